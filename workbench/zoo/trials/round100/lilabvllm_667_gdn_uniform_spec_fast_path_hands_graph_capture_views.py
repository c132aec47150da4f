"""GDN spec decode on FULL graphs: the uniform metadata fast path hands out views, so every graph reads the capture batch's accepted-token counts.

Upstream: https://github.com/local-inference-lab/vllm/pull/667 ("gdn: keep the uniform spec-decode fast path on the
graph buffers", local-inference-lab/vllm, a vLLM fork, dev/gilded-gnosis lineage; 2026-09-05, merged).
Read: the PR description as stored (TL;DR, the measurement table, the one-sentence cause: "the fast path handed the
layers views of runner-owned tensors instead of the builder-owned buffers the generic path fills, and full cudagraphs
captured through one path replay through the other"; the "Mechanism" section is cut off in the stored copy); the
fixed ``vllm/v1/attention/backends/gdn_attn.py`` of the fork (a stored version with ``_can_reuse_spec_inputs``,
``_build_uniform_spec_decode`` whose docstring says everything the layers read "is written into the builder-owned
graph buffers, exactly where the generic path writes it, so a full cudagraph captured through either path replays
correctly through the other", the generic ``build`` with its FULL-graph copies and padded-row fills, and
``build_for_cudagraph_capture``, which builds from ``num_accepted_tokens = torch.diff(m.query_start_loc)``); an older
stored version of the same file, from before the fast path existed. The diff itself was not read: the pre-fix fast
path (views of ``mamba_aligned_state_indices``, of constant tensors and of the ``num_accepted_tokens`` it is passed)
is reconstructed from the description and the fixed function.
Symptom: GLM-5.3-Flash + DFlash2 with ``VLLM_GDN_SPEC_DECODE_METADATA_FASTPATH`` on (the default): speculative
acceptance sags and then collapses to exactly 1.00 for the life of the server, halving decode throughput (the
target's own output stays right, GSM8K 94-97/100); with the fast path off, or fixed, it does not collapse (2.49-2.70).
Mechanism: a FULL graph keeps the addresses it was captured with. Capture builds the dummy uniform batch through
``build_for_cudagraph_capture``, which qualifies for the fast path; before the fix the fast path returned views of
what it was handed, so the graph read ``num_accepted_tokens`` from the capture call's own ``torch.diff`` tensor (every
draft "accepted") and never from the builder's ``num_accepted_tokens`` buffer that later steps fill. Every replay,
whichever path built its metadata (the fast path for a uniform batch, the generic path for a padded one), loads each
request's recurrent state from the slot after the last draft instead of after the last accepted token.
Doctor: warmup-divergence, at _build_uniform_spec_decode: capture decided the tensor the graph reads the accepted
counts from (the capture batch's own), replays keep it while an eager step reads this step's counts.
Fix (upstream): the fast path copies state indices, masks, query starts and accepted counts into the builder-owned
graph buffers (``spec_state_indices_tensor``, ``spec_sequence_masks``, ``spec_query_start_loc``,
``num_accepted_tokens``), the same ones the generic path fills.
Modelled: ``GDNAttentionMetadataBuilder`` (``_can_reuse_spec_inputs``, ``_build_uniform_spec_decode``, ``build``
reduced to all-prefill and all-spec batches with padded rows, ``build_for_cudagraph_capture``) and
``GDNAttentionMetadata`` as in the fork (no token-index or chunk metadata). Stand-ins: the GDN layer (one gated delta
rule layer, no causal conv; the spec kernel loads the state from ``spec_state_indices[r, num_accepted[r] - 1]`` and
writes the state after token t to column t, as ``fused_recurrent_gated_delta_rule`` does, skipping null slots; the
prefill path runs from a zero state and stores column 0); the runner (``mamba_aligned_state_indices``: K+1 slots per
request, null in padded rows; FULL graphs for uniform verify batches of 2 and 4 requests, a batch padded to the next
size); the drafter and the sampler (fixed draft tokens, a scripted acceptance per step). float64.
Workload: K = 2. Step 1 prefills A (4 tokens), B (3), C (5), eager. Steps 2-3 verify A, B, C (9 tokens, padded to the
4-request graph: generic path); step 4 verifies A and B (the 2-request graph: fast path). Accepted counts fed to steps
2-4: 1 each (after the prompts), then (2, 3, 1), then (3, 1); every replay of the bug reads 3 (all drafts accepted).
Bug: step 1 equals eager, every replay differs (max per step 0, 1.34, 1.53, 0.28: here the wrong state shows in the
verify logits themselves, upstream measured it as acceptance); copying only the accepted counts
into the builder buffer makes it equal eager. Fix: max |graph - eager| = 1.8e-15 (float64 rounding of the padded
matmuls) over the logits of all 36 tokens.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/local-inference-lab/vllm/pull/667"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_build_uniform_spec_decode"
SYMPTOM = ("GDN + DFlash/MTP with FULL graphs: the uniform spec-decode fast path hands out views, so graphs read the "
           "capture batch's accepted-token counts; recurrent state loads from the wrong slot, acceptance collapses")

NUM_SPEC = 2                                   # K drafts per verify step
QUERY_LEN = 1 + NUM_SPEC
MAX_NUM_SEQS = 4
CAPTURE_NUM_REQS = [2, 4]                      # FULL uniform-decode graphs (tokens: QUERY_LEN x requests)
MAX_NUM_TOKENS = 16
NULL_BLOCK_ID = 0
NUM_SLOTS = 1 + MAX_NUM_SEQS * QUERY_LEN       # slot 0: the null block
HIDDEN, VOCAB = 8, 16
NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM = 2, 4, 4
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    is_prefilling: torch.Tensor
    num_reqs: int
    num_actual_tokens: int


@dataclasses.dataclass
class GDNAttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_spec_decodes: int
    num_spec_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor | None = None
    spec_query_start_loc: torch.Tensor | None = None
    non_spec_query_start_loc: torch.Tensor | None = None
    spec_state_indices_tensor: torch.Tensor | None = None
    non_spec_state_indices_tensor: torch.Tensor | None = None
    spec_sequence_masks: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None
    num_reqs: int = 0
    is_uniform_spec_decode: bool = False


# --- vllm/v1/attention/backends/gdn_attn.py ---------------------------------------------------------------------------

class GDNAttentionMetadataBuilder:
    # Runner-owned stable storage, with NULL_BLOCK_ID in padded request rows.
    mamba_aligned_state_indices: torch.Tensor | None = None

    def __init__(self, num_spec, use_full_cuda_graph, device):
        self.num_spec = num_spec
        self.use_spec_decode = num_spec > 0
        self.use_full_cuda_graph = use_full_cuda_graph
        self.mamba_cache_mode = "align"
        self.decode_cudagraph_max_bs = MAX_NUM_SEQS * (num_spec + 1)
        bs = self.decode_cudagraph_max_bs
        self.spec_state_indices_tensor = torch.empty((bs, num_spec + 1), dtype=torch.int32, device=device)
        self.spec_sequence_masks = torch.empty((bs,), dtype=torch.bool, device=device)
        self.spec_query_start_loc = torch.empty((bs + 1,), dtype=torch.int32, device=device)
        self.num_accepted_tokens = torch.empty((bs,), dtype=torch.int32, device=device)
        self._reuse_spec_decode_inputs = True      # envs.VLLM_GDN_SPEC_DECODE_METADATA_FASTPATH (default on)
        # Constant sources for the uniform spec-decode fast path.
        self._uniform_spec_masks = torch.ones(bs, dtype=torch.bool, device=device)
        self._uniform_spec_query_start = torch.arange(bs + 1, dtype=torch.int32, device=device) * (num_spec + 1)

    def _can_reuse_spec_inputs(self, m, num_accepted_tokens, num_decode_draft_tokens_cpu):
        return (
            self._reuse_spec_decode_inputs
            and self.use_spec_decode
            and self.use_full_cuda_graph
            and self.mamba_cache_mode == "align"
            and self.mamba_aligned_state_indices is not None
            and num_accepted_tokens is not None
            and num_decode_draft_tokens_cpu is not None
            and 0 < m.num_actual_tokens <= self.decode_cudagraph_max_bs
            and m.num_actual_tokens == m.num_reqs * (self.num_spec + 1)
            and bool(torch.all(num_decode_draft_tokens_cpu == self.num_spec))
            and bool(torch.all(torch.diff(m.query_start_loc_cpu) == self.num_spec + 1))
            and not bool(torch.any(m.is_prefilling))
        )

    def _build_uniform_spec_decode(self, m, num_accepted_tokens):
        """Build an all-spec, uniform-window batch without any host-side work."""
        num_reqs = m.num_reqs
        num_tokens = m.num_actual_tokens
        source = self.mamba_aligned_state_indices
        assert source is not None
        if _variant == "bug":      # views of what the fast path was handed
            spec_state_indices = source[:num_reqs, : self.num_spec + 1]
            spec_sequence_masks = self._uniform_spec_masks[:num_reqs]
            spec_query_start_loc = self._uniform_spec_query_start[: num_reqs + 1]
            accepted = num_accepted_tokens[:num_reqs]
        else:                      # written into the builder-owned graph buffers, where the generic path writes
            spec_state_indices = self.spec_state_indices_tensor[:num_reqs]
            spec_state_indices.copy_(source[:num_reqs, : self.num_spec + 1], non_blocking=True)
            spec_sequence_masks = self.spec_sequence_masks[:num_reqs]
            spec_sequence_masks.fill_(True)
            spec_query_start_loc = self.spec_query_start_loc[: num_reqs + 1]
            spec_query_start_loc.copy_(self._uniform_spec_query_start[: num_reqs + 1], non_blocking=True)
            accepted = self.num_accepted_tokens[:num_reqs]
            accepted.copy_(num_accepted_tokens[:num_reqs], non_blocking=True)
        return GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_spec_decodes=num_reqs, num_spec_decode_tokens=num_tokens,
            num_actual_tokens=num_tokens, spec_query_start_loc=spec_query_start_loc,
            spec_state_indices_tensor=spec_state_indices, spec_sequence_masks=spec_sequence_masks,
            num_accepted_tokens=accepted, num_reqs=num_reqs, is_uniform_spec_decode=True)

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False):
        m = common_attn_metadata
        if self._can_reuse_spec_inputs(m, num_accepted_tokens, num_decode_draft_tokens_cpu):
            return self._build_uniform_spec_decode(m, num_accepted_tokens)

        query_start_loc = m.query_start_loc
        block_table_tensor = self.mamba_aligned_state_indices[:m.num_reqs]     # _get_state_indices, align mode
        spec_sequence_masks_cpu = None
        if self.use_spec_decode and num_decode_draft_tokens_cpu is not None:
            spec_sequence_masks_cpu = num_decode_draft_tokens_cpu >= 0
        num_spec_decodes = 0 if spec_sequence_masks_cpu is None else int(spec_sequence_masks_cpu.sum())
        if num_spec_decodes == 0:                  # reduced: an all-prefill batch (fresh prompts)
            context_lens = m.seq_lens_cpu - torch.diff(m.query_start_loc_cpu)
            return GDNAttentionMetadata(
                num_prefills=m.num_reqs, num_prefill_tokens=m.num_actual_tokens, num_spec_decodes=0,
                num_spec_decode_tokens=0, num_actual_tokens=m.num_actual_tokens,
                has_initial_state=(context_lens > 0).to(query_start_loc.device),
                non_spec_query_start_loc=query_start_loc, non_spec_state_indices_tensor=block_table_tensor[:, 0],
                num_reqs=m.num_reqs)

        # reduced: an all-spec batch, padded request rows at the back
        assert not bool(torch.any(m.is_prefilling))
        spec_sequence_masks = spec_sequence_masks_cpu.to(query_start_loc.device)
        spec_state_indices_tensor = block_table_tensor[spec_sequence_masks_cpu, : self.num_spec + 1]
        spec_query_start_loc = query_start_loc[: num_spec_decodes + 1]
        num_spec_decode_tokens = int(m.query_start_loc_cpu[num_spec_decodes])
        num_accepted_tokens = num_accepted_tokens[spec_sequence_masks_cpu]

        # Prepare per-request tensors for cudagraph.
        batch_size = m.num_reqs
        if self.use_full_cuda_graph and num_spec_decodes <= self.decode_cudagraph_max_bs:
            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state_indices_tensor, non_blocking=True)
            spec_state_indices_tensor = self.spec_state_indices_tensor[:batch_size]
            spec_state_indices_tensor[num_spec_decodes:].fill_(NULL_BLOCK_ID)
            self.spec_sequence_masks[:num_spec_decodes].copy_(spec_sequence_masks[:num_spec_decodes])
            spec_sequence_masks = self.spec_sequence_masks[:batch_size]
            spec_sequence_masks[num_spec_decodes:].fill_(False)
            self.spec_query_start_loc[: num_spec_decodes + 1].copy_(spec_query_start_loc, non_blocking=True)
            spec_query_start_loc = self.spec_query_start_loc[: batch_size + 1]
            spec_query_start_loc[num_spec_decodes + 1:].fill_(num_spec_decode_tokens)
            self.num_accepted_tokens[:num_spec_decodes].copy_(num_accepted_tokens, non_blocking=True)
            num_accepted_tokens = self.num_accepted_tokens[:batch_size]
            num_accepted_tokens[num_spec_decodes:].fill_(1)
        return GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_spec_decodes=num_spec_decodes,
            num_spec_decode_tokens=num_spec_decode_tokens, num_actual_tokens=m.num_actual_tokens,
            spec_query_start_loc=spec_query_start_loc, spec_state_indices_tensor=spec_state_indices_tensor,
            spec_sequence_masks=spec_sequence_masks, num_accepted_tokens=num_accepted_tokens, num_reqs=m.num_reqs)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """Metadata for FULL cudagraph capture (decode only)."""
        m = common_attn_metadata
        num_accepted_tokens = torch.diff(m.query_start_loc)
        num_decode_draft_tokens_cpu = (num_accepted_tokens - 1).cpu()
        return self.build(0, m, num_accepted_tokens, num_decode_draft_tokens_cpu)


# --- the GDN layer (stand-in kernels) ---------------------------------------------------------------------------------

def _l2norm(x):
    return x / x.pow(2).sum(-1, keepdim=True).add(1e-6).sqrt()


def _gated_delta_step(state, q, k, v, g, beta):
    """One token per row. state [n, H, dk, dv]; q, k [n, dk]; v [n, H, dv]; g, beta [n, H]."""
    state = state * g.exp()[..., None, None]
    pred = torch.einsum("nhkv,nk->nhv", state, k)
    state = state + torch.einsum("nk,nhv->nhkv", k, (v - pred) * beta[..., None])
    return state, torch.einsum("nhkv,nk->nhv", state, q)


class GatedDeltaNetAttention:
    def __init__(self, device):
        gen = generator(667)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.w_qkvz = r(HIDDEN, 2 * HEAD_K_DIM + 2 * NUM_V_HEADS * HEAD_V_DIM, scale=0.6)
        self.w_ba = r(HIDDEN, 2 * NUM_V_HEADS, scale=0.6)
        self.A_log, self.dt_bias = r(NUM_V_HEADS, scale=0.3), r(NUM_V_HEADS, scale=0.3)
        self.norm_weight = 1.0 + r(HEAD_V_DIM, scale=0.1)
        self.w_out = r(NUM_V_HEADS * HEAD_V_DIM, HIDDEN, scale=0.6)
        self.ssm_state = torch.zeros(NUM_SLOTS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, dtype=DTYPE, device=device)
        self._steps = torch.arange(QUERY_LEN, device=device)

    def fused_recurrent_gated_delta_rule(self, q, k, v, g, beta, md, out):
        """Spec decode: state from column num_accepted - 1, the state after token t stored in column t."""
        indices, cu = md.spec_state_indices_tensor, md.spec_query_start_loc
        rows = (cu[:-1].unsqueeze(1) + self._steps).clamp(max=q.shape[0] - 1)               # [B, K + 1]
        valid = self._steps < (cu[1:] - cu[:-1]).unsqueeze(1)
        first = indices.gather(1, (md.num_accepted_tokens.long() - 1).unsqueeze(1)).squeeze(1)
        h = self.ssm_state.index_select(0, first)
        for t in range(QUERY_LEN):
            r, ok = rows[:, t], valid[:, t]
            h_new, o = _gated_delta_step(h, q[r], k[r], v[r], g[r], beta[r])
            h = torch.where(ok[:, None, None, None], h_new, h)
            slot = indices[:, t].long()
            keep = (ok & (slot != NULL_BLOCK_ID))[:, None, None, None]
            self.ssm_state.index_copy_(0, slot, torch.where(keep, h, self.ssm_state.index_select(0, slot)))
            out.index_copy_(0, r, torch.where(ok[:, None, None], o, out.index_select(0, r)))

    def chunk_gated_delta_rule(self, q, k, v, g, beta, md, out):
        """Prefill (eager only): each prompt from a zero state; the final state goes to its slot."""
        starts = md.non_spec_query_start_loc.tolist()
        for r in range(md.num_prefills):
            slot = md.non_spec_state_indices_tensor[r:r + 1].long()
            h = torch.zeros_like(self.ssm_state[:1])
            for t in range(starts[r], starts[r + 1]):
                h, out[t:t + 1] = _gated_delta_step(h, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                    beta[t:t + 1])
            self.ssm_state.index_copy_(0, slot, h)

    def forward(self, hidden_states, md):
        n = hidden_states.shape[0]
        q, k, v, z = (hidden_states @ self.w_qkvz).split(
            [HEAD_K_DIM, HEAD_K_DIM, NUM_V_HEADS * HEAD_V_DIM, NUM_V_HEADS * HEAD_V_DIM], dim=-1)
        b, a = (hidden_states @ self.w_ba).split(NUM_V_HEADS, dim=-1)
        q, k = _l2norm(q) * HEAD_K_DIM ** -0.5, _l2norm(k)
        v = v.reshape(n, NUM_V_HEADS, HEAD_V_DIM)
        g, beta = -self.A_log.exp() * F.softplus(a + self.dt_bias), torch.sigmoid(b)
        core_attn_out = torch.zeros(n, NUM_V_HEADS, HEAD_V_DIM, dtype=DTYPE, device=hidden_states.device)
        if md.num_spec_decodes > 0:
            self.fused_recurrent_gated_delta_rule(q, k, v, g, beta, md, core_attn_out)
        if md.num_prefills > 0:
            self.chunk_gated_delta_rule(q, k, v, g, beta, md, core_attn_out)
        x = core_attn_out / core_attn_out.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * self.norm_weight
        x = x * F.silu(z.reshape(n, NUM_V_HEADS, HEAD_V_DIM))
        return x.reshape(n, -1) @ self.w_out


class Model:
    def __init__(self, device):
        gen = generator(6670)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.linear_attn = GatedDeltaNetAttention(device)

    def forward(self, input_ids, attn_metadata):
        x = self.embed_tokens[input_ids]
        return (x + self.linear_attn.forward(x, attn_metadata)) @ self.lm_head


# --- the runner (reduced) ---------------------------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = Model(device)
        self.builder = GDNAttentionMetadataBuilder(NUM_SPEC, use_cuda_graph, device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.int32, device=device)
        self.mamba_state_idx = torch.zeros(MAX_NUM_SEQS, QUERY_LEN, dtype=torch.int32, device=device)
        self.num_accepted_tokens = torch.ones(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.builder.mamba_aligned_state_indices = self.mamba_state_idx
        self.num_computed, self.graphs = {}, {}
        if use_cuda_graph:
            b = self.builder
            events.static_buffers("GDNAttentionMetadataBuilder", {
                "spec_state_indices_tensor": b.spec_state_indices_tensor, "spec_sequence_masks": b.spec_sequence_masks,
                "spec_query_start_loc": b.spec_query_start_loc, "num_accepted_tokens": b.num_accepted_tokens})
            self.capture_model()

    def _dummy_run(self, num_reqs):
        """Capture the FULL graph of a uniform verify batch of ``num_reqs`` requests on the null block."""
        n = num_reqs * QUERY_LEN
        self.mamba_state_idx[:num_reqs].fill_(NULL_BLOCK_ID)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * QUERY_LEN
        self.query_start_loc[:num_reqs + 1].copy_(host(qsl, self.device))
        cam = CommonAttentionMetadata(self.query_start_loc[:num_reqs + 1], host(qsl, self.device),
                                      host(torch.full((num_reqs,), QUERY_LEN), self.device),
                                      host(torch.zeros(num_reqs, dtype=torch.bool), self.device), num_reqs, n)
        attn_metadata = self.builder.build_for_cudagraph_capture(cam)
        self.graphs[num_reqs] = capture(
            lambda: self.model.forward(self.input_ids[:n], attn_metadata), device=self.device,
            name=f"FULL verify {num_reqs}", owner="GPUModelRunner",
            static={"input_ids": self.input_ids, "query_start_loc": self.query_start_loc,
                    "mamba_aligned_state_indices": self.mamba_state_idx,
                    "num_accepted_tokens": self.num_accepted_tokens},
            state={"ssm_state": self.model.linear_attn.ssm_state})

    def capture_model(self):
        for num_reqs in sorted(CAPTURE_NUM_REQS, reverse=True):
            self._dummy_run(num_reqs)

    def execute_model(self, scheduled, accepted):
        """``scheduled``: [(request, tokens)], all prompts or all verify windows; ``accepted``: tokens the
        previous verify step accepted per request (1 after a prompt). Returns the logits of every token."""
        num_reqs = len(scheduled)
        verify = all(req in self.num_computed for req, _ in scheduled)
        graph_reqs = next((s for s in sorted(CAPTURE_NUM_REQS) if s >= num_reqs), None)
        use_graph = verify and bool(self.graphs) and graph_reqs is not None
        padded_reqs = graph_reqs if use_graph else num_reqs
        ids, lens, seq_lens = [], [], []
        for i, (req, tokens) in enumerate(scheduled):
            ids += tokens
            lens.append(len(tokens))
            seq_lens.append(self.num_computed.get(req, 0) + len(tokens))
            self.mamba_state_idx[i].copy_(torch.arange(QUERY_LEN, dtype=torch.int32) + 1 + req * QUERY_LEN)
            self.num_computed[req] = seq_lens[-1]
        n = len(ids)
        self.input_ids[:n].copy_(torch.tensor(ids))                # padded rows keep what earlier steps left
        self.mamba_state_idx[num_reqs:padded_reqs].fill_(NULL_BLOCK_ID)
        acc = [accepted.get(req, 1) for req, _ in scheduled] + [1] * (padded_reqs - num_reqs)
        self.num_accepted_tokens[:padded_reqs].copy_(torch.tensor(acc, dtype=torch.int32))
        lens += [QUERY_LEN] * (padded_reqs - num_reqs)
        qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        self.query_start_loc[:padded_reqs + 1].copy_(host(qsl, self.device))
        drafts = [NUM_SPEC if verify else -1] * num_reqs + [-1] * (padded_reqs - num_reqs)
        cam = CommonAttentionMetadata(
            self.query_start_loc[:padded_reqs + 1], host(qsl, self.device),
            host(torch.tensor(seq_lens + [QUERY_LEN] * (padded_reqs - num_reqs)), self.device),
            host(torch.tensor([not verify] * num_reqs + [False] * (padded_reqs - num_reqs)), self.device),
            padded_reqs, int(qsl[-1]))
        attn_metadata = self.builder.build(0, cam, num_accepted_tokens=self.num_accepted_tokens[:padded_reqs],
                                           num_decode_draft_tokens_cpu=host(torch.tensor(drafts), self.device))
        if use_graph:
            g, out = self.graphs[padded_reqs]
            return replay(g, out, real=n, size=int(qsl[-1]), padded={"input_ids": self.input_ids})[:n].clone()
        return self.model.forward(self.input_ids[:n], attn_metadata).clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    A, B, C = 0, 1, 2
    steps = [([(A, [3, 1, 4, 1]), (B, [9, 2, 6]), (C, [5, 3, 5, 8, 9])], {}),     # step 1: prompts (eager)
             ([(A, [7, 9, 3]), (B, [2, 3, 8]), (C, [4, 6, 2])], {A: 1, B: 1, C: 1}),  # steps 2-3: 3 padded to 4
             ([(A, [6, 4, 3]), (B, [3, 8, 3]), (C, [2, 7, 9])], {A: 2, B: 3, C: 1}),
             ([(A, [5, 0, 2]), (B, [8, 8, 4])], {A: 3, B: 1})]                         # step 4: C is done

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        return [runner.execute_model(scheduled, accepted) for scheduled, accepted in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
