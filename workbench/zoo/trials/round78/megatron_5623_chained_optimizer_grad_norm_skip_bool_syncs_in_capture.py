"""Megatron's ChainedOptimizer tests its device-resident grad norm against the (default, infinite) skip threshold with a Python ``if``: the ``bool()`` syncs inside the optimizer CUDA-graph capture, and the capture fails.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5623 ("Short-circuit condition to avoid copying from GPU memory
in `ChainedOptimizer`", merged to main as a28ca480bb on 2026-07-13; the dev-branch backport #6355, "fix(optimizer):
AUT-1363 avoid grad threshold check during capture", says that "Bridge validation against MCore `dev` exposed a
GPU-to-host boolean conversion during optimizer CUDA graph capture"). The check came in with #3460 ("Skip gradient
updates when grad norm exceeds threshold", 180131620a, 2026-05-29). Read: ``git show a28ca480bb`` and, at that
commit, ``megatron/core/optimizer/optimizer.py`` (``ChainedOptimizer``, ``FP32Optimizer``),
``megatron/core/optimizer/clip_grads.py`` and ``megatron/core/optimizer/optimizer_cuda_graph.py``.
Symptom: training with ``--optimizer-cuda-graph`` fails at the iteration where the optimizer step is captured
(``cuda_graph_warmup_steps``): the stream capture is refused ("operation not permitted when stream is capturing",
cudaErrorStreamCaptureUnsupported) and the capture is invalidated. Without the optimizer graph, training is
unchanged (the threshold defaults to ``inf``, so the check never skips a step).
Mechanism: ``get_megatron_optimizer`` always returns a ``ChainedOptimizer`` (one sub-optimizer per parameter class,
e.g. dense and expert parameters). ``training.py`` wraps its ``step`` in ``OptimizerCudaGraphWrapper``, which runs
the first ``cuda_graph_warmup_steps`` optimizer steps eagerly and then captures ``ChainedOptimizer.step`` under
``torch.cuda.graph`` and replays it every later iteration. ``ChainedOptimizer.step`` gets ``grad_norm =
self.get_grad_norm()``; with TE's ``multi_tensor_scale_tensor`` available, ``get_grad_norm_fp32`` keeps the norm on
the device (``total_norm.pow(1.0 / norm_type)``, no ``.item()``), and ``clip_grad_by_total_norm_fp32`` scales by a
tensor ``clip_coeff``: that is what makes the step capturable. #3460 then added, per chained optimizer,
``if grad_norm > optimizer.config.grad_norm_skip_threshold and main_params:``. ``grad_norm > inf`` is a device
tensor, and the ``if`` calls ``bool()`` on it: a device-to-host copy and a wait. Eagerly it just waits and gives
False. Inside the capture CUDA refuses it, the capture is invalidated, and the training run dies.
Doctor: sync-in-capture, at step (``ChainedOptimizer.step``). A host synchronisation (``bool()`` of the device-side
comparison ``grad_norm > grad_norm_skip_threshold``) is attempted while the optimizer step's capture is open. The bug
lives in ``ChainedOptimizer.step``: the fix changed the condition there.
Fix (upstream): ``ChainedOptimizer.step`` reads ``grad_norm_skip_threshold = optimizer.config.grad_norm_skip_threshold``
and tests ``main_params and math.isfinite(grad_norm_skip_threshold) and grad_norm > grad_norm_skip_threshold``. The
host-side ``isfinite`` short-circuits the default configuration before the tensor comparison, so the device is never
read. (A finite threshold would still need the sync; the fix only covers the default, as modelled here.)
Modelled: one rank (all-reduces are the identity), float32 throughout. The model is a tiny MoE block: dense input,
router and output projections and 2 dense-mixture experts, MSE loss on random targets. Two ``FP32Optimizer`` s
(dense and expert parameters) are chained, each over a capturable fused Adam (TE ``FusedAdam(capturable=True)``:
the step count and the bias corrections stay on the device). ``clip_grad=1.0``, so gradients are clipped in place by
the device norm. Megatron's DDP grad buffer is ``param.main_grad`` (zeroed each iteration, filled by backward); the
backward is eager, only the optimizer step is graphed, as with ``--optimizer-cuda-graph`` alone. 6 iterations, the
first 2 optimizer steps eager. Left out: mixed precision and the grad scaler (``found_inf``), separate grad-norm
groups, distributed-optimizer sharding and param gather, ``count_zeros``, timers, logging. The wrapper's class-level
graph and iteration counter are instance attributes here, so that each run starts afresh.
"""
from __future__ import annotations

import logging
import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5623"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "step"
SYMPTOM = ("--optimizer-cuda-graph: capture of ChainedOptimizer.step is refused; bool(grad_norm > "
           "grad_norm_skip_threshold) on the device-resident grad norm syncs inside the capture")

TOKENS, HIDDEN, FFN, EXPERTS = 6, 8, 12, 2
TRAIN_ITERS, CUDA_GRAPH_WARMUP_STEPS = 6, 2
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8


# --- megatron/core/optimizer/optimizer_config.py --------------------------------------------------------------

class OptimizerConfig:
    def __init__(self, lr: float = LR, clip_grad: float = 1.0, grad_norm_skip_threshold: float = float("inf"),
                 optimizer_cuda_graph: bool = False, log_num_zeros_in_grad: bool = False):
        self.lr, self.clip_grad = lr, clip_grad
        self.grad_norm_skip_threshold = grad_norm_skip_threshold      # default: never skip
        self.optimizer_cuda_graph = optimizer_cuda_graph
        self.log_num_zeros_in_grad = log_num_zeros_in_grad


# --- megatron/core/optimizer/clip_grads.py --------------------------------------------------------------------

def get_grad_norm_fp32(grads_for_norm, norm_type=2):
    """The multi_tensor_l2norm path with multi_tensor_scale_tensor available: the norm stays on the device."""
    grad_norm = torch.stack([g.pow(2).sum() for g in grads_for_norm]).sum().reshape(1)   # multi_tensor_l2norm ** 2
    total_norm = grad_norm ** norm_type if norm_type != 2 else grad_norm                 # already the squared norm
    # torch.distributed.all_reduce(total_norm, SUM, group=grad_stats_parallel_group): one rank
    return total_norm.pow(1.0 / norm_type)


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm):
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff.clamp_max_(1.0)
        for g in grads:                                                                  # multi_tensor_scale_tensor
            g.mul_(clip_coeff)
    elif clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


# --- transformer_engine.pytorch.optimizers.FusedAdam(capturable=True) ------------------------------------------

class FusedAdam:
    def __init__(self, params, lr, betas, eps, device):
        self.param_groups = [{"params": list(params), "lr": lr, "betas": betas, "eps": eps}]
        self.state = {}
        for p in self.param_groups[0]["params"]:
            self.state[p] = {"step": torch.zeros(1, device=device), "exp_avg": torch.zeros_like(p),
                             "exp_avg_sq": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                state["step"].add_(1.0)
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                bias_correction1 = 1 - torch.pow(beta1, state["step"])
                bias_correction2 = 1 - torch.pow(beta2, state["step"])
                denom = (state["exp_avg_sq"] / bias_correction2).sqrt().add_(group["eps"])
                p.sub_(group["lr"] * (state["exp_avg"] / bias_correction1) / denom)


# --- megatron/core/optimizer/optimizer.py ----------------------------------------------------------------------

class FP32Optimizer:
    def __init__(self, optimizer: FusedAdam, config: OptimizerConfig):
        self.optimizer, self.config = optimizer, config
        self.is_stub_optimizer = optimizer is None

    def get_parameters(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_grads_for_grad_norm(self):
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        for param in self.get_parameters():
            if hasattr(param, "main_grad"):
                param.grad = param.main_grad
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True


class ChainedOptimizer:
    def __init__(self, chained_optimizers, variant: str):
        self.chained_optimizers = chained_optimizers
        self.config = chained_optimizers[0].config
        self.variant = variant

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf_flag = False
        for optimizer in self.chained_optimizers:
            found_inf_flag |= optimizer.prepare_grads()
        return found_inf_flag

    @torch.no_grad()
    def get_grad_norm(self):
        # grads_states_parallel_group_is_shared(): one norm over every chained optimizer's grads
        grads_for_norm = []
        for optimizer in self.chained_optimizers:
            grads_for_norm += optimizer.get_grads_for_grad_norm()
        return get_grad_norm_fp32(grads_for_norm)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        success = True
        for optimizer in self.chained_optimizers:
            success &= optimizer.step_with_ready_grads()
        return success

    @torch.no_grad()
    def step(self):
        found_inf_flag = self.prepare_grads()
        if found_inf_flag:
            return False, None, None

        grad_norm = self.get_grad_norm()
        should_skip_update = False

        # Clip gradients.
        for optimizer in self.chained_optimizers:
            parameters = optimizer.get_parameters()
            if len(parameters) == 0:
                continue
            main_params = list(parameters)                 # no separate grad-norm groups
            if optimizer.config.clip_grad > 0.0 and main_params:
                clip_grad_by_total_norm_fp32(main_params, max_norm=optimizer.config.clip_grad, total_norm=grad_norm)

            if self.variant == "bug":
                # #3460: bool() of a device tensor -- a D2H copy and a wait, refused inside the optimizer's capture
                if grad_norm > optimizer.config.grad_norm_skip_threshold and main_params:
                    logger.info("skipping grad norm because it's too large %s", grad_norm)
                    should_skip_update = True
            else:
                # #5623: a host-side check on the threshold short-circuits before the device is read
                grad_norm_skip_threshold = optimizer.config.grad_norm_skip_threshold
                if (
                    main_params
                    and math.isfinite(grad_norm_skip_threshold)
                    and grad_norm > grad_norm_skip_threshold
                ):
                    logger.info("skipping grad norm because it's too large %s", grad_norm)
                    should_skip_update = True

        num_zeros_in_grad = None                           # config.log_num_zeros_in_grad is False
        update_successful = False if should_skip_update else self.step_with_ready_grads()
        return update_successful, grad_norm, num_zeros_in_grad


# --- megatron/core/optimizer/optimizer_cuda_graph.py -----------------------------------------------------------

class OptimizerCudaGraphWrapper:
    """``optimizer.step = OptimizerCudaGraphWrapper(optimizer.step, cuda_graph_warmup_steps=...)``."""

    def __init__(self, optimizer_step_func, optimizer: ChainedOptimizer, device, cuda_graph_warmup_steps=1):
        self.optimizer_step_func = optimizer_step_func
        self.optimizer = optimizer
        self.device = device
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps
        self.curr_iteration = 0
        self.cuda_graph = None
        self.result = None

    def __call__(self):
        if self.curr_iteration == self.cuda_graph_warmup_steps:
            params = [p for o in self.optimizer.chained_optimizers for p in o.get_parameters()]
            adam_state = {f"{k}[{i}]": s[k] for o in self.optimizer.chained_optimizers
                          for i, s in enumerate(o.optimizer.state.values()) for k in ("step", "exp_avg", "exp_avg_sq")}
            self.cuda_graph, self.result = capture(
                self.optimizer_step_func, device=self.device, warmups=0, name="optimizer step",
                owner="OptimizerCudaGraphWrapper",
                static={f"main_grad[{i}]": p.main_grad for i, p in enumerate(params)},
                state={**{f"param[{i}]": p for i, p in enumerate(params)}, **adam_state})
        if self.cuda_graph is None:
            with events.warmup(real=True):                 # the real eager optimizer steps before the capture
                self.result = self.optimizer_step_func()
        else:
            update_successful, grad_norm, num_zeros = self.result
            grad_norm = replay(self.cuda_graph, grad_norm)
            self.result = (update_successful, grad_norm, num_zeros)
        self.curr_iteration += 1
        return self.result


# --- the model, Megatron's DDP grad buffer and the training loop (megatron/training/training.py) ----------------

class MoEBlock:
    def __init__(self, device):
        gen = generator(5623)
        self.dense = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4),            # linear_fc_in
                      randn(HIDDEN, EXPERTS, gen=gen, device=device, scale=0.4),           # router
                      randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)]            # linear_proj
        self.experts = [randn(EXPERTS, HIDDEN, FFN, gen=gen, device=device, scale=0.4),    # expert fc1
                        randn(EXPERTS, FFN, HIDDEN, gen=gen, device=device, scale=0.4)]    # expert fc2
        for p in self.parameters():
            p.requires_grad_(True)
            p.main_grad = torch.zeros_like(p)              # DDP grad buffer view

    def parameters(self):
        return self.dense + self.experts

    def forward(self, x):
        w_in, w_router, w_proj = self.dense
        fc1, fc2 = self.experts
        h = torch.tanh(x @ w_in)
        probs = torch.softmax(h @ w_router, dim=-1)
        expert_out = torch.stack([torch.tanh(h @ fc1[e]) @ fc2[e] for e in range(EXPERTS)], dim=1)
        return h + (probs[..., None] * expert_out).sum(dim=1) @ w_proj

    def zero_grad_buffer(self):
        for p in self.parameters():
            p.main_grad.zero_()

    def backward(self, loss):
        """DDP's backward hooks accumulate into ``main_grad``."""
        grads = torch.autograd.grad(loss, self.parameters())
        with torch.no_grad():
            for p, g in zip(self.parameters(), grads):
                p.main_grad.add_(g)


def get_megatron_optimizer(model: MoEBlock, config: OptimizerConfig, device, variant):
    dense = FP32Optimizer(FusedAdam(model.dense, config.lr, BETAS, EPS, device), config)
    expert = FP32Optimizer(FusedAdam(model.experts, config.lr, BETAS, EPS, device), config)
    return ChainedOptimizer([dense, expert], variant)


def run(variant: str, device: str = "cpu"):
    gen = generator(56230)
    batches = [(randn(TOKENS, HIDDEN, gen=gen, device=device), randn(TOKENS, HIDDEN, gen=gen, device=device))
               for _ in range(TRAIN_ITERS)]

    def train(optimizer_cuda_graph: bool):
        config = OptimizerConfig(optimizer_cuda_graph=optimizer_cuda_graph)
        model = MoEBlock(device)
        optimizer = get_megatron_optimizer(model, config, device, variant)
        step = optimizer.step
        if config.optimizer_cuda_graph:
            step = OptimizerCudaGraphWrapper(optimizer.step, optimizer, device,
                                             cuda_graph_warmup_steps=CUDA_GRAPH_WARMUP_STEPS)
        losses, grad_norms = [], []
        for x, y in batches:                               # train_step
            model.zero_grad_buffer()
            loss = ((model.forward(x) - y) ** 2).mean()
            model.backward(loss)
            update_successful, grad_norm, _ = step()
            losses.append(loss.detach().reshape(1))
            grad_norms.append(grad_norm.detach().clone())  # training_log reads it before the next step
        return [torch.cat(losses), torch.cat(grad_norms)] + [p.detach().clone() for p in model.parameters()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
