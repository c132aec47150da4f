"""AITER custom all-reduce on HIP graphs: during capture each registered-output all-reduce bakes the address of the ``RankData`` slot it predicts for its output's peer pointers, but ``register_graph_buffers`` later writes those peer pointers to a different slot; with two all-reduces in one graph the first one's kernel reads the second one's input ``RankData``, broadcasts its result into the wrong buffers and never writes its own output.

Upstream: https://github.com/ROCm/aiter/pull/4974 ("[HIP] Fix (custom_all_reduce): correct output RankData slot
prediction during graph capture", ROCm/aiter, by afriedri, opened 2026-08-24, merged; merge commit not identified,
the fixed code read at stored commit 01f531002b). Read: the PR description (the
capture-time prediction ``d_rank_data_base_ + graph_unreg_input_buffers_.size() + graph_unreg_output_buffers_.size()``
against the flush's ``d_rank_data_base_ + num_input_buffers + i``; the 2-AR table: ``out[0]`` predicted base+1, actual
base+2; the memory access fault in ``cross_device_reduce_2stage_write_mode``). At the parent (mirror snapshot
e4048607a5, 2026-08-22) ``csrc/include/custom_all_reduce.cuh``: ``CustomAllreduce`` (``register_input_buffer``,
``get_buffer_RD``, ``get_output_buffer_RD``, ``register_graph_buffers``, the ``allreduce`` dispatcher and the
``cross_device_reduce_2stage_write_mode`` kernel, stages 1-3 with and without ``is_broadcast_reg_outptr``),
``csrc/kernels/custom_all_reduce.cu::all_reduce`` (``is_broadcast_reg_outptr = (reg_inp_ptr == 0)``, the eager copy
into the registered input buffer) and ``aiter/dist/device_communicators/custom_all_reduce.py`` (``capture``,
``flush_graph_buffers``, ``all_reduce``, ``custom_all_reduce``: zeros during warm-up, ``registered_input`` while
capturing). The fixed ``custom_all_reduce.cuh`` (stored commit 01f531002b): outputs are reserved top-down
(``d_rank_data_end_ - 1 - graph_unreg_output_buffers_.size()``), the flush copies output *i* to
``d_rank_data_end_ - 1 - i`` and moves ``d_rank_data_end_`` down, with capacity checks so the two ends cannot alias.
Symptom: with several custom all-reduces captured into one HIP graph (registered graph inputs, 2-stage write-mode
kernel), replays fault ("Memory access fault by GPU ... cross_device_reduce_2stage_write_mode") or, when the mis-read
slot points at buffers large enough, silently produce wrong activations; eager serving is correct.
Mechanism: ``get_output_buffer_RD`` returns, while capturing, a ``RankData*`` that the kernel launch bakes in. The
input count still grows during capture, so for the k-th of N all-reduces it predicts slot ``2k+1`` while
``register_graph_buffers`` (after capture) writes that output's peer pointers to slot ``N+k``. With two all-reduces,
all-reduce 0 reads slot 1, which holds all-reduce 1's input ``RankData``: each rank broadcasts its reduced chunk into
every rank's all-reduce-1 input buffer (overwritten later by the MLP), and all-reduce 0's output buffers are never
written by any replay. Eager never takes this path (unregistered input, temp-buffer stage 3).
Doctor: warmup-divergence, at get_output_buffer_RD. The capture decided a reference (the ``RankData`` slot baked into
the kernel) that every replay reuses, while the registration that fills the slots (and any eager step) places the
output's peer pointers elsewhere.
Fix (upstream): reserve output ``RankData`` slots from the top of the rank-data buffer at capture and write them there
in ``register_graph_buffers`` (inputs keep growing from the bottom), so prediction and registration agree.
Modelled: ``CustomAllreduce`` (host state per rank: ``input_buffer``, ``output_buffers_``, ``graph_unreg_*``,
``d_rank_data_base_`` / ``d_rank_data_end_`` as slot indices into a device ``rank_data`` table) with
``register_input_buffer``, ``get_buffer_RD``, ``get_output_buffer_RD``, ``register_graph_buffers``,
``get_graph_buffer_ptrs`` and ``all_reduce`` as read; the Python ``capture`` / ``flush_graph_buffers`` /
``custom_all_reduce``; ``cross_device_reduce_2stage_write_mode`` as torch gathers and scatters through device-held
pointers (the kernel reads its ``RankData`` row at replay). Stand-ins: 4 TP ranks run in lockstep in one process, each
rank's device memory is one row of a shared float64 heap and a pointer is a flat element offset into it (IPC
open = identity); graph-pool allocations are bump allocations in the heap; the dispatcher always picks the 2-stage
write-mode kernel (upstream does for 8 ranks and large messages); a 1-layer TP block (row-parallel projection,
all-reduce, residual, MLP, all-reduce, residual) with 4 tokens and hidden 8.
Workload: capture one graph of the block inside ``ca.capture()`` (one warm-up, dummy input), flush the graph buffers,
then serve 3 steps by copying each step's hidden states in and replaying; eager runs the same 3 steps with the
unregistered (copy-in) all-reduce. Slot 0 of each rank's table holds the registered input buffer, so the graph's
table starts at base = 1. Bug: all-reduce 0 bakes slot 2 (base+1, filled by the flush with all-reduce 1's input
RankData) while its output's peer pointers go to slot 3; its replayed broadcast lands in the MLP input buffers and its
output buffers keep their pre-capture zeros, so the residual misses the attention projection: max |graph - eager| =
20.1 (steps 1-3: 20.1, 10.8, 14.9, equally on all 4 ranks), the same on both runs. Fix: equals eager (max 0).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/4974"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "get_output_buffer_RD"
SYMPTOM = ("custom all-reduce in a HIP graph: the output RankData slot baked at capture is not the slot "
           "register_graph_buffers fills, so an all-reduce broadcasts into another tensor and never writes its output")

WORLD, TOKENS, HIDDEN, INTER = 4, 4, 8, 16
SIZE = TOKENS * HIDDEN                     # elements per all-reduce
HEAP_ELEMS = 1024                          # one rank's device memory (elements)
SIGNAL_ELEMS = 2 * SIZE                    # Signal tmp region: stage-1 area + stage-3 area
RANK_DATA_SLOTS = 16
DTYPE = torch.float64

_variant = "bug"


# --- device memory of the emulated ranks ------------------------------------------------------------------------------

class IpcHeap:
    """Each rank's device memory is one row of ``heap``; a device pointer is a flat element offset into it."""

    def __init__(self, device):
        self.heap = torch.zeros(WORLD, HEAP_ELEMS, dtype=DTYPE, device=device)
        self.flat = self.heap.view(-1)
        self.next = [0] * WORLD
        self.scratch_mark = [0] * WORLD

    def ptr(self, t: torch.Tensor) -> int:
        return (t.data_ptr() - self.heap.data_ptr()) // self.heap.element_size()

    def alloc(self, rank: int, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        off = self.next[rank]
        assert off + n <= HEAP_ELEMS, "heap exhausted"
        self.next[rank] += n
        return self.heap[rank, off:off + n].view(*shape)

    def mark_scratch(self):                # everything after this is per-step scratch (eager allocations)
        self.scratch_mark = list(self.next)

    def reset_scratch(self):
        self.next = list(self.scratch_mark)


# --- csrc/include/custom_all_reduce.cuh: class CustomAllreduce ------------------------------------------------------

class CustomAllreduce:
    def __init__(self, heap: IpcHeap, signal_ptrs, rank: int, device):
        self.heap, self.rank_, self.world_size_ = heap, rank, WORLD
        self.sg_ = list(signal_ptrs)                           # RankSignals: peer Signal (tmp) pointers
        self.input_buffer: dict[int, int] = {}
        self.output_buffers_: dict[int, int] = {}
        self.rank_data = torch.zeros(RANK_DATA_SLOTS, WORLD, dtype=torch.int64, device=device)
        self.d_rank_data_base_, self.d_rank_data_end_ = 0, RANK_DATA_SLOTS
        self.graph_unreg_input_buffers_: list[int] = []
        self.graph_unreg_output_buffers_: list[int] = []
        self.device = device

    def check_rank_data_capacity(self, num=1):
        if self.d_rank_data_base_ + num > self.d_rank_data_end_:
            raise RuntimeError(f"Rank data buffer is overflowed by {self.d_rank_data_base_ + num - self.d_rank_data_end_}")

    def _write_slot(self, slot, ptrs):                         # hipMemcpy(d_data, &data, sizeof(RankData), H2D)
        self.rank_data[slot].copy_(torch.tensor(ptrs, dtype=torch.int64).to(self.device))

    def register_input_buffer(self, all_ptrs, self_ptr):
        self.check_rank_data_capacity()
        d_data = self.d_rank_data_base_
        self.d_rank_data_base_ += 1
        self._write_slot(d_data, all_ptrs)
        self.input_buffer[self_ptr] = d_data

    def get_buffer_RD(self, input_ptr):
        if input_ptr in self.input_buffer:
            return self.input_buffer[input_ptr]
        if torch.cuda.is_current_stream_capturing():                     # hipStreamIsCapturing
            if _variant == "fix":
                self.check_rank_data_capacity(len(self.graph_unreg_input_buffers_)
                                              + len(self.graph_unreg_output_buffers_) + 1)
            ptrs = self.d_rank_data_base_ + len(self.graph_unreg_input_buffers_)
            self.graph_unreg_input_buffers_.append(input_ptr)
            return ptrs
        raise RuntimeError(f"buffer address {input_ptr} is not registered!")

    def get_output_buffer_RD(self, output_ptr):
        if output_ptr in self.output_buffers_:
            return self.output_buffers_[output_ptr]
        if torch.cuda.is_current_stream_capturing():
            if _variant == "bug":
                # For graph mode, collect output addresses
                ptrs = (self.d_rank_data_base_ + len(self.graph_unreg_input_buffers_)
                        + len(self.graph_unreg_output_buffers_))
            else:
                # Reserve top-down: the input count still grows during capture.
                self.check_rank_data_capacity(len(self.graph_unreg_input_buffers_)
                                              + len(self.graph_unreg_output_buffers_) + 1)
                ptrs = self.d_rank_data_end_ - 1 - len(self.graph_unreg_output_buffers_)
            self.graph_unreg_output_buffers_.append(output_ptr)
            return ptrs
        raise RuntimeError(f"output buffer address {output_ptr} is not registered!")

    def get_graph_buffer_ptrs(self):
        return self.graph_unreg_input_buffers_ + self.graph_unreg_output_buffers_

    def register_graph_buffers(self, ptrs_per_rank):
        num_input_buffers = len(self.graph_unreg_input_buffers_)
        num_output_buffers = len(self.graph_unreg_output_buffers_)
        total_buffers = num_input_buffers + num_output_buffers
        self.check_rank_data_capacity(total_buffers)
        rank_data = [[ptrs_per_rank[j][i] for j in range(WORLD)] for i in range(total_buffers)]   # IPC open: identity
        for i in range(num_output_buffers):
            self_ptr = self.graph_unreg_output_buffers_[i]
            if _variant == "bug":
                self.output_buffers_[self_ptr] = self.d_rank_data_base_ + num_input_buffers + i
            else:
                self.output_buffers_[self_ptr] = self.d_rank_data_end_ - 1 - i
        if _variant == "bug":
            for i in range(total_buffers):
                self._write_slot(self.d_rank_data_base_ + i, rank_data[i])
            self.d_rank_data_base_ += total_buffers
        else:
            for i in range(num_input_buffers):
                self._write_slot(self.d_rank_data_base_ + i, rank_data[i])
            for i in range(num_output_buffers):
                self._write_slot(self.d_rank_data_end_ - 1 - i, rank_data[num_input_buffers + i])
            self.d_rank_data_base_ += num_input_buffers
            self.d_rank_data_end_ -= num_output_buffers
        self.graph_unreg_input_buffers_.clear()
        self.graph_unreg_output_buffers_.clear()


def cross_device_reduce_2stage_write_mode(fas, input_dp, output_dp, results, size, is_broadcast_reg_outptr):
    """All ranks' launches of the kernel in lockstep (``end_sync`` between the stages); pointers are read from
    each rank's device ``rank_data`` row at run time, the Signal tmp pointers are kernel arguments."""
    heap = fas[0].heap
    flat, part = heap.flat, size // WORLD
    ar_size, ar_part = _ARANGE[(size, flat.device)], _ARANGE[(part, flat.device)]
    tmps = [flat[p:p + SIGNAL_ELEMS] for p in fas[0].sg_]
    # stage1: write local rank data to remote rank
    for rank, fa in enumerate(fas):
        input_ptr = fa.rank_data[input_dp[rank]][rank]
        data = flat[input_ptr + ar_size]
        for w in range(WORLD):
            tmps[w][rank * part:(rank + 1) * part].copy_(data[w * part:(w + 1) * part])
    # stage 2: reduce scatter & write result to remote rank
    for rank, fa in enumerate(fas):
        reduced = tmps[rank][:size].view(WORLD, part).sum(0)
        for w in range(WORLD):
            if is_broadcast_reg_outptr:
                out_ptr = fa.rank_data[output_dp[rank]][w]
                flat.index_copy_(0, out_ptr + rank * part + ar_part, reduced)
            else:
                tmps[w][size + rank * part:size + (rank + 1) * part].copy_(reduced)
    if not is_broadcast_reg_outptr:
        # stage 3: get the output from tmp_buffer
        for rank in range(WORLD):
            results[rank].view(-1).copy_(tmps[rank][size:2 * size])


_ARANGE: dict = {}


# --- csrc/kernels/custom_all_reduce.cu::all_reduce + the Python CustomAllreduce ---------------------------------------

class CustomAllreduceGroup:
    """The Python ``CustomAllreduce`` of every TP rank (they run in lockstep here)."""

    def __init__(self, device):
        self.heap = IpcHeap(device)
        signals = [self.heap.alloc(r, SIGNAL_ELEMS) for r in range(WORLD)]
        sig_ptrs = [self.heap.ptr(s) for s in signals]
        self.fas = [CustomAllreduce(self.heap, sig_ptrs, r, device) for r in range(WORLD)]
        self.reg_input = [self.heap.alloc(r, SIZE) for r in range(WORLD)]         # self._pool["input"]
        reg_ptrs = [self.heap.ptr(t) for t in self.reg_input]
        for r, fa in enumerate(self.fas):
            fa.register_input_buffer(reg_ptrs, reg_ptrs[r])
        for n in (SIZE, SIZE // WORLD):
            _ARANGE[(n, self.heap.flat.device)] = torch.arange(n, device=device)
        self.heap.mark_scratch()
        self._IS_CAPTURING = False

    def empty_like(self, rank, t):                            # torch.empty_like on rank's device
        return self.heap.alloc(rank, *t.shape)

    def all_reduce(self, inps, *, registered_input: bool):
        outs = [self.empty_like(r, inp) for r, inp in enumerate(inps)]
        is_broadcast_reg_outptr = registered_input             # reg_inp_ptr == 0
        input_dp, output_dp = [], []
        for r, (fa, inp, out) in enumerate(zip(self.fas, inps, outs)):
            actual_inp = inp
            if not registered_input:
                self.reg_input[r].view(-1)[:inp.numel()].copy_(inp.reshape(-1))   # hipMemcpyAsync D2D
                actual_inp = self.reg_input[r]
            input_dp.append(fa.get_buffer_RD(self.heap.ptr(actual_inp)))
            output_dp.append(fa.get_output_buffer_RD(self.heap.ptr(out)) if is_broadcast_reg_outptr else None)
        cross_device_reduce_2stage_write_mode(self.fas, input_dp, output_dp, outs, SIZE, is_broadcast_reg_outptr)
        return outs

    def custom_all_reduce(self, inps):
        if self._IS_CAPTURING:
            if torch.cuda.is_current_stream_capturing():
                return self.all_reduce(inps, registered_input=True)
            return [torch.zeros_like(inp) for inp in inps]     # warm up: mimic the allocation pattern
        return self.all_reduce(inps, registered_input=False)

    @contextlib.contextmanager
    def capture(self):
        try:
            self._IS_CAPTURING = True
            yield
        finally:
            self._IS_CAPTURING = False
            self.flush_graph_buffers()

    def flush_graph_buffers(self):
        ptrs_per_rank = [fa.get_graph_buffer_ptrs() for fa in self.fas]           # _gather_ipc_meta
        for fa in self.fas:
            if ptrs_per_rank[fa.rank_]:
                fa.register_graph_buffers(ptrs_per_rank)


# --- a TP decoder block (stand-in for the model) -----------------------------------------------------------------------

class TPBlock:
    def __init__(self, car: CustomAllreduceGroup, device):
        gen = generator(4974)
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.4).to(DTYPE)   # noqa: E731
        self.o_proj = [r(HIDDEN, HIDDEN) for _ in range(WORLD)]
        self.up = [r(HIDDEN, INTER) for _ in range(WORLD)]
        self.down = [r(INTER, HIDDEN) for _ in range(WORLD)]
        self.car = car

    def forward(self, x):
        car = self.car
        attn = [torch.matmul(x, self.o_proj[r], out=car.heap.alloc(r, TOKENS, HIDDEN)) for r in range(WORLD)]
        attn = car.custom_all_reduce(attn)                                # all-reduce 0
        h = [x + attn[r] for r in range(WORLD)]
        mlp = [torch.matmul(F.silu(h[r] @ self.up[r]), self.down[r], out=car.heap.alloc(r, TOKENS, HIDDEN))
               for r in range(WORLD)]
        mlp = car.custom_all_reduce(mlp)                                  # all-reduce 1
        return torch.stack([h[r] + mlp[r] for r in range(WORLD)])


def _steps(device):
    gen = generator(49740)
    return [randn(TOKENS, HIDDEN, gen=gen, device=device).to(DTYPE) for _ in range(3)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def eager():
        car = CustomAllreduceGroup(device)
        block = TPBlock(car, device)
        outs = []
        for x in _steps(device):
            car.heap.reset_scratch()
            outs.append(block.forward(x).clone())
        return outs

    def served():
        car = CustomAllreduceGroup(device)
        block = TPBlock(car, device)
        static_x = torch.zeros(TOKENS, HIDDEN, dtype=DTYPE, device=device)

        def step():
            car.heap.reset_scratch()        # warm-up allocations are per-step scratch; capture's stay the graph's
            return block.forward(static_x)

        with car.capture():
            g, out = capture(step, device=device, warmups=1, static={"static_x": static_x},
                             state={"ipc_heap": car.heap.heap}, owner="CudaGraphRunner", name="decode tokens 4")
        car.heap.mark_scratch()             # the graph's buffers stay allocated
        outs = []
        for x in _steps(device):
            static_x.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
