"""The TP1 draft runner hands the DeepSeek MTP proposer the hidden states of the padded graph batch.

Upstream: https://github.com/vllm-project/vllm/pull/14237 ("[Bugfix] Fix DeepSeek MTP crash when using
TP1ModelRunner with CUDA graph due to shape mismatch", commit 1e3e76b6c, March 2025).
Symptom: "When using DeepSeek MTP module with TP1 model runner and cuda graph, the server will crash due to shape
mismatch. The crash only happens when BS > 1" (``--num-speculative-tokens 3 --speculative-draft-tensor-parallel-
size 1``; the traceback runs through ``execute_model``). Eager mode works.
Mechanism: the MTP proposer is a ``MultiStepWorker`` whose ``sampler_output`` takes the fallback path: one
``execute_model`` per speculative step, each step's inputs prepared on the CPU, with ``return_hidden_states``
so that every step feeds its hidden states to the next (``_maybe_update_previous_hidden_states`` wraps them in
``HiddenStates(model_output.hidden_states, seq_group_metadata_list)``, which asserts one row per sequence).
``vllm/spec_decode/draft_model_runner.py::TP1DraftModelRunner.execute_model`` pads a decode batch to its graph
size: it pads ``previous_hidden_states`` with ``torch.empty`` rows up to ``graph_batch_size`` and replays the
graph captured for that size, so ``hidden_states`` has ``graph_batch_size`` rows. In the fallback branch it then
set ``output.hidden_states = hidden_states`` as is: for 3 sequences replayed in the graph of 4 the proposer gets
4 rows for 3 sequences and ``HiddenStates`` fails its assertion.
Doctor: padded-shape-mismatch, at ``execute_model`` (the graph's padded-size output is handed on with the real
batch's sequence metadata).
Fix (upstream): ``if use_cuda_graph: output.hidden_states = hidden_states[:len(selected_token_indices)]``.
(Same kind of fix as #4978/#5875 in ``ModelRunner.execute_model``; this is the TP1 draft runner's MTP fallback.)
Modelled: the MTP layer without attention or KV cache (embedding, ``eh_proj`` of the normed embedding and
previous hidden state, one MLP, shared head), greedy sampling, no bonus-token expansion.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/14237"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "execute_model"
SYMPTOM = "DeepSeek MTP with the TP1 draft runner and CUDA graphs crashes (shape mismatch) for padded batches"

VOCAB, DIM, MAX_POS = 16, 4, 32
NUM_SPECULATIVE_TOKENS = 3
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4]


class DeepSeekMTP:
    def __init__(self, device):
        gen = generator(14237)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.eh_proj = randn(2 * DIM, DIM, gen=gen, device=device, scale=0.6)
        self.mlp = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.shared_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, positions, previous_hidden_states, spec_step_idx=0):
        inputs_embeds = torch.nn.functional.layer_norm(self.embed_tokens[input_ids], (DIM,))       # enorm
        prev = torch.nn.functional.layer_norm(previous_hidden_states, (DIM,))                    # hnorm
        h = torch.cat([inputs_embeds, prev], dim=-1) @ self.eh_proj + self.pos[positions]
        return h + torch.tanh(h @ self.mlp)

    def compute_logits(self, hidden_states, spec_step_idx=0):
        return torch.nn.functional.layer_norm(hidden_states, (DIM,)) @ self.shared_head


class HiddenStates:
    """``vllm/sequence.py``: hidden states of in-progress sequences, one row per sequence."""

    def __init__(self, hidden_states, seq_group_metadata_list):
        assert len(seq_group_metadata_list) == len(hidden_states)
        self.hidden_states = hidden_states
        self.seq_ids = [s["seq_id"] for s in seq_group_metadata_list]


class CUDAGraphRunner:
    def __init__(self, model, bs, buffers, pool, device):
        self.input_buffers = {k: v[:bs] for k, v in buffers.items()}
        b = self.input_buffers
        self.graph, self.output = capture(
            lambda: model.forward(b["input_ids"], b["positions"], b["previous_hidden_states"]),
            device=device, pool=pool, name=f"mtp decode bs={bs}", owner="CUDAGraphRunner (MTP draft)",
            static=buffers)

    def __call__(self, input_ids, positions, previous_hidden_states, num_real):
        self.input_buffers["input_ids"].copy_(input_ids)
        self.input_buffers["positions"].copy_(positions)
        self.input_buffers["previous_hidden_states"].copy_(previous_hidden_states)
        return replay(self.graph, self.output, real=num_real, size=input_ids.shape[0])


class TP1DraftModelRunner:
    def __init__(self, device, variant, enforce_eager):
        self.device, self.variant = device, variant
        self.model = DeepSeekMTP(device)
        self.return_hidden_states = False
        self.graph_runners = {}
        if not enforce_eager:
            max_bs = _BATCH_SIZES_TO_CAPTURE[-1]
            buffers = {"input_ids": torch.zeros(max_bs, dtype=torch.long, device=device),
                       "positions": torch.zeros(max_bs, dtype=torch.long, device=device),
                       "previous_hidden_states": torch.zeros(max_bs, DIM, device=device)}
            pool = graph_pool_handle(device)
            for bs in reversed(_BATCH_SIZES_TO_CAPTURE):
                self.graph_runners[bs] = CUDAGraphRunner(self.model, bs, buffers, pool, device)

    def prepare_model_input(self, seq_group_metadata_list):
        n = len(seq_group_metadata_list)
        use_cuda_graph = bool(self.graph_runners)
        bs = next(b for b in _BATCH_SIZES_TO_CAPTURE if b >= n) if use_cuda_graph else n
        pad = [0] * (bs - n)
        return {"input_tokens": torch.tensor([s["last_token"] for s in seq_group_metadata_list] + pad,
                                             device=self.device),
                "input_positions": torch.tensor([s["position"] for s in seq_group_metadata_list] + pad,
                                                device=self.device),
                "selected_token_indices": torch.arange(n, device=self.device), "use_cuda_graph": use_cuda_graph}

    def execute_model(self, model_input, previous_hidden_states=None, num_steps=1, spec_step_idx=0):
        is_fallback = num_steps == 1
        use_cuda_graph = model_input["use_cuda_graph"]
        if use_cuda_graph:
            graph_batch_size = model_input["input_tokens"].shape[0]
            model_executable = self.graph_runners[graph_batch_size]
            hidden_states = torch.cat([
                previous_hidden_states,
                torch.empty([graph_batch_size - previous_hidden_states.shape[0], *previous_hidden_states.shape[1:]],
                            dtype=previous_hidden_states.dtype, device=previous_hidden_states.device)])
        else:
            hidden_states = previous_hidden_states
        indices = model_input["selected_token_indices"]
        outputs = []
        for _ in range(num_steps):
            if use_cuda_graph:
                hidden_states = model_executable(model_input["input_tokens"], model_input["input_positions"],
                                                 hidden_states, len(indices))
            else:
                hidden_states = self.model.forward(model_input["input_tokens"], model_input["input_positions"],
                                                   hidden_states, spec_step_idx)
            logits = self.model.compute_logits(hidden_states.index_select(0, indices), spec_step_idx)
            output = {"logits": logits, "sampled_token_ids": logits.argmax(-1)}
            outputs.append(output)
            if self.return_hidden_states and is_fallback:
                if use_cuda_graph and self.variant == "fix":
                    output["hidden_states"] = hidden_states[:len(indices)]
                else:
                    output["hidden_states"] = hidden_states
        return outputs


class MultiStepWorker:
    def __init__(self, model_runner: TP1DraftModelRunner):
        self.model_runner = model_runner

    def sampler_output(self, seq_group_metadata_list, previous_hidden_states: HiddenStates, sample_len):
        """The fallback path: every step prepared on the CPU, one ``execute_model`` per step."""
        self.model_runner.return_hidden_states = True
        model_outputs = []
        for spec_step_idx in range(sample_len):
            model_input = self.model_runner.prepare_model_input(seq_group_metadata_list)
            model_output = self.model_runner.execute_model(model_input, previous_hidden_states.hidden_states,
                                                           spec_step_idx=spec_step_idx)[0]
            # _maybe_update_previous_hidden_states
            previous_hidden_states = HiddenStates(model_output["hidden_states"], seq_group_metadata_list)
            for s, tok in zip(seq_group_metadata_list, model_output["sampled_token_ids"].tolist()):
                s["last_token"], s["position"] = tok, s["position"] + 1      # _append_new_tokens
            model_outputs += [model_output["logits"].clone(), model_output["sampled_token_ids"].clone()]
        return model_outputs


def run(variant: str, device: str = "cpu"):
    gen = generator(3)
    # decode batches (the target model's hidden states of each sequence's last token): 1 and 2 are capture
    # sizes, 3 is padded to 4
    batches = [[(1, 5, 0)], [(1, 6, 0), (2, 4, 7)], [(1, 7, 3), (2, 5, 9), (3, 9, 12)]]
    target_hidden = [randn(len(b), DIM, gen=gen, device=device) for b in batches]

    def serve(enforce_eager: bool):
        worker = MultiStepWorker(TP1DraftModelRunner(device, variant, enforce_eager))
        outs = []
        for batch, hidden in zip(batches, target_hidden):
            seqs = [{"seq_id": i, "position": p, "last_token": t} for i, p, t in batch]
            outs += worker.sampler_output(seqs, HiddenStates(hidden, seqs), NUM_SPECULATIVE_TOKENS)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
