"""NaN router logits of CUDA-graph padding rows make ``topk_softmax`` pick expert 0 k times; the MoE finalize then follows wild rows.

Upstream: https://github.com/vllm-project/vllm/pull/39391 ("fix: clamp NaN/Inf in topk_softmax to prevent
duplicate expert IDs"), fixing https://github.com/vllm-project/vllm/issues/39244 and
https://github.com/vllm-project/vllm/issues/39288 (FlashInfer CUTLASS MoE illegal memory access with CUDA graphs).
Symptom: MoE models (Qwen3.5-397B-A17B-FP8 on H200, Qwen3-Next-80B BF16 on H100) served with the FlashInfer
CUTLASS MoE backend and CUDA graphs crash with ``cudaErrorIllegalAddress`` in ``finalizeMoeRoutingKernel`` as
soon as a batch is padded to a capture size (more often under DP, whose padding is larger); eager mode is fine
(vLLM main, April 2026).
Mechanism: a replay pads the batch to the captured size; the padded request rows have ``seq_lens`` 0, so their
attention softmax has no keys and yields NaN (0/0), which flows through the norm into the router logits.
The ``topkGating`` kernel's selection loop keeps the first expert unless a later score is strictly greater,
and ``NaN > NaN`` (or ``NaN > -inf``) is false, so every top-k slot of a padded token is expert 0. The
CUTLASS MoE sort assumes distinct experts per token: it fills one permuted row per (token, expert) pair, so
the duplicate slot's entry of the unpermuted-to-permuted map is never written and keeps uninitialised
memory, which ``finalizeMoeRoutingKernel`` dereferences for every token of the step: the whole batch fails.
Eager runs the real rows only, with no NaN.
Doctor: stale-padding, at ``topk_softmax`` (the routing of the padded rows, decided by what they hold,
breaks the real rows' MoE step).
Fix (upstream): in ``topkGating``, clamp NaN/Inf scores to 0 after softmax/sigmoid and before the selection
loop; all-zero scores pick distinct experts ``[0, 1, ..., k-1]`` by index tie-breaking.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/39391"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "topk_softmax"
SYMPTOM = "padded batches crash the FlashInfer CUTLASS MoE (illegal address): NaN padding rows route to expert 0 twice"

VOCAB, DIM, NUM_EXPERTS, TOPK, MAX_LEN = 12, 4, 4, 2, 8
MAX_NUM_SEQS = 4
CAPTURE_SIZES = [MAX_NUM_SEQS]
NULL_REGION = 0                                   # KV region of padded rows (a null block)
UNINITIALIZED = 1 << 40                           # stands for the garbage of an entry never written


def topk_softmax(gating_output, topk: int, variant: str):
    """``topkGating``: softmax, then k passes of an argmax that keeps the first expert unless a later score
    is strictly greater (as the kernel's comparison loop does); the chosen expert is masked with -inf."""
    scores = torch.softmax(gating_output.float(), dim=-1)
    if variant == "fix":
        scores = torch.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0)    # the fix
    topk_weights, topk_ids = [], []
    for _ in range(topk):
        best_val = scores[:, 0]
        best_idx = torch.zeros_like(scores[:, 0], dtype=torch.long)
        for e in range(1, scores.shape[1]):
            better = scores[:, e] > best_val
            best_val = torch.where(better, scores[:, e], best_val)
            best_idx = torch.where(better, torch.full_like(best_idx, e), best_idx)
        topk_weights.append(best_val)
        topk_ids.append(best_idx)
        scores = scores.scatter(1, best_idx[:, None], float("-inf"))
    return torch.stack(topk_weights, 1), torch.stack(topk_ids, 1)


def cutlass_moe_sort(topk_ids):
    """The three-step sort: one permuted row per (token, expert) pair, grouped by expert. A token's repeated
    expert gets no row of its own: that entry of the unpermuted-to-permuted map is never written."""
    t, k = topk_ids.shape
    pair = torch.zeros(t, NUM_EXPERTS, dtype=torch.long, device=topk_ids.device)
    pair.scatter_(1, topk_ids, 1)                                              # distinct (token, expert)
    per_expert = pair.sum(0)
    expert_first_row = torch.cumsum(per_expert, 0) - per_expert
    rank_in_expert = torch.cumsum(pair, 0) - pair                              # earlier tokens, same expert
    dest = expert_first_row[topk_ids] + rank_in_expert.gather(1, topk_ids)    # [t, k]
    first_slot = torch.ones_like(topk_ids, dtype=torch.bool)
    for j in range(1, k):
        first_slot[:, j] = (topk_ids[:, j:j + 1] != topk_ids[:, :j]).all(1)
    unpermuted_row_to_permuted_row = torch.where(first_slot, dest, torch.full_like(dest, UNINITIALIZED))
    permuted_expert = torch.zeros(t * k, dtype=torch.long, device=topk_ids.device)
    permuted_expert.scatter_(0, dest.reshape(-1), topk_ids.reshape(-1))
    permuted_token = torch.zeros(t * k, dtype=torch.long, device=topk_ids.device)
    permuted_token.scatter_(0, dest.reshape(-1), torch.arange(t, device=topk_ids.device).repeat_interleave(k))
    return permuted_token, permuted_expert, unpermuted_row_to_permuted_row


def flashinfer_cutlass_moe(hidden_states, topk_weights, topk_ids, w1, w2):
    permuted_token, permuted_expert, unpermuted_row_to_permuted_row = cutlass_moe_sort(topk_ids)
    x = hidden_states[permuted_token]                                          # expandInputRows
    inter = torch.relu(torch.bmm(x[:, None, :], w1[permuted_expert])[:, 0])   # grouped GEMM 1 + act
    expert_out = torch.bmm(inter[:, None, :], w2[permuted_expert])[:, 0]      # grouped GEMM 2
    # finalizeMoeRoutingKernel: every token gathers its k rows through the map
    rows = expert_out[unpermuted_row_to_permuted_row.reshape(-1)].view(*topk_ids.shape, -1)
    return (topk_weights[..., None] * rows).sum(1)


class Qwen3MoeModel:
    def __init__(self, device, variant: str):
        gen = generator(39391)
        self.variant = variant
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(3))
        self.gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.w1 = randn(NUM_EXPERTS, DIM, 2 * DIM, gen=gen, device=device, scale=0.5)
        self.w2 = randn(NUM_EXPERTS, 2 * DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, slot_mapping, region, seq_lens, k_cache, v_cache):
        h = self.emb[input_ids]
        q = h @ self.wq
        k_cache.index_copy_(0, slot_mapping, h @ self.wk)                     # reshape_and_cache
        v_cache.index_copy_(0, slot_mapping, h @ self.wv)
        pos = torch.arange(MAX_LEN, device=h.device)
        slots = region[:, None] * MAX_LEN + pos[None, :]
        e = torch.exp((q[:, None, :] * k_cache[slots]).sum(-1) / DIM ** 0.5)
        e = torch.where(pos[None, :] < seq_lens[:, None], e, torch.zeros_like(e))
        attn = (e[..., None] * v_cache[slots]).sum(1) / e.sum(1, keepdim=True)    # seq_lens 0: 0/0
        h = h + attn
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)            # RMSNorm
        router_logits = h @ self.gate
        topk_weights, topk_ids = topk_softmax(router_logits, TOPK, self.variant)
        h = h + flashinfer_cutlass_moe(h, topk_weights, topk_ids, self.w1, self.w2)
        return h @ self.lm_head


# requests: region of the KV cache (region 0 is the null region), prompt tokens
REQUESTS = [(1, [3, 7, 1]), (2, [5, 2, 9, 4]), (3, [8, 6]), (4, [2, 11])]


def run(variant: str, device: str = "cpu"):
    model = Qwen3MoeModel(device, variant)

    def serve(graphed: bool):
        k_cache = torch.zeros((len(REQUESTS) + 2) * MAX_LEN, DIM, device=device)
        v_cache = torch.zeros_like(k_cache)
        scratch_slot = k_cache.shape[0] - 1                                     # PAD_SLOT_ID target
        bufs = {"input_ids": torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device),
                "slot_mapping": torch.full((MAX_NUM_SEQS,), scratch_slot, dtype=torch.long, device=device),
                "region": torch.full((MAX_NUM_SEQS,), NULL_REGION, dtype=torch.long, device=device),
                "seq_lens": torch.ones(MAX_NUM_SEQS, dtype=torch.long, device=device)}

        def forward(n):
            return model.forward(bufs["input_ids"][:n], bufs["slot_mapping"][:n], bufs["region"][:n],
                                 bufs["seq_lens"][:n], k_cache, v_cache)

        manager = None
        if graphed:   # capture: a dummy decode batch, one token per request on the null region
            manager = GraphManager(forward, CAPTURE_SIZES, device=device, mode=CUDAGraphMode.FULL,
                                   static_buffers=bufs, name="GPUModelRunner (FULL decode)")
            manager.capture()
        for region, prompt in REQUESTS:                                         # prefill (eager)
            h = model.emb[torch.tensor(prompt, device=device)]
            slots = torch.arange(len(prompt), device=device) + region * MAX_LEN
            k_cache[slots], v_cache[slots] = h @ model.wk, h @ model.wv
        lens = {region: len(prompt) for region, prompt in REQUESTS}
        outs = []
        # decode: all four requests, then the fourth finishes and three run padded to the captured size 4
        for step, live in enumerate([REQUESTS, REQUESTS, REQUESTS[:3], REQUESTS[:3]]):
            n = len(live)
            ids = [(prompt[-1] + 3 * step + i) % VOCAB for i, (_, prompt) in enumerate(live)]
            bufs["input_ids"][:n].copy_(torch.tensor(ids))
            bufs["slot_mapping"][:n].copy_(torch.tensor([r * MAX_LEN + lens[r] for r, _ in live]))
            bufs["region"][:n].copy_(torch.tensor([r for r, _ in live]))
            bufs["seq_lens"][:n].copy_(torch.tensor([lens[r] + 1 for r, _ in live]))
            # padded rows: PAD_SLOT_ID, null block, seq_lens 0 (as the runner neutralises them)
            bufs["input_ids"][n:].zero_()
            bufs["slot_mapping"][n:].fill_(scratch_slot)
            bufs["region"][n:].fill_(NULL_REGION)
            bufs["seq_lens"][n:].zero_()
            if manager is None:
                outs.append(forward(n).clone())
            else:
                outs.append(manager.replay(manager.dispatch(n), n).clone())
            for r, _ in live:
                lens[r] += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
