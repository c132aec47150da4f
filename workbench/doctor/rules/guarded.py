"""host-work-frozen, from a capture the workload's own guard refused.

Code whose host work a replay would not repeat often refuses to run inside a capture: torch's
generator refuses to read or set its host seed ("Cannot call CUDAGeneratorImpl::current_seed
during CUDA graph capture"), a library asks ``is_current_stream_capturing()`` and raises. The
capture then fails and the graph is never made: the report's headline says the workload failed,
and without this rule no finding would say why. Such a refusal names host work that would have run
once, at capture: the function it guards is the site.

A refusal is an error raised inside a capture (not the engine's own refusal of a host sync:
``sync.py``) that either says so (its text speaks of capturing) or was raised by a function that
itself asks whether a capture is running (an error of a misused value there, an attribute of
``None``, is no refusal). A function named for the check (``_assert_not_capturing``,
``check_not_capturing``) is the guard, not the work: the finding names its caller.
"""
from __future__ import annotations

import re

from ...engine.source import location
from ..report import Finding
from . import checks

SAYS_CAPTURE = re.compile(r"captur", re.IGNORECASE)


def refused(doctor, graph: str, frames: list, error: BaseException) -> bool:
    """``frames``: the user's frames of the error's traceback, innermost first, with their lines."""
    if not frames or any(graph in f.graph.split(", ") for f in doctor.report.findings):
        return False                # nothing of the user's raised it, or a finding already explains the capture
    frame = frames[0][0]
    if not (SAYS_CAPTURE.search(str(error)) or _asks(frame.f_code) and not isinstance(error, checks.MISUSE)):
        return False
    guard = len(frames) > 1 and SAYS_CAPTURE.search(frame.f_code.co_name) is not None
    site = location(*frames[1]) if guard else location(*frames[0])
    text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    evidence = (f"the capture of {graph} was refused by the workload's own check, at {location(*frames[0])}: "
                f"{text}" + (f"; the check guards the host work at {site}" if guard else ""))
    cause = (f"Host work at {site} is refused inside a capture: a replay repeats only the captured kernels, so work "
             "the host does there (reading or setting host state, a decision) would run once, at capture, and its "
             "result stay frozen in the graph.")
    doctor.add(Finding("host-work-frozen", graph, "-", "-", site, evidence, cause), ("refused-capture", site))
    return True


def _asks(code) -> bool:
    """Whether a function's own code names a capture query (``is_current_stream_capturing``, ``capturing``)."""
    return any(SAYS_CAPTURE.search(name) for name in code.co_names)
