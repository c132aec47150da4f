"""torchvision's ``AnchorGenerator`` stores the dtype/device-converted cell anchors on the module from inside the
compiled region; under CUDA graph trees they are a graph output that a later run overwrites, so the anchors (and every
decoded proposal box) come from whatever the later run wrote there.

Upstream: https://github.com/pytorch/vision/pull/9081 ("fix anti-pattern for cudagraph", pytorch/vision, author
BoyuanFeng, opened and merged 2025-05-22, merge commit 966da7e4; reverted 2025-05-29 by #9088 as BC-breaking, the
maintainers asking for an alternative fix). Read: the PR description ("Previously, ``self.set_cell_anchors(dtype,
device)`` leads to cudagraph error 'accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
run'. This pr fixes the anti-pattern to enable cudagraph."), the revert #9088, and
``torchvision/models/detection/anchor_utils.py`` (``AnchorGenerator.__init__`` / ``generate_anchors`` /
``set_cell_anchors`` / ``grid_anchors`` / ``forward``) at commit 6922d216 (the code is unchanged in substance at the
parent of the fix). The diff itself was not stored; the fix is modelled from the description and the BC note.
Also read, as the sibling fix by the same author: pytorch/benchmark#2619 (yolov3 ``self.grid``).
Symptom: a torchvision detection model (Faster/Mask R-CNN RPN) under ``torch.compile(mode="reduce-overhead")``
raises "RuntimeError: Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run";
without that check the proposals are decoded against garbage anchors.
Mechanism: ``forward`` calls ``self.set_cell_anchors(dtype, device)``, which does ``self.cell_anchors =
[cell_anchor.to(dtype=dtype, device=device) for cell_anchor in self.cell_anchors]``. The cell anchors are made in
float32 in ``__init__``; for another dtype the first compiled call converts them inside the traced region, so the new
tensors are outputs of that graph, placed in the CUDA graph trees' pool, and dynamo stores them on the module. The
next call fails the guard on the anchors' dtype and records a second graph, in which ``.to`` is a no-op: the cell
anchors are now an *input*, an output of the previous generation. The trees record each new generation from the same
pool checkpoint once the previous generation's outputs count as dead, so the second graph's own outputs (proposals,
objectness) are laid over the memory the cell anchors occupy, and ``grid_anchors`` reads that data on every replay.
Doctor: overwritten-output, at set_cell_anchors (it keeps the converted anchors, a graph output, on the module
across runs, and ``grid_anchors`` reads them after a later run overwrote their memory).
Fix (upstream): the converted anchors are no longer stored on the module: ``set_cell_anchors`` returns them and
``grid_anchors`` takes them as an argument (the signature change that made the PR BC-breaking), so every run
converts ``self.cell_anchors`` (float32, never replaced) afresh inside its own graph.
Modelled: ``AnchorGenerator`` line by line (``generate_anchors``, ``set_cell_anchors``, ``grid_anchors``,
``forward``), ``ImageList``, and ``torch.compile(mode="reduce-overhead")`` as in the round-49 yolov3 program: one
graph per guard state (input shape, dtype of each cell anchor), its input copied into a static placeholder, its
outputs placed in allocation order from the pool checkpoint (one region every recording starts from), dynamo's
attribute side effect (``self.cell_anchors = <graph outputs>``) applied after the run. Stand-ins: the RPN is a 1x1-conv
trunk per level plus objectness/box-delta heads and ``BoxCoder.decode`` without clamping; strides are Python ints
(inductor folds the ``torch.tensor`` strides into constants); the anchors are made on the model's device (upstream
makes them on the CPU and ``.to`` moves them too; only the dtype conversion matters here); float64 features.
Workload: 4 batches of 2 images 32x32, two feature levels (strides 8 and 16), 3 aspect ratios, sizes 16 and 32
(48 + 12 anchors per level, 60 per image); each call is one generation. Bug: generation 1 converts the anchors in
its graph and equals eager; the dtype guard then fails, generation 2 records a second graph whose outputs overwrite
the stored anchors (already during its warmup run), so steps 2-4 decode every proposal against overwritten anchors
(proposal boxes off by 22.0, 21.8, 21.2 pixels; objectness, which does not use anchors, stays exact): max |graph -
eager| = 22 (step 1 exact). Fix: one graph, equals eager (max 0).
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/vision/pull/9081"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "set_cell_anchors"
SYMPTOM = ("torchvision AnchorGenerator under reduce-overhead stores its converted cell anchors, a CUDA-graph output, "
           "on the module; a later run overwrites them and proposals are decoded against garbage anchors")

BATCH, IMG, CH, STEPS = 2, 32, 6, 4
LEVEL_STRIDES = (8, 16)
SIZES, ASPECT_RATIOS = ((16,), (32,)), ((0.5, 1.0, 2.0),) * 2
DTYPE = torch.float64

_variant = "bug"


class ImageList:
    def __init__(self, tensors: Tensor, image_sizes: List[tuple]):
        self.tensors, self.image_sizes = tensors, image_sizes


# --- torchvision/models/detection/anchor_utils.py ------------------------------------------------------------------------

class AnchorGenerator:
    def __init__(self, sizes=((128, 256, 512),), aspect_ratios=((0.5, 1.0, 2.0),), device="cpu"):
        if not isinstance(sizes[0], (list, tuple)):
            sizes = tuple((s,) for s in sizes)
        if not isinstance(aspect_ratios[0], (list, tuple)):
            aspect_ratios = (aspect_ratios,) * len(sizes)
        self.sizes, self.aspect_ratios = sizes, aspect_ratios
        self.cell_anchors = [self.generate_anchors(size, aspect_ratio, device=device)
                             for size, aspect_ratio in zip(sizes, aspect_ratios)]

    def generate_anchors(self, scales, aspect_ratios, dtype=torch.float32, device="cpu"):
        scales = torch.as_tensor(scales, dtype=dtype, device=device)
        aspect_ratios = torch.as_tensor(aspect_ratios, dtype=dtype, device=device)
        h_ratios = torch.sqrt(aspect_ratios)
        w_ratios = 1 / h_ratios
        ws = (w_ratios[:, None] * scales[None, :]).view(-1)
        hs = (h_ratios[:, None] * scales[None, :]).view(-1)
        base_anchors = torch.stack([-ws, -hs, ws, hs], dim=1) / 2
        return base_anchors.round()

    def set_cell_anchors(self, dtype, device):
        if _variant == "bug":
            self.cell_anchors = [cell_anchor.to(dtype=dtype, device=device) for cell_anchor in self.cell_anchors]
            return self.cell_anchors
        return [cell_anchor.to(dtype=dtype, device=device) for cell_anchor in self.cell_anchors]   # the fix

    def num_anchors_per_location(self):
        return [len(s) * len(a) for s, a in zip(self.sizes, self.aspect_ratios)]

    def grid_anchors(self, grid_sizes, strides, cell_anchors=None) -> List[Tensor]:
        anchors = []
        if _variant == "bug":
            cell_anchors = self.cell_anchors
        assert cell_anchors is not None
        if not (len(grid_sizes) == len(strides) == len(cell_anchors)):
            raise ValueError("Anchors should be Tuple[Tuple[int]] because each feature map could potentially have "
                             "different sizes and aspect ratios.")
        for size, stride, base_anchors in zip(grid_sizes, strides, cell_anchors):
            grid_height, grid_width = size
            stride_height, stride_width = stride
            device = base_anchors.device
            shifts_x = torch.arange(0, grid_width, dtype=torch.int32, device=device) * stride_width
            shifts_y = torch.arange(0, grid_height, dtype=torch.int32, device=device) * stride_height
            shift_y, shift_x = torch.meshgrid(shifts_y, shifts_x, indexing="ij")
            shift_x, shift_y = shift_x.reshape(-1), shift_y.reshape(-1)
            shifts = torch.stack((shift_x, shift_y, shift_x, shift_y), dim=1)
            anchors.append((shifts.view(-1, 1, 4) + base_anchors.view(1, -1, 4)).reshape(-1, 4))
        return anchors

    def forward(self, image_list: ImageList, feature_maps: List[Tensor]) -> List[Tensor]:
        grid_sizes = [feature_map.shape[-2:] for feature_map in feature_maps]
        image_size = image_list.tensors.shape[-2:]
        dtype, device = feature_maps[0].dtype, feature_maps[0].device
        strides = [[image_size[0] // g[0], image_size[1] // g[1]] for g in grid_sizes]   # stand-in: folded constants
        cell_anchors = self.set_cell_anchors(dtype, device)
        anchors_over_all_feature_maps = self.grid_anchors(grid_sizes, strides, cell_anchors)
        anchors: List[List[Tensor]] = []
        for _ in range(len(image_list.image_sizes)):
            anchors.append([a for a in anchors_over_all_feature_maps])
        return [torch.cat(anchors_per_image) for anchors_per_image in anchors]


# --- an RPN stand-in (torchvision/models/detection/rpn.py, reduced) ---------------------------------------------------------

def decode(rel_codes: Tensor, boxes: Tensor) -> Tensor:
    """``BoxCoder.decode_single`` with weights (1, 1, 1, 1) and no clamp."""
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    ctr_x, ctr_y = boxes[:, 0] + 0.5 * widths, boxes[:, 1] + 0.5 * heights
    dx, dy, dw, dh = rel_codes.unbind(-1)
    pred_ctr_x, pred_ctr_y = dx * widths + ctr_x, dy * heights + ctr_y
    pred_w, pred_h = torch.exp(dw) * widths, torch.exp(dh) * heights
    return torch.stack([pred_ctr_x - 0.5 * pred_w, pred_ctr_y - 0.5 * pred_h,
                        pred_ctr_x + 0.5 * pred_w, pred_ctr_y + 0.5 * pred_h], dim=-1)


class RPN:
    def __init__(self, device):
        gen = generator(9081)
        self.anchor_generator = AnchorGenerator(SIZES, ASPECT_RATIOS, device=device)
        a = self.anchor_generator.num_anchors_per_location()[0]
        self.w_trunk = randn(3, CH, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.w_cls = randn(CH, a, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.w_bbox = randn(CH, a * 4, gen=gen, device=device, scale=0.2).to(DTYPE)
        self.num_anchors = a

    def forward(self, images: Tensor):
        image_list = ImageList(images, [tuple(images.shape[-2:])] * images.shape[0])
        features = [torch.tanh(torch.einsum("bchw,ck->bkhw", F.avg_pool2d(images, s), self.w_trunk))
                    for s in LEVEL_STRIDES]
        objectness, deltas = [], []
        for f in features:                                   # concat_box_prediction_layers: (B, H, W, A) order
            b, _, h, w = f.shape
            objectness.append(torch.einsum("bchw,ck->bhwk", f, self.w_cls).reshape(b, -1))
            deltas.append(torch.einsum("bchw,ck->bhwk", f, self.w_bbox).reshape(b, h * w * self.num_anchors, 4))
        anchors = self.anchor_generator.forward(image_list, features)
        objectness, deltas = torch.cat(objectness, 1), torch.cat(deltas, 1)
        proposals = decode(deltas.reshape(-1, 4), torch.cat(anchors, 0)).view(len(anchors), -1, 4)
        return proposals, objectness


# --- torch.compile(model, mode="reduce-overhead"), modelled -------------------------------------------------------------

class _CudagraphTrees:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.pool = graph_pool_handle(device)
        self.checkpoint = torch.zeros(1 << 12, dtype=DTYPE, device=device)   # where every generation's outputs land
        self.graphs = {}

    def _guards(self, x):
        return tuple(x.shape), tuple(a.dtype for a in self.model.anchor_generator.cell_anchors)

    def _record(self, x):
        static_x = x.clone()
        ag = self.model.anchor_generator
        state = list(ag.cell_anchors)                  # dynamo traces the module as it is at this call
        made = []

        def traced():
            ag.cell_anchors = list(state)
            proposals, objectness = self.model.forward(static_x)
            made[:] = [ag.cell_anchors] if any(a is not b for a, b in zip(ag.cell_anchors, state)) else []
            produced = (list(made[0]) if made else []) + [proposals, objectness]   # outputs, in allocation order
            placed, offset = [], 0
            for t in produced:                         # from the pool checkpoint: same addresses every generation
                view = self.checkpoint[offset:offset + t.numel()].view(t.shape)
                view.copy_(t.to(DTYPE))
                placed.append(view)
                offset += t.numel()
            return tuple(placed)

        g, outputs = capture(traced, device=self.device, pool=self.pool, name=f"RPN generation {len(self.graphs)}",
                             owner="torch.compile(RPN, mode='reduce-overhead')", static={"images": static_x})
        return g, outputs, static_x, bool(made)

    def __call__(self, x):
        key = self._guards(x)
        if key not in self.graphs:
            self.graphs[key] = self._record(x)
        g, outputs, static_x, made = self.graphs[key]
        static_x.copy_(x)
        placed = list(replay(g, outputs))
        if made:                                       # dynamo's side effect, with the graph's outputs
            n = len(self.model.anchor_generator.cell_anchors)
            self.model.anchor_generator.cell_anchors, placed = placed[:n], placed[n:]
        return placed


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(90810)
    images = [randn(BATCH, 3, IMG, IMG, gen=gen, device=device).to(DTYPE) for _ in range(STEPS)]

    def serve():
        compiled = _CudagraphTrees(RPN(device), device)
        out = []
        with torch.no_grad():
            for x in images:                           # each iteration: one generation
                proposals, objectness = compiled(x)
                out += [proposals.clone(), objectness.clone()]
        return out

    def eager():
        model, out = RPN(device), []
        with torch.no_grad():
            for x in images:
                out += list(model.forward(x))
        return out

    return compare(__name__.rsplit(".", 1)[-1], variant, device, serve, eager)
