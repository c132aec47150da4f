"""MTP drafter on ACL graphs: the proposer keeps a copy of the capture sizes taken before the runner adjusts them.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/5183 ("[bugfix][ACLGraph][MTP] deletes
`cudagraph_batch_sizes` in `MtpProposer`", commit ea6206bb18, merged December 2025).
Symptom: as reported, an error during DeepSeek-V3.2 + MTP 2P2D AISBench stress testing (the PR links the error
text, which is not in the commit); traced to ``compilation_config.cudagraph_capture_sizes`` being modified by
``adjust_cudagraph_sizes_for_spec_decode`` in ``NPUModelRunner``, a change that never reaches ``MtpProposer``.
Mechanism (from the diff and the code at its parent): ``MtpProposer.__init__`` snapshots
``self.cudagraph_batch_sizes = sorted(compilation_config.cudagraph_capture_sizes)``. Later, when the decode mode is
FULL with a separate routine and ``uniform_decode_query_len > 1``, ``NPUModelRunner`` calls vLLM's
``compilation_config.adjust_cudagraph_sizes_for_spec_decode``: the sizes are rounded up to multiples of
``num_speculative_tokens + 1`` and those past the old maximum dropped, ``max_cudagraph_capture_size`` shrinks and
``bs_to_padded_graph_size`` is recomputed for it; only ``runner.cudagraph_batch_sizes`` is updated, and graphs are
captured for those sizes. ``MtpProposer._propose`` still tests
``num_scheduled_tokens <= self.cudagraph_batch_sizes[-1]`` against the stale list, so a batch between the new and
the old maximum takes the graph path and calls ``vllm_config.pad_for_cudagraph(num_tokens)``, that is
``bs_to_padded_graph_size[num_tokens]``, past the end of the recomputed table: ``IndexError: list index out of
range`` (vLLM documents that this lookup raises for sizes above the maximum). The error text is inferred from
that code; the PR points to it but the commit does not quote it.
Doctor: undersized-buffer, at ``_propose`` (the drafter asks the graph path to serve more tokens than the largest
captured graph).
Fix (upstream): the proposer field is deleted; both checks use ``self.runner.cudagraph_batch_sizes[-1]``, so such a
batch runs eagerly.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/5183"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_propose"
SYMPTOM = "MTP draft batch between the adjusted and the original max capture size: IndexError in pad_for_cudagraph"

VOCAB, HIDDEN, MAX_POS = 16, 8, 32
NUM_SPECULATIVE_TOKENS = 2
UNIFORM_DECODE_QUERY_LEN = NUM_SPECULATIVE_TOKENS + 1
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8]
MAX_NUM_TOKENS = 16


def round_up(x, multiple):
    return (x + multiple - 1) // multiple * multiple


class CompilationConfig:
    def __init__(self, cudagraph_capture_sizes):
        self.cudagraph_capture_sizes = sorted(cudagraph_capture_sizes)
        self.max_cudagraph_capture_size = self.cudagraph_capture_sizes[-1]
        self.compute_bs_to_padded_graph_size()

    def compute_bs_to_padded_graph_size(self):
        self.bs_to_padded_graph_size = [0 for _ in range(self.max_cudagraph_capture_size + 1)]
        for end, start in zip(self.cudagraph_capture_sizes + [self.max_cudagraph_capture_size + 1],
                              [0] + self.cudagraph_capture_sizes):
            for bs in range(start, end):
                self.bs_to_padded_graph_size[bs] = start if bs == start else end

    def adjust_cudagraph_sizes_for_spec_decode(self, uniform_decode_query_len, tensor_parallel_size):
        multiple_of = uniform_decode_query_len
        if not self.cudagraph_capture_sizes or multiple_of <= 1:
            return
        rounded_sizes = sorted({round_up(size, multiple_of) for size in self.cudagraph_capture_sizes
                                if round_up(size, multiple_of) <= self.max_cudagraph_capture_size})
        self.max_cudagraph_capture_size = rounded_sizes[-1]
        self.cudagraph_capture_sizes = rounded_sizes
        # Recompute after adjusting the cudagraph sizes
        self.compute_bs_to_padded_graph_size()


class VllmConfig:
    def __init__(self):
        self.compilation_config = CompilationConfig(CUDAGRAPH_CAPTURE_SIZES)

    def pad_for_cudagraph(self, batch_size):
        # if batch_size > max_cudagraph_capture_size, it raises an IndexError
        return self.compilation_config.bs_to_padded_graph_size[batch_size]


class DeepSeekMTP:
    def __init__(self, device):
        gen = generator(5183)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.3)
        self.eh_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)

    def __call__(self, input_ids, positions, hidden_states):
        h = torch.tanh(self.embed[input_ids] + self.pos[positions] + hidden_states @ self.eh_proj)
        return h @ self.w


class MtpProposer:
    def __init__(self, vllm_config, device, runner, variant):
        self.vllm_config, self.device, self.runner, self.variant = vllm_config, device, runner, variant
        self.use_aclgraph = runner.use_aclgraph
        if variant == "bug":
            self.cudagraph_batch_sizes = (list(sorted(vllm_config.compilation_config.cudagraph_capture_sizes))
                                          if self.use_aclgraph else [])
        self.model = DeepSeekMTP(device)
        # persistent buffers for aclgraph graph
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.graphs = {}

    def _max_graph_size(self):
        if self.variant == "bug":
            return self.cudagraph_batch_sizes[-1]
        return self.runner.cudagraph_batch_sizes[-1]

    def dummy_run(self, num_tokens):
        """Capture the FULL draft graph for ``num_tokens`` (called by the runner for each of its sizes)."""
        fn = lambda: self.model(self.input_ids[:num_tokens], self.positions[:num_tokens],  # noqa: E731
                                self.hidden_states[:num_tokens])
        self.graphs[num_tokens] = capture(
            fn, device=self.device, owner="MtpProposer (ACL graph)", name=f"mtp {num_tokens} tokens",
            static={"input_ids": self.input_ids, "positions": self.positions, "hidden_states": self.hidden_states})

    def _propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                 last_token_indices, num_scheduled_tokens):
        num_tokens = target_token_ids.shape[0]
        # Shift the input ids by one token; replace each request's last token with its next token.
        self.input_ids[:num_tokens - 1] = target_token_ids[1:]
        self.input_ids[last_token_indices] = next_token_ids
        if self.runner.use_aclgraph and num_scheduled_tokens <= self._max_graph_size():
            num_input_tokens = self.vllm_config.pad_for_cudagraph(num_scheduled_tokens)
        elif self.use_aclgraph and num_tokens <= self._max_graph_size():
            # Acl graph mode, add padding to the batch size
            num_input_tokens = self.vllm_config.pad_for_cudagraph(num_tokens)
        else:
            # Eager mode, no padding needed
            num_input_tokens = num_tokens
        # copy inputs to buffer for cudagraph
        self.positions[:num_tokens] = target_positions
        self.hidden_states[:num_tokens] = target_hidden_states
        if num_input_tokens in self.graphs:
            g, out = self.graphs[num_input_tokens]
            padded = {"input_ids": self.input_ids, "positions": self.positions, "hidden_states": self.hidden_states}
            hidden = replay(g, out, real=num_tokens, size=num_input_tokens, padded=padded)
        else:
            hidden = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens],
                                self.hidden_states[:num_tokens])
        return hidden[last_token_indices].clone()


class NPUModelRunner:
    def __init__(self, device, variant, use_aclgraph):
        self.vllm_config = VllmConfig()
        self.compilation_config = self.vllm_config.compilation_config
        self.use_aclgraph = use_aclgraph
        self.uniform_decode_query_len = UNIFORM_DECODE_QUERY_LEN
        self.cudagraph_batch_sizes = list(sorted(self.compilation_config.cudagraph_capture_sizes))
        self.drafter = MtpProposer(self.vllm_config, device, self, variant)

    def initialize_aclgraph_capture(self):
        # FULL_DECODE_ONLY (separate routine) with uniform_decode_query_len > 1
        self.compilation_config.adjust_cudagraph_sizes_for_spec_decode(self.uniform_decode_query_len, 1)
        capture_sizes = self.compilation_config.cudagraph_capture_sizes
        self.cudagraph_batch_sizes = capture_sizes if capture_sizes is not None else []

    def capture_model(self):
        self.initialize_aclgraph_capture()
        for num_tokens in reversed(self.cudagraph_batch_sizes):
            self.drafter.dummy_run(num_tokens)


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(5183)
    # Target batches: (token ids, positions, query lengths per request). 6 = two MTP decodes; 7 = one decode plus
    # a 4-token prefill chunk; 3 = one decode.
    batches = []
    for query_lens, starts in [([3, 3], [5, 9]), ([3, 4], [8, 0]), ([3], [11])]:
        n = sum(query_lens)
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        positions = torch.cat([torch.arange(s, s + q) for q, s in zip(query_lens, starts)])
        hidden = torch.randn(n, HIDDEN, generator=gen)
        next_ids = torch.randint(0, VOCAB, (len(query_lens),), generator=gen)
        last = torch.cumsum(torch.tensor(query_lens), 0) - 1
        batches.append((ids, positions, hidden, next_ids, last))

    def serve(graphed: bool):
        runner = NPUModelRunner(device, variant, use_aclgraph=graphed)
        if graphed:
            runner.capture_model()
        outs = []
        for ids, positions, hidden, next_ids, last in batches:
            outs.append(runner.drafter._propose(ids.to(device), positions.to(device), hidden.to(device),
                                                next_ids.to(device), last.to(device), ids.shape[0]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
