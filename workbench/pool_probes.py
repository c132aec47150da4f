"""Probes of graph-pool memory: which memory a graph owns, when its pool hands a block on, when a
pool's handle is refused. Part of the engine's semantic probes (``workbench.probes``), run the same
way on a real ``torch.cuda.CUDAGraph`` and on ``CPUGraph``.
"""
from __future__ import annotations

import gc

import torch

from .childproc import run_in_child
from .engine import graph, graph_pool_handle, new_graph, reuse_freed_blocks, synchronize


def _values(t: torch.Tensor) -> list:
    return t.detach().cpu().tolist()


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


def _freed_reuse(device: str, free=list.clear) -> dict:
    """The gathered-temporary pattern: a graph reads ``w[idx]`` where ``w`` is a temporary; ``free``
    lets its memory go (by default the list that alone holds it drops it)."""
    base = _weight(device)
    idx = torch.tensor([1, 2], device=device)
    held = [base * 1.0]                                   # a temporary only this list holds
    g = new_graph(device, on_freed="reuse")
    with graph(g):
        out = held[0][idx].sum(1)
    g.replay()
    synchronize(device)
    alive = _values(out)
    free(held)
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


def probe_freed_in_place(device: str) -> dict:
    """A storage the graph reads is freed in place (``untyped_storage().resize_(0)``; the tensor
    object stays): the graph keeps the old address, which the allocator hands to the next
    allocation of its size, as after a release."""
    result = _freed_reuse(device, lambda held: held[0].untyped_storage().resize_(0))
    return {**result, "alive": [round(v, 2) for v in result["alive"]]}     # (sum order differs in the last bits)


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


POOL_REUSE = ("empty_first", "two_graphs_one_reset", "reset", "del", "del_outputs_too", "del_all_empty_cache",
              "del_empty_cache_output_held", "first_dropped_output_held")


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
            elif name == "first_dropped_output_held":    # g1 goes first, its output held; then g2, with its
                g2, out2 = captured(3)                  # output: the pool's graphs are gone, out1 still holds
                del g1                                  # a block the pool allocated
                gc.collect()
                g1, g2, out2 = g2, None, None
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
