"""MTP>1 drafting: every draft step's SFA metadata is written into the one graph-stable sequence-length buffer.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/14236 ("[BugFix][SpecDecode] Fix low MTP acceptance
rate for SFA (MTP>1)"), fixing https://github.com/vllm-project/vllm-ascend/issues/14306.
Symptom: GLM-5.2 with MTP speculative decoding (``num_speculative_tokens > 1``) on the SFA attention backend has a
much lower acceptance rate in graph mode than expected; outputs stay correct, throughput drops (vllm-ascend
main, August 2026; the same bug on the SFA+DSA-CP path was fixed in #10825).
Mechanism: the drafter builds attention metadata once per draft step (``build_for_drafting(common_attn_metadata,
draft_index)``) and then replays the merged draft graph, which runs all draft steps and reads each step's
``actual_seq_lengths_key`` from the tensors that step's metadata references. The SFA builder already allocated
per-draft-step graph-stable buffers (``spec_actual_seq_lengths_query/key``), but ``_build`` always wrote every
step into the main ``actual_seq_lengths_query``/``actual_seq_lengths_key`` buffers (the ones the target model's
graph reads). Building draft step 2 overwrites in place what draft step 1's metadata points at, so at replay
step 1 attends over step 2's key length: one KV position too many, which holds no token of the request yet.
Eagerly each step's metadata is built right before that step runs, so the shared buffer is harmless there.
Doctor: persistent-mutation, at ``_build`` (building a later draft step writes the graph-stable buffer that the
earlier step's captured attention reads).
Fix (upstream): ``_build`` selects ``spec_actual_seq_lengths_query/key[draft_index - 1]`` whenever a
``draft_index`` is given; non-drafting calls keep the main buffers.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/14236"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "_build"
SYMPTOM = "draft step 1 attends with draft step 2's key length: wrong drafts, low MTP acceptance in graph mode"
VOCAB, DIM, MAX_NUM_REQS, MAX_MODEL_LEN, NUM_SPEC = 6, 4, 2, 10, 2


class AscendSFAMetadataBuilder:
    def __init__(self, device, variant):
        self.variant = variant
        # graph-stable buffers of the main (target / verify) path
        self.actual_seq_lengths_query = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.actual_seq_lengths_key = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        # graph-stable buffers owned by each draft step
        self.spec_actual_seq_lengths_query = [torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
                                              for _ in range(NUM_SPEC)]
        self.spec_actual_seq_lengths_key = [torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
                                            for _ in range(NUM_SPEC)]

    def build_for_drafting(self, common_attn_metadata, draft_index: int):
        return self._build(common_attn_metadata, draft_index)

    def _build(self, common_attn_metadata, draft_index: int | None = None):
        num_reqs = common_attn_metadata["num_reqs"]
        if self.variant == "fix" and draft_index is not None:
            actual_seq_lengths_query = self.spec_actual_seq_lengths_query[draft_index - 1]
            actual_seq_lengths_key = self.spec_actual_seq_lengths_key[draft_index - 1]
        else:
            actual_seq_lengths_query = self.actual_seq_lengths_query
            actual_seq_lengths_key = self.actual_seq_lengths_key
        actual_seq_lengths_query[:num_reqs].copy_(common_attn_metadata["query_start_loc"][1:])
        actual_seq_lengths_key[:num_reqs].copy_(common_attn_metadata["seq_lens"])
        return {"actual_seq_lengths_query": actual_seq_lengths_query[:num_reqs],
                "actual_seq_lengths_key": actual_seq_lengths_key[:num_reqs],
                "slot_mapping": common_attn_metadata["slot_mapping"]}


def sparse_flash_attention(query, kv_cache, actual_seq_lengths_key):
    """Decode attention of each request's query over its first ``actual_seq_lengths_key`` KV positions."""
    scores = torch.einsum("rd,rsd->rs", query, kv_cache) / math.sqrt(query.shape[-1])
    valid = torch.arange(MAX_MODEL_LEN, device=query.device)[None, :] < actual_seq_lengths_key[:, None]
    return torch.einsum("rs,rsd->rd", torch.softmax(scores.masked_fill(~valid, float("-inf")), -1), kv_cache)


class MtpProposer:
    def __init__(self, device, variant):
        gen = generator(14236)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_q = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.w_o = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.builder = AscendSFAMetadataBuilder(device, variant)
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_REQS, DIM, device=device)
        # per-step slot mappings (graph-stable, one per draft step), as ``slot_mapping_group``
        self.slot_mapping_group = [torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
                                   for _ in range(NUM_SPEC)]
        self.query_start_loc = torch.arange(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)

    def draft_step(self, kv_cache, attn_metadata, input_ids, hidden_states):
        x = self.embed[input_ids] + hidden_states
        rows = torch.arange(x.shape[0], device=x.device)
        kv_cache[rows, attn_metadata["slot_mapping"]] = x                    # reshape_and_cache
        attn = sparse_flash_attention(x @ self.w_q, kv_cache, attn_metadata["actual_seq_lengths_key"])
        hidden_states = x + attn @ self.w_o
        return (hidden_states @ self.lm_head).argmax(dim=-1), hidden_states

    def _run_merged_draft(self, kv_cache, attn_metadatas):
        """All draft steps in one (FULL) graph."""
        input_ids, hidden_states, draft_tokens = self.input_ids, self.hidden_states, []
        for attn_metadata in attn_metadatas:
            input_ids, hidden_states = self.draft_step(kv_cache, attn_metadata, input_ids, hidden_states)
            draft_tokens.append(input_ids)
        return torch.stack(draft_tokens, dim=1), hidden_states

    def common_attn_metadata(self, seq_lens, draft_index):
        """Draft step ``draft_index`` (1-based) decodes position ``seq_len + draft_index - 1``."""
        positions = torch.tensor(seq_lens) + draft_index - 1
        self.slot_mapping_group[draft_index - 1].copy_(positions)
        return {"num_reqs": len(seq_lens), "query_start_loc": self.query_start_loc,
                "seq_lens": (positions + 1).to(torch.int32), "slot_mapping": self.slot_mapping_group[draft_index - 1]}


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(5)
    # Two propose rounds: context lengths after the target's verify, its last sampled token and hidden state.
    rounds = [([3, 5], [2, 4]), ([5, 6], [1, 3])]
    target_kv = torch.randn(MAX_NUM_REQS, MAX_MODEL_LEN, DIM, generator=gen)
    target_hidden = [torch.randn(MAX_NUM_REQS, DIM, generator=gen) for _ in rounds]

    def serve(graphed: bool):
        proposer = MtpProposer(device, variant)
        builder = proposer.builder
        kv_cache = torch.zeros(MAX_NUM_REQS, MAX_MODEL_LEN, DIM, device=device)
        if graphed:
            dummy = [builder.build_for_drafting(proposer.common_attn_metadata([1] * MAX_NUM_REQS, k), k)
                     for k in range(1, NUM_SPEC + 1)]
            static = {"input_ids": proposer.input_ids, "hidden_states": proposer.hidden_states,
                      "actual_seq_lengths_key": builder.actual_seq_lengths_key}
            static.update({f"spec_actual_seq_lengths_key[{i}]": t for i, t in
                           enumerate(builder.spec_actual_seq_lengths_key)})
            static.update({f"slot_mapping_group[{i}]": t for i, t in enumerate(proposer.slot_mapping_group)})
            g, out = capture(lambda: proposer._run_merged_draft(kv_cache, dummy), device=device, static=static,
                             state={"kv_cache": kv_cache}, owner="MtpProposer (FULL merged draft graph)")
            kv_cache.zero_()                              # the dummy run's KV is discarded
        outs = []
        for (seq_lens, last_tokens), hidden in zip(rounds, target_hidden):
            for r, length in enumerate(seq_lens):         # the target model wrote the context's KV
                kv_cache[r, :length].copy_(target_kv[r, :length].to(device))
            proposer.input_ids.copy_(torch.tensor(last_tokens))
            proposer.hidden_states.copy_(hidden.to(device))
            if graphed:
                attn_metadatas = [builder.build_for_drafting(proposer.common_attn_metadata(seq_lens, k), k)
                                  for k in range(1, NUM_SPEC + 1)]
                draft_tokens, last_hidden = replay(g, out)
            else:
                input_ids, hidden_states, tokens = proposer.input_ids, proposer.hidden_states, []
                for k in range(1, NUM_SPEC + 1):
                    attn_metadata = builder.build_for_drafting(proposer.common_attn_metadata(seq_lens, k), k)
                    input_ids, hidden_states = proposer.draft_step(kv_cache, attn_metadata, input_ids, hidden_states)
                    tokens.append(input_ids)
                draft_tokens, last_hidden = torch.stack(tokens, dim=1), hidden_states
            outs += [draft_tokens.clone(), last_hidden.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
