"""Warmups and captures on threads the workload starts.

A dispatch mode is per thread: ``watch()`` enters the doctor's on the thread that runs it, and ops
another thread runs never reach it. Runners capture on worker threads (vLLM's micro-batch runner
warms up and captures each micro-batch's graph on a thread of its own), and what those captures
record -- the memory they read, the workspaces their warmups make -- would be invisible: a graph
reading a workspace freed when its thread ended would not be checked at all. So when a warmup or a
capture begins on another thread, the mode is entered there for that phase, beneath the engine's
own capture modes (the order the watching thread has), and left when the phase ends.
"""
from __future__ import annotations

import threading

from torch._C import _len_torch_dispatch_stack, _pop_torch_dispatch_stack, _push_on_torch_dispatch_stack


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
