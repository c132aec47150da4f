"""What the doctor records about graphs and tensors: launch-trace ops (shared by the capture's
trace and the eager step's), referenced storages, announced buffers, pending replays, graphs."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ..engine.source import user_frame
from .raised import released_at
from .tensors import alias


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of a launch trace: name, user source line, storages read and written, the storages
    read that the run did not create itself (``ext``), and its Python-decided arguments."""

    name: str
    source: str
    reads: frozenset = frozenset()
    writes: frozenset = frozenset()
    ext: frozenset = frozenset()
    sig: tuple = ()
    memory: frozenset = frozenset()     # warmup ops: where its tensors live ("host", "cpu", "cuda")
    stack: tuple = ()                   # warmup ops: (function, line) of its frames in the warmup block, outer first


@dataclasses.dataclass
class External:
    """A storage a graph reads or writes without owning it."""

    weak: StorageWeakRef
    tensor: str
    dtype: torch.dtype
    op: str
    source: str
    origin: str | None
    view_only: bool                     # ``op``/``source`` are a view's: the first op that reads it replaces them
    touched_at: tuple = ()              # (op, source) of the capture's first op on it, a view too: it holds the address
    reported: bool = False
    host_copy: tuple = ()               # (op, source) of a captured host-to-device copy from it: host memory,
                                        # which every replay re-reads by address


@dataclasses.dataclass
class Buffer:
    """An announced tensor: ``role`` is input, state, output, metadata, or padded (named by serve)."""

    name: str
    owner: str
    ref: object             # () -> the tensor, None once its memory is released (``announced``)
    role: str
    source: str = ""        # where it was announced


def announced(name: str, owner: str, t: torch.Tensor, role: str, source: str = "") -> Buffer:
    """A ``Buffer`` whose ``ref`` is a weak reference to ``t``. A runner may announce a view taken
    for the announcement (``self.ids[:bs]``), which goes at once while its storage, the buffer, lives
    on: when the object goes, ``ref`` makes the same view of that storage again, until the storage
    goes too."""
    buf = Buffer(name, owner, None, role, source)
    weak, geometry = StorageWeakRef(t.untyped_storage()), (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())

    def gone(_ref) -> None:
        buf.ref = functools.partial(_view_of, weak, *geometry)
    buf.ref = weakref.ref(t, gone)
    return buf


def _view_of(weak, dtype, shape, stride, offset) -> torch.Tensor | None:
    if weak.expired():
        return None
    with _disable_current_modes():
        return alias(torch.UntypedStorage._new_with_weak_ptr(weak.cdata), dtype, shape, stride, offset)


@dataclasses.dataclass(slots=True)
class Pending:
    """What ``serve`` announced for the next replay."""

    real: int
    size: int
    outputs: object
    padded: dict
    eager: object
    columns: dict
    differential: bool
    pre: dict = dataclasses.field(default_factory=dict)
    reads: list = dataclasses.field(default_factory=list)      # small tensors its graphs only read (differential)
    rng: tuple = ()
    carried: dict = dataclasses.field(default_factory=dict)    # probes/carried.py
    span: tuple = ()                    # the step's graphs (GraphInfo), when it replays several (PIECEWISE)
    grad: bool = False                  # autograd on when the step was served: the eager step runs so too
    unpadded: object = None             # the step on its real rows alone (probes/unpadded.py)
    host: list = dataclasses.field(default_factory=list)       # Python containers' contents before the step
    replayed_host: list = dataclasses.field(default_factory=list)   # ... and after the replay (pystate.keep)
    agreed: bool = False                # its real rows equal the reference run's same step (probes/reference.py)
    capture_batch: bool = False         # ... or, the capture's own batch replayed first, it is no step of that run


def _objects_live_with_storages() -> bool:
    """Whether torch keeps a storage's Python object for as long as the storage lives and frees it
    with the storage (PyObject preservation): then a weak reference's callback says when it goes."""
    fired: list = []
    t = torch.empty(1)
    ref = weakref.ref(torch.UntypedStorage._new_with_weak_ptr(StorageWeakRef(t.untyped_storage()).cdata),
                      fired.append)
    kept = not fired
    del t
    return kept and bool(fired) and ref() is None


_PRESERVED = _objects_live_with_storages()
_CLOCK = itertools.count()     # orders captures and graphs let go of (``GraphInfo.born``, ``let_go``)


class Liveness:
    """Whether any storage a graph references has been released since the last look.

    Checked before every replay, and a graph may reference every weight of a model: a callback on
    each storage's Python object (which torch frees with the storage) makes the check O(1); only
    where torch does not keep those objects is each storage asked (one C call each). The callback
    runs as the storage goes, so it also sees where the workload let it go (``released_at``): what
    a finding tells besides the op that reads the address."""

    __slots__ = ("refs", "cdatas", "released", "where", "moved", "__weakref__")

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.cdatas: tuple[int, ...] = ()
        self.released = False
        self.where: dict[int, str] = {}     # storage (cdata) -> the line that released it, where known
        self.moved: set[int] = set()        # storages given other memory in place (``rules.dangling.moved``)

    def watch(self, externals: dict) -> None:
        """Follow the externals added since the last call (a graph's externals are only ever added)."""
        new = list(externals.values())[len(self.cdatas):]
        self.cdatas += tuple(ext.weak.cdata for ext in new)
        if not _PRESERVED:
            return
        for ext in new:
            storage = torch.UntypedStorage._new_with_weak_ptr(ext.weak.cdata)
            if storage is None:
                self.released = True
            else:
                self.refs.append(weakref.ref(storage, functools.partial(self._gone, ext.weak.cdata)))

    def _gone(self, cdata: int, _ref) -> None:
        self.released = True
        if (where := released_at(sys._getframe(1))) is not None:     # (called from C, in that frame)
            self.where[cdata] = where

    def any_released(self) -> bool:
        return self.released or not _PRESERVED and any(map(torch.UntypedStorage._expired, self.cdatas))


class GraphInfo:
    def __init__(self, graph, name: str) -> None:
        self.ref = weakref.ref(graph, self._dropped)
        self.name = name
        self.gone: tuple[str, str] | None = None    # ("reset" or "dropped", the user's line that did it)
        self.born, self.gone_at = next(_CLOCK), None    # when it was captured, and let go of
        self.site = user_frame()                    # the user's line that captured it
        self.callers: list = []                     # (function, key-like locals, line) of the frames that opened it
        self.cuda = not hasattr(graph, "ops")       # a torch.cuda.CUDAGraph exposes no op list
        self.ops: list[Op] = []                     # the capture's launch trace
        self.externals: dict[int, External] = {}
        self.liveness = Liveness()                  # of the externals, for the check before each replay
        self.writes: dict[int, Op] = {}             # external storage -> first op writing it
        self.read_first: set[int] = set()           # externals its ops read before it first wrote them
        self.created: set[int] = set()              # storages this capture created
        self.made: dict[int, tuple] = {}            # ... -> (the tensor it made there, which the program may
                                                    # hold, the op that made it, its line)
        self.unwritten: dict[int, tuple] = {}       # ... by an allocation alone, written by no op of it since: its block
        self.read_unwritten: dict[int, Op] = {}     # ... of those, read by an op of it while still unwritten: that op
        self.handed_off: dict[int, str] = {}        # storage handed to work on another thread in it -> the launch
        self.handed_versions: dict[int, tuple] = {}  # ... -> (weakref to its tensor, its version)
        self.filled_off: dict[int, str] = {}        # ... of those, written by that work in the capture -> the launch
        self.constants: set[int] = set()            # ... of those, Python data lifted in it (host values on CUDA)
        self.foreign: dict[int, tuple] = {}         # storage of another graph's pool -> (graph, op, source, tensor)
        self.collected: set[int] = set()            # ... of those, outputs a collection was run for (dangling)
        self.filled: set[int] = set()               # ... of those, its static inputs no op of that graph writes:
                                                    # eager code fills them each step (``probes/carried.py``)
        self.owners: tuple[int, tuple] = (0, ())    # rules.dangling's cache: (len(foreign), their graphs)
        self.warmup: list[Op] | None = None         # the first warmup run before this capture
        self.cells: tuple | None = None             # its eager form's closure cells at the last compared replay
        self.eager_lines: set[str] = set()          # lines run eagerly after that warmup, outside the capture (and
                                                    # after it, until captures are over: the rest of its step)
        self.pieces: list = []                      # later pieces of its step (PIECEWISE), captured after it
        self.called: set = set()                    # functions its captured ops ran in, inside the capture block
        self.opener = None                          # the function whose code opened the capture block
        self.handed_on: list = []                   # its static inputs announced since in another role (dangling)
        self.paths: list = []                       # with a reference run: each op's functions, static views read
        self.lines_run: set = set()                 # (function, line) run inside the capture, under diagnose's tracer
        self.asked: frozenset = frozenset()         # the user's functions that asked whether a capture is open, in it
        self.returned_numbers: dict = {}            # a Python number a function returned inside it -> that return
        self.returned_paths: dict = {}              # a function that returned a dict or list inside it -> placement
        self.by_value: list = []                    # (Op, value) of 0-dim host tensors its ops take by value
        self.taken_by_value: set = set()            # (op, line) taking a static input's value: the runner's data
        self.writes_inputs = False                  # it writes a static input (rules/mutation.py)
        self.unread_outputs: frozenset | None = None    # storages it created and never reads (differential)
        self.refused: tuple | None = None           # the first refusal raised inside it (rules/sync.py)
        self.replays, self.replayed_at = 0, 0      # ... and the doctor's count of all replays at its last
        self.size: int | None = None                # the size it was last served at (runner_events.serve)
        self.probed = False
        self.attempts = 0                           # mutation probes run (see probes/mutation.py)
        self.pending: Pending | None = None
        self.python: list | None = None            # Python containers its eager step reaches (probes/reach.py)
        self.host_left: tuple | None = None         # a container its eager step changed and replays do not
                                                    # (probes/host_left.py)
        self.left: dict | None = None               # attributes as its capture left them (probes/captured_state.py)
        self.startup_checked = False                # compared once from the state before the warmups
        self.held: list = []                        # (finding, key, place) of probes on replays that gave the reference
                                                    # run's answers: reported once one does not (differential)
        self.held_state: list = []                  # ... of state the eager form writes otherwise (reference.py)
        self.compared = 0                           # replays compared with an eager step
        self.disagreed = False                      # ... and one of them gave other results
        self.traced_always = False                  # its eager step wrote outside the kept state: trace each one
        self.padded_compared = 0                    # padded replays compared with an eager step
        self.read_views: dict = {}                  # static input -> views of it the capture read (rules/unread.py)
        self.rows: frozenset = frozenset()          # ... their rows: the size the graph was captured for
        self.reads: dict = {}                       # ... as masks of the elements the graph reads
        self.windows: dict = {}                     # ... and the line that cut each one-view window
        self.outside: dict = {}                     # ... the elements outside each (``unread.outside``), set-up's cut
        self.derived: list = []                     # storages it reads that set-up code computed from a static input
        self.window: dict | None = None             # static-input elements written since its last replay
        self.step: dict | None = None               # ... as they were when its current replay began
        self.consumed: set[int] = set()             # ... of those, inputs another graph's replay read since
        self.host_copied: list = []                 # during capture: what each copy from host memory read
        self.handed: dict = {}                      # storage handed to host code in it -> (bytes, where) (host_writes)
        self.host_work: dict = {}                   # ... which host code then wrote or read: storage -> HostWork
        self.blocks: set[tuple] = set()             # memory blocks the capture wrote (rules/pool.py)
        self.own_blocks: set[tuple] = set()         # of those, blocks it allocated
        self.handed_blocks: set[tuple] = set()      # blocks of the outputs a runner handed out (rules/pool.py)
        self.rehanded: dict[tuple, tuple] = {}      # ... again, once freed: (the op whose output took it, when)
        self.aliases: dict[int, int] = {}           # storages of none of its tensors on its blocks -> first seen
        self.expects: dict[tuple, tuple] = {}       # blocks read from another capture -> that producer
        self.scatters: list = []                    # captured writes into state through an index (rules/padded_scatter.py)
        self.live_slots: dict = {}                  # scatter -> slots real rows wrote
        self.shared_slots: dict = {}                # scatter -> {slot a padded row shared: (finding, key)}

    def _dropped(self, _ref) -> None:
        """The graph object was collected: where the program let go of it (a cache's eviction)."""
        self.let_go("dropped")

    def let_go(self, how: str) -> None:
        """The program reset the graph (the last reset counts) or dropped it: where (its line), and when."""
        if self.gone is None or how == "reset":
            self.gone, self.gone_at = (how, user_frame()), next(_CLOCK)


def unwritten_blocks(info, pending) -> set:
    """The memory blocks of a step's outputs that its graphs only allocate and no op of theirs writes
    (an attention output a later eager region fills): they hold no result, in a replay or in an eager
    run, and are not compared. By block: a runner may hand out a pointer-made alias of the output. (An
    allocation freed in the capture is forgotten: its block may be given to the next tensor.)"""
    return set().union(*(p.unwritten.values() for p in pending.span or (info,)))
