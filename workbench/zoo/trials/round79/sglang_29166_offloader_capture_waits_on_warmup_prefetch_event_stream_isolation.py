"""SGLang's OffloaderV2 (CPU weight offload) waits, inside the decode-graph capture, on a prefetch event that the warmup recorded on the offload stream, so the capture fails with cudaErrorStreamCaptureIsolation.

Upstream: https://github.com/sgl-project/sglang/pull/29166 ("[Fix]: Inline H2D during CUDA graph capture to avoid
stream isolation in Offloader", Dovis01, description dated 2026-06-24, merged; no linked issue).
Symptom: a server started with ``--offload-group-size/--offload-num-in-group/--offload-prefetch-step`` (OffloaderV2,
``offload_mode="cpu"``) and decode CUDA graphs on fails at start: "Capture cuda graph failed ...
cudaErrorStreamCaptureIsolation". ``--disable-cuda-graph`` works.
Mechanism: in ``python/sglang/srt/utils/offloader.py``, ``OffloaderV2.wrap_modules`` gives each offloaded submodule
(here ``layer.mlp.experts``, a ``FusedMoE`` whose ``w13_weight``/``w2_weight`` live in pinned CPU memory) a
``_ModuleOffloader``, and ``_hook_module_forward_for_offloader`` hooks its forward. The forward runs
``functional_call`` with ``offloaders[index].wait_and_get_device_tensors()``. At its end it calls
``offloaders[(index + prefetch_step) % len].start_onload()`` and then ``offloaders[index].offload()``. It is a ring
prefetch driven from Python. ``start_onload`` does ``alt_stream.wait_stream(current_stream())``, then, under
``torch.cuda.stream(alt_stream)``, the H2D copies (``param.to("cuda", non_blocking=True)``) and
``self._load_event = torch.cuda.Event(); self._load_event.record()``. ``wait_and_get_device_tensors`` calls
``self._load_event.wait()`` on the current stream. ``OffloaderV2.post_init`` starts the first ``prefetch_step``
onloads. ``CudaGraphRunner.capture_one_batch_size`` warms up twice (``run_once()``) on the capture stream, then
captures ``run_once()`` under ``torch.cuda.graph(graph, pool=pool, stream=stream)``. At the end of the warmup's
last offloaded module, the ring wraps around: it issues the onload of the first offloaded module on ``alt_stream``
and records its ``_load_event`` there, outside any capture. In the capture, the first offloaded module's
``wait_and_get_device_tensors`` makes the capturing stream wait on that uncaptured event. CUDA forbids a
dependency that crosses the capture boundary and fails the capture (the PR: "a prefetch/event was created during
warmup **before** capture starts, and capture later tries to wait on that out-of-capture event"). Without graphs
nothing captures: the same event wait only orders the copy before the compute, and the outputs are right.
Doctor: sync-in-capture, at wait_and_get_device_tensors. A stream wait on an event recorded outside the capture is
a dependency of the capture on uncaptured work. CUDA refuses it during capture, as it refuses a host
synchronisation, and the capture fails. The bug lives in ``wait_and_get_device_tensors``. That is the function
where the fix changed code (with ``start_onload``): while the stream is capturing, it no longer waits on the event.
Fix (upstream): ``start_onload`` checks ``torch.cuda.is_current_stream_capturing()`` first. If the stream is
capturing, it creates the device tensors inline on the capture stream, sets ``_load_event = None`` and returns.
``wait_and_get_device_tensors``, when capturing, re-creates the device tensors inside the capture if
``_load_event is not None`` (a prefetch made outside this capture), drops the event, and returns them with no
wait. Outside capture it waits only if there is an event. The copies become graph nodes whose destinations
live in the graph pool. The alt-stream path outside capture is unchanged. (Read: the pre-fix
``_ModuleOffloader`` at commit 29bd4e85 and the post-fix file, the PR description, and the ``deepseek_v2.py``
``offloader_kwargs``.)
Modelled: streams and events are Python objects on both backends, since the CPU engine does not model them. Each
stream knows the capture it takes part in. An event records the capture of the stream it was recorded on (None
outside any capture). CUDA's rule is stated in the model: a capturing stream may not wait (without
``cudaEventWaitExternal``) on an event recorded outside its capture, or in another capture. The model raises
cudaErrorStreamCaptureIsolation at that wait, as the PR reports. The CUDA documentation of that error: a
dependency would cross the capture boundary. HIP lists ``hipErrorStreamCaptureIsolation`` among the results of
``hipStreamWaitEvent``. A stream that is not capturing joins a capture when it waits on one
of its events (fork). The origin joins it back by waiting on its event. The capture fails at its end if a forked
stream is left unjoined. ``torch.cuda.graph(..., stream=stream)`` is the engine's capture plus the modelled
capture of the runner's stream. Execution order on streams is not modelled: every op runs in program order, so
the event waits only matter to the capture rules. ``_CpuParamOffloader`` keeps its pinned CPU copy (``host()``)
beside the module and moves the module's parameter to meta. Upstream keeps the pinned tensor as the parameter.
The model is 4 decoder layers: a resident attention stand-in (a linear mix) and an MoE with 2 experts that are
weighted densely by the router (no top-k). ``group_size=2, num_in_group=1, prefetch_step=1`` offload the experts
of layers 1 and 3. There is one decode graph (bs=2) and 4 greedy decode steps. The workload is decode only.
An eager forward (a prefill) right after capture is left out. After the fix, the first offloaded module would
then use the tensors that the capture made for the wrap-around onload, and no replay has filled them yet. This is
our own observation of the post-fix code; the PR does not discuss it.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from workbench.engine import CaptureError, events, graph_pool_handle, host
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/29166"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "wait_and_get_device_tensors"
SYMPTOM = ("server start fails with 'Capture cuda graph failed ... cudaErrorStreamCaptureIsolation': the first "
           "offloaded layer waits, inside the decode-graph capture, on the prefetch event the warmup recorded "
           "on the offload stream")

VOCAB, HIDDEN, INTERMEDIATE, NUM_EXPERTS, NUM_LAYERS = 16, 8, 12, 2, 4
OFFLOAD_GROUP_SIZE, OFFLOAD_NUM_IN_GROUP, OFFLOAD_PREFETCH_STEP = 2, 1, 1
BS, DECODE_STEPS = 2, 4


# --- the modelled CUDA runtime: streams, events, stream capture --------------------------------------------------

class _Capture:
    """One open stream capture: its origin stream, and the streams forked into it and not yet joined back."""

    def __init__(self, origin: "Stream"):
        self.origin, self.forked = origin, set()


class Stream:
    """``torch.cuda.Stream``: ``capture`` is the capture this stream takes part in, if any."""

    def __init__(self, name: str):
        self.name = name
        self.capture: _Capture | None = None

    def __repr__(self):
        return f"<Stream {self.name}>"

    def record_event(self, event: "Event") -> None:
        event.stream, event.capture = self, self.capture      # recorded on a capturing stream: a node of it

    def wait_event(self, event: "Event") -> None:
        """``cudaStreamWaitEvent``. From a capturing stream, the event must belong to the same capture."""
        cap = event.capture
        if self.capture is not None and cap is not self.capture:
            where = user_frame()
            what = "a non-captured event" if cap is None else "an event of another capture"
            raise CaptureError(
                f"CUDA error: dependency created on uncaptured work in another stream "
                f"(cudaErrorStreamCaptureIsolation): {self!r}, which is being captured, waits on {what} "
                f"(recorded on {event.stream!r}).\n  at {where}",
                op="cudaStreamWaitEvent", source=where)
        if cap is None:
            return                                             # an ordinary wait, outside any capture
        if self.capture is None:                               # fork: this stream joins the capture
            self.capture = cap
            cap.forked.add(self)
        elif self is cap.origin and event.stream is not cap.origin:
            cap.forked.discard(event.stream)                   # join: the origin waits on the forked stream

    def wait_stream(self, other: "Stream") -> None:
        """``Stream.wait_stream``: record an event on ``other`` and wait on it."""
        ev = Event()
        ev.record(other)
        self.wait_event(ev)


class Event:
    """``torch.cuda.Event``: ``record()`` and ``wait()`` use the current stream."""

    def __init__(self):
        self.stream: Stream | None = None
        self.capture: _Capture | None = None

    def record(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).record_event(self)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)


DEFAULT_STREAM = Stream("default")
_current = [DEFAULT_STREAM]
_named_streams: dict = {}


def current_stream() -> Stream:
    return _current[-1]


@contextlib.contextmanager
def cuda_stream(s: Stream):
    """``torch.cuda.stream(s)``."""
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()


def get_stream(name: str) -> Stream:
    """``sglang.srt.runtime_context.get_stream``: one named stream per process."""
    return _named_streams.setdefault(name, Stream(name))


@contextlib.contextmanager
def stream_capture(s: Stream):
    """The stream side of ``torch.cuda.graph(graph, pool=pool, stream=s)``: ``s`` becomes current and is captured
    (cudaStreamBeginCapture ... cudaStreamEndCapture)."""
    cap = _Capture(s)
    s.capture = cap
    try:
        with cuda_stream(s):
            yield
    finally:
        for member in (s, *cap.forked):
            member.capture = None
    if cap.forked:
        raise CaptureError("CUDA error: capturing stream has unjoined work (cudaErrorStreamCaptureUnjoined): "
                           f"{sorted(m.name for m in cap.forked)}", op="cudaStreamEndCapture")


def is_current_stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()``: the engine's answer (a ``CPUGraph`` or a CUDA capture)."""
    return torch.cuda.is_current_stream_capturing()


# --- python/sglang/srt/utils/offloader.py ---------------------------------------------------------------------

class OffloaderV2:
    def __init__(self, group_size: int, num_in_group: int, prefetch_step: int, mode: str, variant: str, device):
        self.group_size, self.num_in_group = group_size, num_in_group
        self.prefetch_step, self.mode = prefetch_step, mode
        self.variant, self.device = variant, device
        self.offloaders: list = []

    def wrap_modules(self, all_modules_generator, submodule_accessor, whitelist_param_names_creator):
        assert len(self.offloaders) == 0, "should only call wrap_modules once"
        # The offloader's async prefetch/offload copies run on their own stream.
        alt_stream = get_stream("offload")
        all_modules, offload_submodules = [], []
        for module_index, module in enumerate(all_modules_generator):
            all_modules.append(module)
            if module_index % self.group_size >= self.group_size - self.num_in_group:
                submodule = submodule_accessor(module)
                offload_submodules.append(submodule)
                self.offloaders.append(_ModuleOffloader(
                    mode=self.mode, module=submodule, alt_stream=alt_stream,
                    whitelist_param_names=whitelist_param_names_creator(submodule), variant=self.variant))
        for index, module in enumerate(offload_submodules):
            _hook_module_forward_for_offloader(index=index, module=module, offloaders=self.offloaders,
                                               prefetch_step=self.prefetch_step)
        return all_modules

    def post_init(self):
        for offloader in self.offloaders:
            offloader.post_init()
        for i in range(self.prefetch_step):
            self.offloaders[i].start_onload()


def _hook_module_forward_for_offloader(index, module, offloaders, prefetch_step):
    def _on_forward_end():
        offloaders[(index + prefetch_step) % len(offloaders)].start_onload()
        offloaders[index].offload()

    _hook_module_forward_raw(module, on_forward_end=_on_forward_end,
                             get_parameter_and_buffer_dicts=lambda: offloaders[index].wait_and_get_device_tensors())


def _hook_module_forward_raw(module, on_forward_end, get_parameter_and_buffer_dicts):
    original_forward = module.forward

    def forward(*args, **kwargs):
        module.forward = original_forward
        output = functional_call(module, get_parameter_and_buffer_dicts(), args=args, kwargs=kwargs)
        on_forward_end()
        module.forward = forward
        return output

    module.forward = forward


class _ModuleOffloader:
    def __init__(self, mode: str, module: nn.Module, alt_stream: Stream, whitelist_param_names: list, variant: str):
        self.mode, self.module, self.alt_stream, self.variant = mode, module, alt_stream, variant
        self.device = next(module.parameters()).device
        self._device_tensors = None
        self._load_event = None
        self._param_offloaders = {name: _CpuParamOffloader(module=module, param_name=name)
                                  for name in whitelist_param_names}

    def post_init(self):
        for param_offloader in self._param_offloaders.values():
            param_offloader.post_init()

    def start_onload(self):
        if self.variant == "fix" and is_current_stream_capturing():
            self._device_tensors = self._create_device_tensors()       # inline H2D on the capture stream
            self._load_event = None
            return
        self.alt_stream.wait_stream(current_stream())
        with cuda_stream(self.alt_stream):
            self._device_tensors = self._create_device_tensors()
            self._load_event = Event()
            self._load_event.record()

    def offload(self):
        self._device_tensors = None
        self._load_event = None

    def wait_and_get_device_tensors(self):
        assert self._device_tensors is not None
        if self.variant == "bug":
            self._load_event.wait()                                    # also inside the capture
            return self._device_tensors
        if is_current_stream_capturing():
            if self._load_event is not None:                           # prefetched outside this capture
                self._device_tensors = self._create_device_tensors()   # redo the copy inside the graph
                self._load_event = None
            return self._device_tensors
        if self._load_event is not None:
            self._load_event.wait()
        return self._device_tensors

    def _create_device_tensors(self):
        return {k: v.create_device_tensor() for k, v in self._param_offloaders.items()}


class _CpuParamOffloader:
    """mode ``cpu``: the weight lives in pinned host memory; each onload copies it to the device."""

    def __init__(self, module, param_name):
        self._module, self._param_name = module, param_name
        param = getattr(module, param_name)
        self._device = param.device
        # _move_param_to_cpu(self._param, pin_memory=True) (modelled: the pinned copy is kept here)
        self._cpu_data = host(param.detach().to("cpu", copy=True), self._device)
        _move_param_to_meta(module, param_name)

    def post_init(self):
        pass

    def create_device_tensor(self):
        return self._cpu_data.to(self._device, non_blocking=True)


def _move_param_to_meta(module, param_name):
    old_param = getattr(module, param_name)
    setattr(module, param_name, nn.Parameter(old_param.data.to("meta"), requires_grad=False))


# --- the model (python/sglang/srt/models/deepseek_v2.py, cut down) ------------------------------------------------

class FusedMoE(nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.w13_weight = nn.Parameter(randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, gen=gen, device=device,
                                             scale=HIDDEN ** -0.5), requires_grad=False)
        self.w2_weight = nn.Parameter(randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, gen=gen, device=device,
                                            scale=INTERMEDIATE ** -0.5), requires_grad=False)

    def forward(self, hidden_states, router_probs):
        gate_up = torch.einsum("th,eih->tei", hidden_states, self.w13_weight)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, self.w2_weight)
        return (router_probs.unsqueeze(-1) * out).sum(dim=1)


class DeepseekV2MoE(nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.gate = nn.Parameter(randn(NUM_EXPERTS, HIDDEN, gen=gen, device=device), requires_grad=False)
        self.experts = FusedMoE(gen, device)

    def forward(self, hidden_states):
        router_probs = torch.softmax(hidden_states @ self.gate.T, dim=-1)
        return self.experts(hidden_states, router_probs)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.mix = nn.Parameter(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5),
                                requires_grad=False)
        self.mlp = DeepseekV2MoE(gen, device)

    def forward(self, hidden_states):
        hidden_states = hidden_states + torch.tanh(F.layer_norm(hidden_states, (HIDDEN,)) @ self.mix)
        return hidden_states + self.mlp(F.layer_norm(hidden_states, (HIDDEN,)))


class DeepseekV2Model(nn.Module):
    def __init__(self, offloader: OffloaderV2, device):
        super().__init__()
        gen = generator(29166)
        self.embed_tokens = nn.Parameter(randn(VOCAB, HIDDEN, gen=gen, device=device), requires_grad=False)
        # make_layers(..., offloader_kwargs=dict(submodule_accessor=..., whitelist_param_names_creator=...))
        self.layers = nn.ModuleList(offloader.wrap_modules(
            (DeepseekV2DecoderLayer(gen, device) for _ in range(NUM_LAYERS)),
            submodule_accessor=lambda layer: layer.mlp.experts,
            whitelist_param_names_creator=lambda module: ["w13_weight", "w2_weight"]))
        self.lm_head = nn.Parameter(randn(VOCAB, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5),
                                    requires_grad=False)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens[input_ids]
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return F.layer_norm(hidden_states, (HIDDEN,)) @ self.lm_head.T


# --- python/sglang/srt/model_executor/{model_runner,cuda_graph_runner}.py -----------------------------------------

class CudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner, self.device = model_runner, model_runner.device
        self.capture_bs = [BS]
        self.input_ids = torch.zeros(BS, dtype=torch.long, device=self.device)
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(self.device)
        self.stream = Stream("graph_capture stream")
        self.capture()

    def capture(self):
        with cuda_stream(self.stream):                      # graph_capture(): torch.cuda.stream(stream)
            for bs in reversed(self.capture_bs):
                self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(
                    bs, self.model_runner.model.forward)

    def capture_one_batch_size(self, bs, forward):
        input_ids = self.input_ids[:bs]

        def run_once():
            return forward(input_ids)

        for _ in range(2):                                  # warm up
            with events.warmup():
                run_once()
        return self._capture_graph(bs, run_once)

    def _capture_graph(self, bs, run_once_fn):
        def body():
            with stream_capture(self.stream):               # torch.cuda.graph(graph, pool=pool, stream=stream)
                return run_once_fn()
        return capture(body, device=self.device, pool=self.pool, warmups=0, name=f"decode bs={bs}",
                       owner="CudaGraphRunner", static={"input_ids": self.input_ids})

    def replay(self, input_ids):
        bs = input_ids.shape[0]
        self.input_ids[:bs].copy_(input_ids)
        return replay(self.graphs[bs], self.output_buffers[bs])


class ModelRunner:
    def __init__(self, variant: str, device, disable_cuda_graph: bool):
        self.device = device
        self.offloader = OffloaderV2(OFFLOAD_GROUP_SIZE, OFFLOAD_NUM_IN_GROUP, OFFLOAD_PREFETCH_STEP, "cpu",
                                     variant, device)
        self.model = DeepseekV2Model(self.offloader, device)
        self.offloader.post_init()                           # get_offloader().post_init() after load
        self.graph_runner = None if disable_cuda_graph else CudaGraphRunner(self)   # init_device_graphs

    @torch.no_grad()
    def forward_decode(self, input_ids):
        if self.graph_runner is not None:
            return self.graph_runner.replay(input_ids).clone()
        return self.model(input_ids)


def run(variant: str, device: str = "cpu"):
    first_tokens = torch.randint(0, VOCAB, (BS,), generator=generator(291660)).to(device)

    def decode(disable_cuda_graph: bool):
        _named_streams.clear()
        runner = ModelRunner(variant, device, disable_cuda_graph)
        ids, outs = first_tokens, []
        for _ in range(DECODE_STEPS):
            logits = runner.forward_decode(ids)
            outs.append(logits)
            ids = logits.argmax(-1)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: decode(False), lambda: decode(True))
