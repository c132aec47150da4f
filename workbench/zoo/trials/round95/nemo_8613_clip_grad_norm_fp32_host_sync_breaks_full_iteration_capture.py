"""NeMo's full-iteration CUDA graph (``CUDAGraphCallback``) cannot capture a Stable Diffusion training step: ``clip_grad_norm_fp32`` builds host tensors and reads the gradient norm back to the host inside the captured optimizer step.

Upstream: https://github.com/NVIDIA/NeMo/pull/8613 ("[SD] CUDA Graphs update", NVIDIA/NeMo, merged 2024-04-09 as
commit c5738263d8). Read: the squashed commit message (its parts include "[SD] remove synchronizations", "[SD] Remove
the sync invoked by tensor allocation", "Make the model sync-free again", "fix bugs for FSDP in clip_grads"), the
diff of ``nemo/collections/nlp/modules/common/megatron/clip_grads.py`` (``clip_grad_norm_fp32`` before and after, in
full), of ``nemo/core/optim/megatron_fused_adam.py`` (the same ``torch.tensor([0.0], device=...)`` ->
``torch.zeros(1, device=...)`` change), of ``ldm/ddpm.py`` (``MegatronLatentDiffusion.training_step`` now takes
``batch``; ``non_cuda_graph_capturable``) and of ``sd_train.py`` (installs ``CUDAGraphCallback(capture_iteration=
cfg.model.capture_cudagraph_iters)``); ``nemo/utils/callbacks/cuda_graph.py`` at the merge (``StaticBufferLoader``,
patched ``zero_grad`` / ``get_lr`` / ``training_step``, ``get_optimizer_step``: eager iterations on a side stream,
capture of the whole PTL ``optimizer_step`` at ``capture_iteration``, replay from then on); and
``MegatronBaseModel.configure_gradient_clipping`` (``sd_train.yaml``: ``gradient_clip_val: 1.0``, ``fused_adam``, so
clipping goes through ``clip_grad_norm_fp32``). The PR has no linked issue; the symptom below is reconstructed
from the code and the commit titles.
Symptom: with ``model.capture_cudagraph_iters >= 0`` SD training fails at the capture iteration (``operation not
permitted when stream is capturing``): gradient clipping synchronises with the host inside the captured step.
Mechanism: PyTorch Lightning runs gradient clipping inside ``optimizer_step`` (closure, then
``configure_gradient_clipping``, then ``optimizer.step``), and the callback captures the whole ``optimizer_step``.
The old ``clip_grad_norm_fp32`` did host work there: ``dummy_overflow_buf = torch.cuda.IntTensor([0])`` (a pageable
host-to-device copy), ``torch.cuda.FloatTensor([float(total_norm)])`` (``float()`` of a device norm, then another
upload), ``total_norm_cuda[0].item()`` and a Python ``if clip_coeff < 1.0`` on the result. The eager iterations before
``capture_iteration`` run it without complaint (only slowly); the capture refuses the first of them.
Doctor: sync-in-capture, at clip_grad_norm_fp32. The function copies host data to the device and reads the norm
back to the host (``float`` / ``.item()``) while the optimizer step is being captured.
Fix (upstream): keep the norm on the device: ``total_norm = torch.zeros(1, device='cuda').squeeze()``, the overflow
buffer made by ``torch.zeros(1, dtype=int32, device='cuda')``, the all-reduce on ``total_norm`` itself,
``total_norm ** (1 / norm_type)`` as a tensor, ``clip_coeff_clamped = torch.clamp(clip_coeff, max=1.0)`` and
``torch._foreach_mul_(grads, clip_coeff_clamped.squeeze())`` instead of the host branch and ``multi_tensor_scale``;
the function returns the norm as a device tensor.
Modelled: ``clip_grad_norm_fp32`` (the 2-norm and p-norm paths of both versions line by line; the inf-norm and FSDP
branches are left out), ``multi_tensor_applier`` with stand-ins for ``amp_C.multi_tensor_l2norm`` /
``multi_tensor_scale`` (torch ops; the overflow flag is passed and ignored), ``param_is_not_shared`` /
``param_is_not_tensor_parallel_duplicate``, a one-rank ``parallel_state`` whose ``all_reduce`` is the identity,
``MegatronBaseModel.configure_gradient_clipping`` / ``get_parameters_with_grad`` and ``self.log`` (with the
callback's ``to_tensor``), ``MegatronLatentDiffusion.training_step`` (zero_grad, forward/backward, loss kept for
logging), the callback's ``CUDAGraphState``, ``StaticBufferLoader``, patched ``zero_grad`` (a no-op while capturing),
patched ``get_lr`` (static lr tensor written outside the graph), ``get_training_step`` (result copied to
``state.output``) and ``get_optimizer_step`` (eager before ``capture_iteration``, zero_grad(set_to_none) then capture,
replay from then on; side streams and the one-second sleep left out). Stand-ins: the UNet is a two-layer MLP over
(noisy latent, timestep embedding, context); ``p_losses`` is DDPM's epsilon MSE with the noise supplied by the batch
(upstream draws it with ``randn_like`` inside the step); the optimizer is apex ``FusedAdam(capturable=True)`` as
torch ops with a device step counter; the LR policy is ``WarmupHoldPolicy``; float64 instead of fp32.
Workload: 16 training iterations of batch 4 (4-channel latents, 3-dim context), gradient_clip_val 0.5 (clipping is
active on every step), capture_iteration 12 as upstream requires (> 11). The bug raises CaptureError at the capture
(the ``torch.cuda.IntTensor([0])`` upload; then ``float``/``.item()`` would follow; on an H200 torch raises "Cannot copy
between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"); the fix captures at iteration
12, replays iterations 12-15 and equals eager on every step's loss and grad_norm and on the final weights (max error 0,
on the CPU and on CUDA).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from workbench.engine import events, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/8613"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "clip_grad_norm_fp32"
SYMPTOM = ("Stable Diffusion training with NeMo's full-iteration CUDAGraphCallback fails at the capture iteration: "
           "clip_grad_norm_fp32 uploads host tensors and reads the gradient norm back to the host (.item()) inside "
           "the captured optimizer step")

LATENT, CONTEXT, TEMB, HIDDEN, BATCH, TIMESTEPS = 4, 3, 4, 8, 4, 10
ITERS, CAPTURE_ITERATION = 16, 12
GRADIENT_CLIP_VAL, BASE_LR, WARMUP_STEPS = 0.5, 2e-2, 14
DTYPE = torch.float64

_variant = "bug"
_device = "cpu"


# --- torch.cuda.IntTensor / FloatTensor (legacy constructors: Python data uploaded to the device) -------------------

def cuda_IntTensor(data): return torch.tensor(data, dtype=torch.int32, device=_device)   # noqa: E704
def cuda_FloatTensor(data): return torch.tensor(data, dtype=DTYPE, device=_device)   # noqa: E704 (float64 here)


# --- megatron.core.parallel_state / torch.distributed (one model-parallel rank) --------------------------------------

class parallel_state:
    get_model_parallel_group = staticmethod(lambda: "model_parallel_group(size 1)")
    get_tensor_model_parallel_rank = staticmethod(lambda: 0)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> None:
    """``torch.distributed.all_reduce`` over a group of one rank: the tensor is already the sum."""


def param_is_not_shared(param) -> bool:
    return not hasattr(param, 'shared') or not param.shared


def param_is_not_tensor_parallel_duplicate(param) -> bool:
    return getattr(param, 'tensor_model_parallel', False) or parallel_state.get_tensor_model_parallel_rank() == 0


# --- apex.multi_tensor_apply / amp_C (stand-ins) ---------------------------------------------------------------------

class amp_C:
    @staticmethod
    def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor):
        norms = torch.stack([t.pow(2).sum() for t in tensor_lists[0]])
        return norms.sum().sqrt().reshape(1), (norms.sqrt() if per_tensor else None)

    @staticmethod
    def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
        for src, dst in zip(*tensor_lists):
            dst.copy_(src * scale)


def multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


# --- nemo/collections/nlp/modules/common/megatron/clip_grads.py -------------------------------------------------------

@torch.no_grad()
def clip_grad_norm_fp32(parameters, max_norm, norm_type=2, use_fsdp=False):
    """Clips gradient norm of an iterable of parameters whose gradients are in fp32 (in place)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    grads_for_norm = []
    if _variant == "bug":
        dummy_overflow_buf = cuda_IntTensor([0])
    for param in parameters:
        if param.grad is not None:
            is_not_shared = param_is_not_shared(param)
            is_not_tp_duplicate = param_is_not_tensor_parallel_duplicate(param)
            grad = param.grad.detach()
            grads.append(grad)
            if is_not_shared and is_not_tp_duplicate:
                grads_for_norm.append(grad)

    # Norm parameters.
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if _variant == "bug":
        total_norm = 0.0
    else:
        total_norm = torch.zeros(1, device=_device, dtype=DTYPE).squeeze()

    # Calculate norm (the inf-norm branch is left out).
    if norm_type == 2.0:
        if _variant == "fix":
            dummy_overflow_buf = torch.zeros(1, device=_device, dtype=torch.int32).squeeze()
        # Use apex's multi-tensor applier for efficiency reasons.
        if len(grads_for_norm) > 0:
            grad_norm, _ = multi_tensor_applier(
                amp_C.multi_tensor_l2norm, dummy_overflow_buf, [grads_for_norm], False  # no per-parameter norm
            )
        else:
            grad_norm = 0.0 if _variant == "bug" else torch.zeros(1, device=_device, dtype=DTYPE).squeeze()
        # Since we will be summing across data parallel groups, we need the pow(norm-type).
        total_norm = grad_norm ** norm_type
    else:
        for grad in grads_for_norm:
            grad_norm = torch.norm(grad, norm_type)
            total_norm += grad_norm ** norm_type

    if _variant == "bug":
        total_norm_cuda = cuda_FloatTensor([float(total_norm)])
        # Sum across all model-parallel GPUs.
        all_reduce(total_norm_cuda, op="sum", group=parallel_state.get_model_parallel_group())
        total_norm = total_norm_cuda[0].item()
        total_norm = total_norm ** (1.0 / norm_type)

        # Scale.
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            if len(grads) > 0:
                multi_tensor_applier(amp_C.multi_tensor_scale, dummy_overflow_buf.fill_(0), [grads, grads], clip_coeff)
        return total_norm

    # Sum across all model-parallel GPUs.
    all_reduce(total_norm, op="sum", group=parallel_state.get_model_parallel_group())
    total_norm = total_norm ** (1.0 / norm_type)

    # Scale.
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    clip_coeff_clamped = torch.clamp(clip_coeff, max=1.0)
    if len(grads) > 0:
        torch._foreach_mul_(grads, clip_coeff_clamped.squeeze())
    return total_norm


# --- apex FusedAdam(capturable=True) and NeMo's WarmupHoldPolicy (stand-ins) ------------------------------------------

class FusedAdam:
    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, capturable=True):
        self.param_groups = [{"params": list(params), "lr": lr, "betas": betas, "eps": eps}]
        self.state: dict = {}

    def zero_grad(self, set_to_none: bool = True):
        for p in self.param_groups[0]["params"]:
            p.grad = None                                         # set_to_none (torch default)

    @torch.no_grad()
    def step(self):
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        if "step" not in group:                                   # capturable: the step count lives on the device
            group["step"] = torch.zeros(1, dtype=DTYPE, device=_device)
        group["step"] += 1
        bc1, bc2 = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state.setdefault(id(p), {})
            if len(state) == 0:
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (state["exp_avg_sq"] / bc2).sqrt().add_(group["eps"])
            p.sub_(group["lr"] * (state["exp_avg"] / bc1) / denom)


class WarmupHoldPolicy:
    def __init__(self, optimizer, warmup_steps, max_lr):
        self.optimizer, self.warmup_steps, self.max_lr, self.last_epoch = optimizer, warmup_steps, max_lr, 0

    def get_lr(self):          # as patched by CUDAGraphCallback: the lr is written into a static tensor
        lrs = [torch.full((), self.max_lr * min(1.0, (self.last_epoch + 1) / self.warmup_steps), dtype=DTYPE)]
        if not hasattr(self, "static_lrs"):
            self.static_lrs = [lr.to(_device) for lr in lrs]
        for i in range(len(lrs)):
            self.static_lrs[i].copy_(lrs[i])
        return self.static_lrs

    def step(self):
        self.optimizer.param_groups[0]["lr"], self.last_epoch = self.get_lr()[0], self.last_epoch + 1


# --- the model: MegatronLatentDiffusion (ldm/ddpm.py) on MegatronBaseModel ---------------------------------------------

class MegatronLatentDiffusion:
    def __init__(self):
        gen = generator(8613)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=_device, scale=scale).to(DTYPE).requires_grad_()
        self.w_in, self.w_t, self.w_c, self.w_out = r(LATENT, HIDDEN), r(TEMB, HIDDEN), r(CONTEXT, HIDDEN), r(HIDDEN, LATENT)
        betas = torch.linspace(1e-4, 2e-2, TIMESTEPS, dtype=DTYPE)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.sqrt_alphas_cumprod = alphas_cumprod.sqrt().to(_device)
        self.sqrt_one_minus_alphas_cumprod = (1.0 - alphas_cumprod).sqrt().to(_device)
        self._optimizer = FusedAdam(self.parameters(), lr=torch.zeros((), dtype=DTYPE, device=_device))
        self.logged: dict = {}

    def parameters(self):
        return [self.w_in, self.w_t, self.w_c, self.w_out]

    # UNetModel stand-in: eps prediction from the noisy latent, the timestep embedding and the context
    def diffusion_model(self, x, timesteps, context):
        half = TEMB // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device, dtype=DTYPE) / half)
        args = timesteps[:, None].to(DTYPE) * freqs[None]
        temb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        h = torch.nn.functional.silu(x @ self.w_in + temb @ self.w_t + context @ self.w_c)
        return h @ self.w_out

    def p_losses(self, x_start, cond, t, noise):
        x_noisy = (self.sqrt_alphas_cumprod.gather(-1, t)[:, None] * x_start
                   + self.sqrt_one_minus_alphas_cumprod.gather(-1, t)[:, None] * noise)
        model_output = self.diffusion_model(x_noisy, t, context=cond)
        return torch.nn.functional.mse_loss(model_output, noise)

    def fwd_bwd_step(self, dataloader_iter):
        batch = next(dataloader_iter)
        loss = self.p_losses(batch["x"], batch["c"], batch["t"], batch["noise"])
        loss.backward()                                              # Megatron's fwd/bwd function runs backward
        return loss.detach()

    def training_step(self, batch):
        # we zero grads here because we also call backward in the megatron-core fwd/bwd functions
        self._optimizer.zero_grad()
        dataloader_iter = iter([batch])
        loss_mean = self.fwd_bwd_step(dataloader_iter)
        self.loss_mean = loss_mean                                   # logged outside the capturing range
        return loss_mean

    def get_parameters_with_grad(self):
        return [p for p in self.parameters() if p.grad is not None]

    def log(self, name, value):                                      # with the callback's sync-free to_tensor
        self.logged[name] = to_tensor(value)

    def configure_gradient_clipping(self):
        """PTL hook: gradient clipping implementation from megatron-lm (fused_adam, no distributed optimizer)."""
        clip_val = float(GRADIENT_CLIP_VAL)
        parameters = self.get_parameters_with_grad()
        grad_norm = clip_grad_norm_fp32(parameters=parameters, max_norm=clip_val, use_fsdp=False)
        self.log('grad_norm', grad_norm)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        """LightningModule.optimizer_step -> precision plugin: closure, gradient clipping, optimizer.step()."""
        optimizer_closure()
        self.configure_gradient_clipping()
        optimizer.step()


def to_tensor(value):   # the callback's sync-free LightningModule.__to_tensor
    return (value.clone().detach() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=DTYPE)).squeeze()


# --- nemo/utils/callbacks/cuda_graph.py ---------------------------------------------------------------------------------

class StaticBufferLoader:
    """Load data to static buffers."""
    def __init__(self, loader):
        self.loader, self.static = loader, None

    def __iter__(self):
        for inputs in self.loader:
            if self.static is None:
                self.static = {k: v.clone() for k, v in inputs.items()}
            for k in inputs:
                self.static[k].copy_(inputs[k])
            yield self.static


def zero_grad(optimizer, *args, **kwargs):
    # We invoke zero_grad before graph capturing.
    if not is_capturing():                                           # torch.cuda.is_current_stream_capturing()
        optimizer.__orig_zero_grad__(*args, **kwargs)


@dataclass
class CUDAGraphState:
    current_iteration: int = 0
    capture_iteration: int = -1  # -1 to disable
    graph: Any = None
    graph_outputs: Any = None
    output: Any = None  # static forward output


def get_training_step(model, state):
    def training_step(batch):
        results = model.__orig_training_step__(batch)
        if state.output is None:
            state.output = results.clone()
        # Copy results to static buffer to rebuild states required by PL.
        with torch.no_grad():
            state.output.copy_(results)
        return results
    return training_step


def get_optimizer_step(model, state, static_batch):
    def optimizer_step(epoch, batch_idx, optimizer, optimizer_closure=None):
        if 0 <= state.current_iteration < state.capture_iteration or state.capture_iteration < 0:
            with events.warmup():
                optimizer.zero_grad(set_to_none=True)
                model.__orig_optimizer_step__(epoch, batch_idx, optimizer, optimizer_closure=optimizer_closure)

        if state.current_iteration == state.capture_iteration:
            optimizer.zero_grad(set_to_none=True)

            def step():
                model.__orig_optimizer_step__(epoch, batch_idx, optimizer, optimizer_closure=optimizer_closure)
                return state.output, model.logged['grad_norm']

            group = optimizer.param_groups[0]
            opt_state = {f"param[{i}].{k}": v for i, p in enumerate(group["params"])
                         for k, v in [("data", p), *optimizer.state[id(p)].items()]}
            opt_state["step"] = group["step"]
            state.graph, state.graph_outputs = capture(
                step, device=_device, warmups=0, name="full iteration", owner="CUDAGraphCallback",
                capture_error_mode="global", static={**{f"batch[{k}]": v for k, v in static_batch.items()},
                                                     "static_lrs[0]": group["lr"]}, state=opt_state)

        # Graph replay and reconstruct missing result
        if state.current_iteration >= state.capture_iteration >= 0:
            replay(state.graph, state.graph_outputs, size=1)

        state.current_iteration += 1
    return optimizer_step


# --- the training loop (PTL fit loop, one optimizer, automatic optimization) -----------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    gen = generator(86130)
    batches = [{"x": randn(BATCH, LATENT, gen=gen, device=device).to(DTYPE),
                "c": randn(BATCH, CONTEXT, gen=gen, device=device).to(DTYPE),
                "t": torch.randint(0, TIMESTEPS, (BATCH,), generator=gen).to(device),
                "noise": randn(BATCH, LATENT, gen=gen, device=device).to(DTYPE)} for _ in range(ITERS)]

    def fit(use_cuda_graph: bool):
        model = MegatronLatentDiffusion()
        optimizer, loader = model._optimizer, StaticBufferLoader(batches)
        scheduler = WarmupHoldPolicy(optimizer, WARMUP_STEPS, BASE_LR)
        model.__orig_training_step__ = model.training_step
        model.__orig_optimizer_step__ = model.optimizer_step
        optimizer.__orig_zero_grad__ = optimizer.zero_grad
        state = CUDAGraphState(capture_iteration=CAPTURE_ITERATION if use_cuda_graph else -1)
        if use_cuda_graph:                                         # CUDAGraphCallback.on_train_start
            optimizer.zero_grad = lambda *a, **k: zero_grad(optimizer, *a, **k)
            model.training_step = get_training_step(model, state)
        outs = []
        for batch_idx, batch in enumerate(loader):
            scheduler.step()                                       # outside the graph: writes static_lrs
            closure = lambda: model.training_step(batch)
            if use_cuda_graph:
                get_optimizer_step(model, state, loader.static)(0, batch_idx, optimizer, optimizer_closure=closure)
                if state.current_iteration > state.capture_iteration:
                    loss, grad_norm = state.graph_outputs          # ClosureResult from state.output; logged norm
                else:
                    loss, grad_norm = state.output, model.logged['grad_norm']
            else:
                optimizer.zero_grad(set_to_none=True)
                model.optimizer_step(0, batch_idx, optimizer, optimizer_closure=closure)
                loss, grad_norm = model.loss_mean, model.logged['grad_norm']
            outs += [loss.clone(), grad_norm.clone()]
        return outs + [p.detach().clone() for p in model.parameters()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: fit(True), lambda: fit(False))
