"""Model Runner V2 KV-sharing fast prefill with LoRA: the reduced (logits-only) pass is padded to a captured no-LoRA
piecewise graph size although the LoRA batch runs eagerly at its real size.

Upstream: https://github.com/vllm-project/vllm/pull/56456 ("[Bugfix][MRV2] Match fast-prefill padding to active LoRA
batches", vllm-project/vllm, merged 2026-09-11). Read: the PR description; a stored pre-fix
``vllm/v1/worker/gpu/attn_utils.py`` whose ``FastPrefillHelper.prepare`` calls
``self.cudagraph_manager.dispatch(num_reqs=..., num_tokens=num_logits, uniform_token_count=None, num_active_loras=0)``
and pads ``logits_indices_padded`` to ``desc.num_tokens``; and the PR's regression test
``test_fast_prefill_dispatch_preserves_active_lora_count`` (a fake manager whose no-LoRA dispatch pads to a captured
8-token PIECEWISE graph while an active-LoRA dispatch stays eager at the unpadded count; the test asserts the padded
indices keep the real logits count). Not read: the model-runner hunk that passes the count, MRV2's LoRA state code.
Symptom: with ``--kv-sharing-fast-prefill``, LoRA and piecewise CUDA graphs, a prefill batch that has an active
adapter (no LoRA graph of its size, so it runs eagerly) gets its reduced logits batch padded for a no-LoRA graph;
"the resulting padded logits metadata could have a different token shape from the actual model input" and the step
fails on a size mismatch.
Mechanism: ``GPUModelRunner.execute_model`` dispatches the main batch with ``num_active_loras`` (here: no captured
LoRA graph, so ``CUDAGraphMode.NONE`` and no padding), then ``FastPrefillHelper.prepare`` dispatches the reduced
logits batch a second time with ``num_active_loras=0``: the no-LoRA PIECEWISE ladder pads 3 logits to 4. The
KV-sharing layers then run eagerly on 4 gathered rows, while the LoRA token mapping the runner staged for that pass
covers the 3 real logits rows.
Doctor: padded-shape-mismatch, at prepare. The reduced pass runs at a graph's padded size (4 rows) and combines those
rows with the LoRA mapping sized for the 3 real rows.
Fix (upstream): pass the main dispatch's ``num_active_loras`` into ``FastPrefillHelper.prepare`` so the second
dispatch uses the same LoRA specialization (eager, unpadded here).
Modelled: ``FastPrefillHelper`` (pre-fix code, plus the fix's argument), a ``CudaGraphManager`` with the dispatch
contract of the upstream test (PIECEWISE graphs captured for sizes [4, 8] without LoRA only; any active-LoRA batch
dispatches eager at its real size) that captures and replays the KV-sharing cross-decoder pass, a tiny self-decoder
(eager) / cross-decoder (one LoRA-wrapped linear + MLP) model, and a ``PunicaWrapper`` whose ``token_lora_mapping``
is staged per pass for the rows the runner knows are real (stand-in for MRV2's LoRA state).
Workload: step 1, no adapter: a 5-token prefill + 1 decode (2 logits -> PIECEWISE graph of 4, replayed). Step 2,
one request on adapter 1: a 4-token prefill + 2 decodes (3 logits): the bug pads to 4 rows while the mapping has 3
and the LoRA add raises "The size of tensor a (4) must match the size of tensor b (3)"; with the fix the pass runs
eagerly on 3 rows and equals the eager run.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/56456"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "prepare"
SYMPTOM = ("MRV2 kv-sharing fast prefill with an active LoRA: FastPrefillHelper.prepare dispatches the logits pass with "
           "num_active_loras=0 and pads 3 logits to a 4-token no-LoRA piecewise graph, while the LoRA batch runs "
           "eager with a 3-row token mapping: the LoRA add fails on 4 vs 3 rows")

VOCAB, HIDDEN, RANK = 16, 8, 2
MAX_NUM_TOKENS = 8
MAX_LORAS = 2
CAPTURE_SIZES = [4, 8]

_variant = "bug"


@dataclasses.dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: str            # "NONE" | "PIECEWISE"
    num_tokens: int
    num_reqs: int
    num_active_loras: int = 0
    num_ubatches: int = 1


@dataclasses.dataclass(frozen=True)
class FastPrefillBatchMetadata:
    logits_indices_padded: torch.Tensor
    num_logits_indices: int


# --- vllm/lora: the punica wrapper and a LoRA-wrapped linear -----------------------------------------------------

class PunicaWrapper:
    def __init__(self, device):
        self.token_lora_mapping = torch.full((MAX_NUM_TOKENS,), -1, dtype=torch.int64, device=device)
        self.num_tokens = 0
        self.no_lora = True

    def update_metadata(self, token_lora_ids):
        n = len(token_lora_ids)
        self.token_lora_mapping[:n].copy_(torch.tensor(token_lora_ids, device=self.token_lora_mapping.device))
        self.num_tokens = n
        self.no_lora = all(i < 0 for i in token_lora_ids)


class ColumnParallelLinearWithLoRA:
    def __init__(self, base, lora_a, lora_b, punica):
        self.base, self.lora_a, self.lora_b, self.punica = base, lora_a, lora_b, punica

    def __call__(self, x):
        y = x @ self.base
        if self.punica.no_lora:                 # the no-LoRA graphs run without the LoRA kernels
            return y
        mapping = self.punica.token_lora_mapping[:self.punica.num_tokens]     # one entry per staged token
        idx = mapping.clamp(min=0)
        shrink = (x.unsqueeze(-1) * self.lora_a[idx]).sum(1)                  # x's rows against the mapping's
        delta = (shrink.unsqueeze(-1) * self.lora_b[idx]).sum(1) * (mapping >= 0).unsqueeze(-1)
        return y + delta                        # x's rows vs the mapping's rows


# --- the model (Gemma3n-like YOCO split) -------------------------------------------------------------------------

class Model:
    def __init__(self, w, punica):
        self.w = w
        self.qkv = ColumnParallelLinearWithLoRA(w["proj"], w["lora_a"], w["lora_b"], punica)

    def self_decoder(self, input_ids, positions):
        x = self.w["embed"][input_ids] + self.w["pos"][positions]
        return x + torch.tanh(x @ self.w["self"])

    def cross_decoder(self, hidden_states):
        """The KV-sharing layers, run on the reduced (logits-only) batch."""
        h = hidden_states + torch.tanh(self.qkv(hidden_states))
        return h + torch.tanh(h @ self.w["mlp"])


# --- vllm/v1/worker/gpu/cudagraph_utils.py: dispatch per the upstream test's contract ---------------------------

class CudaGraphManager:
    def __init__(self, model, device, enabled):
        self.model, self.device, self.enabled = model, device, enabled
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)   # the PW graph's static input
        self.graphs = {}

    def dispatch(self, *, num_reqs, num_tokens, uniform_token_count=None, num_active_loras=0):
        """A captured no-LoRA PIECEWISE graph pads; an active-LoRA batch has no graph and stays eager."""
        if self.enabled and num_active_loras == 0:
            size = next((s for s in CAPTURE_SIZES if s >= num_tokens), None)
            if size is not None:
                return BatchExecutionDescriptor("PIECEWISE", size, num_reqs, num_active_loras)
        return BatchExecutionDescriptor("NONE", num_tokens, num_reqs, num_active_loras)

    def capture(self):
        for n in sorted(CAPTURE_SIZES, reverse=True):
            self.graphs[n] = capture(lambda n=n: self.model.cross_decoder(self.hidden_states[:n]),
                                     device=self.device, name=f"cross_decoder PIECEWISE [{n}]",
                                     owner="CudaGraphManager (PIECEWISE)",
                                     static={"hidden_states": self.hidden_states})

    def run_cross_decoder(self, desc, hidden_states, num_real):
        n = hidden_states.shape[0]
        if desc.cg_mode == "PIECEWISE" and n in self.graphs:
            self.hidden_states[:n].copy_(hidden_states)
            g, out = self.graphs[n]
            return replay(g, out, real=num_real, size=n)
        return self.model.cross_decoder(hidden_states)


# --- vllm/v1/worker/gpu/attn_utils.py ----------------------------------------------------------------------------

class FastPrefillHelper:
    def __init__(self, cudagraph_manager, max_num_tokens):
        self.max_num_tokens = max_num_tokens
        self.cudagraph_manager = cudagraph_manager
        self.logits_indices_buf = torch.zeros(max_num_tokens, dtype=torch.int64, device=cudagraph_manager.device)

    def prepare(self, logits_indices, num_reqs, has_prefill, batch_desc, num_active_loras=0):
        if not has_prefill or batch_desc.cg_mode == "FULL" or batch_desc.num_ubatches > 1:
            return None
        buf = self.logits_indices_buf
        num_logits = logits_indices.shape[0]
        buf[:num_logits].copy_(logits_indices)
        buf[num_logits:] = logits_indices[-1]
        desc = self.cudagraph_manager.dispatch(
            num_reqs=num_reqs, num_tokens=num_logits, uniform_token_count=None,
            num_active_loras=num_active_loras if _variant == "fix" else 0)
        num_logits_padded = min(desc.num_tokens, self.max_num_tokens)
        return FastPrefillBatchMetadata(buf[:num_logits_padded], num_logits)


# --- vllm/v1/worker/gpu/model_runner.py --------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, weights, device, use_cudagraph):
        self.device = device
        self.punica_wrapper = PunicaWrapper(device)
        self.model = Model(weights, self.punica_wrapper)
        self.cudagraph_manager = CudaGraphManager(self.model, device, use_cudagraph)
        self.fast_prefill = FastPrefillHelper(self.cudagraph_manager, MAX_NUM_TOKENS)
        if use_cudagraph:
            self.punica_wrapper.update_metadata([-1] * MAX_NUM_TOKENS)      # capture the no-LoRA graphs
            self.cudagraph_manager.capture()

    def execute_model(self, reqs):
        """``reqs``: (token_ids, positions, lora_id) per request; the last token of each is its logits row."""
        token_ids = [t for r in reqs for t in r[0]]
        positions = [p for r in reqs for p in r[1]]
        logits_indices, logit_loras, at = [], [], 0
        for toks, _, lora_id in reqs:
            at += len(toks)
            logits_indices.append(at - 1)
            logit_loras.append(lora_id)
        num_active_loras = len({i for i in logit_loras if i >= 0})
        desc = self.cudagraph_manager.dispatch(num_reqs=len(reqs), num_tokens=len(token_ids),
                                               num_active_loras=num_active_loras)
        input_ids = torch.tensor(token_ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        hidden = self.model.self_decoder(input_ids, pos)
        meta = self.fast_prefill.prepare(torch.tensor(logits_indices, device=self.device), len(reqs),
                                         has_prefill=True, batch_desc=desc, num_active_loras=num_active_loras)
        # the LoRA mapping of the reduced pass: one entry per real logits row
        self.punica_wrapper.update_metadata(logit_loras)
        rows = hidden[meta.logits_indices_padded]
        cross_desc = self.cudagraph_manager.dispatch(num_reqs=len(reqs), num_tokens=meta.num_logits_indices,
                                                     num_active_loras=num_active_loras)
        out = self.cudagraph_manager.run_cross_decoder(cross_desc, rows, meta.num_logits_indices)
        return out[:meta.num_logits_indices] @ self.model.w["lm_head"]


# --- the workload ------------------------------------------------------------------------------------------------

def _weights(device):
    gen = generator(56456)
    r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
    return {"embed": r(VOCAB, HIDDEN, scale=1.0), "pos": r(MAX_NUM_TOKENS, HIDDEN), "self": r(HIDDEN, HIDDEN),
            "proj": r(HIDDEN, HIDDEN), "mlp": r(HIDDEN, HIDDEN), "lm_head": r(HIDDEN, VOCAB),
            "lora_a": r(MAX_LORAS, HIDDEN, RANK), "lora_b": r(MAX_LORAS, RANK, HIDDEN)}


STEPS = [
    [([3, 7, 1, 9, 4], [0, 1, 2, 3, 4], -1), ([12], [6], -1)],                         # no adapter
    [([2, 8, 6, 11], [0, 1, 2, 3], 1), ([5], [4], -1), ([14], [7], -1)],             # request 0 on adapter 1
]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def eager():
        runner = GPUModelRunner(_weights(device), device, use_cudagraph=False)
        return [runner.execute_model(step) for step in STEPS]

    def served():
        runner = GPUModelRunner(_weights(device), device, use_cudagraph=True)
        return [runner.execute_model(step) for step in STEPS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
