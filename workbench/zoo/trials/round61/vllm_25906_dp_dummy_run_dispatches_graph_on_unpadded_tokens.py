"""An idle DP rank's dummy run replays the graph of its own 1-token count while its peers replay the padded size.

Upstream: https://github.com/vllm-project/vllm/pull/25906 ("[BugFix] Fix DP/EP hang").
Symptom: DP + EP (MoE all2all) serving with CUDA graphs hangs as soon as one DP rank is idle while its
peers decode: "hang caused by improperly sized cudagraph in the dummy runs" (vLLM V1, September 2025).
Mechanism: an idle DP rank still has to join the MoE dispatch/combine of the busy ranks, so
``execute_dummy_batch`` calls ``GPUModelRunner._dummy_run(1)``. ``_dummy_run`` synchronises the token
count across DP (``get_dp_padding`` -> ``num_tokens_across_dp``) and sizes its batch to
``num_tokens_after_padding`` (the DP max, padded to a capture size: the same on every rank, and the size
the busy ranks' ``execute_model`` dispatches). It then picked the captured graph with
``self.cudagraph_dispatcher.dispatch(BatchDescriptor(num_tokens=num_tokens, ...))``: the *local, unpadded*
count, 1. The idle rank replays the graph captured for 1 token, whose all2all dispatch, expert GEMM and
combine cover one row per rank, for a step that must serve ``num_tokens_after_padding`` rows. On GPUs the
mismatched collective sizes deadlock; here the collectives are shared buffers that each rank's graphs write
in lockstep (``DPGroup``), so the busy rank's combine reads the idle rank's expert results for rows 1.. from
an earlier step.
Doctor: undersized-buffer, at ``_dummy_run`` (it replays the 1-token graph for an 8-token step: the replay
is asked to serve more rows than that graph captured).
Fix (upstream): ``BatchDescriptor(num_tokens=num_tokens_after_padding, ...)`` in ``_dummy_run``: the idle
rank dispatches the same DP-synchronised, padded size as its peers.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/25906"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_dummy_run"
SYMPTOM = "an idle DP rank replays its 1-token graph in an 8-token step: the busy rank's MoE combine reads stale rows"
DP_SIZE, HIDDEN, CUDAGRAPH_BATCH_SIZES = 2, 4, (1, 2, 4, 8)
MAX_NUM_TOKENS = CUDAGRAPH_BATCH_SIZES[-1]


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    uniform_decode: bool = True


class CudagraphDispatcher:
    """The keys that were captured: a descriptor dispatches to the key of its own size, if captured."""

    def __init__(self):
        self.cudagraph_keys = {BatchDescriptor(n) for n in CUDAGRAPH_BATCH_SIZES}

    def dispatch(self, batch_descriptor: BatchDescriptor):
        return ("FULL", batch_descriptor) if batch_descriptor in self.cudagraph_keys else ("NONE", None)


def pad_for_cudagraph(n: int) -> int:
    return next(size for size in CUDAGRAPH_BATCH_SIZES if size >= n)


class DPGroup:
    """The EP all2all in miniature: symmetric buffers every DP rank reads and writes. A collective is a
    rendezvous, so each step's graphs run phase by phase on all ranks (dispatch, experts, combine)."""

    def __init__(self, device):
        self.dispatch_buf = torch.zeros(DP_SIZE, MAX_NUM_TOKENS, HIDDEN, device=device)   # [src rank, row]
        self.combine_buf = torch.zeros(DP_SIZE, DP_SIZE, MAX_NUM_TOKENS, HIDDEN, device=device)  # [dst, expert]

    def get_dp_padding(self, num_tokens_across_dp: list[int]) -> int:
        """all_reduce of the ranks' token counts: the padded size every rank runs."""
        return pad_for_cudagraph(max(num_tokens_across_dp))


class MoEModel:
    """One MoE layer with one expert per DP rank (EP = DP); every token goes to every expert."""

    def __init__(self, rank, group, w_experts):
        self.rank, self.group, self.w_experts = rank, group, w_experts

    def dispatch(self, x, n):                     # all2all dispatch: my rows into my slot
        self.group.dispatch_buf[self.rank, :n].copy_(x[:n])

    def experts(self, n):                         # my expert on every rank's first n rows
        out = torch.tanh(self.group.dispatch_buf[:, :n] @ self.w_experts[self.rank])
        self.group.combine_buf[:, self.rank, :n].copy_(out)

    def combine(self, x, hidden_states, n):       # all2all combine: every expert's result for my rows
        hidden_states[:n].copy_(x[:n] + self.group.combine_buf[self.rank, :, :n].sum(0))


class GPUModelRunner:
    def __init__(self, rank, group, w_experts, variant, device, pool):
        self.rank, self.variant, self.device, self.pool = rank, variant, device, pool
        self.model = MoEModel(rank, group, w_experts)
        self.group = group
        self.cudagraph_dispatcher = CudagraphDispatcher()
        self.inputs_embeds = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.graphs = {}                          # BatchDescriptor -> (dispatch, experts, combine) graphs

    def capture_model(self):
        owner = f"vllm GPUModelRunner (DP rank {self.rank})"
        for n in reversed(CUDAGRAPH_BATCH_SIZES):
            m, x, h = self.model, self.inputs_embeds, self.hidden_states
            pieces = (lambda n=n: m.dispatch(x, n), lambda n=n: m.experts(n), lambda n=n: m.combine(x, h, n))
            graphs = []
            for i, fn in enumerate(pieces):
                g, _ = capture(fn, device=self.device, pool=self.pool, name=f"rank{self.rank} n={n} piece{i}",
                               static={"inputs_embeds": x}, owner=owner,
                               state={"dispatch_buf": self.group.dispatch_buf,
                                      "combine_buf": self.group.combine_buf})
                graphs.append(g)
            self.graphs[BatchDescriptor(n)] = graphs

    def execute_model(self, tokens: torch.Tensor, num_tokens_across_dp: list[int]):
        """A busy rank: its real rows, padded to the DP-synchronised size; returns the step's phases."""
        num_tokens = tokens.shape[0]
        num_input_tokens = self.group.get_dp_padding(num_tokens_across_dp)
        self.inputs_embeds[:num_tokens].copy_(tokens)
        _, batch_descriptor = self.cudagraph_dispatcher.dispatch(BatchDescriptor(num_input_tokens))
        return self.graphs[batch_descriptor], num_tokens, num_input_tokens

    def _dummy_run(self, num_tokens: int, num_tokens_across_dp: list[int]):
        """An idle rank joins its peers' collectives with a dummy batch."""
        num_tokens_after_padding = self.group.get_dp_padding(num_tokens_across_dp)
        self.inputs_embeds[:num_tokens_after_padding].zero_()
        # filter out the valid batch descriptor
        if self.variant == "bug":
            _cg_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(BatchDescriptor(num_tokens=num_tokens))
        else:
            _cg_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(
                BatchDescriptor(num_tokens=num_tokens_after_padding))
        return self.graphs[batch_descriptor], num_tokens_after_padding, num_tokens_after_padding


def run(variant: str, device: str = "cpu"):
    gen = generator(25906)
    w_experts = randn(DP_SIZE, HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
    # Per step, each DP rank's decode tokens (None: the rank is idle and runs the dummy batch).
    counts = [(6, 3), (7, None), (5, None), (8, 2)]
    steps = [[None if n is None else randn(n, HIDDEN, gen=gen, device=device) for n in c] for c in counts]

    def eager():
        outs = []
        for step in steps:
            for x in step:
                if x is not None:
                    outs.append(x + sum(torch.tanh(x @ w_experts[e]) for e in range(DP_SIZE)))
        return outs

    def served():
        group, pool = DPGroup(device), graph_pool_handle(device)
        runners = [GPUModelRunner(r, group, w_experts, variant, device, pool) for r in range(DP_SIZE)]
        for runner in runners:
            runner.capture_model()
        outs = []
        for step in steps:
            num_tokens_across_dp = [1 if x is None else x.shape[0] for x in step]
            plans = [runner._dummy_run(1, num_tokens_across_dp) if x is None
                     else runner.execute_model(x, num_tokens_across_dp) for runner, x in zip(runners, step)]
            for phase in range(3):                # each collective is a rendezvous of all DP ranks
                for runner, (graphs, real, _needed) in zip(runners, plans):
                    captured = next(d.num_tokens for d, gs in runner.graphs.items() if gs is graphs)
                    padded = {"inputs_embeds": runner.inputs_embeds} if real < captured else None
                    replay(graphs[phase], runner.hidden_states, real=real, size=captured, padded=padded)
            for runner, x, (_, real, _) in zip(runners, step, plans):
                if x is not None:
                    outs.append(runner.hidden_states[:real].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
