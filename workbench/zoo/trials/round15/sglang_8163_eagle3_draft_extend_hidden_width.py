"""The EAGLE3 draft-extend graph's ``hidden_states`` buffer is ``3 * hidden_size`` wide, not ``3 * target_hidden_size``.

Upstream: https://github.com/sgl-project/sglang/pull/8163 ("Fix eagle3 cuda graph"; issue #7011, "Draft
extend CUDA graph fails to load using llama 3.3 70b").
Symptom: EAGLE3 speculative decoding whose draft model has a ``target_hidden_size`` different from its own
``hidden_size``: the server dies while capturing the draft-extend CUDA graphs (shape error in the draft
model's ``fc``); with ``--disable-cuda-graph`` the same drafts run (sglang 0.4.7-0.4.9, June-July 2025).
Mechanism: in eager mode ``forward_draft_extend_after_decode`` hands the draft model the target model's
aux hidden states as they are, ``3 * target_hidden_size`` wide, and ``LlamaForCausalLMEagle3`` maps them
with ``fc`` (``Linear(3 * target_hidden_size, hidden_size)``). The draft-extend graph instead reads a
static ``self.hidden_states`` buffer that ``EAGLEDraftExtendCudaGraphRunner.__init__`` sized
``3 * hidden_size`` (the draft's own width): the dummy capture batch does not fit ``fc``, and no live batch
fits the buffer either (``copy_`` of the wider target hidden states at replay).
Doctor: undersized-buffer, at ``__init__`` (``EAGLEDraftExtendCudaGraphRunner.__init__`` allocates the
static ``hidden_states`` buffer narrower than the data every step copies into it).
Fix (upstream): size the buffer ``hf_config.target_hidden_size * 3`` when the draft config has
``target_hidden_size`` (as ``llama_eagle3.py`` does for ``fc``), else ``hidden_size * 3``.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/8163"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = "capturing the EAGLE3 draft-extend graphs fails: hidden_states buffer is 3*hidden_size, fc wants 3*target"
VOCAB, HIDDEN, TARGET_HIDDEN, NUM_TOKENS_PER_BS, CAPTURE_BS = 12, 4, 6, 2, (1, 2)


@dataclasses.dataclass
class LlamaForCausalLMEagle3:
    """The EAGLE3 draft: embeddings and ``fc`` on the target's three aux hidden states, one midlayer."""

    config: SimpleNamespace
    embed_tokens: torch.Tensor
    fc: torch.Tensor                   # [3 * hidden_size_in, hidden_size]
    midlayer: torch.Tensor             # [2 * hidden_size, hidden_size]
    lm_head: torch.Tensor

    def forward(self, input_ids, positions, hidden_states):
        embeds = self.embed_tokens[input_ids]
        if hidden_states.shape[-1] != embeds.shape[-1]:
            hidden_states = hidden_states @ self.fc
        h = torch.tanh(torch.cat([embeds, hidden_states], -1) @ self.midlayer) + 0.1 * positions[:, None]
        return h @ self.lm_head


def load_draft_model(device) -> LlamaForCausalLMEagle3:
    gen = generator(8163)
    config = SimpleNamespace(hidden_size=HIDDEN, target_hidden_size=TARGET_HIDDEN)
    hidden_size_in = config.target_hidden_size if hasattr(config, "target_hidden_size") else config.hidden_size
    return LlamaForCausalLMEagle3(config, randn(VOCAB, HIDDEN, gen=gen, device=device),
                                  randn(hidden_size_in * 3, HIDDEN, gen=gen, device=device, scale=0.4),
                                  randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5),
                                  randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5))


class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, draft_model: LlamaForCausalLMEagle3, device, variant):
        self.model, self.device = draft_model, device
        self.capture_bs = list(CAPTURE_BS)
        self.num_tokens_per_bs = NUM_TOKENS_PER_BS
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        hf_config = draft_model.config
        with torch.device(device):
            self.input_ids = torch.zeros((self.max_num_token,), dtype=torch.int64)
            self.positions = torch.zeros((self.max_num_token,), dtype=torch.int64)
            if variant == "bug":
                self.hidden_states = torch.zeros((self.max_num_token, hf_config.hidden_size * 3))
            else:
                self.hidden_states = torch.zeros(
                    (self.max_num_token,
                     hf_config.target_hidden_size * 3 if hasattr(hf_config, "target_hidden_size")
                     else hf_config.hidden_size * 3))
        self.graphs, self.output_buffers = {}, {}
        pool = graph_pool_handle(device)
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, pool)

    def capture_one_batch_size(self, bs: int, pool):
        num_tokens = bs * self.num_tokens_per_bs
        input_ids, positions = self.input_ids[:num_tokens], self.positions[:num_tokens]
        hidden_states = self.hidden_states[:num_tokens]

        def run_once():
            return self.model.forward(input_ids, positions, hidden_states)

        return capture(run_once, device=self.device, pool=pool, name=f"draft extend bs={bs}",
                       static={"input_ids": self.input_ids, "positions": self.positions,
                               "hidden_states": self.hidden_states},
                       owner="EAGLEDraftExtendCudaGraphRunner")

    def replay(self, input_ids, positions, hidden_states):
        raw_num_token = input_ids.shape[0]
        raw_bs = raw_num_token // self.num_tokens_per_bs
        bs = next(b for b in self.capture_bs if b >= raw_bs)
        num_tokens = bs * self.num_tokens_per_bs
        if bs != raw_bs:
            self.input_ids[raw_num_token:num_tokens].zero_()
            self.positions[raw_num_token:num_tokens].zero_()
            self.hidden_states[raw_num_token:num_tokens].zero_()
        self.input_ids[:raw_num_token].copy_(input_ids)
        self.positions[:raw_num_token].copy_(positions)
        self.hidden_states[:raw_num_token].copy_(hidden_states)
        out = replay(self.graphs[bs], self.output_buffers[bs], real=raw_num_token, size=num_tokens)
        return out[:raw_num_token].clone()


def run(variant: str, device: str = "cpu"):
    model = load_draft_model(device)
    gen = torch.Generator().manual_seed(17)
    steps = []
    for raw_bs in (2, 1, 2):                   # accepted tokens of each request after a verify step
        n = raw_bs * NUM_TOKENS_PER_BS
        steps.append((torch.randint(0, VOCAB, (n,), generator=gen), torch.randint(0, 20, (n,), generator=gen),
                      torch.randn(n, 3 * TARGET_HIDDEN, generator=gen)))  # the target's aux hidden states

    def eager():
        return [model.forward(ids.to(device), pos.to(device), hs.to(device)) for ids, pos, hs in steps]

    def served():
        runner = EAGLEDraftExtendCudaGraphRunner(model, device, variant)
        return [runner.replay(ids.to(device), pos.to(device), hs.to(device)) for ids, pos, hs in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
