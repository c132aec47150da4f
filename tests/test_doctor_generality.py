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


def _by_a_running_worker(kernel, *args) -> None:
    """Work given to a thread that is already running (a persistent worker fed by a queue): the
    capture sees no hand-off."""
    import queue
    import threading
    todo, done = queue.Queue(), queue.Queue()
    worker = threading.Thread(target=lambda: done.put(todo.get()()), daemon=True)
    worker.start()                      # (before the work exists: it hands nothing on)
    todo.put(lambda: kernel(*args))
    done.get()


def _submitted(kernel, *args) -> None:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        pool.submit(kernel, *args).result()


def _outside_work(served, variant):
    """The doctor's report of ``served`` (the outside-work tests' step, on ``x`` of 1, 2 and 3),
    beside its eager results; None for the fix, which must equal them with no finding."""
    def eager():
        return [(torch.full((4, 3), v) * 3 + 1) @ (torch.eye(3) * 2) for v in (1.0, 2.0, 3.0)]

    outcome = []
    report = doctor.diagnose(lambda: outcome.append(compare("outside", variant, "cpu", served, eager)))
    assert outcome[0].verdict == ("misbehaves" if variant == "bug" else "equals eager")
    if variant == "fix":
        assert report.findings == []
        return None
    return report


@pytest.mark.parametrize("variant", ["bug", "fix"])
@pytest.mark.parametrize("outside", [_on_another_thread, _submitted, _by_a_running_worker])
def test_a_block_the_graph_allocates_and_only_outside_work_fills_is_named_where_that_work_was_launched(
        variant, outside):
    """The step allocates an output, fills it from work the capture does not record (another
    thread, as a kernel on the legacy default stream), and a captured op reads it: the launch traces
    agree, and the read of a block no op of the graph writes is named where the capture handed the
    block to that work: in the function that chose the kernel (``merge_into``), not in the helper
    that only forwards it to a thread. Work that reaches a thread already running, with no hand-off
    the capture sees, is named at the block's allocation."""
    def served():
        x, w = torch.zeros(4, 3), torch.eye(3) * 2

        def kernel(src, out):
            out.copy_(src + 1)

        def merge_into(src, out):
            if variant == "bug":
                outside(kernel, src, out)
            else:
                kernel(src, out)

        def merge(src):
            out = torch.empty_like(src)
            merge_into(src, out)
            return out

        return _replays(lambda: merge(x * 3) @ w, x)

    if (report := _outside_work(served, variant)) is None:
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.op == "aten.empty_like.default"
    assert "no op of the graph writes" in finding.cause
    launched = outside is not _by_a_running_worker
    assert function_of(finding.location) == ("merge_into" if launched else "merge")
    assert ("was handed to another thread (launched at" in finding.cause) == launched


@pytest.mark.parametrize("variant", ["bug", "fix"])
@pytest.mark.parametrize("outside", [_on_another_thread, _submitted])
def test_a_workspace_the_graph_does_not_own_that_only_handed_off_work_fills_is_named_where_it_was_launched(
        variant, outside):
    """As above, but the block is a cached workspace made before the capture (a kernel library's
    ``_get_cache_buf``), which the graph reads and does not own: the work handed to another thread
    during the capture wrote it (its version counter moved), no op of the graph writes it, and every
    replay reads what that one run wrote there. Named where the work was launched (``precompute``)."""
    def served():
        x, w, workspace = torch.zeros(4, 3), torch.eye(3) * 2, torch.zeros(4, 3)

        def kernel(src, out):
            out.copy_(src + 1)

        def precompute(src, out):
            if variant == "bug":
                outside(kernel, src, out)
            else:
                kernel(src, out)

        def step():
            precompute(x * 3, workspace)
            return workspace @ w

        return _replays(step, x)

    if (report := _outside_work(served, variant)) is None:
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and function_of(finding.location) == "precompute", report
    assert "memory it does not own" in finding.cause and "was handed to another thread" in finding.cause


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


def _padded_table_read_by_index(fill: int):
    """As ``_padded_table``, but the kernel indexes the cache with the table (a failure that names
    the index), and ``bias`` is announced as padded rows the runner leaves as they were."""
    cache = torch.arange(8.0)
    table, bias = torch.zeros(4, dtype=torch.int64), torch.zeros(4)

    def served():
        def kernel():
            return cache[table] * 2 + bias
        g = capture(kernel, device="cpu", warmups=1, name="decode 4", static={"block_table": table, "bias": bias})
        out = []
        for rows in ([1, 2, 3], [4, 5, 6]):
            table[:3].copy_(torch.tensor(rows))
            table[3:].fill_(fill)
            out.append(replay(*g, real=3, size=4, padded={"bias": bias})[:3].clone())
        return out

    def eager():
        return [cache[torch.tensor(rows)] * 2 for rows in ([1, 2, 3], [4, 5, 6])]

    return compare("table", "bug" if fill else "fix", "cpu", served, eager)


@pytest.mark.parametrize("fill", [8, 0])
def test_the_line_that_writes_failing_padded_rows_ranks_before_the_op_that_read_them(fill):
    """The watched run ties the failed lookup to the padded rows of the table it read; the padded-row
    runs then show that 0 written where the runner writes 8 makes the workload complete. Both are
    stale-padding, and the tested one, at the line that writes the pad value, comes first: it is
    what a fix changes. The reader's finding stays, after it."""
    report = doctor.diagnose(lambda: _padded_table_read_by_index(fill))
    if fill == 0:
        assert report.findings == [] and not report.errors
        return
    assert [(f.kind, function_of(f.location)) for f in report.findings] == [
        ("stale-padding", "served"), ("stale-padding", "kernel")], report.findings
    assert report.findings[0].op == "aten.fill_.Scalar" and "the workload completed" in report.findings[0].evidence


def _aliased_slot(pad_slot: int, announce: bool):
    """Three requests padded to a graph of 4. Each row writes its token's embedding (token + 1) at
    position ``length + accept - 1`` of its request's slot in a flat cache (slot * 8 + position) and
    reads back the sum of that slot's positions below ``length + accept``; lengths grow on the host
    by what real rows accepted. The runner writes the padded row itself (token 0, accept 1) and pads
    the slot column with ``pad_slot``: 0 is the live first request's slot, so the padded row writes
    the position the first request (accept 2) reads next to its own; 4 is a null slot no request
    has. Only ``bias`` is left as it was in padded rows, and only its own row reads it. The eager
    step of the same padded batch does the same, so only the run without padding differs."""
    width = 8

    def pad(live):
        return torch.cat([live, live.new_full((1,), pad_slot)])

    def served(graphed):
        cache, lengths = torch.zeros(5 * width), torch.tensor([2, 3, 1, 0, 0])
        slots, accept = torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64)
        token, bias = torch.zeros(4), torch.zeros(4)

        def step(n):
            pos = lengths.index_select(0, slots[:n]) + accept[:n]
            cache.index_put_((slots[:n] * width + pos - 1,), token[:n] + 1)
            seen = torch.arange(width).unsqueeze(0) < pos.unsqueeze(1)
            return (cache.view(5, width).index_select(0, slots[:n]) * seen).sum(1) + bias[:n]

        static = {"slots": slots, "accept": accept, "token": token, "bias": bias}
        g = capture(lambda: step(4), device="cpu", warmups=1, name="decode 4", static=static,
                    state={"cache": cache}) if graphed else None
        cache.zero_()
        out = []
        for i in range(2):
            live = torch.tensor([0, 1, 2])
            if graphed:
                slots.copy_(pad(live))
                accept[3:].fill_(1)
                token[3:].zero_()
            else:
                slots[:3].copy_(live)
            accept[:3].copy_(torch.tensor([2, 1, 1]))
            token[:3].copy_(torch.tensor([1.0, 2.0, 3.0]) * (i + 1))
            bias[:3].fill_(0.5 * i)
            out.append((replay(*g, real=3, size=4, padded={"bias": bias} if announce else None)[:3] if graphed
                        else step(3)).clone())
            lengths[live] += accept[:3]
        return out

    return compare("slot", "bug" if pad_slot == 0 else "fix", "cpu", lambda: served(True), lambda: served(False))


@pytest.mark.parametrize("announce", [True, False])
@pytest.mark.parametrize("pad_slot", [0, 4])
def test_a_pad_value_the_runner_writes_that_aliases_a_live_slot_is_stale_padding_where_it_is_made(pad_slot, announce):
    """Nothing fails and the eager run of the padded step agrees with the replay: only the run
    without graphs differs, at a padded replay. Neither fill of the padded rows the runner left
    changes anything (``bias``, announced or not); filling the slots the runner
    writes with 0 and with 1 does, so the pad value is named where it is made, in ``pad``, not at
    the copy that writes it. The null slot is no finding."""
    report = doctor.diagnose(lambda: _aliased_slot(pad_slot, announce))
    if pad_slot == 4:
        assert report.findings == [] and not report.unexplained, report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.tensor == "slots", finding
    assert function_of(finding.location) == "pad", finding.location
    assert "filled with 0 in one run and 1 in another" in finding.evidence


# ------------------------------------------------------------------------------ one buffer, two names
def _two_pieces(handed_on: bool):
    """A model compiled as two pieces, each graph's inputs named by their place (``piece.arg0``): both
    read the one ``positions`` buffer, which the runner fills once per step. Handed on (bug), the
    runner also fills it with the second piece's positions (shifted by 4) before the first piece
    replays, as a reuse pool that took it back after the first capture would."""
    def served(graphed):
        positions, table = torch.zeros(4, dtype=torch.int64), torch.arange(16.0)

        def first():
            return table[positions] * 2

        def second():
            return table[positions] + 1
        if graphed:
            g1 = capture(first, device="cpu", name="first", static={"first.arg0": positions})
            g2 = capture(second, device="cpu", name="second", static={"second.arg0": positions})
        out = []
        for step in range(3):
            positions.copy_(torch.arange(4) + step)
            if not graphed:
                out += [first().clone(), second().clone()]
                continue
            if handed_on:
                positions.copy_(torch.arange(4) + step + 4)
            a = replay(*g1).clone()
            positions.copy_(torch.arange(4) + step + (4 if handed_on else 0))
            out += [a, replay(*g2).clone() - (4 if handed_on else 0)]
        return out

    return compare("pieces", "bug" if handed_on else "fix", "cpu", lambda: served(True), lambda: served(False))


@pytest.mark.parametrize("handed_on", [False, True])
def test_one_buffer_two_graphs_name_alike_is_held_until_a_replay_differs(handed_on):
    """Announced again under another name while the first graph still reads it, the buffer is held as
    a dangling-reference: reported once the first graph's replay differs from the run without
    graphs (handed on), a note while every replay agrees (two pieces reading one buffer alike)."""
    report = doctor.diagnose(lambda: _two_pieces(handed_on))
    if not handed_on:
        assert report.findings == [], report
        assert any("held until a replay bore them out (dangling-reference" in n for n in report.notes), report
        return
    finding = report.findings[0]
    assert finding.kind == "dangling-reference" and finding.tensor.startswith("first.arg0"), finding
    assert "announced again as second.arg0" in finding.evidence


# ------------------------------------------------------------------------------ a task re-recorded each step
def _re_recorded(other_code: bool):
    """Three graphs in one pool, as a runner that updates one task of its graph each step: ``pre``
    makes ``attn`` in the pool, the task graph writes it (captured again each step, on the step's
    lengths), ``post`` reads it. With ``other_code`` a second graph, captured from other code, writes
    ``attn`` too, after the task and before ``post``: what ``post`` reads is no longer the task's."""
    from workbench.engine import graph_pool_handle

    def served(graphed):
        pool = graph_pool_handle("cpu") if graphed else None
        x, lens = torch.zeros(4), torch.zeros(4)

        def pre():
            return x * 2, torch.zeros(4)

        def task(attn):
            attn.copy_(torch.tanh(lens) + 1)

        def other(attn):
            attn.mul_(0.5)

        def post(h, attn):
            return h + attn
        out, tasks = [], []                 # (the runner keeps every task it recorded)
        if graphed:
            gp, (h, attn) = capture(pre, device="cpu", pool=pool, name="pre", static={"x": x})
            tasks.append(capture(lambda: task(attn), device="cpu", pool=pool, name="attention task",
                                 static={"lens": lens})[0])
            gq, res = capture(lambda: post(h, attn), device="cpu", pool=pool, name="post")
            go = capture(lambda: other(attn), device="cpu", pool=pool, name="other", warmups=0)[0]
        for step in range(3):
            x.fill_(step + 1.0)
            lens.fill_(0.5 * step)
            if not graphed:
                h, attn = pre()
                task(attn)
                out.append(post(h, attn).clone())
                continue
            replay(gp, (h, attn))
            if step:
                tasks.append(capture(lambda: task(attn), device="cpu", pool=pool, name="attention task",
                                     static={"lens": lens})[0])
            replay(tasks[-1], attn)
            if other_code:
                replay(go, attn)
            out.append(replay(gq, res).clone())
        return out

    return compare("task", "bug" if other_code else "fix", "cpu", lambda: served(True), lambda: served(False))


@pytest.mark.parametrize("other_code", [False, True])
def test_a_task_captured_again_each_step_is_the_producer_of_what_it_writes(other_code):
    """The task graph captured again each step writes the memory ``post`` read from the first
    task's capture: the same code captured again is the producer now, no overwritten output. A
    graph of other code writing it before ``post`` replays is ``overwritten-output``."""
    report = doctor.diagnose(lambda: _re_recorded(other_code))
    kinds = [f.kind for f in report.findings]
    assert ("overwritten-output" in kinds) == other_code, report


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


# ------------------------------------------------------------------------------ an output kept past the next replay
def _combine(scores):
    return torch.stack(scores)


def _scores_kept(clone: bool, handed_up: bool):
    """A decode loop keeps each step's logits (the graph's output) in ``scores``. Without a copy every
    kept entry is the graph's memory, which the next replay writes. ``handed_up``: the loop returns
    the list and its caller stacks it (the read is far from the keeping); else the loop stacks it
    itself, through a helper (the read is in the keeper's own flow)."""
    weight = torch.linspace(-1, 1, 16).reshape(4, 4)

    def step_of(x):
        return lambda: torch.tanh(x @ weight)

    def decode(forward, x):
        scores = []
        for _ in range(3):
            logits = forward(x)
            scores.append(logits.clone() if clone else logits)
            x.copy_(logits)
        return scores if handed_up else _combine(scores)

    def served():
        x = torch.linspace(0.1, 0.8, 8).reshape(2, 4)
        g, out = capture(step_of(x), device="cpu", name="decode 2", static={"x": x})
        kept = decode(lambda _: replay(g, out), x)
        return [torch.stack(kept) if handed_up else kept]

    def eager():
        x = torch.linspace(0.1, 0.8, 8).reshape(2, 4)
        kept = decode(lambda x: step_of(x)(), x)
        return [torch.stack(kept) if handed_up else kept]

    return compare("scores_kept", "fix" if clone else "bug", "cpu", served, eager)


@pytest.mark.parametrize("clone", [False, True])
@pytest.mark.parametrize("handed_up", [True, False])
def test_an_output_kept_past_the_replay_that_overwrote_it_is_named_where_it_was_kept(clone, handed_up):
    """Named in the function whose locals held the output when a replay wrote it (``decode``'s
    ``scores``), where a copy would have kept its values, once that function has returned and its
    caller reads what it handed up; the evidence says both. Where the keeper reads it itself, through
    a callee, the read is named (``_combine``)."""
    report = doctor.diagnose(lambda: _scores_kept(clone, handed_up))
    if clone:
        assert report.findings == [] and not report.errors
        return
    finding = next(f for f in report.findings if f.kind == "overwritten-output")
    assert finding.op == "aten.stack.default"
    if handed_up:
        assert function_of(finding.location) == "decode", finding
        assert "held at" in finding.evidence and "in served" in finding.evidence
    else:
        assert function_of(finding.location) == "_combine" and "held at" not in finding.evidence, finding


# ------------------------------------------------------------------------------ an indexed write whose sides disagree
def _cache_write(real: int):
    """A graph of 4 rows reads a cache; before a step the runner writes its new rows into the cache
    at locations laid out for the graph's 4 rows (``pad``: the real ones and a dummy), while the
    values are the real requests' only (3 of them). The cache holds every location it is given."""
    cache = torch.zeros(16, 2)
    loc = torch.zeros(4, dtype=torch.int64)

    def step():
        return cache.index_select(0, loc) * 2

    def served():
        g, out = capture(step, device="cpu", name="decode 4", static={"loc": loc}, state={"cache": cache})
        values = torch.ones(real, 2)
        loc.copy_(torch.tensor([1, 2, 3, 0]))
        cache[loc[:real] if real == 4 else loc] = values          # the fix writes the real rows' locations
        return [replay(g, out).clone()]

    def eager():
        cache.zero_()
        cache[torch.tensor([1, 2, 3, 0])[:real]] = torch.ones(real, 2)
        return [cache.index_select(0, torch.tensor([1, 2, 3, 0])) * 2]

    return compare("cache_write", "bug" if real < 4 else "fix", "cpu", served, eager)


def test_an_indexed_write_whose_values_have_fewer_rows_than_its_locations_is_no_undersized_buffer():
    """``cache[loc] = values`` with 4 locations (a graph's rows) and 3 values fails in torch ("value
    tensor of shape [3, 2] cannot be broadcast to indexing result of shape [4, 2]"): the cache
    holds every location, the two sides of the write disagree. ``padded-shape-mismatch`` at the
    write, the graph's rows against the real ones; never ``undersized-buffer`` of the cache."""
    report = doctor.diagnose(lambda: _cache_write(3))
    assert [(f.kind, f.graph, f.numbers) for f in report.findings] == [
        ("padded-shape-mismatch", "decode 4", {"size": 4, "real": 3})], report.findings
    assert "cache[loc[:real] if real == 4 else loc] = values" in report.findings[0].source
    assert doctor.diagnose(lambda: _cache_write(4)).findings == []
