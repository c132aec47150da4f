"""Host code that reads or writes, through NumPy, memory a capture's ops use: the capture records
no op of it, so a replay runs the ops around it and not the host code (``rules/host_writes.py``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench import doctor
from workbench.engine import host

from test_doctor_mechanisms import Manager, rows


class Sorted:
    """Copies the step's keys into host memory and sorts each row of it there, then scales the sorted
    keys: on the host, in place through NumPy (the bug: a host helper run while capturing), or by
    an op the capture records (the fix)."""

    def __init__(self, on_host: bool):
        self.x, self.keys, self.on_host = torch.zeros(2, 4), host(torch.zeros(2, 4)), on_host

    def forward(self, size):
        self.keys[:size].copy_(self.x[:size])
        if self.on_host:
            k = self.keys.numpy()
            k[:size] = np.sort(k[:size], axis=1)
        else:
            self.keys[:size].copy_(torch.sort(_device(self.keys[:size]), dim=1).values)
        return _device(self.keys[:size]) * 2


def _device(t):
    """Host memory copied to the device, as a kernel's launch stages it."""
    d = torch.empty(t.shape, dtype=t.dtype)
    d.copy_(t, non_blocking=True)
    return d


@pytest.mark.parametrize("on_host", [True, False])
def test_a_host_sort_through_numpy_inside_the_capture_is_host_work_frozen(on_host):
    served = []

    def workload():
        model = Sorted(on_host)
        m = Manager(model.forward, [2], {"x": model.x})
        model.x.copy_(rows(2, seed=1))
        m.capture()
        for seed in (2, 3):
            model.x.copy_(rows(2, seed=seed))
            served.append(m.replay(2).clone())
            assert torch.equal(model.x, rows(2, seed=seed))
    report = doctor.diagnose(workload)
    sorted_ = [torch.sort(rows(2, seed=s), dim=1).values * 2 for s in (2, 3)]
    assert [torch.equal(a, b) for a, b in zip(served, sorted_)] == [not on_host, not on_host]
    if not on_host:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.tensor == "float32[2, 4]", report
    assert finding.source.endswith("k = self.keys.numpy()"), finding.source
    assert "found it changed with no recorded op writing it" in finding.cause


class Refit:
    """Writes per-item bounds into host memory by an op, then refits a per-row maximum over them on the host through
    NumPy (the bug) or by an op (the fix), and reads the refitted maxima back by an op."""

    def __init__(self, on_host: bool):
        self.x, self.bounds, self.top = torch.zeros(2, 4), host(torch.zeros(2, 4)), host(torch.zeros(2, 1))
        self.on_host = on_host

    def forward(self, size):
        self.bounds[:size].copy_(self.x[:size] + 1)
        if self.on_host:
            self.top.numpy()[:size] = self.bounds.numpy()[:size].max(axis=1, keepdims=True)
        else:
            self.top[:size].copy_(_device(self.bounds[:size]).amax(dim=1, keepdim=True))
        return self.x[:size] - _device(self.top[:size])


@pytest.mark.parametrize("on_host", [True, False])
def test_host_code_that_reads_what_the_capture_wrote_is_host_work_frozen_though_it_writes_the_same_bytes(on_host):
    """The capture's step is the step just run eagerly, so the host refit writes the values already
    there: no byte changes, but the host read memory a recorded op of the capture wrote, which a
    replay rewrites and the host code never reads again."""
    def workload():
        model = Refit(on_host)
        m = Manager(model.forward, [2], {"x": model.x})
        model.x.copy_(rows(2, seed=1))
        model.forward(2)
        m.capture()
        for seed in (2, 3):
            model.x.copy_(rows(2, seed=seed))
            m.replay(2)
    report = doctor.diagnose(workload)
    if not on_host:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "host-work-frozen" and finding.tensor == "float32[2, 4]", report
    assert "self.bounds.numpy()" in finding.source, finding.source
    assert "memory a recorded op of the capture wrote" in finding.cause


def test_only_the_programs_own_hand_offs_count_past_torchs_frames():
    """``np.asarray(t)`` reaches ``Tensor.__array__`` through torch's frames: the program's call is
    the first frame past them. The doctor's own reads of a tensor's address or bytes (a digest of a
    constant, a tensor's start) hand nothing to host code."""
    import os
    import sys
    import types

    import workbench.doctor
    from workbench.doctor.rules import host_writes

    def frame_in(directory, name):
        """A function whose code says it lives in ``directory``: it calls ``back(its own frame)``."""
        scope = {"sys": sys}
        exec(compile("def run(back):\n    return back(sys._getframe(0))\n", os.path.join(directory, name), "exec"),
             scope)
        return scope["run"]

    doctor_code = frame_in(os.path.dirname(workbench.doctor.__file__), "own_code.py")
    torch_code = frame_in(os.path.dirname(torch.__file__), "_tensor_stand_in.py")
    t = torch.arange(4.0)
    for caller, counted in ((doctor_code, False), (torch_code, True), (lambda back: back(sys._getframe(0)), True)):
        capture = types.SimpleNamespace(handed={}, host_work={}, writes={}, created=set())
        caller(lambda frame: host_writes.handed(types.SimpleNamespace(capturing=capture), t, frame))
        assert bool(capture.handed) == counted, caller
