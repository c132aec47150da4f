"""What the doctor records about graphs and tensors: launch-trace ops (shared by the capture's
trace and the eager step's), referenced storages, announced buffers, pending replays, graphs."""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef


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


@dataclasses.dataclass
class External:
    """A storage a graph reads or writes without owning it."""

    weak: StorageWeakRef
    tensor: str
    dtype: torch.dtype
    op: str
    source: str
    origin: str | None
    view_only: bool
    reported: bool = False


@dataclasses.dataclass
class Buffer:
    """An announced tensor: ``role`` is input, state, output, metadata, or padded (named by serve)."""

    name: str
    owner: str
    ref: weakref.ref
    role: str


@dataclasses.dataclass
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
    rng: tuple = ()


class GraphInfo:
    def __init__(self, graph, name: str) -> None:
        self.ref = weakref.ref(graph)
        self.name = name
        self.cuda = not hasattr(graph, "ops")       # a torch.cuda.CUDAGraph exposes no op list
        self.ops: list[Op] = []                     # the capture's launch trace
        self.externals: dict[int, External] = {}
        self.cdatas: tuple[int, ...] = ()           # the externals' weak references, for a fast check
        self.writes: dict[int, Op] = {}             # external storage -> first op writing it
        self.created: set[int] = set()              # storages this capture created
        self.foreign: dict[int, tuple] = {}         # storage of another graph's pool -> (graph, op, source, tensor)
        self.out_keys: frozenset = frozenset()      # every storage a replay writes
        self.warmup: list[Op] | None = None         # the first warmup run before this capture
        self.eager_lines: set[str] = set()          # lines run eagerly after that warmup, outside the capture
        self.replays = 0
        self.probed = False
        self.attempts = 0                           # mutation probes run (see probes/mutation.py)
        self.pending: Pending | None = None
        self.python: list | None = None            # Python containers its eager step reaches (probes/pystate.py)
        self.startup_checked = False                # compared once from the state before the warmups
        self.blocks: set[tuple] = set()             # memory blocks the capture wrote (rules/pool.py)
        self.own_blocks: set[tuple] = set()         # of those, blocks it allocated
        self.expects: dict[tuple, tuple] = {}       # blocks read from another capture -> that producer
        self.scatters: list = []                    # captured writes into state through an index (rules/padded_scatter.py)
        self.live_slots: dict = {}                  # scatter -> slots real rows wrote
