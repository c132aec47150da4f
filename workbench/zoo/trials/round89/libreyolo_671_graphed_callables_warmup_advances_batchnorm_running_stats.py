"""LibreYOLO training CUDA graphs: ``make_graphed_callables`` warm-up forwards advance the live model's BatchNorm running statistics before capture.

Upstream: https://github.com/LibreYOLO/libreyolo/pull/671 ("Feat/cuda graph training", LibreYOLO/libreyolo, merged
2026-07-30). Read: the PR's review thread on ``libreyolo/training/cuda_graph.py`` (greptile P1 "Capture warm-up
corrupts BatchNorm state": "make_graphed_callables runs several warm-up forwards on the live training model, updating
BatchNorm running statistics beyond the single update performed in eager training. This makes validation, EMA state,
and saved checkpoints diverge") and the PR summary ("the previously reported BatchNorm warm-up drift is addressed by
snapshotting buffers before capture, restoring them in place before the first replay, and testing exact YOLO9 buffer
parity"); and the merged ``libreyolo/training/cuda_graph.py`` (stored version a21cf76: ``TrainGraphManager.run``,
``_capture_and_run``, ``_snapshot_buffers``, ``_restore_buffers``, ``GraphableNetwork``, the module docstring's
capture-time contracts). The drift was found in review of this PR and fixed in it before the merge, so the buggy
code lived in the PR's earlier commits, not in a release. The PR's commit-by-commit diff was not read; the pre-fix
``_capture_and_run`` below is the merged one without the snapshot/restore, as the review describes it.
Symptom: ``train(..., cuda_graph=True)``: once a batch shape has repeated ``warmup_threshold`` times the manager
captures the network. Losses and weights stay identical to eager, but every BatchNorm layer's running mean/var has
taken ``num_warmup_iters`` extra momentum updates from the capture batch and ``num_batches_tracked`` is ahead by as
many, so eval-mode validation, EMA and checkpoints differ from an eager run.
Mechanism: ``TrainGraphManager._capture_and_run`` calls ``torch.cuda.make_graphed_callables(spec.network, sample,
num_warmup_iters=3)``. Before capturing, torch runs ``num_warmup_iters`` eager forward (and ``autograd.grad``)
passes of the live network on the sample batch; in training mode each forward runs BatchNorm's running-statistics
update in place on the module's own buffers. The capture itself launches nothing, then the first replay performs the
batch's real update, and every later replay one more. So the graph's persistent state (the buffers every replay
updates on purpose) has been written by work outside the step accounting: three phantom training steps.
Doctor: persistent-mutation, at _capture_and_run. The capture path writes the model's persistent BatchNorm buffers
(state the graph updates on purpose at each replay) through the warm-up forwards, which no eager step performs.
Fix (upstream): ``_snapshot_buffers`` clones every module buffer before ``make_graphed_callables`` and
``_restore_buffers`` copies the snapshot back in place (same addresses, which the captured kernels recorded) before
the first replay, so the buffer trajectory matches eager exactly.
Modelled: ``TrainGraphManager`` (shape counting, ``run``, ``_capture_and_run``, snapshot/restore),
``GraphableNetwork`` (flattens the family output list to a tuple), ``CudaGraphTrainSpec`` and a trainer loop (eager
loss ``assemble``, ``.grad`` dropped before backward, SGD step eager). ``make_graphed_callables`` is a stand-in of
torch's: warm-up forwards (its warm-up ``autograd.grad`` with ``only_inputs=True`` writes nothing persistent and is
left out), a forward graph and a backward graph captured into one shared pool, and a ``Graphed`` autograd function
whose forward and backward copy into the static buffers and replay; it rebinds the module's ``forward``. The YOLO9
network is a stand-in: Linear -> BatchNorm1d -> ReLU -> two heads (float64). Sizes: batch 8, in 6, hidden 8, 3 classes.
Workload: six training batches of one shape (warm-up threshold 3, 3 warm-up iterations), then eval-mode validation
on a held-out batch. Steps 1-2 run eager, step 3 captures and replays, steps 4-6 replay. The bug's BatchNorm has 9
tracked batches instead of 6 and running statistics pulled toward batch 3, so the validation predictions and the
running mean/var differ from eager; the losses agree. The fix equals eager.
"""
from __future__ import annotations

import torch
from torch import nn

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/LibreYOLO/libreyolo/pull/671"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "_capture_and_run"
SYMPTOM = ("cuda_graph=True training: make_graphed_callables runs 3 warm-up forwards on the live model before "
           "capture, so BatchNorm running mean/var take 3 extra momentum updates and num_batches_tracked is 9 "
           "instead of 6 after 6 steps; eval-mode validation diverges from eager while losses match")

BATCH, IN, HIDDEN, CLASSES = 8, 6, 8, 3
STEPS, LR = 6, 0.05
DEFAULT_WARMUP_THRESHOLD = 3
DEFAULT_NUM_WARMUP_ITERS = 3

_variant = "bug"


# --- the family network (YOLO9 stand-in) and its capture adapter ----------------------------------------------------

class TinyYOLO9(nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(671)
        self.stem = nn.Linear(IN, HIDDEN).double()
        self.bn = nn.BatchNorm1d(HIDDEN, momentum=0.1).double()
        self.cls_head = nn.Linear(HIDDEN, CLASSES).double()
        self.obj_head = nn.Linear(HIDDEN, 1).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        self.to(device)

    def forward(self, imgs):
        h = torch.relu(self.bn(self.stem(imgs)))
        return [self.cls_head(h), self.obj_head(h)]          # YOLO heads return a list


def flatten_tree(node):
    return (list(node), len(node)) if isinstance(node, list) else ([node], None)


def unflatten_tree(skeleton, tensors):
    return list(tensors) if skeleton is not None else tensors[0]


class GraphableNetwork(nn.Module):
    """Adapter giving the family network the captured-callable contract (a flat tensor tuple)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.skeleton = None

    def forward(self, imgs):
        flat, self.skeleton = flatten_tree(self.module(imgs))
        return tuple(flat)

    def rebuild(self, flat):
        return unflatten_tree(self.skeleton, list(flat))


class CudaGraphTrainSpec:
    def __init__(self, network, assemble):
        self.network, self.assemble = network, assemble


# --- torch.cuda.make_graphed_callables (stand-in, torch/cuda/graphs.py) ----------------------------------------------

def make_graphed_callables(module, sample_args, num_warmup_iters=3, allow_unused_input=False, *, device):
    pool = graph_pool_handle(device)                     # fwd and bwd graphs share one pool
    params = tuple(p for p in module.parameters() if p.requires_grad)
    buffers = {n: b for n, b in module.named_buffers()}
    static_inputs = tuple(sample_args)
    # Warm-up: num_warmup_iters eager forwards on the live module, then the forward capture.
    fwd_graph, static_outputs = capture(
        lambda: module(*static_inputs), device=device, pool=pool, warmups=num_warmup_iters,
        name="graphed fwd", owner="torch.cuda.make_graphed_callables",
        static={f"sample_args[{i}]": t for i, t in enumerate(static_inputs)}, state=buffers)
    static_grad_outputs = tuple(torch.empty_like(o) for o in static_outputs)
    bwd_graph, static_grad_inputs = capture(
        lambda: torch.autograd.grad(static_outputs, params, grad_outputs=static_grad_outputs, only_inputs=True,
                                    allow_unused=allow_unused_input, retain_graph=True),
        device=device, pool=pool, warmups=0, name="graphed bwd", owner="torch.cuda.make_graphed_callables",
        static={f"static_grad_outputs[{i}]": t for i, t in enumerate(static_grad_outputs)})

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for dst, src in zip(static_inputs, inputs[:len(static_inputs)]):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            outs = replay(fwd_graph, static_outputs)
            return tuple(o.detach() for o in outs)

        @staticmethod
        def backward(ctx, *grads):
            for sg, g in zip(static_grad_outputs, grads):
                sg.copy_(g) if g is not None else sg.zero_()
            gi = replay(bwd_graph, static_grad_inputs)
            return (None,) * len(static_inputs) + tuple(b.detach() for b in gi)

    def functionalized(*user_args):
        return Graphed.apply(*(tuple(user_args) + params))

    module.forward = functionalized                      # rebinds the module's forward in place
    return module


# --- libreyolo/training/cuda_graph.py ---------------------------------------------------------------------------------

class TrainGraphManager:
    def __init__(self, device, warmup_threshold=DEFAULT_WARMUP_THRESHOLD, num_warmup_iters=DEFAULT_NUM_WARMUP_ITERS):
        self.device = device
        self.warmup_threshold, self.num_warmup_iters = warmup_threshold, num_warmup_iters
        self._graphed = None
        self._graph_key = None
        self._shape_counts = {}

    @staticmethod
    def _key_for(imgs):
        return (tuple(imgs.shape), imgs.dtype, str(imgs.device))

    def run(self, spec, imgs):
        key = self._key_for(imgs)
        if self._graphed is not None:
            return self._graphed(imgs) if key == self._graph_key else None
        seen = self._shape_counts.get(key, 0) + 1
        self._shape_counts[key] = seen
        if seen < self.warmup_threshold:
            return None
        return self._capture_and_run(spec, imgs)

    @staticmethod
    def _snapshot_buffers(network):
        return [(buf, buf.detach().clone()) for buf in network.buffers()]

    @staticmethod
    def _restore_buffers(snapshot):
        with torch.no_grad():
            for buf, saved in snapshot:
                buf.copy_(saved)                         # in place: the captured kernels recorded these addresses

    def _capture_and_run(self, spec, imgs):
        buffer_snapshot = self._snapshot_buffers(spec.network) if _variant == "fix" else []
        sample = (imgs.detach().clone(),)
        graphed = make_graphed_callables(spec.network, sample, num_warmup_iters=self.num_warmup_iters,
                                         allow_unused_input=True, device=self.device)
        if _variant == "fix":                            # upstream fix: undo the warm-up buffer drift
            self._restore_buffers(buffer_snapshot)
        self._graphed = graphed
        self._graph_key = self._key_for(imgs)
        return self._graphed(imgs)


# --- the trainer (BaseTrainer._train_epoch, reduced) -------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    data = generator(6710)
    batches = [(randn(BATCH, IN, gen=data, device=device).double() * (1.0 + 0.5 * i) + 0.3 * i,
                randn(BATCH, CLASSES, gen=data, device=device).double()) for i in range(STEPS)]
    val_imgs = randn(BATCH, IN, gen=data, device=device).double()

    def train(cuda_graph: bool):
        model = TinyYOLO9(device)
        model.train()
        network = GraphableNetwork(model)

        def assemble(flat, imgs, targets):           # the loss stays eager (data-dependent in upstream)
            cls, obj = network.rebuild(flat)
            return ((cls - targets) ** 2).mean() + 0.1 * (obj ** 2).mean()

        spec = CudaGraphTrainSpec(network, assemble)
        manager = TrainGraphManager(device) if cuda_graph else None
        losses = []
        for imgs, targets in batches:
            flat = manager.run(spec, imgs) if manager is not None else None
            if flat is None:                             # eager step: the family forward, unchanged
                flat = tuple(model(imgs))
                network.skeleton = len(flat)
            loss = spec.assemble(flat, imgs, targets)
            for p in model.parameters():
                p.grad = None                            # the loop drops .grad before every backward
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(LR * p.grad)
            losses.append(loss.detach().clone())
            del flat, loss                               # the step's autograd graph ends with the step
        model.eval()                                     # validation reads the running statistics
        with torch.no_grad():
            cls, obj = model(val_imgs)
        return [torch.stack(losses), cls.clone(), obj.clone(), model.bn.running_mean.clone(),
                model.bn.running_var.clone(), model.bn.num_batches_tracked.double().reshape(1)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
