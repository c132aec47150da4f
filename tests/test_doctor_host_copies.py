"""Host memory a captured copy reads, handed on before the capture ends (``rules/host_copies.py``).
A launcher that builds each launch's arguments in one scratch block of pinned memory and copies
them to the device: the capture records the copies' source address, and the next launch rewrites
the block, so every replay copies the last launch's arguments for all of them."""
from __future__ import annotations

import pytest
import torch

from workbench import doctor
from workbench.engine import events, graph, host, new_graph
from workbench.engine.source import function_of


class _Launcher:
    def __init__(self, retained: bool, sliced: bool = False):
        self.retained, self.scratch, self.kept = retained, host(torch.zeros(2, dtype=torch.long)), []
        self.sliced = sliced                      # the launcher copies a view it takes of what it is handed

    def launch(self, table, args):
        """``out = table[args[0]] * args[1]``, its arguments copied to the device from host memory."""
        dev = torch.empty(2, dtype=torch.long)
        dev.copy_(args[:2] if self.sliced else args, non_blocking=True)
        return table.index_select(0, dev[:1])[0] * dev[1]

    def scale_row(self, table, row: int, factor: int):
        if self.retained:                         # the fix: a block kept as long as the graph
            args = host(torch.zeros(2, dtype=torch.long))
            self.kept.append(args)
        else:
            args = self.scratch                   # one block for every launch
        args.numpy()[:] = (row, factor)           # a host store: no op
        return self.launch(table, args)


def _serve(retained: bool, refresh: bool = False, sliced: bool = False) -> list:
    table = torch.arange(12.0).view(4, 3)
    launcher, x = _Launcher(retained, sliced), torch.zeros(3)
    events.static_buffers("runner", {"x": x})

    def step():
        return launcher.scale_row(table, 1, 2) + launcher.scale_row(table, 3, 5) + x

    with events.warmup():
        step()
    g = new_graph("cpu")
    with graph(g, name="step"):
        out = step()
    outs = []
    for n in range(3):
        x.fill_(n)
        if refresh:                               # a runner's refresh of its staging block before a replay
            launcher.scratch.numpy()[:] = (2, n)
        g.replay()
        outs.append(out.clone())
    return outs


@pytest.mark.parametrize("sliced", [False, True])
def test_a_launch_argument_block_the_next_launch_rewrites_inside_the_capture_is_dangling(sliced):
    """Named where the block was handed to the launcher, also when the launcher copies a view it
    takes of it (``sync.same_memory``)."""
    report = doctor.diagnose(lambda: _serve(retained=False, sliced=sliced))
    found = report.of("dangling-reference")
    assert found, report
    assert function_of(found[0].location) == "scale_row", "named where the block was handed to the launcher"
    assert "before the capture ended" in found[0].evidence


@pytest.mark.parametrize("refresh", [False, True])
def test_blocks_kept_for_the_graph_and_refreshed_between_replays_are_no_finding(refresh):
    """Each launch's own block, kept alive with the graph (the fix); a block the runner writes after
    the capture, before each replay, is the standard staging idiom."""
    assert _serve(retained=True, refresh=refresh)[2].tolist() == [3.0 * 2 + 9 * 5 + 2, 4.0 * 2 + 10 * 5 + 2,
                                                                   5.0 * 2 + 11 * 5 + 2]
    report = doctor.diagnose(lambda: _serve(retained=True, refresh=refresh))
    assert not report.errors and not report.of("dangling-reference"), report


def test_a_launcher_handed_an_arena_that_picks_its_slot_is_named_itself():
    """Handed a whole staging arena, the launcher chose the slot it copies (and reuses) itself: the
    finding names the launcher, not its caller (``sync.same_memory``: a view the callee takes at
    another offset is not what it was handed)."""
    def launch(table, staging, row: int, factor: int):
        slot = staging[2:4]                       # the launcher's own slot, the same for every launch
        slot.numpy()[:] = (row, factor)
        dev = torch.empty(2, dtype=torch.long)
        dev.copy_(slot, non_blocking=True)
        return table.index_select(0, dev[:1])[0] * dev[1]

    def serve():
        table, x = torch.arange(12.0).view(4, 3), torch.zeros(3)
        arena = host(torch.zeros(4, dtype=torch.long))   # the caller's staging arena, handed whole
        events.static_buffers("runner", {"x": x})
        g = new_graph("cpu")
        with graph(g, name="step"):
            out = launch(table, arena, 1, 2) + launch(table, arena, 3, 5) + x
        g.replay()
        return out.clone()

    found = doctor.diagnose(serve).of("dangling-reference")
    assert found and function_of(found[0].location) == "launch", found
