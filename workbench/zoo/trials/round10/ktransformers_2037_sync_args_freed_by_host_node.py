"""The captured host-function node of the CPU-expert sync reads an argument block its first run deleted.

Upstream: https://github.com/kvcache-ai/ktransformers/pull/2037 ("[fix](kt-kernel): CudaGraph replay fix
and Add MoE startup log", commit 6c9c9560).
Symptom: kt-kernel CPU/GPU hybrid MoE (routed experts on the CPU through ``CPUInfer``) served with CUDA
graphs: decode replays crash or hang in the MoE sync, or read garbage, after the first replay; eager decode
is fine (kt-kernel, June 2026).
Mechanism: ``CPUInfer::sync_with_cuda_stream`` allocates ``new SyncArgs{this, allow_n_pending}`` on every
call and enqueues the static ``sync_`` with ``cudaLaunchHostFunc(stream, &sync_, args)``; ``sync_`` waits
for the CPU task queue and then ``delete args``. Eagerly that is one allocation per launch. Under CUDA-graph
capture the host-function node is recorded once, with that one ``args`` pointer, and every replay calls
``sync_`` on it again: the first execution frees the block, and each later replay reads a ``SyncArgs``
whose owner (``sync_`` itself) has released it (a dangling ``cpuinfer`` pointer and ``allow_n_pending``).
Doctor: dangling-reference, at ``sync_`` (the host node's argument block, not the graph's memory, is
released while the graph still reads it by address).
Fix (upstream): drop ``delete args`` from ``sync_``: the block outlives the graph (it is leaked once per
captured launch, one small struct per eager call).
Emulation note: Python runs once at capture here, so the ``delete`` of the capturing launch happens during
capture and already the first replay reads the freed block (upstream: from the second replay on).
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kvcache-ai/ktransformers/pull/2037"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "sync_"
SYMPTOM = "replays of the decode graph run the MoE sync host node on a SyncArgs block freed by its first run"
DIM, NUM_EXPERTS, TOPK, BATCH = 4, 4, 2, 2


def cudaLaunchHostFunc(stream, fn, args):
    """The stream runs ``fn(args)`` when it reaches it; a capture records the node with ``args``."""
    fn(args)


class SyncArgs:
    """``struct SyncArgs { CPUInfer* cpuinfer; size_t allow_n_pending; }``, a host heap block."""

    def __init__(self, cpuinfer: "CPUInfer", allow_n_pending: int):
        self.cpuinfer = cpuinfer
        self.block = cpuinfer.new_block()                 # new SyncArgs{this, allow_n_pending}
        self.block[1:].fill_(allow_n_pending)             # host code: not part of any graph


class TaskQueue:
    def __init__(self):
        self.pending = 0

    def sync(self, allow_n_pending: int):
        self.pending = min(self.pending, allow_n_pending)


class CPUInfer:
    def __init__(self, device, variant: str):
        self.task_queue_ = TaskQueue()
        self.device, self.variant = device, variant
        self.heap = set()                                 # live C++ heap blocks (their owner)
        self._struct = host(torch.zeros(2, dtype=torch.int64), device)
        # what the sync node hands the task queue, read from its SyncArgs at every run
        self.sync_params = torch.zeros(2, dtype=torch.int64, device=device)

    def new_block(self):
        # a fresh host allocation, pinned: the captured copy below reads it by address (CUDA refuses a
        # pageable one inside a capture)
        return host(self._struct.clone(), self.device)

    def submit_with_cuda_stream(self, user_cuda_stream, params):
        func, args = params
        cudaLaunchHostFunc(user_cuda_stream, func, args)

    @staticmethod
    def sync_(sync_args: SyncArgs):
        cpuinfer = sync_args.cpuinfer
        cpuinfer.sync_params.copy_(sync_args.block, non_blocking=True)   # the node reads its SyncArgs
        cpuinfer.task_queue_.sync(int(sync_args.block[1]))
        if cpuinfer.variant == "bug":
            cpuinfer.heap.discard(sync_args)              # delete args

    def sync_with_cuda_stream(self, user_cuda_stream, allow_n_pending: int = 0):
        args = SyncArgs(self, allow_n_pending)
        self.heap.add(args)
        cudaLaunchHostFunc(user_cuda_stream, CPUInfer.sync_, args)


class AMXMoEWrapper:
    """Routed experts on the CPU (``forward_task`` enqueued on the stream), shared expert on the GPU."""

    def __init__(self, device, cpu_infer: CPUInfer):
        gen = generator(2037)
        self.cpu_infer = cpu_infer
        self.gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.experts = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)
        self.shared = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.output_cpu = torch.zeros(BATCH, DIM, device=device)   # the pinned output buffer

    def forward_task(self, hidden_states, topk_ids, topk_weights):
        def moe_forward(_args):
            out = torch.einsum("bd,bkde->bke", hidden_states, self.experts[topk_ids])
            self.output_cpu.copy_((out * topk_weights[..., None]).sum(1))
            self.cpu_infer.task_queue_.pending += 1
        return moe_forward, None

    def forward(self, hidden_states, stream=None):
        router_logits = hidden_states @ self.gate
        topk_weights, topk_ids = torch.softmax(router_logits, -1).topk(TOPK, dim=-1)
        self.cpu_infer.submit_with_cuda_stream(stream, self.forward_task(hidden_states, topk_ids, topk_weights))
        shared_out = hidden_states @ self.shared
        self.cpu_infer.sync_with_cuda_stream(stream, 0)
        return shared_out + self.output_cpu


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    steps = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(3)]

    def eager():
        moe = AMXMoEWrapper(device, CPUInfer(device, variant))
        return [moe.forward(x).clone() for x in steps]

    def served():
        moe = AMXMoEWrapper(device, CPUInfer(device, variant))
        static_hidden = torch.zeros(BATCH, DIM, device=device)
        g, out = capture(lambda: moe.forward(static_hidden), device=device, name="decode bs=2",
                         static={"hidden_states": static_hidden}, owner="sglang CUDA graph runner (kt-kernel MoE)")
        outs = []
        for x in steps:
            static_hidden.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
