"""Qwen3-VL decode graphs are cached by KV slot only; a later prompt replays the first prompt's RoPE position.

Upstream: https://github.com/flashrt-project/FlashRT/pull/125 ("fix(qwen3-vl): bound CUDA graph caches", squash
94465a5d; the decode-graph part is its commit 3750db48 "fix(qwen3-vl): key decode graphs by rope position").
Symptom: the first prompt decodes correctly; a later prompt (another image grid, or text after an image) that reaches
the same KV-cache slots decodes with the rotary position of the prompt that captured the slot's graph: wrong or
degraded tokens (no user report; found in review).
Mechanism: ``Qwen3VlTorchFrontendRtx._ensure_decode_graph(cache_pos, rope_pos)`` lazily captures one decode graph
per step: ``cos, sin = llm._rope_cos_sin(rope_pos)`` (views of rows ``rope_pos`` of the persistent RoPE tables) is
taken on the host before capture, two warmups and the capture call ``llm.forward_own_decode_nvfp4(
llm._static_token_id, cos, sin, cache_pos)``, and the graph is stored as ``self._decode_graphs[cache_pos]``. The
graph therefore reads the RoPE rows of the capture's ``rope_pos``. For a multimodal prompt the decode RoPE position
continues from ``p['mrope_max'] + 1`` while the slot continues from ``p['S']``; two prompts of one length ``S`` but
different ``mrope_max`` share slots but not positions. ``_decode_step_graph(token, cache_pos, rope_pos)`` refreshes
only ``_static_token_id`` and looks the graph up by ``cache_pos``: prompt 2 replays prompt 1's graphs, whose q/k are
rotated at prompt 1's positions (and whose K is written to the cache so rotated), while eager
(``use_graph=False``) slices ``_rope_cos_sin(base_rope + i)`` at every step.
Doctor: warmup-divergence, at ``_ensure_decode_graph``: the capture decided which RoPE rows the graph reads (a
tensor reference at ``rope_pos``), and replays for another ``rope_pos`` reuse it while eager slices the new rows.
Fix (upstream): key the decode-graph cache by ``key = (int(cache_pos), int(rope_pos))`` in ``_graph_cache_get``,
the store and ``move_to_end``; a new position captures its own graph (the PR also bounds the caches with an LRU).
"""
from __future__ import annotations

import collections

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashrt-project/FlashRT/pull/125"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_ensure_decode_graph"
SYMPTOM = "a later prompt reaching the same KV slots decodes with the first prompt's baked-in RoPE position"

VOCAB, HIDDEN, MAX_SEQ, THETA = 16, 4, 16, 10.0
MAX_NEW_TOKENS = 4
# (input_ids, per-token MRoPE positions): an image prompt whose 2x2 grid compresses positions, then a
# text-only prompt of the same length (S = 6): same KV slots 6.., RoPE continuing at 4 vs 6.
PROMPTS = (([1, 9, 9, 9, 9, 2], [0, 1, 1, 2, 2, 3]),
           ([1, 5, 7, 3, 8, 2], [0, 1, 2, 3, 4, 5]))


class Weights:
    def __init__(self, device):
        gen = generator(125)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.8)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)


def apply_rope(x, cos, sin):
    """Rotate halves of ``x`` [rows, HIDDEN] by ``cos``/``sin`` [rows, HIDDEN // 2]."""
    half = HIDDEN // 2
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Qwen3LanguageCoreRtx:
    """The language core (``qwen3_rtx``): RoPE tables, KV cache, static token and logits buffers."""

    def __init__(self, w, device):
        self.w, self.device = w, device
        half = HIDDEN // 2
        inv_freq = THETA ** -(torch.arange(half, dtype=torch.float32) / half)
        freqs = torch.outer(torch.arange(MAX_SEQ, dtype=torch.float32), inv_freq)
        self._rope_cos_table = freqs.cos().contiguous().to(device)
        self._rope_sin_table = freqs.sin().contiguous().to(device)
        self._k_cache = torch.zeros(MAX_SEQ, HIDDEN, device=device)
        self._v_cache = torch.zeros(MAX_SEQ, HIDDEN, device=device)
        self._static_token_id = torch.zeros(1, dtype=torch.long, device=device)
        self._logits_buf = torch.zeros(1, VOCAB, device=device)

    def _rope_cos_sin(self, cur_pos: int):
        """Slice (cos, sin) at cur_pos for a single-token decode call."""
        return self._rope_cos_table[cur_pos:cur_pos + 1], self._rope_sin_table[cur_pos:cur_pos + 1]

    def prefill(self, input_ids, pos_ids):
        """Eager multimodal prefill: writes the prompt's K/V into slots ``0..S-1``; returns last logits."""
        w, S = self.w, len(input_ids)
        x = w.embed[torch.tensor(input_ids, device=self.device)]
        pos = torch.tensor(pos_ids, device=self.device)
        cos, sin = self._rope_cos_table[pos], self._rope_sin_table[pos]
        q, k = apply_rope(x @ w.wq, cos, sin), apply_rope(x @ w.wk, cos, sin)
        self._k_cache[:S].copy_(k)
        self._v_cache[:S].copy_(x @ w.wv)
        mask = torch.ones(S, S, dtype=torch.bool, device=self.device).tril()
        scores = (q @ k.T / HIDDEN ** 0.5).masked_fill(~mask, float("-inf"))
        h = x + (torch.softmax(scores, -1) @ self._v_cache[:S]) @ w.wo
        return (h[-1:] @ w.lm_head).clone()

    def forward_own_decode_nvfp4(self, token_id, cos_pos, sin_pos, cache_pos: int):
        """One decode token: RoPE by the given (cos, sin), K/V written at ``cache_pos``, attention over the cache."""
        w = self.w
        x = w.embed[token_id]
        q, k = apply_rope(x @ w.wq, cos_pos, sin_pos), apply_rope(x @ w.wk, cos_pos, sin_pos)
        self._k_cache[cache_pos:cache_pos + 1].copy_(k)
        self._v_cache[cache_pos:cache_pos + 1].copy_(x @ w.wv)
        n = cache_pos + 1
        attn = torch.softmax(q @ self._k_cache[:n].T / HIDDEN ** 0.5, -1) @ self._v_cache[:n]
        self._logits_buf.copy_((x + attn @ w.wo) @ w.lm_head)
        return self._logits_buf[:1]


class Qwen3VlTorchFrontendRtx:
    def __init__(self, w, device, variant, max_decode_graphs=256):
        self.llm = Qwen3LanguageCoreRtx(w, device)
        self.device, self.variant = device, variant
        self.max_decode_graphs = int(max_decode_graphs)
        # cache-slot -> captured decode graph (bug); (cache-slot, rope-pos) -> graph (fix)
        self._decode_graphs: collections.OrderedDict = collections.OrderedDict()
        self._prompt = None

    def set_prompt(self, input_ids, pos_ids):
        self._prompt = {'input_ids': input_ids, 'S': len(input_ids), 'mrope_max': int(max(pos_ids)),
                        'pos_ids': pos_ids}

    def _graph_cache_get(self, cache, key):
        graph = cache.get(key)
        if graph is not None:
            cache.move_to_end(key)
        return graph

    def _trim_lru_graph_cache(self, cache, max_entries: int) -> None:
        while max_entries > 0 and len(cache) > max_entries:
            cache.popitem(last=False)

    def _ensure_decode_graph(self, cache_pos: int, rope_pos: int):
        """Lazy-capture a decode graph, baking the RoPE slice at ``rope_pos`` (not the cache slot)."""
        llm = self.llm
        key = (int(cache_pos), int(rope_pos)) if self.variant == "fix" else cache_pos
        g = self._graph_cache_get(self._decode_graphs, key)
        if g is not None:
            return g
        cos, sin = llm._rope_cos_sin(rope_pos)
        g = capture(lambda: llm.forward_own_decode_nvfp4(llm._static_token_id, cos, sin, cache_pos),
                    device=self.device, warmups=2, name=f"qwen3_vl_decode[{key}]",
                    owner="Qwen3VlTorchFrontendRtx (decode graphs)",
                    static={"_static_token_id": llm._static_token_id},
                    state={"k_cache": llm._k_cache, "v_cache": llm._v_cache})
        self._decode_graphs[key] = g
        self._decode_graphs.move_to_end(key)
        self._trim_lru_graph_cache(self._decode_graphs, self.max_decode_graphs)
        return g

    def _decode_step_graph(self, token: int, cache_pos: int, rope_pos: int):
        llm = self.llm
        llm._static_token_id.fill_(int(token))
        g, logits = self._ensure_decode_graph(cache_pos, rope_pos)
        return replay(g, logits)

    def generate(self, input_ids, pos_ids, *, max_new_tokens: int, use_graph: bool = True):
        """Greedy generation; returns every step's logits. The decode RoPE position continues from the
        prompt's max MRoPE position while the KV slot advances from the prompt length."""
        self.set_prompt(input_ids, pos_ids)
        llm, p = self.llm, self._prompt
        logits = llm.prefill(p['input_ids'], p['pos_ids'])
        base_slot, base_rope = p['S'], p['mrope_max'] + 1
        outs = [logits]
        tok = int(logits[0].argmax())
        for i in range(max_new_tokens - 1):
            if use_graph:
                logits = self._decode_step_graph(tok, base_slot + i, base_rope + i)
            else:
                cos, sin = llm._rope_cos_sin(base_rope + i)
                token_id = torch.tensor([tok], device=self.device)
                logits = llm.forward_own_decode_nvfp4(token_id, cos, sin, base_slot + i)
            outs.append(logits.clone())
            tok = int(logits[0].argmax())
        return outs


def run(variant: str, device: str = "cpu"):
    w = Weights(device)

    def serve(use_graph: bool):
        fe = Qwen3VlTorchFrontendRtx(w, device, variant)
        outs = []
        for input_ids, pos_ids in PROMPTS:
            outs += fe.generate(input_ids, pos_ids, max_new_tokens=MAX_NEW_TOKENS, use_graph=use_graph)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
