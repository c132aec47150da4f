"""SDMA all-reduce's ``wait_async`` synchronises the stream on the host, so capturing start_async + wait_async fails.

Upstream: https://github.com/ROCm/mori/pull/559 ("Support graph replays for SDMA AllReduce", squash commit
704e464a; inner commits 869dab69 "fix(ccl): prevent SDMA all-reduce corruption across graph replays" and
"fix(ccl): order async all-reduce across streams"). Read: ``git show 704e464a`` (``twoshot_allreduce_sdma_class.cpp``,
``twoshot_allreduce_sdma_class.hpp``, ``python/mori/ccl/collective.py``) and the new test
``tests/python/ccl/test_allreduce_sdma_async_graph.py``.
Symptom: an inference runtime that captures its decode buckets with the async SDMA all-reduce
(``AllreduceSdma.start_async(inp, out, n, stream)`` then ``wait_async(stream)`` inside ``torch.cuda.graph``)
cannot capture: ``RuntimeError: Synchronization failed`` (the capture is invalidated); eager steps work. The new
test keeps a flag ``expect_baseline_failure`` ("baseline unexpectedly captured async start+wait") for exactly this.
Mechanism: ``start_async`` runs ``prepare_async_reduce_scatter`` (host: records ``async_input_``,
``async_output_``, ``async_total_count_``), launches ``SdmaReduceScatterKernel`` (each PE puts chunk ``dst`` of its
input into slot ``myPe`` of PE ``dst``'s transit buffer, then reduces its own slot) and ``AllGatherAsyncPutKernel``
(each PE puts its reduced shard into slot ``myPe`` of every peer), then ``after_async_start``. ``wait_async``
launches ``AllGatherAsyncWaitKernel`` and calls ``AllreduceSdma<T>::finish_async_wait``, which first did
``hipStreamSynchronize(ws)`` (or ``hipDeviceSynchronize``) and only then ``copy_output_to_user`` (the
``hipMemcpyAsync`` of the transit buffer into ``async_output_``). At warmup that host wait is harmless; inside the
capture the stream is capturing, so the runtime refuses the synchronisation (hipErrorStreamCaptureUnsupported) and
the capture of the step fails. (The same PR also fixes a layout defect that needs no host work: the scratch's
rank-slot offsets were ``myPe * (count / npes)``, so graphs of different message sizes gave one address a CU-written
role in one graph and an SDMA-written role in another, exposing stale L2 lines on gfx950; that is a cache-coherence
effect the model cannot show, so here both layouts give the same numbers. ``ensure_buffer_size``'s regrowth on the
async path never triggers at these sizes and is left out.)
Doctor: sync-in-capture, at ``finish_async_wait`` (the host-side stream synchronisation inside the captured step).
Fix (upstream): ``wait_async`` passes ``capturing = torch.cuda.is_current_stream_capturing()`` and
``finish_async_wait`` synchronises only ``if (!capturing)``; it orders the wait stream after ``async_start_event_``
(one stream here) and always copies the result out of scratch. The constructor allocates the scratch once with a
fixed slot stride (``FixedSlotElements``: shard rounded to ``pack_size``, plus 64; ``(npes+1)`` slots) stored in
``slot_stride_elements_`` so rank slots keep the same offsets for every message size, and a too-large call throws
"AllReduce input exceeds fixed reduce scratch capacity".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import is_capturing
from workbench.engine.cpu_graph import host_sync_error
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/mori/pull/559"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "finish_async_wait"
SYMPTOM = "capturing a decode step that uses AllreduceSdma.start_async/wait_async fails: Synchronization failed"

NPES, MY_PE, HIDDEN, INTER = 2, 0, 8, 6          # TP-2, this process plays every PE; rank 0's output is served
BUCKETS = (4, 8)                                 # decode batch sizes captured, one graph each
SCHEDULE = (4, 8, 8, 4, 8, 4)                    # batch size of each served step
PACK = 16 // 4                                   # pack_size for float32 (16-byte packs)


def hipStreamSynchronize(device: str) -> None:
    """The host waits for the stream. A capturing stream refuses it (hipErrorStreamCaptureUnsupported); the
    CPU emulation has no stream object, so the rule is stated here."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream().synchronize()
    elif is_capturing():
        raise host_sync_error("hipStreamSynchronize", user_frame())


def FixedSlotElements(input_buffer_size: int, npes: int) -> int:
    elements = input_buffer_size // 4
    shard = (elements + npes - 1) // npes
    return ((shard + PACK - 1) // PACK) * PACK + 64


class AllreduceSdma:
    """``mori::collective::AllreduceSdma<float>`` for all PEs at once: ``transit[pe]`` is PE ``pe``'s symmetric
    scratch (``output_transit_buffer_`` before the fix, the fixed-stride ``input_transit_buffer_`` after)."""

    def __init__(self, device, variant, input_buffer_size: int):
        self.device, self.variant = device, variant
        self.copy_output_to_user_ = True
        max_elems = input_buffer_size // 4
        if variant == "bug":     # output transit buffer: slot stride = count / npes of each call
            self.slot_stride_elements_ = None
            self.transit = torch.zeros(NPES, NPES * (max_elems // NPES + 64), device=device)
        else:                    # fixed stride from the configured maximum, (npes + 1) slots
            self.slot_stride_elements_ = FixedSlotElements(input_buffer_size, NPES)
            self.transit = torch.zeros(NPES, (NPES + 1) * self.slot_stride_elements_, device=device)
        self.async_in_progress_ = False
        self.async_output_ = None
        self.async_total_count_ = 0

    def _slots(self, total_count):
        """Rank slots ``[pe, slot, shard]`` of every PE's scratch, at this build's offsets."""
        shard = total_count // NPES
        stride = shard if self.slot_stride_elements_ is None else self.slot_stride_elements_
        if stride < shard:
            raise RuntimeError("AllReduce input exceeds fixed reduce scratch capacity")
        return self.transit[:, :NPES * stride].view(NPES, NPES, stride)[:, :, :shard]

    # --- start_async -------------------------------------------------------------------------------
    def prepare_async_reduce_scatter(self, output, total_count):
        if self.async_in_progress_:
            raise RuntimeError("Another async operation is already in progress")
        self.async_in_progress_ = True
        self.async_output_, self.async_total_count_ = output, total_count

    def SdmaReduceScatterKernel(self, inputs, total_count):
        """SDMA scatter (PE ``src`` puts chunk ``dst`` into slot ``src`` of PE ``dst``), then each PE's CU
        reduce of its slots into its own slot ``myPe``."""
        slots = self._slots(total_count)
        slots.copy_(inputs.view(NPES, NPES, -1).transpose(0, 1))
        reduced = slots.sum(1)
        torch.diagonal(slots, dim1=0, dim2=1).copy_(reduced.t())

    def AllGatherAsyncPutKernel(self, total_count):
        """Each PE puts its reduced shard (its slot ``myPe``) into slot ``myPe`` of every peer."""
        slots = self._slots(total_count)
        reduced = torch.diagonal(slots, dim1=0, dim2=1).t()
        slots.copy_(reduced.unsqueeze(0).expand(NPES, NPES, -1))

    def start_async(self, inputs, output, count):
        self.prepare_async_reduce_scatter(output, count)
        self.SdmaReduceScatterKernel(inputs, count)
        self.AllGatherAsyncPutKernel(count)
        # after_async_start(): hipGetLastError() -- nothing to model

    # --- wait_async --------------------------------------------------------------------------------
    def copy_output_to_user(self, output, total_count):
        """``hipMemcpyAsync(output, transit + base, ...)``: PE ``MY_PE``'s gathered shards into the caller's buffer."""
        output.view(NPES, -1).copy_(self._slots(total_count)[MY_PE])

    def finish_async_wait(self):
        if self.variant == "bug":
            hipStreamSynchronize(self.device)              # ws ? hipStreamSynchronize(ws) : hipDeviceSynchronize()
            if self.copy_output_to_user_:
                self.copy_output_to_user(self.async_output_, self.async_total_count_)
        else:
            capturing = torch.cuda.is_current_stream_capturing()   # passed down from wait_async
            # hipStreamWaitEvent(ws, async_start_event_): one stream here, nothing to order
            self.copy_output_to_user(self.async_output_, self.async_total_count_)
            if not capturing:
                hipStreamSynchronize(self.device)
        self.async_in_progress_ = False
        self.async_output_, self.async_total_count_ = None, 0

    def wait_async(self):
        # AllGatherAsyncWaitKernel: spins on the peers' gather flags (already set in the model)
        self.finish_async_wait()


class RowParallelMLP:
    """A TP-2 MLP: each PE holds a column slice of ``up`` and the matching row slice of ``down``."""

    def __init__(self, device):
        gen = generator(559)
        self.up = [randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5) for _ in range(NPES)]
        self.down = [randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(NPES)]

    def forward(self, comm: AllreduceSdma, hidden):
        partials = torch.stack([F.silu(hidden @ self.up[r]) @ self.down[r] for r in range(NPES)])
        count = hidden.numel()
        out = torch.empty(count, device=hidden.device)
        comm.start_async(partials.reshape(NPES, count), out, count)
        comm.wait_async()
        return hidden + out.view_as(hidden)


class ModelRunner:
    """Captures one decode graph per bucket; all graphs share the one communicator, as a runtime's do."""

    def __init__(self, model, device, variant, graphed):
        self.model, self.graphed = model, graphed
        self.comm = AllreduceSdma(device, variant, input_buffer_size=max(BUCKETS) * HIDDEN * 4)
        self.hidden = {bs: torch.zeros(bs, HIDDEN, device=device) for bs in BUCKETS}
        self.graphs = {}
        if graphed:
            for bs in BUCKETS:
                self.graphs[bs] = capture(
                    lambda bs=bs: model.forward(self.comm, self.hidden[bs]), device=device,
                    name=f"decode bs {bs}", owner="decode graphs (mori SDMA all-reduce, async)",
                    static={"hidden": self.hidden[bs]}, state={"sdma_transit": self.comm.transit})

    def execute_model(self, hidden):
        if not self.graphed:
            return self.model.forward(self.comm, hidden).clone()
        bs = hidden.shape[0]
        self.hidden[bs].copy_(hidden)
        g, out = self.graphs[bs]
        return replay(g, out).clone()


def run(variant: str, device: str = "cpu"):
    model = RowParallelMLP(device)
    gen = generator(55900)
    inputs = [randn(bs, HIDDEN, gen=gen, device=device) for bs in SCHEDULE]

    def serve(graphed: bool):
        runner = ModelRunner(model, device, variant, graphed)
        return [runner.execute_model(x) for x in inputs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
