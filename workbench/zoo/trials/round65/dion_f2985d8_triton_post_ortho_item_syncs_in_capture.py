"""Dion2's Triton post-orthogonalize step reads the LR and weight-decay scalars with ``.item()``: the captured optimizer step syncs, and capture aborts.

Upstream: https://github.com/microsoft/dion/commit/f2985d8132b2dec48ee963c5b4ea7e79abfd91cc
("dion2_triton: pass weight-decay/LR scalars as device tensors so filtered capture is graph-safe"),
part of the merged PR https://github.com/microsoft/dion/pull/104.
Symptom: under ``CudaGraphOptimizer``, every FILTERED Dion2/NorDion2 config (``fraction < 1`` with
``triton_post_ortho=True``, "the configuration we train with") fails when the step is captured:
"operation not permitted when stream is capturing". Had it not raised, the Python floats would have
been frozen into the kernel's launch arguments, and a scheduled LR would keep its capture-step value.
Mechanism: the LR is carried as a 0-d device tensor ``group["lr"]`` that a scheduler fills in place
(``_ensure_lr_tensor`` / ``_sync_lr_tensors``). ``dion2_update_megabatch_async`` selects the top-k rows
of the momentum (``dion2_pre_orthogonalize``), orthogonalizes them, and hands
``base_lr=lr, adjusted_lr=adjust_lr_spectral_norm(lr, ...), weight_decay=torch.tensor(wd)`` to
``dion2_post_orthogonalize_triton``. That function computed
``a = (1 - base_lr * weight_decay).item()`` and ``b = adjusted_lr.item()`` on the host and passed
them to ``_dion2_post_ortho_kernel`` as scalar arguments (``x = a*x - b*u``). Both are device tensors,
so each ``.item()`` copies device to host and waits. The warmup steps run eagerly and pass. The step
that ``CudaGraphOptimizer._capture`` records inside ``torch.cuda.graph`` runs the same ``.item()``. A
capturing stream refuses the sync, so no graph is ever recorded.
Doctor: sync-in-capture, at ``dion2_post_orthogonalize_triton``. Its ``.item()`` on the device LR
scalars runs inside the optimizer step's capture.
Fix (upstream): ``a = (1 - base_lr * weight_decay).to(torch.float32)`` and
``b = adjusted_lr.to(torch.float32)`` stay 0-d device tensors, and the kernel loads them
(``a = tl.load(a_ptr)``, ``b = tl.load(b_ptr)``). There is no host sync, and every replay reads the
live LR. A filtered+triton capture regression test was added.
(Read: ``git show f2985d8`` and the pre-fix dion/dion2_triton.py and dion/dion2.py in the dion mirror.
The Triton kernel is written as the same elementwise torch ops. The megabatch all-to-all is the
identity on one rank. ``CudaGraphOptimizer`` is the version after 2ad16fa.)
"""
from __future__ import annotations

import math

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/dion/commit/f2985d8132b2dec48ee963c5b4ea7e79abfd91cc"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "dion2_post_orthogonalize_triton"
SYMPTOM = "capturing the filtered Dion2 step fails: dion2_post_orthogonalize_triton calls .item() on the device LR"

ROWS, COLS, N_MATRICES, STEPS, WARMUP = 6, 4, 2, 6, 2
FRACTION, EF_DECAY, WEIGHT_DECAY = 0.5, 0.9, 0.1
LRS = [0.02 * (0.25 + 1.5 * (t + 1) / STEPS) for t in range(STEPS)]   # a scheduler fills group["lr"]


def host_scalar(value: float, device: str) -> torch.Tensor:
    """``torch.tensor(value)`` as upstream makes it: a CPU scalar (host memory on the CPU backend)."""
    t = torch.tensor(value)
    return host(t, device) if torch.device(device).type == "cpu" else t


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 3) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


def adjust_lr_spectral_norm(lr, param_shape):
    fan_out, fan_in = param_shape[-2], param_shape[-1]
    return lr * math.sqrt(fan_out / fan_in)


def dion2_pre_orthogonalize(G, M, fraction, ef_decay):
    """Momentum update, top-k rows by L1 norm, error-feedback decay of the selected rows (select_dim=-2)."""
    k = max(1, int(math.ceil(fraction * M[0].size(-2))))
    torch._foreach_add_(M, G)
    M_stacked = torch.stack(M, dim=0)
    slice_norms = M_stacked.norm(p=1, dim=-1)
    _, indices = torch.topk(slice_norms, k, dim=-1, sorted=True)
    indices_expanded = indices.unsqueeze(-1).expand(*indices.shape, M[0].size(-1))
    selected_stacked = torch.gather(M_stacked, dim=-2, index=indices_expanded)
    for m, idx, selected in zip(M, indices.unbind(0), selected_stacked.unbind(0)):
        idx_exp = idx.unsqueeze(-1).expand(*idx.shape, m.size(-1))
        m.scatter_(dim=-2, index=idx_exp, src=selected * ef_decay)
    return list(selected_stacked.unbind(0)), list(indices.unbind(0))


def _build_index_map(indices, full_dim):
    index_map = torch.full(indices.shape[:-1] + (full_dim,), -1, dtype=torch.int32, device=indices.device)
    values = torch.arange(indices.shape[-1], dtype=torch.int32, device=indices.device).expand_as(indices)
    index_map.scatter_(-1, indices, values)
    return index_map


def _dion2_post_ortho_kernel(x, u, index_map, a, b):
    """The Triton kernel, row selection: ``x = a*x - b*u[map[m]]``; u is 0 for unselected rows."""
    selected = index_map >= 0
    safe_map = torch.where(selected, index_map, 0).long()
    u_rows = torch.gather(u, 0, safe_map.unsqueeze(-1).expand_as(x)) * selected.unsqueeze(-1)
    x.copy_(a * x - b * u_rows)


def dion2_post_orthogonalize_triton(X, U, indices, base_lr, adjusted_lr, weight_decay, variant):
    if variant == "bug":
        a = (1 - base_lr * weight_decay).item()          # device -> host copy and wait
        b = adjusted_lr.item()
    else:
        a = (1 - base_lr * weight_decay).to(torch.float32)   # 0-d device tensors the kernel loads
        b = adjusted_lr.to(torch.float32)
    for x, u, idx in zip(X, U, indices):
        _dion2_post_ortho_kernel(x, u, _build_index_map(idx, x.size(-2)), a, b)


class Dion2:
    """``Dion2`` (a ``DistributedOrthoBase``) on one rank, filtered (``fraction < 1``), Triton post-ortho."""

    def __init__(self, params, device, variant):
        self.device, self.variant = device, variant
        self.param_groups = [{"params": params, "lr": LRS[0], "fraction": FRACTION, "ef_decay": EF_DECAY,
                              "weight_decay": WEIGHT_DECAY}]
        self.state = {id(p): {"momentum": torch.zeros_like(p)} for p in params}
        self._lr_tensors: dict = {}
        self._sync_lr_tensors()

    def _ensure_lr_tensor(self, index):
        group, tensor = self.param_groups[index], self._lr_tensors.get(index)
        if group["lr"] is tensor:
            return tensor
        if tensor is None:
            tensor = self._lr_tensors[index] = torch.empty((), dtype=torch.float32, device=self.device)
        tensor.fill_(group["lr"])
        group["lr"] = tensor
        return tensor

    def _sync_lr_tensors(self):
        for index in range(len(self.param_groups)):
            self._ensure_lr_tensor(index)

    @torch.no_grad()
    def step(self):
        self._sync_lr_tensors()
        for group in self.param_groups:
            X = group["params"]
            M = [self.state[id(p)]["momentum"] for p in X]
            U_selected, indices = dion2_pre_orthogonalize([p.grad for p in X], M, group["fraction"],
                                                          host_scalar(group["ef_decay"], self.device))
            U_ortho = list(zeropower_via_newtonschulz5(torch.stack(U_selected)).unbind(0))
            lr = group["lr"]
            dion2_post_orthogonalize_triton(X, U_ortho, indices, base_lr=lr,
                                            adjusted_lr=adjust_lr_spectral_norm(lr, X[0].shape),
                                            weight_decay=host_scalar(group["weight_decay"], self.device),
                                            variant=self.variant)


class CudaGraphOptimizer:
    """``dion/cuda_graph.py`` (after 2ad16fa): eager warmup steps, capture ONE step, then replay only."""

    def __init__(self, optimizer: Dion2, warmup_steps: int):
        self.optimizer, self.warmup_steps = optimizer, warmup_steps
        self._step_count, self._graph = 0, None
        params = optimizer.param_groups[0]["params"]
        self._outputs = tuple(params)
        events.persistent_state("CudaGraphOptimizer (params, momentum)", {
            **{f"param{i}": p for i, p in enumerate(params)},
            **{f"momentum{i}": optimizer.state[id(p)]["momentum"] for i, p in enumerate(params)}})
        events.static_buffers("CudaGraphOptimizer (grads)", {f"grad{i}": p.grad for i, p in enumerate(params)})

    def _capture(self):
        graph, _ = capture(self.optimizer.step, device=self.optimizer.device, warmups=0,
                           name="optimizer step", owner="CudaGraphOptimizer")
        self._graph = graph                     # published only once capture has succeeded
        replay(graph, self._outputs)            # capture launches nothing: replay to take this step

    def step(self):
        if self._step_count < self.warmup_steps:
            with events.warmup(real=True):
                self.optimizer.step()
        else:
            self.optimizer._sync_lr_tensors()   # _sync_host_hyperparams
            if self._graph is None:
                self._capture()
            else:
                replay(self._graph, self._outputs)
        self._step_count += 1


def run(variant: str, device: str = "cpu"):
    gen = generator(2985)
    init = [randn(ROWS, COLS, gen=gen, device=device) for _ in range(N_MATRICES)]
    grad_seq = [[randn(ROWS, COLS, gen=gen, device=device) for _ in init] for _ in range(STEPS)]

    def train(graphed: bool):
        params = [p.clone() for p in init]
        for p in params:
            p.grad = torch.zeros_like(p)         # zero_grad(set_to_none=False): stable grad buffers
        opt = Dion2(params, device, variant)
        stepper = CudaGraphOptimizer(opt, WARMUP) if graphed else opt
        outs = []
        for t, grads in enumerate(grad_seq):
            for g in opt.param_groups:
                g["lr"].fill_(LRS[t])            # a torch LR scheduler updates the LR tensor in place
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            stepper.step()
            outs += [p.detach().clone() for p in params]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
