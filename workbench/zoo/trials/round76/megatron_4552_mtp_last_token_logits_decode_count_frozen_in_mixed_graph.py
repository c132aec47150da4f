"""MTP + full-iteration inference graphs: ``speculative_required_logit_indices`` builds the last-token gather from host counts that capture freezes, so a mixed step with fewer decodes than its graph samples a new request's first token from the wrong logit row.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4552 ("Make last_token_logits graphable", merged 2026-05-02,
commit 396bee18f5). The gather came in with #4166 ("Make MTP work with materialize_only_last_token_logits", commit
c1463050b3), which added ``speculative_required_logit_indices`` and called it from ``last_token_logits``.
Symptom: MTP speculative decoding with ``materialize_only_last_token_logits`` (the default) and
``--cuda-graph-scope=full_iteration_inference`` with graphs for mixed (non-decode) steps. When a request's prefill
shares a step with fewer decode requests than the matched mixed graph was captured for, the new request's first
generated token is sampled from the logits of one of its prompt tokens (or of a decode row), not from its last
prompt token. Its whole continuation is then wrong. Eager runs are correct, and so are steps whose decode count
equals the graph's. There is no issue thread; the symptom follows from the diff and its new padding tests.
Mechanism: ``GPTModel._postprocess`` (gpt_model.py) calls ``inference_context.last_token_logits(reshaped)`` inside
the forward that ``CudaGraphManager`` captures per ``padded_batch_dimensions``. In
``DynamicInferenceContext.last_token_logits`` (megatron/core/inference/contexts/dynamic_context.py), with
``num_speculative_tokens > 0``, ``speculative_required_logit_indices`` reads the host counts ``paused_request_count``,
``total_request_count`` and ``num_decode_requests``. It slices ``request_query_lengths[paused:total]``, builds
``arange(num_decode * (k+1))`` and concatenates ``cumsum(query_lengths)[num_decode:] - 1``. Graph capture runs this
once, on the dummy batch of ``add_dummy_requests_for_cudagraph_capture``, which fills the graph's dimensions exactly
(here 3 decode requests and 1 prefill). The replay repeats only the kernels: the arange of 6 decode rows, and the
slice offsets, which put the prefill row at ``cumsum[3]``. A real mixed step (2 decode requests + 1 prefill of 4 tokens)
matches that graph, because ``match_graph_config`` pads the decode count. Its packed tokens are
``[A, A', B, B', C0..C3]``, so the graph hands back rows ``[0..5, 7+pad]`` where eager selects ``[0..3, 7]``. The
controller reads the first ``num_last_token_logits`` = 5 rows (computed on the host with the real counts), and row 4
is C's first prompt token.
Doctor: host-work-frozen, at speculative_required_logit_indices (the Python ints it reads from the context, that is
the decode count, the request slice and the arange length, are turned into index kernels once at capture. Replays
keep the capture batch's decode/prefill split while each eager step rebuilds it from the current counts. The fix
replaces this body with a slice of a buffer that is filled outside the graph).
Fix (upstream): a persistent int32 ``active_logit_idxs`` (``max_requests * (k+1)``) and a constant
``_decode_logit_idxs = arange(...)``. ``pad_active_slices`` (formerly ``pass``) refills them every step in
``initialize_attention_state``, outside the graph: the decode prefix is copied, the prefill last-token positions
are computed with ``torch.cumsum(..., out=prefill_dst)`` and then ``add_(decode_tokens - 1)``, and the tail is
zeroed. ``speculative_required_logit_indices`` and ``last_token_logits`` return or gather
``active_logit_idxs[:num_last_token_logits]``. ``num_last_token_logits`` gives the padded count (padded decode
requests * (k+1) + padded prefill requests) on graph steps.
Modelled: one rank, no pipeline or expert parallelism, no paused requests (the frozen ``paused:total`` slice offsets
are a second form of the same bug and are not exercised). The decoder is a per-token MLP (no attention and no KV
cache), so each logit row depends only on its token and position. The MTP head is one linear map from the sampled
token's embedding and runs eagerly after verification. Sampling is greedy; verification accepts the draft if
the base row's argmax equals it. The graph list follows ``generate_cuda_graph_batch_dimensions_list`` for
max_requests = 4, k = 1, one mixed prefill request and 8 tokens, with non-strict matching (GPT model). The
``build_active_slices`` clamp of the fix is left out (no request metadata is sliced).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4552"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "speculative_required_logit_indices"
SYMPTOM = ("MTP + full_iteration_inference graphs: a mixed step padded to more decode requests than it has replays "
           "the capture's decode/prefill index split; a new request's first token is sampled from a wrong logit row")

VOCAB, HIDDEN, MAX_POS = 16, 8, 32
MAX_REQUESTS, MAX_TOKENS = 4, 16
NUM_SPECULATIVE_TOKENS = 1
TOKEN_ROUNDER, REQUEST_ROUNDER = 4, 2                 # upstream 64, 4
CUDA_GRAPH_PREFILL_TOKEN_COUNTS = [8]
CUDA_GRAPH_DECODE_TOKEN_COUNTS = [8, 4]
CUDA_GRAPH_MIXED_PREFILL_REQUEST_COUNT = 1


# --- megatron/core/inference/batch_dimensions_utils.py --------------------------------------------------------

class InferenceBatchDimensions(NamedTuple):
    token_count: int = 0
    prefill_req_count: int = 0
    decode_req_count: int = 0

    @property
    def req_count(self):
        return self.prefill_req_count + self.decode_req_count

    def is_applicable_for_batch_dim(self, real, strict=False):
        if real.prefill_req_count == 0:
            return (self.token_count >= real.token_count and self.decode_req_count >= real.decode_req_count
                    and self.prefill_req_count == 0)
        if strict:
            return (self.token_count >= real.token_count and self.prefill_req_count >= real.prefill_req_count
                    and self.decode_req_count >= real.decode_req_count)
        return (self.token_count >= real.token_count and self.prefill_req_count >= real.prefill_req_count
                and self.req_count >= real.req_count)

    def is_valid(self, max_requests, num_speculative_tokens):
        return (self.req_count <= max_requests and self.req_count > 0
                and self.decode_req_count * (num_speculative_tokens + 1) + self.prefill_req_count <= self.token_count)


class CUDAGraphBatchDimensionBuilder:
    @staticmethod
    def generate_cuda_graph_batch_dimensions_list(max_requests, num_speculative_tokens):
        k1 = num_speculative_tokens + 1
        dims = []

        def add_if_valid(**kw):
            d = InferenceBatchDimensions(**kw)
            if d.is_valid(max_requests, num_speculative_tokens):
                dims.append(d)

        for size in CUDA_GRAPH_PREFILL_TOKEN_COUNTS:                # mixed prefill and decode mode
            prefill_req_count = min(CUDA_GRAPH_MIXED_PREFILL_REQUEST_COUNT, max_requests)
            decode_req_count = max(0, min((size - prefill_req_count) // k1, max_requests - prefill_req_count))
            add_if_valid(token_count=size, prefill_req_count=prefill_req_count, decode_req_count=decode_req_count)
            add_if_valid(token_count=size, prefill_req_count=min(max_requests, size), decode_req_count=0)
        for size in CUDA_GRAPH_DECODE_TOKEN_COUNTS:                 # decode-only dimensions
            decode_req_count = min(size // k1, max_requests)
            add_if_valid(token_count=decode_req_count * k1, prefill_req_count=0, decode_req_count=decode_req_count)
        dims = list(set(dims))
        dims.sort(key=lambda x: (x.token_count - x.decode_req_count * k1, x.decode_req_count), reverse=True)
        return dims

    @staticmethod
    def match_graph_config(real_batch_dim, cuda_graph_batch_dimensions_list, strict=False):
        applicable = [d for d in cuda_graph_batch_dimensions_list if d.is_applicable_for_batch_dim(real_batch_dim, strict)]
        return min(applicable) if applicable else None


# --- megatron/core/inference/contexts/dynamic_context.py ------------------------------------------------------

class DynamicInferenceContext:
    def __init__(self, variant, device, use_cuda_graphs):
        self.variant, self.device = variant, device
        self.num_speculative_tokens = NUM_SPECULATIVE_TOKENS
        self.max_requests, self.max_tokens = MAX_REQUESTS, MAX_TOKENS
        self.materialize_only_last_token_logits = True
        self.request_query_lengths = torch.zeros(MAX_REQUESTS, dtype=torch.int32, device=device)
        self.token_to_input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.token_to_pos_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        if variant == "fix":
            # Static tensor addresses to make `last_token_logits` graphable with speculative decoding.
            max_logit_idxs = self.max_requests * (self.num_speculative_tokens + 1)
            self.active_logit_idxs = torch.zeros(max_logit_idxs, dtype=torch.int32, device=device)
            self._decode_logit_idxs = torch.arange(max_logit_idxs, dtype=torch.int32, device=device)
        self.cuda_graph_batch_dimensions_list = (
            CUDAGraphBatchDimensionBuilder.generate_cuda_graph_batch_dimensions_list(
                MAX_REQUESTS, NUM_SPECULATIVE_TOKENS) if use_cuda_graphs else [])
        self.reset()

    def reset(self):
        self.request_query_lengths.fill_(0)                     # reset_tensors
        self.paused_request_count = self.total_request_count = 0
        self.num_prefill_requests = self.active_token_count = 0
        self._using_cuda_graph_this_step = False
        self.padded_batch_dimensions = InferenceBatchDimensions()

    @staticmethod
    def round_up_tokens(value):
        return TOKEN_ROUNDER * -(-value // TOKEN_ROUNDER)

    @staticmethod
    def round_up_requests(value):
        return REQUEST_ROUNDER * -(-value // REQUEST_ROUNDER)

    @property
    def num_decode_requests(self):
        return self.total_request_count - self.paused_request_count - self.num_prefill_requests

    def set_step(self, token_ids, position_ids, query_lengths, num_prefill):
        """What add_request / update_requests leave for the step: decode requests first, then prefill requests."""
        n = len(token_ids)
        self.token_to_input_ids[:n].copy_(torch.tensor(token_ids, dtype=torch.long))
        self.token_to_pos_ids[:n].copy_(torch.tensor(position_ids, dtype=torch.long))
        self.request_query_lengths[:len(query_lengths)].copy_(torch.tensor(query_lengths, dtype=torch.int32))
        self.active_token_count, self.total_request_count = n, len(query_lengths)
        self.num_prefill_requests = num_prefill

    def add_dummy_requests_for_cudagraph_capture(self, graph_dimensions):
        k1 = self.num_speculative_tokens + 1
        prefill_tokens = graph_dimensions.token_count - graph_dimensions.decode_req_count * k1
        lengths = [k1] * graph_dimensions.decode_req_count
        if graph_dimensions.prefill_req_count:
            per, rem = divmod(prefill_tokens, graph_dimensions.prefill_req_count)
            lengths += [per + (1 if i < rem else 0) for i in range(graph_dimensions.prefill_req_count)]
        positions = [p for n in lengths for p in range(n)]
        self.set_step([0] * len(positions), positions, lengths, graph_dimensions.prefill_req_count)

    def initialize_attention_state(self, *, construct_graph_dimensions=None):
        if construct_graph_dimensions is not None:
            self.add_dummy_requests_for_cudagraph_capture(construct_graph_dimensions)
        batch_dimensions = InferenceBatchDimensions(self.active_token_count, self.num_prefill_requests,
                                                    self.num_decode_requests)
        best_graph = CUDAGraphBatchDimensionBuilder.match_graph_config(
            batch_dimensions, self.cuda_graph_batch_dimensions_list, strict=False)     # GPT: not hybrid
        self._using_cuda_graph_this_step = best_graph is not None
        if best_graph is not None:
            self.padded_batch_dimensions = best_graph
        elif self.num_prefill_requests == 0:
            padded_decode_req_count = min(self.max_requests, self.round_up_requests(self.num_decode_requests))
            self.padded_batch_dimensions = InferenceBatchDimensions(
                padded_decode_req_count * (self.num_speculative_tokens + 1), 0, padded_decode_req_count)
        else:
            target = min(self.max_requests, self.round_up_requests(self.total_request_count - self.paused_request_count))
            self.padded_batch_dimensions = InferenceBatchDimensions(
                self.round_up_tokens(self.active_token_count), target - self.num_decode_requests,
                self.num_decode_requests)
        self.padded_active_token_count = self.padded_batch_dimensions.token_count
        self.padded_active_request_count = self.padded_batch_dimensions.req_count
        self.pad_active_slices()

    def using_cuda_graph_this_step(self):
        return self._using_cuda_graph_this_step

    def pad_active_slices(self):
        """Pad the active slices of specific tensors."""
        if self.variant == "bug":
            return
        active_request_count = self.total_request_count - self.paused_request_count
        active_decode_count = self.num_decode_requests
        active_prefill_count = active_request_count - active_decode_count
        active_decode_token_count = active_decode_count * (self.num_speculative_tokens + 1)
        # Decode prefix: positions [0, 1, ..., active_decode_token_count - 1].
        self.active_logit_idxs[:active_decode_token_count].copy_(self._decode_logit_idxs[:active_decode_token_count])
        # Prefill last-token positions: cumsum the prefill query lengths in place,
        # then shift by (active_decode_token_count - 1) to get absolute positions.
        prefill_dst = self.active_logit_idxs[active_decode_token_count:active_decode_token_count + active_prefill_count]
        prefill_idxs = self.paused_request_count + active_decode_count
        torch.cumsum(self.request_query_lengths[prefill_idxs:self.total_request_count], dim=0, out=prefill_dst)
        prefill_dst.add_(active_decode_token_count - 1)
        self.active_logit_idxs[active_decode_token_count + active_prefill_count:].zero_()

    def current_input_and_position_ids(self):
        num_tokens = self.padded_active_token_count
        return self.token_to_input_ids[:num_tokens].unsqueeze(0), self.token_to_pos_ids[:num_tokens].unsqueeze(0)

    def speculative_required_logit_indices(self, device):
        """Token-level indices needed for speculative decode verification."""
        if self.variant == "fix":
            return self.active_logit_idxs[:self.num_last_token_logits]
        paused = self.paused_request_count
        total = self.total_request_count
        query_lengths = self.request_query_lengths[paused:total]
        num_decode = self.num_decode_requests

        decode_token_count = num_decode * (self.num_speculative_tokens + 1)
        decode_indices = torch.arange(decode_token_count, device=device)

        cumsum = torch.cumsum(query_lengths, dim=0)
        prefill_last_indices = cumsum[num_decode:] - 1

        return torch.cat([decode_indices, prefill_last_indices])

    @property
    def num_last_token_logits(self):
        if self.variant == "fix" and self._using_cuda_graph_this_step:
            return (self.padded_batch_dimensions.decode_req_count * (self.num_speculative_tokens + 1)
                    + self.padded_batch_dimensions.prefill_req_count)
        return self.num_decode_requests * (self.num_speculative_tokens + 1) + self.num_prefill_requests

    def last_token_logits(self, logits):
        """Select the logit positions needed for token generation: all decode rows, each prefill's last row."""
        assert logits.size(0) == 1
        assert logits.size(1) == self.padded_active_token_count
        if self.variant == "fix":
            return logits.squeeze(0)[self.active_logit_idxs[:self.num_last_token_logits], :]
        logits_2d = logits.squeeze(0)
        selected = self.speculative_required_logit_indices(logits.device)
        assert selected.numel() == self.num_last_token_logits
        return logits_2d[selected, :]


# --- megatron/core/models/gpt/gpt_model.py --------------------------------------------------------------------

class GPTModel:
    def __init__(self, device):
        gen = generator(4552)
        self.word_embeddings = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.position_embeddings = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_fc1 = randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_fc2 = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.output_weight = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.mtp_proj = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, position_ids, inference_context):
        h = (self.word_embeddings[input_ids[0]] + self.position_embeddings[position_ids[0]]).unsqueeze(1)  # [S,1,H]
        hidden_states = h + torch.tanh(h @ self.w_fc1) @ self.w_fc2
        return self._postprocess(hidden_states, inference_context)

    def _postprocess(self, hidden_states, inference_context):
        if inference_context.materialize_only_last_token_logits:
            # Reshape [S, B, H] (with B=1) to [1, S, H] for logit extraction,
            # then back to [S', B, H] for the output layer.
            reshaped = hidden_states.squeeze(1).unsqueeze(0)
            hidden_states = inference_context.last_token_logits(reshaped).unsqueeze(1)
        logits = hidden_states @ self.output_weight
        return logits.transpose(0, 1).contiguous()                  # [1, S', V]

    def mtp_draft(self, token_ids):
        """The MTP head (serial, after verification): one linear map of the sampled token's embedding."""
        return (self.word_embeddings[token_ids] @ self.mtp_proj).argmax(-1)


# --- text_generation_controller.py + dynamic_engine.py --------------------------------------------------------

class Request:
    def __init__(self, request_id, prompt):
        self.request_id, self.tokens, self.prompt_len = request_id, list(prompt), len(prompt)
        self.prefilled, self.pending_draft = False, None


class DynamicInferenceEngine:
    def __init__(self, variant, device, use_cuda_graphs):
        self.device = device
        self.context = DynamicInferenceContext(variant, device, use_cuda_graphs)
        self.model = GPTModel(device)
        self._enable_cuda_graph = use_cuda_graphs
        self._all_logits_cuda = torch.zeros(1, MAX_REQUESTS * (NUM_SPECULATIVE_TOKENS + 1), VOCAB, device=device)
        self.cuda_graphs = {}
        if use_cuda_graphs:
            self.create_cuda_graphs()

    def create_cuda_graphs(self):
        context = self.context
        pool = graph_pool_handle(self.device)
        static = {"token_to_input_ids": context.token_to_input_ids, "token_to_pos_ids": context.token_to_pos_ids}
        if context.variant == "bug":
            static["request_query_lengths"] = context.request_query_lengths
        else:
            static["active_logit_idxs"] = context.active_logit_idxs
        for dims in context.cuda_graph_batch_dimensions_list:
            context.initialize_attention_state(construct_graph_dimensions=dims)
            ids, pos = context.current_input_and_position_ids()
            g, out = capture(lambda i=ids, p=pos: self.model.forward(i, p, context), device=self.device, pool=pool,
                             name=f"full_iteration_inference {tuple(dims)}", owner="CudaGraphManager", static=static)
            self.cuda_graphs[dims] = (g, out, ids, pos)
            context.reset()

    def _dynamic_step_forward_logits(self):
        context = self.context
        logits_seq_len = context.num_last_token_logits
        if context.using_cuda_graph_this_step():
            g, out, ids, pos = self.cuda_graphs[context.padded_batch_dimensions]
            real = context.active_token_count
            logits = replay(g, out, padded_columns={"input_ids": (ids, real), "position_ids": (pos, real)})
        else:
            logits = self.model.forward(*context.current_input_and_position_ids(), context)
        if self._enable_cuda_graph:
            self._all_logits_cuda[:, :logits_seq_len, :].copy_(logits[:, :logits_seq_len, :])
        else:
            self._all_logits_cuda = logits

    def step(self, requests):
        k1 = NUM_SPECULATIVE_TOKENS + 1
        decode = [r for r in requests if r.prefilled]
        prefill = [r for r in requests if not r.prefilled]
        token_ids, position_ids, query_lengths = [], [], []
        for r in decode:                                            # [last sampled token, MTP draft]
            token_ids += [r.tokens[-1], r.pending_draft]
            position_ids += [len(r.tokens) - 1, len(r.tokens)]
            query_lengths.append(k1)
        for r in prefill:
            token_ids += r.tokens
            position_ids += list(range(len(r.tokens)))
            query_lengths.append(len(r.tokens))
        context = self.context
        context.set_step(token_ids, position_ids, query_lengths, len(prefill))
        context.initialize_attention_state()
        self._dynamic_step_forward_logits()
        # Verification and sampling (greedy) on the required rows: k+1 per decode request, 1 per prefill request.
        num_required = len(decode) * k1 + len(prefill)
        required_logits = self._all_logits_cuda.squeeze(0)[:num_required].clone()
        output_tokens = required_logits.argmax(-1).tolist()
        sampled = []
        for i, r in enumerate(decode):
            base = output_tokens[i * k1]
            new = [base, output_tokens[i * k1 + 1]] if base == r.pending_draft else [base]
            r.tokens += new
            sampled.append(new[-1])
        for j, r in enumerate(prefill):
            r.tokens.append(output_tokens[len(decode) * k1 + j])
            r.prefilled = True
            sampled.append(r.tokens[-1])
        drafts = self.model.mtp_draft(torch.tensor(sampled, device=self.device)).tolist()
        for r, d in zip(decode + prefill, drafts):
            r.pending_draft = d
        context.reset()
        return required_logits


def run(variant: str, device: str = "cpu"):
    gen = generator(45521)
    prompts = {name: torch.randint(0, VOCAB, (n,), generator=gen).tolist()
               for name, n in (("A", 5), ("B", 3), ("C", 4), ("D", 2))}
    # step dims: (8,2,0) -> graph (8,4,0); (8,1,2) -> (8,1,3) padded decode; (6,0,3) -> (8,0,4);
    #            (8,1,3) -> (8,1,3) exact; (8,0,4) -> (8,0,4)
    arrivals = [["A", "B"], ["C"], [], ["D"], []]

    def serve(use_cuda_graphs):
        engine = DynamicInferenceEngine(variant, device, use_cuda_graphs)
        active, outs = [], []
        for new in arrivals:
            active += [Request(name, prompts[name]) for name in new]
            outs.append(engine.step(active))
        generated = [(r.tokens[r.prompt_len:] + [-1] * 12)[:12] for r in active]
        outs.append(torch.tensor(generated, dtype=torch.float32))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
