"""Chain-style multi-layer MTP takes the next step's hidden states from the draft-extend graph's buffer even when the step ran eagerly.

Upstream: https://github.com/sgl-project/sglang/pull/22832 ("[sgl] fix incorrect behavior in cuda graph
draft extend").
Symptom: multi-layer EAGLE/MTP with a chain-style draft (``Step3p5MTP``) and draft-extend CUDA graphs
crashes with out-of-bounds accesses once a decode batch is larger than the largest captured draft-extend
batch (sglang main, April 2026); batches that fit, or runs without draft CUDA graphs, are fine.
Mechanism: in chain-style MTP each draft layer's output hidden states feed the next layer. The
draft-extend CUDA graph's captured ``run_once`` copies the layer output into the runner's static
``buffers.hidden_states`` and the worker then reads the next layer's input from that buffer. But the
step only replays the graph when ``can_run`` holds; a batch larger than the captured sizes runs the
draft model eagerly, which never writes ``buffers.hidden_states``. The worker still reads it: rows from
an earlier replay (another batch's hidden states), and only ``max_num_token`` of them, so the per-request
``select_index`` runs past the buffer (out of bounds on the GPU, an ``IndexError`` here).
Doctor: stale-input, at ``_draft_extend_for_decode`` (it reads the graph's static hidden-state buffer for
a step that did not replay the graph, so nothing this step wrote is there).
Fix (upstream): take the chained hidden states from wherever this step's forward actually produced them:
the graph buffer after a replay, the eager forward's ``hidden_states`` otherwise.
"""
from __future__ import annotations

import bisect

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/22832"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_draft_extend_for_decode"
SYMPTOM = "chain MTP draft extend reads stale/short graph hidden-state buffer after an eager step (OOB crash)"
VOCAB, HIDDEN, NUM_STEPS = 10, 4, 2
NUM_TOKENS_PER_BS = 2                      # current token + one draft per request in draft extend
CAPTURE_BS = [1, 2]


class Step3p5MTPLayer:
    def __init__(self, gen, device):
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)

    def forward(self, input_ids, hidden_states):
        h = torch.tanh((hidden_states + self.embed[input_ids.long()]) @ self.w)
        return h @ self.lm_head, h                               # (next_token_logits, hidden_states)


class MultiLayerEagleDraftExtendCudaGraphRunner:
    """One per MTP layer: captures that layer's draft-extend forward for each bs in CAPTURE_BS."""

    def __init__(self, layer, device):
        self.layer = layer
        self.max_bs = max(CAPTURE_BS)
        self.max_num_token = self.max_bs * NUM_TOKENS_PER_BS
        self.input_ids = torch.zeros(self.max_num_token, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(self.max_num_token, HIDDEN, device=device)     # buffers.hidden_states
        self.graphs, self.outputs = {}, {}
        for bs in reversed(CAPTURE_BS):
            def run_once(bs=bs):
                n = bs * NUM_TOKENS_PER_BS
                logits, h = self.layer.forward(self.input_ids[:n], self.hidden_states[:n])
                # Chain-style MTP: overwrite buffers.hidden_states with the draft model's output
                self.hidden_states[:n].copy_(h)
                return logits
            self.graphs[bs], self.outputs[bs] = capture(
                run_once, device=device, name=f"draft extend bs {bs}",
                static={"input_ids": self.input_ids, "hidden_states": self.hidden_states},
                owner="MultiLayerEagleDraftExtendCudaGraphRunner")

    def can_run(self, bs):
        return bs <= self.max_bs

    def replay(self, input_ids, hidden_states, bs):
        graph_bs = CAPTURE_BS[bisect.bisect_left(CAPTURE_BS, bs)]
        n, graph_n = bs * NUM_TOKENS_PER_BS, graph_bs * NUM_TOKENS_PER_BS
        self.input_ids[:n].copy_(input_ids)
        self.hidden_states[:n].copy_(hidden_states)
        return replay(self.graphs[graph_bs], self.outputs[graph_bs], real=n, size=graph_n)[:n]


class MultiLayerEagleWorkerV2:
    def __init__(self, device, variant, use_cuda_graph):
        gen = generator(22832)
        self.layers = [Step3p5MTPLayer(gen, device) for _ in range(NUM_STEPS)]
        self.variant = variant
        self.chain_mtp_hidden_states = True
        self.cuda_graph_runners = ([MultiLayerEagleDraftExtendCudaGraphRunner(layer, device) for layer in self.layers]
                                   if use_cuda_graph else None)

    def _draft_extend_for_decode(self, input_ids, target_hidden_states, num_correct_drafts):
        bs = num_correct_drafts.shape[0]
        num_tokens = bs * NUM_TOKENS_PER_BS
        hidden_states = target_hidden_states
        topk_index = []
        for step, layer in enumerate(self.layers):
            runner = self.cuda_graph_runners[step] if self.cuda_graph_runners else None
            can_cuda_graph = runner is not None and runner.can_run(bs)
            if can_cuda_graph:
                logits = runner.replay(input_ids, hidden_states, bs)
            else:
                logits, ret_hidden_states = layer.forward(input_ids, hidden_states)
            if self.chain_mtp_hidden_states:
                if runner is not None and (self.variant == "bug" or can_cuda_graph):
                    hidden_states = runner.hidden_states[:num_tokens].clone()
                else:
                    hidden_states = ret_hidden_states
            # the last accepted draft of each request sits at num_correct_drafts within its slots
            select_index = torch.arange(bs, device=logits.device) * NUM_TOKENS_PER_BS + num_correct_drafts
            topk_index.append(logits[select_index].argmax(-1))
            # the chained hidden state of the selected token seeds every slot of the request next step
            hidden_states = hidden_states[select_index].repeat_interleave(NUM_TOKENS_PER_BS, 0)
        return torch.stack(topk_index, -1).float()


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(3)
    # (input ids, target hidden states, num_correct_drafts): bs 2, bs 3 (past the captured sizes), bs 2
    batches = []
    for bs in (2, 3, 2):
        ids = torch.randint(0, VOCAB, (bs * NUM_TOKENS_PER_BS,), generator=gen).to(device)
        hid = torch.randn(bs * NUM_TOKENS_PER_BS, HIDDEN, generator=gen).to(device)
        ncd = torch.randint(0, NUM_TOKENS_PER_BS, (bs,), generator=gen).to(device)
        batches.append((ids, hid, ncd))

    def serve(graphed: bool):
        worker = MultiLayerEagleWorkerV2(device, variant, use_cuda_graph=graphed)
        return [worker._draft_extend_for_decode(*b) for b in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
