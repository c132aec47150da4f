"""Megatron's local CUDA-graph manager never sets ``is_first_microbatch``: replays never refresh the FP8 weight cache.

Upstream: https://github.com/NVIDIA/Megatron-LM/commit/323051030e5f921a6ce1d9e0b5ad7e71d96da7c7
(ADLR/megatron-lm!3880, "Fix is_first_microbatch not correctly set with cuda graph enabled").
Symptom: FP8 training with FP8 weight caching and Megatron-Core's local CUDA graphs
(``--cuda-graph-impl local``) runs every replayed forward with the FP8 weights quantized when the graphs
were warmed up: optimizer updates never reach the graphed layers' GEMMs, so the loss curve drifts from
eager (Megatron-LM main, September 2025).
Mechanism: with FP8 weight caching a TE linear re-quantizes its weight into a persistent FP8 workspace only
on an iteration's first microbatch; under a CUDA graph that decision is the device flag
``skip_fp8_weight_update``, which ``_CudagraphReplayNode.forward`` fills with ``not is_first_microbatch``
before each replay and the captured cast kernel reads as its noop flag. ``CudaGraphManager.__init__`` set
``self.is_first_microbatch = False`` and nothing ever updated it, because ``TransformerLayer.__call__`` sends
graphed layers to the manager instead of the eager path that passes ``current_microbatch == 0``. Every replay
therefore skips the re-quantization, and the GEMMs keep reading the workspace that the graph warmup filled
from the weights of that time.
Doctor: stale-input, at ``forward`` (TE ``Linear.forward``: the GEMM reading the FP8 workspace the
replays never refresh).
Fix (upstream): ``TransformerLayer.__call__`` calls
``cudagraph_manager.set_is_first_microbatch(current_microbatch == 0)`` before dispatching to the manager
(which also calls the module's ``set_is_first_microbatch()``), so the flag the replay node writes is
``False`` on each iteration's first microbatch and the graph re-quantizes the updated weights.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/commit/323051030e5f921a6ce1d9e0b5ad7e71d96da7c7"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "forward"
SYMPTOM = "replayed GEMMs keep the FP8 weights quantized at graph warmup; optimizer updates are ignored"
TOKENS, DIM, ITERATIONS, MICROBATCHES, LR = 4, 4, 4, 2, 0.25
FP8_STEP = 1.0 / 8.0          # the emulated FP8 grid (a coarse uniform grid keeps the numbers exact)


def quantize(weight):
    """Cast to the emulated FP8 format (TE's cast kernel)."""
    return torch.round(weight / FP8_STEP) * FP8_STEP


class FP8GlobalStateManager:
    """TE's global FP8 state: the graph-safe ``skip_fp8_weight_update`` flag and whether a graph is
    being warmed up / captured (``fp8_autocast(_graph=True)``)."""

    skip_fp8_weight_update_tensor = None
    _graph_capturing = False

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        cls.skip_fp8_weight_update_tensor.fill_(1.0 if skip else 0.0)

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        return cls.skip_fp8_weight_update_tensor

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls._graph_capturing

    @classmethod
    @contextlib.contextmanager
    def graph_capture(cls):
        cls._graph_capturing = True
        try:
            yield
        finally:
            cls._graph_capturing = False


class Linear(torch.nn.Module):
    """TE ``Linear`` with FP8 weight caching: the FP8 copy of the weight lives in a workspace that is
    refreshed on the first microbatch of an iteration and reused by the others."""

    def __init__(self, device):
        super().__init__()
        gen = generator(3880)
        self.weight = torch.nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=0.5))
        self.weight_workspace = quantize(self.weight.detach())          # the cached FP8 weight

    def forward(self, inp, is_first_microbatch=None):
        skip_fp8_weight_update = (FP8GlobalStateManager.get_skip_fp8_weight_update_tensor()
                                  if FP8GlobalStateManager.fp8_graph_capturing() else None)
        with torch.no_grad():
            if skip_fp8_weight_update is not None:
                # graph-safe path: the cast kernel always runs and reads the noop flag on the device
                fresh = quantize(self.weight)
                self.weight_workspace.copy_(torch.where(skip_fp8_weight_update.bool(), self.weight_workspace, fresh))
            elif is_first_microbatch is None or is_first_microbatch:
                self.weight_workspace.copy_(quantize(self.weight))
            return inp @ self.weight_workspace                           # FP8 GEMM


class CudaGraphManager:
    """Megatron-Core's local CUDA-graph manager for one layer: the first iteration runs eagerly (while
    recording), ``create_cudagraphs()`` warms up and captures, later microbatches replay. Before each
    replay the replay node writes the weight-update flag from ``self.is_first_microbatch``."""

    def __init__(self, module, device):
        self.module = module
        self.is_first_microbatch = False
        self.hidden_states = torch.zeros(TOKENS, DIM, device=device)           # the graph's input buffer
        FP8GlobalStateManager.skip_fp8_weight_update_tensor = torch.zeros(1, device=device)
        self.manager = GraphManager(lambda size: self.module(self.hidden_states[:size]), [TOKENS],
                                    device=device, mode=CUDAGraphMode.FULL, num_warmups=2,
                                    static_buffers={"hidden_states": self.hidden_states,
                                                    "skip_fp8_weight_update":
                                                        FP8GlobalStateManager.skip_fp8_weight_update_tensor},
                                    name="Megatron CudaGraphManager")

    def set_is_first_microbatch(self, is_first_microbatch: bool) -> None:
        self.is_first_microbatch = is_first_microbatch

    def create_cudagraphs(self):
        events.persistent_state("TE Linear", {"weight_workspace": self.module.weight_workspace})
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)       # _CudaGraphRunner.__init__
        with FP8GlobalStateManager.graph_capture():
            self.manager.capture()

    def __call__(self, hidden_states):
        # _CudagraphReplayNode.forward: copy the input, set the flag, replay
        self.hidden_states.copy_(hidden_states)
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not self.is_first_microbatch)
        return self.manager.replay(TOKENS, TOKENS)


class TransformerLayer:
    def __init__(self, device, variant):
        self.linear = Linear(device)
        self.cudagraph_manager = None
        self.current_microbatch = 0
        self.variant = variant

    def forward(self, hidden_states):
        return self.linear(hidden_states, is_first_microbatch=self.current_microbatch == 0)

    def __call__(self, hidden_states):
        if self.cudagraph_manager is not None:
            if self.variant == "fix":
                self.cudagraph_manager.set_is_first_microbatch(self.current_microbatch == 0)
            return self.cudagraph_manager(hidden_states)
        return self.forward(hidden_states)


def data(device):
    gen = generator(1)
    return [[(randn(TOKENS, DIM, gen=gen, device=device), randn(TOKENS, DIM, gen=gen, device=device))
             for _ in range(MICROBATCHES)] for _ in range(ITERATIONS)]


def run(variant: str, device: str = "cpu"):
    batches = data(device)

    def train(graphed: bool):
        layer, outs = TransformerLayer(device, variant), []
        for iteration, microbatches in enumerate(batches):
            if graphed and iteration == 1:               # create_cudagraphs() after the first iteration
                layer.cudagraph_manager = CudaGraphManager(layer.linear, device)
                layer.cudagraph_manager.create_cudagraphs()
            wgrad = torch.zeros(DIM, DIM, device=device)
            for mb, (x, target) in enumerate(microbatches):
                layer.current_microbatch = mb
                y = layer(x).clone()
                outs.append(y)
                wgrad += x.t() @ (y - target)          # backward of 0.5 * ||y - target||^2 (eager here)
            with torch.no_grad():                       # optimizer step on the master weight, in place
                layer.linear.weight.sub_(LR * wgrad / MICROBATCHES)
        return outs + [layer.linear.weight.detach().clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
