"""The QAttn graph's q/k head-norm nodes carry no label: replays normalise the capture call's K cache slot.

Upstream: https://github.com/turboderp-org/exllamav2/commit/cde4e9558c5cbd46acab5d56f5f9b0c65254c7c9
("Add graph node update for QK norms", a direct commit on master; no PR or issue; diff read with
``q_attn.cu``, ``head_norm.cu``, ``graph.cu`` and ``attn.py``'s ``forward_paged`` at that commit).
Symptom: none reported (fixed the day graphs landed); models with q/k norms (Cohere, OLMo-2, Qwen3 style)
decode wrong tokens once the QAttn graph runs (after ``MIN_GRAPH_INSTANCES`` calls of one shape).
Mechanism: ``QAttn::forward_cuda_1_graph`` keeps one ``Graph`` per ``{q_len, batch_size}`` in ``graph_map``;
on the ``MIN_GRAPH_INSTANCES``-th call it captures ``forward_cuda_1(..., graph)``; from then on every call
patches the labelled nodes' pointers for this call's tensors (``rms_norm_cuda_update_x(NORM, x)``,
``q_gemm_cuda_update_c(Q/K/V, temp_q/k/v)``, ``rope_cuda_qk_update_q/k/past_len(ROPE, ...)``) and
``graph->launch``es. Only kernels given ``graph`` and a label call ``graph->attach_label``; the QK norms
were ``head_norm_cuda(stream, temp_q, q_norm, NULL, temp_q, ...)  // TODO: Graph stuff``: unlabelled nodes
that keep the pointers of the capture call. ``forward_paged`` passes ``q = torch.empty(...)`` (a per-call
block) and, on the sequential path, ``k``/``v`` = ``k_cache_f[:, first_index : first_index + q_len]``: the
cache slot of this token, a new address every step. At each replay the K GEMM and RoPE act on the new slot,
but the k-norm node re-normalises, in place, the slot of the capture call's token (already normalised and
rotated): the current key is cached without its norm and an earlier key is corrupted.
Doctor: warmup-divergence, at forward_cuda_1_graph (the replay reuses the q/k references taken at capture
for the norm nodes, which it leaves unpatched, while an eager call normalises this call's q and k).
Fix (upstream): ``head_norm_cuda`` takes ``graph, label`` and attaches it (``Q_NORM``/``K_NORM``);
``head_norm_cuda_update_x`` (param 0) / ``_update_y`` (param 3) are added, and ``forward_cuda_1_graph``
patches both for ``temp_q`` and ``temp_k`` before ``launch`` (and patches RoPE only when there is RoPE).
Emulation: device memory is one flat buffer (``DeviceMemory``, a caching allocator over it: addresses are
offsets). A labelled node reads its parameters from its row of ``node_params`` (``cudaGraphKernelNodeGetParams``'
storage, uploaded by ``launch`` when patched); an unlabelled node's addresses are baked at capture. The
per-call ``q`` gets the same block every step (last freed first), so here the q norm happens to stay right.
MIN_GRAPH_INSTANCES is 125 upstream, 2 here; one layer, bsz 1, the position as RoPE's ``past_len`` (upstream's
paged path passes ``past_lens``, patched alike), fp32, tiny sizes.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn

UPSTREAM = "https://github.com/turboderp-org/exllamav2/commit/cde4e9558c5cbd46acab5d56f5f9b0c65254c7c9"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_cuda_1_graph"
SYMPTOM = "QK-norm models: replayed attention caches un-normalised keys and re-normalises the capture step's key"

HEADS, KV_HEADS, HEAD_DIM, VOCAB, MAX_SEQ, EPS = 2, 1, 4, 16, 8, 1e-6
HIDDEN, KVD, HALF = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HEAD_DIM // 2
MIN_GRAPH_INSTANCES = 2
NORM, Q, K, V, Q_NORM, K_NORM, ROPE = 1, 2, 3, 4, 5, 6, 7             # enum KernelLabels (0: unlabelled)


class DeviceMemory:
    """One flat device buffer and the caching allocator over it (a freed block goes to the next allocation
    of its size, last freed first). Address 0 is NULL."""

    def __init__(self, device, size=1024):
        self.hbm = torch.zeros(size, device=device)
        self.lanes = torch.arange(256, device=device)
        self.top, self.free_blocks = 16, {}

    def malloc(self, n):
        if self.free_blocks.get(n):
            return self.free_blocks[n].pop()
        self.top += n
        return self.top - n

    def free(self, ptr, n):
        self.free_blocks.setdefault(n, []).append(ptr)

    def at(self, ptr, n):
        return self.hbm.narrow(0, ptr, n)

    def upload(self, t):
        ptr = self.malloc(t.numel())
        self.at(ptr, t.numel()).copy_(t.reshape(-1))
        return ptr


def ld(mem, p, n):
    """``n`` elements at address ``p``: baked (an int) or a kernel parameter the graph reads (a tensor)."""
    if isinstance(p, torch.Tensor):
        return mem.hbm.index_select(0, p.long() + mem.lanes[:n])
    return mem.at(p, n)


def st(mem, p, v):
    v = v.reshape(-1)
    if isinstance(p, torch.Tensor):
        mem.hbm.index_copy_(0, p.long() + mem.lanes[:v.numel()], v)
    else:
        mem.at(p, v.numel()).copy_(v)


# ---- kernels: parameters as in their CUDA signatures; shapes come from the launch configuration ----
def rms_norm_kernel(mem, x, w, y, epsilon, r_dim, *, dim):
    xv = ld(mem, x, dim)
    st(mem, y, xv * ld(mem, w, dim) * torch.rsqrt((xv * xv).sum() * r_dim + epsilon))


def gemm_half_q_half_kernel(mem, a, b, c, *, n, k):
    st(mem, c, ld(mem, a, k) @ ld(mem, b, k * n).view(k, n))


def head_norm_kernel(mem, x, w, b, y, epsilon, r_dim, *, num_heads):
    """Per-head layer norm with per-head weights (``b`` is NULL here)."""
    xv = ld(mem, x, num_heads * HEAD_DIM).view(num_heads, HEAD_DIM)
    xc = xv - (xv.sum(-1, keepdim=True) * r_dim)
    out = xc * torch.rsqrt((xc * xc).sum(-1, keepdim=True) * r_dim + epsilon)
    st(mem, y, out * ld(mem, w, num_heads * HEAD_DIM).view(num_heads, HEAD_DIM))


def rope_cuda_qk_kernel(mem, x_q, x_k, sin, cos, rows_q, rows_k, head_dim, heads_q, heads_k, past_len):
    s, c = ld(mem, sin + past_len * HALF, HALF), ld(mem, cos + past_len * HALF, HALF)
    for ptr, heads in ((x_q, HEADS), (x_k, KV_HEADS)):                  # neox style, in place
        t = ld(mem, ptr, heads * HEAD_DIM).view(heads, HEAD_DIM)
        t1, t2 = t[:, :HALF], t[:, HALF:]
        st(mem, ptr, torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], -1))


class Graph:
    """graph.cu: capture once; labelled nodes' parameters are patched on the host and uploaded at launch."""

    def __init__(self, mem, device):
        self.mem, self.device, self.invoke_count, self.g = mem, device, 0, None
        self.node_labels, self.node_params_host, self.node_needs_update = [], [], []
        self.node_params = torch.zeros(8, 10, dtype=torch.float64, device=device)   # the exec nodes' params

    def count(self):
        self.invoke_count += 1
        return self.invoke_count == MIN_GRAPH_INSTANCES

    def ready(self):
        return self.g is not None

    def capture(self, fn):
        self.g, _ = capture(fn, device=self.device, warmups=0, name="QAttn graph", owner="QAttn (graph_map)",
                            state={"device memory": self.mem.hbm})
        self.node_needs_update = [True] * len(self.node_labels)   # end_capture: cudaGraphKernelNodeGetParams

    def attach_label(self, label, params):
        i = len(self.node_labels)
        self.node_labels.append(label)
        self.node_params_host.append([float(p) for p in params])
        return [self.node_params[i, j] for j in range(len(params))]

    def update_param(self, label, sublabel, param, value):
        for i, node_label in enumerate(self.node_labels):
            if node_label == label and self.node_params_host[i][param] != float(value):
                self.node_params_host[i][param] = float(value)
                self.node_needs_update[i] = True

    def launch(self, outputs, eager):
        for i, row in enumerate(self.node_params_host):          # cudaGraphExecKernelNodeSetParams
            if self.node_needs_update[i]:
                self.node_params[i, :len(row)].copy_(torch.tensor(row, dtype=torch.float64).to(self.device))
                self.node_needs_update[i] = False
        events.serve(self.g, 1, 1, outputs=outputs, eager=eager)
        self.g.replay()
        events.handed_out(self.g, outputs)


def launch_kernel(mem, kernel, params, graph=None, label=0, **config):
    """``kernel<<<...>>>(params...); if (graph) graph->attach_label(stream, label, 0);``"""
    if graph is not None and label:
        params = graph.attach_label(label, params)
    kernel(mem, *params, **config)


class QAttn:
    def __init__(self, mem, device, variant, graphed):
        gen = generator(4955)
        self.mem, self.device, self.variant, self.graphed = mem, device, variant, graphed
        self.layernorm = mem.upload(1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1))
        self.q_proj = mem.upload(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6))
        self.k_proj = mem.upload(randn(HIDDEN, KVD, gen=gen, device=device, scale=0.6))
        self.v_proj = mem.upload(randn(HIDDEN, KVD, gen=gen, device=device, scale=0.6))
        self.q_norm = mem.upload(1.0 + randn(HEADS, HEAD_DIM, gen=gen, device=device, scale=0.4))
        self.k_norm = mem.upload(1.0 + randn(KV_HEADS, HEAD_DIM, gen=gen, device=device, scale=0.4))
        ang = torch.arange(MAX_SEQ)[:, None] * (10.0 ** -(torch.arange(HALF) / HALF))[None, :]
        self.sin, self.cos = mem.upload(ang.sin().to(device)), mem.upload(ang.cos().to(device))
        self.temp_state = mem.malloc(HIDDEN)
        self.graph_map = {}

    def forward_cuda_1(self, x, past_len, temp_q, temp_k, temp_v, graph=None):
        m, state = self.mem, self.temp_state
        launch_kernel(m, rms_norm_kernel, (x, self.layernorm, state, EPS, 1.0 / HIDDEN), graph, NORM, dim=HIDDEN)
        launch_kernel(m, gemm_half_q_half_kernel, (state, self.q_proj, temp_q), graph, Q, n=HIDDEN, k=HIDDEN)
        launch_kernel(m, gemm_half_q_half_kernel, (state, self.k_proj, temp_k), graph, K, n=KVD, k=HIDDEN)
        launch_kernel(m, gemm_half_q_half_kernel, (state, self.v_proj, temp_v), graph, V, n=KVD, k=HIDDEN)
        labelled = self.variant == "fix"                                 # bug: "// TODO: Graph stuff"
        launch_kernel(m, head_norm_kernel, (temp_q, self.q_norm, 0, temp_q, EPS, 1.0 / HEAD_DIM),
                      graph if labelled else None, Q_NORM, num_heads=HEADS)
        launch_kernel(m, head_norm_kernel, (temp_k, self.k_norm, 0, temp_k, EPS, 1.0 / HEAD_DIM),
                      graph if labelled else None, K_NORM, num_heads=KV_HEADS)
        launch_kernel(m, rope_cuda_qk_kernel, (temp_q, temp_k, self.sin, self.cos, HEADS, KV_HEADS, HEAD_DIM,
                                               HEADS, KV_HEADS, past_len), graph, ROPE)
        return m.at(temp_q, HIDDEN), m.at(temp_k, KVD), m.at(temp_v, KVD)

    def forward_cuda_1_graph(self, x, past_len, temp_q, temp_k, temp_v):
        if not self.graphed:
            return self.forward_cuda_1(x, past_len, temp_q, temp_k, temp_v)
        graph = self.graph_map.setdefault((1, 1), Graph(self.mem, self.device))     # {q_len, batch_size}
        if graph.count():
            graph.capture(lambda: self.forward_cuda_1(x, past_len, temp_q, temp_k, temp_v, graph))
        if not graph.ready():
            with events.warmup(real=True):
                return self.forward_cuda_1(x, past_len, temp_q, temp_k, temp_v)
        graph.update_param(NORM, 0, 0, x)                                # rms_norm_cuda_update_x
        for label, c in ((Q, temp_q), (K, temp_k), (V, temp_v)):
            graph.update_param(label, 0, 2, c)                           # q_gemm_cuda_update_c
        if self.variant == "fix":                                        # cde4e95
            for label, t in ((Q_NORM, temp_q), (K_NORM, temp_k)):
                graph.update_param(label, 0, 0, t)                       # head_norm_cuda_update_x
                graph.update_param(label, 0, 3, t)                       # head_norm_cuda_update_y
        graph.update_param(ROPE, 0, 0, temp_q)
        graph.update_param(ROPE, 0, 1, temp_k)
        graph.update_param(ROPE, 0, 9, past_len)                         # rope_cuda_qk_update_past_len
        outputs = (self.mem.at(temp_q, HIDDEN), self.mem.at(temp_k, KVD), self.mem.at(temp_v, KVD))
        graph.launch(outputs, eager=lambda: self.forward_cuda_1(x, past_len, temp_q, temp_k, temp_v))
        return outputs


def run(variant: str, device: str = "cpu"):
    gen = generator(7)
    embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
    o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
    lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def generate(graphed):
        mem = DeviceMemory(device)
        attn = QAttn(mem, device, variant, graphed)
        k_cache_f, v_cache_f = mem.malloc(MAX_SEQ * KVD), mem.malloc(MAX_SEQ * KVD)
        token, outs = 5, []
        for first_index in range(6):                                     # sequential decode, bsz 1, q_len 1
            x = mem.malloc(HIDDEN)
            mem.at(x, HIDDEN).copy_(embedding[token])
            q = mem.malloc(HIDDEN)                                       # q = torch.empty(...) per call
            k, v = k_cache_f + first_index * KVD, v_cache_f + first_index * KVD
            attn.forward_cuda_1_graph(x, first_index, q, k, v)
            n = first_index + 1                                          # flash_attn_with_kvcache, eager
            keys = mem.at(k_cache_f, n * KVD).view(n, KVD)
            values = mem.at(v_cache_f, n * KVD).view(n, KVD)
            qh = mem.at(q, HIDDEN).view(HEADS, HEAD_DIM)
            p = torch.softmax(qh @ keys.t() / HEAD_DIM ** 0.5, -1)      # both q heads share the kv head
            h = mem.at(x, HIDDEN) + (p @ values).reshape(HIDDEN) @ o_proj
            logits = h @ lm_head
            outs += [logits.clone(), keys.clone()]
            token = int(logits.argmax())
            mem.free(q, HIDDEN), mem.free(x, HIDDEN)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
