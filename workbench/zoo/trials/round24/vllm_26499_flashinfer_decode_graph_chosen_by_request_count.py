"""FlashInfer picks its decode-graph path by request count; a big spec-decode batch is padded past every graph.

Upstream: https://github.com/vllm-project/vllm/pull/26499 ("[Bugfix] Fix CUDA graph selection bug in FlashInfer
at high concurrency").
Symptom: with speculative decoding and FlashInfer's FULL decode CUDA graphs (TRTLLM decode path), high
concurrency broke the engine: "FlashInfer would choose to use decode CUDA graphs if `num_decodes < threshold`,
even if spec decoding was enabled and the number of tokens in the batch was much higher. This can cause issues
when `num_decode_tokens > max_cudagraph_size`" (vLLM V1, October 2025).
Mechanism: ``FlashInferMetadataBuilder.build`` decides whether a pure-decode batch takes the CUDA-graph decode
path with ``num_decodes <= self._decode_cudagraph_max_bs`` (``min(max_num_reqs, max_capture_size)``), a bound
on requests, and then pads the batch's *tokens* to a captured graph size:
``num_input_tokens = self.vllm_config.pad_for_cudagraph(num_decode_tokens)``. With ``num_speculative_tokens =
K`` every decode request carries ``1 + K`` tokens, so a batch of few enough requests can hold more tokens than
the largest captured graph. The model runner rightly runs such a batch without a graph, but the builder still
asks ``pad_for_cudagraph`` (the ``bs_to_padded_graph_size`` table, which ends at the largest capture size) for
a padded size beyond every captured graph: ``IndexError``, and the step dies.
Doctor: undersized-buffer, at ``build`` (the graph-path decision asks the capture-size table and the
cudagraph decode wrapper's buffers to serve more decode tokens than any graph was captured for).
Fix (upstream): the check uses ``num_decode_tokens <= self._decode_cudagraph_max_bs`` and the constructor
raises that bound to ``min((1 + num_speculative_tokens) * max_num_reqs, max_capture_size)`` when speculative
decoding is used, so the batch builds the non-graph decode metadata.
Read: the PR description and the pre-fix ``FlashInferMetadataBuilder`` (``__init__``, ``_get_decode_wrapper``
and the decode branch of ``build``, quoted from a fork at that revision); the fixed lines are reconstructed
from the description. The description does not quote the resulting error; ``pad_for_cudagraph`` documents
that a size above ``max_capture_size`` raises ``IndexError``, which is what this model raises.
"""
from __future__ import annotations

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/26499"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build"
SYMPTOM = "a spec-decode batch with more tokens than the largest graph crashes FlashInfer's graph-path padding"

VOCAB, DIM = 16, 4
BLOCK_SIZE, MAX_MODEL_LEN = 2, 12
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
NULL_BLOCK, PAD_SLOT_ID = 0, -1
NUM_SPEC = 2                                  # num_speculative_tokens: 1 + 2 query tokens per decode
Q_LEN = 1 + NUM_SPEC
MAX_NUM_REQS = 4
CAPTURE_SIZES = [3, 6]                        # FULL uniform-decode graphs: 1 and 2 requests
MAX_CAPTURE_SIZE = max(CAPTURE_SIZES)
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS
MAX_NUM_TOKENS = MAX_NUM_REQS * MAX_MODEL_LEN


class VllmConfig:
    def __init__(self):
        # compilation_config.bs_to_padded_graph_size: entry n is the smallest capture size >= n
        self.bs_to_padded_graph_size = [min(s for s in CAPTURE_SIZES if s >= n) for n in range(MAX_CAPTURE_SIZE + 1)]

    def pad_for_cudagraph(self, batch_size: int) -> int:
        # if batch_size > max_capture_size, it should raise an IndexError;
        # the caller should make sure the batch_size is within the range.
        return self.bs_to_padded_graph_size[batch_size]


class Model:
    def __init__(self, device):
        gen = generator(26499)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.ctx_pos = torch.arange(MAX_MODEL_LEN, device=device)
        self.tok_idx = torch.arange(MAX_NUM_TOKENS, device=device)


class FlashInferMetadataBuilder:
    def __init__(self, vllm_config, variant, enable_cuda_graph, block_table, seq_lens):
        self.vllm_config, self.variant = vllm_config, variant
        self.enable_cuda_graph = enable_cuda_graph
        if self.enable_cuda_graph:
            # For full cudagraph capture, one `decode_wrapper` for each batch size is needed.
            self._decode_wrappers_cudagraph: dict[int, dict] = {}
            if variant == "fix":
                self._decode_cudagraph_max_bs = min((1 + NUM_SPEC) * MAX_NUM_REQS, MAX_CAPTURE_SIZE)
            else:
                self._decode_cudagraph_max_bs = min(MAX_NUM_REQS, MAX_CAPTURE_SIZE)
        self._decode_wrapper = None
        self.block_table, self.seq_lens = block_table, seq_lens           # the runner's persistent buffers
        # host-side persistent buffers (the planner's inputs)
        self.paged_kv_indptr_cpu = np.zeros(MAX_NUM_REQS + 1, dtype=np.int32)
        self.paged_kv_last_page_len_cpu = np.zeros(MAX_NUM_REQS, dtype=np.int32)

    def _get_decode_wrapper(self, batch_size: int, use_cudagraph: bool):
        wrapper = self._decode_wrappers_cudagraph.get(batch_size) if use_cudagraph else self._decode_wrapper
        if wrapper is None:
            wrapper = {"use_cuda_graph": use_cudagraph, "batch_size": batch_size}
            if use_cudagraph:
                self._decode_wrappers_cudagraph[batch_size] = wrapper
            else:
                self._decode_wrapper = wrapper
        return wrapper

    def build(self, num_decodes: int, num_decode_tokens: int, seq_lens_cpu: np.ndarray) -> dict:
        num_blocks = (seq_lens_cpu + BLOCK_SIZE - 1) // BLOCK_SIZE
        self.paged_kv_indptr_cpu[0] = 0
        np.cumsum(num_blocks, out=self.paged_kv_indptr_cpu[1:num_decodes + 1])
        last = seq_lens_cpu % BLOCK_SIZE
        self.paged_kv_last_page_len_cpu[:num_decodes] = np.where(last == 0, BLOCK_SIZE, last)
        meta = {"num_decodes": num_decodes, "num_decode_tokens": num_decode_tokens,
                "seq_lens": self.seq_lens[:num_decodes], "block_table": self.block_table[:num_decodes],
                "max_seq_len": int(seq_lens_cpu.max())}
        # possible required padding for cudagraph replay
        if self.variant == "fix":
            use_cudagraph = self.enable_cuda_graph and num_decode_tokens <= self._decode_cudagraph_max_bs
        else:
            use_cudagraph = self.enable_cuda_graph and num_decodes <= self._decode_cudagraph_max_bs
        if use_cudagraph:
            num_input_tokens = self.vllm_config.pad_for_cudagraph(num_decode_tokens)
            # Make sure paged_kv_indptr_cpu is not decreasing
            self.paged_kv_indptr_cpu[1 + num_decodes:1 + num_input_tokens] = self.paged_kv_indptr_cpu[num_decodes]
            # flashinfer treats 0 as a full page instead of empty.
            self.paged_kv_last_page_len_cpu[num_decodes:num_input_tokens] = 1
        else:
            num_input_tokens = num_decode_tokens
        meta["decode_wrapper"] = self._get_decode_wrapper(num_input_tokens, use_cudagraph)
        return meta


def reshape_and_cache_flash(key, kv_cache, slot_mapping):
    valid = (slot_mapping >= 0)[:, None]
    slots = slot_mapping.clamp(min=0)
    kv_cache[slots] = torch.where(valid, key, kv_cache[slots])


def trtllm_batch_decode_with_kv_cache(model, query, kv_cache, block_tables, seq_lens, q_len_per_req):
    """Uniform multi-token decode (spec verify): query token j of request r sits at position
    ``seq_lens[r] - q_len_per_req + j`` and attends causally over the request's cached keys."""
    n = query.shape[0]
    tok = model.tok_idx[:n]
    req = tok // q_len_per_req
    qpos = seq_lens[req] - q_len_per_req + tok % q_len_per_req
    pos = model.ctx_pos
    slots = block_tables[req][:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k = kv_cache[slots]
    scores = (k @ query[:, :, None]).squeeze(-1).masked_fill(pos[None, :] > qpos[:, None], -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


def forward(model, kv_cache, input_ids, slot_mapping, block_tables, seq_lens):
    h = model.emb[input_ids]
    reshape_and_cache_flash(h @ model.wk, kv_cache, slot_mapping)
    o = trtllm_batch_decode_with_kv_cache(model, h @ model.wq, kv_cache, block_tables, seq_lens, Q_LEN)
    return h + o @ model.wo


def prefill_forward(model, kv_cache, input_ids, slot_mapping, block_tables, token_req, token_pos):
    h = model.emb[input_ids]
    reshape_and_cache_flash(h @ model.wk, kv_cache, slot_mapping)
    pos = model.ctx_pos
    slots = block_tables[token_req][:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k = kv_cache[slots]
    scores = (k @ (h @ model.wq)[:, :, None]).squeeze(-1).masked_fill(pos[None, :] > token_pos[:, None], -1e9)
    return h + (torch.softmax(scores, -1)[:, :, None] * k).sum(1) @ model.wo


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.kv_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((MAX_NUM_TOKENS,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.vllm_config = VllmConfig()
        self.attn_metadata_builder = FlashInferMetadataBuilder(
            self.vllm_config, variant, enable_cuda_graph=graphed, block_table=self.block_table, seq_lens=self.seq_lens)
        self.graphs = {}
        if graphed:
            pool = graph_pool_handle(device)
            static = {"input_ids": self.input_ids, "slot_mapping": self.slot_mapping,
                      "block_table": self.block_table, "seq_lens": self.seq_lens}
            for size in sorted(CAPTURE_SIZES, reverse=True):
                reqs = size // Q_LEN
                self.seq_lens[:reqs].fill_(Q_LEN)             # dummy decode batch on the null block
                self.block_table[:reqs].fill_(NULL_BLOCK)
                self.slot_mapping[:size].fill_(PAD_SLOT_ID)
                self.graphs[size] = capture(
                    lambda size=size, reqs=reqs: forward(model, self.kv_cache, self.input_ids[:size],
                                                         self.slot_mapping[:size], self.block_table[:reqs],
                                                         self.seq_lens[:reqs]),
                    device=device, pool=pool, name=f"size {size}", static=static,
                    state={"kv_cache": self.kv_cache}, owner="GPUModelRunner (FULL uniform-decode graphs)")

    def _prepare_inputs(self, reqs):
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        ids, slots, token_req, token_pos, seq_lens = [], [], [], [], []
        for r, (tokens, computed, blocks) in enumerate(reqs):
            for j, tok in enumerate(tokens):
                p = computed + j
                ids.append(tok)
                slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                token_req.append(r)
                token_pos.append(p)
            seq_lens.append(computed + len(tokens))
        n, r = len(ids), len(reqs)
        self.input_ids[:n].copy_(t(ids))
        self.slot_mapping[:n].copy_(t(slots))
        self.block_table[:r].copy_(t([b + [NULL_BLOCK] * (MAX_BLOCKS - len(b)) for _, _, b in reqs]))
        self.seq_lens[:r].copy_(t(seq_lens))
        return n, r, t(token_req), t(token_pos), np.asarray(seq_lens, dtype=np.int64)

    def execute_model(self, reqs, decode: bool):
        n, r, token_req, token_pos, seq_lens_cpu = self._prepare_inputs(reqs)
        if not decode:
            return prefill_forward(self.model, self.kv_cache, self.input_ids[:n], self.slot_mapping[:n],
                                   self.block_table[:r], token_req, token_pos).clone()
        self.attn_metadata_builder.build(num_decodes=r, num_decode_tokens=n, seq_lens_cpu=seq_lens_cpu)
        if self.graphed and n in self.graphs:                # the dispatcher: a FULL graph of this size
            return replay(self.graphs[n][0], self.graphs[n][1]).clone()
        return forward(self.model, self.kv_cache, self.input_ids[:n], self.slot_mapping[:n],
                       self.block_table[:r], self.seq_lens[:r]).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(2649)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (3, 2, 4)]
    blocks = [[1 + MAX_BLOCKS * i + b for b in range(MAX_BLOCKS)] for i in range(3)]
    drafts = lambda: torch.randint(1, VOCAB, (Q_LEN,), generator=gen).tolist()  # noqa: E731
    schedule = [[0], [0, 1], [0, 1, 2], [1, 2]]            # requests decoding at each step
    steps = [[drafts() for _ in step] for step in schedule]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        outs = [runner.execute_model([(p, 0, b) for p, b in zip(prompts, blocks)], decode=False)]
        lens = [len(p) for p in prompts]
        for step, tokens in zip(schedule, steps):
            outs.append(runner.execute_model([(tok, lens[i], blocks[i]) for i, tok in zip(step, tokens)],
                                             decode=True))
            for i in step:
                lens[i] += Q_LEN                             # all drafts accepted, for brevity
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
