"""CUDA graph trees hand back the same cached output tensor every replay, still carrying an earlier step's hooks.

Upstream: https://github.com/pytorch/pytorch/pull/126914 ("cudagraphs: fix backward hooks & fsdp interaction",
May 2024).
Read: the PR description and review thread, and the lines it adds to ``CUDAGraphNode.reconstruct_outputs`` (they
are in later ``torch/_inductor/cudagraph_trees.py``: reset ``cached_t._backward_hooks`` before returning a cached
output); not its test. The FSDP side is modelled on FSDP1's ``_runtime_utils`` (pre-backward hook registered on
forward outputs with ``Tensor.register_hook``, post-backward hook asserting ``FORWARD_BACKWARD``; here a
``register_post_accumulate_grad_hook`` stands for the hook FSDP puts on the flat parameter's gradient
accumulation).
Symptom: composing FSDP with ``torch.compile(mode="reduce-overhead")`` (cudagraph trees) fails in the backward
of a later iteration with "ERROR: expected to be in states [<TrainingState.FORWARD_BACKWARD: 2>] but current
state is TrainingState.IDLE"; without CUDA graphs the same training runs.
Mechanism: after a node has been recorded, its executions serve every unaliased output from
``cached_tensor_outputs`` (#98944): ``reconstruct_outputs`` returns the same Tensor object on every replay, to
save the cost of building output tensors. AOTAutograd's ``CompiledFunction`` gives the returned tensor a new
``grad_fn`` each call, but ``_backward_hooks`` is a Python attribute of the tensor object and survives.
``Tensor.register_hook`` registers its hook dict with the tensor's current ``grad_fn`` only when
``_backward_hooks`` is ``None``; on the second replay that serves the cached tensor, the dict of the previous
step is still there, so FSDP's ``_pre_backward_hook`` is added to a dict that this step's ``grad_fn`` never
calls. The pre-backward hook does not run, ``training_state`` stays ``IDLE``, and the post-backward hook of the
flat parameter raises. An eager step (or the warmup and recording runs) returns a fresh tensor each time.
Doctor: warmup-divergence, at ``reconstruct_outputs`` (the output tensor object chosen at the first replay is
reused by every later replay with state an earlier step attached to it, where an eager step makes a new one).
Fix (upstream): in ``reconstruct_outputs``, for a cached output, ``if cached_t._backward_hooks is not None:
cached_t._backward_hooks = None`` before returning it.
"""
from __future__ import annotations

import functools
from enum import Enum, auto

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/pytorch/pull/126914"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "reconstruct_outputs"
SYMPTOM = "FSDP + reduce-overhead: later backward raises 'expected FORWARD_BACKWARD but current state is IDLE'"
BATCH, DIM, STEPS, LR, WORLD_SIZE = 3, 4, 5, 0.1, 2


# --------------------------------------------------------------------------------------- FSDP1 (one unit)
class TrainingState(Enum):
    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


class FSDPState:
    def __init__(self, flat_param):
        self.flat_param = flat_param
        self.training_state = TrainingState.IDLE
        self._is_root = True
        self._post_backward_callback_queued = False
        self._ran_pre_backward_hook = False
        self.peer_grad = None               # rank 1's unsharded gradient, as the reduce-scatter delivers it
        flat_param.register_post_accumulate_grad_hook(functools.partial(_post_backward_hook, self))


def _assert_in_training_states(state, training_states):
    if state.training_state not in training_states:
        raise ValueError(f"expected to be in states {training_states} but current state is "
                         f"{state.training_state}")


def _pre_backward_hook(state, grad):
    if state._ran_pre_backward_hook:
        return grad
    if state._is_root and not state._post_backward_callback_queued:
        state._post_backward_callback_queued = True        # _register_post_backward_final_callback
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_post_backward_final_callback, state))
    state.training_state = TrainingState.FORWARD_BACKWARD
    state._ran_pre_backward_hook = True                   # (and unshard the flat parameter: a no-op here)
    return grad


def _post_backward_hook(state, flat_param):
    _assert_in_training_states(state, [TrainingState.FORWARD_BACKWARD])
    with torch.no_grad():                                 # _reduce_grad: reduce-scatter, then average
        flat_param.grad.add_(state.peer_grad).div_(WORLD_SIZE)


def _post_backward_final_callback(state):
    state.training_state = TrainingState.IDLE
    state._post_backward_callback_queued = False
    state._ran_pre_backward_hook = False


def _register_pre_backward_hooks(state, outputs):
    """``_post_forward``: a pre-backward hook on every forward output that requires grad."""
    if outputs.requires_grad:
        outputs.register_hook(functools.partial(_pre_backward_hook, state))
    return outputs


# ------------------------------------------------------------- the compiled module and its cudagraph tree
def compiled_forward(x, weight):
    """Inductor's forward graph of the wrapped module."""
    return torch.tanh(x @ weight)


class CUDAGraphNode:
    def __init__(self, wrapped_function, inputs, device, variant):
        self.variant = variant
        self.static_x = inputs[0].detach().clone()           # non-static input: copied in
        self.weight = inputs[1]                              # parameter: static, same address every call
        self.graph, self.static_output = capture(
            lambda: wrapped_function(self.static_x, self.weight), device=device, warmups=0,
            static={"x": self.static_x}, owner="CUDAGraphTreeManager", name="compiled_forward")
        self.cached_tensor_outputs: list[torch.Tensor] = []

    def _reconstruct_from_tensor_metadata(self):
        """A new tensor object over the output's storage (what a replay hands out)."""
        out = self.static_output
        return torch.empty(0, dtype=out.dtype, device=out.device).set_(
            out.untyped_storage(), out.storage_offset(), out.shape, out.stride())

    def run_first_inputs(self):
        """The recording run: outputs are built fresh and not cached (memory must stay reclaimable)."""
        replay(self.graph, self.static_output)
        return self._reconstruct_from_tensor_metadata()

    def run(self, new_inputs):
        self.static_x.copy_(new_inputs[0])
        replay(self.graph, self.static_output)
        return self.reconstruct_outputs()

    def reconstruct_outputs(self):
        if not self.cached_tensor_outputs:                   # _initialize_cached_tensors on the first replay
            self.cached_tensor_outputs.append(self._reconstruct_from_tensor_metadata())
        cached_t = self.cached_tensor_outputs[0]
        # this output represents a fresh allocated tensor. We return the same TensorImpl from run to run
        # to avoid overhead. autograd.Function will reset the Autograd meta of output tensors as part of
        # aot_autograd, but _backward_hooks are stored on tensors separately.
        if self.variant == "fix" and cached_t._backward_hooks is not None:
            cached_t._backward_hooks = None
        return cached_t


class CUDAGraphTreeManager:
    """One function: warmup on the first call, record on the second, replay afterwards."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.calls, self.node = 0, None

    def run(self, wrapped_function, new_inputs):
        self.calls += 1
        if self.calls == 1:
            with events.warmup(real=True):
                return wrapped_function(*new_inputs)
        if self.node is None:
            self.node = CUDAGraphNode(wrapped_function, new_inputs, self.device, self.variant)
            return self.node.run_first_inputs()
        return self.node.run(new_inputs)


def make_compiled_function(manager):
    class CompiledFunction(torch.autograd.Function):
        """AOTAutograd's runtime wrapper around the (cudagraphed) forward and its backward."""

        @staticmethod
        def forward(ctx, x, weight):
            out = compiled_forward(x, weight) if manager is None else manager.run(compiled_forward, (x, weight))
            ctx.save_for_backward(x, weight, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, weight, out = ctx.saved_tensors
            grad_pre = grad_out * (1 - out * out)
            return grad_pre @ weight.t(), x.t() @ grad_pre

    return CompiledFunction


def run(variant: str, device: str = "cpu"):
    gen = generator(126914)
    w0 = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
    batches = [(randn(BATCH, DIM, gen=gen, device=device), randn(BATCH, DIM, gen=gen, device=device),
                randn(DIM, DIM, gen=gen, device=device, scale=0.3)) for _ in range(STEPS)]

    def workload(graphed: bool):
        flat_param = w0.clone().requires_grad_()
        state = FSDPState(flat_param)
        fn = make_compiled_function(CUDAGraphTreeManager(device, variant) if graphed else None)
        outs = []
        for x, target, peer_grad in batches:
            state.peer_grad = peer_grad
            out = _register_pre_backward_hooks(state, fn.apply(x, flat_param))   # FSDP forward
            loss = (out * target).sum()
            loss.backward()
            outs += [loss.detach().reshape(1), flat_param.grad.clone()]
            with torch.no_grad():
                flat_param.sub_(LR * flat_param.grad)
            flat_param.grad = None
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
