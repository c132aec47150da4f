"""Grad buffers offloaded for RL rollouts come back at a new address; the training graphs write the old one.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/3231 ("Do not offload grad buffers when training
graphs are enabled", commit 27a5f83eb1): "Enabling gradient buffer offload when training cudagraphs are
enabled causes an IMA. The long-term TODO here is to either do full-iteration cudagraphs or offload with
fixed addresses."
Symptom: Megatron RL with ``--rl-training-cuda-graphs`` and ``--rl-offload-optimizer-during-inference``:
the first training step after a rollout phase dies with an illegal memory access (Megatron-LM main,
Feb 2026).
Mechanism: the training CUDA graphs are captured on the first training step; their backward accumulates
weight gradients straight into ``param.main_grad``, a view of the DDP grad buffer ``grad_data``, so the
graph holds that buffer's address. Before every rollout phase ``get_environment_rollouts`` calls
``offload_grad_buffers()``, which frees the storage (``grad_data.storage().resize_(0)`` and
``empty_cache``); ``restore_grad_buffers()`` afterwards allocates a fresh block (``resize_(n)``), and every
view becomes valid again over the new block. The next replay of the training graph writes the gradients
through the old, released address: an illegal memory access (or, if the block was handed on, gradients
written into someone else's memory while the optimizer reads a zeroed ``main_grad``).
Doctor: dangling-reference, at ``wgrad_gemm_accum_fp32`` (the captured accumulation into ``main_grad``).
Fix (upstream): skip ``offload_grad_buffers()`` when training CUDA graphs are enabled (log a warning and
keep the buffers resident); only the optimizer state is offloaded.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/3231"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "wgrad_gemm_accum_fp32"
SYMPTOM = "illegal memory access: the training graph accumulates into a grad buffer freed by the rollout offload"
IN, OUT, TOKENS, MICROBATCHES, ITERATIONS, LR = 4, 3, 3, 2, 3, 0.1


class Args:
    """The two ``megatron/training/arguments.py`` flags that matter here."""

    def __init__(self, rl_offload_optimizer_during_inference: bool = True, rl_training_cuda_graphs: bool = False):
        self.rl_offload_optimizer_during_inference = rl_offload_optimizer_during_inference
        self.rl_training_cuda_graphs = rl_training_cuda_graphs


class Linear:
    """One layer with gradient-accumulation fusion: its wgrad GEMM accumulates into ``weight.main_grad``."""

    def __init__(self, device):
        self.weight = randn(OUT, IN, gen=generator(3231), device=device, scale=0.5)
        self.weight.main_grad = None

    def parameters(self):
        return [self.weight]


class _ParamAndGradBuffer:
    """The DDP buffer: one flat ``grad_data`` with every ``param.main_grad`` a view into it."""

    def __init__(self, params, device):
        self.params = params
        self.device = device
        self.numel = max(sum(p.numel() for p in params), own_segment_elems(device))
        self.grad_data = torch.zeros(self.numel, device=device)
        self.grad_data_size = 0
        self._point_views()

    def _point_views(self):
        storage, offset = self.grad_data.untyped_storage(), 0
        for p in self.params:
            if p.main_grad is None:
                p.main_grad = torch.empty(0, device=self.device)
            if self.grad_data.numel():
                p.main_grad.set_(storage, offset, p.shape, (p.shape[1], 1))
            else:                                       # offloaded: the view has no memory behind it
                p.main_grad.set_(storage, 0, (0,), (1,))
            offset += p.numel()

    def _storage_resize_(self, numel):
        """``self.grad_data.storage().resize_(numel)``: 0 hands the block back, ``numel`` takes a new one.
        The tensor objects stay; their address changes. (The CPU graph keys memory on storages, so the
        new block is a new storage under the same tensors.)"""
        storage = torch.empty(numel, device=self.device).untyped_storage()
        self.grad_data.set_(storage, 0, (numel,), (1,))
        self._point_views()

    def reset(self):
        self.grad_data.zero_()

    def offload_to_cpu(self, move_params: bool = True, move_grads: bool = True):
        if move_grads and self.grad_data.numel() > 0:
            self.grad_data_size = self.grad_data.numel()
            self._storage_resize_(0)

    def reload_from_cpu(self, move_params: bool = True, move_grads: bool = True):
        if move_grads and self.grad_data_size > 0:
            self._storage_resize_(self.grad_data_size)
            self.grad_data.zero_()
            self.grad_data_size = 0


class DistributedDataParallel:
    def __init__(self, module, device):
        self.module = module
        self.device = device
        self.buffers = [_ParamAndGradBuffer(module.parameters(), device)]

    def zero_grad_buffer(self):
        for buffer in self.buffers:
            buffer.reset()

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True):
        for buffer in self.buffers:
            buffer.offload_to_cpu(move_params=False, move_grads=True)
        if empty_cache:
            release_to_driver(self.device)

    def restore_grad_buffers(self, synchronize: bool = True):
        for buffer in self.buffers:
            buffer.reload_from_cpu(move_params=False, move_grads=True)


def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
    """``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``: main_grad += grad_output^T @ input."""
    main_grad.add_(grad_output.t() @ total_input)


def forward_backward_step(layer, tokens, target):
    """One micro-batch: forward, loss 0.5 * ||y - target||^2, backward with fused wgrad accumulation."""
    output = tokens @ layer.weight.t()
    grad_output = output - target
    wgrad_gemm_accum_fp32(tokens, grad_output, layer.weight.main_grad)
    return 0.5 * grad_output.pow(2).sum(-1)


def optimizer_step(layer):
    layer.weight.sub_(LR * layer.weight.main_grad)


def get_environment_rollouts(args, variant, layer, ddp, prompts, rewards):
    """Offload, generate with the current weights, restore (``megatron/rl/rl_utils.py``)."""
    if args.rl_offload_optimizer_during_inference:
        if variant == "bug" or not args.rl_training_cuda_graphs:
            ddp.offload_grad_buffers()
        # else: "Gradient buffers will not be offloaded when training cudagraphs are enabled!"
    generations = prompts @ layer.weight.t()                     # the inference engine's rollouts
    rollouts = [(prompts[m], generations[m] + rewards[m]) for m in range(MICROBATCHES)]
    if args.rl_offload_optimizer_during_inference:
        ddp.restore_grad_buffers()
    return generations, rollouts


def run(variant: str, device: str = "cpu"):
    gen = generator(27)
    data = [(randn(MICROBATCHES, TOKENS, IN, gen=gen, device=device),
             randn(MICROBATCHES, TOKENS, OUT, gen=gen, device=device, scale=0.3)) for _ in range(ITERATIONS)]

    def serve(graphed: bool):
        layer = Linear(device)
        ddp = DistributedDataParallel(layer, device)
        args = Args(rl_training_cuda_graphs=graphed)
        static = {"tokens": torch.zeros(TOKENS, IN, device=device), "target": torch.zeros(TOKENS, OUT, device=device)}
        g = loss = None
        outs = []
        for prompts, rewards in data:
            generations, rollouts = get_environment_rollouts(args, variant, layer, ddp, prompts, rewards)
            outs.append(generations)
            if graphed and g is None:                          # training graphs: captured on the first train step
                static["tokens"].copy_(rollouts[0][0])
                static["target"].copy_(rollouts[0][1])
                g, loss = capture(lambda: forward_backward_step(layer, static["tokens"], static["target"]),
                                  device=device, static=static, state={"grad_data": ddp.buffers[0].grad_data},
                                  owner="Megatron CudaGraphManager (training graphs)")
            ddp.zero_grad_buffer()
            for tokens, target in rollouts:
                if not graphed:
                    outs.append(forward_backward_step(layer, tokens, target))
                    continue
                static["tokens"].copy_(tokens)
                static["target"].copy_(target)
                outs.append(replay(g, loss).clone())
            optimizer_step(layer)
        return outs + [layer.weight.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
