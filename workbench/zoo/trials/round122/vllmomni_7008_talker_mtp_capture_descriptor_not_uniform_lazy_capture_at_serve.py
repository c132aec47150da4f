"""vLLM-Omni on Ascend NPU: the talker-MTP ACL graphs are captured under batch descriptors that say "not a uniform
decode", because at capture time no request has computed tokens; at serving time every decode step says "uniform", so
the graph wrapper finds no entry for the step's descriptor, tries to capture one in the middle of serving and raises.

Upstream: https://github.com/vllm-project/vllm-omni/pull/7008 ("[Bugfix][NPU] Fix talker_mtp ACL graph capture missing
force_uniform_decode", vllm-project/vllm-omni, author Wallbreazzz, opened 2026-09-03, reviews 2026-09-16/17,
merged; merge commit not read).
Read: the PR description (root cause and fix as stated below); the pre-fix ``NPUARModelRunner.capture_model`` /
``_capture_talker_mtp_graphs`` of ``vllm_omni/platforms/npu/worker`` (the loop over ``cudagraph_capture_sizes`` that
calls ``_determine_batch_execution_and_padding(num_tokens=bsz, num_reqs=bsz, num_scheduled_tokens_np=np.ones(bsz),
max_num_scheduled_tokens=1, use_cascade_attn=False)``, slices the four fixed buffers ``talker_mtp_input_ids`` /
``talker_mtp_inputs_embeds`` / ``last_talker_hidden`` / ``text_step`` to ``batch_desc.num_tokens``, runs the warmups
with ``aclgraph_runtime_mode=NONE`` and captures with ``FULL`` under ``set_cudagraph_capturing_enabled(True)``); the
GPU twin in ``vllm_omni/worker/gpu_ar_model_runner.py``; the runner design note on ``_talker_mtp_forward`` (pads the
decode batch with the same ``_determine_batch_execution_and_padding``, slices the fixed buffers, calls the wrapped
``talker_mtp`` and writes back ``inputs_embeds`` and the audio codes); the ``ACLGraphWrapper.__call__`` lazy-capture
path (``validate_cudagraph_capturing_enabled()`` before a capture on an unseen descriptor) as quoted in
vllm-project/vllm-ascend#8589. The NPU ``_determine_batch_execution_and_padding`` body was not read; its uniform test is
modelled from the PR description.
Symptom: NPU TTS models (Moss-TTS-Local-Transformer on Ascend 910B) crash on the first request with
``RuntimeError: CUDA graph capturing detected at an inappropriate time``; GPUs are unaffected.
Mechanism: on NPU the batch-execution helper marks a batch uniform only if it is a one-token-per-request decode *and*
``has_initial_state = np.all(num_computed_tokens_cpu > 0)``. ``_capture_talker_mtp_graphs`` runs at start-up, when the
input batch holds no request, so every captured descriptor has ``uniform=False``. A served decode step has computed
tokens, so the same helper returns ``uniform=True``; ``ACLGraphWrapper`` keys its entries by the descriptor, misses,
and takes the lazy-capture branch, whose ``validate_cudagraph_capturing_enabled()`` raises because capturing is only
enabled during start-up. What capture decided (the descriptor, from a batch state that only exists at start-up) is
not what a serving step decides.
Doctor: warmup-divergence, at _capture_talker_mtp_graphs. The capture routine derives the graph key from start-up
state (no computed tokens, so not uniform) that no served step shares, so serving decides a different branch than the
one captured; the fix changes only this function.
Fix (upstream): ``_capture_talker_mtp_graphs`` passes ``force_uniform_decode=True`` to
``_determine_batch_execution_and_padding``, so the captured descriptors are the uniform ones serving asks for.
Modelled: ``_capture_talker_mtp_graphs`` (capture sizes largest first, warmups in NONE mode, capture in FULL mode,
capturing enabled only inside it), ``_determine_batch_execution_and_padding`` (uniform test with the NPU
``has_initial_state`` term, ``force_uniform_decode`` override, padding to the smallest capture size),
``BatchDescriptor``, ``ACLGraphWrapper.__call__`` (NONE passes through, entries keyed by descriptor, lazy capture
guarded by ``validate_cudagraph_capturing_enabled``, replay hands out the captured output), ``_talker_mtp_forward``
(fixed buffers, padded slice, write-back of the real rows) and the decode loop's ``num_computed_tokens_cpu``.
Stand-ins: the talker MTP (code predictor) is a small float64 residual loop over 3 code groups (projection,
per-group head, argmax, codec embedding, embedding sum plus ``text_step``); the talker backbone is a fixed random
map from the previous embedding to ``last_talker_hidden``; no attention, no sampling (argmax), no KV cache.
Workload: capture sizes 1, 2, 4; requests A, B, C arrive with prompts (one prefill step each, eager, giving
``num_computed_tokens``), then 4 decode steps of 3 requests (padded to the graph of 4) and, after C finishes, 2 steps
of 2 requests. Eager runs ``talker_mtp`` unwrapped. Bug: the first decode step raises RuntimeError ("CUDA graph
capturing detected at an inappropriate time. This operation is currently disabled."), as on the NPU. Fix: every
decode step replays a captured graph and equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-omni/pull/7008"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_capture_talker_mtp_graphs"
SYMPTOM = ("NPU TTS models crash on the first request: talker-MTP graphs were captured as non-uniform batches "
           "(no computed tokens at start-up), serving asks for uniform ones, and the wrapper tries to capture mid-run")

HIDDEN, CODEBOOK, NUM_CODE_GROUPS = 8, 12, 3
MAX_NUM_REQS = 4
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
CUDAGRAPH_NUM_OF_WARMUPS = 1
UNIFORM_DECODE_QUERY_LEN = 1
DTYPE = torch.float64

_variant = "bug"


# --- vllm/compilation/monitor.py -------------------------------------------------------------------------------------

_cudagraph_capturing_enabled = False


def set_cudagraph_capturing_enabled(enabled: bool) -> None:
    global _cudagraph_capturing_enabled
    _cudagraph_capturing_enabled = enabled


def validate_cudagraph_capturing_enabled() -> None:
    if not _cudagraph_capturing_enabled:
        raise RuntimeError("CUDA graph capturing detected at an inappropriate time. "
                           "This operation is currently disabled.")


# --- vllm/forward_context.py / vllm_ascend ascend_forward_context (reduced) ------------------------------------------

NONE, FULL = "NONE", "FULL"                                  # CUDAGraphMode


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False


_forward_context: dict = {}


@contextlib.contextmanager
def set_ascend_forward_context(attn_metadata, vllm_config, aclgraph_runtime_mode=NONE, batch_descriptor=None):
    saved = dict(_forward_context)
    _forward_context.update(attn_metadata=attn_metadata, cudagraph_runtime_mode=aclgraph_runtime_mode,
                            batch_descriptor=batch_descriptor)
    try:
        yield
    finally:
        _forward_context.clear()
        _forward_context.update(saved)


# --- vllm_ascend/compilation/acl_graph.py (ACLGraphWrapper.__call__, reduced) ----------------------------------------

@dataclasses.dataclass
class ACLGraphEntry:
    batch_descriptor: BatchDescriptor
    aclgraph: object = None
    output: object = None


class ACLGraphWrapper:
    def __init__(self, runnable, device, runtime_mode=FULL):
        self.runnable, self.device, self.runtime_mode = runnable, device, runtime_mode
        self.concrete_aclgraph_entries: dict[BatchDescriptor, ACLGraphEntry] = {}
        self.graph_pool = graph_pool_handle(device)
        self.static_inputs: dict = {}

    def __call__(self, *args):
        runtime_mode = _forward_context.get("cudagraph_runtime_mode", NONE)
        batch_descriptor = _forward_context.get("batch_descriptor")
        if runtime_mode == NONE or runtime_mode != self.runtime_mode:
            return self.runnable(*args)
        if batch_descriptor not in self.concrete_aclgraph_entries:
            self.concrete_aclgraph_entries[batch_descriptor] = ACLGraphEntry(batch_descriptor=batch_descriptor)
        entry = self.concrete_aclgraph_entries[batch_descriptor]
        if entry.aclgraph is None:
            # validate that aclgraph capturing is legal at this point.
            validate_cudagraph_capturing_enabled()
            entry.aclgraph, entry.output = capture(
                lambda: self.runnable(*args), device=self.device, pool=self.graph_pool, warmups=0,
                name=f"talker_mtp FULL {batch_descriptor}", owner="ACLGraphWrapper", static=self.static_inputs)
            return entry.output
        real = _forward_context.get("num_real_reqs", batch_descriptor.num_tokens)
        return replay(entry.aclgraph, entry.output, real=real, size=batch_descriptor.num_tokens,
                      padded={k: v[: batch_descriptor.num_tokens] for k, v in self.static_inputs.items()})


# --- the talker MTP (code predictor) of a Moss-TTS-like talker: stand-in ---------------------------------------------

class TalkerMTP(torch.nn.Module):
    """``talker_mtp(input_ids, inputs_embeds, last_talker_hidden, text_step) -> (inputs_embeds_next, audio_codes)``."""

    def __init__(self, device):
        super().__init__()
        gen = generator(7008)
        r = lambda *s, scale=0.6: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.codec_embedding0 = r(CODEBOOK, HIDDEN)
        self.projection = r(2 * HIDDEN, HIDDEN)
        self.lm_heads = r(NUM_CODE_GROUPS, HIDDEN, CODEBOOK)
        self.codec_embeddings = r(NUM_CODE_GROUPS, CODEBOOK, HIDDEN)

    def forward(self, input_ids, inputs_embeds, last_talker_hidden, text_step):
        h = torch.tanh(torch.cat([last_talker_hidden, self.codec_embedding0[input_ids]], dim=-1) @ self.projection)
        embeds_sum = self.codec_embedding0[input_ids]
        codes = [input_ids]
        for group in range(NUM_CODE_GROUPS):                    # residual codebooks, greedy
            code = (h @ self.lm_heads[group]).argmax(dim=-1)
            emb = self.codec_embeddings[group][code]
            h = torch.tanh(h + emb)
            embeds_sum = embeds_sum + emb
            codes.append(code)
        return embeds_sum + text_step, torch.stack(codes, dim=-1)


class TalkerBackbone(torch.nn.Module):
    """Stand-in for the talker LM step: previous input embedding -> last hidden state and layer-0 code."""

    def __init__(self, device):
        super().__init__()
        gen = generator(70080)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7).to(DTYPE)
        self.head = randn(HIDDEN, CODEBOOK, gen=gen, device=device).to(DTYPE)

    def forward(self, inputs_embeds):
        hidden = torch.tanh(inputs_embeds @ self.w)
        return hidden, (hidden @ self.head).argmax(dim=-1)


# --- vllm_omni/platforms/npu/worker/npu_ar_model_runner.py (reduced) -------------------------------------------------

class InputBatch:
    def __init__(self):
        self.req_ids: list[str] = []
        self.num_computed_tokens_cpu = np.zeros(MAX_NUM_REQS, dtype=np.int32)


class CpuGpuBuffer:
    def __init__(self, *shape, dtype, device):
        self.gpu = torch.zeros(*shape, dtype=dtype, device=device)


class NPUARModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.vllm_config = None
        self.input_batch = InputBatch()
        self.backbone = TalkerBackbone(device)
        model = TalkerMTP(device)
        self.talker_mtp_input_ids = CpuGpuBuffer(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.talker_mtp_inputs_embeds = CpuGpuBuffer(MAX_NUM_REQS, HIDDEN, dtype=DTYPE, device=device)
        self.last_talker_hidden = CpuGpuBuffer(MAX_NUM_REQS, HIDDEN, dtype=DTYPE, device=device)
        self.text_step = CpuGpuBuffer(MAX_NUM_REQS, HIDDEN, dtype=DTYPE, device=device)
        self.has_talker_mtp = True
        if enforce_eager:
            self.talker_mtp = model
        else:
            self.talker_mtp = ACLGraphWrapper(model, device)
            self.talker_mtp.static_inputs = {
                "talker_mtp_input_ids": self.talker_mtp_input_ids.gpu,
                "talker_mtp_inputs_embeds": self.talker_mtp_inputs_embeds.gpu,
                "last_talker_hidden": self.last_talker_hidden.gpu, "text_step": self.text_step.gpu}

    def _is_uniform_decode(self, num_reqs, num_tokens, max_num_scheduled_tokens):
        uniform_decode = (max_num_scheduled_tokens == UNIFORM_DECODE_QUERY_LEN
                          and num_tokens == max_num_scheduled_tokens * num_reqs)
        # NPU: a decode batch is uniform only if every request already has state
        has_initial_state = bool(np.all(self.input_batch.num_computed_tokens_cpu[:num_reqs] > 0))
        return uniform_decode and has_initial_state

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, use_cascade_attn,
                                               force_uniform_decode=None):
        uniform = (self._is_uniform_decode(num_reqs, num_tokens, max_num_scheduled_tokens)
                   if force_uniform_decode is None else force_uniform_decode)
        if self.enforce_eager or use_cascade_attn or num_tokens > max(CUDAGRAPH_CAPTURE_SIZES):
            return NONE, BatchDescriptor(num_tokens, num_reqs, uniform), num_tokens, None, None
        num_tokens_padded = next(s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= num_tokens)
        num_reqs_padded = num_tokens_padded if uniform else num_reqs
        batch_desc = BatchDescriptor(num_tokens=num_tokens_padded, num_reqs=num_reqs_padded, uniform=uniform)
        return FULL, batch_desc, num_tokens_padded, None, None

    #  -------------------------------------- Omni-new -------------------------------------------------
    def capture_model(self):
        self._capture_talker_mtp_graphs()

    def _capture_talker_mtp_graphs(self) -> None:
        if not self.has_talker_mtp or not isinstance(self.talker_mtp, ACLGraphWrapper):
            return
        capture_sizes = sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True)
        num_warmups = CUDAGRAPH_NUM_OF_WARMUPS
        extra = {} if _variant == "bug" else {"force_uniform_decode": True}    # the fix
        set_cudagraph_capturing_enabled(True)
        try:
            for bsz in capture_sizes:
                _, batch_desc, _, _, _ = self._determine_batch_execution_and_padding(
                    num_tokens=bsz, num_reqs=bsz, num_scheduled_tokens_np=np.ones(bsz, dtype=np.int32),
                    max_num_scheduled_tokens=1, use_cascade_attn=False, **extra)
                n = batch_desc.num_tokens
                ids = self.talker_mtp_input_ids.gpu[:n]
                emb = self.talker_mtp_inputs_embeds.gpu[:n]
                hid = self.last_talker_hidden.gpu[:n]
                ts = self.text_step.gpu[:n]
                for _ in range(num_warmups):
                    with set_ascend_forward_context(None, self.vllm_config, aclgraph_runtime_mode=NONE,
                                                    batch_descriptor=batch_desc):
                        self.talker_mtp(ids, emb, hid, ts)
                with set_ascend_forward_context(None, self.vllm_config, aclgraph_runtime_mode=FULL,
                                                batch_descriptor=batch_desc):
                    self.talker_mtp(ids, emb, hid, ts)
        finally:
            set_cudagraph_capturing_enabled(False)

    def _talker_mtp_forward(self, input_ids, inputs_embeds, last_hidden, text_step):
        bsz = input_ids.shape[0]
        mode, batch_desc, _, _, _ = self._determine_batch_execution_and_padding(
            num_tokens=bsz, num_reqs=bsz, num_scheduled_tokens_np=np.ones(bsz, dtype=np.int32),
            max_num_scheduled_tokens=1, use_cascade_attn=False)
        n = batch_desc.num_tokens
        self.talker_mtp_input_ids.gpu[:bsz].copy_(input_ids)
        self.talker_mtp_inputs_embeds.gpu[:bsz].copy_(inputs_embeds)
        self.last_talker_hidden.gpu[:bsz].copy_(last_hidden)
        self.text_step.gpu[:bsz].copy_(text_step)
        with set_ascend_forward_context(None, self.vllm_config, aclgraph_runtime_mode=mode,
                                        batch_descriptor=batch_desc):
            _forward_context["num_real_reqs"] = bsz
            new_embeds, codes = self.talker_mtp(
                self.talker_mtp_input_ids.gpu[:n], self.talker_mtp_inputs_embeds.gpu[:n],
                self.last_talker_hidden.gpu[:n], self.text_step.gpu[:n])
        return new_embeds[:bsz].clone(), codes[:bsz].clone()

    def execute_model(self, req_states, decode):
        """One step: the talker backbone on each request's last embedding, then (decode) the talker MTP."""
        req_ids = list(req_states)
        self.input_batch.req_ids = req_ids
        for row, rid in enumerate(req_ids):
            self.input_batch.num_computed_tokens_cpu[row] = req_states[rid]["num_computed"]
        self.input_batch.num_computed_tokens_cpu[len(req_ids):] = 0
        embeds = torch.stack([req_states[rid]["embeds"] for rid in req_ids])
        last_hidden, layer0 = self.backbone(embeds)
        text_step = torch.stack([req_states[rid]["text"] for rid in req_ids])
        if not decode:                                           # prefill: the embedding is the prompt's
            for rid in req_ids:
                req_states[rid]["num_computed"] += req_states[rid]["prompt_len"]
            return []
        new_embeds, codes = self._talker_mtp_forward(layer0, embeds, last_hidden, text_step)
        for row, rid in enumerate(req_ids):
            req_states[rid]["embeds"] = new_embeds[row]
            req_states[rid]["num_computed"] += 1
        return [new_embeds, codes.to(DTYPE)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enforce_eager):
        runner = NPUARModelRunner(device, enforce_eager)
        runner.capture_model()
        gen = generator(7)
        states = {rid: {"embeds": randn(HIDDEN, gen=gen, device=device).to(DTYPE),
                        "text": randn(HIDDEN, gen=gen, device=device, scale=0.3).to(DTYPE),
                        "num_computed": 0, "prompt_len": 5 + i} for i, rid in enumerate("ABC")}
        outs = []
        for rid in "ABC":                                        # one prefill step per arriving request
            runner.execute_model({rid: states[rid]}, decode=False)
        for _ in range(4):                                       # 3 requests, padded to the graph of 4
            outs += runner.execute_model(states, decode=True)
        del states["C"]                                          # C finishes
        for _ in range(2):                                       # 2 requests, graph of 2
            outs += runner.execute_model(states, decode=True)
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
