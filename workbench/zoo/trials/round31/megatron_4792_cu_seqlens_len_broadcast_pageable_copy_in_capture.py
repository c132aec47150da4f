"""Full-iteration CUDA graph capture fails: the cu_seqlens length broadcast builds its tensor with ``torch.tensor(n, device=dev)``.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4792 ("[Dev] Fix full CUDA graph capture reverted by pull main").
Symptom: with full-iteration CUDA graphs (paged-stash dev config, packed THD batches), capture of the training
iteration fails with a CUDA graph capture error raised at the cu_seqlens length broadcast in
``megatron/training/utils.py``; the same run without CUDA graphs trains.
Mechanism: the source TP rank broadcasts the length of the packed batch's ``cu_seqlens`` before broadcasting
``cu_seqlens`` itself. The nightly pull of main reverted the dev branch's allocation of that length tensor back to
``torch.tensor(n, dtype=torch.int64, device=dev)``, which materialises the Python int in pageable host memory and
copies it to the device. Inside the captured iteration that host-to-device copy from a non-pinned CPU source is a
host synchronisation that a capturing stream refuses (cudaErrorStreamCaptureUnsupported), so capture aborts.
(Only the PR description was read; it quotes the one changed line before and after. The function that holds the
line is modelled here as ``_broadcast_cu_seqlens`` inside ``get_batch_on_this_tp_rank``; the broadcast itself is a
one-rank identity.) Under full-iteration graphs ``cu_seqlens`` is padded to a fixed ``thd_max_num_seqs + 1``
entries, so ``n`` is the same on every step.
Doctor: sync-in-capture, at ``_broadcast_cu_seqlens``.
Fix (upstream): restore ``torch.empty(1, dtype=torch.int64, device=dev).fill_(n)``: an allocation plus a fill kernel
with a scalar argument, no copy from host memory, so the iteration captures (``n`` is constant under the padded
layout, so the recorded fill stays correct on replay).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4792"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_broadcast_cu_seqlens"
SYMPTOM = "full-iteration CUDA graph capture fails at torch.tensor(n, device=dev) in the cu_seqlens length broadcast"

HIDDEN = 4
MAX_TOKENS = 8
THD_MAX_NUM_SEQS = 3                     # cu_seqlens is padded to THD_MAX_NUM_SEQS + 1 entries under CUDA graphs


def _broadcast(t: torch.Tensor) -> torch.Tensor:
    """``torch.distributed.broadcast(t, src)`` on the TP source rank: sends ``t`` as it is (one rank here)."""
    return t


class BatchBuffers:
    """The fixed-address batch buffers of a full-iteration CUDA graph (tokens and padded cu_seqlens)."""

    def __init__(self, device):
        self.device = device
        self.tokens = torch.zeros(MAX_TOKENS, HIDDEN, device=device)
        self.cu_seqlens = torch.zeros(THD_MAX_NUM_SEQS + 1, dtype=torch.int64, device=device)

    def load(self, tokens: torch.Tensor, seqlens: list[int]) -> None:
        """The data iterator stages a packed batch: tokens, and cu_seqlens padded with the total."""
        self.tokens.copy_(tokens.to(self.device))
        cu = [0]
        for n in seqlens:
            cu.append(cu[-1] + n)
        cu += [cu[-1]] * (THD_MAX_NUM_SEQS + 1 - len(cu))
        self.cu_seqlens.copy_(torch.tensor(cu, dtype=torch.int64).to(self.device))


def _broadcast_cu_seqlens(buf: BatchBuffers, variant: str) -> torch.Tensor:
    """Source rank: broadcast the length of cu_seqlens, then cu_seqlens itself."""
    dev = buf.device
    n = buf.cu_seqlens.shape[0]                   # a Python int (fixed: the padded layout)
    if variant == "bug":
        n_tensor = torch.tensor(n, dtype=torch.int64, device=dev)          # pageable host -> device copy
    else:
        n_tensor = torch.empty(1, dtype=torch.int64, device=dev).fill_(n)  # no host copy
    _broadcast(n_tensor)                          # receivers size their cu_seqlens buffer from it
    return _broadcast(buf.cu_seqlens)


def get_batch_on_this_tp_rank(buf: BatchBuffers, variant: str):
    cu_seqlens = _broadcast_cu_seqlens(buf, variant)
    return buf.tokens, cu_seqlens


class PackedModel:
    """A tiny THD layer: a projection, then a per-sequence sum over the packed tokens."""

    def __init__(self, device):
        gen = generator(4792)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.device = device

    def __call__(self, tokens, cu_seqlens):
        h = torch.tanh(tokens @ self.w)
        pos = torch.arange(MAX_TOKENS, device=self.device)
        seq = torch.searchsorted(cu_seqlens[1:], pos, right=True)          # THD_MAX_NUM_SEQS past the total
        out = torch.zeros(THD_MAX_NUM_SEQS + 1, HIDDEN, device=self.device)
        out.index_add_(0, seq, h)
        return out[:THD_MAX_NUM_SEQS]


def train_iteration(buf: BatchBuffers, model: PackedModel, variant: str):
    tokens, cu_seqlens = get_batch_on_this_tp_rank(buf, variant)
    return model(tokens, cu_seqlens)


def run(variant: str, device: str = "cpu"):
    gen = generator(11)
    batches = [(randn(MAX_TOKENS, HIDDEN, gen=gen, device="cpu"), lens)
               for lens in ([3, 5], [2, 2, 4], [6], [1, 4, 2])]

    def serve(graphed: bool):
        buf = BatchBuffers(device)
        model = PackedModel(device)
        step = lambda: train_iteration(buf, model, variant)  # noqa: E731
        outs = []
        if graphed:
            buf.load(*batches[0])
            g, out = capture(step, device=device, owner="FullCudaGraphWrapper (training iteration)",
                             static={"tokens": buf.tokens, "cu_seqlens": buf.cu_seqlens})
            for tokens, lens in batches:
                buf.load(tokens, lens)
                outs.append(replay(g, out).clone())
        else:
            for tokens, lens in batches:
                buf.load(tokens, lens)
                outs.append(step().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
