"""CUDA-graph decode re-plan always picks FlashInfer's tensor-core module, while the captured layer calls the CUDA-core decode entry point (GQA < 4).

Upstream: https://github.com/xLLM-AI/xllm/pull/880 ("bugfix: fix request failure for CUDA backend when enable_graph
is true.", commit b0ae998d6, merged 2026-02-04). The bug came in with
https://github.com/xLLM-AI/xllm/pull/844 (d506d9465, 2026-02-02, "auto-detect whether to use tensor core in decode
phase for flashinfer").
Symptom: on the CUDA backend with ``enable_graph`` on, decode requests fail for models whose GQA group is below 4,
for example Qwen3-0.6B with 16/8 heads. Eager mode and models with a group of 4 or more are fine.
Mechanism: #844 made ``AttentionImpl`` (``layers/cuda/attention.cpp``) choose the FlashInfer decode variant per model:
``decode_use_tensor_core_ = should_use_tensor_core(bf16, num_heads, num_kv_heads)``, which is ``gqa_group_size >= 4``.
That flag goes into both ``update_plan_info`` and ``AttentionParams.use_tensor_core``, so on the eager path the plan
and the kernel always agree. In graph mode ``AttentionImpl::forward`` skips its own plan ("no need to update plan_info
for CUDA graph") and relies on ``CudaGraphPersistentParam::update`` (``runtime/cuda_graph_executor_impl.cpp``), which
re-plans at layer 0 before the capture and before every replay. #844 left that call hard-coded
``/*use_tensor_core=*/true`` ("temporarily"). So ``update_plan_info`` (``flashinfer_planinfo.cpp``) stores the
batch-prefill URI and a prefill-layout plan in the shared ``plan_info``. The captured layer still has
``use_tensor_core = false`` and so ``batch_decode`` (``kernels/cuda/batch_decode.cpp``) takes the CUDA-core branch:
``get_function(uri, "run")``. A batch-prefill JIT module exports ``plan`` / ``ragged_run`` / ``paged_run`` and has no
``run``, so ``get_module(uri)->GetFunction("run").value()`` throws in the first decode graph capture, and the request
fails. (Had it found a function, the 15-field prefill plan would still fail the 10-field
``DecodePlanInfo::FromVector`` check.)
Doctor: warmup-divergence, at ``update`` (the graph runner's pre-capture and pre-replay plan chooses the attention
variant by its own hard-coded rule, not the layer's GQA rule, so what the capture runs with differs from what the
eager step decides for the same batch).
Fix (upstream): ``update()`` computes ``use_tensor_core = should_use_tensor_core(dtype, n_heads, n_kv_heads)`` (the
helper moved to ``kernels/cuda/utils.cpp``), ``CHECK_EQ(dtype, BFloat16)``, and passes it to ``update_plan_info``,
so the graph plan and the captured kernel agree.
Modelled: 2 decoder layers with 4 query heads and 2 KV heads (GQA 2), NHD paged KV caches (page size 2) that
hold the prompts' keys and values as the eager prefill left them, and decode-only lazy graphs per bucket
(1/2/4, with no warmup, followed by the test replay, as at b0ae998d6^). Batches fill their bucket exactly, so no
rows are padded. Dtypes are labels (``bfloat16`` decides ``should_use_tensor_core``) and the arithmetic is float32.
The JIT modules are dicts of their exported entry points, and ``Optional.value()`` on a missing one raises a
RuntimeError whose wording is ours. FlashInfer's plan is modelled by its host-side ``plan_info`` vector only. Both
run kernels compute the same decode attention from device tensors. The kernels receive the persistent
``paged_kv_indices`` buffer whole: upstream passes a slice, but a slice's length does not bound a CUDA kernel's
reads. No RoPE, no norm, and the MLP is a tanh.
"""
import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/880"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "update"
SYMPTOM = ("enable_graph on CUDA, GQA < 4: the graph re-plan builds a tensor-core (batch-prefill) plan, the captured "
           "layer calls the CUDA-core decode 'run' on that module; the request fails")

VOCAB, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 2, 4, 2, 4     # Qwen3-0.6B-like GQA group of 2
HIDDEN = N_HEADS * HEAD_DIM
BLOCK_SIZE, MAX_BLOCKS_PER_SEQ, MAX_SEQS = 2, 6, 4
NUM_BLOCKS = 1 + MAX_SEQS * MAX_BLOCKS_PER_SEQ
MAX_KV = BLOCK_SIZE * MAX_BLOCKS_PER_SEQ


# ------------------------------------------------------------------ kernels/cuda/utils.cpp
def should_use_tensor_core(kv_cache_dtype, num_attention_heads, num_kv_heads):
    gqa_group_size = num_attention_heads // num_kv_heads
    if kv_cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return True
    if kv_cache_dtype in (torch.float16, torch.bfloat16):
        return gqa_group_size >= 4      # the MMA fuses the head group with the token dimension
    return False


class Optional:
    """``tvm::ffi::Optional``: ``value()`` on an empty one throws."""

    def __init__(self, what, func=None):
        self.what, self.func = what, func

    def value(self):
        if self.func is None:
            raise RuntimeError(f"Bad optional access: {self.what}")
        return self.func


class Module:
    def __init__(self, uri, functions):
        self.uri, self.functions = uri, functions

    def GetFunction(self, func_name):  # noqa: N802 - the TVM FFI name
        return Optional(f"module {self.uri} exports no '{func_name}'", self.functions.get(func_name))


def get_batch_decode_uri(dtype, head_dim):
    return f"batch_decode_with_kv_cache_dtype_q_{dtype}_head_dim_{head_dim}"


def get_batch_prefill_uri(backend, dtype, head_dim):
    return f"batch_prefill_with_kv_cache_{backend}_dtype_q_{dtype}_head_dim_{head_dim}"


def get_module(uri):
    if uri.startswith("batch_decode"):        # csrc/batch_decode_jit_binding.cu
        return Module(uri, {"plan": batch_decode_plan, "run": batch_decode_run})
    return Module(uri, {"plan": batch_prefill_plan, "ragged_run": batch_prefill_ragged_run,  # batch_prefill_jit_binding
                        "paged_run": batch_prefill_paged_run})


def get_function(uri, func_name):
    return get_module(uri).GetFunction(func_name).value()


# ------------------------------------------------------------------ the FlashInfer JIT modules (plan / run)
def batch_decode_plan(paged_kv_indptr_host, batch_size, num_qo_heads, num_kv_heads, page_size, enable_cuda_graph):
    """DecodePlanInfo::ToVector (10 fields): padded_batch_size, workspace offsets, enable_cuda_graph, split_kv."""
    return [batch_size, 0, 0, 0, batch_size, 2 * batch_size, 0, 3 * batch_size, int(enable_cuda_graph), 0]


def batch_prefill_plan(qo_indptr_host, paged_kv_indptr_host, kv_len_arr_host, total_num_rows, batch_size,
                       num_qo_heads, num_kv_heads, page_size, enable_cuda_graph):
    """PrefillPlanInfo::ToVector (15 fields); the CTA tile over qo rows fuses the GQA group with the tokens."""
    avg_packed_qo_len = total_num_rows * (num_qo_heads // num_kv_heads) // batch_size
    cta_tile_q = 128 if avg_packed_qo_len > 64 else 64 if avg_packed_qo_len > 16 else 16
    return [batch_size, total_num_rows, 0, cta_tile_q, 0, batch_size, 2 * batch_size, 0, 3 * batch_size,
            4 * batch_size, 0, 0, 0, int(enable_cuda_graph), 0]


def _check_plan(plan_info, fields, name):
    if len(plan_info) != fields:
        raise RuntimeError(f"{name}::FromVector: vec.size() should be {fields}, but got {len(plan_info)}")


def _paged_decode_attention(query, k_cache, v_cache, row_to_req, paged_kv_indptr, paged_kv_indices,
                            paged_kv_last_page_len, sm_scale, output):
    """One query row per request (row_to_req maps rows to requests) over the request's pages; device tensors only."""
    req = row_to_req.long()
    start = paged_kv_indptr[req].long()
    num_pages = paged_kv_indptr[req + 1].long() - start
    kv_len = (num_pages - 1) * BLOCK_SIZE + paged_kv_last_page_len[req].long()
    t = torch.arange(MAX_KV, device=query.device)
    slot = (start[:, None] + t[None, :] // BLOCK_SIZE).clamp(max=paged_kv_indices.numel() - 1)
    pages = paged_kv_indices[slot].long()
    group = query.shape[1] // k_cache.shape[2]
    k = k_cache[pages, t % BLOCK_SIZE].repeat_interleave(group, dim=2)              # [rows, T, Hq, D]
    v = v_cache[pages, t % BLOCK_SIZE].repeat_interleave(group, dim=2)
    scores = torch.einsum("rhd,rthd->rht", query, k) * sm_scale
    scores = scores.masked_fill((t[None, :] >= kv_len[:, None])[:, None, :], float("-inf"))
    output.copy_(torch.einsum("rht,rthd->rhd", torch.softmax(scores, -1), v))


def batch_decode_run(plan_info, query, k_cache, v_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                     output, window_left, sm_scale):
    """BatchDecodeWithPagedKVCacheRun: the CUDA-core (SIMT) decode kernel."""
    _check_plan(plan_info, 10, "DecodePlanInfo")
    rows = torch.arange(query.shape[0], device=query.device)
    _paged_decode_attention(query, k_cache, v_cache, rows, paged_kv_indptr, paged_kv_indices,
                            paged_kv_last_page_len, sm_scale, output)


def batch_prefill_paged_run(plan_info, query, k_cache, v_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                            paged_kv_last_page_len, output, mask_mode_code, window_left, sm_scale):
    """BatchPrefillWithPagedKVCacheRun: the tensor-core kernel, used for decode with qo_indptr = arange."""
    _check_plan(plan_info, 15, "PrefillPlanInfo")
    rows = torch.arange(query.shape[0], device=query.device, dtype=qo_indptr.dtype)
    row_to_req = torch.searchsorted(qo_indptr[1:].contiguous(), rows, right=True)
    _paged_decode_attention(query, k_cache, v_cache, row_to_req, paged_kv_indptr, paged_kv_indices,
                            paged_kv_last_page_len, sm_scale, output)


def batch_prefill_ragged_run(*args, **kwargs):
    raise NotImplementedError("ragged prefill is not used by this workload")


# ------------------------------------------------------------------ layers/cuda/flashinfer_planinfo.cpp
@dataclasses.dataclass
class PlanInfo:
    layer_id: int = -1
    uri: str = ""
    plan_info: list | None = None          # ffi::Array<int64_t>: host ints


@dataclasses.dataclass
class AttentionMetadata:
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    kv_seq_lens: torch.Tensor              # per-sequence lengths (torch::diff of kv_cu_seq_lens)
    slot_mapping: torch.Tensor
    plan_info: PlanInfo
    qo_indptr: torch.Tensor | None = None
    enable_cuda_graph: bool = False
    is_prefill: bool = False


def get_cache_buffer(n):
    return torch.arange(n, dtype=torch.int32)          # a CPU range buffer


def update_plan_info(plan_info, backend, attn_meta, dtype, head_dim, num_qo_heads, num_kv_heads, block_size,
                     window_size_left, enable_cuda_graph, causal, use_tensor_core):
    assert plan_info.layer_id != -1, "Need to set layer_id to PlanInfo."
    if plan_info.layer_id != 0:
        return
    assert not causal                                   # (the prefill branch is not modelled)
    batch_size = attn_meta.paged_kv_last_page_len.shape[0]
    paged_kv_indptr_host = attn_meta.paged_kv_indptr.to("cpu")
    if use_tensor_core:
        plan_info.uri = get_batch_prefill_uri(backend, dtype, head_dim)
        kv_len_arr_host = attn_meta.kv_seq_lens.to("cpu")
        plan_info.plan_info = get_function(plan_info.uri, "plan")(
            get_cache_buffer(batch_size + 1), paged_kv_indptr_host, kv_len_arr_host, batch_size, batch_size,
            num_qo_heads, num_kv_heads, block_size, enable_cuda_graph)
    else:
        plan_info.uri = get_batch_decode_uri(dtype, head_dim)
        plan_info.plan_info = get_function(plan_info.uri, "plan")(
            paged_kv_indptr_host, batch_size, num_qo_heads, num_kv_heads, block_size, enable_cuda_graph)


# ------------------------------------------------------------------ kernels/cuda/batch_decode.cpp
def batch_decode(uri, plan_info, query, k_cache, v_cache, paged_kv_indptr, paged_kv_indices,
                 paged_kv_last_page_len, window_left, sm_scale, output, use_tensor_core, qo_indptr=None):
    if use_tensor_core:
        if qo_indptr is None:
            qo_indptr = get_cache_buffer(paged_kv_last_page_len.shape[0] + 1).to(query.device)
        get_function(uri, "paged_run")(plan_info, query, k_cache, v_cache, qo_indptr, paged_kv_indptr,
                                       paged_kv_indices, paged_kv_last_page_len, output, 0, window_left, sm_scale)
    else:
        get_function(uri, "run")(plan_info, query, k_cache, v_cache, paged_kv_indptr, paged_kv_indices,
                                 paged_kv_last_page_len, output, window_left, sm_scale)


# ------------------------------------------------------------------ layers/cuda/attention.cpp
class AttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window=0):
        self.num_heads_, self.head_size_, self.scale_, self.num_kv_heads_ = num_heads, head_size, scale, num_kv_heads
        self.sliding_window_ = sliding_window - 1
        self.decode_use_tensor_core_ = should_use_tensor_core(torch.bfloat16, num_heads, num_kv_heads)

    def forward(self, attn_metadata, query, key, value, kv_cache):
        output = torch.empty_like(query).view(-1, self.num_heads_, self.head_size_)
        query = query.view(-1, self.num_heads_, self.head_size_)
        key = key.view(-1, self.num_kv_heads_, self.head_size_)
        value = value.view(-1, self.num_kv_heads_, self.head_size_)
        k_cache, v_cache = kv_cache.get_k_cache(), kv_cache.get_v_cache()
        backend = "fa2"                                 # decode is not causal
        if attn_metadata.enable_cuda_graph:
            assert attn_metadata.plan_info.plan_info is not None, "plan_info should not be null"
            # no need to update plan_info for CUDA graph
        else:
            update_plan_info(attn_metadata.plan_info, backend, attn_metadata, "bf16", self.head_size_,
                             self.num_heads_, self.num_kv_heads_, k_cache.shape[1], self.sliding_window_,
                             attn_metadata.enable_cuda_graph, False, self.decode_use_tensor_core_)
        # reshape_paged_cache: the new token's key/value into its slot
        slots = attn_metadata.slot_mapping.long()
        k_cache.view(-1, self.num_kv_heads_, self.head_size_)[slots] = key
        v_cache.view(-1, self.num_kv_heads_, self.head_size_)[slots] = value
        batch_decode(attn_metadata.plan_info.uri, attn_metadata.plan_info.plan_info, query, k_cache, v_cache,
                     attn_metadata.paged_kv_indptr, attn_metadata.paged_kv_indices,
                     attn_metadata.paged_kv_last_page_len, self.sliding_window_, self.scale_, output,
                     use_tensor_core=self.decode_use_tensor_core_, qo_indptr=attn_metadata.qo_indptr)
        return output.view(-1, self.num_heads_ * self.head_size_)


# ------------------------------------------------------------------ the model (llm_model_base.h)
@dataclasses.dataclass
class ModelArgs:
    n_heads: int = N_HEADS
    n_kv_heads: int = N_KV_HEADS
    head_dim: int = HEAD_DIM
    dtype: str = "bfloat16"
    sliding_window: int = 0


@dataclasses.dataclass
class ModelInputParams:
    num_sequences: int
    kv_seq_lens: torch.Tensor              # cumulative
    new_cache_slots: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    attn_metadata: AttentionMetadata | None = None


def build_attention_metadata(params):
    """AttentionMetadataBuilder::build (decode)."""
    return AttentionMetadata(params.paged_kv_indptr, params.paged_kv_indices, params.paged_kv_last_page_len,
                             torch.diff(params.kv_seq_lens), params.new_cache_slots, PlanInfo())


class CausalLM:
    def __init__(self, args, device):
        gen = generator(880)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        kv = N_KV_HEADS * HEAD_DIM
        self.layers = [dict(wq=randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4),
                            wk=randn(HIDDEN, kv, gen=gen, device=device, scale=0.4),
                            wv=randn(HIDDEN, kv, gen=gen, device=device, scale=0.4),
                            wo=randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4),
                            w_mlp=randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4),
                            attn=AttentionImpl(args.n_heads, args.head_dim, args.head_dim ** -0.5, args.n_kv_heads,
                                               args.sliding_window))
                       for _ in range(N_LAYERS)]

    def forward(self, tokens, positions, kv_caches, input_params):
        h = self.embed_tokens[tokens.long()]
        attn_metadata = input_params.attn_metadata or build_attention_metadata(input_params)
        for i, layer in enumerate(self.layers):
            attn_metadata.plan_info.layer_id = i
            a = layer["attn"].forward(attn_metadata, h @ layer["wq"], h @ layer["wk"], h @ layer["wv"], kv_caches[i])
            h = h + a @ layer["wo"]
            h = h + torch.tanh(h @ layer["w_mlp"])
        return h


# ------------------------------------------------------------------ runtime/cuda_graph_executor_impl.cpp
class CudaGraphPersistentParam:
    def __init__(self, args, device, variant):
        self.args_, self.device_, self.variant = args, device, variant
        i32 = dict(dtype=torch.int32, device=device)
        self.persistent_tokens_ = torch.zeros(MAX_SEQS, **i32)
        self.persistent_positions_ = torch.zeros(MAX_SEQS, **i32)
        self.persistent_new_cache_slots_ = torch.zeros(MAX_SEQS, **i32)
        self.kv_seq_lens_ = torch.zeros(MAX_SEQS + 1, **i32)
        self.persistent_paged_kv_indptr_ = torch.zeros(MAX_SEQS + 1, **i32)
        self.persistent_paged_kv_indices_ = torch.zeros(MAX_SEQS * MAX_BLOCKS_PER_SEQ, **i32)
        self.persistent_paged_kv_last_page_len_ = torch.zeros(MAX_SEQS, **i32)
        self.persistent_decode_qo_indptr_ = torch.arange(MAX_SEQS + 1, **i32)
        self.hidden_states_ = torch.zeros(MAX_SEQS, HIDDEN, device=device)
        self.plan_info = PlanInfo()

    def static_buffers(self):
        return {"persistent_tokens": self.persistent_tokens_, "persistent_positions": self.persistent_positions_,
                "persistent_new_cache_slots": self.persistent_new_cache_slots_, "kv_seq_lens": self.kv_seq_lens_,
                "persistent_paged_kv_indptr": self.persistent_paged_kv_indptr_,
                "persistent_paged_kv_indices": self.persistent_paged_kv_indices_,
                "persistent_paged_kv_last_page_len": self.persistent_paged_kv_last_page_len_}

    def update(self, tokens, kv_cache, positions, params, padded_num_tokens, return_capture_params):
        attn_metadata = build_attention_metadata(params)
        attn_metadata.enable_cuda_graph = True
        attn_metadata.plan_info = self.plan_info
        n, bs = tokens.shape[0], params.num_sequences
        self.persistent_tokens_[:n].copy_(tokens)
        self.persistent_positions_[:n].copy_(positions)
        self.kv_seq_lens_[:bs + 1].copy_(params.kv_seq_lens)
        self.persistent_new_cache_slots_[:n].copy_(params.new_cache_slots)
        self.persistent_paged_kv_indptr_[:bs + 1].copy_(params.paged_kv_indptr)
        n_indices = params.paged_kv_indices.shape[0]
        self.persistent_paged_kv_indices_[:n_indices].copy_(params.paged_kv_indices)
        self.persistent_paged_kv_last_page_len_[:bs].copy_(params.paged_kv_last_page_len)
        attn_metadata.kv_seq_lens = torch.diff(self.kv_seq_lens_[:bs + 1])
        attn_metadata.slot_mapping = self.persistent_new_cache_slots_[:n]
        attn_metadata.paged_kv_indptr = self.persistent_paged_kv_indptr_[:bs + 1]
        attn_metadata.paged_kv_indices = self.persistent_paged_kv_indices_        # (whole: see Modelled)
        attn_metadata.paged_kv_last_page_len = self.persistent_paged_kv_last_page_len_[:bs]
        attn_metadata.qo_indptr = self.persistent_decode_qo_indptr_[:bs + 1]

        n_heads = self.args_.n_heads
        n_kv_heads = self.args_.n_kv_heads or n_heads
        dtype = kv_cache.dtype                            # k_cache.scalar_type()
        attn_metadata.plan_info.layer_id = 0             # plan_info is only updated at layer 0
        if self.variant == "bug":
            use_tensor_core = True                       # "let use_tensor_core=true temporarily"
        else:
            assert dtype == torch.bfloat16, "only support bf16 kvcache for now"
            use_tensor_core = should_use_tensor_core(dtype, n_heads, n_kv_heads)
        update_plan_info(attn_metadata.plan_info, "fa2", attn_metadata, "bf16", self.args_.head_dim, n_heads,
                         n_kv_heads, BLOCK_SIZE, self.args_.sliding_window - 1, True, False, use_tensor_core)
        if return_capture_params:
            return dataclasses.replace(params, attn_metadata=attn_metadata)
        return None


class CudaGraph:
    def __init__(self, persistent_param, device):
        self.persistent_param_, self.device = persistent_param, device

    def capture(self, model, tokens, positions, params, kv_cache, bucket_num_tokens, pool):
        self.padded_num_tokens_ = bucket_num_tokens
        p = self.persistent_param_
        graph_params = p.update(tokens, kv_cache[0], positions, params, bucket_num_tokens, True)

        def forward():
            h = model.forward(p.persistent_tokens_[:bucket_num_tokens], p.persistent_positions_[:bucket_num_tokens],
                              kv_cache, graph_params)
            p.hidden_states_[:bucket_num_tokens].copy_(h)        # set_hidden_states
            return p.hidden_states_[:bucket_num_tokens]

        self.graph_, self.out_ = capture(
            forward, device=self.device, pool=pool, warmups=0, name=f"decode bucket {bucket_num_tokens}",
            owner="CudaGraphExecutorImpl (decode graphs)", static=p.static_buffers(),
            state={f"kv_cache[{i}].{kv}": t for i, c in enumerate(kv_cache)
                   for kv, t in (("k", c.get_k_cache()), ("v", c.get_v_cache()))})
        return replay(self.graph_, self.out_)                    # "test replay to verify graph capture"

    def replay(self, tokens, positions, kv_cache, params):
        self.persistent_param_.update(tokens, kv_cache[0], positions, params, self.padded_num_tokens_, False)
        return replay(self.graph_, self.out_)[:tokens.shape[0]]


class CudaGraphExecutorImpl:
    def __init__(self, model, args, device, variant):
        self.model_, self.device = model, device
        self.persistent_param_ = CudaGraphPersistentParam(args, device, variant)
        self.graphs_ = {}
        self.graph_pool_ = graph_pool_handle(device)

    @staticmethod
    def get_bucket_num_tokens(n):
        return 1 if n <= 1 else 2 if n <= 2 else 4

    def run(self, tokens, positions, kv_caches, params):
        bucket = self.get_bucket_num_tokens(tokens.shape[0])
        if bucket in self.graphs_:
            return self.graphs_[bucket].replay(tokens, positions, kv_caches, params)
        g = CudaGraph(self.persistent_param_, self.device)
        out = g.capture(self.model_, tokens, positions, params, kv_caches, bucket, self.graph_pool_)
        self.graphs_[bucket] = g
        return out[:tokens.shape[0]]


# ------------------------------------------------------------------ the workload
class KVCache:
    """One layer's paged caches; ``dtype`` is the KV-cache dtype label (``k_cache.scalar_type()`` upstream)."""

    def __init__(self, k_cache, v_cache, dtype=torch.bfloat16):
        self.k_cache, self.v_cache, self.dtype = k_cache, v_cache, dtype

    def get_k_cache(self):
        return self.k_cache

    def get_v_cache(self):
        return self.v_cache


def make_kv_caches(device):
    """Every layer's caches, holding the prompts' keys and values as the eager prefill left them."""
    gen = generator(8800)
    shape = (NUM_BLOCKS, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM)
    return [KVCache(randn(*shape, gen=gen, device=device), randn(*shape, gen=gen, device=device))
            for _ in range(N_LAYERS)]


def decode_params(seqs, lengths, device):
    """One decode step's inputs for sequences ``seqs`` (each writes its token at position ``lengths[s]``)."""
    indptr, indices, last, kv_cu, slots = [0], [], [], [0], []
    for s in seqs:
        L = lengths[s] + 1
        blocks = [1 + s * MAX_BLOCKS_PER_SEQ + b for b in range((L + BLOCK_SIZE - 1) // BLOCK_SIZE)]
        indices += blocks
        indptr.append(len(indices))
        last.append(L - (len(blocks) - 1) * BLOCK_SIZE)
        kv_cu.append(kv_cu[-1] + L)
        pos = lengths[s]
        slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32).to(device)  # noqa: E731
    return ModelInputParams(len(seqs), i32(kv_cu), i32(slots), i32(indptr), i32(indices), i32(last))


def run(variant: str, device: str = "cpu"):
    args = ModelArgs()
    gen = generator(88)
    prompt_lens = [3, 4, 2, 5]
    schedule = [[0, 1], [0, 1], [0, 1], [0, 1, 2, 3], [0, 1, 2, 3], [2, 3], [1]]
    steps, lengths = [], list(prompt_lens)
    for seqs in schedule:
        tokens = torch.randint(0, VOCAB, (len(seqs),), generator=gen, dtype=torch.int32)
        positions = torch.tensor([lengths[s] for s in seqs], dtype=torch.int32)
        steps.append((tokens, positions, seqs, list(lengths)))
        for s in seqs:
            lengths[s] += 1

    def serve(use_graph):
        model = CausalLM(args, device)
        kv_caches = make_kv_caches(device)
        executor = CudaGraphExecutorImpl(model, args, device, variant) if use_graph else None
        outs = []
        for tokens, positions, seqs, lens in steps:
            tokens, positions = tokens.to(device), positions.to(device)
            params = decode_params(seqs, lens, device)
            if executor is None:
                outs.append(model.forward(tokens, positions, kv_caches, params).clone())
            else:
                outs.append(executor.run(tokens, positions, kv_caches, params).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
