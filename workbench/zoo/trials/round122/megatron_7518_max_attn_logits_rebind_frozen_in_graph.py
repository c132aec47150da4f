"""Megatron-Core QK-clip under Transformer Engine CUDA graphs: ``TEDotProductAttention.forward`` accumulates the per-head
maximum attention logit by rebinding the Python attribute ``current_max_attn_logits``; the rebinding ran once, at
capture, so graph replays neither accumulate the microbatches nor re-publish the statistic after ``clip_qk`` resets it.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/7518 ("Keep attention logit statistics valid across CUDA Graph
replay", NVIDIA/Megatron-LM, by ZenAlexa, opened 2026-09-19; open, not merged when read: no merge commit), fixing
issue https://github.com/NVIDIA/Megatron-LM/issues/7475 ("`current_max_attn_logits` breaks CUDA Graph replay because
its Python-level assignment is not re-executed", by lk137095576, 2026-09-18, labels bug / module: transformer engine).
Read: the issue text and the PR description (the accumulator becomes a nonpersistent FP32 buffer updated in place;
clipping or logging clears that storage for the next step; TE capture cleanup also clears the warmup statistics; the
author reproduced "incomplete accumulation in the first graph-replayed step and missing statistics in later steps" on
``main``). At ``main`` as stored: ``megatron/core/extensions/transformer_engine.py`` ``TEDotProductAttention.__init__``
(``return_max_logit=True``, ``self.current_max_attn_logits = None`` when ``qk_clip`` or ``log_max_attention_logit``)
and ``forward`` (``core_attn_out, batch_max_attention_logits = core_attn_out``; ``None`` -> bind, else
``torch.max(...)`` and rebind); ``megatron/core/optimizer/qk_clip.py`` ``clip_qk`` (skips a layer whose statistic is
None, all-reduces it over DP x CP, logs its max, calls ``attention.clip_qk()`` or resets to None when
``log_max_only``); ``SelfAttention.clip_qk`` / ``_clip_linear_qkv`` in ``megatron/core/transformer/attention.py``
(grouped max per query group, ``eta = clamp(threshold / max, max=1)``, Q rows scaled by ``eta ** alpha``, K rows by
``eta ** (1 - alpha)``, then ``current_max_attn_logits = None``). The PR's diff hunks were not available: the fixed
code below follows its description.
Symptom: with QK-clip (or max-logit logging) and TE CUDA graphs, the clipping statistic is wrong from the first
graph-replayed step (only the last microbatch's maximum) and missing in every later step (clip_qk sees None: no
clipping, logged max 0), so Q/K weights are not clipped as in eager training; no error.
Mechanism: the graph records kernels, not Python. At capture the attribute was None (``clip_qk`` reset it after the
previous step), so capture bound it to the captured ``batch_max_attention_logits`` output and recorded no ``torch.max``.
Each replay rewrites that output with the current microbatch's maximum (no accumulation across microbatches), and
after ``clip_qk`` sets the attribute to None no replay binds it again.
Doctor: host-work-frozen, at forward. ``TEDotProductAttention.forward`` keeps the running maximum in a Python attribute
assignment inside the captured region; it ran once at capture and replays repeat only the kernels.
Fix (upstream): register ``current_max_attn_logits`` as a nonpersistent buffer (-inf = no statistic) and update it in
place (``torch.maximum`` copied into it), so every replay accumulates into the same storage; ``clip_qk`` and the logging
path clear it in place (``fill_(-inf)``) and skip a layer with no statistic; the statistics that TE's warm-up / capture
forwards left in it are cleared after capture.
Modelled: ``TEDotProductAttention`` (forward, max-logit return: per-head max of the scaled causal logits),
``SelfAttention`` (``linear_qkv`` in Megatron's per-group [q, k, v] layout, ``clip_qk``, ``_clip_linear_qkv``), the
optimizer-side ``clip_qk`` of ``qk_clip.py``, and a training loop (``cuda_graph_warmup_steps`` eager iterations, then
per-layer graphs created at the start of an iteration and replayed for every microbatch). Stand-ins: TE's
``make_graphed_callables`` is reduced to one forward graph per layer with a static input (no backward graph, no TE
warm-up forwards), the backward pass and Muon step are replaced by a fixed in-place growth of ``linear_qkv`` (the logits
grow, so clipping engages), one rank (the all-reduce is the identity), no RoPE, float64 instead of FP32 for the buffer.
Workload: 2 layers, 2 heads (MHA), 4 steps of 3 microbatches (seq 4, batch 2); step 0 is eager (graph warm-up step),
graphs are created at the start of step 1. Outputs: every microbatch's output, the logged max logit of every step, the
final ``linear_qkv`` weights. Bug: step 0 (eager) equals; step 1's outputs equal but it logs and clips with 6.24 (the
last microbatch's maximum) instead of 7.50; steps 2-3 log 0 instead of 9.05 / 9.58 and never clip, so their outputs are
up to 1.99 / 7.45 off and the final weights 2.30 off: max |graph - eager| = 9.58. Fix: equals eager (max error 0).
"""
from __future__ import annotations

import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/7518"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = ("with QK-clip and TE CUDA graphs the max attention logit statistic holds only the last microbatch in the "
           "first replayed step and is missing afterwards, so Q/K weights are not clipped as in eager; no error")

HIDDEN, NUM_HEADS, HEAD_DIM, NUM_LAYERS = 8, 2, 4, 2
SEQ, MICRO_BATCH, NUM_MICROBATCHES, TRAIN_ITERS = 4, 2, 3, 4
CUDA_GRAPH_WARMUP_STEPS = 1
QK_CLIP_THRESHOLD, QK_CLIP_ALPHA = 4.0, 0.5
QKV_GROWTH = 1.35                      # stand-in for the optimizer step: the logits grow each step
DTYPE = torch.float64

_variant = "bug"


class TransformerConfig:
    num_attention_heads = NUM_HEADS
    num_query_groups = NUM_HEADS
    kv_channels = HEAD_DIM
    qk_clip = True
    log_max_attention_logit = False
    qk_clip_threshold = QK_CLIP_THRESHOLD
    qk_clip_alpha = QK_CLIP_ALPHA
    cuda_graph_impl = "transformer_engine"
    cuda_graph_warmup_steps = CUDA_GRAPH_WARMUP_STEPS


# --- megatron/core/extensions/transformer_engine.py -----------------------------------------------------------------

class TEDotProductAttention(torch.nn.Module):
    def __init__(self, config, device):
        super().__init__()
        self.config = config
        self.softmax_scale = 1.0 / math.sqrt(HEAD_DIM)
        if config.qk_clip or config.log_max_attention_logit:
            # extra_kwargs["return_max_logit"] = True (TE 2.9+)
            self.return_max_logit = True
            if _variant == "bug":
                self.current_max_attn_logits = None
            else:
                self.register_buffer("current_max_attn_logits",
                                     torch.full((NUM_HEADS,), -math.inf, dtype=DTYPE, device=device), persistent=False)

    def _te_forward(self, query, key, value):
        """te.pytorch.DotProductAttention (causal, sbhd) with return_max_logit: (out, per-head max scaled logit)."""
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.softmax_scale
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhst,tbhd->sbhd", probs, value).reshape(SEQ, query.shape[1], NUM_HEADS * HEAD_DIM)
        max_logit = scores.amax(dim=(0, 2, 3))
        return out, max_logit

    def reset_max_attn_logits(self):
        self.current_max_attn_logits.fill_(-math.inf)

    def forward(self, query, key, value, attention_mask=None):
        core_attn_out = self._te_forward(query, key, value)
        if self.config.qk_clip or self.config.log_max_attention_logit:
            # Update Q K outside of TE Attention API
            core_attn_out, batch_max_attention_logits = core_attn_out
            # Update QK_Clip balancing eta
            if _variant == "bug":
                if self.current_max_attn_logits is None:
                    self.current_max_attn_logits = batch_max_attention_logits
                else:
                    self.current_max_attn_logits = torch.max(self.current_max_attn_logits,
                                                             batch_max_attention_logits)
            else:
                self.current_max_attn_logits.copy_(
                    torch.maximum(self.current_max_attn_logits, batch_max_attention_logits.detach()))
        return core_attn_out


def has_max_attn_logits(core_attention):
    current = core_attention.current_max_attn_logits
    if _variant == "bug":
        return current is not None
    return bool(torch.isfinite(current).any())


# --- megatron/core/transformer/attention.py (SelfAttention, reduced) ------------------------------------------------

class SelfAttention(torch.nn.Module):
    def __init__(self, config, gen, device):
        super().__init__()
        self.config = config
        self.num_attention_heads_per_partition = NUM_HEADS
        self.num_query_groups_per_partition = config.num_query_groups
        self.query_projection_size = self.kv_projection_size = NUM_HEADS * HEAD_DIM
        # linear_qkv.weight: per query group [q (heads_per_group * d), k (d), v (d)] rows, Megatron's layout
        self.linear_qkv_weight = randn(3 * NUM_HEADS * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.9).to(DTYPE)
        self.linear_proj_weight = randn(HIDDEN, NUM_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.core_attention = TEDotProductAttention(config, device)

    def get_query_key_value_tensors(self, hidden_states):
        mixed_qkv = hidden_states @ self.linear_qkv_weight.t()                     # [s, b, 3 * h * d]
        mixed_qkv = mixed_qkv.view(SEQ, hidden_states.shape[1], self.num_query_groups_per_partition, 3 * HEAD_DIM)
        query, key, value = torch.split(mixed_qkv, [HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=3)
        return query.contiguous(), key.contiguous(), value.contiguous()

    def forward(self, hidden_states):
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        core_attn_out = self.core_attention(query, key, value)
        return core_attn_out @ self.linear_proj_weight.t()

    def clip_qk(self):
        """Clip the QK attention logits to the threshold, recommended for Muon optimizer."""
        if not self.config.qk_clip:
            raise ValueError("qk_clip option needs to be enabled")
        current_max = self.core_attention.current_max_attn_logits
        if _variant == "bug" and current_max is None:
            raise ValueError("current_max_attn_logits is None")
        grouped_max = torch.max(current_max.view(self.num_query_groups_per_partition, -1), dim=1).values
        if torch.any(grouped_max > self.config.qk_clip_threshold):
            self.qk_clip_balancing_eta = torch.clamp(self.config.qk_clip_threshold / grouped_max,
                                                     max=1.0).view(self.num_query_groups_per_partition, 1, 1)
            assert torch.all(self.qk_clip_balancing_eta <= 1.0)
            w = self.linear_qkv_weight
            w.data.copy_(self._clip_linear_qkv(w.data))
        if _variant == "bug":
            self.core_attention.current_max_attn_logits = None
        else:
            self.core_attention.reset_max_attn_logits()

    def _clip_linear_qkv(self, weight):
        weight_reshaped = weight.view(self.num_query_groups_per_partition, 3 * HEAD_DIM, -1)
        q, k, v = torch.split(weight_reshaped, [HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=1)
        eta = self.qk_clip_balancing_eta
        q = q * torch.pow(eta, self.config.qk_clip_alpha)
        k = k * torch.pow(eta, 1.0 - self.config.qk_clip_alpha)
        return torch.cat([q, k, v], dim=1).view_as(weight)


class TransformerLayer(torch.nn.Module):
    def __init__(self, config, gen, device):
        super().__init__()
        self.self_attention = SelfAttention(config, gen, device)

    def forward(self, hidden_states):
        return hidden_states + self.self_attention(torch.nn.functional.layer_norm(hidden_states, (HIDDEN,)))


# --- megatron/core/optimizer/qk_clip.py -----------------------------------------------------------------------------

def clip_qk(model, log_max_only=False) -> float:
    with torch.no_grad():
        log_max_attention_logit = 0
        for layer in model:
            attention = layer.self_attention
            if not has_max_attn_logits(attention.core_attention):
                continue
            current_max_attn_logits = attention.core_attention.current_max_attn_logits
            # torch.distributed.all_reduce(..., op=MAX, group=DP x CP): one rank here
            log_max_attention_logit = max(log_max_attention_logit, torch.max(current_max_attn_logits).item())
            if not log_max_only:
                attention.clip_qk()
            elif _variant == "bug":
                attention.core_attention.current_max_attn_logits = None
            else:
                attention.core_attention.reset_max_attn_logits()
    return log_max_attention_logit


# --- the training loop with per-layer TE graphs (megatron/core/transformer/cuda_graphs.py, reduced) ------------------

class Trainer:
    def __init__(self, device, use_cuda_graphs):
        self.device = device
        gen = generator(7518)
        self.config = TransformerConfig()
        self.layers = [TransformerLayer(self.config, gen, device) for _ in range(NUM_LAYERS)]
        self.data = [[randn(SEQ, MICRO_BATCH, HIDDEN, gen=gen, device=device).to(DTYPE)
                      for _ in range(NUM_MICROBATCHES)] for _ in range(TRAIN_ITERS)]
        self.use_cuda_graphs = use_cuda_graphs
        self.graphs = None

    def create_cudagraphs(self):
        """TECudaGraphHelper.create_cudagraphs (reduced): one graph per layer over a static hidden-states input."""
        pool = graph_pool_handle(self.device)
        self.graphs = []
        for i, layer in enumerate(self.layers):
            static_input = torch.zeros(SEQ, MICRO_BATCH, HIDDEN, dtype=DTYPE, device=self.device)
            g, out = capture(lambda layer=layer, x=static_input: layer(x), device=self.device, pool=pool, warmups=0,
                             name=f"layer {i} fwd", owner="TECudaGraphHelper", static={"hidden_states": static_input})
            self.graphs.append((static_input, g, out))
            if _variant == "fix":
                # TE capture cleanup: drop the statistics that the warm-up / capture forwards left in the buffer
                layer.self_attention.core_attention.reset_max_attn_logits()

    def forward_backward(self, step):
        outputs = []
        for mb in self.data[step]:
            hidden_states = mb
            for i, layer in enumerate(self.layers):
                if self.graphs is not None:
                    static_input, g, out = self.graphs[i]
                    static_input.copy_(hidden_states)
                    hidden_states = replay(g, out).clone()
                else:
                    hidden_states = layer(hidden_states)
            outputs.append(hidden_states)
        return outputs

    def optimizer_step(self):
        # stand-in for backward + Muon: the QK projections grow, so the attention logits grow
        for layer in self.layers:
            layer.self_attention.linear_qkv_weight.mul_(QKV_GROWTH)

    def train(self):
        results = []
        for step in range(TRAIN_ITERS):
            if self.use_cuda_graphs and self.graphs is None and step >= self.config.cuda_graph_warmup_steps:
                self.create_cudagraphs()
            results += self.forward_backward(step)
            self.optimizer_step()
            log_max = clip_qk(self.layers, log_max_only=False)
            results.append(torch.tensor([log_max], dtype=DTYPE))
        results += [layer.self_attention.linear_qkv_weight for layer in self.layers]
        return results


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graphs):
        return Trainer(device, use_cuda_graphs).train()

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
