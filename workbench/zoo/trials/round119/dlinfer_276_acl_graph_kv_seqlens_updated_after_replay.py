"""dlinfer's Ascend graph runner for lmdeploy: the attention kernel's ``actual_seq_lengths_kv`` parameter of the captured
ACL graph is refreshed with ``graph.update`` only after ``graph.replay()``, so every replayed decode step attends with the
previous step's KV lengths and misses the token it has just written.

Upstream: https://github.com/DeepLink-org/dlinfer/pull/276 ("fix qwen3-30b lcb-code score accuracy", DeepLink-org/dlinfer,
by yao-fengchen, merged 2025-11-26 as commit 5c4747371b6bd3f39a71656c74e99e3429f259d1).
Read: the commit's diff of ``dlinfer/framework/lmdeploy_ext/cudagraph/ascend_cudagraph.py`` and, at its parent,
``AscendCudaGraphMixin_make_buffers_cudagraph`` (``kv_seqlens`` a host list ``[0] * max_batches``),
``AscendCudaGraphMixin_fill_buffers_cudagraph`` (copies input_ids, position_ids, block_offsets, kv_seqlens,
kv_start_indices into the input buffers) and ``AscendSingleGraphRunner.forward`` (fill buffers, update context,
``torch.npu.synchronize()``, ``self._graph.replay()``, then ``self._graph.update(cpu_update_input=[{"actual_seq_lengths_kv":
kv_seqlens}])``). The fix adds ``update_attn_params(self.update_stream, self.meta, self.max_tokens)`` before the replay
and drops the update after it.
Symptom: Qwen3-30B on Ascend with graph mode scored low on LiveCodeBench (code accuracy); eager mode was fine.
Mechanism: the host-side ``actual_seq_lengths_kv`` of the captured paged-attention task is a graph parameter, not
read from a device buffer; ``graph.update`` patches it for the *next* launch. Updating after ``replay`` means the replay of
step n runs with step n-1's KV lengths (the capture-time ones on the first replay): each sequence ignores its newest
KV entry.
Doctor: stale-input, at forward. The replay reads a graph input (the attention KV lengths) that this step has not
written yet; what it sees is what the previous step left there.
Fix (upstream): refresh the attention parameters (``update_attn_params``) on an update stream before ``replay``.
Modelled: ``make_buffers`` / ``fill_buffers`` / ``AscendSingleGraphRunner.capture`` / ``forward`` as read; the graph's
``actual_seq_lengths_kv`` parameter is a device buffer that ``update`` copies into (what ``graph.update`` does to the
captured task). Capture runs one warm-up forward and replays once (the K/V writes are idempotent). Stand-ins: a one-layer decoder with single-head decode attention over a contiguous per-sequence slot
range (``block_offsets`` reduced to a base slot), no RoPE; float64.
Workload: two sequences with 3 and 5 cached tokens decode 4 steps at batch 2 (one graph, captured at step 1). Bug: max |graph -
eager| = 2.4 (steps 2-4 each attend one KV entry short). Fix: equals eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/DeepLink-org/dlinfer/pull/276"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "forward"
SYMPTOM = ("Ascend graph mode updates the captured attention's actual_seq_lengths_kv after replay, so each decode "
           "step attends with the previous step's KV lengths")

VOCAB, HIDDEN, MAX_BATCHES, SLOTS_PER_SEQ = 16, 8, 2, 16
DTYPE = torch.float64

_variant = "bug"


class Model:
    """Stand-in decoder: embed, write K/V at ``kv_start_indices``, attend over ``[base, base + kv_seqlen)``."""

    def __init__(self, device):
        gen = generator(276)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
                                               for _ in range(4))
        self.k_cache = torch.zeros(MAX_BATCHES * SLOTS_PER_SEQ, HIDDEN, dtype=DTYPE, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)

    def forward(self, input_ids, block_offsets, kv_start_indices, actual_seq_lengths_kv):
        h = self.embed[input_ids]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        self.k_cache.index_copy_(0, kv_start_indices.long(), k)
        self.v_cache.index_copy_(0, kv_start_indices.long(), v)
        ctx = torch.arange(SLOTS_PER_SEQ, device=h.device)
        slots = block_offsets.long()[:, None] + ctx[None, :]
        scores = torch.einsum("bd,bcd->bc", q, self.k_cache[slots]) / HIDDEN ** 0.5
        scores = scores.masked_fill(ctx[None, :] >= actual_seq_lengths_kv[:, None].long(), float("-inf"))
        return h + torch.einsum("bc,bcd->bd", scores.softmax(-1), self.v_cache[slots]) @ self.wo


def make_buffers_cudagraph(device):
    i32 = dict(dtype=torch.int32, device=device)
    return {"input_ids": torch.zeros(MAX_BATCHES, dtype=torch.int64, device=device),
            "block_offsets": torch.zeros(MAX_BATCHES, **i32),
            "kv_seqlens": [0] * MAX_BATCHES,                       # host list: the graph's cpu_update_input
            "kv_start_indices": torch.zeros(MAX_BATCHES, **i32)}


def fill_buffers_cudagraph(input_buffers, input_ids, block_offsets, kv_seqlens, kv_start_indices):
    batch_size = input_ids.size(0)
    input_buffers["input_ids"][:batch_size] = input_ids
    input_buffers["block_offsets"][:batch_size] = block_offsets
    input_buffers["kv_seqlens"][:batch_size] = kv_seqlens
    input_buffers["kv_start_indices"][:batch_size] = kv_start_indices


class AscendSingleGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.input_buffers = make_buffers_cudagraph(device)
        # the captured attention task's actual_seq_lengths_kv parameter (what graph.update patches)
        self.graph_actual_seq_lengths_kv = torch.ones(MAX_BATCHES, dtype=torch.int32, device=device)
        self._graph = self.logits = None

    def _graph_update(self):
        self.graph_actual_seq_lengths_kv.copy_(
            torch.tensor(self.input_buffers["kv_seqlens"], dtype=torch.int32).to(self.device))

    def _run(self):
        b = self.input_buffers
        return self.model.forward(b["input_ids"], b["block_offsets"], b["kv_start_indices"],
                                  self.graph_actual_seq_lengths_kv)

    def capture(self, **kwargs):
        fill_buffers_cudagraph(self.input_buffers, **kwargs)
        self._graph_update()
        b = self.input_buffers
        self._graph, self.logits = capture(
            self._run, device=self.device, warmups=1, name="ascend decode graph", owner="AscendSingleGraphRunner",
            static={"input_ids": b["input_ids"], "block_offsets": b["block_offsets"],
                    "kv_start_indices": b["kv_start_indices"],
                    "actual_seq_lengths_kv": self.graph_actual_seq_lengths_kv},
            state={"k_cache": self.model.k_cache, "v_cache": self.model.v_cache})
        return replay(self._graph, self.logits)

    def forward(self, **kwargs):
        fill_buffers_cudagraph(self.input_buffers, **kwargs)
        if _variant == "fix":
            self._graph_update()                                   # update_attn_params(...) before replay
        out = replay(self._graph, self.logits)
        if _variant == "bug":
            self._graph_update()                                   # self._graph.update(cpu_update_input=...)
        return out


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    tokens = [[3, 5], [7, 2], [11, 9], [4, 13]]

    def serve(use_graph):
        model = Model(device)
        gen = generator(2760)
        model.k_cache.copy_(randn(*model.k_cache.shape, gen=gen, device=device).to(DTYPE))
        model.v_cache.copy_(randn(*model.v_cache.shape, gen=gen, device=device).to(DTYPE))
        runner, lens, outs = AscendSingleGraphRunner(model, device), [3, 5], []
        block_offsets = torch.tensor([0, SLOTS_PER_SEQ], dtype=torch.int32, device=device)
        for step, ids in enumerate(tokens):
            starts = [int(block_offsets[i]) + lens[i] for i in range(2)]
            lens = [n + 1 for n in lens]
            kw = dict(input_ids=torch.tensor(ids, device=device), block_offsets=block_offsets,
                      kv_seqlens=list(lens), kv_start_indices=torch.tensor(starts, dtype=torch.int32, device=device))
            if not use_graph:
                out = model.forward(kw["input_ids"], block_offsets, kw["kv_start_indices"],
                                    torch.tensor(lens, dtype=torch.int32, device=device))
            elif runner._graph is None:
                out = runner.capture(**kw)
            else:
                out = runner.forward(**kw)
            outs.append(out.clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
