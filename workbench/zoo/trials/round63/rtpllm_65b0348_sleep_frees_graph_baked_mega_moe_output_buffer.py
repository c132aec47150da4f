"""Engine sleep frees the Mega MoE output staging buffer baked into the decode graph; the first replay after wake writes it.

Upstream: https://github.com/alibaba/rtp-llm/commit/65b0348fd04d0a5848f608a1062f4b443c767eff ("fix(sleep): keep
graph-baked Mega MoE buffers resident on DSV4 decode sleep", July 2026; no separate issue).
Symptom: DeepSeek-V4 decode role with CUDA graphs and sleep mode: after a sleep/wake cycle the first decode replay
hits an illegal memory access on every rank; the sticky CUDA error surfaces at the async output dispatch and the
pinned-host token tensor's destructor re-throws during unwind -> ``std::terminate`` (SIGABRT), on both decode ranks.
Mechanism: ``rtp_llm/models_py/modules/dsv4/moe/mega_buf.py`` caches two device buffers at module scope, shared by
every MoE layer: the symmetric-memory dispatch buffer (``_MEGA_BUF_CACHE``, held per layer as ``self._mega_buf``) and
the bf16 output staging buffer (``_MEGA_OUTPUT_CACHE``, held as ``self._mega_y``). ``MegaStrategy`` packs the
tokens into the symm buffer and ``deep_gemm.fp8_fp4_mega_moe`` writes the combined routed output into
``self._mega_y[:T]``. ``MegaStrategy._ensure_mega_buffers`` re-creates either buffer lazily ("if None: create") at
the top of every forward. The decode role captures the whole forward, Mega MoE included, so both buffers'
addresses are baked into the graph. On sleep, ``sleep_gpu_reclaim._clear_module_device_caches`` called
``mega_buf.release_mega_output_buffers()`` with no gate: it sets ``strat._mega_y = None`` on every registered
strategy and clears ``_MEGA_OUTPUT_CACHE``; the following ``torch.cuda.empty_cache()`` unmaps the segment. On wake
the decode step only replays the graph: no Python runs, so ``_ensure_mega_buffers`` never re-creates the buffer, and
the replayed MoE kernel writes (and the epilogue reads) the released block. Without graphs (the prefill role, and
the eager reference here) the lazy re-create runs and the release is harmless.
Doctor: dangling-reference, at release_mega_output_buffers (it drops the last references to a buffer that the
captured decode graph still writes and reads; every post-wake replay touches released memory).
Fix (upstream): ``mega_buf`` gets the flag ``_MEGA_BUFFERS_GRAPH_BAKED`` (``set_mega_buffers_graph_baked``, set by
``DeepSeekV4Model.__init__`` from ``enable_cuda_graph``); ``release_mega_output_buffers`` and
``release_mega_symm_buffers`` return at once when it is set, and ``_clear_module_device_caches`` drops the ungated
output release (both buffers are released together only under ``RTP_LLM_SLEEP_FREE_MEGA_SYMM=1``, and kept when
graph-baked).
"""
from __future__ import annotations

import weakref

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/65b0348fd04d0a5848f608a1062f4b443c767eff"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "release_mega_output_buffers"
SYMPTOM = "first DSV4 decode graph replay after sleep/wake: illegal memory access on every rank, then SIGABRT"

HIDDEN, INTER, N_EXPERTS, TOPK, N_LAYERS, BATCH = 8, 8, 4, 2, 2, 3
RTP_LLM_SLEEP_FREE_MEGA_SYMM = False            # default: the symm buffer stays resident on sleep


class SymmBuffer:
    """The symmetric-memory dispatch buffer: per-token staging of x and the routing (single-layer)."""

    def __init__(self, num_max_tokens_per_rank: int, hidden: int, device: str) -> None:
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.x = torch.zeros(num_max_tokens_per_rank, hidden, device=device)
        self.topk_idx = torch.zeros(num_max_tokens_per_rank, TOPK, dtype=torch.long, device=device)
        self.topk_w = torch.zeros(num_max_tokens_per_rank, TOPK, device=device)

    def destroy(self) -> None:
        self.x = self.topk_idx = self.topk_w = None


class MegaBufModule:
    """``rtp_llm/models_py/modules/dsv4/moe/mega_buf.py``: its module-scope caches (one per process)."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self._MEGA_BUF_CACHE: dict = {}
        self._MEGA_OUTPUT_CACHE: dict = {}
        self._MEGA_STRATEGY_REGISTRY: weakref.WeakSet = weakref.WeakSet()
        self._MEGA_BUFFERS_GRAPH_BAKED = False

    def set_mega_buffers_graph_baked(self, enabled: bool) -> None:
        self._MEGA_BUFFERS_GRAPH_BAKED = bool(enabled)

    def mega_buffers_graph_baked(self) -> bool:
        return self._MEGA_BUFFERS_GRAPH_BAKED

    def _get_or_create_mega_buf(self, num_max_tokens_per_rank: int, hidden: int, device: str) -> SymmBuffer:
        key = (num_max_tokens_per_rank, hidden)
        if key not in self._MEGA_BUF_CACHE:
            self._MEGA_BUF_CACHE[key] = SymmBuffer(num_max_tokens_per_rank, hidden, device)
        return self._MEGA_BUF_CACHE[key]

    def _get_or_create_mega_output(self, capacity: int, hidden: int, device: str) -> torch.Tensor:
        key = (device, hidden)
        cached = self._MEGA_OUTPUT_CACHE.get(key)
        if cached is not None and cached.size(0) >= capacity:
            return cached
        cached = torch.empty(max(capacity, 1), hidden, device=device)
        self._MEGA_OUTPUT_CACHE[key] = cached
        return cached

    def release_mega_output_buffers(self) -> tuple[int, float]:
        """Drop every per-layer ref to the shared output staging buffer (sleep reclaim)."""
        if self.variant == "fix" and self._MEGA_BUFFERS_GRAPH_BAKED:
            return 0, 0.0                      # baked into the decode graph: must stay resident
        freed = sum(b.numel() * b.element_size() for b in self._MEGA_OUTPUT_CACHE.values())
        entries = len(self._MEGA_OUTPUT_CACHE)
        for strat in list(self._MEGA_STRATEGY_REGISTRY):
            strat._mega_y = None
        self._MEGA_OUTPUT_CACHE.clear()
        return entries, freed / (1024 ** 3)

    def release_mega_symm_buffers(self) -> float:
        if self.variant == "fix" and self._MEGA_BUFFERS_GRAPH_BAKED:
            return 0.0
        for strat in list(self._MEGA_STRATEGY_REGISTRY):
            strat._mega_buf = None
        for buf in list(self._MEGA_BUF_CACHE.values()):
            buf.destroy()
        self._MEGA_BUF_CACHE.clear()
        self.release_mega_output_buffers()
        return 0.0


def _clear_module_device_caches(mega_buf: MegaBufModule, variant: str) -> list[str]:
    """``rtp_llm/utils/sleep_gpu_reclaim.py``: module-level device caches dropped at engine sleep."""
    notes = []
    if variant == "bug":                       # the ungated output release
        n, freed = mega_buf.release_mega_output_buffers()
        if n:
            notes.append(f"mega_output_cache released ({n} entries, ~{freed:.3f} GiB)")
        if RTP_LLM_SLEEP_FREE_MEGA_SYMM:
            mega_buf.release_mega_symm_buffers()
    elif mega_buf.mega_buffers_graph_baked():
        notes.append("mega buffers kept (baked into CUDA graph)")
    elif RTP_LLM_SLEEP_FREE_MEGA_SYMM:
        mega_buf.release_mega_symm_buffers()   # releases both buffers together
    return notes


class MegaStrategy:
    """One MoE layer's Mega MoE path (``dsv4/moe/strategies/mega.py``)."""

    def __init__(self, mega_buf: MegaBufModule, gen: torch.Generator, device: str) -> None:
        self.mega_buf, self.device = mega_buf, device
        self.gate = randn(HIDDEN, N_EXPERTS, gen=gen, device=device)
        self._mega_l1_w = randn(N_EXPERTS, HIDDEN, 2 * INTER, gen=gen, device=device, scale=0.4)
        self._mega_l2_w = randn(N_EXPERTS, INTER, HIDDEN, gen=gen, device=device, scale=0.4)
        # on CUDA the staging buffer owns its allocator segment, so empty_cache unmaps it
        self._mega_out_capacity_tokens = max(BATCH, own_segment_elems(device) // HIDDEN)
        self._mega_buf = None
        self._mega_y = None
        mega_buf._MEGA_STRATEGY_REGISTRY.add(self)
        self._ensure_mega_buffers()            # created eagerly at construction

    def _ensure_mega_buffers(self) -> None:
        if self._mega_buf is None:
            self._mega_buf = self.mega_buf._get_or_create_mega_buf(BATCH, HIDDEN, self.device)
        if self._mega_y is None:
            self._mega_y = self.mega_buf._get_or_create_mega_output(
                self._mega_out_capacity_tokens, HIDDEN, self.device)

    def fp8_fp4_mega_moe(self, y: torch.Tensor, buf: SymmBuffer, T: int) -> None:
        """The fused kernel: dispatch + L1 GEMM + SwiGLU + L2 GEMM + combine, written into ``y``."""
        x, idx, w = buf.x[:T], buf.topk_idx[:T], buf.topk_w[:T]
        h = torch.einsum("td,tkdf->tkf", x, self._mega_l1_w[idx])
        gate, up = h.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        out = torch.einsum("tki,tkid->tkd", act, self._mega_l2_w[idx])
        y.copy_((out * w[..., None]).sum(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._ensure_mega_buffers()            # Python: runs at capture, never at replay
        T = x.size(0)
        buf = self._mega_buf
        scores = torch.softmax(x @ self.gate, dim=-1)
        topk_w, topk_idx = torch.topk(scores, TOPK, dim=-1)
        buf.x[:T].copy_(x)                     # input packer
        buf.topk_idx[:T].copy_(topk_idx)
        buf.topk_w[:T].copy_(topk_w)
        y = self._mega_y[:T]
        self.fp8_fp4_mega_moe(y, buf, T)
        return y


class DeepSeekV4Model:
    def __init__(self, variant: str, device: str, enable_cuda_graph: bool) -> None:
        gen = generator(65)
        self.mega_buf = MegaBufModule(variant)
        if variant == "fix":
            self.mega_buf.set_mega_buffers_graph_baked(enable_cuda_graph)
        self.layers = [MegaStrategy(self.mega_buf, gen, device) for _ in range(N_LAYERS)]
        self.shared = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.3) for _ in range(N_LAYERS)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for moe, shared in zip(self.layers, self.shared):
            hidden = hidden + moe.forward(hidden) + hidden @ shared      # MoE epilogue: routed + shared
        return hidden


def run(variant: str, device: str = "cpu"):
    gen = generator(63)
    steps = [randn(BATCH, HIDDEN, gen=gen, device=device) for _ in range(4)]
    sleep_after = 2

    def eager():                                # the non-graph path: the lazy re-create covers the sleep
        model = DeepSeekV4Model(variant, device, enable_cuda_graph=False)
        outs = []
        for i, h in enumerate(steps):
            if i == sleep_after:
                _clear_module_device_caches(model.mega_buf, variant)
                release_to_driver(device)
            outs.append(model.forward(h).clone())
        return outs

    def served():
        model = DeepSeekV4Model(variant, device, enable_cuda_graph=True)
        hidden_buf = torch.zeros(BATCH, HIDDEN, device=device)
        g, out = capture(lambda: model.forward(hidden_buf), device=device, name=f"dsv4 decode bs={BATCH}",
                         static={"hidden_states": hidden_buf}, owner="DSV4 decode CudaGraphRunner")
        outs = []
        for i, h in enumerate(steps):
            if i == sleep_after:                # engine sleep ... then wake: the decode step only replays
                _clear_module_device_caches(model.mega_buf, variant)
                release_to_driver(device)
            hidden_buf.copy_(h)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
