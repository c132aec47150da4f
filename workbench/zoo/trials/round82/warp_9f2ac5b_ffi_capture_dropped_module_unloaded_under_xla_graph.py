"""Warp's JAX FFI callback drops the ``ScopedCapture`` that retained the captured kernels' module; a module reload then unloads it while XLA's command buffer still launches its kernels.

Upstream: https://github.com/NVIDIA/warp/commit/9f2ac5bc29e63e8674803b732ef6f41fad20c1ce ("Fix premature unloading of
CUDA modules used in JAX FFI graph captures (GH-782)", NVIDIA/warp, on main 2025-06-10; issue
https://github.com/NVIDIA/warp/issues/782, reported from https://github.com/google-deepmind/mujoco_warp/pull/350).
Symptom: MuJoCo Warp under JAX (``jax_callable``, XLA command buffers on): ``Warp CUDA error 900: operation not
permitted when stream is capturing (in function cuda_unload_module)``, then ``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED``
(pendula.xml; mujoco_warp #425, a crash during training); a module unloaded outside a capture leaves XLA's recorded
graph launching kernels of an unloaded ``CUmodule`` (invalid handle / illegal address). With command buffers off
(every call goes through the FFI callback) the same program is right.
Mechanism: ``FfiCallable.ffi_callback`` (warp/jax_experimental/ffi.py) runs the user function under
``wp.ScopedCapture(stream=stream, external=True)`` when XLA is recording its command buffer. ``capture_begin`` puts
a ``Graph`` in ``runtime.captures``; every ``wp.launch`` on the capturing stream calls
``graph.retain_module_exec(self.module_exec)``: that ``Graph`` is the only thing that keeps the ``ModuleExec``
(the loaded ``CUmodule``) of the recorded kernels alive for as long as the recording is used. Before the fix the
``ScopedCapture`` (and its ``Graph``) was dropped right after the ``with`` block, while XLA kept the recording and
replays it on every later execution. The other holder, ``Module.execs``, lets go as soon as the Warp module is
rehashed: MuJoCo Warp creates kernels lazily (kernel factories registered into the same Python module, so
``register_kernel`` -> ``mark_modified``), and the next ``Module.load`` (here from ``FfiCallable.__call__`` of a
new ``jax_callable``) loads a new ``ModuleExec`` and replaces the old one in ``self.execs``. The old one's
``__del__`` calls ``cuda_unload_module``: Warp defers unloads only while a capture *it knows of* is open
(``g_captures``), so the module is unloaded at once, during XLA's next capture (error 900) or between replays.
XLA's graph keeps launching the recorded kernel of the unloaded module.
Doctor: dangling-reference, at ffi_callback (it lets the capture object that retains the recorded kernels' module
go out of scope while XLA's graph still launches them; the replays then read module memory whose owner released it).
Fix (upstream): ``with wp.ScopedCapture(stream=stream, external=True) as capture:`` ... ``call_desc.capture =
capture`` ("keep a reference to the capture object to prevent required modules getting unloaded"); ``__call__``
now always makes an ``FfiCallDesc`` and passes ``call_id`` (the ``has_static_args`` gate is removed), and
``ffi_callback`` always decodes it, so every call has a descriptor to hold the capture.
Modelled: a ``CUmodule`` is its device image: the compiled constants (``wp.constant`` values inlined in the code) of
every kernel of the module, which the kernels read on each launch; ``cuModuleLoad`` allocates it, ``cuModuleUnload``
frees it and returns it to the driver (on CUDA the image is a 16 MiB segment of its own and ``release_to_driver``
unmaps it, so a stale launch faults; on the CPU the emulation raises ``IllegalMemoryAccess``). One MuJoCo-Warp-like
Python module holds a semi-implicit Euler ``euler_step`` kernel (the step's ``jax_callable``) and, created lazily
by a factory at the first env reset, a ``reset_<nworld>`` kernel (its own ``jax_callable``). XLA is one executable
per jitted function with fixed buffer assignment: execution 1 warms up through the thunks, execution 2 records the
command buffer (one stream capture of the custom call) and later executions replay it; the reset executable runs
once (warm-up only). No vmap/pmap, no output_dims, no metadata extension; jax.Array and wp.array are torch tensors.
The eager reference is the same program with ``--xla_gpu_enable_command_buffer=`` (thunks only). The
unload here falls between replays (the reset's trace), so the model shows the stale launch (IllegalMemoryAccess on
the CPU, an illegal address on CUDA), not the error-900 form, where the same release lands inside XLA's next capture.
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/9f2ac5bc29e63e8674803b732ef6f41fad20c1ce"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "ffi_callback"
SYMPTOM = ("after a lazily created kernel reloads the Warp module, XLA's recorded command buffer launches euler_step "
           "from the unloaded CUmodule: the ScopedCapture that retained it was dropped after the FFI capture")

NWORLD, NQ = 4, 3
STEPS, RESET_AT = 6, 3          # steps of the rollout; the first env reset happens before step RESET_AT
DT, GRAVITY, DAMPING = 0.01, -9.81, 0.5
QPOS0 = 0.25


# --- warp/native/warp.cu + warp/build.py: the driver's side of a module -------------------------------------------

class _Core:
    """``runtime.core``: module load/unload (``cuModuleLoadDataEx`` / ``cuModuleUnload``) and the capture list
    Warp knows of (``g_captures``), which defers unloads while one of *its* captures is open."""

    def __init__(self, device: str):
        self.device = device
        self.g_captures: set = set()
        self.g_deferred_module_list: list = []

    def cuda_load_module(self, constants: list[float]) -> dict:
        image = torch.zeros(4 * own_segment_elems(self.device), device=self.device)  # the module's device image
        image[:len(constants)] = torch.tensor(constants, dtype=torch.float32)
        return {"image": image}

    def cuda_unload_module(self, context, module: dict) -> None:
        # ensure there are no graph captures in progress
        if not self.g_captures:
            module.pop("image")                                                       # cuModuleUnload
            release_to_driver(self.device)
        else:
            # defer until graph capture completes
            self.g_deferred_module_list.append(module)


class _Runtime:
    def __init__(self, device: str):
        self.core = _Core(device)
        self.captures: dict = {}           # capture id -> Graph (ongoing Warp captures)


runtime: _Runtime | None = None
user_modules: dict = {}


# --- warp/context.py ----------------------------------------------------------------------------------------------

class KernelHooks:
    def __init__(self, forward, offset: int, count: int):
        self.forward, self.offset, self.count = forward, offset, count


class ModuleExec:
    """A loaded module. ``Graph`` retains these so that graphs stay valid when the Module is reloaded."""

    def __init__(self, handle, module_hash, device, meta):
        self.handle = handle
        self.module_hash = module_hash
        self.device = device
        self.kernel_hooks = {}
        self.meta = meta                   # kernel key -> (offset, count) of its constants in the image

    # release the loaded module
    def __del__(self):
        if self.handle is not None:
            runtime.core.cuda_unload_module(None, self.handle)

    def get_kernel_hooks(self, kernel) -> KernelHooks:
        hooks = self.kernel_hooks.get(kernel.key)
        if hooks is None:
            offset, count = self.meta[kernel.key]
            hooks = self.kernel_hooks[kernel.key] = KernelHooks(kernel.func, offset, count)
        return hooks


class Module:
    def __init__(self, name: str):
        self.name = name
        self.kernels: dict = {}
        self.execs: dict = {}              # (device.context, block_dim) -> ModuleExec
        self.module_hash = None

    def register_kernel(self, kernel) -> None:
        # keep a reference to the latest version
        self.kernels[kernel.key] = kernel
        # force a reload of module on next launch
        self.mark_modified()

    def mark_modified(self) -> None:
        self.module_hash = None

    def get_module_hash(self):
        if self.module_hash is None:
            self.module_hash = hash(tuple((k, tuple(kern.constants)) for k, kern in sorted(self.kernels.items())))
        return self.module_hash

    def load(self, device) -> ModuleExec:
        # check if executable module is already loaded and not stale
        exec = self.execs.get((None, 256))
        if exec is not None and exec.module_hash == self.get_module_hash():
            return exec
        constants, meta = [], {}
        for key, kernel in sorted(self.kernels.items()):          # codegen: every kernel of the module
            meta[key] = (len(constants), len(kernel.constants))
            constants.extend(kernel.constants)
        cuda_module = runtime.core.cuda_load_module(constants)
        module_exec = ModuleExec(cuda_module, self.get_module_hash(), device, meta)
        self.execs[(None, 256)] = module_exec                      # the old ModuleExec, if any, loses this holder
        return module_exec


def get_module(name: str) -> Module:
    if name not in user_modules:
        user_modules[name] = Module(name)
    return user_modules[name]


class Kernel:
    def __init__(self, func, key: str, module: str, constants: list[float]):
        self.func, self.key, self.constants = func, key, constants
        self.module = get_module(module)
        self.module.register_kernel(self)


class Graph:
    def __init__(self, device, capture_id):
        self.device = device
        self.capture_id = capture_id
        self.module_execs: set = set()
        self.graph = None

    # retain executable CUDA modules used by this graph, which prevents them from being unloaded
    def retain_module_exec(self, module_exec: ModuleExec) -> None:
        self.module_execs.add(module_exec)


class Stream:
    def __init__(self, device, cuda_stream):
        self.device, self.cuda_stream = device, cuda_stream

    @property
    def is_capturing(self) -> bool:
        return is_capturing()


def capture_begin(stream: Stream, external: bool = False) -> None:
    if external and not stream.is_capturing:
        raise RuntimeError("External capture reported, but the stream is not capturing")
    capture_id = stream.cuda_stream                                  # cuda_stream_get_capture_id
    runtime.core.g_captures.add(capture_id)
    runtime.captures[capture_id] = Graph(stream.device, capture_id)


def capture_end(stream: Stream) -> Graph:
    graph = runtime.captures.pop(stream.cuda_stream)
    runtime.core.g_captures.discard(stream.cuda_stream)            # (external: XLA ends the stream capture)
    for module in runtime.core.g_deferred_module_list:             # unload_deferred_modules
        runtime.core.cuda_unload_module(None, module)
    runtime.core.g_deferred_module_list.clear()
    return graph


def launch(kernel: Kernel, inputs: list, outputs: list, stream: Stream) -> None:
    module_exec = kernel.module.load(stream.device)
    hooks = module_exec.get_kernel_hooks(kernel)
    # If the stream is capturing, we retain the CUDA module so that it doesn't get unloaded
    # before the captured graph is released.
    if len(runtime.captures) > 0 and stream.is_capturing:
        graph = runtime.captures.get(stream.cuda_stream)
        if graph is not None:
            graph.retain_module_exec(module_exec)
    constants = module_exec.handle["image"][hooks.offset:hooks.offset + hooks.count]   # the kernel's code
    hooks.forward(constants, *inputs, *outputs)


# --- warp/utils.py ------------------------------------------------------------------------------------------------

class ScopedCapture:
    def __init__(self, stream=None, external=False):
        self.stream, self.external = stream, external
        self.active = False
        self.graph = None

    def __enter__(self):
        capture_begin(stream=self.stream, external=self.external)
        self.active = True
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if self.active:
            try:
                self.graph = capture_end(stream=self.stream)
            finally:
                self.active = False


# --- warp/jax_experimental/ffi.py ---------------------------------------------------------------------------------

class FfiCallDesc:
    def __init__(self, static_inputs):
        self.static_inputs = static_inputs


class FfiCallable:
    def __init__(self, func, num_outputs, module_name, variant):
        self.func = func
        self.module_name = module_name       # func.__module__
        self.num_outputs = num_outputs
        self.has_static_args = False         # every argument of these functions is an array
        self.call_id = 0
        self.call_descriptors = {}
        self._variant = variant              # (which Warp: before/after 9f2ac5bc)

    def __call__(self, *args):
        """Traced once per jit: returns the custom call XLA compiles into the executable."""
        static_inputs = {}
        # load the module
        device = runtime.core.device
        module = get_module(self.module_name)
        module.load(device)
        if self._variant == "bug" and not self.has_static_args:
            return {"target": self, "attrs": {}}
        # save call data to be retrieved by callback
        call_id = self.call_id
        self.call_descriptors[call_id] = FfiCallDesc(static_inputs)
        self.call_id += 1
        return {"target": self, "attrs": {"call_id": call_id}}

    def ffi_callback(self, call_frame: dict) -> None:
        if self._variant == "fix" or self.has_static_args:
            # retrieve call info
            call_id = int(call_frame["attrs"]["call_id"])
            call_desc = self.call_descriptors[call_id]
        stream = Stream(runtime.core.device, cuda_stream=call_frame["stream"])
        arg_list = list(call_frame["args"]) + list(call_frame["rets"])     # wp.array(ptr=buffer.data, ...)
        # call the Python function with reconstructed arguments
        if stream.is_capturing:
            if self._variant == "fix":
                with ScopedCapture(stream=stream, external=True) as capture:
                    self.func(stream, *arg_list)
                # keep a reference to the capture object to prevent required modules getting unloaded
                call_desc.capture = capture
            else:
                with ScopedCapture(stream=stream, external=True):
                    self.func(stream, *arg_list)
        else:
            self.func(stream, *arg_list)


def jax_callable(func, num_outputs, module_name, variant):
    return FfiCallable(func, num_outputs, module_name, variant)


# --- XLA: a jitted function with one FFI custom call, optionally in a command buffer -------------------------------

class XlaExecutable:
    def __init__(self, custom_call: dict, params: list[torch.Tensor], device: str, enable_command_buffer: bool):
        # buffer assignment: parameters and results keep their addresses across executions
        self.params = [torch.zeros_like(p) for p in params]
        self.results = [torch.zeros_like(p) for p in params[:custom_call["target"].num_outputs]]
        self.custom_call, self.device = custom_call, device
        self.enable_command_buffer = enable_command_buffer
        self.warmup_done, self.graph = False, None

    def _custom_call_thunk(self) -> None:
        self.custom_call["target"].ffi_callback({"attrs": self.custom_call["attrs"], "args": self.params,
                                                 "rets": self.results, "stream": 7})

    def execute(self, *args) -> list[torch.Tensor]:
        for p, a in zip(self.params, args):
            p.copy_(a)
        if not self.enable_command_buffer or not self.warmup_done:
            self._custom_call_thunk()                                   # thunks (and the warm-up execution)
            self.warmup_done = True
        else:
            if self.graph is None:                                      # CommandBuffer::Trace, then Submit
                self.graph, _ = capture(self._custom_call_thunk, device=self.device, warmups=0,
                                        name="command buffer", owner="CommandBufferThunk",
                                        static={f"param{i}": p for i, p in enumerate(self.params)})
            replay(self.graph, tuple(self.results))
        return [r.clone() for r in self.results]


# --- the MuJoCo-Warp-like Python module: kernels and the functions wrapped with jax_callable ----------------------

MODULE = "mujoco_warp._src.forward"


def _euler_step_kernel(c, qpos, qvel, qpos_out, qvel_out):
    dt, gravity, damping = c[0], c[1], c[2]
    qvel_out.copy_(qvel * (1.0 - damping * dt) + dt * gravity)
    qpos_out.copy_(qpos + dt * qvel_out)


def _make_reset_kernel(nworld: int) -> Kernel:
    """A kernel factory (``@cache_kernel``): called at the first reset, registered into the same module."""
    def reset_kernel(c, qpos, qvel, done, qpos_out, qvel_out):
        keep = 1.0 - done
        qpos_out.copy_(qpos * keep + c[0] * done)
        qvel_out.copy_(qvel * keep)
    return Kernel(reset_kernel, f"reset_{nworld}", MODULE, [QPOS0])


def simulate(variant: str, device: str, enable_command_buffer: bool, qpos, qvel, done) -> list[torch.Tensor]:
    global runtime
    runtime = _Runtime(device)                                           # wp.init()
    user_modules.clear()
    euler_step = Kernel(_euler_step_kernel, "euler_step", MODULE, [DT, GRAVITY, DAMPING])

    def step(stream, qpos_in, qvel_in, qpos_out, qvel_out):
        launch(euler_step, [qpos_in, qvel_in], [qpos_out, qvel_out], stream)

    step_fn = jax_callable(step, 2, MODULE, variant)
    step_exe = XlaExecutable(step_fn(qpos, qvel), [qpos, qvel], device, enable_command_buffer)   # jax.jit(step_fn)
    out = []
    for i in range(STEPS):
        if i == RESET_AT:                                               # first env reset: the reset kernel is built
            reset_kernel = _make_reset_kernel(NWORLD)

            def reset(stream, qpos_in, qvel_in, done_in, qpos_out, qvel_out):
                launch(reset_kernel, [qpos_in, qvel_in, done_in], [qpos_out, qvel_out], stream)

            reset_fn = jax_callable(reset, 2, MODULE, variant)
            reset_exe = XlaExecutable(reset_fn(qpos, qvel, done), [qpos, qvel, done], device, enable_command_buffer)
            qpos, qvel = reset_exe.execute(qpos, qvel, done)
        qpos, qvel = step_exe.execute(qpos, qvel)
        out += [qpos, qvel]
    return out


def run(variant: str, device: str = "cpu"):
    gen = generator(782)
    qpos = randn(NWORLD, NQ, gen=gen, device=device)
    qvel = randn(NWORLD, NQ, gen=gen, device=device)
    done = torch.tensor([[0.0], [1.0], [0.0], [1.0]], device=device).expand(NWORLD, NQ).contiguous()
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: simulate(variant, device, True, qpos, qvel, done),
                   lambda: simulate(variant, device, False, qpos, qvel, done))
