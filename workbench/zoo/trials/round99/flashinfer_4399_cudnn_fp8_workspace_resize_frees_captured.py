"""FlashInfer's cuDNN FP8 GEMM grows the process-wide ``bmm_fp8_workspace`` with ``resize_()`` when a plan wants more than 32 MiB: the old storage is freed, and every decode graph captured before the growth still launches its GEMMs on the freed address.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/4399 ("fix(gemm): never free workspace storage that captured
CUDA graphs may reference", flashinfer-ai/flashinfer, opened 2026-08-07 by ldkhang1201, open, not merged), fixing issue
#4398 ("bmm_fp8 shared workspace growth frees storage referenced by captured CUDA graphs -> Xid 31 MMU fault / silent
corruption at replay", open). Read: the PR description (retire-and-replace: ``_get_cache_buf`` retires grown-over
buffers into ``_retired_cache_buf``; a new ``_grow_workspace()`` helper replaces all eight
``workspace.resize_(workspace_size)`` sites of ``gemm/gemm_base.py``); the issue's summary; the instrumented evidence
quoted in vllm-project/vllm#52540 and #52553 ("RESIZE old_ptr=0x7efadc000000 old=33554432 new=33554688" during vLLM's
piecewise capture; the FP8 layers of a ModelOpt checkpoint select ``FlashInferFP8ScaledMMLinearKernel`` -> ``bmm_fp8``
-> ``CudnnFp8GemmRunner``); ``flashinfer/utils.py`` (``_get_cache_buf``) and ``flashinfer/gemm/gemm_base.py``
(``bmm_fp8``, ``fp8_gemm_sm100``'s cuDNN runner ``CudnnFp8GemmRunner.forward``, ``_cudnn_gemm_fp8``,
``build_cudnn_gemm_fp8_graph``, ``execute_cudnn_gemm_fp8_graph``) at main fb28d72 (2026-08-22), which still has the
resize. The PR's diff itself was not available to me: ``_grow_workspace`` below is written from its description.
Symptom: vLLM 0.26 + FlashInfer 0.6.13/0.6.14, per-tensor FP8 linears on the cuDNN lane, FULL+PIECEWISE CUDA graphs: the
server dies minutes into serving with "CUDA error: unspecified launch failure" (dmesg Xid 31 MMU fault at the freed
workspace base + a fixed offset), or, when the freed block is reused, silently corrupts other tensors.
Mechanism: ``bmm_fp8`` takes its scratch from ``_get_cache_buf("bmm_fp8_workspace", 32 MiB)``, one tensor per device
shared by every GEMM. ``execute_cudnn_gemm_fp8_graph`` asks the chosen plan for its workspace size and, when the plan
wants more, grows the shared tensor in place with ``workspace.resize_(workspace_size)``, which allocates new storage and
frees the old. A CUDA graph captured earlier baked the old address into its cuDNN kernels' arguments; its next replay
reads and writes scratch at freed memory.
Doctor: dangling-reference, at ``execute_cudnn_gemm_fp8_graph``: the decode graphs read the workspace they captured,
memory the graph does not own, and its owner gives it other memory (``resize_``, which frees the old) in that function.
Fix (upstream): grow by retire-and-replace: allocate a new buffer, swap it into ``_cache_buf``, and keep the old tensor
alive in ``_retired_cache_buf`` so its storage outlives every graph that references it.
Modelled: ``_get_cache_buf`` and ``_cache_buf`` as upstream; ``bmm_fp8`` (``backend="cudnn"``), ``fp8_gemm_sm100``
reduced to its cuDNN runner, ``CudnnFp8GemmRunner.forward`` (the non-override-shape path), ``_cudnn_gemm_fp8``,
``build_cudnn_gemm_fp8_graph`` (lru-cached per shape), ``execute_cudnn_gemm_fp8_graph`` with the resize under
``_variant == "bug"`` and the fix's ``_grow_workspace`` under ``"fix"``. Stand-ins: ``pygraph`` for the cuDNN graph: its
engine is a split-K matmul that writes its partial products into the workspace and sums them into ``c_final``, times
both per-tensor scales; the heuristics pick a decode engine (M <= 8, scratch = its partials) or a large-M engine whose
workspace is 32 MiB + 256 B, the size the vLLM instrumentation caught. FP8 is float64 clamped to +-448 (e4m3's range),
the cuDNN handle is ``None``. vLLM side: ``FlashInferFP8ScaledMMLinearKernel.apply_weights`` (static per-tensor input
scale), a two-layer FP8 MLP with ``SiluAndMul`` and a residual, and a decode runner capturing batch sizes 8 and 4
(descending, shared pool) into graphs that read the ``hidden_states`` static buffer; prefill runs eagerly.
Workload: decode 3 (graph bs=4), decode 7 (bs=8), an eager prefill of 24 tokens, decode 6 (bs=8), decode 2 (bs=4),
against the same steps with ``enforce_eager``. The prefill's large-M plan asks for 33554688 bytes, so the bug variant
``resize_``s the shared workspace and the fourth step's replay reads the freed storage: the CPU emulation raises
IllegalMemoryAccess there (after the prefill the runner hands freed segments back to the driver, the issue's Xid 31
case). The fix retires the old 32 MiB buffer, the graphs keep using it and the prefill uses the new one: all five
steps equal eager (max error 3.6e-15: the graphs multiply padded batches).
"""
from __future__ import annotations

import enum
import functools
from typing import Dict, List, Optional, Tuple

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, release_to_driver, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/4399"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "execute_cudnn_gemm_fp8_graph"
SYMPTOM = ("a cuDNN FP8 plan wanting 32 MiB + 256 B makes execute_cudnn_gemm_fp8_graph resize_() the shared "
           "bmm_fp8 workspace; decode graphs captured before replay on the freed storage (Xid 31 / corruption)")

HIDDEN, INTERMEDIATE = 32, 32
CAPTURE_SIZES = (8, 4)
FP8_MAX = 448.0
DTYPE = torch.float64

_variant = "bug"


# --- flashinfer/utils.py ----------------------------------------------------------------------------------------------

_cache_buf: Dict[Tuple[str, str], torch.Tensor] = {}
_retired_cache_buf: List[torch.Tensor] = []          # (the fix) grown-over buffers, kept for the graphs that use them


def _get_cache_buf(name: str, bytes: int, device: str, zero_init: bool = False) -> torch.Tensor:
    key = (name, device)
    buf = _cache_buf.get(key)
    if buf is None or buf.size(0) < bytes:
        if buf is not None and _variant == "fix":
            _retired_cache_buf.append(buf)
        if zero_init:
            buf = torch.zeros(bytes, dtype=torch.uint8, device=device)
        else:
            buf = torch.empty(bytes, dtype=torch.uint8, device=device)
        _cache_buf[key] = buf
    return buf


# --- cudnn (stand-in for the cuDNN frontend's python graph) -----------------------------------------------------------

class UIDs(enum.Enum):
    A_UID = 0
    B_UID = 1
    A_SCALE_UID = 2
    B_SCALE_UID = 3
    O_UID = 4


class pygraph:
    """One built cuDNN graph: ``c_final = (a @ b) * a_scale * b_scale`` by the engine the heuristics picked."""

    SPLIT_K = 2
    DECODE_ENGINE_MAX_M = 8
    LARGE_M_ENGINE_WORKSPACE = 32 * 1024 * 1024 + 256

    def __init__(self, a_shape, b_shape):
        self.batch, self.m, self.k = a_shape
        self.n = b_shape[-1]
        self.partials_bytes = self.SPLIT_K * self.batch * self.m * self.n * torch.finfo(DTYPE).bits // 8
        self.engine = "split_k_decode" if self.m <= self.DECODE_ENGINE_MAX_M else "split_k_large_m"

    def get_workspace_size(self) -> int:
        if self.engine == "split_k_decode":
            return self.partials_bytes
        return self.LARGE_M_ENGINE_WORKSPACE

    def execute(self, variant_pack, workspace, handle=None):
        a, b = variant_pack[UIDs.A_UID.value], variant_pack[UIDs.B_UID.value]
        c_final = variant_pack[UIDs.O_UID.value]
        partials = workspace[: self.partials_bytes].view(DTYPE).view(self.SPLIT_K, self.batch, self.m, self.n)
        ks = self.k // self.SPLIT_K
        for s in range(self.SPLIT_K):                       # each split writes its partial product to the scratch
            torch.matmul(a[..., s * ks:(s + 1) * ks], b[..., s * ks:(s + 1) * ks, :], out=partials[s])
        torch.sum(partials, dim=0, out=c_final)             # ... which the epilogue reduces
        c_final.mul_(variant_pack[UIDs.A_SCALE_UID.value]).mul_(variant_pack[UIDs.B_SCALE_UID.value])

    def execute_plan_at_index(self, variant_pack, workspace, plan_index, handle=None):
        self.execute(variant_pack, workspace, handle=handle)


# --- flashinfer/gemm/gemm_base.py -------------------------------------------------------------------------------------

DEFAULT_WORKSPACE_SIZE = 32 * 1024 * 1024


def _get_cudnn_handle(device, stream):
    return None


def _get_cudnn_plan_index_for_tactic(graph, tactic) -> int:
    return -1 if tactic < 0 else tactic


def _get_cudnn_workspace_size(graph, plan_index) -> int:
    return graph.get_workspace_size()


@functools.lru_cache(maxsize=2048)
def build_cudnn_gemm_fp8_graph(a_shape, a_stride, b_shape, b_stride, a_type, b_type, o_type, device, tactic=-1):
    return pygraph(tuple(a_shape), tuple(b_shape))


def _grow_workspace(workspace: torch.Tensor, workspace_size: int) -> torch.Tensor:
    """(The fix) A new buffer in the cache's slot; the old one retired, never freed: a captured graph may hold it."""
    grown = torch.empty(workspace_size, dtype=workspace.dtype, device=workspace.device)
    for key, buf in list(_cache_buf.items()):
        if buf is workspace:
            _cache_buf[key] = grown
    _retired_cache_buf.append(workspace)
    return grown


def execute_cudnn_gemm_fp8_graph(graph, a, b, a_scale, b_scale, c_final, workspace, tactic=-1):
    variant_pack = {
        UIDs.A_UID.value: a,
        UIDs.B_UID.value: b,
        UIDs.A_SCALE_UID.value: a_scale,
        UIDs.B_SCALE_UID.value: b_scale,
        UIDs.O_UID.value: c_final,
    }

    stream = None                                           # torch.cuda.current_stream(a.device)
    cudnn_handle = _get_cudnn_handle(a.device, stream)

    plan_index = _get_cudnn_plan_index_for_tactic(graph, tactic)

    workspace_size = _get_cudnn_workspace_size(graph, plan_index)
    if workspace.numel() < workspace_size:
        if _variant == "bug":
            workspace.resize_(workspace_size)               # new storage for the shared tensor; the old is freed
        else:
            workspace = _grow_workspace(workspace, workspace_size)

    if plan_index < 0:
        graph.execute(variant_pack, workspace, handle=cudnn_handle)
    else:
        graph.execute_plan_at_index(variant_pack, workspace, plan_index, handle=cudnn_handle)


def _cudnn_gemm_fp8(workspace, a, b, a_scale, b_scale, out, torch_out_dtype, tactic=-1):
    graph = build_cudnn_gemm_fp8_graph(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), str(a.dtype),
                                       str(b.dtype), str(torch_out_dtype), str(a.device), tactic=tactic)
    execute_cudnn_gemm_fp8_graph(graph, a, b, a_scale, b_scale, out, workspace, tactic=tactic)
    return out


class CudnnFp8GemmRunner:
    def __init__(self):
        self._use_override_shape = False                    # cuDNN without override-shape support

    def forward(self, inputs: List[torch.Tensor], tactic=-1, do_preparation: bool = False, **kwargs) -> torch.Tensor:
        a, b, scale_a, scale_b, out, workspace_buffer = inputs
        _cudnn_gemm_fp8(workspace_buffer, a, b, scale_a, scale_b, out, out.dtype, tactic=tactic)
        return out


def fp8_gemm_sm100(a, b, scale_a, scale_b, out, workspace_buffer, runner_names):
    runners = [CudnnFp8GemmRunner() for name in runner_names if name == "cudnn"]
    inputs = [a, b, scale_a, scale_b, out, workspace_buffer]
    runner, tactic = runners[0], -1                         # (AutoTuner.choose_one outside tuning mode)
    runner.forward(inputs, tactic=tactic)


def bmm_fp8(A, B, A_scale, B_scale, dtype, out: Optional[torch.Tensor] = None, backend: str = "cudnn"):
    if out is None:
        out = torch.empty((A.shape[0], A.shape[1], B.shape[2]), device=A.device, dtype=dtype)

    workspace_buffer = _get_cache_buf("bmm_fp8_workspace", DEFAULT_WORKSPACE_SIZE, str(A.device))
    fp8_gemm_sm100(A, B, A_scale, B_scale, out, workspace_buffer, [backend])
    return out


# --- vllm (stand-ins: the FP8 linear kernel, a one-MLP model, the decode graph runner) ---------------------------------

class Fp8Linear:
    def __init__(self, in_features, out_features, gen, device):
        weight = randn(out_features, in_features, gen=gen, device=device, scale=0.3).to(DTYPE)
        self.weight_scale = weight.abs().amax().reshape(1) / FP8_MAX
        self.weight = (weight / self.weight_scale).clamp(-FP8_MAX, FP8_MAX)           # [n, k], "fp8"
        self.input_scale = torch.full((1,), 4.0 / FP8_MAX, dtype=DTYPE, device=device)   # static per-tensor


class FlashInferFP8ScaledMMLinearKernel:
    @staticmethod
    def apply_weights(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
        x_q = (x / layer.input_scale).clamp(-FP8_MAX, FP8_MAX)                          # static_scaled_fp8_quant
        out = bmm_fp8(x_q.unsqueeze(0), layer.weight.t().unsqueeze(0), layer.input_scale, layer.weight_scale,
                      DTYPE, backend="cudnn")                                            # flashinfer_scaled_fp8_mm
        return out.squeeze(0)


class Fp8MLP:
    def __init__(self, device):
        gen = generator(4399)
        self.gate_up_proj = Fp8Linear(HIDDEN, 2 * INTERMEDIATE, gen, device)
        self.down_proj = Fp8Linear(INTERMEDIATE, HIDDEN, gen, device)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate_up = FlashInferFP8ScaledMMLinearKernel.apply_weights(self.gate_up_proj, hidden_states)
        act = torch.nn.functional.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]   # SiluAndMul
        return hidden_states + FlashInferFP8ScaledMMLinearKernel.apply_weights(self.down_proj, act)


class ModelRunner:
    def __init__(self, device, enforce_eager):
        _cache_buf.clear()                                  # a fresh process
        _retired_cache_buf.clear()
        self.device, self.enforce_eager = device, enforce_eager
        self.model = Fp8MLP(device)
        self.graphs = {}
        if not enforce_eager:
            self.capture_model()

    def capture_model(self):
        self.hidden_states = torch.zeros(max(CAPTURE_SIZES), HIDDEN, dtype=DTYPE, device=self.device)
        pool = graph_pool_handle(self.device)
        for bs in sorted(CAPTURE_SIZES, reverse=True):
            self.graphs[bs] = capture(lambda bs=bs: self.model.forward(self.hidden_states[:bs]), device=self.device,
                                      pool=pool, warmups=1, name=f"decode bs={bs}", owner="ModelRunner",
                                      static={"hidden_states": self.hidden_states})

    def execute_model(self, hidden_states: torch.Tensor, is_prefill: bool) -> torch.Tensor:
        n = hidden_states.shape[0]
        if self.enforce_eager or is_prefill or n > max(CAPTURE_SIZES):
            return self.model.forward(hidden_states)
        bs = min(size for size in CAPTURE_SIZES if size >= n)
        self.hidden_states[:n].copy_(hidden_states)
        g, out = self.graphs[bs]
        return replay(g, out, real=n, size=bs, padded={"hidden_states": self.hidden_states[:bs]})[:n].clone()


# --- the workload -----------------------------------------------------------------------------------------------------

STEPS = [(3, False), (7, False), (24, True), (6, False), (2, False)]     # (tokens, is_prefill)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(43990)
    inputs = [randn(n, HIDDEN, gen=gen, device=device).to(DTYPE) for n, _ in STEPS]

    def serve(enforce_eager):
        runner = ModelRunner(device, enforce_eager)
        outs = []
        for x, (_, is_prefill) in zip(inputs, STEPS):
            outs.append(runner.execute_model(x, is_prefill))
            if is_prefill and not enforce_eager:
                release_to_driver(device)                   # freed segments go back to the driver
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
