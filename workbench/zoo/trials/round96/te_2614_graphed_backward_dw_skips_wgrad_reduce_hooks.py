"""TE's graphed ``backward_dw()`` replays only the wgrad graph: the delayed-wgrad params' DDP grad-ready hooks never run.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/2614 ("[Pytorch] Add get_backward_dw_params api for TE
module", NVIDIA/TransformerEngine, merged 2026-02-10 as 2894e4931), with its Megatron-LM companions
https://github.com/NVIDIA/Megatron-LM/pull/3074 and #2999 ("fix cg missing wgrad hook": "this bug happens when
`delay_wgrad_compute` and `cuda_graph` are both enabled, the parameters within delayed wgrad computation scope will
skip the backward post hook. The fix is in TE"). Read: the TE commit's diff (``graph.py``
``make_graphed_attribute_functions``, ``module/base.py`` ``backward_dw``), ``graph.py`` at its parent (warm-up runs
``module.backward_dw()``, the non-``_order`` capture of ``bwd_dw_graph`` calls it inside the capture), ``linear.py``
at the parent (``wgrad_store.put`` / the fused-accumulation dummy wgrad, ``skip_backward_post_hook``); Megatron at
1934391a95 (the #3074 merge): ``DistributedDataParallel.__init__`` (skip_backward_post_hook params get their hook
through ``register_wgrad_accumulation_and_reduce_hooks`` instead of a grad-accumulator hook),
``_make_backward_post_hook`` (returns at once while ``is_graph_capturing()``), ``zero_grad_buffer``,
``_ParamAndGradBucketGroup.register_grad_ready`` / ``start_grad_sync`` / ``finish_grad_sync`` / ``reset``, and
``TECudaGraphHelper._start_capturing`` / ``_finish_capturing``. The user-visible error is reconstructed from that
code, not quoted from a report.
Symptom: Megatron training with ``delay_wgrad_compute``, ``overlap_grad_reduce`` and TE per-layer CUDA graphs
(``cuda_graph_impl="transformer_engine"``) whose scope holds delayed-wgrad linears: the first eager iteration
records every param as grad-ready, but after capture the delayed-wgrad weights never report ready again, so the
bucket's reduce-scatter is never issued and ``finish_grad_sync`` stops the run with "Communication call has not
been issued for this bucket (1/2 params have grad available)".
Mechanism: eager ``Linear.backward_dw()`` pops the stashed wgrad GEMM (which accumulates into ``main_grad``) and then
calls every ``wgrad_accumulation_and_reduce_hook``; for a delayed-wgrad param that hook is the DDP backward post
hook (Megatron registers it on the module, not on the grad accumulator), i.e. ``register_grad_ready``. TE captures
``bwd_dw_graph`` by calling ``module.backward_dw()`` inside the capture, while Megatron's capture flag makes the hook
return at once. Replays of the graphed callable's ``backward_dw`` attribute repeat the wgrad kernels only: the hook
call is host work that ran (as a no-op) at capture and is never run again. The bucket group's per-param ready counts
then never match the golden counts of the first batch, so ``start_grad_sync`` is never launched.
Doctor: host-work-frozen, at make_graphed_attribute_functions. The hook calls are host work inside the captured
``backward_dw`` region; the graph repeats only its kernels, so the per-step grad-ready bookkeeping done there in
eager never happens on replay.
Fix (upstream): ``make_graphed_attribute_functions`` looks up the graph's TE modules (``visited_te_modules``) and,
after ``bwd_dw_graphs[graph_idx].replay()``, calls ``module._trigger_wgrad_accumulation_and_reduce_hooks()`` for
each module with ``need_backward_dw()`` (``base.py`` factors the hook loop into that method). Megatron #3074 adds the
TE >= 2.12 / ``gradient_accumulation_fusion`` assertions.
Modelled: TE ``WeightGradStore``, ``Linear`` (``delay_wgrad_compute``, ``fuse_wgrad_accumulation``: the wgrad GEMM
accumulates into ``main_grad`` and autograd gets ``get_dummy_wgrad``), the non-``_order`` path of
``_make_graphed_callables`` (warm-up with ``backward_dw``, forward graph, backward graph, ``bwd_dw_graph``), the
``Graphed`` forward/backward and ``make_graphed_attribute_functions``; Megatron ``DistributedDataParallel`` (hook
registration, ``_make_backward_post_hook``, ``zero_grad_buffer``), ``_ParamAndGradBucketGroup`` (one bucket over a
flat ``grad_data``, data-parallel size 1: the collective is an identity and its handle a stand-in),
``TECudaGraphHelper.create_cudagraphs`` and the capture flag. Stand-ins: the transformer layer is a TE ``Linear``
plus tanh, the output layer an eager fused-accumulation linear (a normal param whose hook fires from autograd's
grad accumulator), autograd is written out (``_accumulate_grad`` fires grad-accumulator hooks), the loss is MSE and
the optimizer SGD on ``main_grad``. float64, batch 4, hidden 5, output 3.
Workload: four training iterations; ``cuda_graph_warmup_steps=1``, so iteration 0 runs eager (golden ready counts
for both weights), then the layer is captured and iterations 1-3 replay it. Returned: every iteration's loss and
output, and the final weights. Bug: iteration 1's ``finish_grad_sync`` raises the AssertionError above (only the
output layer's weight was registered). Fix equals eager.
"""
from __future__ import annotations

import queue

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/2614"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "make_graphed_attribute_functions"
SYMPTOM = ("with delay_wgrad_compute and TE CUDA graphs, replaying the graphed backward_dw never calls the delayed "
           "weights' DDP grad-ready hooks, so the overlapped grad reduce is never issued and finish_grad_sync "
           "asserts 'Communication call has not been issued for this bucket'")

BATCH, HIDDEN, OUT = 4, 5, 3
ITERATIONS, CUDA_GRAPH_WARMUP_STEPS, NUM_WARMUP_ITERS, LR = 4, 1, 2, 0.1


# --- megatron/core/transformer/cuda_graphs.py: the capture flag ----------------------------------------------------
_IS_GRAPH_CAPTURING = False


def _set_capture_start():
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = True


def _set_capture_end():
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = False


def is_graph_capturing():
    return _IS_GRAPH_CAPTURING


class Parameter:
    """An ``nn.Parameter`` with the attributes Megatron's DDP hangs on it."""

    def __init__(self, data):
        self.data = data
        self.grad = None
        self.main_grad = None
        self.grad_added_to_main_grad = False
        self.skip_backward_post_hook = False
        self.grad_acc_hooks = []                     # hooks on the param's AccumulateGrad node


def _accumulate_grad(param, grad):
    """Autograd's AccumulateGrad for a leaf, then the hooks on that node."""
    param.grad = grad if param.grad is None else param.grad + grad
    for hook in param.grad_acc_hooks:
        hook()


# --- transformer_engine/pytorch ---------------------------------------------------------------------------------------
_dummy_wgrads = {}


def get_dummy_wgrad(shape, dtype, device):
    """TE's cached dummy wgrad handed to autograd when the wgrad went straight into ``main_grad``."""
    key = (tuple(shape), dtype, str(device))
    if key not in _dummy_wgrads:
        _dummy_wgrads[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _dummy_wgrads[key]


class WeightGradStore:
    def __init__(self, delay_wgrad_compute):
        self._delay = delay_wgrad_compute
        self.context = queue.Queue()

    def delay_wgrad_compute(self):
        return self._delay

    def put(self, tensor_list, func):
        self.context.put([tensor_list, func])

    def pop(self):
        tensor_list, func = self.context.get()
        return func(*tensor_list), tensor_list


class Linear:
    """``te.Linear(..., delay_wgrad_compute=True, fuse_wgrad_accumulation=True)`` (no bias)."""

    def __init__(self, weight, delay_wgrad_compute=True):
        self.weight = weight
        self.fuse_wgrad_accumulation = True
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks = []
        if self.wgrad_store.delay_wgrad_compute():
            self.weight.skip_backward_post_hook = True

    def parameters(self):
        return [self.weight]

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self):
        return self.wgrad_store.delay_wgrad_compute()

    def forward(self, inp):
        self._inputmat = inp
        return inp @ self.weight.data.t()

    def backward(self, grad_output):
        """``_Linear.backward``: dgrad now, the wgrad GEMM stashed; returns (dgrad, wgrad for autograd)."""
        weight = self.weight

        def wgrad_gemm(x, dy):                       # general_gemm(accumulate=True, out=weight.main_grad)
            weight.main_grad.add_(dy.t() @ x)
            return None, None

        dgrad = grad_output @ weight.data
        if self.wgrad_store.delay_wgrad_compute():
            self.wgrad_store.put([self._inputmat, grad_output], wgrad_gemm)
        else:
            wgrad_gemm(self._inputmat, grad_output)
        weight.grad_added_to_main_grad = True       # "Handle custom DDP from mcore"
        return dgrad, get_dummy_wgrad(list(weight.main_grad.shape), weight.data.dtype, weight.data.device)

    def backward_dw(self):
        if not self.need_backward_dw():
            return
        (wgrad, bgrad), _ = self.wgrad_store.pop()
        del wgrad, bgrad
        self._trigger_wgrad_accumulation_and_reduce_hooks()

    def _trigger_wgrad_accumulation_and_reduce_hooks(self):
        for wgrad_accumulation_and_reduce_hook in self.wgrad_accumulation_and_reduce_hooks:
            wgrad_accumulation_and_reduce_hook()


class TransformerLayer:
    """The graphed callable: a TE Linear (delayed wgrad) and a tanh; backward written out."""

    def __init__(self, weight):
        self.linear_fc1 = Linear(weight, delay_wgrad_compute=True)

    def forward(self, x):
        self._y = torch.tanh(self.linear_fc1.forward(x))
        return self._y

    def backward(self, grad_y):
        return self.linear_fc1.backward(grad_y * (1.0 - self._y * self._y))


def _make_graphed_callables(layer, sample_x, device, variant):
    """TE ``_make_graphed_callables`` for one callable, no ``_order``: warm-up, forward graph, backward graph and
    (since a module needs it) the ``bwd_dw_graph``, all in one mempool."""
    mempool = graph_pool_handle(device)
    visited_te_modules = {0: {layer.linear_fc1}}
    need_bwd_dw_graph = {}
    for _ in range(NUM_WARMUP_ITERS):                # autograd.grad(only_inputs=True): nothing reaches .grad
        with events.warmup():
            out = layer.forward(sample_x)
            layer.backward(torch.zeros_like(out))
            need_backward_dw = False
            for module in visited_te_modules.get(0, set()):
                if module.need_backward_dw():
                    need_backward_dw = True
                    module.backward_dw()
            need_bwd_dw_graph[0] = need_backward_dw
    owner = "te.make_graphed_callables"
    fwd_graph, static_outputs = capture(lambda: layer.forward(sample_x), device=device, pool=mempool, warmups=0,
                                        name="fwd", owner=owner, static={"sample_args": sample_x})
    static_grad_output = torch.zeros_like(static_outputs)
    bwd_graph, static_grad_inputs = capture(lambda: layer.backward(static_grad_output), device=device,
                                            pool=mempool, warmups=0, name="bwd", owner=owner,
                                            static={"static_grad_outputs": static_grad_output})
    bwd_dw_graphs = {}
    if need_bwd_dw_graph[0]:
        def run_backward_dw():
            for module in visited_te_modules[0]:
                if module.need_backward_dw():
                    module.backward_dw()      # its hooks run here once; Megatron's capture flag makes them no-ops
        bwd_dw_graphs[0], _ = capture(run_backward_dw, device=device, pool=mempool, warmups=0, name="bwd_dw",
                                      owner=owner, state={"main_grad": layer.linear_fc1.weight.main_grad})

    def make_graphed_attribute_functions(graph_idx):
        te_modules = visited_te_modules.get(graph_idx, set())

        def backward_dw():
            if need_bwd_dw_graph.get(graph_idx, False):
                replay(bwd_dw_graphs[graph_idx], (), size=BATCH)
                if variant == "fix":
                    # the fix: trigger the grad accumulation (and reduce) hooks the wgrad graph cannot replay
                    for module in te_modules:
                        if module.need_backward_dw():
                            module._trigger_wgrad_accumulation_and_reduce_hooks()
        return backward_dw

    class Graphed:                                  # the autograd.Function of the graphed callable
        @staticmethod
        def forward(x):
            sample_x.copy_(x)
            return replay(fwd_graph, static_outputs)

        @staticmethod
        def backward(grad):
            static_grad_output.copy_(grad)
            return replay(bwd_graph, static_grad_inputs)

    Graphed.backward_dw = staticmethod(make_graphed_attribute_functions(0))
    return Graphed


# --- megatron/core/distributed -----------------------------------------------------------------------------------
class _Work:                                        # the async collective's handle (data-parallel size 1)
    def wait(self):
        pass


class _ParamAndGradBucketGroup:
    def __init__(self, params, grad_data, overlap_grad_reduce):
        self.params = set(params)
        self.grad_data = grad_data
        self.gradient_scaling_factor = 1.0          # 1 / data-parallel size
        self.overlap_grad_reduce = overlap_grad_reduce
        self.golden_per_param_grad_ready_counts = {}
        self.per_param_grad_ready_counts = {}
        self.is_last_microbatch = True
        self.is_first_batch = True
        self.grad_reduce_handle = None

    def reset(self):
        if self.is_first_batch and len(self.per_param_grad_ready_counts) > 0:
            assert len(self.per_param_grad_ready_counts) == len(self.params)
            self.golden_per_param_grad_ready_counts = self.per_param_grad_ready_counts
            self.is_first_batch = False
        self.per_param_grad_ready_counts = {}
        self.is_last_microbatch = True

    def start_grad_sync(self):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        if self.gradient_scaling_factor != 1.0:
            self.grad_data *= self.gradient_scaling_factor
        # all_reduce(grad_data, group=dp_group, async_op=overlap_grad_reduce): data-parallel size 1
        self.grad_reduce_handle = _Work() if self.overlap_grad_reduce else None

    def finish_grad_sync(self):
        if not self.overlap_grad_reduce:
            self.start_grad_sync()
            return
        if self.is_first_batch:
            self.start_grad_sync()
        assert self.grad_reduce_handle is not None, (
            f"Communication call has not been issued for this bucket "
            f"({len(self.per_param_grad_ready_counts)}/{len(self.params)} params have grad available)")
        self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None

    def register_grad_ready(self, param):
        assert self.overlap_grad_reduce, "register_grad_ready() should only be called when overlap_grad_reduce is True"
        if self.is_last_microbatch:
            assert param in self.params, "Param is not in the bucket group"
            self.per_param_grad_ready_counts[param] = self.per_param_grad_ready_counts.get(param, 0) + 1
            if not self.is_first_batch:
                if self.per_param_grad_ready_counts == self.golden_per_param_grad_ready_counts:
                    assert len(self.per_param_grad_ready_counts) == len(self.params)
                    self.start_grad_sync()


class DistributedDataParallel:
    def __init__(self, modules, params, device, cuda_graph_impl, overlap_grad_reduce=True, delay_wgrad_compute=True):
        self.cuda_graph_impl = cuda_graph_impl
        self.params_with_grad = list(params)
        grad_data = torch.zeros(sum(p.data.numel() for p in params), dtype=torch.float64, device=device)
        offset = 0
        for p in params:                           # main_grad: a view into the bucket's contiguous grad_data
            p.main_grad = grad_data[offset:offset + p.data.numel()].view_as(p.data)
            offset += p.data.numel()
        self.bucket_group = _ParamAndGradBucketGroup(params, grad_data, overlap_grad_reduce)
        self.param_to_bucket_group = {p: self.bucket_group for p in params}
        self.overlap_grad_reduce = overlap_grad_reduce
        for param in params:
            if delay_wgrad_compute and param.skip_backward_post_hook:
                for module in modules:
                    if hasattr(module, "register_wgrad_accumulation_and_reduce_hooks"):
                        if any(param is p for p in module.parameters()):
                            module.register_wgrad_accumulation_and_reduce_hooks(
                                self._make_backward_post_hook(param))
            else:
                param.grad_acc_hooks.append(self._make_backward_post_hook(param))

    def _make_backward_post_hook(self, param):
        def hook(*unused):
            if is_graph_capturing():
                return
            if param in self.param_to_bucket_group:
                if self.overlap_grad_reduce:
                    assert param.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
                if param.grad is not None and not param.grad_added_to_main_grad:
                    param.main_grad.add_(param.grad)
                param.grad = None
                if self.overlap_grad_reduce:
                    self.param_to_bucket_group[param].register_grad_ready(param)
        return hook

    def zero_grad_buffer(self):
        if self.cuda_graph_impl != "transformer_engine":
            for param in self.params_with_grad:    # left alone under TE graphs: replays cannot set it back
                param.grad_added_to_main_grad = False
        self.bucket_group.grad_data.zero_()
        self.bucket_group.reset()

    def finish_grad_sync(self):
        self.bucket_group.finish_grad_sync()


class OutputLayer:
    """Megatron's output linear (eager, gradient_accumulation_fusion): a normal param, hooked on AccumulateGrad."""

    def __init__(self, weight):
        self.weight = weight

    def forward(self, y):
        self._y = y
        return y @ self.weight.data.t()

    def backward(self, go):
        self.weight.main_grad.add_(go.t() @ self._y)
        self.weight.grad_added_to_main_grad = True
        return go @ self.weight.data, get_dummy_wgrad(list(self.weight.data.shape), go.dtype, go.device)


def run(variant: str, device: str = "cpu"):
    gen = generator(2614)
    w1 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5).double()
    w2 = randn(OUT, HIDDEN, gen=gen, device=device, scale=0.5).double()
    batches = [(randn(BATCH, HIDDEN, gen=gen, device=device).double(),
                randn(BATCH, OUT, gen=gen, device=device).double()) for _ in range(ITERATIONS)]

    def train(cuda_graph_impl):
        _dummy_wgrads.clear()
        layer = TransformerLayer(Parameter(w1.clone()))
        output_layer = OutputLayer(Parameter(w2.clone()))
        params = [layer.linear_fc1.weight, output_layer.weight]
        ddp = DistributedDataParallel([layer.linear_fc1, output_layer], params, device, cuda_graph_impl)
        graphed = None
        outs = []
        for iteration, (x, target) in enumerate(batches):
            if cuda_graph_impl == "transformer_engine" and iteration == CUDA_GRAPH_WARMUP_STEPS:
                # TECudaGraphHelper.create_cudagraphs: _start_capturing ... _finish_capturing
                _set_capture_start()
                try:
                    graphed = _make_graphed_callables(layer, torch.zeros_like(x), device, variant)
                finally:
                    _set_capture_end()
                ddp.zero_grad_buffer()
            ddp.zero_grad_buffer()                  # train_step
            y = graphed.forward(x) if graphed is not None else layer.forward(x)
            o = output_layer.forward(y)
            loss = 0.5 * ((o - target) ** 2).sum() / BATCH
            grad_o = (o - target) / BATCH
            grad_y, w2_grad = output_layer.backward(grad_o)
            _accumulate_grad(output_layer.weight, w2_grad)
            _, w1_grad = graphed.backward(grad_y) if graphed is not None else layer.backward(grad_y)
            _accumulate_grad(layer.linear_fc1.weight, w1_grad)
            if graphed is not None:
                graphed.backward_dw()
            else:
                layer.linear_fc1.backward_dw()
            ddp.finish_grad_sync()                  # finalize_model_grads
            for p in params:                        # optimizer.step() on main_grad
                p.data.sub_(LR * p.main_grad)
            outs += [loss.reshape(1).clone(), o.clone()]
        return outs + [layer.linear_fc1.weight.data.clone(), output_layer.weight.data.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: train("transformer_engine"), lambda: train("none"))
