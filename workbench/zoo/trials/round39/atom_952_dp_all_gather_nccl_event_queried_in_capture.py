"""A DP-attention MoE layer gathers its tokens through NCCL inside the graph capture: the watchdog's event query kills it.

Upstream: https://github.com/ROCm/ATOM/pull/952 ("fix(dp): route DP all_gather through custom AR to survive
CUDAGraph capture"), commit 378715d88.
Symptom: (commit message) ``--enable-dp-attention`` with hipgraph capture (the default ``--level 0`` path on
DeepSeek-V4-Pro) crashed mid-capture with "HIP error: operation not permitted on an event last recorded in a
capturing stream (hipErrorCapturedEvent)", raised by the ProcessGroupNCCL watchdog calling ``hipEventQuery``
on a WorkNCCL end-event recorded inside the capturing stream. Eagerly the same model serves fine.
Mechanism: in ``atom/model_ops/moe.py``, ``all_gather_with_padding`` (the hidden-states and router-logits
gathers before the fused MoE) called ``get_dp_group().all_gather(padded_x, dim=0)``; its default
``use_custom=False`` falls through to ``torch.distributed.all_gather_into_tensor`` on the NCCL process group.
``ProcessGroupNCCL`` records a ``WorkNCCL`` end event after the collective and hands the work to its watchdog,
which polls the works it holds with ``isCompleted()`` (``hipEventQuery`` of the end event). Inside the decode
graph capture the first gather's end event is recorded on the capturing stream; the watchdog's next poll
(modelled here as running whenever the process group is entered again: the router-logits gather) queries it,
a host read of an event that only exists in the graph being built, which the runtime refuses, and the capture
dies. The counterpart ``reduce_scatter_with_unpadding`` already used the custom all-reduce (IPC buffers, no
NCCL work, no event), which is capture-safe. Work made before the capture is flushed first (``capture_begin``
waits for the watchdog's pending queries, as PyTorch does since #110665), so only work recorded inside the
capture is queried. Why the ROCm build's ProcessGroupNCCL handed captured work to the watchdog was not read;
the model follows the commit message. The same change in ``deepseek_v4.py`` ``_hash_topk`` (an int32 input-id
gather) is not modelled.
Doctor: sync-in-capture, at ``isCompleted`` (the watchdog's query of the captured all-gather's end event).
Fix (upstream): both gathers pass ``use_custom=True`` (``get_dp_group().all_gather(padded_x, use_custom=True,
dim=0)``), routing them through the custom all-reduce's IPC all-gather, which records no NCCL work for the
watchdog. (Diff read: the two call-site hunks and the commit message.)
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/ATOM/pull/952"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "isCompleted"
SYMPTOM = "decode graph capture with DP attention dies: watchdog queries an NCCL end event recorded in the capture"

DP_SIZE, RANK = 2, 0
HIDDEN, NUM_EXPERTS, TOPK, INTER = 8, 4, 2, 6
GRAPH_BS = 4                       # the decode graph's batch size (ctx.context.graph_bs)
STEPS = 4


class ForwardContext:
    def __init__(self):
        self.graph_bs = GRAPH_BS
        self.is_prefill = False


_ctx = ForwardContext()


def get_forward_context():
    return _ctx


class CUDAEvent:
    """An end event: ``flag`` is what the device sets once the stream runs past the record, and what
    ``hipEventQuery`` reads back on the host."""

    def __init__(self, device):
        self.flag = torch.zeros((), dtype=torch.int32, device=device)

    def record(self):
        self.flag.fill_(1)


class WorkNCCL:
    def __init__(self, device):
        self.ncclEndEvent_ = CUDAEvent(device)

    def isCompleted(self) -> bool:
        # finishedGPUExecutionInternal(): hipEventQuery(ncclEndEvent_) == hipSuccess
        return bool(self.ncclEndEvent_.flag.item())


class ProcessGroupNCCL:
    """Rank 0 of the DP group; ``peer_recv[i]`` is what the transport delivers of rank 1's tensor for the
    ``i``-th collective of a step (written by the runner before the step, as rank 1's NCCL send would)."""

    def __init__(self, device, peer_recv):
        self.device, self.peer_recv = device, peer_recv
        self.workMetaList_: list[WorkNCCL] = []
        self.calls = 0

    def allgather_into_tensor(self, output, input_):
        self.watchdog()                           # the watchdog thread polls meanwhile
        peer = self.peer_recv[self.calls]
        self.calls += 1
        work = WorkNCCL(self.device)
        n = input_.shape[0]
        output[RANK * n:(RANK + 1) * n].copy_(input_)          # ncclAllGather on the NCCL stream
        output[(1 - RANK) * n:(2 - RANK) * n].copy_(peer)
        work.ncclEndEvent_.record()
        self.workMetaList_.append(work)           # workEnqueue: the watchdog will query its end event
        return work

    def watchdog(self):
        """One poll of ``ProcessGroupNCCL::Watchdog::run``: erase the works whose end event completed."""
        self.workMetaList_ = [w for w in self.workMetaList_ if not w.isCompleted()]

    def wait_pending_event_queries(self):
        """``CUDAGraph::capture_begin`` waits until the watchdog has no work left to query."""
        while self.workMetaList_:
            self.watchdog()


class CustomAllreduce:
    """aiter's custom all-reduce: IPC-registered buffers, a plain kernel on the current stream, no work
    object and no event (capture-safe). ``peer_recv[i]`` is rank 1's registered buffer for the ``i``-th call."""

    def __init__(self, peer_recv):
        self.peer_recv, self.calls = peer_recv, 0

    def custom_all_gather(self, input_):
        peer = self.peer_recv[self.calls]
        self.calls += 1
        parts = [input_, peer] if RANK == 0 else [peer, input_]
        return torch.cat(parts, dim=0)

    def custom_reduce_scatter(self, input_, peer_partial):
        total = input_ + peer_partial
        n = total.shape[0] // DP_SIZE
        return total[RANK * n:(RANK + 1) * n]


class GroupCoordinator:
    def __init__(self, device, gather_recv, scatter_recv):
        self.device = device
        self.device_group = ProcessGroupNCCL(device, gather_recv)
        self.ca_comm = CustomAllreduce(gather_recv)
        self.scatter_recv = scatter_recv

    def begin_step(self):
        self.device_group.calls = self.ca_comm.calls = 0

    def all_gather(self, input_, use_custom=False, dim=0):
        if use_custom:
            return self.ca_comm.custom_all_gather(input_)
        n = input_.shape[0]
        output = torch.empty((DP_SIZE * n,) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        # torch.distributed.all_gather_into_tensor(output, input_, group=self.device_group)
        self.device_group.allgather_into_tensor(output, input_)
        return output

    def reduce_scatter_tensor(self, x):
        return self.ca_comm.custom_reduce_scatter(x, self.scatter_recv)


_dp_group: GroupCoordinator | None = None
_variant = "bug"


def get_dp_group() -> GroupCoordinator:
    return _dp_group


def pad_for_all_gather(x):
    ctx = get_forward_context()
    max_batch_size = ctx.graph_bs
    original_batch_size = x.shape[0]
    padded_x = x
    if original_batch_size < max_batch_size:
        padding = torch.empty((max_batch_size - original_batch_size,) + tuple(x.shape[1:]),
                              dtype=x.dtype, device=x.device)
        # padding.zero_()   (upstream; the decode batches here always fill graph_bs)
        padded_x = torch.cat([x, padding], dim=0)
    return padded_x, original_batch_size


def all_gather_with_padding(x):
    padded_x, original_batch_size = pad_for_all_gather(x)
    if _variant == "bug":
        gathered_hidden_states = get_dp_group().all_gather(padded_x, dim=0)
    else:
        gathered_hidden_states = get_dp_group().all_gather(padded_x, use_custom=True, dim=0)
    return gathered_hidden_states, original_batch_size


def reduce_scatter_with_unpadding(x, original_batch_size):
    scattered_output = get_dp_group().reduce_scatter_tensor(x)
    return scattered_output[:original_batch_size]


class FusedMoE:
    """This rank's shard (intermediate columns) of every expert: the reduce-scatter sums the shards."""

    def __init__(self, gen, device):
        self.gate = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device, scale=0.5)
        self.w13 = randn(NUM_EXPERTS, HIDDEN, INTER, gen=gen, device=device, scale=0.4)
        self.w2 = randn(NUM_EXPERTS, INTER, HIDDEN, gen=gen, device=device, scale=0.4)

    def fused_moe(self, hidden_states, router_logits):
        weights, ids = torch.topk(torch.softmax(router_logits, dim=-1), TOPK, dim=-1)
        out = torch.zeros_like(hidden_states)
        for k in range(TOPK):
            h = torch.einsum("th,thi->ti", hidden_states, self.w13[ids[:, k]])
            y = torch.einsum("ti,tih->th", torch.nn.functional.silu(h), self.w2[ids[:, k]])
            out = out + weights[:, k:k + 1] * y
        return out

    def forward(self, hidden_states):
        router_logits = hidden_states @ self.gate
        hidden_states, original_batch_size = all_gather_with_padding(hidden_states)
        router_logits, _ = all_gather_with_padding(router_logits)
        out = self.fused_moe(hidden_states, router_logits)
        return reduce_scatter_with_unpadding(out, original_batch_size)


class Model:
    def __init__(self, device):
        gen = generator(952)
        self.w_in = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.moe = FusedMoE(gen, device)

    def forward(self, x):
        get_dp_group().begin_step()
        h = torch.tanh(x @ self.w_in)              # attention stand-in: local to this DP rank
        return h + self.moe.forward(h)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(9520)
    steps = [(randn(GRAPH_BS, HIDDEN, gen=gen, device=device),           # this rank's decode batch
              randn(GRAPH_BS, HIDDEN, gen=gen, device=device),           # rank 1's hidden states
              randn(GRAPH_BS, NUM_EXPERTS, gen=gen, device=device),      # rank 1's router logits
              randn(DP_SIZE * GRAPH_BS, HIDDEN, gen=gen, device=device, scale=0.1))  # rank 1's MoE partials
             for _ in range(STEPS)]

    def serve(graphed: bool):
        global _dp_group
        gather_recv = [torch.zeros(GRAPH_BS, HIDDEN, device=device),
                       torch.zeros(GRAPH_BS, NUM_EXPERTS, device=device)]
        scatter_recv = torch.zeros(DP_SIZE * GRAPH_BS, HIDDEN, device=device)
        _dp_group = GroupCoordinator(device, gather_recv, scatter_recv)
        model = Model(device)
        input_hidden = torch.zeros(GRAPH_BS, HIDDEN, device=device)
        graph = out = None
        if graphed:
            static = {"input_hidden": input_hidden, "peer_hidden": gather_recv[0],
                      "peer_router_logits": gather_recv[1], "peer_moe_partial": scatter_recv}
            events.static_buffers("ModelRunner (DP-attention decode graph)", static)
            with events.warmup():                 # the warmup run before capture
                model.forward(input_hidden)
            # CUDAGraph::capture_begin: wait until the watchdog has queried the warmup's works
            _dp_group.device_group.wait_pending_event_queries()
            graph, out = capture(lambda: model.forward(input_hidden), device=device, warmups=0,
                                 owner="ModelRunner (DP-attention decode graph)")
        outs = []
        for x, peer_h, peer_logits, peer_partial in steps:
            input_hidden.copy_(x)
            gather_recv[0].copy_(peer_h)
            gather_recv[1].copy_(peer_logits)
            scatter_recv.copy_(peer_partial)
            if graphed:
                outs.append(replay(graph, out).clone())
            else:
                outs.append(model.forward(input_hidden).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
