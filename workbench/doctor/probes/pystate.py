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
object's attributes, a dict, a list, a set, a deque) are kept before the step (``keep``) and after the
replay, and put back (``put_back``) before and after each eager run: one level each, which covers
nested containers since each of them is kept too. Keys a run adds stay (a cache it filled),
but for one bound to a tensor the step made by a line the capture also ran: that is the step's
own binding, which a replay does not make, and is taken back (``take_back``).

Which containers are kept, and how each is found again, is ``reach.py``'s walk.
"""
from __future__ import annotations

from collections import deque
from operator import is_

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...engine.opinfo import storage_key
from ...engine.source import location, mine
from ..tensors import disagrees
from .reach import ATOMS, MISSING, Watch, found, get


_CONTAINERS = (dict, list, set, deque)


def keep(containers: list, root) -> list:
    """``(container, name, a copy of its contents, the live contents)`` for each of ``watched``'s
    containers, found again by its path from ``root`` (the live contents: the container, or an
    object's ``__dict__``); held only until the step's comparison ends."""
    out, seen, told = Kept(), set(), set()
    for c, (_, _, label, watch) in zip(found(containers, root), containers):
        if watch == Watch.REPORTED:
            told.add(id(c))
        if not watch or c is MISSING or id(c) in seen:
            continue
        live = c if isinstance(c, _CONTAINERS) else getattr(c, "__dict__", None)
        if isinstance(live, _CONTAINERS):
            seen.add(id(c))
            out.append((c, label, _copy(live), live))
    out.quiet = seen - told
    return out


class Kept(list):
    """``keep``'s entries, with the ids of the containers watched only quietly (``Watch.QUIET``)."""

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
        elif isinstance(now, deque):
            deque.clear(now)
            deque.extend(now, was)
        elif isinstance(now, set):
            set.clear(now)
            set.update(now, was)
        else:
            dict.update(now, [(k, v) for k, v in was.items() if get(now, k) is not v])


def what_changed(entry) -> str:
    """In words, how a container's contents differ from those kept (``differ``'s entry)."""
    c, label, was, now = entry
    if isinstance(now, dict):
        owner = label if isinstance(c, dict) else type(c).__name__
        gone = [k for k in was if not dict.__contains__(now, k)]
        added = [k for k in dict.__iter__(now) if k not in was]
        rebound = [k for k in was if dict.__contains__(now, k) and get(now, k) is not was[k]]
        for verb, keys in (("removes", gone), ("adds", added), ("rebinds", rebound)):
            if keys:
                where = f"{owner}.{keys[0]}" if not isinstance(c, dict) else f"{owner}[{keys[0]!r}]"
                more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
                return f"{verb} {where}{more}" + (f" ({short(was[keys[0]])} -> {short(get(now, keys[0]))})"
                                                  if verb == "rebinds" else "")
    return f"changes {label} ({len(was)} -> {len(now)} item(s))"


def grew(entry) -> bool:
    """Whether the change (``differ``'s entry) adds to its container: a key or an item more."""
    _, _, was, now = entry
    if isinstance(now, dict):
        return any(k not in was for k in dict.__iter__(now))
    return len(now) > len(was)


def rebinds_number(entry) -> bool:
    """Whether the change (``differ``'s entry) binds a key or attribute that held a plain number to
    another number: a cursor or counter Python advances each step."""
    return any(type(old) in (int, float) and type(new) in (int, float) for *_, old, new in _rebinds([entry]))


def short(value) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"a tensor {tuple(value.shape)}"
    return text if len(text) <= 40 else text[:37] + "..."



def _copy(live):
    """A container's contents as a plain container: a subclass's own ``copy`` or item access may
    run code (a registry whose ``__getitem__`` builds an object)."""
    if type(live) in (dict, list, set):
        return live.copy()
    return dict(dict.items(live)) if isinstance(live, dict) else list.copy(live) if isinstance(live, list) else \
        list(deque.__iter__(live)) if isinstance(live, deque) else set(set.__iter__(live))


def _same(now, was) -> bool:
    """Identity of contents, in C where it can be (``map(is_, ...)``): this runs over every watched
    container once or twice per compared replay."""
    if len(now) != len(was):
        return False
    if isinstance(now, dict):
        if all(map(is_, dict.values(now), was.values())) and all(map(is_, dict.__iter__(now), was)):
            return True                     # (the common case: nothing moved, in the same order)
        return dict.keys(now) == was.keys() and all(get(now, k) is v for k, v in was.items())
    if isinstance(now, (list, deque)):
        return all(map(is_, now, was))
    return {id(v) for v in now} == {id(v) for v in was}


def _rebinds(entries: list):
    """``(container, label, key, old, new)`` for every key or attribute of a dict or an object, among
    ``differ``'s entries, bound to another object than it was. Keys added or removed (a cache
    filled) are not rebinds."""
    for c, label, was, now in entries:
        if isinstance(now, dict):
            for key, old in was.items():
                if (new := get(now, key, old)) is not old:
                    yield c, label, key, old, new


def changes(entries: list, made: set | None) -> list[tuple]:
    """``(container, key, old, new)`` for every binding of a tensor that now holds another tensor,
    one the eager step made (``made``: its new storages; None when they are not known, and then any
    other tensor), with other values: a binding the replay left on the graph's own output, which
    every replay writes, shows a reader this step's values as the eager step's new tensor does.
    A binding the eager step adds (``old`` is ``MISSING``) to a tensor it made counts too: code
    after the step that took the binding away (a hand-off deleted once read) finds none after a
    replay, where the eager step leaves this step's tensor."""
    rebound = [(c, key, old, new) for c, _, key, old, new in _rebinds(entries)
               if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
               and (made is None or storage_key(new) in made) and not _same_values(old, new)]
    return rebound + [(c, key, MISSING, new) for c, key, new in _added(entries)
                      if isinstance(new, torch.Tensor) and (made is None or storage_key(new) in made)]


def take_back(changed: list) -> None:
    """Take away the bindings an eager run added (``changes``' entries whose old value is ``MISSING``):
    the program goes on as the replay left it, without them (``put_back`` leaves added keys, a cache)."""
    for c, key, _, _ in (entry for entry in changed if entry[2] is MISSING):
        live = c if isinstance(c, dict) else getattr(c, "__dict__", None)
        if isinstance(live, dict):
            dict.pop(live, key, None)


def _added(entries: list):
    """``(container, key, value)`` for every key or attribute of a dict or an object, among
    ``differ``'s entries, that was not there when kept."""
    for c, _, was, now in entries:
        if isinstance(now, dict):
            for key in dict.__iter__(now):
                if key not in was:
                    yield c, key, get(now, key)


def _same_values(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether a binding's new tensor holds its old one's values (on another device it does not: a
    step that moves host metadata onto the GPU, ``info.kv_indices = info.kv_indices.to(device)``,
    rebinds it, and code after the step reads it there)."""
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
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
    return isinstance(value, ATOMS) or isinstance(value, tuple) and all(isinstance(v, ATOMS) for v in value)


def name(obj, key) -> str:
    owner = type(obj).__name__
    return f"{owner}[{key!r}]" if isinstance(obj, dict) else f"{owner}.{key}"


def tracer(entry) -> tuple:
    """A ``sys.settrace`` function that finds the user's line after which ``entry``'s container
    first differs from its contents now, and the list it puts that line (and its function's code)
    in (made just before an eager step whose host work a replay does not repeat runs once more: keys
    an earlier eager run added stay, ``put_back``, and are not this run's change)."""
    now = entry[3]
    was = _copy(now)
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
                at, line = frame, last.get(id(frame)) if event == "line" else None
            while at is not None and not mine(at):
                at, line = at.f_back, None
            found.append((location(at, line), at.f_code) if at is not None else ("-", None))
            return None
        if event == "line":
            last[id(frame)] = frame.f_lineno     # (by id: a frame held here would hold its locals)
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
