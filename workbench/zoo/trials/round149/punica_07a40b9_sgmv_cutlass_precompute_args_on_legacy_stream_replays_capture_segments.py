"""punica (multi-tenant LoRA serving kernels) computes ``y[s[i]:s[i+1]] += x[s[i]:s[i+1]] @ A_i @ B_i`` for a batch
whose rows are grouped into segments, one LoRA adapter per segment (``s`` is the segment indptr; ``wa_ptr``/``wb_ptr``
hold the device addresses of each segment's adapter weights). The LoRA-B (expand) half, ``sgmv_cutlass``, runs in two
launches: ``precompute_sgmv_args`` turns ``s``, the weight pointers and ``layer_idx`` into CUTLASS's grouped-GEMM
arguments (problem sizes, per-problem pointers, leading dimensions) in a device workspace ``tmp``, then
``GemmGrouped::run`` reads them there. The day before, b5f5e1a ("use pytorch current stream for sgmv") had passed the
current stream to the GEMM so that a CUDA graph captures it, but the precompute launch kept no stream argument: it went
to the legacy default stream, which a capture on PyTorch's non-blocking side stream neither records nor refuses. So it
ran once, during capture, with the capture-time segments and pointers; every replay ran only the GEMM, on the arguments
that capture left in ``tmp``. The fix launches ``precompute_sgmv_args`` on ``stream`` too.

Upstream: https://github.com/punica-ai/punica/commit/07a40b9d30e98d88963e8a7e140120a25ac0d518 ("fix(cuda-graph): specify
stream for precompute_sgmv_args in sgmv_cutlass", punica-ai/punica, Lequn Chen, 2023-12-30, a direct commit on master;
it answers issue #33, "bug: sgmv_shrink does not support CUDA graph tracing", where Travis Addair of LoRAX confirmed it
and closed the issue the same day). Read, in a mirror: the whole diff of 07a40b9 (one line of
``csrc/sgmv/sgmv_cutlass.cuh``) and of its parent b5f5e1a (``punica_ops.cc``
``dispatch_sgmv_cutlass``/``dispatch_sgmv_shrink`` taking ``c10::cuda::getCurrentCUDAStream()``, ``sgmv``'s
``gemm.initialize(args, nullptr, stream)``/``gemm.run(stream)``, the flashinfer shrink's stream, the new
``test_sgmv_cuda_graph`` tests); at 07a40b9^: ``sgmv_cutlass.cuh`` (``precompute_sgmv_args``, ``sgmv_tmp_size``,
``alloc_from_buf``, ``sgmv`` with its Expand/Shrink ``GemmGrouped`` branches), ``punica_ops.cc`` (both dispatchers),
``src/punica/ops/__init__.py`` (``_get_cache_buf``, ``sgmv_cutlass``, ``add_lora_sgmv_cutlass``,
``add_lora_sgmv_custom_cutlass``, ``sgmv``), ``src/punica/utils/lora.py`` (``LoraWeight``, ``BatchedLoraWeight``),
``src/punica/models/llama_lora.py`` (``BatchedLlamaLoraWeight``'s segment, ``LlamaAttentionWithLora.forward``'s
``add_lora`` calls), ``tests/test_sgmv_cutlass.py``; the issue's three comments (the maintainer: "we have a kernel,
`precompute_sgmv_args`, that computes input arguments for cutlass. And sadly I forgot to add stream to it in my previous
commit"; Travis Addair: "both `CUDA_LAUNCH_BLOCKING=1` and replay issues are resolved"). The graph user: predibase/lorax
f20789de (#154 "CUDA graph compilation", 2024-01-04, by Travis Addair): ``server/lorax_server/utils/graph.py``
(``get_max_graph_state``: zeroed LoRA pointers and segments; ``GraphWrapper``: ``trace``, ``forward``'s ``pad_and_fill``
then ``replay``) and ``utils/sgmv.py``; its vendored ``sgmv_cutlass.cuh`` already launches with the stream. Not read:
issue #33's description (the store has only its comments), the flashinfer shrink kernel's body, CUTLASS's
``GemmGrouped``, LoRAX's model code. That LoRAX's replays were wrong because of stale arguments is my reading of "replay
issues"; the ``CUDA_LAUNCH_BLOCKING=1`` failure (an error at capture) is not modelled.
Symptom: with a LoRA model's decode step captured, replays apply no LoRA-B update (or another layer's, or another
segment layout's): the arguments are those of the capture's dummy batch, whose segments are all empty, so every served
step returns the base model's logits; without graphs the adapters apply.
Mechanism: ``add_lora_sgmv_custom_cutlass`` runs ``sgmv_shrink`` (on the current stream: captured, reading the static
``s``/``wa_ptr`` at each replay) and then ``sgmv_cutlass``, whose ``sgmv`` launches
``precompute_sgmv_args<<<num_problems, 1>>>`` on stream 0: during capture it executes at once, from the runner's
zeroed static ``segment``/``wb_ptr``, and writes ``m = 0`` for every problem into ``tmp`` (the last call, layer 1,
wins: ``tmp`` is shared); the captured ``GemmGrouped`` reads ``tmp`` by address at each replay. The runner copies
each batch's segments and pointers into its static buffers before every replay, but nothing in the graph turns them
into GEMM arguments any more.
Doctor: host-work-frozen, at sgmv: work the step needs every time (the argument precompute) ran once, at capture,
outside the graph, so replays reuse its capture-time result; ``sgmv`` is the function that launches it on the legacy
stream and the one the fix changes (``precompute_sgmv_args`` itself is unchanged).
Fix (upstream): ``precompute_sgmv_args<<<num_problems, 1, 0, stream>>>(...)`` in ``sgmv``.
Modelled: ``precompute_sgmv_args``, ``sgmv_tmp_size``, ``alloc_from_buf``, ``sgmv``, ``GemmGrouped``
(``initialize``/``run``), ``dispatch_sgmv_cutlass``, ``dispatch_sgmv_shrink`` and the shrink kernel's semantics,
``_get_cache_buf``, ``add_lora_sgmv_custom_cutlass`` (as ``llama_lora`` imports it, ``add_lora``), ``LoraWeight``,
``BatchedLoraWeight``; ``getCurrentCUDAStream``; a LoRAX-style ``GraphWrapper``.
Stand-ins: a launch on stream 0 runs on another thread (the CPU engine records only the capturing thread, as CUDA only
the capturing stream), as in this set's earlier legacy-stream programs. Device memory is ``DeviceMemory``: one unit is
one ``[RANK, HIDDEN]`` matrix, so a weight pointer is a matrix index and ``w[i] + layer_idx * d_in * d_out`` is
``w[i] + layer_idx``; pointers into ``x``/``y`` are row offsets; ``tmp`` is int64 words (9 per problem), not bytes; the
grouped GEMM and the shrink are tensorized over all rows and masked (no per-problem host loop), and ignore ``n``/``k``
and the leading dimensions (always the tensors' own). ``add_lora_sgmv_custom_cutlass`` takes ``tmp1``/``tmp2`` from
``_get_cache_buf`` (as punica's attention ops do, and as LoRAX hands persistent ``tmp_shrink``/``tmp_expand`` to the
kernels) instead of ``torch.empty`` per call: memory allocated inside a capture is poisoned by the CPU engine at capture
end (a capture computes nothing), while on CUDA the uncaptured precompute really writes that pool block; since each
call's freed ``tmp2`` block is handed to the next call in the same capture (my reading of the caching allocator), both
leave the last call's arguments. The model (embedding, two layers of RMSNorm, a ``proj`` with ``add_lora``, SiLU
residual; LM head), ``BatchedLoraModelWeight`` (``BatchedLlamaLoraWeight`` for one projection) and the runner's
``forward`` (copy the batch's segments, padding with empty segments, and pointers, then replay) are mine.
Workload: 3 adapters of rank 4 over hidden 8, 2 layers, float64; a captured decode step of 6 rows and up to 4
segments; 4 steps, each a new batch: adapters [0, 2] over rows [4, 2], [1, 0, 2] over [1, 3, 2], [2, 1, 0, 1] over
[2, 1, 2, 1], [1] over [6]. Outputs: each step's logits. The run without graphs calls the model directly.
Measured: the check printed
  punica_07a40b9_sgmv_cutlass_precompute_args_on_legacy_stream_replays_capture_segments [bug] on cpu: misbehaves
    (max |graph - eager| = 6.7)
  punica_07a40b9_sgmv_cutlass_precompute_args_on_legacy_stream_replays_capture_segments [fix] on cpu: equals eager
    (max |graph - eager| = 0)
Per step (bug): 6.22, 6.70, 5.15, 4.82; every replayed step equals, to the last bit, the same model run with all
segments empty (no LoRA at all). About 4 s for both variants.
"""
from __future__ import annotations

import threading
import types

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/punica-ai/punica/commit/07a40b9d30e98d88963e8a7e140120a25ac0d518"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "sgmv"
SYMPTOM = ("punica's sgmv_cutlass launched precompute_sgmv_args, which turns the segment indptr and the LoRA weight "
           "pointers into CUTLASS's grouped-GEMM arguments, on the legacy default stream, so a captured step ran it "
           "once at capture and every replay's LoRA-B GEMM used the capture-time (dummy, empty) segments")

DTYPE = torch.float64
VOCAB, HIDDEN, RANK, NUM_LAYERS, NUM_ADAPTERS = 16, 8, 4, 2, 3
MAX_BATCH, MAX_SEGMENTS = 6, 4
SHRINK_TMP_SIZE = 64                 # 8 * 1024 * 1024 bytes upstream (stand-in)
LEGACY_STREAM = 0
EPS = 1e-6
# (adapter of each segment, rows of each segment): one decode batch of MAX_BATCH requests per step
BATCHES = (((0, 2), (4, 2)), ((1, 0, 2), (1, 3, 2)), ((2, 1, 0, 1), (2, 1, 2, 1)), ((1,), (6,)))
_variant = "bug"


# --- streams and device memory (stand-ins) ---------------------------------------------------------------------------

def getCurrentCUDAStream():
    """``c10::cuda::getCurrentCUDAStream()``: inside ``torch.cuda.graph`` the capturing stream."""
    return "current stream"


def launch(stream, kernel, *args):
    """``kernel<<<grid, block, 0, stream>>>``. Stream 0 is the legacy default stream: it orders itself only with
    blocking streams, and the capture's side stream is non-blocking, so such a launch executes now and is not captured
    (here: another thread, whose current stream is the default one; the CPU engine records only the capturing one)."""
    if stream == LEGACY_STREAM:
        worker = threading.Thread(target=kernel, args=args)
        worker.start()
        worker.join()
    else:
        kernel(*args)


class DeviceMemory:
    """Device memory that LoRA weight pointers address: one unit is one ``[RANK, HIDDEN]`` matrix, so a pointer is
    a matrix index and ``w[i] + layer_idx * d_in * d_out`` becomes ``w[i] + layer_idx``."""

    def __init__(self, capacity, device):
        self.mem = torch.zeros(capacity, RANK, HIDDEN, dtype=DTYPE, device=device)
        self.top = 0

    def malloc(self, n):
        ptr = self.top
        self.top += n
        return self.mem.narrow(0, ptr, n), ptr


_memory: DeviceMemory | None = None


# --- csrc/sgmv/sgmv_cutlass.cuh --------------------------------------------------------------------------------------

def precompute_sgmv_args(all_problems, ptr_y, ptr_x, ptr_w, ld_y, ld_x, ld_w, y, x, w, s, d_in, d_out, layer_idx):
    """One threadblock per problem ``i`` (here all problems at once). Pointers into ``x`` and ``y`` are row offsets
    from the tensors' starts; pointers into the weights are matrix indices (``DeviceMemory``)."""
    s = s.long()
    m, k, n = s[1:] - s[:-1], d_in, d_out
    all_problems[:, 0].copy_(m)                   # all_problems[i] = cutlass::gemm::GemmCoord(m, n, k)
    all_problems[:, 1].fill_(n)
    all_problems[:, 2].fill_(k)
    ptr_w.copy_(w + layer_idx)                    # ptr_w[i] = w[i] + layer_idx * d_in * d_out
    ptr_x.copy_(s[:-1])                           # ptr_x[i] = x + s[i] * d_in
    ptr_y.copy_(s[:-1])                           # ptr_y[i] = y + s[i] * d_out
    ld_x.fill_(k)
    ld_w.fill_(n)
    ld_y.fill_(n)


def sgmv_tmp_size(num_problems):
    return 9 * num_problems          # sizeof(void *) * 3 + sizeof(int64_t) * 3 + sizeof(GemmCoord), in int64 words


def alloc_from_buf(buf, n):
    return buf[:n], buf[n:]          # auto *p = (T *)*buf; *buf = (void *)(p + n); return p;


def _gemm_grouped(all_problems, num_problems, ptr_a, ptr_b, ptr_c, ptr_d, lda, ldb, ldc, ldd, a, b, d):
    """The grouped GEMM kernel: ``D[i] = A[i] @ B[i] + C[i]`` for each problem, every argument read from the
    device buffers ``precompute_sgmv_args`` filled (``C`` and ``D`` are both ``ptr_Y``)."""
    j = torch.arange(a.shape[0], device=a.device)           # a row of problem i (threadblock tiles, here all rows)
    m = all_problems[:num_problems, 0]
    valid = j.unsqueeze(0) < m.unsqueeze(1)                 # [num_problems, rows]
    rows_a = (ptr_a.unsqueeze(1) + j).clamp(0, a.shape[0] - 1)
    rows_d = (ptr_d.unsqueeze(1) + j).clamp(0, d.shape[0] - 1)
    prod = torch.bmm(a[rows_a], b.mem[ptr_b]) * valid.unsqueeze(-1)     # LinearCombination(alpha 1.0, beta 1.0)
    d.index_add_(0, rows_d.reshape(-1), prod.reshape(-1, prod.shape[-1]))


class GemmGrouped:
    """``cutlass::gemm::device::GemmGrouped<GemmKernel>`` (Expand and Shrink differ only in tile shapes)."""

    def initialize(self, args, workspace=None, stream=None):
        self.args = args
        return "kSuccess"

    def run(self, stream=None):
        launch(stream, _gemm_grouped, *self.args)
        return "kSuccess"


def sgmv(y, x, w, s, tmp_d, num_problems, d_in, d_out, layer_idx, stream):
    ptr_Y, tmp_d = alloc_from_buf(tmp_d, num_problems)
    ptr_X, tmp_d = alloc_from_buf(tmp_d, num_problems)
    ptr_W, tmp_d = alloc_from_buf(tmp_d, num_problems)
    ld_Y, tmp_d = alloc_from_buf(tmp_d, num_problems)
    ld_X, tmp_d = alloc_from_buf(tmp_d, num_problems)
    ld_W, tmp_d = alloc_from_buf(tmp_d, num_problems)
    all_problems, tmp_d = alloc_from_buf(tmp_d, 3 * num_problems)
    all_problems = all_problems.view(num_problems, 3)

    if _variant == "bug":
        launch(LEGACY_STREAM, precompute_sgmv_args,                       # precompute_sgmv_args<<<num_problems, 1>>>(
               all_problems, ptr_Y, ptr_X, ptr_W, ld_Y, ld_X, ld_W, y, x, w, s, d_in, d_out, layer_idx)
    else:
        launch(stream, precompute_sgmv_args,                              # <<<num_problems, 1, 0, stream>>>
               all_problems, ptr_Y, ptr_X, ptr_W, ld_Y, ld_X, ld_W, y, x, w, s, d_in, d_out, layer_idx)

    args = (all_problems, num_problems, ptr_X, ptr_W, ptr_Y, ptr_Y, ld_X, ld_W, ld_Y, ld_Y, x, _memory, y)
    gemm = GemmGrouped()
    status = gemm.initialize(args, None, stream)
    if status != "kSuccess":
        return False
    status = gemm.run(stream)
    return status == "kSuccess"


# --- csrc/sgmv_flashinfer (the custom SGMV shrink kernel, on the current stream since b5f5e1a) ------------------------

def _sgmv_shrink_kernel(y, x, w, s, num_problems, layer_idx):
    """``y[s[i]:s[i+1]] += x[s[i]:s[i+1]] @ deref(w[i])[layer_idx].T``, reading ``s`` and ``w`` on the device."""
    s = s.long()
    rows = torch.arange(y.shape[0], device=y.device)
    problem = (s[1:num_problems + 1].unsqueeze(0) <= rows.unsqueeze(1)).sum(1).clamp(max=num_problems - 1)
    valid = (rows >= s[0]) & (rows < s[num_problems])
    wa = _memory.mem[w[problem] + layer_idx]                                   # [rows, RANK, d_in]
    y.add_(torch.bmm(wa, x.unsqueeze(-1)).squeeze(-1) * valid.unsqueeze(1))


def sgmv_shrink(y, x, w, s, tmp, num_problems, d_in, layer_idx, stream):
    launch(stream, _sgmv_shrink_kernel, y, x, w, s, num_problems, layer_idx)
    return True


# --- csrc/punica_ops.cc ----------------------------------------------------------------------------------------------

def dispatch_sgmv_cutlass(y, x, w_ptr, s, tmp, layer_idx):
    assert y.dim() == 2 and x.dim() == 2 and w_ptr.dim() == 1 and s.dim() == 1 and tmp.dim() == 1
    num_problems = s.size(0) - 1
    d_in = x.size(1)
    d_out = y.size(1)
    assert tmp.size(0) == sgmv_tmp_size(num_problems)
    stream = getCurrentCUDAStream()
    ok = sgmv(y, x, w_ptr, s, tmp, num_problems, d_in, d_out, layer_idx, stream)
    if not ok:
        raise RuntimeError(f"No suitable kernel. dtype={x.dtype}")


def dispatch_sgmv_shrink(y, x, w_ptr, s, tmp, layer_idx):
    assert y.dim() == 2 and x.dim() == 2 and w_ptr.dim() == 1 and s.dim() == 1 and tmp.dim() == 1
    num_problems = s.size(0) - 1
    d_in = x.size(1)
    assert tmp.size(0) == SHRINK_TMP_SIZE
    stream = getCurrentCUDAStream()
    ok = sgmv_shrink(y, x, w_ptr, s, tmp, num_problems, d_in, layer_idx, stream)
    if not ok:
        raise RuntimeError(f"No suitable kernel. dtype={x.dtype} d_out={y.size(1)}")


_kernels = types.SimpleNamespace(sgmv_cutlass=dispatch_sgmv_cutlass, sgmv_shrink=dispatch_sgmv_shrink,
                                 sgmv_cutlass_tmp_size=sgmv_tmp_size)


# --- src/punica/ops/__init__.py --------------------------------------------------------------------------------------

_cache_buf = {}


def _get_cache_buf(name, size, device):
    key = (name, device)
    buf = _cache_buf.get(key)
    if buf is None:
        buf = torch.empty(size, dtype=torch.int64, device=device)
        _cache_buf[key] = buf
    return buf


def add_lora_sgmv_custom_cutlass(y, x, wa_ptr, wb_ptr, s, layer_idx, lora_rank):
    """``y[s[i]:s[i+1]] += x[s[i]:s[i+1]] @ deref(wa_ptr[i]).T @ deref(wb_ptr[i])``."""
    tmp1 = _get_cache_buf("sgmv_shrink_tmp", SHRINK_TMP_SIZE, x.device)
    tmp2_size = _kernels.sgmv_cutlass_tmp_size(wa_ptr.size(0))
    tmp2 = _get_cache_buf(f"sgmv_cutlass_tmp_{wa_ptr.size(0)}", tmp2_size, x.device)
    v = torch.zeros((x.size(0), lora_rank), dtype=x.dtype, device=x.device)
    _kernels.sgmv_shrink(v, x, wa_ptr, s, tmp1, layer_idx)
    _kernels.sgmv_cutlass(y, v, wb_ptr, s, tmp2, layer_idx)


add_lora = add_lora_sgmv_custom_cutlass


# --- src/punica/utils/lora.py ----------------------------------------------------------------------------------------

class LoraWeight:
    def __init__(self, num_layers, in_features, out_features, lora_rank, dtype, device):
        # SGMV-Shrink custom CUDA kernel uses column-major.
        self.wa, self.wa_data_ptr = _memory.malloc(num_layers)      # [num_layers, lora_rank, in_features]
        # SGMV-Expand cutlass kernel uses row-major.
        self.wb, self.wb_data_ptr = _memory.malloc(num_layers)      # [num_layers, lora_rank, out_features]

    def copy_from_tensor(self, a, b):
        self.wa.copy_(a.to(self.wa.device).to(self.wa.dtype))
        self.wb.copy_(b.to(self.wb.device).to(self.wb.dtype).transpose(1, 2))


class BatchedLoraWeight:
    def __init__(self, weights):
        assert len(weights) > 0
        device = weights[0].wa.device
        self.wa_ptr = torch.tensor([w.wa_data_ptr for w in weights], dtype=torch.int64, device=device)
        self.wb_ptr = torch.tensor([w.wb_data_ptr for w in weights], dtype=torch.int64, device=device)


# --- the model (mine, after punica's models/llama_lora.py) -----------------------------------------------------------

class BatchedLoraModelWeight:
    """``BatchedLlamaLoraWeight`` for the one LoRA projection of this model: pointers and the segment indptr."""

    def __init__(self, weights, lens, device):
        self.proj = BatchedLoraWeight(weights)
        self.segment = torch.cumsum(torch.tensor([0] + list(lens), dtype=torch.int32, device=device), dim=0,
                                    dtype=torch.int32)
        self.rank = RANK


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


class LoraLM:
    def __init__(self, device):
        gen = generator(7071)

        def w(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)

        self.embed = w(VOCAB, HIDDEN)
        self.layers = [{"norm": 1.0 + w(HIDDEN, scale=0.1), "proj": w(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5)}
                       for _ in range(NUM_LAYERS)]
        self.final_norm = 1.0 + w(HIDDEN, scale=0.1)
        self.lm_head = w(HIDDEN, VOCAB)
        self.adapters = []
        for _ in range(NUM_ADAPTERS):
            lw = LoraWeight(NUM_LAYERS, HIDDEN, HIDDEN, RANK, DTYPE, device)
            lw.copy_from_tensor(w(NUM_LAYERS, RANK, HIDDEN, scale=0.5), w(NUM_LAYERS, HIDDEN, RANK, scale=0.5))
            self.adapters.append(lw)

    def forward(self, input_ids, lora):
        h = self.embed[input_ids]
        for layer_idx, layer in enumerate(self.layers):
            x = rms_norm(h, layer["norm"])
            p = x @ layer["proj"].t()                                   # q_proj = self.q_proj(hidden_states)
            add_lora(p, x, lora.proj.wa_ptr, lora.proj.wb_ptr, lora.segment, layer_idx, lora.rank)
            h = h + torch.nn.functional.silu(p)
        return rms_norm(h, self.final_norm) @ self.lm_head


# --- the graph runner (mine, after LoRAX's GraphWrapper of predibase/lorax#154) --------------------------------------

class GraphWrapper:
    """Captures one decode step over static ``input_ids``, segment indptr and LoRA pointers (zeros, as LoRAX's
    ``get_max_graph_state``: every segment empty) and replays it with each batch's values copied in."""

    def __init__(self, model, device):
        self.model = model
        self.input_ids = torch.zeros(MAX_BATCH, dtype=torch.int64, device=device)
        self.segment = torch.zeros(MAX_SEGMENTS + 1, dtype=torch.int32, device=device)
        self.wa_ptr = torch.zeros(MAX_SEGMENTS, dtype=torch.int64, device=device)
        self.wb_ptr = torch.zeros(MAX_SEGMENTS, dtype=torch.int64, device=device)
        self.lora = types.SimpleNamespace(proj=types.SimpleNamespace(wa_ptr=self.wa_ptr, wb_ptr=self.wb_ptr),
                                          segment=self.segment, rank=RANK)
        tmp = _get_cache_buf(f"sgmv_cutlass_tmp_{MAX_SEGMENTS}", sgmv_tmp_size(MAX_SEGMENTS), device)
        events.written_metadata("LoRA graph runner", {"sgmv_cutlass tmp": tmp})
        self.graph, self.logits = capture(
            lambda: self.model.forward(self.input_ids, self.lora), device=device, warmups=1,
            name=f"LoRA decode batch {MAX_BATCH}", owner="LoRA graph runner",
            static={"input_ids": self.input_ids, "segment": self.segment, "wa_ptr": self.wa_ptr,
                    "wb_ptr": self.wb_ptr})

    def forward(self, input_ids, lora):
        self.input_ids.copy_(input_ids)
        n = lora.proj.wa_ptr.shape[0]
        self.segment[:n + 1].copy_(lora.segment)
        self.segment[n + 1:].copy_(lora.segment[-1:].expand(MAX_SEGMENTS - n))     # empty trailing segments
        self.wa_ptr[:n].copy_(lora.proj.wa_ptr)
        self.wa_ptr[n:].zero_()
        self.wb_ptr[:n].copy_(lora.proj.wb_ptr)
        self.wb_ptr[n:].zero_()
        return replay(self.graph, self.logits)


def serve(device, use_graph):
    global _memory
    _memory = DeviceMemory(2 * NUM_LAYERS * NUM_ADAPTERS, device)
    _cache_buf.clear()
    model = LoraLM(device)
    runner = GraphWrapper(model, device) if use_graph else None
    gen = generator(33)
    outs = []
    for adapters, lens in BATCHES:
        input_ids = torch.randint(0, VOCAB, (MAX_BATCH,), generator=gen).to(device)
        lora = BatchedLoraModelWeight([model.adapters[a] for a in adapters], lens, device)
        logits = runner.forward(input_ids, lora).clone() if use_graph else model.forward(input_ids, lora)
        outs.append(logits)
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_graph=True), lambda: serve(device, use_graph=False))
