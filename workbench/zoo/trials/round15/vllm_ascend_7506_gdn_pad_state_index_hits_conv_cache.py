"""FULL graph GDN spec decode: padded requests' state index -1 makes the recurrent kernel write into the conv cache.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/7506 ("[BugFix][P/D] fix padding error on FullGraph
mode && fix layerwise connector mamba accuracy", commit 67aad1fce8).
Symptom: GDN (linear-attention) models such as Qwen3-Next, with MTP speculative decoding and FULL ACL graphs, get
NaN / garbled tokens once decode batches are padded up to a capture size; eager mode is clean (vllm-ascend main
on vLLM v0.17.0, March 2026).
Mechanism: for a FULL graph the upstream ``GDNAttentionMetadataBuilder`` pads ``spec_state_indices_tensor`` rows
of padded requests with ``PAD_SLOT_ID`` (-1). The conv1d kernel skips pad slots, but Ascend's Triton
``fused_recurrent_gated_delta_rule`` as replayed in the FULL graph writes each sequence's final SSM state without
the ``ssm_state_indices >= 0`` guard: it computes the address ``ssm_base + (-1) * ssm_stride`` and writes there.
On vllm-ascend a layer's mamba cache is one contiguous tensor, the conv part followed by the SSM part, so that
address is the tail of the conv part: the conv states of the last blocks, owned by a live request. Its next
decode starts from the padded row's garbage. Eager steps have no padded requests and never produce -1.
Doctor: stale-padding, at ``fused_recurrent_gated_delta_rule`` (a real request's cached state is overwritten
through the padded rows' state index).
Fix (upstream): after building the GDN metadata in ``_build_attention_metadata``, for FULL graphs and pure spec
decode batches, fill ``spec_state_indices_tensor[num_spec_decodes:]`` with 0 (the reserved null block) instead
of -1. The Triton kernel's missing guard is modelled as raw address arithmetic on the flat cache.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/7506"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "fused_recurrent_gated_delta_rule"
SYMPTOM = "a padded spec-decode row's SSM write at index -1 lands in a live request's conv state (NaN/garbled text)"
VOCAB, DIM, NUM_BLOCKS, NUM_SPEC = 10, 2, 6, 1
TOKENS_PER_REQ = 1 + NUM_SPEC
MAX_BS = 2                                   # FULL graph capture batch: 2 requests x 2 tokens
CONV_NUMEL, SSM_NUMEL = DIM, DIM * DIM       # width-2 causal conv keeps the previous token; SSM state is D x D
SSM_BASE = NUM_BLOCKS * CONV_NUMEL           # [conv states of all blocks | SSM states of all blocks]
PAD_SLOT_ID = -1
NULL_BLOCK = 0


def causal_conv1d_update(x, mamba_cache, conv_state_indices, conv_weight):
    """Width-2 causal conv over each request's tokens; rows whose index is PAD_SLOT_ID are skipped."""
    conv_state = mamba_cache[:SSM_BASE].view(NUM_BLOCKS, CONV_NUMEL)
    valid = (conv_state_indices != PAD_SLOT_ID)[:, None]
    idx = conv_state_indices.clamp(min=0)
    prev = torch.where(valid, conv_state[idx], torch.zeros_like(conv_state[idx]))
    shifted = torch.cat([prev[:, None, :], x[:, :-1, :]], dim=1)
    conv_state[idx] = torch.where(valid, x[:, -1, :], conv_state[idx])
    return torch.tanh(shifted * conv_weight[0] + x * conv_weight[1])


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, mamba_cache, ssm_state_indices, num_accepted_tokens):
    """Gated delta rule over each request's draft tokens. The initial state is read from block
    ``ssm_state_indices[i, num_accepted_tokens[i] - 1]``; the state after token ``t`` is written to block
    ``ssm_state_indices[i, t]``, by address (as replayed in the FULL graph: no ``>= 0`` guard)."""
    lanes = torch.arange(SSM_NUMEL, device=q.device)
    init_idx = ssm_state_indices.gather(1, (num_accepted_tokens - 1)[:, None]).squeeze(1)
    h = mamba_cache[SSM_BASE + init_idx[:, None] * SSM_NUMEL + lanes].view(-1, DIM, DIM)
    outs = []
    for t in range(q.shape[1]):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]
        h = h * g[:, t, None, None]
        delta = (vt - torch.einsum("nij,ni->nj", h, kt)) * beta[:, t, None]
        h = h + kt[:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("nij,ni->nj", h, qt))
        addr = SSM_BASE + ssm_state_indices[:, t][:, None] * SSM_NUMEL + lanes
        mamba_cache.index_put_((addr.reshape(-1),), h.reshape(-1))
    return torch.stack(outs, dim=1)


class Qwen3NextGatedDeltaNet:
    def __init__(self, device):
        gen = generator(7506)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.conv_weight = randn(2, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=1.5) for _ in range(4))
        self.w_g = randn(DIM, gen=gen, device=device, scale=0.5)
        self.w_beta = randn(DIM, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, mamba_cache, spec_state_indices_tensor, num_accepted_tokens):
        h = self.embed_tokens[input_ids].view(-1, TOKENS_PER_REQ, DIM)
        x = causal_conv1d_update(h, mamba_cache, spec_state_indices_tensor[:, 0], self.conv_weight)
        g = torch.sigmoid(x @ self.w_g)
        beta = torch.sigmoid(x @ self.w_beta)
        k = torch.nn.functional.normalize(x @ self.wk, dim=-1)
        core = fused_recurrent_gated_delta_rule(x @ self.wq, k, x @ self.wv, g, beta, mamba_cache,
                                                spec_state_indices_tensor, num_accepted_tokens)
        return (h + core @ self.wo).view(-1, DIM)


class GDNAttentionMetadataBuilder:
    """vLLM's builder: persistent metadata buffers for FULL graphs, padded rows get PAD_SLOT_ID."""

    def __init__(self, device):
        self.spec_state_indices_tensor = torch.full((MAX_BS, TOKENS_PER_REQ), PAD_SLOT_ID, dtype=torch.long,
                                                    device=device)
        self.num_accepted_tokens = torch.ones(MAX_BS, dtype=torch.long, device=device)

    def build(self, block_table, num_accepted_tokens, batch_size: int):
        num_spec_decodes = block_table.shape[0]
        self.spec_state_indices_tensor[:num_spec_decodes].copy_(block_table[:, :TOKENS_PER_REQ])
        self.spec_state_indices_tensor[num_spec_decodes:].fill_(PAD_SLOT_ID)
        self.num_accepted_tokens[:num_spec_decodes].copy_(num_accepted_tokens)
        self.num_accepted_tokens[num_spec_decodes:].fill_(1)
        return {"num_prefills": 0, "num_decodes": 0, "num_spec_decodes": num_spec_decodes,
                "spec_state_indices_tensor": self.spec_state_indices_tensor[:batch_size],
                "num_accepted_tokens": self.num_accepted_tokens[:batch_size]}


class NPUModelRunner:
    def __init__(self, model, device, variant, full_graph: bool):
        self.model, self.device, self.variant, self.full_graph = model, device, variant, full_graph
        self.input_ids = torch.zeros(MAX_BS * TOKENS_PER_REQ, dtype=torch.long, device=device)
        self.mamba_cache = torch.zeros(SSM_BASE + NUM_BLOCKS * SSM_NUMEL, device=device)   # one layer's raw tensor
        self.builder = GDNAttentionMetadataBuilder(device)
        self.graph = None

    def _build_attention_metadata(self, block_table, num_accepted_tokens, batch_size):
        attn_metadata_i = self.builder.build(block_table, num_accepted_tokens, batch_size)
        if self.variant == "fix" and self.full_graph and attn_metadata_i["num_prefills"] == 0:
            # the Triton operator does not deal with -1 padding in FullGraph mode: pad with the null block
            if attn_metadata_i["num_decodes"] == 0 and attn_metadata_i["num_spec_decodes"] > 0:
                attn_metadata_i["spec_state_indices_tensor"][attn_metadata_i["num_spec_decodes"]:].fill_(NULL_BLOCK)
        return attn_metadata_i

    def capture_model(self):
        meta = self._build_attention_metadata(torch.full((MAX_BS, TOKENS_PER_REQ), NULL_BLOCK, device=self.device),
                                              torch.ones(MAX_BS, dtype=torch.long, device=self.device), MAX_BS)
        self.graph = capture(lambda: self.model.forward(self.input_ids, self.mamba_cache,
                                                        meta["spec_state_indices_tensor"], meta["num_accepted_tokens"]),
                             device=self.device,
                             static={"input_ids": self.input_ids,
                                     "spec_state_indices_tensor": self.builder.spec_state_indices_tensor,
                                     "num_accepted_tokens": self.builder.num_accepted_tokens},
                             state={"mamba_cache": self.mamba_cache}, owner="NPUModelRunner (FULL ACL graph)")

    def execute_model(self, token_ids, block_table, num_accepted_tokens):
        num_reqs = block_table.shape[0]
        num_tokens = num_reqs * TOKENS_PER_REQ
        self.input_ids[:num_tokens].copy_(torch.tensor(token_ids, device=self.device))
        if not self.full_graph:
            meta = self._build_attention_metadata(block_table, num_accepted_tokens, num_reqs)
            return self.model.forward(self.input_ids[:num_tokens], self.mamba_cache,
                                      meta["spec_state_indices_tensor"], meta["num_accepted_tokens"]).clone()
        self._build_attention_metadata(block_table, num_accepted_tokens, MAX_BS)
        g, out = self.graph
        return replay(g, out, real=num_tokens, size=MAX_BS * TOKENS_PER_REQ,
                      padded={"input_ids": self.input_ids})[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    model = Qwen3NextGatedDeltaNet(device)
    gen = torch.Generator().manual_seed(3)
    prefill_conv = torch.randn(CONV_NUMEL, generator=gen)
    prefill_ssm = torch.randn(SSM_NUMEL, generator=gen) * 0.5
    # One request decoding with MTP (1 + 1 draft per step, all accepted): its mamba blocks are 4 (conv state,
    # draft position 0) and 5 (draft position 1), the last blocks of the cache. The batch of 1 is padded to 2.
    block_table = torch.tensor([[4, 5]], device=device)
    num_accepted = torch.tensor([TOKENS_PER_REQ], device=device)
    steps = [[3, 7], [1, 8], [6, 2]]

    def serve(full_graph: bool):
        runner = NPUModelRunner(model, device, variant, full_graph)
        if full_graph:
            runner.capture_model()
        # The prefill left the request's conv state in block 4 and its SSM state in block 5 (accepted position).
        runner.mamba_cache[4 * CONV_NUMEL: 5 * CONV_NUMEL] = prefill_conv.to(device)
        runner.mamba_cache[SSM_BASE + 5 * SSM_NUMEL: SSM_BASE + 6 * SSM_NUMEL] = prefill_ssm.to(device)
        return [runner.execute_model(ids, block_table, num_accepted) for ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
