"""ggml-sycl records every cgraph into a SYCL command graph when ``GGML_SYCL_DISABLE_GRAPH=0``, with no check of the ops in it; ``ggml_sycl_mul_mat_id`` copies the expert ids to the host and waits on the queue (and a dim-3 ``CONCAT`` waits on its two memcpys), so recording a graph that holds one of them throws from the blocking wait.

Upstream: https://github.com/ggml-org/llama.cpp/pull/13587 ("SYCL: Avoid using SYCL-Graph for unsupported nodes",
ggml-org/llama.cpp, Ewan Crawford (EwanC, Codeplay), opened 2025-05-16, merged; the merge is synced into ggml as
ggml-org/ggml@c7fef2ad and into whisper.cpp as 730a00be8, both dated 2025-05-22, "SYCL: Avoid using with SYCL-Graph
for unsupported nodes (llama/13587)"). Read: the full diff of that commit (``ggml/src/ggml-sycl/ggml-sycl.cpp``: the new
``check_graph_compatibility`` and its call in ``ggml_backend_sycl_graph_compute``), in the whisper.cpp and ggml
mirrors; the PR description and the opening of one review thread (Rbiessy, on the hunk that then named the function
``check_node_graph_compatibility``; the comment itself not seen) in the search index; at the parent
revision (whisper.cpp 730a00be8^): ``ggml/src/ggml-sycl/ggml-sycl.cpp`` (``g_ggml_sycl_disable_graph`` read from
``GGML_SYCL_DISABLE_GRAPH`` with default 1, ``ggml_sycl_mul_mat_id`` with ``k_copy_src1_to_contiguous`` /
``k_copy_dst_from_contiguous``, ``ggml_backend_sycl_graph_compute_impl``, ``ggml_backend_sycl_graph_compute``),
``ggml/src/ggml-sycl/concat.cpp`` (``ggml_sycl_op_concat``), ``common.hpp`` (``CHECK_TRY_ERROR``, ``SYCL_CHECK``); in
ggml at c7fef2ad^: ``tests/test-backend-ops.cpp`` (``test_case::eval``, ``test_mul_mat`` / ``test_mul_mat_id`` /
``test_concat`` and their case lists) and ``src/ggml-backend.cpp`` (``ggml_backend_compare_graph_backend``).
Not read: the body of ``ggml_sycl_error`` (``SYCL_CHECK``'s handler: taken to end the process), DPC++'s SYCL-Graph
runtime for the CUDA backend (that a host wait on a recording queue throws is the PR description's statement, and
the sycl_ext_oneapi_graph spec's), ``ggml_sycl_mul_mat``'s oneMKL/DNN f32 path, ``ggml_sycl_compute_forward``'s full
switch, any issue thread (the PR links none).
Symptom: PR description: "Currently on a CUDA backend to SYCL when running ``GGML_SYCL_DISABLE_GRAPH=0
./bin/test-backend-ops -b SYCL0`` there are two operations that throw an exception from the blocking waits during
queue recording": ``-o CONCAT`` ("Use of blocking waits on a queue that's being recorded in ggml_sycl_op_concat") and
``-o MUL_MAT_ID`` ("Blocking wait on a recording queue for a copy to host memory in ggml_sycl_mul_mat_id").
Mechanism: with graphs enabled, ``ggml_backend_sycl_graph_compute`` does ``command_graph(*stream)``,
``begin_recording(*stream)``, ``ggml_backend_sycl_graph_compute_impl`` (every node's ``ggml_sycl_compute_forward``),
``end_recording``, ``finalize`` (or ``update`` of the kept executable graph) and ``ext_oneapi_graph`` for whatever
cgraph it is given; nothing is run eagerly first. ``ggml_sycl_mul_mat_id`` does ``stream->memcpy(ids_host.data(),
ids_dev, ggml_nbytes(ids))`` then ``stream->wait()``: it needs the expert ids on the host to loop over tokens and
slots (``ne12 == 1``) or to count each expert's rows (the grouped path). ``ggml_sycl_op_concat`` with ``dim == 3`` and
contiguous operands does two ``stream->memcpy(...).wait()``. A host wait on a queue recording to a graph is illegal:
the exception leaves ``CHECK_TRY_ERROR`` as an error code and ``SYCL_CHECK`` reports it. Were the wait allowed, the
recorded graph would still keep the expert choice the host loop made at recording. Eagerly (the default,
``GGML_SYCL_DISABLE_GRAPH=1``) the waits only block the host and every case passes.
Doctor: sync-in-capture, at ggml_backend_sycl_graph_compute. A host synchronisation is attempted inside the recorded
region. The waits themselves are in ``ggml_sycl_mul_mat_id`` and ``ggml_sycl_op_concat``, which upstream left as
they were; the defect is the graph path's decision to record a cgraph holding ops that must wait on the host, and
that decision is made in ``ggml_backend_sycl_graph_compute``, the function the fix changed (it now asks
``check_graph_compatibility`` before recording).
Fix (upstream): ``check_graph_compatibility(cgraph)`` returns false when more than one SYCL device exists ("A
sycl_ex::command_graph object can only be created for a single device") or when any node is ``GGML_OP_CONCAT``
or ``GGML_OP_MUL_MAT_ID`` (logging "disabling SYCL graphs due to unsupported node type");
``ggml_backend_sycl_graph_compute`` records only if ``!g_ggml_sycl_disable_graph &&
check_graph_compatibility(cgraph)``, else it runs the nodes directly. The ops themselves are unchanged.
Modelled: ``ggml_backend_sycl_graph_compute`` (both variants), ``check_graph_compatibility`` (fix),
``ggml_backend_sycl_graph_compute_impl``, ``ggml_sycl_compute_forward`` (MUL_MAT, MUL_MAT_ID, CONCAT),
``ggml_sycl_mul_mat``, ``ggml_sycl_mul_mat_id`` (the ids readback and wait; the ``ne12 == 1`` host loop; the grouped
path with its host row count, ``k_copy_src1_to_contiguous``, one matmul per expert and
``k_copy_dst_from_contiguous``), ``ggml_sycl_op_concat`` (the ``dim == 3`` memcpy-and-wait path and the kernel path),
``ggml_sycl_info().device_count``; ``test-backend-ops`` mode ``test``: ``test_mul_mat``, ``test_mul_mat_id``,
``test_concat`` (``build_graph``; ``initialize_tensors``: the default ``init_tensor_uniform`` in [-1, 1], and for
MUL_MAT_ID's ids each row a shuffled ``i % n_mats``)
and ``test_case::eval`` through ``ggml_backend_compare_graph_backend`` (one ``ggml_backend_graph_compute`` per node,
on a one-node graph view, then ``ggml_backend_tensor_get``).
Stand-ins: a SYCL command graph is a workbench graph: ``begin_recording``/``end_recording`` is a capture with no
warm-up, ``ext_oneapi_graph`` one replay; every compute finalizes a fresh executable graph (upstream updates the
kept one when it can, re-finalizing when the update throws). ``queue::wait``/``event::wait`` is the engine's
``synchronize`` (refused inside a capture on both backends, as the recording queue refuses it); the ids' host vector
is ``host()`` memory filled by a non-blocking copy; the engine's refusal propagates as the error (upstream reports it
through ``SYCL_CHECK``). Tensors are float64 (ggml F32), laid out as torch ``(ne3, ne2, ne1, ne0)``; the f32 GEMM is
``torch.matmul``; the grouped MUL_MAT_ID path orders each expert's rows with a stable device argsort where the
kernel takes them in atomic order (the result is the same). The comparison with the CPU backend, the sentinels,
NMSE and the printing are left out: the workload's outputs are the SYCL backend's results. Scaled cases: MUL_MAT
(m 8, k 16, n 1 and 4), MUL_MAT_ID (n_mats 4, n_used 4, m 8, k 16; n 1, n 4, and n 4 with broadcast ``b``: upstream
m 512, k 256, n 1/32/129; ``n_used == n_mats``, so ids needs no VIEW node, which the cases with fewer slots add
and the SYCL backend skips), CONCAT of a [4, 3, 2, 2] with 2 along dims 0 and 3 (upstream [11, 12, 13, 14] with
7).
Workload: ``test-backend-ops -b SYCL0`` over those seven cases, in upstream's op order (MUL_MAT, MUL_MAT_ID,
CONCAT), with ``GGML_SYCL_DISABLE_GRAPH=0`` (served: graphs) and ``=1`` (eager reference); one device; outputs:
every case's result tensor.
Measured (CPU, the check's output):
``llamacpp_13587_sycl_graph_records_mul_mat_id_host_wait [bug] on cpu: misbehaves (raised CaptureError: synchronize()
inside graph capture needs the device's values on the host (a host synchronisation), which a CUDA graph cannot wait
for (cudaErrorStreamCaptureUnsupported).)`` -- at the first MUL_MAT_ID case, from ``stream.wait()`` after the ids
readback in ``ggml_sycl_mul_mat_id``; the two MUL_MAT cases before it were recorded and replayed.
``llamacpp_13587_sycl_graph_records_mul_mat_id_host_wait [fix] on cpu: equals eager (max |graph - eager| = 0)`` --
the MUL_MAT cases are recorded, MUL_MAT_ID and CONCAT run directly. Not run on CUDA (no device was used).
"""
from __future__ import annotations

import torch

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/13587"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "ggml_backend_sycl_graph_compute"
SYMPTOM = ("GGML_SYCL_DISABLE_GRAPH=0: test-backend-ops -o MUL_MAT_ID (and -o CONCAT) throws from a blocking wait on "
           "the queue that is recording the SYCL graph (ids copied to the host in ggml_sycl_mul_mat_id)")

GGML_OP_MUL_MAT, GGML_OP_MUL_MAT_ID, GGML_OP_CONCAT = "MUL_MAT", "MUL_MAT_ID", "CONCAT"
GGML_TYPE_F32, GGML_TYPE_I32 = torch.float64, torch.int32      # ggml F32 computed in float64 here

VARIANT = {"v": "bug"}
g_ggml_sycl_disable_graph = 1            # GGML_SYCL_DISABLE_GRAPH (get_sycl_env default 1)
SYCL_DEVICE_COUNT = 1                    # ggml_sycl_info().device_count


# --- SYCL runtime stand-ins ----------------------------------------------------------------------

class event:
    def __init__(self, q):
        self.queue = q

    def wait(self) -> None:
        synchronize(self.queue.device)   # a host wait: illegal on a queue that is recording a graph


class queue:
    """An in-order sycl::queue (dpct::queue_ptr) on one device."""

    def __init__(self, device: str):
        self.device = device

    def memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> event:
        dst.copy_(src, non_blocking=True)
        return event(self)

    def memset(self, dst: torch.Tensor, value: int) -> event:
        dst.fill_(value)
        return event(self)

    def wait(self) -> None:
        synchronize(self.device)


class command_graph:
    """sycl_ex::command_graph: begin_recording ... end_recording is a capture (no warm-up)."""

    def __init__(self, q: queue):
        self.queue = q
        self.recorded = None

    def record(self, fn, name: str, static: dict):
        self.recorded = capture(fn, device=self.queue.device, warmups=0, name=name, static=static,
                                owner="ggml_backend_sycl_graph_compute")

    def finalize(self):
        return self.recorded


# --- ggml tensors ----------------------------------------------------------------------------------

class ggml_tensor:
    def __init__(self, name: str, data: torch.Tensor, op: str | None = None, src=(), op_params=()):
        self.name, self.data, self.op, self.src, self.op_params = name, data, op, list(src), list(op_params)

    @property
    def ne(self):                        # ggml order: ne[0] is the innermost dimension
        return tuple(reversed(self.data.shape)) + (1,) * (4 - self.data.dim())


class ggml_backend_sycl_context:
    def __init__(self, device: str):
        self.device = device
        self._stream = queue(device)
        self.exec_graph = None

    def stream(self) -> queue:
        return self._stream


# --- ggml/src/ggml-sycl ----------------------------------------------------------------------------

def ggml_sycl_mul_mat(ctx, src0: torch.Tensor, src1: torch.Tensor, dst: torch.Tensor) -> None:
    """dst = src1 * src0^T (ggml: C^T = A * B^T), the f32 GEMM path."""
    torch.matmul(src1, src0.transpose(-1, -2), out=dst)


def ggml_sycl_mul_mat_id(ctx: ggml_backend_sycl_context, dst: ggml_tensor) -> None:
    src0, src1, ids = dst.src                        # as [n_as, m, k], b [n, ne11, k], ids [n, n_ids]
    stream = ctx.stream()
    n_as, ne11, ne12 = src0.ne[2], src1.ne[1], src1.ne[2]
    n_ids = ids.ne[0]

    ids_host = host(torch.empty(ids.data.shape, dtype=torch.int32), ctx.device)   # std::vector<char> ids_host
    stream.memcpy(ids_host, ids.data)
    stream.wait()                                    # SYCL_CHECK(CHECK_TRY_ERROR(stream->wait()))
    ids_host = ids_host.tolist()

    src0_original, src1_original, dst_original = src0.data, src1.data, dst.data
    if ne12 == 1:
        for iid1 in range(ids.ne[1]):
            for id_ in range(n_ids):
                i02 = ids_host[iid1][id_]
                assert 0 <= i02 < n_as
                i11, i12 = id_ % ne11, iid1
                ggml_sycl_mul_mat(ctx, src0_original[i02], src1_original[i12, i11:i11 + 1],
                                  dst_original[i12, id_:id_ + 1])
        return

    m, k = src0.ne[1], src0.ne[0]
    src1_contiguous = torch.empty(ne12 * ne11, k, dtype=src1_original.dtype, device=ctx.device)   # pool allocs
    dst_contiguous = torch.empty(ids.ne[1] * n_ids, m, dtype=dst_original.dtype, device=ctx.device)
    ids_flat = ids.data.reshape(-1)                  # [iid1 * n_ids + id]
    for i02 in range(n_as):
        num_src1_rows = sum(row.count(i02) for row in ids_host)
        if num_src1_rows == 0:
            continue
        dev_cur_src1_row = torch.empty(1, dtype=torch.int32, device=ctx.device)
        stream.memset(dev_cur_src1_row, 0)
        # k_copy_src1_to_contiguous: row_mapping[src1_row] = {id, iid1} for every (iid1, id) choosing i02
        dev_row_mapping = torch.argsort((ids_flat != i02).to(torch.int8), stable=True)[:num_src1_rows]
        iid1, id_ = dev_row_mapping // n_ids, dev_row_mapping % n_ids
        rows = src1_contiguous[:num_src1_rows]
        rows.copy_(src1_original[iid1, id_ % ne11])
        out_rows = dst_contiguous[:num_src1_rows]
        ggml_sycl_mul_mat(ctx, src0_original[i02], rows, out_rows)
        # k_copy_dst_from_contiguous
        dst_original.reshape(-1, m).index_copy_(0, dev_row_mapping, out_rows)


def ggml_sycl_op_concat(ctx: ggml_backend_sycl_context, dst: ggml_tensor) -> None:
    src0, src1 = dst.src
    stream = ctx.stream()
    dim = dst.op_params[0]
    if src0.data.is_contiguous() and src1.data.is_contiguous():
        if dim != 3:
            torch.cat([src0.data, src1.data], dim=3 - dim, out=dst.data)     # concat_f32_sycl
        else:
            size0, size1 = src0.data.numel(), src1.data.numel()
            dst_d = dst.data.reshape(-1)
            stream.memcpy(dst_d[:size0], src0.data.reshape(-1)).wait()
            stream.memcpy(dst_d[size0:size0 + size1], src1.data.reshape(-1)).wait()
    else:
        torch.cat([src0.data, src1.data], dim=3 - dim, out=dst.data)         # concat_f32_sycl_non_cont


def ggml_sycl_compute_forward(ctx: ggml_backend_sycl_context, dst: ggml_tensor) -> bool:
    if dst.op == GGML_OP_MUL_MAT:
        ggml_sycl_mul_mat(ctx, dst.src[0].data, dst.src[1].data, dst.data)
    elif dst.op == GGML_OP_MUL_MAT_ID:
        ggml_sycl_mul_mat_id(ctx, dst)
    elif dst.op == GGML_OP_CONCAT:
        ggml_sycl_op_concat(ctx, dst)
    else:
        return False
    return True


def ggml_backend_sycl_graph_compute_impl(sycl_ctx: ggml_backend_sycl_context, cgraph: list) -> torch.Tensor:
    for node in cgraph:
        ok = ggml_sycl_compute_forward(sycl_ctx, node)
        assert ok, f"op not supported {node.name} ({node.op})"
    return cgraph[-1].data


def check_graph_compatibility(cgraph: list) -> bool:
    if SYCL_DEVICE_COUNT > 1:
        return False                 # a sycl_ex::command_graph can only be created for a single device
    for node in cgraph:
        if node.op in (GGML_OP_CONCAT, GGML_OP_MUL_MAT_ID):
            return False             # blocking host waits on the queue: disabling SYCL graphs
    return True


def ggml_backend_sycl_graph_compute(backend: ggml_backend_sycl_context, cgraph: list) -> None:
    sycl_ctx = backend
    if VARIANT["v"] == "fix":
        use_sycl_graph = not g_ggml_sycl_disable_graph and check_graph_compatibility(cgraph)
    else:
        use_sycl_graph = not g_ggml_sycl_disable_graph
    if use_sycl_graph:
        model_sycl_graph = command_graph(sycl_ctx.stream())
        static = {f"{node.name}.src{i}": s.data for node in cgraph for i, s in enumerate(node.src)}
        model_sycl_graph.record(lambda: ggml_backend_sycl_graph_compute_impl(sycl_ctx, cgraph),
                                name=f"{cgraph[-1].name} ({cgraph[-1].op})", static=static)
        sycl_ctx.exec_graph = model_sycl_graph.finalize()
        g, outputs = sycl_ctx.exec_graph
        replay(g, outputs)           # stream->ext_oneapi_graph(*exec_graph)
    else:
        ggml_backend_sycl_graph_compute_impl(sycl_ctx, cgraph)


# --- tests/test-backend-ops.cpp ---------------------------------------------------------------------

def init_tensor_uniform(shape, gen, device, lo=-1.0, hi=1.0) -> torch.Tensor:
    return (torch.rand(*shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(device)


class test_mul_mat:
    def __init__(self, m: int, n: int, k: int):
        self.m, self.n, self.k = m, n, k

    def build_graph(self, device):
        a = ggml_tensor("a", torch.empty(self.m, self.k, dtype=GGML_TYPE_F32, device=device))     # ne [k, m]
        b = ggml_tensor("b", torch.empty(self.n, self.k, dtype=GGML_TYPE_F32, device=device))     # ne [k, n]
        return [ggml_tensor("out", torch.empty(self.n, self.m, dtype=GGML_TYPE_F32, device=device),
                            GGML_OP_MUL_MAT, [a, b])]

    def initialize_tensors(self, nodes, gen, device):
        for t in nodes[-1].src:
            t.data.copy_(init_tensor_uniform(t.data.shape, gen, device))


class test_mul_mat_id:
    def __init__(self, n_mats: int, n_used: int, b: bool, m: int, n: int, k: int):
        assert n_used == n_mats      # the modelled cases take every expert: ids needs no view node
        self.n_mats, self.n_used, self.b, self.m, self.n, self.k = n_mats, n_used, b, m, n, k

    def build_graph(self, device):
        as_ = ggml_tensor("as", torch.empty(self.n_mats, self.m, self.k, dtype=GGML_TYPE_F32, device=device))
        ids = ggml_tensor("ids", torch.empty(self.n, self.n_mats, dtype=GGML_TYPE_I32, device=device))
        b = ggml_tensor("b", torch.empty(self.n, 1 if self.b else self.n_used, self.k, dtype=GGML_TYPE_F32,
                                         device=device))
        return [ggml_tensor("out", torch.empty(self.n, self.n_used, self.m, dtype=GGML_TYPE_F32, device=device),
                            GGML_OP_MUL_MAT_ID, [as_, b, ids])]

    def initialize_tensors(self, nodes, gen, device):
        as_, b, ids = nodes[-1].src
        for t in (as_, b):
            t.data.copy_(init_tensor_uniform(t.data.shape, gen, device))
        for r in range(ids.data.shape[0]):                   # each row: i % n_mats, shuffled
            data = torch.arange(ids.data.shape[1]) % self.n_mats
            ids.data[r].copy_(data[torch.randperm(len(data), generator=gen)].to(device, torch.int32))


class test_concat:
    def __init__(self, ne_a, ne_b_d: int, dim: int):
        self.ne_a, self.ne_b_d, self.dim = ne_a, ne_b_d, dim

    def build_graph(self, device):
        ne_b = list(self.ne_a)
        ne_b[self.dim] = self.ne_b_d
        ne_out = list(self.ne_a)
        ne_out[self.dim] += self.ne_b_d

        def t(name, ne):
            return ggml_tensor(name, torch.empty(*reversed(ne), dtype=GGML_TYPE_F32, device=device))

        a, b = t("a", self.ne_a), t("b", ne_b)
        out = t("out", ne_out)
        out.op, out.src, out.op_params = GGML_OP_CONCAT, [a, b], [self.dim]
        return [out]

    def initialize_tensors(self, nodes, gen, device):
        for t in nodes[-1].src:
            t.data.copy_(init_tensor_uniform(t.data.shape, gen, device))


def ggml_backend_compare_graph_backend(backend1, nodes) -> list:
    results = []
    for i in range(len(nodes)):
        g1v = nodes[i:i + 1]                                 # ggml_graph_view(g1, i, i + 1)
        ggml_backend_sycl_graph_compute(backend1, g1v)
        results.append(nodes[i].data.clone())                # ggml_backend_tensor_get in the callback
    return results


def make_test_cases_eval():
    cases = [test_mul_mat(8, n, 16) for n in (1, 4)]
    cases += [test_mul_mat_id(4, 4, b, 8, n, 16) for b, n in ((False, 1), (False, 4), (True, 4))]
    cases += [test_concat([4, 3, 2, 2], 2, dim) for dim in (0, 3)]
    return cases


def test_backend_ops(device: str, disable_graph: int) -> list:
    """./bin/test-backend-ops -b SYCL0 (mode test), GGML_SYCL_DISABLE_GRAPH=disable_graph."""
    global g_ggml_sycl_disable_graph
    g_ggml_sycl_disable_graph = disable_graph
    backend = ggml_backend_sycl_context(device)
    gen = generator(13587)
    outputs = []
    for case in make_test_cases_eval():
        nodes = case.build_graph(device)                     # ggml_backend_alloc_ctx_tensors
        case.initialize_tensors(nodes, gen, device)
        outputs += ggml_backend_compare_graph_backend(backend, nodes)
    return outputs


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: test_backend_ops(device, disable_graph=0),
                   lambda: test_backend_ops(device, disable_graph=1))
