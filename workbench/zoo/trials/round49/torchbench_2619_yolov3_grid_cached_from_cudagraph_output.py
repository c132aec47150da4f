"""yolov3's ``YOLOLayer`` caches ``self.grid`` made inside the cudagraphed forward; the next run overwrites it.

Upstream: https://github.com/pytorch/benchmark/pull/2619 ("fix anti-pattern for cudagraph", commit 227fb01e, May 2025).
Symptom: ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) on the yolov3 eval benchmark raised
"RuntimeError: Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run."
Without that check the box centres are offset by whatever the later run wrote into the grid's memory.
Mechanism: ``YOLOLayer.forward`` did ``if (self.nx, self.ny) != (nx, ny): self.create_grids((nx, ny), p.device)``.
``create_grids`` sets ``self.nx, self.ny`` and, in eval, ``self.grid = torch.stack((xv, yv), 2).view(1, 1, ny, nx,
2).float()``. On the first call (``nx == 0``) that runs inside the compiled region: the grid is an output of the
first graph, living in the graph trees' pool, and dynamo stores it on the module. The second call fails the guard
on ``self.nx``/``self.ny`` and records a second graph in which the branch is skipped, so ``self.grid`` is an input:
an output of the previous generation. The trees record each new generation from the same pool checkpoint once the
previous generation's outputs count as dead, so the second graph's own outputs (``p``, the detections) are laid
over the memory the grid occupies; ``io[..., :2] = torch.sigmoid(io[..., :2]) + self.grid`` then adds that data.
Doctor: overwritten-output, at ``forward`` (``YOLOLayer.forward`` keeps the graph-output grid across runs and reads it
after a later run overwrote its memory).
Fix (upstream): both branches of ``forward`` call ``self.create_grids((nx, ny), p.device)`` unconditionally, so the
grid is recomputed inside every run instead of being read as a stale cross-generation output.
Model of ``torch.compile(mode="reduce-overhead")``: one graph per guard state (input shape and each layer's
``(nx, ny)``), its input copied into a static placeholder, its outputs placed in allocation order from the pool
checkpoint (``_CudagraphTrees.checkpoint``, one region every recording starts from), and dynamo's attribute side
effects (``self.grid = <graph output>``) applied after the run. ``self.ng`` (a CPU constant) is left out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/benchmark/pull/2619"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "forward"
SYMPTOM = "yolov3 under reduce-overhead reads a cached self.grid that a later CUDA-graph run overwrote"

NC, BATCH, IMG, CH, STEPS = 2, 2, 64, 8, 4
ANCHORS = {32: [(116.0, 90.0), (156.0, 198.0), (373.0, 326.0)], 16: [(30.0, 61.0), (62.0, 45.0), (59.0, 119.0)]}


class YOLOLayer:
    def __init__(self, anchors, nc, yolo_index, stride, device, variant):
        self.variant, self.training = variant, False
        self.anchors = torch.tensor(anchors, device=device)
        self.index, self.stride = yolo_index, stride
        self.na, self.nc, self.no = len(anchors), nc, nc + 5   # number of anchors, classes, outputs
        self.nx, self.ny, self.ng = 0, 0, 0                    # initialize number of x, y gridpoints
        self.anchor_vec = self.anchors / self.stride
        self.anchor_wh = self.anchor_vec.view(1, self.na, 1, 1, 2)

    def create_grids(self, ng=(13, 13), device="cpu"):
        self.nx, self.ny = ng  # x and y grid size
        if not self.training:  # build xy offsets
            yv, xv = torch.meshgrid([torch.arange(self.ny, device=device), torch.arange(self.nx, device=device)],
                                    indexing="ij")
            self.grid = torch.stack((xv, yv), 2).view((1, 1, self.ny, self.nx, 2)).float()
        if self.anchor_vec.device != torch.device(device):
            self.anchor_vec = self.anchor_vec.to(device)
            self.anchor_wh = self.anchor_wh.to(device)

    def forward(self, p, out):
        bs, _, ny, nx = p.shape  # bs, 255, 13, 13
        if self.variant == "fix":
            self.create_grids((nx, ny), p.device)
        elif (self.nx, self.ny) != (nx, ny):
            self.create_grids((nx, ny), p.device)
        # p.view(bs, 255, 13, 13) -- > (bs, 3, 13, 13, 85)  # (bs, anchors, grid, grid, classes + xywh)
        p = p.view(bs, self.na, self.no, self.ny, self.nx).permute(0, 1, 3, 4, 2).contiguous()
        io = p.clone()  # inference output
        io[..., :2] = torch.sigmoid(io[..., :2]) + self.grid  # xy
        io[..., 2:4] = torch.exp(io[..., 2:4]) * self.anchor_wh  # wh yolo method
        io[..., :4] *= self.stride
        torch.sigmoid_(io[..., 4:])
        return io.view(bs, -1, self.no), p


class Darknet:
    """A two-head stand-in for the yolov3 cfg: a 1x1-conv trunk at stride 16, a stride-32 branch, YOLO heads."""

    def __init__(self, device, variant):
        gen = generator(2619)
        no = 3 * (NC + 5)
        self.w_trunk = randn(3, CH, gen=gen, device=device, scale=0.5)
        self.w_head32 = randn(CH, no, gen=gen, device=device, scale=0.5)
        self.w_head16 = randn(CH, no, gen=gen, device=device, scale=0.5)
        self.yolo_layers = [YOLOLayer(ANCHORS[32], NC, 0, 32, device, variant),
                            YOLOLayer(ANCHORS[16], NC, 1, 16, device, variant)]

    def forward_once(self, x):
        yolo_out, out = [], []
        x = torch.tanh(torch.einsum("bchw,ck->bkhw", F.avg_pool2d(x, 16), self.w_trunk))
        out.append(x)
        x32 = F.avg_pool2d(x, 2)
        yolo_out.append(self.yolo_layers[0].forward(torch.einsum("bchw,ck->bkhw", x32, self.w_head32), out))
        yolo_out.append(self.yolo_layers[1].forward(torch.einsum("bchw,ck->bkhw", out[0], self.w_head16), out))
        io, p = zip(*yolo_out)  # inference output, training output
        return torch.cat(io, 1), p



class _CudagraphTrees:
    """``torch.compile(model, mode="reduce-overhead")``, modelled (see the module docstring)."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.pool = graph_pool_handle(device)
        self.checkpoint = torch.zeros(1 << 12, device=device)   # where every new generation's outputs land
        self.graphs = {}

    def _guards(self, x):
        return tuple(x.shape), tuple((layer.nx, layer.ny) for layer in self.model.yolo_layers)

    def _record(self, x):
        static_x = x.clone()
        model = self.model
        made = []                                  # layers whose grid the trace assigned (a dynamo side effect)

        # dynamo traces the module as it is at this call: warmup and recording both start from that state
        state = [(layer.nx, layer.ny, getattr(layer, "grid", None)) for layer in model.yolo_layers]

        def traced():
            for layer, (nx, ny, grid) in zip(model.yolo_layers, state):
                layer.nx, layer.ny, layer.grid = nx, ny, grid
            before = [grid for _, _, grid in state]
            inf_out, p = model.forward_once(static_x)
            made[:] = [i for i, layer in enumerate(model.yolo_layers) if layer.grid is not before[i]]
            produced = []                          # graph outputs, in allocation order
            for i, layer in enumerate(model.yolo_layers):
                produced += ([layer.grid] if i in made else []) + [p[i]]
            produced.append(inf_out)
            placed, offset = [], 0
            for t in produced:                     # from the pool checkpoint: same addresses every generation
                view = self.checkpoint[offset:offset + t.numel()].view(t.shape)
                view.copy_(t)
                placed.append(view)
                offset += t.numel()
            return tuple(placed)

        g, outputs = capture(traced, device=self.device, pool=self.pool, name=f"yolov3 generation {len(self.graphs)}",
                             owner="torch.compile(Darknet, mode='reduce-overhead')", static={"x": static_x})
        return g, outputs, static_x, made

    def __call__(self, x):
        key = self._guards(x)
        if key not in self.graphs:
            self.graphs[key] = self._record(x)
        g, outputs, static_x, made = self.graphs[key]
        static_x.copy_(x)
        placed = list(replay(g, outputs))
        for i, layer in enumerate(self.model.yolo_layers):      # dynamo's side effects, with the graph's outputs
            if i in made:
                layer.grid = placed.pop(0)
                layer.nx, layer.ny = layer.grid.shape[3], layer.grid.shape[2]
            placed.pop(0)
        return placed[-1]


def run(variant: str, device: str = "cpu"):
    gen = generator(26190)
    images = [randn(BATCH, 3, IMG, IMG, gen=gen, device=device) for _ in range(STEPS)]

    def serve():
        compiled = _CudagraphTrees(Darknet(device, variant), device)
        with torch.no_grad():
            return [compiled(x).clone() for x in images]       # each benchmark iteration: one generation

    def eager():
        model = Darknet(device, variant)
        with torch.no_grad():
            return [model.forward_once(x)[0] for x in images]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, serve, eager)
