"""A graph runner restores buffers by position after a warmup that registered new ones: inference graphs break.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4504 ("Fix conflict with inference graphs"): "#4433
and #4440 were merged 15 minutes apart. They had an un-noticed conflict. Inference CUDA graphs are
broken as a result."
Symptom: "Inference CUDA graphs are broken" (April 2026 main): dynamic inference of a hybrid MoE model
with ``full_iteration_inference`` CUDA graphs; eager inference is unaffected. Here creating the graph
raises.
Mechanism: #4433 made ``_CudaGraphRunner.create_fwd_graph`` back up every buffer of its base module
(``buffer_backup = [buf.clone() for buf in self.base_module.buffers()]``) before the warmup passes and,
after the capture, restore them by position: ``for buf_copy, buf in zip(buffer_backup,
self.base_module.buffers()): buf.copy_(buf_copy)`` (so that a training warmup cannot leave its updates in
the router's ``expert_bias``). #4440 made the whole ``HybridModel`` the base module of the inference
graph. In inference the first forward ever is that graph's warmup, and ``InferenceGroupedMLP.forward``
lazily runs ``_build_concatenated_weights`` there, which registers two new buffers, ``_fc1_weight`` and
``_fc2_weight``, in each MoE layer's experts. The list taken before the warmup no longer lines up with
``buffers()`` after it: the backup of layer 1's router buffers is copied into layer 0's stacked expert
weights, whose shape it does not match (a broadcast error; where a shape happened to broadcast, the expert
weights would be overwritten with router statistics).
Doctor: warmup-divergence, at ``create_fwd_graph`` (it restores a buffer list it took before the warmup,
whose lazy initialisation registered new buffers, by position).
Fix (upstream): back up and restore buffers (like the grads) only ``if self.training and
torch.is_grad_enabled()``: "Inference is not affected (no known buffer mutators) and would add new buffers
(lazy MoE _fc1_weight/_fc2_weight) that misalign the positional restore."
(Read: the diff and description of #4504, the ``create_fwd_graph`` and ``InferenceGroupedMLP`` code before
it, and #4440's diff. The error message is what PyTorch raises for the misaligned ``copy_``; the upstream
report only says the graphs are broken.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4504"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "create_fwd_graph"
SYMPTOM = "creating full-iteration inference graphs of a hybrid MoE model fails: buffer backup restored out of place"
VOCAB, HIDDEN, FFN, NUM_EXPERTS, TOPK, NUM_LAYERS, TOKENS, STEPS = 10, 6, 5, 4, 2, 2, 3, 3


class TopKRouter(torch.nn.Module):
    """Sigmoid routing with an expert bias (``moe_router_enable_expert_bias``)."""

    def __init__(self, gen, device):
        super().__init__()
        self.weight = torch.nn.Parameter(randn(NUM_EXPERTS, HIDDEN, gen=gen, device=device, scale=0.5))
        self.register_buffer('local_tokens_per_expert', torch.zeros(NUM_EXPERTS, device=device),
                             persistent=False)
        self.register_buffer('expert_bias', randn(NUM_EXPERTS, gen=gen, device=device, scale=0.2))

    def forward(self, hidden):
        scores = torch.sigmoid(hidden @ self.weight.t())
        _, top_indices = torch.topk(scores + self.expert_bias, TOPK, dim=-1)
        probs = scores.gather(-1, top_indices)
        return probs / probs.sum(-1, keepdim=True), top_indices


class GroupedLinear(torch.nn.Module):
    """TE ``GroupedLinear``: one weight per expert (``weight0``, ``weight1``, ...)."""

    def __init__(self, out_features, in_features, gen, device):
        super().__init__()
        for i in range(NUM_EXPERTS):
            setattr(self, f'weight{i}', torch.nn.Parameter(randn(out_features, in_features, gen=gen,
                                                                  device=device, scale=0.5)))


class InferenceGroupedMLP(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.linear_fc1 = GroupedLinear(FFN, HIDDEN, gen, device)
        self.linear_fc2 = GroupedLinear(HIDDEN, FFN, gen, device)
        self._concatenated_weights_built = False

    def _build_concatenated_weights(self):
        """Stack the per-expert weights into contiguous buffers that share storage with the params."""
        weight0 = self.linear_fc1.weight0
        _fc1_weight = torch.empty(NUM_EXPERTS, *weight0.shape, device=weight0.device, dtype=weight0.dtype)
        _fc2_weight = torch.empty(NUM_EXPERTS, *self.linear_fc2.weight0.shape, device=weight0.device,
                                  dtype=weight0.dtype)
        for i in range(NUM_EXPERTS):
            fc1_param = getattr(self.linear_fc1, f'weight{i}')
            fc2_param = getattr(self.linear_fc2, f'weight{i}')
            _fc1_weight[i].copy_(fc1_param.data)
            _fc2_weight[i].copy_(fc2_param.data)
            fc1_param.data = _fc1_weight[i]
            fc2_param.data = _fc2_weight[i]
        self.register_buffer('_fc1_weight', _fc1_weight, persistent=False)
        self.register_buffer('_fc2_weight', _fc2_weight, persistent=False)

    def forward(self, hidden, probs, top_indices):
        # Lazily build concatenated weights on first forward (after checkpoint load)
        if not self._concatenated_weights_built:
            self._build_concatenated_weights()
            self._concatenated_weights_built = True
        fc1 = torch.relu(torch.einsum('th,efh->tef', hidden, self._fc1_weight))
        expert_out = torch.einsum('tef,ehf->teh', fc1, self._fc2_weight)          # every expert, every token
        chosen = expert_out.gather(1, top_indices[:, :, None].expand(-1, -1, HIDDEN))
        return (chosen * probs[:, :, None]).sum(1)


class MoELayer(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.router = TopKRouter(gen, device)
        self.experts = InferenceGroupedMLP(gen, device)

    def forward(self, hidden):
        probs, top_indices = self.router(hidden)
        return hidden + self.experts(hidden, probs, top_indices)


class HybridModel(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(4504)
        self.embedding = torch.nn.Parameter(randn(VOCAB, HIDDEN, gen=gen, device=device))
        self.layers = torch.nn.ModuleList(MoELayer(gen, device) for _ in range(NUM_LAYERS))
        self.output_layer = torch.nn.Parameter(randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5))

    def forward(self, input_ids):
        hidden = self.embedding[input_ids]
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden @ self.output_layer


class _CudaGraphRunner:
    def __init__(self, base_module, device, variant, num_warmup_steps=2):
        self.base_module, self.device, self.variant = base_module, device, variant
        self.training = base_module.training
        self.num_warmup_steps = num_warmup_steps
        self.fwd_graph = None

    def create_fwd_graph(self, input_ids):
        self.fwd_graph_input_ids = input_ids.clone()
        # Save buffers, grads, and other variables that may be affected by graph warmup.
        backup = self.variant == "bug" or (self.training and torch.is_grad_enabled())
        buffer_backup = [buf.clone() for buf in self.base_module.buffers()] if backup else []

        self.fwd_graph, self.fwd_graph_outputs = capture(
            lambda: self.base_module(self.fwd_graph_input_ids), device=self.device,
            warmups=self.num_warmup_steps, name="full_iteration_inference", owner="CudaGraphManager",
            static={"input_ids": self.fwd_graph_input_ids})

        # restore cached buffers
        for buf_copy, buf in zip(buffer_backup, self.base_module.buffers()):
            buf.copy_(buf_copy)

    def replay_graph_capture(self, input_ids):
        self.fwd_graph_input_ids.copy_(input_ids)
        return replay(self.fwd_graph, self.fwd_graph_outputs)


class CudaGraphManager:
    """``full_iteration_inference`` scope: one runner whose base module is the whole ``HybridModel``."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.runner = None

    def __call__(self, megatron_module, input_ids):
        if self.runner is None:
            self.runner = _CudaGraphRunner(megatron_module, self.device, self.variant)
            self.runner.create_fwd_graph(input_ids)
        return self.runner.replay_graph_capture(input_ids)


def run(variant: str, device: str = "cpu"):
    gen = generator(4440)
    steps = [torch.randint(0, VOCAB, (TOKENS,), generator=gen).to(device) for _ in range(STEPS)]

    def served():
        model = HybridModel(device).eval()
        manager = CudaGraphManager(device, variant)
        with torch.no_grad():
            return [manager(model, input_ids).clone() for input_ids in steps]

    def eager():
        model = HybridModel(device).eval()
        with torch.no_grad():
            return [model(input_ids).clone() for input_ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
