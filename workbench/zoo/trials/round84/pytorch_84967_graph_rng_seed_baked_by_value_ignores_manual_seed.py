"""A captured CUDA graph's RNG kernels keep the seed they saw at capture: ``torch.cuda.manual_seed`` after capture does not reach them.

Upstream: https://github.com/pytorch/pytorch/pull/84967 ("[CUDA graphs] Fixes errors in RNG seed", landed by
pytorchbot on 2022-09-14 after ngimel's approval; fixes https://github.com/pytorch/pytorch/issues/84614). Read here:
the PR title and description ("Prior to this PR CUDAGraph did not store the RNG seed, that is why
`torch.cuda.manual_seed(new_seed)` would only reset the offset but not update the seed at all keeping whatever value
was used during graph capture"). Also read: the fixed replay code as a later PR's review quotes it
(https://github.com/pytorch/pytorch/pull/143777: ``CUDAGeneratorState::replay_prologue`` does
``seed_extragraph_.fill_(int64_t(seed_)); offset_extragraph_.fill_(int64_t(philox_offset_per_thread_));
increase(wholegraph_increment);``). The PR's diff and the issue text were not read. The pre-fix code below is
reconstructed from the description. The detail that the captured ``PhiloxCudaState`` now holds the seed as a pointer,
like the offset (read by ``at::cuda::philox::unpack``), comes from memory of the current code and was not re-read.
Symptom: a graph that draws random numbers (dropout) replays with the capture-time seed forever. Re-seeding with
``torch.cuda.manual_seed`` only restarts the offset, so a seeded run is not reproducible and differs from eager.
Mechanism: ``CUDAGraph::capture_begin`` registers the default generator (``capture_prologue``), so during capture
``CUDAGeneratorImpl::philox_cuda_state`` hands each RNG kernel a ``PhiloxCudaState``: before the fix it held the
seed BY VALUE (the host ``seed_`` read at capture) and only the offset as a pointer to the graph's
``offset_extragraph_`` plus an intragraph offset. The kernel's arguments freeze at capture. ``CUDAGraph::replay``
refreshed only ``offset_extragraph_`` from the generator before launching, so the seed in every replay stays the
one current at capture.
Doctor: host-work-frozen, at philox_cuda_state. During capture it reads the host seed ``seed_`` as a Python/C++
scalar and bakes it into the captured kernel's arguments. Replays repeat only the kernels, so that value stays at
its capture-time value while eager steps read the current seed.
Fix (upstream): the captured ``PhiloxCudaState`` takes the seed as a pointer to a new graph-owned
``seed_extragraph_`` (``philox_cuda_state``), and the replay prologue fills ``seed_extragraph_`` with the
generator's current seed next to ``offset_extragraph_``.
Modelled: ``CUDAGeneratorImpl`` (seed, philox offset, capture prologue/epilogue, ``philox_cuda_state``), the
``CUDAGraph`` wrapper (capture_begin/capture_end/replay with ``seed_extragraph_``/``offset_extragraph_`` and
``wholegraph_increment``), ``philox::unpack`` and a fused dropout kernel. The Philox stream is a stand-in integer
hash of (seed, offset + element index), computed with int64 tensor ops so that it gives the same bits on CPU and
CUDA. The model is a two-layer MLP with dropout p=0.5 between the layers (hidden 16, batch 4).
Workload: the generator starts at CUDA's default seed 67280421310721. The user warms the step up once and captures
it, then calls ``manual_seed(0)`` and runs 2 steps, then ``manual_seed(1234)`` and runs 2 more (fresh inputs each
step). Eager runs the same seeded steps. The bug's replays draw their dropout masks from seed 67280421310721 in all
4 steps, so the kept hidden units differ from eager's. 15 of the 16 output rows are off, by up to 8.6. The fix
equals eager.
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/84967"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "philox_cuda_state"
SYMPTOM = ("torch.cuda.manual_seed after capture does not change a graph's random numbers: the captured RNG "
           "kernels hold the capture-time seed by value and replay only refreshes the offset")

DEFAULT_RNG_SEED_VAL = 67280421310721        # c10::detail::default_rng_seed_val
IN, HIDDEN, OUT, BATCH = 8, 16, 4, 4
P_DROP = 0.5

_variant = "bug"


# --- aten/src/ATen/cuda/PhiloxCudaState.h, PhiloxUtils.cuh -------------------------------------------------------------

class PhiloxCudaState:
    """``seed_`` / ``offset_`` are ``{val; ptr}`` unions; ``captured_`` says which one the kernel reads."""

    def __init__(self, seed_val=None, seed_ptr=None, offset_val=None, offset_ptr=None, offset_intragraph=0,
                 captured=False):
        self.seed_val, self.seed_ptr = seed_val, seed_ptr
        self.offset_val, self.offset_ptr = offset_val, offset_ptr
        self.offset_intragraph_, self.captured_ = offset_intragraph, captured


def unpack(arg: PhiloxCudaState):
    """``at::cuda::philox::unpack`` (runs on the device, inside the kernel): (seed, offset)."""
    if arg.captured_:
        seed = arg.seed_ptr[0] if arg.seed_ptr is not None else arg.seed_val
        return seed, arg.offset_ptr[0] + arg.offset_intragraph_
    return arg.seed_val, arg.offset_val


# --- aten/src/ATen/cuda/CUDAGeneratorImpl.cpp --------------------------------------------------------------------------

class CUDAGeneratorImpl:
    def __init__(self, seed=DEFAULT_RNG_SEED_VAL):
        self.seed_ = seed
        self.philox_offset_per_thread_ = 0
        self.seed_extragraph_ = self.offset_extragraph_ = None
        self.offset_intragraph_ = 0
        self.graph_expects_this_gen_ = False

    def set_current_seed(self, seed):             # torch.cuda.manual_seed
        self.seed_ = seed
        self.philox_offset_per_thread_ = 0

    def capture_prologue(self, seed_extragraph, offset_extragraph):
        self.seed_extragraph_, self.offset_extragraph_ = seed_extragraph, offset_extragraph
        self.offset_intragraph_ = 0
        self.graph_expects_this_gen_ = True

    def capture_epilogue(self):
        self.graph_expects_this_gen_ = False
        return self.offset_intragraph_            # wholegraph_increment

    def replay_prologue(self, wholegraph_increment):
        if _variant == "fix":
            self.seed_extragraph_.fill_(int(self.seed_))
        self.offset_extragraph_.fill_(int(self.philox_offset_per_thread_))
        self.philox_offset_per_thread_ += wholegraph_increment

    def philox_cuda_state(self, increment):
        increment = ((increment + 3) // 4) * 4
        if is_capturing():
            assert self.graph_expects_this_gen_, "this generator was not registered with the capturing graph"
            offset = self.offset_intragraph_
            self.offset_intragraph_ += increment
            if _variant == "fix":                 # the seed, too, is read through the graph's own buffer
                return PhiloxCudaState(seed_ptr=self.seed_extragraph_, offset_ptr=self.offset_extragraph_,
                                       offset_intragraph=offset, captured=True)
            return PhiloxCudaState(seed_val=self.seed_, offset_ptr=self.offset_extragraph_,   # seed by value
                                   offset_intragraph=offset, captured=True)
        offset = self.philox_offset_per_thread_
        self.philox_offset_per_thread_ += increment
        return PhiloxCudaState(seed_val=self.seed_, offset_val=offset)


# --- aten/src/ATen/native/cuda/Dropout.cu (fused_dropout) ----------------------------------------------------------------

def _mix32(h):
    """Integer hash step on non-negative int64 values below 2**32 (tensor or Python int)."""
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def fused_dropout_kernel(x, p, philox_args):
    """One uniform per element from (seed, offset + i) (stand-in for curand_init(seed, idx, offset) + Philox)."""
    seed, offset = unpack(philox_args)
    idx = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view_as(x)
    seed_term = _mix32((seed & 0xFFFFFFFF) * 0x9E3779B & 0xFFFFFFFF)
    h = _mix32(((idx + offset) * 0x2C1B3C6D + seed_term) & 0xFFFFFFFF)
    u = (h >> 8).to(torch.float32) / float(1 << 24)
    keep = (u >= p).to(x.dtype)
    return x * keep / (1.0 - p)


def fused_dropout(x, p, gen: CUDAGeneratorImpl):
    counter_offset = 4                            # Philox outputs per thread for this launch
    return fused_dropout_kernel(x, p, gen.philox_cuda_state(counter_offset))


# --- the user's model -----------------------------------------------------------------------------------------------------

class MLP:
    def __init__(self, device):
        gen = generator(84967)
        self.w1 = randn(IN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w2 = randn(HIDDEN, OUT, gen=gen, device=device, scale=0.5)

    def forward(self, x, cuda_gen):
        h = torch.relu(x @ self.w1)
        return fused_dropout(h, P_DROP, cuda_gen) @ self.w2


# --- aten/src/ATen/cuda/CUDAGraph.cpp (torch.cuda.CUDAGraph + torch.cuda.graph) -------------------------------------------

class CUDAGraph:
    def __init__(self, device, gen: CUDAGeneratorImpl):
        self.device, self.gen = device, gen
        self.seed_extragraph_ = torch.zeros(1, dtype=torch.int64, device=device)
        self.offset_extragraph_ = torch.zeros(1, dtype=torch.int64, device=device)
        self.wholegraph_increment_ = 0
        self.graph_ = self.outputs_ = None

    def capture(self, fn, static):
        """``with torch.cuda.graph(g): out = fn()``, after the user's warmup (``warmups=1``)."""
        self.gen.capture_prologue(self.seed_extragraph_, self.offset_extragraph_)        # capture_begin
        self.graph_, self.outputs_ = capture(
            fn, device=self.device, warmups=1, name="mlp step", owner="torch.cuda.CUDAGraph",
            static={**static, "seed_extragraph_": self.seed_extragraph_,
                    "offset_extragraph_": self.offset_extragraph_})
        self.wholegraph_increment_ = self.gen.capture_epilogue()                         # capture_end
        return self.outputs_

    def replay(self):
        self.gen.replay_prologue(self.wholegraph_increment_)
        return replay(self.graph_, self.outputs_)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    data = generator(849670)
    inputs = [randn(BATCH, IN, gen=data, device=device) for _ in range(4)]
    seeds = [0, None, 1234, None]                 # torch.cuda.manual_seed before steps 0 and 2

    def served():
        model, cuda_gen = MLP(device), CUDAGeneratorImpl()
        static_x = torch.zeros(BATCH, IN, device=device)
        g = CUDAGraph(device, cuda_gen)
        g.capture(lambda: model.forward(static_x, cuda_gen), {"static_x": static_x})
        outs = []
        for x, seed in zip(inputs, seeds):
            if seed is not None:
                cuda_gen.set_current_seed(seed)
            static_x.copy_(x)
            outs.append(g.replay().clone())
        return outs

    def eager():
        model, cuda_gen = MLP(device), CUDAGeneratorImpl()
        outs = []
        for x, seed in zip(inputs, seeds):
            if seed is not None:
                cuda_gen.set_current_seed(seed)
            outs.append(model.forward(x, cuda_gen))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
