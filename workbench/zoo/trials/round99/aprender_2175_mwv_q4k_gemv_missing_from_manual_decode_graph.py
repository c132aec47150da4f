"""aprender-serve's manual CUDA decode graph (trueno#243) is built only from the kernels its launch sites record during one eager forward; the plain MWV Q4K GEMV, the default Q4K variant on Blackwell, runs in that pass but never records itself, so every replay skips all Q/K/V/O/gate/up/down projections.

Upstream: https://github.com/paiml/aprender/pull/2175 ("fix(serve): Blackwell CUDA-graph replay — record MWV Q4K GEMV
into graph (PMAT-886a)", paiml/aprender, 2026-06-21, merged; it supersedes the closed #2174 with the same change). Read:
the PR descriptions of #2175 and #2174; the fixed ``crates/aprender-serve/src/cuda/executor/q4k_mwv_gemv.rs`` (the added
recording block in ``mwv_q4k_gemv_into`` and its root-cause comment; ``mwv_dp4a_q4k_gemv_into`` and
``hw_dp4a_q4k_gemv_into`` with their recording blocks) and an earlier version of the same executor code without the
block in ``mwv_q4k_gemv_into``; ``layers/graphed_capture.rs`` (``forward_all_layers_gpu_to_logits_graphed``: recording
pass with ``begin_graph_recording`` / ``forward_workspace_captured`` / ``end_graph_recording``, ``graphed_fast_path``,
``prepare_graph_buffers``, ``graph_cc_default``); the manual graph builder (``begin_graph_recording``,
``end_graph_recording``: one ``cuGraphAddKernelNode`` per ``RecordedKernel``, a linear chain);
``forward_graphed_replay`` (H2D of ``position_buf``, ``seq_len_buf``, ``graph_input_buf``, ``cuGraphLaunch``, download
``logits_buf``). The per-layer wiring of ``forward_workspace_captured`` and the other launch sites were not read line by
line.
Symptom: on GB10 (sm_121) graphed decode emits empty or repeated tokens (CPU/GPU parity cosine 0.19-0.53); the same
eager path is correct; RTX 4090 (sm_89, DP4A variant) is unaffected. PMAT-810 had worked around it by defaulting
Blackwell to eager decode.
Mechanism: the first decode token runs ``forward_workspace_captured`` eagerly with ``graph_recording = true``; each
launch site launches its kernel and, if recording, pushes a ``RecordedKernel`` (function, launch config, argument
pointers); ``end_graph_recording`` builds the decode graph from exactly that list. ``mwv_q4k_gemv_into`` - what Q4K
dispatch picks on Blackwell (``Q4kVariant::Mwv``) - launches without recording. Its GEMVs (Q, K, V, attention output,
FFN gate/up/down of every layer) ran in the recording pass and are absent from the graph; every replay reads their
output buffers as the recording pass left them, writes those stale K/V rows into the KV cache at the new position and
returns garbage logits.
Doctor: warmup-divergence, at mwv_q4k_gemv_into: the recording pass decides the kernel list every replay runs, and this
launch site runs in it without adding itself, so replays lack the projections every eager step computes.
Fix (upstream): the same recording block as ``mwv_dp4a_q4k_gemv_into`` (``if self.graph_recording { push RecordedKernel
{ func, config, arg_data: [output, weights, input, k, n] } }``); the PR also re-enables graphed decode on Blackwell
(``graph_cc_default(cc) = cc >= 89``), not modelled: both variants serve with graphs on, as ``CUDA_GRAPH_ENABLE=1``
does.
Modelled: ``CudaExecutor`` with the launch sites ``rmsnorm_into``, ``q4k_gemv_into`` (variant dispatch on the GPU
profile), ``mwv_q4k_gemv_into`` (pre-fix / fixed lines), ``mwv_dp4a_q4k_gemv_into``, ``q6k_gemv_into`` (LM head),
``rope_indirect_into`` / ``kv_scatter_indirect_into`` / ``incremental_attention_indirect_into`` (read ``position_buf`` /
``seq_len_buf`` on the device), ``residual_add_into``, ``fused_swiglu_into``; ``forward_workspace_captured``,
``prepare_graph_buffers``, ``begin_graph_recording``, ``end_graph_recording`` (the graph is captured from a function
that launches the recorded kernels in order, as the linear chain of kernel nodes does), ``forward_graphed_replay``,
``forward_all_layers_gpu_to_logits`` (non-graphed). Stand-ins: Q4K/Q6K dequantizing GEMVs are plain matmuls (no
quantization, no Q8 activation buffer); one attention head; a 2-layer SwiGLU model with 8 hidden units and a 16-token
vocabulary; the GPU profile is GB10 (cc 121, so the MWV variant); float64.
Workload: prompt [3, 11, 6] prefilled token by token on the non-graphed path, then 5 greedy decode steps (positions
3-7): the first through the recording pass, the rest by replay; against the same loop on the non-graphed path; outputs:
each decode step's logits. The bug's first replay (step 2) returns logits computed from the recording pass's projections
and writes stale K/V into the cache: steps 2-5 differ from eager by 5.08-7.54 (max 7.54, eager logits reach 4.82) and
the greedy tokens diverge from step 2 (8 against 9); the fix equals eager (max error 0).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/paiml/aprender/pull/2175"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "mwv_q4k_gemv_into"
SYMPTOM = ("Blackwell graphed decode returns garbage/repeated tokens: the MWV Q4K GEMVs run in the recording pass "
           "but are not recorded, so replays skip every Q/K/V/O/FFN projection")

VOCAB, HIDDEN, INTER, NUM_LAYERS, MAX_SEQ = 16, 8, 16, 2, 16
THETA, EPS = 10000.0, 1e-6
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class RecordedKernel:
    func: object
    arg_data: tuple

    def launch(self):
        self.func(*self.arg_data)


# --- kernels: each writes the output buffer it is given (device-side reads of position/seq_len) -------------------

def rmsnorm_kernel(output, input, gamma):
    output.copy_(input * torch.rsqrt(input.pow(2).mean(-1, keepdim=True) + EPS) * gamma)


def gemv_kernel(output, weight, input):
    torch.matmul(input, weight, out=output)


def rope_indirect_kernel(output, input, position_buf, inv_freq):
    half = HIDDEN // 2
    ang = position_buf.to(input.dtype)[:, None] * inv_freq[None, :]
    x1, x2 = input[:, :half], input[:, half:]
    output.copy_(torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1))


def kv_scatter_indirect_kernel(k_cache, v_cache, k, v, position_buf):
    k_cache.index_copy_(0, position_buf, k)
    v_cache.index_copy_(0, position_buf, v)


def incremental_attention_indirect_kernel(output, q, k_cache, v_cache, seq_len_buf):
    scores = (q @ k_cache.T) / math.sqrt(HIDDEN)                             # [1, MAX_SEQ]
    visible = torch.arange(MAX_SEQ, device=q.device)[None, :] < seq_len_buf[:, None]
    output.copy_(torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v_cache)


def residual_add_kernel(output, a, b):
    torch.add(a, b, out=output)


def fused_swiglu_kernel(output, gate, up):
    output.copy_(torch.nn.functional.silu(gate) * up)


# --- the model --------------------------------------------------------------------------------------------------------

class LayerWeights:
    def __init__(self, r):
        self.attn_norm, self.ffn_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)
        self.q, self.k, self.v, self.o = (r(HIDDEN, HIDDEN, scale=0.4) for _ in range(4))
        self.gate, self.up = r(HIDDEN, INTER, scale=0.4), r(HIDDEN, INTER, scale=0.4)
        self.down = r(INTER, HIDDEN, scale=0.3)


class Weights:
    def __init__(self, device):
        gen = generator(2175)
        r = lambda *s, scale=1.0: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.emb = r(VOCAB, HIDDEN)
        self.layers = [LayerWeights(r) for _ in range(NUM_LAYERS)]
        self.output_norm = 1.0 + r(HIDDEN, scale=0.1)
        self.lm_head_q6k = r(HIDDEN, VOCAB, scale=0.6)
        half = HIDDEN // 2
        self.inv_freq = (THETA ** -(torch.arange(half, dtype=DTYPE) / half)).to(device)


@dataclasses.dataclass
class GpuProfile:
    cc: int = 121                                    # GB10 sm_121

    @property
    def q4k_variant(self):                           # PMAT-806: plain MWV is the Q4K default on Blackwell
        return "mwv" if self.cc >= 120 else "mwv_dp4a"


# --- crates/aprender-serve/src/cuda/executor --------------------------------------------------------------------------

class CudaExecutor:
    def __init__(self, w, device):
        self.w, self.device, self.gpu_profile = w, device, GpuProfile()
        self.graph_recording = False
        self.graph_recorded_kernels: list[RecordedKernel] = []
        self.decode_graph, self.decode_token_count = None, 0
        self.position_buf = self.seq_len_buf = self.graph_input_buf = None
        z = lambda n: torch.zeros(1, n, dtype=DTYPE, device=device)   # noqa: E731 - the TransformerWorkspace
        self.hidden_buf1, self.hidden_buf2, self.normed_hidden_buf, self.input_staging = (z(HIDDEN) for _ in range(4))
        self.q_buf, self.k_buf, self.v_buf, self.attn_out_buf = (z(HIDDEN) for _ in range(4))
        self.q_rope_buf, self.k_rope_buf = z(HIDDEN), z(HIDDEN)
        self.ffn_gate_buf, self.ffn_up_buf, self.ffn_act_buf = z(INTER), z(INTER), z(INTER)
        self.logits_buf = z(VOCAB)
        self.k_cache = [torch.zeros(MAX_SEQ, HIDDEN, dtype=DTYPE, device=device) for _ in range(NUM_LAYERS)]
        self.v_cache = [torch.zeros(MAX_SEQ, HIDDEN, dtype=DTYPE, device=device) for _ in range(NUM_LAYERS)]

    def _record(self, func, *args):
        self.graph_recorded_kernels.append(RecordedKernel(func, args))

    # ---- launch sites: launch, then (trueno#243) record for manual graph construction ----
    def rmsnorm_into(self, input, output, gamma):
        rmsnorm_kernel(output, input, gamma)
        if self.graph_recording:
            self._record(rmsnorm_kernel, output, input, gamma)

    def q4k_gemv_into(self, weight, input, output):
        if self.gpu_profile.q4k_variant == "mwv":
            return self.mwv_q4k_gemv_into(weight, input, output)
        return self.mwv_dp4a_q4k_gemv_into(weight, input, output)

    def mwv_q4k_gemv_into(self, weight, input, output):
        """PAR-082-V2: multi-warp vectorized Q4K GEMV (fp32 activations)."""
        gemv_kernel(output, weight, input)
        if _variant == "fix":
            # PMAT-886a: record kernel for manual graph construction (trueno#243)
            if self.graph_recording:
                self._record(gemv_kernel, output, weight, input)

    def mwv_dp4a_q4k_gemv_into(self, weight, input, output):
        gemv_kernel(output, weight, input)
        if self.graph_recording:                     # realizr#198: MWV DP4A variant records
            self._record(gemv_kernel, output, weight, input)

    def q6k_gemv_into(self, weight, input, output):
        gemv_kernel(output, weight, input)
        if self.graph_recording:
            self._record(gemv_kernel, output, weight, input)

    def rope_indirect_into(self, input, output):
        rope_indirect_kernel(output, input, self.position_buf, self.w.inv_freq)
        if self.graph_recording:
            self._record(rope_indirect_kernel, output, input, self.position_buf, self.w.inv_freq)

    def kv_scatter_indirect_into(self, layer_idx, k, v):
        kv_scatter_indirect_kernel(self.k_cache[layer_idx], self.v_cache[layer_idx], k, v, self.position_buf)
        if self.graph_recording:
            self._record(kv_scatter_indirect_kernel, self.k_cache[layer_idx], self.v_cache[layer_idx], k, v,
                         self.position_buf)

    def incremental_attention_indirect_into(self, layer_idx, q, output):
        incremental_attention_indirect_kernel(output, q, self.k_cache[layer_idx], self.v_cache[layer_idx],
                                              self.seq_len_buf)
        if self.graph_recording:
            self._record(incremental_attention_indirect_kernel, output, q, self.k_cache[layer_idx],
                         self.v_cache[layer_idx], self.seq_len_buf)

    def residual_add_into(self, a, b, output):
        residual_add_kernel(output, a, b)
        if self.graph_recording:
            self._record(residual_add_kernel, output, a, b)

    def fused_swiglu_into(self, gate, up, output):
        fused_swiglu_kernel(output, gate, up)
        if self.graph_recording:
            self._record(fused_swiglu_kernel, output, gate, up)

    # ---- one decode forward over the workspace (what the recording pass runs) ----
    def forward_workspace_captured(self):
        x = self.graph_input_buf
        for i, lw in enumerate(self.w.layers):
            self.rmsnorm_into(x, self.normed_hidden_buf, lw.attn_norm)
            self.q4k_gemv_into(lw.q, self.normed_hidden_buf, self.q_buf)
            self.q4k_gemv_into(lw.k, self.normed_hidden_buf, self.k_buf)
            self.q4k_gemv_into(lw.v, self.normed_hidden_buf, self.v_buf)
            self.rope_indirect_into(self.q_buf, self.q_rope_buf)
            self.rope_indirect_into(self.k_buf, self.k_rope_buf)
            self.kv_scatter_indirect_into(i, self.k_rope_buf, self.v_buf)
            self.incremental_attention_indirect_into(i, self.q_rope_buf, self.attn_out_buf)
            self.q4k_gemv_into(lw.o, self.attn_out_buf, self.hidden_buf1)
            self.residual_add_into(x, self.hidden_buf1, self.input_staging)
            self.rmsnorm_into(self.input_staging, self.normed_hidden_buf, lw.ffn_norm)
            self.q4k_gemv_into(lw.gate, self.normed_hidden_buf, self.ffn_gate_buf)
            self.q4k_gemv_into(lw.up, self.normed_hidden_buf, self.ffn_up_buf)
            self.fused_swiglu_into(self.ffn_gate_buf, self.ffn_up_buf, self.ffn_act_buf)
            self.q4k_gemv_into(lw.down, self.ffn_act_buf, self.hidden_buf1)
            self.residual_add_into(self.input_staging, self.hidden_buf1, self.hidden_buf2)
            x = self.hidden_buf2
        self.rmsnorm_into(x, self.normed_hidden_buf, self.w.output_norm)
        self.q6k_gemv_into(self.w.lm_head_q6k, self.normed_hidden_buf, self.logits_buf)     # LM head (Q6K)

    def prepare_graph_buffers(self, input, position):
        if self.position_buf is None:
            self.position_buf = torch.tensor([position], dtype=torch.long, device=self.device)
            self.seq_len_buf = torch.tensor([position + 1], dtype=torch.long, device=self.device)
            self.graph_input_buf = input.clone()
        else:
            self.position_buf.fill_(position)
            self.seq_len_buf.fill_(position + 1)
            self.graph_input_buf.copy_(input)

    def begin_graph_recording(self):
        self.graph_recorded_kernels.clear()
        self.graph_recording = True

    def end_graph_recording(self):
        """Build the decode graph from the recorded kernels (one kernel node each, a linear chain)."""
        self.graph_recording = False
        recorded = list(self.graph_recorded_kernels)

        def add_kernel_nodes():
            for record in recorded:
                record.launch()
            return self.logits_buf

        self.decode_graph, _ = capture(
            add_kernel_nodes, device=self.device, warmups=0, name="manual decode graph",
            owner="CudaExecutor (trueno#243 manual graph)",
            static={"graph_input_buf": self.graph_input_buf, "position_buf": self.position_buf,
                    "seq_len_buf": self.seq_len_buf},
            state={**{f"k_cache[{i}]": c for i, c in enumerate(self.k_cache)},
                   **{f"v_cache[{i}]": c for i, c in enumerate(self.v_cache)}})
        self.decode_token_count = 1
        return len(recorded)

    def forward_all_layers_gpu_to_logits(self, input, position):
        """Non-graphed path: the same launch sites, no recording."""
        self.prepare_graph_buffers(input, position)
        self.forward_workspace_captured()
        return self.logits_buf.clone()

    def forward_all_layers_gpu_to_logits_graphed(self, input, position):
        if self.decode_graph is not None and self.decode_token_count > 0:      # graphed_fast_path
            return self.forward_graphed_replay(input, position)
        self.prepare_graph_buffers(input, position)
        self.begin_graph_recording()
        with events.warmup(real=True):               # the recording pass is the first decode token
            self.forward_workspace_captured()
        self.end_graph_recording()
        return self.logits_buf.clone()

    def forward_graphed_replay(self, input, position):
        self.position_buf.fill_(position)
        self.seq_len_buf.fill_(position + 1)
        self.graph_input_buf.copy_(input)
        logits = replay(self.decode_graph, self.logits_buf)
        self.decode_token_count += 1
        return logits.clone()


# --- the workload ----------------------------------------------------------------------------------------------------

PROMPT, DECODE_STEPS = [3, 11, 6], 5


def serve(device, graphed):
    w = Weights(device)
    ex = CudaExecutor(w, device)
    for pos, tok in enumerate(PROMPT[:-1]):          # prefill (non-graphed), fills the KV cache
        ex.forward_all_layers_gpu_to_logits(w.emb[tok][None, :], pos)
    position, last_token, outs = len(PROMPT) - 1, PROMPT[-1], []
    for _ in range(DECODE_STEPS):
        x = w.emb[last_token][None, :]
        if graphed:                                  # CUDA_GRAPH_ENABLE=1
            logits = ex.forward_all_layers_gpu_to_logits_graphed(x, position)
        else:
            logits = ex.forward_all_layers_gpu_to_logits(x, position)
        outs.append(logits)
        last_token, position = int(logits.argmax()), position + 1
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(device, True),
                   lambda: serve(device, False))
