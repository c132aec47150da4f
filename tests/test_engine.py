"""Each CUDA-graph rule the CPU emulation promises, one test (or a few) per rule."""
import contextlib
import sys
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench import expect_failure
from workbench.engine import (CaptureError, CPUGraph, GraphError, IllegalMemoryAccess, graph,
                              graph_pool_handle, new_graph, resolve_device, reuse_freed_blocks,
                              synchronize, track_origins)


def capture(fn, pool=None, **kw):
    g = new_graph("cpu", **kw)
    with graph(g, pool=pool):
        out = fn()
    return g, out


# ---------------------------------------------------------------- record and replay
def test_replay_reruns_ops_on_the_same_storage():
    x = torch.zeros(3)
    w = torch.tensor([1.0, 2.0, 3.0])
    g, out = capture(lambda: x * w + 1)
    ptr = out.data_ptr()
    for k in range(1, 4):
        x.fill_(float(k))
        g.replay()
        assert out.data_ptr() == ptr
        assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0]) * k + 1)


def test_recorded_ops_keep_read_write_storages_and_user_source_line():
    x = torch.zeros(4)
    g, _ = capture(lambda: x.add_(1))
    (op,) = [o for o in g.ops if not o.is_view]
    key = x.untyped_storage()._cdata
    assert op.name == "aten.add_.Tensor"
    assert key in op.writes and key in op.reads
    assert "test_engine.py" in op.source and "x.add_(1)" in op.source


def test_an_op_run_from_code_made_without_source_is_named_at_its_caller():
    """Code ``exec``'d from a string (how a dataclass makes its ``__eq__``) has no line to show, so
    the user's line is the one that called it."""
    made: dict = {}
    exec("def scale(t):\n    return t * 2\n", made)
    x = torch.ones(2)
    g, _ = capture(lambda: made["scale"](x))
    (op,) = [o for o in g.ops if not o.is_view]
    assert "test_engine.py" in op.source and 'made["scale"](x)' in op.source


def test_in_place_shape_changes_are_not_replayed():
    """``vector @ matrix`` squeezes its ``mm`` result in place, and the allocator hands a loop's next
    ``mm`` the same block: replayed, the squeeze would reshape the graph's own reference to that
    memory. A CUDA capture records no kernel for it; nor does the emulation."""
    state0, k = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), torch.ones(3, 4)

    def step():
        state = state0.clone()
        for t in range(3):
            state = state + torch.outer(k[t], k[t] @ state)
            state.t_()
        return state
    g, out = capture(step)
    assert not any(op.func.overloadpacket in (torch.ops.aten.squeeze_, torch.ops.aten.t_) for op in g.ops)
    g.replay()
    g.replay()
    assert torch.equal(out, step())


# ------------------------------------------------------------------ frozen Python
def test_python_branches_are_frozen_at_capture():
    state = {"scale": 2.0}
    x = torch.ones(2)
    g, out = capture(lambda: x * 2 if state["scale"] == 2.0 else x * 100)
    state["scale"] = 3.0
    g.replay()
    assert torch.equal(out, torch.full((2,), 2.0))


def test_lazy_init_consumed_by_warmup_is_absent_from_the_graph():
    lengths = torch.tensor([3.0])
    state = {"plan": None}

    def attention():
        if state["plan"] is None:
            state["plan"] = lengths.max().reshape(1) * 1
        return state["plan"] + 0

    attention()                                   # warmup plans
    stale, out = capture(attention)
    lengths.fill_(9.0)
    stale.replay()
    assert out.item() == 3.0
    assert not any("max" in op.name for op in stale.ops)
    state["plan"] = None
    fresh, out2 = capture(attention)
    fresh.replay()
    assert out2.item() == 9.0
    assert any("max" in op.name for op in fresh.ops)


# ----------------------------------------------------- capture launches nothing lasting
def test_capture_leaves_no_write_on_pre_existing_memory():
    x = torch.zeros(4)
    g, _ = capture(lambda: x.add_(2))
    assert torch.equal(x, torch.zeros(4))
    g.replay()
    g.replay()
    assert torch.equal(x, torch.full((4,), 4.0))


def test_outputs_hold_poison_until_first_replay():
    x = torch.ones(3)
    i = torch.arange(3)
    g, (f, n) = capture(lambda: (x * 2, i + 1))
    assert torch.isnan(f).all()
    assert (n == torch.iinfo(torch.int64).min).all()
    g.replay()
    assert torch.equal(f, torch.full((3,), 2.0)) and torch.equal(n, torch.tensor([1, 2, 3]))


def test_constants_created_inside_capture_keep_their_value():
    """A number made into a tensor in the captured code is passed by value to an elementwise op (an
    index list made so is refused: on CUDA it is copied from pageable memory)."""
    x = torch.ones(3)
    g, out = capture(lambda: x[::2] * torch.tensor(5.0))
    g.replay()
    assert torch.equal(out, torch.tensor([5.0, 5.0]))


# ---------------------------------------------------------- ownership and liveness
def test_graph_owns_what_it_allocated_and_references_the_rest():
    x = torch.ones(3)
    g, out = capture(lambda: x * 2)
    assert g.owns(out) and not g.owns(x)


def test_released_reference_raises_illegal_memory_access_naming_op_and_origin():
    with track_origins():
        tmp = torch.arange(10.0) * 2
    idx = torch.tensor([1, 2])
    g = new_graph("cpu")
    with graph(g):
        tmp[idx] + 0
    g.replay()
    del tmp
    gc.collect()
    with expect_failure(IllegalMemoryAccess, quiet=True) as caught:
        g.replay()
    msg = str(caught.error)
    assert "aten.index.Tensor" in msg and "float32[10]" in msg
    assert "tmp = torch.arange(10.0) * 2" in msg          # where it was created


def test_liveness_is_per_storage_not_per_tensor_object():
    base = torch.arange(8.0)
    view = base[2:6]
    g = new_graph("cpu")
    with graph(g):
        out = view * 1
    del view                                             # the view object dies, storage lives
    gc.collect()
    g.replay()
    assert torch.equal(out, torch.arange(2.0, 6.0))
    del base
    gc.collect()
    with pytest.raises(IllegalMemoryAccess):
        g.replay()


def test_storage_keys_are_never_reused_while_the_doctor_watches():
    """A released storage's handle may be given to the next tensor made, and so its key: records
    keyed by storage would then take the new tensor for the dead one (a finding that came and went
    with the garbage collector). Under ``unique_storage_keys`` (every ``watch``) keys stay unique,
    and the memory is still freed with the last tensor."""
    from workbench.doctor import watch
    from workbench.engine.opinfo import storage_key, unique_storage_keys

    def keys_of_released(n: int) -> set[int]:
        keys = set()
        for _ in range(n):
            t = torch.ones(4)
            keys.add(storage_key(t))
            del t
        return keys

    with unique_storage_keys():
        assert len(keys_of_released(50)) == 50
        t = torch.ones(4)
        weak = StorageWeakRef(t.untyped_storage())
        storage_key(t)
        del t
        assert weak.expired()
    with watch():
        assert len(keys_of_released(50)) == 50


def test_reuse_mode_reads_the_next_allocation_of_the_freed_block():
    tmp = torch.arange(16.0)
    g = new_graph("cpu", on_freed="reuse")
    with graph(g):
        out = tmp.sum().reshape(1)
    g.replay()
    assert out.item() == 120.0
    del tmp
    gc.collect()
    g.replay()
    assert out.item() == 120.0                            # freed, not yet reused: old bytes
    with reuse_freed_blocks():
        other = torch.full((16,), 1.0)
    g.replay()
    assert out.item() == 16.0                             # silently someone else's data
    assert torch.equal(other, torch.ones(16))


def test_a_dropped_graph_gives_its_memory_back_to_the_pool_at_once():
    pool = graph_pool_handle("cpu")
    x = torch.ones(4)
    keep, _ = capture(lambda: x * 2, pool=pool)
    drop, _ = capture(lambda: x * 3, pool=pool)
    assert len(pool) == 2
    del drop                                  # no gc.collect(): no graph <-> pool cycle
    assert len(pool) == 1
    keep.reset()
    assert len(pool) == 0


# ------------------------------------------------------------- host synchronisation
@pytest.mark.parametrize("sync", [
    lambda x: x.sum().item(), lambda x: x.cpu(), lambda x: torch.nonzero(x), lambda x: print(x),
    lambda x: x[x > 0], lambda x: x.tolist(), lambda x: bool(x.sum()), lambda x: synchronize("cpu"),
], ids=["item", "cpu", "nonzero", "print", "mask-index", "tolist", "bool", "synchronize"])
def test_host_sync_inside_capture_raises_capture_error(sync):
    x = torch.ones(4)
    with expect_failure(CaptureError, match="capture", quiet=True):
        capture(lambda: sync(x))


@pytest.mark.cuda
@pytest.mark.parametrize("wait", [lambda: torch.cuda.synchronize(),
                                  lambda: torch.cuda.current_stream().synchronize(),
                                  lambda: torch.cuda.Event().synchronize()], ids=["device", "stream", "event"])
def test_a_stream_wait_inside_a_cuda_capture_is_refused_before_cuda_breaks_the_capture(wait):
    """As ``synchronize()`` in a CPU capture: the engine's error, naming the line, and CUDA still usable."""
    x = torch.ones(4, device="cuda")
    g = new_graph("cuda")
    with expect_failure(CaptureError, match="synchronize", quiet=True):
        with graph(g):
            y = x * 2
            wait()
    torch.cuda.synchronize()
    assert torch.equal(x * 2, torch.full((4,), 2.0, device="cuda")) and y.shape == (4,)


def test_failed_capture_undoes_its_writes_and_can_be_retried():
    x = torch.zeros(2)
    g = new_graph("cpu")
    with pytest.raises(CaptureError):
        with graph(g):
            x.add_(1)
            x.sum().item()
    assert torch.equal(x, torch.zeros(2))
    with graph(g):
        x.add_(1)
    g.replay()
    assert torch.equal(x, torch.ones(2))


# ------------------------------------------------- views, in-place, out=, RNG, pools
def test_views_inplace_and_out_variants_replay():
    x = torch.arange(6.0).reshape(2, 3)
    buf = torch.zeros(2)

    def f():
        v = x.t()[1]                 # view of a view
        torch.add(v, 1, out=buf)     # out= into pre-existing memory
        y = v.clone()
        y.mul_(10)                   # in-place on owned memory
        return y
    g, y = capture(f)
    x.copy_(torch.arange(6.0).reshape(2, 3) * 2)
    g.replay()
    assert torch.equal(y, torch.tensor([20.0, 80.0]))
    assert torch.equal(buf, torch.tensor([3.0, 9.0]))


def test_rng_ops_draw_new_numbers_each_replay():
    g, out = capture(lambda: torch.rand(1000))
    g.replay()
    first = out.clone()
    g.replay()
    assert not torch.equal(first, out)
    assert 0.45 < out.mean().item() < 0.55


def test_graphs_share_a_pool_and_read_each_others_outputs():
    pool = graph_pool_handle("cpu")
    x = torch.zeros(2)
    g1, y = capture(lambda: x + 1, pool=pool)
    g2, z = capture(lambda: y * 10, pool=pool)
    assert g2.owns(y) and g1.pool() is g2.pool()
    x.fill_(4.0)
    g1.replay()
    g2.replay()
    assert torch.equal(z, torch.full((2,), 50.0))


# ------------------------------------------------------------------ misuse
def test_replay_before_capture_and_after_reset():
    g = new_graph("cpu")
    with expect_failure(GraphError, match="before capture", quiet=True):
        g.replay()
    x = torch.ones(1)
    with graph(g):
        x * 2
    g.reset()
    with pytest.raises(GraphError, match="before capture"):
        g.replay()


def test_nested_capture_and_double_capture_are_refused():
    x = torch.ones(1)
    outer = new_graph("cpu")
    with pytest.raises(GraphError, match="do not nest"):
        with graph(outer):
            with graph(new_graph("cpu")):
                x * 2
    g, _ = capture(lambda: x * 2)
    with pytest.raises(GraphError, match="already holds a capture"):
        with graph(g):
            x * 3


def test_cuda_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(GraphError, match="sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(GraphError):
        new_graph("cuda")


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_freed"):
        CPUGraph(on_freed="sometimes")
    with pytest.raises(TypeError, match="pool"):
        with graph(new_graph("cpu"), pool="not a pool"):
            pass
    with pytest.raises(TypeError, match="new_graph"):
        with graph(object()):
            pass


# ------------------------------------------------------------------- host memory
def test_host_memory_in_capture_runs_once_and_is_not_replayed():
    from workbench.engine import host, is_host
    staging = host(torch.zeros(1), "cpu")
    lens = host(torch.tensor([2, 7, 4]), "cpu")
    dev = torch.zeros(1)
    g = new_graph("cpu")
    with graph(g):
        staging += 1
        plan = max(lens.tolist())                 # FlashInfer-style planning on host metadata
        dev.copy_(staging, non_blocking=True)
        out = dev + plan
    assert staging.tolist() == [1.0] and plan == 7 and is_host(staging) and not is_host(out)
    g.replay()
    g.replay()
    assert staging.tolist() == [1.0]
    staging.fill_(5.0)
    g.replay()
    assert out.tolist() == [12.0]                  # the captured copy re-reads the host buffer


def test_device_memory_made_where_a_capture_freed_host_memory_is_device_memory():
    """Host work in a capture makes temporaries that die; a device allocation after them may get the
    same storage handle. The capture still takes it for device memory, so copying it is no pageable
    copy (keys of a capture's storages are never reused while it is open)."""
    from workbench.engine import host
    lens = host(torch.arange(8, dtype=torch.float64), "cpu")
    static, out = torch.ones(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    g = new_graph("cpu")
    with graph(g):
        for _ in range(200):
            tmp = lens * 2                          # host work: runs once, not recorded, then freed
            assert float(tmp.sum()) == 56.0
            del tmp
            out.copy_(torch.full((8,), 2.0, dtype=torch.float64) * static)
    static.fill_(3.0)
    g.replay()
    assert out.tolist() == [6.0] * 8


def test_device_op_on_host_memory_raises_naming_op_and_line():
    from workbench.engine import HostDeviceMixError, host
    h = host(torch.ones(3), "cpu")
    d = torch.ones(3)
    with pytest.raises(HostDeviceMixError, match=r"(?s)add.*test_engine.py.*d \+ h"):
        d + h
    g = new_graph("cpu")
    with pytest.raises(HostDeviceMixError, match="mul"):
        with graph(g):
            d * h
    assert not g.captured and len(g.pool()) == 0
    assert torch.equal(d * h.sum(), torch.full((3,), 3.0))   # a 0-dim host tensor is a scalar
    assert not isinstance(h.to("cpu"), type(h)) and h.to("cpu").data_ptr() != h.data_ptr()


def test_device_data_assigned_into_host_memory_crosses_as_on_cuda_watched_or_not():
    """``host[...] = device`` is a copy CUDA allows (a device-to-host copy); it stays one while a
    watcher wraps ``Tensor.__setitem__`` (the doctor does, to check slice writes)."""
    from workbench import doctor
    from workbench.engine import host
    h = host(torch.zeros(2, dtype=torch.int32), "cpu")

    def assign():
        h[...] = torch.tensor([3, 4], dtype=torch.int32)
    assign()
    assert h.tolist() == [3, 4]
    h.zero_()
    report = doctor.diagnose(assign)
    assert h.tolist() == [3, 4] and not report.errors and "raised" not in str(report), report


def test_item_of_device_memory_in_capture_still_raises():
    from workbench.engine import host
    h = host(torch.ones(2), "cpu")
    with pytest.raises(CaptureError, match="item"):
        capture(lambda: (h.sum().item(), torch.ones(2).sum().item()))


def _copy_from_host_made_in_capture(on_freed, make):
    """A graph whose captured copy reads host memory that the captured code made (and dropped,
    unless ``make`` keeps it); the device tensors it reads live as long as the graph."""
    dev, x = torch.zeros(4, dtype=torch.int64), torch.arange(4.0) * 10
    g = new_graph("cpu", on_freed=on_freed)
    with graph(g):
        dev.copy_(make(), non_blocking=True)
        out = x.index_select(0, dev)
    return g, out, (dev, x)


def test_host_memory_made_in_capture_lives_with_the_graph_and_is_read_by_address():
    """As on an H100 with torch 2.11 (probe ``host_made_in_capture``): the host block made inside the
    capture is kept for the graph, so the next host allocation does not take it, and the captured
    copy reads it by address at every replay."""
    from workbench.engine import host
    g, out, _inputs = _copy_from_host_made_in_capture("reuse", lambda: host(torch.tensor([3, 1, 2, 0]), "cpu"))
    assert len(g.pool()) == 1 and not any(op.name.startswith("aten.lift") for op in g.ops)
    g.replay()
    assert out.tolist() == [30.0, 10.0, 20.0, 0.0]          # the bytes the copy saw at capture
    with reuse_freed_blocks():
        other = host(torch.tensor([0, 0, 1, 1]), "cpu")      # a new host allocation: another block
    g.replay()
    assert out.tolist() == [30.0, 10.0, 20.0, 0.0] and other.tolist() == [0, 0, 1, 1]
    kept = next(t for t in g._host_kept)
    kept.fill_(2)
    g.replay()
    assert out.tolist() == [20.0] * 4                        # read at replay, through the address


def test_host_memory_made_in_capture_from_a_reused_pool_block_is_its_own():
    """Inside a capture a factory's output may be placed in a pool block an earlier temporary left
    (here the first launch's device argument buffer). Made host memory with ``host()``, it must not
    stay there: on CUDA the factory made a CPU tensor and ``pin_memory()`` copied it, so the
    replay's copy into the first buffer never touches the second launch's host arguments."""
    from workbench.engine import host
    table, kept = torch.arange(12.0).view(4, 3), []

    def launch(row, factor):
        args = host(torch.zeros(2, dtype=torch.int64), "cpu")
        kept.append(args)
        args.numpy()[:] = (row, factor)
        dev = torch.empty(2, dtype=torch.int64)
        dev.copy_(args, non_blocking=True)
        return table.index_select(0, dev[:1])[0] * dev[1]

    g = new_graph("cpu")
    with graph(g):
        a, b = launch(1, 2), launch(3, 5)
    g.replay()
    assert [k.tolist() for k in kept] == [[1, 2], [3, 5]]
    assert a.tolist() == [6.0, 8.0, 10.0] and b.tolist() == [45.0, 50.0, 55.0]


def test_host_memory_made_in_capture_and_dropped_raises_on_replay_by_default():
    from workbench.engine import host
    g, _, _inputs = _copy_from_host_made_in_capture(
        "raise", lambda: host(host(torch.zeros(4, dtype=torch.int64), "cpu") + 1, "cpu"))
    assert [op.name for op in g.ops if not op.is_view] == ["aten.copy_.default", "aten.index_select.default"]
    with pytest.raises(IllegalMemoryAccess, match=r"(?s)copy_.*host int64\[4\]"):
        g.replay()


def test_host_memory_made_in_capture_and_kept_is_read_live():
    from workbench.engine import host
    kept = []
    g, out, _inputs = _copy_from_host_made_in_capture("raise", lambda: kept.append(host(torch.zeros(4, dtype=torch.int64), "cpu"))
                                              or kept[0])
    kept[0].copy_(torch.tensor([1, 1, 2, 3]))
    g.replay()
    assert out.tolist() == [10.0, 10.0, 20.0, 30.0] and kept[0].tolist() == [1, 1, 2, 3]


@pytest.mark.parametrize("alloc", [lambda s: torch.empty(3), lambda s: torch.empty_like(s),
                                   lambda s: s.new_empty(3), lambda s: torch.empty_strided((3,), (1,))])
def test_replay_launches_nothing_for_an_allocation(alloc):
    s = torch.ones(3)
    g = new_graph("cpu")
    with graph(g):
        buf = alloc(s)
        buf[:2].copy_(s[:2])
    assert buf.isnan().all()                                 # capture computes nothing
    g.replay()
    assert buf[:2].tolist() == [1.0, 1.0] and buf[2].isnan()  # the unwritten element keeps its bytes
    buf[2] = 7.0
    g.replay()
    assert buf.tolist() == [1.0, 1.0, 7.0]


def test_capture_query_answers_false_outside_a_capture():
    assert torch.cuda.is_current_stream_capturing() is False


def test_a_capture_refuses_a_copy_from_pageable_host_memory_or_a_blocking_one():
    """As torch on CUDA ("... unless the CPU tensor is pinned"): ``host()`` memory is pinned, and
    so are its views; what an op on it returns (a clone, an advanced index) is pageable, and a
    captured copy of it into device memory raises. ``host()`` of it pins it. A blocking copy from
    pinned memory raises too (torch synchronises the stream after it: on an H200 the capture
    fails). Outside a capture any copy is allowed."""
    from workbench.engine import host
    pinned = host(torch.arange(4.0), "cpu")
    dev = torch.zeros(2)
    for source, blocking, refused in ((pinned[1:3], False, None), (pinned.clone()[:2], False, "pageable host memory"),
                                      (pinned[[0, 1]], False, "pageable host memory"),
                                      (host(pinned[[0, 1]], "cpu"), False, None),
                                      (pinned[:2], True, "without non_blocking=True")):
        g = new_graph("cpu")
        if refused:
            with pytest.raises(CaptureError, match=refused), graph(g):
                dev.copy_(source, non_blocking=not blocking)
        else:
            with graph(g):
                dev.copy_(source, non_blocking=not blocking)
        dev.copy_(source)                                  # eagerly: a plain copy either way


def test_a_capture_refuses_python_data_copied_to_the_device_and_records_a_number_passed_by_value():
    """On CUDA, Python data the captured code makes into a tensor is pageable host memory, and a
    capture refuses copying it to the device (an H200 with torch 2.11, engine probe ``python_data``):
    ``t[0] = 0`` (``select`` then ``copy_``), ``t[index] = 1`` (``index_put_``), an index list,
    ``t.copy_(torch.tensor(2.))``, ``torch.where`` given one, ``t.new_tensor(...)`` and
    ``torch.tensor(...).to(device)``. A slice or a column filled with a number (``fill_``), a mask
    filled with one (``masked_fill_``) and a host number given to an elementwise op are passed by
    value: recorded, and every replay writes them again."""
    t = torch.zeros(3, 4)
    index = torch.tensor([0, 2])
    refused = {"t[0, 1] = 1": lambda: t.__setitem__((0, 1), 1.0),
               "t[index] = 1": lambda: t.__setitem__(index, 1.0),
               "t[[0, 2]]": lambda: t[[0, 2]] * 1,
               "t.copy_(torch.tensor(2.))": lambda: t.copy_(torch.tensor(2.0)),
               "torch.where": lambda: torch.where(t > 0, t, torch.tensor(0.5)),
               "new_tensor": lambda: t + t.new_tensor(2.0),
               ".to(device)": lambda: t[0] + torch.tensor([1.0, 2.0, 3.0, 4.0]).to("cpu")}
    for what, use in refused.items():
        with pytest.raises(CaptureError, match="pageable host memory"), graph(new_graph("cpu")):
            use()
        use()                                            # eagerly: allowed
    g = new_graph("cpu")
    with graph(g):
        t[1:3] = 5.0
        t[:, 0] = 2
        t[t > 4] = 7
        t.add_(torch.tensor(1.0))
        torch.tensor([1.0, 2.0]) * 2                     # host work on Python data alone: no copy
    t.zero_()
    g.replay()
    assert t[0].tolist() == [3.0, 1.0, 1.0, 1.0] and t[1].tolist() == [3.0, 8.0, 8.0, 8.0]


def test_python_numbers_a_capture_writes_into_host_memory_are_host_work_that_stays():
    """A runner staging metadata into pinned memory inside a capture (``pinned[1] = n``, a slice,
    listed elements, a numpy store): on CUDA each write is host work, done once at capture and kept,
    and the graph records only the copy to the device (an H200 with torch 2.11, engine probe
    ``python_into_host``). So a replay copies what the host holds then, not what the capture wrote."""
    from workbench.host_data_probes import probe_python_into_host
    answer = probe_python_into_host("cpu")
    assert answer["after_capture"] == {"host": [3.0, 5.0, 7.0, 7.0, 8.0, 9.0], "device": [0.0] * 6}
    assert answer["after_replay"] == {"host": [1.0] + [0.0] * 5, "device": [1.0] + [0.0] * 5}


def test_host_requires_a_cpu_tensor_and_a_known_device():
    from workbench.engine import host
    with pytest.raises(TypeError, match="CPU tensor"):
        host([1, 2], "cpu")
    with pytest.raises(GraphError, match="'cpu' or 'cuda'"):
        host(torch.ones(1), "tpu")


# ------------------------------------------------------------- pool hands blocks on
def test_recapture_into_a_pool_reuses_the_dropped_graphs_block():
    pool = graph_pool_handle("cpu")
    inp = torch.full((4,), 5.0)
    g_a, a = capture(lambda: inp - 2, pool=pool)
    g_b, b = capture(lambda: a + 1, pool=pool)
    del g_a, a
    g_a2, _ = capture(lambda: inp * 2, pool=pool)
    g_a2.replay()
    g_b.replay()
    assert b.tolist() == [11.0] * 4


def test_a_block_still_held_by_the_user_is_not_handed_on():
    pool = graph_pool_handle("cpu")
    inp = torch.full((4,), 5.0)
    g_a, a = capture(lambda: inp - 2, pool=pool)
    g_b, b = capture(lambda: a + 1, pool=pool)
    del g_a                                       # the user keeps `a`
    g_a2, a2 = capture(lambda: inp * 2, pool=pool)
    assert a2.data_ptr() != a.data_ptr()
    g_b.replay()
    assert torch.isnan(b).all()                   # b reads a, which no replay wrote since capture


def test_memory_freed_inside_a_capture_is_reused_by_later_allocations():
    x = torch.ones(8)

    def body():
        t = x * 2
        address = t.data_ptr()
        y = t + 1
        del t
        u = x * 3
        return address == u.data_ptr(), u + y

    g = new_graph("cpu")
    with graph(g):
        reused, out = body()
    assert reused
    x.fill_(2.0)
    g.replay()
    assert torch.equal(out, torch.full((8,), 11.0))


def test_reuse_mode_graphs_of_one_address_share_one_retained_block():
    tmp = torch.arange(16.0)
    gs = [capture(lambda: tmp.sum().reshape(1), on_freed="reuse") for _ in range(3)]
    refs = [g.ops[-1].external_refs() or g.ops[0].external_refs() for g, _ in gs]
    assert len({r[0].retained.data_ptr() for r in refs}) == 1
    del tmp
    gc.collect()
    with reuse_freed_blocks():
        first = torch.full((16,), 1.0)
        second = torch.full((16,), 2.0)
    for g, out in gs:
        g.replay()
        assert out.item() == 16.0
    assert second.data_ptr() != first.data_ptr()


# ------------------------------------------------------------------- replay errors
def test_an_error_in_an_emulated_replay_names_the_recorded_op_and_line():
    x = torch.ones(4)
    idx = torch.tensor([0, 1])
    g, _ = capture(lambda: x[idx] * 2)
    idx.fill_(99)                                 # out of range: the replayed kernel fails
    with pytest.raises(IndexError) as info:
        g.replay()
    assert any("aten.index" in n and "test_engine.py" in n for n in info.value.__notes__)


def test_replay_inside_its_own_capture_says_the_capture_is_still_open():
    g = new_graph("cpu")
    with pytest.raises(GraphError, match="still open"):
        with graph(g):
            torch.ones(1) + 1
            g.replay()
    assert not g.captured


def test_new_graph_with_a_bogus_device_names_the_choices():
    with pytest.raises(GraphError, match="device must be 'cpu' or 'cuda', got 'bogus'"):
        new_graph("bogus")


@pytest.mark.parametrize("inference", [False, True])
def test_a_constant_made_in_capture_records_no_lift_or_detach(inference):
    x = torch.ones(3)
    with torch.inference_mode(inference):
        g, out = capture(lambda: x + torch.tensor([1.0, 2.0, 3.0]))
    assert [op.name for op in g.ops] == ["aten.add.Tensor"]
    x.fill_(2.0)
    g.replay()
    assert out.tolist() == [3.0, 4.0, 5.0]


def test_constants_made_inside_a_capture_live_as_long_as_the_graph():
    """``torch.tensor([...])`` in the captured code is a constant the graph keeps: its block is never
    handed to a later allocation of the capture (which would overwrite the index it holds)."""
    from workbench.engine import graph, new_graph
    cache, x = torch.arange(8.0).reshape(4, 2), torch.ones(2, 2)

    def step():
        gathered = cache.flip(0)[2:]                     # rows 1 and 0 (an index list would be refused)
        return (gathered * torch.tensor([[1.0], [0.0]])).sum(0, keepdim=True) + x
    g = new_graph("cpu")
    with graph(g):
        out = step()
    x.fill_(2.0)
    g.replay()
    assert torch.equal(out, step())


def _comprehension_code():
    return [sys._getframe().f_code for _ in range(1)][0]


def _generator_code():
    return next(sys._getframe().f_code for _ in range(1))


def test_a_comprehension_is_named_by_the_function_it_is_written_in():
    """Python 3.11 runs a list comprehension in a frame of its own, 3.12 inline: a site names the
    enclosing function on both; a generator expression's frame, on every version, is named so too."""
    from workbench.engine.source import function_name, location
    code = _comprehension_code()
    assert function_name(code) == "_comprehension_code"
    assert " in _comprehension_code: return [sys._getframe()" in location(code, code.co_firstlineno)
    code = _generator_code()
    assert code.co_name == "<genexpr>" and function_name(code) == "_generator_code"


def test_a_site_without_a_line_names_the_line_that_defines_its_function():
    """A code object alone, or a frame whose instruction has no line (Python 3.12 gives None), is
    named at its function's ``def`` line, never refused."""
    from workbench.engine.source import location
    code = _comprehension_code.__code__
    assert location(code).endswith(f":{code.co_firstlineno} in _comprehension_code: def _comprehension_code():")


def test_capture_end_is_announced_once_the_capture_has_closed():
    """As on CUDA: an observer's own tensor work at ``capture_end`` is not recorded into the graph,
    and an observer that raises there leaves no capture open behind it."""
    from workbench.engine import events, queries

    class Observer:
        def __init__(self, fail):
            self.fail, self.open = fail, None

        def capture_end(self, g):
            self.open = queries.is_capturing()
            torch.ones(2).add_(1)            # the observer's own work
            if self.fail:
                raise RuntimeError("observer failed")

    for fail in (False, True):
        observer = Observer(fail)
        events.subscribe(observer)
        try:
            g, x = new_graph("cpu"), torch.ones(3)
            with (pytest.raises(RuntimeError, match="observer failed") if fail else contextlib.nullcontext()):
                with graph(g):
                    y = x * 2
        finally:
            events.unsubscribe(observer)
        assert observer.open is False and not queries.is_capturing()
        assert [op.name for op in g.ops] == ["aten.mul.Tensor"]
        x.fill_(5.0)
        g.replay()
        assert torch.equal(y, torch.full((3,), 10.0))


def test_a_warmup_left_open_ends_only_for_the_observers_that_saw_it_begin():
    """A thread that stops inside ``warmup()`` leaves its block open; the block ends when its
    generator is collected, at whatever moment that is. An observer subscribed since (the next
    watch) must not be told a warmup of its own ended: it would take the ops of a capture it is
    watching for eager ones. Observers that saw the begin and are still subscribed are told."""
    import gc

    from workbench.engine import events

    class Observer:
        def __init__(self):
            self.seen = []

        def warmup_begin(self):
            self.seen.append("begin")

        def warmup_end(self):
            self.seen.append("end")

    first, later, both = Observer(), Observer(), Observer()
    events.subscribe(first)
    events.subscribe(both)
    left_open = events.warmup()
    left_open.__enter__()
    events.unsubscribe(first)
    events.subscribe(later)
    try:
        del left_open
        gc.collect()
    finally:
        events.unsubscribe(later)
        events.unsubscribe(both)
    assert (first.seen, later.seen, both.seen) == (["begin"], [], ["begin", "end"])


def test_the_upload_guard_refuses_python_data_copied_to_a_gpu_and_nothing_else():
    """``torch.tensor(data, device="cuda")`` copies Python data from pageable memory inside the
    factory, where no aten op shows it; the guard the doctor enters around a CUDA capture refuses it
    with the CPU engine's error (before torch is asked, so this holds on a machine without CUDA).
    Data made on the host, or a tensor already on a device, passes."""
    from workbench.engine.errors import CaptureError
    from workbench.engine.host_sync import UploadGuard
    with UploadGuard():
        with pytest.raises(CaptureError, match="pageable host memory"):
            torch.tensor([0] * 4, dtype=torch.int32, device="cuda")
        with pytest.raises(CaptureError):
            torch.tensor(3, device=torch.device("cuda", 0))
        assert torch.tensor([1, 2], device="cpu").tolist() == [1, 2]
        assert torch.as_tensor(torch.ones(2), device="cpu").shape == (2,)


@pytest.mark.cuda
def test_no_garbage_collection_starts_while_a_cuda_capture_is_open():
    """A collection inside a global-mode capture can finalise a dropped runner's graph, and
    releasing it there invalidates the capture (CUDA says so at the next kernel: "operation failed
    due to a previous error during capture"). With the collector as eager as it can be (a
    collection at every new object), collections run around the captures, none inside one."""
    started = []

    def seen(phase, info):
        if phase == "start":
            started.append(torch.cuda.is_current_stream_capturing())

    threshold = gc.get_threshold()
    gc.callbacks.append(seen)
    gc.set_threshold(1)
    try:
        x = torch.ones(4, device="cuda")
        for _ in range(3):
            g = new_graph("cuda")
            with graph(g, name="size 4"):
                ys = [x * k for k in range(3)]      # Python objects made inside the capture too
            g.replay()
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
    assert started and not any(started), f"{sum(started)} of {len(started)} collections began inside a capture"
    assert ys[2].tolist() == [2.0] * 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_engine_says_a_capture_is_open_on_either_backend(device):
    """``is_capturing()`` answers for a real CUDA capture too: code that skips its host work while
    capturing must skip it on a GPU as on the emulation (on CUDA, a host copy of pageable memory
    inside a capture is refused)."""
    from workbench.engine import is_capturing

    seen = []
    g, x = new_graph(device), torch.ones(3, device=device)
    assert not is_capturing()
    with graph(g):
        seen.append(is_capturing())
        y = x * 2
    g.replay()
    assert seen == [True] and not is_capturing() and y.sum().item() == 6.0


def test_a_replay_while_another_graph_is_capturing_is_refused_as_on_cuda():
    """CUDA refuses every replay while a capture is open ("Cannot prepare for replay during capturing
    stage", probe ``replay_in_capture``): a wrapper replaying its own graph inside an outer capture
    fails at startup there, and must here too, not be recorded into the outer graph."""
    x = torch.ones(2)
    inner, outer = new_graph("cpu"), new_graph("cpu")
    with graph(inner):
        y = x * 2
    with pytest.raises(GraphError, match="Cannot prepare for replay during capturing stage"):
        with graph(outer):
            inner.replay()
    inner.replay()                                  # the capture is over: replays are allowed again
    assert torch.equal(y, x * 2)


@pytest.mark.parametrize("on_freed", ["raise", "reuse"])
def test_a_pool_block_freed_in_place_raises_at_the_next_replay_instead_of_crashing(on_freed):
    """Another graph's output, still held, freed in place (``resize_(0)``: a runtime unmapping graph
    memory it takes for its own) leaves the reading graph with an address and no bytes: its replay
    raises ``IllegalMemoryAccess`` naming the recorded read, as CUDA faults there, and does not run a
    kernel on a storage without memory (which crashed the process)."""
    pool, x = graph_pool_handle("cpu"), torch.ones(3)
    setup = new_graph("cpu", on_freed=on_freed)
    with graph(setup, pool=pool):
        buffer = x * 2
    setup.replay()
    solve = new_graph("cpu", on_freed=on_freed)
    with graph(solve, pool=pool):
        out = buffer + x
    solve.replay()
    assert out.tolist() == [3.0] * 3
    buffer.untyped_storage().resize_(0)
    with pytest.raises(IllegalMemoryAccess, match="freed in place") as e:
        solve.replay()
    assert "out = buffer + x" in str(e.value)
