"""Megatron-FSDP's zero_grad drops the gradient references that only the captured fwd-bwd's host code installs.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4663 ("[Megatron-FSDP] Add conditional param.grad dereferencing
logic to support full-iteration (FWD-BWD) CUDA graphability.").
Symptom: Megatron-FSDP with ``--cuda-graph-impl full_iteration`` (forward-backward captured once by
``FullCudaGraphWrapper`` and replayed) and a precision-aware optimizer (TE ``FusedAdam(use_decoupled_grad=True)``):
after the capture iteration the optimizer finds no gradients on the FSDP parameters, so the weights stop moving
and the loss stays flat while eager training keeps improving (the PR's end-to-end test asserts that decoupled
gradients are present before every ``optimizer.step`` and that the loss decreases).
Mechanism: at the end of forward-backward, ``finalize_model_grads`` -> ``MegatronFSDP.finish_grad_sync`` ->
``attach_grad_to_optimizer_state`` -> ``ParamAndGradBuffer.update_main_grads`` wraps each parameter's shard of
the reduced ``main_grad_buffer`` in a DTensor (``dist_main_grad``) and installs it with
``setattr(param, "decoupled_grad", grad)``: host work, which ran once while the full-iteration graph was
captured. At the start of every iteration ``zero_grad_buffer`` -> ``ParamAndGradBuffer.zero_grad`` zeroes the
buffer and also dereferences the shards (``param.decoupled_grad = None``, ``dist_main_grad[name]._local_tensor =
None``) to free memory. Eagerly, the next ``update_main_grads`` re-installs them; a replay re-runs only the
kernels, which write the new gradients into ``main_grad_buffer``, but nothing puts the references back, and the
optimizer skips every parameter whose ``decoupled_grad`` is None.
Doctor: host-work-frozen, at ``update_main_grads`` (its ``setattr(param, "decoupled_grad", ...)`` ran only at
capture; the eager ``zero_grad`` undoes it before every replayed iteration).
Fix (upstream): a ``megatron_fsdp_cuda_graph_mode`` DDP option, set whenever ``cuda_graph_impl != "none"``: in it
``zero_grad`` only zeroes the gradient buffer and keeps ``param.grad``/``param.decoupled_grad`` and the DTensor
shards, which stay views of that buffer and so see what every replay writes. (The PR also replaces the host
branch ``if num_tokens > 0`` in ``finalize_model_grads`` by a clamp; this program runs without per-token loss,
so that path is not taken.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4663"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "update_main_grads"
SYMPTOM = "after the capture iteration the optimizer sees no decoupled grads and the FSDP weights stop training"
DIM, HIDDEN, MICRO_BATCH, NUM_MICROBATCHES, ITERS = 4, 6, 3, 2, 5


@dataclasses.dataclass
class DistributedDataParallelConfig:
    megatron_fsdp_cuda_graph_mode: bool = False


class FSDPDTensor:
    """``make_fsdp_dtensor``: a DTensor whose local tensor is this rank's shard of ``main_grad_buffer``."""

    def __init__(self, local_tensor):
        self._local_tensor = local_tensor

    def to_local(self):
        return self._local_tensor


class ParamAndGradBuffer:
    """Megatron-FSDP buffers (one data-parallel rank: each shard is the whole item)."""

    def __init__(self, named_weights, ddp_config, device):
        self.ddp_config = ddp_config
        self.use_decoupled_grad = True                  # --use-precision-aware-optimizer
        self.items, offset = {}, 0
        for name, w in named_weights:
            self.items[name] = (offset, offset + w.numel(), tuple(w.shape))
            offset += w.numel()
        self.model_weight_buffer = torch.cat([w.reshape(-1) for _, w in named_weights]).to(device)
        self.main_grad_buffer = torch.zeros(offset, device=device)
        self.optimizer_named_parameters = [(name, self._view(self.model_weight_buffer, name))
                                           for name, _ in named_weights]
        self.dist_main_grad: dict[str, FSDPDTensor] = {}

    def _view(self, buffer, name):
        start, end, shape = self.items[name]
        return buffer[start:end].view(shape)

    def get_item(self, name):
        return self._view(self.main_grad_buffer, name)

    def update_main_grads(self):
        for name, param in self.optimizer_named_parameters:
            optimizer_grad = self.get_item(name)
            if name not in self.dist_main_grad:
                self.dist_main_grad[name] = FSDPDTensor(optimizer_grad)
            else:
                self.dist_main_grad[name]._local_tensor = optimizer_grad.view(optimizer_grad.shape)
            grad = self.dist_main_grad[name]
            if self.use_decoupled_grad:
                setattr(param, "decoupled_grad", grad)
            else:
                setattr(param, "grad", grad.to_local())

    def zero_grad(self):
        if not self.ddp_config.megatron_fsdp_cuda_graph_mode:
            # Dereference the sharded gradient to reclaim memory
            for name, param in self.optimizer_named_parameters:
                param.grad = None
                if hasattr(param, "decoupled_grad"):
                    param.decoupled_grad = None
                if name in self.dist_main_grad:
                    self.dist_main_grad[name]._local_tensor = None
        self.main_grad_buffer.zero_()


class MegatronFSDP:
    """A two-layer MLP wrapped by Megatron-FSDP: compute weights are views of the weight buffer, the backward
    reduces (here: accumulates) each weight gradient into its ``main_grad`` slice."""

    def __init__(self, named_weights, ddp_config, device):
        self.param_and_grad_buffer = ParamAndGradBuffer(named_weights, ddp_config, device)
        buf = self.param_and_grad_buffer
        self.w1, self.w2 = (buf._view(buf.model_weight_buffer, name) for name in ("w1", "w2"))
        self.main_grad = {name: buf.get_item(name) for name in ("w1", "w2")}

    def forward_backward_step(self, x, target, num_microbatches):
        h = torch.tanh(x @ self.w1)
        y = h @ self.w2
        loss = ((y - target) ** 2).mean() / num_microbatches
        dy = 2.0 * (y - target) / (y.numel() * num_microbatches)
        self.main_grad["w2"].add_(h.t() @ dy)                    # grad reduce into main_grad_buffer
        dpre = (dy @ self.w2.t()) * (1 - h * h)
        self.main_grad["w1"].add_(x.t() @ dpre)
        return loss

    def attach_grad_to_optimizer_state(self):
        self.param_and_grad_buffer.update_main_grads()

    def finish_grad_sync(self):
        # synchronize_gradient_reduce(): one data-parallel rank, nothing to wait for
        self.attach_grad_to_optimizer_state()

    def zero_grad_buffer(self):
        self.param_and_grad_buffer.zero_grad()


def finalize_model_grads(model):
    model.finish_grad_sync()


def forward_backward_no_pipelining(model, data_iterator, num_microbatches):
    losses = [model.forward_backward_step(x, t, num_microbatches) for x, t in data_iterator]
    finalize_model_grads(model)
    return torch.stack(losses)


class FusedAdam:
    """``transformer_engine.pytorch.optimizers.FusedAdam`` with ``use_decoupled_grad=True`` (fp32 master weights)."""

    def __init__(self, params, lr=0.1, betas=(0.9, 0.99), eps=1e-8):
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.step_count = 0
        self.state = [None] * len(params)

    def step(self):
        self.step_count += 1
        beta1, beta2 = self.betas
        for i, p in enumerate(self.params):
            p_grad = getattr(p, "decoupled_grad", None)
            if p_grad is None:
                continue
            g = p_grad.to_local()
            if self.state[i] is None:
                self.state[i] = (torch.zeros_like(p), torch.zeros_like(p))
            exp_avg, exp_avg_sq = self.state[i]
            exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (exp_avg_sq / (1 - beta2 ** self.step_count)).sqrt_().add_(self.eps)
            p.sub_(self.lr / (1 - beta1 ** self.step_count) * exp_avg / denom)


class StaticBufferLoader:
    """Copies each microbatch into the static buffers the captured iteration reads."""

    def __init__(self):
        self.static_buffers: list = []

    def __call__(self, batches):
        if not self.static_buffers:
            self.static_buffers = [(x.clone(), t.clone()) for x, t in batches]
        else:
            for (sx, st), (x, t) in zip(self.static_buffers, batches):
                sx.copy_(x)
                st.copy_(t)
        return self.static_buffers


class FullCudaGraphWrapper:
    """``megatron/core/full_cuda_graph.py``: eager warmup iterations, then capture forward-backward once and replay."""

    def __init__(self, forward_backward_func, device, cuda_graph_warmup_steps=1):
        self.forward_backward_func, self.device = forward_backward_func, device
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps
        self.static_loader = StaticBufferLoader()
        self.curr_iteration, self.cuda_graph, self.result = 0, None, None

    def __call__(self, model, batches, num_microbatches):
        data_list = self.static_loader(batches)
        if self.curr_iteration == self.cuda_graph_warmup_steps:
            buf = model.param_and_grad_buffer
            static = {f"{kind}{b}": t for b, pair in enumerate(data_list) for kind, t in zip(("x", "t"), pair)}
            self.cuda_graph, self.result = capture(
                lambda: self.forward_backward_func(model, data_list, num_microbatches), device=self.device,
                warmups=0, static=static, owner="FullCudaGraphWrapper",
                state={"main_grad_buffer": buf.main_grad_buffer, "model_weight_buffer": buf.model_weight_buffer})
        if self.cuda_graph is None:
            with events.warmup(real=True):
                self.result = self.forward_backward_func(model, data_list, num_microbatches)
        else:
            self.result = replay(self.cuda_graph, self.result)
        self.curr_iteration += 1
        return self.result


def run(variant: str, device: str = "cpu"):
    gen = generator(4663)
    named_weights = [("w1", randn(DIM, HIDDEN, gen=gen, device=device, scale=0.5)),
                     ("w2", randn(HIDDEN, 1, gen=gen, device=device, scale=0.5))]
    w_true = randn(DIM, 1, gen=gen, device=device)
    data = []
    for _ in range(ITERS):
        xs = [randn(MICRO_BATCH, DIM, gen=gen, device=device) for _ in range(NUM_MICROBATCHES)]
        data.append([(x, torch.sin(x @ w_true)) for x in xs])
    # get_megatron_ddp_config: the fix turns the CUDA-graph-safe mode on whenever cuda_graph_impl != "none"
    ddp_config = DistributedDataParallelConfig(megatron_fsdp_cuda_graph_mode=variant == "fix")

    def train(forward_backward_func):
        model = MegatronFSDP(named_weights, ddp_config, device)
        optimizer = FusedAdam([p for _, p in model.param_and_grad_buffer.optimizer_named_parameters])
        outs = []
        for batches in data:
            model.zero_grad_buffer()
            losses = forward_backward_func(model, batches, NUM_MICROBATCHES)
            outs.append(losses.clone())
            optimizer.step()
        return outs + [model.param_and_grad_buffer.model_weight_buffer.clone()]

    def served():
        return train(FullCudaGraphWrapper(forward_backward_no_pipelining, device))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served,
                   lambda: train(forward_backward_no_pipelining))
