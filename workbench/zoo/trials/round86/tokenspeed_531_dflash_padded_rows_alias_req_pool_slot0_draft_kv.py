"""DFlash drafter in the decode CUDA graph: padded rows get ``req_pool_indices`` 0, alias the live request in pool slot 0, take its cache length and write their draft block KV into its pages.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/531 ("fix(dflash): fix serverl hang issue for dflash and add
ci eval", lightseekorg/tokenspeed, merged as commit a6578e5a on main, 2026-06-27). Read: the commit's diff of
``runtime/execution/cuda_graph_wrapper.py`` (``_pad_graph_req_pool_indices``) with its comment, and, at that commit,
``runtime/execution/drafter/dflash.py`` (``_update_native_cache_from_target``, ``_draft_native``) and the wrapper's
``__call__``. The PR's other hunks (cache-event all_reduce, ``req_to_page`` slack, accept clamps, trtllm backend,
greedy sampler) were skimmed and are not modelled. Later, #594 kept the sentinel for DFLASH only.
Symptom: Kimi-K2.5 with DFLASH speculative decoding and decode CUDA graphs: the server hangs in the draft
block-decode kernel once a batch is padded up to a captured size. The upstream comment: padding rows pointed at slot
0 "would alias the live first request ... the DFLASH draft derives each row's block seq_len from
valid_cache_lengths[req_pool], so padding rows would grow unbounded with request 0's context".
Mechanism: ``CudaGraphWrapper.__call__`` pads a batch of ``bs`` to ``padded_bs`` and fills the padded rows of
``req_pool_indices_buf`` via ``_pad_graph_req_pool_indices``, which appended zeros. Inside the captured step,
``Dflash._update_native_cache_from_target`` (graph branch) sets ``draft_seq_lens_buf = valid_cache_lengths
.index_select(0, req_pool_indices) + accept_lengths``, so a padded row inherits request 0's committed length; then
``_draft_native`` computes its block's write slots with ``compute_out_cache_loc_uniform(req_pool_indices,
cache_start=prefix_lens, req_to_pages=req_to_page)`` and runs the draft layer, which stores the block's K/V there. A
padded row therefore writes its (dummy) block K/V into request 0's pages at positions next to request 0's own block
and over request 0's just-committed token, and request 0's draft attention reads them.
Doctor: stale-padding, at _pad_graph_req_pool_indices. The real row of request 0 depends on what the padded rows
hold: the pad value 0 is a live pool slot, so the padded rows' K/V writes land in request 0's cache.
Fix (upstream): pad with the sentinel slot ``max_req_pool_size``; ``valid_cache_lengths`` / ``req_to_page`` have
``max_req_pool_size + 1`` rows and the sentinel row stays zero (length 0, dummy page 0), so padded rows stay inert.
Modelled: ``CudaGraphWrapper`` (capture sizes [2, 4], padding of the static input buffers), ``RuntimeStates``
(``valid_cache_lengths``, updated on the host after each step for real rows only), ``req_to_page`` (page size 4, six
pages per request, page 0 = dummy page), ``Dflash`` (the in-graph branch of ``_update_native_cache_from_target``,
``_write_native_cache``, ``_draft_native`` with block size 3 and mask token 15) and a one-layer draft model whose
block tokens attend (block-bidirectionally) over the request's pages. The target verify forward is a stand-in that
supplies per request its candidate-block hidden states, the accept length and the current token; in upstream it is
captured in the same graph. Padded rows get accept length 1, token 0, positions/write slot 0 (dummy slot), and keep
stale target hidden rows. Hidden 8, vocab 16, float64.
Workload: requests A (pool slot 0, 5 tokens), B (slot 1, 7), C (slot 2, 4). Step 1: [A, B, C] padded to the 4-row
graph; A accepts 2, so its block sits at positions 7..9 while the padded row (length 5 + 1) writes positions 6..8 of
A's pages, overwriting A's committed position 6 and two of A's block slots. Step 2: [A, B, C] again. Step 3: C is
done; [A, B] replays the 2-row graph unpadded and A still reads the corrupted position 6. Outputs: the draft logits
and tokens of every step; A's differ from eager from step 1 on. Fix: equal to eager.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/531"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_pad_graph_req_pool_indices"
SYMPTOM = ("DFLASH + decode CUDA graphs: padded rows get req_pool_indices 0, inherit request 0's cache length and "
           "write their draft block K/V into request 0's pages; request 0's drafts are corrupted (upstream: the draft "
           "block-decode kernel hangs as padded rows grow with request 0's context)")

HIDDEN, VOCAB = 8, 16
SPEC_NUM_TOKENS = 3                     # DFLASH block size
MASK_TOKEN_ID = VOCAB - 1
PAGE_SIZE, MAX_PAGES_PER_REQ = 4, 6
MAX_CTX = PAGE_SIZE * MAX_PAGES_PER_REQ
MAX_REQ_POOL_SIZE = 4                   # the sentinel slot is MAX_REQ_POOL_SIZE
NUM_SLOTS = PAGE_SIZE * (1 + MAX_REQ_POOL_SIZE * MAX_PAGES_PER_REQ)   # page 0: the dummy page
CAPTURE_BS = [2, 4]

_variant = "bug"


def compute_out_cache_loc_uniform(req_pool_indices, uniform_input_length, cache_start, req_to_pages):
    pos = cache_start.unsqueeze(1) + torch.arange(uniform_input_length, device=cache_start.device)
    pages = req_to_pages[req_pool_indices.unsqueeze(1), pos // PAGE_SIZE]
    return (pages * PAGE_SIZE + pos % PAGE_SIZE).reshape(-1)


class RuntimeStates:
    def __init__(self, device):
        self.valid_cache_lengths = torch.zeros(MAX_REQ_POOL_SIZE + 1, dtype=torch.int64, device=device)
        self.req_to_page = torch.zeros(MAX_REQ_POOL_SIZE + 1, MAX_PAGES_PER_REQ, dtype=torch.int64, device=device)
        for r in range(MAX_REQ_POOL_SIZE):      # the sentinel row keeps the dummy page 0
            self.req_to_page[r] = 1 + r * MAX_PAGES_PER_REQ + torch.arange(MAX_PAGES_PER_REQ, device=device)


class InputBuffers:
    def __init__(self, device):
        n = max(CAPTURE_BS)
        self.req_pool_indices_buf = torch.zeros(n, dtype=torch.int64, device=device)
        self.accept_lengths_buf = torch.ones(n, dtype=torch.int64, device=device)
        self.current_tokens_buf = torch.zeros(n, dtype=torch.int64, device=device)
        self.target_hidden_buf = torch.zeros(n, SPEC_NUM_TOKENS, HIDDEN, dtype=torch.float64, device=device)
        self.positions_buf = torch.zeros(n, SPEC_NUM_TOKENS, dtype=torch.int64, device=device)
        self.out_cache_loc_buf = torch.zeros(n, SPEC_NUM_TOKENS, dtype=torch.int64, device=device)


class DFlashDraftModel:
    def __init__(self, device):
        gen = generator(531)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed, self.pos_emb = r(VOCAB, HIDDEN, scale=1.0), r(MAX_CTX, HIDDEN)
        self.fc = r(HIDDEN, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.k_cache = torch.zeros(NUM_SLOTS, HIDDEN, dtype=torch.float64, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)


class Dflash:
    def __init__(self, device, runtime_states, input_buffers):
        self.model, self.rs, self.ib = DFlashDraftModel(device), runtime_states, input_buffers
        n = max(CAPTURE_BS)
        self.draft_seq_lens_buf = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_ids_buf = torch.zeros(n, SPEC_NUM_TOKENS, dtype=torch.int64, device=device)
        self.block_offsets = torch.arange(SPEC_NUM_TOKENS, device=device)

    def _update_native_cache_from_target(self, bs):
        """The CUDA-graph branch: lengths from the pool slots, then the target's block hidden into the draft KV."""
        req_pool_indices = self.ib.req_pool_indices_buf[:bs]
        old_lens = self.rs.valid_cache_lengths.index_select(0, req_pool_indices)
        self.draft_seq_lens_buf[:bs].copy_(old_lens + self.ib.accept_lengths_buf[:bs])
        self._write_native_cache(self.ib.target_hidden_buf[:bs].reshape(-1, HIDDEN),
                                 self.ib.positions_buf[:bs].reshape(-1), self.ib.out_cache_loc_buf[:bs].reshape(-1))

    def _write_native_cache(self, target_hidden, target_positions, target_cache_locs):
        m = self.model
        h = target_hidden @ m.fc + m.pos_emb[target_positions]
        m.k_cache[target_cache_locs] = h @ m.wk
        m.v_cache[target_cache_locs] = h @ m.wv

    def _draft_native(self, current_tokens):
        m, bs = self.model, current_tokens.shape[0]
        req_pool_indices = self.ib.req_pool_indices_buf[:bs]
        prefix_lens = self.draft_seq_lens_buf[:bs].clone()
        seq_lens_after = self.draft_seq_lens_buf[:bs]
        seq_lens_after.copy_(prefix_lens + SPEC_NUM_TOKENS)
        block_ids = self.block_ids_buf[:bs]
        block_ids.fill_(MASK_TOKEN_ID)
        block_ids[:, 0].copy_(current_tokens)
        block_positions = prefix_lens.unsqueeze(1) + self.block_offsets
        cache_locs = compute_out_cache_loc_uniform(req_pool_indices, SPEC_NUM_TOKENS, prefix_lens, self.rs.req_to_page)
        # draft layer: store the block's K/V, then every block token attends over [0, seq_lens_after)
        h = m.embed[block_ids] + m.pos_emb[block_positions]                               # [bs, S, H]
        m.k_cache[cache_locs] = (h @ m.wk).reshape(-1, HIDDEN)
        m.v_cache[cache_locs] = (h @ m.wv).reshape(-1, HIDDEN)
        j = torch.arange(MAX_CTX, device=h.device)
        slots = self.rs.req_to_page[req_pool_indices][:, j // PAGE_SIZE] * PAGE_SIZE + j % PAGE_SIZE  # [bs, L]
        keys, vals = m.k_cache[slots], m.v_cache[slots]                                      # [bs, L, H]
        scores = torch.einsum("bsh,blh->bsl", h @ m.wq, keys) * HIDDEN ** -0.5
        scores = scores.masked_fill((j.unsqueeze(0) >= seq_lens_after.unsqueeze(1)).unsqueeze(1), -1e9)
        out = h + torch.einsum("bsl,blh->bsh", torch.softmax(scores, -1), vals) @ m.wo
        logits = out @ m.lm_head
        next_tokens = torch.cat([current_tokens.unsqueeze(1), logits[:, 1:].argmax(-1)], 1)
        return next_tokens, logits

    def forward_step(self, bs):
        self._update_native_cache_from_target(bs)
        return self._draft_native(self.ib.current_tokens_buf[:bs])


class CudaGraphWrapper:
    def __init__(self, drafter, device):
        self.drafter, self.ib, self.device = drafter, drafter.ib, device
        self.config_max_req_pool_size = MAX_REQ_POOL_SIZE
        self.graphs = {}
        for bs in reversed(CAPTURE_BS):     # dummy rows: the sentinel row, dummy slot 0
            self.ib.req_pool_indices_buf[:bs].fill_(MAX_REQ_POOL_SIZE)
            self.graphs[bs] = capture(lambda bs=bs: drafter.forward_step(bs), device=device,
                                      name=f"dflash decode [{bs}]", owner="CudaGraphWrapper",
                                      static={"req_pool_indices_buf": self.ib.req_pool_indices_buf,
                                              "accept_lengths_buf": self.ib.accept_lengths_buf,
                                              "current_tokens_buf": self.ib.current_tokens_buf,
                                              "target_hidden_buf": self.ib.target_hidden_buf,
                                              "positions_buf": self.ib.positions_buf,
                                              "out_cache_loc_buf": self.ib.out_cache_loc_buf},
                                      state={"valid_cache_lengths": drafter.rs.valid_cache_lengths,
                                             "req_to_page": drafter.rs.req_to_page,
                                             "draft_seq_lens_buf": drafter.draft_seq_lens_buf,
                                             "draft_k_cache": drafter.model.k_cache,
                                             "draft_v_cache": drafter.model.v_cache})

    def _pad_graph_req_pool_indices(self, active_req_pool_indices, padded_bs):
        """The hazard site: which pool slot the padding rows point at."""
        pad = padded_bs - active_req_pool_indices.shape[0]
        if pad <= 0:
            return active_req_pool_indices
        if _variant == "fix":           # upstream fix: the zero-initialised sentinel slot
            return torch.cat([active_req_pool_indices,
                              active_req_pool_indices.new_full((pad,), int(self.config_max_req_pool_size))])
        return torch.cat([active_req_pool_indices, active_req_pool_indices.new_zeros(pad)])

    def __call__(self, bs):
        padded_bs = next(b for b in CAPTURE_BS if b >= bs)
        ib = self.ib
        if padded_bs != bs:
            req_pool_indices = self._pad_graph_req_pool_indices(ib.req_pool_indices_buf[:bs].clone(), padded_bs)
            ib.req_pool_indices_buf[:padded_bs].copy_(req_pool_indices)
            ib.accept_lengths_buf[bs:padded_bs].fill_(1)
            ib.current_tokens_buf[bs:padded_bs].zero_()
            ib.positions_buf[bs:padded_bs].zero_()
            ib.out_cache_loc_buf[bs:padded_bs].zero_()
        g, out = self.graphs[padded_bs]
        next_tokens, logits = replay(g, out, real=bs, size=padded_bs, padded={"target_hidden_buf": ib.target_hidden_buf})
        return next_tokens[:bs], logits[:bs]


class ModelExecutor:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.runtime_states = RuntimeStates(device)
        self.input_buffers = InputBuffers(device)
        self.drafter = Dflash(device, self.runtime_states, self.input_buffers)
        self.forward_step = CudaGraphWrapper(self.drafter, device) if use_cuda_graph else None

    def execute(self, slots, target_hidden, accept_lengths, current_tokens):
        bs, ib, rs = len(slots), self.input_buffers, self.runtime_states
        pool = torch.tensor(slots, dtype=torch.int64, device=self.device)
        old = rs.valid_cache_lengths[pool]
        ib.req_pool_indices_buf[:bs].copy_(pool)
        ib.accept_lengths_buf[:bs].copy_(accept_lengths)
        ib.current_tokens_buf[:bs].copy_(current_tokens)
        ib.target_hidden_buf[:bs].copy_(target_hidden)
        ib.positions_buf[:bs].copy_(old.unsqueeze(1) + torch.arange(SPEC_NUM_TOKENS, device=self.device))
        ib.out_cache_loc_buf[:bs].copy_(
            compute_out_cache_loc_uniform(pool, SPEC_NUM_TOKENS, old, rs.req_to_page).view(bs, SPEC_NUM_TOKENS))
        if self.forward_step is not None:
            next_tokens, logits = self.forward_step(bs)
        else:
            next_tokens, logits = self.drafter.forward_step(bs)
        out = (next_tokens.clone(), logits.clone())
        self._update_runtime_state(pool, accept_lengths)
        return out

    def _update_runtime_state(self, req_pool_indices, accept_lengths):
        self.runtime_states.valid_cache_lengths[req_pool_indices] += accept_lengths


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    slot = {"A": 0, "B": 1, "C": 2}
    prompt_lens = {"A": 5, "B": 7, "C": 4}
    schedule = [("ABC", [2, 1, 3]), ("ABC", [1, 2, 1]), ("AB", [2, 1])]

    def serve(use_cuda_graph):
        ex = ModelExecutor(device, use_cuda_graph)
        gen = generator(5310)
        rs, m = ex.runtime_states, ex.drafter.model
        for name, n in prompt_lens.items():      # prompt KV of the draft cache (prefill stand-in)
            p = torch.tensor([slot[name]], device=device)
            locs = compute_out_cache_loc_uniform(p, n, torch.zeros(1, dtype=torch.int64, device=device),
                                                 rs.req_to_page)
            m.k_cache[locs] = randn(n, HIDDEN, gen=gen, device=device).double()
            m.v_cache[locs] = randn(n, HIDDEN, gen=gen, device=device).double()
            rs.valid_cache_lengths[slot[name]] = n
        outs = []
        for names, accepts in schedule:
            bs = len(names)
            hidden = randn(bs, SPEC_NUM_TOKENS, HIDDEN, gen=gen, device=device).double()
            tokens = torch.randint(0, VOCAB - 1, (bs,), generator=gen).to(device)
            outs.extend(ex.execute([slot[n] for n in names], hidden,
                                   torch.tensor(accepts, dtype=torch.int64, device=device), tokens))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
