"""Graph RNG tensors allocated by a first capture under inference mode break every later capture outside it.

Upstream: https://github.com/pytorch/pytorch/pull/172706 ("[cuda_graph] fix when cuda_graph is first captured
under inference_mode"), which fixes https://github.com/pytorch/pytorch/issues/166792 ("CUDAGraph breaks with
error msg: 'Inplace update to inference tensor outside InferenceMode' for torch.compile with custom backend").
Symptom: a torch.compile custom backend that captures CUDA graphs works in each test alone, but running two
tests in one pytest process fails in ``CUDAGraph.capture_begin`` of the second one with ``RuntimeError: Inplace
update to inference tensor outside InferenceMode is not allowed``; calling ``torch._dynamo.reset()`` at the end of
the first test (which frees its graphs) makes the error go away (issue of Nov 2025; the PR names the trigger: the
first CUDA graph was captured under ``inference_mode``).
Mechanism: ``CUDAGraph::capture_begin`` registers the device's default generator state with the graph
(``CUDAGeneratorState::register_graph``). When no graph is registered to the state yet, ``register_graph``
lazily allocates the two device tensors that captured RNG kernels read their Philox seed and offset from
(``seed_extragraph_``, ``offset_extragraph_``); they live as long as any registered graph does. If that first
capture runs under ``torch.inference_mode()`` (here: the first test runs an eval model inside inference mode), the
allocation happens in InferenceMode and both are *inference tensors*. The first test's graphs stay alive in
Dynamo's cache, so the tensors are never re-created: the next capture, outside inference mode (the second,
training test), runs ``capture_prologue``, whose ``seed_extragraph_.fill_(seed)`` is an in-place update of an
inference tensor outside InferenceMode and raises. (Replays of the first graphs, under inference mode, work.)
Here the device state of the generator is modelled in Python (``CUDAGeneratorState``) and the dropout kernel
reads the Philox seed/offset from it exactly as ``philox_cuda_state``/``unpack`` do, so a replay draws the same
numbers as the eager step.
Doctor: warmup-divergence, at ``register_graph`` (the lazy allocation made by the first capture, in the mode that
capture ran in, is reused by every later capture and replay of the generator).
Fix (upstream): the generator's graph RNG tensors are allocated with InferenceMode disabled, so they are normal
tensors whatever mode the first capture runs in. Only the PR's title/description and the issue, and the pre-fix
``CUDAGeneratorImpl.cpp`` (``register_graph``, ``capture_prologue``, ``replay_prologue``) were read, not the diff;
the fix is modelled as ``torch.inference_mode(False)`` around the allocation (torch_npu's port of this code
allocates these tensors under ``c10::InferenceMode guard(false)``).
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/172706"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "register_graph"
SYMPTOM = ("a capture outside inference mode raises 'Inplace update to inference tensor outside InferenceMode' once "
           "a graph was first captured under inference mode")
DIM, HIDDEN, BATCH, STEPS, P_DROP, SEED = 4, 8, 3, 4, 0.25, 172706
_MOD = 1 << 31


class PhiloxCudaState:
    """What a kernel gets from ``philox_cuda_state``: values by value, or, while capturing, pointers to the
    generator's graph tensors plus the offset within the graph (a constant of the graph)."""

    def __init__(self, seed=None, offset=None, seed_ptr=None, offset_ptr=None, offset_intragraph=0):
        self.seed, self.offset = seed, offset
        self.seed_ptr, self.offset_ptr, self.offset_intragraph = seed_ptr, offset_ptr, offset_intragraph
        self.captured = seed_ptr is not None


class CUDAGeneratorState:
    """``at::CUDAGeneratorState`` of the default CUDA generator (host seed/offset, graph-safe device tensors)."""

    def __init__(self, seed, device, variant):
        self.device, self.variant = device, variant
        self.seed_, self.philox_offset_per_thread_, self.offset_intragraph_ = seed, 0, 0
        self.capturing_ = False
        self.seed_extragraph_ = self.offset_extragraph_ = None
        self.registered_graphs_: list = []

    def increase(self, increment):
        increment = ((increment + 3) // 4) * 4          # Note [Why enforce RNG offset % 4 == 0?]
        if self.capturing_:
            self.offset_intragraph_ += increment
        else:
            self.philox_offset_per_thread_ += increment

    def register_graph(self, graph):
        # If this is the first graph to be registered, allocate memory for the seed and offset on the GPU.
        if not self.registered_graphs_:
            if self.variant == "fix":
                with torch.inference_mode(False):       # normal tensors, whatever mode this capture runs in
                    self._allocate()
            else:
                self._allocate()                        # inherits the caller's (inference) mode
        if graph not in self.registered_graphs_:
            self.registered_graphs_.append(graph)

    def _allocate(self):
        self.seed_extragraph_ = torch.empty(1, dtype=torch.long, device=self.device)
        self.offset_extragraph_ = torch.empty(1, dtype=torch.long, device=self.device)

    def capture_prologue(self):
        self.capturing_ = True
        self.offset_intragraph_ = 0
        self.seed_extragraph_.fill_(self.seed_)
        self.offset_extragraph_.fill_(0)

    def capture_epilogue(self):
        self.capturing_ = False
        return self.offset_intragraph_

    def replay_prologue(self, wholegraph_increment):
        self.seed_extragraph_.fill_(self.seed_)
        self.offset_extragraph_.fill_(self.philox_offset_per_thread_)
        self.increase(wholegraph_increment)

    def philox_cuda_state(self, increment):
        if self.capturing_:
            offset = self.offset_intragraph_
            self.increase(increment)
            return PhiloxCudaState(seed_ptr=self.seed_extragraph_, offset_ptr=self.offset_extragraph_,
                                   offset_intragraph=offset)
        offset = self.philox_offset_per_thread_
        self.increase(increment)
        return PhiloxCudaState(seed=self.seed_, offset=offset)


def philox_uniform(philox_args, n, device):
    """Counter-based uniforms in [0, 1): ``at::cuda::philox::unpack`` then one draw per element."""
    counter = torch.arange(n, device=device)
    if philox_args.captured:                            # read through the pointers at every replay
        seed = philox_args.seed_ptr
        counter = counter + philox_args.offset_ptr + philox_args.offset_intragraph
    else:
        seed = philox_args.seed
        counter = counter + philox_args.offset
    x = (counter * 1103515245 + seed * 12345 + 1013904223) % _MOD
    x = ((x ^ (x >> 13)) * 1103515245 + 12345) % _MOD
    x = x ^ (x >> 16)
    return x.to(torch.float32) / _MOD


def fused_dropout(x, p, gen_state):
    philox_args = gen_state.philox_cuda_state(x.numel())
    keep = philox_uniform(philox_args, x.numel(), x.device).view_as(x) >= p
    return x * keep.to(x.dtype) / (1 - p)


class Model:
    def __init__(self, device):
        gen = generator(SEED)
        self.w1 = randn(DIM, HIDDEN, gen=gen, device=device, scale=0.6)
        self.w2 = randn(HIDDEN, DIM, gen=gen, device=device, scale=0.6)
        self.xs = [randn(BATCH, DIM, gen=gen, device=device) for _ in range(2 * STEPS)]

    def eval_forward(self, x, gen_state):
        return torch.tanh(x @ self.w1) @ self.w2

    def train_forward(self, x, gen_state):
        return fused_dropout(torch.tanh(x @ self.w1), P_DROP, gen_state) @ self.w2


class CUDAGraph:
    """``torch.cuda.CUDAGraph``'s generator bookkeeping around one capture (``CUDAGraph.cpp``)."""

    def __init__(self, default_state):
        self.default_state = default_state
        self.captured_generator_states: dict = {}

    def capture(self, fn, device, static_x):
        # capture_begin: the default generator of the device is always registered
        self.default_state.register_graph(self)
        self.captured_generator_states.setdefault(self.default_state, 0)
        for state in self.captured_generator_states:
            state.capture_prologue()
        st = self.default_state
        self.graph, self.outputs = capture(
            fn, device=device, warmups=0, owner="custom torch.compile backend",
            static={"x": static_x, "seed_extragraph": st.seed_extragraph_,
                    "offset_extragraph": st.offset_extragraph_})
        for state in self.captured_generator_states:        # capture_end
            self.captured_generator_states[state] = state.capture_epilogue()

    def replay(self):
        for state, wholegraph_increment in self.captured_generator_states.items():
            state.replay_prologue(wholegraph_increment)
        return replay(self.graph, self.outputs)


class CudaGraphBackend:
    """The custom backend of the issue: the first call warms up (a real step) and captures, later calls replay.
    Compiled graphs stay cached for the process (Dynamo's cache), keeping their generator registration."""

    def __init__(self, device, gen_state):
        self.device, self.gen_state, self.cache = device, gen_state, {}

    def __call__(self, fn, x):
        entry = self.cache.get(fn.__name__)
        if entry is None:
            with events.warmup(real=True):
                out = fn(x, self.gen_state).clone()
            static_x = x.clone()
            graph = CUDAGraph(self.gen_state)
            graph.capture(lambda: fn(static_x, self.gen_state), self.device, static_x)
            self.cache[fn.__name__] = (graph, static_x)
            return out
        graph, static_x = entry
        static_x.copy_(x)
        return graph.replay().clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def tests(call):
        outs = []
        with torch.inference_mode():                    # test 1: eval model compiled under inference_mode
            outs += [call(model.eval_forward, x) for x in model.xs[:STEPS]]
        outs += [call(model.train_forward, x) for x in model.xs[STEPS:]]   # test 2: training forward
        return outs

    def served():
        backend = CudaGraphBackend(device, CUDAGeneratorState(SEED, device, variant))
        return tests(backend)

    def eager():
        gen_state = CUDAGeneratorState(SEED, device, variant)
        return tests(lambda fn, x: fn(x, gen_state).clone())

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
