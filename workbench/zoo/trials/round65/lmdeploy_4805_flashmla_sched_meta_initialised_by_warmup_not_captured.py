"""The warmup initialises FlashMLA 1.x's lazy scheduler object: the graph records no scheduler, replays keep its plan.

Upstream: https://github.com/InternLM/lmdeploy/pull/4805 ("refactor(pytorch): derive CUDA step metadata from selected
operators"; the fix is its commit e2d5b8d80 "fix(pytorch): handle lazy FlashMLA metadata in CUDA graphs").
Symptom: DeepSeek (MLA) models on FlashMLA 1.x with CUDA graphs decode from a tile schedule planned for the engine
warmup's dummy batch (kv_seqlens = 1): KV blocks past the first are never attended, so output degrades into
garbage once contexts grow; eager mode (a fresh scheduler per step) is correct. No report in the PR; inferred.
Mechanism: ``make_buffers_cudagraph`` stores ``input_buffers['tile_scheduler_metadata'], input_buffers['num_splits'] =
flash_mla.get_mla_metadata(...)``. FlashMLA 1.x returns a ``FlashMLASchedMeta`` object and ``None``: the object is
empty and ``flash_mla_with_kvcache`` launches the scheduler kernel (from ``cache_seqlens``) only the first time it
sees it uninitialised. ``fill_buffers_cudagraph`` refreshes the scheduler only ``if isinstance(scheduler_buffer,
torch.Tensor)`` (the 0.x API) and otherwise passes the same object through. ``CUDASingleGraphRunner.capture`` runs
an eager warmup forward first (on ``make_dummy_inputs``: kv_seqlens 1, the dummy block 0), which initialises the
object; the capture forward then finds it initialised and records only the attention kernel. Replays read the
graph's ``kv_seqlens`` buffer but partition the work by the warmup's plan (one block per request), so the newest
tokens' KV is dropped. Miniature: one MLA layer over a paged latent cache (block 2), the plan is
``ceil(kv_seqlen / BLOCK)`` blocks per request.
Doctor: warmup-divergence, at capture (the warmup forward made the lazy scheduler plan on the object the capture
reuses, so the scheduler kernel is not in the graph and replays keep the dummy batch's plan).
Fix (upstream): ``FlashMLAAttentionMetadata`` gets ``scheduler_depends_on_step`` (dense path: ``index_topk is
None``); new ``prepare_cudagraph_capture`` hook, called by ``CUDASingleGraphRunner.capture`` after the warmup and
right before ``torch.cuda.CUDAGraph()``, swaps in a fresh ``flash_mla.get_mla_metadata()`` object, so the scheduler
kernel is recorded and re-runs on every replay from the graph's ``kv_seqlens``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/4805"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "capture"
SYMPTOM = "MLA decode graphs keep the warmup dummy batch's FlashMLA tile schedule: KV blocks past the first are skipped"

VOCAB, DIM = 12, 4
BLOCK, MAX_BLOCKS, NUM_BLOCKS = 2, 4, 9        # block 0: the dummy block warmup inputs point at
BATCH = 2
PROMPTS = ([3, 7, 1, 9], [5, 2, 8])
BLOCK_OFFSETS = [[1, 2, 3, 4], [5, 6, 7, 8]]
DECODE_STEPS = 4


# ---- FlashMLA 1.x in miniature ----
class FlashMLASchedMeta:
    """The lazily initialised scheduler state: empty until the first decode kernel call plans it."""

    def __init__(self):
        self.have_initialized = False
        self.tile_scheduler_metadata = None
        self.num_splits = None


def get_mla_metadata(*args, **kwargs):
    """FlashMLA 1.x: returns an empty scheduler object and ``num_splits=None`` (arguments ignored)."""
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits):
    sched = tile_scheduler_metadata
    if not sched.have_initialized:                 # the scheduler kernel: partition KV blocks per request
        sched.tile_scheduler_metadata = (cache_seqlens + BLOCK - 1) // BLOCK
        sched.num_splits = torch.cumsum(sched.tile_scheduler_metadata, 0)
        sched.have_initialized = True
    kv = k_cache[block_table.long()].reshape(q.shape[0], MAX_BLOCKS * BLOCK, DIM)
    cols = torch.arange(MAX_BLOCKS * BLOCK, device=q.device)
    scheduled = cols[None, :] < sched.tile_scheduler_metadata[:, None] * BLOCK
    visible = scheduled & (cols[None, :] < cache_seqlens[:, None])
    scores = torch.einsum("bd,btd->bt", q, kv).masked_fill(~visible, -1e9)
    return torch.einsum("bt,btd->bd", torch.softmax(scores, -1), kv)


@dataclasses.dataclass
class FlashMLAAttentionMetadata:
    block_offsets: torch.Tensor
    kv_seqlens: torch.Tensor
    tile_scheduler_metadata: Any = None            # FlashMLA 1.x: a FlashMLASchedMeta object
    num_splits: torch.Tensor | None = None
    scheduler_depends_on_step: bool = True         # dense decode (index_topk is None) reads kv_seqlens


def update_meta_flashmla(attn_metadata):
    """Eager steps: a fresh scheduler object per step, planned from this step's kv_seqlens."""
    attn_metadata.tile_scheduler_metadata, attn_metadata.num_splits = get_mla_metadata(
        attn_metadata.kv_seqlens.to(torch.int32), 1, num_heads_k=1)
    return attn_metadata


class DeepseekV2ForCausalLM:
    """One MLA decode layer over a paged latent cache, with the CudaGraphMixin buffer hooks."""

    def __init__(self, device):
        gen = generator(4805)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.q_proj, self.kv_a_proj, self.o_proj = (randn(DIM, DIM, gen=gen, device=device, scale=0.8)
                                                    for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def __call__(self, input_ids, position_ids, past_key_values, attn_metadata):
        x = self.embed_tokens[input_ids[0]]
        pos = position_ids[0]
        rows = torch.arange(pos.shape[0], device=x.device)
        slots = attn_metadata.block_offsets[rows, pos // BLOCK].long() * BLOCK + pos % BLOCK
        past_key_values.view(-1, DIM).index_copy_(0, slots, x @ self.kv_a_proj)
        attn = flash_mla_with_kvcache(x @ self.q_proj, past_key_values, attn_metadata.block_offsets,
                                      attn_metadata.kv_seqlens, attn_metadata.tile_scheduler_metadata,
                                      attn_metadata.num_splits)
        return (x + attn @ self.o_proj) @ self.lm_head

    def make_buffers_cudagraph(self, device):
        input_buffers = {"input_ids": torch.zeros(1, BATCH, dtype=torch.int64, device=device),
                         "position_ids": torch.zeros(1, BATCH, dtype=torch.int64, device=device),
                         "block_offsets": torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.int32, device=device),
                         "kv_seqlens": torch.zeros(BATCH, dtype=torch.int32, device=device)}
        # create buffers for flash mla (1.x: an empty FlashMLASchedMeta and None)
        input_buffers["tile_scheduler_metadata"], input_buffers["num_splits"] = get_mla_metadata(
            torch.ones(BATCH, dtype=torch.int32, device=device), 1, num_heads_k=1)
        return input_buffers

    def fill_buffers_cudagraph(self, input_buffers, input_ids, position_ids, attn_metadata):
        input_buffers["input_ids"].copy_(input_ids)
        input_buffers["position_ids"].copy_(position_ids)
        input_buffers["block_offsets"].zero_()
        input_buffers["block_offsets"][:, :attn_metadata.block_offsets.shape[1]] = attn_metadata.block_offsets
        input_buffers["kv_seqlens"].copy_(attn_metadata.kv_seqlens)
        scheduler_buffer = input_buffers["tile_scheduler_metadata"]
        # only the 0.x tensor API is refreshed here; the 1.x object is passed through as is
        meta = FlashMLAAttentionMetadata(input_buffers["block_offsets"], input_buffers["kv_seqlens"],
                                         scheduler_buffer, input_buffers["num_splits"])
        return dict(input_ids=input_buffers["input_ids"], position_ids=input_buffers["position_ids"],
                    attn_metadata=meta)


def prepare_cudagraph_capture(input_buffers, attn_metadata):
    """(fix) After warmup, before capture: a lazy scheduler that depends on the step is replaced by a fresh one."""
    scheduler = input_buffers["tile_scheduler_metadata"]
    if isinstance(scheduler, torch.Tensor) or not attn_metadata.scheduler_depends_on_step:
        return
    scheduler, num_splits = get_mla_metadata()
    input_buffers["tile_scheduler_metadata"], input_buffers["num_splits"] = scheduler, num_splits
    attn_metadata.tile_scheduler_metadata, attn_metadata.num_splits = scheduler, num_splits


class CUDASingleGraphRunner:
    def __init__(self, model, device, past_key_values, variant):
        self.model, self.device, self.past_key_values, self.variant = model, device, past_key_values, variant
        self.pool = graph_pool_handle(device)
        self._graph, self.output_buffers, self.input_buffers = None, None, None

    def capture(self, input_ids, position_ids, attn_metadata):
        self.input_buffers = self.model.make_buffers_cudagraph(self.device)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.input_buffers, input_ids, position_ids, attn_metadata)
        events.static_buffers("CudaGraphMeta.input_buffers",
                              {k: v for k, v in self.input_buffers.items() if isinstance(v, torch.Tensor)})
        events.persistent_state("past_key_values", {"kv_cache": self.past_key_values})
        with events.warmup():                       # warmup: FlashMLA 1.x plans its scheduler object here
            self.model(past_key_values=self.past_key_values, **padded_kwargs)
        if self.variant == "fix":
            prepare_cudagraph_capture(self.input_buffers, padded_kwargs["attn_metadata"])
        self._graph = new_graph(self.device)
        with graph(self._graph, self.pool, name=f"decode batch={BATCH}"):
            self.output_buffers = self.model(past_key_values=self.past_key_values, **padded_kwargs)

    def forward(self, input_ids, position_ids, attn_metadata):
        self.model.fill_buffers_cudagraph(self.input_buffers, input_ids, position_ids, attn_metadata)
        return replay(self._graph, self.output_buffers)


def run(variant: str, device: str = "cpu"):
    model = DeepseekV2ForCausalLM(device)
    block_offsets = torch.tensor(BLOCK_OFFSETS, dtype=torch.int32, device=device)

    def slot(req, pos):
        return BLOCK_OFFSETS[req][pos // BLOCK] * BLOCK + pos % BLOCK

    def serve(graphed: bool):
        kv_cache = torch.zeros(NUM_BLOCKS, BLOCK, DIM, device=device)
        runner = CUDASingleGraphRunner(model, device, kv_cache, variant)
        if graphed:                                 # engine warmup: capture on make_dummy_inputs
            runner.capture(torch.zeros(1, BATCH, dtype=torch.int64, device=device),
                           torch.zeros(1, BATCH, dtype=torch.int64, device=device),
                           FlashMLAAttentionMetadata(torch.zeros(BATCH, 1, dtype=torch.int32, device=device),
                                                     torch.ones(BATCH, dtype=torch.int32, device=device)))
        for r, p in enumerate(PROMPTS):             # eager prefill of the prompts' latent KV
            ids = torch.tensor(p[:-1], device=device)
            slots = torch.tensor([slot(r, i) for i in range(len(p) - 1)], device=device)
            kv_cache.view(-1, DIM).index_copy_(0, slots, model.embed_tokens[ids] @ model.kv_a_proj)
        tokens, lens, outs = [p[-1] for p in PROMPTS], [len(p) for p in PROMPTS], []
        for _ in range(DECODE_STEPS):
            input_ids = torch.tensor([tokens], device=device)
            position_ids = torch.tensor([[n - 1 for n in lens]], device=device)
            meta = FlashMLAAttentionMetadata(block_offsets, torch.tensor(lens, dtype=torch.int32, device=device))
            if graphed:
                logits = runner.forward(input_ids, position_ids, meta).clone()
            else:
                logits = model(input_ids, position_ids, kv_cache, update_meta_flashmla(meta))
            outs.append(logits)
            tokens, lens = logits.argmax(-1).tolist(), [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
