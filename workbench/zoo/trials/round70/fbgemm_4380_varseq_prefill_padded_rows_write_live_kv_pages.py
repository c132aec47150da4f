"""A varseq prefill captured at a padded token count writes the padded rows' K/V into a live request's KV-cache pages.

Upstream: https://github.com/pytorch/FBGEMM/pull/4380 ("add actual_batch_size to rope_qkv_varseq_prefill",
commit 95bae749906a156d2a35d56629c6d394bae0fa42, 2025-06-20; internal D76900768, no public issue).
Symptom: the commit: "The validation pass in Parallel Decoding uses prefill logic inside a cudagraph, and can need
this for correctness." Under the graph, the K/V of tokens of live requests are overwritten in the paged KV cache
by padded rows (or a garbage block id makes the write go out of bounds); attention of those requests then reads
wrong keys and values and the validated tokens' logits are wrong. Eager is correct (no padded rows).
Mechanism: in fbgemm_gpu/experimental/gen_ai/src/kv_cache/kv_cache.cu the host entry points
``rope_qkv_varseq_prefill`` (and ``nope_``/``xpos_qkv_varseq_prefill``) launch
``rope_xpos_qkv_varseq_prefill_kernel`` over all ``B_T = XQ.size(0)`` token rows, and passed a hard-coded ``nullptr``
for the kernel's ``int64_t* actual_batch_size`` argument (the schema had no such parameter, unlike
``rope_qkv_decoding``). The kernel's comment says why it exists: "When running in CUDA graph mode, the actual batch
size can be smaller than block_tables.size(0). In this case rows of block_tables beyond actual_batch_size are not
initialized, and using them wil cause undefined behavior." The only other exit is ``varseq_seqpos[b_t] == -1``.
Captured at a padded ``B_T``, a step whose real token count is smaller leaves rows ``[n, B_T)`` of the static
``varseq_batch`` / ``varseq_seqpos`` / ``varseq_cache_seqpos`` / token buffers as an earlier replay left them; each
padded row still runs ``get_dst_row`` (``block_tables[b * block_tables_b_stride + cache_loc_t / page_size]``) with
the stale batch row ``b`` and stale cache position, and stores its roped K row and V row there. When the batch has
been compacted, ``block_tables[b]`` now holds another live request's pages, whose earlier positions get overwritten.
Doctor: stale-padding, at rope_qkv_varseq_prefill (it launches the kernel over the padded rows without a
device-side real count, so what the padded rows of the varseq metadata hold decides which live KV-cache entries the
captured step overwrites, and the real rows' attention reads them).
Fix (upstream): the three entry points take ``std::optional<at::Tensor> actual_batch_size`` (schema
``Tensor? actual_batch_size=None`` after ``page_size``) and pass ``actual_batch_size.value().data_ptr()`` instead of
``nullptr``; the captured kernel then returns for ``b_t >= *actual_batch_size``, read from device memory at replay.
The caller fills that device scalar before each replay.
Modelled: bf16 -> float32, one layer, N_H 2 query heads sharing N_KVH 1 KV head, D_H 8, ROPE mode only (the
kernel's pairwise ``sincos`` rotation at ``varseq_seqpos``), paged cache ``[1, NUM_PAGES * PAGE_SIZE, N_KVH, D_H]``.
The kernel is vectorised over ``b_t``: a warp that returns writes nothing, modelled as adding a zero delta with
``index_put_(accumulate=True)`` (no host sync, no write races). ``XQ_O`` is zero-initialised (upstream
``empty_like``) so padded rows stay finite. The Parallel Decoding caller is internal and not public: a small
validation-graph runner (names invented) captures embed -> QKV -> ``rope_qkv_varseq_prefill`` -> paged causal
attention -> logits at B_T 8 tokens / 4 batch rows, copies the real rows of its static buffers
(``varseq_seqpos`` initialised to -1), and every drafted token is accepted. The guard compares the token row
``b_t``, so the caller passes the real token count. Requests A, B, C are validated (3+3+2 tokens), A finishes and
the batch is compacted to B, C (2+2): stale padded rows 4, 5 (B's step-1 tokens, batch row 1) now resolve to C's
pages and overwrite C's prompt K/V at positions 5, 6.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/FBGEMM/pull/4380"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "rope_qkv_varseq_prefill"
SYMPTOM = "padded rows of a graphed varseq prefill write K/V through stale block_tables rows into a live request's pages"

VOCAB, DIM, N_H, N_KVH, D_H = 16, 16, 2, 1, 8
PAGE_SIZE, MAX_PAGES_PER_SEQ, NUM_PAGES = 4, 4, 16
MAX_CTX = PAGE_SIZE * MAX_PAGES_PER_SEQ
B_T, MAX_B = 8, 4                                     # captured token rows / batch rows
THETA = 10000.0
PROMPT_LENS = {"A": 5, "B": 4, "C": 9}
PAGES = {"A": [1, 2, 3, 4], "B": [5, 6, 7, 8], "C": [9, 10, 11, 12]}
STEPS = ((("A", 3), ("B", 3), ("C", 2)),            # validation passes: (request, drafted tokens)
         (("B", 2), ("C", 2)),                       # A finished: batch compacted
         (("C", 3),))


# --- fbgemm_gpu/experimental/gen_ai/src/kv_cache/kv_cache.cu -----------------------------------------

def get_dst_row(b, cache_loc_t, page_size, block_tables):
    """Physical cache row of (batch row b, logical position cache_loc_t) for paged attention."""
    page_logical_idx = cache_loc_t // page_size
    page_offset = cache_loc_t % page_size
    page_physical_idx = block_tables[b, page_logical_idx].long()
    return page_physical_idx * page_size + page_offset


def _rope(x, seqpos, theta):
    """The kernel's rotation of element pairs (2p, 2p+1) by seqpos * theta^(-2p / D_H)."""
    d_h = x.shape[-1]
    powers = torch.arange(0, d_h, 2, device=x.device, dtype=torch.float64)
    freqs = seqpos.to(torch.float64)[:, None] * torch.pow(theta, powers / -d_h)[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    xe, xo = x[..., 0::2].double(), x[..., 1::2].double()
    out = torch.stack((xe * cos - xo * sin, xo * cos + xe * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rope_xpos_qkv_varseq_prefill_kernel(XQ, XK, XV, cache_K, cache_V, XQ_O, varseq_batch, varseq_seqpos, theta,
                                        block_tables, page_size, varseq_cache_seqpos, actual_batch_size=None):
    """One warp per (b_t, head); vectorised over b_t. A warp that returns writes nothing."""
    B_T_ = XQ.size(0)
    b_t = torch.arange(B_T_, device=XQ.device)
    seqpos_t = varseq_seqpos.long()
    live = seqpos_t != -1                                            # if (seqpos_t == -1) return;
    cache_loc_t = varseq_cache_seqpos.long().clamp(min=0)
    b = varseq_batch.long()
    if actual_batch_size is not None:                                # if (actual_batch_size != nullptr &&
        live = live & (b_t < actual_batch_size)                      #     b_t >= *actual_batch_size) return;
    pos = seqpos_t.clamp(min=0)
    keep = live[:, None, None]
    XQ_O.copy_(torch.where(keep, _rope(XQ, pos, theta), XQ_O))
    dst = get_dst_row(b, cache_loc_t, page_size, block_tables)        # [B_T] rows of cache_KV[0]
    for cache, new in ((cache_K, _rope(XK, pos, theta)), (cache_V, XV)):
        rows = cache[0]
        delta = torch.where(keep, new - rows[dst], torch.zeros_like(new))
        rows.index_put_((dst,), delta, accumulate=True)


def rope_qkv_varseq_prefill(XQ, XK, XV, cache_K, cache_V, varseq_batch, varseq_seqpos, theta, num_groups=1,
                            block_tables=None, page_size=PAGE_SIZE, actual_batch_size=None,
                            varseq_cache_seqpos=None, *, variant):
    assert varseq_batch.numel() == XQ.size(0)
    XQ_O = torch.zeros_like(XQ)                                      # at::empty_like(XQ)
    varseq_cache_seqpos_ = varseq_cache_seqpos if varseq_cache_seqpos is not None else varseq_seqpos
    actual_batch_size_ptr = None
    if variant == "fix" and actual_batch_size is not None:
        actual_batch_size_ptr = actual_batch_size                     # actual_batch_size.value().data_ptr()
    # bug: the launch passed a hard-coded nullptr (the op had no actual_batch_size parameter)
    rope_xpos_qkv_varseq_prefill_kernel(XQ, XK, XV, cache_K, cache_V, XQ_O, varseq_batch, varseq_seqpos, theta,
                                        block_tables, page_size, varseq_cache_seqpos_, actual_batch_size_ptr)
    return XQ_O


# --- the caller: one attention layer validating drafted tokens with prefill logic ----------------------

class Weights:
    def __init__(self, device):
        gen = generator(4380)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, N_H * D_H, gen=gen, device=device, scale=0.4)
        self.wk = randn(DIM, N_KVH * D_H, gen=gen, device=device, scale=0.4)
        self.wv = randn(DIM, N_KVH * D_H, gen=gen, device=device, scale=0.4)
        self.wo = randn(N_H * D_H, VOCAB, gen=gen, device=device, scale=0.5)


def paged_attention(XQ_O, cache_K, cache_V, varseq_batch, varseq_seqpos, block_tables):
    """Causal attention of each token over its batch row's pages, positions [0, seqpos]."""
    j = torch.arange(MAX_CTX, device=XQ_O.device)
    b = varseq_batch.long()
    slots = get_dst_row(b[:, None], j[None, :], PAGE_SIZE, block_tables)   # [T, MAX_CTX]
    k = cache_K[0][slots]                                                   # [T, MAX_CTX, N_KVH, D_H]
    v = cache_V[0][slots]
    k = k.repeat_interleave(N_H // N_KVH, dim=2)
    v = v.repeat_interleave(N_H // N_KVH, dim=2)
    scores = torch.einsum("thd,tjhd->thj", XQ_O, k) / D_H ** 0.5
    mask = j[None, None, :] <= varseq_seqpos.long()[:, None, None]
    probs = torch.softmax(scores.masked_fill(~mask, -1e9), dim=-1)
    return torch.einsum("thj,tjhd->thd", probs, v)


def validate_forward(w, cache_K, cache_V, tokens, varseq_batch, varseq_seqpos, varseq_cache_seqpos, block_tables,
                     actual_batch_size, variant):
    T = tokens.shape[0]
    x = w.emb[tokens]
    XQ = (x @ w.wq).view(T, N_H, D_H)
    XK = (x @ w.wk).view(T, N_KVH, D_H)
    XV = (x @ w.wv).view(T, N_KVH, D_H)
    XQ_O = rope_qkv_varseq_prefill(XQ, XK, XV, cache_K, cache_V, varseq_batch, varseq_seqpos, THETA,
                                   block_tables=block_tables, page_size=PAGE_SIZE,
                                   actual_batch_size=actual_batch_size, varseq_cache_seqpos=varseq_cache_seqpos,
                                   variant=variant)
    attn = paged_attention(XQ_O, cache_K, cache_V, varseq_batch, varseq_seqpos, block_tables)
    return attn.reshape(T, N_H * D_H) @ w.wo


class ValidationGraphRunner:
    """Captures the validation pass at B_T token rows / MAX_B batch rows; copies the real rows in per step."""

    def __init__(self, w, cache_K, cache_V, device, variant):
        self.w, self.cache_K, self.cache_V, self.device, self.variant = w, cache_K, cache_V, device, variant
        self.tokens = torch.zeros(B_T, dtype=torch.long, device=device)
        self.varseq_batch = torch.zeros(B_T, dtype=torch.int32, device=device)
        self.varseq_seqpos = torch.full((B_T,), -1, dtype=torch.int32, device=device)
        self.varseq_cache_seqpos = torch.full((B_T,), -1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(MAX_B, MAX_PAGES_PER_SEQ, dtype=torch.int32, device=device)
        self.actual_batch_size = torch.zeros(1, dtype=torch.int64, device=device)

        def run_once():
            return validate_forward(self.w, self.cache_K, self.cache_V, self.tokens, self.varseq_batch,
                                    self.varseq_seqpos, self.varseq_cache_seqpos, self.block_tables,
                                    self.actual_batch_size, self.variant)

        static = {"tokens": self.tokens, "varseq_batch": self.varseq_batch, "varseq_seqpos": self.varseq_seqpos,
                  "varseq_cache_seqpos": self.varseq_cache_seqpos, "block_tables": self.block_tables,
                  "actual_batch_size": self.actual_batch_size}
        self.graph, self.logits = capture(run_once, device=device, name=f"validation B_T {B_T}",
                                          owner="ValidationGraphRunner", static=static,
                                          state={"cache_K": cache_K, "cache_V": cache_V})

    def replay(self, tokens, varseq_batch, varseq_seqpos, block_tables):
        n, nb = tokens.shape[0], block_tables.shape[0]
        self.tokens[:n].copy_(tokens)
        self.varseq_batch[:n].copy_(varseq_batch)
        self.varseq_seqpos[:n].copy_(varseq_seqpos)
        self.varseq_cache_seqpos[:n].copy_(varseq_seqpos)
        self.block_tables[:nb].copy_(block_tables)
        self.actual_batch_size.fill_(n)
        left = {"tokens": self.tokens, "varseq_batch": self.varseq_batch, "varseq_seqpos": self.varseq_seqpos,
                "varseq_cache_seqpos": self.varseq_cache_seqpos}
        logits = replay(self.graph, self.logits, real=n, size=B_T, padded=left)
        return logits[:n].clone()


def run(variant: str, device: str = "cpu"):
    w = Weights(device)
    gen = generator(438)
    slots = NUM_PAGES * PAGE_SIZE
    k0 = randn(1, slots, N_KVH, D_H, gen=gen, device=device)       # prompts already prefilled into their pages
    v0 = randn(1, slots, N_KVH, D_H, gen=gen, device=device)
    drafts = torch.randint(0, VOCAB, (len(STEPS), B_T), generator=gen)

    def serve(graphed: bool):
        cache_K, cache_V = k0.clone(), v0.clone()
        runner = ValidationGraphRunner(w, cache_K, cache_V, device, variant) if graphed else None
        seq_len, outs = dict(PROMPT_LENS), []
        for step, batch in enumerate(STEPS):
            toks, vb, vp = [], [], []
            for row, (r, k) in enumerate(batch):
                for i in range(k):
                    toks.append(int(drafts[step, len(toks)]))
                    vb.append(row)
                    vp.append(seq_len[r] + i)
                seq_len[r] += k                                      # every drafted token accepted
            tokens = torch.tensor(toks, dtype=torch.long).to(device)
            varseq_batch = torch.tensor(vb, dtype=torch.int32).to(device)
            varseq_seqpos = torch.tensor(vp, dtype=torch.int32).to(device)
            block_tables = torch.tensor([PAGES[r] for r, _ in batch], dtype=torch.int32).to(device)
            if graphed:
                outs.append(runner.replay(tokens, varseq_batch, varseq_seqpos, block_tables))
            else:
                outs.append(validate_forward(w, cache_K, cache_V, tokens, varseq_batch, varseq_seqpos, varseq_seqpos,
                                             block_tables, None, variant))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
