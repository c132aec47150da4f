"""The doctor's own eager runs must end: a wait nothing can end fails them instead of hanging.

Differential replay runs a step's eager form on the state a replay left, which the program itself
never does, and that state may lack what the eager form waits for: work an earlier step's Python
would have queued (``queue.Queue.get`` on an empty queue: a graph's replay queues nothing its
capture's Python queued). In the program's own runs something fills the queue; in the doctor's run
nothing will, and the wait would hang the program under ``watch()``. So while a doctor's eager run
waits on a condition (``threading.Condition.wait``: a queue's ``get``, an ``Event``, a
``Semaphore``, a ``Barrier``) with no timeout, it waits only while another Python thread is alive
that could end the wait, at most ``PATIENCE`` seconds, and then raises ``EndlessWait``: the eager
run fails, and differential replay notes that it could not compare that step. Waits with a timeout,
and every wait of another thread, are left alone.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

PATIENCE = 30.0          # seconds a doctor's eager run waits while other threads could end the wait

_original = threading.Condition.wait
_bounded: collections.Counter = collections.Counter()   # thread id -> its doctor's eager runs in progress
_lock = threading.Lock()


class EndlessWait(RuntimeError):
    """A doctor's eager run waited for what nothing would give it."""


def _wait(self, timeout=None):
    if timeout is not None or threading.get_ident() not in _bounded:
        return _original(self, timeout)
    if _original(self, PATIENCE if threading.active_count() > 1 else 0):
        return True
    raise EndlessWait("the eager step waited on a condition nothing would signal (an empty queue's get, an unset "
                      "event): the state the replay left lacks what the eager step waits for")


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """Within the block, this thread's untimed condition waits are bounded (see the module). The
    class's ``wait`` is replaced while any thread is inside such a block (threads may replay, and so
    run eager steps, side by side)."""
    me = threading.get_ident()
    with _lock:
        if not _bounded:
            threading.Condition.wait = _wait
        _bounded[me] += 1
    try:
        yield
    finally:
        with _lock:
            _bounded[me] -= 1
            if not _bounded[me]:
                del _bounded[me]
            if not _bounded:
                threading.Condition.wait = _original
