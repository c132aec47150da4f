"""Talker and predictor graphs captured on the current device (cuda:0), not the model's (cuda:1): empty graphs, frozen codes.

Upstream: https://github.com/andimarafioti/faster-qwen3-tts/pull/45 ("fix: capture CUDA graphs on different devices",
merged 2026-03-04 as 7dc52d9; commits a3cf209 for the predictor and a3ac86e for the talker; fixes #42, which
a9f2a78 / #44 had only half fixed by letting ``FasterQwen3TTS.from_pretrained(device="cuda:N")`` load there).
Symptom: PR text: "CUDA graph capture in `predictor_graph.py` and `talker_graph.py` used the global CUDA device
`cuda`, causing empty graphs if the user defined a different device." With the model on ``cuda:1`` every decode
step gets the same codebook tokens and the same talker hidden state: degenerate, repeated audio codes.
Mechanism: ``PredictorGraph.capture`` (faster_qwen3_tts/predictor_graph.py) and ``TalkerGraph.capture``
(talker_graph.py) warm up, then do ``s = torch.cuda.Stream()``, ``with torch.cuda.stream(s):`` and
``with torch.cuda.graph(self.graph): self._full_loop()`` (resp. ``self._decode_step()``). The process's current
device is still ``cuda:0``, so ``s`` and ``torch.cuda.graph``'s capture stream (its ``default_capture_stream``,
made on the current device) belong to ``cuda:0``. Every kernel of the step takes ``cuda:1`` tensors, so the
dispatcher sends it to ``cuda:1``'s current stream, which is not capturing: the 15-codebook loop / the talker
decode executes once, eagerly, during the capture, and the graph records nothing ("The CUDA Graph is empty").
``PredictorGraph.run`` then copies ``pred_input`` into ``input_buf`` and replays an empty graph, so
``output_tokens`` keeps the codes computed at capture (from the zero ``input_buf``); ``TalkerGraph.run`` fills
``input_buf``/``cache_position``/``attn_mask``/``position_ids`` and replays nothing, so ``output_buf`` keeps the
capture-time hidden state and no decode K/V is ever written. ``fast_generate`` feeds those back every step.
A kernel issued on another device's (non-capturing) stream is modelled as a launch from another thread, whose
stream no capture records (the CPU engine records the capturing thread only); ``_Cuda`` is the process's CUDA
state: the current device, each device's current stream, and the stream a capture is open on.
Doctor: host-work-frozen, at capture (the step's work ran once, outside the graph, while the capture was open;
replays repeat only what was recorded -- nothing -- so the static outputs stay at their capture-time values).
Fix (upstream): ``__init__`` resolves ``self.device_index`` (``torch.device(device).index``, else
``torch.cuda.current_device()``) and ``capture`` wraps the side stream, the ``CUDAGraph`` and the capture in
``with torch.cuda.device(self.device_index):``, so the capture stream is the model device's current stream.
Modelled: one-layer decoders for the 28-layer talker and the 5-layer predictor; 3 residual codebooks instead of
15; greedy sampling (``do_sample=False``), no repetition penalty, EOS or suppress mask; the warmups are the kit's
(``num_warmup`` plus the one on the side stream, without the ``static_cache.reset()`` between them: each loop
writes every cache position before reading it); the prompt prefill is the same decoder over the prompt; matmuls
are broadcast sums (``mm``).
"""
from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/andimarafioti/faster-qwen3-tts/pull/45"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "capture"
SYMPTOM = "graphs captured on cuda:0 for a model on cuda:1 are empty; every step returns the capture-time codes"

REQUESTED_DEVICE = "cuda:1"       # FasterQwen3TTS.from_pretrained(device="cuda:1") ...
CURRENT_DEVICE = 0                # ... while the process's current device stays cuda:0
TALKER_HIDDEN, PRED_HIDDEN, CODEC_VOCAB, PRED_VOCAB = 8, 6, 12, 10
NUM_CODE_GROUPS = 4               # first codebook from the talker + 3 from the predictor
MAX_SEQ_LEN, PROMPT_LEN, TEXT_LEN, STEPS = 16, 4, 5, 6
NEG = torch.finfo(torch.float32).min


class _Stream:
    def __init__(self, device_index):
        self.device_index = device_index


class _Cuda:
    """The process's CUDA state in miniature (what ``torch.cuda`` keeps per process and per device)."""

    def __init__(self, current_device):
        self.current = current_device
        self.streams: dict[int, _Stream] = {}           # each device's current stream (its default at first)
        self.default_capture_stream: _Stream | None = None
        self.capturing: _Stream | None = None

    def current_device(self):
        return self.current

    def current_stream(self, index=None):
        index = self.current if index is None else index
        return self.streams.setdefault(index, _Stream(index))

    def Stream(self):                                   # noqa: N802 - torch.cuda.Stream(): on the current device
        return _Stream(self.current)

    @contextlib.contextmanager
    def device(self, index):
        """``torch.cuda.device(index)``: scoped."""
        previous, self.current = self.current, index
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def stream(self, s):
        """``torch.cuda.stream(s)``: ``s`` becomes its device's current stream (and, via ``set_stream``, its
        device the current one); both come back afterwards."""
        previous_device, previous_stream = self.current, self.current_stream(s.device_index)
        self.streams[s.device_index], self.current = s, s.device_index
        try:
            yield
        finally:
            self.streams[s.device_index], self.current = previous_stream, previous_device

    @contextlib.contextmanager
    def graph_capture_stream(self):
        """What ``torch.cuda.graph(g)`` does with streams: its capture stream, ``default_capture_stream`` (made on
        the current device the first time), becomes current and the capture is begun on it."""
        if self.default_capture_stream is None:
            self.default_capture_stream = self.Stream()
        with self.stream(self.default_capture_stream):
            self.capturing = self.default_capture_stream
            try:
                yield
            finally:
                self.capturing = None

    def launch(self, device_index, kernels):
        """Kernels on ``cuda:<device_index>`` tensors go to that device's current stream. While a capture is open
        on another stream, that stream is not capturing: they execute now and join no graph (modelled as another
        thread, whose stream no capture records)."""
        if not is_capturing() or self.current_stream(device_index) is self.capturing:
            return kernels()
        result = []
        worker = threading.Thread(target=lambda: result.append(kernels()))
        worker.start()
        worker.join()
        return result[0]


cuda = _Cuda(CURRENT_DEVICE)


def mm(a, b):
    """``a @ b`` written as a broadcast sum: the thread that stands for another device's stream then needs no cuBLAS
    handle of its own (on a GPU, creating one there while a capture is open could fail)."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def sample_logits(logits, *, do_sample=False):
    return torch.argmax(logits, dim=-1)                 # do_sample=False path of sampling.sample_logits


def create_causal_mask(cache_position, max_len):
    """``transformers.masking_utils.create_causal_mask`` for eager attention: [1, 1, q, max_len] additive."""
    allowed = torch.arange(max_len, device=cache_position.device)[None, :] <= cache_position[:, None]
    return torch.where(allowed, 0.0, NEG)[None, None]


class StaticCache:
    def __init__(self, hidden, max_cache_len, device):
        self.keys = torch.zeros(1, max_cache_len, hidden, device=device)
        self.values = torch.zeros(1, max_cache_len, hidden, device=device)

    def update(self, k, v, cache_position):
        self.keys.index_copy_(1, cache_position, k)
        self.values.index_copy_(1, cache_position, v)
        return self.keys, self.values

    def reset(self):
        self.keys.zero_()
        self.values.zero_()


class Decoder:
    """One attention layer for the talker backbone / the predictor's inner model (weights on ``cuda:1``)."""

    def __init__(self, hidden, gen, device):
        self.device_index = torch.device(REQUESTED_DEVICE).index
        self.wq, self.wk, self.wv, self.wo = (randn(hidden, hidden, gen=gen, device=device, scale=0.7)
                                              for _ in range(4))
        self.freq = randn(hidden, gen=gen, device=device)

    def __call__(self, inputs_embeds, attention_mask, past_key_values, cache_position, position_ids=None,
                 use_cache=True):
        mask = attention_mask["full_attention"] if isinstance(attention_mask, dict) else attention_mask
        pos = cache_position[None, :].to(inputs_embeds.dtype) if position_ids is None else position_ids[0]
        x = inputs_embeds + torch.sin(pos[..., None] * self.freq)
        k, v = past_key_values.update(mm(x, self.wk), mm(x, self.wv), cache_position)
        scores = mm(mm(x, self.wq), k.transpose(-1, -2)) * x.shape[-1] ** -0.5 + mask[0]
        h = inputs_embeds + mm(mm(torch.softmax(scores, -1), v), self.wo)
        return SimpleNamespace(last_hidden_state=torch.tanh(h))


class CodePredictor:
    def __init__(self, gen, device):
        n = NUM_CODE_GROUPS - 1
        self.small_to_mtp_w = randn(TALKER_HIDDEN, PRED_HIDDEN, gen=gen, device=device, scale=0.8)
        self.model = Decoder(PRED_HIDDEN, gen, device)
        self.model.codec_embedding = [randn(PRED_VOCAB, TALKER_HIDDEN, gen=gen, device=device) for _ in range(n)]
        self.lm_head_w = [randn(PRED_HIDDEN, PRED_VOCAB, gen=gen, device=device) for _ in range(n)]

    def small_to_mtp_projection(self, x):
        return mm(x, self.small_to_mtp_w)


class Talker:
    def __init__(self, gen, device):
        self.model = Decoder(TALKER_HIDDEN, gen, device)
        self.codec_embedding = randn(CODEC_VOCAB, TALKER_HIDDEN, gen=gen, device=device)
        self.codec_head_w = randn(TALKER_HIDDEN, CODEC_VOCAB, gen=gen, device=device, scale=1.5)
        self.code_predictor = CodePredictor(gen, device)

    def codec_head(self, h):
        return mm(h, self.codec_head_w)


class PredictorGraph:
    def __init__(self, code_predictor, device, variant, requested_device=REQUESTED_DEVICE):
        self.device, self.variant = device, variant
        if variant == "fix":
            device_index = torch.device(requested_device).index
            device_index = device_index if device_index is not None else cuda.current_device()
            self.device_index = device_index
        self.num_codebooks = NUM_CODE_GROUPS - 1
        self.max_seq = 2 + self.num_codebooks
        cp = code_predictor
        self.small_to_mtp = cp.small_to_mtp_projection
        self.pred_model = cp.model
        self.lm_heads = [(lambda h, w=w: mm(h, w)) for w in cp.lm_head_w]
        self.codec_embeds = [(lambda ids, w=w: w[ids]) for w in cp.model.codec_embedding]
        self.static_cache = StaticCache(PRED_HIDDEN, self.max_seq, device)
        self.prefill_cache_pos = torch.arange(2, device=device)
        self.decode_cache_positions = [torch.tensor([2 + i], device=device) for i in range(self.num_codebooks - 1)]
        self.input_buf = torch.zeros(1, 2, TALKER_HIDDEN, device=device)
        self.output_tokens = torch.zeros(self.num_codebooks, dtype=torch.long, device=device)
        self.graph = None
        self.prefill_attn = {"full_attention": create_causal_mask(self.prefill_cache_pos, self.max_seq)}
        self.decode_attn = [{"full_attention": create_causal_mask(p, self.max_seq)}
                            for p in self.decode_cache_positions]

    def _full_loop(self):
        h = self.small_to_mtp(self.input_buf)
        out = self.pred_model(inputs_embeds=h, attention_mask=self.prefill_attn, past_key_values=self.static_cache,
                              cache_position=self.prefill_cache_pos, use_cache=True)
        h = out.last_hidden_state
        logits = self.lm_heads[0](h[:, -1:, :])
        tok = sample_logits(logits[:, 0, :])
        self.output_tokens[0] = tok[0]
        for cb_idx in range(1, self.num_codebooks):
            emb = self.small_to_mtp(self.codec_embeds[cb_idx - 1](tok.unsqueeze(0)))
            out = self.pred_model(inputs_embeds=emb, attention_mask=self.decode_attn[cb_idx - 1],
                                  past_key_values=self.static_cache,
                                  cache_position=self.decode_cache_positions[cb_idx - 1], use_cache=True)
            logits = self.lm_heads[cb_idx](out.last_hidden_state[:, -1:, :])
            tok = sample_logits(logits[:, 0, :])
            self.output_tokens[cb_idx] = tok[0]
        return self.output_tokens

    def capture(self, num_warmup=3):
        def full_loop():           # every kernel of it takes cuda:1 tensors: cuda:1's current stream runs it
            return cuda.launch(self.pred_model.device_index, self._full_loop)

        scope = cuda.device(self.device_index) if self.variant == "fix" else contextlib.nullcontext()
        with scope:                                          # fix: with torch.cuda.device(self.device_index)
            s = cuda.Stream()
            with cuda.stream(s):
                self.static_cache.reset()
                with cuda.graph_capture_stream():            # with torch.cuda.graph(self.graph): ...
                    self.graph, _ = capture(
                        full_loop, device=self.device, warmups=num_warmup + 1, name="predictor 15-step loop",
                        owner="PredictorGraph", static={"input_buf": self.input_buf},
                        state={"static_cache.keys": self.static_cache.keys,
                               "static_cache.values": self.static_cache.values})

    def run(self, pred_input):
        self.input_buf.copy_(pred_input)
        self.static_cache.reset()
        if self.graph is None:                               # the eager reference: the same loop, no graph
            self._full_loop()
        else:
            replay(self.graph, self.output_tokens)
        return self.output_tokens.clone()


class TalkerGraph:
    def __init__(self, talker_model, device, variant, max_seq_len=MAX_SEQ_LEN, requested_device=REQUESTED_DEVICE):
        self.device, self.variant, self.max_seq_len = device, variant, max_seq_len
        if variant == "fix":
            device_index = torch.device(requested_device).index
            device_index = device_index if device_index is not None else cuda.current_device()
            self.device_index = device_index
        self.model = talker_model
        self.static_cache = StaticCache(TALKER_HIDDEN, max_seq_len, device)
        self.input_buf = torch.zeros(1, 1, TALKER_HIDDEN, device=device)
        self.output_buf = torch.zeros(1, 1, TALKER_HIDDEN, device=device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.rope_deltas = torch.zeros(1, 1, device=device)
        self.position_ids = torch.zeros(3, 1, 1, device=device)
        self.graph = None
        self.attn_mask_table = [create_causal_mask(torch.tensor([i], device=device), max_seq_len)
                                for i in range(max_seq_len)]
        self.attn_mask = self.attn_mask_table[0].clone()

    def _set_attention_mask(self, position):
        self.attn_mask.copy_(self.attn_mask_table[position])

    def _decode_step(self):
        out = self.model(inputs_embeds=self.input_buf, attention_mask=self.attn_mask,
                         past_key_values=self.static_cache, cache_position=self.cache_position,
                         position_ids=self.position_ids, use_cache=True)
        self.output_buf.copy_(out.last_hidden_state)
        return self.output_buf

    def capture(self, prefill_len, num_warmup=3):
        self.cache_position[0] = prefill_len
        self._set_attention_mask(prefill_len)

        def decode_step():         # every kernel of it takes cuda:1 tensors: cuda:1's current stream runs it
            return cuda.launch(self.model.device_index, self._decode_step)

        scope = cuda.device(self.device_index) if self.variant == "fix" else contextlib.nullcontext()
        with scope:                                          # fix: with torch.cuda.device(self.device_index)
            s = cuda.Stream()
            with cuda.stream(s), cuda.graph_capture_stream():   # with torch.cuda.graph(self.graph): ...
                self.graph, _ = capture(
                    decode_step, device=self.device, warmups=num_warmup + 1, name="talker decode",
                    owner="TalkerGraph",
                    static={"input_buf": self.input_buf, "cache_position": self.cache_position,
                            "attn_mask": self.attn_mask, "position_ids": self.position_ids},
                    state={"static_cache.keys": self.static_cache.keys,
                           "static_cache.values": self.static_cache.values})

    def prefill_kv(self, past_key_values):
        self.static_cache.reset()
        k, v = past_key_values
        seq_len = k.shape[1]
        self.static_cache.update(k, v, torch.arange(seq_len, device=self.device))
        return seq_len

    def run(self, input_embeds, position):
        self.input_buf.copy_(input_embeds)
        self.cache_position[0] = position
        self._set_attention_mask(position)
        delta = self.rope_deltas + self.cache_position[0].to(self.rope_deltas.dtype)
        self.position_ids.copy_(delta.unsqueeze(0).expand(3, -1, -1))
        if self.graph is None:                               # the eager reference: the same step, no graph
            return self._decode_step()
        return replay(self.graph, self.output_buf)


def fast_generate(talker, talker_input_embeds, trailing_text_hiddens, tts_pad_embed, predictor_graph, talker_graph):
    device = talker_input_embeds.device
    # prefill (HF forward over the prompt, then its KV copied into the talker graph's static cache)
    prompt_cache = StaticCache(TALKER_HIDDEN, PROMPT_LEN, device)
    positions = torch.arange(PROMPT_LEN, device=device)
    out = talker.model(inputs_embeds=talker_input_embeds, attention_mask=create_causal_mask(positions, PROMPT_LEN),
                       past_key_values=prompt_cache, cache_position=positions)
    past_hidden = out.last_hidden_state[:, -1:, :]
    token = sample_logits(talker.codec_head(out.last_hidden_state[:, -1, :]))
    prefill_len = talker_graph.prefill_kv((prompt_cache.keys, prompt_cache.values))
    predictor_codec_embeds = talker.code_predictor.model.codec_embedding
    all_codec_ids, gen_step = [], 0
    for step_idx in range(STEPS):
        last_id_hidden = talker.codec_embedding[token.unsqueeze(1)]
        pred_input = torch.cat((past_hidden, last_id_hidden), dim=1)
        codebook_token_ids = predictor_graph.run(pred_input)
        all_codec_ids.append(torch.cat([token.view(1), codebook_token_ids]))
        codec_hiddens = [last_id_hidden] + [predictor_codec_embeds[i][codebook_token_ids[i].unsqueeze(0).unsqueeze(0)]
                                            for i in range(NUM_CODE_GROUPS - 1)]
        inputs_embeds = torch.cat(codec_hiddens, dim=1).sum(1, keepdim=True)
        if gen_step < trailing_text_hiddens.shape[1]:
            inputs_embeds = inputs_embeds + trailing_text_hiddens[:, gen_step].unsqueeze(1)
        else:
            inputs_embeds = inputs_embeds + tts_pad_embed
        hidden_states = talker_graph.run(inputs_embeds, position=prefill_len + step_idx)
        token = sample_logits(talker.codec_head(hidden_states[:, -1, :]))
        past_hidden = hidden_states[:, -1:, :].clone()
        gen_step += 1
    return torch.stack(all_codec_ids)


def run(variant: str, device: str = "cpu"):
    gen = generator(45)
    prompt = randn(1, PROMPT_LEN, TALKER_HIDDEN, gen=gen, device=device)
    trailing = randn(1, TEXT_LEN, TALKER_HIDDEN, gen=gen, device=device)
    tts_pad_embed = randn(1, 1, TALKER_HIDDEN, gen=gen, device=device, scale=0.5)

    def serve(graphed: bool):
        global cuda
        cuda = _Cuda(CURRENT_DEVICE)                         # a fresh process: current device cuda:0
        talker = Talker(generator(4545), device)
        predictor_graph = PredictorGraph(talker.code_predictor, device, variant)
        talker_graph = TalkerGraph(talker.model, device, variant)
        if graphed:                                          # FasterQwen3TTS._warmup
            predictor_graph.capture(num_warmup=3)
            talker_graph.capture(prefill_len=PROMPT_LEN, num_warmup=3)
            assert cuda.current_device() == CURRENT_DEVICE   # the caller's current device is kept
        codes = fast_generate(talker, prompt, trailing, tts_pad_embed, predictor_graph, talker_graph)
        return [codes]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
