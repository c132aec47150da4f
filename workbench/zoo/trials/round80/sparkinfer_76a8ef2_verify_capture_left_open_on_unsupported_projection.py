"""DFlash's verify graph capture is left open when ``dflash_verify_short_run`` bails out on an unsupported projection; the stream stays capturing and the token-loop fallback's first readback fails.

Upstream: https://github.com/gittensor-ai-lab/sparkinfer/commit/76a8ef2b6b0d78e52f8ba2dfb57e468ccab21781
("fix(dflash): end the CUDA capture on every early return from verify", a direct commit on main, 2026-08-17).
Symptom: DSpark (DFlash speculative decoding) on a compressed-tensors Qwen3.8 checkpoint emitted one repeated
token. The log showed "draft sync: operation not permitted when stream is capturing" and, first of all,
"operation failed due to a previous error during capture". A shape the fast verify merely does not support
looked like model corruption instead of a lost optimisation.
Mechanism: ``Qwen35Model::dflash_generate`` (``runtime/src/models/qwen35.cpp``) builds the verify replay graph
before the decode clock starts: ``dflash_warm_verify`` calls ``dflash_verify_short_run(..., capture_only=true)``
(``runtime/src/models/qwen35_prefill.cpp``). That function begins a stream capture on the model's stream
(``cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal)``, "verify graph begin") and records the verify
forward layer by layer. Its projection helpers drive only types 0/8/12/14 (``proj`` also FP8, row by row;
``proj_on``, the forked small projections, not even that). Every GDN layer of a compressed-tensors checkpoint
is SI_QTYPE_FP8 (108) or NVFP4 (109), so layer 0's ``wqkv_gate`` sets ``supported = false`` and the function
``return -1``s: the capture is never ended (the unsupported-LM-head bail-out is the same). Only
``cudaStreamEndCapture`` leaves the capturing state, so the stream stays capturing for good. ``dflash_generate``
ignores the warm-up's result and runs the token loop, as it should for an unsupported fast path, on that same
stream: verify token 0 (``forward_token``, deferred) is recorded into the dangling capture instead of running,
and the draft's readback of its proposals (a device-to-host copy and a stream sync) is refused, "operation not
permitted when stream is capturing"; so is every later readback, and the capture is invalidated. Without the
verify graph no capture is opened, the bail-out just returns -1 and the token loop serves correctly.
Doctor: sync-in-capture, at dflash_verify_short_run. A host synchronisation (the fallback's readback of the
draft's token ids) is attempted while a capture is open. The capture is open only because
``dflash_verify_short_run`` began it and returned early without ending it, so the bug lives there, and that is
where the fix changed code.
Fix (upstream): an ``abandon_capture()`` helper, declared before the first bail-out, ends the capture
(``cudaStreamEndCapture``), destroys the partial graph without instantiating it (it was recorded mid-layer and
is no replayable program), clears the error on failure and sets ``recording = false``. Both early returns
(unsupported projection, unsupported LM head) call it first.
Modelled: a 2-layer hybrid (a GDN linear-attention layer with a [D, D] recurrent state, then a dense FFN),
greedy sampling, no full-attention layers or KV cache. The quantised weights are float tensors that carry
their ``*_type`` tag; the GDN projections of the checkpoint are tagged SI_QTYPE_FP8. The prompt is prefilled
with the token loop (upstream: ``prefill_batched_run``). ``forward_token`` runs eagerly (upstream replays a
decode graph) and reads its argmax with ``.item()`` (a copy into pinned memory and a stream sync); upstream
prints CUDA errors and goes on, so its output degenerates, while torch raises the same error. The DFlash draft
is a small recurrent drafter sharing the target's embedding and LM head (upstream: a block-diffusion drafter
on its own stream); it reads its proposals back with ``.tolist()``. The verify keeps the upstream flow (the
thread-local graph state, the verify arena held across calls, pinned per-step inputs, the replay path, the
commit of the accepted prefix into the live GDN state outside the graph) with one projection per kind; the
MoE, the stream forks, the KV block table and the int8 head are left out. A graphs-off switch
(``cuda_graphs``) stands for the same workload with no capture. The workload's checkpoint never reaches the
verify's supported path, and its draft never lands a full block, so every step stays on the token loop.
Process exit (which destroys the CUDA context, and the stranded capture with it) is modelled by
``Qwen35Model.close``, which ends whatever capture the stream still holds.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import events, graph, host, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/gittensor-ai-lab/sparkinfer/commit/76a8ef2b6b0d78e52f8ba2dfb57e468ccab21781"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "dflash_verify_short_run"
SYMPTOM = ("DSpark on a compressed-tensors (FP8 GDN) Qwen3.8 checkpoint: 'operation not permitted when stream is "
           "capturing' at the draft's readback, then garbage output: the verify capture stays open after the "
           "unsupported-projection bail-out")

VOCAB, HIDDEN, LIN_HEAD_DIM, FFN = 24, 8, 4, 12
N_LAYERS = 2                       # layer 0: GDN (linear_attn), layer 1: dense FFN
SI_QTYPE_FP8, SI_QTYPE_NVFP4 = 108, 109
RMS_EPS = 1e-6
K_PROPOSAL_DEPTH = 3               # block B = depth + 1
K_BLOCK_SCORE = 1                  # full-block accepts before the batched verify engages (kBlockScore)
K_DFLASH_DEFERRED = -2             # forward_token's "sampled id not collected yet"
DFLASH_CAPTURE_LAYER = 0           # the target layer whose hidden state the draft conditions on


def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * w


# --- weights ---------------------------------------------------------------------------------------------------

class Qwen35LayerWeights:
    def __init__(self, layer: int, gen, device, gdn_type: int):
        self.linear_attn = layer == 0
        self.input_norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        if self.linear_attn:
            self.wqkv = randn(HIDDEN, 3 * LIN_HEAD_DIM, gen=gen, device=device, scale=0.5)
            self.wqkv_gate = randn(HIDDEN, LIN_HEAD_DIM, gen=gen, device=device, scale=0.5)
            self.ssm_a = randn(LIN_HEAD_DIM, gen=gen, device=device)
            self.wo = randn(LIN_HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5)
            self.wqkv_type = self.wqkv_gate_type = gdn_type       # compressed-tensors: FP8 GDN projections
        else:
            self.w_up = randn(HIDDEN, FFN, gen=gen, device=device, scale=0.4)
            self.w_down = randn(FFN, HIDDEN, gen=gen, device=device, scale=0.4)
            self.w_up_type = self.w_down_type = 14                 # Q6_K


class Qwen35Weights:
    def __init__(self, gen, device, gdn_type: int):
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_freqs = randn(HIDDEN, gen=gen, device=device)
        self.layers = [Qwen35LayerWeights(layer, gen, device, gdn_type) for layer in range(N_LAYERS)]
        self.final_norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.lm_head_type = 12                                     # Q4_K


def embed(w, ids, pos):
    """Token embedding plus a sinusoidal position term (rows ``ids`` at positions ``pos``)."""
    return w.embed_tokens.index_select(0, ids) + torch.sin(pos.to(torch.float32)[:, None] * w.pos_freqs)


def gdn_row(xn_row, w, state):
    """One token of the gated delta-rule layer from ``state`` [D, D]: the new state and the output row."""
    q, k, v = (xn_row @ w.wqkv).split(LIN_HEAD_DIM)
    z = xn_row @ w.wqkv_gate
    state = torch.sigmoid(w.ssm_a)[:, None] * state + torch.outer(torch.tanh(k), v)
    return state, ((q @ state) * torch.sigmoid(z)) @ w.wo


# --- runtime/src/models/qwen35_prefill.cpp: the exact short-block DFlash verifier ------------------------------

class Qwen35PrefillCtx:
    def __init__(self, model: "Qwen35Model"):
        self.cfg_cuda_graphs = model.cuda_graphs
        self.w, self.lin_state, self.device = model.w, model.lin_state, model.device


class _VerifyArena:
    """``static thread_local Arena verify_arena``: scratch held across calls (the graph keeps its addresses)."""

    def __init__(self, n: int, device):
        self.n = n
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.pos = torch.zeros(n, dtype=torch.long, device=device)
        self.x = torch.zeros(n, HIDDEN, device=device)
        self.xn = torch.zeros(n, HIDDEN, device=device)
        self.rq = torch.zeros(n, 3 * LIN_HEAD_DIM, device=device)
        self.lz = torch.zeros(n, LIN_HEAD_DIM, device=device)
        self.rec_k = torch.zeros(N_LAYERS, n, LIN_HEAD_DIM, device=device)
        self.rec_v = torch.zeros(N_LAYERS, n, LIN_HEAD_DIM, device=device)
        self.logits = torch.zeros(n, VOCAB, device=device)
        self.out_ids = torch.zeros(n, dtype=torch.long, device=device)


class _VerifyThreadLocal:
    """The function's ``static thread_local`` graph state."""

    def __init__(self):
        self.ph_ids = None                       # pinned per-step token ids and positions, copied in by the graph
        self.ph_pos = None
        self.arena = None
        self.verify_graph = None                 # the captured graph (verify_graph / verify_exec)
        self.capture = None                      # the open stream capture, between begin and end
        self.graph_warm = False
        self.graph_ready = False
        self.graph_state_key = None
        self.graph_n_key = -1


_TL = _VerifyThreadLocal()
_VARIANT = {"value": "bug"}


def dflash_verify_short_run(s: Qwen35PrefillCtx, token_ids: list, n: int, start_pos: int,
                            out_argmax: list, capture_only: bool = False) -> int:
    """Verify ``n`` candidate rows from the live hybrid state; commit the accepted prefix. -1: unsupported."""
    tl, N, dev = _TL, n, s.device
    if not token_ids or n < 1 or n > 8:
        return -1
    if tl.arena is None or tl.arena.n != N:
        tl.arena = _VerifyArena(N, dev)
    a = tl.arena
    if tl.ph_ids is None:
        tl.ph_ids = host(torch.zeros(8, dtype=torch.long), dev)          # cudaHostAlloc "verify host ids"
        tl.ph_pos = host(torch.zeros(8, dtype=torch.long), dev)          # "verify host pos"
    tl.ph_ids[:N] = torch.tensor(token_ids[:N], dtype=torch.long)
    tl.ph_pos[:N] = torch.arange(start_pos, start_pos + N, dtype=torch.long)
    w = s.w

    def proj(xin, weight, qtype, out) -> bool:
        if qtype == 0:
            out.copy_(xin @ weight)                                     # launch_gemv_rows
            return True
        if qtype == SI_QTYPE_FP8:                                       # launch_gemv_fp8, one row at a time
            for r in range(N):
                out[r].copy_(xin[r] @ weight)
            return True
        if qtype not in (8, 12, 14):
            print(f"[dflash-verify] unsupported projection type={qtype} N={out.shape[1]} K={xin.shape[1]}")
            return False
        out.copy_(xin @ weight)                                         # quant_rows + launch_mmvq_rows
        return True

    def proj_on(xin, weight, qtype, out) -> bool:                       # proj() on the forked stream
        if qtype == 0:
            out.copy_(xin @ weight)
            return True
        if qtype not in (8, 12, 14):
            return False
        out.copy_(xin @ weight)
        return True

    supported = True
    recording = False

    def abandon_capture():
        """#76a8ef2: end the capture and destroy the partial graph, never instantiating it."""
        nonlocal recording
        if not recording:
            return
        capture, tl.capture = tl.capture, None
        abandoned = RuntimeError("verify capture abandoned: unsupported shape")
        capture.__exit__(type(abandoned), abandoned, None)              # cudaStreamEndCapture + cudaGraphDestroy
        tl.verify_graph = None
        recording = False

    if tl.graph_state_key is not s.lin_state or tl.graph_n_key != N:
        tl.verify_graph, tl.graph_ready, tl.graph_warm = None, False, False
        tl.graph_state_key, tl.graph_n_key = s.lin_state, N
    if tl.graph_ready and capture_only:
        return 0                                                        # already built
    if tl.graph_ready:
        replay(tl.verify_graph, a.out_ids)                              # "verify graph launch"
        out_argmax[:N] = a.out_ids.tolist()                             # "verify graph sync"
    else:
        recording = s.cfg_cuda_graphs and (tl.graph_warm or capture_only)
        if recording:                                                   # "verify graph begin"
            events.static_buffers("dflash_verify_short_run", {"ph_ids": tl.ph_ids, "ph_pos": tl.ph_pos})
            events.persistent_state("dflash_verify_short_run", {"lin_state": s.lin_state})
            tl.verify_graph = new_graph(str(dev))
            tl.capture = contextlib.ExitStack()
            tl.capture.enter_context(graph(tl.verify_graph, name=f"dflash verify N={N}",
                                           capture_error_mode="thread_local"))
        a.ids.copy_(tl.ph_ids[:N], non_blocking=True)                   # "verify ids"
        a.pos.copy_(tl.ph_pos[:N], non_blocking=True)                   # "verify pos"
        a.x.copy_(embed(w, a.ids, a.pos))
        a.xn.copy_(rmsnorm(a.x, w.layers[0].input_norm))
        for L in range(N_LAYERS):
            lw = w.layers[L]
            if lw.linear_attn:
                supported = proj(a.xn, lw.wqkv, lw.wqkv_type, a.rq)
                supported = supported and proj_on(a.xn, lw.wqkv_gate, lw.wqkv_gate_type, a.lz)
                if not supported:
                    break
                q, k, v = a.rq.split(LIN_HEAD_DIM, dim=1)
                a.rec_k[L].copy_(torch.tanh(k))
                a.rec_v[L].copy_(v)
                state = s.lin_state[L]                                  # read, never written, by the verify
                decay = torch.sigmoid(lw.ssm_a)[:, None]
                rows = []
                for r in range(N):                                      # launch_dflash_gdn_scan_compact
                    state = decay * state + torch.outer(a.rec_k[L, r], a.rec_v[L, r])
                    rows.append((q[r] @ state) * torch.sigmoid(a.lz[r]))
                a.x.add_(torch.stack(rows) @ lw.wo)
            else:
                a.x.add_(torch.relu(a.xn @ lw.w_up) @ lw.w_down)
            nxt = w.layers[L + 1].input_norm if L + 1 < N_LAYERS else w.final_norm
            a.xn.copy_(rmsnorm(a.x, nxt))
        if not supported:
            if _VARIANT["value"] == "fix":
                abandon_capture()
            return -1          # bug: a bare return leaves the stream in cudaStreamCaptureStatusActive for good
        head_ok = w.lm_head_type in (8, 12, 14)
        if not head_ok:
            print(f"[dflash-verify] unsupported LM head type={w.lm_head_type} H={HIDDEN}")
            if _VARIANT["value"] == "fix":
                abandon_capture()
            return -1
        a.logits.copy_(a.xn @ w.lm_head)
        a.out_ids.copy_(a.logits.argmax(-1))                            # launch_argmax
        if recording:
            capture, tl.capture = tl.capture, None
            capture.close()                                             # "verify graph end" + instantiate
            tl.graph_ready = tl.graph_warm = True
            if capture_only:
                return 0
            replay(tl.verify_graph, a.out_ids)                          # "verify graph first launch"
        out_argmax[:N] = a.out_ids.tolist()                             # "verify sync"
        tl.graph_warm = True
    keep = 1                                                            # verify_forward_done:
    while keep < N and token_ids[keep] == out_argmax[keep - 1]:
        keep += 1
    for L in range(N_LAYERS):                                           # commit outside the graph
        if w.layers[L].linear_attn:
            decay = torch.sigmoid(w.layers[L].ssm_a)[:, None]
            for r in range(keep):
                s.lin_state[L].mul_(decay).add_(torch.outer(a.rec_k[L, r], a.rec_v[L, r]))
    return keep


# --- the DFlash draft --------------------------------------------------------------------------------------------

class DFlashDraftModel:
    """Proposes a block from the target's captured hidden rows; shares the target's embedding and LM head."""

    def __init__(self, w: Qwen35Weights, gen, device):
        self.w = w
        self.w_ctx = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.w_rec = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.ctx = torch.zeros(HIDDEN, device=device)                  # the draft's context (its KV, upstream)
        self.h_block = host(torch.zeros(1, dtype=torch.long), device)
        self.d_block = torch.zeros(1, dtype=torch.long, device=device)

    def forward_block(self, target_hidden, th_len: int, block: list, start: int, out_ids: list,
                      depth: int) -> bool:
        for r in range(th_len):                                         # append the newly accepted rows
            self.ctx = torch.tanh(self.ctx @ self.w_rec + target_hidden[r] @ self.w_ctx)
        self.h_block[0] = block[0]
        self.d_block.copy_(self.h_block, non_blocking=True)
        h, tok, toks = self.ctx, self.d_block, []
        for _ in range(depth):
            h = torch.tanh(h @ self.w_rec + self.w.embed_tokens.index_select(0, tok)[0])
            tok = (rmsnorm(h, self.w.final_norm) @ self.w.lm_head).argmax(-1, keepdim=True)
            toks.append(tok)
        ids = torch.cat(toks).tolist()                                  # "draft sync": D2H + stream sync
        out_ids[1:depth + 1] = ids
        return True

    def reset(self) -> None:
        self.ctx = torch.zeros_like(self.ctx)


# --- runtime/src/models/qwen35.cpp ---------------------------------------------------------------------------------

class Qwen35Model:
    def __init__(self, device, *, cuda_graphs: bool, gdn_type: int = SI_QTYPE_FP8):
        gen = generator(76082)
        self.device, self.cuda_graphs = device, cuda_graphs
        self.w = Qwen35Weights(gen, device, gdn_type)
        self.lin_state = torch.zeros(N_LAYERS, LIN_HEAD_DIM, LIN_HEAD_DIM, device=device)
        self.h_scalars = host(torch.zeros(2, dtype=torch.long), device)
        self.d_scalars = torch.zeros(2, dtype=torch.long, device=device)
        self.d_out_id = torch.zeros(1, dtype=torch.long, device=device)
        self.dflash_hidden = torch.zeros(K_PROPOSAL_DEPTH + 1, HIDDEN, device=device)
        self.dflash_capture_dst = None
        self.dflash_cap_row = 0
        self.defer_decode_sync = self.decode_pending = False
        self.dflash_draft = DFlashDraftModel(self.w, gen, device)

    def set_dflash_capture(self, dst) -> None:
        self.dflash_capture_dst = dst

    def set_dflash_capture_row(self, row: int) -> None:
        self.dflash_cap_row = row

    def forward_token(self, token_id: int, position: int) -> int:
        """One AR decode step (greedy). Returns the sampled id, or K_DFLASH_DEFERRED."""
        self.h_scalars[0], self.h_scalars[1] = token_id, position
        self.d_scalars.copy_(self.h_scalars, non_blocking=True)         # "decode scalars"
        x = embed(self.w, self.d_scalars[:1], self.d_scalars[1:])[0]
        for L, lw in enumerate(self.w.layers):
            xn = rmsnorm(x, lw.input_norm)
            if lw.linear_attn:
                state, out = gdn_row(xn, lw, self.lin_state[L])
                self.lin_state[L].copy_(state)
                x = x + out
            else:
                x = x + torch.relu(xn @ lw.w_up) @ lw.w_down
            if self.dflash_capture_dst is not None and L == DFLASH_CAPTURE_LAYER:
                self.dflash_capture_dst[self.dflash_cap_row].copy_(x)
        self.d_out_id.copy_((rmsnorm(x, self.w.final_norm) @ self.w.lm_head).argmax(-1, keepdim=True))
        if self.defer_decode_sync:
            self.decode_pending = True
            return K_DFLASH_DEFERRED
        return int(self.d_out_id.item())                                # h_out_id copy + cudaStreamSynchronize

    def dflash_warm_verify(self, n: int, start_pos: int) -> None:
        if not self.cuda_graphs:
            return                                                      # graphs off: no replay graph to build
        ctx = Qwen35PrefillCtx(self)
        dflash_verify_short_run(ctx, [0] * n, n, start_pos, [0] * n, capture_only=True)

    def batched_forward(self, token_ids: list, n: int, start_pos: int, out_argmax: list) -> bool:
        return dflash_verify_short_run(Qwen35PrefillCtx(self), token_ids, n, start_pos, out_argmax) > 0

    def dflash_generate(self, prompt: list, max_new: int) -> list:
        draft, B, depth = self.dflash_draft, K_PROPOSAL_DEPTH + 1, K_PROPOSAL_DEPTH
        prompt_hidden = torch.zeros(len(prompt), HIDDEN, device=self.device)   # the full-context capture
        self.set_dflash_capture(prompt_hidden)
        nxt = -1
        for i, tok in enumerate(prompt):                                # prefill
            self.set_dflash_capture_row(i)
            nxt = self.forward_token(tok, i)
        self.set_dflash_capture(self.dflash_hidden)
        start, target_hidden, th_len = len(prompt), prompt_hidden, len(prompt)
        th_scratch = torch.zeros_like(self.dflash_hidden)
        out, compact_score = [], 0
        block, posterior, draft_ids = [0] * B, [0] * B, [0] * B
        # Build the verify replay graph before the decode clock starts (its result is not looked at).
        self.dflash_warm_verify(depth + 1, start)
        while len(out) < max_new:
            compact_verify = compact_score >= K_BLOCK_SCORE
            block[0] = nxt
            block[1:] = [VOCAB - 1] * (B - 1)                           # mask_token_id
            draft_hidden = target_hidden
            if not compact_verify and target_hidden is self.dflash_hidden:
                th_scratch[:th_len].copy_(target_hidden[:th_len])       # "dflash overlap stash"
                draft_hidden = th_scratch
            p0 = -1
            if not compact_verify:
                self.set_dflash_capture_row(0)
                self.defer_decode_sync = True
                p0 = self.forward_token(block[0], start)
                self.defer_decode_sync = False
            draft_ok = draft.forward_block(draft_hidden, th_len, block, start, draft_ids, depth)
            if not compact_verify and p0 == K_DFLASH_DEFERRED:
                p0 = int(self.d_out_id.item())                          # "verify0 sync"
                self.decode_pending = False
            if not draft_ok:
                break
            block[1:depth + 1] = draft_ids[1:depth + 1]
            accept, keep, vfail = 0, 1, False
            if compact_verify:
                vfail = not self.batched_forward(block, depth + 1, start, posterior)
                if not vfail:
                    while accept < depth and block[accept + 1] == posterior[accept]:
                        accept += 1
                    keep = accept + 1
            else:
                vfail = p0 < 0
                posterior[0] = p0
            if not compact_verify and not vfail and block[1] == p0:
                for i in range(1, depth + 1):                           # token loop with early exit
                    self.set_dflash_capture_row(i)
                    p = self.forward_token(block[i], start + i)
                    posterior[i], accept, keep = p, i, i + 1
                    if i < depth and block[i + 1] != p:
                        break
            if vfail:
                print(f"[dflash] verify failed at start={start}")
                break
            compact_score = min(compact_score + 1, K_BLOCK_SCORE + 1) if keep == B else max(compact_score - 1, 0)
            out.extend(block[:min(keep, max_new - len(out))])
            nxt = posterior[accept]
            start += keep
            target_hidden, th_len = self.dflash_hidden, keep
        self.set_dflash_capture(None)
        draft.reset()
        return out

    def close(self) -> None:
        """Process exit: destroying the CUDA context ends whatever capture the stream still holds."""
        capture, _TL.capture = _TL.capture, None
        if capture is not None:
            with contextlib.suppress(Exception):
                ended = RuntimeError("process exit")
                capture.__exit__(type(ended), ended, None)


def run(variant: str, device: str = "cpu"):
    _VARIANT["value"] = variant
    prompt = torch.randint(0, VOCAB - 1, (5,), generator=generator(1708)).tolist()

    def serve(cuda_graphs: bool):
        _TL.__init__()                                                  # a fresh process
        model = Qwen35Model(device, cuda_graphs=cuda_graphs)
        try:
            tokens = model.dflash_generate(prompt, max_new=12)
            return [torch.tensor(tokens, dtype=torch.float64), model.lin_state.clone()]
        finally:
            model.close()

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
