"""nixl_ep kernels take the device context by value: an old graph keeps the memory views a scale event released.

Upstream: https://github.com/ai-dynamo/nixl/pull/1584 ("nixl_ep: Preserve low-latency CUDA graphs across scale
up/down", commit 7291c57db; release cherry-pick #1589). Read: ``git show 7291c57db`` (nixl_ep.cpp, nixl_ep.hpp,
kernels/api.cuh, kernels/nixl_ep_ll.cu, nixl_ep/buffer.py) and ``connect_ranks`` / ``disconnect_ranks`` /
``_nixl_ep_memory_views_{create,destroy}`` in its parent.
Symptom: low-latency MoE decode graphs (dispatch + combine captured) do not survive elastic scale up/down: a graph
captured before ``connect_ranks``/``disconnect_ranks`` must be re-captured, because its replay uses released NIXL
memory views (and the old rank view); no error text is quoted upstream.
Mechanism: ``nixl_ep::Buffer`` keeps a host struct ``gpu_nixl_ctx gpu_ctx`` with the NIXL memory-view handles
(``local_mvh``, ``remote_mvh``, ``barrier_mvh``, ...) and rank info. ``Buffer::dispatch`` / ``Buffer::combine`` /
``Buffer::barrier`` launch ``ep_kernels::dispatch/combine/barrier`` with ``gpu_ctx`` **by value** (a kernel
argument), so a capture freezes the handles into the graph's kernel nodes. On a scale event ``connect_ranks`` and
``disconnect_ranks`` call ``_nixl_ep_memory_views_destroy()`` (``releaseMemView`` on every handle) and then
``_nixl_ep_memory_views_create()`` (``prepMemView``: new handles in ``gpu_ctx``). Eager calls pass the new struct;
a replay still passes the captured one, whose views the agent has released. In the model a handle is the device
table its view describes (per peer rank: which rdma buffer its descriptor names; ``nixl_null_agent`` for a rank
that is not connected); the kernels look the target rank up in it; the mask buffer is persistent device memory.
Doctor: dangling-reference, at ``dispatch`` (it hands the kernels the capture-time ``gpu_ctx``, whose remote view
``_nixl_ep_memory_views_destroy`` later releases while the graph still reads it).
Fix (upstream): ``_nixl_ep_init`` allocates a device copy ``gpu_ctx_ptr`` (``cudaMalloc``) and
``_nixl_ep_memory_views_create`` refreshes it (``cudaMemcpy(gpu_ctx_ptr, &gpu_ctx, ...)``); dispatch/combine/barrier
pass ``gpu_ctx_ptr`` and the kernels read ``auto nixl_ctx = *nixl_ctx_ptr`` at start, so a graph keeps a fixed
pointer and reads the current context at each replay. (The same PR's ``connect_ranks(..., activate=False)``,
which connects a peer masked, is not modelled.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/ai-dynamo/nixl/pull/1584"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "dispatch"
SYMPTOM = "after connect_ranks/disconnect_ranks, an old low-latency MoE graph replays with released NIXL memory views"

MAX_NUM_RANKS, RANK, NUM_EXPERTS_PER_RANK = 4, 0, 1
NUM_EXPERTS = MAX_NUM_RANKS * NUM_EXPERTS_PER_RANK
HIDDEN, NUM_TOKENS, NUM_TOPK, STEPS = 8, 4, 2, 6
NUM_SLOTS = NUM_TOKENS * NUM_TOPK          # num_max_dispatch_tokens_per_rank * topk slots in a peer's buffer
NULL_SLOT = MAX_NUM_RANKS                  # where a nixl_null_agent descriptor lands (nothing reads it back)


@dataclasses.dataclass
class gpu_nixl_ctx:
    """The host struct the kernels receive (the model keeps the handle they use, the remote view)."""

    remote_mvh: torch.Tensor | None
    rank: int
    max_num_ranks: int


class nixlAgent:
    """Makes and releases memory views: a view is device memory the agent owns until ``releaseMemView``."""

    def __init__(self, device):
        self.device, self.views, self.released = device, [], []

    def prepMemView(self, descs: list[int]) -> torch.Tensor:
        table = torch.full((own_segment_elems(self.device),), NULL_SLOT, dtype=torch.int64)
        table[:len(descs)] = torch.tensor(descs, dtype=torch.int64)
        mvh = table.to(self.device)
        self.views.append(mvh)
        return mvh

    def releaseMemView(self, mvh: torch.Tensor) -> None:
        # (the agent frees the view's memory at its next sync point, so that torch's caching allocator does
        # not hand the same block straight to the next view: NIXL's views are not torch allocations)
        self.views = [v for v in self.views if v is not mvh]
        self.released.append(mvh)

    def progress(self) -> None:
        self.released.clear()


def dispatch_kernel(rdma_recv_x, x, topk_idx, slots, mask_buffer_ptr, nixl_ctx_table):
    """ep_kernels::dispatch: each (token, k) goes to the rank holding its expert, through the remote view."""
    target = topk_idx // NUM_EXPERTS_PER_RANK
    dest = torch.where(mask_buffer_ptr[target] != 0, NULL_SLOT, nixl_ctx_table[target])
    rdma_recv_x.zero_()
    rdma_recv_x[dest, slots] = x[:, None, :].expand(NUM_TOKENS, NUM_TOPK, HIDDEN)


def combine_kernel(combined_x, rdma_recv_combine, topk_idx, topk_weights, slots, mask_buffer_ptr, nixl_ctx_table):
    """ep_kernels::combine: read each expert output back through the remote view, weighted by top-k."""
    target = topk_idx // NUM_EXPERTS_PER_RANK
    src = torch.where(mask_buffer_ptr[target] != 0, NULL_SLOT, nixl_ctx_table[target])
    y = rdma_recv_combine[src, slots]
    combined_x.copy_((y * topk_weights[..., None]).sum(1))


class Buffer:
    def __init__(self, device, variant, expert_weights):
        self.device, self.variant = device, variant
        self.agent = nixlAgent(device)
        self.remote_ranks: list[int] = []
        # peers' rdma buffers as the views map them (row NULL_SLOT: the null agent's), and their experts
        self.rdma_recv_x = torch.zeros(MAX_NUM_RANKS + 1, NUM_SLOTS, HIDDEN, device=device)
        self.rdma_recv_combine = torch.zeros(MAX_NUM_RANKS + 1, NUM_SLOTS, HIDDEN, device=device)
        self.expert_weights = expert_weights
        self.combined_x = torch.zeros(NUM_TOKENS, HIDDEN, device=device)
        self.slots = torch.arange(NUM_SLOTS, device=device).view(NUM_TOKENS, NUM_TOPK)
        mask = torch.ones(MAX_NUM_RANKS, dtype=torch.int32)
        mask[RANK] = 0
        self.mask_buffer_ptr = mask.to(device)                    # 1 = masked (not connected / removed)
        self._nixl_ep_init()
        self._nixl_ep_memory_views_create()

    def _nixl_ep_init(self):
        self.gpu_ctx = gpu_nixl_ctx(remote_mvh=None, rank=RANK, max_num_ranks=MAX_NUM_RANKS)
        if self.variant == "fix":     # cudaMalloc(&gpu_ctx_ptr, sizeof(gpu_nixl_ctx))
            self.gpu_ctx_ptr = torch.full((own_segment_elems(self.device),), NULL_SLOT, dtype=torch.int64,
                                          device=self.device)

    def _nixl_ep_memory_views_create(self):
        connected = set(self.remote_ranks) | {RANK}
        descs = [r if r in connected else NULL_SLOT for r in range(MAX_NUM_RANKS)]
        self.gpu_ctx.remote_mvh = self.agent.prepMemView(descs)
        if self.variant == "fix":     # cudaMemcpy(gpu_ctx_ptr, &gpu_ctx, sizeof(gpu_ctx), cudaMemcpyHostToDevice)
            self.gpu_ctx_ptr.copy_(self.gpu_ctx.remote_mvh)

    def _nixl_ep_memory_views_destroy(self):
        if self.gpu_ctx.remote_mvh is not None:
            self.agent.releaseMemView(self.gpu_ctx.remote_mvh)
        self.gpu_ctx.remote_mvh = None

    def update_mask_buffer(self, rank, mask: bool):
        self.mask_buffer_ptr[rank].fill_(1 if mask else 0)

    def connect_ranks(self, remote_ranks_list):
        new_ranks = [r for r in remote_ranks_list if r != RANK and r not in self.remote_ranks]
        for r in new_ranks:
            self.mask_buffer_ptr[r].fill_(0)                      # cudaMemset(mask_buffer_ptr + r, 0)
        if not new_ranks:
            return
        self.remote_ranks += new_ranks
        self._nixl_ep_memory_views_destroy()
        self._nixl_ep_memory_views_create()
        self._synchronize()                                       # cudaDeviceSynchronize()

    def disconnect_ranks(self, remote_ranks_list):
        for r in remote_ranks_list:
            self.update_mask_buffer(r, True)
        self._nixl_ep_memory_views_destroy()
        self.remote_ranks = [r for r in self.remote_ranks if r not in remote_ranks_list]
        self._nixl_ep_memory_views_create()
        self._synchronize()

    def _synchronize(self):
        self.agent.progress()
        release_to_driver(self.device)        # the released views' memory is gone

    def dispatch(self, x, topk_idx):
        # bug: gpu_ctx by value (the handle the capture saw); fix: gpu_ctx_ptr, which the kernel reads at launch
        nixl_ctx = self.gpu_ctx_ptr if self.variant == "fix" else self.gpu_ctx.remote_mvh
        dispatch_kernel(self.rdma_recv_x, x, topk_idx, self.slots, self.mask_buffer_ptr, nixl_ctx)
        return self.rdma_recv_x

    def combine(self, x, topk_idx, topk_weights):
        self.rdma_recv_combine.copy_(x)               # the experts' results, put back into the peers' buffers
        nixl_ctx = self.gpu_ctx_ptr if self.variant == "fix" else self.gpu_ctx.remote_mvh
        combine_kernel(self.combined_x, self.rdma_recv_combine, topk_idx, topk_weights, self.slots,
                       self.mask_buffer_ptr, nixl_ctx)
        return self.combined_x


def run(variant: str, device: str = "cpu"):
    gen = generator(1584)
    expert_weights = randn(MAX_NUM_RANKS + 1, HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
    batches = []
    for _ in range(STEPS):
        x = randn(NUM_TOKENS, HIDDEN, gen=gen, device=device)
        topk_idx = torch.randint(0, NUM_EXPERTS, (NUM_TOKENS, NUM_TOPK), generator=gen).to(device)
        topk_weights = torch.softmax(torch.randn(NUM_TOKENS, NUM_TOPK, generator=gen), -1).to(device)
        batches.append((x, topk_idx, topk_weights))

    def serve(graphed: bool):
        buffer = Buffer(device, variant, expert_weights)
        buffer.connect_ranks([1, 2])
        x_buf = torch.zeros(NUM_TOKENS, HIDDEN, device=device)
        idx_buf = torch.zeros(NUM_TOKENS, NUM_TOPK, dtype=torch.long, device=device)
        w_buf = torch.zeros(NUM_TOKENS, NUM_TOPK, device=device)

        def moe_step():
            recv_x = buffer.dispatch(x_buf, idx_buf)
            expert_out = torch.bmm(recv_x, buffer.expert_weights)   # each peer's expert, on its own GPU
            return buffer.combine(expert_out, idx_buf, w_buf)

        if graphed:
            g, out = capture(moe_step, device=device, name="low-latency decode",
                             static={"x": x_buf, "topk_idx": idx_buf, "topk_weights": w_buf},
                             state={"mask_buffer_ptr": buffer.mask_buffer_ptr, "rdma_recv_x": buffer.rdma_recv_x,
                                    "rdma_recv_combine": buffer.rdma_recv_combine}, owner="nixl_ep Buffer")
        outs = []
        for step, (x, topk_idx, topk_weights) in enumerate(batches):
            if step == 2:
                buffer.connect_ranks([3])         # scale up: a new peer joins
            if step == 4:
                buffer.disconnect_ranks([2])      # scale down: a peer leaves
            x_buf.copy_(x)
            idx_buf.copy_(topk_idx)
            w_buf.copy_(topk_weights)
            outs.append((replay(g, out) if graphed else moe_step()).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
