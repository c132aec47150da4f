"""Activation checkpointing's RNG save/rewind is refused inside a CUDA-graph capture, so a checkpointed training step cannot be graphed.

Upstream: https://github.com/pytorch/pytorch/pull/162505 ("Make torch.cuda.rng_set_state() and
torch.cuda.rng_get_state() work during stream capture.", fixes issue #162504 "torch.utils.checkpoint.checkpoint
does not work under stream capture to a cuda graph").
Symptom: capturing forward + ``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False,
preserve_rng_state=True)`` + backward in one ``torch.cuda.graph(g)`` fails with "Cannot call
CUDAGeneratorImpl::current_seed during CUDA graph capture"; the goal (bit-exact ``eager_in_grad == graph_in_grad``
after ``manual_seed(42); g.replay()``) is never reached.
Mechanism: ``CUDAGeneratorImpl`` keeps a host ``seed_`` and ``philox_offset_per_thread_``. Under capture, random
kernels do not read them: ``philox_cuda_state`` hands each kernel the graph's device tensors ``seed_extragraph_`` /
``offset_extragraph_`` plus a capture-relative ``offset_intragraph_`` (baked into the kernel); ``replay_prologue``
refreshes the device tensors from the host state before each replay and advances the host offset by the whole
graph's increment. Checkpoint's forward calls ``get_rng_state`` (``current_seed`` + ``get_offset``) to remember
where its dropout-like draw started, and its recompute in backward rewinds there with ``set_rng_state``
(``set_current_seed`` + ``set_offset``, inside ``fork_rng``). Before the fix ``current_seed``/``set_current_seed``
/``get_offset``/``set_offset`` all ``assertNotCapturing``: host RNG bookkeeping in a captured region was refused,
because a host value read or set once at capture is not what the replayed kernels use. The capture raises.
Doctor: host-work-frozen, at current_seed (the checkpoint's host RNG state read/rewind runs inside the captured
region; pre-fix the generator refuses it outright, since a host-side seed/offset change at capture would not be
repeated by replays).
Fix (upstream): during capture, ``set_current_seed`` with the current seed is a no-op (a different seed raises),
and get/set of the state read and move only the philox offset, i.e. ``offset_intragraph_``: the rewind becomes a
capture-relative offset baked into the recompute's kernels, so every replay's recompute reuses the forward's
random numbers.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/162505"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "current_seed"
SYMPTOM = "RuntimeError: Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture"

ROWS, DIM, STEPS, SEED = 4, 6, 3, 42
_MASK = (1 << 32) - 1


def capturing() -> bool:
    """``at::cuda::currentStreamCaptureStatus() != CaptureStatus::None``."""
    return torch.cuda.is_current_stream_capturing()


class CUDAGeneratorImpl:
    """The default device generator in miniature: host seed/offset, and the graph's seed/offset tensors."""

    def __init__(self, device, graph_safe_state: bool):
        self.fixed = graph_safe_state                     # the upstream fix
        self.seed_, self.philox_offset_per_thread_ = 0, 0
        self.seed_extragraph_ = torch.zeros(1, dtype=torch.int64, device=device)
        self.offset_extragraph_ = torch.zeros(1, dtype=torch.int64, device=device)
        self.offset_intragraph_, self.wholegraph_increment = 0, 0
        self.device = device

    def _assert_not_capturing(self, what):
        if capturing():
            raise RuntimeError(f"Cannot call CUDAGeneratorImpl::{what} during CUDA graph capture. If you need "
                               "this call to be captured, please file an issue.")

    # -- host state ------------------------------------------------------------------------------------
    def current_seed(self) -> int:
        if not self.fixed:
            self._assert_not_capturing("current_seed")     # conservatively disallowed in captured regions
        return self.seed_

    def set_current_seed(self, seed: int) -> None:
        if not capturing():
            self.seed_, self.philox_offset_per_thread_ = seed, 0
        elif not self.fixed:
            self._assert_not_capturing("set_current_seed")
        elif seed != self.seed_:
            raise RuntimeError("CUDAGeneratorImpl::set_current_seed can be called during stream capture only if "
                               "the new seed is the same as the old seed.")

    def get_offset(self) -> int:
        if capturing():
            if not self.fixed:
                self._assert_not_capturing("get_offset")
            return self.offset_intragraph_
        return self.philox_offset_per_thread_

    def set_offset(self, offset: int) -> None:
        if capturing():
            if not self.fixed:
                self._assert_not_capturing("set_offset")
            self.offset_intragraph_ = offset              # the rewind moves the capture-relative offset
        else:
            self.philox_offset_per_thread_ = offset

    def manual_seed(self, seed: int) -> None:
        self.set_current_seed(seed)

    # -- what kernels get ------------------------------------------------------------------------------
    def philox_cuda_state(self, increment: int):
        """(seed, base offset tensor, offset baked into the kernel); advances the right counter."""
        if capturing():
            state = (self.seed_extragraph_, self.offset_extragraph_, self.offset_intragraph_)
            self.offset_intragraph_ += increment
            return state
        seed = torch.full((1,), self.seed_, dtype=torch.int64, device=self.device)
        state = (seed, torch.zeros(1, dtype=torch.int64, device=self.device), self.philox_offset_per_thread_)
        self.philox_offset_per_thread_ += increment
        return state

    def capture_prologue(self) -> None:
        self.offset_intragraph_ = 0

    def capture_epilogue(self) -> None:
        self.wholegraph_increment = self.offset_intragraph_

    def replay_prologue(self) -> None:
        """Host work before each replay (outside the graph): feed the graph this step's seed and offset."""
        self.seed_extragraph_.fill_(self.seed_)
        self.offset_extragraph_.fill_(self.philox_offset_per_thread_)
        self.philox_offset_per_thread_ += self.wholegraph_increment


def get_rng_state(gen):
    return gen.current_seed(), gen.get_offset()


def set_rng_state(gen, state):
    seed, offset = state
    gen.set_current_seed(seed)
    gen.set_offset(offset)


def rand_like(x, gen):
    """A counter-based uniform draw (philox in miniature): value i depends only on seed and offset + i."""
    seed, base, intra = gen.philox_cuda_state(x.numel())
    counter = base + intra + torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    h = (counter * 2654435761 + seed * 40503 + 12345) & _MASK
    h = ((h ^ (h >> 13)) * 1274126177) & _MASK
    h = h ^ (h >> 16)
    return (h.to(torch.float32) / float(1 << 32)).view_as(x)


class checkpoint:
    """``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, preserve_rng_state=True)`` in miniature:
    forward keeps no activations, backward rewinds the RNG and recomputes."""

    def __init__(self, fn, x, gen):
        self.fn, self.x, self.gen = fn, x, gen
        self.fwd_rng_state = get_rng_state(gen)               # stash where forward's draws start
        with torch.no_grad():
            self.out = fn(x)[0]

    def recompute(self):
        current = get_rng_state(self.gen)                     # torch.random.fork_rng
        set_rng_state(self.gen, self.fwd_rng_state)
        try:
            return self.fn(self.x)
        finally:
            set_rng_state(self.gen, current)


def block(w, gen):
    def fn(x):
        z = x @ w
        keep = torch.sigmoid(4.0 * (rand_like(z, gen) - 0.5))    # a random gate, as dropout
        return torch.tanh(z) * keep, z, keep
    return fn


def train_step(x, target, w, gen):
    """Forward (checkpointed block, then a noise draw), loss = sum(y * target), and the backward by hand."""
    ckpt = checkpoint(block(w, gen), x, gen)
    y = ckpt.out + 0.1 * rand_like(ckpt.out, gen)
    _, z, keep = ckpt.recompute()                             # the backward's recompute
    grad_z = target * keep * (1 - torch.tanh(z) ** 2)
    return y, grad_z @ w.T, x.T @ grad_z


def run(variant: str, device: str = "cpu"):
    data = generator(162505)
    w = randn(DIM, DIM, gen=data, device=device, scale=0.5)
    xs = [randn(ROWS, DIM, gen=data, device=device) for _ in range(STEPS)]
    targets = [randn(ROWS, DIM, gen=data, device=device) for _ in range(STEPS)]
    fixed = variant == "fix"

    def eager():
        gen = CUDAGeneratorImpl(device, fixed)
        gen.manual_seed(SEED)
        outs = []
        for x, t in zip(xs, targets):
            outs += [o.clone() for o in train_step(x, t, w, gen)]
        return outs

    def served():
        gen = CUDAGeneratorImpl(device, fixed)
        gen.manual_seed(SEED)
        static_x, static_t = xs[0].clone(), targets[0].clone()
        gen.capture_prologue()
        g, out = capture(lambda: train_step(static_x, static_t, w, gen), device=device,
                         static={"x": static_x, "target": static_t}, owner="checkpointed train step")
        gen.capture_epilogue()
        gen.manual_seed(SEED)                                 # as the repro, before replaying
        outs = []
        for x, t in zip(xs, targets):
            static_x.copy_(x)
            static_t.copy_(t)
            gen.replay_prologue()
            outs += [o.clone() for o in replay(g, out)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
