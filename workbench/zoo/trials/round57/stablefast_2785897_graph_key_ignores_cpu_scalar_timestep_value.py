"""stable-fast's dynamic graph cache keys a CPU scalar tensor by shape only: every timestep replays the first one's graph.

Upstream: https://github.com/chengzeyi/stable-fast/commit/2785897ab8964f02655d330da60f8509938ded18 ("add more fuse
patterns & use flat_tensors", a mixed commit on the default branch, November 2023; no PR, no issue). Diff read
(``sfast/cuda/graphs.py``: the ``hash_arg`` hunk; the rest of the file and ``sfast/jit/trace_helper.py`` at that commit).
Symptom: not reported (the commit message does not mention it). From the code: a graphed denoiser called in a loop
with its timestep as a 0-dim CPU tensor (``scheduler.set_timesteps(n)`` with no device keeps ``timesteps`` on the
CPU; after this commit every number a traced module receives also travels as a one-element CPU tensor) denoises
every step at the first step's timestep: wrong latents, a blurred or noisy image, and no error.
Mechanism: ``make_dynamic_graphed_callable`` keeps one graphed callable per ``key = (hash_arg(args),
hash_arg(kwargs))``; a new key goes through ``simple_make_graphed_callable`` -> ``make_graphed_callable``, which runs 3
warmups, copies the example inputs into ``static_inputs`` and captures ``static_outputs = callable(*static_inputs,
**static_kwarg_inputs)`` into the env's mempool. ``_GraphedModule._forward`` then does ``tree_copy_(static_inputs,
inputs)``, ``fwd_graph.replay()``, ``return static_outputs``. Before the fix ``hash_arg(tensor)`` was ``(device.type,
device.index, dtype, shape)``: every step's 0-dim CPU ``timestep`` has the same key, so steps 2.. reuse the graph
captured at step 1. A 0-dim CPU tensor given to a CUDA kernel is a wrapped scalar passed by value: its capture-time
value is baked into the kernel's arguments, and ``tree_copy_`` writing the new timestep into the static CPU tensor
does not reach the replayed kernels (here the sinusoidal time projection ``freqs * timestep``).
Doctor: host-work-frozen, at ``hash_arg`` (the key cannot tell two timesteps apart, so a replay serves a step whose
host scalar was read once, at capture, and keeps its capture-time value).
Fix (upstream): ``hash_arg`` adds ``arg.item() if arg_device_type == 'cpu' and arg.numel() == 1 else None`` to a
tensor's key, so each distinct CPU scalar value gets its own captured graph (later images replay them).
(The CPU timesteps are ``host()`` memory, CUDA's host memory; the static copies are stable-fast's ``tree_copy``
(``clone``) rather than ``copy.deepcopy``, which the CPU emulation's host tensors do not support. stable-fast's own
SD compiler moves the UNet's ``t`` to the device first; the model is a denoiser graphed with
``make_dynamic_graphed_callable`` directly. Eager is the module called directly.)
"""
from __future__ import annotations

import functools
import threading

import torch

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/chengzeyi/stable-fast/commit/2785897ab8964f02655d330da60f8509938ded18"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "hash_arg"
SYMPTOM = "every denoising step replays the graph captured at the first timestep (schedule frozen, wrong latents)"

CHANNELS, HIDDEN, FREQS, TOKENS, CTX = 4, 8, 4, 3, 5
STEPS = 4


class UNet2DConditionModel(torch.nn.Module):
    """A miniature denoiser: time projection of a scalar timestep, a conditioned block, an output projection."""

    def __init__(self, device):
        super().__init__()
        gen = generator(2785)
        self.freqs = torch.exp(-torch.arange(FREQS, dtype=torch.float32) * 2.3 / FREQS).to(device) * 0.01
        self.linear_1 = randn(2 * FREQS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.conv_in = randn(CHANNELS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.to_k = randn(CTX, HIDDEN, gen=gen, device=device, scale=0.3)
        self.conv_out = randn(HIDDEN, CHANNELS, gen=gen, device=device, scale=0.5)

    def forward(self, sample, timestep, encoder_hidden_states):
        # Timesteps: a 0-dim CPU timestep enters the kernels as a wrapped scalar, passed by value
        args = self.freqs * timestep
        temb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1) @ self.linear_1
        ctx = (encoder_hidden_states @ self.to_k).mean(dim=0)
        h = torch.nn.functional.silu(sample @ self.conv_in + temb + ctx)
        return (h @ self.conv_out,)


def hash_arg(arg, variant):
    if isinstance(arg, torch.Tensor):
        arg_device = arg.device
        if variant == "bug":
            return (arg_device.type, arg_device.index, arg.dtype, arg.shape)
        arg_device_type = arg_device.type
        return (arg_device_type, arg_device.index, arg.dtype, arg.shape,
                arg.item()
                if arg_device_type == 'cpu' and arg.numel() == 1 else None)
    if isinstance(arg, (int, float, bool, str, bytes)):
        return arg
    if isinstance(arg, (tuple, list)):
        return tuple(hash_arg(a, variant) for a in arg)
    if isinstance(arg, dict):
        return tuple(sorted(((k, hash_arg(v, variant)) for k, v in arg.items()), key=lambda x: x[0]))
    return None


def tree_copy_(dest, src):
    if isinstance(dest, torch.Tensor):
        dest.copy_(src)
    elif isinstance(dest, (list, tuple)):
        for x, y in zip(dest, src):
            tree_copy_(x, y)
    elif isinstance(dest, dict):
        for k in dest:
            tree_copy_(dest[k], src[k])
    else:
        assert dest == src


def tree_copy(src):
    if isinstance(src, torch.Tensor):
        return src.clone()
    if isinstance(src, (list, tuple)):
        return type(src)(tree_copy(x) for x in src)
    if isinstance(src, dict):
        return {k: tree_copy(v) for k, v in src.items()}
    return src


def tensors_of(tree, prefix):
    """The tensors the graph reads from its static inputs (announced as static buffers)."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, x in enumerate(tree) for k, v in tensors_of(x, f"{prefix}[{i}]").items()}
    if isinstance(tree, dict):
        return {k: v for n, x in tree.items() for k, v in tensors_of(x, f"{prefix}[{n}]").items()}
    return {}


class GraphExecutionEnv:
    def __init__(self, *, mempool, device):
        self.mempool, self.device, self.lock = mempool, device, threading.Lock()


def make_graphed_callable(callable, example_inputs, example_kwarg_inputs, *, execution_env):
    static_inputs = tree_copy(example_inputs)
    static_kwarg_inputs = tree_copy(example_kwarg_inputs)
    # Warmup (3 calls), then capture into the per-device mempool.
    fwd_graph, static_outputs = capture(
        lambda: callable(*static_inputs, **static_kwarg_inputs), device=execution_env.device,
        pool=execution_env.mempool, warmups=3, name="sfast fwd_graph", owner="sfast make_graphed_callable",
        static={**tensors_of(static_inputs, "args"), **tensors_of(static_kwarg_inputs, "kwargs")})

    class _GraphedModule(torch.nn.Module):
        def forward(self, *inputs, **kwarg_inputs):
            with execution_env.lock:
                outputs = self._forward(*inputs, **kwarg_inputs)
                return tree_copy(outputs)

        def _forward(self, *inputs, **kwarg_inputs):
            tree_copy_(static_inputs, inputs)
            tree_copy_(static_kwarg_inputs, kwarg_inputs)
            return replay(fwd_graph, static_outputs)

    return _GraphedModule()


def make_dynamic_graphed_callable(callable, variant, execution_env):
    lock = threading.Lock()
    cached_callables = {}

    @functools.wraps(callable)
    def dynamic_graphed_callable(*args, **kwargs):
        key = (hash_arg(args, variant), hash_arg(kwargs, variant))
        cached_callable = cached_callables.get(key)
        if cached_callable is None:
            with lock:
                cached_callable = cached_callables.get(key)
                if cached_callable is None:
                    cached_callable = make_graphed_callable(callable, args, kwargs, execution_env=execution_env)
                    cached_callables[key] = cached_callable
        return cached_callable(*args, **kwargs)

    dynamic_graphed_callable._cached = cached_callables
    return dynamic_graphed_callable


class EulerDiscreteScheduler:
    """``set_timesteps(n)`` without a device: ``timesteps`` stays in host memory; sigmas are Python numbers."""

    def __init__(self, device):
        self.timesteps = host(torch.linspace(999.0, 0.0, STEPS), device)
        self.sigmas = [float(s) for s in torch.linspace(1.0, 0.0, STEPS + 1)]

    def step(self, model_output, i, sample):
        return sample + (self.sigmas[i + 1] - self.sigmas[i]) * model_output


def run(variant: str, device: str = "cpu"):
    unet = UNet2DConditionModel(device)
    gen = generator(27851)
    images = [randn(TOKENS, CHANNELS, gen=gen, device=device) for _ in range(2)]
    prompt_embeds = randn(2, CTX, gen=gen, device=device)

    def serve(graphed: bool):
        env = GraphExecutionEnv(mempool=graph_pool_handle(device), device=device)
        fn = make_dynamic_graphed_callable(unet, variant, env) if graphed else unet
        scheduler = EulerDiscreteScheduler(device)
        outs = []
        with torch.no_grad():
            for latents in images:                       # two images: the second replays every captured step
                for i, t in enumerate(scheduler.timesteps):
                    noise_pred = fn(latents, t, prompt_embeds)[0]
                    latents = scheduler.step(noise_pred, i, latents)
                    outs.append(latents.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
