"""FlashInfer's fused RoPE + FP8-quantize + paged-KV-append kernel appends a FULL-CUDA-graph padding token (seqlen 0) at the batch index and position an earlier step left in the padded row of ``batch_indices``, overwriting a live request's KV cache.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/2792 ("feat: Support padding tokens with seqlen=0 for
rope+quant+kv cache update fusion kernel", flashinfer-ai/flashinfer, merged 2026-04-10 as b705b6799). Read: the commit
message (vLLM runs FULL cudagraphs with seqlen=0 padding tokens; ``get_batch_indices_positions_kernel`` must initialise
``batch_indices``/``positions`` to -1/0 so padding tokens can be recognised, and
``rope_quantize_fp8_append_paged_kv_cache`` must skip them) and its full diff: ``flashinfer/page.py``
``get_batch_indices_positions`` (``torch.empty`` -> ``torch.full(-1)`` / ``torch.zeros`` for fresh outputs, and
``batch_indices.fill_(-1)`` for a caller's pre-allocated buffer, before launching the Triton
``get_batch_indices_positions_kernel``, which stores only the offsets inside ``[append_indptr[b], append_indptr[b+1])``),
``include/flashinfer/pos_enc.cuh`` ``RopeQuantizeAppendPagedKVCacheKernel`` (the page location
``indptr[batch_indices[idx]] * page_size + positions[idx]`` and every Q/K/V branch wrapped in
``if (batch_indices[idx] >= 0)``), and the new test ``test_rope_quantize_fp8_append_paged_kv_cache_padding`` (3 real
decode requests padded to 5, ``qo_indptr`` ``[0,1,2,3,3,3]``, the prefilled KV cache must stay unchanged). Also read the
Python wrapper ``rope_quantize_fp8_append_paged_kv_cache`` in ``flashinfer/rope.py`` (its arguments and layout). The
serving side (vLLM's FULL-cudagraph runner and where it computes ``batch_indices``/``positions``) was not read: the
runner below is a stand-in built from the commit message and the test.
Symptom: with the fused rope+quant+KV-cache-update kernel under FULL CUDA graphs, every batch padded to a captured size
carries padding tokens that belong to no request (``qo_indptr`` stops at the real token count). Their rows of the
persistent ``batch_indices``/``positions`` buffers are never written, so the kernel appends the padding token's K/V at
whatever request and position an earlier, larger batch left there: a live request's cached K/V is overwritten and its
later tokens are wrong. Eager batches have no padding tokens and are correct.
Mechanism: ``get_batch_indices_positions`` fills only the real tokens' rows of the caller's buffers; padded rows keep the
previous step's values (here: request 0, position 3 from a 4-token prefill). The captured kernel reads all padded rows:
``kv_indptr[0] * page_size + 3`` is the first request's page, slot 3. Eagerly there are no padded rows, so nothing stale
is read.
Doctor: stale-padding, at rope_quantize_fp8_append_paged_kv_cache. Real rows depend on what the padded rows of the
per-token metadata hold: the kernel follows a padded row's stale batch index and position into a real request's KV
cache instead of skipping it.
Fix (upstream): ``get_batch_indices_positions`` sets the rows it does not write to -1 (``batch_indices.fill_(-1)``), and
the kernel skips tokens whose batch index is negative.
Modelled: ``get_batch_indices_positions`` and ``get_batch_indices_positions_kernel`` (the masked stores, vectorised),
``rope_quantize_fp8_append_paged_kv_cache`` with its kernel ``RopeQuantizeAppendPagedKVCacheKernel`` (GQA, neox RoPE
from ``cos_sin_cache``, quant scales, NHD page layout; the FP8 cast is left out, the cache stays float64; a skipped token
is written to one scratch cache row that nothing reads, the kernel's early return), and a paged-prefill attention
stand-in for ``BatchPrefillWithPagedKVCacheWrapper.run`` planned from ``qo_indptr``/``kv_indptr``/``kv_indices``/
``kv_last_page_len``. Stand-ins: ``GPUModelRunner`` (persistent ``input_ids``/``positions``/``query_start_loc``/
``seq_lens``/paged-KV buffers, FULL graphs at token sizes [2, 4], padding requests with zero tokens, page 0 reserved for
dummy requests), ``FlashInferMetadataBuilder.build`` calling ``get_batch_indices_positions`` into persistent buffers
before each step, and a one-layer model (hidden 8, 2 query heads, 1 KV head, head dim 4, page size 4, vocab 16, float64).
Workload: graphs captured at startup; A prefills 4 tokens (size 4, no padding); then A decodes with B's 2-token prefill
(3 tokens padded to 4), A and B decode (size 2), A and B decode with C's 1-token prefill (3 padded to 4), and A, B, C
decode (3 padded to 4); greedy tokens are fed back. The bug appends the padding token onto A's position 3 in every
padded step: step 0 matches, A's logits differ from step 1 on (by 3.9, 5.4, 4.5, 5.0, and its greedy tokens change),
B and C stay exact. The fix equals eager (1.8e-15).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/2792"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "rope_quantize_fp8_append_paged_kv_cache"
SYMPTOM = ("FULL CUDA graphs with seqlen=0 padding tokens: the fused RoPE+FP8+paged-KV-append kernel appends each padding "
           "token at the batch index and position an earlier step left in its row of batch_indices/positions, "
           "overwriting a live request's KV cache")

HIDDEN, VOCAB = 8, 16
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 4          # rope_dim = head_dim (no non-rope part)
PAGE_SIZE = 4
NUM_PAGES = 9                                           # page 0: the null page of dummy requests
MAX_PAGES_PER_REQ = 3
MAX_KV_LEN = MAX_PAGES_PER_REQ * PAGE_SIZE
MAX_POS = 32
CUDA_GRAPH_SIZES = [2, 4]                               # FULL graphs, by token count
MAX_NUM_TOKENS = MAX_NUM_REQS = max(CUDA_GRAPH_SIZES)

_variant = "bug"


# --- flashinfer/page.py, flashinfer/triton/page.py ---------------------------------------------------------------------

def get_batch_indices_positions_kernel(append_indptr, seq_lens_ptr, batch_indices_ptr, positions_ptr):
    """One program per request: ``store(batch_indices[offs], b, mask=offs < batch_end)`` and
    ``store(positions[offs], offs + seq_len - batch_end, mask)`` for ``offs`` in ``[batch_start, batch_end)``. Offsets
    past ``append_indptr[-1]`` belong to no request and are not stored."""
    batch_size = append_indptr.shape[0] - 1
    nnz = batch_indices_ptr.shape[0]
    offsets = torch.arange(nnz, device=append_indptr.device, dtype=append_indptr.dtype)
    batch_idx = torch.searchsorted(append_indptr[1:].contiguous(), offsets, right=True)
    mask = batch_idx < batch_size
    batch_idx = batch_idx.clamp(max=batch_size - 1)
    batch_end = append_indptr[1:][batch_idx]
    seq_len = seq_lens_ptr[batch_idx]
    batch_indices_ptr.copy_(torch.where(mask, batch_idx.to(batch_indices_ptr.dtype), batch_indices_ptr))
    positions_ptr.copy_(torch.where(mask, (offsets + seq_len - batch_end).to(positions_ptr.dtype), positions_ptr))


def get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices=None, positions=None):
    """Convert append indptr and sequence lengths to per-token batch indices and positions."""
    device, dtype = append_indptr.device, torch.int32
    if batch_indices is None:
        batch_indices = (torch.full((nnz,), -1, device=device, dtype=dtype) if _variant == "fix"
                         else torch.empty((nnz,), device=device, dtype=dtype))
    else:
        assert batch_indices.shape == (nnz,) and batch_indices.dtype == dtype
        if _variant == "fix":
            batch_indices.fill_(-1)                    # rows of padding tokens are recognisable
    if positions is None:
        positions = (torch.zeros((nnz,), device=device, dtype=dtype) if _variant == "fix"
                     else torch.empty((nnz,), device=device, dtype=dtype))
    else:
        assert positions.shape == (nnz,) and positions.dtype == dtype
    get_batch_indices_positions_kernel(append_indptr, seq_lens, batch_indices, positions)
    return batch_indices, positions


def get_seq_lens(kv_indptr, kv_last_page_len, page_size):
    return (torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size
            + kv_last_page_len) * (kv_indptr[1:] > kv_indptr[:-1])


# --- flashinfer/rope.py, include/flashinfer/pos_enc.cuh ------------------------------------------------------------------

def _apply_rope_neox(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def RopeQuantizeAppendPagedKVCacheKernel(q_rope_in, k_rope_in, v_in, q_rope_out, cos_sin_cache, pos_ids, k_cache,
                                         v_cache, kv_indices, kv_indptr, batch_indices, positions, page_size,
                                         quant_scale_q, quant_scale_kv):
    """One token per ``idx``: RoPE + scale Q into ``q_rope_out``; RoPE + scale K, scale V, and store them at
    ``divmod(indptr[batch_indices[idx]] * page_size + positions[idx], page_size)`` of the paged cache."""
    half = q_rope_in.shape[-1] // 2
    cs = cos_sin_cache[pos_ids.long()]                                   # [nnz, rope_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q_rope_out.copy_(_apply_rope_neox(q_rope_in, cos, sin) * quant_scale_q)
    k = _apply_rope_neox(k_rope_in, cos, sin) * quant_scale_kv
    v = v_in * quant_scale_kv
    b = batch_indices.long()
    flat = kv_indptr.long()[b] * page_size + positions.long()
    page_iter, entry_idx = flat // page_size, flat % page_size
    page = kv_indices.long()[page_iter.clamp(0, kv_indices.shape[0] - 1)]
    slot = page * page_size + entry_idx
    if _variant == "fix":
        # skip padding tokens with batch_indices < 0 (stand-in for the early return: one scratch row nobody reads)
        slot = torch.where(b >= 0, slot, torch.full_like(slot, NUM_PAGES * page_size))
    k_cache[slot] = k
    v_cache[slot] = v


def rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache,
                                            kv_indices, kv_indptr, batch_indices, positions, is_neox=True,
                                            quant_scale_q=1.0, quant_scale_kv=1.0, page_size=PAGE_SIZE,
                                            kv_layout="NHD", q_rope_out=None):
    assert is_neox and kv_layout == "NHD" and q_nope is None and k_nope is None
    k_cache, v_cache = paged_kv_cache
    if q_rope_out is None:
        q_rope_out = torch.empty_like(q_rope)
    RopeQuantizeAppendPagedKVCacheKernel(q_rope, k_rope, v, q_rope_out, cos_sin_cache, pos_ids, k_cache, v_cache,
                                         kv_indices, kv_indptr, batch_indices, positions, page_size, quant_scale_q,
                                         quant_scale_kv)
    return q_rope_out, None


class BatchPrefillWithPagedKVCacheWrapper:
    """Paged causal attention planned from persistent ``qo_indptr``/``kv_indptr``/``kv_indices``/``kv_last_page_len``
    buffers (use_cuda_graph=True): a stand-in for the FA2 kernel."""

    def __init__(self, qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf):
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._batch_size = 0

    def plan(self, batch_size):
        self._batch_size = batch_size

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        bs = self._batch_size
        qo_indptr = self._qo_indptr_buf[:bs + 1]
        kv_indptr = self._paged_kv_indptr_buf[:bs + 1].long()
        kv_indices = self._paged_kv_indices_buf.long()
        seq_lens = get_seq_lens(kv_indptr, self._paged_kv_last_page_len_buf[:bs].long(), PAGE_SIZE)
        nnz = q.shape[0]
        t = torch.arange(nnz, device=q.device, dtype=qo_indptr.dtype)
        req = torch.searchsorted(qo_indptr[1:].contiguous(), t, right=True).clamp(max=bs - 1)
        q_pos = seq_lens[req] - (qo_indptr[1:][req] - t).long()               # causal: the token's own kv position
        p = torch.arange(MAX_KV_LEN, device=q.device)
        page_iter = (kv_indptr[req][:, None] + p[None, :] // PAGE_SIZE).clamp(0, kv_indices.shape[0] - 1)
        slot = kv_indices[page_iter] * PAGE_SIZE + p[None, :] % PAGE_SIZE         # [nnz, MAX_KV_LEN]
        keys, vals = k_cache[slot][:, :, 0], v_cache[slot][:, :, 0]               # one KV head: [nnz, L, D]
        scores = torch.einsum("thd,tld->thl", q, keys) * HEAD_DIM ** -0.5
        visible = (p[None, :] <= q_pos[:, None]) & (p[None, :] < seq_lens[req][:, None])
        scores = torch.where(visible[:, None, :], scores, torch.full_like(scores, -1e9))
        return torch.einsum("thl,tld->thd", torch.softmax(scores, -1), vals)


# --- the serving side (stand-in) ---------------------------------------------------------------------------------------

class TinyLlama:
    def __init__(self, device):
        gen = generator(2792)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk = r(HIDDEN, NUM_QO_HEADS * HEAD_DIM), r(HIDDEN, NUM_KV_HEADS * HEAD_DIM)
        self.wv, self.wo = r(HIDDEN, NUM_KV_HEADS * HEAD_DIM), r(NUM_QO_HEADS * HEAD_DIM, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
        freqs = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(device)
        # paged KV cache (NHD), flattened to [page * page_size + entry, head, dim]; one scratch row at the end
        rows = NUM_PAGES * PAGE_SIZE + 1
        self.k_cache = torch.zeros(rows, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=torch.float64)
        self.v_cache = torch.zeros_like(self.k_cache)

    def forward(self, input_ids, positions, attn_metadata):
        x = self.embed[input_ids]
        n = input_ids.shape[0]
        q = (x @ self.wq).view(n, NUM_QO_HEADS, HEAD_DIM)
        k = (x @ self.wk).view(n, NUM_KV_HEADS, HEAD_DIM)
        v = (x @ self.wv).view(n, NUM_KV_HEADS, HEAD_DIM)
        m = attn_metadata
        q, _ = rope_quantize_fp8_append_paged_kv_cache(
            q, k, None, None, v, self.cos_sin_cache.float(), positions, (self.k_cache, self.v_cache),
            m["paged_kv_indices"], m["paged_kv_indptr"], m["batch_indices"], m["positions"])
        o = m["wrapper"].run(q.double(), (self.k_cache, self.v_cache))
        return (x + o.reshape(n, -1) @ self.wo) @ self.lm_head


class FlashInferMetadataBuilder:
    """Builds the per-step metadata before the forward (eagerly, also before a replay)."""

    def __init__(self, runner):
        dev = runner.device
        self.runner = runner
        self.batch_indices = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int32, device=dev)
        self.wrapper = BatchPrefillWithPagedKVCacheWrapper(runner.query_start_loc, runner.paged_kv_indptr,
                                                           runner.paged_kv_indices, runner.paged_kv_last_page_len)

    def build(self, num_reqs, num_tokens):
        r = self.runner
        get_batch_indices_positions(r.query_start_loc[:num_reqs + 1], r.seq_lens[:num_reqs], num_tokens,
                                    batch_indices=self.batch_indices[:num_tokens],
                                    positions=self.positions[:num_tokens])
        self.wrapper.plan(num_reqs)
        return {"paged_kv_indices": r.paged_kv_indices, "paged_kv_indptr": r.paged_kv_indptr[:num_reqs + 1],
                "batch_indices": self.batch_indices[:num_tokens], "positions": self.positions[:num_tokens],
                "wrapper": self.wrapper}


class GPUModelRunner:
    def __init__(self, model, device, use_cuda_graph):
        self.model, self.device = model, device
        i32 = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, **i32)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, **i32)
        self.paged_kv_indptr = torch.zeros(MAX_NUM_REQS + 1, **i32)
        self.paged_kv_indices = torch.zeros(NUM_PAGES, **i32)
        self.paged_kv_last_page_len = torch.zeros(MAX_NUM_REQS, **i32)
        self.builder = FlashInferMetadataBuilder(self)
        self.graphs = {}
        if use_cuda_graph:
            self.capture_model()

    def _prepare_inputs(self, reqs, num_reqs_padded, num_tokens_padded):
        """``reqs``: (token ids, kv length after this step, pages). Padding requests get zero tokens."""
        ids, pos, qsl, seq, kv_indptr, kv_indices, last = [], [], [0], [], [0], [], []
        for tokens, kv_len, pages in reqs:
            ids += tokens
            pos += list(range(kv_len - len(tokens), kv_len))
            qsl.append(qsl[-1] + len(tokens))
            seq.append(kv_len)
            used = pages[:(kv_len + PAGE_SIZE - 1) // PAGE_SIZE]
            kv_indices += used
            kv_indptr.append(kv_indptr[-1] + len(used))
            last.append(kv_len - (len(used) - 1) * PAGE_SIZE)
        pad_reqs = num_reqs_padded - len(reqs)
        qsl += [qsl[-1]] * pad_reqs
        seq += [0] * pad_reqs
        kv_indptr += [kv_indptr[-1]] * pad_reqs
        last += [0] * pad_reqs
        n = len(ids)
        self.input_ids[:n].copy_(torch.tensor(ids, dtype=torch.int64))
        self.input_ids[n:num_tokens_padded].zero_()
        self.positions[:n].copy_(torch.tensor(pos, dtype=torch.int64))
        self.positions[n:num_tokens_padded].zero_()
        self.query_start_loc[:num_reqs_padded + 1].copy_(torch.tensor(qsl, dtype=torch.int32))
        self.seq_lens[:num_reqs_padded].copy_(torch.tensor(seq, dtype=torch.int32))
        self.paged_kv_indptr[:num_reqs_padded + 1].copy_(torch.tensor(kv_indptr, dtype=torch.int32))
        if kv_indices:
            self.paged_kv_indices[:len(kv_indices)].copy_(torch.tensor(kv_indices, dtype=torch.int32))
        self.paged_kv_last_page_len[:num_reqs_padded].copy_(torch.tensor(last, dtype=torch.int32))

    def _forward(self, num_reqs, num_tokens, attn_metadata):
        return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens], attn_metadata)

    def capture_model(self):
        b = self.builder
        for size in sorted(CUDA_GRAPH_SIZES, reverse=True):
            dummy = [([0], 1, [0])] * size                # dummy requests on the null page
            self._prepare_inputs(dummy, size, size)
            meta = b.build(size, size)
            g, out = capture(lambda size=size, meta=meta: self._forward(size, size, meta), device=self.device,
                             name=f"FULL [{size} tokens]", owner="GPUModelRunner",
                             static={"input_ids": self.input_ids, "positions": self.positions,
                                     "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens,
                                     "paged_kv_indptr": self.paged_kv_indptr,
                                     "paged_kv_indices": self.paged_kv_indices,
                                     "paged_kv_last_page_len": self.paged_kv_last_page_len,
                                     "batch_indices": b.batch_indices, "kv_positions": b.positions},
                             state={"k_cache": self.model.k_cache, "v_cache": self.model.v_cache})
            self.graphs[size] = (g, out)

    def execute_model(self, reqs):
        num_tokens = sum(len(t) for t, _, _ in reqs)
        if self.graphs:
            size = next(s for s in sorted(CUDA_GRAPH_SIZES) if s >= num_tokens)
            self._prepare_inputs(reqs, size, size)
            self.builder.build(size, size)
            g, out = self.graphs[size]
            padded = {"kv_positions": self.builder.positions}
            if _variant == "bug":                      # the padded rows of batch_indices are left as they were
                padded["batch_indices"] = self.builder.batch_indices
            return replay(g, out, real=num_tokens, size=size, padded=padded)[:num_tokens]
        self._prepare_inputs(reqs, len(reqs), num_tokens)
        meta = self.builder.build(len(reqs), num_tokens)
        return self._forward(len(reqs), num_tokens, meta)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 7, 1, 12], "B": [5, 9], "C": [14]}
    pages = {"A": [1, 2, 3], "B": [4, 5, 6], "C": [7, 8]}
    arrivals = {0: "A", 1: "B", 3: "C"}
    num_steps = 5

    def serve(use_cuda_graph):
        runner = GPUModelRunner(TinyLlama(device), device, use_cuda_graph)
        running, kv_len, new_tokens, outs = [], {}, {}, []
        for step in range(num_steps):
            for name in arrivals.get(step, ""):
                running.append(name)
                kv_len[name] = 0
                new_tokens[name] = list(prompts[name])
            reqs = []
            for name in running:
                kv_len[name] += len(new_tokens[name])
                reqs.append((new_tokens[name], kv_len[name], pages[name]))
            logits = runner.execute_model(reqs).clone()
            outs.append(logits)
            ends, total = [], 0
            for tokens, _, _ in reqs:
                total += len(tokens)
                ends.append(total - 1)
            nxt = logits[ends].argmax(-1).tolist()
            for name, tok in zip(running, nxt):
                new_tokens[name] = [tok]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
