"""KDA prefill under a prefill CUDA graph: the bucket's padded token tail runs as part of the last sequence.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/969 ("fix(kda): trim padded prefill graph inputs",
commit e6f4d754).
Symptom: Kimi-Linear style models (KDA linear attention) served with prefill CUDA graphs give corrupted
attention output and recurrent state for some prefills; decoding from those states drifts from eager
(TokenSpeed main, Aug 2026).
Mechanism: the prefill graph pads the packed token axis to the captured bucket size. The KDA backend
(``MambaAttnBackend`` in ``hybrid_linear_attn.py``) runs outside the captured pieces and scrubs the padded
tail of ``mixed_qkv``/``a``/``b`` (``scrub_padding_tail``), but then hands bucket-sized q/k/v/g/beta to
``kda_paged_prefill``. FlashKDA derives its output extent from the input shape while it derives sequence
tiles from ``cu_seqlens``, so the padded rows past ``cu_seqlens[-1]`` are processed as tokens of the last
sequence. Their q/k/v are zeroed, but the gate ``g`` (from ``_kda_g_raw()``, not scrubbed) still decays the
running state once per padded row, and the last sequence's final state is stored in its state slot: the
next decode step of that request starts from a corrupted state. Eager prefill has no padded rows.
Doctor: stale-padding, at ``kda_paged_prefill`` (the padded rows are folded into the last real sequence's
recurrent state).
Fix (upstream): slice query/key/value/g/beta to the real-token prefix (``num_real_tokens`` from
``extend_seq_lens_cpu``) before calling the kernel; the graph handoff restores the bucket-sized tail.
"""
from __future__ import annotations

import bisect

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/969"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "kda_paged_prefill"
SYMPTOM = "the last prefilled request's KDA state absorbs the bucket's padded rows; its decode drifts from eager"
VOCAB, HIDDEN, HEADS, HEAD_DIM, NUM_SLOTS, BUCKET = 16, 8, 2, 4, 6, 8


class KimiDeltaAttention:
    def __init__(self, device):
        gen = generator(969)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.q_proj, self.k_proj, self.v_proj, self.f_proj = (
            randn(HIDDEN, HEADS * HEAD_DIM, gen=gen, device=device, scale=0.4) for _ in range(4))
        self.b_proj = randn(HIDDEN, HEADS, gen=gen, device=device, scale=0.4)
        self.o_proj = randn(HEADS * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.4)

    def project(self, input_ids):
        h = self.embed_tokens[input_ids]
        t = input_ids.shape[0]
        q = (h @ self.q_proj).view(1, t, HEADS, HEAD_DIM)
        k = torch.nn.functional.normalize((h @ self.k_proj).view(1, t, HEADS, HEAD_DIM), dim=-1)
        v = (h @ self.v_proj).view(1, t, HEADS, HEAD_DIM)
        g = -torch.nn.functional.softplus(h @ self.f_proj).view(1, t, HEADS, HEAD_DIM)   # _kda_g_raw()
        beta = torch.sigmoid(h @ self.b_proj).view(1, t, HEADS)
        return q, k, v, g, beta

    def forward(self, input_ids, attn):
        q, k, v, g, beta = self.project(input_ids)
        o = attn(q, k, v, g, beta)
        return o.reshape(input_ids.shape[0], HEADS * HEAD_DIM) @ self.o_proj


def kda_paged_prefill(query, key, value, g, beta, cu_seqlens, ssm_states, state_indices):
    """FlashKDA varlen prefill: output extent from the input shape, sequence ownership from cu_seqlens.
    Each sequence starts from a fresh state; its final state is stored in its slot of ``ssm_states``."""
    num_tokens, num_seqs = query.shape[1], len(cu_seqlens) - 1
    out = torch.zeros_like(value)
    states = [torch.zeros(HEADS, HEAD_DIM, HEAD_DIM, device=query.device) for _ in range(num_seqs)]
    for t in range(num_tokens):
        s = min(bisect.bisect_right(cu_seqlens[1:], t), num_seqs - 1)     # rows past the end: the last tile
        S = torch.exp(g[0, t])[..., None] * states[s]
        S = S + beta[0, t][:, None, None] * key[0, t][:, :, None] * value[0, t][:, None, :]
        out[0, t] = torch.einsum("hk,hkv->hv", query[0, t], S)
        states[s] = S
    for s in range(num_seqs):
        ssm_states[state_indices[s]] = states[s]
    return out


def scrub_padding_tail(num_real_tokens, *tensors):
    for t in tensors:
        t[:, num_real_tokens:].zero_()


def _slice_kda_prefill_inputs(num_real_tokens, query, key, value, gate, beta):
    """Slice packed KDA inputs to the real-token prefix along their token axis."""
    return (query[:, :num_real_tokens], key[:, :num_real_tokens], value[:, :num_real_tokens],
            gate[:, :num_real_tokens], beta[:, :num_real_tokens])


class MambaAttnBackend:
    """Runs outside the captured pieces; reads this step's ``forward_metadata`` when called."""

    def __init__(self, ssm_states, variant):
        self.ssm_states, self.variant = ssm_states, variant
        self.forward_metadata = None                 # (extend_seq_lens_cpu, state_indices)

    def forward_extend(self, query, key, value, g_kda, beta_kda):
        extend_seq_lens_cpu, state_indices = self.forward_metadata
        seq_len = query.shape[1]
        num_real_tokens = sum(extend_seq_lens_cpu)
        # Zero padded rows so garbage can't reach recurrent state (see scrub_padding_tail).
        scrub_padding_tail(num_real_tokens, query, key, value, beta_kda)
        cu_seqlens = [0]
        for n in extend_seq_lens_cpu:
            cu_seqlens.append(cu_seqlens[-1] + n)
        if self.variant == "fix":
            query, key, value, g_kda, beta_kda = _slice_kda_prefill_inputs(
                num_real_tokens, query, key, value, g_kda, beta_kda)
        o = kda_paged_prefill(query, key, value, g_kda, beta_kda, cu_seqlens, self.ssm_states, state_indices)
        if o.shape[1] != seq_len:                     # the graph handoff restores the bucket tail
            o = torch.cat([o, o.new_zeros(1, seq_len - o.shape[1], HEADS, HEAD_DIM)], dim=1)
        return o


def kda_decode(model, ssm_states, input_ids, state_indices):
    """One decode token per request from its stored state (eager, same for both paths)."""
    q, k, v, g, beta = model.project(input_ids)
    outs = []
    for i, slot in enumerate(state_indices):
        S = torch.exp(g[0, i])[..., None] * ssm_states[slot]
        S = S + beta[0, i][:, None, None] * k[0, i][:, :, None] * v[0, i][:, None, :]
        ssm_states[slot] = S
        outs.append(torch.einsum("hk,hkv->hv", q[0, i], S).reshape(-1) @ model.o_proj)
    return torch.stack(outs)


def run(variant: str, device: str = "cpu"):
    model = KimiDeltaAttention(device)
    gen = torch.Generator().manual_seed(969)
    # Two prefill batches (token counts 5 and 7, both padded to the 8-token bucket), then a decode step.
    batches = [([3, 2], [1, 2]), ([4, 3], [3, 4])]
    prompts = [torch.randint(0, VOCAB, (sum(lens),), generator=gen) for lens, _ in batches]
    decode_ids = torch.randint(0, VOCAB, (4,), generator=gen)

    def eager():
        ssm_states = torch.zeros(NUM_SLOTS, HEADS, HEAD_DIM, HEAD_DIM, device=device)
        backend = MambaAttnBackend(ssm_states, variant)
        outs = []
        for (lens, slots), ids in zip(batches, prompts):
            backend.forward_metadata = (lens, slots)
            outs.append(model.forward(ids.to(device), backend.forward_extend))
        outs.append(kda_decode(model, ssm_states, decode_ids.to(device), [1, 2, 3, 4]))
        return outs

    def served():
        ssm_states = torch.zeros(NUM_SLOTS, HEADS, HEAD_DIM, HEAD_DIM, device=device)
        backend = MambaAttnBackend(ssm_states, variant)
        input_ids = torch.zeros(BUCKET, dtype=torch.long, device=device)
        backend.forward_metadata = ([BUCKET], [0])            # capture: one dummy sequence in slot 0
        manager = GraphManager(lambda size: model.forward(input_ids[:size], attn), [BUCKET],
                               device=device, mode=CUDAGraphMode.PIECEWISE, num_warmups=1,
                               static_buffers={"input_ids": input_ids}, name="prefill CUDA graph (KDA)")
        attn = manager.eager(backend.forward_extend)
        manager.capture()
        ssm_states.zero_()
        outs = []
        for (lens, slots), ids in zip(batches, prompts):
            n = ids.shape[0]
            size = manager.dispatch(n)
            input_ids[:n].copy_(ids)                          # rows [n, size) keep the last batch's ids
            backend.forward_metadata = (lens, slots)
            outs.append(manager.replay(size, n, padded={"input_ids": input_ids}).clone())
        outs.append(kda_decode(model, ssm_states, decode_ids.to(device), [1, 2, 3, 4]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
