"""``expect_failure``: assert that a reproduction fails the way the upstream bug did.

A notebook that shows a bug must fail *loudly* if the bug stops reproducing; a bare try/except
would let it pass silently. This context manager raises ``AssertionError`` when nothing, or the
wrong thing, is raised, and keeps the caught exception for the narrative that follows.
"""
from __future__ import annotations

import re


class expect_failure:
    """``with expect_failure(IndexError, match="out of range") as caught: ...``; then ``caught.error``."""

    def __init__(self, *exc_types: type[BaseException], match: str | None = None, quiet: bool = False):
        if not exc_types:
            raise TypeError("expect_failure needs at least one exception type")
        self.exc_types = exc_types
        self.match = match
        self.quiet = quiet
        self.error: BaseException | None = None

    def __enter__(self) -> expect_failure:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        names = " or ".join(t.__name__ for t in self.exc_types)
        if exc is None:
            raise AssertionError(f"expected {names}, but the block completed without error: "
                                 "the failure no longer reproduces")
        if not isinstance(exc, self.exc_types):
            return False
        if self.match is not None and not re.search(self.match, str(exc)):
            raise AssertionError(f"expected {names} matching {self.match!r}, got: {exc}") from exc
        self.error = exc
        if not self.quiet:
            print(f"expected failure reproduced: {type(exc).__name__}: {exc}")
        return True


def label_predicted_crash(bar, request: int, label: str = "") -> None:
    """Close a tqdm bar over requests 1, 2, ... (console or notebook) that an expected crash
    stopped at ``request``, labelled "crashed as predicted at request K" and complete at the K-1
    requests served: a bar cut short ends red, which reads as a failure of the notebook when it
    is the reproduction succeeding. (A bar driven by ``for`` counts lazily, hence ``n`` is set.)
    ``label`` prefixes the description (which stream or variant crashed)."""
    prefix = f"{label}: " if label else ""
    bar.set_description(f"{prefix}crashed as predicted at request {request}", refresh=False)
    bar.leave = True
    bar.n = bar.total = request - 1
    if hasattr(bar, "container"):            # tqdm.notebook: the widget keeps its own maximum
        bar.container.children[1].max = bar.n
    bar.close()
