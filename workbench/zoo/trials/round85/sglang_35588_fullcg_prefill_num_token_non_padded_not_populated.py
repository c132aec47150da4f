"""sglang full prefill CUDA graph (FullCG): ``num_token_non_padded`` is not a registered, refreshed graph input outside gathered (DP) execution, so every replay masks padded hidden states with the capture bucket's boundary.

Upstream: https://github.com/sgl-project/sglang/pull/35588 ("[Bugfix] Fix full prefill CUDA graph padding and EAGLE
capture", merged 2026-08). Read: the PR description only ("Full prefill CUDA graphs replay fixed token buckets that may
be larger than the live batch. Models that mask padded hidden states need the live `num_token_non_padded` boundary even
when attention tensors are not gathered. Without it, padded rows can propagate through the captured graph." and the
modification "Register and populate `num_token_non_padded` for FullCG, including non-gathered execution"). The diff
was not read. The runner structure (``PrefillCudaGraphRunner.capture_prepare`` / ``load_batch``, token buckets,
largest captured first) is from the descriptions of #27988 (FullCG prefill), #28870 and #31487; the buffer registry
(``build_prefill_registry`` returning a registry with ``has_slot`` / ``get_slot(name).buffer``) from the stored upstream
test ``test/registered/unit/model_executor/test_deepstack_replay_slot.py``. The EAGLE half of the PR (capture FULL hidden
states) is not modelled.
Symptom: with the full prefill graph on, a prefill whose token count is not a captured bucket (5 tokens replayed on the
8-token graph) gives slightly different logits for its real tokens than eager prefill: no error, only drift. Batches of
an exact bucket size and eager prefill are right.
Mechanism: ``load_batch`` copies the live ``input_ids``/``positions`` into the registry's static buffers and replays the
bucket graph; the rows past the live count keep whatever earlier prefills left there (tokens of an earlier, longer
batch). The model masks those padded rows out of its hidden states with ``forward_batch.num_token_non_padded`` before an
op that mixes rows. Outside gathered DP execution that boundary was not a registered slot: the capture batch carried its
own tensor holding the bucket size, the captured mask kernel keeps reading that tensor, and no replay writes it. So the
mask keeps all bucket rows, the stale padded rows stay in, and they change what the real rows get.
Doctor: stale-input, at load_batch (the real rows depend on a graph input, the non-padded boundary, that the per-step
refresh in ``load_batch`` never writes: every replay reads the capture-time value; ``load_batch`` is where the fix
populates the registered slot).
Fix (upstream): ``num_token_non_padded`` is registered for FullCG also when not gathered, and populated with the live
count on every replay, so the captured mask sees the real boundary.
Modelled: the registry (``input_ids``, ``positions``, and the ``num_token_non_padded`` slot, registered only under
``require_gathered_buffer`` in the bug variant, always in the fix), ``PrefillCudaGraphRunner`` (buckets 4 and 8,
``capture_prepare``, ``load_batch``, ``replay``) and a one-block model: embedding + position embedding, the padded-row
mask, and an MLP whose input goes through dynamic per-tensor activation quantization. No attention (a prefill graph of a
one-request batch needs none to show the effect), no DP gather, no EAGLE. Stand-in: the row-mixing op is the dynamic
per-tensor activation scale (``scaled_fp8_quant`` with no static scale: amax over all rows / 448, uniform grid), a
stand-in for whatever downstream op the masked padded rows reach (the PR names none); a padded row with a larger
magnitude than the real rows changes the scale and so the rounding of every real row.
Workload: three prefills on the same runner (buckets 4 and 8): 8 tokens (exact bucket; its last tokens include token 13,
whose embedding is 5x larger), then 5 tokens (replays the 8-bucket: rows 5..7 still hold the first batch's tokens,
token 13 among them), then 3 tokens (the 4-bucket; row 3 holds a token of the second batch). Eager runs each prefill on
its own tokens. With the bug, the 5-token prefill's scale comes from the stale token 13 and its logits drift by up to
0.14; the 3-token prefill stays within 2e-6 of eager (its stale padded row is smaller than its real rows). The fix
variant equals eager on all three.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/35588"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "load_batch"
SYMPTOM = ("full prefill CUDA graph replayed for a non-bucket token count: the model's padded-row mask reads the "
           "capture bucket's num_token_non_padded (never refreshed outside gathered DP execution), stale padded rows "
           "enter the dynamic activation scale and the real tokens' logits drift (no error)")

VOCAB, HIDDEN, MAX_POS = 16, 8, 16
CAPTURE_NUM_TOKENS = [4, 8]
LOUD_TOKEN = 13                # its embedding is 5x larger than the others'
FP8_MAX = 448.0

_variant = "bug"


class ForwardBatch:
    def __init__(self, input_ids, positions, num_token_non_padded):
        self.input_ids, self.positions = input_ids, positions
        self.num_token_non_padded = num_token_non_padded      # 1-element device tensor
        self.num_tokens = input_ids.shape[0]


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
        if self.has_slot("num_token_non_padded"):
            self._slots["num_token_non_padded"].buffer.copy_(forward_batch.num_token_non_padded)


def build_prefill_registry(device, max_num_token, require_gathered_buffer):
    reg = CudaGraphBufferRegistry()
    reg.register("input_ids", torch.zeros(max_num_token, dtype=torch.int64, device=device))
    reg.register("positions", torch.zeros(max_num_token, dtype=torch.int64, device=device))
    if require_gathered_buffer or _variant == "fix":         # the fix: registered for FullCG also when not gathered
        reg.register("num_token_non_padded", torch.zeros(1, dtype=torch.int32, device=device))
    return reg


# --- the model ------------------------------------------------------------------------------------------------------------

def scaled_fp8_quant(x):
    """Dynamic per-tensor activation quantization (no static scale): one scale from the amax of all rows."""
    scale = x.abs().amax().clamp(min=1e-6) / FP8_MAX
    return torch.round(x / scale).clamp(-FP8_MAX, FP8_MAX) * scale


class ModelRunner:
    def __init__(self, device):
        gen = generator(35588)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        embed = r(VOCAB, HIDDEN, scale=1.0)
        embed[LOUD_TOKEN] *= 5.0
        self.embed, self.pos_embed = embed, r(MAX_POS, HIDDEN, scale=0.3)
        self.w_up, self.lm_head = r(HIDDEN, 2 * HIDDEN, scale=0.6), r(HIDDEN, VOCAB, scale=0.6)
        self.w_down = r(2 * HIDDEN, HIDDEN, scale=0.6)
        self.device = device

    def _mask_padded_hidden_states(self, hidden_states, num_token_non_padded):
        """Zero the rows past the live token count (what models that mask padded hidden states do)."""
        rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        keep = (rows < num_token_non_padded).to(hidden_states.dtype)
        return hidden_states * keep.unsqueeze(1)

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed[input_ids] + self.pos_embed[positions]
        h = self._mask_padded_hidden_states(h, forward_batch.num_token_non_padded)
        x = scaled_fp8_quant(h)
        h = h + torch.relu(x @ self.w_up) @ self.w_down
        return h @ self.lm_head

    def forward_extend(self, forward_batch):                  # eager prefill: exact shape, no padding
        return self.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


# --- runner/prefill_cuda_graph_runner.py ----------------------------------------------------------------------------------

class PrefillCudaGraphRunner:
    def __init__(self, model_runner, device, require_gathered_buffer=False):
        self.model_runner, self.device = model_runner, device
        self.capture_num_tokens = sorted(CAPTURE_NUM_TOKENS)
        self.max_num_tokens = max(self.capture_num_tokens)
        self.buffers = build_prefill_registry(device, self.max_num_tokens, require_gathered_buffer)
        self.graphs, self.output_buffers = {}, {}
        for num_tokens in reversed(self.capture_num_tokens):
            self.graphs[num_tokens], self.output_buffers[num_tokens] = self.capture_one(num_tokens)

    def capture_prepare(self, num_tokens):
        if self.buffers.has_slot("num_token_non_padded"):
            num_token_non_padded = self.buffers.get_slot("num_token_non_padded").buffer
            num_token_non_padded.fill_(num_tokens)
        else:                                                 # not a slot: the capture batch's own tensor
            num_token_non_padded = torch.full((1,), num_tokens, dtype=torch.int32, device=self.device)
        return ForwardBatch(self.buffers.get_slot("input_ids").buffer[:num_tokens],
                            self.buffers.get_slot("positions").buffer[:num_tokens], num_token_non_padded)

    def capture_one(self, num_tokens):
        fb = self.capture_prepare(num_tokens)
        mr = self.model_runner
        return capture(lambda: mr.forward(fb.input_ids, fb.positions, fb), device=self.device,
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
                        padded={"input_ids": self.buffers.get_slot("input_ids").buffer,
                                "positions": self.buffers.get_slot("positions").buffer})
        return logits[:raw]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [[3, 7, 1, 9, 4, 13, 13, 6], [2, 5, 11, 8, 10], [12, 6, 15]]

    def serve(use_cuda_graph: bool):
        mr = ModelRunner(device)
        runner = PrefillCudaGraphRunner(mr, device) if use_cuda_graph else None
        outs = []
        for tokens in prompts:
            n = len(tokens)
            fb = ForwardBatch(torch.tensor(tokens, device=device), torch.arange(n, device=device),
                              torch.full((1,), n, dtype=torch.int32, device=device))
            logits = runner.replay(fb) if runner is not None and runner.can_run(fb) else mr.forward_extend(fb)
            outs.append(logits.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
