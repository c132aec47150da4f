"""LMDeploy PyTorch engine, Qwen3-Next with ``LMD_SKIP_WARMUP=1``: a decode graph is captured lazily on the first real batch of its size, and ``CUDAGraphRunner.__call__`` then replays the graph for that same batch; the capture's eager warmup has already advanced the sequences' gated-delta (SSM) conv and recurrent states, so the replay advances them a second time.

Upstream: https://github.com/InternLM/lmdeploy/commit/b1bb56db5f89166d9f416df8a425f44c69c1f739 ("fix graph capture",
InternLM/lmdeploy, by q.yao, 2025-11-06; a merge commit of the ``Qwen3 next`` branch whose own hunks carry the fix),
squashed into https://github.com/InternLM/lmdeploy/pull/4039 ("Qwen3 next", merged 2025-11-07 as 281e1017f).
Read: the commit's combined diff of ``lmdeploy/pytorch/backends/cuda/graph_runner.py`` (``CUDASingleGraphRunner``
gains ``make_output_buffers`` / ``slice_output``; ``capture`` keeps ``warmup_output = self.model(**padded_kwargs)``
and returns ``self.slice_output(warmup_buffers, kwargs)``; ``CUDAGraphRunner.__call__`` returns ``runner.capture``'s
output instead of falling through to ``runner.forward``, with the comment "SSM would update the state in
capture(warmup), replay the graph will leads unexpected state update."); at its first parent 1d905c9ef ("add skip
warmup flag", which adds ``LMD_SKIP_WARMUP`` / ``envs.skip_warmup`` and the early return in
``BaseModelAgent.warmup``): ``graph_runner.py`` whole, ``models/utils/cudagraph.py`` (``CudaGraphMixin``
``make_buffers_cudagraph`` / ``fill_buffers_cudagraph``), ``models/qwen3_next.py`` (``GatedDeltaMeta``,
``CausalConv1dFunc``, ``GatedDelta``, ``Qwen3NextGatedDeltaNet._load_state`` / ``_store_state`` / ``forward``,
``Qwen3NextModel.forward``, ``Qwen3NextForCausalLM.prepare_inputs_for_generation`` / ``make_buffers_cudagraph`` /
``fill_buffers_cudagraph``) and ``BaseModelAgent.warmup``; and the squashed merge 281e1017f's ``graph_runner.py``
(the fix as it landed). Not read: a PR thread or issue (none found), the ``StateCacheEngine`` and the fla /
causal_conv1d kernels (their decode semantics are stood in below).
Symptom: the PR describes none beyond the comment. As the mechanism implies (and as modelled): with the startup warmup
skipped, every decode step that captures a graph (the first batch of each capture size) applies that step's token
to the linear-attention states twice, so that step's logits and every later step of those sequences are wrong;
eager serving is right. Models without SSM state are unaffected (re-filling the same KV slots is idempotent).
Mechanism: ``CUDAGraphRunner.__call__`` finds no runner for the graph key, builds a ``CUDASingleGraphRunner`` and
calls ``capture``, which fills the static buffers from the real batch, runs the model once eagerly ("warmup") and
captures it (a capture launches nothing). The warmup's ``_store_state`` already ``index_copy_``'d the advanced conv
and recurrent states into the state caches at the batch's ``state_ids``. ``__call__`` then calls ``runner.forward``,
which re-fills the buffers and replays: the graph's ``_load_state`` reads the already-advanced states and stores them
advanced again. Eager runs each step once.
Doctor: persistent-mutation, at __call__. The capture step mutates the live SSM state caches twice, once by the
capture's warmup on the real batch and again by the replay of the same batch that ``__call__`` makes right after
capturing; the upstream fix is in ``__call__`` (return the capture's warmup output, no replay on the capture step).
Fix (upstream): ``capture`` returns the warmup run's output (sliced to the batch's tokens) and ``__call__`` returns it
on the step that captured; only later steps replay.
Modelled: ``CUDAGraphRunner`` (``get_graph_key`` on the capture batch sizes of ``_get_capture_batch_size_impl``,
``__call__``, ``prepare_inputs_for_generation``), ``CUDASingleGraphRunner`` (``capture`` with its eager warmup,
``forward``, and in the fix ``make_output_buffers`` / ``slice_output``), ``CudaGraphMixin`` buffers (``input_ids``,
``position_ids``, ``block_offsets``, ``qkv_lens`` with its ``q_start_loc`` / ``q_seqlens`` / ``kv_seqlens`` rows,
``cu_seqlens``) plus Qwen3-Next's ``state_ids`` buffer (filled with -1, then the batch), ``GatedDeltaMeta``
(``valid_state`` / ``state_ids``), ``_load_state`` / ``_store_state``, ``Qwen3NextForCausalLM
.prepare_inputs_for_generation`` interleaving state caches and KV caches by ``layer_types``, ``StepContext`` and
``BaseModelAgent._forward_impl``; the engine runs with ``LMD_SKIP_WARMUP=1``. Stand-ins: one linear-attention layer
(one head, dk = dv = 4, conv kernel 4) and one full-attention layer (one head, paged KV cache, block size 4);
``causal_conv1d_update`` and ``fused_recurrent_gated_delta_rule`` as torch ops with their decode semantics (rolling
conv window updated in place; decay, delta-rule update, read-out), the varlen prefill kernels as a per-sequence token
loop that leaves the last kernel inputs in the conv state (prefill is eager in both runs); no MoE, no rotary embedding,
no ``GatedDeltaMeta.seq_idx`` / ``conv_idx`` (prefill-only); ``update_context_cudagraph`` does nothing; float64.
Workload: max_batches 4 (capture sizes 1, 2, 4). Requests A (prompt 5, 6 new tokens, state 0, blocks 0-2) and B
(prompt 3, 3 new tokens, state 1, blocks 3-5) prefill together eagerly; decode steps 1-2 run A and B (step 1 captures
the batch-2 graph, step 2 replays it); B finishes; steps 3-5 run A alone (step 3 captures the batch-1 graph).
Measured: bug: misbehaves, max |graph - eager| = 1.62. Per step: prefill 0; step 1 (captures the batch-2 graph) 1.3,
and A's greedy token changes (11 instead of 5); step 2 1.62; steps 3-5 (A alone, step 3 captures the batch-1 graph)
0.456, 0.0306, 0.211. Fix: equals eager (max |graph - eager| = 0 at every step). With ``LAYER_TYPES`` set to the
full-attention layer alone, the bug variant equals eager (max 0): only the SSM state is hurt.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/commit/b1bb56db5f89166d9f416df8a425f44c69c1f739"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "__call__"
SYMPTOM = ("with the startup warmup skipped, a Qwen3-Next decode step that captures a graph advances the gated-delta "
           "conv and recurrent states twice (capture warmup, then an immediate replay of the same batch)")

VOCAB, HIDDEN = 16, 8
HEAD_K_DIM = HEAD_V_DIM = 4
CONV_KERNEL = 4                                   # config.linear_conv_kernel_dim
LAYER_TYPES = ("linear_attention", "full_attention")
MAX_BATCHES = 4                                   # cache_config.max_batches
BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_BLOCKS_PER_SEQ = 4, 8, 3
NUM_STATE_CACHES = 4
DTYPE = torch.float64
skip_warmup = True                                # LMD_SKIP_WARMUP=1 (lmdeploy/pytorch/envs.py)

_variant = "bug"


# --- lmdeploy/pytorch/model_inputs.py, backends/cuda/attention (reduced) ---------------------------------------------

@dataclasses.dataclass
class TritonAttentionMetadata:
    is_decoding: bool
    block_offsets: torch.Tensor
    q_start_loc: torch.Tensor
    q_seqlens: torch.Tensor
    kv_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None


@dataclasses.dataclass
class ModelInputs:
    input_ids: torch.Tensor                       # [1, num_tokens]
    seq_length: torch.Tensor                      # [batch]
    history_lengths: torch.Tensor                 # [batch]
    block_offsets: torch.Tensor                   # [batch, MAX_BLOCKS_PER_SEQ]
    state_offsets: torch.Tensor                   # [batch]
    is_decoding: bool


@dataclasses.dataclass
class StepContext:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attn_metadata: TritonAttentionMetadata
    state_offsets: torch.Tensor
    is_decoding: bool
    kv_caches: list
    state_caches: list

    @classmethod
    def new(cls, inputs: ModelInputs, kv_caches, state_caches):
        q_seqlens = inputs.seq_length.to(torch.int32)
        kv_seqlens = (inputs.seq_length + inputs.history_lengths).to(torch.int32)
        q_start_loc = (q_seqlens.cumsum(0) - q_seqlens).to(torch.int32)
        position_ids = torch.cat([torch.arange(int(h), int(h) + int(n)) for h, n in
                                  zip(inputs.history_lengths.tolist(), inputs.seq_length.tolist())])[None]
        attn_metadata = TritonAttentionMetadata(
            is_decoding=inputs.is_decoding, block_offsets=inputs.block_offsets.to(torch.int32),
            q_start_loc=q_start_loc, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
            cu_seqlens_q=F.pad(q_seqlens.cumsum(0), (1, 0)).to(torch.int32),
            cu_seqlens_k=F.pad(kv_seqlens.cumsum(0), (1, 0)).to(torch.int32))
        return cls(inputs.input_ids, position_ids.to(inputs.input_ids.device), attn_metadata, inputs.state_offsets,
                   inputs.is_decoding, kv_caches, state_caches)


class StepContextManager:
    def __init__(self):
        self._current = None

    def current_context(self):
        return self._current


@dataclasses.dataclass
class CudaGraphMeta:
    max_batchs: int
    max_tokens: int
    num_blocks: int
    is_decoding: int
    device: str
    input_buffers: dict = None
    output_buffers: dict = None
    vocab_size: int = 1


# --- lmdeploy/pytorch/models/utils/cudagraph.py (reduced) ---------------------------------------------------------------

class CudaGraphMixin:
    def support_cuda_graph(self, input_ids, position_ids, past_key_values, attn_metadata=None, inputs_embeds=None,
                           **kwargs):
        return attn_metadata.is_decoding

    def make_buffers_cudagraph(self, graph_meta: CudaGraphMeta, *args, **kwargs):
        max_batches, max_tokens, num_blocks, device = (graph_meta.max_batchs, graph_meta.max_tokens,
                                                       graph_meta.num_blocks, graph_meta.device)
        input_buffers = dict()
        input_buffers['input_ids'] = torch.randint(0, graph_meta.vocab_size, (1, max_tokens), dtype=torch.int64,
                                                   generator=generator(0)).to(device)
        input_buffers['position_ids'] = torch.zeros((1, max_tokens), dtype=torch.int64, device=device)
        input_buffers['block_offsets'] = torch.zeros((max_batches, num_blocks), dtype=torch.int32, device=device)
        input_buffers['qkv_lens'] = torch.zeros(3, max_batches, dtype=torch.int32, device=device)
        input_buffers['q_start_loc'] = input_buffers['qkv_lens'][0]
        input_buffers['q_seqlens'] = input_buffers['qkv_lens'][1]
        input_buffers['kv_seqlens'] = input_buffers['qkv_lens'][2]
        input_buffers['cu_seqlens'] = torch.zeros(2, max_batches + 1, dtype=torch.int32, device=device)
        input_buffers['cu_seqlens_q'] = input_buffers['cu_seqlens'][0]
        input_buffers['cu_seqlens_k'] = input_buffers['cu_seqlens'][1]
        return input_buffers

    def fill_buffers_cudagraph(self, graph_meta: CudaGraphMeta, input_ids, position_ids, past_key_values,
                               attn_metadata, inputs_embeds, **kwargs):
        block_offsets, q_start_loc = attn_metadata.block_offsets, attn_metadata.q_start_loc
        q_seqlens, kv_seqlens = attn_metadata.q_seqlens, attn_metadata.kv_seqlens
        input_buffers = graph_meta.input_buffers
        batch_size, num_blocks = block_offsets.size()
        num_tokens = input_ids.size(-1)
        input_buffers['input_ids'][:, :num_tokens] = input_ids
        input_buffers['position_ids'][:, :num_tokens] = position_ids
        input_buffers['block_offsets'][:batch_size, :num_blocks] = block_offsets
        qkv = torch.stack((q_start_loc, q_seqlens, kv_seqlens))
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
        new_inputs = dict(past_key_values=past_key_values, attn_metadata=attn_metadata)
        new_inputs['input_ids'] = input_buffers['input_ids']
        new_inputs['position_ids'] = input_buffers['position_ids']
        new_inputs.update(kwargs)
        return new_inputs

    def update_context_cudagraph(self, graph_meta: CudaGraphMeta, context: StepContext):
        pass


# --- lmdeploy/pytorch/models/qwen3_next.py (reduced) ----------------------------------------------------------------------

class GatedDeltaMeta:
    def __init__(self, num_tokens: int, conv_kernel_size: int, state_ids: torch.Tensor, attn_metadata):
        self.num_tokens = num_tokens
        self.is_decoding = attn_metadata.is_decoding
        self.cu_seqlens = attn_metadata.cu_seqlens_q
        self.q_seqlens = attn_metadata.q_seqlens
        # state_ids, fill invalid state with state_ids[0]
        self.valid_state = state_ids >= 0
        self.state_ids = torch.where(self.valid_state, state_ids, state_ids[0])
        self.state_ids = self.state_ids.clamp(0)


class CausalConv1dFunc:
    """causal_conv1d_update / causal_conv1d_fn with their semantics: a rolling window of the last kernel inputs."""

    def conv1d_update(self, x, weight, bias, conv_state):
        # x: (1, batch, dim); conv_state: (batch, dim, kernel), updated in place as the kernel does
        conv_state.copy_(torch.cat([conv_state[..., 1:], x[0][..., None]], dim=-1))
        out = F.silu((conv_state * weight).sum(-1) + bias)
        return out[None], conv_state

    def conv1d_func(self, x, weight, bias, conv_state, gated_delta_meta: GatedDeltaMeta):
        outs = []
        starts = gated_delta_meta.cu_seqlens[:-1].tolist()
        for b, (start, seqlen) in enumerate(zip(starts, gated_delta_meta.q_seqlens.tolist())):
            window = torch.zeros_like(conv_state[b])
            for t in range(start, start + seqlen):
                window = torch.cat([window[..., 1:], x[0, t][..., None]], dim=-1)
                outs.append(F.silu((window * weight).sum(-1) + bias))
            conv_state[b].copy_(window)
        return torch.stack(outs)[None], conv_state

    def __call__(self, x, weight, bias, conv_state, gated_delta_meta: GatedDeltaMeta):
        if gated_delta_meta.is_decoding:
            return self.conv1d_update(x, weight, bias, conv_state)
        return self.conv1d_func(x, weight, bias, conv_state, gated_delta_meta=gated_delta_meta)


class GatedDelta:
    """fused_recurrent_gated_delta_rule (decode) / chunk_gated_delta_rule (prefill) with use_qk_l2norm_in_kernel."""

    @staticmethod
    def _step(q, k, v, g, beta, state):
        q = F.normalize(q, dim=-1) * HEAD_K_DIM ** -0.5
        k = F.normalize(k, dim=-1)
        state = state * torch.exp(g)[:, None, None]
        delta = (v - torch.einsum("bkv,bk->bv", state, k)) * beta[:, None]
        state = state + torch.einsum("bk,bv->bkv", k, delta)
        return torch.einsum("bkv,bk->bv", state, q), state

    def __call__(self, query, key, value, g, beta, recurrent_state, gated_delta_meta: GatedDeltaMeta):
        if gated_delta_meta.is_decoding:
            out, last_state = self._step(query[0], key[0], value[0], g[0], beta[0], recurrent_state)
            return out[None], last_state
        outs, states = [], []
        starts = gated_delta_meta.cu_seqlens[:-1].tolist()
        for b, (start, seqlen) in enumerate(zip(starts, gated_delta_meta.q_seqlens.tolist())):
            state = recurrent_state[b:b + 1]
            for t in range(start, start + seqlen):
                o, state = self._step(query[0, t:t + 1], key[0, t:t + 1], value[0, t:t + 1], g[0, t:t + 1],
                                      beta[0, t:t + 1], state)
                outs.append(o[0])
            states.append(state[0])
        return torch.stack(outs)[None], torch.stack(states)


class Qwen3NextGatedDeltaNet:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.in_proj_qkvz = r(HIDDEN, 2 * HEAD_K_DIM + 2 * HEAD_V_DIM)
        self.in_proj_ba = r(HIDDEN, 2)
        self.conv1d_weight = r(2 * HEAD_K_DIM + HEAD_V_DIM, CONV_KERNEL, scale=0.7)
        self.conv1d_bias = r(2 * HEAD_K_DIM + HEAD_V_DIM, scale=0.1)
        self.A_log = r(1, scale=0.3)
        self.dt_bias = r(1, scale=0.3)
        self.norm_weight = 1.0 + r(HEAD_V_DIM, scale=0.1)
        self.out_proj = r(HEAD_V_DIM, HIDDEN)
        self.conv1d = CausalConv1dFunc()
        self.gated_delta = GatedDelta()

    def _load_state(self, past_key_value, gated_delta_meta: GatedDeltaMeta):
        state_ids = gated_delta_meta.state_ids
        conv_cache, recurrent_cache = past_key_value[:2]
        return conv_cache.index_select(0, state_ids), recurrent_cache.index_select(0, state_ids)

    def _store_state(self, conv_state, recurrent_state, past_key_value, gated_delta_meta: GatedDeltaMeta):
        conv_cache, recurrent_cache = past_key_value[:2]
        state_ids = gated_delta_meta.state_ids
        valid_state = gated_delta_meta.valid_state
        # fill invalid state with state[0]
        conv_state = torch.where(valid_state.view(-1, 1, 1), conv_state, conv_state[:1])
        recurrent_state = torch.where(valid_state.view(-1, 1, 1), recurrent_state, recurrent_state[:1])
        conv_cache.index_copy_(0, state_ids, conv_state)
        recurrent_cache.index_copy_(0, state_ids, recurrent_state.to(recurrent_cache.dtype))

    def forward(self, hidden_states, past_key_value, gated_delta_meta: GatedDeltaMeta):
        conv_state, recurrent_state = self._load_state(past_key_value, gated_delta_meta)
        query, key, value, z = torch.split(hidden_states @ self.in_proj_qkvz,
                                           [HEAD_K_DIM, HEAD_K_DIM, HEAD_V_DIM, HEAD_V_DIM], dim=-1)
        b, a = (hidden_states @ self.in_proj_ba).unbind(-1)
        mixed_qkv = torch.cat((query, key, value), dim=-1)
        mixed_qkv, conv_state = self.conv1d(mixed_qkv, self.conv1d_weight, self.conv1d_bias, conv_state,
                                            gated_delta_meta=gated_delta_meta)
        query, key, value = torch.split(mixed_qkv, [HEAD_K_DIM, HEAD_K_DIM, HEAD_V_DIM], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        core_attn_out, recurrent_state = self.gated_delta(query, key, value, g=g, beta=beta,
                                                          recurrent_state=recurrent_state,
                                                          gated_delta_meta=gated_delta_meta)
        self._store_state(conv_state, recurrent_state, past_key_value, gated_delta_meta)
        normed = core_attn_out * torch.rsqrt(core_attn_out.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return (normed * F.silu(z)) @ self.out_proj                # FusedRMSNormGated, out_proj


class Qwen3NextAttention:
    """Full attention over a paged KV cache (fill_kv_cache + paged attention)."""

    def __init__(self, gen, device):
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.5).to(DTYPE)   # noqa: E731
        self.wq, self.wk, self.wv, self.wo = r(HIDDEN, HEAD_K_DIM), r(HIDDEN, HEAD_K_DIM), r(HIDDEN, HEAD_K_DIM), \
            r(HEAD_K_DIM, HIDDEN)

    def forward(self, hidden_states, position_ids, past_key_value, attn_metadata):
        k_cache, v_cache = past_key_value
        h = hidden_states[0]
        num_tokens = h.size(0)
        if attn_metadata.is_decoding:
            tok_seq = torch.arange(num_tokens, device=h.device)
        else:
            tok_seq = torch.repeat_interleave(torch.arange(attn_metadata.q_seqlens.numel()),
                                              attn_metadata.q_seqlens.long().cpu()).to(h.device)
        tok_pos = position_ids[0]
        block_offsets = attn_metadata.block_offsets.long()[tok_seq]                  # [tokens, blocks per seq]
        slots = block_offsets.gather(1, (tok_pos // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + tok_pos % BLOCK_SIZE
        k_flat, v_flat = k_cache.view(-1, HEAD_K_DIM), v_cache.view(-1, HEAD_K_DIM)
        k_flat.index_copy_(0, slots, h @ self.wk)
        v_flat.index_copy_(0, slots, h @ self.wv)
        all_pos = torch.arange(MAX_BLOCKS_PER_SEQ * BLOCK_SIZE, device=h.device)
        all_slots = block_offsets[:, all_pos // BLOCK_SIZE] * BLOCK_SIZE + all_pos % BLOCK_SIZE
        scores = torch.einsum("td,tsd->ts", h @ self.wq, k_flat[all_slots]) / math.sqrt(HEAD_K_DIM)
        scores = scores.masked_fill(all_pos[None, :] > tok_pos[:, None], float("-inf"))
        out = torch.einsum("ts,tsd->td", scores.softmax(-1), v_flat[all_slots])
        return (out @ self.wo)[None]


class Qwen3NextForCausalLM(torch.nn.Module, CudaGraphMixin):
    def __init__(self, ctx_mgr: StepContextManager, device):
        super().__init__()
        gen = generator(4039)
        self.ctx_mgr = ctx_mgr
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [Qwen3NextGatedDeltaNet(gen, device) if t == "linear_attention" else
                       Qwen3NextAttention(gen, device) for t in LAYER_TYPES]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata=None, inputs_embeds=None,
                state_ids=None, **kwargs):
        hidden_states = self.embed_tokens[input_ids]
        gated_delta_meta = GatedDeltaMeta(hidden_states.size(1), CONV_KERNEL, state_ids, attn_metadata)
        for idx, layer in enumerate(self.layers):
            if LAYER_TYPES[idx] == "linear_attention":
                hidden_states = hidden_states + layer.forward(hidden_states, past_key_values[idx], gated_delta_meta)
            else:
                hidden_states = hidden_states + layer.forward(hidden_states, position_ids, past_key_values[idx],
                                                              attn_metadata)
        return hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)

    def get_logits(self, hidden_states):
        return hidden_states @ self.lm_head

    def prepare_inputs_for_generation(self, past_key_values, inputs_embeds=None, context: StepContext = None):
        state_caches = list(context.state_caches)
        past_key_values = list(past_key_values)
        new_past_key_values = []
        for layer_type in LAYER_TYPES:
            if layer_type == "linear_attention":
                new_past_key_values.append(state_caches.pop(0))
            elif layer_type == "full_attention":
                new_past_key_values.append(past_key_values.pop(0))
        return dict(input_ids=context.input_ids, position_ids=context.position_ids,
                    past_key_values=new_past_key_values, attn_metadata=context.attn_metadata,
                    inputs_embeds=inputs_embeds, state_ids=context.state_offsets)

    def make_buffers_cudagraph(self, graph_meta: CudaGraphMeta, **kwargs):
        input_buffers = super().make_buffers_cudagraph(graph_meta=graph_meta, **kwargs)
        input_buffers['state_ids'] = torch.full((graph_meta.max_batchs, ), -1, dtype=torch.long,
                                                device=graph_meta.device)
        return input_buffers

    def fill_buffers_cudagraph(self, graph_meta: CudaGraphMeta, **kwargs):
        input_buffers = graph_meta.input_buffers
        new_inputs = super().fill_buffers_cudagraph(graph_meta=graph_meta, **kwargs)
        state_ids = kwargs['state_ids']
        input_buffers['state_ids'].fill_(-1)
        input_buffers['state_ids'][:state_ids.size(0)].copy_(state_ids)
        new_inputs['state_ids'] = input_buffers['state_ids']
        return new_inputs


# --- lmdeploy/pytorch/backends/cuda/graph_runner.py (Nov 2025, Qwen3-Next branch) ---------------------------------------

@functools.lru_cache
def _get_capture_batch_size_impl(max_batches: int):
    ret, batch_size, batch_step = [], 1, 256
    while batch_size <= min(batch_step, max_batches):
        ret.append(batch_size)
        batch_size *= 2
    ret += list(range(batch_size, max_batches + 1, batch_step))
    if max_batches != ret[-1]:
        ret.append(max_batches)
    return ret


def _false(*args, **kwargs):
    return False


class CUDASingleGraphRunner:
    def __init__(self, model, max_batches, max_tokens, num_blocks, is_decoding, pool, device, state):
        self.model = model
        self.ctx_mgr = model.ctx_mgr
        self.meta = CudaGraphMeta(max_batchs=max_batches, max_tokens=max_tokens, num_blocks=num_blocks,
                                  is_decoding=is_decoding, device=device, input_buffers=dict(),
                                  output_buffers=dict(), vocab_size=VOCAB)
        self.device, self.pool, self.state = device, pool, state
        self._graph = None

    def make_output_buffers(self, output):
        return dict(logits=output)

    def slice_output(self, output_buffers, inputs):
        num_tokens = inputs['input_ids'].size(-1)
        return output_buffers['logits'][:, :num_tokens]

    def capture(self, **kwargs):
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta, **kwargs)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        context = self.ctx_mgr.current_context()
        self.model.update_context_cudagraph(self.meta, context)
        buffers = self.meta.input_buffers
        static = {k: buffers[k] for k in ('input_ids', 'position_ids', 'block_offsets', 'qkv_lens', 'cu_seqlens',
                                          'state_ids')}
        events.static_buffers("CUDASingleGraphRunner", static)
        events.persistent_state("CUDASingleGraphRunner", self.state)

        # warmup
        with events.warmup(real=True):
            warmup_output = self.model(**padded_kwargs)
        warmup_buffers = self.make_output_buffers(warmup_output)

        self._graph, output = capture(lambda: self.model(**padded_kwargs), device=self.device, pool=self.pool,
                                      warmups=0, name=f"decode graph bs={self.meta.max_batchs}",
                                      owner="CUDASingleGraphRunner", capture_error_mode="thread_local")
        if _variant == "fix":
            output_buffers = self.make_output_buffers(output)
            self.meta.output_buffers = output_buffers
            return self.slice_output(warmup_buffers, kwargs)
        output_buffers = dict(logits=output)
        self.meta.output_buffers = output_buffers
        return output

    def forward(self, **kwargs):
        num_tokens = kwargs['input_ids'].size(-1)
        assert self._graph is not None
        self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        context = self.ctx_mgr.current_context()
        self.model.update_context_cudagraph(self.meta, context)
        max_tokens = self.meta.max_tokens
        padded_columns = ({'input_ids': (self.meta.input_buffers['input_ids'], num_tokens)}
                          if num_tokens < max_tokens else None)
        logits = replay(self._graph, self.meta.output_buffers['logits'], padded_columns=padded_columns)
        return logits[:, :num_tokens]


class CUDAGraphRunner:
    def __init__(self, model, cache_config, eager_mode, device, state):
        self.model = model
        self.ctx_mgr = model.ctx_mgr
        self.eager_mode = eager_mode
        self.max_batches = cache_config['max_batches']
        self.num_blocks = MAX_BLOCKS_PER_SEQ
        self.enable_graph = self.check_enable_graph()
        self.graph_pool_handle = None                       # torch.cuda.graph_pool_handle()
        self._runner_map = dict()
        self.device, self.state = device, state

    def check_enable_graph(self):
        if self.eager_mode:
            return _false
        return getattr(self.model, 'support_cuda_graph', _false)

    def get_capture_batch_sizes(self):
        return _get_capture_batch_size_impl(self.max_batches)

    def _get_capture_tokens(self, batch_size: int):
        for size in self.get_capture_batch_sizes():
            if size >= batch_size:
                return size
        assert False, f'Unsupported batch_size={batch_size}'

    def get_graph_key(self, input_ids, position_ids, past_key_values, attn_metadata, inputs_embeds, **kwargs):
        context = self.ctx_mgr.current_context()
        batch_size = attn_metadata.q_seqlens.size(0)
        return (self._get_capture_tokens(batch_size), context.is_decoding, False)

    def _get_max_tokens(self, graph_key: tuple):
        assert graph_key[1]
        return graph_key[0]                               # cudagraph_strategy.get_max_tokens: one token per sequence

    def __call__(self, **kwargs):
        enable_graph = self.enable_graph(**kwargs)
        if not enable_graph:
            return self.model(**kwargs)

        graph_key = self.get_graph_key(**kwargs)
        max_batches, is_decoding = graph_key[0], graph_key[1]
        if graph_key not in self._runner_map:
            max_tokens = self._get_max_tokens(graph_key)
            runner = CUDASingleGraphRunner(self.model, max_batches=max_batches, max_tokens=max_tokens,
                                           num_blocks=self.num_blocks, is_decoding=is_decoding,
                                           pool=self.graph_pool_handle, device=self.device, state=self.state)
            if _variant == "fix":
                output = runner.capture(**kwargs)
                self._runner_map[graph_key] = runner
                # SSM would update the state in capture(warmup), replay the graph will leads unexpected state update.
                return output
            runner.capture(**kwargs)
            self._runner_map[graph_key] = runner
        else:
            runner = self._runner_map[graph_key]
        output = runner.forward(**kwargs)
        return output

    def prepare_inputs_for_generation(self, past_key_values, inputs_embeds=None, context=None):
        return self.model.prepare_inputs_for_generation(past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                                        context=context)


# --- lmdeploy/pytorch/engine/model_agent.py (reduced) ---------------------------------------------------------------------

class BaseModelAgent:
    def __init__(self, device, eager_mode):
        self.device = device
        self.ctx_mgr = StepContextManager()
        self.model = Qwen3NextForCausalLM(self.ctx_mgr, device)
        self.kv_caches = [tuple(torch.zeros(NUM_GPU_BLOCKS, BLOCK_SIZE, HEAD_K_DIM, dtype=DTYPE, device=device)
                                for _ in range(2)) for t in LAYER_TYPES if t == "full_attention"]
        self.state_caches = [(torch.zeros(NUM_STATE_CACHES, 2 * HEAD_K_DIM + HEAD_V_DIM, CONV_KERNEL, dtype=DTYPE,
                                          device=device),
                              torch.zeros(NUM_STATE_CACHES, HEAD_K_DIM, HEAD_V_DIM, dtype=DTYPE, device=device))
                             for t in LAYER_TYPES if t == "linear_attention"]
        state = {}
        for i, (conv, rec) in enumerate(self.state_caches):
            state[f"conv_state_{i}"], state[f"recurrent_state_{i}"] = conv, rec
        for i, (k, v) in enumerate(self.kv_caches):
            state[f"k_cache_{i}"], state[f"v_cache_{i}"] = k, v
        self.patched_model = CUDAGraphRunner(self.model, dict(max_batches=MAX_BATCHES), eager_mode, device, state)

    def warmup(self):
        if skip_warmup:
            return
        raise NotImplementedError("the startup warmup (dummy decode batches) is not modelled")

    def _forward_impl(self, inputs: ModelInputs):
        context = StepContext.new(inputs, self.kv_caches, self.state_caches)
        self.ctx_mgr._current = context
        input_dict = self.patched_model.prepare_inputs_for_generation(past_key_values=self.kv_caches,
                                                                      context=context)
        hidden_states = self.patched_model(**input_dict)
        last = (inputs.seq_length.cumsum(0) - 1).to(hidden_states.device)
        return self.model.get_logits(hidden_states[0, last])


@dataclasses.dataclass(eq=False)
class Request:
    tokens: list
    max_new_tokens: int
    state_id: int
    blocks: list
    num_generated: int = 0
    history: int = 0


def _serve(device, eager_mode):
    agent = BaseModelAgent(device, eager_mode)
    agent.warmup()
    gen = generator(126)
    reqs = [Request(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), m, sid, blocks)
            for n, m, sid, blocks in ((5, 6, 0, [0, 1, 2]), (3, 3, 1, [3, 4, 5]))]
    outs = []
    prefill = True
    while True:
        running = [r for r in reqs if r.num_generated < r.max_new_tokens]
        if not running:
            break
        if prefill:
            input_ids = [t for r in running for t in r.tokens]
            seq_length = [len(r.tokens) for r in running]
        else:
            input_ids = [r.tokens[-1] for r in running]
            seq_length = [1] * len(running)
        inputs = ModelInputs(
            input_ids=torch.tensor([input_ids], device=device),
            seq_length=torch.tensor(seq_length, device=device),
            history_lengths=torch.tensor([r.history for r in running], device=device),
            block_offsets=torch.tensor([r.blocks for r in running], device=device),
            state_offsets=torch.tensor([r.state_id for r in running], device=device),
            is_decoding=not prefill)
        logits = agent._forward_impl(inputs)
        outs.append(logits.clone())
        next_ids = logits.argmax(-1).tolist()
        for r, n, tok in zip(running, seq_length, next_ids):
            r.history += n
            r.tokens.append(tok)
            r.num_generated += 1
        prefill = False
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, eager_mode=False), lambda: _serve(device, eager_mode=True))
