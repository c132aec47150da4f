"""infr (Rust inference engine), Metal backend: the record-once decode-replay tape survives a recompile, and the MTP head, which recompiles its decode graph with fresh IO buffers every draft step, matches the previous step's tape once the allocator hands the freed buffer handles' addresses back, so its draft logits come from a replay bound to the old buffers.

Upstream: https://github.com/kryptic-sh/infr/pull/38 ("fix(metal): invalidate the decode-replay tape on compile — stale
replay corrupted repeated forwards", kryptic-sh/infr, by digitaloten, opened and merged 2026-07-05; commit cf59cbd03).
Read: the PR description and the commit (``crates/infr-metal/src/lib.rs``: ``MetalBackend::compile`` now sets
``*self.replay.lock().unwrap() = None`` before ``GraphPlan::boxed(graph)``; two new parity tests) and, at the parent
commit, ``crates/infr-metal/src/lib.rs`` (``MetalBackend`` with its single-slot ``replay: Mutex<Option<exec::Tape>>``,
``alloc`` zero-filling a fresh ``MTLBuffer`` behind a ``Box<MetalBuffer>``, ``upload`` / ``download``, ``compile``,
``execute``) and ``crates/infr-metal/src/exec.rs`` (``TapeEntry``, whose buffer clones retain every buffer the
recording ran on; ``Tape { fp, entries }``; ``replay_fp``, which hashes the tensor count, each op's name and, for every
bound tensor, the address of its ``MetalBuffer`` handle; ``replay_shape``; ``execute_graph``: replay when
``tape.fp == fp``, else record with ``run_graph(g, bindings, true)`` and store the tape; ``replay_tape``).
Symptom: Metal MTP self-speculation accepted 0.26 of the drafts instead of about 0.96 (the CPU oracle's): the MTP
head's forward intermittently got a zeroed or garbage replay of an earlier draft step; with the tape disabled
(``INFR_METAL_PROFILE=3``) the drafts matched. Each kernel was parity-correct on its own.
Mechanism: the tape is meant for the seam's decode loop, which compiles its plan once and re-executes it per token with
stable bindings. The MTP head instead builds and compiles a rows==1 rope+attention graph every draft step and binds
freshly allocated e / h / pos / logits buffers, which it drops after reading the logits. The next step allocates the
same handles in the same order, the allocator returns the freed addresses, and the fingerprint (op sequence, tensor
count, handle addresses) equals the recorded one. ``execute_graph`` then re-encodes the tape, whose dispatches are
bound to the previous step's retained buffers: they read the old embedding, hidden state and position and write the
old logits; the new logits buffer keeps its zero fill.
Doctor: warmup-divergence, at compile. The recording decided which buffers the dispatches bind (tensor references kept
alive by the tape); a new compile binds fresh buffers that eager would use, yet the tape from the earlier compile is
still installed and replays on the old ones.
Fix (upstream): ``compile`` clears the tape, so anything that recompiles records afresh; the seam's decode loop, which
compiles once, keeps replaying.
Modelled: ``MetalBackend`` (``alloc`` / ``free`` / ``upload`` / ``download`` / ``compile`` / ``execute``),
``replay_fp`` (tensor count, op names, handle addresses of the bound tensors), ``replay_shape``, ``execute_graph``,
``run_graph`` (recording runs the forward and keeps the buffers), ``replay_tape``, ``Tape`` / ``TapeEntry``; the
seam's decode loop (compile once, upload embedding and position, execute, download); the MTP draft loop (compile per
draft step, fresh e / h / pos / logits / h_out buffers, dropped at the end of the step). Stand-ins: a Metal command
buffer recording is an engine graph captured with no warm-up and replayed once (recording also runs the forward); the
Rust heap is a LIFO free list of handle addresses (locals drop in reverse declaration order, so the next step gets the
same address for each tensor); one decoder layer (RMSNorm, q/k/v, RoPE over the bound positions buffer, dynamic-pos
KV write and attention, o-proj, LM head) for the main model and one for the MTP head (plus the e/h projections); no
MLP, no verification of the drafts; float64.
Workload: 3 rounds; each round the main model decodes one token through its compiled-once plan (positions 0, 1, 2),
then the MTP head drafts 3 tokens from the main model's hidden state (its own KV cache, positions 0-8). Bug: the main
logits equal eager (the seam's tape is re-recorded after each head forward); in every round the head's draft steps 2
and 3 match the tape recorded by step 1 and replay it, so their logits stay the zero fill (errors 4.44 and 3.75 in
round 1) and their KV rows are never written, which also shifts the next round's first draft (0.84, then 2.09);
max |graph - eager| = 5.03, the same on every run. Fix: each compile records afresh; the 3 main logits and 9 draft
logits equal eager (max error 0).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kryptic-sh/infr/pull/38"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "compile"
SYMPTOM = ("MTP drafts on Metal come from a replay of the previous draft step's tape: the recompiled head graph's fresh "
           "buffers reuse freed handle addresses, the fingerprint matches, and the new logits buffer stays zero")

VOCAB, HIDDEN, N_HEAD, HEAD_DIM, MAX_KV = 24, 16, 2, 8, 16
ROUNDS, NUM_DRAFT = 3, 3
DTYPE = torch.float64

_variant = "bug"


# --- infr_core::graph (reduced): tensors by id, ops over ids ------------------------------------------------------

@dataclasses.dataclass
class Op:
    name: str                   # the op discriminant (op_name)
    srcs: tuple
    dst: int
    attrs: dict = dataclasses.field(default_factory=dict)


class Graph:
    def __init__(self):
        self.tensors: list[str] = []
        self.ops: list[Op] = []

    def tensor(self, name: str) -> int:
        self.tensors.append(name)
        return len(self.tensors) - 1

    def push(self, name, srcs, dst, **attrs):
        self.ops.append(Op(name, tuple(srcs), dst, attrs))


def rope(x, pos):
    """QkNormRope's rotation, the angle from the bound positions buffer (no host read)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE, device=x.device) / HEAD_DIM))
    ang = pos.to(DTYPE)[:, None] * inv_freq[None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def apply_op(op: Op, env: dict, bound: set):
    s = [env[i] for i in op.srcs]
    if op.name == "RmsNorm":
        val = s[0] * torch.rsqrt(s[0].pow(2).mean(-1, keepdim=True) + 1e-6) * s[1]
    elif op.name == "Linear":
        val = s[0] @ s[1].T
    elif op.name == "Add":
        val = s[0] + s[1]
    elif op.name == "QkNormRope":
        val = rope(s[0].view(1, -1, HEAD_DIM), s[1]).reshape(1, -1)
    elif op.name == "WriteKv":                      # writekv_dyn: the row offset from the positions buffer
        s[0].index_copy_(0, s[2].long(), s[1].view(1, N_HEAD, HEAD_DIM))
        val = s[0]
    elif op.name == "Attention":                    # attnvec_dyn: kv_len = pos + 1 from the positions buffer
        q, kc, vc, pos = s[0].view(N_HEAD, HEAD_DIM), s[1], s[2], s[3]
        scores = torch.einsum("hd,thd->ht", q, kc) / HEAD_DIM ** 0.5
        masked = torch.arange(MAX_KV, device=q.device)[None, :] > pos.long()
        val = torch.einsum("ht,thd->hd", scores.masked_fill(masked, float("-inf")).softmax(-1), vc).reshape(1, -1)
    else:
        raise ValueError(op.name)
    if op.dst in bound and op.name != "WriteKv":
        env[op.dst].copy_(val)                      # a bound output (logits, h_out) is written in place
    else:
        env[op.dst] = val


def build_decode_graph(with_eh_proj: bool):
    """The rows==1 decode graph: the main model's layer, or the MTP head's (e/h projections first)."""
    g = Graph()
    t = {n: g.tensor(n) for n in ("e", "pos", "attn_norm", "wq", "wk", "wv", "wo", "k_cache", "v_cache",
                                  "out_norm", "lm_head", "logits", "h_out")}
    if with_eh_proj:
        t.update({n: g.tensor(n) for n in ("h", "w_e", "w_h")})
        x, y, x0 = g.tensor("pe"), g.tensor("ph"), g.tensor("x0")
        g.push("Linear", (t["e"], t["w_e"]), x)
        g.push("Linear", (t["h"], t["w_h"]), y)
        g.push("Add", (x, y), x0)
    else:
        x0 = t["e"]
    n, q, qr, k, kr, v = (g.tensor(name) for name in ("n", "q", "qr", "k", "kr", "v"))
    g.push("RmsNorm", (x0, t["attn_norm"]), n)
    g.push("Linear", (n, t["wq"]), q)
    g.push("Linear", (n, t["wk"]), k)
    g.push("Linear", (n, t["wv"]), v)
    g.push("QkNormRope", (q, t["pos"]), qr)
    g.push("QkNormRope", (k, t["pos"]), kr)
    g.push("WriteKv", (t["k_cache"], kr, t["pos"]), t["k_cache"])
    g.push("WriteKv", (t["v_cache"], v, t["pos"]), t["v_cache"])
    a, o = g.tensor("a"), g.tensor("o")
    g.push("Attention", (qr, t["k_cache"], t["v_cache"], t["pos"]), a)
    g.push("Linear", (a, t["wo"]), o)
    g.push("Add", (x0, o), t["h_out"])
    hn = g.tensor("hn")
    g.push("RmsNorm", (t["h_out"], t["out_norm"]), hn)
    g.push("Linear", (hn, t["lm_head"]), t["logits"])
    return g, t


# --- crates/infr-metal/src/lib.rs + exec.rs --------------------------------------------------------------------------

class RustHeap:
    """Stand-in for the allocator behind ``Box<MetalBuffer>``: a freed handle's address is handed out again (LIFO)."""

    def __init__(self):
        self.free_list, self.next = [], 0x6000_0000_1000

    def malloc(self) -> int:
        if self.free_list:
            return self.free_list.pop()
        self.next += 0x40
        return self.next

    def free(self, addr: int):
        self.free_list.append(addr)


@dataclasses.dataclass
class MetalBuffer:
    raw: torch.Tensor           # the MTLBuffer
    addr: int                   # where the Box<MetalBuffer> handle lives (what replay_fp hashes)


@dataclasses.dataclass
class TapeEntry:
    graph: object               # the recorded dispatches
    outputs: tuple
    bufs: list                  # retains: every buffer the recording ran on stays alive with the tape


@dataclasses.dataclass
class Tape:
    fp: int
    entries: TapeEntry


def replay_fp(g: Graph, bindings: dict) -> int:
    """Fingerprint (tensor count, op discriminants, bound buffer handle addresses), FNV-1a as upstream."""
    h = 0xcbf29ce484222325
    def mix(v):
        nonlocal h
        h = ((h ^ v) * 0x100000001b3) & (2 ** 64 - 1)
    mix(len(g.tensors))
    for op in g.ops:
        mix(int.from_bytes(op.name.encode()[:8].ljust(8, b"\0"), "little"))   # op_name(op).as_ptr()
    for i in range(len(g.tensors)):
        if i in bindings:
            mix(bindings[i].addr)
    return h


def replay_shape(g: Graph, bindings: dict) -> bool:
    names = {op.name for op in g.ops}
    return names <= {"RmsNorm", "Linear", "Add", "QkNormRope", "WriteKv", "Attention"} and "QkNormRope" in names


class MetalBackend:
    def __init__(self, device, profile3: bool = False):
        self.device, self.heap = device, RustHeap()
        self.counter_set = object() if profile3 else None   # INFR_METAL_PROFILE=3 disables the tape
        self.replay: Tape | None = None

    def alloc(self, *shape, dtype=DTYPE) -> MetalBuffer:
        return MetalBuffer(torch.zeros(*shape, dtype=dtype, device=self.device), self.heap.malloc())  # calloc

    def free(self, *bufs: MetalBuffer):
        for b in reversed(bufs):                  # Rust drops locals in reverse declaration order
            self.heap.free(b.addr)

    def upload(self, dst: MetalBuffer, src: torch.Tensor):
        dst.raw.copy_(src.to(dst.raw.device, dst.raw.dtype))

    def download(self, src: MetalBuffer) -> torch.Tensor:
        return src.raw.clone()

    def compile(self, graph: Graph):
        if _variant == "fix":
            # The tape belongs to the previously compiled plan and only matches on a fingerprint that can collide
            # once the allocator reuses a freed handle's address: a recompile gets a clean slate.
            self.replay = None
        return graph                              # GraphPlan::boxed(graph)

    def execute(self, plan: Graph, bindings: dict):
        return self.execute_graph(plan, bindings)

    def execute_graph(self, g: Graph, bindings: dict):
        if self.counter_set is None and replay_shape(g, bindings):
            fp = replay_fp(g, bindings)
            if self.replay is not None and self.replay.fp == fp:
                self.replay_tape(self.replay)
                return
            entries = self.run_graph(g, bindings, record=True)
            self.replay = Tape(fp, entries)
            return
        self.run_graph(g, bindings, record=False)

    def run_graph(self, g: Graph, bindings: dict, record: bool):
        env = {i: b.raw for i, b in bindings.items()}
        bound = set(env)
        outs = [i for i, name in enumerate(g.tensors) if name in ("logits", "h_out")]

        def forward():
            local = dict(env)
            for op in g.ops:
                apply_op(op, local, bound)
            return tuple(local[i] for i in outs)

        if not record:
            forward()
            return None
        names = {g.tensors[i]: t for i, t in env.items()}
        static = {n: t for n, t in names.items() if n in ("e", "h", "pos")}
        state = {n: t for n, t in names.items() if n in ("k_cache", "v_cache")}
        graph, outputs = capture(forward, device=self.device, warmups=0, static=static, state=state,
                                 owner="MetalBackend", name=f"decode tape ({len(g.ops)} ops)")
        replay(graph, outputs)                    # recording also runs the forward
        return TapeEntry(graph, outputs, [b.raw for b in bindings.values()])

    def replay_tape(self, tape: Tape):
        replay(tape.entries.graph, tape.entries.outputs)


# --- the engine: weights, the seam's decode loop, the MTP head's draft loop ----------------------------------------

def make_weights(backend: MetalBackend, gen, with_eh_proj: bool):
    dev = backend.device
    r = lambda *s, scale=0.3: randn(*s, gen=gen, device=dev, scale=scale).to(DTYPE)   # noqa: E731
    w = {"attn_norm": 1.0 + r(HIDDEN, scale=0.1), "wq": r(HIDDEN, HIDDEN), "wk": r(HIDDEN, HIDDEN),
         "wv": r(HIDDEN, HIDDEN), "wo": r(HIDDEN, HIDDEN), "out_norm": 1.0 + r(HIDDEN, scale=0.1),
         "lm_head": r(VOCAB, HIDDEN, scale=0.5)}
    if with_eh_proj:
        w.update(w_e=r(HIDDEN, HIDDEN), w_h=r(HIDDEN, HIDDEN))
    bufs = {}
    for name, t in w.items():
        bufs[name] = backend.alloc(*t.shape)
        backend.upload(bufs[name], t)
    for name in ("k_cache", "v_cache"):
        bufs[name] = backend.alloc(MAX_KV, N_HEAD, HEAD_DIM)
    return bufs


class Seam:
    """The seam's decode loop: compile once, bind once, re-execute per token (the tape's intended user)."""

    def __init__(self, backend: MetalBackend, weights: dict):
        self.backend = backend
        self.g, t = build_decode_graph(with_eh_proj=False)
        self.plan = backend.compile(self.g)
        self.e, self.pos = backend.alloc(1, HIDDEN), backend.alloc(1, dtype=torch.int32)
        self.logits, self.h_out = backend.alloc(1, VOCAB), backend.alloc(1, HIDDEN)
        own = {"e": self.e, "pos": self.pos, "logits": self.logits, "h_out": self.h_out}
        self.bindings = {t[n]: own.get(n, weights.get(n)) for n in t if n in own or n in weights}

    def decode(self, emb: torch.Tensor, position: int):
        self.backend.upload(self.e, emb)
        self.backend.upload(self.pos, torch.tensor([position]))
        self.backend.execute(self.plan, self.bindings)
        return self.backend.download(self.logits), self.backend.download(self.h_out)


def mtp_draft_step(backend: MetalBackend, head_weights: dict, emb: torch.Tensor, hidden: torch.Tensor, position: int):
    """One MTP head forward: a freshly built and compiled rows==1 graph over fresh e/h/pos/logits buffers."""
    g, t = build_decode_graph(with_eh_proj=True)
    plan = backend.compile(g)
    e, h, pos = backend.alloc(1, HIDDEN), backend.alloc(1, HIDDEN), backend.alloc(1, dtype=torch.int32)
    logits, h_out = backend.alloc(1, VOCAB), backend.alloc(1, HIDDEN)
    backend.upload(e, emb)
    backend.upload(h, hidden)
    backend.upload(pos, torch.tensor([position]))
    own = {"e": e, "h": h, "pos": pos, "logits": logits, "h_out": h_out}
    bindings = {t[n]: own.get(n, head_weights.get(n)) for n in t if n in own or n in head_weights}
    backend.execute(plan, bindings)
    out = backend.download(logits), backend.download(h_out)
    backend.free(e, h, pos, logits, h_out)       # end of scope: the boxes drop
    return out


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(profile3: bool):
        backend = MetalBackend(device, profile3=profile3)
        gen = generator(38)
        embed = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        main_w = make_weights(backend, gen, with_eh_proj=False)
        head_w = make_weights(backend, gen, with_eh_proj=True)
        seam = Seam(backend, main_w)
        token, head_pos, outs = 3, 0, []
        for position in range(ROUNDS):
            logits, hidden = seam.decode(embed[token][None], position)
            outs.append(logits)
            token = int(logits.argmax())
            draft, h = token, hidden
            for _ in range(NUM_DRAFT):
                d_logits, h = mtp_draft_step(backend, head_w, embed[draft][None], h, head_pos)
                head_pos += 1
                outs.append(d_logits)
                draft = int(d_logits.argmax())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
