"""LibreYOLO captures the training step lazily in "global" mode, mid-epoch; the pin-memory thread's device call inside that capture kills the run.

Upstream: https://github.com/LibreYOLO/libreyolo/pull/681 ("Fix CUDA-graph capture race with DataLoader pin-memory
threads", merged 2026-08-01). The feature came in #671 (2026-07-30, "Feat/cuda graph training").
Symptom: ``train(..., cuda_graph=True)`` crashed on 2 of 100 datasets of the first RF100-VL campaign with
"AcceleratorError ... in pin memory thread". It happens only when the graph capture overlaps the pin-memory thread's
work. With graphs off nothing goes wrong.
Mechanism: ``TrainGraphManager.run`` (``libreyolo/training/cuda_graph.py``) counts batch shapes and captures lazily,
on a live training batch, once a shape has repeated ``warmup_threshold`` (3) times. That is mid-epoch, while the
``pin_memory=True`` DataLoader's pin-memory thread is alive. ``TrainGraphManager._capture_and_run`` calls
``torch.cuda.make_graphed_callables(spec.network, sample, num_warmup_iters=3, allow_unused_input=True)``. That
function builds its own ``torch.cuda.CUDAGraph`` objects and captures them with ``torch.cuda.graph``'s default
``capture_error_mode="global"``. While a global capture is open, CUDA forbids potentially unsafe calls on *every*
thread of the process. Meanwhile the worker hands over the next prefetched batch, and the pin-memory thread pins it:
``pin_memory()`` goes through the ``CachingHostAllocator``. Its ``process_events`` queries (``cudaEventQuery``) the
events recorded when earlier pinned batches were freed after their ``non_blocking=True`` copies, and then it
``cudaHostAlloc``s or reuses a block. CUDA refuses that call (``cudaErrorStreamCaptureUnsupported``), so the capture
fails at its end. ``_capture_and_run`` catches that and falls back to eager, but the pin-memory thread has already
wrapped its error as the batch (``ExceptionWrapper``). The next batch fetch re-raises it, and that kills the run.
Eager training never opens a capture, so it cannot fail this way.
In the model the pin-memory thread is a real ``threading.Thread``. The two threads take turns through
``threading.Event`` hand-offs, so the interleaving is deterministic. A small clock counts time in network passes
(one forward or one backward, whether eager, warmup or captured; a replay takes no time). The single worker needs
``LOAD_PASSES`` (7) passes to assemble a batch, and it keeps ``prefetch_factor`` (2) batches in flight. Once the
worker has delivered a batch, the pin-memory thread pins it during the main thread's current pass or wait. Eager
steps take 2 passes, so the main thread waits at each fetch and every pin lands in that wait. The capture step runs
3 warmup iterations (6 passes). The capture of the forward graph is the 7th pass, and batch 3's pin lands inside
it. Its event query (``.item()`` of the event's device flag: ``cudaEventQuery``) is refused.
Doctor: sync-in-capture, at _capture_and_run. A device wait on another thread (the pin-memory thread's event query)
is attempted while a capture is open, and only the capture's mode decides whether it is refused. The bug lives in
``_capture_and_run``, and that is where the fix changed code. It calls ``make_graphed_callables``, whose captures
open in global mode, which forbids such calls on every thread.
Fix (upstream): ``_capture_and_run`` calls ``make_graphed_callables`` inside ``_thread_local_capture_errors()``.
That context manager (under a lock, ``_capture_patch_lock``) swaps the ``torch.cuda.CUDAGraph`` symbol for a
subclass whose ``capture_begin`` forces ``capture_error_mode="thread_local"``. Only the capturing thread is then
restricted. Inference (``GraphRunner._capture``) passes ``capture_error_mode="thread_local"`` to ``torch.cuda.graph``.
(Read: the post-fix ``cuda_graph.py`` with ``_thread_local_capture_errors`` and ``_capture_and_run``, the PR
description, a review-thread hunk of the diff, and ``trainer.py``'s ``_train_epoch``.)
Modelled: the family network (YOLO9 through ``GraphableNetwork``) is a 2-layer tanh MLP with a list output and a
BatchNorm-like running-mean buffer. Its backward is written out (the loss's autograd is a small ``Loss`` object).
``assemble`` is a mean-squared loss. SGD uses a constant learning rate. ``make_graphed_callables`` keeps its
structure: warm-up iterations of forward and backward, a forward graph and a backward graph in one pool, and a
``Graphed`` function that copies inputs and gradients in and replays. The ``torch.cuda`` namespace holds only the
``CUDAGraph`` symbol that it instantiates. The DataLoader keeps ``_MultiProcessingDataLoaderIter``'s index
prefetching, ``_pin_memory_loop``'s ``do_one_step`` and ``ExceptionWrapper``. The ``CachingHostAllocator`` keeps
its blocks, its per-free events and its free list. An event is a device flag that the stream sets, and its query
reads the flag. Left out: AMP, EMA, the LR schedule, validation, multi-scale batches, the ``TypeError`` retry and
the inference ``GraphRunner``.
"""
from __future__ import annotations

import collections
import logging
import queue
import sys
import threading
import traceback
import types
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from workbench.engine import events, graph_pool_handle, host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

UPSTREAM = "https://github.com/LibreYOLO/libreyolo/pull/681"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_capture_and_run"
SYMPTOM = ("the run dies with 'Caught ... in pin memory thread': the lazy training capture, in global mode, refuses "
           "the pin-memory thread's CachingHostAllocator call, and the next batch fetch re-raises it")

BATCH, IN_CH, HIDDEN, OUT_CH, NUM_BATCHES, LR = 4, 6, 8, 3, 8, 0.05
DEFAULT_WARMUP_THRESHOLD = 3
DEFAULT_NUM_WARMUP_ITERS = 3
PREFETCH_FACTOR = 2                  # num_workers=1, prefetch_factor=2: two batch indices in flight
LOAD_PASSES = 7                      # the worker's time to assemble one (mosaic) batch, in network passes


# --- time on the main thread, as the DataLoader's threads see it -------------------------------------------------

_LIVE_LOADER_ITERS: list = []        # the training loop's DataLoader iterator (its worker and pin-memory thread)


def _network_pass() -> None:
    """One forward or backward pass of the network (eager, warm-up or captured) takes a while. Meanwhile the worker
    keeps loading, and the pin-memory thread pins each batch the worker delivers during it (deterministic
    hand-off: this thread waits until that pin is done)."""
    for it in _LIVE_LOADER_ITERS:
        it._advance(it._clock + 1)


# --- torch.utils.data (DataLoader with num_workers=1, pin_memory=True) -------------------------------------------

class ExceptionWrapper:
    """``torch._utils.ExceptionWrapper``: an exception caught on a DataLoader thread, re-raised on the main thread."""

    def __init__(self, where: str = "in background"):
        exc_type, exc, tb = sys.exc_info()
        self.exc_type = exc_type
        self.exc_msg = "".join(traceback.format_exception(exc_type, exc, tb))
        self.where = where

    def reraise(self):
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        try:
            exception = self.exc_type(msg)
        except Exception:
            raise RuntimeError(msg) from None
        raise exception


class _Block:
    """A pinned host block of the ``CachingHostAllocator``."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.streams = False                 # a non_blocking copy read it (CachingHostAllocator_recordEvent)


class CachingHostAllocator:
    """``at::cuda::CachingHostAllocator``: pinned blocks, reused once the events recorded at their free completed."""

    def __init__(self, device):
        self.device = device
        self.free_list: list[_Block] = []
        self.events: collections.deque = collections.deque()   # (event, block) of blocks freed while in use
        self._lock = threading.Lock()

    def record_event(self, block: _Block) -> None:
        block.streams = True

    def free(self, block: _Block) -> None:
        """The pinned tensor died. A block a stream still uses waits for an event recorded on that stream now."""
        with self._lock:
            if block.streams:
                event = torch.zeros((), dtype=torch.int32, device=self.device)
                event.fill_(1)                                   # cudaEventRecord: the stream sets it on arrival
                block.streams = False
                self.events.append((event, block))
            else:
                self.free_list.append(block)

    def process_events(self) -> None:
        while self.events:
            event, block = self.events[0]
            if not bool(event.item()):                           # cudaEventQuery
                break
            self.events.popleft()
            self.free_list.append(block)

    def allocate(self, t: torch.Tensor) -> _Block:
        """``t.pin_memory()``: retire completed blocks, reuse a free one of the size, else ``cudaHostAlloc``."""
        with self._lock:
            self.process_events()
            for i, block in enumerate(self.free_list):
                if block.tensor.shape == t.shape and block.tensor.dtype == t.dtype:
                    del self.free_list[i]
                    block.tensor.copy_(t)
                    return block
        return _Block(host(t.clone(), self.device))             # cudaHostAlloc


def pin_memory(data, allocator: CachingHostAllocator):
    """``torch.utils.data._utils.pin_memory.pin_memory`` for a tuple of tensors."""
    return tuple(allocator.allocate(t) for t in data)


def _pin_memory_loop(in_queue, out_queue, device_id, done_event, allocator, turn, turn_done):
    """``torch.utils.data._utils.pin_memory._pin_memory_loop``, one ``do_one_step`` per turn it is given."""

    def do_one_step():
        try:
            r = in_queue.get_nowait()
        except queue.Empty:
            return
        idx, data = r
        if not done_event.is_set() and not isinstance(data, ExceptionWrapper):
            try:
                data = pin_memory(data, allocator)
            except Exception:
                data = ExceptionWrapper(where=f"in pin memory thread for device {device_id}")
            r = (idx, data)
        out_queue.put(r)

    with torch.no_grad():
        while True:
            turn.wait()
            turn.clear()
            try:
                if done_event.is_set():
                    return
                do_one_step()
            finally:
                turn_done.set()


class Dataset:
    def __init__(self, images, targets):
        self.images, self.targets = images, targets

    def __len__(self):
        return len(self.images)

    def fetch(self, index):                    # a worker's _MapDatasetFetcher + collate_fn (mosaic etc. upstream)
        return self.images[index].clone(), self.targets[index].clone()


class DataLoader:
    def __init__(self, dataset: Dataset, device, pin_memory: bool = True, prefetch_factor: int = PREFETCH_FACTOR):
        self.dataset, self.device = dataset, device
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor

    def __len__(self):
        return len(self.dataset)

    def __iter__(self):
        return _MultiProcessingDataLoaderIter(self)


class _MultiProcessingDataLoaderIter:
    """One worker (``LOAD_PASSES`` per batch, ``prefetch_factor`` indices in flight) and the pin-memory thread."""

    def __init__(self, loader: DataLoader):
        self._dataset = loader.dataset
        self._allocator = CachingHostAllocator(loader.device)
        self._clock = 0
        self._worker_free_at = 0
        self._ready_at: Dict[int, int] = {}                    # index -> when the worker hands it over
        self._worker_out: Dict[int, tuple] = {}
        self._send_idx = 0
        self._rcvd_idx = 0
        self._held: Tuple[_Block, ...] = ()                    # the batch the training loop holds now
        self._worker_result_queue: queue.Queue = queue.Queue()
        self._data_queue: queue.Queue = queue.Queue()
        self._pin_memory_thread_done_event = threading.Event()
        self._turn, self._turn_done = threading.Event(), threading.Event()
        self._pin_memory_thread = threading.Thread(
            target=_pin_memory_loop, name="pin_memory",
            args=(self._worker_result_queue, self._data_queue, 0, self._pin_memory_thread_done_event,
                  self._allocator, self._turn, self._turn_done), daemon=True)
        self._pin_memory_thread.start()
        _LIVE_LOADER_ITERS.append(self)
        for _ in range(loader.prefetch_factor):
            self._try_put_index()

    def __len__(self):
        return len(self._dataset)

    def __iter__(self):
        return self

    def _try_put_index(self) -> None:
        if self._send_idx >= len(self._dataset):
            return
        start = max(self._clock, self._worker_free_at)
        self._worker_free_at = start + LOAD_PASSES
        self._ready_at[self._send_idx] = self._worker_free_at
        # the worker process assembles the batch from now on (its own process: none of it runs on this thread
        # while a capture is open); it is handed over at _ready_at
        self._worker_out[self._send_idx] = self._dataset.fetch(self._send_idx)
        self._send_idx += 1

    def _take_turn(self) -> None:
        self._turn.set()
        self._turn_done.wait()
        self._turn_done.clear()

    def _advance(self, until: int) -> None:
        """Time passes on the main thread up to ``until``: each batch the worker delivers meanwhile is pinned now."""
        for idx in sorted(self._ready_at):
            if self._ready_at[idx] <= until:
                del self._ready_at[idx]
                self._worker_result_queue.put((idx, self._worker_out.pop(idx)))
                self._take_turn()
        self._clock = until

    def _next_data(self):
        if self._rcvd_idx >= len(self._dataset):
            raise StopIteration
        if self._data_queue.empty():                           # _get_data: wait on the pin-memory thread's queue
            self._advance(max(self._clock, self._ready_at[self._rcvd_idx]))
        idx, data = self._data_queue.get_nowait()
        for block in self._held:                               # the loop variable's previous batch dies here
            self._allocator.free(block)
        self._held = ()
        self._rcvd_idx += 1
        self._try_put_index()
        if isinstance(data, ExceptionWrapper):                 # _process_data
            data.reraise()
        self._held = data
        return data

    def __next__(self):
        blocks = self._next_data()
        return tuple(b.tensor for b in blocks), blocks

    def _shutdown_workers(self) -> None:
        if self in _LIVE_LOADER_ITERS:
            _LIVE_LOADER_ITERS.remove(self)
        self._pin_memory_thread_done_event.set()
        self._turn.set()
        self._pin_memory_thread.join()


# --- torch.cuda: the CUDAGraph symbol and make_graphed_callables --------------------------------------------------

class CUDAGraph:
    """``torch.cuda.CUDAGraph``, as far as ``make_graphed_callables`` uses it."""

    def __init__(self):
        self.graph = None
        self.capture_error_mode = None

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        self.capture_error_mode = capture_error_mode           # cudaStreamBeginCapture(stream, mode)


torch_cuda = types.SimpleNamespace(CUDAGraph=CUDAGraph)         # the module attribute make_graphed_callables reads


def _torch_cuda_graph(cuda_graph: CUDAGraph, fn, *, device, pool, name, static, state=None):
    """``with torch.cuda.graph(cuda_graph, pool=pool): out = fn()``. ``__enter__`` calls
    ``cuda_graph.capture_begin(pool, capture_error_mode=self.capture_error_mode)``, which is "global" by default."""
    cuda_graph.capture_begin(pool, capture_error_mode="global")
    cuda_graph.graph, out = capture(fn, device=device, pool=pool, warmups=0, name=name, static=static, state=state,
                                    owner="torch.cuda.make_graphed_callables",
                                    capture_error_mode=cuda_graph.capture_error_mode)
    return out


class _Outputs(tuple):
    """A network's flat output tuple and the backward that autograd will run for it."""

    grad_fn: Callable


def make_graphed_callables(network, sample_args, *, device, num_warmup_iters=3, allow_unused_input=False):
    """``torch.cuda.make_graphed_callables`` for one module: warm up forward and backward, capture a forward and a
    backward graph in one pool, and return the module's graphed forward."""
    mempool = graph_pool_handle(device)
    for _ in range(num_warmup_iters):                          # on a side stream upstream
        with events.warmup():
            outputs = network(*sample_args)
            network.backward(tuple(torch.zeros_like(o) for o in outputs))      # autograd.grad(only_inputs=True)
    synchronize(device)
    fwd_graph, bwd_graph = torch_cuda.CUDAGraph(), torch_cuda.CUDAGraph()
    static_input = sample_args[0]
    buffers = {f"buffer{i}": b for i, b in enumerate(network.buffers())}
    static_outputs = _torch_cuda_graph(fwd_graph, lambda: tuple(network(static_input)), device=device, pool=mempool,
                                       name="training forward", static={"static_input": static_input}, state=buffers)
    static_grad_outputs = tuple(torch.zeros_like(o) for o in static_outputs)
    static_grad_inputs = _torch_cuda_graph(
        bwd_graph, lambda: tuple(network.backward(static_grad_outputs)), device=device, pool=mempool,
        name="training backward", static={"static_input": static_input,
                                          **{f"static_grad_output{i}": g for i, g in enumerate(static_grad_outputs)}})

    class Graphed:
        """The ``torch.autograd.Function`` that replays: forward copies the input in, backward the gradients."""

        @staticmethod
        def backward(grads):
            for static_grad, grad in zip(static_grad_outputs, grads):
                if static_grad.data_ptr() != grad.data_ptr():
                    static_grad.copy_(grad)
            return tuple(b.detach() for b in replay(bwd_graph.graph, static_grad_inputs))

        @staticmethod
        def forward(x):
            if static_input.data_ptr() != x.data_ptr():
                static_input.copy_(x)
            out = _Outputs(o.detach() for o in replay(fwd_graph.graph, static_outputs))
            out.grad_fn = Graphed.backward
            return out

    return Graphed.forward                                     # module.forward rebound upstream


# --- libreyolo/models: the YOLO9 family network and its spec -----------------------------------------------------

class YOLO9Net:
    """The trainable network: a list-output head over a tanh trunk, with a BatchNorm-like running-mean buffer."""

    def __init__(self, device):
        gen = generator(681)
        self.w1 = randn(IN_CH, HIDDEN, gen=gen, device=device, scale=0.5)
        self.b1 = randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.w2 = randn(HIDDEN, OUT_CH, gen=gen, device=device, scale=0.5)
        self.running_mean = torch.zeros(HIDDEN, device=device)
        self.grads: List[Optional[torch.Tensor]] = [None, None, None]
        self._saved = None

    def parameters(self):
        return [self.w1, self.b1, self.w2]

    def buffers(self):
        return [self.running_mean]

    def __call__(self, imgs):
        _network_pass()
        h = torch.tanh(imgs @ self.w1 + self.b1)
        self.running_mean.mul_(0.9).add_(0.1 * h.mean(0))      # BatchNorm running stats (train mode)
        self._saved = (imgs, h)
        return [h @ self.w2]

    def backward(self, grad_outputs):
        _network_pass()
        (g_out,) = grad_outputs
        imgs, h = self._saved
        dz = (g_out @ self.w2.t()) * (1 - h * h)
        return imgs.t() @ dz, dz.sum(0), h.t() @ g_out


def flatten_tree(node):
    tensors = []

    def walk(item):
        if isinstance(item, torch.Tensor):
            tensors.append(item)
            return len(tensors) - 1
        return [walk(v) for v in item]

    return tensors, walk(node)


class GraphableNetwork:
    """Adapter giving the family network the captured-callable contract (a flat tensor tuple)."""

    def __init__(self, module: YOLO9Net):
        self.module = module
        self.skeleton: Any = None

    def __call__(self, imgs):
        flat, self.skeleton = flatten_tree(self.module(imgs))
        out = _Outputs(flat)
        out.grad_fn = self.backward
        return out

    def backward(self, grad_outputs):
        return self.module.backward(grad_outputs)

    def buffers(self):
        return self.module.buffers()


class Loss:
    """The loss and the autograd graph ``loss.backward()`` walks (the network's backward, then AccumulateGrad)."""

    def __init__(self, value, grad_outputs, grad_fn, params, grads):
        self.value, self._grad_outputs, self._grad_fn = value, grad_outputs, grad_fn
        self._params, self._grads = params, grads

    def item(self):
        return self.value.item()

    def backward(self):
        for i, g in enumerate(self._grad_fn(self._grad_outputs)):
            if self._grads[i] is None:
                self._grads[i] = g                             # AccumulateGrad: .grad is None, it takes the tensor
            else:
                self._grads[i].add_(g)


class CudaGraphTrainSpec:
    """What a model family hands the trainer: the network to capture and the eager loss that assembles its outputs."""

    def __init__(self, network: GraphableNetwork, assemble: Callable):
        self.network, self.assemble = network, assemble


def yolo9_cuda_graph_train_spec(model: YOLO9Net) -> CudaGraphTrainSpec:
    def assemble(flat, imgs, targets, polygons):
        (pred,) = flat
        diff = pred - targets
        total_loss = (diff * diff).mean()
        grad = 2.0 * diff / diff.numel()
        return {"total_loss": Loss(total_loss, (grad,), flat.grad_fn, model.parameters(), model.grads)}

    return CudaGraphTrainSpec(GraphableNetwork(model), assemble)


# --- libreyolo/training/cuda_graph.py ------------------------------------------------------------------------------

_capture_patch_lock = threading.Lock()


@contextmanager
def _thread_local_capture_errors():
    """Make ``make_graphed_callables`` capture with ``thread_local`` errors: swap the ``torch.cuda.CUDAGraph``
    symbol it instantiates for a subclass that forces the mode at ``capture_begin``."""
    with _capture_patch_lock:
        original = torch_cuda.CUDAGraph

        class _ThreadLocalCaptureGraph(original):
            def capture_begin(self, *args, **kwargs):
                kwargs["capture_error_mode"] = "thread_local"
                super().capture_begin(*args, **kwargs)

        torch_cuda.CUDAGraph = _ThreadLocalCaptureGraph
        try:
            yield
        finally:
            torch_cuda.CUDAGraph = original


@contextmanager
def _no_capture_mode_patch():
    yield


class TrainGraphManager:
    """Owns shape counting, capture and replay for one training run (at most one graph)."""

    def __init__(self, variant, device, warmup_threshold=DEFAULT_WARMUP_THRESHOLD,
                 num_warmup_iters=DEFAULT_NUM_WARMUP_ITERS):
        self.variant, self.device = variant, device
        self.warmup_threshold = max(1, int(warmup_threshold))
        self.num_warmup_iters = max(1, int(num_warmup_iters))
        self.disabled = False
        self._graphed: Optional[Callable] = None
        self._graph_key = None
        self._shape_counts: Dict[tuple, int] = {}

    @staticmethod
    def _key_for(imgs):
        return (tuple(imgs.shape), imgs.dtype, str(imgs.device))

    def _disable(self, reason: str) -> None:
        self.disabled = True
        self._graphed = None
        logger.warning("cuda_graph training capture disabled, falling back to eager: %s", reason)

    def run(self, spec: CudaGraphTrainSpec, imgs) -> Optional[Tuple[torch.Tensor, ...]]:
        if self.disabled:
            return None
        key = self._key_for(imgs)
        if self._graphed is not None:
            if key != self._graph_key:
                return None
            try:
                return self._graphed(imgs)
            except Exception as exc:
                self._disable(f"graph replay failed: {exc!r}")
                return None
        seen = self._shape_counts.get(key, 0) + 1
        self._shape_counts[key] = seen
        if seen < self.warmup_threshold:
            return None
        return self._capture_and_run(spec, imgs)

    @staticmethod
    def _snapshot_buffers(network) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return [(buf, buf.detach().clone()) for buf in network.buffers()]

    @staticmethod
    def _restore_buffers(snapshot) -> None:
        with torch.no_grad():
            for buf, saved in snapshot:
                buf.copy_(saved)

    def _capture_and_run(self, spec: CudaGraphTrainSpec, imgs) -> Optional[Tuple[torch.Tensor, ...]]:
        buffer_snapshot: List[Tuple[torch.Tensor, torch.Tensor]] = []
        try:
            buffer_snapshot = self._snapshot_buffers(spec.network)
            sample = (imgs.detach().clone(),)
            # bug (#671): make_graphed_callables ran bare, so its captures opened in torch.cuda.graph's default
            # capture_error_mode="global"; #681 wraps it in _thread_local_capture_errors()
            patch = _thread_local_capture_errors if self.variant == "fix" else _no_capture_mode_patch
            with patch():
                graphed = make_graphed_callables(spec.network, sample, device=self.device,
                                                 num_warmup_iters=self.num_warmup_iters, allow_unused_input=True)
        except Exception as exc:
            self._disable(f"graph capture failed: {exc!r}")
            try:
                synchronize(self.device)               # drain queued stream-capture errors
            except Exception:
                pass
            self._restore_buffers(buffer_snapshot)
            return None
        self._restore_buffers(buffer_snapshot)         # undo warm-up drift before the first replay
        self._graphed = graphed
        self._graph_key = self._key_for(imgs)
        logger.info("cuda_graph: captured training forward/backward at input shape %s", tuple(imgs.shape))
        try:
            return self._graphed(imgs)
        except Exception as exc:
            self._disable(f"first graph replay failed: {exc!r}")
            return None


# --- libreyolo/training/trainer.py ---------------------------------------------------------------------------------

class YOLO9Trainer:
    def __init__(self, variant, device, cuda_graph: bool, dataset: Dataset):
        self.device = device
        self.model = YOLO9Net(device)
        self.train_loader = DataLoader(dataset, device, pin_memory=True)
        self._cuda_graph_manager = TrainGraphManager(variant, device) if cuda_graph else None
        self._cuda_graph_spec = yolo9_cuda_graph_train_spec(self.model) if cuda_graph else None

    def on_forward(self, imgs, targets, polygons=None):
        spec = yolo9_cuda_graph_train_spec(self.model)
        return spec.assemble(spec.network(imgs), imgs, targets, polygons)

    def _forward_train(self, imgs, targets, polygons=None):
        manager = self._cuda_graph_manager
        if manager is not None:
            flat = manager.run(self._cuda_graph_spec, imgs)
            if flat is not None:
                return self._cuda_graph_spec.assemble(flat, imgs, targets, polygons)
        return self.on_forward(imgs, targets, polygons)

    def zero_grad(self):
        self.model.grads[:] = [None, None, None]               # optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self):
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), self.model.grads):
                p.sub_(LR * g)                                 # torch.optim.SGD.step()

    def _train_epoch(self, epoch):
        losses = []
        loader = iter(self.train_loader)
        try:
            for batch_idx, ((imgs, targets), blocks) in enumerate(loader):
                imgs = imgs.to(self.device, non_blocking=True)
                targets = targets.to(self.device, non_blocking=True)
                for block in blocks:                           # the copies read the pinned blocks
                    loader._allocator.record_event(block)
                outputs = self._forward_train(imgs, targets, None)
                total_loss_raw = outputs["total_loss"]
                self.zero_grad()
                total_loss_raw.backward()
                self.optimizer_step()
                loss_val = float(total_loss_raw.item())
                losses.append(torch.tensor([loss_val], dtype=torch.float64))
        finally:
            loader._shutdown_workers()
        return losses

    def train(self):
        losses = self._train_epoch(0)
        m = self.model
        return losses + [m.w1.clone(), m.b1.clone(), m.w2.clone(), m.running_mean.clone()]


def run(variant: str, device: str = "cpu"):
    gen = generator(6810)
    images = [torch.randn(BATCH, IN_CH, generator=gen) for _ in range(NUM_BATCHES)]
    targets = [torch.randn(BATCH, OUT_CH, generator=gen) for _ in range(NUM_BATCHES)]
    dataset = Dataset(images, targets)

    def train(cuda_graph: bool):
        _LIVE_LOADER_ITERS.clear()
        return YOLO9Trainer(variant, device, cuda_graph, dataset).train()

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
