"""FULL CUDA graph captured from a dummy batch with tiny ``seq_lens``: FA3's key range is baked in too short.

Upstream: https://github.com/vllm-project/vllm/pull/19106 ("[Bugfix] Fix FA3 full cuda graph correctness").
Symptom: V1 with ``compilation_config={"full_cuda_graph": True}`` and FlashAttention 3 generates different
(wrong) text than piecewise graphs or eager mode, with no error; the PR adds ``test_full_cudagraph.py`` to CI,
which compares full-graph generations against piecewise ones (vLLM main, June 2025).
Mechanism: with full CUDA graphs the attention call is inside the graph, so its host-side launch arguments are
frozen at capture: FA3 is launched with ``max_seqlen_k=attn_metadata.max_seq_len`` (and the AOT scheduler's
split plan derived from it), a Python int that ``FlashAttentionMetadataBuilder.build`` computes as
``int(self.runner.seq_lens_np[:num_reqs].max())``. The graph is captured from ``_dummy_run``, whose dummy requests schedule one
token each and whose ``seq_lens`` say no more than that (modelled as ``seq_lens_np[:num_reqs] = 1``): the
captured kernel covers one KV tile.
Every replay reuses that launch, while the metadata of a real step (and an eager step) says the longest sequence
is much longer: replayed decodes attend to the first keys of each sequence only.
Doctor: warmup-divergence, at ``_dummy_run`` (the capture decided the attention's key range from the dummy
batch; replays reuse it while eager steps size it from the real ``seq_lens``).
Fix (upstream): ``_dummy_run`` sets ``seq_lens_np[:num_reqs] = self.max_model_len`` (and 0 beyond) before it
builds the capture-time metadata ("Make sure max_model_len is used at the graph capture time"), so the captured
launch covers any sequence; the per-request ``seqused_k`` masks the rest. (The same PR also zeroes the tail of
the builder's persistent ``scheduler_metadata`` buffer; that part is not modelled here.) The FA3 launch
arithmetic is reduced to "the grid covers ``cdiv(max_seqlen_k, BLOCK_N)`` key tiles".
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/19106"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_dummy_run"
SYMPTOM = "full-CUDA-graph decodes attend only to the first keys of each sequence (wrong generations, no error)"
VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_NUM_REQS, MAX_MODEL_LEN = 16, 4, 4, 6, 2, 8
MAX_BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK_SIZE
BLOCK_N = 2                    # keys per tile of the FA3 kernel's KV loop
NULL_BLOCK = 0                 # dummy runs write their K/V into the reserved null block


class LlamaAttentionModel:
    def __init__(self, device):
        gen = generator(19106)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(4))

    def forward(self, input_ids, attn_metadata, kv_cache):
        key_cache, value_cache = kv_cache
        h = self.embed_tokens[input_ids]
        reshape_and_cache_flash(h @ self.k_proj, h @ self.v_proj, key_cache, value_cache, attn_metadata.slot_mapping)
        out = flash_attn_varlen_func(h @ self.q_proj, key_cache, value_cache, max_seqlen_k=attn_metadata.max_seq_len,
                                     seqused_k=attn_metadata.seq_lens, block_table=attn_metadata.block_table)
        return h + out @ self.o_proj


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    key_cache[slot_mapping] = key
    value_cache[slot_mapping] = value


def flash_attn_varlen_func(q, key_cache, value_cache, max_seqlen_k: int, seqused_k, block_table):
    """Decode attention (one query token per request) over the paged KV cache. ``max_seqlen_k`` is a launch
    argument: the grid covers ``cdiv(max_seqlen_k, BLOCK_N)`` key tiles; ``seqused_k`` masks within them."""
    num_tiles = -(-max_seqlen_k // BLOCK_N)
    pos = torch.arange(num_tiles * BLOCK_N, device=q.device)
    slots = block_table[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE        # [reqs, keys]
    k, v = key_cache[slots], value_cache[slots]
    scores = torch.einsum("rd,rkd->rk", q, k) / math.sqrt(DIM)
    valid = pos[None, :] < seqused_k[:, None]
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return torch.einsum("rk,rkd->rd", probs, v)


@dataclasses.dataclass
class FlashAttentionMetadata:
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class FlashAttentionMetadataBuilder:
    def __init__(self, runner):
        self.runner = runner

    def build(self, num_reqs: int, num_actual_tokens: int) -> FlashAttentionMetadata:
        max_seq_len = int(self.runner.seq_lens_np[:num_reqs].max())
        return FlashAttentionMetadata(max_seq_len=max_seq_len, seq_lens=self.runner.seq_lens[:num_reqs],
                                      block_table=self.runner.block_table[:num_reqs],
                                      slot_mapping=self.runner.slot_mapping[:num_actual_tokens])


class GPUModelRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.max_model_len = MAX_MODEL_LEN
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.seq_lens_np = np.zeros(MAX_NUM_REQS, dtype=np.int64)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_table = torch.full((MAX_NUM_REQS, MAX_BLOCKS_PER_REQ), NULL_BLOCK, dtype=torch.long,
                                      device=device)
        self.kv_cache = (torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device),
                         torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device))
        self.attn_metadata_builder = FlashAttentionMetadataBuilder(self)
        self.graph = None

    def _dummy_run(self, num_tokens: int) -> FlashAttentionMetadata:
        """The capture-time batch: ``num_reqs`` dummy requests with one scheduled token each."""
        num_reqs = min(num_tokens, MAX_NUM_REQS)
        num_scheduled_tokens = np.ones(num_reqs, dtype=np.int64)
        if self.variant == "fix":
            # Make sure max_model_len is used at the graph capture time.
            self.seq_lens_np[:num_reqs] = self.max_model_len
            self.seq_lens_np[num_reqs:] = 0
        else:
            self.seq_lens_np[:num_reqs] = num_scheduled_tokens
        self.seq_lens[:num_reqs].copy_(torch.from_numpy(self.seq_lens_np[:num_reqs]))
        self.slot_mapping[:num_tokens].fill_(NULL_BLOCK * BLOCK_SIZE)
        return self.attn_metadata_builder.build(num_reqs, num_tokens)

    def capture_model(self):
        attn_metadata = self._dummy_run(MAX_NUM_REQS)
        self.graph = capture(lambda: self.model.forward(self.input_ids[:MAX_NUM_REQS], attn_metadata, self.kv_cache),
                             device=self.device,
                             static={"input_ids": self.input_ids, "seq_lens": self.seq_lens,
                                     "slot_mapping": self.slot_mapping, "block_table": self.block_table},
                             state={"key_cache": self.kv_cache[0], "value_cache": self.kv_cache[1]},
                             owner="GPUModelRunner (full_cuda_graph)")

    def execute_model(self, token_ids, seq_lens, graphed: bool):
        """One decode step: every request's new token is its ``seq_len - 1``-th."""
        num_reqs = len(token_ids)
        self.input_ids[:num_reqs].copy_(torch.tensor(token_ids, device=self.device))
        self.seq_lens_np[:num_reqs] = seq_lens
        self.seq_lens[:num_reqs].copy_(torch.from_numpy(self.seq_lens_np[:num_reqs]))
        pos = torch.tensor(seq_lens, device=self.device) - 1
        rows = torch.arange(num_reqs, device=self.device)
        self.slot_mapping[:num_reqs].copy_(self.block_table[rows, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        attn_metadata = self.attn_metadata_builder.build(num_reqs, num_reqs)
        if not graphed:
            return self.model.forward(self.input_ids[:num_reqs], attn_metadata, self.kv_cache).clone()
        g, out = self.graph
        return replay(g, out)[:num_reqs].clone()


def run(variant: str, device: str = "cpu"):
    model = LlamaAttentionModel(device)
    gen = torch.Generator().manual_seed(7)
    prompt_kv = torch.randn(2, 2, MAX_MODEL_LEN, DIM, generator=gen)     # [req, k/v, pos, dim]
    prompt_lens = [4, 5]
    blocks = [[1, 2], [3, 4]]
    steps = [([3, 7], [5, 6]), ([11, 2], [6, 7]), ([5, 9], [7, 8])]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant)
        if graphed:
            runner.capture_model()
        # Requests A and B were prefilled (eagerly); their prompt K/V sit in their blocks.
        for r in range(2):
            runner.block_table[r].copy_(torch.tensor(blocks[r], device=device))
            for p in range(prompt_lens[r]):
                slot = blocks[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                runner.kv_cache[0][slot] = prompt_kv[r, 0, p].to(device)
                runner.kv_cache[1][slot] = prompt_kv[r, 1, p].to(device)
        return [runner.execute_model(ids, lens, graphed) for ids, lens in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
