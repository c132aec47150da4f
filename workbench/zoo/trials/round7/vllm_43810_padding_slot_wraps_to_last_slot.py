"""Padded tokens' ``PADDING_SLOT_ID = -1`` is used as a Python index and overwrites the last cache slot.

Upstream: https://github.com/vllm-project/vllm/issues/43810 ("[Bug]: extract_hidden_states CUDA graph padding
writes PADDING_SLOT_ID=-1 into last hidden-state KV slot", closed). On main ``basic_cache`` now clamps padding
slots to the null block; vllm#43869 proposed the same fix through ``reshape_and_cache_flash``, and vllm#46301
lists "ignore padding slots (slot_mapping < 0) when caching" (which PR landed the clamp was not verified).
Symptom: with ``speculative_config={"method": "extract_hidden_states"}`` and CUDA graphs, the saved hidden
states of the request whose prompt ends in the last block of the hidden-state cache have a wrong last row;
with ``enforce_eager`` they match the reference (vLLM V1, May 2026).
Mechanism: the runner pads each step's tokens up to a captured size and gives the padded tokens
``PADDING_SLOT_ID = -1``, which vLLM's CUDA cache kernels skip. The extraction model's cache-only layer writes
with plain PyTorch indexing, ``kv_cache[slot_mapping // block_size, :, slot_mapping % block_size] = to_cache``,
where ``-1 // block_size`` is the last block and ``-1 % block_size`` its last position. Every padded token
stores its hidden states in the cache's last slot, over the token of the request that owns it.
Doctor: stale-padding, at ``basic_cache`` (the scatter through the padded rows' slot mapping).
Fix (upstream): ``basic_cache`` does ``slot_mapping = slot_mapping.clamp_min(0)`` first: padding slots are
redirected to the null block 0, which is never allocated to a request, and the scatter stays branch-free
and sync-free.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/issues/43810"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "basic_cache"
SYMPTOM = "the request owning the last cache slot gets a padded token's hidden state as its last row"

VOCAB, HIDDEN, NUM_HIDDEN_STATES = 16, 4, 2      # aux hidden states of two target layers per token
BLOCK_SIZE, NUM_BLOCKS = 2, 6                    # block 0: null block
CAPTURE_SIZES = [4, 8, 16]
MAX_TOKENS = max(CAPTURE_SIZES)
PADDING_SLOT_ID = -1
LAYER = "model.cache_only_layers.2"


class ForwardContext:
    slot_mapping: dict | None = None


_forward_context = ForwardContext()


def basic_cache(to_cache, kv_cache, slot_mapping, fixed: bool):
    # to_cache: [seq_len, num_heads, head_size]; kv_cache: [num_blocks, num_heads, block_size, head_size]
    block_size = kv_cache.shape[2]
    if fixed:
        # Padding slots are -1; redirect them to the null block (block 0, never allocated to a request).
        slot_mapping = slot_mapping.clamp_min(0)
    kv_cache[slot_mapping // block_size, :, slot_mapping % block_size] = to_cache


class CacheOnlyAttentionImpl:
    def __init__(self, fixed: bool):
        self.fixed = fixed

    def do_kv_cache_update(self, to_cache, kv_cache, slot_mapping):
        basic_cache(to_cache, kv_cache, slot_mapping, self.fixed)


class CacheOnlyAttentionLayer:
    def __init__(self, kv_cache, fixed: bool):
        self.kv_cache = kv_cache
        self.impl = CacheOnlyAttentionImpl(fixed)

    def forward(self, to_cache):
        layer_slot_mapping = _forward_context.slot_mapping.get(LAYER)        # unified_kv_cache_update
        if layer_slot_mapping is not None:
            self.impl.do_kv_cache_update(to_cache, self.kv_cache, layer_slot_mapping)
        return torch.empty(0, device=to_cache.device, dtype=to_cache.dtype)


class TargetModel:
    """Returns the final hidden states and the aux hidden states of two layers (eagle_aux_hidden_state_layer_ids)."""

    def __init__(self, device):
        gen = generator(43810)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(MAX_TOKENS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w1, self.w2 = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.8) for _ in range(2))

    def __call__(self, input_ids, positions):
        h0 = self.embed_tokens[input_ids] + self.pos[positions]
        h1 = torch.tanh(h0 @ self.w1) + h0
        h2 = torch.tanh(h1 @ self.w2) + h1
        return h2, torch.stack([h1, h2], dim=1)          # [tokens, NUM_HIDDEN_STATES, HIDDEN]


class GPUModelRunner:
    def __init__(self, device, fixed: bool, enforce_eager: bool):
        self.device = device
        self.model = TargetModel(device)
        # the hidden-state "KV cache" of the extraction model's cache-only layer
        self.kv_cache = torch.zeros(NUM_BLOCKS, NUM_HIDDEN_STATES, BLOCK_SIZE, HIDDEN, device=device)
        self.cache_only_layer = CacheOnlyAttentionLayer(self.kv_cache, fixed)
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((MAX_TOKENS,), PADDING_SLOT_ID, dtype=torch.int64, device=device)
        mode = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.FULL
        self.manager = GraphManager(self.forward, CAPTURE_SIZES, device=device, mode=mode,
                                    static_buffers={"input_ids": self.input_ids, "positions": self.positions,
                                                    "slot_mapping": self.slot_mapping},
                                    name="GPUModelRunner")

    def forward(self, num_tokens: int):
        """One step: the target forward, then the extraction model caches the aux hidden states
        (ExtractHiddenStatesModel.forward -> CacheOnlyAttentionLayer)."""
        _forward_context.slot_mapping = {LAYER: self.slot_mapping[:num_tokens]}
        try:
            hidden_states, aux_hidden_states = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])
            self.cache_only_layer.forward(aux_hidden_states)
        finally:
            _forward_context.slot_mapping = None
        return hidden_states

    def capture_model(self):
        events.persistent_state("GPUModelRunner", {"hidden_state_cache": self.kv_cache})
        self.manager.capture()

    def execute_model(self, token_ids, positions, slots):
        n = len(token_ids)
        size = self.manager.dispatch(n)
        self.input_ids[:n] = torch.tensor(token_ids, device=self.device)
        self.positions[:n] = torch.tensor(positions, device=self.device)
        self.slot_mapping[:n] = torch.tensor(slots, device=self.device)
        if size is None:
            return self.manager.run_eager(n)[:n].clone()
        # padded tokens: token 0 at position 0, PADDING_SLOT_ID (the cache kernels skip it)
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0
        self.slot_mapping[n:size] = PADDING_SLOT_ID
        return self.manager.replay(size, n).clone()

    def save_hidden_states(self, block_ids, num_tokens):
        """ExampleHiddenStatesConnector: the request's hidden states, read back from its blocks."""
        blocks = self.kv_cache[torch.tensor(block_ids, device=self.device)]      # [blocks, heads, bs, hidden]
        return blocks.permute(0, 2, 1, 3).reshape(-1, NUM_HIDDEN_STATES, HIDDEN)[:num_tokens].clone()


def schedule():
    """Prefill-only extraction requests (max_tokens=1): (prompt, blocks). Step 1 runs R0 and R1 (10 tokens,
    padded to 16); R1's prompt ends in the last slot of the cache (block 5, offset 1). Step 2 reuses the
    freed blocks for R2 and R3 (4 tokens, a captured size)."""
    return [[([3, 7, 1, 9], [1, 2]), ([5, 2, 8, 4, 6, 11], [3, 4, 5])],
            [([12, 10, 13], [1, 2]), ([14], [3])]]


def run(variant: str, device: str = "cpu"):
    fixed = variant == "fix"

    def serve(enforce_eager: bool):
        runner = GPUModelRunner(device, fixed, enforce_eager)
        runner.capture_model()
        saved = []
        for step in schedule():
            ids, pos, slots = [], [], []
            for prompt, blocks in step:
                for p, tok in enumerate(prompt):
                    ids.append(tok)
                    pos.append(p)
                    slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            saved.append(runner.execute_model(ids, pos, slots))
            for prompt, blocks in step:                    # the requests finish: their hidden states are saved
                saved.append(runner.save_hidden_states(blocks, len(prompt)))
        return saved

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
