"""A capture-only sampling override survives in the cached graph metadata and rewrites every request's params.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/17033 ("[TRTLLM-14779][fix] Clear capture-only
sampling override from cached CUDA graph metadata").
Symptom: one-model speculative decoding (MTP/Eagle3) with CUDA graphs: every request served by the
advanced-sampling graph is sampled with temperature 0.7 / top_k 50 / top_p 0.9, whatever the client
asked for; eager runs honour the request's own parameters (TensorRT-LLM PyTorch backend, July 2026).
Mechanism: to capture the advanced-sampling graph variant, ``_run_capture_pass`` sets
``_force_non_greedy_for_capture`` on the live ``SpecMetadata``, and ``create_cuda_graph_metadata``
shallow-copies that object (flag included) into every graph's cached metadata; the ``finally`` clause
clears the flag on the live object only. On every later replay the runner reseats the graph's cached
copy as the step's ``spec_metadata``, so ``_scan_one_model_sampling`` still honours the capture
override and ``populate_sampling_params_for_one_model`` writes the synthetic 0.7/50/0.9 into the
sampling buffers the captured sampler reads.
Doctor: warmup-divergence, at ``_scan_one_model_sampling`` (the capture-time override that replays of
the cached metadata keep applying, where an eager step uses the request's parameters).
Fix (upstream): after the capture pass, ``CUDAGraphRunner.clear_capture_only_spec_state()`` clears the
flag on every cached graph metadata copy (later refactored away by driving capture with real
non-greedy warmup ``SamplingParams``).
"""
from __future__ import annotations

import copy
import types

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/17033"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_scan_one_model_sampling"
SYMPTOM = "requests on the advanced-sampling graph are sampled with the capture's 0.7/50/0.9, not their own params"
VOCAB, DIM, BS = 6, 4, 2
DISABLE_TEMP_VAL, DISABLE_TOPK_VAL, DISABLE_TOPP_VAL = 1e-5, torch.iinfo(torch.int32).max, 1.0


def _first_or_none(values):
    return values[0] if values is not None and len(values) > 0 else None


def _params_imply_greedy(temperature, top_k, top_p):
    return (temperature in (None, 0)) or top_k == 1 or (temperature is None and top_k is None and top_p is None)


class SpecMetadata:
    """One-model speculative-decoding metadata: the sampling buffers the captured sampler reads."""

    def __init__(self, max_num_requests: int, device):
        self.max_num_requests = max_num_requests
        self.is_cuda_graph = False
        self.is_all_greedy_sample = True
        self.skip_temperature = self.skip_top_k = self.skip_top_p = True
        # allocated once; the captured graphs read these addresses (shared by shallow copies)
        self.temperatures = torch.ones(max_num_requests, device=device)
        self.top_ks = torch.zeros(max_num_requests, dtype=torch.int64, device=device)
        self.top_ps = torch.ones(max_num_requests, device=device)

    def create_cuda_graph_metadata(self, max_batch_size: int):
        if self.is_cuda_graph:
            return self
        cuda_graph_metadata = copy.copy(self)            # shallow: runtime attributes come along
        cuda_graph_metadata.is_cuda_graph = True
        cuda_graph_metadata.max_num_requests = max_batch_size
        return cuda_graph_metadata

    def _scan_one_model_sampling(self, requests):
        per_request_normalized = []
        temperature_enabled = top_k_enabled = top_p_enabled = False
        for request in requests:
            cfg = request.sampling_config
            temp_val, tk_val, tp_val = (_first_or_none(cfg.temperature), _first_or_none(cfg.top_k),
                                        _first_or_none(cfg.top_p))
            is_greedy = _params_imply_greedy(temp_val, tk_val, tp_val)
            temperature_enabled |= not is_greedy and temp_val not in (None, 0, 1)
            top_k_enabled |= not is_greedy and tk_val is not None and tk_val > 0
            top_p_enabled |= not is_greedy and tp_val is not None and tp_val < 1.0
            per_request_normalized.append((
                DISABLE_TEMP_VAL if is_greedy or temp_val is None or temp_val == 0 else temp_val,
                tk_val if (not is_greedy and tk_val is not None and tk_val > 0) else DISABLE_TOPK_VAL,
                DISABLE_TOPP_VAL if is_greedy or tp_val is None else tp_val))
        self.skip_temperature, self.skip_top_k, self.skip_top_p = (not temperature_enabled, not top_k_enabled,
                                                                   not top_p_enabled)
        self.is_all_greedy_sample = self.skip_temperature and self.skip_top_k and self.skip_top_p
        # Warmup-time override (set by the model engine): force the advanced-sampling path so the
        # is_all_greedy_sample=False graph gets captured from parameter-less dummy requests.
        if getattr(self, "_force_non_greedy_for_capture", False):
            self.skip_temperature = self.skip_top_k = self.skip_top_p = False
            self.is_all_greedy_sample = False
            per_request_normalized = [(0.7, 50, 0.9) for _ in per_request_normalized]
        return per_request_normalized

    def update_is_all_greedy_sample(self, requests):
        self._scan_one_model_sampling(requests)

    def populate_sampling_params_for_one_model(self, requests):
        per_request = self._scan_one_model_sampling(requests)
        if self.is_all_greedy_sample:
            return                                       # the argmax path reads no sampling buffer
        n = len(per_request)
        self.temperatures[:n].copy_(torch.tensor([p[0] for p in per_request]))
        self.top_ks[:n].copy_(torch.tensor([p[1] for p in per_request], dtype=torch.int64))
        self.top_ps[:n].copy_(torch.tensor([p[2] for p in per_request]))


def sampling_batch_spec_dec_one_model(logits, temperatures, top_ks, top_ps):
    """Temperature, top-k and top-p applied to the logits: the distribution the sampling kernel draws
    from (returned whole here, so the comparison is deterministic)."""
    logits = logits / temperatures[:, None]
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_ks.clamp(min=1, max=logits.shape[-1]) - 1)[:, None])
    logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) > top_ps[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(-1, keepdim=True)


class Model:
    def __init__(self, device):
        gen = generator(17033)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=2.0)

    def forward(self, input_ids, spec_metadata: SpecMetadata):
        logits = self.emb[input_ids] @ self.lm_head
        if spec_metadata.is_all_greedy_sample:           # argmax fast path
            return torch.zeros_like(logits).scatter(1, logits.argmax(-1, keepdim=True), 1.0)
        n = input_ids.shape[0]
        return sampling_batch_spec_dec_one_model(logits, spec_metadata.temperatures[:n], spec_metadata.top_ks[:n],
                                                 spec_metadata.top_ps[:n])


def _request(temperature=None, top_k=None, top_p=None):
    wrap = (lambda v: None if v is None else [v])
    return types.SimpleNamespace(sampling_config=types.SimpleNamespace(
        temperature=wrap(temperature), top_k=wrap(top_k), top_p=wrap(top_p)))


def schedule():
    """Decode steps of two requests: (input_ids, requests)."""
    sampled = [_request(1.3, 2, 0.95), _request(0.9, 3, 0.8)]
    return [([1, 4], sampled), ([2, 5], [_request(), _request()]), ([3, 0], [_request(), _request(1.6, 4, 0.9)]),
            ([5, 2], sampled)]


class CUDAGraphRunner:
    WARMUP_STEPS = 2

    def __init__(self, device):
        self.graph_metadata, self.graphs, self.graph_outputs = {}, {}, {}
        self.input_ids = torch.zeros(BS, dtype=torch.int64, device=device)

    def capture(self, key, forward_fn, spec_metadata):
        self.graph_metadata[key] = {"spec_metadata": spec_metadata}
        static = {"input_ids": self.input_ids, "temperatures": spec_metadata.temperatures,
                  "top_ks": spec_metadata.top_ks, "top_ps": spec_metadata.top_ps}
        self.graphs[key], self.graph_outputs[key] = capture(forward_fn, device=self.input_ids.device.type,
                                                            warmups=self.WARMUP_STEPS, static=static,
                                                            name=f"bs={key[0]} greedy={key[1]}",
                                                            owner="CUDAGraphRunner")

    def replay(self, key):
        return replay(self.graphs[key], self.graph_outputs[key])

    def clear_capture_only_spec_state(self):
        cleared = 0
        for stored in self.graph_metadata.values():
            meta = stored.get("spec_metadata")
            if meta is not None and getattr(meta, "_force_non_greedy_for_capture", False):
                meta._force_non_greedy_for_capture = False
                cleared += 1
        return cleared


class PyTorchModelEngine:
    def __init__(self, device, variant, graphed):
        self.model = Model(device)
        self.spec_metadata = SpecMetadata(BS, device)
        self.variant, self.graphed = variant, graphed
        self.cuda_graph_runner = CUDAGraphRunner(device) if graphed else None

    def _capture_generation_cuda_graphs(self):
        dummy_requests = [_request() for _ in range(BS)]       # warmup requests carry no sampling params

        def _run_capture_pass(force_non_greedy: bool):
            spec_metadata = self.spec_metadata
            if force_non_greedy:
                spec_metadata._force_non_greedy_for_capture = True
                spec_metadata.is_all_greedy_sample = False
            try:
                key = (BS, spec_metadata.is_all_greedy_sample)
                graph_meta = spec_metadata.create_cuda_graph_metadata(BS)
                graph_meta.populate_sampling_params_for_one_model(dummy_requests)      # _prepare_inputs
                runner = self.cuda_graph_runner
                self.cuda_graph_runner.capture(key, lambda: self.model.forward(runner.input_ids, graph_meta),
                                               graph_meta)
            finally:
                if force_non_greedy:
                    spec_metadata._force_non_greedy_for_capture = False

        _run_capture_pass(force_non_greedy=False)       # pass 1: greedy fast path
        _run_capture_pass(force_non_greedy=True)        # pass 2: advanced sampling variant
        if self.variant == "fix":
            self.cuda_graph_runner.clear_capture_only_spec_state()
        self.spec_metadata.is_all_greedy_sample = True

    def forward(self, input_ids, requests):
        if not self.graphed:
            self.spec_metadata.populate_sampling_params_for_one_model(requests)
            return self.model.forward(input_ids, self.spec_metadata)
        self.spec_metadata.update_is_all_greedy_sample(requests)          # before the graph key is built
        key = (len(requests), self.spec_metadata.is_all_greedy_sample)
        spec_metadata = self.cuda_graph_runner.graph_metadata[key]["spec_metadata"]   # reseated as live
        self.cuda_graph_runner.input_ids.copy_(input_ids)
        spec_metadata.populate_sampling_params_for_one_model(requests)
        return self.cuda_graph_runner.replay(key)


def run(variant: str, device: str = "cpu"):
    steps = [(torch.tensor(ids, device=device), reqs) for ids, reqs in schedule()]

    def serve(graphed: bool):
        engine = PyTorchModelEngine(device, variant, graphed)
        if graphed:
            engine._capture_generation_cuda_graphs()
        return [engine.forward(ids, reqs).clone() for ids, reqs in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
