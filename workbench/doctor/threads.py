"""Warmups and captures on threads the workload starts.

A dispatch mode is per thread: ``watch()`` enters the doctor's on the thread that runs it, and ops
another thread runs never reach it. Runners capture on worker threads (vLLM's micro-batch runner
warms up and captures each micro-batch's graph on a thread of its own), and what those captures
record -- the memory they read, the workspaces their warmups make -- would be invisible: a graph
reading a workspace freed when its thread ended would not be checked at all. So when a warmup or a
capture begins on another thread, the mode is entered there for that phase, beneath the engine's
own capture modes (the order the watching thread has), and left when the phase ends.

Work a capture hands to another thread (``Thread.start``, an executor's ``submit``) runs outside
the graph, once: what it writes no replay writes again (``handed_off``). CUDA's counterpart is a
kernel launched on the legacy default stream, which a capture on a side stream neither records nor
refuses; the CPU engine models it as such a thread. Memory that work writes and the graph reads
holds, at every replay, what that one run wrote (``filled_off``).
"""
from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

from torch._C import _len_torch_dispatch_stack, _pop_torch_dispatch_stack, _push_on_torch_dispatch_stack

from ..engine.opinfo import storage_key, tensors
from ..engine.source import location, mine
from .rules.sync import is_argument

# The calls that hand work to another thread, and where each keeps the function and its arguments.
HAND_OFFS = {threading.Thread.start.__code__: lambda f: (f["self"]._target, (f["self"]._args, f["self"]._kwargs)),
             ThreadPoolExecutor.submit.__code__: lambda f: (f.get("fn"), (f.get("args"), f.get("kwargs")))}


class Threads:
    """The thread ``watch()`` runs on, and the others the doctor's mode was entered on."""

    def __init__(self) -> None:
        self.home = threading.get_ident()
        self.lent: dict[int, int] = {}        # thread id -> phases open there

    def enter(self, mode, above: int = 0) -> None:
        """A phase begins on this thread: enter ``mode`` if it is not on the thread's stack, beneath
        the ``above`` modes the engine has just pushed (a CPU capture's recorder)."""
        ident = threading.get_ident()
        if mode is None or ident == self.home:
            return
        if ident in self.lent:
            self.lent[ident] += 1
            return
        if _len_torch_dispatch_stack() != above:
            return                             # another mode is there already: leave the thread alone
        engine = [_pop_torch_dispatch_stack(None) for _ in range(above)]
        _push_on_torch_dispatch_stack(mode)
        for m in reversed(engine):
            _push_on_torch_dispatch_stack(m)
        self.lent[ident] = 1

    def leave(self, mode) -> None:
        """A phase ends on this thread: the mode leaves once the thread's last open phase has, from
        wherever it is on the stack (an aborted capture announces it before its own modes leave)."""
        ident = threading.get_ident()
        if ident not in self.lent:
            return
        self.lent[ident] -= 1
        if self.lent[ident]:
            return
        del self.lent[ident]
        above = []
        while _len_torch_dispatch_stack() and (top := _pop_torch_dispatch_stack(None)) is not mode:
            above.append(top)
        for m in reversed(above):
            _push_on_torch_dispatch_stack(m)


def handed_off(info, frame) -> None:
    """A capture handed work to another thread (``frame`` runs ``Thread.start`` or ``submit``): each
    storage among the work's arguments is kept with where the work was launched. That is the first
    of the workload's frames outside the one that handed it on, walking out for as long as the work's
    function reached a frame as one of its arguments: a launch helper given its kernel
    (``launch(stream, kernel, *args)``, a stand-in for ``kernel<<<grid, block, 0, stream>>>``) only
    forwards what its caller chose to launch there."""
    work, given = HAND_OFFS[frame.f_code](frame.f_locals)
    caller = frame.f_back
    while caller is not None and not mine(caller):
        caller = caller.f_back
    if work is None or caller is None:
        return
    while caller.f_back is not None and mine(caller.f_back) and is_argument(caller, lambda v: v is work):
        caller = caller.f_back
    where = location(caller)
    for t in tensors(given):
        info.handed_off.setdefault(storage_key(t), where)
        base = t if t._base is None else t._base            # (a view shares its base's version counter)
        info.handed_versions.setdefault(storage_key(t), (weakref.ref(base), base._version))


def filled_off(info) -> None:
    """At the capture's end: the storages handed to work on another thread that it wrote (their
    version counters moved: every in-place write bumps one, on any thread) while the capture was
    open. No replay writes them again (``rootcause``: a graph that reads one reads what that one
    run left). Each by a weak reference to its base tensor (a view handed over may be a temporary), so
    that the doctor keeps no block alive in the capture's pool: one whose base is gone is the graph's
    own, a block it allocated (``_read_unwritten``)."""
    info.filled_off = {key: info.handed_off[key] for key, (ref, version) in info.handed_versions.items()
                       if (t := ref()) is not None and t._version != version}
    info.handed_versions = {}

