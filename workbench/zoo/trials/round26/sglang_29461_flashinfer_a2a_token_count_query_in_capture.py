"""FlashInfer MoE A2A dispatch queries the EP ranks' token counts (all-gather + host read) inside CUDA graph capture.

Upstream: https://github.com/sgl-project/sglang/pull/29461 ("Fix FlashInfer A2A dispatcher during CUDA graph
capture").
Symptom: with the FlashInfer all-to-all MoE backend (``--moe-a2a-backend flashinfer``) and EP > 1 without a
DP-attention token list, capturing the decode CUDA graphs failed in the dispatcher (sglang main, June 2026).
Mechanism: ``FlashinferDispatcher.dispatch`` must give ``MoeAlltoAll`` a ``runtime_max_tokens_per_rank`` that every
EP rank agrees on (the A2A buffers are ``[ep_size, runtime_max_tokens_per_rank, ...]``). With EP > 1 and no
per-rank DP list it queried the runtime token counts: an all-gather of each rank's token count over the EP group,
read back on the host (``max(...)`` of the gathered counts) to size the dispatch. The same Python runs during
CUDA graph capture, where the read-back is a device-to-host synchronisation on the capturing stream: the capture
fails. (Under capture the geometry is fixed anyway: every rank captures the same batch size.)
Doctor: sync-in-capture, at ``dispatch`` (the host read of the all-gathered token counts runs inside the
captured forward).
Fix (upstream): gate the query on ``not is_graph_capture`` (``get_is_capture_mode()`` or
``is_in_breakable_cuda_graph()``); during capture the dispatcher uses the fixed geometry ``x.shape[0]``, which
the graph keeps for its replays.
(Only the PR description was available; its diff was not read, so the shape of the query -- an all-gather of
the counts and a host ``max`` -- is this model's reading of "querying runtime token counts via NCCL all-gather".
EP is emulated in one process: this is rank 0 of 2, the peer captures and runs the same batch size, and all
experts are computed locally; the A2A is reduced to its fixed-geometry layout. Top-1 routing, decode bs 2 only.)
"""
from __future__ import annotations

import contextlib

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/29461"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "dispatch"
SYMPTOM = "decode CUDA graph capture fails in the FlashInfer A2A dispatcher (EP > 1): token-count read-back"
VOCAB, DIM, NUM_EXPERTS, EP_SIZE, MAX_NUM_TOKENS, BS = 8, 4, 2, 2, 4, 2

_is_capture_mode = False


def get_is_capture_mode() -> bool:
    return _is_capture_mode


def is_in_breakable_cuda_graph() -> bool:
    return False


@contextlib.contextmanager
def model_capture_mode():
    global _is_capture_mode
    _is_capture_mode = True
    try:
        yield
    finally:
        _is_capture_mode = False


class EPGroup:
    """The EP process group seen from rank 0; the peer rank runs the same batch sizes."""

    def __init__(self, device):
        self.rank, self.size = 0, EP_SIZE
        self.peer_num_tokens = torch.full((1,), BS, dtype=torch.int32, device=device)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:         # NCCL all-gather (capturable)
        return torch.cat([t, self.peer_num_tokens])


class MoeAlltoAll:
    """Fixed-geometry A2A workspace: ``[ep_size, max_num_tokens, ...]``; padding slots get the invalid expert id."""

    def __init__(self, ep_rank, device):
        self.ep_rank = ep_rank
        self.payload = torch.zeros(EP_SIZE, MAX_NUM_TOKENS, DIM, device=device)
        self.ids = torch.zeros(EP_SIZE, MAX_NUM_TOKENS, 1, dtype=torch.long, device=device)
        self.weights = torch.zeros(EP_SIZE, MAX_NUM_TOKENS, 1, device=device)
        self.combine_payload = torch.zeros(EP_SIZE, MAX_NUM_TOKENS, DIM, device=device)

    def dispatch(self, topk_ids, payloads, runtime_max_tokens_per_rank, invalid_token_expert_id):
        n, m = topk_ids.shape[0], runtime_max_tokens_per_rank
        x, ids, w = payloads
        self.payload[:, :m].zero_()
        self.ids[:, :m].fill_(invalid_token_expert_id)
        self.weights[:, :m].zero_()
        self.payload[self.ep_rank, :n] = x
        self.ids[self.ep_rank, :n] = ids
        self.weights[self.ep_rank, :n] = w
        return self.payload[:, :m], self.ids[:, :m], self.weights[:, :m]

    def combine(self, hidden_states, runtime_max_tokens_per_rank, num_tokens):
        self.combine_payload[:, :runtime_max_tokens_per_rank] = hidden_states
        return self.combine_payload[self.ep_rank, :num_tokens]


class FlashinferDispatcher:
    def __init__(self, group: EPGroup, device, variant):
        self.group, self.variant = group, variant
        self.ep_size, self.ep_rank = group.size, group.rank
        self.invalid_token_expert_id = NUM_EXPERTS
        self.max_num_tokens = MAX_NUM_TOKENS
        self.moe_a2a = MoeAlltoAll(self.ep_rank, device)

    def dispatch(self, hidden_states, topk_ids, topk_weights):
        x = hidden_states
        is_graph_capture = get_is_capture_mode() or is_in_breakable_cuda_graph()
        if self.ep_size > 1 and (self.variant == "bug" or not is_graph_capture):
            # Runtime token-count query: every EP rank must pass the same geometry to MoeAlltoAll.
            counts = self.group.all_gather(torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device))
            self.runtime_max_tokens_per_rank = int(counts.max().item())
        else:
            self.runtime_max_tokens_per_rank = x.shape[0]    # fixed geometry of the captured batch
        assert x.shape[0] <= self.runtime_max_tokens_per_rank <= self.max_num_tokens
        x_recv, ids_recv, w_recv = self.moe_a2a.dispatch(topk_ids, [x, topk_ids, topk_weights],
                                                         self.runtime_max_tokens_per_rank,
                                                         self.invalid_token_expert_id)
        return x_recv.reshape(-1, DIM), ids_recv.reshape(-1, 1), w_recv.reshape(-1, 1)

    def combine(self, hidden_states, num_tokens):
        out = self.moe_a2a.combine(hidden_states.view(self.ep_size, self.runtime_max_tokens_per_rank, DIM),
                                   self.runtime_max_tokens_per_rank, num_tokens)
        del self.runtime_max_tokens_per_rank
        return out


class MoEModel:
    def __init__(self, device, variant):
        gen = generator(29461)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.router = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.w_up = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.7)
        self.w_down = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.dispatcher = FlashinferDispatcher(EPGroup(device), device, variant)

    def experts(self, x, topk_ids, topk_weights):
        valid = topk_ids[:, 0] < NUM_EXPERTS
        e = topk_ids[:, 0].clamp(max=NUM_EXPERTS - 1)              # invalid (padding) slots weigh 0
        h = torch.relu(torch.bmm(x[:, None, :], self.w_up[e]))
        out = torch.bmm(h, self.w_down[e]).squeeze(1)
        return out * (topk_weights * valid[:, None])

    def forward(self, input_ids):
        x = self.embed[input_ids]
        topk_weights, topk_ids = torch.softmax(x @ self.router, -1).topk(1, dim=-1)
        x_recv, ids_recv, w_recv = self.dispatcher.dispatch(x, topk_ids, topk_weights)
        moe_out = self.dispatcher.combine(self.experts(x_recv, ids_recv, w_recv), x.shape[0])
        return (x + moe_out) @ self.lm_head


class CudaGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.input_ids = torch.zeros(BS, dtype=torch.long, device=device)
        with model_capture_mode():
            self.graph, self.output = capture(
                lambda: model.forward(self.input_ids), device=device, name=f"decode bs {BS}",
                owner="CudaGraphRunner", static={"input_ids": self.input_ids})

    def replay(self, input_ids):
        self.input_ids.copy_(input_ids)
        return replay(self.graph, self.output)


def run(variant: str, device: str = "cpu"):
    steps = [torch.tensor(ids).to(device) for ids in ([3, 6], [1, 4], [7, 2])]

    def eager():
        model = MoEModel(device, variant)
        return [model.forward(ids) for ids in steps]

    def served():
        model = MoEModel(device, variant)
        runner = CudaGraphRunner(model, device)
        return [runner.replay(ids).clone() for ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
