"""Without warmup, the first live MTP draft batch to reach a graph key decides that graph's token width.

Upstream: https://github.com/InternLM/lmdeploy/pull/4641 ("Fix mtp cudagraph when no warmup in RL",
commit 5473a386).
Symptom: RL rollouts with Qwen3.5 MTP speculative decoding and CUDA graphs, engine started with
``empty_init`` (no warmup) or woken up after sleep: the draft model's decode graphs fail (or misbehave) as
soon as a draft step with ``num_spec_tokens + 1`` tokens per sequence reaches a batch size whose graph was
first captured by a one-token step; runs that warm up at startup are fine (lmdeploy main, June 2026).
Mechanism: ``CUDAGraphRunner`` captures lazily, on the first call of each graph key
``(batch_size, is_decoding, enable_microbatch, target_hidden_size)``, and sizes the graph's static buffers
from that call's inputs: ``ARSpecCudagraphStrategy.get_max_tokens`` returned ``batch_size`` when the
capturing batch had one token per sequence, and ``make_buffers_cudagraph`` / ``fill_buffers_cudagraph``
took the decode query length from the live inputs. For a non-eagle3 MTP draft model the one-token draft
steps and the ``num_spec_tokens + 1`` steps share one key, so the key's graph serves both widths: warmup
captured it with the full width, but without warmup whichever live step came first decided. A graph
captured by a one-token step then gets a ``(num_spec_tokens + 1)``-token batch that its ``input_ids``
buffer cannot hold.
Doctor: warmup-divergence, at ``get_max_tokens`` (the capture-time batch decides the width every later
replay of the key must serve).
Fix (upstream): allocate ``batch_size * (num_spec_tokens + 1)`` tokens for every decode graph except
eagle3's (whose two input kinds have different keys), take the decode query length from the graph meta
(``get_graph_decode_query_len``), and warm up again after wakeup.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/4641"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "get_max_tokens"
SYMPTOM = "the MTP draft graph captured by a one-token step cannot take a num_spec+1-token step (no warmup)"
VOCAB, HIDDEN, MAX_POS, NUM_SPEC_TOKENS, CAPTURE_BS = 16, 6, 32, 2, (1, 2, 4)


class ARSpecCudagraphStrategy:
    def __init__(self, num_spec_tokens: int, method: str, variant: str):
        self.num_spec_tokens, self.method, self.variant = num_spec_tokens, method, variant

    def get_max_tokens(self, batch_size: int, origin_batch_size: int, num_tokens: int) -> int:
        """Get max tokens."""
        if self.variant == "bug":
            if num_tokens == origin_batch_size:
                return batch_size
        # only eagle3 has two sets of cudagraph due to different target_hidden_size
        elif num_tokens == origin_batch_size and self.method == "eagle3":
            return batch_size
        return batch_size * (self.num_spec_tokens + 1)


@dataclasses.dataclass
class CudaGraphMeta:
    max_batchs: int
    max_tokens: int
    is_decoding: bool
    device: str
    input_buffers: dict = None
    output_buffers: dict = None


def get_decode_query_len(input_ids, q_seqlens) -> int:
    """Get decode query length from graph inputs."""
    return input_ids.size(-1) // q_seqlens.size(0)


def get_graph_decode_query_len(graph_meta: CudaGraphMeta) -> int:
    """Get decode query length from padded graph buffers."""
    return graph_meta.max_tokens // graph_meta.max_batchs


class Qwen3_5MTPModel:
    """The MTP draft layer (token-wise here): embeddings of the draft tokens, their positions, one MLP."""

    def __init__(self, device, variant):
        gen = generator(4641)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.rotary = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.3)
        self.fc = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.variant = variant

    def forward(self, input_ids, position_ids, q_seqlens):
        h = self.embed_tokens[input_ids[0]] + self.rotary[position_ids[0]]
        return {"hidden_states": torch.tanh(h @ self.fc)[None]}

    # ---- CudaGraphMixin
    def make_buffers_cudagraph(self, graph_meta: CudaGraphMeta, input_ids, position_ids, q_seqlens):
        max_batches, max_tokens, device = graph_meta.max_batchs, graph_meta.max_tokens, graph_meta.device
        decode_query_len = (get_decode_query_len(input_ids, q_seqlens) if self.variant == "bug"
                            else get_graph_decode_query_len(graph_meta))
        return {"input_ids": torch.zeros(1, max_tokens, dtype=torch.int64, device=device),
                "position_ids": torch.zeros(1, max_tokens, dtype=torch.int64, device=device),
                "q_seqlens": torch.full((max_batches,), decode_query_len, dtype=torch.int64, device=device)}

    def fill_buffers_cudagraph(self, graph_meta: CudaGraphMeta, input_ids, position_ids, q_seqlens):
        input_buffers = graph_meta.input_buffers
        batch_size, num_tokens = q_seqlens.size(0), input_ids.size(-1)
        input_buffers["input_ids"][:, :num_tokens] = input_ids
        input_buffers["position_ids"][:, :num_tokens] = position_ids
        input_buffers["q_seqlens"].fill_(graph_meta.max_tokens // graph_meta.max_batchs)
        input_buffers["q_seqlens"][:batch_size] = q_seqlens
        return dict(input_ids=input_buffers["input_ids"], position_ids=input_buffers["position_ids"],
                    q_seqlens=input_buffers["q_seqlens"])

    def get_outputs_cudagraph(self, output_buffers, input_ids, **kwargs):
        return output_buffers["hidden_states"][:, :input_ids.size(-1)].clone()


class CUDASingleGraphRunner:
    def __init__(self, model, max_batches, max_tokens, is_decoding, device):
        self.model = model
        self.meta = CudaGraphMeta(max_batches, max_tokens, is_decoding, device)
        self._graph = None

    def capture(self, **kwargs):
        """Capture graph (one eager warmup forward, then the capture)."""
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta, **kwargs)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        self._graph, output = capture(lambda: self.model.forward(**padded_kwargs), device=self.meta.device,
                                      static=self.meta.input_buffers, owner="CUDASingleGraphRunner")
        self.meta.output_buffers = output
        return self.forward(**kwargs)

    def forward(self, **kwargs):
        self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        output_buffers = replay(self._graph, self.meta.output_buffers["hidden_states"])
        return self.model.get_outputs_cudagraph({"hidden_states": output_buffers}, **kwargs)


class CUDAGraphRunner:
    def __init__(self, model, strategy, device):
        self.model, self.cudagraph_strategy, self.device = model, strategy, device
        self._runner_map = {}

    def get_graph_key(self, q_seqlens, target_hidden_size):
        batch_size = next(s for s in CAPTURE_BS if s >= q_seqlens.size(0))
        return (batch_size, True, False, target_hidden_size)

    def __call__(self, input_ids, position_ids, q_seqlens, target_hidden_size=HIDDEN):
        graph_key = self.get_graph_key(q_seqlens, target_hidden_size)
        kwargs = dict(input_ids=input_ids, position_ids=position_ids, q_seqlens=q_seqlens)
        if graph_key not in self._runner_map:
            max_batches = graph_key[0]
            max_tokens = self.cudagraph_strategy.get_max_tokens(max_batches, q_seqlens.size(0), input_ids.size(1))
            runner = CUDASingleGraphRunner(self.model, max_batches, max_tokens, True, self.device)
            output = runner.capture(**kwargs)
            self._runner_map[graph_key] = runner
            return output
        return self._runner_map[graph_key].forward(**kwargs)


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(41)
    # Draft steps of a 2-request batch (RL rollout, engine built with empty_init: no warmup):
    # the step after the target prefill proposes from one token per sequence, the step after a verify
    # consumes num_spec_tokens + 1 tokens per sequence, and so on.
    steps = []
    pos = [7, 11]
    for tokens_per_seq in (1, NUM_SPEC_TOKENS + 1, 1, NUM_SPEC_TOKENS + 1):
        ids = torch.randint(0, VOCAB, (1, 2 * tokens_per_seq), generator=gen)
        positions = torch.tensor([[p + j for p in pos for j in range(tokens_per_seq)]])
        steps.append((ids, positions, torch.full((2,), tokens_per_seq, dtype=torch.int64)))
        pos = [p + tokens_per_seq for p in pos]

    def serve(graphed: bool):
        model = Qwen3_5MTPModel(device, variant)
        runner = CUDAGraphRunner(model, ARSpecCudagraphStrategy(NUM_SPEC_TOKENS, "qwen3_5_mtp", variant), device)
        outs = []
        for ids, positions, q_seqlens in steps:
            ids, positions, q_seqlens = ids.to(device), positions.to(device), q_seqlens.to(device)
            if graphed:
                outs.append(runner(ids, positions, q_seqlens))
            else:
                outs.append(model.forward(ids, positions, q_seqlens)["hidden_states"].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
