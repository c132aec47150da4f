"""Full-iteration graph gathers params from the shared grad/param buffer that the first iteration left zeroed.

Upstream: https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/3076 ("Fix convergence issue with mxfp8
param + full cuda graph"; Megatron-Bridge is the NeMo framework's Megatron training library,
``src/megatron/bridge/training/train.py``).
Symptom: with ``fp8_param_gather=True`` + ``reuse_grad_buf_for_mxfp8_param_ag=True`` +
``overlap_param_gather=True`` and a full-iteration CUDA graph (``cuda_graph_impl=local``,
``cuda_graph_scope=full_iteration``), the first training iteration after the graph warmup has zero grad
norm and a wrong loss, and the run's loss curve departs from the run without graphs (April 2026).
Mechanism: with ``reuse_grad_buf_for_mxfp8_param_ag`` the param all-gather buffer *is* the grad buffer.
Each ``train_step`` zeroes it (``zero_grad_buffer``) and then ``_handle_mxfp8_param_buffer_copy`` copies
the optimizer's main params back into it, so that the overlapped param all-gather (run by the forward
pre-hook, ``finish_param_sync``) has the new params to gather into ``param.data``. The training loop
disables forward pre-hooks for the first iteration, and the copy was guarded by
``forward_pre_hook_enabled``: eagerly that is safe, since without the hook nothing gathers and the
params are already in ``param.data``. The full-iteration graph, though, was captured with the gather
(and the copy into ``param.data`` and the re-zeroing of the buffer) inside it, and a replay runs it
whatever the hooks say now: it gathers the zeroed buffer into ``param.data``, and the iteration trains
a zero-weight model; every later iteration starts from those weights.
Doctor: stale-input, at ``_handle_mxfp8_param_buffer_copy`` (the refresh of the buffer the graph reads
is skipped on this step; the graph reads what ``zero_grad_buffer`` left there).
Fix (upstream): also copy the main params into the param buffer when a full-iteration training graph
has been captured (``FullCudaGraphWrapper.cuda_graph["training"] is not None``), whatever the state of
the forward pre-hooks.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/3076"
FAMILY = "persistent-buffer mutation"
KIND = "stale-input"
SITE = "_handle_mxfp8_param_buffer_copy"
SYMPTOM = "first graphed iteration gathers a zeroed buffer into param.data: zero weights, wrong loss"
TOKENS, DIM, OUT, ITERS, LR = 6, 4, 3, 3, 0.1


class FullCudaGraphWrapper:
    cuda_graph: dict = {}


class DistributedOptimizer:
    """fp32 main params (this DP rank owns all of them: DP size 1) and the step."""

    def __init__(self, model_chunk):
        self.model_chunk = model_chunk
        self.main_param = model_chunk.weight.detach().clone()

    def _copy_main_params_to_param_buffer(self):
        self.model_chunk.param_data.copy_(self.main_param.view(-1))

    def step(self):
        self.main_param.sub_(LR * self.model_chunk.grad_data.view_as(self.main_param))


class ChainedOptimizer:
    def __init__(self, optimizers):
        self.chained_optimizers = optimizers

    def step(self):
        for optim_instance in self.chained_optimizers:
            optim_instance.step()


class DistributedDataParallel:
    """One linear layer; its grad buffer doubles as the param all-gather buffer (reuse_grad_buf)."""

    def __init__(self, device):
        gen = generator(3076)
        self.weight = randn(DIM, OUT, gen=gen, device=device)        # param.data (mxfp8 upstream)
        self.grad_data = torch.zeros(DIM * OUT, device=device)
        self.param_data = self.grad_data                               # reuse_grad_buf_for_mxfp8_param_ag
        self.remove_forward_pre_hook_handles = []

    def enable_forward_pre_hook(self):
        self.remove_forward_pre_hook_handles = ["finish_param_sync"]

    def disable_forward_pre_hook(self):
        self.remove_forward_pre_hook_handles = []

    def zero_grad_buffer(self):
        self.grad_data.zero_()

    def finish_param_sync(self):
        """The forward pre-hook: the (overlapped) param all-gather lands in ``param.data``; the shared
        buffer is then zeroed for the grads."""
        self.weight.copy_(self.param_data.view_as(self.weight))
        self.param_data.zero_()


def forward_backward_func(model, tokens, labels):
    """One micro-batch, forward and backward; grads accumulate into the grad buffer (main_grad)."""
    if model.remove_forward_pre_hook_handles:
        model.finish_param_sync()
    out = tokens @ model.weight
    err = out - labels
    loss = (err ** 2).mean()
    model.grad_data.add_((tokens.t() @ (2 * err / err.numel())).view(-1))
    return loss


def _handle_mxfp8_param_buffer_copy(optimizer, model, reuse_grad_buf_for_mxfp8_param_ag,
                                    overlap_param_gather, variant):
    """Copy main params to param buffer for mxfp8 with grad buffer reuse (skipped on the first
    iteration, when the forward pre-hook is disabled)."""
    if reuse_grad_buf_for_mxfp8_param_ag and overlap_param_gather:
        forward_pre_hook_enabled = len(model[0].remove_forward_pre_hook_handles) > 0
        full_cg_captured = FullCudaGraphWrapper.cuda_graph.get("training") is not None
        if forward_pre_hook_enabled or (variant == "fix" and full_cg_captured):
            for optim_instance in optimizer.chained_optimizers:
                if isinstance(optim_instance, DistributedOptimizer):
                    optim_instance._copy_main_params_to_param_buffer()


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    data = [(randn(TOKENS, DIM, gen=gen, device=device), randn(TOKENS, OUT, gen=gen, device=device))
            for _ in range(ITERS)]

    def train(graphed: bool):
        FullCudaGraphWrapper.cuda_graph = {}
        ddp = DistributedDataParallel(device)
        model = [ddp]
        optimizer = ChainedOptimizer([DistributedOptimizer(ddp)])
        tokens = torch.zeros(TOKENS, DIM, device=device)
        labels = torch.zeros(TOKENS, OUT, device=device)
        if graphed:
            # FullCudaGraphWrapper: warmup steps, then capture of forward_backward_func with the
            # forward pre-hook (the param gather) in it. The buffer holds the current params first.
            ddp.enable_forward_pre_hook()
            ddp.zero_grad_buffer()
            optimizer.chained_optimizers[0]._copy_main_params_to_param_buffer()
            g, loss_out = capture(lambda: forward_backward_func(ddp, tokens, labels), device=device,
                                  static={"tokens": tokens, "labels": labels},
                                  state={"param_data": ddp.param_data, "weight": ddp.weight},
                                  owner="FullCudaGraphWrapper (training)")
            FullCudaGraphWrapper.cuda_graph["training"] = g
        outs = []
        for it in range(ITERS):
            if it == 0:
                ddp.disable_forward_pre_hook()        # params already in param.data
            elif it == 1:
                ddp.enable_forward_pre_hook()
            # train_step
            ddp.zero_grad_buffer()
            _handle_mxfp8_param_buffer_copy(optimizer, model, True, True, variant)
            x, y = data[it]
            if graphed:
                tokens.copy_(x)
                labels.copy_(y)
                loss = replay(g, loss_out, size=1).clone()
            else:
                loss = forward_backward_func(ddp, x, y)
            optimizer.step()
            outs.append(loss)
        return outs + [optimizer.chained_optimizers[0].main_param.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
