"""Inductor's cudagraph partitioning puts ``aten._linalg_eigh`` inside a captured partition: its info check syncs.

Upstream: https://github.com/pytorch/pytorch/pull/188641 ("Mark linalg.eigh as cudagraph-unsafe in Inductor"),
fixing https://github.com/pytorch/pytorch/issues/188355 ("[Inductor][CUDA Graphs] max-autotune attempts to capture
torch.linalg.eigh and crashes with cudaErrorStreamCaptureUnsupported").
Symptom: ``torch.compile(mode="max-autotune")`` of a ``matmul -> torch.linalg.eigh`` function runs iteration 1
(the cudagraph-trees warmup) and fails on iteration 2, inside ``cudagraph_trees._record`` ->
``partition_0`` -> ``buf1 = torch.ops.aten._linalg_eigh.default(buf0)``, with ``torch.AcceleratorError: CUDA error:
operation not permitted when stream is capturing``; eager and ``max-autotune-no-cudagraphs`` run fine.
Mechanism: ``torch.linalg.eigh`` lowers to the fallback kernel ``aten._linalg_eigh.default``. Graph partitioning
(``Scheduler.should_partition``) only splits around nodes that ``is_cudagraph_unsafe_op`` reports (ops in
``FORBIDDEN_CUDAGRAPH_OPS``, ops tagged ``cudagraph_unsafe``, ...); ``_linalg_eigh`` was in neither, so it landed in
``partition_0`` next to the matmul and was recorded by cudagraph trees. Its CUDA implementation (cuSOLVER
``syevd``) checks the solver's device-side ``infos`` from the host (``_linalg_check_errors``, an ``.item()`` read),
which a capturing stream refuses. Here ``_linalg_eigh`` computes with ``torch.linalg.eigh`` and performs that info
check explicitly: the stand-in for the host read inside the cuSOLVER path (on CUDA the real op may refuse first).
Doctor: sync-in-capture, at ``_linalg_check_errors`` (the host read of the eigensolver's ``infos`` during the capture
of ``partition_0``).
Fix (upstream): ``aten._linalg_eigh.default`` is added to Inductor's cudagraph-unsafe op set, so both the whole-graph
skip check and graph partitioning keep it out of capture: the graph becomes ``partition_0`` (matmul, captured),
``_linalg_eigh`` run eagerly, ``partition_1`` (captured). Only the PR description and the issue were read, not the
diff; the name of the set it extends (``FORBIDDEN_CUDAGRAPH_OPS``) is taken from Inductor's ``utils.py``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/188641"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_linalg_check_errors"
SYMPTOM = "max-autotune fails on iteration 2: cudaErrorStreamCaptureUnsupported while recording _linalg_eigh"
N, DIM, ITERS = 5, 4, 4


# ----------------------------------------------------------------------------- the fallback kernel
def _linalg_check_errors(infos: torch.Tensor, api_name: str, is_matrix: bool) -> None:
    """at::_linalg_check_errors: read the solver's device-side info on the host and raise on failure."""
    info = int(infos.item()) if is_matrix else int(infos.max().item())
    if info > 0:
        raise torch.linalg.LinAlgError(f"{api_name}: the algorithm failed to converge ({info} elements)")


def _linalg_eigh(A: torch.Tensor, UPLO: str = "L", compute_v: bool = True):
    """aten._linalg_eigh.default on CUDA: cuSOLVER syevd writes ``infos`` on the device, then the host checks it."""
    L, V = torch.linalg.eigh(A, UPLO=UPLO)
    infos = (~torch.isfinite(L)).sum(-1, dtype=torch.int32)      # syevd's info: elements that did not converge
    _linalg_check_errors(infos, "linalg.eigh", is_matrix=A.dim() == 2)
    return L, V


# ----------------------------------------------------------------------------- the lowered graph
@dataclasses.dataclass
class FxNode:
    name: str
    target: str                                        # the op overload, as is_cudagraph_unsafe_fx_node sees it
    fn: Callable
    args: tuple[str, ...]


def scale_then_gram(x, w):                             # extern mm + triton_poi_fused: buf0 = (x @ w).T @ (x @ w) / N
    y = x @ w
    return y.t() @ y / y.shape[0] + 0.1 * torch.eye(y.shape[1], device=y.device)


def whiten(x, L, V):                                   # extern mm + triton_poi_fused: x projected on the eigenbasis
    return (x @ V) * torch.rsqrt(L)


NODES = [
    FxNode("buf0", "aten.mm.default", scale_then_gram, ("x", "w")),
    FxNode("buf1", "aten._linalg_eigh.default", _linalg_eigh, ("buf0",)),
    FxNode("buf2", "aten.mm.default", whiten, ("x", "buf1_0", "buf1_1")),
]


def get_cudagraph_unsafe_ops(variant: str) -> frozenset[str]:
    """FORBIDDEN_CUDAGRAPH_OPS (torch/_inductor/utils.py); the fix adds ``aten._linalg_eigh.default``."""
    ops = {"aten._fused_moving_avg_obs_fq_helper.default", "run_and_save_rng_state", "run_with_rng_state",
           "aten._local_scalar_dense", "aten._assert_scalar"}
    if variant == "fix":
        ops.add("aten._linalg_eigh.default")
    return frozenset(ops)


def should_partition(node: FxNode, variant: str) -> bool:
    """Scheduler.should_partition: a cudagraph-unsafe node gets its own, non-cudagraphed, partition."""
    return node.target in get_cudagraph_unsafe_ops(variant)


def graph_partition(nodes, variant):
    """Split the node list into ("cudagraph", nodes) partitions and ("eager", [node]) for unsafe nodes."""
    parts, current = [], []
    for node in nodes:
        if should_partition(node, variant):
            if current:
                parts.append(("cudagraph", current))
                current = []
            parts.append(("eager", [node]))
        else:
            current.append(node)
    if current:
        parts.append(("cudagraph", current))
    return parts


def run_nodes(nodes, env):
    for node in nodes:
        out = node.fn(*(env[a] for a in node.args))
        if isinstance(out, tuple):
            env.update({f"{node.name}_{i}": t for i, t in enumerate(out)})
        else:
            env[node.name] = out


def partition_outputs(nodes):
    names = []
    for node in nodes:
        names += [f"{node.name}_0", f"{node.name}_1"] if node.target == "aten._linalg_eigh.default" else [node.name]
    return names


# ----------------------------------------------------------------------------- cudagraph trees, one node per partition
class CUDAGraphNode:
    """Warm up on the first call, record on the second (then replay), replay afterwards."""

    def __init__(self, name, nodes, input_names, device, pool):
        self.name, self.nodes, self.input_names = name, nodes, input_names
        self.output_names = partition_outputs(nodes)
        self.device, self.pool, self.calls = device, pool, 0
        self.graph = self.static_inputs = self.static_outputs = None

    def _model(self, inputs):
        env = dict(zip(self.input_names, inputs))
        run_nodes(self.nodes, env)
        return tuple(env[n] for n in self.output_names)

    def __call__(self, inputs):
        self.calls += 1
        if self.calls == 1:                       # CUDAWarmupNode: run eagerly, hand out its outputs
            with events.warmup(real=True):
                return self._model(inputs)
        if self.graph is None:                    # _record: copy inputs to static places, capture, replay
            self.static_inputs = [t.clone() for t in inputs]
            self.graph, self.static_outputs = capture(
                lambda: self._model(self.static_inputs), device=self.device, pool=self.pool, warmups=0,
                name=self.name, static=dict(zip(self.input_names, self.static_inputs)),
                owner="CUDAGraphTreeManager")
        else:
            for static, t in zip(self.static_inputs, inputs):
                static.copy_(t)
        return replay(self.graph, self.static_outputs)


class CompiledGraph:
    """The output code: partitions run in order; cudagraph-unsafe nodes run eagerly between them."""

    def __init__(self, variant, device):
        pool = graph_pool_handle(device)
        self.parts = []
        for i, (kind, nodes) in enumerate(graph_partition(NODES, variant)):
            needed = sorted({a for n in nodes for a in n.args} - set(partition_outputs(nodes)))
            runner = CUDAGraphNode(f"partition_{i}", nodes, needed, device, pool) if kind == "cudagraph" else None
            self.parts.append((nodes, needed, runner))

    def __call__(self, x, w):
        env = {"x": x, "w": w}
        for nodes, needed, runner in self.parts:
            if runner is None:
                run_nodes(nodes, env)
            else:
                env.update(zip(partition_outputs(nodes), runner([env[a] for a in needed])))
        return env["buf2"].clone(), env["buf1_0"].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(188641)
    w = randn(DIM, DIM, gen=gen, device=device)
    xs = [randn(N, DIM, gen=gen, device=device) for _ in range(ITERS)]

    def eager():
        out = []
        for x in xs:
            env = {"x": x, "w": w}
            run_nodes(NODES, env)
            out += [env["buf2"], env["buf1_0"]]
        return out

    def served():
        compiled = CompiledGraph(variant, device)
        out = []
        for x in xs:
            out += list(compiled(x, w))
        return out

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
