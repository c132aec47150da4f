"""Kimi K3 KDA decode: a bigger eager decode batch regrows the conv staging buffer that captured graphs still use.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/17421 (follow-up to #17269, from its review): "Kimi K3 KDA
decode: size the staging buffer once, build the verify conv constants eagerly".
Symptom: described by the PR as a hazard ("a regrow would leave those graphs writing into freed memory"): after a
decode batch larger than every earlier one runs, replayed decode graphs gather into and read from a freed block:
an illegal memory access, or silent KDA state / output corruption once the block is reused.
Mechanism: ``KimiKDARuntime`` (``tensorrt_llm/_torch/models/modeling_kimi_linear.py``) keeps a persistent
batch-row-dense staging buffer ``self._cs_dense`` of shape ``[3, rows, d, W-1]``. ``_forward_decode`` gathers each
request's conv window from the conv pool (``conv_pool.index_select(0, slot_indices)``), repacks the historical
``W-1`` columns into ``buf[:, :B]`` and hands the three sections (``cs_q/cs_k/cs_v``) to ``trtllm::kda_decode``.
Before the fix the buffer was allocated lazily on the first decode, sized to that call's batch ``B``, and a
``buf.shape[1] < B`` branch replaced it with a larger one whenever a bigger batch arrived. The decode graphs are
warmed up and captured per batch size (largest first): the warmup of the largest captured size allocates the
buffer, and every graph records its address. A later decode batch larger than the largest captured size runs
eagerly (no graph for it) and regrows the buffer: the old tensor goes back to the allocator while every captured
graph still copies into and reads ``cs_q/cs_k/cs_v`` from it. The next replay reads freed memory. (The same PR
also builds the fused-verify fp32 conv weights ``_mtp_conv_weights`` eagerly in
``_build_decode_kernel_constants`` instead of lazily on the first verify call, which could run under capture;
that half is not modelled here.)
Doctor: dangling-reference, at ``_forward_decode`` (its regrow branch releases the staging buffer whose address
the captured decode graphs hold).
Fix (upstream): ``_cs_dense`` is allocated once with ``max(conv_pool.shape[0], B)`` rows (the conv pool's slot
count bounds the plain decode batch); the regrow branch becomes ``assert buf.shape[1] >= B`` ("reallocating would
corrupt previously captured CUDA graphs"); the first-call-under-capture guard (fall back to
``_forward_decode_ref``, never allocate inside capture) is kept.
(Read: the post-fix ``__init__``, ``_build_decode_kernel_constants`` and ``_forward_decode`` and the PR text;
the pre-fix regrow lines are from the PR description. Miniature: d=4 channels per section, W=4, a diagonal
recurrent state per slot, decode graphs for batch sizes 4 and 2, 12 conv-pool slots of which 4 are the
graph warmup's dummy requests.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/17421"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_forward_decode"
SYMPTOM = "decode graph replays after a larger eager decode batch read the regrown (freed) KDA conv staging buffer"

HIDDEN, D, W = 8, 4, 4                    # hidden size, proj_size (channels per q/k/v section), conv_size
NUM_SLOTS = 12                            # conv / ssm pool slots (the Mixed manager's per-rank max batch)
DUMMY_SLOTS = [8, 9, 10, 11]              # slots of the CUDA-graph warmup's dummy requests
CUDA_GRAPH_BATCH_SIZES = [4, 2]           # captured largest first


class KimiKDARuntime:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        gen = generator(17421)
        self._qkvg_proj_weight = randn(4 * D, HIDDEN, gen=gen, device=device, scale=0.5)
        # _build_decode_kernel_constants: transposed conv weights [W, D] per section, fp32 A_log
        self._w_q_t = randn(W, D, gen=gen, device=device, scale=0.6)
        self._w_k_t = randn(W, D, gen=gen, device=device, scale=0.6)
        self._w_v_t = randn(W, D, gen=gen, device=device, scale=0.6)
        self._A_log_f32 = randn(D, gen=gen, device=device)
        self.o_proj = randn(D, HIDDEN, gen=gen, device=device, scale=0.5)
        self._cs_dense = None             # persistent [3, rows, d, W-1] conv-window staging

    def _alloc_cs_dense(self, rows):
        numel = max(3 * rows * D * (W - 1), own_segment_elems(self.device))
        return torch.empty(numel, device=self.device)[:3 * rows * D * (W - 1)].view(3, rows, D, W - 1)

    def _kda_decode(self, x_qkv, onorm_g, cs_q, cs_k, cs_v, state):
        """trtllm::kda_decode in miniature: causal conv over [history, x], gated delta update, gated output."""
        outs = []
        for i, (cs, w_t) in enumerate(((cs_q, self._w_q_t), (cs_k, self._w_k_t), (cs_v, self._w_v_t))):
            win = torch.cat([cs, x_qkv[:, i * D:(i + 1) * D].unsqueeze(-1)], dim=-1)      # [B, d, W]
            outs.append(torch.nn.functional.silu((win * w_t.t().unsqueeze(0)).sum(-1)))
        q, k, v = outs
        state = torch.sigmoid(self._A_log_f32) * state + k * v
        o = q * state * torch.sigmoid(onorm_g)
        return o, state

    def _forward_decode_ref(self, x2d, conv_pool, ssm_pool, slot_indices):
        """Capture-safe reference path: no staging buffer."""
        x_qkvg = x2d @ self._qkvg_proj_weight.t()
        cs = conv_pool.index_select(0, slot_indices)
        sections = cs.view(-1, 3, D, W)[:, :, :, 1:]
        state = ssm_pool.index_select(0, slot_indices)
        o, state = self._kda_decode(x_qkvg[:, :3 * D], x_qkvg[:, 3 * D:], sections[:, 0], sections[:, 1],
                                    sections[:, 2], state)
        ssm_pool.index_copy_(0, slot_indices, state)
        conv_pool.index_copy_(0, slot_indices, torch.cat([cs[:, :, 1:], x_qkvg[:, :3 * D].unsqueeze(-1)], -1))
        return o @ self.o_proj

    def _forward_decode(self, x2d, conv_pool, ssm_pool, slot_indices):
        B = x2d.shape[0]
        buf = self._cs_dense
        if self.variant == "bug":
            if buf is None or buf.shape[1] < B:
                if torch.cuda.is_current_stream_capturing():
                    return self._forward_decode_ref(x2d, conv_pool, ssm_pool, slot_indices)
                # Lazily sized to this batch; a bigger batch replaces it (the old one is released).
                buf = self._alloc_cs_dense(B)
                self._cs_dense = buf
        else:
            if buf is None:
                if torch.cuda.is_current_stream_capturing():
                    # Never allocate inside CUDA graph capture; the reference path is capture-safe.
                    return self._forward_decode_ref(x2d, conv_pool, ssm_pool, slot_indices)
                buf = self._alloc_cs_dense(max(conv_pool.shape[0], B))
                self._cs_dense = buf
            else:
                assert buf.shape[1] >= B, (
                    f"KDA decode staging buffer holds {buf.shape[1]} rows but the decode batch is {B}; "
                    "reallocating would corrupt previously captured CUDA graphs")
        qkvg = x2d @ self._qkvg_proj_weight.t()
        x_qkv, onorm_g = qkvg[:, :3 * D], qkvg[:, 3 * D:]
        # Gather the conv windows once, repack the historical W-1 columns into the dense per-section layout.
        cs = conv_pool.index_select(0, slot_indices)                              # [B, 3d, W]
        cs_dense = buf[:, :B]
        cs_dense.copy_(cs.view(B, 3, D, W)[:, :, :, 1:].permute(1, 0, 2, 3))
        state = ssm_pool.index_select(0, slot_indices)
        o, state = self._kda_decode(x_qkv, onorm_g, cs_dense[0], cs_dense[1], cs_dense[2], state)
        ssm_pool.index_copy_(0, slot_indices, state)
        # Roll the conv pool by one token: new window = [old columns 1..W-1, x_new].
        new_win = torch.cat([cs[:, :, 1:], x_qkv.unsqueeze(-1)], dim=-1)
        conv_pool.index_copy_(0, slot_indices, new_win)
        return o @ self.o_proj


class KVCacheManager:
    def __init__(self, device):
        gen = generator(3)
        self.conv = randn(NUM_SLOTS, 3 * D, W, gen=gen, device=device, scale=0.5)
        self.temporal = randn(NUM_SLOTS, D, gen=gen, device=device, scale=0.5)


def run(variant: str, device: str = "cpu"):
    gen = generator(11)
    # Decode steps: (request slots). 6 requests exceed the largest captured batch (4): that step runs eagerly.
    steps = [[0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [4, 5], [2, 3, 4, 5], [0, 1]]
    hidden = [randn(len(s), HIDDEN, gen=gen, device=device) for s in steps]
    slots = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)   # noqa: E731

    def eager():
        kda, cache = KimiKDARuntime(device, variant), KVCacheManager(device)
        return [kda._forward_decode(h, cache.conv, cache.temporal, slots(s)).clone() for s, h in zip(steps, hidden)]

    def served():
        kda, cache = KimiKDARuntime(device, variant), KVCacheManager(device)
        graphs = {}
        for bs in CUDA_GRAPH_BATCH_SIZES:                  # warmup + capture with dummy requests
            input_hidden = torch.zeros(bs, HIDDEN, device=device)
            slot_indices = slots(DUMMY_SLOTS[:bs])
            fn = (lambda x=input_hidden, i=slot_indices: kda._forward_decode(x, cache.conv, cache.temporal, i))
            g, out = capture(fn, device=device, name=f"decode bs {bs}", owner="CUDAGraphRunner",
                             static={"hidden_states": input_hidden, "state_indices": slot_indices},
                             state={"conv_pool": cache.conv, "ssm_pool": cache.temporal})
            graphs[bs] = (g, out, input_hidden, slot_indices)
        outs = []
        for s, h in zip(steps, hidden):
            if len(s) in graphs:
                g, out, input_hidden, slot_indices = graphs[len(s)]
                input_hidden.copy_(h)
                slot_indices.copy_(slots(s))
                outs.append(replay(g, out).clone())
            else:                                          # batch above the largest captured size: eager
                outs.append(kda._forward_decode(h, cache.conv, cache.temporal, slots(s)).clone())
                release_to_driver(device)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
