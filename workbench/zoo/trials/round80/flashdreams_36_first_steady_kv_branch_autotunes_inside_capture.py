"""flashdreams hands the AR step at which the KV cache *fills* to the CUDA-graph path, so the first steady-state call (a branch never compiled) lands on the capture and Inductor's lazy autotune synchronizes inside it.

Upstream: https://github.com/NVIDIA/flashdreams/pull/36 ("Fix CUDA graph capture crash at the first steady-state AR
step", opened and merged 2026-05-01).
Symptom: an ``alpadreams`` rollout (``compile_network=True``, ``use_cuda_graph=True``, the config's defaults)
crashes on the first AR step whose KV cache is already full at forward time (AR 3 in the repro):
``triton_poi_fused_copy_slice_0 ... benchmark_gpu ... torch.cuda.synchronize()`` -> ``torch.AcceleratorError: CUDA
error: operation not permitted when stream is capturing (cudaErrorStreamCaptureUnsupported)``. With
``use_cuda_graph=False`` the same rollout runs.
Mechanism: ``BlockKVCache`` has two code paths. While filling, ``update`` runs ``_append_to_end`` and
``cached_k``/``cached_v`` return a slice of the valid prefix. Once ``before_update`` (called by
``CosmosTransformerCache.start`` at the AR-step boundary) sees ``is_steady_state() == True``, the cache runs
``_roll_local_window_left``, ``update`` runs ``_overwrite_rightmost_steady`` and ``cached_k``/``cached_v`` return the
full buffer. ``torch.compile`` (``mode="max-autotune-no-cudagraphs"``) traces each branch lazily on its first call:
Dynamo's guards on the cache fail, it recompiles, and Inductor autotunes the new Triton kernels on their first
launch (``benchmark_gpu`` calls ``torch.cuda.synchronize()``). ``CosmosTransformer.predict_flow`` dispatches per AR
step: ``CUDAGraphWrapper.drain`` (eager, through the static buffers, no capture) while ``ar_idx <
config._steady_ar_idx``, else the wrapper's ``__call__`` (``warmup_iters`` eager calls, then capture into
``torch.cuda.graph``, then replays). ``CosmosTransformerConfig.__post_init__`` set ``_steady_ar_idx = chunks_total //
_pT - 1``, the step at which the cache *fills*, on the reasoning that its ``cached_k()`` already has the full
length. But that step still takes the filling branch (``_n_cached`` reaches the buffer size only in its
``after_update``). So the filling step's denoising calls use up both warmups, and the first call that takes the
steady branch (AR 3) is the capture call: its Dynamo recompile and Inductor autotune run inside
``torch.cuda.graph(...)``, and the synchronize is refused. In eager mode the same autotune runs outside any capture.
Doctor: sync-in-capture, at __post_init__. A host synchronisation (the autotuner's ``torch.cuda.synchronize()``)
is attempted while the wrapper's capture is open: the captured call is the first one ever to take the KV cache's
steady branch, because the drain/graph boundary computed in ``CosmosTransformerConfig.__post_init__``
(``_steady_ar_idx``) hands the last *filling* step to the graph path, whose warmups that step consumes. The bug
lives in ``__post_init__``: the fix changed only that line.
Fix (upstream): ``self._steady_ar_idx = chunks_total // self._pT`` (the ``- 1`` dropped in the Cosmos config; the
Wan 2.1 and Cosmos-H configs carry the same line at HEAD): the filling step is drained eagerly, the first steady-state
step's calls are the wrapper's warmups (the steady branch compiles and autotunes there, eagerly), and the capture
at the next step finds every kernel already tuned. (The pre-fix and post-fix transformer files, the wrapper and
``BlockKVCache`` were read in the stored index; the PR body gives the traceback.)
Modelled: one view, one DiT block with one self-attention ``BlockKVCache`` (sink 0, window 3 chunks, one latent
frame per AR chunk, 2 tokens per chunk), a 2-step Euler denoiser per AR step (2 ``predict_flow`` calls, as in the
``2steps`` config), 6 AR steps. ``torch.compile`` is reduced to what matters here: one compiled entry per guard set
(the input shapes and the cache's fill state, which the branches read), and a new entry's Triton kernel autotunes
on its first launch, timing two configs with ``benchmark_gpu`` (configs change no value). Each run builds its own
transformer (a fresh process: no warm compile cache). HDMap conditioning, image injection at AR 0, masks,
AdaLN, cross-attention, context parallelism, CFG and the VAE are left out.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.engine import events, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/flashdreams/pull/36"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "__post_init__"
SYMPTOM = ("the rollout crashes at the first steady-state AR step (cudaErrorStreamCaptureUnsupported): the KV "
           "cache's steady branch is first compiled and autotuned inside the CUDA-graph capture")

TOKENS_PER_FRAME = 2            # _pH * _pW after patchify (one view)
DIM = 4                         # patchified latent channels
MODEL_CHANNELS = 8
NUM_AR_STEPS = 6
DENOISE_TIMESTEPS = (1.0, 0.5)  # the "2steps" sampler: 2 predict_flow calls per AR step


# --- torch.compile / Inductor, reduced ---------------------------------------------------------------------

def benchmark_gpu(kernel: Callable, config: dict, args, kwargs, device: str) -> float:
    """Inductor's ``benchmark_gpu`` (``do_bench``): launch the kernel with one config and time it; the timer waits
    for the device with ``torch.cuda.synchronize()``, which a capturing stream refuses."""
    kernel(*args, **kwargs)
    synchronize(device)
    return float(config["XBLOCK"])          # stands for the measured time (deterministic)


class CachingAutotuner:
    """Inductor's ``CachingAutotuner`` for a compiled entry's Triton kernels (``triton_poi_fused_copy_slice_0``):
    on the first launch ``benchmark_all_configs`` times every config and keeps the fastest."""

    configs = ({"XBLOCK": 128}, {"XBLOCK": 64})

    def __init__(self, kernel: Callable, device: str):
        self.kernel, self.device, self.best = kernel, device, None

    def run(self, *args, **kwargs):
        if self.best is None:
            timings = [benchmark_gpu(self.kernel, cfg, args, kwargs, self.device) for cfg in self.configs]
            self.best = self.configs[timings.index(min(timings))]
        return self.kernel(*args, **kwargs)


class OptimizedModule:
    """``torch.compile(network, mode="max-autotune-no-cudagraphs")``: Dynamo keeps one compiled entry per guard
    set; a call that fails every guard (a new input shape, the KV cache in another fill state, so another Python
    branch) traces a new entry, whose kernels autotune on their first launch."""

    def __init__(self, module, device: str):
        self._orig_mod, self.device = module, device
        self._entries: dict[tuple, CachingAutotuner] = {}

    @staticmethod
    def _guards(args, kwargs) -> tuple:
        shapes = tuple(tuple(v.shape) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        cache = kwargs["cache"]
        fill_state = tuple((blk.is_steady_state(), blk._n_cached, blk._curr_chunk_idx == blk._prev_chunk_idx + 1)
                           for blk in cache.self_attn)
        return shapes, fill_state

    def __call__(self, *args, **kwargs):
        guards = self._guards(args, kwargs)
        if guards not in self._entries:      # recompile: trace this branch, generate its Triton kernels
            self._entries[guards] = CachingAutotuner(self._orig_mod.forward, self.device)
        return self._entries[guards].run(*args, **kwargs)


# --- flashdreams/core/.../kv_cache.py: BlockKVCache (sink_size == 0, chunk-aligned) -------------------------

class BlockKVCache:
    """KV cache for causal attention with a fixed-size local window. Filling: tokens written contiguously,
    ``cached_k()`` returns the valid prefix. Steady state: each new chunk rolls the window left and overwrites
    the rightmost positions, ``cached_k()`` returns the full buffer."""

    def __init__(self, k_shape, v_shape, seq_dim, chunk_size, window_size, sink_size=0, device="cpu",
                 dtype=torch.float32):
        self.k_shape, self.v_shape, self.seq_dim = tuple(k_shape), tuple(v_shape), seq_dim
        self.chunk_size, self.window_size, self.sink_size = chunk_size, window_size, sink_size
        self._prev_chunk_idx = -1
        self._curr_chunk_idx: int | None = None
        self._n_cached = 0
        assert self.k_shape[seq_dim] == sink_size + window_size
        self._k = torch.empty(self.k_shape, device=device, dtype=dtype)
        self._v = torch.empty(self.v_shape, device=device, dtype=dtype)

    def _seq_slice(self, start, end):
        idx: list = [slice(None)] * len(self.k_shape)
        idx[self.seq_dim] = slice(start, end)
        return tuple(idx)

    def _roll_local_window_left(self) -> None:
        total_size = self._k.shape[self.seq_dim]
        tokens_to_keep = self.window_size - self.chunk_size
        if tokens_to_keep > 0:
            dst = self._seq_slice(self.sink_size, self.sink_size + tokens_to_keep)
            src = self._seq_slice(self.sink_size + self.chunk_size, total_size)
            self._k[dst] = self._k[src].clone()
            self._v[dst] = self._v[src].clone()

    def _overwrite_rightmost_steady(self, k, v) -> None:
        total_size = self._k.shape[self.seq_dim]
        sl = self._seq_slice(total_size - self.chunk_size, total_size)
        self._k[sl] = k
        self._v[sl] = v

    def _overwrite_rightmost_filling(self, k, v) -> None:
        sl = self._seq_slice(self._n_cached - self.chunk_size, self._n_cached)
        self._k[sl] = k
        self._v[sl] = v

    def _append_to_end(self, k, v) -> None:
        sl = self._seq_slice(self._n_cached, self._n_cached + self.chunk_size)
        self._k[sl] = k
        self._v[sl] = v

    def is_steady_state(self) -> bool:
        assert self._curr_chunk_idx is not None, "Must call before_update() before is_steady_state()"
        return self._k.shape[self.seq_dim] == self._n_cached

    def before_update(self, chunk_idx: int) -> None:
        assert self._curr_chunk_idx is None, "Must call after_update() before before_update()"
        self._curr_chunk_idx = chunk_idx
        if chunk_idx == self._prev_chunk_idx:
            return
        assert chunk_idx == self._prev_chunk_idx + 1
        if self.is_steady_state():
            self._roll_local_window_left()

    def update(self, k, v) -> None:
        if self.is_steady_state():
            self._overwrite_rightmost_steady(k, v)
        elif self._curr_chunk_idx == self._prev_chunk_idx + 1:
            self._append_to_end(k, v)
        else:
            self._overwrite_rightmost_filling(k, v)

    def after_update(self, chunk_idx: int) -> None:
        assert chunk_idx == self._curr_chunk_idx
        if self._curr_chunk_idx == self._prev_chunk_idx + 1:
            self._n_cached = min(self._n_cached + self.chunk_size, self._k.shape[self.seq_dim])
            self._prev_chunk_idx += 1
        self._curr_chunk_idx = None

    def cached_k(self):
        if self.is_steady_state():
            return self._k
        if self._curr_chunk_idx == self._prev_chunk_idx + 1:
            return self._k[self._seq_slice(0, min(self._n_cached + self.chunk_size, self._k.shape[self.seq_dim]))]
        return self._k[self._seq_slice(0, self._n_cached)]

    def cached_v(self):
        if self.is_steady_state():
            return self._v
        if self._curr_chunk_idx == self._prev_chunk_idx + 1:
            return self._v[self._seq_slice(0, min(self._n_cached + self.chunk_size, self._v.shape[self.seq_dim]))]
        return self._v[self._seq_slice(0, self._n_cached)]


# --- recipes/.../transformer/impl/network.py: CosmosDiTNetwork (one block) ---------------------------------

@dataclass
class CosmosDiTNetworkConfig:
    patch_temporal: int = 1
    patch_spatial: int = 1
    model_channels: int = MODEL_CHANNELS


@dataclass
class CosmosDiTNetworkCache:
    self_attn: list[BlockKVCache]

    def before_update(self, chunk_idx: int) -> None:
        for blk in self.self_attn:
            blk.before_update(chunk_idx)

    def after_update(self, chunk_idx: int) -> None:
        for blk in self.self_attn:
            blk.after_update(chunk_idx)


class CosmosDiTNetwork:
    def __init__(self, config: CosmosDiTNetworkConfig, device: str):
        gen = generator(3600)
        c = config.model_channels
        self.config = config
        self.x_embedder = randn(DIM, c, gen=gen, device=device, scale=0.5)
        self.t_embedder = randn(c, gen=gen, device=device, scale=0.5)
        self.wq = randn(c, c, gen=gen, device=device, scale=0.4)
        self.wk = randn(c, c, gen=gen, device=device, scale=0.4)
        self.wv = randn(c, c, gen=gen, device=device, scale=0.4)
        self.final_layer = randn(c, DIM, gen=gen, device=device, scale=0.4)

    def initialize_cache(self, *, chunk_size: int, window_size: int, sink_size: int, device: str):
        c = self.config.model_channels
        shape = (sink_size + window_size, c)
        return CosmosDiTNetworkCache([BlockKVCache(shape, shape, 0, chunk_size, window_size, sink_size, device)])

    def forward(self, x, timesteps, rope_freqs, cache: CosmosDiTNetworkCache, current_chunk_idx: int,
                eager_mode: bool = False):
        """x: [pT * HW, D] noisy latent tokens of this AR chunk -> predicted flow, same shape. With eager_mode=False
        the cache's before_update / after_update run at the AR-step boundary, not here."""
        h = x @ self.x_embedder + timesteps * self.t_embedder + rope_freqs
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        blk = cache.self_attn[0]
        blk.update(k, v)
        keys, values = blk.cached_k(), blk.cached_v()
        attn = torch.softmax(q @ keys.transpose(0, 1) / math.sqrt(h.shape[-1]), dim=-1) @ values
        return (h + attn) @ self.final_layer


class RotaryPositionEmbedding3D:
    def __init__(self, len_t: int, len_hw: int, head_dim: int, device: str):
        self.len_t, self.len_hw, self.device = len_t, len_hw, device
        self.freqs = torch.linspace(0.1, 1.0, head_dim).to(device)

    def shift_t(self, offset: int):
        t = torch.arange(self.len_t * self.len_hw, device=self.device) // self.len_hw + offset
        return torch.sin(t[:, None].to(torch.float32) * self.freqs)


# --- flashdreams/infra/cuda_graph.py: CUDAGraphWrapper ------------------------------------------------------

class CUDAGraphWrapper:
    """Eager for ``warmup_iters`` calls, then capture the next call against static input buffers, then replay.
    Only top-level tensor args/kwargs are staged; everything else (the KV cache object) passes through."""

    def __init__(self, fn: Callable[..., Any], warmup_iters: int, device: str):
        self.fn, self.warmup_iters, self.device = fn, warmup_iters, device
        self.reset()

    def reset(self) -> None:
        self._graph = None
        self._static_args: list = []
        self._static_kwargs: dict = {}
        self._static_output = None
        self._warmup_remaining = self.warmup_iters

    def _stage(self, args, kwargs):
        fresh = [a for a in args if isinstance(a, torch.Tensor)] + \
                [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        slots = [s for s in self._static_args if isinstance(s, torch.Tensor)] + \
                [s for s in self._static_kwargs.values() if isinstance(s, torch.Tensor)]
        if len(slots) != len(fresh) or any(s.shape != f.shape for s, f in zip(slots, fresh)):
            self.reset()
            self._static_args = [torch.empty_like(a) if isinstance(a, torch.Tensor) else a for a in args]
            self._static_kwargs = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                                   for k, v in kwargs.items()}
        staged_args = []
        for slot, a in zip(self._static_args, args):
            if isinstance(slot, torch.Tensor):
                slot.copy_(a)
                staged_args.append(slot)
            else:
                staged_args.append(a)
        staged_kwargs = {}
        for name, v in kwargs.items():
            slot = self._static_kwargs[name]
            if isinstance(slot, torch.Tensor):
                slot.copy_(v)
                staged_kwargs[name] = slot
            else:
                staged_kwargs[name] = v
        return tuple(staged_args), staged_kwargs

    def drain(self, *args, **kwargs):
        """Eager autotune drain through the shared static buffers; no warmup consumed, no capture."""
        args, kwargs = self._stage(args, kwargs)
        return self.fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        args, kwargs = self._stage(args, kwargs)
        if self._graph is not None:
            return replay(self._graph, self._static_output).clone()
        if self._warmup_remaining > 0:
            self._warmup_remaining -= 1
            with events.warmup(real=True):
                return self.fn(*args, **kwargs)
        static = {f"arg{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        static.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        cache = kwargs["cache"]
        state = {}
        for i, blk in enumerate(cache.self_attn):
            state[f"self_attn[{i}]._k"], state[f"self_attn[{i}]._v"] = blk._k, blk._v
        # with torch.cuda.graph(self._graph): out = self.fn(*args, **kwargs); then replay once to compute it
        graph, out = capture(lambda: self.fn(*args, **kwargs), device=self.device, warmups=0,
                             name="CosmosDiTNetwork steady-state", static=static, state=state,
                             owner="CUDAGraphWrapper")
        self._graph, self._static_output = graph, out
        return replay(self._graph, self._static_output).clone()


# --- recipes/alpadreams/transformer/__init__.py -------------------------------------------------------------

@dataclass
class CosmosTransformerCache:
    network_cache: CosmosDiTNetworkCache
    rope_adapter: RotaryPositionEmbedding3D
    autoregressive_index: int = -1

    def start(self, autoregressive_index: int) -> None:
        self.autoregressive_index = autoregressive_index
        self.network_cache.before_update(autoregressive_index)

    def finalize(self, autoregressive_index: int) -> None:
        self.network_cache.after_update(autoregressive_index)


@dataclass(kw_only=True)
class CosmosTransformerConfig:
    network: CosmosDiTNetworkConfig = field(default_factory=CosmosDiTNetworkConfig)
    len_t: int = 1
    height: int = TOKENS_PER_FRAME
    width: int = 1
    window_size_t: int = 3
    sink_size_t: int = 0
    compile_network: bool = True
    use_cuda_graph: bool = True
    warmup_iters: int = 2
    variant: str = "fix"

    def __post_init__(self) -> None:
        kt, kh = self.network.patch_temporal, self.network.patch_spatial
        self._pT = self.len_t // kt
        self._pH, self._pW = self.height // kh, self.width // kh
        chunks_total = self.sink_size_t + self.window_size_t
        assert chunks_total % self._pT == 0
        if self.variant == "bug":
            # "The last filling step (chunks_per_window - 1) ALREADY makes cached_k() return the full prefix, so
            # it counts as steady." -- but that step still takes the filling branch.
            self._steady_ar_idx = chunks_total // self._pT - 1
        else:
            # #36: the cache fills at AR step chunks_total // _pT - 1; the *next* step is the first whose
            # before_update sees is_steady_state() == True and whose forward takes the steady branches.
            self._steady_ar_idx = chunks_total // self._pT


class CosmosTransformer:
    def __init__(self, config: CosmosTransformerConfig, device: str):
        self.config, self.device = config, device
        self.network = CosmosDiTNetwork(config.network, device)
        if config.compile_network:
            self.network = OptimizedModule(self.network, device)
        self._use_cuda_graph = config.use_cuda_graph
        self._network_call = (CUDAGraphWrapper(self.network, config.warmup_iters, device)
                              if config.use_cuda_graph else self.network)

    def initialize_autoregressive_cache(self) -> CosmosTransformerCache:
        cfg = self.config
        net_cfg = (self.network._orig_mod if isinstance(self.network, OptimizedModule) else self.network).config
        per_step = cfg._pH * cfg._pW
        network_cache = (self.network._orig_mod if isinstance(self.network, OptimizedModule) else self.network) \
            .initialize_cache(chunk_size=per_step * cfg._pT, window_size=per_step * cfg.window_size_t,
                              sink_size=per_step * cfg.sink_size_t, device=self.device)
        rope_adapter = RotaryPositionEmbedding3D(cfg._pT, per_step, net_cfg.model_channels, self.device)
        if self._use_cuda_graph:
            self._network_call.reset()
        return CosmosTransformerCache(network_cache=network_cache, rope_adapter=rope_adapter)

    def predict_flow(self, noisy_latent, timestep, cache: CosmosTransformerCache):
        ar_idx = cache.autoregressive_index
        rope_freqs = cache.rope_adapter.shift_t(offset=ar_idx * self.config._pT)
        if self._use_cuda_graph:
            network = (self._network_call.drain if ar_idx < self.config._steady_ar_idx else self._network_call)
        else:
            network = self.network
        return network(noisy_latent, timesteps=timestep, rope_freqs=rope_freqs, cache=cache.network_cache,
                       current_chunk_idx=ar_idx, eager_mode=False)


# --- flashdreams/infra/diffusion/model/base.py: the AR rollout ----------------------------------------------

def generate(transformer: CosmosTransformer, noises: list[torch.Tensor], device: str) -> list[torch.Tensor]:
    cache = transformer.initialize_autoregressive_cache()
    ts = [torch.full((1,), t, device=device) for t in DENOISE_TIMESTEPS] + [torch.zeros(1, device=device)]
    clean = []
    for ar_idx, noise in enumerate(noises):
        cache.start(ar_idx)
        latent = noise
        for i in range(len(DENOISE_TIMESTEPS)):                 # Euler flow-matching steps
            flow = transformer.predict_flow(latent, ts[i], cache)
            latent = latent - (ts[i] - ts[i + 1]) * flow
        cache.finalize(ar_idx)
        clean.append(latent)
    return clean


def run(variant: str, device: str = "cpu"):
    gen = generator(3636)
    noises = [randn(TOKENS_PER_FRAME, DIM, gen=gen, device=device) for _ in range(NUM_AR_STEPS)]

    def rollout(use_cuda_graph: bool):
        config = CosmosTransformerConfig(use_cuda_graph=use_cuda_graph, variant=variant)
        return generate(CosmosTransformer(config, device), noises, device)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: rollout(True), lambda: rollout(False))
