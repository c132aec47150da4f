"""The batched-prefill CUDA graph outlives its scratch arena: a prefill too big to keep resident frees the arena, and the next same-N call replays into freed memory.

Upstream: https://github.com/gittensor-ai-lab/sparkinfer/commit/8a10f9583f614838a252b9a7c18c3686b94d35ba
("fix(muse-glimmer): destroy the prefill CUDA graph when its arena is freed (#809)", on main, 2026-08-14). Issue:
https://github.com/gittensor-ai-lab/sparkinfer/issues/809 ("Muse Glimmer: prefill graph replay segfaults when a larger
prefill N follows a smaller one"); the graph came in with PR #800 (CUDA-graph capture for the batched prefill).
Symptom: SIGSEGV / illegal memory access in ``cudaGraphLaunch`` on the third prefill of a large N
(``SPARKINFER_BENCH_SWEEP_CTXS="512,4096" SPARKINFER_BENCH_SWEEP_REPS=5``); small N and
``SPARKINFER_MUSE_PREFILL_GRAPH=0`` (eager) are fine. Where the freed blocks were handed on, garbage instead.
Mechanism: ``prefill_batched_run()`` (runtime/src/models/qwen35_prefill.cpp) draws its scratch (``x``, ``xn``,
``hn``, ``ao``, ``b8``, ``att``, ``ffg``/``ffu``, ``d_ids``; ``A_i8``/``sx`` in ``a8``) from ``static thread_local``
arenas that it ``rewind()``s every call; ``Arena::alloc`` reuses a block while it is big enough, so the second call
for an N hands out the same pointers, and the function captures the whole pass (the H2D of the ids from the pinned
``g_pfb_pin``, every kernel) into ``g_pfb_graph``/``g_pfb_exec`` on the second sighting of N (``g_pfb_warm_n ==
N``), launches it, and sets ``g_pfb_n = N``. The fast path at the top replays by N alone: ``if (graph_ok &&
g_pfb_exec && g_pfb_n == N) cudaGraphLaunch(g_pfb_exec)``. At the end, a call whose scratch exceeds
``kArenaKeepBytes`` (1 GB) runs ``a.free_all(); a8.free_all(); ...`` (``cudaFree`` of every block), but leaves
``g_pfb_exec`` and ``g_pfb_n`` alone. For a large N: call 1 runs eagerly and frees; call 2 allocates a fresh arena,
captures those addresses, launches, and frees them; call 3 takes the fast path and replays kernels that write and
read the released blocks. Eager computes from the arena it has just allocated on every call.
Doctor: dangling-reference, at prefill_batched_run (the graph it captures keeps the addresses of its arena blocks;
its own release branch frees those blocks while the graph and ``g_pfb_n`` survive, and its fast path replays the
graph on the next call of the same N, reading and writing memory whose owner released it).
Fix (upstream): inside the release branch, after the ``free_all()`` calls, destroy ``g_pfb_exec`` and
``g_pfb_graph`` and reset ``g_pfb_n = -1`` and ``g_pfb_warm_n = -1``, so the next call at that N redoes the
warm-then-capture cycle.
Modelled: a 2-layer dense model (RMSNorm, causal MHA that writes a KV cache, SwiGLU FFN; int8 activation-quant
projections through ``a8``'s ``A_i8``/``sx``), the last row's logits and an argmax seed; only arenas ``a`` and
``a8`` (``am``/``aw`` hold MoE / long-context scratch). The sweep is N = 4 then 12, three reps each, a new prompt
per rep; ``kArenaKeepBytes`` is scaled to 4 KiB so N = 4 stays resident and N = 12 is released. (The issue's table
has a lone 4096 sweep passing, and only a 4096 after a smaller N crashing; here N = 12 is over the budget on its
own, which the fix's message, "releases its scratch arena at the end of any call whose footprint exceeds the 1 GB
keep-resident budget", covers either way.) The function statics live
on a ``PrefillBatched`` object, and ``g_pfb_graph``/``g_pfb_exec`` are one graph. The captured callable re-takes
the scratch from the warm arena (no allocation: the same blocks, as upstream relies on), allocated just before the
capture. ``free_all`` stands for ``cudaFree``: blocks are padded to own an allocator segment and given back to the
driver, so on CUDA the replay faults as upstream does; on the CPU the replay raises ``IllegalMemoryAccess``.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/gittensor-ai-lab/sparkinfer/commit/8a10f9583f614838a252b9a7c18c3686b94d35ba"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "prefill_batched_run"
SYMPTOM = "the third batched prefill of a large N replays a graph whose scratch arena was freed (segfault / garbage)"

HIDDEN, HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 16, 2, 8, 32, 40, 2
MAX_CTX = 16
SWEEP_CTXS, SWEEP_REPS = (4, 12), 3
K_ARENA_KEEP_BYTES = 1 << 12            # upstream 1 GB: "a one-off 128k prompt should not hold ~10 GB forever"
EPS = 1e-6


# --- qwen35_prefill.cpp: the scratch arena ---------------------------------------------------------

class Arena:
    """Simple device-buffer arena: all-or-nothing allocation with one free() at the end."""

    def __init__(self, device):
        self.device = device
        self.bufs, self.sizes, self.cursor, self.ok = [], [], 0, True

    def alloc(self, n, dtype=torch.float32):
        n = max(n, 1)
        nbytes = n * dtype.itemsize
        if self.cursor < len(self.bufs) and self.sizes[self.cursor] >= nbytes:
            p = self.bufs[self.cursor]                    # warm: the same block, no cudaMalloc
            self.cursor += 1
            return p[:n]
        if self.cursor < len(self.bufs):                  # too small: cudaFree it, cudaMalloc a bigger one
            del self.bufs[self.cursor], self.sizes[self.cursor]
        # cudaMalloc: a block of its own (padded to own its allocator segment, so cudaFree unmaps it)
        elems = max(n, own_segment_elems(self.device) * 4 // dtype.itemsize)
        p = torch.empty(elems, dtype=dtype, device=self.device)
        self.bufs.insert(self.cursor, p)
        self.sizes.insert(self.cursor, nbytes)
        self.cursor += 1
        return p[:n]

    def rewind(self):
        self.cursor, self.ok = 0, True

    def free_all(self):
        self.bufs.clear()                                 # for (void* b : bufs) cudaFree(b);
        self.sizes.clear()
        self.cursor = 0
        release_to_driver(self.device)

    def total(self):
        return sum(self.sizes)


# --- the model context (Qwen35PrefillCtx) ----------------------------------------------------------

class LayerWeights:
    def __init__(self, gen, device):
        self.attn_norm = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.wqkv = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.ffn_norm = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.w_gate = randn(HIDDEN, FFN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.w_up = randn(HIDDEN, FFN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.w_down = randn(FFN, HIDDEN, gen=gen, device=device, scale=FFN ** -0.5)


class Qwen35PrefillCtx:
    def __init__(self, device):
        gen = generator(809)
        self.device = device
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [LayerWeights(gen, device) for _ in range(LAYERS)]
        self.out_norm = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.k_cache = torch.zeros(LAYERS, MAX_CTX, HIDDEN, device=device)   # s.kv
        self.v_cache = torch.zeros(LAYERS, MAX_CTX, HIDDEN, device=device)
        self.logits = torch.zeros(1, VOCAB, device=device)
        self.d_out_id = torch.zeros(1, dtype=torch.int64, device=device)


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def scratch(a, a8, N):
    """The ``---- scratch ----`` block: every buffer of the pass, from the arenas."""
    x, xn, hn, ao = (a.alloc(N * HIDDEN).view(N, HIDDEN) for _ in range(4))
    b8 = a.alloc(N * 3 * HIDDEN).view(N, 3 * HIDDEN)          # qkv
    att = a.alloc(N * HIDDEN).view(N, HIDDEN)
    ffg = a.alloc(N * FFN).view(N, FFN)
    ffu = a.alloc(N * FFN).view(N, FFN)
    d_ids = a.alloc(N, torch.int32)
    A_i8 = a8.alloc(N * HIDDEN, torch.int8).view(N, HIDDEN)   # int8 activation for the projections
    sx = a8.alloc(N)                                          # its per-row scales
    return x, xn, hn, ao, b8, att, ffg, ffu, d_ids, A_i8, sx


# --- qwen35_prefill.cpp: prefill_batched_run --------------------------------------------------------

class PrefillBatched:
    """The function's ``static`` state (graph, its N, the warm N, pinned ids) and its kept arenas."""

    def __init__(self, device, variant, graph_env):
        self.device, self.variant = device, variant
        self.graph_env = graph_env                 # SPARKINFER_MUSE_PREFILL_GRAPH (default on)
        self.arena_reuse = True                    # SPARKINFER_PREFILL_ARENA_REUSE (default on)
        self.keep_a, self.keep_a8 = Arena(device), Arena(device)
        self.g_pfb_graph = self.g_pfb_exec = self.g_pfb_out = None
        self.g_pfb_n, self.g_pfb_warm_n, self.g_pfb_pin_cap = -1, -1, 0
        self.g_pfb_pin = None

    def batched_pass(self, s, N, ids_src):
        """The pass from the H2D of the ids to the argmax (what the capture records)."""
        a, a8 = self.keep_a, self.keep_a8
        a.rewind()
        a8.rewind()
        x, xn, hn, ao, b8, att, ffg, ffu, d_ids, A_i8, sx = scratch(a, a8, N)

        def proj(inp, W, out):                                # int8 activation-quant GEMM
            sx.copy_(inp.abs().amax(-1).clamp_min(EPS) / 127)
            A_i8.copy_(torch.round(inp / sx[:, None]).to(torch.int8))
            out.copy_((A_i8.float() * sx[:, None]) @ W)

        d_ids.copy_(ids_src, non_blocking=True)               # cudaMemcpyAsync(d_ids, g_pfb_pin, ...)
        x.copy_(s.embed[d_ids.long()])
        causal = torch.full((N, N), float("-inf"), device=x.device).triu(1)
        for L, w in enumerate(s.layers):
            xn.copy_(rms_norm(x, w.attn_norm))
            proj(xn, w.wqkv, b8)
            q, k, v = b8.split(HIDDEN, dim=-1)
            s.k_cache[L, :N].copy_(k)                         # KV write
            s.v_cache[L, :N].copy_(v)
            qh, kh, vh = (t.reshape(N, HEADS, HEAD_DIM).transpose(0, 1) for t in (q, k, v))
            p = torch.softmax(qh @ kh.transpose(-1, -2) * HEAD_DIM ** -0.5 + causal, dim=-1)
            att.copy_((p @ vh).transpose(0, 1).reshape(N, HIDDEN))
            proj(att, w.wo, ao)
            x.add_(ao)
            hn.copy_(rms_norm(x, w.ffn_norm))
            proj(hn, w.w_gate, ffg)
            proj(hn, w.w_up, ffu)
            ffg.copy_(torch.nn.functional.silu(ffg) * ffu)   # ffh = ffg: SwiGLU in place
            x.add_(ffg @ w.w_down)
        xn.copy_(rms_norm(x, s.out_norm))
        s.logits.copy_(xn[N - 1:N] @ s.lm_head)
        s.d_out_id.copy_(s.logits.argmax(-1))
        return s.logits, s.d_out_id

    def prefill_batched_run(self, s, prompt_ids):
        N = prompt_ids.numel()
        a, a8 = self.keep_a, self.keep_a8
        if self.arena_reuse:
            a.rewind()
            a8.rewind()

        graph_on = self.graph_env and self.arena_reuse
        if graph_on and N > self.g_pfb_pin_cap:
            self.g_pfb_pin = host(torch.zeros(N, dtype=torch.int32), self.device)   # cudaMallocHost
            self.g_pfb_pin_cap = N
        graph_ok = graph_on and self.g_pfb_pin is not None and self.g_pfb_pin_cap >= N
        if graph_ok:
            self.g_pfb_pin[:N].copy_(prompt_ids)              # memcpy(g_pfb_pin, prompt_ids, ...)
        if graph_ok and self.g_pfb_exec is not None and self.g_pfb_n == N:
            replay(self.g_pfb_exec, self.g_pfb_out)           # cudaGraphLaunch(g_pfb_exec, st)
            return int(s.d_out_id.item())                     # D2H of the seed + sync

        scratch(a, a8, N)                                     # cold arena: cudaMalloc here, before any capture
        if not (a.ok and a8.ok):
            a.free_all()
            return -1

        # Capture on the SECOND sighting of this N (arena warm => no cudaMalloc inside the capture).
        if graph_ok and self.g_pfb_exec is not None and self.g_pfb_n != N:
            self.g_pfb_exec.reset()                           # re-capture when N changes
            self.g_pfb_exec = self.g_pfb_graph = None
            self.g_pfb_n = -1
        ids_src = self.g_pfb_pin[:N] if graph_ok else prompt_ids

        def batched_pass():
            return self.batched_pass(s, N, ids_src)

        if graph_ok and self.g_pfb_exec is None and self.g_pfb_warm_n == N:
            g, out = capture(batched_pass, device=self.device, warmups=0, name=f"prefill N={N}",
                             owner="prefill_batched_run", static={"g_pfb_pin": self.g_pfb_pin},
                             state={"k_cache": s.k_cache, "v_cache": s.v_cache})
            self.g_pfb_graph = self.g_pfb_exec = g
            self.g_pfb_out, self.g_pfb_n = out, N
            replay(g, out)                                    # "pfb first launch": this call's result
        else:
            batched_pass()
        self.g_pfb_warm_n = N
        seed = int(s.d_out_id.item())

        # Release rather than hold when this call's scratch is too big to keep resident.
        if not self.arena_reuse or a.total() + a8.total() > K_ARENA_KEEP_BYTES:
            a.free_all()
            a8.free_all()
            if self.variant == "fix":
                if self.g_pfb_exec is not None:
                    self.g_pfb_exec.reset()                   # cudaGraphExecDestroy / cudaGraphDestroy
                self.g_pfb_exec = self.g_pfb_graph = self.g_pfb_out = None
                self.g_pfb_n = -1
                self.g_pfb_warm_n = -1
        return seed


def run(variant: str, device: str = "cpu"):
    gen = generator(4096)
    prompts = {n: [torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.int32) for _ in range(SWEEP_REPS)]
               for n in SWEEP_CTXS}

    def bench_sweep(graphed: bool):
        s = Qwen35PrefillCtx(device)
        runner = PrefillBatched(device, variant, graph_env=graphed)
        outs = []
        for n in SWEEP_CTXS:                                  # SPARKINFER_BENCH_SWEEP_CTXS
            for rep in range(SWEEP_REPS):                     # SPARKINFER_BENCH_SWEEP_REPS
                ids = host(prompts[n][rep].clone(), device)
                seed = runner.prefill_batched_run(s, ids)
                outs += [s.logits.clone(), torch.tensor([seed]), s.k_cache[:, :n].clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: bench_sweep(True),
                   lambda: bench_sweep(False))
