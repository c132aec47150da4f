"""The routed-experts output of a graphed decode step is a view of the graph's static buffer; the next step's replay rewrites it before it is read.

Upstream: https://github.com/InternLM/lmdeploy/commit/7b0c0c43caada25b91769b30ebc8f423e60d67f9 ("clone experts from
cudagraph buffer"), squashed into https://github.com/InternLM/lmdeploy/pull/4090 ("[Feature]: return routed experts
to reuse"); https://github.com/InternLM/lmdeploy/pull/4149 later moved the clone into ``CudaGraphMixin``.
Symptom: with CUDA-graph decode running several steps per forward task, the routed-expert ids returned for RL router
replay are those of a later step; the generated tokens are right (found by the developer, no user report).
Mechanism: ``Qwen3MoeForCausalLM.make_buffers_cudagraph`` adds ``input_buffers['all_routed_experts']``
([max_tokens, num_layers, topk], int16); ``fill_buffers_cudagraph`` passes it to ``forward``, where every MoE
block writes ``all_routed_experts[:, self.layer_idx, :] = topk_ids`` inside the graph, and the forward returns it,
so it is also ``output_buffers['all_routed_experts']``. After each replay ``get_outputs_cudagraph`` returned
``output_buffers['all_routed_experts'][:num_tokens, ...]``: a view of that static buffer. ``BaseModelAgent._async_step``
stores it (``extra_inputs.all_routed_experts = output.get('all_routed_experts')``), pushes ``BatchedOutputs`` (via
``make_extra_outputs``) on ``_out_que`` and loops to the next of its ``loop_count`` decode steps, whose replay
rewrites the buffer in place; ``get_output_async`` copies the queued outputs to the host (``to_cpu``) only later, and
``ARSequenceStrategy.update_running`` splits them per sequence. Here the consumer drains the queue after the task's
decode loop, so every step reports the last step's experts. Eager (``prepare_inputs_for_generation``) allocates a
fresh ``all_routed_experts`` per forward. Logits are computed from the hidden states at once, so tokens are right.
Doctor: overwritten-output, at get_outputs_cudagraph (it hands out a view of the graph's static experts buffer, read
after later replays of the same graph have overwritten it).
Fix (upstream): ``get_outputs_cudagraph`` returns ``output_buffers['all_routed_experts'][:num_tokens, ...].clone()``;
the experts also move off ``ARExtraInputs``/``ARExtraOutputs`` (carried to the next step) onto a dedicated
``BatchedOutputs.all_routed_experts`` field, read by ``ARSequenceStrategy.update_running``.
"""
from __future__ import annotations

import collections
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/commit/7b0c0c43caada25b91769b30ebc8f423e60d67f9"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "get_outputs_cudagraph"
SYMPTOM = "router replay gets a later decode step's routed-expert ids (tokens unaffected)"

VOCAB, DIM, NUM_LAYERS, NUM_EXPERTS, TOPK = 10, 4, 2, 4, 2
MAX_TOKENS = 2                               # the decode graph's batch (one token per sequence)


class Qwen3MoeForCausalLM:
    def __init__(self, device):
        gen = generator(4090)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(16, DIM, gen=gen, device=device, scale=0.5)
        self.gates = [randn(DIM, NUM_EXPERTS, gen=gen, device=device, scale=2.0) for _ in range(NUM_LAYERS)]
        self.experts = [randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def moe_block(self, layer_idx, h, all_routed_experts):
        topk_weights, topk_ids = torch.softmax(h @ self.gates[layer_idx], -1).topk(TOPK, dim=-1)
        if all_routed_experts is not None:
            all_routed_experts[:, layer_idx, :] = topk_ids
        w = self.experts[layer_idx][topk_ids]                              # [tokens, TOPK, DIM, DIM]
        return h + torch.einsum("tk,td,tkde->te", topk_weights, h, w)

    def forward(self, input_ids, position_ids, all_routed_experts=None):
        h = self.emb[input_ids[0]] + self.pos[position_ids[0]]
        for layer_idx in range(NUM_LAYERS):
            h = self.moe_block(layer_idx, h, all_routed_experts)
        return dict(hidden_states=h[None], all_routed_experts=all_routed_experts)

    def get_logits(self, hidden_states):
        return hidden_states @ self.lm_head

    def prepare_inputs_for_generation(self, input_ids, position_ids):
        all_routed_experts = input_ids.new_empty((input_ids.size(1), NUM_LAYERS, TOPK), dtype=torch.int16)
        return dict(input_ids=input_ids, position_ids=position_ids, all_routed_experts=all_routed_experts)

    # ---- CudaGraphMixin ----
    def make_buffers_cudagraph(self, input_ids):
        return {"input_ids": input_ids.new_zeros(1, MAX_TOKENS), "position_ids": input_ids.new_zeros(1, MAX_TOKENS),
                "all_routed_experts": input_ids.new_empty((MAX_TOKENS, NUM_LAYERS, TOPK), dtype=torch.int16)}

    def fill_buffers_cudagraph(self, input_buffers, input_ids, position_ids):
        input_buffers["input_ids"].copy_(input_ids)
        input_buffers["position_ids"].copy_(position_ids)
        return dict(input_ids=input_buffers["input_ids"], position_ids=input_buffers["position_ids"],
                    all_routed_experts=input_buffers["all_routed_experts"])

    def get_outputs_cudagraph(self, output_buffers, input_ids, variant):
        num_tokens = input_ids.size(-1)
        outputs = {"hidden_states": output_buffers["hidden_states"][:, :num_tokens]}
        experts = output_buffers["all_routed_experts"][:num_tokens, ...]
        outputs["all_routed_experts"] = experts.clone() if variant == "fix" else experts
        return outputs


class CUDAGraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant, self.graph = model, device, variant, None

    def __call__(self, input_ids, position_ids):
        if self.graph is None:
            self.input_buffers = self.model.make_buffers_cudagraph(input_ids)
            new_inputs = self.model.fill_buffers_cudagraph(self.input_buffers, input_ids, position_ids)
            self.graph, out = capture(lambda: self.model.forward(**new_inputs), device=self.device,
                                      owner="CUDAGraphRunner (Qwen3Moe decode)",
                                      static={k: self.input_buffers[k] for k in ("input_ids", "position_ids")})
            self.output_buffers = out
        self.model.fill_buffers_cudagraph(self.input_buffers, input_ids, position_ids)
        views = replay(self.graph, (self.output_buffers["hidden_states"], self.output_buffers["all_routed_experts"]))
        output_buffers = dict(hidden_states=views[0], all_routed_experts=views[1])
        return self.model.get_outputs_cudagraph(output_buffers, input_ids, self.variant)


@dataclasses.dataclass
class ARExtraInputs:
    all_routed_experts: torch.Tensor = None


@dataclasses.dataclass
class ARExtraOutputs:
    all_routed_experts: torch.Tensor = None


@dataclasses.dataclass
class BatchedOutputs:
    next_token_ids: torch.Tensor
    extra_outputs: ARExtraOutputs = None
    all_routed_experts: torch.Tensor = None

    def to_cpu(self):
        cpu = lambda v: v.cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
        extra = ARExtraOutputs(cpu(self.extra_outputs.all_routed_experts))
        return BatchedOutputs(cpu(self.next_token_ids), extra, cpu(self.all_routed_experts))


class BaseModelAgent:
    def __init__(self, model, device, variant, graphed):
        self.model, self.variant = model, variant
        self.runner = CUDAGraphRunner(model, device, variant) if graphed else None
        self._out_que = collections.deque()                              # asyncio.Queue in lmdeploy

    def _async_model_forward(self, input_ids, position_ids):
        if self.runner is not None:
            return self.runner(input_ids, position_ids)
        return self.model.forward(**self.model.prepare_inputs_for_generation(input_ids, position_ids))

    def _async_step(self, input_ids, position_ids, loop_count):
        extra_inputs = ARExtraInputs()
        for idx in range(loop_count):
            output = self._async_model_forward(input_ids, position_ids)
            next_token_ids = self.model.get_logits(output["hidden_states"])[0].argmax(-1)
            if self.variant == "fix":
                all_routed_experts = output.get("all_routed_experts")
                out = BatchedOutputs(next_token_ids, ARExtraOutputs(), all_routed_experts)
            else:
                extra_inputs.all_routed_experts = output.get("all_routed_experts")      # for router replay
                out = BatchedOutputs(next_token_ids, ARExtraOutputs(extra_inputs.all_routed_experts))
            self._out_que.append(out)                                   # _push_output
            if idx < loop_count - 1:                                    # __update_inputs
                input_ids, position_ids = next_token_ids[None], position_ids + 1

    def get_output_async(self):
        return self._out_que.popleft().to_cpu()


def update_running(running, batched_outputs, variant):
    """ARSequenceStrategy.update_running: one token and its routed experts per decoding sequence."""
    experts = batched_outputs.all_routed_experts if variant == "fix" else \
        batched_outputs.extra_outputs.all_routed_experts
    for msg, token, routed in zip(running, batched_outputs.next_token_ids, experts.split([1] * len(running))):
        msg["tokens"].append(float(token))
        msg["routed_experts"].append(routed.numpy().copy())


LOOP_COUNT, ROUNDS = 3, 2


def run(variant: str, device: str = "cpu"):
    model = Qwen3MoeForCausalLM(device)

    def serve(graphed: bool):
        agent = BaseModelAgent(model, device, variant, graphed)
        running = [{"tokens": [], "routed_experts": []} for _ in range(MAX_TOKENS)]
        input_ids = torch.tensor([[3, 8]], device=device)
        position_ids = torch.tensor([[4, 6]], device=device)
        for _ in range(ROUNDS):                                          # forward tasks of LOOP_COUNT decode steps
            agent._async_step(input_ids, position_ids, LOOP_COUNT)
            for _ in range(LOOP_COUNT):                                  # the output coroutine catches up
                update_running(running, agent.get_output_async(), variant)
            input_ids = torch.tensor([[int(m["tokens"][-1]) for m in running]], device=device)
            position_ids = position_ids + LOOP_COUNT
        experts = torch.tensor([e.tolist() for m in running for e in m["routed_experts"]], dtype=torch.float64)
        return [torch.tensor([m["tokens"] for m in running], dtype=torch.float64), experts]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
