"""tokenspeed decode CUDA graph with one DP rank: the padding rows' "sink" req-pool slot ``max_req_pool_size`` is the last slot the scheduler hands out, so the captured sampler adds the padding rows' sampled tokens to that live request's penalty counts.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/574 ("Fix DP cache sizing", lightseekorg/tokenspeed, merged as
commit f1c89a6e on main, 2026-07-02; the PR has no description beyond its title and sign-off). Read: the commit's full
diff, in particular ``runtime/engine/event_loop.py`` (``EventLoop.__init__``: the new ``per_rank_max_batch = max_num_seqs
// dp_size`` and ``req_pool_padding_index = per_rank_max_batch + 1`` passed as ``max_req_pool_size``, with the comment
"The C++ scheduler's req_pool_idx range is rank-local and 1-based: real rows are 1..max_batch_size, row 0 is reserved, and
CUDA graph padding needs one non-real sink row after the scheduler-owned range"; before, ``max_req_pool_size =
server_args.max_num_seqs``) and ``model_executor.py`` (the same comment on ``ModelExecutorConfig.max_req_pool_size``).
At the parent commit I read ``runtime/execution/cuda_graph_wrapper.py`` (``_pad_graph_req_pool_indices``, which routes
padding rows to the sentinel ``self.config.max_req_pool_size``; ``_set_graph_state_write_indices``; ``capture_one``: four
warmups, ``sampling_backend.reset_capture_state()``, capture with ``SamplingBatchInfo(req_pool_indices=
req_pool_indices_buf[:bs])``; ``__call__``), ``runtime/sampling/backends/flashinfer_full.py``
(``FlashInferFullSamplingBackend``: per-pool-slot ``_counts`` with ``max_req_pool_size + 1`` rows, ``_reset_slot``,
``_apply_penalties_and_bias``, ``_accumulate_counts`` = ``_counts.index_put_((pool_idx, tokens), 1, accumulate=True)``
run inside the graph after sampling), ``runtime/execution/input_buffer.py`` (padding defaults: input_ids 1, positions 0,
req_pool 0) and the C++ ``ReqPoolAllocator`` (slots ``1..size``, FIFO free list) built with ``max_batch_size =
per_rank_max_batch``. Reconstructed: the PR names no symptom; that with ``dp_size == 1`` the pre-fix sentinel equals the
last scheduler slot, and what the captured sampler then does with it, follows from the code above and is mine. The
earlier PR #531 had moved padding rows from slot 0 to this sentinel; #574 fixes that the sentinel itself is a live slot.
Symptom: serving with one attention-DP rank, CUDA graphs and frequency/presence/repetition penalties, the request that
holds the last req-pool slot (slot ``max_num_seqs``) is sampled with penalties for tokens it never produced whenever its
decode batch is padded up to a captured size; its output drifts from the eager (or unpadded) result.
Mechanism: a padded replay routes the padding rows' ``req_pool_indices`` to the sink slot ``max_req_pool_size``. The
captured ``FlashInferFullSamplingBackend.sample`` reads each row's penalty state at its pool slot and, after sampling,
scatters every row's token into ``_counts[pool_idx, token]``. With ``max_req_pool_size == max_num_seqs`` and the
scheduler owning slots ``1..max_num_seqs``, the "sink" is the last real slot, so each padded step adds the padding rows'
tokens to that request's counts, and its next steps are penalised for them. Eager decode runs the real rows only and
never touches the slot.
Doctor: stale-padding, at _pad_graph_req_pool_indices. The real row of the request in the last slot depends on what the
padded rows hold: their pool index is a live slot, so the captured sampler's count scatter from the padded rows lands in
that request's penalty state.
Fix (upstream): size the pool with one slot past the scheduler's range (``max_req_pool_size = max_num_seqs // dp_size +
1``); ``_counts`` (and ``req_to_page``) get that extra row, which no request owns, and padding rows write only there.
Modelled: ``EventLoop`` (the sizing the fix changes), ``ReqPoolAllocator`` (1-based FIFO slots), ``ModelExecutorConfig``,
``InputBuffers`` (``input_ids_buf``, ``positions_buf``, ``req_pool_indices_buf``, ``fill_input_buffers`` refreshing the
padding tail to its defaults), ``FlashInferFullSamplingBackend`` (``_counts``, penalty pools, ``_reset_slot``,
``_apply_penalties_and_bias``, ``_accumulate_counts``, ``reset_capture_state``, ``sample``) and ``CudaGraphWrapper``
(capture sizes [1, 2, 4] largest first into one pool, warmups then ``reset_capture_state`` then capture,
``_pad_graph_req_pool_indices``, padded replay). Stand-ins: the model is an embedding + position table + one tanh layer
+ lm head (no KV cache: next-token logits from the current token and position), sampling is greedy argmax over the
penalised logits (upstream: softmax / top-k / top-p / min-p with per-request seeds); no prefill, no drafter. Hidden 8,
vocab 16, float64.
Workload: ``max_num_seqs`` 4, one DP rank. Requests A, B, C, D arrive together (slots 1, 2, 3, 4; all with frequency
penalty 1.2, presence penalty 0.4, repetition penalty 1.3). A stops after 2 tokens; B, C, D decode 8 tokens. Steps 0-1
run the 4-row graph unpadded; from step 2 on, [B, C, D] is padded to the 4-row graph. In the bug the padding row
(slot 4) adds its sampled token to D's counts every padded step, and from step 6 on D's penalised greedy choice differs
from eager (max |graph - eager| = 10 on the token ids); A, B, C match. The fix equals eager.
"""
from __future__ import annotations

import collections

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/574"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_pad_graph_req_pool_indices"
SYMPTOM = ("with one DP rank the CUDA-graph padding rows' sink req-pool slot (max_req_pool_size) is the last slot the "
           "scheduler hands out, so the captured sampler adds the padding rows' tokens to that live request's penalty "
           "counts and its output drifts whenever its batch is padded")

HIDDEN, VOCAB, MAX_POS = 8, 16, 32
MAX_NUM_SEQS, DP_SIZE = 4, 1
CAPTURE_BS = [1, 2, 4]

_variant = "bug"


class ServerArgs:
    def __init__(self, max_num_seqs, dp_size):
        self.max_num_seqs = max_num_seqs
        self.dp_size = dp_size


class SamplingParams:
    def __init__(self, max_new_tokens, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0):
        self.max_new_tokens = max_new_tokens
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty
        self.repetition_penalty = repetition_penalty


# --- tokenspeed-scheduler/csrc/resource/allocator/req_pool_allocator.cpp (stand-in in Python) -------------------------

class ReqPoolAllocator:
    def __init__(self, size):
        self.size_ = size
        # Slot 0 is conventionally reserved (matches Python which starts from index 1).
        self.free_slots_ = collections.deque(range(1, size + 1))

    def Allocate(self):
        if not self.free_slots_:
            raise RuntimeError(f"ReqPoolAllocator::Allocate: no request pool slots available; capacity={self.size_}")
        return self.free_slots_.popleft()

    def deAllocate(self, slot):
        self.free_slots_.append(slot)


# --- runtime/execution ------------------------------------------------------------------------------------------------

class ModelExecutorConfig:
    def __init__(self, max_req_pool_size, max_num_seqs, data_parallel_size, vocab_size):
        # Rank-local graph-padding req-pool index (the sink row padded graph rows are routed to).
        self.max_req_pool_size = max_req_pool_size
        self.max_num_seqs = max_num_seqs
        self.data_parallel_size = data_parallel_size
        self.vocab_size = vocab_size


class TinyLM:
    """Stand-in model: next-token logits from the current token and its position."""

    def __init__(self, device):
        gen = generator(574)
        r = lambda *s, scale=1.0: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN)
        self.pos = r(MAX_POS, HIDDEN, scale=0.5)
        self.w = r(HIDDEN, HIDDEN, scale=0.6)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.9)

    def forward(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos[positions]
        return torch.tanh(h @ self.w) @ self.lm_head


class InputBuffers:
    """Padding defaults the captured graph expects for padded rows: input_ids=1, positions=0, req_pool=0."""

    def __init__(self, max_bs, device):
        i64 = dict(dtype=torch.int64, device=device)
        self.max_bs = max_bs
        self.input_ids_buf = torch.ones(max_bs, **i64)
        self.positions_buf = torch.zeros(max_bs, **i64)
        self.req_pool_indices_buf = torch.zeros(max_bs, **i64)

    def fill_input_buffers(self, requests):
        bs = len(requests)
        dev = self.input_ids_buf.device
        self.req_pool_indices_buf[:bs].copy_(torch.tensor([r.req_pool_idx for r in requests]).to(dev))
        self.input_ids_buf[:bs].copy_(torch.tensor([r.last_token for r in requests]).to(dev))
        self.positions_buf[:bs].copy_(torch.tensor([r.position for r in requests]).to(dev))
        # a larger prior iteration can leave stale values past the current prefix: refresh the padding tail
        self.input_ids_buf[bs:].fill_(1)
        self.positions_buf[bs:].fill_(0)
        self.req_pool_indices_buf[bs:].fill_(0)


class SamplingBatchInfo:
    def __init__(self, req_pool_indices):
        self.req_pool_indices = req_pool_indices


# --- runtime/sampling/backends/flashinfer_full.py ---------------------------------------------------------------------

class FlashInferFullSamplingBackend:
    """Per-pool-idx token counts, accumulated after each sample inside the captured graph."""

    def __init__(self, config, device):
        # Valid pool indices run 0..max_req_pool_size inclusive.
        pool_rows = config.max_req_pool_size + 1
        self._counts = torch.zeros(pool_rows, config.vocab_size, dtype=torch.int64, device=device)
        self._freq_pen_pool = torch.zeros(pool_rows, dtype=torch.float64, device=device)
        self._pres_pen_pool = torch.zeros(pool_rows, dtype=torch.float64, device=device)
        self._rep_pen_pool = torch.ones(pool_rows, dtype=torch.float64, device=device)

    def _reset_slot(self, pool_idx, sp):
        """on_pool_assignment: a slot re-assigned to a new request starts from its params and zero counts."""
        self._freq_pen_pool[pool_idx].fill_(float(sp.frequency_penalty))
        self._pres_pen_pool[pool_idx].fill_(float(sp.presence_penalty))
        self._rep_pen_pool[pool_idx].fill_(float(sp.repetition_penalty))
        self._counts[pool_idx].fill_(0)

    def reset_capture_state(self):
        # Warm-up iterations route all pool indices to row 0, which accumulates sampled tokens into _counts[0].
        self._counts[0].fill_(0)

    def _apply_penalties_and_bias(self, logits, sampling_info):
        pool_idx = sampling_info.req_pool_indices
        counts = self._counts.index_select(0, pool_idx)
        active = counts > 0
        counts_f = counts.to(logits.dtype)
        active_f = active.to(logits.dtype)
        rep = self._rep_pen_pool.index_select(0, pool_idx).unsqueeze(-1)
        freq = self._freq_pen_pool.index_select(0, pool_idx).unsqueeze(-1)
        presence = self._pres_pen_pool.index_select(0, pool_idx).unsqueeze(-1)
        scales = torch.where(active, rep.expand_as(logits), torch.ones_like(logits))
        logits = torch.where(logits > 0, logits / scales, logits * scales)
        return logits - freq * counts_f - presence * active_f

    def _accumulate_counts(self, pool_idx, tokens, weights):
        """Graph-safe in-place scatter: counts[pool_idx, tokens] += weights."""
        self._counts.index_put_((pool_idx, tokens.long()), weights, accumulate=True)

    def sample(self, logits, sampling_info):
        logits = self._apply_penalties_and_bias(logits, sampling_info)
        sampled = logits.argmax(-1)                      # greedy requests (top_k = 1)
        self._accumulate_counts(sampling_info.req_pool_indices, sampled, torch.ones_like(sampled))
        return sampled


class ModelExecutor:
    def __init__(self, config, device, use_cuda_graph):
        self.config = config
        self.device = device
        max_bs = config.max_num_seqs // max(config.data_parallel_size, 1)
        self.model = TinyLM(device)
        self.input_buffers = InputBuffers(max_bs, device)
        self.sampling_backend = FlashInferFullSamplingBackend(config, device)
        self.cuda_graph_wrapper = CudaGraphWrapper(self, config) if use_cuda_graph else None

    def _forward_func(self, bs, sampling_info):
        ibd = self.input_buffers
        logits = self.model.forward(ibd.input_ids_buf[:bs], ibd.positions_buf[:bs])
        return self.sampling_backend.sample(logits, sampling_info)

    def execute_forward_op(self, requests):
        bs = len(requests)
        self.input_buffers.fill_input_buffers(requests)
        if self.cuda_graph_wrapper is not None:
            return self.cuda_graph_wrapper(bs)
        sampling_info = SamplingBatchInfo(req_pool_indices=self.input_buffers.req_pool_indices_buf[:bs])
        return self._forward_func(bs, sampling_info)


class CudaGraphWrapper:
    def __init__(self, executor, config):
        self.executor = executor
        self.config = config
        self.capture_bs = CAPTURE_BS
        self.graphs, self.output_buffers = {}, {}
        ibd = executor.input_buffers
        events.static_buffers("CudaGraphWrapper", {"input_ids_buf": ibd.input_ids_buf,
                                                   "positions_buf": ibd.positions_buf,
                                                   "req_pool_indices_buf": ibd.req_pool_indices_buf})
        events.persistent_state("CudaGraphWrapper", {"sampling_counts": executor.sampling_backend._counts})
        pool = graph_pool_handle(executor.device)
        for bs in sorted(self.capture_bs, reverse=True):       # largest batch size first
            self.graphs[bs], self.output_buffers[bs] = self.capture_one(bs, pool)

    def capture_one(self, bs, pool):
        ex = self.executor
        sampling_info = SamplingBatchInfo(req_pool_indices=ex.input_buffers.req_pool_indices_buf[:bs])

        def run_once():
            return ex._forward_func(bs=bs, sampling_info=sampling_info)

        for _ in range(2):                                     # warm up before capture
            with events.warmup():
                run_once()
        # Clear any per-pool state that warm-up dirtied at pool row 0.
        ex.sampling_backend.reset_capture_state()
        return capture(run_once, device=ex.device, pool=pool, warmups=0, name=f"decode [{bs}]",
                       owner="CudaGraphWrapper")

    def _padded_bs(self, bs):
        return next(s for s in sorted(self.capture_bs) if s >= bs)

    def _pad_graph_req_pool_indices(self, active_req_pool_indices, padded_bs):
        pad = padded_bs - active_req_pool_indices.shape[0]
        if pad <= 0:
            return active_req_pool_indices
        # Route padding rows to the sentinel req-pool slot (max_req_pool_size), not slot 0.
        sentinel = int(self.config.max_req_pool_size)
        return torch.cat([active_req_pool_indices, active_req_pool_indices.new_full((pad,), sentinel)])

    def __call__(self, bs):
        ibd = self.executor.input_buffers
        padded_bs = self._padded_bs(bs)
        if padded_bs != bs:
            req_pool_indices = self._pad_graph_req_pool_indices(ibd.req_pool_indices_buf[:bs].clone(), padded_bs)
            ibd.req_pool_indices_buf[:padded_bs].copy_(req_pool_indices)
        out = replay(self.graphs[padded_bs], self.output_buffers[padded_bs], real=bs, size=padded_bs)
        return out[:bs]


# --- runtime/engine/event_loop.py -------------------------------------------------------------------------------------

class Req:
    def __init__(self, rid, prompt, sampling_params):
        self.rid = rid
        self.last_token = prompt[-1]
        self.position = len(prompt) - 1
        self.sampling_params = sampling_params
        self.output_ids = []
        self.req_pool_idx = None


class EventLoop:
    def __init__(self, server_args, device, use_cuda_graph):
        per_rank_max_batch = server_args.max_num_seqs // max(server_args.dp_size, 1)
        if _variant == "fix":
            # real rows are 1..max_batch_size, row 0 is reserved, and CUDA graph padding needs one non-real sink row
            # after the scheduler-owned range.
            req_pool_padding_index = per_rank_max_batch + 1
            max_req_pool_size = req_pool_padding_index
        else:
            max_req_pool_size = server_args.max_num_seqs
        config = ModelExecutorConfig(max_req_pool_size=max_req_pool_size, max_num_seqs=server_args.max_num_seqs,
                                     data_parallel_size=server_args.dp_size, vocab_size=VOCAB)
        self.model_executor = ModelExecutor(config, device, use_cuda_graph)
        self.req_pool_allocator = ReqPoolAllocator(per_rank_max_batch)     # the scheduler's max_batch_size
        self.running = []

    def add_request(self, req):
        req.req_pool_idx = self.req_pool_allocator.Allocate()
        self.model_executor.sampling_backend._reset_slot(req.req_pool_idx, req.sampling_params)
        self.running.append(req)

    def step(self):
        tokens = self.model_executor.execute_forward_op(self.running).tolist()
        for req, tok in zip(list(self.running), tokens):
            req.output_ids.append(tok)
            req.last_token, req.position = tok, req.position + 1
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                self.running.remove(req)
                self.req_pool_allocator.deAllocate(req.req_pool_idx)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    penalties = dict(frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3)
    prompts = {"A": [3, 7, 1], "B": [2, 9, 4, 4, 11], "C": [5, 6], "D": [8, 1, 13, 2]}
    max_new = {"A": 2, "B": 8, "C": 8, "D": 8}

    def serve(use_cuda_graph):
        loop = EventLoop(ServerArgs(MAX_NUM_SEQS, DP_SIZE), device, use_cuda_graph)
        reqs = [Req(rid, prompts[rid], SamplingParams(max_new[rid], **penalties)) for rid in "ABCD"]
        for req in reqs:
            loop.add_request(req)
        while loop.running:
            loop.step()
        return [torch.tensor(r.output_ids, dtype=torch.float64) for r in reqs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
