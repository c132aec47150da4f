"""vLLM-Ascend ``_dummy_run`` stops asking for active dummy LoRAs after upstream's ``num_active_loras`` API change, so the ACL graphs are captured with no adapter active and never contain the LoRA kernels.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/6958 ("[bugfix][LoRA] Fix the lora accuracy issue introduced
by the upstream vLLM changed.", merged; description dated 2026-03-03). Read: the PR description ("Fix the LoRA e2e test accuracy issue that
introduced by the upstream PR vllm-project/vllm#32005"), the diff hunk of ``vllm_ascend/worker/model_runner_v1.py``
quoted in its review thread (``_dummy_run`` now passes ``remove_lora`` and ``num_active_loras=(self.lora_config.max_loras
if self.lora_config is not None else num_active_loras)`` to ``maybe_dummy_run_with_lora``) and the review note that
``_determine_batch_execution_and_padding`` still sees the original ``num_active_loras``; for the upstream side, the title
of vllm#32005 (graphs captured per number of active LoRAs) and its review snippet of ``maybe_select_dummy_loras``
(``effective_num_loras``: 0 when no LoRA is activated), plus a stored copy of the later upstream
``maybe_dummy_run_with_lora(lora_config, num_scheduled_tokens, num_sampled_tokens, remove_lora=True,
num_active_loras=0, ...)`` whose docstring says LoRA is activated only when ``num_active_loras > 0``, and vLLM's LoRA op
wrappers, which return early on ``if no_lora_flag_cpu.item()``. Not read: the full diff, the Ascend punica kernels
(``punica_npu``), the e2e test.
Symptom: the LoRA e2e accuracy test (``tests/e2e/singlecard/test_llama32_lora.py``) fails on vLLM-Ascend with vLLM
v0.16.0 and graph mode; in the mechanism modelled here graph-served LoRA requests come out as base-model outputs while
eager execution is correct.
Mechanism: upstream #32005 changed ``maybe_dummy_run_with_lora``: the dummy LoRA mapping is built from a new
``num_active_loras`` argument that defaults to 0, and 0 means "no adapter active" (all-zero prompt mapping). Ascend's
``NPUModelRunner._dummy_run`` kept calling it without that argument (inferred from the diff, which adds it), so every
warmup and ACL-graph capture ran with a
mapping of LoRA id 0 -> token index -1; ``LoRAKernelMeta.prepare_tensors`` then sets the host flag
``no_lora_flag_cpu``, and the shrink/expand wrappers return before launching anything. The captured graph therefore has
no LoRA kernel. Replays re-run only the recorded kernels: a real step whose tokens map to adapter slots clears the flag,
but no Python runs inside the replay, and the LoRA delta is silently dropped.
Doctor: warmup-divergence, at _dummy_run. The capture took the no-LoRA branch of a host flag and every replay keeps it,
while an eager step with active adapters now takes the LoRA branch.
Fix (upstream): ``_dummy_run`` passes ``num_active_loras=self.lora_config.max_loras`` (and ``remove_lora``), so the
dummy batch activates ``max_loras`` dummy adapters cyclically, the flag is clear at capture and the kernels are
recorded reading the persistent ``token_lora_mapping`` and stacked LoRA weights.
Modelled: ``NPUModelRunner`` (``_dummy_run``, ``capture_model``, ``execute_model``), the upstream LoRA mixin
(``maybe_dummy_run_with_lora`` / ``maybe_setup_dummy_loras`` / ``maybe_select_dummy_loras``), a LoRA manager with stacked
slot weights, ``PunicaWrapperNPU`` with ``LoRAKernelMeta`` (persistent device mapping + host ``no_lora_flag_cpu``),
``lora_shrink`` / ``lora_expand`` (vectorised stand-ins for the kernels) and a one-layer model
(embedding -> ``ColumnParallelLinearWithLoRA`` -> tanh -> lm head). Sizes: hidden 6, out 5, rank 2, vocab 11,
``max_loras`` 2, FULL decode graphs for 2 and 4 tokens (one token per request).
Workload: adapters 1 and 2 are loaded after capture (dummy adapters removed). Step 1 decodes r0 (LoRA 1), r1 (LoRA 2)
and r2 (base model), padded to the 4-token graph; step 2 r0 and r2 (graph 2); step 3 r1 alone (padded to 2). The bug's
graphs return base-model logits for every LoRA request; the fix's graphs equal eager.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/6958"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_dummy_run"
SYMPTOM = ("after the vLLM v0.16 bump, ACL-graph LoRA requests on vLLM-Ascend are served like the base model: the "
           "dummy capture activated no adapter, so the graph holds no LoRA kernel")

HIDDEN, OUT, RANK, VOCAB = 6, 5, 2, 11
MAX_LORAS, MAX_NUM_TOKENS = 2, 4
CUDAGRAPH_CAPTURE_SIZES = [2, 4]
SCALING = 0.5

_variant = "bug"


class LoRAConfig:
    max_loras = MAX_LORAS
    max_lora_rank = RANK


class LoRAKernelMeta:
    """Device mapping the kernels read, plus the host flag their Python wrappers test."""

    def __init__(self, device):
        self.token_lora_mapping = torch.full((MAX_NUM_TOKENS,), -1, dtype=torch.long, device=device)
        self.no_lora_flag_cpu = host(torch.zeros(1, dtype=torch.bool), device)

    def prepare_tensors(self, token_lora_indices: list[int]):
        n = len(token_lora_indices)
        self.token_lora_mapping[:n].copy_(torch.tensor(token_lora_indices, device=self.token_lora_mapping.device))
        self.token_lora_mapping[n:].fill_(-1)
        self.no_lora_flag_cpu[0] = all(i == -1 for i in token_lora_indices)


def lora_shrink(x, lora_a_stacked, token_lora_mapping, no_lora_flag_cpu, scaling):
    if no_lora_flag_cpu.item():                      # the wrapper's early exit: no kernel launched
        return None
    valid = (token_lora_mapping >= 0).to(x.dtype)[:, None]
    a = lora_a_stacked[token_lora_mapping.clamp(min=0)]                  # [n, rank, hidden]
    return torch.einsum("nh,nrh->nr", x, a) * valid * scaling


def lora_expand(buffer, lora_b_stacked, y, token_lora_mapping, no_lora_flag_cpu):
    if no_lora_flag_cpu.item():
        return
    valid = (token_lora_mapping >= 0).to(y.dtype)[:, None]
    b = lora_b_stacked[token_lora_mapping.clamp(min=0)]                  # [n, out, rank]
    y.add_(torch.einsum("nr,nor->no", buffer, b) * valid)


class PunicaWrapperNPU:
    def __init__(self, device):
        self.meta = LoRAKernelMeta(device)

    def update_metadata(self, token_lora_indices):
        self.meta.prepare_tensors(token_lora_indices)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale):
        mapping = self.meta.token_lora_mapping[:x.shape[0]]
        buffer = lora_shrink(x, lora_a_stacked, mapping, self.meta.no_lora_flag_cpu, scale)
        if buffer is not None:
            lora_expand(buffer, lora_b_stacked, y, mapping, self.meta.no_lora_flag_cpu)


class ColumnParallelLinearWithLoRA:
    def __init__(self, weight, punica, device):
        self.weight = weight
        self.punica_wrapper = punica
        self.lora_a_stacked = torch.zeros(MAX_LORAS, RANK, HIDDEN, device=device)
        self.lora_b_stacked = torch.zeros(MAX_LORAS, OUT, RANK, device=device)

    def forward(self, x):
        y = x @ self.weight.t()
        self.punica_wrapper.add_lora_linear(y, x, self.lora_a_stacked, self.lora_b_stacked, SCALING)
        return y


class LoRAModelManager:
    """Adapter slots: ``lora_index_to_id[slot]``; activating copies weights into the stacked buffers."""

    def __init__(self, layer, punica):
        self.layer, self.punica = layer, punica
        self.lora_index_to_id: list[int | None] = [None] * MAX_LORAS
        self.registered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add_adapter(self, lora_id, a, b):
        self.registered[lora_id] = (a, b)

    def activate_adapter(self, lora_id):
        if lora_id in self.lora_index_to_id:
            return
        slot = self.lora_index_to_id.index(None)
        self.lora_index_to_id[slot] = lora_id
        a, b = self.registered[lora_id]
        self.layer.lora_a_stacked[slot].copy_(a)
        self.layer.lora_b_stacked[slot].copy_(b)

    def remove_all_adapters(self):
        self.registered.clear()
        self.lora_index_to_id = [None] * MAX_LORAS
        self.layer.lora_a_stacked.zero_()
        self.layer.lora_b_stacked.zero_()

    def set_active_adapters(self, token_lora_mapping):
        for lora_id in sorted({i for i in token_lora_mapping if i > 0}):
            self.activate_adapter(lora_id)
        self.punica.update_metadata([self.lora_index_to_id.index(i) if i > 0 else -1 for i in token_lora_mapping])


class Model:
    def __init__(self, device, punica):
        gen = generator(6958)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.proj = ColumnParallelLinearWithLoRA(randn(OUT, HIDDEN, gen=gen, device=device, scale=0.5), punica, device)
        self.lm_head = randn(OUT, VOCAB, gen=gen, device=device, scale=0.7)

    def forward(self, input_ids):
        return torch.tanh(self.proj.forward(self.embed[input_ids])) @ self.lm_head


class NPUModelRunner:
    def __init__(self, device, use_graph):
        self.device, self.use_graph = device, use_graph
        self.lora_config = LoRAConfig()
        self.punica = PunicaWrapperNPU(device)
        self.model = Model(device, self.punica)
        self.lora_manager = LoRAModelManager(self.model.proj, self.punica)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.graphs = {}

    # --- upstream LoRAModelRunnerMixin (after vllm#32005) ---
    @contextlib.contextmanager
    def maybe_setup_dummy_loras(self, lora_config, remove_lora=True):
        gen = generator(32005)
        for lora_id in range(1, lora_config.max_loras + 1):          # dummy "warmup_{id}" adapters
            self.lora_manager.add_adapter(lora_id, randn(RANK, HIDDEN, gen=gen, device=self.device),
                                          randn(OUT, RANK, gen=gen, device=self.device))
        yield
        if remove_lora:
            self.lora_manager.remove_all_adapters()

    def maybe_select_dummy_loras(self, lora_config, num_scheduled_tokens, num_active_loras=0):
        num_reqs = len(num_scheduled_tokens)
        effective_num_loras = min(num_active_loras, lora_config.max_loras) if num_active_loras > 0 else 0
        if effective_num_loras > 0:
            prompt_lora_mapping = np.arange(num_reqs) % effective_num_loras + 1
        else:
            prompt_lora_mapping = np.zeros(num_reqs, dtype=np.int64)           # no adapter active
        self.lora_manager.set_active_adapters(np.repeat(prompt_lora_mapping, num_scheduled_tokens).tolist())

    @contextlib.contextmanager
    def maybe_dummy_run_with_lora(self, lora_config, num_scheduled_tokens, num_sampled_tokens, remove_lora=True,
                                  num_active_loras=0):
        with self.maybe_setup_dummy_loras(lora_config, remove_lora):
            self.maybe_select_dummy_loras(lora_config, num_scheduled_tokens, num_active_loras)
            yield

    # --- vllm_ascend/worker/model_runner_v1.py ---
    def _dummy_run(self, num_tokens, capture_graph=False, remove_lora=True):
        num_scheduled_tokens = np.ones(num_tokens, dtype=np.int64)            # uniform decode: 1 token per request
        num_sampled_tokens = np.ones(num_tokens, dtype=np.int64)
        if _variant == "fix":
            lora_ctx = self.maybe_dummy_run_with_lora(self.lora_config, num_scheduled_tokens, num_sampled_tokens,
                                                      remove_lora, num_active_loras=self.lora_config.max_loras)
        else:   # the pre-#32005 call: num_active_loras falls back to 0 (no adapter activated)
            lora_ctx = self.maybe_dummy_run_with_lora(self.lora_config, num_scheduled_tokens, num_sampled_tokens)
        with lora_ctx:
            self.input_ids[:num_tokens].zero_()
            if not capture_graph:
                return self.model.forward(self.input_ids[:num_tokens])
            self.graphs[num_tokens] = capture(
                lambda n=num_tokens: self.model.forward(self.input_ids[:n]), device=self.device,
                name=f"ACL graph FULL_DECODE_ONLY [{num_tokens}]", owner="NPUModelRunner (ACLGraphWrapper)",
                static={"input_ids": self.input_ids, "token_lora_mapping": self.punica.meta.token_lora_mapping})

    def capture_model(self):
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(n, capture_graph=True)

    def execute_model(self, input_ids, lora_ids):
        n = len(lora_ids)
        if not self.use_graph:
            self.lora_manager.set_active_adapters(lora_ids)
            self.input_ids[:n].copy_(input_ids)
            return self.model.forward(self.input_ids[:n]).clone()
        size = next(s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= n)
        self.lora_manager.set_active_adapters(lora_ids + [0] * (size - n))     # padded tokens: no LoRA
        self.input_ids[:n].copy_(input_ids)
        g, out = self.graphs[size]
        return replay(g, out, real=n, size=size, padded={"input_ids": self.input_ids})[:n].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(1)
    adapters = {lid: (randn(RANK, HIDDEN, gen=gen, device=device), randn(OUT, RANK, gen=gen, device=device))
                for lid in (1, 2)}
    steps = [([3, 7, 1], [1, 2, 0]), ([5, 9], [1, 0]), ([2], [2])]

    def serve(use_graph: bool):
        runner = NPUModelRunner(device, use_graph)
        runner._dummy_run(MAX_NUM_TOKENS)                    # profile run
        if use_graph:
            runner.capture_model()
        for lid, (a, b) in adapters.items():                 # the engine loads the requested adapters
            runner.lora_manager.add_adapter(lid, a, b)
        return [runner.execute_model(torch.tensor(ids, device=device), loras) for ids, loras in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
