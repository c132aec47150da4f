"""FlashInfer decode gets the KV scales as ``nn.Parameter`` tensors: turning them into float launch scales syncs inside the capture.

Upstream: https://github.com/sgl-project/sglang/pull/10056 ("Fix cuda graph mode in flashinfer attn backend").
Symptom: Llama models served with the flashinfer attention backend on Blackwell fail at startup while capturing the
decode CUDA graphs ("Capture cuda graph failed", operation not permitted when stream is capturing); with
``--disable-cuda-graph`` they serve (sglang main, September 2025).
Mechanism: ``RadixAttention`` keeps its KV-cache scales twice: ``k_scale``/``v_scale`` as device tensors
(``nn.Parameter``, loaded from the checkpoint, used by ``set_kv_buffer`` to de-scale the cache write) and
``k_scale_float``/``v_scale_float`` as Python floats. ``FlashInferAttnBackend.forward_decode`` passed the
Parameters to ``decode_wrapper.forward``; the decode kernel selected there takes the softmax and output scales as
scalar launch arguments, so FlashInfer folds ``k_scale`` into ``sm_scale`` and converts the products to Python
floats: a device-to-host copy of a tensor. Eagerly that is only a synchronisation; inside the capture of a decode
graph it is forbidden, and the capture aborts.
Doctor: sync-in-capture, at ``forward_decode`` (the decode call hands device tensors where the kernel needs host
scalars, so the wrapper reads them back during capture).
Fix (upstream): pass ``k_scale=layer.k_scale_float, v_scale=layer.v_scale_float`` (the comment added upstream:
"Must use _float to avoid device-to-host copy that breaks cuda graph capture").
"""
from __future__ import annotations

import bisect
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/10056"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward_decode"
SYMPTOM = "decode CUDA graph capture aborts on a device-to-host read of the KV scales (server fails to start)"
VOCAB, HEAD_DIM, MAX_CONTEXT, NUM_SLOTS = 11, 4, 8, 64
CUDA_GRAPH_BS = [1, 2, 4]


class RadixAttention:
    def __init__(self, device):
        self.scaling = 1.0 / math.sqrt(HEAD_DIM)
        self.logit_cap = 0.0
        self.layer_id = 0
        # checkpoint KV scales: tensors for the cache write, floats for the attention kernels
        self.k_scale = torch.nn.Parameter(torch.tensor(0.5, device=device), requires_grad=False)
        self.v_scale = torch.nn.Parameter(torch.tensor(2.0, device=device), requires_grad=False)
        self.k_scale_float = 0.5
        self.v_scale_float = 2.0


class MHATokenToKVPool:
    def __init__(self, device):
        self.k_buffer = torch.zeros(NUM_SLOTS, HEAD_DIM, device=device)
        self.v_buffer = torch.zeros(NUM_SLOTS, HEAD_DIM, device=device)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        if k_scale is not None:
            cache_k = cache_k / k_scale                   # de-scale before the (fp8) store: a device op
            cache_v = cache_v / v_scale
        self.k_buffer[loc] = cache_k
        self.v_buffer[loc] = cache_v

    def get_kv_buffer(self, layer_id):
        return self.k_buffer, self.v_buffer


class BatchDecodeWithPagedKVCacheWrapper:
    """The CUDA-graph decode wrapper: its plan lives in fixed buffers that ``plan`` rewrites in place."""

    def __init__(self, device, max_bs):
        self._kv_indices = torch.zeros(max_bs, MAX_CONTEXT, dtype=torch.long, device=device)
        self._kv_lens = torch.ones(max_bs, dtype=torch.long, device=device)

    def plan(self, kv_indices, kv_lens):
        bs = kv_lens.shape[0]
        self._kv_indices[:bs].copy_(kv_indices)
        self._kv_lens[:bs].copy_(kv_lens)

    def forward(self, q, paged_kv_cache, sm_scale=None, logits_soft_cap=None, k_scale=None, v_scale=None):
        if k_scale is not None:
            sm_scale *= k_scale
        # the decode kernel takes its softmax and output scales as scalar launch arguments
        bmm1_scale = float(sm_scale)
        bmm2_scale = float(v_scale) if v_scale is not None else 1.0
        return batch_decode_with_kv_cache(q, *paged_kv_cache, self._kv_indices[:q.shape[0]],
                                          self._kv_lens[:q.shape[0]], bmm1_scale, bmm2_scale)


def batch_decode_with_kv_cache(q, k_cache, v_cache, kv_indices, kv_lens, bmm1_scale: float, bmm2_scale: float):
    k, v = k_cache[kv_indices], v_cache[kv_indices]                  # [bs, ctx, d]
    scores = torch.einsum("bd,bcd->bc", q, k) * bmm1_scale
    valid = torch.arange(MAX_CONTEXT, device=q.device)[None, :] < kv_lens[:, None]
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return torch.einsum("bc,bcd->bd", probs, v) * bmm2_scale


class FlashInferAttnBackend:
    def __init__(self, device, variant, max_bs):
        self.variant = variant
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(device, max_bs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v,
                                                         layer.k_scale, layer.v_scale)
        if self.variant == "bug":
            k_scale, v_scale = layer.k_scale, layer.v_scale
        else:
            # Must use _float to avoid device-to-host copy that breaks cuda graph capture.
            k_scale, v_scale = layer.k_scale_float, layer.v_scale_float
        return self.decode_wrapper.forward(
            q, forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id),
            sm_scale=layer.scaling, logits_soft_cap=layer.logit_cap, k_scale=k_scale, v_scale=v_scale)


class ForwardBatch:
    def __init__(self, input_ids, positions, out_cache_loc, token_to_kv_pool):
        self.input_ids, self.positions, self.out_cache_loc = input_ids, positions, out_cache_loc
        self.token_to_kv_pool = token_to_kv_pool


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(10056)
        self.embed_tokens = randn(VOCAB, HEAD_DIM, gen=gen, device=device)
        self.pos_emb = randn(32, HEAD_DIM, gen=gen, device=device, scale=0.3)
        self.qkv_proj = randn(HEAD_DIM, 3 * HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.o_proj = randn(HEAD_DIM, HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(HEAD_DIM, VOCAB, gen=gen, device=device, scale=0.6)
        self.attn = RadixAttention(device)

    def forward(self, forward_batch, attn_backend):
        h = self.embed_tokens[forward_batch.input_ids] + self.pos_emb[forward_batch.positions]
        q, k, v = (h @ self.qkv_proj).split(HEAD_DIM, dim=-1)
        o = attn_backend.forward_decode(q, k, v, self.attn, forward_batch)
        return (h + o @ self.o_proj) @ self.lm_head


class CudaGraphRunner:
    def __init__(self, model, attn_backend, token_to_kv_pool, device):
        self.model, self.attn_backend, self.device = model, attn_backend, device
        max_bs = CUDA_GRAPH_BS[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.token_to_kv_pool = token_to_kv_pool
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(device)
        wrapper = attn_backend.decode_wrapper
        for bs in reversed(CUDA_GRAPH_BS):
            fb = ForwardBatch(self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs], token_to_kv_pool)
            self.graphs[bs], self.output_buffers[bs] = capture(
                lambda fb=fb: self.model.forward(fb, self.attn_backend), device=device, pool=self.pool,
                name=f"decode bs={bs}", owner="CudaGraphRunner",
                static={"input_ids": self.input_ids, "positions": self.positions, "out_cache_loc": self.out_cache_loc,
                        "kv_indices": wrapper._kv_indices, "kv_lens": wrapper._kv_lens},
                state={"k_buffer": token_to_kv_pool.k_buffer, "v_buffer": token_to_kv_pool.v_buffer})

    def replay(self, input_ids, positions, out_cache_loc, kv_indices, kv_lens):
        raw_bs = input_ids.shape[0]
        bs = CUDA_GRAPH_BS[bisect.bisect_left(CUDA_GRAPH_BS, raw_bs)]
        for buf, val in ((self.input_ids, input_ids), (self.positions, positions),
                         (self.out_cache_loc, out_cache_loc)):
            buf.zero_()
            buf[:raw_bs].copy_(val)
        pad = bs - raw_bs
        self.attn_backend.decode_wrapper.plan(
            torch.cat([kv_indices, kv_indices.new_zeros(pad, MAX_CONTEXT)]),
            torch.cat([kv_lens, kv_lens.new_ones(pad)]))
        out = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs)
        return out[:raw_bs]


def run(variant: str, device: str = "cpu"):
    model = LlamaForCausalLM(device)
    gen = torch.Generator().manual_seed(7)
    prefill_k = torch.randn(NUM_SLOTS, HEAD_DIM, generator=gen).to(device)
    prefill_v = torch.randn(NUM_SLOTS, HEAD_DIM, generator=gen).to(device)
    # three requests, each with its own slots (slot 0 is the pool's reserved padding slot); their
    # prompts' KV is already cached
    req_slots = [list(range(1, 9)), list(range(9, 17)), list(range(17, 25))]
    prompt_lens = [3, 5, 2]

    def serve(graphed: bool):
        pool = MHATokenToKVPool(device)
        pool.k_buffer.copy_(prefill_k)
        pool.v_buffer.copy_(prefill_v)
        backend = FlashInferAttnBackend(device, variant, CUDA_GRAPH_BS[-1])
        runner = CudaGraphRunner(model, backend, pool, device) if graphed else None
        pool.k_buffer.copy_(prefill_k)                       # capture-time cache writes are not kept
        pool.v_buffer.copy_(prefill_v)
        input_ids = torch.tensor([4, 9, 2], device=device)
        lens = list(prompt_lens)
        kv_indices = torch.tensor(req_slots, device=device)
        outs = []
        for _ in range(3):
            positions = torch.tensor(lens, device=device)
            out_cache_loc = torch.tensor([req_slots[i][lens[i]] for i in range(3)], device=device)
            kv_lens = torch.tensor(lens, device=device) + 1
            if graphed:
                logits = runner.replay(input_ids, positions, out_cache_loc, kv_indices, kv_lens)
            else:
                backend.decode_wrapper.plan(kv_indices, kv_lens)
                logits = model.forward(ForwardBatch(input_ids, positions, out_cache_loc, pool), backend)
            outs.append(logits.clone())
            input_ids = logits.argmax(-1)
            lens = [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
