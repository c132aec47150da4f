"""On ROCm 7.0 PyTorch's ``zero_`` runs ``hipMemsetAsync``, whose captured memset node reads its fill pattern from the queue's generic kernarg memory: eager launches between replays reuse that slot, so a replayed ``grad.zero_()`` writes their argument instead of 0 and gradient accumulation starts from garbage.

Upstream: https://github.com/pytorch/pytorch/pull/197377 ("[ATen] Keep the fill_ kernel for zero_ on ROCm 7.0.x
(hipMemsetAsync corrupts under graph capture)", pytorch/pytorch, 2026-09-17; closed, exported from Meta's internal
diff tool: the thread I read shows no merge comment, so landing is not confirmed). It narrows the earlier
https://github.com/pytorch/pytorch/pull/197017 (same fix, window [7.0.0, 7.2.4), reviewed by pdesupinski, who pinned
the ROCm fix). Read: both PR descriptions; #197017's review thread with the diff of
``aten/src/ATen/native/cuda/TensorFactories.cu`` (``zero_cuda_`` gains ``#if !defined(USE_ROCM) || ROCM_VERSION <
70000 || ...`` around the memset fast path, else ``self.fill_(0)``); the root cause in the ROCm runtime from
https://github.com/ROCm/rocm-systems/pull/1068 ("clr: Fix memory corruption for memset nodes", merged 2025-09-19):
"Graph capture optimization for hipMemset nodes was storing patterns in regular kernel argument memory instead of
graph-reserved memory ... If graph is created but not used, and other kernels run, they can overwrite the generic
kernarg memory", fixed by taking the pattern from ``getGraphKernArgOffset()`` while capturing. That this is the clr
commit 3038c4c the PyTorch thread pins is my reading of dates and wording, not something either thread states.
Symptom: with ROCm 7.0, a HIP graph that zeroes a buffer with ``zero_`` (since pytorch#195303 routed ``zero_`` to
``cudaMemsetAsync``) "silently returns wrong data ... a buffer ``zero_`` reports as zeroed reads back non-zero. No
error, no NaN, correct shape and dtype"; eager runs and ROCm 6.4.2 / 7.1.0 are correct.
Mechanism: every HIP launch stages its arguments in the queue's kernarg pool, a ring of host-visible slots that a
launch holds only until it retires. ``fillBuffer`` (the blit behind ``hipMemsetAsync``) put its pattern there even
while capturing, and the dispatch packet formed at capture keeps the slot's address. After the capture the slot
goes back to the ring; the next eager launches (here the input pipeline's normalisation, one per microbatch) stage
their arguments in it, and every replay's memset then fills the gradient with the first of them.
Doctor: dangling-reference at zero_cuda_: each replay copies the fill pattern from kernarg memory whose owner, the
capture-time memset launch, has given it back, so it reads what later eager launches staged there; ``zero_cuda_``
is where the fix stops taking that path.
Fix (upstream): inside the affected ROCm window ``zero_cuda_`` calls ``self.fill_(0)``: the fill kernel's scalar is
part of the captured node, so replays write 0. (ROCm's own fix moved the pattern to graph-owned kernarg memory.)
Modelled: ``VirtualGPU`` with its kernarg ring (``allocKernArg``, ``fillBuffer`` as rocblit does it in 7.0, and an
eager ``launch``); ``hipMemsetAsync``; ``zero_cuda_`` with the ROCm-version gate of the fix; ``SGD`` with momentum
(``zero_grad(set_to_none=False)`` calls ``p.grad.zero_()``, as torch's non-foreach path does); a two-layer MLP with its
backward written out; a whole training step captured as in the CUDA-graphs notes' whole-network example, here
accumulating two microbatches inside the graph. Stand-ins: the kernarg ring is host memory (``host()``) that the
kernel "loads" with a captured non-blocking copy; four slots of four float64 arguments; the staging writes are host
writes, as rocclr's are; only the memset path reads generic kernarg memory while capturing, as in 7.0 (captured
kernels use graph-owned kernargs); the normalisation kernel stands for every eager launch of the input pipeline.
Workload: 4 training steps of 2 microbatches (batch 4, 6 -> 8 -> 3, tanh, MSE), SGD lr 0.1 momentum 0.9, float64.
Step 1 runs eagerly (the warmup); the whole step is captured; steps 2-4 replay. Bug: the capture's four memsets
took ring slots 2, 3, 0, 1; step 2's two normalisation launches restage slots 2 and 3 with (mean, 1/std), so from
step 2 ``W1.grad`` and ``b1.grad`` start at 0.5, and from step 3 ``W2.grad`` and ``b2.grad`` too. The losses of steps
1-2 match (a step's loss comes before its update), step 3's is off by 0.017 and step 4's by 0.269; the final weights
by up to 0.327 (``W1``; max |graph - eager| = 0.327). With a mean of 0, or a ring that does not wrap, the bug
variant equals eager: the wrong values are the restaged argument. Fix: all four losses and the weights equal eager
(max error 0).
"""
from __future__ import annotations

import torch

from workbench.engine import events, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/197377"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "zero_cuda_"
SYMPTOM = ("ROCm 7.0 + HIP graph: a captured zero_ (hipMemsetAsync) keeps its fill pattern in generic kernarg "
           "memory that later eager launches reuse, so replays 'zero' gradients to another kernel's argument")

BATCH, IN, HIDDEN, OUT, MICROBATCHES, STEPS = 4, 6, 8, 3, 2, 4
LR, MOMENTUM = 0.1, 0.9
DATA_MEAN, DATA_INV_STD = 0.5, 2.0
KERNARG_SLOTS, KERNARG_SLOT_ELEMS = 4, 4
ROCM_VERSION = 70000                 # ROCm 7.0.0: memset nodes keep their pattern in generic kernarg memory
DTYPE = torch.float64

_variant = "bug"


# --- ROCm clr (reduced): rocvirtual.cpp's kernarg pool, rocblit.cpp's fillBuffer ---------------------------------

class VirtualGPU:
    """One HIP queue. Each launch stages its arguments in the queue's generic kernarg pool, a ring of host-visible
    slots; the dispatch packet keeps the slot's address and the kernel loads its arguments from it when it runs.
    A slot is the launch's only until the launch retires; then the ring hands it to a later launch."""

    def __init__(self, device: str):
        self.device = device
        self.kernarg_pool = host(torch.zeros(KERNARG_SLOTS, KERNARG_SLOT_ELEMS, dtype=DTYPE), device)
        self.next_slot = 0

    def allocKernArg(self, values) -> torch.Tensor:
        slot = self.kernarg_pool[self.next_slot]
        self.next_slot = (self.next_slot + 1) % KERNARG_SLOTS
        for i, value in enumerate(values):              # memcpy of the arguments into kernarg memory (host)
            slot[i] = float(value)
        return slot

    def load_kernargs(self, slot: torch.Tensor, n: int) -> torch.Tensor:
        """What the kernel reads at run time: the slot by address (a captured packet re-reads it every replay)."""
        args = torch.empty(n, dtype=DTYPE, device=self.device)
        args.copy_(slot[:n], non_blocking=torch.cuda.is_current_stream_capturing())
        return args

    def fillBuffer(self, dst: torch.Tensor, pattern: float) -> None:
        """rocblit ``fillBuffer`` (ROCm 7.0): the pattern goes to generic kernarg memory even while a graph is
        being captured (7.1 takes it from ``getGraphKernArgOffset()`` then)."""
        slot = self.allocKernArg([pattern])
        dst.copy_(self.load_kernargs(slot, 1).expand_as(dst))

    def launch(self, kernel, out: torch.Tensor, *scalars) -> None:
        """An eager kernel launch (``hipModuleLaunchKernel``): its scalar arguments go through the ring too."""
        slot = self.allocKernArg(scalars)
        kernel(out, self.load_kernargs(slot, len(scalars)))


_gpu: VirtualGPU | None = None


def hipMemsetAsync(dst: torch.Tensor, value: float) -> None:
    _gpu.fillBuffer(dst, value)


# --- aten/src/ATen/native/cuda/TensorFactories.cu (hipified) ------------------------------------------------------

def zero_cuda_(self: torch.Tensor) -> torch.Tensor:
    """``zero_`` on CUDA/ROCm since pytorch#195303: ``cudaMemsetAsync`` (``hipMemsetAsync``) instead of a fill kernel."""
    if _variant == "fix" and 70000 <= ROCM_VERSION < 70100:
        # hipMemsetAsync silently leaves stale data behind when it is captured into a HIP graph on these ROCm
        # versions, so they keep the fill_ kernel.
        return self.fill_(0)
    hipMemsetAsync(self, 0.0)
    return self


# --- the model, torch.optim.SGD (reduced) and the captured training step ------------------------------------------

class Parameter:
    def __init__(self, data: torch.Tensor):
        self.data, self.grad = data, torch.zeros_like(data)


class MLP:
    """Linear -> tanh -> Linear, its backward written out (autograd accumulates into ``.grad``)."""

    def __init__(self, device: str):
        gen = generator(197377)
        self.W1 = Parameter(randn(HIDDEN, IN, gen=gen, device=device, scale=0.5).to(DTYPE))
        self.b1 = Parameter(randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE))
        self.W2 = Parameter(randn(OUT, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE))
        self.b2 = Parameter(randn(OUT, gen=gen, device=device, scale=0.1).to(DTYPE))

    def parameters(self):
        return [self.W1, self.b1, self.W2, self.b2]

    def forward_backward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(x @ self.W1.data.t() + self.b1.data)
        y = a @ self.W2.data.t() + self.b2.data
        loss = ((y - target) ** 2).mean()
        dy = 2.0 * (y - target) / y.numel()                       # loss.backward()
        self.W2.grad.add_(dy.t() @ a)
        self.b2.grad.add_(dy.sum(0))
        dh = (dy @ self.W2.data) * (1.0 - a * a)
        self.W1.grad.add_(dh.t() @ x)
        self.b1.grad.add_(dh.sum(0))
        return loss


class SGD:
    def __init__(self, params, lr: float, momentum: float):
        self.params, self.lr, self.momentum = params, lr, momentum
        self.momentum_buffers = [torch.zeros_like(p.data) for p in params]

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params:                                  # foreach=None: the per-tensor path
            zero_cuda_(p.grad)                                 # p.grad.zero_()

    def step(self) -> None:
        for p, buf in zip(self.params, self.momentum_buffers):
            buf.mul_(self.momentum).add_(p.grad)
            p.data.sub_(self.lr * buf)


def _normalize_kernel(x: torch.Tensor, args: torch.Tensor) -> None:
    x.sub_(args[0]).mul_(args[1])


def input_pipeline(raw: torch.Tensor) -> torch.Tensor:
    """Per microbatch, on the device: (x - mean) / std, one eager kernel launch each."""
    x = raw.clone()
    for mb in range(MICROBATCHES):
        _gpu.launch(_normalize_kernel, x[mb], DATA_MEAN, DATA_INV_STD)
    return x


def run(variant: str, device: str = "cpu"):
    global _variant, _gpu
    _variant = variant
    gen = generator(103)
    data = [(randn(MICROBATCHES, BATCH, IN, gen=gen, device=device).to(DTYPE) + DATA_MEAN,
             randn(MICROBATCHES, BATCH, OUT, gen=gen, device=device).to(DTYPE)) for _ in range(STEPS)]

    def train(use_graph: bool):
        global _gpu
        _gpu = VirtualGPU(device)
        model = MLP(device)
        optimizer = SGD(model.parameters(), LR, MOMENTUM)
        static_input = torch.zeros(MICROBATCHES, BATCH, IN, dtype=DTYPE, device=device)
        static_target = torch.zeros(MICROBATCHES, BATCH, OUT, dtype=DTYPE, device=device)

        def train_step():
            optimizer.zero_grad(set_to_none=False)
            loss = torch.zeros((), dtype=DTYPE, device=device)
            for mb in range(MICROBATCHES):
                loss = loss + model.forward_backward(static_input[mb], static_target[mb])
            optimizer.step()
            return loss

        losses, g, static_loss = [], None, None
        for step, (raw, target) in enumerate(data):
            static_input.copy_(input_pipeline(raw))
            static_target.copy_(target)
            if not use_graph:
                losses.append(train_step().clone())
            elif g is None:                                    # warmup step, then capture the whole step
                with events.warmup():
                    losses.append(train_step().clone())
                state = {name: t for i, p in enumerate(optimizer.params)
                         for name, t in ((f"param[{i}]", p.data), (f"grad[{i}]", p.grad))}
                state.update({f"momentum_buffer[{i}]": b for i, b in enumerate(optimizer.momentum_buffers)})
                g, static_loss = capture(train_step, device=device, warmups=0, name="train step",
                                         owner="whole-network capture",
                                         static={"input": static_input, "target": static_target}, state=state)
            else:
                losses.append(replay(g, static_loss).clone())
        return [torch.stack(losses)] + [p.data.clone() for p in model.parameters()]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
