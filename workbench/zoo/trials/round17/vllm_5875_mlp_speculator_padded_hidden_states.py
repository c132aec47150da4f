"""The target model's decode graph hands the MLPSpeculator hidden states for the padded batch, not the real one.

Upstream: https://github.com/vllm-project/vllm/pull/5875 ("[BugFix] Fix cuda graph for MLPSpeculator"), which
applies the adjustment made for Medusa in https://github.com/vllm-project/vllm/pull/4978.
Symptom: speculative decoding with an ``mlp_speculator`` draft (vLLM main, June 2024, right after #4947 added
it) works with ``enforce_eager=True`` but fails with CUDA graphs as soon as a decode batch is not itself a
capture size (the batch is padded): the hidden states passed to the speculator do not match the batch
(``assert len(seq_group_metadata_list) == len(hidden_states)`` in ``HiddenStates``). The report gives no
traceback; the symptom is read off the code.
Mechanism: the MLPSpeculator proposes from the target model's last hidden state of every sequence, so the
target ``ModelRunner`` is built with ``return_hidden_states=True`` and, after sampling, returns
``hidden_states`` in the ``SamplerOutput``. For prompts it selects the sampled positions
(``index_select(0, selected_token_indices)``); for decodes it returns the model output as is, one row per
token. A decode batch of 3 sequences replays the graph captured for 4: the model output is the graph's static
output of 4 rows, the last one a padded row, while the batch has 3 sequences.
Doctor: padded-shape-mismatch, at ``execute_model`` (the graph's padded-size output is handed on with the real
batch's sequence metadata).
Fix (upstream): for decodes under a captured graph, return ``hidden_states[:len(indices)]``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay
from workbench.engine import graph_pool_handle

UPSTREAM = "https://github.com/vllm-project/vllm/pull/5875"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "execute_model"
SYMPTOM = "MLPSpeculator decoding fails under CUDA graphs on padded decode batches (hidden states of the padded size)"
VOCAB, DIM, MAX_POS, NUM_PREDICT = 12, 4, 16, 2
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4]


class TargetModel:
    def __init__(self, device):
        gen = generator(5875)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def __call__(self, input_ids, positions):
        return torch.tanh((self.embed[input_ids] + self.pos[positions]) @ self.w)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class MLPSpeculator:
    def __init__(self, device):
        gen = generator(4947)
        self.emb = [randn(VOCAB, DIM, gen=gen, device=device) for _ in range(NUM_PREDICT)]
        self.proj = [randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(NUM_PREDICT)]
        self.head = [randn(DIM, VOCAB, gen=gen, device=device) for _ in range(NUM_PREDICT)]
        self.state_weight, self.emb_weight = 0.5, 0.5

    def generate_proposals(self, input_ids, previous_hidden_states):
        previous_hidden_states = previous_hidden_states.unsqueeze(1)       # b x 1 x d
        last_tokens = input_ids.unsqueeze(1)
        proposals = []
        for head_index in range(NUM_PREDICT):
            z = self.emb[head_index][last_tokens]                            # b x 1 x d
            states = previous_hidden_states @ self.proj[head_index]
            states.add_(z, alpha=self.emb_weight / self.state_weight)
            states = torch.nn.functional.gelu(torch.nn.functional.layer_norm(states, (DIM,)))
            previous_hidden_states = states
            logits = states @ self.head[head_index]
            proposals.append(logits.squeeze(1))
            last_tokens = logits.argmax(-1)
        return torch.stack(proposals, 1)


class HiddenStates:
    """Hidden states of the previous step, one row per sequence of the batch (``vllm/sequence.py``)."""

    def __init__(self, seq_group_metadata_list, hidden_states):
        assert len(seq_group_metadata_list) == len(hidden_states)
        self.seq_ids = [s["seq_id"] for s in seq_group_metadata_list]
        self.hidden_states = hidden_states


class ModelRunner:
    def __init__(self, model, device, enforce_eager: bool, variant: str):
        self.model, self.device, self.variant = model, device, variant
        self.return_hidden_states = True
        self.graph_runners = {}
        if not enforce_eager:
            self.capture_model()

    def capture_model(self):
        max_bs = _BATCH_SIZES_TO_CAPTURE[-1]
        self.input_tokens = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self.input_positions = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        pool = graph_pool_handle(self.device)
        for bs in reversed(_BATCH_SIZES_TO_CAPTURE):
            self.graph_runners[bs] = capture(
                lambda bs=bs: self.model(self.input_tokens[:bs], self.input_positions[:bs]), device=self.device,
                pool=pool, static={"input_tokens": self.input_tokens, "input_positions": self.input_positions},
                owner="CUDAGraphRunner (target model)", name=f"decode bs={bs}")

    def execute_model(self, seq_group_metadata_list, is_prompt: bool):
        d = self.device
        if is_prompt:
            tokens = [t for s in seq_group_metadata_list for t in s["prompt"]]
            positions = [p for s in seq_group_metadata_list for p in range(len(s["prompt"]))]
            ends, n = [], 0
            for s in seq_group_metadata_list:
                n += len(s["prompt"])
                ends.append(n - 1)
            selected_token_indices = torch.tensor(ends, device=d)
            hidden_or_intermediate_states = self.model(torch.tensor(tokens, device=d), torch.tensor(positions, device=d))
            use_cuda_graph = False
        else:
            n = len(seq_group_metadata_list)
            selected_token_indices = torch.arange(n, device=d)
            tokens = torch.tensor([s["last_token"] for s in seq_group_metadata_list], device=d)
            positions = torch.tensor([s["position"] for s in seq_group_metadata_list], device=d)
            use_cuda_graph = bool(self.graph_runners)
            if use_cuda_graph:
                bs = next(b for b in _BATCH_SIZES_TO_CAPTURE if b >= n)
                self.input_tokens[:n].copy_(tokens)
                self.input_tokens[n:bs].zero_()
                self.input_positions[:n].copy_(positions)
                self.input_positions[n:bs].zero_()
                g, out = self.graph_runners[bs]
                hidden_or_intermediate_states = replay(g, out, real=n, size=bs)
            else:
                hidden_or_intermediate_states = self.model(tokens, positions)
        # Sampling (greedy) over the selected positions, outside the graph.
        logits = self.model.compute_logits(hidden_or_intermediate_states.index_select(0, selected_token_indices))
        output = {"sampled_token_ids": logits.argmax(-1), "logits": logits}
        if self.return_hidden_states:
            # we only need to pass hidden states of most recent token
            indices = selected_token_indices
            if is_prompt:
                hidden_states = hidden_or_intermediate_states.index_select(0, indices)
            elif use_cuda_graph and self.variant == "fix":
                hidden_states = hidden_or_intermediate_states[:len(indices)]
            else:
                hidden_states = hidden_or_intermediate_states
            output["hidden_states"] = hidden_states
        return output


def run(variant: str, device: str = "cpu"):
    target, speculator = TargetModel(device), MLPSpeculator(device)
    prompts = [[1, 5, 7], [2, 3], [9, 4, 4, 6]]

    def serve(enforce_eager: bool):
        runner = ModelRunner(target, device, enforce_eager, variant)
        seqs = [{"seq_id": i, "prompt": p, "position": len(p) - 1} for i, p in enumerate(prompts)]
        outs = []
        is_prompt = True
        for _ in range(3):                                      # prefill, then two decode steps of 3 sequences
            output = runner.execute_model(seqs, is_prompt)
            previous_hidden_states = HiddenStates(seqs, output["hidden_states"])
            proposals = speculator.generate_proposals(output["sampled_token_ids"],
                                                      previous_hidden_states.hidden_states)
            outs += [output["logits"].clone(), proposals.clone()]
            for s, tok in zip(seqs, output["sampled_token_ids"].tolist()):
                s["last_token"], s["position"] = tok, s["position"] + 1
            is_prompt = False
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
