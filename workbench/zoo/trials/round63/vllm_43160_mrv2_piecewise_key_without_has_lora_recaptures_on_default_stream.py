"""MRV2 stores its LoRA piecewise graphs under a key without ``has_lora``: serving misses them and captures mid-forward.

Upstream: https://github.com/vllm-project/vllm/pull/43160 ("[MRV2][BugFix] Fix default-stream CG capture in
P/W LoRA case", commit 39bba710bed5b6018718af3e0fd7984f6082118e; issue
https://github.com/vllm-project/vllm/issues/42999).
Symptom: Model Runner V2 with ``--enable-lora`` and PIECEWISE CUDA graphs crashes at the first served step:
"CUDA graphs must be captured on a non-default stream."; the LoRA graphs captured at startup are never replayed.
Mechanism: ``ModelCudaGraphManager.capture(..., has_lora=True)`` runs, inside ``graph_capture()`` (a side
stream), ``create_forward_fn(desc)`` for each capture size: a warmup ``forward_fn(CUDAGraphMode.NONE)``,
then ``forward_fn(CUDAGraphMode.PIECEWISE)``, whose forward context carried ``batch_descriptor =
BatchDescriptor(num_tokens=num_tokens)``: ``has_lora`` left at False. The piecewise backend
``CUDAGraphWrapper.__call__`` looks the descriptor up in ``concrete_cudagraph_entries``; on a miss it makes
an entry and captures ``torch.cuda.graph(cudagraph, pool, stream=current_stream())``, so the LoRA graphs
were stored under ``(num_tokens, has_lora=False)``. ``execute_model`` builds ``BatchDescriptor(num_tokens=
padded, has_lora=self.lora_config is not None)``, i.e. ``has_lora=True``: a miss, so the wrapper captures
again in the middle of a normal forward, on the default stream, which CUDA refuses.
Doctor: warmup-divergence, at ``forward_fn`` (the capture pass keyed its graphs with ``has_lora=False``;
a serving step decides ``has_lora=True``, so what capture prepared is never found).
Fix (upstream): ``forward_fn`` builds ``BatchDescriptor(num_tokens=num_tokens, has_lora=has_lora)``:
capture and serving keys agree and serving replays the startup graphs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/43160"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_fn"
SYMPTOM = "MRV2 + LoRA + PIECEWISE graphs: first served step tries a capture on the default stream and crashes"

VOCAB, DIM, RANK, MAX_LORAS = 16, 4, 2, 2
CAPTURE_SIZES = [2, 4]
MAX_NUM_TOKENS = max(CAPTURE_SIZES)


class CUDAGraphMode(enum.Enum):
    NONE, PIECEWISE, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0


@dataclasses.dataclass
class ForwardContext:
    cudagraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None


_FORWARD_CONTEXT: list[ForwardContext | None] = [None]
DEFAULT_STREAM, _CURRENT_STREAM = "default stream", ["default stream"]


def current_stream() -> str:
    return _CURRENT_STREAM[0]


@contextlib.contextmanager
def graph_capture():
    """vllm.distributed.parallel_state.graph_capture: ``with torch.cuda.stream(torch.cuda.Stream())``."""
    prev, _CURRENT_STREAM[0] = _CURRENT_STREAM[0], "graph capture stream"
    try:
        yield
    finally:
        _CURRENT_STREAM[0] = prev


@contextlib.contextmanager
def set_forward_context(num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None):
    _FORWARD_CONTEXT[0] = ForwardContext(cudagraph_runtime_mode,
                                         batch_descriptor or BatchDescriptor(num_tokens=num_tokens))
    try:
        yield
    finally:
        _FORWARD_CONTEXT[0] = None


@dataclasses.dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: object = None
    output: torch.Tensor | None = None


class CUDAGraphWrapper:
    """The piecewise backend: capture on a new key, replay on a known one."""

    def __init__(self, runnable, runtime_mode: CUDAGraphMode, device):
        self.runnable, self.runtime_mode, self.device = runnable, runtime_mode, device
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}

    def __call__(self, *args):
        ctx = _FORWARD_CONTEXT[0]
        if ctx is None or ctx.cudagraph_runtime_mode != self.runtime_mode:      # NONE: profile/warmup/eager
            return self.runnable(*args)
        key = ctx.batch_descriptor
        entry = self.concrete_cudagraph_entries.setdefault(key, CUDAGraphEntry(key))
        if entry.cudagraph is None:
            # torch.cuda.graph(cudagraph, pool=self.graph_pool, stream=current_stream()): capture_begin
            # refuses the default stream
            if current_stream() == DEFAULT_STREAM:
                raise RuntimeError("CUDA graphs must be captured on a non-default stream. (However, after "
                                   "capture, it's ok to replay them on the default stream.)")
            entry.cudagraph, entry.output = capture(lambda: self.runnable(*args), device=self.device, warmups=0,
                                                    name=f"PIECEWISE {key}", owner="CUDAGraphWrapper")
            return entry.output
        return replay(entry.cudagraph, entry.output)


class LoRALinearPiece:
    """The compiled piece (up to the first splitting op): embedding, base projection and the LoRA delta
    selected per token by ``token_lora_mapping`` (slot 0 of the stacked weights is "no adapter")."""

    def __init__(self, gen, device):
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.weight = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        a, b = torch.randn(MAX_LORAS, RANK, DIM, generator=gen), torch.randn(MAX_LORAS, DIM, RANK, generator=gen)
        self.lora_a = torch.cat([torch.zeros(1, RANK, DIM), a]).to(device)
        self.lora_b = torch.cat([torch.zeros(1, DIM, RANK), b]).to(device)

    def __call__(self, input_ids, token_lora_mapping):
        x = self.embed[input_ids]
        slot = (token_lora_mapping + 1).long()                    # slot 0: no adapter
        shrink = torch.einsum("td,trd->tr", x, self.lora_a[slot])
        return x @ self.weight.T + torch.einsum("tr,tdr->td", shrink, self.lora_b[slot])


class TinyModel:
    def __init__(self, device):
        self.piece = CUDAGraphWrapper(LoRALinearPiece(generator(43160), device), CUDAGraphMode.PIECEWISE, device)

    def __call__(self, input_ids, token_lora_mapping):
        return torch.tanh(self.piece(input_ids, token_lora_mapping))   # splitting op region: eager


class ModelCudaGraphManager:
    def __init__(self, variant, device):
        self.variant, self.device = variant, device

    def capture(self, model, input_buffers, has_lora: bool = False):
        with graph_capture():
            for num_tokens in sorted(CAPTURE_SIZES, reverse=True):
                def forward_fn(cg_mode: CUDAGraphMode, num_tokens=num_tokens) -> None:
                    batch_descriptor = None
                    if cg_mode == CUDAGraphMode.PIECEWISE:
                        batch_descriptor = (BatchDescriptor(num_tokens=num_tokens, has_lora=has_lora)
                                            if self.variant == "fix" else BatchDescriptor(num_tokens=num_tokens))
                    with set_forward_context(num_tokens, cg_mode, batch_descriptor):
                        model(*(buf[:num_tokens] for buf in input_buffers.values()))
                with events.warmup():
                    forward_fn(CUDAGraphMode.NONE)
                forward_fn(CUDAGraphMode.PIECEWISE)


class GPUModelRunner:
    def __init__(self, variant, device, enforce_eager=False):
        self.device, self.enforce_eager, self.lora_config = device, enforce_eager, {"max_loras": MAX_LORAS}
        self.model = TinyModel(device)
        self.input_buffers = {"input_ids": torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device),
                              "token_lora_mapping": torch.full((MAX_NUM_TOKENS,), -1, dtype=torch.int32, device=device)}
        events.static_buffers("GPUModelRunner", self.input_buffers)
        self.cudagraph_manager = ModelCudaGraphManager(variant, device)

    def capture_model(self):
        self.cudagraph_manager.capture(self.model, self.input_buffers, has_lora=self.lora_config is not None)

    def execute_model(self, token_ids, lora_ids):
        n = len(token_ids)
        padded = n if self.enforce_eager else next(s for s in CAPTURE_SIZES if s >= n)
        self.input_buffers["input_ids"].zero_()
        self.input_buffers["token_lora_mapping"].fill_(-1)
        self.input_buffers["input_ids"][:n] = torch.tensor(token_ids, device=self.device)
        self.input_buffers["token_lora_mapping"][:n] = torch.tensor(lora_ids, dtype=torch.int32, device=self.device)
        mode = CUDAGraphMode.NONE if self.enforce_eager else CUDAGraphMode.PIECEWISE
        batch_descriptor = BatchDescriptor(num_tokens=padded, has_lora=self.lora_config is not None)
        with set_forward_context(padded, mode, batch_descriptor):
            out = self.model(*(buf[:padded] for buf in self.input_buffers.values()))
        return out[:n].clone()


# (tokens, adapter per token; -1 = none)
STEPS = [([3, 5, 7], [0, -1, 1]), ([4, 9], [1, 1]), ([8, 1, 11, 13], [-1, 0, 0, 1]), ([2], [-1])]


def run(variant: str, device: str = "cpu"):
    def eager():
        runner = GPUModelRunner(variant, device, enforce_eager=True)
        return [runner.execute_model(t, m) for t, m in STEPS]

    def served():
        runner = GPUModelRunner(variant, device)
        runner.capture_model()
        return [runner.execute_model(t, m) for t, m in STEPS]

    return compare("vllm_43160_mrv2_piecewise_key_without_has_lora_recaptures_on_default_stream", variant, device,
                   served, eager)
