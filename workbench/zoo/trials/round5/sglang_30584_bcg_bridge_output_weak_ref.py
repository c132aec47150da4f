"""A breakable graph keeps only a weak reference to the eager attention output the next segment reads.

Upstream: https://github.com/sgl-project/sglang/pull/30584 ("Fix diffusion BCG lifetime and add
Z-Image-Turbo CI", merged July 2026), after #27436 had switched ``captured_output`` to a weak reference.
Symptom: diffusion serving with the breakable CUDA graph (``--enable-breakable-cuda-graph``,
Z-Image-Turbo): the first replay segfaults in ``copy_ -> cudaMemcpyAsync`` or hits an illegal memory
access; with ``captured_output = output`` the same generation passes.
Mechanism: BCG captures the DiT forward as graph segments and runs attention eagerly between them
(``@eager_on_graph``): at capture the attention output is allocated outside the segments' pool, the next
segment is captured reading its address, and each replay copies the fresh attention result into it (the
bridge). ``eager_on_graph`` kept that bridge only as a weak-ref tensor (so the pool could reuse
per-layer memory), and once capture returned nothing owned it. Every replay then copies into, and the
next segment reads, memory the allocator has released.
Doctor: dangling-reference, at ``forward`` (of ``ZImageAttention``: the output projection, the first op
of the next segment, reads the released attention output).
Fix (upstream): hold the eager break's output strongly (``captured_output = output``), so the bridge
lives as long as the graph; segment intermediates produced inside the pool may stay weak.
"""
from __future__ import annotations

import contextvars
import weakref

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/30584"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "forward"
SYMPTOM = "replay copies into and reads the released attention output: segfault / illegal memory access"
TOKENS, DIM, BLOCKS, STEPS = 6, 4, 2, 3
VARIANT = contextvars.ContextVar("bcg_variant", default="fix")
_current_capture_var: contextvars.ContextVar = contextvars.ContextVar("bcg_capture", default=None)


class _WeakRefTensor:
    """``weak_ref_tensors(x)``: the same address without owning the storage (on the CPU: a weak
    reference that answers None once the owner lets go)."""

    def __init__(self, t: torch.Tensor):
        self._ref = weakref.ref(t)

    def resolve(self):
        return self._ref()


def _weak_ref_if_tensor(x):
    return _WeakRefTensor(x) if torch.is_tensor(x) else x


def _copy_output(dst, src):
    target = dst.resolve() if isinstance(dst, _WeakRefTensor) else dst
    if target is None:
        # On the GPU this copy goes through the stale address into memory the allocator released
        # (the segfault in cudaMemcpyAsync). Nothing here owns that memory any more: there is nothing
        # to write to, and the next segment finds the address freed.
        return src
    target.copy_(src)
    return target


class BreakableCUDAGraph:
    """One graph per segment plus an eager break function between consecutive segments."""

    def __init__(self):
        self._segments: list = []
        self._break_fns: list = []

    def replay(self):
        for i, segment in enumerate(self._segments):
            segment.replay()
            if i < len(self._break_fns):
                self._break_fns[i]()


class BreakableCUDAGraphCapture:
    """Capture into consecutive segments (one pool); ``eager_on_graph`` functions end one segment, run
    eagerly, and begin the next."""

    def __init__(self, cuda_graph: BreakableCUDAGraph, pool, device, name):
        self.cuda_graph, self.pool, self.device, self.name = cuda_graph, pool, device, name
        self._ctx = None

    def _begin_new_segment(self):
        g = new_graph(self.device)
        self._ctx = graph(g, pool=self.pool, name=f"{self.name} segment {len(self.cuda_graph._segments)}")
        self._ctx.__enter__()
        self.cuda_graph._segments.append(g)

    def _end_current_segment(self):
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)

    def __enter__(self):
        self._token = _current_capture_var.set(self)
        self._begin_new_segment()
        return self

    def __exit__(self, exc_type, exc, tb):
        _current_capture_var.reset(self._token)
        if self._ctx is not None:
            self._ctx.__exit__(exc_type, exc, tb)
        return False


def eager_on_graph(enable: bool):
    def decorator(inner):
        if not enable:
            return inner

        def wrapper(*args, **kwargs):
            capture = _current_capture_var.get()
            if capture is None:
                return inner(*args, **kwargs)
            # End the segment that captured up to this break point.
            capture._end_current_segment()
            # Run the eager function once so it allocates its outputs and writes real data into them.
            output = inner(*args, **kwargs)
            captured_inner = inner
            # Upstream weak-refs the args too: they are blocks of the segments' pool, pinned while the
            # graphs live (one shape here), which a plain reference stands for on the CPU.
            captured_args, captured_kwargs = args, kwargs
            if VARIANT.get() == "bug":
                captured_output = _weak_ref_if_tensor(output)
            else:
                captured_output = output

            def replay_fn():
                new_out = captured_inner(*captured_args, **captured_kwargs)
                return _copy_output(captured_output, new_out)

            capture.cuda_graph._break_fns.append(replay_fn)
            # Start a fresh segment for the remainder of the forward.
            capture._begin_new_segment()
            return output

        return wrapper

    return decorator


@eager_on_graph(True)
def dispatch_attention(q, k, v):
    """The DiT attention (varlen / sequence-parallel in the real model): stays eager under BCG."""
    scores = q @ k.transpose(0, 1) / DIM ** 0.5
    return torch.softmax(scores, -1) @ v


class ZImageAttention:
    def __init__(self, gen, device):
        self.to_qkv = randn(DIM, 3 * DIM, gen=gen, device=device, scale=0.5)
        self.to_out = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, hidden_states):
        q, k, v = (hidden_states @ self.to_qkv).split(DIM, dim=-1)
        attn_output = dispatch_attention(q, k, v)
        return attn_output @ self.to_out


class ZImageTransformerBlock:
    def __init__(self, gen, device):
        self.attention = ZImageAttention(gen, device)
        self.adaln = randn(DIM, 2 * DIM, gen=gen, device=device, scale=0.3)
        self.ff = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, x, temb):
        scale, gate = (temb @ self.adaln).split(DIM, dim=-1)
        x = x + gate * self.attention.forward(torch.nn.functional.layer_norm(x, (DIM,)) * (1 + scale))
        return x + torch.tanh(x @ self.ff)


class ZImageTransformer2DModel:
    def __init__(self, device):
        gen = generator(30584)
        self.layers = [ZImageTransformerBlock(gen, device) for _ in range(BLOCKS)]
        self.t_embedder = randn(1, DIM, gen=gen, device=device)
        self.proj_out = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, hidden_states, timestep):
        temb = torch.sin(timestep[:, None] * self.t_embedder)
        x = hidden_states
        for layer in self.layers:
            x = layer.forward(x, temb)
        return x @ self.proj_out


class _Entry:
    def __init__(self, static_kwargs, graph_, output):
        self.static_kwargs, self.graph, self.output = static_kwargs, graph_, output


class BreakableCudaGraphRunner:
    """The diffusion BCG runner: capture per input signature at warmup, replay (or eager) when serving."""

    def __init__(self, transformer, device):
        self.transformer, self.device = transformer, device
        self._pool = graph_pool_handle(device)
        self._entries: dict = {}

    @staticmethod
    def _signature(kwargs):
        return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(kwargs.items()))

    def capture(self, **kwargs):
        static = {k: v.clone() for k, v in kwargs.items()}                   # persistent static leaves
        events.static_buffers("BreakableCudaGraphRunner", static)
        for _ in range(2):                                                    # cuBLAS/JIT workspaces first
            with events.warmup():
                self.transformer.forward(**static)
        bcg = BreakableCUDAGraph()
        with BreakableCUDAGraphCapture(bcg, self._pool, self.device, "DiT"):
            output = self.transformer.forward(**static)
        self._entries[self._signature(kwargs)] = _Entry(static, bcg, output)

    def __call__(self, **kwargs):
        entry = self._entries.get(self._signature(kwargs))
        if entry is None:                                                     # signature miss: eager
            return self.transformer.forward(**kwargs)
        for name, live in kwargs.items():
            entry.static_kwargs[name].copy_(live)
        segments = tuple(entry.graph._segments)
        rows = entry.output.shape[0]
        events.serve(segments[0], rows, rows, outputs=entry.output, pieces=segments,
                     eager=lambda: self.transformer.forward(**entry.static_kwargs))
        entry.graph.replay()
        out = entry.output.view_as(entry.output)
        events.handed_out(segments[-1], out)
        return out.clone()                                                    # the other CFG branch reuses it


def run(variant: str, device: str = "cpu"):
    transformer = ZImageTransformer2DModel(device)
    gen = generator(1)
    latents0 = randn(TOKENS, DIM, gen=gen, device=device)
    timesteps = [torch.full((TOKENS,), 1.0 - i / STEPS, device=device) for i in range(STEPS)]

    def denoise(model_call):
        latents, preds = latents0.clone(), []
        for t in timesteps:
            noise_pred = model_call(hidden_states=latents, timestep=t)
            preds.append(noise_pred)
            latents = latents - noise_pred / STEPS                            # scheduler.step
        return preds + [latents]

    def eager():
        return denoise(transformer.forward)

    def served():
        token = VARIANT.set(variant)
        try:
            with torch.no_grad():
                runner = BreakableCudaGraphRunner(transformer, device)
                runner.capture(hidden_states=torch.zeros(TOKENS, DIM, device=device),   # warmup request
                               timestep=torch.ones(TOKENS, device=device))
                return denoise(runner)
        finally:
            VARIANT.reset(token)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
