"""Full-prefill CUDA graph: the SWA write-location buffer is sized by max_context_len, but a bucket holds aggregate tokens.

Upstream: https://github.com/sgl-project/sglang/pull/35454 ("[Fix] Harden FlashAttention CUDA graph metadata bounds",
merged; described 2026-08-19). The code path came with https://github.com/sgl-project/sglang/pull/27988
("[Experimental] Full Cuda Graph Support for Prefill"): ``cuda_graph_config[prefill].backend = full`` with the
FlashAttention backend (fa3/fa4).
Symptom: the PR says: "Full-prefill CUDA graph buckets are sized by aggregate batch tokens, which can exceed the
maximum context length of any single request. The FlashAttention sliding-window write-location buffer is
currently allocated from max_context_len, so a valid aggregate-token bucket can exceed its capacity." Any
hybrid-SWA model (gpt-oss, Gemma; ``SWAKVPool``) served with full prefill graphs and a prefill bucket larger
than ``--context-length`` fails at startup: capturing the bucket raises a shape mismatch. Without graphs
nothing goes wrong: eager prefill translates ``out_cache_loc`` into a fresh tensor at every step.
Mechanism: ``model_runner_components/cuda_graph_setup.py`` keeps every configured prefill bucket up to
``max_capture_tokens = full_prefill_max_req * context_length`` (aggregate tokens). ``PrefillCudaGraphRunner.
capture_prepare`` builds such a bucket as the fewest dummy requests of at most ``context_length`` tokens each,
padded with zero-length sentinels to the fixed request-slot count. ``capture_one_shape`` (largest bucket
first) calls ``attn_backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)``. This goes to
``FlashAttentionBackend._init_full_cg_prefill_metadata``. On the first capture, that function allocates the
pointer-stable metadata buffers, including ``full_cg_prefill_swa_out_cache_loc =
torch.zeros((self.max_context_len,))``. It then refills
``full_cg_prefill_swa_out_cache_loc[:num_out].copy_(translate_loc_from_full_to_swa(out_cache_loc))`` with
``num_out`` = the bucket's token count. The captured SWA layers' ``set_kv_buffer`` writes through that view
(``KVWriteLoc.swa_loc``). When the bucket is larger than ``max_context_len``, the slice is clipped to the
buffer and the copy does not fit.
Doctor: undersized-buffer, at _init_full_cg_prefill_metadata (this is where the static buffer is created and
filled. The graph's SWA write locations are data that do not fit it: a bucket of aggregate tokens, up to
``full_prefill_max_req * context_len``, goes into a buffer sized by the per-request bound ``max_context_len``.
The fix changed code in this function.)
Fix (upstream): ``_init_full_cg_prefill_metadata`` sizes ``full_cg_prefill_swa_out_cache_loc`` from the captured
token capacity, which is the first and largest bucket, and asserts ``used <= capacity`` before each refill
("used 9 > capacity 8" in its CPU test). Two other changes are left out because they are not graph bugs:
``init_forward_metadata`` (the eager path) uses the static ``max_context_len`` bound when ``seq_lens_cpu`` is
empty, and the PR adds CPU tests.
Modelled: a two-layer hybrid model (layer 0 sliding-window, layer 1 full attention) with no RoPE and no MLP.
``flash_attn_with_kvcache`` is a dense masked gather over the page table. It is causal from ``cu_seqlens_q`` /
``cache_seqlens``, with the window for SWA layers. ``SWAKVPool`` has a full and an SWA K/V cache plus
``full_to_swa_index_mapping``; slot 0 of each is the dummy slot. page_size is 1 and there is no prefix cache.
The runner keeps upstream's order (capture largest bucket first; the metadata init runs outside the graph
before each capture and each replay) and its dummy capture layout. It zeroes the padded tails of the static
inputs (the buffer registry's padding reset). ``context_len`` is 8, the buckets are 8 and 16 tokens, and
``full_prefill_max_req`` is 2 (``chunked_prefill_size // 512``), so the 16-token bucket is admitted, as
upstream admits 8192 for a 4096 context.
"""

import copy
import dataclasses
from typing import Optional

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/35454"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_init_full_cg_prefill_metadata"
SYMPTOM = ("full prefill CUDA graphs on a hybrid-SWA model: capturing a bucket larger than context_len fails, "
           "because the graph-stable SWA write-location buffer holds only max_context_len tokens")

CONTEXT_LEN = 8                       # model_config.context_len (--context-length)
CHUNKED_PREFILL_SIZE = 1024           # full_prefill_max_req defaults to chunked_prefill_size // 512
PREFILL_BUCKETS = (8, 16)             # cuda_graph_config[prefill].bs: aggregate-token buckets
MAX_REQS = 4                          # req_to_token_pool.size
POOL_SLOTS = 48                       # KV slots (slot 0: the dummy slot)
HIDDEN, VOCAB, SLIDING_WINDOW = 8, 32, 3
WORKLOAD = ([7, 6], [5], [8, 8], [3, 2])      # prompt lengths of the prefill batches served


# --- sglang/srt/mem_cache ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class KVWriteLoc:
    loc: torch.Tensor                               # full-pool slots of the new tokens
    swa_loc: Optional[torch.Tensor] = None          # their SWA-pool slots (pre-translated once per forward)


class SWAKVPool:
    """Full and sliding-window sub-pools; SWA layers write at translated slots."""

    def __init__(self, gen, device):
        self.k_full = torch.zeros(POOL_SLOTS, HIDDEN, device=device)
        self.v_full = torch.zeros(POOL_SLOTS, HIDDEN, device=device)
        self.k_swa = torch.zeros(POOL_SLOTS, HIDDEN, device=device)
        self.v_swa = torch.zeros(POOL_SLOTS, HIDDEN, device=device)
        perm = torch.randperm(POOL_SLOTS - 1, generator=gen) + 1
        self.full_to_swa_index_mapping = torch.cat([torch.zeros(1, dtype=torch.long), perm]).to(device)
        self.swa_layer_nums = 1

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[loc.long()]

    def get_kv_buffer(self, layer):
        return (self.k_swa, self.v_swa) if layer.is_swa else (self.k_full, self.v_full)

    def set_kv_buffer(self, layer, write_loc: KVWriteLoc, k, v):
        assert write_loc.swa_loc is not None or not layer.is_swa, "SWA layers need a pre-translated swa_loc"
        loc = write_loc.swa_loc if layer.is_swa else write_loc.loc
        k_cache, v_cache = self.get_kv_buffer(layer)
        k_cache.index_copy_(0, loc.long(), k)
        v_cache.index_copy_(0, loc.long(), v)


class TokenToKVPoolAllocator:
    def __init__(self, device):
        self.device, self.next_slot = device, 1     # slot 0 is the dummy slot

    def alloc(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        assert self.next_slot <= POOL_SLOTS
        return out.to(self.device)


# --- sglang/srt/model_executor/forward_batch_info.py ------------------------------------------------------------

@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    input_ids: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    out_cache_loc: torch.Tensor


# --- sglang/srt/layers/attention/flashattention_backend.py ------------------------------------------------------

@dataclasses.dataclass
class FlashAttentionMetadata:
    cache_seqlens_int32: torch.Tensor = None
    max_seq_len_q: int = 1
    max_seq_len_k: int = 0
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    page_table: torch.Tensor = None
    swa_page_table: torch.Tensor = None
    swa_out_cache_loc: torch.Tensor = None


def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, softmax_scale,
                            window_size):
    """Varlen causal attention over a paged cache (page_size 1); query i of request r sits at position
    cache_seqlens[r] - q_len[r] + (i - cu_seqlens_q[r]). Tokens past cu_seqlens_q[-1] are padding."""
    t, r, width = q.shape[0], cache_seqlens.shape[0], page_table.shape[1]
    idx = torch.arange(t, dtype=cu_seqlens_q.dtype, device=q.device)
    req = torch.searchsorted(cu_seqlens_q[1:].contiguous(), idx, right=True).clamp(max=r - 1)
    start = cu_seqlens_q[req]
    q_len = cu_seqlens_q[req + 1] - start
    seqlen = cache_seqlens[req]
    pos = (seqlen - q_len + idx - start).unsqueeze(1)
    j = torch.arange(width, device=q.device).unsqueeze(0)
    valid = (j < seqlen.unsqueeze(1)) & (j <= pos)
    if window_size[0] >= 0:
        valid = valid & (j >= pos - window_size[0])
    slots = page_table[req].long()
    keys = k_cache[slots].masked_fill(~valid.unsqueeze(-1), 0.0)
    values = v_cache[slots].masked_fill(~valid.unsqueeze(-1), 0.0)
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1) * softmax_scale
    probs = torch.softmax(scores.masked_fill(~valid, -1e30), dim=-1)
    return (probs.unsqueeze(-1) * values).sum(1)


class FlashAttentionBackend:
    def __init__(self, model_runner, variant: str):
        self.variant = variant
        self.max_context_len = CONTEXT_LEN
        self.page_size = 1
        self.max_num_pages = (self.max_context_len + self.page_size - 1) // self.page_size
        self.req_to_token = model_runner.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.use_sliding_window_kv_pool = self.token_to_kv_pool.swa_layer_nums > 0
        self.forward_metadata: Optional[FlashAttentionMetadata] = None
        self.full_cg_prefill_metadata: Optional[FlashAttentionMetadata] = None
        self.full_cg_prefill_swa_out_cache_loc: Optional[torch.Tensor] = None

    # eager ---------------------------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager extend (no prefix): fresh tensors every step."""
        m = FlashAttentionMetadata()
        m.cache_seqlens_int32 = forward_batch.seq_lens.to(torch.int32)
        m.max_seq_len_k = int(forward_batch.seq_lens_cpu.max().item())
        m.cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(forward_batch.seq_lens, dim=0, dtype=torch.int32), (1, 0))
        m.max_seq_len_q, m.cu_seqlens_q = m.max_seq_len_k, m.cu_seqlens_k
        m.page_table = self.req_to_token[forward_batch.req_pool_indices, : m.max_seq_len_k]
        if self.use_sliding_window_kv_pool:
            m.swa_page_table = self.token_to_kv_pool.translate_loc_from_full_to_swa(m.page_table)
            m.swa_out_cache_loc = self.token_to_kv_pool.translate_loc_from_full_to_swa(forward_batch.out_cache_loc)
        self.forward_metadata = m

    # full CUDA graph ------------------------------------------------------------------------------------------------
    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        self._init_full_cg_prefill_metadata(forward_batch, in_capture)

    def _init_full_cg_prefill_metadata(self, forward_batch: ForwardBatch, in_capture: bool):
        """Capture/replay metadata for plain EXTEND under the full prefill CUDA graph: pointer-stable buffers,
        refilled in place every replay."""
        bs = forward_batch.batch_size
        if in_capture and self.full_cg_prefill_metadata is None:
            device = forward_batch.seq_lens.device
            m = FlashAttentionMetadata()
            m.cache_seqlens_int32 = torch.zeros((bs,), dtype=torch.int32, device=device)
            m.cu_seqlens_q = torch.zeros((bs + 1,), dtype=torch.int32, device=device)
            m.cu_seqlens_k = torch.zeros((bs + 1,), dtype=torch.int32, device=device)
            m.page_table = torch.zeros((bs, self.max_num_pages), dtype=torch.int32, device=device)
            self.full_cg_prefill_strided_indices = torch.arange(
                0, self.max_context_len, self.page_size, device=device)
            if self.use_sliding_window_kv_pool:
                m.swa_page_table = torch.zeros((bs, self.max_num_pages), dtype=torch.int32, device=device)
                if self.variant == "fix":           # PR #35454: the captured token capacity (largest bucket first)
                    capacity = forward_batch.out_cache_loc.shape[0]
                else:                               # the per-request bound
                    capacity = self.max_context_len
                self.full_cg_prefill_swa_out_cache_loc = torch.zeros((capacity,), dtype=torch.int64, device=device)
            self.full_cg_prefill_metadata = m
        m = self.full_cg_prefill_metadata
        assert m is not None and bs == m.cache_seqlens_int32.shape[0], (
            "full-CG prefill metadata must be created at capture with the same fixed request-slot count")

        seq_lens = forward_batch.seq_lens[:bs]
        m.cache_seqlens_int32.copy_(seq_lens)
        m.cu_seqlens_k[1:].copy_(torch.cumsum(seq_lens, dim=0))
        m.cu_seqlens_q[1:].copy_(torch.cumsum(forward_batch.extend_seq_lens[:bs], dim=0))
        max_seq_len_k = int(forward_batch.seq_lens_cpu[:bs].max().item())
        if max_seq_len_k > 0:
            max_seq_pages = (max_seq_len_k + self.page_size - 1) // self.page_size
            page_indices = self.req_to_token[forward_batch.req_pool_indices[:bs, None],
                                             self.full_cg_prefill_strided_indices[:max_seq_pages]]
            m.page_table[:, :max_seq_pages].copy_(page_indices // self.page_size)
            if self.use_sliding_window_kv_pool:
                swa_starts = self.token_to_kv_pool.translate_loc_from_full_to_swa(page_indices)
                m.swa_page_table[:, :max_seq_pages].copy_(swa_starts // self.page_size)
        if self.use_sliding_window_kv_pool and forward_batch.out_cache_loc is not None:
            num_out = forward_batch.out_cache_loc.shape[0]
            if self.variant == "fix":
                capacity = self.full_cg_prefill_swa_out_cache_loc.shape[0]
                assert num_out <= capacity, (
                    f"full-CG prefill SWA write locations: used {num_out} > capacity {capacity}")
            self.full_cg_prefill_swa_out_cache_loc[:num_out].copy_(
                self.token_to_kv_pool.translate_loc_from_full_to_swa(forward_batch.out_cache_loc))
            # Captured kernels read the full bucket: route its inactive tail to SWA's dummy slot.
            self.full_cg_prefill_swa_out_cache_loc[num_out:].zero_()
            m.swa_out_cache_loc = self.full_cg_prefill_swa_out_cache_loc[:num_out]
        if in_capture:
            m.max_seq_len_q = forward_batch.input_ids.numel()
            m.max_seq_len_k = self.max_context_len
        self.forward_metadata = m

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch):
        metadata = self.forward_metadata
        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc,
                                                              metadata.swa_out_cache_loc), k, v)
        page_table = metadata.swa_page_table if layer.is_swa else metadata.page_table
        window_size = (layer.sliding_window_size, 0) if layer.is_swa else (-1, -1)
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer)
        return flash_attn_with_kvcache(q, k_cache, v_cache, page_table, metadata.cache_seqlens_int32,
                                       metadata.cu_seqlens_q, layer.scaling, window_size)


# --- the model: alternating sliding-window / full attention (gpt-oss style) -------------------------------------

class RadixAttention:
    def __init__(self, layer_id: int, sliding_window_size: int):
        self.layer_id, self.sliding_window_size = layer_id, sliding_window_size
        self.is_swa = sliding_window_size > -1
        self.scaling = HIDDEN ** -0.5


class HybridSWAModel:
    def __init__(self, gen, device):
        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen) * scale).to(device)
        self.embed = w(VOCAB, HIDDEN, scale=1.0)
        self.layers = []
        for layer_id, window in enumerate((SLIDING_WINDOW, -1)):
            self.layers.append((RadixAttention(layer_id, window),
                                [w(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5) for _ in range(4)]))

    def forward(self, forward_batch: ForwardBatch, attn_backend: FlashAttentionBackend) -> torch.Tensor:
        h = self.embed[forward_batch.input_ids]
        for attn, (wq, wk, wv, wo) in self.layers:
            o = attn_backend.forward_extend(h @ wq, h @ wk, h @ wv, attn, forward_batch)
            h = h + torch.tanh(o @ wo)
        return h


# --- sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py -----------------------------------------------

def resolve_prefill_capture_num_tokens(context_length: int, req_pool_size: int):
    """cuda_graph_setup: Full's request slots, and the buckets the dummy capture batch can represent."""
    max_capture_requests = min(max(CHUNKED_PREFILL_SIZE // 512, 1), req_pool_size)
    max_capture_tokens = max_capture_requests * context_length
    return max_capture_requests, sorted(n for n in PREFILL_BUCKETS if n <= max_capture_tokens)


class PrefillCudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner = model_runner
        device = model_runner.device
        self._capture_req_slots, self.capture_num_tokens = resolve_prefill_capture_num_tokens(CONTEXT_LEN, MAX_REQS)
        self.max_num_tokens = max(self.capture_num_tokens)
        r = self._capture_req_slots
        self.s = {"input_ids": torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device),
                  "out_cache_loc": torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device),
                  "seq_lens": torch.zeros(r, dtype=torch.int64, device=device),
                  "extend_seq_lens": torch.zeros(r, dtype=torch.int64, device=device),
                  "req_pool_indices": torch.zeros(r, dtype=torch.int64, device=device)}
        self._full_cg_seq_lens_cpu = torch.zeros(r, dtype=torch.int64)
        self.graphs, self.outputs = {}, {}
        for num_tokens in reversed(self.capture_num_tokens):          # largest first
            self.capture_one_shape(num_tokens)

    def capture_prepare(self, num_tokens: int) -> ForwardBatch:
        """The bucket as the fewest synthetic requests of at most context_length tokens, then sentinels."""
        capture_seq_lens = [min(CONTEXT_LEN, num_tokens - start) for start in range(0, num_tokens, CONTEXT_LEN)]
        capture_seq_lens += [0] * (self._capture_req_slots - len(capture_seq_lens))
        bs = len(capture_seq_lens)
        s = self.s
        s["seq_lens"][:bs].copy_(torch.tensor(capture_seq_lens))
        s["extend_seq_lens"][:bs].copy_(torch.tensor(capture_seq_lens))
        s["req_pool_indices"][:bs].copy_(torch.arange(bs))
        s["input_ids"].zero_()
        s["out_cache_loc"].zero_()                                   # capture writes go to the dummy slot
        return ForwardBatch(bs, s["input_ids"][:num_tokens], s["seq_lens"][:bs],
                            torch.tensor(capture_seq_lens, dtype=torch.int64), s["extend_seq_lens"][:bs],
                            s["req_pool_indices"][:bs], s["out_cache_loc"][:num_tokens])

    def capture_one_shape(self, num_tokens: int) -> None:
        mr = self.model_runner
        forward_batch = self.capture_prepare(num_tokens)
        mr.attn_backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)
        m = mr.attn_backend.full_cg_prefill_metadata
        static = {"input_ids": self.s["input_ids"], "out_cache_loc": self.s["out_cache_loc"],
                  "cache_seqlens_int32": m.cache_seqlens_int32, "cu_seqlens_q": m.cu_seqlens_q,
                  "cu_seqlens_k": m.cu_seqlens_k, "page_table": m.page_table, "swa_page_table": m.swa_page_table,
                  "full_cg_prefill_swa_out_cache_loc": mr.attn_backend.full_cg_prefill_swa_out_cache_loc}
        pool = mr.token_to_kv_pool
        g, out = capture(lambda: mr.model.forward(forward_batch, mr.attn_backend), device=mr.device,
                         name=f"full prefill {num_tokens} tokens", owner="PrefillCudaGraphRunner", static=static,
                         state={"k_full": pool.k_full, "v_full": pool.v_full, "k_swa": pool.k_swa,
                                "v_swa": pool.v_swa})
        self.graphs[num_tokens], self.outputs[num_tokens] = g, out

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (forward_batch.batch_size <= self._capture_req_slots
                and forward_batch.input_ids.shape[0] <= self.max_num_tokens)

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        n, bs, r = forward_batch.input_ids.shape[0], forward_batch.batch_size, self._capture_req_slots
        bucket = min(b for b in self.capture_num_tokens if b >= n)
        s = self.s
        for name in ("input_ids", "out_cache_loc"):                  # load_batch: reset padding, copy
            s[name][n:].zero_()
            s[name][:n].copy_(getattr(forward_batch, name))
        for name in ("seq_lens", "extend_seq_lens", "req_pool_indices"):
            s[name][bs:r].zero_()                                     # zero-length sentinel requests
            s[name][:bs].copy_(getattr(forward_batch, name))
        self._full_cg_seq_lens_cpu.zero_()
        self._full_cg_seq_lens_cpu[:bs].copy_(forward_batch.seq_lens_cpu)
        padded_view = copy.copy(forward_batch)                        # real out_cache_loc, slot-padded metadata
        padded_view.batch_size = r
        padded_view.seq_lens = s["seq_lens"][:r]
        padded_view.seq_lens_cpu = self._full_cg_seq_lens_cpu
        padded_view.extend_seq_lens = s["extend_seq_lens"][:r]
        padded_view.req_pool_indices = s["req_pool_indices"][:r]
        self.model_runner.attn_backend.init_forward_metadata_out_graph(padded_view)
        return replay(self.graphs[bucket], self.outputs[bucket], real=n, size=bucket)


# --- sglang/srt/model_executor/model_runner.py -------------------------------------------------------------------

class ModelRunner:
    def __init__(self, model, variant, device, use_cuda_graph: bool, gen):
        self.model, self.device = model, device
        self.req_to_token = torch.zeros(MAX_REQS, CONTEXT_LEN, dtype=torch.int32, device=device)
        self.token_to_kv_pool = SWAKVPool(gen, device)
        self.allocator = TokenToKVPoolAllocator(device)
        self.attn_backend = FlashAttentionBackend(self, variant)
        self.prefill_graph_runner = PrefillCudaGraphRunner(self) if use_cuda_graph else None

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        lens = [len(p) for p in prompts]
        out_cache_loc = self.allocator.alloc(sum(lens))
        offset = 0
        for row, n in enumerate(lens):                                # request i takes req_to_token row i
            self.req_to_token[row, :n].copy_(out_cache_loc[offset:offset + n].to(torch.int32))
            offset += n
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        fb = ForwardBatch(len(prompts), torch.tensor(sum(prompts, []), dtype=torch.int64).to(self.device),
                          seq_lens.to(self.device), seq_lens, seq_lens.to(self.device),
                          torch.arange(len(prompts)).to(self.device), out_cache_loc)
        runner = self.prefill_graph_runner
        if runner is not None and runner.can_run(fb):
            hidden = runner.replay(fb)
        else:
            self.attn_backend.init_forward_metadata(fb)
            hidden = self.model.forward(fb, self.attn_backend)
        return hidden[: sum(lens)].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(35454)
    model = HybridSWAModel(gen, device)
    prompts = [[torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in batch] for batch in WORKLOAD]

    def serve(graphed: bool):
        runner = ModelRunner(model, variant, device, graphed, generator(1))
        return [runner.prefill(batch) for batch in prompts]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
