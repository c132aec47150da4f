"""ONNX Runtime GenAI on WebGPU with graph capture: a hybrid (Gated DeltaNet) decoder keeps separate past/present
recurrent-state buffers and swaps them after every token, but decode runs use one graph id, so every replay uses
the buffer bindings of the run that was captured and, on every other token, reads the recurrent state of an older
step.

Upstream: https://github.com/microsoft/onnxruntime-genai/pull/2564 ("Fix WebGPU recurrent state graph capture",
microsoft/onnxruntime-genai, by qjia7, merged 2026-09-15).
Read: the PR description (summary: "keep WebGPU's required separate past and present recurrent buffers and capture
one graph variant for each buffer-swap direction", "select alternating variants in standard decoder-only and
multimodal decoder states", "restore the standard decoder's canonical recurrent-buffer direction and matching graph
variant on a full rewind"; why: "A captured graph has stable buffer bindings, so reusing one graph for both swap
directions reads stale recurrent state"). The diff itself was not available to me. The code before the fix as of
a0c04eb (2026-08-22): ``src/models/recurrent_state.cpp`` (constructor: ``graph_double_buffer_ = !is_webgpu &&
use_graph_capture``, ``share_buffers_ = !is_webgpu && !graph_double_buffer_``; ``Add``; ``Update``: swap
``pasts_``/``presents_``, rebind ``inputs_``/``outputs_``, ``graph_buffer_variant_ ^= 1`` only when double
buffering; ``RewindTo``: a full rewind zeros and rebinds), ``decoder_only.cpp`` (``Run``: graph capture for
``seq_len <= max_graph_capture_length``, ``GraphCaptureVariant()``; ``UpdateInputsOutputs`` calls
``recurrent_state_->Update()`` before every run), ``model.cpp`` (``State::GraphIdForLength(length, variant)``,
``State::Run`` setting ``gpu_graph_id``), and the commit that opened the hole, #2352 (854b055, 2026-08-14: it removed
``RecurrentState``'s "graph capture needs shared buffers" guard of #2244 and turned WebGPU back to separate buffers).
Symptom: Qwen3.5-style hybrid models decode from stale recurrent state on WebGPU with graph capture enabled (the
PR's "reads stale recurrent state"; #2244 reported garbage output for the same frozen bindings); without graph
capture the output is right.
Mechanism: WebGPU cannot bind one buffer as both the read-only past and the read-write present state, so
``RecurrentState`` allocates both and ``Update`` swaps them before each run. The EP records a graph per
``gpu_graph_id`` and replays it with the bindings it was captured with; GenAI gives all 1-token decode runs the same
id (``graph_double_buffer_`` excludes WebGPU, so the variant stays 0). From the run after the capture on, the replay
reads the buffer the capture read as past while GenAI has swapped roles: every other token it reads a state two
steps old, and the present it writes is not the buffer GenAI reads next.
Doctor: warmup-divergence, at __init__. The graph for the decode id fixed its state bindings when it was captured;
eager runs follow the per-token swap. ``RecurrentState``'s constructor decides, for WebGPU, that no per-direction
graph variant is used, which is where the fix turns them on.
Fix (upstream): double-buffered graph variants on WebGPU too: ``Update`` toggles ``graph_buffer_variant_``,
``Run`` asks for the graph id of (length, variant), one graph is captured per swap direction; a full ``RewindTo``
restores the canonical buffer direction together with variant 0.
Modelled: GenAI's ``RecurrentState`` (constructor, ``Add``, ``Update``, ``RewindTo``, ``ZeroStates``), the static
``input_ids`` and ``logits`` buffers used under graph capture, ``State::GraphIdForLength``/``State::Run``,
``DecoderOnly_State::Run``/``UpdateInputsOutputs``/``RewindTo`` and a generator that appends a prompt and feeds
fixed next tokens; ORT's session ``Run`` with ``gpu_graph_id`` (``-1`` runs eagerly; an id runs one regular run, is
captured on the next run with that run's bindings, then replayed). Stand-ins: the WebGPU EP's recorded command list
is an engine graph (captured, then replayed once to produce that run's outputs); graph ids are counters; the model is
one Gated DeltaNet layer (``CausalConvWithState`` + ``LinearAttention`` with a delta-rule state) and an LM head, no
attention layers, no KV cache; tokens are fixed in advance (no search); float64.
Workload: generation 1 (prompt of 3 tokens, 6 decode tokens), ``RewindTo(0)``, generation 2 (prompt of 2, 5 decode
tokens); the logits of every run are compared. Bug: the decode id is captured on the 2nd decode run; from the 3rd
on, replays read stale recurrent state (8 of 11 decode runs wrong, max logit error 5.17). Fix: the two direction
variants are captured on the 3rd and 4th decode runs and every run equals eager (max error 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime-genai/pull/2564"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "__init__"
SYMPTOM = ("WebGPU + graph capture: hybrid (Gated DeltaNet) models decode garbage: one graph per decode length keeps "
           "the capture's past/present bindings while GenAI swaps the recurrent buffers every token")

VOCAB, HIDDEN, CONV_K = 16, 8, 3
DTYPE = torch.float64
WEBGPU, CUDA = "WebGPU", "CUDA"
MIN_NUM_RUNS_BEFORE_GRAPH_CAPTURE = 1

_variant = "bug"


# --- onnxruntime (stand-in): a session whose EP records one graph per gpu_graph_id ---------------------------------

class QwenHybridDecoder:
    """The ONNX model: embedding, one Gated DeltaNet layer (CausalConvWithState + LinearAttention), LM head."""

    def __init__(self, device):
        gen = generator(2564)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed, self.conv_w = r(VOCAB, HIDDEN, scale=1.0), r(HIDDEN, CONV_K)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.w_gate, self.w_beta = r(HIDDEN), r(HIDDEN)
        self.lm_head = r(VOCAB, HIDDEN, scale=1.0)

    def forward(self, input_ids, past_conv, past_recurrent, logits_out, present_conv, present_recurrent):
        conv, state, logits = past_conv, past_recurrent, []
        for x in self.embed[input_ids[0]]:
            window = torch.cat([conv, x[:, None]], dim=1)                      # CausalConvWithState
            c = F.silu((window * self.conv_w).sum(1))
            conv = window[:, 1:]
            q, k, v = self.wq @ c, F.normalize(self.wk @ c, dim=0), self.wv @ c
            g, beta = torch.sigmoid(self.w_gate @ c), torch.sigmoid(self.w_beta @ c)
            state = g * state + beta * torch.outer(k, v - state.T @ k)          # LinearAttention, delta rule
            h = x + self.wo @ (state.T @ q)
            logits.append(self.lm_head @ F.rms_norm(h, (HIDDEN,)))
        logits_out.copy_(torch.stack(logits))
        present_conv.copy_(conv)
        present_recurrent.copy_(state)


class InferenceSession:
    def __init__(self, model: QwenHybridDecoder, device):
        self.model, self.device = model, device
        self.graphs, self.regular_run_count = {}, {}

    def Run(self, run_options: dict, input_names, inputs, output_names, outputs):
        feeds, fetches = dict(zip(input_names, inputs)), dict(zip(output_names, outputs))

        def run_kernels(feeds=feeds, fetches=fetches):                         # the bindings of this run
            self.model.forward(feeds["input_ids"], feeds["past.conv_state"], feeds["past.recurrent_state"],
                               fetches["logits"], fetches["present.conv_state"], fetches["present.recurrent_state"])
            return fetches["logits"]

        graph_id = run_options.get("gpu_graph_id", "-1")
        if graph_id == "-1":
            run_kernels()
        elif graph_id in self.graphs:                                           # replay: the captured bindings
            g, out = self.graphs[graph_id]
            replay(g, out)
        elif self.regular_run_count.get(graph_id, 0) >= MIN_NUM_RUNS_BEFORE_GRAPH_CAPTURE:
            self.graphs[graph_id] = g, out = capture(
                run_kernels, device=self.device, warmups=0, name=f"gpu_graph_id {graph_id}", owner="WebGPU EP",
                static={"input_ids": feeds["input_ids"]},
                state={n: feeds[n] for n in ("past.conv_state", "past.recurrent_state")}
                | {n: fetches[n] for n in ("present.conv_state", "present.recurrent_state")})
            replay(g, out)                                                      # the capture run's own results
        else:
            self.regular_run_count[graph_id] = self.regular_run_count.get(graph_id, 0) + 1
            run_kernels()


# --- onnxruntime-genai: src/models/recurrent_state.cpp ----------------------------------------------------------------

class RecurrentState:
    def __init__(self, state: "DecoderOnly_State"):
        self.state_ = state
        params, device = state.params_, state.device
        self.input_name_strings_ = ["past.conv_state", "past.recurrent_state"]
        self.output_name_strings_ = ["present.conv_state", "present.recurrent_state"]
        is_webgpu = state.model_.p_device_kvcache_ == WEBGPU
        if _variant == "bug":
            self.graph_double_buffer_ = not is_webgpu and params.use_graph_capture
        else:   # WebGPU keeps separate buffers but captures one graph variant per swap direction
            self.graph_double_buffer_ = params.use_graph_capture
        self.share_buffers_ = not is_webgpu and not self.graph_double_buffer_
        self.graph_buffer_variant_ = 0
        shapes = [(HIDDEN, CONV_K - 1), (HIDDEN, HIDDEN)]
        self.presents_ = [torch.zeros(s, dtype=DTYPE, device=device) for s in shapes]
        self.pasts_ = None if self.share_buffers_ else [torch.zeros(s, dtype=DTYPE, device=device) for s in shapes]

    def GraphCaptureVariant(self) -> int:
        return self.graph_buffer_variant_

    def Add(self):
        st = self.state_
        self.input_index_, self.output_index_ = len(st.inputs_), len(st.outputs_)
        for i in range(2):
            st.inputs_.append(self.presents_[i] if self.share_buffers_ else self.pasts_[i])
            st.input_names_.append(self.input_name_strings_[i])
            st.outputs_.append(self.presents_[i])
            st.output_names_.append(self.output_name_strings_[i])

    def rebind(self):
        for i in range(2):
            self.state_.inputs_[self.input_index_ + i] = self.pasts_[i]
            self.state_.outputs_[self.output_index_ + i] = self.presents_[i]

    def Update(self):
        if self.share_buffers_:
            return
        self.pasts_, self.presents_ = self.presents_, self.pasts_               # std::swap(pasts_[i], presents_[i])
        self.rebind()
        if self.graph_double_buffer_:
            self.graph_buffer_variant_ ^= 1

    def RewindTo(self, index: int):
        assert index == 0, "only full rewinds are modelled"
        if self.share_buffers_:
            self.ZeroStates(self.presents_)
            return
        if _variant == "fix" and self.graph_double_buffer_ and self.graph_buffer_variant_ == 1:
            self.pasts_, self.presents_ = self.presents_, self.pasts_           # canonical direction ...
            self.graph_buffer_variant_ = 0                                      # ... with its graph variant
        self.ZeroStates(self.pasts_)
        self.ZeroStates(self.presents_)
        self.rebind()

    @staticmethod
    def ZeroStates(states):
        for t in states:
            t.zero_()


# --- onnxruntime-genai: model.cpp (State), decoder_only.cpp, input_ids.cpp, logits.cpp --------------------------------

class GeneratorParams:
    def __init__(self, use_graph_capture: bool):
        self.use_graph_capture, self.max_graph_capture_length = use_graph_capture, 1


class Model:
    def __init__(self, device):
        self.p_device_kvcache_ = WEBGPU                                         # the EP the session runs on
        self.session_decoder_ = InferenceSession(QwenHybridDecoder(device), device)


class DecoderOnly_State:
    def __init__(self, params: GeneratorParams, model: Model, device):
        self.params_, self.model_, self.device = params, model, device
        self.inputs_, self.input_names_, self.outputs_, self.output_names_ = [], [], [], []
        self.graph_ids_, self.run_options_ = {}, {}
        if params.use_graph_capture:                                            # static buffers, 1-token runs
            self.static_input_ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
            self.static_logits = torch.zeros(1, VOCAB, dtype=DTYPE, device=device)
        self.inputs_.append(None)
        self.input_names_.append("input_ids")
        self.outputs_.append(None)
        self.output_names_.append("logits")
        self.recurrent_state_ = RecurrentState(self)
        self.recurrent_state_.Add()
        if params.use_graph_capture:
            self.GraphIdForLength(1, 0)

    def GraphIdForLength(self, length: int, variant: int) -> str:
        key = length * 2 + variant
        return self.graph_ids_.setdefault(key, str(len(self.graph_ids_) + 1))

    def UpdateInputsOutputs(self, next_tokens: torch.Tensor):
        n = next_tokens.shape[0]
        use_static = self.params_.use_graph_capture and n <= self.params_.max_graph_capture_length
        if use_static:
            self.static_input_ids[0, :n].copy_(next_tokens)
            self.inputs_[0], self.outputs_[0] = self.static_input_ids, self.static_logits
        else:
            self.inputs_[0] = next_tokens[None].clone()
            self.outputs_[0] = torch.zeros(n, VOCAB, dtype=DTYPE, device=self.device)
        self.recurrent_state_.Update()

    def Run(self, next_tokens: torch.Tensor) -> torch.Tensor:
        self.UpdateInputsOutputs(next_tokens)
        seq_len = next_tokens.shape[0]
        graph_capture_this_run = self.params_.use_graph_capture and 1 <= seq_len <= self.params_.max_graph_capture_length
        variant = self.recurrent_state_.GraphCaptureVariant()
        if self.params_.use_graph_capture:                                      # State::Run
            self.run_options_["gpu_graph_id"] = (self.GraphIdForLength(seq_len, variant)
                                                 if graph_capture_this_run else "-1")
        self.model_.session_decoder_.Run(self.run_options_, self.input_names_, self.inputs_, self.output_names_,
                                         self.outputs_)
        return self.outputs_[0][-1]

    def RewindTo(self, index: int):
        self.recurrent_state_.RewindTo(index)


class Generator:
    def __init__(self, model: Model, params: GeneratorParams, device):
        self.state_, self.device = DecoderOnly_State(params, model, device), device

    def append_tokens(self, tokens) -> torch.Tensor:
        return self.state_.Run(torch.tensor(tokens, dtype=torch.int64).to(self.device)).clone()

    def generate_next_token(self, token: int) -> torch.Tensor:                 # the chosen token, fed back
        return self.state_.Run(torch.tensor([token], dtype=torch.int64).to(self.device)).clone()

    def rewind_to(self, index: int):
        self.state_.RewindTo(index)


# --- the workload ---------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(25640)
    generations = [(torch.randint(0, VOCAB, (3,), generator=gen).tolist(), torch.randint(0, VOCAB, (6,),
                                                                                         generator=gen).tolist()),
                   (torch.randint(0, VOCAB, (2,), generator=gen).tolist(), torch.randint(0, VOCAB, (5,),
                                                                                         generator=gen).tolist())]

    def serve(use_graph_capture: bool):
        model = Model(device)
        generator_ = Generator(model, GeneratorParams(use_graph_capture), device)
        logits = []
        for i, (prompt, tokens) in enumerate(generations):
            if i:
                generator_.rewind_to(0)
            logits.append(generator_.append_tokens(prompt))
            logits += [generator_.generate_next_token(t) for t in tokens]
        return logits

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
