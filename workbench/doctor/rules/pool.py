"""Pool memory read across graphs: does a replay read what its capture read?

Graphs of one pool hand memory on: a block one capture freed (a temporary) may hold a tensor of
the next capture, and a graph may read another graph's output (PIECEWISE pieces do, every step).
Both are safe while every replay that reads pool memory finds there what the graph it read from
at capture wrote -- the producer. (Memory older than the captures, such as a KV cache every graph
updates, is state, not pool memory: any graph may have written it last; so is a block of the pool
that the graph which wrote it last had read first, as the reader does: a workspace or a set of
counters one capture allocated and every graph updates.) The doctor notes, per capture, each pool block it reads before
writing it and which capture wrote that block last (the producer), and, per replay, which graph
wrote each such block last. A reader that finds another graph's writes there reads someone else's
data: a graph whose capture freed the block and whose replays still write it
(``dangling-reference``: the block was handed on while its first owner still uses it, aiter
#5393), or a third graph that writes the producer's output (``overwritten-output``). A block the
producer's runner handed out as an output is an output whoever overwrites it: ``overwritten-output``
(the reader reads an output another replay overwrote, whether or not the writer had freed it).

Blocks are keyed by device and address, as the allocator hands them on (on the CPU emulation a
handed-on block keeps its storage; on CUDA it gets a new one at the same address)."""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ...engine.opinfo import describe, overwrites, op_tensors, tensors, written_tensors
from .. import explain
from ..report import Finding


def block(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr())


class PoolReads:
    """``Doctor.pool``: producers of blocks at capture, last writers at replay."""

    def __init__(self) -> None:
        self.producer: dict[tuple, tuple] = {}     # block -> (GraphInfo, Op, tensor) of the capture that wrote it last
        self.expected: set[tuple] = set()          # blocks some graph reads from another graph's capture
        self.last: dict[tuple, object] = {}        # block -> GraphInfo whose replay wrote it last
        self.pending: list = []                    # the last captured op's new outputs (weak), to settle
        self.allocated: dict[tuple, StorageWeakRef] = {}   # blocks some capture allocated: the pool's memory,
                                                           # with the storage it last gave there

    def captured(self, info, func, args, kwargs, out, op) -> None:
        """One op of a capture: blocks it reads before the capture wrote them, blocks it writes.
        Outputs are taken in at the next op (or at the capture's end): the CPU engine may still move
        a new output into a handed-on block after this observer has seen it made."""
        if func.overloadpacket is torch.ops.aten.set_ and self.pending:    # a new tensor re-pointed at other
            self.pending = [(r, o) for r, o in self.pending if r() is not args[0]]     # memory: not allocated here
        self.settle(info)
        if func.is_view:
            return
        written = written_tensors(func, args, kwargs)
        in_place = not overwrites(func) and func._schema.name.endswith("_")
        written_ids = {id(t) for t in written}
        for t in op_tensors(args, kwargs):
            if id(t) in written_ids and not in_place:
                continue                            # an ``out=`` or a copy destination: written, not read
            b = block(t)
            if b in info.blocks or not self.pooled(t, b):
                continue                            # written by this capture first, or not pool memory
            producer = self.producer.get(b)
            # (a producer that is gone took its memory with it: what lies at its address now is another's)
            if producer is not None and producer[0] is not info and producer[0].ref() is not None:
                info.expects.setdefault(b, producer)
                self.expected.add(b)
        inputs = {t.untyped_storage()._cdata for t in op_tensors(args, kwargs)}
        for t in written:
            self._wrote(info, t, op)
        self.pending = [(weakref.ref(t), op) for t in tensors(out) if t.untyped_storage()._cdata not in inputs]

    def settle(self, info) -> None:
        """Take in the previous op's new outputs, where they now live: memory the capture allocated.
        A new output at an address a capture of the pool allocated before was given memory freed since:
        the block was handed on (``dangling.aliased`` asks)."""
        for ref, op in self.pending:
            if (t := ref()) is not None:
                if (block(t) in info.own_blocks or block(t) in self.allocated) and t.numel():
                    info.rehanded[block(t)] = (op, len(info.ops))     # (memory freed since: handed on)
                info.own_blocks.add(block(t))
                self.allocated[block(t)] = StorageWeakRef(t.untyped_storage())
                self._wrote(info, t, op)
        self.pending = []

    def pooled(self, t: torch.Tensor, b: tuple) -> bool:
        """Whether ``t`` lies in pool memory: at an address a capture's new tensor was given, in that
        tensor's storage. Another storage there was made outside the captures, at an address the pool
        had given back (on the CPU emulation ``malloc`` reuses any freed address; a CUDA private pool's
        memory goes to no eager tensor while the pool lives): eager memory, state and not pool memory,
        and what the captures of the pool wrote at that address before is forgotten."""
        made = self.allocated.get(b)
        if made is None:
            return False
        if not made.expired() and made.cdata == t.untyped_storage()._cdata:
            return True
        del self.allocated[b]
        self.producer.pop(b, None)
        return False

    def _wrote(self, info, t, op) -> None:
        b = block(t)
        info.blocks.add(b)
        if b not in self.producer or self.producer[b][0] is not info:
            self.producer[b] = (info, op, describe(t))     # its first write in this capture names it

    def replayed(self, info) -> None:
        if self.expected:
            for b in info.blocks & self.expected:
                self.last[b] = info

    def check(self, doctor, info) -> None:
        """Before ``info`` replays: blocks it reads whose last writer is not their producer."""
        for b, (producer, op, tensor) in info.expects.items():
            last = self.last.get(b)
            if last is None or last is producer or last is info or b in last.expects:
                continue                # (a block the last writer read first, too: state the graphs share)
            now = self.producer.get(b)
            if now is not None and now[0] is last and now[1].source == op.source:
                continue                # (the producing code captured again, a task re-recorded: the producer now)
            handed_on, output = b in last.own_blocks, b in producer.handed_blocks
            kind = "dangling-reference" if handed_on and not output else "overwritten-output"
            evidence = (f"before replay {info.replays + 1} of {info.name}: it reads the {tensor} that {producer.name}'s "
                        f"capture wrote ({op.name}), but {last.name}'s replay wrote that memory last")
            doctor.add(Finding(kind, info.name, op.name, tensor, op.source, evidence,
                               explain.pool_handed_on(tensor, producer.name, last.name, handed_on, output),
                               {"replays_before": info.replays}), (kind, op.name, op.source))
