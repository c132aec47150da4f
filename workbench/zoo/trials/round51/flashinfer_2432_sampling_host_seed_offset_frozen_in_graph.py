"""A FlashInfer sampler inside a CUDA graph keeps the host seed/offset it got at capture, so every replay draws the same uniforms.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/2432 ("fix: Sampling: CUDA Graph fix", commit c5b8a2e0e).
Symptom: a decode step captured with ``top_p_sampling_from_probs`` (or any FlashInfer sampling op) samples
every replay with the capture's random numbers: the per-step fresh randomness of eager decoding is lost
and the sampled tokens differ from eager's (repeated patterns, effectively deterministic decoding).
Mechanism: before the fix the sampling wrappers in ``flashinfer/sampling.py`` took ``seed``/``offset`` only
as Python ints (or read them on the host from the generator with ``get_seed_and_offset``) and passed them
by value (``uint64_t philox_seed, uint64_t philox_offset``) to ``TopPSamplingFromProb``. The serving step
advances its philox offset on the host each step and calls the sampler inside the captured region: at
capture that Python ran once and the kernel node keeps the capture's ``(seed, offset)``; replays re-run
only the kernels, so each one draws the same uniforms while eager advances the offset every step.
Doctor: host-work-frozen, at ``top_p_sampling_from_probs`` (it hands the host seed/offset by value to the
captured kernel, so their capture-time values are baked into every replay).
Fix (upstream): every sampling op accepts ``seed``/``offset`` as ``Union[int, torch.Tensor]``;
``_validate_and_convert_seed_offset`` returns ``(maybe_seed_arr, seed_val, maybe_offset_arr, offset_val)``
and the kernel resolves ``philox_seed = seed_arr ? seed_arr[0] : seed_val`` (same for the offset) on the
device. "Using torch.Tensor is required for CUDA graph compatibility": the caller keeps device seed/offset
tensors and updates them in place between replays.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/2432"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "top_p_sampling_from_probs"
SYMPTOM = "graphed FlashInfer top-p sampling reuses the capture's philox seed/offset at every replay"
VOCAB, HIDDEN, BATCH, STEPS = 16, 8, 4, 6


class PhiloxState:
    """The caller's philox ``(seed, offset)`` on the host, advanced per sampling call as
    ``get_seed_and_offset`` does: ``offset += (increment + 3) // 4 * 4``."""

    def __init__(self, seed: int) -> None:
        self.seed, self.offset = seed, 0

    def advance(self, increment: int) -> tuple[int, int]:
        seed, offset = self.seed, self.offset
        self.offset += (increment + 3) // 4 * 4
        return seed, offset


def _to_tensor_scalar_tuple(x):
    return (x, 0) if isinstance(x, torch.Tensor) else (None, int(x))


def _validate_and_convert_seed_offset(seed, offset, device, batch_size):
    """``(maybe_seed_arr, seed_val, maybe_offset_arr, offset_val)``, as the fixed ``sampling.py`` builds it."""
    if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
        raise ValueError("seed and offset must both be tensors or both be scalars")
    maybe_seed_arr, seed_val = _to_tensor_scalar_tuple(seed)
    maybe_offset_arr, offset_val = _to_tensor_scalar_tuple(offset)
    for arr in (maybe_seed_arr, maybe_offset_arr):
        if arr is not None and (arr.device != device or arr.dim() != 1 or arr.numel() not in (1, batch_size)):
            raise ValueError("seed/offset tensors must be 1D on the probs' device, of length 1 or batch_size")
    return maybe_seed_arr, seed_val, maybe_offset_arr, offset_val


def philox_uniform(philox_seed, philox_offset, n, device):
    """The kernel's counter-based uniforms for ``n`` rows: a host number is a kernel argument (by value),
    a tensor is read on the device at launch."""
    r = torch.arange(n, device=device, dtype=torch.float64)
    x = torch.sin((r + philox_offset) * 12.9898 + philox_seed * 78.233) * 43758.5453
    return x - torch.floor(x)


def TopPSamplingFromProb(probs, top_p, maybe_seed_arr, seed_val, maybe_offset_arr, offset_val):
    """``include/flashinfer/sampling.cuh``: resolve the philox seed/offset, then invert the top-p CDF."""
    philox_seed = maybe_seed_arr[0].double() if maybe_seed_arr is not None else seed_val
    philox_offset = maybe_offset_arr[0].double() if maybe_offset_arr is not None else offset_val
    u = philox_uniform(philox_seed, philox_offset, probs.shape[0], probs.device)
    sorted_probs, sorted_idx = probs.double().sort(dim=-1, descending=True)
    keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p.double().unsqueeze(1)
    kept = sorted_probs * keep
    cdf = (kept / kept.sum(-1, keepdim=True)).cumsum(-1)
    pick = (cdf < u.unsqueeze(1)).sum(-1).clamp(max=probs.shape[-1] - 1)
    return sorted_idx.gather(1, pick.unsqueeze(1)).squeeze(1)


def top_p_sampling_from_probs(probs, top_p, *, seed, offset):
    """``flashinfer.sampling.top_p_sampling_from_probs``: ints go to the kernel by value (frozen in a
    graph); tensors are read by the kernel at every launch (the fix)."""
    args = _validate_and_convert_seed_offset(seed, offset, probs.device, probs.shape[0])
    return TopPSamplingFromProb(probs, top_p, *args)


class TinyLM:
    def __init__(self, device):
        gen = generator(2432)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.3)

    def __call__(self, input_ids):
        return torch.tanh(self.embed[input_ids] @ self.w) @ self.lm_head


class Sampler:
    """The serving step's sampler: one philox draw per request per step."""

    def __init__(self, device, variant):
        self.variant = variant
        self.rng = PhiloxState(seed=1234)
        self.top_p = torch.tensor([0.9, 0.95, 0.8, 1.0], device=device)
        # the fix: device seed/offset the kernel reads at launch, refreshed by the caller between replays
        self.seed_arr = torch.full((1,), self.rng.seed, dtype=torch.int64, device=device)
        self.offset_arr = torch.zeros(1, dtype=torch.int64, device=device)

    def refresh(self):
        """Between replays (fix): advance the host state and write it into the device tensors."""
        _, offset = self.rng.advance(BATCH)
        self.offset_arr.fill_(offset)

    def __call__(self, logits, graphed):
        probs = torch.softmax(logits, dim=-1)
        if graphed and self.variant == "fix":
            return top_p_sampling_from_probs(probs, self.top_p, seed=self.seed_arr, offset=self.offset_arr)
        seed, offset = self.rng.advance(BATCH)          # host ints: by value into the kernel
        return top_p_sampling_from_probs(probs, self.top_p, seed=seed, offset=offset)


def run(variant: str, device: str = "cpu"):
    model = TinyLM(device)
    first_tokens = [1, 5, 9, 13]

    def eager():
        sampler = Sampler(device, variant)
        input_ids = torch.tensor(first_tokens, device=device)
        outs = []
        for _ in range(STEPS):
            input_ids = sampler(model(input_ids), graphed=False)
            outs.append(input_ids.clone())
        return outs

    def served():
        sampler = Sampler(device, variant)
        input_ids = torch.tensor(first_tokens, device=device)        # the decode graph's static input

        def decode_step():
            return sampler(model(input_ids), graphed=True)

        state = {"seed_arr": sampler.seed_arr, "offset_arr": sampler.offset_arr} if variant == "fix" else None
        g, tokens = capture(decode_step, device=device, static={"input_ids": input_ids}, state=state,
                            owner="decode runner", name="decode + top_p sampling")
        outs = []
        for _ in range(STEPS):
            if variant == "fix":
                sampler.refresh()
            new_tokens = replay(g, tokens)
            outs.append(new_tokens.clone())
            input_ids.copy_(new_tokens)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
