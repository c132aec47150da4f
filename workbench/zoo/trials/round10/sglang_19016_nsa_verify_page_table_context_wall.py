"""NSA's CUDA-graph page table is one context length wide: target-verify near the context wall needs more.

Upstream: https://github.com/sgl-project/sglang/pull/19016 ("[FIX] NSA backend page_table overflow in speculative
decoding target_verify").
Symptom: a DeepSeek-V3.2 (NSA attention backend) decode server with speculative decoding (EAGLE/MTP) crashes in
``init_forward_metadata_replay_cuda_graph`` with ``RuntimeError: The size of tensor a (202752) must match the
size of tensor b (202754) at non-singleton dimension 1`` when a request reaches the model's context length
(SGLang main, February 2026, issue #18980). Runs without CUDA graphs do not crash.
Mechanism: ``init_cuda_graph_state`` allocates the graphs' static token page table ``page_table_1`` as
``(max_num_tokens, self.max_context_len)``, ``max_context_len`` being ``model_config.context_len``. On replay,
target-verify needs ``max_seqlen_k = seq_lens.max() + speculative_num_draft_tokens`` columns (the draft tokens'
own KV slots), and ``req_to_token`` rows already carry that headroom (``extra_max_context_len``), so a request
within ``speculative_num_draft_tokens`` of the context length yields a page-index block wider than the static
table: ``page_table_1[:, :max_seqlen_k]`` is silently clipped to ``max_context_len`` columns and the copy
fails. The eager path builds its page table per batch at ``max_seqlen_k`` and never hits the limit.
Doctor: undersized-buffer, at ``init_cuda_graph_state`` (the static page table sized for the context length,
not for context length + draft tokens, which target-verify replays write).
Fix (upstream): add ``speculative_num_draft_tokens`` to the column dimension of the CUDA-graph page table, as
``req_to_token`` does.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/19016"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "init_cuda_graph_state"
SYMPTOM = "target-verify replay at the context wall raises a page-table size mismatch (server crash)"
VOCAB, DIM = 10, 8
CONTEXT_LEN = 8                               # model_config.context_len
SPECULATIVE_NUM_DRAFT_TOKENS = 2
EXTRA_MAX_CONTEXT_LEN = 4 + SPECULATIVE_NUM_DRAFT_TOKENS   # req_to_token headroom for speculative decoding
NUM_SLOTS, MAX_BS = 24, 1


class Model:
    def __init__(self, device):
        gen = generator(19016)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wkv = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


class ForwardBatch:
    def __init__(self, input_ids, req_pool_indices, seq_lens, out_cache_loc):
        self.input_ids, self.req_pool_indices = input_ids, req_pool_indices
        self.seq_lens, self.out_cache_loc = seq_lens, out_cache_loc
        self.seq_lens_cpu = seq_lens.cpu()


class NSAMetadata:
    def __init__(self, cache_seqlens_int32, page_table_1, nsa_seqlens_expanded):
        self.cache_seqlens_int32 = cache_seqlens_int32
        self.page_table_1 = page_table_1
        self.nsa_seqlens_expanded = nsa_seqlens_expanded


class NativeSparseAttnBackend:
    def __init__(self, req_to_token, device, variant):
        self.req_to_token = req_to_token
        self.max_context_len = CONTEXT_LEN
        self.speculative_num_draft_tokens = SPECULATIVE_NUM_DRAFT_TOKENS
        self.device, self.variant = device, variant
        self.forward_metadata = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        page_table_width = self.max_context_len
        if self.variant == "fix":
            # target_verify reads seq_len + num_draft_tokens columns, as req_to_token allows
            page_table_width += self.speculative_num_draft_tokens
        self.decode_cuda_graph_metadata = {
            "cache_seqlens": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            "page_table": torch.zeros(max_num_tokens, page_table_width, dtype=torch.int32, device=self.device),
            "nsa_seqlens_expanded": torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device),
        }

    def init_forward_metadata_capture_cuda_graph(self, bs: int):
        num_tokens = bs * self.speculative_num_draft_tokens
        m = self.decode_cuda_graph_metadata
        m["cache_seqlens"][:bs].fill_(1 + self.speculative_num_draft_tokens)   # capture: seq_len fill value 1
        m["nsa_seqlens_expanded"][:num_tokens].copy_(self._seqlens_expanded(m["cache_seqlens"][:bs]))
        self.forward_metadata = NSAMetadata(m["cache_seqlens"][:bs], m["page_table"][:num_tokens],
                                            m["nsa_seqlens_expanded"][:num_tokens])

    def _seqlens_expanded(self, cache_seqlens):
        """Each draft token's causal KV length: kv_len - qo_len + 1 .. kv_len."""
        j = torch.arange(self.speculative_num_draft_tokens, device=cache_seqlens.device, dtype=torch.int32)
        return (cache_seqlens.unsqueeze(1) - self.speculative_num_draft_tokens + 1 + j).flatten()

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens, seq_lens_cpu):
        metadata = self.forward_metadata
        max_seqlen_k = int(seq_lens_cpu.max().item() + self.speculative_num_draft_tokens)
        cache_seqlens = (seq_lens + self.speculative_num_draft_tokens).to(torch.int32)
        metadata.cache_seqlens_int32.copy_(cache_seqlens)
        page_indices = self.req_to_token[req_pool_indices, :max_seqlen_k]
        page_indices = torch.repeat_interleave(page_indices, repeats=self.speculative_num_draft_tokens, dim=0)
        metadata.page_table_1[:, :max_seqlen_k].copy_(page_indices)
        metadata.nsa_seqlens_expanded.copy_(self._seqlens_expanded(cache_seqlens))

    def init_forward_metadata(self, forward_batch):
        """Eager target-verify: the page table is built per batch, max_seqlen_k wide."""
        max_seqlen_k = int(forward_batch.seq_lens_cpu.max().item() + self.speculative_num_draft_tokens)
        cache_seqlens = (forward_batch.seq_lens + self.speculative_num_draft_tokens).to(torch.int32)
        page_table_1 = torch.repeat_interleave(self.req_to_token[forward_batch.req_pool_indices, :max_seqlen_k],
                                               repeats=self.speculative_num_draft_tokens, dim=0)
        self.forward_metadata = NSAMetadata(cache_seqlens, page_table_1, self._seqlens_expanded(cache_seqlens))

    def forward_extend(self, q, k, kv_pool, out_cache_loc):
        """Target-verify attention: write the draft tokens' latent KV, then attend through the token page table."""
        kv_pool[out_cache_loc] = k
        metadata = self.forward_metadata
        kv = kv_pool[metadata.page_table_1.long()]                                    # [tokens, width, DIM]
        valid = (torch.arange(kv.shape[1], device=q.device).unsqueeze(0)
                 < metadata.nsa_seqlens_expanded.unsqueeze(1))
        scores = (q.unsqueeze(1) * kv).sum(-1).masked_fill(~valid, float("-inf"))
        return (torch.softmax(scores / DIM ** 0.5, dim=-1).unsqueeze(-1) * kv).sum(1)


def target_verify_forward(model, backend, kv_pool, input_ids, out_cache_loc):
    h = model.embed_tokens[input_ids]
    o = backend.forward_extend(h @ model.wq, h @ model.wkv, kv_pool, out_cache_loc)
    return (h + o) @ model.lm_head


def run(variant: str, device: str = "cpu"):
    width = CONTEXT_LEN + EXTRA_MAX_CONTEXT_LEN
    req_to_token = torch.zeros(MAX_BS, width, dtype=torch.int32)
    req_to_token[0] = torch.arange(1, width + 1, dtype=torch.int32)          # position p -> KV slot p + 1
    req_to_token = req_to_token.to(device)
    gen = torch.Generator().manual_seed(18980)
    prefix_kv = torch.randn(NUM_SLOTS, DIM, generator=gen)
    # (seq_len, draft token ids) of successive verify steps of one request approaching the context wall
    steps = [(3, [4, 2]), (5, [7, 1]), (7, [3, 8])]
    num_tokens = MAX_BS * SPECULATIVE_NUM_DRAFT_TOKENS

    def serve(graphed: bool):
        model = Model(device)
        kv_pool = prefix_kv.clone().to(device)
        backend = NativeSparseAttnBackend(req_to_token, device, variant)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        out_cache_loc = torch.zeros(num_tokens, dtype=torch.long, device=device)
        req_pool_indices = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        if graphed:
            backend.init_cuda_graph_state(MAX_BS, num_tokens)
            backend.init_forward_metadata_capture_cuda_graph(MAX_BS)
            out_cache_loc.fill_(NUM_SLOTS - 1)                                 # capture writes a scratch slot
            g, out = capture(lambda: target_verify_forward(model, backend, kv_pool, input_ids, out_cache_loc),
                             device=device, name=f"target_verify bs {MAX_BS}",
                             static={"input_ids": input_ids, "out_cache_loc": out_cache_loc,
                                     **backend.decode_cuda_graph_metadata},
                             state={"kv_pool": kv_pool}, owner="CudaGraphRunner (NSA target_verify)")
        outs = []
        for seq_len, draft_ids in steps:
            seq_lens = torch.tensor([seq_len], device=device)
            ids = torch.tensor(draft_ids, device=device)
            loc = req_to_token[0, seq_len:seq_len + SPECULATIVE_NUM_DRAFT_TOKENS].long()
            batch = ForwardBatch(ids, req_pool_indices, seq_lens, loc)
            if not graphed:
                backend.init_forward_metadata(batch)
                outs.append(target_verify_forward(model, backend, kv_pool, ids, loc).clone())
                continue
            input_ids.copy_(ids)
            out_cache_loc.copy_(loc)
            backend.init_forward_metadata_replay_cuda_graph(MAX_BS, batch.req_pool_indices, batch.seq_lens,
                                                            batch.seq_lens_cpu)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
