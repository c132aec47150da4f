"""With MTP=2 the uniform-decode FULL graph for 8 tokens is captured on a [3, 3, 2] batch: a prefill branch is frozen in.

Upstream: https://github.com/vllm-project/vllm/pull/28315 ("[BugFix] Temporary fix for IMA with MTP = 2 and
full-cg", merged 2025-11-07), for https://github.com/vllm-project/vllm/issues/28207 ("CUDA Graph Capture Issue:
Unexpected Prefill Branches in Uniform Decode Graphs when MTP=2"; earlier report #28015).
Symptom: DeepSeek-R1 with FLASHINFER_MLA / FLASHMLA, ``cudagraph_mode=FULL_AND_PIECEWISE`` and
``deepseek_mtp`` with ``num_speculative_tokens=2`` hits an illegal memory access while serving gsm8k; eager and
num_speculative_tokens 1 or 3 do not.
Mechanism: with spec decode a uniform decode batch has ``uniform_decode_query_len = 1 + K = 3`` tokens per
request, but the capture sizes stay the default [1, 2, 4, 8, ...]. ``GPUModelRunner._dummy_run(num_tokens,
uniform_decode=True)`` builds the capture batch as ``cdiv(num_tokens, 3)`` requests of 3 tokens and gives the
last one ``num_tokens % 3``: for 8 tokens [3, 3, 2], for 4 tokens [3, 1]. The MLA builders
(``MLACommonMetadataBuilder.build``, ``QueryLenSupport.UNIFORM``) call ``split_decodes_and_prefills(...,
require_uniform=True)``, so that short request is classified as a prefill: the FULL "uniform decode" graph is
captured with the decode kernel for 2 requests plus ``MLACommonImpl._forward_prefill``, whose metadata
(``prefill_query_start_loc = query_start_loc[reqs_start:] - query_start_loc[reqs_start]``) is a fresh tensor of
the capture's build, released when the dummy run returns. ``CudagraphDispatcher`` sends every uniform batch of
2 requests (6 tokens, padded to 8) to that graph: each replay re-runs the frozen prefill branch over the
padded tokens with the released ``query_start_loc`` (IMA), although the eager step for the same batch splits
it as all-decode and never runs a prefill.
Doctor: warmup-divergence, at ``_dummy_run`` (the capture batch it builds makes the builder decide a
decode/prefill split and a prefill tensor that every replay reuses, while the replayed batches are all-decode).
Fix (upstream): ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode(uniform_decode_query_len,
tensor_parallel_size)`` (called at cudagraph setup when spec decode is on) rounds every capture size up to a
multiple of ``1 + K``, deduplicated and capped at ``max_cudagraph_capture_size`` (``[q]`` if none is left; with
sequence parallelism a common multiple with tp or ``ValueError``): [1, 2, 4, 8] -> [3, 6], so a uniform capture
batch never has a short last request.
Modelled: one MLA-like layer with a single latent head (k and v from the same cache), paged KV cache (block 0
the null block, padded slots write there); every draft token is accepted; the FlashMLA/FlashInfer decode kernel
is a dense paged attention; no chunked prefill context (the dummy requests have none); the sequence-parallel
branch of the fix is left out. On the CPU the released tensor raises ``IllegalMemoryAccess`` at the first replay.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/28315"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_dummy_run"
SYMPTOM = "MTP=2 + FULL cudagraph: the 8-token decode graph replays a prefill branch captured on [3,3,2] (IMA)"

NUM_SPECULATIVE_TOKENS = 2
UNIFORM_DECODE_QUERY_LEN = 1 + NUM_SPECULATIVE_TOKENS
VOCAB, DIM, MAX_POS = 16, 4, 16
BLOCK_SIZE, MAX_BLOCKS, MAX_NUM_REQS = 4, 4, 3
MAX_TOKENS = MAX_NUM_REQS * UNIFORM_DECODE_QUERY_LEN
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS          # block 0: the null block
PAD_SLOT = 0
PROMPT_LENS = (3, 2)                                 # cached context of requests 0 and 1
STEPS = ((0, 1), (0,), (0, 1), (1,), (0, 1))         # requests scheduled per step (3 tokens each)


def cdiv(a, b):
    return -(-a // b)


class CompilationConfig:
    def __init__(self, cudagraph_capture_sizes, max_cudagraph_capture_size):
        self.cudagraph_capture_sizes = list(cudagraph_capture_sizes)
        self.max_cudagraph_capture_size = max_cudagraph_capture_size

    def adjust_cudagraph_sizes_for_spec_decode(self, uniform_decode_query_len, tensor_parallel_size):
        multiple_of = uniform_decode_query_len        # (sequence parallelism off)
        if not self.cudagraph_capture_sizes or multiple_of <= 1:
            return
        rounded = [cdiv(s, multiple_of) * multiple_of for s in self.cudagraph_capture_sizes]   # round_up
        rounded_sizes = sorted({s for s in rounded if s <= self.max_cudagraph_capture_size})
        if not rounded_sizes and multiple_of <= self.max_cudagraph_capture_size:
            rounded_sizes = [multiple_of]
        if not rounded_sizes:
            raise ValueError(f"No valid cudagraph sizes after rounding to multiple of {multiple_of}")
        self.max_cudagraph_capture_size = rounded_sizes[-1]
        self.cudagraph_capture_sizes = rounded_sizes


def split_decodes_and_prefills(query_start_loc_cpu, decode_threshold, require_uniform):
    """vllm/v1/attention/backends/utils.py: decodes first, then prefills (returns counts of both)."""
    query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    num_reqs, num_tokens = len(query_lens), int(query_start_loc_cpu[-1])
    if query_lens[0] > decode_threshold:
        return 0, num_reqs, 0, num_tokens
    is_prefill = query_lens != query_lens[0] if require_uniform else query_lens > decode_threshold
    if not bool(is_prefill.any()):
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(is_prefill.int().argmax())
    num_decode_tokens = int(query_start_loc_cpu[first_prefill])
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens


class MLACommonMetadata:
    def __init__(self, num_actual_tokens, slot_mapping, num_decodes, num_decode_tokens, num_prefills, decode, prefill):
        self.num_actual_tokens, self.slot_mapping = num_actual_tokens, slot_mapping
        self.num_decodes, self.num_decode_tokens, self.num_prefills = num_decodes, num_decode_tokens, num_prefills
        self.decode, self.prefill = decode, prefill      # dicts of tensors, or None


class MLACommonMetadataBuilder:
    """QueryLenSupport.UNIFORM (FlashMLA, FlashInfer-MLA): spec-decode requests of 1 + K tokens are decodes."""
    reorder_batch_threshold = UNIFORM_DECODE_QUERY_LEN

    def build(self, m) -> MLACommonMetadata:
        """``m``: the CommonAttentionMetadata (a namespace here)."""
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            m.query_start_loc_cpu, self.reorder_batch_threshold, require_uniform=True)
        prefill = None
        if num_prefills > 0:
            reqs_start = num_decodes
            prefill_query_start_loc = m.query_start_loc[reqs_start:] - m.query_start_loc[reqs_start]  # a new tensor
            prefill = {"query_start_loc": prefill_query_start_loc}
        decode = None
        if num_decodes > 0:
            decode = {"block_table": m.block_table_tensor[:num_decodes], "seq_lens": m.seq_lens[:num_decodes]}
        return MLACommonMetadata(m.num_actual_tokens, m.slot_mapping, num_decodes, num_decode_tokens,
                                 num_prefills, decode, prefill)


class MLACommonImpl:
    def __init__(self, kv_cache):
        self.kv_cache, self.scale = kv_cache, DIM ** -0.5      # [NUM_BLOCKS * BLOCK_SIZE, DIM] latent cache

    def _forward_decode(self, q, decode, num_decodes):
        """Paged decode (reshape_query_for_spec_decode): request r's i-th query sits at seq_len - q_len + i."""
        q = q.view(num_decodes, -1, DIM)
        q_len = q.shape[1]
        t = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=q.device)
        slots = decode["block_table"][:, t // BLOCK_SIZE].long() * BLOCK_SIZE + t % BLOCK_SIZE
        kv = self.kv_cache[slots]                                              # [r, T, DIM]
        pos = decode["seq_lens"][:, None].long() - q_len + torch.arange(q_len, device=q.device)[None, :]
        scores = torch.einsum("rqd,rtd->rqt", q, kv) * self.scale
        scores = scores.masked_fill(t[None, None, :] > pos[:, :, None], -1e9)
        return torch.einsum("rqt,rtd->rqd", torch.softmax(scores, -1), kv).reshape(-1, DIM)

    def _forward_prefill(self, q, k, v, prefill):
        """Varlen causal self-attention over the new tokens (cu_seqlens = prefill query_start_loc, no context)."""
        cu = prefill["query_start_loc"]
        t = torch.arange(q.shape[0], device=q.device)
        seq = (cu[1:][None, :] <= t[:, None]).sum(1)                           # request of each token
        mask = (seq[:, None] == seq[None, :]) & (t[None, :] <= t[:, None])
        scores = (q @ k.T * self.scale).masked_fill(~mask, -1e9)
        return torch.softmax(scores, -1) @ v

    def forward(self, q, k, v, attn_metadata: MLACommonMetadata):
        n = attn_metadata.num_actual_tokens
        self.kv_cache[attn_metadata.slot_mapping[:n].long()] = k[:n]          # concat_and_cache_mla
        output = torch.zeros_like(q)
        nd_tok = attn_metadata.num_decode_tokens
        if attn_metadata.num_decodes > 0:
            output[:nd_tok] = self._forward_decode(q[:nd_tok], attn_metadata.decode, attn_metadata.num_decodes)
        if attn_metadata.num_prefills > 0:
            output[nd_tok:n] = self._forward_prefill(q[nd_tok:n], k[nd_tok:n], v[nd_tok:n], attn_metadata.prefill)
        return output


_forward_context: dict = {}


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    _forward_context["attn_metadata"] = attn_metadata
    try:
        yield
    finally:
        _forward_context.clear()


class DeepseekMLAModel:
    def __init__(self, device, kv_cache):
        gen = generator(28315)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wkv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(3))
        self.impl = MLACommonImpl(kv_cache)

    def __call__(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos_embed[positions]
        kv = h @ self.wkv
        attn = self.impl.forward(h @ self.wq, kv, kv, _forward_context["attn_metadata"])
        return h + attn @ self.wo


class GPUModelRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.compilation_config = CompilationConfig([1, 2, 4, 8], 8)
        self.uniform_decode_query_len = UNIFORM_DECODE_QUERY_LEN
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)   # noqa: E731
        self.input_ids, self.positions, self.slot_mapping = z(MAX_TOKENS), z(MAX_TOKENS), z(MAX_TOKENS)
        self.query_start_loc, self.seq_lens = z(MAX_NUM_REQS + 1), z(MAX_NUM_REQS)
        self.block_table = z(MAX_NUM_REQS, MAX_BLOCKS)
        self.builder = MLACommonMetadataBuilder()
        self.cudagraphs = {}

    def _prepare_inputs(self, query_lens, token_ids, seq_lens, block_ids):
        """Fill the persistent inputs for the real batch and build its attention metadata (before padding)."""
        n, num_tokens = len(query_lens), sum(query_lens)
        qsl = torch.tensor([0] + [sum(query_lens[:i + 1]) for i in range(n)])
        pos = [p for ql, sl in zip(query_lens, seq_lens) for p in range(sl - ql, sl)]
        req = [r for r, ql in enumerate(query_lens) for _ in range(ql)]
        slots = [block_ids[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for r, p in zip(req, pos)]
        self.input_ids[:num_tokens].copy_(torch.tensor(token_ids).to(self.device))
        self.positions[:num_tokens].copy_(torch.tensor(pos).to(self.device))
        self.slot_mapping[:num_tokens].copy_(torch.tensor(slots).to(self.device))
        self.slot_mapping[num_tokens:].fill_(PAD_SLOT)
        self.query_start_loc[:n + 1].copy_(qsl.to(self.device))
        self.query_start_loc[n + 1:].fill_(num_tokens)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens).to(self.device))
        self.seq_lens[n:].fill_(0)
        self.block_table[:n].copy_(torch.tensor(block_ids).to(self.device))
        self.block_table[n:].fill_(0)
        return self.builder.build(SimpleNamespace(
            query_start_loc=self.query_start_loc[:n + 1], query_start_loc_cpu=qsl, seq_lens=self.seq_lens[:n],
            block_table_tensor=self.block_table[:n], slot_mapping=self.slot_mapping, num_reqs=n,
            num_actual_tokens=num_tokens))

    def _model_forward(self, num_tokens):
        return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _dummy_run(self, num_tokens, uniform_decode=True):
        max_query_len = self.uniform_decode_query_len if uniform_decode else num_tokens
        num_reqs = min(MAX_NUM_REQS, cdiv(num_tokens, max_query_len))
        num_scheduled_tokens_list = [max_query_len] * num_reqs
        if num_tokens % max_query_len != 0:
            num_scheduled_tokens_list[-1] = num_tokens % max_query_len
        attn_metadata = self._prepare_inputs(num_scheduled_tokens_list, [0] * num_tokens, num_scheduled_tokens_list,
                                             [[0] * MAX_BLOCKS] * num_reqs)       # no context, null blocks
        with set_forward_context(attn_metadata):
            self.cudagraphs[num_tokens] = capture(
                lambda: self._model_forward(num_tokens), device=self.device, name=f"FULL uniform decode {num_tokens}",
                owner="CUDAGraphWrapper (FULL)",
                static={"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                        "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens,
                        "block_table": self.block_table},
                state={"kv_cache": self.model.impl.kv_cache})
        # the dummy batch's attention metadata (and its prefill query_start_loc) is released here

    def capture_model(self):
        if self.variant == "fix":       # _check_and_update_cudagraph_mode, spec decode on
            self.compilation_config.adjust_cudagraph_sizes_for_spec_decode(self.uniform_decode_query_len, 1)
        for size in sorted(self.compilation_config.cudagraph_capture_sizes, reverse=True):
            self._dummy_run(size, uniform_decode=True)

    def dispatch(self, num_tokens, uniform_decode):
        """CudagraphDispatcher: a uniform batch runs the FULL graph of the smallest capture size that fits."""
        cc = self.compilation_config
        if not uniform_decode or num_tokens > cc.max_cudagraph_capture_size:
            return None
        return min(s for s in cc.cudagraph_capture_sizes if s >= num_tokens)

    def execute_model(self, query_lens, token_ids, seq_lens, block_ids):
        attn_metadata = self._prepare_inputs(query_lens, token_ids, seq_lens, block_ids)
        num_tokens = sum(query_lens)
        uniform = max(query_lens) == self.uniform_decode_query_len and num_tokens == len(query_lens) * max(query_lens)
        size = self.dispatch(num_tokens, uniform) if self.cudagraphs else None
        with set_forward_context(attn_metadata):
            if size is None:
                return self._model_forward(num_tokens).clone()
            g, out = self.cudagraphs[size]
            hidden = replay(g, out, real=num_tokens, size=size,
                            padded={"input_ids": self.input_ids, "positions": self.positions})
            return hidden[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(2831)
    prompt_kv = randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device)
    tokens = torch.randint(0, VOCAB, (len(STEPS), MAX_TOKENS), generator=gen).tolist()
    blocks = [[1 + r * MAX_BLOCKS + j for j in range(MAX_BLOCKS)] for r in range(len(PROMPT_LENS))]

    def serve(graphed: bool):
        kv_cache = prompt_kv.clone()
        runner = GPUModelRunner(DeepseekMLAModel(device, kv_cache), device, variant)
        if graphed:
            runner.capture_model()
        seq_lens, outs = list(PROMPT_LENS), []
        for step, reqs in enumerate(STEPS):
            for r in reqs:
                seq_lens[r] += UNIFORM_DECODE_QUERY_LEN          # 1 sampled + K draft tokens, all accepted
            query_lens = [UNIFORM_DECODE_QUERY_LEN] * len(reqs)
            ids = tokens[step][:sum(query_lens)]
            outs.append(runner.execute_model(query_lens, ids, [seq_lens[r] for r in reqs], [blocks[r] for r in reqs]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
