"""vLLM's FULL graph is captured on PyTorch's own capture stream, not on the graph_capture stream the warmup ran on: AITER's per-stream split-K workspace does not exist there.

Upstream: https://github.com/vllm-project/vllm/pull/53818 ("[Bugfix][ROCm] Capture CUDA graphs on the current
stream", fanxingran, merged as 080a66a69c6f; PR thread dated 2026-08-26; an earlier duplicate: #52538; the same abort reported in the
still-open issue #55452 with ``--max-num-seqs > 64``).
Symptom: on ROCm with AITER (Kimi-K3 / GLM-5.3 on MI355X, MRV2, FULL_AND_PIECEWISE) the FULL decode-graph capture
aborts with ``RuntimeError: [AITER] .../csrc/opus_gemm/opus_gemm.cu: splitk workspace not initialized for the current
CUDA stream`` once a tuned GEMM shape routes to the opus a16w16 split-K kernel ("FULL capture reached 8/19 with 26
errors and the engine died"); the engine never starts. ``--enforce-eager`` serves.
Mechanism: AITER's opus split-K launcher (``csrc/opus_gemm/codegen/gen_instances_gfx950.py``) keeps the fp32 partial
sums in a slot from ``opus_splitk_ws_get(stream, allow_create=!capturing)`` (``csrc/opus_gemm/opus_gemm.cu``), a
process-global registry keyed by the current ``hipStream_t``: eagerly a missing entry is created (``hipHostMalloc``)
and its buffer grown (``hipMalloc``); while the stream captures, both are forbidden, so a missing entry throws and a
too-small one trips the grow guard. vLLM's ``capture_graphs`` runs every size under
``graph_capture(device)``, which makes a fresh side stream S current; ``CudaGraphManager.capture_graph``'s eager
warmup forward runs on S and creates and grows S's workspace. ``CudaGraphManager._capture_full_graph``
(vllm/v1/worker/gpu/cudagraph_utils.py) then opened ``torch.cuda.graph(graph, self.pool)`` without ``stream=``, and
``torch.cuda.graph`` switches to its own side stream (``default_capture_stream``) for the captured block: the first
split-K GEMM inside the capture looks up that stream, finds no entry, may not create one, and throws. Eager steps
always look up the stream they run on (and create it lazily), so they never miss. The piecewise
``CUDAGraphWrapper`` had passed ``stream=current_stream()`` since #29207; this FULL path did not.
Doctor: sync-in-capture, at _capture_full_graph (the capture it opens runs on a stream no warmup ran on, so the
library's lazy per-stream workspace creation, a host allocation plus a device ``hipMalloc`` that a capturing
stream forbids, is reached inside the capture; AITER refuses it and the capture dies, while eager never meets it).
Fix (upstream): ``with torch.cuda.graph(graph, self.pool, stream=current_stream()):`` in
``CudaGraphManager._capture_full_graph`` (and the same ``stream=current_stream()`` in
``vllm/v1/worker/encoder_cudagraph.py`` and ``vllm/v1/spec_decode/gemma4.py``): the graph is captured on the
``graph_capture`` stream the warmup primed, finds S's grown workspace, and bakes its slot.
Modelled: one decoder MLP block (embedding -> RMSNorm -> gate_up -> SiLU*mul -> down -> residual -> RMSNorm), float32;
AITER's ``tgemm.mm`` routes M >= 4 to the opus split-K kernel (split_k 2, 4x16 tiles, partials in the stream's
workspace, then the reduce) and smaller M to torch. Only the MRV2 FULL uniform-decode path is modelled (capture
sizes 8, 4, 2, 1, largest first, one eager warmup each, as upstream). Streams: on CUDA the real
``torch.cuda.current_stream()`` / ``torch.cuda.Stream`` (the engine's ``graph()`` is ``torch.cuda.graph`` without
``stream=``, so its default capture stream is current in the block; the fix forks the capture onto the
``graph_capture`` stream and joins it back, which is what ``stream=`` does). The CPU engine has no streams, so there
the stream identity is a Python object per stream, and the captured block makes ``torch.cuda.graph``'s
``default_capture_stream`` (or the ``stream=`` given) current, as torch does. vLLM's TLS-tracked ``current_stream()``
is the current stream. The slot is a Python object holding the workspace tensor; a grow replaces the tensor.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from workbench.engine import events, graph_pool_handle, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/53818"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_capture_full_graph"
SYMPTOM = ("ROCm FULL cudagraph capture aborts: [AITER] splitk workspace not initialized for the current CUDA "
           "stream (warmup primed the graph_capture stream, torch.cuda.graph captured on its own stream)")

VOCAB, HIDDEN, INTER = 64, 16, 32
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8]
MAX_NUM_REQS = 8
OPUS_MIN_M = 4                          # tuned shapes from this M on route to opus a16w16 split-K
OPUS_SPLIT_K, OPUS_B_M, OPUS_B_N = 2, 4, 16
WS_GROW_ALIGN = 256                     # elements (AITER: 4 MiB)
VARIANT = {"v": "bug"}
_ON_CUDA = [False]


# --- torch.cuda streams: real on CUDA; on the CPU engine only their identity is modelled -----------------------

class _CPUStream:
    """A stream on the CPU engine, which runs every op in program order: only which stream is current matters."""

    _ids = itertools.count()

    def __init__(self, name: str):
        self.name = f"{name} #{next(self._ids)}"

    def wait_stream(self, other) -> None:
        pass

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


_CPU_DEFAULT_STREAM = _CPUStream("default stream")
_cpu_current_stream = [_CPU_DEFAULT_STREAM]


class _DefaultCaptureStream:
    """``torch.cuda.graph.default_capture_stream``: the side stream torch creates once and captures on when the
    caller passes no ``stream=``."""

    cpu = _CPUStream("torch.cuda.graph.default_capture_stream")


def torch_cuda_current_stream():
    return torch.cuda.current_stream() if _ON_CUDA[0] else _cpu_current_stream[-1]


def torch_cuda_Stream(device):
    return torch.cuda.Stream(device=device) if _ON_CUDA[0] else _CPUStream("torch.cuda.Stream()")


@contextlib.contextmanager
def torch_cuda_stream(stream):
    if _ON_CUDA[0]:
        with torch.cuda.stream(stream):
            yield
        return
    _cpu_current_stream.append(stream)
    try:
        yield
    finally:
        _cpu_current_stream.pop()


@contextlib.contextmanager
def torch_cuda_graph_stream(stream=None):
    """What ``torch.cuda.graph(graph, pool, stream=stream)`` makes current for the captured block: ``stream``, or,
    without one, its own ``default_capture_stream``. On CUDA the engine's ``graph()`` is ``torch.cuda.graph`` without
    ``stream=`` (its default capture stream is already current); a given ``stream`` is forked into the capture and
    joined back at the end of the block."""
    if not _ON_CUDA[0]:
        with torch_cuda_stream(_DefaultCaptureStream.cpu if stream is None else stream):
            yield
        return
    if stream is None:
        yield
        return
    capture_stream = torch.cuda.current_stream()
    stream.wait_stream(capture_stream)          # ``stream`` joins the capture
    with torch.cuda.stream(stream):
        yield
    capture_stream.wait_stream(stream)          # and is joined back into the capturing stream


# --- vllm/utils/torch_utils.py ----------------------------------------------------------------------------------

def current_stream():
    """vLLM's cached current stream (tracked through the patched ``torch.cuda.set_stream``, which
    ``torch.cuda.stream`` calls): the current stream."""
    return torch_cuda_current_stream()


# --- aiter: csrc/opus_gemm/opus_gemm.cu + the generated split-K launcher ---------------------------------------

class opus_splitk_ws_handle:
    """The host-side slot a captured graph bakes: the kernel reads ``ptr`` (and ``bytes``) at launch."""

    def __init__(self):
        self.ptr: torch.Tensor | None = None
        self.bytes = 0                      # here: float32 elements


_splitk_ws_registry: dict = {}              # SplitkWsRegistry: hipStream_t -> slot (process-global, mutex)


def getCurrentHIPStream():
    return torch_cuda_current_stream()


def _hip_stream_t(stream):
    return stream.cuda_stream if _ON_CUDA[0] else stream


def hipStreamIsCapturing(stream) -> bool:
    return torch.cuda.is_current_stream_capturing()     # (``stream`` is the current stream)


def opus_splitk_ws_get(s, allow_create: bool) -> opus_splitk_ws_handle:
    key = _hip_stream_t(s)
    if key in _splitk_ws_registry:
        return _splitk_ws_registry[key]
    if not allow_create:
        raise RuntimeError(
            "[AITER] csrc/opus_gemm/opus_gemm.cu: splitk workspace not initialized for the current CUDA stream "
            f"({s!r}). Call aiter.opus_gemm_workspace_init() inside `with torch.cuda.stream(s):` (and warm with the "
            "largest expected gemm) before HIP graph capture.")
    h = opus_splitk_ws_handle()             # hipHostMalloc(hipHostMallocCoherent)
    _splitk_ws_registry[key] = h
    return h


def opus_gemm_a16w16_splitk(XQ: torch.Tensor, WQ: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """The generated a16w16 flatmm split-K launcher: per-split partials into the stream's fp32 workspace, then
    ``splitk_reduce_kernel`` folds them into ``Y``."""
    M, K = XQ.shape
    N = WQ.shape[0]
    split_k = OPUS_SPLIT_K
    padded_M = -(-M // OPUS_B_M) * OPUS_B_M
    padded_N = -(-N // OPUS_B_N) * OPUS_B_N

    stream = getCurrentHIPStream()
    capturing = hipStreamIsCapturing(stream)
    ws_handle_ = opus_splitk_ws_get(stream, allow_create=not capturing)

    ws_bytes = split_k * padded_M * padded_N
    if ws_handle_.ptr is None or ws_bytes > ws_handle_.bytes:
        if capturing:
            raise RuntimeError("[AITER] splitk workspace grow inside HIP graph capture is not supported (hipMalloc / "
                               "hipFree are stream-capture-illegal). Warm the cache once eagerly with the largest "
                               "workspace before capturing.")
        grow_bytes = -(-ws_bytes // WS_GROW_ALIGN) * WS_GROW_ALIGN
        ws_handle_.ptr = torch.empty(grow_bytes, dtype=torch.float32, device=XQ.device)   # hipMalloc (old: hipFree)
        ws_handle_.bytes = grow_bytes

    partials = ws_handle_.ptr[:ws_bytes].view(split_k, padded_M, padded_N)
    chunk = K // split_k
    for s in range(split_k):                                   # the main kernel: one K-slice per split
        ks = slice(s * chunk, (s + 1) * chunk)
        partials[s, :M, :N].copy_(XQ[:, ks] @ WQ[:, ks].t())
    Y.copy_(partials[:, :M, :N].sum(0))                        # splitk_reduce_kernel
    return Y


# --- aiter/tuned_gemm.py ----------------------------------------------------------------------------------------

class TunedGemm:
    def get_solution(self, M: int, N: int, K: int) -> str:
        """The tuned-config lookup (bf16_tuned_gemm.csv): large-M shapes were tuned to opus split-K."""
        return "opus" if M >= OPUS_MIN_M else "torch"

    def mm(self, inp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        M, K = inp.shape
        N = weights.shape[0]
        if self.get_solution(M, N, K) == "opus":
            out = torch.empty(M, N, dtype=inp.dtype, device=inp.device)
            return opus_gemm_a16w16_splitk(inp, weights, out)
        return torch.nn.functional.linear(inp, weights)


tgemm = TunedGemm()


# --- the model (one decoder MLP block; its linears go through tgemm.mm on ROCm) ----------------------------------

def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class DecoderModel:
    def __init__(self, device):
        gen = generator(53818)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.input_layernorm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.gate_up_proj = randn(2 * INTER, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.down_proj = randn(HIDDEN, INTER, gen=gen, device=device, scale=INTER ** -0.5)
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)

    def __call__(self, input_ids):
        hidden = self.embed_tokens[input_ids]
        x = rms_norm(hidden, self.input_layernorm)
        gate, up = tgemm.mm(x, self.gate_up_proj).chunk(2, dim=-1)
        hidden = hidden + tgemm.mm(torch.nn.functional.silu(gate) * up, self.down_proj)
        return rms_norm(hidden, self.norm)


# --- vllm/distributed/parallel_state.py ---------------------------------------------------------------------------

class GraphCaptureContext:
    def __init__(self, stream):
        self.stream = stream


@contextlib.contextmanager
def graph_capture(device):
    """Every capture runs on a fresh side stream, made current for the whole ``capture_graphs`` loop."""
    context = GraphCaptureContext(torch_cuda_Stream(device))
    stream = context.stream
    curr_stream = current_stream()
    if curr_stream != stream:
        stream.wait_stream(curr_stream)
    with torch_cuda_stream(stream):
        yield context


# --- vllm/v1/worker/gpu/cudagraph_utils.py --------------------------------------------------------------------------

class InputBuffers:
    def __init__(self, device):
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)


class CudaGraphManager:
    def __init__(self, device):
        self.device = device
        self.cudagraph_sizes = {}
        for i in range(1, max(CUDAGRAPH_CAPTURE_SIZES) + 1):
            self.cudagraph_sizes[i] = min(x for x in CUDAGRAPH_CAPTURE_SIZES if x >= i)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = graph_pool_handle(device)
        self.hidden_states: torch.Tensor | None = None

    def capture_graph(self, num_tokens, model, input_buffers):
        model_inputs = {"input_ids": input_buffers.input_ids[:num_tokens]}
        # Warm up (eagerly, on the current stream: graph_capture's).
        with events.warmup():
            hidden_states = model(**model_inputs)
        if self.hidden_states is None:
            self.hidden_states = torch.empty_like(hidden_states)
        self._capture_full_graph(num_tokens, model, model_inputs, input_buffers)

    def _capture_full_graph(self, num_tokens, model, model_inputs, input_buffers):
        assert num_tokens not in self.graphs
        if VARIANT["v"] == "fix":
            stream = current_stream()           # torch.cuda.graph(graph, self.pool, stream=current_stream())
        else:
            stream = None                       # torch.cuda.graph(graph, self.pool)

        def forward():
            with torch_cuda_graph_stream(stream):
                hidden_states = model(**model_inputs)
                self.hidden_states[:num_tokens] = hidden_states
            return self.hidden_states[:num_tokens]

        graph, out = capture(forward, device=self.device, pool=self.pool, warmups=0, name=f"FULL decode {num_tokens}",
                             static={"input_ids": input_buffers.input_ids[:num_tokens]}, owner="vLLM CudaGraphManager")
        self.graphs[num_tokens], self.outputs[num_tokens] = graph, out

    def capture(self, model, input_buffers):
        capture_graphs(self.cudagraph_sizes, self.device, self.capture_graph, model=model, input_buffers=input_buffers)

    def run_fullgraph(self, num_tokens, cudagraph_size, input_buffers):
        padded = {"input_ids": input_buffers.input_ids[:cudagraph_size]} if num_tokens < cudagraph_size else None
        out = replay(self.graphs[cudagraph_size], self.outputs[cudagraph_size], real=num_tokens,
                     size=cudagraph_size, padded=padded)
        return out[:num_tokens]


def capture_graphs(cudagraph_sizes, device, capture_fn, **capture_kwargs):
    sizes_to_capture = sorted(set(cudagraph_sizes.values()), reverse=True)     # larger graphs first
    with graph_capture(device=device):
        for size in sizes_to_capture:
            capture_fn(size, **capture_kwargs)


# --- vllm/v1/worker/gpu/model_runner.py (MRV2) ---------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = DecoderModel(device)
        self.input_buffers = InputBuffers(device)
        self.cudagraph_manager = None if enforce_eager else CudaGraphManager(device)

    def capture_model(self):
        if self.cudagraph_manager is not None:
            self.cudagraph_manager.capture(self.model, self.input_buffers)
            synchronize(self.device)

    def execute_model(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        self.input_buffers.input_ids[:n].copy_(input_ids)
        size = None if self.cudagraph_manager is None else self.cudagraph_manager.cudagraph_sizes.get(n)
        if size is not None:
            return self.cudagraph_manager.run_fullgraph(n, size, self.input_buffers)
        return self.model(input_ids=self.input_buffers.input_ids[:n])


def decode_steps(device):
    gen = generator(55452)
    return [torch.randint(0, VOCAB, (n,), generator=gen).to(device) for n in (8, 6, 4, 3, 8, 1)]


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    _ON_CUDA[0] = torch.device(device).type == "cuda"

    def serve(enforce_eager: bool):
        _splitk_ws_registry.clear()
        runner = GPUModelRunner(device, enforce_eager)
        runner.capture_model()
        return [runner.execute_model(ids).clone() for ids in decode_steps(device)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
