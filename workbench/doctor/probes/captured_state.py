"""The Python state each graph's capture left, for the eager form of that graph's replays.

A runner that captures several sizes prepares each capture in Python: it binds the attention
metadata of that size on a backend all graphs share (``self.forward_metadata = ...``), sets
``self.bs``. The kernels a capture recorded keep what it saw; the Python attributes keep what the
*last* capture bound. Differential replay runs a graph's eager form (the captured callable) at
its replays: read as it stands, the callable of an earlier size would run with the last size's
metadata and disagree with a correct graph. So, at the end of each capture, the attributes of the
program's objects reachable from the frames around the capture are kept (``captured``).
Before an eager run of that graph, an attribute that holds tensors (metadata), that a later
capture rebound and that nothing rebound since, is given the value this capture left; it is given
back after the run (``restore``/``give_back``). An attribute the program set outside any capture
(metadata bound per step, a feature switched on after capturing) is left as it is now, and so is
every number, flag or string: those are the step's own decisions, which the eager run must take
again (a flag set after capturing may equal, by chance, what the last capture saw).

Only weak references are held (a tensor, an object; a tuple of them is rebuilt), and the
walk does not outlive the capture: the doctor must not keep alive what the program lets go, or
memory a graph still reads would never be released under it.
"""
from __future__ import annotations

import inspect
import sys
import warnings
import weakref

import torch

from ...engine.source import user_frames
from . import reach

_FRAMES = 2             # the user's frames around a capture whose locals are walked: the one that opened it, its caller
_ATOMS = (int, float, bool, str, type(None))
_GONE = object()


def captured(info) -> None:
    """Keep the attributes that hold tensors as this capture leaves them (at its end: what its
    Python saw and set)."""
    frames = user_frames()[:_FRAMES]
    roots = [frame_locals(f) for f in frames]
    del frames
    nodes = reach.watched(roots)
    kept = {}
    with warnings.catch_warnings():     # (a library's deprecated attribute warns when looked at: not the program's)
        warnings.simplefilter("ignore")
        for obj in reach.reached(nodes, roots):
            attrs = getattr(obj, "__dict__", None)
            if not isinstance(attrs, dict) or isinstance(obj, (torch.Tensor, type)):
                continue
            try:
                ref = weakref.ref(obj)
            except TypeError:
                continue
            for name, value in attrs.items():
                if (weak := _weak(value)) is not _GONE and _tensors_in(weak):
                    kept[(id(obj), name)] = (ref, name, weak)
    del roots, nodes
    info.left = kept


def frame_locals(frame) -> dict:
    """A copy of a frame's locals that leaves the frame holding none of them: before Python 3.13,
    ``f_locals`` caches a snapshot on a function's frame, which would keep alive what the function
    lets go after the capture (a tensor it releases while a graph still reads it)."""
    shown = frame.f_locals
    out = dict(shown)
    if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        shown.clear()
    return out


def restore(doctor, info) -> list:
    """Give each attribute holding tensors that a later capture rebound, and nothing rebound since,
    the value this graph's capture left; returns what to undo (``give_back``). The later captures
    are the graphs watched after this one (``doctor.graphs`` keeps them in the order they were captured)."""
    later = []
    for other in reversed(doctor.graphs.values()):
        if other is info:
            break
        if other.left:
            later.append(other.left)
    undo = []
    for key, (ref, name, weak) in (info.left or {}).items() if later else ():
        latest = next((left[key][2] for left in later if key in left), None)
        obj = ref()
        if latest is None or obj is None or name not in vars(obj):
            continue
        attrs = vars(obj)
        now = attrs[name]
        if not same(now, latest) or same(now, weak) or (value := _strong(weak)) is _GONE:
            continue
        attrs[name] = value
        undo.append((attrs, name, now, value))
    return undo


def give_back(undo: list) -> None:
    """Undo ``restore`` where the eager run left the value it was given (what it rebound is its own)."""
    for attrs, name, now, value in undo:
        if attrs.get(name, _GONE) is value:
            attrs[name] = now


def _weak(value, depth: int = 0):
    """What is kept of a value, holding nothing (``_GONE``: it cannot be kept so):
    an atom as is; a tensor by a weak reference, and a view also by its geometry on its base's
    weak reference (the metadata a capture bound is often a view of a runner's buffer, released
    when the next capture binds its own, while the buffer lives on); an object of the program by a
    weak reference and its attributes; a tuple by its items. Three levels deep at most."""
    if isinstance(value, _ATOMS):
        return ("atom", value)
    if depth > 2:
        return _GONE
    if isinstance(value, torch.Tensor):
        base = value._base
        return ("tensor", weakref.ref(value), None if base is None else (
            weakref.ref(base), tuple(value.shape), value.stride(), value.storage_offset()))
    if isinstance(value, tuple):
        parts = tuple(_weak(v, depth + 1) for v in value)
        return _GONE if any(p is _GONE for p in parts) else ("tuple", type(value), parts)
    attrs = getattr(value, "__dict__", None)
    if not isinstance(attrs, dict) or hasattr(type(value), "__slots__") or isinstance(value, (type, torch.nn.Module)):
        return _GONE
    try:
        ref = weakref.ref(value)
    except TypeError:
        return _GONE
    parts = {k: _weak(v, depth + 1) for k, v in attrs.items()}
    return ("object", ref, type(value), None if any(p is _GONE for p in parts.values()) else parts)


def _strong(weak):
    """The value ``_weak`` kept: the object itself while it lives, else one made again (a view on
    its living base, an object of the same class with the same attributes, a tuple)."""
    how = weak[0]
    if how == "atom":
        return weak[1]
    if how == "tensor":
        if (t := weak[1]()) is not None or weak[2] is None:
            return _GONE if t is None else t
        base_ref, size, stride, offset = weak[2]
        base = base_ref()
        return _GONE if base is None else base.as_strided(size, stride, offset)
    if how == "object":
        if (obj := weak[1]()) is not None or weak[3] is None:
            return _GONE if obj is None else obj
        attrs = {k: _strong(v) for k, v in weak[3].items()}
        if any(v is _GONE for v in attrs.values()):
            return _GONE
        obj = weak[2].__new__(weak[2])
        obj.__dict__.update(attrs)
        return obj
    parts = [_strong(p) for p in weak[2]]
    if any(p is _GONE for p in parts):
        return _GONE
    cls = weak[1]
    return cls(*parts) if hasattr(cls, "_fields") else cls(parts)      # (a namedtuple's class takes its fields)


def _tensors_in(weak) -> bool:
    """Whether a kept value holds a tensor: metadata a capture prepared for its size. A number,
    a flag or a string alone is a decision, which the eager step must take again as the program
    now says (a flag set after capturing may equal what the last capture saw by chance)."""
    how = weak[0]
    if how == "tensor":
        return True
    if how == "object":
        return weak[3] is not None and any(map(_tensors_in, weak[3].values()))
    return how == "tuple" and any(map(_tensors_in, weak[2]))


def same(value, weak) -> bool:
    """Whether ``value`` is what ``weak`` keeps: an equal atom, the same tensor or object, or a
    tuple of those."""
    if weak is None:
        return False
    how = weak[0]
    if how == "atom":
        return type(value) is type(weak[1]) and value == weak[1]
    if how in ("tensor", "object"):
        return value is weak[1]()
    return isinstance(value, tuple) and len(value) == len(weak[2]) and all(map(same, value, weak[2]))
