"""Local CUDA graphs pick the params to backprop from the captured forward, where checkpointing hides one.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/6373 ("Fix hidden checkpoint parameter handling in local
CUDA graphs"). Read: the diff and its new test (the PR has no description; the symptom below is what the
diff and ``TestCheckpointParameterDiscovery`` imply).
Symptom: training with Megatron-Core's local CUDA graphs (``--cuda-graph-impl local``) and selective
activation recompute (``CheckpointWithoutOutput``) gives parameters used inside the checkpointed region no
gradient: their ``main_grad`` stays zero (with ``overlap_grad_reduce`` their DDP bucket is never marked
ready), while the same run without CUDA graphs trains them (Megatron-Core main, August 2026; the PR adds
``TestCheckpointParameterDiscovery``).
Mechanism: ``_CudaGraphRunner.create_fwd_graph`` captures the forward and then sets
``params_to_backprop = self.get_connected_params(fwd_graph_outputs)``: a walk of the captured outputs'
autograd graph collecting the ``AccumulateGrad`` leaves. Under capture, ``CheckpointWithoutOutput.checkpoint``
runs its function through ``CheckpointWithoutOutputFunction``, whose node has only the activations as edges:
the checkpointed module's weight is not reachable, so it is not in ``params_to_backprop``. The backward
graph (``create_bwd_graph``) accumulates ``main_grad.add_(wgrad)`` only for ``params_to_backprop``; the
weight's gradient is produced by the checkpoint's nested backward into ``param.grad`` (the DDP post-hook
returns early while capturing), and no replay ever adds it to ``main_grad``. In eager, the DDP post-hook
adds every parameter's ``param.grad`` to ``main_grad``.
Doctor: warmup-divergence, at ``create_fwd_graph`` (the plan of which parameters get their wgrad
accumulated is taken from the captured forward, which differs from what an eager step does).
Fix (upstream): discover the parameters on the graph-warmup outputs (warmup bypasses
``CheckpointWithoutOutput``, so the hidden weight is reachable; force one warmup pass when recompute is on),
and in the backward capture add ``param.grad`` (what a nested backward accumulated) to ``main_grad`` too,
marking ``grad_added_to_main_grad``.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/6373"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "create_fwd_graph"
SYMPTOM = "the checkpointed module's weight never gets a gradient in main_grad under local CUDA graphs"
TOKENS, HIDDEN, MICROBATCHES = 3, 4, 3

_IS_GRAPH_WARMUP = False


def is_graph_warmup():
    return _IS_GRAPH_WARMUP


def _set_warmup(flag: bool):
    global _IS_GRAPH_WARMUP
    _IS_GRAPH_WARMUP = flag


# ------------------------------------------------------------------------------ a minimal autograd graph
class Parameter:
    def __init__(self, data):
        self.data = data
        self.main_grad = torch.zeros_like(data)     # DDP's contiguous grad buffer
        self.grad = None
        self.grad_added_to_main_grad = False


class AccumulateGrad:
    def __init__(self, variable):
        self.variable, self.next_functions = variable, ()


class Node:
    def __init__(self, name, *next_fns):
        self.name, self.next_functions = name, tuple((f, 0) for f in next_fns)


class Output:
    def __init__(self, value, grad_fn):
        self.value, self.grad_fn = value, grad_fn


class CheckpointWithoutOutput:
    def checkpoint(self, run_function, x):
        # If in cuda graph warmup, disable checkpointing (run the function as is).
        if is_graph_warmup():
            return run_function(x)
        with torch.no_grad():
            hidden = run_function(x).value
        # CheckpointWithoutOutputFunction: its node's edges are the saved activations, not the params
        return Output(hidden, Node("CheckpointWithoutOutputFunctionBackward", x.grad_fn))


class Linear:
    def __init__(self, weight):
        self.weight = Parameter(weight)

    def __call__(self, x):
        return Output(x.value @ self.weight.data, Node("MmBackward0", x.grad_fn, AccumulateGrad(self.weight)))


class _CheckpointDependencyModule:
    """A visible projection consuming the output of a checkpointed child module."""

    def __init__(self, device):
        gen = generator(6373)
        self.checkpointed = Linear(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6))
        self.projection = Linear(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6))

    def parameters(self):
        return [self.checkpointed.weight, self.projection.weight]

    def my_op(self, x):
        hidden = CheckpointWithoutOutput().checkpoint(self.checkpointed, x)
        return self.projection(hidden)

    def backward(self, x, grad_output):
        """The backward of ``my_op``: returns the input grad and the wgrads autograd hands back; the
        checkpoint's nested backward (recompute, then ``torch.autograd.backward``) accumulates the
        checkpointed weight's grad into ``param.grad``."""
        hidden = x @ self.checkpointed.weight.data                         # recompute
        wgrads = {id(self.projection.weight): hidden.t() @ grad_output}
        grad_hidden = grad_output @ self.projection.weight.data.t()
        accumulate_grad(self.checkpointed.weight, x.t() @ grad_hidden)     # nested backward
        return grad_hidden @ self.checkpointed.weight.data.t(), wgrads


def accumulate_grad(param, grad):
    param.grad = grad if param.grad is None else param.grad + grad


def ddp_post_hook(param, capturing):
    """``DistributedDataParallel._make_backward_post_hook``."""
    if capturing:
        return
    if param.grad is not None and not param.grad_added_to_main_grad:
        param.main_grad.add_(param.grad)
    param.grad = None


# ------------------------------------------------------------------------------------ local CUDA graphs
class _CudaGraphRunner:
    def __init__(self, module, device, variant):
        self.module, self.device, self.variant = module, device, variant
        self.needs_recompute_param_discovery = variant == "fix"   # grad enabled and recompute_granularity set

    def get_connected_params(self, outputs):
        """Iterate through the autograd graph of 'outputs' and return all parameters connected."""
        stack, visited, p_ids = [o.grad_fn for o in outputs if o.grad_fn], set(), set()
        while stack:
            if (fn := stack.pop()) not in visited:
                visited.add(fn)
                if hasattr(fn, "variable"):
                    p_ids.add(id(fn.variable))
                stack.extend(f for f, _ in fn.next_functions if f)
        return tuple(p for p in self.module.parameters() if id(p) in p_ids)

    def create_fwd_graph(self, sample):
        self.static_x = sample.clone()
        events.static_buffers("_CudaGraphRunner (fwd graph)", {"hidden_states": self.static_x})
        # warmup again as case graph capture mode may execute a different codepath
        _set_warmup(True)
        with events.warmup():
            warmup_outputs = [self.module.my_op(Output(self.static_x.clone(), Node("input")))]
        _set_warmup(False)
        fwd_graph_outputs = []

        def forward():
            out = self.module.my_op(Output(self.static_x, Node("input")))
            fwd_graph_outputs.append(out)
            return out.value

        self.fwd_graph, self.fwd_output = capture(forward, device=self.device, warmups=0, name="fwd",
                                                  static={"hidden_states": self.static_x},
                                                  owner="_CudaGraphRunner (fwd graph)")
        if self.needs_recompute_param_discovery:
            self.params_to_backprop = self.get_connected_params(warmup_outputs)
        else:
            self.params_to_backprop = self.get_connected_params(fwd_graph_outputs)

    def create_bwd_graph(self):
        self.static_grad_output = torch.zeros_like(self.fwd_output)

        def backward():
            for param in self.module.parameters():
                param.grad = None                    # the grads the last step's hooks consumed
            grad_input, wgrads = self.module.backward(self.static_x, self.static_grad_output)
            for param in self.module.parameters():
                ddp_post_hook(param, capturing=torch.cuda.is_current_stream_capturing())
            # Accumulate wgrads directly into main_grad inside the graph
            for param in self.params_to_backprop:
                wgrad = wgrads.get(id(param))
                done = param.grad_added_to_main_grad
                if wgrad is not None and not done:
                    param.main_grad.add_(wgrad)
                if self.variant == "fix" and param.grad is not None and not done:
                    # A nested backward can accumulate directly into param.grad instead of
                    # returning that contribution through the outer autograd.grad call.
                    param.main_grad.add_(param.grad)
            return grad_input

        self.bwd_graph, self.static_grad_input = capture(
            backward, device=self.device, warmups=0, name="bwd",
            static={"grad_output": self.static_grad_output, "hidden_states": self.static_x},
            state={f"main_grad[{i}]": p.main_grad for i, p in enumerate(self.module.parameters())},
            owner="_CudaGraphRunner (bwd graph)")


def run(variant: str, device: str = "cpu"):
    gen = generator(63730)
    batches = [(randn(TOKENS, HIDDEN, gen=gen, device=device), randn(TOKENS, HIDDEN, gen=gen, device=device))
               for _ in range(MICROBATCHES)]

    def eager():
        module = _CheckpointDependencyModule(device)
        outs = []
        for x, grad_output in batches:
            y = module.my_op(Output(x, Node("input"))).value
            grad_input, wgrads = module.backward(x, grad_output)
            accumulate_grad(module.projection.weight, wgrads[id(module.projection.weight)])
            for param in module.parameters():
                ddp_post_hook(param, capturing=False)
            outs += [y.clone(), grad_input.clone()] + [p.main_grad.clone() for p in module.parameters()]
        return outs

    def served():
        module = _CheckpointDependencyModule(device)
        runner = _CudaGraphRunner(module, device, variant)
        runner.create_fwd_graph(batches[0][0])          # create_cudagraphs(): forward, then backward
        runner.create_bwd_graph()
        outs = []
        for x, grad_output in batches:
            runner.static_x.copy_(x)
            y = replay(runner.fwd_graph, runner.fwd_output).clone()
            runner.static_grad_output.copy_(grad_output)
            grad_input = replay(runner.bwd_graph, runner.static_grad_input).clone()
            outs += [y, grad_input] + [p.main_grad.clone() for p in module.parameters()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
