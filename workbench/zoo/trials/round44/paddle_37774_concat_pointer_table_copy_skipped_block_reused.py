"""Concat's device pointer table is filled outside the graph, and split's table then reuses its block.

Upstream: https://github.com/PaddlePaddle/Paddle/pull/37774 ("Fix CUDA Graph H2D bug by restore host
memory"). It fixes the approach of https://github.com/PaddlePaddle/Paddle/pull/36987 ("Try to fix CUDA
Graph H2D copy bug").
Symptom: the PR gives no log. Its description says: "#36987 is wrong, because the device memory which is
to be copied into may be reused by other tensors. H2D copy must be captured into the CUDA Graph instead
of skipping." Replays of a captured program that concatenates or splits more than 4 tensors then read
a corrupted pointer table. The results are wrong, or the addresses are illegal.
Mechanism: when its inputs differ in shape or ``in_num`` is outside 2..4,
``ConcatFunctor<CUDADeviceContext, T>`` (``paddle/fluid/operators/math/concat_and_split.cu``) allocates
``tmp_dev_ins_data = memory::Alloc(context, in_num * sizeof(T*))``. During capture that block comes
from the graph's memory pool. #36987 wrapped the H2D ``memory::Copy`` of the host array
``inputs_data`` into that block in a ``platform::SkipCUDAGraphCaptureGuard``. The guard ends the
current capture segment (``CUDAGraph::EndSegmentCapture``), runs the copy once, for real, and begins a
new segment. The copy is therefore in no segment. ``ConcatKernel(dev_ins_data, ...)`` is captured, and
it dereferences the table at every replay. ``tmp_dev_ins_data`` is released when the functor returns.
``SplitFunctor`` does the same for its output pointers: its ``memory::Alloc`` gets the freed block, and
its own one-shot copy writes the split's output pointers there. Every replay of the concat kernel then
gathers from the split's outputs, which hold the previous step's split results, and not from its own
inputs. The split still reads its table correctly.
Doctor: dangling-reference, at ``ConcatFunctor``. The captured concat kernel reads
``tmp_dev_ins_data``, which the functor released at capture and which the graph never writes itself;
its block now belongs to the split's table.
Fix (upstream): ``auto* restored = platform::RestoreHostMemIfCapturingCUDAGraph(inputs_data, in_num)``
copies the host array into host memory that the graph owns (freed by a reset callback). Then
``memory::Copy(..., tmp_dev_ins_data->ptr(), CPUPlace(), restored, ...)`` is captured as an ordinary
memcpy node. The same change was made in ``SplitFunctor``. Every replay then rewrites each table just
before its kernel reads it.

Diff: the ``ConcatFunctor`` hunk was read in the PR's review thread. The ``SplitFunctor`` change, and
``RestoreHostMemIfCapturingCUDAGraph``, were read in the later source, which has the same code. The
segment mechanism was read in ``paddle/fluid/platform/cuda_graph.cc``.
Modelled: device pointers are offsets into the executor scope's variable memory (``Scope.arena``),
and a pointer table is an int64 tensor of offsets. Restored host memory is pinned here: upstream it is
``new uint8_t[]``, and torch refuses to capture a copy from pageable memory.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from workbench.engine import events, graph, graph_pool_handle, host, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/PaddlePaddle/Paddle/pull/37774"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "ConcatFunctor"
SYMPTOM = "concat replays gather through a pointer table whose block the split's table reused: wrong outputs"

ROWS, COLS, N_BRANCH = 3, 4, 5          # 5 same-shaped inputs: in_num > 4 takes the pointer-table path
OWNER = "paddle Executor (CUDA Graph)"


class CUDAGraph:
    """``paddle/fluid/platform/cuda_graph``: one capture made of segments that share one memory pool."""

    capturing_graph_ = None

    def __init__(self, device, pool):
        self.device, self.pool_ = device, pool
        self.graphs_ = []                 # the segments' graphs, replayed in order
        self.host_mems_ = []              # restored host memory, freed by the graph's reset callbacks
        self._segment = None              # (graph, its open capture)

    @classmethod
    def IsCapturing(cls):
        return cls.capturing_graph_ is not None

    @classmethod
    def BeginCapture(cls, device):
        cls.capturing_graph_ = CUDAGraph(device, graph_pool_handle(device))
        cls.BeginSegmentCapture()

    @classmethod
    def BeginSegmentCapture(cls):
        cg = cls.capturing_graph_
        g = new_graph(cg.device)
        capture = graph(g, pool=cg.pool_, name=f"segment {len(cg.graphs_)}")
        capture.__enter__()
        cg._segment = (g, capture)

    @classmethod
    def EndSegmentCapture(cls, exc_info=(None, None, None)):
        cg = cls.capturing_graph_
        g, capture = cg._segment
        cg._segment = None
        capture.__exit__(*exc_info)
        cg.graphs_.append(g)

    @classmethod
    def EndCapture(cls):
        cls.EndSegmentCapture()
        cg, cls.capturing_graph_ = cls.capturing_graph_, None
        return cg

    @classmethod
    def AbortCapture(cls):
        if cls.capturing_graph_ is not None and cls.capturing_graph_._segment is not None:
            with contextlib.suppress(BaseException):
                cls.EndSegmentCapture(sys.exc_info())
        cls.capturing_graph_ = None

    def Replay(self):
        for g in self.graphs_:
            g.replay()


@contextlib.contextmanager
def SkipCUDAGraphCaptureGuard():
    """#36987: what runs inside is no part of the graph (the capture is split around it)."""
    capturing = CUDAGraph.IsCapturing()
    if capturing:
        CUDAGraph.EndSegmentCapture()
    yield
    if capturing:
        CUDAGraph.BeginSegmentCapture()


def RestoreHostMemIfCapturingCUDAGraph(host_mem, device):
    """#37774: while capturing, a copy of ``host_mem`` that lives as long as the graph."""
    if CUDAGraph.IsCapturing():
        new_host_mem = host(host_mem.clone(), device)
        CUDAGraph.capturing_graph_.host_mems_.append(new_host_mem)   # AddResetCallback(delete[])
        return new_host_mem
    return host_mem


class Var:
    """A scope variable: its tensor and its address (``data<T>()``), an offset into the scope's memory."""

    def __init__(self, arena, offset, rows, cols):
        self.offset = offset
        self.tensor = arena[offset:offset + rows * cols].view(rows, cols)


class Scope:
    def __init__(self, device):
        self.arena = torch.zeros(2 * N_BRANCH * ROWS * COLS, device=device)
        size = ROWS * COLS
        self.branch = [Var(self.arena, i * size, ROWS, COLS) for i in range(N_BRANCH)]
        self.split = [Var(self.arena, (N_BRANCH + i) * size, ROWS, COLS) for i in range(N_BRANCH)]


class CUDADeviceContext:
    def __init__(self, device, variant, scope):
        self.device, self.variant, self.heap = device, variant, scope.arena


def memory_Alloc(context, n):
    return torch.empty(n, dtype=torch.int64, device=context.device)


def memory_Copy(dst, src_host):
    dst.copy_(src_host, non_blocking=True)          # cudaMemcpyAsync on context.stream()


def ConcatKernel(heap, ins_addr, in_num, in_col, out_row, out_col, output):
    rows = torch.arange(out_row, device=heap.device) * in_col
    cols = torch.arange(in_col, device=heap.device)
    addr = ins_addr[None, :, None] + rows[:, None, None] + cols[None, None, :]    # [row, input, col]
    output.copy_(heap[addr].reshape(out_row, out_col))


def SplitKernel(heap, input, in_row, in_col, out0_col, outs_addr):
    o_num = in_col // out0_col
    rows = torch.arange(in_row, device=heap.device) * out0_col
    cols = torch.arange(out0_col, device=heap.device)
    addr = outs_addr[None, :, None] + rows[:, None, None] + cols[None, None, :]
    heap[addr.reshape(-1)] = input.reshape(in_row, o_num, out0_col).reshape(-1)


def ConcatFunctor(context, inputs, output):
    """``ConcatFunctor<CUDADeviceContext, T>`` along axis 1, inputs of one shape."""
    in_num, out_row, in_col = len(inputs), inputs[0].tensor.shape[0], inputs[0].tensor.shape[1]
    out_col = in_num * in_col
    inputs_data = host(torch.tensor([t.offset for t in inputs], dtype=torch.int64), context.device)
    has_same_shape = True
    assert not has_same_shape or in_num < 2 or in_num > 4   # 2..4 same-shaped inputs go by value
    tmp_dev_ins_data = memory_Alloc(context, in_num)
    if context.variant == "bug":
        with SkipCUDAGraphCaptureGuard():                     # #36987: the copy is no graph node
            memory_Copy(tmp_dev_ins_data, inputs_data)
    else:
        restored = RestoreHostMemIfCapturingCUDAGraph(inputs_data, context.device)
        memory_Copy(tmp_dev_ins_data, restored)
    ConcatKernel(context.heap, tmp_dev_ins_data, in_num, in_col, out_row, out_col, output)
    # tmp_dev_ins_data goes back to the pool when the functor returns


def SplitFunctor(context, input, outputs):
    """``SplitFunctor<CUDADeviceContext, T>`` along axis 1, outputs of one shape."""
    o_num, in_row, in_col = len(outputs), input.shape[0], input.shape[1]
    out0_col = in_col // o_num
    outputs_data = host(torch.tensor([t.offset for t in outputs], dtype=torch.int64), context.device)
    tmp_dev_outs_data = memory_Alloc(context, o_num)
    if context.variant == "bug":
        with SkipCUDAGraphCaptureGuard():
            memory_Copy(tmp_dev_outs_data, outputs_data)
    else:
        restored = RestoreHostMemIfCapturingCUDAGraph(outputs_data, context.device)
        memory_Copy(tmp_dev_outs_data, restored)
    SplitKernel(context.heap, input, in_row, in_col, out0_col, tmp_dev_outs_data)


class Program:
    """Five fc branches -> concat -> fc -> split into five -> weighted sum (one static program)."""

    def __init__(self, device, variant):
        gen = generator(37774)
        self.scope = Scope(device)
        self.context = CUDADeviceContext(device, variant, self.scope)
        self.w_branch = [randn(COLS, COLS, gen=gen, device=device, scale=0.6) for _ in range(N_BRANCH)]
        self.w_mix = randn(N_BRANCH * COLS, N_BRANCH * COLS, gen=gen, device=device, scale=0.3)
        self.alpha = randn(N_BRANCH, 1, 1, gen=gen, device=device)
        self.device = device

    def run(self, x):
        for var, w in zip(self.scope.branch, self.w_branch):
            var.tensor.copy_(torch.tanh(x @ w))
        concat_out = torch.empty(ROWS, N_BRANCH * COLS, device=self.device)
        ConcatFunctor(self.context, self.scope.branch, concat_out)
        fc_out = torch.tanh(concat_out @ self.w_mix)
        SplitFunctor(self.context, fc_out, self.scope.split)
        parts = torch.stack([var.tensor for var in self.scope.split])
        return concat_out, (parts * self.alpha).sum(0)


def run(variant: str, device: str = "cpu"):
    gen = generator(3777)
    feeds = [randn(ROWS, COLS, gen=gen, device=device) for _ in range(4)]

    def eager():
        program, outs = Program(device, variant), []
        for feed in feeds:
            outs += [t.clone() for t in program.run(feed)]
        return outs

    def served():
        program = Program(device, variant)
        x = torch.zeros(ROWS, COLS, device=device)            # the feed variable
        events.static_buffers(OWNER, {"x": x})
        events.written_metadata(OWNER, {"scope variables": program.scope.arena})
        CUDAGraph.BeginCapture(device)
        try:
            fetch = program.run(x)
        except BaseException:
            CUDAGraph.AbortCapture()
            raise
        cuda_graph = CUDAGraph.EndCapture()
        outs = []
        for feed in feeds:
            x.copy_(feed)
            events.serve(cuda_graph.graphs_[0], ROWS, ROWS, outputs=fetch, eager=lambda: program.run(x),
                         pieces=tuple(cuda_graph.graphs_))
            cuda_graph.Replay()
            events.handed_out(cuda_graph.graphs_[-1], fetch)
            outs += [t.clone() for t in fetch]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
