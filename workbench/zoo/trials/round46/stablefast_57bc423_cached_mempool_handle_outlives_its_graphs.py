"""stable-fast's per-device graph env caches a pool handle that no live graph holds: re-graphing asserts.

Upstream: https://github.com/chengzeyi/stable-fast/commit/57bc423c4445dd6ef4d895101ba1d7efcb36bb21 ("fix use_count
of mempool becoming zero", a commit on the default branch; no PR). Diff read (``sfast/cuda/graphs.py`` at the
parent commit and the fix, and the new ``tests/cuda/test_graphs.py``).
Symptom: ``RuntimeError: it->second->use_count > 0 INTERNAL ASSERT FAILED at
"../c10/cuda/CUDACachingAllocator.cpp"`` raised from ``capture_begin`` when a callable is graphed again after
every earlier graphed callable was dropped (the new test: graph ``add``, capture a tensor from the env's pool,
``del graphed_add, tmp_graph``, ``gc.collect()``, graph ``add`` again; here the two are dropped one after the
other, ``tmp_graph`` last, which the allocator sees the same way).
Mechanism: ``get_per_device_graph_execution_env`` creates one ``GraphExecutionEnv`` per device, with one
``mempool = torch.cuda.graphs.graph_pool_handle()``, and caches it for the process; every
``make_graphed_callable`` captures its ``tmp_graph`` (the static inputs) and its ``fwd_graph`` with
``pool=execution_env.mempool``. The caching allocator counts the graphs that use a private pool; when the last
of them is destroyed while memory the pool allocated is still held, the pool's use count is 0 and it waits to
be freed, but the env still hands out its id, and the next capture into it hits the allocator's
``use_count > 0`` assert. Here the pool memory still held is the tensor ``x`` allocated inside a capture into
the env's pool, as in the upstream test.
Doctor: dangling-reference, at ``make_graphed_callable`` (its capture uses the env's cached pool handle after
the pool's last owning graph was released).
Fix (upstream): ``GraphExecutionEnv.__init__`` captures an empty ``torch.cuda.CUDAGraph()`` into ``self.mempool``
and keeps it as ``self.graph`` ("Hold a live graph to the mempool so that it has a non-zero use_count").
(``shadow_copy`` (``sfast._C._create_shadow_tensor``) is the identity here; device, stream and lock plumbing
kept only where it shapes the flow; the warmup runs on the current stream. Upstream copies the example inputs
inside ``tmp_graph`` with ``copy.deepcopy``; here with stable-fast's own ``tree_copy`` (``clone``), the same
allocation from the pool: the CPU emulation does not support a deepcopy inside a capture.)
"""
from __future__ import annotations

import copy
import gc
import threading

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/chengzeyi/stable-fast/commit/57bc423c4445dd6ef4d895101ba1d7efcb36bb21"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "make_graphed_callable"
SYMPTOM = "graphing again after all graphed callables were dropped: INTERNAL ASSERT use_count > 0 at capture"

N = 3
_per_device_execution_envs: dict = {}
_per_device_execution_envs_lock = threading.Lock()


class GraphExecutionEnv:
    def __init__(self, *, mempool, device, lock=None, variant="bug"):
        self.mempool = mempool
        self.device = device
        self.lock = threading.Lock() if lock is None else lock
        if variant == "fix":
            g = new_graph(device)
            with graph(g, pool=self.mempool, name="GraphExecutionEnv.graph"):
                pass
            # Hold a live graph to the mempool so that it has a non-zero use_count
            self.graph = g


def get_per_device_graph_execution_env(device, variant):
    with _per_device_execution_envs_lock:
        if device not in _per_device_execution_envs:
            mempool, lock = graph_pool_handle(device), threading.Lock()
            _per_device_execution_envs[device] = GraphExecutionEnv(mempool=mempool, device=device, lock=lock,
                                                                   variant=variant)
        return _per_device_execution_envs[device]


def tree_copy_(dest, src):
    if isinstance(dest, torch.Tensor):
        dest.copy_(src)
    elif isinstance(dest, (list, tuple)):
        assert len(dest) == len(src)
        for x, y in zip(dest, src):
            tree_copy_(x, y)
    else:
        assert dest == src


def tree_copy(src):
    if isinstance(src, torch.Tensor):
        return src.clone()
    elif isinstance(src, (list, tuple)):
        return type(src)(tree_copy(x) for x in src)
    else:
        return src


def shadow_copy(obj):
    return obj


def simple_make_graphed_callable(callable, example_inputs, variant):
    device = str(example_inputs[0].device)
    execution_env = get_per_device_graph_execution_env(device, variant)
    return make_graphed_callable(callable, example_inputs, execution_env=execution_env)


def make_graphed_callable(callable, example_inputs, *, execution_env):
    # Warmup
    with events.warmup():
        for _ in range(3):
            callable(*copy.deepcopy(example_inputs))

    tmp_graph = new_graph(execution_env.device)
    with execution_env.lock:
        with graph(tmp_graph, pool=execution_env.mempool, name="tmp_graph (static inputs)"):
            static_inputs_ = tree_copy(example_inputs)
    static_inputs = shadow_copy(static_inputs_)

    with execution_env.lock:
        fwd_graph, static_outputs = capture(lambda: callable(*static_inputs), device=execution_env.device,
                                            pool=execution_env.mempool, warmups=0, name="fwd_graph",
                                            owner="sfast _GraphedModule",
                                            static={f"static_inputs[{i}]": t for i, t in enumerate(static_inputs)})
    static_outputs = shadow_copy(static_outputs)
    del tmp_graph, static_inputs_

    class _GraphedModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.callable = callable        # Hold a reference to the callable so it doesn't get GC'd

        def forward(self, *inputs):
            with execution_env.lock:
                outputs = self._forward(*inputs)
                outputs = copy.deepcopy(outputs)
            return outputs

        def _forward(self, *inputs):
            tree_copy_(static_inputs, inputs)
            return replay(fwd_graph, static_outputs)

    _graphed_module = _GraphedModule()

    def functionalized(*user_args):
        return _graphed_module(*user_args)

    return functionalized


def add(x, y):
    return x + y


def run(variant: str, device: str = "cpu"):
    gen = generator(57)
    x0, y0, x1, y1 = (randn(N, gen=gen, device=device) for _ in range(4))

    def served():
        _per_device_execution_envs.clear()
        outs = []
        x, y = x0.clone(), y0.clone()
        graphed_add = simple_make_graphed_callable(add, (x, y), variant)
        outs.append(graphed_add(x, y))
        # A tensor allocated from the env's pool, kept by the caller (as stable-fast's static inputs are).
        execution_env = get_per_device_graph_execution_env(str(x.device), variant)
        tmp_graph = new_graph(device)
        with graph(tmp_graph, pool=execution_env.mempool, name="user tmp_graph"):
            x = torch.empty(N, device=device)
        x.copy_(x1)
        del graphed_add                     # the graphed callable is dropped (its graphs die with it) ...
        gc.collect()
        del tmp_graph                       # ... and so is the user's: every graph of the pool is gone
        gc.collect()
        graphed_add = simple_make_graphed_callable(add, (x, y1), variant)
        outs.append(graphed_add(x, y1))
        outs.append(graphed_add(y1, x0))
        return outs

    def eager():
        x = torch.empty(N, device=device)
        x.copy_(x1)
        return [add(x0, y0), add(x, y1), add(y1, x0)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
