"""The TRTLLM-MLA decode graph sizes its block table from the capture's dummy ``seq_lens``: longer requests lose KV.

Upstream: https://github.com/sgl-project/sglang/pull/9675 ("Fix TRTLLM MLA Cuda KV Blocks Causing accuracy drop"),
for the accuracy drop reported in https://github.com/sgl-project/sglang/pull/8638#issuecomment-3193478283.
Symptom: DeepSeek-R1 served with ``--attention-backend trtllm_mla`` (flashinfer's TRT-LLM MLA decode kernel,
Blackwell) with decode CUDA graphs on lost accuracy on long-output evals (GPQA); the fix's GPQA runs are back at
the flashinfer backend's level (sglang main, August 2025).
Mechanism: ``TRTLLMMLABackend.init_cuda_graph_state`` allocates ``cuda_graph_kv_indices`` wide enough for
``max_context_len``, but ``init_forward_metadata_capture_cuda_graph`` (decode, no spec) sliced it to
``self._calc_padded_blocks(seq_lens.max().item())`` columns -- the width of the capture batch, whose ``seq_lens``
are the runner's fill value 1 -- and stored that view as ``decode_cuda_graph_metadata[bs].block_kv_indices``.
``forward_decode`` passes that view to ``trtllm_batch_decode_with_kv_cache_mla`` with
``max_seq_len=int(block_kv_indices.shape[1] * page_size)``: the block table's width and the int are frozen into
the captured kernel. On replay, ``init_forward_metadata_replay_cuda_graph`` refills the same view with
``create_flashmla_kv_indices_triton(..., metadata.block_kv_indices.shape[1])``, so a request longer than the
capture-time width gets only its first pages: decode attends over a truncated context. Eager
``init_forward_metadata`` sizes a fresh table from the batch's real longest sequence.
Doctor: undersized-buffer, at ``init_forward_metadata_capture_cuda_graph`` (it sizes the captured block table from
the dummy capture batch, and replays are asked to serve more block columns than were captured).
Fix (upstream): capture with the full width, ``max_blocks_per_seq = self._calc_padded_blocks(self.max_context_len)``
("Capture with full width so future longer sequences are safe during replay"), so the frozen table and
``max_seq_len`` cover any sequence the server admits.
(I read the backend as it was before the fix -- the capture slice from ``seq_lens.max().item()`` -- and the
post-fix capture code with the full-width comment, not the diff lines of #9675 itself. Toy: one latent "head",
page size 2, the padding to a multiple of 2 blocks stands in for the LCM(128 / page_size, 64) constraint.)
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/9675"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "init_forward_metadata_capture_cuda_graph"
SYMPTOM = "decode graph attends over only the first pages of long requests (accuracy drop with trtllm_mla)"

VOCAB, DIM, PAGE_SIZE = 16, 4, 2
MAX_CONTEXT_LEN = 16                     # model_config.context_len
NUM_PAGES, MAX_REQS = 24, 4
BLOCK_PAD = 2                            # toy stand-in for lcm(TRTLLM_BLOCK_CONSTRAINT // page_size, 64)
CAPTURE_BS = [2, 4]
SEQ_LEN_FILL_VALUE = 1                   # get_cuda_graph_seq_len_fill_value()


def cdiv(a, b):
    return -(-a // b)


def create_flashmla_kv_indices_triton(req_to_token, req_pool_indices, seq_lens, block_kv_indices, max_blocks,
                                      PAGED_SIZE):
    """Per row: the page id of each of the request's first ``min(cdiv(seq_len, page), max_blocks)`` pages."""
    cols = torch.arange(max_blocks, device=seq_lens.device)
    first_tok = (cols * PAGED_SIZE).clamp(max=req_to_token.shape[1] - 1)
    pages = req_to_token[req_pool_indices.long()][:, first_tok] // PAGED_SIZE
    num_pages = (seq_lens.long() + PAGED_SIZE - 1) // PAGED_SIZE
    block_kv_indices[:, :max_blocks] = torch.where(cols[None, :] < num_pages[:, None], pages, -1).to(torch.int32)


def trtllm_batch_decode_with_kv_cache_mla(query, kv_cache, block_tables, seq_lens, max_seq_len):
    """Toy TRT-LLM MLA decode: each row attends over the pages its block table lists (values = keys)."""
    bs, width = block_tables.shape
    k = kv_cache[block_tables.long().clamp(min=0)].reshape(bs, width * PAGE_SIZE, DIM)
    pos = torch.arange(width * PAGE_SIZE, device=query.device)
    valid = (pos[None, :] < seq_lens[:, None]) & (pos[None, :] < max_seq_len)
    scores = (k @ query[:, :, None]).squeeze(-1).masked_fill(~valid, float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


@dataclasses.dataclass
class TRTLLMMLADecodeMetadata:
    block_kv_indices: torch.Tensor


class TRTLLMMLABackend:
    def __init__(self, pool, device, variant):
        self.pool, self.device, self.variant = pool, device, variant
        self.page_size = PAGE_SIZE
        self.max_context_len = MAX_CONTEXT_LEN
        self.req_to_token = pool.req_to_token
        self.decode_cuda_graph_metadata = {}
        self.forward_metadata = None

    def _calc_padded_blocks(self, max_seq_len: int) -> int:
        blocks = cdiv(max_seq_len, self.page_size)
        return cdiv(blocks, BLOCK_PAD) * BLOCK_PAD

    def _create_block_kv_indices(self, batch_size, max_blocks, req_pool_indices, seq_lens):
        block_kv_indices = torch.full((batch_size, max_blocks), -1, dtype=torch.int32, device=self.device)
        create_flashmla_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, block_kv_indices,
                                          max_blocks, PAGED_SIZE=self.page_size)
        return block_kv_indices

    def init_cuda_graph_state(self, max_bs):
        max_blocks_per_seq = self._calc_padded_blocks(self.max_context_len)
        self.cuda_graph_kv_indices = torch.full((max_bs, max_blocks_per_seq), -1, dtype=torch.int32,
                                                device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens):
        if self.variant == "bug":
            max_seqlen_pad = self._calc_padded_blocks(seq_lens.max().item())
        else:
            # Capture with full width so future longer sequences are safe during replay
            max_seqlen_pad = self._calc_padded_blocks(self.max_context_len)
        block_kv_indices = self.cuda_graph_kv_indices[:bs, :max_seqlen_pad]
        create_flashmla_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, block_kv_indices,
                                          max_seqlen_pad, PAGED_SIZE=self.page_size)
        metadata = TRTLLMMLADecodeMetadata(block_kv_indices)
        self.decode_cuda_graph_metadata[bs] = metadata
        self.forward_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens):
        metadata = self.decode_cuda_graph_metadata[bs]
        create_flashmla_kv_indices_triton(self.req_to_token, req_pool_indices[:bs], seq_lens[:bs],
                                          metadata.block_kv_indices, metadata.block_kv_indices.shape[1],
                                          PAGED_SIZE=self.page_size)
        self.forward_metadata = metadata

    def init_forward_metadata(self, forward_batch):
        max_seq = forward_batch.seq_lens_cpu.max().item()
        max_seqlen_pad = self._calc_padded_blocks(max_seq)
        block_kv_indices = self._create_block_kv_indices(len(forward_batch.seq_lens_cpu), max_seqlen_pad,
                                                         forward_batch.req_pool_indices, forward_batch.seq_lens)
        self.forward_metadata = TRTLLMMLADecodeMetadata(block_kv_indices)

    def forward_decode(self, q, k, seq_lens, out_cache_loc):
        self.pool.kv_cache.view(-1, DIM)[out_cache_loc.long()] = k          # set_mla_kv_buffer
        metadata = self.forward_metadata
        return trtllm_batch_decode_with_kv_cache_mla(
            q, self.pool.kv_cache, block_tables=metadata.block_kv_indices, seq_lens=seq_lens.to(torch.int32),
            max_seq_len=int(metadata.block_kv_indices.shape[1] * self.page_size))


class TokenToKVPool:
    def __init__(self, device):
        self.kv_cache = torch.zeros(NUM_PAGES, PAGE_SIZE, DIM, device=device)     # page 0: padding scratch
        self.req_to_token = torch.zeros(MAX_REQS, MAX_CONTEXT_LEN, dtype=torch.long, device=device)


class DeepseekV2ForCausalLM:
    def __init__(self, device):
        gen = generator(9675)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_CONTEXT_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wkv = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.7)

    def forward(self, input_ids, positions, seq_lens, out_cache_loc, attn_backend):
        h = self.embed[input_ids.long()] + self.pos_embed[positions.long()]
        attn = attn_backend.forward_decode(h @ self.wq, h @ self.wkv, seq_lens, out_cache_loc)
        return (h + attn) @ self.lm_head


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor


class CudaGraphRunner:
    def __init__(self, model, attn_backend, pool, device):
        self.model, self.attn_backend, self.pool = model, attn_backend, pool
        self.capture_bs = CAPTURE_BS
        self.max_bs = max(self.capture_bs)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((self.max_bs,), SEQ_LEN_FILL_VALUE, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        attn_backend.init_cuda_graph_state(self.max_bs)
        self.graphs, self.output_buffers = {}, {}
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, device)

    def capture_one_batch_size(self, bs, device):
        input_ids, req_pool_indices = self.input_ids[:bs], self.req_pool_indices[:bs]
        seq_lens, out_cache_loc = self.seq_lens[:bs], self.out_cache_loc[:bs]
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens)

        def run_once():
            return self.model.forward(input_ids, seq_lens - 1, seq_lens, out_cache_loc, self.attn_backend)

        return capture(run_once, device=device, warmups=2, name=f"decode bs {bs}", owner="CudaGraphRunner",
                       static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                               "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc,
                               "cuda_graph_kv_indices": self.attn_backend.cuda_graph_kv_indices},
                       state={"kv_cache": self.pool.kv_cache})

    def can_run(self, forward_batch):
        return len(forward_batch.seq_lens_cpu) <= self.max_bs

    def replay(self, forward_batch):
        raw_bs = len(forward_batch.seq_lens_cpu)
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(SEQ_LEN_FILL_VALUE)
            self.out_cache_loc.zero_()
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, self.req_pool_indices, self.seq_lens)
        left = {"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices}
        return replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded=left)[:raw_bs].clone()


def run(variant: str, device: str = "cpu"):
    model = DeepseekV2ForCausalLM(device)
    gen = generator(2)
    prefill_kv = randn(NUM_PAGES * PAGE_SIZE, DIM, gen=gen, device=device)
    # Requests (req pool slot, pages, prompt length): pages are handed out from page 1 on (page 0 is scratch).
    reqs = {1: ([1, 2, 3, 4, 5, 6], 7), 2: ([7, 8, 14], 3), 3: ([9, 10, 11, 12, 13], 5)}
    # Decode steps: (req slot, input token) per running request; the third step runs A and C only (padded).
    steps = [[(1, 4), (2, 9), (3, 1)], [(1, 7), (2, 2), (3, 11)], [(1, 13), (3, 6)]]

    def setup(pool):
        for r, (pages, n) in reqs.items():
            slots = torch.tensor([p * PAGE_SIZE + i for p in pages for i in range(PAGE_SIZE)], device=device)
            pool.req_to_token[r, :len(slots)] = slots
            pool.kv_cache.view(-1, DIM)[slots[:n]] = prefill_kv[slots[:n]]   # the prompt's KV, as prefill left it

    def serve(graphed: bool):
        pool = TokenToKVPool(device)
        backend = TRTLLMMLABackend(pool, device, variant)
        runner = CudaGraphRunner(model, backend, pool, device) if graphed else None
        if graphed:
            pool.kv_cache.zero_()                # capture and warmups wrote the scratch slot only
        setup(pool)
        lens = {r: n for r, (_, n) in reqs.items()}
        outs = []
        for step in steps:
            t = lambda xs, dt=torch.long: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
            seq_lens = [lens[r] + 1 for r, _ in step]
            fb = ForwardBatch(t([tok for _, tok in step]), t([r for r, _ in step], torch.int32),
                              t(seq_lens, torch.int32), torch.tensor(seq_lens),
                              pool.req_to_token[t([r for r, _ in step]), t([n - 1 for n in seq_lens])])
            if runner is not None and runner.can_run(fb):
                outs.append(runner.replay(fb))
            else:
                backend.init_forward_metadata(fb)
                outs.append(model.forward(fb.input_ids, fb.seq_lens - 1, fb.seq_lens, fb.out_cache_loc,
                                          backend).clone())
            for (r, _), n in zip(step, seq_lens):
                lens[r] = n
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
