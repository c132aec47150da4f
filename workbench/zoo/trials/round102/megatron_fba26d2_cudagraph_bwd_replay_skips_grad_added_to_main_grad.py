"""Megatron-Core's per-layer CUDA graphs replay a TE layer's backward without its host-side ``weight.grad_added_to_main_grad = True``: DDP's grad hook then adds TE's dummy wgrad (uninitialised graph memory) to ``main_grad`` on top of the fused accumulation.

Upstream: https://github.com/NVIDIA/Megatron-LM/commit/fba26d2075f55deb3f09041fdfa548967f4f39c8 ("ADLR/megatron-lm!2340
- Cudagraph memory optimizations and mcore optimizer support", NVIDIA/Megatron-LM, merged 2024-12-17; the MR also
reworks graph memory; the modelled fix is its ``groundtruth_grad_added_to_main_grad`` emulation). Read: the commit's
diff of ``megatron/core/transformer/cuda_graphs.py`` (``_CudaGraphRunner.create_fwd_graph`` with its warmups and
``main_grad`` save/restore, ``create_bwd_graph`` recording ``groundtruth_grad_added_to_main_grad`` when
``fuse_wgrad_accumulation``, ``_CudagraphFunc.forward``/``backward`` with the comment "If using
gradient_accumulation_fusion, whenever `main_grad` is calculated the `grad_added_to_main_grad` attribute is expected
to set. However when using cudagraphs this doesn't occur so we emulate this behavior here.", ``_CudagraphGlobalRecord``
and ``create_cudagraphs``) and of ``distributed_data_parallel.py`` (hooks return while ``is_graph_capturing()``);
``distributed_data_parallel.py`` at the parent (``zero_grad_buffer`` resets ``grad_added_to_main_grad = False``;
``_make_backward_post_hook`` adds ``param.grad`` to ``main_grad`` unless it is set); TransformerEngine
``module/linear.py`` of that time ("Handle custom DDP from mcore": sets the flag and returns ``torch.empty`` as the
wgrad); and TE PR #1204 by the same author, closed unmerged ("With fuse_wgrad_accumulation we toggle weight.grad_added_to_main_grad =
True, which tells Mcore DDP to use main_grad and not grad. However with cudagraphs this does not occur").
Symptom: training with ``enable_cuda_graph`` (per-layer graphs), ``gradient_accumulation_fusion`` and Megatron DDP:
from the first replayed iteration the gradients hold garbage (whatever the graph pool's dummy-wgrad block holds),
so the loss curve departs from the eager one (or goes NaN); without graphs training is normal.
Mechanism: TE's ``_Linear.backward`` accumulates the wgrad GEMM straight into ``weight.main_grad`` and, in Python,
sets ``weight.grad_added_to_main_grad = True`` and returns an uninitialised ``torch.empty`` as the wgrad. The bwd graph
is captured by running that backward once: the GEMM becomes a kernel of the graph, the flag is set once, and the
dummy wgrad is a block of the graph's pool returned on every replay. Every iteration ``zero_grad_buffer`` resets the
flag; a replay sets nothing, so when autograd hands the dummy to the parameter, DDP's post hook sees the flag False
and adds it to ``main_grad``. An eager backward sets the flag each time and the hook skips the add.
Doctor: host-work-frozen, at backward: the flag assignment is host work inside the captured backward; replays run
only its kernels, and the fix restores that host work in ``_CudagraphFunc.backward`` after the replay.
Fix (upstream): ``create_bwd_graph`` records every parameter's ``grad_added_to_main_grad`` after the capture, and
``_CudagraphFunc.backward`` writes those values back after ``bwd_graph.replay()``.
Modelled: TE ``_Linear`` (fused wgrad accumulation, the mcore-DDP branch), a ``TransformerLayer`` (fc1, GELU, fc2,
residual) whose backward is written out; Megatron ``_CudaGraphRunner`` (``record_graph_capture``,
``create_fwd_graph`` with two warmups and the ``main_grad`` restore, ``create_bwd_graph``, ``replay_graph_capture``),
``_CudagraphFunc``, ``create_cudagraphs``, ``CudaGraphManager``, ``DistributedDataParallel`` (contiguous grad buffer,
``_make_backward_post_hook``, ``zero_grad_buffer``) and ``forward_backward_no_pipelining``. Stand-ins: autograd is
written out (``_accumulate_grad`` runs AccumulateGrad and its hooks); the loss is MSE outside the graph; the optimizer
is SGD on ``main_grad``; data-parallel size 1 (no collective). The fwd and bwd graphs share one mempool, as
upstream with VP=1, so the dummy wgrad's block holds what other graph work last left there.
Workload: 3 iterations of 2 microbatches (batch 4, hidden 5, ffn 8), float64, lr 0.1. Iteration 1 runs eagerly and
records; ``create_cudagraphs`` captures at its end; iterations 2-3 replay. Bug: iterations 2-3 add the dummy
blocks' contents to ``main_grad``; the 4 losses of iterations 1-2 match, iteration 3's are off by 0.156 and 0.022, the
final weights by 0.205 and 0.160 (max |graph - eager| = 0.205). Fix: all 6 losses and both weights equal eager (max
error 0).
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/commit/fba26d2075f55deb3f09041fdfa548967f4f39c8"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "backward"
SYMPTOM = ("per-layer CUDA graphs + gradient_accumulation_fusion + Megatron DDP: replayed backwards never set "
           "grad_added_to_main_grad, so DDP adds TE's uninitialised dummy wgrad to main_grad (garbage/NaN grads)")

BATCH, HIDDEN, FFN, MICROBATCHES, ITERATIONS, LR = 4, 5, 8, 2, 3, 0.1
DTYPE = torch.float64

_variant = "bug"
_IS_GRAPH_CAPTURING = False


def is_graph_capturing():
    return _IS_GRAPH_CAPTURING


def _set_capture(flag: bool):
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = flag


class Parameter:
    def __init__(self, data):
        self.data, self.grad, self.grad_accumulator_hooks = data, None, []


def _accumulate_grad(param: Parameter, grad) -> None:
    """Autograd's ``AccumulateGrad`` for a leaf, then its post hooks (Megatron registers DDP's there)."""
    param.grad = grad if param.grad is None else param.grad + grad
    for hook in param.grad_accumulator_hooks:
        hook()


# --- transformer_engine/pytorch/module/linear.py (reduced) --------------------------------------------------------

class _Linear:
    """``torch.autograd.Function``: forward saves the input, backward is TE's (fuse_wgrad_accumulation=True)."""

    @staticmethod
    def forward(ctx: dict, weight: Parameter, inp):
        ctx["weight"], ctx["inputmat"], ctx["fuse_wgrad_accumulation"] = weight, inp, True
        return inp @ weight.data.t()

    @staticmethod
    def backward(ctx: dict, grad_output):
        weight, inputmat = ctx["weight"], ctx["inputmat"]
        dgrad = grad_output @ weight.data
        if ctx["fuse_wgrad_accumulation"]:                      # tex.gemm(..., accumulate=True, out=weight.main_grad)
            weight.main_grad.add_(grad_output.t() @ inputmat)
        # Handle custom DDP from mcore.
        if ctx["fuse_wgrad_accumulation"] and hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            if getattr(weight, "zero_out_wgrad", False):
                wgrad = torch.zeros(weight.main_grad.shape, dtype=weight.data.dtype, device=weight.data.device)
            else:
                wgrad = torch.empty(weight.main_grad.shape, dtype=weight.data.dtype, device=weight.data.device)
        else:
            wgrad = None
        return dgrad, wgrad


class TransformerLayer:
    """fc1 -> GELU(tanh) -> fc2, plus the residual; backward written out (what autograd would run)."""

    def __init__(self, device):
        gen = generator(2340)
        self.fc1 = Parameter(randn(FFN, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE))
        self.fc2 = Parameter(randn(HIDDEN, FFN, gen=gen, device=device, scale=0.5).to(DTYPE))
        self.ctx1, self.ctx2 = {}, {}

    def parameters(self):
        return [self.fc1, self.fc2]

    def forward(self, hidden_states):
        self.h = _Linear.forward(self.ctx1, self.fc1, hidden_states)
        a = torch.nn.functional.gelu(self.h, approximate="tanh")
        return _Linear.forward(self.ctx2, self.fc2, a) + hidden_states

    def backward(self, grad_output):
        """Returns the input grad and {param: wgrad} as autograd would pass them on."""
        grad_a, wgrad2 = _Linear.backward(self.ctx2, grad_output)
        h = self.h.detach().requires_grad_(True)
        with torch.enable_grad():
            (grad_h,) = torch.autograd.grad(torch.nn.functional.gelu(h, approximate="tanh"), h, grad_a)
        grad_x, wgrad1 = _Linear.backward(self.ctx1, grad_h)
        return grad_x + grad_output, {self.fc1: wgrad1, self.fc2: wgrad2}


# --- megatron/core/distributed/distributed_data_parallel.py (reduced) ---------------------------------------------

class DistributedDataParallel:
    def __init__(self, module: TransformerLayer):
        self.params_with_grad = module.parameters()
        self.grad_data = torch.zeros(sum(p.data.numel() for p in self.params_with_grad), dtype=DTYPE,
                                     device=self.params_with_grad[0].data.device)
        offset = 0
        for param in self.params_with_grad:
            param.main_grad = self.grad_data[offset:offset + param.data.numel()].view_as(param.data)
            offset += param.data.numel()
            param.grad_added_to_main_grad = False
            param.grad_accumulator_hooks.append(self._make_backward_post_hook(param))

    def _make_backward_post_hook(self, param: Parameter):
        def hook(*unused):
            if is_graph_capturing():
                return
            if param.grad is not None and (
                not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)
            ):
                param.main_grad.add_(param.grad.data)
            param.grad = None
        return hook

    def zero_grad_buffer(self):
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        self.grad_data.zero_()


# --- megatron/core/transformer/cuda_graphs.py (reduced) -----------------------------------------------------------

_cudagraph_record: list = []


class _CudagraphFunc:
    """Replays the runner's cudagraphs (``torch.autograd.Function``)."""

    @staticmethod
    def forward(ctx: dict, runner: "_CudaGraphRunner", hidden_states):
        if hidden_states.data_ptr() != runner.fwd_graph_input.data_ptr():
            runner.fwd_graph_input.copy_(hidden_states)
        ctx["runner"] = runner
        return replay(runner.fwd_graph, runner.fwd_graph_output).clone()

    @staticmethod
    def backward(ctx: dict, grad_output):
        runner = ctx["runner"]
        if grad_output.data_ptr() != runner.static_grad_output.data_ptr():
            runner.static_grad_output.copy_(grad_output)
        replay(runner.bwd_graph, runner.static_grad_inputs)
        if _variant == "fix":
            # If using gradient_accumulation_fusion, whenever `main_grad` is calculated the
            # `grad_added_to_main_grad` attribute is expected to set. However when using cudagraphs this
            # doesn't occur so we emulate this behavior here.
            for param, grad_added in runner.groundtruth_grad_added_to_main_grad.items():
                param.grad_added_to_main_grad = grad_added
        grad_x, *wgrads = runner.static_grad_inputs
        return grad_x, dict(zip(runner.base_module.parameters(), wgrads))


class _CudaGraphRunner:
    def __init__(self, base_module: TransformerLayer, device: str):
        self.base_module, self.device = base_module, device
        self.fuse_wgrad_accumulation = True                    # config.gradient_accumulation_fusion
        self.cudagraph_created, self.fwd_graph_recorded = False, False
        self.mempool = graph_pool_handle(device)

    def record_graph_capture(self, hidden_states):
        if not self.fwd_graph_recorded:
            _cudagraph_record.append((self, hidden_states))
            self.fwd_graph_recorded = True
        return self.base_module.forward(hidden_states), self.base_module.backward

    def create_fwd_graph(self, hidden_states):
        save_main_grads = [p.main_grad.clone() for p in self.base_module.parameters()]
        self.fwd_graph_input = hidden_states.clone()           # replace_tensors(args, kwargs)
        for _ in range(2):                                     # warmup again: capture may take another codepath
            with events.warmup():
                out = self.base_module.forward(self.fwd_graph_input)
                self.base_module.backward(torch.zeros_like(out))   # torch.autograd.grad: no AccumulateGrad hooks
        self.fwd_graph, self.fwd_graph_output = capture(
            lambda: self.base_module.forward(self.fwd_graph_input), device=self.device, pool=self.mempool,
            warmups=0, name="fwd graph", owner="_CudaGraphRunner", static={"hidden_states": self.fwd_graph_input})
        for param, saved_grad in zip(self.base_module.parameters(), save_main_grads):
            param.main_grad.copy_(saved_grad)                  # restore cached grads

    def create_bwd_graph(self):
        self.static_grad_output = torch.zeros_like(self.fwd_graph_output)

        def backward():
            grad_x, wgrads = self.base_module.backward(self.static_grad_output)
            return (grad_x, *(wgrads[p] for p in self.base_module.parameters()))

        self.bwd_graph, self.static_grad_inputs = capture(
            backward, device=self.device, pool=self.mempool, warmups=0, name="bwd graph", owner="_CudaGraphRunner",
            static={"grad_output": self.static_grad_output},
            state={f"main_grad[{i}]": p.main_grad for i, p in enumerate(self.base_module.parameters())})
        self.groundtruth_grad_added_to_main_grad = {}
        if self.fuse_wgrad_accumulation:
            for param in self.base_module.parameters():
                if hasattr(param, "grad_added_to_main_grad"):
                    self.groundtruth_grad_added_to_main_grad[param] = param.grad_added_to_main_grad

    def replay_graph_capture(self, hidden_states):
        ctx: dict = {}
        out = _CudagraphFunc.forward(ctx, self, hidden_states)
        return out, lambda grad_output: _CudagraphFunc.backward(ctx, grad_output)

    def forward(self, hidden_states):
        if not self.cudagraph_created:
            return self.record_graph_capture(hidden_states)
        return self.replay_graph_capture(hidden_states)


def create_cudagraphs():
    """At the end of the first schedule: create the recorded graphs in execution order."""
    _set_capture(True)
    for runner, hidden_states in _cudagraph_record:
        runner.create_fwd_graph(hidden_states)
        runner.create_bwd_graph()
        runner.cudagraph_created = True
    _cudagraph_record.clear()
    _set_capture(False)


class CudaGraphManager:
    def __init__(self, module: TransformerLayer, device: str):
        self.runner = _CudaGraphRunner(module, device)         # no pipelining: fwd and bwd alternate

    def __call__(self, hidden_states):
        return self.runner.forward(hidden_states)


# --- megatron/core/pipeline_parallel/schedules.py + training loop ---------------------------------------------------

def forward_backward_no_pipelining(model, enable_cuda_graph: bool, microbatches) -> list:
    losses = []
    for x, target in microbatches:
        out, backward = model(x)
        losses.append(((out - target) ** 2).mean())
        grad_x, wgrads = backward(2.0 * (out - target) / out.numel())   # loss.backward()
        for param, wgrad in wgrads.items():
            if wgrad is not None:
                _accumulate_grad(param, wgrad)
    if enable_cuda_graph:
        create_cudagraphs()
    return losses


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(102)
    data = [[(randn(BATCH, HIDDEN, gen=gen, device=device).to(DTYPE), randn(BATCH, HIDDEN, gen=gen, device=device)
              .to(DTYPE)) for _ in range(MICROBATCHES)] for _ in range(ITERATIONS)]

    def train(enable_cuda_graph: bool):
        _cudagraph_record.clear()
        layer = TransformerLayer(device)
        ddp = DistributedDataParallel(layer)
        model = CudaGraphManager(layer, device) if enable_cuda_graph else (
            lambda x: (layer.forward(x), layer.backward))
        losses = []
        for microbatches in data:
            ddp.zero_grad_buffer()
            losses += forward_backward_no_pipelining(model, enable_cuda_graph, microbatches)
            for param in layer.parameters():                    # optimizer.step() on main_grad
                param.data.sub_(LR * param.main_grad)
        return [torch.stack(losses)] + [p.data.clone() for p in layer.parameters()]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
