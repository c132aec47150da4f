"""AutoDeploy's default CUDA graph batch sizes exceed max_batch_size: the dummy batch overflows the input buffers.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/10687 ("[#10688][fix] AutoDeploy Fix CUDA graph batch sizes
exceeding max_batch_size"), for https://github.com/NVIDIA/TensorRT-LLM/issues/10688.
Symptom: ``trtllm-bench ... --backend _autodeploy --max_batch_size 4`` (Llama-3.1-8B-Instruct-FP8) failed during
model initialization with ``AssertionError: Data too large for buffer 'cu_seqlen': 114 > 5`` (January 2026).
Mechanism: AutoDeploy's ``SequenceInfo`` allocates its persistent per-sequence input buffers for
``max_batch_size`` (``cu_seqlen`` holds ``max_batch_size + 1`` entries, ``input_pos``/``slot_idx``
``max_batch_size``), and the torch-cudagraph backend's captured graphs read these buffers in place. When
``cuda_graph_batch_sizes`` was not set, the heuristic in ``update_cuda_graph_batch_sizes`` generated sizes such as
``{1, 17, 33, ..., 113, ...}`` regardless of ``max_batch_size``. Capturing a size means nesting a dummy
generate-only batch of that many sequences into the buffers (``set_generate_only_batch`` -> ``nest_sequences``
-> ``_store_arg``) and warming up and capturing on it; for a size above ``max_batch_size`` that batch does not
fit, and ``_store_arg`` refuses it (113 sequences need 114 ``cu_seqlen`` entries, the buffer has 5).
Doctor: undersized-buffer, at ``_store_arg`` (a capture's dummy batch is written into persistent graph input
buffers it does not fit).
Fix (upstream): the CUDA graph batch sizes are limited to ``max_batch_size`` (sizes above it are dropped), so
every captured batch fits the sequence buffers. (Only the issue text and PR title were available to me, not the
diff; the heuristic below is a scaled-down stand-in for the one the issue quotes.)
(Tiny sizes: max_batch_size 4, 16 token slots, default sizes {1, 2, 4, 5, 9, 13}; the graph runs decode steps,
prefill runs eagerly.)
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/10687"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_store_arg"
SYMPTOM = "model init fails: AssertionError: Data too large for buffer 'cu_seqlen' (graph batch size > max_batch_size)"

VOCAB, DIM, MAX_SEQ_LEN = 16, 4, 8
MAX_BATCH_SIZE, MAX_NUM_TOKENS = 4, 16
DEFAULT_MAX_CUDA_GRAPH_BS = 16


def update_cuda_graph_batch_sizes(max_batch_size, cuda_graph_batch_sizes, variant):
    """Default capture sizes when the user gave none: small powers of two plus a coarse ladder."""
    if cuda_graph_batch_sizes is None:
        cuda_graph_batch_sizes = sorted({1, 2, 4, *range(1, DEFAULT_MAX_CUDA_GRAPH_BS + 1, 4)})
    if variant == "fix":
        cuda_graph_batch_sizes = [bs for bs in cuda_graph_batch_sizes if bs <= max_batch_size]
    return sorted(cuda_graph_batch_sizes)


class SequenceInfo:
    """The persistent input buffers the graphs read in place, sized for ``max_batch_size`` sequences."""

    def __init__(self, device):
        self.device = device
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.cu_seqlen = torch.zeros(MAX_BATCH_SIZE + 1, dtype=torch.long, device=device)
        self.input_pos = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        self.slot_idx = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        self.num_seqs = 0

    def args(self):
        return {"input_ids": self.input_ids, "cu_seqlen": self.cu_seqlen, "input_pos": self.input_pos,
                "slot_idx": self.slot_idx}

    def _store_arg(self, name, tnsr_like):
        buf = getattr(self, name)
        assert len(tnsr_like) <= buf.numel(), f"Data too large for buffer '{name}': {len(tnsr_like)} > {buf.numel()}"
        buf[: len(tnsr_like)].copy_(torch.tensor(tnsr_like, dtype=buf.dtype).to(self.device))

    def nest_sequences(self, input_ids, input_pos, slot_idx):
        """``input_ids``: the new tokens of each sequence; ``input_pos``: its cached length."""
        lens = [len(ids) for ids in input_ids]
        self._store_arg("input_ids", [t for ids in input_ids for t in ids])
        self._store_arg("cu_seqlen", [sum(lens[:i]) for i in range(len(lens) + 1)])
        self._store_arg("input_pos", input_pos)
        self._store_arg("slot_idx", slot_idx)
        self.num_seqs = len(input_ids)

    def set_generate_only_batch(self, batch_size):
        """The dummy decode batch a capture runs on: one token per sequence, sequences in slots 0.."""
        self.nest_sequences([[1]] * batch_size, [0] * batch_size, list(range(batch_size)))


class Model:
    def __init__(self, device):
        gen = generator(10687)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(3))
        self.wo = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


def forward_generate(model, info, k_cache, v_cache, bs):
    """Generate-only step over views of the persistent buffers (what the decode graphs capture)."""
    cu, pos, slot = info.cu_seqlen[: bs + 1], info.input_pos[:bs], info.slot_idx[:bs]
    x = model.emb[info.input_ids[:bs][cu[:-1]]]
    q, k, v = x @ model.wq, x @ model.wk, x @ model.wv
    k_cache[slot, pos] = k
    v_cache[slot, pos] = v
    keys, vals = k_cache[slot], v_cache[slot]                               # [bs, MAX_SEQ_LEN, DIM]
    scores = torch.einsum("bd,bsd->bs", q, keys) * DIM ** -0.5
    scores = scores.masked_fill(torch.arange(MAX_SEQ_LEN, device=q.device)[None, :] > pos[:, None], -1e9)
    return torch.einsum("bs,bsd->bd", torch.softmax(scores, -1), vals) @ model.wo


def forward_context(model, info, k_cache, v_cache):
    """Context (prefill) step, always eager: causal attention within each nested sequence."""
    cu, outs = info.cu_seqlen[: info.num_seqs + 1].tolist(), []
    for b in range(info.num_seqs):
        slot, start = int(info.slot_idx[b]), int(info.input_pos[b])
        x = model.emb[info.input_ids[cu[b]:cu[b + 1]]]
        n = x.shape[0]
        k_cache[slot, start:start + n] = x @ model.wk
        v_cache[slot, start:start + n] = x @ model.wv
        keys, vals = k_cache[slot, : start + n], v_cache[slot, : start + n]
        scores = (x @ model.wq) @ keys.T * DIM ** -0.5
        causal = torch.arange(start + n, device=x.device)[None, :] > (start + torch.arange(n, device=x.device))[:, None]
        outs.append(torch.softmax(scores.masked_fill(causal, -1e9), -1) @ vals @ model.wo)
    return torch.cat(outs)


class CapturedGraph:
    """The torch-cudagraph backend: one graph per batch size, captured largest first into a shared pool."""

    def __init__(self, model, info, k_cache, v_cache, cuda_graph_batch_sizes, device):
        self.model, self.info, self.k_cache, self.v_cache = model, info, k_cache, v_cache
        self.cuda_graph_batch_sizes = cuda_graph_batch_sizes
        self.device, self.graphs, self.outputs = device, {}, {}

    def capture_graph(self):
        pool = graph_pool_handle(self.device)
        for bs in sorted(self.cuda_graph_batch_sizes, reverse=True):
            self.info.set_generate_only_batch(bs)
            self.graphs[bs], self.outputs[bs] = capture(
                lambda bs=bs: forward_generate(self.model, self.info, self.k_cache, self.v_cache, bs),
                device=self.device, pool=pool, owner="AutoDeploy CapturedGraph", name=f"generate bs {bs}",
                static=self.info.args(), state={"k_cache": self.k_cache, "v_cache": self.v_cache})

    def forward(self, bs):
        if bs in self.graphs:
            return replay(self.graphs[bs], self.outputs[bs])
        return forward_generate(self.model, self.info, self.k_cache, self.v_cache, bs)


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    prompts = [[3, 5, 7], [2, 4, 6], [1, 8, 9], [11, 12, 10]]                # four requests, slots 0..3
    decode = [([0, 1, 2, 3], [13, 14, 15, 0]), ([0, 2], [6, 9]), ([1, 3], [7, 5]), ([0, 1, 2, 3], [1, 2, 3, 4])]

    def serve(graphed: bool):
        info = SequenceInfo(device)
        k_cache = torch.zeros(MAX_BATCH_SIZE, MAX_SEQ_LEN, DIM, device=device)
        v_cache = torch.zeros(MAX_BATCH_SIZE, MAX_SEQ_LEN, DIM, device=device)
        runner = None
        if graphed:
            sizes = update_cuda_graph_batch_sizes(MAX_BATCH_SIZE, None, variant)
            runner = CapturedGraph(model, info, k_cache, v_cache, sizes, device)
            runner.capture_graph()
        info.nest_sequences(prompts, [0] * len(prompts), list(range(len(prompts))))
        outs = [forward_context(model, info, k_cache, v_cache).clone()]
        cached = [len(p) for p in prompts]
        for slots, tokens in decode:
            info.nest_sequences([[t] for t in tokens], [cached[s] for s in slots], slots)
            bs = len(slots)
            out = runner.forward(bs) if graphed else forward_generate(model, info, k_cache, v_cache, bs)
            outs.append(out.clone())
            for s in slots:
                cached[s] += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
