"""A2 MoE: the all-reduce branches on ``forward_context.moe_comm_type`` sit in Dynamo-traced code, so the profile run's ALLGATHER choice is baked into every ACL graph, including the MC2 ones.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/3163 ("[BugFix] Fix aclgraph accu problem in A2.",
commit 14d4ed5f0cfc5976a7cb42984f570d8e66655430, merged 2025-09-28; the regression came from #2980 "[CustomOp]
Register AscendSharedFusedMoE custom op", which "makes the ``all_reduce`` of shared_experts exposed to torch dynamo").
Symptom: accuracy drop of MoE models with shared experts (DeepSeek-V2-Lite style) served with ACL graphs
(PIECEWISE) on A2 with expert parallelism; ``enforce_eager`` is correct. No error is raised.
Mechanism: ``NPUModelRunner._select_moe_comm_method`` picks the MoE communication per step from the token count;
on A2 with EP (world_size_across_dp >= 16) it is MC2 when ``num_tokens <= mc2_tokens_capacity`` and ALLGATHER
(NAIVE_MULTICAST with prefill) otherwise, and ``set_ascend_forward_context`` stores it as
``forward_context.moe_comm_type``. The MoE outputs need exactly one TP all-reduce: with ALLGATHER the routed and
the shared experts' outputs are both TP-partial and are summed, then reduced once by
``AscendFusedMoE.maybe_all_reduce_tensor_model_parallel``; with MC2/ALLTOALL the ``finalize`` (combine) already
returns full routed outputs, so ``AscendSharedFusedMoE.forward`` all-reduces only ``shared_out`` and
``maybe_all_reduce_tensor_model_parallel`` returns its input. Both ``if moe_comm_type in {ALLTOALL, MC2}`` tests
were plain Python in code Dynamo traces (the model's MoE block and ``AscendSharedFusedMoE.forward``; only
``forward_impl``, behind the ``moe_forward_shared`` custom op, is opaque). vLLM traces once, in ``profile_run``
(``_dummy_run(max_num_tokens, with_prefill=True)``: NAIVE_MULTICAST), and drops the guards, so the FX graph keeps
"no shared all-reduce, final all-reduce"; ``_capture_model`` then captures that graph for every capture size, all
of which are MC2 sizes. At replay the MC2 combine's full routed output is all-reduced again (multiplied by the TP
size) and the shared experts' partial output is never reduced on its own. An eager step reads the live comm type.
Doctor: warmup-divergence, at ``maybe_all_reduce_tensor_model_parallel`` (the branch on ``moe_comm_type`` was
decided by the profile-run warmup's trace and every capture/replay reuses it, while an eager step decides it
again from the step's comm type; the same holds for the shared-expert branch in ``AscendSharedFusedMoE.forward``).
Fix (upstream): ``maybe_all_reduce_tensor_model_parallel`` returns
``torch.ops.vllm.maybe_all_reduce_tensor_model_parallel(final_hidden_states)``, a new custom op
(register_custom_ops.py) whose impl holds the same branch, and the shared-expert computation with its all-reduce
moves from ``AscendSharedFusedMoE.forward`` into ``AscendSharedFusedMoE.forward_impl`` (reached through
``moe_forward_shared``); both branches now run at each capture (per size) and each eager step.
Modelled: TP=2 ranks in one process: a tensor carries a leading rank axis, ``tensor_model_parallel_all_reduce``
sums over it (out of place, as ``torch.ops.vllm.all_reduce``); EP is the same two ranks, each holding half the
routed experts (world_size_across_dp stays 16 in the config so the A2 rule picks MC2 as upstream does). The MC2
combine is a sum of the ranks' expert outputs; ALLGATHER's finalize returns the rank's partial. Dynamo is a
wrapper whose first call (the profile run) records the forward-context attributes traced code reads and whose
later calls see those recorded values; custom ops (``moe_forward_shared`` and, in the fix,
``maybe_all_reduce_tensor_model_parallel``) read the live context. One piece per graph (no attention to split
at), two MoE layers, no DP sync, no multistream overlap, mc2_tokens_capacity 8 and capture sizes [4, 8] instead
of 512 and up to 512, float32.
"""
from __future__ import annotations

import contextlib
import enum
import types

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/3163"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "maybe_all_reduce_tensor_model_parallel"
SYMPTOM = "A2 + EP + ACL graph: MoE outputs double-reduced (routed) / unreduced (shared) in MC2-sized graphs"

TP, VOCAB, DIM, INTER, NUM_EXPERTS, TOPK, NUM_LAYERS = 2, 32, 8, 8, 4, 2, 2
MAX_NUM_TOKENS, MC2_TOKENS_CAPACITY, CAPTURE_SIZES = 16, 8, [4, 8]
WORLD_SIZE_ACROSS_DP, ROUTED_SCALING_FACTOR = 16, 1.5
VARIANT = {"v": "bug"}


class MoECommType(enum.Enum):
    ALLGATHER = 0
    MC2 = 1
    ALLTOALL = 2
    NAIVE_MULTICAST = 3


# --- vllm.forward_context and torch.compile (Dynamo) ------------------------------------------------

_forward_context = [None]
_DYNAMO = types.SimpleNamespace(fx=None, in_custom_op=0)   # the compiled graph running now


class _TracedForwardContext:
    """What Dynamo-traced code sees: each attribute it read during the trace became a constant of the FX graph
    (vLLM drops the guards, so nothing re-traces when the live value changes)."""

    def __init__(self, fx):
        self._fx = fx

    def __getattr__(self, name):
        if self._fx.tracing:
            self._fx.constants[name] = getattr(_forward_context[0], name)
        return self._fx.constants[name]


def get_forward_context():
    if _DYNAMO.fx is not None and not _DYNAMO.in_custom_op:
        return _TracedForwardContext(_DYNAMO.fx)
    return _forward_context[0]


@contextlib.contextmanager
def set_ascend_forward_context(no_compile_layers, moe_comm_type):
    """A fresh forward context per step, carrying the step's MoE comm type and method."""
    prev = _forward_context[0]
    _forward_context[0] = types.SimpleNamespace(
        no_compile_layers=no_compile_layers, moe_comm_type=moe_comm_type,
        moe_comm_method=get_moe_comm_method(moe_comm_type), sp_enabled=False)
    try:
        yield
    finally:
        _forward_context[0] = prev


class _VllmOps:
    """``torch.ops.vllm``: a registered custom op is one opaque node of the FX graph; its Python runs at every
    call of the graph (and at every capture), reading the live forward context."""


torch_ops_vllm = _VllmOps()


def direct_register_custom_op(op_name, op_func):
    def op(*args, **kwargs):
        _DYNAMO.in_custom_op += 1
        try:
            return op_func(*args, **kwargs)
        finally:
            _DYNAMO.in_custom_op -= 1
    setattr(torch_ops_vllm, op_name, op)


class support_torch_compile:  # noqa: N801 - vLLM's decorator
    """Traced on the first call (the profile run); the guards are dropped, so it is never re-traced."""

    def __init__(self, model):
        self.model, self.fx = model, None

    def __call__(self, *args):
        if self.fx is None:
            self.fx = types.SimpleNamespace(tracing=True, constants={})
        _DYNAMO.fx = self.fx
        try:
            return self.model(*args)
        finally:
            _DYNAMO.fx, self.fx.tracing = None, False


# --- vllm.distributed: TP=2 in one process (leading axis = rank) ------------------------------------

def tensor_model_parallel_all_reduce(x):
    """``torch.ops.vllm.all_reduce`` (SUM over the TP group), out of place."""
    return x.sum(0, keepdim=True).expand_as(x).contiguous()


# --- vllm_ascend/ops/moe/moe_comm_method.py ---------------------------------------------------------

class AllGatherCommImpl:
    def prepare(self, hidden_states, router_logits, replace_allreduce=False):
        return hidden_states, router_logits

    def finalize(self, hidden_states, reduce_results):
        return hidden_states               # each rank keeps the partial sum of its local experts


class MC2CommImpl(AllGatherCommImpl):
    def finalize(self, hidden_states, reduce_results):
        # npu_moe_distribute_combine: every token gets back the outputs of all its experts, on all EP ranks
        return hidden_states.sum(0, keepdim=True).expand_as(hidden_states).contiguous()


def get_moe_comm_method(moe_comm_type):
    return MC2CommImpl() if moe_comm_type in {MoECommType.MC2, MoECommType.ALLTOALL} else AllGatherCommImpl()


# --- vllm.model_executor.layers.fused_moe.layer / vllm_ascend/ops/common_fused_moe.py ----------------

def moe_forward_shared(hidden_states, router_logits, layer_name):
    self = get_forward_context().no_compile_layers[layer_name]
    return self.forward_impl(hidden_states, router_logits)


direct_register_custom_op("moe_forward_shared", moe_forward_shared)


def _maybe_all_reduce_tensor_model_parallel_impl(final_hidden_states):
    """vllm_ascend/ops/register_custom_ops.py (added by the fix)."""
    forward_context = get_forward_context()
    moe_comm_type = forward_context.moe_comm_type
    if moe_comm_type in {MoECommType.ALLTOALL, MoECommType.MC2}:
        return final_hidden_states
    else:
        return tensor_model_parallel_all_reduce(final_hidden_states)


direct_register_custom_op("maybe_all_reduce_tensor_model_parallel", _maybe_all_reduce_tensor_model_parallel_impl)


class SharedMLP:
    """The shared experts: gate_up column-parallel, down row-parallel with ``reduce_results=False``."""

    def __init__(self, gen, device):
        self.gate_up = randn(TP, DIM, 2 * INTER // TP, gen=gen, device=device, scale=DIM ** -0.5)
        self.down = randn(TP, INTER // TP, DIM, gen=gen, device=device, scale=INTER ** -0.5)

    def __call__(self, x):                               # x [TP, T, DIM] -> TP-partial [TP, T, DIM]
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        return torch.bmm(torch.nn.functional.silu(gate) * up, self.down)


class AscendFusedMoE:
    def __init__(self, layer_name, gen, device):
        self.layer_name = layer_name
        self.w = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=DIM ** -0.5)
        self.local_experts = [list(range(r * NUM_EXPERTS // TP, (r + 1) * NUM_EXPERTS // TP)) for r in range(TP)]
        self.reduce_results = False

    def forward(self, hidden_states, router_logits):
        """vLLM's ``FusedMoE.forward`` (shared-experts case): one opaque ``moe_forward_shared`` node."""
        return torch_ops_vllm.moe_forward_shared(hidden_states, router_logits, self.layer_name)

    def maybe_all_reduce_tensor_model_parallel(self, final_hidden_states):
        """In MC2/ALLTOALL the finalize already aggregated the routed outputs across TP ranks; in ALLGATHER each
        rank only has partial outputs and they must be all-reduced."""
        if VARIANT["v"] == "fix":
            return torch_ops_vllm.maybe_all_reduce_tensor_model_parallel(final_hidden_states)
        forward_context = get_forward_context()
        moe_comm_type = forward_context.moe_comm_type
        if moe_comm_type in {MoECommType.ALLTOALL, MoECommType.MC2}:
            return final_hidden_states
        else:
            return tensor_model_parallel_all_reduce(final_hidden_states)

    def forward_impl(self, hidden_states, router_logits):
        forward_context = get_forward_context()
        hidden_states, router_logits = forward_context.moe_comm_method.prepare(
            hidden_states=hidden_states, router_logits=router_logits, replace_allreduce=forward_context.sp_enabled)
        # quant_method.apply: softmax top-k routing, each EP rank runs its local experts
        weights, ids = torch.topk(router_logits.softmax(-1), TOPK, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        partial = torch.zeros_like(hidden_states)
        for rank in range(TP):
            for e in self.local_experts[rank]:
                gate = (weights[rank] * (ids[rank] == e)).sum(-1, keepdim=True)
                partial[rank] += gate * torch.nn.functional.silu(hidden_states[rank] @ self.w[e])
        return forward_context.moe_comm_method.finalize(hidden_states=partial, reduce_results=self.reduce_results)


class AscendSharedFusedMoE(AscendFusedMoE):
    def __init__(self, layer_name, gen, device):
        super().__init__(layer_name, gen, device)
        self._shared_experts = SharedMLP(gen, device)

    def forward(self, hidden_states, router_logits):
        if VARIANT["v"] == "fix":
            shared_out, fused_out = AscendFusedMoE.forward(self, hidden_states=hidden_states,
                                                           router_logits=router_logits)
            return shared_out, fused_out
        shared_out = self._shared_experts(hidden_states)
        # NOTE: This is exactly the opposite of `maybe_all_reduce_tensor_model_parallel`
        forward_context = get_forward_context()
        moe_comm_type = forward_context.moe_comm_type
        if moe_comm_type in {MoECommType.ALLTOALL, MoECommType.MC2}:
            shared_out = tensor_model_parallel_all_reduce(shared_out)
        _, fused_out = AscendFusedMoE.forward(self, hidden_states=hidden_states, router_logits=router_logits)
        return shared_out, fused_out

    def forward_impl(self, hidden_states, router_logits):
        if VARIANT["v"] == "fix":
            shared_out = self._shared_experts(hidden_states)
            forward_context = get_forward_context()
            moe_comm_type = forward_context.moe_comm_type
            if moe_comm_type in {MoECommType.ALLTOALL, MoECommType.MC2}:
                shared_out = tensor_model_parallel_all_reduce(shared_out)
            fused_output = AscendFusedMoE.forward_impl(self, hidden_states=hidden_states,
                                                       router_logits=router_logits)
            return shared_out, fused_output
        shared_output = torch.empty(1, device=hidden_states.device)
        fused_output = AscendFusedMoE.forward_impl(self, hidden_states=hidden_states, router_logits=router_logits)
        return shared_output, fused_output


# --- vllm/model_executor/models/deepseek_v2.py ------------------------------------------------------

class DeepseekV2MoE:
    def __init__(self, i, gen, device):
        self.tp_size = TP
        self.gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)             # ReplicatedLinear
        self.experts = AscendSharedFusedMoE(f"model.layers.{i}.mlp.experts", gen, device)

    def forward(self, hidden_states):
        router_logits = hidden_states @ self.gate
        shared_output, final_hidden_states = self.experts.forward(hidden_states=hidden_states,
                                                                  router_logits=router_logits)
        final_hidden_states = final_hidden_states * ROUTED_SCALING_FACTOR
        final_hidden_states = final_hidden_states + shared_output
        if self.tp_size > 1:
            final_hidden_states = self.experts.maybe_all_reduce_tensor_model_parallel(final_hidden_states)
        return final_hidden_states


class DeepseekV2ForCausalLM:
    def __init__(self, device):
        gen = generator(3163)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.layers = [DeepseekV2MoE(i, gen, device) for i in range(NUM_LAYERS)]

    def __call__(self, input_ids):
        h = self.embed_tokens[input_ids].unsqueeze(0).expand(TP, -1, -1).contiguous()   # replicated on TP ranks
        for layer in self.layers:
            h = h + layer.forward(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return h[0]                                                                      # this rank's view

    def no_compile_layers(self):
        return {layer.experts.layer_name: layer.experts for layer in self.layers}


# --- vllm_ascend/worker/model_runner_v1.py ----------------------------------------------------------

class NPUModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = DeepseekV2ForCausalLM(device)
        self.compiled = self.model if enforce_eager else support_torch_compile(self.model)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.mc2_tokens_capacity = MC2_TOKENS_CAPACITY
        self.graphs = {}

    def _select_moe_comm_method(self, num_tokens, with_prefill):
        # soc_version A2, enable_expert_parallel, quant_type None
        if num_tokens <= self.mc2_tokens_capacity and WORLD_SIZE_ACROSS_DP >= 16:
            moe_comm_type = MoECommType.MC2
        else:
            moe_comm_type = MoECommType.ALLGATHER
        if moe_comm_type == MoECommType.ALLGATHER and with_prefill:
            moe_comm_type = MoECommType.NAIVE_MULTICAST
        return moe_comm_type

    def _dummy_run(self, num_tokens, with_prefill=False):
        moe_comm_type = self._select_moe_comm_method(num_tokens, with_prefill)
        with set_ascend_forward_context(self.model.no_compile_layers(), moe_comm_type):
            return self.compiled(self.input_ids[:num_tokens])

    def profile_run(self):
        with events.warmup():                    # trigger compilation for the general shape
            self._dummy_run(MAX_NUM_TOKENS, with_prefill=True)
            if self._select_moe_comm_method(self.mc2_tokens_capacity, with_prefill=True) == MoECommType.MC2:
                self._dummy_run(self.mc2_tokens_capacity)

    def _capture_model(self):
        for num_tokens in reversed(CAPTURE_SIZES):
            moe_comm_type = self._select_moe_comm_method(num_tokens, False)
            with set_ascend_forward_context(self.model.no_compile_layers(), moe_comm_type):
                self.graphs[num_tokens] = capture(
                    lambda n=num_tokens: self.compiled(self.input_ids[:n]), device=self.device,
                    name=f"aclgraph num_tokens={num_tokens}", static={"input_ids": self.input_ids},
                    owner="NPUModelRunner (ACL graph, PIECEWISE)")

    def execute_model(self, token_ids):
        num_input_tokens = len(token_ids)
        self.input_ids[:num_input_tokens].copy_(torch.tensor(token_ids, device=self.device))
        moe_comm_type = self._select_moe_comm_method(num_input_tokens, False)
        with set_ascend_forward_context(self.model.no_compile_layers(), moe_comm_type):
            if self.enforce_eager or num_input_tokens not in self.graphs:
                return self.compiled(self.input_ids[:num_input_tokens]).clone()
            g, out = self.graphs[num_input_tokens]
            return replay(g, out).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(2980)
    steps = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (4, 8, 4)]

    def serve(enforce_eager):
        VARIANT["v"] = variant
        runner = NPUModelRunner(device, enforce_eager)
        if not enforce_eager:
            runner.profile_run()
            runner._capture_model()
        return [runner.execute_model(t) for t in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
