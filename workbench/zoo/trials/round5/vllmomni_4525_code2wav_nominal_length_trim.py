"""Code2Wav graph output trimmed to the nominal length keeps samples computed from the zero padding.

Upstream: https://github.com/vllm-project/vllm-omni/pull/4525 ("[Bugfix][Qwen3-Omni] Fix Code2Wav
CUDA-graph output length surplus (#4466)"), issue vllm-project/vllm-omni#4466.
Symptom: with CUDA graphs on in Qwen3-Omni's Code2Wav stage, streamed audio gets a fixed ~46 ms of
extra samples in its ramp-up chunks, heard as a "noticeable lag in the middle" (eager is clean).
Mechanism: ``CUDAGraphDecoderWrapper._decode`` zero-pads a chunk of codec frames up to the next
captured size and replays that size's graph. Code2Wav's forward returns fewer samples than nominal
(``frames * total_upsample`` minus a fixed causal-conv trim), but the wrapper sliced the padded
graph's output to the nominal ``actual_size * total_upsample``. For every chunk that is not an exact
capture size, the last trim-constant samples handed out are computed from the padded frames: audio
eager never produces.
Doctor: stale-padding, at ``_decode`` (the slice that hands out samples of the padded frames).
Fix (upstream): trim relative to the captured buffer's length, ``out.shape[-1] - (padded_size -
actual_size) * total_upsample``, so the graph output equals the eager forward (a no-op for decoders
that return the nominal length).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-omni/pull/4525"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_decode"
SYMPTOM = "padded chunks return trim-constant extra samples (audible lag) made from the zero padding"
NUM_QUANTIZERS, CODEBOOK, CHANNELS, UPSAMPLE, KERNEL = 2, 8, 3, 4, 4     # trim constant = KERNEL - 1


class Code2Wav(torch.nn.Module):
    """Codec decoder: codebook embeddings, upsampling, and a valid (unpadded) causal conv whose
    output is ``frames * total_upsample - (KERNEL - 1)`` samples long."""

    def __init__(self, device: str) -> None:
        super().__init__()
        gen = generator(4525)
        self.total_upsample = UPSAMPLE
        self.codebooks = randn(NUM_QUANTIZERS, CODEBOOK, CHANNELS, gen=gen, device=device)
        self.conv_w = randn(1, CHANNELS, KERNEL, gen=gen, device=device, scale=0.5)

    def forward(self, codes):                                          # codes: [B, Q, F]
        emb = sum(self.codebooks[q][codes[:, q, :]] for q in range(NUM_QUANTIZERS))      # [B, F, C]
        up = emb.transpose(1, 2).repeat_interleave(self.total_upsample, dim=-1)          # [B, C, F*U]
        return torch.tanh(torch.nn.functional.conv1d(up, self.conv_w))                    # [B, 1, F*U - K + 1]


class CUDAGraphDecoderWrapper:
    """Captures the decoder for fixed frame counts; a chunk replays the smallest size that fits."""

    def __init__(self, decoder: Code2Wav, capture_sizes: list[int], device: str, trim_to_buffer: bool) -> None:
        self.decoder = decoder
        self.capture_sizes = sorted(capture_sizes)
        self.device = device
        self.trim_to_buffer = trim_to_buffer
        self.graphs, self.static_inputs, self.static_outputs = {}, {}, {}

    def warmup(self) -> None:
        for size in self.capture_sizes:
            self._capture(1, size)

    def _capture(self, bs: int, size: int) -> None:
        static_input = torch.zeros(bs, NUM_QUANTIZERS, size, dtype=torch.long, device=self.device)
        g, static_output = capture(lambda: self.decoder(static_input), device=self.device, name=f"seq {size}",
                                   static={"codes": static_input}, owner="Code2Wav CUDAGraphDecoderWrapper")
        key = (bs, size)
        self.graphs[key], self.static_inputs[key], self.static_outputs[key] = g, static_input, static_output

    def _get_padded_size(self, actual_size: int):
        return next((s for s in self.capture_sizes if actual_size <= s), None)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        actual_size = codes.shape[-1]
        padded_size = self._get_padded_size(actual_size)
        if padded_size is None:
            return self.decoder(codes)
        key = (1, padded_size)
        self.static_inputs[key].zero_()                                 # zero-pad up to the bucket
        self.static_inputs[key][:, :, :actual_size] = codes
        out = replay(self.graphs[key], self.static_outputs[key])
        if self.trim_to_buffer:
            actual_out_len = out.shape[-1] - (padded_size - actual_size) * self.decoder.total_upsample
        else:
            actual_out_len = actual_size * self.decoder.total_upsample
        return out[..., :actual_out_len].clone()


def chunks(device: str):
    """A streamed utterance: ramp-up chunks of 3 and 6 frames (padded to 4 and 8), steady chunks of 4 and 8."""
    gen = generator(4466)
    return [torch.randint(0, CODEBOOK, (1, NUM_QUANTIZERS, f), generator=gen).to(device) for f in (3, 4, 6, 8)]


def run(variant: str, device: str = "cpu"):
    decoder = Code2Wav(device)
    stream = chunks(device)

    def served():
        wrapper = CUDAGraphDecoderWrapper(decoder, [4, 8], device, trim_to_buffer=(variant == "fix"))
        wrapper.warmup()
        return [wrapper._decode(c) for c in stream]

    def eager():
        return [decoder(c) for c in stream]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
