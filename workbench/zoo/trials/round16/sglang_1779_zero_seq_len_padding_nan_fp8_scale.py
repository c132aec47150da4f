"""Padded decode rows get ``seq_len = 0``: their attention is NaN, and a per-tensor dynamic FP8 scale spreads it to every request.

Upstream: https://github.com/sgl-project/sglang/pull/1779 ("[Fix] Fix NaN issues by fixing the cuda graph padding
values for flashinfer"), for issue https://github.com/sgl-project/sglang/issues/1571.
Symptom: under high concurrency, ``--quantization fp8`` models (Llama-3.1-8B/70B-Instruct) abort requests with
"Detected errors during sampling! NaN in the probability."; ``--disable-cuda-graph`` or
``--disable-cuda-graph-padding`` avoids it (sglang v0.3.x, October 2024).
Mechanism: ``CudaGraphRunner.replay`` pads a batch of ``raw_bs`` requests up to the captured ``bs`` and, since
#1469, filled the padded rows' ``seq_lens`` with 0 (flashinfer's capture wanted empty padded requests). A decode
row with no keys has an empty softmax: its attention output is 0/0 = NaN. The padded rows are dropped only at the
end (``logits[:raw_bs]``), but in between every row goes through the o_proj of an FP8 model, whose activation is
quantised with one dynamic *per-tensor* scale (``scaled_fp8_quant(x, None)``: ``amax`` over the whole batch). One
NaN row makes the scale NaN, and every real request's hidden state becomes NaN. Eager decode has no padded rows.
Doctor: stale-padding, at ``scaled_fp8_quant`` (the real rows' outputs depend on the padded rows, whose
``seq_lens`` of 0 make them NaN).
Fix (upstream): fill the padded rows' ``seq_lens`` with 1 (they attend to the reserved slot 0 and stay finite);
#1783 later turned the value into the backend's ``get_cuda_graph_seq_len_fill_value()``.
"""
from __future__ import annotations

import bisect
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/1779"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "scaled_fp8_quant"
SYMPTOM = "NaN in the sampling probabilities for every request of a padded decode batch (fp8 models)"
VOCAB, HIDDEN, MAX_CONTEXT, NUM_SLOTS = 11, 4, 8, 64
CUDA_GRAPH_BS = [1, 2, 4]
FP8_MAX = 448.0


def scaled_fp8_quant(x, scale=None):
    """Dynamic per-tensor quantisation: one scale from the amax of the whole (padded) activation."""
    if scale is None:
        scale = x.abs().max() / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX), scale


class Fp8LinearMethod:
    def apply(self, weight, weight_scale, x):
        qinput, x_scale = scaled_fp8_quant(x, None)
        return (qinput @ weight) * (x_scale * weight_scale)


def decode_attention_fwd(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale):
    kv_indices = req_to_token[req_pool_indices]                      # [bs, ctx]
    k, v = k_buffer[kv_indices], v_buffer[kv_indices]
    scores = torch.einsum("bd,bcd->bc", q, k) * sm_scale
    valid = torch.arange(MAX_CONTEXT, device=q.device)[None, :] < seq_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)   # no keys: 0/0 = NaN
    return torch.einsum("bc,bcd->bd", probs, v)


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(1779)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_emb = randn(32, HIDDEN, gen=gen, device=device, scale=0.3)
        self.qkv_proj = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.6)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.o_proj_scale = 1.0
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)
        self.quant_method = Fp8LinearMethod()

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed_tokens[input_ids] + self.pos_emb[positions]
        q, k, v = (h @ self.qkv_proj).split(HIDDEN, dim=-1)
        forward_batch.k_buffer[forward_batch.out_cache_loc] = k
        forward_batch.v_buffer[forward_batch.out_cache_loc] = v
        o = decode_attention_fwd(q, forward_batch.k_buffer, forward_batch.v_buffer, forward_batch.req_to_token,
                                 forward_batch.req_pool_indices, forward_batch.seq_lens, 1.0 / math.sqrt(HIDDEN))
        h = h + self.quant_method.apply(self.o_proj, self.o_proj_scale, o)
        return h @ self.lm_head


class ForwardBatch:
    def __init__(self, req_pool_indices, seq_lens, out_cache_loc, req_to_token, k_buffer, v_buffer):
        self.req_pool_indices, self.seq_lens, self.out_cache_loc = req_pool_indices, seq_lens, out_cache_loc
        self.req_to_token, self.k_buffer, self.v_buffer = req_to_token, k_buffer, v_buffer


class CudaGraphRunner:
    def __init__(self, model, req_to_token, k_buffer, v_buffer, device, variant):
        self.model, self.device = model, device
        self.seq_len_fill_value = 0 if variant == "bug" else 1
        max_bs = CUDA_GRAPH_BS[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.seq_lens = torch.full((max_bs,), self.seq_len_fill_value, dtype=torch.long, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.req_to_token, self.k_buffer, self.v_buffer = req_to_token, k_buffer, v_buffer
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(device)
        for bs in reversed(CUDA_GRAPH_BS):
            fb = ForwardBatch(self.req_pool_indices[:bs], self.seq_lens[:bs], self.out_cache_loc[:bs],
                              req_to_token, k_buffer, v_buffer)
            self.graphs[bs], self.output_buffers[bs] = capture(
                lambda bs=bs, fb=fb: self.model.forward(self.input_ids[:bs], self.positions[:bs], fb),
                device=device, pool=self.pool, name=f"decode bs={bs}", owner="CudaGraphRunner",
                static={"input_ids": self.input_ids, "positions": self.positions,
                        "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens,
                        "out_cache_loc": self.out_cache_loc},
                state={"k_buffer": k_buffer, "v_buffer": v_buffer})

    def replay(self, input_ids, positions, req_pool_indices, seq_lens, out_cache_loc):
        raw_bs = input_ids.shape[0]
        bs = CUDA_GRAPH_BS[bisect.bisect_left(CUDA_GRAPH_BS, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.req_pool_indices.zero_()
            self.out_cache_loc.zero_()
            self.input_ids.zero_()
            self.positions.zero_()
        self.input_ids[:raw_bs].copy_(input_ids)
        self.positions[:raw_bs].copy_(positions)
        self.req_pool_indices[:raw_bs].copy_(req_pool_indices)
        self.seq_lens[:raw_bs].copy_(seq_lens)
        self.out_cache_loc[:raw_bs].copy_(out_cache_loc)
        logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs)
        return logits[:raw_bs]


def run(variant: str, device: str = "cpu"):
    model = LlamaForCausalLM(device)
    gen = torch.Generator().manual_seed(3)
    prefill_k = torch.randn(NUM_SLOTS, HIDDEN, generator=gen).to(device)
    prefill_v = torch.randn(NUM_SLOTS, HIDDEN, generator=gen).to(device)
    # req_to_token: row 0 is the padding request (all slot 0, a reserved slot); requests 1..3 own their slots
    req_to_token = torch.zeros(4, MAX_CONTEXT, dtype=torch.long, device=device)
    for r in range(1, 4):
        req_to_token[r] = torch.arange(1 + (r - 1) * MAX_CONTEXT, 1 + r * MAX_CONTEXT, device=device)

    def serve(graphed: bool):
        k_buffer, v_buffer = prefill_k.clone(), prefill_v.clone()
        runner = CudaGraphRunner(model, req_to_token, k_buffer, v_buffer, device, variant) if graphed else None
        k_buffer.copy_(prefill_k)                            # capture-time cache writes are not kept
        v_buffer.copy_(prefill_v)
        req_pool_indices = torch.tensor([1, 2, 3], device=device)
        input_ids = torch.tensor([4, 9, 2], device=device)
        lens = torch.tensor([3, 5, 2], device=device)
        outs = []
        for _ in range(3):
            out_cache_loc = req_to_token[req_pool_indices, lens]
            seq_lens = lens + 1
            if graphed:
                logits = runner.replay(input_ids, lens, req_pool_indices, seq_lens, out_cache_loc)
            else:
                fb = ForwardBatch(req_pool_indices, seq_lens, out_cache_loc, req_to_token, k_buffer, v_buffer)
                logits = model.forward(input_ids, lens, fb)
            outs.append(torch.softmax(logits, -1).clone())       # the sampler's probabilities
            input_ids = logits.argmax(-1)
            lens = lens + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
