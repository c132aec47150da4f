"""xLLM ACL graphs, Qwen3.5 / Qwen3-Next gated delta net decode: the captured ``causal_conv1d`` takes the linear-state slot ids as host vectors, so every replay reads and writes the conv state of the capture batch's slots.

Upstream: https://github.com/xLLM-AI/xllm/pull/1636 ("bugfix: fix conv1d operator parameter not being updated causing
accuracy degradation.", xLLM-AI/xllm, by maojunx99, opened 2026-06-02, merged 2026-06-03 as commit 3486ef16b).
Read: the PR description ("The AscendC conv1d operator has four host side vector parameters. On non MTP decode paths,
the linear_state_indices_vec parameter in these four parameters is mutable, so it needs to be dynamically updated
during aclgraph replay. However, the update during replay involves a relatively complex synchronization mechanism, and
at this stage, the original conv1d update will be used instead.") and the commit's diff (one file,
``xllm/core/layers/npu_torch/qwen3_gated_delta_net_base.cpp``: it deletes the ``else if (!use_spec_verify &&
!is_any_prefill && checkpoint_stride == 1)`` branch of ``Qwen3GatedDeltaNetBaseImpl::forward``). At the parent commit:
the whole of that ``forward``, ``get_linear_state_indices``, ``get_checkpoint_stride`` /
``build_linear_state_base_indices``; ``runtime/acl_graph_executor_impl.cpp`` (``AclGraph::capture``: persistent-param
update, ``capture_begin`` in thread-local mode, the model forward on the persistent buffers, ``capture_end``, one
``replay``; ``AclGraph::replay``); ``runtime/acl_graph_persistent_param.cpp`` (``GraphPersistentParam::update``: token
tail zeroed, ``persistent_linear_state_indices_`` refilled with the step's indices and padded with
``kPaddingLinearStateId``, and for capture ``params_for_capture->embedding.linear_state_ids`` = the step's host ids
resized to the padded batch); ``common/constants.h`` (``kPaddingLinearStateId = 0``).
Symptom: Qwen3.5 / Qwen3-Next served on Ascend with ACL graphs (``enable_graph``) loses accuracy; eager mode is right.
Mechanism: in decode the GDN layer built ``linear_state_indices_vec_decode`` (and ``query_start_loc_decode``) on the
host from ``input_params.embedding.linear_state_ids`` and gave them to ``xllm::kernel::causal_conv1d`` as
``IntArrayRef``: operator parameters passed by value. ``AclGraph::capture`` records the forward once, with the capture
batch's ids; a replay re-runs the recorded operator with those ids, while ``GraphPersistentParam::update`` refreshes
only the device buffer ``persistent_linear_state_indices_``. When the bucket is replayed for another set of requests,
each row's conv state is read from (and written to) the slot of the request that sat in that row at capture; the
recurrent (SSM) update uses the refreshed device indices, so the two halves of the layer disagree.
Doctor: host-work-frozen, at forward. The slot ids are Python data turned into a kernel's by-value arguments inside the
captured forward (``forward`` builds the vectors and calls ``causal_conv1d``); replays repeat only the kernels, so the
ids stay at their capture-time values while eager steps pass the current ones.
Fix (upstream): delete the branch; decode falls through to ``causal_conv1d_update`` with
``conv_state_indices = logical_state_indices`` (the device tensor the graph's persistent buffer feeds) and
``query_start_loc = attn_metadata.q_cu_seq_lens``.
Modelled: ``Qwen3GatedDeltaNetBaseImpl.forward`` with its prefill, (bug) host-vector decode and device-index decode
branches as read; ``get_linear_state_indices``; ``causal_conv1d`` (fn and update run modes over host
``query_start_loc`` / ``cache_indices`` / ``has_initial_state``, ``pad_slot_id`` -1) and ``causal_conv1d_update``
(device ``conv_state_indices``, ``conv_state = conv_cache.transpose(1, 2)``); ``GraphPersistentParam.update``;
``AclGraph.capture`` / ``replay`` (no warm-up run, thread-local capture mode, one replay after capture);
``AclGraphExecutorImpl.run`` with decode buckets 1, 2, 4, 8; eager serving is ``BaseExecutorImpl``. Stand-ins: the
fused ``qkvzba`` projection is one linear split in the upstream order, the gated delta rule is the plain recurrence
(l2-normalised q/k, ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``) over the SSM cache, run
sequence by sequence for prefill; gated RMSNorm and ``o_proj``; a 2-layer model of GDN layers only (no full-attention
layers, no MLP); float64; the slot allocator hands out slots 1, 2, 3 (0 is the padding slot).
Workload: requests A (5 prompt tokens, slot 1), B (4, slot 2) and C (6, slot 3), tokens chosen in advance. Prefill A
and B; decode [A, B] twice (the bucket-2 graph is captured with host ids [1, 2]); B finishes; prefill C; decode [A, C]
twice (bucket 2 replayed); decode [C] once (bucket 1 captured with ids [3]); the 9 decode hidden-state rows are
compared. Bug: A's rows are exact throughout; at the two [A, C] steps C's conv reads and writes B's slot 2 (C's row is
off by 1.46, then 2.58), and C's own slot 3 was never advanced, so the [C] step is off by 3.06 although its graph was
captured with the right id. Fix: every decode row equals eager (max error 0).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1636"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = ("Qwen3.5/Qwen3-Next decode on ACL graphs loses accuracy: causal_conv1d takes the linear-state slot ids as "
           "host vectors, so replays read and write the conv state of the capture batch's slots")

VOCAB, HIDDEN, N_LAYERS = 32, 16, 2
NUM_K_HEADS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM = 2, 2, 4, 4
KEY_DIM, VALUE_DIM = NUM_K_HEADS * HEAD_K_DIM, NUM_V_HEADS * HEAD_V_DIM
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
CONV_KERNEL_SIZE = 4
NUM_LINEAR_STATE_SLOTS = 6
kPaddingLinearStateId = 0                     # xllm/core/common/constants.h
MAX_GRAPH_TOKENS = 8
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class ModelInputParams:
    is_prefill: bool
    query_start_loc: list                     # host, cumulative tokens per sequence
    linear_state_ids: list                    # host, one slot per sequence
    has_initial_state: list                   # host, prefill only
    linear_state_indices: torch.Tensor = None  # device copy of linear_state_ids (the graph's persistent buffer)
    q_cu_seq_lens: torch.Tensor = None


@dataclasses.dataclass
class AttentionMetadata:
    is_prefill: bool
    q_cu_seq_lens: torch.Tensor
    max_query_len: int


@dataclasses.dataclass
class CausalConv1dUpdateParams:
    x: torch.Tensor
    conv_state: torch.Tensor
    weight: torch.Tensor
    conv_state_indices: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int


# --- xllm::kernel (stand-ins for the AscendC / triton operators) ------------------------------------------------------

def causal_conv1d(x, weight, conv_state, bias, query_start_loc, cache_indices, has_initial_state,
                  num_accepted_tokens, activation_mode, pad_slot_id, run_mode):
    """AscendC causal_conv1d. ``query_start_loc``, ``cache_indices`` and ``has_initial_state`` are host vectors
    (``IntArrayRef``) handed to the operator by value. x [num_tokens, dim], weight [K, dim], conv_state [slots, K-1,
    dim]; run_mode 0 runs whole sequences (prefill), 1 updates the state token by token (decode)."""
    outs = []
    for i in range(len(query_start_loc) - 1):
        xs = x[query_start_loc[i]:query_start_loc[i + 1]]
        slot = cache_indices[i]
        if slot == pad_slot_id:
            outs.append(torch.zeros_like(xs))
            continue
        if run_mode == 0 and not has_initial_state[i]:
            state = torch.zeros(CONV_KERNEL_SIZE - 1, x.size(-1), dtype=x.dtype, device=x.device)
        else:
            state = conv_state[slot]
        window = torch.cat([state, xs], 0)
        y = torch.stack([(window[t:t + CONV_KERNEL_SIZE] * weight).sum(0) for t in range(xs.size(0))])
        outs.append(F.silu(y) if activation_mode == 1 else y)
        conv_state[slot].copy_(window[-(CONV_KERNEL_SIZE - 1):])
    return torch.cat(outs, 0)


def causal_conv1d_update(params: CausalConv1dUpdateParams):
    """One decode token per sequence; ``conv_state_indices`` is a device tensor read at run time. conv_state [slots,
    dim, K-1] (a transposed view of the cache), weight [dim, K]."""
    assert params.max_query_len == 1
    idx = params.conv_state_indices.long()
    window = torch.cat([params.conv_state.index_select(0, idx), params.x.unsqueeze(-1)], -1)
    params.conv_state.index_copy_(0, idx, window[..., 1:])
    return F.silu((window * params.weight).sum(-1))


def recurrent_gated_delta_rule(q, k, v, g, beta, ssm_cache, state_indices):
    """q, k [bs, T, h, dk], v [bs, T, h, dv], g / beta [bs, T, h]; ssm_cache [slots, h, dk, dv] by device indices."""
    idx = state_indices.long()
    S = ssm_cache.index_select(0, idx)
    q, k = F.normalize(q, dim=-1) / HEAD_K_DIM ** 0.5, F.normalize(k, dim=-1)
    outs = []
    for t in range(q.size(1)):
        S = S * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t, :, None]
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    ssm_cache.index_copy_(0, idx, S)
    return torch.stack(outs, 1)


def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# --- xllm/core/layers/npu_torch/qwen3_gated_delta_net_base.cpp ----------------------------------------------------

class Qwen3GatedDeltaNetBaseImpl:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.in_proj_qkvz = r(CONV_DIM + VALUE_DIM, HIDDEN)
        self.in_proj_ba = r(2 * NUM_V_HEADS, HIDDEN)
        self.conv1d_weight = r(CONV_KERNEL_SIZE, CONV_DIM, scale=0.5)   # loaded as weight.transpose(0, 1)
        self.dt_bias, self.A_log = r(NUM_V_HEADS, scale=0.5), r(NUM_V_HEADS, scale=0.5)
        self.norm_weight = 1.0 + r(HEAD_V_DIM, scale=0.1)
        self.o_proj = r(HIDDEN, VALUE_DIM)

    def get_linear_state_indices(self, input_params: ModelInputParams, device):
        if input_params.linear_state_indices is not None:
            return input_params.linear_state_indices.to(torch.int32)
        return torch.tensor(input_params.linear_state_ids, dtype=torch.int32, device=device)

    def forward(self, hidden_states, attn_metadata: AttentionMetadata, kv_cache, input_params: ModelInputParams):
        qkvz = F.linear(hidden_states, self.in_proj_qkvz)              # fused_qkvzba_split_reshape_cat (stand-in)
        mixed_qkv, z = qkvz.split([CONV_DIM, VALUE_DIM], -1)
        b, a = F.linear(hidden_states, self.in_proj_ba).split([NUM_V_HEADS, NUM_V_HEADS], -1)
        conv_cache, ssm_cache = kv_cache
        conv_weight = self.conv1d_weight
        logical_state_indices = self.get_linear_state_indices(input_params, hidden_states.device)
        is_any_prefill = attn_metadata.is_prefill
        if is_any_prefill:
            mixed_qkv = causal_conv1d(mixed_qkv, conv_weight, conv_cache, None, input_params.query_start_loc,
                                      list(input_params.linear_state_ids), input_params.has_initial_state, None,
                                      1, -1, 0)                        # run mode 0: fn
        elif _variant == "bug":      # !use_spec_verify && !is_any_prefill && checkpoint_stride == 1 (deleted by #1636)
            batch_size, seq_len = mixed_qkv.size(0), 1
            linear_state_indices_vec = list(input_params.linear_state_ids)
            num_tokens = batch_size * seq_len
            query_start_loc_decode = list(range(num_tokens + 1))
            linear_state_indices_vec_decode = [linear_state_indices_vec[i] for i in range(batch_size)
                                               for _ in range(seq_len)]
            mixed_qkv = causal_conv1d(mixed_qkv, conv_weight, conv_cache, None, query_start_loc_decode,
                                      linear_state_indices_vec_decode, [], None, 1, -1, 1)   # run mode 1: update
        else:
            conv1d_params = CausalConv1dUpdateParams(
                x=mixed_qkv, conv_state=conv_cache.transpose(1, 2), weight=conv_weight.transpose(0, 1).contiguous(),
                conv_state_indices=logical_state_indices, query_start_loc=attn_metadata.q_cu_seq_lens,
                max_query_len=attn_metadata.max_query_len)
            mixed_qkv = causal_conv1d_update(conv1d_params)
        beta = torch.sigmoid(b)
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        q, k, v = mixed_qkv.split([KEY_DIM, KEY_DIM, VALUE_DIM], -1)
        q, k = q.view(-1, NUM_K_HEADS, HEAD_K_DIM), k.view(-1, NUM_K_HEADS, HEAD_K_DIM)
        v = v.view(-1, NUM_V_HEADS, HEAD_V_DIM)
        if is_any_prefill:            # chunked gated delta rule per sequence (stand-in: the recurrence)
            cu, outs = input_params.query_start_loc, []
            for i in range(len(cu) - 1):
                s = slice(cu[i], cu[i + 1])
                outs.append(recurrent_gated_delta_rule(q[None, s], k[None, s], v[None, s], g[None, s], beta[None, s],
                                                       ssm_cache, logical_state_indices[i:i + 1])[0])
            core_attn_out = torch.cat(outs, 0)
        else:                         # fused recurrent decode: one token per sequence
            core_attn_out = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                       beta[:, None], ssm_cache, logical_state_indices)[:, 0]
        z = z.view(-1, NUM_V_HEADS, HEAD_V_DIM)
        core_attn_out = rms_norm(core_attn_out, self.norm_weight) * F.silu(z)      # gated RMSNorm
        return F.linear(core_attn_out.reshape(-1, VALUE_DIM), self.o_proj)


class Qwen3NextModel:
    """Stand-in for the Qwen3-Next / Qwen3.5 decoder: GDN layers only."""

    def __init__(self, device):
        gen = generator(1636)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [Qwen3GatedDeltaNetBaseImpl(gen, device) for _ in range(N_LAYERS)]
        self.input_norms = [1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE) for _ in range(N_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)

    def forward(self, tokens, kv_caches, input_params: ModelInputParams):
        h = self.embed_tokens[tokens]
        q_cu = input_params.q_cu_seq_lens
        if q_cu is None:
            q_cu = torch.tensor(input_params.query_start_loc, dtype=torch.int32, device=h.device)
        attn_metadata = AttentionMetadata(is_prefill=input_params.is_prefill, q_cu_seq_lens=q_cu,
                                          max_query_len=1 if not input_params.is_prefill else tokens.size(0))
        for layer, norm, kv_cache in zip(self.layers, self.input_norms, kv_caches):
            h = h + layer.forward(rms_norm(h, norm), attn_metadata, kv_cache, input_params)
        return rms_norm(h, self.norm)


# --- xllm/core/runtime/acl_graph_{persistent_param,executor_impl}.cpp (reduced) ---------------------------------------

def get_bucket_num_tokens(num_tokens: int) -> int:
    return next(b for b in (1, 2, 4, 8) if num_tokens <= b)


class GraphPersistentParam:
    def __init__(self, device):
        self.persistent_tokens_ = torch.zeros(MAX_GRAPH_TOKENS, dtype=torch.int64, device=device)
        self.persistent_linear_state_indices_ = torch.zeros(MAX_GRAPH_TOKENS, dtype=torch.int32, device=device)
        self.q_cu_seq_lens_ = torch.arange(MAX_GRAPH_TOKENS + 1, dtype=torch.int32, device=device)  # decode: 1/seq

    def static_buffers(self):
        return {"persistent_tokens_": self.persistent_tokens_, "q_cu_seq_lens_": self.q_cu_seq_lens_,
                "persistent_linear_state_indices_": self.persistent_linear_state_indices_}

    def update(self, tokens, params: ModelInputParams, padded_num_tokens, return_capture_params):
        actual = tokens.size(0)
        self.persistent_tokens_[:actual].copy_(tokens)
        self.persistent_tokens_[actual:padded_num_tokens].zero_()                      # zero_tensor_tail
        ids = torch.tensor(params.linear_state_ids, dtype=torch.int32, device=tokens.device)
        self.persistent_linear_state_indices_[:actual].copy_(ids)
        self.persistent_linear_state_indices_[actual:padded_num_tokens].fill_(kPaddingLinearStateId)
        if not return_capture_params:
            return None
        return dataclasses.replace(
            params, linear_state_ids=list(params.linear_state_ids) + [kPaddingLinearStateId] * (padded_num_tokens - actual),
            linear_state_indices=self.persistent_linear_state_indices_[:padded_num_tokens],
            q_cu_seq_lens=self.q_cu_seq_lens_[:padded_num_tokens + 1],
            query_start_loc=list(range(padded_num_tokens + 1)))


class AclGraph:
    def __init__(self, persistent_param: GraphPersistentParam, device):
        self.persistent_param_, self.device = persistent_param, device
        self.graph_ = self.hidden_states_ = None
        self.num_tokens_ = 0

    def capture(self, model: Qwen3NextModel, tokens, params, kv_cache, bucket_num_tokens):
        self.num_tokens_ = n = bucket_num_tokens
        p = self.persistent_param_
        graph_params = p.update(tokens, params, n, return_capture_params=True)

        def forward():
            return model.forward(p.persistent_tokens_[:n], kv_cache, graph_params)

        state = {f"kv_cache[{i}].{name}": t for i, c in enumerate(kv_cache) for name, t in zip(("conv", "ssm"), c)}
        # capture_begin(..., ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL): no warm-up run before it
        self.graph_, self.hidden_states_ = capture(forward, device=self.device, warmups=0, static=p.static_buffers(),
                                                   state=state, owner="AclGraphExecutorImpl",
                                                   capture_error_mode="thread_local", name=f"acl decode graph {n}")
        return replay(self.graph_, self.hidden_states_, real=tokens.size(0), size=n)     # graph_.replay()

    def replay(self, tokens, params):
        self.persistent_param_.update(tokens, params, self.num_tokens_, return_capture_params=False)
        return replay(self.graph_, self.hidden_states_, real=tokens.size(0), size=self.num_tokens_)


class AclGraphExecutorImpl:
    def __init__(self, model: Qwen3NextModel, device):
        self.model_, self.device_ = model, device
        self.persistent_param_ = GraphPersistentParam(device)
        self.graphs_: dict[int, AclGraph] = {}

    def run(self, tokens, kv_caches, params: ModelInputParams):
        if params.is_prefill:                                            # graphs serve decode only
            return self.model_.forward(tokens, kv_caches, params)
        bucket = get_bucket_num_tokens(tokens.size(0))
        if bucket in self.graphs_:
            out = self.graphs_[bucket].replay(tokens, params)
        else:
            graph = AclGraph(self.persistent_param_, self.device_)
            out = graph.capture(self.model_, tokens, params, kv_caches, bucket)
            self.graphs_[bucket] = graph
        return out[:tokens.size(0)]


class BaseExecutorImpl:                                                  # enable_graph = false
    def __init__(self, model: Qwen3NextModel):
        self.model_ = model

    def run(self, tokens, kv_caches, params):
        return self.model_.forward(tokens, kv_caches, params)


# --- the serving loop (stand-in for the batch builder and the scheduler) -----------------------------------------------

def _step(reqs, device, prefill: bool):
    tokens, cu = [], [0]
    for req in reqs:
        new = req["prompt"] if prefill else [req["out"][req["decoded"]]]
        req["decoded"] += 0 if prefill else 1
        tokens += new
        cu.append(cu[-1] + len(new))
    params = ModelInputParams(is_prefill=prefill, query_start_loc=cu, linear_state_ids=[r["slot"] for r in reqs],
                              has_initial_state=[0] * len(reqs))
    return torch.tensor(tokens, dtype=torch.int64).to(device), params


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enable_graph: bool):
        model = Qwen3NextModel(device)
        kv_caches = [(torch.zeros(NUM_LINEAR_STATE_SLOTS, CONV_KERNEL_SIZE - 1, CONV_DIM, dtype=DTYPE, device=device),
                      torch.zeros(NUM_LINEAR_STATE_SLOTS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, dtype=DTYPE,
                                  device=device)) for _ in range(N_LAYERS)]
        executor = AclGraphExecutorImpl(model, device) if enable_graph else BaseExecutorImpl(model)
        reqs = {}
        for name, n, slot in (("A", 5, 1), ("B", 4, 2), ("C", 6, 3)):
            gen = generator(ord(name))
            reqs[name] = dict(prompt=torch.randint(0, VOCAB, (n,), generator=gen).tolist(), slot=slot, decoded=0,
                              out=torch.randint(0, VOCAB, (4,), generator=gen).tolist())
        outs = []
        for batch, prefill in ((["A", "B"], True), (["A", "B"], False), (["A", "B"], False), (["C"], True),
                               (["A", "C"], False), (["A", "C"], False), (["C"], False)):
            tok, params = _step([reqs[r] for r in batch], device, prefill)
            out = executor.run(tok, kv_caches, params)
            if not prefill:
                outs.append(out.clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
