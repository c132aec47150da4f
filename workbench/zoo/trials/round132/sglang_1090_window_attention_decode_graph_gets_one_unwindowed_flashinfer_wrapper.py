"""SGLang's Gemma-2 window attention (#1056) gives the FlashInfer backend two decode wrappers, ``[0]`` planned on each request's last ``window`` tokens for the sliding-window layers and ``[1]`` on the whole context for the global ones, but the decode ``CudaGraphRunner`` still builds one ``BatchDecodeWithPagedKVCacheWrapper`` per captured batch and plans it through ``update_flashinfer_indices`` without the window: the captured step's metadata is not the eager step's, and the first sliding-window layer of the capture's first warmup indexes that single wrapper with ``[0]`` and raises ``TypeError``, so the server cannot start with CUDA graphs.

Upstream: https://github.com/sgl-project/sglang/pull/1090 ("[Fix] Compatibility of window attention and cuda graph",
sgl-project/sglang, by Ying1123 (Ying Sheng), description dated 2024-08-14, merged; commit
96a2093ef021b7fb10cf727050e0c87494c5463a, 2024-08-14, read in a stored mirror of the history, the fork zcnrex/sglang).
Read: the PR description ("Address additional review comments from #1056"); the full diff of 96a2093ef
(``model_executor/cuda_graph_runner.py``: ``__init__`` keeps two workspace buffers and clones ``flashinfer_kv_indptr`` /
``flashinfer_kv_indices`` into two-entry lists when ``model_runner.sliding_window_size`` is set, and
``capture_one_batch_size`` then builds two cuda-graph decode wrappers on them; ``forward_batch_info.py``:
``update_flashinfer_indices`` drops its ``sliding_window_size`` parameter, reads ``model_runner.sliding_window_size``,
and ``from_schedule_batch`` / ``init_flashinfer_handlers`` stop passing it; ``model_runner.py``: ``sliding_window_size``
is set in ``load_model`` instead of ``init_flashinfer`` and the three ``from_schedule_batch`` calls drop it;
``server_args.py``: the line ``self.disable_cuda_graph = True`` in the Gemma-2 block of ``check_server_args`` goes;
``radix_attention.py``: a new ``reuse`` flag that skips the KV store; ``test/runners.py``: a file rename). At the parent
(96a2093ef^), whole: ``cuda_graph_runner.py`` (``CudaGraphRunner.__init__``, ``can_run``, ``capture``,
``capture_one_batch_size`` with two warmups and a shared memory pool, ``replay`` with its padding),
``forward_batch_info.py`` (``InputMetadata``, ``compute_positions``, ``from_schedule_batch``,
``init_flashinfer_handlers``, ``update_flashinfer_indices``, both branches), ``radix_attention.py``
(``decode_forward_flashinfer``, ``store_kv_cache``), ``model_runner.py`` (``init_flashinfer``, ``init_cuda_graphs``,
``forward_decode``) and ``models/gemma2.py`` (``get_window_size``, the alternating ``use_sliding_window = layer_idx % 2
== 0``, ``Gemma2Attention`` / ``Gemma2DecoderLayer`` / ``Gemma2Model.forward``); the diff of #1056 (0909bb0d2), which
added the two wrappers, the window branch of ``update_flashinfer_indices`` and the Gemma-2 block of
``ServerArgs.check_server_args`` (called by ``launch_server``) that forces ``disable_cuda_graph = True``; and
FlashInfer's ``python/flashinfer/decode.py`` at a7ee5662b (2024-08-13): ``BatchDecodeWithPagedKVCacheWrapper.__init__``
(cuda-graph mode keeps the caller's indptr / indices / last-page-len buffers, batch size fixed), ``begin_forward``
(cuda-graph mode copies the plan into those buffers, otherwise keeps references), ``end_forward`` and ``forward``.
Not read: an issue thread (none is linked; #1056's review comments themselves), the FlashInfer CUDA kernels and the C++
plan, vLLM's ``graph_capture``, ``Gemma2MLP`` / ``GemmaRMSNorm`` / ``GemmaRotaryEmbedding`` internals, the prefill
(extend) paths, the ``reuse`` flag's user.
Symptom: no report is linked; the PR only says it addresses review comments of #1056. #1056 had shipped window attention
with CUDA graphs forced off for model paths containing ``gemma-2`` ("When using sliding window in gemma-2, disable
radix_cache, regex_jump_forward, and turn on flashinfer"), and #1090 removes that override and makes the graph path
work. What a run with graphs does at the parent is read off the code, not quoted (a guess as far as users go): the
override matches the model path only, so a Gemma-2 checkpoint served from a directory whose name lacks ``gemma-2`` (as
modelled, ``/models/g2-tiny``) keeps CUDA graphs on, and start-up fails in ``CudaGraphRunner.capture`` with ``TypeError:
'BatchDecodeWithPagedKVCacheWrapper' object is not subscriptable`` from ``decode_forward_flashinfer``
(``init_cuda_graphs`` wraps only ``RuntimeError``); without graphs decode is fine.
Mechanism: eager decode goes through ``InputMetadata.from_schedule_batch(..., sliding_window_size=...)``, whose
``update_flashinfer_indices`` takes the window branch: wrapper 0 is planned on ``kv_indices`` from ``seq_len -
min(seq_len, window)`` on, wrapper 1 on the whole context, and ``decode_forward_flashinfer`` picks ``[0]`` for a layer
with ``sliding_window_size != -1`` and ``[1]`` otherwise. The graph runner builds its own metadata for the capture: one
cuda-graph wrapper over its static ``flashinfer_kv_indptr`` / ``flashinfer_kv_indices`` buffers, planned by
``update_flashinfer_indices(..., flashinfer_decode_wrapper)`` with no window (the full-context branch), and hands it to
the captured ``run_once``. The step the capture records is therefore not the eager step: the first sliding-window layer
(layer 0) subscripts the single wrapper in the capture's first warmup and raises; had it not raised, every
sliding-window layer would read the whole context instead of the window (``replay`` too plans the single wrapper without
the window).
Doctor: warmup-divergence, at capture_one_batch_size. The captured step takes another path than the eager step (one
unwindowed wrapper and plan instead of the windowed pair), and the divergence shows as an error only the warmup/capture
of the graph path meets; ``capture_one_batch_size`` is where the graph runner builds the capture's decode wrappers and
plans them, and where the fix builds the two windowed cuda-graph wrappers (``update_flashinfer_indices``, which picks
the branch from what its caller passes, is the other half of the fix).
Fix (upstream): ``capture_one_batch_size`` builds two cuda-graph wrappers on two sets of static indptr / indices buffers
(sharing the last-page-len buffer) when the model has a window, ``update_flashinfer_indices`` reads the window from the
model runner, so capture and replay plan wrapper 0 on the window as eager does, and the Gemma-2 override no longer turns
CUDA graphs off.
Modelled: ``ServerArgs.check_server_args`` (the Gemma-2 block), ``ReqToTokenPool``, ``MHATokenToKVPool``
(``get_key_buffer`` / ``get_value_buffer`` / ``get_kv_buffer``), ``ForwardMode``, ``InputMetadata``
(``from_schedule_batch``, ``compute_positions``, ``init_flashinfer_handlers``), ``update_flashinfer_indices`` (decode,
both branches), FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (``__init__``, ``begin_forward``, ``end_forward``,
``forward``), ``RadixAttention`` (``decode_forward_flashinfer``, ``store_kv_cache``, ``forward``), ``get_window_size``,
``Gemma2Attention``, ``Gemma2DecoderLayer``, ``Gemma2Model``, ``Gemma2ForCausalLM.get_window_size``, ``ModelRunner``
(``init_flashinfer``, ``init_cuda_graphs``, ``forward_decode``), ``CudaGraphRunner`` (``__init__``, ``can_run``,
``capture``, ``capture_one_batch_size``, ``replay``).
Stand-ins: FlashInfer's decode kernel is a torch gather-and-softmax over at most ``MAX_CONTEXT_LEN`` pages of size 1,
with logits soft-capping; a request with no pages (a padded row, ``seq_len`` 0) gives zeros (what the kernel returns
there was not read); no split-KV plan, no tensor cores, the workspace buffers are tiny placeholders. The model is two
layers (layer 0 sliding window, layer 1 global, as Gemma-2 alternates) with one RMS norm before attention, a plain
rotary embedding, no MLP, an lm head tied to the embedding, float64; no tensor parallelism, no torch.compile, no vLLM
``graph_capture`` stream, int64 index tensors. No prefill is run: the KV pool starts filled with random keys and values.
``check_server_args`` is called by the workload, standing for ``launch_server``; the fix sets ``sliding_window_size`` in
``ModelRunner.__init__``, standing for ``load_model``; the linear layers multiply row by row (no batched GEMM, whose
rounding would depend on the padded batch size); no ``patch_model``.
Workload: ``config.sliding_window`` 4 (window 3), contexts of 5 to 10 tokens, capture sizes [1, 2, 4] (``can_run``:
fewer than 4 requests). Three decode steps: 3 requests (the bs-4 graph, one padded row), 2 requests, 3 requests. Output
per step: the real rows' logits.
Measured: bug: misbehaves, raised TypeError at the capture of bs 1 ("'BatchDecodeWithPagedKVCacheWrapper' object is not
subscriptable", in ``decode_forward_flashinfer`` of layer 0, first warmup); no step is served. Fix: equals eager (max
|graph - eager| = 0). The window matters on this workload: run without graphs with the window widened past every
context, the logits move by up to 4.0.
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
import math

import torch
from torch import nn

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/1090"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "capture_one_batch_size"
SYMPTOM = ("Gemma-2 window attention with CUDA graphs: the decode graph runner builds one FlashInfer decode wrapper "
           "planned without the window, the sliding-window layer indexes it as the eager pair, and capture fails")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM = 16, 16, 2, 8
SLIDING_WINDOW = 4                 # config.sliding_window; get_window_size gives 3
LOGIT_CAP = 50.0                   # config.attn_logit_softcapping
NUM_LAYERS = 2
MAX_REQS, MAX_CONTEXT_LEN = 4, 12
NUM_KV_SLOTS = 1 + MAX_REQS * MAX_CONTEXT_LEN      # slot 0: where padded rows write (out_cache_loc zeroed)
BATCH_SIZE_LIST = [1, 2, 4]
DTYPE = torch.float64

_variant = "bug"


# --- sglang/srt/server_args.py, mem_cache/memory_pool.py, forward_batch_info.py (reduced) -----------------------------

@dataclasses.dataclass
class ServerArgs:
    model_path: str
    disable_cuda_graph: bool = False
    disable_flashinfer: bool = False

    def check_server_args(self):
        if "gemma-2" in self.model_path.lower():
            # "When using sliding window in gemma-2, disable radix_cache, regex_jump_forward, and turn on flashinfer."
            self.disable_flashinfer = False
            if _variant == "bug":
                self.disable_cuda_graph = True


class ReqToTokenPool:
    def __init__(self, req_to_token):
        self.req_to_token = req_to_token


class MHATokenToKVPool:
    def __init__(self, k_buffer, v_buffer):
        self.k_buffer, self.v_buffer = k_buffer, v_buffer

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()


@dataclasses.dataclass
class ScheduleBatch:
    reqs: list
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    position_ids_offsets: torch.Tensor
    out_cache_loc: torch.Tensor


@dataclasses.dataclass
class InputMetadata:
    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    out_cache_loc: torch.Tensor
    positions: torch.Tensor = None
    flashinfer_decode_wrapper: object = None

    def compute_positions(self, batch):
        self.positions = (self.seq_lens - 1).to(torch.int64)

    @classmethod
    def from_schedule_batch(cls, model_runner, batch, forward_mode, sliding_window_size=None):
        ret = cls(forward_mode=forward_mode, batch_size=len(batch.reqs), req_pool_indices=batch.req_pool_indices,
                  seq_lens=batch.seq_lens, req_to_token_pool=model_runner.req_to_token_pool,
                  token_to_kv_pool=model_runner.token_to_kv_pool, out_cache_loc=batch.out_cache_loc)
        ret.compute_positions(batch)
        ret.init_flashinfer_handlers(model_runner, None, False, sliding_window_size)
        return ret

    def init_flashinfer_handlers(self, model_runner, prefix_lens, flashinfer_use_ragged, sliding_window_size=None):
        if _variant == "bug":
            update_flashinfer_indices(self.forward_mode, model_runner, self.req_pool_indices, self.seq_lens,
                                      prefix_lens, flashinfer_use_ragged=flashinfer_use_ragged,
                                      sliding_window_size=sliding_window_size)
        else:
            update_flashinfer_indices(self.forward_mode, model_runner, self.req_pool_indices, self.seq_lens,
                                      prefix_lens, flashinfer_use_ragged=flashinfer_use_ragged)
        self.flashinfer_decode_wrapper = model_runner.flashinfer_decode_wrapper


def update_flashinfer_indices(forward_mode, model_runner, req_pool_indices, seq_lens, prefix_lens,
                              flashinfer_decode_wrapper=None, flashinfer_use_ragged=False, sliding_window_size=None):
    """Decode part only (``forward_mode`` is DECODE here; the extend branches are not modelled)."""
    if _variant == "fix":
        sliding_window_size = model_runner.sliding_window_size
    device = seq_lens.device
    batch_size = len(req_pool_indices)
    req_to_token = model_runner.req_to_token_pool.req_to_token
    if sliding_window_size is None:
        paged_kernel_lens = seq_lens
        kv_indptr = torch.zeros((batch_size + 1,), dtype=torch.int64, device=device)
        kv_indptr[1:] = torch.cumsum(paged_kernel_lens, dim=0)
        req_pool_indices_cpu = req_pool_indices.cpu().numpy()
        paged_kernel_lens_cpu = paged_kernel_lens.cpu().numpy()
        kv_indices = torch.cat([req_to_token[req_pool_indices_cpu[i], : paged_kernel_lens_cpu[i]]
                                for i in range(batch_size)], dim=0).contiguous()
        kv_last_page_len = torch.ones((batch_size,), dtype=torch.int64, device=device)
        # CUDA graph uses different flashinfer_decode_wrapper
        if flashinfer_decode_wrapper is None:
            flashinfer_decode_wrapper = model_runner.flashinfer_decode_wrapper
        flashinfer_decode_wrapper.end_forward()
        flashinfer_decode_wrapper.begin_forward(kv_indptr, kv_indices, kv_last_page_len, NUM_HEADS, NUM_HEADS,
                                                HEAD_DIM, 1)
    else:
        kv_last_page_len = torch.ones((batch_size,), dtype=torch.int64, device=device)
        for wrapper_id in range(2):
            paged_kernel_lens = seq_lens
            if wrapper_id == 0 and forward_mode == ForwardMode.DECODE:
                paged_kernel_lens = torch.minimum(paged_kernel_lens, torch.tensor(sliding_window_size))
                kv_start_idx = seq_lens - paged_kernel_lens
            else:
                kv_start_idx = torch.zeros(batch_size, dtype=torch.int64, device=device)
            kv_indptr = torch.zeros((batch_size + 1,), dtype=torch.int64, device=device)
            kv_indptr[1:] = torch.cumsum(paged_kernel_lens, dim=0)
            req_pool_indices_cpu = req_pool_indices.cpu().numpy()
            paged_kernel_lens_cpu = paged_kernel_lens.cpu().numpy()
            kv_start_idx_cpu = kv_start_idx.cpu().numpy()
            kv_indices = torch.cat([req_to_token[req_pool_indices_cpu[i],
                                                 kv_start_idx_cpu[i]: kv_start_idx_cpu[i] + paged_kernel_lens_cpu[i]]
                                    for i in range(batch_size)], dim=0).contiguous()
            # CUDA graph uses different flashinfer_decode_wrapper
            if flashinfer_decode_wrapper is None:
                flashinfer_decode_wrapper = model_runner.flashinfer_decode_wrapper
            flashinfer_decode_wrapper[wrapper_id].end_forward()
            flashinfer_decode_wrapper[wrapper_id].begin_forward(kv_indptr, kv_indices, kv_last_page_len, NUM_HEADS,
                                                                NUM_HEADS, HEAD_DIM, 1)


# --- flashinfer/decode.py (a7ee5662b, reduced; the kernel is a torch stand-in, page size 1) ---------------------------

class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        self._kv_layout = kv_layout
        self._float_workspace_buffer = float_workspace_buffer
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        else:
            self._fixed_batch_size = 0
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer

    @property
    def is_cuda_graph_enabled(self):
        return self._use_cuda_graph

    def begin_forward(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size):
        batch_size = len(last_page_len)
        if self.is_cuda_graph_enabled:
            if batch_size != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                                 f"{batch_size} mismatches the batch size set during initialization "
                                 f"{self._fixed_batch_size}")
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_indices_buf[: len(indices)] = indices
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
        else:
            self._paged_kv_indptr_buf = indptr
            self._paged_kv_indices_buf = indices
            self._paged_kv_last_page_len_buf = last_page_len

    def end_forward(self):
        if not self.is_cuda_graph_enabled:
            self._paged_kv_indptr_buf = None
            self._paged_kv_indices_buf = None
            self._paged_kv_last_page_len_buf = None

    def forward(self, q, paged_kv_cache, sm_scale=None, logits_soft_cap=None):
        """One query row per request b, attending pages ``indices[indptr[b] : indptr[b + 1]]`` (page size 1)."""
        k_cache, v_cache = paged_kv_cache
        indptr, indices = self._paged_kv_indptr_buf, self._paged_kv_indices_buf
        num_pages = indptr[1:] - indptr[:-1]
        kv_len = (num_pages - 1).clamp(min=0) + torch.where(num_pages > 0, self._paged_kv_last_page_len_buf, 0)
        p = torch.arange(MAX_CONTEXT_LEN, device=q.device)
        valid = p[None, :] < kv_len[:, None]
        idx = (indptr[:-1, None] + p[None, :]).clamp(max=indices.shape[0] - 1)
        loc = torch.where(valid, indices[idx], 0)
        scores = (q[:, None] * k_cache[loc]).sum(-1).transpose(1, 2) * sm_scale          # [b, h, p]
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)       # a request with no pages: zeros
        return (probs.transpose(1, 2)[..., None] * v_cache[loc]).sum(1)


# --- sglang/srt/layers/radix_attention.py (flashinfer decode path) ----------------------------------------------------

class RadixAttention(nn.Module):
    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id, sliding_window_size=-1, logit_cap=-1):
        super().__init__()
        self.tp_q_head_num, self.tp_k_head_num, self.tp_v_head_num = num_heads, num_kv_heads, num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window_size = sliding_window_size
        self.logit_cap = logit_cap if logit_cap is not None and logit_cap > 0 else 0
        self.decode_forward = self.decode_forward_flashinfer

    def decode_forward_flashinfer(self, q, k, v, input_metadata: InputMetadata):
        decode_wrapper = input_metadata.flashinfer_decode_wrapper
        if self.sliding_window_size != -1:
            decode_wrapper = decode_wrapper[0]
        else:
            if isinstance(decode_wrapper, list):
                decode_wrapper = decode_wrapper[1]

        self.store_kv_cache(k, v, input_metadata)

        o = decode_wrapper.forward(q.contiguous().view(-1, self.tp_q_head_num, self.head_dim),
                                   input_metadata.token_to_kv_pool.get_kv_buffer(self.layer_id),
                                   sm_scale=self.scaling, logits_soft_cap=self.logit_cap)
        return o.view(-1, self.tp_q_head_num * self.head_dim)

    def forward(self, q, k, v, input_metadata: InputMetadata):
        k = k.view(-1, self.tp_k_head_num, self.head_dim)
        v = v.view(-1, self.tp_v_head_num, self.head_dim)
        assert input_metadata.forward_mode == ForwardMode.DECODE
        return self.decode_forward(q, k, v, input_metadata)

    def store_kv_cache(self, cache_k, cache_v, input_metadata: InputMetadata):
        k_cache = input_metadata.token_to_kv_pool.get_key_buffer(self.layer_id)
        v_cache = input_metadata.token_to_kv_pool.get_value_buffer(self.layer_id)
        k_cache[input_metadata.out_cache_loc] = cache_k
        v_cache[input_metadata.out_cache_loc] = cache_v


# --- sglang/srt/models/gemma2.py (reduced) ----------------------------------------------------------------------------

def linear(x, w):
    """``x @ w`` row by row (no batched GEMM, whose blocking depends on the padded batch size)."""
    return (x[:, :, None] * w[None]).sum(1)


def get_window_size(config):
    return config["sliding_window"] - 1


def rotary(x, positions):
    half = HEAD_DIM // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=DTYPE, device=x.device) / half))
    ang = positions.to(DTYPE)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = x.view(x.shape[0], -1, HEAD_DIM)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(1)


class Gemma2Attention(nn.Module):
    def __init__(self, layer_idx, config, gen, device):
        super().__init__()
        self.q_size = self.kv_size = NUM_HEADS * HEAD_DIM
        self.qkv_proj = randn(HIDDEN, 3 * self.q_size, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.o_proj = randn(self.q_size, HIDDEN, gen=gen, device=device, scale=0.4).to(DTYPE)
        use_sliding_window = layer_idx % 2 == 0 and "sliding_window" in config
        self.attn = RadixAttention(NUM_HEADS, HEAD_DIM, 1.0 / math.sqrt(HEAD_DIM), num_kv_heads=NUM_HEADS,
                                   layer_id=layer_idx,
                                   sliding_window_size=get_window_size(config) if use_sliding_window else -1,
                                   logit_cap=config["attn_logit_softcapping"])

    def forward(self, positions, hidden_states, input_metadata):
        q, k, v = linear(hidden_states, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotary(q, positions), rotary(k, positions)
        return linear(self.attn(q, k, v, input_metadata), self.o_proj)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, layer_idx, config, gen, device):
        super().__init__()
        self.self_attn = Gemma2Attention(layer_idx, config, gen, device)

    def forward(self, positions, hidden_states, input_metadata):
        normed = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)
        return hidden_states + self.self_attn(positions, normed, input_metadata)


class Gemma2Model(nn.Module):
    def __init__(self, config, gen, device):
        super().__init__()
        self.config = config
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = nn.ModuleList([Gemma2DecoderLayer(i, config, gen, device) for i in range(NUM_LAYERS)])

    def forward(self, input_ids, positions, input_metadata):
        hidden_states = self.embed_tokens[input_ids] * HIDDEN ** 0.5
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, input_metadata)
        return hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, config, gen, device):
        super().__init__()
        self.config = config
        self.model = Gemma2Model(config, gen, device)

    def forward(self, input_ids, positions, input_metadata):
        return linear(self.model(input_ids, positions, input_metadata), self.model.embed_tokens.T)  # next_token_logits

    def get_window_size(self):
        return get_window_size(self.config)


# --- sglang/srt/model_executor/cuda_graph_runner.py (reduced) ---------------------------------------------------------

class CudaGraphRunner:
    def __init__(self, model_runner, max_batch_size_to_capture):
        self.model_runner = model_runner
        self.device = device = model_runner.device
        self.graphs, self.output_buffers, self.flashinfer_handlers = {}, {}, {}
        self.graph_memory_pool = None

        # Common inputs
        self.max_bs = max_batch_size_to_capture
        i64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros((self.max_bs,), **i64)
        self.req_pool_indices = torch.zeros((self.max_bs,), **i64)
        self.seq_lens = torch.zeros((self.max_bs,), **i64)
        self.position_ids_offsets = torch.ones((self.max_bs,), **i64)
        self.out_cache_loc = torch.zeros((self.max_bs,), **i64)

        # FlashInfer inputs
        self.flashinfer_kv_indptr = torch.zeros((self.max_bs + 1,), **i64)
        self.flashinfer_kv_indices = torch.zeros((self.max_bs * MAX_CONTEXT_LEN,), **i64)
        self.flashinfer_kv_last_page_len = torch.ones((self.max_bs,), **i64)
        if _variant == "bug" or model_runner.sliding_window_size is None:
            self.flashinfer_workspace_buffer = self.model_runner.flashinfer_workspace_buffers[0]
        else:
            self.flashinfer_workspace_buffers = [self.model_runner.flashinfer_workspace_buffers[0],
                                                 self.model_runner.flashinfer_workspace_buffers[2]]
            self.flashinfer_kv_indptr = [self.flashinfer_kv_indptr, self.flashinfer_kv_indptr.clone()]
            self.flashinfer_kv_indices = [self.flashinfer_kv_indices, self.flashinfer_kv_indices.clone()]

    def can_run(self, batch_size):
        return batch_size < self.max_bs

    def capture(self, batch_size_list):
        self.batch_size_list = batch_size_list
        for bs in batch_size_list:
            self.graphs[bs], self.output_buffers[bs], self.flashinfer_handlers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs):
        # Common inputs
        input_ids = self.input_ids[:bs]
        req_pool_indices = self.req_pool_indices[:bs]
        seq_lens = self.seq_lens[:bs]
        position_ids_offsets = self.position_ids_offsets[:bs]
        out_cache_loc = self.out_cache_loc[:bs]

        # FlashInfer inputs
        if _variant == "bug" or self.model_runner.sliding_window_size is None:
            flashinfer_decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(
                self.flashinfer_workspace_buffer, "NHD", use_cuda_graph=True, use_tensor_cores=False,
                paged_kv_indptr_buffer=self.flashinfer_kv_indptr[: bs + 1],
                paged_kv_indices_buffer=self.flashinfer_kv_indices,
                paged_kv_last_page_len_buffer=self.flashinfer_kv_last_page_len[:bs])
        else:
            flashinfer_decode_wrapper = []
            for i in range(2):
                flashinfer_decode_wrapper.append(BatchDecodeWithPagedKVCacheWrapper(
                    self.flashinfer_workspace_buffers[i], "NHD", use_cuda_graph=True, use_tensor_cores=False,
                    paged_kv_indptr_buffer=self.flashinfer_kv_indptr[i][: bs + 1],
                    paged_kv_indices_buffer=self.flashinfer_kv_indices[i],
                    paged_kv_last_page_len_buffer=self.flashinfer_kv_last_page_len[:bs]))
        update_flashinfer_indices(ForwardMode.DECODE, self.model_runner, req_pool_indices, seq_lens, None,
                                  flashinfer_decode_wrapper)

        # Run and capture
        def run_once():
            input_metadata = InputMetadata(
                forward_mode=ForwardMode.DECODE, batch_size=bs, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                req_to_token_pool=self.model_runner.req_to_token_pool,
                token_to_kv_pool=self.model_runner.token_to_kv_pool, out_cache_loc=out_cache_loc,
                positions=(seq_lens - 1 + position_ids_offsets).to(torch.int64),
                flashinfer_decode_wrapper=flashinfer_decode_wrapper)
            return self.model_runner.model.forward(input_ids, input_metadata.positions, input_metadata)

        wrappers = flashinfer_decode_wrapper if isinstance(flashinfer_decode_wrapper, list) else [
            flashinfer_decode_wrapper]
        static = {"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens,
                  "position_ids_offsets": self.position_ids_offsets, "out_cache_loc": self.out_cache_loc,
                  "kv_last_page_len": self.flashinfer_kv_last_page_len}
        for i, w in enumerate(wrappers):
            static[f"kv_indptr[{i}]"] = w._paged_kv_indptr_buf
            static[f"kv_indices[{i}]"] = w._paged_kv_indices_buf
        pool = self.model_runner.token_to_kv_pool
        state = {f"{kind}_buffer[{layer}]": buf[layer] for kind, buf in (("k", pool.k_buffer), ("v", pool.v_buffer))
                 for layer in range(NUM_LAYERS)}
        graph, out = capture(run_once, device=self.device, pool=self.graph_memory_pool, warmups=2, static=static,
                             state=state, owner="CudaGraphRunner", name=f"decode bs={bs}")
        self.graph_memory_pool = graph.pool()
        return graph, out, flashinfer_decode_wrapper

    def replay(self, batch: ScheduleBatch):
        assert batch.out_cache_loc is not None
        raw_bs = len(batch.reqs)

        # Pad
        index = bisect.bisect_left(self.batch_size_list, raw_bs)
        bs = self.batch_size_list[index]
        if bs != raw_bs:
            self.seq_lens.zero_()
            self.position_ids_offsets.fill_(1)
            self.out_cache_loc.zero_()

        # Common inputs
        self.input_ids[:raw_bs] = batch.input_ids
        self.req_pool_indices[:raw_bs] = batch.req_pool_indices
        self.seq_lens[:raw_bs] = batch.seq_lens
        self.position_ids_offsets[:raw_bs] = batch.position_ids_offsets
        self.out_cache_loc[:raw_bs] = batch.out_cache_loc

        # FlashInfer inputs
        update_flashinfer_indices(ForwardMode.DECODE, self.model_runner, self.req_pool_indices[:bs],
                                  self.seq_lens[:bs], None, self.flashinfer_handlers[bs])

        # Replay
        output = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs,
                        padded={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices})
        return output[:raw_bs]


# --- sglang/srt/model_executor/model_runner.py (reduced) --------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, server_args):
        self.device, self.server_args = device, server_args
        gen = generator(11)
        config = {"sliding_window": SLIDING_WINDOW, "attn_logit_softcapping": LOGIT_CAP}
        self.model = Gemma2ForCausalLM(config, gen, device)
        self.req_to_token_pool = ReqToTokenPool(
            (1 + torch.arange(MAX_REQS * MAX_CONTEXT_LEN, device=device)).view(MAX_REQS, MAX_CONTEXT_LEN))
        self.token_to_kv_pool = MHATokenToKVPool(
            [randn(NUM_KV_SLOTS, NUM_HEADS, HEAD_DIM, gen=gen, device=device).to(DTYPE) for _ in range(NUM_LAYERS)],
            [randn(NUM_KV_SLOTS, NUM_HEADS, HEAD_DIM, gen=gen, device=device).to(DTYPE) for _ in range(NUM_LAYERS)])
        if _variant == "fix":
            self.sliding_window_size = (self.model.get_window_size() if hasattr(self.model, "get_window_size")
                                        else None)
        self.init_flashinfer()
        self.init_cuda_graphs()

    def init_flashinfer(self):
        if _variant == "bug":
            self.sliding_window_size = (self.model.get_window_size() if hasattr(self.model, "get_window_size")
                                        else None)
        workspace_buffers = torch.empty(4, 16, dtype=torch.uint8, device=self.device)
        self.flashinfer_workspace_buffers = workspace_buffers
        self.flashinfer_decode_wrapper = [BatchDecodeWithPagedKVCacheWrapper(workspace_buffers[2 * i + 0], "NHD")
                                          for i in range(2)]

    def init_cuda_graphs(self):
        if self.server_args.disable_cuda_graph or self.server_args.disable_flashinfer:
            self.cuda_graph_runner = None
            return
        self.cuda_graph_runner = CudaGraphRunner(self, max_batch_size_to_capture=max(BATCH_SIZE_LIST))
        self.cuda_graph_runner.capture(BATCH_SIZE_LIST)

    def forward_decode(self, batch: ScheduleBatch):
        if self.cuda_graph_runner and self.cuda_graph_runner.can_run(len(batch.reqs)):
            return self.cuda_graph_runner.replay(batch).clone()
        if _variant == "bug":
            input_metadata = InputMetadata.from_schedule_batch(self, batch, ForwardMode.DECODE,
                                                               sliding_window_size=self.sliding_window_size)
        else:
            input_metadata = InputMetadata.from_schedule_batch(self, batch, ForwardMode.DECODE)
        return self.model.forward(batch.input_ids, input_metadata.positions, input_metadata)


# --- the workload -----------------------------------------------------------------------------------------------------

# (request slots, seq_lens including the token decoded now); every context is longer than the window
STEPS = (([0, 1, 2], [7, 9, 5]), ([1, 3], [10, 6]), ([0, 2, 3], [8, 6, 7]))


def _serve(device, use_cuda_graph):
    server_args = ServerArgs(model_path="/models/g2-tiny", disable_cuda_graph=not use_cuda_graph)
    server_args.check_server_args()
    model_runner = ModelRunner(device, server_args)
    req_to_token = model_runner.req_to_token_pool.req_to_token
    gen = generator(3)
    outs = []
    for reqs, seq_lens in STEPS:
        bs = len(reqs)
        req_pool_indices = torch.tensor(reqs, device=device)
        seq_lens_t = torch.tensor(seq_lens, device=device)
        batch = ScheduleBatch(reqs=reqs, input_ids=torch.randint(0, VOCAB, (bs,), generator=gen).to(device),
                              req_pool_indices=req_pool_indices, seq_lens=seq_lens_t,
                              position_ids_offsets=torch.zeros(bs, dtype=torch.int64, device=device),
                              out_cache_loc=req_to_token[req_pool_indices, seq_lens_t - 1])
        outs.append(model_runner.forward_decode(batch))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
