"""ORT WebGPU EP graph capture keeps one "captured" flag and one command list for every graph annotation id: a second generator's decode runs replay the first generator's captured commands.

Upstream: https://github.com/microsoft/onnxruntime/pull/28260 ("[webgpu] Per-graph buffer manager for WebGPU
multi-graph capture", qjia7, opened 2026-04-29, merged; review threads run to 2026-05-19). Companion GenAI change:
https://github.com/microsoft/onnxruntime-genai/pull/2106 (``State::~State`` calls the new ``ReleaseGraph``).
Symptom: the PR: "Edge's Prompt API speed benchmark creates multiple sessions/generators sequentially with graph capture
enabled. With the existing single-graph design, the second generator replays the first generator's captured commands
with wrong buffers, producing incorrect output and ultimately a QuotaExceededError in the browser." No error is raised
at first: the second generator's logits never change after its prompt, so it repeats one token. Without graph capture
(or with one generator per session) every Run dispatches on its own bound buffers and the output is right.
Mechanism: onnxruntime-genai gives every generator (``State``) its own random graph annotation id
(``graph_id_``, 1..INT_MAX) and runs its prompt with ``gpu_graph_id = -1`` (no capture) and its decode steps with
``gpu_graph_id = graph_id_``, each on its own IO-bound buffers (input ids, positions, attention mask, the shared
past/present KV cache, the logits). ``InferenceSession::Run`` replays instead of running when
``IsGraphCaptured(id)``; otherwise ``WebGpuExecutionProvider::OnRunStart`` opens a capture
(``context_.CaptureBegin(&captured_commands_, *graph_buffer_mgr_)``: every dispatch, with the bind groups of the
buffers bound for this Run, is recorded instead of submitted) once ``IsGraphCaptureAllowed()``, and ``OnRunEnd``
closes it, sets ``is_graph_captured_ = true`` and calls ``ReplayGraph(id)`` (``context_.Replay(captured_commands_,
*graph_buffer_mgr_)``). Before the fix (``onnxruntime/core/providers/webgpu/webgpu_execution_provider.cc``)
``IsGraphCaptured(graph_annotation_id)`` was ``is_graph_captured_ && graph_annotation_id != -1``: one flag for every
id, one ``captured_commands_`` list, one ``graph_buffer_mgr_``; the regular-run count before capture was global too.
Generator A's first decode Run captured A's step (A's buffers frozen in the bind groups). Generator B's prompt (id -1)
ran eagerly, but B's first decode Run asked ``IsGraphCaptured(B's id)``, got true, skipped B's regular run and
capture and replayed A's commands: they read A's input buffers and write A's KV cache and A's logits. B's logits
buffer keeps what B's last prompt run wrote, so every decode step of B samples the same token, and B's KV cache never
receives its decode tokens.
Doctor: warmup-divergence, at IsGraphCaptured (the capture of A's id decided the tensor references, A's IO bindings,
and the "captured" decision that ignores the id makes every later id replay them: B's replays run A's frozen
bindings while the eager step of B computes on B's own inputs, cache and logits; ``IsGraphCaptured`` is where the
fix keys the decision by id).
Fix (upstream): ``is_graph_captured_`` / ``captured_commands_`` / ``graph_buffer_mgr_`` become
``captured_graph_ids_`` (a set: ``IsGraphCaptured`` checks the id), ``captured_graphs_`` and
``per_graph_buffer_mgrs_`` keyed by annotation id, with a per-id regular-run count (``graph_id_to_run_count_`` in the
post-fix header);
``OnRunStart`` captures into the id's own command list and buffer manager (``GpuBufferAllocator`` is pointed at the
active one), ``ReplayGraph(id)`` replays that id's commands, and ``ReleaseGraph(id)`` (new, through the C API) frees
one graph's commands and buffers.
Modelled: one decoder layer (embedding, single-head attention over a fixed ``MAX_LENGTH`` KV cache written in place at
the position, as with ``past_present_share_buffer``; tanh residual, lm_head); float32. Prompts run one token per
Run (id -1). The recorded WebGPU command list is an engine graph and a ``BufferManager`` is a graph pool (one for all
ids before the fix, one per id after). ``ReplayGraph`` also takes the Run's bound outputs (``p_fetches``), which it
hands back as ORT's Run does. ``InferenceSession::Run``'s "another run for necessary memory allocation or graph
capture" recursion is kept; the regular run before a capture is announced as a real warm-up. Generator A is still
alive while B runs (a Python loop that rebinds ``generator = og.Generator(...)`` builds the new generator before the
old one is dropped: onnxruntime-genai #404), so A's buffers stay valid and the replays read live memory.
``ReleaseGraph``, profiling, validation scopes, uniform buffers and the buffer-cache modes are not modelled.
"""
from __future__ import annotations

import random

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/microsoft/onnxruntime/pull/28260"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "IsGraphCaptured"
SYMPTOM = ("WebGPU graph capture: one is_graph_captured_ flag for every gpu_graph_id, so a second generator replays "
           "the first generator's captured commands; its logits stay at the prompt's and it repeats one token")

VOCAB, HIDDEN, MAX_LENGTH = 16, 8, 12
PROMPTS = ([3, 7, 1], [12, 5, 9, 2])       # generator A, then generator B (A still alive)
MAX_NEW_TOKENS = 4
kOrtRunOptionsConfigCudaGraphAnnotation = "gpu_graph_id"


# --- the model: the session's kernels on the IO-bound buffers ---------------------------------------------------

class DecoderModel:
    def __init__(self, device):
        gen = generator(28260)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=1.5)

    def forward(self, input_ids, position_ids, attention_mask, past_key, past_value, logits):
        x = self.embed.index_select(0, input_ids)                         # [1, HIDDEN]
        past_key.index_copy_(0, position_ids, x @ self.wk)               # present == past (shared buffer)
        past_value.index_copy_(0, position_ids, x @ self.wv)
        scores = (x @ self.wq) @ past_key.t() * HIDDEN ** -0.5            # [1, MAX_LENGTH]
        scores = scores.masked_fill(attention_mask == 0, -1e9)
        h = x + torch.tanh(torch.softmax(scores, dim=-1) @ past_value @ self.wo)
        logits.copy_(h @ self.lm_head)
        return logits


# --- onnxruntime/core/providers/webgpu: the context's command recording --------------------------------------

class BufferManager:
    """The buffers a captured command list binds: here the graph pool its capture allocates from."""

    def __init__(self, device):
        self.pool = graph_pool_handle(device)


class CapturedCommands:
    """``std::vector<webgpu::CapturedCommandInfo>``: what a capture recorded (an engine graph here)."""

    def __init__(self):
        self.graph = None


class WebGpuContext:
    def __init__(self, device):
        self.device = device
        self._capture = None                      # (commands, buffer manager, name) while a capture is open

    def CaptureBegin(self, captured_commands, buffer_mgr, name):
        self._capture = (captured_commands, buffer_mgr, name)

    def Dispatch(self, program):
        """The session's kernels: submitted, or recorded while a capture is open (not executed)."""
        if self._capture is None:
            return program()
        commands, buffer_mgr, name = self._capture
        commands.graph, out = capture(program, device=self.device, pool=buffer_mgr.pool, warmups=0, name=name)
        return out

    def CaptureEnd(self):
        self._capture = None

    def Replay(self, captured_commands, buffer_mgr, fetches):
        return replay(captured_commands.graph, fetches)


# --- onnxruntime/core/providers/webgpu/webgpu_execution_provider.cc -----------------------------------------------

class WebGpuExecutionProvider:
    def __init__(self, context, enable_graph_capture, variant):
        self.context_ = context
        self.enable_graph_capture_ = enable_graph_capture
        self.min_num_runs_before_cuda_graph_capture_ = 1
        self.m_current_graph_annotation_id = 0
        self._per_graph = variant == "fix"                       # PR #28260
        # before #28260: one of each for the whole session
        self.is_graph_captured_ = False
        self.regular_run_count_before_graph_capture_ = 0
        self.captured_commands_ = CapturedCommands()
        self.graph_buffer_mgr_ = BufferManager(context.device) if enable_graph_capture else None
        # PR #28260: keyed by graph annotation id
        self.captured_graphs_: dict[int, CapturedCommands] = {}
        self.captured_graph_ids_: set[int] = set()
        self.per_graph_buffer_mgrs_: dict[int, BufferManager] = {}
        self.graph_id_to_run_count_: dict[int, int] = {}

    def IsGraphCaptureEnabled(self):
        return self.enable_graph_capture_

    def IsGraphCaptured(self, graph_annotation_id):
        if self._per_graph:
            return graph_annotation_id in self.captured_graph_ids_
        return self.is_graph_captured_ and graph_annotation_id != -1

    def IsGraphCaptureAllowed(self):
        if self._per_graph:
            runs = self.graph_id_to_run_count_.get(self.m_current_graph_annotation_id, 0)
            return runs >= self.min_num_runs_before_cuda_graph_capture_
        return self.regular_run_count_before_graph_capture_ >= self.min_num_runs_before_cuda_graph_capture_

    def IncrementRegularRunCountBeforeGraphCapture(self):
        if self._per_graph:
            gid = self.m_current_graph_annotation_id
            self.graph_id_to_run_count_[gid] = self.graph_id_to_run_count_.get(gid, 0) + 1
        else:
            self.regular_run_count_before_graph_capture_ += 1

    def OnRunStart(self, run_options):
        if self.IsGraphCaptureEnabled():
            graph_annotation_id = int(run_options.get(kOrtRunOptionsConfigCudaGraphAnnotation, 0))
            self.m_current_graph_annotation_id = graph_annotation_id
            if (graph_annotation_id != -1 and self.IsGraphCaptureAllowed()
                    and not self.IsGraphCaptured(graph_annotation_id)):
                name = f"gpu_graph_id={graph_annotation_id}"
                if self._per_graph:
                    commands = self.captured_graphs_.setdefault(graph_annotation_id, CapturedCommands())
                    buffer_mgr = self.per_graph_buffer_mgrs_.setdefault(graph_annotation_id,
                                                                        BufferManager(self.context_.device))
                    self.context_.CaptureBegin(commands, buffer_mgr, name)
                else:
                    self.context_.CaptureBegin(self.captured_commands_, self.graph_buffer_mgr_, name)

    def OnRunEnd(self, run_options, fetches):
        gid = self.m_current_graph_annotation_id
        if self.IsGraphCaptureEnabled() and not self.IsGraphCaptured(gid):
            if gid != -1 and self.IsGraphCaptureAllowed():
                self.context_.CaptureEnd()
                if self._per_graph:
                    self.captured_graph_ids_.add(gid)
                else:
                    self.is_graph_captured_ = True
                return self.ReplayGraph(gid, fetches)
            self.IncrementRegularRunCountBeforeGraphCapture()
        return fetches

    def ReplayGraph(self, graph_annotation_id, fetches):
        assert self.IsGraphCaptured(graph_annotation_id)
        if self._per_graph:
            return self.context_.Replay(self.captured_graphs_[graph_annotation_id],
                                        self.per_graph_buffer_mgrs_[graph_annotation_id], fetches)
        return self.context_.Replay(self.captured_commands_, self.graph_buffer_mgr_, fetches)


# --- onnxruntime/core/session/inference_session.cc ---------------------------------------------------------------

class IOBinding:
    def __init__(self, inputs: dict, past: dict, outputs: dict):
        self.inputs, self.past, self.outputs = inputs, past, outputs


class InferenceSession:
    def __init__(self, model, device, enable_graph_capture, variant):
        self.model = model
        self.ep = WebGpuExecutionProvider(WebGpuContext(device), enable_graph_capture, variant)
        self._announced: set[int] = set()

    def _execute(self, io_binding):
        b = io_binding
        return self.model.forward(b.inputs["input_ids"], b.inputs["position_ids"], b.inputs["attention_mask"],
                                  b.past["past_key"], b.past["past_value"], b.outputs["logits"])

    def Run(self, run_options, io_binding):
        ep = self.ep
        fetches = io_binding.outputs["logits"]
        graph_annotation_id = int(run_options.get(kOrtRunOptionsConfigCudaGraphAnnotation, 0))
        if ep.IsGraphCaptureEnabled() and ep.IsGraphCaptured(graph_annotation_id):
            return ep.ReplayGraph(graph_annotation_id, fetches)          # "Replaying the captured graph"
        capture_candidate = ep.IsGraphCaptureEnabled() and graph_annotation_id != -1
        if capture_candidate and graph_annotation_id not in self._announced:
            owner = f"InferenceSession (WebGPU EP, gpu_graph_id={graph_annotation_id})"
            events.static_buffers(owner, io_binding.inputs)
            events.persistent_state(owner, io_binding.past)
            self._announced.add(graph_annotation_id)
        ep.OnRunStart(run_options)
        if capture_candidate and ep.context_._capture is None:
            with events.warmup(real=True):                              # a regular run before the capture
                ep.context_.Dispatch(lambda: self._execute(io_binding))
        else:
            ep.context_.Dispatch(lambda: self._execute(io_binding))
        out = ep.OnRunEnd(run_options, fetches)
        if capture_candidate and not ep.IsGraphCaptured(graph_annotation_id):
            # "Start another run for necessary memory allocation or graph capture."
            return self.Run(run_options, io_binding)
        return out


# --- onnxruntime-genai: a generator (State) with its own IO-bound buffers and graph id ----------------------------

class Generator:
    def __init__(self, session, device, use_graph_capture, graph_ids):
        self.session, self.device = session, device
        self.use_graph_capture = use_graph_capture
        self.graph_id_ = str(graph_ids.randint(1, 2 ** 31 - 1)) if use_graph_capture else ""
        self.io = IOBinding(
            inputs={"input_ids": torch.zeros(1, dtype=torch.long, device=device),
                    "position_ids": torch.zeros(1, dtype=torch.long, device=device),
                    "attention_mask": torch.zeros(MAX_LENGTH, device=device)},
            past={"past_key": torch.zeros(MAX_LENGTH, HIDDEN, device=device),
                  "past_value": torch.zeros(MAX_LENGTH, HIDDEN, device=device)},
            outputs={"logits": torch.zeros(1, VOCAB, device=device)})
        self.length = 0
        self.tokens: list[int] = []

    def _run(self, token, graph_capture_this_run):
        inputs = self.io.inputs
        inputs["input_ids"].copy_(torch.tensor([token]).to(self.device))
        inputs["position_ids"].copy_(torch.tensor([self.length]).to(self.device))
        inputs["attention_mask"].copy_((torch.arange(MAX_LENGTH) <= self.length).float().to(self.device))
        run_options = {}
        if self.use_graph_capture:
            run_options[kOrtRunOptionsConfigCudaGraphAnnotation] = self.graph_id_ if graph_capture_this_run else "-1"
        logits = self.session.Run(run_options, self.io).clone()
        self.length += 1
        return logits

    def generate(self, prompt):
        for token in prompt:                                         # the prompt: no capture
            logits = self._run(token, graph_capture_this_run=False)
        served = [logits]
        for _ in range(MAX_NEW_TOKENS - 1):
            token = int(logits.argmax())
            self.tokens.append(token)
            logits = self._run(token, graph_capture_this_run=True)
            served.append(logits)
        self.tokens.append(int(logits.argmax()))
        return served


def run(variant: str, device: str = "cpu"):
    def serve(use_graph_capture: bool):
        model = DecoderModel(device)
        session = InferenceSession(model, device, use_graph_capture, variant)
        graph_ids = random.Random(2106)
        outs, generators = [], []
        for prompt in PROMPTS:                                       # sequential generators, A kept alive
            gen = Generator(session, device, use_graph_capture, graph_ids)
            generators.append(gen)
            outs += gen.generate(prompt)
            outs.append(torch.tensor(gen.tokens, dtype=torch.float32))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
