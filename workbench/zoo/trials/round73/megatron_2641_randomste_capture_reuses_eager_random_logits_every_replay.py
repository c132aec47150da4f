"""MoE ``RandomSTE`` hands the capture the cached logits of the last eager call: every replay routes with them.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/2641 ("Fix CUDA RNG Tracker", Robin Zhang), merged to main
as 965cfd316ccc9dee25c1d33803b52cdd4c9d31e5 on 2026-01-09. Read: ``git show 965cfd316c --
megatron/core/transformer/moe/moe_utils.py``. The bug came in with #1919 ("JIT for MoE router and preprocess",
efdc68170a, 2025-11-19). There is no separate issue.
Symptom: in the load-balanced MoE benchmark mode (``moe_router_force_load_balancing``) with CUDA graphs, every
graphed iteration routes every token with the same "random" logits. Expert assignment and per-expert token counts
are bitwise identical from step to step and from layer to layer, whatever the input. In eager mode each router call
draws fresh logits, so the benchmark does not measure the load it claims to measure.
Mechanism: ``TopKRouter.forward`` replaces the gating logits with ``apply_random_logits(logits)`` =
``RandomSTE.apply``. ``RandomSTE.forward`` (megatron/core/transformer/moe/moe_utils.py) draws
``logits.clone().normal_(generator=RandomSTE.generator)`` from a private ``torch.Generator`` (seed 42 + rank).
No graph registers that generator, so drawing from it inside a capture fails ("Attempt to increase offset for a
CUDA generator not in capture mode"). #1919 worked around this: the function caches each draw in the class attribute
``RandomSTE.random_logits`` and, ``if is_graph_capturing() and RandomSTE.random_logits is not None``, returns that
cached tensor instead of drawing. ``is_graph_capturing()`` is Megatron's flag, set by
``_CudagraphGlobalRecord.create_cudagraphs`` (and ``TECudaGraphHelper._start_capturing``) for the whole graph
creation. So the capture records no draw: the router's top-k, softmax and scatter kernels read the cached tensor's
address (the logits of the last eager call, here layer 2 of the recording iteration), and no replay writes it again.
Every replay of every layer's graph routes with those logits. An eager step draws new ones each call.
Doctor: warmup-divergence, at forward (``RandomSTE.forward``: at capture, Python took the
``is_graph_capturing()`` branch and handed the graph a reference to a tensor drawn by an earlier eager call.
Replays keep reading it, while an eager step at the same point draws fresh random logits).
Fix (upstream): ``RandomSTE.forward`` keeps no class-level generator or cache. It draws
``with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()): random_logits =
logits.clone().normal_()``. With CUDA graphs the tracker is graph-safe (``te_rng_tracker`` is forced on), and its
states are registered with every graph (``register_generator_state``). So the draw is captured as a kernel that
reads its Philox seed/offset from the state's device tensors, and each replay advances the offset
(``replay_prologue``), as eager draws do. The same PR makes ``CudaRNGStatesTracker.fork`` track the current state
name, wraps TE ``make_graphed_callables`` in a tracker fork under sequence parallelism, and converts checkpointed
RNG states; none of that is modelled.
Modelled: Megatron's local CUDA-graph implementation (``CudaGraphManager`` -> ``_CudaGraphRunner``). Iteration 1 runs
eagerly and records the runners; ``create_cudagraphs()`` at its end captures one forward graph per layer; later
iterations replay. Forward graphs only, under ``no_grad`` (the STE's backward is the identity and plays no part in the bug).
``cuda_graph_warmup_steps=0`` (upstream default 3): with the fix, warmup forwards would also draw from the tracker
and shift the graphed RNG stream against eager's, which is no bug. With the bug, warmups would return the cached tensor too.
torch's graph-safe CUDA generator is written out (``CUDAGeneratorState``: host seed/offset, the device
``seed_extragraph``/``offset_extragraph`` that captured kernels read, capture/replay prologues), because the CPU has
none. ``normal_`` is a counter-based normal from (seed, offset + i): a 32-bit integer hash, then Box-Muller. The
private ``RandomSTE.generator`` is the same generator class, unregistered. Two layers, each a residual MoE MLP
(softmax top-2 of 4 experts, dense expert compute weighted by the routing probs). The graphed layer hands out its
``tokens_per_expert`` with its hidden states. There is no attention, layer norm or token dispatcher.
"""
from __future__ import annotations

import contextlib
import math

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/2641"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward"
SYMPTOM = ("force-load-balancing MoE benchmark under CUDA graphs: every replay routes with the cached random "
           "logits of the last eager call, so expert assignment never changes")

SEQ, BSZ, HIDDEN, NUM_EXPERTS, TOPK, NUM_LAYERS, ITERATIONS = 4, 2, 8, 4, 2, 2, 5
RANK = 0
VARIANT = {"v": "bug"}


# --- torch: at::CUDAGeneratorState / CUDAGeneratorImpl (graph-safe Philox) --------------------------

_M32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (Python ints or int64 tensors, the same bits either way)."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def philox_normal(seed, offset, shape, device):
    """The kernel's counter-based normals from (seed, offset): host ints by value, or the graph's device tensors."""
    n = math.prod(shape)
    ctr = torch.arange(n, device=device, dtype=torch.int64) + offset
    key = _mix32(seed * 0x9E37 + 0x7F4A)
    u1 = ((_mix32((2 * ctr) ^ key) >> 8).to(torch.float32) + 0.5) / float(1 << 24)
    u2 = ((_mix32((2 * ctr + 1) ^ key) >> 8).to(torch.float32) + 0.5) / float(1 << 24)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).view(shape)


class CUDAGeneratorState:
    """``at::CUDAGeneratorState``: the host Philox seed/offset, plus the device copies a captured kernel reads."""

    def __init__(self, seed, device, offset=0):
        self.seed, self.philox_offset_per_thread, self.device = seed, offset, device
        self.seed_extragraph = torch.zeros((), dtype=torch.int64, device=device)
        self.offset_extragraph = torch.zeros((), dtype=torch.int64, device=device)
        self.offset_intragraph, self.capturing = 0, False

    def manual_seed(self, seed):
        self.seed, self.philox_offset_per_thread = seed, 0
        return self

    def increase(self, increment):
        """``philox_cuda_state``: device tensors + intra-graph offset while capturing, host values otherwise."""
        increment = (increment + 3) // 4 * 4
        if is_capturing():
            if not self.capturing:
                raise RuntimeError("Attempt to increase offset for a CUDA generator not in capture mode.")
            offset = self.offset_extragraph + self.offset_intragraph
            self.offset_intragraph += increment
            return self.seed_extragraph, offset
        offset = self.philox_offset_per_thread
        self.philox_offset_per_thread += increment
        return self.seed, offset

    def capture_prologue(self):
        """Run by ``CUDAGraph.capture_begin`` for each registered state."""
        self.capturing, self.offset_intragraph = True, 0
        self.seed_extragraph.fill_(self.seed)
        self.offset_extragraph.fill_(0)

    def capture_epilogue(self):
        self.capturing = False
        return self.offset_intragraph                                  # wholegraph_increment

    def replay_prologue(self, wholegraph_increment):
        """Run by ``CUDAGraph.replay`` before launching: publish the host state, then advance it."""
        self.seed_extragraph.fill_(self.seed)
        self.offset_extragraph.fill_(self.philox_offset_per_thread)
        self.philox_offset_per_thread += wholegraph_increment


class CUDAGeneratorImpl:
    """A CUDA ``torch.Generator``: it draws from whichever ``CUDAGeneratorState`` it currently points at."""

    def __init__(self, device, seed=67280421310721):
        self.device, self.state = device, CUDAGeneratorState(seed, device)

    def manual_seed(self, seed):
        self.state.manual_seed(seed)
        return self

    def graphsafe_get_state(self):
        return self.state

    def graphsafe_set_state(self, state):
        self.state = state

    def clone_state(self):
        return CUDAGeneratorState(self.state.seed, self.device, self.state.philox_offset_per_thread)


_default_generators: list = [None]               # torch.cuda.default_generators[0]


def normal_(tensor, generator=None):
    """``Tensor.normal_(generator=...)`` on the device: takes (seed, offset) from the generator's state."""
    gen = generator if generator is not None else _default_generators[0]
    seed, offset = gen.state.increase(tensor.numel())
    return tensor.copy_(philox_normal(seed, offset, tuple(tensor.shape), tensor.device))


# --- megatron/core/tensor_parallel/random.py --------------------------------------------------------

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"


def _get_cuda_rng_state(clone=False, graph_safe=True):
    default_generator = _default_generators[0]
    return default_generator.clone_state() if clone else default_generator.graphsafe_get_state()


def _set_cuda_rng_state(new_state, graph_safe=True):
    _default_generators[0].graphsafe_set_state(new_state)


def get_expert_parallel_rng_tracker_name():
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


class CudaRNGStatesTracker:
    """Named CUDA RNG states; ``fork(name)`` swaps one into the default generator (graph-safe states)."""

    def __init__(self, use_cudagraphable_rng=True):
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.states_, self.seeds_ = {}, set()

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"cuda rng state {name} (seed {seed}) already exists")
        self.seeds_.add(seed)
        new_state = _get_cuda_rng_state(clone=True, graph_safe=True)
        new_state.manual_seed(seed)
        self.states_[name] = new_state

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig_cuda_rng_state = _get_cuda_rng_state(graph_safe=self.use_cudagraphable_rng)
        _set_cuda_rng_state(self.states_[name], graph_safe=self.use_cudagraphable_rng)
        try:
            yield
        finally:
            self.states_[name] = _get_cuda_rng_state(graph_safe=self.use_cudagraphable_rng)
            _set_cuda_rng_state(orig_cuda_rng_state, graph_safe=self.use_cudagraphable_rng)


_CUDA_RNG_STATE_TRACKER: list = [None]


def get_cuda_rng_tracker():
    return _CUDA_RNG_STATE_TRACKER[0]


def get_all_rng_states():
    return get_cuda_rng_tracker().states_


def model_parallel_cuda_manual_seed(seed, device, tp_rank=0, ep_rank=0, etp_rank=0):
    """Seeds the default generator (data parallel) and the tracker's model- and expert-parallel states."""
    _default_generators[0] = CUDAGeneratorImpl(device).manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER[0] = CudaRNGStatesTracker(use_cudagraphable_rng=True)   # te_rng_tracker for graphs
    _CUDA_RNG_STATE_TRACKER[0].add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    expert_parallel_seed = seed + 1024 + 100 * ep_rank + etp_rank
    _CUDA_RNG_STATE_TRACKER[0].add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)


# --- megatron/core/transformer/cuda_graphs.py -------------------------------------------------------

_IS_GRAPH_CAPTURING = [False]


def is_graph_capturing():
    """Query if currently capturing (Megatron's flag: set for the whole of graph creation)."""
    return _IS_GRAPH_CAPTURING[0]


def _set_capture_start():
    _IS_GRAPH_CAPTURING[0] = True


def _set_capture_end():
    _IS_GRAPH_CAPTURING[0] = False


class _CudagraphGlobalRecord:
    cudagraph_created = False
    cudagraph_record: list = []

    @classmethod
    def reset(cls):
        cls.cudagraph_created, cls.cudagraph_record = False, []

    @classmethod
    def record_fwd_graph(cls, runner, args):
        cls.cudagraph_record.append((runner, "fwd", args))

    @classmethod
    def create_cudagraphs(cls):
        """Create the recorded graphs, in recording order, with ``is_graph_capturing()`` True throughout."""
        if cls.cudagraph_created or not cls.cudagraph_record:
            return
        _set_capture_start()
        for runner, graph_type, args in cls.cudagraph_record:
            runner.create_fwd_graph(args)
        for runner, _, _ in cls.cudagraph_record:
            runner.cudagraph_created = True
        cls.cudagraph_created, cls.cudagraph_record = True, []
        _set_capture_end()


def create_cudagraphs():
    """Called at the end of each schedule function (``forward_backward_no_pipelining`` and friends)."""
    _CudagraphGlobalRecord.create_cudagraphs()


class _CudaGraphRunner:
    def __init__(self, base_module, device, layer_number):
        self.base_module, self.device, self.layer_number = base_module, device, layer_number
        self.fwd_graph = None
        self.fwd_graph_recorded = self.cudagraph_created = False
        self.num_warmup_steps = base_module.config.cuda_graph_warmup_steps

    def record_graph_capture(self, args):
        if not self.fwd_graph_recorded:
            _CudagraphGlobalRecord.record_fwd_graph(self, args)
            self.fwd_graph_recorded = True
        out = self.base_module.forward(*args)                    # the recording pass runs eagerly
        return tuple(o.clone() for o in out)

    def create_fwd_graph(self, args):
        self.fwd_graph_input_surface = tuple(torch.zeros_like(a) for a in args)      # zero_out_tensors
        # For cases with multiple active RNG states, e.g. TP: fwd_graph.register_generator_state(state)
        self.generator_states = list(get_all_rng_states().values())
        for _ in range(self.num_warmup_steps):
            self.base_module.forward(*self.fwd_graph_input_surface)
        for state in self.generator_states:                      # CUDAGraph.capture_begin
            state.capture_prologue()
        static = {"hidden_states": self.fwd_graph_input_surface[0]}
        for name, state in get_all_rng_states().items():
            static[f"{name}.seed_extragraph"] = state.seed_extragraph
            static[f"{name}.offset_extragraph"] = state.offset_extragraph
        self.fwd_graph, self.fwd_graph_outputs = capture(
            lambda: self.base_module.forward(*self.fwd_graph_input_surface), device=self.device, warmups=0,
            name=f"TransformerLayer {self.layer_number} fwd", static=static,
            owner="_CudaGraphRunner.create_fwd_graph")
        self.wholegraph_increments = [(s, s.capture_epilogue()) for s in self.generator_states]   # capture_end

    def replay_graph_capture(self, args):
        for static_input, a in zip(self.fwd_graph_input_surface, args):
            static_input.copy_(a)
        for state, increment in self.wholegraph_increments:      # CUDAGraph.replay: register_generator_state
            state.replay_prologue(increment)
        return replay(self.fwd_graph, self.fwd_graph_outputs)


class CudaGraphManager:
    def __init__(self, module, device, layer_number):
        self.runner = _CudaGraphRunner(module, device, layer_number)

    def __call__(self, megatron_module, args):
        if _CudagraphGlobalRecord.cudagraph_created:
            return self.runner.replay_graph_capture(args)
        return self.runner.record_graph_capture(args)


# --- megatron/core/transformer/moe/moe_utils.py -----------------------------------------------------

class RandomSTE(torch.autograd.Function):
    """Straight-through estimator that returns random logits with a rank-specific seed (load-balanced benchmark)."""

    generator = None
    random_logits = None

    @staticmethod
    def forward(ctx, logits):
        if VARIANT["v"] == "fix":
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                random_logits = normal_(logits.clone())
            return random_logits
        # before the fix (#1919): an unregistered private generator, and a cached draw handed to captures
        if is_graph_capturing() and RandomSTE.random_logits is not None:
            return RandomSTE.random_logits
        if RandomSTE.generator is None:
            seed = 42 + RANK
            RandomSTE.generator = CUDAGeneratorImpl(logits.device)
            RandomSTE.generator.manual_seed(seed)
        RandomSTE.random_logits = normal_(logits.clone(), generator=RandomSTE.generator)
        return RandomSTE.random_logits

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def apply_random_logits(logits):
    return RandomSTE.apply(logits)


def topk_routing_with_score_function(logits, topk, use_pre_softmax=False, score_function="softmax"):
    scores, top_indices = torch.topk(logits, k=topk, dim=1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


# --- megatron/core/transformer/moe/router.py, moe_layer.py; transformer_layer.py ---------------------

class TransformerConfig:
    num_moe_experts = NUM_EXPERTS
    moe_router_topk = TOPK
    moe_router_force_load_balancing = True
    cuda_graph_impl = "local"
    cuda_graph_warmup_steps = 0


class TopKRouter:
    def __init__(self, config, gen, device):
        self.config, self.topk = config, config.moe_router_topk
        self.weight = randn(HIDDEN, config.num_moe_experts, gen=gen, device=device, scale=HIDDEN ** -0.5)

    def gating(self, input):
        return input @ self.weight

    def routing(self, logits):
        logits = logits.view(-1, self.config.num_moe_experts)
        return topk_routing_with_score_function(logits, self.topk, score_function="softmax")

    def forward(self, input):
        logits = self.gating(input)
        if self.config.moe_router_force_load_balancing:
            # Apply force load balancing with random logits for benchmark
            logits = apply_random_logits(logits)
        return self.routing(logits)


class MoELayer:
    def __init__(self, config, gen, device):
        self.router = TopKRouter(config, gen, device)
        self.fc1 = randn(config.num_moe_experts, HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.3)
        self.fc2 = randn(config.num_moe_experts, 2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.3)

    def forward(self, hidden_states):
        tokens = hidden_states.reshape(-1, HIDDEN)
        probs, routing_map = self.router.forward(tokens)
        tokens_per_expert = routing_map.sum(dim=0)
        h = torch.nn.functional.gelu(torch.einsum("th,ehf->etf", tokens, self.fc1))
        expert_out = torch.einsum("etf,efh->eth", h, self.fc2)                   # [E, T, H]
        out = (probs.t().unsqueeze(-1) * expert_out).sum(0)                      # zero where not routed
        return out.view_as(hidden_states), tokens_per_expert


class TransformerLayer:
    def __init__(self, config, gen, device, layer_number, enable_cuda_graph):
        self.config, self.layer_number = config, layer_number
        self.mlp = MoELayer(config, gen, device)
        self.cudagraph_manager = CudaGraphManager(self, device, layer_number) if enable_cuda_graph else None

    def forward(self, hidden_states):
        mlp_output, tokens_per_expert = self.mlp.forward(hidden_states)
        return hidden_states + mlp_output, tokens_per_expert

    def __call__(self, hidden_states):
        if self.cudagraph_manager is not None:
            return self.cudagraph_manager(self, (hidden_states,))
        return self.forward(hidden_states)


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(2641)
    config = TransformerConfig()
    weights_seed = 2641
    batches = [randn(SEQ, BSZ, HIDDEN, gen=gen, device=device) for _ in range(ITERATIONS)]

    def train(enable_cuda_graph):
        # a fresh process: RNG seeded by initialize_megatron, no RandomSTE generator or cache, no graphs yet
        model_parallel_cuda_manual_seed(1234, device)
        RandomSTE.generator, RandomSTE.random_logits = None, None
        _CudagraphGlobalRecord.reset()
        wgen = generator(weights_seed)
        layers = [TransformerLayer(config, wgen, device, i + 1, enable_cuda_graph) for i in range(NUM_LAYERS)]
        outs = []
        with torch.no_grad():
            for x in batches:
                hidden = x
                for layer in layers:
                    hidden, tokens_per_expert = layer(hidden)
                    outs.append(tokens_per_expert.clone())
                outs.append(hidden.clone())
                if enable_cuda_graph:
                    create_cudagraphs()          # end of the schedule: after the recording iteration
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
