"""PCP + MTP ACL graph: the MLA builder flattens the decode block table by ``repeat_interleave``, a new tensor per step.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/4221 ("[bugfix] pcp + mtp acl graph bugfix", commit
df777e9faa, merged November 2025).
Symptom: as reported, with pcp + MTP and ACL graphs on, the flattening "influences block_table address and leads to
incorrect results while enable acl graph"; eager was right.
Mechanism (from the diff and the code at its parent): for pcp + spec decode, ``AscendMLAMetadataBuilder.build``
flattens the decode rows of the block table so that every speculative token is its own row with its own
``cp_seq_len`` (to avoid an irregular spec mask): ``block_table = block_table[:num_decodes].repeat_interleave(
self.decode_threshold, dim=0)``, a freshly allocated tensor every build. In FULL graph mode
``AscendMLAImpl._forward_decode_pcp_dcp`` records ``decode_meta.block_table`` in ``graph_params.attn_params`` and
captures ``npu_multi_head_latent_attention`` in a task group; before each replay ``update_mla_attn_dcp_pcp_params``
re-launches the task with the step's ``cp_seq_len`` but the *recorded* ``block_table``: the table flattened for the
capture's dummy run. Every replay then reads the KV pages of the dummy batch's blocks; an eager step reads the
table it just flattened.
Doctor: warmup-divergence, at ``build`` (``AscendMLAMetadataBuilder.build``: the capture's build hands the graph a
per-build tensor as the block table; replays keep that reference while each eager step builds its own).
Fix (upstream): ``BlockTable`` allocates ``max_num_reqs * (1 + num_speculative_tokens)`` rows when
``pcp_world_size > 1``; ``NPUModelRunner._prepare_inputs`` flattens inside that persistent buffer (prefill rows moved
down first, then ``blk_table_tensor[:nd*T].copy_(blk_table_tensor[:nd].repeat_interleave(T, 0))``) and sets
``common_attn_metadata.block_table_tensor = blk_table_tensor[:nd*T + np]``; the builder only slices
(``block_table[:num_decodes_flatten]`` for decode), so the recorded table is a view refreshed in place.
Modelled: one cp rank (rank 0 of pcp=2) with its local KV; the other rank and the LSE merge are left out.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/4221"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "build"
SYMPTOM = "pcp + MTP under ACL graph: decode attention reads the capture's flattened block table (wrong results)"

NUM_HEADS, HEAD_DIM = 2, 4
HIDDEN = NUM_HEADS * HEAD_DIM
NUM_SPECULATIVE_TOKENS = 1
DECODE_THRESHOLD = 1 + NUM_SPECULATIVE_TOKENS
PCP_SIZE, PCP_RANK, DCP_RANK = 2, 0, 0
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 2, 3, 12
MAX_LOCAL_LEN = BLOCK_SIZE * MAX_BLOCKS
MAX_NUM_REQS = 2
NUM_REQS = 2                                      # decode requests in the FULL_DECODE_ONLY bucket
NUM_TOKENS = NUM_REQS * DECODE_THRESHOLD          # its runtime_shape


class _ForwardContext:
    capturing = False


_FORWARD_CONTEXT = _ForwardContext()


class BlockTable:
    def __init__(self, device, variant):
        duplicate_size = 1
        if variant == "fix" and PCP_SIZE > 1:
            duplicate_size += NUM_SPECULATIVE_TOKENS
        self.block_table = torch.zeros(MAX_NUM_REQS * duplicate_size, MAX_BLOCKS, dtype=torch.long, device=device)
        self.block_table_cpu = torch.zeros(MAX_NUM_REQS * duplicate_size, MAX_BLOCKS, dtype=torch.long)

    def commit_block_table(self, num_reqs):
        self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs])

    def get_device_tensor(self):
        return self.block_table


class AscendMLADecodeMetadata:
    def __init__(self, block_table, cp_seq_len):
        self.block_table, self.cp_seq_len = block_table, cp_seq_len


class AscendMLAMetadata:
    def __init__(self, num_decodes, decode):
        self.num_decodes, self.decode = num_decodes, decode


class AscendMLAMetadataBuilder:
    def __init__(self, variant):
        self.variant = variant
        self.pcp_size, self.pcp_rank, self.dcp_rank = PCP_SIZE, PCP_RANK, DCP_RANK
        self.decode_threshold = DECODE_THRESHOLD

    def build(self, common_attn_metadata):
        num_reqs = common_attn_metadata["num_reqs"]
        num_decodes = common_attn_metadata["num_decodes"]
        num_prefills = num_reqs - num_decodes
        block_table = common_attn_metadata["block_table_tensor"][:num_reqs]
        if self.variant == "fix" and self.pcp_size > 1:
            num_decodes_flatten = num_decodes * self.decode_threshold
            block_table = common_attn_metadata["block_table_tensor"][:num_decodes_flatten + num_prefills]
        if self.variant == "bug":
            block_table = block_table[:num_decodes, ...]
            # For pcp + spec decode, we flatten seq_lens and block_table
            # to avoid irregular spec_attn_mask shape
            if self.pcp_size > 1 and self.decode_threshold > 1:
                block_table = block_table.repeat_interleave(self.decode_threshold, dim=0)
        else:
            block_table = block_table[:num_decodes_flatten, ...]
        # [bs * decode_threshold, pcp_size, dcp_size]
        num_computed_tokens_of_pcp_dcp = common_attn_metadata["num_computed_tokens_of_pcp_dcp"]
        cp_seq_len = num_computed_tokens_of_pcp_dcp[:num_decodes * self.decode_threshold, self.pcp_rank,
                                                    self.dcp_rank]
        cp_seq_len = torch.where(cp_seq_len == 0, 1, cp_seq_len)
        return AscendMLAMetadata(num_decodes, AscendMLADecodeMetadata(block_table, cp_seq_len))


def npu_multi_head_latent_attention(q, k_cache, v_cache, block_table, seq_len, scale):
    """One query row per flattened (request, speculative token), over its own paged KV up to ``seq_len``."""
    t = torch.arange(MAX_LOCAL_LEN, device=q.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    k = k_cache.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    v = v_cache.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("bnd,btnd->bnt", q, k) * scale
    p = torch.softmax(scores.masked_fill((t[None, :] >= seq_len[:, None])[:, None, :], -1e9), -1)
    return torch.einsum("bnt,btnd->bnd", p, v)


class MLATask:
    """A captured task group: its ``seq_len`` argument is rewritten by ``graph_task_update`` before a replay."""

    def __init__(self, device):
        self.seq_len = torch.ones(NUM_TOKENS, dtype=torch.long, device=device)


class GraphParams:
    def __init__(self, device):
        self.attn_params: dict[int, list] = {NUM_TOKENS: []}
        self.handles: dict[int, list[MLATask]] = {NUM_TOKENS: []}
        self.free_tasks = [MLATask(device)]


class AscendMLAImpl:
    def __init__(self, graph_params, k_cache, v_cache):
        self.graph_params, self.k_cache, self.v_cache = graph_params, k_cache, v_cache
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def _forward_decode_pcp_dcp(self, q, attn_metadata):
        decode_meta = attn_metadata.decode
        num_tokens = q.size(0)
        if _FORWARD_CONTEXT.capturing:
            handle = self.graph_params.free_tasks.pop(0)                   # graph_task_group_begin
            self.graph_params.attn_params[num_tokens].append(
                (q, self.k_cache, self.v_cache, decode_meta.block_table, decode_meta.cp_seq_len, NUM_HEADS,
                 self.scale))
            out = npu_multi_head_latent_attention(q, self.k_cache, self.v_cache, decode_meta.block_table,
                                                  handle.seq_len, self.scale)
            self.graph_params.handles[num_tokens].append(handle)           # graph_task_group_end
            return out
        return npu_multi_head_latent_attention(q, self.k_cache, self.v_cache, decode_meta.block_table,
                                               decode_meta.cp_seq_len.to(q.device), self.scale)


def update_mla_attn_dcp_pcp_params(graph_params, attn_metadata, runtime_shape):
    """Before each replay: re-launch each recorded task with the step's ``cp_seq_len`` (padded to the runtime
    shape) and the recorded ``block_table``."""
    for param, handle in zip(graph_params.attn_params[runtime_shape], graph_params.handles[runtime_shape]):
        (q_nope, k_nope, v, block_table, seq_len, num_heads, scale) = param
        seq_len = attn_metadata.decode.cp_seq_len
        pad_length = runtime_shape - len(seq_len)
        seq_len = torch.cat([seq_len, torch.zeros(pad_length, dtype=seq_len.dtype)], dim=0)
        handle.seq_len.copy_(seq_len.to(handle.seq_len.device))   # graph_task_update_begin / launch / end


class DeepseekMTPLayer:
    def __init__(self, device, graph_params):
        gen = generator(4221)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        k_cache = randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device, scale=1.5)
        v_cache = randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device)
        self.impl = AscendMLAImpl(graph_params, k_cache, v_cache)

    def forward(self, hidden_states, attn_metadata):
        q = (hidden_states @ self.wq).view(-1, NUM_HEADS, HEAD_DIM)
        return hidden_states + self.impl._forward_decode_pcp_dcp(q, attn_metadata).reshape(-1, HIDDEN) @ self.wo


class NPUModelRunner:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.pcp_size, self.decode_threshold = PCP_SIZE, DECODE_THRESHOLD
        self.speculative_config = True
        self.graph_params = GraphParams(device)
        self.model = DeepseekMTPLayer(device, self.graph_params)
        self.input_batch_block_table = BlockTable(device, variant)
        self.builder = AscendMLAMetadataBuilder(variant)
        self.hidden_states = torch.zeros(NUM_TOKENS, HIDDEN, device=device)
        self.graph = None

    @staticmethod
    def _num_computed_tokens_of_pcp_dcp(histories):
        """Per flattened token row: this rank's KV length (positions p with p % pcp_size == pcp_rank)."""
        rows = [[(h + j + 1 + PCP_SIZE - 1) // PCP_SIZE] for h in histories for j in range(DECODE_THRESHOLD)]
        return torch.tensor(rows, dtype=torch.long)[:, :, None].expand(-1, PCP_SIZE, 1)

    def _prepare_inputs(self, histories, block_ids):
        num_reqs = len(block_ids)
        self.input_batch_block_table.block_table_cpu[:num_reqs] = torch.tensor(block_ids)
        self.input_batch_block_table.commit_block_table(num_reqs)
        blk_table_tensor = self.input_batch_block_table.get_device_tensor()
        common_attn_metadata = {"num_reqs": num_reqs, "num_decodes": num_reqs,
                                "block_table_tensor": blk_table_tensor,
                                "num_computed_tokens_of_pcp_dcp": self._num_computed_tokens_of_pcp_dcp(histories)}
        if self.variant == "fix" and self.speculative_config and self.pcp_size > 1:
            # flattened block_table: [d0, d0, d1, d1, p0, ...]
            num_prefill_reqs, num_decode_reqs = 0, num_reqs
            num_decode_reqs_flatten = num_decode_reqs * self.decode_threshold
            blk_table_tensor[num_decode_reqs_flatten:num_decode_reqs_flatten + num_prefill_reqs].copy_(
                blk_table_tensor[num_decode_reqs:num_decode_reqs + num_prefill_reqs].clone())
            blk_table_tensor[:num_decode_reqs_flatten].copy_(
                blk_table_tensor[:num_decode_reqs].repeat_interleave(self.decode_threshold, dim=0))
            common_attn_metadata["block_table_tensor"] = blk_table_tensor[:num_decode_reqs_flatten + num_prefill_reqs]
        return self.builder.build(common_attn_metadata)

    def capture_model(self):
        """``_dummy_run`` of the decode bucket: dummy requests (null blocks, no history)."""
        dummy = self._prepare_inputs([0] * NUM_REQS, [[0] * MAX_BLOCKS] * NUM_REQS)
        tasks = list(self.graph_params.free_tasks)

        def aclgraph_forward():
            _FORWARD_CONTEXT.capturing = torch.cuda.is_current_stream_capturing()
            try:
                return self.model.forward(self.hidden_states, dummy)
            finally:
                _FORWARD_CONTEXT.capturing = False

        self.graph = capture(
            aclgraph_forward, device=self.device, owner="ACLGraphWrapper (FULL_DECODE_ONLY, pcp + MTP)",
            name=f"decode {NUM_TOKENS} tokens",
            static={"hidden_states": self.hidden_states,
                    "block_table": self.input_batch_block_table.block_table,
                    **{f"mla_task{i}.seq_len": t.seq_len for i, t in enumerate(tasks)}},
            state={"k_cache": self.model.impl.k_cache, "v_cache": self.model.impl.v_cache})

    def execute_model(self, hidden, histories, block_ids):
        attn_metadata = self._prepare_inputs(histories, block_ids)
        self.hidden_states.copy_(hidden)
        if self.graph is None:
            return self.model.forward(self.hidden_states, attn_metadata).clone()
        update_mla_attn_dcp_pcp_params(self.graph_params, attn_metadata, NUM_TOKENS)
        g, out = self.graph
        return replay(g, out).clone()


# Per step: the decode requests' computed tokens and block ids (blocks 1.. are real, 0 is the null block).
STEPS = [
    ([3, 2], [[3, 5, 0], [4, 6, 0]]),
    ([5, 4], [[3, 5, 7], [4, 6, 0]]),
    ([6, 7], [[9, 10, 11], [4, 6, 8]]),
]


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(4221)
    hiddens = [torch.randn(NUM_TOKENS, HIDDEN, generator=gen).to(device) for _ in STEPS]

    def serve(graphed: bool):
        runner = NPUModelRunner(device, variant)
        if graphed:
            runner.capture_model()
        return [runner.execute_model(h, *step) for h, step in zip(hiddens, STEPS)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
