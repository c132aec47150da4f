"""HockeyMOM's hmtrack runs a hockey video through AspenNet, a graph of plugins (detector, ice-rink pruning, tracker,
saving). In its default "thread-graph" mode every plugin runs on its own thread, up to three frames in flight
(``aspen.pipeline``: ``threaded``, ``graph``, ``max_concurrent: 3``). The detector (an mmdet YOLOX-style model with a
TensorRT NMS plugin) takes a CUDA-graph fast path for single-frame batches: ``_TorchDetectorWrapper.predict`` wraps
backbone, head, ``predict_by_feat`` and the NMS in a ``CudaGraphCallable`` and builds the frame's ``InstanceData``
from what ``CudaGraphCallable.__call__`` returns. Before the fix ``__call__`` copied the inputs in, replayed and
returned ``self._static_outputs``: the graph's own output buffers. ``DetectorInferencePlugin.forward`` attached them to
the frame's data sample as they were, and the downstream plugins (rink pruning, tracker, savers, display) read them on
their own threads later. Once the detector thread has replayed the graph for the next frame, the earlier frame's
boxes, scores and labels are the next frame's: the tracker of frame N associates frame N+1's detections. With the
graph off (the eager path) every frame gets new tensors. The fix makes ``CudaGraphCallable.__call__`` return clones
(``clone_outputs=True`` by default, ``_clone_output``) and has ``DetectorInferencePlugin`` snapshot the tensors it
attaches (``_snapshot_tensor``).

Upstream: https://github.com/cjolivier01/HockeyMOM/commit/87e48a56e303a64d7154d1782ea848525ef85995 ("Fix tracking
stream display races", repository cjolivier01/HockeyMOM, author Chris Olivier, 2026-05-25), a direct commit on
``master`` (parent e45df6f8; no pull request or issue that I found). Read, in a mirror of the repository: the whole
diff of 87e48a56 as it touches ``hmlib/utils/cuda_graph.py``, ``hmlib/aspen/plugins/detector_plugin.py``,
``hmlib/aspen/plugins/ice_rink_boundaries_plugins.py``, ``hmlib/aspen/plugins/tracker_plugin.py``,
``hmlib/aspen/net.py``, ``hmlib/tracking_utils/segm_boundaries.py``, ``hmlib/utils/nms.py``,
``hmlib/aspen/plugins/save_plugins.py``, ``hmlib/ui/shower.py``, ``hmlib/tracking_utils/utils.py`` and
``tests/test_cuda_graph_callable.py``; at the parent: all of ``hmlib/utils/cuda_graph.py`` (``CudaGraphCallable``:
``_capture`` with its warmups, pool and thread-local capture, ``_ensure_signature``, ``__call__``),
``hmlib/aspen/plugins/detector_plugin.py`` (``DetectorInferencePlugin.forward``),
``detector_factory_plugin.py``'s ``_strip_static_padding`` and ``_TorchDetectorWrapper`` (``__init__``,
``set_cuda_graph_enabled``, ``predict`` with the graph fast path and the eager path),
``IceRinkSegmBoundariesPlugin.forward``, ``TrackerPlugin.forward`` up to the tracker call,
``TrtBatchedNMS._infer``/``__call__`` (``torch.empty`` outputs per call, bound to the engine), and ``AspenNet``'s
constructor, ``set_cuda_graph_enabled``, ``_init_threaded_graph``, ``_graph_worker``, ``_forward_threaded_graph`` and
the ``aspen.pipeline`` defaults in ``hmlib/config/baseline.yaml``.
Not read: the C++ ByteTrack (``hockeymom/csrc/bytetrack``) and the rest of the commit's C++ changes, mmdet's YOLOX
head, the TensorRT NMS plugin itself, ``SegmBoundaries``' mask logic beyond ``prune_detections_static``, the camera,
stitching and video-output plugins (``video_out.py``, ``video_out_prep.py`` and ``pose_plugin.py`` also use
``CudaGraphCallable``), ``StreamTensor``/``wrap_tensor``. The commit message gives no symptom in words and there is
no issue: what users saw is my reading of the code and of the new test
``should_return_replay_outputs_with_independent_storage`` (``y0`` must keep its values after the next call).
Symptom: none reported in words; the commit is titled "Fix tracking stream display races". With the detector's CUDA
graph on (the default for batch 1 with TensorRT NMS) and the threaded pipeline, a frame's detections, and so its
tracks and its saved/displayed boxes, can be those of a later frame; intermittently, as the threads' timing decides.
Mechanism: ``CudaGraphCallable._capture`` allocates the graph's outputs once, in the graph's pool; every replay
rewrites them in place. ``__call__`` returned that same tuple to every caller, and ``_TorchDetectorWrapper.predict``
put the tensors into the frame's ``InstanceData`` (``_strip_static_padding(..., strip=False)`` keeps them), so every
frame's ``pred_instances`` alias one set of buffers. The pipeline lets the detector thread run frame N+1 while frame
N still waits for the rink pruning and the tracker (two frames in flight here; three are allowed): that replay
overwrites frame N's detections before they are read. Without the graph, ``predict``'s eager path (and
``TrtBatchedNMS._infer``'s per-call ``torch.empty`` outputs) gives each frame its own tensors.
Doctor: overwritten-output, at ``__call__`` (``CudaGraphCallable.__call__``): it hands out the graph's static outputs
themselves, which a later replay overwrites while the frame that received them is still to be read by the rink and
tracker plugins. It is the function the fix changes (clones by default); the detector plugin's snapshot is a second
guard at the caller.
Fix (upstream): ``CudaGraphCallable`` takes ``clone_outputs=True`` and ``__call__`` returns ``_clone_output`` of the
static outputs; ``DetectorInferencePlugin.forward`` attaches ``_snapshot_tensor`` clones. The same commit also replays
on the capture stream with ``wait_stream`` both ways, adds CUDA events between dependent plugin streams in
``AspenNet``, zeroes the NMS rows past ``num_detections`` (``TrtBatchedNMS._zero_padded_outputs``: TensorRT leaves
them unspecified, eager or not), masks them in ``SegmBoundaries`` and the tracker, validates tracker labels and boxes,
and turns the rink-prune graph off for good ("captured label outputs have shown intermittent aliasing"). The stream
and event changes order work that this synchronous emulation already runs in order, and the padded-row changes are
not graph defects: none is modelled (the NMS stand-in writes every row; the rink plugin runs eagerly in both variants,
as it does by default: its graph is on only when its own or the pipeline's ``cuda_graph`` option asks for it,
while the detector wrapper's ``cuda_graph`` defaults to on).
Modelled: ``_same_tensor_signature``, ``_clone_output``, ``CudaGraphStats``, ``CudaGraphCallable`` (``_capture``,
``_ensure_signature``, ``__call__``), ``InstanceData``, ``_strip_static_padding``, ``TrtBatchedNMS``
(``_infer``, ``__call__``), ``DetectorNMS`` (``run_single``, ``_run_trt``), ``_TorchDetectorWrapper``
(``predict``), ``DetectorInferencePlugin`` (``forward``, the fix's ``_snapshot_tensor``),
``IceRinkSegmBoundariesPlugin`` (``forward``), ``TrackerPlugin`` (``forward``), ``SaveTrackingPlugin``, ``AspenNet``
(``_forward_threaded_graph``).
Stand-ins: the detector is a two-layer conv backbone (3 -> 8 -> 8 channels, 16x16 frames) with a YOLOX-like head
(class, box and objectness maps over an 8x8 grid of priors, ``predict_by_feat`` decoding boxes around the priors and
rescaling by the frame's ``scale_factor``); the TensorRT EfficientNMS plugin is a fixed-shape greedy NMS in torch
(class-agnostic, 6 kept rows, rows past the count written as zeros); the rink mask is a rectangle; the C++ ByteTrack
is a three-slot tracker that moves each track halfway to its nearest detection inside a gate. AspenNet's plugin
threads are replaced by one deterministic interleaving the thread-graph scheduler allows: at each tick the detector
thread runs frame t, then the rink, tracker and save threads run frame t-1 (two frames in flight, fewer than
``max_concurrent: 3``); which interleaving a real run takes depends on timing, hence the "races". No CUDA streams or
events, no fp16, no ``StreamTensor`` wrapping; float64. The run without graphs is the same pipeline with the
detector's ``cuda_graph`` off (``_TorchDetectorWrapper(cuda_graph=False)``), which takes ``predict``'s eager path.
Workload: a 6-frame clip of three bright squares moving over a noisy rink (values 0-255). Outputs: per frame, the
tracker's three boxes and scores, and how many detections it was given.
Measured: the check printed
  hockeymom_87e48a56_detector_graph_boxes_overwritten_before_tracker_reads [bug] on cpu: misbehaves
      (max |graph - eager| = 8.2)
  hockeymom_87e48a56_detector_graph_boxes_overwritten_before_tracker_reads [fix] on cpu: equals eager
      (max |graph - eager| = 0)
In the bug the rink plugin and the tracker of frames 0-4 read the next frame's detections (the tracker is given
5, 5, 5, 6, 5 detections where the run without graphs gives 4, 5, 5, 5, 6); frame 5's detections are read before any
further replay and are right, but its tracks carry the earlier frames' errors. Under 2 s per variant on the CPU,
with its run without graphs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from workbench.engine import events, graph, graph_pool_handle, new_graph, synchronize
from workbench.zoo.kit import compare, generator, randn, remember_step, replay

UPSTREAM = "https://github.com/cjolivier01/HockeyMOM/commit/87e48a56e303a64d7154d1782ea848525ef85995"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "__call__"
SYMPTOM = ("with the detector's CUDA graph and the threaded Aspen pipeline, CudaGraphCallable returned the graph's "
           "static outputs, so a frame's detections were overwritten by the next frame's replay before the rink "
           "pruning and the tracker read them: frames were tracked with the next frame's boxes")

DTYPE = torch.float64
IMG, CHANNELS, FEAT, NUM_CLASSES, STRIDE = 16, 3, 8, 2, 2
KEEP_TOP_K, NUM_TRACKS, NUM_FRAMES = 6, 3, 6
SCORE_THRESHOLD, IOU_THRESHOLD, DET_THRESH, TRACK_GATE = 0.05, 0.5, 0.05, 6.0
RINK_BOX = (1.0, 1.0, 15.0, 15.0)          # the rink mask's extent, in frame pixels
_variant = "bug"


# --- hmlib/utils/cuda_graph.py ---------------------------------------------------------------------------------

def _same_tensor_signature(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device)


def _clone_output(value: Any) -> Any:                  # added by the fix
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone_output(item) for item in value)
    if isinstance(value, list):
        return [_clone_output(item) for item in value]
    return value


@dataclasses.dataclass
class CudaGraphStats:
    captures: int = 0
    replays: int = 0


class CudaGraphCallable:
    """Capture and replay a CUDA graph for a tensor-only callable; recaptured on a new input signature."""

    def __init__(self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *, warmup: int = 3,
                 name: str = "cuda_graph", clone_outputs: bool = True):
        self._fn, self._warmup, self._name = fn, int(max(0, warmup)), str(name)
        self._clone_outputs = bool(clone_outputs) and _variant == "fix"      # the parameter is the fix's
        self._graph = None
        self._pool = None
        self._static_inputs: tuple[torch.Tensor, ...] = ()
        self._static_outputs: Any = None
        self.stats = CudaGraphStats()
        self._capture(tuple(example_inputs))

    def _capture(self, example_inputs: tuple[torch.Tensor, ...]) -> None:
        device = example_inputs[0].device
        synchronize(device)
        self._static_inputs = tuple(torch.empty_like(t) for t in example_inputs)
        events.static_buffers(f"CudaGraphCallable({self._name})",
                              {f"input {i}": s for i, s in enumerate(self._static_inputs)})
        with torch.inference_mode():
            for s, t in zip(self._static_inputs, example_inputs):
                s.copy_(t)
            for _ in range(self._warmup):              # warmup to populate caches (cuDNN/autotune, etc.)
                with events.warmup():
                    self._fn(*self._static_inputs)
            synchronize(device)
            g = new_graph(device)
            pool = graph_pool_handle(device)
            with graph(g, pool=pool, name=self._name, capture_error_mode="thread_local"):
                self._static_outputs = self._fn(*self._static_inputs)
            remember_step(g, lambda: self._fn(*self._static_inputs))
        self._graph, self._pool = g, pool
        self.stats.captures += 1

    def _ensure_signature(self, inputs: tuple[torch.Tensor, ...]) -> None:
        if self._graph is None or len(inputs) != len(self._static_inputs) or not all(
                _same_tensor_signature(a, b) for a, b in zip(inputs, self._static_inputs)):
            self._capture(inputs)

    def __call__(self, *inputs: torch.Tensor):
        inp = tuple(inputs)
        self._ensure_signature(inp)
        with torch.inference_mode():
            for s, t in zip(self._static_inputs, inp):
                s.copy_(t)
            static = replay(self._graph, self._static_outputs)
            output = _clone_output(static) if self._clone_outputs else static
        self.stats.replays += 1
        return output


# --- mmengine / detector_factory_plugin.py / nms.py stand-ins --------------------------------------------------

class InstanceData:
    def __init__(self, metainfo: Optional[dict] = None, **fields):
        self.metainfo = dict(metainfo or {})
        for k, v in fields.items():
            setattr(self, k, v)

    def set_metainfo(self, meta: dict) -> None:
        self.metainfo.update(meta)


def _strip_static_padding(instances: InstanceData, strip: bool) -> InstanceData:
    """Remove padded detections when static outputs are enabled (never, with the TensorRT NMS: strip=False)."""
    if instances is None or not strip:
        return instances
    keep = int(instances.metainfo["num_valid_after_nms"])
    return InstanceData(instances.metainfo, bboxes=instances.bboxes[:keep], scores=instances.scores[:keep],
                        labels=instances.labels[:keep])


def bbox_overlaps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / (area_a[:, None] + area_b[None, :] - inter)


class TrtBatchedNMS:
    """The EfficientNMS_TRT engine: fixed ``keep_top_k`` output rows and a device-side count."""

    def _infer(self, boxes: torch.Tensor, scores: torch.Tensor):
        out_boxes = torch.zeros(KEEP_TOP_K, 4, dtype=boxes.dtype, device=boxes.device)
        out_scores = torch.zeros(KEEP_TOP_K, dtype=boxes.dtype, device=boxes.device)
        out_classes = torch.zeros(KEEP_TOP_K, dtype=boxes.dtype, device=boxes.device)
        num_det = torch.zeros((), dtype=torch.int32, device=boxes.device)
        best, cls = scores.max(-1)
        live = best.clone()
        for k in range(KEEP_TOP_K):                    # greedy NMS, all on the device
            s, i = live.max(0)
            valid = s > SCORE_THRESHOLD
            box = boxes.index_select(0, i.view(1))
            out_boxes[k] = torch.where(valid, box[0], torch.zeros_like(box[0]))
            out_scores[k] = torch.where(valid, s, torch.zeros_like(s))
            out_classes[k] = torch.where(valid, cls.index_select(0, i.view(1))[0].to(boxes.dtype),
                                         torch.zeros_like(s))
            num_det = num_det + valid.to(torch.int32)
            live = torch.where(bbox_overlaps(box, boxes)[0] > IOU_THRESHOLD, torch.full_like(live, -1.0), live)
        return num_det, out_boxes, out_scores, out_classes

    def __call__(self, instances: InstanceData) -> InstanceData:
        num_boxes = instances.bboxes.shape[0]
        scores_full = torch.zeros(num_boxes, NUM_CLASSES, dtype=instances.scores.dtype,
                                  device=instances.scores.device)
        scores_full = scores_full.scatter(1, instances.labels.view(-1, 1), instances.scores.view(-1, 1))
        num_det, out_boxes, out_scores, out_classes = self._infer(instances.bboxes, scores_full)
        new_inst = InstanceData(bboxes=out_boxes, scores=out_scores, labels=out_classes.to(torch.long))
        new_inst.set_metainfo(dict(num_valid_after_nms=num_det, max_detections=KEEP_TOP_K))
        return new_inst


class DetectorNMS:
    def __init__(self):
        self._trt = TrtBatchedNMS()

    def run_single(self, inst: InstanceData, meta: dict) -> InstanceData:
        return self._trt(inst)

    def _run_trt(self, insts: list, metas: list) -> list:
        return [self._trt(inst) for inst in insts]


class YOLOXHead:
    def __init__(self, gen: torch.Generator, device: str):
        self.w_cls = randn(NUM_CLASSES, FEAT, 1, 1, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.w_reg = randn(4, FEAT, 1, 1, gen=gen, device=device, scale=0.3).to(DTYPE)
        self.w_obj = randn(1, FEAT, 1, 1, gen=gen, device=device, scale=0.4).to(DTYPE)
        side = IMG // STRIDE
        ys, xs = torch.meshgrid(torch.arange(side, dtype=DTYPE), torch.arange(side, dtype=DTYPE), indexing="ij")
        self.priors = (torch.stack([xs, ys], -1).reshape(-1, 2) * STRIDE + STRIDE / 2).to(device)

    def __call__(self, feats: torch.Tensor):
        return F.conv2d(feats, self.w_cls), F.conv2d(feats, self.w_reg), F.conv2d(feats, self.w_obj)

    def predict_by_feat(self, cls_scores, bbox_preds, objectnesses, batch_img_metas, cfg=None, rescale=True,
                        with_nms=False) -> list:
        cls = cls_scores[0].flatten(1).t().sigmoid()                   # (priors, classes)
        obj = objectnesses[0].flatten(1).t().sigmoid()
        reg = bbox_preds[0].flatten(1).t()
        scores, labels = (cls * obj).max(-1)
        centre = self.priors + reg[:, :2] * STRIDE
        half = torch.exp(reg[:, 2:].clamp(max=2.0)) * STRIDE
        bboxes = torch.cat([centre - half, centre + half], -1)
        if rescale:
            bboxes = bboxes / batch_img_metas[0]["scale_factor"]
        return [InstanceData(bboxes=bboxes, scores=scores, labels=labels)]


class YOLOXDetector:
    def __init__(self, device: str):
        gen = generator(11)
        self.w1 = randn(FEAT, CHANNELS, 3, 3, gen=gen, device=device, scale=0.3).to(DTYPE)
        self.w2 = randn(FEAT, FEAT, 3, 3, gen=gen, device=device, scale=0.3).to(DTYPE)
        self.bbox_head = YOLOXHead(gen, device)

    def extract_feat(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(F.conv2d(F.relu(F.conv2d(x, self.w1, stride=STRIDE, padding=1)), self.w2, padding=1))


class _Wrap:
    def __init__(self, inst_):
        self.pred_instances = inst_


class _TorchDetectorWrapper:
    def __init__(self, model: YOLOXDetector, cuda_graph: bool = True):
        self.model = model
        self._cuda_graph_enabled = bool(cuda_graph)
        self._cg: Optional[CudaGraphCallable] = None
        self._cg_device = None
        self._nms = DetectorNMS()

    def set_cuda_graph_enabled(self, enabled: bool) -> bool:
        self._cuda_graph_enabled = bool(enabled)
        if not self._cuda_graph_enabled:
            self._cg, self._cg_device = None, None
        return True

    def predict(self, imgs: torch.Tensor, data_samples: list) -> list:
        with torch.inference_mode():
            if self._cuda_graph_enabled and imgs.size(0) == 1:     # CUDA graph fast path: batch 1, TRT NMS
                meta0 = data_samples[0].metainfo

                def _fn(x: torch.Tensor):
                    feats = self.model.extract_feat(x)
                    cls_scores, bbox_preds, objectnesses = self.model.bbox_head(feats)
                    inst0 = self.model.bbox_head.predict_by_feat(cls_scores, bbox_preds, objectnesses,
                                                                 batch_img_metas=[meta0], rescale=True)[0]
                    out0 = self._nms._run_trt([inst0], [meta0])[0]
                    return out0.bboxes, out0.scores, out0.labels, out0.metainfo["num_valid_after_nms"]

                if self._cg is None or self._cg_device != imgs.device:
                    self._cg = CudaGraphCallable(_fn, (imgs[:1],), name="detector")
                    self._cg_device = imgs.device
                bboxes, scores, labels, num_valid = self._cg(imgs[:1])
                inst = InstanceData(bboxes=bboxes, scores=scores, labels=labels)
                inst.set_metainfo(dict(num_valid_after_nms=num_valid, max_detections=int(bboxes.shape[0])))
                return [_Wrap(_strip_static_padding(inst, strip=False))]
            feats = self.model.extract_feat(imgs)
            cls_scores, bbox_preds, objectnesses = self.model.bbox_head(feats)
            metas = [s.metainfo for s in data_samples]
            results = []
            for inst, meta in zip(self.model.bbox_head.predict_by_feat(cls_scores, bbox_preds, objectnesses,
                                                                       batch_img_metas=metas, rescale=True), metas):
                results.append(_Wrap(_strip_static_padding(self._nms.run_single(inst, meta), strip=False)))
            return results


# --- the Aspen plugins ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ImgDataSample:
    metainfo: dict
    pred_instances: Optional[InstanceData] = None

    def set_metainfo(self, meta: dict) -> None:
        self.metainfo.update(meta)


def _snapshot_tensor(value):                            # added by the fix
    return value.clone() if torch.is_tensor(value) else value


class DetectorInferencePlugin:
    def forward(self, context: dict) -> dict:
        detector = context["detector_model"]
        batch_inputs = context["inputs"]
        track_data_sample = context["data_samples"]
        for img_data_sample in track_data_sample:
            img_data_sample.set_metainfo({"frame_id": img_data_sample.metainfo.get("img_id")})
        det_results = detector.predict(batch_inputs / 255.0, track_data_sample)
        for img_data_sample, det_sample in zip(track_data_sample, det_results):
            # attach detections to the video data sample for the downstream tracker
            img_data_sample.pred_instances = _strip_static_padding(det_sample.pred_instances, strip=False)
            if _variant == "fix":
                for name in ("bboxes", "labels", "scores"):
                    setattr(img_data_sample.pred_instances, name,
                            _snapshot_tensor(getattr(img_data_sample.pred_instances, name)))
        return {}


class IceRinkSegmBoundariesPlugin:
    """Prune detections outside the ice rink mask (the eager path: its graph is off unless asked for)."""

    def forward(self, context: dict) -> dict:
        for img_data_sample in context["data_samples"]:
            det = img_data_sample.pred_instances
            centres = (det.bboxes[:, :2] + det.bboxes[:, 2:]) / 2
            x0, y0, x1, y1 = RINK_BOX
            keep = ((centres[:, 0] >= x0) & (centres[:, 0] <= x1) & (centres[:, 1] >= y0) & (centres[:, 1] <= y1)
                    & (det.scores > DET_THRESH))
            new_inst = InstanceData(bboxes=det.bboxes[keep], labels=det.labels[keep], scores=det.scores[keep])
            new_inst.set_metainfo({"num_detections": int(keep.sum())})
            img_data_sample.pred_instances = new_inst
        return {}


class HmTracker:
    """Stand-in for the C++ ByteTrack: three track slots, each moved halfway to its nearest detection."""

    def __init__(self):
        self.boxes: Optional[torch.Tensor] = None
        self.scores: Optional[torch.Tensor] = None

    def track(self, payload: dict) -> dict:
        n = payload["num_detections"]
        bboxes, scores = payload["bboxes"][:n], payload["scores"][:n]
        if n > 0 and self.boxes is None:
            idx = torch.arange(NUM_TRACKS, device=bboxes.device).clamp(max=n - 1)
            self.boxes, self.scores = bboxes[idx].clone(), scores[idx].clone()
        elif n > 0:
            centre = lambda b: (b[:, :2] + b[:, 2:]) / 2                     # noqa: E731
            dist, j = torch.cdist(centre(self.boxes), centre(bboxes)).min(1)
            matched = dist < TRACK_GATE
            self.boxes = torch.where(matched[:, None], 0.5 * self.boxes + 0.5 * bboxes[j], self.boxes)
            self.scores = torch.where(matched, 0.5 * self.scores + 0.5 * scores[j], 0.9 * self.scores)
        return {"ids": torch.arange(NUM_TRACKS, device=payload["bboxes"].device), "bboxes": self.boxes,
                "scores": self.scores}


class TrackerPlugin:
    def __init__(self):
        self._hm_tracker = HmTracker()

    def forward(self, context: dict) -> dict:
        for img_data_sample in context["data_samples"]:
            det_instances = img_data_sample.pred_instances
            payload = dict(frame_id=img_data_sample.metainfo["img_id"], bboxes=det_instances.bboxes,
                           labels=det_instances.labels, scores=det_instances.scores,
                           num_detections=det_instances.metainfo["num_detections"])
            results = self._hm_tracker.track(payload)
            img_data_sample.pred_track_instances = InstanceData(
                {"num_detections": payload["num_detections"]}, instances_id=results["ids"],
                bboxes=results["bboxes"], scores=results["scores"])
        return {}


class SaveTrackingPlugin:
    def __init__(self):
        self.records: list[torch.Tensor] = []

    def forward(self, context: dict) -> dict:
        for img_data_sample in context["data_samples"]:
            tracks = img_data_sample.pred_track_instances
            self.records += [tracks.bboxes.clone(), tracks.scores.clone(),
                             torch.tensor([float(tracks.metainfo["num_detections"])], dtype=DTYPE,
                                          device=tracks.bboxes.device)]
        return {}


class AspenNet:
    """The thread-graph pipeline, as one interleaving its plugin threads allow: at each tick the detector thread
    runs frame t, then the rink, tracker and save threads run frame t-1 (two frames in flight; max_concurrent 3)."""

    def __init__(self, plugins: list, max_concurrent: int = 3):
        self.plugins, self.max_concurrent = plugins, max_concurrent

    def _forward_threaded_graph(self, contexts: list) -> None:
        lag = 1
        assert lag + 1 <= self.max_concurrent
        for tick in range(len(contexts) + lag):
            for stage, plugin in enumerate(self.plugins):
                frame = tick - (0 if stage == 0 else lag)
                if 0 <= frame < len(contexts):
                    plugin.forward(contexts[frame])


# --- workload ---------------------------------------------------------------------------------------------------

def make_clip() -> list[torch.Tensor]:
    gen = generator(146)
    frames = []
    starts = [(2, 3), (9, 4), (5, 10)]
    velocity = [(1, 0), (0, 1), (1, -1)]
    for t in range(NUM_FRAMES):
        img = torch.rand(CHANNELS, IMG, IMG, generator=gen, dtype=DTYPE) * 40.0
        for (x, y), (vx, vy) in zip(starts, velocity):
            cx, cy = x + vx * t, y + vy * t
            img[:, cy:cy + 3, cx:cx + 3] += 200.0
        frames.append(img.clamp(max=255.0)[None])
    return frames


def serve(device: str, cuda_graph: bool) -> list[torch.Tensor]:
    detector = _TorchDetectorWrapper(YOLOXDetector(device), cuda_graph=cuda_graph)
    saver = SaveTrackingPlugin()
    net = AspenNet([DetectorInferencePlugin(), IceRinkSegmBoundariesPlugin(), TrackerPlugin(), saver])
    contexts = [{"inputs": frame.to(device), "detector_model": detector,
                 "data_samples": [ImgDataSample({"img_id": t, "scale_factor": 1.0})]}
                for t, frame in enumerate(make_clip())]
    net._forward_threaded_graph(contexts)
    return saver.records


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, cuda_graph=True), lambda: serve(device, cuda_graph=False))
