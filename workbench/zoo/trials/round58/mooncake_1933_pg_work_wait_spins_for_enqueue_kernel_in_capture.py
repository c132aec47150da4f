"""MooncakeWorkCuda::wait() waits on the host for its enqueue kernel, which a capture only records: capture hangs.

Upstream: https://github.com/kvcache-ai/Mooncake/pull/1933 ("[PG] Fix wait() hang during CUDA Graph capture",
merge 741cf0adf, change 0ea21904e). Read: ``git show 0ea21904e`` and ``mooncake-pg/src/mooncake_worker.cu`` /
``include/mooncake_worker.cuh`` around it (``putTaskCuda``, ``enqueueTaskKernel``, ``waitUntilTasksSubmitted``).
Symptom: capturing a CUDA graph of a step whose collective goes through the Mooncake process group (SGLang decode
graphs with Mooncake PG/EP) hangs in ``wait()``; eager steps run.
Mechanism: ``MooncakeWorker::putTaskCuda`` copies the tensor into the send buffer and launches
``enqueueTaskKernel`` on ``enq_stream``; when that kernel runs it writes the task (``submitSequence``, ...) into the
mapped pinned slot ``tasks_[taskId]`` and sets ``active``; the worker thread polls the slots, submits the transfer
to TransferEngine and stores ``submitted_task_sequence_[taskId]``. ``MooncakeWorkCuda::wait`` first calls
``worker_->waitUntilTasksSubmitted(submitted_tasks_, timeout)``, a host spin until the worker has seen each task,
then makes the current stream wait on the end event. Under capture ``enqueueTaskKernel`` is recorded, not run, so
the slot never becomes active and the host waits for device work that cannot happen during a capture. In the model
the worker thread's pass runs inside the spin and its read of the slot is a host read of device-written memory
(``.item()``): the host synchronisation that a capture refuses (upstream: a spin that never ends).
Doctor: sync-in-capture, at ``wait`` (it waits on the host, during the capture, for the enqueue kernel to have run).
Fix (upstream): ``wait`` calls ``waitUntilTasksSubmitted`` only when ``at::cuda::currentStreamCaptureStatus() ==
CaptureStatus::None``; while capturing it only adds the stream dependency. (The same commit makes
``MooncakeBarrierWorkCuda::wait`` return true while capturing instead of ``event_->synchronize()``; no barrier runs
in the captured step here, so that half is not modelled.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kvcache-ai/Mooncake/pull/1933"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "wait"
SYMPTOM = "capturing a decode step with a Mooncake PG all-reduce hangs in MooncakeWorkCuda::wait()"

WORLD_SIZE, RANK, HIDDEN, FFN_SHARD, BATCH, STEPS = 2, 0, 8, 6, 3, 4
kNumTasks_ = 4
kSpinPolls = 1000                   # the model's stand-in for "forever" (timeout == kNoTimeout)


class TransferGroupMeta:
    """Per-group buffers: this rank's send buffer and the recv buffer every rank's data lands in."""

    def __init__(self, device):
        self.size, self.rank = WORLD_SIZE, RANK
        self.send_buffer = torch.zeros(BATCH, HIDDEN, device=device)
        self.recv_buffer = torch.zeros(WORLD_SIZE, BATCH, HIDDEN, device=device)
        self.activeRanksDevice = torch.ones(WORLD_SIZE, dtype=torch.bool, device=device)


def enqueueTaskKernel(tasks_active, tasks_sequence, task_id: int, submit_sequence: int):
    """Copy the task into its (mapped, pinned) slot, then publish it: ``tasks[taskId].active = true``."""
    tasks_sequence[task_id].fill_(submit_sequence)
    tasks_active[task_id].fill_(1)


def reduceKernel(dst, src, activeRanks):
    """Sum of every active rank's contribution."""
    dst.copy_((src * activeRanks.to(src.dtype)[:, None, None]).sum(0))


class MooncakeWorker:
    def __init__(self, device, variant):
        self.variant = variant
        self.tasks_active = torch.zeros(kNumTasks_, dtype=torch.int32, device=device)   # cudaHostAllocMapped
        self.tasks_sequence = torch.zeros(kNumTasks_, dtype=torch.int64, device=device)
        self.submitted_task_sequence_ = [0] * kNumTasks_
        self.next_cuda_task_sequence_ = 1
        self.cudaTaskCount = 0

    def putTaskCuda(self, tensor, meta: TransferGroupMeta):
        task_id = self.cudaTaskCount % 2 + 2
        sequence = self.next_cuda_task_sequence_
        self.next_cuda_task_sequence_ += 1
        meta.send_buffer.copy_(tensor)                                        # tensorToBuffer
        enqueueTaskKernel(self.tasks_active, self.tasks_sequence, task_id, sequence)
        # TransferEngine's transfer of the send buffer to every rank (this rank's row here; the peer's row
        # arrives from the peer) runs on enq_stream once the worker has posted it
        meta.recv_buffer[meta.rank].copy_(meta.send_buffer)
        reduceKernel(tensor, meta.recv_buffer, meta.activeRanksDevice)         # bufferToTensor
        self.cudaTaskCount += 1
        return MooncakeWorkCuda(self, [(task_id, sequence)], self.variant)

    def workerLoopOnce(self):
        """One pass of ``worker_thread_``: pick up published tasks, submit them, mark them done."""
        for i in range(kNumTasks_):
            if self.tasks_active[i].item():                  # the host reads the slot the kernel wrote
                self.submitted_task_sequence_[i] = int(self.tasks_sequence[i].item())
                self.tasks_active[i].fill_(0)                # DONE: the kernel's spin ends

    def waitUntilTasksSubmitted(self, tasks, polls) -> bool:
        for _ in range(polls):
            if all(self.submitted_task_sequence_[t] >= seq for t, seq in tasks):
                return True
            self.workerLoopOnce()
        return False


class MooncakeWorkCuda:
    def __init__(self, worker, submitted_tasks, variant):
        self.worker_, self.submitted_tasks_, self.variant = worker, submitted_tasks, variant

    def wait(self, polls=kSpinPolls) -> bool:
        submitted = True
        capturing = torch.cuda.is_current_stream_capturing()
        if self.variant == "bug" or not capturing:
            submitted = self.worker_.waitUntilTasksSubmitted(self.submitted_tasks_, polls)
        if not submitted:
            raise TimeoutError("MooncakeWorkCuda::wait(): the enqueued task was never submitted (hang)")
        # event_->block(current_stream): one stream in the model, nothing to add
        return True


class MooncakeBackend:
    def __init__(self, device, variant):
        self.worker = MooncakeWorker(device, variant)
        self.meta = TransferGroupMeta(device)

    def allreduce(self, tensor):
        return self.worker.putTaskCuda(tensor, self.meta)


class TPDecodeLayer:
    """Row-parallel MLP shard of a tensor-parallel decode layer; the all-reduce sums the two shards."""

    def __init__(self, device, gen):
        self.w_up = randn(HIDDEN, FFN_SHARD, gen=gen, device=device, scale=0.5)
        self.w_down = randn(FFN_SHARD, HIDDEN, gen=gen, device=device, scale=0.5)

    def forward(self, pg: MooncakeBackend, x):
        partial = torch.relu(x @ self.w_up) @ self.w_down
        pg.allreduce(partial).wait()            # tensor_model_parallel_all_reduce (synchronous: c10d waits)
        return x + partial


def run(variant: str, device: str = "cpu"):
    gen = generator(1933)
    layer = TPDecodeLayer(device, gen)
    steps = [(randn(BATCH, HIDDEN, gen=gen, device=device), randn(BATCH, HIDDEN, gen=gen, device=device))
             for _ in range(STEPS)]

    def serve(graphed: bool):
        pg = MooncakeBackend(device, variant)
        x_buf = torch.zeros(BATCH, HIDDEN, device=device)
        step_fn = lambda: layer.forward(pg, x_buf)  # noqa: E731
        if graphed:
            pg.meta.recv_buffer[1].copy_(steps[0][1])
            g, out = capture(step_fn, device=device, name="decode bs 3", owner="SGLang decode graph (Mooncake PG)",
                             static={"x": x_buf, "recv_buffer": pg.meta.recv_buffer},
                             state={"tasks_active": pg.worker.tasks_active})
        outs = []
        for x, peer_partial in steps:
            pg.meta.recv_buffer[1].copy_(peer_partial)       # rank 1's shard, as TransferEngine delivers it
            x_buf.copy_(x)
            outs.append((replay(g, out) if graphed else step_fn()).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
