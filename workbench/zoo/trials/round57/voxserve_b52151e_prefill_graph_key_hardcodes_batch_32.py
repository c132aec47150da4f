"""The prefill graph is captured at ``max_batch_size`` but looked up at a hard-coded 32: no graph matches the key.

Upstream: https://github.com/vox-serve/vox-serve/commit/b52151e50a813bf1a9813bbd036706d0e18c3740 ("fix: fixed
batch size for prefill cuda graph"), a direct commit on main (no PR, no issue).
Symptom: with ``max_batch_size != 32`` every CUDA-graph prefill fails with ``RuntimeError("No suitable prefill CUDA
graph found")`` (or, when ``max_batch_size > 32``, picks a graph whose batch layout differs from the padded metadata).
Mechanism: ``CudaGraphWorker._initialize_prefill_cuda_graphs`` captures one prefill graph per seq-len bucket with
``batch_size = self.max_batch_size; key = (batch_size, seq_len)``, planning ``self.prefill_wrappers[key]`` (a
CUDA-graph FlashInfer wrapper whose batch size is fixed) with ``qo_indptr = arange(batch_size + 1) * (seq_len //
batch_size)``. At serve time ``run_lm_prefill`` asks ``_get_prefill_cuda_graph_key``, which hard-codes
``padded_batch_size = 32  # self.max_batch_size`` and pads the token count by ``32 - batch_size`` (one token per dummy
request): the key ``(32, padded_seq_len)`` was never captured, and the fallback loop only accepts captured batch sizes
``>= 32``; with ``max_batch_size = 4`` nothing matches, the lookup returns None and ``run_lm_prefill`` raises. The eager
``ModelWorker.run_lm_prefill`` plans the real ``qo_indptr`` and never looks for a graph. Modelled with a one-layer,
one-head LM over a 64-token bucket; FlashInfer's ragged prefill is a block-diagonal causal mask built from the
wrapper's ``qo_indptr`` buffer (searchsorted), so the kernel is graph-safe.
Doctor: undersized-buffer, at _get_prefill_cuda_graph_key (the replay asks for a 32-request prefill graph while only
``max_batch_size`` = 4 requests were captured).
Fix (upstream): one constant, ``self.prefill_graph_batch_size = 8``, used both at capture (``batch_size =
self.prefill_graph_batch_size``) and in ``_get_prefill_cuda_graph_key`` (``padded_batch_size =
self.prefill_graph_batch_size``).
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vox-serve/vox-serve/commit/b52151e50a813bf1a9813bbd036706d0e18c3740"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_get_prefill_cuda_graph_key"
SYMPTOM = "every graphed prefill raises 'No suitable prefill CUDA graph found' when max_batch_size != 32"

VOCAB, HIDDEN = 32, 8
MAX_BATCH_SIZE = 4
PROMPTS = ([[3, 9, 4, 1, 7], [5, 2, 8]], [[11, 6, 13, 2, 9, 1]], [[4, 4, 10], [7, 1], [12, 3, 5, 8]])


class ZonosLM:
    """Embedding -> one causal self-attention layer per request (ragged, by ``qo_indptr``) -> logits."""

    def __init__(self, device):
        gen = generator(52)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, position_ids, attn_wrapper):
        x = self.embed_tokens[input_ids]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        return (x + attn_wrapper.run(q, k, v, position_ids)) @ self.lm_head


class FlashInferPrefillWrapper:
    """Ragged prefill attention; with ``use_cuda_graph`` its batch size is fixed and ``qo_indptr`` lives in a buffer."""

    def __init__(self, device, batch_size=None, use_cuda_graph=False):
        self.device, self.batch_size, self.use_cuda_graph = device, batch_size, use_cuda_graph
        if use_cuda_graph:
            self.qo_indptr_buf = torch.zeros(batch_size + 1, dtype=torch.long, device=device)

    def plan(self, qo_indptr):
        if self.use_cuda_graph:
            if qo_indptr.shape[0] != self.batch_size + 1:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                                 f"{qo_indptr.shape[0] - 1} mismatches the batch size {self.batch_size}")
            self.qo_indptr_buf.copy_(qo_indptr.to(self.device))
            self.qo_indptr = self.qo_indptr_buf
        else:
            self.qo_indptr = qo_indptr.to(self.device)

    def run(self, q, k, v, position_ids):
        tokens = torch.arange(q.shape[0], device=q.device)
        req = torch.searchsorted(self.qo_indptr[1:], tokens, right=True)       # request of each token
        mask = (req[:, None] == req[None, :]) & (tokens[None, :] <= tokens[:, None])
        scores = (q @ k.T).masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, -1) @ v


class ModelWorker:
    """The eager worker: plans the real ``qo_indptr`` and runs the forward on the real tokens."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.prefill_wrapper = FlashInferPrefillWrapper(device)

    def run_lm_prefill(self, requests):
        qo_indptr = [0]
        for r in requests:
            qo_indptr.append(qo_indptr[-1] + len(r))
        ids = torch.tensor([t for r in requests for t in r], device=self.device)
        pos = torch.tensor([i for r in requests for i in range(len(r))], device=self.device)
        self.prefill_wrapper.plan(torch.tensor(qo_indptr))
        logits = self.model.forward(ids, pos, self.prefill_wrapper)
        return logits[torch.tensor(qo_indptr[1:], device=self.device) - 1].clone()


class CudaGraphWorker(ModelWorker):
    def __init__(self, model, device, variant):
        super().__init__(model, device)
        self.variant = variant
        self.max_batch_size = MAX_BATCH_SIZE
        self.cuda_graph_batch_sizes = [2 ** i for i in range(MAX_BATCH_SIZE.bit_length())][::-1]
        self.cuda_graph_seq_len_buckets = [64]
        if variant == "fix":
            self.prefill_graph_batch_size = 8
        self.cuda_graph_pool = graph_pool_handle(device)
        self.prefill_wrappers, self.cuda_graphs_lm_prefill, self.prefill_outputs = {}, {}, {}
        self._initialize_prefill_cuda_graphs()

    def _capture_batch_size(self):
        return self.prefill_graph_batch_size if self.variant == "fix" else self.max_batch_size

    def _initialize_prefill_cuda_graphs(self):
        max_seq_len = max(self.cuda_graph_seq_len_buckets)
        self.cuda_graph_buffers = {
            "prefill_input_ids": torch.zeros(max_seq_len, dtype=torch.long, device=self.device),
            "prefill_position_ids": torch.zeros(max_seq_len, dtype=torch.long, device=self.device),
            "prefill_logits": torch.zeros(max_seq_len, VOCAB, device=self.device)}
        for seq_len in self.cuda_graph_seq_len_buckets:
            batch_size = self._capture_batch_size()
            key = (batch_size, seq_len)
            self.prefill_wrappers[key] = FlashInferPrefillWrapper(self.device, batch_size, use_cuda_graph=True)
            self.prefill_wrappers[key].plan(torch.arange(batch_size + 1) * (seq_len // batch_size))
            buf = self.cuda_graph_buffers

            def step(key=key, seq_len=seq_len):
                logits = self.model.forward(buf["prefill_input_ids"][:seq_len], buf["prefill_position_ids"][:seq_len],
                                            self.prefill_wrappers[key])
                buf["prefill_logits"][:seq_len].copy_(logits)
                return buf["prefill_logits"][:seq_len]

            self.cuda_graphs_lm_prefill[key], self.prefill_outputs[key] = capture(
                step, device=self.device, pool=self.cuda_graph_pool, warmups=2, owner="CudaGraphWorker (prefill)",
                static={"prefill_input_ids": buf["prefill_input_ids"],
                        "prefill_position_ids": buf["prefill_position_ids"],
                        "qo_indptr_buf": self.prefill_wrappers[key].qo_indptr_buf})

    def _get_cuda_graph_seq_len(self, actual_seq_len):
        for seq_len in sorted(self.cuda_graph_seq_len_buckets):
            if seq_len >= actual_seq_len:
                return seq_len
        return None

    def _get_prefill_cuda_graph_key(self, batch_size, seq_len):
        if self.variant == "fix":
            padded_batch_size = self.prefill_graph_batch_size
        else:
            padded_batch_size = 32  # self.max_batch_size # For prefill, we always use max batch size
        padded_seq_len = self._get_cuda_graph_seq_len(seq_len + (padded_batch_size - batch_size))
        if padded_seq_len is None:
            return None
        key = (padded_batch_size, padded_seq_len)
        if key in self.cuda_graphs_lm_prefill:
            return key
        for batch_sz in sorted(self.cuda_graph_batch_sizes):       # best available batch size for this seq len
            test_key = (batch_sz, padded_seq_len)
            if padded_batch_size <= batch_sz <= padded_seq_len and test_key in self.cuda_graphs_lm_prefill:
                return test_key
        return None

    def run_lm_prefill(self, requests):
        actual_batch_size = len(requests)
        input_ids = [t for r in requests for t in r]
        position_ids = [i for r in requests for i in range(len(r))]
        actual_seq_len = len(input_ids)
        graph_key = self._get_prefill_cuda_graph_key(actual_batch_size, actual_seq_len)
        if graph_key is None:
            raise RuntimeError("No suitable prefill CUDA graph found")
        padded_batch_size, padded_seq_len = graph_key
        qo_indptr = [0]
        for r in requests:
            qo_indptr.append(qo_indptr[-1] + len(r))
        for _ in range(padded_batch_size - actual_batch_size):        # one token per dummy request
            qo_indptr.append(qo_indptr[-1] + 1)
        qo_indptr_tensor = torch.tensor(qo_indptr)
        self.prefill_wrappers[graph_key].plan(qo_indptr_tensor)
        buf = self.cuda_graph_buffers
        buf["prefill_input_ids"][:actual_seq_len].copy_(torch.tensor(input_ids, device=self.device))
        buf["prefill_position_ids"][:actual_seq_len].copy_(torch.tensor(position_ids, device=self.device))
        logits = replay(self.cuda_graphs_lm_prefill[graph_key], self.prefill_outputs[graph_key],
                        real=actual_seq_len, size=padded_seq_len)
        actual_qo_indptr = qo_indptr_tensor[:actual_batch_size + 1].to(self.device)
        return logits[actual_qo_indptr[1:] - 1].clone()


def run(variant: str, device: str = "cpu"):
    model = ZonosLM(device)

    def serve():
        worker = CudaGraphWorker(model, device, variant)
        return [worker.run_lm_prefill(batch) for batch in PROMPTS]

    def eager():
        worker = ModelWorker(model, device)
        return [worker.run_lm_prefill(batch) for batch in PROMPTS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, serve, eager)
