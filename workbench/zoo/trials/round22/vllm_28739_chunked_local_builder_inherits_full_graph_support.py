"""Llama 4 chunked local attention kept on FULL decode graphs: replays read the capture's freed virtual-batch tensors.

Upstream: https://github.com/vllm-project/vllm/pull/28739 ("[Bugfix] Fix ChunkedLocalAttention CUDA Graph
setting"), fixing https://github.com/vllm-project/vllm/issues/28604; a regression from the refactor in #28479.
Symptom: incorrect outputs on Llama 4 (``nvidia/Llama-4-Scout-17B-16E-Instruct-FP8``, ``--kv-cache-dtype fp8``)
with the default ``FULL_AND_PIECEWISE`` cudagraph mode (vLLM V1, November 2025).
Mechanism: ``create_chunked_local_attention_backend`` subclasses the underlying backend's builder
(FlashInfer here) and sets ``_cudagraph_support = AttentionCGSupport.NEVER``: its ``build`` runs
``make_local_attention_virtual_batches``, which makes new ``query_start_loc``, ``seq_lens`` and
``block_table`` tensors for the virtual batches every step, so its metadata never lives in persistent
buffers. After #28479 the runner asks ``builder_cls.get_cudagraph_support(...)``; FlashInfer overrides that
classmethod (its answer depends on the kernels it will use), and the chunked builder inherits the override,
so ``NEVER`` is never read. ``_check_and_update_cudagraph_mode`` keeps FULL decode graphs, and the capture
bakes in the addresses of the dummy run's virtual-batch tensors. Those belong to the dummy run's metadata,
which is dropped after capture: every replay reads freed memory, whatever the caching allocator has put there
since (garbage local-attention lengths, offsets and pages; the emulation hands freed blocks on the same way,
``on_freed="reuse"``).
Doctor: dangling-reference, at ``make_local_attention_virtual_batches`` (the per-step tensors it allocates are
what the FULL graph addresses after their owner, the capture's metadata, has released them).
Fix (upstream): ``ChunkedLocalAttentionBuilder`` overrides ``get_cudagraph_support`` to return
``AttentionCGSupport.NEVER``; vLLM downgrades FULL_AND_PIECEWISE to PIECEWISE ("attention is compiled
piecewise"): attention, with the metadata built for the step, runs eagerly between the graph pieces.
(Only the PR description was read, not the diff; the builder/backend structure follows vLLM's
``chunked_local_attention.py`` and ``flashinfer.py``. Tiny model: one chunked local attention layer,
chunk 4, block size 2, one decode graph of 4 requests.)
"""
from __future__ import annotations

import dataclasses
import enum
import math
from types import SimpleNamespace

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events, reuse_freed_blocks
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/28739"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "make_local_attention_virtual_batches"
SYMPTOM = "Llama 4 chunked local attention replayed from FULL decode graphs: incorrect outputs"

VOCAB, DIM = 16, 8
BLOCK_SIZE, ATTENTION_CHUNK_SIZE = 2, 4
PAGES_PER_LOCAL_BLOCK = ATTENTION_CHUNK_SIZE // BLOCK_SIZE
MAX_MODEL_LEN, MAX_NUM_REQS = 12, 4
MAX_BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ          # block 0: the null block
PAD_SLOT = NUM_BLOCKS * BLOCK_SIZE                          # an extra cache row for padded/dummy tokens
CUDAGRAPH_CAPTURE_SIZES = [4]                               # decode graphs: 4 requests of one token
MAX_NUM_TOKENS = 16

_forward_context = SimpleNamespace(attn_metadata=None)


def get_forward_context():
    return _forward_context


class AttentionCGSupport(enum.IntEnum):
    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: list
    seq_lens: torch.Tensor
    seq_lens_cpu: list
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


class AttentionMetadataBuilder:
    _cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return cls._cudagraph_support


def can_use_trtllm_attention(vllm_config) -> bool:
    return vllm_config.kv_cache_dtype == "fp8"        # stand-in for the platform / KV-dtype checks


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # The TRTLLM-gen decode kernels take any uniform batch; FlashInfer's own kernels one token per request.
        if can_use_trtllm_attention(vllm_config):
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, vllm_config, device):
        self.vllm_config, self.device = vllm_config, device

    def build(self, cm: CommonAttentionMetadata):
        # The TRTLLM decode path hands the kernel the runner's block table and sequence lengths as they are:
        # views of persistent buffers, which a FULL graph may keep.
        return SimpleNamespace(num_actual_tokens=cm.num_actual_tokens, query_start_loc=cm.query_start_loc,
                               seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
                               slot_mapping=cm.slot_mapping, max_seq_len=cm.max_seq_len)


def make_local_attention_virtual_batches(attn_chunk_size: int, cm: CommonAttentionMetadata, block_size: int):
    """Split each request's queries at the attention-chunk boundaries: one virtual batch per (request, chunk),
    attending to its chunk's keys only. Host arithmetic on the CPU copies, then new device tensors."""
    cu_q, seqlens_k, rows, first_block = [0], [], [], []
    for i in range(cm.num_reqs):
        q_len = cm.query_start_loc_cpu[i + 1] - cm.query_start_loc_cpu[i]
        seq_len = cm.seq_lens_cpu[i]
        pos = seq_len - q_len
        while pos < seq_len:
            chunk_start = pos // attn_chunk_size * attn_chunk_size
            chunk_end = min(chunk_start + attn_chunk_size, seq_len)
            cu_q.append(cu_q[-1] + chunk_end - pos)
            seqlens_k.append(chunk_end - chunk_start)
            rows.append(i)
            first_block.append(chunk_start // block_size)
            pos = chunk_end
    device = cm.query_start_loc.device
    pages = attn_chunk_size // block_size
    batch_indices = torch.tensor(rows, device=device)
    block_indices = (torch.tensor(first_block, device=device)[:, None]
                     + torch.arange(pages, device=device)[None, :]).clamp(max=MAX_BLOCKS_PER_REQ - 1)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(cu_q, device=device), query_start_loc_cpu=cu_q,
        seq_lens=torch.tensor(seqlens_k, device=device), seq_lens_cpu=seqlens_k,
        num_reqs=len(rows), num_actual_tokens=cm.num_actual_tokens,
        max_query_len=max(b - a for a, b in zip(cu_q, cu_q[1:])), max_seq_len=max(seqlens_k),
        block_table_tensor=cm.block_table_tensor[batch_indices[:, None], block_indices],
        slot_mapping=cm.slot_mapping)


def create_chunked_local_attention_backend(underlying_builder, attention_chunk_size, block_size, variant):
    class ChunkedLocalAttentionBuilder(underlying_builder):
        _cudagraph_support = AttentionCGSupport.NEVER

        if variant == "fix":
            @classmethod
            def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
                return AttentionCGSupport.NEVER

        def build(self, cm: CommonAttentionMetadata):
            local = make_local_attention_virtual_batches(attention_chunk_size, cm, block_size)
            return super().build(local)

    return ChunkedLocalAttentionBuilder


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)


def trtllm_batch_decode_with_kv_cache(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                      scale):
    """Paged attention per (virtual) request: query row t of request b sees that request's first ``seq_lens[b]``
    keys through ``block_tables[b]``, causally."""
    t = torch.arange(query.shape[0], device=query.device)
    b = (torch.searchsorted(query_start_loc, t, right=True) - 1).clamp(0, seq_lens.shape[0] - 1)
    q_len = query_start_loc[b + 1] - query_start_loc[b]
    qpos = seq_lens[b] - q_len + (t - query_start_loc[b])
    j = torch.arange(ATTENTION_CHUNK_SIZE, device=query.device)
    slots = block_tables[b][:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
    slots = slots.clamp(0, PAD_SLOT)        # a kernel reads wherever the page ids point; the model stays in the cache
    scores = (query[:, None, :] * key_cache[slots]).sum(-1) * scale
    scores = scores.masked_fill(j[None, :] > qpos[:, None], float("-inf"))
    return (torch.softmax(scores, -1)[..., None] * value_cache[slots]).sum(1)


class Llama4Attention:
    """One chunked-local attention layer; its KV cache is the runner's persistent state."""

    def __init__(self, device):
        gen = generator(28739)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_MODEL_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.key_cache = torch.zeros(PAD_SLOT + 1, DIM, device=device)
        self.value_cache = torch.zeros(PAD_SLOT + 1, DIM, device=device)
        self.scale = 1.0 / math.sqrt(DIM)

    def unified_attention(self, query, key, value):
        """The attention custom op (a splitting op): reads this step's metadata from the forward context."""
        attn_metadata = get_forward_context().attn_metadata
        n = attn_metadata.num_actual_tokens
        reshape_and_cache_flash(key[:n], value[:n], self.key_cache, self.value_cache, attn_metadata.slot_mapping[:n])
        return trtllm_batch_decode_with_kv_cache(query, self.key_cache, self.value_cache, attn_metadata.block_table,
                                                 attn_metadata.seq_lens, attn_metadata.query_start_loc, self.scale)


class GPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.model = Llama4Attention(device)
        self.vllm_config = SimpleNamespace(kv_cache_dtype="fp8",
                                           cudagraph_mode="FULL_AND_PIECEWISE" if graphed else "NONE")
        builder_cls = create_chunked_local_attention_backend(FlashInferMetadataBuilder, ATTENTION_CHUNK_SIZE,
                                                             BLOCK_SIZE, variant)
        self.builder = builder_cls(self.vllm_config, device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.long, device=device)
        self.block_table_cpu = [[0] * MAX_BLOCKS_PER_REQ for _ in range(MAX_NUM_REQS)]
        self.manager = None
        if graphed:
            mode = self._check_and_update_cudagraph_mode(builder_cls)
            # on_freed="reuse": freed memory a graph still addresses goes to the next allocation of its size,
            # as CUDA's caching allocator hands blocks on (no fault, whatever lands there is read)
            self.manager = GraphManager(self._model_forward, CUDAGRAPH_CAPTURE_SIZES, device=device, mode=mode,
                                        name="GPUModelRunner (decode cudagraphs)", on_freed="reuse",
                                        static_buffers={"input_ids": self.input_ids, "positions": self.positions,
                                                        "slot_mapping": self.slot_mapping,
                                                        "query_start_loc": self.query_start_loc,
                                                        "seq_lens": self.seq_lens, "block_table": self.block_table})
            self.attention = self.manager.eager(self.model.unified_attention)
        else:
            self.attention = self.model.unified_attention

    def _check_and_update_cudagraph_mode(self, builder_cls) -> CUDAGraphMode:
        min_cg_support = builder_cls.get_cudagraph_support(self.vllm_config, kv_cache_spec=None)
        if min_cg_support == AttentionCGSupport.NEVER:
            # FULL_AND_PIECEWISE is not supported with ChunkedLocalAttentionBuilder (support: NEVER);
            # setting cudagraph_mode=PIECEWISE because attention is compiled piecewise.
            return CUDAGraphMode.PIECEWISE
        return CUDAGraphMode.FULL                       # uniform decode batches replay FULL graphs

    def _model_forward(self, num_tokens):
        m = self.model
        h = m.emb[self.input_ids[:num_tokens]] + m.pos[self.positions[:num_tokens]]
        attn = self.attention(h @ m.wq, h @ m.wk, h @ m.wv)
        return h + attn @ m.wo

    def _prepare_inputs(self, reqs):
        """``reqs``: (request row, new tokens, tokens already cached); returns the step's common metadata."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for row, new, cached in reqs:
            ids += new
            pos += range(cached, cached + len(new))
            slots += [int(self.block_table_cpu[row][p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(cached, cached + len(new))]
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(cached + len(new))
        n, num_reqs = len(ids), len(reqs)
        self.input_ids[:n].copy_(t(ids))
        self.positions[:n].copy_(t(pos))
        self.slot_mapping[:n].copy_(t(slots))
        self.query_start_loc[:num_reqs + 1].copy_(t(qsl))
        self.seq_lens[:num_reqs].copy_(t(seq_lens))
        self.block_table[:num_reqs].copy_(t([self.block_table_cpu[row] for row, _, _ in reqs]))
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:num_reqs + 1], query_start_loc_cpu=qsl,
            seq_lens=self.seq_lens[:num_reqs], seq_lens_cpu=seq_lens, num_reqs=num_reqs, num_actual_tokens=n,
            max_query_len=max(len(new) for _, new, _ in reqs), max_seq_len=max(seq_lens),
            block_table_tensor=self.block_table[:num_reqs], slot_mapping=self.slot_mapping[:n])

    def capture_model(self):
        # _dummy_run: a uniform decode batch of 4 one-token requests on the null block, writing the pad slot
        cm = self._prepare_inputs([(r, [0], 0) for r in range(MAX_NUM_REQS)])
        self.slot_mapping[:MAX_NUM_REQS].fill_(PAD_SLOT)
        _forward_context.attn_metadata = self.builder.build(cm)
        events.persistent_state("GPUModelRunner (decode cudagraphs)",
                                {"key_cache": self.model.key_cache, "value_cache": self.model.value_cache})
        self.manager.capture()
        _forward_context.attn_metadata = None           # the dummy run's metadata goes with it

    def execute_model(self, reqs):
        cm = self._prepare_inputs(reqs)
        _forward_context.attn_metadata = self.builder.build(cm)
        n = cm.num_actual_tokens
        uniform_decode = all(len(new) == 1 for _, new, _ in reqs)
        size = self.manager.dispatch(n) if self.manager is not None and uniform_decode else None
        if size is not None:
            hidden = self.manager.replay(size, n)
        else:
            hidden = self._model_forward(n)
        _forward_context.attn_metadata = None
        last = self.query_start_loc[1:len(reqs) + 1] - 1
        return (hidden[last] @ self.model.lm_head).clone()


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(28604)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 5, 2, 4)]
    decode = torch.randint(0, VOCAB, (4, 4), generator=gen).tolist()

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, graphed)
        if graphed:
            runner.capture_model()
        # request r owns blocks 1 + r * MAX_BLOCKS_PER_REQ, ...
        runner.block_table_cpu = [[1 + r * MAX_BLOCKS_PER_REQ + i for i in range(MAX_BLOCKS_PER_REQ)]
                                  for r in range(MAX_NUM_REQS)]
        with reuse_freed_blocks():
            outs = [runner.execute_model([(r, p, 0) for r, p in enumerate(prompts)])]  # prefill: 14 tokens, eager
            for step in range(4):                                                    # uniform decode of 4
                outs.append(runner.execute_model([(r, [decode[step][r]], len(p) + step)
                                                  for r, p in enumerate(prompts)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
