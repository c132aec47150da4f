"""AReno (inclusionAI/AReno), an RL framework with its own rollout engine, decodes hybrid recurrent/attention models
(Qwen3.5, MiniCPM-V 4.6: Gated-DeltaNet layers beside full-attention layers) through CUDA graphs captured per batch
bucket. ``DecodeGraph`` owns the static inputs of one bucket (token ids, positions, ``cache_seqlens``, the paged-KV
``block_table`` and the per-row ``recurrent_slots``: which row of the layers' recurrent-state and conv-state caches a
row reads and writes); ``replay_tensors`` copies a step's real rows in, fills the tail rows of a batch smaller than
the bucket with no-op values, and replays. Padded rows already pointed their KV at a dedicated scratch block; their
recurrent slot, and every row of the buffer during the warmup and capture, was slot 0: a slot the scheduler hands to
real requests (its free list starts at 0). The captured GDN layer reads each row's state at its slot and writes the
updated state back there, so a padded replay also runs the padded rows' dummy token through slot 0's state and writes
that back over the real request that owns slot 0; the warmup runs wrote slot 0 before any request was admitted, and
the first request admitted there starts its prefill from that state. Eagerly (no graphs, no padding) every row has a
slot of its own. The fix reserves one extra slot, never admitted, for the warmup, capture and padded rows.

Upstream: https://github.com/inclusionAI/AReno/pull/509 ("fix(cuda): isolate recurrent decode graph scratch state",
author xsuler, merged 2026-08-23). Read: the PR description (summary, root cause, validation); in the code index, the
files as they stand after the fix: ``areno/engine/runtime/decode_graph.py`` (``DecodeGraph.__init__`` with
``scratch_recurrent_slot``, ``recurrent_slots = torch.full((bucket,), scratch_recurrent_slot)``, ``_forward``,
``warmup``, ``capture``, ``replay_tensors`` with ``recurrent_slots[actual:bucket].fill_(scratch_recurrent_slot)``,
``bucket_for``), ``areno/engine/inference.py`` (``InferenceManager._init_infer_cache`` with
``_scratch_recurrent_slot = max_running_seqs`` and ``set_kv_caches(caches, num_slots=max_running_seqs + 1)``,
``_generate_rollout_tokens_no_sync``, ``_admit_pending_rollout_rows``, ``_infer_decode_next_token_tensor``,
``_decode_graph_for_active_count``, ``_graph_for_rows``, ``_init_decode_graphs``, ``_new_decode_graph``,
``_capture_graph``, ``_free_rollout_rows``, ``_recurrent_slots_for_active_rows``, ``_block_table_for_active_rows``),
the PR's regression test ``test_recurrent_padding_uses_dedicated_scratch_slot`` (real slots [0, 2] in a bucket of 4
must give [0, 2, 4, 4]), ``areno/engine/data/rollout_state.py`` (``InferenceBatchState``: ``_free_recurrent_slots =
list(range(max_running_seqs))``, ``pop(0)`` on admission, ``build_prefill_payload``, ``ensure_decode_blocks``) and the
Qwen3.5 model file (``Qwen35GatedDeltaNet``: ``_causal_conv_infer`` decode (``conv_cache.index_select(0, slots)``,
``conv_cache[slots] = window[:, :, 1:]``), ``_causal_conv_infer_prefill``, ``_forward_infer`` (decode and prefill both
start from ``state_cache.index_select(0, slots)`` and end with ``state_cache[slots] = state``)).
Not read: the diff itself and the code at its parent (the repository snapshot I could fetch predates the recurrent
slots; the index holds only the fixed files). The buggy lines are therefore reconstructed from the PR's root cause
("CUDA graph capture initialized recurrent slots with live request slot IDs ... padded graph rows also reused slot 0")
and from the fixed lines: ``recurrent_slots`` made as zeros, the padded tail filled with 0, no scratch slot in the
cache (``num_slots=max_running_seqs``). Also not read: the FLA kernels, the attention backend, the MiniCPM model, the
sampling helpers beyond their calls, any review thread.
Symptom: with CUDA graphs, rollouts of hybrid recurrent-attention models diverge from what the trainer recomputes
(MiniCPM-V-4.6, TP=2: ``logp_abs_diff_mean`` 0.819 before the fix, 0.0076 after; the pre-multimodal baseline 0.0069).
Mechanism: ``replay_tensors`` fills ``recurrent_slots[actual:bucket]`` with 0 when fewer rows than the bucket decode;
the captured ``_causal_conv_infer`` / ``_forward_infer`` gather the padded rows' conv and recurrent state from slot 0,
advance it with the padded token, and scatter it back to slot 0 after the real rows, so the request that owns slot 0
continues from a state its own token did not produce (on the CPU the last of the duplicate writes wins; on a GPU the
order is unspecified). Before any request, ``DecodeGraph.warmup`` runs the model three times with all rows on slot 0,
which leaves slot 0's recurrent state non-zero for the first request admitted there.
Doctor: stale-padding, at replay_tensors. Real rows depend on what the padded rows hold: the padded rows' recurrent
slot (0) aliases a live request's state, which the captured state update then overwrites. ``replay_tensors`` is where
the padded rows' slot is written (``fill_(0)``) and the function the fix changes (``fill_(scratch_recurrent_slot)``);
the same defect in ``__init__`` lets the warmup runs write slot 0 (a persistent-mutation facet, also fixed by the PR),
but the replay facet is the one that recurs on every padded step and the one the PR's test pins.
Fix (upstream): ``_init_infer_cache`` sets ``_scratch_recurrent_slot = max_running_seqs`` and allocates
``max_running_seqs + 1`` recurrent slots; ``DecodeGraph`` takes ``scratch_recurrent_slot``, initialises
``recurrent_slots`` to it (warmup and capture use it) and fills padded rows with it in ``replay_tensors``.
Modelled: ``DecodeGraph`` (``__init__``, ``_forward``, ``warmup``, ``capture``, ``replay_tensors``), ``bucket_for``,
``_graph_for_rows``, ``InferMeta``, ``InferenceBatchState`` (``build_prefill_payload``, ``ensure_decode_blocks``),
``payload_to_infer_meta``, ``InferenceManager`` (``_init_infer_cache``, ``infer_rollout``,
``_generate_rollout_tokens_no_sync``, ``_admit_pending_rollout_rows``, ``_infer_next_token_tensor``,
``_infer_decode_next_token_tensor``, ``_decode_graph_for_active_count``, ``_init_decode_graphs``,
``_new_decode_graph``, ``_capture_graph``, ``_free_rollout_rows``, ``_block_table_for_active_rows``,
``_recurrent_slots_for_active_rows``, ``_ensure_decode_kv_blocks``), ``Qwen35GatedDeltaNet`` (``_causal_conv_infer``,
``_causal_conv_infer_prefill``, ``_forward_infer``, ``set_state_cache``, ``reset_kv_cache``), a model with
``allocate_kv_caches``, ``set_kv_caches(num_slots=...)``, ``reset_kv_caches``, ``reset_recurrent_cache_slots``.
Stand-ins: the model is mine: vocabulary 32, hidden 16, one GDN layer (2 key/value heads of 4, conv kernel 3) then one
full-attention layer (2 heads of 8) on a paged KV cache of block size 4, no MLP or RoPE, float64; the gated delta rule
and the depthwise SiLU conv are written in torch (upstream: FLA / ARENO kernels), a token at a time in prefill; linear
layers are a product and a sum so a row's numbers do not depend on the batch's row count. Greedy sampling, no TP/DP,
no speculative decoding, no routing replay, no multimodal features; rollouts finish by length only. Prefill admits
whole prompts within ``max_prefill_tokens`` (no chunking); the capture's memory vote and barriers are left out.
Workload: one rollout of 7 prompts (lengths 5, 4, 6, 3, 5, 4, 6; 5 new tokens each), ``max_running_seqs`` 4,
``max_prefill_tokens`` 10, ``decode_graph_buckets`` [1] (graphs for buckets 1 and 4: active batches of 2 and 3 are
padded to 4). The run without graphs is the same engine with ``eager_decode``. Outputs: every step's logits (prefill
and decode), then each prompt's generated tokens and logprobs.
Measured: the check printed
  areno_509_recurrent_graph_padding_rows_share_live_slot_zero [bug] on cpu: misbehaves (max |graph - eager| = 17)
  areno_509_recurrent_graph_padding_rows_share_live_slot_zero [fix] on cpu: equals eager (max |graph - eager| = 0)
Per step (bug): the first prefill (prompts 0 and 1, slots 0 and 1) is off by 0.17 in prompt 0's logits (it starts
from the state the three warmup runs left in slot 0); the first padded decode (2 real rows in the bucket of 4, padded
rows on slot 0) overwrites prompt 0's state, and the next decodes are off by 5.4, 11 and 13. Prompt 0 finishes and its
slot is reset, prompt 4 is admitted to slot 0 from a clean state, and the padded replays of 3 real rows in the bucket
of 4 overwrite it again: off by 0.53, then 4.2, with no warmup state left in play. Generated tokens differ for prompts
0 and 4, the largest difference (17) is a token id. With the fix every logit, token and logprob is exact. Both
variants together take about 4.5 s on the CPU, imports included. Ruff is not installed in the environment.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from workbench.engine import events, graph, new_graph
from workbench.zoo import kit
from workbench.zoo.kit import compare, generator

UPSTREAM = "https://github.com/inclusionAI/AReno/pull/509"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "replay_tensors"
SYMPTOM = ("with CUDA graphs, padded decode rows (and the warmup rows) used recurrent slot 0, which belongs to a real "
           "request, so the captured Gated-DeltaNet state update overwrote that request's recurrent and conv state and "
           "rollout log-probs diverged from the trainer's")

DTYPE = torch.float64
VOCAB, HIDDEN = 32, 16
K_HEADS, V_HEADS, HEAD_K, HEAD_V, CONV_K = 2, 2, 4, 4, 3
ATTN_HEADS, ATTN_DIM = 2, 8
BLOCK_SIZE = 4
_variant = "bug"


def linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` as a product and a sum: a row's result does not depend on how many rows the batch has."""
    return (x.unsqueeze(-2) * w).sum(-1)


# --- areno/engine/runtime/metadata.py -------------------------------------------------------------------------------

@dataclasses.dataclass
class InferMeta:
    mode: str
    sample_indices: Tensor | None = None
    cache_seqlens: Tensor | None = None
    block_table: Tensor | None = None
    recurrent_slots: Tensor | None = None
    cu_seqlens: Tensor | None = None
    cache_block_ids: Tensor | None = None
    cache_block_offsets: Tensor | None = None
    tokens_per_seq: int = 1


@dataclasses.dataclass
class CausalLMOutput:
    logits_shard: Tensor
    hidden_states: Tensor


# --- areno/models/qwen3_5 (stand-in) ---------------------------------------------------------------------------------

class Qwen35GatedDeltaNet:
    """Gated Delta-Net layer: a depthwise causal conv (conv cache) then the gated delta rule (recurrent state cache)."""

    def __init__(self, gen: torch.Generator, device: str):
        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.key_dim, self.value_dim = K_HEADS * HEAD_K, V_HEADS * HEAD_V
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = w(conv_dim + self.value_dim, HIDDEN, scale=HIDDEN ** -0.5)
        self.in_proj_ba = w(2 * V_HEADS, HIDDEN, scale=HIDDEN ** -0.5)
        self.conv1d_weight = w(conv_dim, 1, CONV_K, scale=0.5)
        self.dt_bias = w(V_HEADS, scale=0.5)
        self.A_log = w(V_HEADS, scale=0.5)
        self.norm_weight = torch.ones(HEAD_V, dtype=DTYPE, device=device)
        self.out_proj = w(HIDDEN, self.value_dim, scale=self.value_dim ** -0.5)
        self.scale = HEAD_K ** -0.5
        self.state_cache = torch.tensor([])
        self.conv_cache = torch.tensor([])

    def forward(self, hidden_states: Tensor, infer_meta: InferMeta) -> Tensor:
        qkvz = linear(hidden_states, self.in_proj_qkvz)                       # [1, T, conv_dim + value_dim]
        ba = linear(hidden_states, self.in_proj_ba)
        conv_dim = 2 * self.key_dim + self.value_dim
        mixed = self._causal_conv_infer(qkvz[..., :conv_dim], infer_meta)
        q, k, v = mixed[0].split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        z = qkvz[0, :, conv_dim:]
        b, a = ba[0].split((V_HEADS, V_HEADS), dim=-1)
        out = self._forward_infer(q.reshape(-1, K_HEADS, HEAD_K), k.reshape(-1, K_HEADS, HEAD_K),
                                  v.reshape(-1, V_HEADS, HEAD_V), a, b, infer_meta)
        out = self._rmsnorm_gate(out, z.reshape(-1, V_HEADS, HEAD_V)).reshape(1, -1, self.value_dim)
        return linear(out, self.out_proj)

    def _conv_step(self, window: Tensor) -> Tensor:
        """Depthwise causal conv of one position over its window ``[rows, C, CONV_K]``, SiLU."""
        return F.silu((window * self.conv1d_weight.squeeze(1)).sum(-1))

    def _causal_conv_infer(self, x: Tensor, infer_meta: InferMeta) -> Tensor:
        slots = infer_meta.recurrent_slots.long()
        if infer_meta.mode == "decode":
            current = x.reshape(-1, x.shape[-1])
            history = self.conv_cache.index_select(0, slots).to(dtype=current.dtype)
            window = torch.cat((history, current.unsqueeze(-1)), dim=-1)
            out = self._conv_step(window)
            self.conv_cache[slots] = window[:, :, 1:].detach().to(dtype=self.conv_cache.dtype)
            return out.view(x.shape)
        return self._causal_conv_infer_prefill(x, infer_meta.cu_seqlens, slots)

    def _causal_conv_infer_prefill(self, x: Tensor, cu_seqlens: Tensor, slots: Tensor) -> Tensor:
        out = torch.empty_like(x)
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        for idx, slot in enumerate(slots):
            start, end = int(cu[idx].item()), int(cu[idx + 1].item())
            segment = x[0, start:end]                                            # [L, C]
            padded = torch.cat((torch.zeros(CONV_K - 1, x.shape[-1], dtype=x.dtype, device=x.device), segment))
            for t in range(end - start):
                out[0, start + t] = self._conv_step(padded[t: t + CONV_K].transpose(0, 1).unsqueeze(0))[0]
            self.conv_cache[slot] = padded[-(CONV_K - 1):].transpose(0, 1).to(dtype=self.conv_cache.dtype)
        return out

    def _delta_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor):
        """One token of the gated delta rule per row: q, k [rows, H, Dk], v [rows, H, Dv], state [rows, H, Dk, Dv]."""
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        state = state * g.exp()[..., None, None]
        kv_mem = (state * k.unsqueeze(-1)).sum(-2)
        delta = (v - kv_mem) * beta.unsqueeze(-1)
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        return (state * q.unsqueeze(-1)).sum(-2) * self.scale, state

    def _forward_infer(self, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, infer_meta: InferMeta) -> Tensor:
        slots = infer_meta.recurrent_slots.long()
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        beta = torch.sigmoid(b)
        initial_state = self.state_cache.index_select(0, slots)
        if infer_meta.mode == "decode":
            out, state = self._delta_rule(q, k, v, g, beta, initial_state)
            self.state_cache[slots] = state.detach().to(dtype=self.state_cache.dtype)
            return out
        out = torch.empty_like(v)
        cu = infer_meta.cu_seqlens.tolist()
        for idx in range(len(cu) - 1):
            state = initial_state[idx: idx + 1]
            for t in range(cu[idx], cu[idx + 1]):
                o, state = self._delta_rule(q[t: t + 1], k[t: t + 1], v[t: t + 1], g[t: t + 1], beta[t: t + 1],
                                            state)
                out[t] = o[0]
            self.state_cache[slots[idx]] = state[0].detach()
        return out

    def _rmsnorm_gate(self, x: Tensor, gate: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return x * F.silu(gate)

    def set_state_cache(self, state_cache: Tensor, conv_cache: Tensor) -> None:
        self.state_cache = state_cache
        self.conv_cache = conv_cache

    def reset_kv_cache(self) -> None:
        self.state_cache.zero_()
        self.conv_cache.zero_()


class Qwen35FullAttention:
    """Stand-in full-attention layer on a paged KV cache (no RoPE)."""

    def __init__(self, gen: torch.Generator, device: str):
        def w(*shape):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * HIDDEN ** -0.5).to(device)
        self.qkv = w(3 * ATTN_HEADS * ATTN_DIM, HIDDEN)
        self.o_proj = w(HIDDEN, ATTN_HEADS * ATTN_DIM)
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])

    def forward(self, hidden_states: Tensor, infer_meta: InferMeta) -> Tensor:
        q, k, v = linear(hidden_states[0], self.qkv).view(-1, 3, ATTN_HEADS, ATTN_DIM).unbind(1)
        scale = ATTN_DIM ** -0.5
        if infer_meta.mode == "decode":
            rows = q.shape[0]
            pos = infer_meta.cache_seqlens.long()
            blocks = infer_meta.block_table.long()
            row_ids = torch.arange(rows, device=q.device)
            self.k_cache[blocks[row_ids, pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k
            self.v_cache[blocks[row_ids, pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v
            ar = torch.arange(blocks.shape[1] * BLOCK_SIZE, device=q.device)
            keys = self.k_cache[blocks[:, ar // BLOCK_SIZE], ar % BLOCK_SIZE]          # [rows, L, H, D]
            vals = self.v_cache[blocks[:, ar // BLOCK_SIZE], ar % BLOCK_SIZE]
            scores = (q.unsqueeze(1) * keys).sum(-1) * scale                           # [rows, L, H]
            scores = scores.masked_fill((ar.unsqueeze(0) > pos.unsqueeze(1)).unsqueeze(-1), float("-inf"))
            out = (scores.softmax(1).unsqueeze(-1) * vals).sum(1)
        else:
            self.k_cache[infer_meta.cache_block_ids, infer_meta.cache_block_offsets] = k
            self.v_cache[infer_meta.cache_block_ids, infer_meta.cache_block_offsets] = v
            out = torch.empty_like(q)
            cu = infer_meta.cu_seqlens.tolist()
            for idx in range(len(cu) - 1):
                s, e = cu[idx], cu[idx + 1]
                scores = (q[s:e].unsqueeze(1) * k[s:e].unsqueeze(0)).sum(-1) * scale    # [Lq, Lk, H]
                causal = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~causal.unsqueeze(-1), float("-inf"))
                out[s:e] = (scores.softmax(1).unsqueeze(-1) * v[s:e].unsqueeze(0)).sum(1)
        return linear(out.reshape(1, -1, ATTN_HEADS * ATTN_DIM), self.o_proj)


class Qwen35ForCausalLM:
    def __init__(self, device: str):
        gen = generator(509)
        self.embed_tokens = (torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.gdn = Qwen35GatedDeltaNet(gen, device)
        self.attn = Qwen35FullAttention(gen, device)
        self.lm_head = (torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE) * HIDDEN ** -0.5 * 4).to(device)
        self.training = False

    @staticmethod
    def _norm(x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, infer_meta: InferMeta) -> CausalLMOutput:
        del position_ids                                       # no RoPE in the stand-in
        hidden = self.embed_tokens[input_ids]                  # [1, T, HIDDEN]
        hidden = hidden + self.gdn.forward(self._norm(hidden), infer_meta)
        hidden = hidden + self.attn.forward(self._norm(hidden), infer_meta)
        hidden = self._norm(hidden)
        return CausalLMOutput(logits_shard=linear(hidden, self.lm_head), hidden_states=hidden)

    def allocate_kv_caches(self, num_blocks: int, block_size: int, device: str) -> dict:
        shape = (num_blocks, block_size, ATTN_HEADS, ATTN_DIM)
        return {"k": torch.zeros(shape, dtype=DTYPE, device=device),
                "v": torch.zeros(shape, dtype=DTYPE, device=device)}

    def set_kv_caches(self, caches: dict, num_slots: int) -> None:
        self.attn.k_cache, self.attn.v_cache = caches["k"], caches["v"]
        device = caches["k"].device
        self.gdn.set_state_cache(torch.zeros(num_slots, V_HEADS, HEAD_K, HEAD_V, dtype=DTYPE, device=device),
                                 torch.zeros(num_slots, 2 * self.gdn.key_dim + self.gdn.value_dim, CONV_K - 1,
                                             dtype=DTYPE, device=device))

    def reset_kv_caches(self) -> None:
        self.attn.k_cache.zero_()
        self.attn.v_cache.zero_()
        self.gdn.reset_kv_cache()

    def reset_recurrent_cache_slots(self, slots: Tensor) -> None:
        self.gdn.state_cache[slots] = 0
        self.gdn.conv_cache[slots] = 0


# --- areno/engine/runtime/decode_graph.py ---------------------------------------------------------------------------

def bucket_for(batch_size: int, buckets: list[int]) -> int:
    for bucket in buckets:
        if batch_size <= bucket:
            return bucket
    return batch_size


class DecodeGraph:
    """Reusable CUDA graph for one decode batch bucket (static input buffers, warmup, capture, replay)."""

    def __init__(self, model, bucket: int, max_blocks_per_seq: int, scratch_block: int,
                 scratch_recurrent_slot: int | None, device: str):
        self.model = model
        self.bucket = bucket
        self.scratch_block = scratch_block
        self.scratch_recurrent_slot = scratch_recurrent_slot
        self.device = device
        self.input_ids = torch.zeros((1, bucket), device=device, dtype=torch.long)
        self.position_ids = torch.zeros((1, bucket), device=device, dtype=torch.long)
        self.cache_seqlens = torch.zeros(bucket, device=device, dtype=torch.int32)
        if _variant == "fix":
            # Graph warmup/capture executes the model before any request is admitted. Point every dummy row at the
            # dedicated scratch recurrent slot so it cannot seed live request state with synthetic tokens.
            self.recurrent_slots = torch.full((bucket,), scratch_recurrent_slot, device=device, dtype=torch.long)
        else:       # reconstructed: rows start on slot 0, a slot the scheduler gives to real requests
            self.recurrent_slots = torch.zeros(bucket, device=device, dtype=torch.long)
        self.block_table = torch.full((bucket, max_blocks_per_seq), scratch_block, device=device, dtype=torch.int32)
        self.meta = InferMeta(mode="decode", sample_indices=torch.arange(bucket, device=device, dtype=torch.long),
                              cache_seqlens=self.cache_seqlens, block_table=self.block_table,
                              recurrent_slots=self.recurrent_slots)
        self.graph = new_graph(device)
        self.logits_shard: Tensor | None = None
        self.output_hidden: Tensor | None = None

    def _forward(self) -> tuple[Tensor, Tensor]:
        out = self.model(input_ids=self.input_ids, position_ids=self.position_ids, infer_meta=self.meta)
        return out.logits_shard, out.hidden_states

    def warmup(self, iterations: int = 3) -> None:
        events.static_buffers(f"DecodeGraph bucket={self.bucket}", {
            "input_ids": self.input_ids, "position_ids": self.position_ids, "cache_seqlens": self.cache_seqlens,
            "block_table": self.block_table, "recurrent_slots": self.recurrent_slots})
        with events.warmup():
            for _ in range(iterations):
                outputs = self._forward()
                del outputs

    def capture(self) -> None:
        with graph(self.graph, name=f"decode bucket={self.bucket}"):
            self.logits_shard, self.output_hidden = self._forward()
        kit.remember_step(self.graph, self._forward)

    def replay_tensors(self, input_ids: Tensor, position_ids: Tensor, cache_seqlens: Tensor, block_table: Tensor,
                       recurrent_slots: Tensor) -> Tensor:
        """Copy one dynamic decode step into static buffers and replay the graph."""
        actual = int(cache_seqlens.numel())
        if actual > self.bucket:
            raise ValueError(f"decode payload has {actual} rows, graph bucket is {self.bucket}")
        self.input_ids[0, :actual].copy_(input_ids.view(-1))
        self.position_ids[0, :actual].copy_(position_ids.view(-1))
        self.cache_seqlens[:actual].copy_(cache_seqlens)
        self.recurrent_slots[:actual].copy_(recurrent_slots)
        block_cols = int(block_table.shape[1])
        self.block_table[:actual, :block_cols].copy_(block_table)
        if block_cols < self.block_table.shape[1]:
            self.block_table[:actual, block_cols:].fill_(self.scratch_block)
        # Fill the unused tail rows with no-op values so the captured kernel runs over the full bucket without
        # touching live KV cache slots.
        if actual < self.bucket:
            self.input_ids[0, actual:].fill_(0)
            self.position_ids[0, actual:].fill_(0)
            self.block_table[actual: self.bucket].fill_(self.scratch_block)
            self.cache_seqlens[actual: self.bucket].fill_(0)
            if _variant == "fix":
                self.recurrent_slots[actual: self.bucket].fill_(self.scratch_recurrent_slot)
            else:   # reconstructed: padded rows reuse slot 0
                self.recurrent_slots[actual: self.bucket].fill_(0)
        kit.replay(self.graph, self.logits_shard[0], real=actual, size=self.bucket)   # graph.replay()
        return self.logits_shard


# --- areno/engine/data/rollout_state.py -----------------------------------------------------------------------------

class InferenceBatchState:
    def __init__(self, prompts: list[list[int]], max_new_tokens: int, *, max_running_seqs: int,
                 max_prefill_tokens: int, kv_block_size: int):
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.max_running_seqs = max_running_seqs
        self.max_cache_len = max(len(p) for p in prompts) + max_new_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_block_size = kv_block_size
        self.max_blocks_per_seq = -(-self.max_cache_len // kv_block_size)
        self.num_cache_blocks = max_running_seqs * self.max_blocks_per_seq
        self._pending_seq_id = 0
        self._free_blocks = list(range(self.num_cache_blocks))
        self._seq_to_blocks: dict[int, list[int]] = {}
        self._free_recurrent_slots = list(range(self.max_running_seqs))
        self._seq_to_recurrent_slot: dict[int, int] = {}
        self._last_active_ids: list[int] = []

    @property
    def has_pending_prompts(self) -> bool:
        return self._pending_seq_id < len(self.prompts)

    def build_prefill_payload(self) -> dict | None:
        """Admit whole pending prompts while the sequence and token budgets allow (no chunking here)."""
        input_ids, position_ids, cu_seqlens, sample_indices = [], [], [0], []
        block_table, cache_block_ids, cache_block_offsets, recurrent_slots, active_ids = [], [], [], [], []
        while self._pending_seq_id < len(self.prompts):
            seq_id = self._pending_seq_id
            if len(self._seq_to_blocks) >= self.max_running_seqs:
                break
            prompt = self.prompts[seq_id]
            if len(input_ids) + len(prompt) > self.max_prefill_tokens:
                break
            blocks = [self._free_blocks.pop(0) for _ in range(-(-len(prompt) // self.kv_block_size))]
            self._seq_to_blocks[seq_id] = blocks
            self._seq_to_recurrent_slot[seq_id] = self._free_recurrent_slots.pop(0)
            for token_idx in range(len(prompt)):
                cache_block_ids.append(blocks[token_idx // self.kv_block_size])
                cache_block_offsets.append(token_idx % self.kv_block_size)
            input_ids.extend(prompt)
            position_ids.extend(range(len(prompt)))
            cu_seqlens.append(len(input_ids))
            sample_indices.append(len(input_ids) - 1)
            block_table.append(blocks + [blocks[-1]] * (self.max_blocks_per_seq - len(blocks)))
            recurrent_slots.append(self._seq_to_recurrent_slot[seq_id])
            active_ids.append(seq_id)
            self._pending_seq_id += 1
        if not input_ids:
            return None
        self._last_active_ids = active_ids
        return {"input_ids": torch.tensor(input_ids), "position_ids": torch.tensor(position_ids),
                "sample_indices": torch.tensor(sample_indices), "cu_seqlens": torch.tensor(cu_seqlens),
                "block_table": torch.tensor(block_table, dtype=torch.int32),
                "cache_block_ids": torch.tensor(cache_block_ids),
                "cache_block_offsets": torch.tensor(cache_block_offsets),
                "recurrent_slots": torch.tensor(recurrent_slots)}

    def ensure_decode_blocks(self, seq_ids: list[int], next_positions: list[int]) -> None:
        for seq_id, next_position in zip(seq_ids, next_positions):
            if next_position % self.kv_block_size != 0:
                continue
            blocks = self._seq_to_blocks[seq_id]
            while len(blocks) < next_position // self.kv_block_size + 1:
                blocks.append(self._free_blocks.pop(0))


def payload_to_infer_meta(raw: dict, device: str) -> InferMeta:
    return InferMeta(mode="prefill", sample_indices=raw["sample_indices"].to(device),
                     block_table=raw["block_table"].to(device), recurrent_slots=raw["recurrent_slots"].to(device),
                     cu_seqlens=raw["cu_seqlens"].to(device), cache_block_ids=raw["cache_block_ids"].to(device),
                     cache_block_offsets=raw["cache_block_offsets"].to(device))


# --- areno/engine/inference.py --------------------------------------------------------------------------------------

def _graph_for_rows(graphs: dict[int, DecodeGraph], rows: int) -> DecodeGraph | None:
    """Smallest captured bucket that fits ``rows``; padded rows use the scratch block."""
    for bucket in sorted(graphs):
        if bucket >= rows:
            return graphs[bucket]
    return None


@dataclasses.dataclass
class RuntimeConfig:
    eager_decode: bool
    decode_graph_buckets: list[int]


class InferenceManager:
    """Own rollout generation and decode graph capture."""

    def __init__(self, model: Qwen35ForCausalLM, device: str, runtime: RuntimeConfig):
        self.model, self.device, self.runtime = model, device, runtime
        self._decode_graphs: dict[int, DecodeGraph] = {}
        self._decode_graph_init_attempted = False
        self.step_logits: list[Tensor] = []

    def _init_infer_cache(self, max_running_seqs: int, num_blocks: int, block_size: int,
                          max_blocks_per_seq: int) -> None:
        self._infer_batch_size = max_running_seqs
        if _variant == "fix":
            # Recurrent models need their own scratch slot for CUDA-graph warmup, capture, and padded replay rows.
            # Real requests exclusively own slots [0, max_running_seqs); the extra slot is never admitted.
            self._scratch_recurrent_slot = max_running_seqs
            num_slots = max_running_seqs + 1
        else:       # reconstructed: no scratch recurrent slot before the fix
            self._scratch_recurrent_slot = None
            num_slots = max_running_seqs
        # One extra block past `num_blocks`: a fixed scratch block for padded rows during graph-shape decode.
        self._infer_cache_blocks = num_blocks + 1
        self._scratch_block = num_blocks
        self._max_blocks_per_seq = max_blocks_per_seq
        caches = self.model.allocate_kv_caches(self._infer_cache_blocks, block_size, self.device)
        self.model.set_kv_caches(caches, num_slots=num_slots)
        self._init_decode_graphs()

    def infer_rollout(self, prompts: list[list[int]], max_new_tokens: int, *, max_running_seqs: int,
                      max_prefill_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        state = InferenceBatchState(prompts, max_new_tokens, max_running_seqs=max_running_seqs,
                                    max_prefill_tokens=max_prefill_tokens, kv_block_size=BLOCK_SIZE)
        self._init_infer_cache(state.max_running_seqs, state.num_cache_blocks, BLOCK_SIZE, state.max_blocks_per_seq)
        return self._generate_rollout_tokens_no_sync(state)

    def _generate_rollout_tokens_no_sync(self, state: InferenceBatchState):
        """Prefill admitted prompts, then decode one token per active row; finished rows free their slots."""
        generated: dict[int, list[int]] = {}
        logprobs: dict[int, list[float]] = {}
        next_tokens = torch.empty(0, device=self.device, dtype=torch.long)
        cache_seqlens = torch.empty(0, device=self.device, dtype=torch.int32)
        position_ids = torch.empty(0, device=self.device, dtype=torch.long)
        active_rows: list[int] = []
        while True:
            admitted = self._admit_pending_rollout_rows(state, generated, logprobs)
            if admitted is not None:
                rows, tokens, lens = admitted
                active_rows += rows
                next_tokens = torch.cat([next_tokens, tokens])
                cache_seqlens = torch.cat([cache_seqlens, lens])
                position_ids = torch.cat([position_ids, lens.long()])
            if not active_rows and not state.has_pending_prompts:
                break
            self._ensure_decode_kv_blocks(state, active_rows, cache_seqlens)
            block_table = self._block_table_for_active_rows(state, active_rows)
            recurrent_slots = self._recurrent_slots_for_active_rows(state, active_rows)
            next_tokens, next_logprobs = self._infer_decode_next_token_tensor(
                next_tokens, position_ids, cache_seqlens, block_table, recurrent_slots, len(active_rows))
            for k, row in enumerate(active_rows):
                generated[row].append(int(next_tokens[k]))
                logprobs[row].append(float(next_logprobs[k]))
            cache_seqlens = cache_seqlens + 1
            position_ids = position_ids + 1
            remove = [len(generated[row]) >= state.max_new_tokens for row in active_rows]
            if any(remove):
                self._free_rollout_rows(state, [row for row, r in zip(active_rows, remove) if r])
                keep = torch.tensor([not r for r in remove], device=self.device)
                active_rows = [row for row, r in zip(active_rows, remove) if not r]
                next_tokens, cache_seqlens, position_ids = next_tokens[keep], cache_seqlens[keep], position_ids[keep]
        return ([generated[i] for i in range(len(state.prompts))], [logprobs[i] for i in range(len(state.prompts))])

    def _admit_pending_rollout_rows(self, state: InferenceBatchState, generated: dict, logprobs: dict):
        raw = state.build_prefill_payload()
        if raw is None:
            return None
        new_rows = list(state._last_active_ids)
        new_tokens, new_logprobs = self._infer_next_token_tensor(raw)
        for k, row in enumerate(new_rows):
            generated[row] = [int(new_tokens[k])]
            logprobs[row] = [float(new_logprobs[k])]
        lens = torch.tensor([len(state.prompts[row]) for row in new_rows], device=self.device, dtype=torch.int32)
        return new_rows, new_tokens, lens

    def _sample(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        tokens = logits.argmax(-1)                                      # greedy (temperature 0)
        return tokens, logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def _infer_next_token_tensor(self, raw: dict) -> tuple[Tensor, Tensor]:
        infer_meta = payload_to_infer_meta(raw, self.device)
        out = self.model(input_ids=raw["input_ids"].to(self.device).unsqueeze(0),
                         position_ids=raw["position_ids"].to(self.device).unsqueeze(0), infer_meta=infer_meta)
        logits = out.logits_shard[0, infer_meta.sample_indices]
        self.step_logits.append(logits.clone())
        return self._sample(logits)

    def _infer_decode_next_token_tensor(self, input_ids: Tensor, position_ids: Tensor, cache_seqlens: Tensor,
                                        block_table: Tensor, recurrent_slots: Tensor, active_count: int):
        graph_ = self._decode_graph_for_active_count(active_count)
        if graph_ is None:
            infer_meta = InferMeta(mode="decode", sample_indices=torch.arange(active_count, device=self.device),
                                   cache_seqlens=cache_seqlens, block_table=block_table,
                                   recurrent_slots=recurrent_slots)
            logits_shard = self.model(input_ids=input_ids[:active_count].view(1, active_count),
                                      position_ids=position_ids[:active_count].view(1, active_count),
                                      infer_meta=infer_meta).logits_shard[0, :active_count]
        else:
            logits_shard = graph_.replay_tensors(input_ids, position_ids, cache_seqlens, block_table,
                                                 recurrent_slots)[0, :active_count]
        self.step_logits.append(logits_shard.clone())
        return self._sample(logits_shard)

    def _decode_graph_for_active_count(self, active_count: int) -> DecodeGraph | None:
        if self.runtime.eager_decode:
            return None
        return _graph_for_rows(self._decode_graphs, active_count)

    def _init_decode_graphs(self) -> None:
        if self.runtime.eager_decode or self._decode_graph_init_attempted:
            return
        self._decode_graph_init_attempted = True
        events.persistent_state("Qwen3.5 caches", {
            "state_cache": self.model.gdn.state_cache, "conv_cache": self.model.gdn.conv_cache,
            "k_cache": self.model.attn.k_cache, "v_cache": self.model.attn.v_cache})
        buckets = sorted({b for b in self.runtime.decode_graph_buckets if 1 <= b <= self._infer_batch_size})
        buckets.append(self._infer_batch_size)
        for bucket in sorted(set(buckets)):
            graph_ = self._new_decode_graph(bucket)
            if self._capture_graph(graph_):
                self._decode_graphs[bucket] = graph_

    def _new_decode_graph(self, bucket: int) -> DecodeGraph:
        return DecodeGraph(self.model, bucket, self._max_blocks_per_seq, self._scratch_block,
                           self._scratch_recurrent_slot, self.device)

    def _capture_graph(self, graph_: DecodeGraph) -> bool:
        graph_.warmup()
        graph_.capture()
        return True

    def _ensure_decode_kv_blocks(self, state: InferenceBatchState, active_rows: list[int],
                                 cache_seqlens: Tensor) -> None:
        state.ensure_decode_blocks(active_rows, [int(pos) for pos in cache_seqlens.tolist()])

    def _block_table_for_active_rows(self, state: InferenceBatchState, active_rows: list[int]) -> Tensor:
        rows = []
        for row in active_rows:
            blocks = state._seq_to_blocks[row]
            rows.append(blocks + [blocks[-1]] * (state.max_blocks_per_seq - len(blocks)))
        return torch.tensor(rows, device=self.device, dtype=torch.int32)

    def _recurrent_slots_for_active_rows(self, state: InferenceBatchState, active_rows: list[int]) -> Tensor:
        slots = [state._seq_to_recurrent_slot[row] for row in active_rows]
        return torch.tensor(slots, device=self.device, dtype=torch.long)

    def _free_rollout_rows(self, state: InferenceBatchState, rows: list[int]) -> None:
        """Return KV blocks and recurrent-state slots owned by `rows`."""
        recurrent_slots = [state._seq_to_recurrent_slot[row] for row in rows]
        self.model.reset_recurrent_cache_slots(torch.tensor(recurrent_slots, device=self.device, dtype=torch.long))
        for row in rows:
            state._free_blocks.extend(state._seq_to_blocks.pop(row))
            state._free_recurrent_slots.append(state._seq_to_recurrent_slot.pop(row))


# --- workload -------------------------------------------------------------------------------------------------------

PROMPT_LENS = [5, 4, 6, 3, 5, 4, 6]
MAX_NEW_TOKENS, MAX_RUNNING_SEQS, MAX_PREFILL_TOKENS = 5, 4, 10


def serve(device: str, eager_decode: bool) -> list[Tensor]:
    gen = generator(7)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    manager = InferenceManager(Qwen35ForCausalLM(device), device,
                               RuntimeConfig(eager_decode=eager_decode, decode_graph_buckets=[1]))
    with torch.inference_mode():
        generated, logprobs = manager.infer_rollout(prompts, MAX_NEW_TOKENS, max_running_seqs=MAX_RUNNING_SEQS,
                                                    max_prefill_tokens=MAX_PREFILL_TOKENS)
    tokens = [torch.tensor(g, dtype=DTYPE) for g in generated]
    return manager.step_logits + tokens + [torch.tensor(lp, dtype=DTYPE) for lp in logprobs]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, eager_decode=False), lambda: serve(device, eager_decode=True))
