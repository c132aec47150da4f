"""tinygrad TinyJit: the cache collector keys its output placeholders by the underlying device buffer; when the LRU allocator really frees a cached device buffer and a later, larger output lands at the same device address, the collector takes the dead buffer's placeholder for it, so the replayed kernel list writes an 8-element output into the 4-element buffer that placeholder allocates.

Upstream: https://github.com/tinygrad/tinygrad/pull/1802 ("fix jit buffer reuse when freed", tinygrad/tinygrad, by
nimlgen, opened and merged 2023-09-06, merge commit a78a1fa499b037f2d7b61f32eaf54abd04d41068; closes #1799).
Read: the PR page (description "Closes #1799", the change counts, geohot's review thread on ``_Placeholder``) and the
merge commit's full diff of ``tinygrad/jit.py`` (``_CacheCollector.add`` no longer ``setdefault``s a placeholder for
any output whose signature is known: a new output takes a freed placeholder of the same type or a new one;
``_on_buf_free`` pops the placeholder of an underlying buffer the allocator frees; ``_buftype_key`` includes the
device; ``_mark_output_buffer`` / ``circular_signatures``), ``tinygrad/runtime/lib.py`` (``LRUAllocator._free_buffer``
calls ``CacheCollector._on_buf_free``), ``tinygrad/ops.py`` and ``test/test_cache_collector.py`` (FakeAllocator of 256
bytes, ``test_cache_collector_optimize_when_not_cached_anymore``). At the parent commit 22cf15e9d: ``TinyJit.__call__``
(cnt 0 eager, cnt 1 collect, cnt >= 2 replay ``jit_cache`` with ``input_replace``), ``_CacheCollector`` (``start``,
``add``, ``finish``, ``_Placeholder``), ``RawBuffer`` and ``LRUAllocator`` (``alloc``, ``free``, ``_alloc_buffer``
evicting the oldest cached buffers when ``free_space`` goes negative, ``_free_buffer``). Issue #1799 itself was not read.
Symptom: a jitted function whose collection run makes the LRU allocator free cached device memory replays wrongly
(on the GPU an out-of-bounds write into a too-small intermediate buffer and garbage results; in torch the kernel's
copy raises), while the same function without the JIT is correct.
Mechanism: ``add`` maps every output by its signature (the underlying device buffer) to a placeholder with
``placeholders.setdefault(sig, _Placeholder(buf)).ref = ref(buf)``, assuming a known signature means the same memory
reused by a same-typed RawBuffer. When ``_alloc_buffer`` runs out of ``free_space`` it frees the oldest cached device
buffer, and the device hands its address to the next allocation, of another size; the placeholder of the freed
4-element buffer is still in ``placeholders``, so the new 8-element output gets it. ``finish`` allocates that dead
placeholder's backing buffer with its recorded size (4), and the replayed kernel list writes 8 elements into it and
reads 8 back. Eager (and the collection run, which used the real buffers) are correct.
Doctor: undersized-buffer, at add. ``add`` binds a new output to a placeholder recorded for a freed buffer of another
size, so the buffer ``finish`` allocates for the replays is smaller than the data the kernel writes into it.
Fix (upstream): ``LRUAllocator._free_buffer`` calls ``CacheCollector._on_buf_free``, which moves the freed buffer's
placeholder out of ``placeholders`` into ``freed_placeholders`` (by type); ``add`` updates the ref only of a placeholder
still live under the signature, and gives a new output a freed placeholder of its own type (or a new one).
Modelled: ``TinyJit.__call__``, ``_CacheCollector`` (``start``, ``add``, ``finish``, ``_Placeholder``, both variants as in
the diff; ``_mark_output_buffer`` exists but nothing here assigns, so ``circular_signatures`` stays empty), ``RawBuffer``
(frees to its allocator in ``__del__``) and ``LRUAllocator`` as read. Stand-ins: the device (``_do_alloc`` hands out the
most recently freed address first, as a device allocator does, and an underlying buffer compares and hashes by its
address, like a device pointer); the kernels are torch ops writing their output buffer in place; ``Tensor`` laziness is
left out (each op realizes at once); the replay loop of the ``jit_cache`` (cnt >= 2) is captured once as one graph
(as tinygrad's later graph runners batch it) and ``input_replace`` becomes a copy into the graph's input buffer; float64.
Workload: f(x) = 0.5 * cat(b, 2b) + x with a = 3 * x[:4], b = a + 1, for x of 8 elements, 5 calls (0 eager, 1 collect,
2-4 replayed), device memory 224 bytes. In the collection run allocating the 8-element cat output evicts a's cached
4-element device buffer and reuses its address (and the returned output reuses b's, taking b's placeholder, which is
harmless: b is dead before it is written). Bug: the first replay (the warm-up of the replay loop before its capture)
raises RuntimeError in the E_8_cat kernel ("The size of tensor a (4) must match the size of tensor b (8)": its output
is the 4-element buffer ``finish`` allocated for a's placeholder). Fix: the five outputs equal eager (max |graph -
eager| = 0), deterministically.
"""
from __future__ import annotations

import functools
from collections import defaultdict, deque
from weakref import ref

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/tinygrad/tinygrad/pull/1802"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "add"
SYMPTOM = ("TinyJit binds a new output to the placeholder of a device buffer the LRU allocator freed at the same "
           "address, so the replayed kernels write an 8-element output into a 4-element buffer")

DTYPE, ITEMSIZE = torch.float64, 8
DEV_MEMSZ = 224                       # bytes of device memory the LRU allocator may use
N = 8

_variant = "bug"
_device = "cpu"


# --- the device (stand-in): buffers identified by their address, freed addresses handed out again first ------------

class DeviceBuffer:
    def __init__(self, addr, size):
        self.addr, self.mem = addr, torch.zeros(max(1, size), dtype=DTYPE, device=_device)

    def __eq__(self, other): return isinstance(other, DeviceBuffer) and other.addr == self.addr
    def __hash__(self): return hash(self.addr)


class Device:
    def __init__(self):
        self.next_addr, self.freed_addrs = 0x1000, []

    def malloc(self, size):
        if self.freed_addrs:
            return DeviceBuffer(self.freed_addrs.pop(), size)
        self.next_addr += 0x100
        return DeviceBuffer(self.next_addr, size)

    def free(self, buf):
        self.freed_addrs.append(buf.addr)
        buf.mem = None


# --- tinygrad/runtime/lib.py -------------------------------------------------------------------------------------------

class RawBuffer:
    def __init__(self, size, dtype, buf=None, allocator=None, **kwargs):
        self.size, self.dtype = size, dtype
        self._buf = buf if buf is not None else (allocator.alloc(size, dtype, **kwargs) if allocator else None)
        self._memsz = size * ITEMSIZE
        self._allocator = allocator
        self._device = kwargs.get("device", None)

    def __del__(self):
        if getattr(self, "_allocator", None):
            self._allocator.free(self._buf)

    @property
    def mem(self): return self._buf.mem[:self.size]


class LRUAllocator:
    def __init__(self, dev, dev_memsz=DEV_MEMSZ):
        self.dev, self.epoch = dev, 0
        self.free_space = defaultdict(lambda: dev_memsz)
        self.buffer_info = {}
        self.cached_buffers = defaultdict(deque)          # newest first
        self.aging_order = defaultdict(deque)             # oldest first

    def _cache_reuse_buffer(self, rawbufs):
        return rawbufs.popleft()[0]

    def _alloc_buffer(self, size, dtype, device, **kwargs):
        self.free_space[device] -= size * ITEMSIZE
        while len(self.aging_order[device]) and self.free_space[device] < 0:     # When OOM removing lru buffers.
            bucket, epoch = self.aging_order[device].popleft()
            if self.cached_buffers[bucket] and self.cached_buffers[bucket][-1][1] == epoch:
                self._free_buffer(self.cached_buffers[bucket].pop()[0])
        newbuf = self._do_alloc(max(1, size), dtype, device, **kwargs)
        self.buffer_info[newbuf] = (size, dtype, device)
        return newbuf

    def _free_buffer(self, buf_to_free):
        if _variant == "fix":
            CacheCollector._on_buf_free(buf_to_free)
        self.free_space[self.buffer_info[buf_to_free][2]] += self._underlying_buf_memsz(buf_to_free)
        self.buffer_info.pop(buf_to_free)
        self._do_free(buf_to_free)

    def alloc(self, size, dtype, device="0", **kwargs):
        rawbufs = self.cached_buffers.get(self._cached_bufkey(size, dtype, device), None)
        return self._cache_reuse_buffer(rawbufs) if rawbufs else self._alloc_buffer(size, dtype, device, **kwargs)

    def free(self, buf):          # free() just caches buffer. It might be freed later when OOM during allocation.
        self.epoch += 1
        size, dtype, device = self.buffer_info[buf]
        self.cached_buffers[self._cached_bufkey(size, dtype, device)].appendleft((buf, self.epoch))
        self.aging_order[device].append((self._cached_bufkey(size, dtype, device), self.epoch))

    def _underlying_buf_memsz(self, buf): return self.buffer_info[buf][0] * ITEMSIZE
    def _cached_bufkey(self, size, dtype, device): return (device, size, dtype)
    def _do_alloc(self, size, dtype, device, **kwargs): return self.dev.malloc(size)
    def _do_free(self, buf): self.dev.free(buf)


ALLOCATOR: LRUAllocator = None


class RawDeviceBuffer(RawBuffer):
    def __init__(self, size, dtype, device="0"):
        super().__init__(size, dtype, allocator=ALLOCATOR, device=device)


# --- tinygrad/jit.py ---------------------------------------------------------------------------------------------------

class TinyJit:
    def __init__(self, fxn):
        self.fxn, self.cnt, self.jit_cache, self.ret, self.input_replace = fxn, 0, [], None, {}
        self.graph = self.input_buf = None

    def __call__(self, *args):
        input_rawbuffers = dict(enumerate(args))
        if self.cnt >= 2:
            if self.graph is None:              # stand-in: the replay loop below, captured once as a graph
                self.input_buf = RawDeviceBuffer(N, DTYPE)
                for (j, i) in self.input_replace:
                    self.jit_cache[j][1][i] = self.input_buf

                def replay_jit_cache():
                    for prg, pargs, variables in self.jit_cache:
                        prg(pargs, variables, jit=True)
                    return self.ret.mem

                self.input_buf.mem.copy_(input_rawbuffers[0].mem)
                self.graph, self.out = capture(replay_jit_cache, device=_device, name="TinyJit jit_cache",
                                               static={"input_buf": self.input_buf.mem}, owner="TinyJit")
            self.input_buf.mem.copy_(input_rawbuffers[0].mem)
            replay(self.graph, self.out)
        elif self.cnt == 1:
            CacheCollector.start()
            self.ret = self.fxn(*args)
            self.jit_cache = CacheCollector.finish()
            assert len(self.jit_cache) != 0, "didn't JIT anything!"
            for j_, cache in enumerate(self.jit_cache):
                for i, a in enumerate(cache[1]):
                    if a in input_rawbuffers.values():
                        self.input_replace[(j_, i)] = [k for k, v in input_rawbuffers.items() if v is a][0]
            for (j, i) in self.input_replace:
                self.jit_cache[j][1][i] = None
        elif self.cnt == 0:
            self.ret = self.fxn(*args)
        self.cnt += 1
        return self.ret


class _CacheCollector:
    class _Placeholder:
        def __init__(self, buf):
            self.size, self.dtype, self._device, self.ref, self.buftype = (buf.size, buf.dtype,
                                                                           getattr(buf, "_device", None), ref(buf),
                                                                           type(buf))

        def alive(self): return self.ref() is not None

        def alloc_rawbuf(self):
            return self.buftype(self.size, self.dtype, **({"device": self._device} if self._device is not None else {}))

    def __init__(self):
        self.cache = None
        self.placeholders, self.last_buftype, self.last_placeholder_index = {}, {}, {}
        self.freed_placeholders, self.circular_signatures = defaultdict(list), set()

    def start(self):
        self.cache, self.placeholders, self.last_buftype, self.last_placeholder_index = [], {}, {}, {}
        self.freed_placeholders, self.circular_signatures = defaultdict(list), set()

    def add(self, prg, rawbufs, var_vals):
        if self.cache is None:
            return
        for buf in rawbufs[1:]:
            if isinstance(buf, RawBuffer) and self._get_signature(buf) in self.placeholders and \
                    self.placeholders[self._get_signature(buf)].ref != ref(buf):
                self.placeholders.pop(self._get_signature(buf))
            if isinstance(buf, RawBuffer) and self._get_signature(buf) not in self.placeholders:
                self.last_buftype[self._buftype_key(buf)] = len(self.cache)
        sig = self._get_signature(rawbufs[0])
        if _variant == "bug":
            # a known signature is taken to be the same memory: the placeholder recorded for it is reused
            self.placeholders.setdefault(sig, _CacheCollector._Placeholder(rawbufs[0])).ref = ref(rawbufs[0])
        elif sig in self.placeholders:
            self.placeholders[sig].ref = ref(rawbufs[0])
        else:
            # This is a new output buffer. Try to reuse any freed placeholders with the same type to "merge" these buffers.
            freed = self.freed_placeholders[self._buftype_key(rawbufs[0])]
            plh = freed.pop() if sig not in self.circular_signatures and freed else _CacheCollector._Placeholder(rawbufs[0])
            self.placeholders.setdefault(sig, plh).ref = ref(rawbufs[0])
        self.last_placeholder_index[self.placeholders[sig]] = len(self.cache)
        self.cache.append((prg, [self.placeholders.get(self._get_signature(x), x) for x in rawbufs], var_vals))

    def finish(self):
        if self.cache is None:
            return []
        placeholder_mapper, cache_result = {}, []
        for j, (p, cached_bufs, var_vals) in enumerate(self.cache):
            if cached_bufs[0].__class__ is _CacheCollector._Placeholder:
                if cached_bufs[0].alive():
                    if self.last_buftype.get(self._buftype_key(cached_bufs[0]), -1) < j or \
                            self.last_placeholder_index[cached_bufs[0]] == j:
                        placeholder_mapper[cached_bufs[0]] = cached_bufs[0].ref()
                    elif cached_bufs[0] not in placeholder_mapper:
                        placeholder_mapper[cached_bufs[0]] = cached_bufs[0].alloc_rawbuf()
                elif cached_bufs[0] not in placeholder_mapper:
                    placeholder_mapper[cached_bufs[0]] = cached_bufs[0].alloc_rawbuf()
            cache_result.append((p, [placeholder_mapper.get(buf, buf) for buf in cached_bufs], var_vals))
        self.cache, self.placeholders, self.last_buftype, self.last_placeholder_index = None, {}, {}, {}
        self.freed_placeholders, self.circular_signatures = defaultdict(list), set()
        return cache_result

    def _mark_output_buffer(self, output_buffer): self.circular_signatures.add(self._get_signature(output_buffer))

    def _on_buf_free(self, underlying_buf):
        if underlying_buf not in self.placeholders:
            return
        self.freed_placeholders[self._buftype_key(self.placeholders[underlying_buf])].append(
            self.placeholders[underlying_buf])
        self.placeholders.pop(underlying_buf)

    def _get_signature(self, buf):
        return buf._buf if getattr(buf, "_buf", None) is not None and getattr(buf, "_allocator", None) is not None \
            else buf

    def _buftype_key(self, buf):
        if _variant == "bug":
            return (buf.size, buf.dtype)
        return (buf.size, buf.dtype, buf._device)


CacheCollector = _CacheCollector()


# --- the kernels (stand-in for compiled programs: each writes its output buffer) and the jitted function -------------

class Kernel:
    """A compiled program: its element counts are baked in; it reads and writes device memory by address, so a too
    small output buffer is an out-of-bounds write (the slice of the device allocation is short and the copy fails)."""
    def __init__(self, name, op, out_size, in_sizes):
        self.name, self.op, self.out_size, self.in_sizes = name, op, out_size, in_sizes

    def __call__(self, rawbufs, var_vals, jit=False):
        ins = [b._buf.mem[:n] for b, n in zip(rawbufs[1:], self.in_sizes)]
        rawbufs[0]._buf.mem[:self.out_size].copy_(self.op(*ins))


def exec_ast(kernel, *inputs):
    """``Compiled.exec_ast``: allocate the output, run the program, hand it to the cache collector."""
    output = RawDeviceBuffer(kernel.out_size, DTYPE)
    rawbufs = [output, *inputs]
    kernel(rawbufs, {})
    CacheCollector.add(kernel, rawbufs, {})
    return output


K_SHRINK_MUL = Kernel("E_4_shrink_mul", lambda x: x[:4] * 3.0, 4, (N,))
K_ADD = Kernel("E_4_add", lambda a: a + 1.0, 4, (4,))
K_CAT = Kernel("E_8_cat", lambda b: torch.cat([b, 2.0 * b]), 8, (4,))
K_MULADD = Kernel("E_8_muladd", lambda c, x: 0.5 * c + x, 8, (8, N))


def f(x):
    a = exec_ast(K_SHRINK_MUL, x)
    b = exec_ast(K_ADD, a)
    del a                                  # a's device buffer goes back to the LRU cache
    c = exec_ast(K_CAT, b)              # OOM: the allocator frees a's cached buffer, c gets its address
    del b
    return exec_ast(K_MULADD, c, x)


def run(variant: str, device: str = "cpu"):
    global _variant, _device, ALLOCATOR
    _variant, _device = variant, device
    gen = generator(1802)
    xs = [randn(N, gen=gen, device="cpu").to(DTYPE) for _ in range(5)]

    def serve(jit: bool):
        global ALLOCATOR
        ALLOCATOR = LRUAllocator(Device())
        CacheCollector.__init__()
        fxn = TinyJit(f) if jit else f
        outs = []
        for x_host in xs:
            x = RawDeviceBuffer(N, DTYPE)
            x.mem.copy_(x_host.to(device))
            outs.append(fxn(x).mem.clone())
            del x
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, functools.partial(serve, True),
                       functools.partial(serve, False))
