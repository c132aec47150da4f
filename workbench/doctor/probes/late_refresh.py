"""A static input refreshed after the replay that reads it.

A replay that read an input its step had not written (``stale-input``, ``reference_causes.static_input``)
may be followed, in the same step, by the very write it missed: the runner refreshes that input after it
replays (a graph's parameters updated after its launch), so every replay reads the previous step's
values. What tells it apart from a refresh left out: the first write into that buffer after the replay
puts there what the reference gave the replay's step. The finding is then named where the two are
ordered: the innermost frame on both the replay's stack and the write's, at the line that makes the
write (a refresh left out is named at the refresh beside it, as before).
"""
from __future__ import annotations

from ...engine.opinfo import storage_key
from ...engine.source import function_of, location, user_frames
from ..tensors import disagrees
from .reference_causes import rows_like


def frames() -> tuple:
    """``(id, location)`` of each user frame on the stack, innermost first (a write's, kept with it)."""
    return tuple((id(f), location(f)) for f in user_frames())


def after_replay(late: dict, name: str, stale: tuple, replays: int) -> None:
    """After a replay found to read a stale input (``stale``: its buffer, the view's geometry and what
    the reference gave the op): what the next write into that buffer is checked against."""
    late[name] = (*stale, {fid for fid, _ in frames()}, replays)


def check(late: dict, writers: dict, found: dict) -> None:
    """Before the next replay, or at the end: where the last write into a held buffer came after its
    replay (the same count of replays) and put there what the reference gave that replay's step, the
    graph's finding is named in the frame that replayed before it wrote."""
    for name, (buf, geometry, given, replayed_in, replays) in list(late.items()):
        del late[name]
        whole = buf.ref()
        writer = writers.get(storage_key(whole)) if whole is not None else None
        if writer is None or writer[4] != replays or name not in found:
            continue
        now = rows_like(whole.as_strided(*geometry), given)
        site = next((where for fid, where in writer[5] if fid in replayed_in), None)
        if now is None or site is None or bool(disagrees(now, given).any()):
            continue
        info, kind, op, tensor, _, why, text, numbers = found[name]
        why += (f"; the step writes them after the replay ({writer[1]}): {function_of(site)} replays the graph "
                "before it refreshes what the graph reads, so each replay reads the previous step's values")
        found[name] = (info, kind, op, tensor, site, why, text, numbers)
