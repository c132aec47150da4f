"""Full-CUDA-graph prefill: stale ``mamba_track_mask`` / ``mamba_track_indices`` rows in the padded request slots land a replay's conv window in an earlier request's prefix-cache checkpoint.

Upstream: https://github.com/sgl-project/sglang/pull/34184 ("Fix stale track rows corrupting conv checkpoints under the
prefill graph", commit 25b701506, Ke Bao, merged 2026-08-10).
Symptom: with the FULL prefill CUDA graph and the radix cache with the mamba extra buffer (Inkling short-conv model),
prefix-cache conv checkpoints of earlier requests are silently overwritten. A later request that hits such a prefix
restores a wrong conv state and produces wrong logits/tokens (the Inkling small NVFP4 deterministic test had to run with
``--disable-prefill-cuda-graph``; the fix removes that flag). Graph-off is correct.
Mechanism: ``python/sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py``. A ``FullCudaGraphBackend`` prefill
graph is captured with a fixed request axis, ``_capture_req_slots`` (``full_prefill_max_req``): ``capture_prepare`` pads
the capture batch with zero-length requests and hands the model the registry slots ``mamba_track_mask`` /
``mamba_track_indices`` sliced to all ``_capture_req_slots`` rows, so the captured
``fused_gather_scatter_to_sconv_cache(hidden_states, sconv_cache, track_conv_indices, mask, dst_indices)``
(``InklingShortConv._prepare_extend_sconv_cache``, the prefix-cache checkpoint write) runs over every request slot.
``PrefillCudaGraphRunner.load_batch`` serves a batch of ``bs < _capture_req_slots`` requests: ``buffer_registry.fill_from``
copies rows ``[:bs]`` of the track slots (these bs-axis slots have no padding reset), and the sentinel-tail block
re-zeroes rows ``[bs:req_slots]`` of ``seq_lens`` / ``extend_*`` / ``req_pool_indices`` / ``orig_seq_lens`` -- but not the
two track slots. Rows ``[bs:req_slots]`` therefore still hold an earlier, larger replay's ``mask=True`` and that
request's checkpoint slot. ``InklingShortConvAttnBackend._refresh_track_conv_indices`` zeroes the padded rows of
``track_conv_indices``, so each stale row gathers token 0 of *this* batch and the captured scatter writes that window
into the earlier request's checkpoint slot. The radix cache still maps that request's prefix to the slot: the next
request that hits it copies the corrupted checkpoint into its working slot (COW ``MambaPool.copy_from``) and prefills
from a wrong conv state. Eager has no padded request slots: its mask has exactly ``bs`` live rows.
Doctor: stale-padding, at load_batch (the padded request rows ``[bs:req_slots]`` of the static ``mamba_track_mask`` /
``mamba_track_indices`` keep what an earlier replay wrote; the captured track scatter reads every request slot, so what
those padded rows hold decides which persistent checkpoint slot this replay writes, and a later request's real rows,
restored from that checkpoint, depend on it; ``load_batch`` is where the fix zeroes those rows).
Fix (upstream): in ``load_batch``'s ``if self._is_full_backend and bs < self._capture_req_slots`` block, also zero
``registry.get_slot(name).buffer[bs:r]`` for ``mamba_track_mask`` and ``mamba_track_indices``: padded rows are masked
off and point at slot 0.
Modelled: one short-conv layer (Inkling has four per decoder layer) between an embedding and an lm_head, one conv
stream, one token bucket (32) and 4 request slots; the graph's output is the next-token logits of every request slot
(``next_token_logits_buffer``). The fused Triton kernels (``causal_conv1d`` with its precomputed ``si``,
``update_sconv_cache``, ``fused_gather_scatter_to_sconv_cache``) are torch gathers/``index_copy_``; the masked scatter
writes back the current contents for masked-off rows. ``MambaRadixCache`` is a dict from token prefixes (at chunk
boundaries) to checkpoint slots; the scheduler tracks a request whenever its extend crosses a chunk boundary. Request
pool index 0 and mamba slot 0 are reserved (padded rows' dummy write target). No attention, positions, LoRA, DP,
chunked-prefix variants, spec decoding; requests leave after prefill and their slots are not recycled. The padded
view handed to ``init_forward_metadata_out_graph`` also carries the bucket's token count (upstream the metadata kernel
covers the bucket). Workload: a bs-4 batch (every request checkpoints its first chunk), a bs-2 batch (request
slots 2..3 padded and stale), then one request that hits request 2's first chunk with a 2-token extend (shorter
than the conv kernel, so its logits read the restored checkpoint).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/34184"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "load_batch"
SYMPTOM = ("FULL prefill CUDA graph: padded request slots keep an earlier replay's mamba_track_mask/indices rows, so the "
           "captured track scatter overwrites an earlier request's conv checkpoint; a later prefix hit prefills from it")

VOCAB, HIDDEN = 32, 8
CONV_KERNEL = 4                      # conv_state_len = CONV_KERNEL - 1
MAMBA_CACHE_CHUNK_SIZE = 4           # mamba_cache_chunk_size(): checkpoint granularity
REQ_POOL_SIZE = 8                    # req_to_token_pool.size == runner max_bs (index 0 reserved)
MAMBA_POOL_SIZE = 16                 # slot 0 reserved: the dummy write target of padded rows
CAPTURE_NUM_TOKENS = [32]            # cuda_graph_config.prefill.bs
FULL_PREFILL_MAX_REQ = 4             # -> _capture_req_slots


# --- sglang/srt/model_executor/forward_batch_info.py ------------------------------------------------------------

class ForwardBatch:
    def __init__(self, *, batch_size, input_ids, req_pool_indices, seq_lens, orig_seq_lens, extend_seq_lens,
                 extend_prefix_lens, extend_start_loc, extend_num_tokens, mamba_track_indices=None,
                 mamba_track_mask=None, mamba_track_seqlens=None, next_token_logits_buffer=None):
        self.batch_size, self.input_ids, self.req_pool_indices = batch_size, input_ids, req_pool_indices
        self.seq_lens, self.orig_seq_lens = seq_lens, orig_seq_lens
        self.extend_seq_lens, self.extend_prefix_lens = extend_seq_lens, extend_prefix_lens
        self.extend_start_loc, self.extend_num_tokens = extend_start_loc, extend_num_tokens
        self.mamba_track_indices, self.mamba_track_mask = mamba_track_indices, mamba_track_mask
        self.mamba_track_seqlens = mamba_track_seqlens
        self.next_token_logits_buffer = next_token_logits_buffer


# --- sglang/srt/mem_cache/memory_pool.py ------------------------------------------------------------------------

class MambaPool:
    def __init__(self, device):
        # conv stream: [n_slots, conv_kernel - 1, conv_dim]
        self.sconv_cache = torch.zeros(MAMBA_POOL_SIZE, CONV_KERNEL - 1, HIDDEN, device=device)
        self._next = 1                                          # slot 0 reserved

    def alloc(self) -> int:
        slot, self._next = self._next, self._next + 1
        return slot

    def copy_from(self, src_indices: torch.Tensor, dst_indices: torch.Tensor):
        """Clone conv state from src slots into dst slots (COW of a radix checkpoint)."""
        self.sconv_cache[dst_indices] = self.sconv_cache[src_indices]


class HybridReqToTokenPool:
    def __init__(self, device):
        self.size = REQ_POOL_SIZE
        self.mamba_pool = MambaPool(device)
        # request pool index -> working mamba slot; unallocated entries (and reserved 0) map to the dummy slot 0
        self.req_index_to_mamba_index_mapping = torch.zeros(REQ_POOL_SIZE, dtype=torch.int64, device=device)
        self._next = 1

    def alloc(self) -> tuple[int, int]:
        idx, self._next = self._next, self._next + 1
        slot = self.mamba_pool.alloc()
        self.req_index_to_mamba_index_mapping[idx] = slot
        return idx, slot


# --- sglang/srt/mem_cache/mamba_radix_cache.py (prefix -> conv checkpoint slot) ---------------------------------

class MambaRadixCache:
    def __init__(self):
        self._nodes: dict[tuple, int] = {}

    def match_prefix(self, tokens: list[int]) -> tuple[int, Optional[int]]:
        best = (0, None)
        for key, slot in self._nodes.items():
            if len(key) > best[0] and tuple(tokens[:len(key)]) == key and len(key) < len(tokens):
                best = (len(key), slot)
        return best

    def insert(self, tokens: list[int], mamba_value: int) -> None:
        self._nodes[tuple(tokens)] = mamba_value


# --- sglang/srt/model_executor/cuda_graph_buffer_registry.py ----------------------------------------------------

class GraphSlot:
    def __init__(self, name: str, axis: str, dtype: torch.dtype, zero_padding: bool = False):
        self.name, self.axis, self.dtype = name, axis, dtype     # axis: "bs" or "tokens"
        self.zero_padding = zero_padding    # PaddingPolicy.ZERO (else FOREACH_COPY: the tail is left as it was)
        self.buffer: Optional[torch.Tensor] = None

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        return self.buffer[: padded_bs if self.axis == "bs" else padded_num_tokens]


class CudaGraphBufferRegistry:
    def __init__(self, device, max_bs: int, max_num_tokens: int):
        self.device, self.max_bs, self.max_num_tokens = device, max_bs, max_num_tokens
        self._slots: dict[str, GraphSlot] = {}

    def register_slot(self, slot: GraphSlot) -> None:
        n = self.max_bs if slot.axis == "bs" else self.max_num_tokens
        slot.buffer = torch.zeros(n, dtype=slot.dtype, device=self.device)
        self._slots[slot.name] = slot

    def has_slot(self, name: str) -> bool:
        return name in self._slots

    def get_slot(self, name: str) -> GraphSlot:
        return self._slots[name]

    def fill_from(self, forward_batch, *, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens) -> None:
        for slot in self._slots.values():                       # phase 1: reset padded tails (ZERO policy only)
            raw_n, padded_n = (raw_bs, padded_bs) if slot.axis == "bs" else (raw_num_tokens, padded_num_tokens)
            if slot.zero_padding and raw_n < padded_n:
                slot.buffer[raw_n:padded_n].zero_()
        for slot in self._slots.values():                       # phase 2: copy the heads from the batch
            src = getattr(forward_batch, slot.name, None)
            if src is None:
                continue
            raw_n = raw_bs if slot.axis == "bs" else raw_num_tokens
            slot.buffer[:raw_n].copy_(src)


def build_prefill_registry(*, device, max_bs, max_num_token, enable_mamba_track) -> CudaGraphBufferRegistry:
    """``mamba_track_*`` are bs-axis copies with no padding reset (bs is not padded on this path)."""
    reg = CudaGraphBufferRegistry(device, max_bs, max_num_token)
    reg.register_slot(GraphSlot("input_ids", "tokens", torch.int64, zero_padding=True))
    if enable_mamba_track:
        reg.register_slot(GraphSlot("mamba_track_indices", "bs", torch.int64))
        reg.register_slot(GraphSlot("mamba_track_mask", "bs", torch.bool))
        reg.register_slot(GraphSlot("mamba_track_seqlens", "bs", torch.int64))
    return reg


# --- sglang/srt/layers/attention/linear/inkling_sconv_backend.py ------------------------------------------------

class InklingShortConvMetadata:
    def __init__(self):
        self.cache_indices: Optional[torch.Tensor] = None
        self.query_start_loc: Optional[torch.Tensor] = None
        self.has_initial_state: Optional[torch.Tensor] = None
        self.si: Optional[torch.Tensor] = None                  # token -> request row
        self.track_conv_indices: Optional[torch.Tensor] = None


class InklingShortConvAttnBackend:
    def __init__(self, req_to_token_pool: HybridReqToTokenPool, device):
        self.req_to_token_pool = req_to_token_pool
        self.device = device
        self.conv_state_len = CONV_KERNEL - 1
        self.mamba_cache_chunk_size = MAMBA_CACHE_CHUNK_SIZE
        self.sconv_metadata = InklingShortConvMetadata()
        self._alloc_graph_buffers()

    def _alloc_graph_buffers(self):
        """Sized from the configured capture shapes, once, never reallocated."""
        max_bs, max_tokens, dev = self.req_to_token_pool.size, max(CAPTURE_NUM_TOKENS), self.device
        self._graph_bufs = dict(
            query_start_loc=torch.zeros(max_bs + 1, dtype=torch.int64, device=dev),
            has_initial_state=torch.zeros(max_bs, dtype=torch.bool, device=dev),
            si=torch.zeros(max_tokens, dtype=torch.int64, device=dev),
        )
        self._graph_track_conv_indices = torch.zeros((max_bs, self.conv_state_len), dtype=torch.int64, device=dev)
        self._cache_indices_buf = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self._token_arange = torch.arange(max_tokens, device=dev)
        self._track_window_offsets = torch.arange(self.conv_state_len, dtype=torch.int64, device=dev)
        self._track_index_floor = torch.zeros((1,), dtype=torch.int64, device=dev)

    def graph_buffers(self) -> dict:
        return {**{f"sconv.{k}": v for k, v in self._graph_bufs.items()},
                "sconv.track_conv_indices": self._graph_track_conv_indices,
                "sconv.cache_indices": self._cache_indices_buf}

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager path: nothing downstream is captured, so kernels may allocate."""
        self._prepare_slot_indices(forward_batch, on_graph_path=False)
        self._refresh_extend_metadata(forward_batch, on_graph_path=False)
        self._refresh_track_conv_indices(forward_batch, on_graph_path=False)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        """Full-cuda-graph prefill records no metadata hook: prep runs before every replay, into static buffers."""
        del in_capture
        self._prepare_slot_indices(forward_batch, on_graph_path=True)
        self._refresh_extend_metadata(forward_batch, on_graph_path=True)
        self._refresh_track_conv_indices(forward_batch, on_graph_path=True)

    def _prepare_slot_indices(self, forward_batch: ForwardBatch, on_graph_path: bool):
        self.sconv_metadata = InklingShortConvMetadata()        # _reset_step_state
        req_pool_indices = forward_batch.req_pool_indices
        mapping = self.req_to_token_pool.req_index_to_mamba_index_mapping
        if on_graph_path:
            n = req_pool_indices.shape[0]
            torch.index_select(mapping, 0, req_pool_indices, out=self._cache_indices_buf[:n])
            self.sconv_metadata.cache_indices = self._cache_indices_buf[:n]
        else:
            self.sconv_metadata.cache_indices = torch.index_select(mapping, 0, req_pool_indices)

    def _refresh_extend_metadata(self, forward_batch: ForwardBatch, on_graph_path: bool):
        B, T = forward_batch.batch_size, forward_batch.extend_num_tokens
        ext = forward_batch.extend_seq_lens[:B].to(torch.int64)
        qsl = torch.cat([ext.new_zeros(1), torch.cumsum(ext, 0)])
        his = (forward_batch.seq_lens[:B] - forward_batch.extend_seq_lens[:B]) > 0
        si = torch.searchsorted(qsl[1:].contiguous(), self._token_arange[:T], right=True).clamp(max=B - 1)
        md = self.sconv_metadata
        if on_graph_path:
            bufs = self._graph_bufs
            md.query_start_loc = bufs["query_start_loc"][: B + 1].copy_(qsl)
            md.has_initial_state = bufs["has_initial_state"][:B].copy_(his)
            md.si = bufs["si"][:T].copy_(si)
        else:
            md.query_start_loc, md.has_initial_state, md.si = qsl, his, si

    def _refresh_track_conv_indices(self, forward_batch: ForwardBatch, on_graph_path: bool):
        """Input positions of the conv windows to snapshot for prefix caching: the last ``conv_kernel - 1`` tokens
        up to the last complete ``mamba_cache_chunk_size`` boundary. The padded tail is ZEROED, not left stale."""
        if forward_batch.mamba_track_mask is None:
            self.sconv_metadata.track_conv_indices = None
            return
        rows = forward_batch.batch_size
        query_start_loc = self.sconv_metadata.query_start_loc
        live = min(rows, forward_batch.mamba_track_seqlens.shape[0], forward_batch.extend_prefix_lens.shape[0])
        lens_to_track = forward_batch.mamba_track_seqlens[:live] - forward_batch.extend_prefix_lens[:live]
        chunk_aligned = (lens_to_track // self.mamba_cache_chunk_size) * self.mamba_cache_chunk_size
        start_indices = query_start_loc[:live] + chunk_aligned - self.conv_state_len
        if on_graph_path:
            out = self._graph_track_conv_indices[:rows]
        else:
            out = torch.empty((rows, self.conv_state_len), dtype=torch.int64, device=start_indices.device)
        torch.add(start_indices.unsqueeze(-1).to(torch.int64), self._track_window_offsets, out=out[:live])
        torch.clamp(out[:live], min=self._track_index_floor, max=query_start_loc[-1:].to(torch.int64) - 1,
                    out=out[:live])
        if live < rows:
            out[live:].zero_()
        self.sconv_metadata.track_conv_indices = out


# --- sglang/srt/models/inkling_common/sconv.py (torch forms of the fused kernels) ----------------------------------

def fused_gather_scatter_to_sconv_cache(hidden_states, sconv_cache, track_conv_indices, mask, dst_indices):
    """For each batch row b with mask[b], copy the W-1 token rows track_conv_indices[b] into sconv_cache[dst[b]]."""
    B = mask.shape[0]
    current = sconv_cache[dst_indices]                                           # masked-off rows: written back
    gathered = hidden_states[track_conv_indices]                                 # [B, W-1, D]
    sconv_cache.index_copy_(0, dst_indices, torch.where(mask.view(B, 1, 1), gathered, current))


def _window(x, sconv_cache, positions, seq_start, slot, has_init):
    """Inputs at ``positions`` [N, K] of sequences starting at ``seq_start`` [N]: tokens inside the sequence, the
    initial conv state (slot, if it has one) before it, else zeros."""
    w1 = sconv_cache.shape[1]
    in_seq = positions >= seq_start.unsqueeze(1)
    xs = x[positions.clamp(min=0)]
    state_pos = (positions - seq_start.unsqueeze(1) + w1).clamp(0, w1 - 1)
    st = sconv_cache[slot.unsqueeze(1), state_pos] * has_init.view(-1, 1, 1).to(x.dtype)
    return torch.where(in_seq.unsqueeze(-1), xs, st)


def causal_conv1d(x, weight, sconv_cache, cache_indices, has_initial_state, query_start_loc, si, token_arange):
    w = weight.shape[1]
    pos = token_arange.unsqueeze(1) - (w - 1) + torch.arange(w, device=x.device).unsqueeze(0)
    win = _window(x, sconv_cache, pos, query_start_loc[si], cache_indices[si], has_initial_state[si])   # [T, W, D]
    return F.silu((win * weight.t().unsqueeze(0)).sum(1))


def update_sconv_cache(x, sconv_cache, cache_indices, has_initial_state, query_start_loc):
    w1 = sconv_cache.shape[1]
    ends = query_start_loc[1:]
    pos = ends.unsqueeze(1) - w1 + torch.arange(w1, device=x.device).unsqueeze(0)
    new_state = _window(x, sconv_cache, pos, query_start_loc[:-1], cache_indices, has_initial_state)
    sconv_cache.index_copy_(0, cache_indices, new_state)


class InklingShortConv(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.weight = randn(HIDDEN, CONV_KERNEL, gen=gen, device=device, scale=0.7)    # [d, w]

    def _prepare_extend_sconv_cache(self, forward_batch, sconv_cache, hidden_states, track_conv_indices):
        if track_conv_indices is not None:
            fused_gather_scatter_to_sconv_cache(hidden_states=hidden_states, sconv_cache=sconv_cache,
                                                track_conv_indices=track_conv_indices,
                                                mask=forward_batch.mamba_track_mask,
                                                dst_indices=forward_batch.mamba_track_indices)

    def forward(self, hidden_states, forward_batch, backend):
        meta = backend.sconv_metadata
        sconv_cache = backend.req_to_token_pool.mamba_pool.sconv_cache
        self._prepare_extend_sconv_cache(forward_batch, sconv_cache, hidden_states, meta.track_conv_indices)
        y = causal_conv1d(hidden_states, self.weight, sconv_cache, meta.cache_indices, meta.has_initial_state,
                          meta.query_start_loc, meta.si, backend._token_arange[: hidden_states.shape[0]])
        update_sconv_cache(hidden_states, sconv_cache, meta.cache_indices, meta.has_initial_state,
                           meta.query_start_loc)
        return hidden_states + y                                                       # use_residual


class InklingForCausalLM(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.sconv = InklingShortConv(gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, forward_batch: ForwardBatch, backend) -> torch.Tensor:
        h = self.embed_tokens[forward_batch.input_ids]
        h = self.sconv(h, forward_batch, backend)
        last = backend.sconv_metadata.query_start_loc[1:] - 1                        # one row per request slot
        logits = h[last.clamp(min=0)] @ self.lm_head
        if forward_batch.next_token_logits_buffer is not None:
            return forward_batch.next_token_logits_buffer.copy_(logits)
        return logits


# --- sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py ----------------------------------------------

_PREFILL_STATIC_FIELDS = ("seq_lens", "extend_seq_lens", "extend_prefix_lens", "extend_start_loc",
                          "req_pool_indices", "orig_seq_lens")


class PrefillCudaGraphRunner:
    """FullCudaGraphBackend prefill: a fixed request axis (``_capture_req_slots``) per token bucket."""

    def __init__(self, model, backend, device, variant):
        self.model, self.backend, self.device, self.variant = model, backend, device, variant
        self.capture_num_tokens = sorted(CAPTURE_NUM_TOKENS)
        self.max_num_tokens = max(self.capture_num_tokens)
        self.max_bs = backend.req_to_token_pool.size
        self._is_full_backend = True
        self._capture_req_slots = FULL_PREFILL_MAX_REQ
        self.mamba_track_enabled = True          # enable_mamba_extra_buffer() and not disable_radix_cache
        self.buffer_registry = build_prefill_registry(device=device, max_bs=self.max_bs,
                                                      max_num_token=self.max_num_tokens,
                                                      enable_mamba_track=self.mamba_track_enabled)
        self._prefill_static_buffers = {name: torch.zeros(self.max_bs, dtype=torch.int64, device=device)
                                        for name in _PREFILL_STATIC_FIELDS}
        self.next_token_logits_buffer = torch.zeros(self.max_bs, VOCAB, device=device)
        self.graphs: dict[int, tuple] = {}
        self.raw_num_tokens = self.raw_bs = 0
        self.capture()

    def _static_announced(self) -> dict:
        static = {name: slot.buffer for name, slot in self.buffer_registry._slots.items()}
        static.update({f"static.{k}": v for k, v in self._prefill_static_buffers.items()})
        static.update(self.backend.graph_buffers())
        return static

    @staticmethod
    def _pad_to_bucket(num_tokens, buckets):
        return next(b for b in buckets if b >= num_tokens)

    def capture_prepare(self, num_tokens: int) -> ForwardBatch:
        capture_seq_lens = [num_tokens]
        # Full captures a fixed request-axis shape; unused slots are zero-length sentinels.
        capture_seq_lens += [0] * (self._capture_req_slots - len(capture_seq_lens))
        bs = len(capture_seq_lens)
        starts = [0]
        for n in capture_seq_lens[:-1]:
            starts.append(starts[-1] + n)
        s = self._prefill_static_buffers
        s["seq_lens"][:bs].copy_(torch.tensor(capture_seq_lens))
        s["extend_seq_lens"][:bs].copy_(torch.tensor(capture_seq_lens))
        s["extend_prefix_lens"][:bs].zero_()
        s["extend_start_loc"][:bs].copy_(torch.tensor(starts))
        s["req_pool_indices"][:bs].copy_(torch.arange(bs))
        s["orig_seq_lens"][:bs].copy_(torch.tensor(capture_seq_lens))
        registry = self.buffer_registry

        def _slot(name):
            return registry.get_slot(name).slice_for(bs, num_tokens)

        return ForwardBatch(
            batch_size=bs, input_ids=_slot("input_ids"), req_pool_indices=s["req_pool_indices"][:bs],
            seq_lens=s["seq_lens"][:bs], orig_seq_lens=s["orig_seq_lens"][:bs],
            extend_seq_lens=s["extend_seq_lens"][:bs], extend_prefix_lens=s["extend_prefix_lens"][:bs],
            extend_start_loc=s["extend_start_loc"][:bs], extend_num_tokens=num_tokens,
            mamba_track_indices=_slot("mamba_track_indices"), mamba_track_mask=_slot("mamba_track_mask"),
            mamba_track_seqlens=_slot("mamba_track_seqlens"),
            next_token_logits_buffer=self.next_token_logits_buffer[:bs])

    def capture(self) -> None:
        for num_tokens in reversed(self.capture_num_tokens):
            self.capture_one_shape(num_tokens)

    def capture_one_shape(self, num_tokens: int) -> None:
        forward_batch = self.capture_prepare(num_tokens)
        self.backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)

        def run_once():
            return self.model.forward(forward_batch, self.backend)

        self.graphs[num_tokens] = capture(
            run_once, device=self.device, name=f"full prefill tokens={num_tokens}",
            owner="PrefillCudaGraphRunner", static=self._static_announced(),
            state={"sconv_cache": self.backend.req_to_token_pool.mamba_pool.sconv_cache})

    def load_batch(self, forward_batch: ForwardBatch) -> int:
        """Pad, populate static buffers, and refresh the metadata the captured graph reads."""
        num_tokens = forward_batch.input_ids.shape[0]
        static_num_tokens = self._pad_to_bucket(num_tokens, self.capture_num_tokens)
        self.raw_num_tokens = num_tokens
        bs = forward_batch.batch_size
        self.raw_bs = bs

        self.buffer_registry.fill_from(forward_batch, raw_bs=bs, padded_bs=bs, raw_num_tokens=num_tokens,
                                       padded_num_tokens=static_num_tokens)

        # Under Full, copy serving-time values into the static buffers.
        if self._prefill_static_buffers is not None:
            s = self._prefill_static_buffers
            s["seq_lens"][:bs].copy_(forward_batch.seq_lens)
            s["extend_seq_lens"][:bs].copy_(forward_batch.extend_seq_lens)
            s["extend_prefix_lens"][:bs].copy_(forward_batch.extend_prefix_lens)
            s["extend_start_loc"][:bs].copy_(forward_batch.extend_start_loc)
            s["req_pool_indices"][:bs].copy_(forward_batch.req_pool_indices)
            if forward_batch.orig_seq_lens is not None:
                s["orig_seq_lens"][:bs].copy_(forward_batch.orig_seq_lens)
            if self._is_full_backend and bs < self._capture_req_slots:
                # Sentinel tail for slots [bs:req_slots]: the captured graph reads all req_slots entries, so stale
                # values from the previous replay must be cleared. Zero lengths make the sentinels no-ops.
                r = self._capture_req_slots
                s["seq_lens"][bs:r].zero_()
                s["extend_seq_lens"][bs:r].zero_()
                s["extend_prefix_lens"][bs:r].zero_()
                s["extend_start_loc"][bs:r].fill_(self.raw_num_tokens)
                s["req_pool_indices"][bs:r].zero_()
                s["orig_seq_lens"][bs:r].zero_()
                if self.variant == "fix":                               # PR #34184
                    # The captured track scatter reads these rows too, and a stale mask row still carries a
                    # live destination slot: it would land this replay's window in an earlier request's checkpoint.
                    registry = self.buffer_registry
                    for name in ("mamba_track_mask", "mamba_track_indices"):
                        if registry.has_slot(name):
                            registry.get_slot(name).buffer[bs:r].zero_()

        self._prepare_forward_metadata_for_replay(forward_batch, static_num_tokens)
        return static_num_tokens

    def _prepare_forward_metadata_for_replay(self, forward_batch: ForwardBatch, num_tokens: int) -> None:
        # Slot-padded shallow view: the metadata must see exactly req_slots entries (real values in [:bs],
        # sentinels in [bs:req_slots] already populated above).
        r = self._capture_req_slots
        s = self._prefill_static_buffers
        padded_view = copy.copy(forward_batch)
        padded_view.batch_size = r
        padded_view.seq_lens = s["seq_lens"][:r]
        padded_view.req_pool_indices = s["req_pool_indices"][:r]
        padded_view.extend_seq_lens = s["extend_seq_lens"][:r]
        padded_view.extend_prefix_lens = s["extend_prefix_lens"][:r]
        padded_view.extend_num_tokens = num_tokens
        self.backend.init_forward_metadata_out_graph(padded_view)

    def execute(self, forward_batch: ForwardBatch) -> torch.Tensor:
        static_num_tokens = self.load_batch(forward_batch)
        g, out = self.graphs[static_num_tokens]
        bs, r = self.raw_bs, self._capture_req_slots
        registry = self.buffer_registry
        left = ("mamba_track_seqlens",) if self.variant == "fix" else (
            "mamba_track_mask", "mamba_track_indices", "mamba_track_seqlens")
        padded = {name: registry.get_slot(name).buffer[:r] for name in left}
        logits = replay(g, out, real=bs, size=r, padded=padded)
        return logits[:bs]                                           # _trim_logits_output: raw_bs rows


# --- sglang/srt/managers/schedule_batch.py + model_runner (the serving loop) -------------------------------------

class Req:
    def __init__(self, rid: int, origin_input_ids: list[int]):
        self.rid, self.origin_input_ids = rid, origin_input_ids


class ModelRunner:
    def __init__(self, model, device, variant, enable_prefill_cuda_graph: bool):
        self.model, self.device = model, device
        self.req_to_token_pool = HybridReqToTokenPool(device)
        self.tree_cache = MambaRadixCache()
        self.attn_backend = InklingShortConvAttnBackend(self.req_to_token_pool, device)
        self.prefill_graph_runner = (PrefillCudaGraphRunner(model, self.attn_backend, device, variant)
                                     if enable_prefill_cuda_graph else None)

    def prepare_for_extend(self, reqs: list[Req]):
        """Match prefixes (COW the checkpoint into the request's working slot), allocate, fill track metadata."""
        pool = self.req_to_token_pool
        ids, req_idx, seq, ext, pre, starts, t_idx, t_mask, t_len, inserts = [], [], [], [], [], [], [], [], [], []
        for req in reqs:
            tokens = req.origin_input_ids
            prefix_len, ckpt = self.tree_cache.match_prefix(tokens)
            idx, slot = pool.alloc()
            if ckpt is not None:
                pool.mamba_pool.copy_from(torch.tensor([ckpt], device=self.device),
                                          torch.tensor([slot], device=self.device))
            starts.append(len(ids))
            ids += tokens[prefix_len:]
            aligned = (len(tokens) - prefix_len) // MAMBA_CACHE_CHUNK_SIZE * MAMBA_CACHE_CHUNK_SIZE
            track = aligned > 0
            dst = pool.mamba_pool.alloc() if track else 0
            if track:
                inserts.append((tokens[:prefix_len + aligned], dst))
            req_idx.append(idx)
            seq.append(len(tokens))
            ext.append(len(tokens) - prefix_len)
            pre.append(prefix_len)
            t_idx.append(dst)
            t_mask.append(track)
            t_len.append(len(tokens))
        dev = self.device
        i64 = dict(dtype=torch.int64, device=dev)
        fb = ForwardBatch(
            batch_size=len(reqs), input_ids=torch.tensor(ids, **i64), req_pool_indices=torch.tensor(req_idx, **i64),
            seq_lens=torch.tensor(seq, **i64), orig_seq_lens=torch.tensor(seq, **i64),
            extend_seq_lens=torch.tensor(ext, **i64), extend_prefix_lens=torch.tensor(pre, **i64),
            extend_start_loc=torch.tensor(starts, **i64), extend_num_tokens=len(ids),
            mamba_track_indices=torch.tensor(t_idx, **i64),
            mamba_track_mask=torch.tensor(t_mask, dtype=torch.bool, device=dev),
            mamba_track_seqlens=torch.tensor(t_len, **i64))
        return fb, inserts

    def forward_extend(self, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.prefill_graph_runner is not None and forward_batch.batch_size <= FULL_PREFILL_MAX_REQ:
            return self.prefill_graph_runner.execute(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch, self.attn_backend)

    def run_batch(self, reqs: list[Req]) -> torch.Tensor:
        fb, inserts = self.prepare_for_extend(reqs)
        logits = self.forward_extend(fb).clone()                       # sampled before the next batch
        for tokens, slot in inserts:                                    # cache_unfinished_req: checkpoints
            self.tree_cache.insert(tokens, slot)
        return logits


def run(variant: str, device: str = "cpu"):
    gen = generator(34184)
    model = InklingForCausalLM(gen, device)
    prompts = {n: torch.randint(1, VOCAB, (length,), generator=gen).tolist()
               for n, length in enumerate((7, 9, 6, 5, 5, 6))}
    # Request 6 shares request 2's first chunk (4 tokens): it restores request 2's conv checkpoint.
    prompts[6] = prompts[2][:MAMBA_CACHE_CHUNK_SIZE] + torch.randint(1, VOCAB, (2,), generator=gen).tolist()
    batches = [[0, 1, 2, 3], [4, 5], [6]]                         # bs 4, then 2 (rows 2..3 stale), then 1

    def serve(graphed: bool):
        runner = ModelRunner(model, device, variant, enable_prefill_cuda_graph=graphed)
        return [runner.run_batch([Req(i, prompts[i]) for i in batch]) for batch in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
