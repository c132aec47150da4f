"""TorchInductor cudagraphified a QAT graph holding ``_fused_moving_avg_obs_fq_helper``, whose CUDA kernel reads ``fake_quant_on.item()`` on the host: the capture of the forward graph fails with "operation not permitted when stream is capturing".

Upstream: https://github.com/pytorch/torchdynamo/pull/1169 ("Disable cudagraph when _fused_moving_avg_obs_fq_helper
exists", pytorch/torchdynamo, merged 2022-09-08 as commit e21cff96), for issue
https://github.com/pytorch/torchdynamo/issues/1149 ("TorchBench training error: CUDA graph error", repro
``torchbench.py -d cuda --inductor --training --float32 -k mobilenet_v2_quantized_qat`` / ``resnet50_quantized_qat``).
Read: the issue description (repro and the traceback into the compiled QAT model), the full diff of e21cff96
(``torchinductor/utils.py`` ``has_incompatible_cudagraph_ops``: ``aten._fused_moving_avg_obs_fq_helper.default`` and
``aten._fused_moving_avg_obs_fq_helper_functional.default`` added to ``forbidden_list``; ``benchmarks/torchbench.py``
drops the two models from the not-yet-working list whose comment read "float16 issue or CUDA error: operation not
permitted when stream is capturing"), ``torchinductor/compile_fx.py`` at that commit (``compile_fx_inner`` cudagraphs
only when ``set(graph.device_types) == {"cuda"} and not graph.mutated_inputs and not
has_incompatible_cudagraph_ops(gm)``, else ``BoxedBool.disable``; ``cudagraphify``: aligned static inputs, one eager
warm-up on the example inputs, capture on the static inputs, ``run`` copies the non-fixed inputs and replays;
``compile_fx``'s ``fw_compiler`` with ``num_fixed``), the preceding commit fe3173f7 that introduced
``has_incompatible_cudagraph_ops``, and PyTorch's ``aten/src/ATen/native/quantized/cuda/fused_obs_fake_quant.cu``
(``_calculate_moving_average`` reads ``observer_on`` on the device; ``fused_moving_avg_obs_fake_quant_cuda`` then does
``auto fake_quant = fake_quant_on.item().toInt();`` before ``_calc_moving_avg_qparams_helper`` and
``fake_quantize_per_tensor_affine``). Reconstructed: the AOT/functionalized forward graph of a QAT block (a stand-in
``GraphModule`` of named aten nodes, interpreted by the "generated" ``call``), and the dynamo split of the model into
two frames.
Symptom: QAT vision models (mobilenet_v2 / resnet50 quantized QAT) compiled with TorchInductor and its CUDA graphs fail
on the first training iteration with "CUDA error: operation not permitted when stream is capturing"; with cudagraphs
off they run.
Mechanism: every ``FusedMovingAvgObsFakeQuantize`` lowers to a fallback call of ``_fused_moving_avg_obs_fq_helper``.
Its CUDA implementation decides on the host whether fake quantization is on, with ``fake_quant_on.item()``: a
device-to-host copy and stream synchronisation. Eagerly (and in cudagraphify's warm-up) that is legal; inside the
capture that ``cudagraphify`` opens around the compiled forward it is refused.
Doctor: sync-in-capture, at fused_moving_avg_obs_fake_quant_cuda. The ``.item()`` on ``fake_quant_on`` is a host
synchronisation attempted while the graph is being captured.
Fix (upstream): list both variants of the op in ``has_incompatible_cudagraph_ops`` so ``compile_fx_inner`` does not
cudagraphify a graph containing it (that graph runs as compiled kernels without a CUDA graph; graphs without it are
still captured).
Modelled: ``compile_fx``/``fw_compiler``/``compile_fx_inner``/``BoxedBool``/``cudagraphify``/
``has_incompatible_cudagraph_ops`` as upstream; ``FusedMovingAvgObsFakeQuantize`` (buffers ``observer_enabled``,
``fake_quant_enabled``, ``scale``, ``zero_point`` and the observer's ``min_val``/``max_val``); the CUDA op's host
function ``fused_moving_avg_obs_fake_quant_cuda`` with ``_calculate_moving_average``,
``_calc_moving_avg_qparams_helper`` (ChooseQuantizationParams, per tensor) and ``fake_quantize_per_tensor_affine``
written as torch ops; the functional variant returns the updated observer state, which the AOT runtime wrapper copies
back into the module buffers after the graph. Stand-ins: the model is one QAT linear block (weight fake-quant,
ReLU, activation fake-quant; "conv" as ``addmm``) followed, after a graph break, by a float classifier head; the
generated code is a Python interpreter over the graph's nodes; ``GraphLowering`` only reports device types and
mutated inputs; the warm-up runs on the current stream.
Workload: 4 forward iterations on batches of 4 x 8 (hidden 6, 3 classes), float32, observers and fake quant on;
compared: each iteration's logits and the final observer state. Bug: compiling the first frame raises while capturing
(CPU: the engine's CaptureError on ``Tensor.item()``; on an H200, torch 2.11: "operation not permitted when stream is
capturing" at the ``.item()``, surfacing as "operation failed due to a previous error during capture" when the capture
closes). Fix: the QAT frame runs uncaptured, the head frame is cudagraphified, and both equal eager (error 0, on the
CPU and on CUDA).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchdynamo/pull/1169"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "fused_moving_avg_obs_fake_quant_cuda"
SYMPTOM = ("QAT models compiled by TorchInductor with CUDA graphs fail in capture: _fused_moving_avg_obs_fq_helper's "
           "CUDA kernel reads fake_quant_on.item() on the host, which a capturing stream refuses")

IN, HIDDEN, CLASSES, BATCH = 8, 6, 3, 4
DT = torch.float32

_variant = "bug"


# --- aten/src/ATen/native/quantized/cuda/fused_obs_fake_quant.cu ------------------------------------------------------

def _calculate_moving_average(x, observer_on, averaging_const, running_min, running_max):
    """MovingAverageMinMax kernel: reads observer_on on the device."""
    x_min, x_max = torch.aminmax(x)
    on = observer_on[0] == 1
    new_min = torch.where(torch.isinf(running_min), x_min, running_min + averaging_const * (x_min - running_min))
    new_max = torch.where(torch.isinf(running_max), x_max, running_max + averaging_const * (x_max - running_max))
    running_min.copy_(torch.where(on, new_min, running_min))
    running_max.copy_(torch.where(on, new_max, running_max))


def _calc_moving_avg_qparams_helper(x, running_min, running_max, scale, zero_point, qmin, qmax, symmetric_quant):
    """ChooseQuantizationParamsKernelImpl, size 1 (per tensor)."""
    min_val, max_val = running_min.clone(), running_max.clone()
    straddles = (min_val < 0) & (max_val > 0)
    if symmetric_quant:                                         # preserve_sparsity
        sym_qmin, sym_qmax = -((qmax - qmin) // 2 + 1), (qmax - qmin) // 2
        max_scale = torch.maximum((min_val / sym_qmin).abs(), (max_val / sym_qmax).abs())
        min_val = torch.where(straddles, max_scale * sym_qmin, min_val)
        max_val = torch.where(straddles, max_scale * sym_qmax, max_val)
    min_val = torch.clamp(min_val, max=0.0)
    max_val = torch.clamp(max_val, min=0.0)
    s = (max_val - min_val) / (qmax - qmin)
    s = torch.where((s == 0) | torch.isinf(1.0 / s), torch.full_like(s, 0.1), s)
    zp_from_min, zp_from_max = qmin - min_val / s, qmax - max_val / s
    err_min, err_max = abs(qmin) + (min_val / s).abs(), abs(qmax) + (max_val / s).abs()
    initial = torch.where(err_min < err_max, zp_from_min, zp_from_max)
    if symmetric_quant:
        initial = torch.where(straddles, torch.full_like(initial, (qmin + qmax) / 2), initial)
    nudged = torch.round(torch.clamp(initial, qmin, qmax))
    scale.copy_(s.reshape(scale.shape))
    zero_point.copy_(nudged.reshape(zero_point.shape).to(zero_point.dtype))


def fake_quantize_per_tensor_affine(x, scale, zero_point, qmin, qmax):
    inv_scale = 1.0 / scale
    q = torch.clamp(torch.round(x * inv_scale + zero_point), qmin, qmax)
    return (q - zero_point) * scale


def fused_moving_avg_obs_fake_quant_cuda(x, observer_on, fake_quant_on, running_min, running_max, scale, zero_point,
                                         averaging_const, qmin, qmax, ch_axis, per_row_fq, symmetric_quant):
    x_contig = x.contiguous()
    _calculate_moving_average(x_contig, observer_on, averaging_const, running_min, running_max)
    fake_quant = int(fake_quant_on.item())                      # auto fake_quant = fake_quant_on.item().toInt();
    if fake_quant == 1:
        _calc_moving_avg_qparams_helper(x_contig, running_min, running_max, scale, zero_point, qmin, qmax,
                                        symmetric_quant)
        return fake_quantize_per_tensor_affine(x, scale, zero_point, qmin, qmax)
    return x


def _fused_moving_avg_obs_fq_helper_functional(x, observer_on, fake_quant_on, running_min, running_max, scale,
                                               zero_point, averaging_const, qmin, qmax, ch_axis, per_row_fq,
                                               symmetric_quant):
    """The functionalized op in the AOT graph: works on copies of the state and returns them."""
    running_min, running_max = running_min.clone(), running_max.clone()
    scale, zero_point = scale.clone(), zero_point.clone()
    out = fused_moving_avg_obs_fake_quant_cuda(x, observer_on, fake_quant_on, running_min, running_max, scale,
                                               zero_point, averaging_const, qmin, qmax, ch_axis, per_row_fq,
                                               symmetric_quant)
    return out, running_min, running_max, scale, zero_point


# --- torch/ao/quantization/fake_quantize.py ---------------------------------------------------------------------------

class FusedMovingAvgObsFakeQuantize:
    def __init__(self, quant_min, quant_max, symmetric, device, averaging_constant=0.01):
        self.quant_min, self.quant_max, self.is_symmetric_quant = quant_min, quant_max, symmetric
        self.averaging_constant = averaging_constant
        self.ch_axis, self.is_per_channel = -1, False
        self.observer_enabled = torch.tensor([1], dtype=torch.long).to(device)
        self.fake_quant_enabled = torch.tensor([1], dtype=torch.long).to(device)
        self.scale = torch.tensor([1.0], dtype=DT).to(device)
        self.zero_point = torch.tensor([0], dtype=torch.int32).to(device)
        self.min_val = torch.tensor(float("inf"), dtype=DT).to(device)     # activation_post_process.min_val
        self.max_val = torch.tensor(float("-inf"), dtype=DT).to(device)

    def buffers(self):
        return [self.observer_enabled, self.fake_quant_enabled, self.min_val, self.max_val, self.scale,
                self.zero_point]

    def forward(self, X):
        return fused_moving_avg_obs_fake_quant_cuda(
            X, self.observer_enabled, self.fake_quant_enabled, self.min_val, self.max_val, self.scale,
            self.zero_point, self.averaging_constant, self.quant_min, self.quant_max, self.ch_axis,
            self.is_per_channel, self.is_symmetric_quant)


class QATModel:
    """A QAT block (fake-quantized weight, ReLU, fake-quantized activation), a graph break, a float head."""

    def __init__(self, device):
        gen = generator(1169)
        self.weight = randn(HIDDEN, IN, gen=gen, device=device, scale=0.5).to(DT)
        self.bias = randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DT)
        self.weight_fake_quant = FusedMovingAvgObsFakeQuantize(-128, 127, True, device)
        self.activation_post_process = FusedMovingAvgObsFakeQuantize(0, 255, False, device)
        self.head_weight = randn(CLASSES, HIDDEN, gen=gen, device=device, scale=0.5).to(DT)
        self.head_bias = randn(CLASSES, gen=gen, device=device, scale=0.1).to(DT)

    def backbone(self, x):
        w = self.weight_fake_quant.forward(self.weight)
        return self.activation_post_process.forward(torch.relu(torch.addmm(self.bias, x, w.t())))

    def head(self, feats):
        return torch.addmm(self.head_bias, feats, self.head_weight.t())

    def forward(self, x):
        return self.head(self.backbone(x))

    def observer_state(self):
        return [t.clone() for fq in (self.weight_fake_quant, self.activation_post_process)
                for t in (fq.min_val, fq.max_val, fq.scale, fq.zero_point)]


# --- the traced graphs (AOT forward, functionalized) ------------------------------------------------------------------

class OpOverload:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __str__(self):
        return self.name


FQ_HELPER_FUNCTIONAL = OpOverload("aten._fused_moving_avg_obs_fq_helper_functional.default",
                                  _fused_moving_avg_obs_fq_helper_functional)
ADDMM = OpOverload("aten.addmm.default", torch.addmm)
RELU = OpOverload("aten.relu.default", torch.relu)
T = OpOverload("aten.t.default", torch.t)
GETITEM = OpOverload("<built-in function getitem>", lambda xs, i: xs[i])


@dataclasses.dataclass
class Node:
    op: str
    name: str
    target: object = None
    args: tuple = ()


class Graph:
    def __init__(self, nodes):
        self.nodes = nodes


class GraphModule:
    def __init__(self, nodes, outputs):
        self.graph = Graph(nodes)
        self.outputs = outputs


def _fq_nodes(prefix, x, fq):
    """The nodes one FusedMovingAvgObsFakeQuantize lowers to."""
    args = (x,) + tuple(f"{prefix}_{b}" for b in ("obs_on", "fq_on", "min", "max", "scale", "zp")) + (
        fq.averaging_constant, fq.quant_min, fq.quant_max, fq.ch_axis, fq.is_per_channel, fq.is_symmetric_quant)
    nodes = [Node("call_function", f"{prefix}_fq", FQ_HELPER_FUNCTIONAL, args)]
    nodes += [Node("call_function", f"{prefix}_{i}", GETITEM, (f"{prefix}_fq", i)) for i in range(5)]
    return nodes


def trace_backbone(model):
    """Placeholders: the parameters and buffers (fixed), then the user input."""
    fixed = ["weight", "bias"] + [f"w_{b}" for b in ("obs_on", "fq_on", "min", "max", "scale", "zp")] + \
            [f"a_{b}" for b in ("obs_on", "fq_on", "min", "max", "scale", "zp")]
    nodes = [Node("placeholder", n) for n in fixed + ["x"]]
    nodes += _fq_nodes("w", "weight", model.weight_fake_quant)
    nodes += [Node("call_function", "w_t", T, ("w_0",)),
              Node("call_function", "mm", ADDMM, ("bias", "x", "w_t")),
              Node("call_function", "relu", RELU, ("mm",))]
    nodes += _fq_nodes("a", "relu", model.activation_post_process)
    outputs = ["a_0", "w_1", "w_2", "w_3", "w_4", "a_1", "a_2", "a_3", "a_4"]   # output, then the updated state
    params = [model.weight, model.bias] + model.weight_fake_quant.buffers() + model.activation_post_process.buffers()
    return GraphModule(nodes, outputs), params


def trace_head(model):
    nodes = [Node("placeholder", n) for n in ("head_weight", "head_bias", "feats")]
    nodes += [Node("call_function", "hw_t", T, ("head_weight",)),
              Node("call_function", "logits", ADDMM, ("head_bias", "feats", "hw_t"))]
    return GraphModule(nodes, ["logits"]), [model.head_weight, model.head_bias]


# --- torchinductor/utils.py -------------------------------------------------------------------------------------------

def has_incompatible_cudagraph_ops(gm):
    forbidden_list = {"fbgemm.dense_to_jagged.default", "fbgemm.jagged_to_padded_dense.default"}
    if _variant == "fix":
        forbidden_list |= {"aten._fused_moving_avg_obs_fq_helper.default",
                           "aten._fused_moving_avg_obs_fq_helper_functional.default"}
    for node in gm.graph.nodes:
        if str(node.target) in forbidden_list:
            return True
    return False


# --- torchinductor/compile_fx.py --------------------------------------------------------------------------------------

@dataclasses.dataclass
class BoxedBool:
    value: bool

    def __bool__(self):
        return self.value

    @staticmethod
    def disable(obj):
        if isinstance(obj, BoxedBool):
            obj.value = False
            return obj
        return False


class GraphLowering:
    """What compile_fx_inner asks of the lowering: device types and inputs the graph mutates."""

    def __init__(self, gm):
        self.gm = gm
        self.device_types = {"cuda"}          # every tensor of these graphs lives on the accelerator
        self.mutated_inputs = set()           # functionalized: state updates leave the graph as outputs

    def compile_to_fn(self):
        gm = self.gm
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

        def call(*args):
            env = dict(zip(placeholders, args))
            for n in gm.graph.nodes:
                if n.op == "call_function":
                    vals = [env[a] if isinstance(a, str) and a in env else a for a in n.args]
                    env[n.name] = n.target.fn(*vals)
            return tuple(env[o] for o in gm.outputs)
        return call


def cudagraphify(model, inputs, static_input_idxs=(), device="cpu", name="graph"):
    """Assumes inputs[static_input_idxs[i]] are always the same memory address."""

    def static_input(x):
        # make sure alignment and contiguity of inputs is preserved
        needed_size = sum((shape - 1) * stride for shape, stride in zip(x.size(), x.stride())) + 1
        needed_size = -(-needed_size // 32) * 32
        buffer = torch.zeros(needed_size, dtype=x.dtype, device=x.device)
        return torch.as_strided(buffer, x.size(), x.stride())

    static_inputs = [static_input(x) if idx not in static_input_idxs else inputs[idx] for idx, x in enumerate(inputs)]
    copy_indices = [idx for idx in range(len(static_inputs)) if idx not in static_input_idxs]
    events.static_buffers("torchinductor cudagraphify", {f"arg{i}": static_inputs[i] for i in copy_indices})

    # warmup
    with events.warmup():
        model(*inputs)

    # record
    graph, static_outputs = capture(lambda: model(*static_inputs), device=device, warmups=0, name=name,
                                    owner="torchinductor cudagraphify")

    def run(*new_inputs):
        for idx in copy_indices:
            static_inputs[idx].copy_(new_inputs[idx])
        return replay(graph, static_outputs)

    return run


def compile_fx_inner(gm, example_inputs, cudagraphs=None, num_fixed=0, device="cpu", name="graph"):
    graph = GraphLowering(gm)
    compiled_fn = graph.compile_to_fn()
    if (cudagraphs and set(graph.device_types) == {"cuda"} and not graph.mutated_inputs
            and not has_incompatible_cudagraph_ops(gm)):
        compiled_fn = cudagraphify(compiled_fn, example_inputs, static_input_idxs=range(num_fixed), device=device,
                                   name=name)
    elif cudagraphs:
        BoxedBool.disable(cudagraphs)
    return compiled_fn


def compile_fx(gm, example_inputs, num_example_inputs, device, name):
    """Main entrypoint (the forward compiler of aot_autograd)."""
    cudagraphs = BoxedBool(True)                 # config.triton.cudagraphs

    def fw_compiler(model, example_inputs):
        fixed = len(example_inputs) - num_example_inputs
        return compile_fx_inner(model, example_inputs, num_fixed=fixed, cudagraphs=cudagraphs, device=device,
                                name=name)

    return fw_compiler(gm, example_inputs)


class CompiledQATModel:
    """What dynamo makes of QATModel.forward: two frames (the graph break), each compiled on its first call."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.backbone_fn = self.head_fn = None

    def _backbone(self, x):
        gm, params = trace_backbone(self.model)
        if self.backbone_fn is None:
            self.backbone_fn = compile_fx(gm, params + [x], 1, self.device, "qat block")
        out, *new_state = self.backbone_fn(*params, x)
        for buf, new in zip(params[4:8] + params[10:14], new_state):
            buf.copy_(new)                       # AOT runtime wrapper: apply the buffer mutations
        return out

    def _head(self, feats):
        gm, params = trace_head(self.model)
        if self.head_fn is None:
            self.head_fn = compile_fx(gm, params + [feats], 1, self.device, "head")
        return self.head_fn(*params, feats)[0]

    def __call__(self, x):
        return self._head(self._backbone(x))


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    nsteps = 4

    def serve(compiled):
        model = QATModel(device)
        fn = CompiledQATModel(model, device) if compiled else model.forward
        gen = generator(11690)
        outs = []
        for i in range(nsteps):
            x = randn(BATCH, IN, gen=gen, device=device, scale=1.0 + 0.5 * i).to(DT)
            outs.append(fn(x).clone())
        return outs + model.observer_state()

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
