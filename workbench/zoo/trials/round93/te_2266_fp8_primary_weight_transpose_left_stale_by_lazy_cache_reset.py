"""FP8 primary weights under a CUDA-graphed forward/backward: the optimizer's cast only invalidates the weight's transpose cache, whose refresh is a host-side check inside the captured forward, so replays keep the capture-time transpose and dgrad runs on stale weights.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/2266 ("Add post-processing API for FP8 primary weights to
support CUDA Graph", NVIDIA/TransformerEngine, merged 2025-10-22 as commit 2712bb95c). Read: the commit message and its
full diff of ``transformer_engine/pytorch/tensor/utils.py``: ``_cast_master_weights_to_fp8_delayed_scaling`` and
``_cast_master_weights_to_fp8_current_scaling`` stop calling ``model_weight._reset_caches()`` (whose comment says
the transpose cannot be created there because Megatron may overlap the all-gather with the forward), the blockwise
path stops dropping the column-wise data, and a new ``post_all_gather_processing(model_weights)`` creates the FP8
transpose (``Float8Tensor._create_transpose``) or the column-wise data after the all-gather; the test's ``MiniZero_1`` /
``MiniFSDP`` call it after gathering. Also read, pre-fix: ``Float8TensorStorage.update_usage`` (``has_data_transpose =
self._transpose is not None and not self._transpose_invalid``; if column-wise use is needed and the transpose is not
valid it calls ``_create_transpose``, which writes ``out=self._transpose`` in place), ``Float8Tensor._reset_caches``
(only sets ``_transpose_invalid = True``) and ``_Linear.forward`` (FP8 primary weight: ``get_weight_workspace`` returns
the weight, and when ``inp.requires_grad`` it calls ``weightmat.update_usage(columnwise_usage=True)`` for the dgrad
GEMM). And the consumer, NVIDIA/Megatron-LM PR #2088 ("fp8 param cuda graph support main", merged 2025-12-04): DDP's
``start_param_sync`` / ``finish_param_sync`` call ``post_all_gather_processing`` on the FP8 params, with the comments
"we keep the columnwise data and manually call post_all_gather_processing after all-gather, this makes fp8 params
compatible with CUDA graph" and, for older TE, "the transpose/columnwise data will be created in the next forward pass".
Neither PR describes a user-visible failure in numbers; the stale-transpose mechanism below is reconstructed from the
pre-fix code and those comments.
Symptom: training with FP8 primary weights (``--fp8-param-gather``, delayed or per-tensor current scaling, on GPUs where
TE needs an explicit FP8 transpose for the dgrad GEMM) and TE CUDA graphs: after the first optimizer step the backward
pass computes input gradients with the weights of the capture step, so gradients of earlier layers are wrong and the
loss curve departs from the eager run; without graphs the same code is right.
Mechanism: after the optimizer writes the new FP8 weight in place, the pre-fix cast only marks the transpose cache
invalid (a Python attribute). The transpose is rebuilt lazily by ``update_usage`` in the next forward, a host-side
check. Warmup builds the transpose, so at capture it is valid and the captured forward contains no transpose kernel;
replays never run the check again, and the dgrad GEMM keeps reading the transpose of the capture-time weights (with the
new ``scale_inv``). Eagerly, every forward after an update sees the flag and rebuilds it.
Doctor: warmup-divergence, at _cast_master_weights_to_fp8_current_scaling. Capture decided the branch "transpose cache
valid, do not rebuild" and replays reuse that decision, while an eager step after the cast's cache reset decides to
rebuild the transpose.
Fix (upstream): do not reset the cache in the cast; after the (all-)gather the caller runs
``post_all_gather_processing``, which rebuilds the transpose eagerly, in place, outside the graph.
Modelled: ``Float8Tensor`` (``_data``, ``_scale_inv``, ``_transpose``, ``_transpose_invalid``, ``_reset_caches``,
``_create_transpose``, ``update_usage``), ``Float8CurrentScalingQuantizer`` (``update_quantized``),
``cast_master_weights_to_fp8`` / ``_cast_master_weights_to_fp8_current_scaling``, ``post_all_gather_processing``, a
``Linear`` whose ``_Linear.forward`` / ``backward`` use the row-wise data for fprop and the transpose for dgrad and
accumulate wgrad into ``main_grad`` (``fuse_wgrad_accumulation``), a single-rank ``DistributedOptimizer`` stand-in
(SGD on fp64 master weights, then the cast) and ``DistributedDataParallel.start_param_sync`` (the all-gather is a
no-op on one rank). Stand-ins: FP8 e4m3 is a round-to-grid quantizer (64 levels per amax) in float64; the graphed
callable is one graph over forward + backward of a two-layer MLP (TE captures per-layer forward and backward graphs),
with two eager warmups before capture as ``make_graphed_callables`` does; the loss is MSE.
Workload: 6 SGD steps (lr 0.1) on fresh batches (batch 6, 8 -> 8 -> 4), graphs captured after two warmups on the
first batch. Step 0 matches eager; from step 1 on fc1's main_grad is computed through fc2's capture-time transpose
(off by 0.30 at step 1, up to 1.06 later), the losses drift from step 2 (by 0.07-0.13) and the final master weights
are off by 0.10 (fc1) and 0.027 (fc2). The fix equals eager. Per-step losses, fc1 main_grads and the final master
weights are compared.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/2266"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_cast_master_weights_to_fp8_current_scaling"
SYMPTOM = ("FP8 primary weights with CUDA graphs: the cast after each optimizer step only invalidates the weight's "
           "transpose cache; the lazy rebuild is a host-side check frozen at capture, so dgrad keeps using the "
           "capture-time transpose and earlier layers get wrong gradients")

IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 8, 4
BATCH = 6
NUM_STEPS = 6
LR = 0.1
FP8_LEVELS = 64.0            # stand-in for e4m3's range: values are cast to a grid of amax / 64

_variant = "bug"


# --- transformer_engine/pytorch/tensor ----------------------------------------------------------------------------

class Float8CurrentScalingQuantizer:
    def update_quantized(self, src, dst):
        """Cast ``src`` into ``dst`` in place, with a scale from ``src``'s amax (per-tensor current scaling)."""
        amax = src.abs().amax().clamp_min(1e-12)
        scale = FP8_LEVELS / amax
        dst._data.copy_(torch.round(src * scale))
        dst._scale_inv.copy_((1.0 / scale).reshape(1))
        return dst


class Float8Tensor:
    """FP8 primary weight: row-wise data, its scale inverse, and the transpose cache for column-wise GEMMs."""

    def __init__(self, data, scale_inv, quantizer):
        self._data = data
        self._scale_inv = scale_inv
        self._quantizer = quantizer
        self._transpose = torch.empty(data.shape[1], data.shape[0], dtype=data.dtype, device=data.device)
        self._transpose_invalid = True
        self.main_grad = torch.zeros(data.shape, dtype=torch.float64, device=data.device)

    def _get_quantizer(self):
        return self._quantizer

    def _reset_caches(self):
        """Set transpose cache as invalid. Should be called after any in-place operation."""
        self._transpose_invalid = True

    def _create_transpose(self):
        self._transpose.copy_(self._data.t())          # tex.fp8_transpose(data, out=self._transpose)
        self._transpose_invalid = False

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        has_data_transpose = self._transpose is not None and not self._transpose_invalid
        needs_data_transpose = has_data_transpose if columnwise_usage is None else columnwise_usage
        if needs_data_transpose and not has_data_transpose:
            self._create_transpose()

    def dequantize_rowwise(self):
        return self._data * self._scale_inv

    def dequantize_columnwise(self):
        return self._transpose * self._scale_inv


def _cast_master_weights_to_fp8_current_scaling(params, group):
    for model_weight, master_weight, start_offset in params:
        if _variant == "bug":
            # Reset transpose cache for all model weights; it is created again in the next forward.
            model_weight._reset_caches()
        if master_weight is None:
            continue
        model_weight._get_quantizer().update_quantized(master_weight.view(model_weight._data.shape), model_weight)


def cast_master_weights_to_fp8(model_weights, master_weights, start_offsets, group):
    params = list(zip(model_weights, master_weights, start_offsets))
    _cast_master_weights_to_fp8_current_scaling(params, group)


def post_all_gather_processing(model_weights):
    """Post-processing after all-gather for weights in distributed optimizer: create the FP8 transpose."""
    for model_weight in model_weights:
        model_weight._create_transpose()


# --- transformer_engine/pytorch/module/linear.py (FP8 primary weight, fuse_wgrad_accumulation) -------------------

class Linear:
    def __init__(self, in_features, out_features, gen, device):
        master = randn(out_features, in_features, gen=gen, device=device, scale=0.6).double()
        quantizer = Float8CurrentScalingQuantizer()
        self.weight = Float8Tensor(torch.empty_like(master), torch.ones(1, dtype=torch.float64, device=device),
                                   quantizer)
        quantizer.update_quantized(master, self.weight)
        self.master_weight = master                      # the optimizer's fp32 (here fp64) copy

    def forward(self, inp, inp_requires_grad):
        """_Linear.forward: fprop with the row-wise data; make the transpose available for dgrad."""
        weightmat = self.weight
        weightmat.update_usage(rowwise_usage=True)
        if inp_requires_grad:
            weightmat.update_usage(columnwise_usage=True)      # weight with column-wise usage for dgrad
        return inp @ weightmat.dequantize_rowwise().t()

    def backward(self, inp, grad_output, requires_dgrad):
        """_Linear.backward: dgrad from the transpose, wgrad accumulated into main_grad."""
        self.weight.main_grad.add_(grad_output.t() @ inp)
        if requires_dgrad:
            return grad_output @ self.weight.dequantize_columnwise().t()
        return None


class MLP:
    def __init__(self, device):
        gen = generator(2266)
        self.fc1 = Linear(IN_FEATURES, HIDDEN, gen, device)
        self.fc2 = Linear(HIDDEN, OUT_FEATURES, gen, device)

    def fp8_params(self):
        return [self.fc1.weight, self.fc2.weight]

    def forward_backward(self, x, target):
        h = self.fc1.forward(x, inp_requires_grad=False)
        a = torch.tanh(h)
        y = self.fc2.forward(a, inp_requires_grad=True)
        diff = y - target
        loss = (diff * diff).sum(dim=1).mean().reshape(1)
        dy = diff * (2.0 / x.shape[0])
        da = self.fc2.backward(a, dy, requires_dgrad=True)
        dh = da * (1.0 - a * a)
        self.fc1.backward(x, dh, requires_dgrad=False)
        return loss


# --- megatron/core: DDP param sync and the distributed optimizer (one rank) -----------------------------------------

class DistributedDataParallel:
    def __init__(self, module):
        self.module = module

    def zero_grad_buffer(self):
        for p in self.module.fp8_params():
            p.main_grad.zero_()

    def start_param_sync(self):
        # The param all-gather is a no-op on one rank; after it the FP8 params get their post-processing.
        if _variant == "fix":
            post_all_gather_processing(self.module.fp8_params())


class DistributedOptimizer:
    def __init__(self, module):
        self.layers = [module.fc1, module.fc2]

    def step(self):
        for layer in self.layers:
            layer.master_weight.sub_(LR * layer.weight.main_grad)
        cast_master_weights_to_fp8([layer.weight for layer in self.layers],
                                   [layer.master_weight for layer in self.layers],
                                   [0 for _ in self.layers], group=None)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graph):
        model = MLP(device)
        ddp = DistributedDataParallel(model)
        optimizer = DistributedOptimizer(model)
        gen = generator(22660)
        batches = [(randn(BATCH, IN_FEATURES, gen=gen, device=device).double(),
                    randn(BATCH, OUT_FEATURES, gen=gen, device=device).double()) for _ in range(NUM_STEPS)]
        static_x = torch.zeros(BATCH, IN_FEATURES, dtype=torch.float64, device=device)
        static_target = torch.zeros(BATCH, OUT_FEATURES, dtype=torch.float64, device=device)

        def step_fn():
            return model.forward_backward(static_x, static_target)

        graph = None
        if use_cuda_graph:                                 # make_graphed_callables: warmup, then capture
            static_x.copy_(batches[0][0])
            static_target.copy_(batches[0][1])
            graph = capture(step_fn, device=device, warmups=2, name="fwd+bwd", owner="make_graphed_callables",
                            static={"input": static_x, "target": static_target},
                            state={"fc1.main_grad": model.fc1.weight.main_grad,
                                   "fc2.main_grad": model.fc2.weight.main_grad})
        outs = []
        for x, target in batches:
            static_x.copy_(x)
            static_target.copy_(target)
            ddp.zero_grad_buffer()
            if graph is not None:
                loss = replay(*graph)
            else:
                loss = step_fn()
            outs += [loss.clone(), model.fc1.weight.main_grad.clone()]
            optimizer.step()
            ddp.start_param_sync()
        return outs + [model.fc1.master_weight.clone(), model.fc2.master_weight.clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
