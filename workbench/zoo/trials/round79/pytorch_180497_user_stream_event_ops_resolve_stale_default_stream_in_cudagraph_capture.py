"""A user-stream fork under torch.compile(mode="reduce-overhead"): the traced event ops look up "the current stream" in a table filled before the cudagraph tree switched to its capture stream, so the capture fails.

Upstream: https://github.com/pytorch/pytorch/pull/180497 ("[user-streams] Fix cudagraphs compatibility with current
stream", mlazos, opened 2026-04-15). It landed on main: its code is in the stored ``graph_bytecode_inputs.py`` and
``cudagraph_trees.py``. Its release cherry-pick, #180916 (opened 2026-04-20, "very important for VLLM in the next
release"), is marked merged. It fixes issue #180396 ("[inductor] Stream handling in
torch.compile with reduce-overhead mode is broken", 2026-04-14).
Symptom: a function that forks work onto a side stream (``ev.record(); with torch.cuda.stream(s1): ev.wait();
z = x * 2; ev2.record()``, then ``ev2.wait(); return z + y``) is correct eagerly and under the default
``torch.compile``. Under ``mode="reduce-overhead"``, call 1 (warmup) passes, and call 2 (recording) raises
``torch.AcceleratorError: CUDA error: operation not permitted when stream is capturing``
(cudaErrorStreamCaptureUnsupported).
Mechanism: Dynamo traces the stream and event methods into custom ops that hold no stream or event objects. They
hold indices into a side table, ``torch/_dynamo/graph_bytecode_inputs.py::index_to_external_object_weakref``:
``torch.ops.streams.record_event(event_index, stream_index)``, ``wait_event``, ``fork`` and ``join``. A call with no
stream argument (``ev.record()``, ``ev.wait()``) gets its stream from ``EventVariable._get_stream_arg``, which
returns ``tx.symbolic_stream_state.cur_stream()``. At the bottom of that stack is the trace-time current stream,
which has a ``CurrentStreamSource``, so it becomes a table entry. The pre-graph bytecode refills the table on every
call (``store_user_object_weakrefs(...)``) before the compiled graph runs. For that entry it evaluates
``torch.accelerator.current_stream()`` as the caller sees it, which is the default stream. Under reduce-overhead the
cudagraph tree then runs the graph on its own stream: ``CUDAWarmupNode.run`` under
``_use_cuda_memory_pool_manager(..., self.stream)``, and ``CUDAGraphNode._record`` inside
``torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local")``. The event ops still find
the stale default stream in the table. During warmup nothing is capturing, so using the wrong stream is harmless.
During the recording, ``record_event`` records the event on the default stream while the capture is open, and CUDA
refuses it. The PR says: "the registry was populated during the dynamo bytecode prologue with the trace-time default
stream -- not the cudagraph capture stream. This caused cudaErrorStreamCaptureUnsupported." Eagerly, and when
compiled without cudagraphs, the current stream is the default stream, so the stale entry happens to be right.
Doctor: sync-in-capture, at _record. The traced ``ev.record()`` makes the default stream, which is outside the
capture, take part in the captured stream's ordering while the capture ``_record`` opened is underway. CUDA refuses
that during a capture, as it refuses a host synchronisation, and the capture fails. The bug lives in ``_record``.
That is the function where the fix changed code: after ``torch.cuda.graph`` has switched the current stream, it
refreshes table slot 0 to the capture stream. (The same refresh went into ``CUDAWarmupNode.run``.)
Fix (upstream): ``graph_bytecode_inputs`` gets ``CURRENT_STREAM_INDEX = 0`` and
``set_external_object_by_index(index, value)``, which overwrites a slot at run time and keeps the object alive.
``SymbolicStreamState`` registers the current stream at index 0 (``register_current_stream``), and
``_get_stream_arg`` returns its ``user_object_index``. ``cudagraph_trees.py`` gets the context manager
``_update_current_stream_external_object()``, which runs
``set_external_object_by_index(CURRENT_STREAM_INDEX, torch.cuda.current_stream())``. It is entered in
``CUDAWarmupNode.run`` after ``_use_cuda_memory_pool_manager`` and in ``CUDAGraphNode._record`` after
``torch.cuda.graph`` ("NB: must go after torch.cuda.graph which switches the stream"). (Read: the PR description
and review threads, the post-fix ``graph_bytecode_inputs.py``, both post-fix ``cudagraph_trees.py`` hunks, and the
pre-fix ``variables/streams.py``.)
Modelled: streams and events are Python objects on both backends, since the CPU engine has none. The current stream
is a per-thread value that the stream contexts set. An event recorded on a capturing stream is a node of the
capture. A stream that waits on such an event joins the capture. The capture fails at its end if a joined stream
was never joined back (cudaErrorStreamCaptureUnjoined). The refused call is stated as a rule of the modelled
runtime: while this thread's capture is open, an event record or wait on the legacy default stream is refused with
cudaErrorStreamCaptureUnsupported. This is the outcome the PR reports. The model refuses at the first op that
resolves the stale slot; upstream, the exact runtime call that failed was not identified. The traced FX graph is
written by hand, with the indices Dynamo assigns: 0 for the current stream, then ev, s1, ev2. The tracer itself,
Inductor codegen, guards, the tree's other nodes, and its memory checkpoints are left out. Each call copies its
inputs into the recording's static placeholders and replays, as ``CUDAGraphNode.run`` does.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from workbench.engine import CaptureError, events
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/180497"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_record"
SYMPTOM = ("torch.compile(mode='reduce-overhead') of a user stream fork: call 2 (recording) raises 'operation not "
           "permitted when stream is capturing', because the event ops record on the stale default stream")

ROWS, COLS, CALLS = 4, 8, 4


# --- the modelled CUDA runtime: streams, events, capture membership --------------------------------------------

class _Capture:
    """One open stream capture: its origin stream, and the streams forked into it and not yet joined back."""

    def __init__(self, origin: "Stream"):
        self.origin, self.forked = origin, set()


_open_captures: list[_Capture] = []      # captures open on this (the only) thread


class Stream:
    """``torch.cuda.Stream``. ``legacy`` marks the default stream (the NULL stream)."""

    def __init__(self, name: str, legacy: bool = False):
        self.name, self.legacy = name, legacy
        self.capture: _Capture | None = None       # the capture this stream takes part in, if any

    def __repr__(self):
        return f"<Stream {self.name}>"

    def _refuse_if_legacy_in_capture(self, what: str) -> None:
        if self.legacy and _open_captures:
            where = user_frame()
            raise CaptureError(
                f"CUDA error: operation not permitted when stream is capturing (cudaErrorStreamCaptureUnsupported): "
                f"{what} on the default stream while {_open_captures[-1].origin!r} is being captured.\n  at {where}",
                op=what, source=where)

    def record_event(self, event: "Event") -> None:
        self._refuse_if_legacy_in_capture("cudaEventRecord")
        event.stream, event.capture = self, self.capture        # a captured event is a node of the capture

    def wait_event(self, event: "Event") -> None:
        self._refuse_if_legacy_in_capture("cudaStreamWaitEvent")
        cap = event.capture
        if cap is None:
            return                                               # an ordinary eager wait
        if self.capture is None:                                 # fork: this stream joins the capture
            self.capture = cap
            cap.forked.add(self)
        elif self is cap.origin and event.stream is not cap.origin:
            cap.forked.discard(event.stream)                     # join: the origin waits on the forked stream


class Event:
    """``torch.cuda.Event``: ``record()`` and ``wait()`` use the current stream."""

    def __init__(self):
        self.stream: Stream | None = None
        self.capture: _Capture | None = None

    def record(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).record_event(self)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)


DEFAULT_STREAM = Stream("default", legacy=True)
_current = [DEFAULT_STREAM]


def current_stream() -> Stream:
    """``torch.cuda.current_stream()`` / ``torch.accelerator.current_stream()``."""
    return _current[-1]


def set_stream(stream: Stream) -> None:
    """``torch.accelerator.set_stream``."""
    _current[-1] = stream


@contextlib.contextmanager
def stream(s: Stream):
    """``torch.cuda.stream(s)``: the current stream inside the block."""
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()


@contextlib.contextmanager
def cuda_graph_stream_capture(s: Stream):
    """What ``torch.cuda.graph(self.graph, stream=s)`` does around the engine's capture: make ``s`` current and
    capture it (cudaStreamBeginCapture ... cudaStreamEndCapture)."""
    cap = _Capture(s)
    s.capture = cap
    _open_captures.append(cap)
    try:
        with stream(s):
            yield
    finally:
        _open_captures.remove(cap)
        for member in (s, *cap.forked):
            member.capture = None
    if cap.forked:
        raise CaptureError("CUDA error: capturing stream has unjoined work (cudaErrorStreamCaptureUnjoined): "
                           f"{sorted(m.name for m in cap.forked)}", op="cudaStreamEndCapture")


# --- torch/_dynamo/graph_bytecode_inputs.py ---------------------------------------------------------------------

index_to_external_object_weakref: list = []
keep_alive: list = []
CURRENT_STREAM_INDEX = 0


def store_user_object_weakrefs(*args) -> None:
    index_to_external_object_weakref[:] = map(weakref.ref, args)


def set_external_object_by_index(index: int, value) -> None:
    """#180497: add or update an entry of the external object registry at runtime."""
    keep_alive.append(value)
    if index == len(index_to_external_object_weakref):
        index_to_external_object_weakref.append(weakref.ref(value))
    elif index < len(index_to_external_object_weakref):
        index_to_external_object_weakref[index] = weakref.ref(value)
    else:
        raise AssertionError("Index past the end of index_to_user_object_weakref")


def get_external_object_by_index(index: int):
    obj = index_to_external_object_weakref[index]()
    if obj is None:
        raise AssertionError("User object is no longer alive")
    return obj


# --- torch/_dynamo/variables/streams.py: the custom ops the traced graph calls ----------------------------------

def fork_stream(from_index: int, to_index: int) -> None:          # torch.ops.streams.fork
    set_stream(get_external_object_by_index(to_index))


def join_stream(from_index: int, to_index: int) -> None:          # torch.ops.streams.join
    set_stream(get_external_object_by_index(to_index))


def record_event(event_index: int, stream_index: int) -> None:    # torch.ops.streams.record_event
    get_external_object_by_index(stream_index).record_event(get_external_object_by_index(event_index))


def wait_event(event_index: int, stream_index: int) -> None:      # torch.ops.streams.wait_event
    get_external_object_by_index(stream_index).wait_event(get_external_object_by_index(event_index))


# --- the user's function (issue #180396) and what Dynamo made of it ---------------------------------------------

class UserStreams:
    def __init__(self):
        self.s1, self.ev, self.ev2 = Stream("s1"), Event(), Event()

    def stream_fn(self, x, y):
        """Eager: fork ``x * 2`` onto s1 and join back."""
        self.ev.record()                 # record on the current stream
        with stream(self.s1):
            self.ev.wait()               # s1 waits for the current stream
            z = x * 2                    # runs on s1
            self.ev2.record()            # record completion on s1
        self.ev2.wait()                  # the current stream waits for s1
        return z + y


CUR, EV, S1, EV2 = 0, 1, 2, 3            # indices Dynamo assigned (the trace-time current stream first)


def compiled_graph(inputs: list):
    """The FX graph Dynamo traced from ``stream_fn`` (the Inductor kernels are the two tensor ops); it takes its
    inputs as a list and clears it, as the graphs cudagraph trees run do."""
    x, y = inputs
    inputs.clear()
    record_event(EV, CUR)                # ev.record(): stream from _get_stream_arg -> cur_stream()
    fork_stream(CUR, S1)                 # with torch.cuda.stream(s1):
    wait_event(EV, S1)                   #     ev.wait()
    z = x * 2
    record_event(EV2, S1)                #     ev2.record()
    join_stream(S1, CUR)                 # (leaving the with block)
    wait_event(EV2, CUR)                 # ev2.wait()
    return (z + y,)


# --- torch/_inductor/cudagraph_trees.py -------------------------------------------------------------------------

@contextlib.contextmanager
def _update_current_stream_external_object():
    """#180497: make the registry's current-stream slot the stream that is current now (the tree's stream)."""
    set_external_object_by_index(CURRENT_STREAM_INDEX, current_stream())
    yield


@contextlib.contextmanager
def _use_cuda_memory_pool_manager(device, mem_pool, s: Stream):
    """Allocate into the tree's pool; ``torch.cuda.stream(s)`` around the block."""
    with stream(s):
        yield


class CUDAGraphTreeManager:
    """One tree, one path: call 1 warms up (``CUDAWarmupNode.run``), call 2 records (``CUDAGraphNode._record``,
    then one replay for its outputs), later calls copy inputs into the static placeholders and replay."""

    def __init__(self, model, variant: str, device: str):
        self.model, self.variant, self.device = model, variant, device
        self.stream = Stream("cudagraph tree stream")
        self.cuda_graphs_pool = None
        self.graph = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs = None
        self.calls = 0

    def run(self, new_inputs: list):
        self.calls += 1
        if self.calls == 1:
            return self.warmup_run(new_inputs)
        if self.graph is None:
            return self._record_and_run(new_inputs)
        return self.replay_run(new_inputs)

    def warmup_run(self, new_inputs: list):
        """``CUDAWarmupNode.run``."""
        refresh = _update_current_stream_external_object() if self.variant == "fix" else contextlib.nullcontext()
        with events.warmup(real=True):
            with _use_cuda_memory_pool_manager(self.device, self.cuda_graphs_pool, self.stream), refresh:
                return self.model(new_inputs)

    def _record(self, inputs: list):
        """``CUDAGraphNode._record``: capture the model on the tree's stream, thread-local mode."""
        def body():
            with cuda_graph_stream_capture(self.stream):                  # torch.cuda.graph(..., stream=self.stream)
                if self.variant == "fix":
                    # NB: must go after torch.cuda.graph which switches the stream
                    with _update_current_stream_external_object():
                        return self.model(list(inputs))
                return self.model(list(inputs))
        self.graph, self.static_outputs = capture(
            body, device=self.device, pool=self.cuda_graphs_pool, warmups=0, name="CUDAGraphNode",
            owner="cudagraph_trees CUDAGraphNode", capture_error_mode="thread_local",
            static={"static_input x": self.static_inputs[0], "static_input y": self.static_inputs[1]})

    def _record_and_run(self, new_inputs: list):
        # _allocate_and_copy_recording_inputs: the placeholders replays read
        self.static_inputs = [t.clone() for t in new_inputs]
        new_inputs.clear()
        self._record(self.static_inputs)
        return replay(self.graph, self.static_outputs)                   # run_first_inputs

    def replay_run(self, new_inputs: list):
        """``CUDAGraphNode.run``: copy the inputs into the placeholders, replay."""
        for dst, src in zip(self.static_inputs, new_inputs):
            dst.copy_(src)
        new_inputs.clear()
        return replay(self.graph, self.static_outputs)


class CompiledFunction:
    """``torch.compile(stream_fn, mode="reduce-overhead")``: guards pass, the pre-graph bytecode fills the external
    object table, then the cudagraphified graph runs."""

    def __init__(self, user: UserStreams, variant: str, device: str):
        self.user = user
        self.tree = CUDAGraphTreeManager(compiled_graph, variant, device)

    def __call__(self, x, y):
        # pre-graph bytecode: CurrentStreamSource -> torch.accelerator.current_stream(), then ev, s1, ev2
        store_user_object_weakrefs(current_stream(), self.user.ev, self.user.s1, self.user.ev2)
        try:
            return self.tree.run([x, y])
        finally:
            index_to_external_object_weakref.clear()          # dynamo clears the table after the call
            keep_alive.clear()


def run(variant: str, device: str = "cpu"):
    gen = generator(180497)
    steps = [(randn(ROWS, COLS, gen=gen, device=device), randn(ROWS, COLS, gen=gen, device=device))
             for _ in range(CALLS)]

    def served():
        compiled = CompiledFunction(UserStreams(), variant, device)
        outs = []
        for x, y in steps:
            (out,) = compiled(x, y)
            outs.append(out.clone())
        return outs

    def eager():
        user = UserStreams()
        return [user.stream_fn(x, y) for x, y in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
