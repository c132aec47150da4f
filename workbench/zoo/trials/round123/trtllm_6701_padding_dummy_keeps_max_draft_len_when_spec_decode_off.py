"""TRT-LLM PyTorch backend, two-model speculative decoding with ``max_concurrency``: when speculation is switched off for a step (more active requests than ``max_concurrency``) the engine serves the draft-length-0 decode graph, but ``_get_padded_batch`` still builds the CUDA-graph padding dummy with ``max_draft_len`` draft tokens, so the padded batch carries more tokens than the graph was captured for.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/6701 ("[https://nvbugs/5441438][fix] Set correct draft length for
the cuda graph dummy request", NVIDIA/TensorRT-LLM, by ziyixiong-nv, reviewed 2025-08-08, merged; merge commit not
read). Read: the PR title and its two review threads, which quote the hunks of ``tensorrt_llm/_torch/pyexecutor/
model_engine.py``: in ``_get_padded_batch`` (after ``if available_blocks < 1: return 0``) the new line
``max_draft_len = self.max_draft_len if self.enable_spec_decode else 0`` for the dummy's draft tokens, and a new
``runtime_draft_len`` property (``self.max_draft_len if self.enable_spec_decode else 0``); for the surrounding code of
that time, hunks quoted in other threads: #4084 (``KVCacheManager.add_dummy_requests`` builds a generation dummy of
one token plus ``max_num_draft_tokens`` draft tokens), #4729 / #4853 (one padding dummy created lazily at the first
padded step and replicated ``padding_size`` times), #6665 (``DecodingCUDAGraphRunner`` static ``input_ids`` /
``position_ids`` of ``batch_size * max_beam_width * token_per_request`` tokens, ``token_per_request = draft_len + 1``),
#7363 (graphs keyed by ``(batch_size, draft_len)``) and #8050 (the target engine of two-model speculation also
captures ``draft_len = 0`` graphs when ``max_concurrency`` is set, because speculation is then turned off for large
batches). Not read: the full diff, the nvbug, and the parent-commit ``model_engine.py`` (the code below follows the
quoted hunks; the rest of ``forward`` / ``_prepare_tp_inputs`` is reduced).
Symptom: the nvbug text is not public. As the mechanism implies (and as modelled): with two-model speculative decoding,
``max_concurrency`` set and CUDA-graph padding on, the first generation step that runs with speculation off at a batch
size that is not captured (3 requests, graphs for 1, 2, 4) fails while copying the step's tokens into the
``(4, 0)`` graph's static ``input_ids`` (4 tokens captured, 6 given); eager serving is fine.
Mechanism: the executor turns speculation off (``enable_spec_decode = False``) when more requests are active than
``max_concurrency``; the requests then carry no draft tokens and ``_maybe_get_cuda_graph`` picks the graph of key
``(padded batch size, 0)``, whose static inputs hold one token per request. ``_get_padded_batch`` creates the padding
dummy with ``max_num_draft_tokens=self.max_draft_len`` regardless, so each padding row brings ``1 + max_draft_len``
tokens: the padded batch has ``3 + 1 * 3 = 6`` tokens for a graph of 4.
Doctor: undersized-buffer, at _get_padded_batch. The padded step asks the draft-length-0 graph to serve more token
rows than it was captured for; the upstream fix is in ``_get_padded_batch`` (the dummy's draft length follows the
runtime draft length).
Fix (upstream): ``_get_padded_batch`` gives the dummy ``self.max_draft_len if self.enable_spec_decode else 0`` draft
tokens (and the engine gains ``runtime_draft_len``).
Modelled: ``KVCacheManager.add_dummy_requests`` (generation dummies, draft tokens ``[1] * max_num_draft_tokens``),
``PyTorchModelEngine`` (``_get_padded_batch`` with the lazily created, replicated padding dummy,
``_round_up_batch_size``, ``_maybe_get_cuda_graph`` keyed ``(batch_size, draft_len)``, warmup capturing ``draft_len``
in ``[max_draft_len, 0]`` for batch sizes 1, 2, 4, ``_prepare_tp_inputs`` reduced to token ids, positions, per-request
lengths and seq slots, ``forward`` with padding removal), ``DecodingCUDAGraphRunner`` (static inputs, two warmup runs,
capture, ``run`` copying ``input_ids`` / ``position_ids`` by ``seqlen``), an attention metadata with static
per-request buffers and ``create_cuda_graph_metadata``, and the executor's ``max_concurrency`` switch. Stand-ins: a
one-layer, one-head attention model over a per-slot KV cache (slot ``MAX_BATCH_SIZE`` reserved for the padding dummy),
a fixed greedy draft model run eagerly, greedy verification; float64.
Workload: max_draft_len 2, max_concurrency 2, graphs for batch sizes 1, 2, 4 and draft lengths 2 and 0. Requests A
(prompt 5), B (4), C (6) prefill eagerly; decode steps 1-2 run A, B, C with speculation off (padded to 4); C finishes
after step 2; steps 3-5 run A, B with two drafts each (graph (2, 2), no padding). Measured: the bug raises
RuntimeError at step 1 ("The size of tensor a (4) must match the size of tensor b (6) at non-singleton dimension 0");
the fix replays the (4, 0) graph twice (with a one-token dummy) and the (2, 2) graph three times and equals eager
(max error 1.8e-15 in the two padded steps: float64 rounding of 4-row against 3-row matmuls; 0 elsewhere).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/6701"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_get_padded_batch"
SYMPTOM = ("two-model speculative decoding with max_concurrency: a padded step with speculation off gives the padding "
           "dummy max_draft_len draft tokens, more tokens than the draft-length-0 graph holds")

MAX_BATCH_SIZE, MAX_DRAFT_LEN, MAX_CONCURRENCY = 4, 2, 2
CUDA_GRAPH_BATCH_SIZES = [1, 2, 4]
MAX_NUM_TOKENS, MAX_SEQ_LEN = 32, 16
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1
VOCAB, HIDDEN = 16, 8
DTYPE = torch.float64

_variant = "bug"


# --- tensorrt_llm/_torch/pyexecutor/llm_request.py / resource_manager.py (reduced) ------------------------------------

@dataclasses.dataclass(eq=False)
class LlmRequest:
    py_request_id: int
    tokens: list
    py_seq_slot: int
    max_new_tokens: int = 0
    py_draft_tokens: list = dataclasses.field(default_factory=list)
    is_context: bool = True
    is_cuda_graph_dummy: bool = False
    num_generated: int = 0

    @property
    def is_dummy(self):
        return self.is_cuda_graph_dummy


@dataclasses.dataclass
class ScheduledRequests:
    context_requests: list
    generation_requests: list

    @property
    def batch_size(self):
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def can_run_cuda_graph(self):
        return not self.context_requests


class KVCacheManager:
    def get_num_free_blocks(self):
        return 64

    def add_dummy_requests(self, request_ids, is_gen=True, max_num_draft_tokens=0, seq_slots=None):
        requests = []
        for i, req_id in enumerate(request_ids):
            req = LlmRequest(req_id, tokens=[0], py_seq_slot=seq_slots[i], is_context=not is_gen)
            if is_gen:
                req.py_draft_tokens = [1] * max_num_draft_tokens
            requests.append(req)
        return requests


# --- tensorrt_llm/_torch/attention_backend (reduced) ------------------------------------------------------------------

class AttentionMetadata:
    def __init__(self, max_num_requests, device, is_cuda_graph=False):
        self.max_num_requests, self.device, self.is_cuda_graph = max_num_requests, device, is_cuda_graph
        i64 = dict(dtype=torch.int64, device=device)
        self.seq_lens_cuda = torch.zeros(max_num_requests, **i64)
        self.cu_seqlens_cuda = torch.zeros(max_num_requests + 1, **i64)
        self.seq_slots_cuda = torch.zeros(max_num_requests, **i64)
        self.seq_lens, self.seq_slots, self.num_seqs = [], [], 0

    def create_cuda_graph_metadata(self, max_batch_size):
        return AttentionMetadata(max_batch_size, self.device, is_cuda_graph=True)

    def prepare(self):
        n = self.num_seqs = len(self.seq_lens)
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int64)
        self.seq_lens_cuda[:n].copy_(seq_lens.to(self.device))
        self.cu_seqlens_cuda[1:n + 1].copy_(torch.cumsum(seq_lens, 0).to(self.device))
        self.seq_slots_cuda[:n].copy_(torch.tensor(self.seq_slots, dtype=torch.int64).to(self.device))


class TargetModel:
    """One attention layer over a per-slot KV cache; each token sees its request's cache up to its own position."""

    def __init__(self, device):
        gen = generator(6701)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed, self.pos = r(VOCAB, HIDDEN, scale=1.0), r(MAX_SEQ_LEN, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)
        self.draft_w = r(HIDDEN, HIDDEN, scale=0.8)

    def forward(self, input_ids, position_ids, attn_metadata, kv_cache):
        k_cache, v_cache = kv_cache
        n = attn_metadata.num_seqs
        tok = torch.arange(input_ids.shape[0], device=input_ids.device)
        req = torch.searchsorted(attn_metadata.cu_seqlens_cuda[1:n + 1], tok, right=True).clamp(max=n - 1)
        slots = attn_metadata.seq_slots_cuda[:n][req]
        h = self.embed[input_ids] + self.pos[position_ids]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        k_cache.index_put_((slots, position_ids), k)
        v_cache.index_put_((slots, position_ids), v)
        scores = torch.einsum("th,tsh->ts", q, k_cache[slots]) / math.sqrt(HIDDEN)
        masked = torch.arange(MAX_SEQ_LEN, device=input_ids.device)[None, :] > position_ids[:, None]
        attn = torch.einsum("ts,tsh->th", scores.masked_fill(masked, float("-inf")).softmax(-1), v_cache[slots])
        return (h + attn @ self.wo) @ self.lm_head

    def draft(self, token, num):                      # the draft engine (eager in both runs): greedy chain
        out = []
        for _ in range(num):
            token = int(torch.argmax(torch.tanh(self.embed[token] @ self.draft_w) @ self.lm_head))
            out.append(token)
        return out


# --- tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py (Aug 2025) ---------------------------------------------------

class DecodingCUDAGraphRunner:
    WARMUP_STEPS = 2

    def __init__(self, batch_size, device, attn_metadata, draft_len, kv_cache):
        token_per_request = draft_len + 1
        self.batch_size, self.attn_metadata, self.kv_cache = batch_size, attn_metadata, kv_cache
        self.input_ids = torch.ones(batch_size * token_per_request, dtype=torch.int64, device=device)
        self.position_ids = torch.zeros(batch_size * token_per_request, dtype=torch.int64, device=device)
        self._graph = self._output = None

    def needs_capture(self):
        return self._graph is None

    def capture(self, forward_fn):
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "attn_metadata": self.attn_metadata}
        static = {"input_ids": self.input_ids, "position_ids": self.position_ids,
                  "seq_lens_cuda": self.attn_metadata.seq_lens_cuda,
                  "cu_seqlens_cuda": self.attn_metadata.cu_seqlens_cuda,
                  "seq_slots_cuda": self.attn_metadata.seq_slots_cuda}
        self._graph, self._output = capture(lambda: forward_fn(inputs), device=str(self.input_ids.device),
                                            warmups=self.WARMUP_STEPS, static=static,
                                            state={"k_cache": self.kv_cache[0], "v_cache": self.kv_cache[1]},
                                            owner="DecodingCUDAGraphRunner",
                                            name=f"decode graph bs={self.batch_size} tokens={self.input_ids.numel()}")

    def run(self, inputs, num_real_tokens):
        assert inputs["attn_metadata"] is self.attn_metadata
        seqlen = inputs["input_ids"].shape[0]
        self.input_ids[:seqlen].copy_(inputs["input_ids"])
        self.position_ids[:seqlen].copy_(inputs["position_ids"])
        return replay(self._graph, self._output, real=num_real_tokens, size=self.input_ids.numel())


# --- tensorrt_llm/_torch/pyexecutor/model_engine.py (Aug 2025, reduced) -----------------------------------------------

class PyTorchModelEngine:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = TargetModel(device)
        self.kv_cache_manager = KVCacheManager()
        self.kv_cache = tuple(torch.zeros(MAX_BATCH_SIZE + 1, MAX_SEQ_LEN, HIDDEN, dtype=DTYPE, device=device)
                              for _ in range(2))                     # slot MAX_BATCH_SIZE: the padding dummy's
        self.max_draft_len = MAX_DRAFT_LEN
        self.enable_spec_decode = True
        self._run_cuda_graphs = use_cuda_graph
        self._cuda_graph_padding_enabled = True
        self._cuda_graph_batch_sizes = CUDA_GRAPH_BATCH_SIZES
        self._max_cuda_graph_batch_size = CUDA_GRAPH_BATCH_SIZES[-1]
        self._cuda_graphs: dict[tuple[int, int], DecodingCUDAGraphRunner] = {}
        self.cuda_graph_dummy_request = None
        self.attn_metadata = AttentionMetadata(MAX_BATCH_SIZE + 1, device)
        self.input_ids_cuda = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.position_ids_cuda = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        if use_cuda_graph:
            self.warmup()

    def warmup(self):
        # max_concurrency is set: capture the draft-length-0 graphs too (speculation off for large batches)
        for draft_len in (self.max_draft_len, 0):
            self.enable_spec_decode = draft_len > 0
            for bs in reversed(self._cuda_graph_batch_sizes):
                requests = self.kv_cache_manager.add_dummy_requests(
                    list(range(bs)), is_gen=True, max_num_draft_tokens=draft_len, seq_slots=list(range(bs)))
                for req in requests:
                    req.is_context = False
                self.forward(ScheduledRequests([], requests))
        self.enable_spec_decode = True

    def _round_up_batch_size(self, batch_size):
        return next(bs for bs in self._cuda_graph_batch_sizes if bs >= batch_size)

    def _get_padded_batch(self, scheduled_requests: ScheduledRequests, kv_cache_manager) -> int:
        can_run_cuda_graph = scheduled_requests.can_run_cuda_graph
        batch_size = scheduled_requests.batch_size
        if (not self._run_cuda_graphs or not self._cuda_graph_padding_enabled or not can_run_cuda_graph
                or batch_size > self._max_cuda_graph_batch_size):
            return 0
        padded_batch_size = self._round_up_batch_size(batch_size)
        if batch_size == padded_batch_size:
            return 0
        padding_size = padded_batch_size - batch_size
        if self.cuda_graph_dummy_request is None:
            available_blocks = kv_cache_manager.get_num_free_blocks()
            if available_blocks < 1:
                return 0
            if _variant == "bug":
                max_draft_len = self.max_draft_len
            else:
                max_draft_len = self.max_draft_len if self.enable_spec_decode else 0
            self.cuda_graph_dummy_request = kv_cache_manager.add_dummy_requests(
                [CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True, max_num_draft_tokens=max_draft_len,
                seq_slots=[MAX_BATCH_SIZE])[0]
            self.cuda_graph_dummy_request.is_cuda_graph_dummy = True
        scheduled_requests.generation_requests.extend([self.cuda_graph_dummy_request] * padding_size)
        return padding_size

    def _maybe_get_cuda_graph(self, batch: ScheduledRequests):
        if not self._run_cuda_graphs or not batch.can_run_cuda_graph:
            return None
        batch_size = len(batch.generation_requests)
        draft_len = self.max_draft_len if self.enable_spec_decode else 0
        key = (batch_size, draft_len)
        if key in self._cuda_graphs:
            return self._cuda_graphs[key]
        if batch_size not in self._cuda_graph_batch_sizes:
            return None
        attn_metadata = self.attn_metadata.create_cuda_graph_metadata(batch_size)
        self._cuda_graphs[key] = DecodingCUDAGraphRunner(batch_size, self.device, attn_metadata, draft_len,
                                                          self.kv_cache)
        return self._cuda_graphs[key]

    def _prepare_tp_inputs(self, scheduled_requests: ScheduledRequests, attn_metadata):
        input_ids, position_ids, seq_lens, seq_slots = [], [], [], []
        for request in scheduled_requests.context_requests:
            input_ids += request.tokens
            position_ids += list(range(len(request.tokens)))
            seq_lens.append(len(request.tokens))
            seq_slots.append(request.py_seq_slot)
        for request in scheduled_requests.generation_requests:
            past_seen_token_num = len(request.tokens) - 1
            tokens = [request.tokens[-1]] + request.py_draft_tokens
            input_ids += tokens
            position_ids += list(range(past_seen_token_num, past_seen_token_num + len(tokens)))
            seq_lens.append(len(tokens))
            seq_slots.append(request.py_seq_slot)
        num_tokens = len(input_ids)
        self.input_ids_cuda[:num_tokens].copy_(torch.tensor(input_ids, dtype=torch.int64).to(self.device))
        self.position_ids_cuda[:num_tokens].copy_(torch.tensor(position_ids, dtype=torch.int64).to(self.device))
        attn_metadata.seq_lens, attn_metadata.seq_slots = seq_lens, seq_slots
        attn_metadata.prepare()
        return {"input_ids": self.input_ids_cuda[:num_tokens], "position_ids": self.position_ids_cuda[:num_tokens],
                "attn_metadata": attn_metadata}

    def _forward_step(self, inputs):
        return self.model.forward(inputs["input_ids"], inputs["position_ids"], inputs["attn_metadata"], self.kv_cache)

    def forward(self, scheduled_requests: ScheduledRequests):
        num_real_tokens = (sum(len(r.tokens) for r in scheduled_requests.context_requests)
                           + sum(1 + len(r.py_draft_tokens) for r in scheduled_requests.generation_requests))
        padding_size = self._get_padded_batch(scheduled_requests, self.kv_cache_manager)
        try:
            maybe_graph = self._maybe_get_cuda_graph(scheduled_requests)
            attn_metadata = maybe_graph.attn_metadata if maybe_graph is not None else self.attn_metadata
            inputs = self._prepare_tp_inputs(scheduled_requests, attn_metadata)
            if maybe_graph is None:
                logits = self._forward_step(inputs)
            else:
                if maybe_graph.needs_capture():
                    maybe_graph.capture(self._forward_step)
                logits = maybe_graph.run(inputs, num_real_tokens)
            return logits[:num_real_tokens]
        finally:
            if padding_size > 0:
                del scheduled_requests.generation_requests[-padding_size:]


# --- tensorrt_llm/_torch/pyexecutor/py_executor.py (reduced loop, two-model drafter) ----------------------------------

def _serve(device, use_cuda_graph):
    engine = PyTorchModelEngine(device, use_cuda_graph)
    gen = generator(123)
    active = [LlmRequest(100 + i, tokens=torch.randint(0, VOCAB, (n,), generator=gen).tolist(), py_seq_slot=i,
                         max_new_tokens=m) for i, (n, m) in enumerate(((5, 8), (4, 8), (6, 3)))]
    outs = []
    for _ in range(6):
        if not active:
            break
        context = [r for r in active if r.is_context]
        generation = [r for r in active if not r.is_context]
        if not context:
            # the drafter is used only while at most max_concurrency requests are active
            engine.enable_spec_decode = len(active) <= MAX_CONCURRENCY
            for r in generation:
                r.py_draft_tokens = (engine.model.draft(r.tokens[-1], engine.max_draft_len)
                                     if engine.enable_spec_decode else [])
        batch = ScheduledRequests(context, [] if context else generation)
        logits = engine.forward(batch)
        outs.append(logits.clone())
        target = torch.argmax(logits, dim=-1).tolist()
        offset = 0
        for r in batch.context_requests + batch.generation_requests:      # sampler: greedy verification
            n = len(r.tokens) if r.is_context else 1 + len(r.py_draft_tokens)
            rows = target[offset:offset + n]
            offset += n
            if r.is_context:
                new = [rows[-1]]
                r.is_context = False
            else:
                accepted = 1
                while accepted < n and r.py_draft_tokens[accepted - 1] == rows[accepted - 1]:
                    accepted += 1
                new = rows[:accepted]
            new = new[:r.max_new_tokens - r.num_generated]
            r.tokens += new
            r.num_generated += len(new)
        active = [r for r in active if r.num_generated < r.max_new_tokens]
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
