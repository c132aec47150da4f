"""FP8 FlashMLA decode metadata is allocated afresh on every build; the FULL graph keeps the capture's.

Upstream: https://github.com/vllm-project/vllm/pull/35175 ("[Bugfix] Restore CUDA graph persistent
buffers for FP8 FlashMLA decode"), fixing https://github.com/vllm-project/vllm/issues/33638
("DeepSeekV3.1 with fp8 kvcache in v0.15.0 produces garbled output").
Symptom: DeepSeek-V3.1 with ``--kv-cache-dtype fp8`` under the default FULL_AND_PIECEWISE CUDA graphs
produces output that starts normal and degenerates after a few dozen tokens; ``--enforce-eager`` is
correct (vLLM v0.15.0, Feb 2026).
Mechanism: after the FlashMLASchedMeta refactor (#32810), ``FlashMLAMetadataBuilder._build_decode``
sets the FP8 path's ``tile_scheduler_metadata`` and ``num_splits``, returned as fresh tensors by
``get_mla_metadata_dense_fp8`` on every build, directly on the metadata object; the persistent
``cg_buf_*`` buffers allocated in ``__init__`` became dead code. The decode graph was captured reading
the dummy batch's metadata tensors, which are released after capture, and every replay reads those
addresses while each step's metadata lands wherever the caching allocator puts it. When a step's fresh
tensors happen to reuse the released block the replay is right; once they do not, the kernel runs a tile
schedule and split offsets of an earlier step (shorter sequences) and skips the newest KV blocks.
Doctor: dangling-reference, at ``flash_mla_with_kvcache_fp8`` (the decode kernel reading the metadata
tensors whose owner released them).
Fix (upstream): in ``_build_decode``, when full CUDA graphs are enabled, copy the FP8 metadata into the
persistent ``cg_buf_tile_scheduler_metadata`` / ``cg_buf_num_splits`` views (tail of ``num_splits``
padded with its last value) and hand those views to the kernel, as before the refactor.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events, reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/35175"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "flash_mla_with_kvcache_fp8"
SYMPTOM = "decode under FULL graphs degenerates: the kernel reads an earlier step's tile schedule and splits"

VOCAB, DIM = 10, 4
BLOCK = 2                     # FlashMLA kernel block size (64 upstream)
MAX_BLOCKS = 4                # block-table width
NUM_SM_PARTS = 3              # tile_scheduler_metadata rows (<= #SMs upstream)
MAX_NUM_SEQS = 2              # decode graph size
NUM_KV_BLOCKS = 1 + MAX_NUM_SEQS * MAX_BLOCKS + 1   # block 0 null, last block scratch (slot -1)
MAX_SPLITS = MAX_NUM_SEQS + NUM_SM_PARTS
KEY_STRIDE = 64               # (request, block) -> lexicographic key for the tile schedule


class FlashMLASchedMeta:
    def __init__(self, tile_scheduler_metadata=None, num_splits=None):
        self.tile_scheduler_metadata = tile_scheduler_metadata
        self.num_splits = num_splits


class FlashMLADecodeMetadata:
    def __init__(self, block_table, seq_lens, scheduler_metadata: FlashMLASchedMeta):
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.scheduler_metadata = scheduler_metadata


def get_mla_metadata():
    """Non-FP8 FlashMLA manages its own graph-safe buffers inside the sched-meta object; the FP8 path
    overwrites the two fields below."""
    return FlashMLASchedMeta(), None


def get_mla_metadata_dense_fp8(seq_lens_cpu: list[int], device):
    """The FP8 scheduler kernel: split the decode batch's KV blocks over the SM parts. Returns fresh
    tensors every call: ``tile_scheduler_metadata`` rows ``[begin_idx, begin_block, end_idx, end_block,
    begin_split, 0, 0, 0]`` (requests begin_idx..end_idx; end_block bounds the last one) and cumulative ``num_splits`` [batch + 1]."""
    blocks = [max(1, math.ceil(s / BLOCK)) for s in seq_lens_cpu]
    per_part = math.ceil(sum(blocks) / NUM_SM_PARTS)
    rows, touched = [], [0] * len(blocks)
    req, blk = 0, 0
    for _ in range(NUM_SM_PARTS):
        begin = end = (req, blk)
        take = per_part
        while take and req < len(blocks):
            n = min(take, blocks[req] - blk)
            touched[req] += 1
            take, blk = take - n, blk + n
            end = (req, blk)                                   # last request, its block bound
            if blk == blocks[req]:
                req, blk = req + 1, 0
        rows.append([begin[0], begin[1], end[0], end[1], 0, 0, 0, 0])
    splits = [0]
    for t in touched:
        splits.append(splits[-1] + t)
    tile_scheduler_metadata = torch.empty((NUM_SM_PARTS, 8), dtype=torch.int32, device=device)
    tile_scheduler_metadata.copy_(torch.tensor(rows, dtype=torch.int32))
    num_splits = torch.empty((len(blocks) + 1,), dtype=torch.int32, device=device)
    num_splits.copy_(torch.tensor(splits, dtype=torch.int32))
    return tile_scheduler_metadata, num_splits


class FlashMLAMetadataBuilder:
    def __init__(self, device, full_cudagraphs: bool, restore_persistent_buffers: bool):
        self.device = device
        self.full_cudagraphs = full_cudagraphs
        self.restore = restore_persistent_buffers
        self.cg_buf_tile_scheduler_metadata = None
        self.cg_buf_num_splits = None
        if full_cudagraphs:
            self.cg_buf_tile_scheduler_metadata = torch.zeros((NUM_SM_PARTS, 8), dtype=torch.int32, device=device)
            self.cg_buf_num_splits = torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.int32, device=device)

    def _build_decode(self, block_table_tensor, seq_lens_device, seq_lens_cpu) -> FlashMLADecodeMetadata:
        scheduler_metadata, _ = get_mla_metadata()
        tile_scheduler_metadata, num_splits = get_mla_metadata_dense_fp8(seq_lens_cpu, self.device)
        if self.full_cudagraphs and self.restore:
            sm_parts = tile_scheduler_metadata.size(0)
            view = self.cg_buf_tile_scheduler_metadata[:sm_parts]
            view.copy_(tile_scheduler_metadata)
            tile_scheduler_metadata = view
            n = num_splits.size(0)
            num_splits_view = self.cg_buf_num_splits[:n]
            num_splits_view.copy_(num_splits)
            self.cg_buf_num_splits[n:].fill_(num_splits[-1])
            num_splits = num_splits_view
        scheduler_metadata.tile_scheduler_metadata = tile_scheduler_metadata
        scheduler_metadata.num_splits = num_splits
        return FlashMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                      scheduler_metadata=scheduler_metadata)


def flash_mla_with_kvcache_fp8(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits):
    """Split-KV MLA decode: each SM part attends over the (request, block) range its tile row names and
    writes one partial per split at ``num_splits[req] + i``; the combine sums each request's splits."""
    b = q.shape[0]
    pos = torch.arange(MAX_BLOCKS * BLOCK, device=q.device)
    blk = pos // BLOCK
    slots = block_table[:, blk] * BLOCK + pos % BLOCK                          # [b, P]
    k = k_cache[slots]                                                          # [b, P, D]
    e = torch.exp((q[:, None, :] * k).sum(-1) / DIM ** 0.5)
    e = torch.where(pos[None, :] < cache_seqlens[:, None], e, torch.zeros_like(e))
    key = torch.arange(b, device=q.device)[:, None] * KEY_STRIDE + blk[None, :]
    start = (tile_scheduler_metadata[:, 0] * KEY_STRIDE + tile_scheduler_metadata[:, 1])[:, None, None]
    end = (tile_scheduler_metadata[:, 2] * KEY_STRIDE + tile_scheduler_metadata[:, 3])[:, None, None]
    cover = ((key[None] >= start) & (key[None] < end)).to(e.dtype)             # [parts, b, P]
    num_p = ((cover * e[None])[..., None] * k[None]).sum(2)                    # [parts, b, D]
    den_p = (cover * e[None]).sum(2)                                            # [parts, b]
    touch = cover.amax(-1)                                                      # [parts, b]
    split_id = num_splits[:-1][None, :].long() + torch.cumsum(touch, 0).long() - 1
    split_id = torch.where(touch > 0, split_id, torch.full_like(split_id, MAX_SPLITS))
    o_accum = torch.zeros(MAX_SPLITS + 1, DIM, device=q.device)
    l_accum = torch.zeros(MAX_SPLITS + 1, device=q.device)
    o_accum.index_put_((split_id.reshape(-1),), num_p.reshape(-1, DIM), accumulate=True)
    l_accum.index_put_((split_id.reshape(-1),), den_p.reshape(-1), accumulate=True)
    sid = torch.arange(MAX_SPLITS, device=q.device)
    seg = ((sid[None] >= num_splits[:-1, None]) & (sid[None] < num_splits[1:, None])).to(e.dtype)
    return (seg @ o_accum[:MAX_SPLITS]) / (seg @ l_accum[:MAX_SPLITS])[:, None]


class Model:
    def __init__(self, device):
        gen = generator(35175)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_kv = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.w_q = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.w_o = randn(DIM, DIM, gen=gen, device=device, scale=0.6)

    def latent(self, ids):
        return self.emb[ids] @ self.w_kv

    def forward(self, input_ids, slot_mapping, kv_cache, attn_metadata: FlashMLADecodeMetadata):
        kv_cache[slot_mapping] = self.latent(input_ids)                        # concat_and_cache_mla
        q = self.emb[input_ids] @ self.w_q
        sm = attn_metadata.scheduler_metadata
        o = flash_mla_with_kvcache_fp8(q, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens,
                                       sm.tile_scheduler_metadata, sm.num_splits)
        return o @ self.w_o


def requests():
    """Two requests: prompt tokens and their blocks (block 0 is the null block)."""
    return [([3, 7, 1], [1, 2, 3, 4]), ([5, 2], [5, 6, 7, 8])]


def decode_steps(device):
    """Per step: input_ids, slot_mapping, block_table, seq_lens (device), seq_lens (host mirror)."""
    out = []
    for step in range(4):
        ids, slots, tables, lens = [], [], [], []
        for i, (prompt, blocks) in enumerate(requests()):
            p = len(prompt) + step
            ids.append((prompt[-1] + 3 * step + i + 1) % VOCAB)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
            tables.append(blocks)
            lens.append(p + 1)
        out.append((torch.tensor(ids, device=device), torch.tensor(slots, device=device),
                    torch.tensor(tables, device=device), torch.tensor(lens, dtype=torch.int32, device=device), lens))
    return out


def prefill(model, kv_cache, device):
    for prompt, blocks in requests():
        pos = torch.arange(len(prompt))
        slots = torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK
        kv_cache[slots.to(device)] = model.latent(torch.tensor(prompt, device=device))


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    steps = decode_steps(device)

    def eager():
        kv_cache = torch.zeros(NUM_KV_BLOCKS * BLOCK, DIM, device=device)
        builder = FlashMLAMetadataBuilder(device, full_cudagraphs=False, restore_persistent_buffers=False)
        prefill(model, kv_cache, device)
        outs = []
        for ids, slots, table, lens, lens_cpu in steps:
            md = builder._build_decode(table, lens, lens_cpu)
            outs.append(model.forward(ids, slots, kv_cache, md))
        return outs

    def served():
        kv_cache = torch.zeros(NUM_KV_BLOCKS * BLOCK, DIM, device=device)
        builder = FlashMLAMetadataBuilder(device, full_cudagraphs=True, restore_persistent_buffers=(variant == "fix"))
        bufs = {"input_ids": torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device),
                "slot_mapping": torch.full((MAX_NUM_SEQS,), -1, dtype=torch.long, device=device),
                "block_table": torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS, dtype=torch.long, device=device),
                "seq_lens": torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device)}
        if variant == "fix":
            events.static_buffers("FlashMLAMetadataBuilder", {
                "cg_buf_tile_scheduler_metadata": builder.cg_buf_tile_scheduler_metadata,
                "cg_buf_num_splits": builder.cg_buf_num_splits})
        fwd = {"attn_metadata": None}                                   # set_forward_context

        # capture_model(): a dummy decode batch at max_model_len, slots -1 (PAD_SLOT_ID), null blocks
        dummy_lens = [MAX_BLOCKS * BLOCK] * MAX_NUM_SEQS
        bufs["seq_lens"].copy_(torch.tensor(dummy_lens, dtype=torch.int32))
        fwd["attn_metadata"] = builder._build_decode(bufs["block_table"], bufs["seq_lens"], dummy_lens)
        g, out = capture(lambda: model.forward(bufs["input_ids"], bufs["slot_mapping"], kv_cache, fwd["attn_metadata"]),
                         device=device, on_freed="reuse", name="decode FULL size 2", static=bufs,
                         state={"kv_cache": kv_cache}, owner="GPUModelRunner")
        fwd["attn_metadata"] = None                                     # the dummy run's metadata is released

        prefill(model, kv_cache, device)
        outs = []
        with reuse_freed_blocks():                                      # the caching allocator hands blocks on
            for ids, slots, table, lens, lens_cpu in steps:
                bufs["input_ids"].copy_(ids)
                bufs["slot_mapping"].copy_(slots)
                bufs["block_table"].copy_(table)
                bufs["seq_lens"].copy_(lens)
                fwd["attn_metadata"] = builder._build_decode(bufs["block_table"], bufs["seq_lens"], lens_cpu)
                outs.append(replay(g, out).clone())
                fwd["attn_metadata"] = None
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
