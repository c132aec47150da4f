"""RF-DETR fast preprocess: the TRT graph's private stream copies the preprocess ring slot into the graph's
static input without waiting for the preprocess stream, so the replay runs on what an earlier frame left there.

Upstream: https://github.com/roboflow/inference/commit/139d458102be8abe1cd51bed9579fe6101ed174d ("Fix RF-DETR
preprocess buffer handoff", squashed into PR https://github.com/roboflow/inference/pull/2405 "rfdetr-seg:
Pipelining Optimization (Jetson Orin NX 8GB)").
Symptom: on the pipelined Triton-preprocess path, detections and masks belong to the wrong (an earlier) frame
or to a half-written one; a silent race, no error.
Mechanism: ``FastPreprocessRuntime.try_preprocess`` (``models/rfdetr/triton_preprocess_runtime.py``) copies the
frame into ``state.pinned_host`` (host), enqueues ``state.src_gpu.copy_(pinned_host, non_blocking=True)`` and
the Triton resize/normalise kernels writing ``out_buffer`` (a ring of ``_BUFFER_RING_SIZE`` = 3 slots) on the
preprocess stream, records ``out_buffer._trt_ready_event`` and returns the slot unsynchronised. The model's
``forward`` makes ``self._inference_stream`` wait on that event, but a cached-graph hit in
``_execute_trt_engine`` (``models/common/trt.py``) runs on ``trt_cuda_graph_state.cuda_stream``, the private
stream created at capture: ``input_buffer.copy_(pre_processed_images)`` then ``cuda_graph.replay()`` with no
wait on ``_trt_ready_event``. When the preprocess stream is behind (H2D from pinned memory plus two kernels),
the copy reads the slot before this frame's kernels wrote it: it still holds the frame served three steps
earlier (or nothing yet), and the replay detects on that. (Streams are modelled as in-order queues the device
works through when the host waits: the stream waited on first, then the rest; the graph is captured at model
load from a dummy frame; ring slots start as zeros here so that the stale content is deterministic.)
Doctor: stale-input, at ``_execute_trt_engine`` (the replay's static ``input_buffer`` is refreshed from a
slot this frame's preprocess has not written yet: it carries an earlier frame).
Fix (upstream): ``_execute_trt_engine`` makes the graph stream ``wait_event(pre_processed_images.
_trt_ready_event)`` (and the state's ``consumer_done_event``) before the copy/replay and records
``pre_processed_images._trt_consumed_event`` after it; ``try_preprocess`` turns ``pinned_host``/``src_gpu``
into rings returned by ``next_buffers()``, waits ``pinned_host._preproc_ready_event.synchronize()`` before
``np.copyto`` and makes the preprocess stream ``wait_event(out_buffer._trt_consumed_event)`` before
rewriting a slot.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/roboflow/inference/commit/139d458102be8abe1cd51bed9579fe6101ed174d"
FAMILY = "persistent-buffer mutation"
KIND = "stale-input"
SITE = "_execute_trt_engine"
SYMPTOM = "graph replays detect on the ring slot's earlier frame: detections/masks for the wrong frame"

SRC, TARGET, CLASSES = 6, 4, 3               # source pixels, network input size, detection logits
_BUFFER_RING_SIZE = 3
FRAMES = 6


class Event:
    def __init__(self, stream: "Stream", position: int) -> None:
        self.stream, self.position = stream, position

    def synchronize(self) -> None:
        self.stream.run_until(self.position)


class Stream:
    """A CUDA stream in miniature: launches run in order, when the host (or another stream) waits on them."""

    streams: list = []

    def __init__(self) -> None:
        self.queue: list = []
        self.done = 0
        Stream.streams.append(self)

    def launch(self, fn) -> None:
        self.queue.append(fn)

    def record(self) -> Event:
        return Event(self, len(self.queue))

    def wait_event(self, event: Event) -> None:
        self.launch(event.synchronize)

    def run_until(self, position: int) -> None:
        while self.done < position:
            self.done += 1
            self.queue[self.done - 1]()

    def synchronize(self) -> None:
        """The host blocks on this stream; meanwhile the device also works off every other stream."""
        self.run_until(len(self.queue))
        for other in Stream.streams:
            other.run_until(len(other.queue))


class FastPreprocessState:
    def __init__(self, device: str, variant: str) -> None:
        rings = _BUFFER_RING_SIZE if variant == "fix" else 1
        self.pinned_hosts = [torch.zeros(SRC) for _ in range(rings)]
        self.src_gpus = [torch.zeros(SRC, device=device) for _ in range(rings)]
        self.out_buffers = [torch.zeros(1, TARGET, device=device) for _ in range(_BUFFER_RING_SIZE)]
        self.tmp_buffers = [torch.zeros(1, TARGET, device=device) for _ in range(_BUFFER_RING_SIZE)]
        self.out_buffer_index = 0
        self.events: dict = {}           # the attributes upstream sets on tensors (_trt_ready_event, ...)

    def next_buffers(self):
        idx = self.out_buffer_index
        self.out_buffer_index = (idx + 1) % _BUFFER_RING_SIZE
        return (self.pinned_hosts[idx % len(self.pinned_hosts)], self.src_gpus[idx % len(self.src_gpus)],
                self.out_buffers[idx], self.tmp_buffers[idx])


def triton_preprocess_rfdetr_stretch(src, out, tmp, resize):
    torch.matmul(src.unsqueeze(0), resize, out=tmp)               # horizontal pass
    torch.sub(tmp / 255.0, 0.45, out=out)                         # /255 + normalise


class FastPreprocessRuntime:
    def __init__(self, device: str, variant: str, resize: torch.Tensor) -> None:
        self.variant, self.resize = variant, resize
        self._state = FastPreprocessState(device, variant)

    def try_preprocess(self, frame: torch.Tensor, stream: Stream) -> torch.Tensor:
        state = self._state
        pinned_host, src_gpu, out_buffer, tmp_buffer = state.next_buffers()
        if self.variant == "fix":
            ready = state.events.get(("preproc_ready", id(pinned_host)))
            if ready is not None:
                ready.synchronize()                                    # pinned slot's H2D has run
        pinned_host.copy_(frame)                                       # np.copyto, on the host, now
        if self.variant == "fix":
            consumed = state.events.get(("trt_consumed", id(out_buffer)))
            if consumed is not None:
                stream.wait_event(consumed)
        stream.launch(lambda: src_gpu.copy_(pinned_host, non_blocking=True))
        stream.launch(lambda: triton_preprocess_rfdetr_stretch(src_gpu, out_buffer, tmp_buffer, self.resize))
        ready_event = stream.record()
        state.events[("trt_ready", id(out_buffer))] = ready_event
        state.events[("preproc_ready", id(pinned_host))] = ready_event
        return out_buffer


class TRTCudaGraphState:
    def __init__(self, engine, device: str) -> None:
        self.cuda_stream = Stream()                                # torch.cuda.Stream made at capture
        self.input_buffer = torch.zeros(1, TARGET, device=device)
        self.cuda_graph, out = capture(lambda: engine(self.input_buffer), device=device, name="rfdetr 1x312",
                                       owner="TRTCudaGraphCache", static={"input_buffer": self.input_buffer})
        self.output_buffers = [out]
        self.consumer_done_event = None


def _execute_trt_engine(pre_processed_images, trt_cuda_graph_state, events, variant):
    stream = trt_cuda_graph_state.cuda_stream
    if variant == "fix":
        if trt_cuda_graph_state.consumer_done_event is not None:
            stream.wait_event(trt_cuda_graph_state.consumer_done_event)
        input_ready = events.get(("trt_ready", id(pre_processed_images)))
        if input_ready is not None:
            stream.wait_event(input_ready)
    results = []
    stream.launch(lambda: trt_cuda_graph_state.input_buffer.copy_(pre_processed_images))
    if variant == "fix":
        events[("trt_consumed", id(pre_processed_images))] = stream.record()
    stream.launch(lambda: results.append(
        replay(trt_cuda_graph_state.cuda_graph, trt_cuda_graph_state.output_buffers[0]).clone()))
    stream.synchronize()
    return results


def run(variant: str, device: str = "cpu"):
    gen = generator(2405)
    resize = randn(SRC, TARGET, gen=gen, device=device, scale=0.3)
    weight = randn(TARGET, CLASSES, gen=gen, device=device)
    frames = [(torch.rand(SRC, generator=gen) * 255).round() for _ in range(FRAMES)]     # uint8-valued pixels

    def engine(x):
        return torch.sigmoid(x @ weight)

    def eager():
        outs = []
        for frame in frames:
            tmp = torch.empty(1, TARGET, device=device)
            out = torch.empty(1, TARGET, device=device)
            triton_preprocess_rfdetr_stretch(frame.to(device), out, tmp, resize)
            outs.append(engine(out))
        return outs

    def served():
        Stream.streams = []
        preprocess_stream = Stream()                                   # self._pre_process_stream
        runtime = FastPreprocessRuntime(device, variant, resize)
        state = TRTCudaGraphState(engine, device)                      # graph cache warmed at model load
        outs = []
        for frame in frames:
            pre_processed_images = runtime.try_preprocess(frame, preprocess_stream)
            outs.extend(_execute_trt_engine(pre_processed_images, state, runtime._state.events, variant))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
