"""MLX's CUDA backend updates a cached cudaGraphExec in place with a graph whose cuBLASLt kernel needs another thread-block cluster shape: the update reports success but keeps the instantiated cluster dims, so the GEMM's in-cluster split-K reduction misses partials.

Upstream: https://github.com/ml-explore/mlx/pull/2813 ("Force cudaGraphExec reinstantiation when clusters are
used", ml-explore/mlx, opened 2025-11-21 by andportnoy, merged 2025-11-22 as 3e05cea9f), fixing issue #2748
("[BUG] [CUDA] Blas tests failing on B200", 2025-11-10).
Read: the PR description ("Thread block cluster dimensions are not correctly updated by cudaGraphExecUpdate.
Therefore, when clusters are used, we reinstantiate a cudaGraphExec rather than updating it"; the review: "This
resolves outstanding test failures"); the issue (``test_matmul_shapes`` failing for several shapes and every
transpose mode on B200, and its standalone cuBLASLt reproducer: a captured GEMV's executable updated with
``cudaGraphExecUpdate`` from the graph of a second GEMV prints "Graph exec update success!" and then
``y = {0, 0, 0, 0}``); the commit's diff of ``mlx/backend/cuda/device.cpp`` (new ``is_graph_updatable``, the
cluster dimension in the child-graph node type ``"G" + cluster_dim_x``, the key split into
``graph_nodes_key_``/``graph_deps_key_``, ``commit`` instantiating afresh when ``!is_graph_updatable_``);
``device.cpp`` at the parent (``CaptureContext``, ``add_kernel_node``, ``add_graph_node``,
``insert_graph_dependencies``, ``commit`` with its ``graph_cache_`` and ``cudaGraphExecUpdate``); and
``gemms/cublas_gemm.cpp`` at the parent (``CublasGemm::run``/``execute``: the heuristic, then ``cublasLtMatmul``
under ``encoder.capture_context()``). The follow-up #2857 (``is_graph_updatable_ &=``) was seen, not modelled.
Symptom: on B200 (cuBLASLt picks cluster-launched kernels there) MLX matmuls return wrong numbers (zeros in the
reproducer) once a second matmul reuses a cached graph executable; with ``MLX_USE_CUDA_GRAPHS=0`` they are right.
Mechanism: MLX builds one CUDA graph per command buffer and caches executables by the graph's shape: node types and
dependency edges. A cuBLASLt call is stream-captured into a child graph, node type ``'G'`` whatever it holds. The
next ``eval`` with the same shape of graph (another matmul, same sizes, other transposes) finds the cached
executable and calls ``cudaGraphExecUpdate``: the kernel, its grid and its arguments are rewritten, the
cluster-dimension launch attribute is not, and the update reports success. cuBLASLt's new kernel reduces its K
split across a cluster of the size its heuristic chose; launched with the old, smaller cluster, the partials of
the CTAs outside it never reach the leader.
Doctor: warmup-divergence, at ``add_graph_node``: the executable's launch configuration was decided when it was
instantiated (captured), and the node typing there lets later graphs reuse it, while an eager launch takes the
cluster shape the current kernel needs.
Fix (upstream): ``add_graph_node`` asks ``is_graph_updatable(child, cluster_dim_x)`` (only kernel nodes; cluster
only along x; a clustered kernel must be the child's only node) and types the node ``"G" + cluster_dim_x``, so
graphs whose kernels use different cluster shapes get different executables; ``commit`` instantiates a fresh
executable for a graph that is not updatable.
Modelled: ``CommandEncoder`` (``capture_context``, ``add_graph_node``, ``insert_graph_dependencies``, ``commit``,
``graph_cache_``), ``CudaGraphExec`` (``instantiate``, ``cudaGraphExecUpdate``, launch), ``is_graph_updatable``,
``CublasGemm`` (``run``, ``execute``) and the ``Matmul`` eval of ``test_matmul_shapes``.
Stand-ins: stream capture of a cuBLASLt launch appends a kernel node (function, arguments, cluster attribute) to
the child graph; an executable is the engine's capture of the graph's kernels, run with its kernel-parameter
memory (slots: inputs copied in before a launch, results written back to the arrays after: MLX arrays move
between evals, CUDA rewrites the pointers); the cluster shape is the Python int the kernel is captured with, which
``cudaGraphExecUpdate`` leaves alone as the driver does. ``cublasLtMatmulAlgoGetHeuristic`` is a table (split-K
and cluster size by transpose mode); the kernel splits K over ``splits_k`` CTAs and sums the partials of the
ranks inside the launched cluster. No gemv path, no workspace, one stream.
Workload: 8x8x8 float64 matmuls, the four transpose modes twice (one ``eval``, one command buffer each). The
first (nn: split 2, cluster 2) instantiates the executable; the bug variant updates it for every later eval, so
nt and tt (split 4, cluster 4) run with a cluster of 2 and sum half of K (max error 6.39); tn (no split) is right.
The fix keys the executables ``G2``/``G4``/``G0`` and equals eager exactly (max error 0).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ml-explore/mlx/pull/2813"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "add_graph_node"
SYMPTOM = ("B200: matmuls give wrong numbers (zeros) once cudaGraphExecUpdate reuses a cached executable for a "
           "cuBLASLt kernel with another cluster shape; MLX_USE_CUDA_GRAPHS=0 is right")

M = N = K = 8
MAX_SPLITS = 4
DTYPE = torch.float64
TRANSPOSES = ["nn", "nt", "tn", "tt"] * 2

_variant = "bug"
_use_cuda_graphs = True                          # MLX_USE_CUDA_GRAPHS


def use_cuda_graphs() -> bool:
    return _use_cuda_graphs


# --- CUDA runtime (stand-ins: graphs as node lists, stream capture appends nodes) ---------------------------------

cudaGraphExecUpdateSuccess, cudaGraphExecUpdateErrorTopologyChanged = 0, 2


class KernelNode:
    """``cudaGraphAddKernelNode`` / a captured ``cudaLaunchKernelEx``: function, arguments (arrays by pointer,
    scalars by value), which arguments it writes, and the ``cudaLaunchAttributeClusterDimension``."""

    def __init__(self, func, args: dict, outputs: tuple, cluster_dim: tuple):
        self.func, self.args, self.outputs, self.cluster_dim = func, args, outputs, cluster_dim


class CudaGraph:
    def __init__(self):
        self.nodes: list = []                    # KernelNode, or a child CudaGraph (cudaGraphAddChildGraphNode)


class Stream:
    def __init__(self, device):
        self.device, self.capturing = device, None

    def begin_capture(self):                     # cudaStreamBeginCapture
        self.capturing = CudaGraph()

    def end_capture(self) -> CudaGraph:          # cudaStreamEndCapture
        graph, self.capturing = self.capturing, None
        return graph

    def launch(self, node: KernelNode):          # cudaLaunchKernelEx: recorded while capturing, else run now
        if self.capturing is not None:
            self.capturing.nodes.append(node)
            return
        args = {k: torch.tensor(v, device=self.device) if not isinstance(v, torch.Tensor) else v
                for k, v in node.args.items()}
        result = node.func(node.cluster_dim[0], **{k: v for k, v in args.items() if k not in node.outputs})
        args[node.outputs[0]].copy_(result)


def kernel_nodes(graph: CudaGraph) -> list:
    """The graph's kernels in order, child graphs flattened (an executable launches them all)."""
    out = []
    for node in graph.nodes:
        out.extend(kernel_nodes(node) if isinstance(node, CudaGraph) else [node])
    return out


class CudaGraphExec:
    """``cudaGraphExec_t``. Its kernel-parameter memory is a set of slots; ``instantiate`` captures the kernels on
    them, with each node's cluster dimension as launched then."""

    def __init__(self, device):
        self.device, self.graph, self.outs = device, None, None

    def instantiate(self, graph: CudaGraph):     # cudaGraphInstantiate
        self.nodes = kernel_nodes(graph)
        self.slots = [{k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else torch.tensor(v, device=self.device)
                       for k, v in n.args.items() if k not in n.outputs} for n in self.nodes]
        self.cluster_dims = [n.cluster_dim for n in self.nodes]
        self.bind(self.nodes)
        self.copy_in()
        self.graph, self.outs = capture(
            self.run_kernels, device=self.device, warmups=0, name="mlx command buffer", owner="mlx CommandEncoder",
            static={f"node{i}.{k}": s for i, slots in enumerate(self.slots) for k, s in slots.items()})

    def run_kernels(self):
        return tuple(n.func(dims[0], **slots) for n, dims, slots in zip(self.nodes, self.cluster_dims, self.slots))

    def bind(self, nodes):
        self.bound = [(n.args, n.outputs) for n in nodes]
        for slots, n in zip(self.slots, nodes):
            for k, v in n.args.items():
                if k in slots and not isinstance(v, torch.Tensor):
                    slots[k].fill_(v)                                  # by-value argument

    def copy_in(self):
        for slots, (args, _) in zip(self.slots, self.bound):
            for k, slot in slots.items():
                if isinstance(args[k], torch.Tensor):
                    slot.copy_(args[k])                                # what the argument pointer points at

    def update(self, graph: CudaGraph) -> int:   # cudaGraphExecUpdate
        nodes = kernel_nodes(graph)
        if len(nodes) != len(self.nodes):
            return cudaGraphExecUpdateErrorTopologyChanged
        self.nodes = nodes                                             # new functions, grids and arguments ...
        self.bind(nodes)                                               # ... but not the cluster dimensions
        return cudaGraphExecUpdateSuccess

    def launch(self):                            # cudaGraphLaunch
        self.copy_in()
        results = replay(self.graph, self.outs)
        for result, (args, outputs) in zip(results, self.bound):
            args[outputs[0]].copy_(result)


def is_graph_updatable(graph: CudaGraph):
    """(The fix) CUDA graphs are not updated correctly if a kernel node being updated has a different cluster shape."""
    cluster_dim_x = 0
    for node in graph.nodes:
        if not isinstance(node, KernelNode):
            return False, 0
        x, y, z = node.cluster_dim
        if y > 1 or z > 1:                                             # only dim.x can be greater than 1
            return False, 0
        if x > 0 and len(graph.nodes) > 1:                             # only one node when the child uses clusters
            return False, 0
        cluster_dim_x = x
    return True, cluster_dim_x


# --- mlx/backend/cuda/device.cpp ----------------------------------------------------------------------------------

class GraphNode:
    def __init__(self, node, node_type: str):
        self.node, self.node_type, self.id = node, node_type, ""


class CommandEncoder:
    def __init__(self, device):
        self.device, self.stream_ = device, Stream(device)
        self.graph_, self.graph_cache_ = CudaGraph(), {}
        self.node_count_ = self.graph_node_count_ = 0
        self.graph_key_, self.active_deps_, self.active_outputs_, self.node_map_ = "", [], [], {}
        self.is_graph_updatable_ = True

    def capture_context(self):
        return CaptureContext(self)

    def set_input_array(self, arr):
        self.active_deps_.append(id(arr))

    def set_output_array(self, arr):
        self.active_deps_.append(id(arr))
        self.active_outputs_.append(id(arr))

    def add_graph_node(self, child: CudaGraph):
        if not use_cuda_graphs():
            self.node_count_ += 1
            return
        self.graph_.nodes.append(child)                                # cudaGraphAddChildGraphNode
        if _variant == "bug":
            self.insert_graph_dependencies(GraphNode(child, "G"))
        else:
            updatable, cluster_dim_x = is_graph_updatable(child)
            self.is_graph_updatable_ = updatable
            self.insert_graph_dependencies(GraphNode(child, "G" + str(cluster_dim_x)))

    def insert_graph_dependencies(self, node: GraphNode):
        if node.node_type.startswith("G"):
            self.graph_node_count_ += 1
        node.id = str(self.node_count_)
        self.node_count_ += 1
        self.graph_key_ += node.node_type + "-"
        for d in self.active_deps_:
            if d in self.node_map_:
                self.graph_key_ += self.node_map_[d].id + ">" + node.id + "-"
        for o in self.active_outputs_:
            self.node_map_[o] = node
        self.active_deps_, self.active_outputs_ = [], []

    def commit(self):
        if use_cuda_graphs() and self.node_count_ > 0:
            if not self.is_graph_updatable_:
                graph_exec = CudaGraphExec(self.device)
                graph_exec.instantiate(self.graph_)
                graph_exec.launch()
            else:
                graph_key = f"{self.graph_key_}.{self.node_count_}.{self.graph_node_count_}"
                graph_exec = self.graph_cache_.get(graph_key)
                if graph_exec is not None and graph_exec.update(self.graph_) != cudaGraphExecUpdateSuccess:
                    graph_exec = None
                if graph_exec is None:
                    graph_exec = self.graph_cache_[graph_key] = CudaGraphExec(self.device)
                    graph_exec.instantiate(self.graph_)
                graph_exec.launch()
            self.graph_, self.graph_key_, self.node_map_ = CudaGraph(), "", {}
            self.graph_node_count_, self.is_graph_updatable_ = 0, True
        self.node_count_ = 0


class CaptureContext:
    def __init__(self, enc: CommandEncoder):
        self.enc = enc

    def __enter__(self):
        if use_cuda_graphs():
            self.enc.stream_.begin_capture()
        return self

    def __exit__(self, *exc):
        if not use_cuda_graphs():
            self.enc.node_count_ += 1
            return
        self.enc.add_graph_node(self.enc.stream_.end_capture())


# --- cuBLASLt (stand-in) and mlx/backend/cuda/gemms/cublas_gemm.cpp -----------------------------------------------

def gemm_splitk_cluster_kernel(cluster_dim_x: int, a, b, trans_a, trans_b, splits_k, alpha):
    """Grid (tiles_m, tiles_n, splits_k): CTA z multiplies its slice of K; the CTAs of a cluster push their
    partials through distributed shared memory to rank 0 (split 0), which writes D. A rank outside the launched
    cluster maps no shared memory of the leader: its partial never arrives."""
    a_op = torch.where(trans_a, a.mT, a)
    b_op = torch.where(trans_b, b.mT, b)
    k = a_op.shape[1]
    ranks = torch.arange(MAX_SPLITS, device=a.device)
    split_of_k = torch.arange(k, device=a.device) * splits_k // k
    in_slice = (split_of_k[None, :] == ranks[:, None]).to(a.dtype)
    partials = torch.einsum("mk,sk,kn->smn", a_op, in_slice, b_op)
    arrives = (ranks < max(cluster_dim_x, 1)) & (ranks < splits_k)
    return alpha * (partials * arrives[:, None, None]).sum(0)


class cublasLtMatmulAlgo:
    def __init__(self, splits_k: int, cluster_dim: tuple):
        self.splits_k, self.cluster_dim = splits_k, cluster_dim


def cublasLtMatmulAlgoGetHeuristic(matmul_desc) -> cublasLtMatmulAlgo:
    """B200-like choices for an 8x8x8 FP64 GEMM: the transposes decide split-K and its cluster."""
    return {"nn": cublasLtMatmulAlgo(2, (2, 1, 1)), "nt": cublasLtMatmulAlgo(4, (4, 1, 1)),
            "tn": cublasLtMatmulAlgo(1, (0, 0, 0)), "tt": cublasLtMatmulAlgo(4, (4, 1, 1))}[matmul_desc]


def cublasLtMatmul(matmul_desc, alpha, a, b, d, algo: cublasLtMatmulAlgo, stream: Stream):
    stream.launch(KernelNode(gemm_splitk_cluster_kernel,
                             {"a": a, "b": b, "trans_a": matmul_desc[0] == "t", "trans_b": matmul_desc[1] == "t",
                              "splits_k": algo.splits_k, "alpha": alpha, "d": d},
                             outputs=("d",), cluster_dim=algo.cluster_dim))


class CublasGemm:
    def __init__(self, a_transposed: bool, b_transposed: bool):
        self.matmul_desc_ = ("t" if a_transposed else "n") + ("t" if b_transposed else "n")
        self.heuristic_ = None

    def run(self, encoder: CommandEncoder, out, a, b, alpha: float = 1.0):
        encoder.set_input_array(a)
        encoder.set_input_array(b)
        encoder.set_output_array(out)
        self.execute(encoder, out.data, a.data, b.data, alpha)

    def execute(self, encoder: CommandEncoder, out, a, b, alpha: float):
        if self.heuristic_ is None:
            self.heuristic_ = cublasLtMatmulAlgoGetHeuristic(self.matmul_desc_)
        with encoder.capture_context():
            cublasLtMatmul(self.matmul_desc_, alpha, a, b, out, self.heuristic_, encoder.stream_)


# --- mlx.core: arrays, Matmul::eval_gpu, eval ---------------------------------------------------------------------

class array:
    def __init__(self, data: torch.Tensor):
        self.data = data


def matmul(encoder: CommandEncoder, a: array, b: array, a_transposed: bool, b_transposed: bool) -> array:
    out = array(torch.empty(M, N, dtype=DTYPE, device=a.data.device))   # allocator::malloc
    CublasGemm(a_transposed, b_transposed).run(encoder, out, a, b)
    return out


def eval(encoder: CommandEncoder, out: array) -> torch.Tensor:
    encoder.commit()                                                  # one command buffer per eval
    return out.data.clone()


# --- the workload: test_matmul_shapes, one shape, every transpose ---------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant, _use_cuda_graphs
    _variant = variant
    gen = generator(2748)
    data = [(torch.randn(M, K, generator=gen, dtype=DTYPE).to(device),
             torch.randn(K, N, generator=gen, dtype=DTYPE).to(device)) for _ in TRANSPOSES]

    def serve(graphs: bool):
        global _use_cuda_graphs
        _use_cuda_graphs = graphs
        encoder = CommandEncoder(device)
        results = []
        for (a, b), transpose in zip(data, TRANSPOSES):
            ta, tb = transpose[0] == "t", transpose[1] == "t"
            a_arr = array(a.mT.contiguous() if ta else a.clone())         # stored transposed: a row-major A^T
            b_arr = array(b.mT.contiguous() if tb else b.clone())
            results.append(eval(encoder, matmul(encoder, a_arr, b_arr, ta, tb)))
        return results

    outcome = compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
    _use_cuda_graphs = True
    return outcome
