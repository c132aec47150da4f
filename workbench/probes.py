"""Semantic probes: small experiments whose answers define what a CUDA graph does.

Each probe runs through the engine's one API, so the same code runs on a real
``torch.cuda.CUDAGraph`` and on ``CPUGraph``. ``scripts/gpu_session.py`` records the GPU answers in
``results/gpu/engine_probes.json``; ``tests/test_engine_fidelity.py`` asserts the CPU emulation
gives the same answers. A probe that needs a dead CUDA context runs in a child process. The probes
of graph-pool memory are in ``workbench.pool_probes``, those of host data meeting device memory in
``workbench.host_data_probes``, those of other threads in ``workbench.thread_probes``.
"""
from __future__ import annotations

import torch

from .childproc import on_cuda_in_child, run_in_child
from .engine import CPUGraph, graph, host, new_graph, reuse_freed_blocks, synchronize
from .pool_probes import (_values, probe_freed_in_capture, probe_freed_in_place, probe_freed_input,
                          probe_pool_handle_reuse, probe_recapture_pool, probe_shared_pool, probe_shared_retained)
from .host_data_probes import probe_host_copy, probe_mask_assign, probe_python_data, probe_python_into_host
from .thread_probes import probe_other_thread


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


def probe_host_sync(device: str) -> dict:
    """``.item()`` inside capture fails on both backends."""
    return on_cuda_in_child(_host_sync, device)


def _host_sync(device: str) -> dict:
    x = torch.ones(2, device=device)
    g = new_graph(device)
    try:
        with graph(g):
            x.sum().item()
        return {"raised": False}
    except Exception:  # noqa: BLE001 - CUDA raises a RuntimeError, the CPU a CaptureError
        return {"raised": True}


def probe_replay_in_capture(device: str) -> dict:
    """A graph replayed while another graph's capture is open (a wrapper that replays its own graph
    inside an outer capture) is refused on both backends."""
    return on_cuda_in_child(_replay_in_capture, device)


def _replay_in_capture(device: str) -> dict:
    x = torch.ones(2, device=device)
    inner, outer = new_graph(device), new_graph(device)
    with graph(inner):
        y = x * 2
    try:
        with graph(outer):
            inner.replay()
            y + 1
        return {"refused": False}
    except Exception:  # noqa: BLE001 - CUDA raises a RuntimeError, the CPU a GraphError
        return {"refused": True}


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


def probe_host_from_reused_block(device: str) -> dict:
    """Two launches in one capture, each building its arguments in pinned memory made from a fresh
    CPU tensor and copying them to a device buffer it then drops. The second CPU tensor must not
    share memory with the first launch's device buffer (the CPU emulation may place a capture-time
    factory's output in a pool block an earlier temporary left): replays give both launches' own
    arguments. On CUDA in a child, as pinning inside a capture may break it."""
    if device == "cuda":
        child = run_in_child(_host_from_reused_block, device, timeout=300)
        return child.value if child.ok else {"error": child.error_type}
    return _host_from_reused_block(device)


def _host_from_reused_block(device: str) -> dict:
    table, kept = torch.arange(12.0, device=device).view(4, 3), []

    def launch(row: int, factor: int):
        args = host(torch.zeros(2, dtype=torch.int64), device)
        kept.append(args)
        args.numpy()[:] = (row, factor)                  # a host store
        dev = torch.empty(2, dtype=torch.int64, device=device)
        dev.copy_(args, non_blocking=True)
        return table.index_select(0, dev[:1])[0] * dev[1]

    g = new_graph(device)
    with graph(g):
        a, b = launch(1, 2), launch(3, 5)
    g.replay()
    synchronize(device)
    return {"first": _values(a), "second": _values(b), "arguments": [k.tolist() for k in kept]}


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


PROBES = {
    "increment": probe_increment,
    "frozen_python": probe_frozen_python,
    "lazy_planner": probe_lazy_planner,
    "static_input": probe_static_input,
    "shared_pool": probe_shared_pool,
    "freed_input": probe_freed_input,
    "freed_in_place": probe_freed_in_place,
    "host_sync": probe_host_sync,
    "replay_in_capture": probe_replay_in_capture,
    "capture_query": probe_capture_query,
    "host_memory": probe_host_memory,
    "host_made_in_capture": probe_host_made_in_capture,
    "host_from_reused_block": probe_host_from_reused_block,
    "recapture_pool": probe_recapture_pool,
    "freed_in_capture": probe_freed_in_capture,
    "shared_retained": probe_shared_retained,
    "op_trace": probe_op_trace,
    "batch_norm_stats": probe_batch_norm_stats,
    "pool_handle_reuse": probe_pool_handle_reuse,
    "mask_assign": probe_mask_assign,
    "host_copy": probe_host_copy,
    "python_data": probe_python_data,
    "python_into_host": probe_python_into_host,
    "other_thread": probe_other_thread,
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
