"""SGLang's decode ``CudaGraphRunner`` on ROCm (``is_hip_``) appends the MI30x capture sizes 168..256 to the list of
batch sizes to capture *after* ``get_batch_sizes_to_capture`` has filtered that list down to what the request pool
(``--max-running-requests``) and ``--cuda-graph-max-bs`` allow. With a request pool smaller than 256 the runner then
captures batches larger than any batch the server can hold, and the Triton attention backend, whose ``kv_indptr``
buffer is sized in ``__init__`` for ``req_to_token_pool.size`` requests, cannot take the capture's prefix sums: the
capture of bs 168 fails and the server does not start; ``--disable-cuda-graph`` serves the same requests.

Upstream: https://github.com/sgl-project/sglang/pull/3857 ("fix capture_bs", sgl-project/sglang, by fsx950223, PR
description dated 2025-02-25, merged; commit 4606e2a3fe9f4199451f83aa7bf43b79875228f8 on main, "Bug: fix capture_bs
(#3857)", dated 2025-02-26, read in a stored mirror of the history, the fork zcnrex/sglang). Read: the full diff of that
commit (``python/sglang/srt/model_executor/cuda_graph_runner.py``, ``get_batch_sizes_to_capture``: the block
``if is_hip_: capture_bs += [i * 8 for i in range(21, 33)]`` moves from after the filter
``bs <= req_to_token_pool.size and bs <= cuda_graph_max_bs`` to before the pool-size adjustment); the PR description
in the stored issue corpus ("Move capture_bs to the correct place. Fix memory access issue when
``batch_size > max_running_requests``", with the command ``python3 -m sglang.bench_one_batch --batch-size 32 --input
128 --output 32 --model DeepSeek-V3 --tp 8 --trust-remote-code --max-running-requests 8``); the diff of #3420
(d81ac4434, 2025-02-11, "MI30x: More graph captures for larger batch sizes and concurrencies"), which added the HIP
block after the filter. At the parent (4606e2a3f^): ``cuda_graph_runner.py`` (``get_batch_sizes_to_capture``,
``CudaGraphRunner.__init__`` with its buffers sized by ``max(capture_bs)``, ``init_cuda_graph_state(max_num_token)``
and the ``Capture cuda graph failed`` wrapper, ``can_run``, ``capture`` in ascending order, ``capture_one_batch_size``
with two warmups and the global graph pool, ``replay`` with ``bisect_left`` padding, ``seq_lens.fill_(1)`` and
``out_cache_loc.zero_()``), ``layers/attention/triton_backend.py`` (``TritonAttnBackend.__init__``: ``max_bs =
model_runner.req_to_token_pool.size`` and ``kv_indptr`` of ``max_bs + 1``; ``init_forward_metadata``,
``init_cuda_graph_state``, ``init_forward_metadata_capture_cuda_graph`` and ``init_forward_metadata_replay_cuda_graph``
decode branches without speculative decoding; ``get_cuda_graph_seq_len_fill_value``; ``forward_decode``),
``create_flashinfer_kv_indices_triton`` (in ``flashinfer_backend.py``), ``model_runner.py`` (``init_memory_pool``:
``ReqToTokenPool(size=max_num_reqs + 1)`` with ``max_num_reqs = --max-running-requests``; ``init_cuda_graphs``;
``forward`` and ``forward_decode``), ``mem_cache/memory_pool.py`` (``ReqToTokenPool``; token slot 0 kept for padded
rows), ``server_args.py`` (``cuda_graph_max_bs`` defaults to 160 on large GPUs; the attention backend is ``triton``
where FlashInfer is not available, as on ROCm).
Not read: any issue or user log (the PR cites none; its "memory access issue" is not quoted with an error text), the
review thread, ``bench_one_batch`` beyond its model runner setup, the Triton ``decode_attention_fwd`` kernel (split-KV
with ``attn_logits``), DeepSeek-V3's MLA path and ``patch_model`` / torch.compile, the ROCm runtime itself.
Symptom: the PR: "Fix memory access issue when ``batch_size > max_running_requests``" on ROCm with
``--max-running-requests 8``. What the code at the parent does with such a pool (read, not run upstream): the capture
list becomes [1, 2, 4, 8, 9, 168, ..., 256]; capturing bs 168 writes 168 prefix sums into
``kv_indptr[1 : 169]`` of a 10-entry buffer, and start-up fails with "Capture cuda graph failed: The expanded size of
the tensor ... must match the existing size (168)". Whether the error the author saw was this one or a later memory
fault is a guess.
Mechanism: ``get_batch_sizes_to_capture`` first clips the default capture sizes ([1, 2, 4, 8, ..., 160]) to the pool
size (adding ``size - 1`` and ``size``) and to ``cuda_graph_max_bs``; the HIP block then appends 168..256
unconditionally. The runner sizes its own static buffers by ``max(capture_bs)`` and tells the backend
``init_cuda_graph_state(256)``, which sizes ``cuda_graph_kv_indices`` and ``attn_logits`` for 256 rows, but
``kv_indptr`` stays at the pool size + 1 that ``__init__`` gave it. Capturing in ascending order, the graphs up to the
pool size are captured; at bs 168 ``init_forward_metadata_capture_cuda_graph`` runs
``kv_indptr[1 : bs + 1] = torch.cumsum(seq_lens, dim=0)`` on a slice of ``pool size`` entries: a shape error. Eager
decode never has more requests than the pool, so it never meets the short buffer.
Doctor: undersized-buffer, at get_batch_sizes_to_capture. The capture sizes it hands the runner do not fit a static
buffer the attention backend sized for the request pool; it is the function that decides the graph sizes and the one
the fix changes (the error itself shows in ``init_forward_metadata_capture_cuda_graph``).
Fix (upstream): append the HIP sizes before the pool-size adjustment and the filter, so sizes above
``req_to_token_pool.size`` or ``cuda_graph_max_bs`` are dropped like the others.
Modelled: ``ServerArgs`` (the fields read), ``is_hip_``, ``get_batch_sizes_to_capture`` (bug and fix as in the diff),
``ReqToTokenPool``, ``MHATokenToKVPool.set_kv_buffer``, ``ForwardMode``, ``ForwardBatch``, ``LogitsProcessorOutput``,
``create_flashinfer_kv_indices_triton``, ``decode_attention_fwd``, ``TritonAttnBackend`` (``__init__`` buffers,
``init_forward_metadata`` / ``init_cuda_graph_state`` / ``init_forward_metadata_capture_cuda_graph`` /
``init_forward_metadata_replay_cuda_graph`` decode branches, ``get_cuda_graph_seq_len_fill_value``,
``forward_decode``), ``RadixAttention``, ``CudaGraphRunner`` (``__init__``, ``can_run``, ``capture``,
``capture_one_batch_size``, ``replay``), ``ModelRunner`` (``init_memory_pool`` sizes, ``init_cuda_graphs``,
``forward``, ``forward_decode``).
Stand-ins: ``is_hip_`` is set (the program stands for the ROCm build; nothing else of ROCm is modelled);
``create_flashinfer_kv_indices_triton`` and ``decode_attention_fwd`` in torch (page size 1, one pass instead of
split-KV, so ``attn_logits`` is allocated but not used; the attention reads its indptr on the device, without a host
sync); a two-layer decoder (token embedding, RMSNorm, q/k/v with neox rotary embedding, two heads of width 8, an MLP,
``lm_head``) in float64 instead of DeepSeek-V3, its linear layers written as a product and a sum over the input
dimension so that a row's result does not depend on the batch's row count (a BLAS matmul does, by its kernel
choice); int64 index tensors (upstream int32); ``graph_capture()``, tqdm, the TP barriers and ``patch_model`` left
out; the global graph memory pool is one ``graph_pool_handle``.
Workload: ``--max-running-requests 6`` (a pool of 7 request slots, 16 token slots each; KV slot 0 reserved), default
capture sizes, ``cuda_graph_max_bs`` 160. The server starts (its graphs captured), then the requests' prefixes are in
the KV pool (random keys and values) and five decode steps run: 3 requests (the bs-4 graph, one padded row), 5 (bs 6,
one padded row), 6, 2, 1. Output per step: the real rows' next-token logits; the same server with
``--disable-cuda-graph`` is the reference.
Measured: bug: misbehaves (raised Exception: Capture cuda graph failed: The expanded size of the tensor (7) must
match the existing size (168) at non-singleton dimension 0.  Target sizes: [7].  Tensor sizes: [168]); the graphs
of bs 1, 2, 4, 6 and 7 were captured before it and no step is served. Fix: capture sizes [1, 2, 4, 6, 7], equals
eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
import math

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/3857"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "get_batch_sizes_to_capture"
SYMPTOM = ("ROCm decode CUDA graphs with --max-running-requests below 256: the MI30x capture sizes 168..256 are added "
           "after the pool-size filter, the capture of bs 168 overflows the Triton backend's kv_indptr sized by the "
           "request pool, and the server fails at start-up")

is_hip_ = True                    # the ROCm build (sglang.srt.utils.is_hip())
MAX_RUNNING_REQUESTS = 6          # --max-running-requests: ReqToTokenPool(size=max_num_reqs + 1)
CONTEXT_LEN = 12
MAX_CONTEXT_LEN = CONTEXT_LEN + 4                        # req_to_token width (model context + 4)
NUM_KV_SLOTS = 1 + (MAX_RUNNING_REQUESTS + 1) * MAX_CONTEXT_LEN   # token slot 0: the padded rows' dump slot
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, NUM_LAYERS, INTERMEDIATE = 32, 16, 2, 8, 2, 32
NUM_KV_SPLITS = 8                 # --triton-attention-num-kv-splits
DTYPE = torch.float64

_variant = "bug"


# --- sglang/srt/server_args.py, mem_cache/memory_pool.py, model_executor/forward_batch_info.py (reduced) --------------

@dataclasses.dataclass
class ServerArgs:
    cuda_graph_bs: list | None = None
    cuda_graph_max_bs: int = 160            # the default on a GPU with more than 25 GB
    disable_cuda_graph_padding: bool = False
    disable_cuda_graph: bool = False
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    max_running_requests: int = MAX_RUNNING_REQUESTS


class ReqToTokenPool:
    def __init__(self, size, max_context_len, device):
        self.size = size
        self.max_context_len = max_context_len
        # every request owns its token slots (slot 0 is never handed to a request)
        self.req_to_token = (1 + torch.arange(size * max_context_len)).view(size, max_context_len).to(device)


class MHATokenToKVPool:
    def __init__(self, size, head_num, head_dim, layer_num, device):
        self.k_buffer = [torch.zeros(size, head_num, head_dim, dtype=DTYPE, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(size, head_num, head_dim, dtype=DTYPE, device=device) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    IDLE = enum.auto()

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_decode_or_idle(self):
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_cuda_graph(self):
        return self == ForwardMode.DECODE


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    attn_backend: "TritonAttnBackend"
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    positions: torch.Tensor
    spec_info: object = None


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor | None = None


# --- Triton kernels (torch stand-ins) ---------------------------------------------------------------------------------

def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, page_kernel_lens, kv_indptr, kv_start_idx,
                                        kv_indices_ptr, req_to_token_ptr_stride):
    """One program per request b: kv_indices[kv_indptr[b] + j] = req_to_token[req_pool_indices[b], j], j < lens[b]."""
    bs = req_pool_indices.shape[0]
    j = torch.arange(req_to_token_ptr_stride, device=req_to_token.device)
    rows = req_to_token[req_pool_indices]
    valid = j[None, :] < page_kernel_lens[:bs, None]
    dst = kv_indptr[:bs, None] + j[None, :]
    kv_indices_ptr[dst[valid]] = rows[valid]


def decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, num_kv_splits, sm_scale,
                         logit_cap=0.0):
    """One query token b attends the slots kv_indices[kv_indptr[b] : kv_indptr[b + 1]] (one pass, no split-KV)."""
    bs = q.shape[0]
    p = torch.arange(MAX_CONTEXT_LEN, device=q.device)
    lens = kv_indptr[1: bs + 1] - kv_indptr[:bs]
    valid = p[None, :] < lens[:, None]
    idx = (kv_indptr[:bs, None] + p[None, :]).clamp(max=kv_indices.shape[0] - 1)
    loc = torch.where(valid, kv_indices[idx], 0)
    scores = torch.einsum("bhd,bphd->bhp", q, k_buffer[loc]) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    o.copy_(torch.einsum("bhp,bphd->bhd", torch.softmax(scores, dim=-1), v_buffer[loc]))


# --- sglang/srt/layers/attention/triton_backend.py (reduced: decode, no speculative decoding) -------------------------

class TritonAttnBackend:
    def __init__(self, model_runner, skip_prefill: bool = False, kv_indptr_buf=None):
        self.decode_attention_fwd = decode_attention_fwd
        self.skip_prefill = skip_prefill
        max_bs = model_runner.req_to_token_pool.size
        if kv_indptr_buf is None:
            self.kv_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=model_runner.device)
        else:
            self.kv_indptr = kv_indptr_buf
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.num_head = NUM_HEADS
        self.num_kv_splits = NUM_KV_SPLITS
        self.v_head_dim = model_runner.token_to_kv_pool.get_value_buffer(0).shape[-1]
        self.forward_metadata = None
        self.max_context_len = MAX_CONTEXT_LEN
        self.device = model_runner.device

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager decode: at most ``req_to_token_pool.size`` requests."""
        bs = forward_batch.batch_size
        kv_indptr = self.kv_indptr
        assert forward_batch.forward_mode.is_decode_or_idle() and forward_batch.spec_info is None
        kv_indptr[1: bs + 1] = torch.cumsum(forward_batch.seq_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = torch.zeros(forward_batch.seq_lens_sum, dtype=torch.int64, device=self.device)
        create_flashinfer_kv_indices_triton(self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                            kv_indptr, None, kv_indices, self.req_to_token.stride(0))
        attn_logits = torch.zeros((bs, self.num_head, self.num_kv_splits, self.v_head_dim + 1), dtype=torch.float32,
                                  device=self.device)
        self.forward_metadata = (attn_logits, None, kv_indptr, kv_indices, None, None, None)

    def init_cuda_graph_state(self, max_bs: int, kv_indices_buf=None):
        self.cuda_graph_attn_logits = torch.zeros((max_bs, self.num_head, self.num_kv_splits, self.v_head_dim + 1),
                                                  dtype=torch.float32, device=self.device)
        if kv_indices_buf is None:
            self.cuda_graph_kv_indices = torch.zeros((max_bs * self.max_context_len), dtype=torch.int64,
                                                     device=self.device)
        else:
            self.cuda_graph_kv_indices = kv_indices_buf

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        assert encoder_lens is None, "Not supported"
        assert forward_mode.is_decode_or_idle() and spec_info is None
        kv_indptr = self.kv_indptr
        kv_indptr[1: bs + 1] = torch.cumsum(seq_lens, dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        kv_indices = self.cuda_graph_kv_indices
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, kv_indptr, None,
                                            kv_indices, self.req_to_token.stride(0))
        self.forward_metadata = (self.cuda_graph_attn_logits, None, kv_indptr, kv_indices, None, None, None)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info):
        assert forward_mode.is_decode_or_idle() and spec_info is None
        kv_indptr = self.kv_indptr
        kv_indices = self.cuda_graph_kv_indices
        kv_indptr[1: bs + 1] = torch.cumsum(seq_lens[:bs], dim=0)
        kv_indptr = kv_indptr[: bs + 1]
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices[:bs], seq_lens[:bs], kv_indptr, None,
                                            kv_indices, self.req_to_token.stride(0))

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True):
        o = torch.empty_like(q)
        attn_logits, _, kv_indptr, kv_indices, _, _, _ = self.forward_metadata
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        self.decode_attention_fwd(q, forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                  forward_batch.token_to_kv_pool.get_value_buffer(layer.layer_id), o, kv_indptr,
                                  kv_indices, attn_logits, self.num_kv_splits, layer.scaling)
        return o


# --- a two-layer decoder (stand-in for the served model) --------------------------------------------------------------

class RadixAttention:
    def __init__(self, layer_id):
        self.layer_id = layer_id
        self.scaling = 1.0 / math.sqrt(HEAD_DIM)

    def forward(self, q, k, v, forward_batch: ForwardBatch):
        return forward_batch.attn_backend.forward_decode(q, k, v, self, forward_batch)


def linear(x, weight):
    """``x @ weight`` as a product and a sum over the input dimension: each row's result does not depend on how many
    rows the batch has (a BLAS matmul picks its kernel by the row count, so a padded batch could round differently)."""
    return (x.unsqueeze(-1) * weight).sum(-2)


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(3857)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.layers = [dict(input_norm=1.0 + r(HIDDEN, scale=0.1), qkv=r(HIDDEN, 3 * HIDDEN), o=r(HIDDEN, HIDDEN),
                            post_norm=1.0 + r(HIDDEN, scale=0.1), gate_up=r(HIDDEN, 2 * INTERMEDIATE),
                            down=r(INTERMEDIATE, HIDDEN), attn=RadixAttention(i)) for i in range(NUM_LAYERS)]
        self.norm = 1.0 + r(HIDDEN, scale=0.1)
        self.lm_head = r(VOCAB, HIDDEN, scale=1.0)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE) / HEAD_DIM))
        freqs = torch.outer(torch.arange(MAX_CONTEXT_LEN, dtype=DTYPE), inv_freq)
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)

    def rotary_emb(self, positions, x):
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        hidden_states = self.embed_tokens[input_ids]
        for layer in self.layers:
            x = rms_norm(hidden_states, layer["input_norm"])
            q, k, v = linear(x, layer["qkv"]).view(-1, 3, NUM_HEADS, HEAD_DIM).unbind(1)
            q, k = self.rotary_emb(positions, q), self.rotary_emb(positions, k)
            attn_output = layer["attn"].forward(q, k, v, forward_batch)
            hidden_states = hidden_states + linear(attn_output.reshape(-1, HIDDEN), layer["o"])
            gate, up = linear(rms_norm(hidden_states, layer["post_norm"]), layer["gate_up"]).chunk(2, dim=-1)
            hidden_states = hidden_states + linear(torch.nn.functional.silu(gate) * up, layer["down"])
        hidden_states = rms_norm(hidden_states, self.norm)
        return LogitsProcessorOutput(next_token_logits=linear(hidden_states, self.lm_head.T))


# --- sglang/srt/model_executor/cuda_graph_runner.py (reduced) ---------------------------------------------------------

def get_batch_sizes_to_capture(model_runner):
    server_args = model_runner.server_args
    capture_bs = server_args.cuda_graph_bs
    if capture_bs is None:
        if server_args.disable_cuda_graph_padding:
            capture_bs = list(range(1, 33)) + [64, 128]
        else:
            capture_bs = [1, 2, 4] + [i * 8 for i in range(1, 21)]

    if _variant == "fix" and is_hip_:
        capture_bs += [i * 8 for i in range(21, 33)]

    if max(capture_bs) > model_runner.req_to_token_pool.size:
        # In some case (e.g., with a small GPU or --max-running-requests), the #max-running-requests
        # is very small. We add more values here to make sure we capture the maximum bs.
        capture_bs = list(sorted(set(capture_bs + [model_runner.req_to_token_pool.size - 1]
                                     + [model_runner.req_to_token_pool.size])))
    capture_bs = [bs for bs in capture_bs
                  if bs <= model_runner.req_to_token_pool.size and bs <= server_args.cuda_graph_max_bs]
    if _variant == "bug" and is_hip_:
        capture_bs += [i * 8 for i in range(21, 33)]
    compile_bs = ([bs for bs in capture_bs if bs <= server_args.torch_compile_max_bs]
                  if server_args.enable_torch_compile else [])
    return capture_bs, compile_bs


global_graph_memory_pool = None


class CudaGraphRunner:
    """A CudaGraphRunner runs the forward pass of a model with cuda graph."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.graphs, self.output_buffers = {}, {}
        self.disable_padding = model_runner.server_args.disable_cuda_graph_padding

        # Batch sizes to capture
        self.capture_bs, self.compile_bs = get_batch_sizes_to_capture(model_runner)
        self.capture_forward_mode = ForwardMode.DECODE
        self.num_tokens_per_bs = 1

        # Attention backend
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.model_runner.attn_backend.init_cuda_graph_state(self.max_num_token)
        self.seq_len_fill_value = self.model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()

        # Graph inputs
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros((self.max_num_token,), **i64)
        self.req_pool_indices = torch.zeros((self.max_bs,), **i64)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, **i64)
        self.out_cache_loc = torch.zeros((self.max_num_token,), **i64)
        self.positions = torch.zeros((self.max_num_token,), **i64)

        backend, kv_pool = self.model_runner.attn_backend, self.model_runner.token_to_kv_pool
        events.static_buffers("CudaGraphRunner", {
            "input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens,
            "out_cache_loc": self.out_cache_loc, "positions": self.positions, "kv_indptr": backend.kv_indptr,
            "cuda_graph_kv_indices": backend.cuda_graph_kv_indices})
        events.persistent_state("CudaGraphRunner", {
            **{f"k_buffer[{i}]": b for i, b in enumerate(kv_pool.k_buffer)},
            **{f"v_buffer[{i}]": b for i, b in enumerate(kv_pool.v_buffer)}})

        # Capture
        try:
            self.capture()
        except RuntimeError as e:
            raise Exception(
                f"Capture cuda graph failed: {e}\n"
                "Possible solutions:\n"
                "1. disable cuda graph by --disable-cuda-graph\n"
                "2. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
                "3. disable torch compile by not using --enable-torch-compile\n"
                "4. set --cuda-graph-max-bs to a smaller value (e.g., 32)\n") from e

    def can_run(self, forward_batch: ForwardBatch):
        return (forward_batch.batch_size in self.graphs if self.disable_padding
                else forward_batch.batch_size <= self.max_bs)

    def capture(self):
        for bs in self.capture_bs:
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, self.model_runner.model.forward)

    def capture_one_batch_size(self, bs: int, forward):
        global global_graph_memory_pool
        num_tokens = bs * self.num_tokens_per_bs
        input_ids = self.input_ids[:num_tokens]
        req_pool_indices = self.req_pool_indices[:bs]
        seq_lens = self.seq_lens[:bs]
        forward_batch = ForwardBatch(
            forward_mode=self.capture_forward_mode, batch_size=bs, input_ids=input_ids,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens,
            req_to_token_pool=self.model_runner.req_to_token_pool,
            token_to_kv_pool=self.model_runner.token_to_kv_pool, attn_backend=self.model_runner.attn_backend,
            out_cache_loc=self.out_cache_loc[:num_tokens], seq_lens_sum=int(seq_lens.sum()),
            positions=self.positions[:num_tokens])

        # Attention backend
        self.model_runner.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, num_tokens, req_pool_indices, seq_lens, None, forward_batch.forward_mode, forward_batch.spec_info)

        # Run and capture
        def run_once():
            logits_output = forward(input_ids, forward_batch.positions, forward_batch)
            return logits_output.next_token_logits

        if global_graph_memory_pool is None:
            global_graph_memory_pool = graph_pool_handle(self.device)
        return capture(run_once, device=self.device, pool=global_graph_memory_pool, warmups=2,
                       owner="CudaGraphRunner", name=f"decode bs={bs}")

    def replay(self, forward_batch: ForwardBatch):
        assert forward_batch.out_cache_loc is not None
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs

        # Pad
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        bs = self.capture_bs[index]
        if bs != raw_bs:
            self.seq_lens.fill_(1)
            self.out_cache_loc.zero_()

        # Common inputs
        self.input_ids[:raw_num_token].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_num_token].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_num_token].copy_(forward_batch.positions)

        # Attention backend
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices, self.seq_lens, forward_batch.seq_lens_sum + (bs - raw_bs), None,
            forward_batch.forward_mode, forward_batch.spec_info)

        # Replay (padded rows of input_ids / req_pool_indices / positions keep an earlier step's values)
        next_token_logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs,
                                   padded={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                                           "positions": self.positions})
        return LogitsProcessorOutput(next_token_logits=next_token_logits[:raw_num_token])


# --- sglang/srt/model_executor/model_runner.py (reduced) --------------------------------------------------------------

class ModelRunner:
    def __init__(self, server_args: ServerArgs, device):
        self.server_args, self.device = server_args, device
        self.model = LlamaForCausalLM(device)
        self.init_memory_pool(server_args.max_running_requests)
        self.attn_backend = TritonAttnBackend(self)
        self.init_cuda_graphs()

    def init_memory_pool(self, max_num_reqs):
        self.req_to_token_pool = ReqToTokenPool(size=max_num_reqs + 1, max_context_len=MAX_CONTEXT_LEN,
                                                device=self.device)
        self.token_to_kv_pool = MHATokenToKVPool(NUM_KV_SLOTS, NUM_HEADS, HEAD_DIM, NUM_LAYERS, self.device)

    def init_cuda_graphs(self):
        self.cuda_graph_runner = None
        if self.server_args.disable_cuda_graph:
            return
        self.cuda_graph_runner = CudaGraphRunner(self)

    def forward_decode(self, forward_batch: ForwardBatch):
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if (forward_batch.forward_mode.is_cuda_graph() and self.cuda_graph_runner
                and self.cuda_graph_runner.can_run(forward_batch)):
            return self.cuda_graph_runner.replay(forward_batch)
        return self.forward_decode(forward_batch)


# request slots and seq_lens (including the token decoded at this step) of each decode step
STEPS = (([0, 2, 5], [4, 7, 3]), ([0, 1, 2, 3, 5], [5, 6, 8, 2, 4]), ([0, 1, 2, 3, 4, 5], [6, 7, 9, 3, 5, 5]),
         ([1, 4], [8, 6]), ([2], [10]))


def _serve(device, use_cuda_graph):
    global global_graph_memory_pool
    global_graph_memory_pool = None
    model_runner = ModelRunner(ServerArgs(disable_cuda_graph=not use_cuda_graph), device)
    # the requests' prefixes, prefilled after start-up
    gen = generator(25)
    kv_pool = model_runner.token_to_kv_pool
    for buf in kv_pool.k_buffer + kv_pool.v_buffer:
        buf[1:] = randn(NUM_KV_SLOTS - 1, NUM_HEADS, HEAD_DIM, gen=gen, device=device).to(DTYPE)
    req_to_token = model_runner.req_to_token_pool.req_to_token
    outs = []
    for reqs, seq_lens in STEPS:
        bs = len(reqs)
        req_pool_indices = torch.tensor(reqs, device=device)
        seq_lens_t = torch.tensor(seq_lens, device=device)
        positions = seq_lens_t - 1
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=torch.randint(0, VOCAB, (bs,), generator=gen).to(device), req_pool_indices=req_pool_indices,
            seq_lens=seq_lens_t, req_to_token_pool=model_runner.req_to_token_pool, token_to_kv_pool=kv_pool,
            attn_backend=model_runner.attn_backend, out_cache_loc=req_to_token[req_pool_indices, positions],
            seq_lens_sum=int(sum(seq_lens)), positions=positions)
        logits_output = model_runner.forward(forward_batch)
        outs.append(logits_output.next_token_logits.clone())     # the sampler reads them before the next step
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
