"""undersized-buffer: a warmup or capture run on an empty batch, which then fails.

A runner warms up and captures one graph per batch size, cutting each batch's rows from its static
input buffers (``input_ids[:bs]``). A size list that reaches 0 (a ``max_bs - 1`` at a maximum of
1, a token count divided by the batch and rounded down) makes it warm up and capture for no data:
every announced static input it cuts is cut to no rows. Code sized by the batch then fails -- a
kernel refuses an empty launch grid (CUDA: "invalid configuration argument"), a table of captured
sizes has no entry for 0 -- and the error names the kernel, not the size. Where a warmup or a
capture fails and every announced static input it cut rows from (along the first dimension) was
cut to no rows, the failure is the empty capture batch: ``undersized-buffer`` (a zero-sized capture
input) at the line that cut the first of them, the error's explanation, reported once the error
proves a failure (``failures.explained``: the workload did not survive it, or a harness caught it;
under ``diagnose``, whose tracer sees errors as they are raised).

A capture for no data that fails nothing is no finding here: an expert no token was routed to is
captured empty on purpose (``undersized.announced`` holds those until a step with rows is served).
"""
from __future__ import annotations

from ...engine.source import user_frame
from .. import explain, failures
from ..report import Finding
from ..tensors import first_line


class EmptyBatch:
    """The row cuts of announced static inputs in the current warmup or capture."""

    def __init__(self) -> None:
        self.run = -1                       # which warmup or capture the cuts below belong to
        self.empty: dict[str, tuple] = {}   # input name -> (its shape, where it was cut to no rows)
        self.rows = False                   # some cut of this run had rows

    def sliced(self, doctor, buf, t, args) -> None:
        """``aten.slice`` of an announced buffer's tensor ``t`` (``args``: dim, start, end)."""
        if doctor.phase not in ("warmup", "capture") or buf.role != "input":
            return
        dim, start, end = (list(args[1:4]) + [0, None, None][len(args) - 1:])[:3]
        if dim != 0 or not t.dim():
            return
        run = doctor.report.warmups + doctor.report.captures
        if run != self.run:
            self.run, self.empty, self.rows = run, {}, False
        length = t.shape[0]
        start, end = _bound(start or 0, length), _bound(length if end is None else end, length)
        if end > start:
            self.rows = True
        else:
            self.empty.setdefault(buf.name, ((0, *t.shape[1:]), user_frame()))

    def raised(self, doctor, error: BaseException) -> None:
        """An error in a warmup or capture: explained where every input it cut was cut to no rows
        (a rule that explains the error itself, raised further in, keeps its explanation)."""
        if doctor.phase not in ("warmup", "capture") or not self.empty or self.rows \
                or self.run != doctor.report.warmups + doctor.report.captures or failures.pending(doctor, error):
            return
        text = f"{type(error).__name__}: {first_line(error)}"
        (name, (shape, source)), cuts = next(iter(self.empty.items())), ", ".join(f"`{n}`" for n in self.empty)
        graph = doctor.capturing.name if doctor.phase == "capture" and doctor.capturing is not None else "a warmup"
        evidence = (f"the {doctor.phase} failed ({text}); every announced static input it took rows of ({cuts}) "
                    f"was cut to no rows: the capture batch is empty, the first cut at {source}")
        finding = Finding("undersized-buffer", graph, "aten.slice", f"{name}: {list(shape)}", source, evidence,
                          explain.zero_sized(name, shape), {"shape": list(shape), "empty_inputs": list(self.empty)})
        doctor.explanation = (id(error), finding, ("undersized-buffer", graph, name))


def _bound(i: int, length: int) -> int:
    """A slice bound as Python clamps it."""
    return max(0, min(length, i + length if i < 0 else i))
