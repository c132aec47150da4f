"""What the doctor reports: findings of a fixed set of kinds, each with evidence and a root cause.

Every tool that guards CUDA graphs today reports a *symptom* (an address, a kernel, a mismatch).
A finding here names the op and the user's source line, the tensor, the numbers that prove it, why
it happens and the pattern that fixes it. A report also says what it could *not* check, so that an
empty list of findings never passes for a clean bill of health it did not earn.
"""
from __future__ import annotations

import dataclasses
import html

KINDS = (
    "persistent-mutation",   # the graph writes a static input buffer it does not own
    "stale-padding",         # real rows depend on what padded rows hold
    "dangling-reference",    # the graph reads memory whose owner has released it
    "warmup-divergence",     # warmup ran work (lazy init) that the capture did not record
    "undersized-buffer",     # a zero-sized capture input, or data that does not fit a static buffer
    "overwritten-output",    # an output of replay N is read after replay N+1 overwrote it
    "sync-in-capture",       # a host synchronisation attempted during capture
)

FIX_PATTERNS = {
    "persistent-mutation": "Do not update a static input in place, inside the captured region or in the eager "
                           "code around it: use an out-of-place op (`y = x + c`) or a buffer the graph owns; if "
                           "the write is intended, refresh every row the graph reads before each replay.",
    "stale-padding": "Neutralise padded rows before anything reads them: give every per-row field of rows "
                     "[real, padded) -- metadata included -- a null value (zero, a null slot), and make code "
                     "that derives batch-level decisions ignore rows >= the real count.",
    "dangling-reference": "Keep a reference for as long as the graph lives (cache the tensor on its module and "
                          "re-capture when it is reloaded), or create it inside the capture so the graph's pool "
                          "owns it.",
    "warmup-divergence": "Capture with fresh state: build the state/metadata object again for the capture so "
                         "its lazy work runs -- and is recorded -- inside the graph; or do that work "
                         "unconditionally on every step.",
    "undersized-buffer": "Validate the sizes before capturing: every capture input needs >= 1 element per item "
                         "(e.g. max_batch_size <= min(token budgets)), size buffers with ceil division, and "
                         "reject or fall back to eager for batches larger than a buffer.",
    "overwritten-output": "Copy (`.clone()`) graph outputs that must outlive the next replay, or finish using "
                          "them before replaying the graph again.",
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
    """What a ``watch()`` saw: counts, findings, the kinds it could not check (and why), what the
    watched code raised, and the doctor's own error if it had to stop early (``failure``)."""

    findings: list[Finding] = dataclasses.field(default_factory=list)
    captures: int = 0
    replays: int = 0
    warmups: int = 0
    not_checked: dict[str, str] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    failure: str | None = None
    seconds: float = 0.0

    @property
    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    @property
    def checked(self) -> list[str]:
        return [k for k in KINDS if k not in self.not_checked]

    def of(self, kind: str) -> list[Finding]:
        if kind not in KINDS:
            raise ValueError(f"unknown finding kind {kind!r}; kinds are {KINDS}")
        return [f for f in self.findings if f.kind == kind]

    def headline(self) -> str:
        if self.captures == 0 and not self.findings:
            return "Graph doctor: nothing was captured inside watch(), so nothing could be checked."
        n = len(self.findings)
        line = (f"Graph doctor: {self.captures} capture(s), {self.warmups} warmup run(s), {self.replays} "
                f"replay(s) watched: {n} finding{'s' if n != 1 else ''}.")
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
        lines += [f"the watched code raised: {e}" for e in self.errors]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        e = html.escape
        head = "".join(f"<th style='text-align:left'>{c}</th>" for c in
                       ("kind", "graph", "op", "tensor", "source", "evidence", "root cause", "fix"))
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:left;vertical-align:top'>{e(v)}</td>" for v in
                             (f.kind, f.graph, f.op, f.tensor, f.source, f.evidence, f.cause, f.fix)) + "</tr>"
            for f in self.findings)
        table = f"<table><tr>{head}</tr>{body}</table>" if self.findings else ""
        extra = "".join(f"<li>not checked: <b>{e(k)}</b> ({e(w)})</li>" for k, w in self.not_checked.items())
        extra += "".join(f"<li>the watched code raised: <code>{e(x)}</code></li>" for x in self.errors)
        extra += "".join(f"<li>{e(n)}</li>" for n in self.notes)
        return f"<p><b>{e(self.headline())}</b></p>{table}<ul>{extra}</ul>"
