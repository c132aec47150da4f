"""A FULL decode graph reads the C128A top-k rows at the stride it was captured with; the builder packs them tighter.

Upstream: https://github.com/vllm-project/vllm/pull/51318 (the revert of
https://github.com/vllm-project/vllm/pull/50004, "[DSv4 Perf] Adaptive topk width, 1.0% E2E throughput
improvement"); the feature came back safely in https://github.com/vllm-project/vllm/pull/52823.
Symptom: DeepSeek-V4 with FULL CUDA graphs (MTP + prefix caching, 2x DGX Spark and others) produced
intermittent silent token corruption; eager and PIECEWISE were clean (vLLM, August 2026).
Mechanism: the C128A (heavily compressed, ratio 128) decode attention reads, per token, a row of global
compressed-slot ids from ``global_decode_buffer`` (capacity ``max_model_len // 128`` columns) and a row
length from ``decode_lens_buffer``. #50004 made ``build_c128a_topk_metadata`` size the rows by the live
batch: ``active_topk_width = max(next_power_of_2(max_context // 128), 128)`` and
``global_decode = global_decode_buffer.view(-1)[: n * width].view(n, width)`` -- the rows are packed at a
stride that changes from step to step. A FULL graph is captured on a dummy batch at ``max_model_len``, so
its sparse-attention kernel keeps the capture-time view (width = capacity). When a later step has short
contexts, the builder packs row ``r`` at ``r * width`` while the replayed kernel reads row ``r`` at
``r * capacity``: row 0 is right, rows >= 1 read slot ids that an earlier step left in the buffer, and the
attention lands on another request's context. Eager re-derives the view every step and is correct.
Doctor: warmup-divergence, at ``build_c128a_topk_metadata`` (the capture fixed the top-k row width/stride
that every replay reuses, while each eager step chooses its own adaptive width).
Fix (upstream): #51318 reverted to the capacity layout, ``global_decode_buffer[:num_decode_tokens]`` (stride
= capacity for every step, the unused columns filled with -1), so the captured view and the builder agree.
Read: the descriptions of #50004 (with its before/after layout), #51318 (as quoted by the downstream
report MiaAI-Lab/DeepSeek-v4-Flash-DSpark-2x-DGX-Spark#115), #52823, and the root-cause comment on
https://github.com/vllm-project/vllm/pull/41834 (capture at ``max_model_len`` bakes the widest stride; row 0
is right, later rows read stale bytes); not the revert's diff line by line.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/51318"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "build_c128a_topk_metadata"
SYMPTOM = "FULL-graph decode rows >= 1 attend over stale compressed-slot ids: silent token corruption"

VOCAB, DIM = 16, 4
COMPRESS_RATIO = 4                          # 128 upstream
MAX_MODEL_LEN = 64
CAPACITY_WIDTH = MAX_MODEL_LEN // COMPRESS_RATIO   # c128a_max_compressed: 16 columns
MIN_WIDTH = 4                               # the floor of the adaptive width (128 upstream)
SIZE = MAX_NUM_REQS = 4                     # one FULL decode graph for 4 requests (one token each)
NUM_COMPRESSED_SLOTS = 80


def next_power_of_2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class Model:
    def __init__(self, device):
        gen = generator(51318)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.cols = torch.arange(CAPACITY_WIDTH, device=device)


def build_c128a_topk_metadata(variant, positions, compressed_tables, global_decode_buffer,
                              decode_lens_buffer, device):
    """Per decode token: the global ids of its request's compressed KV entries and how many there are.
    The rows are computed on the host and copied into the persistent buffers (as the builder's kernels
    write them); returns the views the sparse attention reads."""
    n = len(positions)
    num_compressed = [pos // COMPRESS_RATIO + 1 for pos in positions]
    if variant == "bug":
        # #50004: adapt the row width to the current context; pack the rows at that stride.
        width = max(next_power_of_2(max(num_compressed)), MIN_WIDTH)
        global_decode = global_decode_buffer.view(-1)[: n * width].view(n, width)
    else:
        # Pre-#50004 layout, restored by #51318: always the maximum width (capture-stable stride).
        width = CAPACITY_WIDTH
        global_decode = global_decode_buffer[:n]
    rows = [table[:k] + [-1] * (width - k) for table, k in zip(compressed_tables, num_compressed)]
    global_decode.copy_(torch.tensor(rows, dtype=torch.long).to(device))
    lens = decode_lens_buffer[:n]
    lens.copy_(torch.tensor(num_compressed, dtype=torch.long).to(device))
    return SimpleNamespace(c128a_topk_indices=global_decode, c128a_topk_lens=lens)


def sparse_attn(model, query, compressed_kv, topk_indices, topk_lens):
    """Each row attends over the compressed entries named by the first ``topk_lens`` ids of its row."""
    width = topk_indices.shape[1]
    k = compressed_kv[topk_indices.clamp(min=0)]                        # [rows, width, DIM]
    scores = (k @ query[:, :, None]).squeeze(-1)
    scores = scores.masked_fill(model.cols[None, :width] >= topk_lens[:, None], -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


def forward(model, input_ids, compressed_kv, attn_metadata):
    q = model.emb[input_ids] @ model.wq
    out = sparse_attn(model, q, compressed_kv, attn_metadata.c128a_topk_indices,
                      attn_metadata.c128a_topk_lens)
    return out @ model.wo


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        gen = generator(51)
        self.compressed_kv = randn(NUM_COMPRESSED_SLOTS, DIM, gen=gen, device=device)   # the C128A cache
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.global_decode_buffer = torch.full((MAX_NUM_REQS, CAPACITY_WIDTH), -1, dtype=torch.long,
                                               device=device)
        self.decode_lens_buffer = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        if graphed:
            self.capture_model()

    def _build(self, positions, tables):
        return build_c128a_topk_metadata(self.variant, positions, tables, self.global_decode_buffer,
                                         self.decode_lens_buffer, self.device)

    def capture_model(self):
        """FULL decode capture on a dummy batch: every dummy request at ``max_model_len``."""
        dummy_tables = [[0] * CAPACITY_WIDTH for _ in range(SIZE)]
        md = self._build([MAX_MODEL_LEN - 1] * SIZE, dummy_tables)
        self.graph, self.out = capture(
            lambda: forward(self.model, self.input_ids[:SIZE], self.compressed_kv, md),
            device=self.device, owner="GPUModelRunner (FULL decode graph)",
            static={"input_ids": self.input_ids, "global_decode_buffer": self.global_decode_buffer,
                    "decode_lens_buffer": self.decode_lens_buffer},
            state={"compressed_kv": self.compressed_kv})

    def execute_model(self, reqs):
        """``reqs``: (token id, position, compressed block table) per decoding request."""
        n = len(reqs)
        self.input_ids[:n].copy_(torch.tensor([tok for tok, _, _ in reqs], dtype=torch.long).to(self.device))
        md = self._build([pos for _, pos, _ in reqs], [table for _, _, table in reqs])
        if not self.graphed:
            return forward(self.model, self.input_ids[:n], self.compressed_kv, md).clone()
        return replay(self.graph, self.out, real=n, size=SIZE)[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    # Compressed-slot tables: A..D long contexts (16 entries each), E..H short ones.
    long_tables = [list(range(16 * i, 16 * i + 16)) for i in range(4)]
    short_tables = [list(range(64 + 4 * i, 64 + 4 * i + 4)) for i in range(4)]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        outs = []
        # Long-context decodes: the adaptive width equals the capacity, both layouts agree.
        outs.append(runner.execute_model([(3, 60, long_tables[0]), (5, 61, long_tables[1]),
                                          (7, 62, long_tables[2]), (9, 63, long_tables[3])]))
        outs.append(runner.execute_model([(4, 61, long_tables[0]), (6, 62, long_tables[1]),
                                          (8, 63, long_tables[2]), (10, 63, long_tables[3])]))
        # A..D finish; E..H decode with short contexts (<= 3 compressed entries: width 4).
        outs.append(runner.execute_model([(1, 9, short_tables[0]), (2, 10, short_tables[1]),
                                          (11, 11, short_tables[2]), (12, 8, short_tables[3])]))
        outs.append(runner.execute_model([(13, 10, short_tables[0]), (14, 11, short_tables[1]),
                                          (15, 12, short_tables[2]), (0, 9, short_tables[3])]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
