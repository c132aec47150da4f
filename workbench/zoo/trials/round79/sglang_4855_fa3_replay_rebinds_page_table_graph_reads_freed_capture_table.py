"""FA3 decode under CUDA graphs (page_size > 1): the replay-time metadata update rebinds ``metadata.page_table`` to a fresh gather, so the captured decode attention keeps reading the released capture-time page table.

Upstream: https://github.com/sgl-project/sglang/pull/4855 ("Fix fa3 cuda graph page_size > 1 precision and
page_size=1 speed", commit 6ffb6bd47a, merged 2025-03-28). The bug came in one day earlier with #4832
("Support Page Size > 1 for FA3", commit 26c0f1312, merged 2025-03-27), which replaced the in-place page-table
copy of #4680 with a rebinding.
Symptom: with ``--attention-backend fa3 --page-size > 1`` and CUDA graphs on, decode output is wrong ("precision");
``--disable-cuda-graph`` (eager decode) is correct. (The title calls page_size = 1 only a speed problem: the
rebinding code gathered the whole ``req_to_token`` table every step; the program uses page_size 4.)
Mechanism: ``CudaGraphRunner.capture_one_batch_size`` (model_executor/cuda_graph_runner.py) calls
``FlashAttentionBackend.init_forward_metadata_capture_cuda_graph`` (layers/attention/flashattention_backend.py)
before it enters ``torch.cuda.graph``; that sets ``metadata.page_table =
self.decode_cuda_graph_metadata["page_table"][req_pool_indices, :]``, an advanced-index gather, i.e. a new
``[bs, max_pages]`` tensor (zeros) owned only by the per-``bs`` ``FlashAttentionMetadata`` kept in
``decode_cuda_graph_metadata[bs]``. ``forward_decode`` passes ``metadata.page_table`` to
``flash_attn_with_kvcache``, so the captured attention of every layer reads that tensor's address. Before each
replay, ``CudaGraphRunner.replay_prepare`` calls ``init_forward_metadata_replay_cuda_graph``, which (since #4832)
does ``metadata.page_table = self.req_to_token[:, strided_indices]`` and then ``metadata.page_table =
metadata.page_table[req_pool_indices[:bs]]``: plain attribute rebinds to new tensors. The graph never sees them;
the capture-time page table loses its last reference at the first replay and is released while the graph still
reads it. Its block was allocated on the capture side stream (``graph_capture()``), so the replay-time allocations
of the forward stream do not take it: the graph keeps reading the capture-time zeros, and every request's
attention gathers K/V from page 0 (the padding page) instead of its own pages. (The rebound table also holds token
indices, not page indices: #4832 dropped the ``// page_size`` the eager path applies, so even where a same-size
allocation did land in the released block, the graph would read the wrong pages.) Eager decode
(``init_forward_metadata``) builds a new ``metadata`` each step and reads it at once, so it is correct.
Doctor: dangling-reference, at init_forward_metadata_replay_cuda_graph (it rebinds ``metadata.page_table``,
dropping the last reference to the capture-time page table that the captured ``flash_attn_with_kvcache`` of every
layer reads, so every replay reads memory whose owner released it).
Fix (upstream): write the step's page table into the captured tensor in place:
``page_indices = self.req_to_token[:, strided_indices[:max_seq_pages]]``, ``page_indices =
page_indices[req_pool_indices[:bs]] // self.page_size``, ``metadata.page_table[:, :max_seq_pages].copy_(
page_indices)``, ``metadata.page_table[:, max_seq_pages:].fill_(0)``.
Modelled: a 2-layer decoder (fused QKV, attention, O projection with residual; no norms, MLP or RoPE), TP 1,
decode only, capture sizes 2 and 4 (one graph pool), padding to the next captured size as ``replay_prepare``
does. ``flash_attn_with_kvcache`` is dense paged decode attention over ``page_table`` and ``cache_seqlens``
(``cu_seqlens_*``, window, softcap and descales are accepted and unused, as in FA3 decode without new K/V).
Prefill is not modelled: requests arrive with their K/V already in the pool and their ``req_to_token`` row filled
(page by page). ``graph_capture()`` keeps only its side stream (on CUDA); on the CPU a released block keeps its
last bytes (``on_freed="reuse"``, no block reuse), as the capture stream's released block does on CUDA. Page ids
are small enough that a token index read as a page id stays inside the pool (wrong pages, not a fault).
"""
from __future__ import annotations

import bisect
import contextlib
import enum

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/4855"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "init_forward_metadata_replay_cuda_graph"
SYMPTOM = ("fa3, page_size > 1, CUDA graphs: the replay rebinds metadata.page_table to a new gather; the captured "
           "decode attention reads the released capture-time page table; wrong decode output")

VOCAB, HIDDEN, NUM_LAYERS, NUM_HEADS, HEAD_DIM = 32, 8, 2, 2, 4
PAGE_SIZE = 4                    # --page-size
CONTEXT_LEN = 16                 # model_config.context_len
REQ_POOL_SIZE = 8                # req_to_token_pool rows (row 0: the capture's dummy request)
NUM_PAGES = 64                   # token_to_kv_pool pages; page 0 takes the padded rows' writes (out_cache_loc 0)
CUDA_GRAPH_BS = [2, 4]           # get_batch_sizes_to_capture


class ForwardMode(enum.Enum):
    DECODE = enum.auto()


# --- mem_cache/memory_pool.py ---------------------------------------------------------------------------

class ReqToTokenPool:
    def __init__(self, size, max_context_len, device):
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)


class MHATokenToKVPool:
    def __init__(self, size, head_num, head_dim, layer_num, device):
        self.k_buffer = [torch.zeros(size, head_num, head_dim, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size, head_num, head_dim, device=device) for _ in range(layer_num)]

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v


# --- model_executor/forward_batch_info.py -------------------------------------------------------------------

class ForwardBatch:
    def __init__(self, forward_mode, batch_size, input_ids, req_pool_indices, seq_lens, out_cache_loc, seq_lens_sum,
                 req_to_token_pool, token_to_kv_pool, attn_backend, decode_seq_lens_cpu=None):
        self.forward_mode, self.batch_size, self.input_ids = forward_mode, batch_size, input_ids
        self.req_pool_indices, self.seq_lens, self.out_cache_loc = req_pool_indices, seq_lens, out_cache_loc
        self.seq_lens_sum, self.decode_seq_lens_cpu = seq_lens_sum, decode_seq_lens_cpu
        self.req_to_token_pool, self.token_to_kv_pool = req_to_token_pool, token_to_kv_pool
        self.attn_backend = attn_backend


# --- flash_attn_interface (FA3), decode over a paged KV cache -------------------------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, k_descale=None, v_descale=None):
    """One query per sequence (at its last position): attend to keys ``[0, cache_seqlens[b])``, key ``t`` of
    sequence ``b`` being slot ``t % page_size`` of page ``page_table[b, t // page_size]``."""
    page_size = k_cache.shape[1]
    t = torch.arange(page_table.shape[1] * page_size, device=q.device)
    pages = page_table[:, t // page_size].long()                                   # [B, T]
    k, v = k_cache[pages, t % page_size], v_cache[pages, t % page_size]             # [B, T, H, D]
    scores = torch.einsum("bhd,bthd->bht", q, k) * softmax_scale
    past_end = t[None, :] >= cache_seqlens[:, None]
    probs = torch.softmax(scores.masked_fill(past_end[:, None, :], -1e9), dim=-1)
    return torch.einsum("bht,bthd->bhd", probs, v)


# --- layers/attention/flashattention_backend.py (at #4832, 26c0f1312) ------------------------------------------

class FlashAttentionMetadata:
    """Metadata for decode operations to avoid redundant computations."""

    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    max_seq_len_q: int = 0
    max_seq_len_k: int = 0
    window_size: tuple = (-1, -1)
    page_table: torch.Tensor = None
    cache_seqlens_int32: torch.Tensor = None


class FlashAttentionBackend:
    """FlashAttention backend implementation."""

    def __init__(self, model_runner: "ModelRunner", variant: str):
        self.forward_metadata: FlashAttentionMetadata = None
        self.max_context_len = model_runner.context_len
        self.device = model_runner.device
        self.decode_cuda_graph_metadata = {}
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = model_runner.page_size
        self.variant = variant                     # (which sglang: #4832, or with #4855)

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Initialize forward metadata to cache repetitive calculations."""
        metadata = FlashAttentionMetadata()
        seqlens_in_batch = forward_batch.seq_lens
        metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
        batch_size = len(seqlens_in_batch)
        device = seqlens_in_batch.device
        metadata.cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
        metadata.max_seq_len_k = seqlens_in_batch.max().item()
        metadata.page_table = forward_batch.req_to_token_pool.req_to_token[
            forward_batch.req_pool_indices, : metadata.max_seq_len_k]
        # Precompute strided indices
        # [0, page_size, 2 * page_size, ...]
        if self.page_size > 1:
            self.strided_indices = torch.arange(0, metadata.page_table.shape[1], self.page_size, device=self.device)
            metadata.page_table = metadata.page_table[:, self.strided_indices] // self.page_size
        assert forward_batch.forward_mode == ForwardMode.DECODE
        metadata.cu_seqlens_q = torch.arange(0, batch_size + 1, dtype=torch.int32, device=device)
        self.forward_metadata = metadata

    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True):
        return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True):
        """Forward pass with FlashAttention using precomputed metadata."""
        if k is not None and v is not None and save_kv_cache:
            cache_loc = forward_batch.out_cache_loc
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, cache_loc, k, v, layer.k_scale, layer.v_scale)
        kv_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # Use precomputed metadata
        metadata = self.forward_metadata
        q_reshaped = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
        window_size = (layer.sliding_window_size, 0) if layer.sliding_window_size is not None else (-1, -1)
        key_cache = key_cache.view(-1, self.page_size, layer.tp_k_head_num, layer.head_dim)
        value_cache = value_cache.view(-1, self.page_size, layer.tp_v_head_num, layer.head_dim)
        page_table = metadata.page_table
        o = flash_attn_with_kvcache(
            q=q_reshaped, k_cache=key_cache, v_cache=value_cache, page_table=page_table,
            cache_seqlens=metadata.cache_seqlens_int32, cu_seqlens_q=metadata.cu_seqlens_q,
            cu_seqlens_k_new=metadata.cu_seqlens_k, max_seqlen_q=1, softmax_scale=layer.scaling, causal=True,
            window_size=window_size, softcap=layer.logit_cap, k_descale=layer.k_scale, v_descale=layer.v_scale)
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)

    def init_cuda_graph_state(self, max_bs: int):
        """Initialize CUDA graph state for the attention backend."""
        self.decode_cuda_graph_metadata = {
            # Page table for token mapping (batch_size, max_context_len)
            "page_table": torch.zeros(max_bs, (self.max_context_len + self.page_size - 1) // self.page_size,
                                      dtype=torch.int32, device=self.device),
            "strided_indices": torch.arange(0, self.max_context_len, self.page_size, device=self.device),
        }

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        """Initialize forward metadata for capturing CUDA graph."""
        metadata = FlashAttentionMetadata()
        metadata.cache_seqlens_int32 = seq_lens.to(torch.int32)     # (int32 already: the runner's seq_lens)
        batch_size = len(seq_lens)
        device = seq_lens.device
        metadata.cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(seq_lens, dim=0, dtype=torch.int32), (1, 0))
        metadata.max_seq_len_k = seq_lens.max().item()
        # Precompute page table: an advanced-index gather, a new [bs, max_pages] tensor
        metadata.page_table = self.decode_cuda_graph_metadata["page_table"][req_pool_indices, :]
        if forward_mode == ForwardMode.DECODE:
            metadata.cu_seqlens_q = torch.arange(0, batch_size + 1, dtype=torch.int32, device=device)
        else:
            raise ValueError("Do not support Prefill Mode cuda graph")
        self.decode_cuda_graph_metadata[bs] = metadata
        self.forward_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        """Initialize forward metadata for replaying CUDA graph."""
        metadata = self.decode_cuda_graph_metadata[bs]
        # For CPU operations
        max_len = seq_lens_cpu[:bs].max().item()
        metadata.max_seq_len_k = max_len
        # For GPU operations
        seq_lens_in_batch = seq_lens[:bs]
        metadata.cache_seqlens_int32 = seq_lens_in_batch.to(torch.int32)
        metadata.cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(seq_lens_in_batch, dim=0, dtype=torch.int32), (1, 0))
        if self.variant == "bug":
            # #4832: rebinds the attribute to new tensors (and keeps token indices)
            metadata.page_table = self.req_to_token[:, self.decode_cuda_graph_metadata["strided_indices"]]
            metadata.page_table = metadata.page_table[req_pool_indices[:bs]]
        else:
            # #4855: write into the captured page table in place
            max_seq_pages = (metadata.max_seq_len_k + self.page_size - 1) // self.page_size
            page_indices = self.req_to_token[:, self.decode_cuda_graph_metadata["strided_indices"][:max_seq_pages]]
            page_indices = page_indices[req_pool_indices[:bs]] // self.page_size
            metadata.page_table[:, :max_seq_pages].copy_(page_indices)
            metadata.page_table[:, max_seq_pages:].fill_(0)
        self.forward_metadata = metadata

    def get_cuda_graph_seq_len_fill_value(self):
        """Get the fill value for sequence length in CUDA graph."""
        return 0


# --- layers/radix_attention.py and a tiny decoder -----------------------------------------------------------

class RadixAttention:
    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id):
        self.tp_q_head_num = self.tp_k_head_num = self.tp_v_head_num = num_heads
        self.head_dim, self.scaling, self.layer_id = head_dim, scaling, layer_id
        self.sliding_window_size, self.logit_cap = None, 0.0
        self.k_scale = self.v_scale = None
        self.is_cross_attention = False

    def __call__(self, q, k, v, forward_batch: ForwardBatch):
        k = k.view(-1, self.tp_k_head_num, self.head_dim)
        v = v.view(-1, self.tp_v_head_num, self.head_dim)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)


class DecoderLayer:
    def __init__(self, layer_id, gen, device):
        self.qkv_proj = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.attn = RadixAttention(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_HEADS, layer_id)

    def forward(self, hidden_states, forward_batch):
        q, k, v = (hidden_states @ self.qkv_proj).split(HIDDEN, dim=-1)
        return hidden_states + self.attn(q, k, v, forward_batch) @ self.o_proj


class ForCausalLM:
    def __init__(self, device):
        gen = generator(4855)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.5)
        self.layers = [DecoderLayer(i, gen, device) for i in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5 * HIDDEN ** -0.5)

    def forward(self, input_ids, forward_batch):
        hidden_states = self.embed_tokens[input_ids]
        for layer in self.layers:
            hidden_states = layer.forward(hidden_states, forward_batch)
        return hidden_states @ self.lm_head          # next_token_logits


# --- distributed/parallel_state.py: graph_capture() (its capture side stream only) ---------------------------

@contextlib.contextmanager
def graph_capture(device):
    if torch.device(device).type != "cuda":
        yield None                                   # the emulation has one stream
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.current_stream().wait_stream(stream)


# --- model_executor/cuda_graph_runner.py ---------------------------------------------------------------------

class CudaGraphRunner:
    def __init__(self, model_runner: "ModelRunner"):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.graphs, self.output_buffers = {}, {}
        self.capture_bs = CUDA_GRAPH_BS
        self.max_bs = max(self.capture_bs)
        self.model_runner.attn_backend.init_cuda_graph_state(self.max_bs)
        self.seq_len_fill_value = self.model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32)
        # Graph inputs
        self.input_ids = torch.zeros((self.max_bs,), dtype=torch.int64, device=self.device)
        self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int32, device=self.device)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32, device=self.device)
        self.out_cache_loc = torch.zeros((self.max_bs,), dtype=torch.int64, device=self.device)
        self.graph_memory_pool = graph_pool_handle(self.device)
        self.capture()

    def can_run(self, forward_batch: ForwardBatch):
        return forward_batch.batch_size <= self.max_bs

    def capture(self):
        with graph_capture(self.device) as stream:
            self.stream = stream
            # Reverse the order to enable better memory sharing across cuda graphs.
            for bs in reversed(self.capture_bs):
                graph, output_buffers = self.capture_one_batch_size(bs, self.model_runner.model.forward)
                self.graphs[bs] = graph
                self.output_buffers[bs] = output_buffers

    def capture_one_batch_size(self, bs: int, forward):
        input_ids = self.input_ids[:bs]
        req_pool_indices = self.req_pool_indices[:bs]
        seq_lens = self.seq_lens[:bs]
        out_cache_loc = self.out_cache_loc[:bs]
        mr = self.model_runner
        forward_batch = ForwardBatch(ForwardMode.DECODE, bs, input_ids, req_pool_indices, seq_lens, out_cache_loc,
                                     0, mr.req_to_token_pool, mr.token_to_kv_pool, mr.attn_backend)
        # Attention backend (before the capture: the metadata's tensors are not the graph pool's)
        mr.attn_backend.init_forward_metadata_capture_cuda_graph(bs, bs, req_pool_indices, seq_lens, None,
                                                                forward_batch.forward_mode, None)

        def run_once():
            return forward(input_ids, forward_batch)

        kv = mr.token_to_kv_pool
        return capture(
            run_once, device=self.device, pool=self.graph_memory_pool, warmups=2, name=f"decode bs={bs}",
            owner="CudaGraphRunner", on_freed="reuse",
            static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                    "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc},
            state={**{f"k_buffer[{i}]": t for i, t in enumerate(kv.k_buffer)},
                   **{f"v_buffer[{i}]": t for i, t in enumerate(kv.v_buffer)}})

    def replay_prepare(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        bs = self.capture_bs[index]
        if bs != raw_bs:
            self.seq_lens.fill_(1)
            self.out_cache_loc.zero_()
        # Common inputs
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        if forward_batch.decode_seq_lens_cpu is not None:
            if bs != raw_bs:
                self.seq_lens_cpu.fill_(1)
            self.seq_lens_cpu[:raw_bs].copy_(forward_batch.decode_seq_lens_cpu)
        # Attention backend
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices, self.seq_lens, forward_batch.seq_lens_sum + (bs - raw_bs), None,
            forward_batch.forward_mode, None, seq_lens_cpu=self.seq_lens_cpu)
        self.raw_bs, self.bs = raw_bs, bs

    def replay(self, forward_batch: ForwardBatch):
        self.replay_prepare(forward_batch)
        bs, raw_bs = self.bs, self.raw_bs
        padded = None if bs == raw_bs else {            # padded rows left as they were (seq_lens, out_cache_loc
            "input_ids": self.input_ids[:bs],           # were neutralised by fill_(1) / zero_())
            "req_pool_indices": self.req_pool_indices[:bs]}
        next_token_logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded=padded)
        return next_token_logits[:raw_bs]


# --- model_executor/model_runner.py ---------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, variant, use_cuda_graph):
        self.device, self.page_size, self.context_len = device, PAGE_SIZE, CONTEXT_LEN
        self.model = ForCausalLM(device)
        self.req_to_token_pool = ReqToTokenPool(REQ_POOL_SIZE, CONTEXT_LEN, device)
        self.token_to_kv_pool = MHATokenToKVPool(NUM_PAGES * PAGE_SIZE, NUM_HEADS, HEAD_DIM, NUM_LAYERS, device)
        self.attn_backend = FlashAttentionBackend(self, variant)
        self.cuda_graph_runner = CudaGraphRunner(self) if use_cuda_graph else None

    def forward_decode(self, forward_batch: ForwardBatch):
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch)


# --- the workload -------------------------------------------------------------------------------------------------

# Requests: (req_pool_idx, its pages in the KV pool, prompt length).
REQUESTS = {"A": (1, [5, 2, 9, 11]), "B": (3, [7, 3, 10, 6]), "C": (4, [8, 1, 4, 15]), "D": (6, [11, 12, 13, 14])}
PROMPT_LENS = {"A": 5, "B": 9, "C": 2, "D": 6}
STEPS = [["A", "B", "C"], ["A", "B", "C"], ["A", "C"], ["A", "C", "D"], ["A", "B", "C", "D"]]


def run(variant: str, device: str = "cpu"):
    gen = generator(48550)
    num_slots = NUM_PAGES * PAGE_SIZE
    prefill_kv = [(randn(num_slots, NUM_HEADS, HEAD_DIM, gen=gen, device=device),
                   randn(num_slots, NUM_HEADS, HEAD_DIM, gen=gen, device=device)) for _ in range(NUM_LAYERS)]
    tokens = torch.randint(0, VOCAB, (len(STEPS), 4), generator=gen).tolist()

    def serve(use_cuda_graph: bool):
        runner = ModelRunner(device, variant, use_cuda_graph)
        for name, (idx, pages) in REQUESTS.items():
            # the request's token slots, page by page (the paged allocator), and its prompt's K/V
            row = [pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE for pos in range(CONTEXT_LEN)]
            runner.req_to_token_pool.req_to_token[idx].copy_(torch.tensor(row, dtype=torch.int32))
            slots = torch.tensor(row[:PROMPT_LENS[name]], device=device)
            for layer, (k, v) in enumerate(prefill_kv):
                runner.token_to_kv_pool.k_buffer[layer][slots] = k[slots]
                runner.token_to_kv_pool.v_buffer[layer][slots] = v[slots]
        lens = dict(PROMPT_LENS)
        outs = []
        for step, batch in enumerate(STEPS):
            for name in batch:
                lens[name] += 1                          # the token decoded this step
            seq_lens = torch.tensor([lens[n] for n in batch])
            req_pool_indices = torch.tensor([REQUESTS[n][0] for n in batch])
            out_cache_loc = runner.req_to_token_pool.req_to_token[req_pool_indices, seq_lens - 1].long()
            forward_batch = ForwardBatch(
                ForwardMode.DECODE, len(batch), torch.tensor(tokens[step][:len(batch)], device=device),
                req_pool_indices.to(device), seq_lens.to(device), out_cache_loc.to(device), int(seq_lens.sum()),
                runner.req_to_token_pool, runner.token_to_kv_pool, runner.attn_backend,
                decode_seq_lens_cpu=seq_lens.to(torch.int32))
            outs.append(runner.forward_decode(forward_batch).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
