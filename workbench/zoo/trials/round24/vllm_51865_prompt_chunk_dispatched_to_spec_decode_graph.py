"""A prompt chunk shaped like a spec-decode batch replays the FULL decode graph over GDN state indices nobody refreshed.

Upstream: https://github.com/vllm-project/vllm/pull/51865 ("[Bugfix][MRV2] Require all requests to be decoding
for uniform-decode dispatch"), a rework of https://github.com/vllm-project/vllm/pull/50532.
Symptom: hybrid (Gated DeltaNet) models with speculative decoding on Model Runner V2 lost or corrupted their
recurrent state when a prompt chunk had exactly ``1 + num_speculative_tokens`` tokens per request: garbled
output for that request and for decodes sharing its batch (vLLM, August 2026; mechanism behind #49918).
Mechanism: ``ModelRunner.execute_model`` classified a batch as uniform decode from its shape alone,
``get_uniform_token_count(num_reqs, num_tokens, max_query_len)`` (``num_tokens == num_reqs *
max_query_len``); a prompt chunk of ``1 + K`` tokens per request has that shape, so the dispatcher picks the
FULL spec-verify decode graph. The attention metadata is still built from the real batch: the prompt request
has no draft tokens, so ``GDNAttentionMetadataBuilder.build`` builds prefill metadata and skips the copy of
the spec-decode state indices into its persistent ``spec_state_indices_tensor`` (that refresh runs only for
a pure spec-decode batch). The replayed graph, captured for spec decodes only, reads that buffer as it is:
the indices of an earlier step (or of the capture). Its ``fused_recurrent_gated_delta_rule`` starts the
prompt from another request's recurrent state and stores the prompt's final state into that request's slot,
while the prompt's own slot is never written (capture-time indices ``<= 0`` make the kernel skip the read and
the store); later decodes of both requests read wrong states.
Doctor: stale-input, at ``fused_recurrent_gated_delta_rule`` (the replay reads rows of the static
``spec_state_indices_tensor`` that this step did not write).
Fix (upstream): uniform-decode dispatch also requires every request to be past its prompt
(``get_uniform_decode_token_count``; ``gather_batch_req_state`` runs before the cudagraph-mode decision), so
the prompt chunk runs without the FULL decode graph.
Read: the PR descriptions of #51865 and #50532, the review-thread hunk adding ``is_uniform_query_len`` /
``get_uniform_decode_token_count`` (vllm/v1/worker/utils.py), a downstream port of the fix to MRV2's
``execute_model`` (``prefilling = num_computed_prefill_tokens < prefill_len``), and the V1 GDN builder's
persistent-buffer branch. Simplified here: one state slot per request (upstream keeps ``1 + K`` slots for
the intermediate states of a spec decode) and every draft token is accepted.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/51865"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "fused_recurrent_gated_delta_rule"
SYMPTOM = "a K+1-token prompt chunk replays the spec-decode graph: it reads and overwrites another request's state"

VOCAB, DIM = 16, 4
NUM_SPEC = 1
DECODE_QUERY_LEN = 1 + NUM_SPEC
MAX_NUM_REQS = 2
CAPTURE_SIZES = [2, 4]                    # FULL uniform-decode graphs: 1 and 2 spec-decoding requests
MAX_NUM_TOKENS = 8
NUM_SLOTS = 6
NULL_SLOT, PAD_SLOT_ID = 0, -1


class Model:
    def __init__(self, device):
        gen = generator(51865)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.w_in = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.decay = (torch.rand(DIM, generator=gen) * 0.4 + 0.5).to(device)
        self.w_out = randn(DIM, DIM, gen=gen, device=device, scale=0.8)


def get_uniform_token_count(num_reqs: int, num_tokens: int, max_query_len: int) -> int | None:
    """Shape test only: a prompt chunk can have a decode batch's shape."""
    return max_query_len if num_reqs > 0 and num_tokens == max_query_len * num_reqs else None


def get_uniform_decode_token_count(num_reqs, num_tokens, max_query_len, is_prefilling: np.ndarray):
    if is_prefilling.any():
        return None
    return get_uniform_token_count(num_reqs, num_tokens, max_query_len)


@dataclasses.dataclass
class GDNAttentionMetadata:
    num_spec_decodes: int
    num_prefills: int
    batch_size: int                                  # spec rows the kernel runs (padded for a graph)
    spec_state_indices_tensor: torch.Tensor | None
    non_spec_state_indices_tensor: torch.Tensor | None
    has_initial_state: np.ndarray | None
    non_spec_query_lens: np.ndarray | None


class GDNAttentionMetadataBuilder:
    def __init__(self, device, use_full_cuda_graph):
        self.device = device
        self.use_full_cuda_graph = use_full_cuda_graph
        self.decode_cudagraph_max_bs = MAX_NUM_REQS
        self.spec_state_indices_tensor = torch.full((MAX_NUM_REQS,), PAD_SLOT_ID, dtype=torch.long, device=device)

    def build(self, state_slots, query_lens, num_draft_tokens, num_computed_tokens, batch_size=None):
        """``state_slots``: each request's state slot (block_table[:, 0]); host arrays for the rest."""
        spec_sequence_masks = num_draft_tokens > 0
        num_spec_decodes = int(spec_sequence_masks.sum())
        non_spec = ~spec_sequence_masks
        num_prefills = int(non_spec.sum())
        rows = lambda mask: torch.from_numpy(np.nonzero(mask)[0]).to(self.device)  # noqa: E731
        spec_state_indices_tensor = state_slots[rows(spec_sequence_masks)] if num_spec_decodes else None
        meta = GDNAttentionMetadata(
            num_spec_decodes=num_spec_decodes, num_prefills=num_prefills, batch_size=num_spec_decodes,
            spec_state_indices_tensor=spec_state_indices_tensor,
            non_spec_state_indices_tensor=state_slots[rows(non_spec)] if num_prefills else None,
            has_initial_state=(num_computed_tokens[non_spec] > 0) if num_prefills else None,
            non_spec_query_lens=query_lens[non_spec] if num_prefills else None)
        # prepare tensors for cudagraph: only a pure spec-decode batch refreshes the persistent buffer
        if (self.use_full_cuda_graph and num_prefills == 0
                and num_spec_decodes <= self.decode_cudagraph_max_bs):
            batch_size = batch_size or num_spec_decodes
            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state_indices_tensor)
            self.spec_state_indices_tensor[num_spec_decodes:batch_size].fill_(PAD_SLOT_ID)
            meta.spec_state_indices_tensor = self.spec_state_indices_tensor[:batch_size]
            meta.batch_size = batch_size
        return meta


def fused_recurrent_gated_delta_rule(x, decay, ssm_state, ssm_state_indices):
    """Spec-decode rows ``[rows, q_len, DIM]``: a row starts from ``ssm_state[idx]`` and stores its final
    state back there; ``idx <= 0`` (null or padded) skips both the read and the store."""
    valid = (ssm_state_indices > 0)[:, None]
    idx = ssm_state_indices.clamp(min=0)
    h = torch.where(valid, ssm_state[idx], torch.zeros_like(x[:, 0]))
    ys = []
    for t in range(x.shape[1]):
        h = decay * h + x[:, t]
        ys.append(h)
    ssm_state[idx] = torch.where(valid, h, ssm_state[idx])
    return torch.stack(ys, 1)


def chunk_gated_delta_rule(x, decay, ssm_state, state_indices, has_initial_state, query_lens):
    """Prompt (non-spec) requests, one after the other (eager only: never part of the decode graph)."""
    ys, start = [], 0
    for i, n in enumerate(query_lens.tolist()):
        idx = state_indices[i:i + 1]
        h = ssm_state[idx] if has_initial_state[i] else torch.zeros_like(x[:1])
        for t in range(start, start + n):
            h = decay * h + x[t:t + 1]
            ys.append(h)
        ssm_state[idx] = h
        start += n
    return torch.cat(ys)


def gdn_forward(model, ssm_state, input_ids, meta: GDNAttentionMetadata):
    """Spec-decode requests come first (the runner reorders decodes before prompts)."""
    x = model.emb[input_ids] @ model.w_in
    outs, n_spec = [], meta.batch_size * DECODE_QUERY_LEN
    if meta.num_spec_decodes > 0:
        xs = x[:n_spec].reshape(meta.batch_size, DECODE_QUERY_LEN, DIM)
        outs.append(fused_recurrent_gated_delta_rule(xs, model.decay, ssm_state,
                                                     meta.spec_state_indices_tensor).reshape(-1, DIM))
    if meta.num_prefills > 0:
        outs.append(chunk_gated_delta_rule(x[n_spec:], model.decay, ssm_state, meta.non_spec_state_indices_tensor,
                                           meta.has_initial_state, meta.non_spec_query_lens))
    return torch.tanh(torch.cat(outs)) @ model.w_out


class RequestState:
    def __init__(self):
        self.prefill_len, self.num_computed_prefill_tokens, self.state_slot = {}, {}, {}


class ModelRunner:
    """Model Runner V2 with FULL uniform-decode graphs (FULL_AND_PIECEWISE; other batches run eagerly here)."""

    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.ssm_state = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, 1, dtype=torch.long, device=device)
        self.req_states = RequestState()
        self.builder = GDNAttentionMetadataBuilder(device, use_full_cuda_graph=graphed)
        self.graphs = {}
        if graphed:
            self.capture_model()

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        for size in sorted(CAPTURE_SIZES, reverse=True):
            reqs = size // DECODE_QUERY_LEN
            self.block_table[:reqs].fill_(NULL_SLOT)                # dummy requests own no state
            ones = np.ones(reqs, dtype=np.int64)
            meta = self.builder.build(self.block_table[:reqs, 0], ones * DECODE_QUERY_LEN, ones * NUM_SPEC, ones)
            self.graphs[size] = capture(
                lambda size=size, meta=meta: gdn_forward(self.model, self.ssm_state, self.input_ids[:size], meta),
                device=self.device, pool=pool, name=f"size {size}", owner="CudaGraphManager (FULL decode)",
                static={"input_ids": self.input_ids,
                        "spec_state_indices_tensor": self.builder.spec_state_indices_tensor},
                state={"ssm_state": self.ssm_state})

    def gather_batch_req_state(self, scheduled):
        rs = self.req_states
        return np.array([rs.num_computed_prefill_tokens[r] < rs.prefill_len[r] for r, _, _ in scheduled])

    def execute_model(self, scheduled):
        """``scheduled``: (request id, token ids, number of draft tokens), decodes first."""
        rs = self.req_states
        num_reqs = len(scheduled)
        query_lens = np.array([len(toks) for _, toks, _ in scheduled], dtype=np.int64)
        num_tokens, max_query_len = int(query_lens.sum()), int(query_lens.max())
        if self.variant == "fix":
            is_prefilling = self.gather_batch_req_state(scheduled)
            uniform_tok_count = get_uniform_decode_token_count(num_reqs, num_tokens, max_query_len, is_prefilling)
        else:
            uniform_tok_count = get_uniform_token_count(num_reqs, num_tokens, max_query_len)
        use_full_graph = (self.graphed and uniform_tok_count == DECODE_QUERY_LEN and num_tokens in self.graphs)

        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        self.input_ids[:num_tokens].copy_(t([tok for _, toks, _ in scheduled for tok in toks]))
        self.block_table[:num_reqs, 0].copy_(t([rs.state_slot[r] for r, _, _ in scheduled]))
        num_computed = np.array([rs.num_computed_prefill_tokens[r] for r, _, _ in scheduled], dtype=np.int64)
        meta = self.builder.build(self.block_table[:num_reqs, 0], query_lens,
                                  np.array([d for _, _, d in scheduled], dtype=np.int64), num_computed)
        for (r, toks, _) in scheduled:
            rs.num_computed_prefill_tokens[r] = min(rs.prefill_len[r], rs.num_computed_prefill_tokens[r] + len(toks))
        if use_full_graph:
            g, out = self.graphs[num_tokens]
            return replay(g, out).clone()
        return gdn_forward(self.model, self.ssm_state, self.input_ids[:num_tokens], meta).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(5186)
    tok = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    prompts = {"B": tok(3), "C": tok(3), "A": tok(DECODE_QUERY_LEN)}   # A's prompt: exactly 1 + K tokens
    slots = {"B": 1, "C": 2, "A": 3}
    steps = [
        [("B", prompts["B"], 0), ("C", prompts["C"], 0)],             # prompts of 3: not decode-shaped
        [("B", tok(2), NUM_SPEC), ("C", tok(2), NUM_SPEC)],           # pure spec decode: refreshes [B, C]
        [("B", tok(2), NUM_SPEC), ("A", prompts["A"], 0)],            # decode-shaped, but A is prefilling
        [("A", tok(2), NUM_SPEC), ("C", tok(2), NUM_SPEC)],
        [("B", tok(2), NUM_SPEC), ("A", tok(2), NUM_SPEC)],
    ]

    def serve(graphed: bool):
        runner = ModelRunner(model, device, variant, graphed)
        for r, p in prompts.items():
            runner.req_states.prefill_len[r] = len(p)
            runner.req_states.num_computed_prefill_tokens[r] = 0
            runner.req_states.state_slot[r] = slots[r]
        return [runner.execute_model(step) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
