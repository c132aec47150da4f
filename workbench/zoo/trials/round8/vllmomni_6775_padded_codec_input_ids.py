"""The Code2Wav stage gets input_ids padded to a CUDA-graph size but per-request token counts unpadded.

Upstream: https://github.com/vllm-project/vllm-omni/pull/6775 ("[Bugfix] Give exact-shape codec models an
unpadded input_ids view", closes vllm-omni#6712 "Stage 2 graph padding desynchronizes seq_token_counts
from Code2Wav input_ids").
Symptom: MiniCPM-o 4.5 with graphs on for the Code2Wav stage (``enforce_eager: false``) raises
``MiniCPMO45Code2WavBatchError("seq_token_count_mismatch")`` on the first batch whose token count is not a
capture size (e.g. the short final chunks), killing EngineCore; eager never reproduces it (vllm-omni,
Aug 2026).
Mechanism: the cudagraph dispatcher rounds ``num_tokens`` up to a capture size (PIECEWISE too), and the
generation runner's ``_preprocess`` sizes ``input_ids`` to that padded count. The same runner hands the
model ``seq_token_counts`` with the scheduler's real per-request counts. The codec model splits the flat
``input_ids`` by those counts, so on every padded batch the padded tensor and the real counts disagree.
Doctor: padded-shape-mismatch, at ``_split_segments`` (padded ``input_ids`` split by real counts).
Fix (upstream): a ``requires_exact_input_shape`` model flag; for such models the runner slices
``input_ids`` back to the unpadded token count before calling the model.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-omni/pull/6775"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_split_segments"
SYMPTOM = "seq_token_count_mismatch raised on every padded Code2Wav batch (EngineCore dies upstream)"
VOCAB, UP, BUCKET, MAX_TOKENS = 16, 3, 8, 16
CAPTURE_SIZES = [4, 8, 16]


class MiniCPMO45Code2WavBatchError(RuntimeError):
    pass


def _split_segments(input_ids, seq_token_counts):
    flat = input_ids.reshape(-1)
    normalized = [int(c) for c in seq_token_counts]
    if sum(normalized) != flat.numel():
        raise MiniCPMO45Code2WavBatchError(
            f"seq_token_count_mismatch: counts sum to {sum(normalized)}, input_ids has {flat.numel()}")
    return list(torch.split(flat, normalized))


class Code2Wav:
    """Codec tokens -> waveform; the vocoder runs through an inner graph padded to a bucket."""

    requires_exact_input_shape = True

    def __init__(self, device, graphed):
        gen = generator(6775)
        self.emb = randn(VOCAB, UP, gen=gen, device=device)
        self.device, self.graphed = device, graphed
        self.codes = torch.zeros(BUCKET, dtype=torch.long, device=device)
        if graphed:                                     # CUDAGraphDecoderWrapper: warm up, capture a bucket
            self.graph, self.out = capture(lambda: self.vocoder(self.codes), device=device,
                                           static={"codes": self.codes}, owner="CUDAGraphDecoderWrapper")

    def vocoder(self, codes):
        return torch.tanh(self.emb[codes] * 1.5)

    def _decode(self, seg):
        n = seg.shape[0]
        if not self.graphed:
            return self.vocoder(seg).reshape(-1)
        self.codes[:n].copy_(seg)
        self.codes[n:].zero_()                          # the wrapper pads to its bucket with code 0
        return replay(self.graph, self.out, real=n, size=BUCKET, padded={})[:n].reshape(-1).clone()

    def forward(self, input_ids, positions=None, seq_token_counts=None):
        del positions
        return [self._decode(seg) for seg in _split_segments(input_ids, seq_token_counts)]


class GPUGenerationModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        self.model = Code2Wav(device, graphed)
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)

    def _determine_batch_execution_and_padding(self, num_tokens):
        if not self.graphed:
            return num_tokens
        return next(s for s in CAPTURE_SIZES if s >= num_tokens)   # dispatcher rounds up (PIECEWISE too)

    def _preprocess(self, num_tokens_padded):
        return self.input_ids[:num_tokens_padded]

    def execute_model(self, chunks):
        tokens = [len(c) for c in chunks]
        num_tokens = sum(tokens)
        self.input_ids[:num_tokens] = torch.tensor([t for c in chunks for t in c], device=self.device)
        num_tokens_padded = self._determine_batch_execution_and_padding(num_tokens)
        input_ids = self._preprocess(num_tokens_padded)
        if self.variant == "fix" and getattr(self.model, "requires_exact_input_shape", False):
            input_ids = input_ids[:num_tokens]
        model_kwargs = {"seq_token_counts": tokens}
        return self.model.forward(input_ids, None, **model_kwargs)


def run(variant: str, device: str = "cpu"):
    steps = [[[1, 5, 9], [2, 7, 3, 3, 8]],            # 8 tokens: a capture size, no padding
             [[4, 6, 11, 2], [13, 1, 0, 5]],          # 8 tokens
             [[12, 3], [6]]]                          # final chunks: 3 tokens, padded to 4

    def serve(graphed: bool):
        runner = GPUGenerationModelRunner(device, variant, graphed)
        outs = []
        for chunks in steps:
            outs.extend(runner.execute_model(chunks))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
