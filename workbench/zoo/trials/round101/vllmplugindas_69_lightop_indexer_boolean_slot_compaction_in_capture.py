"""Hygon vLLM plugin: the Hy4 LightOp sparse-indexer drops padded ``-1`` slots by boolean-mask compaction, a host sync that fails the decode graph's capture.

Upstream: https://github.com/HYGON-AI/vllm-plugin-das/pull/69 ("feat(eplb): common offline maps and
locality-aware routing controls", HYGON-AI/vllm-plugin-das, the vLLM platform plugin for Hygon DCUs (HCU), merged;
the CUDA-graph fix is its commit 981c1fc, reported in the PR's comment of 2026-09-07 "Hy4 LightOp CUDAGraph
follow-up"). Read: that comment (root cause: "5a9dddb introduced ``cache_k[slot_mapping >= 0]`` to protect LightOp
from dummy -1 slots"; boolean compaction makes a dynamic-shaped tensor, which HIP/CUDA graphs cannot capture;
fix: "the graph-capture/DCP path now keeps fixed-shape K/slot tensors, lets LightOp quantize Q with empty cache
inputs, and writes K through the HCU Triton cache writer, which ignores -1 on device; the eager single-rank path
keeps the fused LightOp cache write"; verified on Hy4-preview FP8, DP8+EP, DeepEP-LL, no ``--enforce-eager``,
``VLLM_USE_V2_MODEL_RUNNER=1``); the fixed tree's tests ``test_hy_v4_lightop_qk_fusion_writes_cache_before_topk``
and ``test_hy_v4_lightop_avoids_unsafe_negative_slot_cache_writes`` (``SparseAttnIndexer.forward_hip``: eager
single rank calls ``lightop_indexer_qk_quant_and_store`` with the first ``num_kv_actual_tokens`` rows and slots,
then ``rocm_aiter_sparse_attn_indexer_native(..., skip_k_cache_insert=True, indexer_cache_layout="NORMAL")``; the
other path calls the fused op with K of shape (0, D) and no slots, then ``ops.indexer_k_quant_and_cache(k, cache,
slot_mapping, block_size, scale_fmt)`` with all slots, -1 included, then top-k with layout None); a later
``sparse_attn_indexer.py`` (the ROCm ``forward_hip``, ``indexer_k_quant_and_cache``). The pre-fix file was not
retrievable: the bug lines are modelled from the comment's quoted expression.
Symptom: Hy4 with the LightOp indexer and CUDA graphs (no ``--enforce-eager``) fails at startup, while capturing
the decode graphs (the stream capture refuses the dynamic-shaped op); eager mode (``--enforce-eager``) is
unaffected.
Mechanism: the dummy batches that capture runs carry ``slot_mapping`` = -1 (PAD), which the fused LightOp cache
write does not skip, so 5a9dddb compacted K and the slots with ``slot_mapping >= 0`` before the fused call. A
boolean-mask index has a data-dependent size: the device must tell the host how many rows survive (a ``nonzero``),
which a capturing stream refuses. The eager warmup passes; the capture raises.
Doctor: sync-in-capture, at forward_hip (its boolean-mask compaction of K and the slots runs inside the captured
decode step and needs a host synchronisation).
Fix (upstream): while capturing (or with DCP), keep K and the slots fixed-shape, quantize only Q in the fused op,
and write K with the cache writer that skips -1 on the device; eagerly keep the fused write. The capture test
(``torch.cuda.is_current_stream_capturing()``) is my reading of "graph-capture path".
Modelled: ``SparseAttnIndexer.forward_hip`` (single rank, ``use_lightop_hy_v4_indexer``), the fused
``lightop_indexer_qk_quant_and_store`` (quantizes Q per token and head to a power-of-two "ue8m0" scale folded into
the weights, quantizes K and stores it at every slot it is given), ``indexer_k_quant_and_cache`` (same K quantizer,
-1 rows write nothing), ``rocm_aiter_sparse_attn_indexer_native`` (paged keys by block table, ReLU(q.k) weighted
over heads, causal mask by ``seq_lens``, top-k indices, -1 where masked) and a sparse attention over the selected
keys; the forward context holding the indexer metadata; the V2 runner's static buffers, dummy run with PAD slots,
FULL decode graphs for 1, 2 and 4 requests captured at startup, padding to the next size. Stand-ins: the model
(embeddings, Q/K/weights projections, LM head), fp8 as rounding to integer multiples (at most 16) of a
power-of-two scale (float64), the cache layouts (``indexer_cache_layout`` is accepted; one layout here). The fixed
eager path's exact lines are unread (the tests show the first ``num_kv_actual_tokens`` rows reaching the fused op):
it is modelled keeping the -1 compaction there, which is legal outside a capture.
Workload: startup captures the decode graphs (warmup + capture on the dummy batch); then requests A (5 tokens),
B (4), C (6) are prefilled eagerly and decode 4 steps each (3 requests padded to 4) with the greedy token fed
back. Bug: the first capture (4 requests, after its eager warmup passed) raises ``CaptureError`` at the compaction
``k[valid]`` in ``forward_hip``: no request is served; fix: the 3 prefills and the 4 decode steps served by the
4-request graph equal eager (max |graph - eager| = 1.78e-15, float rounding of the padded batch's einsums).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HYGON-AI/vllm-plugin-das/pull/69"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward_hip"
SYMPTOM = ("Hy4 + LightOp indexer with CUDA graphs fails at startup while capturing decode graphs "
           "(boolean compaction of K/slot_mapping is a host sync); eager mode is unaffected")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM = 32, 16, 2, 8
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 10, 3           # block 0 is the null block
MAX_NUM_TOKENS, TOPK = 16, 3
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
PAD_SLOT_ID = -1
FP8_MAX = 16.0                                                  # stand-in for float8's range
DTYPE = torch.float64

_variant = "bug"
_forward_context = SimpleNamespace(attn_metadata=None)


def get_forward_context():
    return _forward_context


def _quant_ue8m0(x):
    """Per row (last dim) quantization with a power-of-two scale: returns (dequantized values, scale)."""
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return torch.round(x / scale).clamp(-FP8_MAX, FP8_MAX) * scale, scale


# --- vllm_hcu/model_executor/layers/sparse_attn_indexer.py (kernels: stand-ins) ----------------------------------

def lightop_indexer_qk_quant_and_store(q, k, kv_cache, slot_mapping, weights, page_size, q_scale_factor):
    """LightOp's fused kernel: Q to fp8 (its scale folded into the head weights) and K into the paged cache.
    It writes every slot it is given: a -1 would write outside the cache."""
    q_quant, q_scale = _quant_ue8m0(q)
    k_quant, _ = _quant_ue8m0(k)
    kv_cache.view(-1, HEAD_DIM).index_copy_(0, slot_mapping, k_quant)
    return q_quant, weights * q_scale.squeeze(-1) * q_scale_factor


class ops:
    @staticmethod
    def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, block_size, scale_fmt):
        """The HCU Triton cache writer: rows whose slot is -1 return early (on the device, no compaction)."""
        flat = kv_cache.view(-1, HEAD_DIM)
        k_quant, _ = _quant_ue8m0(k)
        valid = (slot_mapping >= 0)[:, None]
        slots = slot_mapping.clamp(min=0)          # a -1 row rewrites the null block's slot 0 with itself
        flat.index_copy_(0, slots, torch.where(valid, k_quant, flat.index_select(0, slots)))


def rocm_aiter_sparse_attn_indexer_native(hidden_states, k_cache_prefix, kv_cache, q_fp8, k, weights,
                                          quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                                          total_seq_lens, topk_indices_buffer, skip_k_cache_insert,
                                          indexer_cache_layout=None):
    """Index logits over each token's paged keys, top-k per row into ``topk_indices_buffer`` (-1: none)."""
    assert skip_k_cache_insert
    metadata = get_forward_context().attn_metadata[k_cache_prefix]
    n = hidden_states.shape[0]
    keys = kv_cache[metadata.block_table[:n].long()].reshape(n, -1, head_dim)        # [n, L, D]
    scores = torch.relu(torch.einsum("nhd,nld->nhl", q_fp8, keys))
    logits = (scores * weights[:, :, None]).sum(dim=1)
    pos = torch.arange(keys.shape[1], device=keys.device)
    logits = logits.masked_fill(pos[None, :] >= metadata.seq_lens[:n, None], float("-inf"))
    values, indices = logits.topk(topk_tokens, dim=-1)
    topk_indices_buffer[:n] = torch.where(values > float("-inf"), indices, -1)
    return topk_indices_buffer


class SparseAttnIndexer:
    def __init__(self, k_cache, topk_indices_buffer):
        self.k_cache = k_cache
        self.quant_block_size = 128
        self.scale_fmt = "ue8m0"
        self.topk_tokens = TOPK
        self.head_dim = HEAD_DIM
        self.max_model_len = self.max_total_seq_len = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
        self.topk_indices_buffer = topk_indices_buffer
        self.skip_k_cache_insert = False
        self.use_lightop_hy_v4_indexer = True
        self.dcp_world_size = 1
        self.pcp_world_size = 1

    def forward_hip(self, hidden_states, q, k, weights):
        metadata = get_forward_context().attn_metadata[self.k_cache.prefix]
        slot_mapping = metadata.slot_mapping
        kv_cache = self.k_cache.kv_cache
        if _variant == "bug":
            # 5a9dddb: keep LightOp's fused write away from the dummy batch's -1 slots.
            valid = slot_mapping >= 0
            cache_k, cache_slots = k[valid], slot_mapping[valid]
            q_fp8, weights = lightop_indexer_qk_quant_and_store(
                q, cache_k, kv_cache, cache_slots, weights, page_size=BLOCK_SIZE, q_scale_factor=HEAD_DIM ** -0.5)
            layout = "NORMAL"
        elif self.dcp_world_size > 1 or torch.cuda.is_current_stream_capturing():
            # Graph capture / DCP: fixed-shape K and slots; LightOp quantizes Q only, the Triton writer skips -1.
            q_fp8, weights = lightop_indexer_qk_quant_and_store(
                q, k[:0], kv_cache, slot_mapping[:0], weights, page_size=BLOCK_SIZE,
                q_scale_factor=HEAD_DIM ** -0.5)
            ops.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, self.quant_block_size, self.scale_fmt)
            layout = None
        else:
            # Eager single rank: the fused LightOp cache write, on the real tokens (compacted: legal eagerly).
            n = metadata.num_kv_actual_tokens
            cache_k, cache_slots = k[:n], slot_mapping[:n]
            valid = cache_slots >= 0
            q_fp8, weights = lightop_indexer_qk_quant_and_store(
                q, cache_k[valid], kv_cache, cache_slots[valid], weights, page_size=BLOCK_SIZE,
                q_scale_factor=HEAD_DIM ** -0.5)
            layout = "NORMAL"
        return rocm_aiter_sparse_attn_indexer_native(
            hidden_states, self.k_cache.prefix, kv_cache, q_fp8, k, weights, self.quant_block_size,
            self.scale_fmt, self.topk_tokens, self.head_dim, self.max_model_len, self.max_total_seq_len,
            self.topk_indices_buffer, skip_k_cache_insert=True, indexer_cache_layout=layout)


# --- the model (stand-in: one layer whose attention reads only the indexer's top-k keys) -------------------------

class Hy4Model:
    def __init__(self, device):
        gen = generator(69)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_positions = randn(self.max_len(), HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.wq = randn(HIDDEN, N_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.wk = randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.weights_proj = randn(HIDDEN, N_HEADS, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.wo = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)
        self.kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, dtype=DTYPE, device=device)
        self.topk_indices_buffer = torch.full((MAX_NUM_TOKENS, TOPK), -1, dtype=torch.long, device=device)
        k_cache = SimpleNamespace(prefix="model.layers.0.self_attn.indexer.k_cache", kv_cache=self.kv_cache)
        self.indexer = SparseAttnIndexer(k_cache, self.topk_indices_buffer)

    @staticmethod
    def max_len():
        return BLOCK_SIZE * MAX_BLOCKS_PER_REQ

    def forward(self, input_ids, positions):
        n = input_ids.shape[0]
        hidden_states = self.embed_tokens[input_ids] + self.embed_positions[positions]
        q = (hidden_states @ self.wq).view(n, N_HEADS, HEAD_DIM)
        k = hidden_states @ self.wk
        weights = hidden_states @ self.weights_proj
        topk = self.indexer.forward_hip(hidden_states, q, k, weights)[:n]
        # Sparse attention over the selected keys (the cache holds them once the indexer wrote this step's K).
        metadata = get_forward_context().attn_metadata[self.indexer.k_cache.prefix]
        keys = self.kv_cache[metadata.block_table[:n].long()].reshape(n, -1, HEAD_DIM)
        selected = keys.gather(1, topk.clamp(min=0)[:, :, None].expand(n, TOPK, HEAD_DIM))
        mask = topk >= 0
        scores = torch.einsum("nd,ntd->nt", q.mean(dim=1), selected) * HEAD_DIM ** -0.5
        probs = torch.softmax(scores.masked_fill(~mask, -1e30), dim=-1) * mask
        out = torch.einsum("nt,ntd->nd", probs, selected)
        return torch.tanh(hidden_states + out @ self.wo) @ self.lm_head


# --- the runner (vLLM V2 model runner, reduced) ------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = Hy4Model(device)
        self.prefix = self.model.indexer.k_cache.prefix
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_TOKENS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.free_blocks = list(range(1, NUM_BLOCKS))
        self.requests = {}
        self.graphs = {}
        if use_cuda_graph:
            self.capture_model()

    def set_forward_context(self, num_tokens, num_actual):
        _forward_context.attn_metadata = {self.prefix: SimpleNamespace(
            slot_mapping=self.slot_mapping[:num_tokens], num_kv_actual_tokens=num_actual,
            seq_lens=self.seq_lens[:num_tokens], block_table=self.block_table[:num_tokens])}

    def _dummy_run(self, num_tokens):
        """The step a FULL graph captures, on the dummy batch ``capture_model`` prepared."""
        self.set_forward_context(num_tokens, num_tokens)
        return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        static = {"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                  "seq_lens": self.seq_lens, "block_table": self.block_table}
        events.written_metadata("SparseAttnIndexer", {"topk_indices_buffer": self.model.topk_indices_buffer})
        self.slot_mapping.numpy()[:] = PAD_SLOT_ID         # block_tables.get_dummy_slot_mappings()
        self.seq_lens.numpy()[:] = 0
        self.block_table.numpy()[:] = 0
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self.graphs[n] = capture(lambda n=n: self._dummy_run(n), device=self.device, pool=pool,
                                     name=f"FULL decode {n}", owner="GPUModelRunner", static=static,
                                     state={"kv_cache": self.model.kv_cache})

    def _prepare(self, rows):
        """rows: (request id, token, position) per token; writes the static buffers (host data, numpy)."""
        for i, (rid, token, pos) in enumerate(rows):
            blocks = self.requests[rid]
            while len(blocks) <= pos // BLOCK_SIZE:
                blocks.append(self.free_blocks.pop(0))
            self.input_ids.numpy()[i] = token
            self.positions.numpy()[i] = pos
            self.slot_mapping.numpy()[i] = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            self.seq_lens.numpy()[i] = pos + 1
            self.block_table.numpy()[i] = 0
            self.block_table.numpy()[i, :len(blocks)] = blocks

    def execute_model(self, rows, uniform_decode):
        n = len(rows)
        self._prepare(rows)
        size = next((s for s in CUDAGRAPH_CAPTURE_SIZES if s >= n), None)
        if self.graphs and uniform_decode and size is not None:          # FULL graphs serve decode batches
            self.slot_mapping.numpy()[n:size] = PAD_SLOT_ID            # padded requests write nothing
            self.seq_lens.numpy()[n:size] = 0
            self.block_table.numpy()[n:size] = 0
            g, out = self.graphs[size]
            return replay(g, out, real=n, size=size,
                          padded={"input_ids": self.input_ids, "positions": self.positions})[:n].clone()
        self.set_forward_context(n, n)
        return self.model.forward(self.input_ids[:n], self.positions[:n]).clone()

    def prefill(self, rid, prompt):
        self.requests[rid] = []
        return self.execute_model([(rid, t, p) for p, t in enumerate(prompt)], uniform_decode=False)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 17, 8, 25, 1], "B": [9, 4, 30, 12], "C": [22, 6, 14, 2, 27, 11]}
    num_decode_steps = 4

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        outputs, last, length = [], {}, {}
        for rid, prompt in prompts.items():
            logits = runner.prefill(rid, prompt)
            outputs.append(logits)
            last[rid], length[rid] = int(logits[-1].argmax()), len(prompt)
        for _ in range(num_decode_steps):
            rows = [(rid, last[rid], length[rid]) for rid in prompts]
            logits = runner.execute_model(rows, uniform_decode=True)
            outputs.append(logits)
            for i, rid in enumerate(prompts):
                last[rid], length[rid] = int(logits[i].argmax()), length[rid] + 1
        return outputs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
