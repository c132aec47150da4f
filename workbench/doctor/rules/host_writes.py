"""host-work-frozen: host code reads or writes, through NumPy or a raw pointer, memory a capture's ops use.

A capture records ops. Host code that reads or writes a tensor's memory directly goes through no
op, so the capture does not record it: a CPU kernel's stand-in, a sort or a tree refit done in
NumPy on the arrays' memory (Warp's CPU capture runs such host helpers once, as it records). Each
replay re-runs the recorded ops around that code and not the code: what it wrote is lost wherever
a recorded op wrote the memory before it, and what it computed from the graph's data is not
computed again, while the eager step does both every time.

No op shows it. What the doctor does see is the hand-off: while a capture is open, a CPU tensor's
memory is given to host code (``Tensor.numpy()``, ``__array__`` or ``data_ptr()``, seen by
``composite``'s function mode). Memory a recorded op of the capture wrote, handed over, is read by
host code. From the hand-off on, the doctor keeps the storage's bytes after every recorded op that
uses it and compares them before the next: a difference no recorded op made is a write by host
code. (Host code that writes the bytes already there, the same values, leaves no difference.) Only
storages handed over are kept, and only while the capture is open: nothing is copied on any other
path.

This is evidence, not a finding. It explains a differential replay whose launch trace agrees with
the eager step's while the numbers differ (``probes/rootcause``). The finding is named at the line
that handed the memory to host code (a write first).
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ... import engine
from ...engine.opinfo import describe, storage_key
from ...engine.source import mine, user_frame
from ..records import Op

# The tensor methods that give host code a tensor's memory, by name (``watch`` wraps some of them)
HANDED = frozenset({"numpy", "__array__", "data_ptr"})
_LIMIT = 16 << 20            # (bytes kept per storage handed over: a larger one is not followed)
_FORWARDING = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(engine.__file__)),
               os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "session.py"))


@dataclasses.dataclass
class HostWork:
    """Memory of a capture that host code wrote (``op``: the recorded op that found it changed) or
    read (``op``: the recorded op that wrote it before, None for memory the capture allocated), and
    the line that handed it to host code."""

    tensor: str
    handed_at: str
    wrote: bool
    op: Op | None


def handed(doctor, t, caller) -> None:
    """(``composite``'s function mode) ``t``'s memory goes to host code while a capture is open.
    ``caller``: the frame that called the torch method. Only the program's calls count (its own code
    or a library's), found past the frames that only pass them on: torch's (``np.asarray`` reaches
    ``Tensor.__array__`` through them), the engine's capture guards, and the wrappers ``watch`` puts
    on tensor methods (``session.py``). The doctor's own reads of a tensor's address or bytes (a
    digest of a constant, a tensor's start) hand nothing over."""
    info = doctor.capturing
    if info is None or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return
    while caller is not None and caller.f_code.co_filename.startswith(_FORWARDING):
        caller = caller.f_back
    if caller is None or not mine(caller):
        return
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        if t.untyped_storage().nbytes() > _LIMIT:
            return
        key, where = storage_key(t), user_frame()
        # (handed over again: the bytes the last recorded op left stay the baseline)
        kept = info.handed.get(key)
        info.handed[key] = (_bytes(t).clone() if kept is None else kept[0], where)
        if key not in info.host_work and (key in info.writes or key in info.created):
            info.host_work[key] = HostWork(describe(t), where, False, info.writes.get(key))


def before(info, inputs: list, func, source: str) -> None:
    """Before a recorded op: a storage handed to host code whose bytes changed since the last
    recorded op on it was written by the host in between."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        for t in inputs:
            kept = info.handed.get(key := storage_key(t))
            if kept is None or (known := info.host_work.get(key)) is not None and known.wrote:
                continue
            if not torch.equal(kept[0], _bytes(t)):
                info.host_work[key] = HostWork(describe(t), kept[1], True, Op(str(func), source))


def after(info, inputs: list) -> None:
    """After a recorded op: what the op left in the storages handed over is the baseline."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        for t in inputs:
            if (kept := info.handed.get(key := storage_key(t))) is not None:
                info.handed[key] = (_bytes(t).clone(), kept[1])


def cause(info) -> tuple | None:
    """``(kind, op, tensor, text)`` for ``rootcause`` when the capture saw host code read or write
    memory its ops use (a write first); None when it saw none."""
    if not info.host_work:
        return None
    work = max(info.host_work.values(), key=lambda w: w.wrote)
    if work.wrote:
        how = (f"host code wrote the {work.tensor} memory handed to it at {work.handed_at}: {work.op.name} at "
               f"{work.op.source} found it changed with no recorded op writing it. A replay re-runs the recorded "
               "ops and not that write, so what it left there is lost on every replay")
    else:
        made = f" ({work.op.name} at {work.op.source})" if work.op is not None else ""
        how = (f"host code was handed, at {work.handed_at}, the {work.tensor} memory a recorded op of the capture "
               f"wrote{made}, and read it. A replay re-runs that op and not the host code, so what the host "
               "computed from it stays as the capture left it")
    return ("host-work-frozen", Op("host code", work.handed_at), work.tensor,
            f"The launch traces agree, but during the capture {how}, while the eager step runs it again.")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s whole storage (a view: clone what is kept)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
