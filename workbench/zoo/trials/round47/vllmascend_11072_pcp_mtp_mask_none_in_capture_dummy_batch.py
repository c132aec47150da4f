"""PCP + MTP FULL_DECODE_ONLY: the warmup dummies have no context, so the verify graph is captured with no MTP mask.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/11072 ("[BugFix] Fix qwen3.5 pcp acc bug", commit
cd6dd7dfbe, merged June 2026).
Symptom: with pcp=2 + MTP (num_spec=3) + FULL_DECODE_ONLY graphs, GPQA-diamond fell from 88% to 72% and about 10%
of greedy generations collapsed into repetition loops; eager mode was correct (after the fix: 86%).
Mechanism (from the diff and the code at its parent): ``PCPManager.generate_pcp_metadata`` builds the MTP-verify
decode mask only ``if cp_size > 1 and speculative_config and self.num_decode_reqs > 0 ...``: it fills the
persistent ``CpuGpuBuffer`` ``self.dcp_mtp_attn_mask`` (``.np[:n] = mask; copy_to_gpu(n)``) and exposes
``self.dcp_mtp_attn_mask.gpu[:n]``; otherwise ``long_seq_metadata.dcp_mtp_attn_mask = None``. ``num_decode_reqs``
comes from ``classify_decode_request_mask`` (decode = has context, ``num_computed_tokens > 0``, ...), and the
warmup/capture dummies have ``num_computed_tokens == 0``: the capture sees ``num_decode_reqs == 0`` (while the
split-based ``num_decodes`` is 2 here) and so a ``None`` mask. ``_forward_decode_pcp_dcp`` records that ``None`` in
``graph_params.attn_params`` and launches the captured FIA task without a mask; ``update_graph_params`` re-launches
each task before a replay with the step's ``actual_seq_lengths_kv`` but the *recorded* ``attn_mask``. So every
replayed verify step lets each of the 4 speculative query positions attend to the later speculative tokens, which
eager steps (real decodes, a real mask) hide.
Modelled: one cp rank (rank 0 of cp_size 2: pcp=2, dcp=1) with its local KV; the other rank and the LSE merge are
left out. The KV cache already holds the step's tokens (the cache write is not modelled).
Doctor: warmup-divergence, at ``generate_pcp_metadata`` (the capture's dummy batch decides "no decode requests, no
mask", a branch the replays keep while eager steps build and pass the mask).
Fix (upstream): the ``num_decode_reqs > 0`` test moved inside: contents are generated and copied only for real
decode requests, but the stable slice ``self.dcp_mtp_attn_mask.gpu[:mask_n]`` (``mask_n = num_decode_reqs`` if > 0
else ``num_reqs``) is always exposed, so the graph captures a tensor that later steps refresh in place.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/11072"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "generate_pcp_metadata"
SYMPTOM = "PCP+MTP verify graph captured without the MTP causal mask: accuracy drop, repetition loops"

NUM_HEADS, HEAD_DIM = 2, 4
HIDDEN = NUM_HEADS * HEAD_DIM
NUM_SPEC = 3
DECODE_THRESHOLD = NUM_SPEC + 1          # query tokens per MTP-verify decode request
PCP_SIZE, DCP_SIZE, PCP_RANK, DCP_RANK = 2, 1, 0, 0
BLOCK_SIZE, MAX_MODEL_LEN = 4, 16
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = 12
MAX_NUM_REQS = 4
NUM_REQS = 2                             # the FULL_DECODE_ONLY bucket: 2 requests x 4 tokens
NUM_TOKENS = NUM_REQS * DECODE_THRESHOLD


class _ExtraCtx:
    capturing = False


_EXTRA_CTX = _ExtraCtx()


class CpuGpuBuffer:
    def __init__(self, shape, dtype, device):
        self.cpu = torch.zeros(shape, dtype=dtype)
        self.np = self.cpu                           # upstream: a numpy view of the same pinned memory
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)

    def copy_to_gpu(self, n):
        self.gpu[:n].copy_(self.cpu[:n])


class LongSeqMetadata:
    num_computed_tokens_of_pcp_dcp = None
    dcp_mtp_attn_mask = None


class PCPManager:
    def __init__(self, device, variant):
        self.variant = variant
        self.pcp_world_size, self.dcp_world_size = PCP_SIZE, DCP_SIZE
        self.pcp_world_rank, self.dcp_world_rank = PCP_RANK, DCP_RANK
        self.speculative_config = True
        self.decode_threshold = DECODE_THRESHOLD
        self.dcp_mtp_attn_mask = CpuGpuBuffer((MAX_NUM_REQS, DECODE_THRESHOLD, MAX_MODEL_LEN), torch.bool, device)
        self.num_decode_reqs = 0

    def classify_decode_request_mask(self, num_scheduled_tokens, num_computed_tokens, num_prompt_tokens,
                                     decode_threshold):
        """decode = has context, scheduled tokens <= threshold, and prompt finished."""
        has_context = num_computed_tokens > 0
        is_below_threshold = num_scheduled_tokens <= decode_threshold
        done_prefilling = num_computed_tokens >= num_prompt_tokens
        return has_context & is_below_threshold & done_prefilling

    def init_batch_info(self, num_scheduled_tokens, num_reqs, num_computed_tokens, num_prompt_tokens):
        self.num_reqs = num_reqs
        self.decode_req_mask = self.classify_decode_request_mask(
            num_scheduled_tokens[:num_reqs], num_computed_tokens[:num_reqs], num_prompt_tokens[:num_reqs],
            self.decode_threshold)
        self.num_decode_reqs = int(self.decode_req_mask.sum())

    def generate_mtp_attention_mask_for_decode(self, decode_num_computed_tokens, decode_num_scheduled_tokens):
        """True = hidden: local key ``k`` is hidden from speculative query ``q`` past its own position."""
        cp_rank = self.pcp_world_rank * self.dcp_world_size + self.dcp_world_rank
        cp_size = self.pcp_world_size * self.dcp_world_size
        q_lens = decode_num_scheduled_tokens[: self.num_decode_reqs].to(torch.int32)
        global_histories = torch.tensor(decode_num_computed_tokens, dtype=torch.int32)
        total_lens = global_histories + q_lens
        context_lens = total_lens - q_lens
        max_indices = total_lens - 1
        valid = max_indices >= cp_rank
        k_lens = torch.div(max_indices - cp_rank, cp_size, rounding_mode="floor") + 1
        k_lens = torch.where(valid, k_lens, torch.zeros_like(k_lens))
        mtp_attn_mask = self.dcp_mtp_attn_mask.cpu[: self.num_decode_reqs]
        mtp_attn_mask.zero_()
        max_q = int(q_lens[valid].max().item())
        max_k = int(k_lens[valid].max().item())
        q_indices = torch.arange(max_q, dtype=torch.int32)
        k_indices = torch.arange(max_k, dtype=torch.int32)
        valid_q = valid[:, None] & (q_indices[None, :] < q_lens[:, None])
        valid_k = valid[:, None] & (k_indices[None, :] < k_lens[:, None])
        k_upper = (context_lens[:, None] + q_indices - cp_rank) // cp_size
        k_upper_expanded = k_upper[:, :, None]
        k_idx_expanded = k_indices[None, None, :]
        full_mask = (k_idx_expanded > k_upper_expanded) & (k_upper_expanded >= 0)
        full_mask = full_mask & (valid_q[:, :, None] & valid_k[:, None, :])
        mtp_attn_mask[: self.num_decode_reqs, :max_q, :max_k] = full_mask
        return mtp_attn_mask

    def generate_pcp_metadata(self, num_reqs, num_scheduled_tokens, num_computed_tokens_cpu):
        long_seq_metadata = LongSeqMetadata()
        # this rank's share of each request's tokens (positions p with p % cp_size == cp_rank)
        cp_size = self.pcp_world_size * self.dcp_world_size
        total = num_computed_tokens_cpu[:num_reqs] + num_scheduled_tokens[:num_reqs]
        long_seq_metadata.num_computed_tokens_of_pcp_dcp = (total + cp_size - 1) // cp_size
        if self.variant == "bug":
            if (self.dcp_world_size * self.pcp_world_size > 1 and self.speculative_config
                    and self.num_decode_reqs > 0 and num_scheduled_tokens is not None):
                decode_num_scheduled_tokens = num_scheduled_tokens[: self.num_decode_reqs]
                decode_num_computed_tokens = num_computed_tokens_cpu[: self.num_decode_reqs].tolist()
                dcp_mtp_attn_mask = self.generate_mtp_attention_mask_for_decode(
                    decode_num_computed_tokens, decode_num_scheduled_tokens)
                self.dcp_mtp_attn_mask.np[: self.num_decode_reqs] = dcp_mtp_attn_mask
                self.dcp_mtp_attn_mask.copy_to_gpu(self.num_decode_reqs)
                long_seq_metadata.dcp_mtp_attn_mask = self.dcp_mtp_attn_mask.gpu[: self.num_decode_reqs]
            else:
                long_seq_metadata.dcp_mtp_attn_mask = None
        else:
            if (self.dcp_world_size * self.pcp_world_size > 1 and self.speculative_config
                    and num_scheduled_tokens is not None):
                if self.num_decode_reqs > 0:
                    decode_num_scheduled_tokens = num_scheduled_tokens[: self.num_decode_reqs]
                    decode_num_computed_tokens = num_computed_tokens_cpu[: self.num_decode_reqs].tolist()
                    dcp_mtp_attn_mask = self.generate_mtp_attention_mask_for_decode(
                        decode_num_computed_tokens, decode_num_scheduled_tokens)
                    self.dcp_mtp_attn_mask.np[: self.num_decode_reqs] = dcp_mtp_attn_mask
                    self.dcp_mtp_attn_mask.copy_to_gpu(self.num_decode_reqs)
                # Always expose the (stable, pre-allocated) MTP mask buffer
                mask_n = self.num_decode_reqs if self.num_decode_reqs > 0 else num_reqs
                long_seq_metadata.dcp_mtp_attn_mask = self.dcp_mtp_attn_mask.gpu[:mask_n]
            else:
                long_seq_metadata.dcp_mtp_attn_mask = None
        return long_seq_metadata


class AscendMetadataForDecode:
    def __init__(self, num_computed_tokens_of_pcp_dcp, block_tables, dcp_mtp_attn_mask):
        self.num_computed_tokens_of_pcp_dcp = num_computed_tokens_of_pcp_dcp
        self.block_tables, self.dcp_mtp_attn_mask = block_tables, dcp_mtp_attn_mask


class AscendMetadata:
    def __init__(self, num_decodes, block_tables, decode_meta, actual_seq_lengths_q):
        self.num_decodes, self.block_tables = num_decodes, block_tables
        self.decode_meta, self.actual_seq_lengths_q = decode_meta, actual_seq_lengths_q


class AscendAttentionCPMetadataBuilder:
    def build(self, block_table, query_lens, long_seq_metadata):
        num_decodes = int((query_lens <= DECODE_THRESHOLD).sum())     # split_decodes_and_prefills
        decode_meta = AscendMetadataForDecode(
            num_computed_tokens_of_pcp_dcp=long_seq_metadata.num_computed_tokens_of_pcp_dcp[:num_decodes],
            block_tables=block_table[:num_decodes],
            dcp_mtp_attn_mask=long_seq_metadata.dcp_mtp_attn_mask)
        actual_seq_lengths_q = torch.cumsum(query_lens, 0)[:num_decodes].tolist()
        return AscendMetadata(num_decodes, block_table[:num_decodes], decode_meta, actual_seq_lengths_q)


def npu_fused_infer_attention_score(query, key, value, *, atten_mask, block_table, actual_seq_lengths_kv, scale):
    """FIA, BSND: ``query`` [B, S, N, D] over a paged cache; ``atten_mask`` [B, S, max_model_len] (True = hidden)."""
    t = torch.arange(MAX_MODEL_LEN, device=query.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    k = key.view(-1, NUM_HEADS, HEAD_DIM)[slots]                                  # [B, T, N, D]
    v = value.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("bsnd,btnd->bnst", query, k) * scale
    hidden = (t[None, :] >= actual_seq_lengths_kv[:, None])[:, None, None, :]    # [B, 1, 1, T]
    if atten_mask is not None:
        hidden = hidden | atten_mask[:, None, :, :MAX_MODEL_LEN]
    p = torch.softmax(scores.masked_fill(hidden, -1e9), -1)
    return torch.einsum("bnst,btnd->bsnd", p, v)


class FIATask:
    """A captured FIA task group: the host-side arguments ``graph_task_update`` rewrites before each replay."""

    def __init__(self, device):
        self.actual_seq_lengths_kv = torch.ones(NUM_REQS, dtype=torch.long, device=device)

    def rebind(self, actual_seq_lengths_kv):
        buf = self.actual_seq_lengths_kv
        buf.copy_(torch.as_tensor(actual_seq_lengths_kv, device=buf.device))


class GraphParams:
    def __init__(self, device):
        self.attn_params: dict[int, list] = {NUM_TOKENS: []}
        self.handles: dict[int, list[FIATask]] = {NUM_TOKENS: []}
        self.free_tasks = [FIATask(device)]


class AscendAttentionCPImpl:
    def __init__(self, graph_params, key_cache, value_cache):
        self.graph_params, self.key_cache, self.value_cache = graph_params, key_cache, value_cache
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def _forward_decode_pcp_dcp(self, query, attn_metadata):
        num_decodes = attn_metadata.num_decodes
        attn_mask = None
        if attn_metadata.decode_meta.dcp_mtp_attn_mask is not None:         # speculative_config: BSND
            attn_mask = attn_metadata.decode_meta.dcp_mtp_attn_mask
        query = query.view(num_decodes, -1, NUM_HEADS, HEAD_DIM)
        num_tokens = query.shape[0] * query.shape[1]
        if _EXTRA_CTX.capturing:
            handle = self.graph_params.free_tasks.pop(0)              # torch.npu.graph_task_group_begin
            self.graph_params.attn_params[num_tokens].append(
                (query, self.key_cache, self.value_cache, NUM_HEADS, NUM_HEADS, self.scale,
                 attn_metadata.block_tables, BLOCK_SIZE,
                 attn_metadata.decode_meta.num_computed_tokens_of_pcp_dcp, attn_metadata.actual_seq_lengths_q,
                 DCP_SIZE, PCP_RANK, DCP_RANK, attn_mask))
            attn_out = npu_fused_infer_attention_score(
                query, self.key_cache, self.value_cache, atten_mask=attn_mask,
                block_table=attn_metadata.block_tables, actual_seq_lengths_kv=handle.actual_seq_lengths_kv,
                scale=self.scale)
            self.graph_params.handles[num_tokens].append(handle)         # graph_task_group_end
        else:
            attn_out = npu_fused_infer_attention_score(
                query, self.key_cache, self.value_cache, atten_mask=attn_mask,
                block_table=attn_metadata.decode_meta.block_tables,
                actual_seq_lengths_kv=attn_metadata.decode_meta.num_computed_tokens_of_pcp_dcp.to(query.device),
                scale=self.scale)
        return attn_out.reshape(num_tokens, HIDDEN)


def update_graph_params(graph_params, attn_metadata, num_tokens):
    """Before each replay: re-launch every recorded FIA task with the step's ``actual_seq_lengths_kv``; the other
    arguments (block table, ``attn_mask``) are the ones recorded at capture."""
    for param, handle in zip(graph_params.attn_params[num_tokens], graph_params.handles[num_tokens]):
        (q_nope, k_nope, value, num_heads, num_kv_heads, scale, block_table, block_size, actual_seq_lengths_kv,
         actual_seq_lengths_q, dcp_size, pcp_rank, dcp_rank, attn_mask) = param
        actual_seq_lengths_kv = attn_metadata.decode_meta.num_computed_tokens_of_pcp_dcp
        handle.rebind(actual_seq_lengths_kv)               # graph_task_update_begin / FIA.out(..., attn_mask) / end


class Qwen35Layer:
    def __init__(self, device, graph_params):
        gen = generator(11072)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        key_cache = randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device, scale=1.5)
        value_cache = randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device)
        self.impl = AscendAttentionCPImpl(graph_params, key_cache, value_cache)

    def forward(self, hidden_states, attn_metadata):
        q = (hidden_states @ self.wq).view(-1, NUM_HEADS, HEAD_DIM)
        return hidden_states + self.impl._forward_decode_pcp_dcp(q, attn_metadata) @ self.wo


class NPUModelRunner:
    def __init__(self, device, variant):
        self.device = device
        self.graph_params = GraphParams(device)
        self.model = Qwen35Layer(device, self.graph_params)
        self.pcp_manager = PCPManager(device, variant)
        self.builder = AscendAttentionCPMetadataBuilder()
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(NUM_TOKENS, HIDDEN, device=device)
        self.graph = None

    def _prepare_inputs(self, num_computed_tokens, num_prompt_tokens, block_ids):
        num_reqs = len(block_ids)
        num_scheduled_tokens = torch.full((num_reqs,), DECODE_THRESHOLD, dtype=torch.long)
        num_computed = torch.tensor(num_computed_tokens, dtype=torch.long)
        self.pcp_manager.init_batch_info(num_scheduled_tokens, num_reqs, num_computed,
                                         torch.tensor(num_prompt_tokens, dtype=torch.long))
        long_seq_metadata = self.pcp_manager.generate_pcp_metadata(num_reqs, num_scheduled_tokens, num_computed)
        self.block_table[:num_reqs].copy_(torch.tensor(block_ids, device=self.device))
        return self.builder.build(self.block_table[:num_reqs], num_scheduled_tokens, long_seq_metadata)

    def capture_model(self):
        """``_dummy_run`` for the FULL_DECODE_ONLY bucket: dummies with no computed tokens, null blocks."""
        dummy = self._prepare_inputs([0] * NUM_REQS, [0] * NUM_REQS, [[0] * MAX_BLOCKS] * NUM_REQS)
        tasks = list(self.graph_params.free_tasks)

        def aclgraph_forward():
            _EXTRA_CTX.capturing = torch.cuda.is_current_stream_capturing()
            try:
                return self.model.forward(self.hidden_states, dummy)
            finally:
                _EXTRA_CTX.capturing = False

        self.graph = capture(
            aclgraph_forward, device=self.device, owner="ACLGraphWrapper (FULL_DECODE_ONLY, MTP verify)",
            name=f"decode {NUM_TOKENS} tokens",
            static={"hidden_states": self.hidden_states, "block_table": self.block_table,
                    "dcp_mtp_attn_mask.gpu": self.pcp_manager.dcp_mtp_attn_mask.gpu,
                    **{f"fia_task{i}.actual_seq_lengths_kv": t.actual_seq_lengths_kv for i, t in enumerate(tasks)}},
            state={"key_cache": self.model.impl.key_cache, "value_cache": self.model.impl.value_cache})

    def execute_model(self, hidden, num_computed_tokens, num_prompt_tokens, block_ids):
        attn_metadata = self._prepare_inputs(num_computed_tokens, num_prompt_tokens, block_ids)
        self.hidden_states.copy_(hidden)
        if self.graph is None:
            return self.model.forward(self.hidden_states, attn_metadata).clone()
        update_graph_params(self.graph_params, attn_metadata, NUM_TOKENS)
        g, out = self.graph
        return replay(g, out).clone()


# Per verify step: each request's computed tokens (history), prompt length, block ids.
STEPS = [
    ([5, 7], [5, 6], [[3, 5, 0, 0], [4, 6, 0, 0]]),
    ([9, 6], [5, 6], [[3, 5, 7, 0], [4, 6, 0, 0]]),
    ([11, 10], [5, 6], [[3, 5, 7, 0], [4, 6, 8, 0]]),
]


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(47)
    hiddens = [torch.randn(NUM_TOKENS, HIDDEN, generator=gen).to(device) for _ in STEPS]

    def serve(graphed: bool):
        runner = NPUModelRunner(device, variant)
        if graphed:
            runner.capture_model()
        return [runner.execute_model(h, *step) for h, step in zip(hiddens, STEPS)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
