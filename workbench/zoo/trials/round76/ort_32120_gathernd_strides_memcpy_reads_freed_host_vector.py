"""A captured CUDA ``GatherND`` copies its slice strides from a ``std::vector`` freed at return: replays use the next GatherND's strides.

Upstream: https://github.com/microsoft/onnxruntime/pull/32120 ("[CUDA] Make GatherND capture-safe",
microsoft/onnxruntime, merged 2026-08-17).
Symptom: with the CUDA EP's CUDA graph on (``enable_cuda_graph``), a model with ``GatherND`` nodes gives wrong
outputs on replays: "the slice offsets then come out as garbage and the gather reads far outside its input". The
same session with the CUDA graph off is correct. No error is raised.
Mechanism: ``GatherNDBase::PrepareCompute`` (onnxruntime/core/providers/cuda/tensor/gather_nd.cc) builds the
per-slice-dimension strides in a local ``std::vector<int64_t> sizes_from_slice_dims(num_slice_dims)``, takes a
scratch buffer (``GetScratchBuffer``) and stages the strides with ``cudaMemcpyAsync(...,
sizes_from_slice_dims.data(), ..., cudaMemcpyHostToDevice, stream)``; ``ComputeSliceOffsetsImpl`` then reads them
from device memory. Eagerly the copy from a pageable vector is staged before the call returns, so freeing the
vector at return is harmless. Under graph capture (the CUDA EP's ``OnRunStart`` begins it, ``OnRunEnd`` ends it
and replays once) the memcpy becomes a node that keeps the vector's *host address* and re-reads it at every
replay, long after the vector is gone. The heap hands the freed chunk to the next allocation of its size class:
the next ``GatherND`` of the same run allocates its own strides vector there and writes its strides. Every
replay then computes the first GatherND's slice offsets with the second one's strides.
Doctor: dangling-reference, at PrepareCompute (its captured host-to-device copy reads a host vector that
PrepareCompute released on return and the heap gave to the next GatherND's PrepareCompute).
Fix (upstream): the strides are built in a ``TArray<int64_t>`` and passed to ``ComputeSliceOffsetsImpl`` /
``_ComputeSliceOffsetsKernel`` by value (kernel arguments, baked into the captured launch); the scratch buffer and
the async copy are dropped.
Modelled: an ONNX graph of three nodes: last-token pooling ``GatherND(hidden_states [B,S,H], last_index [B,1],
batch_dims=1)``, a ``MatMul`` with an initializer, and candidate scoring ``GatherND(logits [B,V], candidate_ids
[B,K,1], batch_dims=1)``; inputs and the output bound with IOBinding at fixed device addresses, one regular run
before the capture run (the CUDA EP's minimum), all later runs replays. The CUDA kernels are torch ops
(``CUDA_KERNEL_ASSERT`` left out; offsets stay in bounds here). The process heap (glibc ``malloc``: chunk size
classes, a LIFO tcache bin per class) is ``HostHeap`` over one host arena made at session creation: ``host()``,
i.e. pinned on CUDA, because torch refuses a captured copy from pageable memory, which the CUDA driver records;
the copy's semantics are the driver's for a pageable source (staged at the call eagerly, a node reading the
address under capture). Other host allocations of the run are not modelled.
"""
from __future__ import annotations

import torch

from workbench.engine import host, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime/pull/32120"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "PrepareCompute"
SYMPTOM = "CUDA-graph replays pool the wrong hidden-state elements: GatherND's captured strides copy reads a freed vector"

B, S, H, V, K = 2, 6, 4, 8, 3       # batch, sequence, hidden, vocabulary, candidates per row
STEPS = 4
kMaxTArrayDims = 8                  # TArray<int64_t>::capacity


# --- the host process: glibc malloc (tcache bins) over one arena --------------------------------------------------

class HostHeap:
    """The process heap: a request of ``n`` bytes gets a chunk of ``max(32, round_up(n + 8, 16))`` bytes; a freed
    chunk goes on its size class's bin and the next ``malloc`` of that class takes the most recently freed one."""

    def __init__(self, device: str, arena_bytes: int = 1024):
        self.arena = host(torch.zeros(arena_bytes // 8, dtype=torch.int64), device)   # host memory, never a graph's
        self.top, self.tcache = 0, {}

    @staticmethod
    def chunk_size(nbytes: int) -> int:
        return max(32, (nbytes + 8 + 15) & ~15)

    def malloc(self, nbytes: int) -> tuple[int, torch.Tensor]:
        size = self.chunk_size(nbytes)
        free = self.tcache.get(size)
        if free:
            start = free.pop()
        else:
            start, self.top = self.top, self.top + size // 8
            assert self.top <= self.arena.numel(), "arena exhausted"
        return size, self.arena[start + 1:start + size // 8]      # user memory after the chunk header

    def free(self, size: int, mem: torch.Tensor) -> None:
        self.tcache.setdefault(size, []).append(mem.storage_offset() - 1)


class StdVector:
    """``std::vector<int64_t>(n)``: its elements in a heap chunk until the vector goes out of scope."""

    def __init__(self, heap: HostHeap, n: int):
        self.heap, self.n = heap, n
        self.chunk, self.mem = heap.malloc(8 * n)
        self.mem.numpy()[:n] = 0                                  # value-initialised (plain host stores)

    def __setitem__(self, i: int, value: int) -> None:
        self.mem.numpy()[i] = value

    def size(self) -> int:
        return self.n

    def data(self) -> torch.Tensor:
        return self.mem[:self.n]

    def destroy(self) -> None:                                    # ~vector() at the end of its scope
        self.heap.free(self.chunk, self.mem)


def TArray(values) -> tuple[int, ...]:
    """``TArray<int64_t>``: a fixed-capacity array passed to kernels by value."""
    values = tuple(int(v) for v in values)
    assert len(values) <= kMaxTArrayDims
    return values


def cudaMemcpyAsync(dst: torch.Tensor, src: torch.Tensor, count: int, stream=None) -> None:
    """cudaMemcpyHostToDevice from pageable memory: eagerly the runtime stages the source before returning; under
    stream capture the memcpy node keeps the source's host address and reads it at every launch of the graph."""
    dst[:count].copy_(src[:count], non_blocking=is_capturing())


# --- onnxruntime/core/providers/cuda/tensor/gather_nd_impl.cu -------------------------------------------------------

def _ComputeSliceOffsetsKernel(batch_dims, input_dims, num_slices, num_slices_per_batch, input_batch_stride,
                               num_slice_dims, sizes_from_slice_dims, indices_data, input_slice_offsets_data):
    """``sizes_from_slice_dims``: a device pointer (before the fix) or a TArray by value (the fix)."""
    slice_idx = torch.arange(num_slices, device=indices_data.device)
    base_offset = torch.div(slice_idx, num_slices_per_batch, rounding_mode="floor") * input_batch_stride
    slice_indices = indices_data.reshape(num_slices, num_slice_dims)
    relative_slice_offset = torch.zeros(num_slices, dtype=torch.int64, device=indices_data.device)
    for dim_idx in range(num_slice_dims):
        index = slice_indices[:, dim_idx].to(torch.int64)
        dim = input_dims[batch_dims + dim_idx]
        index = torch.where(index < 0, index + dim, index)
        relative_slice_offset = relative_slice_offset + index * sizes_from_slice_dims[dim_idx]
    input_slice_offsets_data.copy_(base_offset + relative_slice_offset)


def ComputeSliceOffsetsImpl(stream, batch_dims, input_dims, num_slices, num_slices_per_batch, input_batch_stride,
                            num_slice_dims, sizes_from_slice_dims, indices_data, input_slice_offsets_data):
    _ComputeSliceOffsetsKernel(batch_dims, input_dims, num_slices, num_slices_per_batch, input_batch_stride,
                               num_slice_dims, sizes_from_slice_dims, indices_data, input_slice_offsets_data)


def GatherNDImpl(stream, num_slices, input_data, output_data, slice_size, input_slice_offsets_data):
    """``_GatherNDKernel``: output[i] = input[slice_offsets[i / slice_size] + i % slice_size]."""
    i = torch.arange(num_slices * slice_size, device=input_data.device)
    src = input_slice_offsets_data[torch.div(i, slice_size, rounding_mode="floor")] + i % slice_size
    output_data.reshape(-1).copy_(input_data.reshape(-1)[src])


# --- onnxruntime/core/providers/cuda/tensor/gather_nd.cc ------------------------------------------------------------

def size_to_dimension(shape, d):
    out = 1
    for s in shape[:d]:
        out *= s
    return out


def size_from_dimension(shape, d):
    return size_to_dimension(shape[d:], len(shape) - d)


class GatherNDBase:
    def __init__(self, ep: CUDAExecutionProvider, batch_dims: int, variant: str):
        self.ep, self.batch_dims_, self.variant = ep, batch_dims, variant

    def GetScratchBuffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, device=self.ep.device)

    def PrepareCompute(self, stream, batch_dims, input_shape, indices_shape, indices_tensor):
        num_slice_dims = indices_shape[-1]
        num_slices = size_to_dimension(indices_shape, len(indices_shape) - 1)
        slice_size = size_from_dimension(input_shape, batch_dims + num_slice_dims)
        num_batches = size_to_dimension(input_shape, batch_dims)
        input_batch_stride = size_from_dimension(input_shape, batch_dims)
        num_slices_per_batch = num_slices // num_batches
        indices_data = indices_tensor

        if self.variant == "bug":
            sizes_from_slice_dims = StdVector(self.ep.heap, num_slice_dims)
            running_product = slice_size
            for i in range(num_slice_dims):
                sizes_from_slice_dims[num_slice_dims - 1 - i] = running_product
                running_product *= input_shape[batch_dims + num_slice_dims - 1 - i]
            sizes_from_slice_dims_buffer = self.GetScratchBuffer(sizes_from_slice_dims.size())
            cudaMemcpyAsync(sizes_from_slice_dims_buffer, sizes_from_slice_dims.data(),
                            sizes_from_slice_dims.size(), stream)
            strides = sizes_from_slice_dims_buffer                # the kernel reads them from device memory
        else:
            sizes = [0] * num_slice_dims
            running_product = slice_size
            for i in range(num_slice_dims):
                sizes[num_slice_dims - 1 - i] = running_product
                running_product *= input_shape[batch_dims + num_slice_dims - 1 - i]
            strides = TArray(sizes)                               # by value: kernel arguments

        input_slice_offsets_buffer = self.GetScratchBuffer(num_slices)
        input_dims = TArray(input_shape)
        ComputeSliceOffsetsImpl(stream, batch_dims, input_dims, num_slices, num_slices_per_batch,
                                input_batch_stride, num_slice_dims, strides, indices_data,
                                input_slice_offsets_buffer)
        if self.variant == "bug":
            sizes_from_slice_dims.destroy()                       # the local vector dies at return
        return num_slices, slice_size, input_slice_offsets_buffer


class GatherND(GatherNDBase):
    def ComputeInternal(self, context: OpKernelContext) -> None:
        input_tensor, indices_tensor = context.Input(0), context.Input(1)
        input_shape, indices_shape = tuple(input_tensor.shape), tuple(indices_tensor.shape)
        last_indices_dimension = self.batch_dims_ + indices_shape[-1]
        assert last_indices_dimension <= len(input_shape)
        shape = list(indices_shape[:-1]) + list(input_shape[last_indices_dimension:])
        output_tensor = context.Output(0, shape)
        num_slices, slice_size, input_slice_offsets_buffer = self.PrepareCompute(
            self.ep.Stream(), self.batch_dims_, input_shape, indices_shape, indices_tensor)
        GatherNDImpl(self.ep.Stream(), num_slices, input_tensor, output_tensor, slice_size,
                     input_slice_offsets_buffer)


class MatMul:
    def __init__(self, ep):
        self.ep = ep

    def ComputeInternal(self, context: OpKernelContext) -> None:
        a, b = context.Input(0), context.Input(1)
        torch.matmul(a, b, out=context.Output(0, [a.shape[0], b.shape[1]]))


# --- the session: nodes, IOBinding, the CUDA EP's graph ---------------------------------------------------------------

class OpKernelContext:
    def __init__(self, session, node):
        self.session, self.node = session, node

    def Input(self, i: int) -> torch.Tensor:
        return self.session.values[self.node[1][i]]

    def Output(self, i: int, shape) -> torch.Tensor:
        name = self.node[2][i]
        bound = self.session.bound_outputs.get(name)
        if bound is not None:                                     # IOBinding: the user's buffer
            assert list(bound.shape) == list(shape)
            out = bound
        else:                                                     # the allocation planner's arena
            out = torch.empty(shape, device=self.session.ep.device)
        self.session.values[name] = out
        return out


class CUDAExecutionProvider:
    """The CUDA EP with ``enable_cuda_graph``: a regular run first, then a run that captures (OnRunStart begins
    the capture, OnRunEnd ends it and replays it), then replays only."""
    kMinNumRunsBeforeCudaGraphCapture = 1

    def __init__(self, device: str, enable_cuda_graph: bool):
        self.device, self.enable_cuda_graph = device, enable_cuda_graph
        self.heap = HostHeap(device)
        self.graph = self.graph_outputs = None

    def Stream(self):
        return None

    def IsGraphCaptured(self) -> bool:
        return self.graph is not None


class InferenceSession:
    def __init__(self, device: str, variant: str, enable_cuda_graph: bool):
        gen = generator(32120)
        self.ep = CUDAExecutionProvider(device, enable_cuda_graph)
        self.initializers = {"lm_head.weight": randn(H, V, gen=gen, device=device, scale=H ** -0.5)}
        self.nodes = [
            (GatherND(self.ep, 1, variant), ["hidden_states", "last_index"], ["pooled"]),
            (MatMul(self.ep), ["pooled", "lm_head.weight"], ["logits"]),
            (GatherND(self.ep, 1, variant), ["logits", "candidate_ids"], ["scores"]),
        ]
        self.values, self.bound_inputs, self.bound_outputs = {}, {}, {}

    def bind_input(self, name, buffer):
        self.bound_inputs[name] = buffer

    def bind_output(self, name, buffer):
        self.bound_outputs[name] = buffer

    def _execute(self):
        self.values = {**self.initializers, **self.bound_inputs}
        for node in self.nodes:
            node[0].ComputeInternal(OpKernelContext(self, node))
        return self.bound_outputs["scores"]

    def run_with_iobinding(self):
        ep = self.ep
        if not ep.enable_cuda_graph:
            return self._execute()
        if ep.IsGraphCaptured():
            return replay(ep.graph, ep.graph_outputs)
        # the regular run(s), then the capture run (whose result is the graph's first replay)
        ep.graph, ep.graph_outputs = capture(
            self._execute, device=ep.device, warmups=ep.kMinNumRunsBeforeCudaGraphCapture,
            name="ort CUDA EP graph", owner="onnxruntime CUDA EP", static=dict(self.bound_inputs))
        return replay(ep.graph, ep.graph_outputs)


def run(variant: str, device: str = "cpu"):
    gen = generator(3212)
    steps = []
    for _ in range(STEPS):
        hidden = torch.randn(B, S, H, generator=gen)
        last = torch.randint(1, S, (B, 1), generator=gen)           # each row's last real token
        cands = torch.randint(0, V, (B, K, 1), generator=gen)
        cands[0, 0, 0] = -1                                         # a negative index (ONNX allows them)
        steps.append((hidden, last, cands))

    def serve(enable_cuda_graph: bool):
        session = InferenceSession(device, variant, enable_cuda_graph)
        hidden_states = torch.zeros(B, S, H, device=device)
        last_index = torch.zeros(B, 1, dtype=torch.int64, device=device)
        candidate_ids = torch.zeros(B, K, 1, dtype=torch.int64, device=device)
        scores = torch.zeros(B, K, device=device)
        session.bind_input("hidden_states", hidden_states)
        session.bind_input("last_index", last_index)
        session.bind_input("candidate_ids", candidate_ids)
        session.bind_output("scores", scores)
        outs = []
        for hidden, last, cands in steps:
            hidden_states.copy_(hidden.to(device))
            last_index.copy_(last.to(device))
            candidate_ids.copy_(cands.to(device))
            outs.append(session.run_with_iobinding().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
