"""The captured prefill's sparse-index workspace never gets its -1 sentinel: padded columns are read as KV indices.

Upstream: https://github.com/vllm-project/vllm/pull/55299 ("[Bugfix][DSv4] Seed the -1 sentinel in the prefill
sparse index workspace").
Symptom: DeepSeek-V4-Flash aborted at startup with ``RuntimeError: Triton Error [CUDA]: an illegal memory access``
as soon as prefill was captured into a CUDA graph (``cudagraph_mode=PIECEWISE`` / ``FULL_AND_PIECEWISE``);
``combined_indices.max()`` at the ``flash_mla_sparse_fwd`` call site exceeded the KV workspace's row count.
Mechanism: ``combine_topk_swa_indices`` builds each prefill token's sparse index row (its top-k compressed slots,
then its sliding-window slots, offset into the gathered KV workspace) and stores only the valid prefix
(``topk_len + swa_len``; a masked store); the rest of the row must hold ``-1``, the sentinel the sparse attention
kernel skips. With ``out=None`` the row comes from ``torch.full(..., -1)``. With a caller-supplied ``out`` (the
persistent ``idx_ws`` / ``lens_ws`` workspace from ``get_simultaneous``, fixed memory that the captured prefill reads
and writes on every replay) nothing seeds it, so the padded columns keep whatever the workspace held: an earlier
call's indices, or memory nothing has written yet. The kernel takes them as KV indices (out of range upstream:
the illegal memory access; in range here: attention over KV rows the token must not see). The eager reference
prefill of the miniature takes the ``out=None`` path. Miniature: one request, chunked prefill of 4 tokens per step,
window 4, compress ratio 2, top-k 2, rows aligned to 8 columns; the workspace arena starts zeroed.
Doctor: stale-padding, at combine_topk_swa_indices (the padded columns of every index row are left as the
workspace held them, and the sparse attention of the real tokens reads them as KV indices).
Fix (upstream): ``combine_topk_swa_indices`` seeds the caller-supplied ``out`` with ``-1`` before the valid
prefix is written, as the ``out=None`` path gets from ``torch.full``.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/55299"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "combine_topk_swa_indices"
SYMPTOM = "sparse prefill attends KV rows named by unseeded padding columns of the index workspace (IMA upstream)"

VOCAB, DIM = 16, 4
WINDOW, COMPRESS_RATIO, TOP_K, ALIGN = 4, 2, 2, 8
MAX_LEN = 16
N = MAX_LEN // COMPRESS_RATIO            # compressed rows gathered first; SWA rows at offset N
M = N + MAX_LEN                          # KV workspace rows
CHUNK = 4                                # prefill tokens per step (the captured size)
COMBINED_TOPK = (TOP_K + WINDOW + ALIGN - 1) // ALIGN * ALIGN


def combine_topk_swa_indices(topk_indices, positions, window_size, compress_ratio, topk, n, out=None, variant="bug"):
    """Rows of [top-k compressed slots | SWA slots | -1 padding] into the KV workspace, and their lengths."""
    num_tokens = topk_indices.shape[0]
    if out is None:
        indices = torch.full((num_tokens, COMBINED_TOPK), -1, dtype=torch.long, device=positions.device)
        lengths = torch.empty(num_tokens, dtype=torch.long, device=positions.device)
    else:
        indices, lengths = out
        if variant == "fix":
            indices.fill_(-1)            # seed the sentinel the out=None path gets from torch.full
    topk_len = ((positions + 1) // compress_ratio).clamp(max=topk)
    swa_len = (positions + 1).clamp(max=window_size)
    cols = torch.arange(COMBINED_TOPK, device=positions.device)[None, :]
    topk_cols = torch.cat([topk_indices, topk_indices.new_zeros(num_tokens, COMBINED_TOPK - topk)], 1)
    swa = n + positions[:, None] - swa_len[:, None] + 1 + (cols - topk_len[:, None])
    value = torch.where(cols < topk_len[:, None], topk_cols, swa)
    valid = cols < (topk_len + swa_len)[:, None]
    indices.copy_(torch.where(valid, value, indices))       # tl.store(..., mask=valid): the prefix only
    lengths.copy_(topk_len + swa_len)
    return indices, lengths


def flash_mla_sparse_fwd(q, kv, indices, topk_length):
    """Sparse attention over the KV workspace rows each token's index row names; -1 marks a skipped slot."""
    gathered = kv[indices.clamp(min=0)]                     # [tokens, COMBINED_TOPK, DIM]
    scores = torch.einsum("td,tkd->tk", q, gathered).masked_fill(indices < 0, -1e9)
    return torch.einsum("tk,tkd->td", torch.softmax(scores, -1), gathered)


class WorkspaceManager:
    """One persistent arena handed out as the same views on every call (fixed addresses for the graph)."""

    def __init__(self, device):
        self.kv_ws = torch.zeros(M, DIM, device=device)
        self.idx_ws = torch.zeros(CHUNK, COMBINED_TOPK, dtype=torch.long, device=device)
        self.lens_ws = torch.zeros(CHUNK, dtype=torch.long, device=device)

    def get_simultaneous(self):
        return self.kv_ws, self.idx_ws, self.lens_ws


class DeepseekV4Attention:
    def __init__(self, device, variant):
        gen = generator(55299)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wkv, self.w_idx, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.8)
                                                 for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.swa_kv_cache = torch.zeros(MAX_LEN, DIM, device=device)
        self.compressed_kv_cache = torch.zeros(N, DIM, device=device)
        self.device, self.variant = device, variant

    def forward(self, input_ids, positions, workspace_manager=None):
        x = self.emb[input_ids]
        q, kv = x @ self.wq, x @ self.wkv
        self.swa_kv_cache.index_copy_(0, positions, kv)
        self.compressed_kv_cache.index_copy_(0, positions[1::2] // COMPRESS_RATIO,
                                             kv.view(-1, COMPRESS_RATIO, DIM).mean(1))
        # indexer: top-k over the compressed entries each token may see
        visible = torch.arange(N, device=self.device)[None, :] < ((positions + 1) // COMPRESS_RATIO)[:, None]
        scores = ((x @ self.w_idx) @ self.compressed_kv_cache.T).masked_fill(~visible, float("-inf"))
        topk_indices = scores.topk(TOP_K, dim=-1).indices
        return self._forward_prefill(x, q, positions, topk_indices, workspace_manager)

    def _forward_prefill(self, x, q, positions, topk_indices, workspace_manager):
        if workspace_manager is None:
            kv_ws, out = torch.empty(M, DIM, device=self.device), None
        else:
            kv_ws, idx_ws, lens_ws = workspace_manager.get_simultaneous()
            out = (idx_ws[:x.shape[0]], lens_ws[:x.shape[0]])
        # dequantize_and_gather_k_cache: compressed rows at offset 0, SWA rows at offset N
        kv_ws[:N].copy_(self.compressed_kv_cache)
        kv_ws[N:].copy_(self.swa_kv_cache)
        combined_indices, combined_lens = combine_topk_swa_indices(
            topk_indices, positions, WINDOW, COMPRESS_RATIO, TOP_K, N, out=out, variant=self.variant)
        attn = flash_mla_sparse_fwd(q, kv_ws, combined_indices, combined_lens)
        return (x + attn @ self.wo) @ self.lm_head


PROMPT = [3, 7, 1, 9, 12, 5, 2, 8, 14, 0, 6, 11]


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        layer = DeepseekV4Attention(device, variant)
        outs = []
        if not graphed:
            for s in range(0, len(PROMPT), CHUNK):
                ids = torch.tensor(PROMPT[s:s + CHUNK], device=device)
                outs.append(layer.forward(ids, torch.arange(s, s + CHUNK, device=device)))
            return outs
        input_ids = torch.zeros(CHUNK, dtype=torch.long, device=device)
        positions = torch.zeros(CHUNK, dtype=torch.long, device=device)
        ws = WorkspaceManager(device)
        events.written_metadata("WorkspaceManager", {"idx_ws": ws.idx_ws, "lens_ws": ws.lens_ws,
                                                     "kv_ws": ws.kv_ws})
        g, logits = capture(lambda: layer.forward(input_ids, positions, ws), device=device,
                            name=f"prefill {CHUNK} tokens", owner="GPUModelRunner",
                            static={"input_ids": input_ids, "positions": positions},
                            state={"swa_kv_cache": layer.swa_kv_cache,
                                   "compressed_kv_cache": layer.compressed_kv_cache})
        for s in range(0, len(PROMPT), CHUNK):
            input_ids.copy_(torch.tensor(PROMPT[s:s + CHUNK], device=device))
            positions.copy_(torch.arange(s, s + CHUNK, device=device))
            outs.append(replay(g, logits).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
