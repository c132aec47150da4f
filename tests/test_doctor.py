"""The graph doctor on the CPU backend: each finding kind on a small synthetic model, the report,
the environment switch, and the evaluation on the five cases."""
import contextlib
import gc
import html
import importlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

import workbench
from workbench import doctor, plots
from workbench import cases
from workbench.cases import graph_doctor
from workbench.engine import CaptureError, GraphRunner, IllegalMemoryAccess, events, graph, new_graph, synchronize
from workbench.engine.queries import is_capturing
from workbench.engine.source import user_frame

ROOT = pathlib.Path(workbench.__file__).resolve().parent.parent
HERE = os.path.relpath(__file__, ROOT)


def where(fn, code: str) -> str:
    """``file:line in function`` of the first line of ``fn`` that contains ``code`` (what
    ``Finding.location`` should say; a test's own assertion naming the code comes later)."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if code in line)
    return f"{HERE}:{start + offset} in {fn.__name__}"


def make_runner(model, dtype=torch.float32, sizes=(2, 4), **kw) -> GraphRunner:
    return GraphRunner(model, {"x": ((3,), dtype)}, sizes, **kw)


def batch(n: int, step: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Small integer values: float arithmetic on them is exact, so patterns are not blurred by rounding."""
    return torch.randint(0, 4, (n, 3), generator=torch.Generator().manual_seed(step)).to(dtype)


def make_batch(n: int, step: int) -> dict[str, torch.Tensor]:
    return {"x": batch(n, step)}


# ------------------------------------------------------------------- models (captured functions)
def accumulating(x):
    x += 2
    return x * 1


def overwriting(x):
    x[-1] = x[0]
    return x * 3


def overwriting_refreshed(x):
    x.fill_(1)
    return x * 3


def self_cancelling(x):
    x |= 8
    x &= ~8
    return x + 1


def self_cancelling_float(x):
    x += 1
    x -= 1
    return x * 2


def noisy_accumulating(x):
    x += 1
    return x + torch.rand_like(x)


def out_of_place(x):
    y = x + 2
    return y * 1


def row_mixing(x):
    return x + x.mean(0)


def row_wise(x):
    return x * 2 + 1


class Accumulator:
    """An in-place write to the static input and a state tensor the graph updates every replay."""

    def __init__(self):
        self.total = torch.zeros(3)

    def __call__(self, x):
        x += 2
        self.total += x.sum(0)
        return x * self.total


class LazyTable:
    """Builds its table from the first batch it sees: the warmup does it (from the dummy batch),
    the capture then finds it built."""

    def __init__(self):
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = x.sum(0) + torch.arange(3.0)
        return x * self.table


def sync_item(x):
    scale = x.sum().item()
    return x * scale


def sync_float(x):
    scale = float(x.sum())
    return x * scale


def sync_nonzero(x):
    rows = torch.nonzero(x)
    return x * rows.shape[0]


class ScaledAccumulating:
    """An in-place write to the static input, scaled by a weight the graph only references."""

    def __init__(self):
        self.scale = torch.ones(3) * 2

    def __call__(self, x):
        x += 1
        return x * self.scale


def gathered_weight():
    """A temporary whose only owner is the caller (the all-gathered weight of case 03)."""
    return torch.randn(3, 3) * 1


def capture_matmul(x, w):
    g = new_graph("cpu")
    with graph(g, name="matmul"):
        out = x @ w
    return g, out


# ------------------------------------------------------------------------ persistent-mutation
@pytest.mark.parametrize("model, dtype, pattern, op, code", [
    (accumulating, torch.float32, "accumulating", "aten.add_.Tensor", "x += 2"),
    (overwriting, torch.float32, "overwriting", "aten.copy_.default", "x[-1] = x[0]"),
], ids=["accumulating", "overwriting"])
def test_persistent_mutation_pattern_op_and_line(model, dtype, pattern, op, code):
    with doctor.watch() as report:
        runner = make_runner(model, dtype)
        runner.capture()
        runner(x=batch(3, dtype=dtype))
    (finding,) = report.findings
    assert finding.kind == "persistent-mutation"
    assert finding.numbers["pattern"] == pattern
    assert finding.op == op
    assert finding.location == where(model, code)
    assert finding.tensor == f"x: {str(dtype).replace('torch.', '')}[4, 3]"
    assert finding.graph == "size 4, size 2"         # size 2 was captured with the same write, never replayed
    assert pattern in finding.evidence and "`x`" in finding.cause
    assert "persistent-mutation" not in report.not_checked


def test_accumulating_numbers():
    with doctor.watch() as report:
        runner = make_runner(accumulating)
        runner.capture()
        runner(x=batch(3))
    (finding,) = report.of("persistent-mutation")
    # rows 0-2 are rewritten by the runner before each replay: only the padded row counts
    assert finding.numbers == {"pattern": "accumulating", "rows": 4, "rows_changed": 1,
                               "max_change_1": 2.0, "max_change_2": 4.0}


@pytest.mark.parametrize("model, dtype", [(self_cancelling, torch.int64), (self_cancelling_float, torch.float32),
                                          (overwriting_refreshed, torch.float32)],
                         ids=["self-cancelling-int", "self-cancelling-float", "writes-only-refreshed-values"])
def test_writes_that_leave_unrefreshed_elements_unchanged_give_no_finding(model, dtype):
    """An idempotent write, and a graph whose writes land only where the runner rewrites before
    every replay (the padded row already holds what the graph writes there)."""
    with doctor.watch() as report:
        runner = make_runner(model, dtype)
        runner.capture()
        runner(x=batch(3, dtype=dtype))
        runner(x=batch(1, dtype=dtype))                  # each graph replayed once, so probed
    assert report.of("persistent-mutation") == []


def test_mutation_without_a_watched_replay_is_reported_not_probed():
    with doctor.watch() as report:
        runner = make_runner(accumulating)
        runner.capture()
    (finding,) = report.of("persistent-mutation")
    assert finding.numbers == {"pattern": "not probed"}
    assert finding.location == where(accumulating, "x += 2")
    assert "not probed" in finding.evidence


def test_out_of_place_gives_no_finding():
    with doctor.watch() as report:
        runner = make_runner(out_of_place)
        runner.capture()
        out = runner(x=batch(3))
    assert report.findings == []
    assert "persistent-mutation" in report.checked
    assert torch.equal(out, batch(3) + 2)


def serve_accumulator(watched: bool):
    """Outputs, static buffer, state and replay counts of a short run of ``Accumulator``."""
    with doctor.watch() if watched else contextlib.nullcontext() as report:
        model = Accumulator()
        runner = make_runner(model)
        runner.capture()
        outputs = [runner(x=batch(n, step)).clone() for step, n in enumerate((3, 4, 1, 2, 3))]
    replays = {size: g.replays for size, g in runner.graphs.items()}
    return outputs, runner.buffers["x"].clone(), model.total.clone(), replays, report


def test_mutation_probe_leaves_buffers_state_and_replay_counts_as_without_the_doctor():
    plain, watched = serve_accumulator(False), serve_accumulator(True)
    for a, b in zip(plain[0], watched[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(plain[1], watched[1])
    assert torch.equal(plain[2], watched[2])
    assert plain[3] == watched[3] == {2: 2, 4: 3}


def test_mutation_probe_leaves_the_random_stream_as_without_the_doctor():
    def serve(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        with doctor.watch() if watched else contextlib.nullcontext():
            runner = make_runner(noisy_accumulating)
            runner.capture()
            return [runner(x=batch(3, step)).clone() for step in range(3)]
    for a, b in zip(serve(False), serve(True), strict=True):
        assert torch.equal(a, b)


def test_self_cancelling_write_on_poisoned_padded_rows_is_still_no_finding():
    with doctor.watch() as report:
        runner = make_runner(self_cancelling_float, poison_padding=True)
        runner.capture()
        runner(x=batch(3))                                # row 3 of 4 is NaN
        runner(x=batch(1))
    assert report.of("persistent-mutation") == []


def serve_with_eager_shift(rows, *, undo: bool = False):
    """Serve ``rows`` through a runner whose eager code around the replays shifts the whole static
    buffer in place (as ``pre_model`` does under PIECEWISE graphs); ``undo`` shifts it back."""
    with doctor.watch() as report:
        runner = make_runner(row_wise, sizes=(4,))
        runner.capture()
        for step, n in enumerate(rows):
            runner(x=batch(n, step))
            runner.buffers["x"] += 2
            if undo:
                runner.buffers["x"] -= 2
    return report


def test_eager_update_of_rows_nobody_rewrites_is_an_accumulating_persistent_mutation():
    report = serve_with_eager_shift((4, 2, 2))
    (finding,) = report.findings
    assert finding.kind == "persistent-mutation"
    assert finding.graph == "outside the graphs (eager code of GraphRunner)"
    assert finding.op == "aten.add_.Tensor" and finding.tensor == "x: float32[4, 3]"
    assert finding.location == where(serve_with_eager_shift, 'runner.buffers["x"] += 2')
    # call 2 (2 real rows): rows 2 and 3 still held call 1's result, 0 + 2 + ... -> +2 again
    assert {k: finding.numbers[k] for k in ("pattern", "call", "rows", "rows_changed", "first_row")} == {
        "pattern": "accumulating", "call": 2, "rows": 4, "rows_changed": 2, "first_row": 2}
    assert finding.numbers["now"] == finding.numbers["was"] + 2
    assert "eager code around them" in finding.cause


def test_eager_update_of_rows_rewritten_every_step_or_undone_gives_no_finding():
    assert serve_with_eager_shift((4, 4, 4)).findings == []          # the runner rewrites every row
    assert serve_with_eager_shift((4, 2, 2), undo=True).findings == []  # shifted back each step


def test_code_run_eagerly_before_the_capture_is_not_warmup_divergence():
    def shift(x):
        x += 2

    buf = torch.zeros(4, 3)
    with doctor.watch() as report:
        events.static_buffers("Piecewise", {"x": buf})
        with events.warmup():
            shift(buf)
            row_wise(buf)
        shift(buf)                                   # the runner keeps it outside the graph
        g = new_graph("cpu")
        with graph(g, name="size 4"):
            row_wise(buf)
        g.replay()
    assert report.of("warmup-divergence") == [] and "warmup-divergence" in report.checked


# ---------------------------------------------------------------------------------- stale-padding
def test_row_mixing_model_has_stale_padding():
    report = doctor.diagnose(lambda: make_runner(row_mixing), make_batch)
    (finding,) = report.findings
    assert finding.kind == "stale-padding"
    assert finding.op == "aten.mean.dim"
    assert finding.location == where(row_mixing, "x.mean(0)")
    assert finding.numbers["max_abs_diff"] > 0
    assert "stale-padding" not in report.not_checked
    assert any("padded step" in note for note in report.notes)


def test_row_wise_model_has_no_stale_padding():
    report = doctor.diagnose(lambda: make_runner(row_wise), make_batch)
    assert report.findings == []
    assert "stale-padding" in report.checked
    assert report.replays == 5                        # default rows: 4, then 4 3 2 1


def test_no_padded_rows_leaves_stale_padding_not_checked():
    report = doctor.diagnose(lambda: make_runner(row_mixing), make_batch, rows=[4, 2])
    assert report.findings == []
    assert "no padded rows" in report.not_checked["stale-padding"]


def test_padding_probe_off_leaves_stale_padding_not_checked():
    report = doctor.diagnose(lambda: make_runner(row_wise), make_batch, padding_probe=False)
    assert report.findings == []
    assert report.not_checked["stale-padding"] == "diagnose(padding_probe=False)"


def test_without_the_padding_probe_the_unpadded_step_still_finds_rows_mixed_with_padding():
    """``GraphRunner`` steps announce their form on the real rows alone: a model that mixes rows
    gives the real rows other results when padded (``probes/unpadded.py``), probes or not."""
    report = doctor.diagnose(lambda: make_runner(row_mixing), make_batch, padding_probe=False)
    (finding,) = report.findings
    assert finding.kind == "stale-padding" and finding.numbers["unpadded"], report
    assert "from an eager run of the step on its 3 real rows alone" in finding.evidence
    assert "stale-padding" not in report.not_checked
    with_probe = doctor.diagnose(lambda: make_runner(row_mixing), make_batch)
    assert [f.op for f in with_probe.findings] == ["aten.mean.dim"]     # the probe's finding localises better


# -------------------------------------------------------------------------- dangling-reference
def test_dangling_reference_is_recorded_and_the_engine_then_raises():
    x = torch.ones(2, 3)
    with doctor.watch() as report:
        w = gathered_weight()
        g, out = capture_matmul(x, w)
        g.replay()
        expected = x @ w
        assert torch.equal(out, expected)
        del w
        gc.collect()
        with pytest.raises(IllegalMemoryAccess):
            g.replay()
    (finding,) = report.findings
    assert finding.kind == "dangling-reference"
    assert finding.graph == "matmul"
    assert finding.op == "aten.mm.default"
    assert finding.tensor == "float32[3, 3]"
    # the finding stands where the weight was let go; the read the replay would fault on is in the evidence
    assert finding.location == where(test_dangling_reference_is_recorded_and_the_engine_then_raises, "del w")
    assert f"through aten.mm.default at {where(capture_matmul, 'out = x @ w')}" in finding.evidence
    assert f"created at {where(gathered_weight, 'torch.randn(3, 3) * 1')}" in finding.evidence
    assert finding.numbers == {"replays_before": 1}


class Residual:
    """A zero residual grown lazily outside capture: the view the capture takes of it is where the
    graph keeps its address (as the engine's faulting replay names it), not the op reading the view."""

    def __init__(self):
        self.buf = None

    def zero_residual(self, x):
        if self.buf is None or self.buf.numel() < x.numel():
            self.buf = torch.zeros(x.numel())               # the last one is released here
        return self.buf[:x.numel()].view_as(x)

    def forward(self, x):
        return torch.relu(x + self.zero_residual(x))


def test_a_dangling_reference_is_named_where_the_capture_took_its_address_and_says_where_it_went():
    x, model = torch.ones(2, 3), Residual()
    with doctor.watch() as report:
        model.forward(torch.ones(2, 3))
        g = new_graph("cpu")
        with graph(g):
            model.forward(x)
        model.forward(torch.ones(4, 3))                     # an eager batch grows the residual
        with pytest.raises(IllegalMemoryAccess, match="in zero_residual"):
            g.replay()
    (finding,) = report.findings
    assert finding.kind == "dangling-reference" and finding.op == "aten.slice.Tensor"
    released = where(Residual.zero_residual, "self.buf = torch.zeros(x.numel())")    # where it went,
    read = where(Residual.zero_residual, "return self.buf[:x.numel()].view_as(x)")  # and where the graph took it
    assert finding.location == released and f"through aten.slice.Tensor at {read}" in finding.evidence
    assert f"released at {released}" in finding.evidence and f"released it at {released}" in finding.cause


class LoadedModule:
    """A loaded kernel image that its finalizer unloads (``__del__`` -> ``unload_image``)."""

    def __init__(self):
        self.image = torch.ones(3, 3)

    def unload_image(self):
        self.image = None                                   # the finalizer's own release

    def __del__(self):
        self.unload_image()


class KernelCache:
    def __init__(self):
        self.modules = {}

    def store(self, key, module):
        self.modules[key] = module                          # drops the last reference to the old module


def test_memory_a_finalizer_releases_is_named_where_the_last_reference_went():
    x, cache = torch.ones(2, 3), KernelCache()
    with doctor.watch() as report:
        cache.store("k", LoadedModule())
        g, out = capture_matmul(x, cache.modules["k"].image)
        cache.store("k", LoadedModule())                    # a second load of the same key replaces the first
        with pytest.raises(IllegalMemoryAccess):
            g.replay()
    (finding,) = report.findings
    dropped = where(KernelCache.store, "self.modules[key] = module")
    assert finding.kind == "dangling-reference" and finding.location == dropped
    assert f"released at {dropped}" in finding.evidence


class Scratch:
    """A capture's scratch kept only by a local of the function that captures: it goes when that
    function returns."""

    def capture(self, x):
        w = torch.randn(3, 3)
        self.g = new_graph("cpu")
        with graph(self.g):
            self.out = x @ w
        return self.g


def test_memory_released_with_a_functions_locals_is_named_at_that_function_under_diagnose():
    def workload():
        x = torch.ones(2, 3)
        g = Scratch().capture(x)
        g.replay()

    report = doctor.diagnose(workload)
    finding = next(f for f in report.findings if f.kind == "dangling-reference")
    assert f"released at {where(Scratch.capture, 'return self.g')}" in finding.evidence


class Fields:
    """Metadata whose fields a replay reads; a helper rebinds them from another instance."""

    def __init__(self, n):
        self.loc = torch.arange(float(n))

    def copy_from(self, other, how):
        if how == "told":
            copy_fields(other, self, assign=["loc"])
        elif how == "spelled":
            assign_loc(self, other.loc)
        else:
            derive_fields(self, other)


def copy_fields(src, dst, assign):
    for name in assign:
        setattr(dst, name, getattr(src, name))


def assign_loc(dst, value):
    setattr(dst, "loc", value)


def derive_fields(dst, src):
    for name, value in {"loc": src.loc * 1}.items():
        setattr(dst, name, value)


@pytest.mark.parametrize("how", ["told", "spelled", "own"])
def test_memory_released_by_a_helper_that_rebinds_the_fields_it_is_told_to_is_named_at_its_caller(how):
    """A helper that ``setattr``s the fields its caller lists on an object it was given does what it
    is told: the release is named where it was told (``copy_from``). One that spells the field, or
    chooses the fields itself (its own table of them), is where the release happens."""
    def workload():
        meta = Fields(3)
        g = new_graph("cpu")
        with graph(g):
            out = meta.loc * 2
        meta.copy_from(Fields(3), how)
        g.replay()
        return out

    report = doctor.diagnose(workload)
    finding = next(f for f in report.findings if f.kind == "dangling-reference")
    at = {"told": where(Fields.copy_from, "copy_fields(other"), "spelled": where(assign_loc, 'setattr(dst, "loc"'),
          "own": where(derive_fields, "setattr(dst, name")}[how]
    assert f"released at {at}" in finding.evidence


def test_memory_released_by_the_garbage_collector_names_no_line():
    x = torch.ones(2, 3)
    with doctor.watch() as report:
        w = gathered_weight()
        cycle = {"w": w}
        cycle["self"] = cycle
        g, out = capture_matmul(x, w)
        del w, cycle
        gc.collect()                                # the cycle's release is the collector's, not a line's
        with pytest.raises(IllegalMemoryAccess):
            g.replay()
    (finding,) = report.findings
    assert "released at" not in finding.evidence and "released it after capture" in finding.cause


def test_guard_stops_the_replay_before_it_reads_released_memory():
    x = torch.ones(2, 3)
    with doctor.watch(guard=True) as report:
        w = gathered_weight()
        g, out = capture_matmul(x, w)
        g.replay()
        before = out.clone()
        del w
        gc.collect()
        with pytest.raises(doctor.DanglingReferenceError) as caught:
            g.replay()
    assert g.replays == 1 and torch.equal(out, before)         # the replay did not run
    assert caught.value.finding is report.findings[0]
    assert caught.value.finding.location == where(test_guard_stops_the_replay_before_it_reads_released_memory,
                                                  "del w")
    assert where(capture_matmul, "out = x @ w") in str(caught.value)                   # what it would read
    assert where(gathered_weight, "torch.randn") in str(caught.value)


def test_tensor_kept_alive_gives_no_dangling_reference():
    x = torch.ones(2, 3)
    with doctor.watch(guard=True) as report:
        w = gathered_weight()
        g, out = capture_matmul(x, w)
        gc.collect()
        g.replay()
        g.replay()
    assert report.findings == []
    assert torch.equal(out, x @ w)


def test_in_place_write_is_still_reported_when_the_first_replay_finds_a_released_tensor():
    with doctor.watch() as report:
        model = ScaledAccumulating()
        runner = make_runner(model, sizes=(4,))
        runner.capture()
        model.scale = None
        gc.collect()
        with pytest.raises(IllegalMemoryAccess):
            runner(x=batch(3))
    assert "persistent-mutation" in report.checked
    assert report.kinds == {"dangling-reference", "persistent-mutation"}


# --------------------------------------------------------------------------- warmup-divergence
def test_lazy_init_in_warmup_is_warmup_divergence():
    with doctor.watch() as report:
        runner = make_runner(LazyTable().forward)
        runner.capture()
        runner(x=batch(3))
    (finding,) = report.findings
    assert finding.kind == "warmup-divergence"
    assert finding.graph == "size 4"                 # size 2's warmup found the table built, as its capture did
    assert finding.op == "aten.sum.dim_IntList"     # arange alone reads no data: a constant, not counted
    assert finding.location == where(LazyTable.forward, "self.table = x.sum(0) + torch.arange(3.0)")
    assert finding.numbers == {"warmup_ops": 4, "captured_ops": 1, "missing": 2, "lines": 1}


def test_eager_init_gives_no_warmup_divergence():
    model = LazyTable()
    model.forward(torch.zeros(1, 3))                 # built before the runner exists
    with doctor.watch() as report:
        runner = make_runner(model.forward)
        runner.capture()
        runner(x=batch(3))
    assert report.findings == []
    assert "warmup-divergence" in report.checked


def test_without_warmup_warmup_divergence_is_not_checked():
    with doctor.watch() as report:
        runner = make_runner(LazyTable().forward, num_warmups=0)
        runner.capture()
        runner(x=batch(3))
    assert report.warmups == 0
    assert report.of("warmup-divergence") == []
    assert report.not_checked["warmup-divergence"] == "no warmup run was announced before any capture"


# --------------------------------------------------------------------------- undersized-buffer
def serve_one(*buffers, real: int = 1) -> None:
    """Capture a graph that reads ``buffers`` and serve it one step of ``real`` rows."""
    g = new_graph("cpu")
    with graph(g, name="reads"):
        out = sum(b.sum() for b in buffers)
    events.serve(g, real, max(real, 1), outputs=out)
    g.replay()


@pytest.mark.parametrize("real", [1, 0])
def test_zero_sized_static_buffer_is_undersized_once_a_graph_reading_it_serves_data(real):
    """A graph captured on an empty input and served steps with no rows (an expert no token was
    routed to) is consistent; served a step with real rows, it was captured for no data."""
    with doctor.watch() as report:
        pixels = torch.zeros(0, 4)
        events.static_buffers("Encoder", {"pixels": pixels})
        assert report.findings == []
        serve_one(pixels, real=real)
    if not real:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "undersized-buffer"
    assert finding.graph == "capture inputs of Encoder"
    assert finding.op == "aten.zeros.default"
    where_made = where(test_zero_sized_static_buffer_is_undersized_once_a_graph_reading_it_serves_data,
                       "pixels = torch.zeros(0, 4)")
    assert finding.location == where_made
    assert finding.numbers == {"shape": [0, 4], "empty_inputs": ["pixels"]}


def test_empty_capture_inputs_of_one_announcement_are_one_finding():
    with doctor.watch() as report:
        pixels = torch.zeros(0, 4)
        events.static_buffers("Encoder", {"ids": torch.zeros(4, dtype=torch.int64), "pixels": pixels,
                                          "pos": torch.zeros(0, 8)})
        serve_one(pixels)
    (finding,) = report.findings
    assert finding.tensor.startswith("pixels: ") and finding.numbers["empty_inputs"] == ["pixels", "pos"]
    assert finding.evidence.startswith("2 of 3 capture inputs are empty: pixels has shape (0, 4)")
    assert "pos has shape (0, 8): dimension 0 is 0" in finding.evidence


def test_copy_of_too_many_rows_into_a_static_buffer_is_undersized():
    with doctor.watch() as report:
        buf = torch.zeros(4, 3)
        events.static_buffers("Runner", {"x": buf})
        buf[:2].copy_(torch.ones(2, 3))             # fits
        buf[:1].copy_(torch.ones(3))                # broadcasts: fits
        with pytest.raises(RuntimeError):
            buf[1:3].copy_(torch.ones(6, 3))
    (finding,) = report.findings
    assert finding.kind == "undersized-buffer"
    assert finding.op == "aten.copy_.default"
    assert finding.location == where(test_copy_of_too_many_rows_into_a_static_buffer_is_undersized,
                                     "buf[1:3].copy_")
    assert finding.numbers == {"data_shape": [6, 3], "buffer_shape": [4, 3]}


def test_a_slice_past_the_end_of_a_static_buffer_is_undersized_even_when_nothing_fails():
    """``buf[:bs, :w] = table[:bs, :w]`` with ``bs`` larger than the buffer: Python clamps both
    slices, the copy succeeds and rows are dropped without an error."""
    table = torch.arange(30.0).reshape(6, 5)
    with doctor.watch() as report:
        buf = torch.zeros(4, 5)
        events.static_buffers("Runner", {"block_table": buf})
        bs, w = 6, 5
        buf[:bs, :w] = table[:bs, :w][:4]
    (finding,) = report.findings
    assert (finding.kind, finding.op) == ("undersized-buffer", "aten.slice.Tensor")
    assert finding.numbers == {"dim": 0, "end": 6, "length": 4}
    assert finding.tensor == "block_table: float32[4, 5]"


# -------------------------------------------------------------------------- overwritten-output
def test_reading_an_output_after_the_next_call_is_overwritten_output():
    with doctor.watch() as report:
        runner = make_runner(row_wise)
        runner.capture()
        first = runner(x=batch(3, 0))
        runner(x=batch(3, 1))
        stale = first + 0
    assert torch.equal(stale, batch(3, 1) * 2 + 1)     # the second call's values, as the finding says
    (finding,) = report.findings
    assert finding.kind == "overwritten-output"
    assert finding.op == "aten.add.Tensor"
    assert finding.location == where(test_reading_an_output_after_the_next_call_is_overwritten_output,
                                     "stale = first + 0")
    assert finding.numbers == {"handed_out_after": 1, "read_after": 2}


def _kept_row(out):
    return out[1]                    # a part of the graph's output kept, not a copy


def _reshaped(out):
    return out.view(-1)              # the same output in another form


@pytest.mark.parametrize("keep", [_kept_row, _reshaped])
def test_an_overwritten_view_is_named_where_a_part_of_the_output_was_taken(keep):
    """A view that takes a part of a handed-out output (a row, a slice) is where the code chose to
    keep the graph's memory rather than a copy: the finding names that line. A view of the whole
    (a reshape) only hands the output on in another form: the finding names the read."""
    with doctor.watch() as report:
        runner = make_runner(row_wise)
        runner.capture()
        kept = keep(runner(x=batch(3, 0)))
        runner(x=batch(3, 1))
        stale = kept + 0
    (finding,) = report.findings
    assert finding.kind == "overwritten-output"
    read = where(test_an_overwritten_view_is_named_where_a_part_of_the_output_was_taken, "stale = kept + 0")
    if keep is _kept_row:
        assert finding.location == where(_kept_row, "return out[1]")
        assert f"and read at {read}" in finding.evidence
    else:
        assert finding.location == read


def test_cloning_before_the_next_call_is_not_overwritten_output():
    with doctor.watch() as report:
        runner = make_runner(row_wise)
        runner.capture()
        first = runner(x=batch(3, 0)).clone()
        runner(x=batch(3, 1))
        kept = first + 0
    assert torch.equal(kept, batch(3, 0) * 2 + 1)
    assert report.findings == []
    assert "overwritten-output" in report.checked


@pytest.mark.parametrize("repoint", ["set_", "data"])
def test_an_output_moved_out_of_the_pool_before_the_next_call_is_not_overwritten_output(repoint):
    """A runner that clones a live output out of the pool in place (``t.set_(t.clone())``, or
    ``t.data = t.clone()``), as a generation boundary does, keeps the object the caller holds."""
    with doctor.watch() as report:
        runner = make_runner(row_wise)
        runner.capture()
        first = runner(x=batch(3, 0))
        with torch.no_grad():
            if repoint == "set_":
                first.set_(first.clone())
            else:
                first.data = first.clone()
        runner(x=batch(3, 1))
        kept = first + 0
    assert torch.equal(kept, batch(3, 0) * 2 + 1)
    assert report.findings == []


def test_reading_a_view_of_an_output_after_the_next_call_is_overwritten_output():
    with doctor.watch() as report:
        runner = make_runner(row_wise)
        runner.capture()
        first = runner(x=batch(3, 0))
        runner(x=batch(3, 1))
        first[:, -1] + 0
    assert report.kinds == {"overwritten-output"}


@pytest.mark.parametrize("clone", [False, True])
def test_rows_split_off_an_output_and_read_on_the_host_later_are_overwritten_output(clone):
    """An output's rows split off per request (``split`` returns views) and queued; the queue is read
    on the host (``tolist``, which dispatches no op on the CPU) after the next call replayed over
    them. Cloned first, the rows hold their own values."""
    with doctor.watch() as report:
        runner = make_runner(row_wise)
        runner.capture()
        out = runner(x=batch(3, 0))
        queued = list((out.clone() if clone else out).split([1, 1, 1]))
        runner(x=batch(3, 1))
        rows = [row.tolist() for row in queued]
    assert (rows[0] == (batch(3, 0) * 2 + 1)[:1].tolist()) == clone
    if clone:
        assert report.findings == []
        return
    (finding,) = report.findings
    assert finding.kind == "overwritten-output" and finding.op == "Tensor.tolist"


@pytest.mark.parametrize("copy", [False, True])
def test_rows_kept_of_a_graphs_own_output_returned_as_it_is_are_overwritten_output(copy):
    """A wrapper that returns the graph's static output itself at every call (the dict a capture
    returned, as a framework's graph wrapper does), not the view it hands out: the caller's rows of
    one call, kept in a list and stacked after the next call replayed over them, read the next
    call's values. Named where the rows were taken; copied first (the fix), nothing is."""
    from workbench.zoo.kit import capture, replay

    def workload():
        x = torch.zeros(2, 3)
        g, out = capture(lambda: {"embedding": x * 2 + 1}, device="cpu", static={"x": x}, warmups=0,
                         name="embed (2, 3)")

        def call(batch):
            x.copy_(batch)
            replay(g, out["embedding"])
            return out                                    # the graph's own outputs, as they are

        kept = []
        for seed in range(2):
            features = call(batch(2, seed))
            embeddings = features["embedding"].clone() if copy else features["embedding"]
            kept.extend(embeddings)                       # one row view per sentence
        return torch.stack(kept)

    report = doctor.diagnose(workload)
    if copy:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "overwritten-output" and finding.op == "aten.stack.default", finding
    assert "kept.extend(embeddings)" in finding.source, finding
    assert finding.graph == "embed (2, 3)", finding       # each row read is the same hazard, in one graph


def test_an_output_copied_to_the_host_after_the_next_call_is_one_overwritten_output():
    """``cpu()`` is where a CUDA program reads the output (the copy); on the CPU it returns the tensor
    itself and dispatches nothing, so it is watched as a host read. Read again (``tolist``), the
    stale output is the same hazard: one finding, at the first read, as on CUDA."""
    def take_to_host(t):
        return t.cpu()

    with doctor.watch() as report:
        runner = make_runner(row_wise)
        runner.capture()
        first = runner(x=batch(3, 0))
        runner(x=batch(3, 1))
        take_to_host(first).tolist()
    (finding,) = report.findings
    assert finding.kind == "overwritten-output" and finding.op == "Tensor.cpu"
    assert finding.location == where(take_to_host, "return t.cpu()")


# ----------------------------------------------------------------------------- sync-in-capture
@pytest.mark.parametrize("model, op, code", [
    (sync_item, "Tensor.item()", "x.sum().item()"),
    (sync_float, "Tensor.__float__()", "float(x.sum())"),
    (sync_nonzero, "aten.nonzero.default", "torch.nonzero(x)"),
], ids=["item", "float", "nonzero"])
def test_host_sync_in_capture_is_flagged_and_the_capture_error_propagates(model, op, code):
    with doctor.watch() as report:
        runner = make_runner(model)
        with pytest.raises(CaptureError):
            runner.capture()
    (finding,) = report.findings
    assert finding.kind == "sync-in-capture"
    assert finding.graph == "size 4"
    assert finding.op == op
    assert finding.location == where(model, code)
    assert any(note.startswith("capture of size 4 failed: CaptureError") for note in report.notes)


def stream_synchronize(x):
    """A helper named for the sync it performs (a stand-in for ``cudaStreamSynchronize``)."""
    return x.sum().item()


def benchmark_in_capture(x):
    stream_synchronize(x)                      # the code that decided to sync
    return x * 2


def host_list(x):
    return x * len([row for row in x.tolist() if row[0] > 0])


def host_copy(x):
    return x * x.cpu().sum()


@pytest.mark.parametrize("model", [host_list, host_copy], ids=["tolist", "cpu"])
def test_a_host_read_the_doctor_also_watches_is_still_refused_in_a_capture(model):
    """``tolist`` and ``cpu`` are wrapped while the doctor watches (host reads on the CPU dispatch no
    op); inside a capture they are refused as without the doctor: the engine's guard knows them by
    their name, which the wrappers keep."""
    with pytest.raises(CaptureError):
        make_runner(model).capture()
    with doctor.watch() as report:
        with pytest.raises(CaptureError):
            make_runner(model).capture()
    assert [f.kind for f in report.findings] == ["sync-in-capture"]


def refused_in_capture(model):
    """The one finding of a capture of ``model`` that the engine refuses."""
    with doctor.watch() as report:
        runner = make_runner(model)
        with pytest.raises(CaptureError):
            runner.capture()
    (finding,) = report.findings
    assert finding.kind == "sync-in-capture"
    return finding


class Event:
    """A stand-in for a runtime event: ``wait`` only passes the synchronisation on."""

    def __init__(self, device):
        self.device = device

    def wait(self):
        synchronize(self.device)


def reorder_in_capture(x):
    y = x * 2
    Event(x.device).wait()                     # the code that decided to wait
    return y + 1


def sync_by_hand(x):
    synchronize(x.device)                      # one call among other work: the code that decided to sync
    return x * 2


@pytest.mark.parametrize("model, code", [(benchmark_in_capture, "stream_synchronize(x)"),
                                         (reorder_in_capture, "Event(x.device).wait()")], ids=["named", "wrapper"])
def test_a_sync_in_a_function_named_for_it_or_only_passing_it_on_is_named_where_it_was_called(model, code):
    """``stream_synchronize`` is named for the sync; ``Event.wait`` does nothing but call the refused
    synchronisation. Either is the sync's stand-in, and the line that called it decided to sync."""
    finding = refused_in_capture(model)
    assert finding.location == where(model, code)
    assert "the synchronisation itself" in finding.evidence


def test_a_function_that_syncs_among_other_work_is_the_site():
    finding = refused_in_capture(sync_by_hand)
    assert finding.op == "synchronize()" and finding.location == where(sync_by_hand, "synchronize(x.device)")


def launch(kernel, device, stream=None):
    """A launch helper: with no stream given, the legacy stream, which synchronises with the others."""
    if stream is None:
        synchronize(device)
    return kernel()


def blocking_copy(dst, src):
    """A stand-in for ``cudaMemcpy``: synchronise, then copy."""
    synchronize(dst.device)
    dst.copy_(src)


def scale_on_legacy_stream(x):
    y = torch.empty_like(x)
    launch(lambda: y.copy_(x * 2), x.device)   # the code that chose the legacy stream (no stream given)
    return y + 1


def gather_blocking(x):
    y = torch.empty_like(x)
    blocking_copy(y, x)                        # the code that chose a blocking copy
    return y * 2


def scale_then_block(x):
    y = x * 2
    synchronize(x.device)                      # after work of its own: the code that decided to sync
    return y


def scaled_and_blocked(x):
    return scale_then_block(x) + 1


@pytest.mark.parametrize("model, code", [(scale_on_legacy_stream, "launch(lambda"),
                                         (gather_blocking, "blocking_copy(y, x)")], ids=["stream-argument", "always"])
def test_a_function_that_synchronises_before_any_work_of_its_own_is_named_where_it_was_called(model, code):
    """``launch`` synchronises when its caller gives no stream; ``blocking_copy`` always does. Neither
    computed anything of its own before the sync (no local variable, none of the workload's functions):
    only its arguments chose the path, and the line that called it chose to block."""
    finding = refused_in_capture(model)
    assert finding.location == where(model, code), finding


def test_a_function_that_synchronises_after_work_of_its_own_is_the_site_when_another_calls_it():
    finding = refused_in_capture(scaled_and_blocked)
    assert finding.location == where(scale_then_block, "synchronize(x.device)"), finding


def device_synchronize(device):
    synchronize(device)


class WaitedTemporary:
    """A temporary that is released by a wait for the stream when it holds memory (a raw
    allocation's destructor: synchronise, then free)."""

    def __init__(self, x):
        self.ptr = torch.empty_like(x)

    def free(self):
        if self.ptr is not None:
            device_synchronize(self.ptr.device)
            self.ptr = None


def scratch_released_by_a_wait(x):
    scratch = WaitedTemporary(x)
    scratch.ptr.copy_(x * 2)
    y = scratch.ptr + 1
    scratch.free()                             # the code that chose a temporary released by a wait
    return y


def timed(kernel, x):
    """A benchmark: launch, then wait for the device to time it."""
    kernel(x)
    device_synchronize(x.device)


def autotune_in_capture(x):
    timed(torch.neg, x)
    return x + 1


def test_a_release_that_only_waits_is_named_where_it_was_called_a_benchmark_that_launched_first_is_the_site():
    """``WaitedTemporary.free`` does nothing but the call that waits (it tests and clears its own
    field): it is the runtime's release as its caller asked for it, and the line that released the
    temporary is the site, past the helper named for the sync and the method alike. ``timed``
    launched a kernel before it waits: the benchmark decided to wait, and is the site."""
    finding = refused_in_capture(scratch_released_by_a_wait)
    assert finding.location == where(scratch_released_by_a_wait, "scratch.free()"), finding
    finding = refused_in_capture(autotune_in_capture)
    assert finding.location == where(timed, "device_synchronize(x.device)"), finding


def cudaMalloc(x):
    """A library's stand-in for a runtime call that a capture refuses (its own check, its own error)."""
    if is_capturing():
        raise CaptureError("cudaMalloc: operation not permitted when stream is capturing", op="cudaMalloc",
                           source=user_frame())
    return torch.empty_like(x)


def lazy_workspace(x):
    return cudaMalloc(x).copy_(x) * 2          # the code that decided to allocate here


def test_a_refused_call_in_a_function_named_for_it_is_named_where_it_was_called():
    """The refused op is a function of the workload's own, named for the runtime call it stands for:
    the site is the line that called it, as for a function named for a sync."""
    finding = refused_in_capture(lazy_workspace)
    assert finding.op == "cudaMalloc" and finding.location == where(lazy_workspace, "cudaMalloc(x)")


class Stream:
    """A library's bookkeeping of streams: waiting on an event recorded inside a capture from a
    stream that is not capturing is refused, with the engine's error naming the runtime call only."""

    def __init__(self, capturing: bool):
        self.capturing = capturing

    def wait(self, recorded_in_capture: bool):
        if recorded_in_capture and not self.capturing and is_capturing():
            raise CaptureError("operation would make the legacy stream depend on a capturing stream",
                               op="cudaStreamWaitEvent")


def accumulate_on_the_default_stream(x):
    Stream(capturing=False).wait(recorded_in_capture=True)      # the line that made the wait
    return x * 2


def test_a_refusal_raised_without_a_line_is_named_where_its_raiser_was_called():
    """A ``CaptureError`` the workload's own code raises names an op but no line: the finding stands
    at the traceback, as for CUDA's own refusal, and the function that raised it (a status check)
    stands for the call its caller made. Never ``<unknown>``."""
    finding = refused_in_capture(accumulate_on_the_default_stream)
    assert finding.op == "cudaStreamWaitEvent"
    assert finding.location == where(accumulate_on_the_default_stream, "Stream(capturing=False).wait("), finding


def test_capture_error_leaving_watch_is_listed_in_the_report():
    with pytest.raises(CaptureError), doctor.watch() as report:
        make_runner(sync_item).capture()
    assert [f.kind for f in report.findings] == ["sync-in-capture"]
    assert len(report.errors) == 1 and report.errors[0].startswith("CaptureError: ")


# ------------------------------------------------------------------------ the doctor's own errors
MUTATION_PROBE = importlib.import_module("workbench.doctor.probes.mutation")
PADDING_PROBE = importlib.import_module("workbench.doctor.probes.padding")
UNDERSIZED = importlib.import_module("workbench.doctor.rules.undersized")
DANGLING = importlib.import_module("workbench.doctor.rules.dangling")
WARMUP = importlib.import_module("workbench.doctor.rules.warmup")


def broken(*args, **kwargs):
    raise KeyError("planted")


@pytest.mark.parametrize("module, name, where", [
    (MUTATION_PROBE, "probe", "replay_begin"),                    # an event handler, before the first replay
    (UNDERSIZED, "check_fit", "watching aten.copy_.default"),     # the dispatch mode, before the op runs
    (WARMUP, "frames_within", "watching aten.add_.Tensor"),       # the dispatch mode, after the warmup's op ran
])
def test_a_failing_doctor_stops_watching_and_leaves_the_run_as_without_it(monkeypatch, module, name, where):
    monkeypatch.setattr(module, name, broken)
    plain, watched = serve_accumulator(False), serve_accumulator(True)
    for a, b in zip(plain[0], watched[0], strict=True):       # every op ran, and ran once
        assert torch.equal(a, b)
    assert torch.equal(plain[1], watched[1]) and torch.equal(plain[2], watched[2])
    assert plain[3] == watched[3]
    assert watched[4].failure.startswith(f"KeyError in {where} at ")


CHECK_LIVENESS = DANGLING.check


def broken_at_the_end(doctor, info, *, before_replay):
    """The liveness check failing only in the final checks, after the replays were watched."""
    if not before_replay:
        raise KeyError("planted")
    CHECK_LIVENESS(doctor, info, before_replay=before_replay)


@pytest.mark.parametrize("module, name, replacement, where, found", [
    (MUTATION_PROBE, "probe", broken, "replay_begin", []),
    (DANGLING, "check", broken_at_the_end, "_final_checks", ["persistent-mutation"]),  # probed at the replay
])
def test_the_report_of_a_failing_doctor_says_where_it_stopped_and_claims_nothing_more(monkeypatch, module, name,
                                                                                       replacement, where, found):
    monkeypatch.setattr(module, name, replacement)
    with doctor.watch() as report:
        runner = make_runner(accumulating)
        runner.capture()
        runner(x=batch(3))
    assert report.failure.startswith(f"KeyError in {where} at test_doctor.py:")
    assert re.match(rf"KeyError in {where} at test_doctor\.py:\d+, from \w+\.py:\d+", report.failure), report.failure
    assert report.failure.endswith(": 'planted'")
    assert [f.kind for f in report.findings] == report.checked == found
    assert all(why.startswith("the doctor stopped early (KeyError") for why in report.not_checked.values())
    assert "stopped early on an error of its own" in str(report).splitlines()[0]
    assert report.errors == []                             # the watched code raised nothing


def test_a_released_static_buffer_with_tracked_eager_updates_is_a_dangling_reference():
    """The released buffer is the finding, not a reason for the doctor to break."""
    buf = torch.zeros(4, 3)
    with doctor.watch() as report:
        events.static_buffers("Runner", {"x": buf})
        g = new_graph("cpu")
        with graph(g, name="size 4"):
            accumulating(buf)                            # the graph writes the buffer
        buf += 1                                         # an eager update the doctor tracks
        del buf
        with pytest.raises(IllegalMemoryAccess):
            g.replay()
    assert report.failure is None
    assert [f.kind for f in report.findings] == ["dangling-reference"]


def test_an_op_that_fails_by_itself_is_the_watched_code_error_not_the_doctors():
    with pytest.raises(RuntimeError, match="must match the size"), doctor.watch() as report:
        torch.zeros(3).add_(torch.zeros(4))
    assert report.failure is None and report.errors[0].startswith("RuntimeError: ")


def test_diagnose_leaves_stale_padding_unchecked_when_a_padded_row_run_fails(monkeypatch):
    monkeypatch.setattr(PADDING_PROBE, "record_inputs", broken)    # only the padded-row runs record
    report = doctor.diagnose(lambda: make_runner(row_wise), make_batch)
    assert report.of("stale-padding") == []
    assert report.not_checked["stale-padding"].startswith("the doctor stopped early in a padded-row run (KeyError")
    assert report.failure.startswith("KeyError in replay_begin")


# -------------------------------------------------------------------------------------- report
def several_findings() -> doctor.Report:
    """One watch with four kinds: an undersized buffer, an accumulating write, a stale read, a sync."""
    with doctor.watch() as report:
        pixels = torch.zeros(0, 4)
        events.static_buffers("Encoder", {"pixels": pixels})
        serve_one(pixels)
        runner = make_runner(accumulating)
        runner.capture()
        first = runner(x=batch(3, 0))
        runner(x=batch(3, 1))
        first.sum()
        with pytest.raises(CaptureError):
            make_runner(sync_item).capture()
    return report


def test_report_text_and_html_show_every_finding():
    report = several_findings()
    assert report.kinds == {"undersized-buffer", "persistent-mutation", "overwritten-output", "sync-in-capture"}
    assert [f.kind for f in report.findings] == [k for k in doctor.KINDS if k in report.kinds]   # in KINDS order
    text, page = str(report), report._repr_html_()
    assert text.startswith(f"Graph doctor: {report.captures} capture(s)")
    assert "4 findings" in text
    for f in report.findings:
        for value in (f.kind, f.op, f.fix):
            assert value in text
            assert re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(value)) in page   # code set as code
        assert f"<code>{html.escape(f.source)}</code>" in page
    assert "`" not in page
    for kind, why in report.not_checked.items():
        assert f"not checked: {kind} ({why})" in text


def test_the_html_report_fits_a_900_px_output_area():
    """Fixed layout at 100% of at most 900 px, four columns whose widths add up, long words wrap."""
    page = several_findings()._repr_html_()
    assert "table-layout:fixed;width:100%;max-width:900px" in page
    widths = [int(w) for w in re.findall(r"width:(\d+)%'>", page)]
    assert len(widths) == 4 and sum(widths) == 100
    assert page.count("overflow-wrap:anywhere") >= 4 * (len(several_findings().findings) + 1)


def test_empty_watch_says_nothing_was_captured_and_checks_nothing():
    with doctor.watch() as report:
        pass
    assert str(report).startswith("Graph doctor: nothing was captured inside watch()")
    assert "nothing was captured" in report._repr_html_()
    assert set(report.not_checked) == set(doctor.KINDS) and len(doctor.KINDS) == 10
    assert report.checked == [] and report.findings == []


def test_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="unknown finding kind"):
        doctor.Report().of("bad-kind")
    with pytest.raises(ValueError, match="unknown finding kind"):
        doctor.Finding(kind="nope", graph="g", op="op", tensor="-", source="-", evidence="-", cause="-")


def test_replays_of_graphs_captured_before_watch_are_noted_not_checked():
    x = torch.ones(2)
    g = new_graph("cpu")
    with graph(g):
        out = x * 2
    with doctor.watch() as report:
        g.replay()
        g.replay()
    assert torch.equal(out, torch.full((2,), 2.0))
    assert report.replays == 2 and report.captures == 0
    assert report.notes == ["2 replays of graphs captured before watch() were not checked"]


# ---------------------------------------------------------------------- WORKBENCH_DOCTOR switch
SCRIPT = textwrap.dedent("""
    import torch
    from workbench.engine import GraphRunner

    def model(x):
        x += 1
        return x * 2

    runner = GraphRunner(model, {"x": ((2,), torch.float32)}, [2])
    runner.capture()
    runner(x=torch.ones(1, 2))      # row 1 is a padded row: nothing rewrites it
""")


def run_script(tmp_path, switch: str) -> subprocess.CompletedProcess:
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "WORKBENCH_DOCTOR": switch, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done


def test_environment_switch_writes_the_report_to_a_file(tmp_path):
    target = tmp_path / "doctor.txt"
    run_script(tmp_path, str(target))
    text = target.read_text()
    assert text.startswith("Graph doctor: 1 capture(s), 1 warmup run(s), 1 replay(s) watched: 1 finding.")
    assert "persistent-mutation" in text and "x += 1" in text


def test_environment_switch_1_prints_the_report_to_stderr(tmp_path):
    done = run_script(tmp_path, "1")
    assert "Graph doctor: 1 capture(s)" in done.stderr
    assert "persistent-mutation" in done.stderr
    assert "Graph doctor" not in done.stdout


# --------------------------------------------------------------------------------- compare_runs
def trace(outputs, graph="size 4", inputs=None, state=None) -> dict:
    """A replay record as ``diagnose``'s probe runs write them."""
    return {"graph": graph, "real": 2, "size": 4, "inputs": inputs or {"x": "same"},
            "readers": {"x": ("aten.mean.dim", "model.py:3 in f: x.mean(0)")},
            "outputs": torch.tensor(outputs, dtype=torch.float64), "state": state or {}}


def test_compare_runs_equal_runs_give_nothing():
    a = [trace([1.0, 2.0]), trace([3.0, float("nan")])]
    b = [trace([1.0, 2.0]), trace([3.0, float("nan")])]
    assert doctor.compare_runs(a, b, [], []) is None
    assert doctor.compare_runs([], [], ["IndexError: x"], ["IndexError: x"]) is None


def test_compare_runs_differing_outputs():
    a = [trace([1.0, 2.0]), trace([3.0, 4.0], state={"float32[8] (state)": "s0"})]
    b = [trace([1.0, 2.0]), trace([3.0, 4.5], state={"float32[8] (state)": "s1"})]
    finding = doctor.compare_runs(a, b, [], [])
    assert finding.kind == "stale-padding"
    assert finding.numbers == {"replay": 2, "max_abs_diff": 0.5}
    assert finding.op == "aten.mean.dim" and finding.source == "model.py:3 in f: x.mean(0)"
    assert finding.tensor == "x"                        # no input differs: the first graph input read
    assert "replay 2 (size 4, 2 real rows of 4)" in finding.evidence
    assert "state float32[8] (state) differs since replay 2" in finding.evidence


def test_compare_runs_names_the_first_input_whose_real_rows_differ():
    a = [trace([1.0], inputs={"x": "p0"})]
    b = [trace([2.0], inputs={"x": "p1"})]
    finding = doctor.compare_runs(a, b, [], [])
    assert finding.tensor == "x"
    assert "first graph input whose real rows differ: x" in finding.evidence
    assert "`x`" in finding.cause


def test_compare_runs_different_graphs_lengths_or_errors():
    graphs = doctor.compare_runs([trace([1.0], graph="size 2")], [trace([1.0], graph="size 4")], [], [])
    assert graphs.numbers == {"replay": 1} and "ran size 2 under one pattern and size 4" in graphs.evidence
    lengths = doctor.compare_runs([trace([1.0]), trace([2.0])], [trace([1.0])], [], ["IndexError: out of range"])
    assert lengths.kind == "stale-padding" and lengths.numbers == {"replays": [2, 1]}
    assert "pattern 1: IndexError: out of range, 1 replays" in lengths.evidence
    errors = doctor.compare_runs([trace([1.0])], [trace([1.0])], [], ["IndexError: out of range"])
    assert errors.numbers == {"replays": [1, 1]}
    assert "pattern 0: no error, 1 replays" in errors.evidence


# ----------------------------------------------------------------------------------- evaluation
# Notebook 06 makes these same calls on the CPU (evaluate, evaluate PIECEWISE, clean_models). When the
# session runs that notebook anyway (`make test`), its results are used instead of a second run of
# each (conftest's NOTEBOOK_KEEPS), and this module runs on the notebook's worker.
@pytest.fixture(scope="module")
def notebook06(notebook_keeps):
    return notebook_keeps("06_graph_doctor")


@pytest.fixture(scope="module")
def evaluation(notebook06):
    return notebook06["rows"] if notebook06 else graph_doctor.evaluate("cpu")


@pytest.fixture(scope="module")
def piecewise(notebook06):
    return notebook06["piecewise"] if notebook06 else graph_doctor.evaluate("cpu", graph_doctor.PIECEWISE)


@pytest.fixture(scope="module")
def clean(notebook06):
    return notebook06["clean"] if notebook06 else graph_doctor.clean_models("cpu")


@pytest.mark.slow
@pytest.mark.multiproc
def test_evaluation_is_correct_on_every_case(evaluation):
    assert [(r.case, r.variant) for r in evaluation] == [(c, v) for c in graph_doctor.CASES
                                                         for v in cases.VARIANTS]
    assert all(r.correct for r in evaluation), "\n".join(r.summary() for r in evaluation)
    for r in evaluation:
        if r.variant == "bug":
            assert r.kinds == [graph_doctor.expected(r.case).kind]
            assert r.hit is not None
        else:
            assert r.report.findings == []


def test_clean_models_give_empty_reports_with_the_key_kinds_checked(clean):
    assert sorted(clean) == ["bert", "gpt2", "roberta"]
    for name, report in clean.items():
        assert report.findings == [], f"{name}:\n{report}"
        assert report.errors == [], name
        assert {"stale-padding", "persistent-mutation"} <= set(report.checked), name


@pytest.mark.slow
@pytest.mark.multiproc
def test_matrix_marks_each_finding_and_each_expected_cell(evaluation):
    fig = graph_doctor.plot_matrix(evaluation)
    ax = fig.axes[0]
    found = sum(len(r.report.kinds) for r in evaluation)
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("found") == found == 5
    assert texts.count("correct") == len(evaluation) and "WRONG" not in texts
    outlined = [p for p in ax.patches if not p.get_fill()]
    assert len(outlined) == 5                   # one expected kind per bug row
    plt.close(fig)


def test_overhead_measures_wall_and_host_time_and_plots_both():
    cost = graph_doctor.overhead("cpu", steps=5, repeats=2, chunk=2)
    for key in ("plain_ms_per_step", "watched_ms_per_step", "plain_host_ms_per_step", "watched_host_ms_per_step"):
        assert 0 < cost[key] < 1e3, key
        per_repeat = cost[key.replace("per_step", "per_repeat")]
        assert len(per_repeat) == 2 and cost[key] == pytest.approx(float(np.median(per_repeat))), key
    assert cost["overhead"] == pytest.approx(cost["watched_ms_per_step"] / cost["plain_ms_per_step"] - 1)
    assert cost["host_added_us"] == pytest.approx(
        1e3 * (cost["watched_host_ms_per_step"] - cost["plain_host_ms_per_step"]))
    # every repeat kept, its own ratio and difference, and their range as the spread
    assert cost["overhead_per_repeat"] == pytest.approx(
        [w / p - 1 for p, w in zip(cost["plain_ms_per_repeat"], cost["watched_ms_per_repeat"])])
    assert cost["host_added_us_per_repeat"] == pytest.approx(
        [1e3 * (w - p) for p, w in zip(cost["plain_host_ms_per_repeat"], cost["watched_host_ms_per_repeat"])])
    assert cost["overhead_range"] == [min(cost["overhead_per_repeat"]), max(cost["overhead_per_repeat"])]
    assert cost["host_added_us_range"] == [min(cost["host_added_us_per_repeat"]), max(cost["host_added_us_per_repeat"])]
    # the watched turns ran inside the doctor: it saw each of their steps (and the first replay)
    assert cost["watched_replays"] >= 2 * 2 * 5 + 1
    assert cost["size"] == "tiny" and cost["syncs_per_step"] == {"plain": None, "watched": None}   # CUDA only
    json.dumps(cost)                                # what cost_record writes
    table = graph_doctor.cost_table([cost]).splitlines()
    assert len(table) == 3 and table[2].startswith("| gpt2 | cpu | ")
    assert f"{cost['host_added_us']:+.0f} |" in table[2]
    assert f"| {graph_doctor.spread_text(cost, 'wall')} |" in table[2]
    assert f"| {graph_doctor.spread_text(cost, 'host')} |" in table[2]
    fig = graph_doctor.plot_overhead(cost)
    heights = [[p.get_height() for p in ax.patches] for ax in fig.axes]
    assert heights == [[cost["plain_ms_per_step"], cost["watched_ms_per_step"]],
                       [cost["plain_host_ms_per_step"], cost["watched_host_ms_per_step"]]]
    dots = [[list(c.get_offsets()[:, 1]) for c in ax.collections] for ax in fig.axes]
    assert dots == [[cost["plain_ms_per_repeat"], cost["watched_ms_per_repeat"]],
                    [cost["plain_host_ms_per_repeat"], cost["watched_host_ms_per_repeat"]]]
    assert [graph_doctor.spread_text(cost, m) in ax.get_title() for ax, m in zip(fig.axes, ("wall", "host"))] == [True] * 2
    plt.close(fig)


def test_cost_spread_says_within_noise_exactly_when_the_repeats_straddle_zero():
    base = {"model": "gpt2", "device": "cpu", "repeats": 5, "plain_ms_per_step": 1.0, "watched_ms_per_step": 1.05,
            "plain_host_ms_per_step": 1.0, "watched_host_ms_per_step": 1.05, "overhead": 0.05, "host_added_us": 50.0}
    straddles = {**base, "overhead_range": [-0.06, 0.12], "host_added_us_range": [-20.0, 90.0]}
    above = {**base, "overhead_range": [0.02, 0.08], "host_added_us_range": [20.0, 90.0]}
    below = {**base, "overhead_range": [-0.08, -0.02], "host_added_us_range": [-90.0, -20.0]}
    assert graph_doctor.spread_text(straddles, "wall") == "-6.0% to +12.0%, within noise"
    assert graph_doctor.spread_text(straddles, "host") == "-20 µs to +90 µs, within noise"
    assert graph_doctor.spread_text(above, "wall") == "+2.0% to +8.0%"
    assert "within noise" not in graph_doctor.spread_text(below, "host")
    assert graph_doctor.spread_text({**above, "repeats": 1}) == "one repeat: no spread"
    assert graph_doctor.spread_text(base) == "spread not recorded"        # a record made before the spread was kept
    assert "| spread not recorded |" in graph_doctor.cost_table([base])
    with pytest.raises(ValueError, match="measure must be one of"):
        graph_doctor.spread_text(above, "gpu")
    with pytest.raises(ValueError, match="chunk must be a whole number >= 1, got 0"):
        graph_doctor.overhead("cpu", chunk=0)


@pytest.mark.slow
@pytest.mark.multiproc
def test_doctor_figures_ask_for_no_text_under_8_points(evaluation):
    """As the figure functions ask for them, before the draw hook would raise anything smaller."""
    cost = {"model": "gpt2", "device": "cpu", "repeats": 2, "plain_ms_per_step": 1.0, "watched_ms_per_step": 1.1,
            "plain_host_ms_per_step": 1.0, "watched_host_ms_per_step": 1.1, "overhead": 0.1, "host_added_us": 100.0,
            "plain_ms_per_repeat": [1.0, 1.0], "watched_ms_per_repeat": [1.1, 1.1], "plain_host_ms_per_repeat": [1.0, 1.0],
            "watched_host_ms_per_repeat": [1.1, 1.1], "overhead_range": [0.1, 0.1], "host_added_us_range": [100.0, 100.0]}
    for fig in (graph_doctor.plot_matrix(evaluation), graph_doctor.plot_overhead(cost)):
        assert not plots.small_texts(fig), plots.small_texts(fig)[:4]
        plt.close(fig)


def test_case01_under_piecewise_graphs_is_found_outside_the_graphs(piecewise):
    rows = piecewise
    assert all(r.correct for r in rows), "\n".join(r.summary() for r in rows)
    assert rows[0].hit.graph.startswith("outside the graphs")


@pytest.mark.cuda
def test_evaluation_on_cuda():
    one_gpu = tuple(c.id for c in cases.CASES if c.gpus == 1)
    rows = graph_doctor.evaluate("cuda", (*one_gpu, *graph_doctor.PIECEWISE))
    assert len(rows) == 10
    assert all(r.correct for r in rows), "\n".join(r.summary() for r in rows)


# ---------------------------------------------------------------------------------- the GPU record
def test_gpu_record_matches_the_cpu_evaluation(evaluation):
    """``results/gpu/graph_doctor.json`` (real CUDA graphs) gives the same finding, op and source line
    as the CPU emulation for every case and variant, and clean transformers models stay clean."""
    record = json.loads((pathlib.Path(__file__).parent.parent / "results/gpu/graph_doctor.json").read_text())
    assert "error" not in record and record["device"].startswith("NVIDIA")
    gpu = {(r["case"], r["variant"]): r for r in record["results"]["evaluation"]}
    recorded = {c.id for c in cases.CASES if c.gpus <= record["device_count"]}   # what that machine could run
    assert {case for case, _ in gpu} == recorded and all(r["correct"] for r in gpu.values())
    for row in graph_doctor.record(evaluation):
        if row["case"] not in recorded:
            continue
        other = gpu[(row["case"], row["variant"])]
        assert (other["kinds"], other["op"], other["location"]) == (row["kinds"], row["op"], row["location"])
    assert all(not m["kinds"] and not m["not_checked"] for m in record["results"]["clean_models"].values())
    assert record["results"]["other_kinds"] == graph_doctor.other_kinds("cpu")


def _gpu_cost_rows(device: str) -> list[dict]:
    record = next(r for r in graph_doctor.gpu_costs() if device in r["device"])
    assert "error" not in record
    return record["results"]["overhead"]


def test_gpu_cost_record_at_base_size_stays_under_two_percent_and_never_syncs():
    """``results/gpu/graph_doctor_cost.json`` (an H100): GPT-2 at its base size, whose GPU step
    is longer than the host work, loses under 2 % of wall time; no watched step synchronises the
    host with the GPU (CUDA's sync debug mode), on any model."""
    rows = _gpu_cost_rows("H100")
    assert [r["model"] for r in rows] == [*graph_doctor.COST_MODELS, "gpt2 (base)"]
    base = rows[-1]
    assert base["size"] == "base" and base["device"] == "cuda"
    assert base["plain_host_ms_per_step"] + base["host_added_us"] / 1e3 < base["plain_ms_per_step"], base
    assert 0 <= base["overhead"] < 0.02, base
    for r in rows:
        assert r["syncs_per_step"] == {"plain": 0, "watched": 0}, r


def test_gpu_cost_records_hide_the_host_cost_behind_the_tiny_models_steps_on_one_host_and_not_another():
    """The tiny models on an H100: on the host of the current record (2026-12-06) wall time moves by
    under 2 % (the target); on the host of 2026-11-25 (``graph_doctor_cost_h100_2026-11-25.json``)
    tiny GPT-2's 0.13 ms step turned host-bound and lost far more. The doctor's host work is alike on
    both; which host the device hangs off decides whether it shows."""
    for r in _gpu_cost_rows("H100")[:len(graph_doctor.COST_MODELS)]:
        assert r["device"] == "cuda" and r["host_added_us"] > 0, r
        assert abs(r["overhead"]) < 0.02, r
    earlier = next(r for r in graph_doctor.gpu_costs() if r["file"] == "graph_doctor_cost_h100_2026-11-25.json")
    gpt2 = earlier["results"]["overhead"][0]
    assert gpt2["model"] == "gpt2" and gpt2["overhead"] > 0.02 and gpt2["host_added_us"] > 0, gpt2


def test_gpu_piecewise_record_matches_the_cpu_evaluation(piecewise):
    record = json.loads((graph_doctor.RESULTS / "graph_doctor_piecewise.json").read_text())
    assert "error" not in record and record["device"].startswith("NVIDIA")
    cpu = graph_doctor.record(piecewise)
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in cpu]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in record["results"]["evaluation"]] == strip


class CaptureHelper:
    """A capture helper kept for the whole program (a singleton): it remembers the last graph it
    opened, and, with ``keep_runner``, the runner it captured for too."""
    last = None
    runner = None


class WeightRunner:
    """Static ``x``, a weight of its own; one graph captured through ``CaptureHelper``."""

    def __init__(self, keep_runner: bool):
        self.x, self.w = torch.zeros(2, 3), torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
        events.static_buffers("runner", {"x": self.x})
        self.g = new_graph("cpu")
        with graph(self.g, name="step"):
            self.out = self.x @ self.w
        CaptureHelper.last = self.g
        if keep_runner:
            CaptureHelper.runner = self

    def __call__(self, x):
        self.x.copy_(x)
        self.g.replay()
        return self.out.clone()


@pytest.mark.parametrize("keep_runner", [False, True])
def test_a_graph_left_only_to_a_capture_helper_reads_nothing_that_matters_at_the_end(keep_runner):
    """The workload drops its runner, and with it the weight, after the last replay. Where the
    helper keeps only the graph, nothing can serve it again (its static input went with the
    runner): no finding. Where the helper keeps the runner, the graph can be replayed with the
    weight gone: ``dangling-reference`` at the end of the watch."""
    def workload():
        runner = WeightRunner(keep_runner)
        runner(torch.ones(2, 3))
        runner.w = None                             # the weight goes; a kept runner could replay again

    try:
        report = doctor.diagnose(workload)
    finally:
        CaptureHelper.last = CaptureHelper.runner = None
    if not keep_runner:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "dangling-reference" and "at the end of watch()" in finding.evidence, finding
