"""QMLP's post-norm graph update writes the new output pointer into the RMS-norm node's ``epsilon``, not its ``y``.

Upstream: https://github.com/turboderp-org/exllamav2/commit/10c58561285e7f1ac2ce8724571d4786d792f9aa
("Fix graph update for RMS norm node", a direct commit on master 33 minutes after the first graph
implementation 28ff618; no PR or issue; diff read with ``q_mlp.cu``, ``rms_norm.cu`` and ``graph.cu`` there).
Symptom: none reported (fixed the same day); post-layernorm models (Gemma-2 style) served through the
QMLP graph get a wrong MLP residual once the graph runs: garbage text.
Mechanism: ``QMLP::forward_graph_`` keeps one ``Graph`` per ``{rows, columns}`` in ``graph_map``; on the
``MIN_GRAPH_INSTANCES``-th call (``graph->count()``) it captures ``forward_(..., graph)``, whose kernels
``graph->attach_label`` themselves (NORM, GATE, UP, POST_NORM). Every call from then on patches the
labelled nodes' parameters for this call's hidden state ``x`` (``rms_norm_cuda_update_x(graph, NORM, x)``;
post-layernorm: ``rms_norm_cuda_update_y(graph, POST_NORM, x)``) and ``graph->launch``es:
``Graph::update_param`` writes ``*(T*) node_params[i].kernelParams[param] = value`` and the node gets
``cudaGraphExecKernelNodeSetParams``. ``rms_norm_kernel(x, w, y, epsilon, r_dim, ...)`` has ``y`` at index 2,
but ``rms_norm_cuda_update_y`` patched index 3: the post-norm node keeps the capture call's ``x`` as its
output (the residual add lands in that block, which the caching allocator has handed on) and its
``epsilon`` becomes the bits of an address. The current hidden state never gets the MLP output on the
calls whose ``x`` is another block, and every replay normalises with a garbage epsilon.
Doctor: warmup-divergence, at rms_norm_cuda_update_y (the replay-time update leaves the post-norm node's
output reference at the one the capture took, and corrupts a scalar of the node, while eager writes ``x``).
Fix (upstream): ``graph->update_param_ptr(label, 0, 3, y)`` becomes ``update_param_ptr(label, 0, 2, y)``.
Emulation: device memory is one flat buffer (``DeviceMemory``, a caching allocator over it: addresses are
offsets); a kernel reads and writes it by address. A labelled node reads its leading parameters from its
row of ``node_params`` (``cudaGraphKernelNodeGetParams``' storage, uploaded by ``launch`` when patched),
so a patched pointer moves what the replay touches; an unlabelled node's pointers are baked at capture.
Two hidden-state blocks alternate between calls (the caller still holds the last step's state while the
next one is made). The 8-byte write also clobbers ``r_dim`` in CUDA; only ``epsilon`` is modelled here.
MIN_GRAPH_INSTANCES is 125 upstream, 2 here; one MLP layer, fp32, tiny sizes.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn

UPSTREAM = "https://github.com/turboderp-org/exllamav2/commit/10c58561285e7f1ac2ce8724571d4786d792f9aa"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "rms_norm_cuda_update_y"
SYMPTOM = "post-layernorm MLP graph: output goes to the capture call's hidden state, epsilon becomes an address"

HIDDEN, INTERM, VOCAB, EPS = 8, 12, 16, 1e-6
MIN_GRAPH_INSTANCES = 2
NORM, GATE, UP, POST_NORM = 1, 2, 3, 4                      # enum KernelLabels (0: unlabelled)


class DeviceMemory:
    """One flat device buffer and the caching allocator over it: a freed block goes to the next allocation
    of its size (last freed first). Address 0 is NULL."""

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
    """Read ``n`` elements at address ``p``: a baked address (int), or a kernel parameter the graph reads."""
    if isinstance(p, torch.Tensor):
        return mem.hbm.index_select(0, p.long() + mem.lanes[:n])
    return mem.at(p, n)


def st(mem, p, v):
    v = v.reshape(-1)
    if isinstance(p, torch.Tensor):
        mem.hbm.index_copy_(0, p.long() + mem.lanes[:v.numel()], v)
    else:
        mem.at(p, v.numel()).copy_(v)


# ---- kernels: leading parameters as in their CUDA signatures, launch configuration after them ----
def rms_norm_kernel(mem, x, w, y, epsilon, r_dim, *, rows, dim, add_residual):
    xv = ld(mem, x, rows * dim).view(rows, dim)
    out = xv * ld(mem, w, dim) * torch.rsqrt((xv * xv).sum(-1, keepdim=True) * r_dim + epsilon)
    if add_residual:
        out = out + ld(mem, y, rows * dim).view(rows, dim)
    st(mem, y, out)


def gemm_half_q_half_kernel(mem, a, b, c, *, m, n, k):
    st(mem, c, ld(mem, a, m * k).view(m, k) @ ld(mem, b, k * n).view(k, n))


def act_mul_kernel(mem, a, b, *, rows, dim):
    st(mem, a, torch.nn.functional.gelu(ld(mem, a, rows * dim)) * ld(mem, b, rows * dim))


class Graph:
    """graph.cu: capture once; labelled nodes' parameters are patched on the host and uploaded at launch."""

    def __init__(self, mem, device):
        self.mem, self.device, self.invoke_count = mem, device, 0
        self.g = None
        self.node_labels, self.node_params_host, self.node_needs_update = [], [], []
        self.node_params = torch.zeros(8, 8, dtype=torch.float64, device=device)   # the exec nodes' params

    def count(self):
        self.invoke_count += 1
        return self.invoke_count == MIN_GRAPH_INSTANCES

    def ready(self):
        return self.g is not None

    def capture(self, fn):
        self.g, _ = capture(fn, device=self.device, warmups=0, name="QMLP graph", owner="QMLP (graph_map)",
                            state={"device memory": self.mem.hbm})
        self.node_needs_update = [True] * len(self.node_labels)   # end_capture: cudaGraphKernelNodeGetParams

    def attach_label(self, label, params):
        """The node just captured: its leading parameters now live in its ``node_params`` row."""
        i = len(self.node_labels)
        self.node_labels.append(label)
        self.node_params_host.append([float(p) for p in params])
        return [self.node_params[i, j] for j in range(len(params))]

    def update_param_ptr(self, label, sublabel, param, value):
        for i, node_label in enumerate(self.node_labels):
            if node_label != label:
                continue
            if self.node_params_host[i][param] == float(value):
                continue
            self.node_params_host[i][param] = float(value)     # *p_old_value = value (whatever param is)
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


def rms_norm_cuda_update_x(graph, label, x):
    graph.update_param_ptr(label, 0, 0, x)


def rms_norm_cuda_update_y(graph, label, y, variant):
    graph.update_param_ptr(label, 0, 3 if variant == "bug" else 2, y)    # 10c5856: 3 -> 2


class QMLP:
    def __init__(self, mem, device, variant, graphed):
        gen = generator(10585)
        self.mem, self.device, self.variant, self.graphed = mem, device, variant, graphed
        self.layernorm = mem.upload(1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1))
        self.post_layernorm = mem.upload(1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1))
        self.gate = mem.upload(randn(HIDDEN, INTERM, gen=gen, device=device, scale=0.5))
        self.up = mem.upload(randn(HIDDEN, INTERM, gen=gen, device=device, scale=0.5))
        self.down = mem.upload(randn(INTERM, HIDDEN, gen=gen, device=device, scale=0.5))
        self.temp_state, self.temp_a, self.temp_b = mem.malloc(HIDDEN), mem.malloc(INTERM), mem.malloc(INTERM)
        self.graph_map = {}

    def forward_(self, x, rows, graph=None):
        m, r_dim = self.mem, 1.0 / HIDDEN
        launch_kernel(m, rms_norm_kernel, (x, self.layernorm, self.temp_state, EPS, r_dim), graph, NORM,
                      rows=rows, dim=HIDDEN, add_residual=False)
        launch_kernel(m, gemm_half_q_half_kernel, (self.temp_state, self.gate, self.temp_a), graph, GATE,
                      m=rows, n=INTERM, k=HIDDEN)
        launch_kernel(m, gemm_half_q_half_kernel, (self.temp_state, self.up, self.temp_b), graph, UP,
                      m=rows, n=INTERM, k=HIDDEN)
        launch_kernel(m, act_mul_kernel, (self.temp_a, self.temp_b), rows=rows, dim=INTERM)
        # down proj with post_layernorm: into temp_state (no label), then the post norm adds into x
        launch_kernel(m, gemm_half_q_half_kernel, (self.temp_a, self.down, self.temp_state),
                      m=rows, n=HIDDEN, k=INTERM)
        launch_kernel(m, rms_norm_kernel, (self.temp_state, self.post_layernorm, x, EPS, r_dim), graph,
                      POST_NORM, rows=rows, dim=HIDDEN, add_residual=True)
        return (m.at(x, rows * HIDDEN),)

    def forward_graph_(self, x, rows):
        if not self.graphed:
            return self.forward_(x, rows)
        graph = self.graph_map.setdefault((rows, HIDDEN), Graph(self.mem, self.device))
        if graph.count():
            graph.capture(lambda: self.forward_(x, rows, graph))
        if graph.ready():
            rms_norm_cuda_update_x(graph, NORM, x)
            rms_norm_cuda_update_y(graph, POST_NORM, x, self.variant)
            outputs = (self.mem.at(x, rows * HIDDEN),)
            graph.launch(outputs, eager=lambda: self.forward_(x, rows))
            return outputs
        with events.warmup(real=True):
            return self.forward_(x, rows)


def run(variant: str, device: str = "cpu"):
    gen = generator(28)
    embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
    lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def generate(graphed):
        mem = DeviceMemory(device)
        mlp = QMLP(mem, device, variant, graphed)
        token, prev, outs = 3, None, []
        for _ in range(6):
            x = mem.malloc(HIDDEN)                      # this step's hidden state (the last one still held)
            mem.at(x, HIDDEN).copy_(embedding[token])
            (h,) = mlp.forward_graph_(x, 1)
            logits = h.view(1, HIDDEN) @ lm_head
            outs.append(logits.clone())
            token = int(logits.argmax())
            if prev is not None:
                mem.free(prev, HIDDEN)
            prev = x
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
