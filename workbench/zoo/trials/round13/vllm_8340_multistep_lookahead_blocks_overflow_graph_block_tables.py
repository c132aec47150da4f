"""Lookahead slots give a decode sequence one block more than the captured block-table width.

Upstream: https://github.com/vllm-project/vllm/pull/8340 ("[Bugfix] Ensure multistep lookahead allocation is
compatible with cuda graph max capture"), for issues #8068 and #5563.
Symptom: with multi-step scheduling (or speculative decoding, ``num_lookahead_slots`` > 0) and CUDA graphs,
a request whose length gets close to ``max_seq_len_to_capture`` kills the engine with ``ValueError: could not
broadcast input array from shape (513,) into shape (512,)`` (vLLM 0.5.x-0.6.0, June-September 2024);
``--enforce-eager`` or ``max_seq_len_to_capture = max_model_len`` avoid it.
Mechanism: the decode graphs are captured for block tables ``max_seq_len_to_capture // block_size`` wide: the
runner's persistent ``graph_block_tables`` numpy buffer. A decode batch uses the graphs while its longest
sequence fits ``max_seq_len_to_capture``, but the block manager allocated blocks for ``seq_len +
num_lookahead_slots`` tokens, so near the boundary a block table has one block more than the captured width.
``FlashAttentionMetadataBuilder.build`` copies each whole block table into the buffer and the copy does not
fit. The extra blocks only hold lookahead slots no kernel reads in this step, and the eager path (a padded
tensor as wide as the longest table) runs fine.
Doctor: undersized-buffer, at ``build`` (a block table longer than the captured ``graph_block_tables`` row).
Fix (upstream): copy at most ``input_block_tables.shape[1]`` blocks; the lookahead blocks past the captured
width are not used by the model anyway.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/8340"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build"
SYMPTOM = "ValueError: could not broadcast input array from shape (5,) into shape (4,) near max_seq_len_to_capture"
BLOCK_SIZE, MAX_SEQ_LEN_TO_CAPTURE, NUM_LOOKAHEAD_SLOTS = 2, 8, 3
MAX_BATCHSIZE_TO_CAPTURE, NUM_BLOCKS, HEAD = 2, 16, 4


class ModelRunner:
    def __init__(self, device):
        self.device = device
        self.max_seq_len_to_capture = MAX_SEQ_LEN_TO_CAPTURE
        # [max batch size, max context len // block size]: the captured block-table width.
        self.graph_block_tables = np.zeros(
            (MAX_BATCHSIZE_TO_CAPTURE, MAX_SEQ_LEN_TO_CAPTURE // BLOCK_SIZE), dtype=np.int32)


class FlashAttentionMetadataBuilder:
    def __init__(self, runner: ModelRunner, variant: str):
        self.runner, self.variant = runner, variant
        self.block_tables: list[list[int]] = []

    def build(self, seq_lens: list[int], block_tables: list[list[int]], use_captured_graph: bool,
              batch_size: int) -> dict:
        self.block_tables = block_tables
        device = self.runner.device
        if use_captured_graph:
            # The shape of graph_block_tables is [max batch size, max context len // block size].
            input_block_tables = self.runner.graph_block_tables[:batch_size]
            if self.variant == "bug":
                for i, block_table in enumerate(self.block_tables):
                    if block_table:
                        input_block_tables[i, :len(block_table)] = block_table
            else:
                max_blocks = input_block_tables.shape[1]
                for i, block_table in enumerate(self.block_tables):
                    if block_table:
                        num_blocks = len(block_table)
                        if num_blocks <= max_blocks:
                            input_block_tables[i, :num_blocks] = block_table
                        else:
                            # Lookahead slots of multi-step may allocate more blocks than the captured
                            # width; they are not used in this step, so they can be skipped.
                            input_block_tables[i, :max_blocks] = block_table[:max_blocks]
            block_tables_t = torch.from_numpy(input_block_tables).to(device)
        else:
            width = max(len(b) for b in block_tables)                     # make_tensor_with_pad
            block_tables_t = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], device=device)
        return {"seq_lens": torch.tensor(seq_lens, device=device), "block_tables": block_tables_t}


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens):
    """One query token per sequence over its first ``seq_len`` cached tokens, through the block table."""
    pos = torch.arange(block_tables.shape[1] * BLOCK_SIZE, device=query.device)
    slots = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = key_cache[slots], value_cache[slots]                       # [batch, tokens, head]
    scores = torch.einsum("bh,bth->bt", query, k) / math.sqrt(HEAD)
    scores = scores.masked_fill(pos[None, :] >= seq_lens[:, None], float("-inf"))
    return torch.einsum("bt,bth->bh", torch.softmax(scores, -1), v)


def run(variant: str, device: str = "cpu"):
    gen = generator(8340)
    key_cache = randn(NUM_BLOCKS * BLOCK_SIZE, HEAD, gen=gen, device=device)
    value_cache = randn(NUM_BLOCKS * BLOCK_SIZE, HEAD, gen=gen, device=device)
    # Two decode requests; the block manager allocates for seq_len + lookahead slots (multi-step).
    blocks = [[3, 7, 1, 9, 12], [5, 2, 8, 14, 11]]
    steps = [([4, 3], randn(2, HEAD, gen=gen, device=device)),
             ([5, 4], randn(2, HEAD, gen=gen, device=device)),
             ([7, 5], randn(2, HEAD, gen=gen, device=device)),     # 7 + 3 lookahead slots: 5 blocks
             ([8, 6], randn(2, HEAD, gen=gen, device=device))]

    def allocated(seq_len, req):
        return blocks[req][:math.ceil((seq_len + NUM_LOOKAHEAD_SLOTS) / BLOCK_SIZE)]

    def serve(graphed: bool):
        runner = ModelRunner(device)
        builder = FlashAttentionMetadataBuilder(runner, variant)
        query = torch.zeros(MAX_BATCHSIZE_TO_CAPTURE, HEAD, device=device)
        seq_lens_buf = torch.ones(MAX_BATCHSIZE_TO_CAPTURE, dtype=torch.long, device=device)
        block_tables_buf = torch.zeros(runner.graph_block_tables.shape, dtype=torch.int32, device=device)
        if graphed:
            g, out = capture(lambda: paged_attention_decode(query, key_cache, value_cache, block_tables_buf.long(),
                                                            seq_lens_buf),
                             device=device, static={"query": query, "seq_lens": seq_lens_buf,
                                                    "block_tables": block_tables_buf},
                             state={"key_cache": key_cache, "value_cache": value_cache},
                             owner="CUDAGraphRunner (decode)")
        outs = []
        for seq_lens, q in steps:
            tables = [allocated(s, i) for i, s in enumerate(seq_lens)]
            use_captured_graph = graphed and max(seq_lens) <= runner.max_seq_len_to_capture
            meta = builder.build(seq_lens, tables, use_captured_graph, MAX_BATCHSIZE_TO_CAPTURE)
            if use_captured_graph:                                     # CUDAGraphRunner.forward copies in
                query.copy_(q)
                seq_lens_buf.copy_(meta["seq_lens"])
                block_tables_buf.copy_(meta["block_tables"])
                outs.append(replay(g, out).clone())
            else:
                outs.append(paged_attention_decode(q, key_cache, value_cache, meta["block_tables"].long(),
                                                   meta["seq_lens"]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
