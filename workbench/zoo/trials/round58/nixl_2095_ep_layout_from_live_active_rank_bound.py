"""NIXL EP sizes the dispatch/combine layout from the live ``active_rank_bound``: a graph captured before a rank was unmasked keeps the old layout.

Upstream: https://github.com/ai-dynamo/nixl/pull/2095 ("nixl_ep: Allow CUDA graph reuse across rank changes"),
commit 890f1e9005612f25369bfcadf0f1e9cffedc9c38; the layout came to follow the mask with #1693 (``num_experts``
deprecated and ignored).
Symptom: "masking or unmasking ranks changes active_rank_bound, which changes tensor shapes, buffer offsets, and
kernel launch parameters captured in CUDA graphs. This prevents callers from reusing those graphs after rank
changes." A low-latency MoE decode graph replayed after a scale-up leaves the new rank's tokens out.
Mechanism: ``Buffer::update_mask_buffer(rank, mask)`` (also run by ``connect_ranks(..., activate)`` and
``disconnect_ranks``) flips ``active_ranks[rank]``, writes the device ``mask_buffer`` (kernels read it at run time)
and calls ``_refresh_active_rank_bound()``: the host member ``active_rank_bound`` = highest active rank + 1.
``Buffer::dispatch`` ignores the caller's ``num_experts`` and allocates ``packed_recv_x`` as
``{num_experts_per_rank, active_rank_bound * num_max_dispatch_tokens_per_rank, hidden}`` and
``packed_recv_layout_range`` as ``{num_experts_per_rank, active_rank_bound}``, and launches the dispatch kernel
with ``num_ranks = active_rank_bound``; ``Buffer::combine`` asserts its inputs against the live member and launches
with it too. A caller that captures dispatch -> experts -> combine (the MoE layer of a decode step) bakes the
bound of the capture into the graph: the shapes, the offsets and ``num_ranks``. Here ranks 2 and 3 are connected
but masked (``activate=False``) at capture, so the bound is 2; unmasking rank 3 (scale-up) makes it 4. Eager steps
now receive from and combine back to ranks 0..3; the replayed graph still runs the recv and send loops over ranks
0..1, so rank 3's tokens are never received by the local experts and nothing is sent back to it. (Masking a rank
instead shrinks the bound: then the host asserts of an eager combine on the graph's handle fail.) The send phase
of dispatch and the peers' reductions are left out: every rank's tokens (ours too) are already in the RDMA receive
region when the step runs, and the output is the RDMA region combine sends back to each source rank.
Doctor: warmup-divergence, at dispatch (the capture decided the layout and ``num_ranks`` from the host member of
that moment; replays keep it while an eager step now derives them from the new bound).
Fix (upstream): ``dispatch`` takes ``std::optional<int> num_experts`` again and sizes everything from
``get_rank_bound(num_experts)`` (``*num_experts / num_experts_per_rank``, asserted to cover the active experts and
not exceed ``max_num_ranks``; the live bound only when absent); ``combine`` and ``get_next_combine_buffer`` take the
bound from the handle (``layout_range.size(1)``). Callers pass the maximum expert count, so the layout stays fixed
while ranks are masked or unmasked and the kernels skip masked ranks through ``mask_buffer``.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ai-dynamo/nixl/pull/2095"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "dispatch"
SYMPTOM = "after unmasking rank 3 the replayed MoE graph still uses the 2-rank layout: rank 3's tokens are dropped"

MAX_NUM_RANKS, NUM_EXPERTS_PER_RANK, NUM_MAX_DISPATCH_TOKENS_PER_RANK, HIDDEN = 4, 2, 4, 8
NUM_EXPERTS = MAX_NUM_RANKS * NUM_EXPERTS_PER_RANK          # what the caller passes: the maximum physical experts


class EPHostAssert(RuntimeError):
    pass


def EP_HOST_ASSERT(cond: bool, what: str) -> None:  # noqa: N802 - the upstream macro's name
    if not cond:
        raise EPHostAssert(f"Assertion failed: {what}")


class Buffer:
    """``nixl_ep::Buffer`` (low-latency mode) of rank 0, with its RDMA regions sized by ``max_num_ranks``."""

    def __init__(self, variant: str, device: str, rank: int = 0) -> None:
        self.variant, self.rank = variant, rank
        self.max_num_ranks, self.num_experts_per_rank = MAX_NUM_RANKS, NUM_EXPERTS_PER_RANK
        self.remote_ranks: list[int] = []
        self.active_ranks = [r == rank for r in range(MAX_NUM_RANKS)]
        self.active_rank_bound = rank + 1
        self.mask_buffer = torch.ones(MAX_NUM_RANKS, dtype=torch.int32, device=device)     # 1 = masked
        self.mask_buffer[rank] = 0
        # where the peers' dispatch sends land: [local expert, src rank, slot, hidden] and the token counts
        self.rdma_recv_x = torch.zeros(NUM_EXPERTS_PER_RANK, MAX_NUM_RANKS, NUM_MAX_DISPATCH_TOKENS_PER_RANK, HIDDEN,
                                       device=device)
        self.rdma_recv_count = torch.zeros(NUM_EXPERTS_PER_RANK, MAX_NUM_RANKS, dtype=torch.int64, device=device)
        # what combine sends back to each source rank (their combine receive regions)
        self.combine_send_x = torch.zeros(MAX_NUM_RANKS, NUM_EXPERTS_PER_RANK, NUM_MAX_DISPATCH_TOKENS_PER_RANK,
                                          HIDDEN, device=device)

    # ---- elasticity ----
    def _refresh_active_rank_bound(self) -> None:
        self.active_rank_bound = max(r for r in range(self.max_num_ranks) if self.active_ranks[r]) + 1

    def update_mask_buffer(self, rank_to_mask: int, mask: bool) -> None:
        EP_HOST_ASSERT(rank_to_mask != self.rank or not mask, "cannot mask the local rank")
        EP_HOST_ASSERT(mask or rank_to_mask in self.remote_ranks, "cannot unmask an unconnected rank")
        self.active_ranks[rank_to_mask] = not mask
        self._refresh_active_rank_bound()
        self.mask_buffer[rank_to_mask] = int(mask)                  # ep_kernels::update_mask_buffer

    def connect_ranks(self, remote_ranks_list: list[int], activate: bool = True) -> None:
        self.remote_ranks += [r for r in remote_ranks_list if r != self.rank and r not in self.remote_ranks]
        if activate:
            for r in remote_ranks_list:
                if r != self.rank:
                    self.update_mask_buffer(r, False)

    def get_rank_bound(self, num_experts: int | None) -> int:
        if num_experts is None:
            return self.active_rank_bound
        EP_HOST_ASSERT(num_experts % self.num_experts_per_rank == 0, "num_experts % num_experts_per_rank == 0")
        EP_HOST_ASSERT(self.active_rank_bound * self.num_experts_per_rank <= num_experts
                       <= self.max_num_ranks * self.num_experts_per_rank, "num_experts covers the active experts")
        return num_experts // self.num_experts_per_rank

    # ---- low-latency dispatch / combine ----
    def dispatch(self, num_max_dispatch_tokens_per_rank: int, num_experts: int | None = None):
        if self.variant == "fix":
            rank_bound = self.get_rank_bound(num_experts)
        else:                                                       # num_experts: deprecated, ignored
            rank_bound = self.active_rank_bound
        num_max_recv_tokens = rank_bound * num_max_dispatch_tokens_per_rank
        dev = self.rdma_recv_x.device
        packed_recv_x = torch.empty(self.num_experts_per_rank, num_max_recv_tokens, HIDDEN, device=dev)
        packed_recv_layout_range = torch.empty(self.num_experts_per_rank, rank_bound, dtype=torch.int64, device=dev)
        packed_recv_count = torch.empty(self.num_experts_per_rank, dtype=torch.int32, device=dev)
        # ep_kernels::dispatch (receive phase), launched with num_ranks = rank_bound
        active = (self.mask_buffer[:rank_bound] == 0).to(torch.int64)
        counts = self.rdma_recv_count[:, :rank_bound] * active
        slot = torch.arange(num_max_dispatch_tokens_per_rank, device=dev)
        valid = (slot < counts[:, :, None]).unsqueeze(-1)
        packed_recv_x.view(self.num_experts_per_rank, rank_bound, num_max_dispatch_tokens_per_rank, HIDDEN).copy_(
            self.rdma_recv_x[:, :rank_bound] * valid)
        packed_recv_layout_range.copy_(counts)
        packed_recv_count.copy_(counts.sum(1))
        handle = (packed_recv_layout_range, num_max_dispatch_tokens_per_rank, HIDDEN)
        return packed_recv_x, packed_recv_count, handle

    def combine(self, x: torch.Tensor, handle) -> torch.Tensor:
        layout_range, num_max_dispatch_tokens_per_rank, hidden = handle
        if self.variant == "fix":
            rank_bound = layout_range.size(1)
            EP_HOST_ASSERT(self.active_rank_bound <= rank_bound <= self.max_num_ranks, "rank_bound in range")
        else:
            rank_bound = self.active_rank_bound
            EP_HOST_ASSERT(layout_range.size(1) == rank_bound, "layout_range.size(1) == active_rank_bound")
        EP_HOST_ASSERT(x.size(1) == rank_bound * num_max_dispatch_tokens_per_rank,
                       "x.size(1) == rank_bound * num_max_dispatch_tokens_per_rank")
        # ep_kernels::combine (send phase), launched with num_ranks = rank_bound: valid tokens go back to their rank
        slot = torch.arange(num_max_dispatch_tokens_per_rank, device=x.device)
        valid = (slot < layout_range[:, :, None]).unsqueeze(-1).transpose(0, 1)
        y = x.view(self.num_experts_per_rank, rank_bound, num_max_dispatch_tokens_per_rank, hidden).transpose(0, 1)
        sent = self.combine_send_x[:rank_bound]
        sent.copy_(torch.where(valid, y, sent))
        return self.combine_send_x


def moe_layer(buffer: Buffer, expert_w: torch.Tensor) -> torch.Tensor:
    """The caller's MoE decode layer: dispatch -> local experts -> combine (what it captures)."""
    recv_x, _recv_count, handle = buffer.dispatch(NUM_MAX_DISPATCH_TOKENS_PER_RANK, num_experts=NUM_EXPERTS)
    return buffer.combine(torch.nn.functional.silu(torch.bmm(recv_x, expert_w)), handle)


def run(variant: str, device: str = "cpu"):
    gen = generator(2095)
    expert_w = randn(NUM_EXPERTS_PER_RANK, HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
    n_steps = 4
    sends = [randn(NUM_EXPERTS_PER_RANK, MAX_NUM_RANKS, NUM_MAX_DISPATCH_TOKENS_PER_RANK, HIDDEN, gen=gen,
                   device=device) for _ in range(n_steps)]
    counts = [torch.randint(1, NUM_MAX_DISPATCH_TOKENS_PER_RANK + 1, (NUM_EXPERTS_PER_RANK, MAX_NUM_RANKS),
                            generator=gen).to(device) for _ in range(n_steps)]

    def start() -> Buffer:
        buffer = Buffer(variant, device)
        buffer.connect_ranks([1])                                   # rank 1 active
        buffer.connect_ranks([2, 3], activate=False)                # connected, kept masked
        return buffer

    def peers_send(buffer: Buffer, step: int) -> None:
        """The RDMA writes of this step's dispatch send phase (every active rank, ours too)."""
        active = torch.tensor(buffer.active_ranks, dtype=torch.int64, device=device)
        buffer.rdma_recv_x.copy_(sends[step])
        buffer.rdma_recv_count.copy_(counts[step] * active)

    def scale_event(buffer: Buffer, step: int) -> None:
        if step == 2:
            buffer.update_mask_buffer(3, False)                     # scale-up: rank 3 unmasked

    def eager():
        buffer, outs = start(), []
        for step in range(n_steps):
            scale_event(buffer, step)
            peers_send(buffer, step)
            outs.append(moe_layer(buffer, expert_w).clone())
        return outs

    def served():
        buffer, outs = start(), []
        events.persistent_state("nixl_ep.Buffer", {"mask_buffer": buffer.mask_buffer,
                                                   "combine_send_x": buffer.combine_send_x})
        peers_send(buffer, 0)
        g, out = capture(lambda: moe_layer(buffer, expert_w), device=device, name="moe decode",
                         static={"rdma_recv_x": buffer.rdma_recv_x, "rdma_recv_count": buffer.rdma_recv_count},
                         owner="MoE decode runner")
        for step in range(n_steps):
            scale_event(buffer, step)
            peers_send(buffer, step)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
