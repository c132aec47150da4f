"""Breakable CUDA graph prefill records the linear-attention kernels of a hybrid model inside a graph segment.

Upstream: https://github.com/sgl-project/sglang/pull/25110 ("[Fix]: BCG support for RadixLinearAttention
(Qwen3.5 / linear-attn hybrid models)"); the BCG wiring it copies is from
https://github.com/sgl-project/sglang/pull/22218 ("[Experimental] Breakable Piecewise Cuda Graph").
Symptom: with ``--enable-breakable-cuda-graph`` on hybrid linear-attention models (Qwen3.5, Qwen3-Next,
Kimi-Linear, Bailing-MoE-Linear) "the server silently produces wrong outputs": GSM8K on Qwen3.5-4B falls to
16.5% (86.7% with the fix, 86.1% with the torch.compile piecewise graphs); nothing is raised.
Mechanism: Breakable CUDA Graph (BCG) captures the prefill forward of each token bucket as graph segments
separated by eager breaks. ``RadixAttention.forward`` is such a break (#22218): the attention backend runs
eagerly between segments, on the metadata ``init_forward_metadata`` built for this step.
``RadixLinearAttention.forward`` had no BCG wiring, so it calls the backend (``forward_extend`` ->
``chunk_gated_delta_rule``) inside the segment being captured: the linear-attention kernels are recorded
with the metadata tensors the hybrid linear-attention backend built for the capture's dummy batch
(``query_start_loc``, ``mamba_cache_indices``: one request of ``num_tokens`` tokens in the reserved dummy
state slot 0). Each later step builds new metadata eagerly, but the replayed kernels keep reading the capture
batch's: the real requests' tokens are mixed as one sequence that starts from the dummy slot's state, and
their own state slots are never updated, so later chunks go wrong too. An eager step of the same code reads
the step's metadata.
Only the #25110 description and the #22218 review diff of ``RadixAttention``'s BCG branch were read, not
the #25110 diff. Modelling choices: the runner keeps the capture batch's metadata alive (upstream it may be
released when the next ``init_forward_metadata`` replaces it, and the graph then reads whatever reuses
that memory: equally not this step's metadata); the model is reduced to one GDN-like layer
(``chunk_gated_delta_rule`` is a scalar-gated linear recurrence, no delta-rule correction or conv) and one
full-attention layer that attends within the chunk only (no prefix KV).
Doctor: warmup-divergence, at ``forward`` (of ``RadixLinearAttention``: without the BCG break its backend
call is captured and binds the capture batch's ``query_start_loc`` / ``mamba_cache_indices``).
Fix (upstream): mirror the ``RadixAttention`` pattern in ``RadixLinearAttention``: under BCG the linear
attention becomes an eager break, so its kernels run outside the segments on the step's own metadata.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/25110"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward"
SYMPTOM = "hybrid linear-attention model gives silently wrong prefill outputs under breakable CUDA graphs"

VOCAB, DIM, NUM_STATE_SLOTS, GATE = 16, 4, 6, 0.8
DUMMY_SLOT = 0                         # MambaPool slot reserved for padding / dummy requests
CAPTURE_NUM_TOKENS = (8, 4)            # BCG prefill token buckets, captured largest first
MAX_NUM_TOKENS = max(CAPTURE_NUM_TOKENS)


@dataclasses.dataclass
class ForwardBatch:
    extend_seq_lens: list              # tokens of each request in this chunk
    mamba_slots: list                  # each request's state slot in the MambaPool


@dataclasses.dataclass
class ForwardMetadata:
    query_start_loc: torch.Tensor      # [num_reqs + 1]
    mamba_cache_indices: torch.Tensor  # [num_reqs]


def token_to_request(query_start_loc, num_tokens):
    """Request of every token row, whether the row is a real token (rows past the last one are padding),
    and the row index."""
    t = torch.arange(num_tokens, device=query_start_loc.device)
    req = torch.searchsorted(query_start_loc[1:], t, right=True)
    num_reqs = query_start_loc.shape[0] - 1
    return req.clamp(max=num_reqs - 1), t < query_start_loc[-1], t


def chunk_gated_delta_rule(q, k, v, ssm_states, query_start_loc, cache_indices):
    """Prefill kernel of the linear attention: per request, S_t = g * S_{t-1} + k_t v_t^T starting from the
    request's state slot, o_t = q_t S_t; the request's final state is written back to its slot."""
    n = q.shape[0]
    req, valid, t = token_to_request(query_start_loc, n)
    pos = t - query_start_loc[req]                                   # position within the request's chunk
    s0 = ssm_states[cache_indices[req]]                              # [n, D, D]
    same = (req[:, None] == req[None, :]) & (t[None, :] <= t[:, None]) & valid[:, None] & valid[None, :]
    decay = torch.pow(GATE, (pos[:, None] - pos[None, :]).clamp(min=0).to(q.dtype)) * same
    out = (torch.pow(GATE, (pos + 1).to(q.dtype))[:, None] * (q[:, None, :] @ s0).squeeze(1)
           + ((q @ k.T) * decay) @ v) * valid[:, None]
    lens = query_start_loc[1:] - query_start_loc[:-1]
    w = torch.pow(GATE, (lens[req] - 1 - pos).clamp(min=0).to(q.dtype)) * valid   # weight of k_j v_j^T
    contrib = torch.zeros(cache_indices.shape[0], DIM, DIM, dtype=q.dtype, device=q.device)
    contrib.index_add_(0, req, w[:, None, None] * k[:, :, None] * v[:, None, :])
    new_states = torch.pow(GATE, lens.to(q.dtype))[:, None, None] * ssm_states[cache_indices] + contrib
    ssm_states.index_copy_(0, cache_indices, new_states)
    return out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q):
    """Causal attention within each request of the chunk (padding rows attend to themselves)."""
    n = q.shape[0]
    req, valid, t = token_to_request(cu_seqlens_q, n)
    allowed = ((req[:, None] == req[None, :]) & (t[None, :] <= t[:, None]) & valid[None, :]) | torch.eye(
        n, dtype=torch.bool, device=q.device)
    return torch.softmax((q @ k.T).masked_fill(~allowed, -1e9), -1) @ v


class HybridLinearAttnBackend:
    """Full-attention backend plus the Mamba/GDN backend. ``init_forward_metadata`` runs eagerly before
    every forward (and before each capture) and builds new metadata tensors for that batch."""

    def __init__(self, device):
        self.device = device
        self.ssm_states = torch.zeros(NUM_STATE_SLOTS, DIM, DIM, device=device)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch):
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        qsl = [0]
        for n in forward_batch.extend_seq_lens:
            qsl.append(qsl[-1] + n)
        self.forward_metadata = ForwardMetadata(t(qsl), t(forward_batch.mamba_slots))
        return self.forward_metadata

    def forward_extend(self, q, k, v, layer):
        md = self.forward_metadata
        if layer.is_linear:
            return chunk_gated_delta_rule(q, k, v, self.ssm_states, md.query_start_loc, md.mamba_cache_indices)
        return flash_attn_varlen_func(q, k, v, md.query_start_loc)


_bcg = {"capturing": False}            # is_in_breakable_cuda_graph()


def eager_on_graph(fn, *args):
    """A BCG break: under BCG the call is not captured; the runner runs it eagerly between segments."""
    if _bcg["capturing"]:
        raise _Break(fn, args)
    return fn(*args)


class _Break(Exception):
    def __init__(self, fn, args):
        super().__init__("BCG break")
        self.fn, self.args = fn, args


class RadixAttention:
    is_linear = False

    def forward(self, q, k, v, backend):
        # BCG wiring (#22218): the attention is a graph break.
        return eager_on_graph(backend.forward_extend, q, k, v, self)


class RadixLinearAttention:
    is_linear = True

    def __init__(self, variant):
        self.variant = variant

    def forward(self, q, k, v, backend):
        if self.variant == "fix":
            # Mirror RadixAttention: the linear attention is a graph break under BCG.
            return eager_on_graph(backend.forward_extend, q, k, v, self)
        # No BCG wiring: the backend's kernels run inside the segment being captured, on the
        # metadata tensors the backend holds now (the capture batch's).
        return backend.forward_extend(q, k, v, self)


class Qwen3_5Model:
    """Embedding, a GDN layer and a full-attention layer, written as the stages a breakable graph sees:
    each stage takes the tensors made so far and returns the ones it makes."""

    def __init__(self, device, backend, variant):
        gen = generator(25110)
        self.backend = backend
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w = {name: randn(DIM, DIM, gen=gen, device=device, scale=0.6)
                  for name in ("q0", "k0", "v0", "o0", "q1", "k1", "v1", "o1")}
        self.linear_attn, self.attn = RadixLinearAttention(variant), RadixAttention()

    def stages(self):
        w, b = self.w, self.backend

        def embed_and_in_proj(env):
            h0 = self.emb[env["input_ids"]]
            return {"h0": h0, "q0": h0 @ w["q0"], "k0": h0 @ w["k0"], "v0": h0 @ w["v0"]}

        def linear_attention(env):
            return {"o0": self.linear_attn.forward(env["q0"], env["k0"], env["v0"], b)}

        def out_proj_and_qkv(env):
            h1 = env["h0"] + env["o0"] @ w["o0"]
            return {"h1": h1, "q1": h1 @ w["q1"], "k1": h1 @ w["k1"], "v1": h1 @ w["v1"]}

        def full_attention(env):
            return {"o1": self.attn.forward(env["q1"], env["k1"], env["v1"], b)}

        def final(env):
            return {"hidden": env["h1"] + env["o1"] @ w["o1"]}

        return [(embed_and_in_proj, ()), (linear_attention, ("o0",)), (out_proj_and_qkv, ()),
                (full_attention, ("o1",)), (final, ())]

    def forward(self, input_ids):
        env = {"input_ids": input_ids}
        for stage, _ in self.stages():
            env.update(stage(env))
        return env["hidden"]


class BreakableCudaGraphRunner:
    """BCG prefill graphs, one per token bucket. Running the stages under capture, a run of stages up to
    a break becomes one captured segment; the break runs eagerly and lands its result in a static bridge
    buffer that the next segment reads (what ``BreakableCUDAGraph`` does around ``eager_on_graph``)."""

    def __init__(self, model, device):
        self.model, self.device, self.backend = model, device, model.backend
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.bridges = {key: torch.zeros(MAX_NUM_TOKENS, DIM, device=device)
                        for _, keys in model.stages() for key in keys}
        self.pool = graph_pool_handle(device)
        self.capture_metadata = {}
        self.plans = {size: self.capture_one_shape(size) for size in CAPTURE_NUM_TOKENS}

    def capture_one_shape(self, size):
        # The capture batch: one dummy request of `size` tokens in the dummy state slot. Its metadata is
        # kept as the runner's per-shape capture state.
        self.capture_metadata[size] = self.backend.init_forward_metadata(ForwardBatch([size], [DUMMY_SLOT]))
        env = {"input_ids": self.input_ids[:size]}       # what the next segment reads
        ahead = dict(env)                                # the pending segment's results, run eagerly
        plan, pending, made = [], [], []
        for stage, _ in self.model.stages():
            _bcg["capturing"] = True
            try:
                out = stage(ahead)                       # not a break: part of the pending segment
                ahead.update(out)
                pending.append(stage)
                made.extend(out)
                continue
            except _Break:                               # eager_on_graph: the segment ends here
                pass
            finally:
                _bcg["capturing"] = False
            if pending:
                plan.append(self._capture_segment(pending, made, env, size))
                env.update(zip(made, plan[-1][2]))
            env.update(self._run_break(stage, env, size))
            ahead, pending, made = dict(env), [], []
            plan.append(("break", stage))
        if pending:
            plan.append(self._capture_segment(pending, made, env, size))
        return plan

    def _capture_segment(self, stages, keys, env, size):
        fn = (lambda st=tuple(stages), e=dict(env), ks=tuple(keys): _run_stages(st, e, ks))
        touches_state = any(s.__name__ == "linear_attention" for s in stages)
        g, outs = capture(fn, device=self.device, pool=self.pool, name=f"BCG segment, {size} tokens",
                          owner=f"BreakableCudaGraphRunner ({size} tokens)",
                          static={"input_ids": self.input_ids, **self.bridges},
                          state={"ssm_states": self.backend.ssm_states} if touches_state else None)
        return ("graph", g, outs, keys)

    def _run_break(self, stage, env, size):
        out = {}
        for key, value in stage(env).items():
            self.bridges[key][:size].copy_(value)
            out[key] = self.bridges[key][:size]
        return out

    def forward(self, forward_batch, input_ids):
        n = input_ids.shape[0]
        size = next(s for s in sorted(CAPTURE_NUM_TOKENS) if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.backend.init_forward_metadata(forward_batch)     # this step's metadata, built eagerly
        env = {"input_ids": self.input_ids[:size]}
        for entry in self.plans[size]:
            if entry[0] == "break":
                env.update(self._run_break(entry[1], env, size))
            else:
                _, g, outs, keys = entry
                env.update(zip(keys, replay(g, outs, real=n, size=size)))
        return env["hidden"][:n]


def _run_stages(stages, env, keys):
    env = dict(env)
    for stage in stages:
        env.update(stage(env))
    return tuple(env[k] for k in keys)


def run(variant: str, device: str = "cpu"):
    # Prefill chunks: (token ids, state slot) per request; a request's later chunk continues its state.
    steps = [
        [([3, 5, 7], 1), ([2, 9], 2)],             # 5 tokens -> bucket 8
        [([4, 1], 3)],                             # 2 tokens -> bucket 4
        [([6, 8], 1), ([11], 3)],                  # chunks continuing two requests -> bucket 4
        [([12, 13, 14], 2), ([15], 1)],            # 4 tokens -> bucket 4
    ]

    def serve(graphed: bool):
        backend = HybridLinearAttnBackend(device)
        model = Qwen3_5Model(device, backend, variant)
        runner = BreakableCudaGraphRunner(model, device) if graphed else None
        outs = []
        for reqs in steps:
            fb = ForwardBatch([len(ids) for ids, _ in reqs], [slot for _, slot in reqs])
            ids = torch.tensor([tok for toks, _ in reqs for tok in toks], dtype=torch.long).to(device)
            if graphed:
                outs.append(runner.forward(fb, ids).clone())
            else:
                backend.init_forward_metadata(fb)
                outs.append(model.forward(ids).clone())
        outs.append(backend.ssm_states[1:].clone())      # the real requests' linear-attention states
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
