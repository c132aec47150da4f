"""FA3 spec-decode graphs plan the split scheduler for the runtime KV length, while the kernel splits the padded page table's length.

Upstream: https://github.com/InternLM/lmdeploy/pull/4591 ("fix: enable FA3 for SM80+ GPUs and fix CUDA version
comparison", merged; commit e3b35ac21, second part "fix(attention): align max_seqlen_k with FA3 internal
seqlen_k computation").
Symptom: the PR description: "The scheduler metadata buffer must be sized to match, otherwise buffer size
mismatches cause incorrect results" (FA3 decoding for speculative decoding, CUDA graphs on).
Mechanism: FA3's ``mha_fwd`` derives ``seqlen_k = page_table.size(1) * page_size`` for paged KV without
``cu_seqlens_k``; ``get_scheduler_metadata`` must be given the same ``max_seqlen_k`` to describe the same
split layout. Under CUDA graphs ``CudaGraphMixin.make_buffers_cudagraph`` allocates ``block_offsets`` as
``[max_batchs, num_blocks]`` and the static ``scheduler_metadata`` (planned with ``max_seqlen_k=decode_query_len``);
each step ``fill_buffers_cudagraph`` re-plans with ``max_seqlen_k=attn_metadata.max_kv_seqlen`` (the runtime KV
length) and copies it into the buffer, but the captured kernel reads the padded ``block_offsets`` buffer, so its
``seqlen_k`` is ``num_blocks * block_size``. The plan says how many splits each sequence needs for a short
``seqlen_k`` (one); the kernel cuts its far longer ``seqlen_k`` into wider splits and runs only as many as the
plan says, so the keys past the first split are never attended. Eager stays consistent: its ``block_offsets``
is as wide as the longest sequence. The FA3 split heuristic and the per-sequence dynamic split count are
modelled in a few lines (``get_num_splits``, ``num_splits_dynamic``); the real kernel's layout differs in detail.
Doctor: padded-shape-mismatch, at fill_buffers_cudagraph (metadata planned for the real KV length, used by a
kernel sized by the padded page table).
Fix (upstream): both ``CudaGraphMixin`` paths pass ``max_seqlen_k = graph_meta.num_blocks * graph_meta.block_size``
and eager ``update_meta_flashattn`` passes ``block_offsets.size(1) * block_size``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/4591"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "fill_buffers_cudagraph"
SYMPTOM = "FA3 decode under CUDA graphs attends only the first KV split of each sequence: wrong attention output"

DIM, BLOCK_SIZE, NUM_PAGES = 4, 4, 12
NUM_BLOCKS = 8                 # graph_meta.num_blocks: block_offsets columns of the graph buffers
MAX_BATCHS = 2                 # the captured batch (real == padded here)
DECODE_QUERY_LEN = 1
K_BLOCK_N = 4                  # FA3's kBlockN (keys per n-block)
MAX_SPLITS = 4


def _cdiv(a, b):
    return -(-a // b)


def get_num_splits(seqlen_k: int) -> int:
    """FA3's host heuristic (modelled): no split for a handful of n-blocks, else up to MAX_SPLITS."""
    n_blocks = _cdiv(seqlen_k, K_BLOCK_N)
    return 1 if n_blocks <= 4 else min(n_blocks // 2, MAX_SPLITS)


def _get_meta_flashattn(batch_size, max_seqlen_q, max_seqlen_k, cache_seqlens):
    """``get_scheduler_metadata``: per sequence, how many of the ``num_splits`` splits hold its keys."""
    num_splits = get_num_splits(max_seqlen_k)
    blocks_per_split = _cdiv(_cdiv(max_seqlen_k, K_BLOCK_N), num_splits)
    n_blocks = (cache_seqlens[:batch_size] + K_BLOCK_N - 1) // K_BLOCK_N
    num_splits_dynamic = ((n_blocks + blocks_per_split - 1) // blocks_per_split).clamp(1, num_splits)
    return num_splits_dynamic.to(torch.int32)


def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, scheduler_metadata):
    """FA3 decode: ``seqlen_k = page_table.size(1) * page_size``; the kernel cuts it into its own
    ``num_splits`` splits and runs, per sequence, the number of splits the scheduler metadata gives."""
    seqlen_k = page_table.shape[1] * BLOCK_SIZE
    split_len = _cdiv(_cdiv(seqlen_k, K_BLOCK_N), get_num_splits(seqlen_k)) * K_BLOCK_N
    b = q.shape[0]
    k = k_cache[page_table].reshape(b, seqlen_k, DIM)
    v = v_cache[page_table].reshape(b, seqlen_k, DIM)
    pos = torch.arange(seqlen_k, device=q.device)
    valid = (pos[None, :] < cache_seqlens[:, None]) & (pos[None, :] // split_len < scheduler_metadata[:, None])
    scores = (k @ q[:, :, None]).squeeze(-1).masked_fill(~valid, float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * v).sum(1)


class Model:
    def __init__(self, device):
        gen = generator(4591)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.k_cache = randn(NUM_PAGES, BLOCK_SIZE, DIM, gen=gen, device=device)
        self.v_cache = randn(NUM_PAGES, BLOCK_SIZE, DIM, gen=gen, device=device)

    def forward(self, hidden, block_offsets, kv_seqlens, scheduler_metadata):
        q = hidden @ self.wq
        return flash_attn_with_kvcache(q, self.k_cache, self.v_cache, block_offsets, kv_seqlens, scheduler_metadata)


class CudaOpsBackend:
    @staticmethod
    def update_meta_flashattn(variant, block_offsets, kv_seqlens, max_kv_seqlen):
        """Eager: the step's ``block_offsets`` is as wide as its longest sequence needs."""
        max_seqlen_k = block_offsets.size(1) * BLOCK_SIZE if variant == "fix" else max_kv_seqlen
        return _get_meta_flashattn(kv_seqlens.size(0), DECODE_QUERY_LEN, max_seqlen_k, kv_seqlens)


class CudaGraphMixin:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant

    def make_buffers_cudagraph(self):
        dev = self.device
        self.input_buffers = {
            "hidden": torch.zeros(MAX_BATCHS, DIM, device=dev),
            "block_offsets": torch.zeros(MAX_BATCHS, NUM_BLOCKS, dtype=torch.long, device=dev),
            "kv_seqlens": torch.ones(MAX_BATCHS, dtype=torch.long, device=dev),
        }
        max_seqlen_k = NUM_BLOCKS * BLOCK_SIZE if self.variant == "fix" else DECODE_QUERY_LEN
        self.input_buffers["scheduler_metadata"] = _get_meta_flashattn(
            MAX_BATCHS, DECODE_QUERY_LEN, max_seqlen_k, self.input_buffers["kv_seqlens"])

    def fill_buffers_cudagraph(self, hidden, block_offsets, kv_seqlens, max_kv_seqlen):
        buf = self.input_buffers
        n, width = block_offsets.shape
        buf["hidden"][:n].copy_(hidden)
        buf["block_offsets"][:n, :width].copy_(block_offsets)
        buf["block_offsets"][:, width:].fill_(0)
        buf["kv_seqlens"][:n].copy_(kv_seqlens)
        if self.variant == "fix":
            # must match the (padded) block_offsets buffer the captured kernel reads
            max_seqlen_k = NUM_BLOCKS * BLOCK_SIZE
        else:
            max_seqlen_k = max_kv_seqlen
        scheduler_metadata = _get_meta_flashattn(n, DECODE_QUERY_LEN, max_seqlen_k, buf["kv_seqlens"])
        num_meta = scheduler_metadata.size(0)
        buf["scheduler_metadata"][:num_meta] = scheduler_metadata
        buf["scheduler_metadata"][num_meta:] = 0


class CUDAGraphRunner(CudaGraphMixin):
    def __init__(self, model, device, variant):
        super().__init__(model, device, variant)
        self.make_buffers_cudagraph()
        b = self.input_buffers
        self.graph, self.out = capture(
            lambda: self.model.forward(b["hidden"], b["block_offsets"], b["kv_seqlens"], b["scheduler_metadata"]),
            device=device, owner="CUDAGraphRunner (FA3 spec decode)", static=dict(b))

    def __call__(self, hidden, block_offsets, kv_seqlens, max_kv_seqlen):
        self.fill_buffers_cudagraph(hidden, block_offsets, kv_seqlens, max_kv_seqlen)
        width = block_offsets.shape[1]
        out = replay(self.graph, self.out,
                     padded_columns={"block_offsets": (self.input_buffers["block_offsets"], width)})
        return out[:hidden.shape[0]].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(45910)
    # (kv lengths, pages per sequence); the longest sequence fills whole blocks, so that eager's
    # max_kv_seqlen equals block_offsets.size(1) * block_size in both variants
    steps = [([8, 5], [[1, 2], [3, 4]]),
             ([12, 7], [[1, 2, 5], [3, 4, 0]]),
             ([16, 9], [[1, 2, 5, 6], [3, 4, 7, 0]]),
             ([20, 10], [[1, 2, 5, 6, 8], [3, 4, 7, 0, 0]])]
    hiddens = [randn(MAX_BATCHS, DIM, gen=gen, device=device) for _ in steps]

    def tensors(lens, pages):
        return (torch.tensor(pages, dtype=torch.long).to(device), torch.tensor(lens, dtype=torch.long).to(device))

    def served():
        runner = CUDAGraphRunner(model, device, variant)
        outs = []
        for (lens, pages), h in zip(steps, hiddens):
            block_offsets, kv_seqlens = tensors(lens, pages)
            outs.append(runner(h, block_offsets, kv_seqlens, max(lens)))
        return outs

    def eager():
        outs = []
        for (lens, pages), h in zip(steps, hiddens):
            block_offsets, kv_seqlens = tensors(lens, pages)
            meta = CudaOpsBackend.update_meta_flashattn(variant, block_offsets, kv_seqlens, max(lens))
            outs.append(model.forward(h, block_offsets, kv_seqlens, meta).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
