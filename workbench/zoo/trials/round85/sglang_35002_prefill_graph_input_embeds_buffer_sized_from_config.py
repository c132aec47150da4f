"""sglang prefill CUDA graph: the ``input_embeds`` replay slot is sized from ``config.hidden_size``, too narrow for a model whose merged prefill input embedding is wider, so the graph cannot take the model's real input.

Upstream: https://github.com/sgl-project/sglang/pull/35002 ("Support model-defined prefill input embedding width",
merged 2026-08). Read: the PR description ("Some multimodal models merge text and media embeddings at a width that
differs from `config.hidden_size`, so prefill CUDA graph buffers sized only from the configuration can be too narrow";
modifications: "Let a model expose `input_embeds_hidden_size` for the prefill graph input buffer. Use that width
consistently for both the input buffer and shared buffer registry. Preserve `config.hidden_size` as the default"), and
the stored upstream unit test ``test/registered/unit/model_executor/test_prefill_cuda_graph_runner_helpers.py`` (the
helper ``PrefillCudaGraphRunner._input_embeds_hidden_size()`` returns ``model.input_embeds_hidden_size`` when the model
sets it, else ``model_config.hidden_size``). The diff was not read. One stored model that sets the attribute (a
Qwen4-Exp MTP draft in a fork: ``input_embeds_hidden_size = hidden_size * hc_count``, "Register the replay slot at HC
width, not the token embedding width") was read for the kind of model concerned. The registry names
(``build_prefill_registry``, ``has_slot`` / ``get_slot(name).buffer``) are from the stored upstream test
``test_deepstack_replay_slot.py``. Closed duplicate attempt: #34990.
Symptom: with the prefill CUDA graph on, a model whose prefill input embedding is wider than ``config.hidden_size``
cannot run: capture hands the model a ``[tokens, hidden_size]`` slice of the static ``input_embeds`` slot where the model
expects its own merged width, and the first layer that consumes it fails with a shape error (eager prefill, which
passes the model's own ``input_embeds`` tensor, works).
Mechanism: the prefill graph runner allocates its static input buffers once, in ``__init__`` through
``build_prefill_registry``; the ``input_embeds`` slot was ``[max_num_tokens, model_config.hidden_size]``. The
multimodal wrapper merges the text embedding with the media features eagerly and passes the merged tensor as
``forward_batch.input_embeds``; the graphed language model reads the slot. A model that merges at a wider width gets a
slot that cannot hold its input: the capture batch (a view of the slot) has the wrong width, and a replay would have to
copy ``[n, W]`` rows into ``[n, hidden_size]`` storage.
Doctor: undersized-buffer, at _input_embeds_hidden_size (the data the step feeds the graph, rows of the model's merged
width, does not fit the static slot sized from the configuration; ``_input_embeds_hidden_size`` is where the slot's width
is decided and where the fix goes).
Fix (upstream): ``_input_embeds_hidden_size()`` returns the model's ``input_embeds_hidden_size`` when it defines one
(else ``config.hidden_size``), and that width is used both for the input buffer and for the registry slot.
Modelled: ``PrefillCudaGraphRunner`` (token buckets 4 and 8, largest captured first, ``capture_prepare``,
``load_batch``, ``replay``), the registry with ``input_ids``, ``positions`` and ``input_embeds`` slots, and a tiny
multimodal model: the eager wrapper (``embed_mm_inputs``) concatenates each token's text embedding with a per-token media
feature of the same width (merged width 2 x hidden_size, a stand-in for "merge text and media embeddings at a width that
differs"), and the graphed language model fuses it back to hidden_size with a linear layer, adds a position embedding,
runs one MLP block and the LM head. No attention (a one-request prefill needs none to show the contract), no DP, no
EAGLE.
Workload: build the runner (captures the 8- and 4-token graphs), then three prefills of 5, 8 and 3 tokens with media
features. Eager runs each through the wrapper and the language model. Bug: building the runner raises (capture of the
8-token graph feeds an ``[8, 8]`` slot view to a fuse layer expecting width 16: "mat1 and mat2 shapes cannot be
multiplied"), so no prefill is served. Fix: the slot is 16 wide; the 5-token prefill replays the 8 graph, the 3-token
one the 4 graph, and all three equal eager.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/35002"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_input_embeds_hidden_size"
SYMPTOM = ("prefill CUDA graph for a model whose merged prefill input embedding is wider than config.hidden_size: "
           "the static input_embeds slot is sized from the config, so the graph cannot take the model's input "
           "(shape error at capture); eager prefill works")

VOCAB, HIDDEN, MAX_POS = 16, 8, 16
MERGED = 2 * HIDDEN                      # the model's merged (text + media) prefill input width
CAPTURE_NUM_TOKENS = [4, 8]

_variant = "bug"


class ForwardBatch:
    def __init__(self, input_ids, positions, input_embeds=None, mm_features=None):
        self.input_ids, self.positions = input_ids, positions
        self.input_embeds, self.mm_features = input_embeds, mm_features
        self.num_tokens = input_ids.shape[0]


class ModelConfig:
    hidden_size = HIDDEN


# --- cuda_graph_buffer_registry.py --------------------------------------------------------------------------------------

class _Slot:
    def __init__(self, name, buffer):
        self.name, self.buffer = name, buffer


class CudaGraphBufferRegistry:
    def __init__(self):
        self._slots = {}

    def register(self, name, buffer):
        self._slots[name] = _Slot(name, buffer)

    def has_slot(self, name):
        return name in self._slots

    def get_slot(self, name):
        return self._slots[name]

    def buffers(self):
        return {name: slot.buffer for name, slot in self._slots.items()}

    def populate(self, forward_batch, num_tokens):
        """Copy the live batch into the static slots (rows past ``num_tokens`` are left as they are)."""
        self._slots["input_ids"].buffer[:num_tokens].copy_(forward_batch.input_ids)
        self._slots["positions"].buffer[:num_tokens].copy_(forward_batch.positions)
        if self.has_slot("input_embeds") and forward_batch.input_embeds is not None:
            self._slots["input_embeds"].buffer[:num_tokens].copy_(forward_batch.input_embeds)


def build_prefill_registry(device, max_num_token, is_multimodal, hidden_size):
    reg = CudaGraphBufferRegistry()
    reg.register("input_ids", torch.zeros(max_num_token, dtype=torch.int64, device=device))
    reg.register("positions", torch.zeros(max_num_token, dtype=torch.int64, device=device))
    if is_multimodal:
        reg.register("input_embeds", torch.zeros(max_num_token, hidden_size, device=device))
    return reg


# --- the model: an eager multimodal wrapper around a graphed language model -----------------------------------------------

class LanguageModel:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        self.w_fuse = r(MERGED, HIDDEN, scale=0.4)        # merged width -> hidden_size
        self.pos_embed = r(MAX_POS, HIDDEN, scale=0.3)
        self.w_up, self.w_down = r(HIDDEN, 2 * HIDDEN, scale=0.6), r(2 * HIDDEN, HIDDEN, scale=0.6)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.6)

    def forward(self, input_ids, positions, forward_batch, input_embeds):
        h = input_embeds @ self.w_fuse + self.pos_embed[positions]
        h = h + torch.relu(h @ self.w_up) @ self.w_down
        return h @ self.lm_head


class MultimodalForConditionalGeneration:
    """The wrapper merges text and media embeddings eagerly; the language model is what the prefill graph runs."""

    def __init__(self, device):
        gen = generator(35002)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.language_model = LanguageModel(gen, device)
        if _variant == "fix":                             # the model declares its merged width (upstream's opt-in)
            self.input_embeds_hidden_size = MERGED

    def embed_mm_inputs(self, forward_batch):
        text = self.embed_tokens[forward_batch.input_ids]
        return torch.cat([text, forward_batch.mm_features], dim=-1)     # [n, 2 * hidden_size]


class ModelRunner:
    def __init__(self, device):
        self.device = device
        self.model = MultimodalForConditionalGeneration(device)
        self.model_config = ModelConfig()
        self.is_multimodal = True

    def forward_extend(self, forward_batch):                 # eager prefill: exact shape, no padding
        lm = self.model.language_model
        return lm.forward(forward_batch.input_ids, forward_batch.positions, forward_batch, forward_batch.input_embeds)


# --- runner/prefill_cuda_graph_runner.py ----------------------------------------------------------------------------------

class PrefillCudaGraphRunner:
    def __init__(self, model_runner, device):
        self.model_runner, self.device = model_runner, device
        self.capture_num_tokens = sorted(CAPTURE_NUM_TOKENS)
        self.max_num_tokens = max(self.capture_num_tokens)
        self.buffers = build_prefill_registry(device, self.max_num_tokens, model_runner.is_multimodal,
                                              self._input_embeds_hidden_size())
        self.graphs, self.output_buffers = {}, {}
        for num_tokens in reversed(self.capture_num_tokens):
            self.graphs[num_tokens], self.output_buffers[num_tokens] = self.capture_one(num_tokens)

    def _input_embeds_hidden_size(self):
        if _variant == "fix":                             # the fix: a model-defined width takes precedence
            return getattr(self.model_runner.model, "input_embeds_hidden_size",
                           self.model_runner.model_config.hidden_size)
        return self.model_runner.model_config.hidden_size

    def capture_prepare(self, num_tokens):
        return ForwardBatch(self.buffers.get_slot("input_ids").buffer[:num_tokens],
                            self.buffers.get_slot("positions").buffer[:num_tokens],
                            input_embeds=self.buffers.get_slot("input_embeds").buffer[:num_tokens])

    def capture_one(self, num_tokens):
        fb = self.capture_prepare(num_tokens)
        lm = self.model_runner.model.language_model
        return capture(lambda: lm.forward(fb.input_ids, fb.positions, fb, fb.input_embeds), device=self.device,
                       name=f"prefill num_tokens={num_tokens}", owner="PrefillCudaGraphRunner",
                       static=self.buffers.buffers())

    def can_run(self, forward_batch):
        return forward_batch.num_tokens <= self.max_num_tokens

    def load_batch(self, forward_batch):
        raw = forward_batch.num_tokens
        num_tokens = next(n for n in self.capture_num_tokens if n >= raw)
        self.buffers.populate(forward_batch, raw)
        return num_tokens

    def replay(self, forward_batch):
        raw = forward_batch.num_tokens
        num_tokens = self.load_batch(forward_batch)
        logits = replay(self.graphs[num_tokens], self.output_buffers[num_tokens], real=raw, size=num_tokens,
                        padded={name: self.buffers.get_slot(name).buffer
                                for name in ("input_ids", "positions", "input_embeds")})
        return logits[:raw]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [[2, 5, 11, 8, 10], [3, 7, 1, 9, 4, 13, 12, 6], [12, 6, 15]]
    gen = generator(7)
    media = [randn(len(p), HIDDEN, gen=gen, device=device, scale=0.8) for p in prompts]

    def serve(use_cuda_graph: bool):
        mr = ModelRunner(device)
        runner = PrefillCudaGraphRunner(mr, device) if use_cuda_graph else None
        outs = []
        for tokens, feats in zip(prompts, media):
            n = len(tokens)
            fb = ForwardBatch(torch.tensor(tokens, device=device), torch.arange(n, device=device), mm_features=feats)
            fb.input_embeds = mr.model.embed_mm_inputs(fb)          # the wrapper's eager merge
            logits = runner.replay(fb) if runner is not None and runner.can_run(fb) else mr.forward_extend(fb)
            outs.append(logits.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
