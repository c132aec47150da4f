"""Lines the run without graphs ran and the served run never did: a branch only the capture decided.

A capture runs the step's Python once, and its replays repeat what that run decided: a branch the
capture did not take (``if return_logprob:``) is never taken by a replay, whatever a later step
asks, and a runner that knows it may refuse such steps outright. Where the served run fails, or
its results differ from the workload's run without graphs (``probes/reference.py``), and no other
finding explains it, this compares the two runs line by line: in the functions some capture ran,
a line the reference run ran -- up to the step at which the served run stopped -- and the served
run never ran (in a capture, a warmup, or its own eager code) is where the two runs parted. The
first such line, in the reference's order, is reported as ``warmup-divergence``: at the check that
chose to replay the graph (``raised.decider``: a reuse test answering True, a cache key), where one
did, for the replays repeat the capture's path because it could not tell the paths apart; else at
that line. (A line a warmup ran
is no parting: the lazy set-up the reference does in its first step, the served run does in its
warmup. Whether the capture then skipped it is ``rules/warmup.py``'s question.)

The other way round, when nothing else explains results that differ (``installed``, asked last): a
closure a capture ran, which the run without graphs never called, running in the served run's own
eager code is set-up the graphs left on the eager path (a wrapper bound over a module's forward
for the capture), named where it is defined.

Lines are seen by ``raised``'s tracer (under ``diagnose``): every line of the workload's code
while the reference is recorded and while a warmup runs, and after it the lines of the functions
some capture ran, outside the doctor's own runs.
"""
from __future__ import annotations

import linecache

from ...engine.source import function_name, location, short_path
from .. import explain
from ..report import Finding


class Coverage:
    """The reference run's lines, with the call number at which each first ran, and the served
    run's lines in the functions its captures ran."""

    def __init__(self) -> None:
        self.first: dict[tuple, int] = {}      # (code, line) -> the reference's call number when first run
        self.codes: set = set()                # functions a capture ran lines of
        self.served: set = set()               # (code, line) the served run ran eagerly, in those functions
        self.warm: set = set()                 # (code, line) its warmups ran (before the captures are known)
        self.chosen: dict = {}                 # graph name -> the check whose answer chose to replay it, first seen
        self.raised: set = set()               # (code, line) an exception passed in the reference run

    def wanted(self, doctor, code, recording: bool) -> bool:
        """Whether a call of ``code`` reports its lines."""
        return recording or doctor.phase == "warmup" or code in self.codes

    def line(self, doctor, code, line: int, number: int, recording: bool) -> None:
        if recording:
            self.first.setdefault((code, line), number)
        elif doctor.phase == "warmup":
            self.warm.add((code, line))
        elif doctor.phase == "eager" and code in self.codes:
            self.served.add((code, line))

    def captured(self, info) -> None:
        self.codes.update(code for code, _ in info.lines_run)

    def parted(self, doctor, reference, failed: bool) -> None:
        """Report where the served run first left the reference's lines (see the module's docstring)."""
        graphs = [info for info in doctor.graphs.values() if info.lines_run]
        ran = self.served.union(self.warm, *(info.lines_run for info in graphs))
        limit = _progress(reference, graphs, failed)
        # (a function the failure was raised under was cut short there: lines it did not reach are no path)
        left = {(code, line): n for (code, line), n in self.first.items()
                if n < limit and code in self.codes and (code, line) not in ran
                and not (failed and code in doctor.failed_codes)}
        if not left:
            return
        _, code, line = min((n, code, line) for (code, line), n in left.items())
        lines = sorted(ln for c, ln in left if c is code)
        names = [info.name for info in graphs if any(c is code for c, _ in info.lines_run)]
        where, function = location(code, line), function_name(code)
        outcome = "the served run failed" if failed else "the served run's results differ from that run's"
        evidence = (f"{outcome}; the run without graphs ran {len(lines)} line(s) of {function} (lines "
                    f"{', '.join(map(str, lines[:6]))}{', ...' if len(lines) > 6 else ''}) that the served run "
                    f"never ran, while {', '.join(names)} captured {function} on another path")
        if (check := next((self.chosen[n] for n in names if n in self.chosen), None)) is not None:
            # A check chose to replay the graph (a graph-reuse test, a cache key) and answered alike for
            # both paths: what it leaves out is what the replays needed to tell them apart.
            evidence += f"; the check at {check} chose to replay it, whatever path the step needed"
            where = check
        doctor.add(Finding("warmup-divergence", ", ".join(names), "-", "-", where, evidence,
                           explain.capture_path(function, names[0]), {"lines": len(lines)}),
                   ("warmup-divergence", "coverage", where))

    def installed(self, doctor) -> None:
        """The other way round: a closure a capture ran, which the run without graphs never called,
        runs in the served run's own eager code. Graph set-up left it on the eager path (a wrapper
        bound over a module's forward for the capture, a hook): the eager steps go on with what was
        decided for the capture. Named where it is defined: its enclosing function installed it."""
        ran = {code for code, _ in self.first}
        extra = [(code, line) for code, line in self.served if code not in ran and _enclosing(code)]
        if not extra:
            return
        code = min(extra, key=lambda cl: (cl[0].co_firstlineno, cl[1]))[0]
        graphs = [info for info in doctor.graphs.values() if info.lines_run]
        names = [info.name for info in graphs if any(c is code for c, _ in info.lines_run)]
        where = _defined(code)
        evidence = (f"the served run's results differ from that run's; {function_name(code)}, which "
                    f"{', '.join(names)} captured, runs in the served run's eager code too, and the run without "
                    "graphs never calls it: the graph set-up left it on the eager path")
        doctor.add(Finding("warmup-divergence", ", ".join(names), "-", "-", where, evidence,
                           explain.left_installed(function_name(code), names[0]), {}),
                   ("warmup-divergence", "installed", where))


def _enclosing(code) -> str | None:
    """The name of the function ``code``'s function is defined in (a closure's), else None."""
    parts = code.co_qualname.split(".")
    return parts[-3] if len(parts) >= 3 and parts[-2] == "<locals>" else None


def _defined(code) -> str:
    """Where a nested function is defined: its ``def`` line, in the function that encloses it."""
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return f"{short_path(code.co_filename)}:{code.co_firstlineno} in {_enclosing(code)}: {line}"


def _progress(reference, graphs, failed: bool) -> float:
    """The reference's call number at which the step after the served run's last began (the
    served run reached that step if it failed in it): lines first run later are not compared."""
    limit = -1.0
    for info in graphs:
        root = reference.root(info)
        if root is None:
            return float("inf")
        calls = reference.calls.get(root[0], [])
        reached = reference.served.get(root[0], 0) + reference.replayed.get(root[0], 0) + failed
        limit = max(limit, calls[reached] if reached < len(calls) else float("inf"))
    return limit if limit >= 0 else float("inf")

