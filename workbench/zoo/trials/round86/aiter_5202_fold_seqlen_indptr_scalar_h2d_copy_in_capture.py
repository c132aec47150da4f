"""AITER persistent MLA decode with head folding: ``_fold_seqlen_indptr`` seeds the folded indptr with ``out[0] = 0``, a host-to-device copy of a Python scalar, inside vLLM's FULL decode graph capture.

Upstream: https://github.com/ROCm/aiter/pull/5202 ("[Bugfix] Make `_fold_seqlen_indptr` cudagraph-safe (avoid scalar
H2D copy)", ROCm/aiter, opened 2026-09-02, merged; backported to release/v0.1.21 as #5222). Read: the PR description (the
old three-line body of ``_fold_seqlen_indptr``, the error, the vLLM CI test that exposed it), the description of the
closed duplicate #5354 (the exact torch error text, the head-folding condition), and a stored post-fix ``aiter/mla.py``
(``_fold_seqlen_indptr`` with ``F.pad`` and its caller in ``mla_decode_fwd``: ``nhead in range(32, 128 + 1, 16) and
persistent_mode`` -> ``fold_factor = ori_nhead // 16``, ``q``/``o`` viewed as 16-head pseudo-batches,
``qo_indptr = _fold_seqlen_indptr(qo_indptr, fold_factor)``). Not read: the PR's diff hunks as such, the asm stage-1
kernel, ``get_mla_metadata_v1``, vLLM's ``rocm_aiter_mla.py`` of that date.
Symptom: vLLM on MI300 (gfx942) with the ROCm AITER MLA backend and FULL decode CUDA graphs (CI:
``test_eagle_correctness_light[ROCM_AITER_FA-deepseek_eagle]``) dies while capturing: ``mla_decode_fwd`` ->
``torch.ops.vllm.rocm_aiter_mla_decode_fwd`` raises "operation not permitted when stream is capturing" / "Cannot copy
between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned". Eager decode is fine.
Mechanism: for a head count the persistent asm kernel does not serve natively (bf16 with 32-128 heads per rank on
gfx942), ``mla_decode_fwd`` folds the heads into 16-head pseudo-batches and rebuilds ``qo_indptr`` with
``_fold_seqlen_indptr``: ``out = torch.empty(..., device=indptr.device); out[0] = 0; out[1:] = cumsum(...)``. The
assignment of a Python number into a device tensor is staged through unpinned host memory (a pageable
host-to-device copy, which synchronises the host with the stream). vLLM captures the whole decode forward
(``AiterMLAImpl._forward_decode`` included) as one FULL graph, so that copy is issued on a capturing stream and the
capture is refused.
Doctor: sync-in-capture, at _fold_seqlen_indptr. A pageable host-to-device copy (a host synchronisation) is issued
inside the captured region.
Fix (upstream): build the leading zero on the device: ``out = torch.nn.functional.pad(cumsum, (1, 0), value=0)``;
values, dtype and shape are unchanged.
Modelled: vLLM's ``AiterMLAMetadataBuilder._build_decode`` filling persistent ``qo_indptr`` / ``paged_kv_indptr`` /
``paged_kv_indices`` / ``paged_kv_last_page_len`` and a persistent ``work_info_set`` (stand-in for
``get_mla_metadata_v1``'s work plan: pseudo-batch -> request), ``AiterMLAImpl._forward_decode`` and aiter's
``mla_decode_fwd`` head-folding branch and ``_fold_seqlen_indptr`` as upstream has them. Stand-ins: 2 heads play the
natively served 16, 4 heads per rank play 64; ``mla_decode_stage1_asm_fwd`` is one split of latent attention (scores
``q . c``, output the weighted ``c``) over a page-size-1 latent cache; ``mla_reduce_v1`` (a single split) is left out.
The model is one MLA layer (q projection, latent cache write at ``slot_mapping``, o projection, lm head) with
hidden 8, latent 6, vocab 10 (float64). FULL decode graphs at 2 and 4 requests are captured largest first after one
eager warm-up; padded requests get zero-length KV ranges and write latent slot 0 (the null slot).
Workload: requests A-D with prefilled latents (prompt lengths 3, 5, 2, 4); decode steps of A-B, A-C (3 padded to 4)
and A-D. Bug: capturing the 4-request graph raises ``CaptureError`` at ``out[0] = 0``. Fix: capture succeeds and the
three steps' logits equal eager.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/5202"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_fold_seqlen_indptr"
SYMPTOM = ("ROCm AITER MLA with FULL decode graphs on MI300: capture of the decode forward fails in mla_decode_fwd "
           "('Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned') "
           "because _fold_seqlen_indptr writes out[0] = 0")

HIDDEN, LATENT, VOCAB = 8, 6, 10
NATIVE_HEADS = 2              # stand-in for the 16 heads the persistent asm kernel serves natively
NUM_HEADS = 4                 # stand-in for 64 heads per rank: folded into 2 pseudo-batches
MAX_NUM_REQS, MAX_PAGES_PER_REQ = 4, 8
NUM_SLOTS = 1 + MAX_NUM_REQS * MAX_PAGES_PER_REQ          # slot 0: null
CUDAGRAPH_CAPTURE_SIZES = [2, 4]

_variant = "bug"


# ---- aiter/mla.py -------------------------------------------------------------------------------
def _fold_seqlen_indptr(indptr, fold_factor):
    """Repeat each batch's seqlen ``fold_factor`` times (head-folding pseudo-batches)."""
    lens = indptr[1:] - indptr[:-1]
    folded_lens = lens.repeat_interleave(fold_factor)
    if _variant == "fix":
        cumsum = torch.cumsum(folded_lens, dim=0).to(indptr.dtype)
        return torch.nn.functional.pad(cumsum, (1, 0), value=0)
    out = torch.empty(folded_lens.numel() + 1, dtype=indptr.dtype, device=indptr.device)
    out[0] = 0
    out[1:] = torch.cumsum(folded_lens, dim=0).to(indptr.dtype)
    return out


def mla_decode_stage1_asm_fwd(q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, work_info_set,
                              max_seqlen_q, sm_scale, o):
    """Stand-in for the persistent asm kernel: one split per pseudo-batch, latent attention over page-size-1 KV."""
    num_pseudo = qo_indptr.shape[0] - 1
    rows = qo_indptr[:-1]                                           # max_seqlen_q == 1
    req = work_info_set[:num_pseudo]                                # pseudo-batch -> request (work plan)
    start, length = kv_indptr[req], kv_indptr[req + 1] - kv_indptr[req]
    j = torch.arange(MAX_PAGES_PER_REQ, device=q.device)
    pages = kv_indices[(start.unsqueeze(1) + j).clamp(max=kv_indices.shape[0] - 1)]       # [P, J]
    c = kv_buffer[pages, 0, 0]                                                             # [P, J, D]
    qp = q[rows]                                                                           # [P, h, D]
    scores = torch.einsum("phd,pjd->phj", qp, c) * sm_scale
    scores = scores.masked_fill((j.unsqueeze(0) >= length.unsqueeze(1)).unsqueeze(1), -1e9)
    o[rows] = torch.einsum("phj,pjd->phd", torch.softmax(scores, -1), c)


def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                   sm_scale, work_info_set, persistent_mode=True):
    ori_total_s, ori_nhead, _ = q.shape
    nhead, io_transformed = ori_nhead, False
    if nhead == NATIVE_HEADS:
        pass                                                         # natively supported
    elif nhead in range(2 * NATIVE_HEADS, 8 * NATIVE_HEADS + 1, NATIVE_HEADS) and persistent_mode:
        fold_factor = ori_nhead // NATIVE_HEADS
        nhead = NATIVE_HEADS
        total_s = ori_total_s * fold_factor
        q = q.view(total_s, nhead, -1)
        o = o.view(total_s, nhead, -1)
        qo_indptr = _fold_seqlen_indptr(qo_indptr, fold_factor)
        io_transformed = True
    else:
        raise AssertionError(f"{nhead=} and {max_seqlen_q=} not supported")
    mla_decode_stage1_asm_fwd(q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, work_info_set,
                              max_seqlen_q, sm_scale, o)
    if io_transformed:
        o = o.view(ori_total_s, ori_nhead, -1)
    return o


# ---- vLLM: rocm_aiter_mla.py --------------------------------------------------------------------
class AiterMLAMetadataBuilder:
    """Persistent decode metadata for FULL graphs (padded requests: zero-length KV, repeated indptr)."""

    def __init__(self, device):
        self.qo_indptr = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.paged_kv_indptr = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.paged_kv_indices = torch.zeros(MAX_NUM_REQS * MAX_PAGES_PER_REQ, dtype=torch.int64, device=device)
        self.paged_kv_last_page_len = torch.ones(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.work_info_set = torch.zeros(MAX_NUM_REQS * NUM_HEADS, dtype=torch.int64, device=device)

    def _build_decode(self, seq_lens: list[int], block_table: torch.Tensor, num_reqs_padded: int):
        n = len(seq_lens)
        lens = torch.tensor(seq_lens + [0] * (num_reqs_padded - n), dtype=torch.int32)
        indptr = torch.zeros(num_reqs_padded + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(lens, 0)
        indices = torch.cat([block_table[i, :seq_lens[i]] for i in range(n)])
        self.paged_kv_indptr[:num_reqs_padded + 1].copy_(indptr.to(self.paged_kv_indptr.device))
        self.paged_kv_indices[:indices.numel()].copy_(indices.to(self.paged_kv_indices.device))
        self.qo_indptr[:num_reqs_padded + 1].copy_(torch.arange(num_reqs_padded + 1, dtype=torch.int32))
        fold = NUM_HEADS // NATIVE_HEADS                                 # get_mla_metadata_v1 stand-in
        self.work_info_set[:num_reqs_padded * fold].copy_(torch.arange(num_reqs_padded * fold) // fold)
        return {"qo_indptr": self.qo_indptr[:num_reqs_padded + 1],
                "paged_kv_indptr": self.paged_kv_indptr[:num_reqs_padded + 1],
                "paged_kv_indices": self.paged_kv_indices,
                "paged_kv_last_page_len": self.paged_kv_last_page_len[:num_reqs_padded],
                "work_info_set": self.work_info_set, "max_qo_len": 1}


class DeepseekMLALayer:
    def __init__(self, device):
        gen = generator(5202)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.w_q = r(HIDDEN, NUM_HEADS * LATENT)
        self.w_kv = r(HIDDEN, LATENT)
        self.w_o = r(NUM_HEADS * LATENT, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.scale = LATENT ** -0.5
        self.kv_cache = torch.zeros(NUM_SLOTS, 1, 1, LATENT, device=device, dtype=torch.float64)

    def _forward_decode(self, q, decode):                            # AiterMLAImpl._forward_decode
        o = torch.zeros_like(q)
        return mla_decode_fwd(q, self.kv_cache, o, decode["qo_indptr"], decode["paged_kv_indptr"],
                              decode["paged_kv_indices"], decode["paged_kv_last_page_len"], decode["max_qo_len"],
                              self.scale, decode["work_info_set"])

    def forward(self, hidden_states, slot_mapping, decode):
        n = hidden_states.shape[0]
        q = (hidden_states @ self.w_q).view(n, NUM_HEADS, LATENT)
        self.kv_cache.index_copy_(0, slot_mapping, (hidden_states @ self.w_kv).view(n, 1, 1, LATENT))
        o = self._forward_decode(q, decode)
        return (hidden_states + o.reshape(n, -1) @ self.w_o) @ self.lm_head


class GPUModelRunner:
    def __init__(self, device, use_graph):
        self.device = device
        self.model = DeepseekMLALayer(device)
        self.builder = AiterMLAMetadataBuilder(device)
        self.hidden_states = torch.zeros(MAX_NUM_REQS, HIDDEN, device=device, dtype=torch.float64)
        self.slot_mapping = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.graphs = {}
        if use_graph:
            self.capture_model()

    def capture_model(self):
        dummy_table = torch.zeros(MAX_NUM_REQS, MAX_PAGES_PER_REQ, dtype=torch.int64)
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):        # _dummy_run: one null page each
            decode = self.builder._build_decode([1] * n, dummy_table, n)
            b = self.builder
            g, out = capture(lambda n=n, d=decode: self.model.forward(self.hidden_states[:n], self.slot_mapping[:n], d),
                             device=self.device, name=f"mla decode FULL [{n}]", owner="GPUModelRunner (FULL_DECODE_ONLY)",
                             static={"hidden_states": self.hidden_states, "slot_mapping": self.slot_mapping,
                                     "qo_indptr": b.qo_indptr, "paged_kv_indptr": b.paged_kv_indptr,
                                     "paged_kv_indices": b.paged_kv_indices, "work_info_set": b.work_info_set},
                             state={"kv_cache": self.model.kv_cache})
            self.graphs[n] = (g, out)

    def execute_model(self, inputs, seq_lens, block_table, slots):
        n = len(seq_lens)
        size = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= n) if self.graphs else n
        self.hidden_states[:n].copy_(inputs)
        self.slot_mapping[:size].fill_(0)
        self.slot_mapping[:n].copy_(slots)
        decode = self.builder._build_decode(seq_lens, block_table, size)
        if self.graphs:
            g, out = self.graphs[size]
            logits = replay(g, out, real=n, size=size, padded={"hidden_states": self.hidden_states})
        else:
            logits = self.model.forward(self.hidden_states[:n], self.slot_mapping[:n], decode)
        return logits[:n].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompt_lens = {"A": 3, "B": 5, "C": 2, "D": 4}
    schedule = ["AB", "ABC", "ABCD"]

    def serve(use_graph: bool):
        runner = GPUModelRunner(device, use_graph)
        gen = generator(5203)
        block_table = torch.zeros(MAX_NUM_REQS, MAX_PAGES_PER_REQ, dtype=torch.int64)
        for i, rid in enumerate("ABCD"):
            block_table[i] = torch.arange(1 + i * MAX_PAGES_PER_REQ, 1 + (i + 1) * MAX_PAGES_PER_REQ)
            pages = block_table[i, :prompt_lens[rid]].to(device)
            runner.model.kv_cache[pages] = randn(prompt_lens[rid], 1, 1, LATENT, gen=gen, device=device).double()
        seq_lens = dict(prompt_lens)
        outs = []
        for names in schedule:
            rows = ["ABCD".index(r) for r in names]
            slots = torch.tensor([int(block_table[i, seq_lens[r]]) for i, r in zip(rows, names)]).to(device)
            for r in names:
                seq_lens[r] += 1
            inputs = randn(len(names), HIDDEN, gen=gen, device=device).double()
            outs.append(runner.execute_model(inputs, [seq_lens[r] for r in names], block_table[rows], slots))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
