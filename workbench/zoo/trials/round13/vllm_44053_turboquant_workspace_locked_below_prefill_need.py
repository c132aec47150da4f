"""The shared workspace is locked at its capture-time size; a long-context TurboQuant prefill then needs more.

Upstream: https://github.com/vllm-project/vllm/pull/44053 ("[Bugfix][V1][TurboQuant] Reserve workspace before
CUDA graph capture"; supersedes #40798).
Symptom: with ``--kv-cache-dtype turboquant_*`` and CUDA graphs, a long-context request (12k tokens in the
report) fails in ``_continuation_prefill`` with the runner's locked-workspace assertion ("Workspace is locked
but allocation ... requires ..."); short requests and ``--enforce-eager`` are fine (vLLM main, May 2026).
Mechanism: the V1 ``WorkspaceManager`` hands out slices of one arena that grows on demand; the FULL decode
graphs bake in the address of their scratch (``mid_o``, ``lse``), so after ``capture_model`` the runner locks
the workspace: growing it would free the arena the graphs hold. TurboQuant requested its scratch lazily, so at
lock time the arena was only as large as the capture-time decode steps needed. Continuation prefill (run
eagerly, outside the graphs) dequantizes the cached context into workspace scratch whose size grows with the
context length; for a long enough context the request no longer fits the locked arena.
Doctor: undersized-buffer, at ``_continuation_prefill`` (scratch larger than the arena fixed at capture).
Fix (upstream): ``TurboQuantMetadataBuilder.__init__`` reserves the worst-case TurboQuant workspace (decode
and continuation-prefill scratch for ``max_model_len``) before capture, so the arena never has to grow.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/44053"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_continuation_prefill"
SYMPTOM = "AssertionError: Workspace is locked but allocation requires more than the capture-time arena"
HEAD, MAX_MODEL_LEN, NUM_KV_SPLITS, MAX_DECODE_BS = 4, 8, 2, 2


class WorkspaceManager:
    """``vllm/v1/worker/workspace.py``: one growable arena, sliced per call; locked after capture."""

    def __init__(self, device):
        self.device = device
        self._current_workspace: torch.Tensor | None = None
        self._locked = False

    def lock_workspace(self):
        self._locked = True

    def _ensure_workspace_size(self, required: int) -> torch.Tensor:
        current = 0 if self._current_workspace is None else self._current_workspace.numel()
        if current < required:
            if self._locked:
                raise AssertionError(
                    f"Workspace is locked but allocation requires {required} elements, current size is "
                    f"{current}. Workspace growth is not allowed after locking.")
            self._current_workspace = None                    # the old arena is freed (empty_cache)
            self._current_workspace = torch.empty(required, device=self.device)
        return self._current_workspace

    def get_simultaneous(self, *shapes):
        sizes = [math.prod(s) for s in shapes]
        arena = self._ensure_workspace_size(sum(sizes))
        views, offset = [], 0
        for shape, n in zip(shapes, sizes):
            views.append(arena[offset:offset + n].view(shape))
            offset += n
        return views


class TurboQuantMetadataBuilder:
    def __init__(self, workspace: WorkspaceManager, variant: str):
        if variant == "fix":
            # Reserve the worst case before CUDA graph capture locks the workspace.
            decode = MAX_DECODE_BS * NUM_KV_SPLITS * (HEAD + 1)
            continuation_prefill = 2 * MAX_MODEL_LEN * HEAD
            workspace._ensure_workspace_size(max(decode, continuation_prefill))


class TurboQuantImpl:
    def __init__(self, workspace, key_cache, value_cache, scale):
        self.workspace, self.key_cache, self.value_cache, self.scale = workspace, key_cache, value_cache, scale

    def _decode_attention(self, query, seq_lens):
        """Split-KV decode: stage 1 writes per-split partial sums into workspace scratch, stage 2 combines."""
        bs = query.shape[0]
        mid_o, lse = self.workspace.get_simultaneous((bs, NUM_KV_SPLITS, HEAD), (bs, NUM_KV_SPLITS))
        k, v = self.key_cache[:bs] * self.scale, self.value_cache[:bs] * self.scale      # dequantize
        pos = torch.arange(MAX_MODEL_LEN, device=query.device)
        scores = torch.einsum("bh,bth->bt", query, k) / math.sqrt(HEAD)
        valid = pos[None, :] < seq_lens[:, None]
        w = torch.exp(scores - scores.masked_fill(~valid, float("-inf")).amax(-1, keepdim=True)) * valid
        split = (pos // (MAX_MODEL_LEN // NUM_KV_SPLITS))[None, :, None] == torch.arange(NUM_KV_SPLITS,
                                                                                           device=query.device)
        mid_o.copy_(torch.einsum("bt,bth,bts->bsh", w, v, split.expand(bs, -1, -1).to(w.dtype)))
        lse.copy_(torch.einsum("bt,bts->bs", w, split.expand(bs, -1, -1).to(w.dtype)))
        return mid_o.sum(1) / lse.sum(1, keepdim=True)

    def _continuation_prefill(self, query, req, context_len):
        """A prompt chunk attending to its already-cached context: the context is dequantized into
        workspace scratch sized by the context length."""
        k_buf, v_buf = self.workspace.get_simultaneous((context_len, HEAD), (context_len, HEAD))
        torch.mul(self.key_cache[req, :context_len], self.scale, out=k_buf)
        torch.mul(self.value_cache[req, :context_len], self.scale, out=v_buf)
        scores = query @ k_buf.t() / math.sqrt(HEAD)
        return torch.softmax(scores, -1) @ v_buf


def run(variant: str, device: str = "cpu"):
    gen = generator(44053)
    key_cache = randn(MAX_DECODE_BS, MAX_MODEL_LEN, HEAD, gen=gen, device=device)
    value_cache = randn(MAX_DECODE_BS, MAX_MODEL_LEN, HEAD, gen=gen, device=device)
    scale = torch.tensor(0.5, device=device)
    decodes = [([3, 4], randn(2, HEAD, gen=gen, device=device)), ([4, 5], randn(2, HEAD, gen=gen, device=device)),
               ([5, 6], randn(2, HEAD, gen=gen, device=device))]
    chunk = randn(2, HEAD, gen=gen, device=device)                # request 1: 2 prompt tokens after 6 cached

    def serve(graphed: bool):
        workspace = WorkspaceManager(device)
        TurboQuantMetadataBuilder(workspace, variant)
        impl = TurboQuantImpl(workspace, key_cache, value_cache, scale)
        query = torch.zeros(MAX_DECODE_BS, HEAD, device=device)
        seq_lens = torch.ones(MAX_DECODE_BS, dtype=torch.long, device=device)
        if graphed:
            g, out = capture(lambda: impl._decode_attention(query, seq_lens), device=device,
                             static={"query": query, "seq_lens": seq_lens},
                             state={"key_cache": key_cache, "value_cache": value_cache},
                             owner="GPUModelRunner (FULL decode graph)")
            workspace.lock_workspace()                            # capture_model: no growth from here on

        def decode(lens, q):
            query.copy_(q)
            seq_lens.copy_(torch.tensor(lens, device=device))
            return (replay(g, out) if graphed else impl._decode_attention(query, seq_lens)).clone()

        outs = [decode(*decodes[0]), decode(*decodes[1])]
        # A mixed batch: PIECEWISE graphs, attention runs eagerly; request 1 continues a long prompt.
        outs.append(impl._continuation_prefill(chunk, 1, 6).clone())
        outs.append(decode(*decodes[2]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
