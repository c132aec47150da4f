"""vLLM-Ascend, a multimodal model served with ``--language-model-only``: ``_dummy_run`` (the warmup/capture run)
picks the ``inputs_embeds`` path from ``is_multimodal_model`` while ``_preprocess`` picks the ``input_ids`` path from
``supports_mm_inputs``, so the graph captured by the dummy run reads an input buffer that no served step writes.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/8556 ("[BugFix] Fix _dummy_run warmup mismatch when using
--language-model-only", vllm-project/vllm-ascend, merged 2026-04-27 as commit e5134c5e5d). Read: the PR description
("When `--language-model-only` is set, `is_multimodal_model` remains `True` ... but `supports_mm_inputs` becomes `False`
(all modality limits are 0). The `_dummy_run` warmup used `is_multimodal_model` to choose the embeddings path
(`inputs_embeds=tensor`), while `_preprocess` used `supports_mm_inputs` to choose the token-ids path (`input_ids=tensor`).
This mismatch caused `torch.compile`/dynamo to crash with `AttributeError: 'NoneType' object has no attribute 'size'` on
the first inference request."), its one-line diff in ``NPUModelRunner._dummy_run`` (``self.is_multimodal_model`` ->
``self.supports_mm_inputs`` in the ``input_ids = None / inputs_embeds = self.inputs_embeds.gpu[:num_tokens_padded]``
branch), and the surrounding ``_dummy_run`` of ``vllm_ascend/worker/model_runner_v1.py`` at the parent commit
(batch descriptor, ``assert num_tokens_padded <= self.max_num_tokens``, positions, ``set_ascend_forward_context`` with
``aclgraph_runtime_mode``/``batch_descriptor``, ``self._model_forward(num_tokens_padded, input_ids, positions,
intermediate_tensors, inputs_embeds)``). ``_preprocess``'s branch is vLLM's ``GPUModelRunner._preprocess`` (embeddings
path only when ``supports_mm_inputs``; else ``input_ids = self.input_ids.gpu[:num_input_tokens]; inputs_embeds = None``).
Reconstructed: the ACL graph wrapper, the capture loop and the model (stand-ins, below).
Symptom: with ``--language-model-only`` and graph mode the first request crashes the engine inside the compiled model
(upstream, through dynamo's trace of the dummy run); eager mode (``--enforce-eager``) serves it. Here, without dynamo,
the same capture/serve divergence shows up where the FULL decode graph is replayed: the decode steps compute from the
``inputs_embeds`` buffer instead of the tokens, and the generated tokens are wrong.
Mechanism: every graph is captured by ``_dummy_run``. With ``is_multimodal_model`` true it hands the model
``input_ids=None, inputs_embeds=self.inputs_embeds.gpu[:n]``, so the captured FULL graph reads the persistent
``inputs_embeds`` buffer. At serving time ``_preprocess`` (``supports_mm_inputs`` false) writes the token ids into
``self.input_ids`` and passes ``inputs_embeds=None``; nothing ever writes ``inputs_embeds`` (it holds zeros), and the
replay ignores the arguments it is called with. Eagerly the model embeds the token ids it is given.
Doctor: warmup-divergence, at _dummy_run. The warmup/capture run decided the input branch (embeddings) that every replay
keeps, while the eager step's ``_preprocess`` decides the other branch (token ids); the graph therefore reads a static
input the served steps never write.
Fix (upstream): choose the branch in ``_dummy_run`` with ``self.supports_mm_inputs`` (as ``_preprocess`` does), so the
graphs are captured on the token-ids path the served steps take.
Modelled: ``NPUModelRunner`` (``_dummy_run`` with the upstream branch, ``capture_model`` with its warmup dummy runs,
``_preprocess``, ``_model_forward``, ``execute_model`` padding uniform decode batches to ``cudagraph_capture_sizes``
under ``FULL_DECODE_ONLY``), ``CpuGpuBuffer`` persistent buffers, ``set_ascend_forward_context`` carrying
``aclgraph_runtime_mode`` and ``BatchDescriptor``, an ``ACLGraphWrapper`` that captures the model once per batch
descriptor and replays it without looking at its arguments (as vLLM's FULL wrapper does), and
``supports_multimodal_inputs`` (false when every modality limit is 0). Stand-ins: the Qwen3-VL language model (token
embedding + position embedding, 3 residual MLP layers, hidden 8, vocab 16, float64; no attention: the bug is in which
buffer the graph reads), greedy sampling on the host, no dynamo (so no ``AttributeError``).
Workload: capture sizes [2, 4]; A (5 tokens) and B (3 tokens) prefill eagerly, A and B decode (2 tokens: graph 2), C (4
tokens) prefills, then A, B, C decode four times (3 tokens padded to graph 4). The bug's decode logits differ from eager
from the first decode step on (the graph embeds the zeros of the unwritten inputs_embeds buffer, not the tokens; max
error 13.6 on the CPU); the fix equals eager on every step (logits of all scheduled tokens compared).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/8556"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_dummy_run"
SYMPTOM = ("A multimodal model served with --language-model-only in graph mode: the capture dummy run takes the "
           "inputs_embeds path (is_multimodal_model) while served steps take the input_ids path (supports_mm_inputs), so "
           "the replayed graph ignores the tokens; upstream the first request crashes the compiled model, eager mode works")

HIDDEN = 8
VOCAB = 16
NUM_LAYERS = 3
MAX_POSITION = 32
MAX_NUM_TOKENS = 16
CUDAGRAPH_CAPTURE_SIZES = [2, 4]

_variant = "bug"


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


@dataclasses.dataclass
class ModelConfig:
    is_multimodal_model: bool = True          # Qwen3-VL architecture
    is_encoder_decoder: bool = False
    language_model_only: bool = True          # --language-model-only: every modality limit is 0
    limit_mm_per_prompt: dict = dataclasses.field(default_factory=lambda: {"image": 0, "video": 0})


def supports_multimodal_inputs(model_config: ModelConfig) -> bool:
    """MULTIMODAL_REGISTRY.supports_multimodal_inputs: a multimodal model whose modality limits are all 0 takes none."""
    return model_config.is_multimodal_model and any(v > 0 for v in model_config.limit_mm_per_prompt.values())


# --- forward context ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class AscendForwardContext:
    num_tokens: int
    num_actual_tokens: int
    aclgraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None


_forward_context: AscendForwardContext | None = None


@contextlib.contextmanager
def set_ascend_forward_context(attn_metadata, vllm_config, *, num_tokens, num_actual_tokens, aclgraph_runtime_mode,
                               batch_descriptor=None):
    global _forward_context
    prev, _forward_context = _forward_context, AscendForwardContext(num_tokens, num_actual_tokens,
                                                                    aclgraph_runtime_mode, batch_descriptor)
    try:
        yield
    finally:
        _forward_context = prev


# --- the model (stand-in for Qwen3VLForConditionalGeneration's language model) ----------------------------------------

class Qwen3VLForConditionalGeneration:
    def __init__(self, device):
        gen = generator(8556)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.pos_embed = r(MAX_POSITION, HIDDEN, scale=0.3)
        self.layers = [(r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)) for _ in range(NUM_LAYERS)]
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        return self.embed_tokens[input_ids]

    def __call__(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        hidden_states = inputs_embeds + self.pos_embed[positions]
        for w1, w2 in self.layers:
            hidden_states = hidden_states + torch.tanh(hidden_states @ w1) @ w2
        return hidden_states

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- the ACL graph wrapper ----------------------------------------------------------------------------------------------

class ACLGraphWrapper:
    """FULL-mode wrapper: the first call with FULL runtime mode for a batch descriptor captures the runnable with the
    arguments of that call (the capture dummy run's); later calls replay, ignoring their arguments (the persistent
    buffers are assumed to hold the step's inputs)."""

    def __init__(self, runnable, runner):
        self.runnable = runnable
        self.runner = runner
        self.runtime_mode = CUDAGraphMode.FULL
        self.concrete_aclgraph_entries = {}
        self.graph_pool = graph_pool_handle(runner.device)

    def __getattr__(self, name):
        return getattr(self.runnable, name)

    def __call__(self, *args, **kwargs):
        ctx = _forward_context
        if ctx is None or ctx.aclgraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        desc = ctx.batch_descriptor
        entry = self.concrete_aclgraph_entries.get(desc)
        r = self.runner
        static = {"input_ids": r.input_ids.gpu, "positions": r.positions, "inputs_embeds": r.inputs_embeds.gpu}
        if entry is None:
            entry = capture(lambda: self.runnable(*args, **kwargs), device=r.device, pool=self.graph_pool,
                            name=f"model [{desc.num_tokens}]", owner="NPUModelRunner", static=static)
            self.concrete_aclgraph_entries[desc] = entry
            return entry[1]
        g, output = entry
        return replay(g, output, real=ctx.num_actual_tokens, size=desc.num_tokens, padded=static)


# --- the runner ---------------------------------------------------------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, *size, dtype, device):
        self.cpu = torch.zeros(*size, dtype=dtype)
        self.gpu = torch.zeros(*size, dtype=dtype, device=device)

    def copy_to_gpu(self, n):
        self.gpu[:n].copy_(self.cpu[:n].to(self.gpu.device))


class NPUModelRunner:
    def __init__(self, device, enforce_eager):
        self.device = device
        self.model_config = ModelConfig()
        self.is_multimodal_model = self.model_config.is_multimodal_model
        self.supports_mm_inputs = supports_multimodal_inputs(self.model_config)
        self.enable_prompt_embeds = False
        self.max_num_tokens = MAX_NUM_TOKENS
        self.cudagraph_mode = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.FULL_DECODE_ONLY
        self.cudagraph_batch_sizes = sorted(CUDAGRAPH_CAPTURE_SIZES)
        self.input_ids = CpuGpuBuffer(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions_cpu = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64)
        self.inputs_embeds = CpuGpuBuffer(MAX_NUM_TOKENS, HIDDEN, dtype=torch.float64, device=device)
        self.model = Qwen3VLForConditionalGeneration(device)
        if self.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY:
            self.model = ACLGraphWrapper(self.model, self)

    # -- warmup and capture ----------------------------------------------------------------------------------------------
    def _dummy_run(self, num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, is_graph_capturing=False):
        uniform = cudagraph_runtime_mode == CUDAGraphMode.FULL
        batch_desc = BatchDescriptor(num_tokens=num_tokens, num_reqs=num_tokens if uniform else None, uniform=uniform)
        num_tokens_padded = batch_desc.num_tokens
        # Make sure padding doesn't exceed max_num_tokens
        assert num_tokens_padded <= self.max_num_tokens
        mm_branch = self.is_multimodal_model if _variant == "bug" else self.supports_mm_inputs
        if mm_branch and not self.model_config.is_encoder_decoder or self.enable_prompt_embeds:
            input_ids = None
            inputs_embeds = self.inputs_embeds.gpu[:num_tokens_padded]
        else:
            input_ids = self.input_ids.gpu[:num_tokens_padded]
            inputs_embeds = None
        positions = self.positions[:num_tokens_padded]
        intermediate_tensors = None
        with set_ascend_forward_context(None, None, num_tokens=num_tokens_padded, num_actual_tokens=num_tokens_padded,
                                        aclgraph_runtime_mode=cudagraph_runtime_mode, batch_descriptor=batch_desc):
            return self._model_forward(num_tokens_padded, input_ids, positions, intermediate_tensors, inputs_embeds)

    def profile_run(self):
        self._dummy_run(self.max_num_tokens)

    def capture_model(self):
        if self.cudagraph_mode != CUDAGraphMode.FULL_DECODE_ONLY:
            return
        for num_tokens in reversed(self.cudagraph_batch_sizes):
            self._dummy_run(num_tokens, CUDAGraphMode.NONE)                      # cudagraph_num_of_warmups
            self._dummy_run(num_tokens, CUDAGraphMode.FULL, is_graph_capturing=True)

    # -- serving ---------------------------------------------------------------------------------------------------------
    def _model_forward(self, num_tokens_padded, input_ids, positions, intermediate_tensors, inputs_embeds):
        return self.model(input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                          inputs_embeds=inputs_embeds)

    def _preprocess(self, num_scheduled_tokens, num_input_tokens):
        if self.supports_mm_inputs and not self.model_config.is_encoder_decoder:
            inputs_embeds_scheduled = self.model.embed_input_ids(self.input_ids.gpu[:num_scheduled_tokens])
            self.inputs_embeds.gpu[:num_scheduled_tokens].copy_(inputs_embeds_scheduled)
            input_ids = None
            inputs_embeds = self.inputs_embeds.gpu[:num_input_tokens]
        else:
            # For text-only models, we use token ids as input.
            input_ids = self.input_ids.gpu[:num_input_tokens]
            inputs_embeds = None
        return input_ids, inputs_embeds, self.positions[:num_input_tokens]

    def _pad_for_graph(self, num_scheduled_tokens, uniform_decode):
        if (self.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY and uniform_decode
                and num_scheduled_tokens <= self.cudagraph_batch_sizes[-1]):
            padded = next(s for s in self.cudagraph_batch_sizes if s >= num_scheduled_tokens)
            return CUDAGraphMode.FULL, BatchDescriptor(num_tokens=padded, num_reqs=padded, uniform=True)
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens=num_scheduled_tokens)

    def execute_model(self, scheduled):
        token_ids = [t for req in scheduled for t in req["token_ids"]]
        positions = [p for req in scheduled for p in req["positions"]]
        num_scheduled_tokens = len(token_ids)
        uniform_decode = all(len(req["token_ids"]) == 1 for req in scheduled)
        runtime_mode, batch_desc = self._pad_for_graph(num_scheduled_tokens, uniform_decode)
        num_input_tokens = batch_desc.num_tokens
        self.input_ids.cpu[:num_scheduled_tokens] = torch.tensor(token_ids, dtype=torch.int64)
        self.input_ids.copy_to_gpu(num_scheduled_tokens)
        self.positions_cpu[:num_scheduled_tokens] = torch.tensor(positions, dtype=torch.int64)
        self.positions[:num_scheduled_tokens].copy_(self.positions_cpu[:num_scheduled_tokens].to(self.device))
        input_ids, inputs_embeds, positions_t = self._preprocess(num_scheduled_tokens, num_input_tokens)
        with set_ascend_forward_context(None, None, num_tokens=num_input_tokens, num_actual_tokens=num_scheduled_tokens,
                                        aclgraph_runtime_mode=runtime_mode, batch_descriptor=batch_desc):
            hidden_states = self._model_forward(num_input_tokens, input_ids, positions_t, None, inputs_embeds)
        return self.model.compute_logits(hidden_states[:num_scheduled_tokens])


# --- workload -----------------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_graphs):
        runner = NPUModelRunner(device, enforce_eager=not use_graphs)
        runner.profile_run()
        runner.capture_model()
        prompts = {"A": [3, 5, 7, 2, 9], "B": [4, 11, 6], "C": [8, 1, 13, 10]}
        lengths, last, outs, seen = {}, {}, [], set()

        def prefill(name):
            lengths[name] = len(prompts[name])
            return {"name": name, "token_ids": prompts[name], "positions": list(range(lengths[name]))}

        def decode(name):
            lengths[name] += 1
            return {"name": name, "token_ids": [last[name]], "positions": [lengths[name] - 1]}

        schedule = [["A"], ["B"], ["A", "B"], ["C"]] + [["A", "B", "C"]] * 4
        for step in schedule:
            batch = [decode(n) if n in seen else prefill(n) for n in step]
            seen.update(step)
            logits = runner.execute_model(batch)
            outs.append(logits.clone())
            ends = torch.tensor([len(r["token_ids"]) for r in batch]).cumsum(0) - 1
            for req, row in zip(batch, ends.tolist()):
                last[req["name"]] = int(logits[row].argmax())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
