"""TransformerEngine's full-length cu_seqlens come from a functools.lru_cache: once eager calls with 128 other (batch, seqlen) shapes evict the entry a CUDA graph captured, the cached tensor is freed and the next replay reads released memory.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/798 ("[PyTorch] Avoid using LRU cache for cu_seqlens",
NVIDIA/TransformerEngine, merged 2024-04-24 as commit f0ed3d509; labelled 1.6.0, the release that added
``make_graphed_callables`` in PR #575 by the same author). Read: the PR description ("LRU cache usage is leading to
IMAs in certain LLM workloads"), the review ("We speculate the bug is because torch.device("cuda") !=
torch.device("cuda", 0) != "cuda""), and the full diff of
``transformer_engine/pytorch/attention.py``: ``_get_full_cu_seqlens(batch_size, max_seqlen, device)`` loses its
``@functools.lru_cache`` and instead stores ``torch.arange(0, (batch_size + 1) * max_seqlen, step=max_seqlen,
dtype=torch.int32, device=device)`` in a module-level dict ``_cu_seqlens_cache`` keyed on ``(batch_size, max_seqlen)``
that is never evicted. Also read, pre-fix: the callers in ``FlashAttention.forward`` and ``FusedAttention.forward``
(for ``bshd`` / ``sbhd`` without a padding mask, ``cu_seqlens_q = _get_full_cu_seqlens(batch_size, max_seqlen_q,
query_layer.device)``, then ``flash_attn_varlen_func(..., cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
causal=...)`` on the tokens flattened to ``thd``). The eviction mechanism below is reconstructed: ``lru_cache``'s
default ``maxsize`` is 128 and its entry is the only owner of the tensor, while a CUDA graph (TE 1.6's
``make_graphed_callables``) keeps only the tensor's address; the device-key mismatch the reviewer suspected only adds
entries (one shape can occupy several), which makes the eviction come sooner.
Symptom: illegal memory accesses in LLM workloads that run TE attention under CUDA graphs and also call it eagerly
with many other sequence shapes (variable-length evaluation or generation); without graphs nothing fails, since an
evicted entry is simply recomputed.
Mechanism: the graphed forward reads the cu_seqlens tensor that the cache handed out during warmup. Replays run no
Python, so they never touch the LRU order: for the cache the captured shape's entry is as old as the capture. After 128
eager calls with other shapes the LRU evicts it, its last reference goes, and the allocator takes the memory back
while the graph still reads it (an IMA once the driver unmaps it, or cu_seqlens of some later tensor once it is
reused, which sends the attention kernel out of bounds). Eager steps look the shape up again and get a fresh tensor.
Doctor: dangling-reference, at _get_full_cu_seqlens. The graph reads the memory of the cached cu_seqlens tensor after
its only owner, the LRU cache, has released it.
Fix (upstream): cache the tensors in a module-level dict that never evicts, so every tensor a graph captured stays
alive for the life of the process.
Modelled: ``_get_full_cu_seqlens`` (``functools.lru_cache`` with its default size, vs. the ``_cu_seqlens_cache``
dict), ``FlashAttention.forward`` (``bshd`` -> ``thd``, full cu_seqlens, causal) over a ``flash_attn_varlen_func``
stand-in that segments the flattened tokens by the cu_seqlens tensor on the device, a ``DotProductAttention`` inside a
small self-attention layer (hidden 8, 2 heads of 4, float64; QKV and output projections), and a
``make_graphed_callables``-style runner (one warmup, then capture of the forward for the training micro-batch shape).
Stand-ins: the layer is graphed for its forward only (TE captures forward and backward; the backward reads the same
cu_seqlens); the eager calls with other shapes are a validation sweep over 130 sequence lengths at batch 1.
Workload: three training micro-batches of [2, 6, 8] through the graphed layer, with an eager validation pass after the
first one (the same layer on 130 batches of lengths 1..130). The bug's first replay is right; the validation pass
evicts the captured shape's entry, and the second replay raises IllegalMemoryAccess on the CPU (it reads the freed
cu_seqlens). The fix equals eager. The graphed outputs of every step and the last validation output are compared.
"""
from __future__ import annotations

import functools

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/798"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_get_full_cu_seqlens"
SYMPTOM = ("TE attention under CUDA graphs plus eager calls with many other shapes: the lru_cache holding the full "
           "cu_seqlens evicts the captured shape's tensor and frees it, and later replays read released memory "
           "(illegal memory access)")

HIDDEN, HEADS, HEAD_DIM = 8, 2, 4
TRAIN_BATCH, TRAIN_SEQLEN = 2, 6
NUM_ROUNDS = 3
VALIDATION_SEQLENS = range(1, 131)

_variant = "bug"


# --- transformer_engine/pytorch/attention.py ---------------------------------------------------------------------

@functools.lru_cache
def _get_full_cu_seqlens_lru(batch_size, max_seqlen, device):
    return torch.arange(0, (batch_size + 1) * max_seqlen, step=max_seqlen, dtype=torch.int32, device=device)


_cu_seqlens_cache = {}


def _get_full_cu_seqlens(batch_size, max_seqlen, device):
    """Cumulative sequence lengths in a batch. All sequences in batch have the maximum sequence length."""
    if _variant == "bug":
        return _get_full_cu_seqlens_lru(batch_size, max_seqlen, device)      # @functools.lru_cache (maxsize 128)
    if (batch_size, max_seqlen) not in _cu_seqlens_cache:
        _cu_seqlens_cache[(batch_size, max_seqlen)] = torch.arange(
            0, (batch_size + 1) * max_seqlen, step=max_seqlen, dtype=torch.int32, device=device)
    return _cu_seqlens_cache[(batch_size, max_seqlen)]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                           causal=False):
    """Varlen attention over flattened tokens [T, H, D]; sequence i owns tokens [cu_seqlens[i], cu_seqlens[i+1])."""
    tq, tk = q.shape[0], k.shape[0]
    pos_q = torch.arange(tq, dtype=torch.int32, device=q.device)
    pos_k = torch.arange(tk, dtype=torch.int32, device=k.device)
    seq_q = (pos_q.unsqueeze(1) >= cu_seqlens_q[1:].unsqueeze(0)).sum(1)          # sequence of each token
    seq_k = (pos_k.unsqueeze(1) >= cu_seqlens_k[1:].unsqueeze(0)).sum(1)
    allowed = seq_q.unsqueeze(1) == seq_k.unsqueeze(0)
    allowed = allowed & (pos_k.unsqueeze(0) < cu_seqlens_k[-1])
    if causal:
        local_q = pos_q - cu_seqlens_q[seq_q.clamp(max=cu_seqlens_q.shape[0] - 1)]
        local_k = pos_k - cu_seqlens_k[seq_k.clamp(max=cu_seqlens_k.shape[0] - 1)]
        allowed = allowed & (local_k.unsqueeze(0) <= local_q.unsqueeze(1))
    scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


class FlashAttention:
    def __init__(self, softmax_scale):
        self.softmax_scale = softmax_scale

    def forward(self, query_layer, key_layer, value_layer, qkv_format="bshd", attn_mask_type="causal"):
        assert qkv_format == "bshd" and "padding" not in attn_mask_type
        batch_size, max_seqlen_q = query_layer.shape[0], query_layer.shape[1]
        max_seqlen_kv = key_layer.shape[1]
        query_layer, key_layer, value_layer = [x.reshape(-1, *x.shape[-2:])
                                               for x in (query_layer, key_layer, value_layer)]
        # Cumulative sequence lengths for unpadded data
        cu_seqlens_q = _get_full_cu_seqlens(batch_size, max_seqlen_q, query_layer.device)
        cu_seqlens_kv = _get_full_cu_seqlens(batch_size, max_seqlen_kv, key_layer.device)
        output = flash_attn_varlen_func(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                                        max_seqlen_q, max_seqlen_kv, self.softmax_scale,
                                        causal="causal" in attn_mask_type)
        return output.reshape(batch_size, max_seqlen_q, -1)


class DotProductAttention:
    def __init__(self, num_attention_heads, kv_channels):
        self.flash_attention = FlashAttention(softmax_scale=kv_channels ** -0.5)

    def forward(self, query_layer, key_layer, value_layer, attn_mask_type="causal"):
        return self.flash_attention.forward(query_layer, key_layer, value_layer, "bshd", attn_mask_type)


class SelfAttentionLayer:
    """QKV projection, DotProductAttention (bshd, causal), output projection, residual."""

    def __init__(self, device):
        gen = generator(798)
        self.qkv = randn(HIDDEN, 3 * HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5).double()
        self.proj = randn(HEADS * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5).double()
        self.core_attention = DotProductAttention(HEADS, HEAD_DIM)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q, k, v = (hidden_states @ self.qkv).view(b, s, 3, HEADS, HEAD_DIM).unbind(2)
        context = self.core_attention.forward(q, k, v, attn_mask_type="causal")
        return hidden_states + context @ self.proj


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graph):
        _get_full_cu_seqlens_lru.cache_clear()
        _cu_seqlens_cache.clear()
        layer = SelfAttentionLayer(device)
        gen = generator(7980)
        train_batches = [randn(TRAIN_BATCH, TRAIN_SEQLEN, HIDDEN, gen=gen, device=device).double()
                         for _ in range(NUM_ROUNDS)]
        static_input = torch.zeros(TRAIN_BATCH, TRAIN_SEQLEN, HIDDEN, dtype=torch.float64, device=device)
        graph = None
        if use_cuda_graph:                          # make_graphed_callables(layer, (static_input,))
            static_input.copy_(train_batches[0])
            graph = capture(lambda: layer.forward(static_input), device=device, warmups=1,
                            name=f"layer fwd [{TRAIN_BATCH}, {TRAIN_SEQLEN}]", owner="make_graphed_callables",
                            static={"hidden_states": static_input})
        outs = []
        validation_out = None
        for step, batch in enumerate(train_batches):
            static_input.copy_(batch)
            if graph is not None:
                out = replay(*graph)
            else:
                out = layer.forward(static_input)
            outs.append(out.clone())
            if step == 0:                            # validation, eager: other shapes go through the same cache
                for seqlen in VALIDATION_SEQLENS:
                    x = randn(1, seqlen, HIDDEN, gen=gen, device=device).double()
                    validation_out = layer.forward(x)
        return outs + [validation_out.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
