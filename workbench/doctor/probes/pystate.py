"""Python state an eager step changes and a replay cannot: tensor bindings.

A replay runs kernels only. Whatever the step's Python does besides launching them -- bind an
attribute to this step's tensor (``self.x = h``) -- happened once, at capture, and never again.
Differential replay makes that visible: the tensor bindings reachable from the step's eager
callable are noted before its eager run and compared after it; a binding the eager step moved to a
tensor it made is host work the graph does not repeat. The doctor then puts every such binding back
as the replay left it, so the watched program goes on as if only the replay had run.

Reachable means through closures, bound methods, ``functools.partial``, object ``__dict__``
entries, dicts, lists and tuples (an ``nn.Module``'s submodules and buffers included), up to
``_MAX_OBJECTS`` objects, found once per graph. The engine's own objects are walked through (a
graph manager leads to the model) but not watched: their bookkeeping is not the step's.
"""
from __future__ import annotations

import functools
import types

import torch

from ...engine.opinfo import storage_key

_MAX_OBJECTS = 4000
_ATOMS = (int, float, bool, str, bytes, complex, type(None))  # walked past: nothing to reach through
_OPAQUE = (types.ModuleType, type, torch.dtype, torch.device, torch.Tensor)
_INFRA = ("workbench.engine", "workbench.doctor", "torch.utils._python_dispatch")


def watched(root: object) -> list:
    """The containers whose bindings the step could change: objects with a ``__dict__`` and dicts
    reachable from ``root`` (found once per eager callable: the reachable set is stable).
    Containers held by the engine's own objects are walked through, not watched."""
    seen, out, stack = set(), [], [(root, True)]
    while stack and len(seen) < _MAX_OBJECTS:
        obj, watch = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS) or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            stack += [(c.cell_contents, watch) for c in obj.__closure__ or () if _filled(c)]
            stack += [(d, watch) for d in obj.__defaults__ or ()]
        elif isinstance(obj, types.MethodType):
            stack += [(obj.__self__, watch), (obj.__func__, watch)]
        elif isinstance(obj, functools.partial):
            stack += [(v, watch) for v in (obj.func, *obj.args, *obj.keywords.values())]
        elif isinstance(obj, (dict, list, tuple)):
            if watch and isinstance(obj, dict):
                out.append(obj)
            stack += [(v, watch) for v in (obj.values() if isinstance(obj, dict) else obj)]
        elif isinstance(attrs := getattr(obj, "__dict__", None), dict):
            mine = not type(obj).__module__.startswith(_INFRA)
            if mine:
                out.append(obj)
            stack += [(v, mine) for v in attrs.values()]
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def bindings(objects: list) -> list:
    """``(container, key)`` of every binding of a tensor in the watched objects and dicts (found
    once per graph, with the containers)."""
    out = []
    for o in objects:
        items = (o if isinstance(o, dict) else o.__dict__).items()
        out += [(o, k) for k, v in items if isinstance(v, torch.Tensor)]
    return out


def snapshot(bound: list) -> list:
    """``(container, key, tensor bound now)`` for each of ``bindings``."""
    return [(o, k, (o if isinstance(o, dict) else o.__dict__).get(k)) for o, k in bound]


def changes(before: list, made: set | None) -> list[tuple]:
    """``(container, key, old, new)`` for every binding of a tensor that now holds another tensor,
    one the eager step made (``made``: its new storages; None when they are not known, and then any
    other tensor). Keys added or removed (a cache filled) and plain values are bookkeeping the
    step's kernels do not read."""
    out = []
    for obj, key, old in before:
        new = (obj if isinstance(obj, dict) else obj.__dict__).get(key, old)
        if new is not old and isinstance(new, torch.Tensor) and (made is None or storage_key(new) in made):
            out.append((obj, key, old, new))
    return out


def restore(changed: list[tuple]) -> None:
    """Put each changed binding back as it was before the eager step."""
    for obj, key, old, _ in changed:
        (obj if isinstance(obj, dict) else obj.__dict__)[key] = old


def name(obj, key) -> str:
    owner = type(obj).__name__
    return f"{owner}[{key!r}]" if isinstance(obj, dict) else f"{owner}.{key}"
