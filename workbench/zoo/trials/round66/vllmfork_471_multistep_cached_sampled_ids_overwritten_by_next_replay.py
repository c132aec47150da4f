"""HPU multi-step decode caches a reference to each step's sampled token ids; the next step's graph replay overwrites it.

Upstream: https://github.com/HabanaAI/vllm-fork/pull/471 (commit 3c39626fb, "The output tensor from sampling is the
input_tokens to the ..."): "Accuracy fix for multi-step scheduling. This code solves the problem of a wrong second
token when HPU Graphs are used."
Symptom: with multi-step scheduling (``num_scheduler_steps > 1``) and HPU graphs, the tokens reported for the
earlier steps of a multi-step batch are wrong (the second token of every sequence, with two steps); without HPU
graphs they are right. No crash.
Mechanism: ``HPUModelRunner.execute_model`` (vllm/worker/hpu_model_runner.py) runs ``num_steps`` decode steps in one
call. The model is ``_maybe_wrap_in_hpu_graph`` -> ``htorch.hpu.wrap_in_hpu_graph(HpuModelAdapter(...),
disable_tensor_cache=True)``: captured once per bucket (``warmup_model``), replayed after. Per step it does
``output = self.model.sample(...).sampled_token_ids`` and ``self.cached_step_outputs.append(output)`` -- a reference,
not a copy -- then ``_prepare_decode(..., output=output)`` makes ``input_tokens = output[:real_batch_size]``, a view
that is the next replay's input. Only in the last step does ``_decode_sampler_outputs`` pop the cached tensors and
``.cpu().tolist()`` them. Under HPU graphs the memory holding a step's sampled ids is memory the next replay writes,
so by then every cached entry but the last reads a later step's ids. (A later commit, c5975f854 "Handle LoRA
specific changes in MSS" (#675), moved the copy to the input side: ``input_tokens = output[:real_batch_size].clone()``.)
Doctor: overwritten-output, at ``execute_model`` (it keeps the step's graph-memory sampled ids in
``cached_step_outputs`` across the next replay and reads them after).
Fix (upstream): ``self.cached_step_outputs.append(output.detach().clone())``.
Modelled: the closed HPU runtime's reuse of that memory (lazy mode, ``disable_tensor_cache=True``) is modelled as
one captured decode step (forward + compute_logits + greedy sample) whose sampled ids are a static output of the
graph, rewritten by every replay; one decode bucket, no KV cache (a token/position MLP), no async callbacks, no
broadcast to non-driver workers; the dummy placeholder tokens of ``seq_data`` are the length bookkeeping here.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HabanaAI/vllm-fork/pull/471"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "execute_model"
SYMPTOM = "multi-step scheduling with HPU graphs reports wrong tokens for every step but the last of a batch"

VOCAB, HIDDEN, MAX_POS = 24, 8, 32
BUCKET = 4                                   # decode batch bucket (the batch is padded to it)
NUM_STEPS = 3                                # num_scheduler_steps
PROMPT_LAST = (5, 11, 2, 17)                 # last token of each sequence after prefill
PROMPT_LENS = (3, 6, 4, 5)
CALLS = 2                                    # multi-step batches scheduled


class HpuModelAdapter:
    """Tiny decoder: token + position embedding, an MLP, lm head, greedy sampler."""

    def __init__(self, device):
        gen = generator(471)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w1 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, positions):
        h = self.emb[input_ids[:, 0]] + self.pos[positions[:, 0]]
        return torch.tanh(h @ self.w1) + h

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head

    def sample(self, logits):
        """Greedy sampler: ``sampled_token_ids`` of shape ``[batch, 1]``."""
        return torch.argmax(logits, dim=-1, keepdim=True)

    def decode_step(self, input_ids, positions):
        return self.sample(self.compute_logits(self.forward(input_ids, positions)))


class HPUGraphDecode:
    """``wrap_in_hpu_graph`` in miniature: captured at warmup per bucket; a call copies the user inputs into the
    graph's inputs (``copy_to``) and replays; the returned sampled ids are the graph's memory."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.input_ids = torch.zeros(BUCKET, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(BUCKET, 1, dtype=torch.long, device=device)
        self.graph = self.outputs = None

    def warmup_model(self):
        self.graph, self.outputs = capture(lambda: self.model.decode_step(self.input_ids, self.positions),
                                           device=self.device, name=f"decode bs{BUCKET}", owner="HPUModelRunner",
                                           static={"input_ids": self.input_ids, "positions": self.positions})

    def __call__(self, input_ids, positions):
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        return replay(self.graph, self.outputs)


class HPUModelRunner:
    def __init__(self, device, variant, use_graphs):
        self.device, self.variant = device, variant
        self.model = HpuModelAdapter(device)
        self.graphed = HPUGraphDecode(self.model, device) if use_graphs else None
        if self.graphed is not None:
            self.graphed.warmup_model()
        self.cached_step_outputs: list[torch.Tensor] = []

    def _prepare_decode(self, seq_lens, last_tokens, output=None):
        if output is None:
            input_tokens = torch.tensor([[t] for t in last_tokens], dtype=torch.long).to(self.device)
        else:
            input_tokens = output[:len(seq_lens)]           # the sampled ids become the next step's input
        input_positions = torch.tensor([[n - 1] for n in seq_lens], dtype=torch.long).to(self.device)
        return input_tokens, input_positions

    def _model_step(self, input_ids, positions):
        if self.graphed is not None:
            return self.graphed(input_ids, positions)
        return self.model.decode_step(input_ids, positions)

    def execute_model(self, seq_lens, last_tokens, num_steps):
        input_ids, positions = self._prepare_decode(seq_lens, last_tokens)
        for i in range(num_steps):
            output = self._model_step(input_ids, positions)   # sample(...).sampled_token_ids
            if num_steps > 1:
                if self.variant == "bug":
                    self.cached_step_outputs.append(output)
                else:
                    self.cached_step_outputs.append(output.detach().clone())
            if i < num_steps - 1:
                seq_lens = [n + 1 for n in seq_lens]         # the dummy placeholder token per sequence
                input_ids, positions = self._prepare_decode(seq_lens, last_tokens, output=output)
        return self._decode_sampler_outputs()

    def _decode_sampler_outputs(self):
        outs = []
        while self.cached_step_outputs:
            next_token_ids = self.cached_step_outputs.pop(0)
            outs.append(next_token_ids.cpu().tolist())
        return outs


def run(variant: str, device: str = "cpu"):
    def serve(use_graphs: bool):
        runner = HPUModelRunner(device, variant, use_graphs)
        seq_lens, last = list(PROMPT_LENS), list(PROMPT_LAST)
        steps = []
        for _ in range(CALLS):
            outs = runner.execute_model(seq_lens, last, NUM_STEPS)   # list of per-step [[id], ...]
            steps += outs
            seq_lens = [n + NUM_STEPS for n in seq_lens]
            last = [row[0] for row in outs[-1]]
        return [torch.tensor(s, dtype=torch.float64) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
