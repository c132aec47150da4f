"""Multi-step lookahead blocks make a block table wider than the captured graph's block-table buffer.

Upstream: https://github.com/PygmalionAI/aphrodite-engine/pull/1008 ("fix: ensure multistep lookahead
allocation is compatible with cugraph max capture", commit de341ffb; the same fix for the FlashInfer
backend is #1036).
Symptom: with multi-step scheduling (``--num-scheduler-steps``) and CUDA graphs, a decode batch whose
sequence is a few tokens short of ``max_seq_len_to_capture`` crashes the engine with numpy's
``ValueError: could not broadcast input array from shape (n,) into shape (m,)`` (Aphrodite, Dec 2024).
Mechanism: a decode batch goes to a captured graph when its longest sequence is at most
``max_seq_len_to_capture``, and the graphs' block tables are staged in the host array
``graph_block_tables``, ``max_seq_len_to_capture // block_size`` columns wide. Multi-step scheduling makes
the block manager reserve lookahead slots, so a sequence a few tokens short of that limit already owns
blocks past the graphs' width. The metadata builder copies each sequence's whole block table into its row
of the staging array, and that copy does not fit.
Doctor: undersized-buffer, at ``build`` (the copy of a block table into the captured block-table buffer).
Fix (upstream): copy at most the buffer's width: the lookahead blocks past it are not read by this step's
attention, so they are dropped.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PygmalionAI/aphrodite-engine/pull/1008"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build"
SYMPTOM = "ValueError copying a block table with lookahead blocks into the captured block-table array"
NAME = "aphrodite_1008_lookahead_blocks_exceed_graph_block_table"

VOCAB, D, BLOCK_SIZE, NUM_BLOCKS = 16, 4, 2, 16
MAX_SEQ_LEN_TO_CAPTURE = 8
NUM_SCHEDULER_STEPS = 4
NUM_LOOKAHEAD_SLOTS = NUM_SCHEDULER_STEPS - 1
BATCH_SIZES_TO_CAPTURE = [1, 2, 4]
PAD_SLOT_ID = -1                         # row -1 of the cache is a scratch row nobody reads
_NUM_WARMUP_ITERS = 2


class Model:
    def __init__(self, device):
        gen = generator(1008)
        self.embed = randn(VOCAB, D, gen=gen, device=device)
        self.pos = randn(4 * MAX_SEQ_LEN_TO_CAPTURE, D, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(D, D, gen=gen, device=device, scale=0.6) for _ in range(3))
        self.lm_head = randn(D, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, positions, kv_caches, slot_mapping, seq_lens_tensor, block_tables):
        """Decode: write each token's key/value at its slot, then paged attention over its block table."""
        k_cache, v_cache = kv_caches
        h = self.embed[input_ids] + self.pos[positions]
        k_cache[slot_mapping] = h @ self.wk
        v_cache[slot_mapping] = h @ self.wv
        pos = torch.arange(block_tables.shape[1] * BLOCK_SIZE, device=h.device)
        slots = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        scores = ((h @ self.wq)[:, None, :] * k_cache[slots]).sum(-1) / math.sqrt(D)
        scores = scores.masked_fill(pos[None, :] >= seq_lens_tensor[:, None], float("-inf"))
        out = h + (torch.softmax(scores, -1)[..., None] * v_cache[slots]).sum(1)
        return out @ self.lm_head

    def prefill(self, kv_caches, tokens, slots):
        k_cache, v_cache = kv_caches
        h = self.embed[tokens] + self.pos[torch.arange(len(tokens), device=tokens.device)]
        k_cache[slots] = h @ self.wk
        v_cache[slots] = h @ self.wv


class BlockSpaceManager:
    """Allocates blocks so a sequence has room for its tokens plus the multi-step lookahead slots."""

    def __init__(self):
        self.free = list(range(1, NUM_BLOCKS))
        self.block_tables: dict[int, list[int]] = {}

    def append_slots(self, seq_id, num_tokens, num_lookahead_slots):
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * BLOCK_SIZE < num_tokens + num_lookahead_slots:
            table.append(self.free.pop(0))
        return table

    def slot(self, seq_id, position):
        return self.block_tables[seq_id][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


class FlashAttentionMetadataBuilder:
    def __init__(self, runner, block_tables, variant):
        self.runner, self.block_tables, self.variant = runner, block_tables, variant

    def build(self, seq_lens, cuda_graph_pad_size, batch_size):
        device = self.runner.device
        use_captured_graph = cuda_graph_pad_size != -1
        if use_captured_graph:
            # The shape of graph_block_tables is [max batch size, max context len // block size].
            input_block_tables = self.runner.graph_block_tables[:batch_size]
            max_blocks = input_block_tables.shape[1]
            for i, block_table in enumerate(self.block_tables):
                if block_table:
                    num_blocks = len(block_table)
                    if self.variant == "bug" or num_blocks <= max_blocks:
                        input_block_tables[i, :num_blocks] = block_table
                    else:
                        # More blocks may be allocated for multi-step lookahead slots; this step does
                        # not read them, so they can be dropped.
                        input_block_tables[i, :max_blocks] = block_table[:max_blocks]
            block_tables = torch.from_numpy(input_block_tables).to(device=device)
        else:
            width = max(len(t) for t in self.block_tables)
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.block_tables], device=device)
        seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        return {"block_tables": block_tables, "seq_lens_tensor": seq_lens_tensor}


class ModelRunner:
    def __init__(self, model, kv_caches, device, variant, enforce_eager):
        self.model, self.kv_caches, self.device, self.variant = model, kv_caches, device, variant
        self.enforce_eager = enforce_eager
        self.max_seq_len_to_capture = MAX_SEQ_LEN_TO_CAPTURE
        self.max_batchsize_to_capture = BATCH_SIZES_TO_CAPTURE[-1]
        self.graph_block_tables = np.zeros(
            (self.max_batchsize_to_capture, self.get_max_block_per_batch()), dtype=np.int64)
        self.graph_runners: dict[int, tuple] = {}

    def get_max_block_per_batch(self):
        return (self.max_seq_len_to_capture + BLOCK_SIZE - 1) // BLOCK_SIZE

    def capture_model(self):
        max_bs = self.max_batchsize_to_capture
        input_tokens = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        input_positions = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        slot_mapping = torch.full((max_bs,), PAD_SLOT_ID, dtype=torch.int64, device=self.device)
        seq_lens = torch.ones(max_bs, dtype=torch.int64, device=self.device)
        block_tables = torch.from_numpy(self.graph_block_tables).to(device=self.device)
        pool = graph_pool_handle(self.device)
        for bs in reversed(BATCH_SIZES_TO_CAPTURE):
            bufs = {"input_ids": input_tokens[:bs], "positions": input_positions[:bs],
                    "slot_mapping": slot_mapping[:bs], "seq_lens_tensor": seq_lens[:bs],
                    "block_tables": block_tables[:bs]}

            def step(b=bufs):
                return self.model.forward(b["input_ids"], b["positions"], self.kv_caches, b["slot_mapping"],
                                          b["seq_lens_tensor"], b["block_tables"])

            g, out = capture(step, device=self.device, pool=pool, warmups=_NUM_WARMUP_ITERS, name=f"decode bs {bs}",
                             static=bufs, state={"k_cache": self.kv_caches[0], "v_cache": self.kv_caches[1]},
                             owner="aphrodite CUDAGraphRunner")
            self.graph_runners[bs] = (g, out, bufs)

    def _use_captured_graph(self, batch_size, max_decode_seq_len):
        return (not self.enforce_eager and batch_size <= self.max_batchsize_to_capture
                and max_decode_seq_len <= self.max_seq_len_to_capture)

    def execute_model(self, batch, block_manager):
        """``batch``: (seq_id, token, position) of each decoding sequence."""
        seq_lens = [pos + 1 for _, _, pos in batch]
        input_tokens = [tok for _, tok, _ in batch]
        input_positions = [pos for _, _, pos in batch]
        slot_mapping = [block_manager.slot(sid, pos) for sid, _, pos in batch]
        block_tables = [list(block_manager.block_tables[sid]) for sid, _, _ in batch]
        batch_size = len(batch)
        cuda_graph_pad_size = -1
        if self._use_captured_graph(batch_size, max(seq_lens)):
            graph_batch_size = next(bs for bs in BATCH_SIZES_TO_CAPTURE if bs >= batch_size)
            cuda_graph_pad_size = graph_batch_size - batch_size
            batch_size = graph_batch_size
            input_tokens += [0] * cuda_graph_pad_size
            input_positions += [0] * cuda_graph_pad_size
            slot_mapping += [PAD_SLOT_ID] * cuda_graph_pad_size
            seq_lens += [1] * cuda_graph_pad_size
        attn_metadata = FlashAttentionMetadataBuilder(self, block_tables, self.variant).build(
            seq_lens, cuda_graph_pad_size, batch_size)
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)
        if cuda_graph_pad_size == -1:
            return self.model.forward(t(input_tokens), t(input_positions), self.kv_caches, t(slot_mapping),
                                      attn_metadata["seq_lens_tensor"], attn_metadata["block_tables"])
        g, out, bufs = self.graph_runners[batch_size]
        bufs["input_ids"].copy_(t(input_tokens))
        bufs["positions"].copy_(t(input_positions))
        bufs["slot_mapping"].copy_(t(slot_mapping))
        bufs["seq_lens_tensor"].copy_(attn_metadata["seq_lens_tensor"])
        bufs["block_tables"].copy_(attn_metadata["block_tables"])
        real = len(batch)
        logits = replay(g, out, real=real, size=batch_size, padded={"block_tables": bufs["block_tables"]})
        return logits[:real].clone()


def schedule():
    """Prompts A (4 tokens) and B (2 tokens); decode steps of (seq_id, token, position). A reaches a
    sequence length of 6 at step 2: 6 tokens + 3 lookahead slots need 5 blocks, the graph has room for 4."""
    prompts = {0: [3, 9, 1, 12], 1: [7, 2]}
    steps = [[(0, 5, 4), (1, 11, 2)], [(0, 8, 5), (1, 4, 3)], [(0, 13, 6), (1, 6, 4)], [(0, 10, 7)]]
    return prompts, steps


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    prompts, steps = schedule()

    def serve(graphed: bool):
        kv_caches = (torch.zeros(NUM_BLOCKS * BLOCK_SIZE + 1, D, device=device),
                     torch.zeros(NUM_BLOCKS * BLOCK_SIZE + 1, D, device=device))
        block_manager = BlockSpaceManager()
        runner = ModelRunner(model, kv_caches, device, variant, enforce_eager=not graphed)
        if graphed:
            runner.capture_model()
        for sid, prompt in prompts.items():
            table = block_manager.append_slots(sid, len(prompt), 0)
            slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(prompt))]
            model.prefill(kv_caches, torch.tensor(prompt, device=device), torch.tensor(slots, device=device))
        logits = []
        for batch in steps:
            for sid, _, pos in batch:        # the scheduler reserves this step's slot plus the lookahead slots
                block_manager.append_slots(sid, pos + 1, NUM_LOOKAHEAD_SLOTS)
            logits.append(runner.execute_model(batch, block_manager))
        return logits

    return compare(NAME, variant, device, lambda: serve(True), lambda: serve(False))
