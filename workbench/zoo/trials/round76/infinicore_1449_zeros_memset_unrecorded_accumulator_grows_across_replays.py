"""InfiniCore's ``Tensor::zeros()`` cleared its memory with a raw memset at graph-record time, not with a recorded op, so a recorded graph that accumulates into a ``zeros()`` tensor never restarts from zero: its value grows over the 5 warm-ups and every replay.

Upstream: https://github.com/InfiniTensor/InfiniCore/pull/1449 ("feat: implement device-native ones", merged
2026-07-30, merge 5558be3c). The graph part is commit 1bd436f551a98de5a8d255aab27a9a42c5e2bd6e ("feat: make tensor
initializers graph-aware"), with the regression test ``test/infinicore/graph/tensor_initializers.py``.
Symptom: after ``stop_graph_recording()`` the accumulator holds 5x the step's result instead of 1x. Each
``graph.run()`` then adds one more step's result on top of the last (the upstream test expects 1.0 and gets 5, 6,
7, ...). Run eagerly, the same code is correct.
Mechanism: InfiniCore records a graph in two stages. Between ``context::startGraphRecording()`` and
``stopGraphRecording()``, every graph-aware op (``INFINICORE_GRAPH_OP_RECORD_OR_RUN``) is only planned and appended to
``Graph::op_list_``; it does not run. ``stopGraphRecording()`` calls ``Graph::instantiate()``
(``src/infinicore/graph/graph.cc``), which runs the op list 5 times as warm-up and then captures one ``run()`` with
``infinirtStreamBeginCapture``/``EndCapture`` (a CUDA graph on NVIDIA). ``Graph::run()`` replays that graph.
``TensorImpl::zeros`` (``src/infinicore/tensor/tensor.cc``) was ``empty()`` followed by
``context::setDeviceMemoryAsync(result->data(), 0, nbytes, stream)``, a raw runtime memset issued by the host. It is no
graph op, so during recording it ran at once, a single time, before any recorded op, and it is not in ``op_list_``.
The recorded ``add(zero_value, increment, out=zero_value)`` therefore starts every warm-up, the capture and every replay
from the previous pass's sum. Eager calls ``zeros()`` on every step, so it re-clears each time.
Doctor: host-work-frozen, at zeros. The zeroing is host-issued work (a direct runtime memset, not a recorded op) inside
the recording region. It ran once at record time; the warm-ups, the capture and the replays repeat only the recorded
ops, so the memory keeps no capture-time zero: each pass adds to the last. The bug lives in ``TensorImpl::zeros``, the
function the fix changed: it now calls ``op::zeros_`` (a new graph op ``Zeros``) instead of the raw memset.
Fix (upstream): ``TensorImpl::zeros`` calls ``op::zeros_(Tensor{result})`` when ``nbytes() != 0``. ``Zeros`` is a graph
op (``src/infinicore/ops/zeros/zeros.cc``, ``zeros_infinirt.cc``) whose ``run()`` issues the same memset. While
recording, it is appended to ``op_list_``, so it runs in every warm-up and is captured as a memset node that every
replay repeats. (``ones()``, before this PR a TODO that returned ``empty()``, became a graph op too. It is left out
here, because before the PR eager was equally wrong.)
Modelled: the consumer is the upstream regression test's accumulator: ``zeros()`` inside the recording, then
``add(zero_value, increment, out=zero_value)``. I found no served code of that time that accumulates into a
``zeros()`` tensor inside a recorded forward. ``ops/inner`` and ``linear_w4a16_gptq_qy`` overwrite their
``zeros()`` output (the inner kernel stores ``out = tmp``; qyblas GEMM uses beta 0). The Marlin GEMM workspaces are
lock arrays that the kernel resets to 0 itself. InfiniLM's ``minicpm_eagle`` ``zero_hidden_states`` is only read, and
its graph is compiled but never replayed (draft runs use ``sample_all_positions``, which forces eager).
As in InfiniLM's compilers, the ``increment`` input is recorded once and refreshed before each run
(``get_compiled`` copies live inputs into the recorded ones). The test's constant ``ones`` becomes one value per step.
The op list holds closures over the tensors (``GraphTensor`` blobs upstream). ``Graph::instantiate`` is the kit's
``capture`` with 5 warm-ups. Left out are descriptor caching, the pinned allocator, capture-safe segmentation and
the ``ones`` half of the test.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InfiniTensor/InfiniCore/pull/1449"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "zeros"
SYMPTOM = ("an accumulator built with Tensor::zeros() inside a recorded graph is never re-zeroed: it holds 5x the step "
           "after the 5 warm-ups and grows by one step per graph.run(); eager re-zeroes every call")

SHAPE = (8, 16)
NUM_RUNS = 4
VARIANT = {"v": "bug"}


# --- src/infinicore/graph/graph.cc -----------------------------------------------------------------------------

class GraphOperator:
    """A planned op (``DispatchableGraphOperator``): ``run()`` launches its kernel on the planned tensors."""

    def __init__(self, name, runner):
        self.name = name
        self.runner_ = runner

    def run(self):
        self.runner_()


class Graph:
    def __init__(self, device):
        self.device = device
        self.op_list_: list[GraphOperator] = []
        self.device_graph_ = None

    def add_operator(self, op):
        self.op_list_.append(op)

    def _run_op_list(self):
        for op in self.op_list_:
            op.run()

    def run(self, outputs=None):
        """Launch the device graph if instantiated, else run the op list. ``outputs``: the recorded tensors the
        caller reads afterwards (InfiniLM's compiled ``Output``), handed out as the graph's static outputs."""
        if self.device_graph_ is not None:
            return replay(self.device_graph_, outputs)
        self._run_op_list()
        return outputs

    def instantiate(self, static):
        """5 warm-up runs of the op list, then capture one run into a device graph."""
        self.device_graph_, _ = capture(self._run_op_list, device=self.device, warmups=5, name="infinicore graph",
                                        static=static, owner="infinicore::graph::Graph")


class GraphManager:
    def __init__(self):
        self.recording_ = False
        self.graph_: Graph | None = None

    def is_recording(self):
        return self.recording_

    def start_recording(self, device):
        self.recording_ = True
        self.graph_ = Graph(device)

    def add_operator(self, op):
        assert self.recording_
        self.graph_.add_operator(op)

    def stop_recording(self, static):
        self.recording_ = False
        graph, self.graph_ = self.graph_, None
        graph.instantiate(static)          # USE_INFINIRT_GRAPH
        return graph


# --- src/infinicore/context ------------------------------------------------------------------------------------

class context:
    graph_manager_ = GraphManager()

    @staticmethod
    def isGraphRecording():
        return context.graph_manager_.is_recording()

    @staticmethod
    def startGraphRecording(device):
        context.graph_manager_.start_recording(device)

    @staticmethod
    def stopGraphRecording(static):
        return context.graph_manager_.stop_recording(static)

    @staticmethod
    def setDeviceMemoryAsync(tensor, value):
        """``infinirtMemsetAsync`` on the current stream, issued now by the host."""
        tensor.fill_(value)


def INFINICORE_GRAPH_OP_RECORD_OR_RUN(name, runner):
    """While recording, plan the op and append it to the graph; otherwise run it now."""
    if context.isGraphRecording():
        context.graph_manager_.add_operator(GraphOperator(name, runner))
    else:
        runner()


# --- src/infinicore/ops ----------------------------------------------------------------------------------------

class op:
    @staticmethod
    def add(a, b, out):
        INFINICORE_GRAPH_OP_RECORD_OR_RUN("Add", lambda: torch.add(a, b, out=out))
        return out

    @staticmethod
    def zeros_(output):
        """``Zeros`` (added by the fix): its ``run()`` issues the memset, so it is recorded like any op."""
        INFINICORE_GRAPH_OP_RECORD_OR_RUN("Zeros", lambda: context.setDeviceMemoryAsync(output, 0))


# --- src/infinicore/tensor/tensor.cc ---------------------------------------------------------------------------

class TensorImpl:
    @staticmethod
    def empty(shape, dtype, device):
        return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def zeros(shape, dtype, device):
        result = TensorImpl.empty(shape, dtype, device)
        if VARIANT["v"] == "fix":
            if result.numel() != 0:
                op.zeros_(result)
        else:
            # bug: a raw memset issued now -- while recording, it runs once and is not in the graph's op list
            context.setDeviceMemoryAsync(result, 0)
        return result


class Tensor:
    @staticmethod
    def zeros(shape, dtype, device):
        return TensorImpl.zeros(shape, dtype, device)


# --- test/infinicore/graph/tensor_initializers.py, as a served workload -----------------------------------------

def forward(increment, device):
    """The recorded step: a fresh accumulator, one accumulation into it."""
    zero_value = Tensor.zeros(SHAPE, torch.float32, device)
    op.add(zero_value, increment, out=zero_value)
    return zero_value


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(1449)
    steps = [randn(*SHAPE, gen=gen, device=device) for _ in range(NUM_RUNS)]

    def served():
        increment = torch.ones(SHAPE, dtype=torch.float32, device=device)    # recorded input, staged per run
        context.startGraphRecording(device)
        zero_value = forward(increment, device)
        graph = context.stopGraphRecording(static={"increment": increment})
        outs = []
        for x in steps:
            increment.copy_(x)                                                 # get_compiled: copy the live input
            outs.append(graph.run(outputs=zero_value).clone())
        return outs

    def eager():
        increment = torch.empty(SHAPE, dtype=torch.float32, device=device)
        outs = []
        for x in steps:
            increment.copy_(x)
            outs.append(forward(increment, device).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
