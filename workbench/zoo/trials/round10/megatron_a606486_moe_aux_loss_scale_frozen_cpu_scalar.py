"""MoE aux-loss backward scale: a CPU scalar at capture time is baked into the graphed backward.

Upstream: https://github.com/NVIDIA/Megatron-LM/commit/a606486ecefa46eafafe771cf8177195099f11e7
("ADLR/megatron-lm!2204 - Add conditional cudagraph support for MoE models"; the ``MoEAuxLossAutoScaler``
part of the change).
Symptom: MoE training with Transformer Engine CUDA graphs over the MoE layers
(``--external-cuda-graph``, Megatron-core 0.11 era, March 2025) scales the router's load-balancing
gradient by 1 on every step, instead of by the main loss's scale divided by the number of
micro-batches. The router gets an aux-loss gradient ``num_microbatches`` times too large (times the
fp16 loss scale too small), and the run differs from the same run without graphs. Nothing raises.
Mechanism: ``MoEAuxLossAutoScaler.backward`` multiplies the aux loss's gradient by the class attribute
``main_loss_backward_scale``, whose default was ``torch.tensor(1.0)``, a CPU tensor. Graphs are
captured at the first training iteration (``cuda_graph_capture`` in ``train_step``), before any
``forward_step`` has called ``set_loss_scale``, so the captured backward multiplies by that 0-dim CPU
tensor, which CUDA passes to the kernel by value: 1.0 becomes a constant of the graph.
``set_loss_scale`` then rebinds the attribute to ``loss_scale / num_microbatches`` on every
micro-batch. Eager backwards read the new value; replays keep the constant.
Doctor: host-work-frozen, at ``backward`` (the captured multiply reads a host scalar, fixed at capture).
Fix (upstream): the default is ``None``, and ``backward`` lazily creates ``torch.tensor(1.0,
device=aux_loss.device)``, so the warmup creates a device tensor that the capture reads by address.
``set_loss_scale`` writes later scales into it with ``copy_`` instead of rebinding, and
``forward_step`` builds ``loss_scale`` on the device.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/commit/a606486ecefa46eafafe771cf8177195099f11e7"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "backward"
SYMPTOM = "graphed MoE layers scale the router's aux-loss gradient by 1 instead of 1/num_microbatches"
TOKENS, DIM, EXPERTS, NUM_MICROBATCHES, ITERS, LR, AUX_COEFF = 6, 4, 3, 4, 2, 0.2, 1.0


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """An AutoScaler that triggers the backward pass and scales the grad for auxiliary loss."""

    main_loss_backward_scale: torch.Tensor = None
    fixed: bool = True

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        if MoEAuxLossAutoScaler.fixed and MoEAuxLossAutoScaler.main_loss_backward_scale is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0, device=aux_loss.device)
        aux_loss_backward_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        scaled_aux_loss_grad = torch.ones_like(aux_loss) * aux_loss_backward_scale
        return grad_output, scaled_aux_loss_grad

    @staticmethod
    def set_loss_scale(scale: torch.Tensor):
        if not MoEAuxLossAutoScaler.fixed:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        elif MoEAuxLossAutoScaler.main_loss_backward_scale is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        else:
            MoEAuxLossAutoScaler.main_loss_backward_scale.copy_(scale)


def reset_aux_loss_scaler(variant: str, device: str):
    """A fresh process: the class attribute's default as each version defines it."""
    MoEAuxLossAutoScaler.fixed = variant == "fix"
    MoEAuxLossAutoScaler.main_loss_backward_scale = (
        None if variant == "fix" else host(torch.tensor(1.0), device))   # pre-fix default: torch.tensor(1.0)


class MoELayer:
    """Top-1 router with a switch load-balancing loss, and the experts (the graphed callable)."""

    def __init__(self, device):
        gen = generator(2204)
        self.router_weight = randn(DIM, EXPERTS, gen=gen, device=device).requires_grad_()
        self.expert_weight = randn(EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5).requires_grad_()

    def parameters(self):
        return [self.router_weight, self.expert_weight]

    def __call__(self, hidden_states):
        logits = hidden_states @ self.router_weight
        probs = torch.softmax(logits, dim=-1)
        top_indices = logits.argmax(dim=-1, keepdim=True)
        routing_map = torch.zeros_like(probs).scatter_(1, top_indices, 1.0)
        tokens_per_expert = routing_map.sum(0)
        aux_loss = AUX_COEFF * EXPERTS * torch.sum(probs.mean(0) * tokens_per_expert / TOKENS)
        weights = self.expert_weight[top_indices.squeeze(1)]
        expert_output = torch.bmm(hidden_states.unsqueeze(1), weights).squeeze(1)
        output = expert_output * probs.gather(1, top_indices)
        return MoEAuxLossAutoScaler.apply(output, aux_loss)


def fwd_bwd(layer, hidden_states, labels):
    """One micro-batch: forward, the loss (already divided by num_microbatches) and backward."""
    output = layer(hidden_states)
    loss = ((output - labels) ** 2).mean() / NUM_MICROBATCHES
    grads = torch.autograd.grad(loss, layer.parameters())
    return (loss.detach(), *grads)


def moe_loss_scale(variant: str, device: str):
    """``forward_step``: the scale for the aux loss (no grad_scale_func: bf16)."""
    loss_scale = torch.ones((), device=device) if variant == "fix" else host(torch.tensor(1.0), device)
    return loss_scale / NUM_MICROBATCHES


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    data = [[(randn(TOKENS, DIM, gen=gen, device=device), randn(TOKENS, DIM, gen=gen, device=device, scale=0.3))
             for _ in range(NUM_MICROBATCHES)] for _ in range(ITERS)]

    def train(step_fn, train_step_begin=lambda layer, it: None):
        layer = MoELayer(device)
        outs = []
        for it in range(ITERS):
            train_step_begin(layer, it)
            main_grads = [torch.zeros_like(p) for p in layer.parameters()]
            for hidden_states, labels in data[it]:
                # forward_step: sets the aux-loss scale for this micro-batch's backward
                MoEAuxLossAutoScaler.set_loss_scale(moe_loss_scale(variant, device))
                loss, *grads = step_fn(layer, hidden_states, labels)
                outs.append(loss.clone())
                for main_grad, grad in zip(main_grads, grads):
                    main_grad += grad                          # DDP main_grad accumulation
            with torch.no_grad():
                for p, main_grad in zip(layer.parameters(), main_grads):
                    p.sub_(LR * main_grad)
        return outs + [p.detach().clone() for p in layer.parameters()]

    def eager():
        reset_aux_loss_scaler(variant, device)
        return train(fwd_bwd)

    def served():
        reset_aux_loss_scaler(variant, device)
        graphs = {}

        def cuda_graph_capture(layer, it):
            """``train_step``: at the first training iteration, before any forward_step,
            make_graphed_callables warms up on sample args, then captures fwd and bwd."""
            if it != 0:
                return
            static_x = torch.zeros(TOKENS, DIM, device=device)
            static_y = torch.zeros(TOKENS, DIM, device=device)
            g, outputs = capture(lambda: fwd_bwd(layer, static_x, static_y), device=device, warmups=3,
                                 static={"hidden_states": static_x, "labels": static_y},
                                 owner="TE make_graphed_callables (MoE layer)")
            graphs.update(g=g, outputs=outputs, x=static_x, y=static_y)

        def step(layer, x, y):
            graphs["x"].copy_(x)
            graphs["y"].copy_(y)
            return replay(graphs["g"], graphs["outputs"], size=1)

        return train(step, cuda_graph_capture)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
