"""The fused cross-entropy backward checks ``grad_output == 1.0`` on the host inside a full-iteration capture.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/1997 ("Remove if-else and torch.tensor to meet
cudagraph requirement", commit aa0659e59); used by Megatron-LM's full-iteration CUDA graphs
(ADLR/megatron-lm!3815, "Add is_cg_capturable flag to CrossEntropyLoss to support full CUDA graph
capture").
Symptom: with ``--cuda-graph-scope full_iteration`` and ``--cross-entropy-fusion-impl te``, capturing the
training iteration fails inside the loss backward ("operation not permitted when stream is capturing")
(TransformerEngine 2.6 / Megatron-LM, Aug 2025).
Mechanism: ``CrossEntropyFunction.forward`` stores d(loss)/d(logits) in place in its input and saves it;
``cross_entropy_backward`` then skips the scaling kernel when ``grad_output`` is exactly 1.0 ("if cross
entropy is the last layer"), deciding so on the host with ``torch.equal(grad_output,
torch.tensor(1.0, device=...))``. Eager iterations and the warmup iteration pay a device-to-host sync
there; ``FullCudaGraphWrapper`` captures the whole forward-backward of the iteration, and inside the capture
that upload-and-compare is a host synchronisation the stream capture refuses, so the capture (and the run)
fails at the loss backward.
Doctor: sync-in-capture, at ``cross_entropy_backward`` (``torch.equal`` on the device ``grad_output``).
Fix (upstream): an ``is_cg_capturable`` flag (``parallel_cross_entropy(..., is_cg_capturable)``, passed by
Megatron when ``cuda_graph_scope == 'full_iteration'``) skips the host check and always runs the scaling
kernel, which is exact for ``grad_output == 1`` too.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/1997"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "cross_entropy_backward"
SYMPTOM = "full-iteration CUDA graph capture fails in the cross-entropy backward (host sync while capturing)"
VOCAB, DIM, SEQ, MICROBATCHES, ITERATIONS, WARMUP_STEPS, LR = 6, 4, 3, 2, 4, 1, 0.5


def cross_entropy_forward(_input, target, label_smoothing, reduce_loss, dist_process_group, ignore_idx):
    """Online-softmax loss; the gradient (softmax - one_hot) overwrites ``_input`` in place."""
    B, SQ, V = _input.shape
    logits = _input.reshape(B * SQ, V).float()
    lse = torch.logsumexp(logits, -1)
    loss_1d = lse - logits.gather(1, target.reshape(-1, 1)).squeeze(1)
    grad = torch.softmax(logits, -1) - torch.zeros_like(logits).scatter_(1, target.reshape(-1, 1), 1.0)
    n_rows = B * SQ
    _input.copy_((grad / n_rows if reduce_loss else grad).reshape(B, SQ, V))
    loss = torch.sum(loss_1d) / n_rows if reduce_loss else loss_1d.reshape(B, SQ)
    return loss, _input


def cross_entropy_backward(_input, grad_output, is_cg_capturable=False):
    """Backward implementation of cross entropy loss kernel"""
    # If cross entropy is the last layer, grad_output is 1.0. Skip the mul to save time
    if not is_cg_capturable and torch.equal(grad_output, torch.tensor(1.0, device=grad_output.device)):
        pass
    else:
        _input.mul_(grad_output)                       # element_mul_kernel: one grad_output value per launch
    return _input


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, _input, target, label_smoothing=0.0, reduce_loss=False, dist_process_group=None,
                ignore_idx=-100, is_cg_capturable=False):
        loss, _input = cross_entropy_forward(_input, target, label_smoothing, reduce_loss, dist_process_group,
                                             ignore_idx)
        ctx.save_for_backward(_input.detach())
        ctx.is_cg_capturable = is_cg_capturable
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        (_input,) = ctx.saved_tensors
        _input = cross_entropy_backward(_input, grad_output, ctx.is_cg_capturable)
        return _input, None, None, None, None, None, None


class GPTModel:
    def __init__(self, device):
        gen = generator(1997)
        self.embedding = randn(VOCAB, DIM, gen=gen, device=device)
        self.output_layer = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5).requires_grad_()
        self.output_layer.grad = torch.zeros_like(self.output_layer)     # static grads (no set_to_none)

    def forward(self, tokens, labels, is_cg_capturable):
        logits = (self.embedding[tokens] @ self.output_layer)[None]       # [b=1, s, V]
        return CrossEntropyFunction.apply(logits, labels[None], 0.0, True, None, -100, is_cg_capturable)


def forward_backward_no_pipelining(model, microbatches, is_cg_capturable):
    """Megatron's schedule: per micro-batch, loss / num_microbatches, then backward (grads accumulate)."""
    losses = []
    for tokens, labels in microbatches:
        output_tensor = model.forward(tokens, labels, is_cg_capturable) / len(microbatches)
        torch.autograd.backward(output_tensor)
        losses.append(output_tensor.detach())
    return torch.stack(losses)


def optimizer_step(model):
    with torch.no_grad():
        model.output_layer.sub_(LR * model.output_layer.grad)
        model.output_layer.grad.zero_()


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(3815)
    data = [[(torch.randint(0, VOCAB, (SEQ,), generator=gen).to(device),
              torch.randint(0, VOCAB, (SEQ,), generator=gen).to(device)) for _ in range(MICROBATCHES)]
            for _ in range(ITERATIONS)]

    def eager():
        model, outs = GPTModel(device), []
        for batch in data:
            outs.append(forward_backward_no_pipelining(model, batch, is_cg_capturable=False))
            optimizer_step(model)
        return outs + [model.output_layer.detach().clone()]

    def served():
        model, outs = GPTModel(device), []
        # Megatron passes is_cg_capturable=True only when cuda_graph_scope == 'full_iteration' (the fix)
        is_cg_capturable = variant == "fix"
        static = [(torch.zeros(SEQ, dtype=torch.long, device=device), torch.zeros(SEQ, dtype=torch.long, device=device))
                  for _ in range(MICROBATCHES)]                          # StaticBufferLoader
        names = {f"{n}[{m}]": t for m, pair in enumerate(static) for n, t in zip(("tokens", "labels"), pair)}
        g = result = None
        for iteration, batch in enumerate(data):
            for (tokens, labels), (s_tokens, s_labels) in zip(batch, static):
                s_tokens.copy_(tokens)
                s_labels.copy_(labels)
            if iteration < WARMUP_STEPS:                                  # FullCudaGraphWrapper: eager warmup steps
                with events.warmup(real=True):
                    outs.append(forward_backward_no_pipelining(model, static, is_cg_capturable))
            else:
                if g is None:                                             # curr_iteration == cuda_graph_warmup_steps
                    g, result = capture(lambda: forward_backward_no_pipelining(model, static, is_cg_capturable),
                                        device=device, warmups=0, static=names,
                                        state={"output_layer.grad": model.output_layer.grad},
                                        owner="FullCudaGraphWrapper")
                outs.append(replay(g, result).clone())
            optimizer_step(model)
        return outs + [model.output_layer.detach().clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
