"""torchtitan RL generator (vLLM engine, custom varlen FlashAttention backend): FULL CUDA graphs also serve prefill and
mixed prefill-decode batches, but the varlen attention launches its kernel grid from the host-side ``max_query_len`` of
the batch it was captured with (the capture's dummy batch: one token per request), so a replayed prefill only computes
the first query tile of each request and the rest of the attention output stays as the buffer held it.

Upstream: https://github.com/pytorch/torchtitan/pull/3685 ("[rl] vLLM generator: use FULL_DECODE_ONLY cudagraph mode
(fix #3668)", pytorch/torchtitan, by yichuan-w, merged 2026-06-18 as commit 7ebeb81f3b2439b495f8e670fdc0be528aff6507).
Read: the PR description (root-cause chain: ``AttentionConfig(backend=CUSTOM)`` -> ``PyTorchVarlenAttentionBackend
(FlashAttentionBackend)`` -> FA3 on SM 9.0 reports ``AttentionCGSupport.ALWAYS`` -> vLLM keeps ``FULL`` for mixed
prefill-decode batches -> "degenerate tokens + NaN logprobs" at large batch; FA2 reports ``UNIFORM_BATCH`` and vLLM
downgrades to ``FULL_DECODE_ONLY``) and the commit's diff of ``torchtitan/experiments/rl/actors/generator.py``
(``VLLMCudagraphConfig`` gains ``mode = "FULL_DECODE_ONLY"``; ``get_vllm_compilation_config`` builds
``CompilationConfig(cudagraph_mode=...)`` from it instead of ``cudagraph_mode="full"``). At the parent commit:
``get_vllm_compilation_config`` (capture sizes: powers of two up to ``max_num_seqs``, plus ``max_num_seqs``) and
``torchtitan/experiments/rl/models/attention.py`` (``PyTorchVarlenAttentionBackend``, and
``PyTorchVarlenAttentionImpl.forward``: ``max_seqlen_q = attn_metadata.max_query_len``, ``max_seqlen_k =
attn_metadata.max_seq_len`` passed as Python ints to ``torch.nn.attention.varlen.varlen_attn_out`` with
``cu_seqlens_q = query_start_loc``, ``seqused_k = seq_lens`` and the paged ``block_table``). The #3669 inductor fixes
bundled in the PR (rope device copy, ``_node_ref``, AOT cache) are not modelled.
Symptom: with CUDA graphs on, RL rollouts (Search-R1, ``max_num_seqs`` 256-500) generate degenerate tokens and NaN
logprobs; eager generation is correct, so the recipe had to run with ``cudagraph.enable=False``.
Mechanism: vLLM captures each FULL graph from a dummy batch of one token per request, so ``max_query_len`` is 1 during
capture. The varlen kernel sizes its grid from that host int (``ceil(max_seqlen_q / kBlockM)`` query tiles per
request). A FULL graph replayed for a prefill or mixed batch launches the same grid: only the first tile of each
request's query rows is computed, the later rows of the attention output keep what the output buffer held, and the
request's last-token logits (what the sampler reads) are wrong. Pure-decode batches have ``max_query_len`` 1 both at
capture and at replay, which is why FULL_DECODE_ONLY is safe.
Doctor: host-work-frozen, at forward. ``PyTorchVarlenAttentionImpl.forward`` reads the batch's ``max_query_len`` on the
host inside the captured region; the graph keeps the capture-time value (1) while an eager step of the same mixed
batch uses the real one.
Fix (upstream): request ``cudagraph_mode="FULL_DECODE_ONLY"``: graphs serve pure-decode batches only; prefill and mixed
batches run eager.
Modelled: ``VLLMCudagraphConfig.get_vllm_compilation_config`` and ``PyTorchVarlenAttentionImpl.forward`` as read (the
variant picks the mode). The vLLM side is not read here but written from vLLM v1 as the PR describes it: the
backend's inherited ``ALWAYS`` support and the mode resolution (FA2's ``UNIFORM_BATCH`` downgrades FULL),
``CudagraphDispatcher.dispatch`` (FULL: any batch up to the largest capture size; FULL_DECODE_ONLY: uniform decode
only), ``GPUModelRunner`` (persistent ``input_ids``,
``positions``, ``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``; ``_dummy_run`` capture batches of
one token per request on the null block; padded requests as zero-length, padded slots on the null block; eager
``compute_logits`` on each request's last token). Stand-ins:
``varlen_attn_out`` is a torch emulation of FA3's tiling (``BLOCK_M`` = 2 query rows per tile instead of 128; keys
bounded by ``seqused_k`` per request, as FA3 does with a paged KV cache; rows outside the grid are not written);
the model is a 2-layer decoder with learned position embeddings instead of RoPE and no TP; vLLM allocates the
attention output per forward (zeros here); greedy sampling; float64.
Workload: max_num_seqs 8 (capture sizes 1, 2, 4, 8). Request A (6-token prompt) is prefilled alone (6 tokens, padded to
8), decodes one step, then B (3-token prompt) joins: a mixed batch of A's decode and B's prefill (4 tokens), then A
and B decode for 3 steps; the per-step logits of every request are compared. Bug: the 6-token prefill (graph 8) and
the mixed batch (graph 4) replay FULL graphs captured with max_query_len 1; A's and B's last-token logits come from
attention rows the kernel never wrote (A's first sampled token is 31 instead of eager's 21: error 5.9 at the prefill,
and the rollouts diverge from there; max |graph - eager| = 17.5 over the 6 steps). Fix: prefill and mixed batches run
eager, decodes replay the graphs: equal to eager (max error 0).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchtitan/pull/3685"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = ("with FULL CUDA graphs the RL generator's prefill and mixed batches replay a varlen attention launched for "
           "the capture batch's max_query_len of 1, so later query rows are never computed: degenerate tokens")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS = 32, 16, 2, 8, 24, 2
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 16, 4
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 8, 16
BLOCK_M = 2                     # FA3 kBlockM stand-in: query rows per tile of the kernel grid
NULL_BLOCK = 0
DTYPE = torch.float64

_variant = "bug"


# --- vLLM (the pieces the generator relies on) ----------------------------------------------------------------------

class AttentionCGSupport:
    ALWAYS = "ALWAYS"                   # FA3: full graphs for any batch
    UNIFORM_BATCH = "UNIFORM_BATCH"     # FA2: full graphs for uniform (decode) batches only


@dataclasses.dataclass
class CompilationConfig:
    cudagraph_mode: str
    mode: int
    cudagraph_capture_sizes: list


@dataclasses.dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int                  # host ints, as vLLM's metadata builder computes them
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    use_cascade: bool = False


_forward_context: dict = {}


def get_forward_context():
    return _forward_context


class FlashAttentionBackend:
    _cudagraph_support = AttentionCGSupport.ALWAYS      # FA3 on SM 9.0


class CudagraphDispatcher:
    """vLLM's resolution of the requested mode against the backend, and the per-batch graph choice."""

    def __init__(self, compilation_config: CompilationConfig, backend):
        mode = compilation_config.cudagraph_mode.upper()
        if mode == "FULL" and backend._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH:
            mode = "FULL_DECODE_ONLY"                   # what FA2 gets; FA3 (ALWAYS) keeps FULL
        self.cudagraph_mode = mode
        self.capture_sizes = sorted(compilation_config.cudagraph_capture_sizes)

    def dispatch(self, num_tokens: int, uniform_decode: bool):
        if num_tokens > self.capture_sizes[-1]:
            return None
        if self.cudagraph_mode == "FULL_DECODE_ONLY" and not uniform_decode:
            return None
        return next(s for s in self.capture_sizes if s >= num_tokens)


# --- torchtitan/experiments/rl/actors/generator.py -----------------------------------------------------------------

@dataclasses.dataclass
class VLLMCudagraphConfig:
    enable: bool = True
    mode: str = "FULL_DECODE_ONLY"

    def get_vllm_compilation_config(self, *, max_num_seqs: int):
        if not self.enable:
            return None
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        cap = max_num_seqs
        sizes = [1 << i for i in range(int(math.log2(cap)) + 1)]
        if cap not in sizes:
            sizes.append(cap)
        if _variant == "bug":
            return CompilationConfig(cudagraph_mode="full", mode=0, cudagraph_capture_sizes=sorted(sizes))
        return CompilationConfig(cudagraph_mode=self.mode, mode=0, cudagraph_capture_sizes=sorted(sizes))


# --- torchtitan/experiments/rl/models/attention.py ---------------------------------------------------------------

def varlen_attn_out(out, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    scale, window_size, block_table, seqused_k):
    """Stand-in for ``torch.nn.attention.varlen.varlen_attn_out`` (FA3, paged KV): the grid has
    ``ceil(max_seqlen_q / BLOCK_M)`` query tiles per request; rows outside the grid are not written. Keys are bounded
    per request by ``seqused_k`` (``max_seqlen_k`` only tunes scheduling)."""
    num_m_blocks = -(-max_seqlen_q // BLOCK_M)
    local = torch.arange(num_m_blocks * BLOCK_M, device=query.device)
    q_start = cu_seqlens_q[:-1].long()
    q_len = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    valid = local[None, :] < q_len[:, None]                                 # [S, rows]
    tok = torch.where(valid, q_start[:, None] + local[None, :], 0).clamp(max=query.shape[0] - 1)
    q = query[tok]                                                          # [S, rows, H, D]
    ctx = torch.arange(block_table.shape[1] * BLOCK_SIZE, device=query.device)
    slots = block_table[:, ctx // BLOCK_SIZE].long() * BLOCK_SIZE + ctx % BLOCK_SIZE
    k = key_cache.reshape(-1, N_HEADS, HEAD_DIM)[slots]                     # [S, C, H, D]
    v = value_cache.reshape(-1, N_HEADS, HEAD_DIM)[slots]
    pos = seqused_k[:, None].long() - q_len[:, None] + local[None, :]      # causal: absolute query positions
    visible = (ctx[None, None, :] <= pos[:, :, None]) & (ctx[None, None, :] < seqused_k[:, None, None].long())
    scores = torch.einsum("srhd,schd->shrc", q, k) * scale
    scores = scores.masked_fill(~visible[:, None], torch.finfo(scores.dtype).min)
    o = torch.einsum("shrc,schd->srhd", scores.softmax(-1), v)
    delta = torch.where(valid[:, :, None, None], o - out[tok], torch.zeros_like(o))
    out.index_put_((tok.reshape(-1),), delta.reshape(-1, N_HEADS, HEAD_DIM), accumulate=True)
    return out


class PyTorchVarlenAttentionBackend(FlashAttentionBackend):
    """Registered as ``AttentionBackendEnum.CUSTOM``; inherits FA3's ``AttentionCGSupport.ALWAYS``."""

    @staticmethod
    def get_name():
        return "CUSTOM"


class PyTorchVarlenAttentionImpl:
    def __init__(self):
        self.scale = HEAD_DIM ** -0.5

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: FlashAttentionMetadata, output):
        if attn_metadata is None:
            return output.fill_(0)
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(1)
        cu_seqlens_q = attn_metadata.query_start_loc
        seqused_k = attn_metadata.seq_lens
        max_seqlen_q = attn_metadata.max_query_len
        max_seqlen_k = attn_metadata.max_seq_len
        block_table = attn_metadata.block_table
        return varlen_attn_out(output[:num_actual_tokens], query[:num_actual_tokens], key_cache, value_cache,
                               cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, scale=self.scale,
                               window_size=(-1, 0), block_table=block_table, seqused_k=seqused_k)


# --- the model (stand-in for the torchtitan Qwen3 decoder wrapped for vLLM) ------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class DecoderLayer:
    def __init__(self, gen, device, kv_cache):
        r = lambda *s, scale=0.35: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.qkv, self.o = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.in_norm, self.post_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)
        self.kv_cache = kv_cache                                    # [num_blocks, 2, block_size, heads, dim]
        self.impl = PyTorchVarlenAttentionImpl()

    def forward(self, h):
        md = get_forward_context()["attn_metadata"]
        T = h.shape[0]
        q, k, v = F.linear(rms_norm(h, self.in_norm), self.qkv).view(T, 3, N_HEADS, HEAD_DIM).unbind(1)
        slots = md.slot_mapping.long()                              # reshape_and_cache_flash
        key_cache, value_cache = self.kv_cache.unbind(1)
        key_cache.index_put_((slots // BLOCK_SIZE, slots % BLOCK_SIZE), k)
        value_cache.index_put_((slots // BLOCK_SIZE, slots % BLOCK_SIZE), v)
        output = torch.zeros(T, N_HEADS, HEAD_DIM, dtype=DTYPE, device=h.device)
        self.impl.forward(self, q, k, v, self.kv_cache, md, output)
        h = h + F.linear(output.reshape(T, HIDDEN), self.o)
        gate, up = F.linear(rms_norm(h, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


class Qwen3Model:
    def __init__(self, device, kv_caches):
        gen = generator(3685)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        max_model_len = MAX_BLOCKS_PER_REQ * BLOCK_SIZE
        self.embed_positions = randn(max_model_len, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [DecoderLayer(gen, device, c) for c in kv_caches]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.lm_head = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)

    def forward(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        for layer in self.layers:
            h = layer.forward(h)
        return h

    def compute_logits(self, hidden_states):
        return F.linear(rms_norm(hidden_states, self.norm), self.lm_head)


# --- vllm/v1/worker/gpu_model_runner.py (reduced) ------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, compilation_config: CompilationConfig | None):
        self.device = device
        i32 = dict(dtype=torch.int32, device=device)
        self.kv_caches = [torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                          for _ in range(N_LAYERS)]
        self.model = Qwen3Model(device, self.kv_caches)
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_SEQS + 1, **i32)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, **i32)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS_PER_REQ, **i32)
        self.slot_mapping = torch.zeros(MAX_NUM_BATCHED_TOKENS, **i32)
        self.graphs = {}
        self.cudagraph_dispatcher = None
        if compilation_config is not None:
            self.cudagraph_dispatcher = CudagraphDispatcher(compilation_config, PyTorchVarlenAttentionBackend)
            self.capture_model()

    def _build_attn_metadata(self, num_reqs, num_tokens, max_query_len, max_seq_len):
        return FlashAttentionMetadata(
            num_actual_tokens=num_tokens, max_query_len=max_query_len,
            query_start_loc=self.query_start_loc[: num_reqs + 1], max_seq_len=max_seq_len,
            seq_lens=self.seq_lens[:num_reqs], block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens])

    def _dummy_run(self, num_tokens):
        """Capture batch: one token per request (at most max_num_seqs requests), all on the null block."""
        num_reqs = min(num_tokens, MAX_NUM_SEQS)
        q_lens = [num_tokens // num_reqs] * num_reqs
        q_lens[-1] += num_tokens - sum(q_lens)
        self.input_ids[:num_tokens].fill_(0)
        self.positions[:num_tokens].fill_(0)
        cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0)
        self.query_start_loc[: num_reqs + 1].copy_(cu)
        self.seq_lens[:num_reqs].copy_(torch.tensor(q_lens, dtype=torch.int32))
        self.block_table[:num_reqs].fill_(NULL_BLOCK)
        self.slot_mapping[:num_tokens].fill_(NULL_BLOCK * BLOCK_SIZE)
        return self._build_attn_metadata(num_reqs, num_tokens, max(q_lens), max(q_lens))

    def _model_forward(self, num_tokens):
        return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        static = {"input_ids": self.input_ids, "positions": self.positions, "query_start_loc": self.query_start_loc,
                  "seq_lens": self.seq_lens, "block_table": self.block_table, "slot_mapping": self.slot_mapping}
        state = {f"kv_caches[{i}]": c for i, c in enumerate(self.kv_caches)}
        for num_tokens in sorted(self.cudagraph_dispatcher.capture_sizes, reverse=True):
            _forward_context["attn_metadata"] = self._dummy_run(num_tokens)
            self.graphs[num_tokens] = capture(
                lambda n=num_tokens: self._model_forward(n), device=self.device, pool=pool, owner="GPUModelRunner",
                name=f"{self.cudagraph_dispatcher.cudagraph_mode} [{num_tokens}]", static=static, state=state)

    def execute_model(self, scheduled):
        """``scheduled``: (token ids to compute, first position, block ids) per request."""
        num_reqs = len(scheduled)
        ids, pos, slots, cu, seq_lens = [], [], [], [0], []
        for row, (tokens, start, blocks) in enumerate(scheduled):
            p = list(range(start, start + len(tokens)))
            ids += tokens
            pos += p
            slots += [blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in p]
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            self.block_table[row].fill_(NULL_BLOCK)
            self.block_table[row, : len(blocks)].copy_(torch.tensor(blocks, dtype=torch.int32))
        num_tokens = cu[-1]
        q_lens = [len(t) for t, _, _ in scheduled]
        self.input_ids[:num_tokens].copy_(torch.tensor(ids, dtype=torch.int64))
        self.positions[:num_tokens].copy_(torch.tensor(pos, dtype=torch.int64))
        self.slot_mapping[:num_tokens].copy_(torch.tensor(slots, dtype=torch.int32))
        self.query_start_loc[: num_reqs + 1].copy_(torch.tensor(cu, dtype=torch.int32))
        self.query_start_loc[num_reqs + 1:].fill_(num_tokens)          # padded requests: zero-length
        self.seq_lens[:num_reqs].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        self.seq_lens[num_reqs:].fill_(0)
        self.block_table[num_reqs:].fill_(NULL_BLOCK)
        md = self._build_attn_metadata(num_reqs, num_tokens, max(q_lens), max(seq_lens))
        _forward_context["attn_metadata"] = md
        size = None
        if self.cudagraph_dispatcher is not None:
            size = self.cudagraph_dispatcher.dispatch(num_tokens, uniform_decode=max(q_lens) == 1)
        if size is not None:
            self.slot_mapping[num_tokens:size].fill_(NULL_BLOCK * BLOCK_SIZE)     # padded tokens write the null block
            g, out = self.graphs[size]
            hidden_states = replay(g, out, real=num_tokens, size=size)
        else:
            hidden_states = self._model_forward(num_tokens)
        logits_indices = torch.tensor(cu[1:], device=self.device) - 1
        return self.model.compute_logits(hidden_states[logits_indices])


# --- the RL generator's rollout loop (stand-in for the vLLM scheduler and the sampler) --------------------------------

def rollout(runner: GPUModelRunner):
    gen = generator(3668)
    prompts = {"A": torch.randint(1, VOCAB, (6,), generator=gen).tolist(),
               "B": torch.randint(1, VOCAB, (3,), generator=gen).tolist()}
    blocks = {"A": [1, 2, 3, 4], "B": [5, 6, 7, 8]}
    reqs = {}
    schedule = [["A"], ["A"], ["A", "B"], ["A", "B"], ["A", "B"], ["A", "B"]]
    outs = []
    for step in schedule:
        scheduled = []
        for r in step:
            if r not in reqs:                                          # prefill the whole prompt
                reqs[r] = {"len": 0, "pending": prompts[r]}
            scheduled.append((reqs[r]["pending"], reqs[r]["len"], blocks[r]))
        logits = runner.execute_model(scheduled)
        outs.append(logits.clone())
        for row, r in enumerate(step):                                 # greedy sampling
            reqs[r]["len"] += len(reqs[r]["pending"])
            reqs[r]["pending"] = [int(logits[row].argmax())]
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enable_cudagraph: bool):
        config = VLLMCudagraphConfig(enable=enable_cudagraph)
        runner = GPUModelRunner(device, config.get_vllm_compilation_config(max_num_seqs=MAX_NUM_SEQS))
        return rollout(runner)

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
