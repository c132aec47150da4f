"""DFlash maps CUDA-graph padding requests to context slot 0: they write into the real request that owns it.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/16548 ("[https://nvbugs/6451032][fix] Reserve extra dflash
context slot for dummy requests").
Symptom: with DFlash speculative decoding and CUDA-graph padding on, one request of a batch sees its acceptance
length collapse (about 3.0 down to about 0.55) at random; ``test_dflash_qwen3_5_4b`` was flaky and waived
(TensorRT-LLM main, July 2026). Eager runs, and batches that exactly fill a captured batch size, are clean.
Mechanism: ``DFlashWorker`` keeps a per-request context K/V cache of the drafter (``_ctx_k_buf`` /
``_ctx_v_buf``) and its length ``_ctx_len``, indexed by a persistent slot taken from ``_free_slots`` when a
request's prefill is stored. Each step it maps the batch's request ids to slots
(``self._req_to_slot.get(rid, 0)``) into ``_batch_to_slot``, which the captured draft forward reads. A batch
padded up to a captured size carries CUDA-graph dummy requests, whose ids have no slot: they get slot 0, the
slot of whichever real request took it first. In the replay the dummy rows append their own context K/V at
``_ctx_len[0]`` and advance ``_ctx_len[0]`` by their accepted tokens, so that request's drafter context
gains foreign rows and skips positions: its drafts stop matching the target and acceptance collapses.
Doctor: stale-padding, at ``prepare`` (the padded rows' slot ids: the default 0 is a live request's slot).
Fix (upstream): reserve one scratch slot for dummy requests: ``_ctx_len`` and the K/V buffers are sized
``max_batch + 1`` and ``_dummy_slot = max_batch`` is the default of the mapping; real requests still draw
slots ``0 .. max_batch - 1``.
"""
from __future__ import annotations

from collections import deque

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/16548"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "prepare"
SYMPTOM = "the request in context slot 0 drafts from a context polluted by CUDA-graph dummy rows (acceptance collapse)"
HIDDEN, VOCAB, MAX_CTX = 8, 12, 16
MAX_DRAFT_LEN = 2                         # K: K + 1 target tokens per gen request, K + 1 query tokens per block
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1
CUDA_GRAPH_BATCH_SIZE = 4                 # the captured decode batch; 2 real requests are padded with 2 dummies


class DFlashDraftModel:
    def __init__(self, device):
        gen = generator(16548)
        self.fc = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.wk = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.wv = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.4)
        self.mask_token_id = VOCAB - 1

    def precompute_context_kv(self, proj):
        return proj @ self.wk, proj @ self.wv


class DFlashWorker:
    def __init__(self, device, max_batch: int, fixed: bool):
        self.device, self.fixed = device, fixed
        num_rows = max_batch + 1 if fixed else max_batch
        if fixed:
            # One scratch slot for CUDA-graph padding / dummy requests, never handed out by _free_slots.
            self._dummy_slot = max_batch
        width = MAX_CTX + MAX_DRAFT_LEN + 1          # + block slack
        self._ctx_k_buf = torch.zeros(num_rows, width, HIDDEN, device=device)
        self._ctx_v_buf = torch.zeros(num_rows, width, HIDDEN, device=device)
        self._ctx_len = torch.zeros(num_rows, dtype=torch.long, device=device)
        self._batch_to_slot = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._free_slots = deque(range(max_batch))
        self._req_to_slot = {}

    def _store_prefill_context(self, draft_model, req_id, ctx_hidden):
        """A context request's captured target hidden states become its drafter context."""
        slot = self._free_slots.popleft()
        self._req_to_slot[req_id] = slot
        n = ctx_hidden.shape[0]
        k, v = draft_model.precompute_context_kv(ctx_hidden @ draft_model.fc)
        self._ctx_k_buf[slot, :n] = k
        self._ctx_v_buf[slot, :n] = v
        self._ctx_len[slot] = n

    def prepare(self, request_ids):
        """Map this step's requests (CUDA-graph dummies included) to their context slots."""
        default = self._dummy_slot if self.fixed else 0
        mapping = [self._req_to_slot.get(rid, default) for rid in request_ids]
        self._batch_to_slot[:len(request_ids)].copy_(torch.tensor(mapping, dtype=torch.long, device=self.device))

    def forward(self, draft_model, target_hidden, num_accepted, bonus, num_gens: int):
        """The draft half of a gen step: append the accepted tokens' context K/V, then draft K tokens."""
        K = MAX_DRAFT_LEN
        slots = self._batch_to_slot[:num_gens]
        ctx_len_gen = self._ctx_len[slots]
        offsets_kp1 = torch.arange(K + 1, device=target_hidden.device)
        col_idx = (ctx_len_gen.unsqueeze(1) + offsets_kp1.unsqueeze(0)).clamp(max=self._ctx_k_buf.shape[1] - 1)
        write_mask = (offsets_kp1.unsqueeze(0) < num_accepted.unsqueeze(1)).unsqueeze(-1)
        k, v = draft_model.precompute_context_kv(target_hidden @ draft_model.fc)       # [num_gens, K + 1, H]
        rows = slots.unsqueeze(1).expand_as(col_idx)
        self._ctx_k_buf[rows, col_idx] = torch.where(write_mask, k, self._ctx_k_buf[rows, col_idx])
        self._ctx_v_buf[rows, col_idx] = torch.where(write_mask, v, self._ctx_v_buf[rows, col_idx])
        self._ctx_len.index_add_(0, slots, num_accepted)                             # _advance_ctx_len
        # Noise block: the bonus token followed by K mask tokens attends over the request's context.
        mask_emb = draft_model.embed_tokens[draft_model.mask_token_id].expand(num_gens, K, HIDDEN)
        noise_embedding = torch.cat([draft_model.embed_tokens[bonus].unsqueeze(1), mask_emb], dim=1)
        q = noise_embedding @ draft_model.wq
        ctx_k, ctx_v = self._ctx_k_buf[slots], self._ctx_v_buf[slots]
        valid = torch.arange(ctx_k.shape[1], device=q.device).unsqueeze(0) < self._ctx_len[slots].unsqueeze(1)
        scores = (q @ ctx_k.transpose(1, 2)).masked_fill(~valid.unsqueeze(1), float("-inf"))
        out = torch.softmax(scores / HIDDEN ** 0.5, dim=-1) @ ctx_v
        return torch.log_softmax(out[:, 1:] @ draft_model.lm_head, dim=-1)              # K draft positions


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(6451032)
    prompts = {7: torch.randn(5, HIDDEN, generator=gen), 9: torch.randn(4, HIDDEN, generator=gen)}
    steps = [(torch.randn(2, MAX_DRAFT_LEN + 1, HIDDEN, generator=gen), torch.tensor([3, 1]),
              torch.randint(0, VOCAB - 1, (2,), generator=gen)) for _ in range(3)]

    def serve(graphed: bool):
        draft_model = DFlashDraftModel(device)
        worker = DFlashWorker(device, max_batch=CUDA_GRAPH_BATCH_SIZE, fixed=(variant == "fix"))
        size = CUDA_GRAPH_BATCH_SIZE
        target_hidden = torch.zeros(size, MAX_DRAFT_LEN + 1, HIDDEN, device=device)
        num_accepted = torch.ones(size, dtype=torch.long, device=device)     # the bonus token is always accepted
        bonus = torch.zeros(size, dtype=torch.long, device=device)
        if graphed:
            # Warmup/capture run on dummy requests only; context lengths are restored afterwards.
            worker.prepare([CUDA_GRAPH_DUMMY_REQUEST_ID] * size)
            saved_ctx_len = worker._ctx_len.clone()
            g, out = capture(lambda: worker.forward(draft_model, target_hidden, num_accepted, bonus, size),
                             device=device, warmups=2, name=f"bs {size}",
                             static={"target_hidden": target_hidden, "num_accepted": num_accepted, "bonus": bonus,
                                     "_batch_to_slot": worker._batch_to_slot},
                             state={"_ctx_k_buf": worker._ctx_k_buf, "_ctx_v_buf": worker._ctx_v_buf,
                                    "_ctx_len": worker._ctx_len}, owner="DFlashWorker (one-model spec decode)")
            worker._ctx_len.copy_(saved_ctx_len)
        for req_id, hidden in prompts.items():
            worker._store_prefill_context(draft_model, req_id, hidden.to(device))
        request_ids = list(prompts)
        outs = []
        for hidden, accepted, bonus_ids in steps:
            n = len(request_ids)
            if not graphed:
                worker.prepare(request_ids)
                outs.append(worker.forward(draft_model, hidden.to(device), accepted.to(device), bonus_ids.to(device),
                                           n).clone())
                continue
            # The scheduled batch is padded with CUDA-graph dummy requests up to the captured size.
            worker.prepare(request_ids + [CUDA_GRAPH_DUMMY_REQUEST_ID] * (size - n))
            target_hidden[:n].copy_(hidden.to(device))
            num_accepted[:n].copy_(accepted.to(device))
            bonus[:n].copy_(bonus_ids.to(device))
            outs.append(replay(g, out, real=n, size=size, padded={"_batch_to_slot": worker._batch_to_slot})[:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
