"""Padded decode-graph rows get slot 0 and write their K/V into the first cache slot of a live request.

Upstream: https://github.com/GeeeekExplorer/nano-vllm/commit/df99418f7d6ca676550f4372cdc6e1521ce8c33d
("simplify": the commit that makes ``run_model`` fill the graph's ``slot_mapping`` with -1 and lets
``store_kvcache_kernel`` skip slot -1).
Symptom: with CUDA graphs on (``enforce_eager=False``) a decode batch whose size is not a capture size
(3 running sequences replay the graph of 4) silently changes the output of the sequence that owns KV block 0;
with ``enforce_eager=True`` every sequence decodes as expected (nano-vllm main, before August 31 2025). No
user report; the symptom follows from the diff.
Mechanism: ``ModelRunner.run_model`` pads a decode batch to the next entry of ``graph_bs``: before the
fix it zeroed every graph variable (``v.zero_()``) and copied the real rows over the first ``bs`` entries.
The padded rows therefore keep ``slot_mapping = 0``, a valid slot: the first token of block 0. The captured
``store_kvcache`` kernel runs over all rows of the graph, so every replay writes the padded rows' key and
value (the embedding of token 0) over the K/V cached in slot 0, and the real rows' attention then reads the
overwritten entry in the same replay. The eager path runs exactly ``bs`` rows and never writes slot 0.
Doctor: stale-padding, at ``store_kvcache`` (padded rows write the cache through slot ids that belong to a
real sequence).
Fix (upstream): ``run_model`` fills ``graph_vars["slot_mapping"]`` with -1 (and zeroes ``context_lens``)
before copying the real rows, and ``store_kvcache_kernel`` returns early for ``slot == -1``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay
from workbench.engine import graph_pool_handle

UPSTREAM = "https://github.com/GeeeekExplorer/nano-vllm/commit/df99418f7d6ca676550f4372cdc6e1521ce8c33d"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "store_kvcache"
SYMPTOM = "the sequence owning KV block 0 decodes from a first token overwritten by the graph's padded row"
VOCAB, D, BLOCK_SIZE, NUM_BLOCKS, MAX_NUM_BLOCKS = 9, 4, 2, 6, 2
GRAPH_BS = [1, 2, 4]


@dataclass
class Context:
    is_prefill: bool = False
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


_CONTEXT = Context()


def set_context(is_prefill, slot_mapping=None, context_lens=None, block_tables=None):
    global _CONTEXT
    _CONTEXT = Context(is_prefill, slot_mapping, context_lens, block_tables)


def get_context():
    return _CONTEXT


def reset_context():
    global _CONTEXT
    _CONTEXT = Context()


def store_kvcache(key, value, k_cache, v_cache, slot_mapping, skip_minus_one: bool):
    """``store_kvcache_kernel[(N,)]``: one program per row writes its key/value at ``slot_mapping[idx]``."""
    for idx in range(key.shape[0]):
        slot = slot_mapping[idx].long().view(1)
        if skip_minus_one:                                    # the fix: `if slot == -1: return`
            safe = slot.clamp(min=0)
            keep = (slot < 0).view(1, 1)
            k_cache.index_put_((safe,), torch.where(keep, k_cache[safe], key[idx].view(1, D)))
            v_cache.index_put_((safe,), torch.where(keep, v_cache[safe], value[idx].view(1, D)))
        else:
            k_cache.index_put_((slot,), key[idx].view(1, D))
            v_cache.index_put_((slot,), value[idx].view(1, D))


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale):
    """Paged decode attention: row i attends over its first ``cache_seqlens[i]`` cached tokens."""
    j = torch.arange(block_table.shape[1] * BLOCK_SIZE, device=q.device)
    slots = block_table.long()[:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
    k, v = k_cache[slots], v_cache[slots]
    scores = (k @ q[:, :, None]).squeeze(-1) * softmax_scale
    mask = j[None, :] < cache_seqlens.long()[:, None]
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    p = torch.where(mask, p, torch.zeros_like(p))             # an empty (padded) row attends to nothing
    return (p[:, :, None] * v).sum(1)


class Qwen3ForCausalLM:
    def __init__(self, device, skip_minus_one: bool):
        gen = generator(99418)
        self.embed_tokens = randn(VOCAB, D, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(D, D, gen=gen, device=device, scale=0.6) for _ in range(4))
        self.lm_head = randn(D, VOCAB, gen=gen, device=device, scale=0.6)
        self.k_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, D, device=device)
        self.v_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, D, device=device)
        self.skip_minus_one = skip_minus_one

    def __call__(self, input_ids, positions):
        context = get_context()
        x = self.embed_tokens[input_ids]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping, self.skip_minus_one)
        if context.is_prefill:
            return None                                       # prefill: only the cache matters here
        o = flash_attn_with_kvcache(q, self.k_cache, self.v_cache, context.context_lens, context.block_tables,
                                    softmax_scale=D ** -0.5)
        return x + o @ self.wo

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class Sequence:
    def __init__(self, token_ids, block_table):
        self.token_ids, self.block_table = list(token_ids), block_table

    def __len__(self):
        return len(self.token_ids)

    @property
    def last_block_num_tokens(self):
        return len(self) - (len(self.block_table) - 1) * BLOCK_SIZE if len(self) > BLOCK_SIZE else len(self)


class ModelRunner:
    def __init__(self, device, enforce_eager: bool, variant: str):
        self.device, self.enforce_eager, self.variant = device, enforce_eager, variant
        self.model = Qwen3ForCausalLM(device, skip_minus_one=(variant == "fix"))
        if not enforce_eager:
            self.capture_cudagraph()

    def prepare_prefill(self, seqs):
        input_ids, positions, slot_mapping = [], [], []
        for seq in seqs:
            input_ids += seq.token_ids
            positions += range(len(seq))
            slot_mapping += [seq.block_table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(len(seq))]
        set_context(True, slot_mapping=torch.tensor(slot_mapping, dtype=torch.int32, device=self.device))
        return (torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device))

    def prepare_decode(self, seqs):
        input_ids = [seq.token_ids[-1] for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        context_lens = [len(seq) for seq in seqs]
        slot_mapping = [seq.block_table[-1] * BLOCK_SIZE + seq.last_block_num_tokens - 1 for seq in seqs]
        block_tables = [seq.block_table + [-1] * (MAX_NUM_BLOCKS - len(seq.block_table)) for seq in seqs]
        dev = self.device
        set_context(False, slot_mapping=torch.tensor(slot_mapping, dtype=torch.int32, device=dev),
                    context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
                    block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev).clamp(min=0))
        return torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev)

    def run_model(self, input_ids, positions, is_prefill):
        if is_prefill or self.enforce_eager:
            out = self.model(input_ids, positions)
            return None if out is None else self.model.compute_logits(out)
        bs = input_ids.size(0)
        context = get_context()
        graph_bs = next(x for x in GRAPH_BS if x >= bs)
        graph = self.graphs[graph_bs]
        graph_vars = self.graph_vars
        if self.variant == "bug":
            for k, v in graph_vars.items():
                if k != "outputs":
                    v.zero_()
        graph_vars["input_ids"][:bs] = input_ids
        graph_vars["positions"][:bs] = positions
        if self.variant == "fix":
            graph_vars["slot_mapping"].fill_(-1)
        graph_vars["slot_mapping"][:bs] = context.slot_mapping
        if self.variant == "fix":
            graph_vars["context_lens"].zero_()
        graph_vars["context_lens"][:bs] = context.context_lens
        graph_vars["block_tables"][:bs, :context.block_tables.size(1)] = context.block_tables
        out = replay(graph, self.graph_outputs[graph_bs], real=bs, size=graph_bs)
        return self.model.compute_logits(out[:bs])

    def capture_cudagraph(self):
        dev, max_bs = self.device, max(GRAPH_BS)
        input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        slot_mapping = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        context_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        block_tables = torch.zeros(max_bs, MAX_NUM_BLOCKS, dtype=torch.int32, device=dev)
        outputs = torch.zeros(max_bs, D, device=dev)
        self.graphs, self.graph_outputs, self.graph_pool = {}, {}, graph_pool_handle(dev)
        static = dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                      context_lens=context_lens, block_tables=block_tables)
        for bs in reversed(GRAPH_BS):
            set_context(False, slot_mapping=slot_mapping[:bs], context_lens=context_lens[:bs],
                        block_tables=block_tables[:bs])

            def forward(bs=bs):
                outputs[:bs] = self.model(input_ids[:bs], positions[:bs])
                return outputs[:bs]

            self.graphs[bs], self.graph_outputs[bs] = capture(
                forward, device=dev, pool=self.graph_pool, name=f"decode bs={bs}", static=static,
                state={"k_cache": self.model.k_cache, "v_cache": self.model.v_cache}, owner="nano-vllm ModelRunner")
            reset_context()
        self.graph_vars = dict(static, outputs=outputs)


def run(variant: str, device: str = "cpu"):
    def serve(enforce_eager: bool):
        runner = ModelRunner(device, enforce_eager, variant)
        # three sequences, two prompt tokens each; A owns block 0, whose slot 0 holds A's first token
        seqs = [Sequence([1, 2], [0, 1]), Sequence([3, 4], [2, 3]), Sequence([5, 6], [4, 5])]
        input_ids, positions = runner.prepare_prefill(seqs)
        runner.run_model(input_ids, positions, True)
        outs = []
        for step_tokens in ([7, 8, 2], [4, 1, 3]):
            for seq, t in zip(seqs, step_tokens):
                seq.token_ids.append(t)
            input_ids, positions = runner.prepare_decode(seqs)
            outs.append(runner.run_model(input_ids, positions, False).clone())   # 3 rows -> graph of 4
            reset_context()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
