"""ggml-cuda's multi-row argsort calls CUB ``DeviceSegmentedSort``, which copies its partition group sizes to the host and syncs the stream mid-dispatch; inside ggml's CUDA-graph capture that sync is refused and the capture aborts.

Upstream: https://github.com/ggml-org/llama.cpp/pull/21718 ("CUDA: Limit DeviceSegmentedSort to immediate mode",
Oliver Simons, merged; synced to ggml as ggml-org/ggml@c400095e on 2026-04-13). The bug came in with
https://github.com/ggml-org/llama.cpp/pull/17004 ("sampling : add support for backend sampling"), which replaced the
capturable ``DeviceSegmentedRadixSort`` with ``DeviceSegmentedSort`` for nrows > 1. CUB side: NVIDIA/cccl#5661
("CUB stable sort pair fails during graph capture for certain sizes": above 500 segments, "operation failed due to a
previous error during capture").
Symptom: with CUDA graphs on, a ggml graph holding an ARGSORT (or the TOP_K fallback to argsort when CCCL < 3.2) over
more than 1024 columns and more than CUB's partitioning threshold of rows (500 segments) aborts at its first capture:
``CUDA error: operation not permitted when stream is capturing`` from ``CUDA_CHECK`` in
``argsort_f32_i32_cuda_cub``. ``GGML_CUDA_DISABLE_GRAPHS=1`` (immediate mode) sorts correctly. The PR's new
test-backend-ops case ``ARGSORT ne=[2048,512,1,1]``, with the harness patched to evaluate every case twice (the second
evaluation is captured), is what exposes it.
Mechanism: ``ggml_cuda_op_argsort`` (``ggml/src/ggml-cuda/argsort.cu``) sends rows wider than 1024 to
``argsort_f32_i32_cuda_cub``; for nrows > 1 it called ``DeviceSegmentedSort::SortPairs`` /
``SortPairsDescending`` (keys sorted in place in ``temp_keys``, values ``temp_indices`` -> ``dst``, one segment per
row). In CUB (``cub/device/dispatch/dispatch_segmented_sort.cuh``, host path, no CDP), when ``num_segments >
PartitioningThreshold`` the dispatcher first launches a three-way partition that buckets the segments into large,
small and medium on the device and writes ``group_sizes``; then it does ``MemcpyAsync(h_group_sizes, group_sizes,
cudaMemcpyDeviceToHost, stream)`` into a stack array and ``SyncStream(stream)``, and only then
``device_segmented_sort_continuation`` sizes the large-segment and small/medium-segment kernel grids from
``h_group_sizes``. ``ggml_backend_cuda_graph_compute`` evaluates a graph directly on its first call (warmup) and on
the next call with unchanged properties captures it (``cudaStreamBeginCapture(..., cudaStreamCaptureModeRelaxed)``).
A D->H copy into pageable host memory plus a synchronize of the capturing stream is illegal in every capture mode:
the readback is refused, CUB returns the error, ``CUDA_CHECK`` aborts (and the capture is invalidated). No stale
group sizes are ever used: CUB returns before the continuation. Eager evaluation reads the sizes back each call and is
correct.
Doctor: sync-in-capture, at argsort_f32_i32_cuda_cub. A host synchronisation (CUB's group-size readback plus stream
sync, reached through ``DeviceSegmentedSort::SortPairs``) is attempted while ggml's capture is open. The bug lives in
``argsort_f32_i32_cuda_cub``: that is the function the fix changed, choosing the non-capturable CUB algorithm
regardless of whether the stream is capturing.
Fix (upstream): ``argsort_f32_i32_cuda_cub`` asks ``cudaStreamIsCapturing(stream)`` (under ``USE_CUDA_GRAPH``) and,
for nrows > 1 while capturing, calls ``DeviceSegmentedRadixSort::SortPairs`` / ``SortPairsDescending`` (begin bit 0,
end bit 32), whose launches depend only on ``num_items`` and ``num_segments``; immediate mode keeps the faster
``DeviceSegmentedSort``. The same three-way branch is applied to the temp-storage size query and to the real call.
Modelled: the test-backend-ops case ``ARGSORT`` (both orders, as the test loops over them) as two one-node ggml graphs
(one ``ggml_cuda_graph`` each) evaluated four times with new data, as ``ggml_backend_compare_graph_backend`` run
repeatedly. Scaled sizes: the bitonic limit of 1024 columns is 16, CUB's partitioning threshold of 500 segments is 5,
its medium/small segment limits are 16/4 items; the case is 24 columns x 8 rows (every segment "large"). CUB's sort
kernels are torch stable sorts over the segments they are given (segments are ggml's uniform rows, offsets
``i * ncols`` from ``init_offsets``); the partition writes large ids first and medium ids at the end of
``large_and_medium_segments_indices`` via a device argsort of the bucket. The temp-storage size query, the pool
allocation of ``d_temp_storage``, CDP and the > INT_MAX segment loop are left out. ``ggml_backend_cuda_graph_compute``
keeps only the warmup -> capture -> launch sequence; ``CUDA_CHECK`` lets CUDA's error propagate.
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/21718"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "argsort_f32_i32_cuda_cub"
SYMPTOM = ("ggml CUDA graph capture of a multi-row argsort aborts: CUB DeviceSegmentedSort reads its partition "
           "group sizes back to the host and syncs the capturing stream (operation not permitted when stream is "
           "capturing)")

GGML_SORT_ORDER_ASC, GGML_SORT_ORDER_DESC = 0, 1
MAX_BITONIC_COLS = 16            # stands for ncols > 1024 / shared memory too small for the bitonic kernel
PARTITIONING_THRESHOLD = 5       # CUB's segmented-sort policy: 500 segments (sm_80+)
MEDIUM_SEGMENT_MAX_SIZE = 16     # larger segments go to the large-segment (block radix) kernel
SMALL_SEGMENT_MAX_SIZE = 4
NCOLS, NROWS, N_EVALS = 24, 8, 4


# --- CUB (host dispatch path, CUB_RDC_ENABLED off) -----------------------------------------------------------

def _sort_segments(keys_in, values_in, keys_out, values_out, segment_ids, segment_size, descending):
    """One sort kernel over the segments named in ``segment_ids`` (ggml's segments: uniform rows)."""
    k_rows = keys_in.view(-1, segment_size).index_select(0, segment_ids)
    v_rows = values_in.view(-1, segment_size).index_select(0, segment_ids)
    sorted_keys, perm = torch.sort(k_rows, dim=-1, stable=True, descending=descending)
    keys_out.view(-1, segment_size).index_copy_(0, segment_ids, sorted_keys)
    values_out.view(-1, segment_size).index_copy_(0, segment_ids, torch.gather(v_rows, 1, perm))


class DeviceRadixSort:
    @staticmethod
    def SortPairs(d_keys_in, d_keys_out, d_values_in, d_values_out, num_items, descending=False):
        ids = torch.zeros(1, dtype=torch.long, device=d_keys_in.device)
        _sort_segments(d_keys_in, d_values_in, d_keys_out, d_values_out, ids, num_items, descending)


class DeviceSegmentedRadixSort:
    """Radix passes over all segments: every launch is sized from num_items and num_segments only (capturable)."""

    @staticmethod
    def SortPairs(d_keys_in, d_keys_out, d_values_in, d_values_out, num_items, num_segments,
                  d_begin_offsets, d_end_offsets, descending=False):
        segment_size = num_items // num_segments
        all_segments = torch.arange(num_segments, device=d_keys_in.device)
        _sort_segments(d_keys_in, d_values_in, d_keys_out, d_values_out, all_segments, segment_size, descending)


def device_segmented_sort_continuation(num_segments, d_keys_in, d_keys_out, d_values_in, d_values_out,
                                       segment_size, h_group_sizes, large_and_medium_segments_indices,
                                       small_segments_indices, descending):
    """Launch the large-segment kernel (one CTA per large segment) and the small/medium kernel, grids from the host."""
    large_segments = h_group_sizes[0]
    if large_segments > 0:                                          # DeviceSegmentedSortKernelLarge<<<large, ...>>>
        _sort_segments(d_keys_in, d_values_in, d_keys_out, d_values_out,
                       large_and_medium_segments_indices[:large_segments], segment_size, descending)
    small_segments = h_group_sizes[1]
    medium_segments = num_segments - (large_segments + small_segments)
    if small_segments + medium_segments:                            # DeviceSegmentedSortKernelSmall<<<...>>>
        ids = torch.cat([small_segments_indices[:small_segments],
                         large_and_medium_segments_indices[num_segments - medium_segments:]])
        _sort_segments(d_keys_in, d_values_in, d_keys_out, d_values_out, ids, segment_size, descending)


class DeviceSegmentedSort:
    """Multi-kernel segmented sort: partition on the device, group sizes read back, then the sort kernels."""

    @staticmethod
    def SortPairs(d_keys_in, d_keys_out, d_values_in, d_values_out, num_items, num_segments,
                  d_begin_offsets, d_end_offsets, descending=False):
        segment_size = num_items // num_segments
        if num_segments <= PARTITIONING_THRESHOLD:                  # SortWithoutPartitioning: one fallback kernel
            all_segments = torch.arange(num_segments, device=d_keys_in.device)
            _sort_segments(d_keys_in, d_values_in, d_keys_out, d_values_out, all_segments, segment_size, descending)
            return
        # DispatchThreeWayPartitionIf: bucket the segments on the device, write group_sizes = {large, small}
        sizes = d_end_offsets - d_begin_offsets
        large = sizes > MEDIUM_SEGMENT_MAX_SIZE
        small = sizes <= SMALL_SEGMENT_MAX_SIZE
        bucket = torch.where(large, 0, torch.where(small, 1, 2))
        large_and_medium_segments_indices = torch.argsort(bucket, stable=True)   # large first, medium at the end
        small_segments_indices = torch.argsort((~small).to(torch.int32), stable=True)
        group_sizes = torch.stack([large.sum(), small.sum()]).to(torch.int32)
        # MemcpyAsync(h_group_sizes, group_sizes, cudaMemcpyDeviceToHost, stream); SyncStream(stream)
        h_group_sizes = group_sizes.tolist()
        device_segmented_sort_continuation(num_segments, d_keys_in, d_keys_out, d_values_in, d_values_out,
                                           segment_size, h_group_sizes, large_and_medium_segments_indices,
                                           small_segments_indices, descending)


# --- ggml/src/ggml-cuda/argsort.cu ----------------------------------------------------------------------------

def init_indices(ncols, nrows, device):
    return torch.arange(ncols, dtype=torch.int32, device=device).repeat(nrows)


def init_offsets(ncols, nrows, device):
    return torch.arange(nrows + 1, dtype=torch.int32, device=device) * ncols


def argsort_f32_i32_cuda_cub(x, dst, ncols, nrows, order, variant):
    temp_indices = init_indices(ncols, nrows, x.device)             # ggml_cuda_pool_alloc<int>
    offset_iterator = init_offsets(ncols, nrows, x.device)
    temp_keys = x.clone()                                           # cudaMemcpyAsync D2D into the pool buffer
    descending = order == GGML_SORT_ORDER_DESC

    is_capturing_ = False
    if variant == "fix":              # #21718: cudaStreamIsCapturing(stream, &capture_status)
        is_capturing_ = is_capturing()

    if nrows == 1:
        DeviceRadixSort.SortPairs(temp_keys, temp_keys, temp_indices, dst, ncols, descending)
    elif is_capturing_:
        DeviceSegmentedRadixSort.SortPairs(temp_keys, temp_keys, temp_indices, dst, ncols * nrows, nrows,
                                           offset_iterator[:-1], offset_iterator[1:], descending)
    else:
        DeviceSegmentedSort.SortPairs(temp_keys, temp_keys, temp_indices, dst, ncols * nrows, nrows,
                                      offset_iterator[:-1], offset_iterator[1:], descending)


def argsort_f32_i32_cuda_bitonic(x, dst, ncols, nrows, order):
    perm = torch.sort(x.view(nrows, ncols), dim=-1, stable=True, descending=order == GGML_SORT_ORDER_DESC)[1]
    dst.copy_(perm.to(torch.int32).view(-1))


def ggml_cuda_op_argsort(src0, dst, order, variant):
    ncols, nrows = src0.shape[-1], src0.numel() // src0.shape[-1]
    if ncols > MAX_BITONIC_COLS:
        argsort_f32_i32_cuda_cub(src0.view(-1), dst.view(-1), ncols, nrows, order, variant)
    else:
        argsort_f32_i32_cuda_bitonic(src0.view(-1), dst.view(-1), ncols, nrows, order)


# --- ggml/src/ggml-cuda/ggml-cuda.cu: one ggml graph, one ggml_cuda_graph -------------------------------------

class ggml_cgraph:
    """The test case's graph: ``out = ggml_argsort(ctx, a, order)``."""

    def __init__(self, name, order, device):
        self.name, self.order = name, order
        self.a = torch.zeros(NROWS, NCOLS, device=device)                       # leaf, set by tensor_set
        self.out = torch.zeros(NROWS, NCOLS, dtype=torch.int32, device=device)  # the ARGSORT node


class ggml_cuda_graph:
    def __init__(self):
        self.warmup_complete = False
        self.instance = None          # (graph, outputs)


class ggml_backend_cuda_context:
    def __init__(self, device, variant, use_cuda_graph):
        self.device, self.variant, self.use_cuda_graph = device, variant, use_cuda_graph
        self.cuda_graphs: dict[str, ggml_cuda_graph] = {}

    def cuda_graph(self, graph_key):
        return self.cuda_graphs.setdefault(graph_key, ggml_cuda_graph())


def ggml_cuda_graph_evaluate_and_capture(cuda_ctx, cgraph):
    ggml_cuda_op_argsort(cgraph.a, cgraph.out, cgraph.order, cuda_ctx.variant)   # ggml_cuda_compute_forward
    return cgraph.out


def ggml_backend_cuda_graph_compute(cuda_ctx, cgraph):
    graph = cuda_ctx.cuda_graph(cgraph.name)
    if not cuda_ctx.use_cuda_graph or not graph.warmup_complete:
        graph.warmup_complete = cuda_ctx.use_cuda_graph   # first call: properties changed, evaluate directly
        return ggml_cuda_graph_evaluate_and_capture(cuda_ctx, cgraph)
    if graph.instance is None:        # cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed) .. EndCapture
        graph.instance = capture(lambda: ggml_cuda_graph_evaluate_and_capture(cuda_ctx, cgraph),
                                 device=cuda_ctx.device, warmups=0, name=cgraph.name,
                                 owner="ggml_backend_cuda_context", static={"a": cgraph.a},
                                 capture_error_mode="relaxed")
    g, out = graph.instance
    return replay(g, out)             # cudaGraphLaunch


def run(variant: str, device: str = "cpu"):
    gen = generator(21718)
    data = [[randn(NROWS, NCOLS, gen=gen, device=device) for _ in range(N_EVALS)] for _ in range(2)]

    def serve(use_cuda_graph: bool):
        cuda_ctx = ggml_backend_cuda_context(device, variant, use_cuda_graph)
        cgraphs = [ggml_cgraph(f"ARGSORT order={o}", o, device) for o in (GGML_SORT_ORDER_ASC, GGML_SORT_ORDER_DESC)]
        outs = []
        for step in range(N_EVALS):   # ggml_backend_compare_graph_backend, evaluated again and again
            for cgraph, inputs in zip(cgraphs, data):
                cgraph.a.copy_(inputs[step])                                # ggml_backend_tensor_set
                outs.append(ggml_backend_cuda_graph_compute(cuda_ctx, cgraph).clone())   # ggml_backend_tensor_get
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
