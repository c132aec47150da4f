"""vLLM Qwen3-Next MTP with FULL graphs: the GDN metadata builder counts a padded zero-length request as a prefill, so it skips the refresh of the persistent metadata the graph reads, and the replay runs on the state slots and offsets of an earlier batch.

Upstream: https://github.com/vllm-project/vllm/pull/34077 ("[BUGFIX] Fix accuracy bugs in Qwen3-Next MTP",
vllm-project/vllm, opened 2026-02-08, merged 2026-02-10). Read: the PR description ("All problems was in accurate
processing of padded part of batch: before counted zero len as prefill; state_indices didn't take padded elems in
account; copy to persistent place had shape mismatch"), its diff (``vllm/v1/attention/backends/gdn_attn.py``, commit
000214c4b in a vLLM fork mirror), the pre-fix ``GDNAttentionMetadataBuilder.build`` / ``build_for_cudagraph_capture``,
``Qwen3NextGatedDeltaNet._forward_core`` and the runner's FULL-graph padding (``query_start_loc`` repeats its last
value, ``seq_lens`` 0, block-table rows ``-1``, ``num_decode_draft_tokens`` ``-1``, ``num_accepted_tokens`` 1) in
``gpu_model_runner.py`` at the parent commit; the closed PR #33777 (the same miscount, reported as a crash).
Symptom: Qwen3-Next with MTP (3 speculative tokens) loses GSM8K accuracy with CUDA graphs, only at low concurrency
(at high concurrency the batches are too large for the graphs); no error.
Mechanism: a FULL decode graph of ``n`` requests x ``1 + num_spec`` tokens reads the builder's persistent buffers
(``spec_state_indices_tensor``, ``spec_query_start_loc``, ``num_accepted_tokens``), which ``build`` refreshes in its
"prepare tensors for cudagraph" block. With fewer requests the runner pads the batch with zero-length requests (not
drafting, so not spec); ``build`` counts every non-spec request that is not a one-token decode as a prefill, so
``num_prefills = 1``, the batch looks mixed and the refresh block (``num_prefills == 0 and num_decodes == 0``) is
skipped. The replay then uses the previous batch's state slots, offsets and accepted counts: after a request finished
and the batch was condensed, a moved request reads and writes the finished one's GDN state, and the padded row (a full
sequence in the stale ``spec_query_start_loc``) advances a live request's state with stale tokens. Eager never pads.
Doctor: stale-input, at build (the graph reads static metadata buffers that this step's ``build`` did not write: a
skipped refresh leaves the previous step's state indices, offsets and accepted counts in them).
Fix (upstream): ``num_prefills`` excludes the zero-length padded requests; the all-spec branch takes only the
spec rows (``block_table_tensor[spec_sequence_masks]``, ``query_start_loc[:num_spec_decodes + 1]``) and copies
``spec_sequence_masks[:num_spec_decodes]``, so the refresh runs and pads with ``PAD_SLOT_ID`` / empty offsets.
Modelled: ``GDNAttentionMetadataBuilder.build`` (the spec branch, both sub-branches and the cudagraph block, line by
line; the no-draft branch is left out: every step here verifies drafts) and ``build_for_cudagraph_capture``;
``_forward_core`` (all-spec and mixed paths); ``fused_recurrent_gated_delta_rule_fwd_kernel`` (spec decoding,
in-place per-token states, ``num_accepted_tokens - 1`` as the initial slot, skips for ``T == 0`` and negative
indices) as torch ops over the launch grid; ``fused_gdn_gating``; the runner's padding and FULL graphs of 2 and 4
requests (6 and 12 tokens). Stand-ins: one GDN layer, 2 heads of dim 4, no causal conv1d, output gate ``silu(z)``
instead of the gated RMSNorm, float64; stores to skipped slots go to the null block 0 (never read by a request); the
non-spec prefill path reuses the recurrent kernel (no chunked kernel); prefill is left out (requests start from a zero
state); the drafter is a fixed table and acceptance is greedy.
Workload: requests A-D, 2 drafts per step, state slots A 1-3, B 4-6, C 7-9, D 10-12. Steps 1-2 verify A, B, C, D (graph
of 4, no padding); B finishes and D moves to row 1; steps 3-4 verify A, D, C (graph of 4, one padded request); step 5
verifies A, D (graph of 2). No draft is accepted here (the table drafter misses), so ``num_accepted_tokens`` stays
1 and the damage comes from the stale state indices and offsets. Bug: steps 1-2 equal eager (max 0); in steps 3-4 the
stale metadata makes D (row 1) read and write B's slots and the padded row advance D's own slots with D's step-2
tokens, so D's logits differ in steps 3, 4 and 5 (0.314, 0.031, 0.022; step 5 has no padding but reads D's damaged
state); A and C stay equal; max |graph - eager| = 0.314. Fix: equals eager, max 1.8e-15 (float64 rounding of the
padded matmuls).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/34077"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "build"
SYMPTOM = ("Qwen3-Next MTP with FULL graphs: a padded zero-length request counts as a prefill, the GDN builder skips "
           "refreshing the metadata buffers the graph reads, and the replay uses an earlier batch's state slots")

HIDDEN, VOCAB, NUM_HEADS, HEAD_DIM = 8, 16, 2, 4
NUM_SPEC = 2                                            # num_speculative_tokens
MAX_NUM_REQS = 4
NUM_SLOTS = 1 + MAX_NUM_REQS * (NUM_SPEC + 1)           # slot 0 is the null block
MAX_MODEL_LEN = 64
CUDAGRAPH_CAPTURE_SIZES = [2 * (NUM_SPEC + 1), 4 * (NUM_SPEC + 1)]   # uniform decode: tokens = reqs * (1 + spec)
NULL_BLOCK_ID, PAD_SLOT_ID = 0, -1
DTYPE = torch.float64

_variant = "bug"


# --- vllm/model_executor/layers/fla/ops (fused recurrent gated delta rule as torch ops over the launch grid) -----------

def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def fused_recurrent_gated_delta_rule_fwd_kernel(q, k, v, g, beta, o, h0, ht, cu_seqlens, ssm_state_indices,
                                                num_accepted_tokens, scale, max_len, has_initial_state=None):
    """grid = (sequences, heads); states are [slot, head, V, K]; one program per sequence."""
    N = cu_seqlens.shape[0] - 1
    bos = cu_seqlens[:-1].long()
    seq_len = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    indices = ssm_state_indices[:N].long()
    if num_accepted_tokens is not None:                                    # IS_SPEC_DECODING
        i_t = (num_accepted_tokens[:N].long() - 1).clamp(min=0)
    else:
        i_t = torch.zeros(N, dtype=torch.long, device=q.device)
    state_idx = indices.gather(1, i_t[:, None]).squeeze(1)
    live = (seq_len > 0) & (state_idx >= 0)                                # `if T == 0` / `if state_idx < 0`: return
    b_h = h0[state_idx.clamp(min=0)] * live[:, None, None, None]
    if has_initial_state is not None:
        b_h = b_h * has_initial_state[:N, None, None, None]
    for t in range(max_len):
        tok = (bos + t).clamp(max=q.shape[0] - 1)
        step = live & (t < seq_len)
        b_q, b_k, b_v = _l2norm(q[tok]) * scale, _l2norm(k[tok]), v[tok]
        h = b_h * torch.exp(g[tok])[..., None, None]
        b_v = (b_v - (h * b_k[:, :, None, :]).sum(-1)) * beta[tok][..., None]
        h = h + b_v[..., None] * b_k[:, :, None, :]
        b_h = torch.where(step[:, None, None, None], h, b_h)
        o.index_add_(0, tok, torch.where(step[:, None, None], (b_h * b_q[:, :, None, :]).sum(-1), 0.0))
        final_state_idx = indices[:, min(t, indices.shape[1] - 1)]         # INPLACE_FINAL_STATE, per token
        store = step & (final_state_idx >= 0)
        target = torch.where(store, final_state_idx, NULL_BLOCK_ID)
        ht.index_copy_(0, target, torch.where(store[:, None, None, None], b_h, ht[target]))


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, ssm_state_indices,
                                     num_accepted_tokens=None, max_len=NUM_SPEC + 1, has_initial_state=None):
    o = q.new_zeros(q.shape)
    fused_recurrent_gated_delta_rule_fwd_kernel(q, k, v, g, beta, o, initial_state, initial_state, cu_seqlens,
                                                ssm_state_indices, num_accepted_tokens, HEAD_DIM ** -0.5, max_len,
                                                has_initial_state)
    return o, initial_state


def fused_gdn_gating(A_log, a, b, dt_bias):
    return -torch.exp(A_log) * F.softplus(a + dt_bias), torch.sigmoid(b)


# --- vllm/v1/attention/backends/gdn_attn.py ------------------------------------------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table_tensor: torch.Tensor
    num_actual_tokens: int


@dataclasses.dataclass
class GDNAttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_spec_decodes: int
    num_spec_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor | None = None
    spec_query_start_loc: torch.Tensor | None = None
    non_spec_query_start_loc: torch.Tensor | None = None
    spec_state_indices_tensor: torch.Tensor | None = None
    non_spec_state_indices_tensor: torch.Tensor | None = None
    spec_sequence_masks: torch.Tensor | None = None
    spec_token_indx: torch.Tensor | None = None
    non_spec_token_indx: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None


class GDNAttentionMetadataBuilder:
    def __init__(self, device, use_full_cuda_graph):
        self.num_spec, self.use_full_cuda_graph = NUM_SPEC, use_full_cuda_graph
        self.decode_cudagraph_max_bs = MAX_NUM_REQS * (NUM_SPEC + 1)
        bs, i32 = self.decode_cudagraph_max_bs, dict(dtype=torch.int32, device=device)
        self.spec_state_indices_tensor = torch.zeros(bs, self.num_spec + 1, **i32)
        self.spec_sequence_masks = torch.zeros(bs, dtype=torch.bool, device=device)
        self.spec_token_indx = torch.zeros(bs, **i32)
        self.non_spec_token_indx = torch.zeros(bs, **i32)
        self.spec_query_start_loc = torch.zeros(bs + 1, **i32)
        self.num_accepted_tokens = torch.zeros(bs, **i32)

    def build(self, m, num_accepted_tokens, num_decode_draft_tokens_cpu):
        query_start_loc, block_table_tensor = m.query_start_loc, m.block_table_tensor
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        context_lens_tensor = m.seq_lens - query_lens                      # compute_num_computed_tokens()
        spec_sequence_masks_cpu = num_decode_draft_tokens_cpu >= 0
        num_spec_decodes = int(spec_sequence_masks_cpu.sum())
        spec_sequence_masks = spec_sequence_masks_cpu.to(query_start_loc.device)

        non_spec_query_lens = query_lens[~spec_sequence_masks]
        num_decodes = int((non_spec_query_lens == 1).sum())
        if _variant == "bug":
            num_prefills = non_spec_query_lens.size(0) - num_decodes      # a zero-length padded request counts
        else:
            num_zero_len = int((non_spec_query_lens == 0).sum())           # the fix: padded requests are no prefills
            num_prefills = non_spec_query_lens.size(0) - num_decodes - num_zero_len
        num_decode_tokens = num_decodes
        num_prefill_tokens = int(non_spec_query_lens.sum()) - num_decode_tokens
        num_spec_decode_tokens = int(query_lens.sum()) - num_prefill_tokens - num_decode_tokens

        if num_prefills == 0 and num_decodes == 0:
            spec_token_size = min(num_spec_decodes * (self.num_spec + 1), int(m.query_start_loc_cpu[-1]))
            spec_token_indx = torch.arange(spec_token_size, dtype=torch.int32, device=query_start_loc.device)
            non_spec_token_indx = torch.empty(0, dtype=torch.int32, device=query_start_loc.device)
            if _variant == "bug":
                spec_state_indices_tensor = block_table_tensor[:, : self.num_spec + 1]
                spec_query_start_loc = query_start_loc
            else:
                spec_state_indices_tensor = block_table_tensor[spec_sequence_masks, : self.num_spec + 1]
                spec_query_start_loc = query_start_loc[: num_spec_decodes + 1]
            non_spec_state_indices_tensor = non_spec_query_start_loc = None
        else:
            spec_token_masks = torch.repeat_interleave(spec_sequence_masks, query_lens)
            index = torch.argsort(spec_token_masks.int(), stable=True).to(torch.int32)
            num_non_spec_tokens = num_prefill_tokens + num_decode_tokens
            non_spec_token_indx, spec_token_indx = index[:num_non_spec_tokens], index[num_non_spec_tokens:]
            spec_state_indices_tensor = block_table_tensor[spec_sequence_masks, : self.num_spec + 1]
            non_spec_state_indices_tensor = block_table_tensor[~spec_sequence_masks, 0]
            spec_query_start_loc = F.pad(torch.cumsum(query_lens[spec_sequence_masks], 0), (1, 0)).to(torch.int32)
            non_spec_query_start_loc = F.pad(torch.cumsum(non_spec_query_lens, 0), (1, 0)).to(torch.int32)
        num_accepted_tokens = num_accepted_tokens[spec_sequence_masks]
        has_initial_state = (context_lens_tensor > 0)[~spec_sequence_masks] if num_prefills > 0 else None

        # Prepare tensors for cudagraph (m.num_actual_tokens is already padded by the model runner)
        batch_size = m.num_actual_tokens
        if (self.use_full_cuda_graph and num_prefills == 0 and num_decodes == 0
                and num_spec_decodes <= self.decode_cudagraph_max_bs
                and num_spec_decode_tokens <= self.decode_cudagraph_max_bs):
            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state_indices_tensor)
            spec_state_indices_tensor = self.spec_state_indices_tensor[:batch_size]
            spec_state_indices_tensor[num_spec_decodes:].fill_(PAD_SLOT_ID)
            masks = spec_sequence_masks if _variant == "bug" else spec_sequence_masks[:num_spec_decodes]
            self.spec_sequence_masks[:num_spec_decodes].copy_(masks)
            spec_sequence_masks = self.spec_sequence_masks[:batch_size]
            spec_sequence_masks[num_spec_decodes:].fill_(False)
            self.non_spec_token_indx[: non_spec_token_indx.size(0)].copy_(non_spec_token_indx)
            non_spec_token_indx = self.non_spec_token_indx[: non_spec_token_indx.size(0)]
            self.spec_token_indx[: spec_token_indx.size(0)].copy_(spec_token_indx)
            spec_token_indx = self.spec_token_indx[: spec_token_indx.size(0)]
            self.spec_query_start_loc[: num_spec_decodes + 1].copy_(spec_query_start_loc)
            spec_num_query_tokens = spec_query_start_loc[-1]
            spec_query_start_loc = self.spec_query_start_loc[: batch_size + 1]
            spec_query_start_loc[num_spec_decodes + 1:].fill_(spec_num_query_tokens)
            self.num_accepted_tokens[:num_spec_decodes].copy_(num_accepted_tokens)
            num_accepted_tokens = self.num_accepted_tokens[:batch_size]
            num_accepted_tokens[num_spec_decodes:].fill_(1)

        return GDNAttentionMetadata(
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_spec_decodes=num_spec_decodes,
            num_spec_decode_tokens=num_spec_decode_tokens, num_actual_tokens=m.num_actual_tokens,
            has_initial_state=has_initial_state, spec_query_start_loc=spec_query_start_loc,
            non_spec_query_start_loc=non_spec_query_start_loc, spec_state_indices_tensor=spec_state_indices_tensor,
            non_spec_state_indices_tensor=non_spec_state_indices_tensor, spec_sequence_masks=spec_sequence_masks,
            spec_token_indx=spec_token_indx, non_spec_token_indx=non_spec_token_indx,
            num_accepted_tokens=num_accepted_tokens)

    def build_for_cudagraph_capture(self, m):
        num_accepted_tokens = torch.diff(m.query_start_loc)
        num_decode_draft_tokens_cpu = (num_accepted_tokens - 1).cpu()
        return self.build(m, num_accepted_tokens, num_decode_draft_tokens_cpu)


# --- vllm/model_executor/models/qwen3_next.py (one GDN layer) -----------------------------------------------------------

_forward_context: dict = {}


def get_forward_context():
    return _forward_context


class Qwen3NextGatedDeltaNet(torch.nn.Module):
    def __init__(self, gen, device, ssm_state):
        super().__init__()
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.7).to(DTYPE)  # noqa: E731
        self.in_proj_qkvz = r(HIDDEN, 4 * NUM_HEADS * HEAD_DIM)
        self.in_proj_ba = r(HIDDEN, 2 * NUM_HEADS)
        self.A_log, self.dt_bias = r(NUM_HEADS) * 0.3, r(NUM_HEADS)
        self.out_proj = r(NUM_HEADS * HEAD_DIM, HIDDEN)
        self.ssm_state = ssm_state

    def forward(self, hidden_states):
        T = hidden_states.shape[0]
        q, k, v, z = (hidden_states @ self.in_proj_qkvz).view(T, 4, NUM_HEADS, HEAD_DIM).unbind(1)
        b, a = (hidden_states @ self.in_proj_ba).view(T, 2, NUM_HEADS).unbind(1)
        g, beta = fused_gdn_gating(self.A_log, a, b, self.dt_bias)
        core_attn_out = torch.zeros(T, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=hidden_states.device)
        self._forward_core(q, k, v, g, beta, core_attn_out)
        return (core_attn_out * F.silu(z)).reshape(T, -1) @ self.out_proj

    def _forward_core(self, q, k, v, g, beta, core_attn_out):
        md = get_forward_context()["attn_metadata"]
        n, ssm_state = md.num_actual_tokens, self.ssm_state
        q, k, v, g, beta = q[:n], k[:n], v[:n], g[:n], beta[:n]
        if md.num_prefills == 0 and md.num_decodes == 0:                   # all requests verify drafts
            core_attn_out[:n], _ = fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, initial_state=ssm_state,
                cu_seqlens=md.spec_query_start_loc[: md.num_spec_decodes + 1],
                ssm_state_indices=md.spec_state_indices_tensor, num_accepted_tokens=md.num_accepted_tokens)
            return
        sel = lambda x, idx: x.index_select(0, idx.long())                 # noqa: E731
        spec, non_spec = md.spec_token_indx, md.non_spec_token_indx
        out_spec, _ = fused_recurrent_gated_delta_rule(
            *(sel(x, spec) for x in (q, k, v, g, beta)), initial_state=ssm_state,
            cu_seqlens=md.spec_query_start_loc[: md.num_spec_decodes + 1],
            ssm_state_indices=md.spec_state_indices_tensor, num_accepted_tokens=md.num_accepted_tokens)
        out_non_spec, _ = fused_recurrent_gated_delta_rule(                 # stand-in for chunk_gated_delta_rule
            *(sel(x, non_spec) for x in (q, k, v, g, beta)), initial_state=ssm_state,
            cu_seqlens=md.non_spec_query_start_loc, ssm_state_indices=md.non_spec_state_indices_tensor[:, None],
            max_len=md.num_prefill_tokens + md.num_decode_tokens, has_initial_state=md.has_initial_state)
        merged_out = torch.zeros_like(core_attn_out[:n])
        merged_out.index_copy_(0, spec.long(), out_spec)
        merged_out.index_copy_(0, non_spec.long(), out_non_spec)
        core_attn_out[:n] = merged_out


class Qwen3NextForCausalLM(torch.nn.Module):
    def __init__(self, device, ssm_state):
        super().__init__()
        gen = generator(34077)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.linear_attn = Qwen3NextGatedDeltaNet(gen, device, ssm_state)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens[input_ids]
        hidden_states = hidden_states + self.linear_attn(F.rms_norm(hidden_states, (HIDDEN,)))
        return F.rms_norm(hidden_states, (HIDDEN,)) @ self.lm_head


# --- vllm/v1/worker/gpu_model_runner.py (reduced; MTP verify steps only) -----------------------------------------------

def propose(token):
    """Drafter stand-in: a fixed table (``t -> 5 t + 3 mod VOCAB``) chained ``NUM_SPEC`` times."""
    drafts = [token]
    for _ in range(NUM_SPEC):
        drafts.append((drafts[-1] * 5 + 3) % VOCAB)
    return drafts[1:]


class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.ssm_state = torch.zeros(NUM_SLOTS, NUM_HEADS, HEAD_DIM, HEAD_DIM, dtype=DTYPE, device=device)
        self.model = Qwen3NextForCausalLM(device, self.ssm_state)
        self.builder = GDNAttentionMetadataBuilder(device, use_full_cuda_graph=use_cuda_graph)
        max_tokens = MAX_NUM_REQS * (NUM_SPEC + 1)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.query_start_loc_cpu = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, NUM_SPEC + 1, dtype=torch.int32, device=device)
        self.num_accepted_tokens = torch.ones(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.num_decode_draft_tokens_cpu = torch.full((MAX_NUM_REQS,), -1, dtype=torch.int32)
        self.requests, self.graphs = {}, {}
        if use_cuda_graph:
            self.capture_model()

    def _common_metadata(self, num_reqs, num_tokens):
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc_cpu[: num_reqs + 1].to(self.device),
            query_start_loc_cpu=self.query_start_loc_cpu[: num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
            block_table_tensor=self.block_table[:num_reqs], num_actual_tokens=num_tokens)

    def _model_forward(self, num_tokens):
        return self.model(self.input_ids[:num_tokens])

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        b = self.builder
        for num_tokens in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            n = num_tokens // (NUM_SPEC + 1)                               # _dummy_run: uniform decode, null block
            self.input_ids[:num_tokens].fill_(0)
            self.query_start_loc_cpu[: n + 1].copy_(torch.arange(0, num_tokens + 1, NUM_SPEC + 1))
            self.seq_lens[:n].fill_(MAX_MODEL_LEN)
            self.block_table[:n].fill_(NULL_BLOCK_ID)
            _forward_context["attn_metadata"] = b.build_for_cudagraph_capture(self._common_metadata(n, num_tokens))
            self.graphs[num_tokens] = capture(
                lambda t=num_tokens: self._model_forward(t), device=self.device, pool=pool,
                name=f"FULL decode [{num_tokens}]", owner="GPUModelRunner",
                static={"input_ids": self.input_ids, "spec_state_indices_tensor": b.spec_state_indices_tensor,
                        "spec_query_start_loc": b.spec_query_start_loc, "num_accepted_tokens": b.num_accepted_tokens},
                state={"ssm_state": self.ssm_state})

    def add_request(self, req_id, prompt_token, slots):
        self.requests[req_id] = {"last": prompt_token, "drafts": propose(prompt_token), "num_accepted": 1,
                                 "num_computed": 1, "slots": slots}

    def _prepare_inputs(self, req_ids, num_reqs_padded):
        n, ids, cu = len(req_ids), [], [0]
        for row, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            ids += [req["last"]] + req["drafts"]
            cu.append(cu[-1] + NUM_SPEC + 1)
            self.seq_lens[row] = req["num_computed"] + NUM_SPEC
            self.block_table[row] = torch.tensor(req["slots"], dtype=torch.int32)
            self.num_accepted_tokens[row] = req["num_accepted"]
        self.input_ids[: len(ids)].copy_(torch.tensor(ids, dtype=torch.int64))   # padded token rows left as they were
        self.query_start_loc_cpu[: n + 1].copy_(torch.tensor(cu, dtype=torch.int32))
        self.query_start_loc_cpu[n + 1:].fill_(cu[-1])
        self.seq_lens[n:].fill_(0)
        self.block_table[n:num_reqs_padded].fill_(PAD_SLOT_ID)
        self.num_accepted_tokens[n:].fill_(1)
        self.num_decode_draft_tokens_cpu[:n].fill_(NUM_SPEC)
        self.num_decode_draft_tokens_cpu[n:].fill_(-1)

    def execute_model(self, req_ids):
        num_tokens = len(req_ids) * (NUM_SPEC + 1)
        num_tokens_padded = next((s for s in sorted(self.graphs) if s >= num_tokens), num_tokens)
        num_reqs_padded = num_tokens_padded // (NUM_SPEC + 1)
        self._prepare_inputs(req_ids, num_reqs_padded)
        _forward_context["attn_metadata"] = self.builder.build(
            self._common_metadata(num_reqs_padded, num_tokens_padded),
            self.num_accepted_tokens[:num_reqs_padded], self.num_decode_draft_tokens_cpu[:num_reqs_padded])
        if num_tokens_padded in self.graphs:
            g, out = self.graphs[num_tokens_padded]
            logits = replay(g, out, real=num_tokens, size=num_tokens_padded,
                            padded={"input_ids": self.input_ids})[:num_tokens].clone()
        else:
            logits = self._model_forward(num_tokens)[:num_tokens].clone()
        target = logits.view(len(req_ids), NUM_SPEC + 1, VOCAB).argmax(dim=-1)   # greedy rejection sampling
        for row, req_id in enumerate(req_ids):
            req, accepted = self.requests[req_id], 0
            while accepted < NUM_SPEC and req["drafts"][accepted] == int(target[row, accepted]):
                accepted += 1
            req["num_accepted"] = accepted + 1
            req["num_computed"] += accepted + 1
            req["last"] = int(target[row, accepted])
            req["drafts"] = propose(req["last"])
        return logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    steps = [list("ABCD")] * 2 + [list("ADC")] * 2 + [list("AD")]          # B finishes; D moves to row 1

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        for i, (req_id, token) in enumerate(zip("ABCD", (3, 7, 11, 14))):
            runner.add_request(req_id, token, [1 + i * (NUM_SPEC + 1) + j for j in range(NUM_SPEC + 1)])
        return [runner.execute_model(step) for step in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
