"""Autograd under CUDA graph capture: a retained ``AccumulateGrad`` node keeps the default stream it saw at warm-up, and the captured backward waits on it.

Upstream: https://github.com/pytorch/pytorch/pull/180090 ("Detect and fix stale stream references in autograd during
CUDA graph capture", eee4017, April 2026; landed: the follow-ups #189371 and #189591 build on it). Read: the PR
description ("During CUDA graph capture, autograd nodes may hold a stale reference to a non-capturing stream from a
prior warmup iteration. When the autograd engine encounters such a node, it issues ``cudaStreamWaitEvent`` on that
stream, which pulls a non-capturing stream into the capture graph and invalidates it"; reproducer: "default-stream
warmup followed by side-stream capture"; default: a clear ``RuntimeError`` for a stale default stream; opt-in
``torch.autograd.graph.set_override_stale_capture_stream(True)`` redirects the stale stream to the producer's
capturing stream), review excerpts of the ``engine.cpp`` hunk (in ``evaluate_function``, before the
``OptionalStreamGuard``: ``if (opt_parent_stream.has_value() && !opt_parent_stream->is_capturing())`` and an input's
``ready_streams[pos]->is_capturing()``, then ``opt_parent_stream = maybe_override_stale_capture_stream(...)``; the
author: without it "``opt_parent_stream->wait(opt_ready_event)`` below issues ``cudaStreamWaitEvent`` on a
non-capturing stream") and of the new error text, and the description of #189371 (delayed-wgrad Megatron training:
``AccumulateGrad`` nodes "hold default-stream metadata from eager warmup"). Not read: the full diff, the
``InputBuffer::add`` hunk, the tests.
Symptom: a training step whose warm-up ran on the default stream (as the reproducer does) cannot be captured: the
capture of ``loss.backward()`` fails with ``operation would make the legacy stream depend on a capturing blocking
stream`` (``cudaErrorStreamCaptureImplicit``), an opaque CUDA error naming no autograd node.
Mechanism: an autograd node records the stream current when it is created (``Node::stream()``) and the engine runs
it there: ``Engine::evaluate_function`` takes ``opt_parent_stream = func->stream()``, guards it and makes it wait on
the ready event its producer recorded (``opt_parent_stream->wait(opt_ready_event)``). A leaf's ``AccumulateGrad``
node is created once and outlives the iteration when something retains it (Megatron's DDP keeps every parameter's
grad accumulator to hang its grad-ready hook on), so it keeps the stream of the eager warm-up: the legacy default
stream. ``torch.cuda.graph`` captures on a side stream; in the captured backward the producer of the weight's
gradient runs on the capturing stream, and the engine makes the default stream wait on an event recorded in the
capture. CUDA refuses that and invalidates the capture.
Doctor: warmup-divergence, at evaluate_function. The warm-up decided the accumulator node's stream (lazily, when it
was made); the capture reuses that decision, which no longer holds once the work runs on the capture stream.
Fix (upstream): ``evaluate_function`` (and ``InputBuffer::add``) call ``maybe_override_stale_capture_stream`` when the
node's stream is not capturing but a ready stream is: by default a stale default stream raises a ``RuntimeError``
naming the node; with ``set_override_stale_capture_stream(True)`` the node runs on the producer's capturing stream.
The fix variant turns the override on (the path that lets the capture proceed).
Modelled: the engine's stream bookkeeping (``Stream`` with ``is_capturing``/``wait``, ``Event.record``, nodes that
remember their creation stream, ``evaluate_function``, the override) around a hand-written backward of a
one-layer least-squares model (``MseLossBackward`` -> ``MmBackward`` -> ``AccumulateGrad``); a DDP-style wrapper
retains the weight's ``AccumulateGrad`` at wrap time. The CUDA refusal of a cross-capture wait is raised as the
engine's ``CaptureError``. Streams are bookkeeping only: the kernels run where the engine runs them, on either
device. The whole step (zero_grad, forward, backward, SGD update) is captured once after one eager warm-up step.
Workload: weight 4x3, batch 8, lr 0.1; step 0 is the warm-up (on the default stream), then capture, then 5 replays
with fresh data copied into the static inputs; outputs are the weights after each step. The bug's capture fails at
``AccumulateGrad`` (raised ``CaptureError``); the fix captures and its 6 steps equal eager.
"""
from __future__ import annotations

import torch

from workbench.engine import CaptureError, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/180090"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "evaluate_function"
SYMPTOM = ("capturing a backward whose warm-up ran on the default stream fails: a retained AccumulateGrad node "
           "kept the warm-up's default stream and the engine makes it wait on an event of the capture")

IN, OUT, BATCH, STEPS, LR = 4, 3, 8, 6, 0.1

_variant = "bug"
_override_stale_capture_stream = False      # torch.autograd.graph.set_override_stale_capture_stream


# --- c10::Stream / at::cuda::CUDAEvent bookkeeping ------------------------------------------------------------------

class Stream:
    def __init__(self, name):
        self.name = name

    def is_capturing(self):
        return is_capturing() and self is CAPTURE_STREAM

    def wait(self, event):
        """``cudaStreamWaitEvent(self, event)``: a non-capturing stream may not wait on an event of a capture."""
        if event.stream is not None and event.stream.is_capturing() and not self.is_capturing():
            raise CaptureError(f"CUDA error: operation would make the legacy stream depend on a capturing blocking "
                               f"stream (cudaErrorStreamCaptureImplicit): {self.name} waits on {event.stream.name}",
                               op="cudaStreamWaitEvent")


class Event:
    def __init__(self):
        self.stream = None

    def record(self, stream):
        self.stream = stream


DEFAULT_STREAM = Stream("default (legacy) stream")
CAPTURE_STREAM = Stream("torch.cuda.graph capture stream")


def current_stream():
    """``torch.cuda.graph`` captures on its own side stream; outside it the program runs on the default stream."""
    return CAPTURE_STREAM if is_capturing() else DEFAULT_STREAM


def set_override_stale_capture_stream(enabled):
    global _override_stale_capture_stream
    _override_stale_capture_stream = enabled


# --- torch/csrc/autograd: nodes (function.h), the engine (engine.cpp) -------------------------------------------------

class Node:
    def __init__(self):
        self._stream = current_stream()              # recorded when the forward op creates the node

    def stream(self):
        return self._stream


class MseLossBackward(Node):
    def __init__(self, diff, next_fn):
        super().__init__()
        self.diff, self.next_fn = diff, next_fn

    def apply(self, grad):
        return self.next_fn, grad * 2.0 * self.diff / self.diff.numel()


class MmBackward(Node):
    def __init__(self, x, next_fn):
        super().__init__()
        self.x, self.next_fn = x, next_fn

    def apply(self, grad):
        return self.next_fn, self.x.T @ grad


class AccumulateGrad(Node):
    def __init__(self, variable):
        super().__init__()
        self.variable = variable

    def apply(self, grad):
        self.variable.grad.add_(grad)                # .grad exists (zero_grad(set_to_none=False)): in place
        return None, None


def grad_accumulator(variable):
    """``impl::grad_accumulator``: one node per leaf, reused while anything keeps it alive."""
    acc = getattr(variable, "_grad_accumulator", None)
    if acc is None:
        acc = AccumulateGrad(variable)
        variable._grad_accumulator = acc
    return acc


def maybe_override_stale_capture_stream(opt_parent_stream, ready_stream, name):
    if not _override_stale_capture_stream:
        if opt_parent_stream is DEFAULT_STREAM:
            raise RuntimeError(f"During CUDA graph capture, autograd node '{name}' has a stale reference to the "
                               f"default stream from warmup. This will invalidate the capture.")
        return opt_parent_stream
    return ready_stream


def evaluate_function(func, grad, ready_stream, ready_event):
    opt_parent_stream = func.stream()
    if _variant == "fix":
        # Check for stale non-capturing stream and override or error as configured.
        if not opt_parent_stream.is_capturing() and ready_stream.is_capturing():
            opt_parent_stream = maybe_override_stale_capture_stream(opt_parent_stream, ready_stream,
                                                                    type(func).__name__)
    # c10::OptionalStreamGuard parent_stream_guard{opt_parent_stream};
    opt_parent_stream.wait(ready_event)              # the consumer waits for its producer
    next_fn, next_grad = func.apply(grad)
    event = Event()
    event.record(opt_parent_stream)
    return next_fn, next_grad, opt_parent_stream, event


def engine_execute(root, grad):
    stream, event = current_stream(), Event()
    event.record(stream)
    func = root
    while func is not None:
        func, grad, stream, event = evaluate_function(func, grad, stream, event)


# --- the user's model and training step --------------------------------------------------------------------------------

class DistributedDataParallel:
    """Megatron-style DDP: retains each parameter's grad accumulator to register its grad-ready hook."""

    def __init__(self, weight):
        self.weight = weight
        self.grad_accs = [grad_accumulator(weight)]  # made at wrap time, on the default stream


def forward_backward(ddp, x, y):
    out = x @ ddp.weight
    diff = out - y
    root = MseLossBackward(diff, MmBackward(x, grad_accumulator(ddp.weight)))
    engine_execute(root, torch.ones((), device=x.device))
    return (diff * diff).mean()


def make(device):
    gen = generator(180090)
    weight = randn(IN, OUT, gen=gen, device=device, scale=0.5)
    target = randn(IN, OUT, gen=gen, device=device)
    data = []
    for _ in range(STEPS):
        x = randn(BATCH, IN, gen=gen, device=device)
        data.append((x, x @ target))
    weight.grad = torch.zeros_like(weight)
    return DistributedDataParallel(weight), data


def train_step(ddp, x, y):
    ddp.weight.grad.zero_()
    loss = forward_backward(ddp, x, y)
    ddp.weight.sub_(LR * ddp.weight.grad)
    return loss


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    set_override_stale_capture_stream(variant == "fix")

    def served():
        ddp, data = make(device)
        static_x, static_y = data[0][0].clone(), data[0][1].clone()
        out = []
        g, static_loss = capture(lambda: train_step(ddp, static_x, static_y), device=device, warmups=1,
                                 name="train step", owner="torch.cuda.graph (whole step)",
                                 static={"static_x": static_x, "static_y": static_y},
                                 state={"weight": ddp.weight, "weight.grad": ddp.weight.grad})
        out.append(ddp.weight.clone())               # after the warm-up step (step 0)
        for x, y in data[1:]:
            static_x.copy_(x)
            static_y.copy_(y)
            replay(g, static_loss)
            out.append(ddp.weight.clone())
        return out

    def eager():
        ddp, data = make(device)
        out = []
        for x, y in data:
            train_step(ddp, x, y)
            out.append(ddp.weight.clone())
        return out

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
