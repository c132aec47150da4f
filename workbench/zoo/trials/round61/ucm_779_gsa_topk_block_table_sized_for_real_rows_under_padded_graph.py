"""GSA-on-device hands a padded ACL-graph decode batch a top-k block table with only the real requests' rows.

Upstream: https://github.com/ModelEngine-Group/unified-cache-management/pull/779 ("[bugfix] Fix padded block
tables in graph mode for vllm-ascend v0.11.0", commit ae00195f).
Symptom: GSA sparse decode (GQA) fails under NPU graph mode on vllm-ascend v0.11.0; the commit says "the block
tables in attn_metadata may be padded by the runtime graph capture ... Ensure attention uses the correct block
tables shape". Eager (no graph padding) was fine.
Mechanism: with ACL graphs (piecewise) the runner pads the decode batch to a captured size
(``num_input_tokens = pad_for_cudagraph(n)``); ``AscendAttentionMetadataBuilder.build`` then pads the DecodeOnly
metadata to that size too (``seq_lens`` with ones, ``block_table`` with zero rows, ``torch.cat``), and the
captured pieces compute ``query``/``key`` for all padded rows. The attention op runs between the pieces with the
UCM hook ``GSAOnDevice.attention_begin``: ``cache_k_hash_gqa_npu`` fixes ``batch_size_for_hamming`` (the real
decode requests), ``update_decode_topk_gqa_npu`` runs ``npu_hamming_dist_top_k`` into the persistent
``hamming_output`` and, for DecodeOnly, rebinds ``attn_metadata.block_tables = hamming_output[:bs, 0, :]``: a
table with ``batch_size_for_hamming`` rows, while ``query`` and ``seq_lens`` (the top-k lengths of the padded
``seq_lens``) have the padded row count. ``_npu_paged_attention`` then combines a padded-size query with a
real-size block table and fails. Without padding (eager) both sizes agree.
Doctor: padded-shape-mismatch, at ``update_decode_topk_gqa_npu`` (it swaps the padded block table for one sized
for the real rows, which the padded-size attention then combines with the padded query and lengths).
Fix (upstream): ``cache_k_hash_gqa_npu`` records the step's (padded) table once, ``self.new_block_tables =
attn_metadata.block_tables``; ``update_decode_topk_gqa_npu`` writes the top-k ids into it in place
(``self.new_block_tables[:bs] = self.hamming_output[:bs, 0, :]``) and sets ``attn_metadata.block_tables =
self.new_block_tables``, so padded rows keep the builder's padding and the shape matches.
(One attention layer, one KV head; the hamming top-k keeps the first and last block and the best middle one.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ModelEngine-Group/unified-cache-management/pull/779"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "update_decode_topk_gqa_npu"
SYMPTOM = "GSA sparse decode under NPU graph: paged attention gets a top-k block table with real rows only"

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 4
HIDDEN = NUM_HEADS * HEAD_DIM
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 2, 8, 40          # max_model_len = 16
HASH_BITS, HASH_TOPK_TOKENS = 8, 6                     # top-k: 3 blocks
MAX_NUM_REQS, NUM_INPUT_TOKENS = 4, 4                  # cudagraph_capture_sizes = [4]
SEQ_LEN_THRESHOLD = 7


@dataclasses.dataclass
class AscendMetadata:
    num_actual_tokens: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    slot_mapping: torch.Tensor


def update_seq_lens(seq_lens, topk_token, block_size):
    """KV length left after top-k: ``topk`` blocks, the last one the request's own (partial) tail block."""
    nblk = (seq_lens + block_size - 1) // block_size
    k = topk_token // block_size
    return torch.where(nblk <= k, seq_lens, (k - 1) * block_size + seq_lens - (nblk - 1) * block_size)


def npu_hamming_dist_top_k(q_hash, k_hash, topk, seq_lens, block_table, out):
    """Per request: keep the first and the last block, add the middle blocks closest in hamming distance."""
    for b in range(q_hash.shape[0]):
        nblk = int((seq_lens[b] + BLOCK_SIZE - 1) // BLOCK_SIZE)
        k = int(topk[b])
        if nblk <= k:
            out[b, 0, :nblk] = block_table[b, :nblk]
            continue
        blocks = block_table[b, 1:nblk - 1]
        sim = (k_hash[blocks] == q_hash[b]).flatten(1).sum(1)              # [middle blocks]
        keep = torch.topk(sim, k - 2).indices.sort().values + 1
        idx = torch.cat([keep.new_zeros(1), keep, keep.new_full((1,), nblk - 1)])
        out[b, 0, :k] = block_table[b, idx]


def _npu_paged_attention(query, key_cache, value_cache, block_table, context_lens, scale):
    t = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=query.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    k = key_cache.view(-1, HEAD_DIM)[slots]                             # one KV head
    v = value_cache.view(-1, HEAD_DIM)[slots]
    scores = torch.einsum("bhd,btd->bht", query, k) * scale
    p = torch.softmax(scores.masked_fill((t[None, :] >= context_lens[:, None])[:, None, :], -1e9), -1)
    return torch.einsum("bht,btd->bhd", p, v)


class GSAOnDevice:
    def __init__(self, device, variant):
        self.variant = variant
        gen = generator(7791)
        self.hash_weight = randn(HEAD_DIM, HASH_BITS, gen=gen, device=device)
        self.topk_for_hamming_full = torch.full((MAX_NUM_REQS,), HASH_TOPK_TOKENS // BLOCK_SIZE, device=device)
        self.hamming_output = torch.zeros(MAX_NUM_REQS, NUM_KV_HEADS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.is_tensor_computed = False

    def compute_hash(self, x):
        return (x @ self.hash_weight > 0).to(torch.uint8)

    def execute_begin(self):
        self.is_tensor_computed = False

    def build_decode_attention_meta_npu(self, query_lens, seq_lens, block_table):
        self.ori_seq_lens_decode, self.ori_block_table_decode = seq_lens.clone(), block_table.clone()
        self.decode_mask = (query_lens == 1) & (seq_lens[:query_lens.numel()] >= SEQ_LEN_THRESHOLD)
        self.num_decode_requests = int(self.decode_mask.sum())
        self.topk_seq_lens_qwen = update_seq_lens(seq_lens, HASH_TOPK_TOKENS, BLOCK_SIZE)

    def cache_k_hash_gqa_npu(self, key, k_hash, attn_metadata):
        if not self.is_tensor_computed:
            self.batch_size_for_hamming = self.num_decode_requests        # slice_enabled
            self.topk_for_hamming = self.topk_for_hamming_full[:self.batch_size_for_hamming]
            self.seq_lens_for_hamming = attn_metadata.seq_lens[:self.batch_size_for_hamming]
            self.block_table_decode = self.ori_block_table_decode[:self.batch_size_for_hamming]
            if self.variant == "fix":
                self.new_block_tables = attn_metadata.block_tables
            self.is_tensor_computed = True
        k_hash_compute = self.compute_hash(key)                          # npu_reshape_and_cache_bnsd:
        n = int(attn_metadata.query_lens.sum())                          # rows by query_lens (real rows)
        k_hash.view(-1, NUM_KV_HEADS, HASH_BITS)[attn_metadata.slot_mapping] = k_hash_compute[:n]

    def update_decode_topk_gqa_npu(self, query, k_hash, attn_metadata):
        bs = self.batch_size_for_hamming
        q_hash = self.compute_hash(query[:bs].mean(1, keepdim=True))
        npu_hamming_dist_top_k(q_hash, k_hash, self.topk_for_hamming, self.seq_lens_for_hamming,
                               self.block_table_decode, self.hamming_output[:bs])
        attn_metadata.seq_lens = self.topk_seq_lens_qwen
        if self.variant == "bug":
            new_block_tables = self.hamming_output[:bs, 0, :]            # DecodeOnly: real rows only
            attn_metadata.block_tables = new_block_tables
        else:
            self.new_block_tables[:bs] = self.hamming_output[:bs, 0, :]
            attn_metadata.block_tables = self.new_block_tables

    def attention_begin(self, query, key, k_hash, attn_metadata):
        self.cache_k_hash_gqa_npu(key, k_hash, attn_metadata)
        self.update_decode_topk_gqa_npu(query, k_hash, attn_metadata)

    def attention_finished(self, attn_metadata):
        attn_metadata.block_tables, attn_metadata.seq_lens = self.ori_block_table_decode, self.ori_seq_lens_decode


class NPUModelRunner:
    def __init__(self, device, variant, use_aclgraph):
        gen = generator(779)
        self.device, self.use_aclgraph = device, use_aclgraph
        self.w_qkv = randn(HIDDEN, HIDDEN + 2 * NUM_KV_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.w_o = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.key_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device)
        self.value_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, gen=gen, device=device)
        self.ucm_sparse = GSAOnDevice(device, variant)
        self.k_hash = self.ucm_sparse.compute_hash(self.key_cache)      # prefill hashed the prompt keys
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(NUM_INPUT_TOKENS, HIDDEN, device=device)
        self.attn_output = torch.zeros(NUM_INPUT_TOKENS, HIDDEN, device=device)
        self.graphs = None

    def qkv_piece(self):
        qkv = self.hidden_states @ self.w_qkv
        return (qkv[:, :HIDDEN].reshape(-1, NUM_HEADS, HEAD_DIM).contiguous(),
                qkv[:, HIDDEN:HIDDEN + HEAD_DIM].reshape(-1, NUM_KV_HEADS, HEAD_DIM).contiguous(),
                qkv[:, HIDDEN + HEAD_DIM:].reshape(-1, NUM_KV_HEADS, HEAD_DIM).contiguous())

    def o_piece(self):
        return self.hidden_states + self.attn_output @ self.w_o

    def capture_model(self):
        static = {"hidden_states": self.hidden_states, "attn_output": self.attn_output}
        self.graphs = (capture(self.qkv_piece, device=self.device, owner="ACLGraphWrapper (PIECEWISE)",
                               name="qkv piece bs=4", static=static),
                       capture(self.o_piece, device=self.device, owner="ACLGraphWrapper (PIECEWISE)",
                               name="o_proj piece bs=4", static=static))

    def build(self, num_reqs, num_input_tokens, seq_lens, slot_mapping):
        """``AscendAttentionMetadataBuilder.build`` (DecodeOnly), with the UCM patch's GSA hook."""
        block_table = self.block_table[:num_reqs]
        query_lens = torch.ones(num_reqs, dtype=torch.long)
        seq_lens = torch.tensor(seq_lens)
        if num_input_tokens > num_reqs:                                  # graph padding
            pad = num_input_tokens - num_reqs
            seq_lens = torch.cat([seq_lens, torch.ones(pad, dtype=seq_lens.dtype)])
            block_table = torch.cat([block_table, block_table.new_zeros(pad, MAX_BLOCKS)])
        self.ucm_sparse.build_decode_attention_meta_npu(query_lens, seq_lens, block_table)
        return AscendMetadata(num_reqs, block_table, seq_lens, query_lens,
                              torch.tensor(slot_mapping, device=self.device))

    def unified_ascend_attention_with_output(self, query, key, value, attn_metadata):
        n = attn_metadata.num_actual_tokens
        self.ucm_sparse.attention_begin(query, key, self.k_hash, attn_metadata)
        self.key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[attn_metadata.slot_mapping] = key[:n]
        self.value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[attn_metadata.slot_mapping] = value[:n]
        out = _npu_paged_attention(query, self.key_cache, self.value_cache, attn_metadata.block_tables,
                                   attn_metadata.seq_lens.to(query.device), HEAD_DIM ** -0.5)
        self.ucm_sparse.attention_finished(attn_metadata)
        return out.reshape(-1, HIDDEN)

    def execute_model(self, hidden, block_ids, seq_lens):
        num_reqs = len(block_ids)
        num_input_tokens = NUM_INPUT_TOKENS if self.use_aclgraph else num_reqs
        self.block_table[:num_reqs] = torch.tensor(block_ids, device=self.device)
        slots = [row[(s - 1) // BLOCK_SIZE] * BLOCK_SIZE + (s - 1) % BLOCK_SIZE for row, s in zip(block_ids, seq_lens)]
        self.ucm_sparse.execute_begin()
        attn_metadata = self.build(num_reqs, num_input_tokens, seq_lens, slots)
        self.hidden_states[:num_reqs] = hidden
        self.hidden_states[num_reqs:] = 0
        if self.graphs is None:
            q, k, v = (t[:num_input_tokens] for t in self.qkv_piece())
            self.attn_output[:num_input_tokens] = self.unified_ascend_attention_with_output(q, k, v, attn_metadata)
            return self.o_piece()[:num_reqs].clone()
        (g1, qkv), (g2, out) = self.graphs
        q, k, v = replay(g1, qkv, real=num_reqs, size=NUM_INPUT_TOKENS)
        self.attn_output.copy_(self.unified_ascend_attention_with_output(q, k, v, attn_metadata))
        return replay(g2, out, real=num_reqs, size=NUM_INPUT_TOKENS)[:num_reqs].clone()


# Per step: each decode request's block ids and KV length (its new token included); 3, then 2, then 3 requests.
STEPS = [
    ([[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11, 0, 0], [12, 13, 14, 15, 16, 17, 18, 0]], [9, 12, 14]),
    ([[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11, 0, 0]], [10, 12]),
    ([[1, 2, 3, 4, 5, 19, 0, 0], [6, 7, 8, 9, 10, 11, 20, 0], [12, 13, 14, 15, 16, 17, 18, 0]], [11, 13, 14]),
]


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(7790)
    hiddens = [torch.randn(len(b), HIDDEN, generator=gen).to(device) for b, _ in STEPS]

    def serve(graphed: bool):
        runner = NPUModelRunner(device, variant, use_aclgraph=graphed)
        if graphed:
            runner.capture_model()
        return [runner.execute_model(h, *step) for h, step in zip(hiddens, STEPS)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
