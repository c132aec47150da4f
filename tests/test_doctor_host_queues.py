"""Work a step's Python queues, under differential replay (``doctor/probes/reach.py``, ``pystate.py``,
``waits.py``).

A training layer that defers its weight gradient (TransformerEngine's ``WeightGradStore``) puts the
backward's tensors on a ``queue.Queue`` and a later call takes them off. Captured, each Python call
ran once, at capture; the doctor's eager run of a step's captured callable then starts from what
the replays left, and must neither hang on an empty queue nor take the program's work off it.
"""
from __future__ import annotations

import queue

import torch

from workbench import doctor
from workbench.childproc import run_in_child
from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, replay


class DeferredLinear:
    """``backward`` queues its input for ``backward_dw``, which takes it and accumulates the weight
    gradient into ``main_grad``."""

    def __init__(self) -> None:
        self.weight = torch.arange(6.).reshape(2, 3) / 6
        self.main_grad = torch.zeros(2, 3)
        self.store = queue.Queue()

    def backward(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        self.store.put((x, grad))
        return grad @ self.weight

    def backward_dw(self) -> None:
        x, grad = self.store.get()
        self.main_grad.add_(grad.T @ x)


def _graphed_backward_dw() -> dict:
    """The two calls captured as two graphs and replayed in turn: the eager form of ``backward_dw``
    finds the queue as the replays left it, empty."""
    layer, x, grad = DeferredLinear(), torch.ones(4, 3), torch.full((4, 2), 0.5)
    pool = graph_pool_handle("cpu")

    def workload():
        bwd = capture(lambda: layer.backward(x, grad), device="cpu", pool=pool, warmups=0, name="bwd",
                      static={"x": x, "grad": grad})
        dw = capture(layer.backward_dw, device="cpu", pool=pool, warmups=0, name="bwd_dw",
                     state={"main_grad": layer.main_grad})
        for _ in range(3):
            replay(*bwd)
            replay(dw[0], (), size=4)

    return _outcome(doctor.diagnose(workload))


def _outcome(report) -> dict:
    return {"findings": [f.kind for f in report.findings], "notes": report.notes, "failure": report.failure}


def _ends_uncompared(workload, graph: str) -> None:
    """The child's workload ends (a hang is a TimeoutError here) with no finding, and the report
    notes that ``graph``'s step could not be compared."""
    result = run_in_child(workload, timeout=180)
    assert result.ok, result
    assert result.value["failure"] is None and result.value["findings"] == [], result.value
    assert any(f"{graph}: the eager step raised EndlessWait" in n for n in result.value["notes"]), result.value


def test_an_eager_run_that_waits_on_an_empty_queue_fails_instead_of_hanging():
    _ends_uncompared(_graphed_backward_dw, "bwd_dw")


def test_work_an_eager_run_took_off_a_queue_is_put_back():
    """The runner queues a work item for each step; the captured step takes one (at capture: the
    dummy one), and the runner's code after the replay takes the step's own, without waiting. The
    doctor's eager run of the step took that item: it must be back in the queue when the run ends."""
    work, x, w = queue.Queue(), torch.zeros(4, 3), torch.eye(3)
    done = []

    def step():
        work.get()
        return x @ w

    def workload():
        work.put("dummy")
        g, out = capture(step, device="cpu", warmups=0, name="step", static={"x": x})
        for i in range(4):
            work.put(f"request {i}")
            x.copy_(torch.full((4, 3), float(i)))
            replay(g, out)
            done.append(work.get_nowait())          # queue.Empty if the doctor took it

    report = doctor.diagnose(workload)
    assert report.errors == [] and report.caught == [] and report.findings == [], report
    assert done[-4:] == [f"request {i}" for i in range(4)], done


def test_waits_are_bounded_only_for_the_threads_inside_and_restored_when_all_have_left(monkeypatch):
    """Two threads replay side by side: the first to start an eager run ends it first, while the
    second is still inside its own. The condition's ``wait`` is the library's again once the last
    has left, and a thread's untimed wait on an empty queue fails only inside such a run."""
    import threading

    from workbench.doctor.probes import waits
    original = threading.Condition.wait
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def first():
        with waits.bounded():
            first_in.set()
            second_in.wait(timeout=10)
        first_out.set()

    def second():
        first_in.wait(timeout=10)
        with waits.bounded():
            second_in.set()
            first_out.wait(timeout=10)

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert threading.Condition.wait is original
    monkeypatch.setattr(waits, "PATIENCE", 0.1)     # (a test runner's own threads may be alive)
    with waits.bounded():
        try:
            queue.Queue().get()
        except waits.EndlessWait:
            errors.append("failed")
    assert errors == ["failed"] and threading.Condition.wait is original


def _graphed_step_on_a_simple_queue() -> dict:
    """A step takes its work item from a ``queue.SimpleQueue`` (C: no condition to bound). The
    capture took the runner's dummy item; replays take none, and the doctor's eager run of the step
    finds the queue empty: only the wall-time limit ends its wait."""
    from workbench.doctor.probes import waits
    waits.LIMIT = 2.0
    work, x, w = queue.SimpleQueue(), torch.zeros(4, 3), torch.eye(3)

    def step():
        work.get()
        return x @ w

    def workload():
        work.put("dummy")
        g, out = capture(step, device="cpu", warmups=0, name="step", static={"x": x})
        for i in range(3):
            x.copy_(torch.full((4, 3), float(i)))
            replay(g, out)

    return _outcome(doctor.diagnose(workload))


def test_an_eager_run_blocked_in_c_is_stopped_by_the_wall_time_limit():
    _ends_uncompared(_graphed_step_on_a_simple_queue, "step")


def test_the_wall_time_limit_leaves_a_program_s_own_alarm_alone(monkeypatch):
    """Where the program handles ``SIGALRM`` itself, the doctor arms no timer and changes no handler."""
    import signal

    from workbench.doctor.probes import waits
    monkeypatch.setattr(waits, "LIMIT", 0.2)
    mine = lambda signum, frame: None        # noqa: E731
    old = signal.signal(signal.SIGALRM, mine)
    try:
        with waits.bounded():
            assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
            assert signal.getsignal(signal.SIGALRM) is mine
        assert signal.getsignal(signal.SIGALRM) is mine
    finally:
        signal.signal(signal.SIGALRM, old)
    with waits.bounded():                          # nobody's: armed, then given back
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
