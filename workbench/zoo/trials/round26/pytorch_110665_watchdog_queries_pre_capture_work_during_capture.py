"""Eager NCCL work is still on the watchdog's list when a capture begins: its event query lands inside the capture.

Upstream: https://github.com/pytorch/pytorch/pull/110665 ("[NCCL][CUDA][CUDA Graphs] Flush enqueued work before
starting a graph capture 2", October 2023; an alternative to #104487, cherry-picked to 2.1 as #111875).
Read: the PR description and its review threads (the ``CUDAGraph.cpp`` and ``ProcessGroupNCCL::collective`` hunks),
the discussion and repro in #104487 and #105182, and ``CUDAGraph::{inc,dec,num}_pending_event_queries`` /
``capture_begin`` in later ``CUDAGraph.cpp``; not the full diff.
Symptom: (reported in #104487, July 2023) a loop of "a few eager warmup iterations that all-reduce, then capture
a graph of the same step, then replay it" crashes intermittently in one of the later captures; adding
``time.sleep(1)`` before the capture makes it go away. #105182 traces it to "the watchdog thread calling
``cudaEventQuery`` on work that was enqueued before a graph capture" (the exact CUDA error text is not quoted).
Mechanism: after #102542, ``ProcessGroupNCCL::collective`` no longer enqueues work launched while the stream is
capturing, but the work of the eager warmup iterations is enqueued: each ``WorkNCCL`` stays in ``workMetaList_``
until the watchdog thread (``workCleanupLoop``, waking every ``kWatchdogThreadSleepMillis``) finds its end event
complete with ``cudaEventQuery`` and erases it. ``CUDAGraph::capture_begin`` did not wait for that list to
drain, so when the watchdog's next poll falls inside the capture it queries an event recorded before the
capture: in the default ``cudaStreamCaptureModeGlobal`` an event query from any thread while a capture is
underway is refused and invalidates the capture. In this model the watchdog thread wakes whenever the process
group launches a collective (inside the capture: the captured all-reduce), before it considers enqueueing it,
and ``cudaEventQuery`` is the host read of the end event's completion flag.
Doctor: sync-in-capture, at ``isCompleted`` (the watchdog's query of a warmup all-reduce's end event while the
step is being captured).
Fix (upstream): ``collective`` calls ``CUDAGraph::inc_pending_event_queries()`` before checking the capture status
(and ``dec_`` when it does not enqueue), the watchdog calls ``dec_pending_event_queries()`` when it erases a
completed work, and ``CUDAGraph::capture_begin`` waits until ``num_pending_event_queries()`` is 0 ("Waiting for
pending NCCL work to finish before starting graph capture.") before ``cudaStreamBeginCapture``.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/110665"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "isCompleted"
SYMPTOM = "capturing the step fails: the watchdog queries a warmup all-reduce's event during the capture"
WORLD_SIZE, BATCH, DIM, STEPS, WARMUP_STEPS, LR = 2, 3, 4, 5, 2, 0.2


class CUDAGraph:
    """The process-wide counter of event queries the NCCL watchdog still owes (``CUDAGraph.cpp``)."""

    pending_event_queries = 0

    @classmethod
    def inc_pending_event_queries(cls):
        cls.pending_event_queries += 1

    @classmethod
    def dec_pending_event_queries(cls):
        assert cls.pending_event_queries > 0, "Attempted to decrement the number of outstanding events to be queried"
        cls.pending_event_queries -= 1

    @classmethod
    def num_pending_event_queries(cls):
        return cls.pending_event_queries


def capture_begin(pg, variant):
    """``CUDAGraph::capture_begin`` (the part before ``cudaStreamBeginCapture``)."""
    if variant == "fix":
        # any NCCL watchdog already knows we are capturing and enqueues nothing new; wait for the work it
        # still has to query (the watchdog keeps running meanwhile)
        while CUDAGraph.num_pending_event_queries():
            pg.workCleanupLoop()


class CUDAEvent:
    """``ncclEndEvents_``: recorded on the NCCL stream after the collective; ``flag`` is what the device sets
    once the stream runs past the record (what ``cudaEventQuery`` asks about)."""

    def __init__(self, device):
        self.flag = torch.zeros((), dtype=torch.int32, device=device)

    def record(self):
        self.flag.fill_(1)


class WorkNCCL:
    def __init__(self, device):
        self.ncclEndEvent_ = CUDAEvent(device)

    def isCompleted(self) -> bool:
        # finishedGPUExecutionInternal(): cudaEventQuery(ncclEndEvents_) == cudaSuccess
        return bool(self.ncclEndEvent_.flag.item())

    def wait(self):
        """``synchronizeStream()``: the current stream waits on the end event (no host wait)."""


class ProcessGroupNCCL:
    """Rank 0 of two data-parallel ranks; ``peer_recv`` is what the transport delivers of rank 1's tensor."""

    def __init__(self, device):
        self.device = device
        self.peer_recv = torch.zeros(DIM, 1, device=device)
        self.workMetaList_: list[WorkNCCL] = []
        self.coalescing_state_ = 0

    def allreduce(self, tensor):
        self.workCleanupLoop()             # the watchdog thread wakes up meanwhile (its timer, not the launch)
        return self.collective(tensor, lambda t: t.add_(self.peer_recv))

    def collective(self, tensor, fn):
        work = WorkNCCL(self.device)
        fn(tensor)                                        # ncclAllReduce on the NCCL stream
        work.ncclEndEvent_.record()
        capture_status = torch.cuda.is_current_stream_capturing()
        # Notify graphs before we check the capture status preemptively
        CUDAGraph.inc_pending_event_queries()
        if not self.coalescing_state_ and not capture_status:     # #102542: captured work is not enqueued
            self.workMetaList_.append(work)               # workEnqueue
        else:
            CUDAGraph.dec_pending_event_queries()
        return work

    def workCleanupLoop(self):
        """One iteration of the watchdog: erase the works whose end event has completed."""
        remaining = []
        for work in self.workMetaList_:
            if work.isCompleted():
                CUDAGraph.dec_pending_event_queries()
            else:
                remaining.append(work)
        self.workMetaList_ = remaining


def local_grad(x, y, weight):
    """Mean-squared-error gradient of a linear model on this rank's batch."""
    return x.t() @ (x @ weight - y) * (2.0 / x.shape[0])


def train_step(pg, x, y, weight):
    """The step the graph captures: this rank's gradient, averaged over ranks by an all-reduce."""
    grad = local_grad(x, y, weight)
    pg.allreduce(grad).wait()
    return grad.div_(WORLD_SIZE)


def run(variant: str, device: str = "cpu"):
    gen = generator(110665)
    init = randn(DIM, 1, gen=gen, device=device, scale=0.5)
    batches = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, 1, gen=gen, device=device),
                randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, 1, gen=gen, device=device))
               for _ in range(STEPS)]

    def workload(graphed: bool):
        CUDAGraph.pending_event_queries = 0
        weight = init.clone()
        pg = ProcessGroupNCCL(device)
        static_x = torch.zeros(BATCH, DIM, device=device)
        static_y = torch.zeros(BATCH, 1, device=device)
        graph = out = None
        outs = []
        for step, (x, y, peer_x, peer_y) in enumerate(batches):
            pg.peer_recv.copy_(local_grad(peer_x, peer_y, weight))   # rank 1's gradient, as NCCL delivers it
            static_x.copy_(x)
            static_y.copy_(y)
            if not graphed:
                grad = train_step(pg, static_x, static_y, weight).clone()
            elif step < WARMUP_STEPS:                                 # eager warmup iterations (real steps)
                with events.warmup(real=True):
                    grad = train_step(pg, static_x, static_y, weight).clone()
            else:
                if graph is None:
                    capture_begin(pg, variant)
                    graph, out = capture(lambda: train_step(pg, static_x, static_y, weight), device=device,
                                         warmups=0, owner="data-parallel step (whole-step graph)",
                                         static={"x": static_x, "y": static_y, "peer_recv": pg.peer_recv})
                grad = replay(graph, out).clone()
            weight.sub_(LR * grad)                     # optimizer step, eager
            outs += [grad, weight.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
