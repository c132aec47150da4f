"""A shrunken text batch clears only its prefix of ``b_position_delta``; the next larger batch's graph reads an old image delta.

Upstream: https://github.com/ModelTC/LightLLM/commit/0ff0abde125cc9c7cfbb6b730e1560d4342dc2da ("fix: flush stale
b_position_delta rows in mtp fused decode graph"; also a6abc557 on another branch; no issue, no PR).
Symptom: after a larger batch that held a multimodal request, a later text-only batch of that size decodes with
wrong M-RoPE positions (wrong / degraded tokens, no crash); the commit: "the graph reads the old delta left in the
tail, and the mrope position goes wrong".
Mechanism: ``MTPFusedDecodeGraph.__init__`` allocates one static ``b_position_delta`` (max batch rows) and a pinned
``b_position_delta_pin``; every graph ``self.graphs[batch_size]`` was captured with
``infer_state.b_position_delta_gpu = self.b_position_delta[:batch_size]``, which the Qwen2-VL infer state adds to
``position_ids``. ``replay_verify`` stages each request's image delta (``grid_thwd[3]``) into the pin and, to save
an H2D copy, uploads ``[:batch_size]`` only ``if has_delta or self._position_delta_dirty``, then sets
``_position_delta_dirty = has_delta``. Step A (batch 8, request 5 has an image) uploads rows 0..7, dirty = True;
step B (batch 4, text) uploads only rows 0..3 and clears the flag: rows 4..7 still hold A's deltas; step C
(batch 8, text) has neither flag, uploads nothing, and ``graphs[8]`` reads row 5's old delta for a text request.
The eager path builds ``torch.tensor(b_position_delta)`` from the live requests every step.
Doctor: stale-input, at replay_verify (the graph's real rows 4..7 read static ``b_position_delta`` elements that
this step never refreshed: they hold what step A uploaded).
Fix (upstream): the flag becomes a count of possibly dirty rows, ``_position_delta_rows``; the new
``_flush_position_delta(has_delta, batch_size)`` zeroes ``pin[batch_size:n]`` and uploads ``[:n]`` with
``n = max(batch_size, prev_rows)`` whenever ``has_delta or prev_rows > 0``, then keeps
``batch_size if has_delta else 0``. (Miniature: one layer, 1-D RoPE for M-RoPE, verify graph only; the draft
graph and sampling are left out.)
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ModelTC/LightLLM/commit/0ff0abde125cc9c7cfbb6b730e1560d4342dc2da"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "replay_verify"
SYMPTOM = "text request after a shrink-then-grow decodes with an old image's M-RoPE position delta"

VOCAB, DIM = 16, 4
CUDA_GRAPH_BATCH_SIZES = [4, 8]            # graph_max_batch_size 8


@dataclasses.dataclass
class InferReq:
    token: int
    seq_len: int
    images: list                             # multimodal_params["images"]: each {"grid_thwd": (t, h, w, delta)}


@dataclasses.dataclass
class ModelInput:
    batch_size: int
    input_ids: torch.Tensor
    b_seq_len: torch.Tensor


def image_delta(req: InferReq) -> int:
    return sum(image["grid_thwd"][3] for image in req.images)


class Qwen2VLModel:
    def __init__(self, device):
        gen = generator(50)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.inv_freq = (10.0 ** -(torch.arange(DIM // 2, dtype=torch.float32) / (DIM // 2))).to(device)

    def _token_forward(self, input_ids, b_seq_len, b_position_delta_gpu):
        """Qwen2VL infer state: ``position_ids + b_position_delta_gpu``; then one rotary layer and the head."""
        position_ids = (b_seq_len - 1).to(torch.int64) + b_position_delta_gpu
        q = self.emb[input_ids] @ self.wq
        ang = position_ids.to(torch.float32)[:, None] * self.inv_freq[None, :]
        q1, q2 = q[:, : DIM // 2], q[:, DIM // 2:]
        q = torch.cat([q1 * ang.cos() - q2 * ang.sin(), q1 * ang.sin() + q2 * ang.cos()], -1)
        return q @ self.lm_head

    def eager_decode(self, model_input: ModelInput, run_reqs):
        b_position_delta = [image_delta(req) for req in run_reqs]
        delta = torch.tensor(b_position_delta, dtype=torch.int64, device=model_input.input_ids.device)
        return self._token_forward(model_input.input_ids, model_input.b_seq_len, delta)


class MTPFusedDecodeGraph:
    def __init__(self, model: Qwen2VLModel, device: str, variant: str):
        self.model, self.device, self.variant = model, device, variant
        self.cuda_graph_batch_sizes = CUDA_GRAPH_BATCH_SIZES
        B = max(CUDA_GRAPH_BATCH_SIZES)
        self.mempool = graph_pool_handle(device)
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=device)
        self.b_seq_len = torch.zeros(B, dtype=torch.int32, device=device)
        self.b_position_delta = torch.zeros(B, dtype=torch.int64, device=device)
        self._position_delta_dirty = False     # the bug: a bool
        self._position_delta_rows = 0          # the fix: rows that may still hold a non-zero delta
        pin = torch.device(device).type == "cuda"
        self.input_ids_pin = torch.zeros(B, dtype=torch.int64, pin_memory=pin)
        self.b_seq_len_pin = torch.zeros(B, dtype=torch.int32, pin_memory=pin)
        self.b_position_delta_pin = torch.zeros(B, dtype=torch.int64, pin_memory=pin)
        self.graphs = {}

    def _find_graph_batch_size(self, batch_size: int):
        index = bisect.bisect_left(self.cuda_graph_batch_sizes, batch_size)
        return self.cuda_graph_batch_sizes[index] if index < len(self.cuda_graph_batch_sizes) else None

    def _stage_warmup_inputs(self, batch_size: int):
        self.input_ids[:batch_size].fill_(1)
        self.b_seq_len[:batch_size].fill_(2)
        self.b_position_delta[:batch_size].zero_()

    def _run_verify_body(self, batch_size: int):
        return self.model._token_forward(self.input_ids[:batch_size], self.b_seq_len[:batch_size],
                                         self.b_position_delta[:batch_size])   # infer_state.b_position_delta_gpu

    def warmup(self):
        for batch_size in self.cuda_graph_batch_sizes[::-1]:
            self._stage_warmup_inputs(batch_size)
            self.graphs[batch_size] = capture(
                lambda bs=batch_size: self._run_verify_body(bs), device=self.device, pool=self.mempool, warmups=1,
                name=f"verify bs {batch_size}", owner="MTPFusedDecodeGraph",
                static={"input_ids": self.input_ids[:batch_size], "b_seq_len": self.b_seq_len[:batch_size],
                        "b_position_delta": self.b_position_delta[:batch_size]})

    def _flush_position_delta(self, has_delta: bool, batch_size: int):
        prev_rows = self._position_delta_rows
        if has_delta or prev_rows > 0:
            n = max(batch_size, prev_rows)
            self.b_position_delta_pin[batch_size:n].zero_()
            self.b_position_delta[:n].copy_(self.b_position_delta_pin[:n], non_blocking=True)
        self._position_delta_rows = batch_size if has_delta else 0

    def replay_verify(self, model_input: ModelInput, run_reqs):
        real_batch_size = model_input.batch_size
        batch_size = self._find_graph_batch_size(real_batch_size)
        self.input_ids_pin[:real_batch_size].copy_(model_input.input_ids)
        self.b_seq_len_pin[:real_batch_size].copy_(model_input.b_seq_len)
        if batch_size != real_batch_size:
            self.input_ids_pin[real_batch_size:batch_size].fill_(1)
            self.b_seq_len_pin[real_batch_size:batch_size].fill_(2)
        has_delta = False
        for i, req in enumerate(run_reqs):
            delta = image_delta(req)
            if delta != 0:
                has_delta = True
            self.b_position_delta_pin[i] = delta
        if batch_size != real_batch_size:
            self.b_position_delta_pin[real_batch_size:batch_size].zero_()
        self.input_ids[:batch_size].copy_(self.input_ids_pin[:batch_size], non_blocking=True)
        self.b_seq_len[:batch_size].copy_(self.b_seq_len_pin[:batch_size], non_blocking=True)
        if self.variant == "fix":
            self._flush_position_delta(has_delta, batch_size)
        else:
            if has_delta or self._position_delta_dirty:
                self.b_position_delta[:batch_size].copy_(self.b_position_delta_pin[:batch_size], non_blocking=True)
            self._position_delta_dirty = has_delta
        verify_graph, logits = self.graphs[batch_size]
        return replay(verify_graph, logits, real=real_batch_size, size=batch_size)[:real_batch_size]


def text(token, seq_len):
    return InferReq(token, seq_len, [])


def steps():
    """A: batch 8, request 5 carries an image (delta 3); B: batch 4, text; C: batch 8, text only."""
    a = [text(3, 9), text(7, 5), text(2, 12), text(9, 6), text(4, 8),
         InferReq(11, 30, [{"grid_thwd": (1, 4, 4, 3)}]), text(5, 7), text(13, 10)]
    b = [text(6, 10), text(1, 6), text(8, 13), text(10, 7)]
    c = b[:2] + [text(12, 14), text(14, 8), text(15, 3), text(0, 4), text(2, 11), text(6, 2)]
    return [a, b, c]


def model_input_of(run_reqs, device) -> ModelInput:
    return ModelInput(len(run_reqs),
                      torch.tensor([r.token for r in run_reqs], dtype=torch.int64).to(device),
                      torch.tensor([r.seq_len for r in run_reqs], dtype=torch.int32).to(device))


def run(variant: str, device: str = "cpu"):
    model = Qwen2VLModel(device)

    def served():
        fused = MTPFusedDecodeGraph(model, device, variant)
        fused.warmup()
        return [fused.replay_verify(model_input_of(reqs, device), reqs).clone() for reqs in steps()]

    def eager():
        return [model.eager_decode(model_input_of(reqs, device), reqs) for reqs in steps()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
