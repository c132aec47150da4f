"""FlexAttention with a custom mask mod under FULL CUDA graphs: the per-layer block-mask rebuild in ``forward`` is captured with the dummy batch's max_seq_len, so every replay truncates the KV blocks to the first page.

Upstream: https://github.com/vllm-project/vllm/pull/45232 ("[FlexAttention] make custom mask mods fully cudagraphable",
liangel-02, opened 2026-06-11, merged 2026-06-17; follow-up of #37692 (custom mask mods) after #36298 (FULL cudagraph
support for flex attention); downstream user pytorch/torchtitan#3633).
Symptom: with ``attention_backend=FLEX_ATTENTION``, ``cudagraph_mode=FULL`` and a custom ``logical_mask_mod`` on the
attention layers (the PR's test: a windowed-causal mask, window 4, Qwen2.5-1.5B, capture size 4), the logprobs of
replayed decode steps differ from eager (``enforce_eager``), which is correct. Only FULL graphs are affected.
Mechanism: since #36298 ``FlexAttentionMetadataBuilder`` is ``AttentionCGSupport.ALWAYS``: ``build()`` (run eagerly
before every replay) builds the block mask with ``FlexAttentionMetadata._build_block_mask_direct`` and copies its
``kv_indices`` / ``kv_num_blocks`` into the builder's persistent buffers, which the captured ``flex_attention``
kernel reads. But ``build()`` always put ``logical_mask_mod=causal_mask_mod`` and ``sliding_window=None`` in the
metadata; the layer's own mask came in later, in ``FlexAttentionImpl.forward``: ``if layer_mask_mod is not None and
attn_metadata.logical_mask_mod is not layer_mask_mod: attn_metadata.logical_mask_mod = layer_mask_mod;
attn_metadata.mask_mod = attn_metadata.get_mask_mod(); needs_rebuild_block_mask = True`` (likewise for
``sliding_window``), then ``attn_metadata.block_mask = attn_metadata._build_block_mask_direct()``. Under FULL graphs
that Python ran once, inside the capture, on the capture's dummy metadata: ``build_for_cudagraph_capture`` sets
``max_seq_len`` to the dummy batch's ``seq_lens`` (= max_query_len, 1 for a decode capture), so the rebuild's
``used_pages = self.block_table[self.doc_ids, :cdiv(self.max_seq_len, self.block_size)]`` was recorded with one
logical page. Every replay re-runs those kernels after ``build()``: they overwrite ``persistent_kv_indices`` /
``persistent_kv_num_blocks`` with the first page of each request only, so attention skips every later KV block (a
windowed decode query then sees no key at all). Eager re-decides per step with the step's own ``max_seq_len``.
Doctor: host-work-frozen, at build (the host work of the mask decision -- the attribute assignments on the
metadata and the page count ``cdiv(max_seq_len, block_size)`` of the block-mask rebuild -- ran once inside the
captured forward because ``build()`` left the layer's mask mod out of the metadata; replays repeat only the
rebuild's kernels, with the capture-time page count).
Fix (upstream): ``FlexAttentionMetadataBuilder.__init__`` reads the layers' ``logical_mask_mod`` when
``_uses_full_cudagraphs()`` (``_maybe_get_custom_mask_mod``, raising "cannot use alternating mask mods w/ full CUDA
graphs" when layers disagree) and ``build()`` puts it, and ``kv_cache_spec.sliding_window``, into the metadata, so
the block mask is built with them before replay and ``forward``'s check no longer fires inside the graph.
Modelled: a 2-layer decoder (embedding + learned positions, one fused qkv projection, flex attention, o_proj,
residual, lm_head), float32, 2 query heads over 1 KV head (head_dim 8), KV page = kv_block_size = q_block_size = 4,
windowed-causal custom mask (window 4) on both layers, max_model_len 32. The flex kernel is a dense torch routine
that honours the block mask as the Triton kernel does: per query group it visits the first ``kv_num_blocks``
entries of its ``kv_indices`` row (read through the row stride, as the kernel's pointer arithmetic does) and applies
``mask_mod`` inside them; a row with no visible key gives 0. The vLLM runner is reduced to: FULL capture at size 4
(one NONE-mode warmup dummy run, then the capture dummy run, each with fresh metadata from
``build_for_cudagraph_capture``), a 4-request prefill of 40 tokens run eagerly (larger than any capture size), and
three replayed decode steps. The forward context, ``get_layers_from_vllm_config`` and the configs are small stand-ins;
score mods, sliding-window specs, mm prefix ranges and block-sparsity hints are left out of the model (the
``sliding_window`` branch is kept in ``forward`` and ``build``).
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from workbench.engine import events, graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/45232"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "build"
SYMPTOM = ("FlexAttention + custom mask mod + FULL cudagraph: the block-mask rebuild in forward is replayed with "
           "the capture dummy batch's max_seq_len, so decode attends only to the first KV page (logprobs differ "
           "from eager)")

VOCAB, HIDDEN = 32, 16
NUM_LAYERS = 2
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 8
BLOCK_SIZE = 4                  # KV cache page = kv_block_size (direct build)
Q_BLOCK_SIZE = 4
WINDOW = 4                      # the PR test's windowed-causal mask
MAX_MODEL_LEN = 32
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 64
MAX_PAGES_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
NUM_GPU_BLOCKS = 1 + MAX_NUM_SEQS * MAX_PAGES_PER_SEQ     # block 0: the null block
CAPTURE_SIZES = [4]
VARIANT = {"v": "bug"}


def cdiv(a, b):
    return -(a // -b)


# --- vllm.forward_context -----------------------------------------------------------------------------

_forward_context: list = [None]


def get_forward_context():
    return _forward_context[0]


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    prev, _forward_context[0] = _forward_context[0], SimpleNamespace(attn_metadata=attn_metadata)
    try:
        yield
    finally:
        _forward_context[0] = prev


# --- torch.nn.attention.flex_attention (the parts vLLM uses) -------------------------------------------

class BlockMask:
    def __init__(self, seq_lengths, kv_num_blocks, kv_indices, BLOCK_SIZE, mask_mod):
        self.seq_lengths, self.kv_num_blocks, self.kv_indices = seq_lengths, kv_num_blocks, kv_indices
        self.BLOCK_SIZE, self.mask_mod = BLOCK_SIZE, mask_mod

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                       BLOCK_SIZE=(128, 128), mask_mod=None, seq_lengths=None, compute_q_blocks=True):
        return cls(seq_lengths, kv_num_blocks, kv_indices, BLOCK_SIZE, mask_mod)


def and_masks(*mods):
    def mask(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out
    return mask


def flex_attention_compiled(query, key, value, score_mod, block_mask, scale, enable_gqa=False, kernel_options=None):
    """The flex kernel: [1, H, Q, D] x [1, Hkv, KV, D]. Query group g = q // BLOCK_M visits the first
    ``kv_num_blocks[g]`` physical blocks of row g of ``kv_indices`` (a pointer and a row stride, as in the Triton
    kernel) and applies ``mask_mod`` elementwise inside them."""
    q_len, kv_len = query.shape[2], key.shape[2]
    block_m, block_n = block_mask.BLOCK_SIZE
    kv_num_blocks = block_mask.kv_num_blocks[0, 0]                         # [G]
    kv_indices = block_mask.kv_indices[0, 0]                               # [G, W] view of a persistent buffer
    groups, row = kv_num_blocks.shape[0], kv_indices.stride(0)
    rows = kv_indices.as_strided((groups, row), (row, 1), kv_indices.storage_offset())
    visited = torch.arange(row, device=query.device)[None, :] < kv_num_blocks[:, None]
    num_kv_blocks = kv_len // block_n
    idx = torch.where(visited, rows, num_kv_blocks).long()
    block_ok = torch.zeros(groups, num_kv_blocks + 1, dtype=torch.bool, device=query.device)
    block_ok.scatter_(1, idx, True)
    q_idx = torch.arange(q_len, device=query.device)
    kv_idx = torch.arange(kv_len, device=query.device)
    allowed = block_ok[q_idx // block_m][:, kv_idx // block_n]                                   # [Q, KV]
    allowed = allowed & block_mask.mask_mod(None, None, q_idx[:, None], kv_idx[None, :])
    if enable_gqa:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", query, key) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m) * allowed
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.einsum("bhqk,bhkd->bhqd", p, value)


# --- vllm/v1/attention/backends/flex_attention.py ------------------------------------------------------

def _offsets_to_doc_ids_tensor(offsets_cpu, device):
    # Built on the host (no GPU->CPU sync for repeat_interleave's output length), then uploaded.
    counts = offsets_cpu[1:] - offsets_cpu[:-1]
    doc_ids = torch.repeat_interleave(counts).to(torch.int32)       # = repeat_interleave(arange(len), counts)
    return doc_ids.to(device, non_blocking=True)


def pad_to_multiple(x, multiple, dim):
    difference = (multiple - (x.shape[dim] % multiple)) % multiple
    if difference == 0:
        return x
    pad = [0, 0] * (x.ndim - 1 - dim) + [0, difference]
    return torch.nn.functional.pad(x, pad, mode="constant", value=0)


def physical_to_logical_mapping(block_table, seq_lens, block_size, total_blocks):
    max_reqs, max_num_blocks = block_table.shape
    device = block_table.device
    physical_to_logical = torch.full((max_reqs, total_blocks), -1, dtype=torch.long, device=device)
    num_blocks_per_seq = cdiv(seq_lens, block_size)
    mask = torch.arange(max_num_blocks, device=device)[None, :] < num_blocks_per_seq[:, None]
    valid_block_table = torch.where(mask, block_table, 0)
    valid_logical_indices = torch.where(mask, torch.arange(max_num_blocks, device=device)[None, :], 0)
    physical_to_logical.scatter_reduce_(-1, valid_block_table.to(torch.int64), valid_logical_indices, reduce="amax")
    physical_to_logical[:, 0] = -1
    return physical_to_logical


def unique_static_unsorted(x, *, M, dim=-1, ignored_val=0, pad_val=-1):
    dim = dim % x.ndim
    x_perm = x.movedim(dim, -1)
    B, N = x_perm.numel() // x_perm.shape[-1], x_perm.shape[-1]
    x_flat = x_perm.reshape(B, N)
    device = x.device
    idx = torch.arange(N, device=device).expand(B, N)
    first_idx = torch.full((B, M + 1), N, device=device)
    first_idx.scatter_reduce_(1, x_flat, idx, reduce="amin")
    keep = (x_flat != ignored_val) & (idx == first_idx.gather(1, x_flat))
    dest_pos = torch.cumsum(keep.to(torch.long), dim=1) - 1
    dest_pos = torch.where(keep, dest_pos, N)
    packed_extended = torch.full((B, N + 1), pad_val, device=device, dtype=x_flat.dtype)
    packed_flat = packed_extended.scatter_(1, dest_pos, x_flat)[:, :N]
    return packed_flat.reshape(x_perm.shape).movedim(-1, dim)


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def windowed_causal_mask_mod(b, h, q_idx, kv_idx):
    """The custom logical mask mod of the PR's test."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


def copy_to_persistent(dst, src):
    sliced = dst[tuple(slice(0, s) for s in src.shape)]
    sliced.copy_(src)
    return sliced


class FlexAttentionMetadata:
    def __init__(self, *, causal, num_actual_tokens, max_query_len, query_start_loc, query_start_loc_cpu,
                 max_seq_len, seq_lens, block_table, slot_mapping, total_cache_tokens, block_size, num_reqs,
                 physical_to_logical, decode_offset, persistent_kv_indices, persistent_kv_num_blocks,
                 persistent_doc_ids, logical_mask_mod=causal_mask_mod, sliding_window=None, direct_build=True,
                 q_block_size=16, kv_block_size=16):
        self.causal, self.num_actual_tokens, self.max_query_len = causal, num_actual_tokens, max_query_len
        self.query_start_loc, self.query_start_loc_cpu = query_start_loc, query_start_loc_cpu
        self.max_seq_len, self.seq_lens, self.block_table, self.slot_mapping = max_seq_len, seq_lens, block_table, slot_mapping
        self.total_cache_tokens, self.block_size, self.num_reqs = total_cache_tokens, block_size, num_reqs
        self.physical_to_logical, self.decode_offset = physical_to_logical, decode_offset
        self.persistent_kv_indices, self.persistent_kv_num_blocks = persistent_kv_indices, persistent_kv_num_blocks
        self.persistent_doc_ids = persistent_doc_ids
        self.logical_mask_mod, self.sliding_window, self.direct_build = logical_mask_mod, sliding_window, direct_build
        self.q_block_size, self.kv_block_size = q_block_size, kv_block_size
        self.block_mask = None
        self.__post_init__()

    def __post_init__(self):
        self.doc_ids = _offsets_to_doc_ids_tensor(self.query_start_loc_cpu, self.query_start_loc.device)
        self.doc_ids = copy_to_persistent(self.persistent_doc_ids, self.doc_ids)
        self.num_blocks = self.total_cache_tokens // self.block_size
        self.mask_mod = self.get_mask_mod()

    @property
    def logical_block_ids(self):
        return torch.arange(cdiv(self.max_seq_len, self.block_size), device=self.block_table.device, dtype=torch.long)

    def _convert_physical_to_logical(self, request_lookup, q_idx, physical_kv_idx):
        q_req = request_lookup[q_idx]
        physical_kv_block = physical_kv_idx // self.block_size
        physical_kv_offset = physical_kv_idx % self.block_size
        logical_block_idx = self.physical_to_logical[q_req, physical_kv_block]
        logical_kv_idx = logical_block_idx * self.block_size + physical_kv_offset
        live_block = logical_block_idx >= 0
        within_upper_bound = logical_kv_idx < self.seq_lens[q_req]
        within_lower_bound = logical_kv_idx >= 0
        is_valid = live_block & within_upper_bound & within_lower_bound
        local_q_idx = q_idx - self.query_start_loc[q_req]
        logical_q_idx = local_q_idx + self.decode_offset[q_req]
        return is_valid, logical_q_idx, logical_kv_idx

    def get_paged_mask_mod(self):
        def final_mask_mod(b, h, q_idx, physical_kv_idx):
            is_valid, logical_q_idx, logical_kv_idx = self._convert_physical_to_logical(
                self.doc_ids, q_idx, physical_kv_idx)
            return is_valid & self.logical_mask_mod(b, h, logical_q_idx, logical_kv_idx)
        return final_mask_mod

    def get_sliding_window_mask_mod(self):
        def final_mask_mod(b, h, q_idx, physical_kv_idx):
            is_valid, logical_q_idx, logical_kv_idx = self._convert_physical_to_logical(
                self.doc_ids, q_idx, physical_kv_idx)
            return is_valid & (torch.abs(logical_q_idx - logical_kv_idx) < self.sliding_window)
        return final_mask_mod

    def get_mask_mod(self):
        mask_mod = self.get_paged_mask_mod()
        if self.sliding_window is not None:
            mask_mod = and_masks(mask_mod, self.get_sliding_window_mask_mod())
        return mask_mod

    def _build_block_mask_direct(self):
        used_pages = self.block_table[self.doc_ids, : cdiv(self.max_seq_len, self.block_size)]
        if self.sliding_window:
            token_indices = torch.arange(self.doc_ids.shape[0], device=used_pages.device, dtype=torch.long)
            logical_q_idx = token_indices - self.query_start_loc[self.doc_ids] + self.decode_offset[self.doc_ids]
            min_kv_idx = torch.clamp(logical_q_idx - (self.sliding_window - 1), min=0)
            sliding_mask = self.logical_block_ids >= (min_kv_idx // self.block_size)[:, None]
            used_pages.masked_fill_(~sliding_mask, 0)
        used_pages_padded = pad_to_multiple(used_pages, multiple=self.q_block_size, dim=0)
        used_pages_padded = used_pages_padded.reshape(used_pages_padded.shape[0] // self.q_block_size, -1)
        kv_indices = unique_static_unsorted(used_pages_padded.long(), M=self.num_blocks).to(torch.int32)
        kv_indices = copy_to_persistent(self.persistent_kv_indices, kv_indices)
        kv_num_blocks = (kv_indices >= 0).sum(dim=-1).to(torch.int32)
        kv_num_blocks = copy_to_persistent(self.persistent_kv_num_blocks, kv_num_blocks)
        return BlockMask.from_kv_blocks(
            seq_lengths=(self.num_actual_tokens, self.total_cache_tokens), kv_num_blocks=kv_num_blocks[None, None],
            kv_indices=kv_indices[None, None], BLOCK_SIZE=(self.q_block_size, self.kv_block_size),
            mask_mod=self.mask_mod, compute_q_blocks=False)


def get_layers_from_vllm_config(vllm_config, layer_type, layer_names):
    ctx = vllm_config.compilation_config.static_forward_context
    return {name: ctx[name] for name in layer_names if isinstance(ctx[name], layer_type)}


class FlexAttentionMetadataBuilder:
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = kv_cache_spec, layer_names, vllm_config, device
        self.block_size = kv_cache_spec.block_size
        self.q_block_size, self.kv_block_size = Q_BLOCK_SIZE, self.block_size
        self.direct_build = True
        self.max_num_query_groups = cdiv(MAX_NUM_BATCHED_TOKENS, self.q_block_size)
        self.max_num_kv_indices = self.q_block_size * cdiv(MAX_MODEL_LEN, self.block_size)
        self.persistent_kv_num_blocks = torch.empty(self.max_num_query_groups, dtype=torch.int32, device=device)
        self.persistent_offset_tensor = torch.empty(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.persistent_doc_ids = torch.empty(MAX_NUM_BATCHED_TOKENS, dtype=torch.int32, device=device)
        self.persistent_physical_to_logical = None
        self.persistent_kv_indices = None
        self.custom_logical_mask_mod = None
        if VARIANT["v"] == "fix" and self._uses_full_cudagraphs():
            layers = get_layers_from_vllm_config(vllm_config, Attention, self.layer_names)
            self.custom_logical_mask_mod = self._maybe_get_custom_mask_mod(layers)

    def _uses_full_cudagraphs(self):
        return self.vllm_config.compilation_config.cudagraph_mode == "FULL"

    def _maybe_get_custom_mask_mod(self, layers):
        mask_mods = {getattr(layer, "logical_mask_mod", None) for layer in layers.values()}
        if len(mask_mods) > 1:
            raise ValueError("cannot use alternating mask mods w/ full CUDA graphs")
        return next(iter(mask_mods), None)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        # #36298: the dummy batch's own max_seq_len (not max_model_len), to avoid recompiling during capture
        common_attn_metadata.max_seq_len = int(common_attn_metadata.seq_lens_cpu_upper_bound.max().item())
        return self.build(0, common_attn_metadata)

    def build(self, common_prefix_len, common_attn_metadata):
        cm = common_attn_metadata
        num_gpu_blocks = self.vllm_config.cache_config.num_gpu_blocks
        total_cache_tokens = num_gpu_blocks * self.block_size
        inverse_block_table = physical_to_logical_mapping(cm.block_table_tensor, cm.seq_lens, self.block_size,
                                                          num_gpu_blocks)
        if self.persistent_physical_to_logical is None:
            self.persistent_physical_to_logical = torch.empty(MAX_NUM_SEQS, num_gpu_blocks, dtype=torch.long,
                                                              device=self.device)
        if self.persistent_kv_indices is None:
            self.persistent_kv_indices = torch.empty(self.max_num_query_groups, self.max_num_kv_indices,
                                                     dtype=torch.int32, device=self.device)
        inverse_block_table = copy_to_persistent(self.persistent_physical_to_logical, inverse_block_table)
        offset_tensor = cm.seq_lens - (cm.query_start_loc[1:] - cm.query_start_loc[:-1])   # num computed tokens
        offset_tensor = copy_to_persistent(self.persistent_offset_tensor, offset_tensor.to(torch.int32))
        logical_mask_mod = causal_mask_mod
        sliding_window = None
        if VARIANT["v"] == "fix" and self._uses_full_cudagraphs():
            if self.custom_logical_mask_mod is not None:
                logical_mask_mod = self.custom_logical_mask_mod
            sliding_window = getattr(self.kv_cache_spec, "sliding_window", None)
        out = FlexAttentionMetadata(
            causal=True, num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc, query_start_loc_cpu=cm.query_start_loc_cpu,
            max_seq_len=cm.max_seq_len, seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping, total_cache_tokens=total_cache_tokens, block_size=self.block_size,
            num_reqs=cm.num_reqs, physical_to_logical=inverse_block_table, decode_offset=offset_tensor,
            persistent_kv_indices=self.persistent_kv_indices, persistent_kv_num_blocks=self.persistent_kv_num_blocks,
            persistent_doc_ids=self.persistent_doc_ids, logical_mask_mod=logical_mask_mod,
            sliding_window=sliding_window, direct_build=self.direct_build, q_block_size=self.q_block_size,
            kv_block_size=self.kv_block_size)
        # Pre-build block_mask so it is ready before CUDA graph capture (#36298).
        if out.block_mask is None:
            out.block_mask = out._build_block_mask_direct()
        return out


class FlexAttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window):
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
        self.sliding_window = sliding_window

    def do_kv_cache_update(self, key, value, kv_cache, slot_mapping):
        key_cache, value_cache = kv_cache.unbind(0)
        key_cache.view(-1, self.num_kv_heads, self.head_size).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, self.num_kv_heads, self.head_size).index_copy_(0, slot_mapping, value)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        num_actual_tokens = attn_metadata.num_actual_tokens
        needs_rebuild_block_mask = False
        if attn_metadata.sliding_window != self.sliding_window:
            attn_metadata.sliding_window = self.sliding_window
            attn_metadata.mask_mod = attn_metadata.get_mask_mod()
            needs_rebuild_block_mask = True
        layer_mask_mod = getattr(layer, "logical_mask_mod", None)
        if layer_mask_mod is not None and attn_metadata.logical_mask_mod is not layer_mask_mod:
            attn_metadata.logical_mask_mod = layer_mask_mod
            attn_metadata.mask_mod = attn_metadata.get_mask_mod()
            needs_rebuild_block_mask = True
        if needs_rebuild_block_mask or attn_metadata.block_mask is None:
            attn_metadata.block_mask = attn_metadata._build_block_mask_direct()

        key_cache, value_cache = kv_cache.unbind(0)
        key_cache = key_cache.view(-1, self.num_kv_heads, self.head_size)
        value_cache = value_cache.view(-1, self.num_kv_heads, self.head_size)
        q, k, v = (x[None].permute(0, 2, 1, 3) for x in (query, key_cache, value_cache))
        q = q[:, :, :num_actual_tokens, :]
        out = flex_attention_compiled(q, k, v, None, attn_metadata.block_mask, self.scale,
                                      enable_gqa=self.num_kv_heads != self.num_heads)
        output[:num_actual_tokens].copy_(out.permute(0, 2, 1, 3).squeeze(0))
        return output


# --- vllm/attention/layer.py (Attention with the #37692 custom mask hook) -------------------------------

class Attention:
    def __init__(self, layer_name, device, logical_mask_mod=None):
        self.layer_name = layer_name
        self.impl = FlexAttentionImpl(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS, sliding_window=None)
        self.logical_mask_mod = logical_mask_mod
        self.kv_cache = torch.zeros(2, NUM_GPU_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device)

    def forward(self, query, key, value):
        attn_metadata = get_forward_context().attn_metadata[self.layer_name]
        output = torch.empty_like(query)
        self.impl.do_kv_cache_update(key, value, self.kv_cache, attn_metadata.slot_mapping)
        return self.impl.forward(self, query, key, value, self.kv_cache, attn_metadata, output)


class DecoderModel:
    def __init__(self, device, gen):
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embed_positions = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device)
        self.layers = []
        for i in range(NUM_LAYERS):
            self.layers.append(SimpleNamespace(
                qkv_proj=randn(HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, gen=gen, device=device,
                               scale=HIDDEN ** -0.5),
                o_proj=randn(NUM_HEADS * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5),
                attn=Attention(f"model.layers.{i}.self_attn.attn", device, logical_mask_mod=windowed_causal_mask_mod)))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=HIDDEN ** -0.5)

    def forward(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        n = h.shape[0]
        for layer in self.layers:
            q, k, v = (h @ layer.qkv_proj).split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM,
                                                   NUM_KV_HEADS * HEAD_DIM], -1)
            o = layer.attn.forward(q.reshape(n, NUM_HEADS, HEAD_DIM), k.reshape(n, NUM_KV_HEADS, HEAD_DIM),
                                   v.reshape(n, NUM_KV_HEADS, HEAD_DIM))
            h = h + o.reshape(n, -1) @ layer.o_proj
        return h @ self.lm_head


# --- vllm/v1/worker/gpu_model_runner.py -----------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, cudagraph_mode):
        self.device = device
        self.model = DecoderModel(device, generator(45232))
        layers = {l.attn.layer_name: l.attn for l in self.model.layers}
        self.vllm_config = SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_mode=cudagraph_mode, static_forward_context=layers),
            cache_config=SimpleNamespace(num_gpu_blocks=NUM_GPU_BLOCKS))
        kv_cache_spec = SimpleNamespace(block_size=BLOCK_SIZE)            # FullAttentionSpec
        self.builder = FlexAttentionMetadataBuilder(kv_cache_spec, list(layers), self.vllm_config, device)
        n = MAX_NUM_BATCHED_TOKENS
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_PAGES_PER_SEQ, dtype=torch.int32, device=device)
        self.cudagraphs = {}

    def _build_attention_metadata(self, query_lens, seq_lens, for_cudagraph_capture=False):
        num_reqs, num_tokens = len(query_lens), sum(query_lens)
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        query_start_loc_cpu = host(qsl, self.device)
        self.query_start_loc[: num_reqs + 1].copy_(query_start_loc_cpu)
        seq_lens_cpu = host(torch.tensor(seq_lens, dtype=torch.int32), self.device)
        self.seq_lens[:num_reqs].copy_(seq_lens_cpu)
        cm = SimpleNamespace(
            query_start_loc=self.query_start_loc[: num_reqs + 1], query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=self.seq_lens[:num_reqs], seq_lens_cpu_upper_bound=seq_lens_cpu, max_seq_len=max(seq_lens),
            num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max(query_lens),
            block_table_tensor=self.block_table[:num_reqs], slot_mapping=self.slot_mapping[:num_tokens])
        md = (self.builder.build_for_cudagraph_capture(cm) if for_cudagraph_capture else self.builder.build(0, cm))
        return {name: md for name in self.builder.layer_names}

    def _dummy_run(self, num_tokens, is_graph_capturing=False):
        """A uniform-decode dummy batch: seq_lens = max_query_len = 1, padding slots in the null block."""
        self.input_ids[:num_tokens].zero_()
        self.positions[:num_tokens].zero_()
        self.slot_mapping[:num_tokens].copy_(torch.arange(num_tokens, device=self.device) % BLOCK_SIZE)
        attn_metadata = self._build_attention_metadata([1] * num_tokens, [1] * num_tokens, for_cudagraph_capture=True)
        with set_forward_context(attn_metadata):
            fn = lambda: self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens])  # noqa: E731
            if not is_graph_capturing:
                with events.warmup():
                    fn()
                return
            b = self.builder
            static = {"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                      "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens,
                      "block_table": self.block_table, "persistent_doc_ids": b.persistent_doc_ids,
                      "persistent_offset_tensor": b.persistent_offset_tensor,
                      "persistent_physical_to_logical": b.persistent_physical_to_logical,
                      "persistent_kv_indices": b.persistent_kv_indices,
                      "persistent_kv_num_blocks": b.persistent_kv_num_blocks}
            state = {f"kv_cache.{i}": l.attn.kv_cache for i, l in enumerate(self.model.layers)}
            self.cudagraphs[num_tokens] = capture(fn, device=self.device, pool=self.pool, warmups=0,
                                                  name=f"FULL num_tokens={num_tokens}", static=static, state=state,
                                                  owner="CUDAGraphWrapper")

    def capture_model(self):
        self.pool = graph_pool_handle(self.device)
        for n in reversed(CAPTURE_SIZES):
            self._dummy_run(n)                     # cudagraph_num_of_warmups = 1, runtime mode NONE
            self._dummy_run(n, is_graph_capturing=True)

    def execute_model(self, reqs, token_ids, positions_per_req):
        """reqs: request rows; token_ids / positions_per_req: per request, the tokens scheduled this step."""
        ids = [t for ts in token_ids for t in ts]
        pos = [p for ps in positions_per_req for p in ps]
        n = len(ids)
        self.input_ids[:n].copy_(torch.tensor(ids, device=self.device))
        self.positions[:n].copy_(torch.tensor(pos, device=self.device))
        pos_t = self.positions[:n]
        req_of_tok = torch.tensor([i for i, ps in enumerate(positions_per_req) for _ in ps], device=self.device)
        self.slot_mapping[:n].copy_(self.block_table[req_of_tok, pos_t // BLOCK_SIZE].long() * BLOCK_SIZE
                                    + pos_t % BLOCK_SIZE)
        attn_metadata = self._build_attention_metadata([len(ps) for ps in positions_per_req],
                                                       [ps[-1] + 1 for ps in positions_per_req])
        with set_forward_context(attn_metadata):
            if n in self.cudagraphs:
                g, out = self.cudagraphs[n]
                return replay(g, out).clone()
            return self.model.forward(self.input_ids[:n], self.positions[:n]).clone()


def requests():
    gen = generator(4523)
    lens = [9, 13, 7, 11]
    prompts = [torch.randint(0, VOCAB, (L,), generator=gen).tolist() for L in lens]
    # physical pages interleaved across requests (logical page b of request r -> 1 + r + 4 * b)
    tables = [[1 + r + MAX_NUM_SEQS * b for b in range(MAX_PAGES_PER_SEQ)] for r in range(len(lens))]
    return prompts, tables


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    prompts, tables = requests()
    gen = generator(7)
    decode_tokens = [torch.randint(0, VOCAB, (len(prompts),), generator=gen).tolist() for _ in range(3)]

    def serve(cudagraph_mode):
        runner = GPUModelRunner(device, cudagraph_mode)
        if cudagraph_mode == "FULL":
            runner.capture_model()
        runner.block_table[: len(tables)].copy_(torch.tensor(tables, dtype=torch.int32, device=device))
        outs = []
        lengths = [len(p) for p in prompts]
        logits = runner.execute_model(range(len(prompts)), prompts, [list(range(L)) for L in lengths])  # prefill, eager
        outs.append(logits)
        for step in decode_tokens:                                                    # replayed in FULL mode
            outs.append(runner.execute_model(range(len(prompts)), [[t] for t in step], [[L] for L in lengths]))
            lengths = [L + 1 for L in lengths]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve("FULL"), lambda: serve("NONE"))
