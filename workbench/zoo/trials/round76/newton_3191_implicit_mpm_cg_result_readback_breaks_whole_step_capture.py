"""Newton's implicit-MPM iterative rheology solver reads its device-side CG results back to the host, so capturing a whole ``SolverImplicitMPM.step`` fails.

Upstream: https://github.com/newton-physics/newton/pull/3191 ("Fix implicit MPM capture with iterative linear solver",
merged 2026-06-29 as d0bbec2f636392079dc21231a852139176fc1335; closes issue #3155). The diff of
``newton/_src/solvers/implicit_mpm/solve_rheology.py`` and the new test ``test_cg_rheology_whole_step_graph_capture``
were read, with the pre-fix ``solve_rheology.py``, ``solver_implicit_mpm.py``, ``examples/mpm/example_mpm_granular.py``
and Warp's ``warp/_src/optim/linear.py`` (``cg``, ``_run_capturable_loop``).
Symptom: capturing a whole MPM step (``with wp.ScopedCapture(): solver.step(...)``, as the MPM examples do with a
fixed grid) with ``SolverImplicitMPM.Config.solver = "cg"`` (also "cr", "gmres") fails: ``RuntimeError: Warp copy
error ... CUDA error 906 ... wp_memcpy_d2h``; the capture is invalidated. Without the outer capture the same steps run
fine. The default Gauss-Seidel solvers capture cleanly.
Mechanism: ``solve_rheology`` runs an iterative linear solver through ``_LinearSolver.solve``, which calls Warp's
``cg(..., check_every=0, use_cuda_graph=use_graph)``. With ``check_every=0`` Warp keeps the convergence test on the
device (``_run_capturable_loop``: ``wp.capture_while`` on a device-side condition when the device is capturing) and
returns ``end_iter``, ``residual`` and ``atol`` as length-1 device arrays, precisely so that the caller need not
synchronise. ``_LinearSolver.solve`` nevertheless did ``end_iter = end_iter.numpy()[0]`` (and the same for
``residual`` and ``atol``) whenever ``use_graph`` was set, verbose or not, although only the verbose report prints
them. Run eagerly the device-to-host copy is merely a sync. Inside a user's outer capture of ``SolverImplicitMPM.step``
it is a synchronous copy on the capturing stream, which CUDA refuses, and the whole-step capture fails.
Doctor: sync-in-capture, at solve (``_LinearSolver.solve``): a host read of device results (``.numpy()``, a
synchronous device-to-host copy) is attempted while a capture is open. The bug lives in ``_LinearSolver.solve``, the
function the fix changed: it read the solver's device-side results back to the host unconditionally on the graph path.
Fix (upstream): ``_LinearSolver.solve`` discards ``atol`` and reads ``end_iter`` and ``residual`` back only for the
verbose report, and never while an outer capture is recording: ``if verbose and not (use_graph and
self.momentum.velocity.device.is_capturing):``.
Modelled: a 1-D column of particles (``Config.solver = "cg"``, ``grid_type = "fixed"``, no colliders, which ``"cg"``
requires) on a fixed grid of nodes: P2G with linear hat weights (``_compute_unconstrained_velocity`` plus gravity),
one strain node per cell with the strain operator B = nodal velocity difference, a diagonal compliance, and the
Delassus operator ``B M^-1 B^T + C`` with its Jacobi preconditioner, solved by Warp's CG with a device-side stopping
condition; the stress is warm-started from the last step (``LastStepData``), applied back to the grid velocity, and
G2P advects the particles and relaxes their elastic strain. Warp's ``cg`` is modelled on its ``check_every=0`` path:
``maxiter`` cycles, each a no-op once the device-side condition is false (what ``capture_while`` and Warp's
non-graph loop both compute); Warp's own inner capture when nothing outer is capturing is left out, so the eager run
uses no graph. ``wp.array.numpy()`` is ``.cpu().numpy()``; the capture's refusal is cudaErrorStreamCaptureUnsupported
rather than CUDA's 906 (legacy-stream dependency). Contact solvers, Gauss-Seidel and Jacobi paths, the strain
eigenbasis, APIC, timers, temporary stores and scratchpad rebuilding are left out. The served loop is
``Example.simulate`` (2 substeps with the state swap, captured whole, replayed once per frame); eager runs the same
frames without the capture. Solver ``verbose`` is its default (off).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/newton-physics/newton/pull/3191"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "solve"
SYMPTOM = ("whole-step capture of SolverImplicitMPM with solver='cg' fails (CUDA error 906 in wp_memcpy_d2h): "
           "_LinearSolver.solve copies end_iter/residual/atol to the host inside the capture")

NODE_COUNT, VOXEL_SIZE, PARTICLE_COUNT = 12, 0.1, 16
GRAVITY, FRAME_DT, SIM_SUBSTEPS, FRAMES = -9.81, 1.0 / 60.0, 2, 4
VARIANT = {"v": "bug"}


# --- the few Warp entry points the model needs -------------------------------------------------------------

class Device:
    """A Warp device (``wp.context.Device``), answering ``is_capturing`` as Warp does for the current stream."""

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_capturing(self) -> bool:
        return is_capturing()


def get_device(array: torch.Tensor) -> Device:
    """``wp.array.device`` (a Warp ``Device``) for a torch tensor standing for a Warp array."""
    return Device(array.device)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum().reshape(1)            # a length-1 device array, as Warp's array_inner writes


class LinearOperator:
    """``warp.optim.linear.LinearOperator``: ``matvec(x, y, z, alpha, beta)`` computes ``z = alpha A x + beta y``."""

    def __init__(self, shape, dtype, device, matvec):
        self.shape, self.dtype, self.device, self.matvec = shape, dtype, device, matvec


# --- warp/_src/optim/linear.py: cg with check_every=0 -------------------------------------------------------

def _update_condition(maxiter: int, cycle_size: int, cur_iter, r_norm_sq, atol_sq, condition) -> None:
    # counts only cycles that ran: a conditional loop stops launching this kernel once condition is 0
    cur_iter.add_(cycle_size * (condition != 0).to(cur_iter.dtype))
    keep_going = (cur_iter < maxiter) & (r_norm_sq > atol_sq)
    condition.copy_(keep_going.to(condition.dtype))


def cg(A, b, x, tol=None, atol=None, maxiter=0, M=None, callback=None, check_every=10, use_cuda_graph=True):
    """Preconditioned conjugate gradient. With ``check_every=0`` the stopping test stays on the device and the
    results come back as length-1 device arrays ``(final_iteration, residual_norm_sq, atol_sq)``."""
    assert check_every == 0, "only the capturable (check_every=0) path is modelled"
    r, z, Ap = torch.empty_like(b), torch.empty_like(b), torch.empty_like(b)
    A.matvec(x, b, r, alpha=-1.0, beta=1.0)                      # r = b - A x
    M.matvec(r, r, z, alpha=1.0, beta=0.0)                       # z = M r
    p = z.clone()
    rz_old = _dot(r, z)
    r_norm_sq = _dot(r, r)
    atol_sq = torch.clamp(_dot(b, b) * (tol * tol), min=atol * atol)

    cycle_size = 1
    cur_iter_and_condition = torch.full((2,), -cycle_size, dtype=torch.int32, device=b.device)
    cur_iter, condition = cur_iter_and_condition[0:1], cur_iter_and_condition[1:2]
    _update_condition(maxiter, cycle_size, cur_iter, r_norm_sq, atol_sq, condition)

    def do_cycle_with_condition():
        active = condition.bool()
        A.matvec(p, Ap, Ap, alpha=1.0, beta=0.0)
        p_ap = _dot(p, Ap)
        alpha = torch.where(active, rz_old / torch.where(p_ap != 0, p_ap, torch.ones_like(p_ap)),
                            torch.zeros_like(p_ap))
        x.add_(alpha * p)
        r.sub_(alpha * Ap)
        M.matvec(r, r, z, alpha=1.0, beta=0.0)
        rz_new = _dot(r, z)
        beta = rz_new / torch.where(rz_old != 0, rz_old, torch.ones_like(rz_old))
        p.copy_(torch.where(active, z + beta * p, p))
        rz_old.copy_(torch.where(active, rz_new, rz_old))
        r_norm_sq.copy_(torch.where(active, _dot(r, r), r_norm_sq))
        _update_condition(maxiter, cycle_size, cur_iter, r_norm_sq, atol_sq, condition)

    # _run_capturable_loop: wp.capture_while(condition, ...) when capturing; each cycle is a no-op once the
    # device-side condition is 0, so running maxiter cycles computes what the conditional loop computes
    for _ in range(0, maxiter, cycle_size):
        do_cycle_with_condition()
    return cur_iter, r_norm_sq, atol_sq


_ITERATIVE_LINEAR_SOLVERS = {"cg": cg}


# --- newton/_src/solvers/implicit_mpm/solve_rheology.py -----------------------------------------------------

class MomentumData:
    def __init__(self, inv_volume: torch.Tensor, velocity: torch.Tensor):
        self.inv_volume = inv_volume           # per velocity node
        self.velocity = velocity               # grid velocity DOFs, updated in place [m/s]


class RheologyData:
    def __init__(self, compliance_mat, elastic_strain_delta, plastic_strain_delta, stress):
        self.compliance_mat = compliance_mat                 # diagonal compliance, per strain node
        self.elastic_strain_delta = elastic_strain_delta
        self.plastic_strain_delta = plastic_strain_delta
        self.stress = stress


class _DelassusOperator:
    def __init__(self, rheology: RheologyData, momentum: MomentumData, temporary_store=None):
        self.rheology, self.momentum = rheology, momentum
        self.delassus_diagonal = None

    @property
    def size(self) -> int:
        return self.rheology.stress.shape[0]

    def compute_diagonal_factorization(self, split_mass: bool = False) -> None:
        inv_m = self.momentum.inv_volume
        self.delassus_diagonal = (inv_m[:-1] + inv_m[1:]) / (VOXEL_SIZE * VOXEL_SIZE) + self.rheology.compliance_mat

    def require_strain_mat_transpose(self) -> None:
        pass

    def apply_stress_delta(self, stress_delta: torch.Tensor, velocity: torch.Tensor) -> None:
        """velocity += M^-1 B^T stress_delta."""
        bt = (F.pad(stress_delta, (1, 0)) - F.pad(stress_delta, (0, 1))) / VOXEL_SIZE
        velocity.add_(self.momentum.inv_volume * bt)

    def apply_velocity_delta(self, velocity_delta, y, z, alpha: float, beta: float) -> None:
        """z = alpha B velocity_delta + beta y."""
        strain = (velocity_delta[1:] - velocity_delta[:-1]) / VOXEL_SIZE
        z.copy_(alpha * strain if beta == 0.0 else alpha * strain + beta * y)      # beta = 0: y is not read

    def postprocess_stress_and_strain(self) -> None:
        pass

    def release(self) -> None:
        pass


class _LinearSolver:
    def __init__(self, delassus_operator: _DelassusOperator, method: str = "cr", temporary_store=None) -> None:
        self.momentum = delassus_operator.momentum
        self.rheology = delassus_operator.rheology
        self.delassus_operator = delassus_operator
        self._method_name = method
        self._method_fn = _ITERATIVE_LINEAR_SOLVERS[method]

        self.delassus_operator.require_strain_mat_transpose()
        self.delassus_operator.compute_diagonal_factorization(split_mass=False)

        self.delta_velocity = torch.empty_like(self.momentum.velocity)

        shape = (delassus_operator.size, delassus_operator.size)
        device = self.rheology.compliance_mat.device
        self.linear_operator = LinearOperator(shape=shape, dtype=torch.float32, device=device,
                                              matvec=self._delassus_matvec)
        self.preconditioner = LinearOperator(shape=shape, dtype=torch.float32, device=device,
                                             matvec=self._preconditioner_matvec)

    def _delassus_matvec(self, x, y, z, alpha: float, beta: float):
        # dv = B^T x
        self.delta_velocity.zero_()
        self.delassus_operator.apply_stress_delta(x, self.delta_velocity)
        # z = alpha B dv + beta * y
        self.delassus_operator.apply_velocity_delta(self.delta_velocity, y, z, alpha, beta)
        # z += C x
        z.add_(alpha * self.rheology.compliance_mat * x)

    def _preconditioner_matvec(self, x, y, z, alpha, beta):
        # jacobi_preconditioner kernel
        z.copy_(alpha * x / self.delassus_operator.delassus_diagonal if beta == 0.0 else
                alpha * x / self.delassus_operator.delassus_diagonal + beta * y)

    def solve(self, tol: float, tolerance_scale: float, max_iterations: int, use_graph: bool, verbose: bool):
        self.delassus_operator.apply_velocity_delta(
            self.momentum.velocity,
            self.rheology.elastic_strain_delta,
            self.rheology.plastic_strain_delta,
            alpha=-1.0,
            beta=-1.0,
        )

        end_iter, residual, atol = self._method_fn(
            A=self.linear_operator,
            M=self.preconditioner,
            b=self.rheology.plastic_strain_delta,
            x=self.rheology.stress,
            atol=tol * tolerance_scale,
            tol=tol,
            maxiter=max_iterations,
            check_every=0 if use_graph else 10,
            use_cuda_graph=use_graph,
        )

        if VARIANT["v"] == "bug":
            # bug: the length-1 device results are copied to the host (wp.array.numpy(): a synchronous
            # device-to-host copy) on every graph-path solve, verbose or not -- inside an outer capture of the
            # whole step the capturing stream refuses the copy
            if use_graph:
                end_iter = end_iter.cpu().numpy()[0]
                residual = residual.cpu().numpy()[0]
                atol = atol.cpu().numpy()[0]

            if verbose:
                res = math.sqrt(residual) / tolerance_scale
                print(f"{self.name} terminated after {end_iter} iterations with residual {res}")
        else:
            # fix (#3191): read back only for the verbose report, and never while an outer capture is recording
            if verbose and not (use_graph and get_device(self.momentum.velocity).is_capturing):
                if use_graph:
                    end_iter = end_iter.cpu().numpy()[0]
                    residual = residual.cpu().numpy()[0]
                res = math.sqrt(residual) / tolerance_scale
                print(f"{self.name} terminated after {end_iter} iterations with residual {res}")

    @property
    def name(self):
        return self._method_name.upper()

    def release(self):
        pass


def solve_rheology(solver, max_iterations: int, tolerance: float, momentum: MomentumData, rheology: RheologyData,
                   temporary_store=None, use_graph: bool = True, verbose: bool | None = None):
    """The iterative-linear-solver-only path of ``solve_rheology`` (no colliders)."""
    verbose = bool(verbose)
    delassus_operator = _DelassusOperator(rheology, momentum, temporary_store)
    tolerance_scale = math.sqrt(1 + delassus_operator.size)

    solvers = (solver,) if isinstance(solver, str) else tuple(solver)
    rheology_solver = _LinearSolver(delassus_operator, method=solvers[0], temporary_store=temporary_store)
    rheology_solver.solve(tolerance, tolerance_scale, max_iterations, use_graph, verbose)
    rheology_solver.release()

    # linear solver only
    delassus_operator.apply_stress_delta(rheology.stress, momentum.velocity)
    delassus_operator.postprocess_stress_and_strain()
    delassus_operator.release()
    return None


# --- newton/_src/solvers/implicit_mpm/solver_implicit_mpm.py ------------------------------------------------

class _MPMStateData:
    def __init__(self, particle_elastic_strain: torch.Tensor):
        self.particle_elastic_strain = particle_elastic_strain


class State:
    def __init__(self, particle_q, particle_qd, particle_elastic_strain):
        self.particle_q, self.particle_qd = particle_q, particle_qd
        self.mpm = _MPMStateData(particle_elastic_strain)


class Model:
    """``builder.finalize()``: a column of particles above the grid origin, no colliders."""

    def __init__(self, device):
        gen = generator(3191)
        self.device = torch.device(device)
        base = torch.linspace(0.3, 0.7, PARTICLE_COUNT)
        self.particle_q = (base + 0.004 * torch.randn(PARTICLE_COUNT, generator=gen)).to(device)
        self.particle_qd = randn(PARTICLE_COUNT, gen=gen, device=device, scale=0.2)
        self.particle_mass = (0.05 * (1.0 + 0.3 * torch.rand(PARTICLE_COUNT, generator=gen))).to(device)
        self.particle_elastic_strain = randn(PARTICLE_COUNT, gen=gen, device=device, scale=0.02)
        self.strain_compliance = (2e-3 * (1.0 + 0.5 * torch.rand(NODE_COUNT - 1, generator=gen))).to(device)

    def state(self) -> State:
        return State(self.particle_q.clone(), self.particle_qd.clone(), self.particle_elastic_strain.clone())


class Config:
    def __init__(self):
        self.solver = "gauss-seidel"
        self.grid_type = "sparse"
        self.max_iterations = 250
        self.tolerance = 1.0e-4


class ImplicitMPMScratchpad:
    """Grid fields, pre-allocated once for a fixed grid so that ``step()`` can be graph-captured."""

    def __init__(self, device):
        strain_count = NODE_COUNT - 1
        self.inv_mass_matrix = torch.zeros(NODE_COUNT, device=device)
        self.velocity_field = torch.zeros(NODE_COUNT, device=device)
        self.compliance_matrix = torch.zeros(strain_count, device=device)
        self.elastic_strain_delta_field = torch.zeros(strain_count, device=device)
        self.plastic_strain_delta_field = torch.zeros(strain_count, device=device)
        self.stress_field = torch.zeros(strain_count, device=device)


class LastStepData:
    def __init__(self, device):
        self.ws_stress = torch.zeros(NODE_COUNT - 1, device=device)      # stress warm-start for the next step


class SolverImplicitMPM:
    def __init__(self, model: Model, config: Config, *, temporary_store=None, verbose: bool | None = None):
        self.model = model
        self.max_iterations = config.max_iterations
        self.tolerance = float(config.tolerance)
        self.temporary_store = temporary_store
        self.verbose = verbose if verbose is not None else False          # wp.config.log_level <= wp.LOG_DEBUG
        self.grid_type = config.grid_type
        self.solver = (config.solver,)
        # upstream: self.model.device.is_cuda and wp.is_conditional_graph_supported() -- the device modelled here
        self._use_cuda_graph = True
        self._scratchpad = ImplicitMPMScratchpad(model.device)
        self._last_step_data = LastStepData(model.device)
        node_z = torch.arange(NODE_COUNT, dtype=torch.float32) * VOXEL_SIZE
        self._node_positions = node_z.to(model.device)
        self._strain_positions = (node_z[:-1] + 0.5 * VOXEL_SIZE).to(model.device)

    def step(self, state_in: State, state_out: State, control, contacts, dt: float) -> None:
        pic = self._particles_to_cells(state_in.particle_q)
        scratch = self._scratchpad                 # fixed grid: the rebuilt scratchpad keeps its fields
        self._step_impl(state_in, state_out, dt, pic, scratch)

    def _particles_to_cells(self, positions):
        """Linear hat weights of each particle on the velocity nodes and on the strain nodes."""
        w_vel = torch.clamp(1.0 - (positions[:, None] - self._node_positions[None, :]).abs() / VOXEL_SIZE, min=0.0)
        w_str = torch.clamp(1.0 - (positions[:, None] - self._strain_positions[None, :]).abs() / VOXEL_SIZE, min=0.0)
        return w_vel, w_str

    def _step_impl(self, state_in, state_out, dt, pic, scratch):
        self._compute_unconstrained_velocity(state_in, dt, pic, scratch)
        self._build_elasticity_system(state_in, dt, pic, scratch)
        self._load_warmstart(scratch)
        self._solve_rheology(scratch)
        self._save_for_next_warmstart(scratch)
        self._update_particles(state_in, state_out, dt, pic, scratch)

    def _compute_unconstrained_velocity(self, state_in, dt, pic, scratch):
        w_vel, _ = pic
        mass = (w_vel * self.model.particle_mass[:, None]).sum(0)
        momentum = (w_vel * (self.model.particle_mass * state_in.particle_qd)[:, None]).sum(0)
        has_mass = mass > 0
        safe_mass = torch.where(has_mass, mass, torch.ones_like(mass))
        scratch.inv_mass_matrix.copy_(torch.where(has_mass, 1.0 / safe_mass, torch.zeros_like(mass)))
        scratch.velocity_field.copy_(torch.where(has_mass, momentum / safe_mass + GRAVITY * dt,
                                                 torch.zeros_like(mass)))

    def _build_elasticity_system(self, state_in, dt, pic, scratch):
        _, w_str = pic
        weight = w_str.sum(0)
        strain = (w_str * state_in.mpm.particle_elastic_strain[:, None]).sum(0)
        scratch.elastic_strain_delta_field.copy_(strain / (weight + 1e-6))
        scratch.compliance_matrix.copy_(self.model.strain_compliance / (dt * dt) / (weight + 1.0))

    def _load_warmstart(self, scratch):
        scratch.stress_field.copy_(self._last_step_data.ws_stress)

    def _solve_rheology(self, scratch):
        momentum_data = MomentumData(inv_volume=scratch.inv_mass_matrix, velocity=scratch.velocity_field)
        rheology_data = RheologyData(compliance_mat=scratch.compliance_matrix,
                                     elastic_strain_delta=scratch.elastic_strain_delta_field,
                                     plastic_strain_delta=scratch.plastic_strain_delta_field,
                                     stress=scratch.stress_field)
        return solve_rheology(self.solver, self.max_iterations, self.tolerance, momentum_data, rheology_data,
                              temporary_store=self.temporary_store, use_graph=self._use_cuda_graph,
                              verbose=self.verbose)

    def _save_for_next_warmstart(self, scratch):
        self._last_step_data.ws_stress.copy_(scratch.stress_field)

    def _update_particles(self, state_in, state_out, dt, pic, scratch):
        w_vel, w_str = pic
        grid_vel = scratch.velocity_field
        strain_rate = (grid_vel[1:] - grid_vel[:-1]) / VOXEL_SIZE
        particle_strain_rate = (w_str * strain_rate[None, :]).sum(1)
        state_out.mpm.particle_elastic_strain.copy_(0.9 * state_in.mpm.particle_elastic_strain
                                                    + dt * particle_strain_rate)
        # (A)PIC advection
        state_out.particle_qd.copy_((w_vel * grid_vel[None, :]).sum(1))
        state_out.particle_q.copy_(state_in.particle_q + dt * state_out.particle_qd)


# --- newton/examples/mpm/example_mpm_granular.py (the user's whole-step capture) ----------------------------

class Example:
    def __init__(self, device, use_graph: bool):
        self.device = device
        self.frame_dt = FRAME_DT
        self.sim_substeps = SIM_SUBSTEPS
        self.sim_dt = self.frame_dt / self.sim_substeps
        self.model = Model(device)
        mpm_options = Config()
        mpm_options.solver = "cg"
        mpm_options.grid_type = "fixed"             # whole-step capture precondition
        mpm_options.max_iterations = 16
        mpm_options.tolerance = 1.0e-5
        self.solver = SolverImplicitMPM(self.model, mpm_options)
        self.state_0, self.state_1 = self.model.state(), self.model.state()
        self.graph = self.graph_output = None
        if use_graph:
            self.capture()

    def capture(self):
        if self.solver.grid_type == "fixed":        # upstream also requires wp.get_device().is_cuda
            assert self.sim_substeps % 2 == 0, "Sim substeps must be even for graph capture of MPM step"
            s0, s1 = self.state_0, self.state_1
            state = {"state_0.particle_q": s0.particle_q, "state_0.particle_qd": s0.particle_qd,
                     "state_0.mpm.particle_elastic_strain": s0.mpm.particle_elastic_strain,
                     "state_1.particle_q": s1.particle_q, "state_1.particle_qd": s1.particle_qd,
                     "state_1.mpm.particle_elastic_strain": s1.mpm.particle_elastic_strain,
                     "last_step_data.ws_stress": self.solver._last_step_data.ws_stress}
            # with wp.ScopedCapture() as capture: self.simulate()  (no warmup)
            self.graph, self.graph_output = capture(self.simulate, device=self.device, warmups=0,
                                                    name="SolverImplicitMPM simulate()", owner="Example",
                                                    state=state)

    def simulate(self):
        for _ in range(self.sim_substeps):
            self.solver.step(self.state_0, self.state_1, None, None, self.sim_dt)
            self.state_0, self.state_1 = self.state_1, self.state_0
        return self.state_0.particle_q

    def step(self) -> torch.Tensor:
        if self.graph is not None:
            replay(self.graph, self.graph_output)
        else:
            self.simulate()
        return self.state_0.particle_q.clone()


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant

    def eager():
        example = Example(device, use_graph=False)
        return [example.step() for _ in range(FRAMES)]

    def served():
        example = Example(device, use_graph=True)
        return [example.step() for _ in range(FRAMES)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
