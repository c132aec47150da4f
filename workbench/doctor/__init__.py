"""The graph doctor: find CUDA-graph hazards automatically and explain their root cause.

``watch()`` observes every capture, warmup and replay the engine and the runners perform inside it,
and yields a ``Report``; ``diagnose()`` exercises a workload or a runner under it, with active
probes of the padded rows and differential replay. Setting ``WORKBENCH_DOCTOR`` watches a whole
script or notebook without changing it: ``1`` prints the report to stderr at exit, any other value
is a file to write it to; ``workbench.doctor.current()`` is the report so far. ``pytest
--graph-doctor`` (``workbench.doctor.plugin``) fails each test whose graphs have a finding.

Layout: ``intake`` (events and ops in), ``capture`` (what a capture records), ``rules/`` (one
module per kind), ``probes/`` (mutation, padding, differential replay, launch traces, padded rows'
writes, the unpadded step), ``report`` (findings and reports), ``session`` (``watch``),
``diagnose``, with ``raised`` and ``composite`` (errors as the workload raises them, caught or not),
``plugin``.
"""
from __future__ import annotations

import atexit
import os
import pathlib
import sys

from .diagnose import diagnose, exercise
from .rules.dangling import DanglingReferenceError
from .report import FIX_PATTERNS, KINDS, Finding, Report
from .rules.padding import compare_runs
from .session import watch

__all__ = ["FIX_PATTERNS", "KINDS", "DanglingReferenceError", "Finding", "Report", "compare_runs", "current",
           "diagnose", "exercise", "watch"]

_session: tuple | None = None     # (context manager, report) of the environment-variable switch


def current() -> Report | None:
    """The report of the ``WORKBENCH_DOCTOR`` watch (None when the variable is not set)."""
    return None if _session is None else _session[1]


def start_from_environment() -> None:
    """Called on ``import workbench`` when ``WORKBENCH_DOCTOR`` is set (and not ``0``)."""
    global _session
    target = os.environ.get("WORKBENCH_DOCTOR", "")
    if _session is not None or target in ("", "0"):
        return
    context = watch()
    _session = (context, context.__enter__())
    atexit.register(_finish, target)


def _finish(target: str) -> None:
    context, report = _session
    context.__exit__(None, None, None)
    if target == "1":
        print(report, file=sys.stderr)
    else:
        pathlib.Path(target).write_text(str(report) + "\n")
