"""Local partial MoE graphs: the postprocess runner is warmed up and captured on the dispatcher tensors that the router capture left bound.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/3373 ("RL: Hybrid MoE training cudagraphs and fix training <->
inference transition", NVIDIA/Megatron-LM, commit e19fbe2e1d, merged 2026-03-06).
Symptom: the PR reports no separate symptom for this hunk. Its comment states the failure: "During graph warmup, the
router capture leaves these attrs pointing into cudagraph pool memory; restoring them here ensures the postprocess
graph captures with valid pointers". With ``cuda_graph_impl="local"`` and ``cuda_graph_scope`` holding
``moe_router`` + ``moe_preprocess`` (the training scope that the PR's RL loop sets, so ``use_partial_cudagraphs``),
``create_cudagraphs()`` warms up each MoE layer's postprocess runner on routing indices that nothing has computed.
The unpermute then scatters with whatever the graph pool's memory holds. Out-of-range bytes give a device-side
assert while the graphs are built (an illegal memory access with TE's fused kernel); in-range bytes pass unnoticed.
Here the engine's poison gives an out-of-bounds index. Eager training (``cuda_graph_impl="none"``) is correct.
Mechanism (megatron/core/transformer/transformer_layer.py, ``MoETransformerLayer``, and cuda_graphs.py):
``create_mcore_cudagraph_manager`` wraps ``_forward_mlp_router`` in ``cudagraph_manager_router`` and
``_forward_mlp_postprocess`` in ``cudagraph_manager_postprocess``; the expert dispatch between them runs eagerly.
The router step (``MoELayer`` with ``fwd_execution_map = "route"``) runs ``MoEAlltoAllTokenDispatcher.
dispatch_preprocess``, which binds dispatcher attributes to new tensors (``routing_map``, ``tokens_per_expert``,
``num_global_tokens_per_local_expert``, and from ``permute`` the ``reversed_local_input_permutation_mapping``).
``_forward_mlp_router`` then copies each tensor attribute in ``cudagraph_attrs`` into the layer's persistent dict
``token_dispatcher_attrs``. The first call stores the tensor itself (``attr.detach()``); later calls ``copy_`` into
it. Only ``_forward_mlp_expert_compute`` rebinds the dispatcher to those persistent copies.
``combine_postprocess`` (the postprocess step) calls ``unpermute`` with whatever the dispatcher holds at that moment.
The first training step runs eagerly and only records the runners. At its end, ``create_cudagraphs()``
(``_CudagraphGlobalRecord.create_cudagraphs``) calls ``_CudaGraphRunner.create_fwd_graph`` for each recorded runner
in execution order, all into one ``global_mempool``: warmups on zero copies of the inputs, then the capture. The
router runner's capture runs ``dispatch_preprocess`` again, so the dispatcher attributes now point at tensors the
capture allocated in the graph pool. A capture computes nothing, so these tensors hold no routing until the first
replay. The postprocess runner of the same layer comes next. Its warmups and its capture run
``_forward_mlp_postprocess`` with the dispatcher still bound to those capture-time tensors: ``unpermute`` scatters
with a ``reversed_local_input_permutation_mapping`` that was never computed. Had it survived, the postprocess graph
would hold the pool addresses, not the persistent copies that eager steps use. The first eager expert step after
capture rebinds the dispatcher to the persistent copies and releases those addresses to the pool.
(Each router replay rewrites them just before its postprocess replay, with only eager expert compute in between.
So the replays would read this step's routing, and the failure shows at graph creation.)
Doctor: warmup-divergence, at _forward_mlp_postprocess. The router runner's capture decided the dispatcher's tensor
references, the capture-time pool tensors that it never computed. The postprocess warmups and capture reuse that
binding, while every eager step rebinds the dispatcher to the persistent ``token_dispatcher_attrs``. The fix makes
``_forward_mlp_postprocess`` take the eager step's binding itself.
Fix (upstream): at the top of ``_forward_mlp_postprocess``, ``for name, attr in self.token_dispatcher_attrs.items():
setattr(self.mlp.token_dispatcher, name, attr)``. The postprocess warmup then reads the copies that the router's
warmup filled, and the capture takes the persistent buffers, which every router replay updates through its captured
``copy_``. The same diff also makes ``_forward_mlp`` rebind right after the router call, behind
``self._router_dtoh_event.record(); self._router_dtoh_event.synchronize()``; both hunks are modelled.
Modelled: two ``MoETransformerLayer``s with only the MLP half (no attention). Each has a pre-MLP LayerNorm, a
softmax-after-top-k ``TopKRouter`` (4 experts, top-2), the ``MoEAlltoAllTokenDispatcher`` at EP = TP = 1 (the
all-to-alls are identities and ``sort_chunks_by_idxs`` keeps its upstream form), a ``SequentialMLP`` of GELU
experts that apply the probs after the activation, and bias-dropout-add with dropout 0. ``permute`` is the PR's
argsort form, which this same diff made capturable. ``unpermute`` is the unfused ``scatter_add_``
(``moe_permute_fusion=False``); TE's fused kernel would read its row-id map the same way. The steps are
forward-only with autograd off, and the schedule calls ``create_cudagraphs()`` at the end of the first step, as
``forward_backward_no_pipelining`` does. Backward graphs, DDP hooks, FP8, the buffer-reuse metadata between graphs
and the RL inference/training scope switch are left out. ``maybe_move_tensor_to_cpu`` is a blocking ``.cpu()``
(upstream: a side-stream copy plus an event). ``all_to_all`` is Megatron's world-size-1 shortcut.
``torch.cuda.Event`` is a stand-in over ``synchronize``. ``create_cudagraphs`` keeps its ``gc.collect()`` and
``torch.cuda.empty_cache()``. On CUDA the postprocess warmup reads whatever the pool's memory holds. On an H200, in a
fresh process, it read zeros (in-range indices), so there the bug variant passes and equals eager: every router
replay rewrites the tensors before its postprocess replay. Upstream the pool is not fresh: with persistent inference
graphs, the training captures share ``global_mempool`` with the graphs that the rollouts replayed. On the CPU the
warmup reads the capture's poison and raises.
"""
from __future__ import annotations

import enum
import gc

import torch
import torch.nn.functional as F

from workbench.engine import events, graph_pool_handle, synchronize
from workbench.zoo.kit import capture, compare, generator, release_to_driver, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/3373"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_forward_mlp_postprocess"
SYMPTOM = ("local partial MoE graphs: create_cudagraphs() warms up and captures the postprocess runner on the "
           "routing the router capture left on the dispatcher (never computed); the unpermute scatters with "
           "garbage indices while the graphs are built")

SEQ, BATCH, HIDDEN, FFN_HIDDEN, NUM_EXPERTS, TOPK, NUM_LAYERS, STEPS = 6, 1, 8, 12, 4, 2, 2, 4
_DEVICE = "cpu"


# --- megatron/core/transformer/enums.py, transformer_config.py ------------------------------------------------

class CudaGraphScope(enum.Enum):
    attn = enum.auto()
    mlp = enum.auto()
    moe = enum.auto()
    moe_router = enum.auto()
    moe_preprocess = enum.auto()


class TransformerConfig:
    """The fields of megatron.core.transformer.TransformerConfig this layer reads (upstream: a dataclass)."""

    def __init__(self, cuda_graph_impl="none", cuda_graph_scope=None, cuda_graph_warmup_steps=3):
        self.hidden_size, self.ffn_hidden_size = HIDDEN, FFN_HIDDEN
        self.num_moe_experts, self.moe_router_topk = NUM_EXPERTS, TOPK
        self.moe_permute_fusion = False
        self.moe_pad_expert_input_to_capacity = False
        self.moe_expert_capacity_factor = None
        self.moe_router_padding_for_quantization = False
        self.layernorm_epsilon, self.hidden_dropout = 1e-5, 0.0
        self.cuda_graph_impl = cuda_graph_impl
        self.cuda_graph_scope = list(cuda_graph_scope or [])
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps


# --- megatron/core/transformer/cuda_graphs.py (local CUDA graphs, before e19fbe2e1d) --------------------------

class _GraphStatus(enum.Enum):
    FWD_READY = 0
    BWD_READY = 1


class ArgMetadata:
    """Arg meta: the shape/dtype of a tensor argument, or a non-tensor argument itself."""

    def __init__(self, arg):
        self.type = type(arg)
        if isinstance(arg, torch.Tensor):
            self.shape, self.dtype, self.device = arg.shape, arg.dtype, arg.device
        else:
            self.value = arg

    def zeros_like(self):
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


def tree_map(func, tree):
    if isinstance(tree, (tuple, list)):
        return type(tree)(tree_map(func, t) for t in tree)
    if isinstance(tree, dict):
        return {k: tree_map(func, v) for k, v in tree.items()}
    return func(tree)


class _CudagraphGlobalRecord:
    """Records the first fwd pass of every runner, so that 'create_cudagraphs' creates the graphs in execution
    order, which is required for cudagraphs sharing a mempool."""

    cudagraph_created = False
    cudagraph_record: list[tuple] = []

    @classmethod
    def record_fwd_graph(cls, runner, args, kwargs, out):
        cls.cudagraph_record.append((runner, "fwd", args, kwargs, out))

    @classmethod
    def create_cudagraphs(cls):
        if cls.cudagraph_created or len(cls.cudagraph_record) == 0:
            return
        gc.collect()
        release_to_driver(_DEVICE)          # torch.cuda.empty_cache()
        for runner, graph_type, args, kwargs, out in cls.cudagraph_record:
            assert graph_type == "fwd"
            runner.create_fwd_graph(args, kwargs, out, clone_inputs=True)
        for g in cls.cudagraph_record:
            g[0].cudagraph_created = True
        cls.cudagraph_created = True
        cls.cudagraph_record = []


def create_cudagraphs():
    """Called at the end of each schedule function (forward_backward_no_pipelining): during the first step the
    runners record their order; here each runner's graph is created in that order."""
    return _CudagraphGlobalRecord.create_cudagraphs()


def delete_cuda_graphs():
    """Delete all CUDA graphs."""
    _CudagraphGlobalRecord.cudagraph_created = False
    _CudagraphGlobalRecord.cudagraph_record = []
    CudaGraphManager.global_mempool = None


class _CudaGraphRunner:
    """Represents the execution of a cudagraphed module for a single microbatch."""

    def __init__(self, base_module, mempool, fwd_graph_input_args, fwd_graph_input_kwargs, func, need_backward):
        self.base_module = base_module
        self.mempool = mempool
        self.fwd_graph_input_arg_metas = [ArgMetadata(a) for a in fwd_graph_input_args]
        self.fwd_graph = None
        self.fwd_graph_recorded = False
        self.cudagraph_created = False
        self.status = _GraphStatus.FWD_READY
        self.grad_enabled = need_backward and torch.is_grad_enabled()
        self.func = func
        self.num_warmup_steps = base_module.config.cuda_graph_warmup_steps
        self.name = f"layer {base_module.layer_number} {func.__name__}"

    def create_fwd_graph(self, args, kwargs, outputs=None, clone_inputs=True):
        """Create a fwd cudagraph for this runner. Should be called inside 'create_cudagraphs()'."""

        def _resolve_input_buffer(ten):
            if not isinstance(ten, ArgMetadata):
                return ten
            if ten.type is not torch.Tensor:
                return ten.value
            return ten.zeros_like()     # a fresh buffer from _CudagraphGlobalRecord.tensor_reuse_pool

        self.fwd_graph_input_args = tree_map(_resolve_input_buffer, args)
        self.fwd_graph_input_kwargs = tree_map(_resolve_input_buffer, kwargs)
        self.fwd_graph_input_surface = self.get_tensors(self.fwd_graph_input_args, self.fwd_graph_input_kwargs)

        def clone_ten(ten):
            if not torch.is_tensor(ten):
                return ten
            return torch.zeros_like(ten)

        # warmup again as case graph capture mode may execute a different codepath
        for _ in range(self.num_warmup_steps):
            with events.warmup():
                warmup_args = tree_map(clone_ten, self.fwd_graph_input_args)
                warmup_kwargs = tree_map(clone_ten, self.fwd_graph_input_kwargs)
                self.func(*warmup_args, **warmup_kwargs)

        # with torch.cuda.graph(self.fwd_graph, pool=self.mempool, capture_error_mode="thread_local"):
        self.fwd_graph, fwd_graph_outputs = capture(
            lambda: self.func(*self.fwd_graph_input_args, **self.fwd_graph_input_kwargs), device=_DEVICE,
            pool=self.mempool, warmups=0, name=self.name, owner="_CudaGraphRunner",
            static={f"{self.name} input {i}": t for i, t in enumerate(self.fwd_graph_input_surface)},
            state=self.base_module.persistent_state(self.func.__name__))
        self.fwd_graph_outputs = fwd_graph_outputs
        self.fwd_graph_output_surface = self.get_tensors(fwd_graph_outputs)

    def record_graph_capture(self, args, kwargs):
        """Records the data needed to create this runner's forward cudagraph; runs the pass eagerly."""
        out = self.func(*args, **kwargs)
        if type(out) != tuple:
            out = (out,)
        if not self.fwd_graph_recorded:
            meta = lambda a: ArgMetadata(a)     # noqa: E731
            _CudagraphGlobalRecord.record_fwd_graph(self, tree_map(meta, args), tree_map(meta, kwargs),
                                                    tree_map(meta, out))
            self.fwd_graph_recorded = True
        return out[0] if len(out) == 1 else tuple(out)

    def replay_graph_capture(self, is_first_microbatch, args, kwargs):
        """Replay the fwd cuda graph (_CudagraphReplayNode.forward): copy new data into the input buffers."""
        for user_input, cudagraph_input in zip(self.get_tensors(args, kwargs), self.fwd_graph_input_surface):
            cudagraph_input.copy_(user_input)
        out = replay(self.fwd_graph, tuple(self.fwd_graph_output_surface))
        out_iter = iter(out)
        fwd_outputs = self.to_list(self.fwd_graph_outputs)
        result = tuple(next(out_iter) if torch.is_tensor(o) else o for o in fwd_outputs)
        return result[0] if len(result) == 1 else result

    def get_mismatch_errors(self, args, kwargs):
        errors = []
        for a, m in zip(args, self.fwd_graph_input_arg_metas):
            if torch.is_tensor(a) != (m.type is torch.Tensor) or (torch.is_tensor(a) and a.shape != m.shape):
                errors.append(f"  - Tensor mismatch: Received {type(a)} but expected {m.type}")
        return errors

    @staticmethod
    def to_list(x):
        return list(x) if isinstance(x, (tuple, list)) else [x]

    def get_tensors(self, args, kwargs=None):
        flat = self.to_list(args) + list((kwargs or {}).values())
        out = []
        for a in flat:
            if isinstance(a, (tuple, list)):
                out += self.get_tensors(a)
            elif torch.is_tensor(a):
                out.append(a)
        return out


class CudaGraphManager:
    """Creates and runs cudagraphs for a megatron module."""

    global_mempool = None

    def __init__(self, config, base_module=None, function_name=None, need_backward=True):
        self.need_backward = need_backward
        self.training = True
        func = getattr(base_module, function_name)

        def wrapped_func(*args, **kwargs):
            return self(base_module, args, kwargs)

        setattr(base_module, function_name, wrapped_func)
        self.func = func
        self.cudagraph_runners: list[_CudaGraphRunner] = []
        self.is_first_microbatch = False
        self.reuse_cudagraphs = True      # parallel_state.get_pipeline_model_parallel_world_size() == 1
        if CudaGraphManager.global_mempool is None:
            CudaGraphManager.global_mempool = graph_pool_handle(_DEVICE)

    def get_cudagraph_runner(self, megatron_module, args, kwargs, reuse_cudagraphs):
        require_grad = self.need_backward and torch.is_grad_enabled()

        def is_valid(r):
            return (r.status == _GraphStatus.FWD_READY and not r.get_mismatch_errors(args, kwargs)
                    and (not require_grad or r.grad_enabled))

        runner = next((r for r in self.cudagraph_runners if is_valid(r)), None)
        if runner is None:
            assert not _CudagraphGlobalRecord.cudagraph_created, "no matching cudagraph runner"
            runner = _CudaGraphRunner(megatron_module, CudaGraphManager.global_mempool, args, kwargs, self.func,
                                      self.need_backward)
            self.cudagraph_runners.append(runner)
        return runner

    def __call__(self, megatron_module, args, kwargs):
        if _CudagraphGlobalRecord.cudagraph_created:
            runner = self.get_cudagraph_runner(megatron_module, args, kwargs, self.reuse_cudagraphs)
            out = runner.replay_graph_capture(self.is_first_microbatch, args, kwargs)
        elif self.training:
            runner = self.get_cudagraph_runner(megatron_module, args, kwargs, self.reuse_cudagraphs)
            out = runner.record_graph_capture(args, kwargs)
        else:
            return self.func(*args, **kwargs)
        # If forward only, next replay should be a forward pass as well
        runner.status = _GraphStatus.FWD_READY if not torch.is_grad_enabled() else _GraphStatus.BWD_READY
        return out


class _Event:
    """torch.cuda.Event stand-in (``_router_dtoh_event``): record, then wait for the work queued before it."""

    def record(self):
        pass

    def synchronize(self):
        synchronize(_DEVICE)


# --- megatron/core/transformer/moe/moe_utils.py (permute at e19fbe2e1d: argsort form) -------------------------

def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
    """Permute the tokens and probs based on the mask (dropless, unfused path)."""
    num_tokens, hidden = tokens.shape
    permuted_probs = None
    assert num_out_tokens is not None, "num_out_tokens is required for the argsort-based permute"
    # mask [num_tokens, num_experts] -> [num_experts, num_tokens]
    routing_map = routing_map.bool().T.contiguous()
    # Use argsort to get indices of non-zero entries in row-major order (fixed-shape, capturable).
    flat_sorted = routing_map.reshape(-1).argsort(descending=True, stable=True)
    flat_sorted = flat_sorted[:num_out_tokens]
    sorted_indices = flat_sorted % num_tokens
    if probs is not None:
        permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted]
    # use the mapping to permute the tokens
    permuted_input = tokens.index_select(0, sorted_indices)
    return permuted_input, permuted_probs, sorted_indices, None, None


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
              drop_and_pad=False):
    """Restore the original order of tokens after permutation (unfused path, no probs)."""
    _, hidden = restore_shape
    input_dtype = permuted_tokens.dtype
    # Create an output tensor filled with zeros
    output_tokens = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    # Scatter add the permuted_input back to the original positions
    output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return output_tokens.to(dtype=input_dtype)


def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """Split and sort the input tensor based on the split_sizes and sorted indices."""
    split_sizes, sorted_idxs = split_sizes.tolist(), sorted_idxs.tolist()
    input = torch.split(input, split_sizes, dim=0)
    output = torch.cat([input[i] for i in sorted_idxs], dim=0)
    if probs is not None:
        probs = torch.split(probs, split_sizes, dim=0)
        permuted_probs = torch.cat([probs[i] for i in sorted_idxs], dim=0)
    else:
        permuted_probs = None
    return output, permuted_probs


def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
    return tensor


def all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None):
    world_size = 1                      # expert-parallel size 1
    if world_size == 1:
        return input_


# --- megatron/core/transformer/moe/router.py, experts.py -----------------------------------------------------

class TopKRouter:
    def __init__(self, config, weight):
        self.config, self.weight = config, weight        # [num_experts, hidden]

    def __call__(self, input, padding_mask=None):
        logits = F.linear(input, self.weight).view(-1, self.config.num_moe_experts)
        # topk_softmax_with_capacity, softmax after top-k (moe_router_pre_softmax=False)
        scores, top_indices = torch.topk(logits, k=self.config.moe_router_topk, dim=1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return routing_probs, routing_map


class MLP:
    def __init__(self, fc1, fc2):
        self.fc1, self.fc2 = fc1, fc2

    def __call__(self, hidden_states, permuted_probs):
        intermediate = F.gelu(hidden_states @ self.fc1)
        intermediate = intermediate * permuted_probs.unsqueeze(-1)
        return intermediate @ self.fc2, None


class SequentialMLP:
    def __init__(self, num_local_experts, config, weights, prefix):
        self.local_experts = [MLP(weights[f"{prefix}.experts.{e}.fc1"], weights[f"{prefix}.experts.{e}.fc2"])
                              for e in range(num_local_experts)]

    def __call__(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        tokens_per_expert = tokens_per_expert.tolist()
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)
        probs_list = torch.split(permuted_probs, tokens_per_expert)
        output_local_list = [expert(tokens, probs)[0]
                             for expert, tokens, probs in zip(self.local_experts, tokens_list, probs_list)]
        return torch.cat(output_local_list, dim=0), None


# --- megatron/core/transformer/moe/token_dispatcher.py -----------------------------------------------------

class MoEAlltoAllTokenDispatcher:
    """AlltoAll-based token dispatcher (EP = TP = 1)."""

    def __init__(self, num_local_experts, local_expert_indices, config):
        self.config = config
        self.tp_size = self.ep_size = 1
        self.num_local_experts = num_local_experts
        self.num_experts = config.num_moe_experts
        self.local_expert_indices = local_expert_indices
        self.input_splits = self.output_splits = self.output_splits_tp = None
        self.permute_idx_device = "cpu"     # (torch.device("cuda") with moe_permute_fusion)
        input_chunk_idxs = torch.arange(self.num_experts * self.tp_size, device=self.permute_idx_device)
        self.sort_input_by_local_experts = input_chunk_idxs.reshape(-1, self.num_local_experts).T.ravel()
        self.restore_output_by_local_experts = input_chunk_idxs.reshape(self.num_local_experts, -1).T.ravel()
        self.drop_and_pad = self.config.moe_pad_expert_input_to_capacity
        self.cuda_sync_point = "no_sync"
        self.cuda_dtoh_point = "before_permutation_1"
        if config.cuda_graph_impl != "none" and (
            CudaGraphScope.moe_preprocess in config.cuda_graph_scope or not self.config.cuda_graph_scope
        ):
            self.cuda_dtoh_point = "before_ep_alltoall"
        self.tokens_per_expert = None
        self.num_out_tokens = None
        self.num_global_tokens_per_local_expert = None
        self.reversed_local_input_permutation_mapping = None
        self.routing_map = None
        # Attributes that need to be captured in cudagraph.
        self.cudagraph_attrs = [
            'tokens_per_expert',
            'input_splits',
            'output_splits',
            'output_splits_tp',
            'num_out_tokens',
            'num_global_tokens_per_local_expert',
            'reversed_local_input_permutation_mapping',
            'routing_map',
        ]
        self.shared_experts = None

    def preprocess(self, routing_map):
        # [num_experts], number of tokens assigned to each expert from the current rank's input.
        num_local_tokens_per_expert = routing_map.sum(dim=0).long()
        # For dropless training, output size is static (num_tokens * topk)
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        num_global_tokens_per_local_expert = num_local_tokens_per_expert.reshape(self.num_experts)
        num_tokens_per_local_expert = num_local_tokens_per_expert
        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert = num_global_tokens_per_local_expert.view(
                -1, self.num_local_experts)
        return num_tokens_per_local_expert

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(self.routing_map)
        # Permutation 1: input to AlltoAll input
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        (permutated_local_input_tokens, permuted_probs, self.reversed_local_input_permutation_mapping, _, _) = \
            permute(hidden_states, self.routing_map, probs=probs, num_out_tokens=self.num_out_tokens,
                    fused=self.config.moe_permute_fusion, drop_and_pad=self.drop_and_pad)
        return permutated_local_input_tokens, permuted_probs

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        global_input_tokens = all_to_all(None, permutated_local_input_tokens, self.output_splits,
                                         self.input_splits)
        global_probs = all_to_all(None, permuted_probs, self.output_splits, self.input_splits)
        return global_input_tokens, global_probs

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", self.tokens_per_expert)
        if self.num_local_experts > 1:
            global_input_tokens, global_probs = sort_chunks_by_idxs(
                global_input_tokens, self.num_global_tokens_per_local_expert.ravel(),
                self.sort_input_by_local_experts, probs=global_probs, fused=self.config.moe_permute_fusion)
        tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if self.num_local_experts > 1:
            hidden_states, _ = sort_chunks_by_idxs(
                hidden_states, self.num_global_tokens_per_local_expert.T.ravel(),
                self.restore_output_by_local_experts, fused=self.config.moe_permute_fusion)
        return hidden_states

    def token_combine(self, hidden_states):
        return all_to_all(None, hidden_states, self.input_splits, self.output_splits)

    def combine_postprocess(self, permutated_local_input_tokens):
        # Unpermutation 1: AlltoAll output to output
        output = unpermute(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            restore_shape=self.hidden_shape_before_permute,
            routing_map=self.routing_map,
            fused=self.config.moe_permute_fusion,
            drop_and_pad=self.drop_and_pad,
        )
        return output.view(self.hidden_shape)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        """Move all possible GPU tensors to CPU at self.cuda_dtoh_point (blocking here)."""
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            tokens_per_expert = maybe_move_tensor_to_cpu(tokens_per_expert)
            self.input_splits = maybe_move_tensor_to_cpu(self.input_splits, as_numpy=True)
            self.output_splits = maybe_move_tensor_to_cpu(self.output_splits, as_numpy=True)
            self.output_splits_tp = maybe_move_tensor_to_cpu(self.output_splits_tp, as_numpy=True)
            self.num_out_tokens = maybe_move_tensor_to_cpu(self.num_out_tokens)
            if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
                self.num_global_tokens_per_local_expert = maybe_move_tensor_to_cpu(
                    self.num_global_tokens_per_local_expert)
        return tokens_per_expert


# --- megatron/core/transformer/moe/moe_layer.py ---------------------------------------------------------------

class MoELayer:
    def __init__(self, config, weights, prefix):
        self.config = config
        self.router = TopKRouter(config, weights[f"{prefix}.router.weight"])
        self.token_dispatcher = MoEAlltoAllTokenDispatcher(
            config.num_moe_experts, list(range(config.num_moe_experts)), config)
        self.experts = SequentialMLP(config.num_moe_experts, config, weights, prefix)
        self.use_shared_expert = False
        self.fwd_execution_map = ["route", "expert_compute", "postprocess"]

    def route(self, hidden_states, padding_mask=None):
        probs, routing_map = self.router(hidden_states, padding_mask)
        return probs, routing_map

    def preprocess(self, hidden_states, probs, routing_map):
        hidden_states, probs = self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
        return hidden_states, probs

    def dispatch(self, hidden_states, probs):
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def shared_experts_compute(self, hidden_states):
        return None

    def routed_experts_compute(self, hidden_states, probs):
        dispatched_input, tokens_per_expert, permuted_probs = (
            self.token_dispatcher.dispatch_postprocess(hidden_states, probs))
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert, permuted_probs)
        output = self.token_dispatcher.combine_preprocess(expert_output)
        return output, mlp_bias

    def combine(self, output):
        return self.token_dispatcher.token_combine(output)

    def postprocess(self, output, shared_expert_output):
        output = self.token_dispatcher.combine_postprocess(output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def __call__(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        # MoE forward: route -> dispatch -> compute -> combine
        if "route" in self.fwd_execution_map:
            shared_expert_output = self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
            if intermediate_tensors is not None:
                return hidden_states, probs, shared_expert_output
        if "expert_compute" in self.fwd_execution_map:
            if intermediate_tensors is not None:
                hidden_states, probs = intermediate_tensors
            dispatched_input, probs = self.dispatch(hidden_states, probs)
            output, mlp_bias = self.routed_experts_compute(dispatched_input, probs)
            output = self.combine(output)
            if intermediate_tensors is not None:
                return output, mlp_bias
        if "postprocess" in self.fwd_execution_map:
            if intermediate_tensors is not None:
                output, shared_expert_output = intermediate_tensors
            output = self.postprocess(output, shared_expert_output)
            if intermediate_tensors is not None:
                return output
        return output, mlp_bias


# --- megatron/core/transformer/transformer_layer.py -----------------------------------------------------------

def bias_dropout_add(x_with_bias, residual, prob, training):
    x, bias = x_with_bias
    if bias is not None:
        x = x + bias
    out = F.dropout(x, p=prob, training=training)
    return residual + out


class TransformerLayer:
    def __init__(self, config, layer_number, weights):
        self.config, self.layer_number, self.training = config, layer_number, True
        prefix = f"layers.{layer_number}"
        self.pre_mlp_layernorm_weight = weights[f"{prefix}.pre_mlp_layernorm.weight"]
        self.mlp = MoELayer(config, weights, f"{prefix}.mlp")
        if config.cuda_graph_impl == "local":
            self.create_mcore_cudagraph_manager(config)

    def _forward_pre_mlp_layernorm(self, hidden_states):
        return F.layer_norm(hidden_states, (self.config.hidden_size,), self.pre_mlp_layernorm_weight,
                            eps=self.config.layernorm_epsilon)

    def _forward_post_mlp(self, mlp_output_with_bias, residual):
        return bias_dropout_add(mlp_output_with_bias, residual, self.config.hidden_dropout, self.training)

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):
        residual = hidden_states
        pre_mlp_layernorm_output = self._forward_pre_mlp_layernorm(hidden_states)
        mlp_output_with_bias = self.mlp(pre_mlp_layernorm_output, padding_mask=padding_mask)
        return self._forward_post_mlp(mlp_output_with_bias, residual)

    def forward(self, hidden_states):
        return self._forward_mlp(hidden_states)


class MoETransformerLayer(TransformerLayer):
    """Supports "partial" CUDA graphs by decomposing the MLP forward pass into router, expert-compute, and
    post-process stages."""

    def __init__(self, *args, variant: str, **kwargs):
        self.is_moe_layer = True
        self.use_partial_cudagraphs = False
        self.moe_layer_recompute = False
        self.token_dispatcher_attrs = {}
        self.variant = variant                  # (which Megatron-LM: before or with e19fbe2e1d's restore)
        self._router_dtoh_event = _Event()
        super().__init__(*args, **kwargs)

    def create_mcore_cudagraph_manager(self, config):
        if (CudaGraphScope.moe_router in self.config.cuda_graph_scope
                or CudaGraphScope.moe_preprocess in self.config.cuda_graph_scope):
            self.moe_layer_recompute = False
            self.use_partial_cudagraphs = True
            self.cudagraph_manager_router = CudaGraphManager(
                self.config, self, function_name="_forward_mlp_router")
            self.cudagraph_manager_postprocess = CudaGraphManager(
                self.config, self, function_name="_forward_mlp_postprocess")

    def persistent_state(self, function_name):
        """(The emulation's note for the runner: the router graph writes token_dispatcher_attrs on purpose.)"""
        if function_name != "_forward_mlp_router":
            return None
        return {f"layer {self.layer_number} token_dispatcher_attrs.{k}": v
                for k, v in self.token_dispatcher_attrs.items()}

    def _forward_mlp_router(self, hidden_states, padding_mask=None):
        """Executes the router phase of the MoE block (captured by `cudagraph_manager_router`)."""
        residual = hidden_states
        self.mlp.fwd_execution_map = "route"
        pre_mlp_layernorm_output = self._forward_pre_mlp_layernorm(hidden_states)
        router_outputs = self.mlp(pre_mlp_layernorm_output, intermediate_tensors=(), padding_mask=padding_mask)

        for attr_name in self.mlp.token_dispatcher.cudagraph_attrs:
            attr = getattr(self.mlp.token_dispatcher, attr_name)
            if torch.is_tensor(attr):
                if attr_name in self.token_dispatcher_attrs:
                    self.token_dispatcher_attrs[attr_name].copy_(attr)
                else:
                    self.token_dispatcher_attrs[attr_name] = attr.detach()

        return residual, *router_outputs

    def _forward_mlp_expert_compute(self, hidden_states, probs):
        """Executes the experts; in partial graph modes it runs eagerly between the two graph replays."""
        for name, attr in self.token_dispatcher_attrs.items():
            setattr(self.mlp.token_dispatcher, name, attr)

        self.mlp.fwd_execution_map = "expert_compute"
        return self.mlp(None, intermediate_tensors=(hidden_states, probs))

    def _forward_mlp_postprocess(self, residual, output, shared_expert_output, mlp_bias):
        """Combines the expert outputs and performs the final Bias-Dropout-Add (captured by
        `cudagraph_manager_postprocess`)."""
        if self.variant == "fix":
            # Restore token dispatcher attributes. During graph warmup, the router capture leaves these
            # attrs pointing into cudagraph pool memory; restoring them here ensures the postprocess
            # graph captures with valid pointers.
            for name, attr in self.token_dispatcher_attrs.items():
                setattr(self.mlp.token_dispatcher, name, attr)

        self.mlp.fwd_execution_map = "postprocess"
        output = self.mlp(None, intermediate_tensors=(output, shared_expert_output))
        return self._forward_post_mlp((output, mlp_bias), residual)

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):
        """Orchestrates the MLP forward pass, stitching the router, expert_compute and postprocess calls."""

        def _forward_mlp_partial_cudagraphs(hidden_states, inference_context=None, padding_mask=None):
            residual, hidden_states, probs, shared_expert_output = self._forward_mlp_router(
                hidden_states, padding_mask=padding_mask)
            if self.variant == "fix":
                # After the router graph replays, the captured .copy_() operations that update
                # self.token_dispatcher_attrs may not have completed: wait for them, then rebind.
                self._router_dtoh_event.record()
                self._router_dtoh_event.synchronize()
                for name, attr in self.token_dispatcher_attrs.items():
                    setattr(self.mlp.token_dispatcher, name, attr)
            expert_output, mlp_bias = self._forward_mlp_expert_compute(hidden_states, probs)
            return self._forward_mlp_postprocess(residual, expert_output, shared_expert_output, mlp_bias)

        if self.use_partial_cudagraphs:
            return _forward_mlp_partial_cudagraphs(hidden_states, padding_mask=padding_mask)
        return super()._forward_mlp(hidden_states, padding_mask=padding_mask)


# --- the model and the training-step schedule -------------------------------------------------------------------

def make_weights(device: str) -> dict:
    gen = generator(3373)

    def w(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    weights = {}
    for layer in range(1, NUM_LAYERS + 1):
        p = f"layers.{layer}"
        weights[f"{p}.pre_mlp_layernorm.weight"] = 1.0 + w(HIDDEN, scale=0.1)
        weights[f"{p}.mlp.router.weight"] = w(NUM_EXPERTS, HIDDEN, scale=1.0)
        for e in range(NUM_EXPERTS):
            weights[f"{p}.mlp.experts.{e}.fc1"] = w(HIDDEN, FFN_HIDDEN, scale=HIDDEN ** -0.5)
            weights[f"{p}.mlp.experts.{e}.fc2"] = w(FFN_HIDDEN, HIDDEN, scale=FFN_HIDDEN ** -0.5)
    return weights


class MoEModel:
    def __init__(self, config, weights, variant):
        self.layers = [MoETransformerLayer(config, n, weights, variant=variant) for n in range(1, NUM_LAYERS + 1)]

    def __call__(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer.forward(hidden_states)
        return hidden_states


def forward_backward_no_pipelining(model, hidden_states, config):
    """One forward-only step; with local CUDA graphs, create_cudagraphs() at its end (schedules.py)."""
    with torch.no_grad():
        output = model(hidden_states).clone()
    if config.cuda_graph_impl == "local":
        create_cudagraphs()
    return output


def run(variant: str, device: str = "cpu"):
    global _DEVICE
    _DEVICE = device
    gen = generator(3373_2)
    batches = [torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(device) for _ in range(STEPS)]

    def train(cuda_graph_impl: str):
        scope = [CudaGraphScope.moe_router, CudaGraphScope.moe_preprocess] if cuda_graph_impl == "local" else []
        config = TransformerConfig(cuda_graph_impl=cuda_graph_impl, cuda_graph_scope=scope)
        delete_cuda_graphs()
        try:
            model = MoEModel(config, make_weights(device), variant)
            return [forward_backward_no_pipelining(model, hidden_states, config) for hidden_states in batches]
        finally:
            delete_cuda_graphs()

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train("local"), lambda: train("none"))
