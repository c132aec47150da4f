"""Under MetaX GQA-DCP the FULL decode graph keeps the capture build's ``cu_seqlens_k``, a per-build tensor released after capture.

Upstream: https://github.com/MetaX-MACA/vLLM-metax/commit/52812841de9b792151fab72d6f4c2204f1387bca ("[BugFix] correct
`cu_seqlens_k` in dcp when capture cudagraph", MetaX-MACA/vLLM-metax, committed 2026-06-10 on the default branch,
no PR number; the ``# For metax GQA DCP`` varlen path and its per-build ``cu_seqlens_k`` arrived with
"Support vllm 0.15.0" (#209), 2026-02-26).
Symptom: with decode context parallelism (DCP > 1) on MetaX and a FULL cudagraph mode (FULL / FULL_AND_PIECEWISE),
decode output is wrong (requests attend over the wrong number of their context tokens); ``enforce_eager`` is right.
Mechanism: ``FlashAttentionMetadataBuilder.build`` (vllm_metax/v1/attention/backends/flash_attn.py) runs eagerly
before every step, the capture's ``_dummy_run`` included. In the ``dcp_world_size > 1`` branch it already writes
the rank-local context lengths into the persistent ``self._dcp_context_kv_lens`` (the upstream vLLM #36070 port),
but then builds the K offsets of MetaX's varlen context attention as
``cu_seqlens_k = F.pad(dcp_context_kv_lens, (1, 0), value=0).cumsum(dim=0, dtype=torch.int32)``: a brand-new
tensor per build, stored in ``FlashAttentionMetadata.cu_seqlens_k``. ``FlashAttentionImpl._forward_with_dcp``
passes it to ``flash_attn_varlen_func(..., cu_seqlens_k=attn_metadata.cu_seqlens_k, block_table=...)`` for the
context attention over this rank's KV share. The FULL graph records the address of the tensor built for the
dummy batch (seq_len 1: all prefix sums 0); when the dummy run's metadata goes, its block goes back to the
caching allocator. Each replay's eager build writes the real prefix sums into a new tensor elsewhere, and the
graph keeps reading the released block: the dummy prefix sums, or whatever the allocator put there since. Every
decode step then attends over the wrong slice of the local context.
Doctor: dangling-reference, at ``build`` (``FlashAttentionMetadataBuilder.build`` hands the graph a per-build
``cu_seqlens_k``; nothing keeps the capture's one alive, and replays read its released block).
Fix (upstream): ``FlashAttentionMetadataBuilder.__init__`` allocates ``self._dcp_cu_seqlens_k = torch.zeros(
max_num_reqs + 1, int32)`` when ``dcp_world_size > 1``; ``build`` zeroes ``[:num_reqs + 1]``, writes the prefix
sums with ``torch.cumsum(dcp_context_kv_lens, dim=0, dtype=torch.int32, out=self._dcp_cu_seqlens_k[1:num_reqs + 1])``
and hands out the view ``self._dcp_cu_seqlens_k[:num_reqs + 1]``: one address for capture and replay.
Modelled: DCP rank 0 of 2 (interleave 1) with its pre-filled local KV share, one attention layer; the query
all-gather, the cross-rank LSE reduce (``dcp_combine``), the new token's cache write, the prefill/decode split
and AOT scheduling are left out. No padding: each decode step fills the captured batch of 4 requests. On the CPU
the graph reads the released block's capture-time bytes (no block reuse is emulated or needed). On a real GPU
the block holds those or a later small allocation's data; the step's own ``cu_seqlens_k`` does not land on it,
since a real step (``_prepare_inputs``, as upstream) holds ``logits_indices = query_start_loc[1:] - 1`` while it
builds and the dummy run does not, which shifts the first step's build allocations by one block.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/MetaX-MACA/vLLM-metax/commit/52812841de9b792151fab72d6f4c2204f1387bca"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "build"
SYMPTOM = ("MetaX DCP + FULL cudagraph decode: varlen context attention reads the capture build's released "
           "cu_seqlens_k (wrong per-request K ranges, wrong output)")

NUM_HEADS, HEAD_DIM, VOCAB = 2, 4, 16
HIDDEN = NUM_HEADS * HEAD_DIM
MAX_MODEL_LEN = 24
DCP_WORLD_SIZE, DCP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE = 2, 0, 1
BLOCK_SIZE, MAX_BLOCKS = 4, 3           # rank-local block table: MAX_MODEL_LEN / DCP_WORLD_SIZE tokens
MAX_NUM_REQS = 8                        # scheduler_config.max_num_seqs
NUM_REQS = 4                            # the uniform-decode FULL graph's batch size
NUM_BLOCKS = 1 + NUM_REQS * MAX_BLOCKS  # block 0 is the null block


def get_dcp_local_seq_lens(seq_lens, dcp_size=1, dcp_rank=None, cp_kv_cache_interleave_size=1):
    """How many of each request's first ``seq_lens`` tokens live in ``dcp_rank``'s KV share."""
    rank_offsets = torch.tensor([[dcp_rank]], dtype=torch.int32, device=seq_lens.device)
    seq_lens_tiled = seq_lens.to(torch.int32).unsqueeze(-1).repeat(1, rank_offsets.shape[1])
    base = seq_lens_tiled // cp_kv_cache_interleave_size // dcp_size * cp_kv_cache_interleave_size
    remainder = seq_lens_tiled - base * dcp_size
    remainder = torch.clip(remainder - rank_offsets * cp_kv_cache_interleave_size, 0, cp_kv_cache_interleave_size)
    return (base + remainder).squeeze(1)


class CommonAttentionMetadata:
    def __init__(self, query_start_loc, seq_lens, num_reqs, max_query_len, max_seq_len, block_table_tensor):
        self.query_start_loc, self.seq_lens, self.num_reqs = query_start_loc, seq_lens, num_reqs
        self.max_query_len, self.max_seq_len = max_query_len, max_seq_len
        self.block_table_tensor = block_table_tensor


class FlashAttentionMetadata:
    def __init__(self, *, query_start_loc, max_query_len, seq_lens, block_table, cu_seqlens_k,
                 max_dcp_context_kv_len=None, dcp_context_kv_lens=None, causal=True):
        self.query_start_loc, self.max_query_len, self.seq_lens = query_start_loc, max_query_len, seq_lens
        self.block_table = block_table
        self.cu_seqlens_k = cu_seqlens_k                      # For metax GQA DCP
        self.max_dcp_context_kv_len, self.dcp_context_kv_lens = max_dcp_context_kv_len, dcp_context_kv_lens
        self.causal = causal


# --- vllm_metax/v1/attention/backends/flash_attn.py -----------------------------------------------------

class FlashAttentionMetadataBuilder:
    def __init__(self, device, variant):
        self.variant, self.device = variant, device
        self.dcp_world_size, self.dcp_rank = DCP_WORLD_SIZE, DCP_RANK
        self.cp_kv_cache_interleave_size = CP_KV_CACHE_INTERLEAVE_SIZE
        if self.dcp_world_size > 1:
            max_num_reqs = MAX_NUM_REQS
            self._dcp_context_kv_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
            if variant == "fix":
                self._dcp_cu_seqlens_k = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=self.device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        num_reqs = common_attn_metadata.num_reqs
        max_query_len = common_attn_metadata.max_query_len
        max_seq_len = common_attn_metadata.max_seq_len
        query_start_loc = common_attn_metadata.query_start_loc
        seq_lens = common_attn_metadata.seq_lens
        max_dcp_context_kv_len = 0
        dcp_context_kv_lens = None
        # For metax GQA DCP
        cu_seqlens_k = None
        if self.dcp_world_size > 1:
            query_lens = query_start_loc[1:] - query_start_loc[:-1]
            context_kv_lens = seq_lens - query_lens
            local_context_kv_lens = get_dcp_local_seq_lens(
                context_kv_lens, self.dcp_world_size, self.dcp_rank, self.cp_kv_cache_interleave_size)
            self._dcp_context_kv_lens[:num_reqs] = local_context_kv_lens
            self._dcp_context_kv_lens[num_reqs:] = 0
            dcp_context_kv_lens = self._dcp_context_kv_lens[:num_reqs]
            num_partitions = self.dcp_world_size * self.cp_kv_cache_interleave_size
            max_dcp_context_kv_len = ((max_seq_len + num_partitions - 1) // num_partitions
                                      ) * self.cp_kv_cache_interleave_size
            # For metax GQA DCP
            if self.variant == "bug":
                cu_seqlens_k = F.pad(dcp_context_kv_lens, (1, 0), value=0).cumsum(dim=0, dtype=torch.int32)
            else:
                # Keep K offsets in persistent storage so full cudagraph replay
                # sees the runtime-updated DCP prefix sums.
                self._dcp_cu_seqlens_k[: num_reqs + 1].zero_()
                torch.cumsum(dcp_context_kv_lens, dim=0, dtype=torch.int32,
                             out=self._dcp_cu_seqlens_k[1: num_reqs + 1])
                cu_seqlens_k = self._dcp_cu_seqlens_k[: num_reqs + 1]
        return FlashAttentionMetadata(
            query_start_loc=query_start_loc, max_query_len=max_query_len, seq_lens=seq_lens,
            block_table=common_attn_metadata.block_table_tensor, cu_seqlens_k=cu_seqlens_k,
            max_dcp_context_kv_len=max_dcp_context_kv_len, dcp_context_kv_lens=dcp_context_kv_lens, causal=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                           causal, block_table, return_attn_probs=True):
    """Paged varlen attention, decode shape (one query token per request, non-causal): request ``b`` attends
    over its first ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` cached tokens, found through ``block_table[b]``.
    Returns the output, its LSE as ``[H, B]`` (``-inf`` where a request has no K) and no probs."""
    seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    t = torch.arange(max_seqlen_k, device=q.device)
    slots = block_table[:, t // BLOCK_SIZE].long() * BLOCK_SIZE + t % BLOCK_SIZE
    k_ctx, v_ctx = (cache.view(-1, NUM_HEADS, HEAD_DIM)[slots] for cache in (k, v))
    scores = torch.einsum("bhd,bthd->bht", q, k_ctx) * softmax_scale
    scores = scores.masked_fill((t[None, :] >= seqlens_k[:, None])[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.clamp(min=-1e30)[..., None])
    return torch.einsum("bht,bthd->bhd", p, v_ctx), lse.transpose(0, 1), None


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse):
    """``lse`` as ``[H, B]``; writes the merged attention into ``output``."""
    prefix_lse, suffix_lse = prefix_lse.transpose(0, 1), suffix_lse.transpose(0, 1)
    max_lse = torch.maximum(prefix_lse, suffix_lse)
    wp, ws = torch.exp(prefix_lse - max_lse)[..., None], torch.exp(suffix_lse - max_lse)[..., None]
    output.copy_((wp * prefix_output + ws * suffix_output) / (wp + ws))


_forward_context: dict = {}


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    _forward_context["attn_metadata"] = attn_metadata
    try:
        yield
    finally:
        _forward_context.clear()


class FlashAttentionImpl:
    def __init__(self, key_cache, value_cache):
        self.key_cache, self.value_cache, self.scale = key_cache, value_cache, HEAD_DIM ** -0.5

    def _forward_with_dcp(self, query, key, value, key_cache, value_cache, output,
                          attn_metadata: FlashAttentionMetadata):
        cu_seqlens_q = attn_metadata.query_start_loc
        max_seqlen_q = attn_metadata.max_query_len
        block_table = attn_metadata.block_table
        query = query.contiguous()
        query_across_dcp = query      # get_dcp_group().all_gather(query, dim=1): the other rank's heads left out
        assert attn_metadata.dcp_context_kv_lens is not None
        context_attn_out, context_lse, _ = flash_attn_varlen_func(
            q=query_across_dcp, k=key_cache, v=value_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            cu_seqlens_k=attn_metadata.cu_seqlens_k, max_seqlen_k=attn_metadata.max_dcp_context_kv_len,
            softmax_scale=self.scale, causal=False, block_table=block_table, return_attn_probs=True)
        # (self.dcp_combine(...) across the DCP group left out: one rank modelled.)
        # The new tokens attend to themselves (flash_attn_varlen_func with cu_seqlens_k=cu_seqlens_q, causal):
        # one query token per request, so its output is its own value and its LSE the scaled self-score.
        query_attn_out = value
        query_lse = ((query * key).sum(-1) * self.scale).transpose(0, 1)
        merge_attn_states(output, context_attn_out, context_lse, query_attn_out, query_lse)
        return output


class Model:
    def __init__(self, device):
        gen = generator(5281284)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.impl = FlashAttentionImpl(randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device, scale=1.5),
                                       randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device))

    def __call__(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos_embed[positions]
        q, k, v = ((h @ w).view(-1, NUM_HEADS, HEAD_DIM) for w in (self.wq, self.wk, self.wv))
        attn = torch.empty_like(q)
        self.impl._forward_with_dcp(q, k, v, self.impl.key_cache, self.impl.value_cache, attn,
                                    _forward_context["attn_metadata"])
        return h + attn.reshape(-1, HIDDEN) @ self.wo

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm/v1/worker/gpu_model_runner.py (cut down) -------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, *shape, dtype, device):
        self.cpu = host(torch.zeros(*shape, dtype=dtype), device)
        self.gpu = torch.zeros(*shape, dtype=dtype, device=device)

    def copy_to_gpu(self, n):
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class GPUModelRunner:
    def __init__(self, model, device, variant):
        self.model, self.device = model, device
        self.input_ids = CpuGpuBuffer(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.positions = CpuGpuBuffer(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.query_start_loc = CpuGpuBuffer(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)
        self.seq_lens = CpuGpuBuffer(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.block_table = CpuGpuBuffer(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.attn_metadata_builder = FlashAttentionMetadataBuilder(device, variant)
        self.cudagraph = None

    def _copy_inputs_to_gpu(self, n):
        for buf, rows in ((self.input_ids, n), (self.positions, n), (self.query_start_loc, n + 1),
                          (self.seq_lens, n), (self.block_table, n)):
            buf.copy_to_gpu(rows)

    def _common_attn_metadata(self, n, max_seq_len):
        return CommonAttentionMetadata(self.query_start_loc.gpu[:n + 1], self.seq_lens.gpu[:n], n, 1, max_seq_len,
                                       self.block_table.gpu[:n])

    def _prepare_inputs(self, token_ids, seq_lens, block_ids):
        n = len(token_ids)
        self.input_ids.cpu[:n] = torch.tensor(token_ids)
        self.positions.cpu[:n] = torch.tensor(seq_lens) - 1
        self.query_start_loc.cpu[:n + 1] = torch.arange(n + 1, dtype=torch.int32)    # one token per request
        self.seq_lens.cpu[:n] = torch.tensor(seq_lens, dtype=torch.int32)
        self.block_table.cpu[:n] = torch.tensor(block_ids, dtype=torch.int32)
        self._copy_inputs_to_gpu(n)
        logits_indices = self.query_start_loc.gpu[1:n + 1] - 1      # held until sampling
        common = self._common_attn_metadata(n, max(seq_lens))
        return self.attn_metadata_builder.build(0, common), logits_indices

    def _model_forward(self):
        return self.model(self.input_ids.gpu[:NUM_REQS], self.positions.gpu[:NUM_REQS])

    def _dummy_run(self):
        """Capture the FULL uniform-decode graph on a dummy batch (seq_len 1, null blocks, max_seq_len =
        max_model_len)."""
        n = NUM_REQS
        self.input_ids.cpu[:n] = 0
        self.positions.cpu[:n] = 0
        self.query_start_loc.cpu[:n + 1] = torch.arange(n + 1, dtype=torch.int32)
        self.seq_lens.cpu[:n] = 1
        self.block_table.cpu[:n] = 0
        self._copy_inputs_to_gpu(n)
        attn_metadata = self.attn_metadata_builder.build_for_cudagraph_capture(
            self._common_attn_metadata(n, MAX_MODEL_LEN))
        static = {name: getattr(self, name).gpu for name in
                  ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table")}
        for name in ("_dcp_context_kv_lens", "_dcp_cu_seqlens_k"):
            if hasattr(self.attn_metadata_builder, name):
                static[name] = getattr(self.attn_metadata_builder, name)
        with set_forward_context(attn_metadata):
            self.cudagraph = capture(self._model_forward, device=self.device, name=f"FULL decode {NUM_REQS}",
                                     owner="CUDAGraphWrapper (FULL, DCP rank 0)", static=static,
                                     state={"key_cache": self.model.impl.key_cache,
                                            "value_cache": self.model.impl.value_cache}, on_freed="reuse")
        # the dummy batch's metadata (and its cu_seqlens_k) dies here

    def execute_model(self, token_ids, seq_lens, block_ids):
        attn_metadata, logits_indices = self._prepare_inputs(token_ids, seq_lens, block_ids)
        with set_forward_context(attn_metadata):
            if self.cudagraph is None:
                hidden_states = self._model_forward()
            else:
                g, out = self.cudagraph
                hidden_states = replay(g, out)
        sample_hidden_states = hidden_states[logits_indices]
        return self.model.compute_logits(sample_hidden_states)


BLOCKS = [[1 + MAX_BLOCKS * i + j for j in range(MAX_BLOCKS)] for i in range(NUM_REQS)]
STEPS = [([3, 9, 5, 1], [7, 10, 4, 13]), ([12, 2, 8, 6], [8, 11, 5, 14]),      # (token ids, seq_lens)
         ([4, 15, 0, 11], [9, 12, 6, 15]), ([7, 3, 14, 10], [10, 13, 7, 16])]


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant)
        if graphed:
            runner._dummy_run()
        return [runner.execute_model(ids, lens, BLOCKS) for ids, lens in STEPS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
