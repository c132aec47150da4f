"""EAGLE draft-extend graph under DP attention counts one logprob token per request: most rows' logits are never written.

Upstream: https://github.com/sgl-project/sglang/pull/16974 ("[SPEC_V2] Enable cudagraph draft_extend for
trtllm_mla_backend and Acclen Fix for DP under cudagraph mode").
Symptom: EAGLE/MTP with DP attention and the draft-extend CUDA graph enabled: the average accept length fell
by about a third (``accept len: 1.52`` instead of ``2.2-2.3`` per DP rank on DeepSeek-class models); with
the draft-extend graph off it was normal (sglang main, January 2026).
Mechanism: the draft-extend graph runs ``num_tokens_per_bs`` (= ``speculative_num_steps + 1``) tokens per
request, and the draft's next tokens come from the logits at each request's last accepted token. With DP
attention the logits processor gathers only ``dp_local_num_tokens`` rows, read from the runner's static
``global_num_tokens_for_logprob_gpu`` buffer (``LogitsMetadata.compute_dp_attention_metadata``), and scatters
the result back into the static ``next_token_logits_buffer``. The draft-extend runner filled that buffer with
``bs * num_tokens_for_logprob_per_batch`` where ``num_tokens_for_logprob_per_batch = 1``, so each replay
computed logits for the first ``bs`` rows only; the rows the draft actually samples (``select_index``) kept
whatever the logits buffer held (never this step's values), and the draft proposed tokens from them. The
eager draft extend takes its counts from the scheduler's batch, which counts every token.
Doctor: stale-input, at ``replay`` (it writes a logprob-token count that leaves most rows of the static
logits buffer unwritten by the step, and the sampled rows read them).
Fix (upstream): set ``num_tokens_for_logprob_per_batch = num_tokens_per_bs`` in the draft-extend runners'
capture and replay (``global_num_tokens_for_logprob_gpu`` equal to ``global_num_tokens_gpu``).
(Tiny draft model, one DP rank shown, two requests of three draft-extend tokens each, eagle top-k 2.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/16974"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "replay"
SYMPTOM = "draft tokens sampled from logits rows the draft-extend graph never wrote; accept length drops ~35%"
VOCAB, DIM, TOPK, DP_RANK = 10, 4, 2, 0
SPECULATIVE_NUM_STEPS = 2
NUM_TOKENS_PER_BS = SPECULATIVE_NUM_STEPS + 1
MAX_BS = 2


class EagleDraftModel:
    def __init__(self, device):
        gen = generator(16974)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.fc = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, hidden_states):
        return torch.tanh(self.embed[input_ids] + hidden_states @ self.fc)


@dataclasses.dataclass
class LogitsMetadata:
    global_num_tokens_for_logprob_gpu: torch.Tensor
    dp_local_num_tokens: torch.Tensor = None

    def compute_dp_attention_metadata(self):
        self.dp_local_num_tokens = self.global_num_tokens_for_logprob_gpu[DP_RANK]


def dp_gather_partial(global_buffer, local_tokens, num_tokens):
    rows = torch.arange(local_tokens.shape[0], device=local_tokens.device)
    global_buffer.copy_(torch.where((rows < num_tokens)[:, None], local_tokens, torch.zeros_like(local_tokens)))
    return global_buffer


def dp_scatter(local_tokens, global_tokens, num_tokens):
    rows = torch.arange(local_tokens.shape[0], device=local_tokens.device)
    local_tokens.copy_(torch.where((rows < num_tokens)[:, None], global_tokens, local_tokens))


def logits_processor(hidden_states, lm_head, logits_metadata, gathered_buffer, next_token_logits_buffer):
    logits_metadata.compute_dp_attention_metadata()
    n = logits_metadata.dp_local_num_tokens
    hidden = dp_gather_partial(gathered_buffer, hidden_states, n)
    dp_scatter(next_token_logits_buffer, hidden @ lm_head, n)
    return next_token_logits_buffer


def draft_extend_forward(model, input_ids, hidden_states, accept_length, logits_metadata, gathered_buffer,
                         next_token_logits_buffer):
    bs = accept_length.shape[0]
    h = model.forward(input_ids, hidden_states)
    logits = logits_processor(h, model.lm_head, logits_metadata, gathered_buffer, next_token_logits_buffer)
    select_index = torch.arange(bs, device=h.device) * NUM_TOKENS_PER_BS + accept_length - 1
    probs = torch.softmax(logits[select_index], -1)
    topk_p, topk_index = probs.topk(TOPK, dim=-1)
    return topk_p, topk_index


class EAGLEDraftExtendCudaGraphRunner:
    def __init__(self, model, device, variant):
        self.model = model
        max_num_token = MAX_BS * NUM_TOKENS_PER_BS
        self.input_ids = torch.zeros(max_num_token, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(max_num_token, DIM, device=device)
        self.accept_length = torch.full((MAX_BS,), NUM_TOKENS_PER_BS, dtype=torch.long, device=device)
        self.global_num_tokens_gpu = torch.zeros(1, dtype=torch.long, device=device)
        self.global_num_tokens_for_logprob_gpu = torch.zeros(1, dtype=torch.long, device=device)
        self.gathered_buffer = torch.zeros(max_num_token, DIM, device=device)
        self.next_token_logits_buffer = torch.zeros(max_num_token, VOCAB, device=device)
        self.num_tokens_for_logprob_per_batch = 1 if variant == "bug" else NUM_TOKENS_PER_BS
        self.capture(device)

    def capture(self, device):
        bs = MAX_BS
        self.global_num_tokens_gpu.fill_(bs * NUM_TOKENS_PER_BS)
        self.global_num_tokens_for_logprob_gpu.fill_(bs * self.num_tokens_for_logprob_per_batch)
        meta = LogitsMetadata(self.global_num_tokens_for_logprob_gpu)
        self.graph, self.output = capture(
            lambda: draft_extend_forward(self.model, self.input_ids, self.hidden_states, self.accept_length, meta,
                                         self.gathered_buffer, self.next_token_logits_buffer),
            device=device, name=f"draft extend bs {bs}", owner="EAGLEDraftExtendCudaGraphRunner",
            static={"input_ids": self.input_ids, "hidden_states": self.hidden_states,
                    "accept_length": self.accept_length,
                    "global_num_tokens_for_logprob_gpu": self.global_num_tokens_for_logprob_gpu,
                    "next_token_logits_buffer": self.next_token_logits_buffer})

    def replay(self, input_ids, hidden_states, accept_length):
        raw_bs = bs = accept_length.shape[0]
        num_tokens = bs * NUM_TOKENS_PER_BS
        self.input_ids[:num_tokens].copy_(input_ids)
        self.hidden_states[:num_tokens].copy_(hidden_states)
        self.accept_length[:raw_bs].copy_(accept_length)
        self.global_num_tokens_gpu.fill_(bs * NUM_TOKENS_PER_BS)
        self.global_num_tokens_for_logprob_gpu.fill_(bs * self.num_tokens_for_logprob_per_batch)
        topk_p, topk_index = replay(self.graph, self.output, real=raw_bs, size=bs)
        return topk_p[:raw_bs].clone(), topk_index[:raw_bs].clone()


def run(variant: str, device: str = "cpu"):
    model = EagleDraftModel(device)
    gen = generator(2)
    steps = []
    for accept in ([3, 2], [1, 3], [2, 2]):
        ids = torch.randint(0, VOCAB, (MAX_BS * NUM_TOKENS_PER_BS,), generator=gen).to(device)
        hidden = randn(MAX_BS * NUM_TOKENS_PER_BS, DIM, gen=gen, device=device)
        steps.append((ids, hidden, torch.tensor(accept, dtype=torch.long, device=device)))

    def eager():
        outs = []
        for ids, hidden, accept in steps:
            n = ids.shape[0]
            meta = LogitsMetadata(torch.tensor([n], dtype=torch.long, device=device))   # the batch's own counts
            outs.extend(draft_extend_forward(model, ids, hidden, accept, meta, torch.empty(n, DIM, device=device),
                                             torch.empty(n, VOCAB, device=device)))
        return outs

    def served():
        runner = EAGLEDraftExtendCudaGraphRunner(model, device, variant)
        outs = []
        for ids, hidden, accept in steps:
            outs.extend(runner.replay(ids, hidden, accept))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
