"""Piecewise prefill pads q/k/v to the bucket, but FA3 varlen gets real-token cu_seqlens: the last real token reads padded rows.

Upstream: https://github.com/sgl-project/sglang/pull/27343 (fix for the ``fa_skip_kv_cache`` embedding fast path
under piecewise CUDA graph; the regression came with https://github.com/sgl-project/sglang/pull/21971).
Symptom: embedding models served with ``--attention-backend fa3`` under the piecewise CUDA graph returned fully
NaN embeddings for ~40% of *short* inputs (one request per forward, LAST-token pooling); inputs that fill their
token bucket were unaffected (sglang main, between #21971 in April and the fix in June 2026).
Mechanism: #21971 made ``FlashAttentionBackend.forward_extend`` serve embedding prefills with
``flash_attn_varlen_func`` on the raw K/V (``fa_skip_kv_cache``), passing ``cu_seqlens_q`` as both the query
and the key boundaries. Under the piecewise graph the model runs at the padded bucket size, so ``q``/``k``/``v``
have bucket rows while ``cu_seqlens_q`` (built by ``init_forward_metadata`` from the real extend lengths) ends
at the real token count: the kernel's ``q.shape[0] == cu_seqlens_q[-1]`` contract is broken, and (the fix's
test says) the boundary query block corrupts the last real token's output, the row LAST-token pooling returns.
How, in the toy: no segment covers the padded rows, so their attention output (``RadixAttention``'s
``torch.empty`` output, allocated inside the captured piece) is never written and the next layer's padded
K/V are garbage; the real segment's last key tile reaches into those rows (loads bounded by the tensor,
masking on the scores only, and a masked score times a NaN value is still NaN).
Doctor: padded-shape-mismatch, at ``forward_extend`` (run at the bucket size, it hands FA3 padded ``q``/``k``/``v``
with ``cu_seqlens`` for the real tokens only).
Fix (upstream): append a dummy tail segment for the padded rows (``torch.cat([cu_seqlens_q, ...])``), so the
padded rows get valid, isolated attention metadata and the real segments are unchanged; #27343 adds
``test_fa_skip_kv_cache_piecewise_nan.py`` (no-NaN and HF-cosine checks over short inputs).
(Evidence: the fix's regression-test docstring and a description of its diff; not the diff lines themselves.
The toy: one head, two layers, one request per forward as in that test, bucket 8, a 4-row key tile.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/27343"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "forward_extend"
SYMPTOM = "short inputs padded to a piecewise bucket come back as NaN embeddings (LAST-token pooling)"

VOCAB, DIM, NUM_LAYERS = 16, 4, 2
BUCKET = 8                 # the piecewise graph's captured token count
BLOCK_N = 4                # the kernel's key tile


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, out):
    """Toy FA3 varlen forward (one head). Per segment, keys/values are loaded in ``BLOCK_N``-row tiles bounded
    by the tensor (``k.shape[0]``, as a TMA load is), not by the segment; rows outside the segment are masked
    in the scores only. Rows no segment covers are not written. Requires ``q.shape[0] == cu_seqlens_q[-1]``."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    total_k = k.shape[0]
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs:
            continue
        tile_end = min(ks + -(-(ke - ks) // BLOCK_N) * BLOCK_N, total_k)
        kpos = torch.arange(tile_end - ks, device=q.device)
        qpos = torch.arange(qe - qs, device=q.device) + (ke - ks) - (qe - qs)     # bottom-right causal
        keep = kpos[None, :] < ke - ks
        if causal:
            keep = keep & (kpos[None, :] <= qpos[:, None])
        scores = (q[qs:qe] @ k[ks:tile_end].T) * DIM ** -0.5
        p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        out[qs:qe] = p @ v[ks:tile_end]
    return out


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    extend_seq_lens: list
    extend_num_tokens: int


@dataclasses.dataclass
class FlashAttentionMetadata:
    cu_seqlens_q: torch.Tensor
    max_seq_len_q: int


class FlashAttentionBackend:
    """The FA3 backend in embedding mode (``fa_skip_kv_cache``: no KV cache, attention on raw K/V)."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.fa_skip_kv_cache = True
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        lens = torch.tensor(forward_batch.extend_seq_lens, dtype=torch.int32)
        cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
        self.forward_metadata = FlashAttentionMetadata(cu.to(self.device), max(forward_batch.extend_seq_lens))

    def forward_extend(self, q, k, v, layer_id, forward_batch, out):
        metadata = self.forward_metadata
        cu_seqlens_q, max_seqlen_q = metadata.cu_seqlens_q, metadata.max_seq_len_q
        if self.variant == "fix" and q.shape[0] > forward_batch.extend_num_tokens:
            # Piecewise padding: give the padded rows their own (dummy) tail segment.
            cu_seqlens_q = torch.cat([cu_seqlens_q, cu_seqlens_q.new_tensor([q.shape[0]])])
            max_seqlen_q = max(max_seqlen_q, q.shape[0] - forward_batch.extend_num_tokens)
        assert self.fa_skip_kv_cache
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_q,
                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_q, causal=True, out=out)


class Model:
    """Embedding model: two layers; ``RadixAttention`` allocates the attention output and the backend fills it."""

    def __init__(self, device):
        gen = generator(27343)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.layers = [tuple(randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(4))
                       for _ in range(NUM_LAYERS)]

    def qkv(self, layer_id, h):
        wq, wk, wv, _ = self.layers[layer_id]
        q, k, v = h @ wq, h @ wk, h @ wv
        return q, k, v, torch.empty_like(q)         # RadixAttention: output = torch.empty_like(q)

    def post_attn(self, layer_id, h, attn_out):
        return h + torch.tanh(attn_out @ self.layers[layer_id][3])

    def forward(self, input_ids, backend, forward_batch):
        h = self.embed[input_ids]
        for i in range(NUM_LAYERS):
            q, k, v, out = self.qkv(i, h)
            backend.forward_extend(q, k, v, i, forward_batch, out)
            h = self.post_attn(i, h, out)
        return h


def pool_last(h, forward_batch):
    """LAST-token pooling, normalised (the embedding the request gets back)."""
    last = torch.tensor(forward_batch.extend_seq_lens).cumsum(0) - 1
    return torch.nn.functional.normalize(h[last.to(h.device)], dim=-1)


class PiecewiseCudaGraphRunner:
    """torch.compile splits the forward at attention: graph pieces at the bucket size, attention eager between
    them (``unified_attention_with_output`` fills the output buffer the previous piece allocated)."""

    def __init__(self, model, backend, device):
        self.model, self.backend, self.device = model, backend, device
        self.input_ids = torch.zeros(BUCKET, dtype=torch.long, device=device)
        pool = graph_pool_handle(device)
        fb = ForwardBatch(self.input_ids, [BUCKET], BUCKET)           # capture: one request filling the bucket
        backend.init_forward_metadata(fb)
        self.pieces = [capture(self.piece_0, device=device, pool=pool, name=f"piece 0 tokens {BUCKET}",
                               owner="PiecewiseCudaGraphRunner", static={"input_ids": self.input_ids})]
        for i in range(NUM_LAYERS):
            h, q, k, v, out = self.pieces[-1][1]
            backend.forward_extend(q, k, v, i, fb, out)
            self.pieces.append(capture(lambda i=i, h=h, out=out: self.piece(i, h, out), device=device, pool=pool,
                                       name=f"piece {i + 1} tokens {BUCKET}", owner="PiecewiseCudaGraphRunner"))

    def piece_0(self):
        """Embedding and layer 0's q/k/v (and its attention output buffer)."""
        h = self.model.embed[self.input_ids]
        return (h,) + self.model.qkv(0, h)

    def piece(self, i, h, attn_out):
        """Layer ``i`` after attention, then the next layer's q/k/v (or the final hidden states)."""
        h = self.model.post_attn(i, h, attn_out)
        return (h,) + self.model.qkv(i + 1, h) if i + 1 < NUM_LAYERS else (h,)

    def replay(self, forward_batch, variant):
        n = forward_batch.extend_num_tokens
        self.input_ids[:n].copy_(forward_batch.input_ids)
        self.input_ids[n:].zero_()
        self.backend.init_forward_metadata(forward_batch)
        for i, (g, outs) in enumerate(self.pieces):
            left = {}
            if i > 0 and variant == "bug":      # the attention output's padded rows were never written
                left["attn_output"] = self.pieces[i - 1][1][4]
            outs = replay(g, outs, real=n, size=BUCKET, padded=left)
            if i < NUM_LAYERS:
                _, q, k, v, out = outs
                self.backend.forward_extend(q, k, v, i, forward_batch, out)
        return outs[0]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(3)
    # One request per forward, as in the regression test: 3 and 5 tokens end inside a key tile, 4 ends on a
    # tile boundary, 8 fills the bucket.
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).to(device) for n in (3, 4, 5, 8)]
    batches = [ForwardBatch(ids, [len(ids)], len(ids)) for ids in prompts]

    def eager():
        backend = FlashAttentionBackend(device, variant)
        outs = []
        for fb in batches:
            backend.init_forward_metadata(fb)
            outs.append(pool_last(model.forward(fb.input_ids, backend, fb), fb))
        return outs

    def served():
        backend = FlashAttentionBackend(device, variant)
        runner = PiecewiseCudaGraphRunner(model, backend, device)
        return [pool_last(runner.replay(fb, variant), fb).clone() for fb in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
