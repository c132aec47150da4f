"""DeepSeek-V3.2's DSA attention backend makes ``paddle.tensor(200.0)`` in every forward: a host-to-device copy of a Python number inside the decode-graph capture, which the capturing stream refuses.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/7253 ("[DeepSeekV3.2][Graph Optimization] Remove
synchronous operation to avoid capture fail and unnecessary contiguous in DSA Backend", ShaneGZhu, merged
2026-04-09, commit 7005404ce).
Symptom: DeepSeek-V3.2 (and GLM-MoE-DSA) served by FastDeploy with CUDA graphs fails at start-up, while
``GPUModelRunner.capture_model`` captures the decode graphs (the capture is invalidated: "operation not permitted
when stream is capturing"); without CUDA graphs it serves.
Mechanism: ``DSAAttentionBackend.forward_mixed``
(fastdeploy/model_executor/layers/attention/dsa_attention_backend.py) computed the KV-cache write scale as
``k_range = paddle.tensor(200.0); scale = paddle.abs(compressed_kv).max() / k_range`` before
``compute_slot_mapping`` and ``dsk_attn_write_cache``. ``paddle.tensor`` builds a tensor from Python data on the
current place (the GPU): a synchronous copy from pageable host memory to the device, made afresh on every
forward. Eagerly that is only a small blocking copy. ``CudaGraphPiecewiseBackend.__call__`` runs the whole model
forward (every DSA layer's ``forward_mixed``) between ``capture_begin`` and ``capture_end``, and a capturing
stream refuses that copy, so the capture of the first decode graph fails and the server never becomes ready.
Doctor: sync-in-capture, at forward_mixed (the captured forward turns a Python number into a device tensor, a
host-to-device copy from pageable memory, which a capture cannot record; the fix divides by the Python float,
which the kernel takes by value).
Fix (upstream): ``scale = paddle.abs(compressed_kv).max() / 200.0`` (no tensor made from host data). The same PR
replaces ``latent_cache.transpose([0, 2, 1, 3]).contiguous()`` with a ``view`` for the decode kernel, a
performance change, not modelled.
Modelled: one DeepseekV32DSAAttention layer between an embedding and an LM head (float32, hidden 16, 2 heads,
q_lora 8, kv_lora 8, nope 4, rope 4, v 4; no RoPE rotation, no MoE, no norms' weights), its ``Indexer``
(2 index heads of dim 4, ReLU-weighted logits over the request's cached keys, top-3, mapped to physical slots as
``radix_topk_ragged_transform`` does) and the decode branch of ``forward_mixed`` (``flash_mla_with_kvcache`` over
the top-k slots, as one dense torch routine). ``paddle.tensor(200.0)`` lands on the current device in Paddle; the
torch spelling of that is ``torch.tensor(200.0, device=...)``. The fp8_ds_mla cache is stored in float32 (the
kernel quantizes per 128-element tile internally and ignores ``scale`` on that path, as upstream). The runner
keeps FastDeploy's ``share_inputs`` as persistent buffers, captures the decode sizes 4 and 2 from a dummy run
(block 0 is the dummy block) and replays exact sizes (no padding). Prompts are already in the caches; four
requests decode three steps, then two of them three more.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/7253"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward_mixed"
SYMPTOM = ("DeepSeek-V3.2 decode CUDA graph capture fails on paddle.tensor(200.0) (a host-to-device copy) in "
           "DSAAttentionBackend.forward_mixed; the server does not start")

VOCAB, HIDDEN = 24, 16
NUM_HEADS = 2
Q_LORA_RANK, KV_LORA_RANK = 8, 8
QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, V_HEAD_DIM = 4, 4, 4
INDEX_N_HEADS, INDEX_HEAD_DIM, INDEX_TOPK = 2, 4, 3
BLOCK_SIZE, MAX_BLOCKS_PER_SEQ, MAX_NUM_SEQS = 4, 3, 4
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_SEQ
NUM_BLOCKS = 1 + MAX_NUM_SEQS * MAX_BLOCKS_PER_SEQ          # block 0: the dummy run's block
CUDAGRAPH_CAPTURE_SIZES = [2, 4]
VARIANT = {"v": "bug"}


def _rms(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# --- fastdeploy/model_executor/forward_meta.py ---------------------------------------------------------

class ForwardMeta:
    def __init__(self, ids_remove_padding, position_ids, batch_id_per_token, block_tables, seq_lens_decoder,
                 caches):
        self.ids_remove_padding, self.position_ids = ids_remove_padding, position_ids
        self.batch_id_per_token, self.block_tables = batch_id_per_token, block_tables
        self.seq_lens_decoder, self.caches = seq_lens_decoder, caches


# --- custom ops (custom_ops/gpu_ops/append_attn/ds_mla_cache_kernel.cu, flash_mla) -----------------------

def dsk_attn_write_cache(kv_nope, kv_pe, kv_cache, slot_mapping, scale, cache_quant_type_str):
    """``DSMLAWriteCacheKernel``: one cache entry per token, [NoPE | RoPE], at its slot. The fp8_ds_mla path
    (``concat_and_cache_ds_mla_kernel``) takes per-tile scales of its own and does not read ``scale``."""
    assert cache_quant_type_str == "fp8_ds_mla"
    entries = torch.cat([kv_nope, kv_pe.reshape(kv_pe.shape[0], -1)], dim=-1)
    kv_cache.view(-1, KV_LORA_RANK + QK_ROPE_HEAD_DIM)[slot_mapping] = entries


def indexer_k_quant_and_cache(k, indexer_cache, slot_mapping):
    indexer_cache.view(-1, INDEX_HEAD_DIM)[slot_mapping] = k


def flash_mla_with_kvcache(q, k_cache, head_dim_v, softmax_scale, indices):
    """Sparse MLA decode: each token attends to the cache entries at its top-k physical slots (-1: none)."""
    flat = k_cache.view(-1, k_cache.shape[-1])
    idx = indices[:, 0, :]                                                     # [T, K]
    entries = flat[idx.clamp_min(0)]                                           # [T, K, D]
    scores = torch.einsum("thd,tkd->thk", q[:, 0], entries) * softmax_scale
    scores = scores.masked_fill((idx < 0)[:, None, :], float("-inf"))
    out = torch.einsum("thk,tkd->thd", torch.softmax(scores, dim=-1), entries[..., :head_dim_v])
    return out, None


# --- fastdeploy/model_executor/layers/attention/dsa_attention_backend.py ---------------------------------

def compute_slot_mapping(block_tables, positions, batch_id_per_token, block_size):
    block_idx = positions // block_size
    block_ids = block_tables[batch_id_per_token, block_idx]
    block_offset = positions % block_size
    slot_mapping = block_ids * block_size + block_offset
    return slot_mapping.to(torch.int64)


class DSAAttentionBackend:
    def __init__(self):
        self.block_size = BLOCK_SIZE
        self.attn_softmax_scale = (QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM) ** -0.5

    def forward_mixed(self, q, k, v, qkv, compressed_kv, k_pe, layer, forward_meta):
        latent_cache = forward_meta.caches[2 * layer.layer_id]

        if VARIANT["v"] == "bug":
            k_range = torch.tensor(200.0, device=compressed_kv.device)     # paddle.tensor(200.0): on the GPU
            scale = torch.abs(compressed_kv).max() / k_range
        else:
            scale = torch.abs(compressed_kv).max() / 200.0

        slot_mapping = compute_slot_mapping(
            forward_meta.block_tables, forward_meta.position_ids, forward_meta.batch_id_per_token, self.block_size)

        dsk_attn_write_cache(compressed_kv, k_pe, latent_cache, slot_mapping, scale.to(torch.float32),
                             "fp8_ds_mla")

        # Decode (every token of these steps is a decode token)
        fmha_out_decode, _ = flash_mla_with_kvcache(
            q.unsqueeze(1), latent_cache, KV_LORA_RANK, self.attn_softmax_scale, v)
        return fmha_out_decode


class Attention:
    def __init__(self, backend, layer_id):
        self.backend, self.layer_id = backend, layer_id

    def __call__(self, q, k, v, qkv, compressed_kv, k_pe, forward_meta):
        return self.backend.forward_mixed(q, k, v, qkv, compressed_kv, k_pe, self, forward_meta)


# --- fastdeploy/model_executor/models/deepseek_v3.py ----------------------------------------------------

class Indexer:
    def __init__(self, layer_id, gen, device):
        self.layer_id = layer_id
        self.index_topk = INDEX_TOPK
        self.wq_b = randn(Q_LORA_RANK, INDEX_N_HEADS * INDEX_HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wk = randn(HIDDEN, INDEX_HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.weights_proj = randn(HIDDEN, INDEX_N_HEADS, gen=gen, device=device, scale=0.5)
        self.softmax_scale = INDEX_HEAD_DIM ** -0.5

    def forward(self, forward_meta, hidden_states, qr):
        indexer_cache = forward_meta.caches[2 * self.layer_id + 1]
        q = (qr @ self.wq_b).reshape(-1, INDEX_N_HEADS, INDEX_HEAD_DIM)
        k = _rms(hidden_states @ self.wk)
        weights = (hidden_states @ self.weights_proj) * self.softmax_scale * INDEX_N_HEADS ** -0.5
        slot_mapping = compute_slot_mapping(forward_meta.block_tables, forward_meta.position_ids,
                                            forward_meta.batch_id_per_token, BLOCK_SIZE)
        indexer_k_quant_and_cache(k, indexer_cache, slot_mapping)

        # decode: fp8_paged_mqa_logits over the request's cached keys, then radix_topk_ragged_transform
        tables = forward_meta.block_tables[forward_meta.batch_id_per_token]          # [T, MAX_BLOCKS]
        keys = indexer_cache[tables].reshape(tables.shape[0], MAX_MODEL_LEN, INDEX_HEAD_DIM)
        logits = (torch.relu(torch.einsum("thd,tpd->thp", q, keys)) * weights[:, :, None]).sum(1)
        pos = torch.arange(MAX_MODEL_LEN, device=hidden_states.device)
        cache_seqlens = forward_meta.seq_lens_decoder[forward_meta.batch_id_per_token] + 1
        logits = logits.masked_fill(pos[None, :] >= cache_seqlens[:, None], float("-inf"))
        values, top_pos = torch.topk(logits, self.index_topk, dim=-1)
        slots = torch.gather(tables, 1, top_pos // BLOCK_SIZE) * BLOCK_SIZE + top_pos % BLOCK_SIZE
        return slots.masked_fill(values == float("-inf"), -1)                        # indexer_top_k


class DeepseekV32DSAAttention:
    def __init__(self, backend, layer_id, gen, device):
        self.qkv_a_proj_with_mqa = randn(HIDDEN, Q_LORA_RANK + KV_LORA_RANK + QK_ROPE_HEAD_DIM, gen=gen,
                                         device=device, scale=0.5)
        self.q_b_proj = randn(Q_LORA_RANK, NUM_HEADS * (QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM), gen=gen,
                              device=device, scale=0.5)
        self.w_uk = randn(NUM_HEADS, QK_NOPE_HEAD_DIM, KV_LORA_RANK, gen=gen, device=device, scale=0.5)
        self.w_uv = randn(NUM_HEADS, KV_LORA_RANK, V_HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.o_proj = randn(NUM_HEADS * V_HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5)
        self.indexer = Indexer(layer_id, gen, device)
        self.dsa_attn = Attention(backend, layer_id)

    def forward(self, forward_meta, hidden_states):
        qkv_a_out = hidden_states @ self.qkv_a_proj_with_mqa
        query, compressed_kv, key_pe = qkv_a_out.split([Q_LORA_RANK, KV_LORA_RANK, QK_ROPE_HEAD_DIM], dim=-1)
        key_pe = key_pe.reshape(-1, 1, QK_ROPE_HEAD_DIM)
        query = _rms(query)

        indexer_top_k = self.indexer.forward(forward_meta, hidden_states, query)

        query = (query @ self.q_b_proj).reshape(-1, NUM_HEADS, QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM)
        query_nope, query_pe = query.split([QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM], dim=-1)
        q_nope_out = torch.einsum("thn,hnc->thc", query_nope, self.w_uk)              # kv_b_proj_bmm "k"
        q_input = torch.cat([q_nope_out, query_pe], dim=-1)

        compressed_kv = _rms(compressed_kv)
        kv = torch.cat([compressed_kv, key_pe.squeeze(1)], dim=-1)

        fmha_out = self.dsa_attn(q=q_input.contiguous(), k=kv.unsqueeze(1), v=indexer_top_k.unsqueeze(1),
                                 qkv=None, compressed_kv=compressed_kv, k_pe=key_pe, forward_meta=forward_meta)
        fmha_out = torch.einsum("thc,hcv->thv", fmha_out, self.w_uv).reshape(-1, NUM_HEADS * V_HEAD_DIM)
        return fmha_out @ self.o_proj


class DeepseekV32ForCausalLM:
    def __init__(self, backend, device):
        gen = generator(7253)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.self_attn = DeepseekV32DSAAttention(backend, 0, gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, ids_remove_padding, forward_meta):
        h = self.embed_tokens[ids_remove_padding]
        h = h + self.self_attn.forward(forward_meta, h)
        return _rms(h) @ self.lm_head


# --- fastdeploy/worker/gpu_model_runner.py + graph_optimization/cudagraph_piecewise_backend.py ----------

class GPUModelRunner:
    def __init__(self, model, caches, device, use_cudagraph):
        self.model, self.caches, self.device = model, caches, device
        self.use_cudagraph = use_cudagraph
        self.share_inputs = {
            "ids_remove_padding": torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device),
            "position_ids": torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device),
            "batch_id_per_token": torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device),
            "block_tables": torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ, dtype=torch.long, device=device),
            "seq_lens_decoder": torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device),
        }
        self.cuda_graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(device)

    def _forward_meta(self, bs):
        s = self.share_inputs
        return ForwardMeta(s["ids_remove_padding"][:bs], s["position_ids"][:bs], s["batch_id_per_token"][:bs],
                           s["block_tables"], s["seq_lens_decoder"], self.caches)

    def _run_model(self, bs):
        forward_meta = self._forward_meta(bs)
        return self.model.forward(forward_meta.ids_remove_padding, forward_meta)

    def _dummy_run(self, bs):
        s = self.share_inputs
        s["ids_remove_padding"].zero_()
        s["position_ids"].zero_()
        s["batch_id_per_token"].copy_(torch.arange(MAX_NUM_SEQS, device=self.device))
        s["block_tables"].zero_()                     # every dummy request writes the dummy block
        s["seq_lens_decoder"].zero_()

    def capture_model(self):
        """Warm up and capture one decode graph per capture size (CudaGraphPiecewiseBackend.__call__)."""
        for bs in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(bs)
            self.cuda_graphs[bs], self.output_buffers[bs] = capture(
                lambda bs=bs: self._run_model(bs), device=self.device, pool=self.pool, warmups=1,
                name=f"decode bs={bs}", owner="CudaGraphPiecewiseBackend",
                static=dict(self.share_inputs),
                state={"latent_cache": self.caches[0], "indexer_cache": self.caches[1]})

    def _prepare_inputs(self, input_ids, positions, block_tables):
        bs = input_ids.shape[0]
        s = self.share_inputs
        s["ids_remove_padding"][:bs].copy_(input_ids)
        s["position_ids"][:bs].copy_(positions)
        s["batch_id_per_token"][:bs].copy_(torch.arange(bs, device=self.device))
        s["block_tables"][:bs].copy_(block_tables)
        s["seq_lens_decoder"][:bs].copy_(positions)            # tokens already cached
        return bs

    def execute_model(self, input_ids, positions, block_tables):
        bs = self._prepare_inputs(input_ids, positions, block_tables)
        if self.use_cudagraph:
            return replay(self.cuda_graphs[bs], self.output_buffers[bs])
        return self._run_model(bs)


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(72530)
    prefill_latent = torch.randn(NUM_BLOCKS, 1, BLOCK_SIZE, KV_LORA_RANK + QK_ROPE_HEAD_DIM, generator=gen)
    prefill_index = torch.randn(NUM_BLOCKS, BLOCK_SIZE, INDEX_HEAD_DIM, generator=gen)
    prompt_lens = [5, 3, 7, 4]
    first_tokens = [3, 11, 17, 6]
    tables = torch.tensor([[1 + MAX_BLOCKS_PER_SEQ * r + j for j in range(MAX_BLOCKS_PER_SEQ)]
                           for r in range(MAX_NUM_SEQS)])

    def serve(use_cudagraph: bool):
        caches = [torch.zeros(NUM_BLOCKS, 1, BLOCK_SIZE, KV_LORA_RANK + QK_ROPE_HEAD_DIM, device=device),
                  torch.zeros(NUM_BLOCKS, BLOCK_SIZE, INDEX_HEAD_DIM, device=device)]
        model = DeepseekV32ForCausalLM(DSAAttentionBackend(), device)
        runner = GPUModelRunner(model, caches, device, use_cudagraph)
        if use_cudagraph:
            runner.capture_model()                     # start-up, before the server is ready
        caches[0].copy_(prefill_latent)                # the prompts' KV (prefilled)
        caches[1].copy_(prefill_index)
        running = [0, 1, 2, 3]
        lens = list(prompt_lens)
        tokens = list(first_tokens)
        outs = []
        for step in range(6):
            if step == 3:
                running = [0, 1]                       # requests 2 and 3 finish
            input_ids = torch.tensor([tokens[r] for r in running], device=device)
            positions = torch.tensor([lens[r] for r in running], device=device)
            logits = runner.execute_model(input_ids, positions, tables[running].to(device))
            outs.append(logits.clone())
            for i, r in enumerate(running):
                tokens[r] = int(logits[i].argmax())
                lens[r] += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
