"""TokenSpeed decode CUDA graphs at ``max_num_seqs=1``: the capture list gains ``max_bs - 1 == 0`` and capturing a bs=0 graph crashes.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/493 ("fix(cudagraph): drop bs=0 capture at max_num_seqs=1",
merged 2026-06-21). Read: the PR description ("At `max_num_seqs=1`, `get_batch_sizes_to_capture` injects
`max_bs - 1 == 0` into the capture list, and capturing the `bs=0` graph crashes the scheduler. Fix: filter `bs > 0`."),
the one-line diff of ``python/tokenspeed/runtime/execution/cuda_graph_wrapper.py`` (commit eebc2679), and the
parent commit's ``CudaGraphWrapper.__init__`` / ``capture`` / ``_capture_one`` (capture sizes iterated in sorted order,
four warm-up ``run_once`` calls with ``seq_lens_buf[:bs].fill_(max_tokens_per_req)`` and ``_init_capture_metadata(bs)``
before ``torch.cuda.graph``, ``global_graph_memory_pool = graph.pool()``). Not read: the crash log; the PR does not say
which kernel of the bs=0 forward fails.
Symptom: a server started with ``--max-num-seqs 1`` (and CUDA graphs on) dies during CUDA graph capture, before serving
anything; any ``max_num_seqs`` >= 2 starts fine, and so does ``--disable-cuda-graph``.
Mechanism: ``get_batch_sizes_to_capture(config)`` takes the default list ``[1, 2, 4, 8, ...]``; because its maximum
exceeds ``max_bs = max_num_seqs // dp``, it adds ``max_bs - 1`` and ``max_bs`` (to capture the largest batch and the one
below it), then keeps the sizes ``<= effective_max``. With ``max_bs = 1`` that list is ``[0, 1]``.
``CudaGraphWrapper.capture`` walks it in order and ``_capture_one(0)`` warms up and captures a forward over zero rows:
every static input is a ``[:0]`` slice and the kernels are launched with an empty grid.
Doctor: undersized-buffer, at get_batch_sizes_to_capture. It hands the runner a capture size of 0, so the graph is
captured over zero-sized input slices (a zero-sized capture input); the fix only filters the list.
Fix (upstream): keep ``0 < bs <= effective_max``.
Modelled: ``get_batch_sizes_to_capture`` verbatim (minus DP), ``ModelExecutorConfig``, ``InputBuffers`` (static
``input_ids_buf``, ``positions_buf``, ``seq_lens_buf``), ``CudaGraphWrapper`` (``capture``, ``_capture_one`` with warm-up
and a shared pool, ``_padded_bs`` by bisect, ``__call__`` copy-in/replay), and a one-layer decode model with a
token-slot KV cache, an LM head and a greedy sampler. Stand-in: ``cute_argmax`` is a kernel launched with grid
``(bs,)``; like a raw CUDA launch it refuses an empty grid (``cudaErrorInvalidConfiguration``: "invalid configuration
argument"). Which of upstream's bs=0 kernels failed first is not known; this is the one the model has.
Workload: ``max_num_seqs=1``; one request with a 3-token prompt (eager prefill into the KV cache) then 4 greedy decode
steps at bs=1. Bug: the capture list is ``[0, 1]`` and capturing bs=0 raises before the first decode. Fix: the list is
``[1]``; the 4 decode steps replay the bs=1 graph and equal eager.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.engine import GraphError, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/493"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "get_batch_sizes_to_capture"
SYMPTOM = ("with max_num_seqs=1 the decode capture list becomes [0, 1]; capturing the bs=0 graph (zero-row input "
           "slices, empty kernel grids) crashes the server at startup")

VOCAB, HIDDEN, MAX_CONTEXT = 16, 8, 12

_variant = "bug"


@dataclasses.dataclass
class ModelExecutorConfig:
    max_num_seqs: int
    data_parallel_size: int = 1
    cudagraph_capture_sizes: list | None = None
    disable_cuda_graph_padding: bool = False
    max_cudagraph_capture_size: int = 512


def get_batch_sizes_to_capture(config: ModelExecutorConfig):
    capture_bs = config.cudagraph_capture_sizes
    max_bs = config.max_num_seqs // max(config.data_parallel_size, 1)
    if capture_bs is None:
        if config.disable_cuda_graph_padding:
            capture_bs = list(range(1, 33)) + [64, 96, 128, 160]
        else:
            capture_bs = [1, 2, 4] + [i * 8 for i in range(1, 21)]
    if max(capture_bs) > max_bs:
        capture_bs = list(sorted(set(capture_bs + [max_bs - 1] + [max_bs])))
    effective_max = min(config.max_cudagraph_capture_size, max_bs)
    if _variant == "fix":
        capture_bs = [bs for bs in capture_bs if 0 < bs <= effective_max]
    else:
        capture_bs = [bs for bs in capture_bs if bs <= effective_max]
    return capture_bs


def cute_argmax(logits):
    """The greedy sampler kernel, one CTA per row: grid ``(bs,)``. A launch with an empty grid is refused as CUDA
    refuses it (stand-in: checked here, on both devices)."""
    grid = (logits.shape[0],)
    if grid[0] == 0:
        raise GraphError("CUDA error: invalid configuration argument (cute_argmax launched with grid (0,))")
    return logits.argmax(-1)


class Model:
    def __init__(self, device):
        gen = generator(493)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_CONTEXT, HIDDEN, scale=0.3)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN, scale=0.6) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.7)
        self.k_cache = torch.zeros(MAX_CONTEXT, HIDDEN, device=device)     # one request: slot = position
        self.v_cache = torch.zeros(MAX_CONTEXT, HIDDEN, device=device)

    def forward_step(self, input_ids, positions, seq_lens):
        """Decode: each row writes its KV at its position and attends to ``[0, seq_len)``; greedy sample."""
        h = self.embed[input_ids] + self.pos_embed[positions]
        self.k_cache[positions] = h @ self.wk
        self.v_cache[positions] = h @ self.wv
        q = h @ self.wq
        scores = (q @ self.k_cache.T) * HIDDEN ** -0.5                       # [bs, MAX_CONTEXT]
        j = torch.arange(MAX_CONTEXT, device=q.device)
        scores = scores.masked_fill(j.unsqueeze(0) >= seq_lens.unsqueeze(1), float("-inf"))
        logits = (h + torch.softmax(scores, -1) @ self.v_cache @ self.wo) @ self.lm_head
        return logits, cute_argmax(logits)

    def prefill(self, prompt, device):
        n = len(prompt)
        pos = torch.arange(n, device=device)
        h = self.embed[torch.tensor(prompt, device=device)] + self.pos_embed[pos]
        self.k_cache[:n], self.v_cache[:n] = h @ self.wk, h @ self.wv
        q = h[-1:] @ self.wq
        p = torch.softmax((q @ self.k_cache[:n].T) * HIDDEN ** -0.5, -1)
        logits = (h[-1:] + p @ self.v_cache[:n] @ self.wo) @ self.lm_head
        return logits, cute_argmax(logits)


class InputBuffers:
    def __init__(self, max_bs, device):
        self.input_ids_buf = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions_buf = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.seq_lens_buf = torch.ones(max_bs, dtype=torch.int64, device=device)


class CudaGraphWrapper:
    def __init__(self, config, model, device):
        self.model, self.device = model, device
        self.max_tokens_per_req = 1
        self.capture_bs = get_batch_sizes_to_capture(config)
        self.max_bs = max(self.capture_bs)
        self.input_buffers = InputBuffers(self.max_bs, device)
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(device)       # global_graph_memory_pool

    def _forward_func(self, bs):
        ib = self.input_buffers
        return self.model.forward_step(ib.input_ids_buf[:bs], ib.positions_buf[:bs], ib.seq_lens_buf[:bs])

    def capture(self):
        for bs in self.capture_bs:                   # sorted: [0, 1] at max_num_seqs=1
            self.graphs[bs], self.output_buffers[bs] = self._capture_one(bs)

    def _capture_one(self, bs):
        ib = self.input_buffers
        # Keep warm-up seq_lens >= q_len per request (upstream fills before each of its warm-ups).
        ib.seq_lens_buf[:bs].fill_(self.max_tokens_per_req)
        return capture(lambda: self._forward_func(bs), device=self.device, pool=self.pool, warmups=4,
                       name=f"decode bs={bs}", owner="CudaGraphWrapper",
                       static={"input_ids_buf": ib.input_ids_buf, "positions_buf": ib.positions_buf,
                               "seq_lens_buf": ib.seq_lens_buf},
                       state={"k_cache": self.model.k_cache, "v_cache": self.model.v_cache})

    def _padded_bs(self, bs):
        return self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]

    def __call__(self, input_ids, positions, seq_lens):
        bs = input_ids.shape[0]
        padded_bs = self._padded_bs(bs)
        ib = self.input_buffers
        ib.input_ids_buf[:bs].copy_(input_ids)
        ib.positions_buf[:bs].copy_(positions)
        ib.seq_lens_buf[:bs].copy_(seq_lens)
        logits, ids = replay(self.graphs[padded_bs], self.output_buffers[padded_bs], real=bs, size=padded_bs)
        return logits[:bs].clone(), ids[:bs].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    config = ModelExecutorConfig(max_num_seqs=1)
    prompt, steps = [3, 9, 5], 4

    def serve(use_cuda_graph: bool):
        model = Model(device)
        wrapper = None
        if use_cuda_graph:
            wrapper = CudaGraphWrapper(config, model, device)
            wrapper.capture()                         # at startup, before any request
            model.k_cache.zero_()
            model.v_cache.zero_()
        logits, ids = model.prefill(prompt, device)
        outs = [logits.clone()]
        pos = len(prompt)
        for _ in range(steps):
            args = (ids.view(1).to(torch.int64), torch.tensor([pos], device=device),
                    torch.tensor([pos + 1], device=device))
            logits, ids = wrapper(*args) if wrapper is not None else model.forward_step(*args)
            outs.append(logits.clone())
            pos += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
