"""Qwen3-TTS's streaming vocoder captures its decoder graphs after the process reports ready; the first request's reference-code event sync lands inside the capture.

Upstream: https://github.com/sgl-project/sglang-omni/pull/1786 ("[qwen3-tts]: Fix Qwen3-TTS vocoder graph capture
readiness race", opened 2026-08-28, merged; it supersedes the closed #1735, "[Qwen3-TTS] Make initial vocoder CUDA
Graph capture startup-safe").
Symptom: on a cold start, the first request sent as soon as ``/health`` answers 200 fails with HTTP 500. #1735
reports "``cudaErrorStreamCaptureUnsupported``, graph invalidation, and HTTP request failure". It depends on startup
timing. After the fix, 10/10 fresh starts each answered an immediate request with 200.
Mechanism: in ``sglang_omni/models/qwen3_tts/streaming_vocoder.py``, ``Qwen3TTSStreamingVocoderScheduler.
on_serving_start()`` called ``self._initial_decode_graphs.capture()`` and ``self._followup_decode_graphs.capture()``
(``_Qwen3TTSInitialDecodeGraphs.capture``: per (frames, batch) key, two warmups, ``capture_stream.synchronize()``,
then ``torch.cuda.graph(graph, pool=graph_pool, stream=capture_stream)`` in the default
``capture_error_mode="global"``). ``on_serving_start()`` runs on the scheduler thread that ``Stage.start()``
launches. ``Stage.start()`` returns without waiting for that thread, so the process publishes readiness while the
vocoder is still capturing. An immediate voice-clone request then reaches the same process's preprocessing
(``_Qwen3TTSAdhocReferenceHook.encode_one``). It submits the reference audio to ``_Qwen3TTSRefCodeBatcher``, whose
``qwen3-tts-ref-code`` thread encodes it with the speech tokenizer and then waits on a CUDA event
(``_synchronize_outcomes``: ``handoff = torch.cuda.Event(); handoff.record(self._encode_stream);
handoff.synchronize()``). While a global-mode capture is open, CUDA refuses that wait from any thread in the
process. The request fails, and the refused call invalidates the vocoder's capture. Without graphs there is no
capture window, so the same interleaving is harmless. In the model the process's other threads are generators.
They take turns in a fixed order (``yield_to_other_threads``); there are no real races. The scheduler thread that
``Stage.start()`` launched gets its first turn once the request handler waits for its reference codes, which is
after readiness. Warmups and captures take a while, so the other threads get turns during them. During the
warmups the ref-code thread launches its encode. Inside the first capture it reaches its event wait, on the
capturing thread, and the capture refuses the wait there, as CUDA does process-wide in global mode. The error
reaches the waiting request and aborts that capture. The vocoder logs it, and that (frames, batch) key stays
graph-less.
Doctor: sync-in-capture, at on_serving_start. The event wait in ``_synchronize_outcomes`` is a host
synchronisation, and it runs while a capture is open: the one ``on_serving_start`` opened on the scheduler thread
after readiness. The bug lives in ``on_serving_start``. That is the function where the fix changed code: it took
the capture out of the serving start and out of the window in which requests are already accepted.
Fix (upstream): the captures move to a new ``warmup_now()``
(``self._initial_decode_graphs.capture(); self._followup_decode_graphs.capture()``). The stage factory
``create_vocoder_executor()`` in ``sglang_omni/models/qwen3_tts/stages.py`` calls it under the GPU startup lock,
before the process publishes readiness ("Factory construction completes before the stage process publishes
readiness, so CUDA capture cannot overlap request-time GPU work from colocated stages"). ``on_serving_start()``
only builds the async decode queues and workers. (The pre-fix ``on_serving_start`` and the post-fix
``warmup_now``/``on_serving_start``/``create_vocoder_executor`` were read; the capture mode is unchanged.)
Modelled: a speech tokenizer (an encoder that gives 2 codebooks of 16 codes from 4 samples per frame, and a
decoder: summed codebook embeddings, a kernel-2 causal mix, 4 samples per frame), a speaker encoder, and an eager
talker that generates 6 code frames from the reference codes, the speaker embedding and the text. Left context is 4
frames, the initial chunk 2 frames, the follow-up stride 2 frames, so every streaming decode is a 6-frame window.
Each graph holder captures batches (1, 2) into its own pool. The async initial/follow-up worker threads are folded
into ``decode_delta``, which picks the holder they would use. The reference waveform is uploaded on the request
thread. The ref-code batcher's event is recorded on the current stream (on the CPU the engine's ``synchronize``
stands for the event wait). A refused wait fails the batch's futures. In the upstream batcher that was read,
``_run`` does not catch an error from ``_synchronize_outcomes``: the thread dies, and the request's
``result(timeout=130.0)`` fails. Pinned staging, bad-code screening, batching of several streams,
``inference_mode`` and the serving loop are left out.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue

import torch
import torch.nn.functional as F

from workbench.engine import events, graph_pool_handle, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

UPSTREAM = "https://github.com/sgl-project/sglang-omni/pull/1786"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "on_serving_start"
SYMPTOM = ("HTTP 500 on the first request after /health: the vocoder still captures its graphs on the scheduler "
           "thread, and the reference-code encode's CUDA event sync is refused by the global-mode capture")

NUM_QUANTIZERS, CODEBOOK_SIZE, HIDDEN, SAMPLES_PER_FRAME = 2, 16, 8, 4
DEFAULT_QWEN3_TTS_LEFT_CONTEXT_FRAMES = 4
DEFAULT_QWEN3_TTS_INITIAL_CHUNK_FRAMES = 2
DEFAULT_QWEN3_TTS_STREAM_FOLLOWUP_STRIDE = 2
DEFAULT_QWEN3_TTS_STREAM_INITIAL_FOLLOWUP_STRIDE = 2
GRAPH_BATCH_SIZES = (1, 2)
REF_FRAMES, GEN_FRAMES, TEXT_VOCAB = 5, 6, 11

OTHER_THREADS: list = []             # the process's other threads (generators), in the order they got work


def start_thread(target) -> None:
    """``threading.Thread(target=...).start()``: ``target`` is a generator function. Its thread first runs at
    the caller's next wait, and each ``yield`` in it is a point where the thread is preempted."""
    OTHER_THREADS.append(target())


def yield_to_other_threads() -> None:
    """The process's other threads each get one turn, in order: each runs to its next ``yield`` or to its end.
    If this is called inside an open global-mode capture, their CUDA calls land in it. The capture refuses a wait
    there, as CUDA refuses it process-wide. The refused call fails in its own thread and invalidates the capture,
    so its error propagates here, into the capture."""
    for _ in range(len(OTHER_THREADS)):
        if not OTHER_THREADS:
            break
        thread = OTHER_THREADS.pop(0)
        try:
            next(thread)
        except StopIteration:
            continue
        OTHER_THREADS.append(thread)


def _await_result(future: concurrent.futures.Future):
    """``future.result(timeout=130.0)``: this thread blocks while the others run."""
    while not future.done() and OTHER_THREADS:
        yield_to_other_threads()
    return future.result(timeout=0)


# --- the speech tokenizer (Qwen3TTSTokenizer: encoder for reference codes, decoder for the vocoder) -----------

class _EncoderOutput:
    def __init__(self, audio_codes: list):
        self.audio_codes = audio_codes


class Qwen3TTSTokenizerDecoder:
    def __init__(self, gen, device):
        self.total_upsample = SAMPLES_PER_FRAME
        self.codebooks = randn(NUM_QUANTIZERS, CODEBOOK_SIZE, HIDDEN, gen=gen, device=device)
        self.w_in = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_mix = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_up = randn(HIDDEN, SAMPLES_PER_FRAME, gen=gen, device=device, scale=0.5)

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> waveform [B, 1, T * samples_per_frame]."""
        batch, _, frames = codes.shape
        x = self.codebooks[0][codes[:, 0]]
        for q in range(1, NUM_QUANTIZERS):
            x = x + self.codebooks[q][codes[:, q]]
        h = torch.tanh(x @ self.w_in)
        h = h + F.pad(h, (0, 0, 1, 0))[:, :frames] @ self.w_mix          # causal conv, kernel 2
        return torch.tanh(h @ self.w_up).reshape(batch, 1, frames * SAMPLES_PER_FRAME)

    def chunked_decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self(codes)


class Qwen3TTSTokenizerModel:
    def __init__(self, device):
        gen = generator(1786)
        self.w_enc = randn(NUM_QUANTIZERS, SAMPLES_PER_FRAME, CODEBOOK_SIZE, gen=gen, device=device)
        self.decoder = Qwen3TTSTokenizerDecoder(gen, device)


class Qwen3TTSTokenizer:
    def __init__(self, device):
        self.model = Qwen3TTSTokenizerModel(device)

    def encode(self, waveforms: list, sr: int) -> _EncoderOutput:
        """Waveforms (on the device) -> one [T, Q] code tensor each."""
        del sr
        codes = []
        for waveform in waveforms:
            frames = waveform.reshape(-1, SAMPLES_PER_FRAME)
            logits = torch.einsum("ts,qsc->tqc", frames, self.model.w_enc)
            codes.append(logits.argmax(dim=-1))
        return _EncoderOutput(codes)


# --- sglang_omni/models/qwen3_tts/request_builders.py: the reference-code batcher and the ad-hoc hook ----------

class _Qwen3TTSRefCodeBatcher:
    """Encodes reference audio on its own thread ("qwen3-tts-ref-code") and resolves a future per reference."""

    def __init__(self, speech_tokenizer, *, device):
        self._speech_tokenizer = speech_tokenizer
        self._device = torch.device(device)
        self._queue: queue.Queue = queue.Queue()

    def submit(self, waveform, sample_rate: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((waveform, int(sample_rate), future))
        start_thread(self._run)                            # the batcher thread wakes up on the queued item
        return future

    def _drain(self) -> list:
        batch = []
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    def _synchronize_outcomes(self, outcomes: dict) -> None:
        # note (luojiaxuan, upstream): resolve futures only after the encode kernels finish.
        del outcomes
        if self._device.type == "cuda":
            handoff = torch.cuda.Event()
            handoff.record(torch.cuda.current_stream(self._device))
            handoff.synchronize()
        else:
            synchronize(self._device)                      # the event wait, on the emulation

    def _run(self):
        """One iteration of the thread's loop: drain a batch, encode it, wait for the encode, resolve the futures."""
        batch = self._drain()
        if not batch:
            return
        outcomes: dict = {}
        groups: dict = {}
        for index, (waveform, sample_rate, _) in enumerate(batch):
            groups.setdefault(sample_rate, []).append((index, waveform))
        for sample_rate, group in groups.items():
            encoded = self._speech_tokenizer.encode([w for _, w in group], sr=sample_rate).audio_codes
            for (index, _), code in zip(group, encoded, strict=True):
                outcomes[index] = code
        yield                                              # encode launched; preempted before the wait
        try:
            self._synchronize_outcomes(outcomes)
        except BaseException as exc:
            for _, _, future in batch:                     # the batch's requests fail (HTTP 500)
                future.set_exception(exc)
            raise                                          # the refused call invalidates the open capture
        for index, (_, _, future) in enumerate(batch):
            future.set_result(outcomes[index])


class Qwen3TTSModel:
    """The talker side's model: the speaker encoder and the speech tokenizer it encodes references with."""

    def __init__(self, device, speech_tokenizer):
        gen = generator(17860)
        self.device = torch.device(device)
        self.speech_tokenizer = speech_tokenizer
        self.w_spk = randn(SAMPLES_PER_FRAME, HIDDEN, gen=gen, device=device)
        self.codec_embed = randn(NUM_QUANTIZERS, CODEBOOK_SIZE, HIDDEN, gen=gen, device=device, scale=0.5)
        self.text_embed = randn(TEXT_VOCAB, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_h = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_head = randn(HIDDEN, NUM_QUANTIZERS * CODEBOOK_SIZE, gen=gen, device=device)

    def extract_speaker_embedding(self, audio: torch.Tensor) -> torch.Tensor:
        return torch.tanh(audio.reshape(-1, SAMPLES_PER_FRAME) @ self.w_spk).mean(dim=0)

    def generate(self, ref_code, speaker_embedding, text_ids) -> torch.Tensor:
        """The talker (eager): one [Q] code frame per text token, in-context on the reference codes."""
        context = sum(self.codec_embed[q][ref_code[:, q]] for q in range(NUM_QUANTIZERS)).mean(dim=0)
        prev = ref_code[-1]
        frames = []
        for token in text_ids:
            x = sum(self.codec_embed[q][prev[q]] for q in range(NUM_QUANTIZERS))
            h = torch.tanh((x + context + speaker_embedding + self.text_embed[token]) @ self.w_h)
            prev = (h @ self.w_head).reshape(NUM_QUANTIZERS, CODEBOOK_SIZE).argmax(dim=-1)
            frames.append(prev)
        return torch.stack(frames)


class _Qwen3TTSAdhocReferenceHook:
    def __init__(self, *, model):
        self._model = model
        self._ref_code_batcher = _Qwen3TTSRefCodeBatcher(model.speech_tokenizer, device=model.device)

    def encode_one(self, ref_audio: torch.Tensor, sample_rate: int) -> dict:
        waveform = ref_audio.to(self._model.device)
        ref_code_future = self._ref_code_batcher.submit(waveform, sample_rate)
        speaker_embedding = self._model.extract_speaker_embedding(waveform)
        ref_code = _await_result(ref_code_future)
        return {"ref_code": [ref_code], "ref_spk_embedding": [speaker_embedding], "icl_mode": [True]}


# --- sglang_omni/models/qwen3_tts/streaming_vocoder.py ---------------------------------------------------------

class _Qwen3TTSStreamState:
    def __init__(self):
        self.code_chunks: list = []
        self.total_frames = self.pruned_frames = self.ref_frames = 0
        self.emitted_generated_frames = self.next_decode_generated_frames = self.decoded_chunks = 0
        self.num_quantizers: int | None = None
        self.pending_ref_frames = 0
        self.initial_chunk_frames = DEFAULT_QWEN3_TTS_INITIAL_CHUNK_FRAMES


class _Qwen3TTSDecodePlan:
    def __init__(self, decoder_input, absolute_emitted_frames, generated_frames, window_start,
                 emitted_generated_frames):
        self.decoder_input, self.absolute_emitted_frames = decoder_input, absolute_emitted_frames
        self.generated_frames, self.window_start = generated_frames, window_start
        self.emitted_generated_frames = emitted_generated_frames


class _Qwen3TTSInitialDecodeGraphs:
    """CUDA graphs for fixed shape streaming decodes, one holder per stream."""

    def __init__(self, decoder, *, name, device, num_quantizers, input_frames, batch_sizes=GRAPH_BATCH_SIZES,
                 enabled=True):
        self._decoder, self._name, self._device = decoder, name, torch.device(device)
        self._num_quantizers = int(num_quantizers)
        frames = input_frames if isinstance(input_frames, (tuple, list)) else (input_frames,)
        self._input_frames = tuple(sorted(set(int(f) for f in frames if int(f) > 0)))
        self._batch_sizes = tuple(sorted(set(int(size) for size in batch_sizes)))
        self._enabled = bool(enabled)
        self._graphs: dict = {}
        self._inputs: dict = {}
        self._outputs: dict = {}

    def _capture_body(self, static_input: torch.Tensor) -> torch.Tensor:
        yield_to_other_threads()       # the capture is open (and takes a while): the other threads keep running
        return self._decoder(static_input)

    def capture(self) -> None:
        if not self._enabled or self._graphs:
            return
        graph_pool = graph_pool_handle(self._device)
        for input_frames, batch_size in ((f, b) for f in self._input_frames for b in self._batch_sizes):
            try:
                static_input = torch.zeros((batch_size, self._num_quantizers, input_frames), dtype=torch.long,
                                           device=self._device)
                with events.warmup():
                    for _ in range(2):
                        self._decoder(static_input)
                yield_to_other_threads()                         # the warmups run: the other threads keep running
                synchronize(self._device)                        # capture_stream.synchronize()
                graph, static_output = capture(                 # torch.cuda.graph(graph, pool=graph_pool, ...)
                    lambda: self._capture_body(static_input), device=str(self._device), pool=graph_pool,
                    warmups=0, name=f"{self._name} frames={input_frames} batch={batch_size}",
                    static={"static_input": static_input}, owner=f"_Qwen3TTSInitialDecodeGraphs {self._name}")
            except Exception as exc:
                logger.warning("Qwen3-TTS decoder graph capture failed for frames=%d batch=%d: %s",
                               input_frames, batch_size, exc)
                continue
            self._graphs[(input_frames, batch_size)] = graph
            self._inputs[(input_frames, batch_size)] = static_input
            self._outputs[(input_frames, batch_size)] = static_output

    def decode(self, codes: torch.Tensor) -> torch.Tensor | None:
        if (not self._graphs or codes.ndim != 3 or int(codes.shape[1]) != self._num_quantizers
                or int(codes.shape[2]) not in self._input_frames):
            return None
        batch_size = int(codes.shape[0])
        bucket = next((size for size in self._batch_sizes if size >= batch_size), None)
        key = (int(codes.shape[2]), bucket) if bucket is not None else None
        if key is None or key not in self._graphs:
            return None
        static_input = self._inputs[key]
        static_input.zero_()
        static_input[:batch_size].copy_(codes)
        out = replay(self._graphs[key], self._outputs[key], real=batch_size, size=bucket)
        return out[:batch_size].clone()


class Qwen3TTSStreamingVocoderScheduler:
    """Decode Qwen3-TTS codec frames (StreamingVocoderBase)."""

    def __init__(self, tokenizer, *, device, variant, initial_cuda_graph=True, followup_cuda_graph=True,
                 async_decode=True):
        self._variant = variant
        self._device = torch.device(device)
        self._decoder = tokenizer.model.decoder
        left = DEFAULT_QWEN3_TTS_LEFT_CONTEXT_FRAMES
        self._initial_decode_graphs = _Qwen3TTSInitialDecodeGraphs(
            self._decoder, name="initial", device=device, num_quantizers=NUM_QUANTIZERS,
            input_frames=left + DEFAULT_QWEN3_TTS_INITIAL_CHUNK_FRAMES, enabled=initial_cuda_graph)
        self._followup_decode_graphs = _Qwen3TTSInitialDecodeGraphs(
            self._decoder, name="followup", device=device, num_quantizers=NUM_QUANTIZERS,
            input_frames=(left + DEFAULT_QWEN3_TTS_STREAM_FOLLOWUP_STRIDE,
                          left + DEFAULT_QWEN3_TTS_STREAM_INITIAL_FOLLOWUP_STRIDE),
            enabled=followup_cuda_graph)
        self._samples_per_frame = int(self._decoder.total_upsample)
        self._stream_followup_stride = DEFAULT_QWEN3_TTS_STREAM_FOLLOWUP_STRIDE
        self._stream_initial_followup_stride = DEFAULT_QWEN3_TTS_STREAM_INITIAL_FOLLOWUP_STRIDE
        self._stream_left_context_frames = left
        self._async_decode = bool(async_decode)
        self._initial_queue = self._followup_queue = None

    def start(self):
        """The scheduler thread's body: ``on_serving_start()``, then the serving loop (not modelled)."""
        self.on_serving_start()
        yield

    def warmup_now(self) -> None:
        """#1786: called by the stage factory, before the process publishes readiness."""
        if not self._async_decode:
            return
        self._initial_decode_graphs.capture()
        self._followup_decode_graphs.capture()

    def on_serving_start(self) -> None:
        if not self._async_decode:
            return
        if self._variant == "bug":     # before #1786: captured here, on the thread Stage.start() just launched
            self._initial_decode_graphs.capture()
            self._followup_decode_graphs.capture()
        self._initial_queue = queue.Queue()
        self._followup_queue = queue.PriorityQueue()

    def create_stream_state(self, request_id: str) -> _Qwen3TTSStreamState:
        del request_id
        return _Qwen3TTSStreamState()

    def latch_stream_contract(self, state: _Qwen3TTSStreamState, metadata: dict) -> None:
        state.num_quantizers = int(metadata["num_quantizers"])
        state.pending_ref_frames = int(metadata["ref_code_len"])

    def ingest(self, state: _Qwen3TTSStreamState, codes: torch.Tensor) -> None:
        if state.pending_ref_frames:
            state.ref_frames = state.pending_ref_frames
            state.pending_ref_frames = 0
        state.code_chunks.append(codes)
        state.total_frames += int(codes.shape[0])

    def _next_decode_threshold(self, state: _Qwen3TTSStreamState) -> int:
        return state.next_decode_generated_frames or state.initial_chunk_frames

    def should_decode(self, state: _Qwen3TTSStreamState, *, is_final: bool) -> bool:
        return is_final or state.total_frames - state.ref_frames >= self._next_decode_threshold(state)

    def _build_decode_plan(self, state: _Qwen3TTSStreamState, *, is_final: bool) -> _Qwen3TTSDecodePlan | None:
        available_generated_frames = state.total_frames - state.ref_frames
        if available_generated_frames <= state.emitted_generated_frames:
            return None
        next_frames = self._next_decode_threshold(state)
        if not is_final and available_generated_frames < next_frames:
            state.next_decode_generated_frames = next_frames
            return None
        generated_frames = available_generated_frames
        absolute_emitted = state.ref_frames + state.emitted_generated_frames
        window_start = max(0, absolute_emitted - self._stream_left_context_frames)
        window_end = state.ref_frames + generated_frames
        while (state.code_chunks
               and state.pruned_frames + int(state.code_chunks[0].shape[0]) <= window_start):
            state.pruned_frames += int(state.code_chunks.pop(0).shape[0])
        codes = torch.cat(state.code_chunks, dim=0)
        decoder_input = (codes[window_start - state.pruned_frames: window_end - state.pruned_frames]
                         .transpose(0, 1).unsqueeze(0))
        return _Qwen3TTSDecodePlan(decoder_input, absolute_emitted, generated_frames, window_start,
                                   state.emitted_generated_frames)

    def _launch_decode_plans(self, plans: list, *, graphs: _Qwen3TTSInitialDecodeGraphs) -> list:
        decoder_input = torch.cat([plan.decoder_input for plan in plans], dim=0).contiguous()
        waveform = graphs.decode(decoder_input)
        if waveform is None:
            waveform = self._decoder.chunked_decode(decoder_input)
        return [self._extract_delta(plan, waveform[index, 0]).to(torch.float32)
                for index, plan in enumerate(plans)]

    def _extract_delta(self, plan: _Qwen3TTSDecodePlan, waveform: torch.Tensor) -> torch.Tensor:
        trim_frames = plan.absolute_emitted_frames - plan.window_start
        trim_samples = min(trim_frames * self._samples_per_frame, int(waveform.shape[-1]))
        new_frames = plan.generated_frames - plan.emitted_generated_frames
        return waveform[trim_samples: trim_samples + new_frames * self._samples_per_frame]

    def _commit_decode_plan(self, state, plan, delta) -> torch.Tensor:
        state.emitted_generated_frames = plan.generated_frames
        state.decoded_chunks += 1
        stride = self._stream_initial_followup_stride if state.decoded_chunks == 1 else self._stream_followup_stride
        state.next_decode_generated_frames = plan.generated_frames + stride
        return delta

    def decode_delta(self, state: _Qwen3TTSStreamState, *, is_final: bool) -> torch.Tensor | None:
        plan = self._build_decode_plan(state, is_final=is_final)
        if plan is None:
            return None
        # the initial worker decodes on _decode_stream (initial holder), the follow-up worker on
        # _followup_decode_stream (follow-up holder)
        graphs = self._initial_decode_graphs if state.decoded_chunks == 0 else self._followup_decode_graphs
        delta = self._launch_decode_plans([plan], graphs=graphs)[0]
        return self._commit_decode_plan(state, plan, delta)


# --- sglang_omni/models/qwen3_tts/stages.py and the stage runtime ----------------------------------------------

def create_vocoder_executor(tokenizer, *, device, variant, initial_cuda_graph=True, followup_cuda_graph=True):
    scheduler = Qwen3TTSStreamingVocoderScheduler(tokenizer, device=device, variant=variant,
                                                  initial_cuda_graph=initial_cuda_graph,
                                                  followup_cuda_graph=followup_cuda_graph)
    if variant == "fix":
        # note (ratish): Factory construction completes before the stage process publishes readiness, so CUDA
        # capture cannot overlap request-time GPU work from colocated stages.
        scheduler.warmup_now()
    return scheduler


class Stage:
    def __init__(self, name, scheduler):
        self.name, self.scheduler = name, scheduler

    def start(self) -> None:
        """Launches the scheduler thread and returns without waiting for its initialization."""
        start_thread(self.scheduler.start)


class Qwen3TTSServer:
    """One process, colocated stages: preprocessing (reference encode), talker, streaming vocoder."""

    def __init__(self, device, variant, cuda_graph: bool):
        self.device = device
        tokenizer = Qwen3TTSTokenizer(device)
        self.model = Qwen3TTSModel(device, tokenizer)
        # stage factories, under the GPU startup lock
        self.reference_hook = _Qwen3TTSAdhocReferenceHook(model=self.model)
        self.vocoder = create_vocoder_executor(tokenizer, device=device, variant=variant,
                                               initial_cuda_graph=cuda_graph, followup_cuda_graph=cuda_graph)
        self.stages = [Stage("vocoder", self.vocoder)]
        for stage in self.stages:
            stage.start()
        self.ready = True                                      # readiness published: /health answers 200

    def speech(self, request_id, ref_audio, sample_rate, text_ids) -> list:
        """POST /v1/audio/speech (voice clone, streaming codec output)."""
        assert self.ready
        prompt = self.reference_hook.encode_one(ref_audio, sample_rate)
        ref_code = prompt["ref_code"][0]
        codes = self.model.generate(ref_code, prompt["ref_spk_embedding"][0], text_ids)
        state = self.vocoder.create_stream_state(request_id)
        self.vocoder.latch_stream_contract(state, {"num_quantizers": NUM_QUANTIZERS,
                                                   "ref_code_len": int(ref_code.shape[0])})
        chunks = [torch.cat([ref_code, codes[:1]], dim=0)] + [codes[i:i + 1] for i in range(1, len(codes))]
        audio = []
        for chunk in chunks:
            self.vocoder.ingest(state, chunk)
            if self.vocoder.should_decode(state, is_final=False):
                delta = self.vocoder.decode_delta(state, is_final=False)
                if delta is not None:
                    audio.append(delta)
        delta = self.vocoder.decode_delta(state, is_final=True)
        if delta is not None:
            audio.append(delta)
        return [torch.cat(audio), codes.to(torch.float32), ref_code.to(torch.float32)]


def run(variant: str, device: str = "cpu"):
    gen = generator(178600)
    ref_audio = torch.randn(REF_FRAMES * SAMPLES_PER_FRAME, generator=gen)      # the client's reference clip
    text_ids = torch.randint(0, TEXT_VOCAB, (GEN_FRAMES,), generator=gen).tolist()

    def cold_start_then_request(cuda_graph: bool):
        OTHER_THREADS.clear()
        server = Qwen3TTSServer(device, variant, cuda_graph)
        return server.speech("req-0", ref_audio, 24000, text_ids)   # sent as soon as /health answers

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: cold_start_then_request(True),
                   lambda: cold_start_then_request(False))
