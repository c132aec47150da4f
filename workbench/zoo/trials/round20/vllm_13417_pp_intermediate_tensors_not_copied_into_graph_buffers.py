"""A PP stage's graphs read persistent intermediate-tensor buffers the runner never fills with the received activations.

Upstream: https://github.com/vllm-project/vllm/pull/13417 ("[V1][PP] Fix intermediate tensor values"),
the follow-up to https://github.com/vllm-project/vllm/pull/13353 ("[V1][PP] Cache Intermediate Tensors").
Symptom: V1 with pipeline parallelism (PP > 1) and CUDA graphs produced wrong outputs; the author had seen
the outputs differ with and without CUDA graphs when PP > 1, and verified correct outputs on one node only
with this fix (and #13339) (vLLM 0.7.3, February 2025).
Mechanism: a non-first PP rank receives the previous stage's ``hidden_states`` / ``residual`` as fresh
tensors every step (``recv_tensor_dict``). Piecewise CUDA graphs need fixed addresses, so #13353 made
``GPUModelRunner`` allocate persistent ``self.intermediate_tensors`` (``make_empty_intermediate_tensors``,
zeros) in ``_dummy_run`` and pass views ``v[:num_input_tokens]`` of them to the model both at capture and
in ``execute_model``, but ``execute_model`` never copied the received values into them. Every replay
therefore runs the stage's layers on what the dummy run left in the buffers (zeros): the received
activations of this step are an input the step never writes.
Doctor: stale-input, at ``execute_model`` (it hands the graph the persistent intermediate-tensor views
without writing this step's received values into them).
Fix (upstream): in ``execute_model``, ``for k, v in intermediate_tensors.items():
self.intermediate_tensors[k][:num_input_tokens].copy_(v[:num_input_tokens], non_blocking=True)`` before
building the ``IntermediateTensors`` of views (the code as it stands in later vLLM; the PR itself was
read only through its description). Upstream also routed steps run without graphs through the same
buffers, so eager mode was wrong as well until this fix; the reference here is the stage's forward on
the received tensors, what the stage must compute.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/13417"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "execute_model"
SYMPTOM = "PP > 1 with CUDA graphs: the last stage runs on the dummy run's zero activations every step"

VOCAB, HIDDEN, MAX_POSITION = 12, 4, 16
CAPTURE_SIZES = [2, 4, 8]
MAX_NUM_TOKENS = CAPTURE_SIZES[-1]
EPS = 1e-6


class IntermediateTensors(dict):
    """What one pipeline stage sends the next: ``hidden_states`` and ``residual`` per token."""


def rms_norm(x, residual, weight):
    x = x + residual
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight, x


class FirstStage:
    """PP rank 0: embedding and the first decoder layer; its output is sent to rank 1."""

    def __init__(self, device):
        gen = generator(13353)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)

    def __call__(self, input_ids):
        residual = self.embed_tokens[input_ids]
        return IntermediateTensors(hidden_states=torch.tanh(residual @ self.w), residual=residual)


class LlamaForCausalLM:
    """PP rank 1 (the last stage): the remaining decoder layer, the final norm and the LM head."""

    def __init__(self, device):
        gen = generator(13417)
        self.pos_emb = randn(MAX_POSITION, HIDDEN, gen=gen, device=device, scale=0.3)
        self.input_layernorm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.w_up = randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_down = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.7)

    def make_empty_intermediate_tensors(self, batch_size: int, device):
        return IntermediateTensors(hidden_states=torch.zeros(batch_size, HIDDEN, device=device),
                                   residual=torch.zeros(batch_size, HIDDEN, device=device))

    def __call__(self, positions, intermediate_tensors: IntermediateTensors):
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
        hidden_states, residual = rms_norm(hidden_states + self.pos_emb[positions], residual,
                                           self.input_layernorm)
        hidden_states = torch.relu(hidden_states @ self.w_up) @ self.w_down
        hidden_states, _ = rms_norm(hidden_states, residual, self.norm)
        return hidden_states @ self.lm_head                   # compute_logits (last rank)


class GPUModelRunner:
    """The V1 runner of the last PP rank, with #13353's persistent intermediate tensors."""

    def __init__(self, model: LlamaForCausalLM, variant: str, device, graphed: bool):
        self.model, self.variant, self.device, self.graphed = model, variant, device, graphed
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.intermediate_tensors: IntermediateTensors | None = None
        self.graphs: dict[int, tuple] = {}

    def _dummy_run(self, num_tokens: int):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(MAX_NUM_TOKENS, self.device)
        intermediate_tensors = IntermediateTensors({k: v[:num_tokens] for k, v in self.intermediate_tensors.items()})
        return self.model(self.positions[:num_tokens], intermediate_tensors)

    def profile_run(self):
        self._dummy_run(MAX_NUM_TOKENS)               # allocates the persistent intermediate tensors

    def capture_model(self):
        static = {"positions": self.positions,
                  **{f"intermediate_tensors.{k}": v for k, v in self.intermediate_tensors.items()}}
        for num_tokens in reversed(CAPTURE_SIZES):
            self.graphs[num_tokens] = capture(lambda n=num_tokens: self._dummy_run(n), device=self.device,
                                              owner="GPUModelRunner (PP rank 1)", name=f"size {num_tokens}",
                                              static=static)

    def execute_model(self, positions, intermediate_tensors: IntermediateTensors):
        num_scheduled_tokens = len(positions)
        self.positions[:num_scheduled_tokens].copy_(torch.tensor(positions, device=self.device))
        if not self.graphed:                          # the stage's forward on the received activations
            return self.model(self.positions[:num_scheduled_tokens], intermediate_tensors).clone()
        num_input_tokens = next(s for s in CAPTURE_SIZES if s >= num_scheduled_tokens)
        if self.variant == "fix":
            for k, v in intermediate_tensors.items():
                self.intermediate_tensors[k][:num_scheduled_tokens].copy_(v[:num_scheduled_tokens],
                                                                           non_blocking=True)
        intermediate_tensors = IntermediateTensors({k: v[:num_input_tokens]
                                                    for k, v in self.intermediate_tensors.items()})
        out = self._model_forward(num_scheduled_tokens, self.positions[:num_input_tokens], intermediate_tensors)
        return out[:num_scheduled_tokens].clone()

    def _model_forward(self, real: int, positions, intermediate_tensors: IntermediateTensors):
        """The piecewise backend at a captured size: it replays the graph, whose kernels read the addresses
        seen at capture (vLLM's debug mode asserts the inputs are the same views)."""
        size = positions.shape[0]
        graph, logits = self.graphs[size]
        assert all(v.data_ptr() == self.intermediate_tensors[k].data_ptr() for k, v in intermediate_tensors.items())
        return replay(graph, logits, real=real, size=size,
                      padded={"positions": self.positions,
                              **{f"intermediate_tensors.{k}": v for k, v in self.intermediate_tensors.items()}})


# scheduled tokens per step: (token id, position)
STEPS = [[(3, 0), (7, 1), (1, 2)],
         [(5, 3), (9, 0), (2, 1), (6, 2), (4, 3)],
         [(8, 4), (10, 4)],
         [(11, 5), (0, 5), (3, 0)],
         [(2, 6), (7, 6), (5, 1), (9, 0), (1, 1), (4, 2), (6, 3)]]


def run(variant: str, device: str = "cpu"):
    first_stage = FirstStage(device)
    model = LlamaForCausalLM(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, variant, device, graphed)
        if graphed:
            runner.profile_run()
            runner.capture_model()
        outs = []
        for step in STEPS:
            ids = torch.tensor([t for t, _ in step], device=device)
            received = first_stage(ids)               # recv_tensor_dict: fresh tensors every step
            outs.append(runner.execute_model([p for _, p in step], received))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
