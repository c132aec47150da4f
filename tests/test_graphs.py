"""The graph manager: capture loop, dispatch, modes, re-capture and announcements."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.engine import CUDAGraphMode, GraphManager, IllegalMemoryAccess, events, is_capturing
from workbench.engine.cpu_graph import CPUGraph


class Step:
    """A step over a static buffer: y = (x * w) + offset, with ``offset`` in an eager region."""

    def __init__(self, max_size: int = 8) -> None:
        self.x = torch.zeros(max_size, 3)
        self.w = torch.full((3,), 2.0)
        self.offset = 1.0
        self.calls: list[int] = []
        self.manager: GraphManager | None = None

    def add_offset(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.offset                  # Python state read at every call

    def forward(self, size: int) -> torch.Tensor:
        self.calls.append(size)
        h = self.x[:size] * self.w
        h = self.manager.eager(self.add_offset)(h)
        return h.sin()

    def expected(self, n: int) -> torch.Tensor:
        return ((self.x[:n] * self.w) + self.offset).sin()


def make(mode="FULL", sizes=(1, 2, 4), **kw) -> tuple[Step, GraphManager]:
    step = Step()
    step.manager = GraphManager(step.forward, sizes, mode=mode, **kw)
    return step, step.manager


def test_warmups_then_capture_per_size_largest_first_into_one_pool():
    step, m = make(num_warmups=2)
    m.capture()
    assert step.calls == [4, 4, 4, 2, 2, 2, 1, 1, 1]
    assert {id(g.pool()) for pieces in m.graphs.values() for g in pieces} == {id(m.pool)}
    step.x[:3] = torch.randn(3, 3)
    out = m.replay(m.dispatch(3), 3)
    assert out.shape == (3, 3) and torch.equal(out, step.expected(3))


def test_full_mode_freezes_the_eager_region_piecewise_runs_it_every_replay():
    for mode, follows_offset in (("FULL", False), ("PIECEWISE", True)):
        step, m = make(mode)
        m.capture()
        step.x[:2] = torch.randn(2, 3)
        step.offset = 5.0
        out = m.replay(2, 2)
        frozen = ((step.x[:2] * step.w) + 1.0).sin()
        assert torch.equal(out, step.expected(2) if follows_offset else frozen), mode
        assert torch.equal(m.run_eager(2)[:2], step.expected(2))


def test_piecewise_splits_the_capture_at_each_eager_region():
    step, m = make("PIECEWISE")
    m.capture()
    assert all(len(pieces) == 2 for pieces in m.graphs.values())


def test_an_eager_region_at_the_start_leaves_no_empty_piece():
    x = torch.arange(4.0)
    m = GraphManager(lambda size: m.eager(lambda t: t + 1)(x[:size]) * 3, [4], mode="PIECEWISE")
    m.capture()
    assert len(m.graphs[4]) == 1
    x.fill_(10.0)
    assert torch.equal(m.replay(4, 4), torch.full((4,), 33.0))


def test_mode_none_captures_nothing_and_dispatches_eager():
    step, m = make("NONE")
    m.capture()
    assert m.graphs == {} and m.dispatch(1) is None and step.calls == []


def test_dispatch_picks_the_smallest_size_that_fits_and_eager_above():
    _, m = make(sizes=[8, 2, 4])
    assert [m.dispatch(n) for n in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, None]
    with pytest.raises(ValueError, match="positive whole number"):
        m.dispatch(0)


def test_recapture_after_the_weight_is_replaced():
    step, m = make()
    m.capture()
    step.w = torch.full((3,), 3.0)               # the captured weight's storage is released
    with pytest.raises(IllegalMemoryAccess):
        m.replay(4, 4)
    m.recapture()
    step.x[:4] = torch.randn(4, 3)
    assert torch.equal(m.replay(4, 4), ((step.x[:4] * 3.0) + 1.0).sin())


def test_a_failed_capture_keeps_earlier_sizes_and_leaves_no_capture_open():
    x = torch.ones(4)

    def forward(size):
        if size == 2 and is_capturing():
            raise RuntimeError("boom at size 2")
        return x[:size] * 2

    m = GraphManager(forward, [1, 2, 4])
    with pytest.raises(RuntimeError, match="boom"):
        m.capture()
    assert sorted(m.graphs) == [4] and not is_capturing()
    assert torch.equal(m.replay(4, 3), torch.full((3,), 2.0))


def test_capture_runs_under_no_grad_unless_asked():
    w = torch.ones(3, requires_grad=True)
    x = torch.zeros(2, 3)
    for grad in (False, True):
        m = GraphManager(lambda size: x[:size] * w, [2], grad=grad)
        m.capture()
        assert m.outputs[2].requires_grad is grad


def test_serve_announces_an_eager_step_equal_to_the_replay():
    step, m = make()
    m.capture()
    seen = []

    class Listener:
        def engine_op(self, func, args):                # runs the engine's own ops
            return func(*args)

        def __getattr__(self, name):
            return lambda *a, **k: seen.append((name, a, k))

    listener = Listener()
    events.subscribe(listener)
    try:
        step.x[:4] = torch.randn(4, 3)
        out = m.replay(4, 3, padded={"x": step.x}).clone()
    finally:
        events.unsubscribe(listener)
    names = [name for name, _, _ in seen]
    assert names == ["serve", "replay_begin", "replay_end", "handed_out"]
    _, (graph, real, size, padded, outputs), kw = seen[0]
    assert (real, size, list(padded)) == (3, 4, ["x"]) and isinstance(graph, CPUGraph)
    assert torch.equal(kw["eager"]()[:3], out)


def test_a_piecewise_step_is_announced_whole_before_its_eager_regions_run():
    """Its eager regions change state between pieces, so no single piece can be re-run: the step is
    announced once, on its first graph, with all its pieces and its eager step, before any of it
    runs; the other pieces are announced without one."""
    step, m = make("PIECEWISE")
    m.capture()
    seen = []

    class Listener:
        def serve(self, graph, *args, **kw):
            seen.append((graph, kw["eager"], kw["pieces"]))

        def replay_begin(self, graph):
            seen.append(("replay", graph))

    listener = Listener()
    events.subscribe(listener)
    try:
        out = m.replay(4, 4).clone()
    finally:
        events.unsubscribe(listener)
    first, second = m.graphs[4]
    assert [s[0] for s in seen] == [first, "replay", second, "replay"]
    assert seen[0][2] == (first, second) and seen[2][1:] == (None, ())
    assert torch.equal(seen[0][1](), out)


def test_static_buffers_per_size_are_prepared_before_their_warmups():
    made = []

    def buffers(size):
        made.append(size)
        return {"x": torch.zeros(size)}

    m = GraphManager(lambda size: m.buffers[size]["x"] + 1, [1, 3], static_buffers=buffers, descending=False)
    m.capture()
    assert made == [1, 3] and set(m.buffers) == {1, 3}


@pytest.mark.parametrize("sizes, message", [
    (4, "sequence of integers, got 4"), (None, "got None"), ("12", "got '12'"),
    ([1, 2.5], "must be integers"), ([0, 1], "positive"), ([2, 2], "unique"), ([], "empty")])
def test_bad_capture_sizes_say_what_to_pass(sizes, message):
    with pytest.raises(ValueError, match=message):
        GraphManager(lambda size: None, sizes)


def test_numpy_capture_sizes_are_accepted():
    assert GraphManager(lambda size: None, np.array([4, 1, 2])).capture_sizes == [1, 2, 4]


@pytest.mark.parametrize("bad", [-3, 1.5, True])
def test_num_warmups_must_be_a_whole_number_at_least_zero(bad):
    with pytest.raises(ValueError, match="num_warmups"):
        GraphManager(lambda size: None, [1], num_warmups=bad)


def test_modes_are_spelled_as_vllm():
    assert [m.value for m in CUDAGraphMode] == ["NONE", "PIECEWISE", "FULL"]
    assert CUDAGraphMode.of("piecewise") is CUDAGraphMode.PIECEWISE
    with pytest.raises(ValueError, match="mode must be one of"):
        CUDAGraphMode.of("partial")


def test_replay_refuses_a_size_never_captured_and_too_many_rows():
    _, m = make()
    with pytest.raises(Exception, match="no graphs captured yet"):
        m.replay(4, 4)
    m.capture()
    with pytest.raises(Exception, match="captured sizes are"):
        m.replay(3, 3)
    with pytest.raises(Exception, match="serves 1..4 real rows, got 5"):
        m.replay(4, 5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_the_same_manager_on_real_cuda_graphs(mode):
    """FULL and PIECEWISE (an eager region first: CUDA refuses to replay the empty piece before it),
    replay equal to eager, and re-capture after the weight is replaced."""
    x = torch.zeros(8, 3, device="cuda")
    w = [torch.full((3,), 2.0, device="cuda")]
    offset = [1.0]
    m = GraphManager(lambda size: (m.eager(lambda t: t + offset[0])(x[:size]) * w[0]).sin(), [2, 4, 8],
                     device="cuda", mode=mode)
    m.capture()
    if mode == "PIECEWISE":
        assert all(len(pieces) == 1 for pieces in m.graphs.values())
    x[:3] = torch.randn(3, 3, device="cuda")
    offset[0] = 5.0
    out = m.replay(m.dispatch(3), 3)
    used = 5.0 if mode == "PIECEWISE" else 1.0
    torch.testing.assert_close(out, ((x[:3] + used) * 2.0).sin(), rtol=0, atol=1e-6)
    w[0] = torch.full((3,), 3.0, device="cuda")
    m.recapture()
    torch.testing.assert_close(m.replay(4, 4), ((x[:4] + offset[0]) * 3.0).sin(), rtol=0, atol=1e-6)
