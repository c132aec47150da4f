"""The advanced-sampling decode graph is captured on the argmax branch: a warmup-only pass cleared its override.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/17671 ("[None][fix] Preserve advanced sampling state
through graph capture"); the same bug is described in detail by the superseded
https://github.com/NVIDIA/TensorRT-LLM/pull/17692 ("[None][fix] Defer sampling cleanup until graph capture") and
by the TRTLLM-14874 root-cause note; the cleanup it moves was added by #17033 (already covered).
Symptom: with one-engine speculative decoding (MTP, EAGLE3 one-model, DFlash) and CUDA graphs on, non-greedy
requests decode greedily: an identical ``temperature=0.9`` request returns the same completion every time, equal
to the greedy one; GPQA Diamond dropped from 84.75% to 79.04% (MTP3) and 79.58% (DFlash7), recovered by the
fix (TensorRT-LLM main, August 2026).
Mechanism: ``_capture_generation_cuda_graphs`` runs two warmup rounds, a workspace-sizing round
(``is_warmup_only``) and the real capture. In each round ``_run_capture_pass(force_non_greedy=True)`` sets
``_force_non_greedy_for_capture`` on the live ``SpecMetadata`` so that the graph key is the advanced-sampling one
(``is_all_greedy_sample=False``). The graph body is decided by the graph's own ``SpecMetadata``: the shallow copy
``create_cuda_graph_metadata`` made the first time the key was seen, cached in ``graph_metadata`` and re-scanned
by ``populate_sampling_params_for_one_model`` every iteration. In round 1 the fresh copy inherits the flag. Then
``clear_capture_only_spec_state()`` (#17033) ran after the warmup-only round too and wiped the flag from every
cached copy. In round 2 the copies are reused flagless: the scan of the parameter-less dummy requests comes out
greedy, ``_sample_tokens_for_batch`` takes its ``is_all_greedy_sample`` argmax branch, and that Python decision is
what the capture records under the advanced key. At serving time a batch with a non-greedy request selects the
advanced key, ``populate`` fills the temperature buffer, and the replay runs argmax, where an eager step samples.
Doctor: warmup-divergence, at ``_sample_tokens_for_batch`` (the real capture took the argmax branch, decided from
graph metadata a warmup-only cleanup had reset; an eager step with a non-greedy request takes the sampling branch).
Fix (upstream): the capture-only cleanup runs only after the real capture pass; warmup-only passes no longer clear
capture-only speculative metadata, so the copies keep the override while the advanced graphs are recorded.
(Read: the descriptions of #17671 and #17692, the TRTLLM-14874 note, and the current ``SpecMetadata`` /
``_run_capture_pass`` / ``clear_capture_only_spec_state`` code; not the #17671 diff itself. Tiny model: one
layer, one token per request and step; temperature only, no top-k/top-p; the sampler's random numbers are a
deterministic hash of the per-request seed and position instead of a Philox stream.)
"""
from __future__ import annotations

import copy

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/17671"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_sample_tokens_for_batch"
SYMPTOM = "non-greedy requests are served greedily by the advanced-sampling CUDA graph (argmax recorded)"

VOCAB, DIM, MAX_POS = 12, 6, 16
MAX_BATCH_SIZE = 2
CUDA_GRAPH_BATCH_SIZES = [2]
WARMUP_STEPS = 2
CAPTURE_TEMPERATURE = 0.7        # the synthetic capture-time value (with top_k 50 / top_p 0.9 upstream)
DISABLE_TEMP_VAL = 1e-5          # greedy rows: a tiny temperature, so the sampling kernel degenerates to argmax


class SamplingConfig:
    def __init__(self, temperature=None, seed=0):
        self.temperature = None if temperature is None else [temperature]
        self.random_seed = [seed]


class LlmRequest:
    def __init__(self, request_id, temperature=None, is_dummy=False):
        self.py_request_id = request_id
        self.sampling_config = SamplingConfig(temperature, seed=request_id)
        self.is_dummy = is_dummy


def params_imply_greedy_decoding(temperature):
    return temperature is None or temperature == 0


class SpecMetadata:
    """The one-engine speculative metadata; graph copies are shallow, so they share its tensors."""

    def __init__(self, max_num_requests, device):
        self.max_num_requests = max_num_requests
        self.is_cuda_graph = False
        self.is_all_greedy_sample = True
        self.request_temperatures = torch.ones(max_num_requests, device=device)
        self.request_seeds = torch.zeros(max_num_requests, dtype=torch.long, device=device)

    def create_cuda_graph_metadata(self, max_batch_size):
        if self.is_cuda_graph:
            return self
        cuda_graph_metadata = copy.copy(self)          # inherits any runtime attribute, the capture flag too
        cuda_graph_metadata.is_cuda_graph = True
        cuda_graph_metadata.max_num_requests = max_batch_size
        return cuda_graph_metadata

    def _scan_one_model_sampling(self, requests):
        """Sets is_all_greedy_sample (honoring the warmup capture override); returns per-request values."""
        per_request = []
        temperature_enabled = False
        for request in requests:
            temp_val = (request.sampling_config.temperature or [None])[0]
            is_greedy = params_imply_greedy_decoding(temp_val)
            temperature_enabled |= not is_greedy
            per_request.append((DISABLE_TEMP_VAL if is_greedy else temp_val,
                                request.sampling_config.random_seed[0]))
        self.is_all_greedy_sample = not temperature_enabled
        # Warmup-time override: dummy warmup requests carry no sampling params, so force the
        # advanced-sampling path for the (is_all_greedy_sample=False) capture.
        if getattr(self, "_force_non_greedy_for_capture", False):
            self.is_all_greedy_sample = False
            per_request = [(CAPTURE_TEMPERATURE, seed) for _, seed in per_request]
        return per_request

    def update_is_all_greedy_sample(self, requests):
        """Refresh the flag for the current batch BEFORE the CUDA graph key is built."""
        self._scan_one_model_sampling(requests)

    def populate_sampling_params_for_one_model(self, requests):
        per_request = self._scan_one_model_sampling(requests)
        if self.is_all_greedy_sample:
            return                                      # all-greedy batches skip the buffers
        n = len(per_request)
        device = self.request_temperatures.device
        self.request_temperatures[:n].copy_(torch.tensor([t for t, _ in per_request], device=device))
        self.request_seeds[:n].copy_(torch.tensor([s for _, s in per_request], device=device))


def _uniform_noise(seeds, positions, vocab):
    """Counter-based uniforms keyed by (seed, position, token): the same numbers eagerly and on replay."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.float32)
    x = seeds[:, None].float() * 12.9898 + positions[:, None].float() * 4.1414 + ids[None, :] * 78.233
    return torch.frac(torch.abs(torch.sin(x) * 43758.5453)).clamp(1e-6, 1 - 1e-6)


def sampling_batch_spec_dec_one_model(logits, temperatures, seeds, positions):
    """Temperature sampling by the Gumbel-max trick."""
    gumbel = -torch.log(-torch.log(_uniform_noise(seeds, positions, logits.shape[-1])))
    return torch.argmax(logits / temperatures[:, None] + gumbel, dim=-1)


class OneModelSpecWorker:
    """Target forward plus the one-model sampler, all inside the captured generation step."""

    def __init__(self, device):
        gen = generator(17671)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.6)

    def forward(self, input_ids, position_ids, spec_metadata, batch_size):
        h = torch.tanh((self.embed[input_ids] + self.pos_embed[position_ids]) @ self.w)
        logits = h @ self.lm_head
        return self._sample_tokens_for_batch(logits, spec_metadata, batch_size, position_ids)

    def _sample_tokens_for_batch(self, logits, spec_metadata, batch_size, position_ids):
        if spec_metadata.is_all_greedy_sample:
            return torch.argmax(logits, dim=-1)        # the greedy fast path
        temperatures = spec_metadata.request_temperatures[:batch_size]
        seeds = spec_metadata.request_seeds[:batch_size]
        return sampling_batch_spec_dec_one_model(logits, temperatures, seeds, position_ids)


class CUDAGraphRunner:
    def __init__(self, device):
        self.device = device
        self.is_warmup_only = False
        self.graph_metadata = {}
        self.graphs, self.graph_outputs = {}, {}

    def get_graph_spec_metadata(self, key, spec_metadata):
        """maybe_get_cuda_graph: one cached shallow copy per key, reseated as the live metadata."""
        if key not in self.graph_metadata:
            self.graph_metadata[key] = {"spec_metadata": spec_metadata.create_cuda_graph_metadata(key[0])}
        return self.graph_metadata[key]["spec_metadata"]

    def needs_capture(self, key):
        return key not in self.graph_outputs

    def capture(self, key, forward_fn, static):
        if self.is_warmup_only:
            return forward_fn()                        # workspace-sizing round: run it, record nothing
        g, out = capture(forward_fn, device=self.device, warmups=WARMUP_STEPS, owner="CUDAGraphRunner",
                         name=f"generation bs {key[0]} {'greedy' if key[1] else 'advanced sampling'}",
                         static=static)
        self.graphs[key], self.graph_outputs[key] = g, out
        return out

    def replay(self, key):
        return replay(self.graphs[key], self.graph_outputs[key])

    def clear_capture_only_spec_state(self):
        cleared = 0
        for stored in self.graph_metadata.values():
            spec_metadata = stored.get("spec_metadata")
            if spec_metadata is not None and getattr(spec_metadata, "_force_non_greedy_for_capture", False):
                spec_metadata._force_non_greedy_for_capture = False
                cleared += 1
        return cleared


class PyTorchModelEngine:
    def __init__(self, device, variant, use_cuda_graph):
        self.device, self.variant = device, variant
        self.model = OneModelSpecWorker(device)
        self.spec_metadata = SpecMetadata(MAX_BATCH_SIZE, device)
        self.input_ids_cuda = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        self.position_ids_cuda = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        self.cuda_graph_runner = CUDAGraphRunner(device) if use_cuda_graph else None

    def warmup(self):
        if self.cuda_graph_runner is not None:
            self._capture_generation_cuda_graphs()

    def _capture_generation_cuda_graphs(self):
        runner = self.cuda_graph_runner
        for is_warmup_only in (True, False):           # grow-workspace round, then the real capture
            runner.is_warmup_only = is_warmup_only
            self._run_capture_pass(force_non_greedy=False)          # greedy fast path
            self._run_capture_pass(force_non_greedy=True)           # advanced sampling
            if self.variant == "bug" or not is_warmup_only:
                # bug: the cleanup also runs after the warmup-only round, before the real capture
                runner.clear_capture_only_spec_state()
        runner.is_warmup_only = False
        self.spec_metadata.is_all_greedy_sample = True

    def _run_capture_pass(self, force_non_greedy):
        spec_metadata = self.spec_metadata
        if force_non_greedy:
            spec_metadata._force_non_greedy_for_capture = True
            spec_metadata.is_all_greedy_sample = False
        try:
            for bs in CUDA_GRAPH_BATCH_SIZES:
                dummies = [LlmRequest(1000 + i, is_dummy=True) for i in range(bs)]
                self.forward(dummies, [0] * bs, [0] * bs)
        finally:
            if force_non_greedy:
                spec_metadata._force_non_greedy_for_capture = False

    def forward(self, requests, token_ids, positions):
        bs = len(requests)
        self.input_ids_cuda[:bs].copy_(torch.tensor(token_ids, device=self.device))
        self.position_ids_cuda[:bs].copy_(torch.tensor(positions, device=self.device))
        runner = self.cuda_graph_runner
        if runner is None or bs not in CUDA_GRAPH_BATCH_SIZES:
            self.spec_metadata.populate_sampling_params_for_one_model(requests)
            return self.model.forward(self.input_ids_cuda[:bs], self.position_ids_cuda[:bs], self.spec_metadata, bs)
        self.spec_metadata.update_is_all_greedy_sample(requests)
        key = (bs, self.spec_metadata.is_all_greedy_sample)
        graph_spec_metadata = runner.get_graph_spec_metadata(key, self.spec_metadata)
        graph_spec_metadata.populate_sampling_params_for_one_model(requests)     # in _prepare_inputs
        if runner.needs_capture(key):
            return runner.capture(key, lambda: self.model.forward(
                self.input_ids_cuda[:bs], self.position_ids_cuda[:bs], graph_spec_metadata, bs),
                static={"input_ids": self.input_ids_cuda, "position_ids": self.position_ids_cuda,
                        "request_temperatures": self.spec_metadata.request_temperatures,
                        "request_seeds": self.spec_metadata.request_seeds})
        return runner.replay(key)


def run(variant: str, device: str = "cpu"):
    def serve(use_cuda_graph: bool):
        engine = PyTorchModelEngine(device, variant, use_cuda_graph)
        engine.warmup()
        # Request 7 is greedy, request 8 asks for temperature 1.5; a first all-greedy step, then both.
        greedy_only = [LlmRequest(7), LlmRequest(9)]
        mixed = [LlmRequest(7), LlmRequest(8, temperature=1.5)]
        outs = [engine.forward(greedy_only, [3, 5], [4, 6]).clone()]
        tokens, positions = [1, 2], [5, 3]
        for _ in range(4):
            sampled = engine.forward(mixed, tokens, positions).clone()
            outs.append(sampled)
            tokens, positions = sampled.tolist(), [p + 1 for p in positions]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
