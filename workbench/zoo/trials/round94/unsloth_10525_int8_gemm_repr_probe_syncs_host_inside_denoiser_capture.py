"""Unsloth Studio's int8 diffusion transformer cannot be CUDA-graph captured: torchao's int8 GEMM (``safe_int_mm``) asks whether its input is a FakeTensor by formatting the input's repr, which reads the values back to the host inside the capture.

Upstream: https://github.com/unslothai/unsloth/pull/10525 ("Studio: keep torchao quantisation from mutating inductor
config, and make its int8 GEMM capture-safe", unslothai/unsloth, merged 2026-09-08). Read: the PR description (fix 1,
torchao's ``set_inductor_config`` churn, in full; fix 2 through its title and the summary in the follow-up PR 10537,
"the ``repr`` probe in ``safe_int_mm`` that synced the device on every call"), the torchao issue the PR's author filed
the same day (pytorch/ao#4872, "safe_int_mm's FakeTensor probe via input.__repr__() syncs the device on every eager int8
matmul and breaks CUDA graph capture": the probe line, the two consequences, the repro with three side-stream warmups
then ``torch.cuda.graph``), a stored post-fix version of Studio's patch
``studio/backend/core/inference/diffusion_torchao_patches.py`` (``_is_fake_tensor``, ``_make_safe_int_mm``: torchao's
``safe_int_mm`` body with only the probe replaced, ``_patch_torchao_intmm_module``) and its test file, torchao's own
``safe_int_mm`` / ``_int_scaled_matmul`` (``torchao/quantization/quantize_/workflows/int8/kernels.py``) and the
``Int8Tensor`` linear that calls them (``int8_tensor.py``), and Studio's capture runner ``GraphedForward``
(``diffusion_cuda_graph.py``, from PR 10537). The PR's diff was not read: the stored patch file may be a later home of
the same fix (its docstring names ``unsloth/import_fixes.py::fix_torchao_safe_int_mm_repr_probe`` as the canonical copy).
Symptom: with the torchao int8 transformer (``Int8DynamicActivationInt8WeightConfig``), capturing the denoiser forward
into a CUDA graph fails with ``cudaErrorStreamCaptureUnsupported`` ("operation failed due to a previous error during
capture"), so the int8 path never gets a graph; eagerly, every int8 linear pays a device sync.
Mechanism: ``safe_int_mm`` first decides whether it is being traced: ``dynamo_is_compiling() or "FakeTensor" in
input.__repr__()``. On a real device tensor ``Tensor.__repr__`` formats the element values, i.e. copies them to the
host (``.item()``): a host synchronisation. Eagerly that is only slow; inside ``torch.cuda.graph`` the capturing stream
refuses it and the capture is invalidated. The warmups before capture run the same probe without complaint.
Doctor: sync-in-capture, at safe_int_mm. A host synchronisation (the repr's read of the int8 activation values) is
attempted while the denoiser forward is being captured.
Fix (upstream): replace the string probe with the question it approximated, ``_is_fake_tensor(input)``
(``torch._subclasses.fake_tensor.is_fake``, ``isinstance(x, FakeTensor)`` as fallback); the rest of ``safe_int_mm`` is
torchao's body unchanged. Studio installs the copy over torchao's ``safe_int_mm`` at import.
Modelled: ``safe_int_mm`` (torchao's body: the compile-path probe, the device / cuBLAS-dimension checks, the int32
fallback, the contiguity fixes; ``torch._int_mm`` stands for ``out_dtype(aten.mm, int32)``, and the host-tensor check
asks ``is_host`` because the emulated CPU device stands for the GPU), ``_int_scaled_matmul``
(its device path, which calls ``safe_int_mm``; torchao's separate CPU kernel is left out because the emulated CPU
device stands for the GPU), the ``Int8Tensor`` linear (per-token symmetric int8 activations, per-channel int8 weights,
``x_vals_int8 @ w_vals_int8_t`` rescaled), ``_is_fake_tensor`` and ``GraphedForward`` (instance ``forward`` slot,
``graph_key`` on shapes, static input buffers copied in, 3 warmups, capture, replay, outputs cloned). The DiT is a
stand-in: timestep sinusoid + MLP, one adaLN block whose feed-forward is two int8 linears (hidden 16, ffn 32), float32;
the pipeline is a flow-matching Euler loop of 4 steps over 32 latent tokens. ``GraphedForward``'s poison-to-eager
fallback (which hides a failed capture by running eager for the rest of the load) is left out: the capture error
surfaces as in the torchao issue's repro and in the measurement that found the bug.
Workload: one 4-step render, batch 1, 32 tokens of 8 channels; the first denoiser call warms up and captures, the rest
replay. The bug raises CaptureError at the capture (a host synchronisation in ``Tensor.__repr__``; on CUDA the
capture is invalidated, cudaErrorStreamCaptureUnsupported); the fix captures, replays 3 times and equals eager on every
step's velocity and on the final latents (max error 0).
"""
from __future__ import annotations

import math

import torch

from workbench.engine import is_host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/unslothai/unsloth/pull/10525"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "safe_int_mm"
SYMPTOM = ("Unsloth Studio's torchao int8 diffusion transformer cannot be CUDA-graph captured: safe_int_mm probes for "
           "FakeTensors with input.__repr__(), which copies the int8 activations to the host inside the capture "
           "(cudaErrorStreamCaptureUnsupported); eagerly every int8 linear pays a device sync")

IN_CH, HIDDEN, FFN, TOKENS = 8, 16, 32, 32
NUM_STEPS = 4
WARMUP_ITERS = 3

_variant = "bug"


# --- torchao/quantization/quantize_/workflows/int8/kernels.py ----------------------------------------------------------

def dynamo_is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _is_fake_tensor(x) -> bool:
    """Exactly what the "FakeTensor" substring probe was trying to answer (Studio's patch)."""
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:
        is_fake = None
    if is_fake is not None:
        return bool(is_fake(x))
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return False
    return isinstance(x, FakeTensor)


def _probe_is_fake(input: torch.Tensor) -> bool:
    if _variant == "fix":
        return _is_fake_tensor(input)
    return "FakeTensor" in input.__repr__()


def safe_int_mm(input: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    # torch.compile path
    if dynamo_is_compiling() or _probe_is_fake(input):
        return torch._int_mm(input, mat2)

    # error checking for cublas path
    assert mat2.device == input.device, (
        f"need both tensors to be on the same device but got {mat2.device} and {input.device}")
    device_cpu = is_host(mat2) or is_host(input)     # torchao: "cpu" in [mat2.device.type, input.device.type]
    # with input.shape = [i,j] and mat2.shape = [j,k]
    j_is_nonzero_multiple_of_8 = (input.shape[1] % 8 == 0) and (input.shape[1] > 0)
    k_is_nonzero_multiple_of_8 = (mat2.shape[1] % 8 == 0) and (mat2.shape[1] > 0)
    bad_dimensions_for_cublas = not (j_is_nonzero_multiple_of_8 and k_is_nonzero_multiple_of_8)

    if device_cpu or bad_dimensions_for_cublas:
        # fallback path
        return torch.matmul(input.cpu().to(torch.int32), mat2.cpu().to(torch.int32)).to(input.device.type)

    # cublas paths
    if not mat2.is_contiguous():  # silently gives incorrect result without this
        mat2 = mat2.contiguous()
    if (not input.is_contiguous()) and (input.shape[0] % 8 != 0):  # gives cryptic error without this
        input = input.contiguous()
    return torch._int_mm(input, mat2)


def _int_scaled_matmul(a: torch.Tensor, b: torch.Tensor, scales1: torch.Tensor) -> torch.Tensor:
    M, _ = a.shape
    assert scales1.dim() == 2
    assert M == scales1.size(0) or scales1.numel() == 1
    assert 1 == scales1.size(1)
    assert scales1.is_contiguous()
    c = safe_int_mm(a, b)
    return c * scales1


# --- torchao Int8Tensor linear (int8 dynamic activation, int8 weight) ---------------------------------------------------

def _int8_symm_per_token_quant(x: torch.Tensor):
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / 127.0
    qdata = torch.round(x / scale).clamp(-128, 127).to(torch.int8)
    return qdata, scale


class Int8Linear:
    """A Linear after ``quantize_(..., Int8DynamicActivationInt8WeightConfig())``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        w_scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / 127.0      # per output channel
        self.qdata = torch.round(weight / w_scale).clamp(-128, 127).to(torch.int8)   # [N, K]
        self.scale = w_scale.flatten()
        self.bias = bias

    def __call__(self, activation_tensor: torch.Tensor) -> torch.Tensor:
        x_vals_int8, x_scales = _int8_symm_per_token_quant(activation_tensor)
        w_vals_int8_t = self.qdata.contiguous().t()
        tmp = x_vals_int8.reshape(-1, x_vals_int8.shape[-1])
        y_dot_scaled = _int_scaled_matmul(tmp, w_vals_int8_t, x_scales.reshape(-1, 1))
        y = (y_dot_scaled * self.scale).reshape(*x_vals_int8.shape[:-1], y_dot_scaled.shape[-1])
        return y + self.bias


# --- the denoiser (stand-in DiT) ---------------------------------------------------------------------------------------

class Transformer2DModel:
    def __init__(self, device: str):
        gen = generator(10525)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale)
        self.proj_in_w, self.proj_in_b = r(IN_CH, HIDDEN), r(HIDDEN, scale=0.1)
        self.t_w1, self.t_w2 = r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.ada_w = r(HIDDEN, 3 * HIDDEN, scale=0.2)
        self.ff1 = Int8Linear(r(FFN, HIDDEN, scale=0.4), r(FFN, scale=0.1))      # quantised feed-forward
        self.ff2 = Int8Linear(r(HIDDEN, FFN, scale=0.4), r(HIDDEN, scale=0.1))
        self.proj_out_w = r(HIDDEN, IN_CH)

    def time_proj(self, timestep: torch.Tensor) -> torch.Tensor:
        half = HIDDEN // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=timestep.device,
                                                            dtype=torch.float32) / half)
        args = timestep[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = True):
        x = hidden_states @ self.proj_in_w + self.proj_in_b                    # [B, T, H]
        temb = torch.nn.functional.silu(self.time_proj(timestep) @ self.t_w1) @ self.t_w2
        shift, scale, gate = (torch.nn.functional.silu(temb) @ self.ada_w).chunk(3, dim=-1)
        h = torch.nn.functional.layer_norm(x, (HIDDEN,)) * (1 + scale[:, None]) + shift[:, None]
        h = self.ff2(torch.nn.functional.gelu(self.ff1(h)))
        x = x + gate[:, None] * h
        sample = x @ self.proj_out_w
        if not return_dict:
            return (sample,)
        return {"sample": sample}

    def __call__(self, *args, **kwargs):
        fwd = self.__dict__.get("forward")                                   # an installed GraphedForward
        return fwd(*args, **kwargs) if fwd is not None else self.forward(*args, **kwargs)


# --- studio/backend/core/inference/diffusion_cuda_graph.py -------------------------------------------------------------

def _flatten(obj, out: list):
    if torch.is_tensor(obj):
        out.append(obj)
        return ("t", len(out) - 1)
    if isinstance(obj, (list, tuple)):
        return ("l", isinstance(obj, tuple), [_flatten(o, out) for o in obj])
    if isinstance(obj, dict):
        return ("d", [(k, _flatten(v, out)) for k, v in obj.items()])
    return ("v", obj)


def _rebuild(spec, tensors: list):
    kind = spec[0]
    if kind == "t":
        return tensors[spec[1]]
    if kind == "l":
        values = [_rebuild(s, tensors) for s in spec[2]]
        return tuple(values) if spec[1] else values
    if kind == "d":
        return {k: _rebuild(s, tensors) for k, s in spec[1]}
    return spec[1]


def graph_key(obj):
    if torch.is_tensor(obj):
        return ("t", tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.device.type)
    if isinstance(obj, (list, tuple)):
        return ("l", isinstance(obj, tuple), tuple(graph_key(o) for o in obj))
    if isinstance(obj, dict):
        return ("d", tuple((k, graph_key(v)) for k, v in obj.items()))
    return ("v", obj)


class _Entry:
    __slots__ = ("graph", "in_spec", "out_spec", "out_tensors", "static")


class GraphedForward:
    """Replaces one denoiser module's ``forward`` with a CUDA-graph replay (first call of a key captures)."""

    def __init__(self, module: Transformer2DModel, device: str, warmup: int = WARMUP_ITERS):
        self.module, self.device = module, device
        self.orig = type(module).forward.__get__(module)
        self.warmup = warmup
        self.cache: dict = {}

    def install(self) -> GraphedForward:
        self.module.__dict__["forward"] = self
        return self

    def __call__(self, *args, **kwargs):
        if kwargs.get("return_dict", True) is not False:
            return self.orig(*args, **kwargs)
        key = graph_key((args, kwargs))
        entry = self.cache.get(key)
        if entry is None:
            entry = self.cache[key] = self._capture(args, kwargs)
        live: list = []
        _flatten((args, kwargs), live)
        for dst, src in zip(entry.static, live):
            dst.copy_(src)
        served = replay(entry.graph, tuple(entry.out_tensors))
        # Cloned: every replay writes the SAME buffers, which the pipeline holds across steps.
        return _rebuild(entry.out_spec, [t.clone() for t in served])

    def _capture(self, args: tuple, kwargs: dict) -> _Entry:
        entry = _Entry()
        live: list = []
        entry.in_spec = _flatten((args, kwargs), live)
        entry.static = [torch.empty_like(t) for t in live]
        for dst, src in zip(entry.static, live):
            dst.copy_(src)
        static_args, static_kwargs = _rebuild(entry.in_spec, entry.static)
        entry.graph, out = capture(lambda: self.orig(*static_args, **static_kwargs), device=self.device,
                                   warmups=self.warmup, name="denoiser forward", owner="GraphedForward",
                                   static={f"static[{i}]": t for i, t in enumerate(entry.static)})
        out_tensors: list = []
        entry.out_spec = _flatten(out, out_tensors)
        entry.out_tensors = out_tensors
        return entry


# --- the render -------------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graph: bool):
        transformer = Transformer2DModel(device)
        if use_cuda_graph:
            GraphedForward(transformer, device).install()        # install_cuda_graphs: first step captures
        gen = generator(105250)
        latents = randn(1, TOKENS, IN_CH, gen=gen, device=device)
        sigmas = torch.linspace(1.0, 0.0, NUM_STEPS + 1)
        outs = []
        with torch.no_grad():
            for i in range(NUM_STEPS):                           # FlowMatchEulerDiscrete stand-in
                timestep = torch.full((latents.shape[0],), float(sigmas[i]) * 1000.0).to(device)
                velocity = transformer(latents, timestep=timestep, return_dict=False)[0]
                latents = latents + float(sigmas[i + 1] - sigmas[i]) * velocity
                outs.append(velocity)
        return outs + [latents]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
