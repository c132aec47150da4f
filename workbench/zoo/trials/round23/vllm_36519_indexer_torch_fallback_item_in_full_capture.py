"""Without DeepGEMM the sparse-MLA indexer still reports FULL-graph support; its torch fallback syncs in capture.

Upstream: https://github.com/vllm-project/vllm/pull/36519 ("[Bugfix][Sparse MLA] report indexer CG support
properly"); the failure was reported in https://github.com/vllm-project/vllm/pull/30515#issuecomment-4023776086.
Symptom: ``vllm serve deepseek-ai/DeepSeek-V3.2`` on a machine without DeepGEMM died while capturing CUDA
graphs: ``fp8_paged_mqa_logits_torch ... context_len = context_lens[i].item()`` ->
``torch.AcceleratorError: CUDA error: operation not permitted when stream is capturing``, then "operation
failed due to a previous error during capture" (vLLM V1, March 2026).
Mechanism: ``DeepseekV32IndexerMetadataBuilder`` reported ``AttentionCGSupport.UNIFORM_BATCH`` unconditionally,
so ``_check_and_update_cudagraph_mode`` kept the default ``FULL_AND_PIECEWISE`` and ``capture_model``
captured FULL decode graphs, with the attention (and its indexer) inside. Without DeepGEMM the indexer's
decode logits come from the PyTorch fallback ``fp8_paged_mqa_logits_torch``, which loops over the batch in
Python and reads each request's context length with ``.item()``: a device-to-host read inside the
capture. (The piecewise graphs were fine: attention is a splitting op and runs eagerly between pieces.)
Doctor: sync-in-capture, at ``fp8_paged_mqa_logits_torch`` (``context_lens[i].item()`` inside the FULL
decode capture).
Fix (upstream): the indexer builder reports its CUDA-graph support from the kernel it will actually use
(``NEVER`` for the torch fallback, ``UNIFORM_BATCH`` with DeepGEMM); the runner then resolves
``FULL_AND_PIECEWISE`` to ``PIECEWISE`` ("CUDAGraphMode.FULL_AND_PIECEWISE is not supported with
DeepseekV32IndexerBackend backend (support: AttentionCGSupport.NEVER); setting cudagraph_mode=PIECEWISE
because attention is compiled piecewise") and the indexer only ever runs eagerly.
I read the PR description and its before/after logs; the diff itself was not available to me, so the
builder's ``get_cudagraph_support`` below is written from that description.
"""
from __future__ import annotations

import dataclasses
import enum
from types import SimpleNamespace

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/36519"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "fp8_paged_mqa_logits_torch"
SYMPTOM = "DeepSeek-V3.2 without DeepGEMM: FULL decode capture hits context_lens[i].item() and aborts startup"

VOCAB, DIM, HEADS, HEAD_DIM = 16, 4, 2, 4
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, TOPK = 2, 12, 4, 2
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS
SIZE = 2                                        # the one capture size: 2 decode requests
NULL_BLOCK = 0
LAYER = "model.layers.0.self_attn"

_forward_context = SimpleNamespace(attn_metadata=None)


class AttentionCGSupport(enum.IntEnum):
    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL_AND_PIECEWISE = 2


def has_deep_gemm() -> bool:
    return False                                # no DeepGEMM wheel on this machine


@dataclasses.dataclass
class SparseMLAMetadata:
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


class FlashMLASparseMetadataBuilder:
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def get_cudagraph_support(self):
        return self._cudagraph_support


class DeepseekV32IndexerMetadataBuilder:
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, variant):
        self.variant = variant

    def get_cudagraph_support(self):
        if self.variant == "fix" and not has_deep_gemm():
            return AttentionCGSupport.NEVER     # the torch fallback is not cudagraph compatible
        return self._cudagraph_support


def fp8_paged_mqa_logits_torch(q, kv_cache, weights, context_lens, block_tables, max_model_len):
    """The PyTorch fallback of DeepGEMM's paged MQA logits: a Python loop over requests and blocks."""
    batch_size = q.shape[0]
    logits = torch.full((batch_size, max_model_len), float("-inf"), device=q.device)
    for i in range(batch_size):
        context_len = context_lens[i].item()
        for block_rk in range((context_len + BLOCK_SIZE - 1) // BLOCK_SIZE):
            block_idx = block_tables[i][block_rk]
            kx = kv_cache[block_idx * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=q.device)]
            s = torch.relu(q[i] @ kx.t()) * weights[i][:, None]       # [heads, block_size]
            k_offsets = torch.arange(block_rk * BLOCK_SIZE, (block_rk + 1) * BLOCK_SIZE, device=q.device)
            logits[i, block_rk * BLOCK_SIZE:(block_rk + 1) * BLOCK_SIZE] = torch.where(
                k_offsets < context_len, s.sum(0), float("-inf"))
    return logits


class DeepseekV32Layer:
    def __init__(self, device):
        gen = generator(36519)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wkv = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wq_idx = randn(DIM, HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wk_idx = randn(DIM, HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.w_weights = randn(DIM, HEADS, gen=gen, device=device, scale=0.5)
        self.wo = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def piece0(self, input_ids):
        h = self.emb[input_ids]
        return (h, h @ self.wq, h @ self.wkv, (h @ self.wq_idx).view(-1, HEADS, HEAD_DIM), h @ self.wk_idx,
                h @ self.w_weights)

    def attention(self, q, kv, q_idx, k_idx, weights, kv_cache, idx_k_cache, output):
        """vllm::unified_mla_attention_with_output (a splitting op): cache write, indexer, sparse MLA."""
        md = _forward_context.attn_metadata[LAYER]
        n = q.shape[0]
        kv_cache[md.slot_mapping[:n]] = kv
        idx_k_cache[md.slot_mapping[:n]] = k_idx
        # Indexer decode path: DeepGEMM's fp8_paged_mqa_logits, or the torch fallback without it
        logits = fp8_paged_mqa_logits_torch(q_idx, idx_k_cache, weights, md.seq_lens[:n], md.block_table[:n],
                                            MAX_MODEL_LEN)
        topk = logits.topk(TOPK, dim=-1).indices
        slots = md.block_table[:n].gather(1, topk // BLOCK_SIZE) * BLOCK_SIZE + topk % BLOCK_SIZE
        sel = kv_cache[slots]                                           # [n, TOPK, dim]
        p = torch.softmax((sel @ q[:, :, None]).squeeze(-1), -1)
        output[:n] = (p[:, :, None] * sel).sum(1)

    def piece1(self, h, attn_output):
        return (h + attn_output) @ self.wo


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.attn_metadata_builders = [FlashMLASparseMetadataBuilder(), DeepseekV32IndexerMetadataBuilder(variant)]
        gen = generator(365)
        self.kv_cache = randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device)        # prompts' KV
        self.idx_k_cache = randn(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, gen=gen, device=device)
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.block_table = torch.full((SIZE, MAX_BLOCKS), NULL_BLOCK, dtype=torch.long, device=device)
        self.attn_output = torch.zeros(SIZE, DIM, device=device)
        self.metadata = {LAYER: SparseMLAMetadata(self.slot_mapping, self.seq_lens, self.block_table)}
        self.cudagraph_mode = self._check_and_update_cudagraph_mode(CUDAGraphMode.FULL_AND_PIECEWISE)
        if graphed:
            self.capture_model()

    def _check_and_update_cudagraph_mode(self, cudagraph_mode):
        min_cg_support = min(b.get_cudagraph_support() for b in self.attn_metadata_builders)
        if cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE and min_cg_support == AttentionCGSupport.NEVER:
            # "...setting cudagraph_mode=PIECEWISE because attention is compiled piecewise"
            cudagraph_mode = CUDAGraphMode.PIECEWISE
        return cudagraph_mode

    def _full_forward(self, n):
        h, q, kv, q_idx, k_idx, weights = self.model.piece0(self.input_ids[:n])
        self.model.attention(q, kv, q_idx, k_idx, weights, self.kv_cache, self.idx_k_cache, self.attn_output)
        return self.model.piece1(h, self.attn_output[:n])

    def capture_model(self):
        # _dummy_run(SIZE): decode requests of one token each, on the null block
        self.seq_lens.fill_(1)
        _forward_context.attn_metadata = self.metadata
        static = {"input_ids": self.input_ids, "slot_mapping": self.slot_mapping, "seq_lens": self.seq_lens,
                  "block_table": self.block_table}
        state = {"kv_cache": self.kv_cache, "idx_k_cache": self.idx_k_cache}
        pool = graph_pool_handle(self.device)
        # mixed-mode PIECEWISE graphs: the pieces between the splitting (attention) ops
        self.pw0, self.pw0_out = capture(lambda: self.model.piece0(self.input_ids[:SIZE]), device=self.device,
                                         pool=pool, owner="PIECEWISE piece 0", static={"input_ids": self.input_ids})
        h = self.pw0_out[0]
        self.pw1, self.pw1_out = capture(lambda: self.model.piece1(h, self.attn_output[:SIZE]),
                                         device=self.device, pool=pool, owner="PIECEWISE piece 1",
                                         static={"attn_output": self.attn_output})
        if self.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE:
            # FULL decode graph: the whole step, attention and indexer included
            self.full, self.full_out = capture(lambda: self._full_forward(SIZE), device=self.device, pool=pool,
                                               owner="FULL decode graph", static=static, state=state)

    def execute_model(self, token_ids, positions, block_ids):
        n = len(token_ids)
        pos = torch.tensor(positions, device=self.device)
        self.input_ids[:n].copy_(torch.tensor(token_ids, device=self.device))
        self.block_table[:n].copy_(torch.tensor(block_ids, device=self.device))
        self.seq_lens[:n].copy_(pos + 1)
        self.slot_mapping[:n].copy_(self.block_table[:n].gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1)
                                    * BLOCK_SIZE + pos % BLOCK_SIZE)
        _forward_context.attn_metadata = self.metadata
        if not self.graphed:
            return self._full_forward(n).clone()
        if self.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE:      # uniform decode -> FULL
            return replay(self.full, self.full_out).clone()
        h, q, kv, q_idx, k_idx, weights = replay(self.pw0, self.pw0_out)
        self.model.attention(q, kv, q_idx, k_idx, weights, self.kv_cache, self.idx_k_cache, self.attn_output)
        return replay(self.pw1, self.pw1_out).clone()


def run(variant: str, device: str = "cpu"):
    model = DeepseekV32Layer(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        block_ids = [[1, 2, 3, 4], [5, 6, 7, 8]]          # A has 3 prompt tokens cached, B has 4
        outs = []
        for step, toks in enumerate(([3, 9], [12, 4], [7, 1], [10, 6])):
            outs.append(runner.execute_model(toks, [3 + step, 4 + step], block_ids))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
