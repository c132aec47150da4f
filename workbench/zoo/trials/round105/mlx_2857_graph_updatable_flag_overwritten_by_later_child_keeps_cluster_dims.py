"""MLX's CUDA backend decides per command buffer whether its cached cudaGraphExec may be updated in place, but
``add_graph_node`` overwrote that decision with each child graph's own: a cuBLASLt split-K GEMM whose clustered
kernel makes its child non-updatable is forgotten as soon as the next GEMM's child is added, so a later eval updates
the cached executable in place and its split-K kernel keeps the cluster shape it was instantiated with.

Upstream: https://github.com/ml-explore/mlx/pull/2857 ("Fix graph updating", ml-explore/mlx, by awni (Awni Hannun),
opened 2025-12-03, reviewed by zcbenz, merged as commit 193cdcd81; parent d8ceae7b7).
Read: the PR description ("Fix updating property to accumulate correctly over the graph (that was a bug)"; "Enable a
structure like graph -> graph -> kernel node to be potentially updatable. This comes up with cudnn"; pre-training
speed 106511 -> 112456 tok/s on B200) and zcbenz's comment (cuDNN frontend wraps its graph in a child graph); the
commit's diff of ``mlx/backend/cuda/device.cpp``: ``add_graph_node`` now does ``is_graph_updatable_ &=
is_graph_updatable(child, cluster_dim_x)`` instead of ``=``, and ``is_graph_updatable`` recurses into a lone child
graph node. At the parent: ``device.cpp`` (``CaptureContext``, ``add_graph_node``, ``is_graph_updatable``: only
kernel nodes, cluster only along x, a clustered kernel must be its child's only node, ``cluster_dim_x`` set only
past those checks; ``insert_graph_dependencies`` with ``graph_nodes_key_``/``graph_deps_key_``; ``commit``:
``!is_graph_updatable_`` instantiates a fresh executable, otherwise ``graph_cache_`` by key and
``cudaGraphExecUpdate``, a failed update re-instantiates; ``is_graph_updatable_ = true`` after each commit) and
``gemms/cublas_gemm.cpp`` (``CublasGemm::run``/``execute``: heuristic once, workspace from ``cu::malloc_async``
when ``workspaceSize > 0``, ``cublasLtMatmul`` under ``encoder.capture_context()``). #2813 (the cluster key and
``is_graph_updatable`` itself) is the earlier fix this one completes.
Symptom: the PR reports none beyond "that was a bug"; what it leads to, as modelled: on B200-class GPUs (cuBLASLt
picks cluster-launched split-K kernels) an eval holding two GEMMs returns wrong numbers for some transposes once a
cached graph executable is reused; ``MLX_USE_CUDA_GRAPHS=0`` is right.
Mechanism: since #2813 a child graph is updatable only if it is a lone clustered kernel (its cluster size then goes
into the node type ``G<x>``) or unclustered kernels. A split-K GEMM with a separate reduction kernel captures two
nodes, the first clustered: ``is_graph_updatable`` says no and leaves ``cluster_dim_x`` at 0 (type ``G0``), so
graphs with clusters of 2 and of 4 share a key. The flag should then keep the whole command buffer away from the
cache, but the next GEMM's child (one plain kernel) resets it to true. ``commit`` finds the executable of the
earlier eval under the same key and ``cudaGraphExecUpdate`` rewrites kernels and arguments but not the cluster
dimension: the new algorithm's split-K CTAs reduce through clusters of the old size, and the reduction kernel,
sized for the new clusters, never reads the partials of the other cluster.
Doctor: warmup-divergence, at add_graph_node. The executable's launch configuration was fixed when it was
instantiated for an earlier eval; ``add_graph_node`` loses the verdict that forbids reusing it, so replays keep
the old cluster shape while eager launches use the one the current kernel needs.
Fix (upstream): accumulate the flag over the command buffer's child graphs (``&=``); also recurse through a lone
child graph node so cuDNN's graph -> graph -> kernel children can be updated (a performance change).
Modelled: ``CommandEncoder`` (``capture_context``, ``add_graph_node``, ``insert_graph_dependencies``, ``commit``,
``graph_cache_``, the flag and its reset), ``is_graph_updatable`` as read (with the fix's recursion), ``CudaGraphExec``
(``instantiate``, ``cudaGraphExecUpdate``, ``cudaGraphLaunch``) and ``CublasGemm`` (``run``, ``execute``: heuristic,
workspace, capture). Stand-ins: stream capture appends kernel nodes (function, arguments, cluster attribute) to the
child graph; an executable is the engine's capture of the flattened kernels over parameter memory keyed by argument
(inputs copied in before a launch, written arrays copied back after: MLX arrays move between evals, CUDA rewrites
the pointers); a node's cluster size is the Python int it is captured with, which the update leaves alone as the
driver does. The cuBLASLt heuristic is a table; its split-K kernel sums each cluster's K slices into the cluster's
workspace slot (cluster id = rank // launched cluster size) and a reduction kernel sums the first splits/cluster
slots. One stream, no cuDNN.
Workload: per eval, ``y = op(a) @ op(b)`` (8x8x8, float64, transposes nn, nt, tt, tn, twice) then ``z = y^T @ w``
(8x8x8, one plain kernel), one command buffer each. Bug: nn instantiates the executable with a cluster of 2; nt and
tt (split 4, cluster 4) update it and lose the partials of CTAs 2 and 3 (y off by up to 7.9, z by up to 22.6); tn
changes the topology and re-instantiates, and so does the second nn, after which nt and tt are wrong again (4 of
8 evals). Fix: each of these command buffers gets a fresh executable and every eval equals eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ml-explore/mlx/pull/2857"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "add_graph_node"
SYMPTOM = ("evals with two GEMMs return wrong numbers once a cached graph executable is updated in place: the "
           "split-K kernel keeps the cluster size it was instantiated with; MLX_USE_CUDA_GRAPHS=0 is right")

M = K = N = 8
MAX_SPLITS = 4
DTYPE = torch.float64
TRANSPOSES = ["nn", "nt", "tt", "tn"] * 2

_variant = "bug"
_use_cuda_graphs = True                          # MLX_USE_CUDA_GRAPHS


def use_cuda_graphs() -> bool:
    return _use_cuda_graphs


# --- CUDA runtime stand-ins ----------------------------------------------------------------------------------------

cudaGraphExecUpdateSuccess, cudaGraphExecUpdateErrorTopologyChanged = 0, 2


class KernelNode:
    """A launched kernel: function, arguments (arrays by pointer, scalars by value), the argument it writes, and its
    ``cudaLaunchAttributeClusterDimension``."""

    def __init__(self, func, args: dict, output: str, cluster_dim=(0, 0, 0)):
        self.func, self.args, self.output, self.cluster_dim = func, args, output, cluster_dim


class CudaGraph:
    def __init__(self):
        self.nodes: list = []                    # KernelNode or child CudaGraph (cudaGraphAddChildGraphNode)


def flatten(graph: CudaGraph) -> list:
    out = []
    for node in graph.nodes:
        out.extend(flatten(node) if isinstance(node, CudaGraph) else [node])
    return out


def as_device(value, device):
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, device=device)


class CudaStream:
    def __init__(self, device):
        self.device, self.capture_graph = device, None

    def launch(self, node: KernelNode):          # recorded while the stream captures, else run now
        if self.capture_graph is not None:
            self.capture_graph.nodes.append(node)
            return
        args = {k: as_device(v, self.device) for k, v in node.args.items() if k != node.output}
        node.args[node.output].copy_(node.func(node.cluster_dim[0], **args))


class CudaGraphExec:
    """``cudaGraphExec_t``: one parameter slot per distinct argument of the instantiated graph."""

    def __init__(self, device):
        self.device = device

    def instantiate(self, graph: CudaGraph):     # cudaGraphInstantiate
        self.nodes = flatten(graph)
        self.slot_of, first = {}, {}
        for i, node in enumerate(self.nodes):
            for name, value in node.args.items():
                key = id(value) if isinstance(value, torch.Tensor) else (i, name)
                self.slot_of[(i, name)] = first.setdefault(key, len(first))
        self.written = sorted({self.slot_of[(i, n.output)] for i, n in enumerate(self.nodes)})
        self.cluster_x = [n.cluster_dim[0] for n in self.nodes]      # launch configuration, fixed here
        self.bind(self.nodes)
        self.inputs = {s: torch.zeros_like(v) for s, v in self.arrays.items() if s not in self.written}
        self.copy_in()
        self.graph, self.outs = capture(
            self.run_kernels, device=self.device, warmups=0, name="mlx command buffer", owner="mlx CommandEncoder",
            static={f"param{s}": t for s, t in self.inputs.items()})

    def bind(self, nodes):
        self.arrays = {}
        for i, node in enumerate(nodes):
            for name, value in node.args.items():
                self.arrays.setdefault(self.slot_of[(i, name)], as_device(value, self.device))

    def copy_in(self):
        for s, t in self.inputs.items():
            t.copy_(self.arrays[s])

    def run_kernels(self):
        env = dict(self.inputs)
        for i, (node, cluster_x) in enumerate(zip(self.nodes, self.cluster_x)):
            args = {n: env[self.slot_of[(i, n)]] for n in node.args if n != node.output}
            env[self.slot_of[(i, node.output)]] = node.func(cluster_x, **args)
        return tuple(env[s] for s in self.written)

    def update(self, graph: CudaGraph) -> int:   # cudaGraphExecUpdate: functions and arguments, not cluster dims
        nodes = flatten(graph)
        if len(nodes) != len(self.nodes) or any(len(a.args) != len(b.args) for a, b in zip(nodes, self.nodes)):
            return cudaGraphExecUpdateErrorTopologyChanged
        self.nodes = nodes
        self.bind(nodes)
        return cudaGraphExecUpdateSuccess

    def launch(self):                            # cudaGraphLaunch
        self.copy_in()
        for s, result in zip(self.written, replay(self.graph, self.outs)):
            self.arrays[s].copy_(result)


# --- mlx/backend/cuda/device.cpp -----------------------------------------------------------------------------------

def is_graph_updatable(graph: CudaGraph):
    """CUDA graphs are not updated correctly if a kernel node being updated has a different cluster shape. Returns
    ``(updatable, cluster_dim_x)``; ``cluster_dim_x`` keeps its 0 when a check fails first."""
    cluster_dim_x = 0
    for node in graph.nodes:
        if isinstance(node, CudaGraph):
            if _variant == "bug":
                return False, cluster_dim_x
            if len(graph.nodes) > 1:                 # try to be updatable for graph -> graph -> kernel
                return False, cluster_dim_x
            return is_graph_updatable(node)
        x, y, z = node.cluster_dim
        if y > 1 or z > 1:                           # only dim.x can be greater than 1
            return False, cluster_dim_x
        if x > 0 and len(graph.nodes) > 1:           # only one child node allowed when the subgraph uses clusters
            return False, cluster_dim_x
        cluster_dim_x = x
    return True, cluster_dim_x


class GraphNode:
    def __init__(self, node, node_type: str):
        self.node, self.node_type, self.id = node, node_type, ""


class CommandEncoder:
    def __init__(self, device):
        self.device, self.stream_ = device, CudaStream(device)
        self.graph_, self.graph_cache_ = CudaGraph(), {}
        self.node_count_, self.graph_nodes_key_, self.graph_deps_key_ = 0, "", ""
        self.active_deps_, self.active_outputs_, self.node_map_ = [], [], {}
        self.is_graph_updatable_ = True

    def capture_context(self):
        return CaptureContext(self)

    def set_input_array(self, arr):
        self.active_deps_.append(id(arr.data))

    def set_output_array(self, arr):
        self.active_deps_.append(id(arr.data))
        self.active_outputs_.append(id(arr.data))

    def add_graph_node(self, child: CudaGraph):
        if not use_cuda_graphs():
            self.node_count_ += 1
            return
        updatable, cluster_dim_x = is_graph_updatable(child)
        if _variant == "bug":
            self.is_graph_updatable_ = updatable
        else:
            self.is_graph_updatable_ &= updatable
        self.graph_.nodes.append(child)             # cudaGraphAddChildGraphNode
        self.insert_graph_dependencies(GraphNode(child, "G" + str(cluster_dim_x)))

    def insert_graph_dependencies(self, node: GraphNode):
        node.id = str(self.node_count_)
        self.node_count_ += 1
        self.graph_nodes_key_ += node.node_type + "-"
        deps = []
        for d in self.active_deps_:
            if d in self.node_map_ and self.node_map_[d] not in deps:
                deps.append(self.node_map_[d])
        for o in self.active_outputs_:
            self.node_map_[o] = node
        self.active_deps_, self.active_outputs_ = [], []
        for dep in deps:
            self.graph_deps_key_ += dep.id + "-" + node.id + "-"

    def commit(self):
        if use_cuda_graphs() and self.node_count_ > 0:
            if not self.is_graph_updatable_:
                graph_exec = CudaGraphExec(self.device)
                graph_exec.instantiate(self.graph_)
                graph_exec.launch()
            else:
                graph_key = self.graph_nodes_key_ + ":" + self.graph_deps_key_
                graph_exec = self.graph_cache_.get(graph_key)
                if graph_exec is not None and graph_exec.update(self.graph_) != cudaGraphExecUpdateSuccess:
                    graph_exec = None                   # graph_exec.reset()
                if graph_exec is None:
                    graph_exec = self.graph_cache_[graph_key] = CudaGraphExec(self.device)
                    graph_exec.instantiate(self.graph_)
                graph_exec.launch()
            self.graph_, self.graph_nodes_key_, self.graph_deps_key_, self.node_map_ = CudaGraph(), "", "", {}
            self.is_graph_updatable_ = True
        self.node_count_ = 0


class CaptureContext:
    def __init__(self, enc: CommandEncoder):
        self.enc = enc

    def __enter__(self):
        if use_cuda_graphs():                           # cudaStreamBeginCapture(..., ThreadLocal)
            self.enc.stream_.capture_graph = CudaGraph()
        return self

    def __exit__(self, *exc):
        if not use_cuda_graphs():
            self.enc.node_count_ += 1
            return
        graph, self.enc.stream_.capture_graph = self.enc.stream_.capture_graph, None
        self.enc.add_graph_node(graph)


# --- cuBLASLt (stand-in) and mlx/backend/cuda/gemms/cublas_gemm.cpp -------------------------------------------------

def op(x, transposed):
    return torch.where(transposed, x.mT, x)


def splitk_cluster_kernel(cluster_dim_x: int, a, b, trans_a, trans_b, splits_k):
    """Grid z = split of K: each CTA multiplies its K slice; the CTAs of a cluster add their partials through
    distributed shared memory into the cluster's workspace slot (cluster id = rank // launched cluster size)."""
    a_op, b_op = op(a, trans_a), op(b, trans_b)
    k = a_op.shape[1]
    ranks = torch.arange(MAX_SPLITS, device=a.device)
    in_slice = ((torch.arange(k, device=a.device) * splits_k // k)[None, :] == ranks[:, None]).to(a.dtype)
    partials = torch.einsum("mk,sk,kn->smn", a_op, in_slice, b_op)
    cluster_of = ranks // max(cluster_dim_x, 1)
    into = ((cluster_of[None, :] == ranks[:, None]) & (ranks < splits_k)[None, :]).to(a.dtype)
    return torch.einsum("cs,smn->cmn", into, partials)


def splitk_reduce_kernel(cluster_dim_x: int, workspace, num_clusters, alpha):
    """The reduction kernel of a split-K algorithm: D = alpha * sum of the first ``num_clusters`` slots."""
    used = (torch.arange(MAX_SPLITS, device=workspace.device) < num_clusters).to(workspace.dtype)
    return alpha * torch.einsum("c,cmn->mn", used, workspace)


def gemm_kernel(cluster_dim_x: int, a, b, trans_a, trans_b, alpha):
    return alpha * op(a, trans_a) @ op(b, trans_b)


class cublasLtMatmulHeuristicResult:
    def __init__(self, splits_k: int, cluster_dim: tuple):
        self.splits_k, self.cluster_dim = splits_k, cluster_dim
        self.workspaceSize = MAX_SPLITS if splits_k > 1 else 0


def cublasLtMatmulAlgoGetHeuristic(matmul_desc: str, m: int, n: int, k: int):
    """B200-like choices for an 8x8x8 FP64 GEMM: the transposes decide split-K and its cluster."""
    table = {("nn", 8, 8, 8): (2, (2, 1, 1)), ("nt", 8, 8, 8): (4, (4, 1, 1)), ("tt", 8, 8, 8): (4, (4, 1, 1)),
             ("tn", 8, 8, 8): (1, (0, 0, 0))}
    return cublasLtMatmulHeuristicResult(*table[(matmul_desc, m, n, k)])


def cublasLtMatmul(matmul_desc, alpha, a, b, d, algo, workspace, stream: CudaStream):
    ta, tb = matmul_desc[0] == "t", matmul_desc[1] == "t"
    if algo.splits_k == 1:
        stream.launch(KernelNode(gemm_kernel, {"a": a, "b": b, "trans_a": ta, "trans_b": tb, "alpha": alpha,
                                               "d": d}, "d"))
        return
    stream.launch(KernelNode(splitk_cluster_kernel, {"a": a, "b": b, "trans_a": ta, "trans_b": tb,
                                                     "splits_k": algo.splits_k, "ws": workspace}, "ws",
                             cluster_dim=algo.cluster_dim))
    stream.launch(KernelNode(splitk_reduce_kernel, {"workspace": workspace, "alpha": alpha, "d": d,
                                                    "num_clusters": algo.splits_k // algo.cluster_dim[0]}, "d"))


class CublasGemm:
    def __init__(self, a_transposed: bool, b_transposed: bool, m: int, n: int, k: int):
        self.matmul_desc_ = ("t" if a_transposed else "n") + ("t" if b_transposed else "n")
        self.shape_, self.heuristic_ = (m, n, k), None

    def run(self, encoder: CommandEncoder, out, a, b, alpha: float = 1.0):
        encoder.set_input_array(a)
        encoder.set_input_array(b)
        encoder.set_output_array(out)
        self.execute(encoder, out.data, a.data, b.data, alpha)

    def execute(self, encoder: CommandEncoder, out, a, b, alpha: float):
        if self.heuristic_ is None:
            self.heuristic_ = cublasLtMatmulAlgoGetHeuristic(self.matmul_desc_, *self.shape_)
        workspace = None
        if self.heuristic_.workspaceSize > 0:                       # cu::malloc_async + add_temporary
            workspace = torch.zeros(self.heuristic_.workspaceSize, *out.shape, dtype=out.dtype, device=out.device)
        with encoder.capture_context():
            cublasLtMatmul(self.matmul_desc_, alpha, a, b, out, self.heuristic_, workspace, encoder.stream_)


# --- mlx.core: arrays, Matmul::eval_gpu, eval -----------------------------------------------------------------------

class array:
    def __init__(self, data: torch.Tensor):
        self.data = data


def matmul(encoder: CommandEncoder, a: array, b: array, a_transposed: bool, b_transposed: bool) -> array:
    m = a.data.shape[1] if a_transposed else a.data.shape[0]
    k = a.data.shape[0] if a_transposed else a.data.shape[1]
    n = b.data.shape[0] if b_transposed else b.data.shape[1]
    out = array(torch.empty(m, n, dtype=DTYPE, device=a.data.device))   # allocator::malloc
    CublasGemm(a_transposed, b_transposed, m, n, k).run(encoder, out, a, b)
    return out


def eval(encoder: CommandEncoder, *outs: array) -> list:
    encoder.commit()                                                     # one command buffer per eval
    return [o.data.clone() for o in outs]


# --- the workload: a two-GEMM layer, every transpose of the first GEMM ----------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant, _use_cuda_graphs
    _variant = variant
    gen = generator(2857)
    data = [(torch.randn(M, K, generator=gen, dtype=DTYPE).to(device),
             torch.randn(K, N, generator=gen, dtype=DTYPE).to(device),
             torch.randn(M, N, generator=gen, dtype=DTYPE).to(device)) for _ in TRANSPOSES]

    def serve(graphs: bool):
        global _use_cuda_graphs
        _use_cuda_graphs = graphs
        encoder = CommandEncoder(device)
        results = []
        for (a, b, w), transpose in zip(data, TRANSPOSES):
            ta, tb = transpose[0] == "t", transpose[1] == "t"
            a_arr = array(a.mT.contiguous() if ta else a.clone())        # stored transposed: a row-major A^T
            b_arr = array(b.mT.contiguous() if tb else b.clone())
            y = matmul(encoder, a_arr, b_arr, ta, tb)
            z = matmul(encoder, y, array(w.clone()), True, False)           # z = y^T @ w: one plain kernel
            results += eval(encoder, y, z)
        return results

    outcome = compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
    _use_cuda_graphs = True
    return outcome
