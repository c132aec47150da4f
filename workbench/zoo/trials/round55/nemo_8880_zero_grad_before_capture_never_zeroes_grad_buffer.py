"""CUDAGraphCallback runs ``optimizer.zero_grad`` eagerly before the capture: replays never zero the grad buffer.

Upstream: https://github.com/NVIDIA/NeMo/pull/8880 ("Fix Distributed Fused Adam Issues", squash commit 08ea4cb1;
branch commit b797941574 "Fix the CUDA graph issue if there's kernel in zero_grad.").
Symptom: NeMo training with the full-iteration ``CUDAGraphCallback`` and ``MegatronDistributedFusedAdam``
(contiguous grad buffer) silently accumulates gradients across iterations after the capture iteration, so the
updates and the loss drift away from eager training; nothing raises.
Mechanism: ``nemo/utils/callbacks/cuda_graph.py`` patches the LightningModule's ``optimizer_step`` with
``get_optimizer_step(state)``. Before ``state.capture_iteration`` every iteration runs
``optimizer.zero_grad(**zero_grad_kwargs)`` and ``__orig_optimizer_step__`` (closure = forward + backward, then
the Adam step) eagerly on ``state.stream``. At the capture iteration the old code called
``optimizer.zero_grad(...)`` *before* ``with torch.cuda.graph(state.graph, ...)``, so only
``__orig_optimizer_step__`` was captured; from then on the callback only calls ``state.graph.replay()``. The code
assumed, as PyTorch's whole-network recipe does, that ``zero_grad(set_to_none=True)`` launches no kernel. Apex
``DistributedFusedAdam.zero_grad`` with ``contiguous_grad_buffer`` does: ``grad_buffer.zero_()``, and NeMo's
override re-points ``param.main_grad = self.grad_buffer_view(param)``. That zeroing ran once, eagerly, at the
capture iteration and is no node of the graph. Megatron's backward with gradient-accumulation fusion
accumulates each weight gradient into ``main_grad`` (``wgrad_gemm_accum_fp32``), so every replay adds this
iteration's gradient to the previous iterations' ones, and the Adam step consumes the running sum.
Doctor: stale-input, at optimizer_step (the captured backward reads ``main_grad`` expecting zeros; the refresh
that zeroes it is left outside the graph, so replays read what the previous iteration left there).
Fix (upstream): ``optimizer.zero_grad(**zero_grad_kwargs)`` moved inside the ``torch.cuda.graph(...)`` block
("it can lead to CUDA kernels inside ``zero_grad()`` being not captured"), so the zeroing is replayed too.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/8880"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "optimizer_step"
SYMPTOM = "after the capture iteration replayed steps accumulate gradients across iterations; training diverges"
DIM, HIDDEN, BATCH, ITERS, CAPTURE_ITERATION = 4, 6, 5, 6, 2


class MegatronDistributedFusedAdam:
    """Apex ``DistributedFusedAdam`` (``contiguous_grad_buffer=True``, capturable) as NeMo wraps it."""

    def __init__(self, params, device, lr=0.05, betas=(0.9, 0.99), eps=1e-8):
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.contiguous_grad_buffer = True
        self._grad_buffer = torch.zeros(sum(p.numel() for p in params), device=device)
        self._offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        self.step_count = torch.zeros((), device=device)       # capturable: the step lives on the device
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]

    def grad_buffer_view(self, i):
        start = self._offsets[i]
        return self._grad_buffer[start:start + self.params[i].numel()].view(self.params[i].shape)

    def zero_grad(self, set_to_none: bool = False):
        if self.contiguous_grad_buffer:
            self._grad_buffer.zero_()                          # apex: grad_buffer.zero_() -- a kernel
            for i, param in enumerate(self.params):            # NeMo: param.main_grad = self.grad_buffer_view(param)
                param.main_grad = self.grad_buffer_view(i)

    def step(self, closure):
        loss = closure()
        beta1, beta2 = self.betas
        self.step_count.add_(1)
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            g = p.main_grad
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m_hat = m / (1 - beta1 ** self.step_count)
            v_hat = v / (1 - beta2 ** self.step_count)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))
        return loss


@dataclasses.dataclass
class CUDAGraphState:
    capture_iteration: int = CAPTURE_ITERATION
    current_iteration: int = 0
    graph: object = None
    output: torch.Tensor | None = None
    result: torch.Tensor | None = None


class MegatronGPTModel:
    """A two-layer MLP whose backward accumulates weight gradients into ``main_grad`` (gradient-accumulation
    fusion), with NeMo's patched ``training_step`` / ``optimizer_step``."""

    def __init__(self, w1, w2, state, device):
        self.w1, self.w2, self.state, self.device = w1.clone(), w2.clone(), state, device

    def parameters(self):
        return [self.w1, self.w2]

    def __orig_training_step__(self, batch):
        x, target = batch
        h = torch.tanh(x @ self.w1)
        y = h @ self.w2
        loss = ((y - target) ** 2).mean()
        dy = 2.0 * (y - target) / y.numel()                    # loss.backward(), by hand
        self.w2.main_grad.add_(h.t() @ dy)                     # wgrad_gemm_accum_fp32(h, dy, w2.main_grad)
        dpre = (dy @ self.w2.t()) * (1 - h * h)
        self.w1.main_grad.add_(x.t() @ dpre)
        return loss

    def training_step(self, batch):                            # get_training_step(state)
        results = self.__orig_training_step__(batch)
        if self.state.output is None:
            self.state.output = results.detach().clone()       # struct_copy_one
        with torch.no_grad():
            self.state.output.copy_(results)                   # struct_copy_two: rebuild PL's result later
        return results

    def __orig_optimizer_step__(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure, variant):
        """``get_optimizer_step(state)``'s ``optimizer_step``."""
        state, zero_grad_kwargs = self.state, {"set_to_none": True}
        if 0 <= state.current_iteration < state.capture_iteration or state.capture_iteration < 0:
            with events.warmup(real=True):                     # eager warmup iterations on state.stream
                optimizer.zero_grad(**zero_grad_kwargs)
                self.__orig_optimizer_step__(epoch, batch_idx, optimizer, optimizer_closure)
            state.result = state.output
        if state.current_iteration == state.capture_iteration:
            if variant == "bug":
                optimizer.zero_grad(**zero_grad_kwargs)        # eager: its kernel is never part of the graph

            def captured():
                if variant == "fix":                           # #8880: zero_grad inside torch.cuda.graph(...)
                    optimizer.zero_grad(**zero_grad_kwargs)
                self.__orig_optimizer_step__(epoch, batch_idx, optimizer, optimizer_closure)
                return state.output

            x, target = optimizer_closure.batch
            state.graph, _ = capture(
                captured, device=self.device, warmups=0, owner="CUDAGraphCallback",
                static={"tokens": x, "labels": target},
                state={"w1": self.w1, "w2": self.w2, "exp_avg0": optimizer.exp_avg[0],
                       "exp_avg1": optimizer.exp_avg[1], "exp_avg_sq0": optimizer.exp_avg_sq[0],
                       "exp_avg_sq1": optimizer.exp_avg_sq[1], "step": optimizer.step_count})
        if state.current_iteration >= state.capture_iteration >= 0:
            state.result = replay(state.graph, state.output)   # ClosureResult from state.output
        state.current_iteration += 1


class Closure:
    def __init__(self, model, batch):
        self.model, self.batch = model, batch

    def __call__(self):
        return self.model.training_step(self.batch)


class StaticBufferLoader:
    """``cuda_graph.py``'s loader: every batch is copied into the same static buffers."""

    def __init__(self, loader):
        self.loader, self.static = loader, None

    def __iter__(self):
        for x, target in self.loader:
            if self.static is None:
                self.static = (x.clone(), target.clone())
            else:
                self.static[0].copy_(x)
                self.static[1].copy_(target)
            yield self.static


def run(variant: str, device: str = "cpu"):
    gen = generator(8880)
    w1, w2 = randn(DIM, HIDDEN, gen=gen, device=device, scale=0.5), randn(HIDDEN, 1, gen=gen, device=device, scale=0.5)
    w_true = randn(DIM, 1, gen=gen, device=device)
    data = []
    for _ in range(ITERS):
        x = randn(BATCH, DIM, gen=gen, device=device)
        data.append((x, torch.sin(x @ w_true)))

    def fit(graphed: bool):
        model = MegatronGPTModel(w1, w2, CUDAGraphState(), device)
        optimizer = MegatronDistributedFusedAdam(model.parameters(), device)
        losses = []
        for batch_idx, batch in enumerate(StaticBufferLoader(data)):
            closure = Closure(model, batch)
            if graphed:
                model.optimizer_step(0, batch_idx, optimizer, closure, variant)
                losses.append(model.state.result.clone())
            else:                                              # plain Lightning: zero_grad, then step(closure)
                optimizer.zero_grad(set_to_none=True)
                losses.append(optimizer.step(closure).detach().clone())
        return losses + [model.w1.clone(), model.w2.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: fit(True), lambda: fit(False))
