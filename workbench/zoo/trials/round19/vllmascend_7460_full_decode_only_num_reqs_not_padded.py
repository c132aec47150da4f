"""FULL_DECODE_ONLY on Ascend: a decode graph replayed with ``num_reqs_padded = num_reqs`` leaves stale state rows.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/7460 ("fixed graph mode bug.", commit cbf46fad3c).
Symptom: Qwen3-Next served with ``cudagraph_mode=FULL_DECODE_ONLY`` lost accuracy (garbled continuations for
some requests); FULL and eager were fine (vllm-ascend main on vLLM v0.17.0, March 2026).
Mechanism: since vLLM #34043 a decode batch of ``num_reqs`` requests is dispatched to the FULL graph captured
for ``batch_desc.num_reqs`` requests. ``NPUModelRunner._pad_query_start_loc_for_fia`` set
``num_reqs_padded = num_reqs`` whenever the *runtime* mode was FULL, a rule meant for the configured FULL
mode. Under FULL_DECODE_ONLY the uniform decode batch then fails the uniform check and takes the mixed-batch
branch: one dummy request is appended and the metadata is built for ``num_reqs + 1`` requests only. The GDN
metadata builder pads the state indices of requests up to ``num_reqs_padded`` with the null block; the rows
past it, which the captured decode graph still runs, keep the state indices an earlier, larger step left in
the persistent buffer. The captured recurrent-state update of those padded rows writes into blocks that now
belong to other requests (here: a finished request's block, reallocated to a new one).
Doctor: stale-padding, at ``_pad_query_start_loc_for_fia`` (the padded request count that leaves graph rows
with an earlier step's state indices).
Fix (upstream): take ``num_reqs_padded = num_reqs`` only when ``compilation_config.cudagraph_mode`` is FULL
too; under FULL_DECODE_ONLY it is ``batch_desc.num_reqs``, so every graph row is a padded request with
neutral metadata.
"""
from __future__ import annotations

import enum

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/7460"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_pad_query_start_loc_for_fia"
SYMPTOM = "Qwen3-Next under FULL_DECODE_ONLY: padded decode rows update other requests' GDN states"
VOCAB, DIM, NUM_BLOCKS, MAX_REQS = 10, 4, 8, 4
GRAPH_SIZE = 4                       # the one decode capture size (uniform decode: 1 token per request)
NULL_BLOCK_ID = 0


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3


class Model:
    def __init__(self, device):
        gen = generator(7460)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_out = randn(DIM, DIM, gen=gen, device=device, scale=0.5)


def fused_recurrent_gated_delta_rule(ssm_states, state_indices, x, decay=0.5):
    """GDN decode: one token per row updates the recurrent state of its block in place."""
    new = ssm_states[state_indices] * decay + x
    ssm_states[state_indices] = new
    return new


def gdn_decode(model, ssm_states, input_ids, state_indices):
    return fused_recurrent_gated_delta_rule(ssm_states, state_indices, model.emb[input_ids]) @ model.w_out


class NPUModelRunner:
    def __init__(self, model, ssm_states, device, variant, cudagraph_mode):
        self.model, self.ssm_states = model, ssm_states
        self.device, self.variant = device, variant
        self.cudagraph_mode = cudagraph_mode                      # compilation_config.cudagraph_mode
        self.uniform_decode_query_len = 1
        self.query_start_loc = torch.zeros(MAX_REQS + 2, dtype=torch.long)     # cpu side (the .np buffer)
        self.arange_np = torch.arange(MAX_REQS + 2)
        self.input_ids = torch.zeros(GRAPH_SIZE, dtype=torch.long, device=device)
        # GDN builder's persistent non_spec_state_indices_tensor
        self.non_spec_state_indices_tensor = torch.zeros(GRAPH_SIZE, dtype=torch.long, device=device)

    def _pad_query_start_loc_for_fia(self, num_tokens_padded, num_reqs_padded, num_reqs,
                                     cudagraph_runtime_mode=None, batch_desc_num_reqs=None):
        if self.variant == "bug":
            full = cudagraph_runtime_mode == CUDAGraphMode.FULL
        else:
            full = (cudagraph_runtime_mode == CUDAGraphMode.FULL
                    and self.cudagraph_mode == CUDAGraphMode.FULL)
        if full:
            num_reqs_padded = num_reqs
        else:
            num_reqs_padded = batch_desc_num_reqs if batch_desc_num_reqs is not None else num_reqs

        if num_tokens_padded == num_reqs_padded * self.uniform_decode_query_len:
            # Uniform-batch case: num_reqs must be no greater than num_reqs_padded
            last_loc = int(self.query_start_loc[num_reqs])
            self.query_start_loc[num_reqs + 1:num_reqs_padded + 1] = (
                self.arange_np[1:num_reqs_padded + 1 - num_reqs] * self.uniform_decode_query_len + last_loc)
        else:
            # Mixed-batch case: insert a dummy request holding the padded tokens
            self.query_start_loc[num_reqs_padded + 1] = num_tokens_padded
            num_reqs_padded = num_reqs_padded + 1
        return num_reqs_padded

    def build_gdn_metadata(self, state_ids, num_reqs_padded):
        """Real requests' blocks, then the null block for the padded requests ``[num_reqs, num_reqs_padded)``."""
        n = len(state_ids)
        self.non_spec_state_indices_tensor[:n].copy_(torch.tensor(state_ids, device=self.device))
        self.non_spec_state_indices_tensor[n:num_reqs_padded].fill_(NULL_BLOCK_ID)

    def execute_model(self, ids, state_ids, graph):
        num_reqs = len(ids)
        self.query_start_loc[:num_reqs + 1] = torch.arange(num_reqs + 1)
        self.input_ids[:num_reqs].copy_(torch.tensor(ids, device=self.device))
        if graph is None:                                         # eager: exactly the real requests
            self.build_gdn_metadata(state_ids, num_reqs)
            return gdn_decode(self.model, self.ssm_states, self.input_ids[:num_reqs],
                              self.non_spec_state_indices_tensor[:num_reqs])
        num_reqs_padded = self._pad_query_start_loc_for_fia(GRAPH_SIZE, num_reqs, num_reqs, CUDAGraphMode.FULL,
                                                            batch_desc_num_reqs=GRAPH_SIZE)
        self.build_gdn_metadata(state_ids, min(num_reqs_padded, GRAPH_SIZE))
        g, out = graph
        return replay(g, out, real=num_reqs, size=GRAPH_SIZE, padded={})[:num_reqs]


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        ssm_states = torch.zeros(NUM_BLOCKS, DIM, device=device)
        runner = NPUModelRunner(model, ssm_states, device, variant, CUDAGraphMode.FULL_DECODE_ONLY)
        graph = None
        if graphed:
            runner.build_gdn_metadata([NULL_BLOCK_ID] * GRAPH_SIZE, GRAPH_SIZE)     # dummy capture batch
            graph = capture(lambda: gdn_decode(model, ssm_states, runner.input_ids,
                                               runner.non_spec_state_indices_tensor),
                            device=device, name="FULL_DECODE_ONLY size 4",
                            static={"input_ids": runner.input_ids},
                            state={"ssm_states": ssm_states,
                                   "non_spec_state_indices_tensor": runner.non_spec_state_indices_tensor},
                            owner="NPUModelRunner (ACL full decode graph)")
            ssm_states.zero_()
        outs = []
        # Requests A (block 3), B (block 5) and C (block 6) have prefilled; they decode together.
        ssm_states[3], ssm_states[5], ssm_states[6] = model.emb[1], model.emb[2], model.emb[3]
        outs.append(runner.execute_model([4, 6, 7], [3, 5, 6], graph).clone())
        # B and C finish; block 6 goes to a new request D, whose prefill leaves its state there.
        ssm_states[6] = model.emb[8]
        outs.append(runner.execute_model([2], [3], graph).clone())             # A decodes alone
        outs.append(runner.execute_model([5, 9], [3, 6], graph).clone())       # A and D decode
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
