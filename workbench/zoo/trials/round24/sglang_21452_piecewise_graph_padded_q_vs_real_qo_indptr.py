"""Piecewise CUDA graph prefill pads q to the captured token count, but FlashInfer is planned for the real tokens only.

Upstream: https://github.com/sgl-project/sglang/pull/21452 ("fix: piecewise_cuda_graph get correct qo_indptr"),
for https://github.com/sgl-project/sglang/issues/21218.
Symptom: extend (prefill) batches served by the piecewise CUDA graph (``--enable-piecewise-cuda-graph``) with
``--attention-backend flashinfer`` fail whenever the batch is padded up to a captured token count: FlashInfer
expects ``qo_indptr[-1]`` to equal ``q.shape[0]`` (its prefill ``run`` rejects ``q.shape[0] (N) does not match
qo_indptr[-1] (n)``, as later reports quote), otherwise it may read invalid KV indices (sglang main, March 2026).
Mechanism: ``PiecewiseCudaGraphRunner`` replays the per-layer graph pieces at the captured ``static_num_tokens``:
``input_ids``/``positions``/``out_cache_loc`` are padded to that count, so the attention split op, run eagerly
between the pieces, receives ``q`` with ``static_num_tokens`` rows. The attention metadata is planned once per
batch by ``FlashInferIndicesUpdaterPrefill.call_begin_forward`` from the forward batch's real requests:
``qo_indptr[1:bs+1] = cumsum(seq_lens - prefix_lens)``, ending at the real extend token count, and ``kv_indptr`` /
``kv_indices`` for those requests only. The paged-prefill wrapper is thus handed a padded ``q`` with an indptr
sized for the real rows.
Doctor: padded-shape-mismatch, at ``call_begin_forward`` (the plan for the padded attention call describes only the
real tokens: ``qo_indptr[-1]`` < ``q.shape[0]``).
Fix (upstream): ``call_begin_forward`` reads the forward context's piecewise token count and, when it exceeds the
real extend tokens, appends a dummy request holding the padding tokens (``qo_indptr`` gets ``pcg_num_tokens``,
``kv_indptr`` gets ``extra_kv`` more entries, all pointing at the scratch KV slot 0), so ``qo_indptr[-1] ==
q.shape[0]`` without touching the causal masks of the real requests.
(Read: the PR description and the fixed ``call_begin_forward`` (flashinfer_mla_backend.py, the same block as the
MHA backend's), a later review quoting it, and #30916 for FlashInfer's check; not the issue nor the diff itself.
Tiny model: one layer, page size 1, no RoPE (a learned position embedding), one attention head.)
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/21452"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "call_begin_forward"
SYMPTOM = "padded piecewise-graph prefill: q.shape[0] (static tokens) does not match qo_indptr[-1] (real tokens)"

VOCAB, DIM, MAX_POS, NUM_SLOTS, MAX_REQS, MAX_CTX = 16, 4, 16, 32, 4, 8
CAPTURE_NUM_TOKENS = [4, 8]           # piecewise_cuda_graph_tokens

_forward_context = SimpleNamespace(num_tokens=None, forward_batch=None)


def get_forward_context():
    return _forward_context


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor

    @property
    def extend_num_tokens(self):
        return self.input_ids.shape[0]


class ReqToTokenPool:
    def __init__(self, device):
        self.req_to_token = torch.zeros(MAX_REQS, MAX_CTX, dtype=torch.long, device=device)


class MHATokenToKVPool:
    """Slot 0 is the padding scratch slot."""

    def __init__(self, device):
        self.k_buffer = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.v_buffer = torch.zeros(NUM_SLOTS, DIM, device=device)

    def set_kv_buffer(self, loc, k, v):
        self.k_buffer[loc] = k
        self.v_buffer[loc] = v


def create_flashinfer_kv_indices(req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr, kv_indices):
    for i, (req, n) in enumerate(zip(req_pool_indices.tolist(), paged_kernel_lens.tolist())):
        start = int(kv_indptr[i])
        kv_indices[start:start + n] = req_to_token[req, :n]


class BatchPrefillWithPagedKVCacheWrapper:
    """FlashInfer's paged prefill: plan() on host-side indptrs, run() over q and the paged KV cache."""

    def plan(self, qo_indptr, kv_indptr, kv_indices):
        self._qo_indptr = qo_indptr.tolist()
        self._kv_indptr = kv_indptr.tolist()
        self._kv_indices = kv_indices

    def run(self, q, k_cache, v_cache):
        if q.shape[0] != self._qo_indptr[-1]:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({self._qo_indptr[-1]})")
        out = torch.empty_like(q)
        for i in range(len(self._qo_indptr) - 1):
            qs, qe = self._qo_indptr[i], self._qo_indptr[i + 1]
            ks, ke = self._kv_indptr[i], self._kv_indptr[i + 1]
            if qe == qs:
                continue
            slots = self._kv_indices[ks:ke]
            k, v = k_cache[slots], v_cache[slots]
            q_pos = torch.arange(qe - qs, device=q.device) + (ke - ks) - (qe - qs)     # causal, end-aligned
            mask = torch.arange(ke - ks, device=q.device)[None, :] <= q_pos[:, None]
            scores = (q[qs:qe] @ k.t()).masked_fill(~mask, float("-inf"))
            out[qs:qe] = torch.softmax(scores, -1) @ v
        return out


class FlashInferIndicesUpdaterPrefill:
    def __init__(self, req_to_token, device, variant):
        self.req_to_token, self.variant = req_to_token, variant
        self.kv_indptr = torch.zeros(MAX_REQS + 1, dtype=torch.long, device=device)
        self.qo_indptr = torch.zeros(MAX_REQS + 1, dtype=torch.long, device=device)

    def update(self, wrapper, forward_batch):
        paged_kernel_lens = forward_batch.seq_lens
        self.call_begin_forward(wrapper, forward_batch.req_pool_indices, paged_kernel_lens,
                                int(paged_kernel_lens.sum()), forward_batch.seq_lens, forward_batch.prefix_lens,
                                self.kv_indptr, self.qo_indptr)

    def call_begin_forward(self, wrapper, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, seq_lens,
                           prefix_lens, kv_indptr, qo_indptr):
        bs = len(seq_lens)
        kv_indptr[1:bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)
        kv_indptr = kv_indptr[:bs + 1]
        qo_lens = seq_lens - prefix_lens
        qo_indptr[1:bs + 1] = torch.cumsum(qo_lens, dim=0)
        qo_indptr = qo_indptr[:bs + 1]

        extra_kv = 0
        if self.variant == "fix":
            # Piecewise CUDA graph padding: q.shape[0] is the static token count; append a dummy request for
            # the padding tokens, its KV mapped to the scratch slot 0.
            fwd_ctx = get_forward_context()
            pcg_num_tokens = fwd_ctx.num_tokens
            actual_qo_tokens = fwd_ctx.forward_batch.extend_num_tokens if fwd_ctx.forward_batch is not None else None
            if pcg_num_tokens is not None and actual_qo_tokens is not None and pcg_num_tokens > actual_qo_tokens:
                extra_kv = pcg_num_tokens - actual_qo_tokens

        kv_indices = torch.empty(paged_kernel_lens_sum + extra_kv, dtype=torch.long, device=req_pool_indices.device)
        create_flashinfer_kv_indices(self.req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr, kv_indices)
        if extra_kv > 0:
            kv_start = paged_kernel_lens_sum
            kv_indices[kv_start:kv_start + extra_kv] = 0
            qo_indptr = torch.cat([qo_indptr, qo_indptr.new_tensor([pcg_num_tokens])])
            kv_indptr = torch.cat([kv_indptr, kv_indptr.new_tensor([kv_start + extra_kv])])
        wrapper.plan(qo_indptr, kv_indptr, kv_indices)


class FlashInferAttnBackend:
    def __init__(self, req_to_token_pool, token_to_kv_pool, device, variant):
        self.token_to_kv_pool = token_to_kv_pool
        self.prefill_wrapper_paged = BatchPrefillWithPagedKVCacheWrapper()
        self.indices_updater_prefill = FlashInferIndicesUpdaterPrefill(req_to_token_pool.req_to_token, device, variant)

    def init_forward_metadata(self, forward_batch):
        self.indices_updater_prefill.update(self.prefill_wrapper_paged, forward_batch)

    def forward_extend(self, q, k, v, out_cache_loc):
        self.token_to_kv_pool.set_kv_buffer(out_cache_loc, k, v)
        return self.prefill_wrapper_paged.run(q, self.token_to_kv_pool.k_buffer, self.token_to_kv_pool.v_buffer)


class LlamaForCausalLM:
    """Two graph pieces around the attention split op, which runs eagerly."""

    def __init__(self, device):
        gen = generator(21452)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo, self.w_up = (randn(DIM, DIM, gen=gen, device=device, scale=0.7)
                                                         for _ in range(5))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.6)

    def piece_0(self, input_ids, positions):
        h = self.embed[input_ids] + self.pos_embed[positions]
        return h, h @ self.wq, h @ self.wk, h @ self.wv

    def piece_1(self, h, attn_output):
        h = h + attn_output @ self.wo
        h = h + torch.relu(h @ self.w_up)
        return h @ self.lm_head


class ModelRunner:
    def __init__(self, device, variant):
        self.device = device
        self.model = LlamaForCausalLM(device)
        self.req_to_token_pool = ReqToTokenPool(device)
        self.token_to_kv_pool = MHATokenToKVPool(device)
        self.attn_backend = FlashInferAttnBackend(self.req_to_token_pool, self.token_to_kv_pool, device, variant)

    def forward_extend(self, forward_batch):
        """Eager extend: exactly the batch's tokens."""
        _forward_context.num_tokens, _forward_context.forward_batch = None, forward_batch
        self.attn_backend.init_forward_metadata(forward_batch)
        h, q, k, v = self.model.piece_0(forward_batch.input_ids, forward_batch.positions)
        attn = self.attn_backend.forward_extend(q, k, v, forward_batch.out_cache_loc)
        return self.model.piece_1(h, attn)


class PiecewiseCudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = device = model_runner.device
        max_num_tokens = max(CAPTURE_NUM_TOKENS)
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.out_cache_loc = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.attn_output = torch.zeros(max_num_tokens, DIM, device=device)
        self.pieces = {}
        for num_tokens in sorted(CAPTURE_NUM_TOKENS, reverse=True):
            self.capture_one_batch_size(num_tokens)

    def capture_one_batch_size(self, num_tokens):
        model = self.model_runner.model
        g0, out0 = capture(lambda: model.piece_0(self.input_ids[:num_tokens], self.positions[:num_tokens]),
                           device=self.device, name=f"piece 0, {num_tokens} tokens", owner="PiecewiseCudaGraphRunner",
                           static={"input_ids": self.input_ids, "positions": self.positions})
        g1, out1 = capture(lambda: model.piece_1(out0[0], self.attn_output[:num_tokens]), device=self.device,
                           name=f"piece 1, {num_tokens} tokens", owner="PiecewiseCudaGraphRunner",
                           static={"attn_output": self.attn_output})
        self.pieces[num_tokens] = (g0, out0, g1, out1)

    def can_run(self, forward_batch):
        return forward_batch.extend_num_tokens <= max(CAPTURE_NUM_TOKENS)

    def replay(self, forward_batch):
        n = forward_batch.extend_num_tokens
        static_num_tokens = min(s for s in CAPTURE_NUM_TOKENS if s >= n)
        self.input_ids[:n].copy_(forward_batch.input_ids)
        self.positions[:n].copy_(forward_batch.positions)
        self.out_cache_loc[:n].copy_(forward_batch.out_cache_loc)
        self.input_ids[n:static_num_tokens].zero_()
        self.positions[n:static_num_tokens].zero_()
        self.out_cache_loc[n:static_num_tokens].zero_()          # padding tokens write the scratch slot 0
        _forward_context.num_tokens, _forward_context.forward_batch = static_num_tokens, forward_batch
        backend = self.model_runner.attn_backend
        backend.init_forward_metadata(forward_batch)
        g0, out0, g1, out1 = self.pieces[static_num_tokens]
        _, q, k, v = replay(g0, out0, real=n, size=static_num_tokens)
        # the attention split op runs eagerly at the padded size
        self.attn_output[:static_num_tokens].copy_(
            backend.forward_extend(q, k, v, self.out_cache_loc[:static_num_tokens]))
        return replay(g1, out1, real=n, size=static_num_tokens)[:n].clone()


def run(variant: str, device: str = "cpu"):
    # Extend steps: (req_pool_idx, new token ids, prefix_len, first slot); prefix hits reuse earlier slots.
    steps = [[(0, [3, 9], 0, 1), (1, [4, 1, 7], 0, 3)],          # 5 tokens -> padded to 8
             [(0, [5, 2, 8], 2, 6), (2, [6], 0, 9)],             # 4 tokens -> exactly 4
             [(1, [2, 11], 3, 10), (3, [7], 0, 12)]]             # 3 tokens -> padded to 4

    def batch_of(runner, step):
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        ids, pos, loc = [], [], []
        for req, toks, prefix, slot in step:
            slots = list(range(slot, slot + len(toks)))
            runner.req_to_token_pool.req_to_token[req, prefix:prefix + len(toks)] = t(slots)
            ids += toks
            pos += list(range(prefix, prefix + len(toks)))
            loc += slots
        return ForwardBatch(t(ids), t(pos), t(loc), t([r for r, *_ in step]),
                            t([p + len(x) for _, x, p, _ in step]), t([p for _, _, p, _ in step]))

    def eager():
        runner = ModelRunner(device, variant)
        return [runner.forward_extend(batch_of(runner, step)).clone() for step in steps]

    def served():
        runner = ModelRunner(device, variant)
        graph_runner = PiecewiseCudaGraphRunner(runner)
        runner.token_to_kv_pool.k_buffer.zero_()                 # capture-time writes hit slot 0 only
        runner.token_to_kv_pool.v_buffer.zero_()
        outs = []
        for step in steps:
            fb = batch_of(runner, step)
            outs.append(graph_runner.replay(fb) if graph_runner.can_run(fb) else runner.forward_extend(fb).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
