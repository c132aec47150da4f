"""LMDeploy's decode-graph buffers pick the FA3 spec-decoding path from the graph's query length, so a dLLM (blocks of 4 query tokens per sequence) builds FA3 scheduler metadata the eager step never builds, from a ``max_kv_seqlen`` nothing set.

Upstream: https://github.com/InternLM/lmdeploy/pull/4159 ("fix dllm when fa3 installed", InternLM/lmdeploy, commit
f363babf5, 2025-11-27, merged; no description). The bug came in the day before with
https://github.com/InternLM/lmdeploy/pull/3945 ("[Feature]: Support speculative decoding", commit c77593721).
Read: the commit's diff of ``lmdeploy/pytorch/models/utils/cudagraph.py``, ``backends/cuda/graph_runner.py`` and
``backends/cuda/op_backend.py``, and at the parent commit: the whole ``cudagraph.py`` (``make_buffers_cudagraph``,
``fill_buffers_cudagraph``), ``graph_runner.py`` (``CUDASingleGraphRunner.capture``/``forward``,
``CUDAGraphRunner.get_graph_key``/``__call__``), ``op_backend.py`` (``update_step_context``,
``update_meta_flashattn``, ``_get_meta_flashattn``), ``attention.py`` (``TritonAttentionMetadata`` with
``max_kv_seqlen: int = None``; ``TritonAttentionBuilder.build``: ``_enable_fa3`` is off when ``block_sparse_size !=
1``), ``models/sdar.py`` (attention built with ``block_sparse_size=dllm_block_length``), ``configurations/sdar.py``
(``model_paradigm = 'dllm'``), ``strategies/dllm`` (dummy inputs and ``max_tokens`` of ``block_size`` tokens per
sequence) and ``engine/model_agent.py`` (``warmup``: one dummy decoding forward per capture batch size). Also read:
FA3's ``flash_attn_interface.get_scheduler_metadata`` (it forwards ``max_seqlen_k`` to the compiled op). Not read:
the compiled op; that it rejects ``None`` is inferred from its integer parameter, and the failure seen upstream is
not described anywhere.
Symptom (inferred from the code; the PR gives only its title): an SDAR (dLLM) model served by the PyTorch engine with
CUDA graphs on a machine where FlashAttention-3 is installed fails at start-up, in the decoding-graph warmup; in
eager mode it serves.
Mechanism: the eager step context (``CudaOpsBackend.update_step_context``) builds FA3 decoding metadata only when
``model_paradigm == 'ar_spec'`` (``update_meta_flashattn`` then sets ``scheduler_metadata`` and
``max_kv_seqlen``); a dLLM gets neither and its block-sparse attention runs the Triton kernels. The graph path
decides again, on its own: ``make_buffers_cudagraph`` and ``fill_buffers_cudagraph`` take ``use_flash_attn3_decoding
= decode_query_len > 1 and not use_flash_mla``. The graph key's query length is tokens per sequence, which for a dLLM
decode step is the block length (4), so every dLLM decode graph takes the spec-decoding branch: it calls FA3's
``get_scheduler_metadata(..., max_seqlen_k=attn_metadata.max_kv_seqlen, ...)`` with the ``None`` the eager path
left there. The first capture (the warmup's dummy decoding batch) dies; had it not, the captured step would carry
FA3 metadata the eager step never has.
Doctor: warmup-divergence, at fill_buffers_cudagraph. What the captured step is built from is decided on the graph
path by a different rule (query length) from the eager step context's (model paradigm), so the graph path runs
host-side metadata work the eager step does not, on inputs the eager step never prepared.
Fix (upstream): ``CUDASingleGraphRunner`` puts ``use_flash_mla=model_config.use_flash_mla`` and
``use_fa3_decoding=model_config.model_paradigm == 'ar_spec'`` into ``CudaGraphMeta``; ``make_buffers_cudagraph`` and
``fill_buffers_cudagraph`` read those two flags (FlashMLA ``if``, FA3 ``elif``) instead of re-deriving them; and
``update_step_context`` turns its second ``if`` into ``elif`` so FlashMLA and FA3 metadata are never both built.
Modelled: ``ModelConfig`` (paradigm, FlashMLA flag), ``TritonAttentionMetadata``, ``update_step_context`` /
``update_meta_flashattn`` (the eager rule), ``CudaGraphMeta``, ``CudaGraphMixin`` (``make_buffers_cudagraph``,
``fill_buffers_cudagraph`` with the pre-fix and fixed rule, ``make_output_buffers``, ``get_outputs_cudagraph``),
``CUDASingleGraphRunner`` (``capture``, ``forward``), ``CUDAGraphRunner`` (graph key = bucket, decoding, no
microbatch, query length; capture on first use, whose output the warmup discards) and ``BaseModelAgent.warmup``
(dummy decoding batch per bucket, largest first, all rows on dummy block 0). Stand-ins: ``get_scheduler_metadata``
checks its integer arguments as the compiled op would (``None`` raises ``TypeError``) and returns per-row tile
counts; the model is one attention layer (embedding + sinusoidal positions, q/k/v/o, lm_head applied outside the
graph); the block-sparse Triton attention writes the step's K/V at ``kv_seqlen - q_seqlen + i`` through the block
table and lets each token see every cached position in its own or an earlier dLLM block; unmasking is a fixed
schedule of token ids; float64.
Workload: dLLM block length 4, KV blocks of 4 tokens, 3 blocks per sequence, capture batch sizes 1 and 2 (every
decode batch fills its bucket, so no row is padded); eager prefill of A (4 tokens) and B (8); decode steps [A, B]
twice (two denoising passes over the same block), then [A] twice on A's next block (B has finished). The bug raises
TypeError in the warmup capture of the batch-2 graph; the fix captures both graphs, replays them for all four
steps, and every step equals eager (max error 0).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/4159"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "fill_buffers_cudagraph"
SYMPTOM = ("a dLLM (SDAR) served with CUDA graphs fails at the decoding-graph warmup when FA3 is installed: the graph "
           "buffers take the FA3 spec-decoding path from query length 4 and call get_scheduler_metadata with "
           "max_seqlen_k=None")

VOCAB, HIDDEN, HEAD_DIM = 16, 8, 8
MASK_ID = VOCAB - 1
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 4, 3, 16          # KV pages; block 0 is the warmup's dummy block
DLLM_BLOCK_LENGTH = 4                                 # tokens per sequence in a dLLM decode step
CAPTURE_BATCH_SIZES = (1, 2)
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class ModelConfig:
    vocab_size: int = VOCAB
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = HEAD_DIM
    model_paradigm: str = 'dllm'                       # configurations/sdar.py
    use_flash_mla: bool = False
    dllm_block_length: int = DLLM_BLOCK_LENGTH


@dataclasses.dataclass
class TritonAttentionMetadata:
    is_decoding: bool
    block_offsets: torch.Tensor
    q_start_loc: torch.Tensor = None
    q_seqlens: torch.Tensor = None
    kv_seqlens: torch.Tensor = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    # flash attn
    scheduler_metadata: torch.Tensor = None
    max_kv_seqlen: int = None


# --- flash_attn_interface (FA3, installed) ---------------------------------------------------------------------------

def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens, qkv_dtype=torch.bfloat16, page_size=None, causal=False,
                           window_size=(-1, -1)):
    """Stand-in for FA3's scheduler metadata: the compiled op takes plain integers (a ``None`` is rejected)."""
    for name, value in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                        ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("headdim", headdim)):
        if not isinstance(value, int):
            raise TypeError(f"get_scheduler_metadata(): incompatible function arguments: {name}={value!r} "
                            "is not an int")
    tiles = torch.div(cache_seqlens[:batch_size] + 127, 128, rounding_mode="floor").to(torch.int32)
    return torch.nn.functional.pad(tiles.cumsum(0, dtype=torch.int32), (1, 0))


# --- lmdeploy/pytorch/backends/cuda/op_backend.py --------------------------------------------------------------------

def update_meta_flashattn(attn_metadata, step):
    batch_size = attn_metadata.q_seqlens.size(0)
    attn_metadata.scheduler_metadata = get_scheduler_metadata(
        batch_size, step["input_ids"].size(1) // batch_size, step["max_kv_seqlen"], step["config"].num_attention_heads,
        step["config"].num_key_value_heads, step["config"].head_dim, attn_metadata.kv_seqlens.to(torch.int32),
        page_size=BLOCK_SIZE)
    attn_metadata.max_kv_seqlen = step["max_kv_seqlen"]
    return attn_metadata


def update_step_context(step):
    """The eager rule: FA3 decoding metadata only for the speculative-decoding paradigm."""
    config = step["config"]
    q_seqlens, kv_seqlens = step["q_seqlens"], step["kv_seqlens"]
    use_flash_attn3_decoding = config.model_paradigm == 'ar_spec'
    pad = torch.nn.functional.pad
    attn_metadata = TritonAttentionMetadata(step["is_decoding"], step["block_offsets"],
                                            q_start_loc=q_seqlens.cumsum(0) - q_seqlens, q_seqlens=q_seqlens,
                                            kv_seqlens=kv_seqlens,
                                            cu_seqlens_q=pad(q_seqlens.cumsum(0, dtype=torch.int32), (1, 0)),
                                            cu_seqlens_k=pad(kv_seqlens.cumsum(0, dtype=torch.int32), (1, 0)))
    if config.use_flash_mla:
        raise NotImplementedError("FlashMLA is not modelled")
    elif use_flash_attn3_decoding and step["is_decoding"]:
        attn_metadata = update_meta_flashattn(attn_metadata, step)
    return dict(input_ids=step["input_ids"], position_ids=step["position_ids"],
                past_key_values=step["past_key_values"], attn_metadata=attn_metadata)


# --- lmdeploy/pytorch/models/utils/cudagraph.py ----------------------------------------------------------------------

@dataclasses.dataclass
class CudaGraphMeta:
    """Meta info of cudagraph."""
    max_batchs: int
    max_tokens: int
    num_blocks: int
    is_decoding: int
    device: str
    input_buffers: dict = None
    output_buffers: dict = None
    vocab_size: int = 1
    decode_query_len: int = 1
    use_flash_mla: bool = False                        # the fix: taken from the model config
    use_fa3_decoding: bool = False


class CudaGraphMixin:
    """Mixin class to support cudagraph."""

    def _graph_uses_fa3(self, graph_meta):
        if _variant == "fix":
            return graph_meta.use_fa3_decoding
        # use fa3 decode kernel for spec decode
        use_flash_mla = getattr(self.config, 'use_flash_mla', False)
        return graph_meta.decode_query_len > 1 and not use_flash_mla

    def make_output_buffers(self, output):
        return dict(hidden_states=output)

    def make_buffers_cudagraph(self, graph_meta: CudaGraphMeta, *args, **kwargs):
        max_batches, max_tokens, device = graph_meta.max_batchs, graph_meta.max_tokens, graph_meta.device
        input_buffers = dict()
        input_buffers['input_ids'] = torch.randint(0, graph_meta.vocab_size, (1, max_tokens),
                                                   generator=self._pad_gen).to(device)
        input_buffers['position_ids'] = torch.zeros((1, max_tokens), dtype=torch.int64, device=device)
        if self._graph_uses_fa3(graph_meta):
            input_buffers['scheduler_metadata'] = torch.zeros(max_batches + 1, dtype=torch.int32, device=device)
        input_buffers['block_offsets'] = torch.zeros((max_batches, graph_meta.num_blocks), dtype=torch.int32,
                                                     device=device)
        input_buffers['qkv_lens'] = torch.zeros(3, max_batches, dtype=torch.int32, device=device)
        input_buffers['q_start_loc'] = input_buffers['qkv_lens'][0]
        input_buffers['q_seqlens'] = input_buffers['qkv_lens'][1]
        input_buffers['kv_seqlens'] = input_buffers['qkv_lens'][2]
        input_buffers['cu_seqlens'] = torch.zeros(2, max_batches + 1, dtype=torch.int32, device=device)
        input_buffers['cu_seqlens_q'] = input_buffers['cu_seqlens'][0]
        input_buffers['cu_seqlens_k'] = input_buffers['cu_seqlens'][1]
        return input_buffers

    def fill_buffers_cudagraph(self, graph_meta: CudaGraphMeta, input_ids, position_ids, past_key_values,
                               attn_metadata: TritonAttentionMetadata, **kwargs):
        """Fill cudagraph buffers from forward inputs."""
        block_offsets = attn_metadata.block_offsets
        input_buffers = graph_meta.input_buffers
        batch_size, num_blocks = block_offsets.size()
        num_tokens = input_ids.size(-1)
        decode_query_len = graph_meta.decode_query_len
        input_buffers['input_ids'].copy_(torch.randint(0, graph_meta.vocab_size, (1, graph_meta.max_tokens),
                                                       generator=self._pad_gen))      # random_ padding ids
        input_buffers['input_ids'][:, :num_tokens] = input_ids
        input_buffers['position_ids'][:, :num_tokens] = position_ids
        input_buffers['block_offsets'][:batch_size, :num_blocks] = block_offsets

        qkv = torch.stack((attn_metadata.q_start_loc, attn_metadata.q_seqlens, attn_metadata.kv_seqlens))
        input_buffers['qkv_lens'].zero_()
        input_buffers['q_seqlens'].fill_(graph_meta.max_tokens // graph_meta.max_batchs)
        input_buffers['qkv_lens'][:, :batch_size] = qkv
        input_buffers['cu_seqlens_q'][1:batch_size + 1] = input_buffers['q_seqlens'][:batch_size].cumsum(0)
        input_buffers['cu_seqlens_k'][1:batch_size + 1] = input_buffers['kv_seqlens'][:batch_size].cumsum(0)

        attn_metadata.block_offsets = input_buffers['block_offsets']
        attn_metadata.q_start_loc = input_buffers['q_start_loc']
        attn_metadata.q_seqlens = input_buffers['q_seqlens']
        attn_metadata.kv_seqlens = input_buffers['kv_seqlens']
        attn_metadata.cu_seqlens_q = input_buffers['cu_seqlens_q']
        attn_metadata.cu_seqlens_k = input_buffers['cu_seqlens_k']

        if self._graph_uses_fa3(graph_meta):                # FlashMLA branch omitted (not used by this model)
            scheduler_metadata = get_scheduler_metadata(
                batch_size=batch_size, max_seqlen_q=decode_query_len, max_seqlen_k=attn_metadata.max_kv_seqlen,
                num_heads_q=self.config.num_attention_heads, num_heads_kv=self.config.num_key_value_heads,
                headdim=self.config.head_dim, cache_seqlens=attn_metadata.kv_seqlens.to(torch.int32),
                qkv_dtype=DTYPE, page_size=BLOCK_SIZE)
            input_buffers['scheduler_metadata'].zero_()
            input_buffers['scheduler_metadata'][:batch_size + 1].copy_(scheduler_metadata[:batch_size + 1])
            attn_metadata.scheduler_metadata = input_buffers['scheduler_metadata']

        return dict(past_key_values=past_key_values, attn_metadata=attn_metadata,
                    input_ids=input_buffers['input_ids'], position_ids=input_buffers['position_ids'])

    def get_outputs_cudagraph(self, output_buffers, input_ids, **kwargs):
        return output_buffers['hidden_states'][:input_ids.size(-1)]


# --- the model (stand-in for SDARForCausalLM) and its block-sparse Triton attention ----------------------------------

def block_sparse_attention(q, k, v, k_cache, v_cache, attn_metadata: TritonAttentionMetadata):
    """fill_kv_cache at ``kv_seqlen - q_seqlen + i``, then every query sees the cached positions of its own and all
    earlier dLLM blocks (the Triton path; FA3 is off for ``block_sparse_size != 1``)."""
    bs, max_blocks = attn_metadata.block_offsets.shape
    qlen = q.size(0) // bs
    history = (attn_metadata.kv_seqlens - attn_metadata.q_seqlens).long()
    pos = history[:, None] + torch.arange(qlen, device=q.device)[None, :]                 # [bs, qlen]
    table = attn_metadata.block_offsets.long()
    slots = table.gather(1, torch.div(pos, BLOCK_SIZE, rounding_mode="floor")) * BLOCK_SIZE + pos % BLOCK_SIZE
    k_cache.index_copy_(0, slots.reshape(-1), k)
    v_cache.index_copy_(0, slots.reshape(-1), v)
    ctx = torch.arange(max_blocks * BLOCK_SIZE, device=q.device)
    kv_slots = table[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE                 # [bs, L]
    scores = torch.einsum("bqd,bld->bql", q.view(bs, qlen, -1), k_cache[kv_slots]) / math.sqrt(HEAD_DIM)
    same_or_earlier_block = (ctx[None, None, :] // DLLM_BLOCK_LENGTH) <= (pos[:, :, None] // DLLM_BLOCK_LENGTH)
    visible = same_or_earlier_block & (ctx[None, None, :] < attn_metadata.kv_seqlens[:, None, None].long())
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bql,bld->bqd", probs, v_cache[kv_slots]).reshape(bs * qlen, -1)


class SDARForCausalLM(CudaGraphMixin):
    def __init__(self, device):
        self.config = ModelConfig()
        gen = generator(4159)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HEAD_DIM) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB)
        self.inv_freq = (1.0 / 10.0 ** (torch.arange(HIDDEN, dtype=DTYPE) / HIDDEN)).to(device)
        self._pad_gen = torch.Generator().manual_seed(41590)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata: TritonAttentionMetadata, **kwargs):
        """Returns hidden states (the lm_head runs outside the graph, as ``get_logits`` does)."""
        k_cache, v_cache = past_key_values
        h = self.embed_tokens[input_ids[0]] + torch.sin(position_ids[0, :, None].to(DTYPE) * self.inv_freq)
        o = block_sparse_attention(h @ self.wq, h @ self.wk, h @ self.wv, k_cache, v_cache, attn_metadata)
        return h + o @ self.wo

    def get_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- lmdeploy/pytorch/backends/cuda/graph_runner.py ------------------------------------------------------------------

class CUDASingleGraphRunner:
    def __init__(self, model, max_batches, max_tokens, num_blocks, is_decoding, pool, model_config, device,
                 decode_query_len=1):
        self.model, self.pool, self.device = model, pool, device
        self.meta = CudaGraphMeta(max_batchs=max_batches, max_tokens=max_tokens, num_blocks=num_blocks,
                                  is_decoding=is_decoding, device=device, input_buffers=dict(),
                                  output_buffers=dict(), vocab_size=model_config.vocab_size,
                                  decode_query_len=decode_query_len,
                                  # the fix's two flags (the pre-fix mixin re-derives them instead)
                                  use_flash_mla=model_config.use_flash_mla,
                                  use_fa3_decoding=model_config.model_paradigm == 'ar_spec')
        self._graph = None

    def capture(self, **kwargs):
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta, **kwargs)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        k_cache, v_cache = kwargs['past_key_values']
        self._graph, output = capture(lambda: self.model.forward(**padded_kwargs), device=self.device,
                                      pool=self.pool, warmups=1, name=f"decode bs {self.meta.max_batchs}",
                                      owner="lmdeploy CUDAGraphRunner", static=self.meta.input_buffers,
                                      state={"k_cache": k_cache, "v_cache": v_cache})
        self.meta.output_buffers = self.model.make_output_buffers(output)

    def forward(self, **kwargs):
        self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        batch_size = kwargs['attn_metadata'].block_offsets.size(0)
        # tokens are rows of the [max_tokens, hidden] output; every decode batch here fills its bucket
        rows = kwargs['input_ids'].size(-1)
        hidden = replay(self._graph, self.meta.output_buffers['hidden_states'], real=rows,
                        size=self.meta.max_tokens)
        assert batch_size == self.meta.max_batchs
        return self.model.get_outputs_cudagraph({'hidden_states': hidden}, **kwargs)


class CUDAGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.model_config = model.config
        self.graph_pool_handle = graph_pool_handle(device)
        self._runner_map = {}

    def get_graph_key(self, input_ids, attn_metadata, **kwargs):
        batch_size = attn_metadata.q_seqlens.size(0)
        query_len = input_ids.size(1) // batch_size      # for the draft model to tell its inputs apart
        bucket = next(bs for bs in CAPTURE_BATCH_SIZES if bs >= batch_size)
        return (bucket, attn_metadata.is_decoding, False, query_len)

    def __call__(self, **kwargs):
        if not kwargs['attn_metadata'].is_decoding:           # support_cuda_graph: decoding only
            return self.model.forward(**kwargs)
        graph_key = self.get_graph_key(**kwargs)
        max_batches, is_decoding, _, decode_query_len = graph_key
        if graph_key not in self._runner_map:
            runner = CUDASingleGraphRunner(self.model, max_batches=max_batches,
                                           max_tokens=max_batches * self.model_config.dllm_block_length,
                                           num_blocks=MAX_BLOCKS, is_decoding=is_decoding,
                                           pool=self.graph_pool_handle, model_config=self.model_config,
                                           device=self.device, decode_query_len=decode_query_len)
            runner.capture(**kwargs)
            self._runner_map[graph_key] = runner
            return None                                   # lmdeploy returns the eager warmup's output here
        return self._runner_map[graph_key].forward(**kwargs)


# --- the engine: warmup, prefill, dLLM decoding ----------------------------------------------------------------------

def make_step(config, caches, device, ids, positions, q_seqlens, kv_seqlens, block_offsets, is_decoding):
    q_seqlens = torch.tensor(q_seqlens, dtype=torch.int32, device=device)
    kv_seqlens = torch.tensor(kv_seqlens, dtype=torch.int32, device=device)
    return dict(config=config, past_key_values=caches, is_decoding=is_decoding,
                input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
                q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, max_kv_seqlen=int(kv_seqlens.max()),
                block_offsets=torch.tensor(block_offsets, dtype=torch.int32, device=device))


def warmup(runner, config, caches, device):
    """BaseModelAgent.warmup: one dummy decoding forward per capture batch size (largest first), block 0."""
    for bs in sorted(CAPTURE_BATCH_SIZES, reverse=True):
        n = config.dllm_block_length
        ids = torch.randint(0, VOCAB, (bs * n,), generator=torch.Generator().manual_seed(bs)).tolist()
        step = make_step(config, caches, device, ids, list(range(n)) * bs, [n] * bs, [n] * bs, [[0]] * bs, True)
        runner(**update_step_context(step))


BLOCK_TABLE = {"A": [1, 2, 3], "B": [4, 5, 6]}
PROMPTS = {"A": 4, "B": 8}
# (sequences, denoising pass) per decode step; A moves to its next block after step 2, B has finished by then
SCHEDULE = [(["A", "B"], 0), (["A", "B"], 1), (["A"], 0), (["A"], 1)]


def token(seq, pos, unmasked=True):
    return (5 * "AB".index(seq) + 3 * pos + 2) % (VOCAB - 1) if unmasked else MASK_ID


def serve(device, use_cuda_graph):
    model = SDARForCausalLM(device)
    config = model.config
    caches = (torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, dtype=DTYPE, device=device),
              torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, dtype=DTYPE, device=device))
    runner = CUDAGraphRunner(model, device) if use_cuda_graph else None
    if runner is not None:
        warmup(runner, config, caches, device)
    for seq, n in PROMPTS.items():                       # prefill runs eagerly
        step = make_step(config, caches, device, [token(seq, p) for p in range(n)], list(range(n)), [n], [n],
                         [BLOCK_TABLE[seq]], False)
        model.forward(**update_step_context(step))
    history, outs, n = dict(PROMPTS), [], DLLM_BLOCK_LENGTH
    for seqs, denoise in SCHEDULE:
        if denoise == 0 and seqs == ["A"]:
            history["A"] += n                             # A's previous block is committed
        ids = [token(s, history[s] + i, unmasked=i < 2 * denoise) for s in seqs for i in range(n)]
        positions = [history[s] + i for s in seqs for i in range(n)]
        step = make_step(config, caches, device, ids, positions, [n] * len(seqs),
                         [history[s] + n for s in seqs], [BLOCK_TABLE[s] for s in seqs], True)
        inputs = update_step_context(step)
        hidden = runner(**inputs) if runner is not None else model.forward(**inputs)
        outs.append(model.get_logits(hidden).clone())
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(device, True),
                   lambda: serve(device, False))
