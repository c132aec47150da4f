"""HIP graphs + quantized KV: the first captured decode step dies in ``launch_fattn``, whose raw f16 dequant temp buffers are freed with a ``cudaStreamSynchronize`` on the capturing stream.

Upstream: https://github.com/TheTom/llama-cpp-turboquant/pull/176 ("HIP: fix turbo KV decode crash under graph
capture; batch-aware VEC/TILE FA routing", TheTom/llama-cpp-turboquant, a llama.cpp fork with TurboQuant KV caches;
KaiFelixBennett, opened 2026-06-10, merged; a later port cites it as 7985f6b).
Read: the PR description as stored (the crash "FLASH_ATTN_EXT failed: operation not permitted when stream is
capturing" with ``GGML_HIP_GRAPHS=ON`` on the first decode step; the two causes; the two changes) and the author's
follow-up comment (ggml never captures the first eval at a new size: the eval whose node properties changed runs eager,
the next identical one is captured; "the capture-aware pool branch is only reachable under capture in the head_dim==192
/ K-stride-mismatch fallthrough"). From the fork's snapshot of 2026-05-04 (before the merge): ``launch_fattn`` in
``ggml/src/ggml-cuda/fattn-common.cuh`` with the HIP-only ``hip_f16_alloc`` (raw ``cudaMalloc``; destructor
``cudaStreamSynchronize(stream); cudaFree(ptr)``; added by 0757ff4ee "fix(hip): bypass pool for FA f16 temp buffers to
prevent OOM"), ``ggml_cuda_get_best_fattn_kernel`` in ``fattn.cu`` (HIP forces VEC for quantized KV only when
``can_use_vector_kernel``), ``ggml_backend_cuda_graph_compute`` / ``ggml_cuda_graph_update_required`` /
``ggml_cuda_graph_evaluate_and_capture`` in ``ggml-cuda.cu`` (two-eval warmup, relaxed-mode capture, launch) and
``ggml_cuda_pool_leg`` / ``ggml_cuda_pool_alloc``. Also the description of #313 in the same repository, whose first
commit reports the same abort (gemma-4 MoE, q8_0 K, graphs on) and routes the temp to the pool when the cgraph will be
captured. The merged diff itself was not read (the snapshot predates it): the fixed lines are rebuilt from the text.
Symptom: with ``GGML_HIP_GRAPHS=ON`` (graph capture on, the default per #313) any quantized KV cache aborts generation
at the first captured decode step with ``FLASH_ATTN_EXT failed ... operation not permitted when stream is
capturing``; with ``GGML_CUDA_DISABLE_GRAPHS=1`` the same model generates.
Mechanism: a head dim that the VEC kernel cannot serve (not a multiple of 64 here) falls through to the TILE kernel,
which needs f16 K/V: ``launch_fattn`` dequantizes the q8_0 cache into ``K_f16``/``V_f16``. On HIP these come from raw
``cudaMalloc`` and are released at scope exit by ``cudaStreamSynchronize(stream)`` + ``cudaFree`` (so the legacy pool
does not keep the multi-GB temp on no-VMM cards). Eagerly that only blocks the host. ggml evaluates the second
identical decode cgraph inside ``cudaStreamBeginCapture``: the synchronize on the capturing stream is refused and the
capture (and the server) dies.
Doctor: sync-in-capture, at launch_fattn (the destructor of its raw temp buffers waits on the capturing stream; the fix
changes exactly which allocator ``launch_fattn`` uses while capturing).
Fix (upstream): ``launch_fattn`` checks ``cudaStreamIsCapturing`` and takes ``K_f16``/``V_f16`` from the ggml pool
while capturing (pool alloc/free make no synchronizing call; the pool keeps the buffer, so the captured address stays
valid for every launch), keeping raw alloc + immediate free otherwise (the text says "for large eager prefill"; here the
capture check alone decides, so the eager decode step keeps the raw path too). The same PR makes HIP force VEC only
for ``Q->ne[1] <= 8`` (prefill speed); that half is not modelled (it routes nothing differently here: the head dim
rules VEC out).
Modelled: a one-layer decoder (embedding + learned positions, q/k/v projections, q8_0 K and V cache written by
``SET_ROWS`` at ``kv_idxs``, ``FLASH_ATTN_EXT`` with an f16 causal mask over the whole 256-cell cache, output
projection, residual, lm_head), ``llama_context.decode`` copying inputs in (``ggml_backend_tensor_set``) and logits out,
and the ggml-cuda graph path as read: per-cgraph ``ggml_cuda_graph`` with ``warmup_complete``, node-property
comparison, capture into a graph and launch. Stand-ins: q8_0 for the turbo KV types (32-value blocks, int8 + scale), the
TILE kernel as a masked softmax attention over the dequantized f16 K/V, the VEC kernel as the same attention with inline
dequantization (never selected at head dim 96), ``cudaMalloc`` as ``torch.empty`` and ``cudaStreamSynchronize`` as the
engine's ``synchronize`` (refused inside a capture, as the capturing stream refuses it). float32 activations, f16 K/V.
Workload: a 5-token prompt (eager: a new cgraph), then 4 greedy decode steps of one token on the same decode cgraph:
step 1 runs eager (properties changed), step 2 is captured and launched, steps 3-4 launch the graph. Reference: the
same model with ``GGML_CUDA_DISABLE_GRAPHS=1``. Bug: the prompt and decode step 1 run; the capture at step 2 raises
CaptureError from the ``synchronize`` in ``hip_f16_alloc.free`` (upstream's abort). Fix: all 5 logits rows equal eager
(max |graph - eager| = 0).
"""
from __future__ import annotations

import math

import torch

from workbench.engine import is_capturing, synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/TheTom/llama-cpp-turboquant/pull/176"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "launch_fattn"
SYMPTOM = ("GGML_HIP_GRAPHS=ON with a quantized KV cache: the first captured decode step aborts in FLASH_ATTN_EXT "
           "(launch_fattn frees its raw f16 dequant temp with cudaStreamSynchronize on the capturing stream)")

N_VOCAB, N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM = 16, 32, 2, 1, 96
N_CTX = 256                                   # one FATTN_KQ_STRIDE: the KV views always span 256 cells
FATTN_KQ_STRIDE = 256
QK8_0 = 32
PROMPT = [3, 9, 4, 1, 12]
N_DECODE = 4
GGML_USE_HIP = True

BEST_FATTN_KERNEL_VEC, BEST_FATTN_KERNEL_TILE = 100, 200
_variant = "bug"


# --- HIP runtime stand-ins -------------------------------------------------------------------------

def cudaMalloc(nelements: int, device: str) -> torch.Tensor:
    return torch.empty(nelements, dtype=torch.float16, device=device)


def cudaStreamSynchronize(stream) -> None:
    synchronize(stream.device)                # a host wait on the stream: refused while it captures


def cudaStreamIsCapturing(stream) -> bool:
    return is_capturing()


class cudaStream_t:
    def __init__(self, device: str):
        self.device = device


# --- ggml/src/ggml-cuda: pool, tensors, quantization -------------------------------------------------

class ggml_cuda_pool_leg:
    """Legacy pool: keeps every buffer it ever handed out; best fit first, else a new allocation."""

    def __init__(self, device: str):
        self.device = device
        self.buffer_pool: list[torch.Tensor] = []

    def alloc(self, nelements: int) -> torch.Tensor:
        fits = [i for i, b in enumerate(self.buffer_pool) if b.numel() >= nelements]
        if fits:
            return self.buffer_pool.pop(min(fits, key=lambda i: self.buffer_pool[i].numel()))
        look_ahead = 256 * ((int(1.05 * nelements) + 255) // 256)
        return cudaMalloc(look_ahead, self.device)

    def free(self, ptr: torch.Tensor) -> None:
        self.buffer_pool.append(ptr)          # retained: no CUDA call


class ggml_cuda_pool_alloc:
    def __init__(self, pool: ggml_cuda_pool_leg):
        self.pool, self.ptr = pool, None

    def alloc(self, nelements: int) -> torch.Tensor:
        self.ptr = self.pool.alloc(nelements)
        return self.ptr

    def free(self) -> None:                   # ~ggml_cuda_pool_alloc()
        if self.ptr is not None:
            self.pool.free(self.ptr)
            self.ptr = None


class hip_f16_alloc:
    """HIP/ROCm: bypass the pool for f16 temp buffers (the legacy pool would retain the peak size)."""

    def __init__(self, stream: cudaStream_t):
        self.stream, self.ptr = stream, None

    def alloc(self, nelements: int) -> torch.Tensor:
        self.ptr = cudaMalloc(nelements, self.stream.device)
        return self.ptr

    def free(self) -> None:                   # ~hip_f16_alloc()
        if self.ptr is not None:
            cudaStreamSynchronize(self.stream)
            self.ptr = None                   # cudaFree(ptr)


class ggml_tensor:
    def __init__(self, name, op, data, src=(), type_="f32"):
        self.name, self.op, self.data, self.src, self.type = name, op, data, list(src), type_


def quantize_q8_0(x: torch.Tensor):
    """quantize_row_q8_0: 32-value blocks, d = amax / 127, qs = round(x / d)."""
    blocks = x.reshape(*x.shape[:-1], -1, QK8_0)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    qs = torch.round(blocks * inv).clamp(-127, 127).to(torch.int8)
    return qs.reshape(x.shape), d.squeeze(-1).to(torch.float16)


def dequantize_q8_0_to_f16(qs: torch.Tensor, d: torch.Tensor, out: torch.Tensor) -> None:
    """convert_unary<q8_0 -> half> into a caller-provided f16 buffer."""
    blocks = qs.reshape(*qs.shape[:-1], -1, QK8_0).to(torch.float32) * d.unsqueeze(-1).to(torch.float32)
    out.copy_(blocks.reshape(-1).to(torch.float16))


# --- ggml/src/ggml-cuda/fattn*.cu ----------------------------------------------------------------------

class ggml_backend_cuda_context:
    def __init__(self, device: str):
        self.device = device
        self._stream = cudaStream_t(device)
        self._pool = ggml_cuda_pool_leg(device)
        self.cuda_graphs = {}                 # graph_key -> ggml_cuda_graph

    def stream(self) -> cudaStream_t:
        return self._stream

    def pool(self) -> ggml_cuda_pool_leg:
        return self._pool


def ggml_cuda_get_best_fattn_kernel(device: str, dst: ggml_tensor) -> int:
    Q, K, V = dst.src[0], dst.src[1], dst.src[2]
    n_kv, _, head_dim = K.data[0].shape                  # K view [n_kv, n_head_kv, D]
    can_use_vector_kernel = head_dim <= 256 and head_dim % 64 == 0 and n_kv % FATTN_KQ_STRIDE == 0
    if GGML_USE_HIP and (K.type == "q8_0" or V.type == "q8_0") and can_use_vector_kernel:
        return BEST_FATTN_KERNEL_VEC          # inline dequant, no temp buffer
    return BEST_FATTN_KERNEL_TILE


def flash_attn_kernel(q, k, v, mask, scale, out) -> None:
    """The attention both kernels compute: q [n_tokens, n_head * D], k/v [n_kv, n_head_kv, D], mask [n_tokens, n_kv]."""
    q = q.view(q.shape[0], N_HEAD, HEAD_DIM)
    group = N_HEAD // N_HEAD_KV
    k = k.to(torch.float32).repeat_interleave(group, dim=1)
    v = v.to(torch.float32).repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,khd->htk", q, k) * scale + mask.to(torch.float32)
    probs = torch.softmax(scores, dim=-1)
    out.copy_(torch.einsum("htk,khd->thd", probs, v).reshape(out.shape))


def launch_fattn(ctx: ggml_backend_cuda_context, dst: ggml_tensor, need_f16_K: bool, need_f16_V: bool) -> None:
    Q, K, V, mask = dst.src
    pool, main_stream = ctx.pool(), ctx.stream()
    if _variant == "bug":
        # HIP/ROCm: raw alloc + free so the legacy pool does not retain the dequant temp (0757ff4ee)
        K_f16, V_f16 = hip_f16_alloc(main_stream), hip_f16_alloc(main_stream)
    elif cudaStreamIsCapturing(main_stream):
        # capture-aware: pool alloc/free make no synchronizing call, and the pool keeps the captured address
        K_f16, V_f16 = ggml_cuda_pool_alloc(pool), ggml_cuda_pool_alloc(pool)
    else:
        K_f16, V_f16 = hip_f16_alloc(main_stream), hip_f16_alloc(main_stream)

    (k_qs, k_d), (v_qs, v_d) = K.data, V.data
    K_data, V_data = k_qs, v_qs
    if need_f16_K and K.type != "f16":
        K_data = K_f16.alloc(k_qs.numel())[:k_qs.numel()].view(k_qs.shape)
        dequantize_q8_0_to_f16(k_qs, k_d, K_data.view(-1))
    if need_f16_V and V.type != "f16":
        V_data = V_f16.alloc(v_qs.numel())[:v_qs.numel()].view(v_qs.shape)
        dequantize_q8_0_to_f16(v_qs, v_d, V_data.view(-1))

    flash_attn_kernel(Q.data, K_data, V_data, mask.data, 1.0 / math.sqrt(HEAD_DIM), dst.data)
    V_f16.free()                              # scope exit: the destructors run
    K_f16.free()


def ggml_cuda_flash_attn_ext_vec(ctx, dst) -> None:
    Q, K, V, mask = dst.src
    k = K.data[0].to(torch.float32).unflatten(-1, (-1, QK8_0)) * K.data[1].to(torch.float32).unsqueeze(-1)
    v = V.data[0].to(torch.float32).unflatten(-1, (-1, QK8_0)) * V.data[1].to(torch.float32).unsqueeze(-1)
    flash_attn_kernel(Q.data, k.flatten(-2), v.flatten(-2), mask.data, 1.0 / math.sqrt(HEAD_DIM), dst.data)


def ggml_cuda_flash_attn_ext_tile(ctx, dst) -> None:
    launch_fattn(ctx, dst, need_f16_K=True, need_f16_V=True)


def ggml_cuda_flash_attn_ext(ctx, dst) -> None:
    if ggml_cuda_get_best_fattn_kernel(ctx.device, dst) == BEST_FATTN_KERNEL_VEC:
        ggml_cuda_flash_attn_ext_vec(ctx, dst)
    else:
        ggml_cuda_flash_attn_ext_tile(ctx, dst)


# --- ggml/src/ggml-cuda/ggml-cuda.cu ------------------------------------------------------------------

def ggml_cuda_compute_forward(ctx, node: ggml_tensor) -> None:
    s = node.src
    if node.op == "GET_ROWS":
        torch.index_select(s[0].data, 0, s[1].data, out=node.data)
    elif node.op == "ADD":
        torch.add(s[0].data, s[1].data, out=node.data)
    elif node.op == "MUL_MAT":
        torch.matmul(s[1].data, s[0].data, out=node.data)
    elif node.op == "SET_ROWS":               # quantize the new rows into the q8_0 cache at the given cells
        qs, d = quantize_q8_0(s[0].data.view(-1, N_HEAD_KV, HEAD_DIM))
        node.data[0].index_copy_(0, s[1].data, qs)
        node.data[1].index_copy_(0, s[1].data, d)
    elif node.op == "FLASH_ATTN_EXT":
        ggml_cuda_flash_attn_ext(ctx, node)
    else:
        raise RuntimeError(f"op not supported {node.name} ({node.op})")


class ggml_cuda_graph:
    def __init__(self):
        self.graph = None                     # (captured graph, its output)
        self.node_props = None
        self.warmup_complete = False


def ggml_cuda_graph_update_required(cuda_ctx, cgraph) -> bool:
    graph = cuda_ctx.cuda_graphs[cgraph["key"]]
    props = [(n.op, n.name, tuple(d.data_ptr() for d in _datas(n)),
              tuple(t.data_ptr() for x in n.src for t in _datas(x))) for n in cgraph["nodes"]]
    changed = props != graph.node_props
    graph.node_props = props
    return changed


def _datas(t: ggml_tensor):
    return t.data if isinstance(t.data, tuple) else (t.data,)


def ggml_cuda_graph_evaluate_and_capture(cuda_ctx, cgraph, use_cuda_graph, cuda_graph_update_required):
    def evaluate():
        for node in cgraph["nodes"]:
            ggml_cuda_compute_forward(cuda_ctx, node)
        return cgraph["nodes"][-1].data

    if not use_cuda_graph:
        return evaluate()
    graph = cuda_ctx.cuda_graphs[cgraph["key"]]
    if cuda_graph_update_required:            # cudaStreamBeginCapture(relaxed) ... cudaStreamEndCapture
        graph.graph = capture(evaluate, device=cuda_ctx.device, warmups=0, name=f"cgraph {cgraph['key']}",
                              owner="ggml_backend_cuda_graph_compute", static=cgraph["inputs"], state=cgraph["kv"])
    g, out = graph.graph
    return replay(g, out)                     # cudaGraphLaunch


def ggml_backend_cuda_graph_compute(cuda_ctx, cgraph, disable_graphs: bool):
    use_cuda_graph = cuda_graph_update_required = False
    if not disable_graphs:
        graph = cuda_ctx.cuda_graphs.setdefault(cgraph["key"], ggml_cuda_graph())
        properties_changed = ggml_cuda_graph_update_required(cuda_ctx, cgraph)
        if not graph.warmup_complete:
            if not properties_changed:        # 2nd call with no property change: capture now
                graph.warmup_complete = True
                use_cuda_graph = cuda_graph_update_required = True
        elif properties_changed:
            graph.warmup_complete = False
        else:
            use_cuda_graph, cuda_graph_update_required = True, graph.graph is None
    return ggml_cuda_graph_evaluate_and_capture(cuda_ctx, cgraph, use_cuda_graph, cuda_graph_update_required)


# --- llama.cpp: model, graph build, decode ---------------------------------------------------------------

class llama_model:
    def __init__(self, device: str):
        gen = generator(176)
        r = lambda *s, scale=0.4: (torch.randn(*s, generator=gen) * scale).to(device)   # noqa: E731
        self.tok_embd, self.pos_embd = r(N_VOCAB, N_EMBD, scale=1.0), r(N_CTX, N_EMBD, scale=0.3)
        self.wq = r(N_EMBD, N_HEAD * HEAD_DIM)
        self.wk, self.wv = r(N_EMBD, N_HEAD_KV * HEAD_DIM), r(N_EMBD, N_HEAD_KV * HEAD_DIM)
        self.wo, self.output = r(N_HEAD * HEAD_DIM, N_EMBD, scale=0.2), r(N_EMBD, N_VOCAB)


class llama_context:
    def __init__(self, model: llama_model, device: str, disable_graphs: bool):
        self.model, self.device, self.disable_graphs = model, device, disable_graphs
        self.backend = ggml_backend_cuda_context(device)
        kv = lambda: (torch.zeros(N_CTX, N_HEAD_KV, HEAD_DIM, dtype=torch.int8, device=device),   # noqa: E731
                      torch.zeros(N_CTX, N_HEAD_KV, HEAD_DIM // QK8_0, dtype=torch.float16, device=device))
        self.k_l, self.v_l = kv(), kv()       # q8_0 cache: (qs, d)
        self.graphs, self.n_past = {}, 0

    def build_graph(self, n_tokens: int):
        """llm_build_*: the tensors of one n_tokens, allocated once (ggml-alloc) and outside any capture."""
        if n_tokens in self.graphs:
            return self.graphs[n_tokens]
        m, dev = self.model, self.device
        z = lambda *s, dtype=torch.float32: torch.zeros(*s, dtype=dtype, device=dev)   # noqa: E731
        T = ggml_tensor
        inp_tokens, inp_pos = T("inp_tokens", "NONE", z(n_tokens, dtype=torch.long)), \
            T("inp_pos", "NONE", z(n_tokens, dtype=torch.long))
        kv_idxs = T("kv_idxs", "NONE", z(n_tokens, dtype=torch.long))
        kq_mask = T("KQ_mask", "NONE", z(n_tokens, N_CTX, dtype=torch.float16), type_="f16")
        w = {k: T(k, "NONE", getattr(m, k)) for k in ("tok_embd", "pos_embd", "wq", "wk", "wv", "wo", "output")}
        tok = T("inp_embd", "GET_ROWS", z(n_tokens, N_EMBD), [w["tok_embd"], inp_tokens])
        pos = T("inp_pos_embd", "GET_ROWS", z(n_tokens, N_EMBD), [w["pos_embd"], inp_pos])
        x = T("inpL", "ADD", z(n_tokens, N_EMBD), [tok, pos])
        q = T("Qcur", "MUL_MAT", z(n_tokens, N_HEAD * HEAD_DIM), [w["wq"], x])
        k = T("Kcur", "MUL_MAT", z(n_tokens, N_HEAD_KV * HEAD_DIM), [w["wk"], x])
        v = T("Vcur", "MUL_MAT", z(n_tokens, N_HEAD_KV * HEAD_DIM), [w["wv"], x])
        k_set = T("k_cache_set", "SET_ROWS", self.k_l, [k, kv_idxs], "q8_0")
        v_set = T("v_cache_set", "SET_ROWS", self.v_l, [v, kv_idxs], "q8_0")
        k_view, v_view = T("k_cache_view", "NONE", self.k_l, type_="q8_0"), T("v_cache_view", "NONE", self.v_l,
                                                                             type_="q8_0")
        attn = T("fattn", "FLASH_ATTN_EXT", z(n_tokens, N_HEAD * HEAD_DIM), [q, k_view, v_view, kq_mask])
        proj = T("attn_out", "MUL_MAT", z(n_tokens, N_EMBD), [w["wo"], attn])
        res = T("l_out", "ADD", z(n_tokens, N_EMBD), [proj, x])
        logits = T("result_output", "MUL_MAT", z(n_tokens, N_VOCAB), [w["output"], res])
        cgraph = {"key": f"n_tokens={n_tokens}", "nodes": [tok, pos, x, q, k, v, k_set, v_set, attn, proj, res, logits],
                  "inputs": {"inp_tokens": inp_tokens.data, "inp_pos": inp_pos.data, "kv_idxs": kv_idxs.data,
                             "KQ_mask": kq_mask.data},
                  "kv": {"k_l.qs": self.k_l[0], "k_l.d": self.k_l[1], "v_l.qs": self.v_l[0], "v_l.d": self.v_l[1]}}
        self.graphs[n_tokens] = cgraph
        return cgraph

    def decode(self, tokens):
        n = len(tokens)
        cgraph = self.build_graph(n)
        pos = torch.arange(self.n_past, self.n_past + n)
        mask = torch.where(torch.arange(N_CTX)[None, :] <= pos[:, None], 0.0, float("-inf")).to(torch.float16)
        inputs = cgraph["inputs"]             # llm_graph_input_*::set_input -> ggml_backend_tensor_set
        inputs["inp_tokens"].copy_(torch.tensor(tokens))
        inputs["inp_pos"].copy_(pos)
        inputs["kv_idxs"].copy_(pos)
        inputs["KQ_mask"].copy_(mask)
        logits = ggml_backend_cuda_graph_compute(self.backend, cgraph, self.disable_graphs)
        self.n_past += n
        return logits[-1].clone()             # ggml_backend_tensor_get of the last token's logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def generate(disable_graphs: bool):
        ctx = llama_context(llama_model(device), device, disable_graphs)
        outs = [ctx.decode(PROMPT)]
        for _ in range(N_DECODE):
            outs.append(ctx.decode([int(outs[-1].argmax())]))      # greedy
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(disable_graphs=False),
                       lambda: generate(disable_graphs=True))
