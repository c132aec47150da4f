"""What the engine and the runners announce, so that an observer (the graph doctor) can watch.

A CUDA graph's hazards live between the calls: a capture that recorded less than the warmup ran,
a replay that reads memory whose owner let go, padded rows nobody refreshed. The engine calls the
functions below at those moments; with no observer subscribed each call returns at once, so the
engine pays one lookup per event.

Who calls what, and when (a runner built on the graph manager gets all of this for free):

* the engine itself: ``capture_begin``/``capture_end``/``capture_abort`` (``graph()``),
  ``capture_refused`` (a capture that could not begin: its pool handle refused),
  ``pool_made`` (``graph_pool_handle()``), ``pool_used`` (the pool a capture that began was given)
  and ``replay_begin``/``replay_end`` (both graph classes), with ``launching`` between them on
  CUDA. ``capture_end`` comes once the capture has closed, on both backends: what an observer
  does then is not recorded, and an observer that raises leaves no capture open.
* a runner, **once, before its first warmup**, names what its tensors *mean*:

  - ``static_buffers``: inputs it rewrites every step and the graphs read through views: a step
    that writes some of them and leaves one unwritten has omitted an input (the graph reads an
    earlier step's values); one buffer is one input of one role;
  - ``persistent_state``: state that lives across steps and that the graphs read *and* write on
    purpose (KV caches, SSM states), or that the runner carries from step to step on purpose (a
    block table extended in place);
  - ``shared_outputs``: output buffers that several graphs write (one buffer, a view per size);
  - ``written_metadata``: buffers a graph writes on purpose as part of its job (metadata it
    computes from its inputs), which are not inputs mutated by mistake.

  Announcing again (after a re-capture or a resize) replaces the meaning of those tensors.
* ``warmup()`` around each eager run made before a capture (``warmup(real=True)`` when that run is
  a real step whose results the runner hands out: lazy capture on a shape's first batch).
* ``dummy_run()`` around eager code that runs on a capture's dummy batch between its graphs: the
  eager regions of a PIECEWISE capture (attention between the pieces). What it writes into
  persistent state is dummy data, as a warmup's is, and must not land on live rows.
* ``reference()`` around a run of the same workload without graphs (the eager baseline a test
  compares the served run with), made **before** the graphs are captured: the doctor compares each
  replay with the same step of that run.
* ``results`` once the served run is done, with its results beside the reference run's: the
  workload's own verdict (``doctor/probes/reference.py``).
* ``serve`` **after** the runner has written this step's inputs (and neutralised whatever padded
  rows it neutralises), **immediately before** ``replay()``, with the padded rows (``padded``) and
  the padded columns (``padded_columns``: a buffer and the width of the step's data in it). The doctor fills only padded rows and
  padded columns that nothing rewrote since the previous replay, so the order of the runner's own
  writes no longer changes the verdict; a ``serve`` announced after the replay describes nothing.
* ``handed_out`` right after the replay, with the views of the outputs returned to the caller.

The engine's own tensor ops on a served step (the copy of a batch into a static buffer, the slice
of an output) go through ``engine_op``: an observer that watches ops checks them there as it would
through a dispatch mode, without the mode's cost on every step.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

_observers: list[Any] = []
_EVENTS = ("capture_begin", "capture_end", "capture_abort", "capture_refused", "graph_reset", "pool_made", "pool_used",
           "replay_begin", "launching", "replay_end", "static_buffers",
           "persistent_state", "shared_outputs", "written_metadata", "warmup_begin", "warmup_end",
           "dummy_run_begin", "dummy_run_end", "reference_begin", "reference_end", "results", "serve", "handed_out",
           "engine_op")
# event -> the observers' handlers, in subscription order: looked up once per subscription, not
# per event (a served step emits four events, and an observer's cost is host time per step).
_handlers: dict[str, tuple] = {event: () for event in _EVENTS}


def subscribe(observer: Any) -> None:
    _observers.append(observer)
    _collect()


def unsubscribe(observer: Any) -> None:
    _observers.remove(observer)
    _collect()


def _collect() -> None:
    """Each observer handles the events it has a method for (an observer listens to what it needs)."""
    for event in _EVENTS:
        _handlers[event] = tuple(h for o in _observers if (h := getattr(o, event, None)) is not None)


def _emit(event: str, *args: Any, **kwargs: Any) -> None:
    for handler in _handlers[event]:
        handler(*args, **kwargs)


def capture_begin(graph: Any, name: str | None) -> None:
    if _observers:
        _emit("capture_begin", graph, name)


def capture_end(graph: Any) -> None:
    if _observers:
        _emit("capture_end", graph)


def capture_abort(graph: Any, error: BaseException) -> None:
    if _observers:
        _emit("capture_abort", graph, error)


def capture_refused(graph: Any, pool: Any, name: str | None, error: BaseException) -> None:
    if _observers:
        _emit("capture_refused", graph, pool, name, error)


def graph_reset(graph: Any) -> None:
    """A captured graph was reset: its pool memory goes back to the pool, under any graph that still
    reads it (a dangling read is named where this happened)."""
    if _observers:
        _emit("graph_reset", graph)


def pool_made(pool: Any) -> None:
    if _observers:
        _emit("pool_made", pool)


def pool_used(graph: Any, pool: Any) -> None:
    if _observers and pool is not None:
        _emit("pool_used", graph, pool)


def replay_begin(graph: Any) -> None:
    for handler in _handlers["replay_begin"]:
        handler(graph)


def launching(graph: Any) -> None:
    """A CUDA graph about to launch (after ``replay_begin``): an observer may raise, instead of the
    launch, the error its kernels would give (an index out of range ends the CUDA context on a
    device-side assert; the CPU raises at the op). ``replay_end`` follows either way."""
    for handler in _handlers["launching"]:
        handler(graph)


def replay_end(graph: Any) -> None:
    for handler in _handlers["replay_end"]:
        handler(graph)


def static_buffers(owner: str, buffers: Mapping[str, Any]) -> None:
    """Persistent input buffers that graphs read through views (names are for reports), written by
    the runner before every replay. A graph writing one of them is a mutation of its input; writes
    into them must fit them, and land where the graph reads."""
    if _observers:
        _emit("static_buffers", owner, dict(buffers))


def persistent_state(owner: str, buffers: Mapping[str, Any]) -> None:
    """State kept across steps that graphs read and write on purpose (KV/SSM caches). Differential
    replay compares what the graph and an eager step write there; a warmup must not overwrite the
    parts that already hold live data."""
    if _observers:
        _emit("persistent_state", owner, dict(buffers))


def shared_outputs(owner: str, buffers: Mapping[str, Any]) -> None:
    """Output buffers written by several graphs: a view handed out after one graph's replay is
    stale once *any* graph writing the same memory replays."""
    if _observers:
        _emit("shared_outputs", owner, dict(buffers))


def written_metadata(owner: str, buffers: Mapping[str, Any]) -> None:
    """Buffers a graph writes on purpose (metadata it derives from its inputs): not a mutation."""
    if _observers:
        _emit("written_metadata", owner, dict(buffers))


@contextlib.contextmanager
def _bracket(begin: str, end: str, **kwargs: Any) -> Iterator[None]:
    """A begin event, the block, then the end event for the observers that saw the begin and are
    still subscribed. A block a thread left without ending it ends when its generator is collected,
    whenever that is: an observer subscribed since must not take that end for one of its own."""
    if not _observers:
        yield
        return
    saw = _handlers[end]
    _emit(begin, **kwargs)
    try:
        yield
    finally:
        for handler in _handlers[end]:
            if handler in saw:
                handler()


@contextlib.contextmanager
def warmup(real: bool = False) -> Iterator[None]:
    """The eager run(s) a runner makes before capturing the next graph. ``real=True``: the run is a
    real step, not a dummy batch (a runner that captures lazily on the first batch of a shape and
    hands that run's results to the caller), so what it writes into state is real data that later
    steps may read."""
    # (``real`` is passed only when set: observers written before the flag take no argument)
    with _bracket("warmup_begin", "warmup_end", **({"real": True} if real else {})):
        yield


@contextlib.contextmanager
def dummy_run() -> Iterator[None]:
    """Eager code run on a capture's dummy batch outside the graphs being captured (the graph
    manager wraps each eager region of a PIECEWISE capture in it)."""
    with _bracket("dummy_run_begin", "dummy_run_end"):
        yield


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """A run of the same workload without graphs, before the served run: the same requests, the same
    model calls, eagerly. Differential replay can only run the captured callable again, which
    carries what capture decided and reads what the runner's replay path prepared; this run is what
    the workload gives when neither is involved (see ``doctor/probes/reference.py``)."""
    with _bracket("reference_begin", "reference_end"):
        yield


def results(reference: Sequence[Any], served: Sequence[Any]) -> None:
    """The workload's own end-to-end comparison, once both runs are done: what its reference run
    (``reference()``) gave and what the served run gave, the same outputs in the same order (a test
    that asserts the two agree has both at hand). What the doctor found on replays that each gave the
    reference's answer is borne out when these differ, and stays a note when they agree."""
    if _observers:
        _emit("results", list(reference), list(served))


def serve(graph: Any, real: int, size: int, *, padded: Mapping[str, Any] | None = None,
          outputs: Any = None, eager: Callable[[], Any] | None = None,
          padded_columns: Mapping[str, tuple[Any, int]] | None = None, pieces: tuple = (),
          unpadded: Callable[[], Any] | None = None) -> None:
    """The next replay of ``graph`` serves ``real`` of its ``size`` rows (call it after writing the
    step's inputs, immediately before ``replay()``).

    ``padded`` maps names to tensors or NumPy arrays whose rows ``[real, size)`` are this step's
    padded rows; ``padded_columns`` maps names to ``(tensor, real_width)``: columns
    ``[real_width, tensor.shape[1])`` of rows ``[0, size)`` are padded columns. An observer may
    overwrite padded rows and columns (probes). ``outputs`` are the graph's static outputs (rows
    ``[0, real)`` are real). ``eager()``, when given, runs this step's forward eagerly on the same
    static buffers and returns its outputs: the doctor's differential replay compares it with the
    replay (without it, differential replay reports "not checked"). A step that replays several
    graphs with eager code between them (PIECEWISE) announces ``eager`` and ``pieces`` (its graphs,
    in order) on its first graph: the whole step is compared after the last. ``unpadded()``, when
    given with ``real < size``, runs the same step eagerly on the real rows alone (rows ``[0, real)``
    of the same buffers, no padded rows): padding must change nothing the real rows get, nor state
    they own (the doctor compares the two on sampled padded steps)."""
    for handler in _handlers["serve"]:
        handler(graph, real, size, dict(padded or {}), outputs, eager=eager, padded_columns=dict(padded_columns or {}),
                pieces=tuple(pieces), unpadded=unpadded)


def engine_op(func: Any, *args: Any) -> Any:
    """Run one aten op of the engine's serving path (``func(*args)``). The last observer with an
    ``engine_op(func, args)`` handler runs it and returns its result (observers subscribed before
    it see the op through their dispatch modes as usual); with none it runs here."""
    handlers = _handlers["engine_op"]
    return handlers[-1](func, args) if handlers else func(*args)


def handed_out(graph: Any, tensors: Any) -> None:
    """Views of ``graph``'s static outputs returned to the caller: stale after the next replay of
    any graph that writes the same memory."""
    for handler in _handlers["handed_out"]:
        handler(graph, tensors)
