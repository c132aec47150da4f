"""Captured KV scatter writes every padded row to (page 0, slot 0), and page 0 is an allocatable page of a live request.

Upstream: https://github.com/mstar-project/mstar/commit/1c5814e6984687f5cf7e0e18b9afd4f6e4bbb4e9 ("engine: reserve a
null page for padded captured-scatter tails", August 2026).
Symptom (commit message): once the page pool wraps, every padded graph replay silently corrupts one cached token of
a live request (in all layer planes); "invisible to greedy verify and to short parity runs" (they never wrap the
pool). Eager is right.
Mechanism (from the diff and the code at its parent): ``FlashInferPrefillWrapper.set_kv_cache`` (and
``FlashInferMLAWrapper.set_latent``) scatters K/V with ``n = self._total_tokens``, a host int: inside the captured
piecewise/packed-prefill graphs it is the capture bucket's row count, so every replay scatters all bucket rows,
padding included. ``plan`` (outside the graph) copies the real ``token_to_page[:total_tokens]`` /
``token_to_cache[:total_tokens]`` into the static buffers and zero-fills the tail (``if total_tokens <
self.max_total_tokens: self.token_to_page[total_tokens:] = 0``), so each padded row writes its garbage K/V (what the
stale tail of ``hidden_states`` projects to) into (page 0, slot 0). ``PageAllocator.__init__`` put every page,
page 0 included, in its FIFO ``free_pages`` queue: after the pool wraps, page 0 belongs to a live request, and a
padded replay overwrites that request's cached token, which its attention then reads. An eager step scatters only
its ``total_tokens`` real rows.
Doctor: stale-padding, at ``plan`` (it aims the padded tail of the captured scatter at (0, 0), a slot of the KV pool
that real rows attend to, so real outputs depend on what the padded rows hold).
Fix (upstream): ``NULL_PAGE_IDX = 0`` in flashinfer_utils; ``plan`` aims the tail at ``NULL_PAGE_IDX``;
``PageAllocator(max_num_pages, reserve_null_page=False)`` starts its free queue at ``NULL_PAGE_IDX + 1`` when the
flag is set, and ``PagedAllocationManager`` builds ``PageAllocator(config.max_num_pages, reserve_null_page=True)``:
the padded tail lands in a sink page no request owns.
Modelled: one attention layer of a packed-prefill graph at one token bucket, a 5-page pool of 2-token pages.
"""
from __future__ import annotations

import math
import queue

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/mstar-project/mstar/commit/1c5814e6984687f5cf7e0e18b9afd4f6e4bbb4e9"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "plan"
SYMPTOM = "padded graph replays scatter garbage K/V into slot 0 of page 0, a live request's page once the pool wraps"

NULL_PAGE_IDX = 0
HIDDEN, HEAD_DIM = 8, 8
PAGE_SIZE, MAX_NUM_PAGES = 2, 5
MAX_TOTAL_TOKENS = 4                 # the captured packed-prefill bucket
MAX_KV_LEN = 3 * PAGE_SIZE


class PageAllocator:
    def __init__(self, max_num_pages: int, reserve_null_page: bool = False):
        self.max_num_pages = max_num_pages
        self.free_pages: queue.Queue[int] = queue.Queue()
        first_page = NULL_PAGE_IDX + 1 if reserve_null_page else 0
        for i in range(first_page, max_num_pages):
            self.free_pages.put(i)

    def allocate(self, n: int) -> list[int]:
        if self.free_pages.qsize() < n:
            raise RuntimeError(f"Not enough free pages: requested {n}, available {self.free_pages.qsize()}")
        return [self.free_pages.get() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        for page in pages:
            self.free_pages.put(page)


class PagedAllocationManager:
    def __init__(self, variant: str):
        self.page_allocator = PageAllocator(MAX_NUM_PAGES, reserve_null_page=(variant == "fix"))
        self.request_states: dict[str, tuple[list[int], int]] = {}     # request -> (pages, kv length)

    def append(self, rid: str, num_new: int) -> tuple[list[int], int]:
        pages, kv_len = self.request_states.get(rid, ([], 0))
        need = -(-(kv_len + num_new) // PAGE_SIZE) - len(pages)
        pages = pages + self.page_allocator.allocate(need)
        self.request_states[rid] = (pages, kv_len + num_new)
        return self.request_states[rid]

    def reset_label(self, rid: str) -> None:
        self.page_allocator.free(self.request_states.pop(rid)[0])


class FlashInferPrefillWrapper:
    def __init__(self, device, max_total_tokens: int):
        self.device, self.max_total_tokens = device, max_total_tokens
        # Static buffers for vectorized KV cache writes (CUDA graph mode)
        self.token_to_page = torch.zeros(max_total_tokens, dtype=torch.long, device=device)
        self.token_to_cache = torch.zeros(max_total_tokens, dtype=torch.long, device=device)
        # what attn_wrapper.plan leaves in its static buffers: each query row's KV slots and length
        self._kv_slots_buf = torch.zeros(max_total_tokens, MAX_KV_LEN, dtype=torch.long, device=device)
        self._kv_len_buf = torch.ones(max_total_tokens, dtype=torch.long, device=device)
        self._total_tokens = 0

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
        n_req = qo_indptr.shape[0] - 1
        starts = qo_indptr[:-1]
        lens = qo_indptr[1:] - qo_indptr[:-1]
        total_tokens = int(lens.sum().item())
        self._total_tokens = total_tokens
        num_pages_after = paged_kv_indptr[1:] - paged_kv_indptr[:-1]
        kv_len_after = (num_pages_after - 1) * PAGE_SIZE + paged_kv_last_page_len
        seg = torch.repeat_interleave(torch.arange(n_req), lens)
        intra = torch.arange(total_tokens) - torch.repeat_interleave(starts, lens)
        g = kv_len_after[seg] - lens[seg] + intra                # absolute KV position per token
        page_off = torch.div(g, PAGE_SIZE, rounding_mode="floor")
        abs_page_ptr = paged_kv_indptr[:-1][seg] + page_off
        token_to_page = paged_kv_indices[abs_page_ptr]
        token_to_cache = g - page_off * PAGE_SIZE
        self.token_to_page[:total_tokens].copy_(token_to_page.to(self.device))
        self.token_to_cache[:total_tokens].copy_(token_to_cache.to(self.device))
        if total_tokens < self.max_total_tokens:
            # The captured set_kv_cache scatter writes max_total_tokens rows every replay.
            self.token_to_page[total_tokens:] = NULL_PAGE_IDX
            self.token_to_cache[total_tokens:] = 0
        # attention plan (causal over the request's pages)
        j = torch.arange(MAX_KV_LEN)
        ptr = (paged_kv_indptr[:-1][seg][:, None] + j // PAGE_SIZE).clamp(max=paged_kv_indices.shape[0] - 1)
        slots = torch.where(j <= g[:, None], paged_kv_indices[ptr] * PAGE_SIZE + j % PAGE_SIZE, 0)
        self._kv_slots_buf[:total_tokens].copy_(slots.to(self.device))
        self._kv_len_buf[:total_tokens].copy_((g + 1).to(self.device))
        self._kv_slots_buf[total_tokens:] = 0
        self._kv_len_buf[total_tokens:] = 1

    def run(self, q, kv_cache_layer):
        t = q.shape[0]
        k = kv_cache_layer[:, 0].reshape(-1, HEAD_DIM)[self._kv_slots_buf[:t]]
        v = kv_cache_layer[:, 1].reshape(-1, HEAD_DIM)[self._kv_slots_buf[:t]]
        scores = torch.einsum("td,tld->tl", q, k) / math.sqrt(HEAD_DIM)
        mask = torch.arange(MAX_KV_LEN, device=q.device)[None, :] >= self._kv_len_buf[:t, None]
        return torch.einsum("tl,tld->td", torch.softmax(scores.masked_fill(mask, -1e9), -1), v)

    def set_kv_cache(self, kv_cache_layer, k, v):
        n = self._total_tokens                      # a host int: the bucket size inside the captured graph
        page_idx = self.token_to_page[:n]
        cache_idx = self.token_to_cache[:n]
        kv_cache_layer[page_idx, 0, cache_idx] = k[:n]
        kv_cache_layer[page_idx, 1, cache_idx] = v[:n]


class AttentionLayer:
    def __init__(self, device, wrapper):
        gen = generator(1)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.6)
                                              for _ in range(4))
        self.kv_cache = torch.zeros(MAX_NUM_PAGES, 2, PAGE_SIZE, HEAD_DIM, device=device)
        self.wrapper = wrapper

    def forward(self, hidden_states):
        q, k, v = hidden_states @ self.wq, hidden_states @ self.wk, hidden_states @ self.wv
        self.wrapper.set_kv_cache(self.kv_cache, k, v)
        return hidden_states + self.wrapper.run(q, self.kv_cache) @ self.wo.T


class Engine:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.manager = PagedAllocationManager(variant)
        self.wrapper = FlashInferPrefillWrapper(device, MAX_TOTAL_TOKENS)
        self.layer = AttentionLayer(device, self.wrapper)
        self.hidden_states = torch.zeros(MAX_TOTAL_TOKENS, HIDDEN, device=device)
        self.graph = None
        if graphed:
            # capture with a dummy plan: one request filling the bucket on the first pages
            self.wrapper.plan(torch.tensor([0, MAX_TOTAL_TOKENS]), torch.tensor([0, 2]), torch.tensor([0, 1]),
                              torch.tensor([PAGE_SIZE]))
            w = self.wrapper
            self.graph = capture(
                lambda: self.layer.forward(self.hidden_states), device=device, name="packed prefill",
                owner="mstar piecewise graph", static={"hidden_states": self.hidden_states,
                                                       "token_to_page": w.token_to_page,
                                                       "token_to_cache": w.token_to_cache,
                                                       "kv_slots": w._kv_slots_buf, "kv_len": w._kv_len_buf},
                state={"kv_cache": self.layer.kv_cache})

    def step(self, batch, hidden, finished):
        qo, kv_indptr, kv_indices, last = [0], [0], [], []
        for rid, num_new in batch:
            pages, kv_len = self.manager.append(rid, num_new)
            qo.append(qo[-1] + num_new)
            kv_indices += pages
            kv_indptr.append(len(kv_indices))
            last.append(kv_len - (len(pages) - 1) * PAGE_SIZE)
        self.wrapper.plan(torch.tensor(qo), torch.tensor(kv_indptr), torch.tensor(kv_indices), torch.tensor(last))
        n = qo[-1]
        self.hidden_states[:n].copy_(hidden)
        if self.graph is None:
            out = self.layer.forward(self.hidden_states[:n]).clone()
        else:
            g, outputs = self.graph
            out = replay(g, outputs, real=n, size=MAX_TOTAL_TOKENS,
                         padded={"hidden_states": self.hidden_states})[:n].clone()
        for rid in finished:
            self.manager.reset_label(rid)
        return out


# (requests with their new tokens, requests finished after the step); the pool wraps at step 2
STEPS = [
    ([("r0", 4)], ["r0"]),
    ([("r1", 3)], []),
    ([("r2", 4)], ["r1"]),
    ([("r2", 1), ("r3", 2)], []),
]


def run(variant: str, device: str = "cpu"):
    gen = generator(5814)
    hiddens = [randn(sum(n for _, n in batch), HIDDEN, gen=gen, device=device) for batch, _ in STEPS]

    def serve(graphed: bool):
        engine = Engine(device, variant, graphed)
        return [engine.step(batch, h, finished) for (batch, finished), h in zip(STEPS, hiddens)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
