"""Megatron's reentrant activation checkpoint (``tensor_parallel.checkpoint``) runs inside CUDA-graph warmup/capture.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/3919 ("Fix recompute checkpointing + training CGs",
commit ada8dfe6f2). Related report (same error text): https://github.com/NVIDIA/Megatron-LM/issues/2758.
Symptom: training with activation recompute (``--recompute-granularity``, which wraps layer segments in
``tensor_parallel.checkpoint``) and training CUDA graphs fails while the graphs are being created:
``RuntimeError: Checkpointing is not compatible with .grad(), please use .backward() if possible``.
Mechanism: ``checkpoint()`` wraps ``CheckpointFunction.apply``. Its forward saves the RNG states on the host
(``_get_all_rng_states``) and runs the segment under ``no_grad``; its backward checks
``torch.autograd._is_checkpoint_valid()``, restores the RNG states, re-runs the segment under ``enable_grad``
and calls ``torch.autograd.backward`` on it: Python and autograd machinery meant to run again at every
backward. An eager training step uses ``loss.backward()``, so this works. ``create_cudagraphs`` (under
``_set_capture_start``) makes ``_CudaGraphRunner.create_fwd_graph`` warm the layer up (under
``_set_warmup_start``) with ``torch.autograd.grad(...)`` and capture it, and ``create_bwd_graph`` captures the
backward with ``torch.autograd.grad(...)`` too. Run there, the checkpoint's host-side recompute/RNG work would
run once at capture and never again at replay, and ``CheckpointFunction.backward`` refuses the ``.grad()`` call
outright, so graph creation dies at the first warmup backward. ``CheckpointWithoutOutput`` already skipped
itself while ``is_graph_warmup()``; plain ``checkpoint()`` did not.
Doctor: host-work-frozen, at ``checkpoint`` (it lets ``CheckpointFunction``'s host-side save/recompute
machinery run inside graph warmup/capture, where replays cannot repeat it and ``.grad()`` refuses it).
Fix (upstream): at the top of ``checkpoint()``: ``if is_graph_warmup() or is_graph_capturing(): return
function(*args)``: during warmup and capture the segment runs plainly, its activations are kept, and the
graphs record every op directly with no recompute.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/3919"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "checkpoint"
SYMPTOM = "graph creation fails: 'Checkpointing is not compatible with .grad()' from the recomputed layer"
TOKENS, HIDDEN, FFN, MICROBATCHES = 4, 4, 8, 4

# ---------------------------------------------------------------- megatron/core/transformer/cuda_graphs.py
_IS_GRAPH_CAPTURING = False
_IS_GRAPH_WARMUP = False
_CHECKPOINT_SKIPS_GRAPHS = False      # the fix's early return in checkpoint() (set by run)


def is_graph_capturing():
    return _IS_GRAPH_CAPTURING


def _set_capture(flag: bool):
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = flag


def is_graph_warmup():
    return _IS_GRAPH_WARMUP


def _set_warmup(flag: bool):
    global _IS_GRAPH_WARMUP
    _IS_GRAPH_WARMUP = flag


# ---------------------------------------------------------------- megatron/core/tensor_parallel/random.py
def _get_all_rng_states():
    """CPU, CUDA and tracker RNG states upstream; host work either way."""
    return torch.get_rng_state()


def _set_all_rng_states(cpu_rng_state):
    torch.set_rng_state(cpu_rng_state)


def detach_variable(inputs):
    return tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.rng_states = _get_all_rng_states()          # copy the rng states
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *args):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
        inputs = ctx.saved_tensors
        current = _get_all_rng_states()                 # _fork_rng
        _set_all_rng_states(ctx.rng_states)
        detached_inputs = detach_variable(inputs)
        with torch.enable_grad():
            outputs = ctx.run_function(*detached_inputs)
        _set_all_rng_states(current)
        torch.autograd.backward((outputs,), args)
        return (None, None) + tuple(inp.grad for inp in detached_inputs)


def checkpoint(function, distribute_saved_activations, *args):
    """Checkpoint a model or part of the model."""
    if _CHECKPOINT_SKIPS_GRAPHS and (is_graph_warmup() or is_graph_capturing()):
        return function(*args)                           # the fix: no recompute inside warmup/capture
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


# ---------------------------------------------------------------- a layer trained with full recompute
class TransformerLayer(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(3919)
        self.linear_fc1 = torch.nn.Parameter(randn(HIDDEN, FFN, gen=gen, device=device, scale=0.5))
        self.linear_fc2 = torch.nn.Parameter(randn(FFN, HIDDEN, gen=gen, device=device, scale=0.5))

    def _mlp(self, hidden_states):
        return torch.nn.functional.gelu(hidden_states @ self.linear_fc1) @ self.linear_fc2

    def forward(self, hidden_states):
        return hidden_states + checkpoint(self._mlp, False, hidden_states)


class _CudaGraphRunner:
    """Megatron's local training graphs for one layer: a fwd and a bwd graph in one pool."""

    def __init__(self, base_module, mempool, device, num_warmup_steps=1):
        self.base_module, self.mempool, self.device = base_module, mempool, device
        self.num_warmup_steps = num_warmup_steps

    def record_graph_capture(self, hidden_states):
        """The first microbatch runs eagerly (the training loop then calls ``loss.backward()``)."""
        self.sample = hidden_states.detach()
        return self.base_module(hidden_states)

    def create_fwd_graph(self):
        self.fwd_graph_input_surface = (torch.zeros_like(self.sample).requires_grad_(True),)
        events.static_buffers("Megatron _CudaGraphRunner (fwd)", {"hidden_states": self.fwd_graph_input_surface[0]})
        # warmup again as case graph capture mode may execute a different codepath
        _set_warmup(True)
        try:
            for _ in range(self.num_warmup_steps):
                with events.warmup():
                    warmup_args = tuple(t.clone().detach().requires_grad_(True) for t in self.fwd_graph_input_surface)
                    warmup_outputs = (self.base_module(*warmup_args),)
                    torch.autograd.grad(outputs=warmup_outputs, inputs=warmup_args,
                                        grad_outputs=tuple(torch.zeros_like(o) for o in warmup_outputs),
                                        only_inputs=True, allow_unused=True)
        finally:
            _set_warmup(False)
        self.fwd_graph = new_graph(self.device)
        with graph(self.fwd_graph, pool=self.mempool, name="fwd"):
            self.fwd_graph_outputs = self.base_module(*self.fwd_graph_input_surface)
        self.params_to_backprop = tuple(self.base_module.parameters())
        self.fwd_graph_input_surface = self.fwd_graph_input_surface + self.params_to_backprop

    def create_bwd_graph(self):
        self.static_grad_outputs = torch.zeros_like(self.fwd_graph_outputs)
        events.static_buffers("Megatron _CudaGraphRunner (bwd)", {"grad_output": self.static_grad_outputs})
        self.bwd_graph = new_graph(self.device)
        with graph(self.bwd_graph, pool=self.mempool, name="bwd"):
            self.static_grad_inputs = torch.autograd.grad(
                outputs=(self.fwd_graph_outputs,), inputs=self.fwd_graph_input_surface,
                grad_outputs=(self.static_grad_outputs,), only_inputs=True, allow_unused=True)

    def replay_fwd(self, hidden_states):
        with torch.no_grad():
            self.fwd_graph_input_surface[0].copy_(hidden_states)
            return replay(self.fwd_graph, self.fwd_graph_outputs).clone()

    def replay_bwd(self, grad_output):
        with torch.no_grad():
            self.static_grad_outputs.copy_(grad_output)
            return [g.clone() for g in replay(self.bwd_graph, self.static_grad_inputs)]


def create_cudagraphs(runners):
    """``_CudagraphGlobalRecord.create_cudagraphs``: the whole creation runs under ``_set_capture_start``."""
    _set_capture(True)
    try:
        for runner in runners:
            runner.create_fwd_graph()
        for runner in reversed(runners):
            runner.create_bwd_graph()
    finally:
        _set_capture(False)


def train_step_eager(layer, x, dy):
    """One eager microbatch: forward with recompute, ``.backward()``, per-microbatch grads."""
    for p in layer.parameters():
        p.grad = None
    h = x.clone().requires_grad_(True)
    y = layer(h)
    torch.autograd.backward(y, dy)
    return [y.detach().clone(), h.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


def run(variant: str, device: str = "cpu"):
    global _CHECKPOINT_SKIPS_GRAPHS
    _CHECKPOINT_SKIPS_GRAPHS = variant == "fix"
    gen = generator(39190)
    data = [(randn(TOKENS, HIDDEN, gen=gen, device=device), randn(TOKENS, HIDDEN, gen=gen, device=device))
            for _ in range(MICROBATCHES)]

    def eager():
        layer = TransformerLayer(device)
        return [t for x, dy in data for t in train_step_eager(layer, x, dy)]

    def served():
        layer = TransformerLayer(device)
        runner = _CudaGraphRunner(layer, graph_pool_handle(device), device)
        outs = []
        for i, (x, dy) in enumerate(data):
            if i == 0:                          # record pass (eager), then graphs are created
                for p in layer.parameters():
                    p.grad = None
                h = x.clone().requires_grad_(True)
                y = runner.record_graph_capture(h)
                torch.autograd.backward(y, dy)
                outs += [y.detach().clone(), h.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
                create_cudagraphs([runner])
                continue
            outs.append(runner.replay_fwd(x))
            outs += runner.replay_bwd(dy)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
