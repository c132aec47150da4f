"""The one-time FP8 KV-scale calibration step is served by a FULL graph captured without it.

Upstream: https://github.com/vllm-project/vllm/pull/25513 ("[BugFix][torch.compile] KV scale calculation
issues with FP8 quantization (#21640)"), fixing https://github.com/vllm-project/vllm/issues/21640.
Symptom: ``kv_cache_dtype="fp8"`` with ``calculate_kv_scales=True`` failed or lost accuracy in V1 unless
``enforce_eager`` was set: with graphs on, the dynamic K/V scales were not computed from the first real
batch (vLLM 0.10, summer 2025).
Mechanism: ``Attention`` computes ``_k_scale``/``_v_scale`` once, from the first real step
(``attn_metadata.enable_kv_scales_calculation``), then clears its Python flag ``calculate_kv_scales``.
That decision is Python: the graphs are captured on dummy batches, whose metadata disables the
calculation, so the captured step contains only the cache write and attention. When the first real step
fits a captured size the runner replays that graph: no scale is computed, the KV cache is written and
read with the default scale 1.0, and, since replay runs no Python, nothing ever flips the flag: every
later replay keeps the uncalibrated scale, where an eager run calibrates on step one.
Doctor: warmup-divergence, at ``maybe_calc_kv_scales`` (the capture took the no-calculation branch that an
eager first step takes the other way).
Fix (upstream): the calculation moved into the ``maybe_calc_kv_scales`` op, and ``gpu_model_runner`` sets
``cudagraph_runtime_mode = NONE`` for a step whose metadata enables the KV-scale calculation, so that step
runs eagerly; later steps replay graphs that read the calibrated scale tensors.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/25513"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "maybe_calc_kv_scales"
SYMPTOM = "FP8 KV cache keeps the default scale 1.0 under CUDA graphs: calculate_kv_scales never runs"

VOCAB, DIM, MAX_MODEL_LEN, SIZE = 12, 4, 8, 4   # one FULL graph for up to 4 tokens of one sequence
K_SCALE_CONSTANT = V_SCALE_CONSTANT = 200.0      # envs.K_SCALE_CONSTANT / V_SCALE_CONSTANT
FP8_MAX = 448.0
PAD_SLOT_ID = -1

_forward_context = SimpleNamespace(attn_metadata=None)


def get_forward_context():
    return _forward_context


def _fp8_quant(x, scale):
    """The fp8 cache store, modelled coarsely: values land on a unit grid after dividing by the scale."""
    return torch.round(x / scale).clamp(-FP8_MAX, FP8_MAX)


class Attention:
    def __init__(self, device):
        gen = generator(25513)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device, scale=0.4)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.5)
                                              for _ in range(4))
        self.calculate_kv_scales = True
        self._k_scale = torch.ones((), device=device)
        self._v_scale = torch.ones((), device=device)
        self._k_scale_float = self._v_scale_float = 1.0
        self.k_range = torch.tensor(K_SCALE_CONSTANT, device=device)
        self.v_range = torch.tensor(V_SCALE_CONSTANT, device=device)
        self.slot_pos = torch.arange(MAX_MODEL_LEN, device=device)

    def calc_kv_scales(self, query, key, value):
        self._k_scale.copy_(torch.abs(key).max() / self.k_range)
        self._v_scale.copy_(torch.abs(value).max() / self.v_range)
        self._k_scale_float = self._k_scale.item()
        self._v_scale_float = self._v_scale.item()
        # We only calculate the scales once.
        self.calculate_kv_scales = False

    def forward(self, h, positions, slot_mapping, key_cache, value_cache):
        query, key, value = h @ self.wq, h @ self.wk, h @ self.wv
        maybe_calc_kv_scales(self, query, key, value)
        # reshape_and_cache_flash with kv_cache_dtype="fp8": quantised with the layer's scale tensors
        valid = (slot_mapping >= 0)[:, None]
        slots = slot_mapping.clamp(min=0)
        key_cache[slots] = torch.where(valid, _fp8_quant(key, self._k_scale), key_cache[slots])
        value_cache[slots] = torch.where(valid, _fp8_quant(value, self._v_scale), value_cache[slots])
        k = key_cache * self._k_scale                    # dequantised in the attention kernel
        v = value_cache * self._v_scale
        scores = (query @ k.t()).masked_fill(self.slot_pos[None, :] > positions[:, None], -1e9)
        return (torch.softmax(scores, -1) @ v) @ self.wo


def maybe_calc_kv_scales(layer, query, key, value):
    attn_metadata = get_forward_context().attn_metadata
    if layer.calculate_kv_scales and attn_metadata.enable_kv_scales_calculation:
        layer.calc_kv_scales(query, key, value)


class GPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        self.layer = Attention(device)
        self.key_cache = torch.zeros(MAX_MODEL_LEN, DIM, device=device)
        self.value_cache = torch.zeros(MAX_MODEL_LEN, DIM, device=device)
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.positions = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((SIZE,), PAD_SLOT_ID, dtype=torch.long, device=device)
        if graphed:
            # _dummy_run / capture_model: dummy metadata, the KV-scale calculation disabled
            _forward_context.attn_metadata = SimpleNamespace(enable_kv_scales_calculation=False)
            self.graph, self.out = capture(
                lambda: self._model_forward(SIZE), device=device, owner="GPUModelRunner (FULL graph)",
                static={"input_ids": self.input_ids, "positions": self.positions,
                        "slot_mapping": self.slot_mapping},
                state={"key_cache": self.key_cache, "value_cache": self.value_cache})

    def _model_forward(self, n):
        h = self.layer.emb[self.input_ids[:n]]
        return self.layer.forward(h, self.positions[:n], self.slot_mapping[:n], self.key_cache, self.value_cache)

    def execute_model(self, token_ids, start_pos):
        n = len(token_ids)
        self.input_ids[:n].copy_(torch.tensor(token_ids, device=self.device))
        self.positions[:n].copy_(torch.arange(start_pos, start_pos + n, device=self.device))
        self.slot_mapping[:n].copy_(self.positions[:n])          # one sequence: slot == position
        self.slot_mapping[n:].fill_(PAD_SLOT_ID)
        attn_metadata = SimpleNamespace(enable_kv_scales_calculation=True)
        _forward_context.attn_metadata = attn_metadata
        use_graph = self.graphed
        if self.variant == "fix" and attn_metadata.enable_kv_scales_calculation and \
                self.layer.calculate_kv_scales:
            use_graph = False                                   # cudagraph_runtime_mode = NONE
        if not use_graph:
            return self._model_forward(n).clone()
        return replay(self.graph, self.out, real=n, size=SIZE, padded={"input_ids": self.input_ids,
                      "positions": self.positions})[:n].clone()


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, graphed)
        outs = [runner.execute_model([3, 7, 1], 0)]             # prefill: the first real step
        for pos, tok in ((3, 5), (4, 9), (5, 2)):                 # decode steps
            outs.append(runner.execute_model([tok], pos))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
