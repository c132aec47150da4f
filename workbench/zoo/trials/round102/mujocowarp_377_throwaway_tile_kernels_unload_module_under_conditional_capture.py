"""MuJoCo Warp builds a fresh Warp kernel per call for each qM tile; inside a graph_conditional body capture the throwaway kernels make Warp reload the module and unload the one the captured body still runs.

Upstream: https://github.com/google-deepmind/mujoco_warp/pull/377 ("Work around crashes with graph_conditional ==
True", google-deepmind/mujoco_warp, opened 2025-06-18 by adenzler-nvidia, merged 2025-06-23 as 25964e06).
Read: the PR description ("random crashes with these kernels that are dynamically created ... maybe it's because it's
a throwaway python object") and review (btaba's ``cache_kernel`` decorator, merged); the diff
(``warp_util.cache_kernel``, ``_KERNEL_CACHE``, the decorator on ``support.mul_m_dense``, ``smooth._tile_cholesky_*``,
``solver.update_gradient_*`` and other tile factories); at the parent: ``warp_util.kernel`` (nested kernels, a module
per outer function), ``support.mul_m``/``mul_m_dense``, ``solver.solve``/``_solve`` (``wp.capture_if(condition=d.nefc,
on_true=_solve)``), ``create_context``. Warp at the time (c78b3ba8, ``warp/context.py``): ``Kernel.__init__`` ->
``Module.register_kernel`` (``self.kernels[key] = kernel``, ``_live_kernels`` WeakSet, ``mark_modified``),
``ModuleHasher`` (hashes the *live* kernels), ``Module.load`` (a new ``ModuleExec`` when the hash changed),
``ModuleExec.__del__`` (``cuda_unload_module``), ``launch`` (retains the ``ModuleExec`` only in
``runtime.captures.get(capture_id)``), ``capture_if``/``capture_pause``/``capture_resume``.
Seen, not modelled: the follow-up #426 (the same cache for GJK) and Warp's own fix d807a235 (body graphs registered
under their capture id, so ``retain_module_exec`` finds them).
Symptom: with ``m.opt.graph_conditional = True`` (CUDA 12.4+), ``mjwarp.step`` captured with ``wp.ScopedCapture``
crashes at ``wp.capture_launch`` (CUDA launch errors; "random": it depends on which kernels are garbage collected).
Mechanism: ``mul_m_dense(tile)`` defines and returns a new ``@nested_kernel`` each call; every tile size gives a kernel
of the same key with another ``wp.static(tile.size)``, registered in the module ``...support.mul_m_dense``.
``module.kernels[key]`` keeps only the latest, so the previous tile's kernel object dies and leaves the WeakSet of live
kernels: the module hash changes at every launch of ``mul_m``'s loop and ``load`` builds a new ``ModuleExec``,
dropping the old one, whose ``__del__`` unloads the CUDA module. In a plain capture this is harmless: ``launch``
retained each ``ModuleExec`` in the graph. ``solve`` captures ``_solve`` as the ``on_true`` body of a conditional node,
and ``capture_resume`` gives the body a new capture id that is not in ``runtime.captures``: nothing retains the
body's modules, so the module of the first tile's launch is unloaded by the second tile's launch, while the body graph
still launches the first tile's kernel from it.
Doctor: dangling-reference, at mul_m_dense (the factory hands out a throwaway kernel object, whose death makes Warp
unload the module code that the captured conditional body keeps launching).
Fix (upstream): ``@cache_kernel`` on the factories: the kernel for a given tile size is built once and kept in
``_KERNEL_CACHE``; the live kernels and the module hash stop changing after the first step, so the module is loaded
once and stays loaded.
Modelled: Warp's ``Kernel``/``Module``/``ModuleExec``/``Graph``/``launch``/``capture_if``/``ScopedCapture``/
``capture_launch`` as above; MJWarp's ``nested_kernel``, ``cache_kernel``, ``TileSet``, ``mul_m_dense``, ``mul_m``,
``create_context``, ``_solver_iteration``, ``_solve``, ``solve``, ``step``. Stand-ins: a loaded CUDA module is an image
in device memory outside the graph's pool (the driver loads it; no stream records it) holding its kernels' static
tables, here each tile kernel's unrolled offsets, which the launch reads; a kernel's hash is its key and static values.
Small physics: two kinematic trees (3 and 2 dofs) give a block-diagonal ``qM`` of two tile sets; ``qacc_smooth`` from
a dense solve (a module-level kernel, in the parent graph); one-sided constraints solved by a few Newton-like steps
that call ``mul_m``; semi-implicit Euler. The conditional node always takes ``on_true`` here (``nefc`` > 0), so its
body is recorded inline under its own capture id; the solver loop is a Python loop (no ``capture_while``).
Workload: 2 worlds, 5 steps, a new applied force each; step 1 runs eagerly (loads the modules), then ``step`` is
captured and replayed for steps 2-5. Bug: the first replay raises IllegalMemoryAccess (the body's ``mul_m_dense``
kernel for the 3-dof tile runs from an unloaded module); with ``graph_conditional=False`` the same code equals eager
(the plain capture retains every ``ModuleExec``). Fix: equals eager (max error 0).
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/google-deepmind/mujoco_warp/pull/377"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "mul_m_dense"
SYMPTOM = ("graph_conditional=True: replays of the captured mjwarp.step crash: the solve body's tile kernels run from "
           "a module Warp unloaded when the throwaway kernel objects died")

NWORLD, NV, NSTEP, TIMESTEP, ITERATIONS = 2, 5, 5, 0.01, 3
DTYPE = torch.float64

_variant = "bug"


# --- warp/native (stand-ins): the driver ------------------------------------------------------------------------
class CUmodule:
    """A loaded CUDA module: its image (code and constants) in device memory until ``cuda_unload_module``."""

    def __init__(self, image, offsets):
        self.image, self.offsets = image, offsets


class _Core:
    def __init__(self):
        self.capture_id = None                                  # the capture under way on the stream
        self._next_capture_id = 1

    def cuda_load_module(self, device, kernels):
        table, offsets = [], {}
        for kernel in kernels:
            offsets[kernel.get_mangled_name()] = (len(table), len(kernel.constants))
            table += kernel.constants
        with _disable_current_modes():                          # cuModuleLoadData: no stream records a module load
            image = torch.tensor(table, dtype=DTYPE).to(device)
        return CUmodule(image, offsets)

    def cuda_unload_module(self, context, module: CUmodule):
        module.image = None                                     # cuModuleUnload

    def cuda_launch_kernel(self, context, module: CUmodule, kernel, inputs):
        start, size = module.offsets[kernel.get_mangled_name()]
        kernel.func(module.image[start:start + size], *inputs)  # the kernel runs from the module image

    def cuda_stream_is_capturing(self, stream) -> bool:
        return self.capture_id is not None

    def cuda_stream_get_capture_id(self, stream) -> int:
        return self.capture_id

    def new_capture_id(self) -> int:
        self._next_capture_id += 1
        return self._next_capture_id


class Runtime:
    def __init__(self):
        self.core = _Core()
        self.captures: dict = {}                                # capture id -> Graph, for retain_module_exec
        self.modules: dict = {}


runtime = Runtime()


# --- warp/context.py -------------------------------------------------------------------------------------------
class Kernel:
    def __init__(self, func, module, key, constants):
        self.func, self.module, self.key, self.constants = func, module, key, list(constants)
        self.hash = hash((key, tuple(self.constants)))          # codegen: wp.static values are part of the source
        module.register_kernel(self)

    def get_mangled_name(self):
        return f"{self.key}_{self.hash & 0xffffff:06x}"


class ModuleExec:
    def __init__(self, handle, module_hash, device):
        self.handle, self.module_hash, self.device = handle, module_hash, device

    def __del__(self):                                          # release the loaded module
        if self.handle is not None and runtime is not None:      # (at interpreter exit the runtime is gone)
            runtime.core.cuda_unload_module(self.device, self.handle)


class Module:
    def __init__(self, name):
        self.name = name
        self.kernels: dict = {}
        self._live_kernels = weakref.WeakSet()
        self.execs: dict = {}
        self.hashers: dict = {}

    def register_kernel(self, kernel):
        self.kernels[kernel.key] = kernel                       # keep a reference to the latest version
        self._live_kernels.add(kernel)                          # track all kernel objects, even duplicates
        self.mark_modified()                                    # for a reload of module on next launch

    def mark_modified(self):
        self.hashers = {}

    def hash_module(self):
        """``ModuleHasher``: all unique kernels that are still alive."""
        if "hash" not in self.hashers:
            self.hashers["hash"] = hash(tuple(sorted({k.hash for k in self._live_kernels})))
        return self.hashers["hash"]

    def load(self, device) -> ModuleExec:
        exec = self.execs.get(device)
        if exec is not None and exec.module_hash == self.hash_module():
            return exec
        live = sorted(self._live_kernels, key=lambda k: k.hash)
        module_exec = ModuleExec(runtime.core.cuda_load_module(device, live), self.hash_module(), device)
        self.execs[device] = module_exec                        # the previous ModuleExec is dropped here
        return module_exec


def get_module(name) -> Module:
    if name not in runtime.modules:
        runtime.modules[name] = Module(name)
    return runtime.modules[name]


class Graph:
    def __init__(self, device, capture_id):
        self.device, self.capture_id = device, capture_id
        self.module_execs: set = set()
        self.graph_exec = self.outputs = None

    def retain_module_exec(self, module_exec: ModuleExec):
        """retain executable CUDA modules used by this graph, which prevents them from being unloaded"""
        self.module_execs.add(module_exec)


def launch(kernel: Kernel, inputs, device):
    module_exec = kernel.module.load(device)
    # If the stream is capturing, we retain the CUDA module so that it doesn't get unloaded
    # before the captured graph is released.
    if runtime.core.cuda_stream_is_capturing(None):
        graph = runtime.captures.get(runtime.core.cuda_stream_get_capture_id(None))
        if graph is not None:
            graph.retain_module_exec(module_exec)
    runtime.core.cuda_launch_kernel(device, module_exec.handle, kernel, inputs)


def capture_if(condition: torch.Tensor, on_true=None, on_false=None, **kwargs):
    if not runtime.core.cuda_stream_is_capturing(None):
        branch = on_true if int(condition.cpu()[0]) else on_false   # no graph: read the condition, run the branch
        if branch is not None:
            branch(**kwargs)
        return
    # cuda_graph_insert_if_else; the workload always has constraints (condition > 0): the on_true body is recorded
    main_capture_id = runtime.core.capture_id                   # capture_pause
    runtime.core.capture_id = runtime.core.new_capture_id()     # capture_resume(graph_on_true): a new capture id
    try:
        on_true(**kwargs)
    finally:
        runtime.core.capture_id = main_capture_id               # capture_pause; capture_resume(main_graph)


class ScopedCapture:
    def __init__(self, device, static, state):
        self.device, self.static, self.state = device, static, state

    def capture(self, fn) -> Graph:
        capture_id = runtime.core.new_capture_id()              # capture_begin
        graph = Graph(self.device, capture_id)
        runtime.captures[capture_id] = graph
        runtime.core.capture_id = capture_id
        try:
            graph.graph_exec, graph.outputs = capture(
                fn, device=self.device, warmups=0, name="wp.ScopedCapture(mjwarp.step)", static=self.static,
                state=self.state, owner="mujoco_warp step graph")
        finally:
            runtime.core.capture_id = None                      # capture_end
            del runtime.captures[capture_id]
        return graph


def capture_launch(graph: Graph):
    return replay(graph.graph_exec, graph.outputs)


# --- mujoco_warp/_src/warp_util.py ------------------------------------------------------------------------------
def nested_kernel(func, static):
    """``@kernel``: a module per outer function (``...support.mul_m_dense``), ``wp.static`` values in the code."""
    module = get_module(".".join([func.__module__] + func.__qualname__.split(".<locals>.")[:-1]))
    return Kernel(func, module, func.__qualname__.replace(".<locals>.", "__"), static)


_KERNEL_CACHE = {}


def cache_kernel(func):
    # caching kernels to avoid crashes in graph_conditional code
    @functools.wraps(func)
    def wrapper(*args):
        key = tuple(a.size if hasattr(a, "size") else hash(a) for a in args) + (hash(func.__name__),)
        if key not in _KERNEL_CACHE:
            _KERNEL_CACHE[key] = func(*args)
        return _KERNEL_CACHE[key]

    return wrapper


# --- mujoco_warp/_src/types.py, io.py ---------------------------------------------------------------------------
class TileSet:
    def __init__(self, adr, size):
        self.adr, self.size = adr, size                         # address of each tile; size of all tiles in the set


class Option:
    def __init__(self):
        self.timestep, self.iterations, self.graph_conditional = TIMESTEP, ITERATIONS, True


class Model:
    def __init__(self, device):
        gen = generator(377)
        self.nv, self.opt = NV, Option()
        a, b = randn(3, 3, gen=gen, device=device, scale=0.3), randn(2, 2, gen=gen, device=device, scale=0.3)
        self.qM0 = torch.block_diag(a @ a.T + torch.eye(3), b @ b.T + torch.eye(2)).to(device, DTYPE)
        self.qM_tiles = [TileSet(torch.tensor([0], device=device), 3), TileSet(torch.tensor([3], device=device), 2)]
        self.dof_stiffness = torch.tensor([2.0, 1.5, 1.0, 3.0, 0.5], dtype=DTYPE, device=device)
        self.dof_damping = torch.full((NV,), 0.2, dtype=DTYPE, device=device)
        self.efc_J = randn(3, NV, gen=gen, device=device).to(DTYPE)       # one-sided constraints (limits, contacts)
        self.efc_D = torch.tensor([4.0, 2.5, 3.0], dtype=DTYPE, device=device)


class Data:
    def __init__(self, device):
        gen = generator(1377)
        z = lambda *s: torch.zeros(*s, dtype=DTYPE, device=device)    # noqa: E731
        self.qpos = randn(NWORLD, NV, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.qvel, self.qacc, self.qacc_smooth, self.qacc_warmstart = (z(NWORLD, NV) for _ in range(4))
        self.qfrc_applied, self.qfrc_smooth, self.efc_Ma, self.efc_grad = (z(NWORLD, NV) for _ in range(4))
        self.qM, self.efc_aref = z(NWORLD, NV, NV), z(NWORLD, 3)
        self.njmax = NWORLD * 3
        self.nefc = torch.tensor([self.njmax], dtype=torch.int32, device=device)


# --- mujoco_warp/_src/support.py --------------------------------------------------------------------------------
def mul_m_dense(tile: TileSet):
    """Returns a matmul kernel for some tile size"""
    if _variant == "bug":
        return _mul_m_dense(tile)                               # a new kernel object at every call
    else:
        return cache_kernel(_mul_m_dense)(tile)                 # @cache_kernel


def _mul_m_dense(tile: TileSet):
    def kernel(tile_offsets, qM_in, adr, vec, res):
        # TILE_SIZE = wp.static(tile.size): the unrolled tile offsets live in the compiled code
        dofs = (adr[:, None] + tile_offsets.long()[None, :]).reshape(-1)
        qM_tile = qM_in.index_select(1, dofs).index_select(2, dofs)
        res.index_copy_(1, dofs, torch.bmm(qM_tile, vec.index_select(1, dofs)[..., None])[..., 0])

    return nested_kernel(kernel, static=range(tile.size))


def mul_m(m: Model, d: Data, res: torch.Tensor, vec: torch.Tensor):
    """Multiply vectors by inertia matrix (dense: one tile kernel per tile set)."""
    for tile in m.qM_tiles:
        launch(mul_m_dense(tile), (d.qM, tile.adr, vec, res), vec.device)


# --- mujoco_warp/_src/smooth.py, forward.py ---------------------------------------------------------------------
def _factor_solve_dense(dof_order, qM_in, qfrc, qacc_out):
    order = dof_order.long()
    L = torch.linalg.cholesky(qM_in.index_select(1, order).index_select(2, order))
    qacc_out.copy_(torch.cholesky_solve(qfrc.index_select(1, order)[..., None], L)[..., 0])


factor_solve_dense = Kernel(_factor_solve_dense, get_module(__name__ + ".smooth"), "factor_solve_dense", range(NV))


def fwd_position_velocity(m: Model, d: Data):
    """``crb`` and ``passive``: the inertia matrix and the smooth forces (plain kernels of unchanging modules)."""
    d.qM.copy_(m.qM0 + torch.diag_embed(0.1 * torch.cos(d.qpos) ** 2))
    d.qfrc_smooth.copy_(d.qfrc_applied - m.dof_stiffness * d.qpos - m.dof_damping * d.qvel)
    d.efc_aref.copy_(-10.0 * (d.qpos @ m.efc_J.T) - 2.0 * (d.qvel @ m.efc_J.T))


# --- mujoco_warp/_src/solver.py ---------------------------------------------------------------------------------
def _update_gradient(m: Model, d: Data):
    mul_m(m, d, d.efc_Ma, d.qacc)                               # Ma = qM @ qacc
    jaref = d.qacc @ m.efc_J.T - d.efc_aref
    efc_force = -m.efc_D * torch.clamp(jaref, max=0.0)          # active rows push J qacc up to aref
    qfrc_constraint = efc_force @ m.efc_J
    d.efc_grad.copy_(d.efc_Ma - d.qfrc_smooth - qfrc_constraint)


def create_context(m: Model, d: Data):
    _update_gradient(m, d)                                      # Ma, constraint state and gradient at the warmstart


def _solver_iteration(m: Model, d: Data):
    h = d.qM + (m.efc_J.T * m.efc_D) @ m.efc_J                  # Newton step on a majorizer of the cost Hessian
    d.qacc.sub_(torch.linalg.solve(h, d.efc_grad[..., None])[..., 0])
    _update_gradient(m, d)


def _copy_acc(m: Model, d: Data):
    d.qacc.copy_(d.qacc_smooth)
    d.qacc_warmstart.copy_(d.qacc_smooth)


def _solve(m: Model, d: Data):
    """Finds forces that satisfy constraints."""
    d.qacc.copy_(d.qacc_warmstart)                              # warmstart
    create_context(m, d)
    for _ in range(m.opt.iterations):
        _solver_iteration(m, d)
    d.qacc_warmstart.copy_(d.qacc)


def solve(m: Model, d: Data):
    if m.opt.graph_conditional:
        capture_if(condition=d.nefc, on_true=_solve, on_false=_copy_acc, m=m, d=d)
    elif d.njmax == 0:
        _copy_acc(m, d)
    else:
        _solve(m, d)


def step(m: Model, d: Data):
    """``forward`` then ``euler``."""
    fwd_position_velocity(m, d)
    launch(factor_solve_dense, (d.qM, d.qfrc_smooth, d.qacc_smooth), d.qpos.device)     # fwd_acceleration
    solve(m, d)
    d.qvel.add_(m.opt.timestep * d.qacc)
    d.qpos.add_(m.opt.timestep * d.qvel)
    return d.qpos, d.qvel, d.qacc


# --- the simulation loop (mjlab-style: step once eagerly, then capture and replay) --------------------------------
class Simulation:
    def __init__(self, device, use_cuda_graph: bool):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.m, self.d = Model(device), Data(device)
        self.graph = None

    def step(self, ctrl: torch.Tensor):
        self.d.qfrc_applied.copy_(ctrl)
        if self.graph is not None:
            out = capture_launch(self.graph)
        else:
            out = step(self.m, self.d)
            if self.use_cuda_graph:                             # create_graph: capture after a first eager step
                d = self.d
                self.graph = ScopedCapture(
                    self.device, static={"qfrc_applied": d.qfrc_applied},
                    state={"qpos": d.qpos, "qvel": d.qvel, "qacc_warmstart": d.qacc_warmstart},
                ).capture(lambda: step(self.m, self.d))
        return [t.clone() for t in out]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(77)
    ctrls = [randn(NWORLD, NV, gen=gen, device=device).to(DTYPE) for _ in range(NSTEP)]

    def serve(use_cuda_graph: bool):
        for module in runtime.modules.values():                 # a fresh process: nothing loaded, no nested kernels
            module.execs.clear()
            module.kernels.clear()
            module.mark_modified()
        _KERNEL_CACHE.clear()
        sim = Simulation(device, use_cuda_graph)
        return [t for ctrl in ctrls for t in sim.step(ctrl)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
