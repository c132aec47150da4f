"""Replacing the fixed graph-storage borrow runs leaves the live borrow pool carving the old runs: EAGLE's borrowed probabilities land on a graph's logits.

Upstream: https://github.com/sgl-project/sglang/pull/37966 ("[Memory] Retire graph borrow pool before updating static
runs", merged; opened 2026-09-04). Borrowing came in with https://github.com/sgl-project/sglang/pull/35375 ("[Memory]
Borrow CUDA graph pool storage for EAGLE sampling", opt-in ``SGLANG_ENABLE_GRAPH_POOL_BORROW=1``).
Symptom: the PR: "Replacing fixed graph-storage extents while a borrow memory pool remains live leaves allocator state
tied to the previous address set." Step-local eager tensors borrowed from graph storage keep landing at the previous
extents. Once those extents hold live graph memory (a decode graph's output logits), the sampler's writes into its
borrowed full-vocabulary probabilities overwrite the logits before they are read. No error is raised: the
logprobs (and anything else read from the logits after sampling) are wrong. Without graphs there is no graph
storage and borrowing is a no-op, so eager is right.
Mechanism: ``runner_utils/pool.py``. ``borrow_graph_pool(user)`` routes the step's allocations through one persistent
``torch.cuda.MemPool`` (``_borrow_mem_pool``) over a ``BumpArenaStub`` whose extents are set once, when the pool
is built: ``_borrow_stub.set_extents(runs)`` with ``runs = _borrow_static_runs`` when externally managed graph
storage registered fixed runs, else the free runs of a snapshot of the graph pool. Later borrows reuse that pool
(and its cached blocks) until something calls ``_teardown_borrow_pool()`` (capture, in
``graph_pool_capture_scope``; a stub that lost segments). ``set_graph_pool_borrow_runs(runs)`` only assigned
``_borrow_static_runs = sorted(runs, ...)[:MAX_EXTENTS]``: the new extents were published, but the live
``_borrow_mem_pool`` still carved (and handed back its cached blocks at) the previous address set. Here graph
storage is managed externally at stable addresses: at reservation it registers all of its range as free; the
decode graphs (bs 4, then 2: largest first) are captured, each one's output logits placed in that storage; the
sampling prewarm right after capture borrows once (building the borrow pool over the whole range: its
probabilities land at the start, where the bs-4 logits now live) and the storage then registers the runs left
free. Serving: each verify step replays the graph (logits handed out), and in ``borrow_graph_pool("eagle
verify")`` allocates ``target_probs`` [bs, vocab]: the stale pool hands back the prewarm's cached block (bs 4) or
bumps on in the old extent (bs 2), exactly onto the step's logits; ``target_probs.copy_(softmax(logits))`` writes
the probabilities over the logits, and the logprobs are then taken from probabilities.
Doctor: overwritten-output, at set_graph_pool_borrow_runs (the graph's output logits, handed out by the replay, are
read by the sampler after their memory was overwritten, by an eager write through the borrowed ``target_probs``
that the stale borrow pool placed on them; the stale pool is the one ``set_graph_pool_borrow_runs`` left live when
it replaced the runs, which is where the fix changed code).
Fix (upstream): ``set_graph_pool_borrow_runs`` sorts and truncates the replacement runs first, calls
``_teardown_borrow_pool()`` (synchronise, drain deferred frees, drop ``_borrow_mem_pool``), then publishes
``_borrow_static_runs``: the next borrow builds a new pool over the new extents.
Modelled: the device's address space is one float32 tensor (the externally managed graph storage; addresses are
byte offsets into it); a tensor at an address is a view of it. ``BumpArenaStub`` bumps first-fit through its
extents; ``torch.cuda.MemPool`` is a small caching layer that takes a borrowed tensor's block back when the tensor
dies and hands it to the next request of the same size; ``torch.cuda.use_mem_pool`` routes only the explicit
``empty`` of the borrowed probabilities (upstream every allocation in the scope goes there). The externally
managed storage (``ExternalGraphStorage``, and the order reserve / capture / prewarm / register) stands for a
caller that this snapshot of sglang does not contain: in-tree, ``set_graph_pool_borrow_runs`` is reached only
from tests, and the docstring's "graph storage whose addresses are managed externally". The decode model is one
tanh layer and an lm_head; sampling is greedy over the target probabilities (no draft tree, no rejection).
Capture/replay/borrow exclusivity (``graph_pool_user_scope``) is kept; deferred frees, streams and
synchronisation are not modelled.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/37966"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "set_graph_pool_borrow_runs"
SYMPTOM = ("after the graph-storage borrow runs are replaced, the live borrow pool still carves the old extents: "
           "EAGLE's borrowed probabilities overwrite a decode graph's output logits")

VOCAB, HIDDEN = 16, 8
CAPTURE_BS = (4, 2)                        # captured largest first
STORAGE_BYTES = 4 * 16 * VOCAB             # the externally managed graph storage
TEMPERATURE = 0.7
WORKLOAD = (4, 2, 4, 4, 2, 4)              # verify batches served


# --- the device's address space (here: the externally managed graph storage) ---------------------------------

class ExternalGraphStorage:
    """Graph storage at stable addresses, managed outside the shared pool (stands for the caller; see Modelled)."""

    def __init__(self, nbytes: int, device):
        self.words = torch.zeros(nbytes // 4, device=device)
        self.nbytes = nbytes
        self._placed = 0                                        # bytes given to graphs, from address 0

    def tensor_at(self, address: int, shape) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return self.words[address // 4: address // 4 + n].view(*shape)

    def place(self, shape) -> torch.Tensor:
        """Storage for a graph's output, at the next stable address."""
        t = self.tensor_at(self._placed, shape)
        self._placed += 4 * t.numel()
        return t

    def free_runs(self) -> list[tuple[int, int]]:
        return [(self._placed, self.nbytes - self._placed)] if self._placed < self.nbytes else []


_address_space: Optional[ExternalGraphStorage] = None


# --- sglang/srt/utils/cuda_vmm_utils.py ------------------------------------------------------------------------

class BumpArenaStub:
    """Bump allocator over caller-owned extents (the allocator behind the borrow MemPool)."""

    MAX_EXTENTS = 8

    def __init__(self):
        self.extents: list[tuple[int, int]] = []
        self._cursors: list[int] = []
        self.cursor_bytes = 0
        self.freed_bytes = 0                                    # segments released by empty_cache (none here)

    def set_extents(self, runs: list[tuple[int, int]]) -> None:
        self.extents = list(runs)
        self._cursors = [0] * len(self.extents)
        self.cursor_bytes = 0

    def allocator(self, nbytes: int) -> int:
        for i, (address, size) in enumerate(self.extents):
            if self._cursors[i] + nbytes <= size:
                ptr = address + self._cursors[i]
                self._cursors[i] += nbytes
                self.cursor_bytes += nbytes
                return ptr
        raise torch.OutOfMemoryError(f"graph pool borrow: no run holds {nbytes} bytes")


# --- torch.cuda.MemPool / use_mem_pool (the caching layer over a pluggable allocator) ---------------------------

class MemPool:
    def __init__(self, allocator):
        self._allocator = allocator
        self._cached: dict[int, list[int]] = {}                 # nbytes -> free block addresses

    def malloc(self, nbytes: int) -> int:
        blocks = self._cached.get(nbytes)
        return blocks.pop() if blocks else self._allocator(nbytes)

    def free(self, address: int, nbytes: int) -> None:
        self._cached.setdefault(nbytes, []).append(address)


_mem_pool_stack: list[MemPool] = []


@contextmanager
def use_mem_pool(mem_pool: MemPool) -> Iterator[None]:
    _mem_pool_stack.append(mem_pool)
    try:
        yield
    finally:
        _mem_pool_stack.pop()


def empty(shape, device) -> torch.Tensor:
    """``torch.empty``: from the current MemPool if one is in use, else from the default allocator."""
    if not _mem_pool_stack:
        return torch.empty(*shape, device=device)
    mem_pool = _mem_pool_stack[-1]
    nbytes = 4 * shape[0] * shape[1]
    address = mem_pool.malloc(nbytes)
    t = _address_space.tensor_at(address, shape)
    weakref.finalize(t, mem_pool.free, address, nbytes)        # the block goes back to the pool's cache
    return t


# --- sglang/srt/model_executor/runner_utils/pool.py -------------------------------------------------------------

SGLANG_ENABLE_GRAPH_POOL_BORROW = True
_graph_memory_pool = None
_active_graph_pool_user: Optional[str] = None
_borrow_stub: Optional[BumpArenaStub] = None
_borrow_mem_pool: Optional[MemPool] = None
_borrow_disabled_reason: Optional[str] = None
_borrow_static_runs: Optional[list[tuple[int, int]]] = None
_borrow_extents_total = 0
_variant = "bug"


def _reset_borrow_state(variant: str, graph_memory_pool=None) -> None:
    """A fresh process (the unit tests' ``_reset_borrow_state``)."""
    global _graph_memory_pool, _active_graph_pool_user, _borrow_stub, _borrow_mem_pool
    global _borrow_disabled_reason, _borrow_static_runs, _borrow_extents_total, _variant, _address_space
    _graph_memory_pool, _address_space = graph_memory_pool, graph_memory_pool
    _active_graph_pool_user = _borrow_stub = _borrow_mem_pool = _borrow_disabled_reason = None
    _borrow_static_runs, _borrow_extents_total, _variant = None, 0, variant


def set_graph_pool_borrow_runs(runs: list[tuple[int, int]]) -> None:
    """Use fixed graph-storage extents instead of snapshots of the shared pool."""
    global _borrow_static_runs
    if _variant == "fix":                                       # PR #37966
        static_runs = sorted(runs, key=lambda run: run[1], reverse=True)[: BumpArenaStub.MAX_EXTENTS]
        _teardown_borrow_pool()
        _borrow_static_runs = static_runs
        return
    _borrow_static_runs = sorted(runs, key=lambda run: run[1], reverse=True)[: BumpArenaStub.MAX_EXTENTS]


def get_global_graph_memory_pool():
    return _graph_memory_pool


def graph_pool_borrow_enabled() -> bool:
    if _borrow_disabled_reason is not None or not SGLANG_ENABLE_GRAPH_POOL_BORROW:
        return False
    if _borrow_static_runs is not None:
        return len(_borrow_static_runs) > 0
    return get_global_graph_memory_pool() is not None


@contextmanager
def graph_pool_user_scope(user: str) -> Iterator[None]:
    global _active_graph_pool_user
    if _active_graph_pool_user is not None:
        raise RuntimeError(f"graph pool already has live user {_active_graph_pool_user!r}; cannot use it for {user!r}")
    _active_graph_pool_user = user
    try:
        yield
    finally:
        _active_graph_pool_user = None


@contextmanager
def graph_pool_replay_scope() -> Iterator[None]:
    if not graph_pool_borrow_enabled():
        yield
        return
    with graph_pool_user_scope("CUDA graph"):
        yield


@contextmanager
def graph_pool_capture_scope() -> Iterator[None]:
    if not graph_pool_borrow_enabled():
        yield
        return
    with graph_pool_user_scope("CUDA graph"):
        _teardown_borrow_pool()          # capture re-carves the pool's free space: retire the borrow pool
        yield


def _teardown_borrow_pool() -> None:
    """Retire the persistent borrow pool (after draining deferred frees, upstream)."""
    global _borrow_mem_pool
    if _borrow_mem_pool is None:
        return
    _borrow_mem_pool = None


@contextmanager
def borrow_graph_pool(user: str) -> Iterator[None]:
    """Route this step's allocations onto the graph storage's free runs (tensors must not survive the step)."""
    global _borrow_stub, _borrow_mem_pool, _borrow_extents_total
    if not graph_pool_borrow_enabled():
        yield
        return
    with graph_pool_user_scope(user):
        if _borrow_mem_pool is not None:
            if _borrow_stub.freed_bytes or _borrow_stub.cursor_bytes > _borrow_extents_total // 2:
                _teardown_borrow_pool()
        if _borrow_mem_pool is None:
            if _borrow_stub is None:
                _borrow_stub = BumpArenaStub()
            runs = _borrow_static_runs      # (else: find_free_graph_pool_runs of the shared pool)
            _borrow_stub.set_extents(runs)
            _borrow_mem_pool = MemPool(_borrow_stub.allocator)
            _borrow_extents_total = sum(run_bytes for _, run_bytes in runs)
        with use_mem_pool(_borrow_mem_pool):
            yield


# --- the model, its decode CUDA graphs and EAGLE verify sampling ----------------------------------------------------

class DecodeModel:
    def __init__(self, gen, device):
        self.w1 = (torch.randn(HIDDEN, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(device)
        self.lm_head = (torch.randn(HIDDEN, VOCAB, generator=gen) * 1.5).to(device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(hidden @ self.w1) @ self.lm_head


class CudaGraphRunner:
    """One decode graph per batch size; each graph's output logits live in the external graph storage."""

    def __init__(self, model, storage: ExternalGraphStorage, device):
        self.model = model
        self.static_hidden = torch.zeros(max(CAPTURE_BS), HIDDEN, device=device)
        self.graphs, self.output_buffers = {}, {}
        for bs in CAPTURE_BS:
            logits_buf = storage.place((bs, VOCAB))

            def run_once(bs=bs, logits_buf=logits_buf):
                logits_buf.copy_(self.model.forward(self.static_hidden[:bs]))
                return logits_buf

            with graph_pool_capture_scope():
                g, out = capture(run_once, device=device, name=f"decode bs={bs}", owner="CudaGraphRunner",
                                 static={"hidden": self.static_hidden})
            self.graphs[bs], self.output_buffers[bs] = g, out

    def replay(self, hidden: torch.Tensor) -> torch.Tensor:
        bs = hidden.shape[0]
        self.static_hidden[:bs].copy_(hidden)
        with graph_pool_replay_scope():
            return replay(self.graphs[bs], self.output_buffers[bs])


def verify_sample(logits: torch.Tensor, device):
    """Greedy verify over the full-vocabulary target probabilities, which are borrowed from graph storage."""
    bs = logits.shape[0]
    with borrow_graph_pool("eagle verify"):
        target_probs = empty((bs, VOCAB), device)
        target_probs.copy_(torch.softmax(logits / TEMPERATURE, dim=-1))
        predict = target_probs.argmax(dim=-1, keepdim=True)
        accept_prob = target_probs.gather(1, predict)
        # return_logprob: the target logprobs of the accepted tokens, from the logits
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, predict)
    del target_probs                                            # step-local: back to the borrow pool
    return [predict.to(logits.dtype), accept_prob, logprobs]


def run(variant: str, device: str = "cpu"):
    gen = generator(37966)
    model = DecodeModel(gen, device)
    batches = [torch.randn(bs, HIDDEN, generator=gen).to(device) for bs in WORKLOAD]

    def serve(graphed: bool):
        if not graphed:
            _reset_borrow_state(variant)                       # no graphs: no graph storage, no borrowing
            outs = []
            for hidden in batches:
                outs += verify_sample(model.forward(hidden), device)
            return outs
        storage = ExternalGraphStorage(STORAGE_BYTES, device)
        _reset_borrow_state(variant, graph_memory_pool=storage)
        set_graph_pool_borrow_runs(storage.free_runs())         # reserved: all of it is free
        runner = CudaGraphRunner(model, storage, device)        # the graphs' logits are placed in it
        verify_sample(torch.zeros(max(CAPTURE_BS), VOCAB, device=device), device)   # sampling prewarm
        set_graph_pool_borrow_runs(storage.free_runs())         # what the graphs left free
        outs = []
        for hidden in batches:
            outs += verify_sample(runner.replay(hidden), device)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
