"""Where the doctor names a branch that a capture decided: the frame whose ``if`` went another way
(not the function the extra work runs in), and a path the run without graphs took that the served
run never did (not the lazy set-up its warmup already ran); the line that asked for a copy CUDA
refused in a capture where no op the doctor watches showed it; and the frame that built a step's
state whose decision a runner's own check finds unlike its graph's. Workloads are written here, on
the engine's public API; each bug has a fix that must give no finding."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
import types

import pytest
import torch

from workbench import doctor
from workbench.doctor.probes.eager_trace import branched
from workbench.engine import events, graph, host, new_graph

from test_doctor_setup_and_warmups import only_finding


class _Shared:
    """A receive region shared by two modes: the normal mode stages its data there and leaves it;
    the low-latency mode accumulates into it, so switching to it cleans the region first. The mode
    is the class's, as a communication library keeps its one buffer's dispatch mode."""

    region = torch.zeros(4)
    mode = None

    @classmethod
    def clean(cls) -> None:
        cls.region.zero_()

    @classmethod
    def set_low_latency(cls) -> None:
        if cls.mode == "normal":
            cls.clean()
        cls.mode = "low_latency"

    @classmethod
    def set_normal(cls) -> None:
        cls.mode = "normal"


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_setter_that_cleans_only_on_a_mode_switch_is_the_site(variant):
    """The decode graph was captured in low-latency mode, so its capture never cleaned the region;
    an eager prefill in between switches to normal mode and leaves the region dirty. An eager decode
    now cleans it (in ``clean``, called by ``set_low_latency``); the replay does not. The decision is
    ``set_low_latency``'s branch. The fix sets the captured mode again before each replay (eagerly)."""
    def workload():
        shared, x = _Shared, torch.zeros(4)
        shared.region, shared.mode = torch.zeros(4), None
        events.static_buffers("runner", {"x": x})
        events.persistent_state("runner", {"region": shared.region})

        def decode():
            shared.set_low_latency()
            shared.region.add_(x)
            out = shared.region * 2
            shared.region.zero_()            # a low-latency round cleans what it used
            return out

        with events.warmup():
            decode()
        g = new_graph("cpu")
        with graph(g, name="decode"):
            out = decode()
        for step in range(3):
            shared.set_normal()              # an eager prefill stages its tokens in the region
            shared.region.copy_(torch.full((4,), 5.0 + step))
            x.copy_(torch.arange(4.0) + step)
            if variant == "fix":
                shared.set_low_latency()     # the captured mode, set again before the replay
            events.serve(g, 4, 4, outputs=out, eager=decode)
            g.replay()
    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence" and finding.op == "aten.zero_.default"
    assert " in set_low_latency: " in finding.source and finding.source.endswith("cls.clean()")
    assert "left the capture's path at" in finding.cause


def test_the_branch_is_the_first_frame_at_a_line_the_capture_never_ran():
    """Outermost first: a frame at a line the capture ran goes on down; the first one at a line it
    never ran took another branch -- unless the capture never ran its function at all, when the
    caller chose another function."""
    def outer(lines):
        return middle(lines)

    def middle(lines):
        return inner(lines)

    def inner(lines):
        return branched(types.SimpleNamespace(lines_run=lines), top)

    top = sys._getframe()
    at = {f: f.__code__.co_firstlineno for f in (outer, middle, inner)}
    ran = {(outer.__code__, at[outer] + 1), (middle.__code__, at[middle])}
    assert " in middle: return inner(lines)" in outer(ran)               # middle's call line never ran
    assert " in outer: return middle(lines)" in outer({(outer.__code__, at[outer] + 1)})   # nor middle at all
    assert outer(ran | {(middle.__code__, at[middle] + 1), (inner.__code__, at[inner] + 1)}) is None


class _Averager:
    """Averaging whose first steps copy and later steps average, decided on the host by a flag the
    previous step left in host memory (as an optimizer's scalar state kept on the CPU), which a
    replay never updates; the state is made at the first step."""

    def __init__(self, on_device: bool) -> None:
        self.state: dict = {}
        self.on_device = on_device

    def step(self, p: torch.Tensor) -> None:
        if not self.state:                               # lazy: the first step makes the state
            self.state["ax"] = torch.zeros_like(p)
            for name in ("n", "average"):
                self.state[name] = torch.zeros(()) if self.on_device else host(torch.zeros(()))
        n, average, ax = self.state["n"], self.state["average"], self.state["ax"]
        n += 1
        if self.on_device:                               # the fix: decided on the device, every step
            ax.add_(p.sub(ax).mul(torch.where(average > 0, 0.5, 1.0)))
            average.copy_((n > 2).float())
            return
        if average.item():
            ax.add_(p.sub(ax).mul(0.5))
        else:
            ax.copy_(p)
        average.fill_(float(n.item() > 2))


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_path_only_the_reference_took_is_not_the_set_up_a_warmup_ran(variant):
    """The run without graphs makes the averager's state at its first step and averages from its
    fourth; the served run makes the state in its warmup and replays the copy its capture recorded.
    An eager step from the replay's state copies too (the flag it reads was never updated), so only
    the run without graphs shows where the two runs part: the averaging branch, not the lazy set-up."""
    def run(graphed: bool):
        p = torch.zeros(3)
        opt = _Averager(on_device=variant == "fix")
        outs = []
        if graphed:                                      # (whole-network capture warms up with real steps)
            events.static_buffers("trainer", {"p": p})
            with events.warmup(real=True):
                opt.step(p)
            g = new_graph("cpu")
            with graph(g, name="step"):
                opt.step(p)
        else:                   # the warmup's step, eagerly (a capture launches nothing that lasts)
            opt.step(p)
        for k in range(5):
            p.copy_(torch.arange(3.0) * (k + 1))
            if graphed:
                events.serve(g, 3, 3, outputs=opt.state["ax"], eager=lambda: opt.step(p))
                g.replay()
            else:
                opt.step(p)
            outs.append(opt.state["ax"].clone())
        return outs

    def workload():
        with events.reference():
            reference = run(False)
        events.results(reference, run(True))

    finding = only_finding(workload, variant)
    if finding is None:
        return
    assert finding.kind == "warmup-divergence"
    assert " in step: " in finding.source and finding.source.endswith("ax.add_(p.sub(ax).mul(0.5))")


# ------------------------------------------------------------------------------ refused by CUDA
def test_a_capture_cuda_refused_for_a_pageable_copy_is_named_at_the_innermost_user_frame():
    """Torch's own refusal of a pageable copy in a CUDA capture (raised inside a factory, in a
    backward pass on autograd's device thread, where no op the doctor watches shows it first) is
    sync-in-capture at the user's frame that asked for it; another error is not. The same words from a
    CPU capture are the same finding: there they come from a library's binding that relays CUDA's
    refusal of a call the engine cannot see (a driver query), as they would on a GPU."""
    from workbench.doctor.intake import Doctor
    from workbench.doctor.rules import sync

    def backward():
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                           "tensor is pinned. Please use tensor.pin_memory() or allocate the tensor with "
                           "pin_memory=True.")

    found = []
    for raised in (backward, lambda: 1 / 0):
        d = Doctor()
        try:
            raised()
        except (RuntimeError, ZeroDivisionError) as e:
            sync.capture_failed(d, "fwd+bwd", e)
        found.append(d.report.findings)
    (finding,), other = found
    assert other == [] and finding.kind == "sync-in-capture" and finding.op == "a copy from pageable host memory"
    assert " in backward: raise RuntimeError(" in finding.source


class _DriverError(RuntimeError):
    """A library binding's own exception for a failed driver call (``cuda_error``, ``CudaAPIError``)."""


def _pool_attribute() -> int:
    """A memory-pool attribute read, which CUDA refuses in a global-mode capture (error 900)."""
    if torch.cuda.is_current_stream_capturing():
        raise _DriverError("operation not permitted when stream is capturing(900): Failed to get attribute "
                           "for a memory pool")
    return 0


@pytest.mark.parametrize("warm", [False, True])
def test_a_refusal_a_binding_relays_from_a_cpu_capture_is_sync_in_capture(warm):
    """The CPU engine cannot see a driver call; the binding relays CUDA's words, and the doctor
    reads them as it does on a GPU. The binding's check raised them for a call its caller made: the
    finding names the caller, whose lazy first use fell into the capture. Made once before the
    capture (``warm``), nothing is refused."""
    def workload():
        x, threshold = torch.ones(3), []

        def step():
            if not threshold:
                threshold.append(_pool_attribute())        # resolved lazily, on first use
            return x * 2

        if warm:
            step()
        try:
            with graph(new_graph("cpu"), name="step"):
                step()
        except _DriverError:
            pass                                           # the serving loop falls back to eager

    found = [(f.kind, f.source.rsplit(" in ", 1)[-1].split(":")[0]) for f in doctor.diagnose(workload).findings]
    assert found == ([] if warm else [("sync-in-capture", "step")])


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_refusal_caught_while_a_capture_stays_open_is_sync_in_capture(variant):
    """A function that begins a capture and returns early without ending it leaves the capture
    open: the steps after it run inside it, and their first host read is refused there (CUDA
    invalidates the capture). A harness catches that error and the capture ends much later, with an
    error of its own: the refused read is the finding. Abandoned on the same early return (the
    fix), the capture is gone before the read, and nothing is refused."""
    def workload():
        x, capture = torch.arange(4.0), contextlib.ExitStack()

        def begin_verify():
            capture.enter_context(graph(new_graph("cpu"), name="verify"))
            x.mul_(2)
            if variant == "fix":                          # abandon the capture before leaving
                abandoned = RuntimeError("unsupported shape")
                capture.__exit__(type(abandoned), abandoned, None)
            return -1                                     # an early return, past the capture's end

        begin_verify()
        try:
            (x + 1).tolist()                              # the next step's host read
        except Exception:
            pass                                          # a harness logs it and goes on
        ended = RuntimeError("process exit")
        capture.__exit__(type(ended), ended, None)

    report = doctor.diagnose(workload)
    found = [(f.kind, f.source.split(": ", 1)[-1]) for f in report.findings]
    assert found == ([] if variant == "fix" else [("sync-in-capture", "(x + 1).tolist()                              # the next step's host read")])
    if variant == "bug":           # the evidence says where the capture was left open
        assert "in begin_verify: return -1" in report.findings[0].evidence, report


@pytest.mark.cuda
def test_a_pageable_copy_in_a_captured_backward_is_sync_in_capture_on_cuda():
    """``torch.tensor(1.0, device=...)`` in a custom backward, captured with its forward: torch
    refuses the copy on autograd's device thread; the doctor names that line."""
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            one = torch.tensor(1.0, device=grad.device)
            return grad * one

    x = torch.ones(4, device="cuda", requires_grad=True)

    def step():
        Scale.apply(x).sum().backward()

    with doctor.watch() as report:
        with events.warmup():
            step()
        with pytest.raises(RuntimeError, match="pinned"), graph(new_graph("cuda"), name="fwd+bwd"):
            step()
    (finding,) = report.findings
    assert finding.kind == "sync-in-capture" and finding.source.endswith("one = torch.tensor(1.0, device=grad.device)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_blocking_copy_from_pinned_memory_in_a_capture_is_refused_and_named(device):
    """Torch synchronises the stream after a blocking host-to-device copy, which a capture refuses
    (engine probe ``host_copy``): the CPU engine raises, and on CUDA the doctor stops the copy
    before it runs, with the CPU's error, so the capture fails cleanly and the context lives."""
    from workbench.engine import CaptureError
    pinned, dev = host(torch.arange(4.0), device), torch.zeros(4, device=device)
    with doctor.watch() as report:
        with pytest.raises(CaptureError, match="non_blocking=True"), graph(new_graph(device), name="upload"):
            dev.copy_(pinned)
    (finding,) = report.findings
    assert finding.kind == "sync-in-capture" and finding.source.endswith("dev.copy_(pinned)")
    dev.copy_(pinned, non_blocking=True)
    assert dev.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_weight_copied_from_pinned_memory_inside_the_capture_is_the_graphs_own(device):
    """A layer whose weight lives in pinned host memory copies it to the device on every forward
    (weight offload) and drops the copy after use. Inside the capture the copy is a copy node into
    memory the capture allocated: the graph owns it, and its release after capture is no dangling
    reference. (On CUDA the doctor took an op whose inputs are all host memory for host work that
    a capture does not record, and the copy's output for memory made before watch().)"""
    weight, x = host(torch.arange(12.0).reshape(3, 4), device), torch.ones(2, 3, device=device)

    def forward():
        w = weight.to(device, non_blocking=True)        # onloaded for this call, released after it
        return x @ w

    def workload():
        with torch.no_grad():
            events.static_buffers("Offloaded", {"x": x})
            with events.warmup():
                forward()
            g = new_graph(device)
            with graph(g, name="step"):
                out = forward()
            for step in range(3):
                x.fill_(step)
                g.replay()
                assert out.tolist() == (x @ weight.to(device)).tolist()

    report = doctor.diagnose(workload)
    assert report.findings == [] and report.failure is None, report


def test_a_storage_handed_to_set_is_signed_by_its_size_not_its_contents():
    """``set_`` takes a storage: the launch signature keeps its size. Printing it would read every
    element, which on CUDA inside a capture is a synchronisation the capture refuses (the doctor's
    own error, seen on the H200 on a weak reference made in a capture)."""
    from workbench.doctor.tensors import signature
    storage = torch.arange(6.0).untyped_storage()
    t = torch.empty(0)
    sig = signature(torch.ops.aten.set_.source_Storage_storage_offset, (t, storage, 0, [6], [1]), {})
    assert sig[1] == ("storage", 24) and all("0.0" not in str(a) for a in sig), sig


class _Layout(enum.Enum):
    PLAIN = "plain"
    SHARDED = "sharded"


@dataclasses.dataclass
class _Plan:
    layout: _Layout = _Layout.PLAIN


@pytest.mark.parametrize("variant", ["bug", "fix", "harness check"])
def test_a_runner_check_that_a_steps_decision_matches_its_graph_names_where_the_step_got_it(variant):
    """Graphs of 2 and 4 rows are captured with a plain and a sharded output layout; the runner
    checks, before each replay, that the step's plan chose its graph's layout. A background step
    builds its plan without routing it (bug): the check fails on the way to the graph of 4, and
    the frame that made that plan is named. Routed (fix), it replays. A check of decisions outside
    any replay path (a harness comparing two strings) is no evidence."""
    x = torch.zeros(4)

    def workload():
        events.static_buffers("runner", {"x": x})
        graphs, outs, layouts = {}, {}, {}
        for size, layout in ((2, _Layout.PLAIN), (4, _Layout.SHARDED)):
            def forward(size=size, layout=layout):
                return x[:size] * (2.0 if layout is _Layout.SHARDED else 1.0)
            with events.warmup():
                forward()
            g = new_graph("cpu")
            with graph(g, name=f"rows {size}"):
                outs[size] = forward()
            graphs[size], layouts[size] = g, layout

        def serve(n, plan):
            size = 2 if n <= 2 else 4
            assert plan.layout == layouts[size], "the plan's layout is not its graph's"
            x[:n].copy_(torch.arange(n, dtype=torch.float32))
            events.serve(graphs[size], n, size, outputs=outs[size])
            graphs[size].replay()
            return outs[size][:n].clone()

        def routed(n):
            return _Plan(_Layout.SHARDED if n > 2 else _Layout.PLAIN)

        def foreground_step(n):
            return serve(n, routed(n))

        def background_step(n):
            plan = routed(n) if variant == "fix" else _Plan()
            return serve(n, plan)
        foreground_step(2)
        if variant == "harness check":
            def judge(verdict):
                assert verdict == "equals eager"
            try:
                judge("misbehaves")
            except AssertionError:
                pass
            return
        try:
            background_step(3)
        except AssertionError:
            if variant == "fix":
                raise
    report = doctor.diagnose(workload)
    if variant != "bug":
        assert report.findings == [], report
        return
    [finding] = report.findings
    assert finding.kind == "warmup-divergence" and finding.op == "check", report
    assert "in background_step" in finding.source and "plan.layout" in finding.tensor, report


# ------------------------------------------------------------------------------ a reuse check chose the graph
def _cache_key(x, scaled: bool, variant: str) -> tuple:
    """The graph cache's key: ``bug`` leaves out what chooses the branch."""
    return (tuple(x.shape),) if variant == "bug" else (tuple(x.shape), scaled)


def _branchy_step(x, scaled: bool):
    if scaled:
        return x * 2.0
    return x + 1.0


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_graph_a_cache_key_chose_for_a_step_on_another_path_is_named_at_the_key(variant):
    """A graph cache keyed on the input's shape alone: a step that needs the other branch replays
    the graph of the first, whose capture took one path. The lines the run without graphs ran and
    the served run never did say where the paths parted; the key function that chose to replay says
    why, and is where the fix goes."""
    from workbench.engine import source
    from workbench.zoo.kit import capture, compare, replay

    flags = (False, True, False, True)
    data = [torch.full((3,), float(i)) for i in range(4)]

    def served():
        graphs, x, outs = {}, torch.zeros(3), []
        for d, scaled in zip(data, flags):
            x.copy_(d)
            k = _cache_key(x, scaled, variant)
            if k not in graphs:
                graphs[k] = capture(lambda s=scaled: _branchy_step(x, s), device="cpu", static={"x": x})
            outs.append(replay(*graphs[k]).clone())
        return outs

    report = doctor.diagnose(lambda: compare("keyed", variant, "cpu", served,
                                             lambda: [_branchy_step(d, s) for d, s in zip(data, flags)]))
    if variant == "fix":
        assert not report.findings, report
        return
    found = report.of("warmup-divergence")
    assert found and source.function_of(found[0].location) == "_cache_key", report
    assert "never ran" in found[0].evidence and "chose to replay it" in found[0].evidence


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_loop_count_read_from_host_memory_at_capture_is_frozen_host_work_on_both_devices(device):
    """The captured step loops as many times as a host mirror says, read on the host (its ``max()``,
    then ``int``). That is host work, which a capture does not record, so the eager step's launch
    trace leaves it out too, and the two part where the loop does: a count frozen at capture
    (host-work-frozen), on CUDA as on the CPU. (Beside a CUDA graph the eager trace kept the host
    ``max``, parted there first, and called it a launch the graph lacks: warmup-divergence.)"""
    mirror, x = host(torch.ones(2, dtype=torch.int64), device), torch.ones(3, device=device)

    def forward():
        y = x.clone()
        for _ in range(int(mirror.max())):
            y = y * 2 + 1
        return y

    def workload():
        events.static_buffers("Loop", {"x": x})
        with events.warmup():
            forward()
        g = new_graph(device)
        with graph(g, name="loop"):
            out = forward()
        mirror.fill_(3)
        for step in range(2):
            x.fill_(step)
            events.serve(g, 3, 3, padded={}, outputs=out, eager=forward)
            g.replay()
            events.handed_out(g, out)
    finding = only_finding(workload, "bug")
    assert (finding.kind, finding.op) == ("host-work-frozen", "aten.mul.Tensor"), finding
    assert finding.source.endswith("in forward: y = y * 2 + 1"), finding.source


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_state_a_replay_copies_into_pinned_host_memory_is_kept_once_the_copy_landed(device):
    """A step whose graph writes its state back into pinned host memory by a non-blocking copy (Warp's
    CPU arrays): a sampled step equals its eager run. On CUDA the copy lands when the stream reaches
    it, after the launch returns, and the doctor waits for it before keeping the replay's state
    (``tensors.landed``)."""
    from workbench.zoo.kit import capture, replay
    q = host(torch.linspace(0.0, 1.0, 1 << 16, dtype=torch.float64), device)
    w = torch.eye(1024, dtype=torch.float64, device=device) * 0.5
    w @ w                                        # cuBLAS makes its handle at its first call, never in a capture

    def step():
        d = torch.empty(q.shape, dtype=q.dtype, device=device)
        d.copy_(q, non_blocking=True)
        for _ in range(8):                       # device work long enough for the write-back to land late
            d = (d.view(64, 1024) @ w).view(-1) * 2.0 + 0.001
        q.copy_(d, non_blocking=True)
        return d

    def workload():
        g, out = capture(step, device=device, warmups=0, name="step", state={"q": q})
        for _ in range(4):
            replay(g, out)
    with doctor.watch(differential=1) as report:
        workload()
    assert report.findings == [], report
