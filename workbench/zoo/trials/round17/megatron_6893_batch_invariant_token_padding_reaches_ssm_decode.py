"""Batch-invariant CUDA-graph buckets pad tokens to 64 but not requests: the Mamba decode reshape gets the padded rows.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/6893 ("fix(inference): preserve batch invariance for Nemotron
Nano"), a follow-up to https://github.com/NVIDIA/Megatron-LM/pull/6521.
Symptom: dynamic inference of Nemotron Nano (hybrid Mamba/attention) with ``batch_invariant_mode`` and CUDA graphs
failed in decode with invalid reshape / input dimensions in decode attention and the SSM (Megatron-LM main, August
2026, after #6521).
Mechanism: #6521 aligns every CUDA-graph bucket's token count up to a multiple of ``TOKEN_ROUNDER`` (64), so graphed
norms run in the same M-alignment class as eager steps, while leaving the bucket's request counts unchanged: a
decode-only bucket is ``(token_count=64, decode_req_count=4)``. ``match_graph_config`` serves a decode step of 3
requests at that bucket, and ``padded_batch_dimensions`` becomes the bucket's. ``ssm_dynamic_inference`` then takes
the whole packed batch as the decode partition when there is no prefill (``zxBCdt_decode = zxBCdt``) and views it
as ``[decode_req_count, seq_len, -1]``: 64 token rows folded into 4 requests, so the decode kernel gets rows 16
times too wide. Eager decode steps pad tokens and requests to the same count and never see the mismatch.
Doctor: padded-shape-mismatch, at ``ssm_dynamic_inference`` (at the bucket's padded size, token-padded activations
combined with request-sized metadata).
Fix (upstream): exclude the token-only padding before the decode attention and SSM kernels (take the first
``decode_req_count * seq_len`` rows) and restore zero padding to ``token_count`` rows before their output
projections.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/6893"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "ssm_dynamic_inference"
SYMPTOM = "decode-only steps in a 64-token-aligned graph bucket crash in the Mamba decode reshape"
TOKEN_ROUNDER = 64
HIDDEN, D_INNER, MAX_REQUESTS = 4, 4, 4
PAD_SLOT = MAX_REQUESTS                  # padded requests update a dummy state slot (upstream: index -1 is skipped)


@dataclasses.dataclass(frozen=True)
class InferenceBatchDimensions:
    token_count: int
    prefill_req_count: int
    decode_req_count: int


def _batch_invariant_token_align(token_count: int) -> int:
    """Round a CUDA-graph bucket token count UP to a 64-multiple (min 64)."""
    rounded_up = math.ceil(token_count / TOKEN_ROUNDER) * TOKEN_ROUNDER
    return max(TOKEN_ROUNDER, rounded_up)


class CUDAGraphBatchDimensionBuilder:
    @staticmethod
    def generate_cuda_graph_batch_dimensions_list(max_requests):
        """Decode-only buckets; under batch-invariant mode the token count is PADDING, request counts untouched."""
        cuda_graph_batch_dimensions_list = []
        for decode_req_count in (max_requests, max_requests // 2):
            batch_dim = InferenceBatchDimensions(_batch_invariant_token_align(decode_req_count), 0, decode_req_count)
            if batch_dim not in cuda_graph_batch_dimensions_list:
                cuda_graph_batch_dimensions_list.append(batch_dim)
        return cuda_graph_batch_dimensions_list

    @staticmethod
    def match_graph_config(batch_dimensions, cuda_graph_batch_dimensions_list):
        fits = [g for g in cuda_graph_batch_dimensions_list
                if g.decode_req_count >= batch_dimensions.decode_req_count and g.prefill_req_count == 0
                and g.token_count >= batch_dimensions.token_count]
        return min(fits, key=lambda g: (g.token_count, g.decode_req_count)) if fits else None


class DynamicInferenceContext:
    def __init__(self, device):
        self.padded_batch_dimensions = None
        self.num_speculative_tokens = 0
        self.batch_indices_decode = torch.full((MAX_REQUESTS,), PAD_SLOT, dtype=torch.long, device=device)
        self.mamba_ssm_states = torch.zeros(MAX_REQUESTS + 1, D_INNER, device=device)

    def mamba_states_cache(self):
        return self.mamba_ssm_states


class MambaMixer:
    def __init__(self, device, variant):
        gen = generator(6893)
        self.in_proj_weight = randn(HIDDEN, 2 * D_INNER, gen=gen, device=device, scale=0.5)
        self.out_proj_weight = randn(D_INNER, HIDDEN, gen=gen, device=device, scale=0.5)
        self.A = torch.linspace(0.3, 0.9, D_INNER).to(device)
        self.variant = variant

    def in_proj(self, hidden_states):
        return hidden_states @ self.in_proj_weight, None

    def out_proj(self, y):
        return y @ self.out_proj_weight, None

    def ssm_decode(self, zxBCdt, ssm_state, batch_indices):
        """One recurrent step per request: ``[N, S, 2*d_inner]`` in, ``[N, S, d_inner]`` out."""
        x, z = torch.split(zxBCdt, [D_INNER, D_INNER], dim=-1)
        new_state = ssm_state[batch_indices] * self.A + x[:, -1]
        ssm_state[batch_indices] = new_state
        return (new_state * F.silu(z[:, -1])).unsqueeze(1)

    def ssm_dynamic_inference(self, hidden_states, context):
        ssm_state = context.mamba_states_cache()
        padded_dims = context.padded_batch_dimensions
        token_count = padded_dims.token_count
        decode_req_count = padded_dims.decode_req_count
        prefill_req_count = padded_dims.prefill_req_count

        zxBCdt, _ = self.in_proj(hidden_states)

        # --- Decode partition (placed first in the packed batch) ---------
        seq_len = 1 + context.num_speculative_tokens
        decode_token_count = decode_req_count * seq_len
        if self.variant == "bug":
            zxBCdt_decode = zxBCdt[:decode_token_count] if prefill_req_count > 0 else zxBCdt
        else:
            # Exclude batch-invariant token-only padding before the decode kernels.
            zxBCdt_decode = zxBCdt[:decode_token_count]
        # Reshape from [N*S, 1, d] to [N, S, d] for the decode kernels.
        zxBCdt_decode = zxBCdt_decode.squeeze(1).view(decode_req_count, seq_len, -1)
        y_decode = self.ssm_decode(zxBCdt_decode, ssm_state, context.batch_indices_decode[:decode_req_count])
        # Flatten back to [N*S, 1, d] to match the merge logic.
        y = y_decode.view(decode_token_count, 1, -1)
        if self.variant == "fix" and token_count > decode_token_count:
            y = F.pad(y, (0, 0, 0, 0, 0, token_count - decode_token_count))   # restore zero padding rows
        return self.out_proj(y)


def run(variant: str, device: str = "cpu"):
    gen = generator(68930)
    # Three requests decode for three steps, then one finishes and two decode once more.
    steps = [([0, 1, 2], randn(3, 1, HIDDEN, gen=gen, device=device)) for _ in range(3)]
    steps.append(([0, 2], randn(2, 1, HIDDEN, gen=gen, device=device)))

    def eager():
        mixer, context = MambaMixer(device, variant), DynamicInferenceContext(device)
        outs = []
        for slots, hidden in steps:
            n = len(slots)
            # Eager decode pads tokens and requests to one count: here, no padding at all.
            context.padded_batch_dimensions = InferenceBatchDimensions(n, 0, n)
            context.batch_indices_decode[:n] = torch.tensor(slots, device=device)
            out, _ = mixer.ssm_dynamic_inference(hidden, context)
            outs.append(out[:n].clone())
        return outs

    def served():
        mixer, context = MambaMixer(device, variant), DynamicInferenceContext(device)
        buckets = CUDAGraphBatchDimensionBuilder.generate_cuda_graph_batch_dimensions_list(MAX_REQUESTS)
        max_tokens = max(b.token_count for b in buckets)
        hidden_states = torch.zeros(max_tokens, 1, HIDDEN, device=device)
        graphs = {}
        for bucket in buckets:
            def forward(bucket=bucket):
                context.padded_batch_dimensions = bucket
                return mixer.ssm_dynamic_inference(hidden_states[:bucket.token_count], context)[0]
            saved = context.mamba_ssm_states.clone()
            graphs[bucket] = capture(forward, device=device, name=f"decode {bucket}",
                                     owner="DynamicInferenceContext (CUDA graphs)",
                                     static={"hidden_states": hidden_states,
                                             "batch_indices_decode": context.batch_indices_decode},
                                     state={"mamba_ssm_states": context.mamba_ssm_states})
            context.mamba_ssm_states.copy_(saved)       # warmup/capture updates are dummy data
        outs = []
        for slots, hidden in steps:
            n = len(slots)
            bucket = CUDAGraphBatchDimensionBuilder.match_graph_config(InferenceBatchDimensions(n, 0, n), buckets)
            context.padded_batch_dimensions = bucket
            hidden_states[:n].copy_(hidden)
            hidden_states[n:].zero_()
            context.batch_indices_decode[:n] = torch.tensor(slots, device=device)
            context.batch_indices_decode[n:].fill_(PAD_SLOT)
            g, out = graphs[bucket]
            outs.append(replay(g, out, real=n, size=bucket.token_count)[:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
