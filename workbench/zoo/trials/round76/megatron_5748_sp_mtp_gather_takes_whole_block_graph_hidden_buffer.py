"""Serial MTP under SP all-gathers each rank's whole ``max_tokens`` block-graph hidden buffer: rank 1's tokens read rank 0's stale tail.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5748 ("Fixes for SP + MTP all-gathers", merged 2026-08-11,
commit 8018459d73). The bug came in with #4950 ("Add full model cuda graph support for MTP inference", commit
1cfa834a8d), which added the persistent buffer. The PR's other part (``barrier_before`` on the NVLS multimem
all-gather, a cross-rank symmetric-buffer race) is not modelled.
Symptom: with MTP speculative decoding, tensor parallelism with sequence parallelism, and block-scope inference
CUDA graphs, the MTP heads draft from the wrong decoder hidden state for every request whose last accepted token
lies outside rank 0's sequence shard. Drafts are wrong and the acceptance rate collapses. Nothing crashes, and the
greedy output tokens are unchanged (speculative decoding stays lossless). Eager runs and the other graph scopes are
correct.
Mechanism: with ``inference_cuda_graph_scope == block``, ``DynamicInferenceContext.initialize_all_tensors``
(dynamic_context.py) allocates ``mtp_decoder_hidden_states`` as a persistent ``[max_tokens, 1, hidden]`` buffer:
"the Python assignment in forward() runs only during graph capture ... Sized to max_tokens; only
[:actual_tokens] is valid each step". ``GPTModel._postprocess`` (gpt_model.py) ``copy_``s each step's decoder
output, which is this rank's SP shard ``[S/TP, 1, H]``, into the buffer's prefix. Otherwise it assigns the tensor
itself. ``TextGenerationController._compute_serial_mtp_and_sample`` (text_generation_controller.py) runs eagerly
after verification. It takes ``context.mtp_decoder_hidden_states`` as this rank's shard and all-gathers it with
``gather_from_sequence_parallel_region``, then indexes the result with ``_last_accepted_seq_indices``. Those are
indices into the full sequence, where rank r's tokens sit at ``r*S/TP + i``. Under block scope the gathered
tensor is ``TP*max_tokens`` rows and rank r's shard starts at ``r*max_tokens``. So indices meant for rank 1's
tokens land in rank 0's rows past its valid prefix. Those rows hold hidden states of earlier, larger steps (or
rows that were never written).
Doctor: stale-padding, at _compute_serial_mtp_and_sample (the real draft tokens depend on what the persistent
buffer's rows past this step's valid prefix hold. The step left those rows as they were, and they are padding of
the ``max_tokens`` allocation. The fix changed code only in this function, where the whole buffer is handed to the
all-gather instead of its valid ``[:padded_active_token_count // tp]`` prefix).
Fix (upstream): under block scope, ``_compute_serial_mtp_and_sample`` first slices ``hidden_states`` to
``context.padded_active_token_count`` (divided by ``tp_size`` under SP, with an assert that it divides) and then
gathers.
Modelled: TP = 2 ranks in one process. Each rank has its own ``DynamicInferenceContext`` (static token and position
buffers, plus the persistent MTP buffer) and its own graphs. Model weights are not sharded: each rank holds all of
them and computes its own SP shard of the tokens. The decoder is a per-token MLP (no attention and no KV cache).
The output layer gives local logits, and the controller gathers them outside the graph; upstream gathers inside
the output layer. One block-scope graph is captured per decode batch size (1, 2 or 4 requests; 2, 4 or 8 tokens).
The captured region is the model forward, including the ``_postprocess`` ``copy_``. The prefill step runs eagerly,
and under block scope it still ``copy_``s into the buffer. There is one speculative token and one MTP depth with
greedy sampling. The MTP head has random weights, so acceptance is low in eager runs too: the bug shows as wrong
drafts (and a changed acceptance count where a draft would have matched), not as a collapse of a high rate.
The MTP forward runs eagerly on the gathered rows, without the SP scatter, padding or MTP graphs.
The buffer is ``torch.zeros`` where upstream uses ``torch.empty``, so that rows never written are deterministic.
Requests that finish are dropped, and there are no paused requests or pipeline stages.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5748"
FAMILY = "under-sized buffers / shape contracts"
KIND = "stale-padding"
SITE = "_compute_serial_mtp_and_sample"
SYMPTOM = ("MTP + sequence parallel + block-scope CUDA graphs: the SP all-gather of the whole max_tokens hidden-states "
           "buffer puts rank 0's stale tail where rank 1's shard belongs; wrong MTP drafts, acceptance collapses")

TP_SIZE = 2
VOCAB, HIDDEN, MAX_POS = 16, 8, 32
MAX_REQUESTS, MAX_TOKENS = 4, 16
NUM_SPECULATIVE_TOKENS = 1
CUDA_GRAPH_DECODE_REQUEST_COUNTS = [4, 2, 1]       # decode-only block graphs, 2 tokens per request


class InferenceCudaGraphScope(enum.Enum):
    none = 1
    layer = 2
    block = 3


def round_up_to_nearest_multiple(value, multiple):
    return multiple * -(-value // multiple)


# --- megatron/core/tensor_parallel/mappings.py (the TP group modelled as a list of per-rank tensors) -----------

def gather_from_sequence_parallel_region(rank_inputs):
    """All-gather along the sequence dimension: rank r's whole input lands after ranks 0..r-1's whole inputs."""
    return torch.cat(list(rank_inputs), dim=0)


def scatter_to_sequence_parallel_region(input_, rank):
    local = input_.shape[0] // TP_SIZE
    return input_[rank * local:(rank + 1) * local]


# --- megatron/core/inference/batch_dimensions_utils.py ------------------------------------------------------

class InferenceBatchDimensions(NamedTuple):
    token_count: int = 0
    prefill_req_count: int = 0
    decode_req_count: int = 0


# --- megatron/core/inference/contexts/dynamic_context.py ----------------------------------------------------

class DynamicInferenceContext:
    """One TP rank's context. Every rank holds the whole step's token ids and positions."""

    def __init__(self, rank, device, inference_cuda_graph_scope):
        self.rank, self.device = rank, device
        self.inference_cuda_graph_scope = inference_cuda_graph_scope
        self.max_tokens = MAX_TOKENS
        self.num_speculative_tokens = NUM_SPECULATIVE_TOKENS
        self.token_to_input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.token_to_pos_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.cuda_graph_batch_dimensions_list = (
            [InferenceBatchDimensions(r * (NUM_SPECULATIVE_TOKENS + 1), 0, r) for r in CUDA_GRAPH_DECODE_REQUEST_COUNTS]
            if inference_cuda_graph_scope == InferenceCudaGraphScope.block else [])
        self.mtp_decoder_hidden_states = None
        self.initialize_all_tensors()

    def initialize_all_tensors(self):
        # MTP speculative decoding: persistent buffer for decoder hidden states.
        # Only needed for block-scope CUDA graphs, where the Python assignment in
        # forward() runs only during graph capture. Using copy_() into a fixed
        # buffer ensures every batch-size graph replay writes to the same GPU
        # address. Sized to max_tokens; only [:actual_tokens] is valid each step.
        if self.num_speculative_tokens > 0 and self.inference_cuda_graph_scope == InferenceCudaGraphScope.block:
            # upstream: torch.empty (zeros here so that never-written rows are deterministic)
            self.mtp_decoder_hidden_states = torch.zeros(self.max_tokens, 1, HIDDEN, device=self.device)

    def initialize_attention_state(self, token_ids, position_ids, num_prefill, num_decode, *,
                                   construct_graph_dimensions=None):
        if construct_graph_dimensions is not None:              # dummy decode requests for capture
            token_ids = position_ids = [0] * construct_graph_dimensions.token_count
            num_prefill, num_decode = 0, construct_graph_dimensions.decode_req_count
        self.active_token_count = len(token_ids)
        self.num_prefill_requests, self.num_decode_requests = num_prefill, num_decode
        best = None
        if num_prefill == 0:
            fits = [d for d in self.cuda_graph_batch_dimensions_list
                    if d.decode_req_count >= num_decode and d.token_count >= self.active_token_count]
            best = min(fits) if fits else None
        self._using_cuda_graph_this_step = best is not None
        if best is not None:
            self.padded_batch_dimensions = best
        else:                                                   # eager: pad only for SP alignment
            self.padded_batch_dimensions = InferenceBatchDimensions(
                round_up_to_nearest_multiple(self.active_token_count, TP_SIZE), num_prefill, num_decode)
        self.padded_active_token_count = self.padded_batch_dimensions.token_count
        n, p = self.active_token_count, self.padded_active_token_count
        self.token_to_input_ids[:n].copy_(torch.tensor(token_ids, dtype=torch.long))
        self.token_to_pos_ids[:n].copy_(torch.tensor(position_ids, dtype=torch.long))
        self.token_to_input_ids[n:p] = 0                        # pad_active_slices: padded tokens read id 0
        self.token_to_pos_ids[n:p] = 0

    def current_input_and_position_ids(self):
        return (self.token_to_input_ids[:self.padded_active_token_count],
                self.token_to_pos_ids[:self.padded_active_token_count])

    def using_cuda_graph_this_step(self):
        return self._using_cuda_graph_this_step


# --- megatron/core/models/gpt/gpt_model.py --------------------------------------------------------------------

class GPTModel:
    def __init__(self, rank, device, inference_cuda_graph_scope):
        self.rank = rank
        self.inference_cuda_graph_scope = inference_cuda_graph_scope
        gen = generator(5748)                                   # every TP rank holds the same weights
        self.word_embeddings = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.position_embeddings = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_fc1 = randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_fc2 = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.output_weight = randn(HIDDEN, VOCAB, gen=gen, device=device)
        # mtp: MultiTokenPredictionLayer (eh_proj over [norm(hidden), norm(embedding)], one MLP)
        self.mtp_eh_proj = torch.cat([randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=1.5),     # hidden half
                                      randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)])    # embedding half
        self.mtp_fc = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)

    def embedding(self, input_ids, position_ids):
        return (self.word_embeddings[input_ids] + self.position_embeddings[position_ids]).unsqueeze(1)  # [S,1,H]

    def decoder(self, hidden_states):
        return hidden_states + torch.tanh(hidden_states @ self.w_fc1) @ self.w_fc2

    def forward(self, input_ids, position_ids, inference_context):
        decoder_input = scatter_to_sequence_parallel_region(self.embedding(input_ids, position_ids), self.rank)
        hidden_states = self.decoder(decoder_input)             # this rank's SP shard [S/TP, 1, H]
        return self._postprocess(hidden_states, inference_context)

    def _postprocess(self, hidden_states, inference_context):
        # Cache decoder hidden states for serial MTP computation after speculative token verification.
        if self.inference_cuda_graph_scope == InferenceCudaGraphScope.block:
            assert inference_context.mtp_decoder_hidden_states is not None
            inference_context.mtp_decoder_hidden_states[: hidden_states.shape[0]].copy_(hidden_states)
        else:
            inference_context.mtp_decoder_hidden_states = hidden_states
        return (hidden_states @ self.output_weight).squeeze(1)  # local logits [S/TP, V]

    def compute_mtp_single_step(self, hidden_states, next_token_ids, position_ids):
        emb = self.embedding(next_token_ids, position_ids)
        norm = lambda x: x / x.norm(dim=-1, keepdim=True).clamp(min=1e-6)   # noqa: E731
        h = torch.cat([norm(hidden_states), norm(emb)], dim=-1) @ self.mtp_eh_proj
        h = h + torch.tanh(h @ self.mtp_fc)
        return h, h @ self.output_weight                        # [A,1,H], [A,1,V]


# --- megatron/core/inference/text_generation_controllers/text_generation_controller.py -------------------------

class TextGenerationController:
    def __init__(self, variant, models, contexts):
        self.variant = variant
        self.models, self.contexts = models, contexts           # index = TP rank
        self._tp_size = TP_SIZE
        self._sp_enabled = True
        self.num_speculative_tokens = NUM_SPECULATIVE_TOKENS
        self.cuda_graphs = [dict() for _ in contexts]           # rank -> {batch dims: (graph, logits)}
        self._last_accepted_seq_indices = None
        self._sampled_tokens_cuda = None

    def _dynamic_step_forward_logits(self):
        """Every rank runs its forward (a block graph replay, or eagerly); the local logits are gathered."""
        rank_logits = []
        for rank, (model, context) in enumerate(zip(self.models, self.contexts)):
            if context.using_cuda_graph_this_step():
                g, out = self.cuda_graphs[rank][context.padded_batch_dimensions]
                local = context.padded_active_token_count // self._tp_size
                real = min(max(context.active_token_count - rank * local, 0), local)
                rank_logits.append(replay(g, out, real=real, size=local).clone())
            else:
                rank_logits.append(model.forward(*context.current_input_and_position_ids(), context))
        return gather_from_sequence_parallel_region(rank_logits)  # [padded S, V]

    def _dynamic_step_sample_logits_and_verify_tokens(self, logits, requests, step_inputs):
        """Greedy sampling of every required row, then verification of each decode request's draft."""
        output_tokens = logits.argmax(-1).tolist()
        last_accepted, sampled, accepted_counts = [], [], []
        for req, (start, n, is_prefill) in zip(requests, step_inputs):
            if is_prefill:
                new, last = [output_tokens[start + n - 1]], start + n - 1
            else:                                               # input [last token, draft]
                draft = req.pending_draft
                if draft == output_tokens[start]:
                    new, last = [output_tokens[start], output_tokens[start + 1]], start + 1
                else:
                    new, last = [output_tokens[start]], start
            accepted_counts.append(len(new) - 1)
            req.tokens += new
            last_accepted.append(last)
            sampled.append(new[-1])
        dev = logits.device
        self._last_accepted_seq_indices = torch.tensor(last_accepted, dtype=torch.long, device=dev)
        self._sampled_tokens_cuda = torch.tensor(sampled, dtype=torch.long, device=dev)
        return accepted_counts

    def _compute_serial_mtp_and_sample(self, base_position):
        """Compute MTP logits serially after verification and sample speculative tokens."""
        # Every TP rank runs this method; the rank-local part is looped over the ranks, then one all-gather.
        rank_hidden_states = []
        for context in self.contexts:
            # Get decoder hidden states at last accepted positions.
            hidden_states = context.mtp_decoder_hidden_states
            if self.variant == "fix":
                # Block-scope CUDA graphs write into a persistent max_tokens-sized
                # buffer. Only the prefix for this step is valid. Slice each rank's
                # local SP shard before gathering; gathering the oversized buffer
                # would place rank 0's stale tail between the valid rank shards.
                if context.inference_cuda_graph_scope == InferenceCudaGraphScope.block:
                    local_token_count = context.padded_active_token_count
                    if self._sp_enabled:
                        assert local_token_count % self._tp_size == 0
                        local_token_count //= self._tp_size
                    hidden_states = hidden_states[:local_token_count]
            rank_hidden_states.append(hidden_states)
        # When SP is active the decoder output is in scattered format [S/TP, B, H], but
        # _last_accepted_seq_indices are indices into the full (gathered) sequence.
        hidden_states = gather_from_sequence_parallel_region(rank_hidden_states)
        last_accepted_hidden = hidden_states[self._last_accepted_seq_indices, :, :]
        next_token_ids = self._sampled_tokens_cuda.clone()
        _, mtp_logits = self.models[0].compute_mtp_single_step(last_accepted_hidden, next_token_ids, base_position)
        spec_tokens = mtp_logits.squeeze(1).argmax(-1)
        for context in self.contexts:
            if context.inference_cuda_graph_scope != InferenceCudaGraphScope.block:
                context.mtp_decoder_hidden_states = None
        return spec_tokens.tolist()


# --- megatron/core/inference/engines/dynamic_engine.py ----------------------------------------------------------

class Request:
    def __init__(self, request_id, prompt, max_new):
        self.request_id, self.tokens, self.prompt_len, self.max_new = request_id, list(prompt), len(prompt), max_new
        self.pending_draft, self.drafts, self.accepted = None, [], 0
        self.prefilled = False

    def generated(self):
        return self.tokens[self.prompt_len:self.prompt_len + self.max_new]


class DynamicInferenceEngine:
    def __init__(self, variant, device, use_cuda_graphs):
        scope = InferenceCudaGraphScope.block if use_cuda_graphs else InferenceCudaGraphScope.none
        self.device = device
        self.contexts = [DynamicInferenceContext(r, device, scope) for r in range(TP_SIZE)]
        self.models = [GPTModel(r, device, scope) for r in range(TP_SIZE)]
        self.controller = TextGenerationController(variant, self.models, self.contexts)
        if use_cuda_graphs:
            self.create_cuda_graphs()

    def create_cuda_graphs(self):
        for rank, (model, context) in enumerate(zip(self.models, self.contexts)):
            pool = graph_pool_handle(self.device)
            for dims in sorted(context.cuda_graph_batch_dimensions_list, reverse=True):
                context.initialize_attention_state(None, None, 0, 0, construct_graph_dimensions=dims)
                ids, pos = context.current_input_and_position_ids()
                self.controller.cuda_graphs[rank][dims] = capture(
                    lambda m=model, c=context, i=ids, p=pos: m.forward(i, p, c), device=self.device, pool=pool,
                    name=f"rank{rank} block decode_req={dims.decode_req_count}",
                    owner="CudaGraphManager (block scope)",
                    static={"token_to_input_ids": context.token_to_input_ids,
                            "token_to_pos_ids": context.token_to_pos_ids})

    def step(self, requests):
        token_ids, position_ids, step_inputs = [], [], []
        num_prefill = sum(not r.prefilled for r in requests)
        for req in requests:
            start = len(token_ids)
            if not req.prefilled:
                token_ids += req.tokens
                position_ids += list(range(len(req.tokens)))
            else:
                token_ids += [req.tokens[-1], req.pending_draft]
                position_ids += [len(req.tokens) - 1, len(req.tokens)]
            step_inputs.append((start, len(token_ids) - start, not req.prefilled))
        for context in self.contexts:
            context.initialize_attention_state(token_ids, position_ids, num_prefill, len(requests) - num_prefill)
        ctrl = self.controller
        logits = ctrl._dynamic_step_forward_logits()
        accepted = ctrl._dynamic_step_sample_logits_and_verify_tokens(logits, requests, step_inputs)
        base_position = torch.tensor([len(r.tokens) - 1 for r in requests], dtype=torch.long, device=self.device)
        drafts = ctrl._compute_serial_mtp_and_sample(base_position)
        for req, draft, acc in zip(requests, drafts, accepted):
            req.prefilled = True
            req.accepted += acc
            req.pending_draft = draft
            req.drafts.append(draft)

    def generate(self, prompts, max_new):
        reqs = [Request(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_new))]
        active = list(reqs)
        while active:
            self.step(active)
            active = [r for r in active if len(r.tokens) - r.prompt_len < r.max_new]
        out = []
        for r in reqs:
            out += [torch.tensor(r.generated(), dtype=torch.float64), torch.tensor(r.drafts, dtype=torch.float64),
                    torch.tensor([r.accepted], dtype=torch.float64)]
        return out


def run(variant: str, device: str = "cpu"):
    gen = generator(57480)
    prompt_lens = [3, 2, 4, 3]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    max_new = [3, 10, 6, 8]                 # the decode batch shrinks 4 -> 3 -> 2 -> 1 requests
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: DynamicInferenceEngine(variant, device, True).generate(prompts, max_new),
                   lambda: DynamicInferenceEngine(variant, device, False).generate(prompts, max_new))
