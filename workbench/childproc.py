"""Run a reproduction in a child process and get a structured result back.

A device-side assert or an illegal memory access poisons the whole CUDA context: every later CUDA
call in that process fails. A notebook that reproduces one must survive it, so the reproduction
runs in a fresh ``spawn``-ed process and the parent receives either the function's return value or
a description of the exception (type, message, and whether the child died outright).
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class ChildResult:
    ok: bool
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None

    def raise_if_failed(self) -> Any:
        if not self.ok:
            raise RuntimeError(f"child process failed: {self.error_type}: {self.error}\n{self.traceback or ''}")
        return self.value


def _target(queue, fn, args, kwargs):
    try:
        queue.put(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        queue.put(("error", (type(e).__name__, str(e), traceback.format_exc())))


def run_in_child(fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> ChildResult:
    """Call ``fn(*args, **kwargs)`` in a spawned process (``fn`` must be importable by name)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_target, args=(queue, fn, args, kwargs))
    proc.start()
    try:
        status, payload = queue.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - queue.Empty or a broken pipe when the child died
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
            return ChildResult(False, error_type="TimeoutError",
                               error=f"child did not finish within {timeout:.0f} s", exitcode=None)
        return ChildResult(False, error_type="ChildDied", error=f"child exited with code {proc.exitcode}",
                           exitcode=proc.exitcode)
    proc.join(30)
    if status == "ok":
        return ChildResult(True, value=payload, exitcode=proc.exitcode)
    etype, msg, tb = payload
    return ChildResult(False, error_type=etype, error=msg, traceback=tb, exitcode=proc.exitcode)


def on_cuda_in_child(probe: Callable[[str], dict], device: str) -> dict:
    """``probe(device)``, on CUDA in a child process: a refused op may break the capture, or the context."""
    if device == "cuda":
        return run_in_child(probe, device, timeout=300).raise_if_failed()
    return probe(device)
