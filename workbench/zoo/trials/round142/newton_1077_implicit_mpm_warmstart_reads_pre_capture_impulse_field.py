"""Newton's implicit MPM solver (a continuum solver for granular flow on a grid, warm-started from the previous
step's contact impulses and stresses) read its warm start, when the whole substep loop is captured as one CUDA graph,
from the impulse and stress fields bound to the input state *at capture time*. Those fields are made again at every
step (a new space partition of the active grid nodes, new ``dof_values``) and bound to ``state_out``; the captured
step's Python ran once, so every replay's first substep interpolated the pre-capture state's fields, which the state
had let go during the capture (Warp frees them when the capture ends) -- not what the previous replay solved. The fix
warm-starts from ``state_in.ws_impulse_field`` / ``ws_stress_field``: persistent space-level fields of each state that
``_save_for_next_warmstart`` rewrites inside the graph at every step.

Upstream: https://github.com/newton-physics/newton/pull/1077 ("Add option to keep visual mesh when building
approximations", repository newton-physics/newton, author Gilles Daviet (gdaviet), opened 2025-11-12, squash-merged
2025-11-13 as 32adea99480b40b093b49f2f1c2a02a62e2a5bb9). The PR's description speaks only of the mesh option; its
squash also carries the branch commit 4543aa082849b52becab4bdb1ba81971f161adeb ("Fix warm-starting regression with
graph-captured mpm", 2025-11-07, same author: in ``SolverImplicitMPM._step_impl`` the lines
``prev_impulse_field = state_in.impulse_field`` / ``prev_stress_field = state_in.stress_field`` are removed and the call
becomes ``self._warmstart_fields(state_in.ws_impulse_field, state_in.ws_stress_field)``) and 75b45e6a5 ("Fix
elasticity with fixed grid, reuse compliance matrix storage"). Read, in a mirror of the repository: both commits'
diffs and the squash's diff of ``solver_implicit_mpm.py``; at the squash's parent dfacfd540
``solver_implicit_mpm.py``: ``_ImplicitMPMScratchpad`` (``create_function_spaces``, ``_create_velocity_function_space``,
``require_velocity_space_fields``, ``require_strain_space_fields``), ``SolverImplicitMPM.__init__``, ``enrich_state``,
``step``, ``_rebuild_scratchpad``, ``_step_impl`` (binning, collider rasterization, warm start, strain solve, save,
advection), ``_require_velocity_space_fields``, ``_require_strain_space_fields``, ``_warmstart_fields``,
``_save_for_next_warmstart``, ``collect_collider_impulses``, ``project_outside``; the signature and docstring of
``solve_rheology`` (``solve_rheology.py``: stress and collider impulse are in/out warm starts, iterations stop at
``tolerance`` or ``max_iterations``); ``examples/mpm/example_mpm_granular.py`` at fad7055f6 (``capture``: one
``wp.ScopedCapture`` of ``simulate``, no warm-up, even substep count; ``simulate``: ``step``, ``project_outside``,
state swap); the history: 3a8146802 (inside #940, "Fix warmstarting with graph capture", which introduced the ``ws_``
fields) and 0610d783c (also inside #940, "2way coupling example", which moved the warm start back to
``state_in.impulse_field`` read at the top of ``_step_impl``), so main carried the bug from #940's merge (2025-10-30)
to #1077's. Warp at its mirror's head: a device free issued during a capture is deferred (``g_deferred_free_list``)
and run when ``wp_cuda_graph_end_capture`` ends the last capture; ``wp.Graph`` keeps no launch-argument arrays;
``make_field`` returns zero-initialized fields.
Not read: the rest of ``solve_rheology.py`` (Delassus blocks, coloring, Jacobi, the conditional-graph loop),
``rasterized_collisions.py``, warp.fem's ``NonconformingField``, ``interpolate`` and ``make_space_partition`` code (so
that nothing in warp.fem keeps the old field alive past the capture is inferred, not read), the compliance-matrix half
of the squash, and any user report (there is none: the commit message is the only statement of the bug).
Symptom: the commit calls it a "warm-starting regression with graph-captured mpm"; no numbers are given. Read from the
code (a guess about what users saw): with graph capture on (CUDA, ``grid_type="fixed"``), the first substep of every
frame warm-starts from the impulses and stresses the state held before the capture (zeros, or whatever Warp's mempool
put in the freed blocks since) instead of the previous frame's, so the iterative rheology/contact solve starts far from
its solution and returns a different (less converged) one than without graphs.
Mechanism: ``enrich_state`` binds both states' ``impulse_field`` / ``stress_field`` to the scratchpad's first fields.
``Example.capture`` records ``simulate`` (two substeps, swapping ``state_0`` and ``state_1``). In substep 1
``_step_impl`` takes ``prev_impulse_field = state_in.impulse_field`` (the pre-capture field), then
``_require_velocity_space_fields(state_out)`` binds a new field made on this step's partition; ``_warmstart_fields``
interpolates the pre-capture field (through its own partition's node map) into it. In substep 2 ``state_0`` is the
output and is rebound, so the last reference to the pre-capture fields and their partition goes; Warp frees them when
the capture ends. Every ``capture_launch`` then reads those addresses for substep 1's warm start. Eager stepping looks
``state_in.impulse_field`` up at each call and gets the previous step's live field.
Doctor: dangling-reference, at ``_step_impl``: the replayed warm start reads the dof values (and node map) of fields
whose owner, the state, released them during the capture; ``_step_impl`` is where the step chooses to read the
per-step field bound to ``state_in`` instead of the persistent warm-start field, and the function the fix changes.
Fix (upstream): ``_step_impl`` calls ``self._warmstart_fields(state_in.ws_impulse_field, state_in.ws_stress_field)``:
fields allocated once per state at space level, rewritten by ``_save_for_next_warmstart`` inside every (replayed) step.
Modelled: ``SolverImplicitMPM`` (``enrich_state``, ``step``, ``_rebuild_scratchpad``, ``_create_geometry_partition``,
``_step_impl``, ``_require_velocity_space_fields``, ``_require_strain_space_fields``, ``_warmstart_fields``,
``_save_for_next_warmstart``, ``project_outside``, ``collect_collider_impulses``), ``_ImplicitMPMScratchpad``
(``create_function_spaces``, ``require_velocity_space_fields``, ``require_strain_space_fields``,
``allocate_temporaries``, ``release_temporaries``), ``solve_rheology``, the granular example's ``Example`` (``capture``,
``simulate``, ``step``), Warp's deferred free during a capture (``scoped_capture``, ``free_deferred_allocs``).
Stand-ins: Warp arrays are torch tensors, ``wp.ScopedCapture``/``wp.capture_launch`` the kit's ``capture`` (no warm-up)
and ``replay``; objects owning Warp arrays defer their frees while a capture is open (``_WarpArrays``). A fixed 2D grid
of 6x5 nodes (voxel size 1): Q1 velocity nodes and P0 strain nodes (cells), each space partitioned per step into its
active nodes in space order, capacity the whole space, the node maps plain tensors (upstream: temporaries borrowed from
a ``fem.TemporaryStore``, so the pre-capture map's address may even be borrowed again inside the capture: not
modelled). Bilinear PIC transfer of 16 unit-mass particles, no APIC, no elastic/plastic strain or hardening update, no
particle volume fraction; the only collider is the ground row (friction 0.4). ``NonconformingField`` is a nodal lookup
through the source field's node map with a zero background. ``solve_rheology`` is Jacobi with mass splitting over the
cells, for a scalar no-tension compliant pressure against compression (``B v + C p >= 0``, B the Q1 divergence at the
cell centre), then the frictional ground contact per node, with a fixed two iterations (upstream: a full stress tensor
with a Drucker-Prager-like yield surface, Gauss-Seidel by colors or Jacobi, until a residual tolerance or
``max_iterations``): with a fixed count the warm start shows in the numbers, where upstream it shows as a worse or
slower converged solve. CPU graphs use ``on_freed="reuse"``: the freed fields keep their bytes, as a Warp mempool block
does until it is handed on (with ``on_freed="raise"`` the bug's first replay raises ``IllegalMemoryAccess`` at the
warm start's read of the old field, in ``_nonconforming_interpolate``; the fix's replays do not).
Workload: the granular example's loop: 16 particles with random positions and velocities, two states enriched, the
graph captured right away (only the served run), five frames of two substeps (dt 0.05). Outputs per frame:
``state_0``'s particle positions and velocities and its collider impulses. The run without graphs steps the same
example eagerly.
Measured: bug: misbehaves (max |graph - eager| = 1.02): frame 1 equals eager (the pre-capture fields hold the zeros that
eager also starts from); from frame 2 on, each replay's first substep starts from zero impulses and pressures instead
of the previous frame's (velocity differences 0.28, 0.69, 0.92, 0.83, collider impulses up to 1.02). Fix: equals eager
(max |graph - eager| = 0). About 2 s per variant on the CPU (the run without graphs included).
"""
from __future__ import annotations

import torch

from workbench.zoo import kit

UPSTREAM = "https://github.com/newton-physics/newton/pull/1077"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_step_impl"
SYMPTOM = ("with the implicit MPM substep loop graph-captured, every replay's first substep warm-starts from the "
           "impulse and stress fields the state held before the capture (released during it), not from the "
           "previous frame's solution")

DTYPE = torch.float64
NX, NY = 6, 5                       # grid nodes; voxel size 1
G, NCELLS = NX * NY, (NX - 1) * (NY - 1)
NULL_NODE_INDEX = -1
PARTICLES, FRAMES, SUBSTEPS, FRAME_DT = 16, 5, 2, 0.1
MAX_ITERATIONS, COMPLIANCE, FRICTION, GRAVITY = 2, 0.05, 0.4, -9.8
_variant = "bug"


# --- warp runtime: a free issued while a capture is open is deferred until the capture ends -------------------------

class _Runtime:
    capturing = False
    deferred_free: list = []

    def free_deferred_allocs(self):
        self.deferred_free.clear()


_runtime = _Runtime()


class _WarpArrays:
    """An object owning Warp arrays: released while a capture is open, arrays it did not allocate inside that capture
    are freed only when the capture ends (``deferred_free`` in warp.cu)."""

    def __init__(self):
        self._made_in_capture = _runtime.capturing

    def __del__(self):
        if _runtime.capturing and not self._made_in_capture:
            _runtime.deferred_free.extend(t for t in vars(self).values() if isinstance(t, torch.Tensor))


def scoped_capture(fn, **announce):
    """``with wp.ScopedCapture() as capture: fn()`` (no warm-up), then ``capture.graph``; the frees deferred during
    the capture happen once it has ended."""
    _runtime.capturing = True
    try:
        return kit.capture(fn, warmups=0, on_freed="reuse", **announce)
    finally:
        _runtime.capturing = False
        _runtime.free_deferred_allocs()


# --- warp.fem stand-ins ---------------------------------------------------------------------------------------------

class SpacePartition(_WarpArrays):
    """The active nodes of a space, in space order: ``space_node_indices`` (partition -> space, NULL past the active
    count) and ``partition_node_index`` (space -> partition, NULL when inactive). Capacity: the whole space."""

    def __init__(self, active: torch.Tensor):
        super().__init__()
        n = active.shape[0]
        order = torch.argsort((~active).to(torch.int32), stable=True)
        count = active.sum()
        rank = torch.arange(n, device=active.device)
        self.space_node_indices = order.masked_fill(rank >= count, NULL_NODE_INDEX)
        self.partition_node_index = torch.full((n,), NULL_NODE_INDEX, dtype=torch.long, device=active.device)
        self.partition_node_index.scatter_(0, order, rank.masked_fill(rank >= count, NULL_NODE_INDEX))


class DiscreteField(_WarpArrays):
    """``space.make_field(space_partition)``: zero-initialized dof values per partition node (no partition: every
    node of the space, in space order)."""

    def __init__(self, nodes: int, width: int, space_partition: SpacePartition | None, device):
        super().__init__()
        self.space_partition = space_partition
        self.dof_values = torch.zeros(nodes, width, dtype=DTYPE, device=device)


def _gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` along the first dimension, NULL entries reading zero."""
    out = values[index.clamp(min=0)]
    return out.masked_fill((index < 0).view(-1, *([1] * (out.dim() - 1))), 0.0)


def _nonconforming_interpolate(src: DiscreteField, dest: DiscreteField):
    """``fem.interpolate(fem.NonconformingField(domain, src, background=0), dest=restriction(dest))``: the source
    field at each destination node, looked up through the source's own node map."""
    space_nodes = dest.space_partition.space_node_indices
    if src.space_partition is None:
        src_index = space_nodes
    else:
        src_index = _gather(src.space_partition.partition_node_index, space_nodes)
        src_index = src_index.masked_fill(space_nodes < 0, NULL_NODE_INDEX)
    dest.dof_values.copy_(_gather(src.dof_values, src_index))


# --- newton/_src/solvers/implicit_mpm -------------------------------------------------------------------------------

class State:
    def __init__(self, particle_q, particle_qd):
        self.particle_q, self.particle_qd = particle_q, particle_qd


class _ImplicitMPMScratchpad:
    """Per-step spaces, fields, and temporaries: Q1 velocity nodes (grid nodes), P0 strain nodes (cells)."""

    def __init__(self):
        self.vel_space_partition = self.strain_space_partition = None
        self.velocity_test_partition = self.sym_strain_test_partition = None   # what the fields were made on

    def create_function_spaces(self, active_cells, active_nodes):
        self.vel_space_partition = SpacePartition(active_nodes)
        self.strain_space_partition = SpacePartition(active_cells)

    def require_velocity_space_fields(self, device):
        if self.velocity_test_partition is self.vel_space_partition:
            return
        self.velocity_test_partition = self.vel_space_partition
        self.velocity_field = DiscreteField(G, 2, self.vel_space_partition, device)
        self.impulse_field = DiscreteField(G, 2, self.vel_space_partition, device)

    def require_strain_space_fields(self, device):
        if self.sym_strain_test_partition is self.strain_space_partition:
            return
        self.sym_strain_test_partition = self.strain_space_partition
        self.stress_field = DiscreteField(NCELLS, 1, self.strain_space_partition, device)

    def allocate_temporaries(self, device):
        self.inv_mass_matrix = torch.empty(G, dtype=DTYPE, device=device)
        self.node_mass = torch.empty(G, dtype=DTYPE, device=device)
        self.strain_matrix = torch.empty(NCELLS, G, 2, dtype=DTYPE, device=device)

    def release_temporaries(self):
        self.inv_mass_matrix = self.node_mass = self.strain_matrix = None


def solve_rheology(max_iterations, strain_mat, compliance, node_mass, inv_volume, stress, velocity, collider_friction,
                   collider_impulse):
    """Jacobi with mass splitting over the strain nodes, then the frictional ground contact per velocity node (x
    tangential, y normal). The stress of a cell is the pressure it exerts (no tension: >= 0, compliant), acting on the
    cell's four velocity nodes through ``strain_mat`` (the divergence, B) against compression (B v + C p >= 0).
    ``stress`` and ``collider_impulse`` are in/out: they come in warm-started."""
    inv_m = inv_volume[:, None]
    contact = collider_friction >= 0
    mu = collider_friction.clamp(min=0)
    coupled = (strain_mat.abs().sum(-1) > 0).to(DTYPE)                  # [strain node, velocity node]
    split = coupled.sum(0)                                                # strain nodes sharing each velocity node
    delassus = (strain_mat.pow(2).sum(-1) * (inv_volume * split)[None]).sum(1, keepdim=True) + compliance
    sig, lam = stress.clone(), collider_impulse.clone()
    v = velocity + inv_m * (lam + (strain_mat * sig[:, :, None]).sum(0))
    for _ in range(max_iterations):
        strain_rate = (strain_mat * v[None]).sum((1, 2))[:, None]
        sig_new = (sig - (strain_rate + compliance * sig) / delassus).clamp(min=0.0)
        v = v + inv_m * (strain_mat * (sig_new - sig)[:, :, None]).sum(0)
        sig = sig_new
        ln = (lam[:, 1] - node_mass * v[:, 1]).clamp(min=0).masked_fill(~contact, 0.0)
        v = v + inv_m * torch.stack([torch.zeros_like(ln), ln - lam[:, 1]], -1)
        lt = torch.clamp(lam[:, 0] - node_mass * v[:, 0], -mu * ln, mu * ln).masked_fill(~contact, 0.0)
        v = v + inv_m * torch.stack([lt - lam[:, 0], torch.zeros_like(lt)], -1)
        lam = torch.stack([lt, ln], -1)
    stress.copy_(sig)
    collider_impulse.copy_(lam)
    velocity.copy_(v)


class SolverImplicitMPM:
    def __init__(self, particle_q: torch.Tensor, device: str):
        self.device = device
        cell = torch.arange(NCELLS)
        base = (cell // (NX - 1)) * NX + cell % (NX - 1)
        corners = torch.stack([base, base + 1, base + NX, base + NX + 1], 1)
        self.cell_nodes = corners.to(device)
        self.incidence = torch.zeros(NCELLS, G, dtype=DTYPE).scatter_(1, corners, 1.0).to(device)
        # divergence of each corner's bilinear basis function at the cell centre (P0 strain, Q1 velocity)
        grad = torch.tensor([[-0.5, -0.5], [0.5, -0.5], [-0.5, 0.5], [0.5, 0.5]], dtype=DTYPE)
        self.space_strain_matrix = torch.zeros(NCELLS, G, 2, dtype=DTYPE)
        self.space_strain_matrix[cell[:, None], corners] = grad
        self.space_strain_matrix = self.space_strain_matrix.to(device)
        ground = torch.arange(G) < NX
        self.collider_friction = torch.where(ground, FRICTION, -1.0).to(DTYPE).to(device)
        self.gravity = torch.tensor([0.0, GRAVITY], dtype=DTYPE, device=device)
        self._scratchpad = _ImplicitMPMScratchpad()
        self._rebuild_scratchpad(particle_q)

    def enrich_state(self, state: State):
        state.ws_impulse_field = None
        state.ws_stress_field = None
        self._require_velocity_space_fields(state)
        self._require_strain_space_fields(state)

    def step(self, state_in: State, state_out: State, dt: float):
        self._rebuild_scratchpad(state_in.particle_q)
        self._step_impl(state_in, state_out, dt, self._scratchpad)
        self._scratchpad.release_temporaries()

    def _bin_particles(self, positions):
        """``fem.PicQuadrature``: each particle's cell, its four nodes and bilinear weights."""
        cx = positions[:, 0].floor().clamp(0, NX - 2)
        cy = positions[:, 1].floor().clamp(0, NY - 2)
        fx, fy = positions[:, 0] - cx, positions[:, 1] - cy
        cell = (cy * (NX - 1) + cx).long()
        weights = torch.stack([(1 - fx) * (1 - fy), fx * (1 - fy), (1 - fx) * fy, fx * fy], 1)
        return cell, self.cell_nodes[cell], weights

    def _create_geometry_partition(self, positions):
        cell, _, _ = self._bin_particles(positions)
        return torch.zeros(NCELLS, dtype=DTYPE, device=positions.device).index_fill_(0, cell, 1.0)

    def _rebuild_scratchpad(self, positions):
        active_cells = self._create_geometry_partition(positions)           # fixed grid, active cells
        self._scratchpad.create_function_spaces(active_cells > 0, (active_cells[:, None] * self.incidence).sum(0) > 0)
        self._scratchpad.allocate_temporaries(self.device)

    def _step_impl(self, state_in: State, state_out: State, dt: float, scratch: _ImplicitMPMScratchpad):
        if _variant == "bug":
            prev_impulse_field = state_in.impulse_field
            prev_stress_field = state_in.stress_field

        # Bin particles, transfer mass and momentum to the grid (space order), then to the partition
        _, nodes, weights = self._bin_particles(state_in.particle_q)
        transfer = torch.zeros(PARTICLES, G, dtype=DTYPE, device=self.device).scatter_(1, nodes, weights)
        mass_space = transfer.sum(0)                                          # unit particle mass
        momentum_space = (transfer[:, :, None] * state_in.particle_qd[:, None]).sum(0)
        self._require_velocity_space_fields(state_out)
        self._require_strain_space_fields(state_out)
        vel_nodes = scratch.vel_space_partition.space_node_indices
        strain_nodes = scratch.strain_space_partition.space_node_indices
        scratch.node_mass.copy_(_gather(mass_space, vel_nodes))
        has_mass = scratch.node_mass > 0
        scratch.inv_mass_matrix.copy_((1.0 / scratch.node_mass.masked_fill(~has_mass, 1.0)).masked_fill(~has_mass, 0.0))
        free_velocity = _gather(momentum_space, vel_nodes) * scratch.inv_mass_matrix[:, None] + dt * self.gravity
        state_out.velocity_field.dof_values.copy_(free_velocity.masked_fill(~has_mass[:, None], 0.0))
        # strain matrix B in partition order: [strain partition node, velocity partition node]
        rows = _gather(self.space_strain_matrix, strain_nodes)
        scratch.strain_matrix.copy_(_gather(rows.transpose(0, 1), vel_nodes).transpose(0, 1))

        if _variant == "bug":
            self._warmstart_fields(prev_impulse_field, prev_stress_field)
        else:
            self._warmstart_fields(state_in.ws_impulse_field, state_in.ws_stress_field)

        friction = _gather(self.collider_friction, vel_nodes).masked_fill(vel_nodes < 0, -1.0)
        solve_rheology(MAX_ITERATIONS, scratch.strain_matrix, COMPLIANCE, scratch.node_mass, scratch.inv_mass_matrix,
                       state_out.stress_field.dof_values, state_out.velocity_field.dof_values, friction,
                       state_out.impulse_field.dof_values)
        self._save_for_next_warmstart(state_out)

        # (A)PIC advection: grid velocity back to the particles
        grid_vel = _gather(state_out.velocity_field.dof_values, scratch.vel_space_partition.partition_node_index)
        particle_qd = (transfer[:, :, None] * grid_vel[None]).sum(1)
        state_out.particle_qd.copy_(particle_qd)
        q = state_in.particle_q + dt * particle_qd
        state_out.particle_q.copy_(torch.stack([q[:, 0].clamp(0, NX - 1 - 1e-6), q[:, 1].clamp(0, NY - 1 - 1e-6)], 1))

    def _require_velocity_space_fields(self, state_out: State):
        scratch = self._scratchpad
        scratch.require_velocity_space_fields(self.device)
        # Re-generated at each step, defined on the space partition
        state_out.velocity_field = scratch.velocity_field
        state_out.impulse_field = scratch.impulse_field
        # Impulse warmstarting, defined at space level
        if state_out.ws_impulse_field is None:
            state_out.ws_impulse_field = DiscreteField(G, 2, None, self.device)

    def _require_strain_space_fields(self, state_out: State):
        scratch = self._scratchpad
        scratch.require_strain_space_fields(self.device)
        state_out.stress_field = scratch.stress_field
        if state_out.ws_stress_field is None:
            state_out.ws_stress_field = DiscreteField(NCELLS, 1, None, self.device)

    def _warmstart_fields(self, prev_impulse_field: DiscreteField, prev_stress_field: DiscreteField):
        scratch = self._scratchpad
        _nonconforming_interpolate(prev_impulse_field, scratch.impulse_field)
        _nonconforming_interpolate(prev_stress_field, scratch.stress_field)

    def _save_for_next_warmstart(self, state_out: State):
        for field, ws in ((state_out.impulse_field, state_out.ws_impulse_field),
                          (state_out.stress_field, state_out.ws_stress_field)):
            ws.dof_values.zero_()       # then scatter_field_dof_values: partition order -> space order
            ws.dof_values.copy_(_gather(field.dof_values, field.space_partition.partition_node_index))

    def project_outside(self, state_in: State, state_out: State, dt: float):
        """Particles on the ground (the only collider) lose the velocity that goes into it."""
        on_ground = state_in.particle_q[:, 1] <= 0.0
        vy = torch.where(on_ground, state_in.particle_qd[:, 1].clamp(min=0), state_in.particle_qd[:, 1])
        state_out.particle_qd.copy_(torch.stack([state_in.particle_qd[:, 0], vy], 1))

    def collect_collider_impulses(self, state: State) -> torch.Tensor:
        return -1.0 * state.impulse_field.dof_values        # cell volume 1


# --- newton/examples/mpm/example_mpm_granular.py --------------------------------------------------------------------

class Example:
    def __init__(self, device: str, graphed: bool):
        gen = kit.generator(142)
        q = torch.stack([torch.rand(PARTICLES, generator=gen, dtype=DTYPE) * (NX - 2.4) + 0.2,
                         torch.rand(PARTICLES, generator=gen, dtype=DTYPE) * (NY - 2.5) + 0.3], 1)
        qd = torch.randn(PARTICLES, 2, generator=gen, dtype=DTYPE) * 1.5
        self.sim_dt = FRAME_DT / SUBSTEPS
        self.state_0 = State(q.to(device), qd.to(device))
        self.state_1 = State(q.to(device), qd.to(device))
        self.solver = SolverImplicitMPM(self.state_0.particle_q, device)
        self.solver.enrich_state(self.state_0)
        self.solver.enrich_state(self.state_1)
        self.device = device
        self.graph, self.graph_outputs = self.capture() if graphed else (None, None)

    def capture(self):
        persistent = {}
        for name, state in (("state_0", self.state_0), ("state_1", self.state_1)):
            persistent.update({f"{name}.particle_q": state.particle_q, f"{name}.particle_qd": state.particle_qd,
                               f"{name}.ws_impulse_field": state.ws_impulse_field.dof_values,
                               f"{name}.ws_stress_field": state.ws_stress_field.dof_values})
        return scoped_capture(self.simulate, device=self.device, name="example_mpm_granular.simulate",
                              owner="newton example (wp.ScopedCapture)", state=persistent)

    def simulate(self):
        for _ in range(SUBSTEPS):
            self.solver.step(self.state_0, self.state_1, self.sim_dt)
            self.solver.project_outside(self.state_1, self.state_1, self.sim_dt)
            self.state_0, self.state_1 = self.state_1, self.state_0
        return self.state_0.particle_q, self.state_0.particle_qd

    def step(self):
        if self.graph is not None:
            return kit.replay(self.graph, self.graph_outputs)        # wp.capture_launch
        return self.simulate()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(graphed: bool):
        example = Example(device, graphed)
        outputs = []
        for _ in range(FRAMES):
            q, qd = example.step()
            outputs += [q.clone(), qd.clone(), example.solver.collect_collider_impulses(example.state_0).clone()]
        return outputs

    try:
        return kit.compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
    finally:
        _variant = "bug"
