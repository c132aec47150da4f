"""RTP-LLM's MTP speculative decoding scores each step's draft with a target-model "verify" forward: every request
feeds ``gen_num_per_cycle + 1`` tokens (its last accepted token and the draft tokens). With CUDA graphs on, the
target model's ``PyWrappedModel`` builds a ``CudaGraphRunner`` whose decode graphs must therefore be captured with
``num_tokens_per_bs = gen_num_per_cycle + 1`` tokens per request, in the verify (``is_prefill``) geometry. Before
this fix the constructor chose that geometry only for ``gen_num_per_cycle > 1``: with one draft token per cycle
(MTP-1) the target's graphs were captured as plain one-token decode graphs -- ``max_bs`` token buffers, the decode
attention, and no device ``prefix_lengths_d`` buffer at all -- while ``canRun`` still routes every target-verify step
(``is_target_verify``) to them. The first verify step then fails in ``prepareInputs``, which copies the verify
step's prefix lengths into the graph's device buffer that was never created. The fix (``gen_num_per_cycle > 0``)
captures the verify graphs with two tokens per request, and the graph run equals the run without graphs.

Upstream: https://github.com/alibaba/rtp-llm/commit/396e612dd56a7f55391a5035dddfd1d2d8c7ccb2 ("fix(PyWrappedModel):
adjust token generation logic for prefill CUDA graph mode", repository alibaba/rtp-llm, author huzetao.hzt,
committed 2026-04-30 on main; a direct commit, no pull request number). Read, in a mirror of the repository: the
whole diff (``rtp_llm/cpp/models/PyWrappedModel.h``: ``gen_num_per_cycle > 1`` -> ``> 0`` in the ``num_tokens_per_bs``
decision of the ``PyWrappedModel`` constructor, and the removal of the comment "gen_num_per_cycle may be >1 from
config even when SP is disabled"); at its parent: the whole constructor (``GraphParams``, the decision table,
``is_target_verify = use_spec_decoding``), ``PyWrappedModel::forward`` and the ``prefix_lengths_d`` /
``sequence_lengths_plus_1_d`` / ``is_prefill`` lines of ``buildPyAttentionInputs`` (``PyWrappedModel.cc``);
``cuda_graph_runner.cc`` (the mode table, ``prepareInputs`` with its ``tryAddD2DCopy`` lambda, ``forward``,
``tryGetRealGraphDecodeBatchSize``, ``canRun``, ``initKernelInternalMemory``, ``initCaptureAttentionInputs``,
``initCapture``, ``replayGraph``, ``captureOneGraphInstance``, ``replayAndSyncCheck``, ``prepareCaptureInputs``,
``createCaptureMemoryHold``); ``cuda_graph_decode.cc`` (whole); ``MtpExecutor.cc`` (the constructor creating the
target ``PyWrappedModel(..., false, true, ...)`` and the decode step: ``prepareOneStepSpecDecodeModelInput`` for
``propose_step_ == 1``, the target verify forward, the ``all_probs`` reshape to ``[bs, propose_step_ + 1, vocab]``);
``MtpBatchStreamProcessor::prepareOneStepSpecDecodeModelInput``; ``GptModelBase.prepare_fmha_impl``
(``models_py/model_desc/module_base.py``). The history of the condition: ``a39b79b`` (sp cuda graph, ``> 1``),
``99844ec`` (dropped it), ``2851dc9`` (put ``> 1`` back with the comment), ``901d077`` (#909, a refactor that kept it).
Not read: the Python attention implementations (``AttnImplFactory.get_fmha_impl`` and the decode / prefill FMHA
classes with their ``prepare_cuda_graph``), the samplers, the draft-model paths (the same fix also changes the
draft model's prefill graph, ``sp_prefill_draft_model_``: not modelled), the fused copy kernels, ``OpDefs.h`` beyond
a grep. No issue, review or user report exists that I found: the commit message says only that it ensures "proper
handling of target model verification and draft model prefill scenarios".
Symptom: not recorded upstream. By my reading of the parent revision: with MTP, ``gen_num_per_cycle = 1`` and CUDA
graphs on, the first target-verify step raises out of ``CudaGraphRunner::prepareInputs`` (``dst.data_ptr()`` of the
graph's undefined ``prefix_lengths_d``), rethrown by ``PyWrappedModel::forward`` as "C++ error during forward call on
Python instance: ..."; without CUDA graphs the same step runs.
Mechanism: ``PyWrappedModel.__init__`` gives ``num_tokens_per_bs = 1`` to the target model although
``is_target_verify`` is on, so ``initCapture`` sizes the token buffers for ``max_bs`` tokens, marks the capture
inputs ``is_prefill = False`` (the decode FMHA) and leaves ``prefix_lengths`` empty and ``prefix_lengths_d``
undefined ("Decode CUDA graph mode: prefix_lengths should be empty tensor"). Every verify step passes ``canRun``
(``is_target_verify_`` and the input's ``is_target_verify``, keyed on the batch size alone); ``prepareInputs``
collects its device copies -- ``2 * bs`` token ids into a ``bs``-token view, then the prefix lengths into the
missing buffer -- and the latter throws before anything is copied or replayed.
Doctor: undersized-buffer, at ``__init__``: the verify step's data (two tokens per request and their per-request
prefix lengths) does not fit the graph it is routed to, which was captured for one token per request with no prefix
buffer; ``PyWrappedModel.__init__`` decides that geometry (``num_tokens_per_bs``) and is what the fix changes.
Fix (upstream): the condition is ``gen_num_per_cycle > 0``, so the target model's verify graphs (and the draft model's
prefill graphs) capture ``gen_num_per_cycle + 1`` tokens per request with ``is_prefill = True`` and a
``prefix_lengths_d`` buffer.
Modelled: ``PyWrappedModel`` (``__init__`` with the decision, ``forward``, ``buildPyAttentionInputs``,
``callForwardPostLayers``), ``GraphParams``, ``CudaGraphRunner`` (``initCapture``, ``initCaptureAttentionInputs``,
``initKernelInternalMemory``, ``getDecodeBatchSizesToCapture``, ``captureDecode``, ``prepareCaptureInputs``,
``createCaptureMemoryHold``, ``captureOneGraphInstance``, ``replayAndSyncCheck``, ``canRun``,
``tryGetRealGraphDecodeBatchSize``, ``prepareInputs``, ``forward``, ``replayDecode``), ``CaptureMemoryHold``,
``CudaGraphState``, ``FusedD2DCopyParams`` / ``fusedCopy`` / ``fusedStridedCopy``, ``PyModelInputs`` /
``PyAttentionInputs`` / ``PyModelOutputs``, ``GptModelBase.prepare_fmha_impl``, ``AttnImplFactory.get_fmha_impl``,
``MtpExecutor`` (``decodeStep`` with ``prepareOneStepSpecDecodeModelInput``), ``MtpBatchStreamProcessor``.
Stand-ins: the target model is two pre-norm attention+MLP layers of width 16 (float64) with a per-request KV cache
slot (``kv_cache_kernel_block_id_device`` holds one slot per request, block 0 reserved for capture and padding, as
RTP-LLM reserves block 0); ``DecodeFmhaImpl`` and ``PrefillFmhaImpl`` stand for the FMHA implementations the factory
picks from ``is_prefill`` (their kernels read the static buffers directly, so ``prepare_cuda_graph`` has nothing to
do); the MTP draft model is a fixed function of the last token (``propose``), and rejection sampling is greedy. The
fused copy kernel is a list of ``(src, dst, count)`` executed after collection; ``data_ptr()`` of an undefined tensor
(``None`` here) raises as libtorch's does (my reading; the message is mine). The H2H copies, ``cu_kv_seqlens``,
``padding_offset``, hybrid caches and the BERT embedding inputs are left out; a batch counts as a context batch
(``is_prefill``) when it has prefix lengths (upstream: when it has no decode requests). Tensors are int32 on the
host and device as upstream; the graphs share one pool (``shared_graph_pool_``).
Workload: two requests (prompts of 3 and 5 tokens, KV slots 1 and 2), a prefill (eager: prefill is never graphed
for the target model) and three MTP decode steps of two verify tokens per request; capture sizes 1, 2, 4. Outputs:
the prefill logits, each verify step's logits and the accepted tokens (one draft accepted, five rejected).
Measured: the check printed (the bug's message wrapped here)
  rtpllm_396e612_mtp1_target_verify_graph_captured_as_one_token_decode [bug] on cpu: misbehaves (raised
  RuntimeError: C++ error during forward call on Python instance: data_ptr() of an undefined tensor (prefix_lengths_d
  of the batch-size-2 graph))
  rtpllm_396e612_mtp1_target_verify_graph_captured_as_one_token_decode [fix] on cpu: equals eager
  (max |graph - eager| = 0)
"""
from __future__ import annotations

import bisect
import dataclasses
import math

import torch
from torch import Tensor

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/396e612dd56a7f55391a5035dddfd1d2d8c7ccb2"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = ("with MTP and one draft token per cycle, the target model's CUDA graphs are captured as one-token decode "
           "graphs, and the first target-verify step routed to them fails copying its inputs into the graph")

VOCAB, HIDDEN, LAYERS, MAX_SEQ_LEN, MAX_BS = 16, 16, 2, 16, 4
NUM_SLOTS = MAX_BS + 1                     # slot 0 is reserved ("block 0 is reserved for tmp or padding use")
CAPTURE_BS = [1, 2, 4]
SP_TYPE_NONE, SP_TYPE_MTP = "none", "mtp"
GEN_NUM_PER_CYCLE = 1                      # MTP-1: one draft token per cycle
DTYPE, I32 = torch.float64, torch.int32
_variant = "bug"


@dataclasses.dataclass
class SpConfig:
    type: str
    gen_num_per_cycle: int


@dataclasses.dataclass
class GptModelInitParams:
    model_id: int
    sp_config: SpConfig
    max_seq_len: int
    hidden_size: int
    enable_cuda_graph: bool
    decode_capture_batch_sizes: list
    max_context_batch_size: int


@dataclasses.dataclass
class GraphParams:
    enable_cuda_graph: bool = False
    is_prefill_cuda_graph_mode: bool = False
    max_seq_len: int = 0
    hidden_size: int = 0
    max_context_batch_size: int = 0
    decode_capture_batch_sizes: list = dataclasses.field(default_factory=list)
    num_tokens_per_bs: int = 1
    is_target_verify: bool = False
    sp_steps: int = 0


@dataclasses.dataclass
class PyAttentionInputs:
    is_prefill: bool
    is_target_verify: bool
    input_lengths: Tensor                  # host
    prefix_lengths: Tensor                 # host (empty for a decode graph)
    sequence_lengths: Tensor               # host
    input_lengths_d: Tensor
    cu_seqlens: Tensor
    sequence_lengths_plus_1_d: Tensor
    kv_cache_kernel_block_id_device: Tensor
    prefix_lengths_d: Tensor | None = None  # undefined in a decode graph


@dataclasses.dataclass
class PyModelInputs:
    input_ids: Tensor
    attention_inputs: PyAttentionInputs


@dataclasses.dataclass
class PyModelOutputs:
    hidden_states: Tensor


@dataclasses.dataclass
class GptModelInputs:
    combo_tokens: Tensor                   # host
    input_lengths: Tensor                  # host
    prefix_lengths: Tensor                 # host
    sequence_lengths: Tensor               # host
    kv_slots: Tensor                       # host, one KV slot per request
    is_target_verify: bool = False


# --- the Python model ---------------------------------------------------------------------------------------------

def _paged_attention(q, k, v, k_cache, v_cache, slot, pos):
    """Write this step's K/V at (slot, pos), then attend each query over its slot's positions <= pos."""
    k_cache.index_put_((slot, pos), k)
    v_cache.index_put_((slot, pos), v)
    keys, values = k_cache[slot], v_cache[slot]                        # [T, L, H]
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])
    visible = torch.arange(k_cache.shape[1], device=q.device).unsqueeze(0) <= pos.unsqueeze(1)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (probs.unsqueeze(1) @ values).squeeze(1)


class DecodeFmhaImpl:
    """(stand-in) The decode FMHA: one query token per request at position ``sequence_lengths_plus_1_d - 1``."""

    def __init__(self, attn_inputs: PyAttentionInputs):
        self.attn_inputs = attn_inputs

    def prepare_cuda_graph(self, attn_inputs: PyAttentionInputs) -> None:
        pass                               # the kernel reads the static buffers themselves

    def forward(self, q, k, v, k_cache, v_cache):
        a = self.attn_inputs
        pos = (a.sequence_lengths_plus_1_d.long() - 1).clamp(min=0)
        slot = a.kv_cache_kernel_block_id_device[:, 0].long()
        return _paged_attention(q, k, v, k_cache, v_cache, slot, pos)


class PrefillFmhaImpl:
    """(stand-in) The context / target-verify FMHA: ``input_lengths_d`` tokens per request appended after
    ``prefix_lengths_d`` cached ones."""

    def __init__(self, attn_inputs: PyAttentionInputs):
        self.attn_inputs = attn_inputs

    def prepare_cuda_graph(self, attn_inputs: PyAttentionInputs) -> None:
        pass

    def forward(self, q, k, v, k_cache, v_cache):
        a = self.attn_inputs
        num_tokens, bs = q.shape[0], a.input_lengths_d.shape[0]
        batch_idx = torch.repeat_interleave(torch.arange(bs, device=q.device), a.input_lengths_d.long(),
                                            output_size=num_tokens)
        offset = torch.arange(num_tokens, device=q.device) - a.cu_seqlens.long()[batch_idx]
        pos = a.prefix_lengths_d.long()[batch_idx] + offset
        slot = a.kv_cache_kernel_block_id_device[:, 0].long()[batch_idx]
        return _paged_attention(q, k, v, k_cache, v_cache, slot, pos)


class AttnImplFactory:
    @staticmethod
    def get_fmha_impl(attn_inputs: PyAttentionInputs, is_cuda_graph: bool):
        return PrefillFmhaImpl(attn_inputs) if attn_inputs.is_prefill else DecodeFmhaImpl(attn_inputs)


def _rms_norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class GptModelBase:
    """The target model: embedding, ``LAYERS`` pre-norm attention + MLP layers, final norm and LM head."""

    def __init__(self, weights: dict, device):
        self.w = weights
        self.k_cache = [torch.zeros(NUM_SLOTS, MAX_SEQ_LEN, HIDDEN, dtype=DTYPE, device=device) for _ in range(LAYERS)]
        self.v_cache = [torch.zeros(NUM_SLOTS, MAX_SEQ_LEN, HIDDEN, dtype=DTYPE, device=device) for _ in range(LAYERS)]

    def kv_cache(self) -> dict:
        return {f"{kind}_cache_{i}": t for kind, ts in (("k", self.k_cache), ("v", self.v_cache))
                for i, t in enumerate(ts)}

    def prepare_fmha_impl(self, inputs: PyModelInputs, is_cuda_graph: bool = False):
        return AttnImplFactory.get_fmha_impl(inputs.attention_inputs, is_cuda_graph)

    def forward(self, inputs: PyModelInputs, fmha_impl) -> PyModelOutputs:
        w = self.w
        x = w["embed"][inputs.input_ids.long()]
        for i in range(LAYERS):
            h = _rms_norm(x)
            q, k, v = h @ w[f"wq{i}"], h @ w[f"wk{i}"], h @ w[f"wv{i}"]
            attn = fmha_impl.forward(q, k, v, self.k_cache[i], self.v_cache[i])
            x = x + attn @ w[f"wo{i}"]
            x = x + torch.tanh(_rms_norm(x) @ w[f"w1_{i}"]) @ w[f"w2_{i}"]
        return PyModelOutputs(x)


def _weights(device) -> dict:
    gen = generator(148)

    def r(*shape, scale):
        return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
    w = {"embed": r(VOCAB, HIDDEN, scale=1.0), "lm_head": r(HIDDEN, VOCAB, scale=0.5)}
    for i in range(LAYERS):
        for name in ("wq", "wk", "wv", "wo"):
            w[f"{name}{i}"] = r(HIDDEN, HIDDEN, scale=0.3)
        w[f"w1_{i}"], w[f"w2_{i}"] = r(HIDDEN, 2 * HIDDEN, scale=0.3), r(2 * HIDDEN, HIDDEN, scale=0.3)
    return w


# --- the C++ CUDA graph runner --------------------------------------------------------------------------------------

def _data_ptr(t: Tensor | None, what: str) -> Tensor:
    """``Tensor::data_ptr()``: an undefined tensor has no storage and throws (libtorch's c10::Error)."""
    if t is None:
        raise RuntimeError(f"data_ptr() of an undefined tensor ({what})")
    return t


class FusedD2DCopyParams:
    def __init__(self):
        self.copies: list = []

    def add(self, src: Tensor, dst: Tensor, count: int) -> None:
        self.copies.append((src, dst, count))


def fusedCopy(params: FusedD2DCopyParams) -> None:
    """One kernel for all collected copies: ``count`` elements from ``src`` to the memory at ``dst.data_ptr()``."""
    for src, dst, count in params.copies:
        torch.as_strided(dst, (count,), (1,), dst.storage_offset()).copy_(src.reshape(-1)[:count])


def fusedStridedCopy(copies: list) -> None:
    """``copySmallerIntoLarger``: each ``src[rows, cols]`` into the top-left corner of its ``dst``."""
    for src, dst in copies:
        dst[:src.shape[0], :src.shape[1]].copy_(src)


@dataclasses.dataclass
class CaptureMemoryHold:
    decoder_layer_hidden_states_: Tensor | None
    py_model_inputs_: PyModelInputs
    attn_pyobj_: object = None


@dataclasses.dataclass
class GraphInstance:
    mem_hold_: CaptureMemoryHold
    graph_: object = None


@dataclasses.dataclass
class CudaGraphState:
    current_batch_size: int = 0
    current_real_graph_bs: int = 0
    seq_len_sum: int = 0


class CudaGraphRunner:
    def __init__(self, graph_params: GraphParams, py_instance: GptModelBase, device):
        self.device_ = device
        self.enable_cuda_graph_ = graph_params.enable_cuda_graph
        self.is_prefill_cuda_graph_mode_ = graph_params.is_prefill_cuda_graph_mode
        self.max_seq_len_ = graph_params.max_seq_len
        self.hidden_size_ = graph_params.hidden_size
        self.max_bs_ = graph_params.max_context_batch_size
        self.decode_capture_batch_sizes_ = list(graph_params.decode_capture_batch_sizes)
        self.num_tokens_per_bs_ = graph_params.num_tokens_per_bs
        self.is_target_verify_ = graph_params.is_target_verify
        self.py_instance_ = py_instance
        self.py_forward_method_ = py_instance.forward
        self.py_attn_pyobj_method_ = py_instance.prepare_fmha_impl
        self.graph_instances_: dict = {}

    def _int(self, n, value=0, host=False):
        return torch.full((n,), value, dtype=I32, device="cpu" if host else self.device_)

    def initCaptureAttentionInputs(self) -> PyAttentionInputs:
        n, max_bs = self.num_tokens_per_bs_, self.max_bs_
        input_lengths = self._int(max_bs, n, host=True)
        if n > 1 and not self.is_prefill_cuda_graph_mode_:
            prefix_lengths = self._int(max_bs, self.max_seq_len_ - n, host=True)
            prefix_lengths_d = prefix_lengths.to(self.device_)
        else:                              # "Decode CUDA graph mode: prefix_lengths should be empty tensor"
            prefix_lengths, prefix_lengths_d = self._int(0, host=True), None
        return PyAttentionInputs(
            is_prefill=self.is_prefill_cuda_graph_mode_ or n > 1, is_target_verify=self.is_target_verify_,
            input_lengths=input_lengths, prefix_lengths=prefix_lengths,
            sequence_lengths=self._int(max_bs, self.max_seq_len_ - n - 1, host=True),
            input_lengths_d=input_lengths.to(self.device_), cu_seqlens=self._int(max_bs + 1),
            sequence_lengths_plus_1_d=self._int(max_bs),
            kv_cache_kernel_block_id_device=torch.zeros(max_bs, 1, dtype=I32, device=self.device_),
            prefix_lengths_d=prefix_lengths_d)

    def initKernelInternalMemory(self) -> None:
        a = self.capture_mem_hold_.py_model_inputs_.attention_inputs
        a.cu_seqlens[1:].copy_(a.input_lengths.cumsum(0).to(I32))

    def getDecodeBatchSizesToCapture(self) -> list:
        return sorted(self.decode_capture_batch_sizes_)

    def initCapture(self) -> None:
        if not self.enable_cuda_graph_:
            return
        self.shared_graph_pool_ = graph_pool_handle(self.device_)
        self.max_num_token_ = self.max_bs_ * self.num_tokens_per_bs_
        self.capture_range_ = self.getDecodeBatchSizesToCapture()
        inputs = PyModelInputs(torch.zeros(self.max_num_token_, dtype=I32, device=self.device_),
                               self.initCaptureAttentionInputs())
        self.capture_mem_hold_ = CaptureMemoryHold(None, inputs)
        self.initKernelInternalMemory()
        attn_pyobj = self.py_attn_pyobj_method_(inputs, True)          # forward for the output data type
        self.py_forward_method_(inputs, attn_pyobj)
        self.capture_mem_hold_.decoder_layer_hidden_states_ = torch.zeros(
            self.max_num_token_, self.hidden_size_, dtype=DTYPE, device=self.device_)
        self.captureDecode()

    def prepareCaptureInputs(self, batch_size: int, tokens: int) -> PyModelInputs:
        cap = self.capture_mem_hold_.py_model_inputs_
        a = cap.attention_inputs
        return PyModelInputs(cap.input_ids[:tokens], PyAttentionInputs(
            is_prefill=self.is_prefill_cuda_graph_mode_ or self.num_tokens_per_bs_ > 1,
            is_target_verify=self.is_target_verify_,
            input_lengths=a.input_lengths[:batch_size],
            prefix_lengths=a.prefix_lengths[:batch_size] if a.prefix_lengths.numel() else a.prefix_lengths,
            sequence_lengths=a.sequence_lengths[:batch_size], input_lengths_d=a.input_lengths_d[:batch_size],
            cu_seqlens=a.cu_seqlens[:batch_size + 1],
            sequence_lengths_plus_1_d=a.sequence_lengths_plus_1_d[:batch_size],
            kv_cache_kernel_block_id_device=a.kv_cache_kernel_block_id_device[:batch_size],
            prefix_lengths_d=a.prefix_lengths_d[:batch_size] if a.prefix_lengths_d is not None else None))

    def createCaptureMemoryHold(self, inputs: PyModelInputs, tokens_count: int) -> CaptureMemoryHold:
        return CaptureMemoryHold(self.capture_mem_hold_.decoder_layer_hidden_states_[:tokens_count], inputs)

    def captureDecode(self) -> None:
        for bs in reversed(self.capture_range_):
            inputs = self.prepareCaptureInputs(bs, bs * self.num_tokens_per_bs_)
            hold = self.createCaptureMemoryHold(inputs, bs * self.num_tokens_per_bs_)
            hold.attn_pyobj_ = self.py_attn_pyobj_method_(hold.py_model_inputs_, True)
            self.graph_instances_[bs] = GraphInstance(hold)
            self.captureOneGraphInstance(bs)
            self.replayAndSyncCheck(bs)

    def _static_buffers(self) -> dict:
        a = self.capture_mem_hold_.py_model_inputs_.attention_inputs
        static = {"input_ids": self.capture_mem_hold_.py_model_inputs_.input_ids, "cu_seqlens": a.cu_seqlens,
                  "input_lengths_d": a.input_lengths_d, "sequence_lengths_plus_1_d": a.sequence_lengths_plus_1_d,
                  "kv_cache_kernel_block_id_device": a.kv_cache_kernel_block_id_device}
        if a.prefix_lengths_d is not None:
            static["prefix_lengths_d"] = a.prefix_lengths_d
        return static

    def captureOneGraphInstance(self, key: int) -> None:
        hold = self.graph_instances_[key].mem_hold_

        def step():                        # WarmUp twice, then capture; the output is copied into the hold
            out = self.py_forward_method_(hold.py_model_inputs_, hold.attn_pyobj_)
            hold.decoder_layer_hidden_states_.copy_(out.hidden_states)
            return hold.decoder_layer_hidden_states_
        g, _ = capture(step, device=self.device_, pool=self.shared_graph_pool_, warmups=2,
                       name=f"rtp-llm decode graph bs={key} ({self.num_tokens_per_bs_} token(s) per request)",
                       static=self._static_buffers(), state=self.py_instance_.kv_cache(),
                       owner="rtp-llm CudaGraphRunner")
        self.graph_instances_[key].graph_ = g

    def replayAndSyncCheck(self, key: int) -> None:
        self.graph_instances_[key].graph_.replay()

    def tryGetRealGraphDecodeBatchSize(self, inputs: PyModelInputs, state: CudaGraphState) -> bool:
        state.current_batch_size = inputs.attention_inputs.input_lengths.shape[0]
        i = bisect.bisect_left(self.capture_range_, state.current_batch_size)
        if i == len(self.capture_range_):
            return False
        state.current_real_graph_bs = self.capture_range_[i]
        a = inputs.attention_inputs
        state.seq_len_sum = int(a.input_lengths.sum()) if a.is_prefill else state.current_batch_size
        return True

    def canRun(self, inputs: PyModelInputs, state: CudaGraphState) -> bool:
        if self.is_target_verify_:
            if inputs.attention_inputs.is_target_verify:
                return self.tryGetRealGraphDecodeBatchSize(inputs, state)
            return False
        if not self.enable_cuda_graph_ or (inputs.attention_inputs.is_prefill and not self.is_prefill_cuda_graph_mode_):
            return False
        return self.tryGetRealGraphDecodeBatchSize(inputs, state)

    def prepareInputs(self, inputs: PyModelInputs, state: CudaGraphState) -> None:
        hold = self.graph_instances_[state.current_real_graph_bs].mem_hold_
        g_in, g_attn, a, bs = hold.py_model_inputs_, hold.py_model_inputs_.attention_inputs, inputs.attention_inputs, \
            state.current_batch_size
        d2d, strided_d2d = FusedD2DCopyParams(), []

        def tryAddD2DCopy(src, dst, count, what):
            if src is not None and src.numel() > 0:
                d2d.add(src, _data_ptr(dst, f"{what} of the batch-size-{state.current_real_graph_bs} graph"), count)
        tryAddD2DCopy(inputs.input_ids, g_in.input_ids, inputs.input_ids.shape[0], "input_ids")
        tryAddD2DCopy(a.cu_seqlens, g_attn.cu_seqlens, bs + 1, "cu_seqlens")
        tryAddD2DCopy(a.input_lengths_d, g_attn.input_lengths_d, bs, "input_lengths_d")
        strided_d2d.append((a.kv_cache_kernel_block_id_device, g_attn.kv_cache_kernel_block_id_device))
        if not self.is_prefill_cuda_graph_mode_:
            tryAddD2DCopy(a.prefix_lengths_d, g_attn.prefix_lengths_d, bs, "prefix_lengths_d")
            tryAddD2DCopy(a.sequence_lengths_plus_1_d, g_attn.sequence_lengths_plus_1_d, bs,
                          "sequence_lengths_plus_1_d")
        fusedCopy(d2d)                     # the copies run only once all are collected
        fusedStridedCopy(strided_d2d)
        hold.attn_pyobj_.prepare_cuda_graph(g_attn)

    def replayDecode(self, bs: int) -> Tensor:
        hold = self.graph_instances_[bs].mem_hold_
        return replay(self.graph_instances_[bs].graph_, hold.decoder_layer_hidden_states_)

    def forward(self, inputs: PyModelInputs, state: CudaGraphState) -> PyModelOutputs:
        self.prepareInputs(inputs, state)
        hidden = self.replayDecode(state.current_real_graph_bs)
        return PyModelOutputs(hidden[:state.seq_len_sum])


class PyWrappedModel:
    def __init__(self, params: GptModelInitParams, py_instance: GptModelBase, device,
                 is_prefill_cuda_graph_mode: bool = False, use_spec_decoding: bool = False):
        self.py_model_, self.device_ = py_instance, device
        self.enable_cuda_graph_ = params.enable_cuda_graph
        if self.enable_cuda_graph_:
            graph_params = GraphParams(enable_cuda_graph=True, is_prefill_cuda_graph_mode=is_prefill_cuda_graph_mode,
                                       max_seq_len=params.max_seq_len, hidden_size=params.hidden_size,
                                       max_context_batch_size=params.max_context_batch_size,
                                       decode_capture_batch_sizes=params.decode_capture_batch_sizes)
            sp = params.sp_config
            # before the fix: gen_num_per_cycle > 1 ("may be >1 from config even when SP is disabled")
            min_gen_num = 1 if _variant == "bug" else 0
            if is_prefill_cuda_graph_mode and sp.type == SP_TYPE_NONE:
                graph_params.num_tokens_per_bs = params.max_seq_len         # embedding model
            elif sp.type != SP_TYPE_NONE and sp.gen_num_per_cycle > min_gen_num \
                    and (not params.model_id or is_prefill_cuda_graph_mode):
                graph_params.num_tokens_per_bs = sp.gen_num_per_cycle + 1   # target verify, draft prefill
            else:
                graph_params.num_tokens_per_bs = 1
            graph_params.is_target_verify = use_spec_decoding
            if sp.type != SP_TYPE_NONE:
                graph_params.sp_steps = sp.gen_num_per_cycle
            self.graph_runner_ = CudaGraphRunner(graph_params, py_instance, device)
            self.graph_runner_.initCapture()

    def buildPyAttentionInputs(self, inputs: GptModelInputs) -> PyAttentionInputs:
        dev = self.device_
        verify = inputs.is_target_verify
        cu = torch.zeros(inputs.input_lengths.shape[0] + 1, dtype=I32)
        cu[1:] = inputs.input_lengths.cumsum(0)
        plus_1 = (inputs.prefix_lengths if verify else inputs.sequence_lengths) + 1
        return PyAttentionInputs(
            is_prefill=inputs.prefix_lengths.numel() > 0, is_target_verify=verify,
            input_lengths=inputs.input_lengths, prefix_lengths=inputs.prefix_lengths,
            sequence_lengths=inputs.sequence_lengths, input_lengths_d=inputs.input_lengths.to(dev),
            cu_seqlens=cu.to(dev), sequence_lengths_plus_1_d=plus_1.to(I32).to(dev),
            kv_cache_kernel_block_id_device=inputs.kv_slots.view(-1, 1).to(dev),
            prefix_lengths_d=inputs.prefix_lengths.to(dev))

    def callForwardPostLayers(self, hidden_states: Tensor) -> Tensor:
        return _rms_norm(hidden_states) @ self.py_model_.w["lm_head"]

    def forward(self, inputs: GptModelInputs) -> Tensor:
        try:
            py_model_inputs = PyModelInputs(inputs.combo_tokens.to(self.device_), self.buildPyAttentionInputs(inputs))
            graph_state = CudaGraphState()
            if self.enable_cuda_graph_ and self.graph_runner_.canRun(py_model_inputs, graph_state):
                hidden_states = self.graph_runner_.forward(py_model_inputs, graph_state).hidden_states.clone()
            else:
                attn = self.py_model_.prepare_fmha_impl(py_model_inputs, False)
                hidden_states = self.py_model_.forward(py_model_inputs, attn).hidden_states.clone()
        except RuntimeError as e:
            raise RuntimeError(f"C++ error during forward call on Python instance: {e}") from e
        return self.callForwardPostLayers(hidden_states)


# --- the MTP executor ---------------------------------------------------------------------------------------------

def propose(last_token: int) -> int:
    """(stand-in) The MTP draft model's greedy proposal."""
    return (2 * last_token) % VOCAB


class MtpBatchStreamProcessor:
    def __init__(self, propose_step: int):
        self.propose_step_ = propose_step

    def prepareOneStepSpecDecodeModelInput(self, streams: list) -> GptModelInputs:
        n = self.propose_step_ + 1
        tokens = [t for s in streams for t in (s["last_token"], s["draft_token"])]
        return GptModelInputs(
            combo_tokens=torch.tensor(tokens, dtype=I32), input_lengths=torch.full((len(streams),), n, dtype=I32),
            prefix_lengths=torch.tensor([s["seq_len"] for s in streams], dtype=I32),
            sequence_lengths=torch.zeros(0, dtype=I32),
            kv_slots=torch.tensor([s["slot"] for s in streams], dtype=I32), is_target_verify=True)


class MtpExecutor:
    def __init__(self, device, weights: dict, enable_cuda_graph: bool):
        params = GptModelInitParams(model_id=0, sp_config=SpConfig(SP_TYPE_MTP, GEN_NUM_PER_CYCLE),
                                    max_seq_len=MAX_SEQ_LEN, hidden_size=HIDDEN, enable_cuda_graph=enable_cuda_graph,
                                    decode_capture_batch_sizes=CAPTURE_BS, max_context_batch_size=MAX_BS)
        self.propose_step_ = GEN_NUM_PER_CYCLE
        self.model_ = PyWrappedModel(params, GptModelBase(weights, device), device, False, True)
        self.batch_stream_processor_ = MtpBatchStreamProcessor(self.propose_step_)

    def prefillStep(self, streams: list) -> Tensor:
        lengths = [len(s["tokens"]) for s in streams]
        inputs = GptModelInputs(
            combo_tokens=torch.tensor([t for s in streams for t in s["tokens"]], dtype=I32),
            input_lengths=torch.tensor(lengths, dtype=I32), prefix_lengths=torch.zeros(len(streams), dtype=I32),
            sequence_lengths=torch.zeros(0, dtype=I32), kv_slots=torch.tensor([s["slot"] for s in streams], dtype=I32))
        logits = self.model_.forward(inputs)
        last = torch.tensor(lengths).cumsum(0) - 1
        for s, token in zip(streams, logits[last.to(logits.device)].argmax(-1).tolist()):
            s["seq_len"] = len(s["tokens"])
            s["tokens"].append(token)
            s["last_token"], s["draft_token"] = token, propose(token)
        return logits

    def decodeStep(self, streams: list) -> Tensor:
        model_input = self.batch_stream_processor_.prepareOneStepSpecDecodeModelInput(streams)
        logits = self.model_.forward(model_input)                   # the target model verify
        all_probs = torch.softmax(logits, -1).reshape(len(streams), self.propose_step_ + 1, VOCAB)
        target = all_probs.argmax(-1).tolist()                      # (stand-in) greedy rejection sampling
        for s, (t0, t1) in zip(streams, target):
            accepted = [s["draft_token"], t1] if t0 == s["draft_token"] else [t0]
            s["seq_len"] += len(accepted)
            s["tokens"] += accepted
            s["accepted"] += len(accepted) - 1
            s["last_token"], s["draft_token"] = accepted[-1], propose(accepted[-1])
        return logits


def serve(device: str, enable_cuda_graph: bool) -> list:
    executor = MtpExecutor(device, _weights(device), enable_cuda_graph)
    gen = generator(7)
    streams = [{"slot": slot, "tokens": torch.randint(0, VOCAB, (n,), generator=gen).tolist(), "accepted": 0}
               for slot, n in ((1, 3), (2, 5))]
    outputs = [executor.prefillStep(streams)]
    for _ in range(3):
        outputs.append(executor.decodeStep(streams))
    outputs.append(torch.tensor([t for s in streams for t in s["tokens"]] + [s["accepted"] for s in streams],
                                dtype=DTYPE))
    return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, enable_cuda_graph=True), lambda: serve(device, enable_cuda_graph=False))
