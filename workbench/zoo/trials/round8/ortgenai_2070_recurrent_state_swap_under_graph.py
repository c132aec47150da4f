"""Recurrent past/present buffers swapped every step: the captured decode graph keeps the capture-time pair.

Upstream: https://github.com/microsoft/onnxruntime-genai/pull/2070 ("Enable CUDA graph capture for CUDA
EP to improve decode throughput", merged April 2026), change 3: "Fix ``RecurrentState::Update()`` for CUDA
graph compatibility. The original code used ``std::swap`` to alternate past/present buffers each decode
step, which changes memory addresses and invalidates the captured CUDA graph. When graph capture is
enabled, copy present->past in-place."
Symptom: hybrid recurrent models (Qwen3.5 linear-attention layers) with ``enable_cuda_graph=1`` on the
CUDA EP generate corrupted, repetitive text once decode steps are replayed.
Mechanism: each decode step binds ``past_recurrent_state`` as an input and ``present_recurrent_state`` as
an output; ``RecurrentState::Update`` then swaps the two buffers so the present becomes the next past.
ONNX Runtime captures the decode run once, with the buffer addresses bound at that step, and every replay
reads and writes those same two buffers whatever is bound later. After the first swap the replay reads
the buffer that now holds the state from two steps back and overwrites the one the host treats as past:
the recurrent state stops advancing.
Doctor: warmup-divergence, at ``Update`` (the swap that rebinds which tensor a step reads, while the graph
keeps the capture-time one).
Fix (upstream): with graph capture enabled, ``Update`` copies present into past in place, so the addresses
the graph was captured with stay the step's past and present.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime-genai/pull/2070"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "Update"
SYMPTOM = "linear-attention state stops advancing under graph replay: corrupted, repetitive generations"
DIM, STEPS, DECAY = 3, 5, 0.7


class LinearAttentionDecoder:
    """One decode run of the ONNX session: present = decay * past + k^T v; out = q @ present."""

    def __init__(self, device):
        gen = generator(2070)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(3))

    def run(self, input_embeds, past_state, present_state):
        q, k, v = input_embeds @ self.wq, input_embeds @ self.wk, input_embeds @ self.wv
        present_state.copy_(DECAY * past_state + k.T @ v)
        return q @ present_state


class RecurrentState:
    def __init__(self, device, use_graph_capture: bool, in_place: bool):
        self.past = torch.zeros(DIM, DIM, device=device)
        self.present = torch.zeros(DIM, DIM, device=device)
        self.use_graph_capture = use_graph_capture
        self.in_place = in_place

    def Update(self):
        if self.use_graph_capture and self.in_place:
            self.past.copy_(self.present)          # the fix: keep the addresses the graph holds
        else:
            self.past, self.present = self.present, self.past      # std::swap


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    tokens = [randn(1, DIM, gen=gen, device=device) for _ in range(STEPS)]
    decoder = LinearAttentionDecoder(device)

    def eager():
        state, outs = RecurrentState(device, use_graph_capture=False, in_place=False), []
        for x in tokens:
            outs.append(decoder.run(x, state.past, state.present).clone())
            state.Update()
        return outs

    def served():
        state = RecurrentState(device, use_graph_capture=True, in_place=(variant == "fix"))
        input_embeds = torch.zeros(1, DIM, device=device)        # graph-capture input buffer
        outs, graph = [], None
        for step, x in enumerate(tokens):
            input_embeds.copy_(x)
            if step == 0:                                        # a regular run before capture
                outs.append(decoder.run(input_embeds, state.past, state.present).clone())
            else:
                if graph is None:                                # captured on this run, then replayed
                    past, present = state.past, state.present    # the buffers bound at this step
                    graph = capture(lambda: decoder.run(input_embeds, past, present), device=device,
                                    warmups=0, name="decoder", static={"input_embeds": input_embeds},
                                    state={"recurrent_state_0": state.past, "recurrent_state_1": state.present},
                                    owner="onnxruntime-genai State::Run")
                g, out = graph
                outs.append(replay(g, out).clone())
            state.Update()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
