"""PIECEWISE DeepSeek-V4 prefill hands the eager attention core a bucket-padded ``q`` next to real-sized indptrs.

Upstream: https://github.com/ROCm/ATOM/pull/1595 ("[atom-vllm][Bugfix] DeepSeek-V4: reconcile CUDA-graph
padding in vLLM PIECEWISE attention"), commit 4acedd49b.
Symptom: with vLLM ``cudagraph_mode=FULL_AND_PIECEWISE``, a prefill/mixed batch padded up to a captured
bucket aborts in the paged-prefill kernel: ``[AITER] pa_sparse_prefill_opus_kernels.cu:60
kv_indptr_prefix length must be N+1``, which kills EngineCore and hangs the server mid gsm8k run.
Mechanism: under PIECEWISE, ``DeepseekV4Attention.forward`` takes the NARROW split: the Q/KV projections
``_attn_pre`` are a captured piece replayed at the padded bucket width ``T_pad`` (vLLM pads
``input_ids``/``positions`` to ``num_input_tokens``), then the splitting op ``v4_core_attention`` runs
eagerly and calls ``self._attn_core(x, q, kv_pre, ..., positions)`` directly, then the graphed
``_attn_post`` piece. The plugin's padding reconciliation lived only in
``DeepseekV4AttentionVllm.forward_impl`` (the WIDE split, FULL/NONE), which the NARROW path never calls.
The sparse-attention metadata (``batch_id_per_token``, ``kv_indptr_prefix_*``, ``kv_indptr_extend``) is
built for the real token count, so ``_attn_core`` passes ``sparse_attn_v4_paged_prefill`` a ``T_pad``-row
``q`` with a ``T_real + 1`` indptr, and the kernel's contract check aborts.
Doctor: padded-shape-mismatch, at ``sparse_attn_v4_paged_prefill`` (where the padded-width ``q`` from the
graphed piece meets the real-sized ``kv_indptr_prefix``; the eager ``_attn_core`` feeds it).
Fix (upstream): an ``_attn_core`` override in ``DeepseekV4AttentionVllm``: outside dummy runs and decode,
with ``num_real = batch_id_per_token.shape[0] < num_in = x.size(0)``, clip every per-token input to
``num_real``, run the native core, and ``F.pad`` the output back to ``num_in`` so the piecewise output
buffer and the graphed ``_attn_post`` keep the captured shape. Decode and dummy runs are untouched.
Diff read: yes (the ``_attn_core`` override and class docstring; the native ``forward`` / ``_attn_pre`` /
``_attn_post`` / ``sparse_attn_v4_paged_prefill`` call read at that commit). Simplified: one layer, the
indexer/compressor inputs (``qr``, ``idx_*``) and the FULL decode graph are left out.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/ATOM/pull/1595"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "sparse_attn_v4_paged_prefill"
SYMPTOM = "paged-prefill kernel aborts: kv_indptr_prefix length must be N+1 (EngineCore dies, server hangs)"

VOCAB, DIM, N_HEADS, HEAD_DIM = 32, 8, 2, 4
MAX_SEQ_LEN, NUM_SLOTS = 8, 4
CAPTURE_SIZES = [4, 8]           # piecewise num_tokens buckets
MAX_NUM_TOKENS = max(CAPTURE_SIZES)


@dataclasses.dataclass
class AttentionMetaData_DSV4:
    state: str                          # "PREFILL" (prefill/mixed) or "DECODE"
    batch_id_per_token: torch.Tensor    # [T_real]
    kv_indices_prefix: torch.Tensor     # rows of unified_kv (earlier chunks)
    kv_indptr_prefix: torch.Tensor      # [T_real + 1]
    kv_indices_extend: torch.Tensor     # rows of this chunk's kv
    kv_indptr_extend: torch.Tensor      # [T_real + 1]
    slot_rows: torch.Tensor             # [T_real] unified_kv row each token's kv is written to


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: AttentionMetaData_DSV4 | None
    is_dummy_run: bool
    num_tokens: int                     # batch_descriptor.num_tokens (the padded bucket)
    num_real: int
    cudagraph: bool


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    return _forward_context


def _dense_mask(indptr, indices, n_rows, n_cols):
    rows = torch.repeat_interleave(torch.arange(n_rows, device=indptr.device), indptr[1:] - indptr[:-1])
    mask = torch.zeros(n_rows, n_cols, dtype=torch.bool, device=indptr.device)
    mask[rows, indices] = True
    return mask


def sparse_attn_v4_paged_prefill(q, unified_kv, kv_indices_prefix, kv_indptr_prefix, kv, kv_indices_extend,
                                 kv_indptr_extend, softmax_scale):
    """Token ``t`` attends over ``unified_kv[kv_indices_prefix[indptr_prefix[t]:indptr_prefix[t+1]]]`` and
    ``kv[kv_indices_extend[...]]`` (values = keys). ``q``: [N, H, D]."""
    n = q.shape[0]
    if kv_indptr_prefix.shape[0] != n + 1:
        raise RuntimeError(f"[AITER] pa_sparse_prefill_opus_kernels.cu:60 kv_indptr_prefix length must be N+1 "
                           f"(N={n}, got {kv_indptr_prefix.shape[0]})")
    keys = torch.cat([unified_kv, kv], 0)                                       # [P + T, D]
    mask = torch.cat([_dense_mask(kv_indptr_prefix, kv_indices_prefix, n, unified_kv.shape[0]),
                      _dense_mask(kv_indptr_extend, kv_indices_extend, n, kv.shape[0])], 1)
    scores = torch.einsum("nhd,kd->nhk", q, keys) * softmax_scale
    scores = scores.masked_fill(~mask[:, None, :], -1e9)
    return torch.einsum("nhk,kd->nhd", torch.softmax(scores, -1), keys)


class CUDAGraphWrapper:
    """vLLM's piecewise wrapper: one graph per ``num_tokens`` bucket, captured on first sight."""

    def __init__(self, runnable, name, device):
        self.runnable, self.name, self.device = runnable, name, device
        self.entries = {}

    def __call__(self, *args):
        fc = get_forward_context()
        if not fc.cudagraph:
            return self.runnable(*args)
        entry = self.entries.get(fc.num_tokens)
        if entry is None:
            static = tuple(a.clone() for a in args)
            g, out = capture(lambda: self.runnable(*static), device=self.device, name=self.name,
                             owner=f"CUDAGraphWrapper ({self.name})",
                             static={f"{self.name}.arg{i}": s for i, s in enumerate(static)})
            self.entries[fc.num_tokens] = (g, static, out)
            return out
        g, static, out = entry
        for s, a in zip(static, args):
            s.copy_(a)
        # the padded token rows of the piece's inputs are what the runner's persistent buffers held
        padded = {f"{self.name}.arg{i}": s for i, s in enumerate(static)} if self.name == "_attn_pre" else None
        return replay(g, out, real=fc.num_real, size=fc.num_tokens, padded=padded)


class DeepseekV4Attention:
    def __init__(self, device):
        gen = generator(1595)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, N_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wkv = randn(DIM, HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wo = randn(N_HEADS * HEAD_DIM, DIM, gen=gen, device=device, scale=0.5)
        self.unified_kv = torch.zeros(NUM_SLOTS * MAX_SEQ_LEN, HEAD_DIM, device=device)
        self.softmax_scale = HEAD_DIM ** -0.5
        self.attn_pre = CUDAGraphWrapper(self._attn_pre, "_attn_pre", device)
        self.attn_post = CUDAGraphWrapper(self._attn_post, "_attn_post", device)

    def forward(self, x, positions):
        # PIECEWISE cudagraph -> NARROW split attention
        q, kv_pre = self.attn_pre(x)
        o = v4_core_attention(self, x, q, kv_pre, positions)
        return self.attn_post(o)

    def _attn_pre(self, x):
        """Q/KV projections (graphable, num_tokens)."""
        return x @ self.wq, x @ self.wkv

    def _attn_post(self, o):
        """Output projection (graphable, num_tokens-shaped)."""
        return o @ self.wo

    def _attn_core(self, x, q, kv_pre, positions):
        fc = get_forward_context()
        if fc.is_dummy_run:                       # dummy/bypass forwards short-circuit
            return x.new_zeros(x.shape[0], N_HEADS * HEAD_DIM)
        attn_md = fc.attn_metadata
        q_sa = q.view(q.shape[0], N_HEADS, HEAD_DIM)
        o = sparse_attn_v4_paged_prefill(q_sa, self.unified_kv, attn_md.kv_indices_prefix,
                                         attn_md.kv_indptr_prefix, kv_pre, attn_md.kv_indices_extend,
                                         attn_md.kv_indptr_extend, self.softmax_scale)
        # swa_write AFTER attn: this chunk's kv into the per-request cache rows
        self.unified_kv[attn_md.slot_rows] = kv_pre
        return o.flatten(1)


class DeepseekV4AttentionVllm(DeepseekV4Attention):
    def __init__(self, device, variant):
        super().__init__(device)
        self.variant = variant

    def _attn_core(self, x, q, kv_pre, positions):
        if self.variant == "bug":                 # only forward_impl (WIDE split) reconciled the padding
            return super()._attn_core(x, q, kv_pre, positions)
        fc = get_forward_context()
        if not fc.is_dummy_run:
            attn_md = fc.attn_metadata
            if attn_md is not None and attn_md.state != "DECODE":
                num_in = x.size(0)
                bid = attn_md.batch_id_per_token
                num_real = bid.shape[0] if bid is not None else num_in
                if num_real < num_in:

                    def _clip(t):
                        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.size(0) == num_in:
                            return t[:num_real]
                        return t

                    o = super()._attn_core(_clip(x), _clip(q), _clip(kv_pre), _clip(positions))
                    return F.pad(o, (0, 0, 0, num_in - num_real))
        return super()._attn_core(x, q, kv_pre, positions)


def v4_core_attention(layer, x, q, kv_pre, positions):
    """The splitting op: runs eagerly between the two captured pieces."""
    return layer._attn_core(x, q, kv_pre, positions)


class ModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.attn = DeepseekV4AttentionVllm(device, variant)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.num_computed = {}                   # request -> tokens already in unified_kv
        if graphed:
            self.capture_model()

    def _model(self, n):
        return self.attn.forward(self.attn.emb[self.input_ids[:n]], self.positions[:n])

    def capture_model(self):
        global _forward_context
        for n in sorted(CAPTURE_SIZES, reverse=True):
            _forward_context = ForwardContext(None, is_dummy_run=True, num_tokens=n, num_real=n, cudagraph=True)
            self._model(n)
        _forward_context = None

    def build_metadata(self, batch):
        """``batch``: (request slot, new token ids) per request (prefill chunk or one decode token)."""
        bid, pre_ptr, pre_idx, ext_ptr, ext_idx, rows, pos = [], [0], [], [0], [], [], []
        offset = 0
        for b, (slot, ids) in enumerate(batch):
            start = self.num_computed.get(slot, 0)
            for i in range(len(ids)):
                bid.append(b)
                pos.append(start + i)
                rows.append(slot * MAX_SEQ_LEN + start + i)
                pre_idx += [slot * MAX_SEQ_LEN + p for p in range(start)]
                pre_ptr.append(len(pre_idx))
                ext_idx += list(range(offset, offset + i + 1))
                ext_ptr.append(len(ext_idx))
            offset += len(ids)
            self.num_computed[slot] = start + len(ids)
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        return AttentionMetaData_DSV4("PREFILL", t(bid), t(pre_idx), t(pre_ptr), t(ext_idx), t(ext_ptr),
                                      t(rows)), t(pos)

    def execute_model(self, batch):
        global _forward_context
        ids = [tok for _, toks in batch for tok in toks]
        num_real = len(ids)
        num_input_tokens = (next(s for s in CAPTURE_SIZES if s >= num_real) if self.graphed else num_real)
        attn_md, pos = self.build_metadata(batch)
        self.input_ids[:num_real].copy_(torch.tensor(ids).to(self.device))
        self.positions[:num_real].copy_(pos)
        _forward_context = ForwardContext(attn_md, is_dummy_run=False, num_tokens=num_input_tokens,
                                          num_real=num_real, cudagraph=self.graphed)
        try:
            out = self._model(num_input_tokens)
        finally:
            _forward_context = None
        return out[:num_real].clone()        # logits_indices reference real positions only


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        runner = ModelRunner(device, variant, graphed)
        outs = []
        # A (3 tokens) and B (5 tokens): exactly the 8-token bucket, no padding.
        outs.append(runner.execute_model([(0, [3, 5, 7]), (1, [9, 11, 13, 15, 17])]))
        # mixed: A's next token and C's 2-token prompt -> 3 real tokens padded to the 4-token bucket.
        outs.append(runner.execute_model([(0, [19]), (2, [21, 23])]))
        # B's next token, C's next two: again 3 real tokens in the 4-token bucket.
        outs.append(runner.execute_model([(1, [25]), (2, [27, 29])]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
