"""Pinned host memory a runner stages a step's metadata in, for an asynchronous copy to the device
(``rules/staging.py``). A copy from pinned memory reads it when the stream gets to it: a host one
step ahead that refills the same buffer sends the previous step the next step's data. Workloads
keep their own queue of launches, as a stream in miniature, so the copy runs when the host waits."""
from __future__ import annotations

import pytest
import torch

from workbench import doctor
from workbench.engine import events, graph, host, new_graph


class _Stream:
    """Launches run in order when the host waits for one of them."""

    def __init__(self):
        self.queue, self.done = [], 0

    def launch(self, fn) -> int:
        self.queue.append(fn)
        return len(self.queue)

    def wait(self, mark: int) -> None:
        while self.done < mark:
            self.done += 1
            self.queue[self.done - 1]()


def _serve(variant: str, ahead: bool) -> list:
    """Four steps of a graph reading ``slots``; each step stages its slots in pinned memory (one
    buffer for all steps in the bug, a fresh one per step in the fix) and queues their copy and the
    replay. ``ahead``: the host waits for a step only after staging the next one."""
    slots, table = torch.zeros(3, dtype=torch.long), torch.arange(10.0) * 10
    persistent = host(torch.zeros(3, dtype=torch.long))
    stream, out_rows = _Stream(), []

    def step():
        return table[slots] + 1

    events.static_buffers("runner", {"slots": slots})
    with events.warmup():
        step()
    g = new_graph("cpu")
    with graph(g, name="decode"):
        out = step()
    previous = None
    for n in range(4):
        staged = persistent if variant == "bug" else host(torch.zeros(3, dtype=torch.long))
        for i in range(3):
            staged[i] = n + i                                    # the staging line
        stream.launch(lambda staged=staged: slots.copy_(staged, non_blocking=True))
        launched = stream.launch(lambda: (g.replay(), out_rows.append(out.clone())))
        if not ahead:
            stream.wait(launched)
        elif previous is not None:
            stream.wait(previous)
        previous = launched
    stream.wait(len(stream.queue))
    return out_rows


@pytest.mark.parametrize("variant", ["bug", "fix"])
def test_a_pinned_buffer_refilled_before_its_queued_copy_ran(variant):
    report = doctor.diagnose(lambda: _serve(variant, ahead=True))
    if variant == "fix":
        assert report.findings == [], report
        return
    found = report.findings[0]
    assert found.kind == "persistent-mutation" and "staged[i] = n + i" in found.source, report
    assert found.tensor.startswith("pinned host memory"), report


def test_a_pinned_buffer_refilled_after_its_copy_ran_is_no_finding():
    """The same single buffer, with the host waiting for each step: every refill comes after the
    copy that read the previous one."""
    report = doctor.diagnose(lambda: _serve("bug", ahead=False))
    assert report.findings == [], report


def test_a_host_read_of_staged_data_is_a_read():
    """Staged data the host reads back (``tolist``: no op on the CPU) reached a reader."""
    def workload():
        staged = host(torch.zeros(2))
        for n in range(3):
            staged.copy_(torch.tensor([n, n + 1.0]))
            staged.tolist()
    assert doctor.diagnose(workload).findings == []


def test_a_host_mirror_nothing_reads_after_its_first_upload_is_no_finding():
    """A runner keeps a pinned host mirror of its lengths up to date every step, but fills the
    device copy the graph reads from the step's own device tensor: after the capture's upload
    nothing reads the mirror again, so no step's data was lost. Read again once after the
    refills, the same mirror is a staging buffer whose earlier data never reached that read."""
    def workload(read_again: bool):
        lengths, mirror = torch.zeros(3, dtype=torch.long), host(torch.zeros(3, dtype=torch.long))
        events.static_buffers("runner", {"lengths": lengths})
        mirror.fill_(1)
        lengths.copy_(mirror)                                    # the capture's batch, uploaded
        g = new_graph("cpu")
        with graph(g, name="decode"):
            out = lengths * 2
        for n in range(3):
            given = torch.tensor([n, n + 1, n + 2])
            mirror.copy_(given)                                  # the mirror line
            lengths.copy_(given)
            g.replay()
        if read_again:
            lengths.copy_(mirror, non_blocking=True)
        return out.clone()

    assert doctor.diagnose(lambda: workload(False)).findings == []
    found = doctor.diagnose(lambda: workload(True)).findings
    assert [f.kind for f in found] == ["persistent-mutation"] and "mirror.copy_(given)" in found[0].source, found


def test_data_nothing_reads_is_not_lost_when_its_block_is_filled_again():
    """Pinned blocks handed out by an arena (a host allocator's free list): each step writes a
    temporary into block 1, drops it unread, and uploads block 0, which it keeps. The same line
    writes block 1 over with other values, but no reader ever wanted the first bytes: no finding.
    Read block 1 once after the refills, and the earlier data never reached that read."""
    def workload(read_block_1: bool):
        arena, names = host(torch.zeros(2, 4)), torch.zeros(4)
        events.static_buffers("runner", {"names": names})
        arena[0] = 7.0
        g = new_graph("cpu")
        with graph(g, name="layer"):
            out = names * 2
        for n in range(3):
            arena[1] = float(n)                                  # a temporary's bytes, dropped unread
            names.copy_(arena[0], non_blocking=True)             # the kept block, uploaded
            g.replay()
        if read_block_1:
            names.copy_(arena[1], non_blocking=True)
        return out.clone()

    assert doctor.diagnose(lambda: workload(False)).findings == []
    found = doctor.diagnose(lambda: workload(True)).findings
    assert [f.kind for f in found] == ["persistent-mutation"] and "arena[1] = float(n)" in found[0].source, found


def test_a_row_cleared_refilled_and_cleared_again_before_its_upload_lost_nothing_of_the_clear():
    """A runner's pinned block table condenses when requests finish: ``clear_row`` empties a row,
    ``add_row`` refills it with the next request's blocks, and when that request finishes too in the
    same step ``clear_row`` empties it again, all before the step's one upload. The second clear
    writes over data of ``add_row``'s, an edit by another line, not over the first clear's data,
    which ``add_row`` had already replaced: no finding (a line that writes over its own staged data,
    as in the single-buffer refill above, still is one)."""
    def workload():
        table, mirror = torch.zeros(2, 2, dtype=torch.long), host(torch.ones(2, 2, dtype=torch.long))
        events.static_buffers("runner", {"block_table": table})
        table.copy_(mirror)
        g = new_graph("cpu")
        with graph(g, name="decode"):
            out = table * 2

        def clear_row(row):
            mirror[row].fill_(0)                                 # the clearing line

        def add_row(row, blocks):
            mirror[row] = torch.tensor(blocks)

        for n in range(3):
            clear_row(0)
            add_row(0, [n + 2, n + 3])
            clear_row(0)
            add_row(0, [n + 5, n + 6])
            table.copy_(mirror, non_blocking=True)
            g.replay()
        return out.clone()

    assert doctor.diagnose(workload).findings == []
