"""Graph-pool memory as blocks the pool hands on, as CUDA's caching allocator does.

A CUDA graph's private pool keeps the blocks its captures allocated. A block whose tensors are all
gone is *free*: the next allocation of a capture into the same pool may be placed in it, whether
the block was freed by a dropped graph's output (a re-capture then writes where a later graph
reads, which is how graphs of one pool hand results on) or freed inside the same capture (a
temporary's memory reused by a later temporary). Code that frees memory a graph still needs
(torchcomms #877, warp #1419) silently reads someone else's data; the emulation must too.

How "free" is known without hooking the allocator: graphs never hold the user's tensor objects,
only private aliases (``CPUGraph._alias``); the pool holds one whole-storage view per block, and
torch keeps the storage's one Python object. A block is free when its storage's use count is
exactly those references: no user tensor is left.
"""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from .errors import GraphError

_use_count = torch._C._storage_Use_Count


class Block:
    """One storage of the pool, and the graphs whose recorded ops reference it."""

    __slots__ = ("whole", "nbytes", "users")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        with _disable_current_modes():     # the pool's bookkeeping, not an op of the watched code
            self.whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.nbytes = storage.nbytes()
        self.users: dict[int, weakref.ref] = {}       # id(graph ref) -> graph ref


class Pool:
    """Memory owned by graphs (a CUDA graph's private mempool). Several graphs may share one.

    Graphs are held weakly: a graph holds its pool, so a strong back-reference would keep dropped
    graphs (and their blocks) alive until the garbage collector runs. A block nobody's graph uses
    any more leaves the pool at once; a block a live graph uses stays, and is handed on when free.
    """

    def __init__(self) -> None:
        self._blocks: dict[int, Block] = {}
        self._graphs: set[int] = set()      # id(graph ref) of the graphs captured into it, until reset or dropped
        self._left: list = []               # the blocks it still had when its last graph went (``_enter``)
        self._loose: list = []              # blocks no graph uses whose tensors live: still the pool's

    def _enter(self, graph) -> weakref.ref:
        """A capture into this pool begins: the graph's weak reference, by which the pool forgets it
        when it is dropped (or reset). CUDA's caching allocator counts the graphs that use a
        private pool. When the last one is reset or dropped while a tensor the pool allocated is
        still held (a graph's output), the pool waits to be freed, and a capture given its handle
        fails (``TORCH_INTERNAL_ASSERT(it->second->use_count > 0)`` in the allocator); once all its
        memory is free the handle starts a new pool (measured on an H200, torch 2.11, with or
        without ``empty_cache``: ``results/gpu/engine_probes.json``, ``pool_handle_reuse``)."""
        if not self._graphs and any(not ref.expired() for ref in self._left):
            raise GraphError(
                "capture into a graph pool whose graphs have all been reset or dropped while memory it allocated "
                "is still held (a graph's output): CUDA's caching allocator refuses the handle (INTERNAL ASSERT "
                "use_count > 0). Take a fresh graph_pool_handle() for the new captures, keep one graph of the "
                "pool alive until they are captured, or let go of the old outputs first.")
        self._left = []
        graph_ref = weakref.ref(graph, self._forget)
        self._graphs.add(id(graph_ref))
        return graph_ref

    def owns(self, key: int) -> bool:
        return key in self._blocks

    def _adopt(self, graph_ref: weakref.ref, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        block = self._blocks.get(storage._cdata)
        if block is None:
            block = self._blocks[storage._cdata] = Block(storage)
        block.users[id(graph_ref)] = graph_ref

    def _drop(self, key: int) -> None:
        """The storage ``key`` is not graph memory after all (host memory, see ``CPUGraph._claim_host``)."""
        self._blocks.pop(key, None)

    def _forget(self, graph_ref: weakref.ref) -> None:
        """A graph was reset or dropped: it uses none of the pool's blocks any more."""
        if id(graph_ref) in self._graphs:
            self._graphs.discard(id(graph_ref))
            if not self._graphs:
                self._left = [StorageWeakRef(b.whole.untyped_storage()) for b in self._blocks.values()]
                self._left += [ref for ref in self._loose if not ref.expired()]
        self._loose = [ref for ref in self._loose if not ref.expired()]
        for key in list(self._blocks):
            users = self._blocks[key].users
            users.pop(id(graph_ref), None)
            if not users:       # (a tensor still holding it keeps it the pool's: CUDA counts it at ``_enter``)
                self._loose.append(StorageWeakRef(self._blocks.pop(key).whole.untyped_storage()))

    def _free_block(self, nbytes: int, busy: set, aliases) -> torch.UntypedStorage | None:
        """A block of exactly ``nbytes`` that no user tensor holds (see module doc), not in
        ``busy``; ``aliases(key)`` counts the live graphs' private references to a block."""
        for key, block in self._blocks.items():
            if block.nbytes != nbytes or key in busy:
                continue
            ours = 2 + sum(aliases(ref(), key) for ref in block.users.values() if ref() is not None)
            if _use_count(key) == ours:
                return block.whole.untyped_storage()
        return None

    def __len__(self) -> int:
        return len(self._blocks)

    def __repr__(self) -> str:
        return f"Pool({len(self)} storages)"
