"""TurboQuant's QJL sign unpacking builds its powers-of-two constant with ``torch.tensor([...], device=...)`` on every call, so capturing the hybrid decode attention fails.

Upstream: https://github.com/0xSero/turboquant/pull/12 ("fix(quantizer): make _pack/_unpack_qjl_signs CUDA-graph-safe",
AEON-7, description dated 2026-04-24, merged: a pull request against 0xSero/turboquant itself, whatever its
comment "added by turbokv patch" refers to; no separate issue). The fixed
``turboquant/quantizer.py`` was read at ca52d33; the pre-fix lines are in the PR body and in the mirror's main (7ac9b8d).
Symptom: with TurboQuant hooks installed on a vLLM worker (``install_turboquant_hooks``, modes ``capture_only`` and
``hybrid``), start-up fails during CUDA graph capture in ``determine_available_memory()``: "Cannot copy between CPU and
CUDA tensors during CUDA graph capture unless the CPU tensor is pinned". Only ``--enforce-eager`` serves, at a 20-30%
decode-throughput cost.
Mechanism: ``TurboQuantProd._pack_qjl_signs`` and ``TurboQuantProd._unpack_qjl_signs`` (turboquant/quantizer.py)
each ran ``powers = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], device=signs.device, dtype=torch.uint8)`` on every
call: the list is materialised in pageable host memory and copied host-to-device. Eagerly that is a tiny synchronous
copy. In hybrid mode the patched attention ``forward`` (turboquant/integration/vllm.py, ``_make_patched_forward``)
serves a decode step through ``compute_hybrid_attention`` -> ``_attend_hybrid`` -> ``quantizer.dequantize(flat.prod_q)``
-> ``_unpack_qjl_signs``, i.e. inside the captured decode forward; a capturing stream refuses the pageable copy
(cudaErrorStreamCaptureUnsupported), and the capture, hence start-up, fails. (In ``capture_only`` mode the same
refusal would come from ``_pack_qjl_signs``, reached when ``KVCaptureEngine`` ingestion of a capture run's K/V
overflows the ring into ``CompressedKVStore.append_chunk`` -> ``quantize``.)
Doctor: sync-in-capture, at _unpack_qjl_signs (its ``torch.tensor(..., device=...)`` upload of Python data runs
inside the captured decode attention: a host-to-device copy of pageable memory that a capture cannot record).
Fix (upstream): a module-level per-device cache, ``_POWERS_CACHE`` and ``_qjl_powers(device)``, which makes the
constant once (``torch.tensor([...], dtype=torch.uint8, pin_memory=False).to(device)``) at the first, eager, call
(prefill compression, the warmup run) and returns the same device tensor afterwards; both ``_pack_qjl_signs`` and
``_unpack_qjl_signs`` use ``_qjl_powers(...)``. The captured kernels then read that cached tensor at a stable address.
Modelled: one attention layer (hidden 32 -> 2 query heads over 1 KV head, head_dim 32), float32 throughout (upstream's
ring is bf16), hybrid mode. TurboQuant keys at 3 bits (2-bit MSE stage + 1-bit QJL), values 2-bit group-quantized;
the Beta-distribution Lloyd-Max JSON codebooks are replaced by the Gaussian Lloyd-Max table scaled by 1/sqrt(d).
vLLM is cut to a paged-cache ``FlashAttentionImpl`` (prefill only), the two hooks, and a runner that prefills one
24-token prompt eagerly (16 tokens compressed, the last 8 in the exact ring), then warms up and captures a FULL
decode graph of one token and replays it. Upstream vLLM captures at start-up on dummy runs; here the capture follows
the prefill so that replays serve real history. The decode steps' own K/V appends (upstream a Python ring cursor and
lazily re-flattened store, host state that graphs freeze independently of #12) are left out in the eager and the
graphed runs alike: each step attends a new query against the prefilled context.
"""
from __future__ import annotations

import math
import types
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/0xSero/turboquant/pull/12"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_unpack_qjl_signs"
SYMPTOM = ("vLLM start-up with TurboQuant hooks fails in CUDA graph capture: _unpack_qjl_signs copies "
           "torch.tensor([1,2,...,128], device=cuda) from pageable memory inside the captured decode attention")

HIDDEN, HEAD_DIM, NUM_KV_HEADS, NUM_QUERY_HEADS = 32, 32, 1, 2
KEY_BITS, VALUE_BITS, VALUE_GROUP_SIZE = 3, 2, 32
RING_CAPACITY, PROMPT_LEN, DECODE_STEPS, MAX_MODEL_LEN = 8, 24, 4, 32
MIN_HISTORY_FOR_TQ = 16
MODE_OFF, MODE_CAPTURE_ONLY, MODE_HYBRID = "off", "capture_only", "hybrid"
VARIANT = {"v": "bug"}

# Gaussian Lloyd-Max centroids (unit variance); coordinates of a rotated unit vector have variance 1/d.
_LLOYD_MAX = {1: [0.7979], 2: [0.4528, 1.5104], 3: [0.2451, 0.7560, 1.3440, 2.1520]}


# --- turboquant/codebook.py + rotation.py ---------------------------------------------------------------

def get_codebook_tensors(d, bits, device, dtype=torch.float32):
    half = [c / math.sqrt(d) for c in _LLOYD_MAX[bits]]
    centroids = [-c for c in reversed(half)] + half
    inner = [(a + b) / 2 for a, b in zip(centroids[:-1], centroids[1:])]
    return (torch.tensor(centroids, device=device, dtype=dtype),
            torch.tensor([-1.0] + inner + [1.0], device=device, dtype=dtype))


def generate_rotation_matrix(d, device, dtype=torch.float32, seed=42):
    rng = torch.Generator(device="cpu")
    rng.manual_seed(seed)
    G = torch.randn(d, d, generator=rng, dtype=torch.float32)
    Q, R = torch.linalg.qr(G)
    Q = Q * torch.sign(torch.diag(R)).unsqueeze(0)
    return Q.to(device=device, dtype=dtype)


def generate_qjl_matrix(d, device, dtype=torch.float32, seed=12345):
    rng = torch.Generator(device="cpu")
    rng.manual_seed(seed)
    return torch.randn(d, d, generator=rng, dtype=torch.float32).to(device=device, dtype=dtype)


def rotate_forward(x, Pi):
    return torch.matmul(x, Pi.T)


def rotate_backward(y, Pi):
    return torch.matmul(y, Pi)


# --- turboquant/quantizer.py ----------------------------------------------------------------------------

# The fix: a per-device cache of the powers-of-two constant, filled at the first (eager) call.
_POWERS_CACHE: dict[torch.device, torch.Tensor] = {}


def _qjl_powers(device: torch.device) -> torch.Tensor:
    cached = _POWERS_CACHE.get(device)
    if cached is None:
        cached = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, pin_memory=False).to(device)
        _POWERS_CACHE[device] = cached
    return cached


class MSEQuantized(NamedTuple):
    indices: torch.Tensor
    norms: torch.Tensor
    bits: int


class ProdQuantized(NamedTuple):
    mse_indices: torch.Tensor
    qjl_signs: torch.Tensor
    residual_norms: torch.Tensor
    norms: torch.Tensor
    mse_bits: int


def _pack_indices(indices, bits):
    batch_shape = indices.shape[:-1]
    vals_per_byte = {1: 8, 2: 4}.get(bits, 2)
    bits = bits if bits <= 2 else 4
    reshaped = indices.to(torch.uint8).reshape(*batch_shape, -1, vals_per_byte)
    shifts = torch.arange(vals_per_byte, device=indices.device, dtype=torch.uint8) * bits
    return (reshaped << shifts).sum(dim=-1, dtype=torch.uint8)


def _unpack_indices(packed, bits, d):
    batch_shape = packed.shape[:-1]
    vals_per_byte = {1: 8, 2: 4}.get(bits, 2)
    bits = bits if bits <= 2 else 4
    shifts = torch.arange(vals_per_byte, device=packed.device, dtype=torch.uint8) * bits
    unpacked = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*batch_shape, -1)
    return unpacked[..., :d].long()


class TurboQuantMSE(torch.nn.Module):
    def __init__(self, dim, bits=3, device=None, dtype=torch.float32, seed=42):
        super().__init__()
        self.dim, self.bits, self.device = dim, bits, device
        self.register_buffer("Pi", generate_rotation_matrix(dim, device, dtype, seed=seed))
        centroids, boundaries = get_codebook_tensors(dim, bits, device, dtype)
        self.register_buffer("centroids", centroids)
        self.register_buffer("boundaries", boundaries)
        self.register_buffer("decision_boundaries", boundaries[1:-1].contiguous())

    def quantize(self, x):
        norms = x.norm(dim=-1, keepdim=False)
        x_unit = x / (norms.unsqueeze(-1) + 1e-10)
        y = rotate_forward(x_unit.float(), self.Pi)
        indices = torch.searchsorted(self.decision_boundaries, y.contiguous())
        return MSEQuantized(indices=_pack_indices(indices, self.bits), norms=norms, bits=self.bits)

    def dequantize(self, q):
        indices = _unpack_indices(q.indices, q.bits, self.dim)
        x_hat = rotate_backward(self.centroids[indices], self.Pi)
        return x_hat * q.norms.unsqueeze(-1)


class TurboQuantProd(torch.nn.Module):
    """Algorithm 2: MSE quantizer at (b-1) bits, then 1-bit QJL of the residual, plus the residual norm."""

    def __init__(self, dim, bits=3, device=None, dtype=torch.float32, seed=42):
        super().__init__()
        self.dim, self.bits, self.device = dim, bits, device
        self.mse_quantizer = TurboQuantMSE(dim=dim, bits=bits - 1, device=device, dtype=dtype, seed=seed)
        self.register_buffer("S", generate_qjl_matrix(dim, device, dtype, seed=seed + 1000))
        self.qjl_scale = math.sqrt(math.pi / 2.0) / dim

    def _pack_qjl_signs(self, projected):
        """Pack sign bits into uint8 (8 signs per byte)."""
        signs = (projected > 0).to(torch.uint8)
        d = signs.shape[-1]
        if d % 8 != 0:
            signs = F.pad(signs, (0, 8 - d % 8), value=0)
        signs_reshaped = signs.reshape(*signs.shape[:-1], -1, 8)
        if VARIANT["v"] == "bug":
            powers = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], device=signs.device, dtype=torch.uint8)
        else:
            powers = _qjl_powers(signs.device)
        return (signs_reshaped * powers).sum(dim=-1, dtype=torch.uint8)

    def _unpack_qjl_signs(self, packed):
        """Unpack sign bits from uint8 to float {-1, +1}."""
        if VARIANT["v"] == "bug":
            powers = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], device=packed.device, dtype=torch.uint8)
        else:
            powers = _qjl_powers(packed.device)
        unpacked = ((packed.unsqueeze(-1) & powers) > 0).float()
        signs = unpacked.reshape(*packed.shape[:-1], -1)[..., :self.dim]
        return 2.0 * signs - 1.0

    def quantize(self, x):
        mse_q = self.mse_quantizer.quantize(x)
        x_hat = self.mse_quantizer.dequantize(mse_q)
        residual = x - x_hat
        residual_norms = residual.norm(dim=-1)
        projected = torch.matmul(residual.float(), self.S.T)
        return ProdQuantized(mse_indices=mse_q.indices, qjl_signs=self._pack_qjl_signs(projected),
                             residual_norms=residual_norms, norms=mse_q.norms, mse_bits=mse_q.bits)

    def dequantize(self, q):
        x_mse = self.mse_quantizer.dequantize(MSEQuantized(indices=q.mse_indices, norms=q.norms, bits=q.mse_bits))
        signs = self._unpack_qjl_signs(q.qjl_signs)
        x_qjl = torch.matmul(signs, self.S) * (self.qjl_scale * q.residual_norms.unsqueeze(-1))
        return x_mse + x_qjl


# --- turboquant/kv_cache.py (values) ------------------------------------------------------------------------

class ValueQuantized(NamedTuple):
    data: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int = 2


def quantize_values(v, bits=2, group_size=32):
    orig_shape, d = v.shape, v.shape[-1]
    n_groups = d // group_size
    v_grouped = v.reshape(*orig_shape[:-1], n_groups, group_size)
    v_min = v_grouped.min(dim=-1, keepdim=True).values
    v_max = v_grouped.max(dim=-1, keepdim=True).values
    n_levels = 2 ** bits - 1
    scale = ((v_max - v_min) / n_levels).clamp(min=1e-10)
    v_q = ((v_grouped - v_min) / scale).round().clamp(0, n_levels).to(torch.uint8).reshape(*orig_shape[:-1], d)
    v_4 = v_q.reshape(*orig_shape[:-1], d // 4, 4)
    packed = v_4[..., 0] | (v_4[..., 1] << 2) | (v_4[..., 2] << 4) | (v_4[..., 3] << 6)
    return ValueQuantized(data=packed, scales=scale.squeeze(-1), zeros=v_min.squeeze(-1), bits=bits)


def unpack_values(vq):
    packed = vq.data
    parts = [packed & 0x03, (packed >> 2) & 0x03, (packed >> 4) & 0x03, (packed >> 6) & 0x03]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def dequantize_values(vq, group_size=32):
    data = unpack_values(vq).float()
    d, batch_shape = data.shape[-1], data.shape[:-1]
    data = data.reshape(*batch_shape, d // group_size, group_size)
    return (data * vq.scales.unsqueeze(-1) + vq.zeros.unsqueeze(-1)).reshape(*batch_shape, d)


# --- turboquant/store.py --------------------------------------------------------------------------------

class FlatCache(NamedTuple):
    prod_q: ProdQuantized
    value_q: ValueQuantized
    num_tokens: int


class CompressedKVStore:
    def __init__(self, head_dim, num_kv_heads, key_bits=3, value_bits=2, value_group_size=32, device=None,
                 layer_idx=0):
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads
        self.value_bits, self.value_group_size = value_bits, min(value_group_size, head_dim)
        self.device = device
        self.quantizer = TurboQuantProd(dim=head_dim, bits=key_bits, device=device, seed=42 + layer_idx * 7)
        self._key_chunks: list[ProdQuantized] = []
        self._value_chunks: list[ValueQuantized] = []
        self._chunk_lengths: list[int] = []
        self._flat: Optional[FlatCache] = None

    @property
    def num_tokens(self):
        return sum(self._chunk_lengths)

    def append_chunk(self, key, value):
        """Quantize and store a chunk of KV pairs; key/value: (chunk_len, num_kv_heads, head_dim)."""
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        self._key_chunks.append(self.quantizer.quantize(k))
        self._value_chunks.append(quantize_values(v, bits=self.value_bits, group_size=self.value_group_size))
        self._chunk_lengths.append(key.shape[0])
        self._flat = None

    def get_flat_cache(self):
        """A flattened view of all compressed tokens, cached until the next write (one chunk here)."""
        if not self._key_chunks:
            return None
        if self._flat is None:
            self._flat = FlatCache(prod_q=_flatten_prod_q(self._key_chunks[0]),
                                   value_q=_flatten_value_q(self._value_chunks[0]), num_tokens=self.num_tokens)
        return self._flat


def _flatten_prod_q(pq):
    return ProdQuantized(
        mse_indices=pq.mse_indices.reshape(-1, pq.mse_indices.shape[-2], pq.mse_indices.shape[-1]).contiguous(),
        qjl_signs=pq.qjl_signs.reshape(-1, pq.qjl_signs.shape[-2], pq.qjl_signs.shape[-1]).contiguous(),
        residual_norms=pq.residual_norms.reshape(-1, pq.residual_norms.shape[-1]).contiguous(),
        norms=pq.norms.reshape(-1, pq.norms.shape[-1]).contiguous(),
        mse_bits=pq.mse_bits)


def _flatten_value_q(vq):
    return ValueQuantized(data=vq.data.reshape(-1, vq.data.shape[-2], vq.data.shape[-1]).contiguous(),
                          scales=vq.scales.reshape(-1, vq.scales.shape[-2], vq.scales.shape[-1]).contiguous(),
                          zeros=vq.zeros.reshape(-1, vq.zeros.shape[-2], vq.zeros.shape[-1]).contiguous(),
                          bits=vq.bits)


# --- turboquant/capture.py ------------------------------------------------------------------------------

class RingBuffer:
    """The most recent ``capacity`` exact tokens."""

    def __init__(self, capacity, num_kv_heads, head_dim, device, dtype=torch.float32):
        self.capacity = capacity
        self._k = torch.zeros(capacity, num_kv_heads, head_dim, device=device, dtype=dtype)
        self._v = torch.zeros(capacity, num_kv_heads, head_dim, device=device, dtype=dtype)
        self._pos = 0

    def write(self, key, value, num_tokens):
        # (single write that fits, as in the prefill here; the overflow drain is left out)
        self._k[self._pos:self._pos + num_tokens] = key[:num_tokens]
        self._v[self._pos:self._pos + num_tokens] = value[:num_tokens]
        self._pos += num_tokens

    def peek(self):
        if self._pos == 0:
            return None
        return self._k[:self._pos], self._v[:self._pos]


class KVCaptureEngine:
    def __init__(self, store, ring_capacity=128, device=None):
        self.store = store
        self.ring = RingBuffer(ring_capacity, store.num_kv_heads, store.head_dim, device)

    def ingest_prefill(self, key, value, num_tokens):
        """Bulk-capture prefill KV: everything but the last ``ring.capacity`` tokens goes to the store."""
        if num_tokens <= self.ring.capacity:
            self.ring.write(key[:num_tokens], value[:num_tokens], num_tokens)
        else:
            n_compress = num_tokens - self.ring.capacity
            self.store.append_chunk(key[:n_compress], value[:n_compress])
            self.ring.write(key[n_compress:num_tokens], value[n_compress:num_tokens], self.ring.capacity)


# --- turboquant/score.py --------------------------------------------------------------------------------

def compute_hybrid_attention(query, store, recent_k, recent_v, num_query_heads, scale=None):
    if scale is None:
        scale = 1.0 / math.sqrt(store.head_dim)
    flat = store.get_flat_cache()
    # (only the both-segments case occurs here; the compressed-only / exact-only branches are left out)
    assert flat is not None and flat.num_tokens >= MIN_HISTORY_FOR_TQ and recent_k is not None
    return _attend_hybrid(query, flat, store.quantizer, recent_k, recent_v, num_query_heads // store.num_kv_heads,
                          store.num_kv_heads, store.head_dim, scale)


def _attend_hybrid(query, flat, quantizer, recent_k, recent_v, gqa_ratio, num_kv_heads, head_dim, scale):
    k_hist = quantizer.dequantize(flat.prod_q)          # (H_kv, N_hist, D)
    v_hist = dequantize_values(flat.value_q, 32)
    k_all = torch.cat([k_hist.float(), recent_k.transpose(0, 1).float()], dim=1)
    v_all = torch.cat([v_hist.float(), recent_v.transpose(0, 1).float()], dim=1)
    return _matmul_attend(query, k_all, v_all, gqa_ratio, num_kv_heads, scale)


def _matmul_attend(query, kv_keys, kv_values, gqa_ratio, num_kv_heads, scale):
    T, Q, D = query.shape
    q = query.float().view(T, num_kv_heads, gqa_ratio, D).permute(1, 2, 0, 3)
    k, v = kv_keys.float().unsqueeze(1), kv_values.float().unsqueeze(1)
    weights = F.softmax(torch.einsum("hgtd,hgnd->hgtn", q, k) * scale, dim=-1)
    out = torch.einsum("hgtn,hgnd->hgtd", weights, v)
    return out.permute(2, 0, 1, 3).reshape(T, Q, D).to(query.dtype)


# --- turboquant/integration/vllm.py ---------------------------------------------------------------------

_GLOBAL_MODE = [MODE_HYBRID]


class LayerState:
    def __init__(self, num_query_heads, store, engine):
        self.num_query_heads, self.store, self.engine = num_query_heads, store, engine


def _make_patched_kv_update(orig_fn, state):
    def patched(self_impl, layer, key, value, kv_cache, slot_mapping):
        orig_fn(self_impl, layer, key, value, kv_cache, slot_mapping)
        if _GLOBAL_MODE[0] == MODE_OFF:
            return
        num_tokens = slot_mapping.shape[0]
        if num_tokens > 1:
            state.engine.ingest_prefill(key, value, num_tokens)
    return patched


def _make_patched_forward(orig_fn, state):
    def patched(self_impl, layer, query, key, value, kv_cache, attn_metadata, output=None):
        mode = _GLOBAL_MODE[0]
        if mode in (MODE_OFF, MODE_CAPTURE_ONLY) or attn_metadata is None or attn_metadata.max_query_len > 1:
            return orig_fn(self_impl, layer, query, key, value, kv_cache, attn_metadata, output)
        # --- hybrid decode ---
        num_actual = attn_metadata.num_actual_tokens
        q = query[:num_actual].view(num_actual, state.num_query_heads, HEAD_DIM)
        recent = state.engine.ring.peek()
        result = compute_hybrid_attention(query=q, store=state.store, recent_k=recent[0], recent_v=recent[1],
                                          num_query_heads=state.num_query_heads, scale=self_impl.scale)
        output[:num_actual].copy_(result.reshape(num_actual, state.num_query_heads * HEAD_DIM).to(output.dtype))
        return output
    return patched


def install_hooks(impl, device, mode=MODE_HYBRID):
    _GLOBAL_MODE[0] = mode
    store = CompressedKVStore(head_dim=HEAD_DIM, num_kv_heads=NUM_KV_HEADS, key_bits=KEY_BITS,
                              value_bits=VALUE_BITS, value_group_size=VALUE_GROUP_SIZE, device=device)
    state = LayerState(NUM_QUERY_HEADS, store, KVCaptureEngine(store, ring_capacity=RING_CAPACITY, device=device))
    impl.do_kv_cache_update = types.MethodType(_make_patched_kv_update(FlashAttentionImpl.do_kv_cache_update, state),
                                               impl)
    impl.forward = types.MethodType(_make_patched_forward(FlashAttentionImpl.forward, state), impl)
    return state


# --- vLLM: the attention backend, the layer and the runner ----------------------------------------------

class AttentionMetadata:
    def __init__(self, num_actual_tokens, max_query_len, seq_len, slot_mapping):
        self.num_actual_tokens, self.max_query_len = num_actual_tokens, max_query_len
        self.seq_len, self.slot_mapping = seq_len, slot_mapping


class FlashAttentionImpl:
    """Exact causal attention over a one-sequence slot cache (the prefill path here)."""

    def __init__(self):
        self.num_heads, self.num_kv_heads, self.scale = NUM_QUERY_HEADS, NUM_KV_HEADS, HEAD_DIM ** -0.5

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        kv_cache[0].index_copy_(0, slot_mapping, key)
        kv_cache[1].index_copy_(0, slot_mapping, value)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        n, seq = attn_metadata.num_actual_tokens, attn_metadata.seq_len
        q = query[:n].view(n, NUM_QUERY_HEADS, HEAD_DIM).transpose(0, 1)
        k = kv_cache[0, :seq].transpose(0, 1).expand(NUM_QUERY_HEADS, seq, HEAD_DIM)
        v = kv_cache[1, :seq].transpose(0, 1).expand(NUM_QUERY_HEADS, seq, HEAD_DIM)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        output[:n].copy_(out.transpose(0, 1).reshape(n, NUM_QUERY_HEADS * HEAD_DIM))
        return output


class Attention:
    def __init__(self, device):
        gen = generator(1212)
        self.q_proj = randn(HIDDEN, NUM_QUERY_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.4)
        self.k_proj = randn(HIDDEN, NUM_KV_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.4)
        self.v_proj = randn(HIDDEN, NUM_KV_HEADS * HEAD_DIM, gen=gen, device=device)
        self.impl = FlashAttentionImpl()
        self.kv_cache = torch.zeros(2, MAX_MODEL_LEN, NUM_KV_HEADS, HEAD_DIM, device=device)

    def prefill(self, hidden_states, attn_metadata, output):
        query = hidden_states @ self.q_proj
        key = (hidden_states @ self.k_proj).view(-1, NUM_KV_HEADS, HEAD_DIM)
        value = (hidden_states @ self.v_proj).view(-1, NUM_KV_HEADS, HEAD_DIM)
        self.impl.do_kv_cache_update(self, key, value, self.kv_cache, attn_metadata.slot_mapping)
        return self.impl.forward(self, query, key, value, self.kv_cache, attn_metadata, output)

    def decode(self, hidden_states, attn_metadata, output):
        query = hidden_states @ self.q_proj
        return self.impl.forward(self, query, None, None, self.kv_cache, attn_metadata, output)


class GPUModelRunner:
    def __init__(self, device):
        self.device = device
        self.attn = Attention(device)
        self.tq_state = install_hooks(self.attn.impl, device, mode=MODE_HYBRID)
        # FULL decode graph buffers: one decode token
        self.hidden_states = torch.zeros(1, HIDDEN, device=device)
        self.output = torch.zeros(1, NUM_QUERY_HEADS * HEAD_DIM, device=device)
        self.decode_metadata = AttentionMetadata(1, 1, PROMPT_LEN + 1, None)
        self.graph = self.graph_output = None

    def execute_prefill(self, prompt_hidden):
        md = AttentionMetadata(PROMPT_LEN, PROMPT_LEN, PROMPT_LEN, torch.arange(PROMPT_LEN, device=self.device))
        out = torch.zeros(PROMPT_LEN, NUM_QUERY_HEADS * HEAD_DIM, device=self.device)
        return self.attn.prefill(prompt_hidden, md, out)

    def _decode_forward(self):
        return self.attn.decode(self.hidden_states, self.decode_metadata, self.output)

    def execute_decode_eager(self, hidden):
        self.hidden_states.copy_(hidden)
        return self._decode_forward().clone()

    def capture_model(self):
        flat = self.tq_state.store.get_flat_cache()
        ring = self.tq_state.engine.ring
        state = {"tq_store.flat.mse_indices": flat.prod_q.mse_indices, "tq_store.flat.qjl_signs": flat.prod_q.qjl_signs,
                 "tq_store.flat.residual_norms": flat.prod_q.residual_norms, "tq_store.flat.norms": flat.prod_q.norms,
                 "tq_store.flat.value_data": flat.value_q.data, "tq_store.flat.value_scales": flat.value_q.scales,
                 "tq_store.flat.value_zeros": flat.value_q.zeros, "tq_ring._k": ring._k, "tq_ring._v": ring._v}
        self.graph, self.graph_output = capture(self._decode_forward, device=self.device, warmups=1,
                                                name="FULL decode bs=1", owner="vLLM CUDAGraphWrapper",
                                                static={"hidden_states": self.hidden_states}, state=state)

    def execute_decode_graph(self, hidden):
        self.hidden_states.copy_(hidden)
        return replay(self.graph, self.graph_output).clone()


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(12)
    prompt = randn(PROMPT_LEN, HIDDEN, gen=gen, device=device)
    decode_hidden = [randn(1, HIDDEN, gen=gen, device=device) for _ in range(DECODE_STEPS)]

    def eager():
        _POWERS_CACHE.clear()                          # a fresh worker process
        runner = GPUModelRunner(device)
        outs = [runner.execute_prefill(prompt).clone()]
        return outs + [runner.execute_decode_eager(h) for h in decode_hidden]

    def served():
        _POWERS_CACHE.clear()
        runner = GPUModelRunner(device)
        outs = [runner.execute_prefill(prompt).clone()]
        runner.capture_model()
        return outs + [runner.execute_decode_graph(h) for h in decode_hidden]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
