"""torchtitan's varlen vLLM attention claims FULL-graph support: mixed batches replay a frozen ``max_query_len``.

Upstream: https://github.com/pytorch/torchtitan/pull/3776 ("[rl] annotate varlen Attention with correct
cudagraph capability", fixes issue #3709; the default was first moved to FULL_DECODE_ONLY in #3685).
Symptom: the RL / Search-R1 vLLM generator with ``cudagraph_mode=FULL`` produced NaN logprobs and random,
degenerate tokens at large batch; eager and FULL_DECODE_ONLY were clean (torchtitan main, June 2026).
Mechanism: ``PyTorchVarlenAttentionBackend`` subclasses vLLM's ``FlashAttentionBackend`` and so inherited
the FA3 builder's ``AttentionCGSupport.ALWAYS``: vLLM kept FULL graphs for *mixed* prefill/decode batches,
captured from dummy batches. ``PyTorchVarlenAttentionImpl.forward`` hands the varlen kernel
``max_seqlen_q = attn_metadata.max_query_len``, a Python int that becomes a launch argument: the grid covers
``max_seqlen_q`` query rows per sequence. The capture bakes in the dummy batch's value (2 tokens per request
here); a replay for a real mixed batch whose prefill chunk is longer never computes the later query rows of
that sequence, which keep what the attention output buffer held (NaN poison here, stale rows on a GPU), and
the last prompt token's logits are read from such a row.
Doctor: host-work-frozen, at ``forward`` (the host ``max_query_len`` passed to the captured varlen kernel).
Fix (upstream): the backend's builder reports ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``; vLLM then
downgrades FULL to FULL_DECODE_ONLY: only uniform one-token decode batches (``max_query_len == 1`` always)
replay FULL graphs, and prefill / mixed batches run attention eagerly.
"""
from __future__ import annotations

import enum
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchtitan/pull/3776"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = "FULL cudagraph over mixed prefill/decode batches: NaN logprobs and degenerate tokens"
VOCAB, DIM, MAX_REQS, MAX_LEN = 11, 4, 4, 8
CAPTURE_SIZES = [4, 8]
NUM_SLOTS = MAX_REQS * MAX_LEN
PAD_SLOT = NUM_SLOTS                         # the cache's extra row: padded tokens write there


class AttentionCGSupport(enum.Enum):
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    ALWAYS = 3


class FlashAttentionMetadataBuilder:
    _cudagraph_support = AttentionCGSupport.ALWAYS        # FA3


class FlashAttentionMetadata:
    def __init__(self, query_start_loc, seq_lens, block_table, slot_mapping, max_query_len, num_actual_tokens):
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.block_table = block_table
        self.slot_mapping = slot_mapping
        self.max_query_len = max_query_len
        self.num_actual_tokens = num_actual_tokens


def varlen_attn_out(out, q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q: int, seqused_k, block_table, scale):
    """Paged varlen attention (one block of ``MAX_LEN`` slots per request). The grid covers ``max_seqlen_q``
    query rows per sequence: rows past it are never written and keep what ``out`` held."""
    num_tokens = q.shape[0]
    t = torch.arange(num_tokens, device=q.device)
    seq = (torch.searchsorted(cu_seqlens_q, t, right=True) - 1).clamp(0, seqused_k.shape[0] - 1)
    q_len = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]
    i = t - cu_seqlens_q[seq]                             # row within its sequence
    pos = seqused_k[seq] - q_len + i                      # absolute (causal) position of the query
    j = torch.arange(MAX_LEN, device=q.device)
    slots = block_table[seq][:, None] * MAX_LEN + j[None, :]
    keys, values = k_cache[slots], v_cache[slots]
    scores = (q[:, None, :] * keys).sum(-1) * scale
    scores = scores.masked_fill(j[None, :] > pos[:, None], float("-inf"))
    computed = (torch.softmax(scores, -1)[..., None] * values).sum(1)
    valid = (t < cu_seqlens_q[-1]) & (i < max_seqlen_q)
    out.copy_(torch.where(valid[:, None], computed, out))
    return out


class PyTorchVarlenAttentionImpl:
    def __init__(self, k_cache, v_cache):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.scale = 1.0 / math.sqrt(DIM)

    def forward(self, query, key, value, attn_metadata, output):
        num_actual_tokens = attn_metadata.num_actual_tokens
        # reshape_and_cache: padded tokens carry PAD_SLOT
        self.k_cache.index_copy_(0, attn_metadata.slot_mapping[:num_actual_tokens], key[:num_actual_tokens])
        self.v_cache.index_copy_(0, attn_metadata.slot_mapping[:num_actual_tokens], value[:num_actual_tokens])
        cu_seqlens_q = attn_metadata.query_start_loc
        seqused_k = attn_metadata.seq_lens
        max_seqlen_q = attn_metadata.max_query_len          # a Python int: a launch argument of the kernel
        block_table = attn_metadata.block_table
        return varlen_attn_out(output[:num_actual_tokens], query[:num_actual_tokens], self.k_cache, self.v_cache,
                               cu_seqlens_q, max_seqlen_q, seqused_k, block_table, self.scale)


class Model:
    def __init__(self, device):
        gen = generator(3776)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.k_cache = torch.zeros(NUM_SLOTS + 1, DIM, device=device)
        self.v_cache = torch.zeros(NUM_SLOTS + 1, DIM, device=device)
        self.attn = PyTorchVarlenAttentionImpl(self.k_cache, self.v_cache)

    def forward(self, input_ids, positions, attn_metadata):
        h = self.emb[input_ids] + self.pos[positions]
        output = torch.empty_like(h)                        # the attention output buffer
        attn = self.attn.forward(h @ self.wq, h @ self.wk, h @ self.wv, attn_metadata, output)
        return h + attn


def get_builder_cls(variant):
    if variant == "bug":
        return FlashAttentionMetadataBuilder
    # Report UNIFORM_SINGLE_TOKEN_DECODE cudagraph support instead of the FA3 builder's ALWAYS.

    class PyTorchVarlenAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
        _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    return PyTorchVarlenAttentionMetadataBuilder


class GPUModelRunner:
    """Persistent input buffers, metadata for a (padded) batch, and the FULL graphs keyed by size."""

    def __init__(self, model, device, variant, graphed):
        self.model, self.device = model, device
        self.input_ids = torch.zeros(max(CAPTURE_SIZES), dtype=torch.long, device=device)
        self.positions = torch.zeros(max(CAPTURE_SIZES), dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max(CAPTURE_SIZES),), PAD_SLOT, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_REQS + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_REQS, dtype=torch.long, device=device)
        self.block_table = torch.arange(MAX_REQS, device=device)   # request row r owns block r
        support = get_builder_cls(variant)._cudagraph_support
        # FULL -> FULL_DECODE_ONLY when the backend only supports uniform one-token decode
        self.full_decode_only = support != AttentionCGSupport.ALWAYS
        self.graphed = graphed
        self.graphs = {}

    def _prepare(self, tokens, positions, slots, q_lens, seq_lens, size):
        n, num_reqs = len(tokens), len(q_lens)
        self.input_ids[:n].copy_(torch.tensor(tokens, device=self.device))
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(torch.tensor(positions, device=self.device))
        self.positions[n:].zero_()
        self.slot_mapping[:n].copy_(torch.tensor(slots, device=self.device))
        self.slot_mapping[n:].fill_(PAD_SLOT)
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        qsl += [qsl[-1]] * (MAX_REQS - num_reqs)             # padded requests: empty
        self.query_start_loc.copy_(torch.tensor(qsl, device=self.device))
        self.seq_lens.copy_(torch.tensor(list(seq_lens) + [0] * (MAX_REQS - num_reqs), device=self.device))
        return FlashAttentionMetadata(self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping,
                                      max_query_len=max(q_lens), num_actual_tokens=size)

    def capture_model(self):
        for size in CAPTURE_SIZES:
            if self.full_decode_only:
                if size > MAX_REQS:
                    continue
                q_lens = [1] * size                           # uniform decode dummy batch
            else:
                num_reqs = min(size, MAX_REQS)                # mixed dummy batch: tokens spread over requests
                q_lens = [size // num_reqs] * num_reqs
                q_lens[-1] += size - sum(q_lens)
            meta = self._prepare([0] * size, [0] * size, [PAD_SLOT] * size, q_lens, q_lens, size)
            fn = lambda meta=meta, size=size: self.model.forward(self.input_ids[:size], self.positions[:size], meta)  # noqa: E731
            self.graphs[size] = capture(fn, device=self.device, name=f"FULL size {size}",
                                        static={"input_ids": self.input_ids, "positions": self.positions,
                                                "slot_mapping": self.slot_mapping,
                                                "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens},
                                        state={"k_cache": self.model.k_cache, "v_cache": self.model.v_cache},
                                        owner="GPUModelRunner (FULL cudagraphs)")

    def execute_model(self, tokens, positions, slots, q_lens, seq_lens):
        n = len(tokens)
        uniform_decode = all(q == 1 for q in q_lens)
        size = next((s for s in CAPTURE_SIZES if s >= n), None)
        use_graph = (self.graphed and size in self.graphs and (uniform_decode or not self.full_decode_only))
        if use_graph:
            self._prepare(tokens, positions, slots, q_lens, seq_lens, size)
            g, out = self.graphs[size]
            hidden = replay(g, out, real=n, size=size, padded={})
        else:
            meta = self._prepare(tokens, positions, slots, q_lens, seq_lens, n)
            hidden = self.model.forward(self.input_ids[:n], self.positions[:n], meta)
        logits_indices = torch.tensor([sum(q_lens[:i + 1]) - 1 for i in range(len(q_lens))], device=self.device)
        return (hidden[logits_indices] @ self.model.lm_head).clone()


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        runner = GPUModelRunner(Model(device), device, variant, graphed)
        if graphed:
            runner.capture_model()
        outs = []

        def step(reqs):
            """``reqs``: (row, new tokens, tokens already cached)."""
            tokens, positions, slots, q_lens, seq_lens = [], [], [], [], []
            for row, new, cached in reqs:
                tokens += new
                positions += list(range(cached, cached + len(new)))
                slots += [row * MAX_LEN + p for p in range(cached, cached + len(new))]
                q_lens.append(len(new))
                seq_lens.append(cached + len(new))
            outs.append(runner.execute_model(tokens, positions, slots, q_lens, seq_lens))

        step([(0, [3, 7, 1], 0), (1, [2, 5], 0)])             # two prompts: a prefill batch of 5 tokens
        step([(0, [4], 3), (1, [9], 2)])                      # uniform decode
        step([(0, [6], 4), (1, [8], 3), (2, [1, 2, 3, 4], 0)])  # mixed: two decodes and a 4-token prompt
        step([(0, [5], 5), (1, [2], 4), (2, [7], 4)])         # uniform decode
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
