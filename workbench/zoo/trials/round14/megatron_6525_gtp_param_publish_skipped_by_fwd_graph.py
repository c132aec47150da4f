"""A forward graph skips the GTP "ensure params ready" step: replays read last step's gathered weights.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/6525 ("fix: ensure GTP params are ready before CUDA
graph replay").
Symptom: with generalized tensor parallelism (GTP, sharded parameters gathered asynchronously) and
Megatron's local CUDA graphs, the forward graphs of later iterations compute with weights that lag the
optimizer by a step; training silently diverges from the ungraphed run (Megatron core, August 2026).
Mechanism: a ``GTPShardedParam`` is all-gathered asynchronously after the optimizer updates its shard;
the gathered weight is published into the buffer the GEMM reads by ``ensure_params_ready(weights)``,
which the forward calls just before using the weight. That call is host-side bookkeeping: it looks at
which params still have a pending gather and only then waits and publishes. The runner captures the
forward after warmup, when nothing is pending, so the capture records no publish at all; on replay the
Python call does not run, the pending gathers of the new step are never published, and the graph's GEMM
reads the weight buffer as the previous step left it. Eagerly the same forward publishes every step.
Doctor: stale-input, at ``ensure_params_ready`` (the publish of the gathered weight, a per-step refresh
of the buffer the graph reads, runs only where Python runs: never on replay).
Fix (upstream): during capture ``register_capture_params_to_ensure_ready(weights)`` records the GTP
params the graph reads (``_gtp_fwd_params_to_ensure_ready``), and the runner calls
``ensure_params_ready`` on them eagerly before every forward replay.
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/6525"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "ensure_params_ready"
SYMPTOM = "graphed forwards use weights one optimizer step old; training drifts from eager, no error"
HIDDEN, TOKENS, STEPS, LR = 4, 3, 4, 0.1

_ACTIVE_CAPTURE_PARAMS: list | None = None       # GTPCaptureCommState of the capture in progress


class GTPShardedParam:
    """A weight whose shard the optimizer updates; the full weight is gathered asynchronously and
    published into ``data`` (the buffer the GEMM reads) by ``ensure_params_ready``."""

    def __init__(self, shard):
        self.shard = shard                        # what the optimizer owns (world size 1 here)
        self.data = shard.clone()                 # published full weight: what the forward reads
        self.gather_buffer = torch.empty_like(shard)
        self.pending = False                      # host-side: an async all-gather awaits publication

    def start_param_gather(self):
        self.gather_buffer.copy_(self.shard)      # the async all-gather (lands in the gather buffer)
        self.pending = True


def ensure_params_ready(params):
    """Wait for pending gathers and publish them: host bookkeeping, then a copy only if pending."""
    for p in params:
        if p.pending:
            p.data.copy_(p.gather_buffer)
            p.pending = False


def register_capture_params_to_ensure_ready(params):
    if _ACTIVE_CAPTURE_PARAMS is not None:
        for p in params:
            if all(p is not q for q in _ACTIVE_CAPTURE_PARAMS):
                _ACTIVE_CAPTURE_PARAMS.append(p)


class GTPLinear:
    def __init__(self, weight, fixed):
        self.weight = GTPShardedParam(weight)
        self.fixed = fixed

    def forward(self, x):
        weights = [self.weight]
        if self.fixed:
            register_capture_params_to_ensure_ready(weights)
        ensure_params_ready(weights)
        return torch.tanh(x @ self.weight.data.t())


class _CudaGraphRunner:
    def __init__(self, module, device):
        self.module = module
        self.device = device
        self.static_input = torch.zeros(TOKENS, HIDDEN, device=device)
        self.fwd_graph = None
        self._gtp_fwd_params_to_ensure_ready = ()

    def __call__(self, x):
        global _ACTIVE_CAPTURE_PARAMS
        self.static_input.copy_(x)
        if self.fwd_graph is None:
            registered = []

            def fwd():
                return self.module.forward(self.static_input)
            events.persistent_state("_CudaGraphRunner (GTP)", {"weight.data": self.module.weight.data})
            _ACTIVE_CAPTURE_PARAMS = registered
            try:
                self.fwd_graph, self.static_output = capture(
                    fwd, device=self.device, static={"hidden_states": self.static_input},
                    owner="_CudaGraphRunner (GTP)")
            finally:
                _ACTIVE_CAPTURE_PARAMS = None
            self._gtp_fwd_params_to_ensure_ready = tuple(registered)
        ensure_params_ready(self._gtp_fwd_params_to_ensure_ready)      # empty before the fix
        return replay(self.fwd_graph, self.static_output)


def run(variant: str, device: str = "cpu"):
    gen = generator(6525)
    w0 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
    batches = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]
    target = randn(TOKENS, HIDDEN, gen=gen, device=device)
    fixed = variant == "fix"

    def train(graphed):
        layer = GTPLinear(w0.clone(), fixed)
        runner = _CudaGraphRunner(layer, device) if graphed else None
        outs = []
        for x in batches:
            y = runner(x).clone() if graphed else layer.forward(x)
            outs.append(y)
            # optimizer step on the shard (a fixed pseudo-gradient from this step's output), then
            # the async param gather for the next forward
            layer.weight.shard.sub_(LR * ((y - target).t() @ x) / TOKENS)
            layer.weight.start_param_gather()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
