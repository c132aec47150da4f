"""Adaptive speculative decoding: the post-warmup hook resets the wrong backend, so warmup's metadata is frozen into a graph.

Upstream: https://github.com/sgl-project/sglang/pull/35275 ("[Bug][Spec] fix startup crash and reduce CUDA
graph memory usage for speculative adaptive"), part 2 of 3.
Symptom: with ``--speculative-adaptive`` the server hit an illegal memory access on the first replay of a
graph captured for another draft width; without adaptive speculative decoding (one set of runners) it
was fine (sglang main, August 2026).
Mechanism: backends such as DeepSeek-V4's build their forward metadata lazily inside the forward: the
runner prepares *raw* metadata (views of the graph's static ``seq_lens``/``req_pool_indices``), and the
first forward upgrades it (``_maybe_upgrade_forward_metadata``: raw -> full, the per-token page table and
KV lengths) unless it is already full. A warmup run does that upgrade eagerly, on tensors it allocates, so
``DecodeCudaGraphRunner.capture_one_shape`` calls the backend's ``on_after_cuda_graph_warmup`` hook between
warmup and capture to drop the warmed-up metadata; the capture then records the upgrade itself. The hook
was looked up on ``self.model_runner.attn_backend`` instead of the backend this capture ran against
(``capture_prepare``'s). Adaptive speculative decoding builds extra runners, one per draft width, each on a
freshly created backend, while ``model_runner.attn_backend`` still points at the active one: for those the
hook reset the wrong object, their capture saw metadata that was already full, skipped the upgrade, and
recorded kernels that read warmup's tensors. The next replay prepares fresh raw metadata, the warmed-up
full metadata is dropped, and the graph reads freed memory.
Doctor: warmup-divergence, at ``capture_one_shape`` (the lazy metadata upgrade was decided by warmup and
the capture reused it instead of recording it).
Fix (upstream): call ``attn_backend.on_after_cuda_graph_warmup()`` on the backend returned by
``capture_prepare``. (The PR's other two parts, the logits buffer size and one capture stream, are
not modelled.)
(Target-verify forward of a one-layer toy with ``num_tokens_per_req`` draft tokens per request; the
prompts' KV is written directly as a prefill would leave it.)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/35275"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "capture_one_shape"
SYMPTOM = "first replay of an extra adaptive-spec runner's graph reads warmup metadata already freed (IMA)"
VOCAB, DIM, CONTEXT_LEN, NUM_SLOTS, MAX_REQS, BS = 10, 4, 12, 40, 3, 2
PROMPT_LENS = (4, 6)
STEPS = ((2, [[1, 5], [7, 2]]), (3, [[3, 3, 8], [4, 0, 6]]), (2, [[9, 1], [2, 2]]), (3, [[5, 6, 7], [1, 8, 3]]))


@dataclasses.dataclass
class FullMetadata:
    page_table: torch.Tensor            # one row per token
    cache_seqlens: torch.Tensor         # KV length seen by each token (causal within the draft)


@dataclasses.dataclass
class ForwardMetadata:
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    num_tokens_per_req: int
    full: Optional[FullMetadata] = None


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor


class DSV4AttnBackend:
    def __init__(self, req_to_token, k_buffer, v_buffer, num_tokens_per_req):
        self.req_to_token, self.k_buffer, self.v_buffer = req_to_token, k_buffer, v_buffer
        self.num_tokens_per_req = num_tokens_per_req
        self.forward_metadata: Optional[ForwardMetadata] = None

    def init_forward_metadata(self, forward_batch):
        self.forward_metadata = ForwardMetadata(forward_batch.seq_lens, forward_batch.req_pool_indices,
                                                self.num_tokens_per_req)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch):
        self.init_forward_metadata(forward_batch)         # raw: views of the runner's static buffers

    def init_forward_metadata_replay_cuda_graph(self, forward_batch):
        self.init_forward_metadata(forward_batch)         # fresh raw metadata; the graph upgrades it

    def on_after_cuda_graph_warmup(self):
        """Drop what warmup upgraded, so that the capture records the upgrade."""
        if self.forward_metadata is not None:
            self.forward_metadata.full = None

    def _maybe_upgrade_forward_metadata(self):
        metadata = self.forward_metadata
        if metadata.full is not None:
            return metadata.full
        t = metadata.num_tokens_per_req
        page_table = self.req_to_token[metadata.req_pool_indices].repeat_interleave(t, dim=0)
        offsets = torch.arange(t, device=metadata.seq_lens.device).repeat(metadata.seq_lens.shape[0])
        cache_seqlens = metadata.seq_lens.repeat_interleave(t) - (t - 1) + offsets
        metadata.full = FullMetadata(page_table, cache_seqlens)
        return metadata.full

    def forward(self, q, k, v, forward_batch):
        self.k_buffer[forward_batch.out_cache_loc] = k
        self.v_buffer[forward_batch.out_cache_loc] = v
        full = self._maybe_upgrade_forward_metadata()
        keys, values = self.k_buffer[full.page_table], self.v_buffer[full.page_table]
        scores = (keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])
        valid = torch.arange(full.page_table.shape[1], device=q.device)[None, :] < full.cache_seqlens[:, None]
        p = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        return (p.unsqueeze(-1) * values).sum(1)


class DeepseekV4ForCausalLM:
    def __init__(self, device):
        gen = generator(35275)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, forward_batch, attn_backend):
        h = self.embed[forward_batch.input_ids]
        o = attn_backend.forward(h @ self.wq, h @ self.wk, h @ self.wv, forward_batch)
        return (h + o @ self.wo) @ self.lm_head


class ModelRunner:
    def __init__(self, model, attn_backend):
        self.model, self.attn_backend = model, attn_backend


class DecodeCudaGraphRunner:
    """Target-verify graphs for one draft width (``num_tokens_per_req``), bound to one attention backend."""

    def __init__(self, model_runner, attn_backend, num_tokens_per_req, device, variant):
        self.model_runner, self.attn_backend = model_runner, attn_backend
        self.num_tokens_per_req, self.device, self.variant = num_tokens_per_req, device, variant
        n = BS * num_tokens_per_req
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.long, device=device)
        self.req_pool_indices = torch.zeros(BS, dtype=torch.long, device=device)
        self.seq_lens = torch.full((BS,), num_tokens_per_req, dtype=torch.long, device=device)
        self.forward_batch = ForwardBatch(BS, self.input_ids, self.req_pool_indices, self.seq_lens,
                                          self.out_cache_loc)
        self.graph, self.output = self.capture_one_shape(BS)

    def capture_prepare(self):
        return self.attn_backend

    def capture_one_shape(self, bs):
        attn_backend = self.capture_prepare()
        attn_backend.init_forward_metadata_capture_cuda_graph(self.forward_batch)

        def run_once():
            return self.model_runner.model.forward(self.forward_batch, attn_backend)

        owner = f"DecodeCudaGraphRunner (draft width {self.num_tokens_per_req})"
        events.static_buffers(owner, {"input_ids": self.input_ids, "out_cache_loc": self.out_cache_loc,
                                      "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens})
        events.persistent_state(owner, {"k_buffer": attn_backend.k_buffer, "v_buffer": attn_backend.v_buffer,
                                        "req_to_token": attn_backend.req_to_token})
        for _ in range(2):
            with events.warmup():
                run_once()
        if self.variant == "fix":
            attn_backend.on_after_cuda_graph_warmup()
        else:
            self.model_runner.attn_backend.on_after_cuda_graph_warmup()
        g = new_graph(self.device)
        with graph(g, name=f"bs {bs} x {self.num_tokens_per_req}"):
            out = run_once()
        return g, out

    def replay(self, forward_batch):
        self.input_ids.copy_(forward_batch.input_ids)
        self.out_cache_loc.copy_(forward_batch.out_cache_loc)
        self.req_pool_indices.copy_(forward_batch.req_pool_indices)
        self.seq_lens.copy_(forward_batch.seq_lens)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(self.forward_batch)
        return replay(self.graph, self.output).clone()


def run(variant: str, device: str = "cpu"):
    model = DeepseekV4ForCausalLM(device)

    def serve(graphed: bool):
        gen = generator(352750)
        k_buffer = torch.zeros(NUM_SLOTS, DIM, device=device)
        v_buffer = torch.zeros(NUM_SLOTS, DIM, device=device)
        req_to_token = torch.zeros(MAX_REQS, CONTEXT_LEN, dtype=torch.long, device=device)
        first_slot = {1: 1, 2: 17}
        for rid, n in zip((1, 2), PROMPT_LENS):
            req_to_token[rid] = torch.arange(first_slot[rid], first_slot[rid] + CONTEXT_LEN)
            k_buffer[first_slot[rid]:first_slot[rid] + n] = randn(n, DIM, gen=gen, device=device)
            v_buffer[first_slot[rid]:first_slot[rid] + n] = randn(n, DIM, gen=gen, device=device)
        # Adaptive speculative decoding: one backend (and runner) per draft width; the model runner's
        # attn_backend is the active width's, the others are extra runners on fresh backends.
        backends = {t: DSV4AttnBackend(req_to_token, k_buffer, v_buffer, t) for t in (2, 3)}
        model_runner = ModelRunner(model, backends[2])
        runners = ({t: DecodeCudaGraphRunner(model_runner, backends[t], t, device, variant) for t in (2, 3)}
                   if graphed else None)
        outs = []
        for t, drafts in STEPS:
            # The verify step writes the draft tokens' KV after each prompt; rejected drafts are not kept,
            # so every step verifies from the prompt end (enough for the hazard).
            lens = [n + t for n in PROMPT_LENS]
            ids = torch.tensor(drafts, device=device).flatten()
            loc = torch.cat([req_to_token[rid, n:n + t] for rid, n in zip((1, 2), PROMPT_LENS)])
            forward_batch = ForwardBatch(BS, ids, torch.tensor([1, 2], device=device),
                                         torch.tensor(lens, device=device), loc)
            if graphed:
                outs.append(runners[t].replay(forward_batch))
            else:
                backends[t].init_forward_metadata(forward_batch)
                outs.append(model.forward(forward_batch, backends[t]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
