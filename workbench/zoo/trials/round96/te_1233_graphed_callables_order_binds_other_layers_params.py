"""TE ``make_graphed_callables(..., _order=...)`` binds some per-microbatch graphs to another layer's parameters: their weight gradients are dropped.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/1233 ("Support CUDA Graph for MoE models",
NVIDIA/TransformerEngine, merged 2024-11-25 as commit ae393e81e). Read: the PR description (its change list names
"Fix wrong ``per_callable_module_params`` order bug in ``_make_graphed_callables`` when ``_order`` is given" and
"Fix warmup argument mismatch bug in ``_make_graphed_callables`` when ``_order`` is given"), the diff of
``transformer_engine/pytorch/graph.py`` and ``graph.py`` at its parent (argument checks, flattening, the
``per_callable_*`` lists, warmup, the ``_order`` capture loop, ``make_graphed_autograd_function`` /
``Graphed`` / ``functionalized`` and the assembly of the returned callables). The PR reports no user symptom;
the one below is reconstructed from the code.
Symptom: with ``_order`` (the pipeline-schedule capture used by Megatron-style per-layer graphs), more than one
layer per model chunk and more than one microbatch, the gradients of some layers' weights are silently missing
from the graphed training step: here layer 1 gets only the second microbatch's weight gradient and layer 0 only
the first's. The forward (and so a step's losses) stays right; the optimizer applies the wrong gradients. (With
the default ``allow_unused_input=False`` the same mismatch makes ``make_graphed_callables`` raise already in its
warmup: "The differentiated Tensor at index 1 appears to not have been used in the graph".)
Mechanism: the per-forward-pass lists of ``_make_graphed_callables`` are indexed (chunk, microbatch, layer), as
``sample_args`` and the capture loop are, but the old code built ``per_callable_module_params`` layer-major
(``for c in callables: for i in range(num_microbatches)``), i.e. ``[L0, L0, L1, L1]`` instead of
``[L0, L1, L0, L1]``. Each graph's static input surface (user args + module params) is what its backward graph
differentiates (``torch.autograd.grad(..., inputs=static_input_surface)``) and what ``functionalized`` hands to
``Graphed.apply`` as the parameters. So the graph of (microbatch 0, layer 1) was captured computing gradients
with respect to layer 0's weights, which its output does not use (``allow_unused_input=True``: None), and every
replay connects it to layer 0's parameters in autograd: layer 1's weight gradient of that microbatch is never
produced. The forward replays are unaffected (each captured ``func`` is the right layer).
Doctor: warmup-divergence, at _make_graphed_callables. Capture fixed a tensor reference (which parameters a
graph differentiates and is wired to) that every replay reuses, while the eager step differentiates the layer's
own parameters.
Fix (upstream): build ``per_callable_module_params`` in (chunk, microbatch, layer) order
(``callables[m_chunk * num_layers + l_no]``), and warm up every forward pass of ``_order`` with its own
callable and sample args (``warmup_func_idx`` / ``warmup_func``) instead of ``enumerate(callables)``.
Modelled: ``_make_graphed_callables`` (the ``_order`` branch: size checks, ``per_callable_module_params`` and
static input surfaces in both versions, both warmup loops, the forward/backward capture loop into one mempool,
``static_grad_inputs`` padding, ``make_graphed_autograd_function`` with ``Graphed.forward``/``backward`` and
``functionalized``); FP8, kwargs, RNG-state registration, the MoE module filtering and the ``fp8_group`` argument
of the PR are left out. ``Linear`` stands in for ``te.Linear`` (``x @ W^T + b``, float64). The caller is a
Megatron-like ``forward_backward_no_pipelining`` loop (``_order = [1, -1, 1, -1]``) with
``allow_unused_input=True`` as Megatron passes it, gradient buffers created before graphing and zeroed in place
(so ``AccumulateGrad`` adds into them), and an SGD step.
Workload: one model chunk of 2 layers, 2 microbatches of 4 tokens, hidden 3, 2 SGD steps (lr 0.01). The bug's
first-step losses equal eager, but its accumulated gradients do not (layer 0 lacks microbatch 1's weight/bias
gradient, layer 1 microbatch 0's: max error 40.2), and the second step's losses and the final weights drift from
there; the fix equals eager on every loss, gradient and weight (max error 0).
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/1233"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_make_graphed_callables"
SYMPTOM = ("with _order and several layers per chunk, graphs of mismatched index are captured and wired against "
           "another layer's parameters, so those microbatches' weight gradients are silently dropped")

TOKENS, HIDDEN, NUM_LAYERS, NUM_MICROBATCHES, STEPS, LR = 4, 3, 2, 2, 2, 0.01
NUM_WARMUP_ITERS = 2
# forward_backward_no_pipelining (PP=1): forward and backward of each microbatch in turn
ORDER = [1, -1] * NUM_MICROBATCHES
OWNER = "te.make_graphed_callables"

_variant = "bug"


class Linear(torch.nn.Module):
    """``te.Linear`` (bf16/fp8 off): ``x @ weight^T + bias``."""

    def __init__(self, seed, device):
        super().__init__()
        gen = generator(seed)
        self.weight = torch.nn.Parameter(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6).double())
        self.bias = torch.nn.Parameter(randn(HIDDEN, gen=gen, device=device, scale=0.3).double())

    def forward(self, inp):
        return inp @ self.weight.t() + self.bias


def _make_graphed_callables(callables, sample_args, num_warmup_iters=3, allow_unused_input=False,
                            _order=None, pool=None, device="cpu"):
    """``transformer_engine.pytorch.graph._make_graphed_callables``, the ``_order`` branch."""
    # Custom logic for interleaved pipeline parallelism: one entry of sample_args per forward pass,
    # in (model chunk, microbatch, layer) order.
    num_model_chunks = max(_order)
    num_microbatches = len(_order) // num_model_chunks // 2
    assert num_model_chunks * num_microbatches * 2 == len(_order)
    num_layers = len(sample_args) // num_model_chunks // num_microbatches
    assert len(callables) == num_model_chunks * num_layers
    assert len(sample_args) == num_model_chunks * num_microbatches * num_layers

    flatten_sample_args = [tuple(args) for args in sample_args]
    per_callable_len_user_args = [len(args) for args in flatten_sample_args]
    # Note: These per_callable_* variables are not actually per-callable, but per-forward-pass.
    per_callable_module_params = []
    if _variant == "bug":
        for c in callables:
            for i in range(num_microbatches):
                per_callable_module_params.append(
                    tuple(c.parameters()) if isinstance(c, torch.nn.Module) else ()
                )
    else:
        for m_chunk in range(num_model_chunks):
            for _ in range(num_microbatches):
                for l_no in range(num_layers):
                    per_callable_module_params.append(
                        tuple(callables[m_chunk * num_layers + l_no].parameters())
                        if isinstance(callables[m_chunk * num_layers + l_no], torch.nn.Module)
                        else ()
                    )
    assert len(per_callable_module_params) == len(flatten_sample_args)
    per_callable_static_input_surfaces = [
        flatten_sample_args[i] + per_callable_module_params[i] for i in range(len(flatten_sample_args))
    ]
    events.static_buffers(OWNER, {f"sample_args {i}": a[0] for i, a in enumerate(flatten_sample_args)})

    n = len(flatten_sample_args)
    fwd_graphs, bwd_graphs = [None] * n, [None] * n
    graph_callables = [None] * n
    mempool = graph_pool_handle(device) if pool is None else pool

    # Warmup
    if _variant == "bug":
        warmup = list(enumerate(callables))
    else:
        warmup_func_idx, warmup_func = [], []
        fwd_idx = [0] * num_model_chunks
        for c_id in _order:
            if c_id > 0:
                m_chunk = c_id - 1
                for l_no in range(num_layers):
                    func = callables[m_chunk * num_layers + l_no]
                    func_idx = (m_chunk * num_microbatches * num_layers) + (fwd_idx[m_chunk] * num_layers + l_no)
                    warmup_func_idx.append(func_idx)
                    warmup_func.append(func)
                fwd_idx[m_chunk] += 1
        assert len(warmup_func) == len(sample_args)
        warmup = list(zip(warmup_func_idx, warmup_func))
    for func_idx, func in warmup:
        args = sample_args[func_idx]
        static_input_surface = per_callable_static_input_surfaces[func_idx]
        for _ in range(num_warmup_iters):
            with events.warmup():
                outputs = (func(*args),)
                grad_inputs = torch.autograd.grad(
                    outputs=tuple(o for o in outputs if o.requires_grad),
                    inputs=tuple(i for i in static_input_surface if i.requires_grad),
                    grad_outputs=tuple(torch.empty_like(o) for o in outputs if o.requires_grad),
                    only_inputs=True,
                    allow_unused=allow_unused_input,
                )
                del outputs, grad_inputs

    # All captures share a mempool: capture the passes in the order they will run (_order).
    per_callable_static_outputs = [None] * n
    per_callable_static_grad_outputs = [None] * n
    per_callable_static_grad_inputs = [None] * n
    fwd_idx = [0] * num_model_chunks
    bwd_idx = [0] * num_model_chunks
    for c_id in _order:
        if c_id > 0:
            m_chunk = c_id - 1
            for l_no in range(num_layers):
                func = callables[m_chunk * num_layers + l_no]
                per_callable_fwd_idx = (m_chunk * num_microbatches * num_layers) + (fwd_idx[m_chunk] * num_layers + l_no)
                args = sample_args[per_callable_fwd_idx]
                fwd_graphs[per_callable_fwd_idx], outputs = capture(
                    lambda func=func, args=args: func(*args), device=device, pool=mempool, warmups=0,
                    name=f"fwd {per_callable_fwd_idx}", owner=OWNER)
                per_callable_static_outputs[per_callable_fwd_idx] = (outputs,)
                graph_callables[per_callable_fwd_idx] = func
            fwd_idx[m_chunk] += 1
        else:
            m_chunk = -c_id - 1
            for l_no in list(reversed(range(num_layers))):
                per_callable_bwd_idx = (m_chunk * num_microbatches * num_layers) + (bwd_idx[m_chunk] * num_layers + l_no)
                static_input_surface = per_callable_static_input_surfaces[per_callable_bwd_idx]
                static_outputs = per_callable_static_outputs[per_callable_bwd_idx]
                static_grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in static_outputs)
                events.static_buffers(OWNER, {f"static_grad_outputs {per_callable_bwd_idx}": static_grad_outputs[0]})
                bwd_graphs[per_callable_bwd_idx] = new_graph(device)
                with graph(bwd_graphs[per_callable_bwd_idx], pool=mempool, name=f"bwd {per_callable_bwd_idx}"):
                    grad_inputs = torch.autograd.grad(
                        outputs=tuple(o for o in static_outputs if o.requires_grad),
                        inputs=tuple(i for i in static_input_surface if i.requires_grad),
                        grad_outputs=tuple(o for o in static_grad_outputs if o is not None),
                        only_inputs=True,
                        allow_unused=allow_unused_input,
                    )
                # Pads out the actually-needed grads with Nones in gradient slots for inputs
                # that don't require grad.
                static_grad_inputs = []
                grad_idx = 0
                for arg in static_input_surface:
                    if arg.requires_grad:
                        static_grad_inputs.append(grad_inputs[grad_idx])
                        grad_idx += 1
                    else:
                        static_grad_inputs.append(None)
                per_callable_static_grad_outputs[per_callable_bwd_idx] = static_grad_outputs
                per_callable_static_grad_inputs[per_callable_bwd_idx] = tuple(static_grad_inputs)
            bwd_idx[m_chunk] += 1

    def make_graphed_autograd_function(fwd_graph, bwd_graph, module_params, len_user_args, static_input_surface,
                                       static_outputs, static_grad_outputs, static_grad_inputs):
        class Graphed(torch.autograd.Function):
            """Autograd function for graph replay."""

            @staticmethod
            def forward(ctx, *inputs):
                # Copy values from new tensors into static tensors
                for i in range(len_user_args):
                    if static_input_surface[i].data_ptr() != inputs[i].data_ptr():
                        static_input_surface[i].copy_(inputs[i])
                # Replay forward graph
                outs = replay(fwd_graph, static_outputs)
                return tuple(o.detach() for o in outs)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                for g, grad in zip(static_grad_outputs, grads):
                    if g is not None and g.data_ptr() != grad.data_ptr():
                        g.copy_(grad)
                present = tuple(b for b in static_grad_inputs if b is not None)
                got = iter(replay(bwd_graph, present))
                # Input args that didn't require grad (or were unused) expect a None gradient.
                return tuple(next(got).detach() if b is not None else None for b in static_grad_inputs)

        def functionalized(*user_args):
            # Runs the autograd function with inputs == all inputs to the graph that might require grad
            # (explicit user args + module parameters). Assumes module params didn't change since capture.
            func_args = tuple(user_args) + module_params
            return Graphed.apply(*func_args)[0]

        return functionalized

    # Put together the final graphed callables
    ret = []
    for i in range(n):
        ret.append(make_graphed_autograd_function(
            fwd_graphs[i], bwd_graphs[i], per_callable_module_params[i], per_callable_len_user_args[i],
            per_callable_static_input_surfaces[i], per_callable_static_outputs[i],
            per_callable_static_grad_outputs[i], per_callable_static_grad_inputs[i]))
    return ret


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(1233)
    data = [[(randn(TOKENS, HIDDEN, gen=gen, device=device).double(),
              randn(TOKENS, HIDDEN, gen=gen, device=device, scale=0.5).double())
             for _ in range(NUM_MICROBATCHES)] for _ in range(STEPS)]

    def train(graphed: bool):
        layers = [Linear(20 + l, device) for l in range(NUM_LAYERS)]
        params = [p for layer in layers for p in layer.parameters()]
        for p in params:                      # gradient buffers exist before graphing
            p.grad = torch.zeros_like(p)
        if graphed:
            sample_args = [(torch.zeros(TOKENS, HIDDEN, dtype=torch.float64, device=device, requires_grad=True),)
                           for _ in range(NUM_MICROBATCHES * NUM_LAYERS)]
            graphed_callables = _make_graphed_callables(
                tuple(layers), sample_args, num_warmup_iters=NUM_WARMUP_ITERS, allow_unused_input=True,
                _order=ORDER, device=device)
        outs = []
        for step in data:
            for p in params:                  # optimizer.zero_grad(set_to_none=False)
                p.grad.zero_()
            for mb, (x, target) in enumerate(step):      # forward_backward_no_pipelining
                hidden = x.clone().requires_grad_()
                for l_no in range(NUM_LAYERS):
                    fn = graphed_callables[mb * NUM_LAYERS + l_no] if graphed else layers[l_no]
                    hidden = fn(hidden)
                loss = 0.5 * ((hidden - target) ** 2).sum()
                outs.append(loss.detach().clone())
                loss.backward()
            outs.extend(p.grad.clone() for p in params)
            with torch.no_grad():             # optimizer.step() (SGD)
                for p in params:
                    p.sub_(LR * p.grad)
        outs.extend(p.detach().clone() for p in params)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
