"""A launch-trace record, shared by the capture's trace (intake) and the eager step's (probes)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of a launch trace: name, user source line, storages read and written, the storages
    read that the run did not create itself (``ext``), and its Python-decided arguments."""

    name: str
    source: str
    reads: frozenset = frozenset()
    writes: frozenset = frozenset()
    ext: frozenset = frozenset()
    sig: tuple = ()
