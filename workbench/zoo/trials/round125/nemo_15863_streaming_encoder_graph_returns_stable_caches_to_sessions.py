"""NeMo cache-aware streaming ASR with the CUDA-graph encoder step: ``CudaGraphsStreamingEncoderStep._replay`` hands back the captured step's stable output buffers themselves, so a streaming session that keeps the returned caches for its next chunk holds memory that the next replay of the same graph (another session's chunk) rewrites.

Upstream: https://github.com/NVIDIA-NeMo/Speech/pull/15863 ("Cache-aware Streaming ASR: up to 5x faster encoder
with CUDA graphs", NVIDIA-NeMo/Speech, author hamuzhan, opened 2026-07-02, reviewed by artbataev 2026-07-20, merged).
Read: the PR description and the review excerpt ("**Critical**: return copy of the outputs."); the new file
``nemo/collections/asr/parts/submodules/streaming_encoder_cuda_graphs.py`` in two versions: without the copy
(hamuzhan/NeMo at 30b63cdc6eac4381861c97bb4632539d1fbd624c, the PR author's fork, and NVIDIA-NeMo/NeMo at
d1f8fae65a50e21930c5986c6c1f00a09048f1e5: ``_replay`` ends ``captured.graph.replay(); return
captured.stable_outputs``) and with it (tristan-hyams/NeMo at c4d4e67707755dd9e4e03ada4056529e9948a770 and
yhayarannvidia/NeMo-Speech at 51ba7b98b88c4c751098540209e03672b30a3a95: ``_CapturedStep.get_stable_outputs_copy``,
"Return outputs with storage that is not overwritten by the next graph replay", and ``_replay`` returns it);
``nemo/collections/asr/parts/mixins/streaming.py`` of that PR (``set_streaming_cuda_graphs``,
``cache_aware_stream_step`` dispatching to the helper, ``_cache_aware_stream_step_impl``); the ConformerEncoder
streaming path at NVIDIA/NeMo 8cfedd7203 (``conformer_encoder.py``: ``forward_internal`` with caches,
``streaming_post_process``, ``get_initial_cache_state``; ``multi_head_attention.py`` ``update_cache``;
``causal_convs.py`` ``update_cache``; ``conformer_modules.py`` ``ConformerLayer.forward``; ``mixins.py``
``conformer_stream_step``); and the PR's unit tests for the helper in their fixed version (found by text search,
repository not identified): ``run_stream`` feeds the returned caches back as the next step's inputs (``_, _, cache_lc,
cache_lt, cache_len = out``) and ``test_replayed_outputs_are_not_overwritten`` ("Each replay must return outputs with
storage independent from the graph buffers") holds the first replay's outputs across a second replay. Not read: the
full diff and the commit that added the copy (whether the copy-less version reached the main branch is not known to
me), the rest of the review thread.
Symptom: no user report read (the reviewer flagged it before any). As modelled: with
``encoder.set_streaming_cuda_graphs(True)``, two streaming sessions on one model (interleaved chunks of the same shape,
each keeping the caches its step returned) get each other's encoder state once the steady-state graph is replayed,
and their CTC outputs go wrong from there on; no error is raised.
Mechanism: ``stream_step`` counts eager calls per key (shape, dtype, ``keep_all_outputs``, ``drop_extra_pre_encoded``,
attention context); after ``warmup_steps`` it captures the step into a graph whose last ops copy the five outputs
(encoded, encoded_len, ``cache_last_channel_next``, ``cache_last_time_next``, ``cache_last_channel_next_len``) into
``stable_outputs``. ``_replay`` copies the caller's inputs into the static inputs, replays, and returns
``stable_outputs``: every caller of that graph gets the same five tensors. Session B's caches after its replay are
those buffers; session A's chunk replays the same graph and rewrites them; B's next step copies A's new state in as
its own. Eager steps allocate fresh outputs per call.
Doctor: overwritten-output, at _replay. It hands out the graph's stable output buffers, which the sessions read at
their next step after another replay of the same graph has overwritten them; the upstream fix is in ``_replay``
(return copies).
Fix (upstream): ``_replay`` returns ``captured.get_stable_outputs_copy()`` (a clone of every stable output).
Modelled: ``CudaGraphsStreamingEncoderStep`` (``_make_key``, ``_can_use_graphs``, ``stream_step`` with per-key
warm-up counts and ``max_graphs``, its capture-failure fallback omitted; ``_capture`` with cloned static inputs, a
dry run for the output shapes, stable outputs from ``empty_like`` and the in-graph copies,
``capture_error_mode="thread_local"``; ``_replay``),
``_CapturedStep``, ``StreamingEncoder`` (``set_streaming_cuda_graphs``, ``cache_aware_stream_step``,
``_cache_aware_stream_step_impl``), a ConformerEncoder with its cache-aware forward (``drop_extra_pre_encoded``,
``offset = cache_len - cache_last_channel_len`` masks, per-layer ``update_cache`` for attention and causal conv,
``clamp(cache_last_channel_len + cache_keep_size, max=cache_len)``), ``streaming_post_process`` and
``get_initial_cache_state``, ``conformer_stream_step`` (CTC log-probs) and a per-session chunk buffer (first chunk
without pre-encode cache, later chunks with one cached frame and ``drop_extra_pre_encoded=1``, last chunk with
``keep_all_outputs=True``). Stand-ins: two tiny Conformer layers (single-head attention without relative positions,
depthwise conv by ``unfold``, parameter-free layer norms), a linear pre-encode with stride 1, a 1x1 CTC head,
float64; ``torch.cuda.is_available`` / ``signal.is_cuda`` / autocast checks dropped (the engine's graphs also run on
the CPU).
Workload: two sessions A and B, one stream each, 6 chunks of 4 new frames; their steps interleave A0 B0 A1 B1 ...
The steady key (5-frame chunk, drop 1, keep_all False) is counted at A1, B1, A2, captured and replayed at B2, and
replayed at A3, B3, A4, B4; A5 and B5 (``keep_all_outputs=True``) run eager. Output: the CTC log-probs of every step.
Measured (CPU): bug misbehaves, max |graph - eager| = 7.37 over the log-probs: the seven steps A0 to A3 equal eager
(0), then B3 2.56, A4 2.67, B4 7.37, A5 1.18, B5 6.93 (A3 still copies in its own eager caches; B3 copies in A3's).
One session alone on the same code equals eager. Fix equals eager (max 0).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA-NeMo/Speech/pull/15863"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_replay"
SYMPTOM = ("cache-aware streaming with the CUDA-graph encoder step: sessions keep the caches the step returned, which "
           "are the graph's stable output buffers, and the next session's replay rewrites them")

FEAT_IN, D_MODEL, N_LAYERS, VOCAB = 4, 8, 2, 6
LAST_CHANNEL_CACHE_SIZE, CONV_KERNEL, CHUNK, PRE_ENCODE_CACHE, NUM_CHUNKS = 6, 3, 4, 1, 6
DTYPE = torch.float64

_variant = "bug"


# --- nemo/collections/asr/parts/submodules/streaming_encoder_cuda_graphs.py (PR #15863, reduced) ----------------------

class _CapturedStep:
    """A captured CUDA graph with its static input and stable output buffers."""

    def __init__(self, graph, static_inputs, stable_outputs):
        self.graph = graph
        self.static_inputs = static_inputs
        self.stable_outputs = stable_outputs

    def get_stable_outputs_copy(self):
        """Return outputs with storage that is not overwritten by the next graph replay."""
        return tuple(output.clone() for output in self.stable_outputs)


class CudaGraphsStreamingEncoderStep:
    """Optional CUDA-graph replay for ``StreamingEncoder.cache_aware_stream_step``."""

    FULL_GRAPH, NO_GRAPHS = "full_graph", "no_graphs"

    def __init__(self, encoder, warmup_steps: int = 3, max_graphs: int = 8):
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.encoder = encoder
        self.warmup_steps = warmup_steps
        self.max_graphs = max_graphs
        self.cuda_graphs_mode = self.FULL_GRAPH
        self._graphs: dict[tuple, _CapturedStep] = {}
        self._key_counts: dict[tuple, int] = {}

    def _make_key(self, signal, keep_all_outputs, drop_extra_pre_encoded):
        streaming_cfg = self.encoder.streaming_cfg
        return (tuple(signal.shape), str(signal.dtype), signal.device.index, bool(keep_all_outputs),
                -1 if drop_extra_pre_encoded is None else int(drop_extra_pre_encoded),
                tuple(self.encoder.att_context_size), streaming_cfg.last_channel_cache_size,
                streaming_cfg.valid_out_len)

    def _can_use_graphs(self, signal, cache_last_channel, keep_all_outputs, bypass_pre_encode):
        return (self.cuda_graphs_mode == self.FULL_GRAPH and not self.encoder.training
                and cache_last_channel is not None and not keep_all_outputs and not bypass_pre_encode)

    def stream_step(self, processed_signal, processed_signal_length=None, cache_last_channel=None,
                    cache_last_time=None, cache_last_channel_len=None, keep_all_outputs=True,
                    drop_extra_pre_encoded=None, bypass_pre_encode=False):
        eager_kwargs = dict(processed_signal_length=processed_signal_length, cache_last_channel=cache_last_channel,
                            cache_last_time=cache_last_time, cache_last_channel_len=cache_last_channel_len,
                            keep_all_outputs=keep_all_outputs, drop_extra_pre_encoded=drop_extra_pre_encoded,
                            bypass_pre_encode=bypass_pre_encode)
        if processed_signal_length is None or not self._can_use_graphs(
                processed_signal, cache_last_channel, keep_all_outputs, bypass_pre_encode):
            return self.encoder._cache_aware_stream_step_impl(processed_signal, **eager_kwargs)

        key = self._make_key(processed_signal, keep_all_outputs, drop_extra_pre_encoded)
        captured = self._graphs.get(key)
        if captured is not None:
            return self._replay(captured, processed_signal, processed_signal_length, cache_last_channel,
                                cache_last_time, cache_last_channel_len)

        self._key_counts[key] = self._key_counts.get(key, 0) + 1
        if self._key_counts[key] > self.warmup_steps and len(self._graphs) < self.max_graphs:
            captured = self._capture(key, eager_kwargs, processed_signal)
            return self._replay(captured, processed_signal, processed_signal_length, cache_last_channel,
                                cache_last_time, cache_last_channel_len)

        return self.encoder._cache_aware_stream_step_impl(processed_signal, **eager_kwargs)

    def _capture(self, key, eager_kwargs, signal):
        static_inputs = {
            "signal": signal.clone(),
            "length": eager_kwargs["processed_signal_length"].clone(),
            "cache_last_channel": eager_kwargs["cache_last_channel"].clone(),
            "cache_last_time": eager_kwargs["cache_last_time"].clone(),
            "cache_last_channel_len": eager_kwargs["cache_last_channel_len"].clone(),
        }

        def run_step():
            return self.encoder._cache_aware_stream_step_impl(
                static_inputs["signal"],
                processed_signal_length=static_inputs["length"],
                cache_last_channel=static_inputs["cache_last_channel"],
                cache_last_time=static_inputs["cache_last_time"],
                cache_last_channel_len=static_inputs["cache_last_channel_len"],
                keep_all_outputs=eager_kwargs["keep_all_outputs"],
                drop_extra_pre_encoded=eager_kwargs["drop_extra_pre_encoded"],
                bypass_pre_encode=False,
            )

        # dry run: learns output shapes/dtypes for this key
        dry_run_outputs = run_step()
        stable_outputs = tuple(torch.empty_like(t) for t in dry_run_outputs)
        del dry_run_outputs

        def capture_region():
            outputs = run_step()
            for stable, out in zip(stable_outputs, outputs):
                stable.copy_(out)
            return stable_outputs

        graph, _ = capture(capture_region, device=str(signal.device), warmups=0, static=static_inputs,
                           owner="CudaGraphsStreamingEncoderStep", capture_error_mode="thread_local",
                           name=f"streaming encoder step signal={tuple(signal.shape)}")
        captured = _CapturedStep(graph, static_inputs, stable_outputs)
        self._graphs[key] = captured
        return captured

    def _replay(self, captured, signal, length, cache_last_channel, cache_last_time, cache_last_channel_len):
        static = captured.static_inputs
        static["signal"].copy_(signal)
        static["length"].copy_(length)
        static["cache_last_channel"].copy_(cache_last_channel)
        static["cache_last_time"].copy_(cache_last_time)
        static["cache_last_channel_len"].copy_(cache_last_channel_len)
        outputs = replay(captured.graph, captured.stable_outputs)
        if _variant == "fix":
            return captured.get_stable_outputs_copy()
        return outputs


# --- nemo/collections/asr/parts/mixins/streaming.py (PR #15863) -------------------------------------------------------

class StreamingEncoder:
    _stream_step_cuda_graphs = None

    def set_streaming_cuda_graphs(self, enabled=True, warmup_steps=3, max_graphs=8):
        if not enabled:
            self._stream_step_cuda_graphs = None
            return None
        self._stream_step_cuda_graphs = CudaGraphsStreamingEncoderStep(self, warmup_steps=warmup_steps,
                                                                       max_graphs=max_graphs)
        return self._stream_step_cuda_graphs

    def cache_aware_stream_step(self, processed_signal, processed_signal_length=None, cache_last_channel=None,
                                cache_last_time=None, cache_last_channel_len=None, keep_all_outputs=True,
                                drop_extra_pre_encoded=None, bypass_pre_encode=False):
        kwargs = dict(processed_signal_length=processed_signal_length, cache_last_channel=cache_last_channel,
                      cache_last_time=cache_last_time, cache_last_channel_len=cache_last_channel_len,
                      keep_all_outputs=keep_all_outputs, drop_extra_pre_encoded=drop_extra_pre_encoded,
                      bypass_pre_encode=bypass_pre_encode)
        if self._stream_step_cuda_graphs is not None:
            return self._stream_step_cuda_graphs.stream_step(processed_signal, **kwargs)
        return self._cache_aware_stream_step_impl(processed_signal, **kwargs)

    def _cache_aware_stream_step_impl(self, processed_signal, processed_signal_length=None, cache_last_channel=None,
                                      cache_last_time=None, cache_last_channel_len=None, keep_all_outputs=True,
                                      drop_extra_pre_encoded=None, bypass_pre_encode=False):
        if drop_extra_pre_encoded is not None:
            prev_drop_extra_pre_encoded = self.streaming_cfg.drop_extra_pre_encoded
            self.streaming_cfg.drop_extra_pre_encoded = drop_extra_pre_encoded
        else:
            prev_drop_extra_pre_encoded = None
        encoder_output = self.forward(audio_signal=processed_signal, length=processed_signal_length,
                                      cache_last_channel=cache_last_channel, cache_last_time=cache_last_time,
                                      cache_last_channel_len=cache_last_channel_len,
                                      bypass_pre_encode=bypass_pre_encode)
        encoder_output = self.streaming_post_process(encoder_output, keep_all_outputs=keep_all_outputs)
        if prev_drop_extra_pre_encoded is not None:
            self.streaming_cfg.drop_extra_pre_encoded = prev_drop_extra_pre_encoded
        return encoder_output


# --- nemo/collections/asr/modules/conformer_encoder.py and submodules (reduced) ---------------------------------------

@dataclasses.dataclass
class CacheAwareStreamingConfig:
    chunk_size: int = CHUNK
    shift_size: int = CHUNK
    cache_drop_size: int = 0
    last_channel_cache_size: int = LAST_CHANNEL_CACHE_SIZE
    valid_out_len: int = CHUNK
    pre_encode_cache_size: int = PRE_ENCODE_CACHE
    drop_extra_pre_encoded: int = PRE_ENCODE_CACHE


def _layer_norm(x):
    return F.layer_norm(x, (x.shape[-1],))


class ConformerLayer:
    """FF/2 -> self-attention with ``cache_last_channel`` -> causal depthwise conv with ``cache_last_time`` -> FF/2."""

    def __init__(self, gen, device):
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.ff1_w1, self.ff1_w2 = r(D_MODEL, 2 * D_MODEL), r(2 * D_MODEL, D_MODEL)
        self.wq, self.wk, self.wv, self.wo = r(D_MODEL, D_MODEL), r(D_MODEL, D_MODEL), r(D_MODEL, D_MODEL), \
            r(D_MODEL, D_MODEL)
        self.conv_w = r(D_MODEL, CONV_KERNEL, scale=0.6)
        self.ff2_w1, self.ff2_w2 = r(D_MODEL, 2 * D_MODEL), r(2 * D_MODEL, D_MODEL)
        self.cache_drop_size = 0

    def update_cache(self, key, value, query, cache):          # MultiHeadAttention.update_cache
        key = value = torch.cat([cache, key], dim=1)
        q_keep_size = query.shape[1] - self.cache_drop_size
        cache = torch.cat([cache[:, q_keep_size:, :], query[:, :q_keep_size, :]], dim=1)
        return key, value, query, cache

    def self_attn(self, query, key, value, mask, cache):
        key, value, query, cache = self.update_cache(key, value, query, cache)
        q, k, v = query @ self.wq, key @ self.wk, value @ self.wv
        scores = (q @ k.transpose(1, 2)) / math.sqrt(D_MODEL)
        attn = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1).masked_fill(mask, 0.0)
        return (attn @ v) @ self.wo, cache

    def conv(self, x, cache):                                   # ConformerConvolution with CausalConv1D cache
        x = x.transpose(1, 2)
        new_x = torch.cat([cache, x], dim=-1)                   # CausalConv1D.update_cache
        next_cache = new_x[:, :, -cache.size(-1):]
        x = (new_x.unfold(-1, CONV_KERNEL, 1) * self.conv_w[None, :, None, :]).sum(-1)
        return torch.tanh(x).transpose(1, 2), next_cache

    def forward(self, x, att_mask, cache_last_channel, cache_last_time):
        residual = x
        x = torch.relu(_layer_norm(x) @ self.ff1_w1) @ self.ff1_w2
        residual = residual + x * 0.5
        x = _layer_norm(residual)
        x, cache_last_channel = self.self_attn(query=x, key=x, value=x, mask=att_mask, cache=cache_last_channel)
        residual = residual + x
        x, cache_last_time = self.conv(_layer_norm(residual), cache=cache_last_time)
        residual = residual + x
        x = torch.relu(_layer_norm(residual) @ self.ff2_w1) @ self.ff2_w2
        residual = residual + x * 0.5
        return _layer_norm(residual), cache_last_channel, cache_last_time


class ConformerEncoder(StreamingEncoder):
    def __init__(self, device):
        gen = generator(15863)
        self.device = device
        self.training = False
        self.d_model = D_MODEL
        self.pre_encode_w = randn(FEAT_IN, D_MODEL, gen=gen, device=device, scale=0.8).to(DTYPE)
        self.layers = [ConformerLayer(gen, device) for _ in range(N_LAYERS)]
        self.att_context_size = [LAST_CHANNEL_CACHE_SIZE, 0]
        self.conv_context_size = [CONV_KERNEL - 1, 0]
        self.streaming_cfg = CacheAwareStreamingConfig()

    def pre_encode(self, x, lengths):                          # ConvSubsampling stand-in (stride 1)
        return x @ self.pre_encode_w, lengths

    def get_initial_cache_state(self, batch_size=1):
        cache_last_channel = torch.zeros(len(self.layers), batch_size, self.streaming_cfg.last_channel_cache_size,
                                         self.d_model, dtype=DTYPE, device=self.device)
        cache_last_time = torch.zeros(len(self.layers), batch_size, self.d_model, self.conv_context_size[0],
                                      dtype=DTYPE, device=self.device)
        cache_last_channel_len = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        return cache_last_channel, cache_last_time, cache_last_channel_len

    def _create_masks(self, att_context_size, padding_length, max_audio_length, offset, device):
        t = torch.arange(max_audio_length, device=device)
        pad_mask = t[None, :] < padding_length[:, None]
        pad_mask = pad_mask & (t[None, :] >= offset[:, None])
        diff = t[:, None] - t[None, :]
        att_mask = (diff >= 0) & (diff <= att_context_size[0])
        att_mask = att_mask[None] & pad_mask[:, None, :] & pad_mask[:, :, None]
        return ~pad_mask, ~att_mask

    def forward(self, audio_signal, length, cache_last_channel=None, cache_last_time=None,
                cache_last_channel_len=None, bypass_pre_encode=False):
        audio_signal = torch.transpose(audio_signal, 1, 2)
        audio_signal, length = self.pre_encode(x=audio_signal, lengths=length)
        if self.streaming_cfg.drop_extra_pre_encoded > 0 and cache_last_channel is not None:
            audio_signal = audio_signal[:, self.streaming_cfg.drop_extra_pre_encoded:, :]
            length = (length - self.streaming_cfg.drop_extra_pre_encoded).clamp(min=0)

        max_audio_length = audio_signal.size(1)
        cache_len = self.streaming_cfg.last_channel_cache_size
        cache_keep_size = max_audio_length - self.streaming_cfg.cache_drop_size
        max_audio_length = max_audio_length + cache_len
        padding_length = length + cache_len
        offset = torch.neg(cache_last_channel_len) + cache_len

        pad_mask, att_mask = self._create_masks(self.att_context_size, padding_length, max_audio_length, offset,
                                                audio_signal.device)
        att_mask = att_mask[:, cache_len:]
        cache_last_time_next, cache_last_channel_next = [], []
        for lth, layer in enumerate(self.layers):
            audio_signal, cache_last_channel_cur, cache_last_time_cur = layer.forward(
                audio_signal, att_mask, cache_last_channel[lth], cache_last_time[lth])
            cache_last_channel_next.append(cache_last_channel_cur)
            cache_last_time_next.append(cache_last_time_cur)

        audio_signal = torch.transpose(audio_signal, 1, 2)
        return (audio_signal, length.to(dtype=torch.int64), torch.stack(cache_last_channel_next, dim=0),
                torch.stack(cache_last_time_next, dim=0),
                torch.clamp(cache_last_channel_len + cache_keep_size, max=cache_len))

    def streaming_post_process(self, rets, keep_all_outputs=True):
        encoded, encoded_len, cache_last_channel_next, cache_last_time_next, cache_last_channel_next_len = rets
        if self.streaming_cfg.last_channel_cache_size > 0:
            cache_last_channel_next = cache_last_channel_next[:, :, -self.streaming_cfg.last_channel_cache_size:, :]
        if self.streaming_cfg.valid_out_len > 0 and not keep_all_outputs:
            encoded = encoded[:, :, :self.streaming_cfg.valid_out_len]
            encoded_len = torch.clamp(encoded_len, max=self.streaming_cfg.valid_out_len)
        return encoded, encoded_len, cache_last_channel_next, cache_last_time_next, cache_last_channel_next_len


class ConvASRDecoder:
    def __init__(self, device):
        self.w = randn(D_MODEL, VOCAB, gen=generator(158), device=device).to(DTYPE)

    def __call__(self, encoder_output):
        return torch.log_softmax(encoder_output.transpose(1, 2) @ self.w, dim=-1)


class EncDecCTCModelBPE:
    def __init__(self, device):
        self.encoder = ConformerEncoder(device)
        self.decoder = ConvASRDecoder(device)

    def conformer_stream_step(self, processed_signal, processed_signal_length=None, cache_last_channel=None,
                              cache_last_time=None, cache_last_channel_len=None, keep_all_outputs=True,
                              drop_extra_pre_encoded=None):
        (encoded, encoded_len, cache_last_channel_next, cache_last_time_next,
         cache_last_channel_next_len) = self.encoder.cache_aware_stream_step(
            processed_signal=processed_signal, processed_signal_length=processed_signal_length,
            cache_last_channel=cache_last_channel, cache_last_time=cache_last_time,
            cache_last_channel_len=cache_last_channel_len, keep_all_outputs=keep_all_outputs,
            drop_extra_pre_encoded=drop_extra_pre_encoded)
        log_probs = self.decoder(encoder_output=encoded)
        return log_probs, encoded_len, cache_last_channel_next, cache_last_time_next, cache_last_channel_next_len


# --- a streaming session per connection (CacheAwareStreamingAudioBuffer reduced) --------------------------------------

class StreamingSession:
    def __init__(self, asr_model, features):
        self.asr_model, self.features = asr_model, features
        (self.cache_last_channel, self.cache_last_time,
         self.cache_last_channel_len) = asr_model.encoder.get_initial_cache_state(batch_size=1)
        self.step_num = 0

    def next_chunk(self):
        cfg = self.asr_model.encoder.streaming_cfg
        start = self.step_num * cfg.shift_size
        if self.step_num == 0:
            return self.features[:, :, :cfg.chunk_size], 0
        return self.features[:, :, start - cfg.pre_encode_cache_size:start + cfg.chunk_size], \
            cfg.drop_extra_pre_encoded

    def step(self):
        chunk, drop = self.next_chunk()
        keep_all_outputs = self.step_num == NUM_CHUNKS - 1
        chunk_len = torch.full((chunk.size(0),), chunk.size(-1), dtype=torch.int64, device=chunk.device)
        (log_probs, _, self.cache_last_channel, self.cache_last_time,
         self.cache_last_channel_len) = self.asr_model.conformer_stream_step(
            processed_signal=chunk, processed_signal_length=chunk_len, cache_last_channel=self.cache_last_channel,
            cache_last_time=self.cache_last_time, cache_last_channel_len=self.cache_last_channel_len,
            keep_all_outputs=keep_all_outputs, drop_extra_pre_encoded=drop)
        self.step_num += 1
        return log_probs


def _serve(device, use_cuda_graphs):
    asr_model = EncDecCTCModelBPE(device)
    if use_cuda_graphs:
        asr_model.encoder.set_streaming_cuda_graphs(True, warmup_steps=3, max_graphs=8)
    gen = generator(2026)
    sessions = [StreamingSession(asr_model, randn(1, FEAT_IN, NUM_CHUNKS * CHUNK, gen=gen, device=device).to(DTYPE))
                for _ in range(2)]
    outs = []
    for _ in range(NUM_CHUNKS):
        for session in sessions:
            outs.append(session.step().clone())
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
