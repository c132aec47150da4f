"""Helion's CuTe launcher caches its launch args with the warmup's stream baked in: the captured launch hits the cache, runs on that stream and is no node of the graph.

Upstream: https://github.com/pytorch/helion/pull/2817 ("[cute] Sample CUDA stream per launch to fix empty-graph
capture", yushangdi), merged 2026-06-18 as 62e9166b; the bug came with https://github.com/pytorch/helion/pull/2516
("[cutedsl] cache cute launch arguments", d412772e, 2026-05-21).
Symptom: a Helion CuTe-DSL kernel launched inside ``torch.cuda.graph`` silently stops computing: PyTorch warns "The
CUDA Graph is empty. This usually means that the graph was attempted to be captured on wrong device or stream.",
replays do not run the kernel, so what it writes keeps its capture-time value whatever the new inputs (reported
under tritonbench ``--cudagraph``: 8 ns for a 512x2048x2048 FP8 GEMM, negative latencies).
Mechanism: Helion's generated host code calls ``default_cute_launcher(_helion_kernel, grid, *args, block=...)``
(helion/runtime/__init__.py). It gets ``(schema_key, launch_args)`` from ``_build_cached_cute_schema_and_args``,
an 8-entry LRU on the kernel keyed by ``_cute_launch_arg_cache_key`` (the grid; each tensor's device, dtype, rank,
``data_ptr``, sizes, strides; the scalars) -- not by the stream. On a miss ``_build_cute_schema_and_args`` makes
the ``make_ptr`` pointers and scalars, appends the grid and then ``current_stream()`` (``cutlass.torch``'s: torch's
current stream), and the whole tuple is cached; the launcher then calls ``compiled(*launch_args)``. The warmup
launch runs eagerly on the default stream and caches args that end with it. ``torch.cuda.graph`` makes its
capture stream current, but the captured launch has the same signature (same buffers, grid and scalars), hits the
cache, and the kernel is enqueued on the cached default stream: a stream that is not capturing (and that the
non-blocking capture stream does not serialise with), so the launch executes once, immediately, and the graph
records nothing for it. At every replay the kernel's output keeps what that one capture-time launch wrote (from
the warmup's inputs); everything downstream reads it. Eager launches always run on the current stream, so eager
is right. Here the kernel is a destination-passing RMSNorm writing the layer's ``normed`` workspace; the MLP and
LM head after it are captured torch ops, so the replayed logits are those of the capture step's hidden states at
every later step. A launch on another stream is modelled as a launch from another thread, whose current stream is
that one: the CPU engine records only the capturing thread, as CUDA captures only the capturing stream.
Doctor: host-work-frozen, at ``default_cute_launcher`` (during capture the cache hit makes it launch the kernel
with the stale stream from the cached args, so the kernel runs once, outside the graph, at capture; replays
repeat only the captured kernels and the RMSNorm output is never recomputed; ``_build_cute_schema_and_args``,
which baked the stream in, does not even run during the capture).
Fix (upstream): ``_build_cute_schema_and_args`` no longer appends the stream (launch args end with the grid);
``default_cute_launcher`` calls ``compiled(*launch_args, _cute_current_stream())``, a new helper that samples
``current_stream()`` on every launch, so a captured launch goes to the capture stream. Tests
``test_cute_launcher_samples_stream_fresh_per_launch`` and ``test_cute_build_schema_excludes_stream_from_cached_args``.
(Diff read in full at 62e9166b; pre-fix ``_cute_launch_arg_cache_key`` / ``_build_cached_cute_schema_and_args``
read at its parent.)
Modelled: the CuTe compile is a ``_CompiledCuteLauncher`` that turns the launch args back into the kernel's
parameters and launches on the stream it is given; ``make_ptr`` keeps the tensor it addresses; shapes are baked
(``bake_tensor_shapes``), eps is a runtime scalar, no constexpr parameters, no arch env, no compile options. The
pre-fix key holds every tensor's ``data_ptr``, so the capture hits the warmup's entry only when it launches with the
same buffers: the kernel here is a destination-passing Helion ``rms_norm(x, weight, out, eps)`` on the runner's
static hidden-states buffer and the layer's own output workspace (the reported case, a tritonbench FP8 GEMM, was
timed, not checked). One user graph of batch 4 captured on the first step after one warmup, float32, 4 steps; each
run builds its kernel afresh (a fresh process: empty launch-arg cache). The CPU emulation has no stream objects:
``current_stream()`` answers a capture-stream token on the capturing thread and a default-stream token elsewhere.
"""
from __future__ import annotations

import threading

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/helion/pull/2817"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "default_cute_launcher"
SYMPTOM = ("a Helion CuTe kernel inside a captured graph launches on the warmup's cached stream: it runs once at "
           "capture, the graph records nothing for it, and replays keep its capture-time output")

VOCAB, HIDDEN, INTER, BATCH, STEPS, EPS = 16, 8, 16, 4, 4, 1e-6
_RUN = {"variant": "bug", "device": "cpu"}


# --------------------------------------------------------------------------------- cutlass (CuTe DSL), modelled
class _CpuStream:
    """The CPU emulation has no stream objects: a token for the default stream and one for the capture stream."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


_DEFAULT_STREAM, _CAPTURE_STREAM = _CpuStream("default stream"), _CpuStream("capture stream")


def current_stream():
    """``cutlass.torch.current_stream``: torch's current stream (under ``torch.cuda.graph``, its capture stream)."""
    if torch.device(_RUN["device"]).type == "cuda":
        return torch.cuda.current_stream()
    return _CAPTURE_STREAM if is_capturing() else _DEFAULT_STREAM


class _Pointer:
    """``cute.runtime.make_ptr``: a typed global-memory address (here it keeps the tensor that owns it)."""

    def __init__(self, dtype, memory, mem_space, assumed_align):
        self.dtype, self.memory, self.mem_space, self.assumed_align = dtype, memory, mem_space, assumed_align


def make_ptr(dtype, memory, mem_space, assumed_align=16):
    return _Pointer(dtype, memory, mem_space, assumed_align)


def _cuda_launch(stream, kernel, *params):
    """``cuLaunchKernel(..., stream)``. A stream capture records only work enqueued on the capturing stream; a launch
    on another stream (not joined to the capture) executes now and leaves no node. On the CPU the engine records only
    the capturing thread, so a launch on a stream other than the caller's current one runs on a worker thread."""
    if stream == current_stream():
        kernel(*params)
        return

    def on_stream():
        if isinstance(stream, torch.cuda.Stream):
            with torch.cuda.stream(stream):
                kernel(*params)
        else:
            kernel(*params)

    worker = threading.Thread(target=on_stream)
    worker.start()
    worker.join()


# ------------------------------------------------------------------------------------ helion/runtime/__init__.py
_CUTE_LAUNCHER_IMPORTS: tuple | None = None


def _get_cute_launcher_imports():
    global _CUTE_LAUNCHER_IMPORTS
    cached = _CUTE_LAUNCHER_IMPORTS
    if cached is not None:
        return cached
    cached = ("gmem", make_ptr, current_stream)    # (cute.AddressSpace.gmem, make_ptr, cutlass_torch.current_stream)
    _CUTE_LAUNCHER_IMPORTS = cached
    return cached


def _cute_current_stream():
    """The fix: sample the *current* CUDA stream for a cute kernel launch, fresh on every launch, never cached."""
    _gmem, _make_ptr, current_stream_obj = _get_cute_launcher_imports()
    return current_stream_obj()


# Keep the per-kernel launch-argument cache small: production kernels normally
# relaunch one or two stable tensor signatures, while autotune may probe many.
_CUTE_LAUNCH_ARG_CACHE_LIMIT = 8


def _cute_kernel_param_is_constexpr(cute_kernel):
    return getattr(cute_kernel, "_constexpr_flags", ())


def _normalize_cute_scalar(arg):
    return ("float", float(arg)) if isinstance(arg, float) else ("int", int(arg))


def _cute_scalar_cache_value(scalar_kind, scalar_value):
    return scalar_value.hex() if scalar_kind == "float" else scalar_value


def _cute_launch_arg_cache_key(cute_kernel, args, grid):
    constexpr_flags = _cute_kernel_param_is_constexpr(cute_kernel)
    key: list = [grid]
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            key.append(("tensor", arg.device.type, arg.device.index, str(arg.dtype), arg.ndim, arg.data_ptr(),
                        tuple(int(arg.size(d)) for d in range(arg.ndim)),
                        tuple(int(arg.stride(d)) for d in range(arg.ndim))))
            continue
        scalar_kind, scalar_value = _normalize_cute_scalar(arg)
        is_constexpr = i < len(constexpr_flags) and constexpr_flags[i]
        key.append(("scalar_constexpr" if is_constexpr else "scalar", scalar_kind,
                    _cute_scalar_cache_value(scalar_kind, scalar_value)))
    return tuple(key)


def _build_cached_cute_schema_and_args(cute_kernel, args, grid):
    cache_key = _cute_launch_arg_cache_key(cute_kernel, args, grid)
    try:
        cache = cute_kernel._helion_cute_launch_arg_cache
    except AttributeError:
        cache = {}
        cute_kernel._helion_cute_launch_arg_cache = cache
    cached = cache.get(cache_key)
    if cached is not None:
        cache[cache_key] = cache.pop(cache_key)
        return cached
    built = _build_cute_schema_and_args(cute_kernel, args, grid)
    cache[cache_key] = built
    if len(cache) > _CUTE_LAUNCH_ARG_CACHE_LIMIT:
        cache.pop(next(iter(cache)))
    return built


def _build_cute_schema_and_args(cute_kernel, args, grid, bake_tensor_shapes=True):
    gmem_space, make_ptr_obj, current_stream_obj = _get_cute_launcher_imports()
    constexpr_flags = _cute_kernel_param_is_constexpr(cute_kernel)
    schema: list = []
    launch_args: list = []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            sizes_t = tuple(int(arg.size(d)) for d in range(arg.ndim))
            strides_t = tuple(int(arg.stride(d)) for d in range(arg.ndim))
            launch_args.append(make_ptr_obj(arg.dtype, arg, gmem_space, assumed_align=16))
            if bake_tensor_shapes and all(s > 0 for s in sizes_t):
                schema.append(("tensor", str(arg.dtype), arg.ndim, sizes_t, strides_t))
            else:
                schema.append(("tensor", str(arg.dtype), arg.ndim))
                launch_args.extend(sizes_t)
                launch_args.extend(strides_t)
            continue
        scalar_kind, scalar_value = _normalize_cute_scalar(arg)
        if i < len(constexpr_flags) and constexpr_flags[i]:
            schema.append(("scalar_constexpr", scalar_kind, _cute_scalar_cache_value(scalar_kind, scalar_value),
                           scalar_value))
        else:
            schema.append(("scalar", scalar_kind))
            launch_args.append(scalar_value)
    launch_args.extend(grid)
    if _RUN["variant"] == "fix":
        pass        # the stream is intentionally NOT appended here: the caller samples it fresh per launch
    else:
        launch_args.append(current_stream_obj())      # launch_args.append(current_stream()): cached with the rest
    return tuple(schema), tuple(launch_args)


class _CompiledCuteLauncher:
    """What ``cute.compile`` returns for the generated wrapper: it takes the launch args (pointers and runtime
    scalars, then the grid, then the stream), rebuilds the tensors from the baked layouts and launches the kernel."""

    def __init__(self, cute_kernel, schema_key, block):
        self.cute_kernel, self.schema_key, self.block = cute_kernel, schema_key, block

    def __call__(self, *launch_args):
        *args, gx, gy, gz, stream = launch_args
        params, it = [], iter(args)
        for entry in self.schema_key:
            if entry[0] == "tensor":
                ptr = next(it)
                if len(entry) == 5:                          # baked shape and stride
                    params.append(ptr.memory.as_strided(entry[3], entry[4]))
                else:
                    sizes = [next(it) for _ in range(entry[2])]
                    strides = [next(it) for _ in range(entry[2])]
                    params.append(ptr.memory.as_strided(sizes, strides))
            elif entry[0] == "scalar_constexpr":
                params.append(entry[3])
            else:
                params.append(next(it))
        _cuda_launch(stream, self.cute_kernel, *params, (gx, gy, gz), self.block)


def _get_compiled_cute_launcher(cute_kernel, schema_key, block, compile_options=None, arch_args=()):
    try:
        compiled_cache = cute_kernel._helion_cute_compiled
    except AttributeError:
        compiled_cache = {}
        cute_kernel._helion_cute_compiled = compiled_cache
    key = (schema_key, block, compile_options)
    if key not in compiled_cache:
        compiled_cache[key] = _CompiledCuteLauncher(cute_kernel, schema_key, block)
    return compiled_cache[key]


def default_cute_launcher(cute_kernel, grid, *args, **kwargs):
    block = kwargs.pop("block", (256, 1, 1))
    cute_compile_options = kwargs.pop("cute_compile_options", None)
    grid_xyz = (int(grid[0]), int(grid[1]) if len(grid) > 1 else 1, int(grid[2]) if len(grid) > 2 else 1)
    block_xyz = (int(block[0]), int(block[1]) if len(block) > 1 else 1, int(block[2]) if len(block) > 2 else 1)
    if any(dim <= 0 for dim in grid_xyz):
        return None
    args_tuple = tuple(args)
    schema_key, launch_args = _build_cached_cute_schema_and_args(cute_kernel, args_tuple, grid_xyz)
    compiled = _get_compiled_cute_launcher(cute_kernel, schema_key, block_xyz, compile_options=cute_compile_options,
                                           arch_args=args_tuple)
    if _RUN["variant"] == "fix":
        return compiled(*launch_args, _cute_current_stream())
    return compiled(*launch_args)                    # the stream is the cached tuple's last element


# ------------------------------------------------------- a Helion kernel (backend="cute") and its generated host code
def compile_rms_norm():
    """``@helion.kernel(backend="cute") def rms_norm(x, weight, out, eps)``: one row per CTA, written into ``out``.
    Returns the generated host function; its CuTe kernel is new (so its launch-arg cache is empty)."""

    def _helion_rms_norm(x, weight, out, eps, grid, block):
        # for tile_m in hl.tile(m): row = x[tile_m, :]; out[tile_m, :] = row * rsqrt(mean(row^2) + eps) * weight
        rows = x[:grid[0]]
        out[:grid[0]].copy_(rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps) * weight)

    def rms_norm(x, weight, out, eps, *, _launcher=default_cute_launcher):
        m, n = x.size()
        _launcher(_helion_rms_norm, (m,), x, weight, out, eps, block=(32, 1, 1))
        return out

    return rms_norm


# ------------------------------------------------------------------------------------------------ the user's model
class DecoderMLPHead:
    """RMSNorm (the Helion kernel, into the layer's own workspace), a SiLU-gated MLP with residual, the LM head."""

    def __init__(self, device):
        gen = generator(2817)
        self.rms_norm = compile_rms_norm()
        self.norm_weight = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.w_gate_up = randn(HIDDEN, 2 * INTER, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.w_down = randn(INTER, HIDDEN, gen=gen, device=device, scale=INTER ** -0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.normed = torch.zeros(BATCH, HIDDEN, device=device)         # the kernel's output workspace

    def forward(self, hidden_states):
        x = self.rms_norm(hidden_states, self.norm_weight, self.normed, EPS)
        gate, up = (x @ self.w_gate_up).chunk(2, -1)
        h = hidden_states + (torch.nn.functional.silu(gate) * up) @ self.w_down
        return h @ self.lm_head


class CUDAGraphRunner:
    """Static input buffer, one graph captured on the first call (after one eager warmup), replayed after."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.static_hidden = torch.zeros(BATCH, HIDDEN, device=device)
        self.graph = self.static_logits = None

    def __call__(self, hidden_states):
        self.static_hidden.copy_(hidden_states)
        if self.graph is None:
            self.graph, self.static_logits = capture(
                lambda: self.model.forward(self.static_hidden), device=self.device, warmups=1,
                name=f"batch {BATCH}", owner="user CUDA-graph runner", static={"hidden_states": self.static_hidden})
        return replay(self.graph, self.static_logits)


def run(variant: str, device: str = "cpu"):
    _RUN["variant"], _RUN["device"] = variant, device
    gen = generator(2516)
    inputs = [torch.randn(BATCH, HIDDEN, generator=gen).to(device) for _ in range(STEPS)]

    def serve(use_cuda_graph: bool):
        model, outs = DecoderMLPHead(device), []
        runner = CUDAGraphRunner(model, device) if use_cuda_graph else None
        for hidden in inputs:
            logits = runner(hidden).clone() if use_cuda_graph else model.forward(hidden)
            outs += [logits, logits.argmax(-1)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
