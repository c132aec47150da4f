"""Prefill CUDA-graph replays never refresh ``prefix_lengths_device``: attention runs with capture-time prefix lengths.

Upstream: https://github.com/alibaba/rtp-llm/commit/6b88d752876bb247b08d4360805ac37a1c45cd18 ("fix(attention):
right-align FlashInfer native CUDA graph padding"), a direct commit on main (no PR, no issue).
Symptom: no public report; the commit's tests show prefill-graph output differing from the normal (eager) op
when requests carry a prefix (cached KV) and when a replay's batch is smaller or differently mixed than the
capture's (``test_replay_smaller_batch_with_varied_input``, ``test_batch_prefill`` bs=6).
Mechanism: ``CudaGraphRunner::capturePrefill`` captures one graph per token bucket over static
``py_model_inputs_`` (host ``prefix_lengths``/``input_lengths``/``cu_seqlens`` and device twins
``prefix_lengths_device``/``input_lengths_device``/``cu_seqlens_device``). The twin ``prefix_lengths_device``
is made by ``prepareCaptureInputs`` as ``prefix_lengths.cuda()`` of zeros (CUDA ``prefix_init = 0``); capture
then sets only the host ``prefix_lengths`` (``max_seq_len_``). Each attention object
(``FlashInferTRTLLMPrefillImpl``) keeps static ``seq_lens`` that the captured
``trtllm_batch_context_with_kv_cache`` reads. Before every replay ``CudaGraphRunner::prepareInputs`` copies the
live batch into the static inputs and calls ``prepare_cuda_graph``, whose ``_prepare_cg_prefill_kernel``
writes ``seq_lens = input_lengths_device + prefix_lengths_device``. But the D2D copy of
``prefix_lengths_device`` sat inside ``if (!is_prefill_cuda_graph_mode_)``: in prefill-graph mode it is never
refreshed, and the padded tail is zeroed only on the host. Every replay computes ``seq_lens`` with prefix 0,
so each request's new tokens are placed (KV write) and attended as if it had no cached prefix; eager
(``FlashInferTRTLLMPrefillOp.prepare`` from the live host lengths) uses the real prefixes.
(Miniature: one layer, one head; the fused RoPE/KV-cache write takes its positions from the same
``seq_lens - input_lengths``; ``cu_kv_seqlens``/``kv_cache_offset`` are left out; the right-alignment layout
change of the same commit is not modelled.)
Doctor: stale-input, at prepareInputs (it skips the refresh of the static ``prefix_lengths_device`` in prefill
mode, so each replay's real requests read the prefix lengths left there at capture).
Fix (upstream): ``tryAddD2DCopy(prefix_lengths_device ...)`` moves out of the decode-only branch (copied in
both modes); in prefill mode the padded tails of ``prefix_lengths_device`` and ``input_lengths_device`` are
zeroed too; ``capturePrefill`` copies ``input_lengths``/``prefix_lengths`` into their device twins.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/6b88d752876bb247b08d4360805ac37a1c45cd18"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "prepareInputs"
SYMPTOM = "prefill-graph replays attend with capture-time prefix lengths (0): wrong outputs with a prefix cache"

VOCAB, DIM, PAGE, MAX_BLOCKS = 16, 4, 2, 4           # seq_size_per_block, blocks per request
MAX_BS, MAX_SEQ_LEN, NUM_BLOCKS = 4, PAGE * MAX_BLOCKS, 37   # block 0: the null block
CAPTURE_RANGE = (4, 8)                                 # token buckets
# (input ids, prefix lengths, block ids per request): requests carry a cached prefix (prefix cache hit)
STEPS = (([[3, 9], [5], [7, 2, 11], [4, 8]], [3, 5, 0, 2], [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12],
                                                              [13, 14, 15, 16]]),
         ([[6], [1, 14], [10, 12]], [4, 1, 6], [[17, 18, 19, 20], [21, 22, 23, 24], [25, 26, 27, 28]]),
         ([[13], [2, 5]], [6, 3], [[29, 30, 31, 32], [33, 34, 35, 36]]))


class PyAttentionInputs:
    def __init__(self, device, input_lengths, prefix_lengths, cu_seqlens, block_ids):
        self.input_lengths, self.prefix_lengths, self.cu_seqlens = input_lengths, prefix_lengths, cu_seqlens
        self.input_lengths_device = input_lengths.to(device)
        self.prefix_lengths_device = prefix_lengths.to(device)
        self.cu_seqlens_device = cu_seqlens.to(device)
        self.kv_cache_kernel_block_id_device = block_ids.to(device)


def make_inputs(device, steps_item):
    ids, prefix, blocks = steps_item
    lens = [len(x) for x in ids]
    cu = [0] + [sum(lens[:i + 1]) for i in range(len(lens))]
    t = lambda xs: host(torch.tensor(xs, dtype=torch.int32), device)       # noqa: E731 - pinned host
    attn = PyAttentionInputs(device, t(lens), t(prefix), t(cu), t(blocks))
    return torch.tensor([i for x in ids for i in x], device=device), attn


class Weights:
    def __init__(self, device):
        gen = generator(6588)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_SEQ_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(4))


class FlashInferTRTLLMPrefillImpl:
    """``fmha_impl.prepare`` (from the host lengths) makes ``seq_lens``; its address is what the graph reads."""

    def __init__(self, attn_inputs: PyAttentionInputs):
        self.attn_inputs = attn_inputs
        dev = attn_inputs.input_lengths_device.device
        prefix_lengths = torch.zeros(attn_inputs.input_lengths.shape[0], dtype=torch.int32, device=dev)
        input_lengths = torch.zeros_like(prefix_lengths)
        prefix_lengths.copy_(attn_inputs.prefix_lengths, non_blocking=True)
        input_lengths.copy_(attn_inputs.input_lengths, non_blocking=True)
        self.seq_lens = input_lengths + prefix_lengths          # the _cg params' seq_lens

    def prepare_cuda_graph(self, attn_inputs: PyAttentionInputs):
        """``_prepare_cg_prefill_kernel``: seq_lens = input_lens + prefix_lens, from the device twins."""
        self.seq_lens.copy_(attn_inputs.input_lengths_device + attn_inputs.prefix_lengths_device)

    def forward(self, w, x, kv_cache, tokens):
        """Fused RoPE/KV write at ``seq_lens - input_lens + i``, then causal paged attention up to ``seq_lens``."""
        a, (k_cache, v_cache) = self.attn_inputs, kv_cache
        nb = a.input_lengths_device.shape[0]
        t = torch.arange(tokens, device=x.device)
        b = (a.cu_seqlens_device[1:nb + 1][None, :] <= t[:, None]).sum(1)
        valid = t < a.cu_seqlens_device[nb]                      # padded tokens of the bucket
        bc = b.clamp(max=nb - 1)
        pos = (self.seq_lens[bc] - a.input_lengths_device[bc] + t - a.cu_seqlens_device[bc]).long()
        pos = pos.clamp(0, MAX_SEQ_LEN - 1)
        table = a.kv_cache_kernel_block_id_device.long()[bc]     # [T, MAX_BLOCKS]
        slot = table.gather(1, (pos // PAGE)[:, None]).squeeze(1) * PAGE + pos % PAGE
        slot = torch.where(valid, slot, torch.zeros_like(slot))  # padded tokens write the null block
        h = x + w.pos[pos]
        k_cache[slot] = h @ w.wk
        v_cache[slot] = h @ w.wv
        ctx = torch.arange(MAX_SEQ_LEN, device=x.device)
        slots = table[:, ctx // PAGE] * PAGE + ctx % PAGE
        mask = (ctx[None, :] <= pos[:, None]) & (ctx[None, :] < self.seq_lens[bc].long()[:, None])
        scores = ((k_cache[slots] @ (h @ w.wq)[:, :, None]).squeeze(-1)).masked_fill(~mask, -1e9)
        return x + (torch.softmax(scores, -1)[:, :, None] * v_cache[slots]).sum(1) @ w.wo


def model_forward(w, input_ids, attn_pyobj, kv_cache):
    return attn_pyobj.forward(w, w.emb[input_ids], kv_cache, input_ids.shape[0])


class CudaGraphRunner:
    def __init__(self, w, kv_cache, device, variant):
        self.w, self.kv_cache, self.device, self.variant = w, kv_cache, device, variant
        self.is_prefill_cuda_graph_mode_, self.max_bs_ = True, MAX_BS
        z = lambda n: host(torch.zeros(n, dtype=torch.int32), device)      # noqa: E731
        # capture_mem_hold_.py_model_inputs_ (prepareCaptureInputs: prefix_lengths_device = prefix_lengths.cuda())
        self.input_ids = torch.zeros(max(CAPTURE_RANGE), dtype=torch.long, device=device)
        self.py_attn = PyAttentionInputs(device, z(MAX_BS), z(MAX_BS), z(MAX_BS + 1), z([MAX_BS, MAX_BLOCKS]))
        self.graph_instances_ = {}
        self.capturePrefill()

    def capturePrefill(self):
        a = self.py_attn
        for seq_len in sorted(CAPTURE_RANGE, reverse=True):
            # draft-prefill dummy layout: tokens spread over requests, every request gets max_seq_len_ prefix
            active_bs, per_bs = MAX_BS, seq_len // MAX_BS
            a.input_lengths.fill_(0)
            a.input_lengths[:active_bs] = per_bs
            a.prefix_lengths.fill_(MAX_SEQ_LEN - per_bs)
            a.cu_seqlens.copy_(torch.tensor([min(b, active_bs) * per_bs for b in range(MAX_BS + 1)]))
            a.cu_seqlens_device.copy_(a.cu_seqlens)
            if self.variant == "fix":
                a.input_lengths_device.copy_(a.input_lengths)
                a.prefix_lengths_device.copy_(a.prefix_lengths)
            attn_pyobj = FlashInferTRTLLMPrefillImpl(a)          # py_attn_pyobj_method_(inputs, true)
            def fn(p=attn_pyobj, n=seq_len):
                return model_forward(self.w, self.input_ids[:n], p, self.kv_cache)
            g, out = capture(fn,
                             device=self.device, name=f"prefill seq_len {seq_len}", owner="CudaGraphRunner",
                             static={"input_ids": self.input_ids, "input_lengths_device": a.input_lengths_device,
                                     "prefix_lengths_device": a.prefix_lengths_device,
                                     "cu_seqlens_device": a.cu_seqlens_device,
                                     "kv_cache_kernel_block_id_device": a.kv_cache_kernel_block_id_device,
                                     "seq_lens": attn_pyobj.seq_lens},
                             state={"k_cache": self.kv_cache[0], "v_cache": self.kv_cache[1]})
            self.graph_instances_[seq_len] = (g, out, attn_pyobj)

    def prepareInputs(self, input_ids, inputs: PyAttentionInputs, bs, seq_len):
        a = self.py_attn
        a.kv_cache_kernel_block_id_device.fill_(0)
        self.input_ids[:seq_len].copy_(input_ids)
        a.cu_seqlens_device[:bs + 1].copy_(inputs.cu_seqlens_device)
        a.input_lengths_device[:bs].copy_(inputs.input_lengths_device)
        a.kv_cache_kernel_block_id_device[:bs].copy_(inputs.kv_cache_kernel_block_id_device)
        if self.variant == "fix" or not self.is_prefill_cuda_graph_mode_:
            a.prefix_lengths_device[:bs].copy_(inputs.prefix_lengths_device)
        a.cu_seqlens[:bs + 1].copy_(inputs.cu_seqlens)
        a.input_lengths[:bs].copy_(inputs.input_lengths)
        a.prefix_lengths[:bs].copy_(inputs.prefix_lengths)
        if bs < self.max_bs_:                                    # reset unused batch portions (prefill only)
            a.prefix_lengths[bs:].fill_(0)
            a.input_lengths[bs:].fill_(0)
            if self.variant == "fix":
                a.prefix_lengths_device[bs:].fill_(0)
                a.input_lengths_device[bs:].fill_(0)
        a.cu_seqlens[bs + 1:].fill_(seq_len)
        a.cu_seqlens_device[bs + 1:].fill_(seq_len)

    def forward(self, input_ids, inputs: PyAttentionInputs):
        bs, current_seq_len = inputs.input_lengths.shape[0], input_ids.shape[0]
        bucket = min(n for n in CAPTURE_RANGE if n >= current_seq_len)
        g, out, attn_pyobj = self.graph_instances_[bucket]
        self.prepareInputs(input_ids, inputs, bs, current_seq_len)
        attn_pyobj.prepare_cuda_graph(self.py_attn)              # launched when attention inputs are ready
        hidden = replay(g, out, real=current_seq_len, size=bucket, padded={"input_ids": self.input_ids})
        return hidden[:current_seq_len].clone()


def run(variant: str, device: str = "cpu"):
    w = Weights(device)
    gen = generator(75)
    k0 = randn(NUM_BLOCKS * PAGE, DIM, gen=gen, device=device)   # the cached prefixes' K/V
    v0 = randn(NUM_BLOCKS * PAGE, DIM, gen=gen, device=device)

    def serve(graphed: bool):
        kv_cache = (k0.clone(), v0.clone())
        runner = CudaGraphRunner(w, kv_cache, device, variant) if graphed else None
        outs = []
        for item in STEPS:
            input_ids, inputs = make_inputs(device, item)
            if graphed:
                outs.append(runner.forward(input_ids, inputs))
            else:                                                # normalForward
                outs.append(model_forward(w, input_ids, FlashInferTRTLLMPrefillImpl(inputs), kv_cache))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
