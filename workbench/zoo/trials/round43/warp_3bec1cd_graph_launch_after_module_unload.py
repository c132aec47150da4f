"""A captured Warp launch keeps only the kernel handle: ``Module.unload()`` frees the CUDA module the graph runs.

Upstream: https://github.com/NVIDIA/warp/commit/3bec1cd03e3417bbf89c7a07cdddef97949f936e ("Retain CUDA modules
used during graph capture", August 2024; Warp is merged from GitLab, so there is no GitHub PR). CHANGELOG:
"Fix errors when launching a CUDA graph after a module is reloaded".
Symptom: ``wp.capture_launch(graph)`` fails with a CUDA error ("Graph launch error") once the module of a
captured kernel has been unloaded after the capture: by a reload, by a new kernel or function registered in
the same Python module, or by a generic kernel's new overload (each calls ``Module.unload()`` so that the
module is rebuilt on its next launch). Eager launches just rebuild the module and run.
Mechanism: before the fix ``Module`` owned the loaded CUDA modules (``cuda_modules[context]``) and the cached
kernel entry points (``kernel_hooks``); a captured ``Graph`` held only its ``cudaGraphExec``, whose kernel
nodes name functions of that module. ``Module.unload()`` called ``runtime.core.cuda_unload_module`` and
cleared the hooks, releasing the module's device image while the graph still launches from it. Here a
loaded module's device image (its code and constants) is a device tensor the kernel reads; unloading frees it
back to the driver, and the next graph launch reads freed memory.
Doctor: dangling-reference, at ``unload`` (``Module.unload`` releases the CUDA module whose kernels the
captured graph still launches).
Fix (upstream): a ref-counted ``ModuleExec`` owns the loaded module (``__del__`` unloads it) and its kernel
hooks; ``Module.load`` returns it and ``Module.unload`` only drops the module's own reference.
``capture_begin`` creates the ``Graph(device, capture_id)`` up front and registers it in
``runtime.captures``; ``launch`` asks ``cuda_stream_is_capturing`` and, while capturing, calls
``graph.retain_module_exec(module_exec)``, so a graph keeps every module it launches until it is destroyed.
Read: the diff of 3bec1cd (``warp/context.py``: ``ModuleExec``, ``Module.load/unload/get_kernel_hooks``,
``Graph``, ``launch``, ``capture_begin/capture_end``; the test ``test_graph_launch_after_module_reload``).
The trigger modelled is ``Module.register_kernel`` (a diagnostic kernel defined in the example's module after
the capture), which calls ``self.unload()`` at the parent commit.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, own_segment_elems, release_to_driver, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/3bec1cd03e3417bbf89c7a07cdddef97949f936e"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "unload"
SYMPTOM = "capture_launch after the example's module is unloaded runs kernels of a freed CUDA module (launch error)"

NUM_PARTICLES, SIM_SUBSTEPS, FRAME_DT, FRAMES = 6, 2, 0.05, 4
GRAVITY, DAMPING = (0.0, -9.8, 0.0), 0.98


# ----------------------------------------------------------------------------- the driver (warp.cu)
class CUmodule:
    """A loaded CUDA module: its device image (code and constants) until ``cuda_unload_module``."""

    def __init__(self, device, table):
        self.device = device
        self.image = torch.zeros(own_segment_elems(device), device=device)
        self.image[: len(table)].copy_(torch.tensor(table).to(device))
        self.offsets: dict = {}


class CUfunction:
    def __init__(self, module: CUmodule, kernel):
        self.module, self.kernel = module, kernel


class _Core:
    def __init__(self):
        self.capture_id = None                   # the capture under way on the stream, if any
        self._next_capture_id = 1

    def cuda_load_module(self, device, kernels):
        table, offsets = [], {}
        for kernel in kernels:                   # build: the kernels' constants, laid out in the image
            offsets[kernel.key] = len(table)
            table += kernel.constants
        module = CUmodule(device, table)
        module.offsets = offsets
        return module

    def cuda_unload_module(self, context, module: CUmodule):
        module.image = None                      # cuModuleUnload: the image goes back to the driver
        release_to_driver(module.device)

    def cuda_get_kernel(self, context, module, kernel):
        return CUfunction(module, kernel)

    def cuda_launch_kernel(self, context, func: CUfunction, params):
        k = func.module.offsets[func.kernel.key]
        consts = func.module.image[k: k + len(func.kernel.constants)]     # the kernel runs from the image
        func.kernel.func(consts, *params)

    def cuda_stream_is_capturing(self, stream) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def cuda_stream_get_capture_id(self, stream) -> int:
        return self.capture_id


class Runtime:
    def __init__(self):
        self.core = _Core()
        self.captures: dict = {}                 # (fix) maps capture ids to graphs


runtime = Runtime()


# ----------------------------------------------------------------------------- warp/context.py
class KernelHooks:
    def __init__(self, forward):
        self.forward = forward


class ModuleExec:
    """(the fix) The compiled executable code for one device, a ref-counted wrapper of the loaded module."""

    def __init__(self, handle, device):
        self.handle, self.device = handle, device
        self.kernel_hooks: dict = {}

    def __del__(self):                           # release the loaded module
        if self.handle is not None and self.handle.image is not None:
            self.handle.image = None

    def get_kernel_hooks(self, kernel):
        hooks = self.kernel_hooks.get(kernel)
        if hooks is None:
            hooks = KernelHooks(runtime.core.cuda_get_kernel(None, self.handle, kernel))
            self.kernel_hooks[kernel] = hooks
        return hooks


class Kernel:
    def __init__(self, module, key, func, constants):
        self.module, self.key, self.func, self.constants = module, key, func, list(constants)
        module.register_kernel(self)


class Module:
    def __init__(self, name, device, variant):
        self.name, self.device, self.variant = name, device, variant
        self.kernels: dict = {}
        self.cuda_modules: dict = {}             # module lookup by CUDA context (before the fix)
        self.kernel_hooks: dict = {}
        self.cuda_execs: dict = {}               # (fix) executable CUDA module lookup by CUDA context

    def register_kernel(self, kernel):
        self.kernels[kernel.key] = kernel
        # for a reload of module on next launch
        self.unload()

    def load(self, device):
        if self.variant == "bug":
            if "ctx" not in self.cuda_modules:
                self.cuda_modules["ctx"] = runtime.core.cuda_load_module(device, list(self.kernels.values()))
            return True
        if "ctx" not in self.cuda_execs:
            handle = runtime.core.cuda_load_module(device, list(self.kernels.values()))
            self.cuda_execs["ctx"] = ModuleExec(handle, device)
        return self.cuda_execs["ctx"]

    def unload(self):
        if self.variant == "bug":
            # need to unload the CUDA module from all CUDA contexts where it is loaded
            for context, module in self.cuda_modules.items():
                runtime.core.cuda_unload_module(context, module)
            self.cuda_modules = {}
            # clear kernel hooks
            self.kernel_hooks = {}
        else:
            # clear loaded modules: a graph that retained the ModuleExec keeps it alive
            self.cuda_execs = {}

    def get_kernel_hooks(self, kernel, device):
        hooks = self.kernel_hooks.get(kernel)
        if hooks is None:
            hooks = KernelHooks(runtime.core.cuda_get_kernel(None, self.cuda_modules["ctx"], kernel))
            self.kernel_hooks[kernel] = hooks
        return hooks


class Graph:
    def __init__(self, device, capture_id):
        self.device, self.capture_id = device, capture_id
        self.graph_exec = self.outputs = None
        self.module_execs: set = set()

    def retain_module_exec(self, module_exec):
        """(the fix) retain executable CUDA modules used by this graph"""
        self.module_execs.add(module_exec)


def launch(kernel, inputs, device):
    if kernel.module.variant == "bug":
        if not kernel.module.load(device):
            return
        hooks = kernel.module.get_kernel_hooks(kernel, device)
    else:
        module_exec = kernel.module.load(device)
        hooks = module_exec.get_kernel_hooks(kernel)
        # If the stream is capturing, we retain the CUDA module so that it doesn't get unloaded
        # before the captured graph is released.
        if runtime.core.cuda_stream_is_capturing(None):
            graph = runtime.captures.get(runtime.core.cuda_stream_get_capture_id(None))
            if graph is not None:
                graph.retain_module_exec(module_exec)
    runtime.core.cuda_launch_kernel(None, hooks.forward, inputs)


class ScopedCapture:
    """``with wp.ScopedCapture() as capture``: modules are force-loaded before the capture begins."""

    def __init__(self, device, modules, static, state):
        self.device, self.modules, self.static, self.state = device, modules, static, state

    def capture(self, fn) -> Graph:
        for m in self.modules:                   # force_module_load
            m.load(self.device)
        capture_id = runtime.core._next_capture_id
        runtime.core._next_capture_id += 1
        graph = Graph(self.device, capture_id)
        runtime.captures[capture_id] = graph
        runtime.core.capture_id = capture_id
        try:
            graph.graph_exec, graph.outputs = capture(
                fn, device=self.device, warmups=0, name="wp.ScopedCapture", static=self.static, state=self.state,
                owner="warp.ScopedCapture (particle example)")
        finally:
            runtime.core.capture_id = None
            del runtime.captures[capture_id]
        return graph


def capture_launch(graph: Graph):
    return replay(graph.graph_exec, graph.outputs)


# ----------------------------------------------------------------------------- the user's example module
def integrate_particles(consts, q, qd, f, inv_mass, dt):
    gravity, damping = consts[:3], consts[3]
    qd.add_((f * inv_mass + gravity) * dt)
    qd.mul_(damping)
    q.add_(qd * dt)


def kinetic_energy(consts, qd, inv_mass, energy):
    energy.copy_(consts[0] * ((qd * qd).sum(1, keepdim=True) / inv_mass).sum())


class Example:
    def __init__(self, device, variant, use_cuda_graph):
        self.device = device
        self.module = Module("example_particles", device, variant)
        self.integrate = Kernel(self.module, "integrate_particles", integrate_particles, [*GRAVITY, DAMPING])
        self.energy_kernel = None
        self.particle_q = (torch.arange(NUM_PARTICLES * 3, dtype=torch.float32).view(NUM_PARTICLES, 3) * 0.1).to(device)
        self.particle_qd = torch.zeros(NUM_PARTICLES, 3, device=device)
        self.particle_f = (torch.linspace(-1.0, 1.0, NUM_PARTICLES * 3).view(NUM_PARTICLES, 3)).to(device)
        self.inv_mass = (1.0 / (1.0 + torch.arange(NUM_PARTICLES, dtype=torch.float32))).to(device)[:, None]
        self.energy = torch.zeros(1, device=device)
        self.graph = None
        if use_cuda_graph:
            state = {"particle_q": self.particle_q, "particle_qd": self.particle_qd}
            self.graph = ScopedCapture(device, [self.module], {}, state).capture(self.simulate)

    def simulate(self):
        dt = FRAME_DT / SIM_SUBSTEPS
        for _ in range(SIM_SUBSTEPS):
            launch(self.integrate, (self.particle_q, self.particle_qd, self.particle_f, self.inv_mass, dt),
                   self.device)
        return self.particle_q

    def step(self):
        if self.graph is not None:
            return capture_launch(self.graph)
        return self.simulate()

    def add_diagnostics(self):
        """@wp.kernel defined later in the same Python module: ``register_kernel`` unloads the module."""
        self.energy_kernel = Kernel(self.module, "kinetic_energy", kinetic_energy, [0.5])

    def kinetic_energy(self):
        launch(self.energy_kernel, (self.particle_qd, self.inv_mass, self.energy), self.device)
        return self.energy


def run(variant: str, device: str = "cpu"):
    def serve(use_cuda_graph: bool):
        example = Example(device, variant, use_cuda_graph)
        outs = []
        for frame in range(FRAMES):
            if frame == 2:
                example.add_diagnostics()
            outs.append(example.step().clone())
            if example.energy_kernel is not None:
                outs.append(example.kinetic_energy().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
