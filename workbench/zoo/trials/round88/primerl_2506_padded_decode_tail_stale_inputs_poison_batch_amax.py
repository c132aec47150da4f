"""prime-rl rollout inference: vLLM pads a decode batch to a CUDA-graph capture size and leaves the padded tail of the persistent ``input_ids`` / ``positions`` buffers holding an earlier step's tokens, which reach the real rows through a batch-wide reduction.

Upstream: https://github.com/PrimeIntellect-ai/prime-rl/pull/2506 ("Scrub padded vLLM model inputs",
PrimeIntellect-ai/prime-rl, merged 2026-05-19, commit 845eb6e6f). Read: the PR description (the Nemotron Nano SWE
repro that ended in ``BadRequestError: Out of range float values are not JSON compliant: nan`` and "vLLM pads decode
batches up to CUDA graph capture sizes ... model-input tensors can contain stale values in the padded tail ... those
stale padded inputs were sufficient to poison replayed decode graphs"), the whole diff (the new
``src/prime_rl/inference/vllm/padded_input_scrub.py`` with ``monkey_patch_vllm_padded_input_scrub`` /
``_patched_preprocess`` / ``_zero_padded_model_inputs``, its registration in ``patches.py`` and ``server.py``, and the
CPU unit tests), and the later removal commit 0c0b92f99 (#3203), whose message says the pinned vLLM 0.26 now
"zeros the padded positions tail natively" in ``_preprocess``. Not read: vLLM's own ``GPUModelRunner`` source or the
upstream vLLM PRs it cites (#42779, #42739); the PR does not name the kernel that lets a padded row reach a real row.
Symptom: RL rollouts on a vLLM server with FULL decode CUDA graphs return NaN/garbage logprobs for real requests once
an earlier, larger batch has left its tokens in the padded tail; ``enforce_eager`` rollouts are fine.
Mechanism: vLLM V1 ``GPUModelRunner`` keeps persistent ``input_ids`` / ``positions`` device buffers.
``_prepare_inputs`` writes only the ``total_num_scheduled_tokens`` scheduled entries; ``_preprocess(scheduler_output,
num_input_tokens)`` then hands the model ``input_ids[:num_input_tokens]`` and ``positions[:num_input_tokens]`` where
``num_input_tokens`` is the batch padded up to a captured graph size. Rows past the scheduled prefix still hold the
previous step's tokens and positions, the replayed decode graph computes them as real work, and a kernel that reads
the whole padded batch lets them change the real rows.
Doctor: stale-padding, at _preprocess. Real rows depend on the padded rows of the persistent input buffers, which
``_preprocess`` leaves holding the previous step's tokens instead of a neutral value.
Fix (upstream): ``_patched_preprocess`` wraps ``GPUModelRunner._preprocess`` and ``_zero_padded_model_inputs`` zeros
``input_ids``, ``inputs_embeds`` and ``positions`` over ``[total_num_scheduled_tokens, num_input_tokens)`` before the
model (graph) runs.
Modelled: ``GPUModelRunner`` (persistent buffers, ``_prepare_inputs``, ``_preprocess``, ``_get_num_input_tokens``,
``capture_model`` / ``execute_model``), prime-rl's ``_patched_preprocess`` / ``_zero_padded_model_inputs`` as in the
diff. The model is a stand-in for the hybrid MoE decoder: token embedding (token 0, the scrubbed value, embeds to a zero
row), rotary mixing by ``positions``, and an expert MLP whose activations are quantized with a per-tensor
dynamic scale (``amax`` over every row of the batch, the online-FP8 MoE activation quantization vLLM uses). That
batch-wide ``amax`` stands in for the unnamed kernel that reads past the scheduled prefix: it is one documented way a
padded row reaches real rows, and a zeroed row is inert in it. float64, hidden 8, vocab 32, capture sizes [4, 8].
Workload: step 1 decodes 8 requests (graph 8, no padding; its rows 5-7 carry high-magnitude tokens). Step 2 decodes
5 requests padded to graph 8: rows 5-7 still hold step 1's tokens, their activations set the batch ``amax``, and the
5 real rows are quantized on a coarser grid than eager (which runs 5 rows): logits off by up to 11. Step 3 decodes 3
requests padded to graph 4; its stale row 3 (step 2's token) stays below the real rows' amax, so that step matches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PrimeIntellect-ai/prime-rl/pull/2506"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_preprocess"
SYMPTOM = ("prime-rl rollouts with vLLM FULL decode graphs: a 5-request decode step is padded to the 8-token graph and "
           "rows 5-7 of input_ids/positions still hold step 1's tokens; their activations set the batch-wide amax of "
           "the expert activation quantization, so the real requests' logits differ from eager")

HIDDEN, VOCAB, FFN = 8, 32, 16
MAX_NUM_TOKENS, MAX_POSITION = 8, 64
CUDAGRAPH_CAPTURE_SIZES = [4, 8]
QMAX = 7.0                 # quantization grid of the expert activations (coarse, so a scale change shows)
LOUD_TOKENS = (29, 30, 31)  # tokens whose embeddings are large (step 1 puts them in rows 5-7)

_variant = "bug"


@dataclass
class SchedulerOutput:
    req_ids: list[str]
    token_ids: list[int]       # one decode token per request
    positions: list[int]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


class NemotronStandIn:
    """Embedding, rotary mixing by position, quantized expert MLP (residual), LM head."""

    def __init__(self, device):
        gen = generator(2506)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        embed = r(VOCAB, HIDDEN, scale=1.0)
        embed[0] = 0.0                                    # the scrubbed token embeds to a zero row
        embed[list(LOUD_TOKENS)] *= 6.0
        self.embed = embed
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HIDDEN, 2, dtype=torch.float64) / HIDDEN))
        ang = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat([ang.cos(), ang.sin()], -1).to(device)
        self.w1, self.w2 = r(HIDDEN, FFN), r(FFN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    def rotary(self, positions, x):
        cos, sin = self.cos_sin_cache[positions].chunk(2, -1)
        x1, x2 = x[:, 0::2], x[:, 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(1)

    @staticmethod
    def per_tensor_dynamic_quant(x):
        """Online per-tensor activation quantization: one scale from the amax of the whole (padded) batch."""
        scale = x.abs().amax().clamp(min=1e-12) / QMAX
        return torch.round(x / scale).clamp(-QMAX, QMAX) * scale

    def forward(self, input_ids, positions):
        h = self.rotary(positions, self.embed[input_ids])
        a = torch.nn.functional.silu(h @ self.w1)
        h = h + self.per_tensor_dynamic_quant(a) @ self.w2
        return h @ self.lm_head


# --- prime-rl: src/prime_rl/inference/vllm/padded_input_scrub.py -------------------------------------------------

def _zero_padded_model_inputs(preprocess_result, num_scheduled_tokens, num_input_tokens):
    """Zero the model-input tail beyond scheduled tokens in-place."""
    if num_input_tokens <= num_scheduled_tokens:
        return
    input_ids, inputs_embeds, positions = preprocess_result[0], preprocess_result[1], preprocess_result[2]
    pad_slice = slice(num_scheduled_tokens, num_input_tokens)
    if input_ids is not None:
        input_ids[pad_slice].zero_()
    if inputs_embeds is not None:
        inputs_embeds[pad_slice].zero_()
    if positions is not None:
        if positions.ndim == 1:
            positions[pad_slice].zero_()
        else:
            positions[..., pad_slice].zero_()


def monkey_patch_vllm_padded_input_scrub(runner_cls) -> None:
    original_preprocess = runner_cls._preprocess

    def _patched_preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        result = original_preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors)
        _zero_padded_model_inputs(result, int(scheduler_output.total_num_scheduled_tokens), int(num_input_tokens))
        return result

    runner_cls._preprocess = _patched_preprocess


# --- vLLM V1 GPUModelRunner (the parts on this path) ---------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device = device
        self.model = NemotronStandIn(device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)   # persistent
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)   # persistent
        self.enforce_eager = enforce_eager
        self.cudagraphs: dict[int, tuple] = {}

    def _prepare_inputs(self, scheduler_output):
        n = scheduler_output.total_num_scheduled_tokens
        self.input_ids[:n].copy_(torch.tensor(scheduler_output.token_ids, device=self.device))
        self.positions[:n].copy_(torch.tensor(scheduler_output.positions, device=self.device))

    def _get_num_input_tokens(self, num_scheduled_tokens):
        if self.enforce_eager:
            return num_scheduled_tokens
        return next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_scheduled_tokens)

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        """The hazard site: the model gets the padded slices; rows past the scheduled prefix are not written."""
        input_ids = self.input_ids[:num_input_tokens]
        positions = self.positions[:num_input_tokens]
        return input_ids, None, positions, intermediate_tensors, {}

    def capture_model(self):
        for n in CUDAGRAPH_CAPTURE_SIZES:             # _dummy_run(n) on the (zeroed) buffers, then capture
            g, out = capture(lambda n=n: self.model.forward(self.input_ids[:n], self.positions[:n]),
                             device=self.device, name=f"FULL decode [{n}]", owner="GPUModelRunner",
                             static={"input_ids": self.input_ids, "positions": self.positions})
            self.cudagraphs[n] = (g, out)

    def execute_model(self, scheduler_output):
        self._prepare_inputs(scheduler_output)
        num_scheduled = scheduler_output.total_num_scheduled_tokens
        num_input_tokens = self._get_num_input_tokens(num_scheduled)
        input_ids, _, positions, _, _ = self._preprocess(scheduler_output, num_input_tokens)
        if self.enforce_eager:
            logits = self.model.forward(input_ids, positions)
        else:
            g, out = self.cudagraphs[num_input_tokens]
            scrubbed = _variant == "fix"
            logits = replay(g, out, real=num_scheduled, size=num_input_tokens,
                            padded=None if scrubbed else {"input_ids": self.input_ids, "positions": self.positions})
        return logits[:num_scheduled].clone()        # the sampler's rows


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    class Runner(GPUModelRunner):                     # a fresh class per run, so the patch never leaks
        pass

    if variant == "fix":
        monkey_patch_vllm_padded_input_scrub(Runner)

    seq_len = {f"r{i}": 10 + 3 * i for i in range(8)}
    steps = [
        ["r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7"],
        ["r0", "r1", "r2", "r3", "r4"],
        ["r0", "r1", "r2"],
    ]
    tokens = {0: [3, 7, 11, 5, 9, LOUD_TOKENS[0], LOUD_TOKENS[1], LOUD_TOKENS[2]],
              1: [4, 12, 6, 15, 8], 2: [13, 2, 10]}

    def serve(enforce_eager: bool):
        runner = Runner(device, enforce_eager)
        if not enforce_eager:
            runner.capture_model()
        lens = dict(seq_len)
        outs = []
        for i, reqs in enumerate(steps):
            so = SchedulerOutput(reqs, tokens[i], [lens[r] - 1 for r in reqs])
            outs.append(runner.execute_model(so))
            for r in reqs:
                lens[r] += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
