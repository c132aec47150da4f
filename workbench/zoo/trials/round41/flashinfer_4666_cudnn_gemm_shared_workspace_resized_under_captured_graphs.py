"""A cuDNN FP8 GEMM grows flashinfer's shared workspace with ``resize_()`` mid-capture, under earlier graphs.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/4666 ("fix(gemm): never move the shared cuDNN GEMM
workspace"). It follows the unmerged #4553 and #4399. The downstream report is vllm-project/vllm#52540.
Symptom: vLLM v0.26 serving a ModelOpt mixed NVFP4/FP8 Qwen checkpoint on SM120 with piecewise CUDA graphs
died minutes into serving, with a GPU coredump / Xid 31 illegal address in a cuDNN-generated GEMM kernel. At
other times the corruption was silent. Instrumentation caught one cuDNN FP8 plan asking for 32 MiB + 256 B
while the piecewise graphs were being captured ("Capturing CUDA graphs ... 8/9"): "RESIZE old_ptr=0x7efadc000000
... new_ptr=0x7efa8d200000".
Mechanism: ``bmm_fp8`` takes its workspace from ``_get_cache_buf("bmm_fp8_workspace", DEFAULT_WORKSPACE_SIZE,
device)``. That is one 32 MiB uint8 buffer per ``(name, device)``, shared by the whole process. Each call goes
``CudnnFp8GemmRunner.forward`` -> ``_cudnn_gemm_fp8`` -> ``execute_cudnn_gemm_fp8_graph``, which asks the
plan for its workspace size and, if the buffer is smaller, calls ``workspace.resize_(workspace_size)``. The
buffer is the shared one, so this grows it in place. ``resize_`` to a larger size allocates a new block, copies
the bytes, frees the old block and leaves the tensor pointing at the new address. vLLM captures its graphs from
the largest size down. Every graph captured before the first shape whose plan asks for more (here the small-M
plan) has the old address baked into its cuDNN kernel nodes. Those graphs replay into memory the caching
allocator has taken back: an illegal address once it is unmapped, otherwise scratch written over whatever
tensor now lives there.
Doctor: dangling-reference, at ``execute_cudnn_gemm_fp8_graph`` (its ``resize_`` releases the shared workspace
storage that earlier-captured graphs still address).
Fix (upstream): ``DEFAULT_WORKSPACE_SIZE`` goes from 32 to 40 MiB, above cuDNN's worst-case shape-independent
request (33,554,692 B). A new ``_gemm_workspace_at_least()`` replaces all 10 ``resize_()`` sites. It hands back
the shared buffer if it is big enough. Otherwise it returns a call-local buffer and leaves the shared one
alone, and during capture it raises instead. ``_get_cache_buf`` retires a displaced buffer rather than dropping
it. Building a cuDNN plan during capture raises ``CudnnPlanBuildInCaptureError``.
(Read: the pre-fix ``gemm_base.py``/``utils.py`` at flashinfer fb28d72, where all the ``resize_`` sites and
``_get_cache_buf`` are, plus the PR description of #4666 for the fix. The merged diff hunks were not readable
here, so ``_gemm_workspace_at_least`` follows that description.
Scaled sizes: 1 "MiB" = 16 B, and the "+256 B" of the small-M plan is +4 B. Which plan asks for more is
illustrative: upstream says only that one FP8 plan did, at capture 8 of 9. Here the growth happens in the
warmup run that vLLM's capture loop makes for size 2, the first call of that shape. FP8 values are held in float32.
``resize_`` is spelled out as what the caching allocator does to the address, a new block and the old one
freed, because the CPU emulation follows storages, not raw pointers. On CUDA the captured graph keeps the freed
address exactly as with ``resize_``. On the CPU its replay raises ``IllegalMemoryAccess``, as the Xid 31
upstream did. On CUDA the replay reads the freed block silently.)
"""
from __future__ import annotations

import functools

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/4666"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "execute_cudnn_gemm_fp8_graph"
SYMPTOM = "graphs captured before a cuDNN plan grew the shared GEMM workspace replay into freed memory (Xid 31)"

MiB = 16                                                    # scaled: 1 "MiB" = 16 bytes
DEFAULT_WORKSPACE_SIZE = {"bug": 32 * MiB, "fix": 40 * MiB}  # the fix raises it 32 -> 40 MiB
CUDNN_WORKSPACE_REQUEST = 32 * MiB                          # cuDNN's shape-independent request...
SMALL_M_EXTRA = 4                                           # ...and the small-M plan's extra (+256 B upstream)
HIDDEN, INTERMEDIATE = 4, 8
CUDAGRAPH_CAPTURE_SIZES = [8, 4, 2, 1]                      # vLLM captures the largest first

# flashinfer/utils.py: the process-wide cache of named buffers.
_cache_buf: dict[tuple[str, str], torch.Tensor] = {}
_retired_cache_buf: list[torch.Tensor] = []                 # the fix: displaced buffers stay alive


class CudnnPlanBuildInCaptureError(RuntimeError):
    pass


def _get_cache_buf(name: str, bytes: int, device: str, variant: str) -> torch.Tensor:
    key = (name, device)
    buf = _cache_buf.get(key)
    if buf is None or buf.size(0) < bytes:
        if buf is not None and variant == "fix":
            _retired_cache_buf.append(buf)                  # never free an address a graph may hold
        buf = torch.empty(bytes, dtype=torch.uint8, device=device)
        _cache_buf[key] = buf
    return buf


class CudnnFp8GemmGraph:
    """A built cuDNN FP8 GEMM graph (one execution plan): a split-K kernel whose two K-halves' partial
    products go through the workspace before the scaled epilogue sums them."""

    def __init__(self, m: int, k: int, n: int):
        self.m, self.k, self.n = m, k, n

    def get_workspace_size(self) -> int:
        # The engine cuDNN's heuristics pick for the smallest M asks for a little more.
        return CUDNN_WORKSPACE_REQUEST + (SMALL_M_EXTRA if self.m <= 2 else 0)

    def execute(self, variant_pack: dict, workspace: torch.Tensor) -> None:
        a, b, a_scale, b_scale, out = (variant_pack[k] for k in ("A", "B", "A_SCALE", "B_SCALE", "O"))
        m, k, n = self.m, self.k, self.n
        partials = workspace[:2 * m * n * 4].view(torch.float32).view(2, m, n)
        torch.matmul(a[0, :, :k // 2], b[0, :k // 2], out=partials[0])
        torch.matmul(a[0, :, k // 2:], b[0, k // 2:], out=partials[1])
        out[0].copy_(partials.sum(0) * (a_scale * b_scale))


@functools.lru_cache(maxsize=2048)
def _build_cudnn_gemm_fp8_graph(a_shape, b_shape, device) -> CudnnFp8GemmGraph:
    return CudnnFp8GemmGraph(a_shape[1], a_shape[2], b_shape[2])


def build_cudnn_gemm_fp8_graph(a_shape, b_shape, device, variant: str) -> CudnnFp8GemmGraph:
    """``lru_cache``'d, shape-keyed. The fix refuses a plan build (a cache miss) inside a capture."""
    if variant == "fix" and torch.cuda.is_current_stream_capturing():
        info = _build_cudnn_gemm_fp8_graph.cache_info()
        graph = _build_cudnn_gemm_fp8_graph(a_shape, b_shape, device)
        if _build_cudnn_gemm_fp8_graph.cache_info().misses != info.misses:
            raise CudnnPlanBuildInCaptureError(f"cuDNN FP8 GEMM plan for {a_shape} built during capture; "
                                               "warm the shape up outside the capture")
        return graph
    return _build_cudnn_gemm_fp8_graph(a_shape, b_shape, device)


def _gemm_workspace_at_least(workspace: torch.Tensor, workspace_size: int) -> torch.Tensor:
    """The fix: never move the shared buffer; a call-local one if it is too small (not under capture)."""
    if workspace.numel() >= workspace_size:
        return workspace
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"cuDNN GEMM needs {workspace_size} B of workspace, the shared buffer has "
                           f"{workspace.numel()} B, and a CUDA graph is being captured")
    return torch.empty(workspace_size, dtype=torch.uint8, device=workspace.device)


def execute_cudnn_gemm_fp8_graph(graph, a, b, a_scale, b_scale, c_final, workspace, variant: str):
    variant_pack = {"A": a, "B": b, "A_SCALE": a_scale, "B_SCALE": b_scale, "O": c_final}
    workspace_size = graph.get_workspace_size()
    if variant == "bug":
        if workspace.numel() < workspace_size:
            # workspace.resize_(workspace_size) on the shared cached buffer. The allocator gives it a
            # new block with the old bytes and frees the old one; the tensor object stays the same.
            grown = torch.empty(workspace_size, dtype=torch.uint8, device=workspace.device)
            grown[:workspace.numel()].copy_(workspace)
            workspace.set_(grown.untyped_storage(), 0, (workspace_size,), (1,))
    else:
        workspace = _gemm_workspace_at_least(workspace, workspace_size)
    graph.execute(variant_pack, workspace)


def _cudnn_gemm_fp8(workspace, a, b, a_scale, b_scale, out, variant: str):
    graph = build_cudnn_gemm_fp8_graph(tuple(a.shape), tuple(b.shape), str(a.device), variant)
    execute_cudnn_gemm_fp8_graph(graph, a, b, a_scale, b_scale, out, workspace, variant)
    return out


def bmm_fp8(A, B, A_scale, B_scale, variant: str, out=None):
    if out is None:
        out = torch.empty((A.shape[0], A.shape[1], B.shape[2]), device=A.device, dtype=torch.float32)
    workspace_buffer = _get_cache_buf("bmm_fp8_workspace", DEFAULT_WORKSPACE_SIZE[variant], str(A.device), variant)
    return _cudnn_gemm_fp8(workspace_buffer, A, B, A_scale, B_scale, out, variant)   # backend "cudnn"


class FlashInferFP8ScaledMMLinearKernel:
    """vLLM's per-tensor FP8 linear: static input scale, per-tensor weight scale, ``bmm_fp8``."""

    def __init__(self, weight, input_scale, weight_scale, variant):
        self.weight = (weight / weight_scale)[None]          # "fp8" weight [1, K, N]
        self.input_scale, self.weight_scale = input_scale, weight_scale
        self.variant = variant

    def apply(self, x):
        x_q = (x / self.input_scale)[None]                   # static per-tensor quantisation
        return bmm_fp8(x_q, self.weight, self.input_scale, self.weight_scale, self.variant)[0]


class Qwen3MLP:
    """The piecewise-captured part of a layer: gate-up and down projections, both FP8 cuDNN GEMMs."""

    def __init__(self, device, variant):
        gen = generator(4666)
        w_up = randn(HIDDEN, INTERMEDIATE, gen=gen, device=device, scale=0.6)
        w_down = randn(INTERMEDIATE, HIDDEN, gen=gen, device=device, scale=0.6)
        scale = lambda v: torch.tensor(v, device=device)     # noqa: E731
        self.up = FlashInferFP8ScaledMMLinearKernel(w_up, scale(0.5), scale(0.25), variant)
        self.down = FlashInferFP8ScaledMMLinearKernel(w_down, scale(0.75), scale(0.25), variant)

    def forward(self, hidden_states):
        return hidden_states + self.down.apply(torch.nn.functional.silu(self.up.apply(hidden_states)))


def run(variant: str, device: str = "cpu"):
    gen = generator(52540)
    batch_sizes = [4, 8, 2, 1, 4]                            # serving steps, each a captured size
    inputs = [randn(n, HIDDEN, gen=gen, device=device) for n in batch_sizes]

    def eager():
        _cache_buf.clear()                                   # a fresh process
        _retired_cache_buf.clear()
        _build_cudnn_gemm_fp8_graph.cache_clear()
        mlp = Qwen3MLP(device, variant)
        return [mlp.forward(x).clone() for x in inputs]

    def served():
        _cache_buf.clear()                                   # a fresh process
        _retired_cache_buf.clear()
        _build_cudnn_gemm_fp8_graph.cache_clear()
        mlp = Qwen3MLP(device, variant)
        max_size = max(CUDAGRAPH_CAPTURE_SIZES)
        input_buffer = torch.zeros(max_size, HIDDEN, device=device)
        pool = graph_pool_handle(device)                     # vLLM's one global graph pool
        graphs = {}
        for size in CUDAGRAPH_CAPTURE_SIZES:                 # warm up, then capture, size by size
            static_input = input_buffer[:size]
            graphs[size] = capture(lambda x=static_input: mlp.forward(x), device=device, pool=pool,
                                   warmups=1, name=f"size {size}", owner="CUDAGraphWrapper",
                                   static={"input_buffer": input_buffer})
        outs = []
        for x in inputs:
            g, out = graphs[x.shape[0]]
            input_buffer[:x.shape[0]].copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
