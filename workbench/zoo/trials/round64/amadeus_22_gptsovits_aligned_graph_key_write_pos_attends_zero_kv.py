"""GPT-SoVITS static-KV decode graph attends zero KV slots: the alignment gap and every unwritten slot.

Upstream: https://github.com/Code-Amadeus/Amadeus/pull/22 ("fix(tts): prevent runaway GPT-SoVITS filler
vowels"; issue https://github.com/Code-Amadeus/Amadeus/issues/21).
Symptom: with static KV + CUDA Graph, short Japanese fillers ("うーん……") turned into a long held vowel that
hid the sentence: 243 semantic tokens with a run of 192 equal tokens and 9.77 s of audio, where dynamic KV
gave 125 tokens / 5 s; 24/220 anomalous trials before the fix, 0/220 after.
Mechanism: ``Text2SemanticDecoder.infer_panel_naive`` runs ``process_prompt`` eagerly, copies the prompt
KV into the fixed ``[B, bucket, hidden]`` buffers of ``bucket_static_inputs[graph_key]`` and zeroes the
rest, then decodes one token per replay: ``T2SBlockWithStaticCache.decode_next_token_with_static_cache``
writes k/v with ``k_cache.scatter_(1, pos_idx, k)`` (``pos_idx`` is a persistent tensor ``fill_``-ed
before each replay) and runs SDPA over the whole bucket with no mask. To share graphs between sentences
the graph key ``(bucket, graph_initial_len)`` rounds the prompt length up to
``_GRAPH_INITIAL_LEN_STRIDE = 32`` (337/345/351 -> 352), and that aligned length was also the write
position: ``pos_idx.fill_(graph_initial_len + graph_step_count)``. So up to 31 zero KV rows sit between
the prompt and the first generated token, and every not-yet-written slot up to the bucket end is zero
too. A zero key gives logit 0, not weight 0: on every replay these padded slots take softmax mass away
from the real context, and the semantic tokens collapse. The dynamic (torch.cat) path sees only real KV.
Doctor: stale-padding, at ``decode_next_token_with_static_cache`` (the query's attention spans the
unwritten/gap KV slots of the static bucket, so what those padded slots hold reaches the real row).
Fix (upstream): a persistent ``key_valid_mask [B, bucket]`` in ``bucket_static_inputs``: reset with
``zero_()`` and set ``[:, :kv_cache_len] = True`` at each new sentence, marked inside the graph by
``T2STransformerWithStaticCache`` with ``key_valid_mask.scatter_(1, pos_idx[:, :, 0], True)``, and passed
as ``attn_mask`` to SDPA in every block; the write position becomes ``graph_prompt_len +
graph_step_count`` (``graph_initial_len`` is only the reuse key). (Also in the PR, not modelled: bucket
overflow switches to dynamic KV, capture no longer consumes the sampling RNG, a collapse guard.)
(Miniature: two sentences of 37 and 45 prompt positions share the key (96, 64); greedy argmax stands in for
sample(); the reference is the dynamic torch.cat path, which attends only to real KV.)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Code-Amadeus/Amadeus/pull/22"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "decode_next_token_with_static_cache"
SYMPTOM = "static-KV graph decode attends zero gap/unwritten KV slots; semantic tokens collapse to a held vowel"

HIDDEN, HEADS, LAYERS, VOCAB, MAX_POS = 16, 2, 2, 24, 128
_GRAPH_INITIAL_LEN_STRIDE = 32
KV_CACHE_BUCKETS = (96,)
SENTENCES = ((37, 5), (45, 5))        # (prompt length, decode steps): both align to 64, one graph key


class T2SBlock:
    def __init__(self, gen, device):
        s = 1 / math.sqrt(HIDDEN)
        self.qkv_w, self.out_w = randn(3 * HIDDEN, HIDDEN, gen=gen, device=device, scale=s * 2), \
            randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=s)
        self.w1, self.w2 = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=s), \
            randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=s)

    def _tail(self, x, attn):
        x = F.layer_norm(x + F.linear(attn, self.out_w), [HIDDEN])
        return F.layer_norm(x + F.linear(F.relu(F.linear(x, self.w1)), self.w2), [HIDDEN])

    @staticmethod
    def _heads(t):
        return t.view(t.shape[0], t.shape[1], HEADS, -1).transpose(1, 2)

    def _attend(self, q, k, v, mask):
        attn = F.scaled_dot_product_attention(self._heads(q), self._heads(k), self._heads(v), attn_mask=mask)
        return attn.transpose(1, 2).reshape(q.shape[0], q.shape[1], HIDDEN)

    def process_prompt(self, x):
        q, k, v = F.linear(x, self.qkv_w).chunk(3, dim=-1)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        return self._tail(x, self._attend(q, k, v, causal)), k, v

    def decode_next_token(self, x, k_cache, v_cache):
        """Dynamic KV (the reference path): the cache grows with torch.cat, only real KV exists."""
        q, k, v = F.linear(x, self.qkv_w).chunk(3, dim=-1)
        k_cache, v_cache = torch.cat([k_cache, k], dim=1), torch.cat([v_cache, v], dim=1)
        return self._tail(x, self._attend(q, k_cache, v_cache, None)), k_cache, v_cache

    def decode_next_token_with_static_cache(self, x, k_cache, v_cache, pos_idx, key_valid_mask):
        """T2SBlockWithStaticCache: scatter_ this step's k/v at pos_idx, attend over the whole bucket."""
        q, k, v = F.linear(x, self.qkv_w).chunk(3, dim=-1)
        k_cache.scatter_(1, pos_idx, k)
        v_cache.scatter_(1, pos_idx, v)
        mask = None if key_valid_mask is None else key_valid_mask.unsqueeze(1).unsqueeze(1)
        return self._tail(x, self._attend(q, k_cache, v_cache, mask))   # mask None: zero KV slots count


class Text2SemanticDecoder:
    def __init__(self, device, variant):
        gen = generator(22)
        self.device, self.variant = device, variant
        self.blocks = [T2SBlock(gen, device) for _ in range(LAYERS)]
        self.ar_audio_embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.ar_predict_layer = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.5)
        pos = torch.arange(MAX_POS)[:, None] / (100 ** (torch.arange(0, HIDDEN, 2) / HIDDEN))
        self.pe = torch.stack([pos.sin(), pos.cos()], -1).flatten(1).to(device)
        self.bucket_graphs, self.bucket_static_inputs, self.bucket_static_outputs = {}, {}, {}

    def next_xy_pos(self, logits, position):
        """Greedy stand-in for sample(): the next token's embedding plus its sine position."""
        return (self.ar_audio_embedding[logits.argmax(-1)] + self.pe[position])[:, None, :]

    def process_prompt(self, xy_pos):
        ks, vs = [], []
        for blk in self.blocks:
            xy_pos, k, v = blk.process_prompt(xy_pos)
            ks.append(k)
            vs.append(v)
        return F.linear(xy_pos[:, -1], self.ar_predict_layer), ks, vs

    def decode_next_token_with_static_cache(self, static_in):
        """T2STransformerWithStaticCache + ar_predict_layer: the captured decode step."""
        x, pos_idx, mask = static_in["xy_pos"], static_in["pos_idx"], static_in.get("key_valid_mask")
        if mask is not None:                                     # fix: mark the current write slot valid
            mask.scatter_(1, pos_idx[:, :, 0], True)
        for i, blk in enumerate(self.blocks):
            x = blk.decode_next_token_with_static_cache(x, static_in["k_cache"][i], static_in["v_cache"][i],
                                                        pos_idx, mask)
        return F.linear(x[:, -1], self.ar_predict_layer)

    def _warmup_and_capture_bucket(self, bucket, graph_initial_len):
        dev = self.device
        static_in = {"xy_pos": torch.zeros(1, 1, HIDDEN, device=dev),
                     "k_cache": [torch.zeros(1, bucket, HIDDEN, device=dev) for _ in range(LAYERS)],
                     "v_cache": [torch.zeros(1, bucket, HIDDEN, device=dev) for _ in range(LAYERS)],
                     "pos_idx": torch.full((1, 1, HIDDEN), graph_initial_len, dtype=torch.long, device=dev)}
        state = {**{f"k_cache.{i}": t for i, t in enumerate(static_in["k_cache"])},
                 **{f"v_cache.{i}": t for i, t in enumerate(static_in["v_cache"])}}
        if self.variant == "fix":
            static_in["key_valid_mask"] = torch.zeros(1, bucket, dtype=torch.bool, device=dev)
            state["key_valid_mask"] = static_in["key_valid_mask"]
        key = (bucket, graph_initial_len)
        g, out = capture(lambda: self.decode_next_token_with_static_cache(static_in), device=dev, warmups=2,
                         name=f"t2s decode {key}", owner="Text2SemanticDecoder",
                         static={"xy_pos": static_in["xy_pos"], "pos_idx": static_in["pos_idx"]}, state=state)
        self.bucket_graphs[key], self.bucket_static_inputs[key], self.bucket_static_outputs[key] = g, static_in, out

    def infer_panel_naive(self, xy_pos, steps, graphed):
        """Prompt eagerly, then one token per step: static-KV graph replays, or dynamic KV (eager)."""
        logits, k_cache, v_cache = self.process_prompt(xy_pos)
        kv_cache_len = k_cache[0].shape[1]
        outs = [logits]
        if not graphed:
            for idx in range(steps):
                x = self.next_xy_pos(logits, kv_cache_len + idx)
                for i, blk in enumerate(self.blocks):
                    x, k_cache[i], v_cache[i] = blk.decode_next_token(x, k_cache[i], v_cache[i])
                logits = F.linear(x[:, -1], self.ar_predict_layer)
                outs.append(logits)
            return outs
        bucket = next(b for b in KV_CACHE_BUCKETS if b > kv_cache_len)
        graph_initial_len = -(-kv_cache_len // _GRAPH_INITIAL_LEN_STRIDE) * _GRAPH_INITIAL_LEN_STRIDE
        graph_key = (bucket, graph_initial_len)
        if graph_key not in self.bucket_graphs:
            self._warmup_and_capture_bucket(bucket, graph_initial_len)
        static_in, g = self.bucket_static_inputs[graph_key], self.bucket_graphs[graph_key]
        for i in range(LAYERS):        # new sentence: prompt KV in, gap + generated region cleared
            for dst, src in ((static_in["k_cache"][i], k_cache[i]), (static_in["v_cache"][i], v_cache[i])):
                dst[:, :kv_cache_len].copy_(src)
                dst[:, kv_cache_len:].zero_()
        if "key_valid_mask" in static_in:
            static_in["key_valid_mask"].zero_()
            static_in["key_valid_mask"][:, :kv_cache_len] = True
        # bug: the aligned graph key doubles as the logical write start; fix: the real prompt length
        graph_prompt_len = kv_cache_len if self.variant == "fix" else graph_initial_len
        for graph_step_count in range(steps):
            static_in["xy_pos"].copy_(self.next_xy_pos(logits, kv_cache_len + graph_step_count))
            write_pos = graph_prompt_len + graph_step_count
            static_in["pos_idx"].fill_(write_pos)
            unwritten = {f"{n}.{i}": (static_in[n][i], write_pos + 1) for n in ("k_cache", "v_cache")
                         for i in range(LAYERS)}
            logits = replay(g, self.bucket_static_outputs[graph_key], padded_columns=unwritten).clone()
            outs.append(logits)
        return outs


def run(variant: str, device: str = "cpu"):
    gen = generator(2122)
    prompts = [randn(1, n, HIDDEN, gen=gen, device=device) for n, _ in SENTENCES]

    def serve(graphed):
        model = Text2SemanticDecoder(device, variant)
        outs = []
        for xy_pos, (_, steps) in zip(prompts, SENTENCES):
            outs.extend(model.infer_panel_naive(xy_pos, steps, graphed))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
