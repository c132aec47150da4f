"""Under DCP the FULL decode graph keeps the capture build's ``dcp_context_kv_lens``, released after capture.

Upstream: https://github.com/vllm-project/vllm/pull/36070 ("[Bugfix][DCP] Fix CUDA graph capture for Decode
Context Parallelism"), fixing https://github.com/vllm-project/vllm/issues/35935 ("DCP + CUDA graphs broken -
dcp_context_kv_lens frozen during capture").
Symptom: with decode context parallelism (DCP > 1) and FULL CUDA graphs (the decode half of the v1 default
``FULL_AND_PIECEWISE``) the model generates garbage (tests/distributed/test_context_parallel.py, Qwen2.5-1.5B,
TP=4, DCP=2); ``--enforce-eager`` is right.
Mechanism: ``FlashAttentionMetadataBuilder.build`` runs eagerly before every step (capture included). With
``dcp_world_size > 1`` it computes ``query_kv_lens = query_start_loc[1:] - query_start_loc[:-1]``,
``dcp_context_kv_lens = seq_lens - query_kv_lens`` and ``get_dcp_local_seq_lens(...)`` on the GPU (since #29449,
which removed the CPU path): a brand-new tensor per build, stored in ``FlashAttentionMetadata``.
``FlashAttentionImpl._forward_with_dcp`` passes it as ``seqused_k`` of the context attention over this rank's
share of the KV cache. The FULL graph captured in ``_dummy_run`` records the address of the tensor built for
the dummy batch; when the dummy run's metadata goes, that block goes back to the caching allocator. Each
replay's eager build writes the real lengths into a new tensor elsewhere, and the graph reads the released
block: the dummy lengths, or whatever the allocator put there next (here the next build's ``query_kv_lens``,
all ones), so every decode step attends over the wrong number of context tokens.
Doctor: dangling-reference, at ``build`` (``FlashAttentionMetadataBuilder.build`` hands the graph a per-build
``dcp_context_kv_lens``; nothing keeps the capture's one alive, and replays read its released block).
Fix (upstream): ``FlashAttentionMetadataBuilder.__init__`` allocates ``self._dcp_context_kv_lens =
torch.zeros(max_num_reqs, int32)`` when ``dcp_world_size > 1``; ``build`` writes ``[:num_reqs]`` in place,
zeroes ``[num_reqs:]`` and hands out the view ``self._dcp_context_kv_lens[:num_reqs]``: one address for capture
and replay. (Pre- and post-fix flash_attn.py code read; the PR diff itself was not available.)
Modelled: DCP rank 0 of 2 (interleave 1) with its pre-filled local KV share; the query all-gather, the cross-rank
LSE reduce, the new token's cache write and the FA3 AOT ``schedule`` are left out. No padding: each decode step
fills the captured batch of 4 requests.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from workbench.engine import host, reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/36070"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "build"
SYMPTOM = "DCP + FULL CUDA graph decode: context attention reads a released dcp_context_kv_lens (garbage output)"

NUM_HEADS, HEAD_DIM, VOCAB, MAX_POS = 2, 4, 16, 32
HIDDEN = NUM_HEADS * HEAD_DIM
DCP_WORLD_SIZE, DCP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE = 2, 0, 1
BLOCK_SIZE, MAX_BLOCKS = 4, 3
MAX_LOCAL_LEN = BLOCK_SIZE * MAX_BLOCKS  # the longest local context this rank's block table can hold
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


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    block_table_tensor: torch.Tensor


@dataclasses.dataclass
class FlashAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    dcp_context_kv_lens: torch.Tensor | None


class FlashAttentionMetadataBuilder:
    def __init__(self, device, variant):
        self.variant = variant
        self.dcp_world_size, self.dcp_rank = DCP_WORLD_SIZE, DCP_RANK
        self.cp_kv_cache_interleave_size = CP_KV_CACHE_INTERLEAVE_SIZE
        if variant == "fix" and self.dcp_world_size > 1:
            self._dcp_context_kv_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> FlashAttentionMetadata:
        num_reqs, seq_lens = common_attn_metadata.num_reqs, common_attn_metadata.seq_lens
        query_start_loc = common_attn_metadata.query_start_loc
        dcp_context_kv_lens = None
        if self.dcp_world_size > 1:
            if self.variant == "bug":
                query_kv_lens = query_start_loc[1:] - query_start_loc[:-1]
                dcp_context_kv_lens = seq_lens - query_kv_lens
                dcp_context_kv_lens = get_dcp_local_seq_lens(                # a new tensor every build
                    dcp_context_kv_lens, self.dcp_world_size, self.dcp_rank, self.cp_kv_cache_interleave_size)
            else:
                query_lens = query_start_loc[1:] - query_start_loc[:-1]
                context_kv_lens = seq_lens - query_lens
                local_context_kv_lens = get_dcp_local_seq_lens(
                    context_kv_lens, self.dcp_world_size, self.dcp_rank, self.cp_kv_cache_interleave_size)
                self._dcp_context_kv_lens[:num_reqs] = local_context_kv_lens
                self._dcp_context_kv_lens[num_reqs:] = 0
                dcp_context_kv_lens = self._dcp_context_kv_lens[:num_reqs]
        block_table = common_attn_metadata.block_table_tensor
        return FlashAttentionMetadata(query_start_loc, seq_lens, block_table, dcp_context_kv_lens)


def flash_attn_varlen_func(q, k_cache, v_cache, seqused_k, block_table, softmax_scale):
    """Decode (one query token per request), non-causal over the first ``seqused_k`` cached tokens;
    returns the output and its softmax LSE (``-inf`` and a zero output where ``seqused_k`` is 0)."""
    t = torch.arange(MAX_LOCAL_LEN, device=q.device)
    slots = block_table[:, t // BLOCK_SIZE].long() * BLOCK_SIZE + t % BLOCK_SIZE
    k, v = (cache.view(-1, NUM_HEADS, HEAD_DIM)[slots] for cache in (k_cache, v_cache))
    scores = torch.einsum("rhd,rthd->rht", q, k) * softmax_scale
    scores = scores.masked_fill((t[None, :] >= seqused_k[:, None].long())[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.clamp(min=-1e30)[..., None])
    return torch.einsum("rht,rthd->rhd", p, v), lse


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse):
    max_lse = torch.maximum(prefix_lse, suffix_lse)
    wp, ws = torch.exp(prefix_lse - max_lse)[..., None], torch.exp(suffix_lse - max_lse)[..., None]
    return (wp * prefix_output + ws * suffix_output) / (wp + ws)


_forward_context: dict = {}


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    _forward_context["attn_metadata"] = attn_metadata
    try:
        yield
    finally:
        _forward_context.clear()


class FlashAttentionImpl:
    def __init__(self, k_cache, v_cache):
        self.k_cache, self.v_cache, self.scale = k_cache, v_cache, HEAD_DIM ** -0.5

    def _forward_with_dcp(self, query, key, value, attn_metadata: FlashAttentionMetadata):
        context_attn_out, context_lse = flash_attn_varlen_func(
            query, self.k_cache, self.v_cache, seqused_k=attn_metadata.dcp_context_kv_lens,
            block_table=attn_metadata.block_table, softmax_scale=self.scale)
        # (cp_lse_ag_out_rs across the DCP group left out.) The new tokens attend to themselves, causally:
        query_lse = (query * key).sum(-1) * self.scale
        return merge_attn_states(context_attn_out, context_lse, value, query_lse)


class Model:
    def __init__(self, device):
        gen = generator(36070)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
                                              for _ in range(4))
        self.impl = FlashAttentionImpl(randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device, scale=1.5),
                                       randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device))

    def __call__(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos_embed[positions]
        q, k, v = ((h @ w).view(-1, NUM_HEADS, HEAD_DIM) for w in (self.wq, self.wk, self.wv))
        attn = self.impl._forward_with_dcp(q, k, v, _forward_context["attn_metadata"])
        return h + attn.reshape(-1, HIDDEN) @ self.wo


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

    def _prepare_inputs(self, token_ids, seq_lens, block_ids) -> FlashAttentionMetadata:
        n = len(token_ids)
        self.input_ids.cpu[:n] = torch.tensor(token_ids)
        self.positions.cpu[:n] = torch.tensor(seq_lens) - 1
        self.query_start_loc.cpu[:n + 1] = torch.arange(n + 1, dtype=torch.int32)    # one token per request
        self.seq_lens.cpu[:n] = torch.tensor(seq_lens, dtype=torch.int32)
        self.block_table.cpu[:n] = torch.tensor(block_ids, dtype=torch.int32)
        for buf, rows in ((self.input_ids, n), (self.positions, n), (self.query_start_loc, n + 1),
                          (self.seq_lens, n), (self.block_table, n)):
            buf.copy_to_gpu(rows)
        common = CommonAttentionMetadata(self.query_start_loc.gpu[:n + 1], self.seq_lens.gpu[:n], n,
                                         self.block_table.gpu[:n])
        return self.attn_metadata_builder.build(common)

    def _model_forward(self):
        return self.model(self.input_ids.gpu[:NUM_REQS], self.positions.gpu[:NUM_REQS])

    def _dummy_run(self):
        """Capture the FULL uniform-decode graph on a dummy batch (no context: seq_len 1, null blocks)."""
        attn_metadata = self._prepare_inputs([0] * NUM_REQS, [1] * NUM_REQS, [[0] * MAX_BLOCKS] * NUM_REQS)
        static = {name: getattr(self, name).gpu for name in
                  ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table")}
        if hasattr(self.attn_metadata_builder, "_dcp_context_kv_lens"):
            static["_dcp_context_kv_lens"] = self.attn_metadata_builder._dcp_context_kv_lens
        with set_forward_context(attn_metadata):
            self.cudagraph = capture(self._model_forward, device=self.device, name=f"FULL decode {NUM_REQS}",
                                     owner="CUDAGraphWrapper (FULL, DCP rank 0)", static=static,
                                     state={"key_cache": self.model.impl.k_cache,
                                            "value_cache": self.model.impl.v_cache}, on_freed="reuse")
        # the dummy batch's metadata (and its dcp_context_kv_lens) dies here

    def execute_model(self, token_ids, seq_lens, block_ids):
        attn_metadata = self._prepare_inputs(token_ids, seq_lens, block_ids)
        with set_forward_context(attn_metadata):
            if self.cudagraph is None:
                return self._model_forward().clone()
            g, out = self.cudagraph
            return replay(g, out).clone()


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

    def served():
        with reuse_freed_blocks():             # the caching allocator hands a released block on
            return serve(True)
    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: serve(False))
