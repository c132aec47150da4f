"""DP-padded rows of the draft-extend graph carry seq_len 1; their expanded top-k lengths go negative.

Upstream: https://github.com/sgl-project/sglang/pull/30378 ("[DSA] Re-enable fused top-k v2 for MTP: clamp
padded-row seq_lens to >= 0"; follow-up to #30274, cherry-picked as #30427).
Symptom: GLM-5.2 (DSA sparse attention) with MTP speculative decoding and DP attention dies with
``CUDBG_EXCEPTION_WARP_ILLEGAL_ADDRESS`` in ``topk_small_batch_kernel`` while replaying the draft-extend
CUDA graph (sglang main, July 2026); TP-only MTP and eager runs are fine.
Mechanism: under DP attention a rank with fewer requests replays the graph of the DP-wide batch size, and
its padded ("idle companion") rows get the graph's ``seq_len_fill_value`` of 1, smaller than the
``qo_len`` of a draft-extend row (the number of draft tokens). The DSA metadata expands each row's
sequence length into one visible KV length per query token, ``kv - qo + 1 + i``, so those rows get
negative lengths. The fused top-k v2 kernel reads lengths as ``uint32_t``: ``-1`` becomes ~4.29e9
tokens, the row is sent down the selection path over the whole graph score buffer, and the kernel
addresses far past it (illegal address).
Doctor: stale-padding, at ``seqlens_expand_triton`` (the expansion that turns the padded rows' fill
value into negative lengths the captured top-k reads).
Fix (upstream): metadata producers clamp the expanded lengths of padded rows to >= 0, so those rows
take the kernel's trivial path ("empty -> all -1").
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/30378"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "seqlens_expand_triton"
SYMPTOM = "illegal address in the graph's top-k kernel on DP-padded steps (IndexError here)"
VOCAB, HIDDEN, INDEX_DIM = 12, 4, 4
NUM_DRAFT_TOKENS = 3          # qo_len of a draft-extend row (speculative_num_draft_tokens; 6 upstream)
MAX_CONTEXT = 8               # width of the graph's score buffer (max context)
INDEX_TOPK = 2                # dsa_index_topk (2048 upstream)
PAGE_BITS = 0                 # page_size 1: the page table holds token slots
MAX_BS = 2
NUM_SLOTS = 1 + MAX_BS * MAX_CONTEXT    # slot 0 is reserved (padded rows' page table points there)


class DraftModel:
    """One DSA layer of the MTP draft model: indexer scores, top-k selection, sparse attention."""

    def __init__(self, device):
        gen = generator(30378)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w_index_q = randn(HIDDEN, INDEX_DIM, gen=gen, device=device, scale=0.5)
        self.w_q = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        # KV and indexer-key caches, filled by earlier target/draft passes (read-only here)
        self.index_k = randn(NUM_SLOTS, INDEX_DIM, gen=gen, device=device)
        self.k_cache = randn(NUM_SLOTS, HIDDEN, gen=gen, device=device)
        self.v_cache = randn(NUM_SLOTS, HIDDEN, gen=gen, device=device)

    def forward(self, input_ids, page_table, dsa_seqlens_expanded):
        h = self.embed[input_ids]
        token_pages = page_table.repeat_interleave(NUM_DRAFT_TOKENS, dim=0)        # [tokens, MAX_CONTEXT]
        scores = (self.index_k[token_pages] * (h @ self.w_index_q)[:, None, :]).sum(-1)
        slots = _topk_transform_v2_paged(scores, dsa_seqlens_expanded, token_pages, INDEX_TOPK)
        q = h @ self.w_q
        valid = slots >= 0
        k = self.k_cache[slots.clamp(min=0)]
        v = self.v_cache[slots.clamp(min=0)]
        att = ((q[:, None, :] * k).sum(-1) / HIDDEN ** 0.5).masked_fill(~valid, float("-inf"))
        w = torch.exp(att - att.amax(-1, keepdim=True).clamp(min=-1e30)) * valid
        w = w / w.sum(-1, keepdim=True).clamp(min=1e-30)
        return (h + (w[..., None] * v).sum(1)) @ self.lm_head


def _topk_transform_v2_paged(scores, lengths, page_table, topk):
    """The fused top-k v2 kernel with its page-table transform: per query token, the ``topk`` best of
    its first ``lengths`` columns, as cache slots (-1: none). The kernel reads lengths as uint32_t; a
    row longer than ``topk`` takes the selection path, which walks the row from its newest column."""
    tokens, width = scores.shape
    lens = lengths.to(torch.int64) & 0xFFFFFFFF
    j = torch.arange(width, device=scores.device)
    cols = lens[:, None] - 1 - j                                     # visible columns, newest first
    live = cols >= 0
    flat = torch.arange(tokens, device=scores.device)[:, None] * width + cols.clamp(min=0)
    cand = scores.reshape(-1)[flat].masked_fill(~live, float("-inf"))
    top = cand.topk(topk, dim=1).indices
    selected = torch.where(live.gather(1, top), cols.gather(1, top), -1)
    trivial = torch.where(j[:topk] < lens[:, None], j[:topk], -1)   # rows of <= topk tokens: all of them
    idx = torch.where(lens[:, None] <= topk, trivial, selected)
    pages = page_table.gather(1, (idx.clamp(min=0) >> PAGE_BITS))
    return torch.where(idx >= 0, pages, -1)


def seqlens_expand_triton(seq_lens, qo_len, out, clamp_padded_rows: bool):
    """Visible KV length of every draft-extend query token: ``kv - qo + 1 + i``."""
    bs = seq_lens.shape[0]
    offsets = torch.arange(qo_len, dtype=torch.int32, device=seq_lens.device).repeat(bs)
    expanded = seq_lens.repeat_interleave(qo_len) - qo_len + 1 + offsets
    if clamp_padded_rows:
        expanded = expanded.clamp(min=0)
    out[:bs * qo_len].copy_(expanded)


class DeepseekSparseAttnBackend:
    """The DSA backend's graph-side metadata: ``dsa_seqlens_expanded`` lives in a static buffer."""

    def __init__(self, device, clamp_padded_rows: bool):
        self.clamp_padded_rows = clamp_padded_rows
        self.dsa_seqlens_expanded = torch.zeros(MAX_BS * NUM_DRAFT_TOKENS, dtype=torch.int32, device=device)

    def init_forward_metadata_capture_cuda_graph(self, bs, seq_lens):
        seqlens_expand_triton(seq_lens[:bs], NUM_DRAFT_TOKENS, self.dsa_seqlens_expanded, self.clamp_padded_rows)

    def init_forward_metadata_replay_cuda_graph(self, bs, seq_lens):
        seqlens_expand_triton(seq_lens[:bs], NUM_DRAFT_TOKENS, self.dsa_seqlens_expanded, self.clamp_padded_rows)


class EAGLEDraftExtendCudaGraphRunner:
    """Draft-extend graphs, one per padded batch size (counted in tokens: ``bs * qo_len``)."""

    def __init__(self, model, device, clamp_padded_rows: bool):
        self.model = model
        self.backend = DeepseekSparseAttnBackend(device, clamp_padded_rows)
        self.seq_len_fill_value = 1
        self.input_ids = torch.zeros(MAX_BS * NUM_DRAFT_TOKENS, dtype=torch.long, device=device)
        self.seq_lens = torch.full((MAX_BS,), self.seq_len_fill_value, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(MAX_BS, MAX_CONTEXT, dtype=torch.long, device=device)
        self.manager = GraphManager(
            self.forward, [NUM_DRAFT_TOKENS * bs for bs in range(1, MAX_BS + 1)], device=device,
            mode=CUDAGraphMode.FULL, name="EAGLEDraftExtendCudaGraphRunner",
            static_buffers={"input_ids": self.input_ids, "seq_lens": self.seq_lens, "page_table": self.page_table,
                            "dsa_seqlens_expanded": self.backend.dsa_seqlens_expanded})

    def forward(self, num_tokens):
        bs = num_tokens // NUM_DRAFT_TOKENS
        return self.model.forward(self.input_ids[:num_tokens], self.page_table[:bs],
                                  self.backend.dsa_seqlens_expanded[:num_tokens])

    def capture(self):
        self.seq_lens.fill_(MAX_CONTEXT)               # the capture's dummy batch: full-length rows
        self.backend.init_forward_metadata_capture_cuda_graph(MAX_BS, self.seq_lens)
        self.manager.capture()

    def replay(self, input_ids, seq_lens, page_table, dp_global_bs):
        raw_bs = seq_lens.shape[0]
        num_tokens = self.manager.dispatch(max(raw_bs, dp_global_bs) * NUM_DRAFT_TOKENS)
        bs = num_tokens // NUM_DRAFT_TOKENS
        if bs != raw_bs:                               # DP padding: idle-companion rows
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.page_table.zero_()                    # req_pool_indices 0: the reserved request
        self.input_ids[:raw_bs * NUM_DRAFT_TOKENS].copy_(input_ids)
        self.seq_lens[:raw_bs].copy_(seq_lens)
        self.page_table[:raw_bs].copy_(page_table)
        self.backend.init_forward_metadata_replay_cuda_graph(bs, self.seq_lens)
        out = self.manager.replay(num_tokens, raw_bs * NUM_DRAFT_TOKENS,
                                  padded={"input_ids": self.input_ids[:num_tokens]})
        return out.clone()


def schedule(device):
    """Per step: this DP rank's requests (draft token ids, seq_len, token slots) and the largest batch
    of any DP rank. Request A owns slots 1..8, B slots 9..16. Step 2: B has finished here, while the
    other DP rank still runs two requests, so this rank replays the 2-row graph with one idle row."""
    a_slots = list(range(1, 1 + MAX_CONTEXT))
    b_slots = list(range(1 + MAX_CONTEXT, 1 + 2 * MAX_CONTEXT))
    steps = [([([3, 7, 1], 6, a_slots), ([5, 2, 9], 5, b_slots)], 2),
             ([([4, 8, 10], 7, a_slots)], 2),
             ([([6, 11, 0], 8, a_slots)], 1)]
    out = []
    for reqs, dp_global_bs in steps:
        out.append((torch.tensor([t for ids, _, _ in reqs for t in ids], device=device),
                    torch.tensor([n for _, n, _ in reqs], dtype=torch.int32, device=device),
                    torch.tensor([s for _, _, s in reqs], device=device), dp_global_bs))
    return out


def run(variant: str, device: str = "cpu"):
    model = DraftModel(device)
    steps = schedule(device)
    clamp = variant == "fix"

    def eager():
        outs = []
        for input_ids, seq_lens, page_table, _ in steps:
            expanded = torch.zeros(seq_lens.shape[0] * NUM_DRAFT_TOKENS, dtype=torch.int32, device=device)
            seqlens_expand_triton(seq_lens, NUM_DRAFT_TOKENS, expanded, clamp)
            outs.append(model.forward(input_ids, page_table, expanded))
        return outs

    def served():
        runner = EAGLEDraftExtendCudaGraphRunner(model, device, clamp)
        runner.capture()
        return [runner.replay(*step) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
