"""TRT-LLM keeps a captured graph's output only as a weak ref: a later capture into the shared pool lands on it.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/17010 ("[https://nvbugs/6525011][fix] Store the owning
output tensor in _graph_output_refs for each graph's lifetime", commit 60e7fcaeaf).
Symptom: accuracy test failures with CUDA graphs in the PyTorch backend (``TestLagunaXS::test_fp8`` waived
on B200/B300 until the fix), TensorRT-LLM main, July/August 2026.
Mechanism: ``CUDAGraphRunner.capture()`` passes each graph's output through ``make_weak_ref()`` so that
intermediate activations can be freed, and keeps nothing else. The output's block in the runner's shared
graph memory pool is therefore *free* while the graph is still replayable: the next capture into the pool
(graphs are captured per batch size, largest first, and lazily for keys that show up while serving) can be
handed that very block for one of its own tensors. From then on two graphs write the same memory: a replay
of the smaller graph overwrites the logits that the larger graph handed out. Any logits still in use when
the other graph replays are corrupted. The PR names no consumer; here, as in the overlap scheduler, the
previous iteration's outputs (kept for its log-probs) are processed after the next iteration's forward has
been enqueued, and the batch size changed between them, so the next forward replays the other graph.
Doctor: overwritten-output, at ``_process_previous_batch`` (the read of the handed-out logits after the
other graph's replay overwrote their block).
Fix (upstream): keep the owning output tensor in ``_graph_output_refs[key]`` for the graph's lifetime (cleared
in ``clear()`` before ``graph.reset()``), so no later capture can be placed on it; callers still get the weak ref.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/17010"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_process_previous_batch"
SYMPTOM = "a graph's handed-out logits are overwritten by another batch size's graph replay (wrong log-probs/tokens)"
VOCAB, HIDDEN, MAX_BS = 8, 16, 4
CUDA_GRAPH_BATCH_SIZES = [4, 2]            # captured largest first, into one pool


class Model:
    def __init__(self, device):
        gen = generator(17010)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.3)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens[input_ids]              # [bs, HIDDEN]: the capture's first block
        return torch.log_softmax(torch.tanh(hidden_states) @ self.lm_head, dim=-1)


class _WeakRefTensor:
    """``make_weak_ref`` (``_torch/utils.py``): the output's address, not its ownership."""

    def __init__(self, t):
        self._meta = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.is_cuda:
            self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                             "typestr": "<f4", "version": 2}
        else:
            self._ref = StorageWeakRef(t.untyped_storage())

    def tensor(self):
        offset, shape, stride, dtype, device = self._meta
        if device.type == "cuda":
            return torch.as_tensor(self, device=device).view(dtype)
        storage = torch.UntypedStorage._new_with_weak_ptr(self._ref.cdata)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def make_weak_ref(x):
    return _WeakRefTensor(x)


class CUDAGraphRunner:
    def __init__(self, device, fixed: bool):
        self.device, self.fixed = device, fixed
        self.graphs, self.graph_outputs, self._graph_output_refs = {}, {}, {}
        self.memory_pool = graph_pool_handle(device)
        self.input_ids = torch.zeros(MAX_BS, dtype=torch.long, device=device)   # shared static tensor

    def capture(self, key, forward_fn):
        bs = key
        g, output = capture(lambda: forward_fn(self.input_ids[:bs]), device=self.device, pool=self.memory_pool,
                            warmups=2, name=f"bs {bs}", static={"input_ids": self.input_ids},
                            owner="CUDAGraphRunner")
        self.graphs[key] = g
        # Mark weak ref here. The output tensor should be freed properly.
        self.graph_outputs[key] = make_weak_ref(output)
        if self.fixed:
            self._graph_output_refs[key] = output      # the owning tensor lives as long as the graph
        del output

    def replay(self, key, input_ids):
        self.input_ids[:key].copy_(input_ids)
        return replay(self.graphs[key], self.graph_outputs[key].tensor())


def _process_previous_batch(previous):
    """Overlap scheduler: the previous iteration's log-probs of its sampled tokens, read after the next
    iteration's forward was enqueued."""
    logits, tokens = previous
    return logits.gather(1, tokens[:, None]).squeeze(1).clone()


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(17)
    # iteration -> batch of input ids: the generation batch size changes from one iteration to the next
    batches = [torch.randint(0, VOCAB, (bs,), generator=gen).to(device) for bs in (4, 2, 4)]

    def loop(forward):
        outs, previous = [], None
        for input_ids in batches:
            logits = forward(input_ids)
            tokens = logits.argmax(-1)
            if previous is not None:
                outs.append(_process_previous_batch(previous))
            previous = (logits, tokens)
        outs.append(_process_previous_batch(previous))
        return outs

    def eager():
        model = Model(device)
        return loop(model.forward)

    def served():
        model = Model(device)
        runner = CUDAGraphRunner(device, fixed=(variant == "fix"))
        for bs in CUDA_GRAPH_BATCH_SIZES:
            runner.capture(bs, model.forward)
        return loop(lambda input_ids: runner.replay(input_ids.shape[0], input_ids))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
