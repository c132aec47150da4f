"""The graph doctor's general mechanisms, each on small bug and fix workloads of its own.

Every workload here is a tiny serving loop written for this file, on the engine's public API: a
graph manager of a few lines (one graph per size in one pool, warmups, ``serve`` with an eager
step), buffers, and a model with one deliberate flaw -- or its fix, which must give no finding.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from test_doctor_setup_and_warmups import only_finding
from workbench import doctor
from workbench.engine import GraphRunner, events, graph, graph_pool_handle, is_capturing, new_graph, opinfo
from workbench.engine.errors import GraphError, IllegalMemoryAccess


class Manager:
    """One graph per size, captured largest first into one pool after a warmup; ``replay(n)``
    announces ``serve`` (with the eager step) and hands the real rows of the outputs out."""

    def __init__(self, forward, sizes, buffers, *, state=None, shared=None, metadata=None, name="Tiny"):
        self.forward, self.sizes, self.buffers = forward, sorted(sizes), buffers
        self.graphs, self.outputs = {}, {}
        self.pool = graph_pool_handle("cpu")
        events.static_buffers(name, buffers)
        if state:
            events.persistent_state(name, state)
        if shared:
            events.shared_outputs(name, shared)
        if metadata:
            events.written_metadata(name, metadata)

    def capture(self, sizes=None):
        with torch.no_grad():
            for size in sorted(sizes or self.sizes, reverse=True):
                if size in self.graphs:                 # a re-capture releases the old graph first
                    self.graphs.pop(size).reset()
                    del self.outputs[size]
                with events.warmup():
                    self.forward(size)
                g = new_graph("cpu")
                with graph(g, pool=self.pool, name=f"size {size}"):
                    self.outputs[size] = self.forward(size)
                self.graphs[size] = g

    def replay(self, n, *, padded=None, columns=None, eager=True):
        size = next(s for s in self.sizes if s >= n)
        g = self.graphs[size]
        events.serve(g, n, size, padded=self.buffers if padded is None else padded, outputs=self.outputs[size],
                     eager=functools.partial(self.forward, size) if eager else None, padded_columns=columns)
        g.replay()
        out = self.outputs[size][:n]
        events.handed_out(g, out)
        return out


def rows(n, width=4, seed=0, dtype=torch.float32):
    return torch.randint(0, 5, (n, width), generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------------------ differential replay
class Sampler:
    """Logits divided by a temperature the user changes between requests."""

    def __init__(self, variant):
        self.variant = variant
        self.x = torch.zeros(4, 4)
        self.temperature = 1.0
        self.temp_buf = torch.ones(())          # fix: the temperature lives in a static buffer

    def forward(self, size):
        if self.variant == "bug":
            return torch.softmax(self.x[:size] / self.temperature, -1)
        return torch.softmax(self.x[:size] / self.temp_buf, -1)

    def set_temperature(self, t):
        self.temperature = t
        self.temp_buf.fill_(t)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_python_scalar_changed_after_capture(variant):
    def workload():
        s = Sampler(variant)
        m = Manager(s.forward, [2, 4], {"x": s.x})
        m.capture()
        for step, t in enumerate((1.0, 0.5)):
            s.set_temperature(t)
            s.x[:3].copy_(rows(3, seed=step))
            m.replay(3)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.errors == []
        assert "differential replay: 2 replay(s) compared" in " ".join(report.notes)
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen"          # the temperature, a Python float, baked in at capture
    assert finding.op == "aten.div.Tensor" and finding.location.endswith("in forward")
    assert "self.x[:size] / self.temperature" in finding.source
    assert finding.numbers["how"] == "arguments" and finding.numbers["replay"] == 2
    assert "eager run" in finding.evidence


class Biased:
    """A bias switched on after capture (a feature flag read by Python)."""

    def __init__(self):
        self.x = torch.zeros(4, 3)
        self.bias = torch.full((3,), 0.5)
        self.use_bias = False

    def forward(self, size):
        y = self.x[:size] * 2
        if self.use_bias:
            y = y + self.bias
        return y


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_feature_switched_on_after_capture(variant):
    def workload():
        model = Biased()
        m = Manager(model.forward, [4], {"x": model.x})
        m.capture()
        model.x.copy_(rows(4, 3))
        m.replay(4)
        model.use_bias = True
        if variant == "fix":
            m.capture()                         # re-capture when Python's decisions change
        m.replay(4)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and finding.numbers["how"] == "length"
    assert "y = y + self.bias" in finding.source          # the op the eager step launches and the graph lacks


class Rescaled:
    """A weight replaced by a new tensor after capture (an update that rebinds, not copies)."""

    def __init__(self):
        self.x = torch.zeros(2, 3)
        self.scale = torch.ones(3)
        self.old = []

    def forward(self, size):
        return self.x[:size] * self.scale

    def update(self, how):
        new = torch.full((3,), 3.0)
        if how == "copy":
            self.scale.copy_(new)
        else:
            self.old.append(self.scale)           # still alive: the graph reads it without error
            self.scale = new


@pytest.mark.parametrize("variant", ["bug", "copy in place", "re-capture"])
def test_a_weight_rebound_after_capture(variant):
    def workload():
        model = Rescaled()
        m = Manager(model.forward, [2], {"x": model.x})
        m.capture()
        model.x.copy_(rows(2, 3))
        model.update("copy" if variant == "copy in place" else "rebind")
        if variant == "re-capture":
            m.capture()
        m.replay(2)
    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and finding.numbers["how"] == "reference"
    assert finding.tensor == "float32[3]" and "self.x[:size] * self.scale" in finding.source
    assert "a reference frozen at capture" in finding.cause


class Planned:
    """Planning deferred into the captured forward: a host-side plan turned into a tensor there."""

    def __init__(self):
        self.x = torch.zeros(4, 4)
        self.lengths = [4, 4, 4, 4]

    def forward(self, size):
        mask = torch.tensor([[c < n for c in range(4)] for n in self.lengths[:size]])
        return (self.x[:size] * mask).sum(-1)


def test_planning_deferred_into_the_captured_forward():
    def workload():
        model = Planned()
        m = Manager(model.forward, [4], {"x": model.x})
        m.capture()
        model.x.copy_(rows(4))
        model.lengths = [1, 2, 3, 4]
        m.replay(4)
    (finding,) = doctor.diagnose(workload).findings
    assert finding.kind == "host-work-frozen" and finding.numbers["how"] == "arguments"   # a plan made on the host
    assert "torch.tensor(" in finding.source


class Keyed:
    """Graphs keyed on the batch size only, though the step also depends on a causal flag."""

    def __init__(self):
        self.x = torch.zeros(4, 4)
        self.causal = True

    def forward(self, size):
        scores = self.x[:size] @ self.x[:size].T
        if self.causal:
            scores = scores.tril()
        return scores.sum(-1)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_keyed_on_the_wrong_property(variant):
    def workload():
        model = Keyed()
        managers = {flag: Manager(model.forward, [4], {"x": model.x}) for flag in (True, False)}
        for flag, m in managers.items():
            model.causal = flag
            m.capture()
        model.x.copy_(rows(4))
        model.causal = False
        (managers[True] if variant == "bug" else managers[model.causal]).replay(4)
    report = doctor.diagnose(workload)
    assert [f.kind for f in report.findings] == (["warmup-divergence"] if variant == "bug" else [])


def test_without_an_eager_step_differential_replay_says_not_checked():
    def workload():
        s = Sampler("bug")
        m = Manager(s.forward, [4], {"x": s.x})
        m.capture()
        s.set_temperature(0.5)
        m.replay(4, eager=False)
    report = doctor.diagnose(workload)
    assert report.findings == []
    assert report.skipped == {"differential replay": "no eager step announced (serve(..., eager=...))"}
    assert "not checked: differential replay (no eager step announced" in str(report)


def test_launch_traces_that_differ_with_equal_values_are_a_note_not_a_finding():
    """A branch on capture (another but equivalent kernel) is no hazard: one note, however many of the
    sampled replays (the first, the ninth) see it."""
    from workbench.engine import is_capturing

    x = torch.zeros(2, 3)

    def forward(size):
        return x[:size] * 2 if is_capturing() else x[:size] + x[:size]

    def workload():
        m = Manager(forward, [2], {"x": x})
        m.capture()
        for step in range(9):
            x.copy_(rows(2, 3, seed=step))
            m.replay(2)
    report = doctor.diagnose(workload)
    assert report.findings == []
    noted = [n for n in report.notes if "launch traces differ" in n and "outputs and state agree" in n]
    assert len(noted) == 1, noted


def test_differential_replay_leaves_the_program_as_the_replay_left_it():
    """The eager step writes the state too; afterwards state and outputs are the replay's."""
    cache = torch.zeros(4, 3)
    x = torch.zeros(4, 3)

    def forward(size):
        cache[:size] += x[:size]
        return cache[:size] * 1

    def serve(watched):
        cache.zero_()
        x.zero_()
        m = Manager(forward, [4], {"x": x}, state={"cache": cache})
        m.capture()
        cache.zero_()
        outs = []
        for step in range(3):
            x.copy_(rows(4, 3, seed=step))
            outs.append(m.replay(4).clone())
        return outs, cache.clone()

    plain = serve(False)
    with doctor.watch(differential=1) as report:
        watched = serve(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], watched[0], strict=True))
    assert torch.equal(plain[1], watched[1])
    assert report.findings == [] and "differential replay: 3 replay(s) compared" in " ".join(report.notes)


@pytest.mark.parametrize("differential", [0, 1])
def test_differential_replay_keeps_alive_nothing_the_program_let_go(differential):
    """A runner replaces its buffers object (a beam width changed) and keeps the graph captured on
    the old one. The old buffers have no owner left; the graph still reads them: dangling, with
    differential replay on too (its record of the step's Python containers must not hold them)."""
    class Buffers:
        def __init__(self):
            self.x = torch.zeros(4)

    class Runner:
        def __init__(self):
            self.buffers = [Buffers()]

        def forward(self, size):
            return self.buffers[0].x[:size] * 2

    def workload():
        r = Runner()
        m = Manager(r.forward, [4], {})
        m.capture()
        m.replay(4)
        r.buffers = [Buffers()]                  # the old object, and its tensor, are released
        m.replay(4)
    report = doctor.diagnose(workload, differential=differential, padding_probe=False)
    assert [f.kind for f in report.findings] == ["dangling-reference"], report


def test_a_capture_keeps_alive_no_local_of_the_code_that_captured_it():
    """The Python state a capture leaves is read from the frames around it (``captured_state``):
    reading a frame's locals must not leave the frame holding them, or a tensor released after the
    capture would stay alive and the graph's dangling read would go unseen."""
    def workload():
        x = torch.ones(4)
        g = new_graph("cpu")
        with graph(g, name="g"):
            out = x * 2
        del x                                    # the graph does not own it: released here
        events.serve(g, 4, 4, padded={}, outputs=out)
        with pytest.raises(IllegalMemoryAccess):
            g.replay()
    with doctor.watch(differential=1) as report:
        workload()
    assert [f.kind for f in report.findings] == ["dangling-reference"], report


class SharedBackend:
    """One attention backend under every size's graph: each capture binds that size's metadata on it
    (``self.forward_metadata``, as SGLang's backends do); replays refresh the static buffers only.
    ``temperature`` is a Python float the forward reads, set by the program when it likes."""

    def __init__(self):
        self.x = torch.zeros(4, 3)
        self.lens = torch.zeros(4)
        self.forward_metadata = None
        self.temperature = 1.0

    def init_forward_metadata_capture_cuda_graph(self, size):
        self.forward_metadata = (self.lens[:size], size)

    def forward(self):
        lens, size = self.forward_metadata
        return self.x[:size] * lens[:, None] / self.temperature


@pytest.mark.parametrize("variant", ["fix", "bug"])
def test_each_graph_eager_form_runs_with_the_python_state_its_capture_left(variant):
    """Sizes 4 then 2 are captured; the size-2 capture rebinds the metadata after the size-4 one.
    The eager form of a size-4 replay is the captured callable: it must run with the metadata the
    size-4 capture left, not the size-2 one (which would disagree with a correct graph). A value the
    program sets after capturing (``bug``: the temperature) is the step's own: still compared as it is."""
    def workload():
        b = SharedBackend()
        events.static_buffers("backend", {"x": b.x, "lens": b.lens})
        graphs, pool = {}, graph_pool_handle("cpu")
        for size in (4, 2):
            b.init_forward_metadata_capture_cuda_graph(size)
            with events.warmup():
                b.forward()
            graphs[size] = g = new_graph("cpu")
            with graph(g, pool=pool, name=f"size {size}"):
                out = b.forward()
            graphs[size] = (g, out)
        if variant == "bug":
            b.temperature = 0.5
        for step in range(2):
            b.x.copy_(rows(4, 3, seed=step))
            b.lens.copy_(torch.arange(1.0, 5.0))
            g, out = graphs[4]
            events.serve(g, 4, 4, padded={}, outputs=out, eager=b.forward)
            g.replay()
    report = doctor.diagnose(workload)
    assert "differential replay: 2 replay(s) compared" in " ".join(report.notes), report
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and "self.temperature" in finding.source, finding


def test_differential_replay_is_refused_with_a_clear_error_for_a_bad_rate():
    with pytest.raises(ValueError, match="differential must be a whole number >= 0"):
        with doctor.watch(differential=-1):
            pass


def test_a_divergence_names_the_buffer_the_diverging_op_reads():
    def workload():
        s = Sampler("bug")
        m = Manager(s.forward, [4], {"x": s.x})
        m.capture()
        s.set_temperature(0.25)
        s.x.copy_(rows(4))
        m.replay(4)
    (finding,) = doctor.diagnose(workload).findings
    assert finding.tensor == "x: float32[4, 4]"


# ------------------------------------------------------------------------------ static inputs a step did not write
class Offsets:
    """Values plus a per-request offset read through a static slot index. A step without slots
    means every row reads slot 0, whose offset is 0; the bug leaves the last step's slots."""

    def __init__(self, variant):
        self.variant = variant
        self.offsets = torch.tensor([0.0, 5.0, -2.0, 9.0])
        self.x = torch.zeros(4)
        self.slots = torch.zeros(4, dtype=torch.int64)

    def forward(self, size):
        return self.x[:size] + self.offsets[self.slots[:size]]

    def step(self, m, x, slots=None):
        self.x[:len(x)] = x
        if slots is not None:
            self.slots[:len(slots)] = slots
        elif self.variant == "fix":
            self.slots.zero_()
        return m.replay(len(x)).clone()


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_static_input_a_step_omits_keeps_the_last_steps_values(variant):
    def workload():
        model = Offsets(variant)
        m = Manager(model.forward, [4], {"x": model.x, "slots": model.slots})
        m.capture()
        model.step(m, torch.ones(4), torch.tensor([1, 2, 3, 1]))
        model.step(m, torch.ones(4))                    # no request has an offset
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-input" and finding.tensor.startswith("slots")
    assert finding.source.endswith("in forward: return self.x[:size] + self.offsets[self.slots[:size]]")
    assert finding.numbers["elements_carried"] == 4 and finding.numbers["max_abs_diff"] == 9.0


def test_a_static_input_a_step_refreshes_in_part_is_named_at_the_refresh_that_left_the_rest():
    """Four real requests, but the step copies slots for the first two only (a copy sized by another
    count): the other two keep the last step's slots, and the finding stands at that copy, the
    refresh that left them out, not at the op that reads them."""
    def workload():
        model = Offsets("bug")
        m = Manager(model.forward, [4], {"x": model.x, "slots": model.slots})
        m.capture()
        model.step(m, torch.ones(4), torch.tensor([1, 2, 3, 1]))
        model.step(m, torch.ones(4), torch.tensor([0, 0, 0, 0])[:2])
    (finding,) = doctor.diagnose(workload).findings
    assert finding.kind == "stale-input" and finding.tensor.startswith("slots"), finding
    assert finding.source.endswith("in step: self.slots[:len(slots)] = slots"), finding
    assert "this step's refresh of slots at" in finding.evidence, finding


def test_a_table_updated_in_place_a_column_per_step_is_no_stale_input():
    """A block table the runner extends by one entry per step, the rest carried on purpose: an
    input written in part is this step's data plus its padding, not an omitted input."""
    def workload():
        cache = torch.arange(8.0)
        table = torch.zeros(2, 4, dtype=torch.int64)
        lens = torch.ones(2, dtype=torch.int64)

        def forward(size):
            used = torch.arange(4)[None] < lens[:size, None]
            return (cache[table[:size]] * used).sum(1)
        m = Manager(forward, [2], {"lens": lens, "table": table})
        m.capture()
        for step in range(3):
            table[:, step] = torch.tensor([2 * step + 1, 2 * step + 2])
            lens.fill_(step + 1)
            m.replay(2)
    assert doctor.diagnose(workload).findings == []


def test_a_graph_runner_announces_padded_columns():
    """A batch narrower than the block-table buffer leaves the columns past its width as an
    earlier, wider batch wrote them; summing every column reads them."""
    cache = torch.arange(8.0)

    def make_runner():
        return GraphRunner(lambda table: cache[table].sum(1), {"table": ((4,), torch.int64)}, [2])

    def make_batch(n, step):
        return {"table": torch.arange(1, 1 + n * (4 - 2 * (step % 2))).reshape(n, -1) % 8}
    report = doctor.diagnose(make_runner, make_batch, rows=[2, 2])
    assert [f.kind for f in report.findings] == ["stale-padding"], report
    assert report.findings[0].tensor.startswith("table")


# ------------------------------------------------------------------------------ shape contracts
@pytest.mark.parametrize("phase", ["warmup", "capture", "eager"])
def test_a_write_past_the_end_of_a_static_buffer_in_any_phase(phase):
    """A prefill table copied with slice assignment, in whichever phase the runner does it."""
    table = torch.arange(24.0).reshape(6, 4)
    block = torch.zeros(4, 4)
    out = torch.zeros(4)

    def forward(size, fill=False):
        if fill:
            block[:6, :4] = table[:6, :4][:4]
        return block[:size].sum(-1) + out[:size]

    with doctor.watch() as report:
        events.static_buffers("Prefill", {"block_table": block})
        with events.warmup():
            forward(4, fill=phase in ("warmup", "capture"))
        g = new_graph("cpu")
        with graph(g, name="size 4"):
            forward(4, fill=phase in ("warmup", "capture"))    # the capture runs what the warmup ran
        if phase == "eager":
            forward(4, fill=True)
    (finding,) = report.of("undersized-buffer")      # (a graph writing it, never replayed, is another)
    assert finding.kind == "undersized-buffer" and finding.tensor == "block_table: float32[4, 4]"
    assert "block[:6, :4] = table[:6, :4][:4]" in finding.source
    assert f"during {'warmup' if phase == 'capture' else phase}" in finding.evidence   # the first write


def test_a_replay_announced_for_more_rows_or_columns_than_captured():
    x = torch.zeros(8, 4)
    with doctor.watch() as report:
        m = Manager(lambda size: x[:size] * 2, [8], {"x": x})
        m.capture()
        events.serve(m.graphs[8], 12, 8, padded={"x": x})
        m.graphs[8].replay()
        events.serve(m.graphs[8], 8, 8, padded_columns={"x": (x, 6)})
        m.graphs[8].replay()
    findings = report.of("undersized-buffer")
    assert [f.numbers for f in findings] == [{"real": 12, "size": 8}, {"real_columns": 6, "columns": 4}]
    assert all(f.op == "serve" for f in findings)


def test_a_write_that_fails_on_a_static_buffer_names_it():
    buf = torch.zeros(4, 3)
    with pytest.raises(RuntimeError), doctor.watch() as report:
        events.static_buffers("Runner", {"slots": buf})
        buf.index_put_((torch.tensor([0, 1]),), torch.ones(2, 5))
    (finding,) = report.findings
    assert (finding.kind, finding.op) == ("undersized-buffer", "aten.index_put_.default")
    assert finding.tensor == "slots: float32[4, 3]" and "failed" in finding.evidence


# ------------------------------------------------------------------------------ cross-graph
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_output_buffer_shared_by_two_graphs(variant):
    x = torch.zeros(4, 3)
    out = torch.zeros(4, 3)

    def forward(size):
        out[:size] = x[:size] * 2
        return out[:size]

    with doctor.watch() as report:
        m = Manager(forward, [2, 4], {"x": x}, shared={"out": out})
        m.capture()
        x.copy_(rows(4, 3))
        small = m.replay(2)
        small = small.clone() if variant == "fix" else small
        m.replay(4)
        small.sum()
    if variant == "fix":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "overwritten-output" and finding.graph == "size 2"
    assert finding.numbers["overwritten_by"] == "size 4" and "small.sum()" in finding.source


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_reading_the_output_of_another_graph_that_was_captured_again(variant):
    """A two-stage pipeline in one pool: the head graph reads the encoder graph's output."""
    x = torch.zeros(2, 3)
    w = torch.ones(3, 3)
    pool = graph_pool_handle("cpu")
    stages = {}

    def capture(name):
        g = new_graph("cpu")
        with graph(g, pool=pool, name=name):
            stages[name + " out"] = (x @ w) if name == "encoder" else stages["encoder out"].sum(-1)
        stages[name] = g

    with doctor.watch() as report:
        events.static_buffers("Pipeline", {"x": x})
        capture("encoder")
        capture("head")
        capture("encoder")                      # the encoder is captured again (a weight update)
        if variant == "fix":
            capture("head")                     # ... and so is everything that reads its outputs
        stages["encoder"].replay()
        stages["head"].replay()
    if variant == "fix":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "dangling-reference" and finding.graph == "head"
    assert "output of encoder, which was dropped" in finding.evidence


# ------------------------------------------------------------------------------ padding
class Paged:
    """Attention-like gather through a block table with padded columns (blocks beyond the step's
    longest sequence): the sum over a row's blocks reads every column."""

    def __init__(self, variant):
        self.variant = variant
        self.cache = torch.arange(1.0, 9.0).reshape(8, 1) * torch.ones(8, 2)
        self.cache[0] = 0                               # block 0 is the null block
        self.table = torch.zeros(4, 4, dtype=torch.int64)

    def forward(self, size):
        return self.cache[self.table[:size]].sum(1)

    def step(self, m, width, seed):
        self.table[:, :width] = torch.randint(1, 8, (4, width), generator=torch.Generator().manual_seed(seed))
        if self.variant == "fix":
            self.table[:, width:] = 0                   # padded columns point at the null block
        return m.replay(4, columns={"table": (self.table, width)})


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_stale_padded_columns(variant):
    def workload():
        model = Paged(variant)
        m = Manager(model.forward, [4], {"table": model.table})
        m.capture()
        model.step(m, 4, 0)
        model.step(m, 2, 1)                             # columns 2 and 3 still hold step 0's blocks
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.tensor == "table"


class Decoder:
    """Positions advanced inside the graph for the next decode step, rotary table of 8 positions:
    padded rows nobody resets keep advancing until they index past the table."""

    def __init__(self, variant):
        self.variant = variant
        self.rope = torch.arange(16.0).reshape(8, 2)
        self.positions = torch.zeros(4, dtype=torch.int64)

    def forward(self, size):
        out = self.rope[self.positions[:size]] * 1
        self.positions[:size] += 1
        return out

    def step(self, m, n):
        self.positions[:n].copy_(torch.arange(n))
        if self.variant == "fix":
            self.positions[n:].zero_()                  # padded rows reset before each replay
        return m.replay(n, padded={"positions": self.positions})


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_crash_only_with_the_padded_rows_as_the_runner_left_them(variant):
    def workload():
        model = Decoder(variant)
        m = Manager(model.forward, [4], {"positions": model.positions})
        m.capture()
        for _ in range(10):
            model.step(m, 3)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and report.errors == []
        return
    assert report.headline().startswith("Graph doctor: the workload failed: IndexError")
    assert "raised by the replay of size 4 in aten.index.Tensor, recorded at" in report.errors[0]
    (finding,) = report.of("stale-padding")
    assert "completed" in finding.evidence and finding.tensor == "positions"
    assert report.kinds == {"stale-padding", "persistent-mutation"}


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_row_values_placed_from_the_padded_end_are_a_padded_shape_mismatch(variant):
    """The runner writes each real row's offset into a static buffer, counting back from the end of the
    batch. The bug counts from the padded end (the real rows and the graph's padded rows), so every
    offset lands as many rows late as the step has padded rows: the graph reads the reference's values
    moved by the padding (``padded-shape-mismatch``, at the write). Counted from the real end, they
    are where the graph reads them."""
    x, offsets = torch.zeros(8, 3), torch.zeros(8)

    def forward(size):
        return x[:size] * 2 + offsets[:size, None]

    def prepare(step, n, size):
        x[:n].copy_(rows(n, 3, seed=step))
        end = size if variant == "bug" else n
        offsets[end - n:end] = torch.arange(1.0, n + 1) * (step + 1)     # the write

    def workload():
        with events.reference():
            expected = []
            for step in range(2):
                prepare(step, 6, 6)
                expected.append(forward(6).clone())
        m = Manager(forward, [8], {"x": x, "offsets": offsets})
        m.capture()
        got = []
        for step in range(2):
            prepare(step, 6, 8)
            got.append(m.replay(6).clone())
        events.results(expected, got)

    finding = only_finding(workload, variant)
    if variant == "bug":
        assert (finding.kind, finding.op) == ("padded-shape-mismatch", "aten.copy_.default"), finding
        assert finding.source.endswith("offsets[end - n:end] = torch.arange(1.0, n + 1) * (step + 1)     # the write")
        assert "moved by 2 row(s), as many as the step's padded rows" in finding.evidence, finding.evidence


# ------------------------------------------------------------------------------ persistent state
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_recapture_warmup_writing_rows_of_running_requests(variant):
    kv = torch.zeros(6, 2)
    slots = torch.zeros(2, dtype=torch.int64)
    x = torch.zeros(2, 2)

    def forward(size):
        kv.index_copy_(0, slots[:size], x[:size])
        return kv[slots[:size]] * 1

    with doctor.watch() as report:
        m = Manager(forward, [2], {"slots": slots, "x": x}, state={"kv": kv})
        slots.copy_(torch.tensor([5, 5]))               # the dummy batch writes the reserved row 5
        m.capture()
        slots.copy_(torch.tensor([0, 1]))               # two running requests in rows 0 and 1
        x.copy_(torch.ones(2, 2))
        m.replay(2, eager=False)
        if variant == "bug":
            slots.copy_(torch.arange(2))                # the re-capture's dummy batch: rows 0, 1
        else:
            slots.copy_(torch.tensor([5, 5]))
        x.zero_()
        m.capture()
    (*findings,) = report.findings
    if variant == "fix":
        assert findings == []
        return
    (finding,) = findings
    assert finding.kind == "persistent-mutation" and finding.graph == "warmup"
    assert finding.numbers == {"rows_overwritten": 2, "live_rows": 2, "rows": 6}


# ------------------------------------------------------------------------------ fix idioms
def counting(x):
    x[:, 0] += 1
    return x * 1


@pytest.mark.parametrize("reset", [False, True])
def test_rows_reset_before_each_replay_are_the_fix(reset):
    """The graph bumps a counter column in place; the runner resetting every row before each
    replay is the standard fix (so the probe refreshes as it does)."""
    x = torch.zeros(4, 3)

    def workload():
        m = Manager(lambda size: counting(x[:size]), [4], {"x": x})
        m.capture()
        for step, n in enumerate((3, 4, 2)):
            if reset:
                x.zero_()
            x[:n].copy_(rows(n, 3, step))
            m.replay(n)
    report = doctor.diagnose(workload)
    assert [f.kind for f in report.findings] == ([] if reset else ["persistent-mutation"])


def test_gather_inside_the_capture_eager_fallback_and_an_idempotent_refresh_give_no_finding():
    table = torch.arange(40.0).reshape(10, 4)
    ids = torch.zeros(4, dtype=torch.int64)
    meta = torch.zeros(4, dtype=torch.int64)

    def forward(size):
        meta.copy_(meta.clone())                         # an idempotent refresh inside the graph
        return table[ids[:size]] * 2                     # the gather happens inside the capture

    def workload():
        m = Manager(forward, [2, 4], {"ids": ids, "meta": meta})
        m.capture()
        for step, n in enumerate((3, 4, 6)):
            batch = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(step))
            if n > 4:
                table[batch] * 2                         # eager fallback beyond the largest size
                continue
            ids[:n].copy_(batch)
            meta.copy_(torch.arange(4))                  # the runner refreshes the metadata
            m.replay(n)
        m.replay(1)
    report = doctor.diagnose(workload)
    assert report.findings == [] and report.errors == []


def test_metadata_the_graph_writes_on_purpose_is_no_mutation():
    x = torch.zeros(4, 3)
    lengths = torch.zeros(4)

    def forward(size):
        lengths[:size] = (x[:size] != 0).sum(-1)         # metadata derived from the inputs
        return x[:size] * lengths[:size, None]

    def workload():
        m = Manager(forward, [4], {"x": x}, metadata={"lengths": lengths})
        m.capture()
        x[:3].copy_(rows(3, 3))
        m.replay(3)
    assert doctor.diagnose(workload).findings == []


# ------------------------------------------------------------------------------ clean models
def test_a_clean_transformers_model_with_differential_replay_gives_an_empty_report():
    from workbench.models.hf import tiny_model

    model = tiny_model("gpt2", seed=0).eval()
    ids = torch.zeros(4, 8, dtype=torch.int64)

    def forward(size):
        return model(input_ids=ids[:size]).last_hidden_state

    def workload():
        m = Manager(forward, [2, 4], {"input_ids": ids})
        m.capture()
        for step, n in enumerate((4, 3, 1)):
            ids[:n].copy_(torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(step)))
            m.replay(n)
    report = doctor.diagnose(workload)
    assert report.findings == [] and report.errors == [] and report.failure is None
    assert "differential replay: 3 replay(s) compared" in " ".join(report.notes)


# ------------------------------------------------------------------------------ bad input
def test_diagnose_with_a_make_batch_of_the_wrong_dtype_says_the_workload_failed():
    def make_runner():
        return GraphRunner(lambda x: x * 2, {"x": ((3,), torch.float32)}, [2, 4])

    report = doctor.diagnose(make_runner, lambda n, step: {"x": torch.ones(n, 3, dtype=torch.int64)})
    assert report.headline().startswith("Graph doctor: the workload failed: GraphError: input 'x' has dtype")
    assert not report.clean and "stale-padding" not in report.kinds


@pytest.mark.parametrize("factory, batch, match", [
    (lambda: "a runner", lambda n, s: {}, "make_runner must return a GraphRunner, got str"),
    (lambda: GraphRunner(lambda x: x, {"x": ((3,), torch.float32)}, [2]), lambda n, s: torch.ones(n, 3),
     "make_batch\\(2, 0\\) must return a dict of tensors"),
])
def test_diagnose_raises_a_type_error_for_a_factory_of_the_wrong_type(factory, batch, match):
    with pytest.raises(TypeError, match=match):
        doctor.diagnose(factory, batch)


def test_a_workload_that_raises_is_never_a_clean_report():
    def workload():
        raise ValueError("broken workload")
    report = doctor.diagnose(workload)
    assert report.headline() == ("Graph doctor: the workload failed: ValueError: broken workload -- 0 findings in "
                                 "what ran before (0 capture(s), 0 replay(s)).")


# ------------------------------------------------------------------ a step's inputs, across graphs
@pytest.mark.parametrize("relayed", [False, True], ids=["direct", "through-a-copy"])
@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_smaller_graph_reading_rows_a_larger_batch_wrote_is_stale_input(variant, relayed):
    """Two graphs read one destination buffer: the bug's graphs read its tail (``dest[-size:]``),
    which for the smaller graph holds what the larger batch wrote for the other graph's replay.
    ``relayed``: the runner writes this step's rows of its own slot and the backend copies the whole
    slot into the buffer the graphs read, so the stale rows reach them through the copy."""
    def workload():
        state, slot, x = torch.zeros(9, 2), torch.zeros(4, dtype=torch.int64), torch.zeros(4, 2)
        dest = torch.zeros(4, dtype=torch.int64) if relayed else slot

        def forward(size):
            d = dest[-size:] if variant == "bug" else dest[:size]
            state.index_copy_(0, d, x[:size] * 2)
            return state.index_select(0, d) + 1

        m = Manager(forward, [2, 4], {"x": x, "dest": dest, **({"slot": slot} if relayed else {})})
        events.persistent_state("cache", {"state": state})
        m.capture()
        for rows in ([1, 2, 3, 4], [5, 6]):
            n = len(rows)
            slot[:n] = torch.tensor(rows)
            if relayed:
                dest.copy_(slot)                            # the slot handed over whole
            x[:n] = torch.arange(1.0, n + 1)[:, None]
            m.replay(n)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-input" and finding.tensor.startswith("dest"), report
    assert "state.index_copy_(0, d, x[:size] * 2)" in finding.source or "index_select(0, d)" in finding.source


# ------------------------------------------------------------------ PIECEWISE steps
class Paged2:
    """A PIECEWISE step with an eager attention-like region between two pieces that writes a
    cache through a per-token slot mapping of the real tokens (a global, as a forward context)."""

    slots = None

    def __init__(self, fixed: bool):
        from workbench.engine import GraphManager
        self.fixed, self.cache, self.x = fixed, torch.zeros(8, 2), torch.zeros(4, 2)
        self.m = GraphManager(self.forward, [4], mode="PIECEWISE", static_buffers={"x": self.x})
        self.write = self.m.eager(self.write_cache)

    def write_cache(self, key):
        out, slots = torch.zeros_like(key), Paged2.slots
        if slots is None:                             # a capture's dummy run: no metadata
            return out
        n = slots.shape[0] if self.fixed else key.shape[0]
        idx = slots[torch.arange(n)]
        self.cache[idx] = key[:n]
        return out + 1

    def forward(self, size):
        key = self.x[:size] * 3
        return self.write(key) + key


@pytest.mark.parametrize("fixed", [False, True], ids=["bug", "fix"])
def test_a_piecewise_eager_region_that_mixes_padded_and_real_rows(fixed):
    """The eager region between two pieces meets the first piece's padded tensor and a real-row
    slot mapping: padded-shape-mismatch at that line. Its warmup ran the whole step, eager region and
    second piece included, which is no work the capture skipped."""
    def workload():
        model = Paged2(fixed)
        events.persistent_state("cache", {"cache": model.cache})
        model.m.capture()
        model.x[:3] = torch.ones(3, 2)
        Paged2.slots = torch.tensor([1, 2, 3])
        try:
            model.m.replay(4, 3, padded={"x": model.x})
        except IndexError:
            pass
        finally:
            Paged2.slots = None
    report = doctor.diagnose(workload)
    assert not report.of("warmup-divergence"), report
    if fixed:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "padded-shape-mismatch" and "idx = slots[torch.arange(n)]" in finding.source
    assert "`key` float32[4, 2]" in finding.tensor and "int64[3] (3 real rows)" in finding.tensor


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_static_input_no_graph_reads_is_noted(variant):
    """The runner fills ``embeds`` every step, but the bug's capture calls the model without it: the
    graph embeds ``ids`` instead, and every replay ignores the runner's ``embeds``. A runner may also
    keep a buffer the captured kernels do not use, so this is a note, never a finding."""
    table = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))

    def model(ids, embeds=None):
        return (table[ids] if embeds is None else embeds) * 2

    def workload():
        ids, embeds = torch.zeros(4, dtype=torch.int64), torch.zeros(4, 3)
        m = Manager(lambda size: model(ids[:size], None if variant == "bug" else embeds[:size]), [4],
                    {"ids": ids, "embeds": embeds})
        m.capture()
        for step in range(2):
            ids[:] = torch.arange(4) + step
            embeds[:] = table[ids] + 1.0                  # image features merged into the embeddings
            m.replay(4)
    report = doctor.diagnose(workload)
    assert report.findings == [], report
    noted = [n for n in report.notes if "no graph reads embeds" in n]
    assert len(noted) == (variant == "bug"), report.notes            # one note, however many replays
    if noted:
        assert "with graph(g, pool=self.pool" in noted[0] and "(24 element(s) of new data before 2 replays" in noted[0]


class _Batch:
    def __init__(self, scaled):
        self.scaled = scaled


def _sample(x, temps, batch):
    if batch.scaled:
        return x / temps[:, None]
    return x * 1.0


@pytest.mark.parametrize("variant", ["bug", "fix", "watch"])
def test_a_branch_the_capture_did_not_take_is_warmup_divergence_at_the_line_that_reads_the_input(variant):
    """The step divides by ``temps`` only when the batch asks for it, and the capture ran on a dummy
    batch that did not: its graph holds no kernel that reads ``temps``, and every replay ignores the
    temperatures the runner copies there. The captured function names ``temps`` on a line the capture
    never ran, so it is ``warmup-divergence`` there, not a note. ``fix``: the runner serves such
    batches eagerly and copies nothing. Under ``watch()`` alone no line is traced, so which lines the
    capture ran is not known: a note, as for a buffer the captured code never names."""
    def workload():
        x, temps = torch.zeros(4, 3), torch.ones(4)
        dummy, live = _Batch(False), _Batch(True)
        m = Manager(lambda size: _sample(x[:size], temps[:size], dummy), [4], {"x": x, "temps": temps})
        m.capture()
        for step in range(2):
            x[:] = rows(4, 3, seed=step)
            wanted = torch.tensor([0.5, 1.0, 2.0, 4.0]) + step
            if variant == "fix":
                _sample(x, wanted, live)
            else:
                temps[:] = wanted
                m.replay(4)
    if variant == "watch":
        with doctor.watch(differential=1) as report:
            workload()
        assert report.findings == [] and any("no graph reads temps" in n for n in report.notes), report
        return
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and "in _sample: return x / temps[:, None]" in finding.source, finding
    assert finding.tensor.startswith("temps") and finding.numbers["elements_dropped"] == 4


def test_a_static_input_only_the_host_reads_is_no_finding():
    """``lens`` is a static input the runner fills and reads on the host (``tolist``, which on the
    CPU dispatches no op) to plan the step; no graph reads it, and nothing is lost."""
    def workload():
        x, lens, mask = torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64), torch.zeros(4, 3)
        m = Manager(lambda size: (x[:size] * mask[:size]).sum(1), [4], {"x": x, "lens": lens})
        m.capture()
        for step in range(3):
            lens[:] = torch.tensor([1, 2, 3, 2]) + step % 2
            mask.copy_((torch.arange(3)[None] < torch.tensor(lens.tolist())[:, None]).float())
            x[:] = step + 1.0
            m.replay(4)
    report = doctor.diagnose(workload)
    assert report.findings == [], report


@pytest.mark.parametrize("variant", ["bug", "fix", "refreshed"])
def test_a_graph_that_updates_a_copy_of_the_callers_state(variant):
    """A graph wrapper copies every input it does not own before each replay. ``bug``: the caller's
    cache is such an input, so the graph's in-place update lands in the copy and the next copy
    discards it; ``fix``: the cache is the graph's own input; ``refreshed``: the caller writes the
    source anew each step (a counter the graph bumps in its copy is the reset idiom)."""
    def workload():
        cache, x = torch.zeros(4, 2), torch.zeros(1, 2)
        static_cache = cache if variant == "fix" else torch.zeros(4, 2)
        pos = torch.zeros(1, dtype=torch.int64)

        def step():
            static_cache.index_copy_(0, pos, x * 2)
            return static_cache.sum(0, keepdim=True)

        static = {"x": x, "pos": pos} if variant == "fix" else {"x": x, "pos": pos, "cache": static_cache}
        m = Manager(lambda size: step(), [1], static, state={"cache": cache} if variant == "fix" else None)
        m.capture()
        for p in range(3):
            if variant == "refreshed":
                cache.copy_(torch.randn(4, 2, generator=torch.Generator().manual_seed(p)))
            if variant != "fix":
                static_cache.copy_(cache)                  # the wrapper's copy-in
            pos.fill_(p)
            x.fill_(p + 1.0)
            m.replay(1)
    report = doctor.diagnose(workload)
    if variant != "bug":
        assert not report.of("persistent-mutation"), report
        return
    finding = report.of("persistent-mutation")[0]
    assert finding.tensor.startswith("cache") and "static_cache.index_copy_(0, pos, x * 2)" in finding.source
    assert "refilled cache from the same" in finding.evidence


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_lookup_past_a_static_buffer_during_a_warmup_is_an_undersized_buffer(variant):
    """The capture of 8 tokens runs a dummy request of 8 tokens, whose page-table row holds 6
    entries (the context length): its attention looks the table up past its end."""
    def workload():
        width = 6 if variant == "bug" else 8
        table, lens = torch.arange(width).reshape(1, width), torch.zeros(1, dtype=torch.int64)

        def forward(size):
            idx = torch.arange(size) + lens * 0           # the dummy request's positions, read through the table
            return table.reshape(-1)[idx].float().sum()[None]

        m = Manager(forward, [4, 8], {"table": table, "lens": lens})
        try:
            m.capture()
        except IndexError:
            pass
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "undersized-buffer" and finding.tensor.startswith("table"), report
    assert "table.reshape(-1)[idx]" in finding.source and "during warmup" in finding.evidence


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_warmup_failing_on_the_shape_of_a_static_input_names_where_it_was_made(variant):
    """A draft model maps the target's hidden states (width 6) with ``fc``; the runner made its
    static ``hidden`` buffer the draft's own width (4), so the warmup's matmul fails on it (the
    runner catches the error and serves eagerly). The finding is the buffer's allocation, which
    decided its width; the fix sizes it from the target's width."""
    fc = torch.ones(6, 2)

    def workload():
        hidden = torch.zeros(4, 4 if variant == "bug" else 6)
        m = Manager(lambda size: hidden[:size] @ fc, [4], {"hidden": hidden})
        try:
            m.capture()
        except RuntimeError:
            pass
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "undersized-buffer" and finding.tensor.startswith("hidden"), report
    assert "hidden = torch.zeros(4" in finding.source and "hidden[:size] @ fc" in finding.evidence, finding


@pytest.mark.parametrize("fill", [0, 1])
def test_nan_padded_rows_make_that_a_batch_wide_scale_hands_to_real_rows(fill):
    """Padded rows' lengths are reset to ``fill`` before each replay. A length of 0 is an attention
    row with no keys: NaN, which stays in its row (a repeated copy of the rows keeps it there) until
    a per-tensor scale over the whole padded batch (dynamic FP8 quantisation) hands it to every
    real row. A length of 1 stays finite."""
    keys = rows(4, seed=1)
    lens = torch.zeros(4, dtype=torch.int64)

    def forward(size):
        valid = torch.arange(4)[None, :] < lens[:size, None]
        scores = keys[None, :, 0].expand(size, 4).masked_fill(~valid, float("-inf"))
        o = torch.softmax(scores, -1) @ keys
        wide = o.repeat_interleave(2, 0)            # a copy of the rows, not a mix of them
        return o / wide.abs().amax()

    def workload():
        m = Manager(forward, [4], {"lens": lens})
        m.capture()
        for n in (3, 2):
            lens.fill_(fill)
            lens[:n] = torch.arange(1, n + 1)
            m.replay(n, padded={})
    report = doctor.diagnose(workload)
    if fill:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.op in ("aten.amax.default", "aten.div.Tensor"), report
    assert "o / wide.abs().amax()" in finding.source and "NaN" in finding.evidence, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_nan_a_padded_row_stores_into_a_slot_real_rows_read_is_stale_padding(variant):
    """Padded rows have length 0 (an attention row with no keys: NaN) and slot 0, the cache's null
    slot. The step stores each row's output at its slot, then reads its rows' slots and slot 0 (a
    page table's padding, weighted 0: 0 * NaN is NaN). The store hands the padded row's NaN to the
    real rows through the cache (bug): the finding is at the store. The fix skips stores into the
    null slot."""
    keys = rows(4, width=3, seed=1)
    lens, slots = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    cache = torch.zeros(5, 3)

    def forward(size):
        valid = torch.arange(4)[None, :] < lens[:size, None]
        scores = keys[None, :, 0].expand(size, 4).masked_fill(~valid, float("-inf"))
        o = torch.softmax(scores, -1) @ keys
        s = slots[:size]
        if variant == "fix":
            o = torch.where((s == 0)[:, None], cache[s], o)
        cache.index_put_((s,), o)                   # the store
        return cache[s] + 0.0 * cache[0]

    def workload():
        m = Manager(forward, [4], {"lens": lens, "slots": slots}, state={"cache": cache})
        m.capture()
        for n in (3, 2):
            lens.fill_(0)
            slots.fill_(0)
            lens[:n], slots[:n] = torch.arange(1, n + 1), torch.arange(1, n + 1)
            m.replay(n, padded={})
    finding = only_finding(workload, variant)
    if variant == "bug":
        assert finding.kind == "stale-padding" and "cache.index_put_((s,), o)" in finding.source, finding
        assert "into memory that is not per row" in finding.evidence, finding


def test_only_an_op_that_mixes_rows_hands_padded_rows_nan_to_real_rows():
    """Of ops on a batch whose padded row (the last of 4) holds NaN: a per-row op keeps it there, a
    flattened copy of the rows is no mix (as large as what carried it), a reduction is one."""
    from types import SimpleNamespace
    from workbench.doctor.probes import nonfinite
    x = torch.ones(4, 3)
    x[3] = float("nan")
    aten = torch.ops.aten
    for func, out, mixes in ((aten.mul.Tensor, x * 2, False), (aten.clone.default, x.reshape(-1).clone(), False),
                             (aten.sum.default, x.sum(), True)):
        d = SimpleNamespace(nonfinite=(3, 4), crossed=None, stored={})
        nonfinite.on_op(d, func, (x,), {}, out)
        assert (d.crossed is not None) == mixes, func


def test_state_announced_again_with_each_capture_keeps_its_first_values():
    """A runner announces its KV cache with every capture; the warmup of the first capture writes
    the reserved slot 0, and the runner puts the cache back after the captures. Padded rows then
    write slot 0, which no request owns: no finding. (Taking each announcement's values as the
    state as announced would make slot 0 live data, put back by the restore.)"""
    cache, slots, x = torch.randn(6, 2, generator=torch.Generator().manual_seed(0)), torch.zeros(4, dtype=torch.int64), \
        torch.zeros(4, 2)

    def forward(size):
        cache.index_put_((slots[:size],), x[:size] + 1)
        return cache[slots[:size]] * 2

    def workload():
        saved = cache.clone()
        m = Manager(forward, [], {"slots": slots, "x": x})
        for size in (4, 2):
            events.persistent_state("Tiny", {"cache": cache})
            m.sizes = sorted({*m.sizes, size})
            m.capture([size])
        cache.copy_(saved)
        for n in (3, 1):
            slots.zero_()
            slots[:n] = torch.arange(1, n + 1)
            x[:n] = rows(n, 2, seed=n)
            m.replay(n, padded={})
    assert doctor.diagnose(workload).findings == []


def _value(x):
    return x.item() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("how", ["helper", "direct"])
def test_a_number_read_from_a_tensor_a_helper_was_handed_is_named_where_it_was_handed_in(how):
    """An optimizer's step count is a device tensor (capturable); a helper that reads it as a
    number syncs inside the capture because the update function handed it the tensor: the finding
    names that line. A read in the function itself is named where it is."""
    step_t, w = torch.zeros(()), torch.ones(4)

    def update():
        step_t.add_(1)
        count = step_t
        scale = _value(count) if how == "helper" else count.item()
        w.mul_(1 - 0.1 / scale)

    def workload():
        with events.warmup():
            update()
        g = new_graph("cpu")
        try:
            with graph(g):
                update()
        except Exception:  # noqa: BLE001 - the capture fails, as on CUDA
            pass
    (finding,) = doctor.diagnose(workload).findings
    assert finding.kind == "sync-in-capture", finding
    line = "scale = _value(count) if how" if how == "helper" else "count.item()"
    assert line in finding.source and "in update:" in finding.source, finding


@pytest.mark.parametrize("unpacked", [False, True])
def test_a_number_read_from_a_tensor_the_captured_lambda_closes_over_is_named_where_it_is_read(unpacked):
    """The captured callable is a lambda over the runner's tensor, or over its tuple of static inputs
    that it unpacks into the call (``lambda: model(*static_inputs)``): the lambda chose nothing, so
    the finding stays at the function that reads the number."""
    limit = torch.tensor(3)
    static_inputs = (limit,)

    def attention(n):
        return torch.ones(int(n.item()))

    def workload():
        g = new_graph("cpu")
        try:
            with graph(g):
                (lambda: attention(*static_inputs))() if unpacked else (lambda: attention(limit))()
        except Exception:  # noqa: BLE001 - the capture fails, as on CUDA
            pass
    (finding,) = doctor.diagnose(workload).findings
    assert "in attention:" in finding.source, finding


@pytest.mark.parametrize("grads", [True, False])
def test_a_warmup_that_steps_an_optimizer_on_gradients_is_a_training_step(grads):
    """A whole-network capture warms up with a real optimizer step; its gradients are written by
    hand (no backward pass). What the warmup wrote is training state, not dummy data. Without the
    gradient, the same warmup moving the weights is a dummy batch's write that real steps read."""
    w = torch.ones(4)
    x = torch.zeros(4)
    if grads:
        w.grad = torch.zeros(4)

    def step():
        g = x * w
        if grads:
            w.grad.copy_(g)
        w.sub_(0.1 * g)
        return (x * w).sum()[None]

    def workload():
        x.copy_(torch.arange(4.0))
        m = Manager(lambda size: step(), [1], {"x": x})
        m.capture()
        for k in range(2):
            x.copy_(torch.arange(4.0) + k)
            m.replay(1)
    report = doctor.diagnose(workload)
    assert (report.findings == []) == grads, report


def test_a_workload_under_inference_mode_is_watched_to_its_end():
    """State and scratch the eager step writes under ``torch.inference_mode()`` are inference
    tensors: the doctor's own copies of them must still be writable when it puts them back."""
    def workload():
        with torch.inference_mode():
            x, cache = torch.zeros(2, 3), torch.zeros(4, 3)
        scratch = {}

        def forward(size):
            with torch.inference_mode():
                scratch.setdefault("w", torch.zeros(2, 3)).copy_(x[:size] * 2)   # memory the graph never writes
                cache[:size] += x[:size]
                return cache[:size] * 1.0

        m = Manager(forward, [2], {"x": x}, state={"cache": cache})
        m.capture()
        for step in range(3):
            with torch.inference_mode():
                x.fill_(step + 1.0)
            m.replay(2)
    report = doctor.diagnose(workload)
    assert report.failure is None, report


def test_the_doctors_aliases_made_under_inference_mode_are_writable_outside_it():
    from workbench.doctor.tensors import alias
    with torch.inference_mode():
        t = torch.zeros(3)
        a = alias(t.untyped_storage(), t.dtype)
    a.copy_(torch.ones(3))
    assert torch.equal(t, torch.ones(3))


def test_the_doctors_comparisons_take_host_memory_beside_device_memory():
    """Host memory against device memory is a refused op in the workload, not in the doctor's own
    comparisons (a replay's staging block against the reference's copy of it)."""
    from workbench.doctor.tensors import changed, differs, disagrees, max_abs_diff
    from workbench.engine import host
    staged, device = host(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 3.0])
    assert differs(staged, device).tolist() == [False, True] == changed(staged, device).tolist()
    assert disagrees(device, staged).tolist() == [False, True] and max_abs_diff(staged, device) == 1.0


def test_masks_placed_through_a_storage_follow_the_view_expanded_views_included():
    """``onto`` puts a view's values at its elements of the storage and ``at`` reads them back;
    an expanded view (stride 0) names one element several times and must not fail."""
    from workbench.doctor.tensors import at, onto, region
    buf = torch.zeros(4, 3)
    view = buf[1:3, ::2]
    mask = onto(torch.tensor([[True, False], [False, True]]), view, buf)
    assert mask.nonzero().tolist() == [[1, 0], [2, 2]]
    assert torch.equal(at(mask, view, buf), torch.tensor([[True, False], [False, True]]))
    assert torch.equal(at(onto(torch.tensor([[1.0, 2.0]]), view), view), torch.tensor([[1.0, 2.0]] * 2))
    row = buf[0:1].expand(5, 3)
    assert region(row, buf).nonzero()[:, 0].unique().tolist() == [0]
    assert onto(torch.ones(5, 3, dtype=torch.bool), row, buf)[0].all()
    windows = buf.reshape(-1).unfold(0, 4, 2)                      # windows share elements
    assert region(windows, buf).all()
    assert onto(torch.ones(windows.shape), windows, buf).eq(1).all()


@pytest.mark.parametrize("variant", ["bug", "fix", "smaller"])
def test_a_write_that_does_not_fit_an_unannounced_buffer_is_an_undersized_buffer(variant):
    """Before each capture the runner builds its dummy batch's metadata into a persistent buffer of
    ``max_reqs + 1`` entries, not yet announced; the bug counts one request per token, so the
    largest capture's metadata does not fit and the copy fails (the start-up loop catches it and
    goes on). Data *smaller* than the destination that does not broadcast is another problem."""
    def workload():
        max_reqs = 2
        meta = torch.zeros(max_reqs + 1, dtype=torch.int64)

        def build(num_reqs):
            data = torch.arange(num_reqs + 1) if variant != "smaller" else torch.arange(2)
            meta[:num_reqs + 1 if variant != "smaller" else 3].copy_(data)

        x = torch.zeros(4)
        m = Manager(lambda size: x[:size] * 2 + meta[:1], [2, 4], {"x": x})
        for size in (4, 2):
            try:
                build(size if variant == "bug" else min(size, max_reqs))
            except RuntimeError:
                continue
        m.capture()
    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.of("undersized-buffer") == [], report
        return
    (finding,) = report.of("undersized-buffer")
    assert "meta[:num_reqs + 1" in finding.source and "data of shape (5,)" in finding.evidence, finding
    assert "destination of shape (3,)" in finding.evidence and "during eager" in finding.evidence


@pytest.mark.parametrize("fixed", [False, True])
def test_data_with_a_dimension_its_destination_lacks_does_not_fit_it(fixed):
    """Multimodal rotary positions are three rows per token; the bug's persistent positions buffer
    holds one row per token, and the runner's first copy into it fails, before any capture. The fix
    allocates three rows and copies into a column window."""
    def workload():
        positions = torch.zeros(3, 4, dtype=torch.long) if fixed else torch.zeros(4, dtype=torch.long)
        x = torch.zeros(4)
        m = Manager(lambda size: x[:size] * 2 + positions[..., :size].reshape(-1, size)[0], [4], {"x": x})
        step = torch.arange(6).reshape(3, 2)
        (positions[:, :2] if fixed else positions[:2]).copy_(step)
        m.capture()
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [] and not report.errors, report
        return
    (finding,) = report.of("undersized-buffer")
    assert "positions[:2]).copy_(step)" in finding.source and "data of shape (3, 2)" in finding.evidence, finding


@pytest.mark.parametrize("variant", ["bug", "fix", "rows"])
def test_a_warmup_writing_data_of_another_width_into_a_buffer_is_an_undersized_buffer(variant):
    """The captured step copies its logits into a logits buffer shared by the runner's graphs, sized
    for the full vocabulary; the bug's draft head has a reduced one, and the warmup's copy fails: the
    buffer's shape contract, broken before any graph exists. Rows that differ (a real-row count
    against a padded one) are not this kind."""
    def workload():
        vocab, hot = 6, 3
        logits_buffer = torch.zeros(4, vocab)
        x, head = torch.zeros(4, 2), torch.ones(2, hot if variant == "bug" else vocab)

        def step(size):
            logits = x[:size if variant != "rows" else size - 1] @ head
            logits_buffer[:size].copy_(logits)
            return logits_buffer[:size]

        m = Manager(step, [4], {"x": x})
        try:
            m.capture()
        except RuntimeError:
            pass
    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.of("undersized-buffer") == [], report
        return
    (finding,) = report.of("undersized-buffer")
    assert "logits_buffer[:size].copy_(logits)" in finding.source and "another width" in finding.evidence, finding
    assert "during warmup" in finding.evidence, finding


@pytest.mark.parametrize("announced", [True, False])
@pytest.mark.parametrize("variant", ["bug", "fix", "smaller"])
def test_an_item_assignment_whose_data_does_not_fit_is_an_undersized_buffer(variant, announced):
    """``buffers[:, :n] = ids`` into a graph's ``[1, width]`` input, announced or not yet: the bug's
    graph was sized for one token and the step brings four. Item assignment fails inside ``expand``,
    before any copy is dispatched (into an announced buffer, the slice past its end says so first).
    Data smaller than its destination that does not broadcast (three tokens into four columns) is
    another problem."""
    def workload():
        ids = torch.zeros(1, 1 if variant == "bug" else 4, dtype=torch.int64)
        x = torch.zeros(4)
        m = Manager(lambda size: x[:size] * 2, [4], {"x": x, **({"ids": ids} if announced else {})})
        m.capture()
        step = torch.arange(4) if variant != "smaller" else torch.arange(3)
        try:
            ids[:, :4] = step
        except RuntimeError:
            pass
        m.replay(4)
    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.of("undersized-buffer") == [], report
        return
    (finding,) = report.of("undersized-buffer")
    assert "ids[:, :4] = step" in finding.source and finding.tensor.startswith("ids") == announced, finding
    assert ("a slice asks for [.., 4)" if announced else "elements of shape (1, 1)") in finding.evidence, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_index_past_the_end_of_a_workspace_a_capture_sized_is_an_undersized_buffer(variant):
    """The capture sizes a split-KV workspace for its dummy batch and keeps it; an eager stage of a
    later step needs more splits than that and writes past the workspace's end (the serving loop
    drops the step). The fix sizes the workspace for the step."""
    def workload():
        x = torch.zeros(4)
        spaces = {}

        def forward(size):
            spaces.setdefault(size, torch.zeros(2, 3))         # sized by the dummy batch: 2 splits
            return x[:size] * 2

        m = Manager(forward, [4], {"x": x})
        m.capture()
        splits = 3
        space = spaces[4] if variant == "bug" else torch.zeros(splits, 3)
        try:
            space.index_copy_(0, torch.arange(splits), torch.ones(splits, 3))
        except IndexError:
            pass
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.of("undersized-buffer")
    assert "space.index_copy_" in finding.source and "an index past its end" in finding.evidence, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_host_work_is_not_part_of_a_launch_trace(variant):
    """The step reads its longest length from host metadata (``host()``: pinned memory on CUDA),
    which a capture does not record, and scales its attention with it. The launch traces of the
    replay and the eager step line up past that host read; they part at the op whose arguments
    the frozen length decided: host-work-frozen there, as on CUDA, not a divergence at the read."""
    from workbench.engine import host

    def workload():
        x = torch.zeros(2, 8)
        longest = host(torch.full((1,), 4, dtype=torch.int64))

        def attend(h, n):
            return h.sum(1, keepdim=True) / n

        def forward(size):
            return attend(x[:size], int(longest[0]))

        m = Manager(forward, [2], {"x": x})
        m.capture()
        for step in range(3):
            x.copy_(rows(2, 8, seed=step))
            if variant == "bug":
                longest[0] = 5 + step
            m.replay(2)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.location.endswith(" in attend"), report


def test_an_index_past_the_end_of_an_announced_buffer_is_an_undersized_buffer():
    """An index error is not a ``RuntimeError``: a scatter past the end of a static buffer, caught
    by the serving loop, is reported like a copy that does not fit it."""
    def workload():
        x = torch.zeros(4)
        m = Manager(lambda size: x[:size] * 2, [4], {"x": x})
        m.capture()
        try:
            x.index_copy_(0, torch.arange(5), torch.ones(5))
        except IndexError:
            pass
    (finding,) = doctor.diagnose(workload).of("undersized-buffer")
    assert finding.tensor.startswith("x") and "x.index_copy_" in finding.source, finding


# ------------------------------------------------------------------------------ unwritten memory
@pytest.mark.skipif(torch.cuda.is_available(), reason="the doctor fills no memory where CUDA is available")
def test_eager_allocations_are_filled_while_watching_and_captures_keep_the_users_setting():
    """``torch.empty`` outside a capture holds NaN (integers: their maximum) while the doctor
    watches; inside a capture, and after the block, the user's own deterministic setting stands."""
    seen = {}

    def forward():
        seen["capture"] = (torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled())
        return torch.ones(2) * 2

    with doctor.watch():
        torch.full((64,), 7.0).mul_(2)                  # a previous user of the memory, freed
        floats, ints = torch.empty(64), torch.empty(64, dtype=torch.int32)
        with graph(new_graph("cpu"), name="size 2"):
            forward()
        after_capture = torch.are_deterministic_algorithms_enabled()
    assert torch.isnan(floats).all() and (ints == torch.iinfo(torch.int32).max).all()
    assert seen["capture"] == (False, False) and after_capture and not torch.are_deterministic_algorithms_enabled()

    torch.use_deterministic_algorithms(True)            # the user's strict setting, errors included
    try:
        with doctor.watch():
            warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
            with graph(new_graph("cpu"), name="size 2"):
                forward()
        assert not warn_only and seen["capture"] == (True, False)
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the doctor fills no memory where CUDA is available")
def test_a_cpu_replay_fills_nothing_and_eager_code_after_it_is_filled_again():
    """The emulated replay's ops write the graph's memory or fresh outputs they write whole: no fill
    while it runs (what an observer after the doctor sees at ``replay_begin``), the fill again once
    it is done; under the user's own deterministic mode, their fill stands throughout."""
    class Look:
        def replay_begin(self, graph):
            seen.append(torch.utils.deterministic.fill_uninitialized_memory)

    for users in (False, True):
        seen, look = [], Look()
        torch.use_deterministic_algorithms(users)
        try:
            with doctor.watch():
                x = torch.ones(3)
                g = new_graph("cpu")
                with graph(g, name="size 3"):
                    y = x * 2
                events.subscribe(look)            # after the doctor: it has stepped aside
                try:
                    g.replay()
                finally:
                    events.unsubscribe(look)
                after = torch.empty(64)
        finally:
            torch.use_deterministic_algorithms(False)
        assert seen == [users] and torch.isnan(after).all() and (y == 2).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the doctor fills no memory where CUDA is available")
def test_a_step_reading_memory_no_op_wrote_gets_the_same_answer_every_run():
    """A kernel whose grid misses rows of its output leaves them as the allocation held them: in the
    replay, the capture's poison; in the eager step, what the allocator's previous user left there
    (here, on purpose, 7s). Both are unwritten memory and the doctor compares them as equal, in
    every run; the replay's NaN reaching the output is the program's symptom, not a divergence."""
    def workload():
        x = torch.zeros(4, 3)

        def forward(size):
            computed = x[:size] * 2
            torch.ones_like(computed).mul_(7)              # a previous user of the memory, freed
            out = torch.empty_like(computed)              # rows past the grid are never written
            return torch.where(torch.arange(size)[:, None] < 2, computed, out)

        m = Manager(forward, [4], {"x": x})
        m.capture()
        for step in range(3):
            x.copy_(rows(4, 3, seed=step))
            m.replay(4)
    reports = [doctor.diagnose(workload, padding_probe=False) for _ in range(3)]
    assert [r.findings for r in reports] == [[], [], []], reports[0]


# ------------------------------------------------------------------------ pool blocks handed on
@pytest.mark.parametrize("keep_outputs", [False, True])
def test_an_output_whose_block_a_later_capture_was_given_is_overwritten_by_its_replay(keep_outputs):
    """A runner that keeps only a weak reference to a graph's output frees its block at once: the
    next capture into the pool is given it for a tensor of its own, and that graph's replay writes
    the block. An output of the first graph handed out, then read after the second graph's replay,
    holds the second graph's numbers (``overwritten-output`` at the read). Keeping the output alive
    as long as its graph (the fix) keeps the block, and no finding."""
    def workload():
        weight = torch.linspace(-1, 1, 32).reshape(4, 8)
        ids = torch.zeros(4, dtype=torch.long)
        pool, graphs, kept, outputs = graph_pool_handle("cpu"), {}, {}, {}
        events.static_buffers("Tiny", {"ids": ids})

        def forward(size):
            h = torch.tanh(weight[ids[:size]])
            return torch.cat([h, h])[:size] * 2           # size 2's cat has the bytes of size 4's output

        for size in (4, 2):
            with events.warmup():
                forward(size)
            g = new_graph("cpu")
            with graph(g, pool=pool, name=f"size {size}"):
                out = forward(size)
            graphs[size], outputs[size] = g, (StorageWeakRef(out.untyped_storage()), out.shape)
            if keep_outputs:
                kept[size] = out
            del out

        def output(n):                                    # the output, from its address alone
            ref, shape = outputs[n]
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            return torch.empty(0).set_(storage, 0, shape)

        previous = None
        for step, n in enumerate((4, 2, 4)):
            ids[:n].copy_(torch.arange(n) + step)
            g = graphs[n]
            events.serve(g, n, n, padded={}, outputs=output(n))
            g.replay()
            out = output(n)
            events.handed_out(g, out)
            if previous is not None:
                previous.sum()                            # the previous step's output, read after this replay
            previous = out

    report = doctor.diagnose(workload, padding_probe=False)
    if keep_outputs:
        assert not report.findings, report
    else:
        (finding,) = report.of("overwritten-output")
        assert finding.numbers["overwritten_by"] == "size 2" and "previous.sum()" in finding.source, finding


@pytest.mark.parametrize("handed_out", [False, True])
def test_a_block_one_capture_freed_and_the_next_was_given_is_dangling_or_an_overwritten_output(handed_out):
    """Graph A frees a temporary inside its capture; B, captured next into the same pool, is given
    that block for its tensor, and A's replays still write there. C reads B's tensor. Where B's
    runner hands that tensor out as B's output, C reads an output A's replay overwrote
    (``overwritten-output``); where nobody hands it out (a buffer a library keeps), it is memory
    handed on while its first owner still uses it (``dangling-reference``)."""
    x = torch.ones(4)

    def workload():
        pool, (a, b, c) = graph_pool_handle("cpu"), (new_graph("cpu") for _ in range(3))
        events.static_buffers("Chunks", {"x": x})
        with graph(a, pool=pool, name="A"):
            t = x * 2                       # a temporary, freed inside A's capture
            out_a = t.sum(0, keepdim=True)
            del t
        with graph(b, pool=pool, name="B"):
            y = x + 3                       # given the block A freed
        with graph(c, pool=pool, name="C"):
            z = y * 5
        for step in range(3):
            x.fill_(step)
            for g, real, out in ((b, 4, y), (a, 1, out_a), (c, 4, z)):
                events.serve(g, real, real, padded={}, outputs=out)
                g.replay()
                if handed_out or g is not b:
                    events.handed_out(g, out)
    (finding,) = doctor.diagnose(workload, padding_probe=False).findings
    assert (finding.kind, finding.graph) == ("overwritten-output" if handed_out else "dangling-reference", "C")
    assert finding.source.endswith("y = x + 3                       # given the block A freed"), finding


@pytest.mark.parametrize("alive", [True, False])
def test_a_block_whose_producing_graph_is_gone_is_no_other_graphs_output(alive):
    """A capture reads a block another capture wrote: that graph's output, expected there at every
    replay. Once the producing graph is gone (a graph captured to measure memory, then dropped), its
    memory went with it: what a later capture reads at that address is another tensor."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from workbench.doctor.records import GraphInfo, Op
    from workbench.doctor.rules.pool import PoolReads, block

    t, reads = torch.zeros(4), PoolReads()
    first = new_graph("cpu")
    producer, reader = GraphInfo(first, "first"), GraphInfo(new_graph("cpu"), "second")
    reads.allocated[block(t)] = StorageWeakRef(t.untyped_storage())
    reads.producer[block(t)] = (producer, Op("aten.add.Tensor", "here"), "float32[4]")
    if not alive:
        del first
    reads.captured(reader, torch.ops.aten.mul.Tensor, (t, t), {}, torch.zeros(4), Op("aten.mul.Tensor", "there"))
    assert (block(t) in reader.expects) == alive, reader.expects


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_pool_handle_kept_past_its_graphs_is_a_dangling_reference_where_it_was_made(variant):
    """Two engines one after the other. The first captures into a pool handle cached at class scope,
    resets its graphs at shutdown and keeps its last output; the second is handed the same handle,
    and its capture is refused (CUDA's allocator: ``use_count > 0``). The finding names the line that
    made the handle. Each engine taking a fresh handle is clean."""
    class Backend:
        handle = None

    def engine(x):
        pool = Backend.handle if variant == "bug" else graph_pool_handle("cpu")
        if pool is None:
            pool = Backend.handle = graph_pool_handle("cpu")
        with events.warmup():
            x * 2
        g = new_graph("cpu")
        with graph(g, pool=pool, name="decode"):
            out = x * 2
        g.replay()
        return g, out

    def workload():
        x = torch.ones(4)
        g, kept = engine(x)
        g.reset()                                   # the first engine shuts down; its last output is kept
        try:
            engine(x)
        except GraphError:
            pass
        return kept

    report = doctor.diagnose(workload, padding_probe=False)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "dangling-reference" and "Backend.handle = graph_pool_handle" in finding.source, finding
    assert "was refused" in finding.evidence, finding


@pytest.mark.parametrize("kept", [False, True])
def test_a_graph_warmed_up_and_captured_on_a_worker_thread_is_watched(kept):
    """A runner warms up and captures on a thread of its own (a micro-batch runner); the workspace
    its warmup made lives in that thread's state and goes when the thread ends. The doctor's mode is
    per thread: entered there for the warmup and the capture, it sees the graph read the workspace,
    which is released before the first replay (``dangling-reference``). Kept alive: clean."""
    import threading

    def workload():
        x, local, held, graphs = torch.zeros(4), threading.local(), [], []
        events.static_buffers("runner", {"x": x})

        def forward():
            if not hasattr(local, "workspace"):
                local.workspace = torch.zeros(4)
                held.append(local.workspace) if kept else None
            local.workspace.copy_(x * 2)
            return local.workspace + 1

        def capture_on_thread():
            with events.warmup():
                forward()
            g = new_graph("cpu")
            with graph(g, name="ubatch 0"):
                out = forward()
            graphs.append((g, out))
            del local.workspace                  # the thread's state goes with it

        worker = threading.Thread(target=capture_on_thread)
        worker.start()
        worker.join()
        g, out = graphs[0]
        x.copy_(rows(4, seed=1)[0])
        try:
            g.replay()
        except IllegalMemoryAccess:
            pass

    report = doctor.diagnose(workload, padding_probe=False)
    if kept:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "dangling-reference" and "del local.workspace" in finding.source, finding
    assert "local.workspace.copy_(x * 2)" in finding.evidence, finding


def test_a_worker_thread_whose_warmup_never_ended_is_left_alone_after_the_watch(monkeypatch):
    """A worker begins a warmup and stops before ending it (its code raised); the doctor's mode stays
    on that thread's stack, where nobody else can take it off. After the watch, its ops pass through
    (no rule sees them) and the report, complete at the watch's end, does not change."""
    import threading

    from workbench.doctor.intake import Doctor

    seen, on_op = [], Doctor.on_op
    monkeypatch.setattr(Doctor, "on_op", lambda self, func, *a: (seen.append(func), on_op(self, func, *a))[1])

    started, go_on, done = threading.Event(), threading.Event(), []

    def worker():
        warmup = events.warmup()
        warmup.__enter__()                      # never left
        started.set()
        go_on.wait()
        done.append(torch.ones(3).mul_(2).sum().item())   # after the watch

    with doctor.watch() as report:
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
    before, seen_in_watch = str(report), len(seen)
    go_on.set()
    thread.join()
    assert done == [6.0] and len(seen) == seen_in_watch and str(report) == before, (seen, report)


# ------------------------------------------------------------------ one line, two consumers' data
@pytest.mark.parametrize("variant", ["bug", "fix", "patch"])
def test_a_line_that_overwrites_its_own_data_before_the_replay_is_persistent_mutation(variant):
    """Metadata for two draft steps built by the same builder before one replay: with one buffer
    (bug) the second build overwrites what the first wrote for step 1, and the graph reads step 2's
    lengths twice: ``persistent-mutation`` at the builder's copy. A buffer per step (fix) is clean, and
    so is another line patching what a bulk copy wrote (a next token over shifted ids)."""
    def workload():
        lens = [torch.zeros(2) for _ in range(2)]
        x = torch.zeros(2, 3)
        shared = variant == "bug"

        def build(step_lens, step):
            buf = lens[0] if shared else lens[step]
            buf[:2].copy_(step_lens)
            return buf

        def forward(size):
            return x[:size] * lens[0][:size, None] + x[:size] * lens[1][:size, None]

        m = Manager(forward, [2], {"x": x, "lens0": lens[0], "lens1": lens[1]})
        m.capture()
        for step in range(2):
            x.copy_(rows(2, 3, seed=step))
            if variant == "patch":
                lens[0][:2].copy_(torch.tensor([1.0, 2.0]) + step)
                lens[0][1:2].copy_(torch.tensor([7.0]))          # another line edits what the bulk copy wrote
                lens[1][:2].copy_(torch.tensor([3.0, 4.0]))
            else:
                for k in range(2):
                    build(torch.tensor([1.0, 2.0]) + 2 * k + step, k)
            m.replay(2)

    report = doctor.diagnose(workload, padding_probe=False)
    if variant == "bug":
        (finding,) = report.of("persistent-mutation")
        assert "buf[:2].copy_(step_lens)" in finding.source and finding.tensor.startswith("lens0"), finding
        assert finding.graph == "size 2", finding
    else:
        assert not report.findings, report


# --------------------------------------------------------- padded rows' writes read back by eager code
@pytest.mark.parametrize("neutralised", [False, True])
def test_state_padded_rows_wrote_that_eager_code_reads_back_is_stale_padding(neutralised):
    """Padded rows of a slot index left as the previous step wrote them make the graph write a real
    request's state slot; the runner reads that state back eagerly for a request this step did not
    serve. The write is a masked store of the whole state (no index names a slot), and the graph's
    real-row outputs do not show it; what eager code computes from the state does, between the two
    padded-row fills: ``stale-padding`` at the graph's write. Padded rows pointed at
    the reserved slot 0 (the fix) leave every request's state as it was."""
    def workload():
        slots = torch.zeros(4, dtype=torch.long)
        x = torch.zeros(4, 3)
        state = torch.zeros(5, 3)                     # slot 0: reserved for padded rows

        def forward(size):
            h = x[:size] * 2
            # each row stores its result in its request's slot: a kernel that writes the whole state
            # (a masked store), so no index names a slot
            mine = slots[:size, None] == torch.arange(5)[None, :]
            state.copy_(torch.where(mine.any(0)[:, None], mine.t().float() @ h, state))
            return h + 1

        m = Manager(forward, [4], {"x": x, "slots": slots}, state={"state": state})
        m.capture()
        state.zero_()
        seen = []
        for step, reqs in enumerate(([1, 2, 3, 4], [3, 4], [1, 2])):
            n = len(reqs)
            seen.append(state[torch.tensor(reqs)].sum(1))  # the runner reads its requests' states back
            x[:n].copy_(rows(n, 3, seed=step))
            slots[:n].copy_(torch.tensor(reqs))
            if neutralised:
                slots[n:].fill_(0)
            m.replay(n, padded={"x": x, "slots": slots})

    report = doctor.diagnose(workload)
    if neutralised:
        assert not report.findings, report
    else:
        (finding,) = report.of("stale-padding")
        assert "copy_" in finding.op and "state.copy_(torch.where" in finding.source, finding
        assert "eager code computes other values" in finding.evidence, finding


# ------------------------------------------------------------------------------ errors raised before dispatch
def _served_once(x: torch.Tensor) -> None:
    """A graph of 4 rows over the static input ``x``, captured and replayed once: graphs exist."""
    m = Manager(lambda size: x[:size] * 2, [4], {"x": x})
    m.capture()
    x.copy_(rows(4))
    m.replay(4)


def _metadata_step(lengths, how):
    """A runner step whose host metadata check fails before any op reaches a dispatch mode
    (``repeat_interleave``'s size check), caught as ``how`` says."""
    x = torch.zeros(4, 4)

    def build(lens):
        return torch.repeat_interleave(torch.tensor(lens), torch.tensor([1, 1, 1, 1]))

    def probe():
        try:
            return torch.repeat_interleave(torch.tensor(lengths), torch.tensor([1, 1, 1, 1]))
        except RuntimeError:             # the function that called the op catches it: a capability probe
            return None

    def refuse():
        raise ValueError("no metadata for this batch")

    def deliberate():
        return refuse()                  # raised on purpose one call down, caught two calls up

    def workload():
        _served_once(x)
        try:
            {"escapes": lambda: build(lengths), "probe": probe, "deliberate": deliberate}[how]()
        except (RuntimeError, ValueError):     # a serving loop that drops the batch
            pass
    return workload


def test_an_error_a_library_check_raised_before_dispatch_and_the_workload_caught_is_reported():
    report = doctor.diagnose(_metadata_step([2, 2, 2], "escapes"))
    assert len(report.caught) == 1 and report.caught[0].startswith("RuntimeError: repeats must have the same size")
    assert "in build" in report.caught[0] and "raised inside the workload and caught" in report.headline()
    assert not report.clean


@pytest.mark.parametrize("how", ["probe", "deliberate"])
def test_errors_caught_where_raised_or_raised_on_purpose_are_not_reported(how):
    report = doctor.diagnose(_metadata_step([2, 2, 2], how))
    assert report.caught == [] and report.findings == [], report


def _allocating_step(workspace: int):
    """Graphs captured, then a step whose planner asks a fixed workspace for more than it holds; the
    allocator refuses with a ``raise`` two calls down, and the zoo's ``compare`` (a harness, not the
    workload's code) catches what the served run raises."""
    from workbench.zoo.kit import compare

    buf = torch.zeros(workspace)

    def aligned_alloc(n):
        if n > buf.numel():
            raise RuntimeError(f"Failed to allocate {n} elements from a workspace of {buf.numel()}")
        return buf[:n]

    def plan(n):
        return aligned_alloc(n)

    def served():
        x = torch.zeros(4, 4)
        _served_once(x)
        return [plan(8).clone()]

    return lambda: compare("allocating", "bug", "cpu", served, lambda: [torch.zeros(8)])


@pytest.mark.parametrize("workspace", [4, 8])
def test_a_raise_a_harness_caught_outside_the_workloads_code_is_reported(workspace):
    report = doctor.diagnose(_allocating_step(workspace))
    if workspace == 8:
        assert report.caught == [] and report.findings == [], report
        return
    assert len(report.caught) == 1 and report.caught[0].startswith("RuntimeError: Failed to allocate 8"), report
    assert "in aligned_alloc" in report.caught[0] and not report.clean


def _keyed_step(key: int, caught_by_workload: bool):
    """Graphs captured, then a step that looks its parameters up in a table keyed by the captured
    sizes, two calls down; a key no size has raises ``KeyError``. The workload's own caller may
    catch it (a lookup with a fallback: a protocol), or the zoo's ``compare`` (a harness) does."""
    from workbench.zoo.kit import compare

    params = {1: torch.ones(1), 2: torch.ones(2)}

    def lookup(size):
        return params[size]

    def update(size):
        return lookup(size) * 2

    def step():
        try:
            return update(key)
        except KeyError:
            if not caught_by_workload:
                raise
            return torch.zeros(key)

    def served():
        _served_once(torch.zeros(4, 4))
        return [step().clone()]

    return lambda: compare("keyed", "bug", "cpu", served, lambda: [torch.ones(key) * 2])


@pytest.mark.parametrize("key, caught_by_workload", [(3, False), (3, True), (2, False)])
def test_a_lookup_error_a_harness_caught_is_reported_and_one_the_workload_handled_is_not(key, caught_by_workload):
    report = doctor.diagnose(_keyed_step(key, caught_by_workload))
    if caught_by_workload or key == 2:
        assert report.caught == [] and report.findings == [], report
        return
    assert len(report.caught) == 1 and report.caught[0].startswith("KeyError: 3"), report
    assert "in lookup" in report.caught[0] and not report.clean


def _refused_setup(batch: int):
    """A served run whose graph wrapper refuses the step's batch in its plan, before anything is
    captured (a wrapper fixed to a batch size in graph mode), after its reference run; the zoo's
    ``compare`` catches the error."""
    from workbench.zoo.kit import compare

    def plan(fixed, n):
        if n != fixed:
            raise ValueError(f"the batch size should be fixed in graph mode: {n} against {fixed}")
        return torch.ones(n)

    def prepare(n):
        return plan(batch, n) * 2

    return lambda: compare("refused", "bug", "cpu", lambda: [prepare(3).clone()], lambda: [torch.ones(3) * 2])


@pytest.mark.parametrize("batch", [4, 3])
def test_a_served_run_that_fails_before_any_capture_is_not_nothing_captured(batch):
    report = doctor.diagnose(_refused_setup(batch))
    if batch == 3:
        assert report.caught == [] and "nothing was captured" in report.headline(), report
        return
    assert len(report.caught) == 1 and report.caught[0].startswith("ValueError: the batch size"), report
    assert "nothing was captured" not in report.headline() and not report.clean


@pytest.mark.parametrize("error", ["IllegalMemoryAccess", "GraphError"])
@pytest.mark.parametrize("capacity", [7, 8])
def test_a_kernels_fault_the_workload_models_and_a_harness_caught_is_reported(capacity, error):
    """A kernel stand-in that writes through a bare pointer raises the engine's ``IllegalMemoryAccess``
    itself when a store leaves the allocation, as CUDA faults; one launched with a grid it cannot
    have raises ``GraphError`` as CUDA refuses the launch: the served run ends there, and the report
    says so instead of "0 findings" (the engine's own ``IllegalMemoryAccess``, a replay's read of
    released memory, is the dangling rules')."""
    from workbench import engine
    from workbench.zoo.kit import compare
    fault = getattr(engine, error)

    def store_indices(out, n):
        if n > out.numel():
            raise fault("CUDA error: an illegal memory access was encountered")
        out[:n] = torch.arange(n, dtype=out.dtype)

    def build(n):
        out = torch.empty(capacity)
        store_indices(out, n)
        return out[:n]

    def served():
        _served_once(torch.zeros(4, 4))
        return [build(8).clone()]

    report = doctor.diagnose(lambda: compare("faulting", "bug", "cpu", served, lambda: [torch.arange(8.)]))
    if capacity == 8:
        assert report.caught == [] and report.findings == [], report
        return
    assert len(report.caught) == 1 and report.caught[0].startswith(f"{error}: CUDA error"), report
    assert "in store_indices" in report.caught[0] and not report.clean


class _DriverError(RuntimeError):
    """A binding's error for a failed driver call."""


def test_a_raise_given_the_id_of_an_error_caught_before_is_still_reported():
    """A binding parks a failed call's error (caught where it was raised, in a destructor) and raises a
    new one at its next call: CPython gives the new error the freed one's id. It is new all the same
    (it does not come up from the frame the old one left), and the harness caught it."""
    from workbench.zoo.kit import compare
    ids = []

    def wait_event():
        raise _DriverError("CUDA_ERROR_INVALID_VALUE")

    def record_err(call, parked):
        try:
            call()
        except _DriverError as e:
            ids.append(id(e))
            parked.append(e.args[0])

    def check_err(parked):
        if parked:
            error = _DriverError(parked.pop())
            ids.append(id(error))
            raise error

    def served():
        x = torch.zeros(4, 4)
        _served_once(x)
        parked = []
        record_err(wait_event, parked)           # a drop parks the error
        check_err(parked)                        # the next call raises it
        return [x]

    report = doctor.diagnose(lambda: compare("parked", "bug", "cpu", served, lambda: [torch.zeros(4, 4)]))
    assert ids[0] == ids[1], "the condition under test: the new error was given the caught one's id"
    assert len(report.caught) == 1 and report.caught[0].startswith("_DriverError: CUDA_ERROR_INVALID_VALUE")
    assert "in check_err" in report.caught[0] and not report.clean


def test_errors_the_standard_library_raises_and_catches_itself_are_not_reported():
    """``re`` compiling a new pattern raises and catches ``IndexError`` inside its parser (at the end of
    every pattern); the standard library is not the workload's code and is not traced."""
    def workload():
        x = torch.zeros(4)
        m = Manager(lambda size: x[:size] * 2, [4], {"x": x})
        m.capture()
        re.purge()
        re.compile(r"(?P<tag>[A-Za-z_]\w*)x{2}(?:ab|cd)+$")
        x[:] = 1.0
        m.replay(4)
    report = doctor.diagnose(workload)
    assert report.caught == [] and report.findings == [], report


def test_a_step_whose_metadata_fits_is_clean():
    report = doctor.diagnose(_metadata_step([2, 2, 2, 2], "escapes"))
    assert report.caught == [] and report.findings == [], report


def _host_staging(width):
    """A runner that stages each step's block table in a NumPy array sized for 4 blocks a row, then
    copies it into the graph's static input; a step with ``width`` blocks, in a loop that drops a
    batch whose preparation fails."""
    import numpy as np
    table = torch.zeros(2, 4, dtype=torch.int64)
    staging = np.zeros((2, 4), dtype=np.int64)

    def prepare(blocks):
        for i, row in enumerate(blocks):
            staging[i, :len(row)] = row
        table.copy_(torch.from_numpy(staging))

    def workload():
        m = Manager(lambda size: table[:size] * 2, [2], {"table": table})
        m.capture()
        try:
            prepare([list(range(width)), [1]])
            m.replay(2)
        except ValueError:
            pass
    return workload


def test_a_host_staging_write_that_does_not_fit_is_an_undersized_buffer():
    report = doctor.diagnose(_host_staging(5))
    found = report.of("undersized-buffer")
    assert len(found) == 1 and found[0].location.endswith("in prepare"), report
    assert "shape (5,)" in found[0].evidence and "(4,)" in found[0].evidence
    assert doctor.diagnose(_host_staging(4)).findings == []


def _staged_lengths(padded):
    """A runner that pads a step of 3 requests to its graph of 4 and stages the requests' lengths in a
    NumPy array: into the padded rows' slice (``lens_np[:4] = three``, which NumPy refuses), or into
    the real rows' slice with the padded rows zeroed."""
    import numpy as np
    lens = torch.zeros(4, dtype=torch.int64)
    lens_np = np.zeros(4, dtype=np.int64)

    def prepare(real_lens, bs):
        if padded:
            lens_np[:bs] = np.array(real_lens)
        else:
            lens_np[:len(real_lens)] = real_lens
            lens_np[len(real_lens):bs] = 0
        lens.copy_(torch.from_numpy(lens_np))

    def workload():
        m = Manager(lambda size: lens[:size] * 2, [2, 4], {"lens": lens})
        m.capture()
        for real in ([5, 6], [5, 6, 7]):
            try:
                prepare(real, 2 if len(real) <= 2 else 4)
                m.replay(len(real))
            except ValueError:
                pass
    return workload


def test_a_host_staging_write_of_the_real_rows_into_the_padded_rows_slice_is_a_padded_shape_mismatch():
    report = doctor.diagnose(_staged_lengths(padded=True))
    (found,) = report.findings
    assert found.kind == "padded-shape-mismatch" and found.location.endswith("in prepare"), report
    assert "4 rows" in found.evidence and "3 rows" in found.evidence
    assert doctor.diagnose(_staged_lengths(padded=False)).findings == []


@pytest.mark.parametrize("statement", ["a[i] = v", "a[:n] = v", "a[i, :n] = v"])
def test_every_item_assignment_instruction_is_read_as_one(statement):
    """The host-write rules run where a frame raised on an item assignment; Python 3.12 compiles a
    slice's (``a[:n] = v``) to an instruction of its own (STORE_SLICE), which must count too."""
    import dis
    from workbench.doctor import raised
    stores = [i for i in dis.get_instructions(compile(statement, "<test>", "exec")) if i.opname.startswith("STORE_")
              and i.opname not in ("STORE_NAME", "STORE_FAST", "STORE_GLOBAL")]
    assert len(stores) == 1 and stores[0].opcode in raised._STORES, stores


def _restored_after_capture(dummy_slot):
    """Per-request lengths advanced by each row's slot; the capture's dummy rows write
    ``dummy_slot`` and the runner restores the lengths afterwards (as TensorRT-LLM's spec workers
    do); padded rows of served steps get ``dummy_slot`` too. Slot 4 is reserved for them."""
    lens = torch.zeros(5, dtype=torch.int64)
    slots = torch.full((4,), dummy_slot, dtype=torch.int64)

    def forward(size):
        lens.index_add_(0, slots[:size], torch.ones(size, dtype=torch.int64))
        return lens[slots[:size]] * 1

    def workload():
        m = Manager(forward, [4], {"slots": slots}, state={"lens": lens})
        saved = lens.clone()
        m.capture()
        lens.copy_(saved)                     # what the dummy rows advanced is put back
        lens[:2] = torch.tensor([5, 3])       # two requests' prefills
        for _ in range(2):
            slots.copy_(torch.tensor([0, 1, dummy_slot, dummy_slot]))
            m.replay(2)
    return workload


def test_state_a_runner_restored_after_capture_is_not_live_data():
    assert doctor.diagnose(_restored_after_capture(4)).findings == []
    found = doctor.diagnose(_restored_after_capture(0)).of("stale-padding")
    assert found and found[0].op == "aten.index_add_.default", found


def test_real_rows_of_a_one_by_tokens_output_are_its_second_dimension():
    """A ``[1, tokens, vocab]`` output (lmdeploy's logits): its real rows are along the tokens, so a
    padded row an earlier step left in the static input changes nothing real rows get."""
    x = torch.zeros(4, 2)

    def workload():
        m = Manager(lambda size: (x[:size] * 2)[None], [4], {"x": x})
        m.capture()
        for n in (3, 2):
            x[:n].copy_(rows(n, 2, seed=n))
            m.replay(n)
    assert doctor.diagnose(workload).findings == []


class _Scaled:
    """A step that multiplies by a scale the trainer sets between steps: a 0-dim host tensor that
    ``set_scale`` rebinds (bug: CUDA passes it by value, the graph keeps the capture's number), or
    a device tensor it writes in place (fix)."""

    def __init__(self, fixed):
        from workbench.engine import host
        self.fixed, self.x = fixed, torch.zeros(2, 2)
        self.scale = torch.ones(()) if fixed else host(torch.tensor(1.0))

    def set_scale(self, value):
        from workbench.engine import host
        if self.fixed:
            self.scale.copy_(torch.tensor(value))
        else:
            self.scale = host(torch.tensor(value))

    def forward(self, size):
        return self.x[:size] * self.scale


@pytest.mark.parametrize("fixed", [False, True])
def test_a_host_scalar_given_to_a_captured_op_is_a_constant_not_a_reference(fixed):
    model = _Scaled(fixed)

    def workload():
        m = Manager(model.forward, [2], {"x": model.x})
        m.capture()
        for step, value in enumerate((0.5, 0.25)):
            model.set_scale(value)
            model.x.copy_(rows(2, 2, seed=step))
            m.replay(2)
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [], report
    else:
        assert report.kinds == {"host-work-frozen"}, report
        assert "('scalar', '1.0') in the graph and ('scalar', '0.5')" in report.findings[0].cause


class _Connector:
    """Transfers queued per layer before the step, landed by the forward's wait (a layer-wise KV
    connector). ``piecewise``: the wait runs in an eager region between graphs, at every step (the
    fix); else inside the captured forward, where a replay runs no Python (the bug)."""

    def __init__(self):
        self.cache, self.queued = torch.zeros(4, 2), {}

    def start_load(self, rows_):
        self.queued["layer0"] = [(torch.arange(2), rows_)]

    def wait(self, layer):
        for slots, values in self.queued.pop(layer, []):
            self.cache[slots] = values
        return self.cache


@pytest.mark.parametrize("piecewise", [False, True])
def test_differential_replay_puts_host_state_back_and_names_host_work_the_graph_skips(piecewise):
    """The eager re-run takes the step's transfers off the queue; the program must find them where
    the replay left them (its results the same watched and not), and a FULL graph that skipped the
    wait is host work frozen at the line that drained the queue."""
    from workbench.engine import CUDAGraphMode, GraphManager

    def program():
        conn, x = _Connector(), torch.zeros(2, 2)
        mode = CUDAGraphMode.PIECEWISE if piecewise else CUDAGraphMode.FULL
        manager = GraphManager(lambda size: (x[:size] * 2) + wait("layer0")[:size], [2], device="cpu", mode=mode,
                               static_buffers={"x": x}, name="Tiny")
        events.persistent_state("Tiny", {"cache": conn.cache})
        wait = manager.eager(conn.wait)
        manager.capture()
        conn.cache.zero_()
        outs = []
        for step in range(3):
            x.copy_(rows(2, 2, seed=step))
            conn.start_load(rows(2, 2, seed=10 + step))
            outs.append(manager.replay(2, 2).clone())
            outs.append(conn.cache.clone())
            conn.queued.clear()
        return torch.cat(outs)

    unwatched = program()
    watched = []
    report = doctor.diagnose(lambda: watched.append(program()))
    assert torch.equal(watched[0], unwatched)
    if piecewise:
        assert report.findings == [], report
    else:
        found = report.of("host-work-frozen")
        assert found and "in wait: for slots, values in self.queued.pop(layer, [])" in found[0].source, report
        assert found[0].tensor == "_Connector.queued", found[0]


def test_eager_regions_of_a_piecewise_capture_write_dummy_data():
    """Between the pieces of a PIECEWISE capture, eager code runs on the capture's dummy batch: its
    cache writes are no live data, so the next size's capture writing the same rows is no finding;
    a re-capture after real steps wrote those rows is."""
    from workbench.engine import CUDAGraphMode, GraphManager

    def workload(recapture):
        cache, x = torch.zeros(4, 2), torch.zeros(2, 2)

        def store(h):
            cache[:h.shape[0]] = h            # the dummy batch's keys land in slots 0..size
            return cache[:h.shape[0]] * 1.0
        manager = GraphManager(lambda size: region(x[:size] + 1) * 2, [1, 2], device="cpu",
                               mode=CUDAGraphMode.PIECEWISE, static_buffers={"x": x}, name="Tiny")
        events.persistent_state("Tiny", {"cache": cache})
        region = manager.eager(store)
        manager.capture()
        cache.zero_()
        x.copy_(rows(2, 2, seed=1))
        manager.replay(2, 2)
        if recapture:
            manager.recapture()
    assert doctor.diagnose(lambda: workload(False)).findings == []
    found = doctor.diagnose(lambda: workload(True)).of("persistent-mutation")
    assert found and "in store" in found[0].source, found


@pytest.mark.parametrize("train", [False, True])
def test_a_warmup_that_runs_backward_is_a_training_step(train):
    """PyTorch's whole-network capture warms up with a real optimizer step: the weights it moves are
    training, not dummy data. A forward-only warmup that moves the same weights is still reported."""
    w = torch.ones(2, 2, requires_grad=True)
    x = torch.zeros(2, 2)

    def step():
        if train:
            loss = (x @ w).sum()
            w.grad = None
            loss.backward()
            with torch.no_grad():
                w.sub_(0.1 * w.grad)
            return loss.detach()
        with torch.no_grad():
            w.mul_(0.5)                      # a dummy batch that moves the weights
            return (x @ w).sum()

    def workload():
        events.static_buffers("trainer", {"x": x})
        events.persistent_state("trainer", {"w": w})
        x.copy_(rows(2, 2, seed=0))
        with events.warmup():
            step()
        g = new_graph("cpu")
        with graph(g, name="train step"):
            out = step()
        for i in range(2):
            x.copy_(rows(2, 2, seed=i + 1))
            events.serve(g, 2, 2, outputs=out, eager=step)
            g.replay()
            events.handed_out(g, out)
    report = doctor.diagnose(workload)
    if train:
        assert report.findings == [], report
    else:
        assert "persistent-mutation" in report.kinds, report


def test_a_per_group_table_filled_past_what_the_kernel_reads_is_no_finding_when_the_results_agree():
    """``starts`` holds a cumulative sum per adapter group, written for every group the step has;
    the captured kernel reads only the start of each block it launches (one, for this graph), and
    so does the eager form. Rows past the window are the step's bookkeeping, not data the graph
    drops: held, and let go when the workload's results equal its run without graphs'."""
    from workbench.zoo.kit import capture, compare, replay

    def kernel(x, starts):
        return x * (starts[0:1].float() + 1.0)

    data = [torch.full((4,), float(i)) for i in range(3)]

    def served():
        x, starts = torch.zeros(4), torch.zeros(4, dtype=torch.long)
        g, out = capture(lambda: kernel(x, starts), device="cpu", static={"x": x, "starts": starts})
        outs = []
        for d in data:
            x.copy_(d)
            starts[1:4].copy_(torch.tensor([1, 3, 4]))          # the cumulative counts: the step's own table
            outs.append(replay(g, out, real=4, size=4).clone())
        return outs

    report = doctor.diagnose(lambda: compare("starts", "fix", "cpu", served, lambda: [d * 1.0 for d in data]))
    assert not report.of("undersized-buffer"), report


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("cut_inside", [False, True])
def test_a_graph_whose_view_of_a_per_token_input_is_shorter_than_its_real_rows(fixed, cut_inside):
    """A graph of 4 tokens captured on ``slots[:2]`` (sliced by the request count, not the tokens):
    a step of 3 real tokens writes a slot the graph never reads. The window is fixed at capture, and
    the finding names the line that cut it: set-up code's (``sliced``), or the captured op's that
    reads it when the captured code cuts it itself."""
    slots, cache, x = torch.zeros(4, dtype=torch.long), torch.zeros(6, 2), torch.zeros(4, 2)
    n_view = 4 if fixed else 2

    def sliced():
        return slots[:n_view]

    def workload():
        events.static_buffers("runner", {"slots": slots, "x": x})
        events.persistent_state("runner", {"cache": cache})
        view = None if cut_inside else sliced()

        def forward():
            v = slots[:n_view] if cut_inside else view
            cache.index_copy_(0, v, x[:v.shape[0]])
            return cache[:4] * 1.0
        with events.warmup():
            forward()
        g = new_graph("cpu")
        with graph(g, name="size 4"):
            out = forward()
        cache.zero_()
        for n in (3, 2):
            slots[:n].copy_(torch.arange(n) + 1)
            slots[n:].fill_(5)
            x[:n].copy_(rows(n, 2, seed=n))
            events.serve(g, n, 4, outputs=out, eager=forward)
            g.replay()
            events.handed_out(g, out[:n])
    report = doctor.diagnose(workload)
    if fixed:
        assert report.of("undersized-buffer") == [], report
    else:
        found = report.of("undersized-buffer")
        assert found and found[0].numbers["rows_read"] == 2, report
        assert ("in forward" if cut_inside else "in sliced") in found[0].source, report


@pytest.mark.parametrize("short", [False, True])
def test_pad_ids_a_step_writes_past_its_graphs_tokens_are_no_data_the_graph_drops(short):
    """A slot row ``[1, 4]`` that each step fills whole, its tokens' slots then the pad id -1 (vLLM's
    slot-mapping kernel pads the rest of the buffer), served by graphs of 1, 2 and 4 tokens that each
    read their own width, a view set-up code cut (so the eager step reads through it too). The
    graphs of 1 and 2 never read the pads: the workload's results agree with its run without graphs,
    so a note says so and nothing is found. Cut at a width of 3 (``short``), the graph of 4 drops a
    real token's slot, and the results part."""
    slots, emb = torch.full((1, 4), -1, dtype=torch.long), torch.arange(1.0, 9.0)
    views = {}

    def forward(size):
        return emb[views[size].clamp(min=0)].sum().expand(size) * 1.0

    def step(real):
        row = torch.full((4,), -1, dtype=torch.long)
        row[:len(real)] = torch.tensor(real)
        slots[0].copy_(row)

    batches = ([2], [2, 5], [2, 5, 6, 7], [3])

    def workload():
        with events.reference():
            reference = []
            for real in batches:
                reference.append(emb[torch.tensor(real)].sum().expand(len(real)) * 1.0)
        m = Manager(forward, [1, 2, 4], {"slots": slots})
        views.update({size: slots[0, :3 if short and size == 4 else size] for size in m.sizes})
        m.capture()
        served = []
        for real in batches:
            step(real)
            served.append(m.replay(len(real)).clone())
        events.results(reference, served)

    report = doctor.diagnose(workload)
    found = report.of("undersized-buffer")
    if short:
        assert any(f.graph == "size 4" and f.numbers["elements_read"] == 3 for f in found), report
    else:
        assert found == [] and report.findings == [], report
        assert any("nothing the steps needed" in n for n in report.notes), report.notes


def test_a_per_request_buffer_shorter_than_the_steps_tokens_is_not_cut_by_its_window():
    """A verify graph serves 8 tokens (2 requests of 4 drafts) and reads the request offsets
    ``indptr[:2]`` of a buffer of 3 (the end offset is the runner's, no kernel reads it): the
    buffer has no row for each of the step's real rows, so rows past the graph's window are no
    tokens of the step that it leaves unread."""
    indptr, x = torch.zeros(3, dtype=torch.long), torch.zeros(8, 2)

    def forward(size):
        return x * indptr[:2].repeat_interleave(4)[:, None]

    def workload():
        m = Manager(forward, [8], {"indptr": indptr, "x": x})
        m.capture()
        for seed in (1, 2):
            indptr.copy_(torch.tensor([0, 4, 8]) + seed)
            x.copy_(rows(8, 2, seed=seed))
            m.replay(8)

    report = doctor.diagnose(workload)
    assert report.of("undersized-buffer") == [], report


def test_an_eager_steps_copies_past_a_graphs_window_are_not_the_next_replays_data():
    """A per-request ``lens`` the graph of 3 tokens (one request of three) reads as ``lens[:1]``. A
    prefill of three requests, run eagerly, wrote ``lens[:3]`` and used none of it; the
    decode step then writes ``lens[:1]``: its data fits the window, and the rows past it were the
    prefill's."""
    lens, x = torch.zeros(3, dtype=torch.long), torch.zeros(3, 2)

    def decode():
        return x * lens[:1, None]

    def workload():
        events.static_buffers("runner", {"lens": lens, "x": x})
        with events.warmup():
            decode()
        g = new_graph("cpu")
        with graph(g, name="size 3"):
            out = decode()
        lens[:3].copy_(torch.tensor([1, 2, 1]))          # the prefill's requests
        x.copy_(rows(3, 2, seed=1))
        (x * 2).sum()                                      # the prefill, eagerly: it needs no lengths
        lens[:1].copy_(torch.tensor([4]))                  # one request decoding three tokens
        x.copy_(rows(3, 2, seed=2))
        events.serve(g, 3, 3, outputs=out, eager=decode)
        g.replay()
        events.handed_out(g, out)
    report = doctor.diagnose(workload)
    assert report.of("undersized-buffer") == [], report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_reading_its_segment_of_each_peers_rows_leaves_the_rest_on_purpose(variant):
    """A symmetric buffer holds each peer rank's partial outputs for all tokens; rank 1's graph reads
    its own segment (tokens 2..3) of every peer's rows, and the peers publish whole rows. What lies
    around the segment is the other ranks' to read: no finding (fix). The bug captured on a window
    of the hidden width the capture's dummy batch had, one column: the second column each step
    copies is dropped (a window too short), which an eager step, at the width now, reads."""
    partials = torch.zeros(4, 4, 2)                 # [rank, token, hidden]
    hidden = [1]                                    # the width of the capture's dummy batch

    def reduce_scatter():
        window = partials[:, 2:4] if variant == "fix" else partials[:, 2:4, :hidden[0]]
        return window.sum(0) * 2

    def workload():
        events.static_buffers("symmetric memory", {"partials": partials})
        with events.warmup():
            reduce_scatter()
        g = new_graph("cpu")
        with graph(g, name="draft moe"):
            out = reduce_scatter()
        hidden[0] = 2
        for step in range(2):
            for r in range(4):
                partials[r].copy_(rows(4, 2, seed=10 * step + r))     # a peer publishes its whole rows
            events.serve(g, 2, 2, outputs=out, eager=reduce_scatter)
            g.replay()
            events.handed_out(g, out)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    # (and the width the capture froze is host work frozen: both name the same cause)
    assert [f.kind for f in report.findings] == ["undersized-buffer", "host-work-frozen"], report


# ------------------------------------------------------------ host values a replay leaves as it found
_TRACKER: dict = {}


def _save_to_tracker(loss, group):
    entry = _TRACKER.setdefault("aux", {"values": torch.zeros(())})
    entry["values"] += loss.detach().sum()         # the graph repeats this add...
    entry["group"] = group                         # ...but not this host work


class _Router:
    def __init__(self):
        self.x, self.group = torch.zeros(4, 3), "tp"

    def forward(self, size):
        y = self.x[:size] * 2
        _save_to_tracker(y, self.group)
        return y


@pytest.mark.parametrize("fixed", [False, True])
def test_a_python_value_the_step_sets_and_code_outside_the_graph_clears_is_host_work(fixed):
    """A logging tracker in a module global: the captured forward adds into its values and sets
    its reduction group; the end of each iteration clears it (bug: the group too). Outputs agree,
    but the eager step sets the group where the replay leaves ``None``: host-work-frozen at the
    assignment. A value set by an eager-only path (a count the capture never ran) is not."""
    def workload():
        _TRACKER.clear()
        r = _Router()
        m = Manager(r.forward, [2, 4], {"x": r.x})
        m.capture()
        for step in range(3):
            r.x[:3].copy_(rows(3, 3, seed=step))
            m.replay(3)
            _TRACKER["aux"]["values"].zero_()
            if not fixed:
                _TRACKER["aux"]["group"] = None
    report = doctor.diagnose(workload)
    assert report.failure is None and not report.errors, report
    if fixed:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.location.endswith("in _save_to_tracker"), finding
    assert "entry[\"group\"] = group" in finding.source and finding.tensor == "_TRACKER['aux']['group']"


@pytest.mark.parametrize("results", ["agree", "differ"])
def test_a_python_value_the_replay_leaves_is_judged_by_the_workloads_own_results(results):
    """The tracker above, with the workload's run without graphs announced: the group the replay
    leaves cleared is reported only where the workload says its results differ from that run's
    (a mode string set in the forward that nothing reads is no fault)."""
    def workload():
        _TRACKER.clear()
        with events.reference():
            expected = [rows(3, 3, seed=step) * 2 for step in range(3)]
        r = _Router()
        m = Manager(r.forward, [2, 4], {"x": r.x})
        m.capture()
        got = []
        for step in range(3):
            r.x[:3].copy_(rows(3, 3, seed=step))
            got.append(m.replay(3)[:3].clone())
            _TRACKER["aux"]["values"].zero_()
            _TRACKER["aux"]["group"] = None
        events.results(expected, got if results == "agree" else [g + 1 for g in got])
    report = doctor.diagnose(workload)
    assert report.failure is None and not report.errors, report
    if results == "agree":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.tensor == "_TRACKER['aux']['group']", finding


class _Scratch:
    """An eager-only path that grows a scratch size of its own (the capture took another path, as
    a capture-owned scratch does), in a function the capture never ran."""

    def __init__(self):
        self.x, self.reserved = torch.zeros(4, 3), 0

    def reserve(self, n):
        if n > self.reserved:
            self.reserved = n

    def forward(self, size):
        if not torch.cuda.is_current_stream_capturing():
            self.reserve(size)
        return self.x[:size] + 1


def test_a_value_set_by_code_the_capture_never_ran_is_not_host_work():
    def workload():
        s = _Scratch()
        m = Manager(s.forward, [4], {"x": s.x})
        m.capture()
        for step in range(3):
            s.x.copy_(rows(4, 3, seed=step))
            m.replay(4)
            s.reserved = 0                      # the scratch released between steps
    report = doctor.diagnose(workload)
    assert report.findings == [] and report.failure is None and not report.errors, report
    assert "differential replay: 3 replay(s) compared" in " ".join(report.notes), report.notes


# ------------------------------------------------------------ host work a replay leaves undone
class _Saver:
    """A KV connector. Bug: the attention hook queues the layer's save when the step's metadata
    is bound (the capture bound none, and a replay runs no hook); fix: ``wait_for_save``, after the
    step, queues it. Either way ``wait_for_save`` stores what is queued."""

    def __init__(self, in_hook: bool):
        self.in_hook, self.meta, self.queue, self.stored = in_hook, None, [], []

    def save_layer(self, kv):
        if self.in_hook and self.meta is not None:
            self.queue.append((self.meta, kv))

    def wait_for_save(self, kv):
        if not self.in_hook and self.meta is not None:
            self.queue.append((self.meta, kv))
        self.stored += [(meta, t.clone()) for meta, t in self.queue]
        self.queue.clear()


class _SavingLayer:
    def __init__(self, saver):
        self.x, self.saver = torch.zeros(4, 3), saver

    def forward(self, size):
        kv = self.x[:size] * 2
        self.saver.save_layer(kv)
        return kv


@pytest.mark.parametrize("fixed", [False, True])
def test_a_queue_the_captured_step_fills_in_python_is_host_work_when_the_results_differ(fixed):
    """Outputs and state agree with an eager run of the step, but that eager step queues a save the
    replay never does, and the store the workload reports lacks what its run without graphs
    saved: host-work-frozen at the hook's append. (The served run's eager prefill runs the hook's
    path too: no line of it is one the served run never ran.) The fix queues the save after the replay."""
    def served(eager: bool):
        saver = _Saver(in_hook=not fixed)
        layer = _SavingLayer(saver)
        m = None if eager else Manager(layer.forward, [4], {"x": layer.x})
        if m is not None:
            m.capture()
        for step in range(4):                   # a prefill of 4 rows, eager in both runs, then decodes of 3
            n = 4 if step == 0 else 3
            layer.x[:n].copy_(rows(n, 3, seed=step))
            saver.meta = step
            out = layer.forward(n) if eager or step == 0 else m.replay(n)[:n]
            saver.wait_for_save(out)
            saver.meta = None
        return torch.tensor([float(len(saver.stored))])

    def workload():
        with events.reference():
            expected = served(eager=True)
        events.results([expected], [served(eager=False)])
    if (finding := only_finding(workload, "fix" if fixed else "bug")) is None:
        return
    assert finding.kind == "host-work-frozen" and finding.location.endswith("in save_layer"), finding
    assert "self.queue.append" in finding.source and finding.tensor == "_Saver.queue", finding


# ------------------------------------------------------------------- a dummy batch's index past a table
@pytest.mark.parametrize("held_by", ["input", "state"])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_dummy_batch_index_past_a_table_is_named_by_the_buffer_that_holds_it(held_by, fixed):
    """A warmup's dummy batch looks up a table that is no static buffer (a rotary cache, a KV pool)
    past its end. The index held by a static input (the dummy positions) is data that does not
    fit: undersized-buffer; held by state the dummy rows index (a request-to-slot table left as
    allocated) it is entries no request wrote: stale-padding. The fixes bound the dummy data, or
    initialise the entries."""
    table = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    pos = torch.zeros(4, dtype=torch.long)
    slots = torch.full((2, 3), 0 if fixed else 1 << 20, dtype=torch.long)      # row 0: the dummy request's

    def forward(size):
        idx = pos[:size] if held_by == "input" else slots[pos[:size] % 2, 0]
        return table[idx] * 2

    def workload():
        nonlocal pos
        pos.copy_(torch.tensor([3, 5, 7, 7 if fixed else 8]) if held_by == "input" else torch.zeros(4))
        m = Manager(forward, [4], {"pos": pos}, state={"slots": slots})
        try:
            m.capture()
        except IndexError:
            return
        pos.copy_(torch.tensor([1, 2, 3, 4]) if held_by == "input" else torch.zeros(4))
        m.replay(4)
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [] and not report.errors, report
        return
    (finding,) = report.findings
    assert finding.kind == ("undersized-buffer" if held_by == "input" else "stale-padding"), finding
    assert finding.tensor.startswith("pos" if held_by == "input" else "slots") and "in forward" in finding.location
    assert finding.numbers["size"] == 8 and "past the end" in finding.evidence


@pytest.mark.parametrize("fixed", [False, True])
def test_a_padded_replay_whose_padded_rows_index_past_a_table_is_stale_padding(fixed):
    """Padded rows take their token ids from a dummy request's row of a token table no request
    wrote (allocated uninitialised: here a far index): the replay's embedding lookup fails there.
    The index sits in the padded rows of the static input only: stale-padding at the lookup. The
    fix zero-initialises the table."""
    embed = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(4, dtype=torch.long)
    tokens = torch.full((5, 3), 0 if fixed else 1 << 30, dtype=torch.long)     # row 4: the dummy request's

    def forward(size):
        return embed[ids[:size]] * 2

    def workload():
        m = Manager(forward, [4], {"ids": ids})
        m.capture()
        tokens[:3, 0] = torch.tensor([1, 2, 3])
        for _ in range(2):
            ids.copy_(tokens[[0, 1, 2, 4], 0])       # three requests, padded with the dummy's row
            try:
                m.replay(3)
            except IndexError:
                pass
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [] and not report.caught, report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.tensor.startswith("ids") and "in forward" in finding.location
    assert "padded row(s) of ids" in finding.evidence and finding.numbers["real"] == 3


@pytest.mark.parametrize("fixed", [False, True])
def test_a_real_rows_index_past_a_table_in_a_padded_replay_is_an_undersized_table(fixed):
    """A per-request stash is sized by the graph's batch (4 rows) but looked up by request slot,
    and a request holding slot 4 arrives in a padded step: the replay's lookup runs past the end.
    The lookup's own index says a real row holds the index (the padded rows hold slot 0), so no
    padded row is to blame: undersized-buffer, named where the stash was allocated -- not
    stale-padding because some other buffer happens to hold the number, nor a shape mismatch of
    the caller that handed the replay's rows on. The fix sizes the stash by the request pool."""
    slots = torch.zeros(4, dtype=torch.long)

    def workload():
        stash = torch.arange(7.0 if fixed else 4.0).unsqueeze(1)        # one row per pool slot, or per batch row

        def forward(size):
            return stash[slots[:size]] * 2

        m = Manager(forward, [4], {"slots": slots}, state={"stash": stash})
        m.capture()
        outs, full = [], m.outputs[4]         # (the graph's rows, held where the replay's error passes)
        for batch in ([1, 2, 3], [1, 4, 3]):
            slots.copy_(torch.tensor(batch + [0]))
            try:
                outs.append(m.replay(3)[:3].clone())
            except IndexError:
                pass
        return outs, full
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [] and not report.caught, report
        return
    (finding,) = report.findings
    assert finding.kind == "undersized-buffer" and finding.tensor.startswith("stash"), finding
    assert finding.location.endswith("in workload") and "real row(s) 1 of the lookup's index" in finding.evidence


@pytest.mark.parametrize("fixed", [False, True])
def test_a_padding_sentinel_handed_to_an_indexed_op_at_fixed_shapes_is_stale_padding(fixed):
    """A pair list kept at a fixed length for the graph pads the pairs a step does not have with
    (-1, -1). The per-atom sum scatters the pairs by index: ``index_add`` rejects -1 (on a GPU a
    device-side assert), and the warmup fails. The padding's sentinel reached an op as an index:
    stale-padding at that op, not a lookup past a table's end. The fix points padded pairs at a
    dummy atom whose row is dropped, with zero weight."""
    pos = torch.zeros(4)

    def forward(size):
        close = (pos[:, None] - pos[None, :]).abs() < 1.5
        i, j = torch.triu_indices(4, 4, 1)
        keep = close[i, j]
        dummy = 4 if fixed else -1
        i, j = torch.where(keep, i, dummy), torch.where(keep, j, dummy)
        energy = torch.zeros(5 if fixed else 4).index_add(0, i, (pos[i.clamp(0, 3)] * keep).abs())
        return energy[:4] * 2

    def workload():
        pos.copy_(torch.tensor([0.0, 1.0, 5.0, 9.0]))
        m = Manager(forward, [4], {"pos": pos})
        try:
            m.capture()
        except IndexError:
            return None
        return m.replay(4).clone()
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [] and not report.caught, report
        return
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.op == "aten.index_add.default", finding
    assert "in forward" in finding.location and "hold -1, a padding sentinel" in finding.evidence


@pytest.mark.parametrize("fixed", [False, True])
def test_a_padded_row_writing_what_real_rows_read_after_state_moved_is_stale_padding(fixed):
    """A padded row writes through a dummy slot. After the first steps, eager code migrates the
    cache (compaction moves a live page into the dummy's old slot and remaps its request) but the
    runner never re-points the dummy (the fix does): every padded replay then writes where a real
    row reads. Seen on the padded step after the migration (eager code wrote persistent state),
    as a padded row's write into elements real rows read in the same step."""
    kv = torch.zeros(8, 2)
    x = torch.zeros(4, 2)
    slot = torch.zeros(4, dtype=torch.long)        # where each row writes its entry
    read = torch.zeros(4, dtype=torch.long)        # which entry each row reads back (its page)

    def forward(size):
        kv[slot[:size]] = x[:size]
        return kv[read[:size]] * 2

    def workload():
        m = Manager(forward, [4], {"x": x, "slot": slot, "read": read}, state={"kv": kv})
        m.capture()
        pages, dummy = [1, 2, 3], 7
        kv[1:4] = rows(3, 2, seed=9)                       # prefill of three requests' pages
        for step in range(4):
            if step == 2:                                  # compaction: page of request 2 moves to slot 7
                kv[7] = kv[3]
                pages[2] = 7
                dummy = 0 if fixed else dummy              # the fix re-points the padding dummy
            x.copy_(rows(4, 2, seed=step))
            slot.copy_(torch.tensor([4, 5, 6, dummy]))     # three new entries, then the padded row's
            read.copy_(torch.tensor(pages + [dummy]))
            m.replay(3)
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [], report
        return
    found = report.of("stale-padding")
    assert found and found[0].tensor == "`kv`" and "in forward" in found[0].location, report
    assert found[0].numbers["real"] == 3 and "read" in found[0].evidence


@pytest.mark.parametrize("by", ["index", "source"])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_per_row_state_update_of_a_padded_row_into_a_real_requests_slot(fixed, by):
    """A kernel that updates the state one row at a time: the padded row's slot index is the dummy
    slot 0, which the bug also hands to a real request. Its one-row write is the padded row's (the
    index, ``slots[i:i + 1]``, or else the source, ``x[i:i + 1]``, is a slice of the step's rows),
    into a slot a real row writes: stale-padding at the update. The fix keeps slot 0 for the dummy."""
    state = torch.zeros(4, 2)
    x = torch.zeros(2, 2)
    slots = torch.zeros(2, dtype=torch.long)

    def forward(size):
        out = []
        for i in range(size):
            if by == "index":
                idx = slots[:size][i:i + 1]
                new = state.index_select(0, idx) * 0.5 + x[i:i + 1]
                state.index_copy_(0, idx, new)
            else:                                      # a store kernel: cache[slot] = row i of the source
                idx = slots[i].clone().view(1)
                new = x[i:i + 1]
                state.index_put_((idx,), new)
            out.append(state[idx] + 0)
        return torch.cat(out)

    def workload():
        m = Manager(forward, [2], {"x": x, "slots": slots}, state={"state": state})
        m.capture()
        first = 1 if fixed else 0                      # the slot the request is given
        state[first] = 1.0                             # its prefill
        for step in range(3):
            x.copy_(rows(2, 2, seed=step))
            slots.copy_(torch.tensor([first, 0]))      # one real row, the padded row on the dummy slot
            m.replay(1)
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [], report
        return
    found = report.of("stale-padding")
    assert found and found[0].location.endswith("in forward"), report
    assert found[0].op == ("aten.index_copy_.default" if by == "index" else "aten.index_put_.default")


class _Scheduler:
    """Scheduler coefficients kept on the host, read by the step and passed down to the kernel
    launch by value (the fix keeps them in a static buffer the runner refreshes)."""

    def __init__(self, fixed):
        self.fixed = fixed
        self.x = torch.zeros(2, 2)
        self.coeffs = [0.37, 0.61]
        self.coeff_buf = torch.full((), 0.37)

    def launch(self, x, alpha):
        return x * alpha + 1

    def step(self, size):
        alpha = self.coeff_buf if self.fixed else self.coeffs[0]     # the host read
        return self.launch(self.x[:size], alpha)

    def set_schedule(self, coeffs):
        self.coeffs = coeffs
        self.coeff_buf.fill_(coeffs[0])


@pytest.mark.parametrize("fixed", [False, True])
def test_a_frozen_number_is_named_where_the_step_read_it_from_the_host(fixed):
    """The graph keeps the coefficient it was given at capture; the launch helper only passes it
    on. host-work-frozen is named at the frame that read it from host state (the outermost that
    holds the number), not at the helper's op."""
    def workload():
        s = _Scheduler(fixed)
        m = Manager(s.step, [2], {"x": s.x})
        m.capture()
        for step, coeffs in enumerate(([0.37, 0.61], [0.83, 0.29])):
            s.set_schedule(coeffs)
            s.x.copy_(rows(2, 2, seed=step))
            m.replay(2)
    report = doctor.diagnose(workload)
    if fixed:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.op == "aten.mul.Tensor", finding
    assert finding.location.endswith("in step") and "self.launch(self.x[:size], alpha)" in finding.source
    assert "The number comes from" in finding.cause


def as_scalar(value):
    """A helper that lifts the number it is handed into a tensor (``torch.tensor(value)``)."""
    return torch.tensor(value)


class _Optimizer:
    """A schedule kept in a dict of Python numbers; the step reads it and hands it straight to a
    helper that makes it a tensor: no frame holds the number in a variable of its own."""

    def __init__(self):
        self.x = torch.zeros(2, 2)
        self.group = {"decay": 0.37}

    def step(self, size):
        return self.decayed(self.x[:size])

    def decayed(self, x):
        return x * (1 - as_scalar(self.group["decay"]))     # the host read, passed down


def test_a_frozen_number_passed_straight_down_is_named_where_it_was_passed():
    """The lifted constant differs between the graph and the eager step. The op is in the helper,
    which was handed the number; the function that read it from the dict and passed it is named
    (not the step's entry, whose reads are the step's inputs)."""
    def workload():
        opt = _Optimizer()
        m = Manager(opt.step, [2], {"x": opt.x})
        m.capture()
        for step, decay in enumerate((0.37, 0.61, 0.83)):
            opt.group["decay"] = decay
            opt.x.copy_(rows(2, 2, seed=step))
            m.replay(2)
    report = doctor.diagnose(workload)
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.op == "aten.lift_fresh.default", finding
    assert finding.location.endswith("in decayed") and "as_scalar(self.group" in finding.source, finding


def test_a_graph_the_program_let_go_of_is_not_kept_alive_by_the_doctor():
    """The eager step's closure holds the runner (and through it the graph) but not the input
    buffer, which the workload releases first when it returns. The doctor keeps the way to the
    Python state each eager step reaches, a closure's cell included: until the end of the watch it
    kept the runner alive, and the graph it no longer belonged to looked like one whose input had gone."""
    class Runner:
        def __init__(self, x):
            self.graphs = {}
            with events.warmup():
                self.forward(x)
            g = new_graph("cpu")
            with graph(g, name="tiny"):
                self.out = self.forward(x)
            self.graphs[4] = g

        def forward(self, x):
            return x * 2

        def __call__(self, x):
            g = self.graphs[4]
            events.serve(g, 4, 4, padded={}, outputs=self.out, eager=lambda: self.forward(x))
            g.replay()
            return self.out.clone()

    def workload():
        x = torch.zeros(4)
        events.static_buffers("tiny", {"x": x})
        runner = Runner(x)
        for step in range(2):
            x.copy_(torch.arange(4.0) + step)
            runner(x)

    report = doctor.diagnose(workload)
    assert report.replays == 2 and report.findings == [], report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_that_overwrites_an_input_buffer_without_reading_it_keeps_an_output_there(variant):
    """``scratch`` is announced as a static input and never refreshed by the runner; the graph
    writes it. ``fix``: from ``x`` alone, the same bytes whatever it held (an output kept in an
    input buffer: a replay's write is all anyone reads). ``bug``: a running maximum that reads what
    the buffer held, so a step's result depends on the earlier steps' writes."""
    x, scratch = torch.zeros(4, 3), torch.zeros(4, 3)

    def forward(size):
        y = x[:size] * 2
        scratch[:size].copy_(torch.maximum(scratch[:size], y) if variant == "bug" else y)
        return scratch[:size] + 1

    def workload():
        m = Manager(forward, [4], {"x": x, "scratch": scratch})
        m.capture()
        for step in range(2):
            x.copy_(rows(4, 3, seed=step))
            m.replay(4)

    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [] and any("an output kept in an input buffer" in n for n in report.notes), report
        return
    assert [f.kind for f in report.findings if "scratch" in f.tensor] == ["persistent-mutation"], report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_capture_s_outputs_taken_for_a_step_s_result(variant):
    """A runner keyed on the wrong property captures on a real step and, ``bug``, returns what the
    capture gave: values no kernel computed (the emulation's poison; on a GPU, whatever the memory
    held). ``fix``: it replays right after capturing. The eager attention between two pieces of a
    capture also reads a capture's outputs before any replay, and is no finding: what it computes
    feeds the next piece's capture (a dummy batch)."""
    x, mid = torch.zeros(4, 3), torch.zeros(4, 3)
    events.static_buffers("tiny", {"x": x})
    pool = graph_pool_handle("cpu")

    def step(batch):
        x.copy_(batch)
        g1 = new_graph("cpu")
        with graph(g1, pool=pool, name="piece 0"):
            h = x * 2
        mid.copy_(torch.softmax(h, -1))                  # the eager region between the pieces
        g2 = new_graph("cpu")
        with graph(g2, pool=pool, name="piece 1"):
            out = mid + 1
        if variant == "fix":
            g1.replay()
            mid.copy_(torch.softmax(h, -1))
            g2.replay()
        return out.clone()

    report = doctor.diagnose(lambda: [step(rows(4, 3, seed=s)) for s in range(2)])
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and finding.graph == "piece 1", finding
    assert "with graph(g2" in finding.source and "out.clone()" in finding.evidence, finding


def test_what_a_capture_in_pieces_writes_into_state_from_its_dummy_batch_is_no_live_data():
    """Two captures in pieces, the larger first; the eager region between a capture's pieces updates
    the recurrent state's dummy slot from the first piece's output, which no kernel computed yet. The
    next capture's warmup then writes that slot: dummy data over dummy data, not a warmup over a
    request's state."""
    def workload():
        state = torch.zeros(3, 4)                  # slot 0: the dummy batch's
        events.persistent_state("pool", {"state": state})
        x = torch.zeros(8, 4)
        events.static_buffers("runner", {"x": x})
        pool = graph_pool_handle("cpu")

        def capture(size):
            with events.warmup():
                state[0].copy_((x[:size] * 2).sum(0))
            g1 = new_graph("cpu")
            with graph(g1, pool=pool, name=f"piece 0 of {size}"):
                h = x[:size] * 2
            state[0].copy_(h.sum(0))                # the eager region: from the piece's uncomputed output
            g2 = new_graph("cpu")
            with graph(g2, pool=pool, name=f"piece 1 of {size}"):
                out = state[0] + 1
            return g1, g2, out

        return [capture(size) for size in (8, 4)]

    report = doctor.diagnose(workload)
    assert report.findings == [], report


def test_two_captures_dummy_values_meeting_in_one_eager_op_feed_the_next_piece():
    """Two captures in pieces, the larger first. Each eager region keeps a value of its first piece's
    uncomputed output in state, then combines the state's dummy slot -- which the previous capture's
    region wrote from that capture's dummy values -- with its own piece's output, and the next piece
    reads the result. That op follows its first input's dummy values, which fed a capture already;
    the second capture's dummy values met them there and feed its own next piece: no result."""
    model = []                                          # the state outlives the capture loop

    def workload():
        state, kept = torch.zeros(3, 4), torch.zeros(3, 4)     # slot 0 / row 1: the dummy batch's
        model.append((state, kept))
        events.persistent_state("pool", {"state": state, "kept": kept})
        x = torch.zeros(8, 4)
        events.static_buffers("runner", {"x": x})
        pool = graph_pool_handle("cpu")

        def capture(size):
            g1 = new_graph("cpu")
            with graph(g1, pool=pool, name=f"piece 0 of {size}"):
                h = x[:size] * 2
            kept[1].copy_(h[0])                         # the eager region, from the piece's uncomputed output
            mid = state[0] + h
            state[0].copy_(mid.sum(0))
            g2 = new_graph("cpu")
            with graph(g2, pool=pool, name=f"piece 1 of {size}"):
                out = mid + 1
            return g1, g2, out

        return [capture(size) for size in (8, 4)]

    report = doctor.diagnose(workload)
    assert report.findings == [], report


def _norm(h):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def _capture_or_replay(x, graphs):
    """The decode graph of the two tests below: captured on the first call (whose outputs then hold
    nothing computed), replayed on the later ones; returns its outputs."""
    if "g" not in graphs:
        g = new_graph("cpu")
        with graph(g, name="decode"):
            out = torch.tanh(x * 2) + 0.5
        graphs["g"] = (g, out)
        return out
    g, out = graphs["g"]
    g.replay()
    return out


@pytest.mark.parametrize("answer, kept", [("clone", False), ("norm", False), ("norm", True)])
def test_a_capture_s_outputs_a_dummy_run_drops_are_nobody_s_result(answer, kept):
    """A runner's capture loop runs each size once on a dummy batch through the path that captures,
    which hands back what the capture returned -- a copy, or a final norm computed on it (several
    eager ops, each reading the one before, in one function: Gemma3n's norm after its last piece)
    -- and drops it (vLLM's ``capture_model``); the real steps replay. Nothing was taken for a
    result. Kept (the first real step is the capturing one, and its answer goes out), it is
    ``warmup-divergence``."""
    finish = (lambda out: out.clone()) if answer == "clone" else _norm

    def workload():
        x = torch.zeros(4, 3)
        events.static_buffers("tiny", {"x": x})
        graphs = {}

        def step(batch):
            x.copy_(batch)
            return finish(_capture_or_replay(x, graphs))   # the capturing call's answer: uncomputed

        first = step(rows(4, 3, seed=7) if kept else torch.zeros(4, 3))   # the capture loop's dummy batch
        return ([first] if kept else []) + [step(rows(4, 3, seed=s)) for s in range(2)]

    report = doctor.diagnose(workload)
    if not kept:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and "taken for a result" in finding.evidence, finding


@pytest.mark.parametrize("results", ["agree", "differ"])
def test_a_capture_s_output_a_dummy_step_reads_on_the_host_is_judged_by_the_workloads_results(results):
    """A runner's capture loop takes the capturing call's answer as its dummy step's: each row's argmax
    is read on the host and written into the next step's input, which the loop then clears with the
    rest of the dummy requests. What the capture left went nowhere that lasts: where the workload's
    results equal its run without graphs', a note; where they differ, ``warmup-divergence``."""
    def workload():
        x, next_ids = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
        events.static_buffers("tiny", {"x": x})
        graphs = {}

        def step(batch):
            x.copy_(batch)
            logits = _capture_or_replay(x, graphs).clone()
            for i in range(4):
                next_ids[i] = int(logits[i].argmax())      # read on the host, into the next step's input
            return logits

        with events.reference():
            expected = [torch.tanh(rows(4, 3, seed=s) * 2) + 0.5 for s in range(2)]
        step(torch.zeros(4, 3))                            # the capture loop's dummy step...
        next_ids.zero_()                                   # ... whose requests it clears
        got = [step(rows(4, 3, seed=s)) for s in range(2)]
        events.results(expected, got if results == "agree" else [g + 1 for g in got])

    report = doctor.diagnose(workload)
    if results == "agree":
        assert report.findings == [], report
        assert any("went nowhere that lasts" in n for n in report.notes), report.notes
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and "taken for a result" in finding.evidence, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_table_cached_on_first_use_inside_a_capture_is_named_where_it_is_read_again(variant):
    """A rotary table is built on first use and cached on the module; the first use is the capture
    (the fix builds it in the warmup before). The capture computes nothing that lasts, so later eager
    calls read a table no kernel filled: ``warmup-divergence`` at the function that cached it, which
    reads it again, not at the capture (the runner hands on no capture output)."""
    class Rotary:
        def table(self, n):
            if not hasattr(self, "cached"):
                self.cached = torch.arange(8.0).outer(torch.ones(2)) * 0.5
            return self.cached[:n].clone()

    def workload():
        rope = Rotary()
        x = torch.zeros(4, 2)
        events.static_buffers("vision", {"x": x})
        if variant == "fix":
            with events.warmup():
                rope.table(4)
        g = new_graph("cpu")
        with graph(g, name="vision"):
            out = x + rope.table(4)
        del out
        return [rope.table(n) * 2 for n in (2, 4)]     # eager calls of the same function, later

    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence" and "in table: return self.cached[:n].clone()" in finding.source, finding
    assert "kept a tensor it made while it was being captured" in finding.cause, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_raw_pointer_over_an_arena_is_written_only_where_its_addresses_point(variant):
    """A kernel given a pointer into a pool of per-layer state slots addresses the whole allocation
    (``as_strided`` over all of it) and stores into the slots it is given: an indexed write (``mem[addr]
    = v``) writes those elements, not the whole view. Slots within the layer's state are no finding;
    the bug's pad slot -1 lands in the previous layer's last slot, outside the state it was given."""
    pool = torch.zeros(2, 4, 3)                                # [layers, slots, state]

    def store(state, slots, values):
        mem = torch.as_strided(state, (pool.numel(),), (1,), 0)   # the device pointer: the whole allocation
        addr = state.storage_offset() + slots[:, None] * 3 + torch.arange(3)
        mem[addr.reshape(-1)] = values.reshape(-1)

    def workload():
        g = new_graph("cpu")
        slots = torch.tensor([2, -1 if variant == "bug" else 0])
        with graph(g, name="prefill"):
            store(pool[1], slots, torch.ones(2, 3))
        g.replay()

    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.of("undersized-buffer") == [], report
        return
    (finding,) = report.of("undersized-buffer")
    assert finding.numbers == {"buffer_bytes": 48, "written_past": 12}, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_kernel_scratch_written_past_its_result_buffer_is_an_undersized_buffer(variant):
    """Loop state carved from one arena: a result word, then the position. The sampling kernel keeps
    its scratch right after the result pointer (``as_strided`` over three words from it); the bug
    allocated one word for the result, so the scratch writes land on the position. The fix allocates
    the result with its scratch. The position's own writes, and a view past the end that is only
    read, are no finding."""
    arena = torch.zeros(8, dtype=torch.int32)
    result = arena[0:1] if variant == "bug" else arena[0:3]
    position = arena[1:2] if variant == "bug" else arena[3:4]

    def sample(logits):
        scratch = torch.as_strided(result, (3,), (1,))            # reinterpret_cast<int*>(result)
        scratch[1:3].copy_(logits.topk(2).indices.to(torch.int32))
        result[0:1].copy_(scratch[1:2])
        return torch.as_strided(position, (2,), (1,)).sum()        # a look past the end: a read

    def step(logits):
        out = sample(logits)
        position.add_(1)
        return out

    def workload():
        events.persistent_state("runner", {"result": result, "position": position})
        logits = torch.zeros(5)
        with events.warmup():
            step(logits)
        g = new_graph("cpu")
        with graph(g, name="decode loop"):
            out = step(logits)
        for s in range(2):
            logits.copy_(rows(1, 5, seed=s)[0])
            g.replay()
        return out.clone()
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.of("undersized-buffer") == [], report
        return
    finding = report.of("undersized-buffer")[0]
    assert "scratch[1:3].copy_" in finding.source and "past the 4 of int32[1]" in finding.evidence, finding
    assert finding.numbers == {"buffer_bytes": 4, "written_past": 8}, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_view_past_the_storage_of_a_buffer_a_graph_reads_is_an_undersized_buffer(variant):
    """A static buffer sized by the first request's prompt (three tokens) and laid out afresh for each
    request's length (``as_strided`` over it, as C++ lays a tensor over its pointer): a longer prompt
    asks for a view past its storage, which torch refuses and CUDA code writes past unchecked. The
    finding names the function that chose the shape, not the helper that made the view; the fix
    sizes the buffer for the longest prompt."""
    class StaticBuffer:
        def __init__(self):
            self.buffer = None

        def tensor_on(self, shape):
            if self.buffer is None:
                self.buffer = torch.zeros(6 if variant == "fix" else shape[0], dtype=torch.float64)
            return self.buffer.as_strided(tuple(shape), (1,), 0)

    def workload():
        sb, w = StaticBuffer(), torch.arange(1.0, 7.0, dtype=torch.float64)
        outs = []
        for prompt in (torch.ones(3, dtype=torch.float64), torch.full((5,), 2.0, dtype=torch.float64)):
            def prefill():
                ids = sb.tensor_on([prompt.shape[0]])
                ids.copy_(prompt)
                return ids

            ids = prefill()
            g = new_graph("cpu")
            with graph(g, name=f"prompt {prompt.shape[0]}"):
                out = (ids * w[:ids.shape[0]]).sum()
            g.replay()
            outs.append(out.clone())
        return outs
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "undersized-buffer", finding
    assert "in prefill: ids = sb.tensor_on([prompt.shape[0]])" in finding.source, finding
    assert "out of bounds for storage" in finding.evidence and finding.numbers == {"storage_bytes": 24}, finding


@pytest.mark.parametrize("variant", ["bug", "fix", "own count"])
def test_a_kernel_reading_real_row_metadata_at_the_padded_count_is_a_padded_shape_mismatch(variant):
    """A graph of 4 rows serves 3 real ones; eager code after the replay hands its padded output and
    the step's slot mapping (a view of the runner's buffer over the 3 real rows) to a cache-store
    kernel, which reads one slot per row of the output through the mapping's pointer: the padded row
    reads the buffer's next element, an earlier step's slot, and stores there. ``fix`` cuts the
    output to the mapping's rows (vLLM's ``k = k[:slot_mapping.shape[0]]``); a kernel that reads the
    mapping's own count takes a window within it. The site is the caller's line: the kernel was handed
    the mapping (real code reads below the user's frames)."""
    slots = torch.tensor([5, 6, 7, 1])                  # the runner's buffer: entry 3 is an earlier step's
    ids = torch.zeros(4)
    cache = torch.zeros(8)

    def store_kernel(k, slot_mapping):
        mem = torch.as_strided(slot_mapping, (slots.numel(),), (1,), 0)      # the device pointer
        count = slot_mapping.shape[0] if variant == "own count" else k.shape[0]
        at = mem[slot_mapping.storage_offset():slot_mapping.storage_offset() + count]
        cache[at] = k[:count]

    def store(k, real):
        slot_mapping = slots[:real]
        k = k[:slot_mapping.shape[0]] if variant == "fix" else k
        store_kernel(k, slot_mapping)

    def workload():
        g = new_graph("cpu")
        with events.warmup():
            out = ids * 2 + 1
        with graph(g, name="size 4"):
            out = ids * 2 + 1
        ids[:3].copy_(torch.tensor([1.0, 2.0, 3.0]))
        events.serve(g, 3, 4, padded={"ids": ids}, outputs=out)
        g.replay()
        store(out, 3)
        return cache.clone()

    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.of("padded-shape-mismatch") == [], report
        return
    (finding,) = report.of("padded-shape-mismatch")
    assert "store_kernel(k, slot_mapping)" in finding.source and finding.graph == "size 4", finding
    assert finding.numbers == {"real": 3, "size": 4, "elements_read": 4}, finding


def _weak(t):
    """A tensor on ``t``'s memory that does not own it (vLLM's ``weak_ref_tensors``)."""
    storage = torch._C._construct_storage_from_data_pointer(t.untyped_storage().data_ptr(), t.device,
                                                            t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_weak_reference_taken_during_a_capture_to_memory_it_then_hands_on_is_dangling(variant):
    """Two layers share one scratch, made by the first and kept for the second. ``bug`` keeps only a
    weak reference during the capture: the first layer's scratch goes back to the pool when it
    returns, the next activation is given that block, and the second layer's scratch writes land on
    it. ``fix`` keeps a strong reference until the capture ends."""
    kept = {}
    x = torch.zeros(8)

    def layer(h):
        scratch = kept.get("scratch")
        if scratch is None:
            scratch = torch.empty(8)
            kept["scratch"] = _weak(scratch) if variant == "bug" else scratch
        scratch.copy_(h * 2)
        return h + scratch.sum()

    def step():
        kept.clear()
        return layer(layer(x) * 0.5)

    def workload():
        events.static_buffers("runner", {"x": x})
        g = new_graph("cpu")
        with graph(g, name="two layers"):
            out = step()
        for s in range(2):
            x.copy_(rows(1, 8, seed=s)[0])
            g.replay()
        return out.clone()
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.of("dangling-reference") == [], report
        return
    (finding,) = report.of("dangling-reference")
    assert "scratch.copy_(h * 2)" in finding.source and "does not own its memory" in finding.evidence, finding
    assert "layer(x) * 0.5" in finding.evidence, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_pieces_output_kept_weakly_and_read_by_the_next_pieces_capture_is_dangling(variant):
    """Two pieces of a step, captured one after the other into one pool. ``bug`` hands the first
    piece's outputs on as weak references (only the last piece's may be: nothing runs after it), so
    their memory goes back to the pool when the capture ends; the second piece's capture gives that
    block to its first temporary, and then reads the weak reference, which now points at it. ``fix``
    keeps the first piece's outputs."""
    from workbench.engine import graph_pool_handle
    x, w = torch.zeros(4, 4), torch.randn(4, 4, generator=torch.Generator().manual_seed(0))

    def first():
        out = x @ w
        return _weak(out) if variant == "bug" else out

    def workload():
        events.static_buffers("runner", {"x": x})
        pool, graphs = graph_pool_handle("cpu"), []
        graphs.append(new_graph("cpu"))
        with graph(graphs[0], pool=pool, name="piece 0"):
            h = first()
        graphs.append(new_graph("cpu"))
        with graph(graphs[1], pool=pool, name="piece 1"):
            t = x @ w.t()                               # a temporary: the pool's first free block
            out = t + h
        for s in range(2):
            x.copy_(rows(4, 4, seed=s))
            for g in graphs:
                g.replay()
        return out.clone()
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.of("dangling-reference") == [], report
        return
    (finding,) = report.of("dangling-reference")
    assert "out = t + h" in finding.source and "does not own its memory" in finding.evidence, finding
    assert "t = x @ w.t()" in finding.evidence and finding.graph == "piece 1", finding


def test_an_eager_step_that_hands_out_a_weak_reference_is_not_compared_on_it():
    """The last piece of a step hands its output out as a weak reference (vLLM's piecewise backend:
    the graph's pool keeps that memory until the next replay, and the caller copies it at once).
    The eager form of the step does the same, but nothing keeps its memory: by the time differential
    replay looks, it is freed. That output is not compared, and nothing is found."""
    x, w = torch.zeros(4, 4), torch.randn(4, 4, generator=torch.Generator().manual_seed(0))

    def step():
        return _weak(torch.tanh(x @ w) * 3.0)

    def workload():
        events.static_buffers("runner", {"x": x})
        g = new_graph("cpu")
        with graph(g, name="last piece"):
            out = step()
        got = []
        for s in range(3):
            x.copy_(rows(4, 4, seed=s))
            events.serve(g, 4, 4, padded={}, outputs=out, eager=step)
            g.replay()
            got.append(out.clone())
            torch.randn(64, 64)                        # eager work after the step, as a sampler's
        return got
    report = doctor.diagnose(workload)
    assert report.findings == [], report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_buffer_asked_for_with_a_negative_size_is_an_undersized_buffer(variant):
    """The runner sizes a graph's input buffer from the span of the batch's view, ``(rows - 1) *
    stride + width``: for a batch of no rows the span is negative and the allocation fails (the
    start-up loop catches it). The fix sizes it from the shape."""
    def workload():
        hidden = torch.zeros(4, 8)
        for rows in (2, 0):
            x = hidden[:rows, :3]
            needed = (x.shape[0] - 1) * x.stride(0) + x.shape[1] if variant == "bug" else x.numel()
            try:
                buf = torch.empty(needed)
            except RuntimeError:
                continue
            Manager(lambda size: buf * 2, [1], {"buf": buf}).capture()
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.of("undersized-buffer") == [], report
        return
    (finding,) = report.of("undersized-buffer")
    assert "buf = torch.empty(needed)" in finding.source and "negative size" in finding.evidence, finding


def test_an_output_the_graph_only_allocates_is_not_compared(monkeypatch):
    """The captured step hands out a buffer it allocates and never writes (an attention output that
    an eager region fills after the replay, as a PIECEWISE backend's ``torch.empty_like(q)``): what
    that memory holds is no result, in the replay or in the eager form, and is not compared. Eager
    allocations are left unfilled here, as on CUDA (``doctor/uninit.py`` fills them with NaN on a
    machine without it, which an eager NaN's rule then ignores)."""
    import contextlib
    from workbench.doctor import session
    monkeypatch.setattr(session, "filled", contextlib.nullcontext)

    def workload():
        x = torch.zeros(4, 3)
        m = Manager(lambda size: (x[:size] * 2, torch.empty_like(x[:size])), [4], {"x": x})
        m.capture()
        for step in range(3):
            x.copy_(rows(4, width=3, seed=step))
            h, out = m.replay(4)
            out.copy_(h + 1)
    report = doctor.diagnose(workload)
    assert report.findings == [], report


def test_an_output_on_the_block_of_a_freed_unwritten_temporary_is_compared():
    """A capture allocates scratch it never writes and frees it; the allocator gives that block to
    the step's output. The output holds a result and is compared: here a factor Python read at
    capture, changed since, which only the output shows. (Whether the block is reused is the
    allocator's choice, so the test checks that some run reused it.)"""
    blocks = []

    def workload():
        x, factor = torch.zeros(4, 3), [2.0]

        def step(size):
            scratch = torch.empty(size, 3)
            blocks.append(scratch.data_ptr())
            del scratch
            out = x[:size] * factor[0]
            blocks.append(out.data_ptr())
            return out

        m = Manager(step, [4], {"x": x})
        m.capture()
        factor[0] = 3.0
        for seed in range(2):
            x.copy_(rows(4, width=3, seed=seed))
            m.replay(4)
    report = doctor.diagnose(workload)
    assert any(a == b for a, b in zip(blocks[::2], blocks[1::2])), "no block reused: the test shows nothing"
    assert report.findings and "output 0" in report.findings[0].evidence, report


def test_an_eager_step_returning_fewer_outputs_than_the_replay_hands_out_is_a_finding():
    """The capture's step returned two outputs, which the runner hands out; the eager step now takes
    another path and returns one: the counts are compared, and the difference is the finding."""
    def workload():
        x, extra = torch.zeros(4, 3), [True]

        def step(size):
            h = x[:size] * 2
            return (h, h + 1) if extra[0] else (h,)

        m = Manager(step, [4], {"x": x})
        m.capture()
        extra[0] = False
        for seed in range(2):
            x.copy_(rows(4, width=3, seed=seed))
            m.replay(4)
    report = doctor.diagnose(workload)
    assert report.failure is None, report.failure
    assert any("the replay has 2 outputs, the eager step 1" in f.evidence for f in report.findings), report


def test_a_released_graphs_record_stays_when_a_new_graph_gets_its_id():
    """A graph captured, replayed and released, then a new one captured: the allocator may give the
    new graph object the released one's id. Each capture keeps its own record, in capture order,
    whatever the ids (a record replaced by id lost what it held, at random)."""
    from workbench.doctor.intake import Doctor
    from workbench.doctor.session import watching
    x = torch.ones(2)
    with watching(Doctor()) as watcher:
        for name in ("first", "second", "third"):
            g = new_graph("cpu")
            with graph(g, name=name):
                x * 2
            g.replay()
            del g
        g = new_graph("cpu")
        with graph(g, name="fourth"):
            x * 3
        with graph(h := new_graph("cpu"), name="fifth"):
            x * 4
        g.reset()
        with graph(g, name="fourth again"):
            x * 5
        records = [info.name for info in watcher.graphs.values()]
    assert records == ["first", "second", "third", "fifth", "fourth again"], records
    assert watcher.info(g).name == "fourth again" and watcher.info(h).name == "fifth"


def test_a_graphs_output_fed_to_the_next_graph_as_its_static_input_is_not_its_state():
    """Graph partitions: the first graph's output is the second's static input, and an op between
    them runs eagerly on it in place (a fallback no graph may hold). To the first graph that buffer
    is its output, whatever the eager op left in it before the next replay: no finding."""
    def workload():
        x = torch.zeros(4, 3)
        events.static_buffers("partitions", {"x": x})
        first = lambda: x * 2  # noqa: E731
        g0 = new_graph("cpu")
        with graph(g0, name="partition_0"):
            buf = first()
        events.static_buffers("partitions", {"buf0": buf})
        second = lambda: buf + 1  # noqa: E731
        g1 = new_graph("cpu")
        with graph(g1, name="partition_1"):
            out = second()
        for step in range(4):
            x.copy_(rows(4, 3, seed=step))
            events.serve(g0, 4, 4, outputs=buf, eager=first)
            g0.replay()
            buf[buf > 0] = 0.0                        # the eager fallback, on the first graph's output
            events.serve(g1, 4, 4, outputs=out, eager=second)
            g1.replay()
    report = doctor.diagnose(workload)
    assert report.findings == [] and report.failure is None, report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_per_request_table_scattered_into_each_step_is_written_not_updated(variant):
    """The runner writes each step's lengths into a static per-request table by request slot
    (``index_copy_``, ``fix``: the rows named are overwritten, the others kept) and the graph reads
    the step's slots: a write, not an update that builds on what the rows held. ``bug``: the table
    takes each step's increment (``index_add_``), which the next step builds on."""
    table, slots = torch.zeros(6), torch.zeros(2, dtype=torch.long)

    def forward(size):
        return table[slots[:size]] * 2

    def workload():
        m = Manager(forward, [2], {"lengths_by_slot": table, "slots": slots})
        m.capture()
        for step in range(3):
            slots.copy_(torch.tensor([1, 3]))
            lengths = torch.tensor([5.0, 7.0]) + step
            if variant == "fix":
                table.index_copy_(0, slots, lengths)
            else:
                table.index_add_(0, slots, torch.ones(2))
            m.replay(2)

    report = doctor.diagnose(workload)
    mutations = report.of("persistent-mutation")
    assert (mutations == []) == (variant == "fix"), report


def test_only_an_index_write_told_to_combine_reads_its_destination():
    aten, x, i, v = torch.ops.aten, torch.zeros(3), torch.tensor([0]), torch.ones(1)
    assert opinfo.overwrites(aten.index_copy_.default, (x, 0, i, v))
    assert opinfo.overwrites(aten.index_put_.default, (x, [i], v))
    assert not opinfo.overwrites(aten.index_put_.default, (x, [i], v, True))
    assert opinfo.overwrites(aten.scatter_.src, (x, 0, i, v))
    assert not opinfo.overwrites(aten.scatter_.value_reduce, (x, 0, i, 1.0), {"reduce": "add"})
    assert not opinfo.overwrites(aten.index_add_.default, (x, 0, i, v))


def test_a_workspace_one_capture_allocated_and_every_graph_updates_is_state_they_share():
    """A kernel library's counters allocated (zeroed) inside the first capture and read and
    restored by every graph of the pool: each graph finds what the last one left, by design, as
    with a KV cache; a graph reading another's *output* after a third overwrote it is the hazard
    (``test_doctor_lifetimes``, the pool tests)."""
    x, cache = torch.zeros(4, 3), {}

    def workspace():                         # one per stream, as the library keys it: the capture's is new
        key = is_capturing()
        if key not in cache:
            cache[key] = torch.zeros(2)
        return cache[key]

    def forward(size):
        ws = workspace()
        out = x[:size] * 2 + ws[0]
        ws.copy_(ws * 0)                    # the last tile restores the counters
        return out

    def workload():
        m = Manager(forward, [1, 2, 4], {"x": x})
        m.capture()
        for step, n in enumerate((4, 2, 1, 2, 4)):
            x.copy_(rows(4, 3, seed=step))
            m.replay(n)

    assert doctor.diagnose(workload).findings == []


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_that_advances_its_own_inputs_is_judged_by_the_workload_s_results(variant):
    """A decode loop on the device: each replay samples the next token into its static input and
    advances its position (written on purpose; the runner sets both only when a request starts).
    With a run without graphs announced, the mutation probe's finding is held: ``fix`` resets the
    position for each request and gives that run's answers, no finding; ``bug`` carries the first
    request's position into the second, and the finding is reported."""
    from workbench.zoo.kit import capture, compare, replay
    table = torch.arange(40.0).reshape(10, 4) / 10

    def step(tok, pos):
        logits = table[(tok + pos) % 10].sum(-1, keepdim=True) * torch.arange(1.0, 6.0)
        tok.copy_(logits.argmax(-1) % 10)
        pos.add_(1)
        return logits

    def generate(tok, pos, first, run_step, reset=True):
        tok.fill_(first)
        if reset:
            pos.zero_()
        return [run_step().clone() for _ in range(3)]

    def served():
        tok, pos = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        g, out = capture(lambda: step(tok, pos), device="cpu", name="decode loop", static={"tok": tok, "pos": pos})
        return [o for first in (2, 5) for o in generate(tok, pos, first, lambda: replay(g, out),
                                                         reset=variant == "fix" or first == 2)]

    def eager():
        tok, pos = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        return [o for first in (2, 5) for o in generate(tok, pos, first, lambda: step(tok, pos))]

    def run():
        return compare("device loop", variant, "cpu", served, eager)

    assert run().verdict == ("misbehaves" if variant == "bug" else "equals eager")
    report = doctor.diagnose(run)
    if variant == "fix":
        assert report.findings == [] and any("held" in n for n in report.notes), report
        return
    assert "persistent-mutation" in report.kinds, report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_columns_a_step_reads_none_of_in_eager_form_too_are_not_dropped_by_its_graph(variant):
    """A verifier reads the coins of all drafts but the last (``coins[:, :n - 1]``), in its eager form
    too, of a buffer the runner fills whole each step: that last column is nobody's data, and the
    graph drops nothing (fix). A window cut by set-up code before the capture (``view``, which the
    eager form reads through too) is frozen in both: the column it leaves is dropped (bug)."""
    coins, views = torch.zeros(3, 3), []

    def verify():
        window = views[0] if variant == "bug" else coins[:, :3][:, :2]
        return window.cumsum(1) * 2

    def workload():
        events.static_buffers("sampler", {"coins": coins})
        views.append(coins[:, :1])
        with events.warmup():
            verify()
        g = new_graph("cpu")
        with graph(g, name="verify"):
            out = verify()
        for step in range(3):
            coins.copy_(rows(3, 3, seed=step))
            events.serve(g, 3, 3, outputs=out, eager=verify)
            g.replay()
            events.handed_out(g, out)
    report = doctor.diagnose(workload)
    if variant == "fix":
        assert report.findings == [], report
    else:
        assert [f.kind for f in report.findings] == ["undersized-buffer"], report


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0,), (2, 3, 4)])
def test_the_parts_outside_a_window_are_made_for_any_shape(shape):
    """``unread.outside`` runs at every capture's end, on what the capture read of each static input:
    an empty buffer (a zero-size capture input) must not stop the doctor."""
    from workbench.doctor.rules.unread import outside
    reads = torch.zeros(shape, dtype=torch.bool)
    if reads.numel():
        reads[0, :1] = True
    other_rows, past_end = outside(reads)
    assert other_rows.shape == past_end.shape == reads.shape
    assert not bool((other_rows & past_end).any()) and not bool((reads & (other_rows | past_end)).any())


@pytest.mark.parametrize("later", [False, True])
def test_findings_held_at_one_place_are_released_there_in_the_order_held(later):
    """``probes.release`` puts each held finding where it would have stood unheld: two held after the
    first finding come back second and third, in the order they were held, whether or not another
    finding was added since."""
    from workbench.doctor.intake import Doctor
    from workbench.doctor.probes import held, release
    from workbench.doctor.report import Finding
    d = Doctor()

    def add(line):
        d.add(Finding("host-work-frozen", "g", "-", "-", f"x.py:{line} in f: y", "e", "c"), ("k", line))
    add(1)
    kept: list = []
    with held(d, kept):
        add(2)
        add(3)
    if later:
        add(4)
    release(d, kept)
    assert [f.source[5] for f in d.report.findings] == ["1", "2", "3", "4"][:3 + later]


@pytest.mark.parametrize("how", ["set_", "resize_"])
def test_a_static_buffer_given_another_shape_in_place_between_replays_is_still_watched(how):
    """Eager code that gives a static input another shape in place (a copy that re-allocates its
    destination to the source's size, as Paddle's ``copy_`` does; a ``resize_``) and copies into it:
    what the rules knew of its elements was of the old layout. The doctor goes on watching (no
    error of its own), and the graph still reading the old memory is reported."""
    x = torch.zeros(4)

    def grow_and_fill(values):
        if how == "set_":
            x.set_(torch.empty(values.numel()).untyped_storage(), 0, values.shape)
        else:
            x.resize_(values.shape)
        x.copy_(values)

    def workload():
        m = Manager(lambda size: x[:size] * 2, [4], {"x": x})
        x.copy_(rows(4)[:, 0])
        m.capture()
        for step in range(3):
            x.copy_(rows(4, seed=step)[:, 0])
            m.replay(4)
            x.add_(1)                                        # an update the rules track element by element
        grow_and_fill(rows(9, seed=5)[:, 0])              # the step's data does not fit: new memory
        x.copy_(rows(9, seed=6)[:, 0])
        m.replay(4)

    report = doctor.diagnose(workload)
    assert report.failure is None, report.failure
    assert "dangling-reference" in report.kinds, report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_step_that_returns_nothing_is_compared_by_what_it_leaves_where_it_writes(variant):
    """An explicit solver advances its state in place from a launcher that returns nothing, and its
    graph reads the step's coefficient from an argument slot bound at capture. The runner's update
    writes each new coefficient into that slot (fix) or only into its own record (bug: the update is
    lost). Every replay agrees with its eager form, which reads the same slot; the run without graphs
    binds the coefficient afresh at each launch. The launcher returns nothing, so the replay is
    compared with what the reference's same step left in the state it wrote: the slot the graph
    reads holds another value than that step's, which the step did not write."""
    from workbench.zoo.kit import capture, compare, replay

    def launch(u, f, slot):
        u.add_(slot * (f - u))

    def forcing(n):
        return rows(1, 6, seed=n)[0]

    def served():
        u, f, slot, record = torch.zeros(6), torch.zeros(6), torch.zeros(()), {}
        g, outs = None, []
        for n in range(4):
            f.copy_(forcing(n))
            if g is None:
                slot.fill_(0.1)
                g, _ = capture(lambda: launch(u, f, slot), device="cpu", warmups=0, name="solver step",
                               static={"f": f, "slot": slot}, state={"u": u})
            elif variant == "fix":
                slot.fill_(0.1 * (n + 1))
            else:
                record["coef"] = 0.1 * (n + 1)
            outs.append(replay(g, u).clone())
        return outs

    def eager():
        u, outs = torch.zeros(6), []
        for n in range(4):
            launch(u, forcing(n), torch.full((), 0.1 * (n + 1)))
            outs.append(u.clone())
        return outs

    def run():
        return compare("void launcher", variant, "cpu", served, eager)

    assert run().verdict == ("misbehaves" if variant == "bug" else "equals eager")
    report = doctor.diagnose(run)
    if variant == "fix":
        assert report.findings == [], report
        return
    assert [f.kind for f in report.findings] == ["stale-input"], report
    assert "from the reference run's same step" in report.findings[0].evidence, report


def test_a_generator_kept_on_a_class_is_put_back_after_the_eager_step():
    """A dropout draws its mask from a counter-based generator kept on a class (as ``torch.cuda``
    keeps its default generator): an eager step takes the next offset from it; in the graph the
    offset is a device tensor the runner's replay sets from the same generator, advancing it as an
    eager step would. Differential replay's eager run of a step takes an offset too, so the
    generator must be put back after it: otherwise every later replay draws other masks than the
    run without graphs, a difference the doctor itself made."""
    from workbench.zoo.kit import capture, compare, replay

    class Generators:
        default = None

    class Counter:
        def __init__(self):
            self.offset = 0

        def take(self):
            self.offset += 1
            return self.offset - 1

    x, offset = torch.arange(1.0, 9.0), torch.zeros((), dtype=torch.long)

    def dropout(t):
        off = offset if is_capturing() else torch.tensor(Generators.default.take())
        return t * ((torch.arange(8) * 7 + off * 3) % 5 != 0)

    def served():
        Generators.default = Counter()
        g, out = capture(lambda: dropout(x), device="cpu", warmups=0, name="dropout", static={"offset": offset})
        outs = []
        for _ in range(4):
            offset.fill_(Generators.default.take())        # the replay's prologue
            outs.append(replay(g, out).clone())
        return outs

    def eager():
        Generators.default = Counter()
        return [dropout(x).clone() for _ in range(4)]

    def run():
        return compare("class generator", "fix", "cpu", served, eager)

    assert run().verdict == "equals eager"
    report = doctor.diagnose(run)
    assert report.findings == [], report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_captured_on_a_buffer_the_steps_eager_form_is_not_given(variant):
    """Context parallelism in small: the rank's share of each step's tokens (every other one) is
    gathered into the partitioner's buffer, which the model is given. The graph was captured on
    the runner's buffer of the whole batch, which the runner still writes (bug), or on the
    partitioner's (fix). No call of the run without graphs is given what the bug's graph reads,
    so its replays are paired with their steps by the count: the output differs, and the static
    input the graph reads holds other values than the step's."""
    from workbench.zoo.kit import capture, compare, replay
    w = torch.linspace(-1, 1, 12).reshape(3, 4)

    def model(tokens):
        return torch.tanh(tokens @ w.T)

    def share(batch):
        return batch[::2]

    batches = [rows(4, 4, seed=s) for s in range(4)]

    def served():
        whole, part = torch.zeros(4, 4), torch.zeros(2, 4)
        g, out = capture(lambda: model(whole[:2] if variant == "bug" else part), device="cpu", name="rank 0",
                         static={"whole": whole, "part": part})
        outs = []
        for batch in batches:
            whole.copy_(batch)
            part.copy_(share(batch))
            outs.append(replay(g, out).clone())
        return outs

    def run():
        return compare("partitioned", variant, "cpu", served, lambda: [model(share(b)).clone() for b in batches])

    assert run().verdict == ("misbehaves" if variant == "bug" else "equals eager")
    report = doctor.diagnose(run)
    if variant == "fix":
        assert report.findings == [], report
        return
    assert [f.kind for f in report.findings] == ["warmup-divergence"], report
    assert "whole" in report.findings[0].evidence and "whole.copy_(batch)" in report.findings[0].source, report


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_binding_the_captured_step_adds_and_the_program_takes_away_is_host_work(variant):
    """A hand-off through a Python attribute: the captured forward binds its hidden states to
    ``model.hidden_cache`` (bug), which the code after the step reads and deletes. A replay runs no
    Python, so after it there is no binding to read, where the eager step adds this step's tensor.
    Differential replay takes that binding back after its eager run (the program goes on as the
    replay left it, and fails as it would unwatched), and names the line that binds it. The fix
    writes the hidden states into a persistent buffer the graph writes in place."""
    from workbench.zoo.kit import capture, compare, replay
    w = torch.linspace(-1, 1, 16).reshape(4, 4)

    class Model:
        def __init__(self):
            self.buffer = torch.zeros(4, 4)

        def forward(self, x):
            hidden = torch.tanh(x @ w)
            if variant == "bug":
                self.hidden_cache = hidden
            else:
                self.buffer[: hidden.shape[0]].copy_(hidden)
            return hidden.sum(-1)

    def after_step(model, n):
        if variant == "bug":
            hidden = model.hidden_cache if hasattr(model, "hidden_cache") else None
            if hasattr(model, "hidden_cache"):
                del model.hidden_cache
        else:
            hidden = model.buffer[:n]
        return hidden.mean(-1)           # (None after a replay: AttributeError)

    batches = [rows(4, 4, seed=s) for s in range(3)]

    def served():
        model, x = Model(), torch.zeros(4, 4)
        g, out = capture(lambda: model.forward(x), device="cpu", name="step", static={"x": x})
        after_step(model, 4)
        outs = []
        for batch in batches:
            x.copy_(batch)
            outs += [replay(g, out).clone(), after_step(model, 4)]
        return outs

    def eager():
        model, outs = Model(), []
        for batch in batches:
            outs += [model.forward(batch).clone(), after_step(model, 4)]
        return outs

    def run():
        return compare("hand-off", variant, "cpu", served, eager)

    outcome = run()
    assert outcome.verdict == ("misbehaves" if variant == "bug" else "equals eager")
    report = doctor.diagnose(run)
    if variant == "fix":
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and "self.hidden_cache = hidden" in finding.source, report
    assert "AttributeError" in str(report), report          # the workload's own failure, as unwatched


def _bring(buf: torch.Tensor, values: torch.Tensor) -> None:
    buf.copy_(values)                    # the one line that brings every step's data


@pytest.mark.parametrize("eager_step", [True, False])
def test_data_an_eager_warmup_step_reads_before_the_same_line_copies_again_reached_a_reader(eager_step):
    """A runner that runs a step eagerly until its graph is stable (ggml's warmup) copies a step's
    input, runs it under ``events.warmup()``, and copies the next: the warmup read the first copy.
    Without that eager step, the same line overwrites data nothing read: ``persistent-mutation``."""
    from workbench.zoo.kit import capture, replay

    def workload():
        x = torch.zeros(4)
        g, out = capture(lambda: x * 2, device="cpu", static={"x": x}, warmups=0)
        _bring(x, torch.arange(4.0))
        replay(g, out)
        _bring(x, torch.arange(4.0) + 1)
        if eager_step:
            with events.warmup():
                (x * 2).sum()
        _bring(x, torch.arange(4.0) + 5)
        replay(g, out)
    finding = only_finding(workload, "fix" if eager_step else "bug")
    assert eager_step or (finding.kind == "persistent-mutation" and "in _bring" in finding.source)


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_host_arithmetic_split_into_several_ops_is_host_work_in_every_trace(variant):
    """An optimizer step whose counter lives in host memory (``bug``: a ``capturable`` optimizer that
    made its step with ``torch.tensor(0.)`` on the CPU, lazily, at its first step) computes its bias
    correction on the host: ``0.1 / bias`` is a reciprocal then a multiply, whose intermediate is no
    host tensor by type. The capture runs that host work once and records none of it; the warmups'
    record and the eager step's launch trace must leave it out too, or each finds a line "the capture
    never ran" (``warmup-divergence`` twice) where the graph keeps a number the host computed at
    capture. One finding: ``host-work-frozen``, at the device op given that number. The fix keeps the
    step on the device."""
    from workbench.engine.host import host
    from workbench.zoo import kit

    def run(served: bool):
        param, grad = torch.ones(4, dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)
        state = {}

        def update():
            if "step" not in state:
                zero = torch.tensor(0.0, dtype=torch.float64)
                state["step"] = host(zero) if variant == "bug" else zero
            step = state["step"]
            step.add_(1)
            bias = 1 - torch.pow(0.9, step)
            step_size = 0.1 / bias
            param.sub_(grad * step_size)
            return param

        if not served:
            return [update().clone() for _ in range(6)]
        outs = []
        for _ in range(3):                  # real training steps before the capture; the first makes the state
            with events.warmup(real=True):
                outs.append(update().clone())
        events.persistent_state("optimizer", {"param": param, "step": state["step"]})
        g = new_graph("cpu")
        with graph(g):
            out = update()
        kit.remember_step(g, update)
        return outs + [kit.replay(g, out).clone() for _ in range(3)]

    finding = only_finding(lambda: kit.compare("host_step", variant, "cpu", lambda: run(True), lambda: run(False)),
                           variant)
    if finding is None:
        return
    assert finding.kind == "host-work-frozen" and "param.sub_(grad * step_size)" in finding.source, finding


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_an_in_place_op_on_a_fresh_tensor_that_meets_the_padded_rows_is_a_padded_shape_mismatch(variant):
    """The runner prepares a padded step's metadata: a fresh copy of the real rows' cache locations,
    from which it subtracts in place the lengths of the graph's rows (``bug``: all 8, padded rows
    included; the fix slices them to the 6 real rows). ``loc -= lens`` fails, and it is no buffer
    overflowing: ``loc`` was made one line before and no graph reads it, so the two operands met at
    two counts, the graph's and the requests' (``padded-shape-mismatch``), not ``undersized-buffer``."""
    from workbench.zoo import kit
    base = torch.arange(10, 18, dtype=torch.float64)
    lens = torch.arange(1, 9, dtype=torch.float64)

    def prepare(real: int, size: int):
        loc = base[:real].clone()
        loc -= lens[:size] if variant == "bug" else lens[:real]
        return loc

    def run(served: bool):
        if not served:
            return [prepare(n, n) * 2 for n in (8, 6)]
        x = torch.zeros(8, dtype=torch.float64)
        g, out = kit.capture(lambda: x * 2, device="cpu", static={"x": x})
        outs = []
        for real in (8, 6):
            x[:real].copy_(prepare(real, 8))
            outs.append(kit.replay(g, out, real=real, size=8)[:real].clone())
        return outs

    finding = only_finding(lambda: kit.compare("padded_loc", variant, "cpu", lambda: run(True), lambda: run(False)),
                           variant)
    if finding is None:
        return
    assert finding.kind == "padded-shape-mismatch" and "loc -= lens[:size]" in finding.source, finding
