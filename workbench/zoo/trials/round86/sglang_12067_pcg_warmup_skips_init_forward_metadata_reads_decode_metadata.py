"""Piecewise CUDA graph warmup runs the model without initialising the attention backend's forward metadata, so the extend forward reads the ``DecodeMetadata`` that the decode graph capture left behind.

Upstream: https://github.com/sgl-project/sglang/pull/12067 ("[b200] fix piecewise cuda graph launch bug",
sgl-project/sglang, merged; description dated 2025-10-24). Read: the PR description (bug 1: error text, root cause
and the one-line fix; bug 2, the CUTLASS/TMA fallback on B200, is not modelled) and the earlier, closed attempt
https://github.com/sgl-project/sglang/pull/11569 (same title idea, same traceback through
``PiecewiseCudaGraphRunner.__init__``). The diff itself was not read; the fix below is the one the description
states ("Add ``self.model_runner.attn_backend.init_forward_metadata(forward_batch)`` before calling
``model.forward()`` in the warmup phase").
Symptom: launching with ``--enable-piecewise-cuda-graph`` (FlashInfer attention, as on B200) dies while the
``ModelRunner`` builds its ``PiecewiseCudaGraphRunner``: ``AttributeError: 'DecodeMetadata' object has no attribute
'prefill_wrappers'``. Without piecewise graphs the server starts and serves.
Mechanism: ``ModelRunner`` first captures the decode graphs (``CudaGraphRunner``): for each batch size
``FlashInferAttnBackend.init_forward_metadata_capture_cuda_graph`` sets ``self.forward_metadata`` to a
``DecodeMetadata`` (decode wrappers bound to the graph's kv-index buffers). It then builds the
``PiecewiseCudaGraphRunner``, whose ``warmup_and_capture()`` makes a dummy EXTEND ``ForwardBatch`` per token bucket
and calls ``model.forward()`` directly. The eager path (``ModelRunner.forward_extend``) always calls
``attn_backend.init_forward_metadata(forward_batch)`` first; the warmup did not, so the attention layer (the
splitting op that runs between the captured pieces) reads whatever plan the last step left: the decode capture's
``DecodeMetadata``, which has no ``prefill_wrappers``.
Doctor: warmup-divergence, at warmup_and_capture. The warmup/capture path decides the attention plan differently
from the eager step: it reuses the plan a previous (decode-graph) capture left in ``forward_metadata`` instead of
planning for its own batch as ``forward_extend`` does.
Fix (upstream): ``warmup_and_capture`` calls ``attn_backend.init_forward_metadata(forward_batch)`` before the warmup
``model.forward()``.
Modelled: ``ModelRunner`` (init order: decode graphs, then piecewise graphs; ``forward_extend`` /
``forward_decode``), ``CudaGraphRunner`` (decode, bs [1, 2, 4], padded rows go to a dummy request row whose tokens
sit in KV slot 0), ``PiecewiseCudaGraphRunner`` (token buckets [4, 8]; the model is split at attention into two
captured pieces, qkv projection and o-proj + lm head, with the attention running eagerly between them, as the
torch.compile piecewise backend does), ``FlashInferAttnBackend`` with ``PrefillMetadata`` / ``DecodeMetadata`` and
stand-ins for the prefill wrapper (plan on host indptrs) and the CUDA-graph decode wrapper (static kv-index and
kv-length buffers). One attention layer, hidden 8, vocab 16, float64, page size 1.
Workload: prefill A (3 tokens) + B (4 tokens): 7 tokens in the 8-token piecewise graph; decode [A, B] in the bs-2
decode graph; prefill C (2 tokens) in the 4-token piecewise graph; decode [A, B, C] padded to the bs-4 graph.
Outputs: every step's logits. Bug: engine start-up raises the AttributeError above before any step. Fix: equal to
eager.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/12067"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "warmup_and_capture"
SYMPTOM = ("--enable-piecewise-cuda-graph with FlashInfer: PiecewiseCudaGraphRunner warmup calls model.forward() "
           "without init_forward_metadata, the extend attention reads the DecodeMetadata left by the decode graph "
           "capture and start-up dies with \"'DecodeMetadata' object has no attribute 'prefill_wrappers'\"")

HIDDEN, VOCAB = 8, 16
MAX_REQS, MAX_CTX = 4, 16
DUMMY_REQ = MAX_REQS                          # req_to_token row of the padding/dummy request (all slot 0)
NUM_SLOTS = 1 + MAX_REQS * MAX_CTX            # slot 0: the dummy slot
DECODE_CAPTURE_BS = [1, 2, 4]
PCG_CAPTURE_NUM_TOKENS = [4, 8]

_variant = "bug"


class ForwardMode:
    EXTEND = "extend"
    DECODE = "decode"


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: str
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list
    extend_seq_lens_cpu: list | None = None


@dataclasses.dataclass
class PrefillMetadata:
    prefill_wrappers: list


@dataclasses.dataclass
class DecodeMetadata:
    decode_wrappers: list


class BatchPrefillWithPagedKVCacheWrapper:
    """Stand-in for FlashInfer's prefill wrapper: ``plan`` on host indptrs, ``run`` causal over paged KV."""

    def plan(self, qo_indptr, kv_indptr, kv_indices):
        self.qo_indptr, self.kv_indptr, self.kv_indices = qo_indptr, kv_indptr, kv_indices

    def run(self, q, k_cache, v_cache):
        outs = []
        for i in range(len(self.qo_indptr) - 1):
            qs = q[self.qo_indptr[i]:self.qo_indptr[i + 1]]
            idx = self.kv_indices[self.kv_indptr[i]:self.kv_indptr[i + 1]]
            keys, vals = k_cache[idx], v_cache[idx]
            scores = qs @ keys.T * HIDDEN ** -0.5
            n_q, n_k = qs.shape[0], keys.shape[0]
            allowed = (torch.arange(n_k, device=q.device).unsqueeze(0)
                       <= (n_k - n_q + torch.arange(n_q, device=q.device)).unsqueeze(1))
            outs.append(torch.softmax(scores.masked_fill(~allowed, -1e9), -1) @ vals)
        return torch.cat(outs)


class BatchDecodeWrapper:
    """Stand-in for the (CUDA-graph) decode wrapper: per-row kv indices and lengths held in tensors."""

    def __init__(self, kv_indices, kv_lens):
        self.kv_indices, self.kv_lens = kv_indices, kv_lens

    def run(self, q, k_cache, v_cache):
        keys, vals = k_cache[self.kv_indices], v_cache[self.kv_indices]        # [bs, MAX_CTX, H]
        scores = (keys * q.unsqueeze(1)).sum(-1) * HIDDEN ** -0.5
        valid = torch.arange(MAX_CTX, device=q.device).unsqueeze(0) < self.kv_lens.unsqueeze(1)
        return (torch.softmax(scores.masked_fill(~valid, -1e9), -1).unsqueeze(-1) * vals).sum(1)


class FlashInferAttnBackend:
    def __init__(self, req_to_token, device):
        self.req_to_token = req_to_token
        self.k_cache = torch.zeros(NUM_SLOTS, HIDDEN, device=device, dtype=torch.float64)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.forward_metadata = None
        self.decode_cuda_graph_metadata = {}

    def init_forward_metadata(self, fb: ForwardBatch):
        """Plan for this batch (eager steps, and piecewise replays)."""
        if fb.forward_mode == ForwardMode.EXTEND:
            qo, kv, idx = [0], [0], []
            for r, (ext, total) in enumerate(zip(fb.extend_seq_lens_cpu, fb.seq_lens_cpu)):
                qo.append(qo[-1] + ext)
                kv.append(kv[-1] + total)
                idx.append(self.req_to_token[fb.req_pool_indices[r], :total])
            wrapper = BatchPrefillWithPagedKVCacheWrapper()
            wrapper.plan(qo, kv, torch.cat(idx))
            self.forward_metadata = PrefillMetadata([wrapper])
        else:
            self.forward_metadata = DecodeMetadata([BatchDecodeWrapper(self.req_to_token[fb.req_pool_indices],
                                                                       fb.seq_lens)])

    def init_cuda_graph_state(self, max_bs, device):
        self.cuda_graph_kv_indices = torch.zeros(max_bs, MAX_CTX, dtype=torch.int64, device=device)
        self.cuda_graph_kv_lens = torch.ones(max_bs, dtype=torch.int64, device=device)

    def init_forward_metadata_capture_cuda_graph(self, bs):
        wrapper = BatchDecodeWrapper(self.cuda_graph_kv_indices[:bs], self.cuda_graph_kv_lens[:bs])
        self.decode_cuda_graph_metadata[bs] = wrapper
        self.forward_metadata = DecodeMetadata([wrapper])

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens):
        self.cuda_graph_kv_indices[:bs].copy_(self.req_to_token[req_pool_indices])
        self.cuda_graph_kv_lens[:bs].copy_(seq_lens)
        self.forward_metadata = DecodeMetadata([self.decode_cuda_graph_metadata[bs]])

    def forward(self, q, k, v, fb: ForwardBatch):
        self.k_cache[fb.out_cache_loc] = k
        self.v_cache[fb.out_cache_loc] = v
        if fb.forward_mode == ForwardMode.EXTEND:
            return self.forward_metadata.prefill_wrappers[0].run(q, self.k_cache, self.v_cache)
        return self.forward_metadata.decode_wrappers[0].run(q, self.k_cache, self.v_cache)


class LlamaForCausalLM:
    """One attention layer; ``qkv`` and ``post`` are the two pieces either side of the attention split."""

    def __init__(self, device):
        gen = generator(12067)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed, self.pos_emb = r(VOCAB, HIDDEN, scale=1.0), r(MAX_CTX, HIDDEN)
        self.wq, self.wk, self.wv, self.wo, self.w_mlp = (r(HIDDEN, HIDDEN) for _ in range(5))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    def qkv(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos_emb[positions]
        return h @ self.wq, h @ self.wk, h @ self.wv, h

    def post(self, attn_out, h):
        h = h + attn_out @ self.wo
        return (h + torch.tanh(h @ self.w_mlp)) @ self.lm_head

    def forward(self, input_ids, positions, fb, attn_backend):
        q, k, v, h = self.qkv(input_ids, positions)
        return self.post(attn_backend.forward(q, k, v, fb), h)


class CudaGraphRunner:
    """Decode graphs; padded rows point at the dummy request (KV slot 0)."""

    def __init__(self, model_runner):
        self.mr, dev = model_runner, model_runner.device
        max_bs = max(DECODE_CAPTURE_BS)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.full((max_bs,), DUMMY_REQ, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.mr.attn_backend.init_cuda_graph_state(max_bs, dev)
        self.graphs = {}
        for bs in reversed(DECODE_CAPTURE_BS):
            self.graphs[bs] = self.capture_one_batch_size(bs)

    def _fb(self, bs):
        return ForwardBatch(ForwardMode.DECODE, bs, self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs],
                            self.req_pool_indices[:bs], self.seq_lens[:bs], [1] * bs)

    def capture_one_batch_size(self, bs):
        backend, fb = self.mr.attn_backend, self._fb(bs)
        backend.init_forward_metadata_capture_cuda_graph(bs)
        return capture(lambda: self.mr.model.forward(fb.input_ids, fb.positions, fb, backend), device=self.mr.device,
                       name=f"decode bs={bs}", owner="CudaGraphRunner",
                       static={"input_ids": self.input_ids, "positions": self.positions,
                               "out_cache_loc": self.out_cache_loc, "cuda_graph_kv_indices": backend.cuda_graph_kv_indices,
                               "cuda_graph_kv_lens": backend.cuda_graph_kv_lens},
                       state={"k_cache": backend.k_cache, "v_cache": backend.v_cache})

    def replay(self, fb: ForwardBatch):
        raw_bs = fb.batch_size
        bs = next(b for b in DECODE_CAPTURE_BS if b >= raw_bs)
        for buf, src, pad in ((self.input_ids, fb.input_ids, 0), (self.positions, fb.positions, 0),
                              (self.out_cache_loc, fb.out_cache_loc, 0),
                              (self.req_pool_indices, fb.req_pool_indices, DUMMY_REQ), (self.seq_lens, fb.seq_lens, 1)):
            buf[:raw_bs].copy_(src)
            buf[raw_bs:bs].fill_(pad)
        self.mr.attn_backend.init_forward_metadata_replay_cuda_graph(bs, self.req_pool_indices[:bs], self.seq_lens[:bs])
        g, out = self.graphs[bs]
        return replay(g, out, real=raw_bs, size=bs)[:raw_bs]


class PiecewiseCudaGraphRunner:
    """Token-bucket graphs of the pieces around the attention split (attention runs eagerly between them)."""

    def __init__(self, model_runner):
        self.mr, dev = model_runner, model_runner.device
        n_max = max(PCG_CAPTURE_NUM_TOKENS)
        self.input_ids = torch.zeros(n_max, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n_max, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n_max, dtype=torch.int64, device=dev)
        self.attn_output = torch.zeros(n_max, HIDDEN, dtype=torch.float64, device=dev)
        self.graphs = {}
        for n in reversed(PCG_CAPTURE_NUM_TOKENS):
            self.graphs[n] = self.warmup_and_capture(n)

    def warmup_and_capture(self, num_tokens):
        """The hazard site: the warmup forward must be planned for its own dummy EXTEND batch."""
        mr, n = self.mr, num_tokens
        forward_batch = ForwardBatch(ForwardMode.EXTEND, 1, self.input_ids[:n], self.positions[:n],
                                     self.out_cache_loc[:n], torch.tensor([DUMMY_REQ], device=mr.device),
                                     torch.tensor([n], device=mr.device), [n], [n])
        if _variant == "fix":            # upstream fix: plan the attention for the warmup batch
            mr.attn_backend.init_forward_metadata(forward_batch)
        mr.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch, mr.attn_backend)  # warmup
        qkv_graph = capture(lambda: mr.model.qkv(self.input_ids[:n], self.positions[:n]), device=mr.device,
                            name=f"pcg piece0 [{n}]", owner="PiecewiseCudaGraphRunner",
                            static={"input_ids": self.input_ids, "positions": self.positions})
        h = qkv_graph[1][3]
        post_graph = capture(lambda: mr.model.post(self.attn_output[:n], h), device=mr.device,
                             name=f"pcg piece1 [{n}]", owner="PiecewiseCudaGraphRunner",
                             static={"attn_output": self.attn_output})
        return qkv_graph, post_graph

    def replay(self, fb: ForwardBatch):
        raw, n = fb.input_ids.shape[0], next(b for b in PCG_CAPTURE_NUM_TOKENS if b >= fb.input_ids.shape[0])
        self.input_ids[:raw].copy_(fb.input_ids)
        self.input_ids[raw:n].zero_()
        self.positions[:raw].copy_(fb.positions)
        self.positions[raw:n].zero_()
        self.mr.attn_backend.init_forward_metadata(fb)
        (g0, out0), (g1, out1) = self.graphs[n]
        q, k, v, _ = replay(g0, out0, real=raw, size=n)
        self.attn_output[:raw].copy_(self.mr.attn_backend.forward(q[:raw], k[:raw], v[:raw], fb))
        self.attn_output[raw:n].zero_()
        return replay(g1, out1, real=raw, size=n)[:raw]


class ModelRunner:
    def __init__(self, device, use_graphs):
        self.device = device
        self.req_to_token = torch.zeros(MAX_REQS + 1, MAX_CTX, dtype=torch.int64, device=device)
        for r in range(MAX_REQS):
            self.req_to_token[r] = 1 + r * MAX_CTX + torch.arange(MAX_CTX, device=device)
        self.model = LlamaForCausalLM(device)
        self.attn_backend = FlashInferAttnBackend(self.req_to_token, device)
        self.cuda_graph_runner = CudaGraphRunner(self) if use_graphs else None
        self.piecewise_cuda_graph_runner = PiecewiseCudaGraphRunner(self) if use_graphs else None

    def forward_extend(self, fb):
        if self.piecewise_cuda_graph_runner is not None and fb.input_ids.shape[0] <= max(PCG_CAPTURE_NUM_TOKENS):
            return self.piecewise_cuda_graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        return self.model.forward(fb.input_ids, fb.positions, fb, self.attn_backend)

    def forward_decode(self, fb):
        if self.cuda_graph_runner is not None and fb.batch_size <= max(DECODE_CAPTURE_BS):
            return self.cuda_graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        return self.model.forward(fb.input_ids, fb.positions, fb, self.attn_backend)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 7, 1], "B": [5, 2, 9, 4], "C": [11, 6]}
    slot = {"A": 0, "B": 1, "C": 2}

    def serve(use_graphs):
        mr = ModelRunner(device, use_graphs)
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        lens, last, outs = {}, {}, []

        def prefill(names):
            ids = [tok for n in names for tok in prompts[n]]
            pos = [p for n in names for p in range(len(prompts[n]))]
            locs = [int(mr.req_to_token[slot[n], p]) for n in names for p in range(len(prompts[n]))]
            fb = ForwardBatch(ForwardMode.EXTEND, len(names), t(ids), t(pos), t(locs), t([slot[n] for n in names]),
                              t([len(prompts[n]) for n in names]), [len(prompts[n]) for n in names],
                              [len(prompts[n]) for n in names])
            logits = mr.forward_extend(fb)
            outs.append(logits.clone())
            ends = torch.cumsum(t([len(prompts[n]) for n in names]), 0) - 1
            for n, nxt in zip(names, logits[ends].argmax(-1).tolist()):
                lens[n], last[n] = len(prompts[n]), nxt

        def decode(names):
            pos = [lens[n] for n in names]
            fb = ForwardBatch(ForwardMode.DECODE, len(names), t([last[n] for n in names]), t(pos),
                              t([int(mr.req_to_token[slot[n], p]) for n, p in zip(names, pos)]),
                              t([slot[n] for n in names]), t([p + 1 for p in pos]), [p + 1 for p in pos])
            logits = mr.forward_decode(fb)
            outs.append(logits.clone())
            for n, nxt in zip(names, logits.argmax(-1).tolist()):
                lens[n], last[n] = lens[n] + 1, nxt

        prefill(["A", "B"])
        decode(["A", "B"])
        prefill(["C"])
        decode(["A", "B", "C"])
        decode(["A", "B", "C"])
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
