"""FIA-padded ``query_start_loc`` makes GDN see prefills, so it skips refreshing the FULL graph's spec buffers.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/6822 ("[bugfix] Fixed an accuracy problem of gdn layer
in graph").
Symptom: Qwen3-Next (GDN linear attention) with MTP and ``cudagraph_mode=FULL_DECODE_ONLY`` generates nonsense
(" What and the... the" instead of " What is your name?"); eager mode is fine (vllm-ascend main on vLLM v0.15,
February 2026).
Mechanism: for the FIA kernel's TND layout the NPU model runner pads ``query_start_loc`` up to the graph's batch
(``_pad_query_start_loc_for_fia``): each padded request gets ``uniform_decode_query_len`` padding tokens. The same
buffer went to the GDN metadata builder. GDN classifies requests by their draft-token counts: padded requests have
none (``num_decode_draft_tokens = -1``), so with a query length > 1 they count as *prefills*. The builder copies
this step's spec-decode metadata (``spec_state_indices_tensor``, ``num_accepted_tokens``, ...) into the persistent
buffers the FULL decode graph was captured on only when ``num_prefills == 0 and num_decodes == 0``. So on every
padded step (fewer running requests than the captured batch) the refresh is skipped, and the replayed graph updates
the recurrent states through the state indices and accepted counts of the last unpadded step: a request reads
another request's (or a finished request's) GDN state, and the padding rows write into live states.
Doctor: stale-input, at ``_build_attention_metadata`` (the GDN builder gets the FIA-padded ``query_start_loc`` and
leaves the graph's spec-decode buffers unwritten).
Fix (upstream): keep an unpadded ``gdn_query_start_loc`` (padded requests repeat the last offset: zero length,
which the builder does not count as prefills) and hand it to the GDN builder in ``_build_attention_metadata``.
(Modelled with one GDN layer whose recurrent update is a decayed sum; attention/FIA itself is left out. The
builder follows vLLM's ``GDNAttentionMetadataBuilder.build``; why padded requests count as prefills is read from
that builder, the PR itself only says the padded ``query_start_loc`` breaks GDN.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/6822"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "_build_attention_metadata"
SYMPTOM = "padded FULL_DECODE_ONLY steps replay GDN with the previous step's state indices: garbled Qwen3-Next output"
VOCAB, HIDDEN, NUM_BLOCKS, MAX_NUM_REQS = 12, 4, 10, 4
NUM_SPEC = 1                                          # MTP: one draft token
UNIFORM_DECODE_QUERY_LEN = 1 + NUM_SPEC
CUDAGRAPH_BATCH_SIZE = 2                              # FULL_DECODE_ONLY graph: 2 requests, 4 tokens
NULL_BLOCK_ID = 0


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    block_table_tensor: torch.Tensor


@dataclasses.dataclass
class GDNAttentionMetadata:
    num_prefills: int
    num_spec_decodes: int
    spec_state_indices_tensor: torch.Tensor          # [batch, NUM_SPEC + 1] state slots per request
    num_accepted_tokens: torch.Tensor                # [batch]


class AscendGDNAttentionMetadataBuilder:
    def __init__(self, device, use_full_cuda_graph: bool):
        self.use_full_cuda_graph = use_full_cuda_graph
        self.decode_cudagraph_max_bs = CUDAGRAPH_BATCH_SIZE * UNIFORM_DECODE_QUERY_LEN
        # Persistent buffers the FULL graph is captured on.
        self.spec_state_indices_tensor = torch.zeros(MAX_NUM_REQS, NUM_SPEC + 1, dtype=torch.long, device=device)
        self.num_accepted_tokens = torch.ones(MAX_NUM_REQS, dtype=torch.long, device=device)

    def build(self, m: CommonAttentionMetadata, num_decode_draft_tokens_cpu: torch.Tensor,
              num_accepted_tokens: torch.Tensor) -> GDNAttentionMetadata:
        query_lens_cpu = m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]
        spec_sequence_masks_cpu = num_decode_draft_tokens_cpu[:m.num_reqs] >= 0
        num_spec_decodes = int(spec_sequence_masks_cpu.sum())
        non_spec_query_lens_cpu = query_lens_cpu[~spec_sequence_masks_cpu]
        num_decodes = int((non_spec_query_lens_cpu == 1).sum())
        # Exclude zero-length padded sequences from prefill count.
        num_zero_len = int((non_spec_query_lens_cpu == 0).sum())
        num_prefills = non_spec_query_lens_cpu.size(0) - num_decodes - num_zero_len
        num_spec_decode_tokens = int(query_lens_cpu[spec_sequence_masks_cpu].sum())
        mask = spec_sequence_masks_cpu.to(m.block_table_tensor.device)
        spec_state_indices_tensor = m.block_table_tensor[mask, :NUM_SPEC + 1]
        num_accepted_tokens = num_accepted_tokens[:m.num_reqs][mask]

        # Prepare tensors for cudagraph
        batch_size = m.num_reqs
        if (self.use_full_cuda_graph and num_prefills == 0 and num_decodes == 0
                and num_spec_decodes <= self.decode_cudagraph_max_bs
                and num_spec_decode_tokens <= self.decode_cudagraph_max_bs):
            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state_indices_tensor)
            spec_state_indices_tensor = self.spec_state_indices_tensor[:batch_size]
            spec_state_indices_tensor[num_spec_decodes:].fill_(NULL_BLOCK_ID)
            self.num_accepted_tokens[:num_spec_decodes].copy_(num_accepted_tokens)
            num_accepted_tokens = self.num_accepted_tokens[:batch_size]
            num_accepted_tokens[num_spec_decodes:].fill_(1)
        return GDNAttentionMetadata(num_prefills, num_spec_decodes, spec_state_indices_tensor, num_accepted_tokens)


class Qwen3NextGatedDeltaNet:
    def __init__(self, device):
        gen = generator(6822)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.in_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.out_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, ssm_state, attn_metadata: GDNAttentionMetadata):
        """Spec decode: each request's tokens continue from the state of its last accepted token; the state after
        token t is written to the request's slot t (``fused_recurrent_gated_delta_rule`` with spec indices)."""
        idx = attn_metadata.spec_state_indices_tensor
        x = (self.embed_tokens[input_ids] @ self.in_proj).view(idx.shape[0], UNIFORM_DECODE_QUERY_LEN, HIDDEN)
        init = idx.gather(1, (attn_metadata.num_accepted_tokens - 1).unsqueeze(1)).squeeze(1)
        state = ssm_state[init]
        outs = []
        for t in range(UNIFORM_DECODE_QUERY_LEN):
            state = state * 0.6 + x[:, t]
            ssm_state[idx[:, t]] = state
            outs.append(state)
        return (torch.stack(outs, 1) @ self.out_proj).reshape(-1, HIDDEN)


class NPUModelRunner:
    def __init__(self, model, device, variant, graphed: bool):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.ssm_state = torch.zeros(NUM_BLOCKS, HIDDEN, device=device)
        self.input_ids = torch.zeros(MAX_NUM_REQS * UNIFORM_DECODE_QUERY_LEN, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, NUM_SPEC + 1, dtype=torch.long, device=device)
        self.num_accepted_tokens = torch.ones(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.num_decode_draft_tokens_cpu = torch.full((MAX_NUM_REQS,), -1, dtype=torch.long)
        # NOTE: For FULL mode we change +1 to +2 to reserve extra space for padding.
        self.query_start_loc_cpu = torch.zeros(MAX_NUM_REQS + 2, dtype=torch.long)
        self.gdn_query_start_loc_cpu = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.long)
        self.builder = AscendGDNAttentionMetadataBuilder(device, use_full_cuda_graph=graphed)
        if graphed:
            self.capture_model()

    def _pad_query_start_loc_for_fia(self, num_tokens_padded, num_reqs_padded, num_reqs):
        """TND layout: the last ``actual_seq_lengths_q`` must equal the padded token count."""
        if num_tokens_padded == num_reqs_padded * UNIFORM_DECODE_QUERY_LEN:
            last_loc = self.query_start_loc_cpu[num_reqs]
            self.query_start_loc_cpu[num_reqs + 1:num_reqs_padded + 1] = (
                torch.arange(1, num_reqs_padded + 1 - num_reqs) * UNIFORM_DECODE_QUERY_LEN + last_loc)
        return num_reqs_padded

    def _build_attention_metadata(self, num_reqs, num_reqs_padded, num_tokens_padded):
        cm = CommonAttentionMetadata(query_start_loc_cpu=self.query_start_loc_cpu[:num_reqs_padded + 1],
                                     num_reqs=num_reqs_padded, num_actual_tokens=num_tokens_padded,
                                     block_table_tensor=self.block_table[:num_reqs_padded])
        if self.variant == "fix":
            # Now, query_start_loc is padded. But gdn needs an unpadded one.
            cm.query_start_loc_cpu = self.gdn_query_start_loc_cpu[:num_reqs_padded + 1]
        return self.builder.build(cm, self.num_decode_draft_tokens_cpu, self.num_accepted_tokens)

    def capture_model(self):
        """FULL_DECODE_ONLY capture on a dummy uniform decode batch of CUDAGRAPH_BATCH_SIZE requests."""
        n = CUDAGRAPH_BATCH_SIZE
        self.num_decode_draft_tokens_cpu[:n] = NUM_SPEC
        self.query_start_loc_cpu[:n + 1] = torch.arange(n + 1) * UNIFORM_DECODE_QUERY_LEN
        self.gdn_query_start_loc_cpu[:n + 1] = torch.arange(n + 1) * UNIFORM_DECODE_QUERY_LEN
        attn_metadata = self._build_attention_metadata(n, n, n * UNIFORM_DECODE_QUERY_LEN)
        self.graph, self.graph_out = capture(
            lambda: self.model.forward(self.input_ids[:n * UNIFORM_DECODE_QUERY_LEN], self.ssm_state, attn_metadata),
            device=self.device, name=f"FULL decode {n} reqs",
            static={"input_ids": self.input_ids,
                    "spec_state_indices_tensor": self.builder.spec_state_indices_tensor,
                    "num_accepted_tokens": self.builder.num_accepted_tokens},
            state={"ssm_state": self.ssm_state}, owner="NPUModelRunner (ACL graph, FULL_DECODE_ONLY)")
        self.ssm_state.zero_()                                # capture-time state is discarded

    def execute_model(self, requests):
        """``requests``: (token ids of this step, state slots, accepted tokens of the previous step)."""
        num_reqs = len(requests)
        num_tokens = num_reqs * UNIFORM_DECODE_QUERY_LEN
        num_reqs_padded = CUDAGRAPH_BATCH_SIZE if self.graphed else num_reqs
        num_tokens_padded = num_reqs_padded * UNIFORM_DECODE_QUERY_LEN
        ids = [t for r in requests for t in r[0]]
        self.input_ids[:num_tokens].copy_(torch.tensor(ids, device=self.device))
        self.input_ids[num_tokens:num_tokens_padded].zero_()
        for i, (_, slots, accepted) in enumerate(requests):
            self.block_table[i] = torch.tensor(slots, device=self.device)
            self.num_accepted_tokens[i] = accepted
        self.block_table[num_reqs:num_reqs_padded].fill_(NULL_BLOCK_ID)
        self.num_decode_draft_tokens_cpu[:num_reqs] = NUM_SPEC
        self.num_decode_draft_tokens_cpu[num_reqs:] = -1
        cu_num_tokens = torch.arange(1, num_reqs + 1) * UNIFORM_DECODE_QUERY_LEN
        self.query_start_loc_cpu[0] = 0
        self.query_start_loc_cpu[1:num_reqs + 1] = cu_num_tokens
        self.gdn_query_start_loc_cpu[0] = 0
        self.gdn_query_start_loc_cpu[1:num_reqs + 1] = cu_num_tokens
        self.gdn_query_start_loc_cpu[num_reqs + 1:] = cu_num_tokens[-1]
        if self.graphed:
            num_reqs_padded = self._pad_query_start_loc_for_fia(num_tokens_padded, num_reqs_padded, num_reqs)
        attn_metadata = self._build_attention_metadata(num_reqs, num_reqs_padded, num_tokens_padded)
        if not self.graphed:
            return self.model.forward(self.input_ids[:num_tokens], self.ssm_state, attn_metadata).clone()
        return replay(self.graph, self.graph_out, real=num_tokens, size=num_tokens_padded)[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    model = Qwen3NextGatedDeltaNet(device)

    def serve(graphed: bool):
        runner = NPUModelRunner(model, device, variant, graphed)
        runner.ssm_state[3] = model.embed_tokens[1]          # prefilled states of request A (slots 3, 4)
        runner.ssm_state[5] = model.embed_tokens[2]          # and of request B (slots 5, 6)
        outs = []
        # A and B decode together (the captured batch: no padding).
        outs.append(runner.execute_model([([4, 7], [3, 4], 1), ([8, 2], [5, 6], 1)]))
        outs.append(runner.execute_model([([9, 1], [3, 4], 2), ([3, 3], [5, 6], 1)]))
        # A finished; B decodes alone and is padded to the graph's 2 requests.
        outs.append(runner.execute_model([([5, 6], [5, 6], 2)]))
        outs.append(runner.execute_model([([2, 10], [5, 6], 1)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
