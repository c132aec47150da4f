"""A CUDA-graphed FlashInfer sampler keeps the philox seed/offset it read on the host at capture.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5791 ("Prevent FlashInfer sampling from running with
CUDA graphs", commit 650b783826).
Symptom: dynamic inference with ``sampling_backend='flashinfer'`` and local CUDA graphs samples every
decode step with the same random numbers: non-greedy generations repeat patterns and are not the
seeded, per-step-fresh samples the eager sampler gives (Megatron-LM main, July 2026).
Mechanism: ``FlashInferSampling`` wrapped ``sample_kernel`` in a ``CudaGraphManager`` (inline capture).
``flashinfer.sampling.top_k_top_p_sampling_from_probs(..., generator=self._rng)`` reads the generator's
philox ``(seed, offset)`` on the host and advances the host offset, then passes both to its kernel by
value. Inside the capture that host work ran once: the recorded kernel keeps the capture's offset, so
every replay draws the same uniforms, and the generator's offset no longer advances between steps.
Doctor: host-work-frozen, at ``top_k_top_p_sampling_from_probs`` (the host philox seed/offset taken
for the captured sampling kernel).
Fix (upstream): the FlashInfer sampler is never graphed (no ``CudaGraphManager`` on ``sample_kernel`` /
``sample_speculative``); it runs eagerly after the graphed forward, so the seeded generator advances its
offset normally every step.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5791"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "top_k_top_p_sampling_from_probs"
SYMPTOM = "graphed FlashInfer sampling replays the capture's random numbers at every decode step"
VOCAB, HIDDEN, NUM_REQS, STEPS = 8, 4, 2, 5


class Generator:
    """A CUDA ``torch.Generator``'s philox state as FlashInfer sees it: ``(seed, offset)`` on the host."""

    def __init__(self, seed):
        self.seed = seed
        self.offset = 0


def get_seed_and_offset(increment, generator):
    """``flashinfer.utils.get_seed_and_offset``: read the philox state on the host and advance it."""
    seed, offset = generator.seed, generator.offset
    generator.offset += (increment + 3) // 4 * 4
    return seed, offset


def philox_uniform(seed, offset, n, device):
    """The kernel's counter-based uniforms for ``n`` rows from ``(seed, offset)`` (passed by value)."""
    r = torch.arange(n, device=device, dtype=torch.float64)
    x = torch.sin((r + offset) * 12.9898 + seed * 78.233) * 43758.5453
    return x - torch.floor(x)


def top_k_top_p_sampling_from_probs(probs, top_k, top_p, generator):
    """``flashinfer.sampling``: rejection-free top-k/top-p sampling with the generator's philox state."""
    seed, offset = get_seed_and_offset(probs.shape[0] * 32, generator)   # host work: by value
    u = philox_uniform(seed, offset, probs.shape[0], probs.device)
    sorted_probs, sorted_idx = probs.double().sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    keep = ranks.unsqueeze(0) < top_k.unsqueeze(1)
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_p.double().unsqueeze(1)
    kept = sorted_probs * keep
    cdf = (kept / kept.sum(-1, keepdim=True)).cumsum(-1)
    pick = (cdf < u.unsqueeze(1)).sum(-1).clamp(max=probs.shape[-1] - 1)
    return sorted_idx.gather(1, pick.unsqueeze(1)).squeeze(1)


class GPUView:
    """``context.gpu_view``: the per-step device mirror of the active requests' sampling parameters."""

    def __init__(self, device):
        self.temperature = torch.tensor([1.0, 0.8], device=device)
        self.top_k = torch.tensor([0, 3], dtype=torch.long, device=device)
        self.top_p = torch.tensor([0.9, 0.0], device=device)


class DynamicInferenceContext:
    def __init__(self, device):
        self.gpu_view = GPUView(device)


class FlashInferSampling:
    """Fused FlashInfer sampling (``megatron/core/inference/sampling/flashinfer_sampling.py``)."""

    def __init__(self, vocab_size, rng):
        self._vocab_size = vocab_size
        self._rng = rng

    def sample_kernel(self, logits, n, context):
        gv = context.gpu_view
        temperature = gv.temperature[:n]
        top_k = gv.top_k[:n]
        top_p = gv.top_p[:n]
        # Clamp temperature to avoid division by 0.
        temperature = temperature.clamp(min=1e-6)
        scaled = logits[:n] / temperature.unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        # Sentinel values disable filtering: top_k=vocab_size keeps all tokens, top_p=1.0 the full mass.
        top_k_safe = top_k.masked_fill(top_k == 0, self._vocab_size)
        top_p_safe = top_p.masked_fill(top_p == 0.0, 1.0)
        output = torch.empty(n, device=logits.device, dtype=torch.int64)
        output.copy_(top_k_top_p_sampling_from_probs(probs, top_k_safe, top_p_safe, generator=self._rng))
        return output


class GPTModel:
    def __init__(self, device):
        gen = generator(5791)
        self.embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.output_layer = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def __call__(self, input_ids):
        h = torch.tanh(self.embedding[input_ids] @ self.w)
        return h @ self.output_layer                                       # last-token logits


def run(variant: str, device: str = "cpu"):
    model = GPTModel(device)
    prompt_last_tokens = [3, 5]

    def eager():
        context = DynamicInferenceContext(device)
        sampling = FlashInferSampling(VOCAB, Generator(seed=1234))
        input_ids = torch.tensor(prompt_last_tokens, device=device)
        outs = []
        for _ in range(STEPS):
            new_tokens = sampling.sample_kernel(model(input_ids), NUM_REQS, context)
            outs.append(new_tokens.clone())
            input_ids = new_tokens
        return outs

    def served():
        context = DynamicInferenceContext(device)
        sampling = FlashInferSampling(VOCAB, Generator(seed=1234))
        input_ids = torch.tensor(prompt_last_tokens, device=device)    # the decode graph's static input
        owner = "DynamicInferenceEngine (local CUDA graphs)"
        g_fwd, logits = capture(lambda: model(input_ids), device=device, static={"input_ids": input_ids},
                                owner=owner, name="decode forward")
        if variant == "bug":
            # CudaGraphManager(config, self, function_name="sample_kernel", inline_capture=True)
            logits_in = torch.zeros_like(logits)
            g_sample, sampled = capture(lambda: sampling.sample_kernel(logits_in, NUM_REQS, context),
                                        device=device, static={"logits": logits_in}, owner=owner,
                                        name="sample_kernel")
        outs = []
        for _ in range(STEPS):
            step_logits = replay(g_fwd, logits)
            if variant == "bug":
                logits_in.copy_(step_logits)
                new_tokens = replay(g_sample, sampled)
            else:
                new_tokens = sampling.sample_kernel(step_logits, NUM_REQS, context)   # eager, never graphed
            outs.append(new_tokens.clone())
            input_ids.copy_(new_tokens)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
