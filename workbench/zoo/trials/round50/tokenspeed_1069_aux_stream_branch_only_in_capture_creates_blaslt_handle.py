"""The shared expert forks onto its aux stream only in capture: that stream's lazy hipBLASLt handle is made inside capture.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/1069 ("fix(runtime): warm graph auxiliary streams before
capture", merged as 12e233c7; the same fix for Kimi-Linear MoE: #1270).
Symptom: with torch 2.13 on ROCm, graph capture of Qwen3.5 MoE / Inkling dies with "HIP error 900: operation not
permitted when stream is capturing" (hipBLASLt's forbidden ``hipMalloc``); in #1270 one error per rank, then a
startup deadlock with every GPU at 0%.
Mechanism: torch 2.13 caches hipBLASLt handles per (device, stream) and creates one lazily, with its workspace
allocation, the first time a GEMM on that stream selects hipBLASLt. ``Qwen3_5MoeSparseMoeBlock._forward_tp`` runs
the shared expert under ``self.stream_fork.scope(enable=... and get_is_capture_mode())``: only when capturing does
``fork.branch()`` move it onto the auxiliary stream. ``CudaGraphWrapper._capture_one`` runs its 4 warmups (capture
mode off, on the default stream), so the shared expert's GEMMs only ever created the default stream's handle;
``torch.cuda.graph(graph, pool=..., stream=self.stream)`` then turns capture mode on, the branch takes the aux
stream for the first time, and its first GEMM creates that stream's handle inside the capture. Eager serving never
forks. (Miniature: the gate and routed experts are quantized kernels that do not use hipBLASLt, so the shared
expert's BF16 linears are the only hipBLASLt GEMMs; split-K partials live in the handle's workspace.)
Doctor: sync-in-capture, at getCurrentCUDABlasLtHandle (the lazy handle creation's ``hipMalloc`` runs inside the
captured forward, on the aux stream that no warmup touched).
Fix (upstream): warmup runs ``with torch.cuda.stream(self.stream):`` (then ``torch.cuda.synchronize()``);
``StreamFork.scope(*, enable, overlap=True)`` gains ``overlap`` (``branch()`` ends with
``self.join_event.wait(self._current)`` when false), and the models call
``scope(enable=get_is_cuda_graph_phase(), overlap=get_is_capture_mode())``: warmup rehearses the aux-stream branch
serially, which creates its handle before capture.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import CaptureError, events, graph_pool_handle
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/1069"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "getCurrentCUDABlasLtHandle"
SYMPTOM = "graph capture dies: HIP error 900, hipBLASLt handle hipMalloc while the aux stream is capturing"

HIDDEN, INTER, EXPERTS, SPLIT_K, WORKSPACE_ELEMS = 4, 8, 3, 2, 128
CAPTURE_BS = [2, 4]
_is_capture_mode = False
_is_cuda_graph_phase = False
_current_stream = "default"
_blaslt_handles: dict = {}                   # torch 2.13: one hipBLASLt handle (and workspace) per (device, stream)


def get_is_capture_mode() -> bool:
    return _is_capture_mode


def get_is_cuda_graph_phase() -> bool:
    return _is_cuda_graph_phase


@contextlib.contextmanager
def cuda_stream(stream: str):
    """``torch.cuda.stream``: the GEMMs in the block run on (and pick the handle of) ``stream``."""
    global _current_stream
    prev, _current_stream = _current_stream, stream
    try:
        yield
    finally:
        _current_stream = prev


def getCurrentCUDABlasLtHandle(device: str):
    key = (device, _current_stream)
    if key not in _blaslt_handles:             # hipblasLtCreate + its workspace hipMalloc, on first use
        if torch.cuda.is_current_stream_capturing():
            raise CaptureError("HIP error: operation not permitted when stream is capturing (900): hipMalloc "
                               f"for the hipBLASLt handle of stream {_current_stream!r}\n  at {user_frame()}",
                               op="hipMalloc", source=user_frame())
        _blaslt_handles[key] = torch.zeros(WORKSPACE_ELEMS, device=device)
    return _blaslt_handles[key]


def F_linear(x, weight):
    """BF16 ``F.linear`` -> hipBLASLt: split-K partial products in the handle's workspace, then reduced."""
    ws = getCurrentCUDABlasLtHandle(x.device.type)
    rows, out = x.shape[0], weight.shape[0]
    partials, chunk = ws[: SPLIT_K * rows * out].view(SPLIT_K, rows, out), x.shape[1] // SPLIT_K
    for s in range(SPLIT_K):
        torch.matmul(x[:, s * chunk:(s + 1) * chunk], weight[:, s * chunk:(s + 1) * chunk].t(), out=partials[s])
    return partials.sum(0)


class StreamFork:
    def __init__(self, aux_stream):
        self.aux_stream = aux_stream
        self._active, self._overlap = False, True

    @contextlib.contextmanager
    def scope(self, *, enable: bool, overlap: bool = True):
        self._active = enable and self.aux_stream is not None
        self._overlap = overlap                       # fork_event.record / join_event.wait: ordering only here
        try:
            yield self
        finally:
            self._active, self._overlap = False, True

    @contextlib.contextmanager
    def branch(self):
        if not self._active:
            yield
            return
        with cuda_stream(self.aux_stream):               # fork_event.wait(aux_stream)
            yield                                        # join_event.record(aux_stream)
        # not self._overlap: join_event.wait(self._current) serialises the branch (ordering only here)


class Qwen3_5MoeSparseMoeBlock:
    def __init__(self, device: str, variant: str):
        gen = generator(1069)
        self.variant = variant
        self.gate_w = randn(EXPERTS, HIDDEN, gen=gen, device=device)
        self.experts_w = randn(EXPERTS, HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.shared_up = randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5)
        self.shared_down = randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5)
        self.stream_fork = StreamFork("aux")

    def shared_expert(self, x):
        return F_linear(torch.nn.functional.silu(F_linear(x, self.shared_up)), self.shared_down)

    def experts(self, x, router_logits):
        """Routed experts (a quantized fused-MoE kernel, not hipBLASLt): softmax-weighted mix."""
        weights = torch.softmax(router_logits, -1)
        return torch.einsum("te,eoh,th->to", weights, self.experts_w, x)

    def _forward_tp(self, hidden_states):
        router_logits = hidden_states @ self.gate_w.t()          # quantized gate kernel
        shared_output = None
        if self.variant == "fix":
            scope = self.stream_fork.scope(enable=get_is_cuda_graph_phase(), overlap=get_is_capture_mode())
        else:
            scope = self.stream_fork.scope(enable=get_is_capture_mode())
        with scope as fork:
            with fork.branch():
                shared_output = self.shared_expert(hidden_states)
            final_hidden_states = self.experts(hidden_states, router_logits)
        return final_hidden_states + shared_output


class CudaGraphWrapper:
    def __init__(self, block, device: str, variant: str):
        self.block, self.device, self.variant = block, device, variant
        self.hidden_buf = torch.zeros(max(CAPTURE_BS), HIDDEN, device=device)
        self.graphs, self.output_buffers = {}, {}

    def capture(self):
        self.stream = "graph"                               # torch.cuda.Stream()
        self.pool = graph_pool_handle(self.device)
        for bs in sorted(CAPTURE_BS, reverse=True):
            self.graphs[bs], self.output_buffers[bs] = self._capture_one(bs)

    def _capture_one(self, bs: int):
        global _is_cuda_graph_phase, _is_capture_mode

        def run_once():
            return self.block._forward_tp(self.hidden_buf[:bs])

        _is_cuda_graph_phase = True
        warm_stream = cuda_stream(self.stream) if self.variant == "fix" else contextlib.nullcontext()
        with warm_stream:
            for _ in range(4):
                with events.warmup():
                    run_once()
        _is_capture_mode = True
        try:
            def captured():
                with cuda_stream(self.stream):                # torch.cuda.graph(..., stream=self.stream)
                    return run_once()
            return capture(captured, device=self.device, pool=self.pool, warmups=0, name=f"decode bs {bs}",
                           owner="tokenspeed CudaGraphWrapper", static={"hidden_buf": self.hidden_buf[:bs]},
                           state={f"hipBLASLt workspace ({s})": ws for (_, s), ws in _blaslt_handles.items()})
        finally:
            _is_capture_mode = False
            _is_cuda_graph_phase = False

    def __call__(self, hidden_states):
        bs = hidden_states.shape[0]
        self.hidden_buf[:bs].copy_(hidden_states)
        return replay(self.graphs[bs], self.output_buffers[bs])


def batches(device):
    gen = generator(1270)
    return [randn(bs, HIDDEN, gen=gen, device=device) for bs in (4, 2, 4)]


def run(variant: str, device: str = "cpu"):
    def served():
        _blaslt_handles.clear()
        wrapper = CudaGraphWrapper(Qwen3_5MoeSparseMoeBlock(device, variant), device, variant)
        wrapper.capture()
        return [wrapper(x).clone() for x in batches(device)]

    def eager():
        _blaslt_handles.clear()
        block = Qwen3_5MoeSparseMoeBlock(device, variant)
        return [block._forward_tp(x) for x in batches(device)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
