"""Python state an eager step changes and a replay cannot: tensor bindings, queues, counters.

A replay runs kernels only. Whatever the step's Python does besides launching them -- bind an
attribute to this step's tensor (``self.x = h``), take the work queued for a layer off a dict,
count a step -- happened once, at capture, and never again. Differential replay makes that
visible: the containers reachable from the step's eager callable are kept before its eager run and
compared after it; a binding the eager step moved to a tensor it made (``changes``), or any other
change the replay did not make, is host work the graph does not repeat.

The eager run must also start from the host state the replay started from, and leave the program
as the replay left it: a connector whose eager step takes this step's transfers off its queue
would otherwise find them gone when the served step's own code (an eager piece between graphs,
the code after the replay) looks for them. So the contents of every reachable container (an
object's attributes, a dict, a list, a set) are kept before the step (``keep``) and after the
replay, and put back (``put_back``) before and after each eager run: one level each, which covers
nested containers since each of them is kept too. Keys a run adds stay (a cache it filled).

Reachable means through closures, bound methods, ``functools.partial``, object ``__dict__``
entries (a tensor's too: attributes a program sets on a parameter), the class attributes and
methods of the program's own classes (a generator or a singleton kept on a class), dicts, lists
and tuples (an ``nn.Module``'s submodules and buffers included), up to
``_MAX_OBJECTS`` objects, found once per graph. The engine's own objects are walked through (a
graph manager leads to the model) but not watched: their bookkeeping is not the step's.
"""
from __future__ import annotations

import functools
import sys
import types
import weakref
from operator import is_

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import storage_key
from ...engine.source import location, mine
from ..tensors import disagrees

_MAX_OBJECTS = 4000
# What an object reached only through a class attribute is watched as: put back after an eager run
# (a generator kept on a class, whose offset the eager run advances), never reported as a change the
# replay does not make (what a class holds is the program's machinery, not the step's state).
QUIET = 0.5
_ATOMS = (int, float, bool, str, bytes, complex, type(None))  # walked past: nothing to reach through
_OPAQUE = (types.ModuleType, type, torch.dtype, torch.device, torch.Tensor)
_INFRA = ("workbench.engine", "workbench.doctor", "torch.utils._python_dispatch")
_THEIRS = ("torch", "numpy")
_LIBRARIES = (*_THEIRS, "workbench.engine", "workbench.doctor")
_STATEFUL = (torch.nn.Module, torch.optim.Optimizer)   # torch objects that hold a model's own state
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
    stack = [(root, True, "the step", None, _ROOT)]
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
            # the class) is put back after an eager run, quietly (``QUIET``), and the globals its
            # methods use are walked.
            seen[id(obj)] = watch
            nodes.append([parent, step, label, False])
            far += [(f, True, f.__name__, None, _weak(f)) for f in _methods(obj)]
            stack += [(v, watch and QUIET, f"{obj.__name__}.{k}", len(nodes) - 1, _Attr(k))
                      for k, v in vars(obj).items()
                      if not k.startswith("__") and not isinstance(_function(v), (types.FunctionType, property))]
            continue
        if (was := seen.get(id(obj))) is not None and was >= watch or isinstance(obj, _ATOMS) \
                or isinstance(obj, _OPAQUE) and not (isinstance(obj, torch.Tensor) and obj.__dict__):
            continue
        seen[id(obj)] = watch
        me = len(nodes)
        nodes.append([parent, step, label, False])
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
        elif isinstance(obj, (dict, list, tuple, set)):
            nodes[me][3] = watch if not isinstance(obj, tuple) else False
            if isinstance(obj, set):            # (a set's members are reached, never found again by a key)
                stack += [(v, watch, f"{label}[{_key(v)}]", None, _weak(v)) for v in obj]
                continue
            items = dict.items(obj) if isinstance(obj, dict) else enumerate(obj)    # (not a subclass's own)
            stack += [(v, watch, f"{label}[{_key(k)}]", me, k) for k, v in items]
        elif isinstance(attrs := getattr(obj, "__dict__", None), dict):
            module, tensor = type(obj).__module__, isinstance(obj, torch.Tensor)
            if not tensor and (module.startswith(_THEIRS) and not isinstance(obj, _STATEFUL)
                               or module.startswith(_RECORDINGS)
                               or module.partition(".")[0] in sys.stdlib_module_names):
                continue                # a library's own object (an op overload, a logger), a graph's recording
            # A tensor is watched for the attributes the program set on it (a parameter's main_grad, the
            # gradient an optimizer reads from it), never walked into.
            mine = (QUIET if watch is QUIET else True) if tensor or not module.startswith(_INFRA) else False
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
    return repr(key) if isinstance(key, _ATOMS) else f"<{type(key).__name__}>"


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


def _found(nodes: list, root) -> list:
    """Each node's object now (``_MISSING`` where the way to it is gone), parents first, from ``root``
    (what ``watched`` was given, or its equal now)."""
    out = []
    for parent, step, _, _ in nodes:
        if parent is None:
            obj = root if step is _ROOT else _get(*step) if isinstance(step, _Global) \
                else step() if isinstance(step, weakref.ref) else step
            obj = _MISSING if obj is None else obj
        elif (obj := out[parent]) is _MISSING:
            pass
        elif step is _SELF or step is _FUNC:
            obj = getattr(obj, step, _MISSING)
        elif isinstance(step, _Cell):
            cells = getattr(obj, "__closure__", None) or ()
            obj = cells[step].cell_contents if step < len(cells) and _filled(cells[step]) else _MISSING
        elif isinstance(step, _Default):
            defaults = getattr(obj, "__defaults__", None) or ()
            obj = defaults[step] if step < len(defaults) else _MISSING
        elif isinstance(step, _Part):
            parts = _parts(obj) if isinstance(obj, functools.partial) else ()
            obj = parts[step] if step < len(parts) else _MISSING
        elif isinstance(step, _Attr):
            attrs = getattr(obj, "__dict__", None)
            obj = _get(attrs, step) if isinstance(attrs, dict) else attrs.get(step, _MISSING) \
                if isinstance(obj, type) else _MISSING
        elif isinstance(obj, dict):
            obj = _get(obj, step)
        elif isinstance(obj, (list, tuple)) and isinstance(step, int) and step < len(obj):
            obj = obj[step]
        else:
            obj = _MISSING
        out.append(obj)
    return out


def reached(containers: list, root) -> list:
    """The watched objects and containers of ``watched``, found again now from ``root``."""
    return [c for c, (_, _, _, watch) in zip(_found(containers, root), containers)
            if watch is True and c is not _MISSING]


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


def keep(containers: list, root) -> list:
    """``(container, name, a copy of its contents, the live contents)`` for each of ``watched``'s
    containers, found again by its path from ``root`` (the live contents: the container, or an
    object's ``__dict__``); held only until the step's comparison ends."""
    out, seen, told = Kept(), set(), set()
    for c, (_, _, label, watch) in zip(_found(containers, root), containers):
        if watch is True:
            told.add(id(c))
        if not watch or c is _MISSING or id(c) in seen:
            continue
        live = c if isinstance(c, (dict, list, set)) else getattr(c, "__dict__", None)
        if isinstance(live, (dict, list, set)):
            seen.add(id(c))
            out.append((c, label, _copy(live), live))
    out.quiet = seen - told
    return out


class Kept(list):
    """``keep``'s entries, with the ids of the containers watched only ``QUIET``ly."""

    quiet: set = frozenset()


def told(changed: list, kept: Kept) -> list:
    """The changes (``differ``'s entries) to report: not those of containers watched quietly."""
    return [entry for entry in changed if id(entry[0]) not in kept.quiet]


def differ(kept: list) -> list:
    """The kept entries whose container's contents are no longer those kept (compared by identity:
    a value rebound, a key added or taken away)."""
    return [entry for entry in kept if not _same(entry[3], entry[2])]


def put_back(kept: list) -> None:
    """Give every kept container the contents it had when kept, where they differ: values rebound
    and keys taken away are put back, lists and sets restored whole. Keys and attributes added
    stay: a dict an eager run filled is a cache (quantized weights kept for later microbatches),
    and an eager program runs from its second step on with that cache filled."""
    for _, _, was, now in differ(kept):     # (the base type's methods: a subclass may redefine ``update``)
        if isinstance(now, list):
            list.__setitem__(now, slice(None), was)
        elif isinstance(now, set):
            set.clear(now)
            set.update(now, was)
        else:
            dict.update(now, [(k, v) for k, v in was.items() if _get(now, k) is not v])


def what_changed(entry) -> str:
    """In words, how a container's contents differ from those kept (``differ``'s entry)."""
    c, label, was, now = entry
    if isinstance(now, dict):
        owner = label if isinstance(c, dict) else type(c).__name__
        gone = [k for k in was if not dict.__contains__(now, k)]
        added = [k for k in dict.__iter__(now) if k not in was]
        rebound = [k for k in was if dict.__contains__(now, k) and _get(now, k) is not was[k]]
        for verb, keys in (("removes", gone), ("adds", added), ("rebinds", rebound)):
            if keys:
                where = f"{owner}.{keys[0]}" if not isinstance(c, dict) else f"{owner}[{keys[0]!r}]"
                more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
                return f"{verb} {where}{more}" + (f" ({short(was[keys[0]])} -> {short(_get(now, keys[0]))})"
                                                  if verb == "rebinds" else "")
    return f"changes {label} ({len(was)} -> {len(now)} item(s))"


def rebinds_number(entry) -> bool:
    """Whether the change (``differ``'s entry) binds a key or attribute that held a plain number to
    another number: a cursor or counter Python advances each step."""
    return any(type(old) in (int, float) and type(new) in (int, float) for *_, old, new in _rebinds([entry]))


def short(value) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"a tensor {tuple(value.shape)}"
    return text if len(text) <= 40 else text[:37] + "..."


_MISSING = object()


def _copy(live):
    """A container's contents as a plain container: a subclass's own ``copy`` or item access may
    run code (a registry whose ``__getitem__`` builds an object)."""
    if type(live) in (dict, list, set):
        return live.copy()
    return dict(dict.items(live)) if isinstance(live, dict) else list.copy(live) if isinstance(live, list) else \
        set(set.__iter__(live))


def _get(d: dict, key, default=_MISSING):
    """``d[key]`` as stored, without a subclass's ``__getitem__``/``get``."""
    return dict.get(d, key, default)


def _same(now, was) -> bool:
    """Identity of contents, in C where it can be (``map(is_, ...)``): this runs over every watched
    container once or twice per compared replay."""
    if len(now) != len(was):
        return False
    if isinstance(now, dict):
        if all(map(is_, dict.values(now), was.values())) and all(map(is_, dict.__iter__(now), was)):
            return True                     # (the common case: nothing moved, in the same order)
        return dict.keys(now) == was.keys() and all(_get(now, k) is v for k, v in was.items())
    if isinstance(now, list):
        return all(map(is_, now, was))
    return {id(v) for v in now} == {id(v) for v in was}


def _rebinds(entries: list):
    """``(container, label, key, old, new)`` for every key or attribute of a dict or an object, among
    ``differ``'s entries, bound to another object than it was. Keys added or removed (a cache
    filled) are not rebinds."""
    for c, label, was, now in entries:
        if isinstance(now, dict):
            for key, old in was.items():
                if (new := _get(now, key, old)) is not old:
                    yield c, label, key, old, new


def changes(entries: list, made: set | None) -> list[tuple]:
    """``(container, key, old, new)`` for every binding of a tensor that now holds another tensor,
    one the eager step made (``made``: its new storages; None when they are not known, and then any
    other tensor), with other values: a binding the replay left on the graph's own output, which
    every replay writes, shows a reader this step's values as the eager step's new tensor does."""
    return [(c, key, old, new) for c, _, key, old, new in _rebinds(entries)
            if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
            and (made is None or storage_key(new) in made) and not _same_values(old, new)]


def _same_values(old: torch.Tensor, new: torch.Tensor) -> bool:
    if old.shape != new.shape or old.dtype != new.dtype:
        return False
    with _disable_current_modes():
        return not bool(disagrees(old, new).any())


def settings(entries: list) -> list[tuple]:
    """``(container, where, old, new)`` for every plain value the eager step set to another value: a
    number, a flag or a string changed, or a binding set where the replay left ``None`` (or cleared
    where it left one). That is host work the graph does not repeat: a replay leaves what capture
    set, and code outside the graph that changed it since (a tracker cleared after each step) is
    never undone. A fresh object bound in place of another (new metadata each step) is the step's
    own bookkeeping; a tensor bound in place of another is ``changes``'; a tensor binding cleared
    (memory let go once used) is neither."""
    return [(c, f"{label}[{key!r}]" if isinstance(c, dict) else f"{label}.{key}", old, new)
            for c, label, key, old, new in _rebinds(entries)
            if not isinstance(old, torch.Tensor) and _set(old, new)]


def _set(old, new) -> bool:
    if old is None or new is None:
        return True
    return _plain(old) and _plain(new) and old != new


def _plain(value) -> bool:
    return isinstance(value, _ATOMS) or isinstance(value, tuple) and all(isinstance(v, _ATOMS) for v in value)


def name(obj, key) -> str:
    owner = type(obj).__name__
    return f"{owner}[{key!r}]" if isinstance(obj, dict) else f"{owner}.{key}"


def tracer(entry) -> tuple:
    """A ``sys.settrace`` function that finds the user's line after which ``entry``'s container
    first differs from its kept contents, and the list it puts that line (and its function's code)
    in (run once, on an eager step whose host work a replay does not repeat)."""
    _, _, was, now = entry
    found, last = [], {}

    def trace(frame, event, arg):
        if found:
            return None
        if not _same(now, was):
            # Seen at a line: the frame's previous line changed it; at a call: the caller's line; at
            # a return: the line the frame returns from.
            if event == "call":
                at, line = frame.f_back, None
            else:
                at, line = frame, last.get(frame) if event == "line" else None
            while at is not None and not mine(at):
                at, line = at.f_back, None
            found.append((location(at, line), at.f_code) if at is not None else ("-", None))
            return None
        if event == "line":
            last[frame] = frame.f_lineno
        return trace
    return trace, found


def cells(eager) -> tuple:
    """What the eager form's closure cells hold (by identity): a cell rebound since the last compared
    replay makes it another function than the one last watched."""
    out = []
    for cell in getattr(eager, "__closure__", None) or ():
        try:
            out.append(id(cell.cell_contents))
        except ValueError:               # an empty cell
            out.append(None)
    return tuple(out)
