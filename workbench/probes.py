"""Semantic probes: small experiments whose answers define what a CUDA graph does.

Each probe runs through the engine's one API, so the same code runs on a real
``torch.cuda.CUDAGraph`` and on ``CPUGraph``. ``scripts/gpu_session.py`` records the GPU answers in
``results/gpu/engine_probes.json``; ``tests/test_engine_fidelity.py`` asserts the CPU emulation
gives the same answers. A probe that needs a dead CUDA context runs in a child process.
"""
from __future__ import annotations

import gc

import torch

from .childproc import run_in_child
from .engine import CPUGraph, graph, graph_pool_handle, host, new_graph, reuse_freed_blocks, synchronize


def _values(t: torch.Tensor) -> list:
    return t.detach().cpu().tolist()


def probe_increment(device: str, replays: int = 3) -> dict:
    """``x += 2`` on a buffer that existed before capture: capture itself must not increment."""
    x = torch.zeros(4, device=device)
    g = new_graph(device)
    with graph(g):
        x += 2
    synchronize(device)
    after_capture = _values(x)
    for _ in range(replays):
        g.replay()
    synchronize(device)
    return {"after_capture": after_capture, "after_replays": _values(x), "replays": replays}


def probe_frozen_python(device: str) -> dict:
    """A Python branch taken at capture stays taken at replay, whatever the data says later."""
    flag = {"double": True}
    x = torch.ones(3, device=device)

    def f():
        return x * 2 if flag["double"] else x * 3

    g = new_graph(device)
    with graph(g):
        out = f()
    flag["double"] = False
    x.fill_(5.0)
    g.replay()
    synchronize(device)
    return {"replayed": _values(out), "eager_now": _values(f())}


def probe_lazy_planner(device: str) -> dict:
    """A lazy ``if plan is None`` planner: warmup on the same state leaves the plan out of the graph."""
    lengths = torch.tensor([3.0], device=device)
    x = torch.ones(1, device=device)

    def make():
        state = {"plan": None}

        def f():
            if state["plan"] is None:
                state["plan"] = torch.empty(1, device=device)
                state["plan"].copy_(lengths.max())
            return x * state["plan"]
        return f

    shared = make()
    shared()                                     # warmup plans with lengths=3
    g_shared = new_graph(device)
    with graph(g_shared):
        out_shared = shared()
    fresh_warm = make()
    fresh_warm()
    fresh = make()                               # capture on a fresh state records the planner
    g_fresh = new_graph(device)
    with graph(g_fresh):
        out_fresh = fresh()
    lengths.fill_(7.0)
    g_shared.replay()
    g_fresh.replay()
    synchronize(device)
    return {"shared_state_replay": _values(out_shared), "fresh_state_replay": _values(out_fresh)}


def probe_static_input(device: str) -> dict:
    """New data copied into a static input buffer is what the next replay computes on."""
    static = torch.zeros(4, device=device)
    w = torch.arange(4.0, device=device)
    g = new_graph(device)
    with graph(g):
        out = (static * w).sum(0, keepdim=True)
    results = []
    for k in range(1, 4):
        static.copy_(torch.full((4,), float(k), device=device))
        g.replay()
        synchronize(device)
        results.append(_values(out)[0])
    return {"outputs": results}


def probe_shared_pool(device: str) -> dict:
    """Two graphs in one pool, the second reading the first's output (vLLM's piecewise pieces)."""
    pool = graph_pool_handle(device)
    x = torch.zeros(4, device=device)
    g1, g2 = new_graph(device), new_graph(device)
    with graph(g1, pool=pool):
        y = x + 1
    with graph(g2, pool=pool):
        z = y * 10
    outs = []
    for k in range(3):
        x.fill_(float(k))
        g1.replay()
        g2.replay()
        synchronize(device)
        outs.append(_values(z)[0])
    return {"outputs": outs}


# 32 MiB: a block of its own in CUDA's large pool, so empty_cache() can return it to the driver.
_SHAPE = (8192, 1024)


def _weight(device: str) -> torch.Tensor:
    # Built on the host and copied over in one allocation: device-side temporaries would leave
    # cached blocks that the freed tensor could share a segment with, which empty_cache() keeps.
    return ((torch.arange(_SHAPE[0] * _SHAPE[1]) % 1000).float().reshape(_SHAPE) / 1000).to(device)


def _freed_reuse(device: str) -> dict:
    """The gathered-temporary pattern: a graph reads ``w[idx]`` where ``w`` is a temporary."""
    base = _weight(device)
    idx = torch.tensor([1, 2], device=device)
    w = base * 1.0                                        # a temporary only this frame holds
    g = new_graph(device, on_freed="reuse")
    with graph(g):
        out = w[idx].sum(1)
    g.replay()
    synchronize(device)
    alive = _values(out)
    del w
    with reuse_freed_blocks():
        junk = torch.full(_SHAPE, 5.0, device=device)     # same size: the allocator hands the block on
    g.replay()
    synchronize(device)
    result = {"alive": alive, "after_reuse": _values(out)}
    del junk
    return result


def _freed_release(device: str) -> dict:
    base = _weight(device)
    idx = torch.tensor([1, 2], device=device)
    w = base * 1.0
    g = new_graph(device)
    with graph(g):
        out = w[idx].sum(1)
    del w
    if device == "cuda":
        torch.cuda.empty_cache()
    g.replay()
    synchronize(device)
    return {"replayed": _values(out)}


def probe_freed_input(device: str) -> dict:
    """Both outcomes of a freed referenced tensor: reused block (wrong values), released (crash)."""
    reuse = _freed_reuse(device)
    child = run_in_child(_freed_release, device, timeout=300) if device == "cuda" else None
    if child is None:
        try:
            _freed_release(device)
            release = {"crashed": False, "error": ""}
        except Exception as e:  # noqa: BLE001 - the outcome is the data
            release = {"crashed": True, "error": f"{type(e).__name__}: {e}"}
    else:
        release = {"crashed": not child.ok, "error": f"{child.error_type}: {child.error}"}
    release["illegal_memory_access"] = "illegal memory access" in release["error"].lower() or \
        "IllegalMemoryAccess" in release["error"]
    return {"reuse": reuse, "release": release}


def probe_host_sync(device: str) -> dict:
    """``.item()`` inside capture fails on both backends (on CUDA in a child: it breaks the capture)."""
    if device == "cuda":
        return run_in_child(_host_sync, device, timeout=300).raise_if_failed()
    return _host_sync(device)


def _host_sync(device: str) -> dict:
    x = torch.ones(2, device=device)
    g = new_graph(device)
    try:
        with graph(g):
            x.sum().item()
        return {"raised": False}
    except Exception:  # noqa: BLE001 - CUDA raises a RuntimeError, the CPU a CaptureError
        return {"raised": True}


def probe_capture_query(device: str) -> dict:
    """``torch.cuda.is_current_stream_capturing()`` as libraries ask it: True on the capturing
    thread only, for the duration of the capture (on CUDA in a child: a query from another thread
    during a global-mode capture could invalidate it, and the record then says so)."""
    if device == "cuda":
        child = run_in_child(_capture_query, device, timeout=300)
        return child.value if child.ok else {"error": f"{child.error_type}: {child.error}"}
    return _capture_query(device)


def _capture_query(device: str) -> dict:
    import threading
    seen = {}
    x = torch.zeros(2, device=device)
    g = new_graph(device)
    with graph(g):
        seen["inside"] = torch.cuda.is_current_stream_capturing()
        other = threading.Thread(target=lambda: seen.update(other_thread=_query()))
        other.start()
        other.join()
        x.add_(1)
    seen["after"] = _query()
    return seen


def _query() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - a CPU-only torch has no CUDA runtime to ask: not capturing
        return False


def probe_host_memory(device: str) -> dict:
    """Host memory inside a capture: host work runs once at capture, ``.tolist()`` of it is legal,
    a captured host-to-device copy re-reads the host buffer at every replay, and a device op given
    host memory raises."""
    staging = host(torch.zeros(2), device)
    lens = host(torch.tensor([3, 5]), device)
    dev = torch.zeros(2, device=device)
    g = new_graph(device)
    with graph(g):
        staging += 1
        longest = max(lens.tolist())
        dev.copy_(staging, non_blocking=True)
        out = dev * 2
    synchronize(device)
    after_capture = _values(staging)
    g.replay()
    g.replay()
    synchronize(device)
    after_replays = _values(staging)
    staging.fill_(10.0)
    g.replay()
    synchronize(device)
    try:
        dev + staging
        mix = "allowed"
    except RuntimeError:
        mix = "raised"
    return {"host_after_capture": after_capture, "host_after_two_replays": after_replays,
            "tolist_longest": longest, "copy_rereads_host": _values(out), "device_op_on_host": mix}


def probe_host_made_in_capture(device: str) -> dict:
    """Pinned host memory made inside a capture and dropped at once (a staging buffer): the
    captured copy keeps the host address, so once the caching host allocator hands the block to the
    next host allocation of that size, replays copy that allocation's data. On CUDA in a child:
    pinning inside a capture may break it, and the record then says so (torch versions whose host
    allocator keeps capture-time blocks for the graph answer with the first values twice)."""
    if device == "cuda":
        child = run_in_child(_host_made_in_capture, device, timeout=300)
        return child.value if child.ok else {"error": child.error_type}
    return _host_made_in_capture(device)


def _host_made_in_capture(device: str) -> dict:
    x = torch.arange(4.0, device=device) * 10
    index = torch.zeros(4, dtype=torch.int64, device=device)
    g = new_graph(device, on_freed="reuse")
    with graph(g):
        index.copy_(host(torch.tensor([3, 1, 2, 0]), device), non_blocking=True)
        out = x.index_select(0, index)
    g.replay()
    synchronize(device)
    first = _values(out)
    with reuse_freed_blocks():
        later = host(torch.tensor([0, 0, 1, 1]), device)
    g.replay()
    synchronize(device)
    return {"first": first, "after_next_host_allocation": _values(out), "later": _values(later)}


def probe_recapture_pool(device: str) -> dict:
    """Graph B reads graph A's output, both in one pool; A and its output are dropped and A is
    re-captured: the pool hands A's freed block to the new output, so B reads it."""
    pool = graph_pool_handle(device)
    inp = torch.full((4,), 5.0, device=device)
    g_a, g_b = new_graph(device), new_graph(device)
    with graph(g_a, pool=pool):
        a = inp - 2
    with graph(g_b, pool=pool):
        b = a + 1
    del g_a, a
    g_a2 = new_graph(device)
    with graph(g_a2, pool=pool):
        inp * 2
    g_a2.replay()
    g_b.replay()
    synchronize(device)
    return {"b_reads": _values(b)[0]}


def probe_freed_in_capture(device: str) -> dict:
    """Memory freed inside a capture is given to a later allocation of the same capture."""
    x = torch.ones(256, device=device)
    g = new_graph(device)
    with graph(g):
        first = x * 2
        address = first.data_ptr()
        y = first + 1
        del first
        second = x * 3
        reused = second.data_ptr() == address
        z = second + y
    g.replay()
    synchronize(device)
    return {"reused": reused, "replayed": _values(z)[0]}


def probe_shared_retained(device: str) -> dict:
    """Two graphs referencing one freed address read the same later allocation (one block)."""
    w = _weight(device) * 1.0
    idx = torch.tensor([1, 2], device=device)
    graphs, outs = [], []
    for _ in range(2):
        g = new_graph(device, on_freed="reuse")
        with graph(g):
            outs.append(w[idx].sum(1))
        graphs.append(g)
    del w
    with reuse_freed_blocks():
        junk = torch.full(_SHAPE, 5.0, device=device)
    for g in graphs:
        g.replay()
    synchronize(device)
    result = {"first": _values(outs[0]), "second": _values(outs[1])}
    del junk
    return result


def probe_op_trace(device: str) -> dict:
    """The aten ops a capture records: those the code ran, no more (no extra ``detach``); on CUDA
    the ops a dispatch logger sees during the real capture, on the CPU the graph's ``ops``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4).to(device)
    x = torch.ones(2, 4, device=device)
    g = new_graph(device)
    with torch.inference_mode():
        layer(x).relu()                    # warmup: cuBLAS sets up its handle outside the capture
        with graph(g), Log() as log:
            (layer(x).relu() + torch.full((1,), 1.0, device=device)).detach()
    ops = [op.name for op in g.ops] if isinstance(g, CPUGraph) else log.ops
    return {"ops": ops}


def probe_batch_norm_stats(device: str) -> dict:
    """``F.batch_norm`` in training updates its running statistics in place, though the op's schema
    does not mark them written: capture must not update them, each replay must."""
    mean, var = torch.zeros(3, device=device), torch.ones(3, device=device)
    x = torch.arange(12.0, device=device).reshape(4, 3) / 4
    g = new_graph(device)
    with graph(g):
        torch.nn.functional.batch_norm(x, mean, var, training=True, momentum=0.5)
    synchronize(device)
    after_capture = _values(mean)
    g.replay()
    synchronize(device)
    return {"mean_after_capture": after_capture, "mean_after_replay": [round(v, 4) for v in _values(mean)]}


POOL_REUSE = ("empty_first", "two_graphs_one_reset", "reset", "del", "del_outputs_too", "del_all_empty_cache",
              "del_empty_cache_output_held")


def probe_pool_handle_reuse(device: str) -> dict:
    """A pool handle used again after graphs captured into it were reset or dropped: CUDA's caching
    allocator refuses it while the pool's last graph is gone and memory it allocated is still held
    (an output), and starts a new pool once all of it is free, ``empty_cache`` or not. Each
    scenario in a child process on CUDA (the refusal is an internal assert)."""
    if torch.device(device).type == "cuda":
        return {name: (r.value if r.ok else f"refused: child {r.error_type}")
                for name in POOL_REUSE for r in [run_in_child(_pool_reuse, name, device, timeout=120)]}
    return {name: _pool_reuse(name, device) for name in POOL_REUSE}


def _pool_reuse(name: str, device: str) -> str:
    pool = graph_pool_handle(device)
    x = torch.ones(4, device=device)

    def captured(scale):
        g = new_graph(device)
        with graph(g, pool=pool):
            out = x * scale
        return g, out
    try:
        if name == "empty_first":
            g0 = new_graph(device)
            with graph(g0, pool=pool):
                pass
            g0.reset()
            del g0
        else:
            g1, out1 = captured(2)
            if name == "two_graphs_one_reset":
                g2, out2 = captured(3)          # noqa: F841 - kept alive: the pool keeps a graph
                g1.reset()
            elif name == "reset":
                g1.reset()
            elif name in ("del_outputs_too", "del_all_empty_cache"):
                del out1
            del g1
            gc.collect()
            if name in ("del_all_empty_cache", "del_empty_cache_output_held") and torch.device(device).type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        g, _ = captured(5)
        g.replay()
        synchronize(device)
        return "ok"
    except RuntimeError as e:                   # CUDA: INTERNAL ASSERT use_count > 0; CPU: GraphError
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


PROBES = {
    "increment": probe_increment,
    "frozen_python": probe_frozen_python,
    "lazy_planner": probe_lazy_planner,
    "static_input": probe_static_input,
    "shared_pool": probe_shared_pool,
    "freed_input": probe_freed_input,
    "host_sync": probe_host_sync,
    "capture_query": probe_capture_query,
    "host_memory": probe_host_memory,
    "host_made_in_capture": probe_host_made_in_capture,
    "recapture_pool": probe_recapture_pool,
    "freed_in_capture": probe_freed_in_capture,
    "shared_retained": probe_shared_retained,
    "op_trace": probe_op_trace,
    "batch_norm_stats": probe_batch_norm_stats,
    "pool_handle_reuse": probe_pool_handle_reuse,
}


def run_all(device: str) -> dict:
    """Every probe's answer on ``device``, keyed by probe name."""
    return {name: probe(device) for name, probe in PROBES.items()}


def comparable(answers: dict) -> dict:
    """The part of the answers both backends must agree on exactly (error texts differ)."""
    out = {k: v for k, v in answers.items() if k != "freed_input"}
    if "pool_handle_reuse" in answers:        # refused or not (the errors' texts differ)
        out["pool_handle_reuse"] = {k: v == "ok" for k, v in answers["pool_handle_reuse"].items()}
    if "freed_input" not in answers:
        return out
    freed = answers["freed_input"]
    out["freed_input"] = {
        "reuse_alive": [round(v, 2) for v in freed["reuse"]["alive"]],   # sum order differs in last bits
        "reuse_values_changed": freed["reuse"]["after_reuse"] != freed["reuse"]["alive"],
        "release_crashed": freed["release"]["crashed"],
        "release_is_illegal_memory_access": freed["release"]["illegal_memory_access"],
    }
    return out
