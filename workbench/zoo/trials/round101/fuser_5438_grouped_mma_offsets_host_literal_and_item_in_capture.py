"""nvFuser's GroupedMmaOp builds the CUTLASS grouped GEMM's expert offsets from a host literal (``at::tensor({0})``) and checks them with ``.item()`` on every call: inside Thunder's CUDA-graph capture of an MoE step both are host synchronisations, so the graph cannot be captured.

Upstream: https://github.com/NVIDIA/Fuser/pull/5438 ("Fix GroupedMmaOp so it's capturable", NVIDIA/Fuser, opened
2025-10-27 by wujingyue, merged 2025-10-28 as f8b8551a7), fixing issue #5434 ("GroupedMmaOp::evaluate can't be
captured by CUDA graph", 2025-10-27).
Read: the PR description (Thunder's ``benchmark_inference.py --enable-nv-linear``: decode 12.74 ms without CUDA
graphs, 5.47 ms with ``--enable-thunder-cudagraph`` once fixed) and its review comment ("This triggers a GPU-to-CPU
copy so we skip this when the program runs in capture mode"); the issue (gdb in ``GroupedMmaOp::evaluate``); the
commit's diff of ``csrc/ir/nodes.cpp`` (``at::tensor({0}, ...)`` becomes ``at::zeros({1}, ...)`` in the offsets
built for the CUTLASS kernel) and of ``cutlass/group_mm.cu`` (``validateInputsGroupMm``'s per-expert ``.item()``
loop runs only when ``currentStreamCaptureStatus() == None``; ``grouped_mm``, ``run_group_mm``,
``run_get_group_gemm_starts`` otherwise reformatted); ``GroupedMmaOp::evaluate`` at the parent (the GB200 CUTLASS
branch: ``group_sizes`` by ``at::diff``, ``ab_strides``/``c_strides`` by ``full_like``, ``problem_sizes`` stacked,
offsets shifted by one); and Thunder's ``CUDAGraphRunner`` (``get_static_buffer``, ``build_cuda_graph``: three
warm-up calls on a side stream, then ``torch.cuda.graph``; ``call_cuda_graph``; read at its January 2026 head).
Symptom: Thunder with nvFuser's grouped GEMM (MoE experts) and ``--enable-thunder-cudagraph`` fails while capturing
the decode graph: a CUDA error inside the capture, which the issue's gdb trace stops in ``GroupedMmaOp::evaluate``
(the error text itself was not read); without CUDA graphs it runs.
Mechanism: Thunder warms the region up three times (eager: everything works) and then captures it. nvFuser runs
``torch._grouped_mm`` as an expression-evaluator segment: ``GroupedMmaOp::evaluate`` is host code that, on an SM100
GPU, prepares the CUTLASS kernel's arguments with ATen ops and calls ``cutlass_kernels::grouped_mm``. Two of those
ops need the host: ``at::tensor({0}, device)`` (a literal copied from pageable host memory to the GPU, to prepend
to the offsets) and, in ``validateInputsGroupMm``, ``expert_offsets[i].item()`` for every expert. A capturing stream
refuses both, at the first: the capture fails.
Doctor: sync-in-capture, at ``evaluate``: its host-literal copy is the first host synchronisation of the capture
(the ``.item()`` loop would be the second), and the fix changes that line.
Fix (upstream): the prepended zero comes from ``at::zeros({1}, ...)`` (a fill kernel, capturable), and the offset
validation loop is skipped while the current stream is capturing.
Modelled: Thunder's ``CUDAGraphRunner`` (``get_static_buffer``, ``build_cuda_graph``, ``call_cuda_graph``), an
nvFuser fusion of an MoE layer (router, top-1, sort by expert, offsets, ``GroupedMmaOp``, scatter back), and
``GroupedMmaOp.evaluate`` / ``grouped_mm`` / ``validateInputsGroupMm`` / ``run_group_mm`` as upstream. Stand-ins: the
CUTLASS grouped GEMM (and ``get_group_gemm_starts``) is one masked einsum over the groups; nvFuser's generated
kernels for the rest of the fusion are the same math in ATen ops; the device is taken to be SM100 (the branch the
PR fixes; the fallback branch's ``offsets.cpu()``, which issue #5434's gdb shows, is not modelled and the PR leaves
it); float32 (the CUTLASS kernel's bf16/fp16 dtype check is left out).
Workload: an MoE layer (4 experts, hidden 8, expert width 6) on a decode batch of 8 tokens, 5 steps with new
hidden states. Bug: the three warm-ups run; the capture raises at ``torch.tensor([0], ...)`` in ``evaluate`` (the
emulation's CaptureError, CUDA's cudaErrorStreamCaptureUnsupported). Fix: captured once, replayed per step; every
step equals eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/Fuser/pull/5438"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "evaluate"
SYMPTOM = ("Thunder + nvFuser grouped GEMM with --enable-thunder-cudagraph: capturing the MoE decode graph fails "
           "with a CUDA error in GroupedMmaOp::evaluate; eager runs")

TOKENS, HIDDEN, FFN, EXPERTS = 8, 8, 6, 4
STEPS = 5
DTYPE = torch.float32

_variant = "bug"


class NvfError(RuntimeError):
    pass


def NVF_CHECK_LE(a, b):
    if not a <= b:
        raise NvfError(f"Expected {a} <= {b}")


def NVF_CHECK_EQ(a, b):
    if a != b:
        raise NvfError(f"Expected {a} == {b}")


# --- cutlass/group_mm.cu (nvfuser::cutlass_kernels) ----------------------------------------------------------------

def run_group_mm(output, a, b, ab_strides, c_strides, problem_sizes, expert_offsets, M, N, K):
    """The CUTLASS grouped GEMM (stand-in): group g multiplies rows [expert_offsets[g], + problem_sizes[g, 0]) of
    ``a`` [M, K] by ``b[g]`` [N, K]^T; ``get_group_gemm_starts`` turns the same offsets into per-group pointers."""
    rows = torch.arange(M, device=a.device)
    starts = expert_offsets.to(torch.long)
    ends = starts + problem_sizes[:, 0].to(torch.long)
    in_group = ((rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])).to(a.dtype)   # [G, M]
    output.copy_(torch.einsum("gm,mk,gnk->mn", in_group, a, b))


def validateInputsGroupMm(a, b, ab_strides, c_strides, problem_sizes, expert_offsets):
    NVF_CHECK_EQ(a.dim(), 2)
    NVF_CHECK_EQ(b.dim(), 3)
    if _variant == "bug" or not torch.cuda.is_current_stream_capturing():
        m = a.size(0)
        g = expert_offsets.size(0)
        prev_offset = 0
        for i in range(g):
            expert_offset = expert_offsets[i].item()
            NVF_CHECK_LE(expert_offset, m)
            NVF_CHECK_LE(prev_offset, expert_offset)
            prev_offset = expert_offset
    NVF_CHECK_EQ(ab_strides.dtype, torch.long)
    NVF_CHECK_EQ(c_strides.dtype, torch.long)
    NVF_CHECK_EQ(problem_sizes.dim(), 2)
    NVF_CHECK_EQ(problem_sizes.size(1), 3)
    NVF_CHECK_EQ(problem_sizes.size(0), expert_offsets.size(0))
    NVF_CHECK_EQ(problem_sizes.dtype, torch.int32)


def grouped_mm(a, b, ab_strides, c_strides, problem_sizes, expert_offsets):
    output = torch.empty(a.size(0), b.size(1), dtype=a.dtype, device=a.device)
    validateInputsGroupMm(a, b, ab_strides, c_strides, problem_sizes, expert_offsets)
    run_group_mm(output, a, b, ab_strides, c_strides, problem_sizes, expert_offsets,
                 a.size(0), b.size(1), a.size(1))
    return output


# --- csrc/ir/nodes.cpp ---------------------------------------------------------------------------------------------

def getCurrentDeviceProperties_major() -> int:
    return 10                                                   # a GB200: the CUTLASS branch


class GroupedMmaOp:
    """``out = grouped_mm(mat1 [m, k], mat2 [g, k, n], offsets [g])``, run by nvFuser's expression evaluator."""

    def evaluate(self, mat1, mat2, offsets):
        supported_by_cutlass_kernel = (getCurrentDeviceProperties_major() == 10 and mat1.dim() == 2
                                       and mat2.dim() == 3 and mat1.is_contiguous()
                                       and mat2.transpose(-1, -2).is_contiguous())
        if not supported_by_cutlass_kernel:
            raise NvfError("the fallback (offsets.cpu()) branch is not modelled")
        mat2 = mat2.transpose(-1, -2)                           # [m, k] x [g, n, k]; both contiguous
        k, n = mat1.size(-1), mat2.size(1)
        group_sizes = torch.diff(offsets, n=1, dim=-1,
                                 prepend=torch.zeros(1, dtype=torch.int32, device=offsets.device))
        ab_strides = torch.full_like(offsets, k, dtype=torch.long)
        c_strides = torch.full_like(offsets, n, dtype=torch.long)
        problem_sizes = torch.stack([group_sizes, c_strides, ab_strides], dim=-1).to(torch.int32)
        if _variant == "bug":
            first = torch.tensor([0], dtype=torch.int32, device=offsets.device)      # at::tensor({0}, ...)
        else:
            first = torch.zeros(1, dtype=torch.int32, device=offsets.device)         # at::zeros({1}, ...)
        offsets = torch.cat([first, offsets[:-1]])
        return grouped_mm(mat1, mat2, ab_strides, c_strides, problem_sizes, offsets)


# --- the fusion Thunder hands to nvFuser (an MoE layer, top-1 routing) ---------------------------------------------

def moe_fusion(hidden_states, router_weight, expert_weight):
    """Router, top-1, sort tokens by expert, cumulative offsets, the grouped GEMM, scatter back and scale."""
    probs = torch.softmax(hidden_states @ router_weight.t(), dim=-1)
    topk_weight, topk_ids = probs.max(dim=-1)
    order = torch.argsort(topk_ids, stable=True)
    counts = (topk_ids[:, None] == torch.arange(EXPERTS, device=hidden_states.device)[None, :]).sum(0)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    out_sorted = GroupedMmaOp().evaluate(hidden_states[order], expert_weight.transpose(-1, -2), offsets)
    out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)
    return out * topk_weight[:, None]


# --- thunder/transforms/cudagraph.py -------------------------------------------------------------------------------

class CUDAGraphRunner:
    def __init__(self, device):
        self.device = device
        self.cuda_graph_cache = {}

    def get_static_buffer(self, x):
        if isinstance(x, torch.Tensor):
            return torch.empty_like(x).copy_(x)
        return x

    def build_cuda_graph(self, fn, args, static_args_mask):
        static_inputs = tuple(self.get_static_buffer(arg) if not is_static else arg
                              for arg, is_static in zip(args, static_args_mask))
        graph, static_outputs = capture(
            lambda: fn(*static_inputs), device=self.device, warmups=3, name="CUDAGraph1", owner="thunder",
            static={f"arg{i}": x for i, (x, s) in enumerate(zip(static_inputs, static_args_mask)) if not s})
        return graph, static_inputs, static_outputs

    def call_cuda_graph(self, fn, *args, static_args_mask):
        cache_key = (fn.__name__, static_args_mask, tuple((a.dtype, a.shape) for a in args))
        cache_entry = self.cuda_graph_cache.get(cache_key)
        if cache_entry is None:
            cache_entry = self.cuda_graph_cache[cache_key] = self.build_cuda_graph(fn, args, static_args_mask)
        graph, static_inputs, static_outputs = cache_entry
        for static_input, arg in zip(static_inputs, args):
            if static_input is not arg:
                static_input.copy_(arg)
        return replay(graph, static_outputs)


# --- the workload: MoE decode steps, Thunder with and without --enable-thunder-cudagraph ---------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(5434)
    router_weight = (torch.randn(EXPERTS, HIDDEN, generator=gen) * 2.0).to(device)
    expert_weight = (torch.randn(EXPERTS, FFN, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(device)
    steps = [torch.randn(TOKENS, HIDDEN, generator=gen).to(device) for _ in range(STEPS)]
    static_mask = (False, True, True)                        # the weights are nn.Parameters: not copied

    def serve(use_cudagraph: bool):
        runner = CUDAGraphRunner(device)
        outs = []
        for hidden in steps:
            if use_cudagraph:
                out = runner.call_cuda_graph(moe_fusion, hidden, router_weight, expert_weight,
                                             static_args_mask=static_mask)
            else:
                out = moe_fusion(hidden, router_weight, expert_weight)
            outs.append(out.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
