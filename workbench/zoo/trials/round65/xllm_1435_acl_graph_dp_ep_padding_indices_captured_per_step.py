"""The ACL decode graph keeps the capture step's DP/EP padding index tensors, released after that step.

Upstream: https://github.com/xLLM-AI/xllm/pull/1435 ("bugfix: stabilize ACL graph dp/cp ep padding addresses and
sync fallback.", commit c19fa28ab), follow-up https://github.com/xLLM-AI/xllm/pull/1449 (commit 0e9970d78).
Symptom: DeepSeek-style MoE models served with data parallel attention + expert parallel under ACL-graph decode
give wrong or garbled outputs (and hangs); eager decode is right.
Mechanism: under DP/EP, ``WorkerImpl`` builds ``DpEpPadding(token_size_per_dp_group = dp_global_token_nums,
...).build()`` on the host every step; ``assemble_result`` moves ``attn_padding_idx``, ``attn_unpadding_idx``,
``ffn_padding_idx``, ``ffn_unpadding_idx``, ``lm_head_skip_padding_token_indices``, ... to the device as fresh
tensors (``safe_to``) in ``params.dp_ep_padding_data``. The decoder layer gathers the local tokens into the
padded per-DP layout (``attn_padding_idx``), all-gathers across DP ranks, compacts the real tokens of all ranks
for the MoE (``attn_unpadding_idx``) and scatters the MoE output back to the padded layout before the
reduce-scatter (``ffn_padding_idx``). ``GraphPersistentParam::update(..., return_capture_params=true)`` copied
tokens, positions and attention metadata into persistent buffers but returned ``params_for_capture`` with
``dp_ep_padding_data`` as it came: the graph captured by ``AclGraph::capture`` gathers with the capture step's
index tensors, which are released when that step's params die, and ``update`` never writes them at replay.
Every replay uses the capture step's token layout (or whatever was allocated there since): once the DP ranks'
token counts differ from the capture step's, this rank's real tokens get the MoE output of padding rows, i.e.
of another rank's token.
Doctor: dangling-reference, at ``update`` (the capture params it returns keep the step's own
``dp_ep_padding_data`` tensors, which nothing keeps alive after the capture step).
Fix (upstream): the ``GraphPersistentParam`` constructor pre-allocates ``persistent_dp_ep_padding_`` (and
``persistent_cp_ep_padding_``), every field ``torch::zeros({decode_capacity * dp_size}, int32)``; ``update``
calls ``update_persistent_dp_ep_padding`` (``copy_into_persistent``: ``persistent.slice(0, 0,
src.size(0)).copy_(src)``) at capture and at every replay, and the capture params get ``slice_like(persistent,
src)``. #1449 makes ``slice_like`` return the whole persistent buffer for an empty ``src`` (not modelled).
Not modelled either: #1435's eager-fallback threshold on the global instead of the local batch size (a DP
collective desync needs several ranks). Toy: this process is DP rank 1 of 2 (attn TP 1); rank 0's padded
hidden states arrive in the all-gather's receive buffer; the experts run whole on this rank; every step has
6 tokens over the DP group, at most 4 per rank (bucket 4), so every index tensor keeps its captured length.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events, graph, host, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1435"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "update"
SYMPTOM = "DP+EP ACL-graph decode gathers/scatters MoE tokens with the capture step's freed padding indices"

VOCAB, DIM, NUM_EXPERTS, MAX_LEN = 16, 4, 3, 12
DP_SIZE, ATTN_DP_RANK = 2, 1
DECODE_CAPACITY = 4                       # get_decode_graph_capacity: max decode tokens per rank
BUCKETS = (1, 2, 4)
FIELDS = ("attn_padding_idx", "attn_unpadding_idx", "ffn_padding_idx", "ffn_unpadding_idx",
          "lm_head_skip_padding_token_indices")


@dataclasses.dataclass
class DpEpPaddingData:
    attn_padding_idx: torch.Tensor | None = None
    attn_unpadding_idx: torch.Tensor | None = None
    ffn_padding_idx: torch.Tensor | None = None
    ffn_unpadding_idx: torch.Tensor | None = None
    lm_head_skip_padding_token_indices: torch.Tensor | None = None


@dataclasses.dataclass
class ModelInputParams:
    dp_global_token_nums: list
    dp_ep_padding_data: DpEpPaddingData


class DpEpPadding:
    """Host-side index builder (``npu_dp_ep_padding.cpp``, attn TP size 1)."""

    def __init__(self, token_size_per_dp_group, attn_dp_rank, device):
        self.sizes, self.rank, self.device = list(token_size_per_dp_group), attn_dp_rank, device

    def build(self) -> DpEpPaddingData:
        m = max(self.sizes)                                       # max_token_size_per_dp_group_

        def ar(n, offset=0):
            return torch.arange(n, dtype=torch.int32) + offset

        dp_padding_idx = [torch.cat([ar(n), torch.zeros(m - n, dtype=torch.int32)]) for n in self.sizes]
        all_gather_unpadding = torch.cat([ar(m, i * m) for i in range(len(self.sizes))])
        reduce_scatter_unpadding = torch.cat([ar(n, i * m) for i, n in enumerate(self.sizes)])
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        idx = {"attn_padding_idx": dp_padding_idx[self.rank],
               "attn_unpadding_idx": all_gather_unpadding[reduce_scatter_unpadding.long()],
               "ffn_padding_idx": torch.cat([torch.cat([ar(n, s), torch.zeros(m - n, dtype=torch.int32)])
                                             for n, s in zip(self.sizes, starts)]),
               "ffn_unpadding_idx": ar(self.sizes[self.rank]),
               "lm_head_skip_padding_token_indices": torch.cat([ar(n, i * m) for i, n in enumerate(self.sizes)])}
        # assemble_result: safe_to(device, non_blocking) of every field, fresh device tensors per step
        return DpEpPaddingData(**{k: host(v, self.device).to(self.device, non_blocking=True) for k, v in idx.items()})


class ProcessGroupHCCL:
    """DP all-gather / reduce-scatter of this rank; rank 0's contribution lands in ``recv_``."""

    def __init__(self, device):
        self.recv_ = torch.zeros(DECODE_CAPACITY, DIM, device=device)

    def all_gather(self, local):
        return torch.cat([self.recv_[:local.shape[0]], local])           # rank order: 0, 1

    def reduce_scatter(self, padded):
        return padded.view(DP_SIZE, -1, DIM)[ATTN_DP_RANK]


class DeepseekV2DecoderLayer:
    def __init__(self, device):
        gen = generator(1435)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.w_attn = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.w_gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.experts = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.8)

    def forward(self, tokens, positions, params: ModelInputParams, dp_group: ProcessGroupHCCL):
        dp = params.dp_ep_padding_data
        h = self.embed_tokens[tokens] + self.pos_embed[positions]
        h = h + torch.tanh(h @ self.w_attn)                                  # attention (per token here)
        gathered = dp_group.all_gather(h.index_select(0, dp.attn_padding_idx))   # [dp * max, D]
        x = gathered.index_select(0, dp.attn_unpadding_idx)                  # the real tokens of all ranks
        gate = torch.softmax(x @ self.w_gate, -1)
        weight, top = gate.max(-1)
        moe = torch.tanh((x[:, None, :] @ self.experts[top]).squeeze(1)) * weight[:, None]
        mine = dp_group.reduce_scatter(moe.index_select(0, dp.ffn_padding_idx))  # back to padded, own slice
        return h + mine[:h.shape[0]]


class GraphPersistentParam:
    def __init__(self, device, variant):
        self.variant = variant
        self.persistent_tokens_ = torch.zeros(DECODE_CAPACITY, dtype=torch.long, device=device)
        self.persistent_positions_ = torch.zeros(DECODE_CAPACITY, dtype=torch.long, device=device)
        self.persistent_dp_ep_padding_ = None
        if variant == "fix":      # pre-allocate persistent dp ep padding buffers with maximum capacity
            cap = DECODE_CAPACITY * DP_SIZE
            self.persistent_dp_ep_padding_ = DpEpPaddingData(
                **{f: torch.zeros(cap, dtype=torch.int32, device=device) for f in FIELDS})

    def buffers(self):
        out = {"persistent_tokens_": self.persistent_tokens_, "persistent_positions_": self.persistent_positions_}
        if self.persistent_dp_ep_padding_ is not None:
            out.update({f"persistent_dp_ep_padding_.{f}": getattr(self.persistent_dp_ep_padding_, f) for f in FIELDS})
        return out

    def update_persistent_dp_ep_padding(self, src: DpEpPaddingData):
        for f in FIELDS:                                                      # copy_into_persistent
            persistent, s = getattr(self.persistent_dp_ep_padding_, f), getattr(src, f)
            assert s.shape[0] <= persistent.shape[0], "dp_ep_padding persistent buffer overflow"
            persistent[:s.shape[0]].copy_(s, non_blocking=True)

    def update(self, tokens, positions, params: ModelInputParams, padded_num_tokens, return_capture_params=False):
        n = tokens.shape[0]
        self.persistent_tokens_[:n].copy_(tokens)
        self.persistent_tokens_[n:padded_num_tokens].zero_()
        self.persistent_positions_[:n].copy_(positions)
        self.persistent_positions_[n:padded_num_tokens].zero_()
        if self.variant == "fix":
            self.update_persistent_dp_ep_padding(params.dp_ep_padding_data)
        if not return_capture_params:
            return None
        params_for_capture = dataclasses.replace(params)     # dp_ep_padding_data: the step's own tensors
        if self.variant == "fix":
            src = params.dp_ep_padding_data
            params_for_capture.dp_ep_padding_data = DpEpPaddingData(**{     # slice_like(persistent, src)
                f: getattr(self.persistent_dp_ep_padding_, f)[:getattr(src, f).shape[0]] for f in FIELDS})
        return params_for_capture


class AclGraph:
    def __init__(self, persistent_param, device):
        self.persistent_param_, self.graph_ = persistent_param, new_graph(device, on_freed="reuse")
        self.num_tokens_, self.hidden_states_ = 0, None

    def capture(self, model, tokens, positions, params, dp_group, bucket_num_tokens):
        self.num_tokens_ = b = bucket_num_tokens
        p = self.persistent_param_
        graph_params = p.update(tokens, positions, params, b, return_capture_params=True)
        events.static_buffers("GraphPersistentParam", p.buffers())
        events.static_buffers("ProcessGroupHCCL (all-gather receive)", {"recv_": dp_group.recv_})
        with graph(self.graph_, name=f"decode bucket {b}"):
            self.hidden_states_ = model.forward(p.persistent_tokens_[:b], p.persistent_positions_[:b],
                                                graph_params, dp_group)
        return replay(self.graph_, self.hidden_states_, real=tokens.shape[0])[:tokens.shape[0]]

    def replay(self, tokens, positions, params):
        self.persistent_param_.update(tokens, positions, params, self.num_tokens_)
        return replay(self.graph_, self.hidden_states_, real=tokens.shape[0])[:tokens.shape[0]]


class AclGraphExecutorImpl:
    def __init__(self, model, dp_group, device, variant, enable_graph):
        self.model_, self.dp_group, self.device, self.enable_graph = model, dp_group, device, enable_graph
        self.persistent_param_ = GraphPersistentParam(device, variant)
        self.graphs_ = {}

    def run(self, tokens, positions, params: ModelInputParams):
        if not self.enable_graph:
            return self.model_.forward(tokens, positions, params, self.dp_group)
        graph_num_tokens = max(params.dp_global_token_nums)     # DP: bucket on the global max tokens
        bucket = next(b for b in BUCKETS if b >= graph_num_tokens)
        if bucket in self.graphs_:
            return self.graphs_[bucket].replay(tokens, positions, params)
        g = self.graphs_[bucket] = AclGraph(self.persistent_param_, self.device)        # lazy capture
        return g.capture(self.model_, tokens, positions, params, self.dp_group, bucket)


def run(variant: str, device: str = "cpu"):
    model = DeepseekV2DecoderLayer(device)
    gen = generator(7)
    # dp_global_token_nums per decode step and this rank's tokens; rank 0's hidden states for the all-gather
    steps = [((4, 2), [3, 9]), ((2, 4), [5, 1, 12, 7]), ((2, 4), [2, 8, 4, 11]), ((4, 2), [6, 0]),
             ((2, 4), [13, 10, 3, 14])]
    peers = [torch.randn(n0, DIM, generator=gen) for (n0, _), _ in steps]

    def serve(graphed: bool):
        dp_group = ProcessGroupHCCL(device)
        executor = AclGraphExecutorImpl(model, dp_group, device, variant, graphed)
        outs = []
        for step, ((n0, n1), ids) in enumerate(steps):
            # the worker: params for this step (DpEpPadding built and moved per step); they die with the step
            params = ModelInputParams([n0, n1], DpEpPadding([n0, n1], ATTN_DP_RANK, device).build())
            tokens = host(torch.tensor(ids), device).to(device, non_blocking=True)
            positions = host(torch.tensor([4 + step + j for j in range(n1)]), device).to(device, non_blocking=True)
            peer = peers[step][torch.cat([torch.arange(n0), torch.zeros(max(n0, n1) - n0, dtype=torch.long)])]
            dp_group.recv_[:peer.shape[0]].copy_(peer.to(device))             # rank 0's padded contribution
            outs.append(executor.run(tokens, positions, params).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
