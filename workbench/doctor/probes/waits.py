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

A wait in C is not a condition's: a plain lock's ``acquire``, ``queue.SimpleQueue.get``, a thread's
``join`` on a thread that waits in turn. No Python method can be bounded for those, but a signal
interrupts them: on the main thread, where nothing else uses ``SIGALRM`` (no handler, no timer
running), an eager run that is still running after ``LIMIT`` seconds of wall time is stopped with
``EndlessWait`` too. A step that computes (not waits) for that long is stopped as well; the
comparison is then lost, not the program.
"""
from __future__ import annotations

import collections
import contextlib
import signal
import threading
from collections.abc import Iterator

PATIENCE = 30.0          # seconds a doctor's eager run waits while other threads could end the wait
LIMIT = 120.0            # seconds of wall time a doctor's eager run may take on the main thread

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


def _too_long(signum, frame):
    raise EndlessWait(f"the eager step was still running after {LIMIT:.0f} s (a wait nothing ends: a lock, a "
                      "thread's join, a queue the replay left empty)")


@contextlib.contextmanager
def _alarm(outermost: bool) -> Iterator[None]:
    """``LIMIT`` on the main thread's outermost eager run, where ``SIGALRM`` is nobody else's."""
    free = (outermost and threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))
    if not free:
        yield
        return
    signal.signal(signal.SIGALRM, _too_long)
    signal.setitimer(signal.ITIMER_REAL, LIMIT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """Within the block, this thread's untimed condition waits are bounded, and on the main thread
    the whole run too (see the module). The class's ``wait`` is replaced while any thread is inside
    such a block (threads may replay, and so run eager steps, side by side)."""
    me = threading.get_ident()
    with _lock:
        if not _bounded:
            threading.Condition.wait = _wait
        _bounded[me] += 1
        outermost = _bounded[me] == 1
    try:
        with _alarm(outermost):
            yield
    finally:
        with _lock:
            _bounded[me] -= 1
            if not _bounded[me]:
                del _bounded[me]
            if not _bounded:
                threading.Condition.wait = _original
