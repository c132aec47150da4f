"""SGLang FA3 EAGLE draft decode (topk > 1, page_size > 1) under CUDA graphs: the replay path scatters the pages of all
``speculative_num_steps`` draft slots into the step-tight ``decode_length + 1``-column expand page table, so a branch whose
draft slots span more pages than the row holds stores past its row.

Upstream: https://github.com/sgl-project/sglang/pull/27360 ("[Spec] Fix fa3 EAGLE draft-decode expand page_table scatter
OOB for topk>1 + page_size>1", sgl-project/sglang, merged; description dated 2026-06-05). It is the real root cause named
when the maintainer closed issue 26532 (the FA3 + spec + topk>1 + page_size>1 illegal memory accesses of 22096 / 14624).
Read: the PR description (bug, fix, standalone repro with EAGLE3 topk=8 + page_size=2 + fa3) and the issue's resolution
note; a stored ``flashattention_backend.py`` from before the fix: ``init_cuda_graph_state`` (the topk>1 expand dict with
``page_table = zeros(max_bs * topk, decode_length + 1)``), ``init_forward_metadata_capture_cuda_graph`` (binds the slices),
``init_forward_metadata_replay_cuda_graph`` (whose ``page_size > 1`` branch calls ``draft_decode_set_expand_metadata(...,
cache_loc=cache_loc)`` with the full ``out_cache_loc.view(-1, speculative_num_steps)`` while the ``page_size == 1`` branch
copies ``cache_loc[:, :decode_length]``), the eager ``init_forward_metadata`` (topk>1 draft decode; for page_size > 1 an
``expand_page_table`` of ``speculative_num_steps`` columns, comment "we leave one extra for last_page_len") and the
``@torch.compile``'d ``draft_decode_set_expand_metadata`` (unique-consecutive page positions, then ``page_table[:num_seqs,
:].scatter_(1, positions, cache_loc)``). The PR diff was not read: the fix (slice at the call site, plus an always-on
``cache_loc.shape[1] <= page_table.shape[1]`` assert before the scatter) is reconstructed from the description.
Symptom: EAGLE/EAGLE3 with ``--speculative-eagle-topk > 1``, ``--page-size > 1`` and the fa3 backend, draft CUDA graphs on:
intermittent illegal memory access, NaN logits or a ``vectorized_gather`` index assert; eager draft decode is fine.
Mechanism: a branch's draft slots start at offset ``last_page_len`` of its private first page (which duplicates the
prefix's partial page). The captured expand attention of draft step ``i`` needs the pages of ``last_page_len + i + 1``
tokens, at most ``i + 2``: the CUDA-graph table has exactly that many columns. Eagerly the table has
``speculative_num_steps`` columns, so scattering the pages of all steps' slots is harmless there; at replay the same
unsliced call writes, for a branch whose slots cross one more page (here: an odd prefix at step 0), a position past its
row. Inductor's scatter does not check bounds: the store lands in the neighbouring row or past the buffer, in CUDA-graph
memory.
Doctor: undersized-buffer, at init_forward_metadata_replay_cuda_graph. The replay preparation hands data (pages of
``speculative_num_steps`` slots) that does not fit the static page table sized for ``decode_length + 1`` pages.
Fix (upstream): pass ``cache_loc[:, :decode_length]`` at the CUDA-graph call site (as the page_size == 1 branch does) and
assert ``cache_loc.shape[1] <= page_table.shape[1]`` in ``draft_decode_set_expand_metadata``.
Modelled: ``FlashAttentionMetadata``, ``FlashAttentionBackend`` (``init_forward_metadata``, ``init_cuda_graph_state``,
``init_forward_metadata_capture_cuda_graph``, ``init_forward_metadata_replay_cuda_graph``, ``forward_decode`` with the
two-half topk>1 draft attention and ``merge_state_v2``), ``FlashAttentionMultiStepBackend``,
``draft_decode_set_expand_metadata``, ``EAGLEDraftCudaGraphRunner`` (capture of the multi-step draft forward per bs into
one pool, replay), ``EAGLEWorker.draft_forward`` (out_cache_loc reordered to ``[num_steps, bs * topk]``). Stand-ins:
``flash_attn_with_kvcache`` is a paged softmax attention over ``page_table`` bounded by ``cache_seqlens`` returning the
LSE; the draft model is one attention layer (head dim 8, vocab 16, float64); each branch continues with its own argmax
(``select_top_k_tokens`` left out); the compiled scatter is a loop of stores that raises ``IllegalMemoryAccess`` where a
store falls outside the row it was handed (upstream it silently overwrites graph memory).
Workload: page_size 2, topk 2, speculative_num_steps 4 (three draft decode steps), graphs for bs 1 and 2. Rounds draft
for prefixes of 6 tokens (A), then 6 and 4 (A, C), then 7 and 4 (B, C). The even prefixes replay fine; the bug raises at
the B round's step-0 replay preparation (its branches' four slots span three pages, two columns); the fix equals eager
(max error 0) on every round's draft logits.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.engine import IllegalMemoryAccess, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/27360"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "init_forward_metadata_replay_cuda_graph"
SYMPTOM = ("EAGLE topk>1 + page_size>1 + fa3 with draft CUDA graphs: the replay scatters the pages of all draft steps' "
           "slots into the step-tight expand page table; branches crossing one more page store past their row "
           "(illegal memory access / NaN); eager draft decode is fine")

HEAD_DIM, VOCAB = 8, 16
PAGE_SIZE, TOPK, NUM_STEPS = 2, 2, 4        # speculative_num_steps: draft decode steps 0..NUM_STEPS-2
MAX_BS, CUDA_GRAPH_BS = 2, [1, 2]
MAX_CONTEXT_LEN = 16
MAX_NUM_PAGES = MAX_CONTEXT_LEN // PAGE_SIZE
NUM_PAGES = 64                              # page 0: the dummy page capture rows point at
PRIVATE_PAGES = 3                           # pages per branch: ceil((last_page_len + NUM_STEPS) / PAGE_SIZE) <= 3
SCALE = HEAD_DIM ** -0.5

_variant = "bug"


@dataclasses.dataclass
class FlashAttentionMetadata:
    cache_seqlens_int32: torch.Tensor = None
    max_seq_len_k: int = 0
    page_table: torch.Tensor = None


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    input_ids: torch.Tensor
    hidden_states: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor                  # [bs * topk * num_steps], laid out [bs, topk, num_steps]
    step_out_cache_loc: torch.Tensor = None      # this draft step's slots, [bs * topk]


class TokenToKVPool:
    def __init__(self, device):
        self.k_buffer = torch.zeros(NUM_PAGES * PAGE_SIZE, HEAD_DIM, dtype=torch.float64, device=device)
        self.v_buffer = torch.zeros_like(self.k_buffer)

    def set_kv_buffer(self, loc, k, v):
        self.k_buffer.index_copy_(0, loc, k)
        self.v_buffer.index_copy_(0, loc, v)


# --- kernels (stand-ins) ----------------------------------------------------------------------------------------------

def flash_attn_with_kvcache(q, kv_pool, page_table, cache_seqlens):
    """Paged attention of row ``j`` over the first ``cache_seqlens[j]`` tokens of its pages; returns (out, lse)."""
    pos = torch.arange(page_table.shape[1] * PAGE_SIZE, device=q.device)
    slots = page_table[:, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE
    valid = pos[None, :] < cache_seqlens[:, None]
    scores = ((q[:, None, :] * kv_pool.k_buffer[slots]).sum(-1) * SCALE).masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[:, None]).masked_fill(~valid, 0.0)
    return (p[..., None] * kv_pool.v_buffer[slots]).sum(1), lse


def merge_state_v2(o1, lse1, o2, lse2):
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (o1 * w1[:, None] + o2 * w2[:, None]) / (w1 + w2)[:, None]


def _compiled_scatter_(page_table, positions, cache_loc):
    """``page_table.scatter_(1, positions, cache_loc)`` as the Inductor kernel runs it: one unchecked store per element.
    A store past the row is where upstream silently corrupts graph memory; the emulation raises there."""
    width = page_table.shape[1]
    if int(positions.max()) >= width:
        row = int((positions >= width).any(dim=1).nonzero()[0])
        raise IllegalMemoryAccess(
            f"draft_decode_set_expand_metadata: scatter_ stores page position {int(positions[row].max())} into row {row} "
            f"of a {tuple(page_table.shape)} page_table (an out-of-bounds write into CUDA-graph memory)")
    page_table.scatter_(1, positions, cache_loc)


def draft_decode_set_expand_metadata(cache_seqlens_int32, page_table, last_page_lens, decode_length, cache_loc, topk,
                                     page_size):
    if _variant == "fix":
        assert cache_loc.shape[1] <= page_table.shape[1], (cache_loc.shape, page_table.shape)
    expanded_last_page_lens = last_page_lens.repeat_interleave(topk)
    cache_seqlens_int32.copy_(decode_length + expanded_last_page_lens)
    cache_loc = (cache_loc // page_size).to(torch.int32)
    if cache_loc.dim() == 1:
        cache_loc = cache_loc.unsqueeze(0)
    # Vectorized torch.unique_consecutive: track value change points then scatter
    mask = torch.ones_like(cache_loc, dtype=torch.bool)
    mask[:, 1:] = cache_loc[:, 1:] != cache_loc[:, :-1]
    positions = mask.cumsum(dim=1) - 1
    num_seqs = cache_loc.shape[0]
    _compiled_scatter_(page_table[:num_seqs, :], positions, cache_loc)


# --- python/sglang/srt/layers/attention/flashattention_backend.py (topk > 1 draft decode, page_size > 1) -------------

class FlashAttentionBackend:
    def __init__(self, req_to_token, kv_pool, speculative_step_id, device):
        self.req_to_token, self.token_to_kv_pool, self.device = req_to_token, kv_pool, device
        self.topk, self.speculative_num_steps, self.page_size = TOPK, NUM_STEPS, PAGE_SIZE
        self.speculative_step_id = speculative_step_id
        self.forward_metadata = self.forward_metadata_spec_decode_expand = None

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        metadata = FlashAttentionMetadata()
        metadata.cache_seqlens_int32 = forward_batch.seq_lens.to(torch.int32)
        metadata.max_seq_len_k = int(forward_batch.seq_lens_cpu.max())
        metadata.page_table = self.req_to_token[forward_batch.req_pool_indices, : metadata.max_seq_len_k]
        metadata_expand = FlashAttentionMetadata()
        decode_length = self.speculative_step_id + 1
        metadata_expand.cache_seqlens_int32 = torch.full((forward_batch.batch_size * self.topk,), decode_length,
                                                         device=self.device, dtype=torch.int32)
        self.forward_metadata_spec_decode_expand = metadata_expand
        # Convert the page table to a strided format
        strided_indices = torch.arange(0, metadata.page_table.shape[1], self.page_size, device=self.device)
        metadata.page_table = (metadata.page_table[:, strided_indices] // self.page_size).to(torch.int32)
        last_page_lens = forward_batch.seq_lens % self.page_size
        # First attention handles seq_lens - last_page_lens.
        metadata.cache_seqlens_int32 -= last_page_lens.to(torch.int32)
        # Second attention handles last_page_len + decode part.
        self.forward_metadata_spec_decode_expand.cache_seqlens_int32 += last_page_lens.repeat_interleave(
            self.topk).to(torch.int32)
        # the max decode length is speculative_num_steps - 1 and we leave one extra for last_page_len
        expand_page_table = torch.zeros(forward_batch.batch_size * self.topk, self.speculative_num_steps,
                                        dtype=torch.int32, device=self.device)
        cache_loc = forward_batch.out_cache_loc.view(-1, self.speculative_num_steps)
        draft_decode_set_expand_metadata(self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
                                         expand_page_table, last_page_lens, decode_length, cache_loc, self.topk,
                                         self.page_size)
        self.forward_metadata_spec_decode_expand.page_table = expand_page_table
        self.forward_metadata = metadata

    def init_cuda_graph_state(self, max_bs):
        self.decode_cuda_graph_metadata = {
            "strided_indices": torch.arange(0, MAX_CONTEXT_LEN, self.page_size, device=self.device)}
        # This is used by draft decode's first half of metadata when topk > 1
        self.draft_decode_metadata_topk_normal = {
            "cache_seqlens": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            "page_table": torch.zeros(max_bs, MAX_NUM_PAGES, dtype=torch.int32, device=self.device)}
        # This is used by draft decode's second half of metadata when topk > 1
        decode_length = self.speculative_step_id + 1
        self.draft_decode_metadata_topk_expand = {
            "cache_seqlens": torch.full((max_bs * self.topk,), decode_length, device=self.device, dtype=torch.int32),
            "page_table": torch.zeros(max_bs * self.topk, decode_length + 1, dtype=torch.int32, device=self.device)}

    def init_forward_metadata_capture_cuda_graph(self, bs):
        metadata, metadata_expand = FlashAttentionMetadata(), FlashAttentionMetadata()
        metadata.cache_seqlens_int32 = self.draft_decode_metadata_topk_normal["cache_seqlens"][:bs]
        metadata.page_table = self.draft_decode_metadata_topk_normal["page_table"][:bs, :]
        metadata_expand.cache_seqlens_int32 = self.draft_decode_metadata_topk_expand["cache_seqlens"][: bs * self.topk]
        metadata_expand.page_table = self.draft_decode_metadata_topk_expand["page_table"][: bs * self.topk]
        self.draft_decode_metadata_topk_normal[bs] = metadata
        self.draft_decode_metadata_topk_expand[bs] = metadata_expand
        self.forward_metadata, self.forward_metadata_spec_decode_expand = metadata, metadata_expand

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu, out_cache_loc):
        seq_lens, seq_lens_cpu, req_pool_indices = seq_lens[:bs], seq_lens_cpu[:bs], req_pool_indices[:bs]
        # 1. The first half of metadata for prefix tokens
        metadata = self.draft_decode_metadata_topk_normal[bs]
        last_page_lens = seq_lens % self.page_size
        seq_lens = seq_lens - last_page_lens
        metadata.cache_seqlens_int32.copy_(seq_lens)
        metadata.max_seq_len_k = int(seq_lens_cpu.max())
        max_seq_pages = (metadata.max_seq_len_k + self.page_size - 1) // self.page_size
        strided_indices = self.decode_cuda_graph_metadata["strided_indices"][:max_seq_pages]
        page_table = self.req_to_token[req_pool_indices[:, None], strided_indices[None, :]] // self.page_size
        metadata.page_table[:, :max_seq_pages].copy_(page_table)
        # 2. The second half of metadata for draft tokens (per_batch_num_tokens = topk)
        metadata_expand = self.draft_decode_metadata_topk_expand[bs]
        decode_length = self.speculative_step_id + 1
        # shape: [bs, num_steps, topk] -> [bs x topk, num_steps]
        cache_loc = out_cache_loc.view(-1, self.speculative_num_steps)
        if _variant == "fix":
            cache_loc = cache_loc[:, :decode_length]
        draft_decode_set_expand_metadata(metadata_expand.cache_seqlens_int32, metadata_expand.page_table,
                                         last_page_lens, decode_length, cache_loc, self.topk, self.page_size)
        self.forward_metadata, self.forward_metadata_spec_decode_expand = metadata, metadata_expand

    def forward_decode(self, q, k, v, forward_batch: ForwardBatch):
        self.token_to_kv_pool.set_kv_buffer(forward_batch.step_out_cache_loc, k, v)
        metadata, metadata_expand = self.forward_metadata, self.forward_metadata_spec_decode_expand
        # topk queries of a request attend to its prefix pages (cu_seqlens_q with step topk), then each branch to its
        # own last page + draft tokens; the two halves are merged by their LSE.
        o, lse = flash_attn_with_kvcache(q, self.token_to_kv_pool,
                                         metadata.page_table.repeat_interleave(self.topk, dim=0),
                                         metadata.cache_seqlens_int32.repeat_interleave(self.topk))
        o_expand, lse_expand = flash_attn_with_kvcache(q, self.token_to_kv_pool, metadata_expand.page_table,
                                                       metadata_expand.cache_seqlens_int32)
        return merge_state_v2(o, lse, o_expand, lse_expand)


class FlashAttentionMultiStepBackend:
    def __init__(self, req_to_token, kv_pool, device):
        self.attn_backends = [FlashAttentionBackend(req_to_token, kv_pool, i, device) for i in range(NUM_STEPS - 1)]

    def init_forward_metadata(self, forward_batch):
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs):
        for backend in self.attn_backends:
            backend.init_cuda_graph_state(max_bs)

    def init_forward_metadata_capture_cuda_graph(self, bs):
        for backend in self.attn_backends:
            backend.init_forward_metadata_capture_cuda_graph(bs)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch, bs):
        for backend in self.attn_backends:
            backend.init_forward_metadata_replay_cuda_graph(bs, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                                            forward_batch.seq_lens_cpu, forward_batch.out_cache_loc)


# --- the draft model and EAGLEWorker.draft_forward (stand-ins) -------------------------------------------------------

class LlamaForCausalLMEagle:
    def __init__(self, device):
        gen = generator(27360)
        self.embed = randn(VOCAB, HEAD_DIM, gen=gen, device=device).double()
        self.wq, self.wk, self.wv, self.wo = (randn(HEAD_DIM, HEAD_DIM, gen=gen, device=device, scale=0.5).double()
                                              for _ in range(4))
        self.lm_head = randn(HEAD_DIM, VOCAB, gen=gen, device=device).double()

    def forward(self, input_ids, hidden_states, forward_batch, attn_backend):
        x = self.embed[input_ids] + hidden_states
        o = attn_backend.forward_decode(x @ self.wq, x @ self.wk, x @ self.wv, forward_batch)
        h = torch.tanh(o @ self.wo + x)
        return h @ self.lm_head, h


def draft_forward(model, draft_attn_backend, forward_batch):
    """EAGLEWorker.draft_forward: one draft decode per step; each branch continues with its own argmax."""
    bs = forward_batch.batch_size
    out_cache_loc = forward_batch.out_cache_loc.reshape(bs, TOPK, NUM_STEPS).permute(2, 0, 1).reshape(NUM_STEPS, -1)
    input_ids, hidden_states, logits_list = forward_batch.input_ids, forward_batch.hidden_states, []
    for i in range(NUM_STEPS - 1):
        forward_batch.step_out_cache_loc = out_cache_loc[i]
        logits, hidden_states = model.forward(input_ids, hidden_states, forward_batch,
                                              draft_attn_backend.attn_backends[i])
        logits_list.append(logits)
        input_ids = torch.argmax(logits, dim=-1)
    return torch.stack(logits_list)


class EAGLEDraftCudaGraphRunner:
    def __init__(self, model, draft_attn_backend, kv_pool, device):
        self.model, self.backend, self.device = model, draft_attn_backend, device
        n = MAX_BS * TOPK
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(n, HEAD_DIM, dtype=torch.float64, device=device)
        self.out_cache_loc = torch.zeros(n * NUM_STEPS, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(MAX_BS, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(MAX_BS, dtype=torch.int64, device=device)
        self.backend.init_cuda_graph_state(MAX_BS)
        self.graphs, self.outputs, pool = {}, {}, graph_pool_handle(device)
        static = {"input_ids": self.input_ids, "hidden_states": self.hidden_states,
                  "out_cache_loc": self.out_cache_loc}
        for i, b in enumerate(self.backend.attn_backends):
            static.update({f"normal_page_table_{i}": b.draft_decode_metadata_topk_normal["page_table"],
                           f"normal_cache_seqlens_{i}": b.draft_decode_metadata_topk_normal["cache_seqlens"],
                           f"expand_page_table_{i}": b.draft_decode_metadata_topk_expand["page_table"],
                           f"expand_cache_seqlens_{i}": b.draft_decode_metadata_topk_expand["cache_seqlens"]})
        state = {"k_buffer": kv_pool.k_buffer, "v_buffer": kv_pool.v_buffer}
        for bs in reversed(CUDA_GRAPH_BS):
            fb = ForwardBatch(bs, self.input_ids[: bs * TOPK], self.hidden_states[: bs * TOPK],
                              self.req_pool_indices[:bs], self.seq_lens[:bs], self.seq_lens[:bs].cpu(),
                              self.out_cache_loc[: bs * TOPK * NUM_STEPS])
            self.backend.init_forward_metadata_capture_cuda_graph(bs)
            self.graphs[bs], self.outputs[bs] = capture(
                lambda fb=fb: draft_forward(self.model, self.backend, fb), device=device, pool=pool, warmups=1,
                name=f"draft bs={bs}", static=static, state=state, owner="EAGLEDraftCudaGraphRunner")

    def replay(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        bs = CUDA_GRAPH_BS[bisect.bisect_left(CUDA_GRAPH_BS, raw_bs)]
        n = raw_bs * TOPK
        self.input_ids[:n].copy_(forward_batch.input_ids)
        self.hidden_states[:n].copy_(forward_batch.hidden_states)
        self.out_cache_loc[: n * NUM_STEPS].copy_(forward_batch.out_cache_loc)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        static_fb = ForwardBatch(bs, self.input_ids[: bs * TOPK], self.hidden_states[: bs * TOPK],
                                 self.req_pool_indices[:bs], self.seq_lens[:bs], forward_batch.seq_lens_cpu,
                                 self.out_cache_loc[: bs * TOPK * NUM_STEPS])
        self.backend.init_forward_metadata_replay_cuda_graph(static_fb, bs)
        out = replay(self.graphs[bs], self.outputs[bs])
        return out[:, :n]


# --- the workload ----------------------------------------------------------------------------------------------------

PREFIX_LENS = {1: 6, 2: 7, 3: 4}            # req pool index -> prefix length (A, B, C)
ROUNDS = [[1], [1, 3], [2, 3]]


def build_state(device):
    """KV pool with each request's prefix in its own pages, and req_to_token."""
    gen = generator(2736)
    kv_pool = TokenToKVPool(device)
    req_to_token = torch.zeros(len(PREFIX_LENS) + 1, MAX_CONTEXT_LEN, dtype=torch.int64, device=device)
    for r, length in PREFIX_LENS.items():
        first_slot = (1 + (r - 1) * MAX_NUM_PAGES) * PAGE_SIZE
        slots = torch.arange(first_slot, first_slot + MAX_CONTEXT_LEN, device=device)
        req_to_token[r] = slots
        kv_pool.k_buffer[slots[:length]] = randn(length, HEAD_DIM, gen=gen, device=device).double()
        kv_pool.v_buffer[slots[:length]] = randn(length, HEAD_DIM, gen=gen, device=device).double()
    return kv_pool, req_to_token


def prepare_for_draft(round_idx, reqs, kv_pool, req_to_token, device):
    """Per branch: a run of private pages whose first page duplicates the prefix's partial page; the branch's
    NUM_STEPS draft slots follow it (out_cache_loc laid out [bs, topk, num_steps])."""
    gen = generator(100 + round_idx)
    next_page = 1 + len(PREFIX_LENS) * MAX_NUM_PAGES + round_idx * MAX_BS * TOPK * PRIVATE_PAGES
    locs = []
    for r in reqs:
        length = PREFIX_LENS[r]
        last_page_len = length % PAGE_SIZE
        tail = req_to_token[r, length - last_page_len: length]
        for _ in range(TOPK):
            base = next_page * PAGE_SIZE
            next_page += PRIVATE_PAGES
            kv_pool.k_buffer[base: base + last_page_len] = kv_pool.k_buffer[tail]
            kv_pool.v_buffer[base: base + last_page_len] = kv_pool.v_buffer[tail]
            locs.append(base + last_page_len + torch.arange(NUM_STEPS, device=device))
    seq_lens = torch.tensor([PREFIX_LENS[r] for r in reqs], dtype=torch.int64)
    return ForwardBatch(len(reqs), torch.randint(0, VOCAB, (len(reqs) * TOPK,), generator=gen).to(device),
                        randn(len(reqs), HEAD_DIM, gen=gen, device=device).double().repeat_interleave(TOPK, dim=0),
                        torch.tensor(reqs, device=device), seq_lens.to(device), seq_lens, torch.cat(locs))


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graph):
        model = LlamaForCausalLMEagle(device)
        kv_pool, req_to_token = build_state(device)
        backend = FlashAttentionMultiStepBackend(req_to_token, kv_pool, device)
        runner = EAGLEDraftCudaGraphRunner(model, backend, kv_pool, device) if use_cuda_graph else None
        outputs = []
        for i, reqs in enumerate(ROUNDS):
            fb = prepare_for_draft(i, reqs, kv_pool, req_to_token, device)
            if runner is not None:
                outputs.append(runner.replay(fb).clone())
            else:
                backend.init_forward_metadata(fb)
                outputs.append(draft_forward(model, backend, fb))
        return outputs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
