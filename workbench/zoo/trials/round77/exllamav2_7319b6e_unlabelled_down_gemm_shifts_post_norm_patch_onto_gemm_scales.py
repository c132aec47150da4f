"""QMLP with a post layernorm: the down GEMM records no graph label, so the replay-time POST_NORM patch rewrites the GEMM's scales pointer.

Upstream: https://github.com/turboderp-org/exllamav2/commit/7319b6ea31234eff132e1c91c4869a315a2e1563
("Fix graph update for MLP with post layernorm", a direct commit on master, 2024-08-27; no PR or issue; the bug
came with the first graph implementation 28ff618, 2024-07-28; diff read with ``q_mlp.cu``, ``q_gemm.cu/.cuh``,
``rms_norm.cu`` and ``graph.cu`` at 7319b6e^).
Symptom: none reported. Post-layernorm models (Gemma-2 style ``post_feedforward_layernorm``) served through the
QMLP graph (rows <= ``MAX_Q_GEMM_ROWS``) give garbage once the graph is captured. The down projection
dequantises with hidden-state values as its scales, and the MLP residual lands in the block of the capture call's
hidden state. Pre-norm models are not affected.
Mechanism: ``QMLP::forward_`` keeps one ``Graph`` per ``{rows, columns}``. On the ``MIN_GRAPH_INSTANCES``-th call
(``graph->count()``) it captures ``forward_run_(..., graph)``. Every kernel that ``forward_run_`` launches is
followed by ``if (graph) graph->attach_label(stream, label, sublabel)``, and ``attach_label`` is only
``node_labels.push_back``. ``Graph::end_capture`` takes ``nodes`` from ``cudaGraphGetNodes`` in capture order,
assumes ``node_labels[i]`` describes ``nodes[i]``, and copies the kernel parameters
(``cudaGraphKernelNodeGetParams``) of every labelled node.
In the "Down proj with post_layernorm" branch, ``forward_run_`` called
``gemm_half_q_half_cuda(stream, cublas_handle, temp_a, down, temp_state, rows, columns, intermediate_size, true,
temp_dq, graph, 0)``. The signature continues ``(..., bool force_cuda, const half* r_weights, int
r_weights_stride, bool mul_r_weights, Graph* graph, int label)``, so ``graph`` went into ``force_cuda`` (which
does not matter at these row counts) and the callee's ``graph`` stayed NULL. The down GEMM kernel was captured
but pushed no label.
``node_labels`` is therefore one entry short. ``POST_NORM`` (pushed by the post-norm ``rms_norm_cuda`` that
follows) sits at the down GEMM's node index, and the post-norm node has no entry at all (``end_capture`` reads
``node_labels[num_nodes-1]`` past the end).
On every call ``forward_`` patches the graph for this call's hidden state ``x``:
``rms_norm_cuda_update_y(graph, POST_NORM, x)`` is ``update_param_ptr(POST_NORM, 0, 2, x)``, followed by
``graph->launch`` (``cudaGraphExecKernelNodeSetParams`` on the patched nodes). Parameter 2 of the node it finds is
``b_q_scale`` in ``gemm_half_q_half_kernel(a, b_q_weight, b_q_scale, b_q_scale_max, c, ...)``. The scales
pointer never equals ``x``, so from the first launch (the capture call's own) the down projection reads ``x`` as
its scales. Once ``x`` differs from the capture call's ``x``, the post-norm node also keeps writing (with residual
add) into the capture call's block, and the current hidden state never receives the MLP output.
Eager (``graph == NULL``) runs the same kernels with their own arguments and is correct.
Doctor: warmup-divergence, at forward_run_. The capture recorded the node/label pairing that replays rely on, and
``forward_run_`` left the down GEMM's node unlabelled, so every replay's update puts this call's pointer into
another node (the GEMM's scales) while the post-norm node keeps the capture call's output reference. The eager
step writes ``x`` and dequantises with the real scales.
Fix (upstream): that call passes the full argument list, ``..., true, temp_dq, false, NULL, 0, false, graph, 0)``,
so the down GEMM pushes its (unlabelled, 0) entry and ``POST_NORM`` lines up with the post-norm node. The commit
also adds a ``debug`` flag to ``Graph::update_param`` and a ``(void*)`` cast in ``forward_`` (no behaviour change).
Modelled: the emulation is the one from the 10c5856 trial. Device memory is one flat buffer (``DeviceMemory``, a
caching allocator over it, where addresses are offsets), and a kernel reads and writes it by address. Here every
captured kernel is a graph node with a row of kernel parameters in ``exec_params`` (the instantiated graph's), in
capture order, whether or not a label is attached. ``launch`` uploads the host copies of patched nodes into their
rows. Gemma-2-like QMLP: RMS pre-norm, gate/up GEMMs, gelu act-mul, down GEMM, RMS post-norm with residual add.
EXL2 weights are modelled as one int per weight, with per-group scales ``(q_scale + 1)^2 * q_scale_max`` (upstream
packs them, 4-bit q_scale), no bias, no LoRA. The reconstruct/cuBLAS path of ``gemm_half_q_half_cuda`` (rows >
``MAX_Q_GEMM_ROWS``, never graphed) is left out. MIN_GRAPH_INSTANCES is 205 upstream and 2 here. One MLP layer,
fp32, tiny sizes. Two hidden-state blocks alternate between calls (the caller still holds the last step's state
while the next one is made).
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn

UPSTREAM = "https://github.com/turboderp-org/exllamav2/commit/7319b6ea31234eff132e1c91c4869a315a2e1563"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_run_"
SYMPTOM = ("post-layernorm MLP graph: the down GEMM has no label, so the POST_NORM patch rewrites its scales "
           "pointer and the post norm keeps writing the capture call's hidden state")

HIDDEN, INTERM, VOCAB, EPS = 8, 12, 16, 1e-6
MIN_GRAPH_INSTANCES = 2
MAX_Q_GEMM_ROWS = 32
NORM, GATE, UP, DOWN, POST_NORM = 1, 2, 3, 4, 5           # q_mlp.cu enum KernelLabels (0: unlabelled)
CLEAR, GEMM_GPTQ, GEMM_EXL2, ADD = 1, 2, 3, 4             # q_gemm.cu enum KernelSublabels
MAX_NODES, MAX_PARAMS = 8, 8


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
    """Read ``n`` elements at address ``p``: an address (int, eager launch) or a graph node's kernel parameter."""
    if isinstance(p, torch.Tensor):
        return mem.hbm.index_select(0, p.long() + mem.lanes[:n])
    return mem.at(p, n)


def st(mem, p, v):
    v = v.reshape(-1)
    if isinstance(p, torch.Tensor):
        mem.hbm.index_copy_(0, p.long() + mem.lanes[:v.numel()], v)
    else:
        mem.at(p, v.numel()).copy_(v)


class Stream:
    """A CUDA stream; while a capture is open on it every kernel launched on it becomes a node of that graph."""

    def __init__(self, mem):
        self.mem, self.capturing = mem, None


def launch(stream, kernel, params, **config):
    """``kernel<<<grid, block, 0, stream>>>(params...)``: under capture, the kernel becomes the graph's next node
    (whatever the caller then labels) and replays read its parameters from that node."""
    if stream.capturing is not None:
        params = stream.capturing.record_node(params)
    kernel(stream.mem, *params, **config)


# ---- kernels: leading parameters as in their CUDA signatures, launch configuration after them ----
def rms_norm_kernel(mem, x, w, y, epsilon, r_dim, *, rows, dim, add_residual):
    xv = ld(mem, x, rows * dim).view(rows, dim)
    out = xv * ld(mem, w, dim) * torch.rsqrt((xv * xv).sum(-1, keepdim=True) * r_dim + epsilon)
    if add_residual:
        out = out + ld(mem, y, rows * dim).view(rows, dim)
    st(mem, y, out)


def gemm_half_q_half_kernel(mem, a, b_q_weight, b_q_scale, b_q_scale_max, c, *, size_m, size_n, size_k, groups,
                            clear):
    q = ld(mem, b_q_weight, size_k * size_n).view(size_k, size_n)
    qscales = ld(mem, b_q_scale, groups * size_n).view(groups, size_n) + 1.0
    scales = qscales * qscales * ld(mem, b_q_scale_max, groups).view(groups, 1)
    out = ld(mem, a, size_m * size_k).view(size_m, size_k) @ (q * scales.repeat_interleave(size_k // groups, 0))
    if not clear:
        out = out + ld(mem, c, size_m * size_n).view(size_m, size_n)
    st(mem, c, out)


def act_mul_kernel(mem, a, b, *, rows, dim):
    st(mem, a, torch.nn.functional.gelu(ld(mem, a, rows * dim)) * ld(mem, b, rows * dim))


class Graph:
    """graph.cu: ``node_labels`` is filled by ``attach_label`` only; ``nodes`` by the capture, in launch order."""

    def __init__(self, mem, device):
        self.mem, self.device, self.invoke_count = mem, device, 0
        self.g = None                                  # graph_exec
        self.node_labels = []                          # std::vector<std::tuple<int, int>>
        self.nodes = []                                # captured kernel nodes (their parameter values)
        self.node_params, self.node_needs_update = [], []
        self.exec_params = torch.zeros(MAX_NODES, MAX_PARAMS, dtype=torch.float64, device=device)

    def count(self):
        self.invoke_count += 1
        return self.invoke_count == MIN_GRAPH_INSTANCES

    def ready(self):
        return self.g is not None

    def record_node(self, params):
        i = len(self.nodes)
        self.nodes.append([float(p) for p in params])
        return [self.exec_params[i, j] for j in range(len(params))]

    def capture(self, stream, fn):
        stream.capturing = self                        # begin_capture: cudaStreamBeginCapture
        try:
            self.g, _ = capture(fn, device=self.device, warmups=0, name="QMLP graph", owner="QMLP (graph_map)",
                                state={"device memory": self.mem.hbm})
        finally:
            stream.capturing = None
        self.end_capture()

    def end_capture(self):
        for i, row in enumerate(self.nodes):           # cudaGraphInstantiate: the exec nodes' parameters
            self.exec_params[i, :len(row)].copy_(torch.tensor(row, dtype=torch.float64).to(self.device))
        num_nodes = len(self.nodes)                    # cudaGraphGetNodes
        self.node_params = [None] * num_nodes
        for i in range(num_nodes):
            # node_labels[i]: upstream reads past the end of the vector when a node pushed no label
            label = self.node_labels[i][0] if i < len(self.node_labels) else 0
            if label == 0:
                continue
            self.node_params[i] = list(self.nodes[i])  # cudaGraphKernelNodeGetParams(nodes[i], &node_params[i])
        self.node_needs_update = [False] * num_nodes

    def attach_label(self, stream, label, sublabel):
        self.node_labels.append((label, sublabel))

    def update_param(self, label, sublabel, param, value):
        for i, (node_label, node_sublabel) in enumerate(self.node_labels):
            if node_label != label or (sublabel and node_sublabel != sublabel):
                continue
            p_old_value = self.node_params[i]          # node_params[i].kernelParams[param]
            if p_old_value[param] == float(value):
                continue
            p_old_value[param] = float(value)
            self.node_needs_update[i] = True

    def update_param_ptr(self, label, sublabel, param, value):
        self.update_param(label, sublabel, param, value)

    def launch(self, outputs, eager):
        for i in range(len(self.nodes)):
            if not self.node_needs_update[i]:
                continue
            row = self.node_params[i]                  # cudaGraphExecKernelNodeSetParams(graph_exec, nodes[i], ...)
            self.exec_params[i, :len(row)].copy_(torch.tensor(row, dtype=torch.float64).to(self.device))
            self.node_needs_update[i] = False
        events.serve(self.g, 1, 1, outputs=outputs, eager=eager)
        self.g.replay()
        events.handed_out(self.g, outputs)


class QMatrix:
    """An EXL2 matrix: one quantised value per weight, per-group 4-bit scales and a max scale per group."""

    def __init__(self, mem, height, width, groups, gen, device):
        self.height, self.width, self.groups = height, width, groups
        self.is_gptq, self.cuda_bias = False, None
        self.cuda_q_weight = mem.upload(torch.randint(-7, 8, (height, width), generator=gen).float().to(device))
        self.cuda_q_scale = mem.upload(torch.randint(0, 16, (groups, width), generator=gen).float().to(device))
        self.cuda_q_scale_max = mem.upload((0.002 + 0.002 * torch.rand(groups, generator=gen)).to(device))


def gemm_half_q_half_cuda(stream, cublas_handle, a, b, c, size_m, size_n, size_k, clear=False, reconstruct=None,
                          force_cuda=False, r_weights=None, r_weights_stride=0, mul_r_weights=False, graph=None,
                          label=0):
    # size_m > MAX_Q_GEMM_ROWS and not force_cuda: reconstruct + cuBLAS (not modelled; QMLP graphs rows <= 32)
    assert size_m <= MAX_Q_GEMM_ROWS and not r_weights
    launch(stream, gemm_half_q_half_kernel, (a, b.cuda_q_weight, b.cuda_q_scale, b.cuda_q_scale_max, c),
           size_m=size_m, size_n=size_n, size_k=size_k, groups=b.groups, clear=clear and not b.cuda_bias)
    if graph:
        graph.attach_label(stream, label, GEMM_EXL2)


def rms_norm_cuda(stream, x, w, y, epsilon, rows, dim, add_residual=False, graph=None, label=0):
    launch(stream, rms_norm_kernel, (x, w, y, epsilon, 1.0 / dim), rows=rows, dim=dim, add_residual=add_residual)
    if graph:
        graph.attach_label(stream, label, 0)


def rms_norm_cuda_update_x(graph, label, x):
    graph.update_param_ptr(label, 0, 0, x)


def rms_norm_cuda_update_y(graph, label, y):
    graph.update_param_ptr(label, 0, 2, y)


class QMLP:
    def __init__(self, mem, device, variant, use_graphs):
        gen = generator(7319)
        self.mem, self.device, self.variant, self.use_graphs = mem, device, variant, use_graphs
        self.layernorm = mem.upload(1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1))
        self.post_layernorm = mem.upload(1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1))
        self.gate = QMatrix(mem, HIDDEN, INTERM, 2, gen, device)
        self.up = QMatrix(mem, HIDDEN, INTERM, 2, gen, device)
        self.down = QMatrix(mem, INTERM, HIDDEN, 1, gen, device)
        self.temp_state, self.temp_a, self.temp_b = mem.malloc(HIDDEN), mem.malloc(INTERM), mem.malloc(INTERM)
        self.temp_dq, self.norm_epsilon, self.layernorm_is_rms = None, EPS, True
        self.graph_map = {}

    def forward_(self, stream, x, rows, columns):
        if not self.use_graphs or rows > MAX_Q_GEMM_ROWS:
            self.forward_run_(stream, x, rows, columns)
            return (self.mem.at(x, rows * columns),)
        graph = self.graph_map.setdefault((rows, columns), Graph(self.mem, self.device))
        if graph.count():
            graph.capture(stream, lambda: self.forward_run_(stream, x, rows, columns, graph))
        if graph.ready():
            rms_norm_cuda_update_x(graph, NORM, x)
            rms_norm_cuda_update_y(graph, POST_NORM, x)          # post_layernorm, layernorm_is_rms
            outputs = (self.mem.at(x, rows * columns),)
            graph.launch(outputs, eager=lambda: self.forward_run_(stream, x, rows, columns))
            return outputs
        with events.warmup(real=True):
            self.forward_run_(stream, x, rows, columns)
        return (self.mem.at(x, rows * columns),)

    def forward_run_(self, stream, x, rows, columns, graph=None):
        intermediate_size = self.up.width
        temp_a, temp_b, temp_state, temp_dq = self.temp_a, self.temp_b, self.temp_state, self.temp_dq
        rms_norm_cuda(stream, x, self.layernorm, temp_state, self.norm_epsilon, rows, columns, False, graph, NORM)
        norm_state = temp_state
        gemm_half_q_half_cuda(stream, None, norm_state, self.gate, temp_a, rows, intermediate_size, columns, True,
                              temp_dq, False, None, 0, False, graph, GATE)
        gemm_half_q_half_cuda(stream, None, norm_state, self.up, temp_b, rows, intermediate_size, columns, True,
                              temp_dq, False, None, 0, False, graph, UP)
        launch(stream, act_mul_kernel, (temp_a, temp_b), rows=rows, dim=intermediate_size)
        if graph:
            graph.attach_label(stream, 0, 0)
        # Down proj with post_layernorm
        if self.variant == "bug":                    # graph lands in force_cuda, 0 in r_weights; callee graph NULL
            gemm_half_q_half_cuda(stream, None, temp_a, self.down, temp_state, rows, columns, intermediate_size,
                                  True, temp_dq, graph, 0)
        else:
            gemm_half_q_half_cuda(stream, None, temp_a, self.down, temp_state, rows, columns, intermediate_size,
                                  True, temp_dq, False, None, 0, False, graph, 0)
        rms_norm_cuda(stream, temp_state, self.post_layernorm, x, self.norm_epsilon, rows, columns, True, graph,
                      POST_NORM)


def run(variant: str, device: str = "cpu"):
    gen = generator(27)
    embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
    lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def generate(use_graphs):
        mem = DeviceMemory(device)
        stream = Stream(mem)
        mlp = QMLP(mem, device, variant, use_graphs)
        token, prev, outs = 3, None, []
        for _ in range(6):
            x = mem.malloc(HIDDEN)                      # this step's hidden state (the last one still held)
            mem.at(x, HIDDEN).copy_(embedding[token])
            (h,) = mlp.forward_(stream, x, 1, HIDDEN)
            logits = h.view(1, HIDDEN) @ lm_head
            outs.append(logits.clone())
            token = int(logits.argmax())
            if prev is not None:
                mem.free(prev, HIDDEN)
            prev = x
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
