"""Two threads compile the same CuPy ``ElementwiseKernel`` at once; the second one's memo store drops the first one's kernel, and the module a captured graph launches is unloaded.

Upstream: https://github.com/cupy/cupy/pull/9600 ("ENH: do not unload modules/code that have been used", seberg,
opened 2026-01-13, merged 2026-01-16 as 117026663; fix commit fca8f0ead, test commit 9b62c9eb5). No issue: the PR
says it is "a minimal solution to make graph capture mostly more robust in a threaded environment", and its test
docstring says that not unloading a kernel that was ever used "matters for graph capture".
Symptom: a CuPy graph captured on one thread (``Stream.begin_capture`` ... ``end_capture``) fails on
``Graph.launch()`` (a CUDA launch error, or an illegal access) when another thread used the same kernel for the
first time at the same moment. The captured kernel node names a ``CUfunction`` of a module that was unloaded after
the capture. Eager calls are unaffected. The PR's tests are thread tests: they check that one compiled kernel ends
up in the memo and stays there. They do not replay a graph; this program plays the graph case the PR describes.
Mechanism: ``ElementwiseKernel._get_elementwise_kernel`` (cupy/_core/_kernel.pyx) looks the kernel up in
``self._elementwise_kernel_memo``. On a miss it calls the module-level ``_get_elementwise_kernel``, which is wrapped
by ``_util.memoize(for_each_device=True)`` (cupy/_util.pyx). That function compiles (``compile_with_cache``: NVRTC
runs ``with nogil`` and the disk cache does IO), builds a fresh ``function.Module`` and loads it, and returns a
``Function``. Two threads that miss together each compile and load their own module (A and B). Both memo stores then
assign unconditionally: ``m[arg_key] = result`` in ``memoize`` and ``self._elementwise_kernel_memo[key] = kern``
(the code even says "Potentially overwrite a duplicate cache entry because _get_elementwise_kernel() may include IO
wait"). Worker 1 finishes first: it stores A, warms up with A, and captures a graph that launches A. Worker 2 then
stores B over A. A ``Function`` holds its ``Module`` ("to keep module loaded"), and ``Module.__dealloc__`` calls
``driver.moduleUnload``. A ``Graph`` (cupy/cuda/graph.pyx) holds only its ``cudaGraphExec`` (and host callbacks),
and CuPy captures in relaxed mode by default, so nothing stops the unload. Once the memos drop A, nothing holds it:
module A is unloaded and every ``Graph.launch()`` runs a kernel from a freed module. An eager call enqueues its
launch while its ``Function`` is alive, and the next call finds B in the memo, so eager is correct.
Doctor: dangling-reference, at _get_elementwise_kernel. The memo store in ``ElementwiseKernel._get_elementwise_kernel``
(after ``memoize``'s store in the same function chain) drops the last reference to the ``Function``/``Module``
that worker 1's captured graph launches. Its ``Module.__dealloc__`` unloads the module, and the graph keeps reading
the released module image.
Fix (upstream): both stores use ``dict.setdefault`` and take back what the dict holds:
``kern = self._elementwise_kernel_memo.setdefault(key, kern)`` (likewise ``ufunc._get_ufunc_kernel``), and
``result = m.setdefault(arg_key, result)`` in ``memoize``. The first kernel stored is the one every caller uses,
and the memo keeps it loaded. A later duplicate (B) is dropped before anyone launches it.
Modelled: one ``ElementwiseKernel`` (a bias-GELU whose preamble constants live in the module image), two threads
(worker 1 on the main thread captures; worker 2 makes one eager call), ``_util.memoize`` with ``clear_memo``, and
``compile_with_cache`` -> ``Module.load``/``get_function``. A loaded module's device image (its code and constants)
is a device tensor the kernel reads. ``moduleUnload`` frees it back to the driver, as the Warp 3bec1cd trial
models an unloaded module. The race is made deterministic: worker 2's NVRTC compile (which releases the GIL) is
held until worker 1 has captured (``Interleaving``, model scaffolding). The interleaving is one that the real
scheduler allows. ``Stream.begin_capture``/``end_capture``/``Graph.launch`` are the kit's capture/replay in
relaxed mode, with one eager warm-up (the first call that compiles). Left out: ufunc, ``_cached_codes``, options,
the on-disk cache, and the ``_ArgInfo``/``_TypeMap`` classes (plain tuples here).
"""
from __future__ import annotations

import functools
import threading

import torch

from workbench.zoo.kit import capture, compare, generator, randn, release_to_driver, replay

UPSTREAM = "https://github.com/cupy/cupy/pull/9600"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_get_elementwise_kernel"
SYMPTOM = ("Graph.launch() after two threads compiled the same ElementwiseKernel at once runs a kernel whose module "
           "the memo overwrite unloaded (launch error / illegal access)")

N, STEPS = 8, 3
GELU_C0, GELU_C1 = 0.7978845608, 0.044715          # sqrt(2/pi) and the cubic coefficient, in the preamble

_cupy = {"fixed": False}                           # which CuPy the workload imports: before or after #9600
_nvrtc_hooks: list = []                            # model scaffolding: the interleaving of the two threads


def _image_elems(device: str) -> int:
    """A module image big enough (> 10 MB) to own its CUDA allocator segment, so that an unload unmaps it."""
    return (3 << 20) if torch.device(device).type == "cuda" else 16


# ----------------------------------------------------------------------------- cupy_backends/cuda/api/driver.pyx
class CUmodule:
    """A loaded CUDA module: its device image (code and constants) until ``moduleUnload``."""

    def __init__(self, device, cubin):
        self.device, self.body, self.nconst = device, cubin["body"], len(cubin["consts"])
        self.image = torch.zeros(_image_elems(device), device=device)
        self.image[: self.nconst].copy_(torch.tensor(cubin["consts"], dtype=torch.float32).to(device))


class CUfunction:
    """A kernel handle: what a captured kernel node names. It does not keep the module loaded."""

    def __init__(self, module: CUmodule, name: str):
        self.module, self.name = module, name


class driver:
    @staticmethod
    def moduleLoadData(device, cubin) -> CUmodule:
        return CUmodule(device, cubin)

    @staticmethod
    def moduleGetFunction(module: CUmodule, funcname: str) -> CUfunction:
        return CUfunction(module, funcname)

    @staticmethod
    def moduleUnload(module: CUmodule):
        module.image = None                        # cuModuleUnload: the image goes back to the driver
        release_to_driver(module.device)

    @staticmethod
    def launchKernel(func: CUfunction, size: int, args):
        consts = func.module.image[: func.module.nconst]      # the kernel runs from the module image
        func.module.body(consts, *args)


# ----------------------------------------------------------------------------- cupy_backends/cuda/libs/nvrtc.pyx
def compileProgram(code):
    # with nogil: status = nvrtcCompileProgram(...)   (other threads run while this one compiles)
    for hook in _nvrtc_hooks:
        hook.nogil()
    name, operation, preamble = code
    return {"name": name, "body": operation, "consts": preamble}


# ----------------------------------------------------------------------------- cupy/cuda/function.pyx
class Function:
    """CUDA kernel function."""

    def __init__(self, module: Module, funcname: str):
        self.module = module  # to keep module loaded
        self.ptr = driver.moduleGetFunction(module.ptr, funcname)

    def linear_launch(self, size: int, args):
        driver.launchKernel(self.ptr, size, args)


class Module:
    """CUDA kernel module."""

    def __init__(self, device):
        self.device, self.ptr = device, None

    def __del__(self):                             # __dealloc__
        if self.ptr is not None:
            driver.moduleUnload(self.ptr)
            self.ptr = None

    def load(self, cubin):
        self.ptr = driver.moduleLoadData(self.device, cubin)

    def get_function(self, name: str) -> Function:
        return Function(self, name)


# ----------------------------------------------------------------------------- cupy/cuda/compiler.py
def compile_with_cache(code, device) -> Module:
    cubin = compileProgram(code)
    mod = Module(device)                           # a fresh module per compile: no in-memory module cache
    mod.load(cubin)
    return mod


# ----------------------------------------------------------------------------- cupy/_util.pyx
_memos: list = []


def clear_memo():
    for memo in _memos:
        memo.clear()


def memoize(for_each_device=False):
    """Makes a function memoizing the result for each argument and device."""
    def decorator(f):
        memo: dict = {}
        _memos.append(memo)

        @functools.wraps(f)
        def ret(*args):
            dev_id = 0 if for_each_device else -1  # runtime.getDevice()
            arg_key = (dev_id, args)
            m = memo
            result = m.get(arg_key, m)
            if result is m:
                result = f(*args)
                if _cupy["fixed"]:
                    result = m.setdefault(arg_key, result)
                else:
                    m[arg_key] = result
            return result

        return ret

    return decorator


# ----------------------------------------------------------------------------- cupy/_core/_kernel.pyx
def _get_elementwise_kernel_code(arginfos, type_map, params, operation, name, preamble):
    return (name, operation, preamble)


def _get_simple_elementwise_kernel_from_code(name, code, device) -> Function:
    module = compile_with_cache(code, device)
    return module.get_function(name)


@memoize(for_each_device=True)
def _get_elementwise_kernel(arginfos, type_map, params, operation, name, preamble, device):
    code = _get_elementwise_kernel_code(arginfos, type_map, params, operation, name, preamble)
    return _get_simple_elementwise_kernel_from_code(name, code, device)


class ElementwiseKernel:
    """User-defined elementwise kernel."""

    def __init__(self, in_params, out_params, operation, name, preamble=()):
        self.in_params, self.out_params = in_params, out_params
        self.params = (in_params, out_params)
        self.operation, self.name, self.preamble = operation, name, tuple(preamble)
        self._elementwise_kernel_memo: dict = {}

    def __call__(self, *in_args):
        out = torch.empty_like(in_args[0])         # out_args are allocated before the kernel is looked up
        inout_args = (*in_args, out)
        arginfos = tuple((str(a.dtype), a.dim()) for a in inout_args)
        type_map = (("T", str(in_args[0].dtype)),)
        kern = self._get_elementwise_kernel(0, arginfos, type_map, str(out.device))
        kern.linear_launch(out.numel(), inout_args)
        return out

    def _get_elementwise_kernel(self, dev_id, arginfos, type_map, device) -> Function:
        key = (dev_id, arginfos, type_map)
        kern = self._elementwise_kernel_memo.get(key, None)
        if kern is not None:
            return kern
        kern = _get_elementwise_kernel(
            arginfos, type_map, self.params, self.operation, self.name, self.preamble, device)
        if _cupy["fixed"]:
            kern = self._elementwise_kernel_memo.setdefault(key, kern)
        else:
            # Store the compiled kernel in the cache.
            # Potentially overwrite a duplicate cache entry because
            # _get_elementwise_kernel() may include IO wait.
            self._elementwise_kernel_memo[key] = kern
        return kern


# ----------------------------------------------------------------------------- the user's program
def bias_gelu(consts, x, b, y):
    """``y = gelu(x + b)`` with the tanh approximation; its constants are the preamble's."""
    c0, c1 = consts[0], consts[1]
    h = x + b
    y.copy_(0.5 * h * (1.0 + torch.tanh(c0 * (h + c1 * h * h * h))))


class Interleaving:
    """Model scaffolding: worker 2's NVRTC compile (GIL released) outlasts worker 1's first call and capture."""

    def __init__(self):
        self.worker2_compiling = threading.Event()
        self.worker1_captured = threading.Event()

    def nogil(self):
        if threading.current_thread().name == "cupy-worker-2":
            self.worker2_compiling.set()
            self.worker1_captured.wait(timeout=30)


def run(variant: str, device: str = "cpu"):
    def serve(use_graph: bool):
        _cupy["fixed"] = variant == "fix"
        clear_memo()
        kernel = ElementwiseKernel("T x, T b", "T y", bias_gelu, "bias_gelu", preamble=(GELU_C0, GELU_C1))
        gen = generator(0)
        bias = randn(N, gen=gen, device=device, scale=0.1)
        inputs = [randn(N, gen=gen, device=device) for _ in range(STEPS)]
        w2_x = randn(N, gen=gen, device=device)
        inter = Interleaving()
        _nvrtc_hooks[:] = [inter]
        worker2_out: dict = {}

        def worker2():                             # another thread's first use of the same kernel
            try:
                worker2_out["y"] = kernel(w2_x, bias)
            except BaseException as e:             # noqa: BLE001 - reported on the main thread
                worker2_out["error"] = e
            finally:
                inter.worker2_compiling.set()

        t2 = threading.Thread(target=worker2, name="cupy-worker-2")
        try:
            t2.start()
            inter.worker2_compiling.wait(timeout=30)   # worker 2 missed the memo and is compiling
            if use_graph:
                x = inputs[0].clone()              # worker 1's static input buffer
                graph, y = capture(lambda: kernel(x, bias), device=device, warmups=1, name="Stream.begin_capture",
                                   static={"x": x}, owner="cupy.cuda.Stream capture (worker 1)",
                                   capture_error_mode="relaxed")
            else:
                kernel(inputs[0], bias)            # worker 1's first call: compiles module A
        finally:
            inter.worker1_captured.set()
            t2.join()
            _nvrtc_hooks.clear()
        if "error" in worker2_out:
            raise worker2_out["error"]
        outs = []
        for inp in inputs:
            if use_graph:
                x.copy_(inp)
                outs.append(replay(graph, y).clone())      # Graph.launch()
            else:
                outs.append(kernel(inp, bias))
        outs.append(worker2_out["y"])
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
