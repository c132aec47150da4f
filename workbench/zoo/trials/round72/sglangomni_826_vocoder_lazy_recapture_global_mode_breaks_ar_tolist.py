"""MOSS-TTS-Local's streaming vocoder re-captures its decode graphs lazily in "global" capture mode; the colocated AR stage's ``next_token_ids.tolist()`` on its own thread is refused and the request fails with HTTP 500.

Upstream: https://github.com/sgl-project/sglang-omni/pull/826 ("[MOSS]: Use thread_local capture_error_mode for
CUDA graph", opened and merged 2026-06-19; fixes issue #825, "MOSS streaming vocoder lazy CUDA-graph recapture can
race colocated AR .tolist() under global capture mode"). The same fix for Ming-Omni is #830.
Symptom: in colocated serving (the AR stage and the vocoder stage in one process), an occasional HTTP 500 on the
AR side: ``operation not permitted when stream is capturing``. It happens only when a lazy vocoder re-capture
overlaps an AR step. The vocoder capture that was open at that moment fails too. With graphs off nothing goes wrong.
Mechanism: ``MossTTSLocalStreamingVocoderScheduler`` (``sglang_omni/models/moss_tts_local/streaming_vocoder.py``)
captures its codec-decode graphs in the factory (``warmup_now``), before the stage is ready. But non-streaming
traffic closes that idle startup session (``_close_idle_startup_session_locked``). The next streaming request then
takes a slot through ``_ensure_slot`` -> ``_ensure_session_graphed``. That builds a new ``_CodecStreamSession`` and
re-captures (``warmup_cuda_graph`` -> ``MossVocoderCudaGraphRunner.warmup`` -> ``_capture_frame_count`` per T,
largest first). The re-capture runs synchronously on the vocoder's scheduler loop while serving is live.
``_capture_frame_count`` opened ``torch.cuda.graph(graph, pool=self._pool)``. No mode was passed, so PyTorch used
``capture_error_mode="global"``, and CUDA then refuses potentially unsafe calls from *every* thread of the process
while the capture is open. Meanwhile the AR stage's scheduler thread processes its decode batch result, and that
calls ``next_token_ids.tolist()`` on the CUDA tensor of sampled ids: a device-to-host copy plus a sync. CUDA
refuses it ("operation not permitted when stream is capturing"). The AR batch fails, and its request gets an HTTP
500. The refused call also invalidates the vocoder's capture, and ``warmup`` logs it and leaves that T on eager.
In the model the AR scheduler is a real second thread (``threading.Thread``). The two threads take turns in a fixed
order through ``threading.Event`` hand-offs, so the interleaving is deterministic. Every codec decode
(``_decode_frame``) takes a while, so the colocated AR thread gets one step each time: warmup decodes and the
captured decode alike. The 4th AR step of request C lands inside the capture of T=2.
Doctor: sync-in-capture, at _capture_frame_count. A host synchronisation (the AR thread's ``.tolist()``) is
attempted while a capture is open, and only the capture's mode decides whether it is refused. The bug lives in
``_capture_frame_count``. That is where the fix changed code: the capture opened there in global mode, which makes
a capture on one thread forbid value reads on every other thread.
Fix (upstream): ``_capture_frame_count`` captures with ``torch.cuda.graph(graph, pool=self._pool,
capture_error_mode="thread_local")``, so only the capturing thread is checked. A unit test parses the runner's
source (``ast``) to assert the keyword is there. (The post-fix ``vocoder_cuda_graph.py`` and
``streaming_vocoder.py`` were read; the one-line change is quoted from the PR body.)
Modelled: the codec (MOSS-Audio-Tokenizer-v2) is summed codebook embeddings plus a sinusoidal position from the
per-slot offset, a recurrent causal mix whose last hidden state is the per-slot streaming state, and an upsampling
head with 2 channels and 4 samples per frame. The codec batch is 2 stream slots plus 1 offline slot. The graphs
are captured for T in (1, 2), with 3 warmups each. The AR model (backbone plus the local micro-decode of a text
token and 3 RVQ codes) is one greedy recurrent step, run eagerly. Its ``OmniScheduler`` runs every admitted
request in one batch. If a step raises, that batch's requests fail with HTTP 500. Requests: A is non-streaming (it
closes the startup session), B is streaming (5 frames; its first chunk triggers the lazy re-capture), and C is
non-streaming (10 frames; the AR thread decodes it during the re-capture). The HTTP client raises on a 500.
Left out are the non-streaming packed-attention decoder (an eager full decode stands for it), coalescing of several
streams, radix hashing, SSE framing, the VRAM guard, the codec's attention cache patch and the AR stage's own
graphs.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import NamedTuple

import torch

from workbench.engine import events, graph_pool_handle, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

UPSTREAM = "https://github.com/sgl-project/sglang-omni/pull/826"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_capture_frame_count"
SYMPTOM = ("HTTP 500 on the AR side (operation not permitted when stream is capturing): the streaming vocoder's "
           "lazy re-capture, in global capture mode, refuses the colocated AR thread's next_token_ids.tolist()")

N_VQ, CODE_VOCAB, TEXT_VOCAB, AR_HIDDEN = 3, 16, 12, 8
CODEC_HIDDEN, SAMPLES_PER_FRAME, CHANNELS = 8, 4, 2
STREAM_SLOTS, OFFLINE_SLOTS = 2, 1
STREAM_CHUNK_FRAMES, INITIAL_CHUNK_FRAMES, MAX_STEP_FRAMES = 2, 2, 2
CUDA_GRAPH_FRAMES = [1, 2]
WARMUP_ITERS = 3


# --- the process: colocated stages --------------------------------------------------------------------------

_COLOCATED_SCHEDULERS: list = []      # the AR stage's scheduler (its own thread), in the same process


def _colocated_stages_make_progress() -> None:
    """A codec decode takes a while (kernel launches, GPU time). Meanwhile each colocated stage's scheduler thread
    runs its next step, if it has work. The hand-off is deterministic: this thread waits until that step is done."""
    for scheduler in _COLOCATED_SCHEDULERS:
        if scheduler.has_work():
            scheduler.take_turn()


# --- the codec (MOSS-Audio-Tokenizer-v2), streaming ---------------------------------------------------------

class _DecodeResult(NamedTuple):
    audio: torch.Tensor
    audio_lengths: torch.Tensor


class _StreamingState:
    """Per-slot causal state of one ``codec.streaming(batch_size)`` context (stable storage across steps)."""

    def __init__(self, batch_size: int, device):
        self.exec_mask = torch.ones(batch_size, dtype=torch.bool, device=device)
        self.prev_hidden = torch.zeros(batch_size, CODEC_HIDDEN, device=device)
        self.offset = torch.zeros(batch_size, dtype=torch.long, device=device)

    def reset(self, reset_mask: torch.Tensor) -> None:
        self.prev_hidden.masked_fill_(reset_mask[:, None], 0.0)
        self.offset.masked_fill_(reset_mask, 0)


class MossAudioTokenizerCodec:
    def __init__(self, device):
        gen = generator(8260)
        self.device = torch.device(device)
        self.codebooks = randn(N_VQ, CODE_VOCAB, CODEC_HIDDEN, gen=gen, device=device, scale=0.7)
        self.freqs = randn(CODEC_HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_in = randn(CODEC_HIDDEN, CODEC_HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_rec = randn(CODEC_HIDDEN, CODEC_HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_up = randn(CODEC_HIDDEN, CHANNELS * SAMPLES_PER_FRAME, gen=gen, device=device, scale=0.6)
        self._streaming_state: _StreamingState | None = None

    @contextlib.contextmanager
    def streaming(self, batch_size: int):
        self._streaming_state = _StreamingState(batch_size, self.device)
        try:
            yield
        finally:
            self._streaming_state = None

    def _set_streaming_exec_mask(self, exec_mask: torch.Tensor) -> None:
        self._streaming_state.exec_mask.copy_(exec_mask)

    def _decode_with_state(self, codes, lengths, state: _StreamingState) -> _DecodeResult:
        """codes [n_vq, B, T] -> audio [B, channels, T * samples_per_frame]; advances the exec-masked slots."""
        _, batch, frames = codes.shape
        x = self.codebooks[0][codes[0]]
        for q in range(1, N_VQ):
            x = x + self.codebooks[q][codes[q]]
        pos = (state.offset[:, None] + torch.arange(frames, device=codes.device)).to(torch.float32)
        x = x + torch.sin(pos[..., None] * self.freqs)
        h = state.prev_hidden
        hs = []
        for t in range(frames):
            h = torch.tanh(x[:, t] @ self.w_in + h @ self.w_rec)
            hs.append(h)
        out = torch.tanh(torch.stack(hs, dim=1) @ self.w_up)                     # [B, T, C * S]
        audio = out.reshape(batch, frames, CHANNELS, SAMPLES_PER_FRAME).permute(0, 2, 1, 3)
        audio = audio.reshape(batch, CHANNELS, frames * SAMPLES_PER_FRAME)
        mask = state.exec_mask
        state.prev_hidden.copy_(torch.where(mask[:, None], h, state.prev_hidden))
        state.offset.copy_(torch.where(mask, state.offset + frames, state.offset))
        return _DecodeResult(audio, lengths * SAMPLES_PER_FRAME)

    def _decode_frame(self, codes: torch.Tensor, codes_lengths: torch.Tensor) -> _DecodeResult:
        _colocated_stages_make_progress()
        return self._decode_with_state(codes, codes_lengths, self._streaming_state)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Non-streaming decode of one utterance ``[n_vq, T]`` -> ``[channels, samples]``."""
        _colocated_stages_make_progress()
        frames = int(codes.shape[1])
        state = _StreamingState(1, self.device)
        lengths = torch.full((1,), frames, dtype=torch.long, device=self.device)
        return self._decode_with_state(codes[:, None, :], lengths, state).audio[0]


# --- sglang_omni/models/moss_tts_local/vocoder_cuda_graph.py ------------------------------------------------

class _CapturedVocoderGraph(NamedTuple):
    graph: object
    static_codes: torch.Tensor
    static_lengths: torch.Tensor
    static_audio: torch.Tensor
    static_audio_lengths: torch.Tensor


class MossVocoderCudaGraphRunner:
    """Warmup-captured, sealed replay of exact-T graphs for the MOSS codec decode (B fixed at the slot width)."""

    def __init__(self, codec, *, batch_size: int, n_vq: int, max_frames: int, variant: str,
                 warmup_iters: int = WARMUP_ITERS):
        self._codec = codec
        self._batch_size = int(batch_size)
        self._n_vq = int(n_vq)
        self._device = codec.device
        self._max_frames = int(max_frames)
        self._warmup_iters = int(warmup_iters)
        self._graphs: dict[int, _CapturedVocoderGraph] = {}
        self._pool = None
        self._sealed = False
        self._variant = variant
        self._reset_mask = torch.ones(self._batch_size, dtype=torch.bool, device=self._device)

    @torch.no_grad()
    def _reset_state(self) -> None:
        self._codec._streaming_state.reset(self._reset_mask)

    @torch.no_grad()
    def _capture_frame_count(self, frame_count: int) -> None:
        b, n = self._batch_size, self._n_vq
        device = self._device
        static_codes = torch.zeros(n, b, frame_count, dtype=torch.long, device=device)
        static_lengths = torch.full((b,), frame_count, dtype=torch.long, device=device)
        exec_mask = torch.ones(b, dtype=torch.bool, device=device)
        self._codec._set_streaming_exec_mask(exec_mask)
        for _ in range(self._warmup_iters):                  # side-stream warmup upstream
            with events.warmup():
                self._codec._decode_frame(static_codes, static_lengths)
        synchronize(device)
        self._reset_state()                                  # offset 0 after warmup, before capture
        self._codec._set_streaming_exec_mask(exec_mask)
        if self._pool is None:
            self._pool = graph_pool_handle(device)
        # bug: torch.cuda.graph(graph, pool=self._pool) -- the default "global" mode forbids value reads on every
        # thread of the process while this capture is open; #826 passes capture_error_mode="thread_local"
        mode = "thread_local" if self._variant == "fix" else "global"
        state = self._codec._streaming_state
        graph, result = capture(lambda: self._codec._decode_frame(static_codes, static_lengths),
                                device=str(device), pool=self._pool, warmups=0, name=f"vocoder T={frame_count}",
                                static={"static_codes": static_codes, "exec_mask": state.exec_mask},
                                state={"prev_hidden": state.prev_hidden, "offset": state.offset},
                                owner="MossVocoderCudaGraphRunner", capture_error_mode=mode)
        self._graphs[frame_count] = _CapturedVocoderGraph(graph, static_codes, static_lengths, result.audio,
                                                          result.audio_lengths)
        logger.info("Captured MOSS vocoder CUDA graph T=%d (B=%d)", frame_count, b)

    @torch.no_grad()
    def warmup(self, frames) -> None:
        """Capture one graph per T, once, then seal. The caller resets all slots afterwards."""
        if self._sealed:
            logger.warning("MossVocoderCudaGraphRunner.warmup called after seal; ignoring")
            return
        for t in sorted(dict.fromkeys(int(x) for x in frames), reverse=True):     # largest T first (shared pool)
            if t in self._graphs or not 1 <= t <= self._max_frames:
                continue
            try:
                self._capture_frame_count(t)
            except Exception as exc:                         # best effort: an uncaptured T falls back to eager
                self._graphs.pop(t, None)
                logger.warning("MOSS vocoder CG capture failed for T=%d: %s; will use eager", t, exc)
        self._sealed = True

    def captured_frames(self) -> list[int]:
        return sorted(self._graphs.keys())

    @torch.no_grad()
    def decode_step(self, codes_step: torch.Tensor, exec_mask: torch.Tensor):
        n, b, t = codes_step.shape
        if b != self._batch_size or n != self._n_vq:
            return None
        entry = self._graphs.get(int(t))
        if entry is None:
            return None
        self._codec._set_streaming_exec_mask(exec_mask)
        entry.static_codes.copy_(codes_step)
        return replay(entry.graph, (entry.static_audio, entry.static_audio_lengths))


# --- sglang_omni/models/moss_tts_local/streaming_vocoder.py -------------------------------------------------

class _CodecStreamSession:
    """Persistent batched ``codec.streaming()`` session: stream slots for live requests, offline slots."""

    def __init__(self, codec, *, stream_slots: int, offline_slots: int, n_vq: int, variant: str):
        self._codec = codec
        self._stream_slots = int(stream_slots)
        self._offline_slots = int(offline_slots)
        self._batch_size = self._stream_slots + self._offline_slots
        self._n_vq = int(n_vq)
        self._device = codec.device
        self._variant = variant
        self._free_stream_slots = list(range(self._stream_slots))
        self._closed = False
        self._cg_runner: MossVocoderCudaGraphRunner | None = None
        self.warmup_attempted = False
        self._exit_stack = contextlib.ExitStack()
        with torch.no_grad():
            self._exit_stack.enter_context(codec.streaming(self._batch_size))

    def warmup_cuda_graph(self, frames: list[int]) -> list[int]:
        self.warmup_attempted = True
        if self._closed:
            return []
        if self._cg_runner is None:
            self._cg_runner = MossVocoderCudaGraphRunner(self._codec, batch_size=self._batch_size, n_vq=self._n_vq,
                                                         max_frames=max(frames) if frames else 1,
                                                         variant=self._variant)
        try:
            self._cg_runner.warmup(frames)
        except Exception:
            self._cg_runner = None
            raise
        self._reset_slots(list(range(self._batch_size)))
        captured = self._cg_runner.captured_frames()
        if not captured:
            self._cg_runner = None
        return captured

    def has_cuda_graph_runner(self) -> bool:
        return bool(self._cg_runner and self._cg_runner.captured_frames())

    def acquire(self) -> int | None:
        return self._free_stream_slots.pop() if self._free_stream_slots else None

    def release(self, slot: int) -> None:
        if self._closed:
            return
        self._reset_slots([slot])
        self._free_stream_slots.append(slot)

    def close(self) -> None:
        if self._closed:
            return
        self._cg_runner = None
        with torch.no_grad():
            self._exit_stack.close()
        self._closed = True

    def _reset_slots(self, slots: list[int]) -> None:
        reset_mask = torch.zeros(self._batch_size, dtype=torch.bool, device=self._device)
        reset_mask[slots] = True
        with torch.no_grad():
            self._codec._streaming_state.reset(reset_mask)

    def step(self, slot_codes: dict) -> dict:
        """Advance the participating slots by one uniform-length step: slot -> ``[n_vq, T]`` codes in,
        slot -> ``[channels, samples]`` audio out."""
        if not slot_codes:
            return {}
        (step_t,) = {int(codes.shape[1]) for codes in slot_codes.values()}
        codes_step = torch.zeros(self._n_vq, self._batch_size, step_t, dtype=torch.long, device=self._device)
        codes_lengths = torch.zeros(self._batch_size, dtype=torch.long, device=self._device)
        exec_mask = torch.zeros(self._batch_size, dtype=torch.bool, device=self._device)
        for slot, codes in slot_codes.items():
            codes_step[:, slot, :] = codes.to(device=self._device, dtype=torch.long)
            codes_lengths[slot] = step_t
            exec_mask[slot] = True
        slots = list(slot_codes)
        with torch.no_grad():
            graphed = self._cg_runner.decode_step(codes_step, exec_mask) if self._cg_runner is not None else None
            if graphed is not None:
                audio, audio_lengths = graphed
            else:
                self._codec._set_streaming_exec_mask(exec_mask)
                result = self._codec._decode_frame(codes_step, codes_lengths)
                audio, audio_lengths = result.audio, result.audio_lengths
        audio_cpu = audio[slots].detach().to("cpu", torch.float32)               # one batched D2H per step
        lengths_cpu = audio_lengths[slots].detach().to("cpu")
        return {slot: audio_cpu[i, :, :int(lengths_cpu[i])] for i, slot in enumerate(slots)}

    def decode_offline(self, codes_list: list, *, max_step_frames: int) -> list:
        wavs = []
        for wave_start in range(0, len(codes_list), self._offline_slots):
            wave = codes_list[wave_start: wave_start + self._offline_slots]
            slots = [self._stream_slots + i for i in range(len(wave))]
            self._reset_slots(slots)
            cursors = [0] * len(wave)
            chunks = [[] for _ in wave]
            while True:
                remaining = [int(codes.shape[1]) - cur for codes, cur in zip(wave, cursors)]
                positive = [r for r in remaining if r > 0]
                if not positive:
                    break
                step_t = max_step_frames if any(r >= max_step_frames for r in positive) else min(positive)
                plan = {slots[i]: wave[i][:, cursors[i]: cursors[i] + step_t]
                        for i, rem in enumerate(remaining) if rem >= step_t}
                decoded = self.step(plan)
                for i in range(len(wave)):
                    if slots[i] in plan:
                        chunks[i].append(decoded[slots[i]])
                        cursors[i] += step_t
            wavs.extend(torch.cat(item_chunks, dim=-1) for item_chunks in chunks)
        return wavs


class _LocalStreamState:
    def __init__(self):
        self.slot: int | None = None
        self.pending: list = []
        self.threshold = INITIAL_CHUNK_FRAMES
        self.emitted_any = False


class MossTTSLocalStreamingVocoderScheduler:
    """Decode MOSS-TTS Local codec rows incrementally (the vocoder stage's scheduler loop)."""

    def __init__(self, codec, *, variant: str, cuda_graph: bool, responses: dict):
        self._codec = codec
        self._variant = variant
        self._stream_slots, self._offline_slots = STREAM_SLOTS, OFFLINE_SLOTS
        self._n_vq = N_VQ
        self._max_step_frames = MAX_STEP_FRAMES
        self._stream_chunk_frames = STREAM_CHUNK_FRAMES
        self._session: _CodecStreamSession | None = None
        self._session_used_by_streaming = False
        self._cuda_graph = bool(cuda_graph)
        self._cuda_graph_frames = list(CUDA_GRAPH_FRAMES)
        self._stream_states: dict[str, _LocalStreamState] = {}
        self._stream_payloads: dict[str, dict] = {}
        self._state_lock = threading.RLock()
        self.inbox: queue.Queue = queue.Queue()
        self._responses = responses
        self._audio_parts: dict[str, list] = {}

    # --- session management ---
    def _ensure_session(self) -> _CodecStreamSession:
        if self._session is None:
            self._session = _CodecStreamSession(self._codec, stream_slots=self._stream_slots,
                                                offline_slots=self._offline_slots, n_vq=self._n_vq,
                                                variant=self._variant)
        return self._session

    def _close_idle_startup_session_locked(self) -> None:
        if (self._session is not None and not self._session_used_by_streaming and not self._stream_states
                and not self._stream_payloads):
            self._session.close()
            self._session = None

    def _cuda_graph_capture_frames(self) -> list[int]:
        return sorted(set(self._cuda_graph_frames))

    def _ensure_session_graphed(self) -> _CodecStreamSession:
        """Live session with graphs captured (at most once). A session created after non-streaming traffic closed
        the graphed startup session is re-captured here, synchronously, on the serving loop."""
        with self._state_lock:
            session = self._ensure_session()
            if self._cuda_graph and not session.warmup_attempted:
                try:
                    session.warmup_cuda_graph(self._cuda_graph_capture_frames())
                except Exception:
                    logger.exception("MOSS vocoder CUDA-graph capture failed; serving eager from this session")
            return session

    def warmup_now(self) -> None:
        """Factory-time capture, before the stage process is marked ready (GPU quiescent)."""
        if not self._cuda_graph:
            return
        session = self._ensure_session_graphed()
        if not session.has_cuda_graph_runner():
            logger.warning("MOSS vocoder CUDA graphs did not seal at startup; eager vocoder")

    # --- streaming hooks ---
    def on_streaming_new_request(self, request_id: str, payload: dict) -> None:
        self._stream_payloads[request_id] = payload
        self._stream_states.setdefault(request_id, _LocalStreamState())
        self._audio_parts[request_id] = []

    def _ensure_slot(self, state: _LocalStreamState) -> None:
        if state.slot is None:
            self._session_used_by_streaming = True
            state.slot = self._ensure_session_graphed().acquire()

    def on_stream_chunk(self, request_id: str, row: torch.Tensor) -> None:
        state = self._stream_states[request_id]
        row = row.to(dtype=torch.long)
        state.pending.append(row[1: 1 + self._n_vq])      # [text_token, code_0, ..., code_{n_vq-1}]
        self._ensure_slot(state)
        self._pump_streams()

    def _pump_streams(self) -> None:
        while True:
            due = [(rid, s) for rid, s in self._stream_states.items()
                   if s.slot is not None and len(s.pending) >= s.threshold]
            if not due:
                return
            step_t = min(min(len(s.pending) for _, s in due), self._max_step_frames)
            plan = {s.slot: torch.stack(s.pending[:step_t], dim=1) for _, s in due}
            decoded = self._ensure_session().step(plan)
            for rid, s in due:
                del s.pending[:step_t]
                s.emitted_any = True
                s.threshold = self._stream_chunk_frames
                self._audio_parts[rid].append(decoded[s.slot])          # a stream chunk to the client

    def on_stream_done(self, request_id: str) -> None:
        state = self._stream_states[request_id]
        if state.slot is not None:
            session = self._ensure_session_graphed()
            while state.pending:
                step_t = min(len(state.pending), self._max_step_frames)
                codes = torch.stack(state.pending[:step_t], dim=1)
                del state.pending[:step_t]
                self._audio_parts[request_id].append(session.step({state.slot: codes})[state.slot])
            session.release(state.slot)
            state.slot = None
        self._responses[request_id] = ("ok", torch.cat(self._audio_parts.pop(request_id), dim=-1))
        self._stream_states.pop(request_id)
        self._stream_payloads.pop(request_id)

    # --- non-streaming path ---
    def _vocode(self, request_id: str, payload: dict) -> None:
        codes = torch.stack(payload["audio_codes"])[:, 1: 1 + self._n_vq].transpose(0, 1).contiguous()
        with self._state_lock:
            self._close_idle_startup_session_locked()
            if self._session is None:                     # the non-streaming decoder
                wav = self._codec.decode(codes)
            else:
                wav = self._session.decode_offline([codes], max_step_frames=self._max_step_frames)[0]
        self._responses[request_id] = ("ok", wav)

    def drain(self) -> None:
        """The vocoder stage's scheduler loop: handle every message the AR stage sent."""
        while not self.inbox.empty():
            kind, request_id, data = self.inbox.get_nowait()
            if kind == "stream_new":
                self.on_streaming_new_request(request_id, data)
            elif kind == "stream":
                self.on_stream_chunk(request_id, data)
            elif kind == "stream_done":
                self.on_stream_done(request_id)
            else:
                self._vocode(request_id, data)


# --- the AR stage: MOSS-TTS Local model runner and its OmniScheduler (own thread) ---------------------------

class MossTTSLocalModel:
    def __init__(self, device):
        gen = generator(8261)
        self.text_embed = randn(TEXT_VOCAB, AR_HIDDEN, gen=gen, device=device, scale=0.7)
        self.code_embed = randn(N_VQ, CODE_VOCAB, AR_HIDDEN, gen=gen, device=device, scale=0.7)
        self.w_h = randn(AR_HIDDEN, AR_HIDDEN, gen=gen, device=device, scale=0.6)
        self.w_prefill = randn(AR_HIDDEN, AR_HIDDEN, gen=gen, device=device, scale=0.6)
        self.text_head = randn(AR_HIDDEN, TEXT_VOCAB, gen=gen, device=device)
        self.code_heads = randn(N_VQ, AR_HIDDEN, CODE_VOCAB, gen=gen, device=device)

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.text_embed[prompt_ids].mean(dim=0) @ self.w_prefill)

    def decode(self, last_rows: torch.Tensor, hidden: torch.Tensor):
        """One frame per request: backbone step, then the local micro-decode (text token, then n_vq codes)."""
        x = self.text_embed[last_rows[:, 0]]
        for q in range(N_VQ):
            x = x + self.code_embed[q][last_rows[:, 1 + q]]
        h = torch.tanh(x + hidden @ self.w_h)
        text = (h @ self.text_head).argmax(dim=-1)
        codes, local = [], h
        for q in range(N_VQ):
            code = (local @ self.code_heads[q]).argmax(dim=-1)
            codes.append(code)
            local = torch.tanh(local + self.code_embed[q][code])
        return h, torch.stack([text] + codes, dim=1)


class Req:
    def __init__(self, rid, prompt_ids, stream, max_new_tokens):
        self.rid, self.prompt_ids, self.stream, self.max_new_tokens = rid, prompt_ids, stream, max_new_tokens
        self.hidden = self.last_row = None
        self.output_ids: list[int] = []
        self.output_rows: list = []


class GenerationBatchResult:
    def __init__(self, next_token_ids, rows, hidden):
        self.next_token_ids, self.rows, self.hidden = next_token_ids, rows, hidden


class OmniScheduler:
    """The AR stage's scheduler loop, on its own thread. It runs one step per turn that another thread gives it
    (``take_turn``), so the two threads interleave in a fixed order."""

    def __init__(self, model, device, vocoder_inbox: queue.Queue, responses: dict):
        self.model, self.device = model, torch.device(device)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._vocoder_inbox = vocoder_inbox
        self._responses = responses
        self._turn, self._done = threading.Event(), threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self.event_loop, name="moss-ar-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._turn.set()
        self._thread.join()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_turn(self) -> None:
        self._turn.set()
        self._done.wait()
        self._done.clear()

    def run_until_idle(self) -> None:
        while self.has_work():
            self.take_turn()

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)
        if req.stream:
            self._vocoder_inbox.put(("stream_new", req.rid, {"stream": True}))

    def event_loop(self) -> None:
        with torch.no_grad():
            while True:
                self._turn.wait()
                self._turn.clear()
                if self._stopping:
                    return
                batch = None
                try:
                    batch = self.get_next_batch_to_run()
                    result = self.run_batch(batch)
                    self.process_batch_result_decode(batch, result)
                except Exception as exc:           # the batch's requests fail: HTTP 500
                    for req in batch or []:
                        self._responses[req.rid] = ("error", f"HTTP 500: {exc}".splitlines()[0])
                        self.running.remove(req)
                finally:
                    self._done.set()

    def get_next_batch_to_run(self) -> list[Req]:
        for req in self.waiting:
            req.hidden = self.model.prefill(req.prompt_ids)
            req.last_row = torch.cat([req.prompt_ids[-1:], torch.zeros(N_VQ, dtype=torch.long, device=self.device)])
        self.running += self.waiting
        self.waiting = []
        return list(self.running)

    def run_batch(self, batch: list[Req]) -> GenerationBatchResult:
        hidden = torch.stack([req.hidden for req in batch])
        last_rows = torch.stack([req.last_row for req in batch])
        new_hidden, rows = self.model.decode(last_rows, hidden)
        return GenerationBatchResult(rows[:, 0], rows, new_hidden)          # MossTTSLocalModelRunner._collect_frame

    def process_batch_result_decode(self, batch: list[Req], result: GenerationBatchResult) -> None:
        next_token_ids = result.next_token_ids.tolist()                      # D2H copy + sync
        for i, (req, next_token_id) in enumerate(zip(batch, next_token_ids)):
            req.output_ids.append(next_token_id)
            req.hidden, req.last_row = result.hidden[i], result.rows[i]
            req.output_rows.append(result.rows[i])
            if req.stream:
                self._vocoder_inbox.put(("stream", req.rid, result.rows[i]))
            if len(req.output_ids) >= req.max_new_tokens:
                self.running.remove(req)
                if req.stream:
                    self._vocoder_inbox.put(("stream_done", req.rid, None))
                else:
                    self._vocoder_inbox.put(("request", req.rid, {"audio_codes": req.output_rows}))


# --- the colocated server and its clients --------------------------------------------------------------------

class MossTTSLocalServer:
    def __init__(self, device, variant, cuda_graph: bool):
        self.responses: dict = {}
        self.vocoder = MossTTSLocalStreamingVocoderScheduler(MossAudioTokenizerCodec(device), variant=variant,
                                                             cuda_graph=cuda_graph, responses=self.responses)
        self.vocoder.warmup_now()                          # factory, before the stage is ready
        self.ar = OmniScheduler(MossTTSLocalModel(device), device, self.vocoder.inbox, self.responses)
        _COLOCATED_SCHEDULERS.append(self.ar)
        self.ar.start()

    def shutdown(self) -> None:
        _COLOCATED_SCHEDULERS.remove(self.ar)
        self.ar.stop()


def run(variant: str, device: str = "cpu"):
    gen = generator(826)
    prompts = {rid: torch.randint(0, TEXT_VOCAB, (5,), generator=gen) for rid in "ABC"}

    def serve(cuda_graph: bool):
        server = MossTTSLocalServer(device, variant, cuda_graph)
        try:
            def submit(rid, stream, frames):
                server.ar.add_request(Req(rid, prompts[rid].to(device), stream, frames))

            submit("A", False, 4)                          # non-streaming: closes the graphed startup session
            server.ar.run_until_idle()
            server.vocoder.drain()
            submit("B", True, 5)                           # streaming: its rows reach the vocoder's inbox
            server.ar.run_until_idle()
            submit("C", False, 10)                         # the AR stage decodes C while B's first chunk makes
            server.vocoder.drain()                         # the vocoder re-capture (lazily, on its loop)
            server.ar.run_until_idle()
            server.vocoder.drain()
        finally:
            server.shutdown()
        outs = []
        for rid in "ABC":                                   # the HTTP clients
            status, body = server.responses[rid]
            if status != "ok":
                raise RuntimeError(f"request {rid}: {body}")
            outs.append(body)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
