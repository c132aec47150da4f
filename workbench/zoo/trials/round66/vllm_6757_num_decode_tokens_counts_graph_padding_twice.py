"""Attention metadata for a padded CUDA-graph decode batch counts the padding twice in ``num_decode_tokens``.

Upstream: https://github.com/vllm-project/vllm/pull/6757 ("[Bugfix] Fix decode tokens w. CUDA graph", commit
309aaef82, July 2024); issue https://github.com/vllm-project/vllm/issues/6703 ("Flash-attn on-GPU advance step
optimization bug with spec decode on LLama 405B").
Symptom: speculative decoding with a draft model on the TP1 draft runner's GPU multi-step path fails with CUDA
graphs as soon as a decode batch is not a capture size (it is padded): ``assert attn_metadata.num_decode_tokens
== num_seqs`` in ``TP1DraftModelRunner._update_flash_attn_metadata`` raises after the first draft step. With
``enforce_eager`` (no padding) it works. The PR: "The new added assertion will fail without this PR."
Mechanism: ``ModelRunner._prepare_model_input`` pads a decode batch of ``bs`` to ``graph_batch_size``
(``_get_graph_batch_size``), sets ``cuda_graph_pad_size = graph_bs - bs``, pads input tokens, positions and
``seq_lens`` (with 1), and calls ``attn_metadata_builder.build(seq_lens, query_lens, cuda_graph_pad_size,
batch_size=graph_bs)``. In ``CommonMetadataBuilder.build`` (and ``FlashAttentionMetadataBuilder.build``,
``FlashInferMetadataBuilder.build``) the captured-graph branch pads ``slot_mapping`` with ``PAD_SLOT_ID`` and set
``num_decode_tokens = batch_size + cuda_graph_pad_size``: ``batch_size`` is already the padded size, so the field
says ``bs + 2 * pad`` while every per-token tensor has ``graph_bs`` rows. The graph replay itself reads only the
tensors; the multi-step draft runner, which advances the padded metadata on the GPU between replays, checks the
field against the padded sequence count and stops.
Doctor: padded-shape-mismatch, at ``build`` (the metadata of a graph's padded batch gives a token count that
matches neither the padded rows nor the real ones).
Fix (upstream): ``num_decode_tokens = batch_size`` in the three ``build`` methods; the test of
``_prepare_decode`` for CUDA graphs asserts ``attn_metadata.num_decode_tokens == len(seq_lens)``.
Modelled: one decode layer (paged KV cache, one head), greedy sampling, ``ops.advance_step`` in torch; only the
asserts of ``_update_flash_attn_metadata`` that concern token counts; no prefill, no bonus-token expansion.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/6757"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "build"
SYMPTOM = "multi-step draft decoding under CUDA graphs asserts num_decode_tokens == num_seqs on padded batches"

VOCAB, DIM, BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 16, 4, 4, 4, 16
NULL_SLOT = NUM_BLOCKS * BLOCK_SIZE              # where reshape_and_cache "skips" PAD_SLOT_ID
PAD_SLOT_ID = -1
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4]


def _get_graph_batch_size(batch_size: int) -> int:
    return next(bs for bs in _BATCH_SIZES_TO_CAPTURE if bs >= batch_size)


class FlashAttentionMetadata:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class CommonMetadataBuilder:
    def __init__(self, runner, variant):
        self.runner, self.variant = runner, variant

    def build(self, seqs, seq_lens, query_lens, cuda_graph_pad_size: int, batch_size: int):
        device = self.runner.device
        use_captured_graph = cuda_graph_pad_size != -1
        slot_mapping, block_tables = [], []
        for s in seqs:                                        # _add_seq_group (decodes only)
            pos = s["seq_len"] - 1
            slot_mapping.append(s["block_table"][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            block_tables.append(s["block_table"])
        num_decode_tokens = len(seqs)                         # self.num_decode_tokens
        if use_captured_graph:
            slot_mapping.extend([PAD_SLOT_ID] * cuda_graph_pad_size)
            if self.variant == "bug":
                num_decode_tokens = batch_size + cuda_graph_pad_size
            else:
                num_decode_tokens = batch_size
            input_block_tables = torch.zeros(batch_size, MAX_BLOCKS, dtype=torch.int32)   # graph_block_tables
            for i, bt in enumerate(block_tables):
                input_block_tables[i, :len(bt)] = torch.tensor(bt, dtype=torch.int32)
            block_tables_t = input_block_tables.to(device)
        else:
            block_tables_t = torch.tensor([bt + [0] * (MAX_BLOCKS - len(bt)) for bt in block_tables],
                                          dtype=torch.int32, device=device)       # make_tensor_with_pad
        return FlashAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=num_decode_tokens,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            seq_lens=list(seq_lens), seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(query_lens), max_decode_seq_len=max(seq_lens),
            block_tables=block_tables_t, use_cuda_graph=use_captured_graph)


class DraftModel:
    def __init__(self, device):
        gen = generator(6757)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(32, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, positions, kv_cache, slot_mapping, seq_lens_tensor, block_tables):
        k_cache, v_cache = kv_cache
        h = self.embed[input_ids] + self.pos[positions]
        slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, NULL_SLOT), slot_mapping)
        k_cache[slots] = h @ self.wk                          # reshape_and_cache (skips PAD_SLOT_ID)
        v_cache[slots] = h @ self.wv
        ctx = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=h.device)
        table = block_tables.long()[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
        scores = (k_cache[table] @ (h @ self.wq)[:, :, None]).squeeze(-1)
        scores = scores.masked_fill(ctx[None, :] >= seq_lens_tensor.long()[:, None], -1e9)
        return h + (torch.softmax(scores, -1)[:, :, None] * v_cache[table]).sum(1) @ self.wo

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class CUDAGraphRunner:
    def __init__(self, model, kv_cache, bs, buffers, pool, device):
        self.input_buffers = {k: v[:bs] for k, v in buffers.items()}
        b = self.input_buffers
        self.graph, self.output = capture(
            lambda: model.forward(b["input_ids"], b["positions"], kv_cache, b["slot_mapping"],
                                  b["seq_lens_tensor"], b["block_tables"]),
            device=device, pool=pool, name=f"draft decode bs={bs}", owner="CUDAGraphRunner (draft model)",
            static=buffers, state={"k_cache": kv_cache[0], "v_cache": kv_cache[1]})

    def __call__(self, input_ids, positions, attn_metadata, num_queries):
        b = self.input_buffers
        b["input_ids"].copy_(input_ids)
        b["positions"].copy_(positions)
        b["slot_mapping"].copy_(attn_metadata.slot_mapping)
        b["seq_lens_tensor"].copy_(attn_metadata.seq_lens_tensor)
        b["block_tables"].copy_(attn_metadata.block_tables)
        return replay(self.graph, self.output, real=num_queries, size=input_ids.shape[0])


class TP1DraftModelRunner:
    def __init__(self, device, variant, enforce_eager):
        self.device, self.model = device, DraftModel(device)
        gen = generator(6703)
        self.kv_cache = tuple(randn(NULL_SLOT + 1, DIM, gen=gen, device=device) for _ in range(2))
        self.attn_metadata_builder = CommonMetadataBuilder(self, variant)
        self.graph_runners = {}
        if not enforce_eager:                                 # capture_model (dummy metadata: no padding)
            max_bs = _BATCH_SIZES_TO_CAPTURE[-1]
            z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
            buffers = {"input_ids": z(max_bs), "positions": z(max_bs), "slot_mapping": z(max_bs).fill_(NULL_SLOT),
                       "seq_lens_tensor": z(max_bs, dtype=torch.int32) + 1,
                       "block_tables": z(max_bs, MAX_BLOCKS, dtype=torch.int32)}
            pool = graph_pool_handle(device)
            for bs in reversed(_BATCH_SIZES_TO_CAPTURE):
                self.graph_runners[bs] = CUDAGraphRunner(self.model, self.kv_cache, bs, buffers, pool, device)

    def _prepare_model_input(self, seqs):
        batch_size = len(seqs)
        cuda_graph_pad_size = -1
        if self.graph_runners:
            graph_batch_size = _get_graph_batch_size(batch_size)
            cuda_graph_pad_size = graph_batch_size - batch_size
            batch_size = graph_batch_size
        pad = max(cuda_graph_pad_size, 0)
        d = self.device
        input_tokens = torch.tensor([s["last_token"] for s in seqs] + [0] * pad, device=d)
        input_positions = torch.tensor([s["seq_len"] - 1 for s in seqs] + [0] * pad, device=d)
        seq_lens = [s["seq_len"] for s in seqs] + [1] * pad
        query_lens = [1] * len(seqs)
        attn_metadata = self.attn_metadata_builder.build(seqs, seq_lens, query_lens, cuda_graph_pad_size, batch_size)
        return {"input_tokens": input_tokens, "input_positions": input_positions, "attn_metadata": attn_metadata,
                "seq_lens": seq_lens, "query_lens": query_lens}

    def _update_flash_attn_metadata(self, attn_metadata, num_seqs, num_queries):
        if num_seqs != num_queries:
            assert num_seqs > num_queries
            assert attn_metadata.use_cuda_graph
        assert attn_metadata.num_prefills == 0
        assert attn_metadata.num_prefill_tokens == 0
        assert attn_metadata.num_decode_tokens == num_seqs
        assert attn_metadata.slot_mapping.shape == (num_seqs, )
        assert len(attn_metadata.seq_lens) == num_seqs
        assert attn_metadata.block_tables.shape[0] == num_seqs
        for i in range(num_queries):
            attn_metadata.seq_lens[i] += 1
        attn_metadata.max_decode_seq_len = max(attn_metadata.seq_lens)

    def _gpu_advance_step(self, model_input, sampled_token_ids):
        num_seqs, num_queries = len(model_input["seq_lens"]), len(model_input["query_lens"])
        attn_metadata = model_input["attn_metadata"]
        self._update_flash_attn_metadata(attn_metadata, num_seqs, num_queries)
        # ops.advance_step: only the first num_queries rows move on
        q = slice(0, num_queries)
        model_input["input_tokens"][q] = sampled_token_ids
        pos = attn_metadata.seq_lens_tensor[q].long()
        model_input["input_positions"][q] = pos
        attn_metadata.seq_lens_tensor[q] += 1
        table = attn_metadata.block_tables[q].long()
        attn_metadata.slot_mapping[q] = table.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1) * BLOCK_SIZE \
            + pos % BLOCK_SIZE
        return model_input

    def execute_model(self, model_input, num_steps):
        num_queries = len(model_input["query_lens"])
        use_cuda_graph = model_input["attn_metadata"].use_cuda_graph
        if use_cuda_graph:
            model_executable = self.graph_runners[model_input["input_tokens"].shape[0]]
        outputs = []
        selected_token_indices = torch.arange(num_queries, device=self.device)
        for step in range(num_steps):
            m = model_input["attn_metadata"]
            if use_cuda_graph:
                hidden_states = model_executable(model_input["input_tokens"], model_input["input_positions"], m,
                                                 num_queries)
            else:
                hidden_states = self.model.forward(model_input["input_tokens"], model_input["input_positions"],
                                                   self.kv_cache, m.slot_mapping, m.seq_lens_tensor, m.block_tables)
            logits = self.model.compute_logits(hidden_states.index_select(0, selected_token_indices))
            sampled = logits.argmax(-1)
            outputs += [logits, sampled]
            if step != num_steps - 1:
                model_input = self._gpu_advance_step(model_input, sampled)
        return outputs


def run(variant: str, device: str = "cpu"):
    # decode batches of sequences: (last token, seq_len, block table); 2 is a capture size, 3 is padded to 4
    batches = [[(3, 5, [1, 2]), (7, 3, [3, 14])],
               [(3, 6, [1, 2]), (11, 2, [4]), (9, 7, [5, 6, 13])],
               [(5, 9, [7, 8, 9]), (1, 4, [10, 15]), (14, 6, [11, 12])]]

    def serve(enforce_eager: bool):
        runner = TP1DraftModelRunner(device, variant, enforce_eager)
        outs = []
        for batch in batches:
            seqs = [{"last_token": t, "seq_len": n, "block_table": bt} for t, n, bt in batch]
            outs += runner.execute_model(runner._prepare_model_input(seqs), num_steps=3)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
