"""Graph capture batch sizes ignore ``max_num_seqs``: the LoRA graph for batch 8 copies 8 tokens of LoRA metadata into buffers sized for 4.

Upstream: https://github.com/a710128/nanovllm-voxcpm/pull/66 ("Fix LoRA CUDA graph cache regressions"),
commit 4adfed0 ("fix: stabilize LoRA graph cache behavior"); issue #61 ("LoRA + CUDA graph + Blackwell
sm_120: audio quality degradation over time + max_num_seqs tensor mismatch").
Symptom: with a LoRA config and ``max_num_seqs < 8`` (e.g. 4), engine start-up fails in
``capture_cudagraph`` with a tensor size mismatch; without graphs (enforce_eager) the same
requests decode fine.
Mechanism: ``BaseModelRunner.capture_cudagraph`` sizes every static buffer for
``max_bs = min(max_num_seqs, 512)``: ``inputs``/``positions`` (``make_dummy_inputs``), the
outputs (``make_dummy_outputs(max_bs)``) and the per-domain LoRA metadata buffers
(``_make_graph_domain_buffers(max_bs, ...)``: ``token_to_slot`` etc.). But
``self.graph_bs = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))`` always contains 1, 2, 4 and 8.
Capture walks ``reversed(self.graph_bs)``, so it starts at bs=8 > max_bs=4. The base graph's
``cut_inputs(inputs, 8)`` silently shrinks to the 4 rows there are (a "bs=8" graph of 4 rows).
The LoRA graph then calls ``_set_graph_lora_contexts`` with a dummy context of 8 tokens, and
``_copy_lora_domain_to_graph_vars`` does ``token_to_slot_buf[:8].copy_(context.token_to_slot)`` into
a 4-row buffer: the capture input does not fit its static buffer and capture raises.
(Also: with e.g. max_num_seqs=6, ``max_bs`` itself is never captured.)
Doctor: undersized-buffer, at ``capture_cudagraph`` (it asks graphs to hold more rows than the
static buffers it allocated for ``max_bs``).
Fix (upstream): ``graph_bs_candidates = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16)) + [max_bs]``;
``self.graph_bs = sorted({bs for bs in graph_bs_candidates if 1 <= bs <= max_bs})`` (test
``test_lora_capture_cudagraph_respects_max_num_seqs_below_eight``: graph_bs == [1, 2, 4]).
(Not modelled: the PR's other change, the vendored Punica plan cache keyed by ``id()`` of temporary
views, a host-side cache that grew without bound; it behaves the same with and without graphs.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay
from workbench.engine import graph_pool_handle

UPSTREAM = "https://github.com/a710128/nanovllm-voxcpm/pull/66"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "capture_cudagraph"
SYMPTOM = "LoRA CUDA-graph capture fails (tensor size mismatch) when max_num_seqs < 8"

VOCAB, MAX_POS, HIDDEN, RANK, MAX_LORAS = 16, 32, 6, 2, 1
MAX_NUM_SEQS = 4
LORA_DOMAINS = ("lm", "proj")


@dataclasses.dataclass
class LoRAContext:
    token_to_slot: torch.Tensor | None
    no_lora_flag: bool


_lora_contexts: dict[str, LoRAContext] = {}


def set_lora_context(context: LoRAContext, domain: str) -> None:
    _lora_contexts[domain] = context


def build_lora_context_from_slot_list(token_to_slot: list[int], device) -> LoRAContext:
    no_lora = all(s < 0 for s in token_to_slot)
    return LoRAContext(torch.tensor(token_to_slot, dtype=torch.int32).to(device), no_lora)


def cut_inputs(inputs, bs):
    return {k: v[:bs] for k, v in inputs.items()}


def add_lora_linear(x, lora_a, lora_b, context: LoRAContext):
    """Punica shrink + expand: tokens whose slot is -1 get no delta; the kernels bail out on no_lora."""
    if context.no_lora_flag:
        return torch.zeros(x.shape[0], lora_b.shape[-1], device=x.device)
    slot = context.token_to_slot.long()
    a, b = lora_a[slot.clamp(min=0)], lora_b[slot.clamp(min=0)]          # [T, H, R], [T, R, H]
    delta = torch.bmm(torch.bmm(x[:, None, :], a), b).squeeze(1)
    return delta * (slot >= 0)[:, None]


class TinyDecodeModel:
    def __init__(self, device):
        gen = generator(66)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w = {d: randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5) for d in LORA_DOMAINS}
        self.lora_A = {d: randn(MAX_LORAS, HIDDEN, RANK, gen=gen, device=device) for d in LORA_DOMAINS}
        self.lora_B = {d: randn(MAX_LORAS, RANK, HIDDEN, gen=gen, device=device) for d in LORA_DOMAINS}

    def __call__(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos_embed[positions]
        for d in LORA_DOMAINS:
            h = torch.tanh(h @ self.w[d] + add_lora_linear(h, self.lora_A[d], self.lora_B[d], _lora_contexts[d]))
        return h


class BaseModelRunner:
    def __init__(self, model, device, variant, max_num_seqs=MAX_NUM_SEQS):
        self.model, self.device, self.variant, self.max_num_seqs = model, device, variant, max_num_seqs

    def _make_graph_domain_buffers(self, max_rows):
        return {"token_to_slot": torch.full((max_rows,), -1, dtype=torch.int32, device=self.device)}

    def _copy_lora_domain_to_graph_vars(self, graph_vars, domain, context: LoRAContext):
        token_to_slot_buf = graph_vars["lora_domains"][domain]["token_to_slot"]
        if context.no_lora_flag or context.token_to_slot is None:
            token_to_slot_buf.fill_(-1)
            return
        token_count = context.token_to_slot.size(0)
        token_to_slot_buf[:token_count].copy_(context.token_to_slot)      # must fit the max_bs buffer
        if token_count < token_to_slot_buf.size(0):
            token_to_slot_buf[token_count:].fill_(-1)

    def _set_graph_lora_contexts(self, graph_vars, contexts):
        for domain in LORA_DOMAINS:
            context = contexts[domain]
            self._copy_lora_domain_to_graph_vars(graph_vars, domain, context)
            token_count = 0 if context.token_to_slot is None else context.token_to_slot.size(0)
            buf = graph_vars["lora_domains"][domain]["token_to_slot"]
            set_lora_context(LoRAContext(buf[:token_count], context.no_lora_flag), domain)

    def capture_cudagraph(self):
        max_bs = min(self.max_num_seqs, 512)
        inputs = {"input_ids": torch.zeros(max_bs, dtype=torch.long, device=self.device),
                  "positions": torch.zeros(max_bs, dtype=torch.long, device=self.device)}
        lora_domains = {d: self._make_graph_domain_buffers(max_bs) for d in LORA_DOMAINS}
        outputs = torch.zeros(max_bs, HIDDEN, device=self.device)          # make_dummy_outputs(max_bs)
        if self.variant == "bug":
            self.graph_bs = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
        else:
            graph_bs_candidates = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16)) + [max_bs]
            self.graph_bs = sorted({bs for bs in graph_bs_candidates if 1 <= bs <= max_bs})
        self.graphs = {"base": {}, "lora": {}}
        self.graph_pool = graph_pool_handle(self.device)
        static = {**inputs, **{f"{d}.token_to_slot": lora_domains[d]["token_to_slot"] for d in LORA_DOMAINS}}

        def forward(bs):
            def fn():
                outputs[:bs] = self.model(**cut_inputs(inputs, bs))
                return outputs[:bs]
            return fn

        for bs in reversed(self.graph_bs):
            for kind, slot in (("base", -1), ("lora", 0)):
                self._set_graph_lora_contexts({"lora_domains": lora_domains},
                                              {d: build_lora_context_from_slot_list([slot] * bs, self.device)
                                               for d in LORA_DOMAINS})
                self.graphs[kind][bs] = capture(forward(bs), device=self.device, pool=self.graph_pool,
                                                name=f"{kind} bs={bs}", static=static, owner="BaseModelRunner")
        self.graph_vars = dict(inputs=inputs, lora_domains=lora_domains, outputs=outputs)

    def run_model(self, inputs, lora_contexts):
        has_active_lora = any(not c.no_lora_flag for c in lora_contexts.values())
        bs = inputs["positions"].size(0)
        size = next(x for x in self.graph_bs if x >= bs)
        g, out = self.graphs["lora" if has_active_lora else "base"][size]
        gv = self.graph_vars
        for kw in gv["inputs"]:
            gv["inputs"][kw][:bs] = inputs[kw]
        self._set_graph_lora_contexts(gv, lora_contexts)
        padded = {f"graph_vars.inputs.{k}": v[:size] for k, v in gv["inputs"].items()}
        return replay(g, out, real=bs, size=size, padded=padded)[:bs].clone()


def run(variant: str, device: str = "cpu"):
    model = TinyDecodeModel(device)
    # decode steps: (input ids, positions, LoRA slot per sequence; -1 = no adapter)
    steps = [([3, 9, 5], [4, 7, 2], [0, -1, 0]),
             ([1, 12, 6, 14], [5, 8, 3, 9], [0, 0, -1, 0]),
             ([7, 2], [6, 9], [-1, -1]),
             ([11, 4, 8], [7, 10, 4], [-1, 0, 0])]

    def batch(ids, pos, slots):
        inputs = {"input_ids": torch.tensor(ids).to(device), "positions": torch.tensor(pos).to(device)}
        return inputs, {d: build_lora_context_from_slot_list(slots, device) for d in LORA_DOMAINS}

    def eager():
        outs = []
        for step in steps:
            inputs, contexts = batch(*step)
            _lora_contexts.update(contexts)
            outs.append(model(**inputs))
        return outs

    def served():
        runner = BaseModelRunner(model, device, variant)
        runner.capture_cudagraph()
        return [runner.run_model(*batch(*step)) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
