"""A second ``generate()`` replays the decode graph that is still bound to the first call's KV cache.

Upstream: https://github.com/Zyphra/Zonos/commit/ee4d758d2ab4bca24f9f43c77a2efad78c33e86e ("Don't cache
cuda graphs between runs"), a direct commit on ``main`` that follows 38fcfe9 ("Cuda graphs for
_decode_one_token"). There is no pull request; the diff was read, along with the parent's
``zonos/model.py``.
Symptom: nothing was reported in an issue. The commit's comment says "reset cuda graph to avoid cache
changes". What follows from the code: when a ``Zonos`` model generates twice with the same batch size,
the second and later generations decode against the first generation's KV cache. Their audio
codes continue the old utterance, or are garbage, instead of following the new prefix.
Mechanism: ``Zonos._decode_one_token`` captures one CUDA graph when ``self._cg_graph is None or
self._cg_batch_size != bsz``. At capture it stores ``self._cg_inference_params = inference_params`` (and
``self._cg_scale = cfg_scale``). After 3 warmups it captures ``embed_codes(self._cg_input_ids)`` and
``_compute_logits(hidden, self._cg_inference_params, self._cg_scale)``. The captured attention kernels
(mamba_ssm ``MHA`` through ``flash_attn_with_kvcache``) write and read that object's
``key_value_memory_dict`` tensors at its ``lengths_per_sample``. Later calls only do
``self._cg_input_ids.copy_(input_ids); self._cg_graph.replay()``. But ``generate()`` calls
``setup_cache`` on every call, which builds a new ``InferenceParams`` with new cache tensors, and
``_prefill`` fills those. The graph is keyed on the batch size only, so the second ``generate()``
replays a graph whose kernels use the first call's cache and lengths. The first call's
``InferenceParams`` is still alive, held by ``self._cg_inference_params``, so nothing faults. The
logits come from the old utterance's context, and the new cache is never written. Eager decode uses
the ``inference_params`` it was given.
Doctor: warmup-divergence, at ``_decode_one_token``. The capture bound the cache object, and replays
reuse it while an eager step uses the new call's cache.
Fix (upstream): ``self._cg_graph = None`` at the end of ``generate()``, so each call re-captures
against its own cache (and its own ``cfg_scale``).

Modelled: the attention path of the backbone. These are mamba_ssm ``MHA`` blocks; per the README,
Zonos-v0.1-transformer has a transformer backbone. Their decode cache write lands at
``lengths_per_sample``, so the 3 warmups rewrite one slot. The hybrid model's Mamba2 layers are left out: there the warmups advance the SSM
state, which is a separate issue that the commit does not touch. The program also leaves out the
codebook delay pattern, rotary embeddings and the MLPs. Sampling is greedy instead of ``min_p``.
``cfg_scale`` is the default 2.0 in both calls, so only the cache binding differs.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Zyphra/Zonos/commit/ee4d758d2ab4bca24f9f43c77a2efad78c33e86e"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_decode_one_token"
SYMPTOM = "a second generate() with the same batch size decodes against the first call's KV cache"

N_CODEBOOKS, VOCAB, D_MODEL, N_LAYER = 2, 10, 8, 2
MASKED_TOKEN_ID = VOCAB - 1            # the delay pattern's start frame (1025 upstream)
COND_LEN, MAX_NEW_TOKENS = 3, 4


@dataclasses.dataclass
class InferenceParams:                 # mamba_ssm.utils.generation.InferenceParams
    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int
    batch_size_offset: int
    key_value_memory_dict: dict
    lengths_per_sample: torch.Tensor


def flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, positions):
    """Write ``k``/``v`` (one token a row) at ``cache_seqlens`` in place, then attend over ``[0, len]``."""
    at = (positions[None, :] == cache_seqlens[:, None].long())[:, :, None]          # [B, S, 1]
    k_cache.copy_(torch.where(at, k, k_cache))
    v_cache.copy_(torch.where(at, v, v_cache))
    scores = (k_cache @ q[:, 0, :, None]).squeeze(-1) / D_MODEL ** 0.5             # [B, S]
    scores = scores.masked_fill(positions[None, :] > cache_seqlens[:, None].long(), float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * v_cache).sum(1, keepdim=True)   # [B, 1, D]


class MHA:
    """mamba_ssm ``MHA`` with its inference cache (kv packed as ``[B, S, 2, D]``)."""

    def __init__(self, layer_idx, gen, device):
        self.layer_idx = layer_idx
        self.in_proj = randn(D_MODEL, 3 * D_MODEL, gen=gen, device=device, scale=0.5)
        self.out_proj = randn(D_MODEL, D_MODEL, gen=gen, device=device, scale=0.5)
        self.device = device

    def allocate_inference_cache(self, batch_size, max_seqlen):
        return torch.zeros(batch_size, max_seqlen, 2, D_MODEL, device=self.device)

    def forward(self, x, inference_params, positions):
        q, k, v = (x @ self.in_proj).split(D_MODEL, dim=-1)
        kv_cache = inference_params.key_value_memory_dict[self.layer_idx]
        if inference_params.seqlen_offset == 0:
            # Prefill: _update_kv_cache writes [0, L), then causal attention over the prompt.
            length = x.shape[1]
            kv_cache[:, :length, 0] = k
            kv_cache[:, :length, 1] = v
            scores = (q @ k.transpose(1, 2)) / D_MODEL ** 0.5
            causal = positions[:length, None] < positions[None, :length]
            ctx = torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ v
        else:
            ctx = flash_attn_with_kvcache(q, kv_cache[:, :, 0], kv_cache[:, :, 1], k, v,
                                          inference_params.lengths_per_sample, positions)
        return ctx @ self.out_proj


class ZonosBackbone:
    def __init__(self, gen, device, max_seqlen):
        self.layers = [MHA(i, gen, device) for i in range(N_LAYER)]
        self.positions = torch.arange(max_seqlen, device=device)

    def forward(self, hidden_states, inference_params):
        for layer in self.layers:
            hidden_states = hidden_states + layer.forward(hidden_states, inference_params, self.positions)
        return torch.nn.functional.layer_norm(hidden_states, (D_MODEL,))


class Zonos:
    def __init__(self, device, variant, max_seqlen):
        gen = generator(4758)
        self.device, self.variant = device, variant
        self.backbone = ZonosBackbone(gen, device, max_seqlen)
        self.embeddings = [randn(VOCAB, D_MODEL, gen=gen, device=device) for _ in range(N_CODEBOOKS)]
        self.heads = [randn(D_MODEL, VOCAB, gen=gen, device=device) for _ in range(N_CODEBOOKS)]
        self._cg_graph = None
        self._cg_batch_size = None
        self._cg_input_ids = None
        self._cg_logits = None
        self._cg_inference_params = None
        self._cg_scale = None

    def embed_codes(self, codes):
        return sum(emb[codes[:, i]] for i, emb in enumerate(self.embeddings))

    def apply_heads(self, hidden_states):
        return torch.stack([hidden_states @ head for head in self.heads], dim=1)

    def _compute_logits(self, hidden_states, inference_params, cfg_scale):
        last_hidden_states = self.backbone.forward(hidden_states, inference_params)[:, -1, :].unsqueeze(1)
        logits = self.apply_heads(last_hidden_states).squeeze(2).float()
        if cfg_scale != 1.0:
            cond_logits, uncond_logits = logits.chunk(2)
            logits = uncond_logits + (cond_logits - uncond_logits) * cfg_scale
        return logits

    def _decode_one_token(self, input_ids, inference_params, cfg_scale, allow_cudagraphs=True):
        if not allow_cudagraphs:
            hidden_states_local = self.embed_codes(input_ids).repeat(2, 1, 1)
            return self._compute_logits(hidden_states_local, inference_params, cfg_scale)

        bsz = input_ids.size(0)
        need_capture = (self._cg_graph is None) or (self._cg_batch_size != bsz)
        if need_capture:
            self._cg_graph = None
            self._cg_batch_size = bsz
            self._cg_inference_params = inference_params      # the graph binds this call's cache
            self._cg_scale = cfg_scale
            self._cg_input_ids = input_ids.clone()

            def capture_region():
                hidden_states_local = self.embed_codes(self._cg_input_ids)
                hidden_states_local = hidden_states_local.repeat(2, 1, 1)
                return self._compute_logits(hidden_states_local, self._cg_inference_params, self._cg_scale)

            cache = self._cg_inference_params.key_value_memory_dict
            self._cg_graph, self._cg_logits = capture(
                capture_region, device=self.device, warmups=3, owner="Zonos._decode_one_token",
                static={"_cg_input_ids": self._cg_input_ids},
                state={**{f"kv_cache[{i}]": kv for i, kv in cache.items()},
                       "lengths_per_sample": self._cg_inference_params.lengths_per_sample})
        else:
            self._cg_input_ids.copy_(input_ids)
        return replay(self._cg_graph, self._cg_logits)

    def _prefill(self, prefix_hidden_states, input_ids, inference_params, cfg_scale):
        if cfg_scale != 1.0:
            input_ids = input_ids.expand(prefix_hidden_states.shape[0], -1, -1)
        hidden_states = torch.cat([prefix_hidden_states, self.embed_codes(input_ids)], dim=1)
        return self._compute_logits(hidden_states, inference_params, cfg_scale)

    def setup_cache(self, batch_size, max_seqlen):
        key_value_memory_dict = {i: layer.allocate_inference_cache(batch_size, max_seqlen)
                                 for i, layer in enumerate(self.backbone.layers)}
        lengths_per_sample = torch.full((batch_size,), 0, dtype=torch.int32, device=self.device)
        return InferenceParams(max_seqlen, batch_size, 0, 0, key_value_memory_dict, lengths_per_sample)

    def generate(self, prefix_conditioning, max_new_tokens=MAX_NEW_TOKENS, cfg_scale=2.0, batch_size=1,
                 allow_cudagraphs=True):
        seq_len = prefix_conditioning.shape[1] + 1 + max_new_tokens
        inference_params = self.setup_cache(batch_size=batch_size * 2, max_seqlen=seq_len)
        frame = torch.full((batch_size, N_CODEBOOKS, 1), MASKED_TOKEN_ID, dtype=torch.long, device=self.device)

        logits = self._prefill(prefix_conditioning, frame, inference_params, cfg_scale)
        outs = [logits.clone()]
        next_token = logits.argmax(-1)                                   # greedy stand-in for min_p
        prefix_length = prefix_conditioning.shape[1] + 1
        inference_params.seqlen_offset += prefix_length
        inference_params.lengths_per_sample[:] += prefix_length

        for _ in range(max_new_tokens):
            input_ids = next_token.unsqueeze(-1)                         # [bsz, codebooks, 1]
            logits = self._decode_one_token(input_ids, inference_params, cfg_scale, allow_cudagraphs)
            outs.append(logits.clone())
            next_token = logits.argmax(-1)
            inference_params.seqlen_offset += 1
            inference_params.lengths_per_sample[:] += 1

        if self.variant == "fix":
            self._cg_graph = None  # reset cuda graph to avoid cache changes
        return outs


def run(variant: str, device: str = "cpu"):
    gen = generator(758)
    prompts = [randn(2, COND_LEN, D_MODEL, gen=gen, device=device) for _ in range(3)]   # cond + uncond

    def serve(allow_cudagraphs: bool):
        model = Zonos(device, variant, COND_LEN + 1 + MAX_NEW_TOKENS)
        outs = []
        for prefix_conditioning in prompts:            # three utterances, one model, batch size 1
            outs += model.generate(prefix_conditioning, allow_cudagraphs=allow_cudagraphs)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
