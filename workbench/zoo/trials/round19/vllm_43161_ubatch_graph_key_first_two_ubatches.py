"""DBO's microbatched FULL graph is stored under the first two microbatches' tokens, so every step re-captures.

Upstream: https://github.com/vllm-project/vllm/pull/43161 ("[Bugfix] Fix UBatchWrapper CUDA graph key to sum
all ubatches, not just first two"), fixing https://github.com/vllm-project/vllm/issues/43145.
Symptom: with dual-batch overlap for the MoE all2all (``--enable-dbo``) and ``--ubatch-size`` 3 or more,
FULL-graph steps never find their captured graph: each microbatched step captures a new one (vLLM main,
May 2026).
Mechanism: ``UBatchWrapper.__call__`` looks a graph up by the step's total tokens, ``sum(ubatch_slice.
num_tokens for ubatch_slice in ubatch_slices)``, but ``_capture_ubatches`` stores it under
``ubatch_metadata[0].num_tokens + ubatch_metadata[1].num_tokens``. With three microbatches the keys
differ, so a served step takes the capture branch again, and the capture branch returns the graph's
static outputs from the capture itself. A capture launches no kernels: what the step hands on is whatever
the new graph's output memory holds (on the CPU emulation, the capture's poison), and memory grows by a
graph per step.
Doctor: warmup-divergence, at ``_capture_ubatches`` (the key chosen at capture is not the one a served step
looks up, so serving re-enters the capture path).
Fix (upstream): ``num_tokens = sum(m.num_tokens for m in ubatch_metadata)`` in ``_capture_ubatches``.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/43161"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_capture_ubatches"
SYMPTOM = "with --ubatch-size 3 every microbatched step re-captures and returns uncomputed graph outputs"

VOCAB, DIM, NUM_EXPERTS = 16, 4, 3
UBATCH_SIZE, CAPTURE_SIZE = 3, 12              # one FULL graph: 12 tokens in 3 microbatches of 4
MAX_NUM_TOKENS = CAPTURE_SIZE


class MoEModel:
    """Embedding, a top-1 routed MoE layer (the part DBO overlaps with its all2all), and a head."""

    def __init__(self, device):
        gen = generator(43161)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.w_experts = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)
        self.head = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def __call__(self, input_ids):
        h = self.emb[input_ids]
        topk_ids = torch.argmax(h @ self.gate, dim=-1)
        h = h + torch.bmm(h[:, None, :], self.w_experts[topk_ids]).squeeze(1)
        return h @ self.head


@dataclasses.dataclass
class UBatchSlice:
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start


@dataclasses.dataclass
class UbatchMetadata:
    input_ids: torch.Tensor
    num_tokens: int


@dataclasses.dataclass
class CUDAGraphMetaData:
    cudagraph: object
    outputs: torch.Tensor


def ubatch_split(num_tokens: int) -> list[UBatchSlice]:
    per = num_tokens // UBATCH_SIZE
    return [UBatchSlice(slice(i * per, (i + 1) * per if i < UBATCH_SIZE - 1 else num_tokens))
            for i in range(UBATCH_SIZE)]


class UBatchWrapper:
    def __init__(self, runnable, device, variant):
        self.runnable, self.device, self.variant = runnable, device, variant
        self.cudagraphs: dict[int, CUDAGraphMetaData] = {}
        self.graph_pool = graph_pool_handle(device)

    def _make_ubatch_metadata(self, input_ids, ubatch_slices):
        return [UbatchMetadata(input_ids[s.token_slice], s.num_tokens) for s in ubatch_slices]

    def _capture_ubatches(self, ubatch_metadata, model):
        cudagraph = new_graph(self.device)
        with graph(cudagraph, pool=self.graph_pool, name=f"DBO x{len(ubatch_metadata)}"):
            # the microbatch threads hand off to each other; their kernels land in one graph
            outputs = torch.cat([model(m.input_ids) for m in ubatch_metadata])
        if self.variant == "fix":
            num_tokens = sum(m.num_tokens for m in ubatch_metadata)
        else:
            num_tokens = ubatch_metadata[0].num_tokens + ubatch_metadata[1].num_tokens
        self.cudagraphs[num_tokens] = CUDAGraphMetaData(cudagraph, outputs)
        return outputs

    def __call__(self, input_ids, ubatch_slices, cudagraph_runtime_mode="FULL"):
        num_tokens = sum(ubatch_slice.num_tokens for ubatch_slice in ubatch_slices)
        if cudagraph_runtime_mode == "FULL" and num_tokens not in self.cudagraphs:
            ubatch_metadata = self._make_ubatch_metadata(input_ids, ubatch_slices)
            return self._capture_ubatches(ubatch_metadata, self.runnable)
        entry = self.cudagraphs[num_tokens]
        events.serve(entry.cudagraph, num_tokens, num_tokens, outputs=entry.outputs,
                     eager=lambda: self.runnable(input_ids[:num_tokens]))
        entry.cudagraph.replay()
        events.handed_out(entry.cudagraph, entry.outputs)
        return entry.outputs


def run(variant: str, device: str = "cpu"):
    model = MoEModel(device)
    gen = torch.Generator().manual_seed(7)
    steps = [torch.randint(0, VOCAB, (CAPTURE_SIZE,), generator=gen) for _ in range(3)]

    def eager():
        return [model(ids.to(device)) for ids in steps]

    def served():
        input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        events.static_buffers("GPUModelRunner (DBO, FULL)", {"input_ids": input_ids})
        wrapper = UBatchWrapper(model, device, variant)
        # capture_model -> _dummy_run(CAPTURE_SIZE, microbatched): one warmup, then the capture
        with events.warmup():
            model(input_ids[:CAPTURE_SIZE])
        wrapper(input_ids, ubatch_split(CAPTURE_SIZE))
        outs = []
        for ids in steps:                                   # decode steps of 12 tokens (DP/EP ranks in step)
            input_ids[:CAPTURE_SIZE].copy_(ids.to(device))
            outs.append(wrapper(input_ids, ubatch_split(CAPTURE_SIZE)).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
