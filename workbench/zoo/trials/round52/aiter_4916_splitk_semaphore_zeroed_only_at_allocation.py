"""ASM split-K a16w16 GEMM under a graph: the split-K counter is zeroed only when it is allocated, so replays start dirty.

Upstream: https://github.com/ROCm/aiter/pull/4916 ("[Bugfix] Fix ASM split-K semaphore deadlock under CUDA graph
capture", commit 0e8c750d19; supersedes #4494, which was reverted by #4709).
Symptom: Kimi-K3 TP8 with a graphed draft model hangs during warmup on 8x MI355X; rocgdb shows 132 waves of
``bf16gemm_fp32bf16_tn_64x64_splitk_clean`` waiting on a split-K counter that holds 2. No wrong numbers, a hang.
Mechanism: ``aiter/ops/gemm_op_a16w16.py::gemm_a16w16_asm`` with ``splitK > 1`` passes
``sema = get_semaphore_workspace(out.device)`` to ``_gemm_a16w16_asm``. That is
``_get_semaphore_workspace_keyed(device, stream.cuda_stream)``, an ``lru_cache`` returning
``torch.zeros(_SEMA_SHAPE, uint32)``: the counter is zeroed once, on the cache miss (eagerly, at warmup), and then
reused. The kernel's protocol needs counter == 0 at every launch start: each workgroup adds its arrival, the one
that brings the counter to ``splitK`` does the reduction and resets it. A graph records the launch, not the
``torch.zeros`` that ran at allocation, so nothing in a replay restores the counter; residue left by a launch
that shares the per-stream slot (two recorded launches replayed interleaved; the upstream test seeds it directly)
is never cleared. The arrivals then overshoot ``splitK``, the reduction never fires and the waves spin. In this
miniature the kernel is torch ops: a tile whose reduction does not fire is simply not written (instead of spinning),
so the served output keeps stale values, and the counter keeps growing on every replay.
Doctor: stale-input, at ``get_semaphore_workspace`` (each replay's result depends on what an earlier launch left
in the counter, a static input whose refresh, the zero-fill, is not part of the graph).
Fix (upstream): under capture (``torch.cuda.is_current_stream_capturing()``) ``get_semaphore_workspace`` returns
``_get_captured_semaphore_workspace(device)``: the next slot of a per-device ring primed on the eager path
(``_prime_capture_pool``), with ``sema.zero_()`` recorded as a graph node "so every replay starts from zero"; each
recorded launch gets its own slot, exhaustion raises. Eager launches are unchanged.
"""
from __future__ import annotations

import functools

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/4916"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "get_semaphore_workspace"
SYMPTOM = "graph replay of a split-K ASM GEMM starts from a dirty counter (2): the reduction never fires (hang)"

HIDDEN, K, N, TILE_M = 8, 26, 8, 2
SPLIT_K = 13                       # the splitK of the upstream test
_SEMA_SHAPE = (16, 64)
CAPTURE_SEMAPHORE_POOL_SLOTS = 8
_VARIANT = {"v": "bug"}
_capture_rings: dict = {}
_capture_ring_next: dict = {}


def _current_stream_id(device) -> int:
    return 0                       # the stream the graph is captured on (warmed up eagerly, as the test does)


@functools.lru_cache(maxsize=64)
def _get_semaphore_workspace_keyed(device: str, stream_id: int) -> torch.Tensor:
    # int32 stands in for uint32 (the upstream test views the counter as int32 too)
    return torch.zeros(_SEMA_SHAPE, dtype=torch.int32, device=device)


def _prime_capture_pool(device):
    """Allocate the capture pool. Never called from inside a capture."""
    ring = _capture_rings.get(device)
    if ring is None:
        ring = torch.zeros((CAPTURE_SEMAPHORE_POOL_SLOTS, *_SEMA_SHAPE), dtype=torch.int32, device=device)
        _capture_rings[device] = ring
    return ring


def _get_captured_semaphore_workspace(device):
    ring = _capture_rings.get(device)
    if ring is None:
        raise RuntimeError(f"no split-K a16w16 semaphore pool on {device}: run one eager launch first")
    idx = _capture_ring_next.get(device, 0)
    if idx >= CAPTURE_SEMAPHORE_POOL_SLOTS:
        raise RuntimeError(f"split-K a16w16 capture semaphore pool exhausted on {device}")
    _capture_ring_next[device] = idx + 1
    sema = ring[idx]
    sema.zero_()  # a graph node, so every replay starts from zero
    return sema


def get_semaphore_workspace(device):
    """Return a per-(device, stream) zero-initialized semaphore workspace."""
    if _VARIANT["v"] == "fix":
        if is_capturing():
            return _get_captured_semaphore_workspace(device)
        _prime_capture_pool(device)  # allocate here, never under capture
    return _get_semaphore_workspace_keyed(device, _current_stream_id(device))


def _gemm_a16w16_asm(A, B, out, semaphore, splitK):
    """The split-K kernel: splitK workgroups per output tile, last arrival reduces and resets the counter."""
    chunk = A.shape[1] // splitK
    partials = torch.stack([A[:, k * chunk:(k + 1) * chunk] @ B[k * chunk:(k + 1) * chunk] for k in range(splitK)])
    counter = semaphore.view(-1)[: out.shape[0] // TILE_M]
    for _ in range(splitK):        # each workgroup's atomic arrival on its tile's counter
        counter.add_(1)
    fire = (counter == splitK).repeat_interleave(TILE_M).unsqueeze(1)   # the last workgroup saw splitK
    out.copy_(torch.where(fire, partials.sum(0), out))   # (no reduction: the real waves spin here forever)
    counter.masked_fill_(counter == splitK, 0)           # the reducing workgroup resets the counter


def gemm_a16w16_asm(A, B, out, splitK=None):
    sema = get_semaphore_workspace(out.device.type if out.device.index is None else str(out.device))
    _gemm_a16w16_asm(A, B, out, sema, splitK)
    return out, sema


class DraftModel:
    """A graphed draft model: two projections served by the split-K ASM GEMM."""

    def __init__(self, device, batch):
        gen = generator(4916)
        self.w_up = randn(HIDDEN, K, gen=gen, device=device, scale=0.4)
        self.w_down = randn(K, N, gen=gen, device=device, scale=0.4)
        self.hidden = torch.zeros(batch, HIDDEN, device=device)      # static input
        self.up_out = torch.zeros(batch, K, device=device)
        self.out = torch.zeros(batch, N, device=device)
        self.semas = []

    def forward(self):
        # the first projection is a plain GEMM; the second (K=26) runs split-K
        self.up_out.copy_(torch.tanh(self.hidden @ self.w_up))
        out, sema = gemm_a16w16_asm(self.up_out, self.w_down, self.out, splitK=SPLIT_K)
        self.semas.append(sema)
        return out


def _interleaved_launch_residue(sema):
    """What rocgdb found: another launch sharing the slot, replayed interleaved, left 2 arrivals behind."""
    sema.view(-1)[:4].fill_(2)


def run(variant: str, device: str = "cpu"):
    _VARIANT["v"] = variant
    _get_semaphore_workspace_keyed.cache_clear()
    _capture_rings.clear()
    _capture_ring_next.clear()
    gen = generator(49160)
    batch = 8
    steps = [torch.randn(batch, HIDDEN, generator=gen) for _ in range(4)]

    def served():
        m = DraftModel(device, batch)
        g, out = capture(m.forward, device=device, owner="draft model (graphed)", name="draft split-K",
                         static={"hidden": m.hidden})
        _interleaved_launch_residue(m.semas[-1])    # the counter the recorded launch uses
        outs = []
        for x in steps:
            m.hidden.copy_(x.to(device))
            outs.append(replay(g, out).clone())
        return outs

    def eager():
        m = DraftModel(device, batch)
        outs = []
        for x in steps:
            m.hidden.copy_(x.to(device))
            outs.append(m.forward().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
