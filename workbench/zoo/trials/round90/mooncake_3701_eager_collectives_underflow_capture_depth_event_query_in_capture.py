"""Mooncake PG with SGLang TBO + CUDA graphs: every eager GPU collective decrements the tracker's capture depth, so during the next capture ``evictCompleted`` thinks no capture is open and queries retired CUDA events.

Upstream: https://github.com/kvcache-ai/Mooncake/pull/3701 ("[Bugfix][PG] Balance CUDA graph capture-depth
accounting", kvcache-ai/Mooncake, merged 2026-08-26), a follow-up to #3609 ("fix(ep,pg): prevent
cudaErrorIllegalAddress during CUDA graph capture with TBO"). Read: #3701's description (the accounting rule, the
four-step failing sequence and where it occurs), the first part of #3609's description (TBO runs EP dispatch/combine on
a secondary stream; captured works must be retained until shutdown, and ``event->query()`` on works during capture
raised ``cudaErrorIllegalAddress``), and the pre-#3609 code of ``mooncake-pg/torch/src/work_handles.cpp`` and
``mooncake_backend.cpp`` (snapshot of 2026-08-22: ``MooncakeWorkTracker::retire / retainUntilShutdown /
evictCompleted``, ``MooncakeWorkCuda``'s destructor retiring ``[event] { return event->query(); }``,
``launchCollective`` recording the event then evicting). Not read: the diffs of #3609 and #3701; the shape of the
``notifyCapture`` / ``capture_depth_`` accounting below (a captured collective takes a reference at launch and its
``Work`` gives it back when destroyed; ``evictCompleted`` returns early while the depth is positive) is reconstructed
from #3701's description.
Symptom: SGLang with Two-Batch Overlap, Mooncake EP/PG and CUDA graphs: the decode-graph capture fails (CUDA error
during capture / illegal address) after eager collectives ran first (warmup, initialisation). Eager serving is fine.
Mechanism: ``MooncakeBackend::launchCollective`` calls ``work_tracker_->notifyCapture(is_captured)`` for every GPU
collective; ``notifyCapture(true)`` increments ``capture_depth_``, ``notifyCapture(false)`` decrements it. An eager
collective thus decrements a reference it never took: after SGLang's eager warmup runs of the decode step the depth is
negative. In the capture, the first captured collective brings it back to <= 0, and the ``evictCompleted()`` that
every launch runs (its guard: return while ``capture_depth_ > 0``) goes on to query the events of the works retired by
the warmup runs: a host query of the device inside an open capture.
Doctor: sync-in-capture, at evictCompleted. The eviction's host query of a retired work's event (here: reading the
event's completion flag on the host) runs inside the captured decode step, where CUDA refuses host synchronisation.
Fix (upstream): count only captured collectives (``if is_captured: notifyCapture(true)``), so eager collectives leave
the depth at 0 and the captured ones keep it positive while their works are live.
Modelled: ``MooncakeWorkTracker`` (retire / retainUntilShutdown / evictCompleted / notifyCapture), ``MooncakeWorkCuda``
(its destructor: retire with an event query, or retain until shutdown and release the capture reference),
``MooncakeBackend.launchCollective`` / ``allreduce`` (world of 2 EP ranks simulated in one process: the all-reduce sums
the ranks' partial expert outputs), a stand-in ``c10::Event`` (``record`` writes a completion flag on the stream;
``query`` hands back that flag, which the tracker reads on the host), SGLang's ``CudaGraphRunner`` (two eager warmup
runs, then capture) and a one-layer MoE decoder whose decode step runs as two TBO micro-batches, each combining its
experts through the PG all-reduce (the first micro-batch's work still live while the second launches).
Sizes: hidden 8, vocab 16, 4 experts (2 per EP rank), top-2, batch 4 (TBO split 2 + 2), float64.
Workload: SGLang captures the bs-4 decode graph (2 eager warmup runs: 4 eager collectives take the depth to -4 in the
bug variant), then 3 decode steps replay it with greedy next tokens. Bug: the capture's first collective brings the
depth to -3, evictCompleted queries the last warmup works' events inside the capture, and the capture fails. Fix: the
depth is 1 and 2 during the capture, eviction is skipped, the graph replays and equals eager.
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kvcache-ai/Mooncake/pull/3701"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "evictCompleted"
SYMPTOM = ("SGLang TBO + Mooncake EP/PG + CUDA graphs: the eager warmup collectives drive capture_depth_ to -4; in "
           "the decode-graph capture evictCompleted no longer sees a capture open and queries retired CUDA events, "
           "and the capture fails")

HIDDEN, VOCAB, NUM_EXPERTS, TOPK = 8, 16, 4, 2
EP_SIZE = 2
EXPERTS_PER_RANK = NUM_EXPERTS // EP_SIZE
CUDA_GRAPH_BS = 4
DT = torch.float64

_variant = "bug"


class Event:
    """Stand-in for ``c10::Event``: ``record`` marks completion on the stream; ``query`` returns the flag the host
    must read to learn whether the device got there (``cudaEventQuery``)."""

    def __init__(self, device):
        self.flag = torch.zeros((), dtype=torch.int32, device=device)

    def record(self):
        self.flag.fill_(1)

    def query(self):
        return self.flag


class MooncakeWorkTracker:
    def __init__(self):
        self.retired_ = []                    # (resources, ready_to_release)
        self.retained_until_shutdown_ = []
        self.capture_depth_ = 0
        self.is_shutdown_ = False

    def notifyCapture(self, captured: bool):
        self.capture_depth_ += 1 if captured else -1

    def retire(self, resources, ready_to_release):
        if not self.is_shutdown_:
            self.retired_.append((resources, ready_to_release))

    def retainUntilShutdown(self, resources):
        if not self.is_shutdown_:
            self.retained_until_shutdown_.append(resources)

    def evictCompleted(self):
        """Release retired works whose events completed (the hazard site)."""
        if self.capture_depth_ > 0:           # a capture is open: an event query would break it
            return
        if self.is_shutdown_ or not self.retired_:
            return
        candidates, self.retired_ = self.retired_, []
        pending = []
        for resources, ready_to_release in candidates:
            if ready_to_release():            # host read of the event's state (cudaEventQuery)
                continue
            pending.append((resources, ready_to_release))
        self.retired_.extend(pending)

    def shutdown(self):
        self.is_shutdown_ = True
        self.retired_.clear()
        self.retained_until_shutdown_.clear()


class MooncakeWorkCuda:
    def __init__(self, event, tracker, keep_alive, is_captured):
        self.event_, self.tracker_, self.keep_alive_ = event, tracker, keep_alive
        self.is_captured_ = is_captured

    def wait(self):
        """Blocks the current stream on the event (one stream here: nothing to order)."""
        return True

    def __del__(self):
        tracker = self.tracker_
        if tracker is None:
            return
        if self.is_captured_:                 # the graph may replay it: keep until shutdown
            tracker.retainUntilShutdown((self.event_, self.keep_alive_))
            tracker.notifyCapture(False)      # give back the capture reference
            return
        event = self.event_
        tracker.retire(self.keep_alive_, lambda: event.query())


class MooncakeBackend:
    def __init__(self, device):
        self.device = device
        self.work_tracker_ = MooncakeWorkTracker()

    def launchCollective(self, gpu_fn, tensor):
        is_captured = is_capturing()          # capture status of the collective's stream
        if _variant == "fix":                 # upstream fix: only a captured collective takes a reference
            if is_captured:
                self.work_tracker_.notifyCapture(True)
        else:
            self.work_tracker_.notifyCapture(is_captured)
        gpu_fn(tensor)
        event = Event(self.device)
        event.record()
        self.work_tracker_.evictCompleted()
        return MooncakeWorkCuda(event, self.work_tracker_, [tensor], is_captured)

    def allreduce(self, tensor):
        """In-place sum over the EP ranks (dim 0 of ``tensor`` holds one partial per rank)."""
        def gpu_fn(t):
            total = t.sum(0, keepdim=True)
            t.copy_(total.expand_as(t))
        return self.launchCollective(gpu_fn, tensor)


class MoEDecoder:
    """Embedding, a top-2 MoE whose experts live on 2 EP ranks (combined by the PG all-reduce), the lm head."""

    def __init__(self, device, backend):
        gen = generator(3701)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DT)  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.gate = r(HIDDEN, NUM_EXPERTS)
        self.w1, self.w2 = r(NUM_EXPERTS, HIDDEN, HIDDEN), r(NUM_EXPERTS, HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.backend = backend

    def moe_partials(self, x):
        """Each EP rank's partial output (its local experts only): ``[EP_SIZE, n, HIDDEN]``."""
        weights = torch.softmax(x @ self.gate, -1)
        top_w, top_ids = torch.topk(weights, TOPK, -1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        dense_w = torch.zeros_like(weights).scatter(-1, top_ids, top_w)          # [n, E]
        outs = torch.einsum("nh,ehk->nek", x, self.w1).relu()
        outs = torch.einsum("nek,ekh->neh", outs, self.w2) * dense_w.unsqueeze(-1)
        return outs.view(x.shape[0], EP_SIZE, EXPERTS_PER_RANK, HIDDEN).sum(2).transpose(0, 1).contiguous()

    def forward_tbo(self, input_ids):
        """Two-Batch Overlap: micro-batch B's collective launches while A's work is still live."""
        half = input_ids.shape[0] // 2
        x_a, x_b = self.embed[input_ids[:half]], self.embed[input_ids[half:]]
        part_a = self.moe_partials(x_a)
        work_a = self.backend.allreduce(part_a)
        part_b = self.moe_partials(x_b)
        work_b = self.backend.allreduce(part_b)
        work_a.wait()
        work_b.wait()
        del work_a, work_b
        h = torch.cat([x_a + part_a[0], x_b + part_b[0]])
        return h @ self.lm_head


class CudaGraphRunner:
    def __init__(self, model: MoEDecoder, device):
        self.model, self.device = model, device
        self.input_ids = torch.zeros(CUDA_GRAPH_BS, dtype=torch.int64, device=device)
        self.graph, self.output = capture(lambda: self.model.forward_tbo(self.input_ids), device=device, warmups=2,
                                          name=f"decode bs={CUDA_GRAPH_BS} (TBO)", owner="CudaGraphRunner",
                                          static={"input_ids": self.input_ids})

    def replay(self, input_ids):
        self.input_ids.copy_(input_ids)
        return replay(self.graph, self.output)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    start = [3, 7, 1, 12]

    def serve(use_cuda_graph: bool):
        backend = MooncakeBackend(device)
        model = MoEDecoder(device, backend)
        runner = CudaGraphRunner(model, device) if use_cuda_graph else None
        ids = torch.tensor(start, device=device)
        outs = []
        for _ in range(3):
            logits = runner.replay(ids) if runner is not None else model.forward_tbo(ids)
            logits = logits.clone()
            outs.append(logits)
            ids = logits.argmax(-1)
        backend.work_tracker_.shutdown()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
