"""A decode graph built for one sequence is reused for another: its baked recurrent-state row is the first one's.

Upstream: https://github.com/ikawrakow/ik_llama.cpp/pull/2260 ("Fix wrong output for hybrid/recurrent models at
-np > 1 (graph reuse key)", commit 4a4a6d3c1, reported in #1932).
Symptom: hybrid/recurrent models (Qwen3.6-35B-A3B, Qwen3-Next) served with more than one resident sequence
(``-np > 1``) return silently wrong text: "every slot keeps producing fluent text, it is just no longer
conditioned on that slot's prompt, and slots degenerate into repetition loops" (7/12 replies degenerate at
``-np 6``; ``-np 1`` is unaffected). No crash, no warning.
Mechanism: ``llama_decode_internal`` rebuilds the compute graph only when ``llama_context::can_reuse_graph``
says no; otherwise it re-sets the inputs and computes ``prev->graph`` again, and the CUDA backend, seeing the
same graph, replays the CUDA graph it captured for it. ``can_reuse_graph`` keys reuse on the ubatch *shape*
(``all_seq_id``, ``n_outputs``, ``n_kv``, ``n_tokens``, MTP fields; ``update_cache_copies`` re-points the K/V
copies of attention layers only). The gated delta-net bakes the recurrent state into the graph at build time:
``build_qkv`` takes ``state_dst = ggml_view_2d(state_all, ..., state_seq_id_local * state_row_size)`` for the
ubatch's ``token_seq_ids.front()``, and a ``state_reset`` scale-by-0 node when ``batch.pos[0] == 0``. Two
consecutive decode ubatches of different sequences have the same shape, so the graph built for sequence A
decodes sequence B: it reads and writes A's state row, B's row is never touched, and both sequences advance one
shared state.
Doctor: warmup-divergence, at ``can_reuse_graph`` (the build fixed the state row and the reset node; the reuse
decision does not look at which sequences the ubatch carries, while an eager step reads the row of the ubatch's
own sequence).
Fix (upstream): ``llama_ubatch_seq_fingerprint`` hashes the ubatch's sequence composition (per-token seq ids, in
order, and whether each token is at position 0), gated on ``llm_arch_is_hybrid || llm_arch_is_recurrent``; it is
stored in ``llama_context::Prev`` and ``can_reuse_graph`` refuses reuse when it differs.
Read: the diff of #2260 (``src/llama.cpp``), ``can_reuse_graph``/``update_cache_copies`` and
``delta_net::build_layer_attn_linear``/``build_qkv`` at its parent. Modelled: one linear-attention (gated delta
rule) layer with a one-head state and no conv state, no attention layers (whose copies ``update_cache_copies``
re-points); the server issues one ``llama_decode`` per sequence here, so consecutive ubatches alternate between
the two slots. The eager reference computes every ubatch with a freshly built graph (no reuse, no CUDA graph).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ikawrakow/ik_llama.cpp/pull/2260"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "can_reuse_graph"
SYMPTOM = "at -np 2 the reused decode graph advances sequence 0's delta-net state for both slots"

N_VOCAB, N_EMBD, N_CTX, N_SEQ_MAX = 16, 4, 16, 2
PROMPTS = {0: [3, 9, 4], 1: [7, 1]}                       # slot -> prompt tokens (different lengths)
DECODE = [(0, 5), (1, 12), (0, 2), (1, 6), (0, 14), (1, 8), (0, 11), (1, 0)]   # (slot, token), one per decode


class llama_model:
    """A one-layer stand-in for Qwen3-Next's linear-attention layers (one head, no conv state)."""

    def __init__(self, device):
        gen = generator(2260)
        self.tok_embd = randn(N_VOCAB, N_EMBD, gen=gen, device=device)
        self.pos_embd = randn(N_CTX, N_EMBD, gen=gen, device=device, scale=0.3)
        self.wq = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.7)
        self.wk = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.7)
        self.wv = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.7)
        self.w_beta = randn(N_EMBD, gen=gen, device=device)
        self.w_gate = randn(N_EMBD, gen=gen, device=device)
        self.ssm_out = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.7)
        self.output = randn(N_EMBD, N_VOCAB, gen=gen, device=device)


class llama_batch:
    def __init__(self, tokens, pos, seq_id):
        self.token, self.pos, self.seq_id = list(tokens), list(pos), list(seq_id)
        self.n_tokens = len(self.token)
        self.n_seq_id = [1] * self.n_tokens
        self.all_seq_id = 0                       # unused by per-token seq ids (the server's batches)


class ggml_cgraph:
    """A built graph: its input tensors (set by ``llama_set_inputs``), the computation with everything the
    builder baked into it, and the CUDA graph the backend captured for it."""

    def __init__(self, inp_tokens, inp_pos, compute):
        self.inp_tokens, self.inp_pos, self.compute = inp_tokens, inp_pos, compute
        self.cuda_graph = None


class Prev:
    def __init__(self, all_seq_id, n_outputs, n_kv, n_tokens, seq_fingerprint, graph):
        self.all_seq_id, self.n_outputs, self.n_kv, self.n_tokens = all_seq_id, n_outputs, n_kv, n_tokens
        self.seq_fingerprint, self.graph = seq_fingerprint, graph


def llama_graph_bakes_seq_state(arch: str) -> bool:
    return arch in ("qwen3next", "qwen35")          # llm_arch_is_hybrid(arch) || llm_arch_is_recurrent(arch)


def llama_ubatch_seq_fingerprint(b: llama_batch, arch: str, variant: str) -> int:
    """(the fix) FNV-1a over the ubatch's sequence composition; 0 where nothing of it is baked (and before
    the fix, where no fingerprint exists)."""
    if variant == "bug" or not llama_graph_bakes_seq_state(arch):
        return 0
    h = 1469598103934665603
    mask = (1 << 64) - 1

    def mix(v):
        nonlocal h
        h = ((h ^ v) * 1099511628211) & mask

    mix(b.n_tokens)
    for i in range(b.n_tokens):
        mix(b.n_seq_id[i])
        mix(b.seq_id[i])
        mix(1 if b.pos[i] == 0 else 0)
    return h


def build_qkv(model, x, state_all, state_seq_id_local: int, reset_state_local: bool):
    """``delta_net::build_qkv``: the state row is a view at a build-time offset; a reset is a build-time node."""
    state_dst = state_all[state_seq_id_local]                 # ggml_view_2d(..., state_seq_id_local * row_size)
    state = state_dst * 0.0 if reset_state_local else state_dst.clone()      # "state_reset": ggml_scale(.., 0)
    q, k, v = x @ model.wq, x @ model.wk, x @ model.wv
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(x @ model.w_beta[:, None])          # [n_tokens, 1]
    gate = torch.sigmoid(x @ model.w_gate[:, None])
    outs = []
    for t in range(x.shape[0]):                               # gated delta rule, token by token
        q_t, k_t, v_t = q[t:t + 1], k[t:t + 1], v[t:t + 1]
        state = gate[t:t + 1] * state
        delta = (v_t - k_t @ state) * beta[t:t + 1]
        state = state + k_t.transpose(0, 1) @ delta
        outs.append(q_t @ state)
    state_dst.copy_(state)                                    # ggml_cpy(new state, state_dst)
    return torch.cat(outs)


def build_layer_attn_linear(model, x, state_all, batch: llama_batch):
    token_seq_ids = batch.seq_id
    all_same_seq = all(s == token_seq_ids[0] for s in token_seq_ids)
    assert all_same_seq
    reset_state = batch.pos[0] == 0
    out = build_qkv(model, x, state_all, token_seq_ids[0], reset_state)
    return out @ model.ssm_out + x


def llama_build_graph(model, s_l, batch: llama_batch, device) -> ggml_cgraph:
    inp_tokens = torch.zeros(batch.n_tokens, dtype=torch.long, device=device)
    inp_pos = torch.zeros(batch.n_tokens, dtype=torch.long, device=device)

    def compute():
        x = model.tok_embd[inp_tokens] + model.pos_embd[inp_pos]
        cur = build_layer_attn_linear(model, x, s_l, batch)
        return cur[-1:] @ model.output                        # inp_out_ids: the last token's logits
    return ggml_cgraph(inp_tokens, inp_pos, compute)


class llama_context:
    def __init__(self, model, device, variant, graph_reuse: bool):
        self.model, self.device, self.variant = model, device, variant
        self.arch = "qwen3next"
        self.graph_reuse = graph_reuse                       # cparams.graph_reuse (off: -no-gr)
        self.s_l = torch.zeros(N_SEQ_MAX, N_EMBD, N_EMBD, device=device)   # kv_self.s_l[il], one row per slot
        self.n_kv = 0
        self.n_outputs = 1
        self.prev: Prev | None = None

    def update_cache_copies(self) -> bool:
        """Re-point the baked K/V copy offsets of the attention layers (there are none here); recurrent
        layers are skipped (``layer_has_attention_kv``)."""
        return True

    def can_reuse_graph(self, u_batch: llama_batch) -> bool:
        if not self.graph_reuse:
            return False
        the_prev = self.prev
        if the_prev is None or the_prev.graph is None:
            return False
        if llama_ubatch_seq_fingerprint(u_batch, self.arch, self.variant) != the_prev.seq_fingerprint:
            return False
        return (u_batch.all_seq_id == the_prev.all_seq_id and
                self.n_kv == the_prev.n_kv and
                self.n_outputs == the_prev.n_outputs and
                u_batch.n_tokens == the_prev.n_tokens and
                self.update_cache_copies())

    def llama_set_inputs(self, gf: ggml_cgraph, u_batch: llama_batch):
        gf.inp_tokens.copy_(torch.tensor(u_batch.token, device=self.device))
        gf.inp_pos.copy_(torch.tensor(u_batch.pos, device=self.device))

    def graph_compute(self, gf: ggml_cgraph, use_cuda_graph: bool):
        """``ggml_backend_cuda_graph_compute``: a new graph is captured; the same graph is replayed."""
        if not use_cuda_graph:
            return gf.compute()
        if gf.cuda_graph is None:
            gf.cuda_graph = capture(gf.compute, device=self.device, warmups=0, name=f"n_tokens={gf.inp_tokens.numel()}",
                                    static={"inp_tokens": gf.inp_tokens, "inp_pos": gf.inp_pos},
                                    state={"s_l (recurrent state)": self.s_l}, owner="ggml-cuda backend")
        graph, out = gf.cuda_graph
        return replay(graph, out)


def llama_decode_internal(lctx: llama_context, u_batch: llama_batch, use_cuda_graph: bool) -> torch.Tensor:
    if not lctx.can_reuse_graph(u_batch):
        gf = llama_build_graph(lctx.model, lctx.s_l, u_batch, lctx.device)   # llm_build_context::llama_build_graph
        if lctx.graph_reuse:
            lctx.prev = Prev(u_batch.all_seq_id, lctx.n_outputs, lctx.n_kv, u_batch.n_tokens,
                             llama_ubatch_seq_fingerprint(u_batch, lctx.arch, lctx.variant), gf)
    else:
        gf = lctx.prev.graph                                  # "Reusing graph"
    lctx.llama_set_inputs(gf, u_batch)
    return lctx.graph_compute(gf, use_cuda_graph)


def run(variant: str, device: str = "cpu"):
    model = llama_model(device)

    def serve(graphs: bool):
        lctx = llama_context(model, device, variant, graph_reuse=graphs)
        n_past = {}
        logits = []
        for slot, prompt in PROMPTS.items():                  # prompt processing, one slot at a time
            batch = llama_batch(prompt, range(len(prompt)), [slot] * len(prompt))
            logits.append(llama_decode_internal(lctx, batch, graphs).clone())
            n_past[slot] = len(prompt)
        for slot, token in DECODE:                            # one decode ubatch per slot, alternating
            batch = llama_batch([token], [n_past[slot]], [slot])
            logits.append(llama_decode_internal(lctx, batch, graphs).clone())
            n_past[slot] += 1
        return logits

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
