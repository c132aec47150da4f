"""Qwen3-TTS Code2Wav replays its own decoder CUDA graph inside vLLM's FULL capture of the stage's forward: startup crash.

Upstream: https://github.com/vllm-project/vllm-omni/pull/2910 ("[Qwen3TTS][Bugfix] Guard inner CUDA graph replay
during outer capture", merged; opened 2026-04-19). The Ascend twin, same bug on NPUGraph:
https://github.com/vllm-project/vllm-omni/pull/6639.
Symptom: Stage 1 (``model_stage: code2wav``) with ``enforce_eager: false`` and ``cudagraph_capture_sizes:
[16, 32, 48, 64]`` dies at startup: ``RuntimeError: Cannot prepare for replay during capturing stage. ... Current
cudaStreamCaptureStatus: cudaStreamCaptureStatusActive``, raised at ``cuda_graph_decoder_wrapper.py:151``,
``self.graphs[padded_size].replay()``. Eager stages work.
Mechanism: ``Qwen3TTSCode2Wav.load_weights`` enables the decoder's own graphs
(``Qwen3TTSTokenizerV2Decoder.enable_cudagraph`` -> ``CUDAGraphDecoderWrapper.warmup`` captures one graph per
padded frame count and sets ``_warmed_up``). Later vLLM's ``capture_model`` warms each size up eagerly and then runs
``_dummy_run`` in FULL mode, where ``CUDAGraphWrapper`` opens a stream capture around the whole model forward.
``Qwen3TTSCode2Wav.forward`` -> ``chunked_decode`` -> ``CUDAGraphDecoderWrapper.chunked_decode_with_cudagraph`` ->
``CUDAGraphDecoderWrapper.decode`` decides in Python (``enabled``, ``_warmed_up``, a captured bucket fits) to fill
``static_inputs`` and call ``replay()`` on the inner graph. During the eager warmup runs that is legal; inside the
outer capture the replay is refused: torch's ``CUDAGraph::replay`` runs the registered generator's
``replay_prologue``, whose ``assertNotCapturing("Cannot prepare for replay during capturing stage.")`` fails on a
capturing current stream. The exception aborts the outer capture and the stage fails to start.
Doctor: sync-in-capture, at ``decode`` (work a capturing stream refuses -- the launch of another graph -- is
attempted inside the captured forward; ``decode`` is where the choice to replay instead of launching kernels is made).
Fix (upstream): ``decode`` returns ``self.decoder(codes)`` when ``torch.cuda.is_current_stream_capturing()``: under
the outer capture the decoder's kernels are recorded into vLLM's FULL graph (which then holds its own
intermediates, not the inner graphs' static buffers); outside any capture the inner graphs still serve.
Modelled: one request per step, codebook-major ``input_ids`` of ``Q * frames`` tokens; the decoder is a code
embedding (mean over quantizers), a causal pre-transformer stand-in (two taps), a transposed-conv upsampler
(kernel = stride, as a linear map) and a 1x1 output conv with the clamp -- all causal, so zero-padding a chunk to its
graph bucket leaves the real samples unchanged, as upstream relies on; decoder chunking scaled down (6 frames, left
context 2); the inner warmup's ``device.type != "cuda"`` early return is dropped (the emulation is the device);
vLLM's runner serves only token counts that are exact capture sizes (no outer padding) and runs a larger step
eagerly, where the decoder's own graphs serve.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-omni/pull/2910"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "decode"
SYMPTOM = "FULL-mode capture of the Code2Wav stage fails: the decoder wrapper replays its inner CUDA graph in the capture"

NUM_QUANTIZERS, CODEBOOK_SIZE, HIDDEN, TOTAL_UPSAMPLE = 2, 16, 8, 4
DECODE_CHUNK_FRAMES, DECODE_LEFT_CONTEXT_FRAMES = 6, 2
DECODER_CAPTURE_SIZES = [2, 4, 8]                    # CUDAGraphDecoderWrapper.capture_sizes (frames)
CUDAGRAPH_CAPTURE_SIZES = [4, 8, 12, 16]             # Stage-1 cudagraph_capture_sizes (tokens = Q * frames)
MAX_NUM_TOKENS = 24
STEP_FRAMES = (4, 2, 6, 10, 8, 6)                   # frames per step; 10 frames = 20 tokens runs eagerly


# ----------------------------------------------------------------------------- vLLM side (FULL cudagraph mode)
_forward_context: dict = {"cudagraph_runtime_mode": "NONE", "num_tokens": 0}


@contextlib.contextmanager
def set_forward_context(cudagraph_runtime_mode, num_tokens):
    old = dict(_forward_context)
    _forward_context.update(cudagraph_runtime_mode=cudagraph_runtime_mode, num_tokens=num_tokens)
    try:
        yield
    finally:
        _forward_context.update(old)


class CUDAGraphEntry:
    def __init__(self, batch_descriptor):
        self.batch_descriptor, self.cudagraph, self.output = batch_descriptor, None, None


class CUDAGraphWrapper:
    """vllm/compilation/cuda_graph.py: capture on the first FULL call of a size, replay afterwards."""

    def __init__(self, runnable, device, graph_pool, input_ids):
        self.runnable, self.device, self.graph_pool, self.input_ids = runnable, device, graph_pool, input_ids
        self.concrete_cudagraph_entries: dict[int, CUDAGraphEntry] = {}

    def __call__(self, **kwargs):
        if _forward_context["cudagraph_runtime_mode"] != "FULL":
            return self.runnable(**kwargs)
        batch_descriptor = _forward_context["num_tokens"]
        entry = self.concrete_cudagraph_entries.setdefault(batch_descriptor, CUDAGraphEntry(batch_descriptor))
        if entry.cudagraph is None:                  # warmups ran before, as NONE-mode dummy runs
            entry.cudagraph, entry.output = capture(
                lambda: self.runnable(**kwargs), device=self.device, pool=self.graph_pool, warmups=0,
                name=f"FULL num_tokens {batch_descriptor}", owner="CUDAGraphWrapper",
                static={"input_ids": self.input_ids})
            return entry.output
        return replay(entry.cudagraph, entry.output)


# ----------------------------------------------------------------------------- the speech-tokenizer decoder
class Qwen3TTSTokenizerV2Decoder(nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        p = lambda *s, scale=0.5: nn.Parameter(randn(*s, gen=gen, device=device, scale=scale), requires_grad=False)
        self.total_upsample = TOTAL_UPSAMPLE
        self.code_embedding = p(NUM_QUANTIZERS * CODEBOOK_SIZE, HIDDEN, scale=1.0)
        self.register_buffer("code_offset", (torch.arange(NUM_QUANTIZERS) * CODEBOOK_SIZE).view(1, -1, 1).to(device))
        self.pre_transformer = nn.ParameterList([p(HIDDEN, HIDDEN), p(HIDDEN, HIDDEN)])   # causal: taps t, t-1
        self.upsample = p(HIDDEN, TOTAL_UPSAMPLE * HIDDEN)                                # ConvTranspose1d k = s
        self.decoder = p(HIDDEN, 1, scale=0.8)                                            # 1x1 conv to the wave
        self._cudagraph_enabled, self._cudagraph_wrapper = False, None

    def forward(self, codes):
        """[B, Q, T] codes -> [B, 1, T * total_upsample] waveform in [-1, 1]."""
        hidden = self.code_embedding[codes + self.code_offset].mean(1)                   # [B, T, H]
        prev = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
        hidden = torch.tanh(hidden @ self.pre_transformer[0] + prev @ self.pre_transformer[1])
        b, t, _ = hidden.shape
        hidden = torch.tanh(hidden @ self.upsample).reshape(b, t * TOTAL_UPSAMPLE, HIDDEN)
        return (hidden @ self.decoder).transpose(1, 2).clamp(min=-1.0, max=1.0)

    def enable_cudagraph(self, device, variant):
        wrapper = CUDAGraphDecoderWrapper(self, DECODER_CAPTURE_SIZES, NUM_QUANTIZERS, variant=variant)
        wrapper.warmup(device)
        self._cudagraph_wrapper, self._cudagraph_enabled = wrapper, True

    def chunked_decode(self, codes, chunk_size, left_context_size):
        if self._cudagraph_enabled and self._cudagraph_wrapper is not None:
            batch_wav = self._cudagraph_wrapper.chunked_decode_with_cudagraph(codes, chunk_size, left_context_size)
        else:
            wavs, start_index = [], 0
            while start_index < codes.shape[-1]:
                end_index = min(start_index + chunk_size, codes.shape[-1])
                context_size = left_context_size if start_index >= left_context_size else start_index
                wav_chunk = self(codes[..., start_index - context_size:end_index])
                wavs.append(wav_chunk[..., context_size * self.total_upsample:])
                start_index = end_index
            batch_wav = torch.cat(wavs, dim=-1)
        return [batch_wav[idx, :, :codes.shape[-1] * self.total_upsample] for idx in range(codes.shape[0])]


class CUDAGraphDecoderWrapper:
    """vllm_omni/model_executor/models/qwen3_tts/cuda_graph_decoder_wrapper.py"""

    def __init__(self, decoder, capture_sizes, num_quantizers, enabled=True, variant="bug"):
        self.decoder, self.capture_sizes = decoder, sorted(capture_sizes)
        self.num_quantizers, self.enabled, self.variant = num_quantizers, enabled, variant
        self.graphs, self.static_inputs, self.static_outputs = {}, {}, {}
        self._warmed_up, self._device = False, None

    def _get_padded_size(self, actual_size):
        for size in self.capture_sizes:
            if actual_size <= size:
                return size
        return None

    def warmup(self, device, dtype=torch.long):
        if not self.enabled or self._warmed_up:
            return
        self._device = device
        self.decoder.eval()
        for size in self.capture_sizes:
            self._capture(size, device, dtype)
        self._warmed_up = True

    def _capture(self, size, device, dtype):
        static_input = torch.zeros(1, self.num_quantizers, size, dtype=dtype, device=device)
        with torch.no_grad():
            graph, static_output = capture(lambda: self.decoder(static_input), device=device, warmups=1,
                                           name=f"Code2Wav decoder size {size}", owner="CUDAGraphDecoderWrapper",
                                           static={f"static_inputs[{size}]": static_input})
        self.graphs[size] = graph
        self.static_inputs[size] = static_input
        self.static_outputs[size] = static_output

    def decode(self, codes):
        if not self.enabled or not self._warmed_up or codes.shape[0] != 1:
            return self.decoder(codes)
        if self.variant == "fix" and torch.cuda.is_current_stream_capturing():
            return self.decoder(codes)           # #2910: an outer capture records the decoder's kernels
        actual_size = codes.shape[-1]
        padded_size = self._get_padded_size(actual_size)
        if padded_size is None or padded_size not in self.graphs:
            return self.decoder(codes)
        self.static_inputs[padded_size].zero_()
        self.static_inputs[padded_size][:, :, :actual_size] = codes
        output = replay(self.graphs[padded_size], self.static_outputs[padded_size])
        actual_out_len = actual_size * self.decoder.total_upsample
        return output[..., :actual_out_len].clone()

    def chunked_decode_with_cudagraph(self, codes, chunk_size=300, left_context_size=25):
        wavs, start_index, total_len = [], 0, codes.shape[-1]
        total_upsample = self.decoder.total_upsample
        while start_index < total_len:
            end_index = min(start_index + chunk_size, total_len)
            context_size = left_context_size if start_index - left_context_size > 0 else start_index
            wav_chunk = self.decode(codes[..., start_index - context_size:end_index])
            wavs.append(wav_chunk[..., context_size * total_upsample:])
            start_index = end_index
        return torch.cat(wavs, dim=-1)


class Qwen3TTSCode2Wav(nn.Module):
    """Stage-1 code2wav model: frame-aligned codec tokens in ``input_ids`` -> waveform."""

    def __init__(self, device, enforce_eager, variant):
        super().__init__()
        self.device, self.enforce_eager, self.variant = device, enforce_eager, variant
        self.decoder = Qwen3TTSTokenizerV2Decoder(generator(2910), device)
        self._num_quantizers, self._total_upsample = NUM_QUANTIZERS, TOTAL_UPSAMPLE

    def load_weights(self):
        self.decoder.eval()
        if not self.enforce_eager:                   # _maybe_enable_decoder_cudagraph
            self.decoder.enable_cudagraph(self.device, self.variant)

    @torch.no_grad()
    def forward(self, input_ids):
        q = self._num_quantizers
        ids = input_ids.reshape(-1).to(dtype=torch.long)
        frames = ids.numel() // q
        codes = ids.reshape(q, frames).unsqueeze(0)                       # codebook-major [q*F] -> [1, Q, F]
        wav = self.decoder.chunked_decode(codes, DECODE_CHUNK_FRAMES, DECODE_LEFT_CONTEXT_FRAMES)[0]
        return wav.reshape(-1)


class GPUModelRunner:
    def __init__(self, device, variant, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int32, device=device)
        self.model = Qwen3TTSCode2Wav(device, enforce_eager, variant)
        self.model.load_weights()
        self.cudagraph_batch_sizes = [] if enforce_eager else sorted(CUDAGRAPH_CAPTURE_SIZES)
        self.cudagraph_wrapper = CUDAGraphWrapper(self.model, device, graph_pool_handle(device), self.input_ids)
        self.capture_model()

    def _model_forward(self, num_tokens):
        return self.cudagraph_wrapper(input_ids=self.input_ids[:num_tokens])

    def _dummy_run(self, num_tokens, cudagraph_runtime_mode):
        with set_forward_context(cudagraph_runtime_mode, num_tokens):
            return self._model_forward(num_tokens)

    def capture_model(self):
        for num_tokens in sorted(self.cudagraph_batch_sizes, reverse=True):
            with events.warmup():
                self._dummy_run(num_tokens, "NONE")
            self._dummy_run(num_tokens, "FULL")

    def execute_model(self, codes_flat):
        n = codes_flat.numel()
        self.input_ids[:n].copy_(codes_flat)
        mode = "FULL" if n in self.cudagraph_batch_sizes else "NONE"
        with set_forward_context(mode, n):
            return self._model_forward(n).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(29100)
    steps = [torch.randint(0, CODEBOOK_SIZE, (NUM_QUANTIZERS * f,), generator=gen, dtype=torch.int32)
             for f in STEP_FRAMES]

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, enforce_eager=not graphed)
        return [runner.execute_model(codes.to(device)) for codes in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
