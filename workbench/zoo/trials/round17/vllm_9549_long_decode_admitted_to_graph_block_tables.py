"""A typo admits decode batches longer than ``max_seq_len_to_capture`` to the graphs: their block tables are cut.

Upstream: https://github.com/vllm-project/vllm/pull/9549 ("[Bugfix][Misc]: fix graph capture for decoder");
the same typo is fixed by https://github.com/vllm-project/vllm/pull/9285 ("Fixes a typo about
'max_decode_seq_len' which causes crashes with cuda graph").
Symptom: vLLM 0.6.3 (October 2024) answers prompts longer than ``max_seq_len_to_capture`` (8192 by default)
with incomplete, repeated or garbage text (issues #9448, #9417, #9409, #9670, #9769); 0.6.2 and
``--enforce-eager`` are fine.
Mechanism: the V0 ``ModelInputForGPUBuilder.build`` decides whether a decode batch may use a captured graph
with ``_get_cuda_graph_pad_size(num_seqs, max_decode_seq_len, max_encoder_seq_len)``, which refuses batches
whose longest sequence exceeds ``max_seq_len_to_capture``. The encoder-decoder change (#8645) passed
``max_decode_seq_len=max_encoder_seq_len``: for a decoder-only model that is 0, so every decode batch of a
capture size is replayed. The graphs were captured with ``graph_block_tables`` of
``max_seq_len_to_capture // block_size`` columns, and ``_get_graph_runner_block_tables`` silently cuts a
longer block table to that width. The captured paged-attention kernel still walks ``seq_len`` positions: the
blocks past the width are read from the next row of the static table (a padded row, another sequence), so
long sequences attend to the wrong keys and values.
Doctor: undersized-buffer, at ``build`` (a batch whose block tables do not fit the captured
``graph_block_tables`` is sent to the graph).
Fix (upstream): pass ``max_decode_seq_len=max_decode_seq_len``, so long decode batches run eagerly.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/9549"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build"
SYMPTOM = "sequences longer than max_seq_len_to_capture decode garbage with CUDA graphs (0.6.3), fine eager"
VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS = 10, 4, 2, 12
MAX_SEQ_LEN_TO_CAPTURE, MAX_MODEL_LEN = 4, 8           # graph block tables: 4 // 2 = 2 columns
_BATCH_SIZES_TO_CAPTURE = [4]
PAD_SLOT_ID = -1


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(9549)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.7)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Store this step's key/value at its slot; ``PAD_SLOT_ID`` rows (padding) store nothing."""
    valid = (slot_mapping >= 0)[:, None]
    slots = slot_mapping.clamp(min=0)
    key_cache.index_put_((slots,), torch.where(valid, key, key_cache[slots]))
    value_cache.index_put_((slots,), torch.where(valid, value, value_cache[slots]))


def paged_attention_v1(query, key_cache, value_cache, block_tables, seq_lens):
    """Decode attention over ``seq_lens`` positions. As the kernel does, position ``p`` of sequence ``i`` takes
    its block id at ``block_tables.data[i * row_width + p // BLOCK_SIZE]``: past the row's width that is the
    next row of the same buffer."""
    num_seqs, width = block_tables.shape
    pos = torch.arange(MAX_MODEL_LEN, device=query.device)
    flat = block_tables.reshape(-1)
    idx = (torch.arange(num_seqs, device=query.device)[:, None] * width + pos[None, :] // BLOCK_SIZE)
    slots = flat[idx.clamp(max=flat.numel() - 1)] * BLOCK_SIZE + pos[None, :] % BLOCK_SIZE
    k, v = key_cache[slots], value_cache[slots]                          # [seqs, positions, dim]
    scores = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(DIM)
    scores = scores.masked_fill(pos[None, :] >= seq_lens[:, None], float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * v).sum(1)


def forward(model, kv_caches, input_tokens, slot_mapping, seq_lens, block_tables):
    x = model.embed_tokens[input_tokens]
    key_cache, value_cache = kv_caches
    reshape_and_cache(x @ model.wk, x @ model.wv, key_cache, value_cache, slot_mapping)
    attn = paged_attention_v1(x @ model.wq, key_cache, value_cache, block_tables, seq_lens)
    return (x + attn) @ model.lm_head


class ModelRunner:
    def __init__(self, model, device, enforce_eager: bool, variant: str):
        self.model, self.device, self.variant = model, device, variant
        self.enforce_eager = enforce_eager
        self.max_seq_len_to_capture = MAX_SEQ_LEN_TO_CAPTURE
        max_bs = _BATCH_SIZES_TO_CAPTURE[-1]
        gen = generator(1)
        self.kv_caches = (randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device),
                          randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device))
        # [max batch size, max context len // block size], a host array as upstream
        self.graph_block_tables = np.zeros((max_bs, self.max_seq_len_to_capture // BLOCK_SIZE), dtype=np.int64)
        self.graph_runners = {}
        if not enforce_eager:
            self.capture_model()

    def capture_model(self):
        bs = _BATCH_SIZES_TO_CAPTURE[-1]
        d = self.device
        self.input_buffers = {
            "input_tokens": torch.zeros(bs, dtype=torch.long, device=d),
            "slot_mapping": torch.full((bs,), PAD_SLOT_ID, dtype=torch.long, device=d),
            "seq_lens": torch.ones(bs, dtype=torch.long, device=d),
            "block_tables": torch.from_numpy(self.graph_block_tables).to(d),
        }
        b = self.input_buffers
        self.graph_runners[bs] = capture(
            lambda: forward(self.model, self.kv_caches, b["input_tokens"], b["slot_mapping"], b["seq_lens"],
                            b["block_tables"]),
            device=d, static=b, state={"key_cache": self.kv_caches[0], "value_cache": self.kv_caches[1]},
            owner="CUDAGraphRunner (V0 decode)")

    def _use_captured_graph(self, batch_size, decode_only, max_decode_seq_len, max_encoder_seq_len=0):
        return (decode_only and not self.enforce_eager and batch_size <= _BATCH_SIZES_TO_CAPTURE[-1]
                and max_decode_seq_len <= self.max_seq_len_to_capture
                and max_encoder_seq_len <= self.max_seq_len_to_capture)

    def _get_cuda_graph_pad_size(self, num_seqs, max_decode_seq_len, max_encoder_seq_len=0):
        """The number of padding sequences for a graph, or -1 when the batch cannot use one."""
        if not self._use_captured_graph(num_seqs, True, max_decode_seq_len, max_encoder_seq_len):
            return -1
        graph_batch_size = next(b for b in _BATCH_SIZES_TO_CAPTURE if b >= num_seqs)
        return graph_batch_size - num_seqs

    def _get_graph_runner_block_tables(self, num_seqs, block_tables):
        max_batch_size, max_blocks = self.graph_block_tables.shape
        assert max_batch_size >= num_seqs
        graph_block_tables = self.graph_block_tables[:num_seqs]
        for i, block_table in enumerate(block_tables):
            if block_table:
                num_blocks = len(block_table)
                if num_blocks <= max_blocks:
                    graph_block_tables[i, :num_blocks] = block_table
                else:
                    # It may be possible to have more blocks allocated due to lookahead slots of
                    # multi-step, however, they are not used anyway, so can be safely ignored.
                    graph_block_tables[i, :max_blocks] = block_table[:max_blocks]
        return torch.from_numpy(graph_block_tables).to(self.device)

    def build(self, seqs):
        """``ModelInputForGPUBuilder.build`` for a decode batch: ``seqs`` = (token, seq_len, block_table)."""
        seq_lens = [s[1] for s in seqs]
        max_decode_seq_len = max(seq_lens)
        max_encoder_seq_len = 0                               # decoder-only model
        if self.variant == "bug":
            cuda_graph_pad_size = self._get_cuda_graph_pad_size(
                num_seqs=len(seq_lens), max_decode_seq_len=max_encoder_seq_len,
                max_encoder_seq_len=max_encoder_seq_len)
        else:
            cuda_graph_pad_size = self._get_cuda_graph_pad_size(
                num_seqs=len(seq_lens), max_decode_seq_len=max_decode_seq_len,
                max_encoder_seq_len=max_encoder_seq_len)
        slot_mapping = [bt[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for _, n, bt in seqs]
        return {"input_tokens": [s[0] for s in seqs], "seq_lens": seq_lens, "slot_mapping": slot_mapping,
                "block_tables": [s[2] for s in seqs], "cuda_graph_pad_size": cuda_graph_pad_size}

    def execute_model(self, model_input):
        d, n = self.device, len(model_input["seq_lens"])
        if model_input["cuda_graph_pad_size"] == -1:
            width = max(len(bt) for bt in model_input["block_tables"])
            block_tables = torch.tensor([bt + [0] * (width - len(bt)) for bt in model_input["block_tables"]],
                                        dtype=torch.long, device=d)
            return forward(self.model, self.kv_caches, torch.tensor(model_input["input_tokens"], device=d),
                           torch.tensor(model_input["slot_mapping"], device=d),
                           torch.tensor(model_input["seq_lens"], device=d), block_tables)
        bs = n + model_input["cuda_graph_pad_size"]
        g, out = self.graph_runners[bs]
        b = self.input_buffers
        pad = model_input["cuda_graph_pad_size"]
        b["input_tokens"].copy_(torch.tensor(model_input["input_tokens"] + [0] * pad, device=d))
        b["slot_mapping"].copy_(torch.tensor(model_input["slot_mapping"] + [PAD_SLOT_ID] * pad, device=d))
        b["seq_lens"].copy_(torch.tensor(model_input["seq_lens"] + [1] * pad, device=d))
        b["block_tables"][:n].copy_(self._get_graph_runner_block_tables(n, model_input["block_tables"]))
        return replay(g, out, real=n, size=bs, padded={"block_tables": b["block_tables"]})[:n]


def run(variant: str, device: str = "cpu"):
    model = LlamaForCausalLM(device)
    # Prompts already prefilled into the cache: A (3 tokens, blocks 1-2), B (5 tokens, blocks 3-5).
    steps = [
        [(4, 4, [1, 2]), (7, 6, [3, 4, 5])],                  # B's seq_len 6 > max_seq_len_to_capture
        [(2, 5, [1, 2, 6]), (5, 7, [3, 4, 5, 7])],
        [(8, 2, [8]), (1, 3, [9, 10])],                       # short requests: graphs in both variants
    ]

    def serve(enforce_eager: bool):
        runner = ModelRunner(model, device, enforce_eager, variant)
        return [runner.execute_model(runner.build(step)).clone() for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
