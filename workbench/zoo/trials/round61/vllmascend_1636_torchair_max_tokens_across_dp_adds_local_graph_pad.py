"""Torchair decode under DP: ``max_num_tokens_across_dp`` adds this rank's own ``graph_pad_size``: ranks disagree.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/1636 ("[BugFix] Fix max_num_tokens_across_dp calculation
bugs in attention_v1_torchair", commit b6151e1123, July 2025).
Symptom: PR text: "we compute this by graph_pad_size plus max_num_tokens(actual). This will result in different
max_num_tokens_across_dp across dp ranks. If padding related is required, this might cause a wrong padding."
(DP > 1 with torchair graph decode; here: wrong MoE rows on the less loaded rank.)
Mechanism: ``NPUModelRunner._process_reqs`` all-reduces (MAX) the real token counts over the DP group
(``_get_forward_metadata_across_dp``) and passes ``max_num_tokens_across_dp`` = the max real count to the
builder; for torchair decode it also passes ``graph_pad_size = padded_batch_size - total_num_scheduled_tokens``,
where ``padded_batch_size = select_torchair_padded_batch_size(max_num_tokens)`` is the same on every rank but
``graph_pad_size`` is *local*. ``AscendAttentionTorchairMetadataBuilder.build`` (DecodeOnly + torchair) did
``max_num_tokens_across_dp += graph_pad_size``: that equals the padded batch only on the most loaded rank; a rank
with fewer real tokens gets ``padded + (max_real - local_real)``. The compiled model (``PanguProMoEModel.forward``,
h2p path) reads that int to pad its hidden states (``h2p_pad_idx``) before the all-rank
``all_gather_into_tensor`` / MoE / ``reduce_scatter``, whose per-rank segment length must agree on all ranks.
Torchair compiles one graph per padded batch size, and dynamo specialises the int in ``attn_metadata`` (a new
value recompiles; inferred from torch.compile's guards, not stated in the PR), so the graph this rank
replays lays its segment out ``max_real - local_real`` rows further than its peer does, and its
reduce-scatter reads the peer's expert outputs of other rows. Warmup (``build_dummy``:
``max_num_tokens_across_dp = num_reqs``) and eager mode (``graph_pad_size = -1``) are right.
The peer DP rank (the most loaded one) is simulated on the host: before each step it writes its tokens and its
expert's partial output for every gathered row into the communication buffers, in its own (correct) layout.
Doctor: padded-shape-mismatch, at ``build`` (the graph's padded batch is combined with a length made of the
real cross-DP max plus a local pad, so the padded hidden states no longer match the agreed segment).
Fix (upstream): drop ``max_num_tokens_across_dp += graph_pad_size`` and set
``max_num_tokens_across_dp = len(padded_seq_lens)``, the padded (captured) batch size, identical on all ranks.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/1636"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "build"
SYMPTOM = "DP torchair decode: the lighter rank pads to a longer MoE segment than its peer and gets wrong rows"

DP_SIZE, DP_RANK, PEER = 2, 1, 0          # this process is DP rank 1; rank 0 (more requests) is simulated
VOCAB, DIM, MAX_POS = 16, 4, 32
TORCHAIR_GRAPH_BATCH_SIZES = [4, 8]
MAX_NUM_TOKENS = 8
COMM_ROWS = DP_SIZE * 2 * MAX_NUM_TOKENS  # room for any (even a wrong) segment length


@dataclasses.dataclass
class AscendTorchairMetadata:
    num_actual_tokens: int
    seq_lens: list
    max_num_tokens_across_dp: int = 0


class CommBuffers:
    """What the all-rank all_gather / reduce_scatter exchange: every rank's tokens and its expert's partial
    output for all gathered rows, each at the row offsets of the writer's segment length."""

    def __init__(self, device):
        self.tokens = torch.zeros(COMM_ROWS, DIM, device=device)
        self.partials = torch.zeros(DP_SIZE, COMM_ROWS, DIM, device=device)


class PanguProMoEModel:
    """One decoder layer in miniature: embedding + position, then the h2p MoE (expert ``r`` lives on rank ``r``)."""

    def __init__(self, device, comm):
        gen = generator(1636)
        self.comm = comm
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.router = randn(DIM, DP_SIZE, gen=gen, device=device)
        self.experts = randn(DP_SIZE, DIM, DIM, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def attn(self, input_ids, positions):
        return torch.tanh(self.embed[input_ids] + self.pos[positions])

    def expert_partial(self, x, rank):
        gate = torch.softmax(x @ self.router, dim=-1)[:, rank:rank + 1]
        return gate * (x @ self.experts[rank])

    def forward(self, input_ids, positions, attn_metadata):
        hidden_states = self.attn(input_ids, positions)
        max_tokens_across_dp = attn_metadata.max_num_tokens_across_dp
        tp_size = 1
        h2p_padded_len = ((tp_size - (max_tokens_across_dp % tp_size)) % tp_size + max_tokens_across_dp
                          - hidden_states.shape[0])
        h2p_unpad_idx = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        h2p_pad_idx = torch.cat([h2p_unpad_idx, torch.zeros(h2p_padded_len, dtype=torch.long,
                                                            device=hidden_states.device)])
        if h2p_unpad_idx.shape[0] < h2p_pad_idx.shape[0]:
            hidden_states = hidden_states.index_select(0, h2p_pad_idx)
        n = hidden_states.shape[0]           # all_gather_into_tensor: every rank is assumed to send n rows
        segments = [hidden_states if r == DP_RANK else self.comm.tokens[r * n:(r + 1) * n] for r in range(DP_SIZE)]
        partial = self.expert_partial(torch.cat(segments), DP_RANK)
        # reduce_scatter (sum): this rank's n rows of every rank's partial output
        out = partial[DP_RANK * n:(DP_RANK + 1) * n] + self.comm.partials[PEER, DP_RANK * n:(DP_RANK + 1) * n]
        out = out.index_select(0, h2p_unpad_idx)
        return out @ self.lm_head


class AscendAttentionTorchairMetadataBuilder:
    def __init__(self, variant):
        self.variant = variant

    def build(self, num_reqs, num_actual_tokens, seq_lens, graph_pad_size=-1, max_num_tokens_across_dp=0):
        use_torchair_graph = graph_pad_size > -1
        if use_torchair_graph:                                   # DecodeOnly
            if self.variant == "bug":
                max_num_tokens_across_dp += graph_pad_size
            pad_value = 1
            padded_seq_lens = list(seq_lens) + [pad_value] * graph_pad_size
            if self.variant == "fix":
                max_num_tokens_across_dp = len(padded_seq_lens)
            seq_lens = padded_seq_lens
        return AscendTorchairMetadata(num_actual_tokens, list(seq_lens), max_num_tokens_across_dp)

    def build_dummy(self, num_reqs):
        return AscendTorchairMetadata(num_reqs, [1] * num_reqs, max_num_tokens_across_dp=num_reqs)


class NPUModelRunner:
    def __init__(self, model, device, variant, torchair_graph_enabled):
        self.model, self.device = model, device
        self.torchair_graph_enabled = torchair_graph_enabled
        self.torchair_graph_batch_sizes = TORCHAIR_GRAPH_BATCH_SIZES
        self.attn_metadata_builder = AscendAttentionTorchairMetadataBuilder(variant)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.graphs = {}     # torchair: one compiled model per batch size, guarded on the ints of attn_metadata

    def select_torchair_padded_batch_size(self, batch_size):
        return min(s for s in self.torchair_graph_batch_sizes if batch_size <= s)

    def _get_forward_metadata_across_dp(self, total_num_scheduled_tokens, num_tokens_by_rank):
        # dist.all_reduce(MAX) over the DP cpu group
        return max(num_tokens_by_rank)

    def _compiled_forward(self, batch_size, attn_metadata):
        key = (batch_size, attn_metadata.max_num_tokens_across_dp)
        if key not in self.graphs:
            fn = lambda: self.model.forward(self.input_ids[:batch_size], self.positions[:batch_size],  # noqa: E731
                                            attn_metadata)
            comm = self.model.comm
            self.graphs[key] = capture(fn, device=self.device, owner="NPUModelRunner (torchair graph)",
                                       name=f"torchair decode {key}",
                                       static={"input_ids": self.input_ids, "positions": self.positions,
                                               "comm.tokens": comm.tokens, "comm.partials": comm.partials})
        return self.graphs[key]

    def capture_model(self):
        for num_tokens in reversed(self.torchair_graph_batch_sizes):   # _dummy_run(is_compile=True)
            self.input_ids.zero_()
            self.positions.zero_()
            self._compiled_forward(num_tokens, self.attn_metadata_builder.build_dummy(num_tokens))

    def _process_reqs(self, input_ids, positions, seq_lens, num_tokens_by_rank):
        total_num_scheduled_tokens = input_ids.shape[0]
        max_num_tokens = self._get_forward_metadata_across_dp(total_num_scheduled_tokens, num_tokens_by_rank)
        graph_pad_size = -1
        padded_batch_size = total_num_scheduled_tokens
        if self.torchair_graph_enabled:                  # and not with_prefill
            padded_batch_size = self.select_torchair_padded_batch_size(max_num_tokens)
            graph_pad_size = padded_batch_size - total_num_scheduled_tokens
        attn_metadata = self.attn_metadata_builder.build(
            num_reqs=total_num_scheduled_tokens, num_actual_tokens=total_num_scheduled_tokens, seq_lens=seq_lens,
            graph_pad_size=graph_pad_size, max_num_tokens_across_dp=max_num_tokens)
        self.input_ids.zero_()
        self.positions.zero_()                           # padded input_positions are zeros
        self.input_ids[:total_num_scheduled_tokens].copy_(input_ids)
        self.positions[:total_num_scheduled_tokens].copy_(positions)
        if not self.torchair_graph_enabled:
            out = self.model.forward(self.input_ids[:padded_batch_size], self.positions[:padded_batch_size],
                                     attn_metadata)
        else:
            g, logits = self._compiled_forward(padded_batch_size, attn_metadata)
            out = replay(g, logits, real=total_num_scheduled_tokens, size=padded_batch_size)
        return out[:total_num_scheduled_tokens].clone(), attn_metadata


def peer_publishes(model, comm, peer, local, seg):
    """DP rank 0 (the most loaded rank, whose ``max_num_tokens_across_dp`` is right in both variants) writes its
    tokens and its expert's partial output for all gathered rows, with segments of ``seg`` rows each."""
    def padded_h(ids, pos):
        h = model.attn(ids, pos)
        idx = torch.cat([torch.arange(h.shape[0]), torch.zeros(seg - h.shape[0], dtype=torch.long)])
        return h.index_select(0, idx.to(h.device))
    gathered = torch.cat([padded_h(*peer), padded_h(*local)])      # rank 0's segment, then rank 1's
    comm.tokens.zero_()
    comm.partials.zero_()
    comm.tokens[:seg].copy_(gathered[:seg])
    comm.partials[PEER, :DP_SIZE * seg].copy_(model.expert_partial(gathered, PEER))


def run(variant: str, device: str = "cpu"):
    gen = generator(16360)
    steps = []                                           # (rank 0 tokens, rank 1 tokens): decode, 1 token/req
    for n_peer, n_local in [(6, 3), (3, 2), (5, 5), (7, 2)]:
        ranks = []
        for n in (n_peer, n_local):
            ids = torch.randint(0, VOCAB, (n,), generator=gen)
            pos = torch.randint(1, MAX_POS, (n,), generator=gen)
            ranks.append((ids.to(device), pos.to(device)))
        steps.append(ranks)

    def serve(graphed: bool):
        comm = CommBuffers(device)
        model = PanguProMoEModel(device, comm)
        runner = NPUModelRunner(model, device, variant, torchair_graph_enabled=graphed)
        if graphed:
            runner.capture_model()
        outs = []
        for peer, local in steps:
            counts = [peer[0].shape[0], local[0].shape[0]]
            # the peer's own max_num_tokens_across_dp: the padded batch in graph mode, the max real count in eager
            seg = runner.select_torchair_padded_batch_size(max(counts)) if graphed else max(counts)
            peer_publishes(model, comm, peer, local, seg)
            out, _ = runner._process_reqs(local[0], local[1], (local[1] + 1).tolist(), counts)
            outs.append(out)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
