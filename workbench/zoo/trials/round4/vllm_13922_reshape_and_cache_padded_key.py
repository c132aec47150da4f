"""``reshape_and_cache`` takes its token count from the padded key and reads past the slot mapping.

Upstream: https://github.com/vllm-project/vllm/pull/13922 ("[ROCm][V1] Update reshape_and_cache to properly
work with CUDA graph padding"), fixing https://github.com/vllm-project/vllm/issues/13418 ("[Bug][v1][rocm]
cuda graph gets stuck in case padding is used to meet a captured input size").
Symptom: V1 on MI300X with piecewise CUDA graphs hangs (or hits an illegal memory access) on the first
step whose token count is not a captured size and is padded up to one; no padding, no problem (vLLM
V1, Feb 2025).
Mechanism: under piecewise graphs the model runs at the padded token count, and attention runs eagerly
between the pieces. The ROCm backend passes the whole padded ``key``/``value`` to
``PagedAttention.write_to_paged_cache`` together with ``attn_metadata.slot_mapping``, which holds one
slot per real token only. The ``reshape_and_cache`` kernel launched one block per ``key.size(0)`` token
and each read ``slot_mapping[token_idx]``: the padded tokens read past the end of the slot mapping and
wrote the cache at garbage slots. (``reshape_and_cache_flash`` already used ``slot_mapping.size(0)``.)
Doctor: padded-shape-mismatch, at ``reshape_and_cache`` (the slot lookup that combines the padded key
with the real-count slot mapping).
Fix (upstream): ``reshape_and_cache`` takes ``num_tokens = slot_mapping.size(0)``, so only real tokens are
written.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/13922"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "reshape_and_cache"
SYMPTOM = "hang / illegal memory access on padded piecewise steps: the cache write reads past slot_mapping"

VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_CTX = 12, 4, 2, 6, 6
CAPTURE_SIZES = [2, 4]
PAD_SLOT_ID = -1


class AttentionMetadata:
    def __init__(self, num_actual_tokens, slot_mapping, ctx_slots, ctx_lens):
        self.num_actual_tokens = num_actual_tokens
        self.slot_mapping = slot_mapping          # [num_actual_tokens]
        self.ctx_slots = ctx_slots                # [num_actual_tokens, MAX_CTX] cache slots each token attends to
        self.ctx_lens = ctx_lens                  # [num_actual_tokens]


class ForwardContext:
    attn_metadata: AttentionMetadata | None = None


_forward_context = ForwardContext()


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, fixed: bool):
    """csrc/cache_kernels.cu: one thread block per token, each reads its slot and copies its key/value."""
    num_tokens = slot_mapping.size(0) if fixed else key.size(0)
    token_idx = torch.arange(num_tokens, device=key.device)
    slot_idx = slot_mapping[token_idx]                        # slot_mapping[token_idx] in the kernel
    write = slot_idx >= 0                                     # padding slots (-1) are skipped
    key_cache[slot_idx[write]] = key[:num_tokens][write]
    value_cache[slot_idx[write]] = value[:num_tokens][write]


def chunked_prefill_paged_decode(query, key_cache, value_cache, attn_metadata, output):
    k = key_cache[attn_metadata.ctx_slots]
    v = value_cache[attn_metadata.ctx_slots]
    scores = (query[:, None, :] * k).sum(-1) / DIM ** 0.5
    mask = torch.arange(MAX_CTX, device=query.device)[None, :] >= attn_metadata.ctx_lens[:, None]
    output.copy_((torch.softmax(scores.masked_fill(mask, float("-inf")), -1)[..., None] * v).sum(1))


class ROCmAttentionImpl:
    def __init__(self, kv_cache, fixed: bool):
        self.key_cache, self.value_cache = kv_cache
        self.fixed = fixed

    def forward(self, query, key, value, attn_metadata, output):
        num_actual_tokens = attn_metadata.num_actual_tokens
        # Reshape the input keys and values and store them in the cache (the whole, padded key).
        reshape_and_cache(key, value, self.key_cache, self.value_cache, attn_metadata.slot_mapping, self.fixed)
        chunked_prefill_paged_decode(query[:num_actual_tokens], self.key_cache, self.value_cache, attn_metadata,
                                     output[:num_actual_tokens])
        return output


class GPUModelRunner:
    def __init__(self, device, fixed: bool, enforce_eager: bool):
        gen = generator(13922)
        self.device = device
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(16, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(4))
        self.kv_cache = (torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device),
                         torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device))
        self.impl = ROCmAttentionImpl(self.kv_cache, fixed)
        self.input_ids = torch.zeros(max(CAPTURE_SIZES), dtype=torch.int64, device=device)
        self.positions = torch.zeros(max(CAPTURE_SIZES), dtype=torch.int64, device=device)
        mode = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.PIECEWISE
        self.manager = GraphManager(self.forward, CAPTURE_SIZES, device=device, mode=mode,
                                    static_buffers={"input_ids": self.input_ids, "positions": self.positions},
                                    name="GPUModelRunner")
        self.unified_attention = self.manager.eager(self._unified_attention)    # the splitting op

    def _unified_attention(self, query, key, value):
        output = torch.zeros_like(query)
        attn_metadata = _forward_context.attn_metadata
        if attn_metadata is None:                 # profiling / capture dummy run: no attention
            return output
        return self.impl.forward(query, key, value, attn_metadata, output)

    def forward(self, num_tokens: int):
        h = self.emb[self.input_ids[:num_tokens]] + self.pos_emb[self.positions[:num_tokens]]
        attn = self.unified_attention(h @ self.wq, h @ self.wk, h @ self.wv)
        return h + attn @ self.wo

    def capture_model(self):
        events.persistent_state("GPUModelRunner", {"key_cache": self.kv_cache[0], "value_cache": self.kv_cache[1]})
        self.manager.capture()

    def execute_model(self, ids, positions, attn_metadata):
        n = ids.shape[0]
        self.input_ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        size = self.manager.dispatch(n)           # pad up to a captured size (None: eager)
        _forward_context.attn_metadata = attn_metadata
        try:
            if size is None:
                return self.manager.run_eager(n)[:n].clone()
            return self.manager.replay(size, n, padded={"input_ids": self.input_ids[:size],
                                                        "positions": self.positions[:size]}).clone()
        finally:
            _forward_context.attn_metadata = None


def schedule(device):
    """Flattened V1 steps: (input_ids, positions, per-token (request, position)). A (blocks 1,2,3) prefills
    4 tokens; then A decodes while B (blocks 4,5) prefills 2 (3 tokens, padded to 4); then both decode."""
    blocks = {"A": [1, 2, 3], "B": [4, 5]}
    steps = [[("A", 0, 3), ("A", 1, 7), ("A", 2, 1), ("A", 3, 8)],
             [("A", 4, 5), ("B", 0, 2), ("B", 1, 9)],
             [("A", 5, 6), ("B", 2, 4)]]
    out = []
    for step in steps:
        ids = torch.tensor([t for _, _, t in step], device=device)
        pos = torch.tensor([p for _, p, _ in step], device=device)
        slots = torch.tensor([blocks[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for r, p, _ in step],
                             device=device)
        ctx = torch.tensor([[blocks[r][min(c, p) // BLOCK_SIZE] * BLOCK_SIZE + min(c, p) % BLOCK_SIZE
                             for c in range(MAX_CTX)] for r, p, _ in step], device=device)
        lens = torch.tensor([p + 1 for _, p, _ in step], device=device)
        out.append((ids, pos, AttentionMetadata(len(step), slots, ctx, lens)))
    return out


def run(variant: str, device: str = "cpu"):
    fixed = variant == "fix"

    def serve(enforce_eager: bool):
        runner = GPUModelRunner(device, fixed, enforce_eager)
        runner.capture_model()
        return [runner.execute_model(ids, pos, md) for ids, pos, md in schedule(device)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
