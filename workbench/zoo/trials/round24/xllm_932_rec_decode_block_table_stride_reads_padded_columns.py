"""REC multi-round decode graph: ``decoder_reshape_and_cache`` reads the sliced persistent block table as contiguous.

Upstream: https://github.com/xLLM-AI/xllm/pull/932 ("bugfix: fix REC multi-round CUDA graph accuracy
crash.", commit dbdaeb88).
Symptom: generative-recommendation (REC) multi-round beam decoding on CUDA gave results that did not match
eager when ``enable_graph=true`` ("accuracy mismatch in REC multi-round decode"), February 2026.
Mechanism: in REC multi-round mode each sequence (``batch_size * beam_width`` of them) owns one row of
the unshared KV region; ``LlmRecMultiRoundPipeline`` passes ``block_tables =
cached_naive_block_table_[:num_seqs]``, an int32 ``[num_seqs, 1]`` table (the sequence's own slot).
``decoder_reshape_and_cache`` took ``block_table.select(1, 0).to(torch::kInt32)`` and its kernel read
``block_table[seq_idx]`` from that pointer as a contiguous array. Eager passes the naive table itself
(stride 1). The CUDA graph executor instead copies it into ``persistent_block_tables_`` (int32
``[max_seqs_per_batch, max_block_table_len]``, zeros) and hands the model the slice ``[:n, :1]``:
``select(1, 0)`` of it has stride ``max_block_table_len`` and ``.to(kInt32)`` of an int32 tensor is
that same view, so sequence ``i`` reads element ``i`` of row 0, i.e. a column past the table's real
width that the step never writes (0). Every beam then writes its K/V into block 0 and the later
rounds' attention reads zeros where each beam's decoded keys should be.
Doctor: stale-padding, at ``decoder_reshape_and_cache`` (it reads block ids from the padded columns of
``persistent_block_tables_``).
Fix (upstream): pass ``block_table.stride(0)`` to the kernel and read ``block_table[seq_idx *
block_table_stride]`` (no ``select`` copy). The same commit maps backend ``"rec"`` to ``"llm"`` in
``ExecutorImplFactory`` (the non-graph executor choice; not modelled).
Read: the diff (kernel, launcher), ``CudaGraphExecutorImpl::update_input_buffer`` and
``RecWorkerImpl`` at that commit. The model around the kernel (one layer, decode attention over
explicit per-sequence KV indices instead of FlashInfer's plan) is this program's simplification.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/932"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "decoder_reshape_and_cache"
SYMPTOM = "REC multi-round beam decode under CUDA graphs diverges: every beam's KV is written to block 0"

VOCAB, DIM = 16, 4                          # one head, kv_heads = 1, head_dim = DIM
MAX_SEQS_PER_BATCH, BEAM_WIDTH, TOTAL_ROUND = 2, 2, 4
MAX_DECODE_STEP = TOTAL_ROUND - 1           # rounds after the prefill
NUM_SEQS = MAX_SEQS_PER_BATCH * BEAM_WIDTH  # decode rows: the one graph bucket
MAX_TOKENS_PER_BATCH = 8                    # shared (prompt) region of the full KV cache
FULL_KV_LEN = MAX_TOKENS_PER_BATCH + NUM_SEQS * MAX_DECODE_STEP
MAX_SEQ_LEN, BLOCK_SIZE = 16, 4
MAX_BLOCK_TABLE_LEN = (MAX_SEQ_LEN + BLOCK_SIZE - 1) // BLOCK_SIZE + 1
MAX_KV = MAX_TOKENS_PER_BATCH // MAX_SEQS_PER_BATCH + MAX_DECODE_STEP   # per-sequence KV entries


class Model:
    def __init__(self, device):
        gen = generator(932)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_SEQ_LEN, DIM, gen=gen, device=device, scale=0.3)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.kv_pos = torch.arange(MAX_KV, device=device)


def decoder_reshape_and_cache(proj_k, proj_v, unshared_k_cache, unshared_v_cache, block_table, step, variant):
    """``xllm::kernel::cuda::decoder_reshape_and_cache``: K/V of sequence ``i`` go to
    ``unshared_*_cache[block_id, step]``; the kernel reads ``block_id`` through a raw int32 pointer
    (modelled by ``as_strided`` on the pointer's view). One write per sequence, in sequence order."""
    num_seqs = proj_k.shape[0]
    max_num_seqs = unshared_k_cache.shape[0] * unshared_k_cache.shape[1]
    max_decode_step = unshared_k_cache.shape[2]
    if variant == "bug":
        block_table_flat = block_table.select(1, 0).to(torch.int32)     # int32 already: the same view
        block_ids = block_table_flat.as_strided((num_seqs,), (1,))       # block_table[seq_idx]
    else:
        block_table_i32 = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
        block_table_stride = block_table_i32.stride(0)
        block_ids = block_table_i32.as_strided((num_seqs,), (block_table_stride,))  # [seq_idx * stride]
    k_flat = unshared_k_cache.reshape(max_num_seqs * max_decode_step, *unshared_k_cache.shape[3:])
    v_flat = unshared_v_cache.reshape(max_num_seqs * max_decode_step, *unshared_v_cache.shape[3:])
    for seq_idx in range(num_seqs):
        block_id = block_ids[seq_idx:seq_idx + 1].long()
        valid = ((block_id >= 0) & (block_id < max_num_seqs))[:, None, None]   # guard invalid block id
        dst = block_id.clamp(0, max_num_seqs - 1) * max_decode_step + step.long()
        k_flat.index_put_((dst,), torch.where(valid, proj_k[seq_idx:seq_idx + 1], k_flat.index_select(0, dst)))
        v_flat.index_put_((dst,), torch.where(valid, proj_v[seq_idx:seq_idx + 1], v_flat.index_select(0, dst)))


class AttentionMetadata:
    def __init__(self, block_table, step_tensor, paged_kv_indices, kv_seq_lens, full_k_cache, full_v_cache):
        self.block_table, self.step_tensor = block_table, step_tensor
        self.paged_kv_indices, self.kv_seq_lens = paged_kv_indices, kv_seq_lens
        self.full_k_cache, self.full_v_cache = full_k_cache, full_v_cache
        # the unshared region of the full cache, [max_seqs_per_batch, beam, max_decode_step, kv_heads, D]
        shape = (MAX_SEQS_PER_BATCH, BEAM_WIDTH, MAX_DECODE_STEP, 1, DIM)
        self.unshared_k_cache = full_k_cache[MAX_TOKENS_PER_BATCH:].view(shape)
        self.unshared_v_cache = full_v_cache[MAX_TOKENS_PER_BATCH:].view(shape)


def decode_forward(model, tokens, positions, md: AttentionMetadata, variant):
    """One REC decode round (``XAttentionImpl::forward``, decode branch) of a one-layer model."""
    n = tokens.shape[0]
    h = model.embed_tokens[tokens.long()] + model.pos_embed[positions.long()]
    query, key, value = h @ model.wq, (h @ model.wk).view(n, 1, DIM), (h @ model.wv).view(n, 1, DIM)
    decoder_reshape_and_cache(key, value, md.unshared_k_cache, md.unshared_v_cache, md.block_table,
                              md.step_tensor, variant)
    k = md.full_k_cache[md.paged_kv_indices].squeeze(2)                    # [n, MAX_KV, D]
    v = md.full_v_cache[md.paged_kv_indices].squeeze(2)
    scores = (k @ query[:, :, None]).squeeze(-1) / DIM ** 0.5
    scores = scores.masked_fill(model.kv_pos[None, :] >= md.kv_seq_lens[:, None], -1e9)
    out = (torch.softmax(scores, -1)[:, :, None] * v).sum(1)
    return (out @ model.wo + h) @ model.lm_head


def prefill_forward(model, prompt, full_k_cache, full_v_cache, offset):
    """Eager prefill of one request: its prompt K/V go to the shared region at ``offset``."""
    pos = torch.arange(prompt.shape[0], device=prompt.device)
    h = model.embed_tokens[prompt] + model.pos_embed[pos]
    q, k, v = h @ model.wq, h @ model.wk, h @ model.wv
    full_k_cache[offset:offset + prompt.shape[0], 0] = k
    full_v_cache[offset:offset + prompt.shape[0], 0] = v
    scores = (q[-1:] @ k.T) / DIM ** 0.5
    out = torch.softmax(scores, -1) @ v
    return ((out @ model.wo + h[-1:]) @ model.lm_head)[0]


class CudaGraphExecutorImpl:
    """The decode graph executor: persistent input buffers, one graph per bucket (here ``NUM_SEQS``),
    captured on first use (no warmup) and then replayed."""

    def __init__(self, model, device, variant, full_k_cache, full_v_cache, step_tensor):
        self.model, self.device, self.variant = model, device, variant
        self.full_k_cache, self.full_v_cache, self.step_tensor = full_k_cache, full_v_cache, step_tensor
        self.persistent_tokens_ = torch.zeros(NUM_SEQS, dtype=torch.int32, device=device)
        self.persistent_positions_ = torch.zeros(NUM_SEQS, dtype=torch.int32, device=device)
        self.persistent_block_tables_ = torch.zeros(NUM_SEQS, MAX_BLOCK_TABLE_LEN, dtype=torch.int32, device=device)
        self.persistent_paged_kv_indices_ = torch.zeros(NUM_SEQS, MAX_KV, dtype=torch.long, device=device)
        self.persistent_kv_seq_lens_ = torch.zeros(NUM_SEQS, dtype=torch.long, device=device)
        self.graphs = {}

    def update_input_buffer(self, tokens, positions, params):
        n = tokens.shape[0]
        self.persistent_tokens_[:n].copy_(tokens)
        self.persistent_positions_[:n].copy_(positions)
        actual_block_table_len = params["block_tables"].shape[1]
        slice_persistent_block_tables = self.persistent_block_tables_[:n, :actual_block_table_len]
        slice_persistent_block_tables.copy_(params["block_tables"])
        self.persistent_paged_kv_indices_[:n].copy_(params["paged_kv_indices"])
        self.persistent_kv_seq_lens_[:n].copy_(params["kv_seq_lens"])
        return AttentionMetadata(slice_persistent_block_tables, self.step_tensor,
                                 self.persistent_paged_kv_indices_[:n], self.persistent_kv_seq_lens_[:n],
                                 self.full_k_cache, self.full_v_cache)

    def run(self, tokens, positions, params):
        n = tokens.shape[0]
        md = self.update_input_buffer(tokens, positions, params)
        if n not in self.graphs:
            self.graphs[n] = capture(
                lambda: decode_forward(self.model, self.persistent_tokens_[:n], self.persistent_positions_[:n],
                                       md, self.variant),
                device=self.device, warmups=0, name=f"bucket {n}", owner="CudaGraphExecutorImpl (REC decode)",
                static={"persistent_tokens_": self.persistent_tokens_,
                        "persistent_positions_": self.persistent_positions_,
                        "persistent_block_tables_": self.persistent_block_tables_,
                        "current_round_tensor": self.step_tensor,
                        "persistent_paged_kv_indices_": self.persistent_paged_kv_indices_,
                        "persistent_kv_seq_lens_": self.persistent_kv_seq_lens_},
                state={"full_k_cache": self.full_k_cache, "full_v_cache": self.full_v_cache})
        graph, out = self.graphs[n]
        # the step writes column 0 of the block table only: the columns past it hold what they held
        return replay(graph, out, padded_columns={
            "persistent_block_tables_": (self.persistent_block_tables_, params["block_tables"].shape[1])})


class LlmRecMultiRoundPipeline:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device = model, device
        self.full_k_cache = torch.zeros(FULL_KV_LEN, 1, DIM, device=device)
        self.full_v_cache = torch.zeros(FULL_KV_LEN, 1, DIM, device=device)
        self.cached_naive_block_table_ = torch.arange(NUM_SEQS, dtype=torch.int32, device=device).unsqueeze(1)
        self.cached_current_round_tensor_ = torch.zeros(1, dtype=torch.int32, device=device)
        self.executor = (CudaGraphExecutorImpl(model, device, variant, self.full_k_cache, self.full_v_cache,
                                               self.cached_current_round_tensor_) if graphed else None)
        self.variant = variant

    def generate(self, prompts):
        """Prefill each request, take the top ``BEAM_WIDTH`` first tokens as its beams, then decode
        ``MAX_DECODE_STEP`` rounds greedily per beam; returns every round's logits."""
        dev = self.device
        stride = MAX_TOKENS_PER_BATCH // MAX_SEQS_PER_BATCH
        outs, first = [], []
        for r, prompt in enumerate(prompts):
            logits = prefill_forward(self.model, prompt.to(dev), self.full_k_cache, self.full_v_cache, r * stride)
            outs.append(logits.clone())
            first.append(torch.topk(logits, BEAM_WIDTH).indices)
        tokens = torch.cat(first).to(torch.int32)
        lens = [len(p) for p in prompts]
        for step in range(MAX_DECODE_STEP):
            self.cached_current_round_tensor_.fill_(step)
            seq_req = [i // BEAM_WIDTH for i in range(NUM_SEQS)]
            positions = torch.tensor([lens[r] + step for r in seq_req], dtype=torch.int32, device=dev)
            indices, kv_lens = [], []
            for i, r in enumerate(seq_req):
                shared = [r * stride + j for j in range(lens[r])]
                unshared = [MAX_TOKENS_PER_BATCH + i * MAX_DECODE_STEP + s for s in range(step + 1)]
                row = shared + unshared
                kv_lens.append(len(row))
                indices.append(row + [0] * (MAX_KV - len(row)))
            params = {"block_tables": self.cached_naive_block_table_[:NUM_SEQS],
                      "paged_kv_indices": torch.tensor(indices, device=dev),
                      "kv_seq_lens": torch.tensor(kv_lens, device=dev)}
            if self.executor is None:
                md = AttentionMetadata(params["block_tables"], self.cached_current_round_tensor_,
                                       params["paged_kv_indices"], params["kv_seq_lens"],
                                       self.full_k_cache, self.full_v_cache)
                logits = decode_forward(self.model, tokens, positions, md, self.variant)
            else:
                logits = self.executor.run(tokens, positions, params)
            outs.append(logits.clone())
            tokens = logits.argmax(-1).to(torch.int32)
        return outs


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = torch.Generator().manual_seed(7)
    batches = [[torch.randint(0, VOCAB, (3,), generator=gen), torch.randint(0, VOCAB, (4,), generator=gen)]
               for _ in range(2)]

    def serve(graphed: bool):
        pipeline = LlmRecMultiRoundPipeline(model, device, variant, graphed)
        outs = []
        for prompts in batches:
            outs += pipeline.generate(prompts)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
