"""vLLM MLA with piecewise CUDA graphs and the fused RoPE+quant path: ``MLAAttention.forward`` stores ``self._positions = positions`` (a view of the runner's persistent positions buffer) inside a captured piece, so the assignment runs only at capture; after the captures (largest first) the attribute keeps the last, smallest capture's view, and the eager attention op of a replay at a larger size applies RoPE with positions of the wrong length.

Upstream: https://github.com/vllm-project/vllm/pull/35348 ("Fix stale self._positions during piecewise CUDA graph replay
in MLA", vllm-project/vllm, by tlrmchlsmth, opened 2026-02-26; closed without merge, no merge commit). Read: only the
pull request's description in the ``issues`` corpus (summary, root cause, the configuration, the first steps of the
call chain); not its diff, and not ``mla_attention.py`` / ``forward_context.py`` at its parent commit.
Symptom: DeepSeek-R1 with ``--kv-cache-dtype fp8`` (fused RoPE+quant), piecewise CUDA graphs (default
FULL_AND_PIECEWISE) and data parallelism crashes in rotary embedding: ``RuntimeError: The size of tensor a (8192) must
match the size of tensor b (475)`` at ``deepseek_scaling_rope.py`` ``forward_native``.
Mechanism: piecewise graphs split at the attention custom op: the code of ``MLAAttention.forward`` before the op is in a
captured piece, the op (``forward_impl``) runs eagerly between pieces. ``self._positions = positions`` is a Python side
effect of that captured piece: each capture (sizes largest first) runs it once, so afterwards the attribute holds the
view ``positions[:smallest capture size]``. A replay repeats only the kernels; ``forward_impl`` then reads the stale
attribute and RoPE combines q/k of the replayed size with cos/sin of the last captured size.
Doctor: host-work-frozen, at forward (an attribute assignment inside the captured region ran once, at capture; replays
keep its capture-time value, the view sized for the last captured batch).
Fix (upstream, as described): the runner passes ``positions`` through the ``ForwardContext`` (set outside the CUDA
graphs before every step), and ``forward_impl`` prefers it over ``self._positions``.
Modelled: the runner's persistent ``positions`` buffer and padding to a capture size; piecewise graphs captured largest
first, two pieces per size (the pre-attention piece with ``MLAAttention.forward``'s assignment and the projections, the
post-attention piece with ``o_proj`` and the LM head) through a shared pool; ``forward_impl`` as the eager op between
them, with the fused RoPE+quant path (RoPE on the rope part of q/k, then an fp8-like quantization stand-in) and causal
attention over the step's tokens; ``set_forward_context`` as the fix names it. Stand-ins: one layer, one head, no
latent compression (q and k are plain projections split into nope/rope parts), the quantization is a rounding to
1/64 in float64, a step is one prefill chunk of one sequence; no DP (the padding to a capture size is what matters).
Workload: capture sizes [8, 4] (captured 8 then 4); step 1 a chunk of 3 tokens at positions 0-2 (padded to 4), step 2 a
chunk of 7 tokens at positions 3-9 (padded to 8), step 3 a chunk of 2 tokens at positions 10-11 (padded to 4). Bug:
step 1 equals eager (the stale view is the size-4 one and reads the live buffer), step 2 raises the upstream error:
RuntimeError "The size of tensor a (8) must match the size of tensor b (4) at non-singleton dimension 0" (the same on
both runs). Fix: equals eager, max |graph - eager| = 3.11e-15 (float64 rounding of the padded matmuls).
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/35348"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = ("MLA with piecewise CUDA graphs: self._positions is assigned inside a captured piece, keeps the last "
           "capture's positions view, and RoPE in the eager attention op fails with a size mismatch on replay")

HIDDEN, VOCAB, NOPE_DIM, ROPE_DIM = 8, 16, 4, 4
MAX_POSITION = 64
CUDAGRAPH_CAPTURE_SIZES = [8, 4]
MAX_NUM_TOKENS = max(CUDAGRAPH_CAPTURE_SIZES)
DTYPE = torch.float64

_variant = "bug"


# --- vllm/forward_context.py ------------------------------------------------------------------------------------------

class ForwardContext:
    def __init__(self, positions=None):
        self.positions = positions


_forward_context = ForwardContext()


def set_forward_context(positions):
    global _forward_context
    _forward_context = ForwardContext(positions)


def get_forward_context():
    return _forward_context


# --- deepseek_scaling_rope.py (forward_native) ------------------------------------------------------------------------

class DeepseekScalingRotaryEmbedding:
    def __init__(self, device):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE_DIM, 2, dtype=DTYPE) / ROPE_DIM))
        freqs = torch.arange(MAX_POSITION, dtype=DTYPE)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def forward_native(self, positions, query_rot, key_rot):
        cos, sin = self.cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)

        def rotate(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)

        return rotate(query_rot), rotate(key_rot)


# --- vllm/model_executor/layers/attention/mla_attention.py (reduced) ---------------------------------------------------

class MLAAttention:
    def __init__(self, gen, device):
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.6).to(DTYPE)  # noqa: E731
        self.q_proj = r(HIDDEN, NOPE_DIM + ROPE_DIM)
        self.kv_proj = r(HIDDEN, NOPE_DIM + ROPE_DIM + HIDDEN)
        self.rotary_emb = DeepseekScalingRotaryEmbedding(device)
        self.use_fused_rope_quant = True                   # --kv-cache-dtype fp8
        self._positions = None

    def forward(self, positions, hidden_states):
        """The part of the layer that lies in the captured piece before the attention op."""
        self._positions = positions                        # Python side effect: runs at capture, not at replay
        q = hidden_states @ self.q_proj
        kv = hidden_states @ self.kv_proj
        return q, kv

    def forward_impl(self, q, kv, output):
        """The attention custom op (a splitting op): runs eagerly between the captured pieces."""
        positions = self._positions
        if _variant == "fix":
            ctx_positions = get_forward_context().positions
            if ctx_positions is not None:
                positions = ctx_positions
        k, v = kv[:, : NOPE_DIM + ROPE_DIM], kv[:, NOPE_DIM + ROPE_DIM:]
        q_nope, q_pe = q[:, :NOPE_DIM], q[:, NOPE_DIM:]
        k_nope, k_pe = k[:, :NOPE_DIM], k[:, NOPE_DIM:]
        if self.use_fused_rope_quant:
            q_pe, k_pe = self.rotary_emb.forward_native(positions, q_pe, k_pe)
            k_pe = torch.round(k_pe * 64) / 64              # fp8 KV quantization stand-in
            k_nope = torch.round(k_nope * 64) / 64
        qf, kf = torch.cat([q_nope, q_pe], -1), torch.cat([k_nope, k_pe], -1)
        n = qf.shape[0]
        scores = (qf @ kf.T) * (NOPE_DIM + ROPE_DIM) ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        output[:n].copy_(probs @ v)


class DeepseekV2ForCausalLM:
    def __init__(self, device):
        gen = generator(35348)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.self_attn = MLAAttention(gen, device)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)

    def piece_0(self, input_ids, positions):
        hidden_states = self.embed_tokens[input_ids]
        q, kv = self.self_attn.forward(positions, torch.nn.functional.rms_norm(hidden_states, (HIDDEN,)))
        return hidden_states, q, kv

    def piece_1(self, hidden_states, attn_output):
        hidden_states = hidden_states + attn_output @ self.o_proj
        return torch.nn.functional.rms_norm(hidden_states, (HIDDEN,)) @ self.lm_head


# --- vllm/v1/worker/gpu_model_runner.py (reduced: piecewise graphs, one prefill chunk per step) ------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = DeepseekV2ForCausalLM(device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.attn_output = torch.zeros(MAX_NUM_TOKENS, HIDDEN, dtype=DTYPE, device=device)
        self.graphs = {}
        if use_cuda_graph:
            self.capture_model()

    def _run_pieces(self, n, pieces=None):
        """The piecewise backend: captured pieces around the eager attention op."""
        model = self.model
        if pieces is None:
            hidden_states, q, kv = model.piece_0(self.input_ids[:n], self.positions[:n])
        else:
            (g0, out0), _ = pieces
            hidden_states, q, kv = replay(g0, out0, size=n)
        model.self_attn.forward_impl(q, kv, self.attn_output)
        if pieces is None:
            return model.piece_1(hidden_states, self.attn_output[:n])
        _, (g1, out1) = pieces
        return replay(g1, out1, size=n)

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        model = self.model
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):   # largest first
            self.input_ids[:n].fill_(0)
            self.positions[:n].copy_(torch.arange(n))
            set_forward_context(self.positions[:n])
            piece0 = capture(lambda n=n: model.piece_0(self.input_ids[:n], self.positions[:n]), device=self.device,
                             pool=pool, name=f"PIECEWISE piece 0 [{n}]", owner="GPUModelRunner",
                             static={"input_ids": self.input_ids, "positions": self.positions})
            _, q, kv = piece0[1]
            model.self_attn.forward_impl(q, kv, self.attn_output)
            piece1 = capture(lambda n=n, h=piece0[1][0]: model.piece_1(h, self.attn_output[:n]), device=self.device,
                             pool=pool, name=f"PIECEWISE piece 1 [{n}]", owner="GPUModelRunner",
                             static={"attn_output": self.attn_output})
            self.graphs[n] = (piece0, piece1)

    def execute_model(self, token_ids, start_pos):
        num_tokens = len(token_ids)
        num_input_tokens = next((s for s in sorted(self.graphs) if s >= num_tokens), num_tokens)
        self.input_ids[:num_tokens].copy_(torch.tensor(token_ids, dtype=torch.int64))
        self.positions[:num_tokens].copy_(torch.arange(start_pos, start_pos + num_tokens))
        self.input_ids[num_tokens:num_input_tokens].fill_(0)
        self.positions[num_tokens:num_input_tokens].fill_(0)
        set_forward_context(self.positions[:num_input_tokens])
        logits = self._run_pieces(num_input_tokens, self.graphs.get(num_input_tokens))
        return logits[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    chunks = [[3, 7, 11], [5, 1, 14, 2, 9, 12, 4], [6, 13]]   # 3, 7 and 2 tokens of one prompt

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        outs, pos = [], 0
        for chunk in chunks:
            outs.append(runner.execute_model(chunk, pos))
            pos += len(chunk)
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
