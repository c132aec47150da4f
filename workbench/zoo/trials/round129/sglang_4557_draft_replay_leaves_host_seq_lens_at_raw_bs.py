"""SGLang EAGLE (NextN) draft decode with the FlashInfer MLA backend under CUDA graphs: when the running batch is not a captured size, ``EAGLEDraftCudaGraphRunner.replay`` pads the device inputs to the graph's ``bs`` but hands the backend the host ``decode_seq_lens_cpu`` of the ``raw_bs`` real requests, and ``FlashInferMLAAttnBackend.init_forward_metadata_replay_cuda_graph`` assigns their ``raw_bs``-long prefix sum into the ``bs`` slots of its host ``kv_indptr``: the draft step dies with a shape error before the graph is replayed.

Upstream: https://github.com/sgl-project/sglang/pull/4557 ("[Fix] Fix raw_bs bug when using flashinfer mla and
eagle", sgl-project/sglang, by Fridge003 (Baizhou Zhang), 2025-03-18; merged as commit 90532b762777). Read: the PR
description ("when `bs != raw_bs` when eagle replays cuda graph, `seq_len_cpu` needed by flashinfer mla needs to be
handled"; it fixes the bug reported in issue #4536; DeepSeek-V3 + NextN, ``--speculative-algo EAGLE
--speculative-eagle-topk 1 --enable-flashinfer-mla``) and the full diff of 90532b762 (one file,
``speculative/eagle_draft_cuda_graph_runner.py``: a host ``self.seq_lens_cpu`` buffer in ``__init__``; in ``replay``,
when ``decode_seq_lens_cpu`` is set and ``bs != raw_bs``, fill it with 1, copy the real rows in and hand
``self.seq_lens_cpu[:bs]`` to the backend; restore ``[:raw_bs]`` after the replay). At the parent (90532b762^):
``eagle_draft_cuda_graph_runner.py`` whole (``__init__``, ``can_run``, ``capture``, ``capture_one_batch_size`` with
two warmups, ``_postprocess_output_to_raw_bs``, ``replay``);
``layers/attention/flashinfer_mla_backend.py`` whole (``FlashInferMLAAttnBackend.init_forward_metadata``,
``init_cuda_graph_state``, ``init_forward_metadata_capture_cuda_graph``, ``init_forward_metadata_replay_cuda_graph``,
``get_cuda_graph_seq_len_fill_value`` (0), ``forward_decode``; ``FlashInferMLAIndicesUpdaterDecode.update`` /
``call_begin_forward``; ``FlashInferMLAMultiStepDraftBackend`` (``common_template``, ``init_forward_metadata``,
``init_cuda_graph_state``, capture / replay); ``fast_mla_decode_plan``); ``speculative/eagle_worker.py`` (``draft``,
``draft_forward``); ``speculative/eagle_utils.py`` (``assign_draft_cache_locs``, ``generate_draft_decode_kv_indices``,
``select_top_k_tokens``); ``model_executor/cuda_graph_runner.py`` (``CudaGraphRunner.capture``, ``replay_prepare``,
which already pads ``seq_lens_cpu`` for the target model's graphs, ``get_batch_sizes_to_capture``);
``ForwardBatch.init_new`` (``decode_seq_lens_cpu`` from ``batch.decode_seq_lens``) and
``ScheduleBatch.get_model_worker_batch`` (``decode_seq_lens = self.seq_lens.cpu()`` only with FlashInfer MLA or
FlashMLA). Also read: #4363 (1b859295f, two days before), which dropped ``assert self.disable_padding`` from the draft
runner and added the padded path of ``replay``, making this bug reachable.
Not read: issue #4536 itself, FlashInfer's ``BatchMLAPagedAttentionWrapper`` and its C++ MLA plan/run, the DeepSeek
NextN model code.
Symptom: (PR) EAGLE/NextN speculative decoding with ``--enable-flashinfer-mla`` fails when the draft graph is replayed
padded (``bs != raw_bs``); the fix is validated by GSM8K 0.965 / MMLU 0.878 with the same launch command. As the
mechanism implies (and as modelled): as soon as the number of running requests is not a captured batch size, the draft
step raises ``RuntimeError: The expanded size of the tensor (4) must match the existing size (3) ...`` in
``init_forward_metadata_replay_cuda_graph``; batches of a captured size and ``--disable-cuda-graph`` run fine.
Mechanism: the FlashInfer MLA backend replans at every replay on the host (``fast_mla_decode_plan``, no stream sync):
``kv_len_arr_cpu = seq_lens_cpu[:bs]`` and ``cuda_graph_kv_indptr_cpu[1 : bs + 1] = torch.cumsum(kv_len_arr_cpu)``,
with ``seq_lens_cpu`` the host copy of the batch's lengths the caller passes. ``CudaGraphRunner.replay_prepare`` (target
model) passes its own static ``seq_lens_cpu`` padded to ``bs`` (fill 1). The draft runner's ``replay`` pads the device
``seq_lens`` / ``req_pool_indices`` / ``positions`` and sets ``forward_batch.batch_size = bs``, but leaves
``forward_batch.decode_seq_lens_cpu`` as the real batch's ``raw_bs`` host lengths, and
``FlashInferMLAMultiStepDraftBackend.init_forward_metadata_replay_cuda_graph`` hands that to every step's backend with
``bs``: a ``raw_bs``-row tensor meets ``bs``-row host metadata, and the assignment raises (for ``raw_bs`` 1 it would
broadcast one length into two slots instead). Exact-size replays are unaffected.
Doctor: padded-shape-mismatch, at replay. The padded replay's host metadata combines the graph's padded size ``bs``
(the ``kv_indptr_cpu`` slots) with a tensor sized for the real rows (``decode_seq_lens_cpu``); the runner's ``replay``
is where the host lengths should have been padded as the device ones are, and the fix is there.
Fix (upstream): ``replay`` pads the host lengths into a static ``seq_lens_cpu`` (fill 1, real rows copied) and hands
``self.seq_lens_cpu[:bs]`` to the backend, restoring ``[:raw_bs]`` afterwards.
Modelled: ``EAGLEDraftCudaGraphRunner`` (``__init__`` with its static buffers and ``seq_len_fill_value`` from the
backend, ``can_run``, ``capture`` in reverse over the capture sizes into one pool, ``capture_one_batch_size`` with two
warmups and ``run_once`` restoring ``out_cache_loc`` / ``hidden_states``, ``_postprocess_output_to_raw_bs``,
``replay``); ``FlashInferMLAAttnBackend`` (decode parts of ``init_forward_metadata``, ``init_cuda_graph_state``,
capture / replay metadata, ``get_cuda_graph_seq_len_fill_value``, ``forward_decode``),
``FlashInferMLAIndicesUpdaterDecode`` (``update`` / ``call_begin_forward``, speculative branch),
``FlashInferMLAMultiStepDraftBackend`` (``common_template``, eager / capture / replay), ``fast_mla_decode_plan``;
``EAGLEWorker.draft`` / ``draft_forward``; ``assign_draft_cache_locs``, ``generate_draft_decode_kv_indices`` (torch
for Triton, same offsets), ``select_top_k_tokens``, ``fast_topk``; ``get_model_worker_batch``'s
``decode_seq_lens``.
Stand-ins: a one-layer NextN draft model (token + position embedding, ``eh_proj`` over ``[embeds, hidden]``, one MLA
head: latent 6 + rope 2, absorbed, an output projection, the shared ``lm_head``) in float64; FlashInfer's
``BatchMLAPagedAttentionWrapper``: ``plan`` / the fast plan compute a host plan from the host arrays (the lines that
fail are sglang's, before it), and ``run`` reads each request's KV range from the draft ``kv_indptr`` row its
capture-time plan was given (rewritten by ``generate_draft_decode_kv_indices`` before every replay) and the slots
from ``kv_indices`` (upstream the plan turns host copies of the indptrs into the kernel's work partition; what
FlashInfer's MLA kernel itself reads was not read); the eager ``init_forward_metadata`` passes ``spec_info`` to the
decode updater (at the parent it did not, so eager drafting read only the prefix; left out so that the graph and
eager paths attend over the same KV); token
slots from a stand-in allocator; topk 1, so draft trees are chains.
Workload: capture sizes 1, 2, 4 (``--cuda-graph-bs 1 2 4``), ``speculative_num_steps`` 3 (two draft forwards per
round). Four draft rounds on requests with prefix KV already in the pool: 2 requests (exact), 3 requests (padded to
4), 1 request (exact), 3 requests (padded to 4). Compared: each round's draft scores, tokens and parents, with graphs
against ``--disable-cuda-graph``.
Measured: bug: raised RuntimeError: The expanded size of the tensor (4) must match the existing size (3) at
non-singleton dimension 0.  Target sizes: [4].  Tensor sizes: [3] (in the second round, the first padded replay; the
first round, replayed on the bs=2 graph, equals eager exactly). Fix: equals eager (max |graph - eager| = 0 over the four
rounds, four replays). A check of the stand-in: had the capture-time plan kept its own copy of the draft kv_indptr,
the fix would differ from eager by 10.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from enum import IntEnum, auto
from typing import Callable, List, Optional

import torch

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/4557"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "replay"
SYMPTOM = ("EAGLE/NextN with FlashInfer MLA and CUDA graphs: a draft step whose batch is not a captured size (3 "
           "requests on the bs=4 draft graph) raises 'The expanded size of the tensor (4) must match the existing "
           "size (3)' in init_forward_metadata_replay_cuda_graph; captured sizes and --disable-cuda-graph work")

DTYPE = torch.float64
VOCAB, HIDDEN = 16, 8
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 6, 2
HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM      # MLA absorbed: one KV head holding latent + rope part
MAX_REQS, MAX_CONTEXT_LEN, MAX_POSITION = 6, 16, 64
POOL_SIZE = 1 + 2 * MAX_REQS * MAX_CONTEXT_LEN  # slot 0 is the reserved padding slot
SPECULATIVE_EAGLE_TOPK, SPECULATIVE_NUM_STEPS = 1, 3
CUDA_GRAPH_BS = [1, 2, 4]                       # --cuda-graph-bs 1 2 4
MAX_KV_LEN = 32                                 # the stand-in kernel's fixed KV window per request
global_server_args_dict = {"enable_flashinfer_mla": True}

_variant = "bug"


# --- sglang/srt/model_executor/forward_batch_info.py (reduced) --------------------------------------------------------

class ForwardMode(IntEnum):
    EXTEND = auto()
    DECODE = auto()

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_decode_or_idle(self):
        return self == ForwardMode.DECODE


class CaptureHiddenMode(IntEnum):
    NULL = auto()
    LAST = auto()


@dataclass
class EagleDraftInput:
    topk_p: torch.Tensor = None
    topk_index: torch.Tensor = None
    hidden_states: torch.Tensor = None
    verified_id: torch.Tensor = None
    positions: torch.Tensor = None
    kv_indptr: torch.Tensor = None
    kv_indices: torch.Tensor = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.LAST


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: Optional[torch.Tensor]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MLATokenToKVPool"
    out_cache_loc: torch.Tensor
    seq_lens_sum: object
    positions: torch.Tensor
    spec_info: EagleDraftInput
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.LAST
    decode_seq_lens_cpu: Optional[torch.Tensor] = None
    attn_backend: object = None

    @classmethod
    def init_new(cls, batch: "ModelWorkerBatch", model_runner: "ModelRunner"):
        ret = cls(forward_mode=batch.forward_mode, batch_size=len(batch.seq_lens), input_ids=batch.input_ids,
                  req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                  req_to_token_pool=model_runner.req_to_token_pool, token_to_kv_pool=model_runner.token_to_kv_pool,
                  out_cache_loc=batch.out_cache_loc, seq_lens_sum=batch.seq_lens_sum, positions=None,
                  spec_info=batch.spec_info, capture_hidden_mode=batch.spec_info.capture_hidden_mode,
                  attn_backend=model_runner.attn_backend)
        if ret.spec_info is not None and getattr(ret.spec_info, "positions", None) is not None:
            ret.positions = ret.spec_info.positions
        if ret.forward_mode.is_decode():
            if ret.decode_seq_lens_cpu is None:
                ret.decode_seq_lens_cpu = batch.decode_seq_lens
        return ret


@dataclass
class ModelWorkerBatch:
    forward_mode: ForwardMode
    input_ids: Optional[torch.Tensor]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    decode_seq_lens: Optional[torch.Tensor]
    spec_info: EagleDraftInput


@dataclass
class ScheduleBatch:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    spec_info: EagleDraftInput
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool_allocator: "TokenToKVPoolAllocator"
    device: str
    forward_mode: ForwardMode = ForwardMode.DECODE
    out_cache_loc: torch.Tensor = None
    seq_lens_sum: int = 0
    input_ids: torch.Tensor = None

    def batch_size(self):
        return self.seq_lens.shape[0]

    def alloc_token_slots(self, num_tokens: int):
        return self.token_to_kv_pool_allocator.alloc(num_tokens)

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        if self.forward_mode.is_decode_or_idle():
            if global_server_args_dict["enable_flashinfer_mla"]:
                decode_seq_lens = host(self.seq_lens.detach().to("cpu").clone(), self.device)   # seq_lens.cpu()
            else:
                decode_seq_lens = None
        return ModelWorkerBatch(self.forward_mode, self.input_ids, self.req_pool_indices, self.seq_lens,
                                self.out_cache_loc, self.seq_lens_sum, decode_seq_lens, self.spec_info)


# --- memory pools (reduced) -------------------------------------------------------------------------------------------

class ReqToTokenPool:
    def __init__(self, req_to_token):
        self.req_to_token = req_to_token
        self.size = req_to_token.shape[0]


class TokenToKVPoolAllocator:
    """Stand-in allocator: hands out the free slots in a fixed order."""

    def __init__(self, free_slots, device):
        self.free_slots, self.device = free_slots, device

    def alloc(self, need_size: int):
        select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return select.to(self.device)


class MLATokenToKVPool:
    def __init__(self, kv_buffer):
        self.kv_buffer = [kv_buffer]          # one layer: [POOL_SIZE, 1, kv_lora_rank + qk_rope_head_dim]

    def get_key_buffer(self, layer_id: int):
        return self.kv_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.kv_buffer[layer.layer_id][loc] = cache_k


# --- flashinfer BatchMLAPagedAttentionWrapper (stand-in) --------------------------------------------------------------

class _MLAPlanModule:
    """Stand-in for the JIT module's ``plan``: the host scheduling of the MLA kernel's work."""

    @staticmethod
    def plan(float_workspace_buffer, int_workspace_buffer, pin_memory_int_workspace_buffer, qo_indptr_cpu,
             kv_indptr_cpu, kv_len_arr_cpu, num_heads, head_dim_ckv, causal, stream):
        return (int(qo_indptr_cpu.shape[0]) - 1, kv_indptr_cpu.clone(), kv_len_arr_cpu.clone())


class BatchMLAPagedAttentionWrapper:
    def __init__(self, workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        self._float_workspace_buffer = self._int_workspace_buffer = workspace_buffer
        self._pin_memory_int_workspace_buffer = None
        self._use_cuda_graph = use_cuda_graph
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr, kv_indptr
        self._kv_indices_buf, self._kv_len_arr_buf = kv_indices, kv_len_arr
        self._cached_module = _MLAPlanModule()
        self.device = workspace_buffer.device

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        dev = str(self.device)
        qo_indptr_host = host(qo_indptr.detach().to("cpu").clone(), dev)
        kv_indptr_host = host(kv_indptr.detach().to("cpu").clone(), dev)
        kv_len_arr_host = host(kv_len_arr.detach().to("cpu").clone(), dev)
        if not self._use_cuda_graph or kv_indices.data_ptr() != self._kv_indices_buf.data_ptr():
            self._kv_indices_buf = kv_indices
        self._kv_ranges = kv_indptr          # stand-in: the kernel's per-request KV ranges (see the docstring)
        self._causal, self._page_size, self._sm_scale = causal, page_size, sm_scale
        self._plan_info = self._cached_module.plan(None, None, None, qo_indptr_host, kv_indptr_host,
                                                   kv_len_arr_host, num_heads, head_dim_ckv, causal, None)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        """Paged MLA decode, one query row per request (page size 1)."""
        n = q_nope.shape[0]
        kv_indptr = self._kv_ranges[: n + 1]
        starts, lens = kv_indptr[:-1].to(torch.int64), (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
        j = torch.arange(MAX_KV_LEN, device=q_nope.device)
        valid = j[None, :] < lens[:, None]
        idx = torch.where(valid, starts[:, None] + j[None, :], torch.zeros_like(starts)[:, None])
        slots = self._kv_indices_buf[idx]                                        # [n, MAX_KV_LEN]
        ckv, kpe = ckv_cache[slots, 0], kpe_cache[slots, 0]                      # [n, MAX_KV_LEN, *]
        scores = (q_nope[:, 0, None, :] * ckv).sum(-1) + (q_pe[:, 0, None, :] * kpe).sum(-1)
        scores = (scores * self._sm_scale).masked_fill(~valid, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        return (p[..., None] * ckv).sum(1)[:, None, :]                           # [n, 1, kv_lora_rank]


def fast_mla_decode_plan(self, qo_indptr_cpu, kv_indptr_cpu, kv_indices, kv_len_arr_cpu, num_heads, head_dim_ckv,
                         head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type) -> None:
    """A faster version of BatchMLAPagedAttentionWrapper::plan, for skipping the stream synchronization in original
    plan function during cuda graph replaying."""
    self._causal = causal
    self._page_size = page_size
    self._sm_scale = sm_scale
    self._plan_info = self._cached_module.plan(self._float_workspace_buffer, self._int_workspace_buffer,
                                               self._pin_memory_int_workspace_buffer, qo_indptr_cpu, kv_indptr_cpu,
                                               kv_len_arr_cpu, num_heads, head_dim_ckv, causal, None)


# --- sglang/srt/layers/attention/flashinfer_mla_backend.py (decode parts) ---------------------------------------------

@dataclass
class DecodeMetadata:
    decode_wrapper: BatchMLAPagedAttentionWrapper


@dataclass
class RadixAttention:
    layer_id: int = 0
    tp_q_head_num: int = 1
    tp_k_head_num: int = 1
    head_dim: int = HEAD_DIM
    v_head_dim: int = KV_LORA_RANK
    scaling: float = 1.0 / math.sqrt(HEAD_DIM)


class FlashInferMLAAttnBackend:
    def __init__(self, model_runner, skip_prefill=False, kv_indptr_buf=None, q_indptr_decode_buf=None):
        self.max_context_len = MAX_CONTEXT_LEN
        self.device = model_runner.device
        self.skip_prefill = skip_prefill
        self.workspace_buffer = model_runner.workspace_buffer
        max_bs = model_runner.req_to_token_pool.size
        self.kv_indptr = (torch.zeros((max_bs + 1,), dtype=torch.int32, device=self.device)
                          if kv_indptr_buf is None else kv_indptr_buf)
        self.q_indptr_decode = (torch.arange(0, max_bs + 1, dtype=torch.int32, device=self.device)
                                if q_indptr_decode_buf is None else q_indptr_decode_buf)
        self.decode_wrapper = BatchMLAPagedAttentionWrapper(self.workspace_buffer, backend="auto")
        self.indices_updater_decode = FlashInferMLAIndicesUpdaterDecode(model_runner, self)
        self.forward_metadata = None
        self.decode_cuda_graph_metadata = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        if forward_batch.forward_mode.is_decode_or_idle():
            self.indices_updater_decode.update(
                forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.seq_lens_sum,
                decode_wrapper=self.decode_wrapper, init_metadata_replay=False,
                spec_info=forward_batch.spec_info)        # stand-in: the parent passed no spec_info here
            self.forward_metadata = DecodeMetadata(self.decode_wrapper)
        else:
            raise NotImplementedError("only decode is modelled")

    def init_cuda_graph_state(self, max_bs: int, kv_indices_buf: Optional[torch.Tensor] = None):
        if kv_indices_buf is None:
            cuda_graph_kv_indices = torch.zeros((max_bs * self.max_context_len,), dtype=torch.int32,
                                                device=self.device)
        else:
            cuda_graph_kv_indices = kv_indices_buf
        self.cuda_graph_kv_indices = cuda_graph_kv_indices
        self.cuda_graph_qo_indptr = self.q_indptr_decode.clone()
        self.cuda_graph_kv_indptr = self.kv_indptr.clone()
        self.cuda_graph_kv_lens = torch.ones((max_bs,), dtype=torch.int32, device=self.device)

        # For fast decode plan in graph replaying
        self.cuda_graph_qo_indptr_cpu = host(self.cuda_graph_qo_indptr.to("cpu").clone(), str(self.device))
        self.cuda_graph_kv_indptr_cpu = host(self.cuda_graph_kv_indptr.to("cpu").clone(), str(self.device))
        self.fast_decode_kwargs = {
            "qo_indptr_cpu": self.cuda_graph_qo_indptr_cpu,
            "kv_indptr_cpu": self.cuda_graph_kv_indptr_cpu,
            "kv_indices": self.cuda_graph_kv_indices,
        }

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        if forward_mode.is_decode_or_idle():
            decode_wrapper = BatchMLAPagedAttentionWrapper(
                self.workspace_buffer, use_cuda_graph=True,
                qo_indptr=self.cuda_graph_qo_indptr[: num_tokens + 1],
                kv_indptr=self.cuda_graph_kv_indptr[: num_tokens + 1],
                kv_indices=self.cuda_graph_kv_indices,
                kv_len_arr=self.cuda_graph_kv_lens[:num_tokens], backend="auto")
            seq_lens_sum = seq_lens.sum().item()
            self.indices_updater_decode.update(req_pool_indices, seq_lens, seq_lens_sum,
                                               decode_wrapper=decode_wrapper, init_metadata_replay=False,
                                               spec_info=spec_info)
            self.decode_cuda_graph_metadata[bs] = decode_wrapper
            self.forward_metadata = DecodeMetadata(decode_wrapper)
            decode_wrapper.plan = lambda *a, _w=decode_wrapper: fast_mla_decode_plan(_w, *a)   # partial(...)
        else:
            raise ValueError(f"Invalid mode: {forward_mode=}")

    def init_forward_metadata_replay_cuda_graph(self, bs, num_kv_heads, req_pool_indices, seq_lens, seq_lens_sum,
                                                encoder_lens, forward_mode, spec_info, seq_lens_cpu):
        if forward_mode.is_decode_or_idle():
            assert seq_lens_cpu is not None
            kv_len_arr_cpu = seq_lens_cpu[:bs]
            self.cuda_graph_kv_indptr_cpu[1: bs + 1] = torch.cumsum(kv_len_arr_cpu, dim=0)
            self.fast_decode_kwargs.update({
                "qo_indptr_cpu": self.cuda_graph_qo_indptr_cpu[: bs + 1],
                "kv_indptr_cpu": self.cuda_graph_kv_indptr_cpu[: bs + 1],
                "kv_len_arr_cpu": kv_len_arr_cpu,
            })
            self.indices_updater_decode.update(req_pool_indices[:bs], seq_lens[:bs], seq_lens_sum,
                                               decode_wrapper=self.decode_cuda_graph_metadata[bs],
                                               init_metadata_replay=True, spec_info=spec_info,
                                               **self.fast_decode_kwargs)
        else:
            raise ValueError(f"Invalid forward mode: {forward_mode=}")

    def get_cuda_graph_seq_len_fill_value(self):
        return 0

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        decode_wrapper = self.forward_metadata.decode_wrapper
        cache_loc = forward_batch.out_cache_loc
        if k is not None:
            if save_kv_cache:
                forward_batch.token_to_kv_pool.set_kv_buffer(layer, cache_loc, k, v)
        reshaped_q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        reshaped_k = k_buffer.view(-1, 1, layer.head_dim)
        o = decode_wrapper.run(reshaped_q[:, :, : layer.v_head_dim], reshaped_q[:, :, layer.v_head_dim:],
                               reshaped_k[:, :, : layer.v_head_dim], reshaped_k[:, :, layer.v_head_dim:])
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)


class FlashInferMLAIndicesUpdaterDecode:
    def __init__(self, model_runner, attn_backend):
        self.num_local_heads = 1
        self.kv_lora_rank = KV_LORA_RANK
        self.qk_rope_head_dim = QK_ROPE_HEAD_DIM
        self.scaling = 1.0 / math.sqrt(HEAD_DIM)
        self.data_type = DTYPE
        self.attn_backend = attn_backend
        self.kv_indptr = attn_backend.kv_indptr
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.q_indptr = attn_backend.q_indptr_decode

    def update(self, req_pool_indices, seq_lens, seq_lens_sum, decode_wrapper, init_metadata_replay=False,
               spec_info=None, **fast_decode_kwargs):
        self.call_begin_forward(decode_wrapper, req_pool_indices, seq_lens, seq_lens_sum, self.q_indptr,
                                self.kv_indptr, init_metadata_replay, spec_info, **fast_decode_kwargs)

    def call_begin_forward(self, wrapper, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, q_indptr,
                           kv_indptr, init_metadata_replay=False, spec_info=None, **fast_decode_kwargs):
        bs = len(req_pool_indices)
        q_indptr = q_indptr[: bs + 1]
        kv_lens = paged_kernel_lens.to(torch.int32)
        sm_scale = self.scaling
        assert spec_info is not None, "only the speculative (draft decode) branch is modelled"
        kv_indptr, kv_indices = spec_info.kv_indptr, spec_info.kv_indices
        if not init_metadata_replay:
            wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, self.num_local_heads, self.kv_lora_rank,
                         self.qk_rope_head_dim, 1, False, sm_scale, self.data_type, self.data_type)
        else:
            wrapper.plan(fast_decode_kwargs["qo_indptr_cpu"], fast_decode_kwargs["kv_indptr_cpu"], kv_indices,
                         fast_decode_kwargs["kv_len_arr_cpu"], self.num_local_heads, self.kv_lora_rank,
                         self.qk_rope_head_dim, 1, False, sm_scale, self.data_type, self.data_type)


class FlashInferMLAMultiStepDraftBackend:
    """Wrap multiple flashinfer mla attention backends as one for multiple consecutive draft decoding steps."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        if topk > 1:
            raise ValueError("Currently Flashinfer MLA only supports topk=1 for speculative decoding")
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.generate_draft_decode_kv_indices = generate_draft_decode_kv_indices
        max_bs = model_runner.req_to_token_pool.size * self.topk
        self.kv_indptr = torch.zeros((self.speculative_num_steps, max_bs + 1), dtype=torch.int32,
                                     device=model_runner.device)
        self.q_indptr_decode = torch.arange(0, max_bs + 1, dtype=torch.int32, device=model_runner.device)
        self.attn_backends = [
            FlashInferMLAAttnBackend(model_runner, skip_prefill=True, kv_indptr_buf=self.kv_indptr[i],
                                     q_indptr_decode_buf=self.q_indptr_decode)
            for i in range(self.speculative_num_steps)]
        self.max_context_len = self.attn_backends[0].max_context_len
        self.pool_len = model_runner.req_to_token_pool.req_to_token.shape[1]

    def common_template(self, forward_batch: ForwardBatch, kv_indices_buffer: torch.Tensor, call_fn: Callable):
        num_seqs = forward_batch.batch_size
        bs = self.topk * num_seqs
        seq_lens_sum = forward_batch.seq_lens_sum
        self.generate_draft_decode_kv_indices(
            forward_batch.req_pool_indices, forward_batch.req_to_token_pool.req_to_token, forward_batch.seq_lens,
            kv_indices_buffer, self.kv_indptr, forward_batch.positions, num_seqs, self.topk, self.pool_len,
            self.speculative_num_steps)
        assert isinstance(forward_batch.spec_info, EagleDraftInput)
        for i in range(self.speculative_num_steps - 1):
            forward_batch.spec_info.kv_indptr = self.kv_indptr[i, : bs + 1]
            forward_batch.spec_info.kv_indices = kv_indices_buffer[i][: seq_lens_sum * self.topk + bs * (i + 1)]
            call_fn(i, forward_batch)

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        kv_indices = torch.zeros((self.speculative_num_steps,
                                  forward_batch.batch_size * self.topk * self.max_context_len),
                                 dtype=torch.int32, device=forward_batch.seq_lens.device)

        def call_fn(i, forward_batch):
            forward_batch.spec_info.kv_indptr = forward_batch.spec_info.kv_indptr.clone()
            forward_batch.spec_info.kv_indices = forward_batch.spec_info.kv_indices.clone()
            self.attn_backends[i].init_forward_metadata(forward_batch)

        self.common_template(forward_batch, kv_indices, call_fn)

    def init_cuda_graph_state(self, max_bs: int):
        self.cuda_graph_kv_indices = torch.zeros((self.speculative_num_steps, max_bs * self.max_context_len),
                                                 dtype=torch.int32, device=self.kv_indptr.device)
        for i in range(self.speculative_num_steps):
            self.attn_backends[i].init_cuda_graph_state(max_bs, kv_indices_buf=self.cuda_graph_kv_indices[i])

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch):
        def call_fn(i, forward_batch):
            self.attn_backends[i].init_forward_metadata_capture_cuda_graph(
                forward_batch.batch_size, forward_batch.batch_size * self.topk, forward_batch.req_pool_indices,
                forward_batch.seq_lens, encoder_lens=None, forward_mode=ForwardMode.DECODE,
                spec_info=forward_batch.spec_info)

        self.common_template(forward_batch, self.cuda_graph_kv_indices, call_fn)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch, bs: int):
        def call_fn(i, forward_batch):
            self.attn_backends[i].init_forward_metadata_replay_cuda_graph(
                bs, -1, forward_batch.req_pool_indices, forward_batch.seq_lens, seq_lens_sum=-1, encoder_lens=None,
                forward_mode=ForwardMode.DECODE, spec_info=forward_batch.spec_info,
                seq_lens_cpu=forward_batch.decode_seq_lens_cpu)

        self.common_template(forward_batch, self.cuda_graph_kv_indices, call_fn)


# --- sglang/srt/speculative/eagle_utils.py (torch for the Triton kernels) ---------------------------------------------

def assign_draft_cache_locs(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk,
                            speculative_num_steps):
    """Record each request's newly allocated draft slots at columns ``seq_len .. seq_len + topk * steps``."""
    n = topk * speculative_num_steps
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(n, device=seq_lens.device)[None, :]
    req_to_token[req_pool_indices.to(torch.int64)[:, None], cols] = out_cache_loc.view(-1, n).to(req_to_token.dtype)


def generate_draft_decode_kv_indices(req_pool_indices, req_to_token, paged_kernel_lens, kv_indices, kv_indptr,
                                     positions, num_seqs, topk, pool_len, num_iters):
    """Per draft step ``it``: each request's prefix slots then its ``it + 1`` draft slots in ``kv_indices[it]``, and
    ``kv_indptr[it, z] = sum(positions[:z]) + z * (it + 1)`` (the Triton kernel's offsets)."""
    dev = kv_indices.device
    seq_lens = paged_kernel_lens[:num_seqs].to(torch.int64)
    rows = req_to_token[req_pool_indices[:num_seqs].to(torch.int64)].to(kv_indices.dtype)   # [num_seqs, pool_len]
    cum_seq_len = torch.cumsum(seq_lens, 0) - seq_lens
    j = torch.arange(pool_len, device=dev)
    bid = torch.arange(num_seqs, device=dev)
    for it in range(num_iters):
        iters = it + 1
        for topk_id in range(topk):
            kv_offset = cum_seq_len * topk + bid * iters * topk + topk_id * (seq_lens + iters)
            prefix = j[None, :] < seq_lens[:, None]
            kv_indices[it][(kv_offset[:, None] + j[None, :])[prefix]] = rows[prefix]
            e = torch.arange(iters, device=dev)
            extend_cols = seq_lens[:, None] + e[None, :] * topk + topk_id
            kv_indices[it][(kv_offset[:, None] + seq_lens[:, None] + e[None, :]).flatten()] = \
                rows.gather(1, extend_cols).flatten()
        zid = torch.arange(1, num_seqs * topk + 1, device=dev)
        base = torch.cumsum(positions[: num_seqs * topk].to(torch.int64), 0)
        kv_indptr[it, 1: num_seqs * topk + 1] = (base + zid * iters).to(kv_indptr.dtype)


def fast_topk(values, topk, dim):
    if topk == 1:
        max_value, max_index = torch.max(values, dim=dim)
        return max_value.unsqueeze(1), max_index.unsqueeze(1)
    return torch.topk(values, topk, dim=dim)


def select_top_k_tokens(i, topk_p, topk_index, hidden_states, scores, topk):
    if i == 0:
        input_ids = topk_index.flatten()
        hidden_states = hidden_states.repeat_interleave(topk, dim=0)
        scores = topk_p
        tree_info = (topk_p.unsqueeze(1), topk_index,
                     torch.arange(-1, topk, dtype=torch.long, device=topk_p.device).unsqueeze(0)
                     .repeat(topk_p.shape[0], 1))
    else:
        expand_scores = torch.mul(scores.unsqueeze(2), topk_p.reshape(-1, topk, topk))
        topk_cs_p, topk_cs_index = fast_topk(expand_scores.flatten(start_dim=1), topk, dim=-1)
        scores = topk_cs_p
        topk_index = topk_index.reshape(-1, topk ** 2)
        input_ids = torch.gather(topk_index, index=topk_cs_index, dim=1).flatten()
        selected_input_index = topk_cs_index.flatten() // topk + torch.arange(
            0, hidden_states.shape[0], step=topk, device=hidden_states.device).repeat_interleave(topk)
        hidden_states = hidden_states[selected_input_index, :]
        tree_info = (expand_scores, topk_index, topk_cs_index + (topk ** 2 * (i - 1) + topk))
    return input_ids, hidden_states, scores, tree_info


# --- the NextN draft model (one MLA layer, reduced) -------------------------------------------------------------------

@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor


class DeepseekV3ForCausalLMNextN:
    def __init__(self, device):
        gen = generator(4557)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_POSITION, HIDDEN, scale=0.5)
        self.eh_proj = r(2 * HIDDEN, HIDDEN)
        self.q_proj, self.kv_a_proj = r(HIDDEN, HEAD_DIM, scale=0.6), r(HIDDEN, HEAD_DIM, scale=0.6)
        self.o_proj = r(KV_LORA_RANK, HIDDEN, scale=0.7)
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)
        self.attn = RadixAttention()

    def forward(self, input_ids, positions, forward_batch: ForwardBatch):
        embeds = self.embed_tokens[input_ids] + self.pos_embed[positions]
        hidden_states = torch.cat([embeds, forward_batch.spec_info.hidden_states], dim=-1) @ self.eh_proj
        q, latent_cache = hidden_states @ self.q_proj, hidden_states @ self.kv_a_proj
        attn_output = forward_batch.attn_backend.forward_decode(q, latent_cache.view(-1, 1, HEAD_DIM), None,
                                                                self.attn, forward_batch)
        hidden_states = hidden_states + torch.tanh(attn_output @ self.o_proj)
        return LogitsProcessorOutput(next_token_logits=hidden_states @ self.lm_head, hidden_states=hidden_states)


class ModelRunner:
    def __init__(self, device, req_to_token_pool, token_to_kv_pool):
        self.device = device
        self.req_to_token_pool, self.token_to_kv_pool = req_to_token_pool, token_to_kv_pool
        self.workspace_buffer = torch.empty(16, dtype=torch.uint8, device=device)
        self.model = DeepseekV3ForCausalLMNextN(device)
        self.attn_backend = None


# --- sglang/srt/speculative/eagle_draft_cuda_graph_runner.py ----------------------------------------------------------

class EAGLEDraftCudaGraphRunner:
    def __init__(self, eagle_worker: "EAGLEWorker"):
        self.eagle_worker = eagle_worker
        self.model_runner = model_runner = eagle_worker.model_runner
        self.device = model_runner.device
        self.graphs, self.output_buffers = {}, {}
        self.disable_padding = False
        self.topk = SPECULATIVE_EAGLE_TOPK
        self.speculative_num_steps = SPECULATIVE_NUM_STEPS

        # Batch sizes to capture
        self.capture_bs = CUDA_GRAPH_BS
        self.num_tokens_per_bs = SPECULATIVE_EAGLE_TOPK

        # Attention backend
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.model_runner.draft_attn_backend.init_cuda_graph_state(self.max_num_token)
        self.seq_len_fill_value = self.model_runner.draft_attn_backend.attn_backends[
            0].get_cuda_graph_seq_len_fill_value()
        if _variant == "fix":
            self.seq_lens_cpu = host(torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32),
                                     self.device)

        # Graph inputs
        dev = dict(device=self.device)
        self.input_ids = torch.zeros((self.max_num_token,), dtype=torch.int64, **dev)
        self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int32, **dev)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32, **dev)
        self.out_cache_loc = torch.zeros((self.max_num_token * self.speculative_num_steps,), dtype=torch.int64, **dev)
        self.positions = torch.zeros((self.max_num_token,), dtype=torch.int64, **dev)
        self.topk_p = torch.zeros((self.max_bs, self.topk), dtype=DTYPE, **dev)
        self.topk_index = torch.zeros((self.max_bs, self.topk), dtype=torch.int64, **dev)
        self.hidden_states = torch.zeros((self.max_bs, HIDDEN), dtype=DTYPE, **dev)

        self.capture()

    def can_run(self, forward_batch: ForwardBatch):
        return (forward_batch.batch_size in self.graphs if self.disable_padding
                else forward_batch.batch_size <= self.max_bs)

    def capture(self):
        # CudaGraphRunner.capture: reverse the order to enable better memory sharing across cuda graphs.
        self.pool = graph_pool_handle(self.device)
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, None)

    def capture_one_batch_size(self, num_seqs: int, forward: Callable):
        num_tokens = num_seqs * self.num_tokens_per_bs

        # Graph inputs
        req_pool_indices = self.req_pool_indices[:num_seqs]
        seq_lens = self.seq_lens[:num_seqs]
        out_cache_loc = self.out_cache_loc[: num_tokens * self.speculative_num_steps]
        positions = self.positions[:num_tokens]
        topk_p = self.topk_p[:num_seqs]
        topk_index = self.topk_index[:num_seqs]
        hidden_states = self.hidden_states[:num_seqs]

        spec_info = EagleDraftInput(topk_p=topk_p, topk_index=topk_index, hidden_states=hidden_states)

        # Forward batch
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=num_seqs, input_ids=None, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, req_to_token_pool=self.model_runner.req_to_token_pool,
            token_to_kv_pool=self.model_runner.token_to_kv_pool, out_cache_loc=out_cache_loc,
            seq_lens_sum=seq_lens.sum(), positions=positions, spec_info=spec_info,
            capture_hidden_mode=spec_info.capture_hidden_mode)

        # Attention backend
        self.model_runner.draft_attn_backend.init_forward_metadata_capture_cuda_graph(forward_batch)

        # Run and capture
        def run_once():
            # Backup two fields, which will be modified in-place in `draft_forward`.
            output_cache_loc_backup = forward_batch.out_cache_loc
            hidden_states_backup = forward_batch.spec_info.hidden_states
            ret = self.eagle_worker.draft_forward(forward_batch)
            forward_batch.out_cache_loc = output_cache_loc_backup
            forward_batch.spec_info.hidden_states = hidden_states_backup
            return tuple(ret[0] + ret[1] + ret[2])

        backend = self.model_runner.draft_attn_backend
        return capture(run_once, device=self.device, pool=self.pool, warmups=2,
                       static={"out_cache_loc": self.out_cache_loc, "positions": self.positions,
                               "topk_p": self.topk_p, "topk_index": self.topk_index,
                               "hidden_states": self.hidden_states, "kv_indptr": backend.kv_indptr,
                               "cuda_graph_kv_indices": backend.cuda_graph_kv_indices},
                       state={"kv_buffer": self.model_runner.token_to_kv_pool.kv_buffer[0]},
                       owner="EAGLEDraftCudaGraphRunner", name=f"draft decode bs={num_seqs}")

    def _postprocess_output_to_raw_bs(self, out, raw_bs):
        score_list, token_list, parents_list = out
        score_list = [x[:raw_bs] for x in score_list]
        token_list = [x[:raw_bs] for x in token_list]
        parents_list = [x[:raw_bs] for x in parents_list]
        return (score_list, token_list, parents_list)

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
            self.positions.zero_()

        num_tokens = bs * self.num_tokens_per_bs

        # Common inputs
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[: raw_num_token * self.speculative_num_steps].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        self.topk_p[:raw_bs].copy_(forward_batch.spec_info.topk_p)
        self.topk_index[:raw_bs].copy_(forward_batch.spec_info.topk_index)
        self.hidden_states[:raw_bs].copy_(forward_batch.spec_info.hidden_states)

        # Attention backend
        if bs != raw_bs:
            forward_batch.batch_size = bs
            forward_batch.seq_lens = self.seq_lens[:bs]
            forward_batch.req_pool_indices = self.req_pool_indices[:bs]
            forward_batch.positions = self.positions[:num_tokens]

        if _variant == "fix":
            # Special handle for seq_len_cpu used when flashinfer mla is used
            if (forward_batch.decode_seq_lens_cpu is not None) and (bs != raw_bs):
                self.seq_lens_cpu.fill_(1)
                self.seq_lens_cpu[:raw_bs].copy_(forward_batch.decode_seq_lens_cpu)
                forward_batch.decode_seq_lens_cpu = self.seq_lens_cpu[:bs]

        self.model_runner.draft_attn_backend.init_forward_metadata_replay_cuda_graph(forward_batch, bs)

        # Replay
        flat = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs,
                      padded={"topk_p": self.topk_p, "topk_index": self.topk_index,
                              "hidden_states": self.hidden_states})
        n = self.speculative_num_steps
        out = (list(flat[:n]), list(flat[n: 2 * n]), list(flat[2 * n:]))

        if bs != raw_bs:
            out = self._postprocess_output_to_raw_bs(out, raw_bs)
            forward_batch.batch_size = raw_bs
            forward_batch.positions = self.positions[:raw_num_token]
            forward_batch.seq_lens = self.seq_lens[:raw_bs]
            forward_batch.req_pool_indices = self.req_pool_indices[:raw_bs]
            if _variant == "fix" and forward_batch.decode_seq_lens_cpu is not None:
                forward_batch.decode_seq_lens_cpu = self.seq_lens_cpu[:raw_bs]

        return out


# --- sglang/srt/speculative/eagle_worker.py (draft decode, reduced) ---------------------------------------------------

class EAGLEWorker:
    def __init__(self, device, use_cuda_graph, req_to_token_pool, token_to_kv_pool):
        self.topk, self.speculative_num_steps = SPECULATIVE_EAGLE_TOPK, SPECULATIVE_NUM_STEPS
        self.hot_token_id = None
        self.model_runner = self.draft_model_runner = ModelRunner(device, req_to_token_pool, token_to_kv_pool)
        # init_attention_backend: FlashInfer MLA multi-step draft backend
        self.draft_attn_backend = FlashInferMLAMultiStepDraftBackend(self.draft_model_runner, self.topk,
                                                                     self.speculative_num_steps)
        self.draft_model_runner.draft_attn_backend = self.draft_attn_backend
        # init_cuda_graphs
        self.cuda_graph_runner = EAGLEDraftCudaGraphRunner(self) if use_cuda_graph else None

    def draft(self, batch: ScheduleBatch):
        num_seqs = batch.batch_size()
        spec_info = batch.spec_info

        # Allocate cache locations
        out_cache_loc = batch.alloc_token_slots(num_seqs * self.topk * self.speculative_num_steps)
        assign_draft_cache_locs(batch.req_pool_indices, batch.req_to_token_pool.req_to_token, batch.seq_lens,
                                out_cache_loc, batch.req_to_token_pool.req_to_token.shape[1], self.topk,
                                self.speculative_num_steps)
        batch.out_cache_loc = out_cache_loc
        batch.seq_lens_sum = torch.sum(batch.seq_lens).item()
        spec_info.positions = batch.seq_lens.repeat_interleave(self.topk, dim=0).to(torch.int64)

        # Get forward batch
        spec_info.capture_hidden_mode = CaptureHiddenMode.LAST
        model_worker_batch = batch.get_model_worker_batch()
        forward_batch = ForwardBatch.init_new(model_worker_batch, self.draft_model_runner)
        can_cuda_graph = self.cuda_graph_runner and self.cuda_graph_runner.can_run(forward_batch)
        if can_cuda_graph:
            score_list, token_list, parents_list = self.cuda_graph_runner.replay(forward_batch)
        else:
            # Initialize attention backend
            self.draft_attn_backend.init_forward_metadata(forward_batch)
            forward_batch = ForwardBatch.init_new(model_worker_batch, self.draft_model_runner)
            # Run forward steps
            score_list, token_list, parents_list = self.draft_forward(forward_batch)
        # (EagleVerifyInput.create consumes the lists here; the tree is compared instead)
        return torch.cat([torch.cat([s.reshape(num_seqs, -1) for s in score_list], dim=1),
                          torch.cat(token_list, dim=1).to(DTYPE),
                          torch.cat(parents_list, dim=1).to(DTYPE)], dim=1)

    def draft_forward(self, forward_batch: ForwardBatch):
        # Parse args
        spec_info = forward_batch.spec_info
        out_cache_loc = forward_batch.out_cache_loc
        topk_p, topk_index, hidden_states = spec_info.topk_p, spec_info.topk_index, spec_info.hidden_states

        # Return values
        score_list: List[torch.Tensor] = []
        token_list: List[torch.Tensor] = []
        parents_list: List[torch.Tensor] = []

        # Forward multiple steps
        scores = None
        for i in range(self.speculative_num_steps):
            input_ids, hidden_states, scores, tree_info = select_top_k_tokens(
                i, topk_p, topk_index, hidden_states, scores, self.topk)
            score_list.append(tree_info[0])
            token_list.append(tree_info[1])
            parents_list.append(tree_info[2])

            # We don't need to run the last forward.
            if i == self.speculative_num_steps - 1:
                break

            # Set inputs
            forward_batch.input_ids = input_ids
            out_cache_loc = out_cache_loc.view(forward_batch.batch_size, -1)
            forward_batch.out_cache_loc = out_cache_loc[:, self.topk * i: self.topk * (i + 1)].flatten()
            forward_batch.positions.add_(1)
            forward_batch.attn_backend = self.draft_attn_backend.attn_backends[i]
            spec_info.hidden_states = hidden_states

            # Run forward
            logits_output = self.draft_model_runner.model.forward(forward_batch.input_ids, forward_batch.positions,
                                                                  forward_batch)
            probs = torch.softmax(logits_output.next_token_logits, dim=-1)
            topk_p, topk_index = fast_topk(probs, self.topk, dim=-1)
            hidden_states = logits_output.hidden_states

        return score_list, token_list, parents_list


# --- the workload -----------------------------------------------------------------------------------------------------

# (request pool indices, their committed lengths) per draft round; 3 requests replay on the bs=4 graph
ROUNDS = (([0, 1], [5, 7]), ([2, 3, 4], [4, 6, 3]), ([5], [8]), ([0, 2, 5], [6, 5, 9]))


def _serve(device, use_cuda_graph):
    gen = generator(7)
    # prefix slots of every request, in the upper half of the pool; draft slots come from the lower half
    req_to_token = (1 + MAX_REQS * MAX_CONTEXT_LEN + torch.arange(MAX_REQS * MAX_CONTEXT_LEN)).view(
        MAX_REQS, MAX_CONTEXT_LEN).to(torch.int32).to(device)
    kv_buffer = randn(POOL_SIZE, 1, HEAD_DIM, gen=gen, device=device).to(DTYPE)
    req_to_token_pool = ReqToTokenPool(req_to_token)
    allocator = TokenToKVPoolAllocator(1 + torch.arange(MAX_REQS * MAX_CONTEXT_LEN), device)
    worker = EAGLEWorker(device, use_cuda_graph, req_to_token_pool, MLATokenToKVPool(kv_buffer))
    outs = []
    for reqs, seq_lens in ROUNDS:
        b = len(reqs)
        topk_p = torch.softmax(randn(b, VOCAB, gen=gen, device=device).to(DTYPE), dim=-1).max(dim=-1, keepdim=True)
        spec_info = EagleDraftInput(topk_p=topk_p.values,
                                    topk_index=torch.randint(0, VOCAB, (b, 1), generator=gen).to(device),
                                    hidden_states=randn(b, HIDDEN, gen=gen, device=device).to(DTYPE))
        batch = ScheduleBatch(req_pool_indices=torch.tensor(reqs, dtype=torch.int32, device=device),
                              seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), spec_info=spec_info,
                              req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
                              device=device)
        outs.append(worker.draft(batch))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
