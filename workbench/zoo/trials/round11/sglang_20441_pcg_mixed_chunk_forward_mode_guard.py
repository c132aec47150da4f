"""Piecewise CUDA graphs are compiled and captured for ``EXTEND``; a mixed-chunk batch replays them as ``MIXED``.

Upstream: https://github.com/sgl-project/sglang/pull/20441 ("Fix Piecewise CUDA Graph crash with
`-enable-mixed-chunk`").
Symptom: ``--enable-mixed-chunk`` together with piecewise CUDA graphs (e.g. Qwen3-8B, flashinfer) crashes the
scheduler on the first mixed prefill+decode batch with ``AssertionError: PCG capture stream is not set``; without
mixed chunking, or with PCG off, serving is fine (sglang main, March 2026).
Mechanism: ``PiecewiseCudaGraphRunner`` compiles the model with torch.compile and captures its pieces with every
capture batch built as ``ForwardMode.EXTEND``; the model branches on ``forward_mode``, so Dynamo guards the
compiled code (and the graphs captured under it) on that value. With mixed chunking the scheduler hands a
``ForwardMode.MIXED`` batch to the runner (``is_extend()`` is true for it, so ``can_run`` accepts it), and
``replay_prepare`` copied that mode into the static forward batch. The guard fails, Dynamo recompiles, and the
piecewise backend tries to capture fresh graphs at serving time, where ``get_pcg_capture_stream()`` is ``None``
(it is set only during the capture phase). What capture decided (the EXTEND specialisation) is not what the
replayed step now presents.
Doctor: warmup-divergence, at ``replay_prepare`` (the replayed batch's ``forward_mode`` differs from the one the
graphs were compiled and captured for).
Fix (upstream): ``replay_prepare`` aligns the replay-time mode with the capture-time one: a ``MIXED`` batch is
replayed as ``EXTEND`` (the computation is the same extend path), so the captured graphs are used.
"""
from __future__ import annotations

import enum
import math

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/20441"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "replay_prepare"
SYMPTOM = "first mixed-chunk batch under PCG recompiles and crashes: 'PCG capture stream is not set'"
VOCAB, DIM, MAX_POS, POOL = 12, 4, 16, 64
CAPTURE_NUM_TOKENS = [4, 8]


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3

    def is_extend(self):
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_mixed(self):
        return self == ForwardMode.MIXED


_pcg_capture_stream = None


def set_pcg_capture_stream(stream):
    global _pcg_capture_stream
    _pcg_capture_stream = stream


def get_pcg_capture_stream():
    return _pcg_capture_stream


class ForwardBatch:
    def __init__(self, forward_mode, input_ids, positions, out_cache_loc, extend_seq_lens, extend_prefix_lens,
                 req_pool_indices):
        self.forward_mode = forward_mode
        self.input_ids, self.positions, self.out_cache_loc = input_ids, positions, out_cache_loc
        self.extend_seq_lens, self.extend_prefix_lens = extend_seq_lens, extend_prefix_lens   # host lists
        self.req_pool_indices = req_pool_indices


class AttnBackend:
    """Attention runs outside the piecewise graphs; its metadata is built from the real batch every step."""

    def __init__(self, req_to_token, k_buffer, v_buffer):
        self.req_to_token, self.k_buffer, self.v_buffer = req_to_token, k_buffer, v_buffer
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch):
        self.forward_metadata = (list(forward_batch.extend_seq_lens), list(forward_batch.extend_prefix_lens),
                                 list(forward_batch.req_pool_indices), forward_batch.out_cache_loc)

    def forward_extend(self, q, k, v):
        seq_lens, prefix_lens, pools, out_cache_loc = self.forward_metadata
        n = sum(seq_lens)
        self.k_buffer[out_cache_loc[:n]] = k[:n]
        self.v_buffer[out_cache_loc[:n]] = v[:n]
        o = torch.zeros_like(q)                                  # padded tokens: no attention
        start = 0
        for ext, pre, pool in zip(seq_lens, prefix_lens, pools):
            slots = self.req_to_token[pool, : pre + ext]
            s = q[start:start + ext] @ self.k_buffer[slots].T / math.sqrt(q.shape[-1])
            causal = torch.arange(pre + ext)[None, :] <= (pre + torch.arange(ext))[:, None]
            o[start:start + ext] = torch.softmax(s.masked_fill(~causal.to(q.device), float("-inf")), -1) @ \
                self.v_buffer[slots]
            start += ext
        return o


class Qwen3ForCausalLM:
    def __init__(self, device):
        gen = generator(20441)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.rope = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.3)
        self.wq, self.wk, self.wv, self.wo, self.mlp = (randn(DIM, DIM, gen=gen, device=device, scale=0.5)
                                                        for _ in range(5))
        self.attention = None                                    # set by the runner (PCG splitting op)

    def forward(self, forward_batch: ForwardBatch):
        h = self.embed[forward_batch.input_ids] + self.rope[forward_batch.positions]
        if forward_batch.forward_mode.is_extend():               # Dynamo guards on forward_mode here
            q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
            h = h + self.attention(q, k, v) @ self.wo
        return h + torch.tanh(h @ self.mlp)


class _DynamoCompiled:
    """``torch.compile(model.forward, backend=SGLangPiecewiseBackend)``: one compiled entry per guard set
    (here the ``forward_mode`` the model branches on); a new guard set recompiles, and the piecewise backend
    captures its graphs for the new entry, which needs the PCG capture stream."""

    def __init__(self, model, runner):
        self.model, self.runner = model, runner
        self.cache = {}

    def __call__(self, forward_batch, num_tokens):
        guard = forward_batch.forward_mode
        entry = self.cache.get(guard)
        if entry is None:                                        # (re)compilation
            stream = get_pcg_capture_stream()
            assert stream is not None, "PCG capture stream is not set"
            entry = self.cache[guard] = self.runner.make_piecewise_backend(forward_batch)
            entry.capture()
            return entry.outputs[num_tokens]
        return entry.replay(num_tokens, num_tokens)


class PiecewiseCudaGraphRunner:
    def __init__(self, model, attn_backend, variant, device):
        self.model, self.attn_backend, self.variant, self.device = model, attn_backend, variant, device
        self.capture_num_tokens = CAPTURE_NUM_TOKENS
        max_num_tokens = max(self.capture_num_tokens)
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.compiled = _DynamoCompiled(model, self)
        set_pcg_capture_stream("pcg-capture-stream")
        try:
            self.capture()
        finally:
            set_pcg_capture_stream(None)

    def make_piecewise_backend(self, forward_batch):
        mode = forward_batch.forward_mode
        backend = self.attn_backend

        def forward(num_tokens):
            # capture_one_batch_size: a dummy batch of num_tokens tokens (one request, no prefix)
            fb = ForwardBatch(mode, self.input_ids[:num_tokens], self.positions[:num_tokens],
                              self.out_cache_loc[:num_tokens], [num_tokens], [0], [0])
            backend.init_forward_metadata(fb)
            return self.model.forward(fb)

        manager = GraphManager(forward, self.capture_num_tokens, device=self.device, mode=CUDAGraphMode.PIECEWISE,
                               num_warmups=1, static_buffers={"input_ids": self.input_ids,
                                                              "positions": self.positions},
                               name=f"PiecewiseCudaGraphRunner ({mode.name})")
        self.model.attention = manager.eager(lambda q, k, v: backend.forward_extend(q, k, v))
        return manager

    def capture(self):
        # every capture batch is built as an EXTEND batch
        num_tokens = max(self.capture_num_tokens)
        fb = ForwardBatch(ForwardMode.EXTEND, self.input_ids[:num_tokens], self.positions[:num_tokens],
                          self.out_cache_loc[:num_tokens], [num_tokens], [0], [0])
        self.compiled(fb, num_tokens)

    def can_run(self, forward_batch):
        return forward_batch.forward_mode.is_extend() and len(forward_batch.input_ids) <= max(self.capture_num_tokens)

    def replay_prepare(self, forward_batch):
        num_tokens = len(forward_batch.input_ids)
        static_num_tokens = next(s for s in self.capture_num_tokens if s >= num_tokens)
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        self.positions[:num_tokens].copy_(forward_batch.positions)
        self.input_ids[num_tokens:static_num_tokens].zero_()
        self.positions[num_tokens:static_num_tokens].zero_()
        forward_mode = forward_batch.forward_mode
        if self.variant == "fix" and forward_mode.is_mixed():
            # PCG graphs are captured under EXTEND; MIXED runs the same extend path
            forward_mode = ForwardMode.EXTEND
        static_forward_batch = ForwardBatch(forward_mode, self.input_ids[:static_num_tokens],
                                            self.positions[:static_num_tokens],
                                            self.out_cache_loc[:static_num_tokens], forward_batch.extend_seq_lens,
                                            forward_batch.extend_prefix_lens, forward_batch.req_pool_indices)
        return static_forward_batch, static_num_tokens

    def replay(self, forward_batch):
        num_tokens = len(forward_batch.input_ids)
        static_forward_batch, static_num_tokens = self.replay_prepare(forward_batch)
        # Due to the dispatch kernel for MLA model, we init the metadata with original forward_batch
        self.attn_backend.init_forward_metadata(forward_batch)
        out = self.compiled(static_forward_batch, static_num_tokens)
        return out[:num_tokens]


def run(variant: str, device: str = "cpu"):
    model = Qwen3ForCausalLM(device)
    gen = generator(2)
    req_to_token = torch.arange(4 * MAX_POS, device=device).view(4, MAX_POS)
    k0, v0 = randn(POOL, DIM, gen=gen, device=device), randn(POOL, DIM, gen=gen, device=device)

    def batch(mode, reqs):
        """reqs: (req_pool_index, prefix_len, extend_len)"""
        ids, pos, loc = [], [], []
        for pool, pre, ext in reqs:
            ids += torch.randint(0, VOCAB, (ext,), generator=gen).tolist()
            pos += list(range(pre, pre + ext))
            loc += req_to_token[pool, pre:pre + ext].tolist()
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return ForwardBatch(mode, t(ids), t(pos), t(loc), [r[2] for r in reqs], [r[1] for r in reqs],
                            [r[0] for r in reqs])

    # a prefill chunk, then (mixed chunk on) the next chunk of request 1 mixed with request 0's decode
    batches = [batch(ForwardMode.EXTEND, [(0, 0, 3), (1, 0, 3)]),
               batch(ForwardMode.MIXED, [(1, 3, 4), (0, 3, 1)])]

    def eager():
        backend = AttnBackend(req_to_token, k0.clone(), v0.clone())
        model.attention = backend.forward_extend
        outs = []
        for fb in batches:
            backend.init_forward_metadata(fb)
            outs.append(model.forward(fb).clone())
        return outs

    def served():
        backend = AttnBackend(req_to_token, k0.clone(), v0.clone())
        runner = PiecewiseCudaGraphRunner(model, backend, variant, device)
        backend.k_buffer.copy_(k0)                               # capture's dummy KV writes are discarded
        backend.v_buffer.copy_(v0)
        outs = []
        for fb in batches:
            assert runner.can_run(fb)
            outs.append(runner.replay(fb).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
