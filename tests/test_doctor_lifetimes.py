"""What lives and what goes while the doctor watches: graphs and pool blocks let go of as CUDA
lets go of them, and nothing of the workload's kept alive by the doctor itself."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from workbench import doctor
from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.doctor.rules.dangling import DanglingReferenceError
from workbench.engine.errors import GraphError, IllegalMemoryAccess


def test_a_class_defined_in_a_function_goes_with_its_graph_under_diagnose():
    """The doctor's walk of the step's Python state looks at the methods of the program's classes;
    a class made in a function (a graphed-callable wrapper closing over its graph) must still go
    when the program drops it: a capture into the pool afterwards relies on its graph being gone."""
    gone = {}

    def make(x):
        g = new_graph("cpu")
        with graph(g, name="wrapped"):
            out = x * 2

        class Wrapper:
            def eager(self):
                return x * 2

            def __call__(self):
                events.serve(g, 3, 3, outputs=(out,), eager=self.eager)     # its step, for differential replay
                g.replay()
                return out
        return Wrapper()

    def workload():
        x = torch.ones(3)
        wrapped = make(x)
        for _ in range(2):
            wrapped()
        probe = weakref.ref(wrapped)
        del wrapped
        gc.collect()
        gone["wrapper"] = probe() is None

    doctor.diagnose(workload)
    assert gone == {"wrapper": True}


@pytest.mark.parametrize("dropped_first", ["reader", "owner"])
def test_a_pool_block_whose_graph_went_first_still_counts_while_its_tensor_lives(dropped_first):
    """CUDA's allocator keeps a block in its private pool until its tensor is freed, whichever graph
    of the pool captured it went first: with every graph gone and that tensor held, a capture given
    the pool's handle is refused (``pool_probes``' ``first_dropped_output_held``, on an H200)."""
    pool = graph_pool_handle("cpu")
    x = torch.ones(4)
    a, b = new_graph("cpu"), new_graph("cpu")
    with graph(a, pool=pool):
        held = x * 2
    with graph(b, pool=pool):
        freed = x * 3
    del freed
    if dropped_first == "owner":
        del a
        gc.collect()
        del b
    else:
        del b
        gc.collect()
        del a
    gc.collect()
    with pytest.raises(GraphError, match="use_count > 0"):
        with graph(new_graph("cpu"), pool=pool):
            x + 1
    del held
    gc.collect()
    c = new_graph("cpu")
    with graph(c, pool=pool):                        # its memory all free: the handle starts a new pool
        x + 1


def _let_go(graphs: dict, how: str) -> None:
    """A cache's eviction: the graph is reset, or dropped with its last reference."""
    if how == "reset":
        graphs["staging"].reset()
    else:
        del graphs["staging"]


def _pipeline(keep_output: bool, how: str = "dropped"):
    """A graph reading another graph's output, whose graph is then dropped or reset (its static
    inputs were copied in a capture of their own, as graphed callables do); the program keeps that
    output or not."""
    x = torch.ones(2, 3)
    pool = graph_pool_handle("cpu")
    staging = new_graph("cpu")
    with graph(staging, pool=pool, name="staging"):
        static = x.clone()
    head = new_graph("cpu")
    with graph(head, pool=pool, name="head"):
        out = static.sum(-1)
    graphs = {"staging": staging}
    del staging
    _let_go(graphs, how)
    gc.collect()
    if how == "dropped in a cycle":
        cycle = [static]
        cycle.append(cycle)              # the output's last holder is a cycle no collection has freed yet
        del cycle
    if not keep_output:
        del static
        if how != "dropped in a cycle":
            gc.collect()
    head.replay()
    return out


@pytest.mark.parametrize("how", ["dropped", "reset", "dropped in a cycle"])
def test_a_dropped_graphs_output_the_program_still_holds_is_no_dangling_read(how):
    """The read dangles once the output's holder lets go too; it is named where the graph was let
    go (the decisive act, as a released input is), with the read as the evidence. A holder that is
    an uncollected cycle holds nothing: the answer does not depend on when the collector ran."""
    if how == "dropped in a cycle":
        gc.disable()
    try:
        with doctor.watch() as kept:
            _pipeline(keep_output=True, how=how)
        with doctor.watch() as dropped:
            _pipeline(keep_output=False, how=how)
    finally:
        gc.enable()
    assert kept.findings == [], kept
    (finding,) = dropped.findings
    assert finding.kind == "dangling-reference" and finding.graph == "head"
    assert f"output of staging, which was {how.split()[0]} at " in finding.evidence, finding
    assert finding.location.endswith("in _let_go"), finding
    line = "graphs[\"staging\"].reset()" if how == "reset" else "del graphs[\"staging\"]"
    assert finding.source.endswith(line) and "out = static.sum(-1)" in finding.evidence, finding


# ------------------------------------------------------------------ memory freed in place
@pytest.mark.parametrize("how", ["storage resized to 0", "tensor grown past its storage"])
def test_a_graph_reading_a_storage_given_other_memory_in_place_reads_freed_memory(how):
    """``resize_`` keeps the storage object and moves its memory (frees it, at 0 bytes): a CUDA
    graph keeps the old address, so the emulation's replay raises as after a release, and the
    doctor names the line that moved it, before the replay (``guard``: instead of it)."""
    def workload():
        w, x = torch.ones(4), torch.zeros(4)
        g = new_graph("cpu")
        with graph(g, name="reads w"):
            x + w
        g.replay()
        if how == "storage resized to 0":
            w.untyped_storage().resize_(0)
        else:
            w.resize_(1 << 12)
        g.replay()

    with pytest.raises(IllegalMemoryAccess, match="given other memory after capture"):
        workload()
    with pytest.raises(DanglingReferenceError):
        with doctor.watch(guard=True):
            workload()
    with doctor.watch() as report:
        with pytest.raises(IllegalMemoryAccess):
            workload()
    (finding,) = report.findings
    assert finding.kind == "dangling-reference" and "resize_(" in finding.source
    assert "given other memory in place" in finding.evidence
    assert "resize_" not in vars(torch.UntypedStorage)          # the doctor's wrapper is gone with the watch


@pytest.mark.parametrize("owner", ["kept", "reset"])
@pytest.mark.parametrize("freed", [True, False])
def test_another_graphs_output_freed_in_place_while_held_is_a_dangling_read(owner, freed):
    """A set-up graph's output, held by the program (a solver's analysis buffer) and read by the
    graph captured after it, is freed in place by a runtime that takes it for graph memory it may
    unmap: the next replay reads freed memory whether the set-up graph lives or was reset; the
    finding stands where it was freed. Held and not freed, the read is sound."""
    def unmap(t):
        t.untyped_storage().resize_(0)

    def workload():
        pool, x = graph_pool_handle("cpu"), torch.ones(3)
        setup = new_graph("cpu")
        with graph(setup, pool=pool, name="analysis"):
            buffer = x * 2
        setup.replay()
        solve = new_graph("cpu")
        with graph(solve, pool=pool, name="solve"):
            out = buffer + x
        if owner == "reset":
            setup.reset()
        if freed:
            unmap(buffer)
        solve.replay()
        return out

    report = doctor.diagnose(workload)
    if not freed:
        assert report.findings == [], report
        return
    (finding,) = report.findings
    assert finding.kind == "dangling-reference" and finding.graph == "solve", report
    assert finding.location.endswith("in unmap") and "freed in place" in finding.evidence, finding


def test_a_read_of_a_tensor_whose_storage_was_freed_in_place_is_named_where_it_was_freed():
    """A cache keeps a tensor whose storage another owner frees in place (a graph tree freeing its
    previous generation's outputs): the eager read fails, and the finding stands at the release."""
    cache = {}

    def dealloc_previous_generation(outputs):
        for t in outputs:
            t.untyped_storage().resize_(0)

    def workload():
        pos = torch.ones(2, 3) * 2                 # made by the step, kept by the cache
        cache["pos"] = pos
        dealloc_previous_generation([pos])
        try:
            cache["pos"] @ torch.ones(3, 2)      # (an elementwise op would read address 0)
        except RuntimeError:
            pass

    report = doctor.diagnose(workload)
    (finding,) = report.findings
    assert finding.kind == "dangling-reference"
    assert "dealloc_previous_generation" in finding.source and "aten.mm.default" in finding.evidence


def test_a_storage_freed_and_given_memory_again_before_any_read_is_no_finding():
    """Freeing a parameter's storage between uses and restoring it before the next (FSDP's idiom,
    eager only) reads no freed memory."""
    def workload():
        p = torch.ones(8)
        saved = p.clone()
        for _ in range(2):
            p.untyped_storage().resize_(0)
            p.untyped_storage().resize_(saved.untyped_storage().nbytes())
            p.copy_(saved)
            (p * 2).sum()

    assert doctor.diagnose(workload).findings == []
