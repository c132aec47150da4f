"""The doctor on what happens before and around serving: values computed at set-up from a static
input, warmups that build on each other or leave state behind, several graphs replayed per step,
autograd mode, and op failures the workload swallows. Each workload is small and written here, on
the engine's public API; each bug has a fix that must give no finding."""
from __future__ import annotations

import bisect

import pytest
import torch

from workbench import doctor
from workbench.engine import events, graph, graph_pool_handle, is_capturing, new_graph


def captured(fn, *, static=None, state=None, warmups=1, name=None):
    """Warm up ``fn``, then capture it; returns the graph and its outputs."""
    if static:
        events.static_buffers("runner", static)
    if state:
        events.persistent_state("runner", state)
    for _ in range(warmups):
        with events.warmup():
            fn()
    g = new_graph("cpu")
    with graph(g, name=name):
        out = fn()
    return g, out


def served(g, out, fn):
    events.serve(g, out.shape[0], out.shape[0], outputs=out, eager=fn)
    g.replay()
    return out.clone()


def only_finding(workload, variant):
    """The one finding ``diagnose`` gives a ``bug`` workload; for a ``fix``, asserts there is none."""
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return None
    (finding,) = report.findings
    return finding


def finding_of(workload, variant):
    """The workload (returning its reference run's results and its served ones) misbehaves as a
    ``bug`` and gives the reference's answers as a ``fix``; under the doctor, ``only_finding``."""
    expected, got = workload()
    assert all(torch.equal(e, g) for e, g in zip(expected, got)) == (variant == "fix")
    return only_finding(workload, variant)


# ------------------------------------------------------------------------------ set-up
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_offsets_computed_from_a_static_input_before_the_capture(variant):
    """Cumulative lengths built once from the lengths buffer, outside the capture (bug), or inside
    the captured callable (fix)."""
    def workload():
        lengths = torch.full((3,), 4)
        keys = torch.arange(12.0)

        def offsets():
            return torch.cumsum(lengths, 0) - lengths

        frozen = offsets()

        def step():
            starts = frozen if variant == "bug" else offsets()
            return keys[starts] * lengths
        g, out = captured(step, static={"lengths": lengths})
        for n in ([1, 2, 3], [3, 1, 2]):
            lengths.copy_(torch.tensor(n))
            served(g, out, step)
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and finding.op == "aten.sub.Tensor"
    assert finding.source.endswith("return torch.cumsum(lengths, 0) - lengths")
    assert finding.numbers["source_elements_changed"] == 3


def test_a_table_computed_from_shapes_only_is_no_derivation():
    """``zeros_like`` of a static input reads its shape, not its values: no finding."""
    def workload():
        ids = torch.zeros(4, dtype=torch.int64)
        scale = torch.ones_like(ids, dtype=torch.float32) * 2

        def step():
            return ids * scale
        g, out = captured(step, static={"ids": ids})
        for step_ids in ([1, 2, 3, 4], [5, 6, 7, 8]):
            ids.copy_(torch.tensor(step_ids))
            served(g, out, step)
    assert doctor.diagnose(workload).findings == []


# ------------------------------------------------------------------------------ warmups
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_warmups_that_build_on_each_others_in_place_update(variant):
    """The forward advances the dummy batch's lengths in place; the second warmup then asks for
    more than the dummy batch was given and fails. The fix puts the lengths back after each run."""
    def workload():
        lens = torch.ones(2, dtype=torch.int64)
        table = torch.arange(6.0).reshape(2, 3)
        prepared = lens.clone()

        def forward():
            lens.add_(1)
            return table[torch.arange(2), lens]
        events.static_buffers("runner", {"lens": lens})
        for _ in range(2):
            with events.warmup():
                forward()
            if variant == "fix":
                lens.copy_(prepared)
        g, out = captured(forward, warmups=0)
        if variant == "fix":
            lens.copy_(prepared)
        served(g, out, forward)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.errors == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "persistent-mutation" and finding.graph.startswith("warmups")
    assert finding.source.endswith("lens.add_(1)")
    assert report.errors and "IndexError" in report.errors[0]


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_step_that_builds_on_counts_the_warmups_left(variant):
    """Usage counts the forward accumulates into persistent state: the warmups' dummy tokens are
    counted too unless the runner saves and restores the state around them (fix)."""
    def workload():
        counts = torch.zeros(3)
        x = torch.zeros(4, dtype=torch.int64)

        def forward():
            counts.add_(torch.bincount(x, minlength=3).float())
            return x.float() * 1                      # the counts show only in the state
        saved = counts.clone()
        g, out = captured(forward, static={"x": x}, state={"counts": counts}, warmups=2)
        if variant == "fix":
            counts.copy_(saved)
        for step_x in ([1, 2, 2, 0], [0, 0, 1, 1]):
            x.copy_(torch.tensor(step_x))
            served(g, out, forward)
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "persistent-mutation" and finding.tensor == "counts"
    assert "builds on what the dummy batches wrote" in finding.evidence


def _plan(x):
    return x.sum(1).cumsum(0)                       # per-row offsets: work on the step's data


class _Planned:
    """A layer that plans its rows on every step but while capturing (the plan's kernel syncs, so
    upstream code skips it under capture); ``fix`` plans under capture too (a capturable plan)."""

    def __init__(self, fix: bool):
        self.fix, self.offsets = fix, None

    def forward(self, x):
        if self.fix or not is_capturing():
            self.offsets = _plan(x)
        return x * self.offsets[:, None]


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_work_skipped_because_a_capture_is_open_is_named_at_the_branch_that_asked(variant):
    """The warmup plans on the dummy batch and the capture skips the plan, so every replay uses the
    dummy batch's offsets. The work skipped runs in ``_plan``. Where ``forward`` skipped it because
    it asked whether a capture is open, the decision is that branch, the line the capture ran up to
    and not past: under ``diagnose`` (lines traced) the finding names it, under ``watch()`` alone
    the skipped work. (Work skipped because the warmup had done it, a lazy plan, is named itself:
    ``test_doctor.py::test_evaluation_is_correct_on_every_case``'s fifth case.)"""
    def workload():
        x = torch.zeros(2, 3)
        layer = _Planned(variant == "fix")
        g, out = captured(lambda: layer.forward(x), static={"x": x})
        got = []
        for step in range(2):
            x.copy_(torch.arange(6.0).reshape(2, 3) + step)
            got.append(served(g, out, lambda: layer.forward(x)))
        return got
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    first = report.of("warmup-divergence")[0]
    assert "in forward:" in first.source and first.source.endswith("self.offsets = _plan(x)"), first
    assert "never executed" in first.evidence and "the capture left the warmup's path at" in first.evidence
    with doctor.watch() as watched:
        workload()
    (untraced,) = watched.of("warmup-divergence")
    assert "in _plan: return x.sum(1).cumsum(0)" in untraced.source, untraced


# ------------------------------------------------------------------------------ serving
def test_two_graphs_replayed_in_one_step_on_inputs_written_once_give_no_finding():
    """Metadata built once per step, then a target graph and a draft graph both read it (the
    draft's own input written between them): the draft does not carry the metadata over."""
    def workload():
        lens = torch.zeros(4, dtype=torch.int64)
        draft_ids = torch.zeros(4, dtype=torch.int64)
        table = torch.arange(40.0).reshape(10, 4)

        def target():
            return table[lens] * 2

        def draft():
            return table[lens] + draft_ids
        events.static_buffers("runner", {"lens": lens, "draft_ids": draft_ids})
        gt, out_t = captured(target, name="target")
        gd, out_d = captured(draft, name="draft")
        for step in range(3):
            lens.copy_(torch.arange(4) + step)
            served(gt, out_t, target)
            draft_ids.copy_(torch.arange(4) * step)
            served(gd, out_d, draft)
    assert doctor.diagnose(workload).findings == []


def test_the_eager_step_runs_in_the_autograd_mode_of_the_served_step():
    """Code that branches on ``torch.is_grad_enabled()`` takes the same branch in the eager step
    as in the replay it is compared with."""
    def workload():
        x = torch.zeros(3)
        seen = torch.zeros(3)

        def forward():
            if torch.is_grad_enabled():
                seen.add_(x)
            return x * 2
        g, out = captured(forward, static={"x": x}, state={"seen": seen}, warmups=0)
        seen.zero_()
        for v in (1.0, 2.0):
            x.fill_(v)
            served(g, out, forward)
    report = doctor.diagnose(workload)
    assert report.findings == [], report
    assert "differential replay: 2 replay(s) compared" in str(report)


# ------------------------------------------------------------------------------ swallowed failures
def test_an_op_failure_the_workload_catches_is_in_the_headline():
    def workload():
        x = torch.zeros(2)
        g, out = captured(lambda: x + 1, static={"x": x})
        served(g, out, lambda: x + 1)
        try:
            torch.arange(3)[torch.tensor([5])]
        except IndexError:
            pass                                        # a harness that logs and carries on
    report = doctor.diagnose(workload)
    assert report.errors == [] and not report.clean
    assert len(report.caught) == 1 and report.caught[0].startswith("IndexError")
    assert "during eager" in report.caught[0] and "torch.arange(3)[torch.tensor([5])]" in report.caught[0]
    assert "raised inside the workload and caught: IndexError" in report.headline()


@pytest.mark.parametrize("where", ["harness", "same frame"])
def test_a_misused_value_in_a_callback_a_library_calls_is_in_the_headline_when_a_harness_catches_it(where):
    """``tree_map(lambda x, y: x.copy_(y), ...)`` over leaves one of which is a float raises an
    ``AttributeError`` in the lambda, through torch's pytree code: the step failed. A harness around the
    step (the zoo's ``compare``, not the workload's code) that catches it does not make the run clean; a
    ``try`` in the frame that asked is the workload handling its own case."""
    from torch.utils._pytree import tree_map
    from workbench.zoo.kit import compare

    def refresh(dst, src):
        if where == "same frame":
            try:
                tree_map(lambda x, y: x.copy_(y), dst, src)
            except AttributeError:
                pass
            return
        tree_map(lambda x, y: x.copy_(y), dst, src)

    def served():
        x = torch.zeros(2)
        g, out = captured(lambda: x + 1, static={"x": x})
        refresh((x, 1.0), (torch.ones(2), 2.0))
        return [out.clone()]

    report = doctor.diagnose(lambda: compare("refresh", "bug", "cpu", served, lambda: [torch.ones(2) + 1]))
    if where == "harness":
        assert len(report.caught) == 1 and report.caught[0].startswith("AttributeError: 'float' object"), report
        assert "raised inside the workload and caught: AttributeError" in report.headline()
    else:
        assert report.caught == [], report.caught


def test_a_check_that_fails_in_the_first_warmup_and_is_caught_is_in_the_headline():
    """A start-up loop warms up each capture size and skips the sizes whose warmup fails: a failed
    assertion in the first warmup, before any graph exists, is still the workload's failure."""
    def store(size):
        assert size <= 4, f"batch of {size} does not fit the buffers"
        return torch.zeros(size)

    def workload():
        for size in (8, 2):
            try:
                with events.warmup():
                    store(size) + 1
            except AssertionError:
                continue
    report = doctor.diagnose(workload)
    assert len(report.caught) == 1 and report.caught[0].startswith("AssertionError: batch of 8"), report.caught
    assert "during warmup" in report.caught[0]


@pytest.mark.parametrize("variant", ["bug", "fix", "kept for eager code"])
def test_a_step_that_copies_more_than_its_graph_reads(variant):
    """A bucket's graph captured on the first batch's width (bug) reads three of the four tokens a
    later batch copies in; captured on the bucket's width (fix), it reads them all. A token the
    graph does not read but eager code reads after the replay was not dropped."""
    def workload():
        ids = torch.zeros(1, 4, dtype=torch.int64)
        emb = torch.arange(10.0)
        width = 4 if variant == "fix" else 3

        def step():
            return emb[ids[:, :width]].sum(-1)
        g, out = captured(step, static={"ids": ids})
        for tokens in ([1, 2, 3], [4, 5, 6, 7]):
            ids[:, :len(tokens)] = torch.tensor([tokens])
            ids[:, len(tokens):] = 0
            served(g, out, step)
            if variant == "kept for eager code":
                emb[ids[:, 3]].sum()
    finding = only_finding(workload, "fix" if variant == "kept for eager code" else variant)
    if finding is None:
        return
    assert finding.kind == "undersized-buffer" and finding.tensor.startswith("ids")
    assert finding.source.endswith("ids[:, :len(tokens)] = torch.tensor([tokens])")
    assert finding.numbers == {"elements_dropped": 1, "elements_read": 3}


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_static_input_handed_on_as_another_graphs_input(variant):
    """A reuse pool takes back the first graph's input buffer after its capture (bug) and hands it
    to a second graph as its input, while the first graph still reads it; the fix keeps it."""
    def workload():
        free = []

        def take():
            return free.pop() if free else torch.zeros(3)
        x = take()
        w = torch.arange(3.0)

        def first():
            return x * w
        g1, out1 = captured(first, static={"x": x}, name="first")
        if variant == "bug":
            free.append(x)
        y = take()

        def second():
            return y + 1
        g2, out2 = captured(second, static={"y": y}, name="second")
        for step in range(2):
            x.copy_(torch.full((3,), float(step)))
            y.copy_(torch.full((3,), 10.0 + step))
            served(g2, out2, second)
            served(g1, out1, first)
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "dangling-reference" and finding.tensor.startswith("x") and finding.graph == "first"
    assert finding.source.endswith('in captured: events.static_buffers("runner", static)')   # where x was announced
    assert "announced again as y" in finding.evidence


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_buffer_given_a_new_role_by_a_recapture_is_dangling_only_if_the_old_graph_replays(variant):
    """A graph runner rebuilds its graph when the step's layout changes (ggml's graph update): the
    allocator lays the new graph's inputs out again, so one buffer becomes another input of the
    new graph while the old graph, still held, is about to be replaced. The fix drops the old graph
    (nothing reads the buffer in its first role again); the bug replays the old graph once more."""
    def workload():
        a, b = torch.zeros(3), torch.zeros(3)

        def first():
            return a * 2 + b
        g1, out1 = captured(first, static={"a": a, "b": b}, name="layout 1")
        served(g1, out1, first)

        def second():
            return b * 3 + a
        g2, out2 = captured(second, static={"b (was a)": a, "a (was b)": b}, name="layout 2")
        if variant == "bug":
            served(g1, out1, first)
        del g1, out1
        for step in range(2):
            a.copy_(torch.full((3,), float(step)))
            served(g2, out2, second)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    assert [(f.kind, f.graph, f.tensor.split(":")[0]) for f in report.findings] == [
        ("dangling-reference", "layout 1", "a"), ("dangling-reference", "layout 1", "b")], report
    assert all("and layout 1 replays" in f.evidence for f in report.findings), report


def test_two_windows_of_one_arena_announced_together_are_two_buffers():
    """A runner carves its static inputs from one allocation (a compute buffer) and announces both
    windows at each capture; its graphs keep replaying. One storage, two names, no common byte:
    nothing was handed on."""
    def workload():
        arena = torch.zeros(8)
        a, b = arena[0:4], arena[4:8]

        def step():
            return a * 2 + b
        g1, out1 = captured(step, static={"a": a, "b": b}, name="first")
        g2, out2 = captured(step, static={"a": a, "b": b}, name="second")
        for s in range(2):
            a.copy_(torch.full((4,), float(s)))
            b.copy_(torch.ones(4))
            served(g1, out1, step)
            served(g2, out2, step)
    assert only_finding(workload, "fix") is None


def test_work_a_library_skips_only_under_capture_is_a_note_when_every_replay_agrees():
    """transformers checks ``padding_mask.all()`` (to drop an all-ones mask) only outside a capture:
    the warmup runs that check, the capture does not, and differential replay shows every replay,
    masked rows or not, equal to its eager step: a note, no finding."""
    from workbench import hf_matrix
    from workbench.engine import GraphRunner
    entry = next(e for e in hf_matrix.ENTRIES if e.label == "bert")

    def make_runner():
        model = hf_matrix.build(entry.arch)
        return GraphRunner(lambda **kw: hf_matrix.forward(model, entry, kw),
                           {"input_ids": ((8,), torch.int64), "attention_mask": ((8,), torch.int64)}, [1, 2, 4])

    def make_batch(n, step):
        mask = torch.ones(n, 8, dtype=torch.int64)
        mask[0, :step % 3] = 0                          # some steps pad their first row, some do not
        return {"input_ids": torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(step)),
                "attention_mask": mask}
    report = doctor.diagnose(make_runner, make_batch)
    assert report.findings == [] and report.not_checked == {}, report
    assert any("the warmup ran work the capture skipped" in n and "changes no result" in n for n in report.notes)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_piecewise_step_is_compared_whole(variant):
    """PIECEWISE graphs around an eager attention region; a Python scalar changed after capture is
    frozen in the second piece (bug) unless the graphs are captured again (fix)."""
    from workbench.engine import GraphManager

    def workload():
        x = torch.zeros(4, 3)
        scale = {"t": 1.0}
        managers = []

        def forward(size):
            h = managers[0].eager(lambda v: torch.softmax(v, -1))(x[:size] * 2)
            return h / scale["t"]
        m = GraphManager(forward, [4], mode="PIECEWISE", static_buffers={"x": x})
        managers.append(m)
        m.capture()
        for step, t in enumerate((1.0, 2.0)):
            scale["t"] = t
            if variant == "fix" and step:
                m.recapture()
            x.copy_(torch.randn(4, 3, generator=torch.Generator().manual_seed(step)))
            m.replay(4, 4)
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "host-work-frozen" and finding.source.endswith('return h / scale["t"]')


def test_a_later_warmup_leaves_what_real_steps_wrote_in_between_alone():
    """Graphs captured as they are needed, each after a warmup on a dummy batch that writes only a
    scratch row: the cache rows real steps wrote between the first warmup and a later one are real
    data, not the warmups' (the step never reads the scratch row)."""
    def workload():
        cache = torch.zeros(8)
        pos = torch.zeros(1, dtype=torch.int64)
        val = torch.zeros(1)

        def forward():
            cache.index_copy_(0, pos, val)
            return cache[:7].sum().reshape(1)
        events.persistent_state("backend", {"cache": cache})
        graphs = []
        for p in range(6):
            if p in (0, 3):                                 # a new graph: dummy batch on scratch row 7
                pos.fill_(7)
                val.fill_(-100.0)
                graphs.append(captured(forward, static={"pos": pos, "val": val}))
            pos.fill_(p)
            val.fill_(p + 1.0)
            served(*graphs[-1], forward)
    assert doctor.diagnose(workload).findings == []


# ------------------------------------------------------------------ a lazy capture whose warmup is a real step
def lazy_capture(real: bool):
    """The first batch of a shape is run eagerly (its results handed out), then captured; later
    steps replay. That first run writes the real tokens' keys into the cache, which later steps
    read: announced as a warmup on dummy data, the doctor must take those writes for dummy ones."""
    def workload():
        cache, ids, pos = torch.zeros(8, 2), torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        table = torch.arange(20.0).reshape(10, 2)

        def step():
            cache.index_copy_(0, pos + torch.arange(2), table[ids])
            return cache.sum(0, keepdim=True).expand(2, 2) * 1.0

        events.static_buffers("runner", {"ids": ids, "pos": pos})
        events.persistent_state("runner", {"cache": cache})
        ids.copy_(torch.tensor([3, 4]))
        with events.warmup(real=real):
            step()                                  # the first batch, served by its warmup
        g = new_graph("cpu")
        with graph(g):
            out = step()
        for k, tokens in enumerate(([5, 6], [7, 8])):
            ids.copy_(torch.tensor(tokens))
            pos.fill_(2 * (k + 1))
            served(g, out, step)
    return workload


def test_a_warmup_announced_as_a_real_step_keeps_its_writes_as_real_data():
    bug = doctor.diagnose(lazy_capture(real=False))
    assert [f.kind for f in bug.findings] == ["persistent-mutation"], bug    # taken for a dummy batch's writes
    assert doctor.diagnose(lazy_capture(real=True)).findings == []


def test_a_warmup_blocks_own_set_up_is_not_work_the_capture_skipped():
    """Megatron's layer runner warms up on zero clones of its inputs (made by helpers inside the
    warmup block) with forward and backward, then captures the forward and the backward as two
    graphs: the clones and the backward launched from the runner are its own work, not the step's."""
    from workbench.engine import events, graph, graph_pool_handle, new_graph

    def zero_clone(t):
        return torch.zeros_like(t).requires_grad_(t.requires_grad)

    def workload():
        layer = torch.nn.Linear(3, 3)
        x = torch.randn(2, 3, requires_grad=True)
        events.static_buffers("layer runner", {"x": x})
        with events.warmup():
            w = zero_clone(x)
            out = layer(w)
            torch.autograd.grad(out, (w, *layer.parameters()), torch.ones_like(out))
        pool = graph_pool_handle("cpu")
        fwd, bwd = new_graph("cpu"), new_graph("cpu")
        with graph(fwd, pool=pool, name="fwd"):
            y = layer(x)
        grad_out = torch.ones_like(y)
        with graph(bwd, pool=pool, name="bwd"):
            torch.autograd.grad(y, (x, *layer.parameters()), grad_out)
        for _ in range(2):
            with torch.no_grad():
                x.copy_(torch.randn(2, 3))
            fwd.replay()
            bwd.replay()
    report = doctor.diagnose(workload)
    assert not report.of("warmup-divergence"), report


def test_work_run_eagerly_after_the_capture_in_the_same_step_is_not_work_the_capture_skipped():
    """vLLM's dummy run: the target model, then the drafter, both eagerly in the warmup; in the capture
    pass the target is captured and the drafter runs eagerly after it, outside any graph (its own graphs
    are off). The drafter's lines ran in both passes: no work the capture skipped, for either size,
    though no graph is replayed."""
    w = torch.randn(3, 3)
    x = torch.zeros(4, 3)

    def target(n):
        return x[:n] @ w

    def drafter(h):
        return torch.tanh(h).sum(-1)

    def dummy_run(n, capture):
        if capture:
            with graph(new_graph("cpu"), name=f"size {n}"):
                h = target(n)
        else:
            h = target(n)
        return drafter(h)

    def workload():
        for n in (4, 2):
            with events.warmup():
                dummy_run(n, capture=False)
            dummy_run(n, capture=True)
    report = doctor.diagnose(workload)
    assert report.captures == 2 and not report.of("warmup-divergence"), report


# ------------------------------------------------------------------------------ tables of capture sizes
SIZES = [2, 4]


class _Runner:
    """Graphs of sizes 2 and 4 over one static input, and the host tables a runner keeps of them:
    the padded size of each batch size, the sorted sizes, the graphs by size (also per engine)."""

    def __init__(self):
        self.x = torch.zeros(max(SIZES))
        self.padded_size = [min(s for s in SIZES if s >= n) for n in range(max(SIZES) + 1)]
        self.graphs, self.outputs = {}, {}
        for size in reversed(SIZES):
            self.graphs[size], self.outputs[size] = captured(lambda size=size: self.x[:size] * 2,
                                                             static={"x": self.x} if size == 4 else None)
        self.engines = [self.graphs]

    def run_on(self, engine, batch, size):
        """``run`` on the graphs of one engine: a table of tables (vLLM's graphs of each virtual engine)."""
        graph = self.engines[engine][size]
        self.x[:len(batch)] = batch
        served(graph, self.outputs[size], lambda: self.x[:size] * 2)
        return self.outputs[size][:len(batch)].clone()

    def pad(self, n):
        return self.padded_size[n]

    def run(self, batch, size):
        out = self.outputs[size]
        self.x[:len(batch)] = batch
        served(self.graphs[size], out, lambda: self.x[:size] * 2)
        return out[:len(batch)].clone()



@pytest.mark.parametrize("form", ["padded size", "sorted sizes", "graphs by size", "graphs per engine"])
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_batch_past_the_largest_capture_size_asked_of_a_size_table(form, variant):
    """A batch of 6 rows, more than the largest graph's 4, is sent to the graph path (bug): asking
    the runner's table of capture sizes for it fails and ends the run. The fix runs it eagerly.
    The finding names the line that asked: for a lookup of a helper's argument, the helper's call."""
    def step(runner, batch):
        n = len(batch)
        if variant == "fix" and n > max(SIZES):
            return batch * 2
        if form == "padded size":
            size = runner.pad(n)
        elif form == "sorted sizes":
            size = SIZES[bisect.bisect_left(SIZES, n)]
        else:
            size = n
        if form == "graphs per engine":
            return runner.run_on(0, batch, size)
        return runner.run(batch, size)

    def workload():
        runner = _Runner()
        step(runner, torch.ones(4))
        step(runner, torch.ones(6))
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "undersized-buffer" and finding.numbers["largest"] == 4
    line = {"padded size": "size = runner.pad(n)", "sorted sizes": "size = SIZES[bisect.bisect_left(SIZES, n)]",
            "graphs by size": "return runner.run(batch, size)",
            "graphs per engine": "return runner.run_on(0, batch, size)"}[form]
    assert finding.source.endswith(line), finding.source


def test_a_lookup_the_workload_catches_to_run_eagerly_is_no_finding():
    """The standard fallback: a batch with no graph of its size runs eagerly (``except KeyError``)."""
    def workload():
        runner = _Runner()
        for n in (4, 6):
            batch = torch.ones(n)
            try:
                runner.run(batch, n)
            except KeyError:
                batch * 2
    assert doctor.diagnose(workload).findings == []


class _Staging:
    """Persistent input buffers with a store that checks its data fits (as runners' ``_store_arg``)."""

    def __init__(self, rows):
        self.ids = torch.zeros(rows, dtype=torch.int64)

    def store(self, data):
        buf = self.ids
        assert len(data) <= buf.numel(), f"data too large for ids: {len(data)} > {buf.numel()}"
        buf[:len(data)].copy_(torch.tensor(data))


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_capture_sizes_dummy_batch_that_the_programs_own_check_refuses(variant):
    """Capture sizes beyond the buffers (bug): the first capture's dummy batch fails the program's
    check that it fits, before any graph exists. The fix caps the sizes at the buffers' rows."""
    def workload():
        staging = _Staging(4)
        pool = graph_pool_handle("cpu")
        sizes = [s for s in (1, 2, 4, 6) if variant == "bug" or s <= 4]
        for size in reversed(sizes):
            staging.store([1] * size)
            events.static_buffers("runner", {"ids": staging.ids})
            g = new_graph("cpu")
            with graph(g, pool=pool):
                staging.ids[:size] * 2
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "undersized-buffer" and finding.tensor == "buf: int64[4]"
    assert finding.numbers == {"size": 4, "asked": 6} and finding.graph == "the first capture"
    assert finding.source.endswith("assert len(data) <= buf.numel(), f\"data too large for ids: "
                                   "{len(data)} > {buf.numel()}\"")


@pytest.mark.parametrize("variant", ["bug", "fix", "caught where checked"])
def test_a_step_whose_data_the_programs_own_check_refuses_for_a_static_input(variant):
    """A real step of 6 rows for a static input of 4 (bug) fails the program's check; a batch that
    fits (fix) does not. A check the same function catches (a batch split in two) is no finding."""
    def workload():
        staging = _Staging(4)
        g, out = captured(lambda: staging.ids * 2, static={"ids": staging.ids})
        served(g, out, lambda: staging.ids * 2)
        data = [1] * (4 if variant == "fix" else 6)
        if variant == "caught where checked":
            buf = staging.ids
            try:
                assert len(data) <= buf.numel(), f"{len(data)} > {buf.numel()}"
            except AssertionError:
                data = data[:4]
        staging.store(data)
        served(g, out, lambda: staging.ids * 2)
    finding = only_finding(workload, "fix" if variant != "bug" else "bug")
    if finding is not None:
        assert finding.kind == "undersized-buffer" and finding.tensor == "ids: int64[4]"


class _Arena:
    """A workspace arena that grows on demand until the runner locks it after capture (as vLLM's
    ``WorkspaceManager``): it hands out views by count and checks each request against what it holds,
    for every caller. The arena is kept on the object only."""

    def __init__(self):
        self._current, self._locked = torch.zeros(4), False

    def _ensure(self, required: int) -> torch.Tensor:
        current = self._current.numel()
        if current < required:
            if self._locked:
                raise AssertionError(f"locked arena asked for {required} elements, current size is {current}.")
            self._current = torch.zeros(required)
        return self._current

    def get(self, *sizes: int) -> list:
        arena, views, at = self._ensure(sum(sizes)), [], 0
        for n in sizes:
            views.append(arena[at:at + n])
            at += n
        return views


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_arena_locked_at_capture_that_refuses_a_later_request_names_the_code_that_asked(variant):
    """Decode steps are captured on views of the arena, which is then locked; a later prefill asks it
    for more than the captures needed (bug) and the arena's own check refuses, in a method of the
    arena, with a message whose last number ends its sentence. The request was made by the prefill,
    which computed its size: the finding is there. The fix reserves the prefill's need before the
    capture locks the arena."""
    def prefill(arena, n):
        scratch, = arena.get(2 * n)                          # the prefill's request
        scratch.fill_(1.0)
        return scratch.sum()

    def workload():
        arena = _Arena()
        if variant == "fix":
            arena._ensure(12)
        decode, = arena.get(4)
        g, out = captured(lambda: decode * 2, static={})
        arena._locked = True
        served(g, out, lambda: decode * 2)
        return prefill(arena, 6)
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "undersized-buffer" and finding.numbers == {"size": 4, "asked": 12}
    assert "the prefill's request" in finding.source and finding.tensor.startswith("self._current"), finding


class _AdoptingBuilder:
    """A metadata builder that keeps, at its first build (the capture's), the splits it computed as the
    graph's buffer, on itself and announced nowhere; later builds copy into it after a bare check
    (``bug``). The fix allocates the buffer for the largest batch up front."""

    def __init__(self, variant: str):
        self.buf = None if variant == "bug" else torch.zeros(6, dtype=torch.int64)

    def build(self, lens: list[int]) -> torch.Tensor:
        splits = torch.tensor(lens) // 2 + 1
        if self.buf is None:
            self.buf = splits
            return self.buf
        n = splits.size(0)
        assert n <= self.buf.size(0)
        self.buf[:n].copy_(splits)
        self.buf[n:].fill_(0)
        return self.buf


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_bare_check_that_data_fits_a_buffer_kept_on_an_object_a_graph_reads(variant):
    """The check measures ``self.buf``, no local of its frame and no announced static input, but the
    memory the graph reads: a step of 6 requests after a capture of 4 (bug) fails it, and the
    finding names the buffer and the check. The fix's buffer holds every batch: no finding."""
    def workload():
        builder = _AdoptingBuilder(variant)
        buf = builder.build([2, 3, 4, 5])
        g, out = captured(lambda: buf * 2)
        served(g, out, lambda: buf * 2)
        builder.build([1, 2, 3, 4, 5, 6])
        served(g, out, lambda: buf * 2)
    finding = only_finding(workload, variant)
    if finding is not None:
        assert finding.kind == "undersized-buffer" and finding.tensor == "self.buf: int64[4]", finding
        assert finding.numbers == {"size": 4, "asked": 6} and "assert n <= self.buf.size(0)" in finding.source


def _roll_state(x, state, lines):
    """A decode step's state update (a short convolution's): one state line per request."""
    batch, num_lines = x.shape[0], state.size(0)
    assert num_lines >= batch
    state[lines] = torch.cat([state[lines, 1:], x[:, None]], dim=1)
    return state[lines].sum(1)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_warmup_batch_larger_than_the_state_lines_the_programs_check_compares(variant):
    """Capture sizes up to 4 over a state of 3 lines (bug): the warmup of size 4 fails the program's
    bare ``assert num_lines >= batch``. The two operands are two tensors' sizes, and the ordering
    says which must hold which: the state is the buffer too small. The fix caps the sizes."""
    def workload():
        state, graphs = torch.zeros(3, 2), []
        events.persistent_state("runner", {"state": state})
        for size in ([1, 2, 4] if variant == "bug" else [1, 2, 3]):
            x, lines = torch.ones(size), torch.arange(size)
            events.static_buffers("runner", {f"x{size}": x, f"lines{size}": lines})
            graphs.append((x, lines))                     # (the graphs' inputs live as long as they do)
            with events.warmup():
                _roll_state(x, state, lines)
            graphs.append(new_graph("cpu"))
            with graph(graphs[-1]):
                _roll_state(x, state, lines)
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "undersized-buffer" and finding.tensor == "state: float32[3, 2]", finding
    assert finding.numbers == {"size": 3, "asked": 4} and finding.source.endswith("assert num_lines >= batch")
    # (pytest rewrites this module's asserts to state their operands; a bare one says what was compared)
    assert finding.evidence.endswith(("failed: assert 3 >= 4", "the check compared 3 with 4")), finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_builder_that_resets_the_runners_shared_offsets_before_the_next_builder_reads_them(variant):
    """Two metadata builders get views of the runner's query offsets for a capture's dummy batch.
    The first one's capture path zeroes them in place (bug): the second builder's check that every
    request has a token fails. The fix zeroes only a copy of its own."""
    class Runner:
        def __init__(self):
            self.offsets = torch.zeros(5, dtype=torch.int64)
            events.static_buffers("runner", {"query_start_loc": self.offsets})

        def dummy_batch(self, n):
            self.offsets.copy_(torch.arange(5).clamp(max=n))
            return self.offsets[:n + 1]

    def build_for_capture(offsets):
        if variant == "bug":
            offsets.zero_()
        else:
            offsets = torch.zeros_like(offsets)
        return offsets

    def build_indexer(offsets):
        lengths = offsets[1:] - offsets[:-1]
        assert bool((lengths > 0).all()), "a decode request without tokens"
        return lengths

    def workload():
        runner = Runner()
        offsets = runner.dummy_batch(4)
        build_for_capture(offsets)
        lengths = build_indexer(offsets)
        g = new_graph("cpu")
        with graph(g):
            lengths * 2
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.errors == [], report
        return
    (finding,) = report.findings
    assert report.errors[0].startswith("AssertionError: a decode request without tokens"), report
    assert finding.kind == "persistent-mutation" and finding.tensor == "query_start_loc: int64[5]"
    assert finding.source.endswith("offsets.zero_()") and finding.graph == "the first capture"


# ------------------------------------------------------------------------------ host memory a captured copy reads
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_captured_copy_from_a_shared_host_scratch_that_later_code_refills(variant):
    """``fill(array, value)`` stages the value in host memory and copies it to the device. Captured,
    the copy re-reads that host memory at every replay. With one scratch shared by every call
    (bug), the next eager fill puts its value there and the graph fills with it; the fix gives the
    graph a staging block of its own."""
    from workbench.engine import host
    shared = host(torch.zeros(3))

    def fill(dst, value, scratch):
        scratch.copy_(host(torch.tensor(value)))
        dst.copy_(scratch.expand(dst.shape), non_blocking=True)

    def workload():
        forces, wind = torch.zeros(2, 3), torch.zeros(2, 3)
        own = host(torch.zeros(3)) if variant == "fix" else shared

        def step():
            fill(forces, [0.0, -9.8, 0.0], own)
            return forces * 2
        g, out = captured(step, state={"forces": forces})
        results = []
        for gust in ([1.0, 0.0, 0.0], [0.0, 0.0, 2.0]):
            fill(wind, gust, shared)
            results.append(served(g, out, step))
        return results
    ran = []
    finding = only_finding(lambda: ran.append(workload()), variant)
    gravity = torch.tensor([0.0, -19.6, 0.0]).expand(2, 3)
    assert [torch.equal(r, gravity) for r in ran[0]] == [variant == "fix", variant == "fix"]
    if finding is None:
        return
    assert finding.kind == "dangling-reference" and finding.tensor == "float32[2, 3] (host memory)"
    assert finding.source.endswith("dst.copy_(scratch.expand(dst.shape), non_blocking=True)"), finding.source


def test_host_memory_announced_as_a_static_input_is_refilled_on_purpose_not_handed_on():
    """A captured copy re-reads announced host memory (pinned positions the runner refills before every
    replay): that write is the runner's contract, not memory handed to someone else. What the replay
    gets wrong here is the scale, a Python number read at capture: ``host-work-frozen``, not a
    dangling reference to the refilled host memory."""
    from workbench.engine import host

    def workload():
        positions = host(torch.zeros(3))
        counter = {"step": 1}

        def step():
            staged = torch.empty(3)
            staged.copy_(positions, non_blocking=True)
            return staged * float(counter["step"])
        g, out = captured(step, static={"positions": positions})
        for i in range(2, 5):
            counter["step"] = i
            positions.copy_(torch.full((3,), float(i)))
            served(g, out, step)
    report = doctor.diagnose(workload)
    assert [f.kind for f in report.findings] == ["host-work-frozen"], report


def test_an_attribute_the_step_binds_to_its_own_output_is_no_finding():
    """The captured step keeps its result in an attribute (``self.energy = ...``): capture bound it to
    the graph's output, which every replay writes, so a reader of the attribute sees this step's
    values as the eager step's new binding would give them."""
    class Kernel:
        def __init__(self):
            self.x = torch.zeros(3)

        def step(self):
            self.energy = self.x * 2
            return self.energy

    def workload():
        k = Kernel()
        g, out = captured(k.step, static={"x": k.x})
        for i in range(3):
            k.x.fill_(float(i))
            served(g, out, k.step)
            assert torch.equal(k.energy, torch.full((3,), 2.0 * i))
    assert doctor.diagnose(workload).findings == []


@pytest.mark.parametrize("variant", ["bug", "fix", "neither announced"])
def test_a_check_that_a_buffer_and_the_steps_tensor_match_is_a_padded_shape_mismatch(variant):
    """``bitmask 6 rows, logits 2 rows``: a persistent bitmask laid out for the padded token layout
    and the warmup's logits fail the program's check that they have as many rows (bug): not data
    past a buffer (no undersized-buffer) but two layouts that disagree. The fix lays the bitmask out
    for the graph's batch; where neither tensor is an announced buffer, nothing ties the check to
    the graph."""
    def apply_bitmask(logits, bitmask):
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask {bitmask.shape[0]} rows, logits {logits.shape[0]} rows")
        return logits.masked_fill(bitmask, 0)

    def workload():
        bitmask = torch.zeros(6, 4, dtype=torch.bool)
        if variant != "neither announced":
            events.static_buffers("runner", {"guided_bitmask": bitmask})
        rows = 2 if variant == "fix" else 6
        with events.warmup():
            apply_bitmask(torch.zeros(2, 4), bitmask[:rows] if variant == "fix" else bitmask)
    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.findings == [] and (variant == "fix") == (report.errors == []), report
        return
    (finding,) = report.findings
    assert report.errors[0].startswith("ValueError: bitmask 6 rows"), report
    assert finding.kind == "padded-shape-mismatch" and finding.numbers == {"buffer_rows": 6, "step_rows": 2}
    assert "raise ValueError" in finding.source


def _check(ok: bool, what: str) -> None:
    """A check helper, as ``TORCH_CHECK`` is in C++: the caller compares, the helper raises."""
    if not ok:
        raise RuntimeError(f"Check failed: {what}")


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_comparison_handed_to_a_check_helper_is_read_in_its_caller(variant):
    """Offsets laid out in one buffer sized for the largest batch (9 entries for 8 requests), and a
    kernel wrapper that demands exactly ``batch + 1`` entries through a check helper: the warmup of
    a 4-request graph fails. The comparison is the caller's, handed to the helper: the finding
    stands at the caller's line, the buffer's rows against the count (the fix asks for at least)."""
    def forward(q, indptr):
        batch_size = q.size(0)
        if variant == "fix":
            _check(indptr.size(0) >= batch_size + 1, "indptr.size(0) >= batch_size + 1")
        else:
            _check(indptr.size(0) == batch_size + 1, "indptr.size(0) == batch_size + 1")
        return q * indptr[1:batch_size + 1, None]

    def workload():
        indptr = torch.arange(9.0)
        events.static_buffers("runner", {"indptr": indptr})
        with events.warmup():
            forward(torch.ones(4, 2), indptr)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.errors == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "padded-shape-mismatch" and finding.numbers == {"buffer_rows": 9, "step_rows": 5}
    assert finding.source.endswith('in forward: _check(indptr.size(0) == batch_size + 1, "indptr.size(0) == '
                                   'batch_size + 1")'), finding.source


def _failing_frame(check):
    """The frame in which ``check`` failed, and the error."""
    try:
        check()
    except (AssertionError, ValueError) as e:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        return tb.tb_frame
    raise AssertionError("the check passed")


def test_a_checks_comparison_and_numbers_are_read_from_its_source_not_its_message():
    """A bare ``assert`` has no message (unless pytest rewrote it): the comparison and its operands
    are read from the source and the frame, plain reads only; a negated comparison (``if not a >= b:
    raise``) is the comparison checked."""
    from workbench.doctor.rules import checks
    buf, data = torch.zeros(4), [1] * 6

    def bare():
        assert len(data) <= buf.numel()

    def raised():
        rows = buf.shape[0]
        if data.__len__() != rows:                     # a call that is no plain read
            raise ValueError("mismatch")

    def matched():
        if buf.size(0) + 2 != len(data) + 1:
            raise ValueError("mismatch")

    def negated():                                     # (Rust's ``assert!(dst.len() >= src.len())``, in Python)
        if not buf.numel() >= len(data):
            raise AssertionError("assertion failed: dst.len() >= src.len()")

    assert checks.condition(_failing_frame(bare)) == ("order", [6, 4])
    assert checks.condition(_failing_frame(raised)) is None
    assert checks.condition(_failing_frame(matched)) == ("equal", [6, 7])
    assert checks.condition(_failing_frame(negated)) == ("order", [4, 6])


class _BareStaging(_Staging):
    def store(self, data):
        buf = self.ids
        assert len(data) <= buf.numel()
        buf[:len(data)].copy_(torch.tensor(data))


def test_a_bare_fit_check_without_a_message_is_read_from_its_source():
    """The capture-size fit check above, as a bare ``assert``: the same finding."""
    def workload():
        staging = _BareStaging(4)
        pool = graph_pool_handle("cpu")
        for size in (6, 4):
            staging.store([1] * size)
            events.static_buffers("runner", {"ids": staging.ids})
            g = new_graph("cpu")
            with graph(g, pool=pool):
                staging.ids[:size] * 2
    (finding,) = doctor.diagnose(workload).findings
    assert finding.kind == "undersized-buffer" and finding.numbers == {"size": 4, "asked": 6}, finding


# ------------------------------------------------------------------------------ a static input nothing wrote
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_dummy_batch_whose_preparation_leaves_a_static_input_as_allocated(variant, device):
    """The runtime path writes each step's checkpoint rows (``work_items``) beside the token ids
    and slots; the capture's dummy-batch preparation writes the ids and slots only (bug), so the
    warmup indexes the checkpoint table with what the allocation left there (a large garbage index).
    The fix prepares the work items on both paths. On CUDA the warmup's index is checked before the
    kernel runs (``rules/bounds.py``): the same error and finding as on the CPU, no device assert."""
    garbage = 1 << 20
    ints = dict(dtype=torch.int64, device=device)

    class Runner:
        def __init__(self):
            self.ids, self.slots = torch.zeros(2, **ints), torch.zeros(2, **ints)
            self.work_items = torch.full((2,), garbage, **ints)     # as uninitialised memory
            self.table, self.ckpt = torch.zeros(3, 4, device=device), torch.zeros(6, 4, device=device)

        def prepare(self, ids, slots):
            self.ids.copy_(ids)
            self.slots.copy_(slots)

        def prepare_dummy_batch(self):
            self.prepare(torch.ones(2, **ints), torch.zeros(2, **ints))
            if variant == "fix":
                self.work_items.copy_(self.slots * 2)

        def forward(self):
            h = self.table[self.slots] + self.ids[:, None]
            self.ckpt[self.work_items] = h
            return h * 2

    def workload():
        runner = Runner()
        runner.prepare_dummy_batch()
        events.static_buffers("runner", {"ids": runner.ids, "slots": runner.slots, "work_items": runner.work_items})
        try:
            with events.warmup():
                runner.forward()
        except IndexError:
            return
        g = new_graph(device)
        with graph(g):
            out = runner.forward()
        runner.prepare(torch.tensor([2, 3], device=device), torch.tensor([1, 2], device=device))
        runner.work_items.copy_(runner.slots * 2)
        served(g, out, runner.forward)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.errors == [], report
        return
    (finding,) = report.findings
    assert report.caught[0].startswith("IndexError: index 1048576 is out of bounds"), report
    assert finding.kind == "stale-input" and finding.tensor == "work_items: int64[2]", finding
    assert "in prepare_dummy_batch: self.prepare(" in finding.source, finding
    assert "nothing wrote since it was made" in finding.evidence and "ids, slots were written" in finding.evidence


def test_a_lookup_past_the_end_of_a_static_input_that_nothing_wrote_names_the_table_not_the_index():
    """A table the dummy batch indexes past its end is too small, whatever wrote it: the index
    (written for the dummy batch) is not what the preparation left out."""
    table, idx = torch.arange(3), torch.zeros(4, dtype=torch.int64)

    def workload():
        idx.copy_(torch.tensor([0, 1, 2, 3]))
        try:
            captured(lambda: table[idx] * 2, static={"table": table, "idx": idx})
        except IndexError:
            pass
    report = doctor.diagnose(workload)
    assert "stale-input" not in report.kinds, report


@pytest.mark.cuda
def test_a_gather_past_its_end_in_a_cuda_warmup_raises_the_cpus_error_and_the_context_lives():
    """``gather`` raises a ``RuntimeError`` on the CPU, not an ``IndexError``: the warmup check gives
    that error at the op, as the workload's own, and no device-side assert ends the context."""
    src, idx = torch.zeros(3, device="cuda"), torch.full((2,), 5, device="cuda")

    def workload():
        events.static_buffers("runner", {"idx": idx})
        with pytest.raises(RuntimeError, match="index 5 is out of bounds"), events.warmup():
            torch.gather(src, 0, idx)
    report = doctor.diagnose(workload)
    assert report.failure is None and "aten.gather" in report.caught[0], report
    torch.cuda.synchronize()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_out_form_that_reads_its_destination_accumulates_and_one_that_does_not_refreshes(variant):
    """Eager code writes a static input with an ``out=`` op each step: ``torch.exp(x, out=buf)``
    (fix) writes it from the step's data, as a copy would; ``torch.add(buf, x, out=buf)`` (bug)
    builds on what the last step left there."""
    def workload():
        buf = torch.zeros(2, 3)
        g, out = captured(lambda: buf * 2, static={"buf": buf})
        for step in range(3):
            x = torch.full((2, 3), 0.1 * (step + 1))
            if variant == "bug":
                torch.add(buf, x, out=buf)
            else:
                torch.exp(x, out=buf)
            served(g, out, lambda: buf * 2)
    finding = only_finding(workload, variant)
    if finding is not None:
        assert finding.kind == "persistent-mutation" and finding.op == "aten.add.out", finding
        assert finding.numbers["pattern"] == "accumulating", finding


@pytest.mark.parametrize("variant", ["bug", "refresh"])
def test_a_reset_before_the_steps_data_is_a_refresh_and_one_after_it_clobbers(variant):
    """The runner clears a static table before each step's rows are copied in. ``bug``: another
    function resets the table after the step's copy, and the builder's check that every row has a
    block fails: the reset is the finding. ``refresh``: the third step's copy itself refuses its data
    (another dtype); the table holds what the runner's clear left, and that clear, made before the
    step's data, is no clobber of it: the workload fails, with no finding."""
    def copy_rows(src, dst):
        if src.dtype != dst.dtype:
            raise TypeError(f"table is {dst.dtype}, data {src.dtype}")
        dst[:, :src.size(1)].copy_(src)

    def clear(table):
        table.fill_(0)

    def build(table):
        if int((table > 0).sum()) != table.shape[0]:
            raise ValueError("a row without a block")

    def workload():
        table = torch.zeros(2, 2, dtype=torch.int64)
        g, out = captured(lambda: table * 2, static={"table": table})
        for step in range(3):
            clear(table)                                  # the runner's refresh: before the step's data
            rows = torch.tensor([[step + 1], [step + 2]])
            copy_rows(rows.float() if variant == "refresh" and step == 2 else rows, table)
            if variant == "bug" and step == 2:
                clear(table)
            build(table)
            served(g, out, lambda: table * 2)
    report = doctor.diagnose(workload)
    if variant == "refresh":
        assert report.findings == [] and "TypeError" in report.headline(), report
        return
    (finding,) = report.findings
    assert finding.kind == "persistent-mutation" and finding.op == "aten.fill_.Scalar", finding
    assert finding.source.endswith("table.fill_(0)"), finding


@pytest.mark.parametrize("variant", ["placeholder", "lazy table"])
def test_a_warmup_only_allocation_shaped_like_its_input_is_no_skipped_work(variant):
    """A collective that, in warmup outside the capture, returns ``torch.empty_like(x)`` (the
    allocation pattern of its out-of-place result, as a custom all-reduce does) and does its work
    only under capture: the warmup-only line reads no data, no finding. A table computed from the
    step's data in warmup only, and reused by the capture, is still skipped work."""
    def workload():
        x = torch.arange(4.0)
        table = {}
        events.static_buffers("runner", {"x": x})

        def collective(t):
            if not is_capturing():
                if variant == "placeholder":
                    return torch.empty_like(t)
                table.setdefault("scale", t.abs().amax())
                return t * table["scale"]
            return t * table["scale"] if variant == "lazy table" else t + 1.0
        step = lambda: collective(x * 2.0)  # noqa: E731
        with events.warmup():
            step()
        g = new_graph("cpu")
        with graph(g, name="step"):
            out = step()
        for i in range(2):
            x.copy_(torch.arange(4.0) + i)
            events.serve(g, 4, 4, outputs=out)
            g.replay()
    report = doctor.diagnose(workload)
    found = [f for f in report.findings if f.kind == "warmup-divergence"]
    assert bool(found) == (variant == "lazy table"), report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_capture_deferred_to_the_first_step_warms_up_on_the_live_state(variant):
    """A simulation that captures its step only when the first step comes (a renderer that defers
    the capture) announces its state then, already holding the force the workload staged for that
    step. The warmup runs a real step on that state: it uses the force up and moves the body, and
    the first replay runs the step again. Nothing wrote the state since its announcement, so it is
    not live data by that measure; but the workload wrote it before announcing it, and its results
    differ from its run without graphs: persistent-mutation at the warmup's write (the runner gives
    no eager form of its step, so differential replay does not see it). The fix saves the state
    before the warmup and puts it back before the capture."""
    def run(graphs: bool) -> list:
        pos, vel, force = torch.ones(2, 1), torch.zeros(2, 1), torch.zeros(2, 1)

        def step():
            vel.add_(force * 0.1 - 0.05)
            pos.add_(vel * 0.1)
            force.zero_()                                  # the staged force is used up
            return pos * 1.0

        g, out, results = None, None, []
        for n in range(3):
            force.fill_(1.0 + n)                           # staged for this step
            if not graphs:
                results.append(step())
                continue
            if g is None:                                  # the capture, deferred to the first step
                events.persistent_state("simulation", {"pos": pos, "vel": vel, "force": force})
                saved = [t.clone() for t in (pos, vel, force)]
                with events.warmup():
                    step()
                if variant == "fix":
                    for t, was in zip((pos, vel, force), saved):
                        t.copy_(was)
                g = new_graph("cpu")
                with graph(g, name="simulation step"):
                    out = step()
            events.serve(g, 2, 2, outputs=out)              # (no eager form: no differential replay)
            g.replay()
            results.append(out.clone())
        return results

    def workload():
        with events.reference():
            expected = run(graphs=False)
        got = run(graphs=True)
        events.results(expected, got)
        return expected, got

    found = finding_of(workload, variant)
    if variant == "bug":
        assert found.kind == "persistent-mutation" and "force.zero_()" in found.source, found
        assert "before announcing force" in found.evidence, found
