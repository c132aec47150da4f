"""Assigning a float to ``group["lr"]`` after capture drops the LR tensor the captured optimizer step reads, so replays keep the capture-time LR.

Upstream: https://github.com/microsoft/dion/commit/2ad16fad629757e549b0875f49c60c9188ab3460 ("Fix the
LR/graph invariants the wrapper depends on"), a review commit of the merged PR
https://github.com/microsoft/dion/pull/104 (CUDA-graph-capturable optimizer step).
Symptom: silent. With ``CudaGraphOptimizer`` and a hand-rolled schedule (``for g in opt.param_groups:
g["lr"] = x``, also what torch's scheduler writes when the group's lr is not a tensor), every replayed
step keeps applying the LR of the capture step: "the LR silently froze". Eager training follows the
schedule. (If the assignment lands on the capture step itself, the capture aborts instead.)
Mechanism: ``DistributedOrthoBase._ensure_lr_tensor(group)`` carries the LR as a 0-d device tensor
that the kernels read. If it finds a Python float in ``group["lr"]``, it REPLACES it:
``group["lr"] = torch.full((), float(lr), device=...)``. ``step()`` calls it only
``if not torch.cuda.is_current_stream_capturing()``. ``CudaGraphOptimizer.step`` runs
``warmup_steps`` eager steps, then ``_capture`` records ONE ``optimizer.step()`` and afterwards only
calls ``graph.replay()``. The graph keeps the ADDRESS of the LR tensor that was live at capture.
Later the caller assigns a float at a schedule milestone. That drops the group's reference, which was
the tensor's only owner, so its block goes back to the caching allocator. No ``step()`` runs under
replay, so nothing makes a new tensor, and the graph would not read a new one anyway. Each replay
reads the released block. The caching allocator still holds the capture-time value there (the graph is
built with ``on_freed="reuse"``, as that allocator behaves), so the LR stays at its capture value.
Doctor: dangling-reference, at ``_ensure_lr_tensor``. The graph reads the 0-d LR tensor that
``_ensure_lr_tensor`` allocated and the group owned; the caller's float assignment released it.
Fix (upstream): one persistent tensor per group, ``self._lr_tensors[index]``. It is allocated once and
afterwards only ``fill_``/``copy_``'d, never replaced: ``_ensure_lr_tensor(index)`` returns at once when
``group["lr"] is tensor``, otherwise it fills the tensor and puts it back into the group. It raises if
it would have to write during a capture. A new ``_sync_lr_tensors()`` is called at the top of
``step()``, and ``CudaGraphOptimizer._sync_host_hyperparams()`` calls it before capturing and before
each replay. So a float assignment reaches the one tensor the graph reads.
(Read: ``git show 2ad16fa`` in the dion mirror, dion/megabatch_base.py and dion/cuda_graph.py, and the
new test ``test_cudagraph_tracks_lr_assigned_as_python_float``. Muon's update is reduced to momentum,
Newton-Schulz and ``X -= lr * U``.)
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/dion/commit/2ad16fad629757e549b0875f49c60c9188ab3460"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_ensure_lr_tensor"
SYMPTOM = "a float assigned to group['lr'] after capture never reaches the graph: replays keep the capture-step LR"

ROWS, COLS, STEPS, WARMUP = 4, 6, 8, 2
MU = 0.9
# hand-rolled schedule: step -> the float assigned to group["lr"] (linear warmup, then step decays).
# Nothing is assigned on the capture step (step WARMUP), which would abort the capture upstream.
SCHEDULE = {0: 0.02, 1: 0.04, 4: 0.03, 6: 0.015}


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 3) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


class Muon:
    """``DistributedOrthoBase`` in miniature: one group, momentum state, the LR as a 0-d device tensor."""

    def __init__(self, params, device, variant, lr=SCHEDULE[0], mu=MU):
        self.device, self.variant = device, variant
        self.param_groups = [{"params": params, "lr": lr, "mu": mu}]
        self.state = {id(p): {"momentum": torch.zeros_like(p)} for p in params}
        self._lr_tensors: dict = {}
        for index, group in enumerate(self.param_groups):
            self._ensure_lr_tensor(index if variant == "fix" else group)

    def _ensure_lr_tensor(self, key):
        if self.variant == "bug":
            # before: a float (or a wrong-device tensor) is REPLACED by a new tensor
            group = key
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device == torch.device(self.device) \
                    and lr.dtype == torch.float32:
                return lr
            group["lr"] = torch.full((), float(lr), dtype=torch.float32, device=self.device)
            return group["lr"]
        # after: one persistent tensor per group, allocated once and then only filled
        index = key
        group = self.param_groups[index]
        lr, tensor = group["lr"], self._lr_tensors.get(index)
        if lr is tensor:
            return tensor
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"param group {index} has a learning rate that is not its persistent device "
                               "tensor, and CUDA graph capture is already underway so it cannot be refreshed.")
        if tensor is None:
            tensor = torch.empty((), dtype=torch.float32, device=self.device)
            self._lr_tensors[index] = tensor
        if isinstance(lr, torch.Tensor):
            tensor.copy_(lr)
        else:
            tensor.fill_(lr)
        group["lr"] = tensor
        return tensor

    def _sync_lr_tensors(self):
        for index in range(len(self.param_groups)):
            self._ensure_lr_tensor(index)

    @torch.no_grad()
    def step(self):
        if self.variant == "bug":
            # re-materialize a float assigned since the last step; skipped while capturing
            if not torch.cuda.is_current_stream_capturing():
                for group in self.param_groups:
                    self._ensure_lr_tensor(group)
        else:
            self._sync_lr_tensors()              # a no-op (and so capture-safe) once the tensor is in place
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                M = self.state[id(p)]["momentum"]
                M.mul_(group["mu"]).add_(p.grad)
                U = zeropower_via_newtonschulz5(M)
                p.sub_(U * lr)                   # the kernel reads the 0-d LR tensor by address


class CudaGraphOptimizer:
    """``dion/cuda_graph.py``: eager warmup steps, capture ONE step, then replay only."""

    def __init__(self, optimizer: Muon, warmup_steps: int):
        self.optimizer, self.warmup_steps = optimizer, warmup_steps
        self._step_count, self._graph = 0, None
        params = optimizer.param_groups[0]["params"]
        self._outputs = tuple(params)
        events.persistent_state("CudaGraphOptimizer (params, momentum)", {
            **{f"param{i}": p for i, p in enumerate(params)},
            **{f"momentum{i}": optimizer.state[id(p)]["momentum"] for i, p in enumerate(params)}})
        events.static_buffers("CudaGraphOptimizer (grads)", {f"grad{i}": p.grad for i, p in enumerate(params)})

    def _sync_host_hyperparams(self):
        sync = getattr(self.optimizer, "_sync_lr_tensors", None)
        if sync is not None and self.optimizer.variant == "fix":
            sync()                               # push a float group["lr"] into the persistent tensor

    def _capture(self):
        # on_freed="reuse": a released block keeps its bytes until reused, as in the caching allocator
        graph, _ = capture(self.optimizer.step, device=self.optimizer.device, warmups=0,
                           name="optimizer step", owner="CudaGraphOptimizer", on_freed="reuse")
        self._graph = graph
        replay(self._graph, self._outputs)       # capture launches nothing: replay to take this step

    def step(self):
        if self._step_count < self.warmup_steps:
            with events.warmup(real=True):
                self.optimizer.step()
        else:
            self._sync_host_hyperparams()
            if self._graph is None:
                self._capture()
            else:
                replay(self._graph, self._outputs)
        self._step_count += 1


def run(variant: str, device: str = "cpu"):
    gen = generator(104)
    init = [randn(ROWS, COLS, gen=gen, device=device), randn(COLS, ROWS, gen=gen, device=device)]
    grad_seq = [[randn(*p.shape, gen=gen, device=device) for p in init] for _ in range(STEPS)]

    def train(graphed: bool):
        params = [p.clone() for p in init]
        for p in params:
            p.grad = torch.zeros_like(p)         # zero_grad(set_to_none=False): stable grad buffers
        opt = Muon(params, device, variant)
        stepper = CudaGraphOptimizer(opt, WARMUP) if graphed else opt
        outs = []
        for t, grads in enumerate(grad_seq):
            if t in SCHEDULE:
                for g in opt.param_groups:
                    g["lr"] = SCHEDULE[t]        # the hand-rolled schedule assigns a float
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            stepper.step()
            outs += [p.detach().clone() for p in params]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
