"""ONNX Runtime GenAI with graph capture (static attention mask): ``DefaultPositionInputs::InitializeStaticMask`` copies each prompt row of the attention mask into the graph's ``[batch * beams, max_length]`` static mask with a row stride of ``prompt_length * num_beams`` instead of ``max_length``, so for a batch of several sequences all prompt rows land in row 0 and the other rows stay zero; every decode step then runs (and the captured decode graph replays) with row 1 masked off its own prompt.

Upstream: https://github.com/microsoft/onnxruntime-genai/pull/1639 ("Fix attention-mask stride bug for static
masking (batch > 1)", microsoft/onnxruntime-genai, by anujj, 2025-07-18; merged as commit a40580866, the stored
thread still shows it open). Read: the full diff of a40580866 (``src/models/position_inputs.cpp``, one hunk in
``InitializeStaticMask``: ``auto max_length = input_shape[1] * num_beams;`` becomes
``auto max_length = attention_mask_shape_[1];``) and the PR description; at its parent: ``position_inputs.cpp``
(``DefaultPositionInputs`` constructor, ``Update``, ``CreateAndInitializePositionIDs``,
``CreateNextPositionIDsTensor``, ``UpdatePositionIDs``, ``CreateAndInitializeAttentionMask``,
``InitializeStaticMask``, ``CreateNextAttentionMaskTensor``, ``UpdateAttentionMask``,
``ShouldUseStaticMaskHandling``), ``src/cpu/interface.cpp`` (``UpdatePositionIds``, ``UpdateAttentionMask``,
``UpdateAttentionMaskStatic``), ``src/models/input_ids.cpp`` (``DefaultInputIDs::Update``, decode ids on a static
buffer under graph capture), ``src/models/decoder_only.cpp`` (``DecoderOnly_State::Run``: graph capture only for
runs with one new token per row) and ``src/models/model.cpp`` (``State::Run`` setting the ``gpu_graph_id`` run
option, ``-1`` for runs not to be captured), ``src/config.cpp`` (``IsGraphCaptureEnabled``: DML, and
NvTensorRtRtx with ``enable_cuda_graph``; CUDA EP capture refused at that time). Also read: the
``position_inputs.cpp`` hunks of 37cddd405 (#1305, "Add support for DML Graph Capture", 2025-03-19), which
introduced ``InitializeStaticMask`` with this stride under ``if (use_graph_capture)``, and of 7adf3b7cc (#1594,
2025-07-04), which added ``ShouldUseStaticMaskHandling`` (``use_graph_capture``, or NvTensorRtRtx with
past-present share buffer also without graph capture). Not read: the EP side of the capture (ONNX Runtime's
NvTensorRtRtx / DML graph manager), the model builder's GroupQueryAttention subgraph.
Symptom: (PR text) with batch_size 2, prompt length 2 and max length 5, the static mask should be
``[[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]]`` but is ``[[1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]``: batched generation with
graph capture (static masking) decodes every row after the first with a wrong attention mask; without graph capture
(dynamic mask) it is fine.
Mechanism: with ``use_graph_capture`` the attention mask is one static ``[batch * beams, max_length]`` tensor whose
address the captured decode graph keeps (``ShouldUseStaticMaskHandling``); decode steps only set column
``total_length - 1`` of each row in place (``UpdateAttentionMaskStatic``). ``InitializeStaticMask`` writes the
prompt mask of sequence ``i`` beam ``j`` at offset ``(i * num_beams + j) * max_length`` but computes ``max_length``
as ``input_shape[1] * num_beams`` (the prompt width), so row ``i`` is written at element ``i * prompt_length`` of
the flat buffer: row 0 holds all prompts, rows >= 1 keep the zeros of ``output_span.Zero()``. Every decode step of
row 1 then attends only to the tokens generated after the prompt. Without graph capture the mask is the dynamic
``[batch, total_length]`` tensor rebuilt each step and is right.
Doctor: padded-shape-mismatch, at InitializeStaticMask. The graph's static mask is padded to ``max_length`` columns
and is filled with the stride of the real (prompt-width) mask, so the real rows read mask columns laid out for a
different width.
Fix (upstream): ``InitializeStaticMask`` uses ``attention_mask_shape_[1]`` (``max_length``) as the row stride.
Modelled: ``DefaultInputIDs::Update`` (decode ids on a static buffer), ``DefaultPositionInputs`` (position ids with
the static ``position_ids_next_`` taken over at the first decode step and incremented in place; the attention mask,
static or dynamic, with ``InitializeStaticMask`` in both versions and ``UpdateAttentionMask`` / the CPU
``UpdateAttentionMaskStatic``; ``ShouldUseStaticMaskHandling`` reduced to its graph-capture clause, the
NvTensorRtRtx share-buffer clause of #1594 left out), ``DecoderOnly_State::Run`` / ``State::Run``
(``gpu_graph_id`` set only for one-token runs), an ``InferenceSession`` whose EP runs a graph-annotated run regularly
once, captures it on the next run and replays it afterwards (the run count is a stand-in: the EP code was not read),
and a greedy generator loop.
Stand-ins: a one-layer, one-head decoder over a past-present shared KV buffer ``[batch, max_length, hidden]``
written at ``position_ids``; attention is causal by position with the attention mask as an additive ``-10000`` bias
(instead of GroupQueryAttention with ``seqlens_k`` from the mask); greedy search on the host; float64.
Workload: batch 2, prompts ``[3, 7]`` and ``[5, 2]`` (no padding), max_length 6, num_beams 1. The prompt run is not
captured (``gpu_graph_id = -1``); decode runs at total lengths 3, 4, 5: one regular run, capture at the second,
replay at the third. The outputs compared are the logits of every run.
Measured: bug: max |graph - eager| = 25.9. Row 0 equals eager at every run; row 1 equals it in the prompt run (4.2e-13,
float64 rounding of the -10000 bias) and differs by 22.5, 17.4 and 25.9 in the regular decode run, the captured run
and the replay, whose greedy tokens for row 1 are 13, 7, 6 against eager's 11, 3, 4. Fix: equals eager
(max |graph - eager| = 0).
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime-genai/pull/1639"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "InitializeStaticMask"
SYMPTOM = ("batched generation with graph capture: the static attention mask gets every prompt row written into "
           "row 0, so rows after the first decode with their prompt masked off")

VOCAB, HIDDEN = 16, 8
PAD_TOKEN_ID = 0
MAX_LENGTH, NUM_BEAMS = 6, 1
DTYPE = torch.float64

_variant = "bug"


# --- the ONNX decoder (stand-in) run by ONNX Runtime, with the EP's graph capture ------------------------------------

class DecoderModel:
    """One attention layer over the past-present shared KV buffer; causal by position, mask as additive bias."""

    def __init__(self, device):
        gen = generator(1639)
        r = lambda *s, scale=0.6: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed, self.pos = r(VOCAB, HIDDEN, scale=1.0), r(MAX_LENGTH, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)

    def forward(self, input_ids, position_ids, attention_mask, past_key, past_value):
        batch, total = input_ids.shape[0], attention_mask.shape[1]
        h = self.embed[input_ids] + self.pos[position_ids]                        # [B, S, H]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        rows = torch.arange(batch, device=input_ids.device)[:, None].expand_as(position_ids)
        past_key.index_put_((rows, position_ids), k)                               # present written in place
        past_value.index_put_((rows, position_ids), v)
        keys, values = past_key[:, :total], past_value[:, :total]
        scores = q @ keys.transpose(1, 2) / math.sqrt(HIDDEN)                      # [B, S, total]
        scores = scores + (1.0 - attention_mask.to(DTYPE))[:, None, :] * -10000.0
        future = torch.arange(total, device=input_ids.device)[None, None, :] > position_ids[:, :, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        return (h + (probs @ values) @ self.wo) @ self.lm_head                     # logits [B, S, V]


class NvExecutionProvider:
    """Graph capture per graph annotation id: regular runs first, then capture, then replays."""

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
                                                   state=state, owner="NvExecutionProvider",
                                                   name=f"decoder graph id={graph_annotation_id}")

    def ReplayGraph(self, graph_annotation_id):
        g, logits = self.graphs[graph_annotation_id]
        return replay(g, logits)

    def IncrementRegularRunCountBeforeGraphCapture(self, graph_annotation_id):
        count = self.regular_run_count_before_graph_capture.get(graph_annotation_id, 0)
        self.regular_run_count_before_graph_capture[graph_annotation_id] = count + 1


class InferenceSession:
    def __init__(self, model, device, enable_cuda_graph):
        self.model, self.enable_cuda_graph = model, enable_cuda_graph
        self.ep = NvExecutionProvider(device)

    def Run(self, run_options, inputs, state):
        run_fn = lambda: self.model.forward(inputs["input_ids"], inputs["position_ids"],   # noqa: E731
                                            inputs["attention_mask"], state["past_key"], state["past_value"])
        graph_id = run_options.get("gpu_graph_id", "-1")
        if not self.enable_cuda_graph or graph_id == "-1":
            return run_fn()
        if self.ep.IsGraphCaptured(graph_id):
            return self.ep.ReplayGraph(graph_id)
        if self.ep.IsGraphCaptureAllowed(graph_id):
            self.ep.CaptureGraph(graph_id, run_fn, inputs, state)
            return self.ep.ReplayGraph(graph_id)
        out = run_fn()
        self.ep.IncrementRegularRunCountBeforeGraphCapture(graph_id)
        return out


# --- onnxruntime-genai (reduced) --------------------------------------------------------------------------------------

class Tensor:
    """A model input; ``CreateTensor(shape, make_static)`` places it on the state's static buffer when asked."""

    def __init__(self, state):
        self.state, self.ort_tensor_ = state, None

    def CreateTensor(self, shape, make_static=False):
        shape = tuple(shape)
        if make_static:
            key = (id(self), shape)
            if key not in self.state.static_buffers:
                self.state.static_buffers[key] = torch.zeros(shape, dtype=torch.int64, device=self.state.device)
            self.ort_tensor_ = self.state.static_buffers[key]
        else:
            self.ort_tensor_ = torch.zeros(shape, dtype=torch.int64, device=self.state.device)


class DefaultInputIDs:
    def __init__(self, state):
        self.state = state
        self.shape_ = [state.params.BatchBeamSize(), 0]
        self.value_ = Tensor(state)

    def Update(self, new_tokens):
        sequence_length = new_tokens.numel() // self.state.params.BatchBeamSize()
        if self.shape_[1] != sequence_length:
            self.shape_[1] = sequence_length
            self.value_.CreateTensor(self.shape_, self.state.params.use_graph_capture and sequence_length == 1)
            self.state.inputs["input_ids"] = self.value_.ort_tensor_
        self.value_.ort_tensor_.copy_(new_tokens.view(self.shape_).to(self.state.device))

    def GetShape(self):
        return self.shape_


class DefaultPositionInputs:
    def __init__(self, state):
        self.state, self.params = state, state.params
        self.position_ids_shape_ = [self.params.batch_size, 0]
        self.attention_mask_shape_ = [self.params.batch_size, 0]
        self.position_ids_ = Tensor(state)
        self.position_ids_next_ = Tensor(state)
        self.attention_mask_ = Tensor(state)
        self.attention_mask_next_ = Tensor(state)
        self.is_first_update_ = True

    def ShouldUseStaticMaskHandling(self):
        return self.params.use_graph_capture

    def Update(self, next_tokens, total_length, new_length):
        if self.is_first_update_:
            self.position_ids_shape_[1] = new_length
            self.CreateAndInitializePositionIDs(next_tokens, self.position_ids_shape_)
            self.attention_mask_shape_[1] = new_length
            self.CreateAndInitializeAttentionMask(next_tokens, self.attention_mask_shape_)
        else:
            self.UpdatePositionIDs(total_length, new_length)
            self.UpdateAttentionMask(total_length, new_length)
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
        self.position_ids_.ort_tensor_ = position_ids.to(self.state.device)
        self.position_ids_next_.CreateTensor((shape[0], 1), self.params.use_graph_capture)   # MakeStatic
        self.position_ids_next_.ort_tensor_.copy_(position_ids_next.to(self.state.device))
        self.state.inputs["position_ids"] = self.position_ids_.ort_tensor_

    def CreateNextPositionIDsTensor(self):
        if self.position_ids_next_ is not None and self.position_ids_shape_[0] > 1 and self.position_ids_shape_[1] == 1:
            self.position_ids_, self.position_ids_next_ = self.position_ids_next_, None
        else:
            self.position_ids_.CreateTensor(self.position_ids_shape_,
                                            self.params.use_graph_capture and self.position_ids_shape_[1] == 1)

    def UpdatePositionIDs(self, total_length, new_kv_length):
        if self.position_ids_shape_[1] != new_kv_length:
            self.position_ids_shape_[1] = new_kv_length
            self.CreateNextPositionIDsTensor()
            self.state.inputs["position_ids"] = self.position_ids_.ort_tensor_
        self.position_ids_.ort_tensor_.add_(1)                   # CpuInterface::UpdatePositionIds, batch > 1

    def CreateAndInitializeAttentionMask(self, next_tokens, shape):
        word_id = next_tokens.tolist()
        attention_mask = torch.tensor([[0 if word_id[i * shape[1] + j] == PAD_TOKEN_ID else 1
                                        for j in range(shape[1])] for i in range(shape[0])], dtype=torch.int64)
        if self.ShouldUseStaticMaskHandling():
            self.InitializeStaticMask(attention_mask)
        else:
            self.attention_mask_.ort_tensor_ = attention_mask.repeat_interleave(NUM_BEAMS, 0).to(self.state.device)
            self.attention_mask_shape_[0] *= NUM_BEAMS
        self.state.inputs["attention_mask"] = self.attention_mask_.ort_tensor_

    def InitializeStaticMask(self, cpu_attention_mask):
        self.attention_mask_shape_[0] *= NUM_BEAMS
        self.attention_mask_shape_[1] = self.params.max_length
        self.attention_mask_.CreateTensor(self.attention_mask_shape_, True)
        output_span = self.attention_mask_.ort_tensor_.view(-1)
        output_span.zero_()
        input_span = cpu_attention_mask.view(-1)
        batch_size, new_kv_length = cpu_attention_mask.shape
        num_beams = NUM_BEAMS
        if _variant == "bug":
            max_length = new_kv_length * num_beams
        else:
            max_length = self.attention_mask_shape_[1]
        for i in range(batch_size):
            for j in range(num_beams):
                start = (i * num_beams + j) * max_length
                output_span[start:start + new_kv_length].copy_(
                    input_span[i * new_kv_length:(i + 1) * new_kv_length].to(output_span.device))

    def CreateNextAttentionMaskTensor(self, total_length):
        if self.ShouldUseStaticMaskHandling():
            return
        self.attention_mask_shape_[1] = total_length
        self.attention_mask_next_.CreateTensor(self.attention_mask_shape_)

    def UpdateAttentionMask(self, total_length, new_kv_length):
        self.CreateNextAttentionMaskTensor(total_length)
        mask = self.attention_mask_.ort_tensor_
        batch_beam_size = self.attention_mask_shape_[0]
        if self.ShouldUseStaticMaskHandling():                   # UpdateAttentionMaskStatic: in place
            flat = mask.view(-1)
            for i in range(batch_beam_size):
                for j in range(total_length - new_kv_length, total_length):
                    flat[i * self.params.max_length + j] = 1
            return
        next_mask = self.attention_mask_next_.ort_tensor_
        next_mask[:, :total_length - 1].copy_(mask)
        next_mask[:, total_length - 1] = 1
        self.attention_mask_.ort_tensor_ = next_mask
        self.state.inputs["attention_mask"] = next_mask


class GeneratorParams:
    def __init__(self, batch_size, use_graph_capture):
        self.batch_size, self.max_length, self.use_graph_capture = batch_size, MAX_LENGTH, use_graph_capture

    def BatchBeamSize(self):
        return self.batch_size * NUM_BEAMS


class DecoderOnly_State:
    def __init__(self, session, params, device):
        self.session, self.params, self.device = session, params, device
        self.inputs: dict[str, torch.Tensor] = {}
        self.static_buffers: dict = {}
        self.graph_id_ = "1639" if params.use_graph_capture else None
        shape = (params.BatchBeamSize(), params.max_length, HIDDEN)
        self.kv_cache = {"past_key": torch.zeros(shape, dtype=DTYPE, device=device),
                         "past_value": torch.zeros(shape, dtype=DTYPE, device=device)}
        self.input_ids_ = DefaultInputIDs(self)
        self.position_inputs_ = DefaultPositionInputs(self)

    def UpdateInputsOutputs(self, next_tokens, total_length):
        self.input_ids_.Update(next_tokens)
        new_length = self.input_ids_.GetShape()[1]
        self.position_inputs_.Update(next_tokens, total_length, new_length)

    def Run(self, total_length, next_tokens):
        self.UpdateInputsOutputs(next_tokens, total_length)
        graph_capture_this_run = self.params.use_graph_capture and self.input_ids_.GetShape()[1] == 1
        run_options = {}
        if self.params.use_graph_capture:
            run_options["gpu_graph_id"] = self.graph_id_ if graph_capture_this_run else "-1"
        return self.session.Run(run_options, self.inputs, self.kv_cache)


def _generate(device, use_graph_capture):
    model = DecoderModel(device)
    session = InferenceSession(model, device, enable_cuda_graph=use_graph_capture)
    prompts = [[3, 7], [5, 2]]
    params = GeneratorParams(len(prompts), use_graph_capture)
    state = DecoderOnly_State(session, params, device)
    next_tokens = torch.tensor(prompts, dtype=torch.int64).view(-1)
    total_length = len(prompts[0])
    outs = []
    while total_length < params.max_length:
        logits = state.Run(total_length, next_tokens)
        outs.append(logits.clone())
        next_tokens = torch.argmax(logits[:, -1], dim=-1).cpu()             # greedy search on the host
        total_length += 1
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _generate(device, True), lambda: _generate(device, False))
