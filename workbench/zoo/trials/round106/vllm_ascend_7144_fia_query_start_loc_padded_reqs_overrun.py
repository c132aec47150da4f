"""vLLM-Ascend FULL ACL graphs: once vLLM pads the request count of a FULL batch descriptor, the runner's query_start_loc padding for the FIA operator takes its uniform-decode branch for a mixed batch and extends the cumulative query lengths past the graph's padded token count, so the attention metadata asks for more query rows than the captured graph holds.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/7144 ("fixed fia pad logic in graph mode.",
vllm-project/vllm-ascend, by XiaoxinWang / wangxiaoxin-sherie, merged 2026-03-12 as commit 37d1bd8c50).
Read: the commit message (vLLM PR #34043 deleted ``relax_for_mixed_batch_cudagraphs``, so ``num_reqs`` of the batch
descriptor "no longer equals the actual number of requests"; FIA requires ``query_start_loc[-1]`` to equal the number
of computed tokens; "In full graph mode, set num_reqs_paded = num_reqs") and its diff of
``vllm_ascend/worker/model_runner_v1.py``; at the parent commit (37d1bd8c50^) ``NPUModelRunner._pad_query_start_loc_for_fia``
(uniform branch: ``num_tokens_padded == num_reqs_padded * uniform_decode_query_len`` fills
``query_start_loc[num_reqs + 1 : num_reqs_padded + 1]`` with ``arange * uniform_decode_query_len + last_loc``; mixed
branch: a dummy request ending at ``num_tokens_padded``) and its caller in ``execute_model`` (``num_tokens_padded =
batch_desc.num_tokens``, ``num_reqs_padded = batch_desc.num_reqs``, called when ``cudagraph_mode == FULL``, result
passed as ``num_reqs_padded`` to ``_build_attention_metadata``); the same function in ``worker/v2/model_runner.py``
(for the query_start_loc fill ``[num_reqs + 1:] = num_tokens`` and ``seq_lens_np[num_reqs_padded:] = 0``).
Symptom: with FULL graph mode on Ascend, a step whose batch mixes a prefill chunk with decodes and is padded up to a
capture size fails in the fused infer attention (FIA) operator: in TND layout the first dimension of the query must
equal the last element of ``actual_seq_lengths_q``; eager mode serves.
Mechanism: the FULL batch descriptor now carries a padded request count (one request per padded token for
``uniform_decode_query_len`` 1). For a mixed batch ``num_tokens_padded == num_reqs_padded * 1`` holds, so the uniform
branch runs; it assumes every real request has ``uniform_decode_query_len`` tokens and appends one-token dummy requests
after the real tokens' end, so ``query_start_loc[num_reqs_padded]`` = real tokens + padded requests - real requests,
beyond the graph's padded token count. The metadata of the replay no longer fits the captured query buffer.
Doctor: undersized-buffer, at _pad_query_start_loc_for_fia. The padded query_start_loc it writes makes the attention
of a graph captured for ``num_tokens_padded`` query rows serve more rows than that.
Fix (upstream): in FULL runtime mode ``num_reqs_padded = num_reqs`` before the branch, so a mixed batch gets a single
dummy request ending at ``num_tokens_padded`` (and a uniform decode batch still gets one-token dummies).
Modelled: ``_pad_query_start_loc_for_fia`` (both variants, line by line), the query_start_loc / seq_lens / block-table /
slot-mapping padding of ``_prepare_inputs``, the FULL capture of each size with a dummy uniform-decode batch, and the
per-step graph-parameter update before replay (``update_attn_params``) that hands the host-side
``actual_seq_lengths_q`` / ``actual_seq_lengths_kv`` to FIA, which checks the TND contract. Stand-ins: the dispatcher
pads a FULL key's ``num_reqs`` to the token bucket (capped at ``max_num_seqs``), as the PR describes vLLM after #34043;
FIA's tiling is a per-token plan (request index, KV length) written into static buffers from those host lists; a
2-layer decoder without RoPE (RMSNorm, qkv, ``reshape_and_cache`` with ``PAD_SLOT_ID`` writes sent to a scratch slot,
paged attention, gated MLP); tokens of later steps are fixed in advance (no sampler); block 0 is the null block.
Workload: capture sizes 4 and 8 (uniform_decode_query_len 1, max_num_seqs 8). Step 1 prefills A (6) and B (4): 10
tokens, above the largest capture size, eager. Step 2 decodes A, B (graph 4). Step 3 prefills C (3) next to decodes of
A, B: 5 tokens in 3 requests, graph 8. Step 4 decodes A, B, C (graph 4). Bug: step 3 raises RuntimeError in FIA's
TND check ("query.shape[0] (8) must equal actual_seq_lengths_q[-1] (10)": 5 real tokens + 8 padded requests - 3
real requests); steps 1-2 were served. Fix: step 3 gets one dummy request [5, 8) and the 20 real rows of the four
steps equal eager (max |graph - eager| = 4.4e-15, float64 rounding of the padded batched matmuls).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/7144"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_pad_query_start_loc_for_fia"
SYMPTOM = ("FULL ACL graphs on Ascend: a padded mixed batch gets query_start_loc padded as if it were a uniform decode "
           "batch, its last element exceeds the graph's padded token count and the FIA operator rejects the step")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS = 32, 16, 2, 8, 24, 2
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 16, 4
MAX_NUM_REQS, MAX_NUM_TOKENS = 8, 16
CUDAGRAPH_CAPTURE_SIZES = [4, 8]
PAD_SLOT_ID = -1
SCRATCH_SLOT = NUM_BLOCKS * BLOCK_SIZE       # where reshape_and_cache sends PAD_SLOT_ID writes (stand-in)
DTYPE = torch.float64

_variant = "bug"


class CpuGpuBuffer:
    def __init__(self, n, dtype, device, np_dtype):
        self.np = np.zeros(n, dtype=np_dtype)
        self.gpu = torch.zeros(n, dtype=dtype, device=device)

    def copy_to_gpu(self, n=None):
        n = self.np.shape[0] if n is None else n
        self.gpu[:n].copy_(torch.from_numpy(self.np[:n].copy()))
        return self.gpu[:n]


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None


def dispatch(num_tokens: int, num_reqs: int):
    """FULL cudagraph dispatch (stand-in for vLLM after #34043): pad the tokens to a capture size; the key's
    request count is padded with it (one request per padded token, at most max_num_seqs)."""
    if num_tokens > CUDAGRAPH_CAPTURE_SIZES[-1]:
        return "NONE", BatchDescriptor(num_tokens, num_reqs)
    size = next(s for s in CUDAGRAPH_CAPTURE_SIZES if num_tokens <= s)
    return "FULL", BatchDescriptor(size, min(size, MAX_NUM_REQS))


# --- the model (stand-in decoder; attention = fused infer attention with a per-token plan) -----------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def npu_fused_infer_attention_score_check(num_query_rows, actual_seq_lengths_q, actual_seq_lengths_kv):
    """FIA's host-side contract for input_layout TND (checked at every launch and every graph-task update)."""
    if len(actual_seq_lengths_q) != len(actual_seq_lengths_kv):
        raise RuntimeError(f"FIA: actual_seq_lengths_q has {len(actual_seq_lengths_q)} entries, "
                           f"actual_seq_lengths_kv {len(actual_seq_lengths_kv)}")
    if actual_seq_lengths_q[-1] != num_query_rows:
        raise RuntimeError(f"FIA (TND layout): query.shape[0] ({num_query_rows}) must equal "
                           f"actual_seq_lengths_q[-1] ({actual_seq_lengths_q[-1]})")


class AttnPlan:
    """FIA's tiling for one launch: the request of each query row and its KV length (static buffers of the graph)."""

    def __init__(self, device):
        self.token_req = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.token_kv_len = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)

    def update(self, num_query_rows, actual_seq_lengths_q, actual_seq_lengths_kv):
        npu_fused_infer_attention_score_check(num_query_rows, actual_seq_lengths_q, actual_seq_lengths_kv)
        req, kv_len, start = [], [], 0
        for r, (end, kv) in enumerate(zip(actual_seq_lengths_q, actual_seq_lengths_kv)):
            for t in range(start, end):
                req.append(r)
                kv_len.append(kv - (end - 1 - t))          # causal: row t sees positions < its own + 1
            start = end
        self.token_req[:num_query_rows].copy_(torch.tensor(req, dtype=torch.int64))
        self.token_kv_len[:num_query_rows].copy_(torch.tensor(kv_len, dtype=torch.int64))


def fused_infer_attention(q, k_cache, v_cache, block_table, plan: AttnPlan):
    n = q.size(0)
    tables = block_table[plan.token_req[:n]].long()                         # [n, MAX_BLOCKS_PER_REQ]
    ctx = torch.arange(MAX_BLOCKS_PER_REQ * BLOCK_SIZE, device=q.device)
    slots = tables[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
    k, v = k_cache[slots], v_cache[slots]                                    # [n, ctx, H, D]
    scores = torch.einsum("thd,tchd->thc", q, k) / HEAD_DIM ** 0.5
    masked = ctx[None, :] >= plan.token_kv_len[:n, None]
    return torch.einsum("thc,tchd->thd", scores.masked_fill(masked[:, None, :], -1e30).softmax(-1), v)


class DecoderLayer:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.qkv, self.o = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.in_norm, self.post_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)

    def forward(self, h, kv_cache, block_table, slot_mapping, plan):
        q, k, v = F.linear(rms_norm(h, self.in_norm), self.qkv).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        k_cache, v_cache = kv_cache
        slots = torch.where(slot_mapping >= 0, slot_mapping, SCRATCH_SLOT).long()   # PAD_SLOT_ID is skipped
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        h = h + F.linear(fused_infer_attention(q, k_cache, v_cache, block_table, plan).reshape(-1, HIDDEN), self.o)
        gate, up = F.linear(rms_norm(h, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


class Model:
    def __init__(self, device):
        gen = generator(7144)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [DecoderLayer(gen, device) for _ in range(N_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)

    def forward(self, input_ids, kv_caches, block_table, slot_mapping, plan):
        h = self.embed_tokens[input_ids]
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer.forward(h, kv_cache, block_table, slot_mapping, plan)
        return rms_norm(h, self.norm)


# --- vllm_ascend/worker/model_runner_v1.py (reduced) ------------------------------------------------------------

class NPUModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = Model(device)
        self.uniform_decode_query_len = 1
        self.arange_np = np.arange(MAX_NUM_TOKENS + 1, dtype=np.int32)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS + 1, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.query_start_loc = CpuGpuBuffer(MAX_NUM_REQS + 2, torch.int32, device, np.int32)
        self.seq_lens = CpuGpuBuffer(MAX_NUM_REQS + 1, torch.int32, device, np.int32)
        self.attn_plan = AttnPlan(device)
        self.kv_caches = [tuple(torch.zeros(SCRATCH_SLOT + 1, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                                for _ in range(2)) for _ in range(N_LAYERS)]
        self.graphs = {}
        if not enforce_eager:
            self.capture_model()

    def _pad_query_start_loc_for_fia(self, num_tokens_padded, num_reqs_padded, num_reqs,
                                     cudagraph_runtime_mode=None, batch_desc_num_reqs=None):
        """Satisfy FIA's TND constraint: the first dimension of ``hidden_states`` must equal the last element of
        ``actual_seq_lengths_q``."""
        if _variant == "fix":
            # related to vllm PR #34043: num_reqs no longer equals the actual number of requests.
            if cudagraph_runtime_mode == "FULL":
                num_reqs_padded = num_reqs
            else:
                num_reqs_padded = batch_desc_num_reqs if batch_desc_num_reqs is not None else num_reqs
        if num_tokens_padded == num_reqs_padded * self.uniform_decode_query_len:
            # Uniform-batch case: num_reqs must be no greater than num_reqs_padded
            assert num_reqs <= num_reqs_padded
            last_loc = self.query_start_loc.np[num_reqs]
            self.query_start_loc.np[num_reqs + 1: num_reqs_padded + 1] = (
                self.arange_np[1: num_reqs_padded + 1 - num_reqs] * self.uniform_decode_query_len + last_loc)
        else:
            # Mixed-batch case: num_reqs must equal num_reqs_padded
            assert num_reqs == num_reqs_padded
            # Insert a dummy request instead of setting query_start_loc[num_reqs] = num_tokens_padded directly
            self.query_start_loc.np[num_reqs_padded + 1] = num_tokens_padded
            num_reqs_padded = num_reqs_padded + 1
        self.query_start_loc.copy_to_gpu()
        return num_reqs_padded

    def _prepare_inputs(self, batch, num_tokens_padded):
        """batch: list of (tokens, num_computed_tokens, block_ids); fills the persistent input buffers."""
        num_reqs = len(batch)
        num_scheduled = np.array([len(t) for t, _, _ in batch], dtype=np.int32)
        num_tokens = int(num_scheduled.sum())
        ids, slots = [], []
        self.block_table.zero_()                                              # padded rows: null block 0
        for r, (tokens, computed, blocks) in enumerate(batch):
            ids += tokens
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(computed, computed + len(tokens))]
            self.block_table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            self.seq_lens.np[r] = computed + len(tokens)
        self.input_ids[:num_tokens].copy_(torch.tensor(ids, dtype=torch.int64))
        self.input_ids[num_tokens:num_tokens_padded].zero_()
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.slot_mapping[:num_tokens].copy_(torch.tensor(slots, dtype=torch.int64))
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:num_reqs + 1] = np.cumsum(num_scheduled)
        self.query_start_loc.np[num_reqs + 1:] = num_tokens                  # non-decreasing for FULL graphs
        self.query_start_loc.copy_to_gpu()
        self.seq_lens.np[num_reqs:] = 0
        self.seq_lens.copy_to_gpu()
        return num_reqs, num_tokens

    def update_attn_params(self, num_tokens_padded, num_reqs_padded):
        """The graph-task update before replay: FIA gets this step's host-side sequence lengths."""
        actual_seq_lengths_q = self.query_start_loc.np[1:num_reqs_padded + 1].tolist()
        actual_seq_lengths_kv = self.seq_lens.np[:num_reqs_padded].tolist()
        self.attn_plan.update(num_tokens_padded, actual_seq_lengths_q, actual_seq_lengths_kv)

    def _forward(self, n):
        return self.model.forward(self.input_ids[:n], self.kv_caches, self.block_table, self.slot_mapping[:n],
                                  self.attn_plan)

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        static = {"input_ids": self.input_ids, "slot_mapping": self.slot_mapping, "block_table": self.block_table,
                  "query_start_loc": self.query_start_loc.gpu, "seq_lens": self.seq_lens.gpu,
                  "fia_token_req": self.attn_plan.token_req, "fia_token_kv_len": self.attn_plan.token_kv_len}
        state = {f"kv_caches[{i}].{k}": t for i, c in enumerate(self.kv_caches) for k, t in zip("kv", c)}
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            # dummy run: a uniform decode batch of `size` one-token requests (null blocks, PAD_SLOT_ID writes)
            cg_mode, desc = dispatch(size, size)
            self._prepare_inputs([([0], 0, [0])] * size, desc.num_tokens)
            self.slot_mapping.fill_(PAD_SLOT_ID)
            num_reqs_padded = self._pad_query_start_loc_for_fia(desc.num_tokens, desc.num_reqs, size, cg_mode,
                                                                desc.num_reqs)
            self.update_attn_params(desc.num_tokens, num_reqs_padded)
            self.graphs[size] = capture(lambda n=size: self._forward(n), device=self.device, pool=pool,
                                        static=static, state=state, owner="NPUModelRunner",
                                        name=f"FULL acl graph {size}")

    def execute_model(self, batch):
        num_tokens = sum(len(t) for t, _, _ in batch)
        cg_mode, desc = ("NONE", BatchDescriptor(num_tokens, len(batch))) if self.enforce_eager else \
            dispatch(num_tokens, len(batch))
        num_tokens_padded = desc.num_tokens
        num_reqs, num_tokens = self._prepare_inputs(batch, num_tokens_padded)
        num_reqs_padded = desc.num_reqs if desc.num_reqs is not None else num_reqs
        if cg_mode == "FULL":
            num_reqs_padded = self._pad_query_start_loc_for_fia(num_tokens_padded, num_reqs_padded, num_reqs,
                                                                cg_mode, desc.num_reqs)
        self.update_attn_params(num_tokens_padded, num_reqs_padded)
        if cg_mode == "FULL":
            g, out = self.graphs[num_tokens_padded]
            out = replay(g, out, real=num_tokens, size=num_tokens_padded)
        else:
            out = self._forward(num_tokens)
        return out[:num_tokens]


# --- the serving loop (stand-in scheduler; the decode tokens are fixed in advance) ---------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(12)
    prompts = {r: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for r, n in (("A", 6), ("B", 4), ("C", 3))}
    decodes = {r: torch.randint(0, VOCAB, (3,), generator=gen).tolist() for r in "ABC"}
    blocks = {"A": [1, 2, 3], "B": [4, 5, 6], "C": [7, 8, 9]}
    steps = [[("A", "prefill"), ("B", "prefill")],                # 10 tokens: eager
             [("A", 0), ("B", 0)],                                 # graph 4
             [("A", 1), ("B", 1), ("C", "prefill")],               # 5 tokens, 3 requests: graph 8
             [("A", 2), ("B", 2), ("C", 0)]]                       # graph 4

    def serve(enforce_eager: bool):
        runner = NPUModelRunner(device, enforce_eager)
        computed = {r: 0 for r in "ABC"}
        outs = []
        for step in steps:
            batch = []
            for r, what in step:
                tokens = prompts[r] if what == "prefill" else [decodes[r][what]]
                batch.append((tokens, computed[r], blocks[r]))
            out = runner.execute_model(batch)
            outs.append(out.clone())
            for (r, _), (tokens, _, _) in zip(step, batch):
                computed[r] += len(tokens)
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
