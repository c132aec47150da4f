"""Gemma4 MTP centroid greedy-sample graphs replay against a freed, all-gathered lm_head weight (TP>1).

Upstream: https://github.com/vllm-project/vllm/pull/43909 ("[Bug] Fix gemma4 MTP IMA issue when TP>1, `CUDA error:
an illegal memory access was encountered`").
Symptom: ``vllm bench latency --model google/gemma-4-E2B-it -tp 2 --speculative-config '{"method": "mtp", ...,
"use_local_argmax_reduction": false}'`` dies in ``gemma4.py, in _greedy_sample: self._centroids_graphs[size].replay()``
with ``torch.AcceleratorError: CUDA error: an illegal memory access was encountered``; TP=1 is fine.
Mechanism: ``Gemma4Proposer.load_model`` calls ``_setup_centroids_cuda_graphs()`` once. It takes
``lm_head_weight = self.model._get_full_lm_head_weight()`` into a LOCAL variable; under TP>1 that function returns
``tensor_model_parallel_all_gather(self.lm_head.weight, dim=0)[:vocab_size]``, a view of a fresh temporary (each
rank's ``ParallelLMHead`` holds only its vocab shard). For each size the function warms up
``masked_emb.get_top_tokens(static_input, lm_head_weight)`` three times and captures it: the graph's gather of
candidate embeddings (``lm_head_weight[selected]``) bakes the temporary's address. Only the graph, ``static_input``
and ``static_output`` are stored (``_centroids_graphs/_inputs/_outputs``); when the function returns the gathered
weight loses its last reference and its block goes back to the allocator (then to the driver, or to the KV cache
allocated next). ``_greedy_sample`` copies the draft hidden states into ``_centroids_inputs[size][:T]`` and
replays: the captured gather reads the released block (IMA, or garbage draft tokens). Eager ``get_top_tokens``
gathers a fresh weight on every call and is right. With TP=1 the function returns a view of the live parameter.
Two TP ranks are emulated in one process: rank 0 holds its shard, the peer's shard stands for the all-gather.
Doctor: dangling-reference, at _get_full_lm_head_weight (it hands the capture a temporary that nobody keeps alive,
so every replay reads memory its owner released).
Fix (upstream): ``_get_full_lm_head_weight`` caches the gathered weight in ``self._stable_full_lm_head_weight``
(``all_gather(...)[:vocab_size].contiguous()``) and returns the cached tensor on later calls, so the storage the
graphs read lives as long as the model.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, own_segment_elems, randn, release_to_driver

UPSTREAM = "https://github.com/vllm-project/vllm/pull/43909"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_get_full_lm_head_weight"
SYMPTOM = "Gemma4 MTP TP=2: _centroids_graphs[size].replay() -> CUDA error: an illegal memory access was encountered"

HIDDEN, NUM_CENTROIDS, TOP_K, TP, PAD_ROWS = 16, 8, 2, 2, 16
CENTROID_SIZES = [1, 2, 4]


def vocab_size_for(device: str) -> int:
    # on CUDA the gathered weight is big enough to own its allocator segment (so empty_cache unmaps it)
    return max(256, own_segment_elems(device) // HIDDEN)


class TensorParallelGroup:
    """Two TP ranks in one process: this rank's shard plus the peer's, which the all-gather brings in."""

    def __init__(self, peer_shards: list[torch.Tensor]) -> None:
        self.world_size = 1 + len(peer_shards)
        self.peer_shards = peer_shards

    def tensor_model_parallel_all_gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([local, *self.peer_shards], dim=dim)          # a fresh tensor, as NCCL's output is


class Gemma4MTPMaskedEmbedder:
    """Sparse argmax via centroid routing (the real ``_select_and_score`` / ``get_top_tokens``)."""

    def __init__(self, vocab_size: int, gen: torch.Generator, device: str) -> None:
        self.hidden_size, self.vocab_size, self.num_centroids = HIDDEN, vocab_size, NUM_CENTROIDS
        self.centroid_intermediate_top_k = TOP_K
        self.vocab_size_per_centroid = vocab_size // NUM_CENTROIDS
        self.num_selected = TOP_K * self.vocab_size_per_centroid
        self.centroids_weight = randn(NUM_CENTROIDS, HIDDEN, gen=gen, device=device)
        self.token_ordering = torch.randperm(vocab_size, generator=gen).to(device)

    def _select_and_score(self, hidden_states, lm_head_weight):
        num_tokens = hidden_states.shape[0]
        _, top_k_indices = torch.topk(hidden_states @ self.centroids_weight.T, k=TOP_K, dim=-1)
        clusters = self.token_ordering.view(self.num_centroids, self.vocab_size_per_centroid)
        selected = clusters[top_k_indices]
        embeddings = lm_head_weight[selected.reshape(-1)].view(num_tokens, self.num_selected, self.hidden_size)
        logits = torch.einsum("td,tsd->ts", hidden_states, embeddings)
        return logits, selected.view(num_tokens, -1)

    def get_top_tokens(self, hidden_states, lm_head_weight):
        logits, indices = self._select_and_score(hidden_states, lm_head_weight)
        return indices.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)


class Gemma4MTP:
    """The assistant model on TP rank 0: ``lm_head.weight`` is this rank's vocab shard (padded vocab)."""

    def __init__(self, variant: str, device: str) -> None:
        gen = generator(43909)
        self.variant = variant
        vocab = vocab_size_for(device)
        self.masked_embedding = Gemma4MTPMaskedEmbedder(vocab, gen, device)
        full = randn(vocab + PAD_ROWS, HIDDEN, gen=gen, device=device)      # ParallelLMHead pads the vocab
        shards = list(full.chunk(TP, dim=0))
        self.lm_head_weight = shards[0].clone()                             # self.lm_head.weight (rank 0)
        self.tp_group = TensorParallelGroup([s.clone() for s in shards[1:]])
        self._stable_full_lm_head_weight = None

    def _get_full_lm_head_weight(self) -> torch.Tensor:
        if self.variant == "fix" and self._stable_full_lm_head_weight is not None:
            return self._stable_full_lm_head_weight
        lm_head_weight = self.lm_head_weight
        if self.tp_group.world_size > 1:
            lm_head_weight = self.tp_group.tensor_model_parallel_all_gather(lm_head_weight, dim=0)
            if self.variant == "fix":   # keep the gathered copy alive as long as the model (the graphs read it)
                lm_head_weight = lm_head_weight[: self.masked_embedding.vocab_size].contiguous()
                self._stable_full_lm_head_weight = lm_head_weight
                return lm_head_weight
        return lm_head_weight[: self.masked_embedding.vocab_size]          # a view of the temporary

    def get_top_tokens(self, hidden_states):
        return self.masked_embedding.get_top_tokens(hidden_states, self._get_full_lm_head_weight())


class Gemma4Proposer:
    def __init__(self, model: Gemma4MTP, device: str) -> None:
        self.model, self.device = model, device
        self._centroids_graphs, self._centroids_inputs, self._centroids_outputs = {}, {}, {}
        self._centroids_sizes: list[int] = []

    def load_model(self) -> None:
        self._setup_centroids_cuda_graphs()

    def _setup_centroids_cuda_graphs(self) -> None:
        masked_emb = self.model.masked_embedding
        lm_head_weight = self.model._get_full_lm_head_weight()             # local: dropped on return
        for size in CENTROID_SIZES:
            static_input = torch.zeros(size, masked_emb.hidden_size, device=self.device)
            events.static_buffers("Gemma4Proposer (centroids graphs)", {f"centroids_input_{size}": static_input})
            for _ in range(3):
                with events.warmup():
                    masked_emb.get_top_tokens(static_input, lm_head_weight)
            g = new_graph(self.device)
            with graph(g, name=f"centroids size {size}"):
                static_output = masked_emb.get_top_tokens(static_input, lm_head_weight)
            self._centroids_graphs[size] = g
            self._centroids_inputs[size] = static_input
            self._centroids_outputs[size] = static_output
        self._centroids_sizes = sorted(self._centroids_graphs)

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        for size in self._centroids_sizes:
            if size >= num_tokens:
                static_input, static_output = self._centroids_inputs[size], self._centroids_outputs[size]
                static_input[:num_tokens].copy_(hidden_states)
                events.serve(self._centroids_graphs[size], num_tokens, size, outputs=static_output,
                             padded={f"centroids_input_{size}": static_input},
                             eager=lambda x=static_input: self.model.get_top_tokens(x))
                self._centroids_graphs[size].replay()
                events.handed_out(self._centroids_graphs[size], static_output)
                return static_output[:num_tokens].clone()
        return self.model.get_top_tokens(hidden_states)


def run(variant: str, device: str = "cpu"):
    gen = generator(58)
    steps = [randn(t, HIDDEN, gen=gen, device=device) for t in (1, 3, 2, 4, 1)]   # draft hidden states per step

    def eager():
        model = Gemma4MTP(variant, device)
        return [model.get_top_tokens(h) for h in steps]

    def served():
        model = Gemma4MTP(variant, device)
        proposer = Gemma4Proposer(model, device)
        proposer.load_model()
        release_to_driver(device)                 # the worker profiles memory and empties the cache ...
        kv_cache = torch.zeros(vocab_size_for(device), HIDDEN, device=device)     # ... then allocates the KV cache
        outs = [proposer._greedy_sample(h) for h in steps]
        del kv_cache
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
