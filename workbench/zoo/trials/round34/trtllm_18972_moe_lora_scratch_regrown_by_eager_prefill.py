"""MoE LoRA device scratch reserved for decode capacity only: an eager prefill regrows it under a captured graph.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/18972 ("[None][fix] Stabilize MoE LoRA CUDA graph
scratch").
Symptom: routed-expert MoE LoRA (CUTLASS backend, device LoRA path) with CUDA graphs: decode steps replayed
from a captured graph after a long eager prefill no longer matched eager (illegal memory access / corrupt
LoRA deltas); the PR adds BF16 replay-vs-eager coverage with eager-prefill token capacities.
Mechanism: ``FusedMoeRunner`` (``moeOp.cpp``) keeps one persistent LoRA device scratch shared by all MoE
layers; ``ensureLoraDeviceScratch`` replaces it with a larger allocation whenever a forward needs more
tokens than ``mLoraDeviceScratchCapacity``. ``CudaGraphLoraManager._reserve_moe_lora_workspaces`` pre-sizes
it before capture so that "the buffer addresses baked into the graph remain valid across replays", but it
reserved only ``max_batch_size * max_tokens_per_seq`` tokens (the captured decode batches). Context requests
do not take the CUDA-graph LoRA path: a prefill of more tokens runs eagerly, ``ensureLoraDeviceScratch``
grows the scratch and the old allocation is released, while every captured decode graph still writes and
reads the LoRA intermediate (``x @ A``) through the old address. (The PR also makes ``moeOp.cpp`` fill the
whole pinned-host ``GemmCoord`` hint arrays; that half is not modelled here.)
Doctor: dangling-reference, at ``ensure_lora_device_scratch`` (the eager step's regrowth releases the
scratch that the captured decode graph still addresses).
Fix (upstream): ``CudaGraphLoraManager`` reserves the MoE LoRA workspace for the larger of the decode
capacity and the engine-wide ``max_num_tokens`` (now passed through ``make_cuda_graph_lora_manager`` and
model-engine initialisation), so no later eager forward grows it.
(Read: the ``cuda_graph_lora_manager.py`` hunk of the diff and the ``moeOp.cpp`` hint-fill hunk, plus the
description; ``ensureLoraDeviceScratch``'s grow-by-replacement is from the description and the capture guard
added in #14923. Tiny MoE: 4 experts, top-1, one LoRA slot table, decode graph for batch size 2.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/18972"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "ensure_lora_device_scratch"
SYMPTOM = "decode graph replays after a long eager prefill address a MoE LoRA scratch that was regrown and released"

HIDDEN, NUM_EXPERTS, MAX_RANK, NUM_SLOTS = 4, 4, 2, 2
MAX_BATCH_SIZE, MAX_TOKENS_PER_SEQ = 2, 1        # the captured decode graph: 2 sequences, 1 token each
MAX_NUM_TOKENS = 6                               # engine-wide token budget (prefill included)
CUDA_GRAPH_BATCH_SIZES = [2]


class FusedMoeRunner:
    """The op's runner (``moeOp.cpp``): one LoRA device scratch shared by every MoE layer."""

    def __init__(self, device):
        self.device = device
        self.lora_device_scratch_capacity = 0        # mLoraDeviceScratchCapacity, in tokens
        self.lora_device_scratch = None

    def ensure_lora_device_scratch(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > self.lora_device_scratch_capacity:
            numel = max(num_tokens * MAX_RANK, own_segment_elems(self.device))
            # Grow by replacement: the previous scratch is released here.
            self.lora_device_scratch = torch.empty(numel, device=self.device)
            self.lora_device_scratch_capacity = num_tokens
        return self.lora_device_scratch

    def run_moe(self, layer, x, token_to_slot):
        num_tokens = x.shape[0]
        expert = torch.argmax(x @ layer.router, dim=-1)                       # top-1 routing
        base = torch.bmm(x[:, None, :], layer.w_experts[expert]).squeeze(1)
        # Routed-expert LoRA: the rank-r intermediate goes through the persistent scratch.
        scratch = self.ensure_lora_device_scratch(num_tokens)
        inter = scratch[:num_tokens * MAX_RANK].view(num_tokens, MAX_RANK)
        inter.copy_(torch.bmm(x[:, None, :], layer.lora_a[token_to_slot, expert]).squeeze(1))
        delta = torch.bmm(inter[:, None, :], layer.lora_b[token_to_slot, expert]).squeeze(1)
        return base + delta


class Qwen3MoeLayer:
    def __init__(self, device, seed):
        gen = generator(seed)
        self.router = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device)
        self.w_experts = randn(NUM_EXPERTS, HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.lora_a = randn(NUM_SLOTS, NUM_EXPERTS, HIDDEN, MAX_RANK, gen=gen, device=device, scale=0.7)
        self.lora_b = randn(NUM_SLOTS, NUM_EXPERTS, MAX_RANK, HIDDEN, gen=gen, device=device, scale=0.7)


class Model:
    def __init__(self, device):
        self.runner = FusedMoeRunner(device)
        self.layers = [Qwen3MoeLayer(device, 18972 + i) for i in range(2)]

    def forward(self, hidden_states, token_to_slot):
        h = hidden_states
        for layer in self.layers:
            h = h + self.runner.run_moe(layer, h, token_to_slot)
        return h


class CudaGraphLoraManager:
    def __init__(self, model, variant, max_batch_size, max_tokens_per_seq, max_num_tokens):
        self.variant = variant
        self.max_batch_size, self.max_tokens_per_seq = max_batch_size, max_tokens_per_seq
        self.max_num_tokens = max_num_tokens
        self._reserve_moe_lora_workspaces(model)

    def _reserve_moe_lora_workspaces(self, model):
        """Reserve the MoE LoRA workspace once. Must happen before any CUDA graph capture so the
        buffer addresses baked into the graph remain valid across replays."""
        max_num_tokens = self.max_batch_size * self.max_tokens_per_seq     # worst-case captured forward
        if self.variant == "fix":
            # Captured decode and eager prefill share the scratch: reserve for both.
            max_num_tokens = max(max_num_tokens, self.max_num_tokens)
        model.runner.ensure_lora_device_scratch(max_num_tokens)


def run(variant: str, device: str = "cpu"):
    gen = generator(7)
    # (kind, token -> LoRA slot): decode batches of 2 sequences, one 5-token eager prefill between them.
    steps = [("decode", [0, 1]), ("prefill", [1, 1, 1, 1, 1]), ("decode", [1, 0]), ("decode", [0, 0])]
    hidden = [randn(len(s), HIDDEN, gen=gen, device=device) for _, s in steps]
    slot = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)   # noqa: E731

    def eager():
        model = Model(device)
        CudaGraphLoraManager(model, variant, MAX_BATCH_SIZE, MAX_TOKENS_PER_SEQ, MAX_NUM_TOKENS)
        return [model.forward(h, slot(s)).clone() for (_, s), h in zip(steps, hidden)]

    def served():
        model = Model(device)
        CudaGraphLoraManager(model, variant, MAX_BATCH_SIZE, MAX_TOKENS_PER_SEQ, MAX_NUM_TOKENS)
        bs = CUDA_GRAPH_BATCH_SIZES[0]
        input_hidden = torch.zeros(bs, HIDDEN, device=device)
        token_to_slot = torch.zeros(bs, dtype=torch.long, device=device)
        g, out = capture(lambda: model.forward(input_hidden, token_to_slot), device=device,
                         name=f"generation bs {bs}", owner="CUDAGraphRunner",
                         static={"hidden_states": input_hidden, "token_to_slot": token_to_slot})
        outs = []
        for (kind, s), h in zip(steps, hidden):
            if kind == "decode" and len(s) in CUDA_GRAPH_BATCH_SIZES:
                input_hidden.copy_(h)
                token_to_slot.copy_(slot(s))
                outs.append(replay(g, out).clone())
            else:                             # context requests: no LoRA CUDA-graph path, eager
                outs.append(model.forward(h, slot(s)).clone())
                release_to_driver(device)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
