"""tinygrad's CUDA graph runner builds every kernel node with 0 bytes of dynamic shared memory.

Upstream: https://github.com/tinygrad/tinygrad/pull/16699 ("cuda: pass kernel dynamic shared memory in the graph
runner", commit f38836d14d). Diff read (the one-line change in ``tinygrad/runtime/graph/cuda.py``), plus
``tinygrad/runtime/ops_cuda.py`` at the parent commit for the eager launch contract.
Symptom: "a custom_kernel using dynamic shared memory (extern __shared__) failed with CUDA error 700 on graph
replay while the eager path worked" (commit message).
Mechanism: the eager launch, ``CUDAProgram.__call__``, runs ``cuLaunchKernel(self.prg, *global_size,
*local_size, self.smem, ...)``, so a kernel compiled with ``smem > 0`` gets ``smem`` bytes of
``extern __shared__`` memory per block. ``CUDAGraph.__init__`` (the JIT's graph runner) adds each PROGRAM
item as a kernel node with ``CUDA_KERNEL_NODE_PARAMS_v1(runtime.prg, *global_size, *local_size, 0, ...)``:
``sharedMemBytes`` hardcoded to 0. Kernels that only use static ``__shared__`` arrays are unaffected; a custom
kernel that stages its tile in dynamic shared memory writes past a 0-byte allocation on the graph launch
(illegal address, error 700). Here a launch's dynamic shared memory is a scratch tensor of
``sharedMemBytes // 4`` floats per block, allocated by the launch; the kernel's store of its tile into it
does not fit the 0-element scratch and raises (the CPU's and torch's out-of-bounds error, in place of error
700). The emulation executes the kernels while it records them, so the error surfaces on the graph-building
call itself (the third JIT call), where upstream it surfaces at that call's ``cuGraphLaunch``.
Doctor: undersized-buffer, at ``rms_norm_smem`` (the custom kernel stores its tile into a dynamic-shared-memory
scratch the graph node sized at 0 bytes; the eager launch sizes it ``smem``).
Fix (upstream): pass ``runtime.smem`` as ``sharedMemBytes`` of the kernel node (0 for ordinary kernels, which use
static shared memory).
(A two-kernel TinyJit: the custom RMS-norm kernel with dynamic shared memory, then an ordinary projection
kernel; ``eager()`` launches the same kernels with ``CUDAProgram.__call__`` on every call.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/tinygrad/tinygrad/pull/16699"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "rms_norm_smem"
SYMPTOM = "a custom kernel using extern __shared__ faults (CUDA error 700) on graph replay; eager works"

BLOCKS, LOCAL, EPS = 2, 4, 1e-6               # global_size (blocks), local_size (threads per block)


def rms_norm_smem(smem, out, x, w):
    """``custom_kernel``: ``extern __shared__ float smem[];`` each thread stores its element
    (``smem[tid] = x[blk*LOCAL+tid]``), then the block reduces the tile to its RMS."""
    tile = smem[:, :LOCAL]
    tile.copy_(x.view(BLOCKS, LOCAL))
    rms = torch.rsqrt((tile * tile).mean(-1, keepdim=True) + EPS)
    out.copy_((x.view(BLOCKS, LOCAL) * rms).view(-1) * w)


def E_proj(smem, out, h, wo):
    """An ordinary generated kernel (static shared memory only, ``smem = 0``)."""
    out.copy_(torch.tanh(h * wo))


def cuLaunchKernel(prg, global_size, local_size, shared_mem_bytes, args):
    """A launch: each block gets ``shared_mem_bytes`` of dynamic shared memory."""
    smem = torch.empty(global_size[0], shared_mem_bytes // 4, device=args[0].device)
    prg(smem, *args)


class CUDAProgram:
    def __init__(self, name, fxn, smem: int = 0):
        self.name, self.prg, self.smem = name, fxn, smem
        # (cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, smem) when smem > 0)

    def __call__(self, *args, global_size=(1, 1, 1), local_size=(1, 1, 1)):
        return cuLaunchKernel(self.prg, global_size, local_size, self.smem, args)


@dataclasses.dataclass
class CUDA_KERNEL_NODE_PARAMS_v1:
    func: object
    gridDimX: int
    gridDimY: int
    gridDimZ: int
    blockDimX: int
    blockDimY: int
    blockDimZ: int
    sharedMemBytes: int
    kernelParams: list


class ExecItem:
    def __init__(self, prg: CUDAProgram, bufs, global_size, local_size):
        self.prg, self.bufs, self.global_size, self.local_size = prg, bufs, global_size, local_size

    def run(self):
        self.prg(*self.bufs, global_size=self.global_size, local_size=self.local_size)


class CUDAGraph:
    """``tinygrad/runtime/graph/cuda.py`` (GraphRunner): one kernel node per PROGRAM item; the input slots'
    kernel params are repointed at the caller's buffers before each launch (here: copied into a graph-held
    parameter buffer)."""

    def __init__(self, jit_cache, input_buffers, variant):
        self.input_params = [torch.empty_like(b) for b in input_buffers]
        self.nodes = []
        for ji in jit_cache:
            args = [self.input_params[[id(x) for x in input_buffers].index(id(b))]
                    if any(b is x for x in input_buffers) else b for b in ji.bufs]
            runtime = ji.prg
            smem = runtime.smem if variant == "fix" else 0
            self.nodes.append(CUDA_KERNEL_NODE_PARAMS_v1(runtime.prg, *ji.global_size, *ji.local_size, smem, args))
        self.outputs = self.nodes[-1].kernelParams[0]
        self.graph, _ = capture(self._launch, device=str(input_buffers[0].device), warmups=0,
                                name="TinyJit graph", owner="tinygrad CUDAGraph (GraphRunner)",
                                static={f"input_buffers[{i}]": p for i, p in enumerate(self.input_params)})

    def _launch(self):
        for n in self.nodes:
            cuLaunchKernel(n.func, (n.gridDimX, n.gridDimY, n.gridDimZ), (n.blockDimX, n.blockDimY, n.blockDimZ),
                           n.sharedMemBytes, n.kernelParams)
        return self.outputs

    def __call__(self, input_buffers):
        for p, b in zip(self.input_params, input_buffers):   # cuGraphExecKernelNodeSetParams
            p.copy_(b)
        return replay(self.graph, self.outputs)


class Model:
    def __init__(self, device):
        gen = generator(16699)
        self.w = randn(BLOCKS * LOCAL, gen=gen, device=device)
        self.wo = randn(BLOCKS * LOCAL, gen=gen, device=device)
        self.h = torch.empty(BLOCKS * LOCAL, device=device)
        self.out = torch.empty(BLOCKS * LOCAL, device=device)
        # the custom kernel declares its dynamic shared memory: one float per thread
        self.norm = CUDAProgram("rms_norm_smem", rms_norm_smem, smem=LOCAL * 4)
        self.proj = CUDAProgram("E_proj", E_proj)

    def jit_cache(self, x):
        return [ExecItem(self.norm, [self.h, x, self.w], (BLOCKS, 1, 1), (LOCAL, 1, 1)),
                ExecItem(self.proj, [self.out, self.h, self.wo], (BLOCKS, 1, 1), (LOCAL, 1, 1))]


class TinyJit:
    """Call 1 runs the kernels, call 2 records them, call 3 builds the graph; later calls replay it."""

    def __init__(self, model, variant):
        self.model, self.variant, self.cnt = model, variant, 0
        self.graph_runner = None

    def __call__(self, x):
        if self.cnt < 2:
            for ei in self.model.jit_cache(x):
                ei.run()
            self.cnt += 1
            return self.model.out
        if self.graph_runner is None:
            self.graph_runner = CUDAGraph(self.model.jit_cache(x), [x], self.variant)
        return self.graph_runner([x])


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(1)
    xs = [randn(BLOCKS * LOCAL, gen=gen, device=device) for _ in range(5)]

    def serve(jitted: bool):
        jit = TinyJit(model, variant)
        outs = []
        for x in xs:
            if jitted:
                out = jit(x.clone())
            else:
                for ei in model.jit_cache(x.clone()):
                    ei.run()
                out = model.out
            outs.append(out.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
