"""Clearing the CUDA graphs for an RL weight update never rewinds custom all-reduce's RankData slot cursor: every recapture takes fresh slots after the dead graphs' slots, until ``rank_data`` overflows.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/5662 ("[BugFix] Fix custom_all_reduce overflow", opened
2025-12-19, merged; cherry-picked to the release branch as #5667). The clear-and-recapture path comes from #4305
("[NewFeature]custom_allreduce support cudagraph recapture", 2025-09-28), which added
``custom_ar_clear_ipc_handles()`` to ``CudaGraphPiecewiseBackend.clear_graph()``.
Symptom: (PR motivation, translated) "after capturing CUDA graphs several times, the buffer inside
custom_all_reduce runs out." An RL rollout engine that syncs weights with ``clear_parameters`` /
``update_parameters`` recaptures its graphs after each sync. After a few syncs, the capture ends with
``RuntimeError: Rank data buffer is overflowed by N``. The first capture, and serving without graphs, are fine.
Mechanism: ``paddle::CustomAllreduce`` (custom_ops/gpu_ops/custom_all_reduce/all_reduce.cuh) keeps a cursor,
``d_rank_data_base_``, into the fixed ``rank_data`` buffer that the Python ``CustomAllreduce`` allocates once
(``paddle.empty([8 MiB])``: ``d_rank_data_end_`` = 131072 ``RankData`` slots). ``register_buffer`` takes one slot for
the eager IPC staging buffer. While a stream captures, ``allreduce`` bakes ``d_rank_data_base_ +
graph_unreg_buffers_.size()`` into each kernel as its ``RankData*`` and records the input. When the graph's
``capture_custom_allreduce()`` context ends, ``register_graph_buffers`` checks ``check_rank_data_capacity(num_buffers)``,
writes the peer pointers into those slots, and advances the cursor. For an RL weight update,
``GPUModelRunner.clear_parameters`` -> ``clear_grpah_opt_backend`` -> ``CudaGraphPiecewiseBackend.clear_graph()``
calls ``custom_ar_clear_ipc_handles()`` -> ``CustomAllreduce::clear_ipc_handles``, which closed the peers' IPC
handles but left ``d_rank_data_base_`` where the last capture left it. ``update_parameters`` ->
``capture_model()`` then appends the new graphs' slots after the dead graphs' slots. So every weight sync uses up
(captured all-reduces) x (capture sizes) more slots, until ``register_graph_buffers`` throws. By then, the graph just
captured has already baked ``RankData`` pointers past ``d_rank_data_end_``. Eager all-reduces use only the slot
that ``register_buffer`` registered at init, so they never move the cursor.
Doctor: undersized-buffer, at clear_ipc_handles. The recaptured graph's all-reduces need RankData slots past the
end of the fixed ``rank_data`` table, because ``clear_ipc_handles`` kept the dead graphs' slots reserved. The
capture's slot data does not fit the buffer that the graph's kernels address it in. The fix changed
``clear_ipc_handles`` (with the constructor and ``register_buffer``, which record the rewind point).
Fix (upstream): a new member ``d_rank_data_base_origin_`` is set in the constructor and after every
``register_buffer``, so it points just past the eager-registered slots. ``clear_ipc_handles()`` ends with
``d_rank_data_base_ = d_rank_data_base_origin_``. The next capture reuses the dead graphs' slots, which is safe
because those graphs have been deleted.
Modelled: the C++ ``CustomAllreduce`` (``paddle.CustomAllreduce`` here) and the Python ``CustomAllreduce`` wrapper
(``register_buffer``, ``capture``, ``register_graph_buffers``, ``custom_all_reduce``, ``all_reduce``,
``clear_ipc_handles``). ``communication.py``'s ``_TP_AR``, ``capture_custom_allreduce``,
``custom_ar_clear_ipc_handles`` and ``tensor_model_parallel_all_reduce``. ``CudaGraphPiecewiseBackend``
(warmups outside the custom-AR capture context, capture inside it, replay, ``clear_graph``). The
``GPUModelRunner`` RL path (``capture_model`` over the capture sizes in descending order, ``clear_parameters``,
``update_parameters``). TP 2 runs in one process in lock step: one Python ``CustomAllreduce`` stands for the
group on both ranks, with one C++ object per rank. Every rank's device allocation is a segment of
``DeviceMemory`` at a unified address (its index). ``cudaIpcOpenMemHandle`` maps that address unchanged. A
``RankData`` row holds the peers' addresses. ``empty_cache`` after the graphs are deleted gives their pool
blocks' addresses to the next capture. ``rank_data`` has 12 slots instead of 131072. It starts as garbage
(``paddle.empty``; the address -1 here). The one-stage kernel reads its row through the ``RankData*``
argument, and an address outside the memory sets its fault flag, which the step's synchronisation reports as
CUDA reports an illegal memory access. The model is two TP MLP layers (column-parallel up, tanh, row-parallel
down, all-reduce, residual), with decode batch sizes 1 and 2 captured and served exactly (no padding). There are
no signal buffers or barriers, and no two-stage kernel, NCCL fallback or ``should_custom_ar`` size gate. The
weights are reloaded in new memory at each sync. The slot budget: 1 for the staging buffer, and 2 layers x 2
sizes = 4 per capture generation. The third generation (second weight sync) needs slots 9..12 of 0..11.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import events, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/5662"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "clear_ipc_handles"
SYMPTOM = ("RL weight syncs with custom all-reduce under CUDA graphs: clear_ipc_handles never rewinds the RankData "
           "cursor, each recapture takes new slots, and a later capture raises 'Rank data buffer is overflowed'")

TP_SIZE = 2
HIDDEN, INTERMEDIATE, NUM_LAYERS = 4, 8, 2
CUDAGRAPH_CAPTURE_SIZES = [1, 2]
SEG = max(CUDAGRAPH_CAPTURE_SIZES) * HIDDEN        # elements of one device allocation (max_size of the staging buffer)
RANK_DATA_SLOTS = 12                               # rank_data bytes / sizeof(RankData) (131072 upstream)
GARBAGE = -1                                       # what paddle.empty left in a RankData slot: an address nothing maps
WORKLOAD = [(2, 1, 2), (1, 2, 2), (2, 1, 1)]       # decode batch sizes served, per weight generation (two RL syncs)


class DeviceMemory:
    """Every rank's device allocations at unified addresses (what NVLink and the IPC handles reach), in lock step."""

    def __init__(self, device):
        self.device, self.segments, self.num_persistent = device, [], 0

    def alloc(self) -> int:
        self.segments.append(torch.zeros(SEG, device=self.device))   # inside a capture: a block of the graph's pool
        return len(self.segments) - 1

    def cuda_malloc(self) -> int:
        """A cudaMalloc'd buffer (``create_shared_buffer``): lives until ``close()``."""
        ptr = self.alloc()
        self.num_persistent = len(self.segments)
        return ptr

    def view(self, ptr: int, numel: int) -> torch.Tensor:
        return self.segments[ptr][:numel]

    def empty_cache(self) -> None:
        """``paddle.device.cuda.empty_cache()`` once the graphs are deleted: their pool blocks go back, and the next
        capture's blocks get those addresses again."""
        del self.segments[self.num_persistent:]


# --- custom_ops/gpu_ops/custom_all_reduce/all_reduce.cuh ----------------------------------------------------------

class paddle:  # noqa: N801 - namespace paddle
    class CustomAllreduce:
        """``paddle::CustomAllreduce`` of one rank (the object ``init_custom_all_reduce`` returns as ``_ptr``)."""

        def __init__(self, mem: DeviceMemory, rank_data: torch.Tensor, rank: int, world_size: int, variant: str):
            self.mem, self.rank_, self.world_size_ = mem, rank, world_size
            self.rank_data = rank_data                                  # the RankData array, rank_data_sz bytes
            self.d_rank_data_base_ = 0
            self.d_rank_data_end_ = rank_data.shape[0]
            self.buffers_: dict[int, int] = {}                          # registered pointer -> its RankData*
            self.graph_unreg_buffers_: list[int] = []
            self.ipc_handles_: dict[tuple[int, int], int] = {}          # IPC handle -> opened pointer
            self._fix = variant == "fix"
            if self._fix:                                               # PR #5662
                self.d_rank_data_base_origin_ = self.d_rank_data_base_

        def open_ipc_handle(self, ipc_handle: tuple[int, int]) -> int:
            if ipc_handle not in self.ipc_handles_:
                self.ipc_handles_[ipc_handle] = ipc_handle[1]           # cudaIpcOpenMemHandle: the peer's allocation
            return self.ipc_handles_[ipc_handle]

        def get_graph_buffer_ipc_meta(self):
            handles = [(self.rank_, ptr) for ptr in self.graph_unreg_buffers_]   # cudaIpcGetMemHandle(base_ptr)
            offsets = [0] * len(self.graph_unreg_buffers_)              # each input is its allocation's base here
            return handles, offsets

        def check_rank_data_capacity(self, num: int = 1) -> None:
            if self.d_rank_data_base_ + num > self.d_rank_data_end_:
                raise RuntimeError("Rank data buffer is overflowed by "
                                   + str(self.d_rank_data_base_ + num - self.d_rank_data_end_))

        def register_buffer(self, ptrs: list[int]) -> None:
            """Register already-shared IPC pointers."""
            self.check_rank_data_capacity()
            d_data = self.d_rank_data_base_
            self.d_rank_data_base_ += 1
            self.rank_data[d_data] = torch.tensor(ptrs, dtype=torch.long)   # cudaMemcpy H2D
            self.buffers_[ptrs[self.rank_]] = d_data
            if self._fix:
                self.d_rank_data_base_origin_ = self.d_rank_data_base_

        def register_graph_buffers(self, handles: list[list], offsets: list[list[int]]) -> None:
            num_buffers = len(self.graph_unreg_buffers_)
            self.check_rank_data_capacity(num_buffers)
            rank_data = []
            for i in range(num_buffers):
                self_ptr = self.graph_unreg_buffers_[i]
                rd = []
                for j in range(self.world_size_):
                    if j != self.rank_:
                        rd.append(self.open_ipc_handle(handles[j][i]) + offsets[j][i])
                    else:
                        rd.append(self_ptr)
                rank_data.append(rd)
            if num_buffers:                                             # cudaMemcpy(d_rank_data_base_, rank_data)
                self.rank_data[self.d_rank_data_base_:self.d_rank_data_base_ + num_buffers] = torch.tensor(
                    rank_data, dtype=torch.long)
            self.d_rank_data_base_ += num_buffers
            self.graph_unreg_buffers_.clear()

        def allreduce(self, input_ptr: int, size: int):
            """Picks the ``RankData*`` the kernel gets; returns the launch (run once every rank did its prologue)."""
            if is_capturing():                                          # cudaStreamCaptureStatusActive
                ptrs = self.d_rank_data_base_ + len(self.graph_unreg_buffers_)
                self.graph_unreg_buffers_.append(input_ptr)
            else:
                if input_ptr not in self.buffers_:
                    raise RuntimeError(f"buffer address {input_ptr} is not registered!")
                ptrs = self.buffers_[input_ptr]
            return lambda: self.cross_device_reduce_1stage(ptrs, size)

        def cross_device_reduce_1stage(self, _dp: int, size: int):
            """``auto dp = *_dp;`` then every element is the sum over ranks of ``dp.ptrs[i][idx]``."""
            dev = self.rank_data.device
            memory = torch.stack(self.mem.segments)                     # every rank's memory, read at launch
            flat, n_seg = memory.reshape(-1), memory.shape[0]
            dp_arg = torch.full((1,), _dp, dtype=torch.long, device=dev)   # the kernel argument (a pointer)
            fault = dp_arg[0] >= self.d_rank_data_end_                  # past the rank_data allocation
            dp = self.rank_data.index_select(0, dp_arg.clamp(max=self.d_rank_data_end_ - 1))[0]
            lane = torch.arange(size, device=dev)
            tmp = torch.zeros(size, device=dev)
            for i in range(self.world_size_):
                p = dp[i:i + 1]                                         # a device-side read: no host sync
                fault = fault | ~((p >= 0) & (p < n_seg))[0]
                tmp = tmp + flat.index_select(0, p.clamp(0, n_seg - 1) * SEG + lane)
            return tmp, fault

        def clear_ipc_handles(self) -> None:
            for _ptr in self.ipc_handles_.values():
                pass                                                    # cudaIpcCloseMemHandle(ptr)
            self.ipc_handles_.clear()
            if self._fix:                                               # PR #5662
                self.d_rank_data_base_ = self.d_rank_data_base_origin_


# --- fastdeploy/distributed/custom_all_reduce/custom_all_reduce.py -------------------------------------------------

class CustomAllreduce:
    """The Python ``CustomAllreduce`` of the TP group, on every rank at once (lock step): ``_ptr[r]`` is rank r's
    C++ object."""

    def __init__(self, mem: DeviceMemory, world_size: int, device, variant: str):
        self.capturing = False
        self.mem, self.world_size, self.max_size = mem, world_size, SEG
        # the pre-registered IPC buffer: eager inputs are first copied into it
        self.buffer_ptrs = self.create_shared_buffer(mem, world_size)
        # the tuples of peer pointers (paddle.empty: uninitialised)
        self.rank_data = [torch.full((RANK_DATA_SLOTS, world_size), GARBAGE, dtype=torch.long, device=device)
                          for _ in range(world_size)]
        self._ptr = [paddle.CustomAllreduce(mem, self.rank_data[r], r, world_size, variant) for r in range(world_size)]
        for fa in self._ptr:
            fa.register_buffer(self.buffer_ptrs)                      # register_buffer(self._ptr, self.buffer_ptrs)

    @staticmethod
    def create_shared_buffer(mem: DeviceMemory, world_size: int) -> list[int]:
        return [mem.cuda_malloc() for _ in range(world_size)]          # cudaMalloc + all-gathered IPC handles

    @contextlib.contextmanager
    def capture(self):
        """The main responsibility of this context manager is the ``register_graph_buffers`` call at its end."""
        try:
            self.capturing = True
            yield
        finally:
            self.capturing = False
            self.register_graph_buffers()

    def register_graph_buffers(self) -> None:
        all_datas = [fa.get_graph_buffer_ipc_meta() for fa in self._ptr]   # dist.all_gather_object
        handles = [d[0] for d in all_datas]
        offsets = [d[1] for d in all_datas]
        for fa in self._ptr:
            fa.register_graph_buffers(handles, offsets)

    def custom_all_reduce(self, inputs: dict[int, torch.Tensor]):
        """The main allreduce API that provides support for cuda graph."""
        if self.capturing:
            if is_capturing():
                return self.all_reduce(inputs, registered=True)
            # warm up: mimic the allocation pattern, custom allreduce is out-of-place
            return {r: (torch.empty_like(t), None) for r, t in inputs.items()}
        return self.all_reduce(inputs, registered=False)

    def all_reduce(self, inputs: dict[int, torch.Tensor], registered: bool):
        """Out-of-place all-reduce on every rank. ``registered``: the input's own address goes to the kernel (under
        capture: a block of the graph's pool); otherwise it is copied into the pre-registered buffer first."""
        launches = {}
        shape = next(iter(inputs.values())).shape
        for r, inp in inputs.items():
            numel = inp.numel()
            reg_buffer = self.mem.alloc() if registered else self.buffer_ptrs[r]
            self.mem.view(reg_buffer, numel).copy_(inp.reshape(-1))    # (eager: cudaMemcpyAsync(reg_buffer, inp))
            launches[r] = self._ptr[r].allreduce(reg_buffer, numel)
        # the kernels' start barrier: every rank's input is in place before any rank reduces
        return {r: (out.view(shape), fault) for r, (out, fault) in ((r, k()) for r, k in launches.items())}

    def clear_ipc_handles(self) -> None:
        for fa in self._ptr:
            fa.clear_ipc_handles()                                      # clear_ipc_handles(self._ptr)


# --- fastdeploy/distributed/communication.py --------------------------------------------------------------------

_TP_AR: CustomAllreduce | None = None


@contextlib.contextmanager
def capture_custom_allreduce():
    ar_context = contextlib.nullcontext()
    if _TP_AR is not None:
        ar_context = _TP_AR.capture()
    with ar_context:
        yield


def use_custom_allreduce(mem: DeviceMemory, device, variant: str) -> None:
    global _TP_AR
    _TP_AR = CustomAllreduce(mem, TP_SIZE, device, variant)


def custom_ar_clear_ipc_handles() -> None:
    if _TP_AR is not None:
        _TP_AR.clear_ipc_handles()


def tensor_model_parallel_all_reduce(inputs: dict[int, torch.Tensor]):
    """All-reduce the input tensor across model parallel group (every rank's part)."""
    return _TP_AR.custom_all_reduce(inputs)


# --- fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py -------------------------------

class ConcreteSizeEntry:
    def __init__(self, real_shape: int):
        self.real_shape = real_shape
        self.runnable = None
        self.num_finished_warmup = 0
        self.cuda_graph = None
        self.output_buffer = None


class CudaGraphPiecewiseBackend:
    """Manage the capture and replay of CUDA graphs at the subgraph level."""

    def __init__(self, runnable, cudagraph_capture_sizes, static_buffers, device, warm_up_size=1):
        self.runnable, self.cudagraph_capture_sizes = runnable, cudagraph_capture_sizes
        self.static_buffers, self.device, self.warm_up_size = static_buffers, device, warm_up_size
        self._create_entry_dict()

    def __call__(self, **kwargs):
        real_shape = kwargs["hidden_states"].shape[0]
        entry = self.concrete_size_entries[real_shape]             # captured sizes only: no padding here
        if entry.runnable is None:
            entry.runnable = self.runnable
        if entry.cuda_graph is None:
            for _ in range(entry.num_finished_warmup, self.warm_up_size):
                entry.num_finished_warmup += 1
                with events.warmup():
                    entry.runnable(**kwargs)
            with capture_custom_allreduce():
                entry.cuda_graph, entry.output_buffer = capture(
                    lambda: entry.runnable(**kwargs), device=self.device, warmups=0,
                    name=f"decode bs={real_shape}", owner="CudaGraphPiecewiseBackend", static=self.static_buffers)
        return replay(entry.cuda_graph, entry.output_buffer)

    def _create_entry_dict(self) -> None:
        self.concrete_size_entries = {s: ConcreteSizeEntry(real_shape=s) for s in self.cudagraph_capture_sizes}

    def clear_graph(self, mem: DeviceMemory) -> None:
        custom_ar_clear_ipc_handles()
        for entry in self.concrete_size_entries.values():
            if entry.cuda_graph:
                del entry.cuda_graph
        del self.concrete_size_entries
        mem.empty_cache()                                           # paddle.device.cuda.empty_cache()
        self._create_entry_dict()


# --- the model (every rank's shard, lock step) -------------------------------------------------------------------

class Ernie4_5_Model:  # noqa: N801
    def __init__(self, device):
        self.device = device
        self.graph_opt_backend: CudaGraphPiecewiseBackend | None = None
        self.up_proj: list[list[torch.Tensor]] = []
        self.down_proj: list[list[torch.Tensor]] = []

    def load_weights(self, version: int) -> None:
        """The weights of one RL step, loaded into new memory (``update_parameters``)."""
        gen = generator(5662 + version)
        inter = INTERMEDIATE // TP_SIZE
        self.up_proj = [[randn(HIDDEN, inter, gen=gen, device=self.device, scale=0.6) for _ in range(TP_SIZE)]
                        for _ in range(NUM_LAYERS)]
        self.down_proj = [[randn(inter, HIDDEN, gen=gen, device=self.device, scale=0.6) for _ in range(TP_SIZE)]
                          for _ in range(NUM_LAYERS)]

    def forward(self, hidden_states: torch.Tensor):
        hidden = {r: hidden_states for r in range(TP_SIZE)}
        faults = []
        for layer in range(NUM_LAYERS):
            partial = {r: torch.tanh(hidden[r] @ self.up_proj[layer][r]) @ self.down_proj[layer][r]
                       for r in range(TP_SIZE)}
            reduced = tensor_model_parallel_all_reduce(partial)        # RowParallelLinear's all-reduce
            faults.extend(f for _, f in reduced.values() if f is not None)
            hidden = {r: hidden[r] + reduced[r][0] for r in range(TP_SIZE)}
        fault = torch.stack(faults).any() if faults else torch.zeros((), dtype=torch.bool, device=self.device)
        return torch.stack([hidden[r] for r in range(TP_SIZE)], dim=1), fault

    def __call__(self, hidden_states: torch.Tensor):
        if self.graph_opt_backend is not None:                       # @support_graph_optimization
            return self.graph_opt_backend(hidden_states=hidden_states)
        return self.forward(hidden_states)

    def clear_grpah_opt_backend(self, mem: DeviceMemory) -> None:
        """Clear graph optimization backend, the captured cuda graph will be cleaned."""
        self.graph_opt_backend.clear_graph(mem)


# --- fastdeploy/worker/gpu_model_runner.py ----------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, variant: str, use_cudagraph: bool):
        self.device, self.use_cudagraph = device, use_cudagraph
        self.mem = DeviceMemory(device)
        use_custom_allreduce(self.mem, device, variant)
        self.model = Ernie4_5_Model(device)
        self.model.load_weights(0)
        self.hidden_states = torch.zeros(max(CUDAGRAPH_CAPTURE_SIZES), HIDDEN, device=device)   # share_inputs
        if use_cudagraph:
            self.model.graph_opt_backend = CudaGraphPiecewiseBackend(
                self.model.forward, CUDAGRAPH_CAPTURE_SIZES, {"hidden_states": self.hidden_states}, device)

    def capture_model(self) -> None:
        for batch_size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(batch_size)

    def _dummy_run(self, batch_size: int) -> None:
        self.hidden_states[:batch_size].zero_()
        self.model(self.hidden_states[:batch_size])

    def clear_parameters(self) -> None:
        """Dynamic model loader use to clear parameters use for RL."""
        if self.use_cudagraph:
            self.model.clear_grpah_opt_backend(self.mem)
        self.model.up_proj, self.model.down_proj = [], []

    def update_parameters(self, version: int) -> None:
        """Dynamic model loader use to update parameters use for RL."""
        self.model.load_weights(version)
        if self.use_cudagraph:
            self.capture_model()                                       # Recapture CUDAGraph

    def execute_model(self, x: torch.Tensor) -> torch.Tensor:
        bs = x.shape[0]
        self.hidden_states[:bs].copy_(x)
        out, fault = self.model(self.hidden_states[:bs])
        if bool(fault):                                                 # the step's synchronisation
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return out.clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(566200)
    steps = [[randn(bs, HIDDEN, gen=gen, device=device) for bs in batch] for batch in WORKLOAD]

    def serve(graphed: bool):
        global _TP_AR
        runner = GPUModelRunner(device, variant, use_cudagraph=graphed)
        if graphed:
            runner.capture_model()
        outs = []
        try:
            for version, batch in enumerate(steps):
                if version:                                            # an RL weight sync
                    runner.clear_parameters()
                    runner.update_parameters(version)
                outs.extend(runner.execute_model(x) for x in batch)
        finally:
            _TP_AR = None
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
