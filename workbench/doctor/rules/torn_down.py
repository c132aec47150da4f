"""warmup-divergence, from state a reset tore down that a later capture or step needs again.

A runner that resets (a sleep and wake-up, a weight update, a re-capture) clears what its first
captures set up -- a registry of captured tasks, a workspace, a handle -- by binding it to ``None``,
while the code that built it runs once (an ``lru_cache``, a flag) and is not run again. The next
capture or step meets ``None``: ``'NoneType' object has no attribute ...``, an error that names
neither the reset nor the set-up. When a function that an earlier capture ran (with the value set,
since it did not fail then) fails on ``None`` read from a module global or an attribute -- directly,
or from a getter that returns one -- the function of that module that binds the same name to
``None`` tore it down: ``warmup-divergence`` there (an ``__init__`` only initialises it)."""
from __future__ import annotations

import dis
import types

from ...engine.source import location
from ..report import Finding

_NONE = "'NoneType' object has no attribute"


def failed(doctor, error: BaseException, frame) -> None:
    """An error as it is raised in a watched phase (``raised.py``); reported once it proves a
    failure (``failures.explained``)."""
    if not isinstance(error, AttributeError) or not str(error).startswith(_NONE):
        return
    ran = [info for info in doctor.graphs.values() if frame.f_code in info.called and info is not doctor.capturing]
    read = _read(frame) if ran else None
    if read is None:
        return
    site = _teardown(frame.f_globals, *read)
    if site is None:
        return
    what = f"{'the global' if read[0] == 'global' else 'the attribute'} `{read[1]}`"
    graph = doctor.capturing.name if doctor.capturing is not None else ran[-1].name
    finding = Finding(
        "warmup-divergence", graph, "-", read[1], site,
        f"during {doctor.phase}, {location(frame)} failed on {what}, which is None ({error}); {ran[-1].name}'s "
        f"capture ran this function with it set, and {site} binds it to None",
        f"A reset bound {what} to None after {ran[-1].name} was captured; the code that set it up ran once and "
        "did not run again, so the next capture or step finds it gone. Build it again where the reset happens "
        "(clear the cache or flag that guards its set-up), or do not tear down what later captures need.")
    doctor.explanation = (id(error), finding, ("torn-down", read[1], site))


def _read(frame) -> tuple[str, str] | None:
    """``("global" | "attr", name)`` of the value the failing attribute access was made on."""
    code = frame.f_code
    ins = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
    at = max((k for k, i in enumerate(ins) if i.offset <= frame.f_lasti), default=None)
    if at is None or at == 0 or ins[at].opname not in ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR"):
        return None
    before = ins[at - 1]
    if before.opname == "LOAD_GLOBAL":
        return "global", before.argval
    if before.opname == "LOAD_ATTR":
        return "attr", before.argval
    if before.opname != "LOAD_FAST":
        return None
    # a local: bound from a getter's call (``params = get_graph_params()``), the getter returning a global
    stores = [k for k, i in enumerate(ins[:at]) if i.opname == "STORE_FAST" and i.argval == before.argval]
    if not stores or ins[stores[-1] - 1].opname != "CALL":
        return None
    callee = next((i.argval for i in reversed(ins[:stores[-1]]) if i.opname == "LOAD_GLOBAL"), None)
    getter = frame.f_globals.get(callee)
    if not isinstance(getter, types.FunctionType):
        return None
    body = [i for i in dis.get_instructions(getter.__code__) if i.opname not in ("CACHE", "RESUME")]
    if len(body) == 2 and body[1].opname == "RETURN_VALUE" and body[0].opname in ("LOAD_GLOBAL", "LOAD_ATTR"):
        return ("global" if body[0].opname == "LOAD_GLOBAL" else "attr"), body[0].argval
    return None


def _teardown(module: dict, kind: str, name: str) -> str | None:
    """The line of a function of the failing function's module that binds ``name`` to None."""
    here = module.get("__name__")
    codes = []
    for value in list(module.values()):
        if isinstance(value, types.FunctionType) and value.__module__ == here:
            codes.append(value.__code__)
        elif isinstance(value, type) and value.__module__ == here:
            codes += [f.__code__ for k, f in vars(value).items() if isinstance(f, types.FunctionType) and k != "__init__"]
    store = "STORE_GLOBAL" if kind == "global" else "STORE_ATTR"
    for code in codes:
        ins = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
        for k, i in enumerate(ins):
            if i.opname == store and i.argval == name and any(
                    j.opname == "LOAD_CONST" and j.argval is None for j in ins[max(0, k - 2):k]):
                return location(code, i.positions.lineno if i.positions and i.positions.lineno else code.co_firstlineno)
    return None
