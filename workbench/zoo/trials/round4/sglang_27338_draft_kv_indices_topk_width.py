"""The EAGLE draft graph's kv_indices rows omit the topk factor: long batches spill into the next row.

Upstream: https://github.com/sgl-project/sglang/pull/27338 ("[Bug] Fix EAGLE draft CUDA-graph
`kv_indices` under-allocation for `topk > 1`"; the draft coredump tracked in #26340).
Symptom: EAGLE speculative decoding with ``speculative_eagle_topk > 1``, the FlashInfer backend and
draft CUDA graphs: once a batch's sequences are long enough, draft tokens go silently wrong (in-vocab,
so only the acceptance rate drops) and intermittently out-of-vocab ids crash the target-verify
embedding gather (sglang main, June 2026); eager draft decode is fine.
Mechanism: ``generate_draft_decode_kv_indices`` packs into row ``i`` of the kv-indices buffer the ``topk``
branches of every sequence (prefix plus ``i + 1`` draft slots), ``seq_lens_sum * topk + num_seqs * topk *
(i + 1)`` entries; the eager path sizes rows ``bs * topk * max_context_len``, but
``FlashInferMultiStepDraftBackend.init_cuda_graph_state`` sized ``cuda_graph_kv_indices`` rows
``max_bs * max_context_len``. Once a replayed batch's sequences are long enough, the kernel writes past
the row into the next step's row (from the last row, past the buffer), and the next row's own entries
land on top. The captured attention of the overflowing step then reads its last branches' entries from
the next step's layout: they attend over wrong KV slots.
Doctor: undersized-buffer, at ``generate_draft_decode_kv_indices`` (the write past the row width).
Fix (upstream): size the CUDA-graph rows like the eager ones, ``max_bs * topk * max_context_len``, and
assert ``seq_lens_sum * topk + bs * num_steps <= row width`` before the kernel launch.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/27338"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "generate_draft_decode_kv_indices"
SYMPTOM = "the last draft branches of a long batch attend over another step's KV slots: wrong drafts"
DIM, VOCAB, TOPK, NUM_STEPS, MAX_BS, MAX_CONTEXT_LEN = 4, 6, 2, 3, 2, 12
POOL_LEN = MAX_CONTEXT_LEN                    # req_to_token row width
NUM_KV_SLOTS = 1 + MAX_BS * POOL_LEN          # slot 0: the dummy slot of padded/capture rows
NEXT_BLOCK = 16                               # the allocation that follows the buffer (read by nothing here)


def kv_indices_ptr(kv_indices: torch.Tensor, row: int) -> torch.Tensor:
    """``kv_indices + row * stride``: the flat pointer the kernels get, valid to the end of the memory
    block the buffer lives in (as a raw CUDA pointer is), not just to the end of the row."""
    n = kv_indices.untyped_storage().nbytes() // kv_indices.element_size()
    offset = kv_indices.storage_offset() + row * kv_indices.stride(0)
    return kv_indices.as_strided((n - offset,), (1,), offset)


def generate_draft_decode_kv_indices(req_pool_indices, req_to_token, paged_kernel_lens, kv_indices, kv_indptr,
                                     positions, pool_len, kv_indices_stride, num_steps, num_seqs, topk):
    """The Triton kernel, program by program (grid ``(num_steps, num_seqs, topk)``, in launch order)."""
    seq_lens = paged_kernel_lens.tolist()
    reqs = req_pool_indices.tolist()
    pos = positions.tolist()
    base = kv_indices_ptr(kv_indices, 0)
    for it in range(num_steps):
        iters = it + 1
        for bid in range(num_seqs):
            seq_len, cum_seq_len = seq_lens[bid], sum(seq_lens[:bid])
            for topk_id in range(topk):
                kv_offset = it * kv_indices_stride + cum_seq_len * topk + bid * iters * topk \
                    + topk_id * (seq_len + iters)
                base[kv_offset: kv_offset + seq_len] = req_to_token[reqs[bid], :seq_len]
                draft = seq_len + topk_id * num_steps
                base[kv_offset + seq_len: kv_offset + seq_len + iters] = req_to_token[reqs[bid], draft: draft + iters]
        n = num_seqs * topk
        kv_indptr[it, : n + 1] = torch.tensor([sum(pos[:z]) + z * iters for z in range(n + 1)])


class FlashInferMultiStepDraftBackend:
    def __init__(self, variant, req_to_token, device):
        self.variant, self.device = variant, device
        self.topk, self.speculative_num_steps = TOPK, NUM_STEPS
        self.max_context_len = MAX_CONTEXT_LEN
        self.req_to_token = req_to_token
        self.kv_indptr = torch.zeros(NUM_STEPS, MAX_BS * TOPK + 1, dtype=torch.int64, device=device)

    def common_template(self, fb, kv_indices_buffer):
        generate_draft_decode_kv_indices(fb["req_pool_indices"], self.req_to_token, fb["seq_lens"],
                                         kv_indices_buffer, self.kv_indptr, fb["positions"], POOL_LEN,
                                         kv_indices_buffer.shape[1], self.speculative_num_steps,
                                         fb["seq_lens"].shape[0], self.topk)
        self.kv_indices = kv_indices_buffer        # backend i plans over row i (its pointer) and kv_indptr[i]

    def init_forward_metadata(self, fb):
        bs = fb["seq_lens"].shape[0]
        kv_indices = torch.empty((self.speculative_num_steps, bs * self.topk * self.max_context_len),
                                 dtype=torch.int64, device=self.device)
        self.common_template(fb, kv_indices)

    def init_cuda_graph_state(self, max_bs):
        width = max_bs * self.max_context_len if self.variant == "bug" else max_bs * self.topk * self.max_context_len
        block = torch.zeros(self.speculative_num_steps * width + NEXT_BLOCK, dtype=torch.int64, device=self.device)
        self.cuda_graph_kv_indices = block[: self.speculative_num_steps * width].view(self.speculative_num_steps,
                                                                                      width)

    def init_forward_metadata_capture_cuda_graph(self, fb):
        self.common_template(fb, self.cuda_graph_kv_indices)

    def init_forward_metadata_replay_cuda_graph(self, fb):
        self.common_template(fb, self.cuda_graph_kv_indices)


class DraftModel:
    def __init__(self, device):
        gen = generator(27338)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wh = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.6)


def paged_decode(q, k_cache, v_cache, kv_indices_row, kv_indptr_row):
    """FlashInfer batch decode: row ``j`` attends over ``kv_indices[indptr[j]:indptr[j + 1]]``."""
    start = kv_indptr_row[:-1]
    lens = kv_indptr_row[1:] - start
    pos = torch.arange(MAX_CONTEXT_LEN, device=q.device)
    past = pos[None, :] >= lens[:, None]                       # lanes the kernel does not load
    idx = (start[:, None] + pos[None, :]).clamp(max=kv_indices_row.shape[0] - 1)
    slots = kv_indices_row[idx].masked_fill(past, 0)
    scores = (q[:, None, :] * k_cache[slots]).sum(-1) / DIM ** 0.5
    scores = scores.masked_fill(past, float("-inf"))
    return (torch.softmax(scores, -1)[..., None] * v_cache[slots]).sum(1)


def draft_forward(model, bufs, kv_cache, backend):
    """The multi-step draft decode the runner captures: ``NUM_STEPS - 1`` attention steps, each over
    row ``i`` of the kv indices (the last row is written by the kernel but unused)."""
    k_cache, v_cache = kv_cache
    h = bufs["hidden_states"]
    logits = []
    for i in range(NUM_STEPS - 1):
        k_cache.index_copy_(0, bufs["out_cache_loc"][:, i], h @ model.wk)
        v_cache.index_copy_(0, bufs["out_cache_loc"][:, i], h @ model.wv)
        o = paged_decode(h @ model.wq, k_cache, v_cache, kv_indices_ptr(backend.kv_indices, i), backend.kv_indptr[i])
        logits.append(o @ model.lm_head)
        h = torch.tanh(o @ model.wh + h)
    return torch.stack(logits)


def make_req_to_token(device):
    table = torch.zeros(MAX_BS + 1, POOL_LEN, dtype=torch.int64, device=device)     # req 0: the dummy
    for r in range(1, MAX_BS + 1):
        table[r] = 1 + (r - 1) * POOL_LEN + torch.arange(POOL_LEN, device=device)
    return table


def rounds(device):
    """Two draft rounds of the same two requests (req pool indices 1, 2): prefixes of 2 and 3 tokens
    (rows fit either way), then of 4 and 5 (a draft row needs 26 > 24 entries)."""
    gen = generator(2)
    table = make_req_to_token(device)
    out = []
    for lens in ([2, 3], [4, 5]):
        reqs = torch.tensor([1, 2], device=device)
        seq_lens = torch.tensor(lens, device=device)
        positions = seq_lens.repeat_interleave(TOPK)
        loc = torch.stack([table[r, s + t * NUM_STEPS + torch.arange(NUM_STEPS, device=device)]
                           for r, s in zip(reqs.tolist(), lens) for t in range(TOPK)])
        out.append({"req_pool_indices": reqs, "seq_lens": seq_lens, "positions": positions,
                    "out_cache_loc": loc, "hidden_states": randn(MAX_BS * TOPK, DIM, gen=gen, device=device)})
    return out


def write_prefix_kv(model, kv_cache, table, fb):
    """Target prefill/verify wrote the prefix tokens' KV (token ids stand in for the real ones)."""
    for r, s in zip(fb["req_pool_indices"].tolist(), fb["seq_lens"].tolist()):
        slots = table[r, :s]
        tokens = (torch.arange(s, device=slots.device) * 2 + r) % VOCAB
        kv_cache[0][slots] = model.emb[tokens] @ model.wk
        kv_cache[1][slots] = model.emb[tokens] @ model.wv


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device)
    batches = rounds(device)

    def new_kv():
        return (torch.zeros(NUM_KV_SLOTS, DIM, device=device), torch.zeros(NUM_KV_SLOTS, DIM, device=device))

    def eager():
        table = make_req_to_token(device)
        kv_cache = new_kv()
        backend = FlashInferMultiStepDraftBackend(variant, table, device)
        outs = []
        for fb in batches:
            write_prefix_kv(model, kv_cache, table, fb)
            backend.init_forward_metadata(fb)
            outs.append(draft_forward(model, fb, kv_cache, backend))
        return outs

    def served():
        table = make_req_to_token(device)
        kv_cache = new_kv()
        backend = FlashInferMultiStepDraftBackend(variant, table, device)
        backend.init_cuda_graph_state(MAX_BS)
        n = MAX_BS * TOPK
        bufs = {"req_pool_indices": torch.zeros(MAX_BS, dtype=torch.int64, device=device),
                "seq_lens": torch.ones(MAX_BS, dtype=torch.int64, device=device),     # seq_len_fill_value
                "positions": torch.zeros(n, dtype=torch.int64, device=device),
                "out_cache_loc": torch.zeros(n, NUM_STEPS, dtype=torch.int64, device=device),
                "hidden_states": torch.zeros(n, DIM, device=device)}
        # EAGLEDraftCudaGraphRunner.capture_one_batch_size: capture metadata, then warmups and capture
        backend.init_forward_metadata_capture_cuda_graph(bufs)
        g, out = capture(lambda: draft_forward(model, bufs, kv_cache, backend), device=device, warmups=2,
                         static=dict(bufs, kv_indptr=backend.kv_indptr, kv_indices=backend.cuda_graph_kv_indices),
                         state={"k_cache": kv_cache[0], "v_cache": kv_cache[1]},
                         owner="EAGLEDraftCudaGraphRunner")
        outs = []
        for fb in batches:
            write_prefix_kv(model, kv_cache, table, fb)
            for name, buf in bufs.items():                         # replay: copy the batch in (bs == max_bs)
                buf.copy_(fb[name])
            backend.init_forward_metadata_replay_cuda_graph(bufs)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
