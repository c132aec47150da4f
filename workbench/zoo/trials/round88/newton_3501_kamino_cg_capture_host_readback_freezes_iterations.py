"""Newton's Kamino CG solve, captured on Warp's CPU device, takes the host-readback loop: the break decision is frozen at record time and replays under-iterate.

Upstream: https://github.com/newton-physics/newton/pull/3501 ("Extend CPU graph capture coverage", merged 2026-07-25,
commit 402d8eac02c42243a5c9ae7e4b8f223ca8bf0394). Read here: the commit diff of
newton/_src/solvers/kamino/_src/linalg/conjugate.py, linear.py, solver_vbd.py and CHANGELOG.md, the new regression
test ``_test_capture_replay_matches_eager`` in kamino/tests/test_linalg_solve_cg.py (its docstring: "if the break
decision is frozen at record time via a host readback of stale pre-capture memory, the recorded graph bakes in a
fixed cycle count and cur_iter under capture will be far below the eager count"), the pre-fix ``_run_capturable_loop``,
``check_termination``, ``_cg_kernel_1/2``, ``CGSolver.solve/do_iteration`` and one review thread of the PR. Not read:
the rest of the PR discussion. The VBD, example and docs changes of the same PR are not part of this bug.
Symptom: "SolverKamino CG/CR solves silently under-iterating on CPU graph capture" (CHANGELOG): a CG solve captured
with ``wp.ScopedCapture`` on the CPU device and replayed returns x after a fixed, too small number of iterations
(``cur_iter`` far below eager), while the eager solve converges.
Mechanism: ``_run_capturable_loop`` picks the capture-safe loop only when ``use_cuda_graph and device.is_cuda and
device.is_capturing``. Warp's CPU device also captures graphs, so a CPU capture falls to the eager loop: ``for _ in
range(int(maxiter.numpy().max()), loop_granularity): do_cycle_with_condition(); if not global_condition.numpy()[0]:
break``. That host readback of the device-side termination flag runs once, at record time; the graph records
exactly the cycles that ran before the Python ``break`` and every replay repeats that count, whatever its right-hand
side needs.
Doctor: host-work-frozen, at _run_capturable_loop. The Python loop's break on a host readback of
``global_condition`` is host work inside the captured region; it ran once at capture, so the recorded cycle count
stays at its capture-time value.
Fix (upstream): the condition becomes ``use_graph and device.is_capturing`` (``use_cuda_graph`` renamed
``use_graph``), so any capturing device takes the capture-safe path (``wp.capture_while``, or, without graph
conditionals, ``maxiter_host`` unrolled cycles whose kernels mask converged worlds).
Modelled: ``BatchedLinearOperator.from_dense`` (per-world dense SPD matrices), ``CGSolver`` without preconditioner
(``solve``, ``do_iteration``, ``compute_dot``, ``_initialize_tolerance_kernel``, ``_cg_kernel_1/2``,
``check_termination``) and ``_run_capturable_loop``, with ``use_graph_conditionals=False`` (the unrolled capture-safe
path; conditional nodes are not modelled). The Warp device is the CPU one (``is_cuda`` False) and its
``is_capturing`` is the engine's. A Warp CPU array is host-readable: ``arr.numpy()`` is modelled as a non-blocking
copy into a persistent pinned host mirror read with ``.item()`` (legal in a capture, like the CPU array read it
stands for; on CUDA the capture does not run the copy, so the mirror holds pre-capture memory, as in upstream's test).
Workload: 3 worlds of 4x4 SPD systems, atol 1e-4, rtol 1e-5, maxiter 12. The user warms the solve up once and
captures it with b0 = an eigenvector of each world's matrix (CG converges in one iteration), then replays it for 3
new right-hand sides written in place into b (x zeroed before each solve). Eager runs the same solves. Bug: the graph
holds one CG cycle (capture-time cur_iter 1), so every replay returns x after one iteration where eager needs 4:
all 3 outputs are off, by up to 0.15. Fix: 12 (maxiter_host) masked cycles; converged worlds stop moving, and x
equals eager.
"""
from __future__ import annotations

import functools

import torch

from workbench.engine import host, is_capturing, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/newton-physics/newton/pull/3501"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_run_capturable_loop"
SYMPTOM = ("a Kamino CG solve captured on Warp's CPU device replays a fixed number of iterations: the host readback "
           "that breaks the solve loop ran once, at record time")

N_WORLDS, DIM = 3, 4
ATOL, RTOL, MAXITER = 1.0e-4, 1.0e-5, 12
STEPS = 3

_variant = "bug"


# --- the Warp device and array readbacks ------------------------------------------------------------------------------

class Device:
    """The Warp device the solve runs on: Warp's CPU device, which captures graphs too (APIC)."""

    def __init__(self, torch_device: str):
        self.torch_device = torch_device
        self.is_cuda = False

    @property
    def is_capturing(self) -> bool:
        return is_capturing()


class HostView:
    """``wp.array.numpy()`` of a CPU array (host memory, readable any time, also while a graph records)."""

    def __init__(self, arr: torch.Tensor, device: Device):
        self.arr, self.device = arr, device
        self.mirror = host(torch.zeros(arr.shape, dtype=arr.dtype), device.torch_device)

    def numpy(self) -> torch.Tensor:
        self.mirror.copy_(self.arr, non_blocking=True)
        if not is_capturing():
            synchronize(self.device.torch_device)
        return self.mirror


# --- kamino/_src/linalg/conjugate.py: kernels -------------------------------------------------------------------------

def check_termination(maxiter, loop_granularity, r_norm_sq, atol_sq, world_active, cur_iter, world_condition,
                      batch_condition):
    condition = world_condition != 0
    world_stepped = world_active & condition
    iteration = cur_iter + world_stepped.to(cur_iter.dtype) * loop_granularity
    cur_iter.copy_(iteration)
    continue_world = world_stepped & (atol_sq < r_norm_sq) & (iteration < maxiter)
    world_condition.copy_(continue_world.to(world_condition.dtype))
    batch_condition.copy_(torch.maximum(batch_condition, continue_world.any().to(batch_condition.dtype).reshape(1)))


def _initialize_tolerance_kernel(rtol, atol, b_norm_sq, atol_sq):
    atol_sq.copy_(torch.maximum(rtol * rtol * b_norm_sq, atol * atol))


def _cg_kernel_1(tol, resid, rz_old, p_Ap, p, Ap, x, r):
    ok = (resid > tol) & (p_Ap > 0.0)
    alpha = torch.where(ok, rz_old / torch.where(ok, p_Ap, torch.ones_like(p_Ap)), torch.zeros_like(rz_old))
    x.add_(alpha[:, None] * p)
    r.sub_(alpha[:, None] * Ap)


def _cg_kernel_2(tol, resid_new, rz_old, rz_new, z, p):
    ok = (resid_new > tol) & (rz_old > 0.0)
    beta = torch.where(ok, rz_new / torch.where(ok, rz_old, torch.ones_like(rz_old)), torch.zeros_like(rz_old))
    p.copy_(z + beta[:, None] * p)


# --- kamino/_src/linalg/conjugate.py: operator, loop, solver ----------------------------------------------------------

class BatchedLinearOperator:
    def __init__(self, A: torch.Tensor, device: Device):
        self.A, self.device = A, device
        self.n_worlds, self.max_dim = A.shape[0], A.shape[1]

    @classmethod
    def from_dense(cls, A, device):
        return cls(A, device)

    def gemv(self, x, y, world_active, alpha, beta):
        """y = alpha * A @ x + beta * y (worlds not active keep y)."""
        out = alpha * torch.bmm(self.A, x.unsqueeze(-1)).squeeze(-1) + beta * y
        y.copy_(torch.where(world_active[:, None], out, y))

    def matvec(self, x, y, world_active):
        self.gemv(x, y, world_active, 1.0, 0.0)


def _run_capturable_loop(do_iteration, r_norm_sq, world_active, cur_iter, conditions, maxiter, atol_sq, callback,
                         use_graph, use_graph_conditionals=True, maxiter_host=None, loop_granularity=1,
                         device=None, views=None):
    n_worlds = maxiter.shape[0]
    cur_iter.fill_(-1)
    conditions.fill_(1)
    world_condition, global_condition = conditions[:n_worlds], conditions[n_worlds:]

    def update_condition_launch():          # wp.launch(check_termination, ..., record_cmd=True)
        check_termination(maxiter, loop_granularity, r_norm_sq, atol_sq, world_active, cur_iter, world_condition,
                          global_condition)

    global_condition.zero_()
    update_condition_launch()

    def do_cycle_with_condition():
        for _ in range(0, loop_granularity):
            do_iteration()
        global_condition.zero_()
        update_condition_launch()

    if _variant == "fix":
        capture_safe = use_graph and device.is_capturing
    else:
        capture_safe = use_graph and device.is_cuda and device.is_capturing
    if capture_safe:
        if use_graph_conditionals:
            raise NotImplementedError("wp.capture_while is not modelled")
        for _ in range(0, int(maxiter_host), loop_granularity):
            do_cycle_with_condition()
    else:
        for _ in range(0, int(views["maxiter"].numpy().max().item()), loop_granularity):
            do_cycle_with_condition()
            if not views["global_condition"].numpy()[0].item():
                break
    return cur_iter, r_norm_sq, atol_sq


class CGSolver:
    """Conjugate Gradient solver for symmetric positive definite systems (no preconditioner: z == r)."""

    def __init__(self, A: BatchedLinearOperator, world_active, atol, rtol, maxiter, use_graph=True,
                 use_graph_conditionals=False, loop_granularity=1):
        self.A, self.device = A, A.device
        self.n_worlds, self.maxdims = A.n_worlds, A.max_dim
        self.world_active, self.atol, self.rtol, self.maxiter = world_active, atol, rtol, maxiter
        self.use_graph, self.use_graph_conditionals = use_graph, use_graph_conditionals
        self.loop_granularity = loop_granularity
        dev, dt = A.A.device, A.A.dtype
        self.maxiter_host = int(maxiter.max())                       # int(max(self.maxiter.numpy())), at init
        self.residual = torch.zeros(self.n_worlds, dtype=dt, device=dev)
        self.dot_product = torch.zeros(2, self.n_worlds, dtype=dt, device=dev)
        self.atol_sq = torch.zeros(self.n_worlds, dtype=dt, device=dev)
        self.cur_iter = torch.zeros(self.n_worlds, dtype=torch.int32, device=dev)
        self.conditions = torch.zeros(self.n_worlds + 1, dtype=torch.int32, device=dev)
        self.r = torch.zeros(self.n_worlds, self.maxdims, dtype=dt, device=dev)
        self.p_and_Ap = torch.zeros(2, self.n_worlds, self.maxdims, dtype=dt, device=dev)
        self.rz_new = self.dot_product[0]
        self.views = {"maxiter": HostView(maxiter, self.device),
                      "global_condition": HostView(self.conditions[self.n_worlds:], self.device)}

    def compute_dot(self, a, b, col_offset=0):
        self.dot_product[col_offset].copy_((a * b).sum(-1))

    def solve(self, b, x):
        r = z = self.r
        r_norm_sq = self.dot_product[0]
        p, Ap = self.p_and_Ap[0], self.p_and_Ap[1]
        self.compute_dot(b, b)
        _initialize_tolerance_kernel(self.rtol, self.atol, self.dot_product[0], self.atol_sq)
        r.copy_(b)
        self.A.gemv(x, r, self.world_active, alpha=-1.0, beta=1.0)
        self.compute_dot(r, r)
        p.copy_(z)
        do_iteration = functools.partial(self.do_iteration, p=p, Ap=Ap, rz_old=self.residual, rz_new=self.rz_new,
                                         z=z, x=x, r=r, r_norm_sq=r_norm_sq)
        return _run_capturable_loop(do_iteration, r_norm_sq, self.world_active, self.cur_iter, self.conditions,
                                    self.maxiter, self.atol_sq, None, self.use_graph,
                                    use_graph_conditionals=self.use_graph_conditionals,
                                    maxiter_host=self.maxiter_host,
                                    loop_granularity=min(self.loop_granularity, self.maxiter_host),
                                    device=self.device, views=self.views)

    def do_iteration(self, p, Ap, rz_old, rz_new, z, x, r, r_norm_sq):
        rz_old.copy_(rz_new)
        self.A.matvec(p, Ap, self.world_active)
        self.compute_dot(p, Ap, col_offset=1)
        _cg_kernel_1(self.atol_sq, r_norm_sq, rz_old, self.dot_product[1], p, Ap, x, r)
        self.compute_dot(r, r)
        _cg_kernel_2(self.atol_sq, r_norm_sq, rz_old, rz_new, z, p)


# --- the user's program -----------------------------------------------------------------------------------------------

def _problem(device):
    gen = generator(3501)
    m = torch.randn(N_WORLDS, DIM, DIM, generator=gen)
    A = m @ m.transpose(1, 2) + DIM * torch.eye(DIM)                # SPD, built on the host
    b0 = torch.linalg.eigh(A).eigenvectors[:, :, -1] * 2.0           # CG converges on it in one iteration
    rhs = [randn(N_WORLDS, DIM, gen=gen, device=device) for _ in range(STEPS)]
    return A.to(device), b0.to(device), rhs


def _make_solver(A, device):
    dev = Device(device)
    world_active = torch.ones(N_WORLDS, dtype=torch.bool, device=device)
    atol = torch.full((N_WORLDS,), ATOL, device=device)
    rtol = torch.full((N_WORLDS,), RTOL, device=device)
    maxiter = torch.full((N_WORLDS,), MAXITER, dtype=torch.int32, device=device)
    return CGSolver(BatchedLinearOperator.from_dense(A, dev), world_active, atol, rtol, maxiter, use_graph=True)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    A, b0, rhs = _problem(device)

    def served():
        solver = _make_solver(A, device)
        b = b0.clone()
        x = torch.zeros(N_WORLDS, DIM, device=device)

        def step():
            x.zero_()
            solver.solve(b, x)
            return x

        g, out = capture(step, device=device, warmups=1, name="kamino cg solve", owner="wp.ScopedCapture",
                         static={"b": b},
                         state={"x": x, "r": solver.r, "p_and_Ap": solver.p_and_Ap, "dot_product": solver.dot_product,
                                "residual": solver.residual, "atol_sq": solver.atol_sq, "cur_iter": solver.cur_iter,
                                "conditions": solver.conditions})
        outs = []
        for rhs_k in rhs:
            b.copy_(rhs_k)
            outs.append(replay(g, out).clone())                      # wp.capture_launch(cap.graph)
        return outs

    def eager():
        solver = _make_solver(A, device)
        outs = []
        for rhs_k in rhs:
            x = torch.zeros(N_WORLDS, DIM, device=device)
            solver.solve(rhs_k.clone(), x)
            outs.append(x)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
