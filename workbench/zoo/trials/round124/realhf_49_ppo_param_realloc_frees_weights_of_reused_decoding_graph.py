"""ReaLHF PPO with CUDA-graph generation and parameter reallocation: ``generate`` captures the decoding graph once (graph name ``"decoding"``) and every later call reuses it, but between two generations the actor's weights are reallocated to the trainer and back, which frees the generation model's contiguous parameter buffer the graph reads and builds a new one.

Upstream: https://github.com/openpsi-project/ReaLHF/pull/49 ("Fix CUDAGraph recapture", openpsi-project/ReaLHF, author
nuzant, opened 2024-08-01, merged 2024-08-07 as 4c09d654). Read: the PR description (recapture through the lower-level
``capture_begin``/``capture_end`` to avoid ``gc.collect()``/``empty_cache()`` per capture) and the closed #48 it
replaces (release the KV cache when not generating); the diff of 4c09d654 in ``realhf/impl/model/utils/cuda_graph.py``
(``capture_func`` with ``CUDA_GRAPH_FIRST_CAPTURE``/``CUDA_GRAPH_DESTROYED``, warm-up on the first capture only,
``destroy``), ``realhf/impl/model/nn/real_llm_generate.py`` (``maybe_capture_cudagraph`` passes
``force_recapture=gconfig.force_cudagraph_recapture`` instead of ``False``; ``generate`` destroys the graph after the
main loop) and ``realhf/api/core/model_api.py`` (``force_cudagraph_recapture: bool = True``); at its parent
``prepare_generate_inputs``, ``maybe_capture_cudagraph``, ``generate``, ``genstep``, ``capture_func``,
``reinitialize_input_buffer``, ``ReaLModel.instantiate`` / ``_forward`` / ``build_reparallelized_layers_async`` /
``patch_reparallelization``, ``map_param_to_contigous_memory``, ``VocabPositionEmbedding``, ``ReaLModelBlock._forward``
and the ``param_realloc`` hook and ``clear_data_cache`` of ``realhf/system/model_worker.py``. Also read: #16
(6caa5228, "Add a check in `PPOExperiment` to avoid unintended behaviors", 2024-07-03, from its commit e33e5d00 "fix
ppo cuda graph"), which made ``PPOConfig`` raise "CUDA graph cannot be used with parameter reallocation because CUDA
graph requires pinned parameter memory" two days after 211e0aa2 turned on
``ppo.gen.use_cuda_graph=True`` in ``examples/scripts/manual_ppo.sh`` (actor_gen dp4/pp2 on 8 GPUs, actor_train dp2/pp2
on 4: reallocation every step), and ec2b2a76 (#55, 2024-09-02), which deleted that check once ``generate`` recaptured on
every call. The PR text of #49 does not mention reallocation: that #49 is the change that made CUDA graphs safe with
it is read from this sequence (guard added, recapture-per-call added, guard removed).
Symptom: PPO with ``ppo.gen.use_cuda_graph=True`` and different parallel strategies for ``actor_gen`` and
``actor_train``: the first rollout is fine; from the second one on, the decoding graph replays against the generation
weights of the first step, which the reallocation back to the trainer released: as the CUDA allocator decides, an
illegal address once the model worker's ``clear_data_cache`` has emptied the cache, whatever else now lives in the
block, or, when the next reallocation happens to land on the same block, the right weights by chance.
Mechanism: ``build_reparallelized_layers_async`` from the trainable ``actor_train`` to ``actor_gen`` allocates a new
``to_contiguous_param`` and maps the generation layers' parameters onto it (``patch_reparallelization`` installs it);
from ``actor_gen`` back to ``actor_train`` it sets every generation parameter to an empty ``dummy_tensor`` and drops
``contiguous_param``: the buffer's last owner. The decoding graph captured by the first ``generate`` read the weights
through that buffer's addresses. At the next ``generate``, ``maybe_capture_cudagraph`` calls ``capture_func`` with
``force_recapture=False``; the name is in ``CUDA_GRAPH_STORAGE``, so ``reinitialize_input_buffer`` copies the new inputs
into the old static buffers and the old graph is replayed: on the released buffer, not on the weights just
reallocated. Eager decoding reads the parameters' current storage.
Doctor: dangling-reference, at maybe_capture_cudagraph. The replayed graph reads the generation weights whose owner
(the reallocated ``contiguous_param``) was released; the upstream fix is in ``maybe_capture_cudagraph``'s hard-coded
``force_recapture=False`` (with the ``destroy`` it enables in ``generate``).
Fix (upstream): ``maybe_capture_cudagraph(..., force_recapture=gconfig.force_cudagraph_recapture)`` (default True):
``capture_func`` captures again on every ``generate`` (warm-up only the first time), against the parameters of the
current reallocation and new KV caches, and ``generate`` calls ``cuda_graph.destroy("decoding")`` after its loop.
Modelled: ``GenerationHyperparameters``, ``PipeTransferData``/``PipeCacheData``, ``ReaLModel`` (layers 0 = embedding
with absolute positions, 1..n = blocks, n+1 = head; parameters as views of one ``contiguous_param`` through
``map_param_to_contigous_memory``; ``forward`` for packed prefill/training and for cached decoding, ``_forward`` for the
graph; ``build_reparallelization_plan`` / ``build_reparallelized_layers_async`` / ``patch_reparallelization`` reduced
to one process, where the "broadcast" is a local copy), ``cuda_graph.capture_func`` / ``reinitialize_input_buffer`` /
``input_buffer_handle`` / ``destroy`` (both versions), ``prepare_generate_inputs``, ``maybe_capture_cudagraph``,
``generate`` (eager prefill, then graph or eager decoding), ``genstep`` (greedy, no EOS), the model worker's
``param_realloc`` hook and ``clear_data_cache`` (``gc.collect()`` + ``torch.cuda.empty_cache()`` under
``cuda_cache_cleanliness``). Stand-ins: a 2-block GPT-2-like model (hidden 8, 2 heads, vocab 16, no layer-norm
affine, no biases); torch ops for ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``; a reduced PPO actor step
(clipped ratio loss, reward = mean token id / vocab size, SGD on the trainer's parameters in place); on CUDA the
contiguous parameter buffer is padded to own its allocator segment (``own_segment_elems``); float64.
Workload: 3 PPO steps on 3 prompts (lengths 5, 3, 4), 4 greedy new tokens each; each step: realloc train -> gen,
``generate``, realloc gen -> train, ``train_step``, ``clear_data_cache``. Outputs: per step the generated tokens,
their log-probabilities and the actor loss. Measured: the bug raises IllegalMemoryAccess at the first replay of
step 2 (the graph reads the generation ``wte`` weight of step 1's released ``contiguous_param``); the fix recaptures
each step and equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import dataclasses
import gc
import math
from collections import defaultdict
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/openpsi-project/ReaLHF/pull/49"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "maybe_capture_cudagraph"
SYMPTOM = ("PPO with CUDA-graph generation and parameter reallocation: later rollouts replay the decoding graph "
           "captured in the first one, which reads generation weights that the reallocation back to the trainer freed")

DTYPE = torch.float64
N_LAYERS, HIDDEN, HEAD_DIM, N_HEADS, VOCAB, N_POSITIONS, INTERMEDIATE = 2, 8, 4, 2, 16, 32, 16
MAX_PROMPT_LEN = 8
PPO_STEPS = 3
PROMPT_LENS = (5, 3, 4)

_variant = "bug"
_device = "cpu"


# --- realhf/api/core/model_api.py, realhf/base/constants.py (reduced) -------------------------------------------------

@dataclasses.dataclass
class ReaLModelConfig:
    n_layers: int = N_LAYERS
    hidden_dim: int = HIDDEN
    head_dim: int = HEAD_DIM
    n_q_heads: int = N_HEADS
    vocab_size: int = VOCAB
    n_positions: int = N_POSITIONS
    intermediate_dim: int = INTERMEDIATE


@dataclasses.dataclass(frozen=True)
class ModelName:
    role: str
    replica_id: int


@dataclasses.dataclass
class GenerationHyperparameters:
    max_new_tokens: int = 4
    min_new_tokens: int = 4
    greedy: bool = True
    use_cuda_graph: bool = False
    force_cudagraph_recapture: bool = True          # added by #49 (read only by the fixed code)


def max_prompt_len() -> int:
    return MAX_PROMPT_LEN


_TRAINABLE: Dict[ModelName, bool] = {}


def is_trainable(model_name: ModelName) -> bool:      # realhf/impl/model/comm/param_realloc.py
    return _TRAINABLE[model_name]


# --- realhf/impl/model/nn/real_llm_base.py (reduced) ------------------------------------------------------------------

@dataclasses.dataclass
class PipeTransferData:
    pp_input: torch.Tensor = None
    pp_output: torch.Tensor = None
    cu_seqlens: torch.Tensor = None
    max_seqlen: int = None
    store_kv_cache: bool = False


@dataclasses.dataclass
class PipeCacheData:
    packed_input_ids: torch.Tensor = None
    packed_position_ids: torch.Tensor = None
    k_cache: torch.Tensor = None
    v_cache: torch.Tensor = None
    cache_seqlens: torch.Tensor = None


def compute_varlen_position_indices(total_seqlen, cu_seqlens, seqlen_offsets=None):
    tok = torch.arange(total_seqlen, dtype=torch.long, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous().long(), tok, right=True)
    pos = tok - cu_seqlens.long()[seq]
    if seqlen_offsets is not None:
        pos = pos + seqlen_offsets.long()[seq]
    return pos


class VocabPositionEmbedding(nn.Module):
    def __init__(self, config: ReaLModelConfig, dtype, device):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_dim, dtype=dtype, device=device)
        self.wpe = nn.Embedding(config.n_positions, config.hidden_dim, dtype=dtype, device=device)

    def forward(self, x: PipeTransferData, y: PipeCacheData) -> PipeTransferData:
        y.packed_position_ids = compute_varlen_position_indices(
            total_seqlen=y.packed_input_ids.shape[0], cu_seqlens=x.cu_seqlens, seqlen_offsets=y.cache_seqlens)
        x.pp_output = self._forward(y.packed_input_ids, y.packed_position_ids)
        return x

    def _forward(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(position_ids)


class CausalSelfAttentionLayer(nn.Module):
    def __init__(self, config: ReaLModelConfig, dtype, device):
        super().__init__()
        self.nq, self.d = config.n_q_heads, config.head_dim
        self.c_attn = nn.Linear(config.hidden_dim, 3 * config.hidden_dim, bias=False, dtype=dtype, device=device)
        self.c_proj = nn.Linear(config.hidden_dim, config.hidden_dim, bias=False, dtype=dtype, device=device)
        self.ln = nn.LayerNorm(config.hidden_dim, elementwise_affine=False, dtype=dtype, device=device)

    def forward(self, hidden_states, cu_seqlens, max_seqlen, k_cache=None, v_cache=None, cache_seqlens=None):
        q, k, v = self.c_attn(self.ln(hidden_states)).split(self.nq * self.d, dim=-1)
        q, k, v = (t.reshape(-1, self.nq, self.d) for t in (q, k, v))
        scale = 1.0 / math.sqrt(self.d)
        if k_cache is not None:
            # flash_attn_with_kvcache: append k/v at cache_seqlens, attend to positions <= cache_seqlens
            rows = torch.arange(q.shape[0], device=q.device)
            pos = cache_seqlens.long()
            k_cache.index_put_((rows, pos), k)
            v_cache.index_put_((rows, pos), v)
            scores = torch.einsum("bhd,bshd->bhs", q, k_cache) * scale
            masked = torch.arange(k_cache.shape[1], device=q.device)[None, None, :] > pos[:, None, None]
            probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
            out = torch.einsum("bhs,bshd->bhd", probs, v_cache)
        else:
            # flash_attn_varlen_func over packed sequences
            tok = torch.arange(q.shape[0], device=q.device)
            seq = torch.searchsorted(cu_seqlens[1:].contiguous().long(), tok, right=True)
            allowed = (seq[:, None] == seq[None, :]) & (tok[None, :] <= tok[:, None])
            scores = torch.einsum("thd,shd->hts", q, k) * scale
            probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
            out = torch.einsum("hts,shd->thd", probs, v)
        return self.c_proj(out.reshape(-1, self.nq * self.d)), k, v


class LayerNormMLP(nn.Module):
    def __init__(self, config: ReaLModelConfig, dtype, device):
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden_dim, elementwise_affine=False, dtype=dtype, device=device)
        self.c_fc = nn.Linear(config.hidden_dim, config.intermediate_dim, bias=False, dtype=dtype, device=device)
        self.c_proj = nn.Linear(config.intermediate_dim, config.hidden_dim, bias=False, dtype=dtype, device=device)

    def forward(self, h):
        return self.c_proj(nn.functional.gelu(self.c_fc(self.ln(h)), approximate="tanh"))


class ReaLModelBlock(nn.Module):
    def __init__(self, config: ReaLModelConfig, dtype, device):
        super().__init__()
        self.attn = CausalSelfAttentionLayer(config, dtype, device)
        self.mlp = LayerNormMLP(config, dtype, device)

    def forward(self, x: PipeTransferData, y: PipeCacheData) -> PipeTransferData:
        x.pp_output, k, v = self._forward(x.pp_input, x.cu_seqlens, y.k_cache, y.v_cache, y.cache_seqlens,
                                          x.max_seqlen)
        if x.store_kv_cache and y.k_cache is None:
            y.k_cache, y.v_cache = k, v
        return x

    def _forward(self, pp_input, cu_seqlens, k_cache, v_cache, cache_seqlens, max_seqlen):
        h = pp_input
        attn_out, k, v = self.attn(hidden_states=h, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, k_cache=k_cache,
                                   v_cache=v_cache, cache_seqlens=cache_seqlens)
        h = h + attn_out
        h = self.mlp(h) + h
        return h, k, v


class OutputHead(nn.Linear):
    def forward(self, x: PipeTransferData, y: PipeCacheData) -> PipeTransferData:
        x.pp_output = self._forward(x.pp_input)
        return x

    def _forward(self, x: torch.Tensor):
        return super().forward(x)


# --- realhf/impl/model/nn/flatten_param.py, real_llm_api.py (reduced) -------------------------------------------------

@dataclasses.dataclass
class ContiguousParamSpec:
    start_idx: int
    end_idx: int
    shape: torch.Size


def map_param_to_contigous_memory(layers, config, head_param_point_to_embedding, param_spec, contiguous_param,
                                  layer_idx_offset, allocate_only):
    for local_layer_idx, l in enumerate(layers):
        layer_idx = local_layer_idx + layer_idx_offset
        for k, v in l.named_parameters():
            spec = param_spec[f"{layer_idx}.{k}"]
            old_param_data = v.data
            target = contiguous_param[spec.start_idx:spec.end_idx].view(spec.shape)
            if not allocate_only:
                target.copy_(old_param_data)
            else:
                assert old_param_data.shape == torch.Size([0]), (old_param_data.shape, spec.shape, f"{layer_idx}.{k}")
            v.data = target


@dataclasses.dataclass
class ReparallelizeTarget:
    to_param_spec: Dict[str, ContiguousParamSpec]
    to_param_size: int
    to_layers_handle: nn.ModuleList
    to_layer_start_idx: int
    to_layer_end_idx: int


class ReaLModel(nn.Module):
    def __init__(self, config: ReaLModelConfig, dtype, device):
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, device
        self.layer_idx_start, self.layer_idx_end = 0, config.n_layers + 2
        self.head_param_point_to_embedding = False
        self._param_spec, self._param_size = self._build_param_spec()
        self.contiguous_param = None
        self.layers = None
        self._reparallelize_targets: Dict[Tuple[ModelName, ModelName], ReparallelizeTarget] = {}
        self._instantiated = False

    def _build_layer(self, idx: int, config: ReaLModelConfig) -> nn.Module:
        if idx == 0:
            return VocabPositionEmbedding(config, self.dtype, self.device)
        if idx == config.n_layers + 1:
            return OutputHead(config.hidden_dim, config.vocab_size, bias=False, dtype=self.dtype, device=self.device)
        return ReaLModelBlock(config, self.dtype, self.device)

    def _build_param_spec(self):
        spec, offset = {}, 0
        for idx in range(self.layer_idx_start, self.layer_idx_end):
            for k, p in self._build_layer(idx, self.config).named_parameters():
                spec[f"{idx}.{k}"] = ContiguousParamSpec(offset, offset + p.numel(), p.shape)
                offset += p.numel()
        # on CUDA the flat buffer owns its allocator segment, as a real model's weights do
        return spec, max(offset, own_segment_elems(str(self.device)))

    def instantiate(self):
        assert not self._instantiated
        self.layers = nn.ModuleList([self._build_layer(idx, self.config)
                                     for idx in range(self.layer_idx_start, self.layer_idx_end)])
        self.contiguous_param = torch.empty(self._param_size, dtype=self.dtype, device=self.device)
        map_param_to_contigous_memory(self.layers, self.config, self.head_param_point_to_embedding, self._param_spec,
                                      self.contiguous_param, self.layer_idx_start, allocate_only=False)
        self._instantiated = True

    def forward(self, x: PipeTransferData, ys: List[PipeCacheData]) -> Tuple[PipeTransferData, List[PipeCacheData]]:
        for layer, y in zip(self.layers, ys):
            x = layer(x, y)
            x.pp_input = x.pp_output
        return x, ys

    def _forward(self, input_ids, cu_seqlens, position_ids, hidden_states, k_caches, v_caches, cache_seqlens,
                 max_seqlen):
        if k_caches is None:
            assert v_caches is None
            assert cache_seqlens is None
            k_caches = [None] * self.num_layers
            v_caches = [None] * self.num_layers
        h = hidden_states
        for idx, l in enumerate(self.layers):
            if isinstance(l, VocabPositionEmbedding):
                h = l._forward(input_ids, position_ids)
            elif isinstance(l, ReaLModelBlock):
                h, _, _ = l._forward(h, cu_seqlens=cu_seqlens, k_cache=k_caches[idx], v_cache=v_caches[idx],
                                     cache_seqlens=cache_seqlens, max_seqlen=max_seqlen)
            elif isinstance(l, OutputHead):
                h = l._forward(h)
            else:
                raise NotImplementedError(f"Unsupported layer type {type(l)}")
        return h

    @property
    def num_layers(self):
        return self.layer_idx_end - self.layer_idx_start

    def build_reparallelization_plan(self, from_model_name, to_model_name, to_model_config):
        to_layers_handle = nn.ModuleList([self._build_layer(idx, to_model_config)
                                          for idx in range(self.layer_idx_start, self.layer_idx_end)])
        for p in to_layers_handle.parameters():
            p.data = torch.tensor((), dtype=self.dtype, device=self.device)
        self._reparallelize_targets[(from_model_name, to_model_name)] = ReparallelizeTarget(
            to_param_spec=self._param_spec, to_param_size=self._param_size, to_layers_handle=to_layers_handle,
            to_layer_start_idx=self.layer_idx_start, to_layer_end_idx=self.layer_idx_end)

    def build_reparallelized_layers_async(self, from_model_name, to_model_name, to_model_config):
        assert not (is_trainable(from_model_name) and is_trainable(to_model_name))
        assert is_trainable(from_model_name) or is_trainable(to_model_name)
        if (from_model_name, to_model_name) not in self._reparallelize_targets:
            self.build_reparallelization_plan(from_model_name, to_model_name, to_model_config)
        rtgt = self._reparallelize_targets[(from_model_name, to_model_name)]

        # The trainable parameters are kept (the optimizer holds them); the other side is released.
        if not is_trainable(from_model_name):
            dummy_tensor = torch.tensor((), dtype=self.dtype, device=self.device)
            for p in self.layers.parameters():
                p.data = dummy_tensor
            self.contiguous_param = dummy_tensor
            return None, None, 0.0

        to_contiguous_param = torch.zeros(rtgt.to_param_size, dtype=self.dtype, device=self.device)
        map_param_to_contigous_memory(rtgt.to_layers_handle, to_model_config, False, rtgt.to_param_spec,
                                      to_contiguous_param, rtgt.to_layer_start_idx, allocate_only=True)
        # One process: the receiver is the sender, so the broadcast plan reduces to set_intervals of a local slice.
        to_contiguous_param.copy_(self.contiguous_param)
        return rtgt.to_layers_handle, to_contiguous_param, 0.0

    def patch_reparallelization(self, x, eta):
        assert eta == 1.0
        self.layers, self.contiguous_param = x
        assert self.layers is not None
        assert self.contiguous_param is not None
        assert self.contiguous_param.shape[0] > 0


# --- realhf/impl/model/utils/cuda_graph.py (both versions) ------------------------------------------------------------

CUDA_GRAPH_STORAGE: Dict[str, Any] = dict()
CUDA_GRAPH_INPUT_BUFFER: Dict[str, Dict[str, torch.Tensor]] = dict()
CUDA_GRAPH_OUTPUT_BUFFER: Dict[str, Dict[str, torch.Tensor]] = dict()
CUDA_GRAPH_FIRST_CAPTURE: Dict[str, bool] = defaultdict(lambda: True)
CUDA_GRAPH_DESTROYED: Dict[str, bool] = defaultdict(lambda: False)


def reinitialize_input_buffer(cuda_graph_name, new_buf):
    assert cuda_graph_name in CUDA_GRAPH_INPUT_BUFFER, f"CUDAGraph {cuda_graph_name} does not exist."
    buf = CUDA_GRAPH_INPUT_BUFFER[cuda_graph_name]
    for k, v in buf.items():
        if torch.is_tensor(v):
            v.copy_(new_buf[k])
        elif isinstance(v, list):
            for i, vv in enumerate(v):
                if torch.is_tensor(vv):
                    vv.copy_(new_buf[k][i])
        else:
            buf[k] = new_buf[k]


def _capture(name: str, func: Callable, input_buffer: Dict[str, Any], warmup: bool):
    static = {k: input_buffer[k] for k in ("input_ids", "position_ids", "cache_seqlens")}
    state = {f"{kind}[{i}]": t for kind in ("k_caches", "v_caches")
             for i, t in enumerate(input_buffer[kind]) if t is not None}
    return capture(lambda: func(**input_buffer), device=_device, warmups=1 if warmup else 0, static=static,
                   state=state, owner="realhf cuda_graph.capture_func",
                   name=f"{name} bs={input_buffer['input_ids'].shape[0]}")


@torch.no_grad()
def capture_func(name: str, func: Callable, input_buffer: Dict[str, Any], force_recapture: bool = False,
                 no_grad: bool = False):
    if _variant == "bug":
        if not force_recapture:
            if name in CUDA_GRAPH_STORAGE:
                reinitialize_input_buffer(name, input_buffer)
                assert name in CUDA_GRAPH_INPUT_BUFFER
                assert name in CUDA_GRAPH_OUTPUT_BUFFER
                return CUDA_GRAPH_STORAGE[name], CUDA_GRAPH_INPUT_BUFFER[name], CUDA_GRAPH_OUTPUT_BUFFER[name]
        graph, output = _capture(name, func, input_buffer, warmup=True)
    else:
        if not force_recapture and not CUDA_GRAPH_FIRST_CAPTURE[name]:
            assert name in CUDA_GRAPH_STORAGE
            reinitialize_input_buffer(name, input_buffer)
            return CUDA_GRAPH_STORAGE[name], CUDA_GRAPH_INPUT_BUFFER[name], CUDA_GRAPH_OUTPUT_BUFFER[name]
        first_capture = CUDA_GRAPH_FIRST_CAPTURE[name]
        graph, output = _capture(name, func, input_buffer, warmup=first_capture)

    assert torch.is_tensor(output)
    output_buffer = dict(output=output)
    CUDA_GRAPH_STORAGE[name] = graph
    CUDA_GRAPH_INPUT_BUFFER[name] = input_buffer
    CUDA_GRAPH_OUTPUT_BUFFER[name] = output_buffer
    CUDA_GRAPH_FIRST_CAPTURE[name] = False
    CUDA_GRAPH_DESTROYED[name] = False
    return graph, input_buffer, output_buffer


def input_buffer_handle(graph_name: str, tensor_name: str):
    if graph_name not in CUDA_GRAPH_INPUT_BUFFER:
        return None
    if _variant == "fix" and CUDA_GRAPH_DESTROYED[graph_name]:
        return None
    return CUDA_GRAPH_INPUT_BUFFER[graph_name][tensor_name]


def destroy(name):
    assert name in CUDA_GRAPH_STORAGE and not CUDA_GRAPH_FIRST_CAPTURE[name]
    assert CUDA_GRAPH_DESTROYED[name] is False, f"CUDAGraph {name} already destroyed."
    CUDA_GRAPH_STORAGE[name].reset()
    CUDA_GRAPH_STORAGE[name] = None
    CUDA_GRAPH_INPUT_BUFFER[name] = None
    CUDA_GRAPH_OUTPUT_BUFFER[name] = None
    CUDA_GRAPH_DESTROYED[name] = True


def _reset_cuda_graph_module():
    for table in (CUDA_GRAPH_STORAGE, CUDA_GRAPH_INPUT_BUFFER, CUDA_GRAPH_OUTPUT_BUFFER, CUDA_GRAPH_FIRST_CAPTURE,
                  CUDA_GRAPH_DESTROYED):
        table.clear()


# --- realhf/impl/model/nn/real_llm_generate.py (reduced) --------------------------------------------------------------

def genstep(next_token_logits, unfinished_sequences, generated_idx: int, gconfig: GenerationHyperparameters):
    distrb = torch.distributions.Categorical(logits=next_token_logits)
    next_tokens = distrb.mode if gconfig.greedy else distrb.sample()
    logprob = distrb.log_prob(next_tokens)
    terminate = generated_idx >= gconfig.max_new_tokens - 1
    return next_tokens, logprob, None, terminate, unfinished_sequences


def prepare_generate_inputs(module: ReaLModel, gconfig, x: PipeTransferData, ys: List[PipeCacheData],
                            cuda_graph_name: str):
    cu_seqlens = x.cu_seqlens
    input_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    layer_indices = range(module.layer_idx_start, module.layer_idx_end)
    min_layer_index = module.layer_idx_start
    bs = input_lens.shape[0]
    cache_seqlens = input_lens.clone().to(dtype=torch.int32)

    layer_indices = layer_indices[1:]           # first pipeline stage
    ys[0].cache_seqlens = cache_seqlens
    block_ys = ys[1:]
    layer_indices = layer_indices[:-1]          # last pipeline stage
    ys[-1].cache_seqlens = cache_seqlens
    block_ys = block_ys[:-1]

    for y, layer_idx in zip(block_ys, layer_indices):
        kvcache_seqlen = max(max_prompt_len() + gconfig.max_new_tokens,
                             module.config.hidden_dim // module.config.head_dim + 10)
        k_cache_handle = input_buffer_handle(cuda_graph_name, "k_caches")
        v_cache_handle = input_buffer_handle(cuda_graph_name, "v_caches")
        if k_cache_handle is not None and v_cache_handle is not None:
            k_cache = k_cache_handle[layer_idx - min_layer_index][:bs, :kvcache_seqlen]
            v_cache = v_cache_handle[layer_idx - min_layer_index][:bs, :kvcache_seqlen]
        else:
            k_cache = torch.zeros((bs, kvcache_seqlen, *y.k_cache.shape[1:]), dtype=y.k_cache.dtype,
                                  device=y.k_cache.device)
            v_cache = torch.zeros((bs, kvcache_seqlen, *y.v_cache.shape[1:]), dtype=y.v_cache.dtype,
                                  device=y.v_cache.device)
        indices = (torch.arange(kvcache_seqlen, device=module.device, dtype=torch.long)[None, :]
                   < input_lens[:, None])
        k_cache[indices] = y.k_cache
        v_cache[indices] = y.v_cache
        y.k_cache = k_cache
        y.v_cache = v_cache
        y.cache_seqlens = cache_seqlens
    return x, ys


def maybe_capture_cudagraph(module: ReaLModel, x: PipeTransferData, ys: List[PipeCacheData], cuda_graph_name: str,
                            force_recapture: bool = False):
    bs = x.cu_seqlens.shape[0] - 1
    cache_seqlens = ys[0].cache_seqlens
    input_buffers = dict(
        input_ids=torch.ones((bs,), dtype=torch.long, device=module.device),
        position_ids=cache_seqlens.clone(),
        k_caches=[y.k_cache for y in ys],
        v_caches=[y.v_cache for y in ys],
        cache_seqlens=cache_seqlens.clone(),
        max_seqlen=x.max_seqlen,
        cu_seqlens=x.cu_seqlens.clone(),
        hidden_states=None,
    )
    graph, input_buffers, output_buffers = capture_func(
        cuda_graph_name,
        module._forward,
        input_buffers,
        force_recapture=force_recapture if _variant == "fix" else False,
        no_grad=True,
    )
    return graph, input_buffers, output_buffers


@torch.no_grad()
def generate(model: ReaLModel, packed_input_ids, cu_seqlens, max_seqlen, gconfig: GenerationHyperparameters):
    bs = cu_seqlens.shape[0] - 1
    device = model.device
    generated_idx = 0
    unfinished_sequences = torch.ones(bs, dtype=torch.long, device=device)
    gen_token_ph, gen_logprob_ph = [], []

    x = PipeTransferData(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, store_kv_cache=True)
    ys = [PipeCacheData(packed_input_ids=packed_input_ids)] + [PipeCacheData()
                                                              for _ in range(model.config.n_layers + 1)]
    prompt_logits = model(x, ys)[0].pp_output
    logits = prompt_logits[cu_seqlens[1:].long() - 1]
    next_tokens, logprob, _, terminate, unfinished_sequences = genstep(logits, unfinished_sequences, generated_idx,
                                                                       gconfig)
    gen_token_ph.append(next_tokens)
    gen_logprob_ph.append(logprob)
    generated_idx += 1

    cuda_graph_name = "decoding"
    x, ys = prepare_generate_inputs(model, gconfig, x, ys, cuda_graph_name)
    graph = None
    if gconfig.use_cuda_graph:
        if _variant == "bug":
            graph, input_buffers, output_buffers = maybe_capture_cudagraph(model, x, ys, cuda_graph_name)
        else:
            graph, input_buffers, output_buffers = maybe_capture_cudagraph(
                model, x, ys, cuda_graph_name, force_recapture=gconfig.force_cudagraph_recapture)

    while not terminate:
        if graph is not None:
            input_buffers["input_ids"][:bs].copy_(next_tokens, non_blocking=True)
            input_buffers["position_ids"][:bs].copy_(ys[0].cache_seqlens, non_blocking=True)
            input_buffers["cache_seqlens"][:bs].copy_(ys[0].cache_seqlens, non_blocking=True)
            logits = replay(graph, output_buffers["output"])[:bs].squeeze(1)
        else:
            ys[0].packed_input_ids = next_tokens
            ys[0].packed_position_ids = None
            x.cu_seqlens = torch.arange(bs + 1, dtype=torch.int32, device=device)
            x.max_seqlen = 1
            logits = model(x, ys)[0].pp_output.squeeze(dim=1)

        ys[0].cache_seqlens += 1        # the global handle: every layer's cache_seqlens advances
        next_tokens, logprob, _, terminate, unfinished_sequences = genstep(logits, unfinished_sequences,
                                                                           generated_idx, gconfig)
        gen_token_ph.append(next_tokens)
        gen_logprob_ph.append(logprob)
        generated_idx += 1

    gen_tokens = torch.stack(gen_token_ph, -1)
    log_probs = torch.stack(gen_logprob_ph, -1)
    if _variant == "fix" and gconfig.use_cuda_graph and gconfig.force_cudagraph_recapture:
        destroy(cuda_graph_name)
    return gen_tokens, log_probs, None, ys[1:-1], prompt_logits


# --- realhf/impl/model/interface/ppo_interface.py (reduced actor) -----------------------------------------------------

class PPOActorInterface:
    def __init__(self, gconfig: GenerationHyperparameters, eps_clip: float = 0.2):
        self.gconfig, self.eps_clip = gconfig, eps_clip

    def generate(self, model: ReaLModel, packed_input_ids, cu_seqlens):
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        gen_tokens, logprobs, _, _, _ = generate(model, packed_input_ids, cu_seqlens, max_seqlen, self.gconfig)
        return gen_tokens, logprobs

    def train_step(self, model: ReaLModel, optimizer, packed_input_ids, cu_seqlens, gen_tokens, old_logp):
        prompt_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        gen_len = gen_tokens.shape[1]
        seqs, starts, offset = [], [], 0
        for i, n in enumerate(prompt_lens):
            seqs.append(torch.cat([packed_input_ids[cu_seqlens[i]:cu_seqlens[i + 1]], gen_tokens[i]]))
            starts.append(offset + n - 1)
            offset += n + gen_len
        packed = torch.cat(seqs)
        seq_cu = torch.tensor([0] + [sum(prompt_lens[:i + 1]) + (i + 1) * gen_len for i in range(len(prompt_lens))],
                              dtype=torch.int32, device=packed.device)
        x = PipeTransferData(cu_seqlens=seq_cu, max_seqlen=max(prompt_lens) + gen_len)
        ys = [PipeCacheData(packed_input_ids=packed)] + [PipeCacheData() for _ in range(model.config.n_layers + 1)]
        logits = model(x, ys)[0].pp_output
        logp_all = torch.log_softmax(logits, dim=-1)
        idx = torch.tensor([[s + j for j in range(gen_len)] for s in starts], device=packed.device)
        new_logp = logp_all[idx, gen_tokens]
        rewards = (gen_tokens.to(DTYPE) / VOCAB).mean(-1)
        adv = (rewards - rewards.mean())[:, None]
        ratio = torch.exp(new_logp - old_logp)
        loss = -torch.min(ratio * adv, ratio.clamp(1 - self.eps_clip, 1 + self.eps_clip) * adv).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()


# --- realhf/system/model_worker.py (reduced: one process holds actor_train and actor_gen) -----------------------------

class ModelWorker:
    def __init__(self, models: Dict[ModelName, ReaLModel], device: str):
        self.__unwrapped_models = models
        self.__models = models
        self.__model_is_handle = {name: not m._instantiated for name, m in models.items()}
        self.device = device
        self.cuda_cache_cleanliness = True

    def handle_rpc_hook(self, hook: str, hook_data: Dict[str, Any]):
        self.__handle_one_rpc_hook(hook, hook_data)

    def __handle_one_rpc_hook(self, hook: str, hook_data: Dict[str, Any]):
        if hook == "param_realloc":
            from_model_name: ModelName = hook_data["from_model_name"]
            to_model_name: ModelName = hook_data["to_model_name"]
            to_model_config = hook_data["to_model_config"]
            if from_model_name in self.__unwrapped_models:
                m = self.__unwrapped_models[from_model_name]
            else:
                m = self.__unwrapped_models[to_model_name]
            new_layers, new_param, _ = m.build_reparallelized_layers_async(
                from_model_name=from_model_name, to_model_name=to_model_name, to_model_config=to_model_config)
            if from_model_name in self.__models and not is_trainable(from_model_name):
                self.__model_is_handle[from_model_name] = True
            if to_model_name in self.__models and is_trainable(from_model_name):
                self.__unwrapped_models[to_model_name].patch_reparallelization((new_layers, new_param),
                                                                               eta=hook_data["eta"])
                self.__model_is_handle[to_model_name] = False
        else:
            raise NotImplementedError(f"Unknown hook {hook}.")

    def clear_data_cache(self):
        if self.cuda_cache_cleanliness:
            gc.collect()
            release_to_driver(self.device)
            gc.collect()


def _serve(device: str, use_cuda_graph: bool):
    global _device
    _device = device
    _reset_cuda_graph_module()
    config = ReaLModelConfig()
    actor_train, actor_gen = ModelName("actor", 0), ModelName("actor", 1)
    _TRAINABLE.clear()
    _TRAINABLE.update({actor_train: True, actor_gen: False})

    train_model = ReaLModel(config, DTYPE, torch.device(device))
    train_model.instantiate()
    gen_ = generator(49)
    train_model.contiguous_param.copy_(randn(train_model._param_size, gen=gen_, device=device, scale=0.5))  # SFT ckpt
    gen_model = ReaLModel(config, DTYPE, torch.device(device))                                                # a handle
    optimizer = torch.optim.SGD(train_model.parameters(), lr=0.5)
    worker = ModelWorker({actor_train: train_model, actor_gen: gen_model}, device)
    interface = PPOActorInterface(GenerationHyperparameters(use_cuda_graph=use_cuda_graph))

    prompts = [torch.randint(0, VOCAB, (n,), generator=gen_) for n in PROMPT_LENS]
    packed_input_ids = torch.cat(prompts).to(device)
    cu_seqlens = torch.tensor([0, *torch.tensor(PROMPT_LENS).cumsum(0).tolist()], dtype=torch.int32, device=device)

    outs = []
    for _ in range(PPO_STEPS):
        worker.handle_rpc_hook("param_realloc", dict(from_model_name=actor_train, to_model_name=actor_gen,
                                                     to_model_config=config, eta=1.0))
        gen_tokens, logprobs = interface.generate(gen_model, packed_input_ids, cu_seqlens)
        outs += [gen_tokens.to(DTYPE), logprobs.clone()]
        worker.handle_rpc_hook("param_realloc", dict(from_model_name=actor_gen, to_model_name=actor_train,
                                                     to_model_config=config, eta=1.0))
        loss = interface.train_step(train_model, optimizer, packed_input_ids, cu_seqlens, gen_tokens, logprobs)
        outs.append(loss.reshape(1))
        worker.clear_data_cache()
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: _serve(device, True), lambda: _serve(device, False))
