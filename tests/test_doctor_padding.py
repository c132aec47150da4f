"""The doctor's padded-row mechanisms, each on small runners of its own (bug and fix idioms).

* fills after each step that a runner's round trip carries into the next replay;
* the scatter-index contract: a padded row never names a real row's state slot;
* padded-shape-mismatch: eager code after a padded replay fails on padded and real rows.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_doctor_setup_and_warmups import finding_of, only_finding
from workbench import doctor
from workbench.doctor import padding_record
from workbench.engine import events, graph, new_graph
from workbench.engine.source import function_of

def captured(forward, static, *, name="size 4"):
    """A graph of ``forward`` (a warmup, then the capture) over announced static buffers."""
    events.static_buffers("Runner", static)
    with torch.no_grad():
        with events.warmup():
            forward()
        g = new_graph("cpu")
        with graph(g, name=name):
            out = forward()
    return g, out


def replay(g, out, real, size, padded):
    events.serve(g, real, size, padded=padded, outputs=out)
    g.replay()
    events.handed_out(g, out)
    return out


# ------------------------------------------------------------------ fills carried by a round trip
class Planner:
    """A plan of work items written into a device workspace through a host round trip: entries
    past the planned count keep what the workspace held (``bug``), are masked (``mask``), or are
    given a null item (``null``)."""

    def __init__(self, idiom):
        self.idiom = idiom
        self.table = torch.arange(12.0).reshape(6, 2)
        self.items = torch.zeros(6, dtype=torch.int64)
        self.valid = torch.ones(6)

    def forward(self):
        return (self.table[self.items] * self.valid[:, None]).sum(0, keepdim=True)

    def plan(self, items):
        host = self.items.cpu().clone()               # the workspace as left, through the host
        host[:len(items)] = torch.tensor(items)
        if self.idiom == "null":
            host[len(items):] = 5                     # row 5 of the table is all the null items read
        self.items.copy_(host)
        if self.idiom == "mask":
            self.valid.zero_()
            self.valid[:len(items)] = 1.0
        if self.idiom == "null":
            self.table[5] = 0.0


@pytest.mark.parametrize("idiom", ["bug", "mask", "null"])
def test_padded_rows_refilled_with_what_they_held_before_are_stale_padding(idiom):
    def workload():
        p = Planner(idiom)
        g, out = captured(p.forward, {"items": p.items, "valid": p.valid})
        for items in ([1, 2, 3, 4, 0, 1], [2, 3, 4]):
            p.plan(items)
            replay(g, out, len(items), 6, {"items": p.items})
    report = doctor.diagnose(workload)
    if idiom != "bug":
        assert report.findings == [] and report.errors == []
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.op == "aten.index.Tensor"
    assert finding.location.endswith("in forward") and "replay 2" in finding.evidence


class Mirrored:
    """Work items kept in a persistent host mirror, copied whole into the device buffer every
    step: entries past the plan keep the previous plan's items (``bug``) or the null item."""

    def __init__(self, variant):
        self.variant = variant
        self.table = torch.cat([torch.arange(10.0).reshape(5, 2), torch.zeros(1, 2)])
        self.host = torch.zeros(6, dtype=torch.int64)
        self.items = torch.zeros(6, dtype=torch.int64)

    def forward(self):
        return self.table[self.items].sum(0, keepdim=True)

    def plan(self, items):
        self.host[:len(items)] = torch.as_tensor(items)
        if self.variant == "fix":
            self.host[len(items):] = 5
        self.items.copy_(self.host)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_padded_rows_copied_from_a_persistent_host_mirror(variant):
    data = torch.tensor([1, 2, 3, 4, 0, 1])            # shared by the three runs: put back after each fill

    def workload():
        p = Mirrored(variant)
        g, out = captured(p.forward, {"items": p.items})
        for n in (6, 3, 3):
            p.plan(data[:n])
            replay(g, out, n, 6, {"items": p.items})
    report = doctor.diagnose(workload)
    assert [f.kind for f in report.findings] == (["stale-padding"] if variant == "bug" else [])
    assert torch.equal(data, torch.tensor([1, 2, 3, 4, 0, 1]))


class BlockTable:
    """Block ids per request, rebuilt through the host each step; the graph sums what every
    column's block holds, so padded columns must name the null block 0."""

    def __init__(self, variant):
        self.variant = variant
        self.blocks = torch.cat([torch.zeros(1, 2), torch.arange(1.0, 11.0).reshape(5, 2)])
        self.table = torch.zeros(2, 4, dtype=torch.int64)

    def forward(self):
        return self.blocks[self.table].sum(1)

    def plan(self, rows):
        host = self.table.cpu().clone()
        width = len(rows[0])
        host[:, :width] = torch.tensor(rows)
        if self.variant == "fix":
            host[:, width:] = 0
        self.table.copy_(host)
        return width


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_padded_columns_refilled_with_what_they_held_before(variant):
    def workload():
        p = BlockTable(variant)
        g, out = captured(p.forward, {"table": p.table})
        for rows in ([[1, 2, 3, 4], [5, 4, 3, 2]], [[2, 1], [3, 5]]):
            width = p.plan(rows)
            events.serve(g, 2, 2, outputs=out, padded_columns={"table": (p.table, width)})
            g.replay()
            events.handed_out(g, out)
    report = doctor.diagnose(workload)
    assert [(f.kind, f.op) for f in report.findings] == ([("stale-padding", "aten.index.Tensor")]
                                                          if variant == "bug" else [])


class Positions:
    """Real rows advanced in place between steps (continuing requests), padded rows reset or not;
    every output row sums over the batch, so it reads the padded rows."""

    def __init__(self, reset):
        self.reset = reset
        self.rope = torch.arange(20.0).reshape(10, 2)
        self.positions = torch.zeros(4, dtype=torch.int64)

    def forward(self):
        rows = self.rope[self.positions]
        return rows + rows.sum(0)

    def step(self, n):
        self.positions[:n] += 1                        # the real rows: the previous step's values, updated
        if self.reset:
            self.positions[n:].zero_()


@pytest.mark.parametrize("reset", [False, True])
def test_real_rows_updated_in_place_are_not_touched_by_the_fills(reset):
    """The fills reach only the next step's padded rows: real rows a runner keeps or updates in
    place stay as in the run without the doctor; padded rows never reset remain the finding."""
    def workload():
        p = Positions(reset)
        g, out = captured(p.forward, {"positions": p.positions})
        for n in (4, 3, 3, 2):
            p.step(n)
            replay(g, out, n, 4, {"positions": p.positions})
    report = doctor.diagnose(workload)
    assert [f.kind for f in report.findings] == ([] if reset else ["stale-padding"])


def test_two_runners_stepping_in_turn_with_one_name_for_their_buffers():
    """Two data-parallel ranks, each with its own ``x`` announced under one name and two pieces per
    step (a collective between them makes them take turns). The fills for the next ``serve`` go to
    that serve's buffer, not to the other rank's of the same name; and the first piece, which does
    not write the output announced for every piece, is not compared on it. Rows are independent:
    no finding."""
    def workload():
        ranks = []
        for rank in range(2):
            x, mid, h = torch.zeros(8, 2), torch.zeros(8, 2), torch.zeros(8, 2)
            events.static_buffers(f"rank {rank}", {"x": x})
            pieces = []
            for i, piece in enumerate((lambda x=x, mid=mid: mid.copy_(x * 2),
                                       lambda x=x, mid=mid, h=h: h.copy_(mid + x))):
                with events.warmup():
                    piece()
                g = new_graph("cpu")
                with graph(g, name=f"rank {rank} piece {i}"):
                    piece()
                pieces.append(g)
            ranks.append((x, h, pieces, mid))
        for step, reals in enumerate(((6, 3), (7, 8), (5, 2))):
            for (x, *_), real in zip(ranks, reals):
                x[:real].copy_(torch.arange(real * 2.0).reshape(real, 2) + step)
            for i in range(2):
                for (x, h, pieces, _), real in zip(ranks, reals):
                    replay(pieces[i], h, real, 8, {"x": x})
    report = doctor.diagnose(workload)
    assert report.findings == [], report


def test_host_bookkeeping_arrays_and_a_recapture_between_steps_are_left_alone():
    """NumPy arrays named at serve (requests' counters the runner moves between rows) are not
    filled after a step, nor is anything before a step preceded by a capture."""
    def workload():
        x, counters = torch.zeros(4, 2), np.zeros(4, dtype=np.int64)
        g, out = captured(lambda: x * 2, {"x": x})
        for step, n in enumerate((4, 3, 3)):
            if step == 1:
                counters[n - 1] = counters[n]           # the last request moves into the finished one's row
            counters[:n] += 1
            x[:n] = torch.full((n, 2), float(counters[:n].sum()))
            x[n:] = 0
            if step == 2:
                g, out = captured(lambda: x * 2, {"x": x})   # re-captured after a weight update
            replay(g, out, n, 4, {"x": x, "counters": counters})
    report = doctor.diagnose(workload)
    assert report.findings == [] and report.errors == []


# ------------------------------------------------------------------ the scatter-index contract
def state_update(form):
    def update(state, index, x):
        if form == "index_add_":
            state.index_add_(0, index, x)
        elif form == "index_put_":
            state[index] = state[index] * 0.5 + x
        else:
            state.scatter_add_(0, index[:, None].expand_as(x), x)
        return state[index] * 1
    return update


@pytest.mark.parametrize("form, padding", [(form, padding) for form in ("index_add_", "index_put_", "scatter_add_")
                                           for padding in ("a real slot", "the null slot")]
                         + [("index_put_", "slot -1")])
def test_a_padded_row_naming_a_real_rows_state_slot(form, padding):
    """Slots 0..3 hold requests, slot 4 is the null slot (-1 addresses it as well, where the op
    takes negative indices). The requests go on to a second step, where they read their slots."""
    state = torch.zeros(5, 3)
    index = torch.zeros(4, dtype=torch.int64)
    x = torch.zeros(4, 3)
    update = state_update(form)
    with doctor.watch() as report:
        g, out = captured(lambda: update(state, index, x), {"index": index, "x": x})
        events.persistent_state("Runner", {"state": state})
        index[:3] = torch.tensor([2, 0, 1])
        index[3] = {"a real slot": 0, "the null slot": 4, "slot -1": -1}[padding]
        x.copy_(torch.ones(4, 3))
        replay(g, out, 3, 4, {})                       # the runner wrote every padded row itself
        assert report.findings == []                   # (nobody has read slot 0 since)
        index[3] = 4
        replay(g, out, 3, 4, {})
    if padding != "a real slot":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.op.startswith(f"aten.{form}")
    assert finding.location.endswith("in test_a_padded_row_naming_a_real_rows_state_slot"), finding.location
    assert "aimed the padded row there" in finding.evidence and finding.tensor == "index: int64[4]"
    assert finding.numbers == {"replay": 1, "real": 3, "size": 4, "padded_row": 3, "real_row": 1,
                               "slot": (0, 0) if form == "scatter_add_" else 0}   # scatter: an element


def aim_padded_row(index):
    index[3] = 0


@pytest.mark.parametrize("aimed", [True, False])
def test_a_padded_rows_slot_is_named_where_the_step_aimed_it_else_at_the_scatter(aimed):
    """Step 1 serves four requests; in step 2 the fourth has finished and its row is padded: the
    runner either aims it at slot 0 (``aim_padded_row``), a live request's, or leaves it naming the
    finished request's slot 3, which a request of step 3 takes over. The finding is where the
    padded row's slot was decided: the step's write, or else the scatter that used what was left."""
    state, index, x = torch.zeros(5, 3), torch.zeros(4, dtype=torch.int64), torch.ones(4, 3)
    update = state_update("index_add_")
    with doctor.watch() as report:
        g, out = captured(lambda: update(state, index, x), {"index": index, "x": x})
        events.persistent_state("Runner", {"state": state})
        index.copy_(torch.tensor([2, 0, 1, 3]))
        replay(g, out, 4, 4, {})
        index[:3] = torch.tensor([2, 0, 1])
        if aimed:
            aim_padded_row(index)
        replay(g, out, 3, 4, {})
        index.copy_(torch.tensor([2, 0, 3, 4]))
        replay(g, out, 3, 4, {})
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.numbers["slot"] == (0 if aimed else 3)
    assert function_of(finding.location) == ("aim_padded_row" if aimed else "update"), finding.location


def test_a_dummy_batch_whose_real_row_writes_the_null_slot_is_no_finding():
    """An idle rank's dummy batch is served with one row counted as real, and every row of it names
    the null slot (4): the padded rows share that slot with the real row, but no request lives in it,
    and the next steps' requests never name it."""
    state = torch.zeros(5, 3)
    index = torch.zeros(4, dtype=torch.int64)
    x = torch.ones(4, 3)
    update = state_update("index_add_")
    with doctor.watch() as report:
        g, out = captured(lambda: update(state, index, x), {"index": index, "x": x})
        events.persistent_state("Runner", {"state": state})
        for real, slots in ((3, [2, 0, 1, 4]), (1, [4, 4, 4, 4]), (3, [2, 0, 1, 4]), (4, [2, 0, 1, 3])):
            index.copy_(torch.tensor(slots))
            replay(g, out, real, 4, {})
    assert report.findings == [], report


def test_a_shared_slot_is_reported_when_its_request_goes_on_though_an_earlier_one_did_not():
    """Step 1's padded row shares slot 3 with a request that then finishes; step 2's shares slot 0 with
    one that goes on to step 3: each shared slot waits for its own request, and the second is found."""
    state = torch.zeros(5, 3)
    index = torch.zeros(4, dtype=torch.int64)
    x = torch.ones(4, 3)
    update = state_update("index_add_")
    with doctor.watch() as report:
        g, out = captured(lambda: update(state, index, x), {"index": index, "x": x})
        events.persistent_state("Runner", {"state": state})
        for real, slots in ((3, [3, 1, 2, 3]), (3, [0, 1, 2, 0]), (3, [0, 1, 2, 4])):
            index.copy_(torch.tensor(slots))
            replay(g, out, real, 4, {})
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.numbers["slot"] == 0 and finding.numbers["replay"] == 2


def test_indices_computed_inside_the_graph_and_scatters_into_its_own_tensors_are_not_checked():
    """Only indices read from memory the graph does not own have values before a replay, and only
    writes into memory it does not own are state: neither case gives a finding here."""
    state = torch.zeros(4, 3)
    slots = torch.zeros(4, dtype=torch.int64)

    def forward():
        state.index_add_(0, slots % 2, torch.ones(4, 3))         # index computed in the graph
        return torch.zeros(4, 3).index_add_(0, slots, torch.ones(4, 3))   # the graph's own tensor

    with doctor.watch() as report:
        g, out = captured(forward, {"slots": slots})
        slots.copy_(torch.tensor([0, 1, 2, 0]))
        replay(g, out, 3, 4, {})
    assert report.findings == []


# ------------------------------------------------------------------ padded-shape-mismatch
class Mixer:
    """A graph's 4 padded rows meet per-request tensors of 3 rows in eager code after it."""

    def __init__(self):
        self.h = torch.zeros(4, 2)
        self.g, self.out = captured(lambda: self.h * 2, {"h": self.h})
        self.lengths = torch.tensor([3.0, 1.0, 2.0])

    def step(self):
        self.h[:3] = 1.0
        return replay(self.g, self.out, 3, 4, {"h": self.h})


def asserted(out, lengths):
    assert out.shape[0] == lengths.shape[0], "one length per row"
    return out / lengths[:, None]


def broadcast(out, lengths):
    return out / lengths[:, None]


def indexed(out, lengths):
    return lengths[torch.arange(out.shape[0])]


def listed(out, lengths):
    per_request = lengths.tolist()                     # a host list: one entry per real request
    del lengths
    assert len(out) == len(per_request), "one entry per row"


class Planned:
    """A kernel wrapper planned on the host from the real requests' lengths (an indptr as a list),
    that checks the rows it is given against its plan."""

    def __init__(self, lengths):
        self.indptr = [0, *torch.cumsum(lengths, 0).long().tolist()]

    def run(self, q):
        if q.shape[0] != len(self.indptr) - 1:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match the plan's {len(self.indptr) - 1} rows")
        return q


def planned(out, lengths):
    return Planned(lengths).run(out)


def planned_here(out, lengths):
    indptr = [0, *torch.cumsum(lengths, 0).long().tolist()]
    del lengths
    q = out * 2                                        # derived here: what is checked is this function's choice
    if q.shape[0] != len(indptr) - 1:
        raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match the plan's {len(indptr) - 1} rows")
    return q


def derived_then_asserted(out, lengths):
    scaled = out * 2                                   # derived eagerly: still the graph's 4 rows
    return asserted(scaled, lengths)


@pytest.mark.parametrize("combine, error, line", [
    (asserted, AssertionError, "assert out.shape[0] == lengths.shape[0]"),
    (broadcast, RuntimeError, "return out / lengths[:, None]"),
    (indexed, IndexError, "return lengths[torch.arange(out.shape[0])]"),
    (derived_then_asserted, AssertionError, "assert out.shape[0] == lengths.shape[0]"),
    (listed, AssertionError, "assert len(out) == len(per_request)"),
    (planned, ValueError, "return Planned(lengths).run(out)"),
    (planned_here, ValueError, "raise ValueError(f\"q.shape[0] ({q.shape[0]}) does not match"),
])
def test_eager_code_failing_on_padded_and_real_rows_is_padded_shape_mismatch(combine, error, line):
    """The site is the line that met the two: where a kernel's check refuses what it was handed (its
    message states both counts: ``planned``), the line that handed the padded rows to it."""
    with pytest.raises(error), doctor.watch() as report:
        m = Mixer()
        combine(m.step(), m.lengths)
    assert report.headline().startswith(f"Graph doctor: the workload failed: {error.__name__}")
    (finding,) = report.findings
    assert finding.kind == "padded-shape-mismatch" and finding.graph == "size 4"
    assert finding.source.split(": ", 1)[1].startswith(line)
    assert finding.numbers == {"replay": 1, "real": 3, "size": 4}
    assert "(3 real rows)" in finding.tensor and "(the graph's 4 rows)" in finding.tensor
    assert "its outputs have 4 rows" in finding.cause and "built for the 3 real rows" in finding.cause


def launch(query, cu_lengths):
    """A kernel launcher's host check (TND layout): the query's tokens end where the lengths do."""
    if query.shape[0] != cu_lengths[-1]:
        raise RuntimeError(f"tiling failed: queryT ({query.shape[0]}) != last length ({cu_lengths[-1]})")


def update_params(query, cu_lengths):
    """Before a replay: the captured task is launched again with this step's metadata."""
    launch(query, cu_lengths)


@pytest.mark.parametrize("tokens, last, found", [(4, 3, True), (4, 4, None), (5, 6, False)])
def test_a_count_check_failing_on_a_graphs_size_and_the_real_count_before_its_replay(tokens, last, found):
    """Before a padded replay, the launcher is given the graph's padded query (4 tokens) and lengths
    that stop at the real requests (3): ``padded-shape-mismatch`` at the check. Lengths padded to
    the graph's size do not fail; counts of which neither is a graph's size are no padding."""
    q = torch.zeros(4, 2)

    def workload():
        captured(lambda: q * 2, {"q": q})
        update_params(q if tokens == 4 else torch.zeros(tokens, 2), list(range(1, last + 1)))
    report = doctor.diagnose(workload)
    assert report.headline().startswith("Graph doctor: the workload failed: RuntimeError") == (found is not None)
    mismatch = report.of("padded-shape-mismatch")
    assert bool(mismatch) == bool(found), report
    if found:
        assert mismatch[0].location.endswith("in launch") and mismatch[0].numbers == {"size": 4, "real": 3}


def test_a_failure_the_workload_catches_itself_is_found_by_diagnose_and_the_fix_is_clean():
    def workload(variant):
        m = Mixer()
        out = m.step()
        try:
            asserted(out if variant == "bug" else out[:3], m.lengths)
        except AssertionError:
            pass                                       # the workload records its failure and goes on
    bug, fix = doctor.diagnose(lambda: workload("bug")), doctor.diagnose(lambda: workload("fix"))
    assert [f.kind for f in bug.findings] == ["padded-shape-mismatch"] and bug.errors == []
    assert bug.findings[0].location.endswith("in asserted")
    assert fix.findings == [] and fix.errors == []
    assert sys.gettrace() is None                     # diagnose left no tracer behind


def _execute(m, variant):
    """A model runner's step: replays, then hands the hidden states on for the next component."""
    out = m.step()
    if variant == "bare":
        return out
    return {"hidden_states": out[:3] if variant == "fix" else out}


@pytest.mark.parametrize("variant", ["packed", "bare", "fix"])
def test_padded_rows_handed_on_packed_in_a_result_are_named_where_they_were_packed(variant):
    """A runner packs the replay's padded rows in its result (``output["hidden_states"] = out``) and
    a consumer asserts one row per request: the function that packed them should have sliced them
    (upstream's fix slices there). A bare output returned as it is, a runner's own, leaves the
    finding at the consumer; the sliced result is clean."""
    def workload():
        m = Mixer()
        result = _execute(m, variant)
        try:
            asserted(result if variant == "bare" else result["hidden_states"], m.lengths)
        except AssertionError:
            pass
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "padded-shape-mismatch", finding
    assert finding.location.endswith("in _execute" if variant == "packed" else "in asserted"), finding
    if variant == "packed":
        assert "met in asserted" in finding.evidence and "packed in its result" in finding.evidence, finding


def _scores(q, weights, batch_size, per_request):
    assert batch_size * per_request == weights.shape[0], "one weight per token"
    return q[:weights.shape[0]] * weights


def _indexer(q, weights, metadata):
    batch_size = metadata.num_reqs                      # read from the step's metadata
    return _scores(q, weights[:metadata.num_tokens], batch_size, 1)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_check_of_a_padded_count_against_real_rows_is_named_where_the_count_was_taken(variant):
    """An eager piece between replays checks a request count against the rows of its per-token
    weights. The bug takes the graph's padded size for the count (4 against 3 real rows): the check
    fails on two plain numbers' worth of evidence, named in the function that took the count (the
    helper that asserts was handed it); the fix passes the real count."""
    def workload():
        m = Mixer()
        out = m.step()
        try:
            _indexer(out, out[:, :1], SimpleNamespace(num_tokens=3, num_reqs=4 if variant == "bug" else 3))
        except AssertionError:
            pass
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "padded-shape-mismatch" and finding.location.endswith("in _indexer"), finding
    assert "return _scores(q, weights[:metadata.num_tokens], batch_size, 1)" in finding.source, finding
    assert "`batch_size` = 4 (the graph's 4 rows)" in finding.tensor and "compared in _scores" in finding.tensor


def test_an_error_without_padded_and_real_rows_is_only_the_workloads_error():
    with pytest.raises(ValueError), doctor.watch() as report:
        m = Mixer()
        out = m.step()[:3]                             # the real rows only
        m.lengths / out[:, 0]
        raise ValueError("something else")
    assert report.findings == [] and report.errors == ["ValueError: something else"]


def _lay_out(offsets_buf, new_lens, real, size, variant):
    """Per-request position offsets for a step padded to ``size``: the bug sizes the increment by
    the padded count and fills it from the real requests' lengths."""
    increment = torch.zeros(size, dtype=torch.int64)
    if variant == "bug":
        increment[:] = new_lens - 1
    else:
        increment[:real] = new_lens - 1
    offsets_buf[:size] += increment


@pytest.mark.parametrize("variant", ["bug", "bug after a padded replay", "fix", "no graph of that size"])
def test_a_step_laid_out_with_padded_and_real_rows_fails_before_its_replay(variant):
    """Eager code preparing a padded step combines a tensor of the graph's rows (4, the size it was
    captured for) with one of the real requests' (3) and fails before any replay:
    ``padded-shape-mismatch`` at that line, also when an earlier step replayed padded (the failing
    op reads none of that replay's tensors). A mismatch of sizes no graph was captured for is the
    workload's error only."""
    def workload():
        pos = torch.zeros(4, dtype=torch.int64)
        g, out = captured(lambda: pos * 2, {"pos": pos})
        if variant == "bug after a padded replay":
            replay(g, out, 3, 4, {"pos": pos})
        size = 4 if variant != "no graph of that size" else 5
        try:
            _lay_out(torch.zeros(8, dtype=torch.int64), torch.tensor([2, 3, 2]), 3, size,
                     "fix" if variant == "fix" else "bug")
        except RuntimeError:
            assert variant != "fix"
            return
        replay(g, out, 3, 4, {"pos": pos})
    report = doctor.diagnose(workload)
    if not variant.startswith("bug"):
        assert report.findings == [], report
        assert (variant == "fix") == (report.caught == []), report      # the other raised, and says so
        return
    (finding,) = report.findings
    assert finding.kind == "padded-shape-mismatch" and finding.location.endswith("in _lay_out"), finding
    assert "increment[:] = new_lens - 1" in finding.source and finding.numbers == {"size": 4, "real": 3}


class _Metadata:
    """Per-step metadata a captured forward keeps (attention metadata, a forward context)."""

    def __init__(self, positions):
        self.positions = positions


class _Rotary:
    """A layer that binds the positions it is called with (``self._positions = positions``, and in
    a metadata object) for an eager helper to read after the graph (``bug``, ``bug in metadata``),
    or is handed them by every step (``fix``)."""

    def __init__(self, variant):
        self.variant, self._positions = variant, None

    def forward(self, positions):
        self._positions = positions
        self.meta = _Metadata(positions)
        return positions * 2

    def rotate(self, x, positions):
        if self.variant == "bug in metadata":
            return x * self.meta.positions
        return x * (self._positions if self.variant == "bug" else positions)


@pytest.mark.parametrize("variant", ["bug", "bug in metadata", "fix", "eager view"])
def test_an_attribute_bound_inside_a_capture_and_read_by_a_later_step(variant):
    """An attribute assigned inside the captured region holds the last capture's view (2 rows);
    eager code of a 4-row step reads it (itself, or a field of the metadata object it holds) and
    fails: ``host-work-frozen`` at the assignment of the attribute the failing line read, which
    replays never run. Handed the step's positions instead, the step is right (no finding). A
    2-row view cut by eager code (no capture bound it) is a mismatch with another graph's size,
    and the finding does not claim it was sized for this step's real requests."""
    def workload():
        pos, layer = torch.arange(4, dtype=torch.int64), _Rotary(variant)
        g4, out4 = captured(lambda: layer.forward(pos[:4]), {"pos": pos}, name="size 4")
        captured(lambda: layer.forward(pos[:2]), {"pos": pos}, name="size 2")
        replay(g4, out4, 4, 4, {"pos": pos})
        try:
            return layer.rotate(out4, pos[:4]) if variant != "eager view" else out4 * pos[:2]
        except RuntimeError:
            return None
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.caught == [], report
        return
    (finding,) = report.findings
    assert finding.numbers == {"size": 4, "real": 2}, finding
    if variant.startswith("bug"):
        held, line = ("_positions", "self._positions = positions") if variant == "bug" else (
            "meta.positions", "self.meta = _Metadata(positions)")
        assert finding.kind == "host-work-frozen" and finding.graph == "size 2", finding
        assert finding.source.endswith(line) and f"_Rotary.{held}:" in finding.tensor, finding
        return
    assert finding.kind == "padded-shape-mismatch" and "size 2 was captured for 2" in finding.evidence, finding
    assert "size 2 was captured for" in finding.cause and "sized for the real requests only" not in finding.cause


# ------------------------------------------------------------------ the GPU record
def test_the_zoo_padded_row_bugs_are_found_and_their_fixes_clean_on_the_cpu():
    for name in padding_record.programs():
        expected = padding_record.program(name)
        bug, fix = (padding_record.findings_of(name, v, "cpu") for v in ("bug", "fix"))
        assert expected.KIND in bug["kinds"] and bug["sites"][expected.KIND] == expected.SITE, name
        assert fix["kinds"] == [], name


@pytest.mark.skipif(not padding_record.RESULT.exists(),
                    reason="results/gpu/doctor_padding.json not recorded yet (padding_record.gpu_record on a GPU)")
def test_the_gpu_record_matches_the_emulation():
    data = json.loads(padding_record.RESULT.read_text())
    recorded = data.get("results", data)["programs"]
    for name, variants in recorded.items():
        for variant, found in variants.items():
            assert found == padding_record.findings_of(name, variant, "cpu"), (name, variant)


@pytest.mark.cuda
def test_gpu_record_on_cuda():
    record = padding_record.gpu_record("cuda", only=["trtllm_9873_repeated_padding_state_index"])
    found = record["programs"]["trtllm_9873_repeated_padding_state_index"]
    assert found["bug"]["kinds"] == ["stale-padding"] and found["fix"]["kinds"] == []


# ------------------------------------------------------------------ padded rows writing state real rows own
class Recurrent:
    """A recurrent state per slot, updated in place through the rows' slot indices. The runner
    writes -1 into padded rows; the captured kernel clamps -1 to slot 0 (the bug: a live slot) or
    sends it to a reserved null slot (the fix). ``one_hot``: the update is a one-hot product added to
    the whole state rather than an indexed write."""

    def __init__(self, null_slot: bool, one_hot: bool):
        self.state, self.null_slot, self.one_hot = torch.zeros(5, 4), null_slot, one_hot   # slot 4: reserved
        self.slots, self.x = torch.full((4,), -1, dtype=torch.int64), torch.zeros(4, 4)

    def forward(self, size):
        idx = self.slots[:size]
        slot = torch.where(idx < 0, 4, idx) if self.null_slot else idx.clamp(min=0)
        new = self.state.index_select(0, slot) * 0.8 + self.x[:size]
        if self.one_hot:                                  # rows of distinct slots: state[slot] = new
            hot = (slot[:, None] == torch.arange(5)).to(new.dtype)
            self.state.mul_(1 - hot.sum(0)[:, None]).add_(hot.T @ new)
        else:
            self.state.index_copy_(0, slot, new)
        return new


def _parked_request_workload(null_slot: bool, one_hot: bool):
    from workbench.engine import GraphManager

    def workload():
        model = Recurrent(null_slot, one_hot)
        m = GraphManager(model.forward, [4], static_buffers={"slots": model.slots, "x": model.x})
        events.persistent_state("Recurrent", {"state": model.state})
        m.capture()
        for slots in ([0, 1, 2, 3], [1, 2]):              # request 0 is parked in the second step
            n = len(slots)
            model.slots.fill_(-1)
            model.slots[:n] = torch.tensor(slots)
            model.x.zero_()
            model.x[:n] = torch.arange(1.0, n + 1)[:, None]
            m.replay(4, n, padded={})                   # padded rows neutralised by the runner
    return workload


@pytest.mark.parametrize("one_hot", [False, True], ids=["indexed-write", "one-hot-update"])
def test_padded_rows_that_update_a_live_slot_are_stale_padding_and_a_null_slot_is_not(one_hot):
    """An indexed write is attributed to its rows in the watched eager step (``probes/row_writes``);
    an update that is not an indexed write is seen only against the unpadded step (``probes/unpadded``)."""
    for null_slot in (False, True):
        report = doctor.diagnose(_parked_request_workload(null_slot, one_hot))
        if null_slot:
            assert report.findings == [], report
            assert report.not_checked["stale-padding"].startswith("1 step(s) served fewer real rows"), report
            continue
        (finding,) = report.findings
        assert finding.kind == "stale-padding", report
        if one_hot:
            assert finding.numbers["unpadded"] and "that real rows of an earlier step wrote" in finding.evidence
            assert "add_(hot.T @ new)" in finding.source
        else:
            assert finding.op == "aten.index_copy_.default" and "unpadded" not in finding.numbers
            assert "self.state.index_copy_(0, slot, new)" in finding.source
            assert "for its padded rows alone" in finding.evidence and "(2 real rows of 4)" in finding.evidence


def _kit_decode(kernel: str):
    """A zoo-kit runner (its eager form has no size, so no unpadded step is announced) whose padded
    rows hold slot -1. ``clamp``: the kernel clamps -1 to slot 0, a live request's; ``null``: it sends
    -1 to a reserved slot; ``guarded``: it clamps, but a padded row adds nothing to the slot."""
    from workbench.zoo.kit import capture, replay

    def decode(state, slots, x):
        valid = slots >= 0
        idx = torch.where(valid, slots, 4) if kernel == "null" else slots.clamp(min=0)
        old = state.index_select(0, idx)
        new = old * 0.5 + x
        if kernel == "guarded":
            state.index_add_(0, idx, (new - old) * valid[:, None])
        else:
            state.index_copy_(0, idx, new)
        return new

    def workload():
        state = torch.zeros(5, 3)
        bufs = {"slots": torch.full((4,), -1), "x": torch.zeros(4, 3)}
        g, out = capture(lambda: decode(state, bufs["slots"], bufs["x"]), device="cpu", static=bufs,
                         state={"ssm_state": state})
        for slots in ([0, 1, 2], [1, 2], [0, 1, 2]):     # request 0 is parked in the second step
            n = len(slots)
            bufs["slots"].fill_(-1)
            bufs["slots"][:n] = torch.tensor(slots)
            bufs["x"].zero_()
            bufs["x"][:n] = torch.arange(1.0, n + 1)[:, None]
            replay(g, out, real=n, size=4, padded={})
    return workload


@pytest.mark.parametrize("kernel", ["clamp", "null", "guarded"])
def test_padded_rows_writing_a_live_slot_are_found_without_an_unpadded_step(kernel):
    report = doctor.diagnose(_kit_decode(kernel))
    if kernel != "clamp":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.op == "aten.index_copy_.default", report
    assert "state.index_copy_(0, idx, new)" in finding.source and "`ssm_state`" in finding.tensor
    assert finding.numbers["real"] == 3 and finding.numbers["size"] == 4


def _gather_after_eager_step(pad: bool):
    """A batch too large for the graph runs eagerly and leaves its last row's index in the static
    buffer; the next, padded replay gathers through that stale index (out of range at the graph's
    size). The workload catches the error, as a serving loop that drops the batch does."""
    from workbench.zoo.kit import capture, replay

    def step(idx, hidden, n, tokens):
        return hidden[:tokens][idx[:n]] * 2.0

    def workload():
        idx, hidden = torch.zeros(6, dtype=torch.int64), torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
        g, out = capture(lambda: step(idx, hidden, 4, 8), device="cpu", static={"idx": idx})
        idx[:6] = torch.tensor([0, 2, 4, 9, 10, 11])
        step(idx, hidden, 6, 12)                              # eager: no graph for 6 rows
        idx[:3] = torch.tensor([1, 2, 3])
        if pad:
            idx[3:] = 0
        try:
            replay(g, out, real=3, size=4, padded={} if pad else {"idx": idx})
        except IndexError:
            pass
    return workload


def test_a_caught_replay_error_is_named_and_padded_rows_an_eager_step_left_are_stale_padding():
    report = doctor.diagnose(_gather_after_eager_step(pad=False))
    assert "IndexError" in report.headline() and "raised by the replay of" in report.caught[0], report
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and "hidden[:tokens][idx[:n]]" in finding.source, report
    assert "padded rows as the runner left them failed (IndexError" in finding.evidence
    fixed = doctor.diagnose(_gather_after_eager_step(pad=True))
    assert fixed.findings == [] and fixed.caught == [], fixed


@pytest.mark.parametrize("sentinel", [-1, 0], ids=["bug", "fix"])
def test_a_padded_replay_that_fails_where_its_real_rows_alone_do_not_is_stale_padding(sentinel):
    """The runner writes a sentinel into the padded rows' block table that the kernel does not
    honour (-1: out of range); the manager's step on the real rows alone completes."""
    from workbench.engine import GraphManager

    def workload():
        pages, table = torch.randn(4, 3), torch.zeros(4, dtype=torch.int64)
        m = GraphManager(lambda size: pages.index_select(0, table[:size]) * 2, [4], static_buffers={"table": table})
        m.capture()
        table[:3] = torch.tensor([1, 2, 3])
        table[3:] = sentinel                              # every padded row written
        try:
            m.replay(4, 3, padded={})
        except IndexError:
            pass
    report = doctor.diagnose(workload)
    if sentinel == 0:
        assert report.findings == [] and report.caught == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.op == "aten.index_select.default", report
    assert "completes" in finding.evidence and finding.numbers["crashed"] == "IndexError"


@pytest.mark.parametrize("pad_slot", [-1, 0], ids=["wraps-to-a-prefilled-slot", "reserved-slot"])
def test_padded_rows_overwriting_what_an_eager_prefill_wrote_are_stale_padding(pad_slot):
    """Padded rows get slot ``pad_slot``; the cache write indexes with it as Python does, so -1 is
    the cache's last slot, which an eager prefill filled with a live prompt's key. Slot 0 is reserved:
    no request owns it, and the padded rows' writes there, replay after replay, are no one's."""
    from workbench.zoo.kit import capture, replay

    def decode(cache, slots, x):
        cache[slots] = x * 2                                  # reshape_and_cache, as plain indexing
        return cache.sum(0, keepdim=True).expand(slots.shape[0], -1) + x

    def workload():
        cache = torch.zeros(6, 2)
        slots, x = torch.zeros(4, dtype=torch.int64), torch.zeros(4, 2)
        g, out = capture(lambda: decode(cache, slots, x), device="cpu", static={"slots": slots, "x": x},
                         state={"kv_cache": cache})
        cache[5] = torch.tensor([3.0, 4.0])                   # prefill of a prompt whose key lives in slot 5
        for step, n in enumerate((3, 2, 3)):
            slots[:n] = torch.arange(1, n + 1)
            slots[n:] = pad_slot
            x[:n] = step + 1.0
            x[n:] = 0.0
            replay(g, out, real=n, size=4, padded={})
    report = doctor.diagnose(workload)
    if pad_slot == 0:
        assert report.findings == [], report
        return
    finding = report.findings[0]
    assert finding.kind == "stale-padding" and "cache[slots] = x * 2" in finding.source, report
    assert "for its padded rows alone" in finding.evidence


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_padded_rows_overwriting_a_prefilled_state_row_a_later_step_reads_are_stale_padding(variant):
    """Recurrent state, one row per request. ``bug``: the runner refreshes only the real rows' state
    indices, so the padded rows keep those of an earlier, larger step; a finished request's row then
    goes to a new request, whose prefill fills it, and the next step's padded rows update it while no
    real row of that step reads it. The new request reads it one step later, as the padded rows
    left it. ``fix``: padded rows get the null row 0, which nobody owns."""
    from workbench.zoo.kit import capture, replay

    def decode(state, indices, x):
        new = state[indices] * 0.5 + x
        state[indices] = new
        return new

    def workload():
        state, indices, x = torch.zeros(8, 2), torch.zeros(4, dtype=torch.int64), torch.zeros(4, 2)
        g, out = capture(lambda: decode(state, indices, x), device="cpu", static={"x": x},
                         state={"state": state, "indices": indices})
        state.zero_()
        results = []
        for rows, fill in (([3, 5, 6], None), ([3], 6), ([3, 6], None)):
            if fill is not None:
                state[fill] = torch.tensor([7.0, -7.0])      # a new request's prefill, in a freed row
            n = len(rows)
            indices[:n] = torch.tensor(rows)
            if variant == "fix":
                indices[n:] = 0
            x[:n] = 1.0
            results.append(replay(g, out, real=n, size=4, padded={}).clone())
        return results
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and "state[indices] = new" in finding.source, report
    assert "replay 2 of" in finding.evidence and "replay 3 (2 real rows of 4) reads" in finding.evidence, finding


def test_an_eager_write_into_a_cache_whose_trash_slot_padded_rows_wrote_reads_nothing_of_theirs():
    """Padded rows write their (stale) keys into the cache's trash slot, which nobody reads. An
    eager prefill then writes its keys into live slots of the same cache, in place, and reads only
    those: the cache it writes into differs between the two padded fills (its trash slot), but the
    prefill computed nothing from what padded rows wrote. No finding."""
    from workbench.zoo.kit import capture, replay

    def decode(cache, slots, x):
        cache[slots] = x * 2                                  # reshape_and_cache; padded rows -> trash slot 5
        return cache[1:4].sum(0, keepdim=True).expand(slots.shape[0], -1) + x

    def workload():
        cache = torch.zeros(6, 2)
        slots, x = torch.zeros(4, dtype=torch.int64), torch.zeros(4, 2)
        g, out = capture(lambda: decode(cache, slots, x), device="cpu", static={"slots": slots, "x": x},
                         state={"kv_cache": cache})
        results = []
        for step, n in enumerate((3, 2, 3)):
            slots[:n] = torch.arange(1, n + 1)
            slots[n:] = 5
            x[:n] = step + 1.0
            results.append(replay(g, out, real=n, size=4, padded={"x": x}).clone())
            cache[torch.tensor([1, 2])] = torch.full((2, 2), float(step))   # an eager prefill's keys
            results.append(cache[1:3].sum())
        return results
    report = doctor.diagnose(workload)
    assert report.findings == [], report


def test_a_shape_error_in_the_doctors_own_eager_run_of_a_padded_step_is_no_finding():
    """The captured step's model reads per-request weights from the runner's current context (as a
    LoRA runner's model reads its adapters' mapping): the capture read the static copy, and each step
    sets the context to the real rows' weights. Run eagerly at the padded size (differential replay),
    the step fails on the shapes where it writes the padded-size output; the workload's replays
    never did, and its results are right: the doctor's own run failing is no padded-shape-mismatch."""
    from workbench.zoo.kit import capture, replay

    def workload():
        gen = torch.Generator().manual_seed(0)
        x, static_w, out = torch.zeros(4, 2), torch.zeros(4, 2, 2), torch.zeros(4, 2)
        context = {"w": static_w}

        def model(h):
            return torch.bmm(h[:, None, :], context["w"]).squeeze(1)

        def step():
            out[:4] = model(x)
            return out
        g, _ = capture(step, device="cpu", static={"x": x, "w": static_w})
        steps = [(torch.randn(n, 2, generator=gen), torch.randn(n, 2, 2, generator=gen)) for n in (3, 4, 3)]
        with events.reference():
            expected = [torch.bmm(data[:, None, :], w).squeeze(1) for data, w in steps]
        got = []
        for data, w in steps:
            n = data.shape[0]
            x[:n], x[n:] = data, 0
            static_w[:n], static_w[n:] = w, 0
            context["w"] = w                              # the step's context: real rows only
            got.append(replay(g, out, real=n, size=4)[:n].clone())
        events.results(expected, got)
        return expected, got
    finding_of(workload, "fix")


def test_a_runner_refreshing_its_inputs_with_one_foreach_copy_is_no_mutation():
    """``torch._foreach_copy_`` (a wrapper copying every input at once) overwrites its destinations
    as ``copy_`` does: a refresh, not an in-place update that builds on what was there."""
    from workbench.zoo.kit import capture, replay

    def workload():
        gen = torch.Generator().manual_seed(0)
        a, b = torch.zeros(3, 2), torch.zeros(3, 2)
        g, out = capture(lambda: a * b + 1, device="cpu", static={"a": a, "b": b})
        steps = [(torch.randn(3, 2, generator=gen), torch.randn(3, 2, generator=gen)) for _ in range(3)]
        with events.reference():
            expected = [x * y + 1 for x, y in steps]
        got = []
        for x, y in steps:
            torch._foreach_copy_([a, b], [x, y])
            got.append(replay(g, out).clone())
        events.results(expected, got)
        return expected, got
    finding_of(workload, "fix")


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_padded_rows_read_by_a_reduction_over_all_rows_are_stale_padding(variant):
    """A per-tensor scale (the amax over every row, as an FP8 quantize takes it) of a buffer whose
    padded rows the runner leaves as an earlier, longer step wrote them (bug): real rows are scaled
    by what padded rows hold, which only a fill larger than the real rows shows. The fix zeroes the
    padded rows before each replay."""
    def quantize(h):
        scale = h.abs().amax().clamp(min=1e-6) / 4.0
        return torch.round(h / scale) * scale

    def workload():
        h = torch.zeros(4, 3)
        g, out = captured(lambda: quantize(h), {"h": h})
        for step, n in enumerate((4, 2, 3)):
            h[:n] = 2 + torch.rand(n, 3, generator=torch.Generator().manual_seed(step))   # above 1
            if variant == "fix":
                h[n:] = 0.0
            replay(g, out, n, 4, {"h": h} if variant == "bug" else {})
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and "h.abs().amax()" in finding.source, report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_padded_token_ids_whose_small_fills_both_cure_the_step_are_stale_padding(variant):
    """The padded rows of a token-id buffer reach real rows through a batch-wide amax of the
    embeddings. The runner leaves them as a longer step wrote them (bug): large tokens there scale
    the real rows. Filled with 0 or with 1 (valid tokens, small embeddings), both runs agree and
    equal the run without graphs: only what the runner left there differs, which is the finding.
    The fix zeroes the padded rows before each replay."""
    from workbench.zoo.kit import capture, replay

    def workload():
        embed = torch.rand(8, 2, generator=torch.Generator().manual_seed(0)) + torch.tensor([0.0] * 2 + [1.0] * 4 + [9.0] * 2)[:, None]
        embed[:2] = 0.01                                  # tokens 0 and 1: small embeddings
        ids = torch.zeros(4, dtype=torch.int64)

        def model(tokens):
            h = embed[tokens]
            scale = h.abs().amax() / 3.0
            return torch.round(h / scale) * scale
        steps = [torch.tensor(t) for t in ([2, 3, 6, 7], [3, 2], [4, 3, 2])]
        with events.reference():
            expected = [model(t) for t in steps]
        g, out = capture(lambda: model(ids), device="cpu", static={"ids": ids})
        got = []
        for t in steps:
            n = t.shape[0]
            ids[:n] = t
            if variant == "fix":
                ids[n:] = 0
            got.append(replay(g, out, real=n, size=4, padded={"ids": ids} if variant == "bug" else None)[:n].clone())
        events.results(expected, got)
        return expected, got
    finding = finding_of(workload, variant)
    if variant == "bug":
        assert finding.tensor == "ids" and "with 1, its results equal" in finding.evidence, finding


def _out_of_range_replay_on_cuda() -> dict:
    """(In a child process: a device-side assert would end the CUDA context.) A graph gathers rows of
    a table through a static index buffer; the runner then writes an index past the table's end.
    Under ``diagnose`` the sampled replay raises the CPU's ``IndexError`` instead of launching, the
    context lives on, and the failure is the workload's."""
    from workbench.engine import graph, new_graph
    table = torch.randn(4, 8, device="cuda")
    idx = torch.zeros(2, dtype=torch.int64, device="cuda")
    seen = {}

    def workload():
        events.static_buffers("runner", {"idx": idx})
        step = lambda: table.index_select(0, idx) * 2  # noqa: E731
        with events.warmup():
            step()
        g = new_graph("cuda")
        with graph(g, name="gather"):
            out = step()
        idx.copy_(torch.tensor([1, 9]))
        events.serve(g, 2, 2, padded={}, outputs=out, eager=step)
        try:
            g.replay()
        except IndexError as e:
            seen["error"] = type(e).__name__
    report = doctor.diagnose(workload)
    torch.cuda.synchronize()                       # the context is alive
    return {"error": seen.get("error"), "failure": report.failure, "caught": list(report.caught)}


@pytest.mark.cuda
def test_a_replay_whose_indices_run_past_a_table_raises_the_cpus_error_on_cuda():
    from workbench.childproc import run_in_child
    result = run_in_child(_out_of_range_replay_on_cuda)
    assert result.ok, result
    assert result.value["error"] == "IndexError" and result.value["failure"] is None, result.value
    assert any("IndexError" in c for c in result.value["caught"]), result.value


class _Helper:
    """Process-wide state a program keeps across runs (a capture helper): its first run leaves it
    used, and every later run fails at set-up, before the first replay, each time differently."""
    runs = 0


def test_padded_row_runs_that_end_before_their_first_replay_say_nothing_of_padding():
    """The padded-row runs are later runs of the same program: here they fail at set-up, where no
    padded row was filled yet. Their different endings are no ``stale-padding``; the report says
    the fill was not checked, and why."""
    def workload():
        _Helper.runs += 1
        if _Helper.runs > 1:
            raise RuntimeError(f"capture helper already used ({_Helper.runs - 1} earlier run(s))")
        x = torch.zeros(4, 2)
        g, out = captured(lambda: x * 2, {"x": x})
        x[:3] = 1.0
        replay(g, out, 3, 4, {"x": x})

    _Helper.runs = 0
    report = doctor.diagnose(workload)
    assert _Helper.runs == 3 and report.findings == [], report
    assert report.not_checked["stale-padding"].startswith("both padded-row runs ended before their first replay"), \
        report.not_checked


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_padded_slots_the_runner_set_to_a_sentinel_once_are_a_latent_note(variant):
    """Padded rows' cache slots set to -1 once, before the capture, and never written by a step (the
    steps serve fewer rows than the graph's size): the kernel skips them, and the run gives the
    results of its run without graphs. The two fills show real rows would depend on other values
    there: a latent hazard, a note. In the bug the padded rows hold slot 0 (a buffer made with zeros),
    so they write the first request's cache slot: the run differs, a finding."""
    from workbench.zoo.kit import capture, compare, replay

    batches = [[3.0, 1.0], [4.0, 5.0], [6.0, 7.0]]

    def write_cache(cache, slots, values):
        cache.index_copy_(0, torch.where(slots >= 0, slots, 8), values)      # -1: the trash slot

    def served():
        cache, outs = torch.zeros(9), []
        slots, x = torch.full((3,), -1 if variant == "fix" else 0), torch.zeros(3)          # the sentinel, set once before the capture
        g, out = capture(lambda: (write_cache(cache, slots, x * 2), cache[:8].sum() + x)[1], device="cpu",
                         static={"slots": slots, "x": x}, state={"cache": cache}, warmups=0, name="step")
        for step, values in enumerate(batches):
            n = len(values)
            slots[:n].copy_(torch.arange(n) + 3 * step)
            x[:n].copy_(torch.tensor(values))
            outs.append(replay(g, out, real=n, size=3, padded={"slots": slots, "x": x})[:n].clone())
        return outs

    def eager():
        cache, outs = torch.zeros(8), []
        for step, values in enumerate(batches):
            v = torch.tensor(values)
            cache.index_copy_(0, torch.arange(len(values)) + 3 * step, v * 2)
            outs.append(cache.sum() + v)
        return outs

    report = doctor.diagnose(lambda: compare("sentinel", variant, "cpu", served, eager))
    if variant == "fix":
        assert report.of("stale-padding") == [], report
        assert any("is latent" in n for n in report.notes), report
    else:
        assert report.of("stale-padding"), report


@pytest.mark.parametrize("variant, slots", [("bug", False), ("fix", False), ("bug", True)])
def test_an_index_the_graph_computes_from_padded_rows_metadata_past_the_table(variant, slots):
    """Each row looks its last token's page up at ``length - 1``; the runner gives padded rows a
    length of 0 (bug), so the graph computes position -1 for them and the lookup runs off the page
    table (on a GPU an illegal memory access). No buffer holds -1 in padded rows only: the lookup's
    own index has it in the padded row only. (``slots``: another static input holds -1 in real rows,
    a padding slot id, which is no culprit.) The fix gives padded rows a length of 1."""
    def workload():
        lengths, pages = torch.ones(4, dtype=torch.int64), torch.zeros(4, 3, dtype=torch.int64)
        table = torch.arange(40.0).reshape(10, 4)
        buffers = {"slot_mapping": torch.tensor([-1, -1, 4, 5])} if slots else {}

        def forward():
            last = pages.gather(1, (lengths - 1).unsqueeze(1) // 4)       # the page lookup
            return table[last.squeeze(1)] * 1.0

        g, out = captured(forward, {**buffers, "lengths": lengths, "pages": pages})
        served = []
        for step in range(2):
            lengths[:3] = torch.tensor([2, 5, 9]) + step
            pages[:3] = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
            lengths[3] = 0 if variant == "bug" else 1                     # the padded row
            served.append(replay(g, out, 3, 4, {}).clone())
        return served

    found = only_finding(workload, variant)
    if found is not None:
        assert found.kind == "stale-padding" and "the page lookup" in found.source, found
        assert "padded row(s) 3" in found.tensor and "index -1" in found.evidence, found
