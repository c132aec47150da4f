"""The decode CUDA graph was captured with ``return_logprob=False``: a decode batch asking for logprobs is refused.

Upstream: https://github.com/sgl-project/sglang/pull/775 ("Fix return_log_probs with cuda graph"), fixing
https://github.com/sgl-project/sglang/issues/747 ("Assertion error: Exception in ModelTpServer: This happens when
we do return_log_prob=True").
Symptom: with CUDA graphs on (the default since sgl-project/sglang#612), a request with ``return_logprob=True``
crashed the ``ModelTpServer`` with an ``AssertionError`` at its first decode step; ``--disable-cuda-graph`` served
it (sglang v0.2.x, July 2024).
Mechanism: ``CudaGraphRunner.capture_one_batch_size`` builds the capture batch's ``InputMetadata`` with
``return_logprob=False, top_logprobs_nums=0``, so the capture (and its two warmups) run ``LogitsProcessor.forward``
down its ``if not input_metadata.return_logprob`` branch: the graph computes ``last_logits`` and nothing else, and
its output buffer has ``next_token_logprobs=None``. That decision is frozen into every decode graph. An eager
decode step with ``return_logprob=True`` takes the other branch (``log_softmax`` over the logits, top-k
logprobs). ``ModelRunner.forward_decode`` still routed every batch that fits a captured size to
``CudaGraphRunner.replay``, whose guard for the frozen branch, ``assert not batch.return_logprob``, raised.
Doctor: warmup-divergence, at ``forward`` (``LogitsProcessor.forward``: its logprob branch was decided once, from
the capture batch's ``return_logprob=False``; replays reuse it while an eager step with logprobs decides
otherwise).
Fix (upstream): drop the assertion and extract logprobs outside the graph: after the replay (and the unpad),
``if batch.return_logprob:`` compute ``next_token_logprobs = log_softmax(next_token_logits)`` and, when
``top_logprobs_nums`` asks for them, ``LogitsProcessor.get_top_logprobs`` -- the work the captured branch skips.
(I read ``CudaGraphRunner`` before the fix -- capture with ``return_logprob=False``, ``assert not
batch.return_logprob`` in ``replay`` -- and right after it, with the "Extract logprobs" block; not #775's diff
lines. Toy: a one-layer model without a KV cache; decode inputs are token ids and positions.)
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/775"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward"
SYMPTOM = "a decode batch with return_logprob=True hits the graph captured without logprobs (AssertionError)"

VOCAB, DIM, MAX_POS = 10, 4, 16
BATCH_SIZE_LIST = [1, 2, 4]


@dataclasses.dataclass
class LogitProcessorOutput:
    next_token_logits: torch.Tensor
    next_token_logprobs: torch.Tensor | None = None
    output_top_logprobs: list | None = None


@dataclasses.dataclass
class InputMetadata:
    batch_size: int
    positions: torch.Tensor
    return_logprob: bool = False
    top_logprobs_nums: list | int = 0


@dataclasses.dataclass
class LogitsMetadata:
    top_logprobs_nums: list


class LogitsProcessor:
    def forward(self, hidden_states, weight, input_metadata: InputMetadata):
        last_logits = hidden_states @ weight.T            # decode: every row is a last token

        # Return only last_logits if logprob is not requested
        if not input_metadata.return_logprob:
            return LogitProcessorOutput(next_token_logits=last_logits)

        # When logprob is requested, compute the logits for all tokens.
        all_logprobs = last_logits.float().clone()      # upstream's logits are fp16: ``.float()`` is a copy
        all_logprobs[:] = torch.nn.functional.log_softmax(all_logprobs, dim=-1)
        output = LogitProcessorOutput(next_token_logits=last_logits, next_token_logprobs=all_logprobs)
        if any(x > 0 for x in input_metadata.top_logprobs_nums):
            output.output_top_logprobs = self.get_top_logprobs(
                all_logprobs, LogitsMetadata(input_metadata.top_logprobs_nums))
        return output

    @staticmethod
    def get_top_logprobs(all_logprobs, logits_metadata: LogitsMetadata):
        """Per row, the ``top_logprobs_nums[i]`` largest logprobs (values, token ids)."""
        return [all_logprobs[i].topk(k) if k > 0 else None for i, k in enumerate(logits_metadata.top_logprobs_nums)]


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(775)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.6)
        self.lm_head_weight = randn(VOCAB, DIM, gen=gen, device=device, scale=1.2)
        self.logits_processor = LogitsProcessor()

    def forward(self, input_ids, positions, input_metadata: InputMetadata):
        h = self.embed[input_ids.long()] + self.pos_embed[positions.long()]
        h = h + torch.tanh(h @ self.w)
        return self.logits_processor.forward(h, self.lm_head_weight, input_metadata)


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    seq_lens: torch.Tensor
    return_logprob: bool
    top_logprobs_nums: list

    @property
    def batch_size(self):
        return self.input_ids.shape[0]


class CudaGraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.variant = model, variant
        self.batch_size_list = BATCH_SIZE_LIST
        self.max_bs = max(self.batch_size_list)
        self.input_ids = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones((self.max_bs,), dtype=torch.int32, device=device)
        self.graphs, self.output_buffers = {}, {}
        for bs in self.batch_size_list:
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, device)

    def capture_one_batch_size(self, bs, device):
        input_ids, seq_lens = self.input_ids[:bs], self.seq_lens[:bs]

        def run_once():
            input_metadata = InputMetadata(batch_size=bs, positions=(seq_lens - 1).to(torch.int64),
                                           return_logprob=False, top_logprobs_nums=0)
            return self.model.forward(input_ids, input_metadata.positions, input_metadata).next_token_logits

        return capture(run_once, device=device, warmups=2, name=f"decode bs {bs}", owner="CudaGraphRunner",
                       static={"input_ids": self.input_ids, "seq_lens": self.seq_lens})

    def can_run(self, batch_size):
        return batch_size <= self.max_bs

    def replay(self, batch: Batch):
        if self.variant == "bug":
            assert not batch.return_logprob
        raw_bs = batch.batch_size

        # Pad
        bs = self.batch_size_list[bisect.bisect_left(self.batch_size_list, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(1)

        # Common inputs
        self.input_ids[:raw_bs] = batch.input_ids
        self.seq_lens[:raw_bs] = batch.seq_lens

        # Replay, unpad
        logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs,
                        padded={"input_ids": self.input_ids})
        output = LogitProcessorOutput(next_token_logits=logits[:raw_bs])

        # Extract logprobs
        if self.variant == "fix" and batch.return_logprob:
            output.next_token_logprobs = torch.nn.functional.log_softmax(output.next_token_logits, dim=-1)
            if any(x > 0 for x in batch.top_logprobs_nums):
                output.output_top_logprobs = LogitsProcessor.get_top_logprobs(
                    output.next_token_logprobs, LogitsMetadata(batch.top_logprobs_nums))
        return output


class ModelRunner:
    def __init__(self, model, device, variant, use_cuda_graph):
        self.model = model
        self.cuda_graph_runner = CudaGraphRunner(model, device, variant) if use_cuda_graph else None

    def forward_decode(self, batch: Batch):
        if self.cuda_graph_runner and self.cuda_graph_runner.can_run(batch.batch_size):
            return self.cuda_graph_runner.replay(batch)
        input_metadata = InputMetadata(batch_size=batch.batch_size, positions=(batch.seq_lens - 1).to(torch.int64),
                                       return_logprob=batch.return_logprob, top_logprobs_nums=batch.top_logprobs_nums)
        return self.model.forward(batch.input_ids, input_metadata.positions, input_metadata)


def forward_decode_batch(model_runner, batch: Batch):
    """``ModelTpServer.forward_decode_batch``: greedy next tokens, and their logprobs when requested."""
    output = model_runner.forward_decode(batch)
    next_token_ids = output.next_token_logits.argmax(-1)
    outs = [output.next_token_logits.clone()]
    if batch.return_logprob:
        rows = torch.arange(len(next_token_ids), device=next_token_ids.device)
        outs.append(output.next_token_logprobs[rows, next_token_ids].clone())
        outs += [top[0].clone() for top in output.output_top_logprobs if top is not None]
    return next_token_ids, outs


def run(variant: str, device: str = "cpu"):
    model = LlamaForCausalLM(device)
    # Three running requests; the second asks for logprobs (2 top logprobs) from the second decode step on.
    prompts_len = [3, 5, 2]
    first_tokens = [4, 7, 1]

    def serve(graphed: bool):
        runner = ModelRunner(model, device, variant, use_cuda_graph=graphed)
        tokens, lens = list(first_tokens), list(prompts_len)
        outs = []
        for step in range(3):
            want = step >= 1
            batch = Batch(torch.tensor(tokens, dtype=torch.int32, device=device),
                          torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=device),
                          return_logprob=want, top_logprobs_nums=[0, 2, 0] if want else [0, 0, 0])
            next_ids, step_outs = forward_decode_batch(runner, batch)
            outs += step_outs
            tokens, lens = next_ids.tolist(), [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
