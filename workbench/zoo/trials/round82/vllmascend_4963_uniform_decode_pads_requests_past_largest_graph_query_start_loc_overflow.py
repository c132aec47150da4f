"""FULL decode ACL graphs + DP: a uniform-decode step whose DP-synced token count exceeds every graph is still padded to requests that do not fit ``query_start_loc``.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/4963 ("[Fix] Fixes issues in MTP with async scheduling and
ACL graph", vllm-project/vllm-ascend, commit 0686b32d82, merged 2025-12-14); follow-up
https://github.com/vllm-project/vllm-ascend/pull/5164 (commit ff3914e31a, 2025-12-18) corrects the bound.
Symptom: with MTP (uniform decode query length 1 + num_speculative_tokens) and a FULL decode ACL graph mode under
data parallelism, a step raises an out-of-bounds / size-mismatch error in ``_prepare_inputs`` when the local rank is
in uniform decode while another DP rank schedules more tokens than the largest captured graph (a prefill). The PR:
"prevents padding when the number of input tokens exceeds the maximum ACL graph batch size to avoid out-of-bounds
errors". Eager mode (no FULL decode graphs) never pads requests and runs the same schedule.
Mechanism: ``NPUModelRunner._prepare_inputs`` (``vllm_ascend/worker/model_runner_v1.py``) sets
``num_input_tokens = vllm_config.pad_for_cudagraph(total_num_scheduled_tokens)`` if the step fits
``cudagraph_batch_sizes[-1]`` (else the raw count), then ``_sync_metadata_across_dp`` replaces it with the maximum
over the DP ranks (a CPU all_reduce). Later, to imitate the GPU runner's uniform-decode request padding for the FULL
graphs, ``if cudagraph_mode.decode_mode() == FULL and uniform_decode:`` it computes ``num_reqs_padded =
num_input_tokens // uniform_decode_query_len`` and writes the padded requests' cumulative query ends into the
persistent ``self.query_start_loc.gpu[num_reqs + 1:num_reqs_padded + 1]`` (a buffer of ``max_num_reqs + 1``), then
slices ``seq_lens``/``block_table_tensor`` to ``num_reqs_padded``. ``uniform_decode`` is judged on the local batch,
but ``num_input_tokens`` is the DP maximum: when a peer's prefill makes it larger than any captured graph (so the
dispatcher will run this step without a graph anyway), ``num_reqs_padded`` exceeds ``max_num_reqs`` and the padded
requests do not fit the per-request buffers the FULL graphs were captured on.
Doctor: undersized-buffer, at ``_prepare_inputs`` (it decides to pad the step to ``num_input_tokens //
uniform_decode_query_len`` requests, more than the persistent ``query_start_loc`` / ``seq_lens`` / block-table
buffers hold and more than any captured graph serves; this is the condition the upstream diff bounds).
Fix (upstream, #4963): the condition becomes ``... and uniform_decode and num_input_tokens <=
self.cudagraph_batch_sizes[-1]``: a step beyond the largest graph is not padded (it runs eagerly at its own request
count). #5164 later replaced the bound by ``uniform_decode_query_len <= num_input_tokens <= max_num_seqs *
uniform_decode_query_len`` because in FULL_DECODE_ONLY ``cudagraph_batch_sizes[-1]`` is the untrimmed capture list's
maximum, larger than the decode graphs actually captured; with capture sizes that end at ``max_num_seqs *
uniform_decode_query_len`` (as here) the two bounds agree, so the first fix is modelled.
Modelled: one attention layer over a paged KV cache that already holds every position's K/V (the cache write and
``slot_mapping`` are left out); ``npu_fused_infer_attention_score`` is a stand-in doing TND decode attention from
``actual_seq_lengths`` (cumulative query ends, ``query_start_loc[1:]``) and ``actual_seq_lengths_kv`` (``seq_lens``);
a request of length 0 (a padded one) attends to stale table entries and its rows are never read. MTP with one
speculative token gives ``uniform_decode_query_len = 2``; every draft is taken as accepted (each decode step adds 2
to a request's length), sampling is not modelled (the step's real-token logits are the output). DP is one peer rank
whose token counts are given per step; ``dist.all_reduce`` is a stand-in taking the maximum. FULL decode graphs at
4 and 8 tokens (``max_num_seqs`` = 4) are captured by ``_dummy_run``. The MTP-drafter half of #4963 (slicing
``seq_lens_list``/``block_table`` to ``actual_seq_lengths_q`` under async scheduling) and its
``token_indices_to_sample`` change are left out.
Workload: decode steps with 3, 2, 4, 4 local requests; the peer schedules 6, 7, 20 (a prefill) and 2 tokens. Step 2:
local uniform decode of 8 tokens, DP maximum 20 > 8: the bug pads to 10 requests (``query_start_loc`` holds 5
entries) and raises; the fix runs the step eagerly at 4 requests.
"""
from __future__ import annotations

import enum
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/4963"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_prepare_inputs"
SYMPTOM = ("MTP + FULL decode ACL graphs + DP: a uniform-decode step whose DP-synced token count exceeds the largest "
           "graph is padded to num_input_tokens // query_len requests, past query_start_loc; out-of-bounds error")

VOCAB, HIDDEN = 16, 8
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 4, 4, 17          # block 0: the null block
MAX_NUM_SEQS = 4
NUM_SPECULATIVE_TOKENS = 1
UNIFORM_DECODE_QUERY_LEN = 1 + NUM_SPECULATIVE_TOKENS
MAX_NUM_TOKENS = 32
CUDAGRAPH_CAPTURE_SIZES = [4, 8]                       # multiples of the query length, up to max_num_seqs * 2


class CUDAGraphMode(enum.Enum):
    NONE = 0
    FULL = 2

    def decode_mode(self):
        return self


# --- the model ------------------------------------------------------------------------------------------------

class Model:
    def __init__(self, device):
        gen = generator(4963)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embed_positions = randn(BLOCK_SIZE * MAX_BLOCKS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(2))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)


class AscendMetadata:
    def __init__(self, num_reqs, num_input_tokens, actual_seq_lengths_q, seq_lens, block_table):
        self.num_reqs = num_reqs
        self.num_input_tokens = num_input_tokens
        self.actual_seq_lengths_q = actual_seq_lengths_q      # query_start_loc[1:num_reqs + 1]
        self.seq_lens = seq_lens
        self.block_table = block_table


def npu_fused_infer_attention_score(query, key_cache, value_cache, block_table, actual_seq_lengths,
                                    actual_seq_lengths_kv):
    """TND decode FIA, uniform query length: request r's queries end at ``actual_seq_lengths[r]`` and are the last
    positions of its ``actual_seq_lengths_kv[r]`` cached tokens (bottom-right causal)."""
    ends = actual_seq_lengths.long()
    lens = actual_seq_lengths_kv.long()
    q_off = torch.arange(UNIFORM_DECODE_QUERY_LEN, device=query.device)
    tok = ends[:, None] - UNIFORM_DECODE_QUERY_LEN + q_off                          # [R, Q]
    q_pos = lens[:, None] - UNIFORM_DECODE_QUERY_LEN + q_off
    j = torch.arange(BLOCK_SIZE * MAX_BLOCKS, device=query.device)
    slots = block_table.long()[:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE     # [R, J]
    k, v = key_cache[slots], value_cache[slots]
    q = query[tok]                                                                   # [R, Q, H]
    scores = torch.einsum("rqh,rjh->rqj", q, k) / math.sqrt(HIDDEN)
    valid = j[None, None, :] <= q_pos[:, :, None]
    probs = torch.softmax(scores.masked_fill(~valid, -1e9), -1)
    out = torch.zeros_like(query)
    out.index_copy_(0, tok.reshape(-1), torch.einsum("rqj,rjh->rqh", probs, v).reshape(-1, HIDDEN))
    return out


def model_forward(model, input_ids, positions, attn_metadata, kv_cache):
    h = model.embed_tokens[input_ids] + model.embed_positions[positions]
    attn = npu_fused_infer_attention_score(h @ model.wq, kv_cache[0], kv_cache[1], attn_metadata.block_table,
                                           attn_metadata.actual_seq_lengths_q, attn_metadata.seq_lens)
    h = h + torch.tanh(attn @ model.wo)
    return h @ model.lm_head


# --- stand-ins: CpuGpuBuffer, the DP group, the dispatcher --------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, n, dtype, device):
        self.cpu = torch.zeros(n, dtype=dtype)
        self.gpu = torch.zeros(n, dtype=dtype, device=device)

    def copy_to_gpu(self):
        self.gpu.copy_(self.cpu)


class dist:
    """``torch.distributed`` over the DP CPU group: this rank and one peer."""
    peer_contribution: list = [0, 0]

    @classmethod
    def all_reduce(cls, packed_tensor, dp_rank):
        peer = torch.zeros_like(packed_tensor)
        peer[1 - dp_rank], peer[-1] = cls.peer_contribution
        packed_tensor += peer


class CudagraphDispatcher:
    def __init__(self, mode):
        self.mode, self.keys = mode, set()

    def initialize_cudagraph_keys(self, sizes):
        if self.mode == CUDAGraphMode.FULL:
            self.keys = set(sizes)

    def dispatch(self, num_tokens, uniform_decode):
        if uniform_decode and num_tokens in self.keys:
            return CUDAGraphMode.FULL, num_tokens
        return CUDAGraphMode.NONE, None


# --- vllm_ascend/worker/model_runner_v1.py (reduced) ---------------------------------------------------------

class NPUModelRunner:
    def __init__(self, model, device, cudagraph_mode, variant, kv_cache):
        self.model, self.device, self.variant, self.kv_cache = model, device, variant, kv_cache
        self.cudagraph_mode = cudagraph_mode
        self.use_aclgraph = cudagraph_mode != CUDAGraphMode.NONE
        self.dp_size, self.dp_rank = 2, 0
        self.max_num_reqs = MAX_NUM_SEQS
        self.uniform_decode_query_len = UNIFORM_DECODE_QUERY_LEN
        self.cudagraph_batch_sizes = CUDAGRAPH_CAPTURE_SIZES if self.use_aclgraph else []
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = CpuGpuBuffer(MAX_NUM_TOKENS, torch.long, device)
        self.query_start_loc = CpuGpuBuffer(self.max_num_reqs + 1, torch.int32, device)
        self.seq_lens = CpuGpuBuffer(self.max_num_reqs, torch.int32, device)
        self.block_table = torch.zeros(self.max_num_reqs, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.cudagraph_dispatcher = CudagraphDispatcher(cudagraph_mode)
        self.graphs = {}

    def pad_for_cudagraph(self, num_tokens):
        return next(b for b in self.cudagraph_batch_sizes if b >= num_tokens)

    def _sync_metadata_across_dp(self, num_tokens, with_prefill):
        num_tokens_tensor = torch.tensor([num_tokens if i == self.dp_rank else 0 for i in range(self.dp_size)],
                                         dtype=torch.int32)
        flags_tensor = torch.tensor([int(with_prefill)], dtype=torch.int32)
        packed_tensor = torch.cat([num_tokens_tensor, flags_tensor])
        dist.all_reduce(packed_tensor, self.dp_rank)
        num_tokens_across_dp = packed_tensor[:-1]
        max_tokens_across_dp = int(torch.max(num_tokens_across_dp).item())
        return max_tokens_across_dp, num_tokens_across_dp, bool(packed_tensor[-1])

    def _build_attn_metadata(self, num_reqs, num_input_tokens):
        # AscendCommonAttentionMetadata -> AscendAttentionMetadataBuilder.build
        return AscendMetadata(num_reqs, num_input_tokens, self.query_start_loc.gpu[1:num_reqs + 1],
                              self.seq_lens.gpu[:num_reqs], self.block_table[:num_reqs])

    def _prepare_inputs(self, scheduler_output):
        reqs = scheduler_output["reqs"]                  # (token ids, num_computed_tokens, block ids) per request
        num_reqs = len(reqs)
        num_scheduled_tokens = [len(t) for t, _, _ in reqs]
        total_num_scheduled_tokens = sum(num_scheduled_tokens)
        max_num_scheduled_tokens = max(num_scheduled_tokens)

        if self.use_aclgraph and total_num_scheduled_tokens <= self.cudagraph_batch_sizes[-1]:
            # Add padding to the batch size.
            num_input_tokens = self.pad_for_cudagraph(total_num_scheduled_tokens)
        else:
            # Eager mode.
            num_input_tokens = total_num_scheduled_tokens
        with_prefill = max_num_scheduled_tokens > self.uniform_decode_query_len
        (maybe_padded_num_tokens, num_tokens_across_dp,
         with_prefill) = self._sync_metadata_across_dp(num_input_tokens, with_prefill)
        num_input_tokens = maybe_padded_num_tokens

        cu_num_tokens = torch.tensor(num_scheduled_tokens).cumsum(0)
        self.query_start_loc.cpu[0] = 0
        self.query_start_loc.cpu[1:num_reqs + 1] = cu_num_tokens
        self.query_start_loc.copy_to_gpu()
        self.seq_lens.cpu[:num_reqs] = torch.tensor([c + n for (_, c, _), n in zip(reqs, num_scheduled_tokens)])
        self.seq_lens.copy_to_gpu()
        # Fill unused with -1. Needed for reshape_and_cache
        self.query_start_loc.gpu[num_reqs + 1:].fill_(-1)
        self.seq_lens.gpu[num_reqs:].fill_(0)
        self.block_table[:num_reqs].copy_(torch.tensor([b for _, _, b in reqs], dtype=torch.int32))
        self.input_ids[:total_num_scheduled_tokens].copy_(torch.tensor([x for t, _, _ in reqs for x in t]))
        self.positions.cpu[:total_num_scheduled_tokens] = torch.tensor(
            [c + i for t, c, _ in reqs for i in range(len(t))])
        self.positions.cpu[total_num_scheduled_tokens:num_input_tokens].zero_()
        self.positions.copy_to_gpu()

        uniform_decode = (max_num_scheduled_tokens == self.uniform_decode_query_len) \
            and (total_num_scheduled_tokens == max_num_scheduled_tokens * num_reqs)
        # TODO: We should make this official ASAP. Also note that if we pad here,
        # the builders won't need to add any extra padding.
        if self.variant == "fix":
            pad_requests = self.cudagraph_mode.decode_mode() == CUDAGraphMode.FULL and \
                uniform_decode and num_input_tokens <= self.cudagraph_batch_sizes[-1]
        else:
            pad_requests = self.cudagraph_mode.decode_mode() == CUDAGraphMode.FULL and uniform_decode
        if pad_requests:
            num_reqs_padded = num_input_tokens // self.uniform_decode_query_len
            pad_size = num_reqs_padded - num_reqs
            if pad_size > 0:
                last_query_loc = self.query_start_loc.gpu[num_reqs]
                steps = torch.arange(1, pad_size + 1, device=self.device, dtype=self.query_start_loc.gpu.dtype)
                fill_values = last_query_loc + (steps * self.uniform_decode_query_len)
                self.query_start_loc.gpu[num_reqs + 1:num_reqs_padded + 1] = fill_values
            # So we are trying to simulate the behavior of GPUModelRunner's
            # prepare_inputs for uniform decode mode by padding query_start_loc
            num_reqs = num_reqs_padded

        attn_metadata = self._build_attn_metadata(num_reqs, num_input_tokens)
        return attn_metadata, num_input_tokens, total_num_scheduled_tokens, uniform_decode

    def _dummy_run(self, num_tokens):
        """Capture of a FULL uniform-decode graph at ``num_tokens`` (dummy metadata in the persistent buffers)."""
        num_reqs = num_tokens // self.uniform_decode_query_len
        self.query_start_loc.gpu[:num_reqs + 1].copy_(
            torch.arange(num_reqs + 1, dtype=torch.int32) * self.uniform_decode_query_len)
        self.seq_lens.gpu[:num_reqs].fill_(self.uniform_decode_query_len)
        self.block_table[:num_reqs].zero_()
        attn_metadata = self._build_attn_metadata(num_reqs, num_tokens)
        input_ids, positions = self.input_ids[:num_tokens], self.positions.gpu[:num_tokens]
        self.graphs[num_tokens] = capture(
            lambda: model_forward(self.model, input_ids, positions, attn_metadata, self.kv_cache),
            device=self.device, name=f"FULL uniform decode num_tokens={num_tokens}",
            owner="ACLGraphWrapper (FULL decode)",
            static={"input_ids": self.input_ids, "positions": self.positions.gpu,
                    "query_start_loc": self.query_start_loc.gpu, "seq_lens": self.seq_lens.gpu,
                    "block_table": self.block_table},
            state={"key_cache": self.kv_cache[0], "value_cache": self.kv_cache[1]})

    def capture_model(self):
        self.cudagraph_dispatcher.initialize_cudagraph_keys(self.cudagraph_batch_sizes)
        for num_tokens in reversed(self.cudagraph_batch_sizes):   # the largest batch size first
            self._dummy_run(num_tokens)

    def execute_model(self, scheduler_output):
        attn_metadata, num_input_tokens, num_actual_tokens, uniform_decode = self._prepare_inputs(scheduler_output)
        aclgraph_runtime_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(
            num_tokens=num_input_tokens, uniform_decode=uniform_decode)
        if aclgraph_runtime_mode == CUDAGraphMode.FULL:
            g, out = self.graphs[batch_descriptor]
            logits = replay(g, out, real=num_actual_tokens, size=num_input_tokens,
                            padded={"input_ids": self.input_ids})
        else:
            logits = model_forward(self.model, self.input_ids[:num_input_tokens],
                                   self.positions.gpu[:num_input_tokens], attn_metadata, self.kv_cache)
        return logits[:num_actual_tokens].clone()


# --- the workload -------------------------------------------------------------------------------------------

PROMPT_LENS = [3, 5, 2, 4]
# (local requests, peer rank's scheduled tokens, peer has a prefill)
SCHEDULE = [([0, 1, 2], 6, False), ([0, 3], 7, False), ([0, 1, 2, 3], 20, True), ([1, 2, 3, 0], 2, False)]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(49630)
    blocks = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).view(-1, MAX_BLOCKS)[:len(PROMPT_LENS)].tolist()
    kv_init = [randn(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, gen=gen, device=device) for _ in range(2)]
    step_tokens = [torch.randint(0, VOCAB, (len(r), UNIFORM_DECODE_QUERY_LEN), generator=gen).tolist()
                   for r, _, _ in SCHEDULE]

    def serve(use_aclgraph: bool):
        mode = CUDAGraphMode.FULL if use_aclgraph else CUDAGraphMode.NONE
        kv_cache = [t.clone() for t in kv_init]          # every position's K/V (prefill not modelled)
        runner = NPUModelRunner(model, device, mode, variant, kv_cache)
        if use_aclgraph:
            runner.capture_model()
        computed = list(PROMPT_LENS)
        outs = []
        for (rows, peer_tokens, peer_prefill), tokens in zip(SCHEDULE, step_tokens):
            # the peer rank pads its own count as this one does (its prefill of 20 exceeds every graph)
            peer = (runner.pad_for_cudagraph(peer_tokens)
                    if use_aclgraph and peer_tokens <= CUDAGRAPH_CAPTURE_SIZES[-1] else peer_tokens)
            dist.peer_contribution = [peer, int(peer_prefill)]
            reqs = [(t, computed[r], blocks[r]) for r, t in zip(rows, tokens)]
            outs.append(runner.execute_model({"reqs": reqs}))
            for r in rows:
                computed[r] += UNIFORM_DECODE_QUERY_LEN
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
