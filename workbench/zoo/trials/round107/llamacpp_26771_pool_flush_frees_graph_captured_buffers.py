"""llama.cpp CUDA/HIP graphs with the legacy (non-VMM) memory pool: when an allocation fails, the pool flushes its cached buffers back to the driver, but a captured decode graph still holds the addresses of the pool buffers its kernels used as scratch, and the next replay writes freed memory.

Upstream: https://github.com/ggml-org/llama.cpp/pull/26771 ("CUDA: Recapture graph after memory pool flush",
ggml-org/llama.cpp, by bokrosbalint, opened 2026-08-08, still open when read, so no merge commit), which fixes
https://github.com/ggml-org/llama.cpp/issues/26738 ("Page fault at depth with -fa 0 and MoE expert offload on HIP",
opened 2026-08-07, closed as stale). Read: the PR description ("Implement an atomic counter to signal the memory pool
returning buffers to the driver and recapture the CUDA graph to avoid writing to a stale pointer during replay from a
captured graph leading to a page fault"; latent since #22155; needs graphs on, no VMM, no FA, MoE with partial CPU
offload and enough fragmentation; after #26802 the recapture path fires ~188 times in one llama-bench run) and the
issue's description ("When a graph replay attempts to write to an address already freed, the process crashes"), and
``ggml_cuda_pool_leg`` (``alloc``: best fit among the cached buffers, else ``ggml_cuda_device_malloc`` of
``look_ahead_size = 256 * ceil(1.05 * size / 256)``; on ``cudaErrorMemoryAllocation`` it logs "alloc ... failed,
flushing ... of cached buffers and retrying", synchronizes, calls ``clear_pool`` (``cudaFree`` of every cached buffer)
and retries; ``free``: back into ``buffer_pool``) in a ggml-cuda.cu of the search index (a llama.cpp tree with extra
fused ops; its legacy pool as above). The PR's diff itself was not available; the counter's name and the place of its
check are mine, after the description.
Symptom: llama-bench / llama-server on a HIP card without VMM (gfx900), flash attention off, MoE experts partly on the
CPU, long depth: a page fault (memory access fault) during decode, once fragmentation makes a pool allocation fail.
Graphs off (or VMM) serve.
Mechanism: every op that needs scratch (the q8_1 copy of src1 for MMVQ / MMQ, ``mul_mat_id``'s sorted rows) takes it
from the context's pool through ``ggml_cuda_pool_alloc`` and gives it back when the op returns. The pool buffers are
plain ``cudaMalloc`` memory owned by the pool, not by the graph: a decode graph captured with the pool warm bakes the
address of a cached buffer into its kernels. Batches of more than one token run eagerly (no graph); a long one asks
for a larger scratch buffer, the allocation fails, the pool flushes (``clear_pool`` frees every cached buffer, the
one the graph uses included) and retries. The next decode has the same ggml graph (same nodes, same compute-buffer
addresses), so ``ggml_cuda_graph_update_required`` says "reuse" and the replay writes the freed buffer.
Doctor: dangling-reference, at clear_pool. The pool returns to the driver a buffer that a captured graph still
references as kernel scratch; nothing tells the graph, whose next replay writes the freed memory.
Fix (upstream): ``clear_pool`` bumps an atomic flush counter; the graph remembers the count it was captured at and is
recaptured (so its kernels take fresh pool buffers) when the count changed.
Modelled: ``ggml_cuda_pool_leg`` (``alloc`` with best fit, look-ahead sizing and flush-and-retry, ``free``,
``clear_pool``) with a device-memory budget standing in for VRAM; ``ggml_cuda_pool_alloc`` (alloc in the constructor,
free at the end of the op); ``ggml_backend_cuda_graph_compute`` (graphs off for batches of more than one token and with
GGML_CUDA_DISABLE_GRAPHS), ``ggml_cuda_graph_update_required`` (node data and source addresses and shapes against the
properties recorded at capture), capture, instantiate and launch (a capture is launched right after). Stand-ins: a
2-layer MoE decoder without attention (RMSNorm, a dense projection, a softmax top-2 router over 4 experts with
``mul_mat_id`` up / SiLU / down), every matrix product quantizing its src1 to a q8_1-like block (int8 values and one
scale per row) in pool scratch; the compute buffer (``ggml_gallocr``) sized for the largest ubatch; greedy sampling;
sizes are counted in float64 elements (on CUDA each buffer is scaled up to whole allocator segments and the freed ones
are unmapped with ``empty_cache`` once the retried buffer is mapped, so that the stale address faults). The CPU offload
of experts is not modelled: the eager long batch is the prompt of a second request.
Workload: what the driver can give the pool: 1100 elements. Request A: prompt of 12 tokens (eager; the pool mallocs
scratch buffers of 256 and 512 elements and caches them), then 3 decode steps: the first captures (every op's scratch is
the cached 256 buffer, best fit) and launches, the next 2 replay. Request B: prompt of 30 tokens (eager): the
``mul_mat_id`` down projection needs 1024, which does not fit next to the 768 cached, so the pool flushes both buffers
and retries; then 3 decode steps. Bug: the first decode of B finds the same ggml graph and replays the graph of A, whose
scratch buffer was freed: raised IllegalMemoryAccess (graph replay read freed memory, at the q8_1 quantization of the
first ``mul_mat``; a page fault on the GPU). Fix: the flush count changed, so the decode of B recaptures on the cached
1024 buffer; both prompts' last logits and the 6 decode logits equal eager (max |graph - eager| = 0). Runs twice alike.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/26771"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "clear_pool"
SYMPTOM = ("CUDA/HIP graphs without VMM: a failed pool allocation flushes the cached pool buffers to the driver, "
           "and the reused decode graph writes the freed scratch buffer (page fault)")

N_VOCAB, N_EMBD, N_FF, N_EXPERT, N_EXPERT_USED, N_LAYER = 24, 16, 12, 4, 2, 2
N_UBATCH = 32                       # the compute buffer is reserved for the largest ubatch
POOL_VRAM_BUDGET = 1100             # what the driver can still give the pool (elements)
DTYPE = torch.float64

_variant = "bug"


class cudaErrorMemoryAllocation(Exception):
    pass


# --- ggml/src/ggml-cuda/ggml-cuda.cu: the legacy pool -------------------------------------------------------------

pool_flush_count = 0                # fix: the atomic counter the flush bumps (name mine)


class Device:
    """The driver: ``cudaMalloc`` / ``cudaFree`` against what is left of VRAM."""

    def __init__(self, device):
        self.device, self.used, self.freed = device, 0, False

    def malloc(self, size):
        if self.used + size > POOL_VRAM_BUDGET:
            raise cudaErrorMemoryAllocation(f"out of memory allocating {size} elements")
        self.used += size
        # On CUDA each buffer is scaled up to whole allocator segments (a larger buffer cannot take the place of a
        # freed smaller one), and the freed ones are unmapped (empty_cache) once it is mapped.
        scale = max(1, own_segment_elems(self.device) // 256)
        ptr = torch.empty(size * scale, dtype=DTYPE, device=self.device)
        if self.freed:
            release_to_driver(self.device)
            self.freed = False
        return ptr

    def free(self, ptr, size):
        self.used -= size
        self.freed = True
        del ptr


class ggml_cuda_pool_leg:
    MAX_BUFFERS = 256

    def __init__(self, device: Device):
        self.device = device
        self.buffer_pool = []           # [ptr, size] of the cached (free) buffers
        self.pool_size = 0

    def clear_pool(self):
        global pool_flush_count
        while self.buffer_pool:
            ptr, size = self.buffer_pool.pop()
            self.device.free(ptr, size)                         # CUDA_CHECK(cudaFree(b.ptr))
            self.pool_size -= size
        if _variant == "fix":
            pool_flush_count += 1       # signal: buffers went back to the driver, captured graphs are stale

    def alloc(self, size):
        best_diff, ibest = 1 << 36, -1
        for i, (ptr, bsize) in enumerate(self.buffer_pool):
            if bsize >= size and bsize - size < best_diff:
                best_diff, ibest = bsize - size, i
                if best_diff == 0:
                    break
        if ibest >= 0:
            return self.buffer_pool.pop(ibest)
        look_ahead_size = 256 * ((int(1.05 * size) + 255) // 256)
        try:
            ptr = self.device.malloc(look_ahead_size)
        except cudaErrorMemoryAllocation:
            # "alloc of %.2f MiB failed, flushing %.2f MiB of cached buffers and retrying"
            self.clear_pool()
            ptr = self.device.malloc(look_ahead_size)
        self.pool_size += look_ahead_size
        return [ptr, look_ahead_size]

    def free(self, ptr, size):
        if len(self.buffer_pool) < self.MAX_BUFFERS:
            self.buffer_pool.append([ptr, size])
            return
        self.device.free(ptr, size)
        self.pool_size -= size


class ggml_cuda_pool_alloc:
    """RAII scratch from the pool: allocated by the op, given back when the op returns."""

    def __init__(self, pool, size):
        self.pool = pool
        self.ptr, self.actual_size = pool.alloc(size)

    def __enter__(self):
        return self.ptr

    def __exit__(self, *exc):
        self.pool.free(self.ptr, self.actual_size)


# --- ops (each matrix product quantizes src1 into pool scratch, as MMVQ / MMQ do) ----------------------------------

def quantize_row_q8_1(ctx, src1, buf):
    n, k = src1.shape
    q, d = buf[:n * k].view(n, k), buf[n * k:n * k + n].view(n, 1)
    d.copy_((src1.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30))
    q.copy_(torch.round(src1 / d))
    return q, d


def ggml_cuda_mul_mat(ctx, w, src1, dst):
    n, k = src1.shape
    with ggml_cuda_pool_alloc(ctx.pool, n * (k + 1)) as buf:              # src1_q8_1
        q, d = quantize_row_q8_1(ctx, src1, buf)
        torch.mm(q * d, w.t(), out=dst)


def ggml_cuda_mul_mat_id(ctx, w, src1, ids, dst):
    """dst[t, j] = w[ids[t, j]] @ src1[t] (src1 broadcast over the used experts when it has one row per token)."""
    n, k = src1.shape[0], src1.shape[-1]
    rows = src1.reshape(-1, k)
    with ggml_cuda_pool_alloc(ctx.pool, rows.shape[0] * (k + 1)) as buf:
        q, d = quantize_row_q8_1(ctx, rows, buf)
        x = (q * d).view(n, -1, k).expand(n, ids.shape[1], k)
        dst.copy_(torch.einsum("tjfk,tjk->tjf", w[ids], x))


def rms_norm(x, w, dst, eps=1e-6):
    torch.mul(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), w, out=dst)


# --- the model: a ggml graph over tensors of the compute buffer --------------------------------------------------------

class ggml_gallocr:
    """The compute buffer, reserved once for N_UBATCH tokens: node outputs keep their addresses."""

    def __init__(self, device):
        z = lambda *s, dtype=DTYPE: torch.zeros(N_UBATCH, *s, dtype=dtype, device=device)   # noqa: E731
        self.inp_embd, self.cur, self.attn, self.ffn_inp = z(N_EMBD), z(N_EMBD), z(N_EMBD), z(N_EMBD)
        self.logits_router, self.ids = z(N_EXPERT), z(N_EXPERT_USED, dtype=torch.long)
        self.up, self.down = z(N_EXPERT_USED, N_FF), z(N_EXPERT_USED, N_EMBD)
        self.h = [z(N_EMBD) for _ in range(N_LAYER + 1)]
        self.result_output = z(N_VOCAB)


class Model:
    def __init__(self, device):
        gen = generator(26771)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.tok_embd, self.output = r(N_VOCAB, N_EMBD, scale=1.0), r(N_VOCAB, N_EMBD)
        self.output_norm = 1.0 + r(N_EMBD, scale=0.1)
        self.layers = [dict(attn_norm=1.0 + r(N_EMBD, scale=0.1), wo=r(N_EMBD, N_EMBD),
                            ffn_norm=1.0 + r(N_EMBD, scale=0.1), ffn_gate_inp=r(N_EXPERT, N_EMBD, scale=1.0),
                            ffn_up_exps=r(N_EXPERT, N_FF, N_EMBD), ffn_down_exps=r(N_EXPERT, N_EMBD, N_FF))
                       for _ in range(N_LAYER)]

    def build_graph(self, buf: ggml_gallocr, n):
        """The ggml graph of one ubatch of n tokens: (name, op, dst view, src views) in order."""
        nodes = []
        for il, L in enumerate(self.layers):
            x = buf.inp_embd[:n] if il == 0 else buf.h[il][:n]
            nodes += [("attn_norm", "rms_norm", buf.cur[:n], (x, L["attn_norm"])),
                      ("attn_out", "mul_mat", buf.attn[:n], (L["wo"], buf.cur[:n])),
                      ("ffn_inp", "add", buf.ffn_inp[:n], (x, buf.attn[:n])),
                      ("ffn_norm", "rms_norm", buf.cur[:n], (buf.ffn_inp[:n], L["ffn_norm"])),
                      ("ffn_moe_logits", "mul_mat", buf.logits_router[:n], (L["ffn_gate_inp"], buf.cur[:n])),
                      ("ffn_moe_topk", "argsort_top_k", buf.ids[:n], (buf.logits_router[:n],)),
                      ("ffn_moe_up", "mul_mat_id", buf.up[:n], (L["ffn_up_exps"], buf.cur[:n], buf.ids[:n])),
                      ("ffn_moe_silu", "silu", buf.up[:n], (buf.up[:n],)),
                      ("ffn_moe_down", "mul_mat_id", buf.down[:n], (L["ffn_down_exps"], buf.up[:n], buf.ids[:n])),
                      ("ffn_out", "moe_weighted_sum_add", buf.h[il + 1][:n],
                       (buf.down[:n], buf.logits_router[:n], buf.ids[:n], buf.ffn_inp[:n]))]
        nodes += [("result_norm", "rms_norm", buf.cur[:n], (buf.h[N_LAYER][:n], self.output_norm)),
                  ("result_output", "mul_mat", buf.result_output[:n], (self.output, buf.cur[:n]))]
        return nodes


def ggml_cuda_compute_forward(ctx, op, dst, src):
    if op == "rms_norm":
        rms_norm(src[0], src[1], dst)
    elif op == "mul_mat":
        ggml_cuda_mul_mat(ctx, src[0], src[1], dst)
    elif op == "add":
        torch.add(src[0], src[1], out=dst)
    elif op == "argsort_top_k":
        dst.copy_(src[0].argsort(dim=-1, descending=True)[:, :N_EXPERT_USED])
    elif op == "mul_mat_id":
        ggml_cuda_mul_mat_id(ctx, src[0], src[1], src[2], dst)
    elif op == "silu":
        dst.copy_(F.silu(src[0]))
    elif op == "moe_weighted_sum_add":
        down, logits, ids, residual = src
        weights = logits.softmax(-1).gather(1, ids)
        torch.add(residual, (down * weights[..., None]).sum(1), out=dst)


# --- ggml_backend_cuda_graph_compute ---------------------------------------------------------------------------------

class ggml_cuda_graph:
    def __init__(self):
        self.graph = self.out = None
        self.props = []
        self.pool_flush_count = 0


class ggml_backend_cuda_context:
    def __init__(self, device, disable_graphs):
        self.device = device
        self.pool = ggml_cuda_pool_leg(Device(device))
        self.cuda_graph = ggml_cuda_graph()
        self.disable_cuda_graphs = disable_graphs       # GGML_CUDA_DISABLE_GRAPHS


def _props(nodes):
    return [(name, dst.data_ptr(), tuple(dst.shape), tuple(s.data_ptr() for s in src)) for name, _, dst, src in nodes]


def check_node_graph_compatibility(nodes):
    # batch size > 1 (prompt processing) runs without graphs
    return all(dst.shape[0] <= 1 for _, _, dst, _ in nodes)


def ggml_cuda_graph_update_required(ctx, nodes):
    graph = ctx.cuda_graph
    if graph.graph is None or graph.props != _props(nodes):
        return True
    if _variant == "fix" and graph.pool_flush_count != pool_flush_count:
        return True                 # the pool returned buffers to the driver: the captured scratch may be gone
    return False


def ggml_backend_cuda_graph_compute(ctx, nodes, out):
    def evaluate():
        for _, op, dst, src in nodes:
            ggml_cuda_compute_forward(ctx, op, dst, src)
        return out

    use_cuda_graph = not ctx.disable_cuda_graphs and check_node_graph_compatibility(nodes)
    if not use_cuda_graph:
        return evaluate()
    graph = ctx.cuda_graph
    if ggml_cuda_graph_update_required(ctx, nodes):
        # cudaStreamBeginCapture ... evaluate ... cudaStreamEndCapture, then instantiate (or exec-update)
        graph.graph, graph.out = capture(evaluate, device=ctx.device, warmups=0, name="ggml-cuda graph",
                                         static={"inp_embd": nodes[0][3][0]}, owner="ggml_backend_cuda")
        graph.props = _props(nodes)
        graph.pool_flush_count = pool_flush_count
    return replay(graph.graph, graph.out)                                 # cudaGraphLaunch


# --- llama_context::decode (stand-in for the server: prompt then greedy decode, one request at a time) ----------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enable_graphs: bool):
        global pool_flush_count
        pool_flush_count = 0
        model = Model(device)
        buf = ggml_gallocr(device)
        ctx = ggml_backend_cuda_context(device, disable_graphs=not enable_graphs)
        outs = []

        def decode(tokens):
            n = len(tokens)
            buf.inp_embd[:n].copy_(model.tok_embd[torch.tensor(tokens, device=device)])   # ggml_backend_tensor_set
            logits = ggml_backend_cuda_graph_compute(ctx, model.build_graph(buf, n), buf.result_output[:n])
            last = logits[n - 1].clone()                                     # ggml_backend_tensor_get
            outs.append(last)
            return int(last.argmax())

        for name, n_prompt in (("A", 12), ("B", 30)):
            gen = generator(ord(name))
            token = decode(torch.randint(0, N_VOCAB, (n_prompt,), generator=gen).tolist())
            for _ in range(3):
                token = decode([token])
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
