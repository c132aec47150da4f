"""trtutils' ``TRTEngine`` (the TensorRT runner under its YOLO ``Detector`` and ``Classifier``) captures its CUDA graph
lazily, on the first ``execute``. In 0.7.0 (PR #61) that first call copied the caller's frame into the engine's input
binding and then called ``_capture_cuda_graph``, trusting that "CUDA graph capture calls execute_async_v3 internally".
But the capture first runs a warmup on random data (``warmup(1)`` -> ``mock_execute`` -> ``execute``), which copies
the random tensor into the same input binding and runs the engine on it, and a stream capture then only records
``execute_async_v3``: nothing runs on the caller's frame. The call copies the output binding back and returns the
warmup's detections, computed from random pixels, for the first frame of every ``Detector`` built with the defaults
(``cuda_graph`` on, ``warmup`` off). Later frames replay the graph and are right. The fix (PR #68) copies the caller's
inputs into the bindings again after the capture and launches the new graph before reading the outputs.

Upstream: https://github.com/justincdavis/trtutils/pull/68 ("Migrate to Ty, unify & fix CI", repository
justincdavis/trtutils, author Justin Davis; squash-merged into main on 2026-01-27 as commit
39602817b7ddbdf5371111e11ff241783c229efa; its first bullet is "work on fixing graph issues"). The CUDA graph path
came with PR #61 ("Initial Changes for 0.7.0 - unstable", 859180a, 2026-01-19). Read, in a mirror of the repository:
the whole diff of 3960281 for ``src/trtutils/_engine.py`` (``_capture_cuda_graph``: warmup failure and failed capture
now raise; ``execute``: re-copy the inputs and ``launch()`` after the capture; no ``stream_synchronize`` while
``_capturing_graph``) and ``src/trtutils/core/_graph.py`` (``cuda_stream_begin_capture`` defaults to
``cudaStreamCaptureModeThreadLocal``, ``CUDAGraph.start`` uses it); at the parent 3960281^: ``_engine.py`` whole
(``TRTEngine.__init__``, ``_set_input_bindings``, ``_set_output_bindings``, ``_capture_cuda_graph``, ``execute``,
``direct_exec``), ``core/_graph.py`` whole (``CUDAGraph``: ``__enter__``/``__exit__``, ``start``, ``stop``,
``launch``, ``invalidate``, ``is_captured``), ``core/_interface.py`` (``TRTEngineInterface.__init__`` defaults:
``pagelocked_mem`` True, ``unified_mem`` = ``FLAGS.IS_JETSON``; ``get_random_input``, ``__call__``, ``mock_execute``,
``warmup``), ``core/_bindings.py`` (``Binding``: ``allocation``, ``host_allocation``), ``image/_detector.py``
(``Detector.__init__`` defaults, ``Detector.run``: preprocess, ``self._engine(engine_inputs, no_copy=True)``,
postprocess) and ``image/_image_model.py`` (``TRTEngine(..., warmup=warmup, cuda_graph=cuda_graph)``, both default
None). The later history of ``_engine.py`` and ``_graph.py`` up to 2026-05-14 (#72 turned graphs off by default, #90
on again).
Not read: the PR's page and discussion (not in the stored corpus; the commit message lists its bullets), the rest of
its 100-file diff (CI, typing, ``image/`` refactors), the TensorRT and cuda-python internals, the preprocessors
(``trt``, ``cuda``), ``postprocessors/_detection.py`` and NMS. No user report was found: the symptom below is what the
pre-fix code does, read line by line.
Symptom: the first inference of an engine or detector with CUDA graphs on and no warmup at construction returns the
outputs of the random warmup input instead of the caller's; every later inference is right. No error is raised (the
upstream comment of the fix: "After capture, re-copy user's input (warmup overwrote it) and launch").
Mechanism: ``execute(data)`` copies ``data`` into each input binding's device ``allocation``. The graph is neither
captured nor being captured, so it calls ``_capture_cuda_graph``, which (``self._warmup`` is falsy) runs
``self.warmup(1)``: ``mock_execute`` -> ``execute(get_random_input())``. That nested call copies the random tensor over
the same ``allocation``, sees ``_capturing_graph`` and runs ``execute_async_v3`` directly, so the output bindings now
hold the engine's answer for random pixels. The capture then records ``execute_async_v3``; a stream capture executes
nothing. Back in the outer call, the branch has no launch: the outputs are copied device-to-host as the warmup left
them and returned. The caller's frame is never run.
Doctor: warmup-divergence, at ``execute``. The step that captures does other work than the eager step: it runs the
engine once, on the warmup's random input, and hands that run's outputs back as its own, while eager ``execute`` runs
the engine on the caller's input. ``execute`` is where this is decided and what the fix changes: its lazy-capture
branch returns after the capture without putting the caller's inputs back and launching the graph.
Fix (upstream): in ``execute``, after ``_capture_cuda_graph()`` succeeds, copy ``data`` into the input bindings again
(the same three copy paths as at the top) and ``self._cuda_graph.launch()``. The same commit also made a failed
warmup or capture raise, skipped ``stream_synchronize`` while warming up for a capture, and captured in thread-local
mode (both for several engines capturing from several threads); those are modelled as written but no workload here
needs them.
Modelled: ``TRTEngine`` (``__init__``, ``_set_input_bindings``, ``_set_output_bindings``, ``_capture_cuda_graph``,
``execute``), ``TRTEngineInterface`` (``get_random_input``, ``__call__``, ``mock_execute``, ``warmup``), ``Binding``,
``allocate_bindings``, ``CUDAGraph`` (``start``, ``stop``, ``launch``, ``invalidate``, ``is_captured``, the context
manager), ``cuda_stream_begin_capture``, ``memcpy_host_to_device_async``, ``memcpy_device_to_host_async``,
``stream_synchronize``, ``Detector`` (``run``, ``preprocess``, ``postprocess``).
Stand-ins: the TensorRT engine and its ``IExecutionContext`` are a two-layer convolutional YOLO-style head (3 -> 8
channels, 3x3, then 1x1 to 4 box + 3 class channels over 8x8 anchors) in float64, whose ``execute_async_v3`` reads the
tensor bound to ``images`` and writes the one bound to ``output0`` in place; ``set_tensor_address`` binds tensors, not
pointers. Streams are a name (the engine's CPU emulation runs everything in order; ``stream_synchronize`` is the
engine's ``synchronize``). The host allocations are ``host()`` memory (pinned on CUDA), the caller's frames host
tensors; the pagelocked, non-unified path (the default off Jetson) is the one exercised. ``CUDAGraph`` holds a workbench
graph: ``start``/``stop`` open and close ``graph(...)`` (``cudaStreamBeginCapture``/``EndCapture`` + instantiate),
``launch`` is the kit's ``replay`` (which announces the served step); ``CUDAGraph.record_step`` (not upstream) names
the captured call and its output bindings for that announcement. ``get_random_input`` draws from a seeded generator
(upstream: an unseeded ``np.random.default_rng()``). The ``Detector`` uses the CPU preprocessor (HWC uint8 -> NCHW in
[0, 1], frames already 8x8, so ratio 1 and no padding; upstream's default is the ``trt`` preprocessor engine) and its
postprocess keeps every anchor's box, best score and class (no confidence threshold, no NMS) so shapes stay fixed.
Workload: four 8x8 RGB frames through ``Detector.run`` with the defaults (``cuda_graph`` on, ``warmup`` off); eager is
the same detector with ``cuda_graph=False``. Outputs: each frame's boxes, scores and class ids.
Measured: bug: misbehaves (max |graph - eager| = 4.82): frame 0 carries the random warmup input's detections (boxes
off by up to 4.82, scores by 0.30, class ids by 2); frames 1-3, served by replays, equal eager. Fix: equals eager (max
|graph - eager| = 0). About 1 s per variant on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.engine import events, graph, host, new_graph, synchronize
from workbench.zoo.kit import compare, generator, hooks, randn, remember_step, replay

UPSTREAM = "https://github.com/justincdavis/trtutils/pull/68"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "execute"
SYMPTOM = ("with CUDA graphs on and no warmup at construction, the first inference of a trtutils engine or detector "
           "returns the outputs of the capture's random warmup input: the lazy capture overwrote the caller's input "
           "binding and recorded the engine without running it, and execute returned without a launch")

IMG, CH, HID, NUM_CLASSES, FRAMES = 8, 3, 8, 3, 4
DTYPE = torch.float64


# --- stand-in for the TensorRT engine and its execution context ---------------------------------------------------

class ICudaEngine:
    """A YOLO-style head: one input binding ``images`` [1, 3, 8, 8], one output ``output0`` [1, 4 + C, 64]."""

    def __init__(self, device):
        gen = generator(68)
        self.w1 = randn(HID, CH, 3, 3, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.w2 = randn(4 + NUM_CLASSES, HID, 1, 1, gen=gen, device=device, scale=0.6).to(DTYPE)
        self.input_spec = [("images", (1, CH, IMG, IMG))]
        self.output_spec = [("output0", (1, 4 + NUM_CLASSES, IMG * IMG))]


class IExecutionContext:
    def __init__(self, engine: ICudaEngine):
        self._engine, self._addresses, self._shapes = engine, {}, {}

    def set_input_shape(self, name, shape):
        self._shapes[name] = tuple(shape)

    def set_tensor_address(self, name, allocation):
        self._addresses[name] = allocation

    def execute_async_v3(self, stream) -> bool:
        x = self._addresses["images"]
        h = torch.relu(F.conv2d(x, self._engine.w1, padding=1))
        self._addresses["output0"].copy_(F.conv2d(h, self._engine.w2).flatten(2))
        return True


# --- trtutils/core: bindings, memory, stream, graph ----------------------------------------------------------------

@dataclass
class Binding:
    """Small wrapper for a host/device allocation pair."""

    name: str
    shape: tuple
    allocation: torch.Tensor          # device memory the engine reads or writes
    host_allocation: torch.Tensor     # pagelocked host memory


def allocate_bindings(engine: ICudaEngine, device):
    make = lambda name, shape: Binding(name, shape, torch.zeros(shape, dtype=DTYPE, device=device),
                                       host(torch.zeros(shape, dtype=DTYPE), device))
    return [make(*s) for s in engine.input_spec], [make(*s) for s in engine.output_spec]


def memcpy_host_to_device_async(allocation, array, stream):
    allocation.copy_(array, non_blocking=True)


def memcpy_device_to_host_async(host_allocation, allocation, stream):
    host_allocation.copy_(allocation, non_blocking=True)


def cuda_stream_begin_capture(cuda_graph, stream, mode):
    """``cudaStreamBeginCapture(stream, mode)``: here, open the workbench capture into ``cuda_graph._graph``."""
    cuda_graph._capture = graph(cuda_graph._graph, name="trtutils engine", capture_error_mode=mode)
    cuda_graph._capture.__enter__()


class CUDAGraph:
    """Wrapper around CUDA graph capture and execution."""

    def __init__(self, stream, device, variant):
        self._stream, self._device, self._variant = stream, device, variant
        self._graph = None
        self._graph_exec = None
        self._capture = None
        self._outputs = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        if exc_type is not None:
            self._capture.__exit__(exc_type, exc_val, exc_tb)
            self.invalidate()
            return False
        success = self.stop()
        return not success

    def start(self):
        self._graph = new_graph(self._device)
        # PR #68: thread-local capture mode (it was cudaStreamCaptureModeGlobal)
        cuda_stream_begin_capture(self, self._stream, "thread_local" if self._variant == "fix" else "global")

    def stop(self) -> bool:
        self._capture.__exit__(None, None, None)       # cudaStreamEndCapture + cudaGraphInstantiate
        self._capture, self._graph_exec = None, self._graph
        return True

    def record_step(self, step, outputs):
        """Stand-in: what the captured ``execute_async_v3`` computes and where (for the kit's announcements)."""
        self._outputs = outputs
        remember_step(self._graph_exec, step)
        for hook in hooks:
            hook.captured(self._graph_exec, step)

    def launch(self):
        if self._graph_exec is None:
            raise RuntimeError("Cannot launch graph: no graph has been captured")
        replay(self._graph_exec, self._outputs)       # cudaGraphLaunch(graph_exec, stream)

    def invalidate(self):
        self._graph, self._graph_exec = None, None

    @property
    def is_captured(self) -> bool:
        return self._graph_exec is not None


# --- trtutils/core/_interface.py and trtutils/_engine.py -----------------------------------------------------------

class TRTEngineInterface:
    def __init__(self, engine: ICudaEngine, device):
        self._name, self._device, self._stream = "yolo", device, "stream"
        self._pagelocked_mem, self._unified_mem = True, False          # defaults off Jetson
        self._engine, self._context = engine, IExecutionContext(engine)
        self._inputs, self._outputs = allocate_bindings(engine, device)
        self._rand_input = None
        self._rng = generator(6868)

    def get_random_input(self, *, new=None):
        if new or self._rand_input is None:
            self._rand_input = [host(torch.rand(shape, generator=self._rng, dtype=DTYPE), self._device)
                                for _, shape in self._engine.input_spec]
        return self._rand_input

    def __call__(self, data, *, no_copy=None):
        return self.execute(data, no_copy=no_copy)

    def mock_execute(self, data=None):
        if data is None:
            data = self.get_random_input()
        return self.execute(data, no_copy=True)

    def warmup(self, iterations):
        for _ in range(iterations):
            self.mock_execute()


class TRTEngine(TRTEngineInterface):
    def __init__(self, engine, device, variant, *, warmup=None, cuda_graph=None, warmup_iterations=5):
        super().__init__(engine, device)
        self._variant = variant
        self._async_v3 = True
        self._cuda_graph_enabled = (cuda_graph if cuda_graph is not None else True) and self._async_v3
        self._cuda_graph = None
        self._capturing_graph = False                     # guard against capture recursion
        if self._cuda_graph_enabled:
            self._cuda_graph = CUDAGraph(self._stream, device, variant)
            events.static_buffers("TRTEngine", {b.name: b.allocation for b in self._inputs})
        self._set_input_bindings()
        self._set_output_bindings()
        self._using_engine_tensors = True
        self._warmup = warmup
        if self._warmup:
            self.warmup(warmup_iterations)

    def _set_input_bindings(self):
        for i_binding in self._inputs:
            self._context.set_input_shape(i_binding.name, i_binding.shape)
            self._context.set_tensor_address(i_binding.name, i_binding.allocation)
        if self._cuda_graph and self._cuda_graph.is_captured:
            self._cuda_graph.invalidate()                 # CUDA graph is invalid if using new bindings

    def _set_output_bindings(self):
        for o_binding in self._outputs:
            self._context.set_tensor_address(o_binding.name, o_binding.allocation)
        if self._cuda_graph and self._cuda_graph.is_captured:
            self._cuda_graph.invalidate()

    def _graph_step(self):
        self._context.execute_async_v3(self._stream)
        return tuple(o.allocation for o in self._outputs)

    def _capture_cuda_graph(self):
        if self._capturing_graph:     # prevent recursion: warmup() -> mock_execute() -> execute() -> here
            return
        if self._cuda_graph is None:
            raise RuntimeError(f"CUDA graph is not enabled in engine: {self._name}")
        self._capturing_graph = True
        try:
            # at least one execution required prior to graph capture
            # simply use one warmup iteration if warmup didnt get run
            if not self._warmup:
                with events.warmup():
                    self.warmup(1)
            # CUDAGraph handles capture with a context manager; only the TRT engine is captured
            with self._cuda_graph:
                self._context.execute_async_v3(self._stream)
            if not self._cuda_graph.is_captured:
                self._cuda_graph = None
                raise RuntimeError(f"CUDA graph capture failed for engine '{self._name}'.")
            self._cuda_graph.record_step(self._graph_step, tuple(o.allocation for o in self._outputs))
        finally:
            self._capturing_graph = False

    def _copy_inputs(self, data):
        for i_idx in range(len(self._inputs)):
            memcpy_host_to_device_async(self._inputs[i_idx].allocation, data[i_idx], self._stream)

    def execute(self, data, *, no_copy=None):
        if not self._using_engine_tensors:
            self._set_input_bindings()
            self._using_engine_tensors = True

        # copy inputs
        self._copy_inputs(data)

        # execute
        if self._cuda_graph:
            if self._cuda_graph.is_captured:
                self._cuda_graph.launch()                 # uses already captured graph to handle execution
            elif not self._capturing_graph:
                if self._variant == "bug":
                    # CUDA graph capture calls execute_async_v3 internally
                    # no need to call again here
                    self._capture_cuda_graph()
                else:
                    # Capture the graph (warmup inside will use random data)
                    self._capture_cuda_graph()
                    # After capture, re-copy user's input (warmup overwrote it) and launch
                    if self._cuda_graph is not None and self._cuda_graph.is_captured:
                        self._copy_inputs(data)
                        self._cuda_graph.launch()
            else:
                self._context.execute_async_v3(self._stream)   # capturing: direct execution for warmup
        else:
            self._context.execute_async_v3(self._stream)

        # copy outputs
        for o_idx in range(len(self._outputs)):
            memcpy_device_to_host_async(self._outputs[o_idx].host_allocation, self._outputs[o_idx].allocation,
                                        self._stream)

        # make sure all operations are complete (PR #68: not while warming up for a capture)
        if self._variant == "bug" or not self._capturing_graph:
            synchronize(self._device)                     # stream_synchronize(self._stream)

        if no_copy:
            return [o.host_allocation for o in self._outputs]
        return [o.host_allocation.clone() for o in self._outputs]


# --- trtutils/image/_detector.py -----------------------------------------------------------------------------------

class Detector:
    def __init__(self, engine, device, variant, *, warmup=None, cuda_graph=None):
        self._device = device
        self._engine = TRTEngine(engine, device, variant, warmup=warmup, cuda_graph=cuda_graph)

    def preprocess(self, images):
        """CPU preprocessor: HWC [0, 255] -> NCHW [0, 1]; frames are already the input size."""
        tensor = torch.stack([img.permute(2, 0, 1) for img in images]) / 255.0
        return tensor, [(1.0, 1.0)] * len(images), [(0.0, 0.0)] * len(images)

    def postprocess(self, outputs, ratios, padding):
        out = outputs[0][0]                               # [4 + C, anchors]
        (rx, ry), (px, py) = ratios[0], padding[0]
        scale = host(torch.tensor([rx, ry, rx, ry], dtype=DTYPE), self._device)
        shift = host(torch.tensor([px, py, px, py], dtype=DTYPE), self._device)
        boxes = (out[:4].T - shift) / scale
        scores, class_ids = torch.sigmoid(out[4:]).max(dim=0)
        return [boxes, scores, class_ids.to(DTYPE)]

    def run(self, images):
        tensor, ratios, padding = self.preprocess(images)
        outputs = self._engine([tensor], no_copy=True)
        return self.postprocess(outputs, ratios, padding)


def run(variant: str, device: str = "cpu"):
    engine = ICudaEngine(device)
    gen = generator(2026)
    frames = [host(torch.randint(0, 256, (IMG, IMG, CH), generator=gen).to(DTYPE), device) for _ in range(FRAMES)]

    def detect(detector):
        return [t.clone() for frame in frames for t in detector.run([frame])]

    def eager():
        return detect(Detector(engine, device, variant, cuda_graph=False))

    def served():
        return detect(Detector(engine, device, variant))          # defaults: cuda_graph on, warmup off

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
