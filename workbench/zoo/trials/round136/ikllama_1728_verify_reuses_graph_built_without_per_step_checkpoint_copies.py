"""A speculative verify reuses a graph built while per-step checkpoints were off: a rejection restores unsaved states.

ik_llama.cpp keeps the last compute graph it built (``llama_context::prev``) and, when ``can_reuse_graph`` finds the
next ubatch of the same shape, sets the inputs again and computes that graph once more; the CUDA backend then
replays the CUDA graph it captured for it. Speculative decoding of hybrid (delta-net) models saves, during a verify
batch, the recurrent state after every token into per-step checkpoint tensors, so that a rejection can restore the
state of the last accepted token. Whether those copies exist is decided when the graph is *built*: the delta-net
builder reads the host flag ``kv_self.save_per_step_ssm`` (set by ``llama_spec_ckpt_save`` just before a verify) and
adds the ``per_step_ckpt_cpy`` node only if it is set. ``can_reuse_graph`` did not look at that flag, and since #1713
a multi-token graph may be reused. A graph built for a prompt chunk (flag off) of the same size as a verify batch is
therefore reused for the verify: its logits are right, but no per-step state is written, and the first rejection
restores the recurrent state from a checkpoint buffer nobody filled. The fix refuses reuse while per-step saves are on.

Upstream: https://github.com/ikawrakow/ik_llama.cpp/pull/1728 ("Fix graph reuse regression with MTP checkpoints",
ikawrakow/ik_llama.cpp, by dmaivel; opened and merged 2026-05-03 as commit 38c200373). Read, in a mirror of the
repository: the whole diff of 38c200373 (``src/llama.cpp``: ``can_reuse_graph`` gains ``if (kv_self.save_per_step_ssm)
return false;``; ``llama_decode_internal`` calls ``lctx.reset_scheduler()`` instead of ``ggml_backend_sched_reset`` +
``prev.reset()`` when it rebuilds; ``spec_ckpt_try_per_step`` also allows CPU-only recurrent layers), and at its
parent: ``llama_context::Prev``, ``reset_scheduler``, ``can_reuse_graph``, ``update_cache_copies``,
``llama_decode_internal`` (ubatch loop, ``n_outputs``, ``llama_kv_cache_find_slot``, ``kv_self.n``, reuse/rebuild,
``llama_set_inputs``, ``llama_graph_compute``, ``reset_previous`` for a graph built at head 0),
``llama_kv_cache::per_step_alloc`` / ``per_step_restore`` / ``checkpoint_save``, ``spec_ckpt_try_per_step``,
``llama_spec_ckpt_init`` / ``_save`` / ``_restore`` / ``_discard``, ``llama_kv_cache_seq_rm``;
``src/llama-delta-net.cpp`` (``delta_net`` constructor: ``save_per_step_states = save_per_step_ssm && n_tokens > 1``,
``build_layer_attn_linear``, ``build_qkv``, ``build_fused_delta_net`` with its ``per_step_ckpt_cpy``);
``llm_build_context::init`` (every build re-initialises ``lctx.buf_compute_meta`` and the ``lctx.inp_*`` pointers);
the server (``examples/server/server-context.cpp``): ``save_speculative_checkpoint``,
``restore_speculative_checkpoint``, ``discard_speculative_checkpoint``, the verify bookkeeping, ``need_embd`` (with
MTP every prompt token is an output); ``common/speculative.cpp``: ``common_speculative_state_mtp`` (its own
``ctx_mtp``) and ``mtp_speculative_gen_draft``. Also read: the two PRs the description names, #1713 ("MTP: better
graph reuse", 2dd381808: drops the ``n_tokens > 1`` exclusion, adds ``n_tokens`` and a second cached graph
``prev_mtp``) and #1724 (per-step checkpoints with CPU recurrent layers, description only), and the later #1780 ("MTP:
Reuse graphs (again)", cec1a6c1f), which comments the blanket refusal out and instead stores ``save_per_step_ssm`` and
``per_step_max_allocated`` in ``Prev`` and refuses reuse when either differs -- the two things the build bakes.
Not read: the CUDA backend's graph code at this revision (that a reused ggml graph replays its captured CUDA graph is
from ``ggml_cuda_graph_get_key`` and #2260's description); the MTP context's own graphs beyond the lines named
above; ``ggml_delta_net``'s kernels; the PR thread beyond its description.
Symptom: "Merging #1724 and #1713 introduced a regression where MTP speculative decoding produces incoherent text"
(the PR description). The reported setup is MTP on Qwen3.6-27B with partial offload (#1724's table).
Mechanism: per verify the server calls ``llama_spec_ckpt_init`` (``per_step_alloc``: zero-filled per-step buffers) and
``llama_spec_ckpt_save`` (``save_per_step_ssm = true``), decodes ``[sampled, drafts...]``, and on a rejection calls
``per_step_restore(step)``, which copies the saved state of step ``step`` into ``s_l``; then
``llama_spec_ckpt_discard`` clears the flag. The flag is read only by the graph builder. A prompt chunk of
``n_draft + 1`` tokens (every token an output, as a verify) builds a graph without the copies; the verify that follows
has the same ``n_tokens``, ``n_outputs``, ``n_kv`` and sequence, so ``can_reuse_graph`` says yes, and every later
verify reuses the same graph. The restore then writes zeros (the cleared buffer) into the recurrent state.
Doctor: warmup-divergence, at can_reuse_graph. The graph was captured with the branch ``if save_all_steps`` of the
delta-net builder decided by a host flag that was off then; the verify's own step (built now) takes the other branch
and writes the per-step checkpoints. ``can_reuse_graph`` is where the replayed graph is chosen without looking at
that flag, and it is the function the fix changes.
Fix (upstream): ``can_reuse_graph`` returns false while ``kv_self.save_per_step_ssm`` is set, so every verify batch is
built (and captured) anew, with the copies; and a rebuild resets both cached graphs (``reset_scheduler``).
Modelled: ``llama_context`` (``Prev``, ``prev``/``prev_mtp``, ``reset_scheduler``, ``can_reuse_graph``,
``update_cache_copies``, ``llama_set_inputs``, ``graph_compute``), ``llama_decode_internal`` (ubatch split,
``find_slot``, ``n_kv``, reuse or build, ``reset_previous``), ``llama_kv_cache`` (``cells``, ``head``, ``used``,
``find_slot``, ``seq_rm``, ``per_step_alloc``, ``per_step_restore``), ``delta_net`` (``build_layer_attn_linear``,
``build_qkv``, ``build_fused_delta_net`` with the per-step copy), ``llama_build_graph``, ``llama_spec_ckpt_init`` /
``_save`` / ``_restore`` / ``_discard``, and the server's ``save_speculative_checkpoint``,
``restore_speculative_checkpoint``, ``discard_speculative_checkpoint`` and verify loop.
Stand-ins: a two-layer hybrid (one gated-delta-rule layer with 2 heads of 4x4 state, no short convolution, so no
``per_step_qkv`` / conv reconstruction; one single-head attention layer without RoPE) stands for Qwen3.5/3.6. At this
revision the MTP drafter runs on a context of its own (``common_speculative_state_mtp`` creates ``ctx_mtp`` with
``llama_init_from_model``), so the target context builds only prompt and verify graphs and caches only ``prev``;
the drafter here is a fixed bigram table run on the host, in place of that MTP context (its graphs, ``prev_mtp`` and
the ``reset_scheduler`` half of the fix, which drops both cached graphs of one context when its shared scheduler and
``buf_compute_meta`` are rebuilt, are not modelled). As upstream with MTP, every prompt token is an output
(``need_embd``), so a prompt ubatch and a verify batch of the same length have the same ``n_outputs``. The K/V copy
destinations, which ``update_cache_copies`` re-points on reuse, are a static index input (``inp_kv_idxs``) written by
``llama_set_inputs``; each built graph owns its input tensors; one slot, greedy verification, a constant draft length
(as with ``--draft-p-min 0.0``); the CUDA backend's capture-on-first-compute is ``kit.capture`` (no warmup) then
``kit.replay``. That the last prompt ubatch has ``n_draft + 1`` tokens (a 12-token prompt at ``n_ubatch`` 8 and 3
drafts; a follow-up turn's suffix would do as well) is my construction of a trigger: the reporter's exact sequence of
batches is not known to me. float64 throughout.
Workload: a 12-token prompt decoded in ubatches of 8 and 4 (n_ubatch 8), then 5 speculative steps of 3 drafts each
(verify batches of 4 tokens); outputs: every ubatch's logits and the accepted-draft count of each step. The run
without graphs is the same server loop with graph reuse and CUDA graphs off (``-no-gr``, ``-cuda graphs=0``).
Measured (WORKBENCH_FAST=1, CPU): bug: "misbehaves (max |graph - eager| = 13.7)": the second prompt ubatch builds
the 4-token graph, all five verifies reuse it (the run without graphs builds each), the first verify's logits still
equal eager's, its rejection after one accepted draft restores a zero state (the saved state's norm is 0 against
2.66 eagerly), and from the second verify on logits and acceptances differ (accepted drafts [1, 0, 0, 0, 0] against
[1, 0, 1, 0, 0]); fix: "equals eager (max |graph - eager| = 0)", every verify captured anew. About 3 s per variant.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ikawrakow/ik_llama.cpp/pull/1728"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "can_reuse_graph"
SYMPTOM = ("speculative decoding of a hybrid model turns incoherent: a verify batch reuses a graph built without the "
           "per-step checkpoint copies, so a rejection restores a recurrent state nobody saved")

N_VOCAB, N_EMBD, N_HEAD_V, HEAD_DIM = 16, 8, 2, 4
KV_SIZE, KV_PAD, N_UBATCH, N_DRAFT, N_SPEC_STEPS = 64, 64, 8, 3, 5
STATE_SIZE = N_HEAD_V * HEAD_DIM * HEAD_DIM            # per_step_ssm_state_size (head_v * head_v * nv)
DTYPE = torch.float64
_variant = "bug"


class llama_model:
    """Layer 0: linear attention (gated delta rule); layer 1: full attention with a KV cache."""

    def __init__(self, device):
        gen = generator(1728)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)
        d = N_HEAD_V * HEAD_DIM
        self.tok_embd = r(N_VOCAB, N_EMBD, scale=1.0)
        self.wqkv, self.ssm_alpha, self.ssm_beta, self.ssm_out = r(N_EMBD, 3 * d), r(N_EMBD, N_HEAD_V), \
            r(N_EMBD, N_HEAD_V), r(d, N_EMBD)
        self.wq, self.wk, self.wv, self.wo = (r(N_EMBD, N_EMBD) for _ in range(4))
        self.output = r(N_EMBD, N_VOCAB, scale=1.0)
        self.draft_table = torch.randperm(N_VOCAB, generator=gen).tolist()    # the drafter's bigram table


def rms_norm(x):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6)


class llama_batch:
    def __init__(self, tokens, pos):
        self.token, self.pos = list(tokens), list(pos)
        self.n_tokens = len(self.token)
        self.logits = [True] * self.n_tokens            # verify: every token; prompt: need_embd() with MTP
        self.all_seq_id = 0


class llama_kv_cache:
    def __init__(self, device):
        self.size, self.head, self.used, self.n = KV_SIZE, 0, 0, KV_PAD
        self.cells = [-1] * KV_SIZE                      # cell pos (one sequence)
        self.k_l = torch.zeros(KV_SIZE, N_EMBD, dtype=DTYPE, device=device)
        self.v_l = torch.zeros(KV_SIZE, N_EMBD, dtype=DTYPE, device=device)
        self.s_l = torch.zeros(1, STATE_SIZE, dtype=DTYPE, device=device)     # recurrent state, one slot row
        self.save_per_step_ssm = False
        self.per_step_ssm = None                         # ckpt.per_step_ssm[il] (one recurrent layer)
        self.per_step_max_allocated = 0
        self.device = device

    def find_slot(self, n_tokens, pos):
        if self.head > self.used + 2 * n_tokens:          # llama_decode_internal's heuristic
            self.head = 0
        start = self.head
        while any(self.cells[(start + i) % self.size] >= 0 for i in range(n_tokens)):
            start = (start + 1) % self.size
        self.head = start
        for i in range(n_tokens):
            self.cells[start + i] = pos[i]
        self.used += n_tokens

    def cell_max(self):
        return max((i + 1 for i, p in enumerate(self.cells) if p >= 0), default=0)

    def seq_rm(self, p0):
        for i, p in enumerate(self.cells):
            if p >= p0:
                self.cells[i] = -1
                self.used -= 1

    def per_step_alloc(self, max_tokens):
        if self.per_step_max_allocated >= max_tokens:
            return True
        self.per_step_ssm = None                         # ggml_backend_buffer_free of the old buffers
        self.per_step_ssm = torch.zeros(max_tokens * STATE_SIZE, dtype=DTYPE, device=self.device)  # buffer_clear(0)
        self.per_step_max_allocated = max_tokens
        return True

    def per_step_restore(self, step):
        """tensor_get of the saved state of ``step``, tensor_set into ``s_l`` (host code, between decodes)."""
        if self.per_step_ssm is None or step < 0:
            return False
        self.s_l[0].copy_(self.per_step_ssm[step * STATE_SIZE:(step + 1) * STATE_SIZE])
        return True


class ggml_cgraph:
    """A built graph: its input tensors, the computation with what the builder baked in, its captured CUDA graph."""

    def __init__(self, inputs, compute):
        self.inputs, self.compute, self.cuda_graph = inputs, compute, None


class Prev:
    def __init__(self, all_seq_id, n_outputs, n_kv, n_tokens, mtp_op_type, graph):
        self.all_seq_id, self.n_outputs, self.n_kv, self.n_tokens = all_seq_id, n_outputs, n_kv, n_tokens
        self.mtp_op_type, self.graph = mtp_op_type, graph


# --- src/llama-delta-net.cpp (reduced) --------------------------------------------------------------------------

def build_fused_delta_net(q, k, v, g, beta, state, save_all_steps: bool, per_step_ckpt):
    """``ggml_delta_net`` (token by token), then, when ``save_all_steps``, the ``per_step_ckpt_cpy`` node copying the
    state after every token into the persistent checkpoint tensor."""
    n_tokens = q.shape[0]
    outs, steps = [], []
    for t in range(n_tokens):
        state = state * torch.exp(g[t])[:, None, None]
        kv_mem = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + torch.einsum("hk,hv->hkv", k[t], delta)
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
        steps.append(state)
    if save_all_steps and per_step_ckpt is not None and n_tokens > 1:
        if n_tokens * STATE_SIZE <= per_step_ckpt.numel():
            per_step_ckpt[:n_tokens * STATE_SIZE].copy_(torch.stack(steps).reshape(-1))   # per_step_ckpt_cpy
    return torch.stack(outs), state


def build_qkv(model, cur, s_l, reset_state_local: bool, save_per_step_states: bool, per_step_ckpt):
    n = cur.shape[0]
    qkv = (cur @ model.wqkv).view(n, 3, N_HEAD_V, HEAD_DIM)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    q = q / q.norm(dim=-1, keepdim=True) / math.sqrt(HEAD_DIM)
    k = k / k.norm(dim=-1, keepdim=True)
    g = -torch.nn.functional.softplus(cur @ model.ssm_alpha)
    beta = torch.sigmoid(cur @ model.ssm_beta)
    state_dst = s_l[0]                                   # ggml_view_2d(state_all, ..., state_seq_id_local * row)
    state = state_dst * 0.0 if reset_state_local else state_dst.clone()    # "state_reset" when pos == 0
    out, new_state = build_fused_delta_net(q, k, v, g, beta, state.view(N_HEAD_V, HEAD_DIM, HEAD_DIM),
                                           save_per_step_states, per_step_ckpt)
    state_dst.copy_(new_state.reshape(-1))               # state_cpy
    return out.reshape(n, -1)


class delta_net:
    def __init__(self, lctx, batch: llama_batch):
        self.reset_state = batch.pos[0] == 0
        self.save_per_step_states = lctx.kv_self.save_per_step_ssm and batch.n_tokens > 1

    def build_layer_attn_linear(self, lctx, cur):
        kv = lctx.kv_self
        per_step_ckpt = kv.per_step_ssm if self.save_per_step_states else None
        out = build_qkv(lctx.model, rms_norm(cur), kv.s_l, self.reset_state, self.save_per_step_states, per_step_ckpt)
        return cur + out @ lctx.model.ssm_out


def llama_build_graph(lctx, batch: llama_batch) -> ggml_cgraph:
    """``llm_build_context::llama_build_graph``: new input tensors, the host decisions of this build baked in."""
    dev, n, n_kv, model, kv = lctx.device, batch.n_tokens, lctx.kv_self.n, lctx.model, lctx.kv_self
    inputs = {"inp_tokens": torch.zeros(n, dtype=torch.long, device=dev),
              "inp_kv_idxs": torch.zeros(n, dtype=torch.long, device=dev),
              "inp_KQ_mask": torch.zeros(n, n_kv, dtype=DTYPE, device=dev)}
    dn = delta_net(lctx, batch)

    def compute():
        cur = model.tok_embd[inputs["inp_tokens"]]
        cur = dn.build_layer_attn_linear(lctx, cur)
        x = rms_norm(cur)                                # layer 1: self-attention over the first n_kv cells
        kv.k_l.index_copy_(0, inputs["inp_kv_idxs"], x @ model.wk)
        kv.v_l.index_copy_(0, inputs["inp_kv_idxs"], x @ model.wv)
        kq = (x @ model.wq) @ kv.k_l[:n_kv].T / math.sqrt(N_EMBD) + inputs["inp_KQ_mask"]
        cur = cur + (torch.softmax(kq, dim=-1) @ kv.v_l[:n_kv]) @ model.wo
        return rms_norm(cur) @ model.output              # result_output, every token an output
    return ggml_cgraph(inputs, compute)


# --- src/llama.cpp (reduced) ---------------------------------------------------------------------------------------

class llama_context:
    def __init__(self, model, device, graphs: bool):
        self.model, self.device = model, device
        self.graph_reuse = graphs                        # cparams.graph_reuse (off: -no-gr)
        self.use_cuda_graph = graphs                     # off: -cuda graphs=0
        self.kv_self = llama_kv_cache(device)
        self.n_outputs = 0
        self.mtp_op_type = "MTP_OP_NONE"
        self.prev: Prev | None = None
        self.prev_mtp: Prev | None = None               # the MTP variant's graph (unused: no MTP head here)

    def reset_scheduler(self):
        self.prev = None                                 # ggml_backend_sched_reset(sched) + both cached graphs
        self.prev_mtp = None

    def update_cache_copies(self) -> bool:
        """Re-point the K/V copies at ``kv_self.head`` (here: the ``inp_kv_idxs`` input carries them)."""
        return True

    def can_reuse_graph(self, u_batch: llama_batch) -> bool:
        if not self.graph_reuse:
            return False
        if _variant == "fix" and self.kv_self.save_per_step_ssm:
            return False
        the_prev = self.prev if self.mtp_op_type == "MTP_OP_NONE" else self.prev_mtp
        if the_prev is None or the_prev.graph is None:
            return False
        return (u_batch.all_seq_id == the_prev.all_seq_id and self.kv_self.head > 0 and
                self.kv_self.n == the_prev.n_kv and self.n_outputs == the_prev.n_outputs and
                u_batch.n_tokens == the_prev.n_tokens and self.mtp_op_type == the_prev.mtp_op_type and
                self.update_cache_copies())

    def llama_set_inputs(self, gf: ggml_cgraph, u_batch: llama_batch):
        kv, t = self.kv_self, lambda x, dt: torch.tensor(x, dtype=dt).to(self.device)
        gf.inputs["inp_tokens"].copy_(t(u_batch.token, torch.long))
        gf.inputs["inp_kv_idxs"].copy_(t([kv.head + i for i in range(u_batch.n_tokens)], torch.long))
        mask = [[0.0 if 0 <= kv.cells[j] <= p else -math.inf for j in range(kv.n)] for p in u_batch.pos]
        gf.inputs["inp_KQ_mask"].copy_(t(mask, DTYPE))

    def graph_compute(self, gf: ggml_cgraph):
        """``ggml_backend_cuda_graph_compute``: a new graph is captured then launched; the same graph is replayed."""
        if not self.use_cuda_graph:
            return gf.compute()
        if gf.cuda_graph is None:
            kv = self.kv_self
            state = {"k_l": kv.k_l, "v_l": kv.v_l, "s_l": kv.s_l}
            if kv.per_step_ssm is not None:
                state["per_step_ssm"] = kv.per_step_ssm
            gf.cuda_graph = capture(gf.compute, device=self.device, warmups=0, static=dict(gf.inputs), state=state,
                                    name=f"n_tokens={gf.inputs['inp_tokens'].numel()}", owner="ggml-cuda backend")
        g, out = gf.cuda_graph
        return replay(g, out)


def llama_decode_internal(lctx: llama_context, batch: llama_batch) -> list[torch.Tensor]:
    kv, logits = lctx.kv_self, []
    for cur_token in range(0, batch.n_tokens, N_UBATCH):
        u_batch = llama_batch(batch.token[cur_token:cur_token + N_UBATCH], batch.pos[cur_token:cur_token + N_UBATCH])
        lctx.n_outputs = sum(u_batch.logits)
        kv.find_slot(u_batch.n_tokens, u_batch.pos)
        kv.n = min(kv.size, max(KV_PAD, -(-kv.cell_max() // KV_PAD) * KV_PAD))
        if not lctx.can_reuse_graph(u_batch):
            if _variant == "fix":
                lctx.reset_scheduler()
            else:
                lctx.prev = None                         # ggml_backend_sched_reset(lctx.sched); prev.reset();
            gf = llama_build_graph(lctx, u_batch)
            if lctx.graph_reuse:
                lctx.prev = Prev(u_batch.all_seq_id, lctx.n_outputs, kv.n, u_batch.n_tokens, lctx.mtp_op_type, gf)
        else:
            gf = lctx.prev.graph                         # "Reusing graph"
        lctx.llama_set_inputs(gf, u_batch)
        logits.append(lctx.graph_compute(gf).clone())
        reset_previous = kv.head == 0                    # the first graph of a recurrent model resets the state
        kv.head += u_batch.n_tokens
        if reset_previous:
            lctx.prev = None
    return logits


def llama_spec_ckpt_init(lctx, max_tokens):
    lctx.kv_self.save_per_step_ssm = False
    return "PER_STEP" if lctx.kv_self.per_step_alloc(max_tokens) else "NONE"   # spec_ckpt_try_per_step


def llama_spec_ckpt_save(lctx):
    lctx.kv_self.save_per_step_ssm = True                # (checkpoint_save's shadow copies: conv state, omitted)
    return True


def llama_spec_ckpt_restore(lctx, n_past, accepted_step):
    if not lctx.kv_self.per_step_restore(accepted_step):
        return False
    lctx.kv_self.seq_rm(n_past + accepted_step + 1)      # llama_kv_cache_seq_rm(kv, seq_id, accepted_pos + 1, -1)
    return True


def llama_spec_ckpt_discard(lctx):
    lctx.kv_self.save_per_step_ssm = False


# --- examples/server/server-context.cpp (reduced) ------------------------------------------------------------------

def save_speculative_checkpoint(lctx, n_drafted):
    return llama_spec_ckpt_init(lctx, n_drafted + 1) == "PER_STEP" and llama_spec_ckpt_save(lctx)


def restore_speculative_checkpoint(lctx, n_past, ids):
    llama_spec_ckpt_restore(lctx, n_past, len(ids) - 1)
    llama_spec_ckpt_discard(lctx)                        # discard_speculative_checkpoint


def common_speculative_gen_draft(model, last):
    """Stand-in drafter (the MTP head upstream): a fixed bigram table."""
    drafts = []
    for _ in range(N_DRAFT):
        last = model.draft_table[last]
        drafts.append(last)
    return drafts


def serve(model, device, graphs: bool):
    lctx = llama_context(model, device, graphs)
    prompt = torch.randint(0, N_VOCAB, (N_UBATCH + N_DRAFT + 1,), generator=generator(17)).tolist()
    outs = llama_decode_internal(lctx, llama_batch(prompt, range(len(prompt))))
    sampled, n_past, accepted = int(outs[-1][-1].argmax()), len(prompt), []
    for _ in range(N_SPEC_STEPS):
        drafts = common_speculative_gen_draft(model, sampled)
        ckpt_valid = save_speculative_checkpoint(lctx, len(drafts))
        batch = llama_batch([sampled] + drafts, range(n_past, n_past + len(drafts) + 1))
        logits = llama_decode_internal(lctx, batch)[0]
        outs.append(logits)
        ids = []                                         # common_sampler_sample_and_accept_n (greedy)
        for i in range(len(drafts) + 1):
            ids.append(int(logits[i].argmax()))
            if i == len(drafts) or ids[-1] != drafts[i]:
                break
        accepted.append(len(ids) - 1)
        if len(ids) - 1 < len(drafts) and ckpt_valid:
            restore_speculative_checkpoint(lctx, n_past, ids)
        else:
            lctx.kv_self.seq_rm(n_past + len(ids))
            llama_spec_ckpt_discard(lctx)
        n_past, sampled = n_past + len(ids), ids[-1]
    return outs + [torch.tensor(accepted, dtype=DTYPE)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    model = llama_model(device)
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: serve(model, device, True), lambda: serve(model, device, False))
