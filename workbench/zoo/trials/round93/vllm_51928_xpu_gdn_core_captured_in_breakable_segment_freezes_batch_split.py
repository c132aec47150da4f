"""XPU GDN op captured into a breakable-graph segment: replays reuse the capture batch's decode/prefill split.

Upstream: https://github.com/vllm-project/vllm/pull/51928 ("[Bugfix][XPU] Run GDN attention as eager break under
breakable cudagraph", vllm-project/vllm, opened 2026-08-12, merged). Read: the PR description (Qwen3.5 on XPU gives
garbage output with breakable graphs; the XPU GDN op reads and writes the conv/SSM state caches in place from
data-dependent metadata; under breakable capture the capture-time state addressing is frozen into the graph and replay
corrupts the recurrent state; fix: wrap the ``gdn_attention_core_xpu`` custom op with ``eager_break_during_capture``);
stored copies of ``vllm/_xpu_ops.py`` with ``_gdn_attention_core_xpu_impl`` (it fetches the layer and its
``GDNAttentionMetadata`` from ``get_forward_context()`` and passes the host ints ``num_prefills`` / ``num_decodes`` /
``num_spec_decodes`` / ``num_actual_tokens`` with the device tensors ``has_initial_state`` /
``non_spec_query_start_loc`` / ``non_spec_state_indices_tensor`` to ``torch.ops._xpu_C.gdn_attention``, which mutates
``self.kv_cache``) and a post-fix copy whose registration reads
``direct_register_custom_op(op_name="gdn_attention_core_xpu",
op_func=eager_break_during_capture(_gdn_attention_core_xpu_impl), mutates_args=["core_attn_out", "z"], ...)``;
``GatedDeltaNetAttention.forward_xpu`` in ``vllm/model_executor/layers/mamba/gdn_linear_attn.py`` (in_proj_qkvz /
in_proj_ba, ``torch.zeros`` core_attn_out, ``torch.empty_like`` z, the custom op, gated norm, out_proj); and the
contract of ``eager_break_during_capture`` / ``BreakableCUDAGraphCapture`` (outside a capture the call runs as is;
inside, the current segment ends, the call runs eagerly and is recorded, a new segment begins; replay runs segments
and recorded calls in order); the description of the open CUDA sibling PR #54361 for the point that breakable capture
does not consume ``splitting_ops``. The PR diff itself was not read: the pre-fix registration
(``op_func=_gdn_attention_core_xpu_impl``) is reconstructed from the PR text. The SYCL kernel is a stand-in, and so
are the runner and the capture's dummy batch.
Symptom: Qwen3.5 (hybrid GDN) on Intel XPU with ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` emits garbage; eager serving is fine.
Mechanism: breakable capture does not use ``splitting_ops``; only ops wrapped with ``eager_break_during_capture``
leave the graph. Without the wrapper, ``_gdn_attention_core_xpu_impl`` runs once, inside the segment capture, on the
dummy batch: its Python reads ``num_decodes`` / ``num_prefills`` / ``num_actual_tokens`` and slices the state-index
view with them, and the kernel launches are recorded with those numbers. Every replay repeats the dummy batch's
split: a step that mixes decodes with a new request's prompt chunk has its prompt tokens run down the decode path,
reading the SSM slot the new request inherited (a finished request's state) instead of starting from zero, and the
chunk's later token reads the null slot. The request's recurrent state is corrupt from then on. Eagerly the op reads
this step's metadata.
Doctor: host-work-frozen, at _gdn_attention_core_xpu_impl. Its host work (reading this step's metadata from the
forward context: the decode/prefill split and token count that pick the rows, paths and state slots) runs once at
capture; replays repeat only the recorded kernels with the dummy batch's numbers.
Fix (upstream): register the op as ``eager_break_during_capture(_gdn_attention_core_xpu_impl)``: the capture ends the
segment before it, runs the op eagerly and records it, and every replay calls it again with the live forward context.
Modelled: ``GatedDeltaNetAttention.forward_xpu``, ``_gdn_attention_core_xpu_impl`` (same metadata reads),
``register_ops_once`` / ``direct_register_custom_op`` (the variant switches the ``op_func``), ``GDNAttentionMetadata``,
``get_forward_context`` / ``set_forward_context`` (``attn_metadata`` keyed by prefix, ``no_compile_layers``),
``eager_break_during_capture`` and ``BreakableCUDAGraphCapture`` (segments in one pool, recorded eager calls replayed
in order). Stand-ins: ``_xpu_C.gdn_attention`` is a torch gated delta rule (no causal conv, no conv state): decode rows
update their slot's state in one step; prefill tokens run sequentially, each finding its request on the device from
``non_spec_query_start_loc`` and starting from zero when ``has_initial_state`` is false; ``RMSNormGated`` is
rmsnorm * silu(z). The runner (``BreakableGDNRunner``) keeps persistent hidden-state and metadata buffers (state slots
from the block table; rows past the batch point at null slot 0), captures token sizes [2, 4] after a warmup on a
dummy all-decode batch on slot 0, pads a step to a captured size, and sets the forward context before each replay.
One layer, hidden 8, one head of 4x4, 6 SSM slots, float64.
Workload: step 1 decodes A, B, C, D (4 tokens); D finishes and its slot goes to E; step 2 serves A, B as decodes and
E's 2-token prompt (4 tokens: 2 decodes + 1 prefill); steps 3-4 decode A, B, E (3 tokens, padded to 4); step 5
decodes A, E (size 2). Outputs of the real rows are compared with the same steps run without graphs. The bug equals
eager on step 1 (the dummy batch's split) and differs from step 2 on (per step 0, 1.16, 0.92, 0.19, 0.003: E's state
stays corrupt); the fix equals eager (0).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, remember_step

UPSTREAM = "https://github.com/vllm-project/vllm/pull/51928"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_gdn_attention_core_xpu_impl"
SYMPTOM = ("Qwen3.5 on XPU with breakable CUDA graphs emits garbage: the GDN custom op is captured inside a graph "
           "segment, so every replay reuses the capture batch's decode/prefill split and state slots and corrupts "
           "the recurrent state")

HIDDEN = 8
NUM_K_HEADS = NUM_V_HEADS = 1
HEAD_K_DIM = HEAD_V_DIM = 4
NUM_SLOTS = 6                      # SSM state slots; slot 0 is the null slot
NULL_SLOT = 0
MAX_NUM_REQS = 4
CUDAGRAPH_CAPTURE_SIZES = [2, 4]   # tokens per step
PREFIX = "model.layers.0.linear_attn"


# ---------------------------------------------------------------------------------------- forward context
@dataclasses.dataclass
class GDNAttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor            # [num_reqs] bool
    non_spec_query_start_loc: torch.Tensor     # [num_reqs + 1] int32
    non_spec_state_indices_tensor: torch.Tensor  # [num_reqs] int32
    num_spec_decodes: int = 0
    spec_sequence_masks: torch.Tensor | None = None


@dataclasses.dataclass
class ForwardContext:
    no_compile_layers: dict
    attn_metadata: dict | None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "forward context is not set"
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata, no_compile_layers):
    global _forward_context
    prev, _forward_context = _forward_context, ForwardContext(no_compile_layers, attn_metadata)
    try:
        yield
    finally:
        _forward_context = prev


# ---------------------------------------------------------------------------------------- breakable capture
class BreakableCUDAGraphCapture:
    """Capture split into graph segments at eager breaks; replay runs segments and recorded calls in order."""

    _current: BreakableCUDAGraphCapture | None = None

    def __init__(self, device, pool, name):
        self.device, self.pool, self.name = device, pool, name
        self.segments: list = []          # graphs and (fn, args, kwargs) eager calls, in order
        self.graphs: list = []
        self.is_capturing = False
        self._ctx = None

    @classmethod
    def current(cls):
        return cls._current

    def _begin_segment(self):
        g = new_graph(self.device)
        self._ctx = graph(g, pool=self.pool, name=f"{self.name} segment {len(self.graphs)}")
        self._ctx.__enter__()
        self.segments.append(g)
        self.graphs.append(g)

    def _end_segment(self):
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)

    @contextlib.contextmanager
    def capturing(self):
        BreakableCUDAGraphCapture._current = self
        self.is_capturing = True
        self._begin_segment()
        try:
            yield self
        except BaseException as e:
            if self._ctx is not None:
                ctx, self._ctx = self._ctx, None
                ctx.__exit__(type(e), e, e.__traceback__)
            raise
        else:
            self._end_segment()
        finally:
            self.is_capturing = False
            BreakableCUDAGraphCapture._current = None

    def add_eager_break(self, fn, args, kwargs):
        self._end_segment()
        with events.dummy_run():
            out = fn(*args, **kwargs)
        self.segments.append((fn, args, kwargs))
        self._begin_segment()
        return out

    def replay(self):
        for segment in self.segments:
            if isinstance(segment, tuple):
                fn, args, kwargs = segment
                fn(*args, **kwargs)
            else:
                segment.replay()


def eager_break_during_capture(fn):
    """Run a custom-op implementation eagerly between graph segments during breakable capture (and replay)."""
    def wrapper(*args, **kwargs):
        capture = BreakableCUDAGraphCapture.current()
        if capture is None or not capture.is_capturing:
            return fn(*args, **kwargs)
        return capture.add_eager_break(fn, args, kwargs)
    wrapper.__name__ = fn.__name__
    return wrapper


# ---------------------------------------------------------------------------------------- the XPU kernel (stand-in)
def _l2norm(x):
    return x / x.pow(2).sum(-1, keepdim=True).add(1e-6).sqrt()


def _gated_delta_step(state, q, k, v, g, beta):
    """One token per row: S <- exp(g) S + beta k (v - S^T k)^T ; o = S^T q. state [n, dk, dv]."""
    state = state * g.exp().view(-1, 1, 1)
    pred = torch.einsum("nkv,nk->nv", state, k)
    state = state + torch.einsum("nk,nv->nkv", k, (v - pred) * beta.view(-1, 1))
    return state, torch.einsum("nkv,nk->nv", state, q)


class _xpu_C:  # noqa: N801 - spelled as torch.ops._xpu_C
    @staticmethod
    def gdn_attention(core_attn_out, z, projected_states_qkvz, projected_states_ba, num_k_heads, num_v_heads,
                      head_k_dim, head_v_dim, *, ssm_state, A_log, dt_bias, num_prefills, num_decodes,
                      num_spec_decodes, has_initial_state, non_spec_query_start_loc, non_spec_state_indices_tensor,
                      num_actual_tokens):
        n = num_actual_tokens
        q, k, v, zz = projected_states_qkvz[:n].split([head_k_dim, head_k_dim, head_v_dim, head_v_dim], dim=-1)
        z[:n].copy_(zz.view(n, num_v_heads, head_v_dim))
        b, a = projected_states_ba[:n].split(num_v_heads, dim=-1)
        beta = torch.sigmoid(b).view(n)
        g = (-A_log.exp() * F.softplus(a + dt_bias)).view(n)
        q, k = _l2norm(q) * head_k_dim ** -0.5, _l2norm(k)
        out = core_attn_out.view(core_attn_out.shape[0], -1)
        if num_decodes > 0:                                   # one token per request, state from its slot
            idx = non_spec_state_indices_tensor[:num_decodes].long()
            state = ssm_state.index_select(0, idx)
            state, o = _gated_delta_step(state, q[:num_decodes], k[:num_decodes], v[:num_decodes],
                                         g[:num_decodes], beta[:num_decodes])
            ssm_state.index_copy_(0, idx, state)
            out[:num_decodes].copy_(o)
        if num_prefills > 0:                                  # prompt tokens in order, request found on the device
            num_reqs = num_decodes + num_prefills
            ends = non_spec_query_start_loc[1:num_reqs + 1]
            for t in range(num_decodes, n):
                req = (ends <= t).sum().view(1)
                slot = non_spec_state_indices_tensor.index_select(0, req).long()
                first = non_spec_query_start_loc.index_select(0, req) == t
                fresh = first & ~has_initial_state.index_select(0, req)
                state = ssm_state.index_select(0, slot)
                state = torch.where(fresh.view(1, 1, 1), torch.zeros_like(state), state)
                state, o = _gated_delta_step(state, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
                ssm_state.index_copy_(0, slot, state)
                out[t:t + 1].copy_(o)


# ---------------------------------------------------------------------------------------- vllm/_xpu_ops.py
def _gdn_attention_core_xpu_impl(core_attn_out, z, projected_states_qkvz, projected_states_ba, layer_name):
    """Custom op wrapping the XPU SYCL GDN kernel for torch.compile."""
    forward_context = get_forward_context()
    self = forward_context.no_compile_layers[layer_name]
    attn_metadata_raw = forward_context.attn_metadata

    if attn_metadata_raw is None:
        return

    assert isinstance(attn_metadata_raw, dict)
    attn_metadata = attn_metadata_raw[self.prefix]
    assert isinstance(attn_metadata, GDNAttentionMetadata)

    num_actual_tokens = attn_metadata.num_actual_tokens
    num_prefills = attn_metadata.num_prefills
    num_decodes = attn_metadata.num_decodes
    num_spec_decodes = attn_metadata.num_spec_decodes
    has_initial_state = attn_metadata.has_initial_state
    non_spec_query_start_loc = attn_metadata.non_spec_query_start_loc
    non_spec_state_indices_tensor = attn_metadata.non_spec_state_indices_tensor.contiguous()
    assert attn_metadata.spec_sequence_masks is None

    _xpu_C.gdn_attention(
        core_attn_out, z, projected_states_qkvz, projected_states_ba,
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
        ssm_state=self.kv_cache[0], A_log=self.A_log, dt_bias=self.dt_bias,
        num_prefills=num_prefills, num_decodes=num_decodes, num_spec_decodes=num_spec_decodes,
        has_initial_state=has_initial_state, non_spec_query_start_loc=non_spec_query_start_loc,
        non_spec_state_indices_tensor=non_spec_state_indices_tensor, num_actual_tokens=num_actual_tokens,
    )


def _gdn_attention_core_xpu_fake(core_attn_out, z, projected_states_qkvz, projected_states_ba, layer_name):
    return


class _VllmOps:
    """``torch.ops.vllm``: the registered custom ops."""


vllm_ops = _VllmOps()
_OPS_REGISTERED = False


def direct_register_custom_op(op_name, op_func, mutates_args, fake_impl):
    setattr(vllm_ops, op_name, op_func)


def register_ops_once(variant):
    global _OPS_REGISTERED
    if _OPS_REGISTERED == variant:
        return
    direct_register_custom_op(
        op_name="gdn_attention_core_xpu",
        op_func=(eager_break_during_capture(_gdn_attention_core_xpu_impl) if variant == "fix"
                 else _gdn_attention_core_xpu_impl),
        mutates_args=["core_attn_out", "z"],
        fake_impl=_gdn_attention_core_xpu_fake,
    )
    _OPS_REGISTERED = variant


# ---------------------------------------------------------------------------------------- the layer
class GatedDeltaNetAttention(torch.nn.Module):
    def __init__(self, device, prefix=PREFIX):
        super().__init__()
        gen = generator(51928)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.prefix = prefix
        self.num_k_heads, self.num_v_heads = NUM_K_HEADS, NUM_V_HEADS
        self.head_k_dim, self.head_v_dim = HEAD_K_DIM, HEAD_V_DIM
        self.tp_size = 1
        self.w_qkvz = r(HIDDEN, 2 * HEAD_K_DIM + 2 * HEAD_V_DIM, scale=0.6)
        self.w_ba = r(HIDDEN, 2 * NUM_V_HEADS, scale=0.6)
        self.A_log = r(NUM_V_HEADS, scale=0.3)
        self.dt_bias = r(NUM_V_HEADS, scale=0.3)
        self.norm_weight = 1.0 + r(HEAD_V_DIM, scale=0.1)
        self.w_out = r(NUM_V_HEADS * HEAD_V_DIM, HIDDEN, scale=0.6)
        ssm = torch.zeros(NUM_SLOTS, HEAD_K_DIM, HEAD_V_DIM, dtype=torch.float64, device=device)
        ssm[1:] = r(NUM_SLOTS - 1, HEAD_K_DIM, HEAD_V_DIM, scale=0.8)   # prompts already in the cache
        self.kv_cache = (ssm,)

    def in_proj_qkvz(self, x):
        return x @ self.w_qkvz, None

    def in_proj_ba(self, x):
        return x @ self.w_ba, None

    def norm(self, x, gate):
        x = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * self.norm_weight
        return x * F.silu(gate)

    def out_proj(self, x):
        return x @ self.w_out, None

    def forward_xpu(self, hidden_states):
        num_tokens = hidden_states.size(0)
        # Part 1: Input Projection
        projected_states_qkvz, _ = self.in_proj_qkvz(hidden_states)
        projected_states_ba, _ = self.in_proj_ba(hidden_states)
        # Part 2: Core Attention
        core_attn_out = torch.zeros((num_tokens, self.num_v_heads // self.tp_size, self.head_v_dim),
                                    dtype=hidden_states.dtype, device=hidden_states.device)
        z = torch.empty_like(core_attn_out)
        vllm_ops.gdn_attention_core_xpu(core_attn_out, z, projected_states_qkvz, projected_states_ba, self.prefix)
        # Part 3: Output Projection
        z_shape_og = z.shape
        core_attn_out = core_attn_out.reshape(-1, core_attn_out.shape[-1])
        z = z.reshape(-1, z.shape[-1])
        core_attn_out = self.norm(core_attn_out, z)
        core_attn_out = core_attn_out.reshape(z_shape_og).flatten(-2)
        out, _ = self.out_proj(core_attn_out)
        return out


# ---------------------------------------------------------------------------------------- runner (stand-in)
class GDNMetadataBuffers:
    """The runner's persistent GDN metadata: per-request query_start_loc, state slots (block table column 0) and
    has_initial_state; rows past the batch are neutralised (null slot, no initial state)."""

    def __init__(self, device):
        self.device = device
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.state_indices = torch.full((MAX_NUM_REQS,), NULL_SLOT, dtype=torch.int32, device=device)
        self.has_initial_state = torch.zeros(MAX_NUM_REQS, dtype=torch.bool, device=device)

    def build(self, prefix, num_decodes, prefill_lens, slots, has_initial, num_tokens):
        num_reqs = num_decodes + len(prefill_lens)
        lens = [1] * num_decodes + list(prefill_lens)
        qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        self.query_start_loc[:num_reqs + 1].copy_(qsl.to(self.device))
        self.query_start_loc[num_reqs + 1:].fill_(int(qsl[-1]))
        self.state_indices[:num_reqs].copy_(torch.tensor(slots, dtype=torch.int32).to(self.device))
        self.state_indices[num_reqs:].fill_(NULL_SLOT)
        self.has_initial_state[:num_reqs].copy_(torch.tensor(has_initial, dtype=torch.bool).to(self.device))
        self.has_initial_state[num_reqs:].fill_(False)
        md = GDNAttentionMetadata(
            num_prefills=len(prefill_lens), num_prefill_tokens=sum(prefill_lens), num_decodes=num_decodes,
            num_decode_tokens=num_decodes, num_actual_tokens=num_tokens,
            has_initial_state=self.has_initial_state[:num_reqs],
            non_spec_query_start_loc=self.query_start_loc[:num_reqs + 1],
            non_spec_state_indices_tensor=self.state_indices[:num_reqs])
        return {prefix: md}


class BreakableGDNRunner:
    """Persistent inputs and GDN metadata buffers; one breakable capture per token size; steps padded to a size."""

    def __init__(self, layer, device):
        self.layer, self.device = layer, device
        self.hidden_states = torch.zeros(max(CUDAGRAPH_CAPTURE_SIZES), HIDDEN, dtype=torch.float64, device=device)
        self.meta = GDNMetadataBuffers(device)
        self.layers = {layer.prefix: layer}
        self.pool = graph_pool_handle(device)
        self.captures, self.outputs = {}, {}
        owner = "BreakableGDNRunner"
        events.static_buffers(owner, {"hidden_states": self.hidden_states,
                                      "query_start_loc": self.meta.query_start_loc,
                                      "state_indices": self.meta.state_indices,
                                      "has_initial_state": self.meta.has_initial_state})
        events.persistent_state(owner, {"ssm_state": layer.kv_cache[0]})
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            # dummy run: `size` single-token decodes on the null slot
            metadata = self.meta.build(layer.prefix, size, [], [NULL_SLOT] * size, [False] * size, size)
            with set_forward_context(metadata, self.layers):
                with events.warmup():
                    layer.forward_xpu(self.hidden_states[:size])
                cap = BreakableCUDAGraphCapture(device, self.pool, f"gdn [{size}]")
                with cap.capturing():
                    out = layer.forward_xpu(self.hidden_states[:size])
            for g in cap.graphs:
                remember_step(g, lambda size=size: self.layer.forward_xpu(self.hidden_states[:size]))
            self.captures[size], self.outputs[size] = cap, out

    def execute(self, hidden_states, num_decodes, prefill_lens, slots, has_initial):
        n = hidden_states.shape[0]
        size = next(s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= n)
        self.hidden_states[:n].copy_(hidden_states)           # padded rows keep what earlier steps left
        metadata = self.meta.build(self.layer.prefix, num_decodes, prefill_lens, slots, has_initial, n)
        cap, out = self.captures[size], self.outputs[size]
        with set_forward_context(metadata, self.layers):
            eager = lambda: self.layer.forward_xpu(self.hidden_states[:size])  # noqa: E731
            padded = {"hidden_states": self.hidden_states}
            split = len(cap.graphs) > 1
            for i, segment in enumerate(cap.segments):
                if isinstance(segment, tuple):                # recorded eager break: called again, live context
                    fn, args, kwargs = segment
                    fn(*args, **kwargs)
                    continue
                first = i == 0
                events.serve(segment, n, size, padded=padded, outputs=out,
                             eager=eager if (first or not split) else None,
                             pieces=tuple(cap.graphs) if (first and split) else ())
                segment.replay()
            events.handed_out(cap.graphs[-1], out)
        return out[:n]


# ---------------------------------------------------------------------------------------- workload
A, B, C, D = 1, 2, 3, 4
E = D                              # E takes the slot D released

STEPS = [
    # (num_decodes, prefill lengths, slots per request, has_initial_state per request)
    (4, [], [A, B, C, D], [True, True, True, True]),
    (2, [2], [A, B, E], [True, True, False]),
    (3, [], [A, B, E], [True, True, True]),
    (3, [], [A, B, E], [True, True, True]),
    (2, [], [A, E], [True, True]),
]


def run(variant: str, device: str = "cpu"):
    register_ops_once(variant)
    gen = generator(93)
    inputs = [randn(nd + sum(pl), HIDDEN, gen=gen, device=device).double() for nd, pl, _, _ in STEPS]

    def serve(use_graphs):
        layer = GatedDeltaNetAttention(device)
        runner = BreakableGDNRunner(layer, device) if use_graphs else None   # captured at startup
        meta = GDNMetadataBuffers(device)
        outs = []
        for x, (nd, pl, slots, init) in zip(inputs, STEPS):
            if runner is not None:
                outs.append(runner.execute(x, nd, pl, slots, init).clone())
                continue
            metadata = meta.build(layer.prefix, nd, pl, slots, init, x.shape[0])
            with set_forward_context(metadata, {layer.prefix: layer}):
                outs.append(layer.forward_xpu(x).clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
