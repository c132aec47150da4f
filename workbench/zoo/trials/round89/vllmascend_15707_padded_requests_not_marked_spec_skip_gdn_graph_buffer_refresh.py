"""MRV2 uniform spec-decode FULL graph on vLLM-Ascend: graph-padding requests are not marked speculative, so the GDN builder leaves the pure-speculative path and the graph replays last step's speculative state indices.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/15707 ("[BugFix][Spec Decode] Fix GDN graph padding and Qwen
MTP MRoPE inputs", merged; description dated 2026-09-03). Read: the PR description (part 1: "Keep the padded request count aligned with the
captured batch descriptor ... Mark padded Mamba requests as speculative dummy requests when their query lengths match
the speculative decode length ... Keep capture and replay on the same pure-speculative GDN metadata path so persistent
state indices are refreshed correctly"), the test names in its review thread
(``test_prepare_attn_marks_uniform_full_graph_padding_as_spec``), the closed twin PR #15461 ("Stale Persistent State
Metadata: explicitly marks padded requests ... as speculative decodes, ensuring ... metadata is correctly refreshed
before graph replay"), and a stored later version of ``vllm_ascend/ops/gdn_attn_builder.py``
(``AscendGDNAttentionMetadataBuilder.build``: the spec mask ``num_decode_draft_tokens_cpu >= 0``, the non-spec
query-length split, ``if num_decodes > 0 and num_spec_decodes > 0`` folding into prefills, and
``_pad_spec_decode_metadata`` / ``_materialize_graph_request_tensor`` / ``_materialize_graph_query_start_loc`` run only
when ``num_prefills == 0 and num_decodes == 0``). Not read: the diff of ``vllm_ascend/worker/v2/model_runner.py``
(``prepare_attn`` is modelled from the description and test name), the Ascend GDN kernels, parts 2 and 3 of the PR.
Symptom: Qwen3.5/3.6 (GDN) with MTP under FULL / FULL_DECODE_ONLY graphs on Model Runner V2 give garbled, truncated
output (as #15461 reports for Qwen3.6-35B, ``num_speculative_tokens=2``) when a step runs fewer requests than the
captured graph batch and is padded; eager is correct.
Mechanism: a uniform spec-decode step with ``n`` requests of ``K + 1`` tokens is padded to the captured descriptor's
``R`` requests, each padded request also spanning ``K + 1`` query tokens. ``prepare_attn`` gives the padded requests
``num_decode_draft_tokens = -1`` (not speculative). In ``build`` they fall outside the spec mask and, with query length
``K + 1 > 1``, count as prefills, so ``num_prefills > 0``: the builder takes the mixed path (fresh ``index_select``
tensors) and skips ``_pad_spec_decode_metadata``. The captured graph, recorded on the pure-speculative path, reads the
builder's persistent ``spec_state_indices_tensor``, ``spec_query_start_loc`` and ``num_accepted_tokens``, which still
hold the previous replay's requests: each live request's tokens advance another request's recurrent state slots, and a
padded lane (stale hidden rows) rewrites the last live request's state.
Doctor: stale-input, at prepare_attn. Real rows read elements of the graph's static spec-metadata buffers that this step
never wrote (the refresh was skipped), i.e. what the previous replay left there.
Fix (upstream): ``prepare_attn`` marks padded requests whose query length equals the spec-decode length as speculative
dummy requests (in the model their block-table rows are the null block, accepted count 1), so capture and replay take the same
pure-speculative path and ``_pad_spec_decode_metadata`` rewrites every graph row.
Modelled: the MRV2 runner (``prepare_attn``, dispatch to the uniform FULL graph, replay), the builder's spec/non-spec
split and ``_pad_spec_decode_metadata`` with its materialize helpers, and a GDN-like spec-decode recurrence
(``fused_recurrent_gated_delta_rule`` stand-in: per request read the state at slot ``[num_accepted - 1]``, then for each
of the ``K + 1`` tokens update the state, write it to slot ``[t]`` and emit an output; null-block slot 0 is never
written). The target model around the GDN layer, sampling and rejection are stand-ins: accepted counts come from the
workload. Sizes: hidden 4, K = 2, 4 requests x 3 state slots, graphs captured for 2 and 4 requests.
Workload: requests A-D get a prompt state; step 1 verifies A, B, C, D (4 requests, no padding: both variants refresh);
step 2 verifies B, C, D padded to 4: the bug's graph runs B's tokens on A's slots, C's on B's, D's on C's and a stale
padded lane on D's; step 3 verifies B, D (graph 2, refreshed) from the corrupted states.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/15707"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "prepare_attn"
SYMPTOM = ("GDN + MTP on MRV2 FULL graphs: a step padded to the captured request count leaves the builder's pure-spec "
           "path, so the graph reuses the previous step's spec state indices and corrupts recurrent state")

D, K = 4, 2
T = K + 1
MAX_REQS = 4
NULL_BLOCK_ID = 0
NUM_SLOTS = 1 + MAX_REQS * T
CAPTURE_NUM_REQS = [2, 4]

_variant = "bug"


class GDNAttentionMetadata:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class AscendGDNAttentionMetadataBuilder:
    def __init__(self, device, use_full_cuda_graph):
        self.use_full_cuda_graph = use_full_cuda_graph
        self.decode_cudagraph_max_bs = MAX_REQS
        self.spec_state_indices_tensor = torch.zeros(MAX_REQS, T, dtype=torch.long, device=device)
        self.spec_query_start_loc = torch.zeros(MAX_REQS + 1, dtype=torch.long, device=device)
        self.num_accepted_tokens = torch.ones(MAX_REQS, dtype=torch.long, device=device)

    @staticmethod
    def _materialize_graph_request_tensor(buffer, values, actual, graph_count, padding_value):
        out = buffer[:graph_count]
        out[:actual].copy_(values[:actual])
        out[actual:].fill_(padding_value)
        return out

    @staticmethod
    def _materialize_graph_query_start_loc(buffer, qsl, actual, graph_count):
        out = buffer[:graph_count + 1]
        out[:actual + 1].copy_(qsl[:actual + 1])
        out[actual + 1:].fill_(int(qsl[actual]))
        return out

    def _pad_spec_decode_metadata(self, md, graph_count):
        n = md.num_spec_decodes
        md.spec_state_indices_tensor = self._materialize_graph_request_tensor(
            self.spec_state_indices_tensor, md.spec_state_indices_tensor, n, graph_count, NULL_BLOCK_ID)
        md.spec_query_start_loc = self._materialize_graph_query_start_loc(
            self.spec_query_start_loc, md.spec_query_start_loc, n, graph_count)
        md.num_accepted_tokens = self._materialize_graph_request_tensor(
            self.num_accepted_tokens, md.num_accepted_tokens, n, graph_count, 1)

    def build(self, query_start_loc, block_table, num_accepted_tokens, num_decode_draft_tokens_cpu):
        graph_request_count = block_table.shape[0]
        spec_mask = num_decode_draft_tokens_cpu >= 0
        num_spec_decodes = int(spec_mask.sum())
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        non_spec_lens = query_lens[~spec_mask]
        num_decodes = int((non_spec_lens == 1).sum())
        num_prefills = non_spec_lens.numel() - num_decodes - int((non_spec_lens == 0).sum())
        spec_idx = torch.nonzero(spec_mask, as_tuple=True)[0].to(block_table.device)
        spec_lens = query_lens.index_select(0, spec_idx)
        spec_qsl = torch.zeros(num_spec_decodes + 1, dtype=torch.long, device=block_table.device)
        torch.cumsum(spec_lens, 0, out=spec_qsl[1:])
        md = GDNAttentionMetadata(
            num_prefills=num_prefills, num_decodes=num_decodes, num_spec_decodes=num_spec_decodes,
            spec_state_indices_tensor=block_table.index_select(0, spec_idx),
            spec_query_start_loc=spec_qsl, num_accepted_tokens=num_accepted_tokens.index_select(0, spec_idx))
        if (self.use_full_cuda_graph and num_prefills == 0 and num_decodes == 0
                and graph_request_count <= self.decode_cudagraph_max_bs):
            self._pad_spec_decode_metadata(md, graph_request_count)
        return md


class GatedDeltaNet:
    def __init__(self, device):
        gen = generator(15707)
        self.w_h = randn(D, D, gen=gen, device=device, scale=0.6)
        self.w_x = randn(D, D, gen=gen, device=device, scale=0.6)
        self.w_o = randn(D, D, gen=gen, device=device, scale=0.8)
        self.ssm_state = torch.zeros(NUM_SLOTS, D, device=device)     # slot 0: the null block

    def fused_recurrent_gated_delta_rule(self, x, qsl, state_indices, num_accepted):
        r = state_indices.shape[0]
        t = torch.arange(T, device=x.device)
        q_len = qsl[1:r + 1] - qsl[:r]
        valid = t[None, :] < q_len[:, None]                                     # [r, T]
        xs = x[(qsl[:r, None] + t[None, :]).clamp(max=x.shape[0] - 1)]          # [r, T, D]
        init = state_indices.gather(1, (num_accepted[:r] - 1).clamp(min=0)[:, None]).squeeze(1)
        h = self.ssm_state[init]
        outs = []
        for i in range(T):
            h = torch.where(valid[:, i:i + 1], torch.tanh(h @ self.w_h + xs[:, i] @ self.w_x), h)
            slot = state_indices[:, i]
            write = (valid[:, i] & (slot != NULL_BLOCK_ID))[:, None]
            self.ssm_state[slot] = torch.where(write, h, self.ssm_state[slot])
            outs.append(h @ self.w_o)
        return torch.stack(outs, 1).reshape(r * T, D)

    def forward(self, hidden_states, md):
        return self.fused_recurrent_gated_delta_rule(hidden_states, md.spec_query_start_loc,
                                                     md.spec_state_indices_tensor, md.num_accepted_tokens)


class GPUModelRunnerV2:
    def __init__(self, device, use_graph):
        self.device, self.use_graph = device, use_graph
        self.gdn = GatedDeltaNet(device)
        self.builder = AscendGDNAttentionMetadataBuilder(device, use_full_cuda_graph=use_graph)
        self.hidden_states = torch.zeros(MAX_REQS * T, D, device=device)
        self.graphs = {}

    def prepare_attn(self, block_rows, num_accepted, num_reqs_padded, dummy_run=False):
        """Common metadata at the graph's request count (uniform spec decode, K + 1 tokens per request)."""
        n = len(block_rows)
        query_start_loc = torch.arange(num_reqs_padded + 1, device=self.device) * T   # padded requests span K + 1
        block_table = torch.full((num_reqs_padded, T), NULL_BLOCK_ID, dtype=torch.long, device=self.device)
        if n:
            block_table[:n] = torch.stack(block_rows)
        accepted = torch.ones(num_reqs_padded, dtype=torch.long, device=self.device)
        accepted[:n] = torch.tensor(num_accepted, device=self.device)
        draft_tokens = torch.full((num_reqs_padded,), -1, dtype=torch.long)
        draft_tokens[:n] = K
        if dummy_run:                   # capture: every dummy request is a speculative decode (pure-spec path)
            draft_tokens[:] = K
        elif _variant == "fix":           # upstream fix: graph padding with the spec query length is a spec dummy
            draft_tokens[n:] = torch.where(query_start_loc[n + 1:].cpu() - query_start_loc[n:-1].cpu() == T, K, -1)
        return self.builder.build(query_start_loc, block_table, accepted, draft_tokens)

    def capture_model(self):
        for r in sorted(CAPTURE_NUM_REQS, reverse=True):
            md = self.prepare_attn([], [], r, dummy_run=True)          # dummy run: null-block spec requests
            self.graphs[r] = capture(lambda r=r, md=md: self.gdn.forward(self.hidden_states[:r * T], md),
                                     device=self.device, name=f"FULL uniform spec decode [{r} reqs]",
                                     owner="GPUModelRunnerV2 (FULL graph)",
                                     static={"hidden_states": self.hidden_states,
                                             "spec_state_indices_tensor": self.builder.spec_state_indices_tensor,
                                             "spec_query_start_loc": self.builder.spec_query_start_loc,
                                             "num_accepted_tokens": self.builder.num_accepted_tokens},
                                     state={"ssm_state": self.gdn.ssm_state})

    def execute_model(self, x, block_rows, num_accepted):
        n = len(block_rows)
        if not self.use_graph:
            md = self.prepare_attn(block_rows, num_accepted, n)
            return self.gdn.forward(x, md).clone()
        r = next(s for s in sorted(CAPTURE_NUM_REQS) if s >= n)    # dispatch: uniform decode, shape only
        self.prepare_attn(block_rows, num_accepted, r)
        self.hidden_states[:n * T].copy_(x)
        g, out = self.graphs[r]
        return replay(g, out, real=n * T, size=r * T, padded={"hidden_states": self.hidden_states})[:n * T].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(7)
    rows = {rid: torch.arange(1 + i * T, 1 + (i + 1) * T, device=device) for i, rid in enumerate("ABCD")}
    prompt_states = {rid: randn(D, gen=gen, device=device) for rid in "ABCD"}
    # (requests, accepted count each request starts from)
    steps = [("ABCD", [1, 1, 1, 1]), ("BCD", [1, 3, 2]), ("BD", [2, 3])]
    inputs = [randn(len(names) * T, D, gen=gen, device=device) for names, _ in steps]

    def serve(use_graph: bool):
        runner = GPUModelRunnerV2(device, use_graph)
        if use_graph:
            runner.capture_model()
        for rid, s in prompt_states.items():                   # prefill stand-in: state at slot [0]
            runner.gdn.ssm_state[rows[rid][0]] = s
        return [runner.execute_model(x, [rows[r] for r in names], acc)
                for (names, acc), x in zip(steps, inputs)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
