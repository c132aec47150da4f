"""SGLang's piecewise CUDA graph runner (PCG) replays a prefill with a static ``ForwardBatch`` that it rebuilds field by field in ``replay_prepare``, and that rebuild left out ``mamba_track_indices`` / ``mamba_track_mask`` / ``mamba_track_seqlens``. Qwen3-Next's Gated DeltaNet layer runs eagerly between the captured pieces and reads its batch from the forward context, so under PCG it sees no track mask and skips the prefix-cache checkpoint writes (conv window and SSM state at the last chunk boundary) that the same prefill does without graphs. The radix cache (``--mamba-scheduler-strategy extra_buffer``) still records the request's ping-pong track slot as the state of its prefix; the next request that hits that prefix copies an unwritten slot into its working state and prefills from it.

Upstream: https://github.com/sgl-project/sglang/pull/16053 ("Fix Qwen Next GDN w/ Radix Cache", sgl-project/sglang, by
hebiao064, opened 2025-12-29, merged as commit 94164646829e28d5f6798d407ed6a14976b3b977 on 2025-12-29; read in a stored
mirror of the history, the fork zcnrex/sglang). Read: the full diff of that commit (one file,
``python/sglang/srt/model_executor/piecewise_cuda_graph_runner.py``: ``is_mamba_track_enabled``, three ``[max_bs]``
buffers in ``__init__``, the fields passed to the warmup and capture batches, and in ``replay_prepare`` the copy of the
live batch's three fields into those buffers and their ``[:bs]`` views in the static batch); at its parent the whole of
that file (``warmup_torch_compile``, ``capture_one_batch_size``, ``replay_prepare``, ``replay``),
``layers/attention/hybrid_linear_attn_backend.py`` (``MambaAttnBackendBase._forward_metadata``,
``_init_track_conv_indices``, ``_init_track_ssm_indices``, ``_track_mamba_state_extend``,
``GDNAttnBackend.forward_extend``, ``HybridLinearAttnBackend.forward``), ``models/qwen3_next.py``
(``Qwen3GatedDeltaNet.forward`` / ``_forward``, ``gdn_with_output``), ``managers/schedule_batch.py``
(``prepare_for_extend``, ``_mamba_radix_cache_v2_req_prepare_for_extend``), ``mem_cache/mamba_radix_cache.py``
(``match_prefix``, ``cache_finished_req``), ``mem_cache/memory_pool.py`` (``MambaPool.alloc`` zero-fills,
``HybridReqToTokenPool.alloc`` / ``free`` / ping-pong buffers), ``model_runner.py`` (``forward_extend``); the PR
description; of #13081 (PCG for Qwen3-Next, commit d64bf6c6c) its description, file list and the ``chunk_o.py`` line
that made the kernel output ``zeros_like``.
Not read: ``compilation/cuda_piecewise_backend.py`` and the torch.compile split machinery (modelled as a list of
pieces), the FLA Triton kernels and ``causal_conv1d_triton`` (torch loops here), the decode-side tracking
(``_track_mamba_state_decode`` under the decode graph runner), ``_match_prefix_helper`` and branching-point caching; the
PR adds no test.
Symptom: PR description, Qwen3-Next-80B with ``--enable-piecewise-cuda-graph --mamba-scheduler-strategy extra_buffer``:
"Second run of GSM8k will get only 0.485" (first run 0.950; after the fix 0.945 and 0.945). The second run hits the
prefixes the first run cached.
Mechanism: ``ScheduleBatch.prepare_for_extend`` gives every request whose extend crosses an FLA chunk boundary a track
mask, the ping-pong slot to write (``mamba_track_indices``) and the tracked length, and records
``req.mamba_last_track_seqlen``. ``ModelRunner.forward_extend`` hands PCG-sized batches to
``PiecewiseCudaGraphRunner.replay``, which builds the attention metadata (track indices included) from the live batch,
then runs the model with ``replay_prepare``'s static batch in the forward context. The pieces between layers replay
graphs; ``gdn_with_output`` runs ``Qwen3GatedDeltaNet._forward`` eagerly with ``context.forward_batch``, and
``GDNAttnBackend.forward_extend`` writes the conv window (``conv_states[mamba_track_indices[mask]]``) and
``_track_mamba_state_extend`` the SSM state only if ``forward_batch.mamba_track_mask is not None``: on the static batch
it is ``None``. ``MambaRadixCache.cache_finished_req`` then inserts the prefix up to ``mamba_last_track_seqlen`` with
the track slot as its state, and ``match_prefix`` copies that slot (zeros from ``MambaPool.alloc``, or whatever an
earlier owner left) into the next request's working slot. Without graphs the layer sees the live batch and writes the
checkpoints.
Doctor: warmup-divergence, at replay_prepare. The served prefill does other work than the eager step would: the same
layer code, given the runner's rebuilt batch, takes the no-tracking branch and skips two writes into the persistent
mamba pool that the eager step makes; ``replay_prepare`` is where the step's batch for the replay is decided, and where
the fix carries the three fields over (through runner-owned buffers).
Fix (upstream): ``PiecewiseCudaGraphRunner`` keeps ``mamba_track_indices`` / ``mamba_track_mask`` /
``mamba_track_seqlens`` buffers of ``req_to_token_pool.size`` rows when the extra buffer is on with the radix cache and
no speculative decoding; ``replay_prepare`` copies the live batch's fields into rows ``[:bs]`` and puts those views in
the static batch (the warmup and capture batches get ``[:1]`` / ``[:bs]`` views too).
Modelled: ``ServerArgs`` (the three flags), ``ForwardMode``, ``ForwardBatch`` (``init_new``), ``set_forward_context`` /
``get_forward_context``, ``MambaPool`` (``alloc``, ``free``, ``copy_from``), ``HybridReqToTokenPool`` (``alloc``,
``free``, ``get_mamba_indices``, ``get_mamba_ping_pong_other_idx``, ``mamba2_layer_cache``), ``Req``,
``ScheduleBatch.prepare_for_extend`` / ``_mamba_radix_cache_v2_req_prepare_for_extend``, ``MambaRadixCache``
(``match_prefix`` with COW, ``cache_finished_req``), ``MambaAttnBackendBase`` (``_forward_metadata``,
``init_forward_metadata``, ``_init_track_conv_indices``, ``_init_track_ssm_indices``, ``_track_mamba_state_extend``),
``GDNAttnBackend.forward_extend``, ``HybridLinearAttnBackend.forward``, ``Qwen3GatedDeltaNet`` (``forward``,
``_forward``), ``gdn_with_output``, ``Qwen3HybridLinearDecoderLayer``, ``Qwen3NextModel``, ``Qwen3NextForCausalLM``,
``PiecewiseCudaGraphRunner`` (``__init__``, ``is_mamba_track_enabled``, ``capture``, ``capture_one_batch_size``,
``can_run``, ``replay_prepare``, ``replay``), ``ModelRunner.forward_extend``.
Stand-ins: ``causal_conv1d_fn``, ``fused_gdn_gating`` and ``chunk_gated_delta_rule`` are torch loops (gated delta rule
per token; ``h`` is the state at the start of each chunk; the final state is written in place at
``initial_state_indices``; rows outside ``cu_seqlens`` stay zero, as #13081's ``zeros_like``); FLA chunk 8 (64
upstream); two GDN layers, no full-attention layers (so no KV cache, ``out_cache_loc`` or rotary), one MLP per layer,
width 16, float64. The piecewise compile is a ``CUDAPiecewiseBackend`` holding, per token count, one graph per piece
between the split ops; the capture captures the pieces only (upstream's warmup and capture runs also run the split op
eagerly on a dummy batch, which is not modelled). ``MambaRadixCache`` is a dict of token prefixes (page size 1, no
eviction, no empty-prefix insert); mamba slot 0 is never handed out; index tensors are int64; requests leave after their
prefill (one sampled token), so no decode step runs. ``linear`` is a per-row product and sum rather than BLAS, so that a
row's result does not depend on how many rows (padded or not) the call has.
Workload: capture sizes [16, 32, 48]. Round 1: requests A (21 tokens) and D (13 tokens), cold; both checkpoint their
last chunk boundary (16 and 8, from ``h``); 34 tokens on the 48 graphs. Round 2: B = A[:16] + 5 (hits 16, extends 5, no
checkpoint) and E = D[:8] + 8 (hits 8, extends an aligned 8: checkpoint from the final state); 13 tokens on the 16
graphs. Round 3: F = E[:16] + 3 (hits E's checkpoint). Output: each round's next-token logits.
Measured: bug: misbehaves (max |graph - eager| = 1.14; per round 0, 0.469 and 1.14: round 1 equals eager, B, E and F
prefill from unwritten checkpoints, here the zeros ``MambaPool.alloc`` left). Fix: equals eager (max |graph - eager| =
0); the hits are 16, 8 and 16 tokens in both runs.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/16053"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "replay_prepare"
SYMPTOM = ("Qwen3-Next with piecewise CUDA graphs and the mamba extra-buffer radix cache: the PCG static batch lacks "
           "the mamba track fields, prefills skip their prefix-cache checkpoints, and prefix hits restore unwritten "
           "state (GSM8K 0.95 on the first run, 0.485 on the second)")

FLA_CHUNK_SIZE = 8
VOCAB, HIDDEN, INTER, NUM_LAYERS = 32, 16, 32, 2
NUM_K_HEADS = NUM_V_HEADS = 2
HEAD_K_DIM = HEAD_V_DIM = 4
KEY_DIM, VALUE_DIM = NUM_K_HEADS * HEAD_K_DIM, NUM_V_HEADS * HEAD_V_DIM
CONV_DIM, CONV_KERNEL = 2 * KEY_DIM + VALUE_DIM, 4
PIECEWISE_CUDA_GRAPH_TOKENS = [16, 32, 48]
MAX_RUNNING_REQUESTS, MAX_MAMBA_CACHE_SIZE = 8, 24
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class ServerArgs:
    mamba_scheduler_strategy: str = "extra_buffer"
    disable_radix_cache: bool = False
    speculative_algorithm: object = None

    def enable_mamba_extra_buffer(self):
        return self.mamba_scheduler_strategy == "extra_buffer"


SERVER_ARGS = ServerArgs()


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2

    def is_extend(self):
        return self == ForwardMode.EXTEND


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    extend_seq_lens_cpu: list
    req_to_token_pool: "HybridReqToTokenPool"
    attn_backend: "HybridLinearAttnBackend"
    mamba_track_indices: torch.Tensor | None = None
    mamba_track_mask: torch.Tensor | None = None
    mamba_track_seqlens: torch.Tensor | None = None

    @classmethod
    def init_new(cls, batch: "ScheduleBatch", model_runner: "ModelRunner"):
        return cls(ForwardMode.EXTEND, len(batch.reqs), batch.input_ids, batch.positions, batch.req_pool_indices,
                   batch.seq_lens, batch.extend_seq_lens, batch.extend_prefix_lens, batch.extend_start_loc,
                   batch.extend_seq_lens_cpu, model_runner.req_to_token_pool, model_runner.attn_backend,
                   batch.mamba_track_indices, batch.mamba_track_mask, batch.mamba_track_seqlens)


# --- compilation/piecewise_context_manager.py ----------------------------------------------------------------------
_forward_context = None
_compiled = False


@dataclasses.dataclass
class ForwardContext:
    forward_batch: ForwardBatch
    attention_layers: list


@contextlib.contextmanager
def set_forward_context(forward_batch, attention_layers):
    global _forward_context
    _forward_context = ForwardContext(forward_batch, attention_layers)
    try:
        yield
    finally:
        _forward_context = None


def get_forward_context():
    return _forward_context


@contextlib.contextmanager
def set_compiled(enabled: bool):
    global _compiled
    old, _compiled = _compiled, enabled
    try:
        yield
    finally:
        _compiled = old


# --- mem_cache/memory_pool.py ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class MambaLayerCache:
    conv: list
    temporal: torch.Tensor


class MambaPool:
    def __init__(self, size, device):
        self.size = size
        self.conv = [torch.zeros(NUM_LAYERS, size + 1, CONV_DIM, CONV_KERNEL - 1, dtype=DTYPE, device=device)]
        self.temporal = torch.zeros(NUM_LAYERS, size + 1, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, dtype=DTYPE,
                                    device=device)
        self.free_slots = list(range(1, size + 1))      # slot 0 never handed out (stand-in)
        self.device = device

    def alloc(self, need_size):
        select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        select_index = torch.tensor(select, dtype=torch.int64, device=self.device)
        for conv in self.conv:                            # fill allocated slots with zeros
            conv[:, select_index] = 0
        self.temporal[:, select_index] = 0
        return select_index

    def free(self, free_index):
        self.free_slots.extend(free_index.reshape(-1).tolist())

    def copy_from(self, src_index, dst_index):
        for conv in self.conv:
            conv[:, dst_index] = conv[:, src_index]
        self.temporal[:, dst_index] = self.temporal[:, src_index]


class HybridReqToTokenPool:
    def __init__(self, size, mamba_size, device):
        self.size, self.device = size, device
        self.free_slots = list(range(size))
        self.mamba_pool = MambaPool(mamba_size, device)
        self.mamba_ping_pong_track_buffer_size = 2
        self.req_index_to_mamba_index_mapping = torch.zeros(size, dtype=torch.int64, device=device)

    def alloc(self, need_size, reqs):
        select_index, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        mamba_index = []
        for req in reqs:
            if req.mamba_pool_idx is None:
                req.mamba_pool_idx = self.mamba_pool.alloc(1)[0]
            mamba_index.append(int(req.mamba_pool_idx))
            if req.mamba_ping_pong_track_buffer is None:
                req.mamba_ping_pong_track_buffer = self.mamba_pool.alloc(self.mamba_ping_pong_track_buffer_size)
                req.mamba_next_track_idx = 0
        self.req_index_to_mamba_index_mapping[select_index] = torch.tensor(mamba_index, dtype=torch.int64,
                                                                           device=self.device)
        return select_index

    def get_mamba_indices(self, req_indices):
        return self.req_index_to_mamba_index_mapping[req_indices]

    def get_mamba_ping_pong_other_idx(self, mamba_next_track_idx):
        return 1 - mamba_next_track_idx

    def mamba2_layer_cache(self, layer_id):
        return MambaLayerCache([c[layer_id] for c in self.mamba_pool.conv], self.mamba_pool.temporal[layer_id])

    def free(self, req, free_mamba_cache=True, mamba_ping_pong_track_buffer_to_keep=None):
        self.free_slots.append(req.req_pool_idx)
        if free_mamba_cache:
            self.mamba_pool.free(req.mamba_pool_idx.reshape(1))
            to_free = [i for i in range(self.mamba_ping_pong_track_buffer_size)
                       if i != mamba_ping_pong_track_buffer_to_keep]
            self.mamba_pool.free(req.mamba_ping_pong_track_buffer[to_free])


# --- managers/schedule_batch.py, mem_cache/mamba_radix_cache.py (reduced) --------------------------------------------
@dataclasses.dataclass
class Req:
    rid: str
    origin_input_ids: list
    output_ids: list = dataclasses.field(default_factory=list)
    prefix_len: int = 0
    extend_input_len: int = 0
    req_pool_idx: int | None = None
    mamba_pool_idx: torch.Tensor | None = None
    mamba_ping_pong_track_buffer: torch.Tensor | None = None
    mamba_next_track_idx: int = 0
    mamba_last_track_seqlen: int | None = None


class MambaRadixCache:
    def __init__(self, req_to_token_pool):
        self.req_to_token_pool = req_to_token_pool
        self.entries = {}                                  # token prefix -> mamba_value (one slot)

    def match_prefix(self, key, cow_mamba, req):
        hits = [k for k in self.entries if tuple(key[:len(k)]) == k]
        if not hits:
            return 0
        last = max(hits, key=len)
        if cow_mamba:
            src_index = self.entries[last]
            if req.mamba_pool_idx is None:
                dst_index = self.req_to_token_pool.mamba_pool.alloc(1)
                self.req_to_token_pool.mamba_pool.copy_from(src_index, dst_index)
                req.mamba_pool_idx = dst_index[0]
            else:
                self.req_to_token_pool.mamba_pool.copy_from(src_index, req.mamba_pool_idx.unsqueeze(0))
        return len(last)

    def cache_finished_req(self, req):
        cache_len = req.mamba_last_track_seqlen or 0
        token_ids = tuple((req.origin_input_ids + req.output_ids)[:cache_len])
        keep = self.req_to_token_pool.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)
        mamba_exist = cache_len == 0 or token_ids in self.entries
        if not mamba_exist:
            self.entries[token_ids] = req.mamba_ping_pong_track_buffer[keep].unsqueeze(-1).clone()
        self.req_to_token_pool.free(req, True, None if mamba_exist else keep)


class ScheduleBatch:
    def __init__(self, reqs, req_to_token_pool, device):
        self.reqs, self.req_to_token_pool, self.device = reqs, req_to_token_pool, device

    def prepare_for_extend(self):
        reqs, dev = self.reqs, self.device
        for req in reqs:
            req.extend_input_len = len(req.origin_input_ids) - req.prefix_len
        req_pool_indices = self.req_to_token_pool.alloc(len(reqs), reqs)
        mask_cpu, indices_cpu, seqlens_cpu = [], [], []
        for i, req in enumerate(reqs):
            req.req_pool_idx = req_pool_indices[i]
            if SERVER_ARGS.enable_mamba_extra_buffer():
                self._mamba_radix_cache_v2_req_prepare_for_extend(req, mask_cpu, indices_cpu, seqlens_cpu)
        ext = [r.extend_input_len for r in reqs]
        self.input_ids = torch.tensor(sum((r.origin_input_ids[r.prefix_len:] for r in reqs), []), device=dev)
        self.positions = torch.cat([torch.arange(r.prefix_len, len(r.origin_input_ids)) for r in reqs]).to(dev)
        self.req_pool_indices = torch.tensor(req_pool_indices, dtype=torch.int64, device=dev)
        self.seq_lens = torch.tensor([len(r.origin_input_ids) for r in reqs], device=dev)
        self.extend_seq_lens = torch.tensor(ext, device=dev)
        self.extend_prefix_lens = torch.tensor([r.prefix_len for r in reqs], device=dev)
        self.extend_start_loc = torch.tensor([sum(ext[:i]) for i in range(len(reqs))], device=dev)
        self.extend_seq_lens_cpu = ext
        self.mamba_track_indices = torch.tensor(indices_cpu, dtype=torch.int64, device=dev)
        self.mamba_track_mask = torch.tensor(mask_cpu, dtype=torch.bool, device=dev)
        self.mamba_track_seqlens = torch.tensor(seqlens_cpu, dtype=torch.int64, device=dev)

    def _mamba_radix_cache_v2_req_prepare_for_extend(self, req, mask_cpu, indices_cpu, seqlens_cpu):
        mask = (req.extend_input_len // FLA_CHUNK_SIZE) * FLA_CHUNK_SIZE > 0
        mask_cpu.append(mask)
        indices_cpu.append(req.mamba_ping_pong_track_buffer[req.mamba_next_track_idx].item())
        mamba_track_seqlen = -1
        if mask:
            mamba_track_seqlen = req.prefix_len + req.extend_input_len
            req.mamba_next_track_idx = self.req_to_token_pool.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)
            req.mamba_last_track_seqlen = req.prefix_len + (req.extend_input_len // FLA_CHUNK_SIZE) * FLA_CHUNK_SIZE
        seqlens_cpu.append(mamba_track_seqlen)


# --- FLA / causal-conv kernels (torch stand-ins) ---------------------------------------------------------------------
def causal_conv1d_fn(x, weight, bias, activation, conv_states, has_initial_state, cache_indices, query_start_loc,
                     seq_lens_cpu):
    """x [dim, tokens]; one program per sequence; updates conv_states[cache_indices[i]] with its last K-1 inputs."""
    out = torch.zeros_like(x)
    starts = query_start_loc.tolist()
    for i, length in enumerate(seq_lens_cpu):
        s, idx = starts[i], cache_indices[i]
        prev = torch.where(has_initial_state[i], conv_states[idx], torch.zeros_like(conv_states[idx]))
        full = torch.cat([prev, x[:, s:s + length]], dim=1)
        win = full.unfold(1, CONV_KERNEL, 1)                            # [dim, length, K]
        y = (win * weight[:, None, :]).sum(-1) + bias[:, None]
        out[:, s:s + length] = F.silu(y) if activation == "silu" else y
        conv_states[idx] = full[:, -(CONV_KERNEL - 1):]
    return out


def fused_gdn_gating(A_log, a, b, dt_bias):
    return -torch.exp(A_log) * F.softplus(a + dt_bias), torch.sigmoid(b)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, initial_state_indices, cu_seqlens):
    """Gated delta rule over each sequence of ``cu_seqlens``; returns (o, final states, h at every chunk start)."""
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)           # use_qk_l2norm_in_kernel
    o, hs, finals = torch.zeros_like(v), [], []
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        state = initial_state[initial_state_indices[n]].clone()     # [H, K, V]
        for t in range(bounds[n], bounds[n + 1]):
            if (t - bounds[n]) % FLA_CHUNK_SIZE == 0:
                hs.append(state.clone())
            state = state * torch.exp(g[0, t])[:, None, None]
            u = v[0, t] - torch.einsum("hkv,hk->hv", state, k[0, t])
            state = state + beta[0, t][:, None, None] * k[0, t][:, :, None] * u[:, None, :]
            o[0, t] = torch.einsum("hkv,hk->hv", state, q[0, t]) * HEAD_K_DIM ** -0.5
        initial_state[initial_state_indices[n]] = state              # in-place final state (CUDA path)
        finals.append(state)
    return o, torch.stack(finals), torch.stack(hs).unsqueeze(0)


# --- layers/attention/hybrid_linear_attn_backend.py -------------------------------------------------------------------
@dataclasses.dataclass
class ForwardMetadata:
    query_start_loc: torch.Tensor
    mamba_cache_indices: torch.Tensor
    track_conv_indices: torch.Tensor | None = None
    track_ssm_h_src: torch.Tensor | None = None
    track_ssm_h_dst: torch.Tensor | None = None
    track_ssm_final_src: torch.Tensor | None = None
    track_ssm_final_dst: torch.Tensor | None = None


class MambaAttnBackendBase:
    def __init__(self, model_runner):
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.forward_metadata = None
        self.conv_states_shape = (CONV_DIM, CONV_KERNEL - 1)

    def _forward_metadata(self, forward_batch: ForwardBatch):
        bs = forward_batch.batch_size
        mamba_cache_indices = self.req_to_token_pool.get_mamba_indices(forward_batch.req_pool_indices)
        query_start_loc = torch.empty((bs + 1,), dtype=torch.int64, device=self.device)
        query_start_loc[:bs] = forward_batch.extend_start_loc
        query_start_loc[bs] = forward_batch.extend_start_loc[-1] + forward_batch.extend_seq_lens[-1]
        md = ForwardMetadata(query_start_loc, mamba_cache_indices)
        if forward_batch.mamba_track_mask is not None and forward_batch.mamba_track_mask.any():
            md.track_conv_indices = self._init_track_conv_indices(query_start_loc, forward_batch)
            (md.track_ssm_h_src, md.track_ssm_h_dst, md.track_ssm_final_src,
             md.track_ssm_final_dst) = self._init_track_ssm_indices(mamba_cache_indices, forward_batch)
        return md

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self.forward_metadata = self._forward_metadata(forward_batch)

    def _init_track_conv_indices(self, query_start_loc, forward_batch):
        conv_state_len = self.conv_states_shape[-1]
        lens_to_track = forward_batch.mamba_track_seqlens - forward_batch.extend_prefix_lens
        aligned_len = (lens_to_track // FLA_CHUNK_SIZE) * FLA_CHUNK_SIZE
        start_indices = (query_start_loc[:-1] + aligned_len - conv_state_len)[forward_batch.mamba_track_mask]
        indices = start_indices.unsqueeze(-1) + torch.arange(conv_state_len, device=self.device)
        return indices.clamp(0, int(query_start_loc[-1]) - 1)

    def _init_track_ssm_indices(self, mamba_cache_indices, forward_batch):
        mask = forward_batch.mamba_track_mask.cpu()
        extend_seq_lens = forward_batch.extend_seq_lens.cpu()
        track_indices = forward_batch.mamba_track_indices.cpu()
        num_h_states = (extend_seq_lens - 1) // FLA_CHUNK_SIZE + 1
        src_offset = torch.zeros_like(num_h_states)
        src_offset[1:] = torch.cumsum(num_h_states[:-1], dim=0)
        lens_masked = (forward_batch.mamba_track_seqlens.cpu() - forward_batch.extend_prefix_lens.cpu())[mask]
        dst_masked = track_indices[mask]
        is_aligned = (lens_masked % FLA_CHUNK_SIZE) == 0
        final_src = mamba_cache_indices.cpu()[mask][is_aligned]
        h_src = src_offset[mask][~is_aligned] + lens_masked[~is_aligned] // FLA_CHUNK_SIZE
        return tuple(t.to(self.device) for t in (h_src, dst_masked[~is_aligned], final_src, dst_masked[is_aligned]))

    def _track_mamba_state_extend(self, forward_batch, h, ssm_states, forward_metadata):
        if forward_batch.mamba_track_mask is not None and forward_batch.mamba_track_mask.any():
            h = h.squeeze(0)
            if forward_metadata.track_ssm_h_src.numel() > 0:
                ssm_states[forward_metadata.track_ssm_h_dst] = h[forward_metadata.track_ssm_h_src]
            if forward_metadata.track_ssm_final_src.numel() > 0:
                ssm_states[forward_metadata.track_ssm_final_dst] = ssm_states[forward_metadata.track_ssm_final_src]


class GDNAttnBackend(MambaAttnBackendBase):
    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs):
        mixed_qkv, layer_id, seq_len = kwargs["mixed_qkv"], kwargs["layer_id"], kwargs["seq_len"]
        forward_metadata = self.forward_metadata
        query_start_loc, cache_indices = forward_metadata.query_start_loc, forward_metadata.mamba_cache_indices
        mamba_cache_params = self.req_to_token_pool.mamba2_layer_cache(layer_id)
        conv_states, ssm_states = mamba_cache_params.conv[0], mamba_cache_params.temporal
        has_initial_states = forward_batch.extend_prefix_lens > 0

        mixed_qkv = mixed_qkv.transpose(0, 1)
        if forward_batch.mamba_track_mask is not None and forward_batch.mamba_track_mask.any():
            conv_dst = forward_batch.mamba_track_indices
            mixed_qkv_to_track = mixed_qkv[:, forward_metadata.track_conv_indices].transpose(0, 1)
            mask_indices = forward_batch.mamba_track_mask.nonzero(as_tuple=True)[0]
            conv_states[conv_dst[mask_indices]] = mixed_qkv_to_track
        mixed_qkv = causal_conv1d_fn(mixed_qkv, kwargs["conv_weights"], kwargs["bias"], kwargs["activation"],
                                     conv_states, has_initial_states, cache_indices, query_start_loc,
                                     forward_batch.extend_seq_lens_cpu).transpose(0, 1)[:seq_len]
        query, key, value = torch.split(mixed_qkv, [KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
        query = query.view(1, seq_len, NUM_K_HEADS, HEAD_K_DIM)
        key = key.view(1, seq_len, NUM_K_HEADS, HEAD_K_DIM)
        value = value.view(1, seq_len, NUM_V_HEADS, HEAD_V_DIM)
        g, beta = fused_gdn_gating(kwargs["A_log"], kwargs["a"], kwargs["b"], kwargs["dt_bias"])
        core_attn_out, _, h = chunk_gated_delta_rule(query, key, value, g.unsqueeze(0), beta.unsqueeze(0),
                                                     ssm_states, cache_indices, query_start_loc)
        self._track_mamba_state_extend(forward_batch, h, ssm_states, forward_metadata)
        return core_attn_out


class HybridLinearAttnBackend:
    """Full and linear backends; the model here has linear-attention layers only."""

    def __init__(self, linear_attn_backend, full_attn_layers):
        self.linear_attn_backend, self.full_attn_layers = linear_attn_backend, full_attn_layers
        self.attn_backend_list = [linear_attn_backend]

    def init_forward_metadata(self, forward_batch):
        for attn_backend in self.attn_backend_list:
            attn_backend.init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        assert forward_batch.forward_mode.is_extend()
        return self.linear_attn_backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


def linear(x, weight):
    """``F.linear`` as a per-row reduction: a row's result does not depend on how many rows the call has (BLAS
    blocking would, by an ulp, between the padded graph and the unpadded eager step)."""
    return (x.unsqueeze(-2) * weight).sum(-1)


# --- models/qwen3_next.py (reduced) -----------------------------------------------------------------------------------
def _w(gen, device, *shape, scale=0.3):
    return torch.nn.Parameter(randn(*shape, gen=gen, device=device, scale=scale).to(DTYPE), requires_grad=False)


class RMSNorm(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE),
                                         requires_grad=False)

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return out if residual is None else (out, residual)


class Qwen3GatedDeltaNet(torch.nn.Module):
    def __init__(self, layer_id, gen, device):
        super().__init__()
        self.layer_id, self.activation = layer_id, "silu"
        self.in_proj_qkvz = _w(gen, device, 2 * KEY_DIM + 2 * VALUE_DIM, HIDDEN)
        self.in_proj_ba = _w(gen, device, 2 * NUM_V_HEADS, HIDDEN)
        self.conv1d_weight = _w(gen, device, CONV_DIM, 1, CONV_KERNEL, scale=0.5)
        self.conv1d_bias = _w(gen, device, CONV_DIM, scale=0.1)
        self.A_log = _w(gen, device, NUM_V_HEADS, scale=0.5)
        self.dt_bias = _w(gen, device, NUM_V_HEADS, scale=0.5)
        self.norm_weight = _w(gen, device, HEAD_V_DIM, scale=0.1)
        self.out_proj = _w(gen, device, HIDDEN, VALUE_DIM)

    def fix_query_key_value_ordering(self, mixed_qkvz, mixed_ba):
        query, key, value, z = torch.split(mixed_qkvz, [KEY_DIM, KEY_DIM, VALUE_DIM, VALUE_DIM], dim=-1)
        b, a = torch.split(mixed_ba, [NUM_V_HEADS, NUM_V_HEADS], dim=-1)
        return query, key, value, z, b, a

    def forward(self, hidden_states, forward_batch: ForwardBatch):
        output = torch.empty_like(hidden_states)
        if forward_batch.forward_mode.is_extend() and get_forward_context() is not None:
            gdn_with_output(hidden_states, output, self.layer_id)       # torch.ops.sglang.gdn_with_output
            return output
        return self._forward(hidden_states, forward_batch)

    def _forward(self, hidden_states, forward_batch: ForwardBatch):
        seq_len = hidden_states.shape[0]
        query, key, value, z, b, a = self.fix_query_key_value_ordering(linear(hidden_states, self.in_proj_qkvz),
                                                                       linear(hidden_states, self.in_proj_ba))
        mixed_qkv = torch.cat((query, key, value), dim=-1)
        conv_weights = self.conv1d_weight.view(CONV_DIM, CONV_KERNEL)
        core_attn_out = forward_batch.attn_backend.forward(
            q=None, k=None, v=None, layer=None, forward_batch=forward_batch, mixed_qkv=mixed_qkv,
            conv_weights=conv_weights, bias=self.conv1d_bias, activation=self.activation, a=a, b=b,
            A_log=self.A_log, dt_bias=self.dt_bias, layer_id=self.layer_id, seq_len=seq_len)
        core_attn_out = core_attn_out.reshape(seq_len, NUM_V_HEADS, HEAD_V_DIM)
        z = z.reshape(seq_len, NUM_V_HEADS, HEAD_V_DIM)
        normed = core_attn_out * torch.rsqrt(core_attn_out.pow(2).mean(-1, keepdim=True) + 1e-6)
        core_attn_out = (normed * (1 + self.norm_weight) * F.silu(z)).reshape(seq_len, VALUE_DIM)  # RMSNormGated
        return linear(core_attn_out, self.out_proj)


def gdn_with_output(hidden_states, output, layer_id) -> None:
    """The PCG split op: the whole GDN layer runs eagerly, on the forward context's batch."""
    context = get_forward_context()
    forward_batch = context.forward_batch
    attention_layer = context.attention_layers[layer_id]
    ret = attention_layer._forward(hidden_states, forward_batch)
    output.view(ret.shape).copy_(ret)


class Qwen3HybridLinearDecoderLayer(torch.nn.Module):
    def __init__(self, layer_id, gen, device):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(gen, device), RMSNorm(gen, device)
        self.linear_attn = Qwen3GatedDeltaNet(layer_id, gen, device)
        self.gate_up_proj, self.down_proj = _w(gen, device, 2 * INTER, HIDDEN), _w(gen, device, HIDDEN, INTER)

    def mlp(self, x):
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)


class Qwen3NextModel(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.embed_tokens = _w(gen, device, VOCAB, HIDDEN, scale=1.0)
        self.layers = torch.nn.ModuleList(Qwen3HybridLinearDecoderLayer(i, gen, device) for i in range(NUM_LAYERS))
        self.norm = RMSNorm(gen, device)
        self.piecewise_backend = None

    # The code between the split ops: the pieces the piecewise backend captures.
    def piece(self, i, hidden_states, residual):
        if i == 0:
            hidden_states = F.embedding(hidden_states, self.embed_tokens)
            return self.layers[0].input_layernorm(hidden_states), hidden_states
        layer = self.layers[i - 1]
        hidden_states, residual = layer.post_attention_layernorm(hidden_states, residual)
        hidden_states = layer.mlp(hidden_states)
        if i < NUM_LAYERS:
            return self.layers[i].input_layernorm(hidden_states, residual)
        return self.norm(hidden_states, residual)[0]

    def forward(self, input_ids, positions, forward_batch):
        if _compiled:
            return self.piecewise_backend(input_ids, positions, forward_batch)
        hidden_states, residual = self.piece(0, input_ids, None)
        for i, layer in enumerate(self.layers):
            out = self.piece(i + 1, layer.linear_attn(hidden_states, forward_batch), residual)
            hidden_states, residual = out if i + 1 < NUM_LAYERS else (out, None)
        return hidden_states


class Qwen3NextForCausalLM(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.model = Qwen3NextModel(gen, device)
        self.lm_head = _w(gen, device, VOCAB, HIDDEN)

    def forward(self, input_ids, positions, forward_batch):
        hidden_states = self.model(input_ids, positions, forward_batch)
        last_index = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1   # LogitsProcessor (extend)
        return linear(hidden_states[last_index], self.lm_head)


# --- compilation/cuda_piecewise_backend.py (stand-in) and model_executor/piecewise_cuda_graph_runner.py ---------------
class CUDAPiecewiseBackend:
    """Per token count: one graph per piece; the split ops (``gdn_with_output``) run eagerly between them."""

    def __init__(self, runner):
        self.runner, self.entries = runner, {}

    def __call__(self, input_ids, positions, forward_batch):
        num_tokens, raw = input_ids.shape[0], self.runner.raw_num_tokens
        graphs, outputs, gdn_out = self.entries[num_tokens]
        hidden_states, residual = replay(graphs[0], outputs[0], real=raw, size=num_tokens,
                                         padded={"input_ids": self.runner.input_ids})
        for i in range(NUM_LAYERS):
            gdn_with_output(hidden_states, gdn_out[i][:num_tokens], i)
            out = replay(graphs[i + 1], outputs[i + 1], real=raw, size=num_tokens)
            hidden_states, residual = out if i + 1 < NUM_LAYERS else (out, None)
        return hidden_states


class PiecewiseCudaGraphRunner:
    def is_mamba_track_enabled(self):
        return (SERVER_ARGS.enable_mamba_extra_buffer() and not SERVER_ARGS.disable_radix_cache
                and SERVER_ARGS.speculative_algorithm is None)

    def __init__(self, model_runner: "ModelRunner"):
        self.model_runner, self.device = model_runner, model_runner.device
        self.capture_num_tokens = PIECEWISE_CUDA_GRAPH_TOKENS
        self.max_num_tokens = max(self.capture_num_tokens)
        self.max_bs = model_runner.req_to_token_pool.size
        self.mamba_track_enabled = _variant == "fix" and self.is_mamba_track_enabled()
        dev = dict(device=self.device)
        self.input_ids = torch.zeros((self.max_num_tokens,), dtype=torch.int64, **dev)
        self.positions = torch.zeros((self.max_num_tokens,), dtype=torch.int64, **dev)
        if self.mamba_track_enabled:
            self.mamba_track_indices = torch.zeros((self.max_bs,), dtype=torch.int64, **dev)
            self.mamba_track_mask = torch.zeros((self.max_bs,), dtype=torch.bool, **dev)
            self.mamba_track_seqlens = torch.zeros((self.max_bs,), dtype=torch.int64, **dev)
        else:
            self.mamba_track_indices = self.mamba_track_mask = self.mamba_track_seqlens = None
        # output buffers of the split ops (the captured pieces read them)
        self.gdn_output = [torch.zeros((self.max_num_tokens, HIDDEN), dtype=DTYPE, **dev) for _ in range(NUM_LAYERS)]
        self.attention_layers = model_runner.attention_layers
        # install_torch_compiled: the model's forward now runs the captured pieces while compiled
        self.backend = model_runner.model.model.piecewise_backend = CUDAPiecewiseBackend(self)
        self.pool = graph_pool_handle(self.device)
        self.raw_num_tokens = 0
        self.capture()

    def capture(self):
        for num_tokens in reversed(self.capture_num_tokens):    # large first: smaller ones reuse the pool
            self.capture_one_batch_size(num_tokens)

    def capture_one_batch_size(self, num_tokens):
        model, pool = self.model_runner.model.model, self.pool
        mamba_pool = self.model_runner.req_to_token_pool.mamba_pool
        graphs, outputs = [], []
        g, out = capture(lambda: model.piece(0, self.input_ids[:num_tokens], None), device=self.device, pool=pool,
                         static={"input_ids": self.input_ids},
                         state={"conv_states": mamba_pool.conv[0], "ssm_states": mamba_pool.temporal},
                         owner="PiecewiseCudaGraphRunner", name=f"pcg piece 0 tokens={num_tokens}")
        graphs.append(g), outputs.append(out)
        for i in range(1, NUM_LAYERS + 1):
            residual = out[1]
            g, out = capture(lambda i=i, residual=residual: model.piece(i, self.gdn_output[i - 1][:num_tokens],
                                                                        residual),
                             device=self.device, pool=pool, static={f"gdn_output_{i - 1}": self.gdn_output[i - 1]},
                             owner="PiecewiseCudaGraphRunner", name=f"pcg piece {i} tokens={num_tokens}")
            graphs.append(g), outputs.append(out)
        self.backend.entries[num_tokens] = (graphs, outputs, self.gdn_output)

    def can_run(self, forward_batch: ForwardBatch):
        return len(forward_batch.input_ids) <= self.max_num_tokens

    def replay_prepare(self, forward_batch: ForwardBatch):
        num_tokens = len(forward_batch.input_ids)
        static_num_tokens = self.capture_num_tokens[bisect.bisect_left(self.capture_num_tokens, num_tokens)]
        self.raw_num_tokens = num_tokens
        bs = forward_batch.batch_size
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        self.positions[:num_tokens].copy_(forward_batch.positions)
        mamba_track_indices = mamba_track_mask = mamba_track_seqlens = None
        if _variant == "fix":
            if self.mamba_track_indices is not None and forward_batch.mamba_track_indices is not None:
                self.mamba_track_indices[:bs].copy_(forward_batch.mamba_track_indices)
            if self.mamba_track_mask is not None and forward_batch.mamba_track_mask is not None:
                self.mamba_track_mask[:bs].copy_(forward_batch.mamba_track_mask)
            if self.mamba_track_seqlens is not None and forward_batch.mamba_track_seqlens is not None:
                self.mamba_track_seqlens[:bs].copy_(forward_batch.mamba_track_seqlens)
            if self.mamba_track_enabled:
                mamba_track_indices = self.mamba_track_indices[:bs]
                mamba_track_mask = self.mamba_track_mask[:bs]
                mamba_track_seqlens = self.mamba_track_seqlens[:bs]
        return ForwardBatch(
            forward_mode=forward_batch.forward_mode, batch_size=bs, input_ids=self.input_ids[:static_num_tokens],
            positions=self.positions[:static_num_tokens], req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=forward_batch.seq_lens, extend_seq_lens=forward_batch.extend_seq_lens,
            extend_prefix_lens=forward_batch.extend_prefix_lens, extend_start_loc=forward_batch.extend_start_loc,
            extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
            req_to_token_pool=self.model_runner.req_to_token_pool, attn_backend=self.model_runner.attn_backend,
            mamba_track_indices=mamba_track_indices, mamba_track_mask=mamba_track_mask,
            mamba_track_seqlens=mamba_track_seqlens)

    def replay(self, forward_batch: ForwardBatch):
        self.model_runner.attn_backend.init_forward_metadata(forward_batch)
        static_forward_batch = self.replay_prepare(forward_batch)
        with set_forward_context(static_forward_batch, self.attention_layers), set_compiled(True):
            return self.model_runner.model.forward(static_forward_batch.input_ids, static_forward_batch.positions,
                                                   static_forward_batch)


class ModelRunner:
    def __init__(self, device, enable_piecewise_cuda_graph, gen):
        self.device = device
        self.req_to_token_pool = HybridReqToTokenPool(MAX_RUNNING_REQUESTS, MAX_MAMBA_CACHE_SIZE, device)
        self.model = Qwen3NextForCausalLM(gen, device)
        self.attn_backend = HybridLinearAttnBackend(GDNAttnBackend(self), full_attn_layers=[])
        self.attention_layers = [layer.linear_attn for layer in self.model.model.layers]
        self.piecewise_cuda_graph_runner = PiecewiseCudaGraphRunner(self) if enable_piecewise_cuda_graph else None

    def forward_extend(self, forward_batch: ForwardBatch):
        if self.piecewise_cuda_graph_runner is not None and self.piecewise_cuda_graph_runner.can_run(forward_batch):
            return self.piecewise_cuda_graph_runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


# --- the workload -----------------------------------------------------------------------------------------------------
def _prompts():
    gen = generator(11)
    toks = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()   # noqa: E731
    a, d = toks(21), toks(13)
    b, e = a[:16] + toks(5), d[:8] + toks(8)
    f = e[:16] + toks(3)
    return [[("A", a), ("D", d)], [("B", b), ("E", e)], [("F", f)]]


def _serve(device, enable_piecewise_cuda_graph):
    runner = ModelRunner(device, enable_piecewise_cuda_graph, generator(0))
    tree_cache = MambaRadixCache(runner.req_to_token_pool)
    outs = []
    for round_reqs in _prompts():
        reqs = [Req(rid, ids) for rid, ids in round_reqs]
        for req in reqs:
            req.prefix_len = tree_cache.match_prefix(req.origin_input_ids[:-1], cow_mamba=True, req=req)
        batch = ScheduleBatch(reqs, runner.req_to_token_pool, device)
        batch.prepare_for_extend()
        logits = runner.forward_extend(ForwardBatch.init_new(batch, runner)).clone()
        outs.append(logits)
        for req, token in zip(reqs, logits.argmax(-1).tolist()):
            req.output_ids.append(token)
            tree_cache.cache_finished_req(req)
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
