"""TurboQuant KV cache + MTP: FULL cudagraphs capture spec-decode verify batches through a per-request Python prefill loop, whose host-side plan (the dummy capture's sequence lengths) every replay repeats.

Upstream: https://github.com/vllm-project/vllm/pull/53406 ("[Bugfix] Do not FULL-capture spec-decode batches in
TurboQuant attention backend", vllm-project/vllm, opened 2026-08-22, open when read; fixes vllm#52475). Read: the PR
description (``TurboQuantMetadataBuilder`` declares ``_cudagraph_support = UNIFORM_BATCH`` yet
``supports_spec_as_decode=False``; ``UNIFORM_BATCH`` lets the runner FULL-capture uniform verify batches of
``1 + num_speculative_tokens`` tokens, ``reorder_batch_threshold=1`` sends every batch with ``max_query_len > 1`` to
``_prefill_attention``, whose loop iterates ``query_start_loc_cpu.tolist()`` / ``seq_lens_cpu.tolist()``, so
"capture bakes in the dummy metadata from ``build_for_cudagraph_capture``, which fills ``seq_lens`` with 1"; with
query_len 4 and seq_len 1 ``cached_len`` is negative; K=3 collapses into repetition, K=1 dies with an illegal memory
access); the issue #52475 (silent repetition on ~8k-token prompts, fp8 KV fine); the follow-up #53410's description
("that fix stopped FULL cudagraph capture of spec-decode verify batches"); a stored pre-fix
``vllm/v1/attention/backends/turboquant_attn.py`` (the builder, ``build_for_cudagraph_capture``, ``build``,
``forward`` and ``_prefill_attention`` with its first-chunk fast path, ``_cu_2``, ``_arange_cache`` and the
continuation decode fast path ``synth_seq_lens = _arange_cache[cached_len + 1 : seq_len + 1]``). The diff was not
read: the fix is modelled as the title says, the builder reporting ``UNIFORM_SINGLE_TOKEN_DECODE`` so that verify
batches fall back to PIECEWISE graphs (attention eager between the pieces).
Symptom: MTP speculative decoding with any ``turboquant_*`` KV cache and FULL cudagraphs answers short prompts, then
collapses into one repeated token on longer ones; ``num_speculative_tokens: 1`` kills the engine with an illegal
memory access. Eager, or fp8 KV, is fine.
Mechanism: the verify-batch attention is planned on the host: per request, ``q_len``, ``seq_len``, ``cached_len`` and
the slice ``_arange_cache[cached_len + 1 : seq_len + 1]`` of per-token context lengths, from CPU metadata. Captured
with the dummy run's ``seq_lens`` of 1, that plan (a view of the arange holding [0, 1] for K=1) is what the graph's
decode kernels read at every replay: the first verify token of each request attends to no position (NaN here; an
illegal access upstream) and the second to the first token of the prompt, whatever the real context length.
Doctor: host-work-frozen, at _prefill_attention. Its Python loop derives the per-request lengths and the
``synth_seq_lens`` slice from host metadata once, at capture; replays repeat only the kernels that read them.
Fix (upstream): do not FULL-capture spec-decode batches: report ``UNIFORM_SINGLE_TOKEN_DECODE`` (here in
``get_cudagraph_support``), so the runner resolves decode to PIECEWISE and the loop runs eagerly every step.
Modelled: ``AttentionCGSupport``, ``CommonAttentionMetadata``, ``split_decodes_and_prefills``,
``TurboQuantMetadataBuilder`` (``build``, ``build_for_cudagraph_capture``), ``TurboQuantAttentionImpl``
(``do_kv_cache_update``, ``forward``, ``_prefill_attention`` line by line for the two branches the workload takes),
and a runner with the mode resolution, ``_dummy_run`` captures per size (FULL, or PIECEWISE pieces around the eager
attention), ``_prepare_inputs`` and ``execute_model``. Stand-ins: no TurboQuant compression (the cache stores raw K/V;
the bug is in the planning, not the quantization); ``flash_attn_varlen_func`` and
``triton_turboquant_decode_attention`` are small PyTorch equivalents (the decode stand-in returns NaN for an empty
context, where the Triton kernel faulted); one attention layer; draft tokens are fixed ids and every draft is
accepted (no sampling). float64.
Workload: K=1 (verify batches of 2 tokens per request), capture sizes [2, 4]. Step 1 prefills A (5 tokens) and B (6)
eagerly (11 tokens, above the largest capture size; first chunk, so the fast path). Steps 2 and 3 verify A and B (4
tokens), step 4 verifies A alone (2 tokens). Bug: every verify step replays a FULL graph that attends with
[0, 1]: max |graph - eager| = inf (NaN logits for every first verify token; the second ones, attending to the
prompt's first token only, off by 1.53 to 2.60 against logits of at most 1.96); the prefill step equals eager. Fix:
the verify steps run PIECEWISE graphs with the attention eager, max error 0.
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/53406"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_prefill_attention"
SYMPTOM = ("MTP + turboquant KV cache under FULL cudagraphs: verify batches replay the capture's per-request plan "
           "(dummy seq_lens 1): repetition collapse, or an illegal memory access with one speculative token")

NUM_SPECULATIVE_TOKENS = 1
UNIFORM_DECODE_QUERY_LEN = 1 + NUM_SPECULATIVE_TOKENS
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 2, 16
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 4
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
NUM_BLOCKS = 1 + MAX_NUM_SEQS * MAX_BLOCKS_PER_REQ          # block 0: the null block
NUM_HEADS, HEAD_SIZE, HIDDEN, VOCAB = 2, 4, 8, 16
CUDAGRAPH_CAPTURE_SIZES = [2, 4]
_CONTINUATION_DECODE_THRESHOLD = 128
PADDING_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


class AttentionCGSupport(enum.IntEnum):
    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


def split_decodes_and_prefills(cam, decode_threshold=1):
    if cam.max_query_len <= decode_threshold:
        return cam.num_reqs, 0, cam.num_actual_tokens, 0
    query_lens = (cam.query_start_loc_cpu[1:] - cam.query_start_loc_cpu[:-1]).tolist()
    first_prefill = next(i for i, n in enumerate(query_lens) if n > decode_threshold)
    num_decode_tokens = int(cam.query_start_loc_cpu[first_prefill])
    return first_prefill, cam.num_reqs - first_prefill, num_decode_tokens, cam.num_actual_tokens - num_decode_tokens


# --- vllm/v1/attention/backends/turboquant_attn.py -----------------------------------------------------------------------

@dataclasses.dataclass
class TurboQuantMetadata:
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    num_actual_tokens: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    is_prefill: bool = False
    num_decodes: int = 0
    num_decode_tokens: int = 0
    query_start_loc_cpu: torch.Tensor | None = None     # CPU-resident copies for the prefill path's loop
    seq_lens_cpu: torch.Tensor | None = None


class TurboQuantMetadataBuilder:
    def __init__(self):
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)

    def _init_reorder_batch_threshold(self, reorder_batch_threshold, supports_spec_as_decode):
        self.reorder_batch_threshold = (reorder_batch_threshold + NUM_SPECULATIVE_TOKENS
                                        if supports_spec_as_decode else reorder_batch_threshold)

    @classmethod
    def get_cudagraph_support(cls):
        """``AttentionMetadataBuilder.get_cudagraph_support``: the builder's ``_cudagraph_support``."""
        if _variant == "bug":
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def build_for_cudagraph_capture(self, common_attn_metadata):
        attn_metadata = self.build(0, common_attn_metadata)
        # Set seq_lens to 1 so CUDA graph capture is fast (real seq_lens are filled at replay time).
        attn_metadata.seq_lens.fill_(1)
        return attn_metadata

    def build(self, common_prefix_len, common_attn_metadata):
        cam = common_attn_metadata
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(cam, self.reorder_batch_threshold)
        return TurboQuantMetadata(
            seq_lens=cam.seq_lens, slot_mapping=cam.slot_mapping, block_table=cam.block_table_tensor,
            query_start_loc=cam.query_start_loc, num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len, max_seq_len=cam.max_seq_len, is_prefill=cam.max_query_len > 1,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            query_start_loc_cpu=cam.query_start_loc_cpu, seq_lens_cpu=cam.seq_lens_cpu_upper_bound)


def triton_turboquant_decode_attention(query, kv_cache, block_table, seq_lens, scale):
    """Stand-in: one decode row per query row, attending to ``seq_lens[r]`` positions of its paged context."""
    j = torch.arange(MAX_MODEL_LEN, device=query.device)
    blocks = block_table[:, j // BLOCK_SIZE].long()
    slots = (j % BLOCK_SIZE).expand_as(blocks)
    k, v = kv_cache[blocks, slots, 0], kv_cache[blocks, slots, 1]              # [R, L, H, D]
    scores = torch.einsum("rhd,rlhd->rhl", query, k) * scale
    scores = scores.masked_fill((j.unsqueeze(0) >= seq_lens.unsqueeze(1)).unsqueeze(1), float("-inf"))
    return torch.einsum("rhl,rlhd->rhd", torch.softmax(scores, -1), v)


class TurboQuantAttentionImpl:
    def __init__(self):
        self.num_heads, self.head_size, self.scale = NUM_HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5

    def do_kv_cache_update(self, key, value, kv_cache, slot_mapping):
        """``_store_kv`` stand-in: raw K/V (no TurboQuant packing); padded slots land in the null block."""
        kv_cache.view(-1, 2, self.num_heads, self.head_size).index_copy_(
            0, slot_mapping.clamp(min=0), torch.stack([key, value], 1))

    def _flash_attn_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        """``flash_attn_varlen_func(causal=True)`` stand-in: causal attention within each cu_seqlens segment."""
        t = torch.arange(q.shape[0], device=q.device)
        seg = torch.searchsorted(cu_seqlens_q[1:].long(), t, right=True)
        allowed = (seg.unsqueeze(0) == seg.unsqueeze(1)) & (t.unsqueeze(0) <= t.unsqueeze(1))
        scores = torch.einsum("ihd,jhd->hij", q, k) * self.scale
        return torch.einsum("hij,jhd->ihd", torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1), v)

    def forward(self, query, key, value, kv_cache, attn_metadata, output):
        N = attn_metadata.num_actual_tokens
        q = query[:N].view(N, self.num_heads, self.head_size)
        if not attn_metadata.is_prefill:
            attn_out = triton_turboquant_decode_attention(q, kv_cache, attn_metadata.block_table,
                                                          attn_metadata.seq_lens, self.scale)
        elif attn_metadata.num_decodes == 0:
            k = key[:N].view(N, self.num_heads, self.head_size)
            v = value[:N].view(N, self.num_heads, self.head_size)
            attn_out = self._prefill_attention(q, k, v, kv_cache, attn_metadata)
        else:
            raise NotImplementedError("mixed decode+prefill batches are not part of this workload")
        output[:N] = attn_out.reshape(N, -1)
        return output

    def _prefill_attention(self, query, key, value, kv_cache, attn_metadata):
        N, Hq, D = query.shape
        # Fast path: first-chunk prefills (max_query_len == max_seq_len: no request has cached KV). Python ints.
        if attn_metadata.max_query_len == attn_metadata.max_seq_len:
            return self._flash_attn_varlen(query, key, value, attn_metadata.query_start_loc,
                                           attn_metadata.query_start_loc, attn_metadata.max_query_len,
                                           attn_metadata.max_query_len)
        # Continuation: per-request attention, planned from the CPU-resident metadata.
        num_reqs = attn_metadata.query_start_loc.shape[0] - 1
        output = torch.zeros(N, Hq, D, device=query.device, dtype=query.dtype)
        qsl = attn_metadata.query_start_loc_cpu.tolist()
        seq_lens_list = attn_metadata.seq_lens_cpu.tolist()
        if not hasattr(self, "_cu_2"):
            self._cu_2 = torch.zeros(2, device=query.device, dtype=torch.int32)
        _max_seq = attn_metadata.max_seq_len
        _ac = getattr(self, "_arange_cache", None)
        if _ac is None or _ac.shape[0] <= _max_seq:
            _ac = torch.arange(0, _max_seq + 1, device=query.device, dtype=attn_metadata.seq_lens.dtype)
            self._arange_cache = _ac
        _arange_cache = _ac
        for i in range(num_reqs):
            q_start, q_end = qsl[i], qsl[i + 1]
            q_len = q_end - q_start
            if q_len <= 0:
                continue
            seq_len = seq_lens_list[i]
            q_seq, k_seq, v_seq = query[q_start:q_end], key[q_start:q_end], value[q_start:q_end]
            if q_len == seq_len:                              # first-chunk prefill of this request
                self._cu_2[1:2] = q_len
                out = self._flash_attn_varlen(q_seq, k_seq, v_seq, self._cu_2, self._cu_2, q_len, q_len)
            else:                                             # continuation: tokens already in the cache
                cached_len = seq_len - q_len
                assert q_len <= _CONTINUATION_DECODE_THRESHOLD, "large continuations (_continuation_prefill) not modelled"
                synth_seq_lens = _arange_cache[cached_len + 1: seq_len + 1]
                synth_bt = attn_metadata.block_table[i:i + 1].expand(q_len, -1)
                out = triton_turboquant_decode_attention(q_seq, kv_cache, synth_bt, synth_seq_lens, self.scale)
            output[q_start:q_end] = out.to(query.dtype)
        return output


# --- the model (one attention layer; the attention op is vLLM's splitting op) --------------------------------------------

class Model:
    def __init__(self, device):
        gen = generator(53406)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv = (r(HIDDEN, NUM_HEADS * HEAD_SIZE) for _ in range(3))
        self.wo, self.lm_head = r(NUM_HEADS * HEAD_SIZE, HIDDEN), r(HIDDEN, VOCAB, scale=0.2)

    def qkv(self, input_ids):                                  # piece before the attention split
        x = self.embed_tokens[input_ids]
        return x, x @ self.wq, x @ self.wk, x @ self.wv

    def unified_attention(self, impl, q, k, v, kv_cache, attn_metadata, output):
        n = k.shape[0]
        impl.do_kv_cache_update(k.view(n, NUM_HEADS, HEAD_SIZE), v.view(n, NUM_HEADS, HEAD_SIZE), kv_cache,
                                attn_metadata.slot_mapping)
        return impl.forward(q, k, v, kv_cache, attn_metadata, output)

    def logits(self, x, attn_output):                          # piece after the attention split
        return (x + attn_output @ self.wo) @ self.lm_head


# --- vllm/v1/worker/gpu_model_runner.py (reduced) -------------------------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, *size, device):
        self.cpu = host(torch.zeros(*size, dtype=torch.int32), device)
        self.gpu = torch.zeros(*size, dtype=torch.int32, device=device)

    def copy_to_gpu(self):
        self.gpu.copy_(self.cpu)


class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model, self.builder, self.impl = Model(device), TurboQuantMetadataBuilder(), TurboQuantAttentionImpl()
        self.kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device=device)
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_BATCHED_TOKENS,), PADDING_SLOT_ID, dtype=torch.long, device=device)
        self.attn_output = torch.zeros(MAX_NUM_BATCHED_TOKENS, NUM_HEADS * HEAD_SIZE, dtype=DTYPE, device=device)
        self.query_start_loc = CpuGpuBuffer(MAX_NUM_SEQS + 1, device=device)
        self.seq_lens = CpuGpuBuffer(MAX_NUM_SEQS, device=device)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.computed, self.graphs = {}, {}
        self.decode_cudagraph_mode = self._resolve_decode_cudagraph_mode() if use_cuda_graph else CUDAGraphMode.NONE

    def _resolve_decode_cudagraph_mode(self):
        """FULL_AND_PIECEWISE: FULL for uniform decode batches only if the backend can capture them."""
        support = self.builder.get_cudagraph_support()
        if support >= AttentionCGSupport.UNIFORM_BATCH or (
                support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE and UNIFORM_DECODE_QUERY_LEN == 1):
            return CUDAGraphMode.FULL
        return CUDAGraphMode.PIECEWISE

    def _common_metadata(self, num_reqs, num_tokens, max_query_len):
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.gpu[:num_reqs + 1],
            query_start_loc_cpu=self.query_start_loc.cpu[:num_reqs + 1], seq_lens=self.seq_lens.gpu[:num_reqs],
            seq_lens_cpu_upper_bound=self.seq_lens.cpu[:num_reqs], num_reqs=num_reqs, num_actual_tokens=num_tokens,
            max_query_len=max_query_len, max_seq_len=int(self.seq_lens.cpu[:num_reqs].max()),
            block_table_tensor=self.block_table[:num_reqs], slot_mapping=self.slot_mapping[:num_tokens])

    def _forward_eager_attention(self, n, attn_metadata):
        x, q, k, v = self.model.qkv(self.input_ids[:n])
        attn = self.model.unified_attention(self.impl, q, k, v, self.kv_cache, attn_metadata, self.attn_output[:n])
        return self.model.logits(x, attn)

    def _dummy_run(self, num_tokens):
        """Capture the uniform-decode graph(s) for ``num_tokens`` with dummy metadata."""
        num_reqs = num_tokens // UNIFORM_DECODE_QUERY_LEN
        self.query_start_loc.cpu[:num_reqs + 1] = torch.arange(num_reqs + 1) * UNIFORM_DECODE_QUERY_LEN
        self.seq_lens.cpu[:num_reqs] = 1
        self.query_start_loc.copy_to_gpu()
        self.seq_lens.copy_to_gpu()
        self.block_table[:num_reqs] = 0
        static = {"input_ids": self.input_ids, "slot_mapping": self.slot_mapping, "block_table": self.block_table,
                  "seq_lens": self.seq_lens.gpu, "query_start_loc": self.query_start_loc.gpu}
        state = {"kv_cache": self.kv_cache}
        if self.decode_cudagraph_mode == CUDAGraphMode.FULL:
            md = self.builder.build_for_cudagraph_capture(
                self._common_metadata(num_reqs, num_tokens, UNIFORM_DECODE_QUERY_LEN))
            self.graphs[num_tokens] = capture(lambda: self._forward_eager_attention(num_tokens, md), device=self.device,
                                              name=f"FULL uniform decode {num_tokens}", static=static, state=state,
                                              owner="CUDAGraphWrapper")
        else:                                   # PIECEWISE: the pieces around the (eager) attention op
            qkv = capture(lambda: self.model.qkv(self.input_ids[:num_tokens]), device=self.device,
                          name=f"piece 0 size {num_tokens}", static={"input_ids": self.input_ids},
                          owner="PiecewiseBackend")
            x = qkv[1][0]
            out = capture(lambda: self.model.logits(x, self.attn_output[:num_tokens]), device=self.device,
                          name=f"piece 1 size {num_tokens}", static={"attn_output": self.attn_output},
                          owner="PiecewiseBackend")
            self.graphs[num_tokens] = (qkv, out)

    def capture_model(self):
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(size)

    def _prepare_inputs(self, scheduled):
        slots, input_ids, cu = [], [], 0
        for i, (req, tokens) in enumerate(scheduled):
            start = self.computed.get(req, 0)
            self.block_table[i] = torch.tensor([1 + req * MAX_BLOCKS_PER_REQ + b for b in range(MAX_BLOCKS_PER_REQ)])
            slots += [(1 + req * MAX_BLOCKS_PER_REQ + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(start, start + len(tokens))]
            input_ids += tokens
            cu += len(tokens)
            self.query_start_loc.cpu[i + 1] = cu
            self.seq_lens.cpu[i] = start + len(tokens)
            self.computed[req] = start + len(tokens)
        self.query_start_loc.copy_to_gpu()
        self.seq_lens.copy_to_gpu()
        self.input_ids[:cu].copy_(torch.tensor(input_ids))
        self.slot_mapping[:cu].copy_(torch.tensor(slots))
        return len(scheduled), cu

    def execute_model(self, scheduled):
        num_reqs, n = self._prepare_inputs(scheduled)
        max_query_len = max(len(t) for _, t in scheduled)
        md = self.builder.build(0, self._common_metadata(num_reqs, n, max_query_len))
        uniform_decode = all(len(t) == UNIFORM_DECODE_QUERY_LEN for _, t in scheduled)
        mode = self.decode_cudagraph_mode if uniform_decode and n in self.graphs else CUDAGraphMode.NONE
        if mode == CUDAGraphMode.FULL:
            g, out = self.graphs[n]
            return replay(g, out).clone()
        if mode == CUDAGraphMode.PIECEWISE:
            (g0, (x, q, k, v)), (g1, out) = self.graphs[n]
            x, q, k, v = replay(g0, (x, q, k, v))
            self.model.unified_attention(self.impl, q, k, v, self.kv_cache, md, self.attn_output[:n])
            return replay(g1, out).clone()
        return self._forward_eager_attention(n, md).clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    A, B = 0, 1
    steps = [[(A, [3, 1, 4, 1, 5]), (B, [9, 2, 6, 5, 3, 5])],          # step 1: prefill (eager: 11 tokens)
             [(A, [8, 9]), (B, [7, 9])],                               # steps 2-4: verify (sampled + 1 draft)
             [(A, [3, 2]), (B, [3, 8])],
             [(A, [4, 6])]]

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        if use_cuda_graph:
            runner.capture_model()
        return [runner.execute_model(step) for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
