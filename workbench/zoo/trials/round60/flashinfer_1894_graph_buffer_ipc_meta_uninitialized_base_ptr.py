"""Custom all-reduce exports captured graph buffers from an uninitialised ``base_ptr``: replays hit bogus peer pointers.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/1894 ("fix vllm graph register and add test"), commit
bea5949652b1e0da3610376bbab2bfd223c59452 (2025-10-13); no linked issue.
Symptom: "The all-reduce buffers are incorrectly registered during the cuda graph capture phase when using vLLM
custom all reduce. The base_ptr is not initialized and leads to illegal memory access error."
Mechanism: ``vllm::CustomAllreduce`` (``include/flashinfer/comm/vllm_custom_all_reduce.cuh``). Eager calls of
``all_reduce(fa, inp, out, reg_buffer, ...)`` copy ``inp`` into the pre-registered IPC buffer and use its
``RankData`` (``register_buffer``). While the stream captures (``reg_buffer = 0``), ``allreduce`` bakes
``ptrs = d_rank_data_base_ + graph_unreg_buffers_.size()`` into the kernel and records ``input`` in
``graph_unreg_buffers_``: the slot is filled after capture. Then each rank calls ``get_graph_buffer_ipc_meta()``,
which must export, per recorded ``ptr``, an IPC handle of the *base* of its allocation and ``offsets[i] = ptr -
base_ptr``; the handles are all-gathered and ``register_graph_buffers`` opens them on every peer and writes
``rank_data[i].ptrs[j] = open_ipc_handle(handle) + offset``. In FlashInfer's copy ``void* base_ptr;`` was never
assigned: ``cudaIpcGetMemHandle`` exported whatever allocation the stack residue pointed into (here the rank's
signal buffer, so the export itself succeeds) and the offset was measured from it. The peer's pointer then lands
past the mapping it opened, and every replayed all-reduce kernel reads it: illegal memory access. Eager steps never
use those slots and are correct.
(Emulation: TP-2 in lock step in one process, one graph per size holding both ranks' kernels. Each device
allocation is a segment of ``SEG`` elements at a unified address ``(id + 1) * SPAN``; an IPC mapping opened by a rank
lives at ``IPC_BASE + k * SPAN`` and the rank's ``ipc_rows`` table (device memory) says which segment it maps. The
kernel resolves peer pointers through that table; an address outside every opened mapping sets the kernel's fault
flag, which ``synchronize`` reports as CUDA reports an illegal memory access.)
Doctor: dangling-reference, at get_graph_buffer_ipc_meta (the replayed kernel dereferences a peer address that
maps no live buffer: the exported handle and offset describe a different allocation than the captured input).
Fix (upstream): before exporting, ``cuPointerGetAttribute(&base_ptr, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)``
(throwing "failed to get pointer attr" on failure), as vLLM's implementation does; the PR also adds a graph-capture
test (``tests/comm/test_vllm_custom_allreduce.py``: capture two all-reduces, exchange, register, replay).
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/1894"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "get_graph_buffer_ipc_meta"
SYMPTOM = "custom all-reduce under CUDA graphs: replay raises 'illegal memory access' (bogus peer pointers)"

WORLD, HIDDEN, INTER = 2, 4, 6
CAPTURE_SIZES = [2, 4]
SEG, SPAN = 32, 64                 # elements per allocation, address stride between allocations
IPC_BASE, MAX_MAPPINGS = 1 << 16, 8
RANK_DATA_SLOTS = 8
UNREGISTERED = -1                  # what torch.empty left in a rank_data slot


class DeviceMemory:
    """Every rank's allocations, at unified addresses (one list for the lock-step emulation)."""

    def __init__(self, device):
        self.device, self.segments, self.owner = device, [], []

    def alloc(self, rank):
        self.segments.append(torch.zeros(SEG, device=self.device))   # inside a capture: a graph pool block
        self.owner.append(rank)
        return len(self.segments) * SPAN                       # allocation i lives at (i + 1) * SPAN

    def segment(self, ptr):
        i = ptr // SPAN - 1
        if not 0 <= i < len(self.segments) or ptr % SPAN >= SEG:
            raise RuntimeError("CUDA error: invalid argument")
        return i

    def view(self, ptr, numel):
        return self.segments[self.segment(ptr)][ptr % SPAN:ptr % SPAN + numel]

    def range_start(self, ptr):
        """``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)``."""
        return ptr - ptr % SPAN

    def ipc_get_mem_handle(self, ptr):
        """``cudaIpcGetMemHandle``: a handle of the allocation ``ptr`` points into."""
        return self.segment(ptr)


class CustomAllreduce:
    def __init__(self, mem, rank, device, variant):
        self.mem, self.rank, self.variant = mem, rank, variant
        self.self_sg_ = mem.alloc(rank)            # Signal + IPC-shared staging buffer (create_shared_buffer)
        self.rank_data = torch.full((RANK_DATA_SLOTS, WORLD), UNREGISTERED, dtype=torch.long, device=device)
        self.d_rank_data_base_ = 0
        self.ipc_rows = torch.full((MAX_MAPPINGS,), -1, dtype=torch.long, device=device)
        self.ipc_handles_: dict[int, int] = {}
        self.buffers_: dict[int, int] = {}
        self.graph_unreg_buffers_: list[int] = []

    def open_ipc_handle(self, handle):
        if handle not in self.ipc_handles_:                      # cudaIpcOpenMemHandle: map the allocation
            k = len(self.ipc_handles_)
            self.ipc_rows[k] = handle
            self.ipc_handles_[handle] = IPC_BASE + k * SPAN
        return self.ipc_handles_[handle]

    def register_buffer(self, ptrs):
        self.rank_data[self.d_rank_data_base_] = torch.tensor(ptrs)
        self.buffers_[ptrs[self.rank]] = self.d_rank_data_base_
        self.d_rank_data_base_ += 1

    def get_graph_buffer_ipc_meta(self):
        handles, offsets = [], []
        for ptr in self.graph_unreg_buffers_:
            if self.variant == "fix":
                base_ptr = self.mem.range_start(ptr)            # cuPointerGetAttribute(RANGE_START_ADDR)
            else:
                base_ptr = self.self_sg_                        # `void* base_ptr;`: the stack slot's residue
            handles.append(self.mem.ipc_get_mem_handle(base_ptr))
            offsets.append(ptr - base_ptr)
        return handles, offsets

    def register_graph_buffers(self, handles, offsets):
        for i, self_ptr in enumerate(self.graph_unreg_buffers_):
            rd = [self_ptr if j == self.rank else self.open_ipc_handle(handles[j][i]) + offsets[j][i]
                  for j in range(WORLD)]
            self.rank_data[self.d_rank_data_base_ + i] = torch.tensor(rd)
        self.d_rank_data_base_ += len(self.graph_unreg_buffers_)
        self.graph_unreg_buffers_.clear()

    def allreduce(self, input_ptr, numel):
        if is_capturing():
            slot = self.d_rank_data_base_ + len(self.graph_unreg_buffers_)
            self.graph_unreg_buffers_.append(input_ptr)
        else:
            if input_ptr not in self.buffers_:
                raise RuntimeError(f"buffer address {input_ptr} is not registered!")
            slot = self.buffers_[input_ptr]
        return self.cross_device_reduce_1stage(self.rank_data[slot], input_ptr, numel)

    def cross_device_reduce_1stage(self, ptrs, input_ptr, numel):
        memory = torch.stack(self.mem.segments)                 # what NVLink reaches, read at launch
        lane = torch.arange(numel, device=memory.device)
        tmp, fault = torch.zeros(numel, device=memory.device), torch.zeros((), dtype=torch.bool, device=memory.device)
        for j in range(WORLD):
            if j == self.rank:
                data = self.mem.view(input_ptr, numel)
            else:
                rel = ptrs[j:j + 1] - IPC_BASE                   # a device-side address: no host sync
                k, off = torch.div(rel, SPAN, rounding_mode="floor"), rel % SPAN
                row = self.ipc_rows.index_select(0, k.clamp(0, MAX_MAPPINGS - 1))
                valid = (rel >= 0) & (k < MAX_MAPPINGS) & (row >= 0) & (row < memory.shape[0]) & (off + numel <= SEG)
                fault = fault | ~valid[0]
                flat = row.clamp(0, memory.shape[0] - 1) * SEG + off.clamp(0, SEG - numel) + lane
                data = memory.reshape(-1).index_select(0, flat)
            tmp = tmp + data
        return tmp, fault


def all_reduce(fas, inputs, reg_buffers):
    """``flashinfer.comm.vllm_all_reduce`` on every rank; the kernels' start barrier waits for all inputs."""
    ptrs = []
    for fa, (inp_ptr, numel), reg in zip(fas, inputs, reg_buffers):
        if reg:                                                  # cudaMemcpyAsync(reg_buffer, inp) then reduce
            fa.mem.view(reg, numel).copy_(fa.mem.view(inp_ptr, numel))
        ptrs.append(reg or inp_ptr)
    return [fa.allreduce(p, numel) for fa, p, (_, numel) in zip(fas, ptrs, inputs)]


class TP2Model:
    def __init__(self, device, variant):
        gen = generator(1894)
        self.device, self.mem = device, DeviceMemory(device)
        self.fas = [CustomAllreduce(self.mem, r, device, variant) for r in range(WORLD)]
        for fa in self.fas:                                      # the IPC-shared staging buffers
            fa.register_buffer([fa.self_sg_ if j == fa.rank else
                                fa.open_ipc_handle(self.mem.segment(self.fas[j].self_sg_)) for j in range(WORLD)])
        self.scratch = [self.mem.alloc(r) for r in range(WORLD)]  # the caching allocator's eager block
        self.up = [randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5) for _ in range(WORLD)]
        self.down = [randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(WORLD)]
        self.input_buffer = torch.zeros(max(CAPTURE_SIZES), HIDDEN, device=device)
        self.graphs = {}

    def forward(self, x):
        n, capturing = x.shape[0], is_capturing()
        inputs = []
        for r in range(WORLD):                                   # row-parallel MLP: a partial sum per rank
            ptr = self.mem.alloc(r) if capturing else self.scratch[r]
            self.mem.view(ptr, n * HIDDEN).copy_((torch.tanh(x @ self.up[r]) @ self.down[r]).reshape(-1))
            inputs.append((ptr, n * HIDDEN))
        regs = [0 if capturing else fa.self_sg_ for fa in self.fas]   # registered=True while capturing
        reduced = all_reduce(self.fas, inputs, regs)
        outs = [x + red.view(n, HIDDEN) for red, _ in reduced]
        return (*outs, torch.stack([f for _, f in reduced]).any())

    def capture_model(self):
        for n in reversed(CAPTURE_SIZES):
            self.graphs[n] = capture(lambda n=n: self.forward(self.input_buffer[:n]), device=self.device,
                                     name=f"TP-2 decode n={n}", owner="custom all-reduce runner",
                                     static={"input_buffer": self.input_buffer})
        meta = [fa.get_graph_buffer_ipc_meta() for fa in self.fas]     # then all_gather_object
        handles, offsets = [m[0] for m in meta], [m[1] for m in meta]
        for fa in self.fas:
            fa.register_graph_buffers(handles, offsets)

    def step(self, x, graphed):
        if graphed:
            n = x.shape[0]
            self.input_buffer[:n].copy_(x)
            *outs, fault = replay(*self.graphs[n])
        else:
            *outs, fault = self.forward(x)
        if bool(fault):                                          # torch.cuda.synchronize()
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [o.clone() for o in outs]


def run(variant: str, device: str = "cpu"):
    gen = generator(189400)
    steps = [randn(n, HIDDEN, gen=gen, device=device) for n in (4, 2, 4, 2)]

    def serve(graphed: bool):
        model = TP2Model(device, variant)
        if graphed:
            model.capture_model()
        outs = []
        for x in steps:
            outs.extend(model.step(x, graphed))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
