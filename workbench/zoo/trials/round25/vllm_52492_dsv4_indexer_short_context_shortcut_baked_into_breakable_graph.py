"""DeepSeek V4's indexer shortcut for short contexts is captured into the breakable PIECEWISE graph: no scoring.

Upstream: https://github.com/vllm-project/vllm/pull/52492 ("[Bugfix][DSv4] Keep indexer scoring in breakable
graphs"), related to issue #52448.
Symptom: DeepSeek-V4-Flash-0731 on 2x B200 (TP2 + EP, DSpark-7, prefix caching, ``FULL_AND_PIECEWISE``
breakable CUDA graphs, Model Runner V2): above 2048 prompt tokens, where C4 layers have more than 512 compressed
candidates, the sparse attention used candidates ``0..511`` instead of the learned top-512; the PR compares
prompt lengths on unpatched main with the fix (vLLM main at 8efa13b700, August 2026).
Mechanism: #49486 added a host-side shortcut to ``DeepseekV4Indexer.forward``: when
``indexer_metadata.max_seq_len // compress_ratio <= topk_tokens`` every compressed candidate is selected, so the
learned scoring is skipped: the compressor still builds the indexer K cache and ``_fill_short_context_topk_indices``
writes candidates ``0..num_compressed-1`` (``-1`` after) into ``topk_indices_buffer``, and the forward returns
``(None, None, None)``. #51430 moved ``DeepseekV4Indexer.forward`` into the captured region; only
``_sparse_indexer_and_attn`` (the ``indexer_op`` scoring and ``forward_mqa``) stays an eager break. Breakable
PIECEWISE capture runs on short dummy metadata, so the capture takes the shortcut: the graph records the fill
kernel and no query projection, and the eager break is replayed with the capture's ``index_q = None``, so
``indexer_op`` never runs. A replay for a long cached prefix then attends over candidates ``0..topk-1``
instead of the highest-scoring ones.
Doctor: warmup-divergence, at ``forward`` (``DeepseekV4Indexer.forward``: the capture took the short-context
branch that an eager step with a long context does not take).
Fix (upstream): take the shortcut only when ``not torch.cuda.is_current_stream_capturing()``; the graph then
records the scoring path (valid for short and long contexts) and eager execution keeps the shortcut.
Read: the PR description, and the fixed ``vllm/models/deepseek_v4/attention.py`` with its regression test
``test_indexer_graph_capture.py`` as backported verbatim ("exact backport of vLLM commit 292187dd") in
local-inference-lab/vllm PR #429; the pre-fix condition is the same without the capture check. Sizes are tiny:
compress ratio 2 and top-3 stand in for 4 and 512, the compressor pools a window by its last token, and the
breakable capture is modelled as two captured segments around the eager break.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/52492"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward"
SYMPTOM = "DSv4 breakable PIECEWISE graphs: long-prefix replays attend the first top-k candidates, unscored"

VOCAB, DIM, MAX_REQS, MAX_LEN = 16, 4, 2, 16
COMPRESS_RATIO, INDEX_TOPK = 2, 3
MAX_C = MAX_LEN // COMPRESS_RATIO
TRASH = MAX_REQS * MAX_C                  # the compressed caches' scratch row: non-boundary tokens write there
SIZE = 2                                  # breakable PIECEWISE graph for two tokens (two decoding requests)
INDEXER_PREFIX = "layers.0.attn.indexer.k_cache"

_forward_context = SimpleNamespace(attn_metadata=None)


def get_forward_context():
    return _forward_context


@dataclasses.dataclass
class DeepseekV4IndexerMetadata:
    max_seq_len: int
    num_decode_tokens: int
    num_prefill_tokens: int


class Model:
    def __init__(self, device):
        gen = generator(52492)
        w = lambda: randn(DIM, DIM, gen=gen, device=device, scale=0.8)  # noqa: E731
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq_a, self.wkv, self.wq_b, self.wo = w(), w(), w(), w()
        self.w_comp, self.w_index_comp, self.w_index_q = w(), w(), w()
        self.cand = torch.arange(MAX_C, device=device)
        self.topk_offsets = torch.arange(INDEX_TOPK, device=device)


class DeepseekCompressor:
    """Every ``compress_ratio``-th token pools its window into the next compressed cache entry."""

    def __init__(self, weight, cache):
        self.weight, self.cache = weight, cache

    def __call__(self, kv_score, positions, req_ids):
        boundary = (positions + 1) % COMPRESS_RATIO == 0
        entry = req_ids * MAX_C + (positions + 1) // COMPRESS_RATIO - 1
        self.cache[torch.where(boundary, entry, torch.full_like(entry, TRASH))] = torch.tanh(kv_score @ self.weight)


def _fill_short_context_topk_indices(topk_indices_buffer, positions, offsets):
    """Selects every candidate, -1 otherwise (the Triton kernel of the shortcut)."""
    num_compressed = (positions + 1) // COMPRESS_RATIO
    off = offsets[None, :].expand(positions.shape[0], -1)
    topk_indices_buffer[:positions.shape[0]] = torch.where(off < num_compressed[:, None], off, -1)


class DeepseekV4Indexer:
    def __init__(self, model, index_k_cache, topk_indices_buffer, variant):
        self.model, self.variant = model, variant
        self.compress_ratio, self.topk_tokens = COMPRESS_RATIO, INDEX_TOPK
        self.k_cache_prefix = INDEXER_PREFIX
        self.index_k_cache = index_k_cache
        self.topk_indices_buffer = topk_indices_buffer
        self.compressor = DeepseekCompressor(model.w_index_comp, index_k_cache)

    def forward(self, qr, compressed_kv_score, positions, req_ids):
        indexer_metadata = get_forward_context().attn_metadata[self.k_cache_prefix]
        if (indexer_metadata.max_seq_len // self.compress_ratio <= self.topk_tokens
                and (self.variant == "bug" or not torch.cuda.is_current_stream_capturing())):
            # candidates num smaller than topk, every candidate is selected
            # but we still need to build k cache
            self.compressor(compressed_kv_score, positions, req_ids)
            _fill_short_context_topk_indices(self.topk_indices_buffer, positions, self.model.topk_offsets)
            return None
        q = qr @ self.model.w_index_q                        # wq_b_and_q_quant
        self.compressor(compressed_kv_score, positions, req_ids)
        return q

    def indexer_op(self, q, positions, req_ids):
        """SparseAttnIndexer: score the compressed candidates, keep the top-k (-1 where fewer)."""
        num_compressed = (positions + 1) // COMPRESS_RATIO
        keys = self.index_k_cache[req_ids[:, None] * MAX_C + self.model.cand]
        logits = (keys @ q[:, :, None]).squeeze(-1)
        logits = logits.masked_fill(self.model.cand >= num_compressed[:, None], float("-inf"))
        vals, idx = logits.topk(self.topk_tokens, -1)
        self.topk_indices_buffer[:q.shape[0]] = torch.where(vals > float("-inf"), idx, -1)


class DeepseekV4Attention:
    def __init__(self, model, device, variant):
        self.model = model
        self.kv_cache = torch.zeros(TRASH + 1, DIM, device=device)        # compressed MLA KV
        self.index_k_cache = torch.zeros(TRASH + 1, DIM, device=device)
        self.topk_indices_buffer = torch.full((MAX_LEN * MAX_REQS, INDEX_TOPK), -1, dtype=torch.long, device=device)
        self.indexer = DeepseekV4Indexer(model, self.index_k_cache, self.topk_indices_buffer, variant)
        self.compressor = DeepseekCompressor(model.w_comp, self.kv_cache)

    def prepare(self, hidden_states, positions, req_ids):
        """The captured part of ``_prepare_and_attn``: projections, the indexer, the MLA compressor."""
        qr = hidden_states @ self.model.wq_a
        kv = hidden_states @ self.model.wkv
        index_q = self.indexer.forward(qr, hidden_states, positions, req_ids)
        q = qr @ self.model.wq_b
        self.compressor(hidden_states, positions, req_ids)
        return index_q, q, kv

    def _sparse_indexer_and_attn(self, index_q, q, kv, positions, req_ids, out):
        """The eager break: the indexer op (when the indexer returned a query) and forward_mqa."""
        if index_q is not None:
            self.indexer.indexer_op(index_q, positions, req_ids)
        n = q.shape[0]
        sel = self.topk_indices_buffer[:n]
        keys = torch.cat([self.kv_cache[req_ids[:, None] * MAX_C + sel.clamp(min=0)], kv[:, None]], 1)
        visible = torch.cat([sel >= 0, torch.ones_like(sel[:, :1], dtype=torch.bool)], 1)
        scores = (keys @ q[:, :, None]).squeeze(-1).masked_fill(~visible, float("-inf"))
        out[:n] = (torch.softmax(scores, -1)[:, :, None] * keys).sum(1)

    def o_proj(self, hidden_states, out):
        return hidden_states + out @ self.model.wo

    def forward(self, hidden_states, positions, req_ids, out):
        index_q, q, kv = self.prepare(hidden_states, positions, req_ids)
        self._sparse_indexer_and_attn(index_q, q, kv, positions, req_ids, out)
        return self.o_proj(hidden_states, out)


class BreakableCUDAGraphWrapper:
    """Captures the forward as graph segments split at the eager break; a replay replays each segment and
    calls the break with the arguments the capture handed it."""

    def __init__(self, model, attn, device, input_ids, positions, req_ids, out):
        self.attn, self.captured_args = attn, None
        pool = graph_pool_handle(device)
        static = {"input_ids": input_ids, "positions": positions, "req_ids": req_ids}
        state = {"kv_cache": attn.kv_cache, "index_k_cache": attn.index_k_cache}

        def segment0():
            h = model.emb[input_ids]
            index_q, q, kv = attn.prepare(h, positions, req_ids)
            self.captured_args = (index_q, q, kv, positions, req_ids, out)
            return (h, q, kv) if index_q is None else (h, q, kv, index_q)

        self.g0, self.out0 = capture(segment0, device=device, pool=pool, name=f"size {SIZE} piece 0",
                                     static=static, state=state, owner="BreakableCUDAGraphWrapper")
        attn._sparse_indexer_and_attn(*self.captured_args)             # the break runs eagerly during capture
        h = self.out0[0]
        self.g1, self.out1 = capture(lambda: attn.o_proj(h, out), device=device, pool=pool,
                                     name=f"size {SIZE} piece 1", static={"o_padded": out},
                                     owner="BreakableCUDAGraphWrapper")

    def replay(self):
        replay(self.g0, self.out0)
        self.attn._sparse_indexer_and_attn(*self.captured_args)
        return replay(self.g1, self.out1)


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device = model, device
        self.attn = DeepseekV4Attention(model, device, variant)
        self.input_ids = torch.zeros(MAX_LEN * MAX_REQS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_LEN * MAX_REQS, dtype=torch.long, device=device)
        self.req_ids = torch.zeros(MAX_LEN * MAX_REQS, dtype=torch.long, device=device)
        self.o_padded = torch.zeros(MAX_LEN * MAX_REQS, DIM, device=device)
        self.cg = None
        if graphed:
            # capture on the dummy batch: position 0, seq_len 1
            _forward_context.attn_metadata = {INDEXER_PREFIX: DeepseekV4IndexerMetadata(1, SIZE, 0)}
            self.cg = BreakableCUDAGraphWrapper(model, self.attn, device, self.input_ids[:SIZE],
                                                self.positions[:SIZE], self.req_ids[:SIZE], self.o_padded[:SIZE])

    def execute_model(self, tokens):
        """``tokens``: (token id, position, request) per scheduled token."""
        n = len(tokens)
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        self.input_ids[:n].copy_(t([tok for tok, _, _ in tokens]))
        self.positions[:n].copy_(t([pos for _, pos, _ in tokens]))
        self.req_ids[:n].copy_(t([r for _, _, r in tokens]))
        decodes = len({r for _, _, r in tokens}) == n
        _forward_context.attn_metadata = {INDEXER_PREFIX: DeepseekV4IndexerMetadata(
            max(pos for _, pos, _ in tokens) + 1, n if decodes else 0, 0 if decodes else n)}
        if self.cg is not None and n == SIZE:
            return self.cg.replay().clone()
        h = self.model.emb[self.input_ids[:n]]
        return self.attn.forward(h, self.positions[:n], self.req_ids[:n], self.o_padded[:n]).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(5249)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (12, 11)]
    decodes = [torch.randint(0, VOCAB, (MAX_REQS,), generator=gen).tolist() for _ in range(3)]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        outs = [runner.execute_model([(tok, pos, r) for r, p in enumerate(prompts) for pos, tok in enumerate(p)])]
        lens = [len(p) for p in prompts]
        for step in decodes:             # 6 and 5+ compressed candidates per request: more than the top-3
            outs.append(runner.execute_model([(tok, lens[r], r) for r, tok in enumerate(step)]))
            lens = [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
