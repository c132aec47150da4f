"""imp decode graph: paged-attention launch topology derived on the host from the capture step's context length.

Upstream: https://github.com/kekzl/imp/pull/950 ("fix(graphs): re-derive decode-graph launch topology on context
growth — long prompt after short requests wedged the engine", closes #948). Only the PR description could be
read (the stored snapshot of kekzl/imp predates it); the names below follow it, the code is a model of it.
Symptom: a decode graph captured while serving a short request (ctx ~35: ``num_splits=1``, GQA kernel) was
replayed for the next long-prompt request (ctx ~2400), which hit an illegal memory access at its first decode
step; the engine never recovered (every later request returned 0 tokens, ``/health`` unhealthy).
Mechanism: the per-step decode graph bakes launch topology that ``attention_paged.cu`` derives from
``max_context_len`` on the host while the step is captured: the split-K ``num_splits``, the GQA-vs-split-K kernel
choice and the scratch clamping, i.e. how many KV blocks the recorded kernels visit. Replays repeat those kernels
with the capture-time values. The re-capture trigger meant to catch context growth, the pow2 ``max_blocks``
bucket in ``engine_scheduler.cpp``, never fires: the decode batch pool pads ``max_blocks_per_seq`` to the pool
stride before the comparison ("in practice this comparison never trips"). So a graph captured at a short context
serves a long one with the short context's topology. Here the stale topology visits only the blocks the capture's
context needed: the long request's decode attends to the first few tokens of its prompt (wrong logits rather
than the fault, which upstream came from the same stale topology meeting the clamped scratch).
Doctor: host-work-frozen, at ``paged_attention_decode`` (host topology from ``max_context_len``, computed once at
capture and replayed for every later context length).
Fix (upstream): a pow2-bucketed context high-water mark as an additional ``invalidate_for_update`` trigger,
grow-only (about log2(max ctx) re-captures per process); the re-capture derives the topology for the bucket, and
shorter contexts replayed by a larger-context capture are correct (surplus split-K splits write empty-split
sentinels that the reduce merges).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kekzl/imp/pull/950"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "paged_attention_decode"
SYMPTOM = "a decode graph captured at a short context replays its launch topology for a long-prompt request"

VOCAB, DIM, BLOCK, NUM_BLOCKS, MAX_BLOCKS_PER_SEQ = 16, 4, 4, 16, 8
SPLIT_K_MIN_CTX = 8                  # at or below: the GQA (single pass) kernel
BLOCKS_PER_SPLIT = 2                 # split-K: about this many KV blocks per split
MAX_SPLITS = 4                       # split-K scratch capacity (num_splits is clamped to it)


def cdiv(a, b):
    return (a + b - 1) // b


def next_pow2(x):
    return 1 << max(0, int(x) - 1).bit_length()


class Model:
    def __init__(self, device):
        gen = generator(950)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(MAX_BLOCKS_PER_SEQ * BLOCK, DIM, gen=gen, device=device, scale=0.3)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wv = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.8)


def _gather_kv(k_cache, v_cache, block_tables, first_block, num_blocks):
    pos = torch.arange(first_block * BLOCK, (first_block + num_blocks) * BLOCK, device=k_cache.device)
    slots = block_tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
    return pos, k_cache[slots], v_cache[slots]


def _partial(q, k, v, pos, context_lens):
    """One pass of online softmax over a run of positions: (max, sum of exps, weighted values)."""
    scores = (k @ q[:, :, None]).squeeze(-1)
    valid = pos[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid, float("-inf"))
    m = scores.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m_safe[:, None]) * valid
    return m, e.sum(-1), (e[:, :, None] * v).sum(1)


def gqa_decode_kernel(q, k_cache, v_cache, block_tables, context_lens, max_blocks):
    pos, k, v = _gather_kv(k_cache, v_cache, block_tables, 0, max_blocks)
    _, s, acc = _partial(q, k, v, pos, context_lens)
    return acc / s[:, None]


def split_k_decode_kernel(q, k_cache, v_cache, block_tables, context_lens, max_blocks, num_splits, scratch):
    """Split ``s`` covers blocks ``[s * per, (s + 1) * per)``; a split past a sequence's end writes the
    empty-split sentinel (max -inf, sum 0)."""
    m_buf, s_buf, acc_buf = scratch
    per = cdiv(max_blocks, num_splits)
    for split in range(num_splits):
        first = split * per
        n = max(0, min(per, max_blocks - first))
        if n == 0:
            m_buf[:, split].fill_(float("-inf"))
            s_buf[:, split].zero_()
            acc_buf[:, split].zero_()
            continue
        pos, k, v = _gather_kv(k_cache, v_cache, block_tables, first, n)
        m, s, acc = _partial(q, k, v, pos, context_lens)
        m_buf[:, split], s_buf[:, split], acc_buf[:, split] = m, s, acc
    return split_k_reduce(scratch, num_splits)


def split_k_reduce(scratch, num_splits):
    m_buf, s_buf, acc_buf = (t[:, :num_splits] for t in scratch)
    m = m_buf.amax(-1, keepdim=True)
    w = torch.exp(m_buf - m).nan_to_num(0.0)
    return (w[..., None] * acc_buf).sum(1) / (w * s_buf).sum(1)[:, None]


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scratch):
    """``attention_paged.cu``: the launch topology comes from the host's ``max_context_len``."""
    max_blocks = cdiv(max_context_len, BLOCK)
    if max_context_len <= SPLIT_K_MIN_CTX:
        return gqa_decode_kernel(q, k_cache, v_cache, block_tables, context_lens, max_blocks)
    num_splits = min(cdiv(max_blocks, BLOCKS_PER_SPLIT), MAX_SPLITS)       # scratch clamping
    return split_k_decode_kernel(q, k_cache, v_cache, block_tables, context_lens, max_blocks, num_splits, scratch)


def decode_step(model, token_ids, positions, slot_mapping, block_tables, context_lens, max_context_len,
                k_cache, v_cache, scratch):
    h = model.emb[token_ids] + model.pos_emb[positions]
    k_cache[slot_mapping] = h @ model.wk
    v_cache[slot_mapping] = h @ model.wv
    attn = paged_attention_decode(h @ model.wq, k_cache, v_cache, block_tables, context_lens, max_context_len,
                                  scratch)
    return attn @ model.wo


class DecodeBatchPool:
    """Persistent decode inputs; block-table rows are laid out at the pool stride."""

    def __init__(self, device, batch=1):
        i64 = dict(dtype=torch.long, device=device)
        self.stride_blocks = MAX_BLOCKS_PER_SEQ
        self.token_ids = torch.zeros(batch, **i64)
        self.positions = torch.zeros(batch, **i64)
        self.slot_mapping = torch.zeros(batch, **i64)
        self.block_tables = torch.zeros(batch, self.stride_blocks, **i64)
        self.context_lens = torch.zeros(batch, **i64)

    def max_blocks_per_seq(self, blocks_needed):
        return max(blocks_needed, self.stride_blocks)        # padded up to the pool stride


class Engine:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.k_cache = torch.zeros(NUM_BLOCKS * BLOCK, DIM, device=device)
        self.v_cache = torch.zeros(NUM_BLOCKS * BLOCK, DIM, device=device)
        self.scratch = (torch.zeros(1, MAX_SPLITS, device=device), torch.zeros(1, MAX_SPLITS, device=device),
                        torch.zeros(1, MAX_SPLITS, DIM, device=device))
        self.pool = DecodeBatchPool(device)
        self.graph = None
        self.max_blocks_bucket = None
        self.ctx_hwm = 0

    def invalidate_for_update(self, max_context_len):
        """``engine_scheduler.cpp``: re-capture when the pow2 ``max_blocks`` bucket changes (and, with the
        fix, when the context outgrows the pow2 high-water mark the graph was captured for)."""
        bucket = next_pow2(self.pool.max_blocks_per_seq(cdiv(max_context_len, BLOCK)))
        stale = self.graph is None or bucket != self.max_blocks_bucket
        self.max_blocks_bucket = bucket
        if self.variant == "fix" and next_pow2(max_context_len) > self.ctx_hwm:
            self.ctx_hwm = next_pow2(max_context_len)            # grow-only
            stale = True
        return stale

    def prefill(self, tokens, blocks):
        """Eager: write the prompt's K/V (one layer: K/V depend on the token and position only)."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        pos = list(range(len(tokens)))
        h = self.model.emb[t(tokens)] + self.model.pos_emb[t(pos)]
        slots = t([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in pos])
        self.k_cache[slots] = h @ self.model.wk
        self.v_cache[slots] = h @ self.model.wv

    def decode(self, token, pos, blocks):
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        ctx = pos + 1
        slot = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
        table = t([blocks + [0] * (MAX_BLOCKS_PER_SEQ - len(blocks))])
        if not self.graphed:
            return decode_step(self.model, t([token]), t([pos]), t([slot]), table, t([ctx]), ctx,
                               self.k_cache, self.v_cache, self.scratch).clone()
        p = self.pool
        p.token_ids.copy_(t([token]))
        p.positions.copy_(t([pos]))
        p.slot_mapping.copy_(t([slot]))
        p.block_tables.copy_(table)
        p.context_lens.copy_(t([ctx]))
        if self.invalidate_for_update(ctx):
            captured_ctx = self.ctx_hwm if self.variant == "fix" else ctx
            self.graph = capture(
                lambda: decode_step(self.model, p.token_ids, p.positions, p.slot_mapping, p.block_tables,
                                    p.context_lens, captured_ctx, self.k_cache, self.v_cache, self.scratch),
                device=self.device, warmups=0, owner="imp decode graph",
                static={"token_ids": p.token_ids, "positions": p.positions, "slot_mapping": p.slot_mapping,
                        "block_tables": p.block_tables, "context_lens": p.context_lens},
                state={"k_cache": self.k_cache, "v_cache": self.v_cache})
        g, out = self.graph
        return replay(g, out).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        engine = Engine(model, device, variant, graphed)
        outs = []

        def request(prompt, blocks, steps):
            engine.prefill(prompt, blocks)
            tok = prompt[-1]
            for i in range(steps):
                out = engine.decode((tok * 7 + 3) % VOCAB, len(prompt) + i, blocks)
                outs.append(out)
                tok = int(out.argmax(-1)[0])

        request([3], [1], steps=3)                                           # short: ctx 2..4, one block
        long_prompt = [(i * 5 + 1) % VOCAB for i in range(22)]
        request(long_prompt, [3, 4, 5, 6, 7, 8, 9], steps=3)                 # long: ctx 23..25
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
