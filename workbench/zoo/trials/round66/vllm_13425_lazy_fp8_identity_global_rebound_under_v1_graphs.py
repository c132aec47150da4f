"""FP8 ``apply_fp8_linear`` lazily moves and rebinds the module global ``TORCH_DEVICE_IDENTITY``; V1 graphs read a freed copy.

Upstream: https://github.com/vllm-project/vllm/pull/13425 ("[Bugfix][CI][V1] Work around V1 + CUDA Graph +
torch._scaled_mm fallback issue", commit b3942e157, Feb 2025); issue
https://github.com/vllm-project/vllm/issues/13212 ("FP8 W8A8 quantized model doesn't work properly on V1 with
default compilation_config (use_cudagraph = True)").
Symptom: "vLLM V1, using Ada Lovelace GPUs, and when building vLLM with CUDA < 12.4, FP8 models with
per-channel and/or per-tensor quantization will produce garbage output" (the ``torch._scaled_mm`` fallback of
``apply_fp8_linear``, taken when CUTLASS FP8 is unsupported); the same model is fine with ``enforce_eager``.
Mechanism: ``vllm/model_executor/layers/quantization/utils/w8a8_utils.py`` created ``TORCH_DEVICE_IDENTITY =
torch.ones(1)`` at import, on the CPU. In the fallback branch ``apply_fp8_linear`` did ``global
TORCH_DEVICE_IDENTITY; if TORCH_DEVICE_IDENTITY.device != weight.device: TORCH_DEVICE_IDENTITY =
TORCH_DEVICE_IDENTITY.to(weight.device)`` and passed the global as ``scale_a``/``scale_b`` of
``torch._scaled_mm``. Eagerly the move happens once. Under V1, Dynamo traces the forward on the profiling run,
while the global is still a CPU tensor: the global becomes a graph input, the device check is decided at trace
time (and vLLM's dispatcher skips guards), the ``.to`` stays in the graph as a device copy (Inductor: a new
buffer and ``copy_``), and the rebinding becomes a ``STORE_GLOBAL`` of that graph output after every call. So
each call rebinds the global to a new tensor and drops the one before. The piecewise graph of a size, captured
after its warmup, copies from the global of capture time (the warmup's output) by address; the capture's own
store drops the last owner of that tensor, and every replay reads the scale from freed memory, which the
allocator hands to later small tensors: the GEMM is scaled by whatever lands there. And the global the last
capture leaves is that graph's output, which a capture does not compute: sizes run without a graph (a long
prefill) copy their scale from it before any replay has written it.
Doctor: dangling-reference, at ``apply_fp8_linear`` (its compiled rebinding of the global releases the identity
tensor the captured ``_scaled_mm`` copy reads).
Fix (upstream): ``TORCH_DEVICE_IDENTITY = None`` at import and ``maybe_create_device_identity()``, called from
``create_weights`` of ``Fp8LinearMethod`` / ``CompressedTensorsW8A8Fp8`` / ``FBGEMMFp8LinearMethod`` (run
under the target device), allocates the ones tensor once; the lazy ``.to`` block leaves ``apply_fp8_linear``.
Modelled: the PR's author only says "there is some issue with the way we are setting up
TORCH_DEVICE_IDENTITY"; the Dynamo reading above (trace-time decision, per-call store, capture-time address) is
this program's, the same pattern as #11596's buffer reassignment. FP8 is emulated (integer-valued float
weights, per-token int8-like activations); two fallback linears; ``create_weights`` gets the device explicitly
instead of a default-device context; the trace-time decision is a dict of branch outcomes (``Dynamo``).
"""
from __future__ import annotations

import torch

from workbench.engine import host, is_host, reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/13425"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "apply_fp8_linear"
SYMPTOM = "FP8 models (scaled_mm fallback) produce garbage under V1 CUDA graphs; eager mode is fine"

VOCAB, HIDDEN, INTER = 16, 8, 12
FP8_MAX = 127.0                                  # emulated fp8 range (per-token dynamic activation scales)
CAPTURE_SIZES = [1, 2, 4, 8]                     # cudagraph_capture_sizes
MAX_NUM_TOKENS = 16

TORCH_DEVICE_IDENTITY = None                     # (re)set per "process" by ``_import_w8a8_utils``
VARIANT = "bug"


def _import_w8a8_utils(variant: str, device) -> None:
    """Module import: before the fix a CPU ones tensor, after it ``None``."""
    global TORCH_DEVICE_IDENTITY, VARIANT
    VARIANT = variant
    TORCH_DEVICE_IDENTITY = host(torch.ones(1, dtype=torch.float32), device) if variant == "bug" else None


def maybe_create_device_identity(device) -> None:
    global TORCH_DEVICE_IDENTITY
    if TORCH_DEVICE_IDENTITY is None:
        TORCH_DEVICE_IDENTITY = torch.ones(1, dtype=torch.float32, device=device)


class Dynamo:
    """What torch.compile decided while tracing: the outcome of each Python branch at trace time. vLLM's
    ``TorchCompileWrapperWithCustomDispatcher`` calls the compiled code without guards, so later calls keep it."""

    active = None                                # the Dynamo of the compiled model being run, if any

    def __init__(self):
        self.decisions: dict[str, bool] = {}
        self.stores: dict[str, torch.Tensor] = {}   # STORE_GLOBALs the transformed code runs after the graph

    @staticmethod
    def branch(key: str, value: bool) -> bool:
        d = Dynamo.active
        return value if d is None else d.decisions.setdefault(key, value)

    @staticmethod
    def load_identity():
        d = Dynamo.active
        return TORCH_DEVICE_IDENTITY if d is None else d.stores.get("TORCH_DEVICE_IDENTITY", TORCH_DEVICE_IDENTITY)

    @staticmethod
    def store_identity(t):
        global TORCH_DEVICE_IDENTITY
        if Dynamo.active is None:
            TORCH_DEVICE_IDENTITY = t
        else:                                    # a graph output, stored once the compiled call returns
            Dynamo.active.stores["TORCH_DEVICE_IDENTITY"] = t

    def apply_stores(self):
        global TORCH_DEVICE_IDENTITY
        TORCH_DEVICE_IDENTITY = self.stores.pop("TORCH_DEVICE_IDENTITY", TORCH_DEVICE_IDENTITY)


def _scaled_mm(qinput, weight, scale_a, scale_b):
    """``torch._scaled_mm(..., out_dtype=torch.float32)``: (A * scale_a) @ (B * scale_b)."""
    return (qinput * scale_a) @ (weight * scale_b)


def apply_fp8_linear(input, weight, weight_scale, layer_name):
    x_scale = input.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / FP8_MAX     # per-token dynamic
    qinput = torch.round(input / x_scale).clamp(-FP8_MAX, FP8_MAX)
    if VARIANT == "bug":
        # Making sure the dummy tensor is on the same device as the weight (host memory: a CPU tensor)
        identity = Dynamo.load_identity()        # global TORCH_DEVICE_IDENTITY
        on_host = is_host(identity) or identity.device != weight.device
        if Dynamo.branch(f"{layer_name}: identity on host", on_host):
            moved = torch.empty(identity.shape, dtype=torch.float32, device=weight.device)
            moved.copy_(identity)                # .to(weight.device); compiled: a DeviceCopy of the input
            Dynamo.store_identity(moved)         # TORCH_DEVICE_IDENTITY = ...; compiled: STORE_GLOBAL
    identity = Dynamo.load_identity()
    output = _scaled_mm(qinput, weight, identity, identity)
    return output * x_scale * weight_scale.t()                # DQ: C = sw * sx * (X * W)


class Fp8LinearMethod:
    def create_weights(self, layer: "Fp8Linear", device):
        if VARIANT == "fix":
            maybe_create_device_identity(device)
        gen = generator(13425 + layer.in_features * 31 + layer.out_features)
        w = randn(layer.in_features, layer.out_features, gen=gen, device=device)
        layer.weight_scale = w.abs().amax(dim=0, keepdim=True).t() / FP8_MAX      # per-channel [N, 1]
        layer.weight = torch.round(w / layer.weight_scale.t()).clamp(-FP8_MAX, FP8_MAX)

    def apply(self, layer: "Fp8Linear", x):
        return apply_fp8_linear(x, layer.weight, layer.weight_scale, layer.name)


class Fp8Linear:
    def __init__(self, name, in_features, out_features, device):
        self.name, self.in_features, self.out_features = name, in_features, out_features
        self.quant_method = Fp8LinearMethod()
        self.quant_method.create_weights(self, device)

    def __call__(self, x):
        return self.quant_method.apply(self, x)


class Model:
    def __init__(self, device):
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=generator(1342), device=device)
        self.gate_up_proj = Fp8Linear("gate_up_proj", HIDDEN, INTER, device)
        self.down_proj = Fp8Linear("down_proj", INTER, HIDDEN, device)

    def forward(self, inputs_embeds):
        return inputs_embeds + self.down_proj(torch.relu(self.gate_up_proj(inputs_embeds)))


class ConcreteSizeEntry:
    def __init__(self):
        self.graph = self.output = None


class PiecewiseBackend:
    """One graph per capture size, captured on its first call (after a warmup), replayed afterwards;
    other sizes run the compiled code without a graph."""

    def __init__(self, model: Model, runner: "GPUModelRunner", device):
        self.model, self.runner, self.device = model, runner, device
        self.dynamo = Dynamo()
        self.entries = {size: ConcreteSizeEntry() for size in CAPTURE_SIZES}

    def __call__(self, inputs_embeds):
        Dynamo.active = self.dynamo
        try:
            entry = self.entries.get(inputs_embeds.shape[0])
            if entry is None:
                return self.model.forward(inputs_embeds)
            if entry.graph is None:
                entry.graph, entry.output = capture(
                    lambda: self.model.forward(inputs_embeds), device=self.device, on_freed="reuse",
                    owner="PiecewiseBackend (fp8 model)", name=f"size {inputs_embeds.shape[0]}",
                    static={"inputs_embeds": self.runner.inputs_embeds})
                return entry.output
            return replay(entry.graph, entry.output, real=self.runner.num_tokens, size=inputs_embeds.shape[0],
                          padded={"inputs_embeds": self.runner.inputs_embeds})
        finally:
            Dynamo.active = None
            self.dynamo.apply_stores()           # the transformed bytecode, after the compiled call


class GPUModelRunner:
    def __init__(self, variant, device, graphed: bool):
        _import_w8a8_utils(variant, device)
        self.device = device
        self.model = Model(device)
        self.inputs_embeds = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.num_tokens = 0
        self.compiled = PiecewiseBackend(self.model, self, device) if graphed else self.model.forward
        self.execute_model(list(range(MAX_NUM_TOKENS)))       # profile_run (traces the compiled model)
        if graphed:
            for size in reversed(CAPTURE_SIZES):             # capture_model
                self.execute_model([0] * size)

    def execute_model(self, token_ids):
        n = self.num_tokens = len(token_ids)
        num_input_tokens = next((s for s in CAPTURE_SIZES if s >= n), n)       # pad_for_cudagraph
        ids = torch.tensor(token_ids, device=self.device)
        self.inputs_embeds[:n].copy_(self.model.embed_tokens[ids])
        self.inputs_embeds[n:num_input_tokens].zero_()
        return self.compiled(self.inputs_embeds[:num_input_tokens])[:n].clone()


def run(variant: str, device: str = "cpu"):
    steps = [[3, 9, 1, 14, 7, 7, 2, 11, 5, 0, 8], [4, 6, 12], [1, 10], [13, 2, 5, 9, 3, 15, 6],
             [7, 8, 1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9], [5, 14, 0, 3, 2]]

    def serve(graphed: bool):
        runner = GPUModelRunner(variant, device, graphed)
        return [runner.execute_model(ids) for ids in steps]

    def served():
        with reuse_freed_blocks():     # freed blocks go to the next allocation of their size, as on CUDA
            return serve(True)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: serve(False))
