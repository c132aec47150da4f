"""Qwen3.5 VLM behind ``--backend=vlm``: the wrapper does not forward ``is_hybrid_linear_attention()``, so the ACL-graph decode path builds ``q_cu_seq_lens`` without its leading 0 and the GDN kernel rejects the capture.

Upstream: https://github.com/xLLM-AI/xllm/pull/1844 ("bugfix: propagate is_hybrid_linear_attention for Qwen3.5 VLM
graph capture.", maojunx99, opened 2026-06-29, merged 2026-07-07 as 3d504bb89; twin PR #1842, same title and body,
also merged).
Symptom: as reported, Qwen3.5 on NPU with ``--backend=vlm`` and ACL graphs crashes at the first decode graph capture in
``npu_fused_sigmoid_gating_delta_rule_update`` with "initial_state_indices size must equal cu_seqlens size - 1"; the
text (LLM) backend and eager mode serve.
Mechanism: ``AclGraphExecutorImpl``'s constructor (``xllm/core/runtime/acl_graph_executor_impl.cpp``) asks
``model->is_hybrid_linear_attention()`` once and freezes the answer into each ``GraphPersistentParam``
(``need_update_attn_mask``, ``is_hybrid_linear_attention_``). For the VLM backend the model is
``CausalVLMImpl<Qwen3_5ForConditionalGeneration>``, whose ``is_hybrid_linear_attention()`` forwards only if the wrapped
model has that method (SFINAE trait ``detail::has_is_hybrid_linear_attention``); ``Qwen3VLForConditionalGenerationBase``
(``xllm/models/vlm/qwen3_vl_base.h``) did not have it, so the answer fell back to ``CausalLM``'s ``false`` although
its language model (``Qwen3_5ForCausalLM``, a ``Qwen3HybridForCausalLMImplBase``) says ``true``. With the flag false,
``GraphPersistentParam::update`` (``acl_graph_persistent_param.cpp``) takes ``use_qwen3_5_query_start_loc = false``:
the persistent ``q_cu_seq_lens_`` gets the batch's B-entry cumulative lengths (no leading 0), padded to the bucket,
and the capture params hand the graph a ``padded_batch_size``-entry slice instead of ``padded_batch_size + 1``. In
graph mode ``build_attention_metadata`` (``attention_metadata_builder.cpp``) sees ``graph.tiling_data`` defined and
uses ``q_cu_seq_lens`` as is (the graph path is trusted to carry the leading 0), so ``Qwen3GatedDeltaNetBaseImpl``
passes a cu_seqlens one entry short next to ``padded_batch_size`` state indices. The eager step's builder prepends the
0 itself and never consults the flag.
Doctor: warmup-divergence, at is_hybrid_linear_attention (the graph path's metadata layout -- whether the persistent
``q_cu_seq_lens`` carries the leading 0 that graph-mode metadata relies on -- is a branch decided once, when the
executor is built, from the wrapper's capability answer, and every capture/replay of the graph uses it; the eager step
decides its own layout (prepends the 0) and does otherwise; the wrong answer comes from the VLM wrapper's missing
``is_hybrid_linear_attention``, the function the fix adds).
Fix (upstream): ``Qwen3VLForConditionalGenerationBase::is_hybrid_linear_attention()`` forwards to the language model
when it has the method (else ``false``), so ``CausalVLMImpl`` reports ``true`` for Qwen3.5 VLM.
Modelled: one Qwen3.5 text layer, its gated delta net (decode recurrent update on a per-sequence SSM state slot, state
slot 0 = ``kPaddingLinearStateId``), embedding in, residual out; no vision tower (decode steps are text), no
causal_conv1d, no full-attention layer, no attention-mask update, no ATB tiling plan (``tiling_data`` is a small
persistent tensor whose presence marks graph mode, as in the builder), and no graph-task-update context (it only
carries the spec-verify conv1d tasks). Graphs are captured lazily on a bucket's first decode step without warmup,
then replayed once (``AclGraph::capture``'s test replay serves that step). Decode steps of 3, 4 and 3 sequences
into bucket 4, in ``THREAD_LOCAL`` capture mode; the prefill already filled the SSM states.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1844"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "is_hybrid_linear_attention"
SYMPTOM = ("Qwen3.5 VLM backend on ACL graphs: the graph's q_cu_seq_lens lacks its leading 0; capture fails with "
           "'initial_state_indices size must equal cu_seqlens size - 1'")

VOCAB, HIDDEN = 32, 16
NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM = 2, 4, 4
MAX_SEQS_PER_BATCH = 8
NUM_STATE_SLOTS = 1 + MAX_SEQS_PER_BATCH        # slot 0: kPaddingLinearStateId
K_PADDING_LINEAR_STATE_ID = 0
GRAPH_BUCKETS = [1, 2, 4, 8]


# --- xllm/core/framework/model_input_params.h (reduced) -----------------------------------------------------

class ModelInputParams:
    def __init__(self, *, is_decode, num_sequences, q_seq_lens, q_cu_seq_lens, q_cu_seq_lens_host, linear_state_ids,
                 linear_state_indices=None, tiling_data=None, enable_graph=False):
        self.is_decode, self.num_sequences = is_decode, num_sequences
        self.q_seq_lens = q_seq_lens                        # attention.device.q_seq_lens       [B]
        self.q_cu_seq_lens = q_cu_seq_lens                  # attention.device.q_cu_seq_lens    [B] (no leading 0)
        self.q_cu_seq_lens_host = q_cu_seq_lens_host        # attention.host.q_cu_seq_lens
        self.linear_state_ids = linear_state_ids            # embedding.linear_state_ids
        self.linear_state_indices = linear_state_indices    # embedding.linear_state_indices (graph: persistent)
        self.tiling_data = tiling_data                      # graph.tiling_data (graph mode only)
        self.enable_graph = enable_graph

    def copy(self, **changes):
        """``std::make_optional<ModelInputParams>(params)`` followed by field assignments."""
        fields = dict(vars(self))
        fields.update(changes)
        return ModelInputParams(**fields)


# --- xllm/core/layers/common/attention_metadata_builder.cpp (NPU part) ---------------------------------------

class AttentionMetadata:
    def __init__(self, q_cu_seq_lens, q_seq_lens):
        self.q_cu_seq_lens, self.q_seq_lens = q_cu_seq_lens, q_seq_lens


def build_attention_metadata(params: ModelInputParams) -> AttentionMetadata:
    q_cu_seq_lens = params.q_cu_seq_lens
    if q_cu_seq_lens is None:
        q_cu_seq_lens = torch.cumsum(params.q_seq_lens, 0)
    q_cu_seq_lens = q_cu_seq_lens.to(torch.int32)
    q_cu_has_leading_zero = bool(params.q_cu_seq_lens_host) and params.q_cu_seq_lens_host[0] == 0
    if params.tiling_data is not None or q_cu_has_leading_zero:
        cu = q_cu_seq_lens                          # graph mode: the persistent buffer already holds [0, cu...]
    else:
        cu = torch.cat([torch.zeros(1, dtype=q_cu_seq_lens.dtype, device=q_cu_seq_lens.device), q_cu_seq_lens])
    return AttentionMetadata(q_cu_seq_lens=cu, q_seq_lens=params.q_seq_lens)


# --- torch_npu: npu_fused_sigmoid_gating_delta_rule_update ----------------------------------------------------

def npu_fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, q, k, v, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, scale,
                                               use_qk_l2norm_in_kernel=True, softplus_beta=1.0,
                                               softplus_threshold=20.0):
    """Decode gated delta rule: one token per sequence, sequence i starts at cu_seqlens[i]; the state of sequence i
    is slot initial_state_indices[i] of initial_state_source, updated in place."""
    if initial_state_indices.numel() != cu_seqlens.numel() - 1:
        raise RuntimeError("initial_state_indices size must equal cu_seqlens size - 1")
    starts = cu_seqlens[:-1].long()                 # read on the device
    q, k, v, a, b = q[starts], k[starts], v[starts], a[starts], b[starts]
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    idx = initial_state_indices.long()
    state = initial_state_source[idx]                                            # [N, H, K, V]
    g = -A_log.exp() * F.softplus(a + dt_bias, beta=softplus_beta, threshold=softplus_threshold)   # [N, H]
    beta = torch.sigmoid(b)
    state = state * g.exp()[..., None, None]
    kv_mem = torch.einsum("nhk,nhkv->nhv", k, state)
    delta = (v - kv_mem) * beta[..., None]
    state = state + torch.einsum("nhk,nhv->nhkv", k, delta)
    out = torch.einsum("nhk,nhkv->nhv", q * scale, state)
    initial_state_source.index_copy_(0, idx, state)
    return out


# --- xllm/core/layers/npu_torch/qwen3_gated_delta_net_base.cpp (decode path, reduced) ------------------------

class Qwen3GatedDeltaNetBaseImpl:
    def __init__(self, gen, device):
        h, dk, dv = NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM
        self.in_proj_qkvz = randn(HIDDEN, h * (2 * dk + dv), gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.in_proj_ba = randn(HIDDEN, 2 * h, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.A_log = randn(h, gen=gen, device=device, scale=0.5)
        self.dt_bias = randn(h, gen=gen, device=device, scale=0.5)
        self.out_proj = randn(h * dv, HIDDEN, gen=gen, device=device, scale=(h * dv) ** -0.5)

    @staticmethod
    def get_linear_state_indices(input_params, device):
        if input_params.linear_state_indices is not None:
            return input_params.linear_state_indices.to(torch.int32)
        return torch.tensor(input_params.linear_state_ids, dtype=torch.int32, device=device)

    def forward(self, hidden_states, ssm_cache, attn_metadata, input_params):
        n, h, dk, dv = hidden_states.shape[0], NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM
        q, k, v = (hidden_states @ self.in_proj_qkvz).split([h * dk, h * dk, h * dv], -1)
        b, a = (hidden_states @ self.in_proj_ba).split([h, h], -1)
        logical_state_indices = self.get_linear_state_indices(input_params, hidden_states.device)
        core_attn_out = npu_fused_sigmoid_gating_delta_rule_update(
            self.A_log, a, self.dt_bias, q.view(n, h, dk), k.view(n, h, dk), v.view(n, h, dv), b,
            initial_state_source=ssm_cache, initial_state_indices=logical_state_indices,
            cu_seqlens=attn_metadata.q_cu_seq_lens.contiguous(), scale=dk ** -0.5)
        return core_attn_out.reshape(-1, h * dv) @ self.out_proj


# --- xllm/models/llm/qwen3_next_hybrid_base.h, xllm/models/vlm/qwen3_5.h -------------------------------------

class Qwen3_5ForCausalLM:
    """``Qwen3HybridForCausalLMImplBase``: the Qwen3.5 language model (GDN layers)."""

    def __init__(self, device):
        gen = generator(1844)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.linear_attn = Qwen3GatedDeltaNetBaseImpl(gen, device)

    def is_hybrid_linear_attention(self):
        return True

    def get_input_embeddings(self, input_ids):
        return self.embed_tokens[input_ids.long()]

    def __call__(self, tokens, positions, kv_caches, input_params):
        attn_metadata = build_attention_metadata(input_params)
        hidden = self.get_input_embeddings(tokens)
        return hidden + self.linear_attn.forward(hidden, kv_caches[0], attn_metadata, input_params)


# --- xllm/models/vlm/qwen3_vl_base.h -------------------------------------------------------------------------

class Qwen3VLForConditionalGenerationBase:
    """Before #1844: forwards forward/get_input_embeddings/... to the language model, but has no
    ``is_hybrid_linear_attention``."""

    def __init__(self, language_model):
        self.language_model_ = language_model      # (the vision tower is not modelled: decode steps are text)

    def get_input_embeddings(self, input_ids, input_params):
        return self.language_model_.get_input_embeddings(input_ids)

    def forward(self, tokens, positions, kv_caches, input_params):
        return self.language_model_(tokens, positions, kv_caches, input_params)


class Qwen3VLForConditionalGenerationBaseFixed(Qwen3VLForConditionalGenerationBase):
    """#1844: the same class with the forwarding method added."""

    def is_hybrid_linear_attention(self):
        if has_is_hybrid_linear_attention(self.language_model_):
            return self.language_model_.is_hybrid_linear_attention()
        return False


# --- xllm/core/framework/model/{model_traits.h, causal_lm.h, causal_vlm.h} -----------------------------------

def has_is_hybrid_linear_attention(model) -> bool:
    """``detail::has_is_hybrid_linear_attention<T>``: does ``model->is_hybrid_linear_attention()`` compile?"""
    return callable(getattr(model, "is_hybrid_linear_attention", None))


class CausalLM:
    def is_hybrid_linear_attention(self):
        return False


class CausalVLMImpl(CausalLM):
    def __init__(self, model):
        self.model_ = model

    def forward(self, tokens, positions, kv_caches, params):
        return self.model_.forward(tokens, positions, kv_caches, params)

    def is_hybrid_linear_attention(self):
        if has_is_hybrid_linear_attention(self.model_):
            return self.model_.is_hybrid_linear_attention()
        return CausalLM.is_hybrid_linear_attention(self)


# --- xllm/core/runtime/acl_graph_persistent_param.cpp (reduced) ----------------------------------------------

class GraphPersistentParam:
    def __init__(self, device, need_update_attn_mask=False, is_hybrid_linear_attention=False):
        self.device = device
        self.need_update_attn_mask_ = need_update_attn_mask      # (attention-mask update not modelled)
        self.is_hybrid_linear_attention_ = is_hybrid_linear_attention
        n = MAX_SEQS_PER_BATCH
        self.persistent_tokens_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.persistent_positions_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.q_seq_lens_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.q_cu_seq_lens_ = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.q_cu_seq_lens_default_ = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.persistent_linear_state_indices_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.tiling_data_ = torch.zeros(4, dtype=torch.int32, device=device)
        self.hidden_states_ = torch.zeros(n, HIDDEN, device=device)

    def static_buffers(self):
        return {"persistent_tokens": self.persistent_tokens_, "persistent_positions": self.persistent_positions_,
                "q_seq_lens": self.q_seq_lens_, "q_cu_seq_lens": self.q_cu_seq_lens_,
                "persistent_linear_state_indices": self.persistent_linear_state_indices_,
                "tiling_data": self.tiling_data_}

    def update(self, tokens, positions, params, padded_num_tokens, return_capture_params):
        actual = tokens.shape[0]
        padded_batch_size = padded_num_tokens                       # decode: one token per sequence
        self.persistent_tokens_[:actual].copy_(tokens)
        self.persistent_tokens_[actual:padded_num_tokens].zero_()
        self.persistent_positions_[:actual].copy_(positions)
        self.persistent_positions_[actual:padded_num_tokens].zero_()
        self.q_seq_lens_[:actual].copy_(params.q_seq_lens)
        self.q_seq_lens_[actual:padded_batch_size].fill_(1)
        self.persistent_linear_state_indices_[:actual].copy_(
            torch.tensor(params.linear_state_ids, dtype=torch.int32, device=self.device))
        self.persistent_linear_state_indices_[actual:padded_batch_size].fill_(K_PADDING_LINEAR_STATE_ID)

        self.q_cu_seq_lens_.copy_(self.q_cu_seq_lens_default_)
        use_qwen3_5_query_start_loc = self.is_hybrid_linear_attention_
        if use_qwen3_5_query_start_loc:
            self.q_cu_seq_lens_[0:1].zero_()
            self.q_cu_seq_lens_[1:actual + 1].copy_(params.q_cu_seq_lens[:actual])
        else:
            self.q_cu_seq_lens_[0:actual].copy_(params.q_cu_seq_lens[:actual])
        if padded_batch_size > actual:
            padded = list(range(actual + 1, padded_batch_size + 1))           # each padded sequence: 1 token
            start = actual + (1 if use_qwen3_5_query_start_loc else 0)
            end = padded_batch_size + (1 if use_qwen3_5_query_start_loc else 0)
            self.q_cu_seq_lens_[start:end].copy_(torch.tensor(padded, dtype=torch.int32, device=self.device))

        if not return_capture_params:
            return None
        return params.copy(
            num_sequences=padded_batch_size, q_seq_lens=self.q_seq_lens_[:padded_batch_size],
            q_cu_seq_lens=self.q_cu_seq_lens_[:padded_batch_size + (1 if use_qwen3_5_query_start_loc else 0)],
            linear_state_ids=params.linear_state_ids + [K_PADDING_LINEAR_STATE_ID] * (padded_batch_size - actual),
            linear_state_indices=self.persistent_linear_state_indices_[:padded_batch_size],
            tiling_data=self.tiling_data_, enable_graph=True)


# --- xllm/core/runtime/acl_graph_executor_impl.cpp (reduced) -------------------------------------------------

class AclGraph:
    def __init__(self, persistent_param, device):
        self.persistent_param_, self.device = persistent_param, device
        self.graph_ = self.outputs_ = None
        self.num_tokens_ = 0

    def capture(self, model, tokens, positions, params, kv_cache, bucket_num_tokens):
        self.num_tokens_ = n = bucket_num_tokens
        pp = self.persistent_param_
        graph_params = pp.update(tokens, positions, params, n, return_capture_params=True)

        def forward():
            out = model.forward(pp.persistent_tokens_[:n], pp.persistent_positions_[:n], kv_cache, graph_params)
            pp.hidden_states_[:n].copy_(out)                   # set_hidden_states
            return pp.hidden_states_[:n]

        # graph_.capture_begin({0, 0}, ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL); no warmup run
        self.graph_, self.outputs_ = capture(
            forward, device=self.device, warmups=0, name=f"decode bucket={n}", owner="AclGraphExecutorImpl",
            static=pp.static_buffers(), state={"ssm_cache": kv_cache[0]}, capture_error_mode="thread_local")
        # test replay right after capture: it produces this step's hidden states
        return replay(self.graph_, self.outputs_, real=tokens.shape[0], size=n)[:tokens.shape[0]].clone()

    def replay(self, model, tokens, positions, kv_cache, params):
        actual = tokens.shape[0]
        self.persistent_param_.update(tokens, positions, params, self.num_tokens_,
                                      return_capture_params=model.is_hybrid_linear_attention())
        return replay(self.graph_, self.outputs_, real=actual, size=self.num_tokens_)[:actual].clone()


class AclGraphExecutorImpl:
    def __init__(self, model, device):
        self.model_, self.device = model, device
        need_update_attn_mask = model.is_hybrid_linear_attention()
        is_hybrid_linear_attn = model.is_hybrid_linear_attention()
        self.persistent_param = GraphPersistentParam(device, need_update_attn_mask, is_hybrid_linear_attn)
        self.graphs: dict[int, AclGraph] = {}

    @staticmethod
    def get_bucket_num_tokens(num_tokens):
        return next(b for b in GRAPH_BUCKETS if b >= num_tokens)

    def run(self, tokens, positions, kv_caches, params):
        if not params.is_decode:
            return self.model_.forward(tokens, positions, kv_caches, params)
        bucket = self.get_bucket_num_tokens(tokens.shape[0])
        graph = self.graphs.get(bucket)
        if graph is not None:
            return graph.replay(self.model_, tokens, positions, kv_caches, params)
        graph = AclGraph(self.persistent_param, self.device)
        out = graph.capture(self.model_, tokens, positions, params, kv_caches, bucket)
        self.graphs[bucket] = graph
        return out


# --- the workload --------------------------------------------------------------------------------------------

# (sequence -> linear state slot) and the decode steps: which sequences run, with their next tokens
STEPS = [[1, 2, 3], [1, 2, 3, 4], [2, 3, 4]]


def decode_params(seqs, device):
    b = len(seqs)
    q_seq_lens = torch.ones(b, dtype=torch.int32, device=device)
    cu = list(range(1, b + 1))                          # build_q_cu_seq_lens_vec on NPU: no leading 0
    return ModelInputParams(is_decode=True, num_sequences=b, q_seq_lens=q_seq_lens,
                            q_cu_seq_lens=torch.tensor(cu, dtype=torch.int32, device=device),
                            q_cu_seq_lens_host=cu, linear_state_ids=list(seqs))


def run(variant: str, device: str = "cpu"):
    gen = generator(18440)
    ssm_init = randn(NUM_STATE_SLOTS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, gen=gen, device=device, scale=0.5)
    ssm_init[K_PADDING_LINEAR_STATE_ID].zero_()
    step_tokens = [torch.randint(0, VOCAB, (len(s),), generator=gen).to(torch.int32) for s in STEPS]
    step_positions = [torch.full((len(s),), 7 + i, dtype=torch.int32) for i, s in enumerate(STEPS)]
    vlm_class = Qwen3VLForConditionalGenerationBaseFixed if variant == "fix" else Qwen3VLForConditionalGenerationBase

    def serve(use_graph: bool):
        # --backend=vlm: CausalVLMImpl<Qwen3_5ForConditionalGeneration>
        model = CausalVLMImpl(vlm_class(Qwen3_5ForCausalLM(device)))
        kv_caches = [ssm_init.clone()]
        executor = AclGraphExecutorImpl(model, device) if use_graph else None
        outs = []
        for seqs, tok, pos in zip(STEPS, step_tokens, step_positions):
            params = decode_params(seqs, device)
            tok, pos = tok.to(device), pos.to(device)
            if use_graph:
                outs.append(executor.run(tok, pos, kv_caches, params))
            else:
                outs.append(model.forward(tok, pos, kv_caches, params).clone())
        outs.append(kv_caches[0][1:].clone())           # the sequences' SSM states after the steps
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
