"""EAGLE3 multi-step draft: padded graph rows use page ids left past ``bs`` and write draft KV into live pages.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/955 ("fix(eagle3): clear draft page table rows past the
current batch", squash commit bb57018f; branch commit 023d52bc).
Symptom: silent quality loss once the batch shrinks under CUDA-graph padding with spec steps >= 2: the MiniMax-M3
EAGLE3 CI eval fell from eval_accept_rate 0.665 to 0.0015 (avg_accept_len 3.00 -> 1.005), score 0.90 -> 0.87; the
victim request's drafts are rejected from then on.
Mechanism: ``ModelExecutor.__init__`` allocates one graph-stable, batch-ordered table ``self.draft_page_table``
(``[max_bs, max_num_pages_per_req]`` int32; row i is batch position i, not a req-pool index). Each step, outside the
graph, ``_publish_draft_page_table`` copies the target's full-history block table into ``draft_page_table[:bs]``,
clamps the -1 column pads to dummy page 0 and zeroes the columns past ``width``, but never touches rows ``bs:``.
The decode graph is captured at ``padded_bs`` and replayed at that size (``cuda_graph_wrapper`` pads ``seq_lens``
with 1 and hands the whole table to the drafter). Inside it ``Eagle._run_multi_step_decode`` computes the KV write
slots of draft steps 2..N with ``compute_out_cache_loc_uniform(page_table=self.page_table)`` over all
``padded_bs`` rows and the draft model stores its KV there. After a request finishes, the padded rows still hold
the page ids of requests from an earlier, larger batch; the req-pool sink row does not protect a batch-ordered
table. A padded row therefore writes draft KV into early slots of a live request's first page, and that request's
attention (in the same replay and in every later step) reads the corrupted keys. Eager runs only ``bs`` rows.
Doctor: stale-padding, at ``_publish_draft_page_table`` (the publish leaves rows past ``bs`` holding real page ids
that the padded rows of the replay use as KV write locations inside other requests' pages).
Fix (upstream): ``_publish_draft_page_table`` also runs ``self.draft_page_table[bs:].zero_()``, so padded rows point
at dummy page 0.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/955"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_publish_draft_page_table"
SYMPTOM = "after the batch shrinks, padded draft rows overwrite a live request's KV: its drafts go wrong"

VOCAB, HIDDEN = 16, 8
PAGE_SIZE, MAX_PAGES, NUM_PAGES = 4, 4, 20       # page 0: the dummy page
MAX_BS = 4                                        # the one captured decode size (padded_bs)
SPEC_NUM_STEPS = 3                                # draft steps 2..N derive their write slots from the table


def compute_out_cache_loc_uniform(uniform_input_length, cache_start, page_table, page_size):
    """KV slots of ``uniform_input_length`` tokens per row from ``cache_start``, via the batch-ordered table."""
    positions = cache_start.view(-1, 1) + torch.arange(uniform_input_length, device=cache_start.device).view(1, -1)
    page_ids = page_table.long().gather(1, (positions // page_size).clamp(max=page_table.shape[1] - 1))
    return page_ids * page_size + positions % page_size


class InputBuffers:
    def __init__(self, device):
        self.seq_lens_buf = torch.ones(MAX_BS, dtype=torch.long, device=device)
        self.draft_ids_buf = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.hidden_buf = torch.zeros(MAX_BS, HIDDEN, device=device)


class Eagle:
    def __init__(self, device, page_table, input_buffers, token_to_kv_pool):
        gen = generator(955)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(MAX_PAGES * PAGE_SIZE, HIDDEN, gen=gen, device=device, scale=0.3)
        self.fc = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.page_table, self.input_buffers, self.k_cache = page_table, input_buffers, token_to_kv_pool
        self.page_size, self.spec_num_steps = PAGE_SIZE, SPEC_NUM_STEPS

    def _draft_forward(self, bs, draft_ids, hidden, positions, out_cache_loc, draft_seq_lens):
        h = torch.tanh(self.embed[draft_ids] + hidden @ self.fc + self.pos[positions])
        self.k_cache[out_cache_loc] = h                              # the draft step's KV write
        span = torch.arange(MAX_PAGES * PAGE_SIZE, device=h.device)
        locs = self.page_table[:bs].long().repeat_interleave(PAGE_SIZE, 1) * PAGE_SIZE + span % PAGE_SIZE
        keys = self.k_cache[locs]                                     # [bs, tokens, H]
        scores = (keys @ h.unsqueeze(-1)).squeeze(-1).masked_fill(span.view(1, -1) >= draft_seq_lens.view(-1, 1),
                                                                 float("-inf"))
        return (scores.softmax(-1).unsqueeze(-1) * keys).sum(1)

    def _run_multi_step_decode(self, bs):
        cache_start = self.input_buffers.seq_lens_buf[:bs].clone()
        # Write cache slots for steps 1..N-1.
        cache_locs = compute_out_cache_loc_uniform(self.spec_num_steps - 1, cache_start, self.page_table[:bs],
                                                   self.page_size)
        draft_seq_lens = cache_start + 1
        positions = cache_start.clone()
        draft_ids = self.input_buffers.draft_ids_buf[:bs]
        hidden = self.input_buffers.hidden_buf[:bs]
        outs = []
        for i in range(1, self.spec_num_steps):
            hidden = self._draft_forward(bs, draft_ids, hidden, positions, cache_locs[:, i - 1], draft_seq_lens)
            draft_ids = (hidden @ self.lm_head).argmax(-1)
            outs.append(hidden)
            positions = positions + 1
            draft_seq_lens = draft_seq_lens + 1
        return torch.stack(outs, 1)


class ModelExecutor:
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        # Batch-ordered page table (row i == batch position i). Graph-stable: the drafter's captured segments
        # record this buffer's address.
        self.draft_page_table = torch.zeros((MAX_BS, MAX_PAGES), dtype=torch.int32, device=device)
        self.input_buffers = InputBuffers(device)
        self.k_cache = randn(NUM_PAGES * PAGE_SIZE, HIDDEN, gen=generator(9550), device=device)
        self.drafter = Eagle(device, self.draft_page_table, self.input_buffers, self.k_cache)
        if graphed:
            bufs = self.input_buffers
            self.graph, self.out = capture(
                lambda: self.drafter._run_multi_step_decode(MAX_BS), device=device,
                owner="ModelExecutor (decode graph)", name=f"decode bs={MAX_BS}",
                state={"token_to_kv_pool": self.k_cache},
                static={"draft_page_table": self.draft_page_table, "seq_lens_buf": bufs.seq_lens_buf,
                        "draft_ids_buf": bufs.draft_ids_buf, "hidden_buf": bufs.hidden_buf})

    def _publish_draft_page_table(self, bs, table):
        width = table.shape[1]
        max_width = self.draft_page_table.shape[1]
        rows = self.draft_page_table[:bs]
        # -1 column pads -> dummy page 0 (negative locs otherwise).
        rows[:, :width].copy_(table)
        rows[:, :width].clamp_min_(0)
        if width < max_width:
            rows[:, width:].zero_()
        if self.variant == "fix":
            # Graph replay reads padded_bs rows; stale ids past bs alias another request's pages.
            self.draft_page_table[bs:].zero_()

    def forward_step(self, table, seq_lens, draft_ids, hidden):
        bs = seq_lens.shape[0]
        self._publish_draft_page_table(bs, table)
        bufs = self.input_buffers
        bufs.seq_lens_buf[:bs].copy_(seq_lens)
        bufs.draft_ids_buf[:bs].copy_(draft_ids)
        bufs.hidden_buf[:bs].copy_(hidden)
        if not self.graphed:
            return self.drafter._run_multi_step_decode(bs)
        bufs.seq_lens_buf[bs:].fill_(1)                  # cuda_graph_wrapper pads seq_lens with value=1
        padded = {"draft_ids_buf": bufs.draft_ids_buf, "hidden_buf": bufs.hidden_buf}
        if self.variant == "bug":
            padded["draft_page_table"] = self.draft_page_table
        return replay(self.graph, self.out, real=bs, size=MAX_BS, padded=padded)[:bs].clone()


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(955)
    # Requests A, B, C, D: their pages (page 0 is the dummy) and committed lengths at step 1.
    pages = {"A": [1, 2, 3], "B": [4, 5, 6, 7], "C": [8, 9], "D": [10, 11, 12]}
    lens = {"A": 5, "B": 9, "C": 3, "D": 6}
    # The batch shrinks as requests finish: C, then B. D moves up to a lower batch row.
    schedule = [["A", "B", "C", "D"], ["A", "B", "D"], ["A", "D"], ["A", "D"]]
    steps = []
    for step, batch in enumerate(schedule):
        width = max(len(pages[r]) for r in batch)
        table = torch.tensor([pages[r] + [-1] * (width - len(pages[r])) for r in batch], dtype=torch.int32)
        seq_lens = torch.tensor([lens[r] + step for r in batch])
        draft_ids = torch.randint(0, VOCAB, (len(batch),), generator=gen)
        hidden = torch.randn(len(batch), HIDDEN, generator=gen)
        steps.append((table, seq_lens, draft_ids, hidden))

    def serve(graphed: bool):
        executor = ModelExecutor(device, variant, graphed)
        return [executor.forward_step(*(t.to(device) for t in s)) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
