"""XPU GDN on PIECEWISE graphs: the eager ``gdn_attention`` op between the pieces demands exactly ``num_actual_tokens`` rows, so a padded decode batch aborts.

Upstream: https://github.com/vllm-project/vllm-xpu-kernels/pull/344 ("[GDN] Accept padded leading dim and slice to
num_actual_tokens", vllm-project/vllm-xpu-kernels, the XPU kernel library of the vLLM XPU platform; opened
2026-05-13, merged 2026-05-17 as ae5ba48; fixes issue #320, "GDN kernel rejects padded inputs from torch.compile /
cudagraph capture (incompatible with vLLM PIECEWISE)"). Read: the PR description and the issue's stored text (the
three ``TORCH_CHECK(... size(0) == num_actual_tokens)`` lines, the repro: a hybrid GDN model on an Arc B70,
``VLLM_XPU_ENABLE_XPU_GRAPH=1``, ``cudagraph_capture_sizes [1, 4]``, three concurrent decode streams, "fine on warmup
(dummy shapes happen to match), crashes on live requests"); the commit's diff of
``csrc/xpu/gdn_attn/gdn_attn_interface.cpp`` and the whole pre-fix file (fetched repository: the checks, the
``NATIVE_LAUNCHER`` that allocates q/k/v/b/a with ``num_actual_tokens`` rows, then ``causal_conv1d`` and
``gated_delta_rule``); the new test ``tests/gdn_attn/test_gdn_attn_padded.py`` (padded call equals the exact-size call
on the active prefix; the padded tail stays at its zero init); vLLM's ``_gdn_attention_core_xpu_impl`` in a stored
``vllm/_xpu_ops.py`` (the custom op, a splitting op, that fetches the layer and its ``GDNAttentionMetadata`` from the
forward context and returns when ``attn_metadata`` is None); the description of the closed vLLM-side PR #42383 (same
slice in the wrapper; the error it quotes, "Expected core_attn_out.size(0) == num_actual_tokens to be true").
Symptom: ``RuntimeError: Expected core_attn_out.size(0) == num_actual_tokens to be true`` from the GDN custom op; the
engine dies on the first live decode batch that is padded to a captured size.
Mechanism: under PIECEWISE graphs the runner pads the step's tokens to the captured size; the graph pieces compute
``projected_states_qkvz`` / ``projected_states_ba`` and allocate ``core_attn_out`` / ``z`` for the padded rows, while
``attn_metadata.num_actual_tokens`` stays at the real count. The op sits between two pieces and gets both: the padded
tensors and the real count. Its shape checks require them to agree. During capture the dummy run carries no
attention metadata, and eagerly nothing is padded, so neither ever meets a padded row.
Doctor: padded-shape-mismatch, at gdn_attention: code run at the graph's padded size combines tensors sized for the
padded rows with the real row count.
Fix (upstream): the op accepts ``size(0) >= num_actual_tokens`` and narrows ``core_attn_out``, ``z`` and both
projected-state inputs to their first ``num_actual_tokens`` rows (contiguous views of the caller's buffers), so it
writes the active prefix and leaves the padded tail as it was.
Modelled: ``gdn_attention`` (signature, shape checks and narrowing as in the C++ interface; the kernels are
stand-ins), ``_gdn_attention_core_xpu_impl`` and the forward context as in vLLM, ``GatedDeltaNetAttention.forward_xpu``
split at the custom op into ``submod_0`` / ``submod_1`` as the PIECEWISE backend splits it. Stand-ins: the SYCL
``causal_conv1d`` and ``gated_delta_rule`` (torch, per request, state slots from ``non_spec_state_indices_tensor``, a
zero state without ``has_initial_state``); the model (embedding, one GDN layer, LM head); the runner (pieces captured
for sizes [1, 4] with no attention metadata, a step of at most 4 tokens padded to the next size, larger steps eager).
float64.
Workload: step 1 prefills A (5 tokens), B (3) and C (4): 12 tokens, above the largest size, eager. Steps 2-3 decode
A, B, C (3 tokens, the 4-token pieces); step 4 decodes A and B (2 tokens, padded to 4); step 5 decodes A (the 1-token
pieces). Bug: step 2 raises ``RuntimeError: Expected core_attn_out.size(0) == num_actual_tokens to be true, but got
false.`` as upstream (step 1 ran eagerly and had equalled eager); fix: the logits of all 21 tokens equal eager (max
|graph - eager| = 1.8e-15, float64 rounding of the padded matmuls), the padded tail of ``core_attn_out`` stays zero.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-xpu-kernels/pull/344"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "gdn_attention"
SYMPTOM = ("XPU GDN models under PIECEWISE graphs: a decode batch smaller than its captured size aborts the engine "
           "in the GDN op: Expected core_attn_out.size(0) == num_actual_tokens to be true")

NUM_K_HEADS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, TP_SIZE = 1, 2, 4, 4, 1
CONV_WIDTH = 3
HIDDEN, VOCAB = 8, 16
MAX_NUM_REQS, MAX_NUM_TOKENS = 4, 16
CUDAGRAPH_CAPTURE_SIZES = [1, 4]              # the issue's --compilation-config cudagraph_capture_sizes
NUM_SLOTS = 1 + MAX_NUM_REQS
PREFIX = "model.layers.0.linear_attn"
DTYPE = torch.float64
MIXED_QKVZ = NUM_K_HEADS // TP_SIZE * (2 * HEAD_K_DIM + 2 * HEAD_V_DIM * NUM_V_HEADS // NUM_K_HEADS)
MIXED_BA = NUM_K_HEADS // TP_SIZE * (2 * NUM_V_HEADS // NUM_K_HEADS)
MIXED_QKV = NUM_K_HEADS // TP_SIZE * (2 * HEAD_K_DIM + HEAD_V_DIM * NUM_V_HEADS // NUM_K_HEADS)

_variant = "bug"


def TORCH_CHECK(cond, expr):  # noqa: N802 - as in the C++ source
    if not cond:
        raise RuntimeError(f"Expected {expr} to be true, but got false.")


# --- csrc/xpu/gdn_attn (kernels are stand-ins) ------------------------------------------------------------------------

def causal_conv1d(q, k, v, z, b, a, projected_states_qkvz, projected_states_ba, conv_weights, conv_bias, conv_state,
                  non_spec_query_start_loc, non_spec_state_indices_tensor, has_initial_state, activation):
    """Split the projections, run the causal conv over q/k/v with each request's conv state, write z, b, a."""
    n = q.shape[0]
    qkv, zz = projected_states_qkvz.split([MIXED_QKV, NUM_V_HEADS * HEAD_V_DIM], dim=-1)
    z.copy_(zz.view(n, NUM_V_HEADS, HEAD_V_DIM))
    bb, aa = projected_states_ba.split(NUM_V_HEADS, dim=-1)
    b.copy_(bb)
    a.copy_(aa)
    starts, slots = non_spec_query_start_loc.tolist(), non_spec_state_indices_tensor.tolist()
    for r, slot in enumerate(slots):
        init = conv_state[slot] if bool(has_initial_state[r]) else torch.zeros_like(conv_state[slot])
        window = torch.cat([init, qkv[starts[r]:starts[r + 1]]])              # [width - 1 + len, dim]
        for t in range(starts[r], starts[r + 1]):
            j = t - starts[r]
            y = (window[j:j + CONV_WIDTH].t() * conv_weights).sum(-1) + conv_bias
            y = F.silu(y) if activation == "silu" else y
            q[t], k[t], v[t] = (x.reshape(like.shape[1:]) for x, like in
                                zip(y.split([HEAD_K_DIM, HEAD_K_DIM, NUM_V_HEADS * HEAD_V_DIM]), (q, k, v)))
        conv_state[slot] = window[-(CONV_WIDTH - 1):]


def gated_delta_rule(core_attn_out, q, k, v, b, a, A_log, dt_bias, ssm_state, non_spec_query_start_loc,
                     non_spec_state_indices_tensor, has_initial_state):
    """S <- exp(g) S + beta (v - S k) k^T per token, o = S q; S is [v heads, head_v, head_k] per slot."""
    starts, slots = non_spec_query_start_loc.tolist(), non_spec_state_indices_tensor.tolist()
    qn = q / q.pow(2).sum(-1, keepdim=True).add(1e-6).sqrt() * HEAD_K_DIM ** -0.5
    kn = k / k.pow(2).sum(-1, keepdim=True).add(1e-6).sqrt()
    g, beta = -A_log.exp() * F.softplus(a + dt_bias), torch.sigmoid(b)
    for r, slot in enumerate(slots):
        state = ssm_state[slot].clone() if bool(has_initial_state[r]) else torch.zeros_like(ssm_state[slot])
        for t in range(starts[r], starts[r + 1]):
            state = state * g[t].exp()[:, None, None]
            pred = torch.einsum("hvk,k->hv", state, kn[t, 0])
            state = state + torch.einsum("hv,k->hvk", (v[t] - pred) * beta[t][:, None], kn[t, 0])
            core_attn_out[t] = torch.einsum("hvk,k->hv", state, qn[t, 0])
        ssm_state[slot] = state


def gdn_attention(core_attn_out, z, projected_states_qkvz, projected_states_ba, num_k_heads, num_v_heads,
                  head_k_dim, head_v_dim, conv_state, ssm_state, conv_weights, conv_bias, activation, A_log, dt_bias,
                  num_prefills, num_decodes, has_initial_state, non_spec_query_start_loc,
                  non_spec_state_indices_tensor, num_actual_tokens, tp_size, reorder_input):
    if _variant == "bug":
        # check core_attn_out / z / projected_states_{qkvz,ba} shapes
        TORCH_CHECK(core_attn_out.size(0) == num_actual_tokens, "core_attn_out.size(0) == num_actual_tokens")
        TORCH_CHECK(core_attn_out.size(1) == num_v_heads // tp_size, "core_attn_out.size(1) == num_v_heads / tp_size")
        TORCH_CHECK(z.size(0) == core_attn_out.size(0), "z.size(0) == core_attn_out.size(0)")
        TORCH_CHECK(projected_states_qkvz.size(0) == num_actual_tokens,
                    "projected_states_qkvz.size(0) == num_actual_tokens")
        TORCH_CHECK(projected_states_ba.size(0) == num_actual_tokens,
                    "projected_states_ba.size(0) == num_actual_tokens")
        core_attn_out_active, z_active = core_attn_out, z
        projected_states_qkvz_active, projected_states_ba_active = projected_states_qkvz, projected_states_ba
    else:
        # Callers running under torch.compile + cudagraph capture pad the leading dim to the captured graph size
        # while num_actual_tokens stays at the real count: accept size(0) >= num_actual_tokens, narrow below.
        TORCH_CHECK(core_attn_out.size(0) >= num_actual_tokens, "core_attn_out.size(0) >= num_actual_tokens")
        TORCH_CHECK(core_attn_out.size(1) == num_v_heads // tp_size, "core_attn_out.size(1) == num_v_heads / tp_size")
        TORCH_CHECK(z.size(0) == core_attn_out.size(0), "z.size(0) == core_attn_out.size(0)")
        TORCH_CHECK(projected_states_qkvz.size(0) >= num_actual_tokens,
                    "projected_states_qkvz.size(0) >= num_actual_tokens")
        TORCH_CHECK(projected_states_ba.size(0) >= num_actual_tokens,
                    "projected_states_ba.size(0) >= num_actual_tokens")
        core_attn_out_active = core_attn_out.narrow(0, 0, num_actual_tokens)
        z_active = z.narrow(0, 0, num_actual_tokens)
        projected_states_qkvz_active = projected_states_qkvz.narrow(0, 0, num_actual_tokens)
        projected_states_ba_active = projected_states_ba.narrow(0, 0, num_actual_tokens)
    TORCH_CHECK(activation in ("silu", "swish"), "activation is silu or swish")

    # NATIVE_LAUNCHER
    dtype, device = projected_states_qkvz.dtype, projected_states_qkvz.device
    q = torch.empty(num_actual_tokens, num_k_heads // tp_size, head_k_dim, dtype=dtype, device=device)
    k = torch.empty(num_actual_tokens, num_k_heads // tp_size, head_k_dim, dtype=dtype, device=device)
    v = torch.empty(num_actual_tokens, num_v_heads // tp_size, head_v_dim, dtype=dtype, device=device)
    b = torch.empty(num_actual_tokens, num_v_heads // tp_size, dtype=dtype, device=device)
    a = torch.empty(num_actual_tokens, num_v_heads // tp_size, dtype=dtype, device=device)
    causal_conv1d(q, k, v, z_active, b, a, projected_states_qkvz_active, projected_states_ba_active, conv_weights,
                  conv_bias, conv_state, non_spec_query_start_loc, non_spec_state_indices_tensor, has_initial_state,
                  activation)
    gated_delta_rule(core_attn_out_active, q, k, v, b, a, A_log, dt_bias, ssm_state, non_spec_query_start_loc,
                     non_spec_state_indices_tensor, has_initial_state)


# --- vllm/_xpu_ops.py and the forward context -------------------------------------------------------------------------

@dataclasses.dataclass
class GDNAttentionMetadata:
    num_prefills: int
    num_decodes: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor
    non_spec_query_start_loc: torch.Tensor
    non_spec_state_indices_tensor: torch.Tensor
    num_spec_decodes: int = 0
    spec_sequence_masks: torch.Tensor | None = None


@dataclasses.dataclass
class ForwardContext:
    no_compile_layers: dict
    attn_metadata: dict | None


_forward_context: ForwardContext | None = None


def get_forward_context():
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

    # TODO: xpu does not support speculative decoding yet
    assert attn_metadata.spec_sequence_masks is None

    conv_weights = self.conv1d_weight.view(self.conv1d_weight.size(0), self.conv1d_weight.size(2))

    gdn_attention(
        core_attn_out, z, projected_states_qkvz, projected_states_ba,
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
        conv_state=self.kv_cache[0], ssm_state=self.kv_cache[1], conv_weights=conv_weights,
        conv_bias=self.conv1d_bias, activation=self.activation, A_log=self.A_log, dt_bias=self.dt_bias,
        num_prefills=attn_metadata.num_prefills, num_decodes=attn_metadata.num_decodes,
        has_initial_state=attn_metadata.has_initial_state,
        non_spec_query_start_loc=attn_metadata.non_spec_query_start_loc,
        non_spec_state_indices_tensor=attn_metadata.non_spec_state_indices_tensor,
        num_actual_tokens=attn_metadata.num_actual_tokens, tp_size=self.tp_size, reorder_input=False,
    )


# --- the model, split at the custom op as the PIECEWISE backend splits it ---------------------------------------------

class GatedDeltaNetAttention:
    def __init__(self, device):
        gen = generator(344)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.prefix, self.activation = PREFIX, "silu"
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = (NUM_K_HEADS, NUM_V_HEADS,
                                                                                HEAD_K_DIM, HEAD_V_DIM)
        self.tp_size = TP_SIZE
        self.w_qkvz, self.w_ba = r(HIDDEN, MIXED_QKVZ, scale=0.6), r(HIDDEN, MIXED_BA, scale=0.6)
        self.conv1d_weight, self.conv1d_bias = r(MIXED_QKV, 1, CONV_WIDTH), r(MIXED_QKV, scale=0.1)
        self.A_log, self.dt_bias = r(NUM_V_HEADS, scale=0.3), r(NUM_V_HEADS, scale=0.3)
        self.norm_weight = 1.0 + r(HEAD_V_DIM, scale=0.1)
        self.w_out = r(NUM_V_HEADS * HEAD_V_DIM, HIDDEN, scale=0.6)
        self.kv_cache = (torch.zeros(NUM_SLOTS, CONV_WIDTH - 1, MIXED_QKV, dtype=DTYPE, device=device),
                         torch.zeros(NUM_SLOTS, NUM_V_HEADS, HEAD_V_DIM, HEAD_K_DIM, dtype=DTYPE, device=device))


class Model:
    def __init__(self, device):
        gen = generator(3440)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.linear_attn = GatedDeltaNetAttention(device)

    def submod_0(self, input_ids):
        """Embedding and Part 1 (input projection) of forward_xpu; allocates the custom op's outputs."""
        layer = self.linear_attn
        hidden_states = self.embed_tokens[input_ids]
        projected_states_qkvz, projected_states_ba = hidden_states @ layer.w_qkvz, hidden_states @ layer.w_ba
        core_attn_out = torch.zeros((hidden_states.size(0), NUM_V_HEADS // TP_SIZE, HEAD_V_DIM),
                                    dtype=DTYPE, device=hidden_states.device)
        z = torch.empty_like(core_attn_out)
        return hidden_states, projected_states_qkvz, projected_states_ba, core_attn_out, z

    def submod_1(self, hidden_states, core_attn_out, z):
        """Part 3 (gated norm, output projection), the residual and the LM head."""
        layer = self.linear_attn
        x = core_attn_out / core_attn_out.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * layer.norm_weight
        out = (x * F.silu(z)).flatten(-2) @ layer.w_out
        return (hidden_states + out) @ self.lm_head

    def forward(self, input_ids):
        hidden_states, qkvz, ba, core_attn_out, z = self.submod_0(input_ids)
        _gdn_attention_core_xpu_impl(core_attn_out, z, qkvz, ba, PREFIX)        # torch.ops.vllm.gdn_attention_core_xpu
        return self.submod_1(hidden_states, core_attn_out, z)


class XPUModelRunner:
    def __init__(self, device, use_graph):
        self.device, self.use_graph = device, use_graph
        self.model = Model(device)
        self.layers = {PREFIX: self.model.linear_attn}
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.graphs, self.slots, self.num_computed = {}, {}, {}
        if use_graph:
            self.capture_model()

    def capture_model(self):
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):     # PIECEWISE dummy run: attn_metadata is None
            with set_forward_context(None, self.layers):
                ids = self.input_ids[:n]
                g0, out0 = capture(lambda ids=ids: self.model.submod_0(ids), device=self.device,
                                   name=f"submod_0 [{n}]", owner="PiecewiseBackend",
                                   static={"input_ids": self.input_ids})
                hidden_states, qkvz, ba, core_attn_out, z = out0
                _gdn_attention_core_xpu_impl(core_attn_out, z, qkvz, ba, PREFIX)
                g1, out1 = capture(lambda h=hidden_states, c=core_attn_out, z=z: self.model.submod_1(h, c, z),
                                   device=self.device, name=f"submod_1 [{n}]", owner="PiecewiseBackend",
                                   static={"hidden_states": hidden_states, "core_attn_out": core_attn_out, "z": z})
            self.graphs[n] = (g0, out0, g1, out1)

    def execute_model(self, scheduled):
        """``scheduled``: [(request, tokens)], decodes first (reorder_batch). Returns every token's logits."""
        ids, qsl, slots, has_init, num_decodes = [], [0], [], [], 0
        for req, tokens in scheduled:
            self.slots.setdefault(req, 1 + len(self.slots))
            ids += tokens
            qsl.append(qsl[-1] + len(tokens))
            slots.append(self.slots[req])
            has_init.append(req in self.num_computed)
            num_decodes += req in self.num_computed and len(tokens) == 1
            self.num_computed[req] = self.num_computed.get(req, 0) + len(tokens)
        n = len(ids)
        self.input_ids[:n].copy_(torch.tensor(ids))                # padded rows keep what earlier steps left
        md = GDNAttentionMetadata(
            num_prefills=len(scheduled) - num_decodes, num_decodes=num_decodes, num_actual_tokens=n,
            has_initial_state=torch.tensor(has_init, device=self.device),
            non_spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32, device=self.device))
        size = next((s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= n), None)
        with set_forward_context({PREFIX: md}, self.layers):
            if not self.use_graph or size is None:
                return self.model.forward(self.input_ids[:n]).clone()
            g0, out0, g1, out1 = self.graphs[size]
            hidden_states, qkvz, ba, core_attn_out, z = replay(g0, out0, real=n, size=size,
                                                               padded={"input_ids": self.input_ids})
            _gdn_attention_core_xpu_impl(core_attn_out, z, qkvz, ba, PREFIX)      # splitting op: eager
            logits = replay(g1, out1, real=n, size=size, padded={"z": z})
            return logits[:n].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    A, B, C = "A", "B", "C"
    steps = [[(A, [3, 1, 4, 1, 5]), (B, [9, 2, 6]), (C, [5, 3, 5, 8])],    # step 1: 12 prompt tokens, eager
             [(A, [9]), (B, [7]), (C, [9])],                              # steps 2-3: 3 tokens, 4-token pieces
             [(A, [3]), (B, [2]), (C, [3])],
             [(A, [8]), (B, [4])],                                        # step 4: C is done, 2 tokens
             [(A, [6])]]                                                  # step 5: 1 token, exact size

    def serve(use_graph):
        runner = XPUModelRunner(device, use_graph)
        return [runner.execute_model(step) for step in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
