"""Qwen3.5 hybrid decode graphs cannot be captured: the attention-metadata builder copies the host linear-state mask to the device inside the capture.

Upstream: https://github.com/xLLM-AI/xllm/pull/2204 ("bugfix: avoid linear state h2d during graph capture.",
merged; backported to release/v0.11.0 as #2205).
Symptom: with ACL graphs on NPU, Qwen3.5 hybrid (Qwen3-Next style GDN + attention) and Qwen3.5 MTP execution
failed graph capture for every bucket ("the Ascend runtime rejects" the synchronous H2D ``aclrtMemcpy`` on the
captured stream) and fell back to eager execution.
Mechanism: ``Qwen3HybridModelImplBase::forward`` (and ``Qwen3_5MtpModelImplBase``) calls
``AttentionMetadataBuilder::build(input_params, ...)`` inside the captured forward. ``build_attention_metadata``
ends with ``materialize_linear_state_validity(params, device, attn_metadata)``, which, after validating the
host ``linear_state_validity_mask`` against the metadata rows, materialises it as a device bool tensor
(``has_initial_states``): a synchronous host-to-device copy of pageable host memory, issued on the capturing
stream. The native NPU GDN kernel never reads that device tensor: it consumes the canonical host mask (here:
the graph's persistent ``has_initial_state`` parameter, refreshed from the host mask before every replay).
Doctor: sync-in-capture, at materialize_linear_state_validity (the blocking H2D copy of the host mask).
Fix (upstream): ``AttentionMetadataBuildOptions{materialize_linear_state_validity}``; the Qwen hybrid / MTP
forwards pass ``materialize_linear_state_validity = !input_params.enable_graph`` on NPU, so the builder
still validates the mask but returns before the device copy when building for a graph.
The C++ is modelled in Python; the GDN layer is a one-head gated-delta-like recurrence at tiny sizes.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/2204"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "materialize_linear_state_validity"
SYMPTOM = "ACL graph capture of Qwen3.5 hybrid/MTP decode fails on a synchronous H2D copy of the linear-state mask"

VOCAB, DIM, NUM_SLOTS, BATCH = 12, 4, 4, 2


@dataclasses.dataclass
class AttentionMetadataBuildOptions:
    materialize_linear_state_validity: bool = True


@dataclasses.dataclass
class ModelInputParams:
    linear_state_indices: torch.Tensor          # device, [batch]
    linear_state_validity_mask: torch.Tensor    # host (CPU) 0/1 mask, [batch]: the canonical source of truth
    enable_graph: bool = False


@dataclasses.dataclass
class AttentionMetadata:
    is_prefill: bool = False
    num_rows: int = 0
    has_initial_states: torch.Tensor | None = None


def materialize_linear_state_validity(params, device, build_options, attn_metadata):
    mask = params.linear_state_validity_mask
    if mask.shape[0] != attn_metadata.num_rows:   # canonical mask validation (kept by the fix)
        raise ValueError(f"linear_state_validity_mask rows={mask.shape[0]}, metadata_rows={attn_metadata.num_rows}")
    if not build_options.materialize_linear_state_validity:
        return
    # CPU mask -> device bool tensor: a synchronous H2D copy (aclrtMemcpy) on the current stream.
    attn_metadata.has_initial_states = mask.to(device)


def build_attention_metadata(params, device, build_options):
    attn_metadata = AttentionMetadata(is_prefill=False, num_rows=params.linear_state_indices.shape[0])
    materialize_linear_state_validity(params, device, build_options, attn_metadata)
    return attn_metadata


class Qwen3HybridModelImplBase:
    """Embedding -> one GDN (linear attention) layer with a recurrent state per slot -> projection."""

    def __init__(self, device, variant):
        gen = generator(2204)
        self.device, self.variant = device, variant
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.decay = torch.tensor(0.7, device=device)

    def gdn(self, h, ssm_state, state_indices, has_initial_state):
        """Native GDN: the recurrent state starts from zero where the slot holds no valid state."""
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        prev = ssm_state[state_indices] * has_initial_state[:, None, None]
        new = self.decay * prev + k[:, :, None] * v[:, None, :]
        ssm_state[state_indices] = new
        return (q[:, None, :] @ new).squeeze(1)

    def forward(self, tokens, input_params, ssm_state, has_initial_state):
        metadata_build_options = AttentionMetadataBuildOptions()
        if self.variant == "fix":
            # Native NPU GDN consumes the canonical host mask directly. Avoid materializing the unused
            # device bool tensor inside ACL graph capture.
            metadata_build_options.materialize_linear_state_validity = not input_params.enable_graph
        attn_metadata = build_attention_metadata(input_params, self.device, metadata_build_options)
        assert not attn_metadata.is_prefill
        h = self.emb[tokens]
        return self.gdn(h, ssm_state, input_params.linear_state_indices, has_initial_state) @ self.wo


class Executor:
    """Decode steps of a fixed batch; ``graphed`` captures one ACL/CUDA graph and replays it."""

    def __init__(self, model, device, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.ssm_state = torch.zeros(NUM_SLOTS, DIM, DIM, device=device)
        # persistent graph parameters (static inputs)
        self.tokens = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.state_indices = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.has_initial_state = torch.zeros(BATCH, device=device)
        self.graph = None

    def _host_mask(self, valid):
        # the canonical host mask, built by the batch builder (pageable host memory)
        return host(torch.tensor(valid, dtype=torch.float32), self.device).clone()

    def _stage(self, tokens, slots, valid):
        mask = self._host_mask(valid)
        self.tokens.copy_(torch.tensor(tokens, dtype=torch.long).to(self.device))
        self.state_indices.copy_(torch.tensor(slots, dtype=torch.long).to(self.device))
        self.has_initial_state.copy_(mask)          # persistent param refreshed from the host mask
        return ModelInputParams(self.state_indices, mask, enable_graph=self.graphed)

    def step(self, tokens, slots, valid):
        params = self._stage(tokens, slots, valid)
        if not self.graphed:
            return self.model.forward(self.tokens, params, self.ssm_state, self.has_initial_state).clone()
        if self.graph is None:
            self.graph, self.out = capture(
                lambda: self.model.forward(self.tokens, params, self.ssm_state, self.has_initial_state),
                device=self.device, warmups=0, owner="AclGraphExecutor (Qwen3.5 hybrid decode)",
                static={"tokens": self.tokens, "linear_state_indices": self.state_indices,
                        "has_initial_state": self.has_initial_state},
                state={"ssm_state": self.ssm_state})
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    model = Qwen3HybridModelImplBase(device, variant)

    def serve(graphed: bool):
        ex = Executor(model, device, graphed)
        steps = [([3, 7], [1, 2], [0.0, 0.0]),      # fresh requests: no initial linear state
                 ([5, 2], [1, 2], [1.0, 1.0]),
                 ([9, 4], [1, 3], [1.0, 0.0]),      # slot 2's request finished; a new one in slot 3
                 ([1, 8], [1, 3], [1.0, 1.0])]
        return [ex.step(*s) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
