"""The Ascend NPU-graph block table is one context length wide: target-verify near the context limit needs more pages.

Upstream: https://github.com/sgl-project/sglang/pull/22778 ("[BUGFIX]Fix Ascend backend pre-allocated range in
NPU Graph Mode.", merged April 2026; the same change is Ascend/sglang#409).
Symptom: with NPU graph mode and ``--speculative-algorithm NGRAM --speculative-num-draft-tokens 16`` (QwQ-32B,
``--attention-backend ascend``), an exception is thrown intermittently when a request's output reaches the
maximum context length: the tensor being copied does not match the size pre-allocated at graph init. Without
graphs (or without speculative decoding) the request completes.
Mechanism: ``AscendAttnBackend.init_cuda_graph_state(max_bs, max_num_tokens)`` allocates the persistent
``self.graph_metadata["block_tables"]`` as ``(max_bs, (max_context_len + page_size - 1) // page_size)``
(``block_tables_swa`` alike). ``init_forward_metadata_capture_cuda_graph`` hands the captured attention the view
``metadata.block_tables = graph_metadata["block_tables"][:bs, :]``. At replay,
``init_forward_metadata_replay_cuda_graph`` takes ``max_len = seq_lens_cpu[:bs].max().item()`` and, for
target-verify, ``max_len += speculative_num_draft_tokens`` (the draft tokens' own KV slots; ``req_to_token``
rows carry that headroom), then runs ``metadata.block_tables[:bs, :max_seq_pages].copy_(req_to_token[
req_pool_indices[:bs], :max_len][:, ::page_size] // page_size)``. For a request within
``speculative_num_draft_tokens`` of ``max_context_len``, ``max_seq_pages`` exceeds the buffer's columns: the
destination slice silently clamps to the buffer width, the source does not, and ``copy_`` raises a size
mismatch. Eager ``init_forward_metadata`` builds its block table per batch at ``max_len`` and never hits it.
Doctor: undersized-buffer, at ``init_cuda_graph_state`` (the static block table is sized for the context
length, not for context length + draft tokens, which a target-verify replay must write).
Fix (upstream): ``total_context_len = max_context_len + page_size - 1``, plus ``speculative_num_draft_tokens``
when it is set; ``block_tables`` and ``block_tables_swa`` are allocated ``(max_bs, total_context_len //
page_size)``.
(One attention layer; prefills run eagerly; every verify batch fills the captured batch size, so no padding.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/22778"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "init_cuda_graph_state"
SYMPTOM = "NPU-graph target-verify near the context limit: block_tables copy_ raises a size mismatch (request fails)"

VOCAB, DIM = 16, 4
MAX_CONTEXT_LEN, PAGE_SIZE, SPECULATIVE_NUM_DRAFT_TOKENS = 8, 2, 3
MAX_BS = 2
REQ_TO_TOKEN_WIDTH = MAX_CONTEXT_LEN + SPECULATIVE_NUM_DRAFT_TOKENS      # extra_max_context_len headroom
NUM_PAGES = 1 + MAX_BS * ((REQ_TO_TOKEN_WIDTH + PAGE_SIZE - 1) // PAGE_SIZE)   # page 0: the null page


class Model:
    def __init__(self, device):
        gen = generator(22778)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(REQ_TO_TOKEN_WIDTH, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(3))

    def forward(self, input_ids, positions, out_cache_loc, kv_cache, metadata: "ForwardMetadata", q_per_req):
        """Write the tokens' keys at ``out_cache_loc``, then attend (paged, causal, values = keys) over each
        request's pages through ``metadata.block_tables`` up to ``metadata.seq_lens``."""
        h = self.embed[input_ids] + self.pos_embed[positions]
        kv_cache[out_cache_loc] = h @ self.wk
        table = metadata.block_tables.repeat_interleave(q_per_req, 0)               # [tokens, pages]
        kv_lens = metadata.seq_lens.repeat_interleave(q_per_req, 0)
        ctx = torch.arange(table.shape[1] * PAGE_SIZE, device=input_ids.device)
        keys = kv_cache[table[:, ctx // PAGE_SIZE] * PAGE_SIZE + ctx % PAGE_SIZE]       # [tokens, ctx, DIM]
        valid = (ctx[None, :] <= positions[:, None]) & (ctx[None, :] < kv_lens[:, None])
        scores = (keys @ (h @ self.wq)[:, :, None]).squeeze(-1).masked_fill(~valid, -1e9)
        return (torch.softmax(scores, -1)[:, :, None] * keys).sum(1) @ self.wo


@dataclasses.dataclass
class ForwardMetadata:
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None


class AscendAttnBackend:
    def __init__(self, req_to_token, device, variant):
        self.req_to_token, self.device, self.variant = req_to_token, device, variant
        self.max_context_len, self.page_size = MAX_CONTEXT_LEN, PAGE_SIZE
        self.speculative_num_draft_tokens = SPECULATIVE_NUM_DRAFT_TOKENS
        self.forward_metadata = None

    def init_forward_metadata(self, req_pool_indices, seq_lens, is_target_verify):
        """Eager: the block table is built per batch, as wide as this batch needs."""
        max_len = int(seq_lens.max()) + (self.speculative_num_draft_tokens if is_target_verify else 0)
        block_tables = self.req_to_token[req_pool_indices, :max_len][:, :: self.page_size] // self.page_size
        kv_lens = seq_lens + self.speculative_num_draft_tokens if is_target_verify else seq_lens
        self.forward_metadata = ForwardMetadata(block_tables, kv_lens)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.variant == "bug":
            width = (self.max_context_len + self.page_size - 1) // self.page_size
        else:
            total_context_len = self.max_context_len + self.page_size - 1
            if self.speculative_num_draft_tokens is not None:
                total_context_len += self.speculative_num_draft_tokens
            width = total_context_len // self.page_size
        self.graph_metadata = {"block_tables": torch.zeros((max_bs, width), dtype=torch.long, device=self.device)}

    def init_forward_metadata_capture_cuda_graph(self, bs, seq_lens):
        metadata = ForwardMetadata(block_tables=self.graph_metadata["block_tables"][:bs, :], seq_lens=seq_lens)
        self.graph_metadata[bs] = metadata
        self.forward_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu):
        metadata = self.graph_metadata[bs]
        max_len = int(seq_lens_cpu[:bs].max().item())
        max_len += self.speculative_num_draft_tokens                       # forward_mode.is_target_verify()
        max_seq_pages = (max_len + self.page_size - 1) // self.page_size
        metadata.block_tables[:bs, :max_seq_pages].copy_(
            self.req_to_token[req_pool_indices[:bs], :max_len][:, :: self.page_size] // self.page_size)
        metadata.block_tables[:bs, max_seq_pages:].fill_(0)
        metadata.block_tables[bs:, :].fill_(0)
        seq_lens = seq_lens + self.speculative_num_draft_tokens
        metadata.seq_lens[:bs].copy_(seq_lens[:bs])
        self.forward_metadata = metadata


class CudaGraphRunner:
    """The target-verify graph (``speculative_num_draft_tokens`` tokens per request), captured at MAX_BS."""

    def __init__(self, model, kv_cache, backend: AscendAttnBackend, device):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        n, d = MAX_BS, SPECULATIVE_NUM_DRAFT_TOKENS
        i64 = dict(dtype=torch.long, device=device)
        self.input_ids, self.positions = torch.zeros(n * d, **i64), torch.zeros(n * d, **i64)
        self.out_cache_loc, self.seq_lens = torch.zeros(n * d, **i64), torch.ones(n, **i64)
        self.req_pool_indices = torch.zeros(n, **i64)
        backend.init_cuda_graph_state(MAX_BS, MAX_BS * d)
        backend.init_forward_metadata_capture_cuda_graph(MAX_BS, self.seq_lens)
        self.graph, self.out = capture(
            lambda: model.forward(self.input_ids, self.positions, self.out_cache_loc, kv_cache,
                                  backend.forward_metadata, d),
            device=device, name=f"target_verify bs={MAX_BS}", owner="CudaGraphRunner (NPU graph)",
            static={"input_ids": self.input_ids, "positions": self.positions, "out_cache_loc": self.out_cache_loc,
                    "seq_lens": self.seq_lens, "block_tables": backend.graph_metadata["block_tables"]},
            state={"kv_cache": kv_cache})

    def replay(self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens):
        bs = seq_lens.shape[0]
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        self.out_cache_loc.copy_(out_cache_loc)
        self.req_pool_indices[:bs].copy_(req_pool_indices)
        self.seq_lens[:bs].copy_(seq_lens)
        self.backend.init_forward_metadata_replay_cuda_graph(bs, self.req_pool_indices, self.seq_lens[:bs],
                                                             seq_lens.cpu())
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    pages_per_req = (REQ_TO_TOKEN_WIDTH + PAGE_SIZE - 1) // PAGE_SIZE
    gen = generator(227780)
    prompts = ([3, 9, 4], [5, 1])
    # (committed lengths before the step, draft tokens per request); request 1 ends at MAX_CONTEXT_LEN - 1
    verify_steps = ([3, 2], [5, 3], [7, 4])
    draft_ids = [torch.randint(0, VOCAB, (MAX_BS * SPECULATIVE_NUM_DRAFT_TOKENS,), generator=gen).to(device)
                 for _ in verify_steps]

    def serve(graphed: bool):
        # req_to_token: request r's token j lives in page 1 + r * pages_per_req + j // PAGE_SIZE
        j = torch.arange(REQ_TO_TOKEN_WIDTH)
        req_to_token = torch.stack([(1 + r * pages_per_req + j // PAGE_SIZE) * PAGE_SIZE + j % PAGE_SIZE
                                    for r in range(MAX_BS)]).to(device)
        kv_cache = torch.zeros(NUM_PAGES * PAGE_SIZE, DIM, device=device)
        backend = AscendAttnBackend(req_to_token, device, variant)
        runner = CudaGraphRunner(model, kv_cache, backend, device) if graphed else None
        outs = []
        for r, p in enumerate(prompts):                                   # prefill (extend): always eager
            backend.init_forward_metadata(t([r]), t([len(p)]), is_target_verify=False)
            pos = t(list(range(len(p))))
            outs.append(model.forward(t(p), pos, req_to_token[r, : len(p)], kv_cache,
                                      backend.forward_metadata, len(p)).clone())
        for seq, ids in zip(verify_steps, draft_ids):
            d = SPECULATIVE_NUM_DRAFT_TOKENS
            pos = t([s + k for s in seq for k in range(d)])
            loc = torch.stack([req_to_token[r, s: s + d] for r, s in enumerate(seq)]).reshape(-1)
            if runner is None:
                backend.init_forward_metadata(t([0, 1]), t(seq), is_target_verify=True)
                outs.append(model.forward(ids, pos, loc, kv_cache, backend.forward_metadata, d).clone())
            else:
                outs.append(runner.replay(ids, pos, loc, t([0, 1]), t(seq)))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
