"""Capturable guided decoder lays out its bitmask for max_draft_len; a draft_len-0 graph has fewer logits rows.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/15023 ("[#15022][fix] Guided decoding (xgrammar) + EAGLE-3 +
draft_len_schedule reaching 0 crashes during CUDA graph capture, 'bitmask must have the same batch size as
logits'").
Symptom (issue #15022): PyTorch backend, guided decoding (xgrammar) with EAGLE-3 one-model speculative decoding and
a ``draft_len_schedule`` that reaches 0 for large batch sizes: the executor crashed while capturing the generation
CUDA graphs (``_capture_generation_cuda_graphs`` -> ``CUDAGraphRunner.capture`` -> ``capture_forward_fn``) with
"bitmask must have the same batch size as logits" (TensorRT-LLM main, June 2026).
Mechanism: with CUDA graphs the engine uses the ``CapturableGuidedDecoder``: ``add_batch`` registers the scheduled
requests and lays out one bitmask row per token the graph will produce, ``build`` fills the rows on the host and
copies them into its persistent device bitmask, and the captured forward applies the bitmask to the logits
(``_apply_bitmask``). ``add_batch`` assumed every generation request carries ``max_draft_len`` draft tokens -- the
padded spec-decode token layout -- so it laid out ``batch_size * (max_draft_len + 1)`` rows. With a
``draft_len_schedule`` the runtime draft length of a batch size can be smaller, down to 0; the graph for that
``(batch_size, draft_len)`` key runs ``batch_size * (runtime_draft_len + 1)`` tokens, so its logits have fewer
rows than the bitmask. The warmup of the capture of the draft_len-0 graph combines the two and fails the
bitmask/logits batch check. The eager (non-capturable) ``GuidedDecoder`` lays out rows from the requests' actual
draft tokens and is not affected.
Doctor: padded-shape-mismatch, at ``_apply_bitmask`` (the graph's forward combines a bitmask sized for the padded
max-draft-length token layout with logits sized for the runtime draft length).
Fix (upstream): ``add_batch(scheduled_requests, runtime_draft_len=None)``; the model engine passes the batch's
runtime draft length, and the bitmask layout uses it (``max_draft_len`` only when none is given).
(Read: the issue's traceback and the fix's ``add_batch`` signature change with the review pointing to the model
engine call site that now passes ``runtime_draft_len``; the rest of the diff was not read. The grammar, the
EAGLE-3 drafter and the target model are reduced to toys; the bitmask is a bool mask instead of packed int32
words; outputs are the masked token probabilities.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/15023"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_apply_bitmask"
SYMPTOM = "capturing the draft_len-0 generation graph fails: 'bitmask must have the same batch size as logits'"
VOCAB, DIM, MAX_CTX = 8, 4, 16
MAX_DRAFT_LEN = 2
CUDA_GRAPH_BATCH_SIZES = [1, 2]
DRAFT_LEN_SCHEDULE = {1: 2, 2: 0}          # batch size -> runtime draft length (reaches 0)
MAX_TOKENS = max(CUDA_GRAPH_BATCH_SIZES) * (MAX_DRAFT_LEN + 1)


@dataclasses.dataclass
class LlmRequest:
    request_id: int
    last_token: int
    position: int
    py_draft_tokens: list[int]
    is_dummy: bool = False


@dataclasses.dataclass
class ScheduledRequests:
    generation_requests: list[LlmRequest]

    @property
    def batch_size(self) -> int:
        return len(self.generation_requests)


def grammar_allows(prev_token: int) -> list[bool]:
    """A toy xgrammar matcher: the tokens allowed after ``prev_token``."""
    return [(tok + prev_token) % 3 != 0 for tok in range(VOCAB)]


def request_bitmask_rows(request: LlmRequest, num_draft_tokens: int) -> list[list[bool]]:
    """One row per token position the request occupies: the last accepted token, then its draft tokens."""
    prev = [request.last_token] + request.py_draft_tokens[:num_draft_tokens]
    return [[True] * VOCAB if request.is_dummy else grammar_allows(p) for p in prev]


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    if bitmask.shape[0] != logits.shape[0]:                     # xgrammar apply_token_bitmask_inplace
        raise ValueError(f"bitmask must have the same batch size as logits "
                         f"(bitmask {bitmask.shape[0]} rows, logits {logits.shape[0]} rows)")
    return logits.masked_fill(~bitmask, -1e4)


class GuidedDecoder:
    """Eager path: rows laid out from each request's actual draft tokens."""

    def __init__(self, device):
        self.device = device

    def add_batch(self, scheduled_requests: ScheduledRequests, runtime_draft_len=None) -> None:
        self.requests = scheduled_requests.generation_requests

    def build(self) -> None:
        rows = [r for req in self.requests for r in request_bitmask_rows(req, len(req.py_draft_tokens))]
        self.bitmask = torch.tensor(rows).to(self.device)

    def execute(self, logits):
        return _apply_bitmask(logits, self.bitmask)


class CapturableGuidedDecoder:
    """Graph path: a persistent device bitmask, laid out by ``add_batch`` and filled by ``build``."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.max_num_draft_tokens = MAX_DRAFT_LEN
        self.bitmask = torch.ones(MAX_TOKENS, VOCAB, dtype=torch.bool, device=device)

    def add_batch(self, scheduled_requests: ScheduledRequests, runtime_draft_len=None) -> None:
        self.requests = scheduled_requests.generation_requests
        self.num_draft_tokens = self.max_num_draft_tokens if runtime_draft_len is None else runtime_draft_len
        self.num_bitmask_tokens = len(self.requests) * (self.num_draft_tokens + 1)

    def build(self) -> None:
        rows = []
        for req in self.requests:
            req_rows = request_bitmask_rows(req, self.num_draft_tokens)
            rows += req_rows + [[True] * VOCAB] * (self.num_draft_tokens + 1 - len(req_rows))
        self.bitmask[:self.num_bitmask_tokens].copy_(torch.tensor(rows).to(self.device))

    def execute(self, logits):
        return _apply_bitmask(logits, self.bitmask[:self.num_bitmask_tokens])


class TargetModel:
    def __init__(self, device):
        gen = generator(15023)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_CTX, DIM, gen=gen, device=device, scale=0.5)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, position_ids):
        x = self.embed[input_ids] + self.pos_embed[position_ids]
        return torch.tanh(x @ self.w) @ self.lm_head


class CUDAGraphRunner:
    WARMUP_STEPS = 2

    def __init__(self, device):
        self.device = device
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.graphs, self.graph_outputs = {}, {}

    def needs_capture(self, key) -> bool:
        return key not in self.graphs

    def capture(self, key, forward_fn, extra_static):
        n = key[0] * (key[1] + 1)
        ids, pos = self.input_ids[:n], self.position_ids[:n]
        self.graphs[key], self.graph_outputs[key] = capture(
            lambda: forward_fn(ids, pos), device=self.device, warmups=self.WARMUP_STEPS,
            name=f"generation bs {key[0]} draft_len {key[1]}", owner="CUDAGraphRunner",
            static={"input_ids": ids, "position_ids": pos, **extra_static})

    def replay(self, key, input_ids, position_ids):
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.position_ids[:n].copy_(position_ids)
        return replay(self.graphs[key], self.graph_outputs[key])


class PyTorchModelEngine:
    def __init__(self, model, device, variant, use_cuda_graph):
        self.model, self.device, self.variant = model, device, variant
        self.use_cuda_graph = use_cuda_graph
        self.guided_decoder = CapturableGuidedDecoder(device, variant) if use_cuda_graph else GuidedDecoder(device)
        self.cuda_graph_runner = CUDAGraphRunner(device) if use_cuda_graph else None

    def _forward_step(self, input_ids, position_ids):
        logits = self.model.forward(input_ids, position_ids)
        return torch.softmax(self.guided_decoder.execute(logits), -1)

    def _prepare_inputs(self, batch: ScheduledRequests, runtime_draft_len: int):
        ids, pos = [], []
        for req in batch.generation_requests:
            req.py_draft_tokens = req.py_draft_tokens[:runtime_draft_len]
            toks = [req.last_token] + req.py_draft_tokens
            ids += toks
            pos += [req.position + j for j in range(len(toks))]
        return torch.tensor(ids).to(self.device), torch.tensor(pos).to(self.device)

    def forward(self, batch: ScheduledRequests):
        runtime_draft_len = DRAFT_LEN_SCHEDULE[batch.batch_size]
        input_ids, position_ids = self._prepare_inputs(batch, runtime_draft_len)
        if self.variant == "fix":
            self.guided_decoder.add_batch(batch, runtime_draft_len=runtime_draft_len)
        else:
            self.guided_decoder.add_batch(batch)
        self.guided_decoder.build()
        if not self.use_cuda_graph:
            return self._forward_step(input_ids, position_ids)
        key = (batch.batch_size, runtime_draft_len)
        runner = self.cuda_graph_runner
        if runner.needs_capture(key):
            runner.capture(key, self._forward_step, {"guided_bitmask": self.guided_decoder.bitmask})
        return runner.replay(key, input_ids, position_ids)

    def _capture_generation_cuda_graphs(self):
        for bs in CUDA_GRAPH_BATCH_SIZES:
            draft_len = DRAFT_LEN_SCHEDULE[bs]
            dummies = [LlmRequest(-1 - i, 0, 0, [0] * draft_len, is_dummy=True) for i in range(bs)]
            self.forward(ScheduledRequests(dummies))


def run(variant: str, device: str = "cpu"):
    model = TargetModel(device)
    drafts = [[(1, 2, 4, [3, 5]), ], [(1, 4, 7, [2, 6]), (2, 5, 5, [1, 1])], [(1, 7, 10, [6, 2])]]

    def batches():
        return [ScheduledRequests([LlmRequest(rid, last, pos, list(d)) for rid, last, pos, d in step])
                for step in drafts]

    def eager():
        engine = PyTorchModelEngine(model, device, variant, use_cuda_graph=False)
        return [engine.forward(b) for b in batches()]

    def served():
        engine = PyTorchModelEngine(model, device, variant, use_cuda_graph=True)
        engine._capture_generation_cuda_graphs()
        return [engine.forward(b).clone() for b in batches()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
