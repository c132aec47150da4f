"""warmup-divergence: the program's own check that a step's decision matches its graph's fails.

A runner that captures a graph per mode (a sampling layout, a speculative branch, a backend's
variant) often checks, on the way to a replay, that the step it is about to serve decided the same
way: ``assert ctx.dp_sampling == expected`` where ``expected`` is what the capture of that bucket
decided. When the check fails, the step's decision was made somewhere that never learnt what the
capture decided (an idle step built without the route the busy steps take): its object was made,
or fetched, in a frame of the step that holds it still.

So: after the captures, in eager code, a check of equality between two decisions (booleans,
strings, None, enum members; counts are the shape rules') fails in a function that has asked for
a replay before. One operand is an attribute of an object a caller holds in a local variable:
the outermost of those callers is where the step got that object, and is named. Without such an
operand the rule says nothing (no place to name).
"""
from __future__ import annotations

import ast
import enum

from ...engine.source import function_name, location, user_frames
from .. import explain
from ..report import Finding
from ..tensors import first_line
from . import checks

_DECISIONS = (bool, str, type(None), enum.Enum)


def replayed(doctor, info) -> None:
    """A graph's first replay: the functions that asked for it (the replay path a later check is on)."""
    doctor.replay_paths.update({f.f_code: info.name for f in user_frames()})


def failed_flag_check(doctor, error: BaseException, frame) -> None:
    """The program's own equality check of two decisions failed on a replay path (module docstring).
    Reported once the error proves a failure (``failures.explained``)."""
    if doctor.phase != "eager" or not doctor.graphs or frame.f_code not in doctor.replay_paths:
        return
    test = checks.test_at(frame)
    if not isinstance(test, ast.Compare) or len(test.ops) != 1 or not isinstance(test.ops[0], (ast.Eq, ast.NotEq)):
        return
    operands = (test.left, test.comparators[0])
    values = [checks.read(node, frame) for node in operands]
    if any(v is checks.UNREAD or not isinstance(v, _DECISIONS) for v in values):
        return
    for node, value in zip(operands, values):
        made = _holder(node, frame)
        if made is None:
            continue
        graph = doctor.replay_paths[frame.f_code]
        text = ast.unparse(node)
        finding = Finding(
            "warmup-divergence", graph, "check", f"{text} = {value!r}", location(made),
            f"after the captures, on the way to a replay (this function asked for {graph} before), the program's "
            f"check `{ast.unparse(test)}` failed ({first_line(error) or type(error).__name__}): {text} is "
            f"{value!r}, decided by the step object {function_name(made.f_code)} holds, not as the capture decided",
            explain.decision_mismatch(text, graph), {})
        doctor.explanation = (id(error), finding, ("warmup-divergence", "check", location(made)))
        return


def _holder(node: ast.expr, frame):
    """For ``obj.attr`` (or a longer chain) read from a local ``obj``: the outermost caller of
    ``frame`` among the workload's frames that holds the same object in a local variable."""
    while isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
        node = node.value
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)) \
            or node.value.id not in frame.f_locals or node.value.id == "self":
        return None
    obj = frame.f_locals[node.value.id]
    if isinstance(obj, _DECISIONS + (int, float)):
        return None
    outer = None
    for caller in user_frames(frame.f_back):
        if any(v is obj for v in caller.f_locals.values()):
            outer = caller
    return outer
