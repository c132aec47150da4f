"""The DFlash verify graph is keyed by batch size only: captured at a budget-truncated span, a full span replays it and reads stale tail logits.

Upstream: https://github.com/pegainfer-project/pegainfer/pull/442 ("fix(qwen3-dflash): post-merge correctness
fixes — capture-shape gate, unified readiness, stream", squash commit e84e9389; first bullet "gate verify CUDA
Graph on the full span shape"). Regression test ``dflash_short_then_long_verify_capture_is_lossless``.
Symptom: speculative (DFlash) greedy output silently diverges from plain greedy decoding for a request that
replays a verify graph first captured by a short request near its ``max_tokens`` budget.
Mechanism: ``Qwen3Model::batch_prefill_into`` (verify_graph.rs) runs the verify forward as a piecewise graph:
``num_layers + 1`` dense segments ``[embed + L0.pre] [L0.post + L1.pre] ... [L_last.post + lm_head]``, each a
``CudaGraphState::run_or_capture`` (the first call captures, every later call relaunches), with attention eager
between them. The segments live in ``bufs.graphs[bidx]``, ``bidx`` the position of ``batch_size`` in
``BATCH_BUCKETS``. ``VerifyGraphBuffers::set_rows(total_tokens)`` only moves the logical row count of the
``max_batch * span`` buffers, and every dense kernel bakes the row count it was captured with. The scheduler
(``build_speculative_verify_items``) truncates a request's span to ``max_tokens - generated_count``, so
``total_tokens`` varies at a fixed batch size. A short request captures bucket bs=1 at 2 rows; a later long request
replays it at 4: only rows 0..1 of ``hidden``/``all_logits`` are computed, rows 2..3 keep what an earlier step left
there and ``select_step_tokens`` verifies the tail drafts against those stale logits. (Capture at the full span
and replay at a truncated one only over-computes: harmless.)
Doctor: undersized-buffer, at ``batch_prefill_into`` (a replay is asked to serve more rows than its captured
segments were recorded with: the graph is keyed on the batch size, not on the row count).
Fix (upstream): ``let full_shape = total_tokens == batch_size * bufs.span;`` and the graph arm becomes
``Some(bidx) if full_shape``; the fallback ``_ =>`` runs the same segments eagerly for an off-bucket batch or a
truncated span, so capture shape == replay shape by construction.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pegainfer-project/pegainfer/pull/442"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "batch_prefill_into"
SYMPTOM = "a full-span verify replays the bs=1 graph captured at a truncated span: stale tail logits, output diverges"

HIDDEN, VOCAB, NUM_LAYERS, BLOCK_SIZE, EPS = 8, 16, 2, 4, 1e-6
BATCH_BUCKETS = (1, 2)


def rms_norm(x, w=None):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if w is None else y * w


class CudaGraphState:
    """openinfer_core::cuda_graph: capture once on the first call, ``cuGraphLaunch`` on every call."""

    def __init__(self):
        self.exec, self.outputs = None, None

    def run_or_capture(self, device, kernels, name, static=None):
        if self.exec is None:
            self.exec, self.outputs = capture(kernels, device=device, warmups=0, name=name, static=static,
                                              owner="VerifyGraphBuffers.graphs")
        replay(self.exec, self.outputs)


class VerifyGraphBuffers:
    def __init__(self, device, max_batch, span):
        rows = max_batch * span
        self.hidden = torch.zeros(rows, HIDDEN, device=device)
        self.q = torch.zeros(rows, HIDDEN, device=device)            # prefill_bufs (q/k share one projection)
        self.attn_output = torch.zeros(rows, HIDDEN, device=device)
        self.all_logits = torch.zeros(rows, VOCAB, device=device)
        self.token_ids_d = torch.zeros(rows, dtype=torch.long, device=device)
        self.graphs = [[CudaGraphState() for _ in range(NUM_LAYERS + 1)] for _ in BATCH_BUCKETS]
        self.max_batch, self.span, self.rows = max_batch, span, 0

    def set_rows(self, total_rows):
        assert total_rows <= self.max_batch * self.span
        self.rows = total_rows                                        # only the logical seq_len moves


class Qwen3Model:
    def __init__(self, device):
        gen = generator(442)
        self.device = device
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [{k: randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4) for k in ("wq", "wo", "w_up")}
                       for _ in range(NUM_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.draft_head = self.lm_head + randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.3)

    # ---- dense ops (captured) ----
    def forward_layer_pre_attn(self, i, bufs):
        n = bufs.rows
        bufs.q[:n].copy_(rms_norm(bufs.hidden[:n]) @ self.layers[i]["wq"])

    def forward_layer_post_attn(self, i, bufs):
        n, w = bufs.rows, self.layers[i]
        h = bufs.hidden[:n]
        h.add_(bufs.attn_output[:n] @ w["wo"])
        h.add_(torch.nn.functional.silu(rms_norm(h) @ w["w_up"]))

    def verify_seg_embed_pre(self, bufs):
        n = bufs.rows
        torch.index_select(self.embed, 0, bufs.token_ids_d[:n], out=bufs.hidden[:n])
        self.forward_layer_pre_attn(0, bufs)
        return bufs.q

    def verify_seg_post_pre(self, i, bufs):
        self.forward_layer_post_attn(i - 1, bufs)
        self.forward_layer_pre_attn(i, bufs)
        return bufs.q

    def verify_seg_post_logits(self, bufs):
        n = bufs.rows
        self.forward_layer_post_attn(NUM_LAYERS - 1, bufs)
        torch.matmul(rms_norm(bufs.hidden[:n], self.norm), self.lm_head, out=bufs.all_logits[:n])
        return bufs.all_logits

    # ---- attention (eager between segments: its KV length grows every step) ----
    def verify_attn(self, i, kv_views, seq_lens, bufs):
        outs, start = [], 0
        for committed, span_len in zip(kv_views, seq_lens):
            kv = self.embed[torch.tensor(committed, device=self.device)] @ self.layers[i]["wq"]   # paged KV
            q = bufs.q[start:start + span_len]
            keys = torch.cat([kv, q])
            scores = q @ keys.T / math.sqrt(HIDDEN)
            causal = torch.ones(span_len, len(keys), dtype=torch.bool, device=self.device).tril(len(committed))
            outs.append(torch.softmax(scores.masked_fill(~causal, -math.inf), -1) @ keys)
            start += span_len
        bufs.attn_output[:start].copy_(torch.cat(outs))

    def batch_prefill_into(self, prompts, kv_views, bufs, variant, use_graphs):
        batch_size = len(prompts)
        seq_lens = [len(p) for p in prompts]
        total_tokens = sum(seq_lens)
        bufs.set_rows(total_tokens)
        all_tokens = [t for p in prompts for t in p]
        bufs.token_ids_d[:total_tokens].copy_(torch.tensor(all_tokens, device=self.device))   # memcpy_htod
        bidx = BATCH_BUCKETS.index(batch_size) if batch_size in BATCH_BUCKETS else None
        full_shape = total_tokens == batch_size * bufs.span
        gate = full_shape if variant == "fix" else True      # the fix: `Some(bidx) if full_shape`
        if use_graphs and bidx is not None and gate:
            segs, name = bufs.graphs[bidx], f"verify bs={batch_size}"
            segs[0].run_or_capture(self.device, lambda: self.verify_seg_embed_pre(bufs), f"{name} seg 0",
                                   static={"token_ids_d": bufs.token_ids_d})
            self.verify_attn(0, kv_views, seq_lens, bufs)
            for i in range(1, NUM_LAYERS):
                segs[i].run_or_capture(self.device, lambda i=i: self.verify_seg_post_pre(i, bufs), f"{name} seg {i}")
                self.verify_attn(i, kv_views, seq_lens, bufs)
            segs[NUM_LAYERS].run_or_capture(self.device, lambda: self.verify_seg_post_logits(bufs),
                                            f"{name} seg {NUM_LAYERS}")
        else:                                                 # off-bucket batch (or, fixed, a truncated span)
            self.verify_seg_embed_pre(bufs)
            self.verify_attn(0, kv_views, seq_lens, bufs)
            for i in range(1, NUM_LAYERS):
                self.verify_seg_post_pre(i, bufs)
                self.verify_attn(i, kv_views, seq_lens, bufs)
            self.verify_seg_post_logits(bufs)


class ActiveRequest:
    def __init__(self, prompt, max_tokens):
        self.tokens, self.max_tokens, self.generated_count = list(prompt), max_tokens, 0


class Executor:
    def __init__(self, model, device, variant, use_graphs):
        self.model, self.device, self.variant, self.use_graphs = model, device, variant, use_graphs
        self.verify_bufs = None

    def execute_speculative_draft(self, req):
        """DFlash draft: ``BLOCK_SIZE - 1`` proposed tokens after the last committed one."""
        draft, t = [], req.tokens[-1]
        for _ in range(BLOCK_SIZE - 1):
            t = int((rms_norm(self.model.embed[t]) @ self.model.draft_head).argmax())
            draft.append(t)
        return [req.tokens[-1]] + draft

    def execute_dflash_verify(self, active):
        if self.verify_bufs is None:
            self.verify_bufs = VerifyGraphBuffers(self.device, BATCH_BUCKETS[-1], BLOCK_SIZE)
        bufs = self.verify_bufs
        spans = []
        for req in active:                                    # build_speculative_verify_items
            remaining = req.max_tokens - req.generated_count
            spans.append(self.execute_speculative_draft(req)[:remaining])
        kv_views = [req.tokens[:-1] for req in active]
        self.model.batch_prefill_into(spans, kv_views, bufs, self.variant, self.use_graphs)
        total_tokens = sum(len(s) for s in spans)
        logits = bufs.all_logits[:total_tokens].clone()
        target = logits.argmax(-1).tolist()                   # select_step_tokens (greedy)
        start = 0
        for req, span in zip(active, spans):                  # build_verify_results: accept the matching prefix
            emitted = []
            for j in range(len(span)):
                emitted.append(target[start + j])
                if j + 1 == len(span) or span[j + 1] != target[start + j]:
                    break
            req.tokens += emitted
            req.generated_count += len(emitted)
            start += len(span)
        return logits


def run(variant: str, device: str = "cpu"):
    model = Qwen3Model(device)
    # the poison request (max_tokens=2) first, alone; then a long one alone; then two at different budgets
    workload = [[([3, 1, 4], 2)], [([5, 9, 2, 6], 10)], [([7, 8], 9), ([1, 5, 11], 12)]]

    def serve(graphed: bool):
        executor = Executor(model, device, variant, graphed)
        outs = []
        for batch in workload:
            active = [ActiveRequest(p, m) for p, m in batch]
            done, steps = [], []
            while active:
                steps.append(executor.execute_dflash_verify(active))
                done += [r for r in active if r.generated_count >= r.max_tokens]
                active = [r for r in active if r.generated_count < r.max_tokens]
            outs.append(steps[0])                             # the first verify's logits: same shape in both runs
            outs += [torch.tensor(r.tokens, dtype=torch.float32) for r in done]   # the committed tokens
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
