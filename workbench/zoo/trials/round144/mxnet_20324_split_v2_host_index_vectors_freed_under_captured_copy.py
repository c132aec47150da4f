"""MXNet's CUDA-graphs executor (``MXNET_ENABLE_CUDA_GRAPHS=1``, for blocks hybridized with ``static_alloc=True,
static_shape=True``) runs each bulked op segment of a ``CachedOp`` conventionally once, then captures it by running the
ops' host code while the stream captures, and from then on only launches the graph. ``CudaGraphsExec::OpOK`` keeps
stateful ops and ops with non-workspace resources out of the graph; everything else, ``_split_v2`` (``np.split``,
``_npi_split``) included, is captured. On the GPU, ``SplitOpForwardGPU`` sends a split whose last axis has fewer than
128 elements to ``SplitOpForwardImpl``, which builds two ``std::vector``s on the host (the split points ``indices`` and
the outputs' pointers ``output_data``), copies them into the op's temp-space workspace with ``mshadow::Copy`` (an
asynchronous host-to-device copy on the op's stream) and launches ``SplitKernel``, which reads both from the workspace.
Captured, each copy is a memcpy node that reads the vector's heap address at every launch, and both vectors are freed
when ``SplitOpForwardImpl`` returns, at capture: every launch of the graph, the first one right after the capture
included, copies freed host memory into the table the kernel uses to find its split points and its output buffers.
The fix (in the PR that ported the feature to MXNet 2.0) registers ``FIsCUDAGraphsCompatible`` returning false for
``_split_v2`` (and ``_npi_pad``), so ``OpOK`` bypasses the op: it runs conventionally between the segment's graphs, its
vectors alive for its copies.

Upstream: https://github.com/apache/mxnet/pull/20324 ("[2.0] [BACKPORT] of [1.x][FEATURE] CUDA graphs support (#19142)",
apache/mxnet, author Dick Carter (DickJC123), opened 2021-06-01, squash-merged to master 2022-03-18 as commit
5ab7f64c2e99890502aa456798b74523e76f3c17). The fix is the PR's commit 4a2dae456758afa2fda0c1c90b7562ae44108a8f
("Marked 2 ops CUDA Graphs incompatible due to cpu->gpu copy", Dick Carter, 2021-05-28), listed in the squash
commit's message. Read, in a mirror of the repository: that commit's whole diff (``src/operator/tensor/matrix_op.cu``:
``_split_v2`` and ``_split_v2_backward`` get ``FIsCUDAGraphsCompatible`` returning false, commented "Incompatible due to
Copy(xpu_tensor, cpu_tensor) in SplitOpForwardImpl"; ``src/operator/numpy/np_pad_op.cu``: the same for ``_npi_pad``);
at its parent: ``src/imperative/cuda_graphs.h`` (``CudaGraphsSubSegExec`` with ``MakeGraph``, ``MakeGraphExec``,
``Update``, ``RunSubSeg``, ``IsRunnable``; ``CudaGraphInfo``; ``CudaGraphCacheKey``; ``CudaGraphsExec`` with ``RunAll``,
``CreateSubExecOverRegion``, ``OpOK``, ``SetTempSpaces``, ``GetGPUTempspacePtrs``), ``CreateEngineOp`` in
``src/imperative/imperative_utils.h``, ``src/imperative/cached_op.cc`` (``StaticAllocMemory``'s dynamic entries,
``StaticInitExec``, ``StaticRunOps``' opening, ``StaticForward``), ``FIsCUDAGraphsCompatible`` in
``include/mxnet/op_attr_types.h``, and in ``src/operator/tensor/``: ``SplitKernel``, ``GetSplitIndices``,
``SplitOpForwardImpl``, ``SplitOpForward`` (``matrix_op-inl.h``), ``SplitOpForwardGPU`` (``matrix_op.cu``) and the
``_split_v2`` registration (``matrix_op.cc``: aliases ``_npi_split`` and ``_npi_array_split``, one ``kTempSpace``
resource). On the 1.x line: ``src/executor/cuda_graphs.h`` (same capture path) and ``matrix_op.cu`` of branch v1.x
(``_split_v2`` without the attribute); the tags 1.8.0 and 1.9.0 contain #19142. Also the PR's other commits' messages
and ``tests/python/gpu/test_gluon_gpu.py::test_cuda_graphs`` (its ``GraphTester`` wraps the tested op in
``identity`` ops "to be fully inside the graph"), and the stored text of PR #20324 and of #19142's description.
Not read: ``NumpyPadOpForward``; ``mshadow::Copy``'s body (I take it, as its stream argument says, to be a
``cudaMemcpyAsync`` on the op's stream); ``SplitOpBackward``; the threaded engine; ``CachedOp``'s backward; the PR's
review threads beyond the stored excerpt. No issue or user report names the split: the defect is read from the fix's
comment and the code, and what the freed memory holds at a launch is my inference, not upstream's words.
Symptom: none reported by users that I found; the fix commit says only "Marked 2 ops CUDA Graphs incompatible due to
cpu->gpu copy". What a launch copies is freed heap memory: glibc's ``free`` of a small chunk writes its tcache
bookkeeping over the chunk's first 16 bytes (my inference from glibc, not upstream's words), so the first two split
points and the first two output pointers the kernel reads are garbage: a store to an unmapped address, an illegal
memory access. PyTorch forbade the same pattern (pytorch#172156, ngimel: a pageable copy in a capture "may be safe from
cudagraphs perspective, however, nothing keeps this memory alive so we are encountering a lot of silent failures").
Mechanism: ``CudaGraphsExec::RunAll`` runs a segment conventionally on its first call, then ``MakeGraph`` runs the
segment's ops under ``cudaStreamBeginCapture`` and ``RunSubSeg`` launches the graph. Inside the capture,
``SplitOpForwardImpl`` computes ``indices`` on the host from the shape and ``SplitParam``, collects the outputs'
``dptr``s in ``output_data``, and ``mshadow::Copy``s both into the workspace; CUDA records memcpy nodes with the
vectors' host addresses, and the vectors die at ``SplitOpForwardImpl``'s return. Later launches run no host code: the
memcpy nodes read memory whose owner released it, and ``SplitKernel`` scatters with whatever they copied.
Doctor: dangling-reference, at ``SplitOpForwardImpl``: the graph reads host memory (the two vectors) after their owner
released it; ``SplitOpForwardImpl`` makes them, hands their addresses to the captured copies and frees them on return
(the fix's comment names it). The upstream change is a registration (``NNVM_REGISTER_OP(_split_v2)``), which has no
function name; the function that consults it is ``OpOK``.
Fix (upstream): ``_split_v2`` and ``_split_v2_backward`` (and ``_npi_pad``, ``_backward_npi_pad``) register
``FIsCUDAGraphsCompatible`` returning false; ``OpOK`` returns it, and ``RunAll`` makes a graph of the good ops before
the split, a non-runnable ``CudaGraphsSubSegExec`` for the split (run conventionally at every call), and a graph of
the ops after it.
Modelled: ``CudaGraphsExec`` (``RunAll``, ``OpOK``, ``CreateSubExecOverRegion``, ``SetTempSpaces``,
``GetGPUTempspacePtrs``, ``cache_``), ``CudaGraphsSubSegExec`` (``MakeGraph``, ``MakeGraphExec``, ``RunSubSeg``,
``IsRunnable``), ``CudaGraphInfo``, ``OpExecutor`` (``Run``, ``RunAll``), ``OpContext``, ``Resource``
(``get_space_typed``), ``NodeAttrs``, ``SplitParam``, the op registry attributes ``FCompute<gpu>``,
``FResourceRequest``, ``FCreateOpState`` and ``FIsCUDAGraphsCompatible``, ``SplitOpForwardGPU``,
``SplitOpForwardImpl``, ``GetSplitIndices``, ``SplitKernel``, ``Copy`` (``mshadow::Copy``), and a ``CachedOp`` with
``StaticForward``.
Stand-ins: the process heap is ``HostHeap``, one host arena (pinned on CUDA: torch refuses to capture a copy from
pageable memory, which the CUDA driver records) with glibc's size classes and LIFO tcache bins; ``free`` writes what
glibc's ``tcache_put`` writes (2.34 and later) into the chunk's first two words: a safe-linked ``next`` pointer and the
process's random ``tcache_key`` (the heap's base address and the key are fixed stand-in values). A ``std::vector``
filled by ``push_back`` is its last buffer (capacity 4 for 4 split points and for 3 pointers: one size class); the
smaller buffers its growth frees, and every other host allocation of the process, are not modelled. ``Copy`` follows
the driver for a pageable source: staged before returning eagerly, a memcpy node reading the address under capture.
A device pointer (``DType*``) is an element offset into the static-allocation pool that holds the split's outputs;
``SplitKernel`` scatters into that pool, and a store outside it (on the GPU a store to an unmapped address, an
illegal-address fault) goes to one spare element and sets a device flag that the next synchronisation (the caller
reading the output) reports as ``cudaErrorIllegalAddress`` (``CudaError``), so the CUDA context survives the run.
The other ops are torch expressions (``FullyConnected``, ``batch_dot``, ``softmax``, ``_copy``). Which ops are outside
the segment follows ``StaticInitExec``: the ops reading the data input or writing the graph output (dynamic entries)
run imperatively, here the two ``_copy`` ops of ``GraphTester``'s pattern. Not modelled: the capture-cache key's
stream (one worker), ``Update`` (recapture when temp-space pointers move: they do not here), the verbose paths, the
>= 128 custom kernel (parameters by value, no host copy), training. float64; the run without graphs is the same
``CachedOp`` with ``MXNET_ENABLE_CUDA_GRAPHS`` unset.
Workload: a single-head self-attention block (my workload, GluonNLP-like): ``_copy`` of the input, ``FullyConnected``
to a fused QKV of width 24, ``np.split`` into 3 (last axis 24 < 128: the ``SplitOpForwardImpl`` path), ``batch_dot``
of Q and K, ``softmax`` with temperature sqrt(8), ``batch_dot`` with V, ``FullyConnected`` out, ``_copy`` to the output;
batch 2, 4 tokens, width 8; six inference calls with fresh inputs. Output: the six outputs.
Measured: bug: misbehaves (raised CudaError: CUDA error: an illegal memory access was encountered
(cudaErrorIllegalAddress): SplitKernel stored outside any allocation), at the second call, the launch right after the
capture: the workspace then holds [94375978633747, 3416996391971084401, 16, 24] for the split points [0, 8, 16, 24]
and tcache bookkeeping over the first two output pointers too; fix: equals eager (max |graph - eager| = 0). Both
variants together in under 4 s on the CPU, imports included.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from workbench.engine import events, host, is_capturing
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/apache/mxnet/pull/20324"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "SplitOpForwardImpl"
SYMPTOM = ("with MXNET_ENABLE_CUDA_GRAPHS=1 a captured np.split (_split_v2, last axis < 128) copies its split points "
           "and output pointers from host vectors SplitOpForwardImpl freed at capture: every launch reads freed memory")

DTYPE = torch.float64
B, T, D = 2, 4, 8                 # batch, tokens, width: the fused QKV has 3 * D = 24 < 128 columns
SECTIONS = 3
NUM_REQUESTS = 6
WORKSPACE_WORDS = 16              # the per-worker kTempSpace (8-byte words: size_t and DType* alike)
kTempSpace = "kTempSpace"
HEAP_BASE = 0x55D0C3A2B000        # the address of the heap arena's first byte (stand-in)
TCACHE_KEY = 0x2F6B9C1D4E3A5871   # glibc's per-process random tcache_key (stand-in value)
_variant = "bug"
_heap = None                      # the process heap (HostHeap) of the current run


class CudaError(RuntimeError):
    pass


# --- the host process: glibc malloc (tcache bins) over one arena -----------------------------------------------------

class HostHeap:
    """The process heap: a request of ``n`` bytes gets a chunk of ``max(32, round_up(n + 8, 16))`` bytes; a freed chunk
    goes on its size class's tcache bin (LIFO), and ``free`` writes the bin's bookkeeping into the chunk's first two
    words, as glibc's ``tcache_put`` does (2.34 and later: a safe-linked ``next`` and the process's ``tcache_key``)."""

    def __init__(self, device: str, arena_words: int = 256) -> None:
        self.arena = host(torch.zeros(arena_words, dtype=torch.int64), device)    # host memory, never a graph's
        self.top, self.tcache = 0, {}

    @staticmethod
    def chunk_size(nbytes: int) -> int:
        return max(32, (nbytes + 8 + 15) & ~15)

    def malloc(self, nbytes: int) -> tuple[int, Tensor]:
        size = self.chunk_size(nbytes)
        free = self.tcache.get(size)
        if free:
            start = free.pop()                                      # tcache_get: the most recently freed chunk
        else:
            start, self.top = self.top, self.top + size // 8
            assert self.top <= self.arena.numel(), "arena exhausted"
        return size, self.arena[start + 1:start + size // 8]       # user memory after the chunk header

    def free(self, size: int, mem: Tensor) -> None:
        bin_ = self.tcache.setdefault(size, [])
        head = HEAP_BASE + 8 * (bin_[-1] + 1) if bin_ else 0        # tcache->entries[tc_idx]
        pos = HEAP_BASE + 8 * mem.storage_offset()                  # &e->next
        words = mem.numpy()
        words[0] = (pos >> 12) ^ head                               # e->next = PROTECT_PTR(&e->next, entries[tc_idx])
        words[1] = TCACHE_KEY                                       # e->key = tcache_key
        bin_.append(mem.storage_offset() - 1)


class StdVector:
    """A ``std::vector`` of 8-byte elements filled by ``push_back``: its buffer (capacity 1, 2, 4, ...: only the last
    one is modelled) is a heap chunk until the vector goes out of scope."""

    def __init__(self, heap: HostHeap, values: list) -> None:
        capacity = 1
        while capacity < len(values):
            capacity *= 2
        self.heap, self.n = heap, len(values)
        self.chunk, self.mem = heap.malloc(8 * capacity)
        self.mem.numpy()[:self.n] = values                          # plain host stores

    def size(self) -> int:
        return self.n

    def data(self) -> Tensor:
        return self.mem[:self.n]

    def destroy(self) -> None:                                      # ~vector() at the end of its scope
        self.heap.free(self.chunk, self.mem)


# --- operator registry (NNVM_REGISTER_OP) ----------------------------------------------------------------------------

class NodeAttrs:
    def __init__(self, op: str, parsed=None, name: str = "") -> None:
        self.op, self.parsed, self.name = op, parsed or {}, name or op


class SplitParam:
    def __init__(self, axis: int, sections: int = 0, indices: tuple = (), squeeze_axis: bool = False) -> None:
        self.axis, self.sections, self.indices, self.squeeze_axis = axis, sections, indices, squeeze_axis


def FullyConnectedCompute(attrs, ctx, inputs, req, outputs) -> None:
    x, weight, bias = inputs
    outputs[0].copy_(torch.matmul(x, weight.t()) + bias)          # flatten=False


def BatchDotForward_(attrs, ctx, inputs, req, outputs) -> None:
    lhs, rhs = inputs
    if attrs.parsed.get("transpose_b"):
        rhs = rhs.transpose(-1, -2)
    outputs[0].copy_(torch.matmul(lhs, rhs))


def SoftmaxCompute(attrs, ctx, inputs, req, outputs) -> None:
    outputs[0].copy_(torch.softmax(inputs[0] / attrs.parsed["temperature"], dim=-1))


def IdentityCompute(attrs, ctx, inputs, req, outputs) -> None:
    outputs[0].copy_(inputs[0])


def GetSplitIndices(ishape, axis: int, sections: int) -> list:
    indices = [-1] * (sections + 1)
    indices[0] = 0
    section_size_b = ishape[axis] // sections
    section_size_a = section_size_b + 1
    section_a = ishape[axis] % sections
    for i in range(sections):
        indices[i + 1] = section_size_a * (i + 1) if i < section_a else section_size_b + indices[i]
    return indices


def Copy(dst: Tensor, src: Tensor, s) -> None:
    """``mshadow::Copy(Tensor<gpu>, Tensor<cpu>, stream)``: ``cudaMemcpyAsync`` host-to-device on the op's stream from
    pageable memory: eagerly the runtime stages the source before returning; under stream capture the memcpy node
    keeps the source's host address and reads it at every launch of the graph."""
    dst.copy_(src, non_blocking=is_capturing())


def dptr(arr: Tensor) -> int:
    """``TBlob::dptr<DType>()`` (stand-in: the element offset of ``arr`` in the static-allocation pool)."""
    return arr.storage_offset()


def SplitKernel(N: int, in_data: Tensor, pool: Tensor, fault: Tensor, out_data: Tensor, indices: Tensor,
                num_sections: int, axis_size: int, trailing_size: int) -> None:
    """``Kernel<SplitKernel, gpu>::Launch``: element ``i`` goes to ``out_data[target][target_idx]``. (Stand-in: a store
    outside the device memory the pool stands for lands in the pool's spare last element and sets ``fault``, the
    device's illegal-address error, which the next synchronisation reports.)"""
    i = torch.arange(N, device=in_data.device)
    idx = i // trailing_size % axis_size
    # for (section = 0; section < num_sections && indices[section] <= idx; target = section++) {}
    target = ((indices[:num_sections].unsqueeze(0) <= idx.unsqueeze(1)).sum(dim=1) - 1).clamp(min=0)
    mid_idx = idx - indices[target]
    head_idx = i // (trailing_size * axis_size)
    tail_idx = i % trailing_size
    section_size = indices[target + 1] - indices[target]
    target_idx = head_idx * trailing_size * section_size + mid_idx * trailing_size + tail_idx
    dest = out_data[target] + target_idx
    in_bounds = (dest >= 0) & (dest < pool.numel() - 1)
    fault.logical_or_((~in_bounds).any())
    pool.index_copy_(0, torch.where(in_bounds, dest, torch.full_like(dest, pool.numel() - 1)), in_data.reshape(-1))


def SplitOpForwardImpl(attrs, ctx, inputs, req, outputs, real_axis: int) -> None:
    param = attrs.parsed
    s = ctx.get_stream()
    input_data = inputs[0]
    ishape = tuple(input_data.shape)
    trailing = math.prod(ishape[real_axis + 1:])
    mid = ishape[real_axis]
    split_pts = GetSplitIndices(ishape, real_axis, param.sections) if param.sections > 0 else list(param.indices)
    points = list(split_pts)
    if param.sections == 0:
        points.append(ishape[real_axis])
    indices = StdVector(_heap, points)                              # std::vector<size_t> indices;
    workspace_size = indices.size()
    # MSHADOW_TYPE_SWITCH(input_data.type_flag_, DType, { ...
    output_data = StdVector(_heap, [dptr(data) for data in outputs])   # std::vector<DType*> output_data;
    workspace_size += output_data.size()
    workspace = ctx.requested[0].get_space_typed(workspace_size, s)
    indices_cpu_tensor = indices.data()                             # Tensor<cpu, 1, size_t>(indices.data(), ...)
    indices_xpu_tensor = workspace[:indices.size()]
    ptrs_cpu_tensor = output_data.data()
    ptrs_xpu_tensor = workspace[indices.size():workspace_size]
    Copy(indices_xpu_tensor, indices_cpu_tensor, s)
    Copy(ptrs_xpu_tensor, ptrs_cpu_tensor, s)
    SplitKernel(input_data.numel(), input_data, ctx.pool, ctx.fault, ptrs_xpu_tensor, indices_xpu_tensor,
                indices.size() - 1, mid, trailing)
    output_data.destroy()                                           # ... }): output_data goes out of scope
    indices.destroy()                                               # return: so does indices


def SplitOpForwardGPU(attrs, ctx, inputs, req, outputs) -> None:
    param = attrs.parsed
    real_axis = param.axis + inputs[0].dim() if param.axis < 0 else param.axis
    last_axis_size = inputs[0].shape[-1]
    # custom kernel will not be efficient with less than 128 elements in last axis
    assert last_axis_size < 128, "the >= 128 kernel (parameters passed by value) is not modelled"
    SplitOpForwardImpl(attrs, ctx, inputs, req, outputs, real_axis)


def _registry() -> dict:
    ops = {
        "_copy": {"FCompute<gpu>": IdentityCompute},
        "FullyConnected": {"FCompute<gpu>": FullyConnectedCompute},
        "batch_dot": {"FCompute<gpu>": BatchDotForward_},
        "softmax": {"FCompute<gpu>": SoftmaxCompute},
        "_split_v2": {"FCompute<gpu>": SplitOpForwardGPU, "FResourceRequest": [kTempSpace]},
    }
    if _variant == "fix":
        # Incompatible due to Copy(xpu_tensor, cpu_tensor) in SplitOpForwardImpl
        ops["_split_v2"]["FIsCUDAGraphsCompatible"] = lambda attrs, is_train: False
    return ops


# --- executors and resources ------------------------------------------------------------------------------------------

class Resource:
    """The per-worker ``kTempSpace`` resource: one workspace whose address stays put once it is big enough."""

    def __init__(self, device: str) -> None:
        self.type = kTempSpace
        self.space = torch.zeros(WORKSPACE_WORDS, dtype=torch.int64, device=device)

    def get_space_typed(self, n: int, s) -> Tensor:
        assert n <= WORKSPACE_WORDS
        return self.space[:n]


class RunContext:
    def __init__(self, device: str) -> None:
        self.stream = device


class OpContext:
    def __init__(self, device: str, requested: list, pool: Tensor | None, fault: Tensor, is_train: bool = False):
        self.device, self.requested, self.pool, self.fault, self.is_train = device, requested, pool, fault, is_train

    def get_stream(self):
        return self.device


class OpExecutor:
    def __init__(self, attrs: NodeAttrs, registry: dict, in_array: list, out_array: list, op_ctx: OpContext) -> None:
        self.attrs, self.in_array, self.out_array, self.op_ctx = attrs, in_array, out_array, op_ctx
        self.fcompute = registry[attrs.op]["FCompute<gpu>"]
        self.req = ["kWriteTo"] * len(out_array)

    def Run(self, rctx: RunContext, is_gpu: bool) -> None:
        self.fcompute(self.attrs, self.op_ctx, self.in_array, self.req, self.out_array)

    @staticmethod
    def RunAll(exec_list: list, rctx: RunContext, is_gpu: bool) -> None:
        for exec_ in exec_list:
            exec_.Run(rctx, is_gpu)


# --- src/imperative/cuda_graphs.h ------------------------------------------------------------------------------------

class CudaGraphsSubSegExec:
    """A CUDA graph of ops ``[from_op_idx, from_op_idx + num_ops)`` of a segment, or those ops run conventionally."""

    def __init__(self, exec_list, rctx, is_gpu, verbose, from_op_idx, num_ops, ops_are_cuda_graph_compatible=True):
        self.from_op_idx_, self.num_ops_ = from_op_idx, num_ops
        self.graph_ = self.graph_exec_ = self.outputs_ = None
        if ops_are_cuda_graph_compatible:
            self.MakeGraph(exec_list, rctx, is_gpu, verbose, from_op_idx, num_ops)
            self.MakeGraphExec()

    def RunSubSeg(self, exec_list, rctx, is_gpu) -> None:
        if self.IsRunnable():
            replay(self.graph_exec_, self.outputs_)                # cudaGraphLaunch(graph_exec_, cu_s)
        else:
            # No CUDA Graph could be made for this portion of the OpSegment.  Run conventionally.
            for i in range(self.num_ops_):
                exec_list[self.from_op_idx_ + i].Run(rctx, is_gpu)

    def IsRunnable(self) -> bool:
        return self.graph_exec_ is not None

    def MakeGraph(self, exec_list, rctx, is_gpu, verbose, from_op_idx, num_ops) -> None:
        def run_oprs():
            # Run those oprs in the sub segment while capturing- no actual GPU work is launched.
            for i in range(num_ops):
                exec_list[from_op_idx + i].Run(rctx, is_gpu)
            return exec_list[from_op_idx + num_ops - 1].out_array[0]
        names = "+".join(e.attrs.name for e in exec_list[from_op_idx:from_op_idx + num_ops])
        # cudaStreamBeginCapture(cu_s, cudaStreamCaptureModeThreadLocal) ... cudaStreamEndCapture
        self.graph_, self.outputs_ = capture(run_oprs, device=rctx.stream, warmups=0, name=f"mxnet op seg [{names}]",
                                             owner="mxnet CudaGraphsExec", capture_error_mode="thread_local")

    def MakeGraphExec(self) -> None:
        self.graph_exec_ = self.graph_                             # cudaGraphInstantiate (torch: at capture end)


class CudaGraphInfo:
    def __init__(self) -> None:
        self.cuda_graph_subseg_execs: list = []
        self.has_been_run_conventionally = False
        self.tempspace_dptrs: list = []


class CudaGraphsExec:
    def __init__(self, exec_list, is_gpu, opr_names, registry, enabled: bool) -> None:
        self.opr_names_, self.registry, self.verbose_ = opr_names, registry, False
        self.is_enabled_ = is_gpu and enabled                      # dmlc::GetEnv("MXNET_ENABLE_CUDA_GRAPHS", false)
        self.cache_: dict = {}
        self.tempspaces_: list = []
        self.SetTempSpaces(exec_list)

    def RunAll(self, exec_list, rctx, is_gpu) -> None:
        if not is_gpu or not self.is_enabled_:
            OpExecutor.RunAll(exec_list, rctx, is_gpu)
            return
        is_train = len(exec_list) > 0 and exec_list[0].op_ctx.is_train
        cuda_graph_info = self.cache_.setdefault((rctx.stream, is_train), CudaGraphInfo())   # CudaGraphCacheKey
        if not cuda_graph_info.has_been_run_conventionally:
            with events.warmup(real=True):                         # a real call, run conventionally
                OpExecutor.RunAll(exec_list, rctx, is_gpu)
            cuda_graph_info.has_been_run_conventionally = True
            return
        before_exec_tempspace_ptrs = self.GetGPUTempspacePtrs()
        if cuda_graph_info.cuda_graph_subseg_execs:
            assert cuda_graph_info.tempspace_dptrs == before_exec_tempspace_ptrs, "Update() is not modelled"
        else:
            # No executors exist yet, so create them. Make one or more CUDA Graphs, avoiding ops that are not OK.
            first_op_idx = 0
            while first_op_idx != len(exec_list):
                num_good_ops = 0
                for last_op_idx in range(first_op_idx, len(exec_list)):
                    if not self.OpOK(exec_list[last_op_idx]):
                        break
                    num_good_ops += 1
                if num_good_ops > 0:
                    self.CreateSubExecOverRegion(exec_list, rctx, is_gpu, first_op_idx, first_op_idx + num_good_ops,
                                                 cuda_graph_info.cuda_graph_subseg_execs)
                    first_op_idx += num_good_ops
                if first_op_idx != len(exec_list):
                    # We had to have hit an op that was not OK.
                    cuda_graph_info.cuda_graph_subseg_execs.append(
                        CudaGraphsSubSegExec(exec_list, rctx, is_gpu, False, first_op_idx, 1, False))
                    first_op_idx += 1
            if self.GetGPUTempspacePtrs() != before_exec_tempspace_ptrs:
                raise RuntimeError("Internal error: saw change in TempSpace ptrs during CUDA graph use.")
            cuda_graph_info.tempspace_dptrs = before_exec_tempspace_ptrs
        # Now execute the CUDA Graph that we either just created or looked-up in the cache.
        for subseg_exec in cuda_graph_info.cuda_graph_subseg_execs:
            subseg_exec.RunSubSeg(exec_list, rctx, is_gpu)

    def CreateSubExecOverRegion(self, exec_list, rctx, is_gpu, from_op_idx, upto_op_idx, cuda_graph_subseg_execs):
        # Optimistically try to create a CUDA Graph of the entire op segment region (it is runnable here)
        full_opseg = CudaGraphsSubSegExec(exec_list, rctx, is_gpu, self.verbose_, from_op_idx,
                                          upto_op_idx - from_op_idx)
        assert full_opseg.IsRunnable()
        cuda_graph_subseg_execs.append(full_opseg)

    def OpOK(self, exec_) -> bool:
        """Is the Op OK to make part of a CUDA Graph?"""
        attrs = self.registry[exec_.attrs.op]
        f = attrs.get("FIsCUDAGraphsCompatible")
        if f is not None:
            return f(exec_.attrs, exec_.op_ctx.is_train)
        if attrs.get("FCreateOpState") is not None:
            return False
        return all(resource.type == kTempSpace for resource in exec_.op_ctx.requested)

    def SetTempSpaces(self, exec_list) -> None:
        if self.is_enabled_:
            found = {id(r): r for e in exec_list for r in e.op_ctx.requested if r.type == kTempSpace}
            self.tempspaces_ = list(found.values())

    def GetGPUTempspacePtrs(self) -> list:
        return [r.space.data_ptr() for r in self.tempspaces_]


# --- the hybridized block (CachedOp, static_alloc=True, static_shape=True) --------------------------------------------

class CachedOp:
    """``y = identity(FC_out(batch_dot(softmax(batch_dot(q, k^T) / sqrt(D)), v)))``, ``q, k, v = split(FC_qkv(x))``."""

    def __init__(self, params: dict, device: str, cuda_graphs: bool) -> None:
        registry = _registry()
        self.device, self.rctx = device, RunContext(device)
        temp_space = Resource(device)

        def z(*shape):
            return torch.zeros(*shape, dtype=DTYPE, device=device)
        # StaticAllocMemory: every internal entry gets its memory once; the split's outputs share one pool
        self.x_in, self.qkv = z(B, T, D), z(B, T, SECTIONS * D)
        self.split_pool = z(SECTIONS * B * T * D + 1)                # (+1: the spare element of SplitKernel's stand-in)
        self.fault = torch.zeros((), dtype=torch.bool, device=device)  # the device's sticky illegal-address error
        q, k, v = (self.split_pool[i * B * T * D:(i + 1) * B * T * D].view(B, T, D) for i in range(SECTIONS))
        self.scores, self.attn, self.context, self.out = z(B, T, T), z(B, T, T), z(B, T, D), z(B, T, D)

        def ctx(resources=(), pool=None):
            return OpContext(device, list(resources), pool, self.fault)

        def op(name, parsed, ins, outs, context, node=""):
            return OpExecutor(NodeAttrs(name, parsed, node), registry, ins, outs, context)
        # StaticInitExec: ops that read the data input or write the graph output (dynamic entries) are not bulked
        self.copy_in = op("_copy", None, [None], [self.x_in], ctx())
        self.segment = [
            op("FullyConnected", None, [self.x_in, params["w_qkv"], params["b_qkv"]], [self.qkv], ctx(), "qkv_proj"),
            op("_split_v2", SplitParam(axis=-1, sections=SECTIONS), [self.qkv], [q, k, v],
               ctx([temp_space], self.split_pool)),
            op("batch_dot", {"transpose_b": True}, [q, k], [self.scores], ctx(), "qk"),
            op("softmax", {"temperature": math.sqrt(D)}, [self.scores], [self.attn], ctx()),
            op("batch_dot", {"transpose_b": False}, [self.attn, v], [self.context], ctx(), "av"),
            op("FullyConnected", None, [self.context, params["w_out"], params["b_out"]], [self.out], ctx(),
               "out_proj"),
        ]
        self.copy_out = op("_copy", None, [self.out], [None], ctx())
        # CreateEngineOp: the bulked segment's exec_fun owns a CudaGraphsExec
        self.cuda_graphs_exec = CudaGraphsExec(self.segment, True, "attention segment", registry, cuda_graphs)
        if cuda_graphs:
            events.static_buffers("mxnet CachedOp", {"x_in": self.x_in})

    def StaticForward(self, x: Tensor) -> Tensor:
        self.copy_in.in_array[0] = x                               # arrays[eid] = inputs[...] (data entry)
        self.copy_in.Run(self.rctx, True)
        self.cuda_graphs_exec.RunAll(self.segment, self.rctx, True)
        output = torch.empty(B, T, D, dtype=DTYPE, device=self.device)   # PrepareOutputs: the caller's NDArray
        self.copy_out.out_array[0] = output
        self.copy_out.Run(self.rctx, True)
        if bool(self.fault):                                       # the caller reads the output: a synchronisation
            raise CudaError("CUDA error: an illegal memory access was encountered (cudaErrorIllegalAddress): "
                            "SplitKernel stored outside any allocation")
        return output


def _params(device: str) -> dict:
    gen = generator(144)

    def w(*shape, scale=0.35):
        return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
    return {"w_qkv": w(SECTIONS * D, D), "b_qkv": w(SECTIONS * D, scale=0.1),
            "w_out": w(D, D), "b_out": w(D, scale=0.1)}


def _requests(device: str) -> list:
    gen = generator(2020)
    return [torch.randn(B, T, D, generator=gen, dtype=DTYPE).to(device) for _ in range(NUM_REQUESTS)]


def infer(device: str, cuda_graphs: bool) -> list:
    """Six inference calls of the hybridized block."""
    global _heap
    _heap = HostHeap(device)
    net = CachedOp(_params(device), device, cuda_graphs)
    outputs = [net.StaticForward(x) for x in _requests(device)]
    return [torch.stack(outputs)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: infer(device, cuda_graphs=True),
                       lambda: infer(device, cuda_graphs=False))
    finally:
        _variant = "bug"
