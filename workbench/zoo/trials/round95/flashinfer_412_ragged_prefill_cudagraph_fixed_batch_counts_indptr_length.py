"""FlashInfer ragged-KV prefill wrapper in CUDA-graph mode takes its fixed batch size from the indptr buffers' length (batch + 1), so begin_forward rejects every batch that fits them.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/412 ("bugfix: Fix cudagraph mode of
BatchPrefillWithRaggedKVCacheWrapper", flashinfer-ai/flashinfer, merged 2024-07-30 as 9907bc1, released in v0.1.3;
description: "The computation of `fixed_batch_size` is not correct."). Read: the PR page, the diff
(``python/flashinfer/prefill.py``, 2 lines) and, at 9907bc1^, ``BatchPrefillWithRaggedKVCacheWrapper`` (``__init__``,
``begin_forward``, ``end_forward``, ``forward``, the documented buffer sizes ``[batch_size + 1]``) next to
``BatchPrefillWithPagedKVCacheWrapper.__init__`` (which computes ``len(qo_indptr_buf) - 1``). The ragged wrapper's
``_fixed_batch_size = len(qo_indptr_buf)`` came with #291 (2024-06-10, "Fix the behavior of decode cuda graph
wrapper").
Symptom: a caller that follows the documented CUDA-graph recipe (static ``qo_indptr_buf`` / ``kv_indptr_buf`` of
``batch_size + 1`` entries, ``use_cuda_graph=True``) gets ``ValueError: The batch size should be fixed in cudagraph
mode, the runtime batch size B  mismatches the batch size set during initialization B+1.`` from the first
``begin_forward``; the ragged prefill can never be captured. The same calls without ``use_cuda_graph`` work.
Mechanism: in cudagraph mode the wrapper keeps the indptr arrays in the caller's static buffers (the captured
kernels read them), and fixes the batch size it serves: ``__init__`` set ``self._fixed_batch_size =
len(qo_indptr_buf)`` and checked ``len(kv_indptr_buf) != self._fixed_batch_size``. An indptr of B requests has
B + 1 entries, so the wrapper's batch is one more than the buffers hold; ``begin_forward`` computes ``batch_size =
len(qo_indptr) - 1`` and raises because it differs from ``_fixed_batch_size`` (and a caller who passes B + 1
requests no longer fits the buffers, ``copy_`` fails).
Doctor: undersized-buffer, at __init__. The contract between the static indptr buffers and the rows they serve is
off by one: the wrapper sizes its fixed batch from the buffer's length, not its capacity in requests, so a batch
that exactly fills the static buffers is judged not to fit and the step is refused.
Fix (upstream): ``self._fixed_batch_size = len(qo_indptr_buf) - 1`` and ``if len(kv_indptr_buf) !=
self._fixed_batch_size + 1``, as the paged wrapper does.
Modelled: ``BatchPrefillWithRaggedKVCacheWrapper`` (``__init__`` with its checks, ``is_cuda_graph_enabled``,
``begin_forward`` (static-buffer copies in cudagraph mode, rebinding otherwise), ``end_forward``, ``forward``) over a
stand-in for the C++ ``BatchPrefillWithRaggedKVCachePyTorchWrapper`` (``begin_forward`` keeps the plan's head
configuration; ``forward`` is ragged causal attention in torch that reads the batch layout from the device indptr
tensors, GQA included, so it can be captured and replayed for any layout of the fixed batch). Stand-ins: the
caller (``RaggedPrefillGraphRunner``: static token/indptr buffers, plan outside the graph, one capture, replays)
and a one-layer attention model (embedding, q/k/v projections, attention, output projection and head, float64).
Custom masks, positional encodings and the workspace plan are left out.
Workload: batch 3, 12 static token slots (padded rows past ``qo_indptr[-1]`` are ignored): 4 prefill steps with
lengths [3, 5, 2], [4, 1, 6], [2, 2, 2], [5, 3, 3]. The bug raises the ValueError above at the first step's
``begin_forward``; the fix plans, captures once and its logits of all real tokens equal eager's on every step.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/412"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = ("BatchPrefillWithRaggedKVCacheWrapper with use_cuda_graph=True: the fixed batch size is taken as the "
           "indptr buffers' length (batch + 1), so begin_forward raises 'The batch size should be fixed in "
           "cudagraph mode' for every correctly sized batch and the ragged prefill can never be captured")

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 4
HIDDEN, VOCAB = NUM_QO_HEADS * HEAD_DIM, 24
BATCH_SIZE, MAX_TOKENS = 3, 12

_variant = "bug"


def _check_kv_layout(kv_layout: str):
    if kv_layout not in ("NHD", "HND"):
        raise KeyError(f"Invalid kv_layout {kv_layout}")


# ----------------------------------------------------------------------------- csrc (stand-in)
class BatchPrefillWithRaggedKVCachePyTorchWrapper:
    """``_kernels.BatchPrefillWithRaggedKVCachePyTorchWrapper``: ``begin_forward`` plans on the host,
    ``forward`` runs the kernel, which reads the batch layout from the indptr tensors on the device."""

    def __init__(self, layout: str, use_cuda_graph: bool):
        self.layout, self.use_cuda_graph = layout, use_cuda_graph
        self.plan = None

    def is_cuda_graph_enabled(self) -> bool:
        return self.use_cuda_graph

    def begin_forward(self, workspace_buffer, qo_indptr, kv_indptr, batch_size, num_qo_heads, num_kv_heads,
                      head_dim, empty_q_data):
        self.plan = (batch_size, num_qo_heads, num_kv_heads, head_dim)

    def end_forward(self):
        self.plan = None

    def forward(self, q, qo_indptr, k, v, kv_indptr, causal, sm_scale):
        batch_size, num_qo_heads, num_kv_heads, head_dim = self.plan
        t = torch.arange(q.shape[0], device=q.device)
        s = torch.arange(k.shape[0], device=k.device)
        rq = torch.searchsorted(qo_indptr[1:].contiguous(), t, right=True)      # request of each query row
        rk = torch.searchsorted(kv_indptr[1:].contiguous(), s, right=True)      # request of each key row
        rq_c, rk_c = rq.clamp(max=batch_size - 1), rk.clamp(max=batch_size - 1)
        q_pos = t - qo_indptr[rq_c]
        kv_pos = s - kv_indptr[rk_c]
        qo_len = qo_indptr[rq_c + 1] - qo_indptr[rq_c]
        kv_len = kv_indptr[rq_c + 1] - kv_indptr[rq_c]
        mask = (rq[:, None] == rk[None, :]) & (rq[:, None] < batch_size)
        if causal:
            mask = mask & (kv_pos[None, :] <= (q_pos + kv_len - qo_len)[:, None])
        group = num_qo_heads // num_kv_heads
        kh = k.repeat_interleave(group, dim=1)
        vh = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, kh) * sm_scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores.masked_fill(~mask.any(-1)[None, :, None], 0.0), dim=-1)
        probs = probs * mask.any(-1)[None, :, None]                             # rows of no request: zero
        return (torch.einsum("hts,shd->thd", probs, vh),)


# ----------------------------------------------------------------------------- python/flashinfer/prefill.py
class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(self, workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 kv_indptr_buf=None, custom_mask_buf=None, qk_indptr_buf=None):
        _check_kv_layout(kv_layout)
        self._kv_layout = kv_layout
        self._workspace_buffer = workspace_buffer
        self._wrapper = BatchPrefillWithRaggedKVCachePyTorchWrapper(kv_layout, use_cuda_graph)
        if use_cuda_graph:
            if not torch.is_tensor(qo_indptr_buf):
                raise ValueError("qo_indptr_buf should be a torch.Tensor in cuda graph mode")
            if not torch.is_tensor(kv_indptr_buf):
                raise ValueError("kv_indptr_buf should be a torch.Tensor in cuda graph mode")
            if _variant == "bug":
                self._fixed_batch_size = len(qo_indptr_buf)
                bad = len(kv_indptr_buf) != self._fixed_batch_size
            else:
                self._fixed_batch_size = len(qo_indptr_buf) - 1
                bad = len(kv_indptr_buf) != self._fixed_batch_size + 1
            if bad:
                raise ValueError(
                    "The length of kv_indptr_buf ({}) should be the same as qo_indptr_buf ({}).".format(
                        len(kv_indptr_buf), self._fixed_batch_size))
        self._qo_indptr_buf = qo_indptr_buf
        self._kv_indptr_buf = kv_indptr_buf
        self._custom_mask_buf = custom_mask_buf
        self._qk_indptr_buf = qk_indptr_buf

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._wrapper.is_cuda_graph_enabled()

    def begin_forward(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, custom_mask=None,
                      packed_custom_mask=None, q_data_type="float16"):
        batch_size = len(qo_indptr) - 1
        if len(kv_indptr) != batch_size + 1:
            raise ValueError("The kv_indptr length should be equal to qk_indptr length.")
        if self.is_cuda_graph_enabled:
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    "The batch size should be fixed in cudagraph mode, the runtime batch size {} "
                    " mismatches the batch size set during initialization {}.".format(
                        batch_size, self._fixed_batch_size))
            self._qo_indptr_buf.copy_(qo_indptr)
            self._kv_indptr_buf.copy_(kv_indptr)
        else:
            self._qo_indptr_buf = qo_indptr
            self._kv_indptr_buf = kv_indptr
        empty_q_data = torch.empty(0, dtype=getattr(torch, q_data_type))
        self._wrapper.begin_forward(self._workspace_buffer, qo_indptr, kv_indptr, batch_size, num_qo_heads,
                                    num_kv_heads, head_dim, empty_q_data)

    def end_forward(self):
        if not self.is_cuda_graph_enabled:
            self._qo_indptr_buf = None
            self._kv_indptr_buf = None
            self._custom_mask_buf = None
            self._qk_indptr_buf = None
        self._wrapper.end_forward()

    def forward(self, q, k, v, causal=True, sm_scale=None):
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(q.size(-1))
        return self._wrapper.forward(q, self._qo_indptr_buf, k, v, self._kv_indptr_buf, causal, sm_scale)[0]


# ----------------------------------------------------------------------------- the caller (stand-in)
class AttentionModel:
    def __init__(self, device):
        gen = generator(412)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.wq = r(HIDDEN, NUM_QO_HEADS * HEAD_DIM)
        self.wk = r(HIDDEN, NUM_KV_HEADS * HEAD_DIM)
        self.wv = r(HIDDEN, NUM_KV_HEADS * HEAD_DIM)
        self.wo = r(NUM_QO_HEADS * HEAD_DIM, HIDDEN)
        self.head = r(HIDDEN, VOCAB)

    def forward(self, input_ids, prefill_wrapper):
        x = self.embed[input_ids]
        q = (x @ self.wq).view(-1, NUM_QO_HEADS, HEAD_DIM)
        k = (x @ self.wk).view(-1, NUM_KV_HEADS, HEAD_DIM)
        v = (x @ self.wv).view(-1, NUM_KV_HEADS, HEAD_DIM)
        o = prefill_wrapper.forward(q, k, v, causal=True)
        h = x + o.reshape(-1, NUM_QO_HEADS * HEAD_DIM) @ self.wo
        return h @ self.head


class RaggedPrefillGraphRunner:
    """The documented recipe: static indptr buffers of ``batch_size + 1`` entries, a cudagraph-mode wrapper,
    ``begin_forward`` outside the graph every step, one capture, then replays."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.workspace_buffer = torch.empty(1024, dtype=torch.uint8, device=device)
        self.qo_indptr_buf = torch.zeros(BATCH_SIZE + 1, dtype=torch.int64, device=device)
        self.kv_indptr_buf = torch.zeros(BATCH_SIZE + 1, dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
        self.wrapper = BatchPrefillWithRaggedKVCacheWrapper(
            self.workspace_buffer, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr_buf,
            kv_indptr_buf=self.kv_indptr_buf)
        self.graph = self.out = None

    def step(self, input_ids, qo_indptr):
        n = int(qo_indptr[-1])
        self.input_ids.zero_()
        self.input_ids[:n].copy_(input_ids)
        self.wrapper.begin_forward(qo_indptr, qo_indptr, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                   q_data_type="float64")
        if self.graph is None:
            self.graph, self.out = capture(
                lambda: self.model.forward(self.input_ids, self.wrapper), device=self.device, warmups=1,
                name=f"ragged prefill [{MAX_TOKENS} tokens]", owner="RaggedPrefillGraphRunner",
                static={"input_ids": self.input_ids, "qo_indptr_buf": self.qo_indptr_buf,
                        "kv_indptr_buf": self.kv_indptr_buf})
        logits = replay(self.graph, self.out, real=n, size=MAX_TOKENS)
        return logits[:n]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    steps = [[3, 5, 2], [4, 1, 6], [2, 2, 2], [5, 3, 3]]
    gen = generator(4120)
    batches = []
    for lens in steps:
        ids = torch.randint(0, VOCAB, (sum(lens),), generator=gen).to(device)
        indptr = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device)
        batches.append((ids, indptr))

    def served():
        runner = RaggedPrefillGraphRunner(AttentionModel(device), device)
        return [runner.step(ids, indptr).clone() for ids, indptr in batches]

    def eager():
        model = AttentionModel(device)
        wrapper = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8, device=device), "NHD")
        outs = []
        for ids, indptr in batches:
            wrapper.begin_forward(indptr, indptr, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, q_data_type="float64")
            outs.append(model.forward(ids, wrapper).clone())
            wrapper.end_forward()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
