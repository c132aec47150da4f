"""A captured FP8 grouped GEMM copies its kernel arguments from a pinned block the next call was handed and overwrote.

Upstream: https://github.com/pytorch/FBGEMM/pull/3373 ("Support FP8 grouped GEMM with cudagraph", commit 0b70e1d4a).
Symptom: ``torch.ops.fbgemm.f8f8bf16_grouped`` was not usable under CUDA graphs (the commit: "quite challenging
to make cudagraph support to handle more complicated kernel arguments with various pointer array"): a replayed
graph hands the CUTLASS grouped GEMM pointers and problem shapes that are not its own, giving wrong outputs or an
illegal memory access. Here an MoE expert FFN (two grouped GEMMs in one captured step) serves garbage.
Mechanism: ``f8f8bf16_grouped_impl`` allocates ``input_args`` and ``output_args`` with
``at::TensorOptions().dtype(at::kLong).pinned_memory(true)`` (the ``CachingHostAllocator``), fills them in a host
loop (``xq_ptr[i]``, ``wq_ptr[i]``, ``scale_ptr[i]``, ``problem_shape_ptr[i] = {m, n, k}``, the packed strides,
``output_ptr[i] = output_data + output_offset``), and ``cudaMemcpyAsync``s them into ``d_input_args`` /
``d_output_args``, which the GEMM reads. Under capture the host loop runs once and the memcpy node keeps the
host address. The pinned tensors are locals: at return they go back to the host allocator, and since the raw
``cudaMemcpyAsync`` recorded no event on them they are free at once. The next call of the op (the second
grouped GEMM of the same captured step) is handed the same blocks and writes its own arguments there. At every
replay both memcpy nodes read the second call's arguments: the first GEMM runs with the second's pointers,
shapes and strides, and its own output is never written.
Doctor: dangling-reference, at ``f8f8bf16_grouped_impl`` (its captured copy reads a pinned block after the
function released it and the allocator handed it to the next call).
Fix (upstream): no pinned staging: ``input_args``/``output_args`` become device tensors
(``at::empty(..., XQ[0].options().dtype(at::kLong))``) and a per-group ``set_kernel_args_kernel<<<1, 256, 0,
stream>>>`` writes each group's pointers, ``ProblemShape(M, N, K)`` and packed strides on the device; the
launch is captured with its arguments baked in, which are static because the inputs' addresses are. The host
fill loop and both ``cudaMemcpyAsync`` calls are deleted.
(Read: ``git show 0b70e1d4a``, the .cu diff and the ``use_cudagraph`` test. In miniature a "pointer" is an
element offset into the call's operand space (its XQ, WQ and scales laid end to end), FP8 quantisation is left
out (``scale`` is the per-group dequant scale), and the CUTLASS kernel is a masked tile loop that reads its
pointers, shapes and strides from ``d_input_args``; ``CachingHostAllocator`` models the pinned allocator's
free list (a fresh one per run). The eager reference is the test's "BF16 loopover gemm reference".)
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/FBGEMM/pull/3373"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "f8f8bf16_grouped_impl"
SYMPTOM = "the replayed MoE FFN's first grouped GEMM runs with the second one's pointers and shapes: wrong outputs"

G, D, F = 3, 4, 6                 # experts (problem_count), model dim, expert FFN dim
MS = (3, 2, 4)                    # tokens routed to each expert (static under capture)
TILE_M, TILE_N, TILE_K = 4, 6, 6  # the kernel config chosen on the host (KernelMode)
STEPS = 3


class Block:
    def __init__(self, size, device):
        self.size = size
        self.data = host(torch.empty(size, dtype=torch.int64), device)    # one pinned allocation


class CachingHostAllocator:
    """``at::getCachingHostAllocator()``: pinned blocks by power-of-two size, a free list per size. A block
    is parked behind events only if ``record_event`` was called on it; a raw ``cudaMemcpyAsync`` calls none."""

    def __init__(self, device):
        self.device, self.free_list = device, {}

    def allocate(self, numel):
        size = 1 << max(numel - 1, 0).bit_length()
        free = self.free_list.get(size)
        return free.pop() if free else Block(size, self.device)

    def free(self, block):
        self.free_list.setdefault(block.size, []).append(block)


def set_kernel_args_kernel(xq_ptr, wq_ptr, scale_ptr, input_args, output_args, output_offset, group_index,
                           M, N, K):
    """The fix's ``set_kernel_args_kernel``: one launch per group writes its arguments on the device."""
    i = group_index
    output_args[i:i + 1].fill_(output_offset)
    for offset, value in ((i, xq_ptr), (G + i, wq_ptr), (2 * G + i, scale_ptr), (3 * G + 3 * i, M),
                          (3 * G + 3 * i + 1, N), (3 * G + 3 * i + 2, K), (6 * G + i, K), (7 * G + i, K),
                          (8 * G + i, N)):     # pointers, ProblemShape(M, N, K), packed strides A/B/output
        input_args[offset:offset + 1].fill_(value)


def cutlass_grouped_gemm(input_args, output_args, xq_space, wq_space, scale_space, output_ext):
    """The CUTLASS grouped GEMM: every group's pointers, shape and strides come from device memory."""
    r = torch.arange(TILE_M, device=xq_space.device)[:, None, None]
    c = torch.arange(TILE_N, device=xq_space.device)[None, :, None]
    k = torch.arange(TILE_K, device=xq_space.device)[None, None, :]
    spare = output_ext.numel() - 1                                     # masked-off lanes write here
    for i in range(G):
        xq_ptr, wq_ptr, scale_ptr = input_args[i], input_args[G + i], input_args[2 * G + i]
        M, N, K = input_args[3 * G + 3 * i], input_args[3 * G + 3 * i + 1], input_args[3 * G + 3 * i + 2]
        lda, ldb, ldd = input_args[6 * G + i], input_args[7 * G + i], input_args[8 * G + i]
        a = xq_space[(xq_ptr + r * lda + k).clamp(0, xq_space.numel() - 1)] * ((r < M) & (k < K))
        b = wq_space[(wq_ptr + c * ldb + k).clamp(0, wq_space.numel() - 1)] * ((c < N) & (k < K))
        acc = (a * b).sum(-1) * scale_space[scale_ptr.clamp(0, G - 1).view(1)]
        dst = torch.where((r < M) & (c < N), output_args[i] + r * ldd + c, spare)[..., 0].clamp(0, spare)
        output_ext.index_put_((dst.flatten(),), acc.flatten())


def f8f8bf16_grouped_impl(XQ, WQ, scale, allocator, variant):
    device = XQ[0].device
    problem_count = len(XQ)
    output_sizes = [XQ[i].size(0) * WQ[i].size(0) for i in range(problem_count)]
    total_output_size = sum(output_sizes)
    n_args = problem_count * 3 + problem_count * 3 + problem_count * 3     # pointers, shapes, strides
    xq_space = torch.cat([x.reshape(-1) for x in XQ])                     # what the pointers address
    wq_space = torch.cat([w.reshape(-1) for w in WQ])
    scale_space = torch.cat([s.reshape(-1) for s in scale])
    output_ext = torch.zeros(total_output_size + 1, device=device)
    xq_offsets = [sum(XQ[j].numel() for j in range(i)) for i in range(problem_count)]
    wq_offsets = [sum(WQ[j].numel() for j in range(i)) for i in range(problem_count)]
    out_offsets = [sum(output_sizes[:i]) for i in range(problem_count)]
    if variant == "fix":
        input_args = torch.empty(n_args, dtype=torch.int64, device=device)
        output_args = torch.empty(problem_count, dtype=torch.int64, device=device)
        for i in range(problem_count):
            set_kernel_args_kernel(xq_offsets[i], wq_offsets[i], i, input_args, output_args, out_offsets[i], i,
                                   XQ[i].size(0), WQ[i].size(0), XQ[i].size(1))
        d_input_args, d_output_args = input_args, output_args
    else:
        input_block, output_block = allocator.allocate(n_args), allocator.allocate(problem_count)
        input_args, output_ptr = input_block.data.numpy(), output_block.data.numpy()   # host pointers
        for i in range(problem_count):                                    # the host fill loop
            m, n, k = XQ[i].size(0), WQ[i].size(0), XQ[i].size(1)
            output_ptr[i] = out_offsets[i]
            input_args[i], input_args[G + i], input_args[2 * G + i] = xq_offsets[i], wq_offsets[i], i
            input_args[3 * G + 3 * i:3 * G + 3 * i + 3] = (m, n, k)       # problem_shape_ptr[i]
            input_args[6 * G + i], input_args[7 * G + i], input_args[8 * G + i] = k, k, n   # strides
        d_input_args = torch.empty(n_args, dtype=torch.int64, device=device)
        d_output_args = torch.empty(problem_count, dtype=torch.int64, device=device)
        d_input_args.copy_(input_block.data[:n_args], non_blocking=True)          # cudaMemcpyAsync
        d_output_args.copy_(output_block.data[:problem_count], non_blocking=True)
        allocator.free(input_block)             # the pinned locals die at return: no event recorded
        allocator.free(output_block)
    cutlass_grouped_gemm(d_input_args, d_output_args, xq_space, wq_space, scale_space, output_ext)
    output_group = output_ext[:total_output_size].split(output_sizes)
    return [output_group[i].view(XQ[i].size(0), WQ[i].size(0)) for i in range(problem_count)]


def loopover_reference(XQ, WQ, scale, allocator=None, variant=None):
    """The test's reference: ``torch.matmul(x_group[i], w_group[i].t())`` per group."""
    return [torch.matmul(x, w.t()) * s for x, w, s in zip(XQ, WQ, scale)]


class MoEExperts:
    """An MoE layer's experts on tokens already sorted by expert: ``silu(x W1^T) W2^T``, two grouped GEMMs."""

    def __init__(self, device, variant, grouped_gemm):
        gen = generator(3373)
        self.w1 = [randn(F, D, gen=gen, device=device, scale=0.5) for _ in range(G)]
        self.w2 = [randn(D, F, gen=gen, device=device, scale=0.5) for _ in range(G)]
        self.scale1 = [randn(1, gen=gen, device=device, scale=0.2) + 1.0 for _ in range(G)]
        self.scale2 = [randn(1, gen=gen, device=device, scale=0.2) + 1.0 for _ in range(G)]
        self.allocator = CachingHostAllocator(device)
        self.variant, self.grouped_gemm = variant, grouped_gemm

    def forward(self, x):
        xq_group = list(x.split(MS))
        y_group = self.grouped_gemm(xq_group, self.w1, self.scale1, self.allocator, self.variant)
        h_group = [torch.nn.functional.silu(y) for y in y_group]
        out_group = self.grouped_gemm(h_group, self.w2, self.scale2, self.allocator, self.variant)
        return torch.cat(out_group)


def run(variant: str, device: str = "cpu"):
    gen = generator(463)
    batches = [torch.randn(sum(MS), D, generator=gen) for _ in range(STEPS)]

    def served():
        moe = MoEExperts(device, variant, f8f8bf16_grouped_impl)
        x = batches[0].to(device).clone()
        g, out = capture(lambda: moe.forward(x), device=device, warmups=1, name="moe-experts",
                         owner="graphed MoE step", static={"x": x})
        outs = []
        for batch in batches:
            x.copy_(batch.to(device))
            outs.append(replay(g, out).clone())
        return outs

    def eager():
        moe = MoEExperts(device, variant, loopover_reference)
        return [moe.forward(batch.to(device)).clone() for batch in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
