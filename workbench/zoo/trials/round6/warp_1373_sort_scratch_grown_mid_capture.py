"""A larger sort inside the capture grows the shared radix-sort scratch: the earlier captured sort keeps the freed block.

Upstream: https://github.com/NVIDIA/warp/issues/1373 ("`radix_sort_pairs` can cause CUDA errors when used
within graph capture"), fixed by commit 13d639900 ("Fix radix sort in CUDA graph capture (GH-1373)").
Symptom: a captured graph that runs ``wp.utils.radix_sort_pairs`` on 2,500 pairs and then on 100,000
pairs corrupts the CUDA context at ``wp.capture_launch`` (Warp 1.12.1); pre-seeding the scratch with the
larger sort before capture avoids it.
Mechanism: every sort takes its cub scratch from one per-stream cache, ``g_radix_sort_temp_map[stream]``,
and ``radix_sort_reserve_internal`` grows it by freeing the cached block and allocating a bigger one
whenever a call needs more. The first captured sort fits the block the pre-seed sort left in the cache, so
its kernels are recorded against that block; the second, larger sort frees it and allocates a new one in
the middle of the same capture. Every launch of the graph then runs the first sort in memory that was
released at capture time.
Doctor: dangling-reference, at ``radix_sort_pairs_device`` (the captured cub sort passes that read and
write the scratch block the cache released).
Fix (upstream): during a capture, take scratch that belongs to the capture (ephemeral graph allocations,
or per-capture side allocations the graph keeps until it is destroyed) and never free or grow the global
per-stream cache from inside a capture.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/warp/issues/1373"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "radix_sort_pairs_device"
SYMPTOM = "graph launch runs the first captured sort in the scratch block freed when the second sort grew it"
NAME = "warp_1373_sort_scratch_grown_mid_capture"

N_SMALL, N_LARGE = 4, 8          # the 2,500 and 100,000 pairs
LAUNCHES = 3


class RadixSortTemp:
    def __init__(self):
        self.mem = None
        self.size = 0


# use unique temp buffers per CUDA stream to avoid race conditions
g_radix_sort_temp_map: dict[str, RadixSortTemp] = {}
STREAM = "stream 0"


def sort_temp_size(n: int) -> int:
    """``cub::DeviceRadixSort::SortPairs(NULL, temp_size, ...)``: the scratch a sort of n pairs needs."""
    return 2 * n + 2


def radix_sort_reserve_internal(n: int, device: str) -> RadixSortTemp:
    """Host code before each sort: grow the stream's cached scratch if this sort needs more."""
    temp = g_radix_sort_temp_map.setdefault(STREAM, RadixSortTemp())
    size = sort_temp_size(n)
    if size > temp.size:
        temp.mem = None                                   # wp_free_device(temp.mem)
        temp.mem = torch.zeros(size, device=device)       # wp_alloc_device(size)
        temp.size = size
    return temp


class CaptureTemp:
    """The fix: scratch owned by the capture (a graph allocation), not the stream's global cache."""

    def __init__(self, n, device):
        self.mem = torch.zeros(sort_temp_size(n), device=device)
        self.size = self.mem.numel()


def acquire_temp_buffer(n: int, device: str, variant: str):
    if variant == "fix" and torch.cuda.is_current_stream_capturing():
        return CaptureTemp(n, device)                     # ephemeral: released after use, never cached
    return radix_sort_reserve_internal(n, device)


def radix_sort_pairs_device(keys, values, n, temp):
    """``cub::DeviceRadixSort::SortPairs`` on a DoubleBuffer (second halves of keys/values), then the
    copy back into the first halves. The scratch carries the keys through the passes."""
    scratch = temp.mem
    scratch[:n].copy_(keys[:n])
    scratch[n:2 * n].copy_(values[:n].to(scratch.dtype))
    order = torch.argsort(scratch[:n], stable=True)
    keys[n:2 * n].copy_(scratch[:n][order])
    values[n:2 * n].copy_(scratch[n:2 * n][order].to(values.dtype))
    keys[:n].copy_(keys[n:2 * n])                         # d_keys.Current() != keys: wp_memcpy_d2d
    values[:n].copy_(values[n:2 * n])


def radix_sort_pairs(keys, values, n, device, variant):
    """``wp.utils.radix_sort_pairs``: keys and values hold 2n entries (the second half is scratch)."""
    temp = acquire_temp_buffer(n, device, variant)
    radix_sort_pairs_device(keys, values, n, temp)


def make_arrays(count, device):
    return torch.zeros(2 * count, device=device), torch.zeros(2 * count, dtype=torch.int32, device=device)


def upload(keys_np, values_np, keys, values):
    count = keys_np.numel()
    keys.copy_(torch.cat([keys_np, torch.zeros(count)]).to(keys.device))
    values.copy_(torch.cat([values_np, torch.zeros(count, dtype=torch.int32)]).to(values.device))


def run(variant: str, device: str = "cpu"):
    gen = generator(1373)
    launches = [(torch.randn(N_SMALL, generator=gen), torch.randn(N_LARGE, generator=gen))
                for _ in range(LAUNCHES)]
    vs_np = torch.arange(N_SMALL, dtype=torch.int32)
    vl_np = torch.arange(N_LARGE, dtype=torch.int32)

    def serve(graphed: bool):
        g_radix_sort_temp_map.clear()
        ks, vs = make_arrays(N_SMALL, device)
        kl, vl = make_arrays(N_LARGE, device)
        upload(launches[0][0], vs_np, ks, vs)
        radix_sort_pairs(ks, vs, N_SMALL, device, variant)     # seed the global scratch with a small sort

        def step():
            radix_sort_pairs(ks, vs, N_SMALL, device, variant)
            radix_sort_pairs(kl, vl, N_LARGE, device, variant)  # needs bigger scratch mid-capture
            return ks[:N_SMALL], vs[:N_SMALL], kl[:N_LARGE], vl[:N_LARGE]

        g = out = None
        if graphed:
            # wp.ScopedCapture: no warmup; the arrays are sorted in place, so no buffer is a read-only input
            g, out = capture(step, device=device, warmups=0, name="wp.ScopedCapture")
        results = []
        for keys_small, keys_large in launches:
            upload(keys_small, vs_np, ks, vs)
            upload(keys_large, vl_np, kl, vl)
            if graphed:
                sorted_arrays = replay(g, out)                  # wp.capture_launch(capture.graph)
            else:
                sorted_arrays = step()
            results += [t.clone().float() for t in sorted_arrays]
        return results

    return compare(NAME, variant, device, lambda: serve(True), lambda: serve(False))
