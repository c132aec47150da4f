"""The ROCm attention builder's capture path zeroes the runner's CPU query offsets; the next builder asserts.

Upstream: https://github.com/vllm-project/vllm/pull/51585 ("[ROCm] [Bugfix] Preserve CPU query offsets
during capture").
Symptom: on ROCm (4x MI325) with FULL CUDA graphs, the mixed-attention model MiniMax-M3 (attention layers
plus a sparse-attention indexer with its own metadata builder) fails at startup, in CUDA-graph profiling:
``models/minimax_m3/common/indexer.py ... assert decode_query_len > 0 / AssertionError / EngineCore
failed to start`` (vLLM main, August 2026).
Mechanism: for a FULL capture, ``GPUModelRunner._dummy_run`` builds the dummy batch's
``CommonAttentionMetadata`` (views of the runner's persistent ``query_start_loc`` on the device and
``query_start_loc_cpu`` on the host) and hands the same object to every KV-cache group's builder, in
order. ``RocmAttentionMetadataBuilder.build_for_cudagraph_capture`` builds its metadata, then zeroes
``common_attn_metadata.query_start_loc`` (to cover an invalid access of the prefix-prefill kernel during
capture, #25985) *and* ``query_start_loc_cpu``. The CPU offsets are the runner's, shared with the
builders that come next and unused by the prefix-prefill kernel: the MiniMax-M3 indexer builder reads
its uniform decode query length from them (``qsl_cpu[1:] - qsl_cpu[:-1]``) and gets 0. Without graphs
no capture path runs and every builder sees the step's real offsets.
Doctor: persistent-mutation, at ``build_for_cudagraph_capture`` (the ROCm builder's capture path writes
the runner-owned ``query_start_loc_cpu`` that later builders of the same batch read).
Fix (upstream): keep zeroing the device offsets, stop zeroing ``query_start_loc_cpu``.
Read: the PR description and ``vllm/v1/attention/backends/rocm_attn.py`` before the fix (both
``zero_()`` calls); the indexer builder's decode block from ``models/minimax_m3/common/indexer.py``.
The model's maths (a top-k index selection feeding paged attention) is a small stand-in.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/51585"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "build_for_cudagraph_capture"
SYMPTOM = "ROCm FULL-graph capture of MiniMax-M3 fails: indexer builder asserts decode_query_len > 0"

VOCAB, DIM, MAX_REQS, MAX_LEN, TOPK = 16, 4, 4, 8, 2
SIZE = 4                                       # the FULL decode graph: 4 one-token requests
PAD_SLOT_ID = -1
NUM_SLOTS = MAX_REQS * MAX_LEN


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


def split_decodes_and_prefills(m: CommonAttentionMetadata, decode_threshold: int = 1):
    """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens); decodes come first."""
    if m.max_query_len <= decode_threshold:
        return m.num_reqs, 0, m.num_actual_tokens, 0
    query_lens = m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]
    num_decodes = int((query_lens <= decode_threshold).sum())
    num_decode_tokens = int(m.query_start_loc_cpu[num_decodes])
    return num_decodes, m.num_reqs - num_decodes, num_decode_tokens, m.num_actual_tokens - num_decode_tokens


@dataclasses.dataclass
class RocmAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class RocmAttentionMetadataBuilder:
    def __init__(self, variant):
        self.variant = variant

    def build(self, common_prefix_len: int, m: CommonAttentionMetadata) -> RocmAttentionMetadata:
        return RocmAttentionMetadata(m.num_actual_tokens, m.max_query_len, m.query_start_loc, m.max_seq_len,
                                     m.seq_lens, m.block_table_tensor, m.slot_mapping)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        attn_metadata = self.build(0, common_attn_metadata)
        # When doing full graph capture, setting seq_lens to max_model_len will cause graph capture to
        # be extremely slow, so here we set it to 1.
        attn_metadata.seq_lens.fill_(1)
        # Here we set the query start locs to 0. This is to cover up an invalid memory access in the
        # prefix_prefill kernel that we run into during graph capture (#25985)
        common_attn_metadata.query_start_loc.zero_()
        if self.variant == "bug":
            common_attn_metadata.query_start_loc_cpu.zero_()
        return attn_metadata


@dataclasses.dataclass
class MiniMaxM3IndexerDecodeMetadata:
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    decode_query_len: int


@dataclasses.dataclass
class MiniMaxM3IndexerMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    decode: MiniMaxM3IndexerDecodeMetadata | None


class MiniMaxM3IndexerMetadataBuilder:
    def build(self, common_prefix_len: int, m: CommonAttentionMetadata) -> MiniMaxM3IndexerMetadata:
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(m)
        assert num_prefills == 0, "this program serves decode-only batches"
        decode_metadata = None
        if num_decodes > 0:
            qsl_cpu = m.query_start_loc_cpu
            query_lens_cpu = qsl_cpu[1:num_decodes + 1] - qsl_cpu[:num_decodes]
            decode_query_len = int(query_lens_cpu[0].item())
            assert decode_query_len > 0
            assert torch.all((query_lens_cpu == decode_query_len) | (query_lens_cpu == 0))
            assert num_decode_tokens == num_decodes * decode_query_len
            decode_metadata = MiniMaxM3IndexerDecodeMetadata(m.seq_lens[:num_decodes],
                                                            m.block_table_tensor[:num_decodes], decode_query_len)
        return MiniMaxM3IndexerMetadata(m.slot_mapping, num_decodes, num_decode_tokens, decode_metadata)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        return self.build(0, common_attn_metadata)


def write_to_paged_cache(x, cache, slot_mapping):
    """``reshape_and_cache``: one write per token; PAD_SLOT_ID entries are skipped (here: sent to the
    cache's spare last row, which no request reads)."""
    cache.index_copy_(0, torch.where(slot_mapping >= 0, slot_mapping, NUM_SLOTS), x)


class Model:
    def __init__(self, device):
        gen = generator(51585)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wq_idx, self.wk_idx = (randn(DIM, DIM, gen=gen, device=device, scale=0.7)
                                                               for _ in range(5))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.k_cache = torch.zeros(NUM_SLOTS + 1, DIM, device=device)
        self.v_cache = torch.zeros(NUM_SLOTS + 1, DIM, device=device)
        self.index_cache = torch.zeros(NUM_SLOTS + 1, DIM, device=device)
        self.pos = torch.arange(MAX_LEN, device=device)

    def indexer(self, h, md: MiniMaxM3IndexerMetadata):
        """Cache the index keys; each decode query keeps the TOPK best-scoring cached positions."""
        write_to_paged_cache(h @ self.wk_idx, self.index_cache, md.slot_mapping)
        d = md.decode
        q = (h[:md.num_decode_tokens] @ self.wq_idx).view(md.num_decodes, d.decode_query_len, DIM)
        keys = self.index_cache[d.block_table[:, None] * MAX_LEN + self.pos[None, :]]      # [reqs, LEN, DIM]
        in_seq = (self.pos[None, :] < d.seq_lens[:, None])[:, None, :]
        scores = (q @ keys.transpose(1, 2)).masked_fill(~in_seq, -1e9)
        chosen = torch.zeros_like(scores).scatter_(-1, scores.topk(TOPK, dim=-1).indices, 1.0) > 0
        return (chosen & in_seq).reshape(md.num_decode_tokens, MAX_LEN)

    def attention(self, h, visible, md: RocmAttentionMetadata):
        """Paged attention (``chunked_prefill_paged_decode``) over each token's request, restricted to
        the positions the indexer kept."""
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        write_to_paged_cache(k, self.k_cache, md.slot_mapping)
        write_to_paged_cache(v, self.v_cache, md.slot_mapping)
        t = torch.arange(h.shape[0], device=h.device)
        seq = (torch.searchsorted(md.query_start_loc, t, right=True) - 1).clamp(0, MAX_REQS - 1)
        slots = md.block_table[seq][:, None] * MAX_LEN + self.pos[None, :]
        scores = (self.k_cache[slots] @ q[:, :, None]).squeeze(-1) / math.sqrt(DIM)
        scores = scores.masked_fill(~visible, -1e9)
        return (torch.softmax(scores, -1)[:, :, None] * self.v_cache[slots]).sum(1)

    def forward(self, input_ids, positions, attn_metadata):
        h = self.embed_tokens[input_ids] + self.pos_embed[positions]
        visible = self.indexer(h, attn_metadata["indexer"])
        return (h + self.attention(h, visible, attn_metadata["attn"])) @ self.lm_head


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.positions = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((SIZE,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_REQS + 1, dtype=torch.long, device=device)
        self.query_start_loc_cpu = host(torch.zeros(MAX_REQS + 1, dtype=torch.long), device)
        self.seq_lens = torch.zeros(MAX_REQS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_REQS, dtype=torch.long, device=device)   # request row -> block
        # one builder per KV-cache group, in group order: attention layers, then the indexer
        self.builders = {"attn": RocmAttentionMetadataBuilder(variant), "indexer": MiniMaxM3IndexerMetadataBuilder()}
        self.static = {"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                       "query_start_loc": self.query_start_loc, "query_start_loc_cpu": self.query_start_loc_cpu,
                       "seq_lens": self.seq_lens, "block_table": self.block_table}
        self.state = {"k_cache": model.k_cache, "v_cache": model.v_cache, "index_cache": model.index_cache}
        if graphed:
            events.static_buffers("GPUModelRunner (FULL decode graph)", self.static)
            events.persistent_state("GPUModelRunner (FULL decode graph)", self.state)

    def _build_attention_metadata(self, num_reqs, num_tokens, max_seq_len, for_cudagraph_capture=False):
        common = CommonAttentionMetadata(
            self.query_start_loc[:num_reqs + 1], self.query_start_loc_cpu[:num_reqs + 1],
            self.seq_lens[:num_reqs], num_reqs, num_tokens, 1, max_seq_len,
            self.block_table[:num_reqs], self.slot_mapping[:num_tokens])
        metadata = {}
        for name, builder in self.builders.items():
            if for_cudagraph_capture:
                metadata[name] = builder.build_for_cudagraph_capture(common)
            else:
                metadata[name] = builder.build(0, common)
        return metadata

    def _prepare_inputs(self, reqs):
        """``reqs``: (request row, token id, position), one token each (uniform decode)."""
        n = len(reqs)
        t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        self.input_ids[:n].copy_(t([tok for _, tok, _ in reqs]).to(self.device))
        self.positions[:n].copy_(t([pos for _, _, pos in reqs]).to(self.device))
        self.slot_mapping[:n].copy_(t([row * MAX_LEN + pos for row, _, pos in reqs]).to(self.device))
        self.slot_mapping[n:].fill_(PAD_SLOT_ID)
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.query_start_loc_cpu.copy_(t([min(i, n) for i in range(MAX_REQS + 1)]))
        self.query_start_loc.copy_(self.query_start_loc_cpu)
        self.seq_lens.copy_(t([pos + 1 for _, _, pos in reqs] + [0] * (MAX_REQS - n)).to(self.device))
        self.block_table.copy_(t([row for row, _, _ in reqs] + [0] * (MAX_REQS - n)).to(self.device))
        return n

    def _dummy_run_metadata(self, num_tokens):
        """The capture's dummy batch: ``num_tokens`` one-token requests, nothing cached."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.query_start_loc_cpu.copy_(torch.arange(MAX_REQS + 1).clamp(max=num_tokens))
        self.query_start_loc.copy_(self.query_start_loc_cpu)
        self.seq_lens.fill_(1)
        self.block_table.zero_()
        return self._build_attention_metadata(num_tokens, num_tokens, MAX_LEN, for_cudagraph_capture=True)

    def capture_model(self):
        metadata = self._dummy_run_metadata(SIZE)
        self.graph, self.out = capture(
            lambda: self.model.forward(self.input_ids, self.positions, metadata), device=self.device,
            name=f"FULL decode {SIZE}", static=self.static, state=self.state,
            owner="GPUModelRunner (FULL decode graph)")

    def execute_model(self, reqs):
        n = self._prepare_inputs(reqs)
        if not self.graphed:
            metadata = self._build_attention_metadata(n, n, MAX_LEN)
            return self.model.forward(self.input_ids[:n], self.positions[:n], metadata).clone()
        self._build_attention_metadata(SIZE, SIZE, MAX_LEN)      # padded batch, as for a FULL replay
        return replay(self.graph, self.out, real=n, size=SIZE)[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        model.k_cache.zero_()
        model.v_cache.zero_()
        model.index_cache.zero_()
        runner = GPUModelRunner(model, device, variant, graphed)
        if graphed:
            runner.capture_model()
        outs = []
        for reqs in ([(0, 3, 0), (1, 5, 0), (2, 7, 0)],
                     [(0, 4, 1), (1, 9, 1), (2, 2, 1)],
                     [(0, 6, 2), (1, 8, 2), (2, 1, 2), (3, 11, 0)],
                     [(0, 12, 3), (1, 10, 3), (2, 13, 3), (3, 14, 1)],
                     [(0, 15, 4), (2, 0, 4)]):
            outs.append(runner.execute_model(reqs))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
