"""ONNX Runtime GenAI with graph capture (DML always, CUDA with ``enable_cuda_graph``): after the continuous-decoding
rework, ``DefaultInputIDs::Update`` and ``Logits::Update`` place the *prompt* run's ``input_ids`` and ``logits`` on the
captured graph's static buffers (``CapturedGraphInfo::sb_input_ids_`` / ``sb_logits32_``), which exist only so that
the decode graph keeps stable addresses. A ``StaticBuffer`` is sized at its first use, and the pooled
``CapturedGraphInfo`` (with its buffers) is recycled to the next generator, so the first generator's prompt fixes the
capacity; the next generator's longer prompt does not fit, and ``StaticBuffer::CreateTensorOnStaticBuffer`` only
constructs its ``"new_bytes > bytes_"`` error (no ``throw``) and hands out a tensor past the end of the allocation.

Upstream: https://github.com/microsoft/onnxruntime-genai/pull/1159 ("Address a DML regression caused by the continuous
decoding changes", microsoft/onnxruntime-genai, by baijumeswani (Baiju Meswani), opened 2024-12-19, label rel-0.6.0;
merged as commit 49eb184af, 2025-01-13). Read: the full diff of 49eb184af (``src/models/input_ids.cpp``: the
constructor no longer takes ``sb_input_ids_``; ``DefaultInputIDs::Update`` gains a first-call branch that builds the
prompt ids in a CPU tensor, runs ``ExpandInputs``, and only then takes ``sb_input_ids_`` from the captured graph info,
with the comment that "the subsequent prompts can not be larger than the first prompt (when graph capture is
enabled)"; ``src/models/logits.cpp``: the constructor no longer takes ``sb_logits16_/32_``, ``Logits::Update`` takes
them after its first call; ``src/generators.cpp`` error text; ``src/models/debugging.cpp`` and ``src/ort_genai_c.cpp``
DML memory-type handling, not modelled) and the PR description ("For DML EP, the input ids must be allocated on CPU
for the prompt case"; "logits must use the static buffer only after the first ``Update`` for DML"). At the parent
(49eb184af^): ``input_ids.cpp`` whole, ``logits.cpp`` (constructor, ``Get``'s prompt branch, ``Update``),
``static_buffer.cpp`` (``CreateTensorOnStaticBuffer``: ``bytes_ = new_bytes * (max_beam_batch_size_ / shape[0])`` at
first use; ``if (new_bytes > bytes_) { std::runtime_error(...); }`` without ``throw``), ``captured_graph_pool.{h,cpp}``
(``ReserveCapturedGraph`` keyed by max batch size / max length / beams, static buffers created once per
``CapturedGraphInfo``, ``CapturedGraphInfoRecycler`` returning the info to the pool when the state dies,
``GenerateUniqueAnnotationID``), ``decoder_only.cpp`` (``DecoderOnly_State`` reserving the captured graph,
``UpdateInputsOutputs``, ``Run``), ``model.cpp`` (``State::Run``: ``gpu_graph_id`` ``-1`` for the first run, the
annotation id afterwards; ``ExpandInputs``), ``kv_cache.cpp`` (``DefaultKeyValueCache`` on ``sb_kv_caches_`` with
past-present share buffer, zeroed at construction), ``position_inputs.cpp`` (prompt position ids in a fresh CPU tensor,
decode position ids on ``sb_position_ids_``), ``generators.cpp`` (``GeneratorParams``: graph capture forces
``max_batch_size = 1``; ``AppendTokens``, ``ComputeLogits``), ``config.cpp`` (``IsCudaGraphEnabled``: always for DML);
and the diffs of 7c0f0d198 (#867, continuous decoding), which moved the prompt ids from a CPU tensor built in the
constructor into ``Update`` and made ``Logits::Update`` run for the prompt too.
Not read: ORT's DML / CUDA EP graph capture (the regular-run-then-capture rule below is a stand-in), the DML upload
heap and cast kernels, the ``sb_input_ids_int32_`` DML twin buffer.
Symptom: (PR title and text) a DML regression of the continuous-decoding release: with graph capture, the prompt's
input ids and logits must not go to the static buffers. As modelled: the second generator of a session (a chat app's
next turn) with a longer prompt than the first writes past the graph's static ``input_ids`` buffer; here that is
torch refusing a view past the storage (upstream, an out-of-bounds device write).
Mechanism: under graph capture every ``DecoderOnly_State`` reserves a ``CapturedGraphInfo`` from the model's pool;
its static buffers keep the addresses the decode graph was captured with, and the info (buffers and captured graph
id) is recycled to the next generator. ``StaticBuffer`` allocates at its first ``CreateTensorOnStaticBuffer`` call,
sized for that shape (times ``max_beam_batch_size / batch``, with ``max_batch_size`` 1 under capture). Since #867,
``DefaultInputIDs::Update`` and ``Logits::Update`` also serve the prompt run, so the first generator's prompt sizes
the buffers; a later generator's longer prompt needs more than ``bytes_``, the size check does not throw, and the
ids are written past the allocation. Without graph capture there is no captured graph info and every tensor is
allocated at its own size.
Doctor: undersized-buffer, at Update. Data that does not fit a static buffer: ``Update`` places the prompt's
``[1, prompt_len]`` ids (and ``[1, prompt_len, vocab]`` logits) on the graph's static buffers, whose capacity the
first generator's prompt fixed.
Fix (upstream): ``DefaultInputIDs::Update`` builds the first (prompt) ids in a fresh CPU tensor and takes
``sb_input_ids_`` only after it; ``Logits::Update`` takes ``sb_logits`` only after its first call; so the static
buffers are first used, and sized, by the one-token decode shapes the graph was captured with.
Modelled: ``StaticBuffer::CreateTensorOnStaticBuffer``, ``CapturedGraphPool::ReserveCapturedGraph`` /
``AddCapturedGraph``, ``CapturedGraphInfoRecycler``, ``CapturedGraphInfo::GenerateUniqueAnnotationID``,
``DefaultInputIDs`` (constructor, ``Update``), ``Logits`` (constructor, ``Update``, ``Get``),
``DefaultPositionInputs`` (``Update``, ``CreateAndInitializePositionIDs``, ``UpdatePositionIDs``,
``CreateNextPositionIDsTensor``, ``CopyNextPositionIDsToCurrent``, ``UpdatePositionIDsImpl``),
``DefaultKeyValueCache`` (share-buffer constructor), ``DecoderOnly_State`` (``UpdateInputsOutputs``, ``Run``),
``State::Run``, ``Model::ExpandInputs``, ``Generator`` (``AppendTokens``, ``ComputeLogits``, ``GenerateNextToken``),
``OgaDestroyGenerator``; an ``InferenceSession`` whose EP runs a graph-annotated run regularly once, captures it on
the next run and replays it afterwards (``IsGraphCaptured``, ``IsGraphCaptureAllowed``, ``CaptureGraph``,
``ReplayGraph``, ``IncrementRegularRunCountBeforeGraphCapture``; the run count is a stand-in).
Stand-ins: a one-layer, one-head decoder over a past-present shared KV buffer ``[1, max_length, hidden]`` written at
``position_ids``, attention over the slots at or before each query's position (instead of GroupQueryAttention); greedy
search on the host; int64 ids written with ``copy_`` (``LaunchInt32ToInt64``); an ``OrtValue`` created over a
static buffer is ``as_strided`` over the buffer's storage (torch refuses one past the storage, where C++ does not);
float64.
Workload: one model, two generators in turn (max_length 10, greedy, 4 new tokens each): A with the 3-token prompt
``[3, 7, 2]`` (prompt run, then decode runs: regular, captured, replayed), destroyed, then B with the 5-token prompt
``[5, 1, 6, 4, 9]``, which reserves A's recycled ``CapturedGraphInfo`` and replays A's decode graph. Compared: the
last-token logits of every run of both generators against the same generators without graph capture.
Measured: bug: misbehaves, raised RuntimeError (setStorage: sizes [1, 5] ... requiring a storage size of 40 are out
of bounds for storage of size 24) at B's prompt ``DefaultInputIDs::Update``: A's prompt sized ``sb_input_ids_`` to 3
ids (and ``sb_logits32_`` to 3 x vocab). Fix: equals eager (max |graph - eager| = 0 over 8 logits rows): graph id
65537 captured at A's second decode run, A's last two and all three of B's decode runs are replays; greedy tokens
A 15 8 13 15, B 1 6 0 1 (the same without graphs). About 1.5 s for the first run in a process, 0.1 s after.
"""
from __future__ import annotations

import math
import weakref

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime-genai/pull/1159"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "Update"
SYMPTOM = ("with graph capture, the prompt's input ids and logits go to the captured graph's static buffers, sized by "
           "the first generator's prompt; a later generator's longer prompt is written past them")

VOCAB, HIDDEN = 16, 8
PAD_TOKEN_ID = 0
MAX_LENGTH, NUM_BEAMS, NEW_TOKENS = 10, 1, 4
PROMPTS = ([3, 7, 2], [5, 1, 6, 4, 9])
DTYPE = torch.float64

_variant = "bug"


# --- the ONNX decoder (stand-in) run by ONNX Runtime, with the EP's graph capture ------------------------------------

class DecoderModel:
    """One attention layer over the past-present shared KV buffer; each query attends to slots <= its position."""

    def __init__(self, device):
        gen = generator(1159)
        r = lambda *s, scale=0.6: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed, self.pos = r(VOCAB, HIDDEN, scale=1.0), r(MAX_LENGTH, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)
        self.slots = torch.arange(MAX_LENGTH, device=device)

    def forward(self, input_ids, position_ids, past_key, past_value, logits):
        h = self.embed[input_ids] + self.pos[position_ids]                        # [B, S, H]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        rows = torch.zeros_like(position_ids)
        past_key.index_put_((rows, position_ids), k)                               # present written in place
        past_value.index_put_((rows, position_ids), v)
        scores = q @ past_key.transpose(1, 2) / math.sqrt(HIDDEN)                  # [B, S, max_length]
        future = self.slots[None, None, :] > position_ids[:, :, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        logits.copy_((h + (probs @ past_value) @ self.wo) @ self.lm_head)         # ORT writes the bound output
        return logits


class CUDAExecutionProvider:
    """Graph capture per graph annotation id: a regular run first, then capture, then replays."""

    kMinNumRunsBeforeCudaGraphCapture = 1

    def __init__(self, device):
        self.device = device
        self.graphs: dict[str, tuple] = {}
        self.regular_run_count_before_graph_capture: dict[str, int] = {}

    def IsGraphCaptured(self, graph_annotation_id):
        return graph_annotation_id in self.graphs

    def IsGraphCaptureAllowed(self, graph_annotation_id):
        return (self.regular_run_count_before_graph_capture.get(graph_annotation_id, 0)
                >= self.kMinNumRunsBeforeCudaGraphCapture)

    def CaptureGraph(self, graph_annotation_id, run_fn, bound_inputs, state):
        self.graphs[graph_annotation_id] = capture(run_fn, device=self.device, warmups=0, static=bound_inputs,
                                                   state=state, owner="CUDAExecutionProvider",
                                                   name=f"decoder graph id={graph_annotation_id}")

    def ReplayGraph(self, graph_annotation_id):
        g, logits = self.graphs[graph_annotation_id]
        return replay(g, logits)

    def IncrementRegularRunCountBeforeGraphCapture(self, graph_annotation_id):
        count = self.regular_run_count_before_graph_capture.get(graph_annotation_id, 0)
        self.regular_run_count_before_graph_capture[graph_annotation_id] = count + 1


class InferenceSession:
    def __init__(self, model, device, enable_graph_capture):
        self.model, self.enable_graph_capture = model, enable_graph_capture
        self.ep = CUDAExecutionProvider(device)

    def Run(self, run_options, inputs, outputs):
        bound = dict(inputs)                                  # the addresses of this run's inputs and outputs
        out = outputs["logits"]
        run_fn = lambda b=bound, o=out: self.model.forward(b["input_ids"], b["position_ids"],   # noqa: E731
                                                           b["past_key"], b["past_value"], o)
        graph_id = run_options.get("gpu_graph_id", "-1")
        if not self.enable_graph_capture or graph_id == "-1":
            return run_fn()
        if self.ep.IsGraphCaptured(graph_id):
            return self.ep.ReplayGraph(graph_id)
        if self.ep.IsGraphCaptureAllowed(graph_id):
            static = {k: bound[k] for k in ("input_ids", "position_ids")}
            state = {k: bound[k] for k in ("past_key", "past_value")}
            self.ep.CaptureGraph(graph_id, run_fn, static, state)
            return self.ep.ReplayGraph(graph_id)
        result = run_fn()
        self.ep.IncrementRegularRunCountBeforeGraphCapture(graph_id)
        return result


# --- onnxruntime-genai (reduced): static buffers and the captured graph pool ----------------------------------------

class StaticBuffer:
    def __init__(self, device, max_beam_batch_size):
        self.device, self.max_beam_batch_size_ = device, max_beam_batch_size
        self.buffer_, self.bytes_ = None, 0

    def CreateTensorOnStaticBuffer(self, shape, dtype):
        shape = tuple(shape)
        new_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        if self.buffer_ is None:
            # Assuming the first dimension is the batch size
            self.bytes_ = new_bytes * (self.max_beam_batch_size_ // shape[0])
            self.buffer_ = torch.zeros(self.bytes_ // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                                       device=self.device)
            return self.buffer_.as_strided(shape, strides, 0)
        if new_bytes > self.bytes_:
            RuntimeError("StaticBuffer: new_bytes > bytes_")   # constructed, never thrown (as upstream)
        return self.buffer_.as_strided(shape, strides, 0)    # OrtValue::CreateTensor(info_, buffer_, new_bytes, ...)


class CapturedGraphInfo:
    def __init__(self):
        self.pool_ = None
        self.index_ = 0
        self.sb_input_ids_ = self.sb_position_ids_ = self.sb_logits32_ = None
        self.sb_kv_caches_: list[StaticBuffer] = []
        self.key_ = None

    def GenerateUniqueAnnotationID(self, batch_size):
        bit_shift = 32 // 2
        return (self.index_ << bit_shift) | batch_size


class CapturedGraphInfoRecycler:
    def __call__(self, captured_graph_info):
        if captured_graph_info is not None:
            pool = captured_graph_info.pool_()
            if pool is not None:
                pool.AddCapturedGraph(captured_graph_info)     # Return the graph to the pool if available


class CapturedGraphInfoPtr:
    """``std::unique_ptr<CapturedGraphInfo, CapturedGraphInfoRecycler>``."""

    def __init__(self, info):
        self.info = info

    def get(self):
        return self.info

    def reset(self):
        info, self.info = self.info, None
        CapturedGraphInfoRecycler()(info)


class CapturedGraphPool:
    def __init__(self, device):
        self.device = device
        self.captured_graphs_map_: dict[tuple, list] = {}
        self.current_graph_annotation_id_ = 1       # 0 is reserved for internal usage in cuda graphs

    def ReserveCapturedGraph(self, model, params):
        if not params.use_cuda_graph:
            return CapturedGraphInfoPtr(None)
        key = (params.max_batch_size, params.max_length, params.num_beams)
        captured_graphs = self.captured_graphs_map_.setdefault(key, [])
        if not captured_graphs:
            new_captured_graph = CapturedGraphInfo()
            new_captured_graph.index_ = self.current_graph_annotation_id_
            self.current_graph_annotation_id_ += 1
            new_captured_graph.pool_ = weakref.ref(self)
            max_beam_batch_size = params.num_beams * params.max_batch_size
            new_captured_graph.sb_input_ids_ = StaticBuffer(self.device, max_beam_batch_size)
            new_captured_graph.sb_kv_caches_ = [StaticBuffer(self.device, max_beam_batch_size) for _ in range(2)]
            new_captured_graph.sb_position_ids_ = StaticBuffer(self.device, max_beam_batch_size)
            new_captured_graph.sb_logits32_ = StaticBuffer(self.device, max_beam_batch_size)
            new_captured_graph.key_ = key
            return CapturedGraphInfoPtr(new_captured_graph)
        return CapturedGraphInfoPtr(captured_graphs.pop(0))   # We found a graph, so take it from the pool

    def AddCapturedGraph(self, captured_graph):
        self.captured_graphs_map_[captured_graph.key_].append(captured_graph)


class Model:
    def __init__(self, device, use_graph_capture):
        self.device = device
        self.session_decoder_ = InferenceSession(DecoderModel(device), device, use_graph_capture)
        self.captured_graph_pool_ = CapturedGraphPool(device)
        self.use_graph_capture = use_graph_capture

    def ExpandInputs(self, input, num_beams):
        # num_beams == 1: CUDA still copies the data over to device memory; CPU and DML keep it where it is
        return input.to(self.device)


class GeneratorParams:
    def __init__(self, model):
        self.use_cuda_graph = model.use_graph_capture
        self.max_batch_size = 1 if self.use_cuda_graph else 0      # set it to 1 by default under graph capture
        self.batch_size, self.max_length, self.num_beams = 1, MAX_LENGTH, NUM_BEAMS

    def BatchBeamSize(self):
        return self.batch_size * self.num_beams


# --- onnxruntime-genai (reduced): the decoder's inputs and outputs -------------------------------------------------

class DefaultInputIDs:
    def __init__(self, state):
        self.state, self.model = state, state.model
        self.shape_ = [state.params.BatchBeamSize(), 0]
        self.value_ = None
        self.sb_input_ids_ = None
        self.is_prompt_ = True
        if _variant == "bug" and state.GetCapturedGraphInfo():
            self.sb_input_ids_ = state.GetCapturedGraphInfo().sb_input_ids_

    def Update(self, new_tokens):
        if _variant == "fix" and self.value_ is None:
            # Prompt stage of a new state: a CPU tensor, then the static buffer from the next Update on.
            self.shape_[1] = new_tokens.numel() // self.shape_[0]
            value = new_tokens.to("cpu", torch.int64).view(self.shape_)
            self.value_ = self.model.ExpandInputs(value, NUM_BEAMS)
            if self.state.GetCapturedGraphInfo():
                self.sb_input_ids_ = self.state.GetCapturedGraphInfo().sb_input_ids_
            self.is_prompt_ = False
            self.state.inputs["input_ids"] = self.value_
            return
        sequence_length = new_tokens.numel() // self.state.params.BatchBeamSize()
        if self.shape_[1] != sequence_length:
            self.shape_[1] = sequence_length
            if self.sb_input_ids_ is None:
                self.value_ = torch.empty(self.shape_, dtype=torch.int64, device=self.model.device)
            else:
                self.value_ = self.sb_input_ids_.CreateTensorOnStaticBuffer(self.shape_, torch.int64)
            self.state.inputs["input_ids"] = self.value_
        self.value_.copy_(new_tokens.view(self.shape_))            # LaunchInt32ToInt64
        self.is_prompt_ = False

    def GetShape(self):
        return self.shape_


class DefaultPositionInputs:
    def __init__(self, state):
        self.state, self.model = state, state.model
        self.position_ids_shape_ = [state.params.batch_size, 0]
        self.position_ids_ = self.position_ids_next_ = None
        self.is_first_update_ = True
        self.sb_position_ids_ = None
        if state.GetCapturedGraphInfo():
            self.sb_position_ids_ = state.GetCapturedGraphInfo().sb_position_ids_

    def Update(self, next_tokens, total_length, new_length):
        if self.is_first_update_:
            self.position_ids_shape_[1] = new_length
            self.CreateAndInitializePositionIDs(next_tokens, self.position_ids_shape_)
        else:
            self.UpdatePositionIDs(total_length, new_length)
        self.is_first_update_ = False

    def CreateAndInitializePositionIDs(self, next_tokens, shape):
        word_id = next_tokens.tolist()
        position_ids = torch.zeros(shape, dtype=torch.int64)
        position_ids_next = torch.zeros(shape[0], 1, dtype=torch.int64)
        for i in range(shape[0]):
            abs_position = 0
            for j in range(shape[1]):
                if word_id[i * shape[1] + j] == PAD_TOKEN_ID:
                    position_ids[i, j] = 0
                else:
                    position_ids[i, j] = abs_position
                    abs_position += 1
            position_ids_next[i, 0] = abs_position - 1
        self.position_ids_ = self.model.ExpandInputs(position_ids, NUM_BEAMS)
        self.position_ids_next_ = self.model.ExpandInputs(position_ids_next, NUM_BEAMS)
        self.state.inputs["position_ids"] = self.position_ids_

    def CopyNextPositionIDsToCurrent(self):
        self.position_ids_.copy_(self.position_ids_next_)

    def CreateNextPositionIDsTensor(self):
        if self.sb_position_ids_ is None:
            if self.position_ids_shape_[1] == 1 and self.position_ids_next_ is not None:
                self.position_ids_, self.position_ids_next_ = self.position_ids_next_, None
            else:
                self.position_ids_ = torch.empty(self.position_ids_shape_, dtype=torch.int64, device=self.model.device)
        else:
            self.position_ids_ = self.sb_position_ids_.CreateTensorOnStaticBuffer(self.position_ids_shape_,
                                                                                  torch.int64)
            if self.position_ids_shape_[1] == 1:
                self.CopyNextPositionIDsToCurrent()

    def UpdatePositionIDs(self, total_length, new_kv_length):
        if self.position_ids_shape_[1] != new_kv_length:
            self.position_ids_shape_[1] = new_kv_length
            self.CreateNextPositionIDsTensor()
            self.state.inputs["position_ids"] = self.position_ids_
        self.UpdatePositionIDsImpl(total_length, new_kv_length)

    def UpdatePositionIDsImpl(self, total_length, new_kv_length):
        # batch size 1: positions from the total length and the new kv length (continuous decoding)
        for i in range(new_kv_length):
            self.position_ids_[0, i] = i + total_length - new_kv_length


class DefaultKeyValueCache:
    """Past-present share buffer: ``[batch_beam, max_length, hidden]`` presents bound as pasts too, zeroed."""

    def __init__(self, state):
        shape = (state.params.BatchBeamSize(), state.params.max_length, HIDDEN)
        info = state.GetCapturedGraphInfo()
        self.presents_ = []
        for i in range(2):
            t = (torch.empty(shape, dtype=DTYPE, device=state.model.device) if info is None
                 else info.sb_kv_caches_[i].CreateTensorOnStaticBuffer(shape, DTYPE))
            t.zero_()
            self.presents_.append(t)
        state.inputs["past_key"], state.inputs["past_value"] = self.presents_

    def Update(self, beam_indices, total_length):
        return                                  # sharing past & present buffers: nothing to do


class Logits:
    def __init__(self, state):
        self.state, self.model = state, state.model
        self.shape_ = [state.params.BatchBeamSize(), 0, VOCAB]
        self.output_raw_ = torch.empty(self.shape_, dtype=DTYPE, device=self.model.device)
        self.sb_logits32_ = None
        if _variant == "bug" and state.GetCapturedGraphInfo():
            self.sb_logits32_ = state.GetCapturedGraphInfo().sb_logits32_
        self.input_sequence_lengths = [0] * state.params.batch_size
        state.outputs["logits"] = self.output_raw_

    def Update(self, next_tokens, new_kv_length):
        if self.output_raw_.shape[1] == new_kv_length and new_kv_length == 1:
            return
        tokens = next_tokens.tolist()
        for b in range(self.state.params.batch_size):    # Find the first non pad token from the end
            token_index = new_kv_length
            while token_index > 0:
                token_index -= 1
                if tokens[b * new_kv_length + token_index] != PAD_TOKEN_ID:
                    break
            self.input_sequence_lengths[b] = token_index + 1
        if self.output_raw_.shape[1] == new_kv_length:
            return
        self.shape_[1] = new_kv_length
        sb_logits = self.sb_logits32_
        self.output_raw_ = (torch.empty(self.shape_, dtype=DTYPE, device=self.model.device) if sb_logits is None
                            else sb_logits.CreateTensorOnStaticBuffer(self.shape_, DTYPE))
        if _variant == "fix" and self.state.GetCapturedGraphInfo() and self.sb_logits32_ is None:
            self.sb_logits32_ = self.state.GetCapturedGraphInfo().sb_logits32_
        self.state.outputs["logits"] = self.output_raw_

    def Get(self, logits):
        if self.shape_[1] != 1:                  # prompt: copy the last token's logits out
            return torch.stack([logits[b, self.input_sequence_lengths[b] - 1]
                                for b in range(self.shape_[0])])[:, None, :].clone()
        return logits


class DecoderOnly_State:
    def __init__(self, model, params):
        self.model, self.params = model, params
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.run_options_: dict[str, str] = {}
        self.first_run_, self.current_batch_size_ = True, 0
        self.captured_graph_info_ = model.captured_graph_pool_.ReserveCapturedGraph(model, params)
        self.input_ids_ = DefaultInputIDs(self)
        self.position_inputs_ = DefaultPositionInputs(self)
        self.logits_ = Logits(self)
        self.kv_cache_ = DefaultKeyValueCache(self)

    def GetCapturedGraphInfo(self):
        return self.captured_graph_info_.get()

    def UpdateInputsOutputs(self, next_tokens, beam_indices, total_length):
        self.input_ids_.Update(next_tokens)
        new_length = self.input_ids_.GetShape()[1]
        self.position_inputs_.Update(next_tokens, total_length, new_length)
        self.kv_cache_.Update(beam_indices, total_length)
        self.logits_.Update(next_tokens, new_length)

    def Run(self, total_length, next_tokens, next_indices=None):
        self.UpdateInputsOutputs(next_tokens, next_indices, total_length)
        batch_size = self.input_ids_.GetShape()[0]
        logits = self.State_Run(self.model.session_decoder_, batch_size)
        return self.logits_.Get(logits)

    def State_Run(self, session, new_batch_size):      # State::Run
        captured_graph_info = self.GetCapturedGraphInfo()
        if self.first_run_:
            if captured_graph_info:
                self.run_options_["gpu_graph_id"] = "-1"
            self.first_run_ = False
        elif captured_graph_info and new_batch_size != self.current_batch_size_:
            self.current_batch_size_ = new_batch_size
            self.run_options_["gpu_graph_id"] = str(captured_graph_info.GenerateUniqueAnnotationID(new_batch_size))
        return session.Run(self.run_options_, self.inputs, self.outputs)


class Generator:
    def __init__(self, model, params):
        self.model, self.params = model, params
        self.state_ = DecoderOnly_State(model, params)
        self.sequence: list[int] = []
        self.computed_logits_ = False
        self.logits_: torch.Tensor | None = None
        self.all_logits: list[torch.Tensor] = []

    def AppendTokens(self, input_ids):
        self.sequence.extend(input_ids)
        self.computed_logits_ = False
        self.ComputeLogits(torch.tensor(input_ids, dtype=torch.int32))

    def ComputeLogits(self, next_tokens):
        logits = self.state_.Run(len(self.sequence), next_tokens)
        self.logits_ = logits
        self.all_logits.append(logits.clone())
        self.computed_logits_ = True

    def GenerateNextToken(self):
        if not self.computed_logits_:
            self.ComputeLogits(torch.tensor(self.sequence[-1:], dtype=torch.int32))
        self.sequence.append(int(torch.argmax(self.logits_[0, -1]).item()))   # greedy search on the host
        self.computed_logits_ = False


def OgaDestroyGenerator(generator):
    generator.state_.captured_graph_info_.reset()      # the state's unique_ptr returns the graph info to the pool


def _generate(device, use_graph_capture):
    model = Model(device, use_graph_capture)
    outs = []
    for prompt in PROMPTS:                              # two chat turns, one generator each
        params = GeneratorParams(model)
        gen = Generator(model, params)
        gen.AppendTokens(prompt)
        for _ in range(NEW_TOKENS):
            gen.GenerateNextToken()
        outs.extend(gen.all_logits)
        OgaDestroyGenerator(gen)
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _generate(device, True), lambda: _generate(device, False))
