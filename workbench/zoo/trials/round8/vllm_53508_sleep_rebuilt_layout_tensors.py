"""After a sleep/wake cycle the runner rebuilds the block-table layout tensors a FULL graph still reads.

Upstream: https://github.com/vllm-project/vllm/pull/53508 ("[Bugfix][MRV2] Isolate sleep-mode KV
allocations"; the failure is described in #53197, "Keep fused draft graph metadata alive across sleep",
and RFC #53343).
Symptom: Model Runner V2 with FULL CUDA graphs (fused multi-step MTP decode) and sleep mode: the first
request after ``wake_up`` fails with ``CUDA_ERROR_ILLEGAL_ADDRESS`` (vLLM main, Aug 2026).
Mechanism: ``initialize_kv_cache`` ran entirely inside the discardable ``kv_cache`` memory pool, so the
persistent block-table layout tensors (block sizes, row strides) created there inherited the tag and
were discarded by ``sleep``. To restore them, ``post_kv_cache_wake_up`` rebuilt those tensors after
wake-up: Python now uses new tensors while the captured graphs keep the addresses of the old ones,
which were released. The first replay after wake reads freed memory.
Doctor: dangling-reference, at ``compute_slot_mappings`` (the captured slot computation that reads the
layout tensors).
Fix (upstream): enter the ``kv_cache`` pool only around the backing KV allocation, so the layout
tensors stay resident across sleep/wake, and stop calling the ``post_kv_cache_wake_up`` rebuild.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/53508"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "compute_slot_mappings"
SYMPTOM = "illegal memory access on the first replay after wake_up (graph reads rebuilt-away layout tensors)"
VOCAB, DIM, BLOCK, MAX_BLOCKS, NUM_BLOCKS, MAX_REQS, CTX = 12, 4, 2, 3, 8, 2, 6


class CuMemAllocator:
    """Tagged pools: allocations made inside ``use_memory_pool(tag)`` follow that tag's sleep policy
    (``kv_cache``: discarded, the same addresses remapped to fresh memory on wake)."""

    def __init__(self):
        self.tagged: dict[str, list[torch.Tensor]] = {}
        self._tag = None

    @contextlib.contextmanager
    def use_memory_pool(self, tag):
        self._tag = tag
        try:
            yield
        finally:
            self._tag = None

    def allocate(self, t: torch.Tensor) -> torch.Tensor:
        if self._tag is not None:
            self.tagged.setdefault(self._tag, []).append(t)
        return t

    def sleep(self):
        for t in self.tagged.get("kv_cache", []):
            t.zero_()                                   # discarded: contents are not restored on wake

    def forget(self, t):
        for ts in self.tagged.values():
            ts[:] = [x for x in ts if x is not t]


class BlockTables:
    """MRV2 block tables: the per-request rows plus layout tensors the graphs read."""

    def __init__(self, device, allocator):
        self.device, self.allocator = device, allocator
        self.block_table = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self._make_layout()

    def _make_layout(self):
        self.block_sizes = self.allocator.allocate(torch.tensor(BLOCK, device=self.device))
        self.block_table_strides = self.allocator.allocate(torch.tensor(MAX_BLOCKS, device=self.device))

    def rebuild_layout(self):
        for t in (self.block_sizes, self.block_table_strides):
            self.allocator.forget(t)
        self._make_layout()


def compute_slot_mappings(block_tables, rows, positions):
    """Slot of each position through the flattened block table and the layout tensors."""
    flat = block_tables.block_table.view(-1)
    bs = block_tables.block_sizes
    block_idx = rows[:, None] * block_tables.block_table_strides + positions // bs
    return flat[block_idx] * bs + positions % bs


class Model:
    def __init__(self, device):
        gen = generator(53508)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(CTX, DIM, gen=gen, device=device, scale=0.5)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.5)


class ModelRunner:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.model = Model(device)
        self.allocator = CuMemAllocator()
        self.input_ids = torch.zeros(MAX_REQS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_REQS, dtype=torch.long, device=device)
        self.rows = torch.arange(MAX_REQS, device=device)

    def initialize_kv_cache(self):
        if self.variant == "bug":                       # the whole initialisation inside the kv pool
            with self.allocator.use_memory_pool("kv_cache"):
                self.kv_cache = self.allocator.allocate(torch.zeros(NUM_BLOCKS * BLOCK, DIM, device=self.device))
                self.block_tables = BlockTables(self.device, self.allocator)
        else:                                           # only the backing cache is discardable
            with self.allocator.use_memory_pool("kv_cache"):
                self.kv_cache = self.allocator.allocate(torch.zeros(NUM_BLOCKS * BLOCK, DIM, device=self.device))
            self.block_tables = BlockTables(self.device, self.allocator)

    def forward(self, size):
        """One decode token per request: write its key, then average the keys of its context."""
        m, bt = self.model, self.block_tables
        ids, pos, rows = self.input_ids[:size], self.positions[:size], self.rows[:size]
        k = (m.emb[ids] + m.pos[pos]) @ m.wk
        slot = compute_slot_mappings(bt, rows, pos[:, None])[:, 0]
        self.kv_cache[slot] = k
        ctx = torch.arange(CTX, device=self.device)[None, :].expand(size, CTX)
        ctx_slots = compute_slot_mappings(bt, rows, ctx)
        mask = (ctx <= pos[:, None]).to(k.dtype)[..., None]
        return (self.kv_cache[ctx_slots] * mask).sum(1) / mask.sum(1)

    def prefill(self, row, prompt, blocks):
        self.block_tables.block_table[row, :len(blocks)] = torch.tensor(blocks, device=self.device)
        pos = torch.arange(len(prompt), device=self.device)
        m = self.model
        k = (m.emb[torch.tensor(prompt, device=self.device)] + m.pos[pos]) @ m.wk
        slots = compute_slot_mappings(self.block_tables, torch.full_like(pos, row), pos[:, None])[:, 0]
        self.kv_cache[slots] = k

    def sleep(self):
        self.allocator.sleep()

    def wake_up(self):
        if self.variant == "bug":
            self.post_kv_cache_wake_up()

    def post_kv_cache_wake_up(self):
        """Restore metadata discarded with the kv_cache pool: new tensors, new addresses."""
        self.block_tables.rebuild_layout()


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        runner = ModelRunner(device, variant)
        runner.initialize_kv_cache()
        manager = GraphManager(runner.forward, [1, 2], device=device, mode=CUDAGraphMode.FULL,
                               static_buffers={"input_ids": runner.input_ids, "positions": runner.positions,
                                               "block_table": runner.block_tables.block_table},
                               name="ModelCudaGraphManager")
        if graphed:
            events.persistent_state("GPUModelRunner", {"kv_cache": runner.kv_cache})
            manager.capture()
        runner.kv_cache.zero_()

        def decode(ids, positions):
            n = len(ids)
            runner.input_ids[:n] = torch.tensor(ids, device=device)
            runner.positions[:n] = torch.tensor(positions, device=device)
            size = manager.dispatch(n) if graphed else None
            if size is None:
                return runner.forward(n).clone()
            return manager.replay(size, real=n)[:n].clone()

        outs = []
        runner.prefill(0, [3, 7, 1], [2, 4])
        runner.prefill(1, [5, 2], [3, 6])
        outs.append(decode([4, 9], [3, 2]))
        outs.append(decode([8, 1], [4, 3]))
        runner.sleep()                                  # RL weight sync: level-1 sleep, then wake
        runner.wake_up()
        runner.block_tables.block_table.zero_()
        runner.prefill(0, [6, 6], [5, 1])               # a new request after wake-up
        outs.append(decode([2], [2]))
        outs.append(decode([11], [3]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
