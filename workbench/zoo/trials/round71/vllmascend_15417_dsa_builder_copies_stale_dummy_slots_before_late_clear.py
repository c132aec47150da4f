"""A FULL-graph DP dummy run clears ``slot_mapping`` only after the DSA builder copied it, so its K/V overwrite a cached block.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/15417 ("[BugFix][Worker] Invalidate dummy slots before
attention metadata build", merged 2026-08-31; siblings #15362 / #15409, v0.25 backport #15492).
Symptom: DeepSeek-V4 (DSA) with DP and FULL / FULL_DECODE_ONLY ACL graphs: an idle DP rank's ``_dummy_run`` writes
the dummy token's K/V through the slots of a request that just finished (the PR's probe: stale slots 1498..1505,
SWA KV block 11 offsets 90..97 go from 4096 finite BF16 values to 4096 NaNs after one dummy forward) into blocks that
were released and may be handed to another request; intermittent garbled output that worsens with KV cache usage.
Still present after #11774. Eager mode is unaffected.
Mechanism: ``_dummy_run`` does not go through ``_prepare_inputs()``, so the per-KV-group persistent
``input_batch.block_table[gid].slot_mapping.gpu`` still holds the last real step's slots (``_build_attention_metadata``
only pads the tail ``[num_tokens:num_tokens_padded]`` with -1, so ``_dummy_run(1)``'s token 0 keeps a real slot).
#11774 added ``blk_table.slot_mapping.gpu.fill_(-1)`` in ``NPUModelRunner._dummy_run`` (model_runner_v1.py), but
after ``self._build_attention_metadata(...)``. During that build ``AscendDSAMetadataBuilder.build``
(attention/dsa_v1.py) already copied the shared slots into its own persistent buffer,
``self.slot_mapping[:num_input_tokens] = DeviceOperator.format_dsa_slot_mapping(slot_mapping, block_size)``
(``[block, offset]`` pairs), and that private buffer is what the captured DSA layer's
``dsa_kv_compress_scatter(swa_kv_cache, kv, slot_mapping)`` reads. The late clear reaches only the shared buffer: the
replayed dummy step scatters its K/V into the finished request's slot. Here that slot is in a full block that stays
in the prefix cache; a follow-up request that hits it attends over the dummy's K/V instead of the cached token's.
Eager and piecewise dummy runs build no attention metadata (``_should_build_dummy_attn_metadata`` is true only for
FULL graphs or forced attention) and their attention layers write no KV.
Doctor: stale-input, at ``_dummy_run`` (the dummy step refreshes the shared ``slot_mapping`` only after the DSA
builder consumed it: the graph's slot input is filled from the previous real step's slots, and later real rows read
the K/V the replay wrote there).
Fix (upstream): move the per-KV-group ``blk_table.slot_mapping.gpu.fill_(-1)`` (still ``if not is_graph_capturing``)
before ``_build_attention_metadata(...)`` in ``_dummy_run``; the builder then copies pad slots, which the scatter skips.
Modelled: one SWA KV cache group, one DSA layer with an MLA-style latent (K = V = ``h @ w_kv``) and dense paged
attention instead of the sparse indexer path; float32; ``BLOCK_SIZE`` 4; FULL_DECODE_ONLY graph captured at 2 decode
tokens (the dispatcher pads ``_dummy_run(1)`` to 2). ``npu_scatter_nd_update_v2`` skipping pad rows (block -1) is a
write into a scratch block nobody reads. Prompts are prefilled by direct cache writes (identical in both modes); the
prefix cache is the fixed reuse of block 0. ``CpuGpuBuffer`` / ``BlockTable`` / ``MultiGroupBlockTable`` keep only
what the path uses.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/15417"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "_dummy_run"
SYMPTOM = ("an idle DP rank's FULL-graph dummy run writes K/V through a finished request's slot (copied by the DSA "
           "builder before the late clear) into a prefix-cached block; a request reusing it decodes garbage")

VOCAB, DIM = 8, 4
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 6, 2
SCRATCH_BLOCK = NUM_BLOCKS                 # where pad-slot writes land: no block table of a request points here
MAX_NUM_REQS = MAX_NUM_TOKENS = 2           # FULL_DECODE_ONLY graph: 2 requests x 1 decode token
MAX_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
PAD_SLOT_ID = -1


# --- vllm_ascend/device/device_op.py -------------------------------------------------------------------

def format_dsa_slot_mapping(slot_mapping, block_size):
    """Non-A5: 2D [block_idx, offset]."""
    return torch.stack([slot_mapping // block_size, slot_mapping % block_size], dim=-1)


def dsa_kv_compress_scatter(cache, x, slot_mapping):
    """npu_scatter_nd_update_v2(cache, slot_mapping, x): rows with a pad slot (block -1) write nothing."""
    block = slot_mapping[:, 0]
    block = torch.where(block < 0, torch.full_like(block, SCRATCH_BLOCK), block)
    cache[block, slot_mapping[:, 1]] = x


# --- vllm block table (persistent CPU/GPU buffers) -------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, *shape, dtype, device, fill=0):
        self.cpu = torch.full(shape, fill, dtype=dtype)
        self.gpu = torch.full(shape, fill, dtype=dtype, device=device)

    def copy_to_gpu(self, n):
        self.gpu[:n].copy_(self.cpu[:n].to(self.gpu.device))


class BlockTable:
    def __init__(self, device):
        self.block_table = CpuGpuBuffer(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.long, device=device,
                                        fill=SCRATCH_BLOCK)
        self.slot_mapping = CpuGpuBuffer(MAX_NUM_TOKENS, dtype=torch.long, device=device)   # zeros, as upstream

    def add_row(self, block_ids, row):
        self.block_table.cpu[row].fill_(SCRATCH_BLOCK)
        self.block_table.cpu[row, :len(block_ids)] = torch.tensor(block_ids)

    def compute_slot_mapping(self, req_indices, positions):
        blocks = self.block_table.cpu[req_indices, positions // BLOCK_SIZE]
        n = len(positions)
        self.slot_mapping.cpu[:n] = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        self.slot_mapping.copy_to_gpu(n)

    def commit_block_table(self, num_reqs):
        self.block_table.copy_to_gpu(num_reqs)


class MultiGroupBlockTable:
    def __init__(self, device, num_groups=1):
        self.block_tables = [BlockTable(device) for _ in range(num_groups)]

    def __getitem__(self, gid):
        return self.block_tables[gid]

    def commit_block_table(self, num_reqs):
        for bt in self.block_tables:
            bt.commit_block_table(num_reqs)


# --- vllm_ascend/attention/dsa_v1.py ----------------------------------------------------------------------

class CommonAttentionMetadata:
    def __init__(self, *, slot_mapping, block_table_tensor, seq_lens, num_reqs, num_input_tokens):
        self.slot_mapping, self.block_table_tensor, self.seq_lens = slot_mapping, block_table_tensor, seq_lens
        self.num_reqs, self.num_input_tokens = num_reqs, num_input_tokens


class AscendDSAMetadata:
    def __init__(self, *, slot_mapping, block_table, seq_lens):
        self.slot_mapping, self.block_table, self.seq_lens = slot_mapping, block_table, seq_lens


class AscendDSAMetadataBuilder:
    def __init__(self, device):
        # Note(qcs): two dimension slot_mapping [block, offset] for the kv cache; persistent, captured by the graph
        self.slot_mapping = torch.zeros(MAX_NUM_TOKENS, 2, dtype=torch.long, device=device)

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> AscendDSAMetadata:
        num_input_tokens = common_attn_metadata.num_input_tokens
        slot_mapping = common_attn_metadata.slot_mapping[:num_input_tokens]
        self.slot_mapping[:num_input_tokens] = format_dsa_slot_mapping(slot_mapping, BLOCK_SIZE)
        num_reqs = common_attn_metadata.num_reqs
        return AscendDSAMetadata(slot_mapping=self.slot_mapping[:num_input_tokens],
                                 block_table=common_attn_metadata.block_table_tensor[:num_reqs],
                                 seq_lens=common_attn_metadata.seq_lens[:num_reqs])


class Model:
    def __init__(self, device):
        gen = generator(15417)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_q = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.w_kv = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.w_o = randn(DIM, VOCAB, gen=gen, device=device, scale=0.6)

    def latent_kv(self, tokens):
        return self.emb[tokens] @ self.w_kv

    def forward(self, input_ids, attn_metadata: AscendDSAMetadata, swa_kv_cache):
        h = self.emb[input_ids]
        # _mla_prolog_single_stream: the SWA cache write goes through the builder's slot_mapping
        dsa_kv_compress_scatter(swa_kv_cache, h @ self.w_kv, attn_metadata.slot_mapping)
        q = h @ self.w_q
        n = q.shape[0]
        kv = swa_kv_cache[attn_metadata.block_table].reshape(n, MAX_LEN, DIM)
        scores = (kv @ q[:, :, None]).squeeze(-1) / math.sqrt(DIM)
        valid = torch.arange(MAX_LEN, device=q.device)[None, :] < attn_metadata.seq_lens[:, None]
        probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1)
        return (probs[:, :, None] * kv).sum(1) @ self.w_o


# --- vllm_ascend/worker/model_runner_v1.py -------------------------------------------------------------------

class NPUModelRunner:
    def __init__(self, model, device, variant, use_graph):
        self.model, self.device, self.variant, self.use_graph = model, device, variant, use_graph
        self.num_kv_cache_groups = 1
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_table = MultiGroupBlockTable(device, self.num_kv_cache_groups)   # input_batch.block_table
        self.attn_metadata_builder = AscendDSAMetadataBuilder(device)
        self.swa_kv_cache = torch.zeros(NUM_BLOCKS + 1, BLOCK_SIZE, DIM, device=device)
        self.graph = None

    def _build_attention_metadata(self, num_tokens, num_tokens_padded, num_reqs_padded):
        blk_table = self.block_table[0]
        slot_mapping = blk_table.slot_mapping.gpu
        slot_mapping[num_tokens:num_tokens_padded].fill_(PAD_SLOT_ID)     # only the padded tail
        cm = CommonAttentionMetadata(slot_mapping=slot_mapping[:num_tokens_padded],
                                     block_table_tensor=blk_table.block_table.gpu, seq_lens=self.seq_lens,
                                     num_reqs=num_reqs_padded, num_input_tokens=num_tokens_padded)
        return self.attn_metadata_builder.build(cm)

    def _model_forward(self, attn_metadata):
        return self.model.forward(self.input_ids, attn_metadata, self.swa_kv_cache)

    def _static_buffers(self):
        return {"input_ids": self.input_ids, "dsa_slot_mapping": self.attn_metadata_builder.slot_mapping,
                "block_table": self.block_table[0].block_table.gpu, "seq_lens": self.seq_lens}

    def capture_model(self):
        self._dummy_run(MAX_NUM_TOKENS, is_graph_capturing=True)
        self.swa_kv_cache.zero_()                                # capture-time contents discarded

    def _prepare_inputs(self, requests):
        """A real decode step: requests are (token, block_ids, position); one token each."""
        bt = self.block_table[0]
        for row, (tok, block_ids, pos) in enumerate(requests):
            self.input_ids[row] = tok
            bt.add_row(block_ids, row)
            self.seq_lens[row] = pos + 1
        n = len(requests)
        bt.commit_block_table(n)
        bt.compute_slot_mapping(torch.arange(n), torch.tensor([p for _, _, p in requests]))
        return n

    def execute_model(self, requests):
        n = self._prepare_inputs(requests)
        attn_metadata = self._build_attention_metadata(n, MAX_NUM_TOKENS, MAX_NUM_REQS)
        if self.use_graph:
            g, out = self.graph
            return replay(g, out, real=n, size=MAX_NUM_TOKENS)[:n].clone()
        return self._model_forward(attn_metadata)[:n].clone()

    def _dummy_run(self, num_tokens, is_graph_capturing=False):
        """DP alignment step of an idle rank (and graph capture)."""
        # _should_build_dummy_attn_metadata: only FULL graphs (or forced attention) build attention metadata;
        # an eager dummy forward runs with attn_metadata None and its attention layers write no KV.
        if not (self.use_graph or is_graph_capturing):
            return
        num_tokens_padded = num_reqs_padded = MAX_NUM_TOKENS       # dispatcher pads to the captured size
        max_query_len = 1
        self.input_ids[:num_tokens_padded].zero_()
        self.seq_lens[:num_reqs_padded].fill_(max_query_len)
        self.block_table.commit_block_table(num_reqs_padded)
        if self.variant == "fix" and not is_graph_capturing:
            # the fix: invalidate dummy slots before attention metadata build
            for kv_cache_gid in range(self.num_kv_cache_groups):
                blk_table = self.block_table[kv_cache_gid]
                blk_table.slot_mapping.gpu.fill_(-1)
        attn_metadata = self._build_attention_metadata(num_tokens, num_tokens_padded, num_reqs_padded)
        if self.variant == "bug" and not is_graph_capturing:
            # #11774's clear: too late, AscendDSAMetadataBuilder.build already copied the stale slots
            for kv_cache_gid in range(self.num_kv_cache_groups):
                blk_table = self.block_table[kv_cache_gid]
                blk_table.slot_mapping.gpu.fill_(-1)
        if is_graph_capturing:
            self.graph = capture(lambda: self._model_forward(attn_metadata), device=self.device,
                                 static=self._static_buffers(), state={"swa_kv_cache": self.swa_kv_cache},
                                 owner="NPUModelRunner (FULL_DECODE_ONLY ACL graph)")
            return
        g, out = self.graph
        left = {"block_table": self.block_table[0].block_table.gpu}        # recommitted from unchanged CPU rows
        if self.variant == "bug":
            left["dsa_slot_mapping"] = self.attn_metadata_builder.slot_mapping   # re-copied: last step's slots
        replay(g, out, real=0, size=num_tokens_padded, padded=left)


def prefill(runner, model, tokens, block_ids, start=0):
    """Eager prefill of a prompt's K/V (identical in both modes)."""
    for i, tok in enumerate(tokens):
        pos = start + i
        runner.swa_kv_cache[block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = model.latent_kv(tok)


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(use_graph: bool):
        runner = NPUModelRunner(model, device, variant, use_graph)
        if use_graph:
            runner.capture_model()
        # A (prompt 3,5,2 in block 0) and B (prompt 1,6 in block 1) decode their last token
        prefill(runner, model, [3, 5, 2], [0])
        prefill(runner, model, [1, 6], [1])
        outs = [runner.execute_model([(4, [0], 3), (7, [1], 2)])]          # A -> slot 3, B -> slot 6
        # A and B finish. A's block 0 is full (3,5,2,4) and stays in the prefix cache; B's block 1 is freed.
        # The rank is idle while other DP ranks still run: a DP dummy step
        runner._dummy_run(1)
        # C: A's conversation continued (prefix-cache hit on block 0, computes position 4 in block 2);
        # D: a new prompt prefilled into block 3
        prefill(runner, model, [2, 5, 1], [3, 4])
        c_blocks, d_blocks = [0, 2], [3, 4]
        for step, (c_tok, d_tok) in enumerate([(6, 3), (1, 2), (5, 7)]):
            outs.append(runner.execute_model([(c_tok, c_blocks, 4 + step), (d_tok, d_blocks, 3 + step)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
