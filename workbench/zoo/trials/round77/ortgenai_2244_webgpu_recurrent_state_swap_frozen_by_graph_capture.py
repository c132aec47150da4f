"""WebGPU RecurrentState keeps separate past/present buffers swapped every step: the captured decode graph keeps the capture-time pair.

Upstream: https://github.com/microsoft/onnxruntime-genai/pull/2244 ("webgpu: fix RecurrentState graph capture with
shared buffer aliasing", merged 2026-07-10, commit f604a5ee6a226c9e8d8f1cfe992bb9a551d4d52c).
Symptom: Qwen3.5-0.8B (GatedDeltaNet linear-attention layers) on the WebGPU EP with ``enableGraphCapture=1``
produces garbage after the first generated token; with graph capture off the output is correct.
Mechanism: #2191 ("Fix webgpu shared buffer issue") made ``src/models/recurrent_state.cpp``'s constructor
``RecurrentState::RecurrentState`` set ``share_buffers_ = model_.p_device_kvcache_->GetType() != DeviceType::WEBGPU``
whatever ``past_present_share_buffer`` and ``use_graph_capture`` said (WebGPU was thought unable to bind one buffer
as both read-only input and read-write output). So on WebGPU it allocates ``pasts_`` next to ``presents_``,
``RecurrentState::Add`` binds ``pasts_[i]`` as the ``past_key_values.%d.conv_state`` / ``.recurrent_state`` inputs
and ``presents_[i]`` as the outputs, and ``RecurrentState::Update`` (called from
``DecoderOnly_State::UpdateInputsOutputs`` before every run) does ``std::swap(pasts_[i], presents_[i])`` and
rebinds ``state_.inputs_`` / ``state_.outputs_``. ``DecoderOnly_State::Run`` sets ``graph_capture_this_run`` for
the one-token decode runs; ``State::Run`` passes ``gpu_graph_id`` and the EP captures the first decode run with
the buffer handles bound then, and replays those recorded dispatches for every later decode run. The host-side
swap is invisible to the replay: every replay reads the buffer that held the state at capture time (the
post-prompt state) and writes the other one, so the recurrent (and conv) state never advances past the first
decode token, while an eager run reads whatever ``Update`` bound.
Doctor: warmup-divergence, at ``__init__`` (``RecurrentState.__init__``, upstream ``RecurrentState::RecurrentState``:
it chose separate, swapped past/present buffers on WebGPU even with graph capture on, so the capture fixes a
tensor reference, the step's past buffer, that every later eager step would have bound differently; the fix
changes only this decision and its guard, ``Add``/``Update`` keep their code).
Fix (upstream): ``share_buffers_ = state_.params_->IsPastPresentShareBufferEnabled(model_.config_->model.type)``
(the same rule as ``DefaultKeyValueCache``): the inputs alias the outputs (one allocation per state, which the
ORT ``LinearAttention`` / ``CausalConvWithState`` WebGPU kernels detect and bind once as ``read_write``), so the
handles stay stable and ``Update`` does nothing; and the constructor throws "Graph capture requires past/present
buffer sharing for models with recurrent state" when ``use_graph_capture`` is set without sharing.
Modelled: WebGPU graph capture modelled with the CUDA-graph engine: a WebGPU captured graph has the same replay
semantics (the recorded dispatches re-run on the buffers bound at capture). Not the CUDA EP path of #2070 (covered
separately: there ``Update`` itself swapped and the fix copied present into past in place); here the bug is the
constructor's per-device choice of buffering, reintroduced for WebGPU by #2191. The decoder ONNX model is one
GatedDeltaNet-like layer: ``CausalConvWithState`` (depthwise causal conv of width 3 with a ``conv_state`` of the last
2 inputs, SiLU) and a gated linear-attention ``LinearAttention`` (``S = decay * S + k^T v``, ``out = q S``), no full
attention layers, no KV cache, no position inputs; one recurrent layer, batch 1, greedy sampling. The EP captures
on the first decode run (no regular runs before capture) and replays it at once, as ORT does.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime-genai/pull/2244"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "__init__"
SYMPTOM = ("WebGPU graph capture freezes the past/present recurrent buffers of the first decode run; the host-side "
           "swap is ignored on replay, the state stops advancing and generation turns to garbage")

VOCAB, HIDDEN, CONV_K, DECAY = 16, 4, 3, 0.8
PROMPT = [3, 7, 1, 12, 5]
MAX_NEW_TOKENS = 6
WEBGPU, CUDA = "WebGPU", "CUDA"


# --- onnxruntime (WebGPU EP) kernels of the decoder model ---------------------------------------------------

def CausalConvWithState(x, conv_state, weight):
    """x: [T, H]; conv_state: [1, H, K-1] (the last K-1 inputs). Returns (y [T, H], new conv_state [1, H, K-1]).
    When the present aliases the past (``conv_state_in_present_state``) the caller writes the result back in place."""
    window = torch.cat((conv_state[0], x.T), dim=1)                                # [H, K-1+T]
    frames = window.unfold(1, CONV_K, 1)                                           # [H, T, K]
    y = torch.nn.functional.silu((frames * weight[:, None, :]).sum(-1)).T          # [T, H]
    return y, window[:, -(CONV_K - 1):][None]


def LinearAttention(q, k, v, initial_state):
    """Gated linear attention over T tokens from ``initial_state`` [1, H, H]; returns (out [T, H], final state)."""
    s = initial_state[0]
    outs = []
    for t in range(q.shape[0]):
        s = DECAY * s + k[t:t + 1].T @ v[t:t + 1]
        outs.append(q[t:t + 1] @ s)
    return torch.cat(outs), s[None]


class DecoderSession:
    """The decoder ONNX session: one run reads the bound inputs and writes the bound outputs."""

    def __init__(self, device):
        gen = generator(2244)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.conv_weight = randn(HIDDEN, CONV_K, gen=gen, device=device, scale=0.7)
        self.q_proj, self.k_proj, self.v_proj = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
                                                 for _ in range(3))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def Run(self, inputs, outputs):
        input_ids, past_conv, past_recurrent = inputs
        logits, present_conv, present_recurrent = outputs
        x = self.embed_tokens[input_ids[0]]                                            # [T, H]
        y, conv_state = CausalConvWithState(x, past_conv, self.conv_weight)
        out, recurrent_state = LinearAttention(y @ self.q_proj, y @ self.k_proj, y @ self.v_proj, past_recurrent)
        present_conv.copy_(conv_state)            # computed in full before the write: safe when present is past
        present_recurrent.copy_(recurrent_state)
        logits.copy_((x[-1:] + out[-1:]) @ self.lm_head)
        return logits


# --- onnxruntime-genai: src/models/recurrent_state.cpp --------------------------------------------------------

class GeneratorParams:
    def __init__(self, use_graph_capture, past_present_share_buffer=True):
        self.use_graph_capture = use_graph_capture
        self.past_present_share_buffer = past_present_share_buffer

    def IsPastPresentShareBufferEnabled(self):
        return self.past_present_share_buffer          # num_beams == 1 here


class RecurrentState:
    def __init__(self, state, device_type, variant):
        self.state_ = state
        params, device = state.params_, state.device
        if variant == "fix":
            self.share_buffers_ = params.IsPastPresentShareBufferEnabled()
            if params.use_graph_capture and not self.share_buffers_:
                raise RuntimeError("Graph capture requires past/present buffer sharing for models with recurrent "
                                   "state. Ensure past_present_share_buffer=true in genai_config.json and num_beams=1 "
                                   "(beam search disables buffer sharing).")
        else:
            if not params.IsPastPresentShareBufferEnabled():
                raise RuntimeError("RecurrentState requires past_present_share_buffer=true. "
                                   "Set past_present_share_buffer to true in genai_config.json.")
            # WebGPU prohibits binding the same buffer as both read-only (input) and read-write (output)
            # storage in the same compute pass, so it must use separate past/present buffers with swap.
            self.share_buffers_ = device_type != WEBGPU
        shapes = [(1, HIDDEN, CONV_K - 1), (1, HIDDEN, HIDDEN)]          # conv_state, recurrent_state
        self.pasts_ = [] if self.share_buffers_ else [torch.zeros(s, device=device) for s in shapes]
        self.presents_ = [torch.zeros(s, device=device) for s in shapes]
        self.input_index_ = self.output_index_ = None

    def Add(self):
        self.input_index_, self.output_index_ = len(self.state_.inputs_), len(self.state_.outputs_)
        for i in range(len(self.presents_)):
            # Shared buffers: alias input=output. Separate buffers: distinct past/present with per-step swap.
            self.state_.inputs_.append(self.presents_[i] if self.share_buffers_ else self.pasts_[i])
            self.state_.outputs_.append(self.presents_[i])

    def Update(self):
        if self.share_buffers_:
            return
        for i in range(len(self.presents_)):
            self.pasts_[i], self.presents_[i] = self.presents_[i], self.pasts_[i]          # std::swap
            self.state_.inputs_[self.input_index_ + i] = self.pasts_[i]
            self.state_.outputs_[self.output_index_ + i] = self.presents_[i]

    def buffers(self):
        named = {f"presents_[{i}]": t for i, t in enumerate(self.presents_)}
        named.update({f"pasts_[{i}]": t for i, t in enumerate(self.pasts_)})
        return named


# --- onnxruntime-genai: src/models/model.cpp, decoder_only.cpp ------------------------------------------------

class DecoderOnly_State:
    def __init__(self, session, params, device, device_type, variant):
        self.session, self.params_, self.device = session, params, device
        self.inputs_, self.outputs_ = [], []
        # input_ids_ / logits_: with graph capture, the one-token buffers are static (stable handles)
        self.static_input_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.logits = torch.zeros(1, VOCAB, device=device)
        self.inputs_.append(self.static_input_ids)                 # input_ids_.Add()
        self.outputs_.append(self.logits)                          # logits_.Add()
        self.recurrent_state_ = RecurrentState(self, device_type, variant)
        self.recurrent_state_.Add()
        self.graph = None

    def UpdateInputsOutputs(self, next_tokens):
        if len(next_tokens) == 1:
            self.static_input_ids.copy_(torch.tensor([next_tokens], device=self.device))
            self.inputs_[0] = self.static_input_ids
        else:
            self.inputs_[0] = torch.tensor([next_tokens], device=self.device)
        self.recurrent_state_.Update()

    def Run(self, next_tokens):
        self.UpdateInputsOutputs(next_tokens)
        graph_capture_this_run = self.params_.use_graph_capture and self.inputs_[0].shape[1] == 1
        return self.StateRun(graph_capture_this_run)

    def StateRun(self, graph_capture_this_run):
        """``State::Run``: a run with ``gpu_graph_id`` set is captured once by the EP, then replayed."""
        if not graph_capture_this_run:
            return self.session.Run(self.inputs_, self.outputs_)
        if self.graph is None:
            self.graph = capture(lambda: self.session.Run(self.inputs_, self.outputs_), device=self.device,
                                 warmups=0, name="decoder gpu_graph_id",
                                 static={"input_ids": self.static_input_ids},
                                 state=self.recurrent_state_.buffers(), owner="onnxruntime-genai State::Run")
        g, out = self.graph
        return replay(g, out)


def run(variant: str, device: str = "cpu"):
    session = DecoderSession(device)

    def generate(use_graph_capture):
        params = GeneratorParams(use_graph_capture)
        state = DecoderOnly_State(session, params, device, WEBGPU, variant)
        outs, next_tokens = [], list(PROMPT)
        for _ in range(MAX_NEW_TOKENS):
            logits = state.Run(next_tokens).clone()
            outs.append(logits)
            next_tokens = [int(logits.argmax(-1).item())]          # greedy search, on the host
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
