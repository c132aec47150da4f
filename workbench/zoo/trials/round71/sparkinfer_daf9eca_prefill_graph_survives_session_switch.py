"""The prefill graph survives a session switch: the next prompt ingest replays it through the previous session's block-table row and GDN state.

Upstream: https://github.com/gittensor-ai-lab/sparkinfer/commit/daf9ecaef89398137bf91466c37f5a880ee517a7
("fix(qwen35): drop the prefill graph on session switch, not just the decode graphs", on main, 2026-08-17; no
separate issue, the commit message carries the repro).
Symptom: deterministic, from the commit's new ``SPARKINFER_DSPARK_PREFIX_PROBE`` in dspark_tau_check: cache a
prefix, then generate three times over the same prompt. Before: g1 MATCH (32/32), g2 DIVERGED at token 0 (a
degenerate "\\n.\\n." loop), g3 MATCH again. After: 32/32 on all three.
Mechanism: runtime/src/models/qwen35.cpp. ``Qwen35Model::forward_token`` captures the PREFILL graph (embed -> layers
-> final norm, no LM head) on the first ``sample=false`` call and replays it for every later prompt token
(``if (!sample && s.graph_prefill_ready && !dflash_cap) cudaGraphLaunch(s.cu_prefill_exec)``); token, position and
seqlen come from ``d_scalars``, but every attention node has ``btable = s.kv->block_table(s.active_seq_id)`` baked in
as a literal argument, and the linear (Gated-DeltaNet) layers the session's ``s.lin_state`` pointer. The prefill
graph is normally dropped in the ``sample && s.graph_prefill_ready`` branch, but a ``sample=true`` call that can
replay a ready DECODE graph returns early above that drop. ``activate_session(seq_id)`` swaps the per-session
pointers on the host and calls ``invalidate_decode_graph()`` to mean "the session under the graphs moved"; before
the fix that tore down only ``cu_exec`` (decode) and ``cu_dflash_exec``. Probe: ``cache_prefix(pfx)`` ingests the
prefix into session 0 and leaves its decode graph ready; g1 (prefix reuse, session 0) captures a prefill graph for
the prompt tail, whose last token replays the decode graph and returns early, so the prefill graph outlives
``release_prefix_session()``. g2 (prefix no longer active: a fresh ``open_session``) replays that graph for every
prompt token: it advances session 0's GDN state (still holding g1's sequence) instead of the new session's
(zeroed at position 0 and never advanced), and appends K/V computed from it through session 0's block-table row.
The decode graph captured at g2's last prompt token binds the new session's pointers and decodes from a wrong
state: g2 diverges at token 0. g2's own last prompt token takes the drop, so g3 is right again. Eager reads the
current ``btable`` and ``s.lin_state`` on every call.
Doctor: warmup-divergence, at invalidate_decode_graph (the prefill graph's capture chose the active session's
block-table row and GDN-state buffer as kernel arguments; after activate_session switches sessions, an eager prompt
ingest uses the new session's, but invalidate_decode_graph leaves the prefill graph standing, so its replays keep
reading and advancing the capture-time session's state).
Fix (upstream): ``invalidate_decode_graph()`` also destroys the prefill graph when ``s.graph_prefill_ready``
(``cudaGraphExecDestroy``/``cudaGraphDestroy``, ``graph_prefill_ready = false``, ``graph_prefill_attn_mode = -1``),
so the next prompt ingest recaptures with the new session's pointers.
Modelled: a 2-layer hybrid Qwen3.5 (layer 0 a linear layer with a per-session recurrent ``lin_state`` vector
updated in place, layer 1 full attention over the paged KV pool), H 8, vocab 16, fp32, greedy argmax sampling (no
penalties/logit bias/top-k). ``KVCacheManager`` keeps the upstream free list, LIFO slot list and one device
``d_block_tables`` array whose row is ``block_table(seq_id)``. Only the token-loop prefill (batched GEMM prefill not
eligible), no adaptive n_splits / attn-mode / sparse / dflash / debug recapture branches, no ``lin_conv_state``,
penalty or logit-bias buffers. As upstream, the freed slot-0 row goes straight to g2's session (LIFO), so the
stale ``btable`` happens to name the new session's row here; the stale ``lin_state`` is what diverges (and the K/V
appended through the row is computed from it). ``cudaStreamBeginCapture``/``cudaGraphLaunch`` are the kit's
``capture``/``replay``; the capture is launched right after instantiation, as upstream.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/gittensor-ai-lab/sparkinfer/commit/daf9ecaef89398137bf91466c37f5a880ee517a7"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "invalidate_decode_graph"
SYMPTOM = ("after a session switch the surviving prefill graph ingests the new prompt through the old session's "
           "block table and GDN state; the generation diverges at token 0")

HIDDEN, VOCAB, BLOCK_SIZE, MAX_SEQ = 8, 16, 4, 16
K_MAX_SEQS, K_MAX_BLOCKS_PER_SEQ, TOTAL_BLOCKS = 8, MAX_SEQ // BLOCK_SIZE, 16
LIN_DECAY, RMS_EPS = 0.6, 1e-6
PROMPT_LEN, MAX_NEW = 8, 6


# --- runtime/src/kv_cache.cpp ---------------------------------------------------------------------

class KVCacheManager:
    """Paged KV pool: free list of block ids, one row of ``d_block_tables`` per sequence slot."""

    def __init__(self, device):
        self.k_pool = torch.zeros(TOTAL_BLOCKS, BLOCK_SIZE, HIDDEN, device=device)
        self.v_pool = torch.zeros(TOTAL_BLOCKS, BLOCK_SIZE, HIDDEN, device=device)
        self.d_block_tables = torch.zeros(K_MAX_SEQS, K_MAX_BLOCKS_PER_SEQ, dtype=torch.long, device=device)
        self.free_list = list(range(TOTAL_BLOCKS - 1, -1, -1))
        self.free_slots = list(range(K_MAX_SEQS - 1, -1, -1))
        self.seq_blocks: dict[int, list[int]] = {}
        self.seq_slot: dict[int, int] = {}

    def allocate(self, seq_id, num_tokens):
        need = -(-num_tokens // BLOCK_SIZE)
        if need > K_MAX_BLOCKS_PER_SEQ:
            return False
        blocks = self.seq_blocks.setdefault(seq_id, [])
        if len(blocks) >= need:
            return seq_id in self.seq_slot
        if len(self.free_list) < need - len(blocks):
            return False
        if seq_id not in self.seq_slot:
            if not self.free_slots:
                return False
            self.seq_slot[seq_id] = self.free_slots.pop()
        while len(blocks) < need:
            blocks.append(self.free_list.pop())
        slot = self.seq_slot[seq_id]                      # cudaMemcpy H2D of the row
        self.d_block_tables[slot, : len(blocks)].copy_(torch.tensor(blocks, dtype=torch.long))
        return True

    def allocated_tokens(self, seq_id):
        return len(self.seq_blocks.get(seq_id, ())) * BLOCK_SIZE

    def free(self, seq_id):
        for b in self.seq_blocks.pop(seq_id, ()):
            self.free_list.append(b)
        if seq_id in self.seq_slot:
            self.free_slots.append(self.seq_slot.pop(seq_id))

    def block_table(self, seq_id):
        slot = self.seq_slot.get(seq_id)
        return None if slot is None else self.d_block_tables[slot]


# --- runtime/src/models/qwen35.cpp ----------------------------------------------------------------

class SessionBuffers:
    def __init__(self, lin_state):
        self.lin_state = lin_state


class Weights:
    def __init__(self, gen, device):
        def w(*shape, scale=0.5):
            return (torch.randn(*shape, generator=gen) * scale).to(device)
        self.embed_tokens = w(VOCAB, HIDDEN, scale=1.0)
        self.lin_norm, self.lin_in, self.lin_out = 1 + w(HIDDEN, scale=0.1), w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN)
        self.input_norm = 1 + w(HIDDEN, scale=0.1)
        self.wq, self.wk, self.wv, self.wo = (w(HIDDEN, HIDDEN) for _ in range(4))
        self.final_norm = 1 + w(HIDDEN, scale=0.1)
        self.lm_head = w(HIDDEN, VOCAB, scale=1.0)


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * w


class Impl:
    def __init__(self, gen, device, use_cuda_graphs):
        self.device, self.use_cuda_graphs = device, use_cuda_graphs
        self.w = Weights(gen, device)
        self.kv = KVCacheManager(device)
        self.d_scalars = torch.zeros(4, dtype=torch.long, device=device)    # token, position, -, seqlen
        self.x = torch.zeros(1, HIDDEN, device=device)
        self.xn = torch.zeros(1, HIDDEN, device=device)
        self.logits = torch.zeros(1, VOCAB, device=device)
        self.d_out_id = torch.zeros(1, dtype=torch.long, device=device)
        # session 0 uses the model's persistent default buffers
        self.lin_state_default = torch.zeros(1, HIDDEN, device=device)
        self.sessions = {0: SessionBuffers(self.lin_state_default)}
        self.lin_state = self.lin_state_default
        self.active_seq_id = 0
        self.next_session_id = 1
        self.cu_exec = self.cu_exec_out = None
        self.graph_ready = False
        self.cu_prefill_exec = self.cu_prefill_out = None
        self.graph_prefill_ready = False
        self.graph_prefill_attn_mode = -1
        self.prefix_tokens, self.prefix_len, self.prefix_next, self.prefix_active = [], 0, -1, False


class Qwen35Model:
    def __init__(self, gen, device, variant, use_cuda_graphs=True):
        self.p_ = Impl(gen, device, use_cuda_graphs)
        self.variant = variant

    # --- the per-token forward --------------------------------------------------------------------
    def forward_token(self, token_id, position, sample):
        s = self.p_
        seqlen = position + 1
        s.d_scalars.copy_(torch.tensor([token_id, position, position, seqlen]))   # decode scalars (H2D)
        if position == 0:                                                          # hybrid: linear state reset
            s.lin_state.zero_()

        def step():
            w = s.w
            s.x.copy_(w.embed_tokens.index_select(0, s.d_scalars[0:1]))            # launch_embedding(s.d_tok)
            # layer 0: linear (Gated-DeltaNet) layer, recurrent state of the active session
            lin_state = s.lin_state
            h = rmsnorm(s.x, w.lin_norm)
            lin_state.mul_(LIN_DECAY).add_(torch.tanh(h @ w.lin_in))
            s.x.add_(lin_state @ w.lin_out)
            # layer 1: full attention through the active session's block-table row
            btable = s.kv.block_table(s.active_seq_id)
            h = rmsnorm(s.x, w.input_norm)
            q, k, v = h @ w.wq, h @ w.wk, h @ w.wv
            pos = s.d_scalars[1:2]
            blk = btable.index_select(0, torch.div(pos, BLOCK_SIZE, rounding_mode="floor"))
            off = torch.remainder(pos, BLOCK_SIZE)
            s.kv.k_pool.index_put_((blk, off), k)                                   # append K/V at position
            s.kv.v_pool.index_put_((blk, off), v)
            j = torch.arange(MAX_SEQ, device=s.x.device)
            phys = btable.index_select(0, torch.div(j, BLOCK_SIZE, rounding_mode="floor"))
            keys = s.kv.k_pool[phys, torch.remainder(j, BLOCK_SIZE)]
            vals = s.kv.v_pool[phys, torch.remainder(j, BLOCK_SIZE)]
            scores = (q @ keys.t()) * HIDDEN ** -0.5
            scores = scores.masked_fill(j.view(1, -1) >= s.d_scalars[3:4].view(1, 1), float("-inf"))
            s.x.add_(torch.softmax(scores, dim=-1) @ vals @ w.wo)
            s.xn.copy_(rmsnorm(s.x, w.final_norm))
            if not sample:
                return s.xn
            s.logits.copy_(s.xn @ w.lm_head)
            s.d_out_id.copy_(s.logits.argmax(-1))
            return s.d_out_id

        def graph_state():
            return {"k_pool": s.kv.k_pool, "v_pool": s.kv.v_pool,
                    "block_table": s.kv.block_table(s.active_seq_id), "lin_state": s.lin_state}

        if not s.use_cuda_graphs:
            step()
            return int(s.d_out_id.item()) if sample else token_id

        if not sample and s.graph_prefill_ready:
            replay(s.cu_prefill_exec, s.cu_prefill_out)                            # prefill graph launch
            return token_id
        if sample and s.graph_ready:
            out = replay(s.cu_exec, s.cu_exec_out)                                 # decode graph launch
            return int(out.item())
        if sample and s.graph_prefill_ready:                                       # drop prefill graph for decode
            s.cu_prefill_exec = s.cu_prefill_out = None
            s.graph_prefill_ready = False
            s.graph_prefill_attn_mode = -1

        g, out = capture(step, device=s.device, warmups=0,
                         name="decode graph" if sample else "prefill graph",
                         static={"d_scalars": s.d_scalars}, state=graph_state(),
                         owner="Qwen35Model::forward_token")
        if not sample:
            s.cu_prefill_exec, s.cu_prefill_out = g, out
            s.graph_prefill_ready = True
            s.graph_prefill_attn_mode = 0
            replay(g, out)                                                         # prefill graph launch (first)
            return token_id
        s.cu_exec, s.cu_exec_out = g, out
        s.graph_ready = True
        out = replay(g, out)                                                       # graph launch (first)
        return int(out.item())

    def invalidate_decode_graph(self):
        s = self.p_
        if s.graph_ready:
            s.cu_exec = s.cu_exec_out = None                                       # cudaGraphExecDestroy/Destroy
            s.graph_ready = False
        if self.variant == "fix" and s.graph_prefill_ready:
            s.cu_prefill_exec = s.cu_prefill_out = None
            s.graph_prefill_ready = False
            s.graph_prefill_attn_mode = -1

    # --- sessions -----------------------------------------------------------------------------------
    def open_session(self, num_tokens):
        s = self.p_
        seq_id = s.next_session_id
        s.next_session_id += 1
        if not s.kv.allocate(seq_id, num_tokens):
            return 0
        s.sessions[seq_id] = SessionBuffers(torch.zeros(1, HIDDEN, device=s.device))
        return seq_id

    def close_session(self, seq_id):
        s = self.p_
        if seq_id == 0:
            return
        s.kv.free(seq_id)
        s.sessions.pop(seq_id, None)                                               # cudaFree(lin_state)
        if s.active_seq_id == seq_id:
            self.activate_session(0)

    def activate_session(self, seq_id):
        s = self.p_
        if s.active_seq_id == seq_id:
            return
        s.active_seq_id = seq_id
        buf = s.sessions.get(seq_id)
        if buf is not None:
            s.lin_state = buf.lin_state
        self.invalidate_decode_graph()

    # --- prompt ingest and prefix cache ---------------------------------------------------------------
    def ingest_prompt_range(self, ids, start, end):
        nxt = -1
        for i in range(start, end):
            sample = i + 1 == end
            r = self.forward_token(ids[i], i, sample)
            if sample:
                nxt = r
        return nxt

    def prompt_matches_prefix(self, prompt):
        s = self.p_
        return s.prefix_active and s.prefix_len > 0 and list(prompt[: s.prefix_len]) == s.prefix_tokens

    def cache_prefix(self, tokens):
        s = self.p_
        self.clear_prefix_cache()
        self.invalidate_decode_graph()
        if not s.kv.allocate(s.active_seq_id, MAX_SEQ):
            return False
        nxt = self.ingest_prompt_range(tokens, 0, len(tokens))
        s.prefix_tokens, s.prefix_len, s.prefix_next, s.prefix_active = list(tokens), len(tokens), nxt, True
        return True

    def clear_prefix_cache(self):
        s = self.p_
        if s.prefix_active or s.kv.allocated_tokens(s.active_seq_id) > 0:
            s.kv.free(s.active_seq_id)
            self.invalidate_decode_graph()
        s.prefix_tokens, s.prefix_len, s.prefix_next, s.prefix_active = [], 0, -1, False

    def release_prefix_session(self):
        s = self.p_
        s.prefix_next = -1
        s.prefix_active = False
        self.invalidate_decode_graph()

    def generate(self, prompt, max_new):
        s = self.p_
        reuse = self.prompt_matches_prefix(prompt)
        budget = len(prompt) + max_new
        if not reuse:
            self.clear_prefix_cache()
            self.invalidate_decode_graph()
            sid = self.open_session(budget)
            self.activate_session(sid)
        else:
            sid = s.active_seq_id
            s.kv.allocate(sid, budget)
            self.activate_session(sid)
        start = s.prefix_len if reuse else 0
        nxt = s.prefix_next if (reuse and start >= len(prompt)) else \
            self.ingest_prompt_range(prompt, start, len(prompt))
        out = []
        for i in range(max_new):
            out.append(nxt)
            nxt = self.forward_token(nxt, len(prompt) + i, True)
        if sid != 0:
            self.close_session(sid)
        else:
            s.kv.free(sid)
            if reuse:
                self.release_prefix_session()
        return out


# --- runtime/examples/dspark_tau_check.cpp: SPARKINFER_DSPARK_PREFIX_PROBE ---------------------------

def run(variant: str, device: str = "cpu"):
    gen = generator(0xDAF9EC)
    weights_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen).tolist()

    def serve(graphed: bool):
        model = Qwen35Model(generator(weights_seed), device, variant, use_cuda_graphs=graphed)
        ar = model.generate(prompt, MAX_NEW)                       # the plain AR reference
        outs = [ar]
        model.cache_prefix(prompt[: len(prompt) // 2])
        for _ in range(3):                                         # g1, g2, g3 over the same prompt
            outs.append(model.generate(prompt, MAX_NEW))
        return [torch.tensor(o, dtype=torch.float32) for o in outs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
