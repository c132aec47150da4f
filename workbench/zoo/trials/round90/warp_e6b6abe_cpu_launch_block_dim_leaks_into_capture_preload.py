"""Warp: a CPU launch leaves ``Module.options["block_dim"]`` at 1, so the pre-capture module preload builds the wrong CUDA variant and the real one is loaded inside the capture.

Upstream: https://github.com/NVIDIA/warp/commit/e6b6abe761f6825432dd5e6d6318a6fccf800f16 ("Fix Module.load
cross-device block_dim leak [GH-564]", NVIDIA/warp, merge request omniverse/warp!2432, 2026-05-29). Read: the
commit message (all four squashed parts), its CHANGELOG entry ("Fix ``wp.load_module()`` and
``wp.ScopedCapture(force_module_load=True)`` after CPU launches so CUDA graph capture precompiles the correct CUDA
kernel variant. On CUDA drivers older than 12.3 this previously raised ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED``; on
newer drivers it silently recompiled inside the capture window"), the diff of ``warp/_src/context.py`` and the
pre-fix code of ``Module.load``, ``force_load``, ``launch`` (``if device == "cpu": block_dim = 1``) and
``capture_begin`` (``force_module_load`` defaults to ``wp.config.enable_graph_capture_module_load_by_default`` on
drivers < 12.3, then ``force_load(device)`` before ``wp_cuda_graph_begin_capture``). Not read: the GH-564 issue
thread, the native ``wp_cuda_load_module`` code, and the new tests beyond their descriptions in the commit message.
Symptom: a program that launches a kernel on the CPU device and then captures the same module's kernels on a CUDA
device (``wp.ScopedCapture(force_module_load=True)``, the default on drivers < 12.3) fails in the capture with CUDA
error 900, ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` (three test_apic.py failures on the earliest-driver L4 runner).
Mechanism: ``Module.load(device, block_dim)`` wrote every per-launch ``block_dim`` into the module-level default
``self.options["block_dim"]`` and keyed ``self.execs`` by ``(device.context, block_dim)``. ``launch`` forces
``block_dim = 1`` on the CPU, so after a CPU launch the default is 1. ``capture_begin`` then calls
``force_load(device)``, whose ``m.load(d, block_dim=None)`` reads that stale 1 and builds and loads only the
``(cuda_ctx, 1)`` variant. The captured ``launch`` asks for ``block_dim=256``: ``Module.load`` finds no
``(cuda_ctx, 256)`` exec and loads the module (``cuModuleLoadDataEx``) inside the capture, which drivers < 12.3
refuse.
Doctor: sync-in-capture, at load. ``Module.load`` runs its lazy CUDA module load, a context-synchronising driver
call, while the stream is capturing, because the preload that should have done it before the capture loaded a
different variant.
Fix (upstream): ``Module.load`` resolves ``active_block_dim = block_dim if block_dim is not None else
self.options["block_dim"]`` without mutating the module default, and ``force_load`` (no explicit ``block_dim``)
preloads the variants already loaded on that device, or the module default, so a CPU block_dim never leaks into a
CUDA preload.
Modelled: ``Device`` (alias, context: ``None`` on the CPU), ``Module`` (``options``, ``execs``, ``load`` with the
build and the device load), ``ModuleExec`` / ``get_kernel_hooks``, ``launch``, ``force_load``, ``capture_begin`` /
``capture_launch`` (``wp.ScopedCapture``) and a particle integrator kernel (semi-implicit Euler under gravity plus
a per-step external force). Stand-ins: codegen and compilation are host-only bookkeeping; ``cuModuleLoadDataEx``
is the driver's implicit context synchronisation (``synchronize``), which a capture refuses; the driver is 12.2.
Workload: 8 particles. The user first runs one integration step on the CPU device (a host sanity check), then
captures one frame (2 substeps) on the accelerator with ``ScopedCapture(force_module_load=None)`` and replays it for
4 frames, writing that frame's external forces into the graph's static force buffer before each replay. Eager runs
the same steps. Bug: the preload builds ``(ctx 1, block_dim 1)``, the captured launch loads ``(ctx 1, block_dim
256)`` inside the capture and the capture raises. Fix: the preload builds ``(ctx 1, block_dim 256)``, the capture
records two kernel launches and the 4 replays equal eager.
"""
from __future__ import annotations

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/e6b6abe761f6825432dd5e6d6318a6fccf800f16"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "load"
SYMPTOM = ("after a CPU launch Module.options['block_dim'] is 1, so ScopedCapture(force_module_load=True) preloads "
           "the block_dim=1 CUDA variant; the captured launch needs block_dim=256 and loads that module inside the "
           "capture (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED on drivers < 12.3)")

DEFAULT_BLOCK_DIM = 256                  # Module.options["block_dim"] default and launch()'s block_dim default
DRIVER_VERSION = (12, 2)                 # runtime.driver_version of the earliest-driver CI runner
ENABLE_GRAPH_CAPTURE_MODULE_LOAD_BY_DEFAULT = True   # wp.config default
N_PARTICLES, FRAMES, SUBSTEPS = 8, 4, 2
FRAME_DT = 1.0 / 60.0
SIM_DT = FRAME_DT / SUBSTEPS

_variant = "bug"


# --- warp/_src/context.py ------------------------------------------------------------------------------------------------

class Device:
    def __init__(self, alias: str, torch_device: str, context):
        self.alias, self.torch_device, self.context = alias, torch_device, context

    @property
    def is_cpu(self) -> bool:
        return self.alias == "cpu"

    @property
    def is_cuda(self) -> bool:
        return not self.is_cpu


def wp_cuda_load_module(device: Device) -> None:
    """``cuModuleLoadDataEx``: loading a module synchronises the context; drivers < 12.3 refuse it while a stream
    of the context is capturing (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)."""
    synchronize(device.torch_device)


class Kernel:
    def __init__(self, key: str, func, module: "Module"):
        self.key, self.func, self.module = key, func, module
        module.kernels.append(self)


class ModuleExec:
    def __init__(self, hooks: dict, device: Device, block_dim: int):
        self.hooks, self.device, self.block_dim = hooks, device, block_dim

    def get_kernel_hooks(self, kernel: Kernel):
        return self.hooks[kernel.key]


class Module:
    def __init__(self, name: str):
        self.name = name
        self.options = {"block_dim": DEFAULT_BLOCK_DIM}
        self.kernels: list[Kernel] = []
        self.execs: dict = {}            # ((device.context, block_dim): ModuleExec)
        self.builds: list = []           # (device alias, block_dim) of every build, in order

    def load(self, device: Device, block_dim: int | None = None) -> ModuleExec:
        if _variant == "bug":
            # update module options if launching with a new block dim
            if block_dim is not None:
                self.options["block_dim"] = block_dim
            active_block_dim = self.options["block_dim"]
        else:
            # resolve the active block_dim without mutating self.options
            active_block_dim = block_dim if block_dim is not None else self.options["block_dim"]

        exec = self.execs.get((device.context, active_block_dim))
        if exec is not None:
            return exec

        # codegen (WP_TILE_BLOCK_DIM = active_block_dim) and compile: host work only
        self.builds.append((device.alias, active_block_dim))
        hooks = {k.key: k.func for k in self.kernels}
        if device.is_cuda:
            wp_cuda_load_module(device)
        exec = ModuleExec(hooks, device, active_block_dim)
        self.execs[(device.context, active_block_dim)] = exec
        return exec


def launch(kernel: Kernel, dim: int, inputs, device: Device, block_dim: int = DEFAULT_BLOCK_DIM) -> None:
    if device.is_cpu:
        block_dim = 1
    module_exec = kernel.module.load(device, block_dim)      # delay load modules
    hooks = module_exec.get_kernel_hooks(kernel)
    hooks(dim, *inputs)


def force_load(device: Device, modules: list[Module], block_dim: int | None = None) -> None:
    if _variant == "bug":
        for m in modules:
            m.load(device, block_dim=block_dim)
        return
    loaded_variants = {m: tuple(m.execs) for m in modules}

    def _load_block_dims(m: Module, d: Device):
        # preload the variants already loaded on this device, else the module default
        if block_dim is not None:
            return [block_dim]
        loaded = [dim for (ctx, dim) in loaded_variants[m] if ctx == d.context]
        return loaded or [None]

    for m in modules:
        for dim in _load_block_dims(m, device):
            m.load(device, block_dim=dim)


class Graph:
    def __init__(self, graph, outputs):
        self.graph, self.outputs = graph, outputs


def capture_begin_end(device: Device, modules: list[Module], fn, *, static, state,
                      force_module_load: bool | None = None) -> Graph:
    """``with wp.ScopedCapture(device, force_module_load=...): fn()`` (capture_begin, the body, capture_end)."""
    if force_module_load is None:
        if DRIVER_VERSION >= (12, 3):
            force_module_load = False    # newer drivers can load modules during capture
        else:
            force_module_load = ENABLE_GRAPH_CAPTURE_MODULE_LOAD_BY_DEFAULT
    if force_module_load:
        force_load(device, modules)      # before wp_cuda_graph_begin_capture
    g, outputs = capture(fn, device=device.torch_device, warmups=0, name="warp.ScopedCapture",
                         owner="warp.ScopedCapture", static=static, state=state)
    return Graph(g, outputs)


def capture_launch(graph: Graph):
    return replay(graph.graph, graph.outputs)


# --- the user's simulation -------------------------------------------------------------------------------------------------

def integrate_particles(dim, particle_q, particle_qd, particle_f, inv_mass, gravity, dt):
    """@wp.kernel: semi-implicit Euler, one thread per particle (vectorised over ``dim`` particles)."""
    particle_qd[:dim].add_((particle_f[:dim] * inv_mass[:dim].unsqueeze(-1) + gravity) * dt)
    particle_q[:dim].add_(particle_qd[:dim] * dt)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    data = generator(564)
    q0 = randn(N_PARTICLES, 3, gen=data, device="cpu")
    qd0 = randn(N_PARTICLES, 3, gen=data, device="cpu", scale=0.1)
    inv_mass0 = torch.rand(N_PARTICLES, generator=data) + 0.5
    frame_forces = [randn(N_PARTICLES, 3, gen=data, device="cpu", scale=2.0) for _ in range(FRAMES)]
    gravity0 = torch.tensor([0.0, 0.0, -9.81])

    def workload(graphed: bool):
        module = Module("__main__")
        integrate = Kernel("integrate_particles", integrate_particles, module)
        cpu, gpu = Device("cpu", "cpu", None), Device("cuda:0", device, 1)

        # host sanity check: one step on the CPU device
        q_h, qd_h = q0.clone(), qd0.clone()
        launch(integrate, N_PARTICLES, [q_h, qd_h, torch.zeros_like(q_h), inv_mass0.clone(), gravity0.clone(), SIM_DT],
               device=cpu)

        q, qd = q0.clone().to(device), qd0.clone().to(device)
        forces = torch.zeros(N_PARTICLES, 3, device=device)      # model.particle_f: written before every frame
        inv_mass, gravity = inv_mass0.to(device), gravity0.to(device)

        def simulate():
            for _ in range(SUBSTEPS):
                launch(integrate, N_PARTICLES, [q, qd, forces, inv_mass, gravity, SIM_DT], device=gpu)
            return q, qd

        outs = [q_h]
        graph = None
        if graphed:
            graph = capture_begin_end(gpu, [module], simulate, static={"particle_f": forces},
                                      state={"particle_q": q, "particle_qd": qd})
        for f in frame_forces:
            forces.copy_(f)
            q_out, qd_out = capture_launch(graph) if graphed else simulate()
            outs += [q_out.clone(), qd_out.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
