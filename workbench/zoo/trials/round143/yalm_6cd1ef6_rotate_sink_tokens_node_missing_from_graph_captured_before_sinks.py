"""yalm (a small C++/CUDA LLM inference engine) records each forward pass as a CUDA graph once per inference mode,
on the first call, and afterwards only re-runs the host code that builds the pass: every kernel whose arguments
change per token (the token, ``pos``, ``kv_pos``, ``kv_len``, ``kv_sink``) goes through
``CudaGraph::add_or_update_kernel_node``, which adds a kernel node while the stream captures and, once the graph
exists, patches that node's arguments with ``cudaGraphExecKernelNodeSetParams``; the graph is then launched. When the
decode runs past the sliding-window context (``-T``), StreamingLLM-style attention sinks start: ``kv_sink`` becomes
``KV_SINKS`` and ``Block::_block_cuda`` launches ``rotate_sink_tokens`` to rotate the sink keys by one position per
token. But ``_block_cuda`` registered that node only ``if (kv_sink > 0)``: the graph is captured at position 0 (the
warm-up forward), where ``kv_sink`` is 0, so the node never entered the graph. At the first position past the
window, the update path looks the key up with ``nodes[key]`` (``std::unordered_map`` inserts a null node) and calls
``cudaGraphExecKernelNodeSetParams`` on it, which fails, and ``CUDA_CHECK`` aborts. Without graphs the branch simply
launches the kernel. The fix registers the node unconditionally (the kernel returns at once when ``kv_sink == 0``).

Upstream: https://github.com/andrewkchan/yalm/commit/6cd1ef6e7d6b9f724b6d98a63b273f903928ad2f ("fix rotate_kv_sink
cuda graph updates, att_mix loop bounds", repository andrewkchan/yalm, author Andrew Chan, 2025-08-26), a direct
commit on the main branch (no pull request), the fix for issue https://github.com/andrewkchan/yalm/issues/9 ("Bug:
rotate_sink_tokens kernel not added to CUDA Graph leads to runtime crash", stamp711, 2025-08-24, closed). Read, in a
mirror of the repository: the whole diff (``src/infer.cu``: ``rotate_sink_tokens``, ``Block::_block_cuda``,
``CudaGraph::add_or_update_kernel_node``, ``att_mix``); at its parent (ec0a3bc): ``src/infer.cu`` from
``fused_rope_and_cache_update`` through ``Block::_block_cuda``, ``Model::_forward_cuda``,
``Model::_forward_cuda_build_graph``, ``CudaGraph::wrap``, ``CudaGraph::launch``, ``add_or_update_kernel_node``, the
``CUDA_CHECK`` macro, the ``rope`` device functions and the kernels ``attn_dot``, ``attn_softmax``, ``att_mix``,
``fused_qkv_matmul_clip``, ``matmul_wide``, ``fused_matmul_add_residuals``, ``copy_embedding_*``; ``src/model.h``
(``KV_SINKS = 2``, ``struct CudaGraph`` with its ``std::unordered_map`` of nodes, ``InferenceState::graph()`` choosing
``_hydrate_graph`` or ``_output_graph`` by mode); the CPU backend's sink rotation in ``src/infer.cpp``; and
``src/main.cpp``'s completion loop (the warm-up ``model.forward(state, 0, 0)``, the prompt in
``HYDRATE_KV_CACHE`` mode but its last token, then sample and forward). The stored text of issue #9 (its
description, whose pasted output is cut off in the copy I read) and of PR #11 (closed unmerged: it re-applied this
commit, then its author found main already had it).
Not read: the rest of ``infer.cu`` (the rmsnorm kernel body, ``matmul``, MoE), the tokenizer, the sampler's code
beyond its call, the CPU backend beyond the sink loop, the tests, and the later fused-attention commits. The exact
CUDA error that ``cudaGraphExecKernelNodeSetParams`` returns for a null node is not shown in the text I read (the
issue's output is truncated); I assume ``cudaErrorInvalidValue``.
Symptom: issue #9: "During CUDA graph creation, ``kv_sink`` would be 0, so this code path is not executed. As a
result, the ``rotate_sink_tokens`` kernel is **not included in the CUDA graph**. Later, when the KV cache window gets
rotated during a subsequent model forward pass, ``add_or_update_kernel_node`` will try to update a **non-existent
node** in the graph, causing the program to crash." Reproduced with a small window: ``./build/main
mistral-7b-instruct-fp16.yalm -i "What is a large language model?" -T 10``.
Mechanism: ``CudaGraph::wrap`` captures ``_forward_cuda_build_graph`` on the first forward of a mode and only re-runs
it (``is_created``) afterwards: the static kernels are skipped and each ``add_or_update_kernel_node`` becomes a
parameter update of a node that must already be in the instantiated graph. Which nodes exist is therefore decided by
the host branches taken at capture, at position 0. ``kv_sink = pos >= max_seq_len ? KV_SINKS : 0`` is 0 there, so the
``if (kv_sink > 0)`` branch of ``_block_cuda`` adds no ``rotate_sink_tokens`` node; at ``pos == max_seq_len`` the
same branch is taken in the update pass and asks for a node the graph never had.
Doctor: warmup-divergence, at ``_block_cuda``: the captured step does other work than the eager step would, because a
host branch (``kv_sink > 0``) evaluated at capture differs from the one later steps take; the function the fix
changes is ``Block::_block_cuda`` (the ``add_or_update_kernel_node`` change only turns the crash into an assert).
Fix (upstream): ``_block_cuda`` always registers the ``rotate_sink_tokens`` node (the ``if (kv_sink > 0)`` becomes a
bare block), ``rotate_sink_tokens`` returns at once when ``kv_sink == 0``, and ``add_or_update_kernel_node`` uses
``nodes.find(key)`` with ``assert(false && "adding new graph nodes after capture currently not supported")`` instead
of ``nodes[key]``. The same commit also changes ``att_mix``'s unrolled loop bound (a prefetch out-of-bounds read for
small contexts), which is not a graph bug and is not modelled.
Modelled: ``CudaGraph`` (``wrap``, ``launch``, ``add_or_update_kernel_node``, ``is_created``, ``nodes``),
``cudaGraphExecKernelNodeSetParams``, ``InferenceState`` (``graph()``, ``set_mode``, per-mode graphs, ``x``, ``xb``,
``q``/``k``/``v``, ``att``, ``xb2``, ``hb``, ``logits``), ``Block`` (``block``, ``_block_cuda``, ``key_cache``,
``value_cache``), ``Model`` (``forward``, ``_forward_cuda``, ``_forward_cuda_build_graph``), the kernels
``copy_embedding``, ``rmsnorm``, ``fused_qkv_matmul_clip``, ``fused_rope_and_cache_update``, ``rotate_sink_tokens``,
``attn_dot``, ``attn_softmax``, ``att_mix``, ``fused_matmul_add_residuals``, ``fused_ffn_w1_w3_glu_act``,
``matmul_wide``, ``rope``, ``KV_SINKS``, and ``main.cpp``'s completion loop (``completion``).
Stand-ins: a kernel node's arguments are a row of a pinned host table (``InferenceState.node_params``) that the
captured node copies to the device before its kernel (a captured copy from pinned memory re-reads it at each
launch), so ``cudaGraphExecKernelNodeSetParams`` is a host write of that row; pointer arguments are the tensors bound
at capture, as upstream. Grid sizes that depend on ``kv_len`` are replaced by masks over the whole cache
(``attn_dot``/``attn_softmax``/``att_mix`` weigh rows ``t >= kv_len`` by exactly 0). The run without graphs is the
same code with graphs off (kernels launched directly, static kernels every time): upstream's CUDA backend has no such
switch, its reference is the CPU backend. Because the host table is read by the launched graph (upstream's
arguments are copied into the executable graph at update time), ``CudaGraph::launch`` waits for the launch before the
next token's updates. The fix's early ``return`` of ``rotate_sink_tokens`` for ``kv_sink == 0`` is implicit here: the
kernel rotates the rows ``r < kv_sink`` by a mask, which is all false then. A null node makes ``cudaGraphExecKernelNodeSetParams`` raise
(``CUDA_CHECK``'s abort). float64 everywhere (upstream: fp16 weights and KV cache, fp32 activations); the model: 2
layers, dim 16, 2 query heads and 1 KV head of 8, SiLU GLU of 32, vocabulary 24, RMSNorm; greedy sampling on the
host.
Workload: ``main.cpp``'s completion with ``-T 6`` (``max_seq_len`` 6, ``KV_SINKS`` 2): the warm-up forward at
position 0 (captures the output graph), a 4-token prompt (positions 0-2 hydrate, capturing the hydrate graph; 3
outputs logits), then 6 greedy decode steps at positions 4-9; from position 6 on the sinks rotate. Outputs: the
logits of every logits-producing forward after the warm-up, the sampled tokens, and both layers' key caches.
Measured: bug: misbehaves (raised CudaError: CUDA error in add_or_update_kernel_node:
cudaGraphExecKernelNodeSetParams(instance, nodes['0:rotate_sink_tokens']) on a node the graph does not have: invalid
argument (cudaErrorInvalidValue=1)), at position 6, the first past the window; fix: equals eager (max |graph - eager|
= 0). The rotation matters to the numbers: the run without graphs with ``rotate_sink_tokens`` stubbed out samples
tokens [6, 18, 23, 13, 3, 15] instead of [6, 18, 23, 13, 3, 18] (logits up to 4.78 apart). About 1 s for both variants
on the CPU.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/andrewkchan/yalm/commit/6cd1ef6e7d6b9f724b6d98a63b273f903928ad2f"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_block_cuda"
SYMPTOM = ("decoding past the sliding window with CUDA graphs crashes: the rotate_sink_tokens node was never captured "
           "(kv_sink was 0 at capture), so add_or_update_kernel_node updates a non-existent graph node")

DTYPE = torch.float64
KV_SINKS = 2
DIM, N_HEADS, N_KV_HEADS, HEAD_DIM, HIDDEN_DIM, VOCAB, N_LAYERS = 16, 2, 1, 8, 32, 24, 2
MAX_SEQ_LEN = 6                     # -T 6: sliding-window context length
ROPE_THETA, ROTARY_DIM, NORM_EPS, QKV_CLIP = 10000.0, HEAD_DIM, 1e-5, 1e9
PROMPT = (1, 7, 3, 12)
NUM_STEPS = 6
MAX_NODES, MAX_ARGS = 32, 4
HYDRATE_KV_CACHE, OUTPUT_LOGITS = "hydrate", "output_logits"
_variant = "bug"


class CudaError(RuntimeError):
    pass


# --- kernels -----------------------------------------------------------------------------------------------------

def rope(x: Tensor, pos: Tensor) -> Tensor:
    """Complex rotation of pairs (j, j+1) of each head by ``pos * theta^(-j/rotary_dim)``; ``pos`` is on the device."""
    pairs = x.reshape(*x.shape[:-1], -1, HEAD_DIM // 2, 2)
    j = torch.arange(0, HEAD_DIM, 2, device=x.device, dtype=DTYPE)
    freq = torch.where(j >= ROTARY_DIM, torch.zeros_like(j), ROPE_THETA ** (-j / ROTARY_DIM))
    val = pos.to(DTYPE) * freq
    fcr, fci = torch.cos(val), torch.sin(val)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * fcr - b * fci, a * fci + b * fcr], dim=-1).reshape(x.shape)


def copy_embedding(table: Tensor, token: Tensor, out: Tensor) -> None:
    out.copy_(table.index_select(0, token).reshape(-1))


def rmsnorm(x: Tensor, weight: Tensor, out: Tensor) -> None:
    out.copy_(x * torch.rsqrt((x * x).mean() + NORM_EPS) * weight)


def fused_qkv_matmul_clip(wq, wk, wv, x, q_out, k_out, v_out) -> None:
    q_out.copy_((wq @ x).clamp(-QKV_CLIP, QKV_CLIP))
    k_out.copy_((wk @ x).clamp(-QKV_CLIP, QKV_CLIP))
    v_out.copy_((wv @ x).clamp(-QKV_CLIP, QKV_CLIP))


def fused_rope_and_cache_update(q, k, v, pos, kv_pos, q_out, kb, vb) -> None:
    q_out.copy_(rope(q, pos))
    kb.index_copy_(0, kv_pos, rope(k, pos).unsqueeze(0))
    vb.index_copy_(0, kv_pos, v.unsqueeze(0))


def rotate_sink_tokens(kb, kv_sink) -> None:
    """Rotate each of the first ``kv_sink`` cached keys forward by one position (RoPE with pos 1)."""
    sinks = kb[:KV_SINKS]
    rows = torch.arange(KV_SINKS, device=kb.device) < kv_sink
    sinks.copy_(torch.where(rows.unsqueeze(1), rope(sinks, torch.ones((), dtype=torch.long, device=kb.device)), sinks))


def attn_dot(kb, q, kv_len, att) -> None:
    group = N_HEADS // N_KV_HEADS
    keys = kb.reshape(MAX_SEQ_LEN, N_KV_HEADS, HEAD_DIM).repeat_interleave(group, dim=1)  # (t, h, d)
    score = torch.einsum("hd,thd->ht", q.reshape(N_HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    live = torch.arange(MAX_SEQ_LEN, device=kb.device) < kv_len
    att.copy_(torch.where(live, score, torch.zeros_like(score)))


def attn_softmax(att, kv_len) -> None:
    live = torch.arange(MAX_SEQ_LEN, device=att.device) < kv_len
    masked = att.masked_fill(~live, -math.inf)
    e = torch.exp(masked - masked.max(dim=1, keepdim=True).values)
    att.copy_(e / e.sum(dim=1, keepdim=True))


def att_mix(vb, att, kv_len, out) -> None:
    group = N_HEADS // N_KV_HEADS
    values = vb.reshape(MAX_SEQ_LEN, N_KV_HEADS, HEAD_DIM).repeat_interleave(group, dim=1)
    live = torch.arange(MAX_SEQ_LEN, device=vb.device) < kv_len
    weights = torch.where(live, att, torch.zeros_like(att))
    out.copy_(torch.einsum("ht,thd->hd", weights, values).reshape(-1))


def fused_matmul_add_residuals(w, x, out) -> None:
    out.add_(w @ x)


def fused_ffn_w1_w3_glu_act(w1, w3, x, out) -> None:
    a = w1 @ x
    out.copy_(a / (1.0 + torch.exp(-a)) * (w3 @ x))


def matmul_wide(w, x, out) -> None:
    out.copy_(w @ x)


# --- CudaGraph (src/infer.cu, src/model.h) ---------------------------------------------------------------------------

class KernelNode:
    """A kernel node: its function, pointer arguments bound at capture, and its per-token scalar arguments, which live
    in a row of the pinned host table and are copied to the device when the node runs."""

    def __init__(self, s: "InferenceState", func, tensors: tuple, slot: int, names: tuple) -> None:
        self.func, self.tensors, self.slot, self.names = func, tensors, slot, names
        self.host_row, self.dev_row = s.node_params[slot], s.node_params_dev[slot]

    def set_params(self, scalars: dict) -> None:
        for i, name in enumerate(self.names):
            self.host_row[i] = int(scalars[name])          # host write: runs once if inside a capture

    def run(self) -> None:
        self.dev_row.copy_(self.host_row, non_blocking=True)   # captured: re-read at every launch
        args = [self.dev_row[i] for i in range(len(self.names))]
        self.func(*self.tensors, *args)


def cudaGraphExecKernelNodeSetParams(instance, node, scalars: dict) -> None:
    if node is None or instance is None:
        raise CudaError("CUDA error in add_or_update_kernel_node: cudaGraphExecKernelNodeSetParams(instance, "
                        f"nodes[{scalars['_key']!r}]) on a node the graph does not have: invalid argument "
                        "(cudaErrorInvalidValue=1)")
    node.set_params(scalars)


class CudaGraph:
    def __init__(self, s: "InferenceState") -> None:
        self.s = s
        self.graph = None
        self.instance = None
        self.outputs = None
        self.is_created = False
        self.nodes: dict = {}

    def wrap(self, func, output: Tensor) -> None:
        if not self.s.use_graphs:
            func()
            return
        if not self.is_created:
            # cudaStreamBeginCapture ... func() ... cudaStreamEndCapture, cudaGraphInstantiate
            self.instance, self.outputs = capture(lambda: (func(), output)[1], device=self.s.device, warmups=0,
                                                  name=f"yalm {self.s._mode} forward", state=self.s.kv_state())
            self.is_created = True
        else:
            func()

    def launch(self) -> None:
        if self.s.use_graphs:
            replay(self.instance, self.outputs)            # cudaGraphLaunch
            # (stand-in) cudaGraphExecKernelNodeSetParams copies the arguments into the executable graph, so the
            # next token's updates cannot race this launch; the host-table stand-in waits for the launch instead.
            synchronize(self.s.device)

    def add_or_update_kernel_node(self, key: str, func, tensors: tuple, scalars: dict) -> None:
        s = self.s
        if not s.use_graphs:                               # (stand-in) the same kernel launched directly
            func(*tensors, *[torch.tensor(int(v), dtype=torch.long, device=s.device) for v in scalars.values()])
            return
        if not self.is_created:
            node = KernelNode(s, func, tensors, s.next_slot(), tuple(scalars))
            node.set_params(scalars)                       # cudaGraphAddKernelNode(&new_node, ..., &params)
            node.run()
            self.nodes[key] = node
        elif _variant == "bug":
            node = self.nodes.setdefault(key, None)        # std::unordered_map::operator[]: inserts a null node
            cudaGraphExecKernelNodeSetParams(self.instance, node, {**scalars, "_key": key})
        else:
            node = self.nodes.get(key)                     # nodes.find(key)
            assert node is not None, "adding new graph nodes after capture currently not supported"
            cudaGraphExecKernelNodeSetParams(self.instance, node, {**scalars, "_key": key})


# --- state and model -------------------------------------------------------------------------------------------------

class InferenceState:
    def __init__(self, device: str, use_graphs: bool) -> None:
        self.device, self.use_graphs = device, use_graphs

        def z(*shape):
            return torch.zeros(*shape, dtype=DTYPE, device=device)
        self._x, self._xb, self._xb2, self._hb = z(DIM), z(DIM), z(N_HEADS * HEAD_DIM), z(HIDDEN_DIM)
        self._q, self._k, self._v = z(N_HEADS * HEAD_DIM), z(N_KV_HEADS * HEAD_DIM), z(N_KV_HEADS * HEAD_DIM)
        self._att, self._logits = z(N_HEADS, MAX_SEQ_LEN), z(VOCAB)
        self.node_params = host(torch.zeros(MAX_NODES, MAX_ARGS, dtype=torch.long), device)
        self.node_params_dev = torch.zeros(MAX_NODES, MAX_ARGS, dtype=torch.long, device=device)
        self._slots = 0
        self._mode = OUTPUT_LOGITS
        self._hydrate_graph, self._output_graph = CudaGraph(self), CudaGraph(self)
        self.blocks: list = []

    def next_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    def set_mode(self, mode: str) -> None:
        self._mode = mode

    def graph(self) -> CudaGraph:
        return self._hydrate_graph if self._mode == HYDRATE_KV_CACHE else self._output_graph

    def kv_state(self) -> dict:
        return {f"{i}:{n}": t for i, b in enumerate(self.blocks)
                for n, t in (("key_cache", b.key_cache()), ("value_cache", b.value_cache()))}

    def x(self): return self._x
    def xb(self): return self._xb
    def xb2(self): return self._xb2
    def hb(self): return self._hb
    def q(self): return self._q
    def k(self): return self._k
    def v(self): return self._v
    def att(self): return self._att
    def logits(self): return self._logits


class Block:
    def __init__(self, layer_i: int, gen: torch.Generator, device: str) -> None:
        self._layer_i = layer_i

        def w(*shape, scale=0.35):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.rms_att_weight, self.rms_ffn_weight = 1.0 + w(DIM, scale=0.1), 1.0 + w(DIM, scale=0.1)
        self.wq, self.wk, self.wv = w(N_HEADS * HEAD_DIM, DIM), w(N_KV_HEADS * HEAD_DIM, DIM), w(N_KV_HEADS * HEAD_DIM, DIM)
        self.wo = w(DIM, N_HEADS * HEAD_DIM)
        self.w1, self.w3, self.w2 = w(HIDDEN_DIM, DIM), w(HIDDEN_DIM, DIM), w(DIM, HIDDEN_DIM)
        self._key_cache = torch.zeros(MAX_SEQ_LEN, N_KV_HEADS * HEAD_DIM, dtype=DTYPE, device=device)
        self._value_cache = torch.zeros(MAX_SEQ_LEN, N_KV_HEADS * HEAD_DIM, dtype=DTYPE, device=device)

    def key_cache(self): return self._key_cache
    def value_cache(self): return self._value_cache

    def block(self, s: InferenceState, pos: int, kv_sink: int, kv_pos: int, kv_len: int) -> None:
        self._block_cuda(s, pos, kv_sink, kv_pos, kv_len)

    def _block_cuda(self, s: InferenceState, pos: int, kv_sink: int, kv_pos: int, kv_len: int) -> None:
        static = not s.graph().is_created or not s.use_graphs        # STATIC_KERNEL(x)
        g, li = s.graph(), self._layer_i
        if static:
            rmsnorm(s.x(), self.rms_att_weight, s.xb())
            fused_qkv_matmul_clip(self.wq, self.wk, self.wv, s.xb(), s.q(), s.k(), s.v())
        kb, vb = self.key_cache(), self.value_cache()
        g.add_or_update_kernel_node(f"{li}:fused_rope_and_cache_update",
                                    lambda pos_, kv_pos_: fused_rope_and_cache_update(
                                        s.q(), s.k(), s.v(), pos_, kv_pos_, s.q(), kb, vb),
                                    (), {"pos": pos, "kv_pos": kv_pos})
        if _variant == "bug":
            if kv_sink > 0:
                g.add_or_update_kernel_node(f"{li}:rotate_sink_tokens", lambda kv_sink_: rotate_sink_tokens(kb, kv_sink_),
                                            (), {"kv_sink": kv_sink})
        else:
            # Sink tokens stay while the rest of the cache is replaced in ring order; rotate any sink tokens each pass.
            g.add_or_update_kernel_node(f"{li}:rotate_sink_tokens", lambda kv_sink_: rotate_sink_tokens(kb, kv_sink_),
                                        (), {"kv_sink": kv_sink})
        g.add_or_update_kernel_node(f"{li}:attn_dot", lambda kv_len_: attn_dot(kb, s.q(), kv_len_, s.att()),
                                    (), {"kv_len": kv_len})
        g.add_or_update_kernel_node(f"{li}:attn_softmax", lambda kv_len_: attn_softmax(s.att(), kv_len_),
                                    (), {"kv_len": kv_len})
        g.add_or_update_kernel_node(f"{li}:att_mix", lambda kv_len_: att_mix(vb, s.att(), kv_len_, s.xb2()),
                                    (), {"kv_len": kv_len})
        if static:
            fused_matmul_add_residuals(self.wo, s.xb2(), s.x())
            rmsnorm(s.x(), self.rms_ffn_weight, s.xb())
            fused_ffn_w1_w3_glu_act(self.w1, self.w3, s.xb(), s.hb())
            fused_matmul_add_residuals(self.w2, s.hb(), s.x())


class Model:
    def __init__(self, device: str) -> None:
        gen = generator(6)
        self.token_embedding_table = (torch.randn(VOCAB, DIM, generator=gen, dtype=DTYPE)).to(device)
        self.blocks = [Block(i, gen, device) for i in range(N_LAYERS)]
        self.rms_final_weight = (1.0 + torch.randn(DIM, generator=gen, dtype=DTYPE) * 0.1).to(device)
        self.wcls = (torch.randn(VOCAB, DIM, generator=gen, dtype=DTYPE) * 0.5).to(device)

    def forward(self, s: InferenceState, token: int, pos: int, mode: str = OUTPUT_LOGITS) -> None:
        self._forward_cuda(s, token, pos, mode)

    def _forward_cuda(self, s: InferenceState, token: int, pos: int, mode: str) -> None:
        s.set_mode(mode)
        g = s.graph()
        output = s.logits() if mode == OUTPUT_LOGITS else s.x()
        g.wrap(lambda: self._forward_cuda_build_graph(s, token, pos, mode), output)
        g.launch()

    def _forward_cuda_build_graph(self, s: InferenceState, token: int, pos: int, mode: str) -> None:
        static = not s.graph().is_created or not s.use_graphs
        s.graph().add_or_update_kernel_node(
            "copy_embedding", lambda token_: copy_embedding(self.token_embedding_table, token_.reshape(1), s.x()),
            (), {"token": token})
        # When decoding past the context length, keep the first few tokens as "attention sinks" (StreamingLLM).
        kv_sink = KV_SINKS if pos >= MAX_SEQ_LEN else 0
        kv_pos = kv_sink + (pos - kv_sink) % (MAX_SEQ_LEN - kv_sink)
        kv_len = MAX_SEQ_LEN if pos >= MAX_SEQ_LEN else pos + 1
        for b in self.blocks:
            b.block(s, pos, kv_sink, kv_pos, kv_len)
        if mode == HYDRATE_KV_CACHE:
            return
        if static:
            rmsnorm(s.x(), self.rms_final_weight, s.x())
            matmul_wide(self.wcls, s.x(), s.logits())


def completion(device: str, use_graphs: bool) -> list:
    """``main.cpp``'s completion mode with greedy sampling."""
    model = Model(device)
    s = InferenceState(device, use_graphs)
    s.blocks = model.blocks
    model.forward(s, 0, 0)                                 # warm-up inference
    logits, tokens = [], []
    encoding = list(PROMPT)
    for pos, token_id in enumerate(encoding):
        mode = OUTPUT_LOGITS if pos + 1 == len(encoding) else HYDRATE_KV_CACHE
        model.forward(s, token_id, pos, mode)
    logits.append(s.logits().clone())
    for _ in range(NUM_STEPS):
        token_id = int(s.logits().argmax().item())         # sampler.sample(state, 0.0), after the stream sync
        tokens.append(token_id)
        encoding.append(token_id)
        model.forward(s, token_id, len(encoding) - 1)
        logits.append(s.logits().clone())
    return [torch.stack(logits), torch.tensor(tokens, dtype=DTYPE),
            *[b.key_cache().clone() for b in model.blocks]]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: completion(device, use_graphs=True),
                       lambda: completion(device, use_graphs=False))
    finally:
        _variant = "bug"
