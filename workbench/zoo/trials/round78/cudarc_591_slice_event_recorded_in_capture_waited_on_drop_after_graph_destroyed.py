"""cudarc: a slice's read/write event recorded inside a capture becomes a captured event, and ``CudaSlice``'s Drop waits on it after the graph is gone, which poisons the context.

Upstream: https://github.com/chelsea0x3b/cudarc/pull/591 ("Fix: gate CudaSlice/SyncOnDrop teardown behind
is_managing_stream_synchronization", astorise; opened 2026-07-18, merged), fixing issue
https://github.com/chelsea0x3b/cudarc/issues/590 ("`SyncOnDrop`/`Drop for CudaSlice` bypass
`is_managing_stream_synchronization()`, poisoning the context after a captured CUDA graph is destroyed — error
surfaces on a later, unrelated call").
Symptom: a CUDA-graph user of cudarc (one stream, or ``disable_event_tracking()``) captures a decode step whose
persistent buffers go to cuBLAS. Later the graph is torn down (a batch-size change, a re-capture) and the buffers are
dropped. The next, unrelated cudarc call (here the allocation of the new bucket's input buffer) fails with
``DriverError(CUDA_ERROR_INVALID_VALUE, "invalid argument")``. Without graphs the same workload runs clean.
Mechanism: in ``src/driver/safe/core.rs`` the entry side of stream synchronisation is gated:
``DevicePtr::device_ptr``/``DevicePtrMut::device_ptr_mut`` (and ``LaunchArgs::arg`` in ``launch.rs``) wait on or
collect the slice's events only when ``ctx.is_managing_stream_synchronization()`` (multi-stream mode and event
tracking). The teardown side was not gated. ``impl Drop for SyncOnDrop`` (the guard ``device_ptr`` returns; cuBLAS's
``gemm`` takes one per operand: ``let (a, _record_a) = a.device_ptr(&self.stream);``) always ran
``stream.ctx.record_err(event.record(stream))``. ``impl<T> Drop for CudaSlice<T>`` always ran
``ctx.record_err(self.stream.wait(read))`` and ``...wait(write)``. A slice created while event tracking is on (the
default) has ``read``/``write`` events even on a single stream. When its guard is dropped while the stream is
capturing, ``cuEventRecord`` does not record anything: the event becomes a captured event that belongs to the graph
being built. Graph launches never re-record it on the host, so it stays that way. Once the graph is destroyed,
``Drop for CudaSlice``'s ``cuStreamWaitEvent`` on it fails with ``CUDA_ERROR_INVALID_VALUE``. Drop cannot return an
error, so ``record_err`` parks it in ``CudaContext::error_state``. The next call that goes through
``bind_to_thread()`` -> ``check_err()`` returns it. In eager mode the same guard records an ordinary event, and the
wait on it in Drop is harmless.
Doctor: warmup-divergence, at drop (``impl Drop for SyncOnDrop``, the ``Record`` arm). No listed kind names this
exactly, and this one is the nearest. The capture decides something that an eager step decides otherwise: the
guard's ``event.record(stream)`` ran under capture and left the slice's ``read``/``write`` events tied to that
capture, where an eager step leaves a completed event. Code after the capture (``Drop for CudaSlice``) relies on that
state and fails once the graph is gone. It is not a synchronisation in the capture, and no memory is read after it
is released. The bug lives in the two ``drop`` functions the fix gated: ``SyncOnDrop``'s (where the capture
captures the event) and ``CudaSlice``'s (where the wait on it fails).
Fix (upstream): ``SyncOnDrop::Record``'s Drop skips ``event.record(stream)``, and ``CudaSlice``'s Drop skips both
``stream.wait(read)`` and ``stream.wait(write)``, when ``!is_managing_stream_synchronization()``.
``SyncOnDrop::Sync`` is unchanged. (Read: the pre-fix ``core.rs``, ``launch.rs``, ``graph.rs`` and
``cublas/safe/gemm.rs`` at the mirror's HEAD of 2026-05-06, and the issue and PR text. The merged diff itself was
not available; the gates are modelled as the PR describes them.)
Modelled: the cudarc safe layer in Python with upstream names (``CudaContext``, ``CudaStream``, ``CudaEvent``,
``CudaSlice``, ``SyncOnDrop``, ``CudaGraph``, ``CudaBlas::gemm``, ``LaunchArgs``). A Rust ``Result`` is a raised
``DriverError``; ``record_err`` takes the call and parks its error; Drop is an explicit ``drop()``. The driver rule is
two functions: ``cuEventRecord`` on a capturing stream ties the event to the capture sequence, and
``cuStreamWaitEvent`` on an event whose capture's graph has been destroyed returns ``CUDA_ERROR_INVALID_VALUE``
(as the issue reports it). The kit's ``capture`` (one eager warmup, then the capture) runs between
``begin_capture`` and ``end_capture``; ``cuEventRecord`` asks the engine whether the capture is open, so the warmup's
records are ordinary ones. ``CudaGraph::launch`` is the kit's ``replay``. The user is a minimal decode runner of the kind the issue describes
(one stream, persistent input/output buffers per batch-size bucket, logits = softcap(hidden @ W) by cuBLAS plus a
custom kernel, the graph and buffers dropped when the batch size changes). Sampling, the KV cache and the model
body are left out.
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/chelsea0x3b/cudarc/pull/591"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "drop"
SYMPTOM = ("after a captured decode graph is destroyed and its buffers are dropped, an unrelated later cudarc call "
           "fails with CUDA_ERROR_INVALID_VALUE parked by Drop for CudaSlice")

DIM, VOCAB, SOFTCAP = 4, 8, 3.0
BATCH_SIZES = (2, 2, 2, 4, 4, 4)          # the scheduler's decode batch grows after three steps

CUDA_ERROR_INVALID_VALUE = "CUDA_ERROR_INVALID_VALUE"
_DESCRIPTIONS = {CUDA_ERROR_INVALID_VALUE: "invalid argument"}


class DriverError(RuntimeError):
    """``cudarc::driver::DriverError``: a ``CUresult`` that is not ``CUDA_SUCCESS``."""

    def __init__(self, code: str):
        self.code = code
        super().__init__(f"DriverError({code}, {_DESCRIPTIONS[code]!r})")


# --- the driver (what CUDA does with events and stream capture) ---------------------------------------------

class _CaptureSequence:
    """One stream capture (``cuStreamBeginCapture`` .. ``cuStreamEndCapture``) and the graph made from it."""

    def __init__(self):
        self.graph_destroyed = False


def cuEventRecord(event: "CudaEvent", stream: "CudaStream") -> None:
    if is_capturing() and stream.capture is not None:
        event.last_record = stream.capture          # a captured event: it belongs to the graph being built
    else:
        event.last_record = "stream"                # completes when the stream reaches it


def cuStreamWaitEvent(stream: "CudaStream", event: "CudaEvent") -> None:
    recorded = event.last_record
    if isinstance(recorded, _CaptureSequence) and recorded.graph_destroyed:
        raise DriverError(CUDA_ERROR_INVALID_VALUE)
    # a completed event, or one never recorded: nothing to wait for


# --- cudarc src/driver/safe/core.rs ------------------------------------------------------------------------

class CudaContext:
    def __init__(self, device: str, *, pr591: bool):
        self.device = device
        self.error_state = None                     # AtomicU32: 0 (None) or the parked CUresult
        self.num_streams = 0                        # streams made by new_stream()/fork()
        self.event_tracking = True                  # the default (enable_event_tracking)
        self.pr591 = pr591                          # core.rs after #591 (teardown gated) or before

    def bind_to_thread(self) -> None:
        self.check_err()                            # then cuCtxSetCurrent if another context is current

    def is_in_multi_stream_mode(self) -> bool:
        return self.num_streams > 0

    def is_event_tracking(self) -> bool:
        return self.event_tracking

    def is_managing_stream_synchronization(self) -> bool:
        return self.is_in_multi_stream_mode() and self.is_event_tracking()

    def check_err(self) -> None:
        error_state, self.error_state = self.error_state, None
        if error_state is not None:
            raise DriverError(error_state)

    def record_err(self, call) -> None:
        """``record_err(result)``: ``call`` is the expression whose ``Result`` Rust passes in."""
        try:
            call()
        except DriverError as err:
            self.error_state = err.code

    def new_event(self) -> "CudaEvent":
        self.bind_to_thread()
        return CudaEvent(self)

    def default_stream(self) -> "CudaStream":
        return CudaStream(self)


class CudaEvent:
    def __init__(self, ctx: CudaContext):
        self.ctx = ctx
        self.last_record = None                     # what the driver knows of the event

    def record(self, stream: "CudaStream") -> None:
        self.ctx.bind_to_thread()
        cuEventRecord(self, stream)

    def drop(self) -> None:
        self.ctx.record_err(self.ctx.bind_to_thread)
        # cuEventDestroy


class SyncOnDrop:
    """``enum SyncOnDrop { Record(Option<(&CudaEvent, &CudaStream)>), Sync(Option<&CudaStream>) }``."""

    def __init__(self, kind: str, target):
        self.kind, self.target = kind, target

    @staticmethod
    def record_event(event: CudaEvent | None, stream: "CudaStream") -> "SyncOnDrop":
        return SyncOnDrop("Record", (event, stream) if event is not None else None)

    def drop(self) -> None:
        target, self.target = self.target, None     # std::mem::take(target)
        if target is None:
            return
        if self.kind == "Record":
            event, stream = target
            if stream.ctx.pr591 and not stream.ctx.is_managing_stream_synchronization():
                return                              # #591: no event bookkeeping when the context does not manage it
            stream.ctx.record_err(lambda: event.record(stream))
        else:
            target.ctx.record_err(target.synchronize)


class CudaSlice:
    def __init__(self, data: torch.Tensor, read: CudaEvent | None, write: CudaEvent | None, stream: "CudaStream"):
        self.data, self.read, self.write, self.stream = data, read, write, stream

    def device_ptr(self, stream: "CudaStream"):
        if self.stream.ctx.is_managing_stream_synchronization():
            if self.write is not None:
                stream.ctx.record_err(lambda: stream.wait(self.write))
        return self.data, SyncOnDrop.record_event(self.read, stream)

    def device_ptr_mut(self, stream: "CudaStream"):
        if self.stream.ctx.is_managing_stream_synchronization():
            if self.read is not None:
                stream.ctx.record_err(lambda: stream.wait(self.read))
            if self.write is not None:
                stream.ctx.record_err(lambda: stream.wait(self.write))
        return self.data, SyncOnDrop.record_event(self.write, stream)

    def drop(self) -> None:
        ctx = self.stream.ctx
        if not ctx.pr591 or ctx.is_managing_stream_synchronization():    # #591 gates both waits
            if self.read is not None:
                ctx.record_err(lambda: self.stream.wait(self.read))
            if self.write is not None:
                ctx.record_err(lambda: self.stream.wait(self.write))
        self.data = None                            # result::free_async(cu_device_ptr, stream)
        for event in (self.read, self.write):       # then its fields drop (Drop for CudaEvent)
            if event is not None:
                event.drop()


class CudaStream:
    def __init__(self, ctx: CudaContext):
        self.ctx = ctx
        self.capture: _CaptureSequence | None = None

    def synchronize(self) -> None:
        self.ctx.bind_to_thread()

    def wait(self, event: CudaEvent) -> None:
        self.ctx.bind_to_thread()
        cuStreamWaitEvent(self, event)

    def alloc(self, *shape: int) -> CudaSlice:
        self.ctx.bind_to_thread()
        data = torch.empty(*shape, device=self.ctx.device)
        if self.ctx.is_event_tracking():
            read, write = self.ctx.new_event(), self.ctx.new_event()
        else:
            read = write = None
        return CudaSlice(data, read, write, self)

    def alloc_zeros(self, *shape: int) -> CudaSlice:
        dst = self.alloc(*shape)
        self.memset_zeros(dst)
        return dst

    def memset_zeros(self, dst: CudaSlice) -> None:
        self.ctx.bind_to_thread()
        dptr, _record = dst.device_ptr_mut(self)
        dptr.zero_()
        _record.drop()

    def memcpy_htod(self, src: torch.Tensor, dst: CudaSlice) -> None:
        self.ctx.bind_to_thread()
        dptr, _record_dst = dst.device_ptr_mut(self)
        dptr.copy_(src.to(dptr.device))
        _record_dst.drop()

    def clone_dtoh(self, src: CudaSlice) -> torch.Tensor:
        self.ctx.bind_to_thread()
        sptr, _record_src = src.device_ptr(self)
        host = sptr.to("cpu", copy=True)
        _record_src.drop()
        self.synchronize()
        return host

    # --- graph.rs ---
    def begin_capture(self) -> None:
        self.ctx.bind_to_thread()
        self.capture = _CaptureSequence()

    def end_capture(self, graph, outputs) -> "CudaGraph":
        self.ctx.bind_to_thread()
        sequence, self.capture = self.capture, None
        return CudaGraph(graph, outputs, self, sequence)

    def launch_builder(self, func) -> "LaunchArgs":
        return LaunchArgs(self, func)


# --- cudarc src/driver/safe/graph.rs, launch.rs, src/cublas/safe/gemm.rs ---------------------------------------

class CudaGraph:
    def __init__(self, cu_graph_exec, outputs, stream: CudaStream, sequence: _CaptureSequence):
        self.cu_graph_exec, self.outputs, self.stream, self.sequence = cu_graph_exec, outputs, stream, sequence

    def launch(self) -> None:
        self.stream.ctx.bind_to_thread()
        replay(self.cu_graph_exec, self.outputs)

    def drop(self) -> None:
        self.cu_graph_exec.reset()                  # cuGraphExecDestroy, cuGraphDestroy
        self.sequence.graph_destroyed = True


class LaunchArgs:
    """``stream.launch_builder(&func).arg(..).launch(cfg)``: its argument events are gated at entry."""

    def __init__(self, stream: CudaStream, func):
        self.stream, self.func = stream, func
        self.waits, self.records, self.args = [], [], []

    def arg(self, slice_: CudaSlice) -> "LaunchArgs":     # PushKernelArg<&mut CudaSlice<T>>
        if self.stream.ctx.is_managing_stream_synchronization():
            if slice_.read is not None:
                self.waits.append(slice_.read)
            if slice_.write is not None:
                self.waits.append(slice_.write)
                self.records.append(slice_.write)
        self.args.append(slice_.data)
        return self

    def launch(self) -> None:
        self.stream.ctx.bind_to_thread()
        for event in self.waits:
            self.stream.wait(event)
        self.func(*self.args)
        for event in self.records:
            event.record(self.stream)


class CudaBlas:
    def __init__(self, stream: CudaStream):
        self.stream = stream

    def gemm(self, a: CudaSlice, b: CudaSlice, c: CudaSlice) -> None:
        """``c = a @ b`` (row-major view of ``Gemm<f32>::gemm``)."""
        a_ptr, _record_a = a.device_ptr(self.stream)
        b_ptr, _record_b = b.device_ptr(self.stream)
        c_ptr, _record_c = c.device_ptr_mut(self.stream)
        c_ptr.copy_(a_ptr @ b_ptr)                  # result::gemm_ex
        for guard in (_record_c, _record_b, _record_a):   # locals drop in reverse order
            guard.drop()


def softcap_kernel(logits: torch.Tensor) -> None:
    logits.div_(SOFTCAP).tanh_().mul_(SOFTCAP)


# --- the user: a one-stream decode runner with a graph per batch-size bucket -------------------------------------

class DecodeRunner:
    """Fields in declaration order: a Rust struct drops ``graph`` before ``x`` and ``out``."""

    def __init__(self, ctx: CudaContext, weight: torch.Tensor, use_graphs: bool):
        self.stream = ctx.default_stream()
        self.blas = CudaBlas(self.stream)
        self.use_graphs = use_graphs
        self.w = self.stream.alloc(DIM, VOCAB)
        self.stream.memcpy_htod(weight, self.w)
        self.bucket = None
        self.graph: CudaGraph | None = None
        self.x: CudaSlice | None = None
        self.out: CudaSlice | None = None

    def forward(self) -> torch.Tensor:
        self.blas.gemm(self.x, self.w, self.out)
        self.stream.launch_builder(softcap_kernel).arg(self.out).launch()
        return self.out.data

    def set_bucket(self, batch: int) -> None:
        """A new batch size: drop the old bucket (graph first), then allocate and capture the new one."""
        if self.graph is not None:
            self.graph.drop()
            self.graph = None
        for buffer in (self.x, self.out):
            if buffer is not None:
                buffer.drop()
        self.x = self.stream.alloc_zeros(batch, DIM)
        self.out = self.stream.alloc_zeros(batch, VOCAB)
        self.bucket = batch
        if self.use_graphs:
            self.stream.begin_capture()
            g, outputs = capture(self.forward, device=self.stream.ctx.device, name=f"decode batch={batch}",
                                 static={"x": self.x.data}, owner="DecodeRunner (cudarc)")
            self.graph = self.stream.end_capture(g, outputs)

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] != self.bucket:
            self.set_bucket(hidden.shape[0])
        self.stream.memcpy_htod(hidden, self.x)
        if self.graph is not None:
            self.graph.launch()
        else:
            self.forward()
        return self.stream.clone_dtoh(self.out)


def run(variant: str, device: str = "cpu"):
    gen = generator(591)
    weight = randn(DIM, VOCAB, gen=gen, device="cpu")
    hiddens = [randn(batch, DIM, gen=gen, device="cpu") for batch in BATCH_SIZES]

    def serve(use_graphs: bool):
        ctx = CudaContext(device, pr591=(variant == "fix"))
        runner = DecodeRunner(ctx, weight, use_graphs)
        return [runner.step(hidden) for hidden in hiddens]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
