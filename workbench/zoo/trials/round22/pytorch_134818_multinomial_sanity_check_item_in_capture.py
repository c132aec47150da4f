"""``torch.multinomial`` checks its probabilities with ``.item()``: a sampler captured in a CUDA graph cannot record it.

Upstream: https://github.com/pytorch/pytorch/pull/134818 (the change to ``multinomial_out`` that made
``torch.multinomial`` capturable; https://github.com/pytorch/pytorch/pull/139897, "Remove multinomial from
cudagraph skip list", cites it: "Since #134818 we can run multinomial in cudagraph without error"), fixing
https://github.com/pytorch/pytorch/issues/134442 ("CUDA Graph caputre error with `torch.multinomial`").
Symptom: capturing a decode step whose sampler calls ``torch.multinomial(probs, 1, replacement=True)``
(or any ``replacement=False`` draw) failed: "CUDA error: operation failed due to a previous error during
capture" / "operation not permitted when stream is capturing" (torch 2.4), while ``num_samples=2,
replacement=True`` captured fine; Inductor kept ``aten.multinomial`` on its cudagraph skip list (#108105)
after the same error.
Mechanism: ATen's ``multinomial_out`` takes a fast path when ``!with_replacement || n_sample == 1`` (the
Gumbel trick: ``q ~ Exp(1)``, ``argmax(p / q)``). Before drawing, it sanity-checks ``self`` on the host:
``((self.max() < INFINITY) & (self.min() >= 0)).item()`` and ``(self.sum(1) == 0).sum().item()``, each
feeding a ``TORCH_CHECK``. ``.item()`` copies a device value to the host and waits for it: a host
synchronisation, which a capturing stream refuses, so the whole capture is invalidated. The slow path
(several samples with replacement) has no such check, which is why ``num_samples=2`` captured.
Doctor: sync-in-capture, at ``multinomial`` (the ``.item()`` reads of the sanity checks in its fast path).
Fix (upstream): the checks stay on the device: ``auto [self_min, self_max] = self.aminmax();`` then
``at::_assert_async(is_valid, "probability tensor contains either `inf`, `nan` or element < 0")`` and
``at::_assert_async(~zero_prob_condition, "invalid multinomial distribution (sum of probabilities <= 0)")``
with ``zero_prob_condition = (self.sum(1) == 0).any()``: device-side asserts a graph records.
(Read: the ``multinomial_out`` code before and after, from stored copies of ``Distributions.cpp``, and the
descriptions of #139897 and #134442; the diff of #134818 itself was not available. The ``Exp(1)`` draw that
ATen makes with the generator is an input here, drawn on the host per step, so that the graph and eager
sample from the same numbers.)
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/134818"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "multinomial"
SYMPTOM = "capturing a decode step that samples with torch.multinomial(probs, 1) fails during capture"
BATCH, HIDDEN, VOCAB, STEPS = 3, 4, 6, 4


def multinomial(probs, n_sample, with_replacement, exponential, variant):
    """ATen ``multinomial_out`` (the fast path: no replacement, or one sample). ``exponential`` holds
    the ``Exp(1)`` draws that ATen makes with ``at::empty_like(self).exponential_(1, gen)``."""
    if not with_replacement or n_sample == 1:
        # Sanity checks on `self`.
        if variant == "bug":
            is_valid = ((probs.max() < math.inf) & (probs.min() >= 0)).item()
            if not is_valid:
                raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
            zero_prob_condition = bool((probs.sum(1) == 0).sum().item())
            if zero_prob_condition:
                raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        else:
            self_min, self_max = probs.aminmax()
            is_valid = (self_max < math.inf) & (self_min >= 0)
            torch._assert_async(is_valid, "probability tensor contains either `inf`, `nan` or element < 0")
            zero_prob_condition = (probs.sum(1) == 0).any()
            torch._assert_async(~zero_prob_condition, "invalid multinomial distribution (sum of probabilities <= 0)")
        # s = argmax( p / q ) where q ~ Exp(1)
        q = exponential.clone()
        torch.div(probs, q, out=q)
        if n_sample == 1:
            return torch.argmax(q, dim=-1, keepdim=True)
        return torch.topk(q, n_sample, dim=-1).indices
    raise NotImplementedError("the slow path (several samples with replacement) is not modelled")


class Sampler:
    """The decode step's head and sampler: logits, temperature, softmax, ``torch.multinomial(probs, 1)``."""

    def __init__(self, device, variant):
        gen = generator(134818)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8)
        self.variant = variant

    def forward(self, hidden, temperatures, exponential):
        logits = (hidden @ self.lm_head) / temperatures[:, None]
        probs = torch.softmax(logits, dim=-1)
        next_token_ids = multinomial(probs, 1, True, exponential, self.variant)
        return next_token_ids, probs


def run(variant: str, device: str = "cpu"):
    gen = generator(134442)
    steps = [(randn(BATCH, HIDDEN, gen=gen, device=device),
              (torch.rand(BATCH, generator=gen) * 0.8 + 0.4).to(device),
              (-torch.rand(BATCH, VOCAB, generator=gen).clamp_min(1e-6).log()).to(device))
             for _ in range(STEPS)]

    def served():
        sampler = Sampler(device, variant)
        hidden = torch.zeros(BATCH, HIDDEN, device=device)
        temperatures = torch.ones(BATCH, device=device)
        exponential = torch.ones(BATCH, VOCAB, device=device)
        hidden.copy_(steps[0][0])
        temperatures.copy_(steps[0][1])
        exponential.copy_(steps[0][2])
        graph, out = capture(lambda: sampler.forward(hidden, temperatures, exponential), device=device,
                             name="decode sampler", owner="decode graph runner",
                             static={"hidden": hidden, "temperatures": temperatures, "exponential": exponential})
        outs = []
        for h, t, e in steps:
            hidden.copy_(h)
            temperatures.copy_(t)
            exponential.copy_(e)
            ids, probs = replay(graph, out)
            outs += [ids.clone(), probs.clone()]
        return outs

    def eager():
        sampler = Sampler(device, variant)
        outs = []
        for h, t, e in steps:
            ids, probs = sampler.forward(h, t, e)
            outs += [ids.clone(), probs.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
