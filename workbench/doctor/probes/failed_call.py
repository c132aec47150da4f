"""A served step that failed, against the reference run: a padded count where real counts were passed.

The served run raised an error in a step's eager code (``raised.py`` saw it) that the reference
run, serving the same requests without graphs, did not: the step failed on its way to a replay or
after it, and the error (a boundary check, a broadcast, a lookup) names neither the graph nor the
padding. The reference called the same functions. Each of its calls is recorded with the sizes of
its arguments (``called``): a plain number, a tensor's rows, a list's length -- what counts a batch.
The calls the error leaves in the served run (innermost first) are compared with them, argument by
argument. The first argument whose size

* is one a graph was captured for (a padded count),
* was never passed there by the reference, and
* is larger than a size the reference did pass there (it passed real counts)

is the padded count reaching code written for real ones: ``padded-shape-mismatch`` at that call's
function, where the padded count met what was sized for the real rows (a valid span recorded for
the scheduled tokens, a per-request list). The reference never padded, so a count it never passed
is the served run's padding, not the requests.

Only where no other rule found anything, for an error the workload did not survive (or a harness
caught), raised in eager code after the captures: a warmup's or a capture's dummy sizes are never
the reference's, and prove nothing.
"""
from __future__ import annotations

import torch

from ...engine.source import function_name, location, mine
from .. import explain_padding
from ..report import Finding
from ..rules.shapes import explainable
from ..tensors import first_line

_SIZES = 64          # distinct sizes kept per argument of a function
_ERRORS = 8          # failing call chains kept per watch


class FailedCalls:
    """The sizes the reference passed to each function, and the served run's failing calls."""

    def __init__(self) -> None:
        self.passed: dict = {}                   # code -> {argument -> the sizes the reference passed}
        self.failing: dict[int, tuple] = {}      # id(error) -> (its text, [(code, line, {argument: size})])

    def called(self, frame) -> None:
        """A call of the workload's code in the reference run."""
        passed = self.passed.setdefault(frame.f_code, {})
        for name, size in _arguments(frame):
            seen = passed.setdefault(name, set())
            if len(seen) < _SIZES:
                seen.add(size)

    def raised(self, doctor, frame, error: BaseException) -> None:
        """An error raised in the served run: the calls it leaves, with their arguments' sizes."""
        if doctor.phase != "eager" or doctor.dummy_run or not doctor.graphs or not explainable(error) \
                or len(self.failing) >= _ERRORS:
            return
        chain = []
        while frame is not None:
            if frame.f_code in self.passed and mine(frame):
                chain.append((frame.f_code, frame.f_lineno, dict(_arguments(frame))))
            frame = frame.f_back
        self.failing[id(error)] = (f"{type(error).__name__}: {first_line(error)}", chain)

    def report(self, doctor) -> None:
        """The finding for the first failing call given a padded count the reference never passed (where
        no other rule found anything)."""
        failures = [] if doctor.report.findings else [*doctor.failed_ops.values(), *doctor.report.errors]
        for text, chain in self.failing.values():
            if not any(f.startswith(text) for f in failures):
                continue                          # (the workload caught it and went on: no failure)
            for code, line, arguments in chain:
                for name, size in arguments.items():
                    passed = self.passed[code].get(name)
                    graphs = [info.name for info in doctor.graphs.values() if size in info.rows]
                    if graphs and passed and size not in passed and min(passed) < size:
                        _report(doctor, text, code, line, name, size, sorted(passed), graphs)
                        return


def _arguments(frame):
    """``(name, size)`` of a call's arguments that count something: a plain number, a tensor's rows,
    a list's length (not ``self``; not a tuple, which is more often a shape than a batch)."""
    code = frame.f_code
    values = frame.f_locals
    for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        value = values.get(name)
        if type(value) is int:
            yield name, value
        elif isinstance(value, torch.Tensor) and value.dim():
            yield name, value.shape[0]
        elif type(value) is list:
            yield name, len(value)


def _report(doctor, text: str, code, line: int, name: str, size: int, passed: list, graphs: list) -> None:
    function = function_name(code)
    shown = ", ".join(map(str, passed[:8])) + (", ..." if len(passed) > 8 else "")
    captures = ", ".join(f"`{g}`" for g in graphs)
    evidence = (f"the served run failed ({text}) in {function}, called with `{name}` of size {size}, the rows of "
                f"the static inputs the capture{'s' if len(graphs) > 1 else ''} of {captures} read; the run without "
                f"graphs called {function} with `{name}` of size {shown}, never {size}")
    doctor.add(Finding("padded-shape-mismatch", ", ".join(graphs), text.split(":", 1)[0], f"`{name}` ({size})",
                       location(code, line), evidence, explain_padding.padded_count(function, name, size),
                       {"size": size, "passed": len(passed)}),
               ("padded-shape-mismatch", location(code, line)))
