"""The grow-only int8 GEMV workspace is freed and reallocated by a larger eager GEMV; the bsz-1 MLP graphs keep the freed pointer.

Upstream: https://github.com/turboderp-org/exllamav3/commit/7b01fc550e623567e632ccef4489f3e6639bfecd ("Disable
mgemv kernel, fix dangling workspace ptr, preserve TC matmul's shmem carveout in exl3_gemv_int8", turboderp,
committed 2026-07-07 to the default branch; the bug came in with 701656d, "GEMV: Add experimental fused-int8
kernels", 2026-07-05; plain int8 mode became the default with f2240dc, 2026-07-09).
Symptom: with the fused int8 GEMV path (EXL3_INT8_GEMV=2) and the bsz-1 graphs of ``BC_GatedMLP``, once a
decode step of two sequences has run (a second job joins the generator), the next single-sequence decode replays
the MLP graphs on a workspace that was given back with ``cudaFree``: an illegal memory access, or, once the range
holds other data, garbage down projections (and column groups never written when the completion counters there
no longer start at zero) while the graph's stores corrupt that data. Without graphs it is correct.
Mechanism: ``exllamav3_ext/quant/exl3_gemv_int8.cu``: ``gemv_int8_get_ws(device, ws_ints)`` kept one grow-only
per-device workspace: ``if (ws.ws_ints < ws_ints) { if (ws.ws) cudaFree(ws.ws); cudaMalloc(...); cudaMemset(0) }``.
``exl3_gemv_int8_sq`` (the m <= 2 per-slice-scale kernel, reached through ``exl3_gemv_int8`` from
``exl3_gemm_gr`` for mul1 tensors) asks for ``SQ_WS_RESERVED + ksplit * M * pstride`` ints (fixed counters and
per-slice scales, then the int32 split-K partials) and passes the pointer as kernel argument 6 (``locks``); the
kernel's per-256-column completion counters are zero between calls (zeroed at allocation, reset by the finishing
block). ``BC_GatedMLP::run_bsz1`` runs its first call eagerly and captures ``run_bsz1_gr`` (mgemm gate/up, act,
``down->run_gr`` -> ``exl3_gemm_gr`` -> the sq GEMV) into ``graph_bsz1`` on the second; ``Graph::launch``
patches only the arguments recorded with ``record_param`` (GP_gemm_A 0, B 1, C 2, suh 7, A_had 8, svh 9), so the
workspace address of argument 6 stays the capture-time one. A later eager GEMV with a larger request -- here the
bsz-2 decode step of ``GatedMLP.forward``, whose down projection runs ``exl3_gemm`` with m = 2 (twice the rows
of partials) -- makes ``gemv_int8_get_ws`` free the buffer and allocate a bigger one. Every graph captured
before still writes its partials and counters into, and reads them from, the freed block. Eager calls read
``gemv_ws[device].ws`` afresh each time and are right.
Doctor: dangling-reference, at gemv_int8_get_ws (it frees the workspace whose address the captured sq GEMV nodes
of the bsz-1 MLP graphs hold as a kernel argument, and hands later calls a new one: every later replay reads and
writes memory whose owner released it; the fix changed exactly this function, to allocate once and never free).
Fix (upstream): ``gemv_int8_get_ws`` allocates one fixed-size workspace (``GEMV_INT8_WS_INTS``, WORKSPACE_SIZE =
16 MB) once, zeroed, and never reallocates; a request larger than that returns nullptr and the callers
(``exl3_gemv_int8_sq``, ``exl3_gemv_int8``, ``exl3_mgemv_int8``) return false, falling through to the regular
kernel. (The same commit disables the int8 mgemv for performance and sets the shared-memory carveout; not
modelled.)
Modelled: one device; a 2-layer model of residual gated MLPs only (no attention, embedding or head), tensors in
float32. The EXL3 trellis weights are plain int8 codes with the input sign vector ``suh`` and the output column
scales ``svh`` (no Hadamard transforms); the fused gate/up ``exl3_mgemm_gr`` is the regular (tensor-core) fp path.
The sq kernel keeps its workspace layout ([counters][{q_s,..} x ksplit x M][partials ksplit x M x pstride]),
its per-slice activation quantization, exact int32 partials, counter-gated epilogue and counter reset, at scaled
sizes (4-column "256-column" groups, 2-wide "16-row" k rows, a fixed grid: ksplit 2 at m = 1 and m = 2, as the
row cap is the same for both upstream in plain int8 mode). The coop kernel (m = 1 fallback) is left out. ``cudaLaunchKernel`` runs the kernel and,
under capture, lets ``Graph`` see the node's arguments at capture end (it keeps only the recorded ones, as node
params hold pointers, not owners); a patched pointer argument is modelled as a copy into (input) or out of
(output) the captured tensor. ``cudaMalloc`` is a tensor; ``cudaFree``'s return to the driver is the kit's
``release_to_driver`` right after the new workspace is allocated (the old range is still mapped then, so the grown
workspace cannot be placed at the freed address and hide the bug by accident): on the CPU the replay then raises
``IllegalMemoryAccess``; on CUDA each modelled int stands for 32 Ki ints, so every workspace is a caching-allocator
segment of its own (>= 10 MiB) and the grown one (21 MiB) cannot fit the released one (a 20 MiB segment), and the
replay faults on the unmapped range.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, release_to_driver, replay

UPSTREAM = "https://github.com/turboderp-org/exllamav3/commit/7b01fc550e623567e632ccef4489f3e6639bfecd"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "gemv_int8_get_ws"
SYMPTOM = ("after a bsz-2 decode grows the int8 GEMV workspace (cudaFree + cudaMalloc), the bsz-1 MLP graphs "
           "replay on the freed workspace")

HIDDEN, INTERMEDIATE, NUM_LAYERS = 8, 16, 2
EPS = 1e-6
WORKLOAD = (1, 1, 1, 1, 2, 2, 1, 1)          # decode batch per step: a second job joins for two steps

# --- exllamav3_ext/quant/exl3_gemv_int8_kernel.cuh (scaled) ------------------------------------------------
GROUP_N = 4                                   # "256-column" groups (one completion counter each)
ROW_K = 2                                     # k per "16-row"
SQ_KSPLIT_CAP = 8
SQ_COUNTERS_CAP = 8                           # fixed counter region
SQ_WS_RESERVED = SQ_COUNTERS_CAP + 4 * SQ_KSPLIT_CAP * 4     # counters + per-slice-per-row scales (m <= 4)
SQ_SMEM_BUDGET = 640                          # shared-memory cap of the decomposition (80 KB upstream)
SQ_ROWS_MAX = 4
GEMV_INT8_MAX_K = 5

# --- exllamav3_ext/quant/exl3_gemv_int8.cu ------------------------------------------------------------------
GEMV_INT8_WS_INTS = 256                       # the fix's fixed size (WORKSPACE_SIZE / sizeof(int) = 16 MB)
EXL3_INT8_GEMV = 2                            # the default mode: plain int8 (1: residual, 0: off)

_variant = "bug"


def gemv_int8_sq_rows_max(M: int, residual: bool) -> int:
    cap = SQ_SMEM_BUDGET // (32 + 64 * M * (2 if residual else 1))
    cap &= ~1
    return cap if cap < SQ_ROWS_MAX else SQ_ROWS_MAX


class GemvInt8Workspace:
    def __init__(self):
        self.ws = None                        # int* ws
        self.ws_ints = 0


gemv_ws: dict[str, GemvInt8Workspace] = {}


def _reset_process(variant: str) -> None:
    """A fresh process: no workspace yet."""
    global _variant
    _variant = variant
    gemv_ws.clear()


def cudaMalloc(ws_ints: int, device: str) -> torch.Tensor:
    """``cudaMalloc`` + ``cudaMemset(0)`` of ``ws_ints`` ints (on CUDA padded so each is a segment of its own:
    see Modelled); the kernels use the first ``ws_ints``."""
    numel = ws_ints if torch.device(device).type != "cuda" else ws_ints << 15
    return torch.zeros(numel, dtype=torch.int32, device=device)


def gemv_int8_get_ws(device: str, ws_ints: int):
    if _variant == "bug":
        # Grow-only per-device workspace shared by the sq and coop paths. The buffer is zeroed on
        # (re)allocation so the sq completion counters (fixed region at the start, self-resetting
        # thereafter) begin at zero; the coop kernels only use the region beyond SQ_WS_RESERVED.
        ws = gemv_ws.setdefault(device, GemvInt8Workspace())
        if ws.ws_ints < ws_ints:
            freed = ws.ws is not None
            ws.ws = None                                    # cudaFree(ws.ws)
            ws.ws = cudaMalloc(ws_ints, device)
            ws.ws_ints = ws_ints
            if freed:
                release_to_driver(device)                   # (cudaFree gave the old block to the driver)
        return ws.ws
    # Fixed-size per-device workspace shared by the sq and coop paths, allocated once and never
    # reallocated: the pointer is baked as a kernel argument into captured CUDA graphs, so growing the
    # buffer would leave every previously captured graph with a dangling workspace pointer.
    if ws_ints > GEMV_INT8_WS_INTS:
        return None
    ws = gemv_ws.setdefault(device, GemvInt8Workspace())
    if ws.ws is None:
        ws.ws = cudaMalloc(GEMV_INT8_WS_INTS, device)
        ws.ws_ints = GEMV_INT8_WS_INTS
    return ws.ws


def exl3_gemv_int8_sq_kernel(A, B, C, size_m, size_k, size_n, locks, suh, A_had, svh, *, M, rows_per):
    """Per-slice-scale kernel: each k-slice is quantized with its own q_s = slicemax / 127, units store exact
    int32 partials, and the ksplit-th contributor of a column group (completion counter) runs the epilogue
    sum_s q_s * acc_s and resets the counter."""
    rows_total = size_k // ROW_K
    ksplit = -(-rows_total // rows_per)
    slice_k = rows_per * ROW_K
    pstride = size_n
    nb256_total = size_n // GROUP_N
    counters = locks[:nb256_total]
    qsums = locks[SQ_COUNTERS_CAP:SQ_COUNTERS_CAP + 4 * ksplit * M].view(torch.float32).view(ksplit, 4, M)
    partials = locks[SQ_WS_RESERVED:SQ_WS_RESERVED + ksplit * M * pstride].view(ksplit, M, pstride)

    ah = A.view(size_m, size_k) * suh                              # staging (the Hadamard is left out)
    slices = ah.view(size_m, ksplit, slice_k).transpose(0, 1)      # [ksplit, M, slice_k]
    q_s = slices.abs().amax(dim=-1).clamp_min(1e-8) / 127.0        # [ksplit, M]
    qsums[:, 0, :].copy_(q_s)                                      # published per slice and row
    a_q = torch.round(slices / q_s.unsqueeze(-1))
    b_slices = B.to(torch.float32).view(ksplit, slice_k, size_n)
    partials.copy_(torch.round(torch.bmm(a_q, b_slices)).to(torch.int32))   # exclusive plain stores

    counters.add_(ksplit)                                          # one atomicAdd per (slice, group) unit
    last = counters == ksplit                                      # the ksplit-th contributor saw ksplit - 1
    acc = (partials.to(torch.float32) * qsums[:, 0, :].unsqueeze(-1)).sum(dim=0)     # epilogue combine
    out = acc * svh
    C_flat = C.view(size_m, size_n)
    columns_done = last.unsqueeze(-1).expand(nb256_total, GROUP_N).reshape(size_n)
    C_flat.copy_(torch.where(columns_done, out, C_flat))
    counters.copy_(torch.where(last, torch.zeros_like(counters), counters))          # counters[nb256] = 0


def exl3_gemm_kernel(A, B, C, size_m, size_k, size_n, locks, suh, A_had, svh):
    """The regular (tensor-core) kernel: fp activations."""
    A_had.view(size_m, size_k).copy_(A.view(size_m, size_k) * suh)
    C.view(size_m, size_n).copy_((A_had.view(size_m, size_k) @ B.to(torch.float32)) * svh)


def exl3_gemv_int8_sq(A, B, C, size_m, size_k, size_n, K, residual, suh, A_had, svh, device, graph) -> bool:
    if size_m > 2:
        return False
    M = size_m
    rows_total = size_k // ROW_K
    rows_per = min(gemv_int8_sq_rows_max(M, residual), rows_total)
    ksplit = -(-rows_total // rows_per)
    if ksplit > SQ_KSPLIT_CAP:
        return False
    if size_n // GROUP_N > SQ_COUNTERS_CAP:
        return False

    pstride = size_n * (2 if residual else 1)
    ws_ptr = gemv_int8_get_ws(device, SQ_WS_RESERVED + ksplit * M * pstride)
    if _variant == "fix" and ws_ptr is None:
        return False

    kernelArgs = [A, B, C, size_m, size_k, size_n, ws_ptr, suh, A_had, svh]
    fn = exl3_gemv_int8_sq_kernel
    cudaLaunchKernel(fn, kernelArgs, graph, M=M, rows_per=rows_per)
    if graph is not None:
        graph.record_param(fn, GP_gemm_A, 0)
        graph.record_param(fn, GP_gemm_B_trellis, 1)
        graph.record_param(fn, GP_gemm_C, 2)
        graph.record_param(fn, GP_gemm_B_suh, 7)
        graph.record_param(fn, GP_gemm_A_had, 8)
        graph.record_param(fn, GP_gemm_B_svh, 9)
        graph.record_param(fn, GP_end, 0)
    return True


def exl3_gemv_int8(A, B, C, suh, A_had, svh, graph) -> bool:
    K = 4                                                           # bits per weight of the mul1 tensors
    size_k = A.shape[-1]
    size_n = B.shape[1]
    size_m = A.numel() // size_k
    if size_n % GROUP_N or K < 1 or K > GEMV_INT8_MAX_K:
        return False
    residual = EXL3_INT8_GEMV == 1
    # Per-slice-scale kernel: m == 1, plus m == 2 in plain int8 mode
    if size_m <= (1 if residual else 2) and exl3_gemv_int8_sq(A, B, C, size_m, size_k, size_n, K, residual,
                                                               suh, A_had, svh, A.device.type, graph):
        return True
    return False                                                    # (the m == 1 coop kernel is left out)


# --- exllamav3_ext/quant/exl3_gemm.cu ---------------------------------------------------------------------------

def exl3_gemm_gr(A, B, C, suh, A_had, svh, force_shape_idx, mcg, mul1, force_num_sms, graph):
    size_k, size_n = A.shape[-1], B.shape[1]
    size_m = A.numel() // size_k
    if mul1 and EXL3_INT8_GEMV != 0:
        if exl3_gemv_int8(A, B, C, suh, A_had, svh, graph):
            return 0
    fn = exl3_gemm_kernel
    cudaLaunchKernel(fn, [A, B, C, size_m, size_k, size_n, None, suh, A_had, svh], graph)
    if graph is not None:
        for param_id, offset in ((GP_gemm_A, 0), (GP_gemm_B_trellis, 1), (GP_gemm_C, 2), (GP_gemm_B_suh, 7),
                                 (GP_gemm_A_had, 8), (GP_gemm_B_svh, 9), (GP_end, 0)):
            graph.record_param(fn, param_id, offset)
    return 1


def exl3_gemm(A, B, C, suh, A_had, svh, force_shape_idx, mcg, mul1, force_num_sms):
    return exl3_gemm_gr(A, B, C, suh, A_had, svh, force_shape_idx, mcg, mul1, force_num_sms, None)


def exl3_mgemm_kernel(A, B_list, C, suh_list, A_had, svh_list):
    """Fused gate/up: the regular (tensor-core) mgemm."""
    x = A.reshape(-1, A.shape[-1])
    for i, (B, suh, svh) in enumerate(zip(B_list, suh_list, svh_list)):
        C[i].view(x.shape[0], -1).copy_(((x * suh) @ B.to(torch.float32)) * svh)


def exl3_mgemm_gr(A, ptrs_trellis, C, ptrs_suh, A_had, ptrs_svh, graph):
    fn = exl3_mgemm_kernel
    cudaLaunchKernel(fn, [A, ptrs_trellis, C, ptrs_suh, A_had, ptrs_svh], graph)
    if graph is not None:
        graph.record_param(fn, GP_mgemm_A, 0)
        graph.record_param(fn, GP_mgemm_C, 2)
        graph.record_param(fn, GP_end, 0)


def silu_mul_kernel(x, y, z):
    z.copy_(torch.nn.functional.silu(x) * y)


def silu_mul_gr(x, y, z, act_limit, graph):
    cudaLaunchKernel(silu_mul_kernel, [x, y, z], graph)
    if graph is not None:
        graph.record_param(silu_mul_kernel, GP_silu_mul_x, 0)
        graph.record_param(silu_mul_kernel, GP_silu_mul_y, 1)
        graph.record_param(silu_mul_kernel, GP_silu_mul_z, 2)
        graph.record_param(silu_mul_kernel, GP_end, 0)


# --- exllamav3_ext/graph.cuh / graph.cu ---------------------------------------------------------------------------

(GP_end, GP_gemm_A, GP_gemm_B_trellis, GP_gemm_C, GP_gemm_B_suh, GP_gemm_A_had, GP_gemm_B_svh, GP_mgemm,
 GP_mgemm_A, GP_mgemm_C, GP_silu_mul_x, GP_silu_mul_y, GP_silu_mul_z) = range(13)
_OUTPUT_PARAMS = {GP_gemm_C, GP_mgemm_C, GP_silu_mul_z}
_capturing: list = []                       # the Graph whose capture is open (its capture stream)


def cudaLaunchKernel(fn, kernelArgs, graph, **launch):
    """Run the kernel; under capture the graph node keeps the kernel and its argument values."""
    fn(*kernelArgs, **launch)
    if graph is not None and _capturing and _capturing[-1] is graph:
        graph._launched.append((fn, list(kernelArgs)))


class Graph:
    def __init__(self, device, name):
        self.device, self.name = device, name
        self.graph = self.outputs = None
        self.graph_sites: list[tuple] = []          # (kernel, param_id, param_offset)
        self.graph_node_sites: list[tuple] = []     # (node, param_id, captured value of the param)
        self._launched: list = []
        self.ready = self.ready_to_record = self.disabled = False

    def capture(self, run, static):
        """capture_begin(); run(graph); capture_end()"""
        _capturing.append(self)
        try:
            self.graph, self.outputs = capture(run, device=self.device, warmups=0, name=self.name,
                                               owner="BC_GatedMLP", static=static)
        finally:
            _capturing.pop()
        self.capture_end()

    def capture_end(self):
        # Match recorded sites to the kernel nodes in order; a node's params hold pointers, not owners, so
        # only the recorded arguments are looked at again
        n = 0
        for fn, param_id, offset in self.graph_sites:
            while self._launched[n][0] is not fn:
                n += 1
            self.graph_node_sites.append((n, param_id, self._launched[n][1][offset] if param_id != GP_end else None))
            if param_id == GP_end:
                n += 1
        self._launched = []
        self.ready = True

    def record_param(self, kernel, param_id, param_offset):
        self.graph_sites.append((kernel, param_id, param_offset))

    def launch(self, params):
        """Patch the recorded params whose value changed, then launch (cudaGraphExecKernelNodeSetParams)."""
        p, outputs_to = 0, []
        for node, param_id, captured in self.graph_node_sites:
            if p == len(params):
                break
            if param_id == params[p][0]:
                new_value = params[p][1]
                if new_value.data_ptr() != captured.data_ptr():
                    if param_id in _OUTPUT_PARAMS:
                        outputs_to.append(new_value)
                    else:
                        captured.copy_(new_value)
                p += 1
        out = replay(self.graph, self.outputs)
        for new_value in outputs_to:
            new_value.copy_(out)


# --- exllamav3_ext/libtorch/linear.cpp, mlp.cpp -------------------------------------------------------------------

class BC_LinearEXL3:
    def __init__(self, trellis, suh, xh, svh, mcg, mul1):
        self.trellis, self.suh, self.xh, self.svh, self.mcg, self.mul1 = trellis, suh, xh, svh, mcg, mul1

    def run_gr(self, x, y, graph):
        if x.numel() == x.shape[-1]:
            exl3_gemm_gr(x, self.trellis, y, self.suh, self.xh, self.svh, -1, self.mcg, self.mul1, 0, graph)
        else:
            assert graph is None or graph.disabled, "BC_LinearEXL3 invoked with graph and bsz > 1"
            xh_ = torch.empty_like(x)
            exl3_gemm(x, self.trellis, y, self.suh, xh_, self.svh, -1, self.mcg, self.mul1, 0)


class BC_GatedMLP:
    def __init__(self, guh, gu, a, gu_ptrs_trellis, gu_ptrs_suh, gu_ptrs_svh, down, device, name, graphs):
        self.guh, self.gu, self.a = guh, gu, a
        self.gu_ptrs_trellis, self.gu_ptrs_suh, self.gu_ptrs_svh = gu_ptrs_trellis, gu_ptrs_suh, gu_ptrs_svh
        self.down = down
        self.graph_bsz1 = Graph(device, name)
        self.graph_bsz1.disabled = not graphs

    def run_bsz1_gr(self, x, d, graph):
        exl3_mgemm_gr(x, self.gu_ptrs_trellis, self.gu, self.gu_ptrs_suh, self.guh, self.gu_ptrs_svh, graph)
        g = self.gu.select(0, 0).unsqueeze(0)
        u = self.gu.select(0, 1).unsqueeze(0)
        silu_mul_gr(g, u, self.a, 0.0, graph)
        self.down.run_gr(self.a, d, graph)
        return d

    def run_bsz1(self, x, d):
        gr = self.graph_bsz1
        if gr.disabled or (not gr.ready and not gr.ready_to_record):
            self.run_bsz1_gr(x, d, None)
            gr.ready_to_record = True
        else:
            if not gr.ready:
                gr.capture(lambda: self.run_bsz1_gr(x, d, gr), static={"x": x})
            gr.launch([(GP_mgemm_A, x), (GP_gemm_C, d)])


# --- exllamav3/modules: linear, mlp, the model ----------------------------------------------------------------------

class LinearEXL3:
    def __init__(self, trellis, suh, svh, device):
        self.trellis, self.suh, self.svh = trellis, suh, svh
        self.mcg, self.mul1 = False, True                          # mul1 codebook: the int8 path takes it
        self.bc = BC_LinearEXL3(trellis, suh, torch.zeros(1, trellis.shape[0], device=device), svh,
                                self.mcg, self.mul1)

    def forward(self, x, params):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.empty(x2.shape[0], self.trellis.shape[1], device=x.device)
        xh = torch.empty_like(x2)
        exl3_gemm(x2, self.trellis, y, self.suh, xh, self.svh, -1, self.mcg, self.mul1, 0)
        return y.view(*x.shape[:-1], -1)


class GatedMLP:
    def __init__(self, gen, device, name, graphs):
        def linear(k, n):
            trellis = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8).to(device)
            suh = (torch.randint(0, 2, (k,), generator=gen) * 2 - 1).to(torch.float32).to(device)
            svh = (torch.rand(n, generator=gen) * 0.5 + 0.5).div(127.0 * k ** 0.5).to(device)
            return LinearEXL3(trellis, suh, svh, device)

        self.gate, self.up, self.down = linear(HIDDEN, INTERMEDIATE), linear(HIDDEN, INTERMEDIATE), \
            linear(INTERMEDIATE, HIDDEN)
        self.multi_gu = ([self.gate.trellis, self.up.trellis], [self.gate.suh, self.up.suh],
                         [self.gate.svh, self.up.svh])
        # static intermediates (g_tensor_cache)
        self.bc = BC_GatedMLP(torch.zeros(2, 1, HIDDEN, device=device), torch.zeros(2, 1, INTERMEDIATE, device=device),
                              torch.zeros(1, 1, INTERMEDIATE, device=device), *self.multi_gu, self.down.bc, device,
                              name, graphs)

    def forward(self, x, params):
        bsz, q_len, dim = x.shape
        if bsz == 1 and q_len == 1:
            d = torch.empty_like(x)
            x = x.view(1, bsz * q_len, dim)
            self.bc.run_bsz1(x, d.view(x.shape))
            return d
        x = x.view(1, bsz * q_len, dim)
        guh = torch.empty((2, bsz * q_len, dim), device=x.device)
        gu = torch.empty((2, bsz * q_len, INTERMEDIATE), device=x.device)
        exl3_mgemm_gr(x, self.multi_gu[0], gu, self.multi_gu[1], guh, self.multi_gu[2], None)   # ext.exl3_mgemm
        g = gu[0].view(bsz, q_len, INTERMEDIATE)
        u = gu[1].view(bsz, q_len, INTERMEDIATE)
        a = torch.empty_like(u)
        silu_mul_gr(g, u, a, 0.0, None)                             # activation_fn_call
        return self.down.forward(a, params)


class Model:
    def __init__(self, device, graphs):
        gen = generator(0x7B01FC5)
        self.norms = [(1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(device) for _ in range(NUM_LAYERS)]
        self.mlps = [GatedMLP(gen, device, f"layer {i} MLP bsz1", graphs) for i in range(NUM_LAYERS)]

    def forward(self, x, params):
        for norm, mlp in zip(self.norms, self.mlps):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm
            x = x + mlp.forward(h, params)
        return x


def run(variant: str, device: str = "cpu"):
    gen = generator(7)
    inputs = [torch.randn(bsz, 1, HIDDEN, generator=gen).to(device) for bsz in WORKLOAD]

    def serve(graphs: bool):
        _reset_process(variant)
        model = Model(device, graphs)
        return [model.forward(x.clone(), {}).clone() for x in inputs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
