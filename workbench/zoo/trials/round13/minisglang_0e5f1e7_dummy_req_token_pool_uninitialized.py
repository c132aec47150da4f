"""Decode graphs pad the batch with a dummy request whose input token comes from an uninitialized token pool.

Upstream: https://github.com/sgl-project/mini-sglang/commit/0e5f1e7e870c478a60c3f2ad5f25413b59cfacfb
("[fix] fix wrong token_pool initialization").
Symptom: with decode CUDA graphs on, a decode batch whose size is not a capture size pads rows whose
input token id is whatever the token pool's spare row held: usually far outside the vocabulary, so the
replayed embedding gather reads out of bounds (an illegal memory access on a GPU); with CUDA graphs disabled
nothing pads and the same requests are served fine (mini-sglang main, January 2026). The commit gives no
user report; the symptom follows from the diff and its comment.
Mechanism: ``GraphRunner.pad_batch`` pads a decode batch up to the next capture size with
``self.dummy_req``, a request that owns the spare row ``table_idx = max_running_req`` of the page table and
token pool, with ``cached_len = 0`` and ``device_len = 1``. ``Scheduler._prepare_batch`` builds the load
indices over ``batch.padded_reqs``, so each padded row reads its input id from ``token_pool[dummy, 0]``, and
``prepare_for_replay`` copies those ids into the graph's ``input_ids`` buffer. Nothing ever writes that
token-pool row (the dummy request never prefills), and ``TableManager`` created the pool with
``torch.empty_like``: the padded rows' token ids are whatever that memory held, usually outside the
vocabulary, and the replayed embedding gathers from out of bounds. The eager path never pads, so it never
reads the row.
Doctor: stale-padding, at ``pad_batch`` (the padded rows read their input id from a token-pool row no step
writes).
Fix (upstream): ``TableManager`` creates the pool with ``torch.zeros_like``, so the dummy request's token id
is 0, a valid id ("dummy request also use this pool to get the input ids").
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/mini-sglang/commit/0e5f1e7e870c478a60c3f2ad5f25413b59cfacfb"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "pad_batch"
SYMPTOM = "padded decode rows embed a garbage token id from the never-written dummy row (illegal memory access upstream)"
VOCAB, DIM, MAX_RUNNING_REQ, MAX_SEQ_LEN, CUDA_GRAPH_BS = 11, 4, 3, 8, [4]
GARBAGE = 0x3F3F3F3F        # what freshly allocated device memory happened to hold (a fixed stand-in)


def empty_like(t: torch.Tensor, dtype) -> torch.Tensor:
    """``torch.empty_like``: the previous contents of the memory (deterministic here, never zero)."""
    return torch.full_like(t, GARBAGE, dtype=dtype)


class Req:
    def __init__(self, table_idx, input_len):
        self.table_idx, self.cached_len, self.device_len = table_idx, input_len - 1, input_len

    def complete_one(self):
        self.cached_len, self.device_len = self.device_len, self.device_len + 1


class Batch:
    def __init__(self, reqs):
        self.reqs = reqs
        self.padded_reqs = reqs

    @property
    def size(self):
        return len(self.reqs)

    @property
    def padded_size(self):
        return len(self.padded_reqs)


class TableManager:
    def __init__(self, page_table, zero_init: bool):
        self.page_table = page_table
        # NOTE: dummy request also use this pool to get the input ids (the fix: token_id = 0)
        self.token_pool = (torch.zeros_like(page_table, dtype=torch.int32) if zero_init
                           else empty_like(page_table, dtype=torch.int32))


class Qwen3ForCausalLM:
    def __init__(self, device):
        gen = generator(58)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_SEQ_LEN, DIM, gen=gen, device=device, scale=0.3)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.7)

    def forward(self, input_ids, positions):
        h = self.embed_tokens[input_ids.long()] + self.pos[positions.long()]   # VocabParallelEmbedding, tp=1
        return torch.tanh(h) @ self.lm_head


class GraphRunner:
    def __init__(self, model, device, cuda_graph_bs, dummy_req):
        self.model = model
        self.max_graph_bs = max(cuda_graph_bs) if cuda_graph_bs else 0
        self.graph_bs_list = sorted(cuda_graph_bs)
        self.dummy_req = dummy_req
        self.graph_map = {}
        if self.max_graph_bs:
            # FICaptureData: the buffers the graphs read
            self.input_ids = torch.zeros(self.max_graph_bs, dtype=torch.int32, device=device)
            self.positions = torch.zeros(self.max_graph_bs, dtype=torch.int32, device=device)
            for bs in self.graph_bs_list:
                ids, pos = self.input_ids[:bs], self.positions[:bs]
                self.graph_map[bs] = capture(lambda: self.model.forward(ids, pos), device=device,
                                             static={"input_ids": self.input_ids, "positions": self.positions},
                                             owner="GraphRunner (decode)", name=f"bs {bs}")

    def can_use_cuda_graph(self, batch):
        return batch.size <= self.max_graph_bs

    def pad_batch(self, batch):
        padded_size = (  # choose the first available batch size
            next(bs for bs in self.graph_bs_list if bs >= batch.size)
            if self.can_use_cuda_graph(batch) else batch.size)
        batch.padded_reqs = batch.reqs + [self.dummy_req] * (padded_size - batch.size)
        return batch.padded_size - batch.size

    def replay(self, batch):
        g, logits = self.graph_map[batch.padded_size]
        bs = batch.padded_size
        self.input_ids[:bs].copy_(batch.input_ids)        # prepare_for_replay
        self.positions[:bs].copy_(batch.positions)
        return replay(g, logits, real=batch.size, size=bs)[: batch.size]


def run(variant: str, device: str = "cpu"):
    prompts = [[3, 7, 1], [5, 2], [9]]

    def serve(graphed: bool):
        model = Qwen3ForCausalLM(device)
        page_table = torch.zeros(MAX_RUNNING_REQ + 1, MAX_SEQ_LEN, dtype=torch.int32, device=device)
        table = TableManager(page_table, zero_init=(variant == "fix"))
        token_pool = table.token_pool
        dummy_req = Req(table_idx=MAX_RUNNING_REQ, input_len=1)      # cached_len 0, device_len 1
        runner = GraphRunner(model, device, CUDA_GRAPH_BS if graphed else [], dummy_req)
        reqs = []
        for i, prompt in enumerate(prompts):       # prefill already wrote the prompts' tokens
            token_pool[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.int32, device=device)
            reqs.append(Req(table_idx=i, input_len=len(prompt)))
        outs = []
        for _ in range(3):                          # decode steps: 3 real rows, padded to 4
            batch = Batch(reqs)
            runner.pad_batch(batch)
            rows = torch.tensor([r.table_idx for r in batch.padded_reqs], device=device)
            cols = torch.tensor([r.device_len - 1 for r in batch.padded_reqs], device=device)
            batch.input_ids = token_pool[rows, cols]             # _load_token_ids
            batch.positions = cols.to(torch.int32)
            if runner.can_use_cuda_graph(batch):
                logits = runner.replay(batch)
            else:
                logits = model.forward(batch.input_ids, batch.positions)
            outs.append(logits.clone())
            next_tokens = logits.argmax(-1).to(torch.int32)
            for r, tok in zip(batch.reqs, next_tokens):          # _write_token_ids
                token_pool[r.table_idx, r.device_len] = tok
                r.complete_one()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
