"""SYCL graph recording of the first decode step throws: the lazy Q4_0 weight reorder mallocs a temp buffer and waits on the recording queue.

Upstream: https://github.com/ggml-org/llama.cpp/pull/16644 ("sycl: use async memory allocation to fix crashes during
graph recording", ggml-org/llama.cpp, Matthew Michel, merged 2025-10-22; synced to ggml as aaa8acb5). Follow-up
https://github.com/ggml-org/llama.cpp/pull/22153 keeps the same helpers and adds an env toggle.
Symptom: with ``GGML_SYCL_DISABLE_GRAPH=0`` "most use cases crash" (PR description: host waits and SYCL
malloc/free are unsupported in graph recording). In the model, the prompt is processed, then the first single-token
decode step throws from the recording queue (a host wait on an event of a queue recording to a graph is an
``errc::invalid`` ``sycl::exception``). With graphs disabled (the default) the same model generates.
Mechanism: ``ggml_backend_sycl_graph_compute`` (ggml/src/ggml-sycl/ggml-sycl.cpp) records every cgraph it is given
(``model_sycl_graph.begin_recording(*stream)``, ``ggml_backend_sycl_graph_compute_impl``, ``end_recording``),
finalizes it and submits it with ``ext_oneapi_graph``: there is no eager warm-up before a recording. Inside it,
``ggml_sycl_mul_mat`` calls ``opt_for_reorder`` for a MMVQ/DMMV matmul whose ``src1`` is one column (a decode token,
``should_reorder_tensor``). The first time it meets a Q4_0/Q4_K/Q6_K weight (``extra->optimized_feature.reorder`` is
false) it calls ``reorder_qw`` -> ``reorder_qw_q4_0``, which rewrites the weight in place from array-of-blocks to
struct-of-arrays through a temporary copy: ``sycl::malloc_shared(size, *stream)``, ``stream->memcpy(tmp_buf,
data_device, size).wait()``, a ``parallel_for`` ending in ``.wait_and_throw()``, ``sycl::free(tmp_buf, *stream)``.
Eagerly these only block the host. While the queue records, the host wait on the memcpy's event is illegal and
throws (and the malloc/free are host-side calls a graph cannot hold: the free would release the buffer before the
recorded kernels ever run). The prompt step is fine: its ``src1`` has several columns, so nothing is reordered.
Doctor: sync-in-capture, at reorder_qw_q4_0 (its ``.wait()`` on the memcpy event is the host synchronisation
attempted in the recorded region; the fix rewrote exactly this function: the temp buffer through
``sycl_ext_malloc_device``/``sycl_ext_free``, and the two waits skipped when async memory ops are on).
Fix (upstream): ``sycl_ext_malloc_device(stream, size)`` / ``sycl_ext_free(stream, ptr)`` call
``syclex::async_malloc(*stream, usm::alloc::device, size)`` / ``syclex::async_free(*stream, ptr)`` when
``g_ggml_sycl_use_async_mem_op`` (set in ``ggml_check_sycl`` to ``!g_ggml_sycl_disable_graph`` when every device has
``aspect::ext_oneapi_async_memory_alloc``), else ``sycl::malloc(..., device)`` / ``sycl::free``; the temp buffer is
device memory now (the extension allocates only device memory); ``reorder_qw_q4_0`` (and _q4_k, _q6_k) keep the
events and ``wait()`` only ``if (!g_ggml_sycl_use_async_mem_op)``. The allocation, copy, reorder kernel and free
become nodes ordered in the recorded queue. ``check_graph_compatibility`` also refuses graphs for ``GGML_OP_MUL_MAT``
when the async extension is not available (not taken here: the modelled compiler has it).
Modelled: a one-layer decoder (``get_rows`` embedding, Q4_0 ``ffn_up``, SILU, Q4_0 ``ffn_down``, residual ADD, Q4_0
``output``) on one device: a 3-token prompt then greedy single-token decode steps; the logits of every step are the
outputs. Only the Q4_0 reorder is modelled (Q4_K/Q6_K are the same change). A SYCL command graph is a workbench
graph: ``begin_recording``/``end_recording`` are a capture with no warm-up, ``ext_oneapi_graph`` one replay; the
executable graph ``update`` is modelled as a fresh finalize every call (the path upstream takes when the topology
changes, as it does after the reorder step). ``event.wait()`` is the engine's ``synchronize`` (a host wait a capture
refuses, as a recording queue does); ``sycl::malloc_shared``/``sycl::malloc`` are plain allocations and
``syclex::async_malloc`` a stream-ordered one (``torch.empty`` on the queue's device); USM pointers are tensors kept
in a table until freed. MMVQ's q8_1 quantisation of ``src1`` is left out (weights are dequantised to fp32, from the
block layout or, once reordered, from the struct-of-arrays layout, as the ``_reorder`` kernels read it). The
compute buffer (one set of node tensors per token count) is allocated once, outside any recording, as ggml-alloc
does; ``ggml_backend_tensor_set``/``_get`` copy tokens in and logits out around each compute.
"""
from __future__ import annotations

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/16644"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "reorder_qw_q4_0"
SYMPTOM = ("GGML_SYCL_DISABLE_GRAPH=0: the first decode step's graph recording throws from the lazy Q4_0 weight "
           "reorder (sycl::malloc_shared temp buffer, memcpy(...).wait() on the recording queue)")

N_VOCAB, N_EMBD, N_FF = 16, 64, 64
QK4_0 = 32
BLOCK_Q4_0_BYTES = 2 + QK4_0 // 2          # struct block_q4_0 { ggml_half d; uint8_t qs[QK4_0 / 2]; }
MMVQ_MAX_BATCH_SIZE = 8
PROMPT = [3, 7, 1]
N_DECODE = 4

GGML_TYPE_F32, GGML_TYPE_Q4_0, GGML_TYPE_I32 = "f32", "q4_0", "i32"
GGML_OP_NONE, GGML_OP_GET_ROWS, GGML_OP_MUL_MAT, GGML_OP_UNARY, GGML_OP_ADD = (
    "NONE", "GET_ROWS", "MUL_MAT", "UNARY", "ADD")
GGML_OP_CONCAT, GGML_OP_MUL_MAT_ID = "CONCAT", "MUL_MAT_ID"
MMVQ = "MMVQ"

VARIANT = {"v": "bug"}
# ggml-sycl.cpp globals
g_ggml_sycl_disable_graph = 1            # GGML_SYCL_DISABLE_GRAPH, default 1
g_ggml_sycl_disable_optimize = 0
g_ggml_sycl_use_async_mem_op = 0         # (fix) added by #16644


class SyclException(RuntimeError):
    """sycl::exception (errc::invalid)."""


# --- SYCL runtime stand-ins ------------------------------------------------------------------------

class event:
    def __init__(self, queue):
        self.queue = queue

    def wait(self) -> None:
        # A host wait: on a queue recording to a graph it is illegal (the capture refuses the wait)
        synchronize(self.queue.device)

    def wait_and_throw(self) -> None:
        self.wait()


class queue:
    """An in-order sycl::queue on one device (dpct::queue_ptr)."""

    def __init__(self, device: str):
        self.device = device
        self.usm = {}                         # USM pointer -> allocation

    def memcpy(self, dst: torch.Tensor, src: torch.Tensor, size: int) -> event:
        dst[:size].copy_(src[:size])
        return event(self)

    def parallel_for(self, n: int, kernel) -> event:
        kernel(n)
        return event(self)


class sycl:
    class usm:
        class alloc:
            device, shared, host = "device", "shared", "host"

    @staticmethod
    def malloc(size: int, q: queue, kind: str) -> torch.Tensor:
        """Host-side USM allocation (not a queue command: a recording cannot hold it)."""
        ptr = torch.empty(size, dtype=torch.uint8, device=q.device)
        q.usm[ptr.data_ptr()] = ptr
        return ptr

    @staticmethod
    def malloc_shared(size: int, q: queue) -> torch.Tensor:
        return sycl.malloc(size, q, sycl.usm.alloc.shared)

    @staticmethod
    def free(ptr: torch.Tensor, q: queue) -> None:
        q.usm.pop(ptr.data_ptr(), None)


class syclex:
    """sycl::ext::oneapi::experimental (sycl_ext_oneapi_async_memory_alloc)."""

    @staticmethod
    def async_malloc(q: queue, kind: str, size: int) -> torch.Tensor:
        if kind != sycl.usm.alloc.device:
            raise SyclException("async_malloc supports only usm::alloc::device")
        ptr = torch.empty(size, dtype=torch.uint8, device=q.device)      # ordered in the queue
        q.usm[ptr.data_ptr()] = ptr
        return ptr

    @staticmethod
    def async_free(q: queue, ptr: torch.Tensor) -> None:
        q.usm.pop(ptr.data_ptr(), None)


class command_graph:
    """sycl_ex::command_graph<modifiable>: a queue recording is a graph capture (no warm-up)."""

    def __init__(self, q: queue):
        self.queue = q
        self.recorded = None

    def record(self, fn, name, static, state):
        self.recorded = capture(fn, device=self.queue.device, warmups=0, name=name, static=static, state=state,
                                owner="ggml_backend_sycl_graph_compute")

    def finalize(self):
        return self.recorded                  # (graph, outputs)


# --- ggml tensors --------------------------------------------------------------------------------

class optimize_feature:
    def __init__(self):
        self.reorder = False


class ggml_tensor_extra_gpu:
    def __init__(self):
        self.optimized_feature = optimize_feature()


class ggml_tensor:
    def __init__(self, name, type_, ne, data, op=GGML_OP_NONE, src=(), extra=None):
        self.name, self.type, self.ne, self.data = name, type_, ne, data
        self.op, self.src, self.extra = op, list(src), extra


def ggml_nbytes(t: ggml_tensor) -> int:
    return t.data.numel() * t.data.element_size()


def quantize_row_q4_0_ref(x: torch.Tensor) -> torch.Tensor:
    """ggml-quants.c: one block of 32 values -> d (fp16) + 16 bytes of nibbles."""
    blocks = x.reshape(-1, QK4_0)
    idx = blocks.abs().argmax(dim=1, keepdim=True)
    mx = torch.gather(blocks, 1, idx)
    d = mx / -8
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp((blocks * inv + 8.5).to(torch.int32), max=15).to(torch.uint8)
    qs = q[:, :QK4_0 // 2] | (q[:, QK4_0 // 2:] << 4)
    d_bytes = d.to(torch.float16).view(torch.uint8)                        # [nb, 2]
    return torch.cat([d_bytes, qs], dim=1).reshape(-1)                     # array of block_q4_0


def dequantize_q4_0(t: ggml_tensor) -> torch.Tensor:
    """dequantize_block_q4_0 / dequantize_block_q4_0_reorder, by the weight's current layout."""
    ncols, nrows = t.ne
    nb = ncols * nrows // QK4_0
    if t.extra is not None and t.extra.optimized_feature.reorder:
        qs = t.data[:nb * QK4_0 // 2].view(nb, QK4_0 // 2)
        d = t.data[nb * QK4_0 // 2:].view(torch.float16).view(nb, 1)
    else:
        blocks = t.data.view(nb, BLOCK_Q4_0_BYTES)
        d = blocks[:, :2].contiguous().view(torch.float16)
        qs = blocks[:, 2:]
    lo = (qs & 0x0F).to(torch.float32) - 8
    hi = (qs >> 4).to(torch.float32) - 8
    return (torch.cat([lo, hi], dim=1) * d.to(torch.float32)).reshape(nrows, ncols)


# --- ggml/src/ggml-sycl/ggml-sycl.cpp ----------------------------------------------------------------

class ggml_backend_sycl_context:
    class opt_feature:
        reorder = True                        # this device benefits from the reorder

    def __init__(self, device: str):
        self.device = device
        self._stream = queue(device)
        self.exec_graph = None

    def stream(self) -> queue:
        return self._stream


def ggml_check_sycl(disable_graph: int) -> None:
    global g_ggml_sycl_disable_graph, g_ggml_sycl_use_async_mem_op
    g_ggml_sycl_disable_graph = disable_graph
    g_ggml_sycl_use_async_mem_op = 0
    if VARIANT["v"] == "fix":
        # #16644: async malloc / free only when graphs are enabled (every device has the aspect here)
        g_ggml_sycl_use_async_mem_op = int(not g_ggml_sycl_disable_graph)


def sycl_ext_malloc_device(stream: queue, size: int) -> torch.Tensor:
    use_async = g_ggml_sycl_use_async_mem_op
    if use_async:
        return syclex.async_malloc(stream, sycl.usm.alloc.device, size)
    return sycl.malloc(size, stream, sycl.usm.alloc.device)


def sycl_ext_free(stream: queue, ptr: torch.Tensor) -> None:
    use_async = g_ggml_sycl_use_async_mem_op
    if use_async:
        syclex.async_free(stream, ptr)
        return
    sycl.free(ptr, stream)


def reorder_qw_q4_0(data_device: torch.Tensor, ncols: int, nrows: int, size: int, offset: int,
                    stream: queue) -> None:
    if VARIANT["v"] == "bug":
        tmp_buf = sycl.malloc_shared(size, stream)
        stream.memcpy(tmp_buf, data_device, size).wait()
    else:
        tmp_buf = sycl_ext_malloc_device(stream, size)
        copy_event = stream.memcpy(tmp_buf, data_device, size)
        if not g_ggml_sycl_use_async_mem_op:
            copy_event.wait()

    assert size % BLOCK_Q4_0_BYTES == 0 and offset % BLOCK_Q4_0_BYTES == 0
    offset_blks = offset // BLOCK_Q4_0_BYTES
    qs_off = offset_blks * QK4_0 // 2
    d_off = qs_off + ncols * nrows // 2 + 2 * offset_blks

    def kernel(nblocks):
        x = tmp_buf[:size].view(nblocks, BLOCK_Q4_0_BYTES)                 # const block_q4_0 * x
        data_device[qs_off:qs_off + nblocks * QK4_0 // 2].copy_(x[:, 2:].reshape(-1))
        data_device[d_off:d_off + 2 * nblocks].copy_(x[:, :2].reshape(-1))

    reorder_event = stream.parallel_for(size // BLOCK_Q4_0_BYTES, kernel)
    if VARIANT["v"] == "bug":
        reorder_event.wait_and_throw()
        sycl.free(tmp_buf, stream)
    else:
        if not g_ggml_sycl_use_async_mem_op:
            reorder_event.wait_and_throw()
        sycl_ext_free(stream, tmp_buf)


def reorder_qw(src0: ggml_tensor, stream: queue) -> None:
    ncols, nrows = src0.ne
    if src0.type == GGML_TYPE_Q4_0:
        reorder_qw_q4_0(src0.data, ncols, nrows, ggml_nbytes(src0), 0, stream)
    else:
        raise RuntimeError("reorder_qw() called with unsupported type")


def should_reorder_tensor(ctx: ggml_backend_sycl_context, dst: ggml_tensor) -> bool:
    return (not g_ggml_sycl_disable_optimize and ctx.opt_feature.reorder and dst.op == GGML_OP_MUL_MAT
            and dst.src[1].ne[1] == 1)


def opt_for_reorder(ctx, src0, src1, dst, mm_algorithm) -> None:
    if not should_reorder_tensor(ctx, dst):
        return
    extra = src0.extra
    if extra is None or extra.optimized_feature.reorder:
        return                                # skip permutations and already reordered tensors
    if mm_algorithm == MMVQ and src0.type != GGML_TYPE_Q4_0:
        return
    reorder_qw(src0, ctx.stream())
    extra.optimized_feature.reorder = True    # used to decode/dequant in next steps and avoid re-reordering


def ggml_sycl_op_mul_mat_vec_q(src0, src1, dst) -> None:
    """y[token] = W x[token] (both layouts: mul_mat_vec_q / the _reorder kernel)."""
    w = dequantize_q4_0(src0)                                          # [nrows, ncols]
    torch.matmul(src1.data, w.t(), out=dst.data)


def ggml_sycl_mul_mat(ctx, src0, src1, dst) -> None:
    use_mul_mat_vec_q = src0.type == GGML_TYPE_Q4_0 and src1.ne[1] <= MMVQ_MAX_BATCH_SIZE
    if use_mul_mat_vec_q:
        opt_for_reorder(ctx, src0, src1, dst, MMVQ)
        ggml_sycl_op_mul_mat_vec_q(src0, src1, dst)
    else:
        torch.matmul(src1.data, dequantize_q4_0(src0).t(), out=dst.data)


def ggml_sycl_compute_forward(ctx, node: ggml_tensor) -> bool:
    if node.op == GGML_OP_GET_ROWS:
        torch.index_select(node.src[0].data, 0, node.src[1].data, out=node.data)
    elif node.op == GGML_OP_MUL_MAT:
        ggml_sycl_mul_mat(ctx, node.src[0], node.src[1], node)
    elif node.op == GGML_OP_UNARY:
        x = node.src[0].data
        torch.mul(x, torch.sigmoid(x), out=node.data)                  # GGML_UNARY_OP_SILU
    elif node.op == GGML_OP_ADD:
        torch.add(node.src[0].data, node.src[1].data, out=node.data)
    else:
        return False
    return True


def ggml_backend_sycl_graph_compute_impl(sycl_ctx, cgraph):
    for node in cgraph["nodes"]:
        ok = ggml_sycl_compute_forward(sycl_ctx, node)
        assert ok, f"op not supported {node.name} ({node.op})"
    return cgraph["nodes"][-1].data


def check_graph_compatibility(cgraph) -> bool:
    for node in cgraph["nodes"]:
        if node.op in (GGML_OP_CONCAT, GGML_OP_MUL_MAT_ID):
            return False                      # blocking host waits (#13587)
        if VARIANT["v"] == "fix" and node.op == GGML_OP_MUL_MAT and not g_ggml_sycl_use_async_mem_op:
            return False                      # reorder needs malloc / free / host waits without async alloc
    return True


def ggml_backend_sycl_graph_compute(backend, cgraph):
    sycl_ctx = backend
    use_sycl_graph = not g_ggml_sycl_disable_graph and check_graph_compatibility(cgraph)
    if use_sycl_graph:
        model_sycl_graph = command_graph(sycl_ctx.stream())
        # begin_recording(*stream); ggml_backend_sycl_graph_compute_impl(); end_recording()
        model_sycl_graph.record(lambda: ggml_backend_sycl_graph_compute_impl(sycl_ctx, cgraph),
                                name=f"cgraph n_tokens={cgraph['n_tokens']}", static=cgraph["inputs"],
                                state=cgraph["weights"])
        sycl_ctx.exec_graph = model_sycl_graph.finalize()
        g, outputs = sycl_ctx.exec_graph
        return replay(g, outputs)             # stream->ext_oneapi_graph(*exec_graph)
    return ggml_backend_sycl_graph_compute_impl(sycl_ctx, cgraph)


# --- llama.cpp: model, graph build, decode loop ----------------------------------------------------

class llama_model:
    def __init__(self, device: str):
        gen = generator(16644)

        def q4_0(name, nrows, ncols):
            w = torch.randn(nrows, ncols, generator=gen) * 0.3
            return ggml_tensor(name, GGML_TYPE_Q4_0, (ncols, nrows), quantize_row_q4_0_ref(w).to(device),
                               extra=ggml_tensor_extra_gpu())

        self.tok_embd = ggml_tensor("token_embd.weight", GGML_TYPE_F32, (N_EMBD, N_VOCAB),
                                    torch.randn(N_VOCAB, N_EMBD, generator=gen).to(device))
        self.ffn_up = q4_0("blk.0.ffn_up.weight", N_FF, N_EMBD)
        self.ffn_down = q4_0("blk.0.ffn_down.weight", N_EMBD, N_FF)
        self.output = q4_0("output.weight", N_VOCAB, N_EMBD)


class llama_context:
    def __init__(self, model: llama_model, device: str, disable_graph: int):
        ggml_check_sycl(disable_graph)
        self.model, self.device = model, device
        self.backend = ggml_backend_sycl_context(device)
        self.graphs = {}                      # n_tokens -> cgraph with its allocated compute buffer

    def build_graph(self, n_tokens: int):
        if n_tokens in self.graphs:
            return self.graphs[n_tokens]
        m, dev = self.model, self.device

        def t(name, ne, op, src, dtype=torch.float32):
            return ggml_tensor(name, GGML_TYPE_F32, ne, torch.zeros(ne[1], ne[0], dtype=dtype, device=dev), op, src)

        inp_tokens = ggml_tensor("inp_tokens", GGML_TYPE_I32, (n_tokens, 1),
                                 torch.zeros(n_tokens, dtype=torch.long, device=dev))
        inpL = t("inp_embd", (N_EMBD, n_tokens), GGML_OP_GET_ROWS, [m.tok_embd, inp_tokens])
        up = t("ffn_up", (N_FF, n_tokens), GGML_OP_MUL_MAT, [m.ffn_up, inpL])
        act = t("ffn_silu", (N_FF, n_tokens), GGML_OP_UNARY, [up])
        down = t("ffn_out", (N_EMBD, n_tokens), GGML_OP_MUL_MAT, [m.ffn_down, act])
        res = t("l_out", (N_EMBD, n_tokens), GGML_OP_ADD, [down, inpL])
        logits = t("result_output", (N_VOCAB, n_tokens), GGML_OP_MUL_MAT, [m.output, res])
        cgraph = {"n_tokens": n_tokens, "nodes": [inpL, up, act, down, res, logits], "inp_tokens": inp_tokens,
                  "inputs": {"inp_tokens": inp_tokens.data},
                  "weights": {w.name: w.data for w in (m.ffn_up, m.ffn_down, m.output)}}
        self.graphs[n_tokens] = cgraph
        return cgraph

    def decode(self, tokens):
        cgraph = self.build_graph(len(tokens))
        cgraph["inp_tokens"].data.copy_(torch.tensor(tokens, device=self.device))   # ggml_backend_tensor_set
        out = ggml_backend_sycl_graph_compute(self.backend, cgraph)
        return out.clone()                                                          # ggml_backend_tensor_get


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant

    def generate(disable_graph: int):
        ctx = llama_context(llama_model(device), device, disable_graph)
        outs = [ctx.decode(PROMPT)]
        token = int(outs[-1][-1].argmax())
        for _ in range(N_DECODE):
            outs.append(ctx.decode([token]))
            token = int(outs[-1][-1].argmax())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: generate(disable_graph=0), lambda: generate(disable_graph=1))
