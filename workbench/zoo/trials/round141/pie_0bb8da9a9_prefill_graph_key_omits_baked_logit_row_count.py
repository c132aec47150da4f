"""Pie's native CUDA driver keeps one forward CUDA graph per ``ForwardGraphKey`` (request bucket R, token bucket N,
layout variant). A wave carrying a prefill samples only some of its token rows (the last token of each request whose
prompt completes, one per decode lane), so it emits *compact* logits: the forward gathers the sampled rows listed in
``sample_idx`` and runs the LM head over ``num_logit_rows`` of them; settlement then reads rows ``[0, num_sampling)`` of
``ws.logits``. ``num_logit_rows`` is a host integer that sizes the gather and the LM-head GEMM, so a capture bakes it
into the graph, yet the key does not carry it. Once prefill-carrying waves were admitted to the graph path (and made
default-on), two prefill waves landing in the same bucket pair with different sampled-row counts shared one graph:
the replay of a capture made with fewer rows computes only that many, and the surplus requests sample whatever an
earlier fire left in ``ws.logits`` -- wrong tokens, no error. The fix refuses graph replay (and graph padding) for
compact-logit waves in ``forward_graph_replay_eligible``, so they run the forward eagerly with their own row count.

Upstream: https://github.com/pie-project/pie/commit/0bb8da9a9a6c9b45adc08674ea53a27a20fb08d9 ("cuda: a replayed
prefill graph was sampling an earlier fire's logits", repository pie-project/pie, author In Gim with Claude Opus 5 as
co-author, 2026-08-08), a direct commit on the public repository's ``dev`` branch (pie's integration branch, into
which the agents' branches are merged; no pull request; it was not yet in ``main`` in the stored snapshot, whose head
is 2026-08-06). Read, in a mirror of the repository: the whole commit (message and diff of
``driver/cuda/src/batch/forward.cpp``, ``forward.hpp``, ``frame.cpp``, ``tp.cpp``); at its parent, in
``batch/forward.cpp`` the functions ``prefill_graph_enabled``, ``capture_forward_graph_exec``,
``forward_graph_replay_eligible`` and ``run_forward_dispatch`` (not the rest of the file), the head of
``batch/forward_graph.hpp`` (``ForwardGraphKey``, ``forward_graph_request_bucket``, ``forward_graph_token_bucket``),
the ``ForwardInputs`` struct of ``batch/forward.hpp`` (``logit_row_indices_d``, ``num_logit_rows``, ``emit_logits``),
the emit-logits tail of ``model/llama_like/llama_like.cpp``
(``llama_like_forward_paged``: the compact gather of ``ws.y`` rows into ``norm_x``, the final RMSNorm, the LM head
over ``lm_head_rows``) and ``llama_like_prefill_graph_capturable``; in ``batch/frame.cpp`` the parts of
``prepare_step`` that count ``num_sampling``, stage ``sample_idx``, decide ``compact_logits`` and the graph-lattice
padding (request and token buckets, pad lanes on ``graph_pad_page``), and the compact-logit ``direct_logit_rows`` for
settlement. Also read: the messages and changed-file lists (not the diffs) of the two follow-up commits
3fa6ca96d ("pad the compact logit rows to the request bucket, and key what is baked", which restores replay by padding
the row count to ``forward_R`` and adding a ``compact_logits`` variant bit) and 7fc0cdc3f ("a compact-logits capture
and a full-emit one shared a graph key"), and the messages of 8775dda99 (admitting prefill-carrying waves to the graph
path behind ``PIE_PREFILL_GRAPH``, with the 128-token lattice and multi-token pad lanes) and 58caee27f (making that
default-on).
Not read: the rest of ``frame.cpp`` (decode envelopes, RS slots, MTP drafts, multimodal), the TP follower in
``tp.cpp`` beyond the diff, FlashInfer planning (``prefill_plan_graph_capturable``), the runtime, scheduler and
inferlets that build a wave, the sampler epilogue, and every model other than ``llama_like``. No user report exists:
the commit says the bug was found by review.
Symptom: the commit's words: "Two prefill waves landing in the same bucket pair with different `num_sampling` share a
graph, so the replay gathers the wrong number of logit rows and the surplus requests sample whatever the previous fire
left in `ws.logits`: wrong tokens, no error, no diagnostic." It was invisible to the author's token-agreement check.
Mechanism: ``run_forward_dispatch`` asks ``forward_graph_replay_eligible``; a prefill-carrying wave is eligible when
``prefill_graph_enabled()`` and the plan is capturable. On a key miss ``capture_forward_graph_exec`` records the body
with ``num_logit_rows = num_sampling`` of this wave (and ``compact_logits = 0 < num_logit_rows < N`` decided in the
body): the row count of the gather kernel and the M of the LM-head GEMM are launch parameters, fixed in the graph
(here: the Python slice of ``sample_idx`` and of the workspace rows). A later compact wave
with the same (R, N) buckets but more sampled rows stages all its rows into ``sample_idx`` and replays; the graph
gathers and projects only the captured count, so ``ws.logits`` rows past it keep an earlier fire's logits, which
settlement reads for the surplus requests.
Doctor: host-work-frozen, at ``forward_graph_replay_eligible``. The defect is a host value (the sampled-row count, and
with it the compact-or-full choice) consumed once inside the captured region and frozen there, while the key that
selects the graph does not carry it; ``forward_graph_replay_eligible`` is the gate that admits a compact wave to a
graph whose baked count is not its own, and it is the function the fix changes (with ``prepare_step``'s padding
decision, which only follows it).
Fix (upstream): ``forward_graph_replay_eligible`` gains a ``compact_logits`` argument and requires ``!compact_logits``
for a prefill-carrying wave; ``run_forward_dispatch`` passes ``in.compact_logits``; ``prepare_step`` computes
``maybe_compact_logits = num_sampling > 0 && num_sampling < fN_real``, declines graph padding for such waves and passes
it to the gate. Compact-logit waves therefore run eagerly, unpadded; pure decode is unaffected.
Modelled: ``prefill_graph_enabled``, ``ForwardGraphKey``, ``forward_graph_request_bucket``,
``forward_graph_token_bucket``, ``make_graph_variant``, ``ForwardFn`` (``invoke_body``,
``invoke_prefill_graph_capturable``, ``invoke_graph_layout``) with ``ForwardInputs``, ``capture_forward_graph_exec``,
``forward_graph_replay_eligible``, ``run_forward_dispatch``, ``prepare_step`` (sampled rows, ``sample_idx`` staging,
``compact_logits``, the R/N lattice padding with pad lanes on ``graph_pad_page``), ``llama_like_forward_paged``,
``PersistentInputs``, ``Workspace`` (``y``, ``norm_x``, ``norm_y``, ``logits``), ``KvCache``, ``BatchEngine``.
Stand-ins: the model is a two-layer float64 llama (width 16, vocab 24, one attention head) whose linear layers are
per-row multiply-sums, so a padded graph batch and the unpadded eager batch give real rows the same bits. Paged KV is a
``[pages, page_size, H]`` cache per layer with page size 4; FlashInfer's CSR page indices and plans are replaced by a
per-token page table in the persistent inputs and a masked gather attention (every plan counts as graph-capturable).
The token grain is 8 (upstream 128, settable by ``PIE_TOKEN_GRAIN``), the graph cache is a dict without eviction, graphs
are captured lazily on first use (upstream also pre-captures a decode lattice with dummy inputs), each graph has its
own pool. The runtime and inferlets are a small scheduler: decode lanes first, then prefill chunks of waiting requests
within an 8-token budget; a request samples on the wave that completes its prompt and on each decode lane; sampling is
greedy argmax over the settled ``ws.logits`` rows. TP, MTP drafts, custom masks, RS slots, the fused LM-head argmax
and multimodal inputs are left out (all off in the modelled waves).
Workload: five requests (prompts of 5, 9, 3, 6 and 4 tokens; 4, 3, 4, 3, 3 new tokens) arriving at steps 0, 0, 1, 2
and 4, served until all finish: seven waves, the first five prefill-carrying (each with compact logits: 1, 2, 3, 4 and 3
sampled rows of 8, 8, 8, 5 and 6 tokens), then two pure-decode waves. Eager is the same engine without a graph cache
(no padding, every wave eager). Outputs: per request, the logits row each sampled token came from and the generated
tokens.
Measured: bug: misbehaves (max |graph - eager| = 15.5). The second wave (a decode lane, the 6-token tail of the 9-token
prompt, the first token of the 3-token one: R=3, N=8) is padded to (R=8, N=16) and captured with
``num_logit_rows`` 2; the fourth wave (three decode lanes and the 2-token tail of the 6-token prompt: R=4, N=5, four
sampled rows) pads to the same key and replays it. Rows 2 and 3 of ``ws.logits`` are not written: row 2 still holds
the third wave's logits for the 3-token request (whose token 15 is repeated instead of 13), row 3 the workspace's
zeros, never written (the 6-token request's first token is 0 instead of 8); both requests diverge from there, the
other three match. Fix: equals eager (max |graph - eager| = 0): the five compact waves run eagerly and unpadded, the
two decode waves replay graphs of (4, 4) and (1, 1). About 1.5 s per variant on the CPU (the run without graphs
included).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/pie-project/pie/commit/0bb8da9a9a6c9b45adc08674ea53a27a20fb08d9"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward_graph_replay_eligible"
SYMPTOM = ("with prefill graph replay on, the forward graph bakes in the number of sampled logit rows it gathers, "
           "which its key does not carry: a later prefill wave in the same (R, N) bucket that samples more rows "
           "replays it, and the surplus requests sample an earlier fire's logits (wrong tokens, no error)")

DTYPE = torch.float64
VOCAB, HIDDEN, N_LAYERS, FFN = 24, 16, 2, 32
PAGE_SIZE, NUM_PAGES, MAX_PAGES_PER_REQ = 4, 24, 4
MAX_WORKSPACE_TOKENS, MAX_FORWARD_REQUESTS = 32, 8
TOKEN_GRAIN = 8                     # upstream kForwardGraphTokenGrain = 128 (PIE_TOKEN_GRAIN overrides it)
MAX_FORWARD_TOKENS = 8              # the stand-in scheduler's token budget per wave
EPS = 1e-6
# (arrival step, prompt, new tokens)
REQUESTS = ((0, [3, 17, 8, 5, 11], 4), (0, [9, 2, 20, 14, 7, 1, 12, 6, 19], 3), (1, [4, 15, 10], 4),
            (2, [13, 21, 16, 2, 8, 22], 3), (4, [5, 18, 1, 9], 3))
_variant = "bug"


# --- batch/forward_graph.hpp ----------------------------------------------------------------------------------------

def prefill_graph_enabled() -> bool:
    return True                     # upstream: default ON since 58caee27f (PIE_PREFILL_GRAPH=0 turns it off)


class ForwardGraphKey(NamedTuple):
    num_requests: int
    num_tokens: int
    variant: int = 0


def forward_graph_request_bucket(requests: int, max_requests: int) -> int:
    if requests <= 0 or max_requests <= 0 or requests > max_requests:
        return 0
    if requests <= 1:
        bucket = 1
    elif requests <= 2:
        bucket = 2
    elif requests <= 4:
        bucket = 4
    elif requests < 256:
        bucket = ((requests + 7) // 8) * 8
    else:
        bucket = ((requests + 15) // 16) * 16
    return bucket if bucket <= max_requests else max_requests


def forward_graph_token_bucket(tokens: int, max_tokens: int) -> int:
    if tokens <= 0 or max_tokens <= 0 or tokens > max_tokens:
        return 0
    bucket = ((tokens + TOKEN_GRAIN - 1) // TOKEN_GRAIN) * TOKEN_GRAIN
    return bucket if bucket <= max_tokens else max_tokens


def make_graph_variant(*, small_spec: bool, rs_verify: bool, have_custom_mask: bool, fused_argmax: bool,
                       graph_layout: int) -> int:
    flags = int(small_spec) | int(rs_verify) << 1 | int(have_custom_mask) << 2 | int(fused_argmax) << 3
    return flags | graph_layout << 4            # no compact_logits bit: 3fa6ca96d/7fc0cdc3f add one later


# --- workspace, persistent inputs, KV cache -------------------------------------------------------------------------

@dataclasses.dataclass
class Workspace:
    y: Tensor
    norm_x: Tensor
    norm_y: Tensor
    logits: Tensor

    @classmethod
    def allocate(cls, device) -> "Workspace":
        def z(*shape):
            return torch.zeros(*shape, dtype=DTYPE, device=device)
        return cls(z(MAX_WORKSPACE_TOKENS, HIDDEN), z(MAX_WORKSPACE_TOKENS, HIDDEN), z(MAX_WORKSPACE_TOKENS, HIDDEN),
                   z(MAX_WORKSPACE_TOKENS, VOCAB))


@dataclasses.dataclass
class PersistentInputs:
    tokens: Tensor
    positions: Tensor
    w_page: Tensor                  # explicit KV-write page per token
    w_off: Tensor                   # and offset in it
    page_table: Tensor              # stand-in for kv_page_indices/indptr: the lane's pages, per token
    sample_idx: Tensor              # compact-logit gather rows

    @classmethod
    def allocate(cls, device) -> "PersistentInputs":
        def z(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)
        return cls(z(MAX_WORKSPACE_TOKENS), z(MAX_WORKSPACE_TOKENS), z(MAX_WORKSPACE_TOKENS),
                   z(MAX_WORKSPACE_TOKENS), z(MAX_WORKSPACE_TOKENS, MAX_PAGES_PER_REQ), z(MAX_WORKSPACE_TOKENS))


@dataclasses.dataclass
class KvCache:
    k: Tensor
    v: Tensor

    @classmethod
    def allocate(cls, device) -> "KvCache":
        shape = (N_LAYERS, NUM_PAGES, PAGE_SIZE, HIDDEN)
        return cls(torch.zeros(shape, dtype=DTYPE, device=device), torch.zeros(shape, dtype=DTYPE, device=device))

    def page_size(self) -> int:
        return PAGE_SIZE


def build_weights(device) -> dict:
    gen = generator(141)

    def rnd(*shape, scale=0.4):
        return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
    layers = [{"attn_norm": 1 + rnd(HIDDEN, scale=0.1), "wq": rnd(HIDDEN, HIDDEN), "wk": rnd(HIDDEN, HIDDEN),
               "wv": rnd(HIDDEN, HIDDEN), "wo": rnd(HIDDEN, HIDDEN), "mlp_norm": 1 + rnd(HIDDEN, scale=0.1),
               "w_gate": rnd(FFN, HIDDEN), "w_up": rnd(FFN, HIDDEN), "w_down": rnd(HIDDEN, FFN)}
              for _ in range(N_LAYERS)]
    return {"embed": rnd(VOCAB, HIDDEN, scale=1.0), "layers": layers, "final_norm": 1 + rnd(HIDDEN, scale=0.1),
            "lm_head": rnd(VOCAB, HIDDEN, scale=1.0)}


def _linear(x: Tensor, w: Tensor) -> Tensor:
    """``gemm_act_x_w`` as a per-row multiply-sum (stand-in): a row's result does not depend on how many rows the
    call has, so padded graph batches and unpadded eager batches round real rows alike."""
    return (x.unsqueeze(-2) * w).sum(-1)


def _rmsnorm(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


# --- model/llama_like/llama_like.cpp --------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardInputs:
    total_tokens: int = 0           # N
    num_requests: int = 0           # R
    is_pure_decode: bool = False
    logit_row_indices_d: Optional[Tensor] = None
    num_logit_rows: int = 0
    emit_logits: bool = True


def llama_like_forward_paged(w: dict, ws: Workspace, cache: KvCache, pi: PersistentInputs, fwd_in: ForwardInputs):
    N = fwd_in.total_tokens
    tokens, positions = pi.tokens[:N], pi.positions[:N]
    w_page, w_off = pi.w_page[:N], pi.w_off[:N]
    ctx = torch.arange(MAX_PAGES_PER_REQ * PAGE_SIZE, device=tokens.device)
    pages = pi.page_table[:N][:, ctx // PAGE_SIZE]                     # [N, C]
    offs = (ctx % PAGE_SIZE).expand(N, -1)
    visible = ctx.unsqueeze(0) <= positions.unsqueeze(1)
    x = w["embed"][tokens]
    for layer, lw in enumerate(w["layers"]):
        h = _rmsnorm(x, lw["attn_norm"])
        q, k, v = _linear(h, lw["wq"]), _linear(h, lw["wk"]), _linear(h, lw["wv"])
        cache.k[layer].index_put_((w_page, w_off), k)                      # launch_write_kv_explicit
        cache.v[layer].index_put_((w_page, w_off), v)
        keys, values = cache.k[layer][pages, offs], cache.v[layer][pages, offs]   # [N, C, H]
        scores = (q.unsqueeze(1) * keys).sum(-1) / math.sqrt(HIDDEN)
        probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
        x = x + _linear((probs.unsqueeze(-1) * values).sum(1), lw["wo"])
        h = _rmsnorm(x, lw["mlp_norm"])
        gate = _linear(h, lw["w_gate"])
        x = x + _linear(gate * torch.sigmoid(gate) * _linear(h, lw["w_up"]), lw["w_down"])
    ws.y[:N].copy_(x)

    if fwd_in.emit_logits:
        # The row count and the compact-or-full choice are host values: a capture keeps the ones it was given.
        compact_logits = (fwd_in.logit_row_indices_d is not None and fwd_in.num_logit_rows > 0
                          and fwd_in.num_logit_rows < N)
        lm_head_rows = N
        if compact_logits:
            rows = fwd_in.logit_row_indices_d[:fwd_in.num_logit_rows]
            ws.norm_x[:fwd_in.num_logit_rows].copy_(ws.y.index_select(0, rows))     # launch_gather_bf16_rows
            ws.norm_y[:fwd_in.num_logit_rows].copy_(_rmsnorm(ws.norm_x[:fwd_in.num_logit_rows], w["final_norm"]))
            lm_head_rows = fwd_in.num_logit_rows
        else:
            ws.norm_y[:N].copy_(_rmsnorm(ws.y[:N], w["final_norm"]))
        ws.logits[:lm_head_rows].copy_(_linear(ws.norm_y[:lm_head_rows], w["lm_head"]))
    return ws.logits


def llama_like_prefill_graph_capturable() -> bool:
    return True                     # stand-in: FlashInfer's FA2 causal prefill plan in graph mode, always


# --- batch/forward.cpp ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardFn:
    weights: dict
    graph_safe: bool = True

    def invoke_body(self, ws, kv_cache, pi, fwd_in: ForwardInputs):
        return llama_like_forward_paged(self.weights, ws, kv_cache, pi, fwd_in)

    def invoke_prefill_graph_capturable(self) -> bool:
        return llama_like_prefill_graph_capturable()

    def invoke_graph_layout(self, is_pure_decode: bool) -> int:
        return 1 if is_pure_decode else 2       # decode plan layout vs prefill plan layout


@dataclasses.dataclass
class BatchEngine:
    device: str
    forward_fn: ForwardFn
    ws: Workspace
    kv_cache: KvCache
    inputs: PersistentInputs
    graph_cache: Optional[dict]
    graph_pad_page: int
    max_forward_requests: int = MAX_FORWARD_REQUESTS
    max_workspace_tokens: int = MAX_WORKSPACE_TOKENS
    graph_outputs: dict = dataclasses.field(default_factory=dict)


def capture_forward_graph_exec(engine: BatchEngine, N: int, R: int, is_pure_decode: bool,
                               logit_row_indices_d: Optional[Tensor], num_logit_rows: int, key: ForwardGraphKey):
    fwd_in = ForwardInputs(total_tokens=N, num_requests=R, is_pure_decode=is_pure_decode,
                           logit_row_indices_d=logit_row_indices_d, num_logit_rows=num_logit_rows)

    def body():
        return engine.forward_fn.invoke_body(engine.ws, engine.kv_cache, engine.inputs, fwd_in)

    # upstream: StreamCaptureGuard on a fresh stream, cudaGraphInstantiate; nothing runs until the launch
    return capture(body, device=engine.device, warmups=0, name=f"forward R={R} N={N} variant={key.variant}")


def forward_graph_replay_eligible(engine: BatchEngine, is_pure_decode: bool, have_custom_mask: bool,
                                  forward_R: int, compact_logits: bool = False) -> bool:
    mask_pointers_stable = not have_custom_mask
    if _variant == "fix":
        # 0bb8da9a9: `num_logit_rows` is BAKED INTO the captured body but is NOT part of `ForwardGraphKey`, so a
        # compact-logit wave cannot share a graph safely.
        geometry_replayable = is_pure_decode or (
            prefill_graph_enabled() and not compact_logits and engine.forward_fn.invoke_prefill_graph_capturable())
    else:
        geometry_replayable = is_pure_decode or (
            prefill_graph_enabled() and engine.forward_fn.invoke_prefill_graph_capturable())
    return (engine.graph_cache is not None and engine.forward_fn.graph_safe and geometry_replayable
            and mask_pointers_stable and forward_R <= engine.max_forward_requests)


def run_forward_dispatch(engine: BatchEngine, s: "StepState") -> None:
    graph_eligible = forward_graph_replay_eligible(engine, s.is_pure_decode, False, s.forward_R, s.compact_logits)
    if graph_eligible:
        graph_variant = make_graph_variant(small_spec=False, rs_verify=False, have_custom_mask=False,
                                           fused_argmax=False,
                                           graph_layout=engine.forward_fn.invoke_graph_layout(s.is_pure_decode))
        key = ForwardGraphKey(s.forward_R, s.forward_N, graph_variant)
        exec_ = engine.graph_cache.get(key)
        if exec_ is None:
            # Pure decode captures full-N logits (N == R); a prefill capture records the compact row list instead
            # (upstream comment: "its count is pinned to R by the eligibility gate above" -- it is not).
            exec_, outputs = capture_forward_graph_exec(
                engine, s.forward_N, s.forward_R, s.is_pure_decode,
                engine.inputs.sample_idx if s.compact_logits else None,
                s.num_sampling if s.compact_logits else 0, key)
            engine.graph_cache[key] = exec_
            engine.graph_outputs[key] = outputs
        replay(exec_, engine.graph_outputs[key], real=s.fN_real, size=s.forward_N)      # cudaGraphLaunch
        return
    fwd_in = ForwardInputs(total_tokens=s.forward_N, num_requests=s.forward_R, is_pure_decode=s.is_pure_decode,
                           logit_row_indices_d=engine.inputs.sample_idx if s.compact_logits else None,
                           num_logit_rows=s.num_sampling if s.compact_logits else 0,
                           emit_logits=s.num_sampling > 0)
    engine.forward_fn.invoke_body(engine.ws, engine.kv_cache, engine.inputs, fwd_in)


# --- batch/frame.cpp ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Lane:
    request: "Request"
    tokens: list
    start_pos: int
    samples: bool


@dataclasses.dataclass
class StepState:
    lanes: list
    is_pure_decode: bool
    num_sampling: int = 0
    fR_real: int = 0
    fN_real: int = 0
    forward_R: int = 0
    forward_N: int = 0
    compact_logits: bool = False
    sample_rows: list = dataclasses.field(default_factory=list)
    direct_logit_rows: list = dataclasses.field(default_factory=list)


def prepare_step(engine: BatchEngine, lanes: list) -> StepState:
    is_pure_decode = all(len(lane.tokens) == 1 and lane.request.prefilled for lane in lanes)
    s = StepState(lanes=lanes, is_pure_decode=is_pure_decode)
    s.fR_real = len(lanes)
    s.fN_real = sum(len(lane.tokens) for lane in lanes)
    row = 0
    for lane in lanes:
        row += len(lane.tokens)
        if lane.samples:
            s.sample_rows.append(row - 1)
    s.num_sampling = len(s.sample_rows)
    s.forward_R, s.forward_N = s.fR_real, s.fN_real

    # Graph-lattice padding decision: pad on geometry alone, before planning.
    graph_pad_requests = graph_pad_tokens = 0
    if _variant == "fix":
        maybe_compact_logits = 0 < s.num_sampling < s.fN_real
        prefill_pad_ok = prefill_graph_enabled() and not maybe_compact_logits
    else:
        maybe_compact_logits = False
        prefill_pad_ok = prefill_graph_enabled()
    eligible = forward_graph_replay_eligible(engine, is_pure_decode or prefill_pad_ok, False, s.fR_real,
                                             maybe_compact_logits)
    if eligible and engine.graph_pad_page >= 0:
        bucket = forward_graph_request_bucket(s.fR_real, engine.max_forward_requests)
        padding = bucket - s.fR_real
        pad_tokens = max(padding, 0)                 # decode pads one token per lane
        page = engine.kv_cache.page_size()
        if not is_pure_decode:
            n_bucket = forward_graph_token_bucket(s.fN_real, engine.max_workspace_tokens)
            solved = False
            for _ in range(8):
                if n_bucket <= 0:
                    break
                want = n_bucket - s.fN_real
                lanes_needed = (want + page - 1) // page if want > 0 else 0
                r_bucket = forward_graph_request_bucket(s.fR_real + lanes_needed, engine.max_forward_requests)
                if r_bucket <= 0:
                    break
                n_lanes = r_bucket - s.fR_real
                if n_lanes <= want <= n_lanes * page:
                    bucket, padding, pad_tokens, solved = r_bucket, n_lanes, want, True
                    break
                if n_lanes > want:
                    n_bucket = forward_graph_token_bucket(s.fN_real + n_lanes, engine.max_workspace_tokens)
                    continue
                break
            if not solved:
                padding = pad_tokens = 0
        fits = padding > 0 and pad_tokens >= padding and s.fN_real + pad_tokens <= MAX_WORKSPACE_TOKENS
        if fits:
            graph_pad_requests, graph_pad_tokens = padding, pad_tokens

    # Stage the persistent inputs (real lanes, then pad lanes on the reserved page).
    tokens, positions, w_page, w_off, table = [], [], [], [], []
    for lane in lanes:
        pages = lane.request.pages + [engine.graph_pad_page] * (MAX_PAGES_PER_REQ - len(lane.request.pages))
        for i, tok in enumerate(lane.tokens):
            pos = lane.start_pos + i
            tokens.append(tok)
            positions.append(pos)
            w_page.append(lane.request.pages[pos // PAGE_SIZE])
            w_off.append(pos % PAGE_SIZE)
            table.append(pages)
    left = graph_pad_tokens
    for lane_index in range(graph_pad_requests):
        n = min(PAGE_SIZE, left - (graph_pad_requests - lane_index - 1))
        for pos in range(n):
            tokens.append(0)
            positions.append(pos)
            w_page.append(engine.graph_pad_page)
            w_off.append(pos)
            table.append([engine.graph_pad_page] * MAX_PAGES_PER_REQ)
        left -= n
    pi, dev = engine.inputs, engine.device
    n_rows = len(tokens)
    pi.tokens[:n_rows].copy_(torch.tensor(tokens, dtype=torch.long, device=dev))
    pi.positions[:n_rows].copy_(torch.tensor(positions, dtype=torch.long, device=dev))
    pi.w_page[:n_rows].copy_(torch.tensor(w_page, dtype=torch.long, device=dev))
    pi.w_off[:n_rows].copy_(torch.tensor(w_off, dtype=torch.long, device=dev))
    pi.page_table[:n_rows].copy_(torch.tensor(table, dtype=torch.long, device=dev))
    if s.sample_rows:
        pi.sample_idx[:s.num_sampling].copy_(torch.tensor(s.sample_rows, dtype=torch.long, device=dev))
    s.compact_logits = not is_pure_decode and 0 < s.num_sampling < s.fN_real
    s.forward_R = s.fR_real + graph_pad_requests
    s.forward_N = s.fN_real + graph_pad_tokens
    # Compact-logit direct rows for settlement.
    s.direct_logit_rows = list(range(s.num_sampling)) if s.compact_logits else list(s.sample_rows)
    return s


def settle_step(engine: BatchEngine, s: StepState) -> list:
    """The epilogue (stand-in: greedy argmax) over the settled rows of ``ws.logits``."""
    if not s.direct_logit_rows:
        return []
    rows = engine.ws.logits[torch.tensor(s.direct_logit_rows, device=engine.device)].clone()
    return list(zip(rows, rows.argmax(dim=-1)))


# --- the runtime (stand-in for pie's scheduler and inferlets) --------------------------------------------------------

@dataclasses.dataclass
class Request:
    prompt: list
    max_new_tokens: int
    pages: list = dataclasses.field(default_factory=list)
    num_computed: int = 0
    prefilled: bool = False
    next_token: Optional[int] = None
    generated: list = dataclasses.field(default_factory=list)
    logits_seen: list = dataclasses.field(default_factory=list)

    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


def serve(device: str, enable_cuda_graphs: bool) -> list:
    with torch.inference_mode():
        engine = BatchEngine(device=device, forward_fn=ForwardFn(build_weights(device)),
                             ws=Workspace.allocate(device), kv_cache=KvCache.allocate(device),
                             inputs=PersistentInputs.allocate(device),
                             graph_cache={} if enable_cuda_graphs else None, graph_pad_page=NUM_PAGES - 1)
        if enable_cuda_graphs:
            pi = engine.inputs
            events.static_buffers("pie BatchEngine", {
                "tokens": pi.tokens, "positions": pi.positions, "w_page": pi.w_page, "w_off": pi.w_off,
                "page_table": pi.page_table, "sample_idx": pi.sample_idx})
            events.persistent_state("pie BatchEngine", {"kv_cache.k": engine.kv_cache.k,
                                                        "kv_cache.v": engine.kv_cache.v})
            events.shared_outputs("pie BatchEngine", {"ws.logits": engine.ws.logits})
        free_pages = list(range(NUM_PAGES - 1))          # the last page is graph_pad_page
        requests = [Request(list(prompt), new) for _, prompt, new in REQUESTS]
        waiting, running, step = [], [], 0
        while step == 0 or waiting or running or any(arrival >= step for arrival, _, _ in REQUESTS):
            waiting += [r for (arrival, _, _), r in zip(REQUESTS, requests) if arrival == step]
            lanes, budget = [], MAX_FORWARD_TOKENS
            for r in running:                                # decode lanes
                pos = len(r.prompt) + len(r.generated) - 1
                if pos // PAGE_SIZE >= len(r.pages):
                    r.pages.append(free_pages.pop(0))
                lanes.append(Lane(r, [r.next_token], pos, True))
                budget -= 1
            for r in list(waiting):                          # prefill chunks, FIFO
                if budget <= 0:
                    break
                n = min(budget, len(r.prompt) - r.num_computed)
                while (r.num_computed + n - 1) // PAGE_SIZE >= len(r.pages):
                    r.pages.append(free_pages.pop(0))
                last = r.num_computed + n == len(r.prompt)
                lanes.append(Lane(r, r.prompt[r.num_computed:r.num_computed + n], r.num_computed, last))
                r.num_computed += n
                budget -= n
                if last:
                    waiting.remove(r)
            if lanes:
                s = prepare_step(engine, lanes)
                run_forward_dispatch(engine, s)
                sampled = iter(settle_step(engine, s))
                for lane in lanes:
                    if not lane.samples:
                        continue
                    logits, token = next(sampled)
                    r = lane.request
                    if not r.prefilled:
                        r.prefilled = True
                        running.append(r)
                    r.logits_seen.append(logits)
                    r.generated.append(int(token))
                    r.next_token = int(token)
                    if r.done():
                        running.remove(r)
                        free_pages += r.pages
                        r.pages = []
            step += 1
        outputs = []
        for r in requests:
            outputs.append(torch.stack(r.logits_seen).clone())
            outputs.append(torch.tensor(r.generated, dtype=DTYPE))
        return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: serve(device, enable_cuda_graphs=True),
                       lambda: serve(device, enable_cuda_graphs=False))
    finally:
        _variant = "bug"
