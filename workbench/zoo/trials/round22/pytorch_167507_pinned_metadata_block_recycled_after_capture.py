"""A pinned host block that a captured H2D copy reads is recycled by the caching host allocator right after capture.

Upstream: https://github.com/pytorch/pytorch/pull/167507 ("Make CachingHostAllocator work with memory pools."),
following https://github.com/pytorch/pytorch/pull/161583 ("Memory pool support for Caching Host Allocator.")
and the draft https://github.com/pytorch/pytorch/pull/146924 ("Support pin_memory() during CUDA stream capture").
Symptom: ops that stage small metadata through pinned host memory and copy it to the device with
``non_blocking=True`` (``torch._chunk_cat``, used by FSDP2's reduce-scatter copy-in, and others listed in
#166765) "did not work in cudagraph": a replayed graph copies whatever now sits in the pinned block, not what
the op wrote there (galv, #161583: "If a cuda graph's operations read from pinned host memory, that pinned host
memory cannot be recycled ... the actual read from host memory won't happen until after cudaGraphLaunch()";
tracked for SimpleFSDP x CUDAGraph in #167861).
Mechanism: ``detail::pack_vecs`` allocates a pinned buffer from the ``CachingHostAllocator``, writes the
metadata vectors into it on the host and issues a ``non_blocking`` H2D copy; the copy calls ``record_event``
for the block on the current stream, and when the buffer tensor dies ``free`` queues the block behind that
event. ``process_events`` returns a block to the free list once ``cudaEventQuery`` reports its event complete.
An event recorded on a capturing stream stands for no work at all (the copy only runs at replay), so the query
reports it complete at once: right after capture the block goes back to the free list, and the next pinned
allocation of its size class (here the next batch's input staging) is handed the same block and overwrites it.
Every replay's captured memcpy then reads that data as the chunk-cat metadata.
Doctor: dangling-reference, at ``process_events`` (it hands on a pinned block whose last reader is a captured
copy that reads it at every replay).
Fix (upstream): ``CUDAGraph::capture_begin``/``capture_end`` call ``begin_allocate_to_pool`` /
``end_allocate_to_pool`` on the host allocator too; host allocations made while capturing belong to the graph's
pool, and a block on which ``record_event()`` is called during stream capture is never reused ("we refuse to
reuse a host memory block as soon as record_event() is called on that block") while that pool lives.
(Read: the PR descriptions, the ``CUDAGraph.cpp`` hunk of #167507 and the design discussion in #161583; the
allocator's C++ diff was not available, so ``CachingHostAllocator`` below models its documented behaviour. How a
pre-fix capture reached the allocator depended on the capture mode: #146924 found ``pin_memory()`` inside a
"global"-mode capture failing on the event query itself; the silent recycling is the "thread_local"/"relaxed"
case, as in galv's example. The chunk-cat kernel gathers through the metadata with ordinary tensor ops; a fresh
allocator per run.)
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph_pool_handle, host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/167507"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "process_events"
SYMPTOM = "a captured _chunk_cat reads its pinned metadata block after the allocator handed it to the next batch"
SIZES = (10, 9, 13)          # three gradient shards, concatenated into one 32-float input
NUMEL = sum(SIZES)
NUM_CHUNKS, STEPS = 2, 4


def _is_capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class Event:
    """A CUDA event recorded on the current stream: complete once the stream has drained. One recorded
    on a capturing stream stands for no work: ``cudaEventQuery`` reports it complete at once."""

    def __init__(self):
        self.captured = _is_capturing()
        self.complete = self.captured

    def query(self) -> bool:
        return self.complete


class Block:
    def __init__(self, size: int, device: str):
        self.size = size
        self.data = host(torch.empty(size, dtype=torch.uint8), device)   # one pinned allocation
        self.events: list[Event] = []
        self.graph_pool = None          # the fix: a block a capture read belongs to that graph's pool


class CachingHostAllocator:
    """``at::CachingHostAllocator`` (pinned memory): blocks of power-of-two size classes, a free list per
    class (the most recently freed block first), and blocks with pending stream uses parked behind events."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.free_list: dict[int, list[Block]] = {}
        self.events: list[Block] = []              # freed blocks whose events may still be pending
        self.allocating_to_pool = None             # the fix: the pool of the capture under way
        self.pool_blocks: dict[int, list[Block]] = {}

    @staticmethod
    def round_size(nbytes: int) -> int:
        return 1 << max(nbytes - 1, 0).bit_length()

    def allocate(self, nbytes: int) -> Block:
        size = self.round_size(nbytes)
        self.process_events()
        free = self.free_list.get(size)
        block = free.pop() if free else Block(size, self.device)
        block.events = []
        return block

    def record_event(self, block: Block) -> None:
        """Called by ``copy_`` for a ``non_blocking`` copy that reads the pinned block on a stream."""
        block.events.append(Event())
        if self.variant == "fix" and _is_capturing():
            block.graph_pool = self.allocating_to_pool   # never reused while that graph's pool lives

    def free(self, block: Block) -> None:
        if block.graph_pool is not None:
            self.pool_blocks.setdefault(id(block.graph_pool), []).append(block)
        elif block.events:
            self.events.append(block)
        else:
            self.free_list.setdefault(block.size, []).append(block)

    def process_events(self) -> None:
        """Blocks whose recorded events all query complete go back to their free list."""
        pending = []
        for block in self.events:
            if all(e.query() for e in block.events):
                self.free_list.setdefault(block.size, []).append(block)
            else:
                pending.append(block)
        self.events = pending

    def synchronize(self) -> None:
        """The streams drained (``torch.cuda.synchronize``): every recorded event is complete."""
        for block in self.events:
            for e in block.events:
                e.complete = True

    def begin_allocate_to_pool(self, pool) -> None:
        if self.variant == "fix":
            self.allocating_to_pool = pool

    def end_allocate_to_pool(self, pool) -> None:
        if self.variant == "fix":
            self.allocating_to_pool = None


def pack_vecs(allocator, vecs, device):
    """ATen ``detail::pack_vecs``: the int64 vectors, packed into one pinned buffer, copied to the device."""
    numel = sum(len(v) for v in vecs)
    block = allocator.allocate(numel * 8)
    packed_host = block.data[:numel * 8].view(torch.int64)
    values = [value for vec in vecs for value in vec]
    packed_host.copy_(host(torch.tensor(values, dtype=torch.int64), device))   # a host memcpy, on the CPU
    packed = packed_host.to(device, non_blocking=True)  # H2D copy from the pinned block
    allocator.record_event(block)
    allocator.free(block)                               # the buffer tensor goes out of scope
    return packed.view(len(vecs), -1)


def get_chunk_cat_metadata(tensors, num_chunks):
    actual = [t.numel() for t in tensors]
    pad = [-(-m // num_chunks) for m in actual]
    src_start = [sum(actual[:i]) for i in range(len(actual))]
    dst_start = [sum(pad[:i]) for i in range(len(pad))]
    return pad, actual, src_start, dst_start


def _chunk_cat_cuda(allocator, tensors, num_chunks, device):
    """``torch._chunk_cat(tensors, dim=0, num_chunks)``: each tensor split into ``num_chunks`` padded chunks,
    chunk ``c`` of every tensor concatenated into row ``c``. The kernel reads its metadata from the device."""
    pad_h, _, _, _ = get_chunk_cat_metadata(tensors, num_chunks)
    width = sum(pad_h)
    meta = pack_vecs(allocator, get_chunk_cat_metadata(tensors, num_chunks), device)
    pad, actual, src_start, dst_start = meta[0], meta[1], meta[2], meta[3]
    flat = torch.cat(tensors)
    col = torch.arange(width, device=device)
    row = torch.arange(num_chunks, device=device)
    tidx = ((col[:, None] >= dst_start[None, :]).sum(1) - 1).clamp(0, len(tensors) - 1)
    within = col - dst_start[tidx]
    elem = row[:, None] * pad[tidx][None, :] + within[None, :]
    valid = (elem >= 0) & (elem < actual[tidx][None, :])
    src = (src_start[tidx][None, :] + elem).clamp(0, flat.numel() - 1)
    return torch.where(valid, flat[src], torch.zeros((), device=device))


class ReduceScatterCopyIn:
    """A step whose gradients (three shards) are packed for a reduce-scatter with ``_chunk_cat``."""

    def __init__(self, device, variant):
        gen = generator(167507)
        self.weight = randn(NUMEL, gen=gen, device=device)
        self.allocator = CachingHostAllocator(device, variant)
        self.device = device

    def step(self, x):
        grad = torch.tanh(x) * self.weight
        shards = list(torch.split(grad, SIZES))
        return _chunk_cat_cuda(self.allocator, shards, NUM_CHUNKS, self.device)

    def stage(self, batch, dst):
        """The input pipeline: the next batch through a pinned staging block, copied ``non_blocking``."""
        block = self.allocator.allocate(NUMEL * 4)
        block.data[:NUMEL * 4].view(torch.float32).copy_(host(batch, self.device))
        dst.copy_(block.data[:NUMEL * 4].view(torch.float32), non_blocking=True)
        self.allocator.record_event(block)
        self.allocator.free(block)

    def drain(self):
        synchronize(self.device)
        self.allocator.synchronize()


def run(variant: str, device: str = "cpu"):
    gen = generator(161583)
    batches = [torch.randn(NUMEL, generator=gen) for _ in range(STEPS + 1)]

    def served():
        mod = ReduceScatterCopyIn(device, variant)
        x = torch.zeros(NUMEL, device=device)
        mod.stage(batches[0], x)
        with events.warmup():                       # warmup on the side stream, then sync
            mod.step(x)
        mod.drain()
        pool = graph_pool_handle(device)
        mod.allocator.begin_allocate_to_pool(pool)  # CUDAGraph::capture_begin (the fix)
        g, out = capture(lambda: mod.step(x), device=device, pool=pool, warmups=0, name="copy-in",
                         owner="graphed training step", static={"x": x})
        mod.allocator.end_allocate_to_pool(pool)    # CUDAGraph::capture_end (the fix)
        outs = []
        for batch in batches[1:]:
            mod.stage(batch, x)
            outs.append(replay(g, out).clone())
            mod.drain()
        return outs

    def eager():
        mod = ReduceScatterCopyIn(device, variant)
        x = torch.zeros(NUMEL, device=device)
        outs = []
        for batch in batches[1:]:
            mod.stage(batch, x)
            outs.append(mod.step(x).clone())
            mod.drain()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
