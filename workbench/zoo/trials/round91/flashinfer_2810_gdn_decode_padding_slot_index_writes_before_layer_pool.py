"""FlashInfer's bf16 gated-delta-rule decode kernel follows a CUDA-graph padding row's slot index -1 to the state just before the layer's pool: the previous layer's last slot, a live request's recurrent state.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/2810 ("feat(gdn): add padding index guard for bf16 decode
kernel", flashinfer-ai/flashinfer, merged 2026-03-22). Read: the commit (ae9a64da1) with its message and full diff:
``flashinfer/gdn_kernels/gdn_decode_bf16_state.py`` adds ``if pool_batch_idx < 0: pool_batch_idx = 0`` after
``pool_batch_idx = gH_slot_indices[batch_idx]`` in ``gated_delta_rule_decode_kernel_seqlen1``, ``..._seqlen234_unified``
and ``..._seqlen1_lowBS_1chunk``; the new test ``_test_decode_kernel_bf16_padding_indices`` (pool slot 0 = null buffer,
real slots from 1, padding rows -1; "Without the kernel-level fix, padding slots do an OOB write to gH[-1] (before the
pool base)"). Also read: the ``gated_delta_rule`` launcher (pool ``[pool_size, HV, V, K]``, per-batch
``initial_state_indices``, kernel choice by T and B), the reference ``decode_delta_rule`` in ``tests/gdn``, and the
description of sglang PR 22818 ("CUDA graph decode uses padded batches where padding slots have initial_state_indices =
-1, but the kernel had no guard for negative indices"). The serving-side code (sglang's GDN backend) was not read; the
runner below is a stand-in built from that description.
Symptom: Qwen3.5-style hybrid models (Gated DeltaNet layers) served with the FlashInfer bf16 GDN decode kernel under CUDA
graphs: whenever a decode batch is padded to a captured size, padding rows carry slot index -1 and the kernel reads and
writes ``gH[-1]``, the memory just before the layer's state pool. Eager decode (no padding rows) is correct.
Mechanism: the serving runner keeps one contiguous recurrent-state cache ``[num_gdn_layers, pool_size, HV, V, K]`` and
passes layer ``l``'s pool (a view) to ``gated_delta_rule`` with the batch's ``initial_state_indices``. At a padded graph
size the runner fills the padding rows with the pad slot id -1. The kernel computes the state address as
``gH + pool_batch_idx * slot_stride``; with -1 that is the slot just before the pool: for layer ``l`` > 0 the previous
layer's last slot, which the slot allocator handed to a live request. The padding row decays that state, adds its delta
update and writes it back, so the live request's layer-``l-1`` state is corrupted and its later tokens change.
Doctor: stale-padding, at gated_delta_rule_decode_kernel_seqlen1_lowBS_1chunk. Real rows of later steps depend on what
the padded rows hold: the kernel follows the padding rows' slot index (-1) into a real request's recurrent state
instead of neutralising it.
Fix (upstream): clamp a negative slot index to 0, the pool's reserved null slot, inside the kernel.
Modelled: the launcher ``gated_delta_rule`` and the kernel ``gated_delta_rule_decode_kernel_seqlen1_lowBS_1chunk`` (the
B <= 4, T = 1 path) with the reference gated delta rule (l2-normalised q/k, g = -exp(A_log) * softplus(a + dt_bias),
beta = sigmoid(b), h *= exp(g), v_new = beta * (v - h k), h += k v_new, o = scale * h q). The pointer arithmetic on
``gH`` is modelled as a row index into the flat state storage; the storage has one spare row before layer 0's pool
standing in for whatever allocation precedes it. The model (stand-in) is two GDN layers (hidden 8, HV 2, K = V = 4)
plus an lm head, float64; a ``GDNCudaGraphRunner`` captures decode at sizes [2, 4] and pads with slot -1. Slot 0 of each
layer's pool is the null slot; real slots 1..4 are handed out from the top (the first request gets slot 4).
Workload: the graphs are captured at startup; then requests A, B, C (prefilled states in slots 4, 3, 2) decode 4 steps
greedily. Each step is 3 real rows padded to the size-4 graph. In the bug the padding row of layer 1 overwrites layer 0's
slot 4 (A's state) every step: step 0 matches eager, A's logits differ from step 1 on (by 0.26, 0.59, 0.38), B and C
stay exact. The fix equals eager.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/2810"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "gated_delta_rule_decode_kernel_seqlen1_lowBS_1chunk"
SYMPTOM = ("GDN (Gated DeltaNet) decode under CUDA graphs with padded batches: the bf16 decode kernel follows a padding "
           "row's slot index -1 to the state just before the layer's pool, the previous layer's last slot, and "
           "overwrites a live request's recurrent state")

HIDDEN, VOCAB = 8, 16
H = HV = 2                  # query/key heads, value heads
K = V = 4                   # head dims
NUM_GDN_LAYERS = 2
MAX_REQS = 4
POOL_SIZE = MAX_REQS + 1    # slot 0: null slot
PAD_SLOT_ID = -1
CUDA_GRAPH_BATCH_SIZES = [2, 4]

_variant = "bug"


# --- flashinfer/gdn_kernels/gdn_decode_bf16_state.py -----------------------------------------------------------------

def gated_delta_rule_decode_kernel_seqlen1_lowBS_1chunk(gQ, gK, gV, ga, gb, gA_log, gdt_bias, gH, gH_base,
                                                        gH_slot_indices, scale, eps=1e-6):
    """One decode token per batch row. ``gH`` is the flat state storage, ``gH_base`` the row of this pool's slot 0:
    the kernel's ``gH + pool_batch_idx * stride`` becomes row ``gH_base + pool_batch_idx``."""
    pool_batch_idx = gH_slot_indices.to(torch.int64)
    if _variant == "fix":
        pool_batch_idx = torch.where(pool_batch_idx < 0, torch.zeros_like(pool_batch_idx), pool_batch_idx)
    rows = gH_base + pool_batch_idx                                   # [B]
    h = gH[rows]                                                      # [B, HV, V, K]
    q = gQ / (gQ.norm(dim=-1, keepdim=True) + eps)
    k = gK / (gK.norm(dim=-1, keepdim=True) + eps)
    q = q.repeat_interleave(HV // H, dim=1)                           # [B, HV, K]
    k = k.repeat_interleave(HV // H, dim=1)
    g = -torch.exp(gA_log) * torch.nn.functional.softplus(ga + gdt_bias)   # [B, HV]
    beta = torch.sigmoid(gb)
    h = h * torch.exp(g)[..., None, None]
    v_new = (gV - (h * k.unsqueeze(2)).sum(-1)) * beta.unsqueeze(-1)   # [B, HV, V]
    h = h + v_new.unsqueeze(-1) * k.unsqueeze(2)                      # h[v, k] += v_new[v] k[k]
    gH[rows] = h                                                      # written back in place
    return scale * (h * q.unsqueeze(2)).sum(-1)                       # [B, HV, V]


def gated_delta_rule(A_log, a, dt_bias, q, k, v, b, initial_state_source, initial_state_base, initial_state_indices,
                     scale=None):
    """The launcher: T = 1 and B <= 4 selects the low-batch kernel."""
    B = q.shape[0]
    assert B <= 4, "only the B <= 4, T = 1 path is modelled"
    scale = K ** -0.5 if scale is None else scale
    return gated_delta_rule_decode_kernel_seqlen1_lowBS_1chunk(
        q, k, v, a, b, A_log, dt_bias, initial_state_source, initial_state_base, initial_state_indices, scale)


# --- the serving side (stand-in) ----------------------------------------------------------------------------------------

class MambaPool:
    """One contiguous recurrent-state cache for all GDN layers; one spare row precedes layer 0's pool."""

    def __init__(self, device):
        self.storage = torch.zeros(1 + NUM_GDN_LAYERS * POOL_SIZE, HV, V, K, device=device, dtype=torch.float64)
        self.free_slots = list(range(1, POOL_SIZE))                  # slot 0: null slot

    def layer_base(self, layer_id):
        return 1 + layer_id * POOL_SIZE

    def alloc(self):
        return self.free_slots.pop()


class GatedDeltaNetLayer:
    def __init__(self, layer_id, gen, device):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.layer_id = layer_id
        self.wq, self.wk = r(HIDDEN, H * K), r(HIDDEN, H * K)
        self.wv, self.wa, self.wb = r(HIDDEN, HV * V), r(HIDDEN, HV), r(HIDDEN, HV)
        self.wo = r(HV * V, HIDDEN)
        self.A_log, self.dt_bias = r(HV, scale=0.3), r(HV, scale=0.3)

    def forward(self, x, pool, cache_indices):
        B = x.shape[0]
        o = gated_delta_rule(self.A_log, x @ self.wa, self.dt_bias, (x @ self.wq).view(B, H, K),
                             (x @ self.wk).view(B, H, K), (x @ self.wv).view(B, HV, V), x @ self.wb,
                             pool.storage, pool.layer_base(self.layer_id), cache_indices)
        return x + o.reshape(B, HV * V) @ self.wo


class HybridModel:
    def __init__(self, device):
        gen = generator(2810)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).double()
        self.layers = [GatedDeltaNetLayer(i, gen, device) for i in range(NUM_GDN_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).double()
        self.pool = MambaPool(device)

    def forward(self, input_ids, cache_indices):
        x = self.embed[input_ids]
        for layer in self.layers:
            x = layer.forward(x, self.pool, cache_indices)
        return x @ self.lm_head


class GDNCudaGraphRunner:
    """Decode graphs per batch size; padding rows get token 0 and slot ``PAD_SLOT_ID``."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.input_ids = torch.zeros(MAX_REQS, dtype=torch.int64, device=device)
        self.cache_indices = torch.full((MAX_REQS,), PAD_SLOT_ID, dtype=torch.int32, device=device)
        self.graphs = {}
        for bs in sorted(CUDA_GRAPH_BATCH_SIZES, reverse=True):
            g, out = capture(lambda bs=bs: self.model.forward(self.input_ids[:bs], self.cache_indices[:bs]),
                             device=device, name=f"gdn decode [{bs}]", owner="GDNCudaGraphRunner",
                             static={"input_ids": self.input_ids, "cache_indices": self.cache_indices},
                             state={"mamba_pool": self.model.pool.storage})
            self.graphs[bs] = (g, out)

    def replay(self, input_ids, cache_indices):
        raw_bs = input_ids.shape[0]
        bs = next(s for s in sorted(CUDA_GRAPH_BATCH_SIZES) if s >= raw_bs)
        self.input_ids[:raw_bs].copy_(input_ids)
        self.input_ids[raw_bs:bs].fill_(0)
        self.cache_indices[:raw_bs].copy_(cache_indices)
        self.cache_indices[raw_bs:bs].fill_(PAD_SLOT_ID)             # init_forward_metadata_replay_cuda_graph
        g, out = self.graphs[bs]
        return replay(g, out, real=raw_bs, size=bs)[:raw_bs]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    names, num_steps = "ABC", 4

    def serve(use_cuda_graph):
        model = HybridModel(device)
        runner = GDNCudaGraphRunner(model, device) if use_cuda_graph else None   # captured at startup
        gen = generator(28100)
        slots = {n: model.pool.alloc() for n in names}               # A: 4, B: 3, C: 2
        for n in names:                                               # prefill stand-in: each layer's state
            for layer in model.layers:
                row = model.pool.layer_base(layer.layer_id) + slots[n]
                model.pool.storage[row] = randn(HV, V, K, gen=gen, device=device, scale=0.5).double()
        tokens = torch.tensor([3, 7, 11], dtype=torch.int64, device=device)
        cache_indices = torch.tensor([slots[n] for n in names], dtype=torch.int32, device=device)
        outs = []
        for _ in range(num_steps):
            if runner is not None:
                logits = runner.replay(tokens, cache_indices)
            else:
                logits = model.forward(tokens, cache_indices)
            outs.append(logits.clone())
            tokens = logits.argmax(-1)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
