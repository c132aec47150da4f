"""Mechanisms that keep the doctor's answers to what the evidence says: pool memory known by the
storage a capture made there, not by address alone; a warmup run on the step's own batch; an empty
capture; a runner's check that a step's inputs match the captured ones; a pre-replay update that
fills a captured task's table with values it chose wrongly."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench import doctor
from workbench.doctor.rules.pool import PoolReads, block
from workbench.engine import events, is_capturing
from workbench.engine.source import function_of
from workbench.zoo.kit import capture, compare, replay


# ------------------------------------------------------------------------------ pool memory
def test_an_address_a_capture_gave_out_holds_pool_memory_only_in_the_storage_it_made_there():
    """A storage made since at an address the pool had given back (``malloc`` reuses any freed
    address on the CPU) is eager memory: what captures wrote at that address is forgotten."""
    reads, t = PoolReads(), torch.zeros(4)
    b = block(t)
    reads.allocated[b] = StorageWeakRef(t.untyped_storage())
    reads.producer[b] = ("a capture", "an op", "a tensor")
    assert reads.pooled(t, b) and reads.pooled(t[1:], b)
    gone = torch.zeros(4)
    reads.allocated[b] = StorageWeakRef(gone.untyped_storage())
    del gone                               # the pool's storage is gone; ``t`` is another one
    assert not reads.pooled(t, b)
    assert b not in reads.allocated and b not in reads.producer


# ------------------------------------------------------------------------------ a warmup that is the step
def _lazy(variant: str):
    """Requests' states in rows of a persistent tensor; the graph of two rows is captured before serving
    (its dummy batch in the spare row 3), the graph of one row on its first step, after a warmup.
    ``fix``: that warmup runs the step itself and its result is served (a graph captured lazily);
    ``bug``: it runs a dummy batch that lands in a running request's row."""
    steps = (([0, 1], 1.0), ([0, 1], 2.0), ([0], 3.0))

    def served():
        state, outs = torch.zeros(4, 3), []
        slots, x = torch.full((2,), 3, dtype=torch.long), torch.zeros(2, 3)

        def forward(n):
            state.index_copy_(0, slots[:n], state.index_select(0, slots[:n]) + x[:n])
            return state.index_select(0, slots[:n]) * 1

        announced = {"static": {"slots": slots, "x": x}, "state": {"state": state}}
        graphs = {2: capture(lambda: forward(2), device="cpu", name="bs 2", **announced)}
        for rows, value in steps:
            n = len(rows)
            if n not in graphs:
                if variant == "fix":
                    slots[:n], x[:n] = torch.tensor(rows), value
                    with events.warmup():
                        outs.append(forward(n).clone())
                else:
                    slots[:n], x[:n] = 0, 9.0                  # a dummy batch, in row 0
                    with events.warmup():
                        forward(n)
                graphs[n] = capture(lambda n=n: forward(n), device="cpu", warmups=0, name=f"bs {n}", **announced)
                if variant == "fix":
                    continue
            slots[:n], x[:n] = torch.tensor(rows), value
            outs.append(replay(*graphs[n]).clone())
        return outs

    def eager():
        state, outs = torch.zeros(4, 3), []
        for rows, value in steps:
            idx = torch.tensor(rows)
            state.index_copy_(0, idx, state.index_select(0, idx) + value)
            outs.append(state.index_select(0, idx) * 1)
        return outs

    return compare("lazy", variant, "cpu", served, eager)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_warmup_on_the_steps_own_batch_writes_the_steps_rows(variant):
    """A warmup's write into rows of live state is held against the workload's results: where they
    agree with its run without graphs, the warmup ran the step itself (no finding, a note)."""
    outcome = []
    report = doctor.diagnose(lambda: outcome.append(_lazy(variant)))
    assert outcome[0].verdict == ("misbehaves" if variant == "bug" else "equals eager")
    if variant == "fix":
        assert report.findings == []
        assert any("the warmup ran the step itself" in n for n in report.notes)
        return
    finding = report.of("persistent-mutation")[0]
    assert "warmup" in finding.graph.split(", ")


# ------------------------------------------------------------------------------ work outside the capture
def _on_another_thread(kernel, *args) -> None:
    """A launch the capture does not record (another thread, as a kernel on another stream)."""
    import threading
    worker = threading.Thread(target=kernel, args=args)
    worker.start()
    worker.join()


def _replays(step, x) -> list:
    """``step`` captured on ``x``, then replayed for three values of ``x``."""
    g = capture(step, device="cpu", warmups=1, name="step", static={"x": x})
    results = []
    for v in (1.0, 2.0, 3.0):
        x.fill_(v)
        results.append(replay(*g).clone())
    return results


def test_a_capture_that_recorded_nothing_of_the_step_is_named():
    """While the capture runs, the step's work goes where the capture does not record (here another
    thread, as a stream of another device would): the graph is empty and its replays keep what the
    capture-time run left."""
    def served():
        x, out = torch.zeros(3), torch.zeros(3)

        def launch():
            out.copy_(x * 2 + 1)

        def step():
            if not is_capturing():
                launch()
            else:
                _on_another_thread(launch)
            return out

        return _replays(step, x)

    def eager():
        return [torch.full((3,), v) * 2 + 1 for v in (1.0, 2.0, 3.0)]

    report = doctor.diagnose(lambda: compare("empty", "bug", "cpu", served, eager))
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.op == "capture"
    assert function_of(finding.location) == "_replays" and "recorded no launch" in finding.cause   # the capture


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_block_the_graph_allocates_and_only_outside_work_fills_is_named_at_its_allocation(variant):
    """The step allocates an output, fills it from work the capture does not record (another
    thread, as a kernel on the legacy default stream), and a captured op reads it: the launch traces
    agree, and the read of a block no op of the graph writes names the allocation."""
    def served():
        x, w = torch.zeros(4, 3), torch.eye(3) * 2

        def kernel(src, out):
            out.copy_(src + 1)

        def merge(src):
            out = torch.empty_like(src)
            if variant == "bug":
                _on_another_thread(kernel, src, out)
            else:
                kernel(src, out)
            return out

        return _replays(lambda: merge(x * 3) @ w, x)

    def eager():
        return [(torch.full((4, 3), v) * 3 + 1) @ (torch.eye(3) * 2) for v in (1.0, 2.0, 3.0)]

    outcome = []
    report = doctor.diagnose(lambda: outcome.append(compare("outside", variant, "cpu", served, eager)))
    assert outcome[0].verdict == ("misbehaves" if variant == "bug" else "equals eager")
    if variant == "fix":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.op == "aten.empty_like.default"
    assert function_of(finding.location) == "merge" and "no op of the graph writes" in finding.cause


# ------------------------------------------------------------------------------ a runner's input check
@dataclasses.dataclass
class Packed:
    cu_seqlens: torch.Tensor


def make_batch(n):
    return {"packed": Packed(torch.arange(n, dtype=torch.float32) * 1)}


class Runner:
    def __init__(self):
        self.graph = None

    def matches(self, kwargs):
        return kwargs["packed"].cu_seqlens.shape == self.captured["packed"].cu_seqlens.shape

    def __call__(self, kwargs):
        if self.graph is None:
            self.captured = {"packed": Packed(torch.zeros_like(kwargs["packed"].cu_seqlens))}
            buf = self.captured["packed"].cu_seqlens
            self.graph = capture(lambda: buf.cumsum(0), device="cpu", warmups=1, name="layer",
                                 static={"packed.cu_seqlens": buf})
        assert self.matches(kwargs), "replaying a graph with other arguments than it was captured with"
        self.captured["packed"].cu_seqlens.copy_(kwargs["packed"].cu_seqlens)
        return replay(*self.graph).clone()


def test_a_runners_check_that_a_step_matches_its_capture_names_the_step_tensor_that_does_not_fit():
    def served():
        runner = Runner()
        return [runner(make_batch(n)) for n in (4, 4, 6)]

    def eager():
        return [(torch.arange(n, dtype=torch.float32) * 1).cumsum(0) for n in (4, 4, 6)]

    report = doctor.diagnose(lambda: compare("match", "bug", "cpu", served, eager))
    finding = report.of("undersized-buffer")[0]
    assert finding.tensor.startswith("packed.cu_seqlens") and "(6,)" in finding.evidence
    assert function_of(finding.location) == "__call__" and "made by" in finding.evidence, finding.location


# ------------------------------------------------------------------------------ a stale eager form
def _stale_closure():
    """A block captured inside the step that first runs it; the closure's cell is rebound when that
    step goes on (to the step's result, which the workload keeps), so the captured callable, the
    step's announced eager form, later writes into that result."""
    values = (1.0, 2.0, 3.0, 4.0)

    def served():
        buf, kept, graphs = torch.zeros(2), [], {}

        def step(v):
            x = buf

            def core():
                x.copy_(x * 2 + 1)
                return x

            if "block" not in graphs:
                graphs["block"] = capture(core, device="cpu", warmups=1, name="block", static={"x": buf})
            buf.fill_(v)
            replay(*graphs["block"])
            x = x * 3                                   # the cell now holds the step's result
            kept.append(x)

        for v in values:
            step(v)
        return kept

    def eager():
        return [(torch.full((2,), v) * 2 + 1) * 3 for v in values]

    return compare("stale", "fix", "cpu", served, eager)


def test_an_eager_form_gone_stale_writes_nothing_the_workload_keeps():
    """Differential replay runs the announced eager form; what it writes outside the kept state is put
    back. The second compared replay is watched too: the first was the capture's own batch, before
    the capturing function returned and its closure's cell was rebound."""
    assert _stale_closure().verdict == "equals eager"
    outcome = []
    report = doctor.diagnose(lambda: outcome.append(_stale_closure()))
    assert outcome[0].verdict == "equals eager", outcome[0].summary()
    assert report.findings == []


# ------------------------------------------------------------------------------ a generation reset together
def test_graphs_reset_together_are_not_checked_for_what_they_would_read():
    """A graph cache that drops a whole generation of graphs (round 67's ``vllmomni_6587`` fix): a
    reset graph replays no more, so what it would read is no hazard, whether or not the collector
    has freed the workspace its pool owned. Before, the answer on that fix depended on where earlier
    allocations had left the heap (a finding on about one heap in four); each heap here is seeded."""
    import random

    from workbench.zoo import trials

    name = "round67/vllmomni_6587_cfm_graph_lru_evicts_owner_of_shared_cublas_workspace"
    for seed in range(12):
        rng = random.Random(seed)
        held = [torch.empty(rng.randint(1, 5000)) for _ in range(rng.randint(1, 200))][::rng.randint(1, 4)]
        assert trials.doctor_of(name, "fix")["kind"] is None, seed
        del held


# ------------------------------------------------------------------------------ graphs let go of, but one
class Sessions:
    """Two graphs bound at capture to the active session's state; switching sessions drops the
    decode graph (``keep_prefill``: and keeps the prefill graph, which goes on advancing the old
    session's state)."""

    def __init__(self, keep_prefill: bool):
        self.keep_prefill, self.state, self.graphs = keep_prefill, torch.zeros(2), {}
        self.x, self.sessions = torch.zeros(2), [self.state]     # (a session's state outlives the switch)

    def switch(self):
        self.state = torch.zeros(2)
        self.sessions.append(self.state)
        self.graphs.pop("decode", None)
        if not self.keep_prefill:
            self.graphs.pop("prefill", None)

    def step(self, kind, v):
        def body():
            s = self.state
            s.mul_(0.5).add_(self.x)
            return s * 2
        if kind not in self.graphs:
            self.graphs[kind] = capture(body, device="cpu", warmups=0, name=kind, static={"x": self.x},
                                        state={"state": self.state})
        self.x.fill_(v)
        return replay(*self.graphs[kind]).clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_kept_where_the_program_drops_the_graphs_bound_to_a_rebound_tensor(variant):
    """A graph replays a tensor frozen at capture while the eager step reads a newer one: where the
    program let go of another graph bound to the same tensor, after this one was captured, is where
    it drops such graphs (and kept this one): the finding is named there."""
    plan = [("prefill", 1.0), ("decode", 2.0), "switch", ("prefill", 3.0), ("decode", 4.0), ("prefill", 5.0)]

    def serve(graphed):
        s = Sessions(keep_prefill=variant == "bug")
        out = []
        for item in plan:
            if item == "switch":
                s.switch()
            elif graphed:
                out.append(s.step(*item))
            else:
                s.x.fill_(item[1])
                s.state.mul_(0.5).add_(s.x)
                out.append(s.state * 2)
        return out

    result = []
    report = doctor.diagnose(lambda: result.append(compare("sessions", variant, "cpu", lambda: serve(True),
                                                           lambda: serve(False))))
    assert result[0].verdict == ("misbehaves" if variant == "bug" else "equals eager")
    if variant == "fix":
        assert report.findings == []
        return
    finding = report.findings[0]
    assert finding.kind == "warmup-divergence" and function_of(finding.location) == "switch", finding
    assert "let go of decode" in finding.cause + finding.evidence


# ------------------------------------------------------------------------------ what the runner writes in padded rows
def _padded_table(fill: int):
    """A runner pads 3 requests to its graph of 4 and writes ``fill`` into the padded block-table row;
    the captured kernel loads a page for every row (a null page is valid, -1 is not)."""
    cache = torch.arange(8.0)
    table = torch.zeros(4, dtype=torch.int64)

    def served():
        def kernel():
            return cache.index_select(0, table) * 2
        g = capture(kernel, device="cpu", warmups=1, name="decode 4", static={"block_table": table})
        out = []
        for rows in ([1, 2, 3], [4, 5, 6]):
            table[:3].copy_(torch.tensor(rows))
            table[3:].fill_(fill)
            out.append(replay(*g, real=3, size=4)[:3].clone())
        return out

    def eager():
        return [cache[torch.tensor(rows)] * 2 for rows in ([1, 2, 3], [4, 5, 6])]

    return compare("table", "bug" if fill < 0 else "fix", "cpu", served, eager)


@pytest.mark.parametrize("fill", [-1, 0])
def test_a_step_that_fails_on_what_the_runner_writes_into_padded_rows_is_stale_padding(fill):
    """No padded rows are announced as left as they were (the runner writes them): both fills of
    those leave the failure as it is. Filling the padded rows of the static inputs too makes the
    run complete, so the value the runner writes is named, at the line that writes it."""
    report = doctor.diagnose(lambda: _padded_table(fill))
    if fill == 0:
        assert report.findings == [] and not report.errors
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.tensor == "block_table", finding
    assert function_of(finding.location) == "served" and finding.op == "aten.fill_.Scalar", finding.location


# ------------------------------------------------------------------------------ a cache the graph only reads
class LazyCache:
    """``-exp(a)`` kept in a buffer, refilled in Python when a flag says it is stale (a warmup refills
    it, so the capture records only its read); a parameter update marks it stale."""

    def __init__(self):
        self.a, self.cache, self.stale = torch.ones(4), torch.zeros(4), True

    def neg_exp(self):
        if self.stale:
            self.cache.copy_(-torch.exp(self.a))
            self.stale = False
        return self.cache


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_eager_step_that_refills_a_tensor_the_graph_only_reads_leaves_no_write_behind(variant):
    """The unwatched eager run of a sampled step refills the cache: kept and put back like state the
    graph writes, so the doctor does not change the workload's results (it had: the refill stayed,
    and every replay after it read the fresh cache); and the refill the replays skip is found."""
    def serve(graphed):
        m, x, out = LazyCache(), torch.zeros(4), []
        step = lambda: x * m.neg_exp()                        # noqa: E731
        g = capture(step, device="cpu", warmups=1, name="decode", static={"x": x}) if graphed else None
        for i in range(6):
            if i == 3:
                m.a.add_(0.5)
                m.stale = True
                if variant == "fix" and graphed:
                    m.neg_exp()                           # refreshed in place, outside the graph
            x.fill_(i + 1.0)
            out.append((replay(*g) if graphed else step()).clone())
        return out

    alone, watched = serve(True), []
    report = doctor.diagnose(lambda: watched.append(compare("cache", variant, "cpu", lambda: serve(True),
                                                            lambda: serve(False))), differential=1)
    assert watched[0].verdict == ("misbehaves" if variant == "bug" else "equals eager"), watched[0].summary()
    kept = []
    doctor.diagnose(lambda: kept.extend(serve(True)), differential=1)
    assert all(torch.equal(a, b) for a, b in zip(alone, kept, strict=True))      # the same results, watched
    if variant == "fix":
        assert report.findings == []
        return
    assert any(f.kind == "warmup-divergence" and function_of(f.location) == "neg_exp" for f in report.findings), report


def test_one_byte_floats_are_compared_as_floats():
    from workbench.doctor.tensors import changed, differs

    a = torch.tensor([1.0, 2.0, 448.0]).to(torch.float8_e4m3fn)
    b = torch.tensor([1.0, 3.0, 448.0]).to(torch.float8_e4m3fn)
    assert differs(a, b).tolist() == [False, True, False] and changed(a, a).sum() == 0


# ------------------------------------------------------------------------------ a pre-replay update that pairs by position
def _task_update(variant: str, sliced: bool = False):
    """Each layer's attention is captured as a task whose table a pre-replay ``update`` rewrites, and
    the eager path reads each layer's own table. ``bug``: ``update`` pairs the captured tasks with the
    metadata by position, and the metadata lists its layers by group, not in layer order."""
    cache = torch.arange(16.0).view(8, 2)
    # (the first layer is first in both orders: its task agrees with the step, which ties the replay to it)
    layers, by_group = ("l0", "l1", "l2"), ("l0", "l2", "l1")

    class Task:
        def __init__(self):
            self.table = torch.zeros(2, dtype=torch.long)

        def rebind(self, table):
            self.table.copy_(table[:2] if sliced else table)      # (a view of what it is handed, or it)

    class Model:
        def __init__(self):
            self.tasks = [Task() for _ in layers]

        def forward(self, tables):
            h = torch.ones(2)
            for name, task in zip(layers, self.tasks):
                h = h * 0.5 + cache.index_select(0, task.table if is_capturing() else tables[name]).sum(1)
            return h

    def tables_at(step):
        return {"l0": torch.tensor([step % 4, 1]), "l1": torch.tensor([4 + step % 3, 5]), "l2": torch.tensor([7, step])}

    def served():
        model, current = Model(), tables_at(0)
        g = capture(lambda: model.forward(current), device="cpu", name="decode",
                    static={f"task{i}.table": t.table for i, t in enumerate(model.tasks)})

        def update(tables):
            for name, task in zip(by_group if variant == "bug" else layers, model.tasks):
                task.rebind(tables[name])
        out = []
        for step in range(1, 4):
            current.update(tables_at(step))
            update(current)
            out.append(replay(*g).clone())
        return out

    def eager():
        model = Model()
        return [model.forward(tables_at(step)) for step in range(1, 4)]

    return compare("task update", variant, "cpu", served, eager)


@pytest.mark.parametrize("variant,sliced", [("bug", False), ("bug", True), ("fix", False)])
def test_a_task_table_an_update_fills_with_another_layers_values_is_named_where_the_update_chose_them(variant, sliced):
    """The replay differs from the same step of the run without graphs, a static input it reads holds
    another layer's table, and the copy that wrote it copies what it is given: the finding stands
    where those values were chosen (``update``), not at the copy, nor at the branch between the
    capture path and the eager path, where differential replay parts."""
    result = []
    report = doctor.diagnose(lambda: result.append(_task_update(variant, sliced)))
    assert result[0].verdict == ("misbehaves" if variant == "bug" else "equals eager")
    if variant == "fix":
        assert report.findings == [], report
        return
    [finding] = report.findings
    assert finding.kind == "warmup-divergence" and function_of(finding.location) == "update", finding
    assert "with values chosen at" in finding.evidence and "task" in finding.tensor
