"""A scheduled ``weight_decay`` reaches the captured optimizer step as a fresh host scalar, so replays keep the capture-step decay.

Upstream: https://github.com/microsoft/dion/pull/108 ("cuda_graph: release(), refuse capture with
grad-less params, and a live weight decay"), commit ca5bd4a (merge 5f5b948).
Symptom: silent. With ``CudaGraphOptimizer`` and schedule-coupled weight decay (Defazio 2506.02285,
which rescales ``group["weight_decay"]`` every step), every replayed step applies the decay of the
capture step (during LR warmup a small fraction of the intended one) for the whole run; eager
training follows the schedule. Found integrating the wrapper into Lightning + FSDP2.
Mechanism: ``CudaGraphOptimizer.step`` runs ``warmup_steps`` eager ``optimizer.step()`` calls, then
``_capture`` records ONE ``optimizer.step()`` into a graph and afterwards only calls
``graph.replay()``: the inner ``step()``'s Python never runs again. ``lr`` is safe: it is a persistent
0-d device tensor per group (``_ensure_lr_tensor``), refilled in place by ``_sync_host_hyperparams``
before each replay. ``weight_decay`` is not: ``Muon._create_ortho_tasks`` builds the update args with
``weight_decay=torch.tensor(group["weight_decay"])``, a NEW 0-d host tensor made from the Python float
on every call, which ``muon_update_post_orthogonalize`` uses as a scalar
(``X *= 1 - base_lr * weight_decay``). A CUDA kernel takes such a CPU scalar by value, so the capture
bakes the capture-step float into the graph; the scheduler's later writes to ``group["weight_decay"]``
change only the host dict, which no replay reads.
Doctor: host-work-frozen, at ``_create_ortho_tasks`` (the host scalar made there from the group's float
ran once, at capture; replays repeat only the kernels, so the decay stays at its capture-time value).
Fix (upstream): a Tensor ``weight_decay`` opts in to a live hyperparameter: ``_ensure_lr_tensor`` /
``_sync_lr_tensors`` become ``_ensure_hyperparam_tensor(index, name)`` / ``_sync_hyperparam_tensors()``
keyed by ``(group, name)``, ``_live_hyperparams(index)`` returns ``("lr", "weight_decay")`` for such a
group; the persistent device tensor is allocated once and only ``fill_``/``copy_``'d (never under
capture), and ``torch.tensor(group["weight_decay"])`` becomes ``as_scalar_tensor(...)``, which passes
that tensor through, so every replay re-reads the live value.
"""
from __future__ import annotations

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/dion/pull/108"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_create_ortho_tasks"
SYMPTOM = "captured Muon step keeps the capture-step weight decay; the scheduled decay is silently ignored"

ROWS, COLS, STEPS, WARMUP = 4, 6, 8, 2
LR, MU = 0.05, 0.9
SCHEDULE = [0.3 - 0.025 * t for t in range(STEPS)]      # schedule-coupled decay, rewritten each step


def as_scalar_tensor(value):
    """The fix's helper: an existing (persistent device) tensor passes through; a float becomes a
    host scalar tensor, exactly as before."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)


def host_scalar(value: float, device: str) -> torch.Tensor:
    """``torch.tensor(value)`` as upstream makes it: a CPU scalar, i.e. host memory (``host`` marks it
    so on the CPU backend; on CUDA it is the plain pageable CPU tensor a kernel takes by value)."""
    t = torch.tensor(value)
    return host(t, device) if torch.device(device).type == "cpu" else t


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 3) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


def muon_update_post_orthogonalize(X, U, base_lr, adjusted_lr, weight_decay):
    torch._foreach_mul_(X, 1 - base_lr * weight_decay)            # decoupled weight decay
    torch._foreach_sub_(X, torch._foreach_mul(U, adjusted_lr))


class Muon:
    """``DistributedOrthoBase`` in miniature: one Muon group, momentum state, persistent LR tensor."""

    def __init__(self, params, device, variant, lr=LR, mu=MU, weight_decay=SCHEDULE[0]):
        self.device, self.variant = device, variant
        # the fix's opt-in: the caller passes a Tensor weight_decay
        wd = torch.tensor(weight_decay) if variant == "fix" else weight_decay
        self.param_groups = [{"params": params, "lr": lr, "mu": mu, "weight_decay": wd}]
        self.state = {id(p): {"momentum": torch.zeros_like(p)} for p in params}
        self._hyperparam_tensors: dict = {}
        self._live_hyperparams_by_group: dict = {}
        self._sync_hyperparam_tensors()

    def _live_hyperparams(self, index):
        live = self._live_hyperparams_by_group.get(index)
        if live is None:
            opted_in = isinstance(self.param_groups[index].get("weight_decay"), torch.Tensor)
            live = ("lr", "weight_decay") if opted_in else ("lr",)
            self._live_hyperparams_by_group[index] = live
        return live

    def _ensure_hyperparam_tensor(self, index, name):
        """Make ``group[name]`` the group's persistent 0-d device tensor: allocated once, then only filled."""
        group = self.param_groups[index]
        value, tensor = group[name], self._hyperparam_tensors.get((index, name))
        if value is tensor:
            return tensor
        if tensor is None:
            tensor = torch.empty((), dtype=torch.float32, device=self.device)
            self._hyperparam_tensors[(index, name)] = tensor
        if isinstance(value, torch.Tensor):
            tensor.copy_(value)
        else:
            tensor.fill_(value)
        group[name] = tensor
        return tensor

    def _sync_hyperparam_tensors(self):
        for index in range(len(self.param_groups)):
            for name in self._live_hyperparams(index):
                self._ensure_hyperparam_tensor(index, name)

    def _create_ortho_tasks(self, group):
        if self.variant == "bug":
            # a NEW host scalar from the Python float, per call: a kernel argument, baked at capture
            weight_decay = host_scalar(group["weight_decay"], self.device)
        else:
            weight_decay = as_scalar_tensor(group["weight_decay"])
        return dict(lr=group["lr"], momentum=group["mu"], weight_decay=weight_decay)

    @torch.no_grad()
    def step(self):
        self._sync_hyperparam_tensors()
        for group in self.param_groups:
            args = self._create_ortho_tasks(group)
            X = [p for p in group["params"] if p.grad is not None]
            M = [self.state[id(p)]["momentum"] for p in X]
            torch._foreach_mul_(M, args["momentum"])
            torch._foreach_add_(M, [p.grad for p in X])
            U = [zeropower_via_newtonschulz5(m) for m in M]
            muon_update_post_orthogonalize(X, U, args["lr"], args["lr"], args["weight_decay"])


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
        self.optimizer._sync_hyperparam_tensors()      # pushes group["lr"] (and a live wd) before capture/replay

    def _capture(self):
        self._graph, _ = capture(self.optimizer.step, device=self.optimizer.device, warmups=0,
                                 name="optimizer step", owner="CudaGraphOptimizer")
        replay(self._graph, self._outputs)             # capture launches nothing: replay to take this step

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
    gen = generator(108)
    init = [randn(ROWS, COLS, gen=gen, device=device), randn(COLS, ROWS, gen=gen, device=device)]
    grad_seq = [[randn(*p.shape, gen=gen, device=device) for p in init] for _ in range(STEPS)]

    def train(graphed: bool):
        params = [p.clone() for p in init]
        for p in params:
            p.grad = torch.zeros_like(p)                # zero_grad(set_to_none=False): stable grad buffers
        opt = Muon(params, device, variant)
        stepper = CudaGraphOptimizer(opt, WARMUP) if graphed else opt
        outs = []
        for t, grads in enumerate(grad_seq):
            opt.param_groups[0]["weight_decay"] = SCHEDULE[t]   # the scheduler writes a float
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            stepper.step()
            outs += [p.detach().clone() for p in params]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
