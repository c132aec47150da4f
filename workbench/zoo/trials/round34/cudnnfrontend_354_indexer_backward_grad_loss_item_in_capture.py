"""cuDNN-frontend's DSA indexer backward reads ``grad_loss`` with ``.item()``: the backward step cannot be graph-captured.

Upstream: https://github.com/NVIDIA/cudnn-frontend/pull/354 ("Fix DSA offset alignment, stream handling, and
CUDA Graph capture"), merged July 2026. The sibling PR #356 ("Make DSA dense indexer backward CUDA Graph safe",
closed, its change folded into the same line of work) describes the same defect in its dense path.
Symptom: capturing a training step whose backward calls the DeepSeek-sparse-attention indexer backward
(``python/cudnn/deepseek_sparse_attention/indexer_backward/api.py``) inside ``torch.cuda.graph`` fails at
``grad_loss.item()`` with ``operation not permitted when stream is capturing``
(``cudaErrorStreamCaptureUnsupported``), so the whole-iteration graph can never be built.
Mechanism: ``execute`` turned the incoming loss gradient into a Python float on the host,
``grad_loss_value = float(_as_grad_loss_tensor(grad_loss, index_q.device).item())``, and folded it into the
host scalar ``grad_scale = float(loss_coeff) * grad_loss_value / max(int(self.normalization_tokens), 1)`` that the
score-gradient kernel takes by value. ``.item()`` copies a device value to the host and waits for it: a host
synchronisation, which a capturing stream refuses. (Had it been allowed, the graph would have frozen the
capture-time ``grad_loss``; the fix's test replays one graph with two ``grad_loss`` values for that reason.)
Doctor: sync-in-capture, at ``execute`` (the ``.item()`` on ``grad_loss`` inside the captured backward).
Fix (upstream): keep ``grad_loss`` on the device: ``grad_loss_tensor = _as_grad_loss_tensor(grad_loss, ...)``,
``grad_scale = float(loss_coeff) / max(int(self.normalization_tokens), 1)`` (host constants only), and the
score-gradient kernel multiplies by the device scalar ``grad_loss_tensor`` itself.
I read the diff hunk of ``execute`` quoted in the PR's review thread and #356's description, not the kernels;
the indexer's forward/backward math below is a small stand-in with the same data flow (a top-k indexer score,
a KL-style score gradient scaled by ``grad_scale * grad_loss``, then dQ, dK and dWeights).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/cudnn-frontend/pull/354"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "execute"
SYMPTOM = "capturing the DSA indexer backward fails at grad_loss.item() (operation not permitted when stream is capturing)"

T, S, H, D, TOPK = 4, 6, 2, 4, 3          # query tokens, key tokens, indexer heads, head dim, top-k
LOSS_COEFF = 0.5


def _as_grad_loss_tensor(grad_loss, device):
    """The API accepts a Python number or a 0-d tensor; both become a 0-d float tensor on ``device``."""
    if isinstance(grad_loss, torch.Tensor):
        return grad_loss.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(grad_loss), dtype=torch.float32, device=device)


def score_grad_kernel(index_q, index_k, weights, topk_idxs, target, grad_scale, grad_loss_tensor=None):
    """The indexer score gradient and its chain to dQ, dK, dW. ``grad_scale`` is a host scalar (by value);
    the capturable kernel also reads ``grad_loss_tensor`` from device memory."""
    k_sel = index_k[topk_idxs]                                       # [T, TOPK, D]
    logits = torch.einsum("thd,tkd->thk", index_q, k_sel)            # per-head q.k over the selected keys
    act = torch.relu(logits)
    scores = (weights[:, :, None] * act).sum(1)                       # [T, TOPK] indexer score
    p = torch.softmax(scores, -1)
    d_scores = (p - target) * grad_scale                              # KL(target || p) gradient
    if grad_loss_tensor is not None:
        d_scores = d_scores * grad_loss_tensor
    d_act = d_scores[:, None, :] * weights[:, :, None] * (logits > 0)
    dweights = (d_scores[:, None, :] * act).sum(-1)                   # [T, H]
    dq = torch.einsum("thk,tkd->thd", d_act, k_sel)
    dk = torch.zeros_like(index_k).index_add_(
        0, topk_idxs.reshape(-1), torch.einsum("thk,thd->tkd", d_act, index_q).reshape(-1, D))
    return dq, dk, dweights


class IndexerBackward:
    """The compiled indexer-backward API object: ``normalization_tokens`` fixed at construction."""

    def __init__(self, normalization_tokens, variant):
        self.normalization_tokens = normalization_tokens
        self.variant = variant

    def execute(self, index_q, index_k, weights, topk_idxs, target, grad_loss, loss_coeff):
        if self.variant == "bug":
            # the loss gradient read back to the host to build a by-value kernel scalar
            grad_loss_value = float(_as_grad_loss_tensor(grad_loss, index_q.device).item())
            grad_scale = float(loss_coeff) * grad_loss_value / max(int(self.normalization_tokens), 1)
            return score_grad_kernel(index_q, index_k, weights, topk_idxs, target, grad_scale)
        grad_loss_tensor = _as_grad_loss_tensor(grad_loss, index_q.device)
        grad_scale = float(loss_coeff) / max(int(self.normalization_tokens), 1)
        return score_grad_kernel(index_q, index_k, weights, topk_idxs, target, grad_scale, grad_loss_tensor)


def run(variant: str, device: str = "cpu"):
    gen = generator(354)
    steps = []
    for i in range(3):
        q = randn(T, H, D, gen=gen, device=device)
        k = randn(S, D, gen=gen, device=device)
        w = randn(T, H, gen=gen, device=device, scale=0.5)
        idx = torch.stack([torch.randperm(S, generator=gen)[:TOPK] for _ in range(T)]).to(device)
        tgt = torch.softmax(torch.randn(T, TOPK, generator=gen), -1).to(device)
        grad_loss = torch.tensor(1.0 / (i + 1)).to(device)             # e.g. a loss scale that changes per step
        steps.append((q, k, w, idx, tgt, grad_loss))
    bwd = IndexerBackward(normalization_tokens=T, variant=variant)

    def eager():
        return [t.clone() for s in steps for t in bwd.execute(*s, LOSS_COEFF)]

    def served():
        static = {"index_q": torch.zeros(T, H, D, device=device), "index_k": torch.zeros(S, D, device=device),
                  "weights": torch.zeros(T, H, device=device),
                  "topk_idxs": torch.zeros(T, TOPK, dtype=torch.long, device=device),
                  "target": torch.full((T, TOPK), 1.0 / TOPK, device=device),
                  "grad_loss": torch.ones((), device=device)}
        names = list(static)

        def load(step):
            for name, value in zip(names, step):
                static[name].copy_(value)

        load(steps[0])
        g, out = capture(lambda: bwd.execute(*(static[n] for n in names), LOSS_COEFF), device=device,
                         static=static, owner="training step (graphed backward)")
        outs = []
        for step in steps:
            load(step)
            outs += [t.clone() for t in replay(g, out)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
