"""Warp's ``wp_bsr_transpose_device`` copies the sorted block indices back with a blocking ``cudaMemcpy``: capturing ``bsr_set_transpose()`` in a CUDA graph fails.

Upstream: https://github.com/NVIDIA/warp/commit/e9b966183814c0557decb3bec06a3b874d99ba93 ("Fix capturability of
bsr_transpose", NVIDIA/warp, Gilles Daviet, 2025-10-01). Read here: the whole commit diff (warp/native/sparse.cu,
warp/sparse.py, the new ``test_capturability`` in warp/tests/test_sparse.py) and the pre-fix
``wp_bsr_transpose_device`` / ``bsr_set_transpose`` / ``_bsr_transpose_values`` code. There is no linked issue or PR
text; the commit message is its title only.
Symptom: ``with wp.ScopedCapture(): ... bsr_transposed(B) ...`` (sparse products in warp.fem / Newton solvers) fails
on GPUs where the radix sort leaves the sorted keys in the second half of the scratch buffer: the legacy-stream
``cudaMemcpy`` is refused by the capturing stream ("operation not permitted when stream is capturing" / "would make
the legacy stream depend on a capturing blocking stream") and the capture is invalidated. Eager calls are right.
Mechanism: ``bsr_set_transpose`` (warp/sparse.py) allocates ``block_index_map`` (2*nnz ints) and calls
``wp_bsr_transpose_device`` (warp/native/sparse.cu). That fills (col,row) keys and block indices, radix-sorts the pairs
with ``cub::DeviceRadixSort::SortPairs`` on two ``cub::DoubleBuffer``s (keys half ``src_block_indices + nnz``,
alternate half ``src_block_indices``), and then, "depending on data size and GPU architecture", if the sorted indices
did not end in ``src_block_indices`` copies them there with ``cudaMemcpy(..., cudaMemcpyDeviceToDevice)``: a
synchronous call on the legacy default stream, not on the ``stream`` every other launch of the function uses. Inside
a capture that implicit synchronisation with the capturing stream is refused. ``_bsr_transpose_values`` then reads
``block_index_map[block]`` to gather the transposed blocks.
Doctor: sync-in-capture, at wp_bsr_transpose_device. The blocking legacy-stream ``cudaMemcpy`` synchronises with the
capturing stream, which CUDA refuses during capture; the function's other work is all stream-ordered.
Fix (upstream): ``cudaMemcpyAsync(src_block_indices, src_block_indices + nnz, nnz * sizeof(int),
cudaMemcpyDeviceToDevice, stream)``. The same commit also moves ``BsrMatrix``'s nnz transfer-buffer release from
``__del__`` to ``weakref.finalize`` and widens a kernel-cache suffix: not modelled (no nnz transfer buffers here).
Modelled: ``BsrMatrix`` (offsets, columns, 2x2 block values, host nnz upper bound), ``bsr_set_transpose`` with its
``block_index_map``, ``wp_bsr_transpose_device`` (fill row/col keys, the sort on double buffers, the copy-back,
``bsr_find_row_offsets``, ``bsr_set_column``), ``_bsr_transpose_values`` and ``bsr_mv``. The radix sort is a stable
``torch.sort`` of the 64-bit (row << 32 | col) keys; its pass count (8 passes of 8 bits for 64-bit keys on this GPU:
even, so the sorted pairs end in the *current* halves) stands in for CUB's tuning policy. ``cudaMemcpy`` is a
device-wide ``synchronize`` followed by the copy (what the legacy stream does); ``cudaMemcpyAsync`` is a plain
stream-ordered ``copy_``. ``wp.ScopedCapture`` / ``wp.capture_launch`` are ``kit.capture`` / ``kit.replay``.
Workload: as upstream's ``test_capturability``: the user's step transposes A (4x3 blocks of 2x2, 6 non-zero blocks)
into a preallocated B = A^T and computes y = B r. It runs once eagerly (module load), is captured, and is then
launched for 3 steps with new A values and r written in place. Bug: the capture raises (CaptureError on the CPU, the
capture-invalidated error on CUDA). Fix: the graph's 3 outputs equal eager's.
"""
from __future__ import annotations

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/e9b966183814c0557decb3bec06a3b874d99ba93"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "wp_bsr_transpose_device"
SYMPTOM = ("capturing bsr_set_transpose() fails: wp_bsr_transpose_device copies the sorted block indices back with a "
           "blocking legacy-stream cudaMemcpy, which the capturing stream refuses")

NROW, NCOL, BLOCK = 4, 3, 2                    # A: 4x3 blocks of 2x2
A_ROWS = [0, 0, 1, 2, 3, 3]                    # the fixed topology (row-major, as bsr_from_triplets leaves it)
A_COLS = [0, 2, 1, 0, 1, 2]
STEPS = 3
SORT_KEY_BITS, RADIX_BITS = 64, 8              # cub onesweep on 64-bit keys: 8 passes on this GPU

_variant = "bug"


# --- CUDA runtime stand-ins -----------------------------------------------------------------------------------------

def cudaMemcpy(dst, src, device):
    """Synchronous copy on the legacy default stream: it waits for (and orders against) every blocking stream."""
    synchronize(device)
    dst.copy_(src)


def cudaMemcpyAsync(dst, src, stream=None):
    dst.copy_(src)                             # ordered on ``stream`` like the launches around it


class DoubleBuffer:
    """``cub::DoubleBuffer``: two halves and a selector saying which one holds the current data."""

    def __init__(self, current, alternate):
        self.d_buffers = [current, alternate]
        self.selector = 0

    def Current(self):
        return self.d_buffers[self.selector]

    def Alternate(self):
        return self.d_buffers[self.selector ^ 1]


def SortPairs(d_keys: DoubleBuffer, d_values: DoubleBuffer, num_items, begin_bit=0, end_bit=64):
    """``cub::DeviceRadixSort::SortPairs``: a stable LSD sort, each pass ping-pongs both double buffers."""
    keys, values = d_keys.Current()[:num_items], d_values.Current()[:num_items]
    order = torch.sort(keys, stable=True).indices
    sorted_keys, sorted_values = keys[order], values[order]
    passes = -(-(end_bit - begin_bit) // RADIX_BITS)
    if passes % 2:
        d_keys.selector ^= 1
        d_values.selector ^= 1
    d_keys.Current()[:num_items].copy_(sorted_keys)
    d_values.Current()[:num_items].copy_(sorted_values)


# --- warp/native/sparse.cu ------------------------------------------------------------------------------------------

def bsr_row_index(offsets, row_count, block):
    return torch.searchsorted(offsets[1:row_count + 1].contiguous(), block, right=True)


def bsr_transpose_fill_row_col(nnz, row_count, bsr_offsets, bsr_columns, block_indices, transposed_row_col):
    i = torch.arange(nnz, device=bsr_offsets.device, dtype=torch.int64)
    block_indices[:nnz].copy_(i.to(block_indices.dtype))
    row = bsr_row_index(bsr_offsets, row_count, i)
    col = bsr_columns[:nnz].to(torch.int64)
    transposed_row_col[:nnz].copy_((col << 32) | row)          # BsrRowCol of the transposed block


def bsr_find_row_offsets(row_count, nnz, unique_row_col, row_offsets):
    rows = unique_row_col[:nnz] >> 32
    r = torch.arange(row_count + 1, device=rows.device, dtype=torch.int64)
    row_offsets.copy_(torch.searchsorted(rows.contiguous(), r).to(row_offsets.dtype))


def bsr_set_column(nnz, unique_row_cols, bsr_cols):
    bsr_cols[:nnz].copy_((unique_row_cols[:nnz] & 0xFFFFFFFF).to(bsr_cols.dtype))


def wp_bsr_transpose_device(row_count, col_count, nnz, bsr_offsets, bsr_columns, transposed_bsr_offsets,
                            transposed_bsr_columns, src_block_indices):
    device = bsr_offsets.device
    combined_row_col = torch.empty(2 * nnz, dtype=torch.int64, device=device)      # ScopedTemporary<BsrRowCol>
    d_keys = DoubleBuffer(src_block_indices[nnz:], src_block_indices[:nnz])
    d_values = DoubleBuffer(combined_row_col[:nnz], combined_row_col[nnz:])
    bsr_transpose_fill_row_col(nnz, row_count, bsr_offsets, bsr_columns, d_keys.Current(), d_values.Current())

    # Sort blocks
    SortPairs(d_values, d_keys, nnz, 0, SORT_KEY_BITS)
    # Depending on data size and GPU architecture buffers may have been swapped or not
    # Ensures the sorted keys are available in summed_block_indices if needed
    if d_keys.Current().data_ptr() != src_block_indices.data_ptr():
        if _variant == "fix":
            cudaMemcpyAsync(src_block_indices[:nnz], src_block_indices[nnz:2 * nnz])
        else:
            cudaMemcpy(src_block_indices[:nnz], src_block_indices[nnz:2 * nnz], device)

    # Compute row offsets from sorted unique blocks
    bsr_find_row_offsets(col_count, nnz, d_values.Current(), transposed_bsr_offsets)
    bsr_set_column(nnz, d_values.Current(), transposed_bsr_columns)


# --- warp/sparse.py -------------------------------------------------------------------------------------------------

class BsrMatrix:
    def __init__(self, nrow, ncol, offsets, columns, values):
        self.nrow, self.ncol = nrow, ncol
        self.offsets, self.columns, self.values = offsets, columns, values
        self.nnz = columns.shape[0]            # host-side nnz upper bound

    @property
    def block_shape(self):
        return tuple(self.values.shape[1:])


def _bsr_transpose_values(col_count, scale, bsr_values, block_index_map, transposed_bsr_offsets,
                          transposed_bsr_values, nnz):
    block = torch.arange(nnz, device=bsr_values.device)
    valid = (block < transposed_bsr_offsets[col_count]).to(bsr_values.dtype)[:, None, None]
    src_block = block_index_map[:nnz].to(torch.int64)
    transposed_bsr_values[:nnz].copy_(bsr_values[src_block].transpose(1, 2) * scale * valid)


def bsr_set_transpose(dest: BsrMatrix, src: BsrMatrix):
    if dest.block_shape != src.block_shape[::-1]:
        raise ValueError(f"Destination block shape must be {src.block_shape[::-1]}, got {dest.block_shape}")
    nnz = src.nnz
    dest.nrow, dest.ncol, dest.nnz = src.ncol, src.nrow, nnz      # _bsr_resize / _bsr_ensure_fits (capacity fits)
    block_index_map = torch.empty(2 * nnz, dtype=torch.int32, device=src.values.device)
    wp_bsr_transpose_device(src.nrow, src.ncol, nnz, src.offsets, src.columns, dest.offsets, dest.columns,
                            block_index_map)
    _bsr_transpose_values(src.ncol, 1.0, src.values, block_index_map, dest.offsets, dest.values, nnz)


def bsr_mv(A: BsrMatrix, x, y):
    block = torch.arange(A.nnz, device=x.device)
    rows = bsr_row_index(A.offsets, A.nrow, block)
    contrib = torch.bmm(A.values[:A.nnz], x[A.columns[:A.nnz].to(torch.int64)].unsqueeze(-1)).squeeze(-1)
    y.zero_()
    y.index_add_(0, rows, contrib)
    return y


# --- the user's program (test_capturability) ----------------------------------------------------------------------

def _make_problem(device):
    counts = torch.bincount(torch.tensor(A_ROWS), minlength=NROW)         # built on the host, before any capture
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(device)
    columns = torch.tensor(A_COLS, dtype=torch.int32, device=device)
    A = BsrMatrix(NROW, NCOL, offsets, columns, torch.zeros(len(A_COLS), BLOCK, BLOCK, device=device))
    B = BsrMatrix(NCOL, NROW, torch.zeros(NCOL + 1, dtype=torch.int32, device=device),
                  torch.zeros(len(A_COLS), dtype=torch.int32, device=device),
                  torch.zeros(len(A_COLS), BLOCK, BLOCK, device=device))
    r = torch.zeros(NROW, BLOCK, device=device)
    y = torch.zeros(NCOL, BLOCK, device=device)
    return A, B, r, y


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(9661)
    values = [randn(len(A_COLS), BLOCK, BLOCK, gen=gen, device=device) for _ in range(STEPS + 1)]
    rhs = [randn(NROW, BLOCK, gen=gen, device=device) for _ in range(STEPS + 1)]
    name = __name__.rsplit(".", 1)[-1]

    def served():
        A, B, r, y = _make_problem(device)

        def test_body():
            bsr_set_transpose(B, A)
            return bsr_mv(B, r, y)

        A.values.copy_(values[0])
        r.copy_(rhs[0])
        # test_body() once to load the modules, then wp.ScopedCapture(force_module_load=False)
        g, out = capture(test_body, device=device, warmups=1, name="bsr transpose + mv", owner="wp.ScopedCapture",
                         static={"A.values": A.values, "A.offsets": A.offsets, "A.columns": A.columns, "r": r},
                         state={"B.offsets": B.offsets, "B.columns": B.columns, "B.values": B.values, "y": y})
        outs = []
        for step in range(1, STEPS + 1):
            A.values.copy_(values[step])
            r.copy_(rhs[step])
            outs.append(replay(g, out).clone())                    # wp.capture_launch(capture.graph)
        return outs

    def eager():
        A, B, r, y = _make_problem(device)
        outs = []
        for step in range(1, STEPS + 1):
            A.values.copy_(values[step])
            r.copy_(rhs[step])
            bsr_set_transpose(B, A)
            outs.append(bsr_mv(B, r, y).clone())
        return outs

    return compare(name, variant, device, served, eager)
