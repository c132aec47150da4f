"""pegainfer's Qwen3 decode runs from ``BatchDecodeBuffers``, fixed-address device buffers that the per-bucket decode
CUDA graphs read; each step ``sync_paged_meta`` copies the step's paged-attention metadata into them, among it the
concatenated page list of every decode row (CSR, one row per request plus the bucket's padding rows).
``page_indices_d`` was sized for the pool's physical blocks plus one padding page per row. But the list is counted
by reference: with prefix caching on, N requests holding the same sealed prefix each list its pages again, so
concurrent decodes over a shared prompt list more pages than the pool has, and the copy into the graph's buffer trips
cudarc's ``dst.len() >= src.len()`` assertion (the worker thread panics, the engine wedges). The fix sizes the buffer
for every row presenting a full-context view (``max_batch * ceil(max_context / page_size)``) and makes
``sync_paged_meta`` fail loud if a view ever exceeds it.

Upstream: https://github.com/pegainfer-project/pegainfer/pull/482 ("fix(qwen3): size decode page indices for
prefix-shared views", pegainfer-project/pegainfer (Rust, cudarc), by Zoee (n-WN), co-author "fox"; squash-merged
2026-07-02 as commit 0ad4c011698e269dbf2c3ac6cdb81d7f0ba387b3; fixes fault 1 of issue #403). Read, in a mirror of the
repository with ``git show``: the whole diff of 0ad4c011 (``openinfer-qwen3-4b/src/batch_decode_buffers.rs``:
``BatchDecodeBuffers::new`` takes ``page_size`` instead of ``max_total_pages`` and allocates ``page_indices_d`` with
``bs * max_view_pages`` instead of ``max_total_pages + bs``; ``sync_paged_meta`` gains the ``anyhow::ensure!`` "decode
page-index overflow"; the new test ``shared_prefix_views_are_counted_by_reference``; the three callers in
``executor.rs`` (``LocalQwen3Lane::new``), ``weights.rs`` and ``batch_decode_trace.rs`` pass ``page_size`` instead of
``total_blocks``; ``docs/models/qwen3/prefix-cache.md``). At the parent 0ad4c011^: ``batch_decode_buffers.rs`` whole
(``BATCH_BUCKETS``, ``bucket_for``, ``BatchDecodeBuffers`` fields and ``new``, ``set_batch_size``,
``sync_paged_meta``, the split-KV CSR), ``batch_decode.rs`` (``Qwen3Model::batch_decode``: bucket padding when
``enable_cuda_graph`` and no LoRA, ``memcpy_htod`` of the padded token ids and positions, ``sync_paged_meta``,
``graphs[graph_idx].run_or_capture``; the head of ``batch_decode_kernels``), ``openinfer-core/src/cuda_graph.rs``
(``CudaGraphState::run_or_capture``: no warm-up, thread-local capture, one launch after instantiation),
``openinfer-kv-cache/src/view.rs`` (``KvView``), ``openinfer-kv-cache/src/pool.rs`` (``BlockPool`` with block 0
reserved "as CUDA Graph padding slot", ``total_blocks``, ``padding_block_id``; ``RequestKv``:
``match_and_add_prefix``, ``schedule_prefill``/``schedule_decode``, ``prefill_view``/``decode_view``,
``apply_prefill``/``apply_decode``) and, in ``executor.rs``, ``LocalQwen3Lane::new`` and the head of
``execute_step_on_lane``. Issue #403 in the search index: its description and the root-cause comment by n-WN.
Not read: the kvbm block manager (``SchedulableSequence``, ``match_blocks``, when a decode-completed block is
registered), FlashInfer's decode kernels, the split-KV and LoRA paths, ``prefill.rs``, the scheduler; the rest of
issue #403 (its fault 2, the blast radius, is another fix).
Symptom: issue #403: "thread 'qwen3-tp-rank-0' panicked at cudarc-0.19.7/src/driver/safe/core.rs:1607:9: assertion
failed: dst.len() >= src.len()", backtrace ``CudaStream::memcpy_htod`` <- ``BatchDecodeBuffers::sync_paged_meta``
<- ``Qwen3Model::batch_decode`` <- ``execute_step_on_lane``; then every request fails with "tensor-parallel worker
step channel closed" while /health stays 200. The root-cause comment: "deterministic with N concurrent same-prompt
requests once the prefix is sealed".
Mechanism: the pre-allocated decode buffers exist so that the bucket graphs replay over the same addresses; their
sizes are fixed at construction. The page list a step copies in grows with the rows' views counted by reference,
while the buffer was sized by the pool's physical blocks (+ one padding page per bucket row). Prefix sharing lets
the by-reference count exceed the physical one; admission charges physical blocks and cannot see it. A run without
the pre-sized buffers builds its page list at the step's size and has no such limit.
Doctor: undersized-buffer, at new: ``BatchDecodeBuffers::new`` sizes the graph's static ``page_indices_d`` by
``max_total_pages + bs`` (the pool's physical block count), the bound the fix replaces; the step's data (17 listed
pages over 8 physical blocks in use here) do not fit it, which surfaces one call later in ``sync_paged_meta``'s copy.
Fix (upstream): ``page_indices_d = alloc_zeros(bs * max_view_pages)`` with ``max_view_pages =
ceil(max_context_tokens / page_size).max(1)`` (padding rows list one page each and are covered), and
``sync_paged_meta`` checks ``all_page_indices.len() <= page_indices_d.len()`` before copying ("decode page-index
overflow: ..."), so a future sizing bug is a step error instead of a panic.
Modelled: ``BATCH_BUCKETS`` (reduced to 1, 2, 4), ``bucket_for``, ``BatchDecodeBuffers`` (``new`` with both
sizings, ``sync_paged_meta`` with the padding rows on the padding page and the fix's check), ``CudaStream.memcpy_htod``
(cudarc's assertion), ``CudaGraphState.run_or_capture`` (capture without a warm-up run, then the first launch;
later calls launch), ``Qwen3Model.batch_decode`` / ``batch_decode_kernels``, ``KvView`` (``page_indices``,
``seq_len``, ``last_page_len``, the exact-cover check), ``BlockPool`` (block 0 the padding block, ``total_blocks``,
prefix matching of sealed full blocks by token hash), ``RequestKv`` (``match_and_add_prefix`` leaving one prompt
token uncached, ``schedule_prefill``/``schedule_decode`` allocating pages, ``prefill_view``/``decode_view`` with
``seq_len = kv_position + n``, ``apply_prefill``/``apply_decode``), ``LocalQwen3Lane.new`` (builds the buffers with
``total_blocks`` or ``page_size``).
Stand-ins: a 2-layer decoder (width 16, 2 heads of 8, learned positions instead of RoPE, RMSNorm, gated MLP, no
QK-norm, no GQA) in float64 with random weights; linear layers are broadcast multiply-sums (a row's result does not
depend on the step's row count, so the padded bucket and the unpadded eager step agree exactly); FlashInfer's
paged decode kernel is a masked attention that reads each row's pages through ``page_indptr_d`` /
``page_indices_d`` / ``last_page_len_d`` over a fixed window of ``ceil(max_context / page_size)`` pages (indices
clamped into the buffer, masked past the row's length); the new token's K/V is written into the paged cache inside
the graph at its page; the split-KV metadata and workspace, ``kv_chunk_size_d``, ``request_indices_d``,
``set_batch_size``, LoRA and the Green Context split graphs are left out; prefill is one eager call per request
through the same layers (upstream: ``prefill.rs``, not read); a request's blocks are registered (sealed, matchable)
when they fill, a guess at kvbm's timing; greedy argmax on the host for the sampler; no request finishes. The run
without graphs (the reference) pads nothing and builds its metadata as fresh tensors of the step's size: upstream's
own eager escape hatch (LoRA batches, ``enable_cuda_graph = false``) still goes through the same pre-allocated
``BatchDecodeBuffers`` and would have overflowed as well; the buffers' fixed sizes are the graph design's, which is
why this is counted a CUDA-graph bug. Sizes: page size 4, a pool of 12 blocks (11 usable), max context 32 tokens
(8 pages a view), the largest bucket 4: the bug's ``page_indices_d`` holds 12 + 4 = 16 pages, the fix's 4 * 8 = 32.
Workload: four requests with the same 12-token system prompt (3 full pages) and 2 tokens of their own. Prefill A;
decode [A] (bucket 1 captured); prefill B and C (their 3 prefix pages matched from A's sealed blocks); decode
[A, B, C] (13 listed pages with the padding row: bucket 4 captured); prefill D; three decode steps of [A, B, C, D]
(bucket 4 replayed): A crosses into its fifth page on the first, so 5 + 4 + 4 + 4 = 17 pages are listed over 8
physical blocks in use (20 over 11 on the last step). Outputs: the logits of every prefill's last token and of every
decode step's real rows, and the generated tokens.
Measured: bug: misbehaves (raised AssertionError: assertion failed: dst.len() >= src.len()), in ``sync_paged_meta``
on the first four-request decode step (before the bucket-4 graph's launch). Fix: equals eager (max |graph - eager| =
0): bucket 1 captured once, bucket 4 captured once and replayed three times. About 1.5 s for both variants on the
CPU.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pegainfer-project/pegainfer/pull/482"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "new"
SYMPTOM = ("with prefix caching, concurrent decodes of same-prompt requests list the shared prefix pages once per "
           "request; the decode graph's page_indices_d, sized by the pool's physical blocks, is too small and the "
           "copy panics (cudarc 'assertion failed: dst.len() >= src.len()'), wedging the engine")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, INTER, NUM_LAYERS = 32, 16, 2, 8, 24, 2
PAGE_SIZE, NUM_BLOCKS, MAX_POSITION_EMBEDDINGS = 4, 12, 32
MAX_VIEW_PAGES = -(-MAX_POSITION_EMBEDDINGS // PAGE_SIZE)
BATCH_BUCKETS = (1, 2, 4)
DTYPE = torch.float64

_variant = "bug"


# --- cudarc / openinfer-core stand-ins --------------------------------------------------------------------------------

class CudaStream:
    def __init__(self, device):
        self.device = device

    def memcpy_htod(self, src, dst: torch.Tensor) -> None:
        """cudarc ``CudaStream::memcpy_htod``: ``assert!(dst.len() >= src.len())``, then copy into the head of dst."""
        if not dst.numel() >= len(src):
            raise AssertionError("assertion failed: dst.len() >= src.len()")
        dst[:len(src)].copy_(torch.tensor(src, dtype=dst.dtype).to(self.device))

    def alloc_zeros(self, n: int, dtype=torch.int32) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)


class DeviceContext:
    def __init__(self, device):
        self.device = device
        self.stream = CudaStream(device)


class CudaGraphState:
    """First call captures (no warm-up run, thread-local capture mode) and launches; later calls launch."""

    def __init__(self):
        self.exec = None
        self.outputs = None

    def run_or_capture(self, ctx: DeviceContext, kernels, *, name, static, state, real, size):
        if self.exec is None:
            self.exec, self.outputs = capture(kernels, device=ctx.device, warmups=0, name=name, static=static,
                                              state=state, owner="BatchDecodeBuffers",
                                              capture_error_mode="thread_local")
        return replay(self.exec, self.outputs, real=real, size=size)          # cuGraphLaunch


# --- openinfer-kv-cache: pool, request KV, views ----------------------------------------------------------------------

class KvView:
    def __init__(self, page_indices, seq_len, page_size):
        assert len(page_indices) == -(-seq_len // page_size), \
            f"KvView pages must exactly cover seq_len={seq_len} (page_size={page_size})"
        self._page_indices, self._seq_len, self.page_size = list(page_indices), seq_len, page_size

    def seq_len(self):
        return self._seq_len

    def page_indices(self):
        return self._page_indices

    def last_page_len(self):
        rem = self._seq_len % self.page_size
        return 0 if self._seq_len == 0 else (rem if rem else self.page_size)


class BlockPool:
    """A free list and the registry of sealed blocks by the hash of the tokens up to their end."""

    def __init__(self, block_size, num_blocks):
        assert num_blocks >= 2, "need at least 2 blocks (1 for padding)"
        self.block_size, self._num_blocks = block_size, num_blocks
        self._free = list(range(num_blocks))
        self._registered: dict[tuple, int] = {}
        self._padding_block_id = self.allocate_blocks(1)[0]      # reserve block 0 as CUDA Graph padding slot

    def total_blocks(self):
        return self._num_blocks

    def padding_block_id(self):
        return self._padding_block_id

    def allocate_blocks(self, n):
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def match_blocks(self, seq_hashes):
        matched = []
        for h in seq_hashes:
            if h not in self._registered:
                break
            matched.append(self._registered[h])
        return matched

    def register_block(self, seq_hash, block_id):
        self._registered.setdefault(seq_hash, block_id)


class RequestKv:
    def __init__(self, prompt_tokens, block_size):
        self.tokens = list(prompt_tokens)
        self.num_input_tokens = len(prompt_tokens)
        self.block_size = block_size
        self.blocks: list[int] = []
        self._kv_position = 0
        self._sealed = 0

    def kv_position(self):
        return self._kv_position

    def match_and_add_prefix(self, pool: BlockPool):
        cacheable = (self.num_input_tokens - 1) // self.block_size      # leaves >= 1 prompt token uncached
        hashes = [tuple(self.tokens[:(i + 1) * self.block_size]) for i in range(cacheable)]
        self.blocks = pool.match_blocks(hashes)
        self._kv_position = self._sealed = len(self.blocks)
        self._kv_position *= self.block_size
        return self._kv_position

    def _reserve(self, num_tokens, pool):
        need = -(-(self._kv_position + num_tokens) // self.block_size) - len(self.blocks)
        if need > 0:
            self.blocks += pool.allocate_blocks(need)

    def schedule_prefill(self, num_tokens, pool):
        self._reserve(num_tokens, pool)

    def schedule_decode(self, pool):
        self._reserve(1, pool)

    def step_page_indices(self, n):
        return self.blocks[:-(-(self._kv_position + n) // self.block_size)]

    def prefill_view(self, prompt_len):
        return KvView(self.step_page_indices(prompt_len), self._kv_position + prompt_len, self.block_size)

    def decode_view(self):
        return KvView(self.step_page_indices(1), self._kv_position + 1, self.block_size)

    def _seal_full_blocks(self, pool):
        while (self._sealed + 1) * self.block_size <= self._kv_position:
            pool.register_block(tuple(self.tokens[:(self._sealed + 1) * self.block_size]), self.blocks[self._sealed])
            self._sealed += 1

    def apply_prefill(self, token, pool):
        self._kv_position = self.num_input_tokens
        self._seal_full_blocks(pool)
        self.tokens.append(token)                                    # the dangling token: decoded next step

    def apply_decode(self, token, pool):
        self._kv_position += 1
        self._seal_full_blocks(pool)
        self.tokens.append(token)


# --- openinfer-qwen3-4b/src/batch_decode_buffers.rs -------------------------------------------------------------------

def bucket_for(bs):
    for b in BATCH_BUCKETS:
        if b >= bs:
            return b
    raise RuntimeError(f"batch size {bs} exceeds largest bucket {BATCH_BUCKETS[-1]}")


@dataclasses.dataclass
class DecodeMeta:
    token_ids: torch.Tensor
    positions: torch.Tensor
    page_indices: torch.Tensor
    page_indptr: torch.Tensor
    last_page_len: torch.Tensor


class BatchDecodeBuffers:
    """Pre-allocated buffers for batch decode, sized for ``max_batch_size``; the bucket graphs read them."""

    @classmethod
    def new(cls, ctx: DeviceContext, max_batch_size, max_total_pages, page_size, padding_page_id, max_context_tokens):
        self = cls()
        bs = max_batch_size
        self.max_batch_size = bs
        self.token_ids_d = ctx.stream.alloc_zeros(bs)
        self.positions_d = ctx.stream.alloc_zeros(bs)
        if _variant == "bug":
            # Paged attention: worst case all requests use max_total_pages + padding slots
            self.page_indices_d = ctx.stream.alloc_zeros(max_total_pages + bs)
        else:
            # Counted by reference: every row presenting a full-context view (padding rows list 1 page each).
            if not page_size > 0:
                raise RuntimeError("page_size must be > 0")
            max_view_pages = max(-(-max_context_tokens // page_size), 1)
            self.page_indices_d = ctx.stream.alloc_zeros(bs * max_view_pages)
        self.page_indptr_d = ctx.stream.alloc_zeros(bs + 1)
        self.last_page_len_d = ctx.stream.alloc_zeros(bs)
        self.padding_page_id = padding_page_id
        self.graphs = [CudaGraphState() for _ in BATCH_BUCKETS]
        return self

    def static_buffers(self):
        return {"token_ids_d": self.token_ids_d, "positions_d": self.positions_d,
                "page_indices_d": self.page_indices_d, "page_indptr_d": self.page_indptr_d,
                "last_page_len_d": self.last_page_len_d}

    def meta(self, padded_bs) -> DecodeMeta:
        return DecodeMeta(self.token_ids_d[:padded_bs], self.positions_d[:padded_bs], self.page_indices_d,
                          self.page_indptr_d[:padded_bs + 1], self.last_page_len_d[:padded_bs])

    def sync_paged_meta(self, ctx: DeviceContext, kv_views, padded_bs):
        real_bs = len(kv_views)
        all_page_indices, indptr, last_page_lens = [], [0], []
        for kv in kv_views:
            all_page_indices.extend(kv.page_indices())
            indptr.append(len(all_page_indices))
            last_page_lens.append(kv.last_page_len())
        for _ in range(real_bs, padded_bs):                          # padding slots: the padding page, seq_len 1
            all_page_indices.append(self.padding_page_id)
            indptr.append(len(all_page_indices))
            last_page_lens.append(1)
        if _variant == "fix" and not len(all_page_indices) <= self.page_indices_d.numel():
            raise RuntimeError(
                f"decode page-index overflow: {len(all_page_indices)} view pages (bs={real_bs}, padded={padded_bs}) "
                f"exceed buffer capacity {self.page_indices_d.numel()}; a view is larger than the context limit the "
                "buffers were sized for")
        ctx.stream.memcpy_htod(all_page_indices, self.page_indices_d)
        ctx.stream.memcpy_htod(indptr, self.page_indptr_d)
        ctx.stream.memcpy_htod(last_page_lens, self.last_page_len_d)


# --- the model (stand-in for Qwen3-4B) --------------------------------------------------------------------------------

def linear(x, w):
    """``x @ w.T`` as a broadcast multiply-sum: a row's result does not depend on how many rows the step has."""
    return (x[:, None, :] * w[None, :, :]).sum(-1)


def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def paged_decode_attention(q, k_cache, v_cache, meta: DecodeMeta):
    """FlashInfer batch decode stand-in: each row attends to its pages (CSR) up to its length."""
    rows, device = q.shape[0], q.device
    start = meta.page_indptr[:rows].long()
    num_pages = meta.page_indptr[1:rows + 1].long() - start
    j = torch.arange(MAX_VIEW_PAGES, device=device)
    idx = (start[:, None] + j[None, :]).clamp(max=meta.page_indices.numel() - 1)
    pages = meta.page_indices[idx].long()                                            # [rows, pages]
    slots = (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=device)).reshape(rows, -1)
    kv_len = (num_pages - 1) * PAGE_SIZE + meta.last_page_len.long()
    masked = torch.arange(slots.shape[1], device=device)[None, :] >= kv_len[:, None]
    k, v = k_cache[slots], v_cache[slots]                                            # [rows, ctx, heads, dim]
    scores = (q[:, None, :, :] * k).sum(-1).transpose(1, 2) * HEAD_DIM ** -0.5      # [rows, heads, ctx]
    probs = scores.masked_fill(masked[:, None, :], float("-inf")).softmax(-1)
    return (probs.transpose(1, 2)[..., None] * v).sum(1)                             # [rows, heads, dim]


class TransformerBlock:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.qkv, self.o_proj = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.input_layernorm = 1.0 + r(HIDDEN, scale=0.1)
        self.post_attention_layernorm = 1.0 + r(HIDDEN, scale=0.1)


class Qwen3Model:
    def __init__(self, device, enable_cuda_graph):
        gen = generator(482)
        self.device, self.enable_cuda_graph = device, enable_cuda_graph
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_positions = randn(MAX_POSITION_EMBEDDINGS, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [TransformerBlock(gen, device) for _ in range(NUM_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.lm_head = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.ctx = DeviceContext(device)

    def forward_rows(self, kv_caches, meta: DecodeMeta):
        """Rows of (token, position), each over its paged view; the row's K/V is written at its position's page."""
        tokens, positions = meta.token_ids.long(), meta.positions.long()
        rows = tokens.shape[0]
        start = meta.page_indptr[:rows].long()
        page = meta.page_indices[(start + positions // PAGE_SIZE).clamp(max=meta.page_indices.numel() - 1)].long()
        write_slots = page * PAGE_SIZE + positions % PAGE_SIZE
        h = self.embed_tokens[tokens] + self.embed_positions[positions]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            q, k, v = linear(rms_norm(h, layer.input_layernorm), layer.qkv).view(rows, 3, NUM_HEADS, HEAD_DIM).unbind(1)
            k_cache.index_copy_(0, write_slots, k)
            v_cache.index_copy_(0, write_slots, v)
            h = h + linear(paged_decode_attention(q, k_cache, v_cache, meta).reshape(rows, HIDDEN), layer.o_proj)
            gate, up = linear(rms_norm(h, layer.post_attention_layernorm), layer.gate_up).chunk(2, dim=-1)
            h = h + linear(torch.nn.functional.silu(gate) * up, layer.down)
        return linear(rms_norm(h, self.norm), self.lm_head)                          # logits [rows, vocab]

    def batch_decode_kernels(self, kv_caches, meta: DecodeMeta):
        return self.forward_rows(kv_caches, meta)

    def prefill(self, tokens, kv_position, view: KvView, kv_caches):
        """One request's uncached prompt tokens (eager; upstream prefill.rs is not modelled)."""
        pages = view.page_indices()
        page_indices, indptr, last = [], [0], []
        for pos in range(kv_position, kv_position + len(tokens)):
            n = pos // PAGE_SIZE + 1
            page_indices += pages[:n]
            indptr.append(len(page_indices))
            last.append(pos % PAGE_SIZE + 1)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32).to(self.device)          # noqa: E731
        meta = DecodeMeta(i32(tokens), i32(list(range(kv_position, kv_position + len(tokens)))), i32(page_indices),
                          i32(indptr), i32(last))
        return self.forward_rows(kv_caches, meta)[-1]

    def batch_decode(self, token_ids, kv_views, kv_caches, bufs: BatchDecodeBuffers | None):
        bs = len(token_ids)
        positions = [v.seq_len() - 1 for v in kv_views]
        if not self.enable_cuda_graph:
            # The run without graphs (stand-in): metadata built as fresh tensors at the step's size.
            page_indices, indptr, last = [], [0], []
            for v in kv_views:
                page_indices += v.page_indices()
                indptr.append(len(page_indices))
                last.append(v.last_page_len())
            i32 = lambda x: torch.tensor(x, dtype=torch.int32).to(self.device)      # noqa: E731
            meta = DecodeMeta(i32(token_ids), i32(positions), i32(page_indices), i32(indptr), i32(last))
            return self.batch_decode_kernels(kv_caches, meta)
        padded_bs = bucket_for(bs)                                   # pad to bucket size for CUDA Graph stability
        token_ids_padded = list(token_ids) + [0] * (padded_bs - bs)
        positions = positions + [0] * (padded_bs - bs)
        self.ctx.stream.memcpy_htod(token_ids_padded, bufs.token_ids_d)
        self.ctx.stream.memcpy_htod(positions, bufs.positions_d)
        bufs.sync_paged_meta(self.ctx, kv_views, padded_bs)
        graph_idx = BATCH_BUCKETS.index(padded_bs)
        state = {f"layers.{i}.{n}_cache": t for i, c in enumerate(kv_caches) for n, t in zip("kv", c)}
        out = bufs.graphs[graph_idx].run_or_capture(
            self.ctx, lambda: self.batch_decode_kernels(kv_caches, bufs.meta(padded_bs)),
            name=f"qwen3 decode bucket {padded_bs}", static=bufs.static_buffers(), state=state, real=bs, size=padded_bs)
        return out[:bs]


# --- openinfer-qwen3-4b/src/executor.rs (reduced) ---------------------------------------------------------------------

class LocalQwen3Lane:
    def __init__(self, device, enable_cuda_graph):
        self.model = Qwen3Model(device, enable_cuda_graph)
        self.pool = BlockPool(PAGE_SIZE, NUM_BLOCKS)
        self.kv_caches = [tuple(torch.zeros(NUM_BLOCKS * PAGE_SIZE, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                                for _ in range(2)) for _ in range(NUM_LAYERS)]
        total_blocks, padding_block_id = self.pool.total_blocks(), self.pool.padding_block_id()
        max_bucket = BATCH_BUCKETS[-1]
        self.bufs = (BatchDecodeBuffers.new(self.model.ctx, max_bucket, total_blocks, PAGE_SIZE, padding_block_id,
                                            MAX_POSITION_EMBEDDINGS) if enable_cuda_graph else None)

    def execute_prefill(self, req: RequestKv):
        cached = req.match_and_add_prefix(self.pool)
        new_tokens = req.tokens[cached:req.num_input_tokens]
        req.schedule_prefill(len(new_tokens), self.pool)
        view = req.prefill_view(len(new_tokens))
        logits = self.model.prefill(new_tokens, req.kv_position(), view, self.kv_caches)
        req.apply_prefill(int(logits.argmax()), self.pool)
        return logits.clone()

    def execute_decode(self, reqs):
        for req in reqs:
            req.schedule_decode(self.pool)
        views = [req.decode_view() for req in reqs]
        logits = self.model.batch_decode([req.tokens[-1] for req in reqs], views, self.kv_caches, self.bufs)
        logits = logits.clone()                                      # sampled on the host; the graph's output is reused
        for req, row in zip(reqs, logits):
            req.apply_decode(int(row.argmax()), self.pool)
        return logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enable_cuda_graph: bool):
        lane = LocalQwen3Lane(device, enable_cuda_graph)
        gen = generator(403)
        system_prompt = torch.randint(0, VOCAB, (3 * PAGE_SIZE,), generator=gen).tolist()
        reqs = {name: RequestKv(system_prompt + torch.randint(0, VOCAB, (2,), generator=gen).tolist(), PAGE_SIZE)
                for name in "ABCD"}
        outs = [lane.execute_prefill(reqs["A"])]
        outs.append(lane.execute_decode([reqs["A"]]))
        outs += [lane.execute_prefill(reqs["B"]), lane.execute_prefill(reqs["C"])]
        outs.append(lane.execute_decode([reqs[n] for n in "ABC"]))
        outs.append(lane.execute_prefill(reqs["D"]))
        for _ in range(3):
            outs.append(lane.execute_decode([reqs[n] for n in "ABCD"]))
        outs.append(torch.tensor([t for n in "ABCD" for t in reqs[n].tokens], dtype=torch.float64))
        return outs

    try:
        with torch.no_grad():
            return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
    finally:
        _variant = "bug"
