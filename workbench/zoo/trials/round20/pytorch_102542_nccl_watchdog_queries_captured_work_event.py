"""A captured NCCL all-reduce is handed to the watchdog, whose event query then runs inside the capture.

Upstream: https://github.com/pytorch/pytorch/pull/102542 ("NCCL process group: avoid workEnqueue when
capturing cuda graph"; Meta diff D46274814; the guard it adds is in ``ProcessGroupNCCL::collective`` at HEAD).
Read: the PR description and its review-thread hunk (the changed ``if`` around ``workEnqueue``), and
``collective``/``endCoalescing`` in later ``ProcessGroupNCCL.cpp`` versions; not the full diff.
Symptom: as reported (May 2023, from an internal Meta workload): capturing a CUDA graph
that contains an NCCL ``all_reduce`` crashes the process group's watchdog thread, which "wants to query
events pertaining to enqueued work items, but this can't be done for events created during cuda graph
capture"; the same step runs eagerly.
Mechanism: ``ProcessGroupNCCL::collective`` records ``ncclEndEvents_`` after launching the NCCL kernel and
then, when not coalescing, calls ``workEnqueue(work)``: the ``WorkNCCL`` joins ``workMetaList_``, which the
watchdog thread (``workCleanupLoop``) polls every ``kWatchdogThreadSleepMillis`` with
``work.isCompleted()``, i.e. ``cudaEventQuery`` on the end event. A collective launched while the stream is
capturing records its event into the graph being built; the watchdog's next poll queries that event while
the capture is still open, a host-side query of device progress that a capture forbids. In this model the
watchdog's poll runs as soon as the work is enqueued (the moment at which it raced with the capture
upstream), and ``cudaEventQuery`` is the host read of the end event's completion flag.
Doctor: sync-in-capture, at ``isCompleted`` (the watchdog's query of the captured collective's end event).
Fix (upstream): ``collective`` reads ``c10::cuda::currentStreamCaptureStatusMayInitCtx()`` and enqueues the
work only when ``!coalescing_state_ && capture_status == CaptureStatus::None``: captured collectives are never
handed to the watchdog (their replays create no ``WorkNCCL`` at all).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/102542"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "isCompleted"
SYMPTOM = "capturing a step with an NCCL all-reduce fails: the watchdog queries the captured work's event"
WORLD_SIZE, RANK, BATCH, DIM, STEPS, LR = 2, 0, 3, 4, 4, 0.2


class CUDAEvent:
    """``at::cuda::CUDAEvent``: recorded on the NCCL stream after the collective; ``flag`` is what the
    device sets once the stream runs past the record (what ``cudaEventQuery`` asks about)."""

    def __init__(self, device):
        self.flag = torch.zeros((), dtype=torch.int32, device=device)

    def record(self):
        self.flag.fill_(1)


class WorkNCCL:
    def __init__(self, device, op_type):
        self.op_type = op_type
        self.ncclEndEvent_ = CUDAEvent(device)

    def isCompleted(self) -> bool:
        # finishedGPUExecutionInternal(): cudaEventQuery(ncclEndEvents_[i]) == cudaSuccess
        return bool(self.ncclEndEvent_.flag.item())

    def wait(self):
        """``synchronizeStream()``: the current stream waits on the end event (no host wait)."""


class ProcessGroupNCCL:
    """Rank 0 of two data-parallel ranks. ``peer_recv`` is the buffer the transport fills with rank 1's
    contribution; ``ncclAllReduce`` sums it into the tensor in place."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.peer_recv = torch.zeros(DIM, 1, device=device)
        self.workMetaList_: list[WorkNCCL] = []
        self.coalescing_state_ = 0
        self.completed = 0

    def allreduce(self, tensor):
        return self.collective(tensor, lambda t: t.add_(self.peer_recv), "ALLREDUCE")

    def collective(self, tensor, fn, op_type):
        work = WorkNCCL(self.device, op_type)
        fn(tensor)                                     # ncclAllReduce on the NCCL stream
        work.ncclEndEvent_.record()
        capture_status = torch.cuda.is_current_stream_capturing()   # currentStreamCaptureStatusMayInitCtx()
        if self.variant == "fix":
            enqueue = not self.coalescing_state_ and not capture_status
        else:
            enqueue = not self.coalescing_state_
        if enqueue:
            self.workEnqueue(work)
        return work

    def workEnqueue(self, work):
        self.workMetaList_.append(work)
        self.workCleanupLoop()             # the watchdog thread wakes up and polls (workMetaListCV_)

    def workCleanupLoop(self):
        """One iteration of the watchdog: erase the works whose end event has completed."""
        remaining = []
        for work in self.workMetaList_:
            if work.isCompleted():
                self.completed += 1
            else:
                remaining.append(work)
        self.workMetaList_ = remaining


def local_grad(x, y, weight):
    """Mean-squared-error gradient of a linear model on this rank's batch."""
    return x.t() @ (x @ weight - y) * (2.0 / x.shape[0])


def train_step(pg, x, y, weight):
    """The captured region: this rank's gradient, averaged over ranks by an all-reduce."""
    grad = local_grad(x, y, weight)
    work = pg.allreduce(grad)
    work.wait()
    return grad.div_(WORLD_SIZE)


def run(variant: str, device: str = "cpu"):
    gen = generator(102542)
    init = randn(DIM, 1, gen=gen, device=device, scale=0.5)
    batches = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, 1, gen=gen, device=device),
                randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, 1, gen=gen, device=device))
               for _ in range(STEPS)]

    def workload(graphed: bool):
        weight = init.clone()
        pg = ProcessGroupNCCL(device, variant)
        static_x = torch.zeros(BATCH, DIM, device=device)
        static_y = torch.zeros(BATCH, 1, device=device)
        graph = out = None
        outs = []
        for x, y, peer_x, peer_y in batches:
            pg.peer_recv.copy_(local_grad(peer_x, peer_y, weight))   # rank 1's gradient, as NCCL delivers it
            static_x.copy_(x)
            static_y.copy_(y)
            if not graphed:
                grad = train_step(pg, static_x, static_y, weight).clone()
            else:
                if graph is None:
                    graph, out = capture(lambda: train_step(pg, static_x, static_y, weight), device=device,
                                         owner="data-parallel step (whole-step graph)",
                                         static={"x": static_x, "y": static_y, "peer_recv": pg.peer_recv})
                grad = replay(graph, out).clone()
            weight.sub_(LR * grad)                     # optimizer step, eager
            outs += [grad, weight.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
