"""A second LLM in one worker captures into the first LLM's released graph pool: the handle was cached at class scope.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/16952 ("[https://nvbugs/6475346][fix] Avoid stale CUDA graph
pool reuse").
Symptom: QA session-reuse runs (a DeepSeekV3Lite LLM, then a Gemma3 LLM created in the same MPI worker) with
``torch_compile`` on failed at the second LLM's generation-only CUDA graph capture, inside ``CUDACachingAllocator``
with ``use_count > 0`` (B300/GB300, RTX PRO 6000; TensorRT-LLM main, July 2026).
Mechanism: the torch.compile ``Backend`` created a CUDA graph pool handle once and kept it at class scope
(``Backend._graph_pool_handle``), and the model engine handed that handle to the outer generation
``CUDAGraphRunner`` as its ``memory_pool``. The first LLM's captures all went into that private pool; at shutdown
its engine reset its graphs (``_release_cuda_graphs``), which released the pool -- but the class still held the
old handle tuple. The second LLM's engine got the same stale handle, and its first capture asked the allocator to
allocate into a pool that no graph uses any more while memory it handed out is still referenced: the allocator
refuses (``TORCH_INTERNAL_ASSERT(use_count > 0)``). An eager run of both LLMs never touches the pool.
Doctor: dangling-reference, at ``__init__`` (``Backend.__init__`` keeps the graph pool handle at class scope, so
it outlives the graphs that owned the pool, and the next engine's runner captures into the released pool).
Fix (upstream): remove the Backend parameter and the class-level registration; piecewise CUDA graphs keep their own
pool (``piecewise_optimizer`` already replaced the handle with a fresh ``graph_pool_handle``), and the generation
runner starts without a pool, so its first capture creates one that later captures share through ``graph.pool()``.
(I read the PR description, not the diff. ``Backend._graph_pool_handle`` and the engine's ``_cuda_graph_mem_pool``
are from my recollection of the TRT-LLM sources, not checked against the diff; ``PyExecutor.previous_batch`` and
the toy's ``generate`` are stand-ins. What still referenced the old pool's memory upstream is not stated (without
such a reference CUDA lets the handle start a new pool); in the toy it is the first executor's last step output
(a one-request step: a view of the batch-1 graph's output), which ``PyExecutor`` still holds because the reused
session keeps the first LLM object alive. The Backend compiles nothing here.)
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/16952"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "__init__"
SYMPTOM = "the second LLM in a worker fails its first CUDA graph capture (stale class-level graph pool handle)"

VOCAB, DIM, MAX_POS = 12, 4, 16
CUDA_GRAPH_BATCH_SIZES = [1, 2]
WARMUP_STEPS = 2


class Backend:
    """The torch.compile backend (``tensorrt_llm/_torch/compilation/backend.py``); only its pool handle matters."""

    _graph_pool_handle = None

    def __init__(self, device, variant):
        self.variant = variant
        if variant == "bug" and Backend._graph_pool_handle is None:
            Backend._graph_pool_handle = graph_pool_handle(device)


class DecoderModel:
    def __init__(self, seed, device):
        gen = generator(seed)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, position_ids):
        h = self.embed[input_ids] + self.pos_embed[position_ids]
        return (h + torch.tanh(h @ self.w)) @ self.lm_head


class CUDAGraphRunner:
    """The generation-only graph runner: one graph per batch size, all in one private memory pool."""

    def __init__(self, model, device, cuda_graph_mem_pool):
        self.model, self.device = model, device
        self.memory_pool = cuda_graph_mem_pool
        max_bs = max(CUDA_GRAPH_BATCH_SIZES)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.graphs, self.graph_outputs = {}, {}

    def capture(self, batch_size):
        ids, pos = self.input_ids[:batch_size], self.position_ids[:batch_size]
        g, out = capture(lambda: self.model.forward(ids, pos), device=self.device, pool=self.memory_pool,
                         warmups=WARMUP_STEPS, name=f"generation bs {batch_size}", owner="CUDAGraphRunner",
                         static={"input_ids": self.input_ids, "position_ids": self.position_ids})
        self.memory_pool = g.pool()          # later captures share the first capture's pool
        self.graphs[batch_size], self.graph_outputs[batch_size] = g, out

    def replay(self, input_ids, position_ids):
        bs = input_ids.shape[0]
        self.input_ids[:bs].copy_(input_ids)
        self.position_ids[:bs].copy_(position_ids)
        return replay(self.graphs[bs], self.graph_outputs[bs])

    def clear(self):
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.graph_outputs.clear()
        self.memory_pool = None


class PyTorchModelEngine:
    def __init__(self, model, device, variant, use_cuda_graph):
        self.model = model
        self._torch_compile_enabled = True
        self._torch_compile_backend = Backend(device, variant)
        if variant == "bug":
            self._cuda_graph_mem_pool = (self._torch_compile_backend._graph_pool_handle
                                         if self._torch_compile_enabled else None)
        else:
            self._cuda_graph_mem_pool = None             # the runner's first capture creates its pool
        self.cuda_graph_runner = (CUDAGraphRunner(model, device, self._cuda_graph_mem_pool)
                                  if use_cuda_graph else None)

    def warmup(self):
        if self.cuda_graph_runner is not None:
            for bs in reversed(CUDA_GRAPH_BATCH_SIZES):   # larger first: smaller graphs reuse its memory
                self.cuda_graph_runner.capture(bs)

    def forward(self, input_ids, position_ids):
        runner = self.cuda_graph_runner
        if runner is not None and input_ids.shape[0] in runner.graphs:
            return runner.replay(input_ids, position_ids)
        return self.model.forward(input_ids, position_ids)

    def _release_cuda_graphs(self):
        if self.cuda_graph_runner is not None:
            self.cuda_graph_runner.clear()


class PyExecutor:
    def __init__(self, model_engine):
        self.model_engine = model_engine
        self.previous_batch = None            # the step in flight (overlap scheduler): its device outputs

    def step(self, input_ids, position_ids):
        logits = self.model_engine.forward(input_ids, position_ids)
        self.previous_batch = logits
        return logits

    def shutdown(self):
        self.model_engine._release_cuda_graphs()


class LLM:
    def __init__(self, model, device, variant, use_cuda_graph):
        engine = PyTorchModelEngine(model, device, variant, use_cuda_graph)
        engine.warmup()
        self._executor = PyExecutor(engine)

    def generate(self, requests):
        """Greedy decode; ``requests``: (last prompt token, prompt length, max new tokens). Finished requests
        leave the batch, so the batch shrinks as they complete."""
        dev = self._executor.model_engine.model.embed.device
        live = [list(r) for r in requests]
        outs = []
        while live:
            logits = self._executor.step(torch.tensor([r[0] for r in live], device=dev),
                                         torch.tensor([r[1] for r in live], device=dev))
            outs.append(logits.clone())
            for r, tok in zip(live, logits.argmax(-1).tolist()):
                r[0], r[1], r[2] = tok, r[1] + 1, r[2] - 1
            live = [r for r in live if r[2] > 0]
        return outs

    def shutdown(self):
        self._executor.shutdown()


def run(variant: str, device: str = "cpu"):
    models = [DecoderModel(16952, device), DecoderModel(6475346, device)]   # "DeepSeekV3Lite", then "Gemma3"
    workloads = [[(3, 2, 3), (7, 4, 2)], [(5, 3, 2), (1, 6, 3)]]

    def serve(graphed: bool):
        Backend._graph_pool_handle = None       # a fresh MPI worker process
        sessions, outs = [], []
        for model, requests in zip(models, workloads):
            llm = LLM(model, device, variant, use_cuda_graph=graphed)
            outs += llm.generate(requests)
            llm.shutdown()
            sessions.append(llm)                # session reuse: the finished LLM object stays referenced
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
