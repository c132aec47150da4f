"""What the doctor reports: findings of a fixed set of kinds, each with evidence and a root cause.

Every tool that guards CUDA graphs today reports a *symptom* (an address, a kernel, a mismatch).
A finding here names the op and the user's source line, the tensor, the numbers that prove it, why
it happens and the pattern that fixes it. A report also says what it could *not* check, so that an
empty list of findings never passes for a clean bill of health it did not earn.
"""
from __future__ import annotations

import dataclasses
import html
import re

KINDS = (
    "persistent-mutation",   # the graph writes a static input buffer it does not own
    "stale-padding",         # real rows depend on what padded rows hold
    "stale-input",           # real rows depend on elements of a static input the step did not write: what
                             # an earlier step left there (an omitted input, a skipped refresh)
    "dangling-reference",    # the graph reads memory whose owner has released it
    "warmup-divergence",     # warmup or capture decided something (lazy init, a plan, a branch, a tensor
                             # reference) that replays reuse while an eager step now decides otherwise
    "undersized-buffer",     # a zero-sized capture input, data that does not fit a static buffer, or a
                             # replay asked to serve more rows or columns than were captured
    "overwritten-output",    # an output is read after a replay (of any graph) overwrote its memory
    "sync-in-capture",       # a host synchronisation attempted during capture
    "host-work-frozen",      # host work inside the captured region (a Python scalar, a host reduction, an
                             # attribute assignment) ran once at capture; replays repeat only the kernels,
                             # so its result stays at its capture-time value
    "padded-shape-mismatch", # code run at a graph's padded size combines tensors sized for the padded rows
                             # with tensors sized for the real rows
)

# The kinds that are about padded rows alone: a replay that serves no padded rows cannot be explained by them.
PADDED_ROWS = ("stale-padding", "padded-shape-mismatch")

FIX_PATTERNS = {
    "persistent-mutation": "Do not update a static input in place, inside the captured region or in the eager "
                           "code around it: use an out-of-place op (`y = x + c`) or a buffer the graph owns; if "
                           "the write is intended, refresh every row the graph reads before each replay.",
    "stale-padding": "Neutralise padded rows before anything reads them: give every per-row field of rows "
                     "[real, padded) -- metadata included -- a null value (zero, a null slot), and make code "
                     "that derives batch-level decisions ignore rows >= the real count.",
    "stale-input": "Write every element of a static input the graph reads before each replay: when a step brings "
                   "no such input, fill the buffer with the value the eager path assumes (a zero delta, a null "
                   "slot) instead of leaving the last step's; announce memory carried across steps on purpose as "
                   "persistent state.",
    "dangling-reference": "Keep a reference for as long as the graph lives (cache the tensor on its module and "
                          "re-capture when it is reloaded), or create it inside the capture so the graph's pool "
                          "owns it.",
    "warmup-divergence": "Capture with fresh state: build the state/metadata object again for the capture so "
                         "its lazy work runs -- and is recorded -- inside the graph; or do that work "
                         "unconditionally on every step. Decisions Python makes per step (a plan, a branch, a "
                         "feature flag, which tensor to read) must be inputs in static buffers, a key of the "
                         "graph, or a reason to re-capture.",
    "undersized-buffer": "Validate the sizes before capturing: every capture input needs >= 1 element per item "
                         "(e.g. max_batch_size <= min(token budgets)), size buffers with ceil division, and "
                         "reject or fall back to eager for batches larger than a buffer.",
    "overwritten-output": "Copy (`.clone()`) graph outputs that must outlive the next replay, or finish using "
                          "them before replaying the graph again (or any graph that writes the same buffer).",
    "host-work-frozen": "Compute per-step values on the device inside the captured region (a reduction, a "
                        "tensor op instead of Python arithmetic), or pass them in a static buffer the runner "
                        "refreshes before each replay; keep state the graph produces in a persistent buffer "
                        "written in place (`self.x.copy_(y)`), never in a Python attribute rebound per step.",
    "padded-shape-mismatch": "Slice graph outputs to the real rows (`out[:num_real]`) before combining them with "
                             "per-request tensors, or give every per-row tensor the padded size with neutral "
                             "padded rows; check the two counts agree where they meet.",
    "sync-in-capture": "Move the host read (`.item()`, `.cpu()`, `nonzero`, printing) before or after the "
                       "captured region, or keep the value on the device (`torch.where`, fixed shapes).",
}


@dataclasses.dataclass
class Finding:
    """One hazard: where (graph, op, tensor, source line), the evidence, the cause and the fix."""

    kind: str
    graph: str
    op: str
    tensor: str
    source: str
    evidence: str
    cause: str
    numbers: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}; kinds are {KINDS}")

    @property
    def fix(self) -> str:
        return FIX_PATTERNS[self.kind]

    @property
    def location(self) -> str:
        """``file:line in function`` (without the code)."""
        return self.source.split(": ", 1)[0]

    def text(self) -> str:
        rows = [("graph", self.graph), ("op", self.op), ("tensor", self.tensor), ("at", self.source),
                ("evidence", self.evidence), ("cause", self.cause), ("fix", self.fix)]
        return "\n".join(f"    {k:<9}{v}" for k, v in rows)


@dataclasses.dataclass
class Report:
    """What a ``watch()`` saw: counts, findings, the kinds it could not check (and why), the
    mechanisms it did not run (``skipped``, e.g. differential replay without an eager step), what
    the watched code raised, and the doctor's own error if it had to stop early (``failure``)."""

    findings: list[Finding] = dataclasses.field(default_factory=list)
    captures: int = 0
    replays: int = 0
    warmups: int = 0
    not_checked: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)
    caught: list[str] = dataclasses.field(default_factory=list)    # op failures the watched code caught
    notes: list[str] = dataclasses.field(default_factory=list)
    # replays whose real rows differ from the workload's run without graphs (``events.reference()``) in
    # graphs no finding names, and the workload's own results where they differ and nothing was found
    # (``events.results``): something is wrong that the doctor could not place
    unexplained: list[str] = dataclasses.field(default_factory=list)
    failure: str | None = None
    seconds: float = 0.0

    def note(self, text: str) -> None:
        """A note, once: sampled replays of one graph see the same thing again."""
        if text not in self.notes:
            self.notes.append(text)

    @property
    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    @property
    def checked(self) -> list[str]:
        return [k for k in KINDS if k not in self.not_checked]

    @property
    def clean(self) -> bool:
        """No finding, the workload ran to its end and the doctor watched all of it."""
        return (not self.findings and not self.errors and not self.caught and self.failure is None
                and not self.unexplained and self.captures > 0)

    def of(self, kind: str) -> list[Finding]:
        if kind not in KINDS:
            raise ValueError(f"unknown finding kind {kind!r}; kinds are {KINDS}")
        return [f for f in self.findings if f.kind == kind]

    def headline(self) -> str:
        n = len(self.findings)
        if self.errors:
            line = (f"Graph doctor: the workload failed: {self.errors[0]} -- {n} finding{'s' if n != 1 else ''} "
                    f"in what ran before ({self.captures} capture(s), {self.replays} replay(s)).")
        elif self.captures == 0 and not self.findings and self.failure is None and not self.caught:
            return "Graph doctor: nothing was captured inside watch(), so nothing could be checked."
        else:
            line = (f"Graph doctor: {self.captures} capture(s), {self.warmups} warmup run(s), {self.replays} "
                    f"replay(s) watched: {n} finding{'s' if n != 1 else ''}.")
        if self.unexplained:
            line += (f" {len(self.unexplained)} result(s) differ from the workload's run without graphs, and no "
                     "finding explains them: see below.")
        if self.caught and not self.errors:
            line += f" An error was raised inside the workload and caught: {self.caught[0]}"
        if self.failure is not None:
            line += f" The doctor stopped early on an error of its own; what came after was not checked: {self.failure}"
        return line

    def __repr__(self) -> str:
        return f"<Report: {self.headline()}>"

    def __str__(self) -> str:
        lines = [self.headline()]
        for i, f in enumerate(self.findings, 1):
            lines += [f"[{i}] {f.kind}", f.text()]
        lines += [f"not checked: {k} ({why})" for k, why in self.not_checked.items()]
        lines += [f"not checked: {k} ({why})" for k, why in self.skipped.items()]
        lines += [f"the watched code raised: {e}" for e in self.errors]
        lines += [f"the watched code raised and caught: {e}" for e in self.caught]
        lines += [f"differs from the run without graphs: {u}" for u in self.unexplained]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """A table that fits a 900 px output area (four columns that wrap, code set as code)."""
        cell = "text-align:left;vertical-align:top;padding:3px 6px;overflow-wrap:anywhere"
        head = "".join(f"<th style='{cell};width:{w}'>{c}</th>" for c, w in
                       (("finding", "16%"), ("where", "26%"), ("what was seen, and why", "34%"), ("fix", "24%")))
        body = "".join(
            "<tr>" + "".join(f"<td style='{cell}'>{v}</td>" for v in (
                f"<b>{_e(f.kind)}</b><br>{_e(f.graph)}",
                f"<code>{_e(f.op)}</code><br><code>{_e(f.tensor)}</code><br><code>{_e(f.source)}</code>",
                f"{_code(f.evidence)}<br><br>{_code(f.cause)}", _code(f.fix))) + "</tr>"
            for f in self.findings)
        table = (f"<table style='table-layout:fixed;width:100%;max-width:900px;font-size:12px'>"
                 f"<tr>{head}</tr>{body}</table>" if self.findings else "")
        extra = "".join(f"<li>not checked: <b>{_e(k)}</b> ({_code(w)})</li>"
                        for k, w in (*self.not_checked.items(), *self.skipped.items()))
        extra += "".join(f"<li>the watched code raised: <code>{_e(x)}</code></li>" for x in self.errors)
        extra += "".join(f"<li>the watched code raised and caught: <code>{_e(x)}</code></li>"
                         for x in self.caught)
        extra += "".join(f"<li>differs from the run without graphs: {_code(u)}</li>" for u in self.unexplained)
        extra += "".join(f"<li>{_code(n)}</li>" for n in self.notes)
        return (f"<div style='max-width:900px'><p><b>{_e(self.headline())}</b></p>{table}"
                f"<ul style='font-size:12px'>{extra}</ul></div>")


def _e(text: str) -> str:
    return html.escape(str(text))


def _code(text: str) -> str:
    """Escaped text with `backticked` spans set as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _e(text))
