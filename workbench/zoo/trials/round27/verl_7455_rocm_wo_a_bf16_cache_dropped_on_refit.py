"""An RL weight refit drops the lazily built bf16 ``wo_a`` cache that the captured attention graph reads by address.

Upstream: https://github.com/verl-project/verl/pull/7455 ("[vllm] fix: preserve ROCm attention cache for CUDA
graphs"), a follow-up to https://github.com/verl-project/verl/pull/7050.
Symptom: ROCm DeepSeek-V4 rollouts in verl with CUDA/HIP graph replay enabled: after a weight refit the captured
attention graph reads the address of a ``_dsv4_wo_a_bf16`` cache that was deleted, i.e. freed memory (stale or
garbage output projections); eager mode is correct (verl, Aug 2026).
Mechanism: vLLM's ``rocm_aiter_mla_sparse._get_cached_wo_a_bf16`` dequantizes the FP8 ``wo_a`` weight once and
caches the bf16 copy on the module (``module._dsv4_wo_a_bf16``), assuming the weight is static. verl's
``process_quanted_weights_after_loading`` called ``clear_rocm_attention_weight_caches`` after every refit, which
``del``-eted the cache so that the next forward would rebuild it lazily. That is right in eager mode, but
``_o_proj`` ran during graph capture: the captured einsum holds the address of the first cache tensor and replays
never re-enter the builder. Dropping the module's only reference releases that storage while the graph still
reads it; eager forwards rebuild a fresh cache from the new weights, replays keep reading the released block.
Doctor: dangling-reference, at ``clear_rocm_attention_weight_caches`` (it releases the cache tensor the captured
attention graph reads).
Fix (upstream): ``refresh_rocm_attention_weight_caches`` rebuilds the cache after the FP8 parameters are back in
their inference layout, ``copy_()``-es the rebuilt value into the original tensor and reattaches that tensor, so
its address never changes; it runs last in ``process_quanted_weights_after_loading``.
(Read from the merged diff, verl commit 611a61cd.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/verl-project/verl/pull/7455"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "clear_rocm_attention_weight_caches"
SYMPTOM = "after an RL weight refit the attention graph reads a freed bf16 wo_a cache (stale/garbage o_proj)"

N_LOCAL_GROUPS, O_LORA_RANK, HIDDEN, TOKENS, STEPS = 2, 4, 6, 3, 3


class DeepseekV4Attention(torch.nn.Module):
    """Only the grouped output projection: ``wo_a`` is stored FP8-like (integer values) with a per-group scale."""

    def __init__(self, device):
        super().__init__()
        shape = (N_LOCAL_GROUPS, O_LORA_RANK, HIDDEN)
        self.wo_a = torch.nn.Parameter(torch.zeros(shape, device=device), requires_grad=False)
        self.wo_a_scale = torch.nn.Parameter(torch.zeros(N_LOCAL_GROUPS, 1, 1, device=device), requires_grad=False)


def _get_cached_wo_a_bf16(module, n_local_groups, o_lora_rank, hidden_dim):
    """vLLM's lazy builder: dequantize ``wo_a`` once and cache it on the module."""
    cached = getattr(module, "_dsv4_wo_a_bf16", None)
    if cached is None:
        cached = (module.wo_a * module.wo_a_scale).reshape(n_local_groups, o_lora_rank, hidden_dim).contiguous()
        module._dsv4_wo_a_bf16 = cached
    return cached


def _o_proj(module, o):
    """``o``: [tokens, groups, o_lora_rank] -> [tokens, hidden] through the cached bf16 ``wo_a``."""
    wo_a = _get_cached_wo_a_bf16(module, N_LOCAL_GROUPS, O_LORA_RANK, HIDDEN)
    return torch.einsum("tgr,grh->th", o, wo_a)


def load_weights(module, wo_a, wo_a_scale):
    """The refit: the new FP8 weights are copied into the live parameters."""
    module.wo_a.data.copy_(wo_a)
    module.wo_a_scale.data.copy_(wo_a_scale)


def clear_rocm_attention_weight_caches(model):
    """Before the fix: drop the cache and rely on the lazy rebuild (correct only in eager mode)."""
    for module in model.modules():
        if hasattr(module, "_dsv4_wo_a_bf16"):
            del module._dsv4_wo_a_bf16


def refresh_rocm_attention_weight_caches(model):
    """The fix: rebuild into the original storage, so a captured graph keeps reading the right address."""
    with torch.inference_mode():
        for module in model.modules():
            live = getattr(module, "_dsv4_wo_a_bf16", None)
            if live is None:
                continue
            n_local_groups, o_lora_rank, hidden_dim = live.shape
            del module._dsv4_wo_a_bf16
            rebuilt = _get_cached_wo_a_bf16(module, n_local_groups, o_lora_rank, hidden_dim)
            if rebuilt.data_ptr() != live.data_ptr():
                live.copy_(rebuilt)
            module._dsv4_wo_a_bf16 = live


def process_quanted_weights_after_loading(model, variant):
    if variant == "bug":
        clear_rocm_attention_weight_caches(model)
    # (apply_mxfp8_transformation_after_loading / process_fp8_weights_after_loading: nothing to do at this size)
    if variant == "fix":
        refresh_rocm_attention_weight_caches(model)     # last: reads wo_a in its inference layout


def run(variant: str, device: str = "cpu"):
    gen = generator(7455)
    refits = []
    for _ in range(STEPS):
        w = torch.round(randn(N_LOCAL_GROUPS, O_LORA_RANK, HIDDEN, gen=gen, device=device, scale=20.0))
        s = randn(N_LOCAL_GROUPS, 1, 1, gen=gen, device=device, scale=0.05).abs() + 0.01
        refits.append((w, s, randn(TOKENS, N_LOCAL_GROUPS, O_LORA_RANK, gen=gen, device=device)))

    def serve(graphed: bool):
        attn = DeepseekV4Attention(device)
        o = torch.zeros(TOKENS, N_LOCAL_GROUPS, O_LORA_RANK, device=device)
        outs = []
        with torch.inference_mode():
            for i, (w, s, o_step) in enumerate(refits):
                load_weights(attn, w, s)                    # initial load, then one refit per RL step
                if i > 0:
                    process_quanted_weights_after_loading(attn, variant)
                o.copy_(o_step)
                if not graphed:
                    outs.append(_o_proj(attn, o).clone())
                    continue
                if i == 0:                                  # vLLM captures once, after the first load
                    g, out = capture(lambda: _o_proj(attn, o), device=device, static={"o": o},
                                     owner="vLLM model runner (FULL graph)", on_freed="reuse")
                outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
