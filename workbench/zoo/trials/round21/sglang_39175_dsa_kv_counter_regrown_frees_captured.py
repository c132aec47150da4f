"""An eager prefill chunk regrows the DSA multi-CTA KV counter and frees the buffer the decode graphs captured.

Upstream: https://github.com/sgl-project/sglang/pull/39175 ("[Fix] Don't free the multi-CTAs KV counter the
decode graphs captured").
Symptom: GLM-5.3-Flash (DeepSeek sparse attention, trtllm-gen sparse MLA decode) with decode CUDA graphs: after
the first prefill chunk with more than ``TRTLLM_MLA_MAX_BATCH_SIZE`` (8192) query rows, every later decode replay
runs the kernel's multi-CTA semaphores through freed storage; latent (stale writes into memory nothing owns) and,
once the allocator hands the block on, silent corruption, a hang or an illegal memory access inside the
``fmhaSm100fKernel...DynamicTokenSparse`` kernel (reported with logging on 4x GB300, September 2026).
Mechanism: ``DeepseekSparseAttnBackend`` owns ``_multi_ctas_kv_counter_buffer``, made by
``make_persistent_multi_ctas_kv_counter_buffer`` for ``max(TRTLLM_MLA_MAX_BATCH_SIZE, max_running_requests)``
rows and passed to ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` as ``multi_ctas_kv_counter_buffer``
(the CTAs that split one row's KV meet at these counters; the last one merges the partials and resets them).
The decode graphs captured its address. ``_forward_trtllm`` does
``self._multi_ctas_kv_counter_buffer = grow_multi_ctas_kv_counter_buffer_if_needed(...)`` with
``batch_size = page_table_1.shape[0]``, the number of *query rows*, not requests: an eager prefill chunk of more
rows than the buffer covers makes ``grow_..._if_needed`` return a new ``torch.zeros`` tensor, and the assignment
drops the only reference to the captured one. Replays never re-run that Python, so they keep the freed address.
Doctor: dangling-reference, at ``_forward_trtllm`` (its rebinding assignment releases the counter buffer the
captured decode graph still reads and writes).
Fix (upstream): ``_forward_trtllm`` no longer replaces the backend's counter buffer that the graphs captured; a
larger counter needed by one eager launch does not free it. (I read the PR's motivation, the quoted line and the
stored versions of ``grow_multi_ctas_kv_counter_buffer_if_needed`` / ``make_persistent_...``; the fix diff itself
was not visible to me, so the fix is modelled as the grown buffer serving that launch only.)
(Tiny sizes: ``TRTLLM_MLA_MAX_BATCH_SIZE`` 8 rows, two heads, top-k 4, one decode graph for batch size 2.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/39175"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_forward_trtllm"
SYMPTOM = "decode replays after a >8192-row prefill chunk drive the MLA kernel's semaphores through freed memory"

VOCAB, NUM_Q_HEADS, HEAD_DIM, TOPK, NUM_SLOTS = 16, 2, 4, 4, 48
TRTLLM_MLA_MAX_BATCH_SIZE = 8          # rows the persistent counter covers at least
MAX_RUNNING_REQUESTS = 2
CAPTURE_BS = 2                         # the one decode graph


def _multi_ctas_kv_counter_bytes(num_q_heads: int, batch_size: int) -> int:
    return batch_size * num_q_heads    # one semaphore per (query row, head)


def make_persistent_multi_ctas_kv_counter_buffer(device, num_q_heads: int, max_batch_size: int) -> torch.Tensor:
    num = _multi_ctas_kv_counter_bytes(num_q_heads, max(TRTLLM_MLA_MAX_BATCH_SIZE, max_batch_size))
    return torch.zeros(num, dtype=torch.int32, device=device)


def grow_multi_ctas_kv_counter_buffer_if_needed(buffer, device, num_q_heads: int, batch_size: int) -> torch.Tensor:
    required = _multi_ctas_kv_counter_bytes(num_q_heads, batch_size)
    if buffer.numel() >= required:
        return buffer
    return torch.zeros(required, dtype=torch.int32, device=device)


def trtllm_batch_decode_with_kv_cache_mla(query, kv_cache, block_tables, multi_ctas_kv_counter_buffer):
    """Sparse MLA over each row's ``TOPK`` selected KV slots, split over two CTAs per (row, head). Each CTA
    arrives at the row's semaphore; the one that arrives second merges both partials. The kernel resets its
    semaphores at the end of every launch, so zero-at-allocation is all a caller owes it."""
    rows = query.shape[0]
    k = kv_cache[block_tables]                                             # [rows, TOPK, D]
    scores = torch.einsum("rhd,rkd->rhk", query, k) * HEAD_DIM ** -0.5
    half = TOPK // 2
    parts = []
    for lo in (0, half):                                                   # one CTA per half of the keys
        s = scores[..., lo:lo + half]
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        parts.append((m, p.sum(-1, keepdim=True), torch.einsum("rhk,rkd->rhd", p, k[:, lo:lo + half])))
    counter = multi_ctas_kv_counter_buffer[: rows * NUM_Q_HEADS].view(rows, NUM_Q_HEADS)
    second = (counter == 0)[..., None]         # at a clean semaphore CTA 1 arrives second and merges
    counter.add_(2)                                                        # both CTAs arrive
    m = torch.maximum(parts[0][0], parts[1][0])
    w0, w1 = torch.exp(parts[0][0] - m), torch.exp(parts[1][0] - m)
    merged = (parts[0][2] * w0 + parts[1][2] * w1) / (parts[0][1] * w0 + parts[1][1] * w1)
    alone = parts[1][2] / parts[1][1]
    counter.zero_()                                                        # self-reset for the next launch
    return torch.where(second, merged, alone)


class DeepseekSparseAttnBackend:
    def __init__(self, device, variant):
        self.device, self.variant, self.num_q_heads = device, variant, NUM_Q_HEADS
        self._multi_ctas_kv_counter_buffer = make_persistent_multi_ctas_kv_counter_buffer(
            device, NUM_Q_HEADS, max_batch_size=MAX_RUNNING_REQUESTS)

    def _forward_trtllm(self, q, kv_cache, page_table_1):
        batch_size = page_table_1.shape[0]                 # query rows, not requests
        if self.variant == "bug":
            self._multi_ctas_kv_counter_buffer = grow_multi_ctas_kv_counter_buffer_if_needed(
                self._multi_ctas_kv_counter_buffer, self.device, self.num_q_heads, batch_size)
            counter = self._multi_ctas_kv_counter_buffer
        else:
            # A larger counter serves this launch; the buffer the decode graphs captured stays owned.
            counter = grow_multi_ctas_kv_counter_buffer_if_needed(
                self._multi_ctas_kv_counter_buffer, self.device, self.num_q_heads, batch_size)
        return trtllm_batch_decode_with_kv_cache_mla(q, kv_cache, page_table_1, counter)


class Model:
    def __init__(self, device):
        gen = generator(39175)
        self.emb = randn(VOCAB, HEAD_DIM, gen=gen, device=device)
        self.wkv = randn(HEAD_DIM, HEAD_DIM, gen=gen, device=device, scale=0.7)
        self.wq = randn(HEAD_DIM, NUM_Q_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(NUM_Q_HEADS * HEAD_DIM, HEAD_DIM, gen=gen, device=device, scale=0.5)


def forward(model, backend, kv_cache, input_ids, out_cache_loc, page_table_1):
    """One layer: write each token's latent KV (``set_mla_kv_buffer``), then sparse MLA over the indexer's
    top-k slots of its request (``page_table_1``, one row per query token)."""
    h = model.emb[input_ids]
    kv_cache[out_cache_loc] = h @ model.wkv
    q = (h @ model.wq).view(-1, NUM_Q_HEADS, HEAD_DIM)
    return backend._forward_trtllm(q, kv_cache, page_table_1).reshape(q.shape[0], -1) @ model.wo


def _topk_slots(slots, upto):
    """The indexer's selection for a token at position ``upto``: the latest ``TOPK`` slots it may see."""
    seen = slots[: upto + 1]
    return [seen[max(0, len(seen) - TOPK + i)] for i in range(TOPK)]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    slots = {"A": list(range(0, 10)), "B": list(range(10, 20)), "C": list(range(20, 40))}
    tok = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731

    def rows(entries):
        """(request, position, token) per query row -> input_ids, out_cache_loc, page_table_1."""
        return (tok([t for _, _, t in entries]), tok([slots[r][p] for r, p, _ in entries]),
                tok([_topk_slots(slots[r], p) for r, p, _ in entries]))

    prefill_ab = [("A", p, (3 * p + 1) % VOCAB) for p in range(4)] + [("B", p, (5 * p + 2) % VOCAB) for p in range(4)]
    prefill_c = [("C", p, (7 * p + 3) % VOCAB) for p in range(12)]      # 12 query rows > 8: the counter grows
    steps = [("prefill", prefill_ab), ("decode", [("A", 4, 9), ("B", 4, 11)]), ("prefill", prefill_c),
             ("decode", [("A", 5, 6), ("C", 12, 13)]), ("decode", [("B", 5, 2), ("C", 13, 4)])]

    def serve(graphed: bool):
        backend = DeepseekSparseAttnBackend(device, variant)
        kv_cache = torch.zeros(NUM_SLOTS, HEAD_DIM, device=device)
        if graphed:                                        # CudaGraphRunner: static decode inputs, one graph
            input_ids = torch.zeros(CAPTURE_BS, dtype=torch.long, device=device)
            out_cache_loc = torch.full((CAPTURE_BS,), NUM_SLOTS - 1, dtype=torch.long, device=device)
            page_table = torch.full((CAPTURE_BS, TOPK), NUM_SLOTS - 1, dtype=torch.long, device=device)
            graph, out = capture(
                lambda: forward(model, backend, kv_cache, input_ids, out_cache_loc, page_table),
                device=device, owner="CudaGraphRunner (decode)", name=f"decode bs {CAPTURE_BS}",
                static={"input_ids": input_ids, "out_cache_loc": out_cache_loc, "page_table_1": page_table},
                state={"kv_cache": kv_cache, "multi_ctas_kv_counter_buffer": backend._multi_ctas_kv_counter_buffer})
        outs = []
        for mode, entries in steps:
            ids, locs, table = rows(entries)
            if mode == "decode" and graphed:
                input_ids.copy_(ids)
                out_cache_loc.copy_(locs)
                page_table.copy_(table)
                outs.append(replay(graph, out).clone())
            else:                                          # prefill chunks always run eagerly
                outs.append(forward(model, backend, kv_cache, ids, locs, table).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
