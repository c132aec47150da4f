"""TGI-on-Gaudi ``StaticWarper`` captures its HPU graph on the caller's logits: later calls overwrite the model graph's output.

Upstream: https://github.com/huggingface/optimum-habana/pull/404 ("[tgi] Fix error in logits process in hpu
graph", commit 381bfe702ad988a4cf72c4e6c2e418308bc20529, Sep 2023). No linked issue.
Symptom: with sampling parameters (temperature / top-k / top-p / typical-p) TGI on Gaudi returned wrong
tokens and log-probs once the HPU graphs were replayed ("error in logits process in hpu graph"): a request
could be sampled from another request's logits.
Mechanism: ``text_generation_server/utils/logits_process.py``: ``static_warper()`` is ``lru_cache``d, so one
``StaticWarper`` serves every request with the same sampling parameters. Its first ``__call__`` did
``self.static_scores = scores`` -- the graph's static input *is* the caller's tensor -- and captured the warpers
and ``log_softmax`` on it; every later call did ``self.static_scores.copy_(scores)`` and ``replay()``. The caller
(``CausalLM.generate_token``, ``models/causal_lm.py``) passes ``logits[-1:, :]``, a view of the batch logits,
and the model is ``wrap_in_hpu_graph``-ed: the logits are the static output of the model's graph for that
input shape, rewritten in place by each replay of it. So ``static_scores`` aliases one row of the prefill
graph's output (row 1 here: the first sampling request of the first batch). In a later prefill batch of the same
shape, the warper call for request 0 copies request 0's logits into row 1 -- request 1's logits, which the loop
has not read yet -- and request 1 is then warped and sampled from request 0's distribution.
Doctor: persistent-mutation, at ``__call__`` (the warper's runner writes, with ``copy_``, a static input it
does not own: a view of the model graph's handed-out logits).
Fix (upstream): ``__call__`` allocates its own ``static_scores``/``static_warped_scores``/``static_next_logprob``
(``scores.clone().contiguous()``), writes the graph's results into them with ``copy_`` inside the capture, and
uses the graph only when ``scores.shape[-2] == 1`` (always true for this caller, which passes ``logits[-1:]``;
the prefill-shape branch the lead describes never runs here), else the eager warpers.
Modelled: a one-layer toy LM (embedding + position + tanh + unembedding), ``wrap_in_hpu_graph`` as one graph
per input shape returning its static outputs, Temperature and TopK warpers, ``Sampling`` as Gumbel-max with
noise drawn per request on the CPU (same law as ``torch.multinomial``); no repetition penalty / watermark,
no stopping criteria; batches of two, one prefill bucket, two decode steps each.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/optimum-habana/pull/404"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "__call__"
SYMPTOM = "sampling request reads another request's logits: StaticWarper's graph input aliases the model graph's output"

VOCAB, HIDDEN, PROMPT_LEN, DECODE_STEPS = 16, 8, 4, 2
# (temperature, top_k) per request; None: greedy (no warper). Batch 1 then batch 2, same prefill shape.
BATCHES = (((None, None), (0.7, 5)), ((0.7, 5), (0.7, 5)))


class TemperatureLogitsWarper:
    def __init__(self, temperature):
        self.temperature = temperature

    def __call__(self, input_ids, scores):
        return scores / self.temperature


class TopKLogitsWarper:
    def __init__(self, top_k, filter_value=-float("inf")):
        self.top_k, self.filter_value = top_k, filter_value

    def __call__(self, input_ids, scores):
        indices_to_remove = scores < torch.topk(scores, self.top_k)[0][..., -1, None]
        return scores.masked_fill(indices_to_remove, self.filter_value)


class StaticWarper:
    def __init__(self, temperature=1.0, top_k=None, *, variant="bug", device="cpu", graphed=True):
        self.warpers = []
        if temperature is not None and temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(float(temperature)))
        if top_k is not None and top_k != 0:
            self.warpers.append(TopKLogitsWarper(top_k=top_k))
        self.variant, self.device, self.graphed = variant, device, graphed
        self.hpu_graph = None
        self.static_scores = self.static_warped_scores = self.static_next_logprob = None

    def _warp(self):
        local_scores = self.static_scores
        for warper in self.warpers:
            local_scores = warper(None, local_scores)
        if self.variant == "bug":
            self.static_warped_scores = local_scores
            self.static_next_logprob = torch.log_softmax(self.static_warped_scores, -1)
        else:
            self.static_warped_scores.copy_(local_scores)
            self.static_next_logprob.copy_(torch.log_softmax(self.static_warped_scores, -1))
        return self.static_warped_scores, self.static_next_logprob

    def __call__(self, scores):
        if not self.graphed:                         # the "CPU branch": the warpers, eagerly
            for warper in self.warpers:
                scores = warper(None, scores)
            return scores, torch.log_softmax(scores, -1)
        if self.variant == "bug":
            if self.hpu_graph is None:
                self.static_scores = scores          # the caller's tensor becomes the graph's input
                self.hpu_graph, _ = capture(self._warp, device=self.device, name="static warper",
                                            owner="StaticWarper", static={"static_scores": self.static_scores})
            self.static_scores.copy_(scores)
            replay(self.hpu_graph, (self.static_warped_scores, self.static_next_logprob))
            return self.static_warped_scores, self.static_next_logprob
        # use hpu graph only for > 1st token
        if self.hpu_graph is None and scores.shape[-2] == 1:
            self.static_scores = scores.clone().contiguous()
            self.static_warped_scores = scores.clone().contiguous()
            self.static_next_logprob = scores.clone().contiguous()
            self.hpu_graph, _ = capture(self._warp, device=self.device, name="static warper",
                                        owner="StaticWarper", static={"static_scores": self.static_scores})
        if scores.shape[-2] == 1:
            self.static_scores.copy_(scores)
            replay(self.hpu_graph, (self.static_warped_scores, self.static_next_logprob))
            return self.static_warped_scores, self.static_next_logprob
        for warper in self.warpers:                  # 1st token disposal
            scores = warper(None, scores)
        return scores, torch.log_softmax(scores, -1)


@lru_cache(10)
def static_warper(temperature, top_k, variant, device, graphed) -> StaticWarper:
    return StaticWarper(temperature=temperature, top_k=top_k, variant=variant, device=device, graphed=graphed)


class Greedy:
    def __call__(self, logits):
        return logits.argmax(dim=-1)


class Sampling:
    """``torch.multinomial(softmax(logits))`` with a seeded generator, as Gumbel-max with CPU-drawn noise."""

    def __init__(self, seed, device):
        self.generator, self.device = generator(seed), device

    def __call__(self, logits):
        u = torch.rand(logits.shape, generator=self.generator).clamp(1e-6, 1 - 1e-6).to(self.device)
        return (logits - torch.log(-torch.log(u))).argmax(dim=-1)


class NextTokenChooser:
    def __init__(self, temperature, top_k, seed, device, variant, graphed):
        has_warpers = (temperature is not None and temperature != 1.0) or (top_k is not None and top_k != 0)
        self.static_warper = static_warper(temperature, top_k, variant, device, graphed) if has_warpers else None
        self.choice = Sampling(seed, device) if has_warpers else Greedy()

    def __call__(self, input_ids, scores):
        if self.static_warper is None:
            next_logprob = torch.log_softmax(scores, -1)
        else:
            scores, next_logprob = self.static_warper(scores)
        next_id = self.choice(scores[-1]).view(1, 1)
        return next_id, next_logprob


class ToyCausalLM:
    def __init__(self, device):
        gen = generator(404)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(PROMPT_LEN + DECODE_STEPS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_out = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=1.5)

    def forward(self, input_ids, position_ids):
        return torch.tanh(self.emb[input_ids] + self.pos[position_ids]) @ self.w_out     # [B, L, V]


class wrap_in_hpu_graph:  # noqa: N801 - the habana_frameworks name
    """One graph per input shape; a replay rewrites that graph's static logits and hands them out."""

    def __init__(self, model, device):
        self.model, self.device, self.cache = model, device, {}

    def forward(self, input_ids, position_ids):
        key = tuple(input_ids.shape)
        if key not in self.cache:
            ids, pos = input_ids.clone(), position_ids.clone()
            g, out = capture(lambda: self.model.forward(ids, pos), device=self.device, name=f"model {key}",
                             owner="wrap_in_hpu_graph", static={"input_ids": ids, "position_ids": pos})
            self.cache[key] = (g, out, ids, pos)
        g, out, ids, pos = self.cache[key]
        ids.copy_(input_ids)
        pos.copy_(position_ids)
        return replay(g, out)


def run(variant: str, device: str = "cpu"):
    model = ToyCausalLM(device)
    gen = generator(4040)
    prompts = torch.randint(0, VOCAB, (len(BATCHES), 2, PROMPT_LEN), generator=gen)

    def serve(graphed: bool):
        static_warper.cache_clear()
        lm = wrap_in_hpu_graph(model, device) if graphed else model
        outs, seed = [], 0
        for b, params in enumerate(BATCHES):
            choosers = []
            for temperature, top_k in params:
                seed += 1
                choosers.append(NextTokenChooser(temperature, top_k, seed, device, variant, graphed))
            input_ids = prompts[b].to(device)
            position_ids = torch.arange(PROMPT_LEN).expand(2, PROMPT_LEN).to(device)
            for step in range(1 + DECODE_STEPS):                      # generate_token: prefill, then decode
                logits = lm.forward(input_ids, position_ids)
                next_ids = []
                for i, (req_logits, chooser) in enumerate(zip(logits, choosers)):
                    next_token_id, logprobs = chooser(input_ids[i].view(1, -1), req_logits[-1:, :])
                    next_token_logprob = logprobs[-1, next_token_id]
                    outs.append(torch.cat([next_token_id.to(logprobs.dtype), next_token_logprob], 1))
                    next_ids.append(next_token_id)
                input_ids = torch.cat(next_ids, 0)
                position_ids = position_ids[:, -1:] + 1
        return [torch.cat(outs, 0)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
