"""FULL-graph padded requests get block-table rows of -1: the FP8 FlashMLA decode kernel dereferences KV page -1.

Upstream: https://github.com/vllm-project/vllm/pull/35431 ("[Bugfix] Use null block (0) for padded block table
entries", opened 2026-02-26, merged), fixing https://github.com/vllm-project/vllm/issues/33664 (FP8 FlashMLA
illegal memory access under concurrency) and #35336; the closed alternative https://github.com/vllm-project/vllm/pull/35969
("Safe CG padding for FlashMLA FP8 seq_lens and block_table") states the cause.
Symptom: an MLA model (DeepSeek-V3.1, Kimi-K2.5) with ``--kv-cache-dtype fp8`` under FULL CUDA graphs dies with
``CUDA error: an illegal memory access`` in the FlashMLA FP8 decode kernel once concurrent decode batches are
padded up to a captured size; ``--enforce-eager`` (no padded requests) runs (vLLM, Feb 2026).
Mechanism: ``GPUModelRunner._build_attention_metadata`` pads the batch to the graph's ``num_reqs_padded`` and, in
its nested ``_get_block_table_and_slot_mapping``, fills the padded tail of the persistent tensors:
``slot_mapping[num_tokens:num_tokens_padded].fill_(-1)`` (right: ``PAD_SLOT_ID`` marks token slots that
``concat_and_cache_mla`` skips) and ``blk_table_tensor[num_reqs:num_reqs_padded].fill_(-1)`` ("to match mamba
PAD_SLOT_ID"). Block tables index whole KV pages, and no kernel on the FlashMLA FP8 path treats -1 as "no page":
``FlashMLAMetadataBuilder`` hands the padded rows (``seq_lens`` 0) to ``flash_mla_with_kvcache``, whose FP8
kernel still loads a page of every request in the batch before masking by length, at
``k_cache + block_table[row, j] * page_stride``: page -1 lies before the KV cache allocation and the replay faults.
Eager steps run ``num_reqs_padded == num_reqs`` and never write -1 into a block table.
Doctor: stale-padding, at ``_get_block_table_and_slot_mapping`` (the runner writes an invalid block id into the
padded rows of the block table, and whether the whole captured step survives depends on what those padded rows
hold; the fix changes only this fill).
Fix (upstream): ``blk_table_tensor[num_reqs:num_reqs_padded].fill_(NULL_BLOCK_ID)`` with ``NULL_BLOCK_ID = 0``,
the block the ``BlockPool`` reserves as the null block (``free_block_queue.popleft()``, ``is_null``) and never hands
to a request; padded rows then read a valid page and are masked. (The PR also moves the mamba/GDN state-index
padding and the mamba kernels' skip test from -1 to 0; not modelled here.)
Modelled: one MLA layer with a single latent KV head (latent dim 4, keys = values), FP8 -> float32, page size 2,
3 pages per request, 9 pages (page 0 the null block), FULL graphs for uniform decode at 2 and 4 requests. The FP8
kernel's page walk is vectorised: each request visits column ``min(j, n_block - 1)`` clamped at 0 (a zero-length
request still loads its first page, as the upstream kernel dereferences a block-table entry for ``seq_lens`` 0,
per #35969), and the page load is a bounds-checked ``index_select`` on the flat cache, so a negative page raises
on the CPU (and trips a device-side assert on CUDA) where the real kernel's raw pointer arithmetic faults.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/35431"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_get_block_table_and_slot_mapping"
SYMPTOM = "FULL-graph decode of a padded batch faults: padded block-table rows of -1 make FP8 FlashMLA load KV page -1"

VOCAB, DIM = 16, 4
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 2, 3, 9          # page 0: the null block
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS
CAPTURE_SIZES = [2, 4]                                # FULL graphs, uniform decode (one token per request)
MAX_NUM_REQS = CAPTURE_SIZES[-1]
PAD_SLOT_ID, NULL_BLOCK_ID = -1, 0


class Model:
    def __init__(self, device):
        gen = generator(35431)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(MAX_MODEL_LEN, DIM, gen=gen, device=device, scale=0.3)
        self.w_q = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.w_kv = randn(DIM, DIM, gen=gen, device=device, scale=0.7)    # kv_a_proj: the latent cached per token
        self.w_o = randn(DIM, DIM, gen=gen, device=device, scale=0.7)


def concat_and_cache_mla(kv_c, kv_cache, slot_mapping):
    """Store each token's latent at its slot; ``PAD_SLOT_ID`` (-1) slots are skipped."""
    flat = kv_cache.view(NUM_BLOCKS * BLOCK_SIZE, DIM)
    valid = slot_mapping >= 0
    slots = slot_mapping.clamp(min=0)
    flat[slots] = torch.where(valid[:, None], kv_c, flat[slots])


class FlashMLADecodeMetadata:
    def __init__(self, block_table, seq_lens):
        self.block_table = block_table
        self.seq_lens = seq_lens


class FlashMLAMetadataBuilder:
    def build(self, common_attn_metadata) -> FlashMLADecodeMetadata:
        # FULL graphs: the persistent views of the runner, padded rows included
        return FlashMLADecodeMetadata(block_table=common_attn_metadata["block_table_tensor"],
                                      seq_lens=common_attn_metadata["seq_lens"])


def flash_mla_with_kvcache(q, kv_cache, block_table, cache_seqlens):
    """FP8 MLA decode over the paged latent cache. Each request walks its pages ``j`` (column ``min(j, n_block-1)``,
    at least column 0) and loads ``page_stride * block_table[row, col] + offset`` from the flat cache; scores past
    ``cache_seqlens`` are masked afterwards."""
    b = q.shape[0]
    flat = kv_cache.view(NUM_BLOCKS * BLOCK_SIZE, DIM)
    pos = torch.arange(MAX_MODEL_LEN, device=q.device)
    n_block = torch.div(cache_seqlens + BLOCK_SIZE - 1, BLOCK_SIZE, rounding_mode="floor")
    col = torch.minimum((pos // BLOCK_SIZE)[None, :], (n_block - 1).clamp(min=0)[:, None])     # [b, P]
    page = torch.gather(block_table, 1, col)
    addr = page * BLOCK_SIZE + (pos % BLOCK_SIZE)[None, :]
    k = flat.index_select(0, addr.reshape(-1)).view(b, MAX_MODEL_LEN, DIM)                     # the page loads
    scores = (q[:, None, :] * k).sum(-1) / DIM ** 0.5
    scores = scores.masked_fill(pos[None, :] >= cache_seqlens[:, None], -1e9)
    p = torch.softmax(scores, -1) * (cache_seqlens > 0)[:, None]                              # empty rows: 0
    return (p[..., None] * k).sum(1)


def forward(model, kv_cache, input_ids, positions, attn_metadata: FlashMLADecodeMetadata, slot_mapping):
    h = model.emb[input_ids] + model.pos_emb[positions]
    concat_and_cache_mla(h @ model.w_kv, kv_cache, slot_mapping)
    attn = flash_mla_with_kvcache(h @ model.w_q, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens)
    return h + attn @ model.w_o


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, DIM, device=device)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(MAX_NUM_REQS, **long)
        self.positions = torch.zeros(MAX_NUM_REQS, **long)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, **long)
        self.slot_mapping = torch.full((MAX_NUM_REQS,), PAD_SLOT_ID, **long)   # BlockTable.slot_mapping.gpu
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, **long)       # BlockTable.block_table.gpu
        self.builder = FlashMLAMetadataBuilder()
        self.graphs = {}
        if graphed:
            self.capture_model()

    def _get_block_table_and_slot_mapping(self, num_tokens, num_tokens_padded, num_reqs, num_reqs_padded):
        blk_table_tensor = self.block_table[:num_reqs_padded]
        slot_mapping = self.slot_mapping[:num_tokens_padded]
        # Fill unused with -1. Needed for reshape_and_cache in full cuda graph mode.
        slot_mapping[num_tokens:num_tokens_padded].fill_(PAD_SLOT_ID)
        if self.variant == "fix":
            # Fill unused block table entries with NULL_BLOCK_ID (null block)
            # for CUDAGraph padding. Block 0 is reserved for padding.
            blk_table_tensor[num_reqs:num_reqs_padded].fill_(NULL_BLOCK_ID)
        else:
            # `blk_table_tensor` -1 to match mamba PAD_SLOT_ID
            blk_table_tensor[num_reqs:num_reqs_padded].fill_(-1)
        return blk_table_tensor, slot_mapping

    def _build_attention_metadata(self, num_tokens, num_tokens_padded, num_reqs, num_reqs_padded):
        blk_table_tensor, slot_mapping = self._get_block_table_and_slot_mapping(
            num_tokens, num_tokens_padded, num_reqs, num_reqs_padded)
        common = {"block_table_tensor": blk_table_tensor, "seq_lens": self.seq_lens[:num_reqs_padded]}
        return self.builder.build(common), slot_mapping

    def _forward_step(self, num_reqs_padded, attn_metadata, slot_mapping):
        return forward(self.model, self.kv_cache, self.input_ids[:num_reqs_padded],
                       self.positions[:num_reqs_padded], attn_metadata, slot_mapping)

    def capture_model(self):
        for size in reversed(CAPTURE_SIZES):
            # _dummy_run: `size` dummy decode requests, all real for the capture (no padded rows)
            self.seq_lens[:size].fill_(1)
            meta, slots = self._build_attention_metadata(size, size, size, size)
            self.graphs[size] = capture(
                lambda size=size, meta=meta, slots=slots: self._forward_step(size, meta, slots),
                device=self.device, name=f"FULL decode {size}", owner="GPUModelRunner (FULL graphs)",
                static={"input_ids": self.input_ids, "positions": self.positions, "seq_lens": self.seq_lens,
                        "slot_mapping": self.slot_mapping, "block_table": self.block_table},
                state={"kv_cache": self.kv_cache})

    def _prepare_inputs(self, scheduled):
        """``scheduled``: per request, (its block ids, the token to decode, its position)."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        ids = [tok for _, tok, _ in scheduled]
        pos = [p for _, _, p in scheduled]
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for blocks, _, p in scheduled]
        rows = [blocks + [NULL_BLOCK_ID] * (MAX_BLOCKS - len(blocks)) for blocks, _, _ in scheduled]
        n = len(scheduled)
        self.input_ids[:n].copy_(t(ids))
        self.positions[:n].copy_(t(pos))
        self.slot_mapping[:n].copy_(t(slots))
        self.block_table[:n].copy_(t(rows))
        self.seq_lens[:n].copy_(t([p + 1 for p in pos]))
        self.seq_lens[n:].fill_(0)
        return n

    def execute_model(self, scheduled):
        num_reqs = self._prepare_inputs(scheduled)
        num_reqs_padded = next(s for s in CAPTURE_SIZES if s >= num_reqs) if self.graphed else num_reqs
        meta, slots = self._build_attention_metadata(num_reqs, num_reqs_padded, num_reqs, num_reqs_padded)
        if not self.graphed:
            return self._forward_step(num_reqs, meta, slots).clone()
        g, out = self.graphs[num_reqs_padded]
        padded = {"input_ids": self.input_ids, "positions": self.positions}   # left as they were
        return replay(g, out, real=num_reqs, size=num_reqs_padded, padded=padded)[:num_reqs].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(3543)
    tok = lambda: int(torch.randint(0, VOCAB, (1,), generator=gen))  # noqa: E731
    A, B, C = [1, 2, 3], [4, 5, 6], [7, 8]                           # block ids per request (0: null block)
    steps = [
        [(A, tok(), 0), (B, tok(), 0)],                             # 2 requests: the size-2 graph, no padding
        [(A, tok(), 1), (B, tok(), 1)],
        [(A, tok(), 2), (B, tok(), 2), (C, tok(), 0)],              # 3 requests in the size-4 graph: 1 padded
        [(A, tok(), 3), (B, tok(), 3), (C, tok(), 1)],
        [(A, tok(), 4), (C, tok(), 2)],                             # B finished: size-2 graph again
    ]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        return [runner.execute_model(s) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
