"""The MTP draft decode builds its attention metadata with the padded token count of its piecewise graph.

Upstream: https://github.com/vllm-project/vllm/pull/55458 ("[Bugfix] Exclude DP token padding from draft
attention metadata"); the same fix for DFlash drafters followed in https://github.com/vllm-project/vllm/pull/56181.
Symptom: DeepSeek-V3.2 with DP8 + EP + MTP crashed whenever DP ranks had unequal request counts: "A rank with
12 requests receives model inputs padded to 13 tokens; the sparse indexer then fails with ``shape
'[12, -1, 64, 128]' is invalid for input of size 106496``" (Model Runner V2, CI build 87584, September 2026).
Mechanism: the autoregressive speculator runs each draft decode step through the cudagraph dispatcher, which
pads the step to the DP-synchronised capture size (13) and, for a PIECEWISE descriptor, leaves
``num_reqs=None``; the graph pieces run at the padded size while attention, a splitting op, runs eagerly
from the step's attention metadata. The speculator built that metadata with ``num_tokens`` = the
descriptor's padded token count, so ``CommonAttentionMetadata.num_actual_tokens`` = 13 for 12 one-token
requests. ``split_decodes_and_prefills`` (all decodes) then returns ``num_decode_tokens = num_actual_tokens``
= 13 next to ``num_decodes`` = 12, and ``sparse_attn_indexer`` reshapes the 13 padded query rows of the
graph piece into ``(decode_lens.shape[0]=12, -1, heads, dim)``: a padded-size tensor combined with a
real-size one. An eager draft step is not padded, so it never sees the mismatch.
Doctor: padded-shape-mismatch, at ``sparse_attn_indexer`` (13 graph-padded query rows reshaped by the 12 real
requests).
Fix (upstream): "Autoregressive draft decode produces one query per request. Use the descriptor's request
count, falling back to the actual local request count, for the attention token count"; padded model
inputs, collective sizes and FULL-graph request padding are kept.
I read the PR description (error, cause and fix as quoted) and the resulting rule as quoted downstream
(``num_tokens = batch_desc.num_tokens if cg_mode == FULL else query_start_loc[-1]``); the diff itself was
not available to me. The DP pair is reduced to one rank told the other rank's token count.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/55458"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "sparse_attn_indexer"
SYMPTOM = "MTP draft decode under DP padding: sparse indexer reshape fails (shape '[3, -1, 2, 4]' invalid)"

VOCAB, DIM, HEADS, HEAD_DIM = 16, 4, 2, 4
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, TOPK = 2, 12, 4, 2
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS
CUDAGRAPH_CAPTURE_SIZES = [4]                  # the drafter's PIECEWISE graphs
MAX_NUM_TOKENS = 4
INDEXER = "model.mtp.0.self_attn.indexer"

_forward_context = SimpleNamespace(attn_metadata=None)


@dataclasses.dataclass
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None                # None for PIECEWISE descriptors


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table_tensor: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int


@dataclasses.dataclass
class DeepSeekV32IndexerDecodeMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    decode_lens: torch.Tensor


@dataclasses.dataclass
class DeepseekV32IndexerMetadata:
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    decode: DeepSeekV32IndexerDecodeMetadata


def split_decodes_and_prefills(m, decode_threshold=1):
    if m.max_query_len <= decode_threshold:            # all decodes
        return m.num_reqs, 0, m.num_actual_tokens, 0
    raise NotImplementedError("only draft decode steps are modelled")


class DeepseekV32IndexerMetadataBuilder:
    def build(self, common_prefix_len, m):
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(m)
        decode_lens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1])[:num_decodes]
        return DeepseekV32IndexerMetadata(
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, num_actual_tokens=m.num_actual_tokens,
            decode=DeepSeekV32IndexerDecodeMetadata(block_table=m.block_table_tensor[:num_decodes],
                                                    seq_lens=m.seq_lens[:num_decodes],
                                                    decode_lens=decode_lens))


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_model_len):
    """Per query row: relu(q . k) weighted per head and summed, over the request's cached keys."""
    pos = torch.arange(max_model_len, device=q.device)
    slots = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    keys = kv_cache[slots]                                          # [batch, len, dim]
    scores = torch.relu(torch.einsum("bnhd,bld->bnhl", q, keys)) * weights[:, :, :, None]
    logits = scores.sum(2)                                          # [batch, next_n, len]
    return logits.masked_fill(pos[None, None, :] >= context_lens[:, None, None], float("-inf"))


def sparse_attn_indexer(q_fp8, weights, k_cache, topk_indices_buffer):
    attn_metadata = _forward_context.attn_metadata[INDEXER]
    decode_metadata = attn_metadata.decode
    num_decode_tokens = attn_metadata.num_decode_tokens
    decode_lens = decode_metadata.decode_lens
    padded_q_fp8_decode_tokens = q_fp8[:num_decode_tokens].reshape(decode_lens.shape[0], -1, *q_fp8.shape[1:])
    next_n = padded_q_fp8_decode_tokens.shape[1]
    logits = fp8_paged_mqa_logits(padded_q_fp8_decode_tokens,
                                  k_cache, weights[:num_decode_tokens].reshape(-1, next_n, HEADS),
                                  decode_metadata.seq_lens, decode_metadata.block_table, MAX_MODEL_LEN)
    topk_indices = logits.reshape(num_decode_tokens, MAX_MODEL_LEN).topk(TOPK, dim=-1).indices
    topk_indices_buffer[:num_decode_tokens, :TOPK] = topk_indices
    return topk_indices_buffer


class DeepSeekMTP:
    """The draft layer: a projection piece, the sparse MLA attention (a splitting op), an output piece."""

    def __init__(self, device):
        gen = generator(55458)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.eh_proj = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wq_idx = randn(DIM, HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.w_weights = randn(DIM, HEADS, gen=gen, device=device, scale=0.5)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def piece0(self, input_ids, hidden_states):
        h = self.emb[input_ids] + hidden_states @ self.eh_proj
        return h, (h @ self.wq_idx).view(-1, HEADS, HEAD_DIM), h @ self.w_weights, h @ self.wq

    def attention(self, q_fp8, weights, q, k_cache, kv_cache, topk_indices_buffer, output):
        """unified sparse MLA attention: the indexer picks TOPK cached tokens, attention reads those."""
        topk = sparse_attn_indexer(q_fp8, weights, k_cache, topk_indices_buffer)
        md = _forward_context.attn_metadata[INDEXER]
        n = md.num_actual_tokens
        block_table = md.decode.block_table
        sel = topk[:n, :TOPK]
        slots = block_table.gather(1, sel // BLOCK_SIZE) * BLOCK_SIZE + sel % BLOCK_SIZE
        kv = kv_cache[slots]                                            # [n, TOPK, dim]
        p = torch.softmax((kv @ q[:n, :, None]).squeeze(-1), -1)
        output[:n] = (p[:, :, None] * kv).sum(1)

    def piece1(self, h, attn_output):
        return (h + attn_output) @ self.head


class AutoregressiveSpeculator:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        gen = generator(58)
        self.k_cache = randn(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, gen=gen, device=device)   # indexer K cache
        self.kv_cache = randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device)       # MLA latent cache
        self.builder = DeepseekV32IndexerMetadataBuilder()
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, DIM, device=device)
        self.attn_output = torch.zeros(MAX_NUM_TOKENS, DIM, device=device)
        self.topk_indices_buffer = torch.zeros(MAX_NUM_TOKENS, TOPK, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_TOKENS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        if graphed:
            pool = graph_pool_handle(device)
            size = CUDAGRAPH_CAPTURE_SIZES[0]
            self.g0, self.out0 = capture(
                lambda: self.model.piece0(self.input_ids[:size], self.hidden_states[:size]), device=device,
                pool=pool, owner="drafter PIECEWISE piece 0",
                static={"input_ids": self.input_ids, "hidden_states": self.hidden_states})
            h = self.out0[0]
            self.g1, self.out1 = capture(lambda: self.model.piece1(h, self.attn_output[:size]), device=device,
                                         pool=pool, owner="drafter PIECEWISE piece 1",
                                         static={"attn_output": self.attn_output})

    def dispatch(self, num_tokens, num_tokens_across_dp):
        """CudagraphDispatcher: pad to the DP-synchronised size, then to a captured size (PIECEWISE)."""
        num_tokens_padded = max(num_tokens_across_dp)
        if not self.graphed:
            return None, BatchDescriptor(num_tokens=num_tokens)          # eager: no padding
        size = min(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens_padded)
        return "PIECEWISE", BatchDescriptor(num_tokens=size, num_reqs=None)

    def _prepare_attn(self, num_reqs, batch_desc):
        if self.variant == "bug":
            num_tokens = batch_desc.num_tokens
        else:
            # one query per request: the descriptor's request count, else the local request count
            num_tokens = batch_desc.num_reqs if batch_desc.num_reqs is not None else num_reqs
        common = CommonAttentionMetadata(
            query_start_loc_cpu=torch.arange(num_reqs + 1), seq_lens=self.seq_lens,
            block_table_tensor=self.block_table, num_reqs=num_reqs, num_actual_tokens=num_tokens,
            max_query_len=1)
        return {INDEXER: self.builder.build(0, common)}

    def propose(self, next_token_ids, target_hidden, seq_lens, block_ids, num_tokens_across_dp):
        n = len(next_token_ids)
        self.input_ids[:n].copy_(torch.tensor(next_token_ids, device=self.device))
        self.hidden_states[:n].copy_(target_hidden)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, device=self.device))
        self.block_table[:n].copy_(torch.tensor(block_ids, device=self.device))
        cg_mode, batch_desc = self.dispatch(n, num_tokens_across_dp)
        _forward_context.attn_metadata = self._prepare_attn(n, batch_desc)
        if cg_mode is None:
            h, q_fp8, weights, q = self.model.piece0(self.input_ids[:n], self.hidden_states[:n])
            self.model.attention(q_fp8, weights, q, self.k_cache, self.kv_cache, self.topk_indices_buffer,
                                 self.attn_output)
            return self.model.piece1(h, self.attn_output[:n]).clone()
        size = batch_desc.num_tokens
        h, q_fp8, weights, q = replay(self.g0, self.out0, real=n, size=size,
                                      padded={"input_ids": self.input_ids, "hidden_states": self.hidden_states})
        self.model.attention(q_fp8, weights, q, self.k_cache, self.kv_cache, self.topk_indices_buffer,
                             self.attn_output)
        logits = replay(self.g1, self.out1, real=n, size=size, padded={"attn_output": self.attn_output})
        return logits[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = DeepSeekMTP(device)
    gen = generator(5545)
    steps = [([3, 9, 14], randn(3, DIM, gen=gen, device="cpu"), [5, 7, 6], [4, 4]),
             ([1, 2, 8], randn(3, DIM, gen=gen, device="cpu"), [6, 8, 7], [3, 4]),
             ([11, 5, 0], randn(3, DIM, gen=gen, device="cpu"), [7, 8, 8], [3, 3])]
    block_ids = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0]]

    def serve(graphed: bool):
        spec = AutoregressiveSpeculator(model, device, variant, graphed)
        outs = []
        for tokens, hidden, seq_lens, across_dp in steps:
            # this rank drafts for 3 requests; the other DP rank's count decides the padded size
            outs.append(spec.propose(tokens, hidden.to(device), seq_lens, block_ids, [len(tokens)] + across_dp))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
