"""How the containers a step could change are found from its eager callable, and found again.

A container is reachable from the step through closures, bound methods, ``functools.partial``,
object ``__dict__`` entries (a tensor's too: attributes a program sets on a parameter), the class
attributes and methods of the program's own classes (a generator or a singleton kept on a class),
dicts, lists, tuples and deques (an ``nn.Module``'s submodules and buffers included; a
``queue.Queue``'s items, the work a step takes off it: an eager run that took it must give it back,
or the next run blocks on an empty queue), up to
``_MAX_OBJECTS`` objects, found once per graph. The engine's own objects are walked through (a
graph manager leads to the model) but not watched: their bookkeeping is not the step's.

A walk names each container by the path that reached it first and keeps that path, not the
container (``watched``): ``found`` follows the paths again at each look. How an object is watched
(``Watch``) depends on the way it was reached: what only a class attribute holds is the program's
machinery, put back after an eager run but never reported.
"""
from __future__ import annotations

import collections
import enum
import functools
import queue
import sys
import types
import weakref

import torch

_MAX_OBJECTS = 4000


class Watch(enum.IntEnum):
    """How a container is watched, in increasing order (a container reached two ways gets the larger)."""

    NO = 0          # walked through (the engine's objects, a tuple, a class's definition), not kept
    QUIET = 1       # kept and put back after an eager run, its changes never reported (what only a class
                    # attribute holds: a generator kept on a class, whose offset the eager run advances)
    REPORTED = 2    # kept, put back, and a change the replay does not make is reported


ATOMS = (int, float, bool, str, bytes, complex, type(None))  # walked past: nothing to reach through
_OPAQUE = (types.ModuleType, type, torch.dtype, torch.device, torch.Tensor)
_INFRA = ("workbench.engine", "workbench.doctor", "torch.utils._python_dispatch")
_THEIRS = ("torch", "numpy")
_LIBRARIES = (*_THEIRS, "workbench.engine", "workbench.doctor")
# Library objects that hold the program's state: a model's, an optimizer's, the work queued for later steps
_STATEFUL = (torch.nn.Module, torch.optim.Optimizer, queue.Queue)
_RECORDINGS = ("workbench.engine.cpu_graph", "workbench.engine.recorded", "workbench.engine.pool")
# A module's hook registries: set up before serving, never a step's state (a dozen dicts per module,
# each compared on every sampled step otherwise).
_REGISTRIES = frozenset(torch.nn.Module().__dict__) - {"training", "_parameters", "_buffers", "_modules"}


def watched(root: object) -> list:
    """The containers whose contents the step could change: objects with a ``__dict__``, dicts,
    lists and sets reachable from ``root`` (found once per eager callable: the reachable set is
    stable), each named by the path that reached it first. A function reaches the module globals
    its code names (a connector kept in a module global, reached through
    ``get_kv_transfer_group()``), except inside torch and NumPy, whose registries and objects are
    theirs (modules and optimizers hold the model's state: those are walked). Only the globals of
    the program's own packages are walked: those of the objects and functions the step holds
    (a model's package, the runner's), not of every library their code calls.
    Containers held by the engine's own objects are walked through, not watched.

    What is kept is the way to each container, not the container: ``(parent, step, name, watched)``
    for everything walked, parents first (a root's parent is None and its step the object, a
    closure's cell, a module's globals), found again at each ``keep``. Holding the containers would
    keep alive what the program has let go (a buffer object the runner replaced, which a graph may
    still read: the doctor must not change when memory is released)."""
    seen, nodes, far, ours, near = {}, [], [], set(), True
    stack = [(root, Watch.REPORTED, "the step", None, _ROOT)]
    while (stack or far) and len(seen) < _MAX_OBJECTS:
        if not stack:                   # what the step holds first; then what its functions' globals hold
            stack, far, near = far[::-1], [], False
        obj, watch, label, parent, step = stack.pop()
        if near:
            ours.add(_package(obj))
        # (reached first through the engine's objects, unwatched, and then from the step's: watched)
        if isinstance(obj, type) and _program_class(obj) and id(obj) not in seen:
            # A class of the program's own: walked through, not watched (its dict is the class's
            # definition): what its class attributes hold (a default generator, a singleton kept on
            # the class) is put back after an eager run, quietly (``Watch.QUIET``), and the globals its
            # methods use are walked.
            seen[id(obj)] = watch
            nodes.append([parent, step, label, Watch.NO])
            far += [(f, Watch.REPORTED, f.__name__, None, _weak(f)) for f in _methods(obj)]
            stack += [(v, min(watch, Watch.QUIET), f"{obj.__name__}.{k}", len(nodes) - 1, _Attr(k))
                      for k, v in vars(obj).items()
                      if not k.startswith("__") and not isinstance(_function(v), (types.FunctionType, property))]
            continue
        if (was := seen.get(id(obj))) is not None and was >= watch or isinstance(obj, ATOMS) \
                or isinstance(obj, _OPAQUE) and not (isinstance(obj, torch.Tensor) and obj.__dict__):
            continue
        seen[id(obj)] = watch
        me = len(nodes)
        nodes.append([parent, step, label, Watch.NO])
        if isinstance(obj, types.FunctionType):
            if not (obj.__module__ or "").startswith(_LIBRARIES) and _package(obj) in ours:
                far += [(obj.__globals__[n], watch, n, None, _Global(obj.__globals__, n))
                        for n in _names(obj.__code__) if n in obj.__globals__]
            cells = enumerate(zip(obj.__code__.co_freevars, obj.__closure__ or ()))
            stack += [(c.cell_contents, watch, n, me, _Cell(i)) for i, (n, c) in cells if _filled(c)]
            stack += [(d, watch, f"{obj.__name__}'s default", me, _Default(i))
                      for i, d in enumerate(obj.__defaults__ or ())]
        elif isinstance(obj, types.MethodType):
            stack += [(obj.__self__, watch, type(obj.__self__).__name__, me, _SELF),
                      (obj.__func__, watch, label, me, _FUNC)]
        elif isinstance(obj, functools.partial):
            stack += [(v, watch, label, me, _Part(i)) for i, v in enumerate(_parts(obj))]
        elif isinstance(obj, (dict, list, tuple, set, collections.deque)):
            nodes[me][3] = watch if not isinstance(obj, tuple) else Watch.NO
            if isinstance(obj, set):            # (a set's members are reached, never found again by a key)
                stack += [(v, watch, f"{label}[{_key(v)}]", None, _weak(v)) for v in obj]
                continue
            items = dict.items(obj) if isinstance(obj, dict) else enumerate(obj)    # (not a subclass's own)
            stack += [(v, watch, f"{label}[{_key(k)}]", me, k) for k, v in items]
        elif isinstance(attrs := getattr(obj, "__dict__", None), dict):
            module, tensor = type(obj).__module__, isinstance(obj, torch.Tensor)
            if not tensor and not isinstance(obj, _STATEFUL) and (
                    module.startswith(_THEIRS) or module.startswith(_RECORDINGS)
                    or module.partition(".")[0] in sys.stdlib_module_names):
                continue                # a library's own object (an op overload, a logger), a graph's recording
            # A tensor is watched for the attributes the program set on it (a parameter's main_grad, the
            # gradient an optimizer reads from it), never walked into.
            mine = Watch.NO if not tensor and module.startswith(_INFRA) else \
                Watch.QUIET if watch == Watch.QUIET else Watch.REPORTED
            if mine:
                nodes[me][2], nodes[me][3] = type(obj).__name__, mine
                if not tensor:
                    far += [(f, mine, f.__name__, None, _weak(f)) for f in _methods(type(obj))]
            skip = _REGISTRIES if isinstance(obj, torch.nn.Module) else ()
            stack += [(v, mine, f"{type(obj).__name__}.{k}", me, _Attr(k)) for k, v in attrs.items() if k not in skip]
    return _ways(nodes)


def _key(key) -> str:
    """A key in a container's name: a plain value as written; another object by its type (a tensor
    key's ``repr`` reads its values, a host synchronisation, and a walk may run while a capture ends)."""
    return repr(key) if isinstance(key, ATOMS) else f"<{type(key).__name__}>"


def _ways(nodes: list) -> list:
    """The watched nodes and those on the way to them, renumbered (parents stay first)."""
    needed = set()
    for i in reversed(range(len(nodes))):
        if nodes[i][3] or i in needed:
            needed.add(i)
            if nodes[i][0] is not None:
                needed.add(nodes[i][0])
    index = {old: new for new, old in enumerate(sorted(needed))}
    return [(None if p is None else index[p], step, label, watch)
            for i, (p, step, label, watch) in enumerate(nodes) if i in needed]


class _Attr(str):
    """A step that is an attribute (an entry of an object's ``__dict__``), not a key."""


_SELF, _FUNC = _Attr("__self__"), _Attr("__func__")
_ROOT = object()        # the walk's root, given again at each look (a step's eager form may be made per step)


class _Cell(int):
    """A step into a function's closure: the contents of its cell at this index."""


class _Default(int):
    """A step to a function's default argument at this index."""


class _Part(int):
    """A step to a ``functools.partial``'s function, or one of its arguments (``_parts``)."""


def _parts(p: functools.partial) -> tuple:
    return (p.func, *p.args, *p.keywords.values())


def _weak(obj):
    """A root of the walk, held weakly where Python allows: the way to a container must not keep
    alive what the program lets go (a graphed callable's wrapper, and the graph its methods close over)."""
    try:
        return weakref.WeakMethod(obj) if isinstance(obj, types.MethodType) else weakref.ref(obj)
    except TypeError:
        return obj


class _Global(tuple):
    """A root that is a module global: ``(the module's globals, name)``, looked up again each time."""

    def __new__(cls, namespace: dict, name: str):
        return super().__new__(cls, (namespace, name))


def found(nodes: list, root) -> list:
    """Each node's object now (``MISSING`` where the way to it is gone), parents first, from ``root``
    (what ``watched`` was given, or its equal now)."""
    out = []
    for parent, step, _, _ in nodes:
        if parent is None:
            obj = root if step is _ROOT else get(*step) if isinstance(step, _Global) \
                else step() if isinstance(step, weakref.ref) else step
            obj = MISSING if obj is None else obj
        elif (obj := out[parent]) is MISSING:
            pass
        elif step is _SELF or step is _FUNC:
            obj = getattr(obj, step, MISSING)
        elif isinstance(step, _Cell):
            cells = getattr(obj, "__closure__", None) or ()
            obj = cells[step].cell_contents if step < len(cells) and _filled(cells[step]) else MISSING
        elif isinstance(step, _Default):
            defaults = getattr(obj, "__defaults__", None) or ()
            obj = defaults[step] if step < len(defaults) else MISSING
        elif isinstance(step, _Part):
            parts = _parts(obj) if isinstance(obj, functools.partial) else ()
            obj = parts[step] if step < len(parts) else MISSING
        elif isinstance(step, _Attr):
            attrs = getattr(obj, "__dict__", None)
            obj = get(attrs, step) if isinstance(attrs, dict) else attrs.get(step, MISSING) \
                if isinstance(obj, type) else MISSING
        elif isinstance(obj, dict):
            obj = get(obj, step)
        elif isinstance(obj, (list, tuple, collections.deque)) and isinstance(step, int) and step < len(obj):
            obj = obj[step]
        else:
            obj = MISSING
        out.append(obj)
    return out


def reached(containers: list, root) -> list:
    """The watched objects and containers of ``watched``, found again now from ``root``."""
    return [c for c, (_, _, _, watch) in zip(found(containers, root), containers)
            if watch == Watch.REPORTED and c is not MISSING]


def _package(obj) -> str:
    """The top-level package a function, or an object's class, comes from."""
    module = obj.__module__ if isinstance(obj, types.FunctionType) else type(obj).__module__
    return (module or "").partition(".")[0]


_METHODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # class -> (its MRO index, name) of each


def _methods(cls: type) -> tuple:
    """The functions a class of the program (not a library's) defines, its bases' included: what
    its objects' steps run, and through them the module globals they use (a tracker kept in a
    module global, reached through a method that calls ``get_tracker()``). Cached by name, weakly:
    a cache holding the class would keep a class defined in a function alive, and with it what its
    methods' closures hold (a graph whose drop the program relies on)."""
    found = _METHODS.get(cls)
    if found is None:
        found = _METHODS[cls] = tuple(
            (i, k) for i, klass in enumerate(cls.__mro__)
            if not (klass.__module__ or "").startswith(_LIBRARIES)
            and (klass.__module__ or "").partition(".")[0] not in sys.stdlib_module_names
            for k, v in vars(klass).items() if isinstance(_function(v), types.FunctionType))
    return tuple(_function(vars(cls.__mro__[i])[k]) for i, k in found)


def _program_class(cls: type) -> bool:
    """Whether a class is the program's own: not a library's, the engine's, nor the standard library's."""
    module = cls.__module__ or ""
    return not module.startswith(_LIBRARIES) and module.partition(".")[0] not in (*sys.stdlib_module_names,
                                                                                   "builtins")


def _function(v):
    return v.__func__ if isinstance(v, (staticmethod, classmethod)) else v


@functools.cache
def _names(code: types.CodeType) -> tuple:
    """The global names a function's code (its nested functions and comprehensions included) uses."""
    return tuple(code.co_names) + tuple(n for c in code.co_consts if isinstance(c, types.CodeType) for n in _names(c))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


MISSING = object()


def get(d: dict, key, default=MISSING):
    """``d[key]`` as stored, without a subclass's ``__getitem__``/``get``."""
    return dict.get(d, key, default)
