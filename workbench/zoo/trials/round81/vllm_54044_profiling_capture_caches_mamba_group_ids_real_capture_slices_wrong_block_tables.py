"""The CUDA-graph memory profiling capture caches the Mamba group layout of its minimal KV cache config; profiling teardown drops the align context but keeps that cache, so the real capture slices the real block tables with the profiling group ids and fails.

Upstream: https://github.com/vllm-project/vllm/pull/54044 ("[Bugfix] Reset cached Mamba align metadata on profiling
teardown", vllm-project/vllm, opened 2026-08-27 by gcanlin, merged late August 2026 as commit b383e1639; it
changes ``vllm/v1/worker/gpu/cudagraph_utils.py`` (+8) and adds
``test_teardown_profiling_state_clears_mamba_align_metadata`` to
``tests/v1/worker/test_gpu_model_runner_v2_cudagraph_profiling.py``).
Symptom: hybrid Mamba/attention models on the V2 model runner (MRV2) with ``mamba_cache_mode="align"``
(prefix caching) and CUDA graphs fail at engine start-up, while capturing CUDA graphs. The PR's report is Kimi-K3 with
TP8 x PP4 on B200: ``capture`` -> ``create_forward_fn(desc, warmup=True)`` -> ``prepare_inputs_to_capture`` ->
``MambaHybridModelState.prepare_attn`` -> ``_ensure_align_ctx`` ->
``MambaSpecDecodeGPUContext.initialize_from_forward_context`` -> ``_populate_metadata``:
``AssertionError: expected 3 block tables, got 4``, then ``RuntimeError: Worker failed with error 'expected 3 block
tables, got 4'``. With ``enforce_eager`` (no graphs) the engine starts and serves.
Mechanism: ``Worker.determine_available_memory`` calls ``profile_cudagraph_memory``
(``vllm/v1/worker/gpu/cudagraph_utils.py``) before the real KV cache exists. ``_init_minimal_kv_cache_for_profiling``
builds a throwaway ``KVCacheConfig`` from this worker's own layers (``get_kv_cache_groups(runner.vllm_config,
runner.get_kv_cache_spec())``). ``runner.capture_model(profile_only=True)`` then captures throwaway graphs, and
``_teardown_profiling_state`` releases everything. The real config comes later from the engine core:
``get_kv_cache_configs`` groups the layers of the *whole* model (all PP stages merged) and projects those global
groups onto each worker (``_project_kv_cache_groups_to_worker``). Under PP the two group layouts differ. In the model
here, PP stage 0 owns 4 KDA layers and 1 MLA layer, so its own grouping is
``[KDA, KDA, KDA, KDA, MLA]`` with Mamba group ids ``[0, 1, 2, 3]``. The whole model has 7 KDA and 3 MLA layers,
so the projected real grouping is ``[KDA, KDA, KDA, MLA]`` with Mamba group ids ``[0, 1, 2]``.
``MambaHybridModelState._get_mamba_group_info`` (``vllm/v1/worker/gpu/model_states/mamba_hybrid.py``) caches
``_mamba_group_ids`` and ``_mamba_spec`` under ``if self._mamba_spec is None:`` from whatever config it first sees.
Since #52388, ``prepare_attn`` calls it (and ``_ensure_align_ctx``) during capture too, so the first caller is the
profiling capture. ``_teardown_profiling_state`` reset ``model_state._mamba_ctx = None`` but not the group cache.
In the real capture, ``_ensure_align_ctx`` builds a new ``MambaSpecDecodeGPUContext`` from the real config
(``num_groups`` = 3), then passes ``[block_tables[gid] for gid in mamba_group_ids]`` with the cached profiling ids,
which is four tables, the last being the MLA group's. ``_populate_metadata`` asserts
``len(block_tables) == self.num_groups``. Eagerly (``cudagraph_mode=NONE``) ``profile_cudagraph_memory`` returns 0
at once, no profiling config is ever built, and the first ``_get_mamba_group_info`` sees the real config.
(A downstream patch script for the 2026-08-28 nightly, K3 with DCP8 and PP, logged the layouts and reported that no
worker saw two of them, blaming the context's list instead. The merged fix, its test and its comment follow the
stale-cache reading, which is what is modelled here.)
Doctor: warmup-divergence, at _teardown_profiling_state. The profiling capture (a capture-time run on throwaway
state) made a lazy decision, the Mamba group layout, that outlives the teardown and that the real capture then
reuses. An engine that never profiles decides from the real config instead. The site is the teardown, because the
teardown is responsible for leaving the runner "from a clean slate" for the real ``initialize_kv_cache``, and it is
the function the fix changed. ``_get_mamba_group_info``'s unkeyed cache is the latent weakness; later main keys it
on the config object.
Fix (upstream): ``_teardown_profiling_state`` also does ``if hasattr(runner.model_state, "_mamba_group_ids"):
runner.model_state._mamba_group_ids = []`` and ``if hasattr(runner.model_state, "_mamba_spec"):
runner.model_state._mamba_spec = None`` (the PR's comment: "the real (e.g. PP-projected) config may place Mamba
layers into a different group layout, so it must be re-derived from the real config"). Later main replaced the
unkeyed cache with ``if info.group_kv_cache_config is not kv_cache_config:``. (Read: the PR description, the fixed
``_teardown_profiling_state`` and ``profile_cudagraph_memory`` in a stored ``cudagraph_utils.py``, the pre-fix
teardown (``_mamba_ctx`` reset only), the pre-fix ``mamba_hybrid.py`` (``_get_mamba_group_info``,
``_ensure_align_ctx``, ``preprocess_state``) and its #52388 ``prepare_attn`` hook, as quoted by downstream patch
scripts for the 2026-08-28 nightly, ``MambaSpecDecodeGPUContext`` in ``vllm/v1/worker/mamba_utils.py``, and
``_get_kv_cache_groups_uniform_page_size`` / ``_project_kv_cache_groups_to_worker`` in
``vllm/v1/core/kv_cache_utils.py``.)
Modelled: a 10-layer Kimi-Linear-like model (KDA linear attention, with MLA full attention at layers 3, 7 and 9),
PP = 2. Only PP stage 0 (layers 0-4) is run. The stage-1 worker contributes only its ``get_kv_cache_spec()`` reply to
the engine core's grouping. A layer split and MLA placement were chosen so that the two layouts give the upstream
error text exactly. The grouping code is upstream's (type buckets, group size from the minimum layer count, strided
split), without spec unification or page-size padding. Each layer gets its own KV tensor (upstream shares tensors
across groups), and KV memory is counted in blocks of one page. KDA is reduced to a diagonal gated recurrence on one
temporal state per block (no conv state, no heads). MLA is a latent cache with single-head NoPE decode attention over
the paged latents. No MLPs. Decode only (one token per request), FULL_DECODE_ONLY graphs at 1, 2 and 4 requests,
``max_num_seqs`` = 4, block size 4 for every group, no speculative decoding (so no align postprocess copy).
Prompts are prefilled before the served steps. That prefill is not modelled: its results (each KDA layer's
recurrent state in the block of the last prompt token, the MLA latents of the prompt) are written into the caches
when the request is added, identically in both runs. Token streams are given (stage 0 does not sample). The output
is stage 0's hidden states for each step (the intermediate tensors sent to stage 1). The align pre-copy (block
boundary migration) and aligned-state-index kernels are torch versions of the Triton kernels. The context keeps
the block tables it was given and reads them as ``data_ptr`` + stride would (any row of the persistent buffer).
The memory estimate is a stand-in (a fixed size per captured graph). The scheduler is a stand-in that allocates one
block per 4-token column, in every group.
"""
import contextlib
import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/54044"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_teardown_profiling_state"
SYMPTOM = ("MRV2 hybrid Mamba model (align prefix caching, PP) fails at start-up capturing CUDA graphs: the "
           "profiling capture cached the Mamba group ids of its own KV cache config, teardown kept them, and the "
           "real capture asserts 'expected 3 block tables, got 4'")

PAD_SLOT_ID = -1
VOCAB, HIDDEN, STATE_DIM, KV_LORA_RANK = 32, 8, 8, 4
BLOCK_SIZE = 4                                  # tokens per block, every group (align mode: mamba == attention)
MAX_MODEL_LEN = 16
MAX_NUM_REQS = 4                                # max_num_seqs
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
NUM_HIDDEN_LAYERS = 10
FULL_ATTN_LAYERS = (3, 7, 9)                    # MLA layers; every other layer is KDA
PP_LAYER_PARTITION = (range(0, 5), range(5, 10))
PAGE_SIZE_BYTES = 64                            # one block of one layer (uniform page size)
KV_CACHE_MEMORY_BYTES = 64 * PAGE_SIZE_BYTES * 5   # what each worker may give the KV cache, before graphs
GRAPH_MEMORY_BYTES = 96                         # stand-in for one FULL graph's measured memory


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


# --- vllm/config ----------------------------------------------------------------------------------------------

class CUDAGraphMode:
    NONE, FULL = "NONE", "FULL"


@dataclass
class CacheConfig:
    block_size: int = BLOCK_SIZE
    mamba_cache_mode: str = "align"
    num_gpu_blocks_override: int | None = None
    num_gpu_blocks: int | None = None


@dataclass
class CompilationConfig:
    cudagraph_mode: str
    cudagraph_capture_sizes: list[int] = field(default_factory=lambda: list(CUDAGRAPH_CAPTURE_SIZES))
    static_forward_context: dict[str, Any] = field(default_factory=dict)

    @property
    def max_cudagraph_capture_size(self) -> int:
        return max(self.cudagraph_capture_sizes)


@dataclass
class VllmConfig:
    cache_config: CacheConfig
    compilation_config: CompilationConfig
    max_num_seqs: int = MAX_NUM_REQS
    max_model_len: int = MAX_MODEL_LEN
    num_speculative_tokens: int = 0


# --- vllm/forward_context.py, vllm/sequence.py ----------------------------------------------------------------

@dataclass
class ForwardContext:
    attn_metadata: dict[str, Any] | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = prev


class IntermediateTensors:
    """What a non-last PP rank hands to the next one."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.tensors[key]
        return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})

    @staticmethod
    def empty_like(other: "IntermediateTensors") -> "IntermediateTensors":
        return IntermediateTensors({k: torch.empty_like(v) for k, v in other.tensors.items()})


# --- vllm/v1/kv_cache_interface.py ----------------------------------------------------------------------------

@dataclass(frozen=True)
class MLAAttentionSpec:
    block_size: int
    head_size: int

    @property
    def page_size_bytes(self) -> int:
        return PAGE_SIZE_BYTES

    def merge(self, specs):
        assert all(s == self for s in specs)
        return self


@dataclass(frozen=True)
class MambaSpec:
    block_size: int
    shapes: tuple
    mamba_type: str = "kda"
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0

    @property
    def page_size_bytes(self) -> int:
        return PAGE_SIZE_BYTES

    def merge(self, specs):
        assert all(s == self for s in specs)
        return self


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]


# --- vllm/v1/core/kv_cache_utils.py ---------------------------------------------------------------------------

def _get_kv_cache_groups_uniform_page_size(kv_cache_spec: dict[str, Any]) -> list[KVCacheGroupSpec]:
    """Bucket the layers by spec, then split every bucket into groups of ``group_size`` layers, strided
    (``layers[i::num_groups]``) so that PP stages share the groups evenly."""
    same_type_layers: dict[Any, list[str]] = defaultdict(list)
    for layer_name, layer_spec in kv_cache_spec.items():
        same_type_layers[layer_spec].append(layer_name)
    layer_buckets = list(same_type_layers.values())
    min_num_layers = min(len(layers) for layers in layer_buckets)
    group_size = min_num_layers
    max_num_layers = max(len(layers) for layers in layer_buckets)
    if max_num_layers < min_num_layers * 1.5:
        group_size = max_num_layers
    grouped_layers = []
    for layers in layer_buckets:
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            grouped_layers.append(layers[i::num_groups])
    return [KVCacheGroupSpec(names, kv_cache_spec[names[0]].merge([kv_cache_spec[n] for n in names]))
            for names in grouped_layers]


def get_kv_cache_groups(vllm_config: VllmConfig, kv_cache_spec: dict[str, Any]) -> list[KVCacheGroupSpec]:
    return _get_kv_cache_groups_uniform_page_size(kv_cache_spec)


def get_kv_cache_config_from_groups(vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec],
                                    available_memory: int) -> KVCacheConfig:
    group_size = max(len(g.layer_names) for g in kv_cache_groups)
    num_blocks = available_memory // (PAGE_SIZE_BYTES * group_size)
    if vllm_config.cache_config.num_gpu_blocks_override is not None:
        num_blocks = vllm_config.cache_config.num_gpu_blocks_override
    return KVCacheConfig(num_blocks, kv_cache_groups)


def _project_kv_cache_groups_to_worker(global_kv_cache_groups, worker_spec) -> list[KVCacheGroupSpec]:
    """Keep each global group (so every worker has the same group ids), with only this worker's layers."""
    return [KVCacheGroupSpec([n for n in group.layer_names if n in worker_spec], group.kv_cache_spec)
            for group in global_kv_cache_groups]


def get_kv_cache_configs(vllm_config: VllmConfig, kv_cache_specs: list[dict[str, Any]],
                         available_memory: list[int]) -> list[KVCacheConfig]:
    merged_kv_cache_specs: dict[str, Any] = {}
    for kv_cache_spec_one_worker in kv_cache_specs:
        for layer_name, layer_spec in kv_cache_spec_one_worker.items():
            merged_kv_cache_specs.setdefault(layer_name, layer_spec)
    global_kv_cache_groups = get_kv_cache_groups(vllm_config, merged_kv_cache_specs)
    configs = [get_kv_cache_config_from_groups(vllm_config,
                                               _project_kv_cache_groups_to_worker(global_kv_cache_groups, spec),
                                               memory)
               for spec, memory in zip(kv_cache_specs, available_memory)]
    num_blocks = min(c.num_blocks for c in configs)
    return [dataclasses.replace(c, num_blocks=num_blocks) for c in configs]


# --- the model: Kimi-Linear-like, KDA + MLA (vllm/model_executor/models/kimi_linear.py) -------------------------

def get_temporal_copy_spec(state, block_ids, cur_block_idx, num_accepted_tokens):
    """The state-copy function of the temporal (recurrent) state: a whole-block copy."""
    return state[block_ids[cur_block_idx]]


class KimiDeltaAttention:
    """The KDA mixer: a gated recurrence on one temporal state per request, kept in the block the aligned
    state index names."""

    def __init__(self, prefix: str, gen, device):
        self.prefix = prefix
        self.kv_cache: list[torch.Tensor] = []
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.q_proj = randn(HIDDEN, STATE_DIM, gen=gen, device=device, scale=0.4)
        self.k_proj = randn(HIDDEN, STATE_DIM, gen=gen, device=device, scale=0.4)
        self.v_proj = randn(HIDDEN, STATE_DIM, gen=gen, device=device, scale=0.4)
        self.f_proj = randn(HIDDEN, STATE_DIM, gen=gen, device=device, scale=0.4)
        self.o_proj = randn(STATE_DIM, HIDDEN, gen=gen, device=device, scale=0.4)

    def get_kv_cache_spec(self, vllm_config) -> MambaSpec:
        return MambaSpec(block_size=vllm_config.cache_config.block_size, shapes=((STATE_DIM,),),
                         mamba_cache_mode=vllm_config.cache_config.mamba_cache_mode)

    def __call__(self, hidden_states):
        attn_metadata = get_forward_context().attn_metadata[self.prefix]
        (recurrent_state,) = self.kv_cache                    # [num_blocks, STATE_DIM]
        state_indices = attn_metadata.state_indices_tensor.long()
        h = rms_norm(hidden_states, self.norm)
        q, k, v = torch.tanh(h @ self.q_proj), h @ self.k_proj, torch.tanh(h @ self.v_proj)
        decay = torch.sigmoid(h @ self.f_proj)
        state = recurrent_state[state_indices]
        new_state = decay * state + k * v
        recurrent_state[state_indices] = new_state
        return (q * new_state) @ self.o_proj


class MLAAttention:
    """The MLA mixer: writes this token's latent into the paged cache, then attends over the sequence's
    latents (NoPE, one head)."""

    def __init__(self, prefix: str, gen, device):
        self.prefix = prefix
        self.kv_cache: list[torch.Tensor] = []
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.kv_a_proj = randn(HIDDEN, KV_LORA_RANK, gen=gen, device=device, scale=0.5)
        self.q_proj = randn(HIDDEN, KV_LORA_RANK, gen=gen, device=device, scale=0.5)
        self.o_proj = randn(KV_LORA_RANK, HIDDEN, gen=gen, device=device, scale=0.5)

    def get_kv_cache_spec(self, vllm_config) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, head_size=KV_LORA_RANK)

    def __call__(self, hidden_states):
        md = get_forward_context().attn_metadata[self.prefix]
        (kv_c_cache,) = self.kv_cache                         # [num_blocks, BLOCK_SIZE, KV_LORA_RANK]
        h = rms_norm(hidden_states, self.norm)
        kv_c, q = h @ self.kv_a_proj, h @ self.q_proj
        # concat_and_cache_mla: rows whose slot is PAD_SLOT_ID store nothing
        slot_mapping = md.slot_mapping.long()
        flat = kv_c_cache.view(-1, KV_LORA_RANK)
        slots = slot_mapping.clamp(min=0)
        flat[slots] = torch.where((slot_mapping >= 0)[:, None], kv_c, flat[slots])
        # decode attention over the request's blocks
        kv = kv_c_cache[md.block_table.long()].flatten(1, 2)   # [num_reqs, max_blocks * BLOCK_SIZE, L]
        pos = torch.arange(kv.shape[1], device=kv.device)
        scores = (kv @ q.unsqueeze(-1)).squeeze(-1) * KV_LORA_RANK ** -0.5
        scores = scores.masked_fill(pos[None, :] >= md.seq_lens.long()[:, None], -1e9)
        out = (torch.softmax(scores, dim=-1).unsqueeze(-1) * kv).sum(1)
        return out @ self.o_proj


class KimiLinearForCausalLM:
    """PP stage 0 of the model: the embedding and layers 0-4."""

    def __init__(self, vllm_config: VllmConfig, layer_ids, device):
        gen = generator(54044)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = {}
        for i in range(NUM_HIDDEN_LAYERS):
            cls = MLAAttention if i in FULL_ATTN_LAYERS else KimiDeltaAttention
            layer = cls(f"model.layers.{i}.self_attn", gen, device)        # every rank draws the same weights
            if i in layer_ids:
                self.layers[layer.prefix] = layer
                vllm_config.compilation_config.static_forward_context[layer.prefix] = layer

    def get_mamba_state_copy_func(self):
        return (get_temporal_copy_spec,)

    def __call__(self, input_ids, positions):
        hidden_states = self.embed_tokens[input_ids]
        for layer in self.layers.values():
            hidden_states = hidden_states + layer(hidden_states)
        return IntermediateTensors({"hidden_states": hidden_states})


def kv_cache_spec_of(vllm_config: VllmConfig, layer_ids) -> dict[str, Any]:
    """``get_kv_cache_spec()`` of the worker that owns ``layer_ids`` (what PP stage 1 reports)."""
    return {f"model.layers.{i}.self_attn":
            (MLAAttentionSpec(vllm_config.cache_config.block_size, KV_LORA_RANK) if i in FULL_ATTN_LAYERS else
             MambaSpec(vllm_config.cache_config.block_size, ((STATE_DIM,),),
                       mamba_cache_mode=vllm_config.cache_config.mamba_cache_mode))
            for i in layer_ids}


# --- vllm/v1/attention/backends: metadata builders -------------------------------------------------------------

@dataclass
class CommonAttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    seq_lens: torch.Tensor
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class KDAAttentionMetadata:
    num_decodes: int
    state_indices_tensor: torch.Tensor


class KDAAttentionMetadataBuilder:
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec, self.layer_names = kv_cache_spec, layer_names
        # Align mode: prepare_attn hands every builder its group's aligned state indices (#52388).
        self.mamba_aligned_state_indices: torch.Tensor | None = None
        self.state_indices_tensor = torch.zeros(vllm_config.max_num_seqs, dtype=torch.int32, device=device)

    def build(self, common: CommonAttentionMetadata) -> KDAAttentionMetadata:
        assert self.mamba_aligned_state_indices is not None, "Aligned Mamba state indices must be precomputed"
        n = common.num_reqs
        self.state_indices_tensor[:n].copy_(self.mamba_aligned_state_indices[:n, 0])
        return KDAAttentionMetadata(num_decodes=n, state_indices_tensor=self.state_indices_tensor[:n])


@dataclass
class MLACommonMetadata:
    num_reqs: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class FlashMLAMetadataBuilder:
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec, self.layer_names = kv_cache_spec, layer_names

    def build(self, common: CommonAttentionMetadata) -> MLACommonMetadata:
        return MLACommonMetadata(common.num_reqs, common.seq_lens, common.block_table_tensor,
                                 common.slot_mapping)


@dataclass
class AttentionGroup:
    layer_names: list[str]
    metadata_builders: list[Any]

    def get_metadata_builder(self, ubatch_id: int = 0):
        return self.metadata_builders[ubatch_id]


def init_attn_backend(kv_cache_config: KVCacheConfig, vllm_config, device) -> list[list[AttentionGroup]]:
    attn_groups = []
    for group in kv_cache_config.kv_cache_groups:
        cls = KDAAttentionMetadataBuilder if isinstance(group.kv_cache_spec, MambaSpec) else FlashMLAMetadataBuilder
        builder = cls(group.kv_cache_spec, group.layer_names, vllm_config, device)
        attn_groups.append([AttentionGroup(list(group.layer_names), [builder])])
    return attn_groups


# --- vllm/v1/worker/gpu/attn_utils.py -------------------------------------------------------------------------

def build_attn_metadata(*, attn_groups, num_reqs, num_tokens, seq_lens, block_tables, slot_mappings,
                        kv_cache_config, model_specific_attn_metadata=None, for_cudagraph_capture=False):
    attn_metadata: dict[str, Any] = {}
    for group_id in range(len(kv_cache_config.kv_cache_groups)):
        common = CommonAttentionMetadata(num_reqs, num_tokens, seq_lens[:num_reqs],
                                         block_tables[group_id][:num_reqs], slot_mappings[group_id][:num_tokens])
        for attn_group in attn_groups[group_id]:
            metadata = attn_group.get_metadata_builder(0).build(common)
            for layer_name in attn_group.layer_names:
                attn_metadata[layer_name] = metadata
    return attn_metadata


# --- vllm/v1/worker/mamba_utils.py ----------------------------------------------------------------------------

def get_mamba_groups(kv_cache_config: KVCacheConfig) -> tuple[list[int], MambaSpec]:
    mamba_group_ids, mamba_specs = [], []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            mamba_group_ids.append(i)
            mamba_specs.append(group.kv_cache_spec)
    assert mamba_group_ids, "no mamba layers in the model"
    assert all(mamba_specs[0] == s for s in mamba_specs)
    return mamba_group_ids, mamba_specs[0]


def _rows_at(block_table_ptr: torch.Tensor, num_rows: int) -> torch.Tensor:
    """What a kernel given ``data_ptr()`` and ``stride(0)`` reads: any row of the persistent table."""
    return block_table_ptr.as_strided((num_rows, block_table_ptr.shape[1]), block_table_ptr.stride(),
                                      block_table_ptr.storage_offset())


@dataclass
class MambaSpecDecodeGPUContext:
    """Per-state and per-group metadata recorded once, for the fused align kernels (pre-copy, aligned state
    indices): the state tensors, which group each belongs to, and each group's block table."""

    states: list[torch.Tensor]
    state_group_indices: list[int]
    block_size: int
    num_layers: int
    num_state_types: int
    total_states: int
    mamba_group_ids: list[int]
    num_groups: int
    aligned_state_indices: torch.Tensor          # [num_groups, max_num_reqs, 1 + num_speculative_blocks]
    block_table_ptrs: list[torch.Tensor | None]
    block_table_stride_req: int = 0
    is_initialized: bool = False

    @classmethod
    def create(cls, max_num_reqs, kv_cache_config, num_state_types, device, make_buffer=None):
        mamba_group_ids, mamba_spec = get_mamba_groups(kv_cache_config)
        num_layers = sum(len(kv_cache_config.kv_cache_groups[gid].layer_names) for gid in mamba_group_ids)
        return cls(states=[], state_group_indices=[], block_size=mamba_spec.block_size, num_layers=num_layers,
                   num_state_types=num_state_types, total_states=num_layers * num_state_types,
                   mamba_group_ids=mamba_group_ids, num_groups=len(mamba_group_ids),
                   aligned_state_indices=torch.zeros(len(mamba_group_ids), max_num_reqs,
                                                     1 + mamba_spec.num_speculative_blocks,
                                                     dtype=torch.int32, device=device),
                   block_table_ptrs=[None] * len(mamba_group_ids))

    def initialize_from_forward_context(self, kv_cache_config, forward_context, mamba_state_copy_funcs,
                                        block_tables: list[torch.Tensor]) -> None:
        if self.is_initialized:
            return
        self._populate_metadata(kv_cache_config, forward_context, mamba_state_copy_funcs, block_tables)

    def _populate_metadata(self, kv_cache_config, forward_context, mamba_state_copy_funcs, block_tables) -> None:
        idx = 0
        for group_local_idx, mamba_group_id in enumerate(self.mamba_group_ids):
            for layer_name in kv_cache_config.kv_cache_groups[mamba_group_id].layer_names:
                kv_caches = forward_context[layer_name].kv_cache
                for state, _copy_func in zip(kv_caches, mamba_state_copy_funcs):
                    self.states.append(state)                     # state_base_addrs[idx] = state.data_ptr()
                    self.state_group_indices.append(group_local_idx)
                    idx += 1
        assert idx == self.total_states, f"populated {idx} Mamba state records, expected {self.total_states}"
        assert len(block_tables) == self.num_groups, (
            f"expected {self.num_groups} block tables, got {len(block_tables)}")
        strides = {bt.stride(0) for bt in block_tables}
        assert len(strides) == 1, f"all mamba block tables must share stride(0), got {strides}"
        self.block_table_stride_req = int(next(iter(strides)))
        for i, bt in enumerate(block_tables):
            self.block_table_ptrs[i] = bt                         # block_table_ptrs[i] = bt.data_ptr()
        self.is_initialized = True

    def compute_aligned_state_indices(self, seq_lens: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """Every Mamba group's physical block for the running state, ``table[(seq_len - 1) // block_size]``
        (``get_aligned_state_indices_multi_group_kernel``)."""
        assert self.is_initialized
        cols = ((seq_lens[:num_reqs].long() - 1) // self.block_size).clamp(min=0)
        for i, ptr in enumerate(self.block_table_ptrs):
            table = _rows_at(ptr, num_reqs)
            self.aligned_state_indices[i, :num_reqs, 0] = table.gather(1, cols[:, None]).squeeze(1)
        return self.aligned_state_indices[:, :num_reqs]

    def run_fused_precopy(self, num_reqs, state_idx_gpu, src_col_gpu, src_off_gpu, idx_mapping) -> None:
        """Before the forward: a request whose running state moves to a new block column gets the previous
        column's state copied there (``precopy_mamba_align_fused_kernel``; src_col < 0: nothing to move)."""
        if num_reqs == 0 or not self.is_initialized:
            return
        slots = idx_mapping[:num_reqs].long()
        src, dst = src_col_gpu[slots].long(), state_idx_gpu[slots].long()
        move = ((src >= 0) & (src != dst))[:, None]
        rows = torch.arange(num_reqs, device=slots.device)
        for state, group_local_idx in zip(self.states, self.state_group_indices):
            table = _rows_at(self.block_table_ptrs[group_local_idx], num_reqs).long()
            src_block, dst_block = table[rows, src.clamp(min=0)], table[rows, dst]
            state[dst_block] = torch.where(move, state[src_block], state[dst_block])


def preprocess_mamba_align_fused_kernel(idx_mapping, state_idx, num_computed_tokens, query_start_loc,
                                        num_accepted_tokens, src_col, src_off, num_reqs, MAMBA_BLOCK_SIZE):
    """Advance each request's running-state column; remember the old one where it changes."""
    slots = idx_mapping[:num_reqs].long()
    query_len = query_start_loc[1:num_reqs + 1] - query_start_loc[:num_reqs]
    new_col = (num_computed_tokens[slots] + query_len - 1) // MAMBA_BLOCK_SIZE
    old_col = state_idx[slots]
    src_col[slots] = torch.where(new_col != old_col, old_col, torch.full_like(old_col, -1))
    src_off[slots] = num_accepted_tokens[slots] - 1
    state_idx[slots] = new_col.to(state_idx.dtype)


# --- vllm/v1/worker/gpu/model_states/mamba_hybrid.py (before the fix: 2026-08-28 nightly) ---------------------

@dataclass
class MambaHybridAttnMetadata:
    is_prefilling: torch.Tensor


class MambaHybridModelState:
    """Model state for hybrid attention + Mamba / linear-attention models."""

    def __init__(self, vllm_config: VllmConfig, model, encoder_cache, device):
        self.vllm_config, self.model, self.device = vllm_config, model, device
        self.max_num_reqs, self.max_model_len = vllm_config.max_num_seqs, vllm_config.max_model_len
        self.supports_mm_inputs = False
        self.cache_config = vllm_config.cache_config
        self.num_accepted_tokens_gpu = torch.ones(self.max_num_reqs, dtype=torch.int32, device=device)
        self._align_mode = self.cache_config.mamba_cache_mode == "align"
        if self._align_mode:
            self._mamba_state_idx_gpu = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
            self._mamba_src_col_gpu = torch.full((self.max_num_reqs,), -1, dtype=torch.int32, device=device)
            self._mamba_src_off_gpu = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
            self._mamba_ctx: MambaSpecDecodeGPUContext | None = None
            self._mamba_group_ids: list[int] = []
            self._mamba_spec: MambaSpec | None = None

    def add_request(self, req_index: int, new_req_data) -> None:
        if self._align_mode:
            # Seed the running state block from the resumed/prefilled position.
            self._mamba_state_idx_gpu[req_index] = (new_req_data.num_computed_tokens - 1) // \
                self.cache_config.block_size
            self.num_accepted_tokens_gpu[req_index] = 1

    def _get_mamba_group_info(self, kv_cache_config: KVCacheConfig) -> tuple[list[int], MambaSpec]:
        if self._mamba_spec is None:
            group_ids: list[int] = []
            specs: list[MambaSpec] = []
            for i, group in enumerate(kv_cache_config.kv_cache_groups):
                spec = group.kv_cache_spec
                if isinstance(spec, MambaSpec):
                    group_ids.append(i)
                    specs.append(spec)
            assert specs, "no mamba layers in the model"
            assert all(specs[0] == s for s in specs)
            self._mamba_group_ids = group_ids
            self._mamba_spec = specs[0]
        return self._mamba_group_ids, self._mamba_spec

    def _ensure_align_ctx(self, kv_cache_config, mamba_group_ids, block_tables) -> MambaSpecDecodeGPUContext:
        if self._mamba_ctx is None:
            copy_funcs = self.model.get_mamba_state_copy_func()
            self._mamba_ctx = MambaSpecDecodeGPUContext.create(
                max_num_reqs=self.max_num_reqs, kv_cache_config=kv_cache_config,
                num_state_types=len(copy_funcs), device=self.device)
        ctx = self._mamba_ctx
        if not ctx.is_initialized:
            forward_context = self.vllm_config.compilation_config.static_forward_context
            # block_tables are batch-order slices of the persistent input_block_tables (stable data_ptr), so
            # the metadata is captured once here and reused across steps.
            ctx.initialize_from_forward_context(
                kv_cache_config, forward_context, self.model.get_mamba_state_copy_func(),
                [block_tables[gid] for gid in mamba_group_ids])
        return ctx

    def preprocess_state(self, input_batch, block_tables, kv_cache_config, num_computed_tokens) -> None:
        """Migrate each request's mamba state across block boundaries before the forward (real batches
        only)."""
        if not self._align_mode:
            return
        num_reqs = input_batch.num_reqs
        if num_reqs == 0:
            return
        mamba_group_ids, mamba_spec = self._get_mamba_group_info(kv_cache_config)
        ctx = self._ensure_align_ctx(kv_cache_config, mamba_group_ids, block_tables)
        preprocess_mamba_align_fused_kernel(
            input_batch.idx_mapping, self._mamba_state_idx_gpu, num_computed_tokens, input_batch.query_start_loc,
            self.num_accepted_tokens_gpu, self._mamba_src_col_gpu, self._mamba_src_off_gpu, num_reqs,
            MAMBA_BLOCK_SIZE=mamba_spec.block_size)
        ctx.run_fused_precopy(num_reqs, self._mamba_state_idx_gpu, self._mamba_src_col_gpu,
                              self._mamba_src_off_gpu, input_batch.idx_mapping)

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups,
                     kv_cache_config, for_capture: bool = False) -> dict[str, Any]:
        if cudagraph_mode == CUDAGraphMode.FULL:
            num_reqs = input_batch.num_reqs_after_padding
            num_tokens = input_batch.num_tokens_after_padding
        else:
            num_reqs = input_batch.num_reqs
            num_tokens = input_batch.num_tokens
        is_prefilling = torch.zeros(num_reqs, dtype=torch.bool)
        is_prefilling[:input_batch.num_reqs] = torch.from_numpy(input_batch.is_prefilling_np)

        if self._align_mode:
            mamba_group_ids, _ = self._get_mamba_group_info(kv_cache_config)
            aligned_index_builders = []
            for group_idx, group_id in enumerate(mamba_group_ids):
                for group in attn_groups[group_id]:
                    builder = group.get_metadata_builder(0)
                    if hasattr(builder, "mamba_aligned_state_indices"):
                        aligned_index_builders.append((group_idx, builder))
            if aligned_index_builders:
                ctx = self._ensure_align_ctx(kv_cache_config, mamba_group_ids, block_tables)
                all_group_indices = ctx.compute_aligned_state_indices(input_batch.seq_lens, num_reqs)
                for group_idx, builder in aligned_index_builders:
                    builder.mamba_aligned_state_indices = all_group_indices[group_idx]

        return build_attn_metadata(
            attn_groups=attn_groups, num_reqs=num_reqs, num_tokens=num_tokens, seq_lens=input_batch.seq_lens,
            block_tables=block_tables, slot_mappings=slot_mappings, kv_cache_config=kv_cache_config,
            model_specific_attn_metadata=MambaHybridAttnMetadata(is_prefilling=is_prefilling),
            for_cudagraph_capture=for_capture)


# --- vllm/v1/worker/gpu/input_batch.py, block_table.py ---------------------------------------------------------

class InputBuffers:
    def __init__(self, max_num_reqs, max_num_tokens, device):
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.idx_mapping = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)


@dataclass
class InputBatch:
    req_ids: list[str]
    num_reqs: int
    num_reqs_after_padding: int
    num_tokens: int
    num_tokens_after_padding: int
    idx_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    is_prefilling_np: np.ndarray

    @classmethod
    def make_dummy(cls, num_reqs: int, num_tokens: int, input_buffers: InputBuffers) -> "InputBatch":
        input_buffers.query_start_loc[:num_reqs + 1] = torch.arange(num_reqs + 1, dtype=torch.int32)
        input_buffers.seq_lens[:num_reqs] = 1
        input_buffers.idx_mapping[:num_reqs] = torch.arange(num_reqs, dtype=torch.int32)
        return cls([], num_reqs, num_reqs, num_tokens, num_tokens, input_buffers.idx_mapping[:num_reqs],
                   input_buffers.query_start_loc[:num_reqs + 1], input_buffers.seq_lens[:num_reqs],
                   input_buffers.input_ids[:num_tokens], input_buffers.positions[:num_tokens],
                   np.zeros(num_reqs, dtype=bool))


class BlockTables:
    """Per-group block tables by request slot (``block_tables``) and gathered in batch order
    (``input_block_tables``, what kernels and graphs read), plus per-group slot mappings."""

    def __init__(self, num_groups, block_size, max_num_reqs, max_num_batched_tokens, max_model_len, device):
        self.num_groups, self.block_size = num_groups, block_size
        max_num_blocks = cdiv(max_model_len, block_size)
        self.block_tables = [torch.zeros(max_num_reqs, max_num_blocks, dtype=torch.int32, device=device)
                             for _ in range(num_groups)]
        self.input_block_tables = [torch.zeros(max_num_reqs, max_num_blocks, dtype=torch.int32, device=device)
                                   for _ in range(num_groups)]
        self.slot_mappings = torch.full((num_groups, max_num_batched_tokens), PAD_SLOT_ID, dtype=torch.long,
                                        device=device)
        self.num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int32)

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        for g, ids in enumerate(new_block_ids):
            start = 0 if overwrite else int(self.num_blocks[g, req_index])
            if ids:
                self.block_tables[g][req_index, start:start + len(ids)] = torch.tensor(ids, dtype=torch.int32)
            self.num_blocks[g, req_index] = start + len(ids)

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: int) -> tuple[torch.Tensor, ...]:
        n = idx_mapping.shape[0]
        for g in range(self.num_groups):
            self.input_block_tables[g][:n] = self.block_tables[g][idx_mapping.long()]
            self.input_block_tables[g][n:num_reqs_padded] = 0
        return tuple(t[:num_reqs_padded] for t in self.input_block_tables)

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        for t in self.input_block_tables:
            t[:num_reqs] = 0
        return tuple(t[:num_reqs] for t in self.input_block_tables)

    def compute_slot_mappings(self, positions: torch.Tensor, num_tokens: int,
                              num_tokens_padded: int) -> torch.Tensor:
        """Decode: token i is batch row i."""
        rows = torch.arange(num_tokens, device=positions.device)
        for g in range(self.num_groups):
            block_ids = self.input_block_tables[g][rows, positions[:num_tokens] // self.block_size].long()
            self.slot_mappings[g, :num_tokens] = block_ids * self.block_size + positions[:num_tokens] % self.block_size
        self.slot_mappings[:, num_tokens:num_tokens_padded] = PAD_SLOT_ID
        return self.slot_mappings[:, :num_tokens_padded]

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        self.slot_mappings[:, :num_tokens] = PAD_SLOT_ID
        return self.slot_mappings[:, :num_tokens]


# --- vllm/platforms ---------------------------------------------------------------------------------------------

class Platform:
    def __init__(self, device):
        self.device = device
        self._global_graph_pool = None

    def get_global_graph_pool(self):
        if self._global_graph_pool is None:
            self._global_graph_pool = graph_pool_handle(self.device)
        return self._global_graph_pool

    def graph_pool_handle(self):
        return graph_pool_handle(self.device)


# --- vllm/v1/worker/gpu/cudagraph_utils.py ----------------------------------------------------------------------

@dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: str
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None


class ModelCudaGraphManager:
    """FULL graphs of the model forward for uniform decode batches (FULL_DECODE_ONLY)."""

    def __init__(self, vllm_config: VllmConfig, device, cudagraph_mode: str, platform: Platform):
        self.vllm_config, self.device, self.cudagraph_mode = vllm_config, device, cudagraph_mode
        self.max_num_reqs = vllm_config.max_num_seqs
        self.graphs: dict[BatchExecutionDescriptor, Any] = {}
        self.graph_outputs: dict[BatchExecutionDescriptor, torch.Tensor] = {}
        self.pool = platform.get_global_graph_pool() if cudagraph_mode != CUDAGraphMode.NONE else None
        self.intermediate_tensors: IntermediateTensors | None = None
        self._graphs_captured = False
        self._capture_descs: list[BatchExecutionDescriptor] = []
        if cudagraph_mode == CUDAGraphMode.FULL:
            self._capture_descs = sorted(
                (BatchExecutionDescriptor(CUDAGraphMode.FULL, n, n, 1)
                 for n in vllm_config.compilation_config.cudagraph_capture_sizes if n <= self.max_num_reqs),
                key=lambda d: d.num_tokens, reverse=True)

    def needs_capture(self) -> bool:
        return bool(self._capture_descs)

    def capture(self, model, model_state, input_buffers, block_tables: BlockTables, attn_groups,
                kv_cache_config, static_buffers, state_buffers, progress_bar_desc="Capturing CUDA graphs"):
        def store_capture_output(num_tokens: int, model_output: IntermediateTensors) -> None:
            if self.intermediate_tensors is None:
                self.intermediate_tensors = IntermediateTensors.empty_like(model_output)
            for k, v in model_output.tensors.items():
                self.intermediate_tensors[k][:num_tokens] = v

        def create_forward_fn(desc: BatchExecutionDescriptor, warmup: bool):
            num_tokens, num_reqs = desc.num_tokens, desc.num_reqs
            model_inputs = {"input_ids": input_buffers.input_ids[:num_tokens],
                            "positions": input_buffers.positions[:num_tokens]}
            attn_metadata = prepare_inputs_to_capture(num_reqs, num_tokens, model_state, input_buffers,
                                                      block_tables, attn_groups, kv_cache_config,
                                                      full_cudagraph=desc.cg_mode == CUDAGraphMode.FULL)

            def forward_fn(cg_mode: str) -> None:
                with set_forward_context(attn_metadata):
                    model_output = model(**model_inputs)
                store_capture_output(num_tokens, model_output)

            return forward_fn

        for desc in self._capture_descs:
            forward_fn = create_forward_fn(desc, warmup=True)      # (the upstream traceback's line 347)
            with events.warmup():
                forward_fn(CUDAGraphMode.NONE)
            # Capture with fresh attention state.
            forward_fn = create_forward_fn(desc, warmup=False)
            g, _ = capture(lambda f=forward_fn: f(CUDAGraphMode.NONE), device=self.device, pool=self.pool,
                           warmups=0, name=f"{progress_bar_desc} FULL num_tokens={desc.num_tokens}",
                           static=static_buffers(), state=state_buffers(), owner="ModelCudaGraphManager")
            self.graphs[desc] = g
            self.graph_outputs[desc] = self.intermediate_tensors["hidden_states"][:desc.num_tokens]
        self._graphs_captured = True

    def dispatch(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None) -> BatchExecutionDescriptor:
        if self._graphs_captured and uniform_token_count == 1:
            for desc in sorted(self.graphs, key=lambda d: d.num_tokens):
                if desc.num_tokens >= num_tokens and desc.num_reqs >= num_reqs:
                    return desc
        return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs)

    def reset_graphs(self) -> None:
        for g in self.graphs.values():
            if hasattr(g, "reset"):
                g.reset()

    def run_fullgraph(self, desc: BatchExecutionDescriptor, num_reqs: int) -> IntermediateTensors:
        hidden_states = replay(self.graphs[desc], self.graph_outputs[desc], real=num_reqs, size=desc.num_tokens)
        return IntermediateTensors({"hidden_states": hidden_states})


def prepare_inputs_to_capture(num_reqs, num_tokens, model_state, input_buffers, block_tables: BlockTables,
                              attn_groups, kv_cache_config, full_cudagraph: bool):
    input_batch = InputBatch.make_dummy(num_reqs, num_tokens, input_buffers)
    input_block_tables = block_tables.get_dummy_block_tables(num_reqs)
    slot_mappings = block_tables.get_dummy_slot_mappings(num_tokens)
    return model_state.prepare_attn(input_batch, CUDAGraphMode.NONE, input_block_tables, slot_mappings,
                                    attn_groups, kv_cache_config, for_capture=full_cudagraph)


def profile_cudagraph_memory(runner: "GPUModelRunner") -> int:
    """Estimate the memory CUDA graph capture needs, *before* the real KV cache exists: bootstrap a minimal
    KV cache, run ``capture_model()`` once into a throwaway pool, then release everything."""
    if runner.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    platform = runner.platform
    saved_global_pool = platform.get_global_graph_pool()
    throwaway_pool = platform.graph_pool_handle()
    platform._global_graph_pool = throwaway_pool
    try:
        _init_minimal_kv_cache_for_profiling(runner)
        manager = runner.cudagraph_manager
        try:
            if not manager.needs_capture():
                return 0
            manager.pool = throwaway_pool
            return int(runner.capture_model(profile_only=True))
        finally:
            manager.reset_graphs()
            manager.graphs.clear()
            manager.graph_outputs.clear()
            manager._graphs_captured = False
            manager.pool = saved_global_pool
            del manager
            _teardown_profiling_state(runner)
    finally:
        platform._global_graph_pool = saved_global_pool


def _init_minimal_kv_cache_for_profiling(runner: "GPUModelRunner") -> None:
    """The smallest KV cache graph capture needs, grouped from this worker's own layers."""
    kv_cache_spec = runner.get_kv_cache_spec()
    kv_cache_groups = get_kv_cache_groups(runner.vllm_config, kv_cache_spec)
    num_blocks = min(runner.max_num_reqs, runner.vllm_config.compilation_config.max_cudagraph_capture_size) or 1
    saved_override = runner.cache_config.num_gpu_blocks_override
    runner.cache_config.num_gpu_blocks_override = num_blocks
    try:
        minimal_config = get_kv_cache_config_from_groups(runner.vllm_config, kv_cache_groups, available_memory=0)
    finally:
        runner.cache_config.num_gpu_blocks_override = saved_override
    runner.initialize_kv_cache(minimal_config, is_profiling=True)
    runner.cache_config.num_gpu_blocks = minimal_config.num_blocks


def clear_layer_kv_caches(layers) -> None:
    for layer in layers:
        layer.kv_cache = []


def _teardown_profiling_state(runner: "GPUModelRunner") -> None:
    """Release the profiling KV cache and captured graphs while keeping model weights, so the real
    ``initialize_kv_cache`` starts from a clean slate."""
    if hasattr(runner.model_state, "_mamba_ctx"):
        runner.model_state._mamba_ctx = None
    if runner.variant == "fix":
        # Invalidate the align-mode Mamba group metadata cached from the profiling KVCacheConfig: the real
        # (e.g. PP-projected) config may place Mamba layers into a different group layout, so it must be
        # re-derived from the real config.
        if hasattr(runner.model_state, "_mamba_group_ids"):
            runner.model_state._mamba_group_ids = []
        if hasattr(runner.model_state, "_mamba_spec"):
            runner.model_state._mamba_spec = None
    if hasattr(runner, "kv_caches"):
        runner.kv_caches.clear()
    if hasattr(runner, "attn_groups"):
        runner.attn_groups.clear()
    if hasattr(runner, "kv_cache_config"):
        del runner.kv_cache_config
    if hasattr(runner, "block_tables"):
        del runner.block_tables
    # Dropping the manager releases the profiling graphs and throwaway pool.
    runner.cudagraph_manager = None
    clear_layer_kv_caches(runner.vllm_config.compilation_config.static_forward_context.values())
    runner.cache_config.num_gpu_blocks = None


# --- vllm/v1/worker/gpu/model_runner.py ------------------------------------------------------------------------

@dataclass
class NewRequestData:
    req_id: str
    prompt_len: int
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]
    prefill: dict[str, torch.Tensor]             # the (not modelled) prefill's results: see the header


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    new_block_ids: dict[str, tuple[list[int], ...]]
    num_scheduled_tokens: dict[str, int]
    token_ids: dict[str, int]
    finished_req_ids: set[str]


class GPUModelRunner:
    def __init__(self, vllm_config: VllmConfig, device, variant: str, platform: Platform, layer_ids):
        self.vllm_config, self.device, self.variant, self.platform = vllm_config, device, variant, platform
        self.cache_config = vllm_config.cache_config
        self.max_num_reqs = vllm_config.max_num_seqs
        self.max_num_tokens = vllm_config.max_num_seqs           # decode only
        self.layer_ids = layer_ids
        self.model = KimiLinearForCausalLM(vllm_config, layer_ids, device)
        self.model_state = MambaHybridModelState(vllm_config, self.model, None, device)
        self.input_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, device)
        self.num_computed_tokens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self.req_id_to_index: dict[str, int] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.attn_groups: list[list[AttentionGroup]] = []
        self.cudagraph_manager: ModelCudaGraphManager | None = None

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return {name: layer.get_kv_cache_spec(self.vllm_config) for name, layer in self.model.layers.items()}

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig, is_profiling: bool = False) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_tables = BlockTables(len(kv_cache_config.kv_cache_groups), self.cache_config.block_size,
                                        self.max_num_reqs, self.max_num_tokens, self.vllm_config.max_model_len,
                                        self.device)
        self.attn_groups = init_attn_backend(kv_cache_config, self.vllm_config, self.device)
        forward_context = self.vllm_config.compilation_config.static_forward_context
        for group in kv_cache_config.kv_cache_groups:
            for layer_name in group.layer_names:
                if isinstance(group.kv_cache_spec, MambaSpec):
                    cache = torch.zeros(kv_cache_config.num_blocks, STATE_DIM, device=self.device)
                else:
                    cache = torch.zeros(kv_cache_config.num_blocks, BLOCK_SIZE, KV_LORA_RANK, device=self.device)
                forward_context[layer_name].kv_cache = [cache]
                self.kv_caches.append(cache)
        self.cudagraph_manager = ModelCudaGraphManager(
            self.vllm_config, self.device, self.vllm_config.compilation_config.cudagraph_mode, self.platform)

    def _static_buffers(self) -> dict[str, torch.Tensor]:
        bufs = {"input_ids": self.input_buffers.input_ids, "positions": self.input_buffers.positions,
                "seq_lens": self.input_buffers.seq_lens, "slot_mappings": self.block_tables.slot_mappings}
        for g, t in enumerate(self.block_tables.input_block_tables):
            bufs[f"input_block_tables[{g}]"] = t
        for g, groups in enumerate(self.attn_groups):
            builder = groups[0].get_metadata_builder(0)
            if isinstance(builder, KDAAttentionMetadataBuilder):
                bufs[f"kda_builder[{g}].state_indices_tensor"] = builder.state_indices_tensor
        return bufs

    def _state_buffers(self) -> dict[str, torch.Tensor]:
        forward_context = self.vllm_config.compilation_config.static_forward_context
        return {f"{name}.kv_cache": forward_context[name].kv_cache[0] for name in self.model.layers}

    def capture_model(self, profile_only: bool = False) -> int:
        manager = self.cudagraph_manager
        if manager is None or not manager.needs_capture():
            return 0
        manager.capture(self.model, self.model_state, self.input_buffers, self.block_tables, self.attn_groups,
                        self.kv_cache_config, self._static_buffers, self._state_buffers,
                        progress_bar_desc="Profiling CUDA graphs" if profile_only else "Capturing CUDA graphs")
        return len(manager.graphs) * GRAPH_MEMORY_BYTES

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        forward_context = self.vllm_config.compilation_config.static_forward_context
        for req_id in scheduler_output.finished_req_ids:
            self.req_id_to_index.pop(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            free = sorted(set(range(self.max_num_reqs)) - set(self.req_id_to_index.values()))
            req_index = self.req_id_to_index[new_req.req_id] = free[0]
            self.num_computed_tokens[req_index] = new_req.num_computed_tokens
            self.model_state.add_request(req_index, new_req)
            self.block_tables.append_block_ids(req_index, new_req.block_ids, overwrite=True)
            # The prefill's results (not modelled; the same in both runs).
            last_col = (new_req.prompt_len - 1) // BLOCK_SIZE
            for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
                for layer_name in group.layer_names:
                    (cache,) = forward_context[layer_name].kv_cache
                    if isinstance(group.kv_cache_spec, MambaSpec):
                        cache[new_req.block_ids[g][last_col]] = new_req.prefill[layer_name]
                    else:
                        for pos in range(new_req.prompt_len):
                            cache[new_req.block_ids[g][pos // BLOCK_SIZE], pos % BLOCK_SIZE] = \
                                new_req.prefill[layer_name][pos]
        for req_id, new_block_ids in scheduler_output.new_block_ids.items():
            self.block_tables.append_block_ids(self.req_id_to_index[req_id], new_block_ids, overwrite=False)

    def prepare_inputs(self, scheduler_output: SchedulerOutput, batch_desc) -> InputBatch:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        num_reqs = num_tokens = len(req_ids)
        num_reqs_padded = batch_desc.num_reqs if batch_desc.cg_mode == CUDAGraphMode.FULL else num_reqs
        num_tokens_padded = batch_desc.num_tokens
        buf = self.input_buffers
        idx = torch.tensor([self.req_id_to_index[r] for r in req_ids], dtype=torch.int32)
        buf.idx_mapping[:num_reqs] = idx.to(self.device)
        idx_mapping = buf.idx_mapping[:num_reqs]
        buf.input_ids[:num_tokens] = torch.tensor([scheduler_output.token_ids[r] for r in req_ids]).to(self.device)
        buf.positions[:num_tokens] = self.num_computed_tokens[idx_mapping.long()].long()
        buf.seq_lens[:num_reqs] = self.num_computed_tokens[idx_mapping.long()] + 1
        buf.query_start_loc[:num_reqs + 1] = torch.arange(num_reqs + 1, dtype=torch.int32).to(self.device)
        # padded rows: no token, no sequence
        buf.input_ids[num_tokens:num_tokens_padded] = 0
        buf.positions[num_tokens:num_tokens_padded] = 0
        buf.seq_lens[num_reqs:num_reqs_padded] = 0
        buf.query_start_loc[num_reqs + 1:num_reqs_padded + 1] = num_tokens
        return InputBatch(req_ids, num_reqs, num_reqs_padded, num_tokens, num_tokens_padded, idx_mapping,
                          buf.query_start_loc[:num_reqs_padded + 1], buf.seq_lens[:num_reqs_padded],
                          buf.input_ids[:num_tokens_padded], buf.positions[:num_tokens_padded],
                          np.zeros(num_reqs, dtype=bool))

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        self._update_states(scheduler_output)
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        batch_desc = self.cudagraph_manager.dispatch(num_reqs, num_reqs, uniform_token_count=1)
        input_batch = self.prepare_inputs(scheduler_output, batch_desc)
        block_tables = self.block_tables.gather_block_tables(input_batch.idx_mapping,
                                                             input_batch.num_reqs_after_padding)
        slot_mappings = self.block_tables.compute_slot_mappings(input_batch.positions, input_batch.num_tokens,
                                                                input_batch.num_tokens_after_padding)
        self.model_state.preprocess_state(input_batch, block_tables, self.kv_cache_config, self.num_computed_tokens)
        attn_metadata = self.model_state.prepare_attn(input_batch, batch_desc.cg_mode, block_tables, slot_mappings,
                                                      self.attn_groups, self.kv_cache_config)
        if batch_desc.cg_mode == CUDAGraphMode.FULL:
            model_output = self.cudagraph_manager.run_fullgraph(batch_desc, num_reqs)
        else:
            with set_forward_context(attn_metadata):
                model_output = self.model(input_ids=input_batch.input_ids[:num_reqs],
                                          positions=input_batch.positions[:num_reqs])
        hidden_states = model_output["hidden_states"][:num_reqs].clone()
        # postprocess: the scheduled tokens are computed now
        self.num_computed_tokens[input_batch.idx_mapping.long()] += 1
        return hidden_states


# --- vllm/v1/worker/gpu_worker.py, vllm/v1/engine/core.py ------------------------------------------------------

class Worker:
    def __init__(self, vllm_config, device, variant, platform, layer_ids):
        self.model_runner = GPUModelRunner(vllm_config, device, variant, platform, layer_ids)

    def determine_available_memory(self) -> int:
        cudagraph_memory_estimate = profile_cudagraph_memory(self.model_runner)
        return KV_CACHE_MEMORY_BYTES - cudagraph_memory_estimate

    def get_kv_cache_spec(self):
        return self.model_runner.get_kv_cache_spec()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        self.model_runner.capture_model()


class SchedulerStandIn:
    """Admits requests, allocates one block per 4-token column in every KV cache group, frees finished ones."""

    def __init__(self, kv_cache_config: KVCacheConfig):
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.free_block_ids = list(range(1, kv_cache_config.num_blocks))       # block 0: the null block
        self.blocks: dict[str, list[list[int]]] = {}
        self.num_computed: dict[str, int] = {}

    def _allocate(self, req_id: str, num_tokens: int) -> tuple[list[int], ...]:
        new = tuple([] for _ in range(self.num_groups))
        while len(self.blocks[req_id][0]) < cdiv(num_tokens, BLOCK_SIZE):
            for g in range(self.num_groups):
                block_id = self.free_block_ids.pop(0)
                self.blocks[req_id][g].append(block_id)
                new[g].append(block_id)
        return new

    def schedule(self, step: int, running: list[str], arrivals: dict, finished: set[str]) -> SchedulerOutput:
        for req_id in finished:
            for ids in self.blocks.pop(req_id):
                self.free_block_ids.extend(ids)
            self.num_computed.pop(req_id)
        new_reqs, new_block_ids = [], {}
        for req_id in running:
            if req_id in arrivals:
                prompt_len, prefill = arrivals[req_id]
                self.blocks[req_id] = [[] for _ in range(self.num_groups)]
                self.num_computed[req_id] = prompt_len
                block_ids = self._allocate(req_id, prompt_len + 1)
                new_reqs.append(NewRequestData(req_id, prompt_len, prompt_len, block_ids, prefill))
            else:
                new = self._allocate(req_id, self.num_computed[req_id] + 1)
                if any(new):
                    new_block_ids[req_id] = new
        token_ids = {r: TOKENS[r][self.num_computed[r] - PROMPT_LENS[r]] for r in running}
        for r in running:
            self.num_computed[r] += 1
        return SchedulerOutput(new_reqs, new_block_ids, {r: 1 for r in running}, token_ids, set(finished))


# --- the workload -------------------------------------------------------------------------------------------------

PROMPT_LENS = {"A": 3, "B": 6, "C": 2, "D": 5}
TOKENS = {r: torch.randint(0, VOCAB, (8,), generator=generator(i)).tolist() for i, r in enumerate(PROMPT_LENS)}
SCHEDULE = [  # (running requests in batch order, arrivals, finished before this step)
    (["A", "B", "C"], {"A", "B", "C"}, set()),
    (["A", "B", "C"], set(), set()),
    (["A", "B", "C", "D"], {"D"}, set()),
    (["A", "B", "C", "D"], set(), set()),
    (["A", "B", "C", "D"], set(), set()),
    (["A", "C", "D"], set(), {"B"}),
    (["A", "C", "D"], set(), set()),
]


def prefill_results(req_id: str, vllm_config: VllmConfig, device) -> dict[str, torch.Tensor]:
    gen = generator(5404400 + ord(req_id))
    out = {}
    for name, spec in kv_cache_spec_of(vllm_config, PP_LAYER_PARTITION[0]).items():
        out[name] = (randn(STATE_DIM, gen=gen, device=device, scale=0.5) if isinstance(spec, MambaSpec) else
                     randn(PROMPT_LENS[req_id], KV_LORA_RANK, gen=gen, device=device))
    return out


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        mode = CUDAGraphMode.FULL if graphed else CUDAGraphMode.NONE     # FULL_DECODE_ONLY / enforce_eager
        vllm_config = VllmConfig(CacheConfig(), CompilationConfig(cudagraph_mode=mode))
        platform = Platform(device)
        worker = Worker(vllm_config, device, variant, platform, PP_LAYER_PARTITION[0])
        # EngineCore._initialize_kv_caches: the PP stage-1 worker reports its specs and memory too.
        kv_cache_specs = [worker.get_kv_cache_spec(), kv_cache_spec_of(vllm_config, PP_LAYER_PARTITION[1])]
        available_memory = [worker.determine_available_memory(), KV_CACHE_MEMORY_BYTES]
        kv_cache_configs = get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory)
        worker.initialize_from_config(kv_cache_configs[0])
        worker.compile_or_warm_up_model()
        scheduler = SchedulerStandIn(kv_cache_configs[0])
        outputs = []
        for step, (running, arrivals, finished) in enumerate(SCHEDULE):
            arrivals = {r: (PROMPT_LENS[r], prefill_results(r, vllm_config, device)) for r in arrivals}
            scheduler_output = scheduler.schedule(step, running, arrivals, finished)
            outputs.append(worker.model_runner.execute_model(scheduler_output))
        return outputs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
