"""Inkling's full-CUDA-graph prefill, captured from a batch with no track metadata on specdec, holds no conv-checkpoint scatter: replays never write the prefix-cache conv state that eager writes.

Upstream: https://github.com/sgl-project/sglang/pull/34043 ("[srt] Fix sconv state memory corruption on specdec",
Eric Zhang, commit fc40684b3, merged 2026-08-09; no description). The follow-up
https://github.com/sgl-project/sglang/pull/35042 (2026-08-17) fixes a capture crash in the new inert path
(``extend_prefix_lens`` is None on a capture batch) and is not modelled.
Symptom: Inkling (short-conv) with speculative decoding, the prefill CUDA graph (FULL backend), the radix cache and
the mamba extra buffer: the conv-state checkpoints of the prefix cache are never written by graphed prefills. A later
request that hits such a prefix restores whatever its checkpoint slot held (here the pool's zeros, in serving an
earlier user's state) as its initial conv state and produces wrong logits. With ``--disable-prefill-cuda-graph``
the restored state is right.
Mechanism: ``PrefillCudaGraphRunner._is_mamba_track_enabled`` (model_executor/runner/prefill_cuda_graph_runner.py)
returned False whenever ``spec_algorithm`` was not NONE, so the prefill graph's buffer registry had no
``mamba_track_mask`` / ``mamba_track_indices`` / ``mamba_track_seqlens`` slots and ``capture_prepare`` built the
capture batch with ``mamba_track_mask=None``. At capture, ``init_forward_metadata_out_graph`` ->
``InklingShortConvAttnBackend._refresh_track_conv_indices`` (layers/attention/linear/inkling_sconv_backend.py)
returned early on ``mamba_track_mask is None`` and left ``sconv_metadata.track_conv_indices`` None, so the model's
``InklingShortConv._prepare_extend_sconv_cache`` (models/inkling_common/sconv.py) took the Python branch
``if track_conv_indices is not None`` the "no" way: the graph holds no ``fused_gather_scatter_to_sconv_cache``.
Live prefill batches do carry a track mask (``ScheduleBatch`` builds it whenever the extra buffer is on, with or
without specdec), and ``can_run_graph`` does not look at it: at every replay ``_prepare_forward_metadata_for_replay``
runs ``_refresh_track_conv_indices`` again on the live batch and now resolves real track rows, but the replayed
kernels never scatter them into ``sconv_cache[mamba_track_indices]``. An eager prefill takes the branch per batch and
writes every checkpoint.
Doctor: warmup-divergence, at _refresh_track_conv_indices (the track metadata it resolved at capture, None because
the capture batch carried no track mask, made the forward's Python branch leave the checkpoint scatter out of the
graph; every replay reuses that decision, while the same function resolves real track rows for each live batch and
an eager step with them scatters the conv windows into the checkpoint slots; ``_is_mamba_track_enabled`` is why the
capture batch carried no mask on specdec).
Fix (upstream): ``_refresh_track_conv_indices`` no longer returns on a graph path when the batch has no track
metadata: it points the batch at persistent all-False ``_graph_track_inert_*`` buffers (allocated in
``_alloc_graph_buffers``), so a capture still launches the track scatter (all rows masked off); off the graph path it
resets ``track_conv_indices`` to None. ``_is_mamba_track_enabled`` drops the ``spec_algorithm.is_none()`` term, so the
prefill graph has the static track slots under specdec, its capture batch carries them and the captured scatter reads
the mask and destinations that each replay refills. (``PrefillInputBuffers`` also rewrites the mask every step and
zeroes the slots' tails; the stale-tail part is sglang #34184's story and is here only in its fixed form.) Here, as
upstream under specdec, the fixed capture batch carries the static slots, so the scatter enters the graph through the
normal path of ``_refresh_track_conv_indices``; its inert path guards capture batches that still carry no track
metadata.
Modelled: one Inkling decoder layer reduced to embedding -> in_proj -> one short conv (depthwise, kernel 4, conv
state of 3 rows in a one-layer, one-stream ``MambaPool``) -> out_proj + residual -> lm_head, next-token logits of each
request's last token; no attention, no KV cache, no draft model (specdec only sets ``spec_algorithm``). Without
attention or stacked layers a restored conv state reaches only the next ``conv_kernel - 1`` tokens, so the two
requests that hit a checkpoint extend 2 and 1 tokens and their next-token logits read it directly. The fused
metadata and conv Triton kernels are dense torch routines with the same inputs (``query_start_loc``,
``has_initial_state``, per-token request index ``si``, slot ids). One capture bucket of 16 tokens with 2 request
slots; three served batches of exactly 2 requests and 16 extend tokens (prompts of 10+6, 8-token hit + 2 and 14, then
12-token hit + 1 and 4-token hit + 15), so no padded slots or tokens are involved. The registry's ``fill_from``
refills the track slots' live rows and zeroes the rest (unreached without padded slots). The
scheduler side is a small ``MambaRadixCache`` (prefix -> checkpoint slot, inserted at the chunk-aligned boundary
after each step) and the copy-on-write of a hit's checkpoint into the request's working slot before the forward.
"""
import copy
import dataclasses
from typing import Optional

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/34043"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_refresh_track_conv_indices"
SYMPTOM = ("prefill CUDA graph captured under specdec without the sconv track scatter: prefix-cache conv "
           "checkpoints are never written, so prefix hits restore a wrong conv state")

VOCAB, HIDDEN, CONV_DIM = 32, 8, 8
CONV_KERNEL = 4
CONV_STATE_LEN = CONV_KERNEL - 1
MAMBA_CACHE_CHUNK_SIZE = 4
NUM_MAMBA_SLOTS = 16                  # slot 0: the dummy write target (MambaSlotAllocator.clear)
REQ_POOL_SIZE = 8
CAPTURE_NUM_TOKENS = [16]
CAPTURE_REQ_SLOTS = 2
CONTEXT_LEN = 64


# --- sglang/srt/server_args.py, speculative algorithm --------------------------------------------------------

class SpeculativeAlgorithm:
    def __init__(self, name: str):
        self.name = name

    def is_none(self) -> bool:
        return self.name == "NONE"


@dataclasses.dataclass
class ServerArgs:
    mamba_scheduler_strategy: str = "extra_buffer"
    disable_radix_cache: bool = False
    mamba_cache_chunk_size: int = MAMBA_CACHE_CHUNK_SIZE

    def enable_mamba_extra_buffer(self) -> bool:
        return self.mamba_scheduler_strategy == "extra_buffer"


# --- sglang/srt/model_executor/forward_batch_info.py ---------------------------------------------------------

@dataclasses.dataclass
class ForwardBatch:
    forward_mode: str
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_prefix_lens: Optional[torch.Tensor]
    extend_start_loc: torch.Tensor
    extend_num_tokens: int
    mamba_track_indices: Optional[torch.Tensor] = None
    mamba_track_mask: Optional[torch.Tensor] = None
    mamba_track_seqlens: Optional[torch.Tensor] = None
    spec_algorithm: Optional[SpeculativeAlgorithm] = None


# --- sglang/srt/mem_cache/memory_pool.py ---------------------------------------------------------------------

class MambaPool:
    def __init__(self, device):
        # conv[stream][layer] is [n_slots, conv_kernel - 1, conv_dim]; one stream, one layer here.
        self.conv = torch.zeros(NUM_MAMBA_SLOTS, CONV_STATE_LEN, CONV_DIM, device=device)
        self.free_slots = list(range(1, NUM_MAMBA_SLOTS))

    def alloc(self) -> int:
        return self.free_slots.pop(0)


class HybridReqToTokenPool:
    def __init__(self, device):
        self.size = REQ_POOL_SIZE
        self.mamba_pool = MambaPool(device)
        self.req_index_to_mamba_index_mapping = torch.zeros(REQ_POOL_SIZE, dtype=torch.int32, device=device)
        self.free_req_slots = list(range(REQ_POOL_SIZE))


# --- sglang/srt/models/inkling_common/kernels/sconv.py (fused metadata) --------------------------------------

def fused_extend_sconv_metadata(*, B, T, cache_indices, extend_seq_lens, his_src, out=None):
    """query_start_loc, has_initial_state and the per-token request index ``si`` in one launch."""
    dev = extend_seq_lens.device
    qsl = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    qsl[1:] = torch.cumsum(extend_seq_lens[:B], 0).to(torch.int32)
    his = his_src[:B] > 0
    tok = torch.arange(T, dtype=torch.int64, device=dev)
    si = torch.searchsorted(qsl[1:].to(torch.int64).contiguous(), tok, right=True).clamp_(max=B - 1)
    if out is None:
        return qsl, his, si
    out["query_start_loc"].copy_(qsl)
    out["has_initial_state"].copy_(his)
    out["si"].copy_(si)
    return out["query_start_loc"], out["has_initial_state"], out["si"]


# --- sglang/srt/layers/attention/linear/inkling_sconv_backend.py ---------------------------------------------

@dataclasses.dataclass
class InklingShortConvMetadata:
    cache_indices: Optional[torch.Tensor] = None
    query_start_loc: Optional[torch.Tensor] = None
    has_initial_state: Optional[torch.Tensor] = None
    si: Optional[torch.Tensor] = None
    # [B, conv_kernel - 1] input positions whose conv window feeds the prefix cache (extend, tracking on).
    track_conv_indices: Optional[torch.Tensor] = None


class InklingShortConvAttnBackend:
    def __init__(self, req_to_token_pool: HybridReqToTokenPool, server_args: ServerArgs, variant: str, device):
        self.req_to_token_pool, self.variant, self.device = req_to_token_pool, variant, device
        self._mamba_cache = req_to_token_pool.mamba_pool
        self.conv_state_len = CONV_STATE_LEN
        self.mamba_cache_chunk_size = server_args.mamba_cache_chunk_size
        self.sconv_metadata = InklingShortConvMetadata()
        self._cache_indices = None
        self._alloc_graph_buffers()

    def _alloc_graph_buffers(self):
        """Sized from the configured capture shapes once, never reallocated (captured kernels hold the addresses)."""
        max_bs = self.req_to_token_pool.size
        max_tokens = max([max_bs, *CAPTURE_NUM_TOKENS])
        dev = self.device
        self._graph_bufs = {
            "query_start_loc": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "has_initial_state": torch.zeros(max_bs, dtype=torch.bool, device=dev),
            "si": torch.zeros(max_tokens, dtype=torch.int64, device=dev),
        }
        self._graph_track_conv_indices = torch.zeros((max_bs, self.conv_state_len), dtype=torch.int64, device=dev)
        if self.variant == "fix":                                   # PR #34043
            # Inert track fields for graph capture: a capture batch that carries no tracking metadata must still
            # LAUNCH the track scatter (all rows masked off), or the python-level `if` specializes it out.
            self._graph_track_inert_mask = torch.zeros(max_bs, dtype=torch.bool, device=dev)
            self._graph_track_inert_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
            self._graph_track_inert_seqlens = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self._cache_indices_buf = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self._track_window_offsets = torch.arange(self.conv_state_len, dtype=torch.int64, device=dev)
        self._track_index_floor = torch.zeros((1,), dtype=torch.int64, device=dev)

    def _graph_metadata_out(self, *, B, T):
        bufs = self._graph_bufs
        return {"query_start_loc": bufs["query_start_loc"][:B + 1], "has_initial_state": bufs["has_initial_state"][:B],
                "si": bufs["si"][:T]}

    def _reset_step_state(self):
        self._cache_indices = None
        self.sconv_metadata = InklingShortConvMetadata()

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager path: nothing downstream is captured, so kernels may allocate."""
        self._prepare_slot_indices(forward_batch)
        self._refresh_sconv_metadata(forward_batch, on_graph_path=False)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        """Full-cuda-graph prefill has no in-graph hook: its prep runs before every replay (and once at capture)."""
        del in_capture
        self._prepare_slot_indices(forward_batch)
        self._refresh_sconv_metadata(forward_batch, on_graph_path=True)

    def _prepare_slot_indices(self, forward_batch: ForwardBatch):
        self._reset_step_state()
        n = forward_batch.req_pool_indices.shape[0]
        buf = self._cache_indices_buf
        torch.index_select(self.req_to_token_pool.req_index_to_mamba_index_mapping, 0,
                           forward_batch.req_pool_indices, out=buf[:n])
        self._cache_indices = buf[:n]

    def _refresh_sconv_metadata(self, forward_batch: ForwardBatch, *, on_graph_path: bool):
        if self._cache_indices is None:
            return
        self.sconv_metadata.cache_indices = self._cache_indices
        assert forward_batch.forward_mode == "extend"
        self._refresh_extend_metadata(forward_batch, on_graph_path)
        self._refresh_track_conv_indices(forward_batch, on_graph_path)

    def _refresh_extend_metadata(self, forward_batch: ForwardBatch, on_graph_path: bool):
        B, T = forward_batch.batch_size, forward_batch.extend_num_tokens
        fill_T, out = T, None
        if on_graph_path:
            fill_T = self._graph_bufs["si"].shape[0]                # captured kernels bake the bucket extent
            out = self._graph_metadata_out(B=B, T=fill_T)
        md = self.sconv_metadata
        md.query_start_loc, md.has_initial_state, md.si = fused_extend_sconv_metadata(
            B=B, T=fill_T, cache_indices=self._cache_indices, extend_seq_lens=forward_batch.extend_seq_lens,
            his_src=forward_batch.extend_prefix_lens, out=out)

    def _refresh_track_conv_indices(self, forward_batch: ForwardBatch, on_graph_path: bool):
        """Input positions of the conv windows to snapshot for prefix caching: the last ``conv_kernel - 1`` tokens
        up to the last complete ``mamba_cache_chunk_size`` boundary."""
        if forward_batch.mamba_track_mask is None:
            if self.variant == "bug":
                return
            if not on_graph_path:                                   # PR #34043
                self.sconv_metadata.track_conv_indices = None
                return
            # Graph capture must still launch the track scatter (see the inert buffers in _alloc_graph_buffers).
            rows = forward_batch.batch_size
            forward_batch.mamba_track_mask = self._graph_track_inert_mask[:rows]
            forward_batch.mamba_track_indices = self._graph_track_inert_indices[:rows]
            forward_batch.mamba_track_seqlens = self._graph_track_inert_seqlens[:rows]
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

    def conv_state_metadata(self) -> InklingShortConvMetadata:
        return self.sconv_metadata

    def sconv_state(self) -> torch.Tensor:
        return self._mamba_cache.conv


# --- sglang/srt/models/inkling_common/sconv.py ---------------------------------------------------------------

def fused_gather_scatter_to_sconv_cache(hidden_states, sconv_cache, track_conv_indices, mask, dst_indices):
    """For each batch row b with mask[b]: sconv_cache[dst[b], w] = hidden_states[track_conv_indices[b, w]]."""
    B = mask.shape[0]
    for b in range(B):                                              # one program per batch row
        dst = dst_indices[b:b + 1].to(torch.int64)
        rows = hidden_states.index_select(0, track_conv_indices[b].to(torch.int64)).unsqueeze(0)
        cur = sconv_cache.index_select(0, dst)
        sconv_cache.index_copy_(0, dst, torch.where(mask[b:b + 1].view(1, 1, 1), rows, cur))


def _window_rows(x, sconv_cache, cache_indices, has_initial_state, req, start, positions):
    """Conv-input rows at ``positions`` (any shape) of requests ``req``: from x inside the request's extend,
    from its cached conv state before it (zeros when it resumes no prefix)."""
    in_seq = positions >= start
    from_x = x.index_select(0, positions.clamp(min=0).reshape(-1)).reshape(*positions.shape, -1)
    j = (CONV_STATE_LEN + positions - start).clamp(0, CONV_STATE_LEN - 1)
    slot = cache_indices.to(torch.int64).index_select(0, req.reshape(-1)).reshape(req.shape)
    state = sconv_cache[slot, j] * has_initial_state.index_select(0, req.reshape(-1)).reshape(req.shape)[..., None]
    return torch.where(in_seq[..., None], from_x, state)


class InklingShortConv(torch.nn.Module):
    def __init__(self, gen, backend: InklingShortConvAttnBackend, device):
        super().__init__()
        self.backend = backend
        self.weight = (torch.randn(CONV_DIM, CONV_KERNEL, generator=gen) * 0.6).to(device)

    def _prepare_extend_sconv_cache(self, forward_batch, sconv_cache, hidden_states, track_conv_indices):
        if track_conv_indices is not None:
            fused_gather_scatter_to_sconv_cache(hidden_states=hidden_states, sconv_cache=sconv_cache,
                                                track_conv_indices=track_conv_indices,
                                                mask=forward_batch.mamba_track_mask,
                                                dst_indices=forward_batch.mamba_track_indices)

    def _apply_training_sconv_kernel(self, hidden_states, sconv_cache, cache_indices, query_start_loc,
                                     has_initial_state, si, batch_size):
        """Causal conv over each request's [conv state | extend tokens]; then the working cache keeps the last
        ``conv_kernel - 1`` rows of that sequence."""
        T = si.shape[0]
        qsl = query_start_loc.to(torch.int64)
        start = qsl.index_select(0, si)                                             # [T]
        tok = torch.arange(T, dtype=torch.int64, device=hidden_states.device)
        taps = torch.arange(CONV_KERNEL, dtype=torch.int64, device=hidden_states.device) - (CONV_KERNEL - 1)
        pos = tok[:, None] + taps                                                    # [T, K]
        win = _window_rows(hidden_states, sconv_cache, cache_indices, has_initial_state,
                           si[:, None].expand_as(pos), start[:, None], pos)          # [T, K, D]
        y = torch.einsum("tkd,dk->td", win, self.weight)
        req = torch.arange(batch_size, dtype=torch.int64, device=hidden_states.device)
        end = qsl[1:batch_size + 1]
        spos = end[:, None] + torch.arange(CONV_STATE_LEN, device=hidden_states.device) - CONV_STATE_LEN
        new_state = _window_rows(hidden_states, sconv_cache, cache_indices, has_initial_state,
                                 req[:, None].expand_as(spos), qsl[:batch_size, None], spos)
        sconv_cache.index_copy_(0, cache_indices[:batch_size].to(torch.int64), new_state)
        return torch.nn.functional.silu(y)

    def forward(self, hidden_states, forward_batch: ForwardBatch):
        meta = self.backend.conv_state_metadata()
        sconv_cache = self.backend.sconv_state()
        assert forward_batch.forward_mode == "extend"
        self._prepare_extend_sconv_cache(forward_batch, sconv_cache, hidden_states, meta.track_conv_indices)
        return self._apply_training_sconv_kernel(hidden_states, sconv_cache, meta.cache_indices,
                                                 meta.query_start_loc, meta.has_initial_state, meta.si,
                                                 forward_batch.batch_size)


class InklingForCausalLM:
    def __init__(self, gen, backend, device):
        self.embed = (torch.randn(VOCAB, HIDDEN, generator=gen)).to(device)
        self.in_proj = (torch.randn(HIDDEN, CONV_DIM, generator=gen) * HIDDEN ** -0.5).to(device)
        self.sconv = InklingShortConv(gen, backend, device)
        self.out_proj = (torch.randn(CONV_DIM, HIDDEN, generator=gen) * CONV_DIM ** -0.5).to(device)
        self.lm_head = (torch.randn(HIDDEN, VOCAB, generator=gen) * 0.5).to(device)

    def forward(self, input_ids, forward_batch: ForwardBatch):
        h = self.embed.index_select(0, input_ids)
        x = h @ self.in_proj
        h = h + self.sconv.forward(x, forward_batch) @ self.out_proj
        last = (forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1).clamp(min=0)
        return h.index_select(0, last) @ self.lm_head                # next-token logits per request


# --- sglang/srt/model_executor/runner_utils/buffers.py + the registry ----------------------------------------

class _Slot:
    def __init__(self, buffer, per_token):
        self.buffer, self.per_token = buffer, per_token

    def slice_for(self, bs, num_tokens):
        return self.buffer[:num_tokens] if self.per_token else self.buffer[:bs]


class CudaGraphBufferRegistry:
    def __init__(self, device, max_bs, max_num_token, enable_mamba_track):
        self.slots = {"input_ids": _Slot(torch.zeros(max_num_token, dtype=torch.int64, device=device), True)}
        if enable_mamba_track:
            self.slots["mamba_track_indices"] = _Slot(torch.zeros(max_bs, dtype=torch.int64, device=device), False)
            self.slots["mamba_track_mask"] = _Slot(torch.zeros(max_bs, dtype=torch.bool, device=device), False)
            self.slots["mamba_track_seqlens"] = _Slot(torch.zeros(max_bs, dtype=torch.int64, device=device), False)

    def has_slot(self, name):
        return name in self.slots

    def get_slot(self, name):
        return self.slots[name]

    def fill_from(self, forward_batch: ForwardBatch, *, raw_bs, raw_num_tokens):
        """Refill the slots from the live batch (the track slots as #34043's populate does: live rows, zeroed tail)."""
        self.slots["input_ids"].buffer[:raw_num_tokens].copy_(forward_batch.input_ids)
        for name in ("mamba_track_indices", "mamba_track_mask", "mamba_track_seqlens"):
            if not self.has_slot(name):
                continue
            buf, live = self.slots[name].buffer, getattr(forward_batch, name)
            if live is not None:
                buf[:raw_bs].copy_(live)
            else:
                buf[:raw_bs].zero_()
            buf[raw_bs:].zero_()


# --- sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py -------------------------------------------

class ModelRunner:
    def __init__(self, model, attn_backend, server_args, spec_algorithm, req_to_token_pool):
        self.model, self.attn_backend, self.server_args = model, attn_backend, server_args
        self.spec_algorithm, self.req_to_token_pool = spec_algorithm, req_to_token_pool


_PREFILL_STATIC_FIELDS = ("seq_lens", "extend_seq_lens", "extend_prefix_lens", "extend_start_loc",
                          "req_pool_indices")


class PrefillCudaGraphRunner:
    """FULL backend: the whole forward is one graph per token bucket, over a fixed number of request slots."""

    def __init__(self, model_runner: ModelRunner, variant: str, device):
        self.model_runner, self.variant, self.device = model_runner, variant, device
        self.max_bs = model_runner.req_to_token_pool.size
        self.max_num_tokens = max(CAPTURE_NUM_TOKENS)
        self.capture_num_tokens = CAPTURE_NUM_TOKENS
        self._capture_req_slots = CAPTURE_REQ_SLOTS
        self.mamba_track_enabled = self._is_mamba_track_enabled()
        self.buffer_registry = CudaGraphBufferRegistry(device, self.max_bs, self.max_num_tokens,
                                                       self.mamba_track_enabled)
        self._prefill_static_buffers = {name: torch.zeros(self.max_bs, dtype=torch.int64, device=device)
                                        for name in _PREFILL_STATIC_FIELDS}
        self.graphs, self.output_buffers = {}, {}
        self.capture()

    def _is_mamba_track_enabled(self) -> bool:
        server_args = self.model_runner.server_args
        if self.variant == "fix":                                   # PR #34043
            return server_args.enable_mamba_extra_buffer() and (not server_args.disable_radix_cache)
        return (server_args.enable_mamba_extra_buffer() and not server_args.disable_radix_cache
                and self.model_runner.spec_algorithm.is_none())

    def capture_prepare(self, num_tokens: int) -> ForwardBatch:
        capture_seq_lens = [min(CONTEXT_LEN, num_tokens - start) for start in range(0, num_tokens, CONTEXT_LEN)]
        capture_seq_lens += [0] * (self._capture_req_slots - len(capture_seq_lens))
        bs = len(capture_seq_lens)
        starts = [0]
        for n in capture_seq_lens[:-1]:
            starts.append(starts[-1] + n)
        s = self._prefill_static_buffers
        s["seq_lens"][:bs].copy_(torch.tensor(capture_seq_lens, device=self.device))
        s["extend_seq_lens"][:bs].copy_(torch.tensor(capture_seq_lens, device=self.device))
        s["extend_prefix_lens"][:bs].zero_()
        s["extend_start_loc"][:bs].copy_(torch.tensor(starts, device=self.device))
        s["req_pool_indices"][:bs].copy_(torch.arange(bs, device=self.device))
        registry = self.buffer_registry

        def _slot(name):
            return registry.get_slot(name).slice_for(bs, num_tokens) if registry.has_slot(name) else None

        return ForwardBatch(
            forward_mode="extend", batch_size=bs, input_ids=_slot("input_ids"),
            req_pool_indices=s["req_pool_indices"][:bs], seq_lens=s["seq_lens"][:bs],
            extend_seq_lens=s["extend_seq_lens"][:bs], extend_prefix_lens=s["extend_prefix_lens"][:bs],
            extend_start_loc=s["extend_start_loc"][:bs], extend_num_tokens=num_tokens,
            mamba_track_indices=_slot("mamba_track_indices"), mamba_track_mask=_slot("mamba_track_mask"),
            mamba_track_seqlens=_slot("mamba_track_seqlens"), spec_algorithm=None)

    def capture(self):
        for num_tokens in reversed(self.capture_num_tokens):
            self.capture_one_shape(num_tokens)

    def _run_forward(self, forward_batch: ForwardBatch, num_tokens: int):
        return self.model_runner.model.forward(forward_batch.input_ids, forward_batch)

    def capture_one_shape(self, num_tokens: int):
        forward_batch = self.capture_prepare(num_tokens)
        attn_backend = self.model_runner.attn_backend
        attn_backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)

        def run_once():
            return self._run_forward(forward_batch, num_tokens)

        backend = attn_backend
        static = {"input_ids": self.buffer_registry.get_slot("input_ids").buffer,
                  **{name: t for name, t in self._prefill_static_buffers.items()},
                  "sconv.query_start_loc": backend._graph_bufs["query_start_loc"],
                  "sconv.has_initial_state": backend._graph_bufs["has_initial_state"],
                  "sconv.si": backend._graph_bufs["si"],
                  "sconv.cache_indices": backend._cache_indices_buf,
                  "sconv.track_conv_indices": backend._graph_track_conv_indices}
        for name in ("mamba_track_indices", "mamba_track_mask", "mamba_track_seqlens"):
            if self.buffer_registry.has_slot(name):
                static[name] = self.buffer_registry.get_slot(name).buffer
        g, out = capture(run_once, device=self.device, name=f"prefill full graph tokens={num_tokens}",
                         owner="PrefillCudaGraphRunner", static=static,
                         state={"mamba_pool.conv": backend.sconv_state()})
        self.graphs[num_tokens], self.output_buffers[num_tokens] = g, out

    def _prepare_forward_metadata_for_replay(self, forward_batch: ForwardBatch):
        """Full CG: slot-padded shallow view of the live batch, over the static length buffers."""
        r = self._capture_req_slots
        s = self._prefill_static_buffers
        padded_view = copy.copy(forward_batch)
        padded_view.batch_size = r
        padded_view.seq_lens = s["seq_lens"][:r]
        padded_view.req_pool_indices = s["req_pool_indices"][:r]
        padded_view.extend_seq_lens = s["extend_seq_lens"][:r]
        padded_view.extend_prefix_lens = s["extend_prefix_lens"][:r]
        padded_view.extend_num_tokens = self.static_num_tokens
        self.model_runner.attn_backend.init_forward_metadata_out_graph(padded_view)

    def load_batch(self, forward_batch: ForwardBatch):
        num_tokens = forward_batch.input_ids.shape[0]
        self.static_num_tokens = min(n for n in self.capture_num_tokens if n >= num_tokens)
        bs = forward_batch.batch_size
        self.buffer_registry.fill_from(forward_batch, raw_bs=bs, raw_num_tokens=num_tokens)
        s = self._prefill_static_buffers
        for name in _PREFILL_STATIC_FIELDS:
            s[name][:bs].copy_(getattr(forward_batch, name))
        if bs < self._capture_req_slots:                             # sentinel tail (not reached here)
            r = self._capture_req_slots
            for name in ("seq_lens", "extend_seq_lens", "extend_prefix_lens", "req_pool_indices"):
                s[name][bs:r].zero_()
            s["extend_start_loc"][bs:r].fill_(num_tokens)
        self._prepare_forward_metadata_for_replay(forward_batch)

    def can_run_graph(self, forward_batch: ForwardBatch) -> bool:
        return (forward_batch.batch_size <= self._capture_req_slots
                and forward_batch.input_ids.shape[0] <= self.max_num_tokens)

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        self.load_batch(forward_batch)
        logits = replay(self.graphs[self.static_num_tokens], self.output_buffers[self.static_num_tokens])
        return logits[:forward_batch.batch_size].clone()             # the sampler reads them now


# --- the scheduler side: MambaRadixCache, ScheduleBatch track fields, COW of a prefix hit ---------------------

class MambaRadixCache:
    """Prefix -> the mamba slot holding the conv state after that prefix (its checkpoint)."""

    def __init__(self):
        self.nodes: dict[tuple, int] = {}

    def match_prefix(self, tokens):
        best = (0, None)
        for key, slot in self.nodes.items():
            if len(key) > best[0] and len(key) <= len(tokens) and tuple(tokens[:len(key)]) == key:
                best = (len(key), slot)
        return best

    def insert(self, tokens, slot):
        self.nodes[tuple(tokens)] = slot


class Scheduler:
    def __init__(self, req_to_token_pool: HybridReqToTokenPool, server_args, spec_algorithm, device):
        self.pool, self.server_args = req_to_token_pool, server_args
        self.spec_algorithm, self.device = spec_algorithm, device
        self.tree_cache = MambaRadixCache()

    def prepare_for_extend(self, prompts):
        """ScheduleBatch.prepare_for_extend + ForwardBatch.init_new, for a batch of new requests."""
        mamba = self.pool.mamba_pool
        input_ids, req_pool_indices, seq_lens, ext_lens, prefix_lens = [], [], [], [], []
        track_idx, track_mask, track_seqlens, inserts = [], [], [], []
        for prompt in prompts:
            prefix_len, ckpt = self.tree_cache.match_prefix(prompt)
            req_idx, work = self.pool.free_req_slots.pop(0), mamba.alloc()
            self.pool.req_index_to_mamba_index_mapping[req_idx] = work
            # _collect_deferred_mamba_cow_and_clear: a hit resumes from its checkpoint, a miss from zeros
            if ckpt is not None:
                mamba.conv[work].copy_(mamba.conv[ckpt])
            else:
                mamba.conv[work].zero_()
            input_ids += prompt[prefix_len:]
            req_pool_indices.append(req_idx)
            seq_lens.append(len(prompt))
            ext_lens.append(len(prompt) - prefix_len)
            prefix_lens.append(prefix_len)
            aligned = (len(prompt) - prefix_len) // MAMBA_CACHE_CHUNK_SIZE * MAMBA_CACHE_CHUNK_SIZE
            tracked = self.server_args.enable_mamba_extra_buffer() and aligned >= CONV_STATE_LEN
            slot = mamba.alloc() if tracked else 0
            track_idx.append(slot)
            track_mask.append(tracked)
            track_seqlens.append(len(prompt))
            if tracked:
                inserts.append((prompt[:prefix_len + aligned], slot))
        starts = [0]
        for n in ext_lens[:-1]:
            starts.append(starts[-1] + n)
        dev = self.device
        fb = ForwardBatch(
            forward_mode="extend", batch_size=len(prompts), input_ids=torch.tensor(input_ids, device=dev),
            req_pool_indices=torch.tensor(req_pool_indices, device=dev), seq_lens=torch.tensor(seq_lens, device=dev),
            extend_seq_lens=torch.tensor(ext_lens, device=dev),
            extend_prefix_lens=torch.tensor(prefix_lens, device=dev),
            extend_start_loc=torch.tensor(starts, device=dev), extend_num_tokens=len(input_ids),
            mamba_track_indices=torch.tensor(track_idx, dtype=torch.int64, device=dev),
            mamba_track_mask=torch.tensor(track_mask, dtype=torch.bool, device=dev),
            mamba_track_seqlens=torch.tensor(track_seqlens, dtype=torch.int64, device=dev),
            spec_algorithm=self.spec_algorithm)
        return fb, inserts

    def process_batch_result(self, prompts, inserts):
        """cache_unfinished_req: the tracked prefixes enter the radix cache with their checkpoint slots."""
        for tokens, slot in inserts:
            self.tree_cache.insert(tokens, slot)


def run(variant: str, device: str = "cpu"):
    gen = generator(34043)
    weights_seed = 34043
    tok = torch.randint(1, VOCAB, (64,), generator=gen).tolist()
    a, b, c_new, d, e_new, f_new = tok[:10], tok[10:16], tok[16:18], tok[18:32], tok[32:33], tok[33:48]
    prompt_c = a[:8] + c_new                        # hits A's checkpoint at 8, extends 2 tokens
    prompt_e = d[:12] + e_new                       # hits D's checkpoint at 12, extends 1 token
    prompt_f = b[:4] + f_new                        # hits B's checkpoint at 4, extends 15 tokens
    steps = [[a, b], [prompt_c, d], [prompt_e, prompt_f]]   # 16 extend tokens, 2 requests each

    def serve(graphed: bool):
        server_args = ServerArgs()
        spec_algorithm = SpeculativeAlgorithm("EAGLE")
        pool = HybridReqToTokenPool(device)
        backend = InklingShortConvAttnBackend(pool, server_args, variant, device)
        model = InklingForCausalLM(generator(weights_seed), backend, device)
        model_runner = ModelRunner(model, backend, server_args, spec_algorithm, pool)
        runner = PrefillCudaGraphRunner(model_runner, variant, device) if graphed else None
        scheduler = Scheduler(pool, server_args, spec_algorithm, device)
        outs = []
        for prompts in steps:
            fb, inserts = scheduler.prepare_for_extend(prompts)
            if runner is not None and runner.can_run_graph(fb):
                outs.append(runner.replay(fb))
            else:
                backend.init_forward_metadata(fb)
                outs.append(model.forward(fb.input_ids, fb))
            scheduler.process_batch_result(prompts, inserts)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
