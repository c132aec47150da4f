"""rtp-llm ROCm TRT all-reduce: a re-captured HIP graph's all-reduce input lands at a recycled ``data_ptr``; the bare-address IPC slot cache hits, and every replay reads the peers' released capture-time buffers.

Upstream: https://github.com/alibaba/rtp-llm/commit/a2c201dfb699db2bdd31253bf9af739aded307ef ("fix: validate
allocation range on IPC cache hit to detect recycled data_ptrs", alibaba/rtp-llm, pushed to main 2026-06-11; no PR).
Symptom: the commit names none beyond "could hit a stale captured IPC slot when PyTorch's caching allocator freed
and reused the same address for a different allocation block". What follows from the code: once the graphs whose
all-reduce inputs were registered are discarded and their pool memory given back, a graph captured later whose
all-reduce input is allocated at one of the old addresses (a new allocation block, same ``data_ptr``) reuses the old
IPC slot, and its replays all-reduce this rank's current partial sums with the peers' old ones: wrong hidden states
on every rank, no error. Eager decode (``data_`` copy path) is correct.
Mechanism: ``CommWorkspace::get_comm_data`` (rtp_llm/models_py/bindings/rocm/kernels/trtllm_allreduce_fusion.cu),
called by every ``allreduce`` / ``allreduce_rms``, looks the input's ``data_ptr`` up in
``std::unordered_map<void*, CommPtrs*> ptr_to_comm_ptrs_``. On a miss during capture (``gpuStreamIsCapturing``) it
pushes the pointer to ``unregistered_ptrs_`` and hands the kernel its own slot ``comm_ptrs_ + used_comm_ptrs_ + k``
(zero-copy, restored by ea8a80a12); outside capture it copies the input into the IPC workspace ``data_`` and uses
slot 0. After the capture loop, ``finish_hipgraph_capture_session`` -> ``TrtllmDistEnv._consume_capture``
(models_py/modules/base/rocm/trt_allreduce.py) exchanges ``get_captured_handles`` (an IPC handle of the allocation
base, ``HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR``) and ``get_captured_offsets``, and ``open_captured_handles`` opens
the peers' handles, writes their mapped addresses (plus offsets; this rank's own entry is its own pointer) into the
slot with ``gpuMemcpy``, and records ``ptr_to_comm_ptrs_[ptr] = slot``. The captured kernel reads
``cptrs->data_ptrs[r]`` from device memory at every replay. The entry is never removed when the graph or its
memory goes away. When the graph pool's segment is freed and a later segment (another size) is mapped at the same
virtual address, the next capture's all-reduce input can have exactly the old ``data_ptr``: the lookup hits, the
new graph is bound to the old slot, and nothing is registered for the new buffer. Its own entry still resolves
(same address, now the new buffer), but the peer entries are the importer's IPC mappings of the peers' *old*
allocations, whose owners released them (the mapping keeps the old pages, holding their last capture-time data).
Doctor: dangling-reference, at get_comm_data (on a cache hit it trusts a slot keyed on a bare ``data_ptr`` whose
allocation was freed and recycled, so the captured all-reduce reads peer memory whose owners released it).
Fix (upstream): ``ptr_to_comm_ptrs_`` maps to ``CachedSlot{comm_ptrs, range_start, range_size}``, recorded in
``open_captured_handles`` with ``hipPointerGetAttribute(RANGE_START_ADDR / RANGE_SIZE)``; on a hit
``get_comm_data`` re-queries both and, if either differs, erases the entry and falls through to the capture
(register a new slot) or copy path.
Modelled: TP 2, one row-parallel linear per decode step followed by the pure all-reduce (``allreduce_op``; no
residual/RMSNorm fusion, no FP8). Both ranks live in one process and are captured into one graph, their work in
lock-step (every rank's matmul and ``get_comm_data`` copy, then every rank's kernel), standing in for two processes
whose kernels meet at ``SyncComm``'s barrier; ``dist.all_gather_object`` is a list over the ranks. The HIP driver is
a stand-in: one physical HBM tensor (both GPUs' pages), a per-GPU page table (device tensor) that the kernel
translates its pointers through, ``hipMalloc`` mapping the lowest free virtual range to fresh physical pages,
``hipFree`` unmapping it, ``hipIpcOpenMemHandle`` mapping the exporter's pages into the importer's address space,
and ``hipPointerGetAttribute`` answering RANGE_START/RANGE_SIZE. Addresses count float elements, not bytes. The
caching allocator is a bump allocator per segment; each capture generation reserves one graph-pool segment before
capturing (a real ``hipMalloc`` is no stream work). The lifecycle is: capture at batch 4, replay, discard the graph
and free its pool, re-capture at batch 2 (e.g. the runner rebuilt with other capture sizes, or re-captured after a
failed ``_consume_capture``, which asks the caller to re-capture), replay. No warmup runs before capture.
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/a2c201dfb699db2bdd31253bf9af739aded307ef"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "get_comm_data"
SYMPTOM = ("ROCm trt all-reduce, HIP graphs re-captured after the old ones were freed: the new graph's all-reduce "
           "input sits at a recycled data_ptr, the bare-address IPC slot cache hits, replays sum the peers' released "
           "capture-time buffers; wrong hidden states")

WORLD_SIZE = 2
HIDDEN = 8                       # hidden size (one page per row)
SHARD = 4                        # each rank's slice of the row-parallel input
PAGE = 8                         # page size of the stand-in MMU, in elements
NUM_VPAGES = 256                 # each GPU's virtual address space, in pages
PHYS_PAGES_PER_RANK = 64         # each GPU's HBM, in pages
MAX_RANKS = 8
COMM_PTRS_BUF_LEN = 8            # comm_ptrs_buf_len
MAX_SIZE_IN_BYTES = 16 * HIDDEN  # max_size_in_bytes (elements here)
CAPTURE_GENERATIONS = (4, 2)     # batch size of each capture (the second after the first graph is discarded)
STEPS_PER_GENERATION = 2

HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR = "RANGE_START_ADDR"
HIP_POINTER_ATTRIBUTE_RANGE_SIZE = "RANGE_SIZE"

_variant = "bug"


# --- HIP runtime stand-in: physical pages, per-GPU page tables, VA allocation, IPC ------------------------------

class HipDevice:
    """One GPU: its physical pages (a region of the shared ``hbm`` tensor) and its page table (read by kernels)."""

    def __init__(self, rank: int, hbm: torch.Tensor):
        self.rank, self.hbm = rank, hbm
        self.page_table = torch.full((NUM_VPAGES,), -1, dtype=torch.int64, device=hbm.device)
        self.mappings: dict[int, tuple[int, int]] = {}     # first virtual page -> (pages, first physical page)
        self.next_phys_page = rank * PHYS_PAGES_PER_RANK

    def _free_virtual_range(self, npages: int) -> int:
        used = sorted((v, v + n) for v, (n, _) in self.mappings.items())
        start = 0
        for lo, hi in used:                                    # first fit: the lowest free range is reused
            if lo - start >= npages:
                return start
            start = max(start, hi)
        if NUM_VPAGES - start < npages:
            raise RuntimeError("hipErrorOutOfMemory (virtual address space)")
        return start

    def map(self, npages: int, phys_page: int) -> int:
        vpage = self._free_virtual_range(npages)
        self.mappings[vpage] = (npages, phys_page)
        self.page_table[vpage:vpage + npages] = torch.arange(phys_page, phys_page + npages,
                                                             device=self.page_table.device)
        return vpage * PAGE

    def unmap(self, va: int) -> None:
        npages, _ = self.mappings.pop(va // PAGE)
        self.page_table[va // PAGE:va // PAGE + npages] = -1

    def mapping_of(self, ptr: int):
        for vpage, (npages, phys_page) in self.mappings.items():
            if vpage * PAGE <= ptr < (vpage + npages) * PAGE:
                return vpage, npages, phys_page
        raise RuntimeError(f"hipErrorInvalidValue: {ptr} is not a mapped device address")

    def physical(self, ptr: int) -> int:
        vpage, _, phys_page = self.mapping_of(ptr)
        return phys_page * PAGE + ptr - vpage * PAGE


def hipMalloc(dev: HipDevice, nelems: int) -> int:
    npages = -(-nelems // PAGE)
    if dev.next_phys_page + npages > (dev.rank + 1) * PHYS_PAGES_PER_RANK:
        raise RuntimeError("hipErrorOutOfMemory")
    phys_page, dev.next_phys_page = dev.next_phys_page, dev.next_phys_page + npages   # fresh physical pages
    return dev.map(npages, phys_page)


def hipFree(dev: HipDevice, ptr: int) -> None:
    dev.unmap(ptr)           # the pages stay alive while another GPU has them IPC-mapped


def hipPointerGetAttribute(attr: str, dev: HipDevice, ptr: int) -> int:
    vpage, npages, _ = dev.mapping_of(ptr)
    return vpage * PAGE if attr == HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR else npages * PAGE


def hipIpcGetMemHandle(dev: HipDevice, base_ptr: int):
    vpage, npages, phys_page = dev.mapping_of(base_ptr)
    return (dev.rank, phys_page, npages)


def hipIpcOpenMemHandle(dev: HipDevice, handle) -> int:
    _, phys_page, npages = handle
    return dev.map(npages, phys_page)          # the exporter's pages, at a new address of the importer


def gpuMemcpyAsync(dev: HipDevice, dst: int, src: int, nelems: int) -> None:
    d, s = dev.physical(dst), dev.physical(src)
    dev.hbm[d:d + nelems].copy_(dev.hbm[s:s + nelems])


class DeviceTensor:
    """A tensor of one GPU: its virtual address and shape; ``torch()`` is the view of its pages."""

    def __init__(self, dev: HipDevice, ptr: int, shape: tuple):
        self.dev, self.ptr, self.shape = dev, ptr, shape

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def torch(self) -> torch.Tensor:
        pa = self.dev.physical(self.ptr)
        return self.dev.hbm[pa:pa + self.numel()].view(self.shape)


class Segment:
    """One caching-allocator segment (``hipMalloc``'d), handed out by bump allocation."""

    def __init__(self, dev: HipDevice, nelems: int):
        self.dev, self.size, self.used = dev, nelems, 0
        self.base = hipMalloc(dev, nelems)

    def malloc(self, shape) -> DeviceTensor:
        n = shape[0] * shape[1]
        if self.used + n > self.size:
            raise RuntimeError("segment exhausted")
        t, self.used = DeviceTensor(self.dev, self.base + self.used, tuple(shape)), self.used + n
        return t

    def release(self) -> None:                 # the pool's blocks all free: emptied back to the driver
        hipFree(self.dev, self.base)


# --- trtllm_allreduce_fusion.cu --------------------------------------------------------------------------------

class CommMeta:
    def __init__(self, rank: int, nranks: int):
        self.rank, self.nranks = rank, nranks


class CachedSlot:
    def __init__(self, comm_ptrs: int, range_start: int, range_size: int):
        self.comm_ptrs = comm_ptrs          # slot index in comm_ptrs_
        self.range_start, self.range_size = range_start, range_size


class ipc_details:
    @staticmethod
    def get_handle(dev, ptr):
        return hipIpcGetMemHandle(dev, ptr)

    @staticmethod
    def open_handles(dev, rank, handles, ptr):
        return [hipIpcOpenMemHandle(dev, h) if i != rank else ptr for i, h in enumerate(handles)]

    @staticmethod
    def create_base_ptr(dev, ptr):
        return hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR, dev, ptr)


class CommWorkspace:
    def __init__(self, dev: HipDevice, rank, world_size, size_in_bytes, comm_ptrs_buf_len, round_robin=True):
        self.dev, self.rank_, self.world_size_ = dev, rank, world_size
        self.size_in_bytes_, self.comm_ptrs_buf_len_, self.round_robin_ = size_in_bytes, comm_ptrs_buf_len, round_robin
        self.data_ = hipMalloc(dev, size_in_bytes * 2)
        self.comm_ptrs_ = torch.zeros(comm_ptrs_buf_len, MAX_RANKS, dtype=torch.int64, device=dev.hbm.device)
        self.used_comm_ptrs_ = 0
        self.ipc_data_: list[int] = []
        self.unregistered_ptrs_: list[int] = []
        self.unregistered_base_ptrs_: list[int] = []
        self.captured_ipc_handles_: list[list[int]] = []
        self.ptr_to_comm_ptrs_: dict = {}
        self.pending_capture_ptrs_: list[int] = []

    def get_data_handle(self):
        return ipc_details.get_handle(self.dev, self.data_)

    def open_data_handles(self, handles):
        self.ipc_data_ = ipc_details.open_handles(self.dev, self.rank_, handles, self.data_)
        row = [self.ipc_data_[(self.rank_ + j) % self.world_size_ if self.round_robin_ else j]
               for j in range(self.world_size_)]
        cptrs = torch.zeros(self.comm_ptrs_buf_len_, MAX_RANKS, dtype=torch.int64)
        cptrs[:, :self.world_size_] = torch.tensor(row)
        self.comm_ptrs_.copy_(cptrs.to(self.comm_ptrs_.device))     # gpuMemcpy H2D
        self.used_comm_ptrs_ = 1

    def get_comm_data(self, input: DeviceTensor, stream=None):
        size = input.numel()
        ptr = input.data_ptr()
        meta = CommMeta(self.rank_, self.world_size_)
        cache_hit = False
        it = self.ptr_to_comm_ptrs_.get(ptr)
        if it is not None:
            if _variant == "bug":
                cptrs = it
                cache_hit = True
            else:
                # Validate that the allocation backing this data_ptr hasn't changed (freed + reused).
                slot = it
                cur_start = hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR, self.dev, ptr)
                cur_size = hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_RANGE_SIZE, self.dev, ptr)
                if cur_start == slot.range_start and cur_size == slot.range_size:
                    cptrs = slot.comm_ptrs
                    cache_hit = True
                else:
                    del self.ptr_to_comm_ptrs_[ptr]      # stale entry: fall through
        if not cache_hit:
            capturing = is_capturing()                   # gpuStreamIsCapturing(stream)
            remaining = self.comm_ptrs_buf_len_ - self.used_comm_ptrs_ - len(self.unregistered_ptrs_)
            if capturing and size < self.size_in_bytes_ and remaining > 0:
                self.unregistered_ptrs_.append(ptr)
                cptrs = self.used_comm_ptrs_ + len(self.unregistered_ptrs_) - 1
            else:
                cptrs = 0
                gpuMemcpyAsync(self.dev, self.data_, ptr, size)
        return meta, cptrs

    def capture_clear(self):
        self.unregistered_ptrs_.clear()
        self.unregistered_base_ptrs_.clear()

    def get_captured_handles(self):
        handles = []
        for ptr in self.unregistered_ptrs_:
            base_ptr = ipc_details.create_base_ptr(self.dev, ptr)
            handles.append(ipc_details.get_handle(self.dev, base_ptr))
            self.unregistered_base_ptrs_.append(base_ptr)
        return handles

    def get_captured_offsets(self):
        return torch.tensor([p - b for p, b in zip(self.unregistered_ptrs_, self.unregistered_base_ptrs_)],
                            dtype=torch.int64)

    def open_captured_handles(self, handles, offsets, ptr_idx):
        ptr, base_ptr = self.unregistered_ptrs_[ptr_idx], self.unregistered_base_ptrs_[ptr_idx]
        range_start = hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR, self.dev, base_ptr)
        range_size = hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_RANGE_SIZE, self.dev, base_ptr)
        if not (range_start <= base_ptr and ptr < range_start + range_size):
            raise RuntimeError("[TrtllmAllreduce] cached ptr falls outside the current allocation")
        ipc_data = ipc_details.open_handles(self.dev, self.rank_, handles, base_ptr)
        self.captured_ipc_handles_.append(ipc_data)
        ipc_data = [d + o for d, o in zip(ipc_data, offsets)]
        row = [ipc_data[(self.rank_ + i) % self.world_size_ if self.round_robin_ else i] for i in range(len(offsets))]
        self.comm_ptrs_[self.used_comm_ptrs_, :len(row)] = torch.tensor(row, device=self.comm_ptrs_.device)
        if _variant == "bug":
            self.ptr_to_comm_ptrs_[ptr] = self.used_comm_ptrs_
        else:
            reg_start = hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR, self.dev, ptr)
            reg_size = hipPointerGetAttribute(HIP_POINTER_ATTRIBUTE_RANGE_SIZE, self.dev, ptr)
            self.ptr_to_comm_ptrs_[ptr] = CachedSlot(self.used_comm_ptrs_, reg_start, reg_size)
        self.pending_capture_ptrs_.append(ptr)
        self.used_comm_ptrs_ += 1

    def commit_capture(self):
        self.pending_capture_ptrs_.clear()

    def begin_capture_session(self):
        self.pending_capture_ptrs_.clear()


def allreduce_kernel(ws: CommWorkspace, meta: CommMeta, cptrs: int, out: DeviceTensor, n: int):
    """Each rank reads ``n`` elements at ``cptrs->data_ptrs[r]`` (its own addresses, through its page table)."""
    dev = ws.dev
    offs = torch.arange(n, device=dev.hbm.device)
    acc = None
    for i in range(meta.nranks):
        va = ws.comm_ptrs_[cptrs, i] + offs
        pa = dev.page_table[va // PAGE] * PAGE + va % PAGE
        v = dev.hbm.index_select(0, pa)
        acc = v if acc is None else acc + v
    out.torch().view(-1).copy_(acc)


# --- trt_allreduce.py (TrtllmDistEnv), rocm_rccl.py ---------------------------------------------------------------

class TrtllmDistEnv:
    def __init__(self, dev: HipDevice, rank: int):
        self.rank, self.world_size = rank, WORLD_SIZE
        self.handle = CommWorkspace(dev, rank, WORLD_SIZE, MAX_SIZE_IN_BYTES, COMM_PTRS_BUF_LEN)
        self._is_captured = False
        self._capture_handles_pending = False

    def _prepare_capture(self, input_tensor):
        if is_capturing():
            self._is_captured = True
            self._capture_handles_pending = True

    def allreduce_op(self, allreduce_in: DeviceTensor, allreduce_out: DeviceTensor):
        """Pure AllReduce kernel: returns the launch, which runs once every rank reached its entry barrier."""
        self._prepare_capture(allreduce_in)
        meta, cptrs = self.handle.get_comm_data(allreduce_in)
        return lambda: allreduce_kernel(self.handle, meta, cptrs, allreduce_out, allreduce_in.numel())


def init_trtllm_dist_envs(devs):
    envs = [TrtllmDistEnv(d, r) for r, d in enumerate(devs)]
    data_handle_list = [e.handle.get_data_handle() for e in envs]          # dist.all_gather_object
    for e in envs:
        e.handle.open_data_handles(data_handle_list)
    return envs


def finish_hipgraph_capture_session(envs):
    """``_consume_capture`` on every rank, its all_gather_object calls as lists over the ranks."""
    if not any(e._capture_handles_pending for e in envs):
        return
    handles = [e.handle.get_captured_handles() for e in envs]
    offsets = [e.handle.get_captured_offsets() for e in envs]
    if len({len(h) for h in handles}) != 1:
        raise RuntimeError("[TrtllmAllreduce] Handle count mismatch across ranks")
    for e in envs:
        e.handle.begin_capture_session()
    for idx in range(len(handles[0])):
        handle_list = [handles[r][idx] for r in range(WORLD_SIZE)]
        offset_list = [int(offsets[r][idx].item()) for r in range(WORLD_SIZE)]
        for e in envs:
            e.handle.open_captured_handles(handle_list, offset_list, idx)
    for e in envs:
        e.handle.capture_clear()
        e.handle.commit_capture()
        e._capture_handles_pending = False
        e._is_captured = False


# --- the model: one row-parallel linear and its all-reduce, both ranks in lock-step -----------------------------------

class World:
    def __init__(self, device):
        self.hbm = torch.zeros(WORLD_SIZE * PHYS_PAGES_PER_RANK * PAGE, device=device)
        self.devs = [HipDevice(r, self.hbm) for r in range(WORLD_SIZE)]
        self.envs = init_trtllm_dist_envs(self.devs)
        gen = generator(2026)
        self.weights = [(torch.randn(SHARD, HIDDEN, generator=gen) * SHARD ** -0.5).to(device)
                        for _ in range(WORLD_SIZE)]
        self.segments = [None] * WORLD_SIZE     # the allocator's current segment on each rank

    def forward(self, hidden_states: torch.Tensor, bs: int):
        allreduce_ins = []
        for r, w in enumerate(self.weights):
            allreduce_in = self.segments[r].malloc((bs, HIDDEN))
            torch.matmul(hidden_states[:bs, r * SHARD:(r + 1) * SHARD], w, out=allreduce_in.torch())
            allreduce_ins.append(allreduce_in)
        outs = [self.segments[r].malloc((bs, HIDDEN)) for r in range(WORLD_SIZE)]   # torch.empty_like
        launches = [env.allreduce_op(a, o) for env, a, o in zip(self.envs, allreduce_ins, outs)]
        for launch in launches:
            launch()
        return tuple(o.torch() for o in outs)


def _steps():
    gen = generator(82)
    return [(bs, torch.randn(bs, WORLD_SIZE * SHARD, generator=gen))
            for bs in CAPTURE_GENERATIONS for _ in range(STEPS_PER_GENERATION)]


def run(variant: str, device: str = "cpu"):
    global _variant
    steps = _steps()

    def eager():
        world = World(device)
        eager_segments = [Segment(d, 4 * max(CAPTURE_GENERATIONS) * HIDDEN) for d in world.devs]
        outs = []
        for bs, x in steps:
            for s in eager_segments:
                s.used = 0                       # last step's blocks freed, handed out again
            world.segments = eager_segments
            outs.append(torch.stack(world.forward(x.to(device), bs)).clone())
        return outs

    def served():
        world = World(device)
        outs = []
        for bs in CAPTURE_GENERATIONS:
            # graph_pool_handle(): this generation's pool, one segment per rank
            pools = [Segment(d, 2 * bs * HIDDEN) for d in world.devs]
            world.segments = pools
            static_x = torch.zeros(bs, WORLD_SIZE * SHARD, device=device)
            g, out = capture(lambda: world.forward(static_x, bs), device=device, warmups=0,
                             name=f"decode bs={bs}", static={"hidden_states": static_x},
                             state={"hbm": world.hbm}, owner="rtp-llm CudaGraphRunner")
            finish_hipgraph_capture_session(world.envs)
            for step_bs, x in steps:
                if step_bs != bs:
                    continue
                static_x.copy_(x.to(device))
                outs.append(torch.stack(replay(g, out)).clone())
            g.reset()                            # graphs discarded ...
            for p in pools:
                p.release()                      # ... and their pool's segment given back to the driver
        return outs

    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
