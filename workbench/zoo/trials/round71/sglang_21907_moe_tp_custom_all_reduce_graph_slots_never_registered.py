"""The MoE groups' custom all-reduce never enters ``graph_capture()``: captured MoE all-reduces keep pointer-table slots that are never registered, and replays fault.

Upstream: https://github.com/sgl-project/sglang/pull/21907 ("[Fix] Add _MOE_TP to graph_capture for MoE models with
ep>1", opened 2026-04-02, merged early April 2026); a regression from #18233 (``bb737d7a8``, 2026-03-22); the
competing https://github.com/sgl-project/sglang/pull/21979 ("Register _MOE_TP group in graph_capture ...", ExitStack
over ``_MOE_EP`` and ``_MOE_TP`` with dedup by identity) was closed.
Symptom: "During CUDA graph replay the custom-allreduce kernel (``cross_device_reduce_1stage``) dereferences
unregistered IPC handles -> illegal memory access -> process killed (exit code -9)", for every MoE model with
``1 < ep < tp`` (``Qwen3-235B-FP8 --tp=8 --ep=2``, ``moe_tp_size`` 4); #21979 reports a hang instead. Fine with
``--disable-cuda-graph`` and when the MoE groups have one rank or alias ``_TP``.
Mechanism: #18233 switched the MoE all-reduce from ``_TP`` to the dedicated ``_MOE_TP`` group
(``tensor_model_parallel_all_reduce`` -> ``moe_tensor_model_parallel_all_reduce``); with ``ep > 1``,
``Qwen3MoeSparseMoeBlock.forward_normal`` reduces over ``_MOE_EP`` (``moe_expert_parallel_all_reduce``), then over
``_MOE_TP``, each a ``GroupCoordinator`` with its own ``ca_comm`` (``CustomAllreduce``). The module-level
``graph_capture()`` (``python/sglang/srt/distributed/parallel_state.py``), which the CUDA-graph runner wraps around
its whole warmup-and-capture loop, entered only ``get_tp_group().graph_capture()`` and ``get_pp_group()``'s. Only
``GroupCoordinator.graph_capture`` enters ``ca_comm.capture()``, which sets ``_IS_CAPTURING`` and, in its ``finally``,
calls ``register_graph_buffers()`` (``get_graph_buffer_ipc_meta`` -> all-gather -> ``ops.register_graph_buffers``).
For the MoE communicators it never ran. While the stream captures, the C++ ``CustomAllreduce::allreduce`` does not
look up a registered buffer: it takes the next ``RankData`` slot, ``d_rank_data_base_ + graph_unreg_buffers_.size()``,
bakes that slot's address into the kernel and records the input in ``graph_unreg_buffers_``; the slot's peer pointers
are written only by ``register_graph_buffers``. So every captured MoE all-reduce points at a slot of ``rank_data``
(``torch.empty``) that nothing ever fills, and each replayed ``cross_device_reduce_1stage`` dereferences garbage peer
pointers. Eager steps copy the input into the staging buffer registered at init (``buffers_``) and are correct.
(Emulation: TP-4 with ``--ep 2`` (``moe_tp_size`` 2) in one process, in lock step: one graph per batch size holds
every rank's kernels, and one ``GroupCoordinator`` object stands for a group kind on every rank, with one
``CustomAllreduce`` per rank. Every rank's allocation is a segment of ``DeviceMemory`` at a unified address, its
index; a ``rank_data`` row holds the peers' addresses. The kernel gathers through the row; an address that maps no
allocation sets its fault flag, which the step's synchronisation reports as CUDA reports an illegal memory access.
The garbage an unregistered slot holds is the address -1, so the outcome does not depend on where memory lies.)
Doctor: stale-input, at graph_capture (the replayed MoE all-reduce kernels read ``rank_data`` slots that no step
and no registration ever wrote: the module-level ``graph_capture`` never enters the MoE groups' capture contexts,
whose exit is what fills them).
Fix (upstream): ``graph_capture()`` also enters the MoE groups' ``graph_capture(context)``, each distinct group once:
inside the TP/PP context, an ``ExitStack`` with ``seen = {id(_TP)}`` enters ``_MOE_EP`` and ``_MOE_TP`` when they are
not None and not already entered (later extended to ``_DCP``, ``_ATTN_TP``, ``_SHARED_EXPERTS_TP``). Their
``ca_comm.capture()`` then registers the graph buffers when the capture loop ends.
Modelled: read were the PR descriptions of #21907 and #21979, the post-fix ``graph_capture`` in stored sglang copies,
``custom_all_reduce.py`` (``capture``, ``register_graph_buffers``, ``custom_all_reduce``, ``all_reduce``) and the C++
``allreduce`` slot logic; the exact pre-fix hunk was not seen, so whether ``_MOE_EP`` was already entered before the
fix is not known (the bug variant enters neither MoE group, as #21979's description implies). One decoder layer:
the attention is one column/row-parallel pair whose ``o_proj`` output goes through ``tensor_model_parallel_all_reduce``;
the MoE block is a replicated top-2 router over 4 experts (2 per EP rank, each expert's intermediate split over the
2 MoE-TP ranks) with dense per-expert matmuls. Float32, world 4, hidden 4. The IPC handle/offset exchange is
reduced to unified addresses; no signal buffers or barriers (lock step runs every rank's prologue, the staging
copy, before any rank's kernel); the one-stage kernel only; pynccl, PP (size 1) and quick all-reduce left out.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/21907"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "graph_capture"
SYMPTOM = "MoE with 1 < ep < tp under CUDA graphs: replay raises 'illegal memory access' in the custom all-reduce"

TP_SIZE, EP_SIZE = 4, 2
MOE_TP_SIZE = TP_SIZE // EP_SIZE
HIDDEN, ATTN_INTER, NUM_EXPERTS, INTER, TOP_K = 4, 8, 4, 4, 2
CAPTURE_BS = [2, 4]
SEG = max(CAPTURE_BS) * HIDDEN     # elements of one allocation
MAX_RANK_DATA = 8                  # RankData slots of one communicator
GARBAGE = -1                       # what torch.empty left in a rank_data slot: an address nothing maps


class DeviceMemory:
    """Every rank's device allocations at unified addresses (what NVLink reaches, in lock step)."""

    def __init__(self, device):
        self.device, self.segments, self.eager_blocks = device, [], {}

    def alloc(self):
        self.segments.append(torch.zeros(SEG, device=self.device))   # inside a capture: a graph pool block
        return len(self.segments) - 1

    def view(self, ptr, numel):
        return self.segments[ptr][:numel]

    def put(self, key, t):
        """The memory a tensor lives in: a fresh graph-pool block under capture, the allocator's cached block
        for ``key`` eagerly. Returns its address."""
        if is_capturing():
            ptr = self.alloc()
        else:
            if key not in self.eager_blocks:
                self.eager_blocks[key] = self.alloc()
            ptr = self.eager_blocks[key]
        self.view(ptr, t.numel()).copy_(t.reshape(-1))
        return ptr


class CustomAllreduce:
    """``sglang...device_communicators.custom_all_reduce.CustomAllreduce`` of one rank (with the C++ object's
    ``rank_data``, ``buffers_`` and ``graph_unreg_buffers_``)."""

    def __init__(self, mem, rank, group_ranks, device):
        self.mem, self.rank, self.group_ranks = mem, rank, group_ranks
        self.world_size = len(group_ranks)
        self.rank_data = torch.full((MAX_RANK_DATA, self.world_size), GARBAGE, dtype=torch.long, device=device)
        self.d_rank_data_base_ = 0
        self.buffers_: dict[int, int] = {}
        self.graph_unreg_buffers_: list[int] = []
        self.buffer = mem.alloc()            # this rank's part of create_shared_buffer (the IPC staging buffer)
        self.buffer_ptrs: list[int] = []
        self._IS_CAPTURING = False

    def register_buffer(self, ptrs):
        self.rank_data[self.d_rank_data_base_] = torch.tensor(ptrs)
        self.buffers_[ptrs[self.group_ranks.index(self.rank)]] = self.d_rank_data_base_
        self.d_rank_data_base_ += 1

    def get_graph_buffer_ipc_meta(self):
        return list(self.graph_unreg_buffers_)

    def register_graph_buffers(self, all_meta):
        """``ops.register_graph_buffers(self._ptr, handles, offsets)`` after the all-gather of every member's
        ``get_graph_buffer_ipc_meta()``: slot ``base + i`` gets every member's i-th captured buffer."""
        for i in range(len(self.graph_unreg_buffers_)):
            self.rank_data[self.d_rank_data_base_ + i] = torch.tensor([meta[i] for meta in all_meta])
        self.d_rank_data_base_ += len(self.graph_unreg_buffers_)
        self.graph_unreg_buffers_.clear()

    def custom_all_reduce(self, inp_ptr, numel):
        """The main allreduce API that provides support for cuda graph. Returns the kernel launch (run once every
        member has done its prologue)."""
        if self._IS_CAPTURING:
            if is_capturing():
                return self.all_reduce(inp_ptr, numel, registered=True)
            # warm up: mimic the allocation pattern, custom allreduce is out-of-place
            zeros = torch.zeros_like(self.mem.view(inp_ptr, numel))
            return lambda: (zeros, torch.zeros((), dtype=torch.bool, device=zeros.device))
        return self.all_reduce(inp_ptr, numel, registered=False)

    def all_reduce(self, inp_ptr, numel, registered):
        if registered:                                           # ops.all_reduce(self._ptr, inp, out, 0, 0)
            input_ptr = inp_ptr
        else:                                                    # cudaMemcpyAsync(reg_buffer, inp) first
            self.mem.view(self.buffer, numel).copy_(self.mem.view(inp_ptr, numel))
            input_ptr = self.buffer
        return self.allreduce(input_ptr, numel)

    def allreduce(self, input_ptr, numel):
        """C++ ``CustomAllreduce::allreduce``: the slot of ``rank_data`` the kernel will read."""
        if is_capturing():                                       # cudaStreamCaptureStatusActive
            slot = self.d_rank_data_base_ + len(self.graph_unreg_buffers_)
            self.graph_unreg_buffers_.append(input_ptr)
        else:
            if input_ptr not in self.buffers_:
                raise RuntimeError(f"buffer address {input_ptr} is not registered!")
            slot = self.buffers_[input_ptr]
        ptrs = self.rank_data[slot]                              # the kernel argument: &d_rank_data_base_[slot]
        return lambda: self.cross_device_reduce_1stage(ptrs, numel)

    def cross_device_reduce_1stage(self, ptrs, numel):
        memory = torch.stack(self.mem.segments)                  # every peer's memory, read at launch
        flat, n_seg = memory.reshape(-1), memory.shape[0]
        lane = torch.arange(numel, device=memory.device)
        tmp = torch.zeros(numel, device=memory.device)
        fault = torch.zeros((), dtype=torch.bool, device=memory.device)
        for j in range(self.world_size):
            p = ptrs[j:j + 1]                                    # a device-side read: no host sync
            fault = fault | ~((p >= 0) & (p < n_seg))[0]
            tmp = tmp + flat.index_select(0, p.clamp(0, n_seg - 1) * SEG + lane)
        return tmp, fault


class GraphCaptureContext:
    def __init__(self, stream):
        self.stream = stream


class GroupCoordinator:
    """One group kind (``_TP``, ``_PP``, ``_MOE_EP``, ``_MOE_TP``) on every rank at once: ``ca_comms[rank]`` is the
    ``ca_comm`` of that rank's coordinator (None for a group of one)."""

    def __init__(self, mem, group_ranks, group_name, device):
        self.unique_name, self.group_ranks = group_name, group_ranks
        self.world_size = len(group_ranks[0])
        self.ca_comms: dict[int, CustomAllreduce] = {}
        if self.world_size > 1:
            for ranks in group_ranks:
                cas = [CustomAllreduce(mem, r, ranks, device) for r in ranks]
                for ca in cas:                                   # create_shared_buffer: all-gather, open handles
                    ca.buffer_ptrs = [peer.buffer for peer in cas]
                    ca.register_buffer(ca.buffer_ptrs)
                self.ca_comms.update({ca.rank: ca for ca in cas})

    @contextlib.contextmanager
    def _ca_capture(self):
        """Every rank's ``ca_comm.capture()``: its ``finally`` is ``register_graph_buffers()``, whose all-gather
        spans the rank's group (lock step: every member's metadata is gathered before any member registers)."""
        try:
            for ca in self.ca_comms.values():
                ca._IS_CAPTURING = True
            yield
        finally:
            for ca in self.ca_comms.values():
                ca._IS_CAPTURING = False
            meta = {r: ca.get_graph_buffer_ipc_meta() for r, ca in self.ca_comms.items()}
            for ca in self.ca_comms.values():
                ca.register_graph_buffers([meta[r] for r in ca.group_ranks])

    @contextlib.contextmanager
    def graph_capture(self, graph_capture_context=None, stream=None):
        if graph_capture_context is None:
            graph_capture_context = GraphCaptureContext(stream)
        maybe_ca_context = contextlib.nullcontext() if not self.ca_comms else self._ca_capture()
        with maybe_ca_context:
            yield graph_capture_context

    def all_reduce(self, mem, inputs, tag):
        """``all_reduce`` -> ``outplace_all_reduce(method="ca")`` -> ``ca_comm.custom_all_reduce`` on every rank."""
        if self.world_size == 1:
            return {r: (t, None) for r, t in inputs.items()}
        shape = next(iter(inputs.values())).shape
        launches = {r: self.ca_comms[r].custom_all_reduce(mem.put((self.unique_name, tag, r), t), t.numel())
                    for r, t in inputs.items()}
        # the kernels' start barrier: every member's staging copy is done before any member reduces
        return {r: (out.view(shape), fault) for r, (out, fault) in ((r, k()) for r, k in launches.items())}


class ParallelState:
    """The module globals of ``parallel_state`` (``_TP``, ``_PP``, ``_MOE_EP``, ``_MOE_TP``), every rank's."""

    def __init__(self, mem, device):
        ranks = list(range(TP_SIZE))
        self._TP = GroupCoordinator(mem, [ranks], "tp", device)
        self._PP = GroupCoordinator(mem, [[r] for r in ranks], "pp", device)
        self._MOE_EP = GroupCoordinator(mem, [ranks[t::MOE_TP_SIZE] for t in range(MOE_TP_SIZE)], "moe_ep", device)
        self._MOE_TP = GroupCoordinator(mem, [ranks[e * MOE_TP_SIZE:(e + 1) * MOE_TP_SIZE] for e in range(EP_SIZE)],
                                        "moe_tp", device)


@contextlib.contextmanager
def graph_capture(ps, variant, stream=None):
    """``graph_capture`` is a context manager which should surround the code that is capturing the CUDA graph."""
    with ps._TP.graph_capture(stream=stream) as context, ps._PP.graph_capture(context):
        if variant == "bug":
            yield context                    # the MoE groups' contexts are never entered
            return
        with contextlib.ExitStack() as stack:
            seen = {id(ps._TP)}
            for group in (ps._MOE_EP, ps._MOE_TP):
                if group is not None and id(group) not in seen:
                    seen.add(id(group))
                    stack.enter_context(group.graph_capture(context))
            yield context


class Qwen3MoeDecoderLayer:
    """Every rank's copy of one decoder layer (lock step)."""

    def __init__(self, ps, mem, device):
        gen = generator(21907)
        self.ps, self.mem = ps, mem
        a, i = ATTN_INTER // TP_SIZE, INTER // MOE_TP_SIZE
        self.qkv_proj = [randn(HIDDEN, a, gen=gen, device=device, scale=0.5) for _ in range(TP_SIZE)]
        self.o_proj = [randn(a, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(TP_SIZE)]
        self.gate = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device)
        w13 = [randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5) for _ in range(NUM_EXPERTS)]
        w2 = [randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(NUM_EXPERTS)]
        self.w13 = {r: [w[:, (r % MOE_TP_SIZE) * i:(r % MOE_TP_SIZE + 1) * i] for w in w13] for r in range(TP_SIZE)}
        self.w2 = {r: [w[(r % MOE_TP_SIZE) * i:(r % MOE_TP_SIZE + 1) * i] for w in w2] for r in range(TP_SIZE)}

    def local_experts(self, rank):
        ep_rank = rank // MOE_TP_SIZE
        per = NUM_EXPERTS // EP_SIZE
        return range(ep_rank * per, (ep_rank + 1) * per)

    def experts(self, rank, h):
        """``FusedMoE`` on one rank: its EP rank's experts, its MoE-TP shard of their intermediate."""
        vals, ids = torch.topk(torch.softmax(h @ self.gate, dim=-1), TOP_K, dim=-1)
        weights = torch.zeros(h.shape[0], NUM_EXPERTS, device=h.device).scatter(1, ids, vals / vals.sum(-1, True))
        out = torch.zeros_like(h)
        for e in self.local_experts(rank):
            out = out + weights[:, e:e + 1] * (torch.nn.functional.silu(h @ self.w13[rank][e]) @ self.w2[rank][e])
        return out

    def forward(self, x):
        ps, faults = self.ps, []

        def reduce(group, parts, tag):
            res = group.all_reduce(self.mem, parts, tag)
            faults.extend(f for _, f in res.values() if f is not None)
            return {r: t for r, (t, _) in res.items()}

        ranks = range(TP_SIZE)
        # tensor_model_parallel_all_reduce of o_proj's partial sums
        attn = reduce(ps._TP, {r: torch.tanh(x @ self.qkv_proj[r]) @ self.o_proj[r] for r in ranks}, "o_proj")
        h = {r: x + attn[r] for r in ranks}
        # Qwen3MoeSparseMoeBlock.forward_normal
        final_hidden_states = {r: self.experts(r, h[r]) for r in ranks}
        if EP_SIZE > 1:
            final_hidden_states = reduce(ps._MOE_EP, final_hidden_states, "moe_ep")    # moe_expert_parallel_all_reduce
        if MOE_TP_SIZE > 1:
            # moe_tensor_model_parallel_all_reduce
            final_hidden_states = reduce(ps._MOE_TP, final_hidden_states, "moe_tp")
        outs = [h[r] + final_hidden_states[r] for r in ranks]
        return (*outs, torch.stack(faults).any())


class CudaGraphRunner:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.mem = DeviceMemory(device)
        self.ps = ParallelState(self.mem, device)
        self.model = Qwen3MoeDecoderLayer(self.ps, self.mem, device)
        self.input_buffer = torch.zeros(max(CAPTURE_BS), HIDDEN, device=device)
        self.graphs = {}

    def capture(self):
        with graph_capture(self.ps, self.variant):
            for bs in reversed(CAPTURE_BS):
                self.graphs[bs] = capture(lambda bs=bs: self.model.forward(self.input_buffer[:bs]),
                                          device=self.device, name=f"decode bs={bs}", owner="CudaGraphRunner",
                                          static={"input_buffer": self.input_buffer})

    def step(self, x, graphed):
        if graphed:
            bs = x.shape[0]
            self.input_buffer[:bs].copy_(x)
            *outs, fault = replay(*self.graphs[bs])
        else:
            *outs, fault = self.model.forward(x)
        if bool(fault):                                          # torch.cuda.synchronize()
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [o.clone() for o in outs]


def run(variant: str, device: str = "cpu"):
    gen = generator(2190700)
    steps = [randn(bs, HIDDEN, gen=gen, device=device) for bs in (4, 2, 4, 2)]

    def serve(graphed: bool):
        runner = CudaGraphRunner(device, variant)
        if graphed:
            runner.capture()
        outs = []
        for x in steps:
            outs.extend(runner.step(x, graphed))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
