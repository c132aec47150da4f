"""tiny-cuda-nn (the neural-graphics library under instant-ngp) records ``Trainer::training_step`` -- forward, loss,
backward -- as a CUDA graph on every call (``CudaGraph::capture_and_execute``: capture, update the instantiated graph,
launch). The network's temporaries come from a per-stream ``GPUMemoryArena``: a reserved virtual address range whose
physical backing ``GPUMemoryArena::enlarge`` maps on demand when an allocation reaches past it, and ``enlarge``
called ``cudaDeviceSynchronize()`` before and after mapping. When an allocation made *inside* the captured training step
is the one that reaches past the mapped size, that device-wide synchronize runs while the stream is capturing, which
CUDA refuses ("operation not permitted when stream is capturing") and which breaks the capture; without graphs the same
step is fine. The fix drops the synchronize before mapping, and while a ``CudaGraph`` capture is open it only asks the
capture (``current_capture()->schedule_synchronize()``) to synchronize once ``cudaStreamEndCapture`` has returned.

Upstream: https://github.com/NVlabs/tiny-cuda-nn/commit/587bd261fe40de3163ae314709b7668fa10ac610 ("Make CudaGraph /
GPUMemoryArena more compatible", repository NVlabs/tiny-cuda-nn, author Thomas Mueller, 2022-02-15), a direct commit on
``master`` (no pull request). Read, in a mirror of the repository: the whole diff
(``include/tiny-cuda-nn/cuda_graph.h``: ``current_captures``, ``current_capture``, ``CudaGraph::capture_and_execute``,
``schedule_synchronize``; ``include/tiny-cuda-nn/gpu_memory.h``: ``GPUMemoryArena::enlarge``); at its parent
``GPUMemoryArena`` whole (``allocate``, ``free``, ``enlarge``, ``size``, ``Allocation``), ``gpu_memory_arenas``,
``allocate_workspace``, ``allocate_workspace_and_distribute``, ``Trainer`` in ``include/tiny-cuda-nn/trainer.h``
(``allocate_training_buffers``, ``forward``, ``evaluate_loss``, ``backward``, ``training_step``),
``CutlassMLP::forward``, ``CutlassMLP::backward`` (its ``backward_tmp`` matrices) and ``allocate_forward_buffers`` in
``src/cutlass_mlp.cu``, the CUTLASS ``fc_multiply_impl`` (which also takes its workspace from the arena) and ``L2Loss``
(``losses/l2.h``). The history of ``enlarge`` after the fix: 207bcb6 (2022-02-28) adds a non-virtual-memory fallback
whose ``enlarge`` synchronizes unconditionally again, and ee210be (2022-08-26). In instant-ngp at 1f40048 (the last
commit before the fix): ``Testbed::train_nerf_step`` (its per-step scratch from ``allocate_workspace_and_distribute`` on
the training stream, sized by the adaptive ``n_rays_per_batch``), the image/SDF/volume modes' calls of
``m_trainer->training_step`` and ``m_training_stream = m_inference_stream``. Issues read (their stored text):
instant-ngp #795 and #455 (the same refused ``cudaDeviceSynchronize()`` in ``gpu_memory.h``, after this fix, see
Symptom).
Not read: the optimizers beyond their call in ``training_step``, the encodings (``GridEncoding``) and FullyFusedMLP,
the PyTorch bindings, the rest of instant-ngp's ``train_nerf_step`` (beyond its scratch and its network calls, which
in February 2022 drove the network's forward/backward directly, not through ``Trainer::training_step``), and the rest
of instant-ngp.
Symptom: the commit cites no report ("more compatible"); the failure is CUDA's refusal of ``cudaDeviceSynchronize``
during stream capture, thrown by ``CUDA_CHECK_THROW`` in ``enlarge`` inside the captured lambda. Users later quoted it
from the branch this commit left synchronizing: instant-ngp #795 ("cudaDeviceSynchronize() failed with error operation
not permitted when stream is capturing", on a K80, whose arena takes the non-virtual-memory fallback of 207bcb6, "when
I have aabb_scale set higher than 2", i.e. with larger batches); #455 reports the same text from the arena's destructor.
Mechanism: ``GPUMemoryArena::allocate`` places a request best-fit in the free intervals and calls ``enlarge(size())``
with the arena's new top; the top only grows past the mapped size when a request lands higher than any before. A
captured step's own temporaries (the forward context's hidden activations, ``backward``'s ``backward_tmp``) are the
same from step to step, but they sit above whatever the caller holds from the same stream's arena at that moment: when
the caller's per-step scratch grows (more rays per batch), the step's temporaries land higher, and the allocation that
crosses the mapped size is made inside ``capture_and_execute``'s lambda. ``enlarge`` then calls
``cudaDeviceSynchronize()`` while the stream captures; the capture is invalidated and the error is thrown.
Doctor: sync-in-capture, at ``enlarge``: a host wait for the whole device issued while the capture is open, in the
function the fix changes (the ``CudaGraph`` side of the fix only runs the deferred synchronize after the capture ends).
Fix (upstream): ``enlarge`` no longer synchronizes before mapping; after mapping it calls
``current_capture()->schedule_synchronize()`` when a ``CudaGraph`` capture is open (``current_captures``, pushed by
``capture_and_execute`` after ``cudaStreamBeginCapture`` and popped after ``cudaStreamEndCapture``), else
``cudaDeviceSynchronize()``; ``capture_and_execute`` synchronizes after ending a capture whose flag is set, then updates
or instantiates and launches the graph. The same commit also captures in ``cudaStreamCaptureModeRelaxed`` instead of
``Global`` (so the ``cuMemCreate``/``cuMemMap`` calls of ``enlarge`` are allowed during capture) and skips capture on
the legacy stream or when the legacy stream is capturing.
Modelled: ``GPUMemoryArena`` (``allocate``, ``free``, ``enlarge``, ``size``, ``Allocation``), ``gpu_memory_arenas``,
``allocate_workspace``, ``allocate_workspace_and_distribute``, ``current_captures``, ``current_capture``, ``CudaGraph``
(``capture_and_execute``, ``schedule_synchronize``), ``Trainer`` (``allocate_training_buffers``, ``forward``,
``evaluate_loss``, ``backward``, ``optimizer_step``, ``training_step``), ``CutlassMLP`` (``forward``, ``backward``,
``allocate_forward_buffers``, ``num_forward_activations``), ``L2Loss.evaluate``, ``reduce_sum``, and a ``Testbed``
with ``train_nerf_step``.
Stand-ins: one float64 tensor is the reserved address range (``cuMemAddressReserve``); mapping physical memory
(``cuMemCreate``/``cuMemMap``/``cuMemSetAccess``) is the growth of the arena's ``m_size`` bookkeeping, so allocations
never move, as with virtual memory. Sizes are in elements: a 16-element (128-byte) alignment and a 32-element
granularity for ``cuda_memory_granularity()`` (2 MiB on a GPU). ``cudaDeviceSynchronize`` is the engine's
``synchronize``, which a capture refuses on both backends. A capture is the engine's, made fresh on each call
(upstream keeps one ``cudaGraphExec_t`` and updates it with ``cudaGraphExecUpdate``); ``cudaGraphLaunch`` is its
replay; the run without graphs skips every capture. The network is a CutlassMLP without biases (4 -> 16 -> 16 -> 4,
ReLU, linear output, float64); the optimizer is plain SGD (upstream Adam). The caller is a stand-in for instant-ngp's
testbed: a ``train_nerf_step`` that takes its per-step ray scratch from the training stream's arena, fills the rays,
samples the target batch of points along them (a fixed stand-in for the ray marcher) and a fixed analytic "scene" for
the targets, and holds the scratch while it calls ``Trainer::training_step``; its rays per batch follow a fixed
schedule (4, 4, 8, 8, 12, 12) standing for the adaptive ``rays_per_batch``. Which upstream workload first crossed the
mapped size inside a capture is not known; this trigger (a caller's growing scratch below the step's temporaries on the
same stream) is a guess consistent with the code read.
Workload: six training steps of 8 samples each on one stream. Step 0 reallocates the trainer's buffers, so it runs
uncaptured (``did_allocate``) and maps the arena to 608 elements; step 1 captures and allocates below that; step 2's
scratch (8 rays) pushes the step's second ``backward_tmp`` to 624 (mapped: 640), and step 4's (12 rays) to 656
(mapped: 672). Outputs: the six training losses (``reduce_sum`` of the loss buffer, read after each launch) and the
final parameters. The run without graphs is the same loop with every capture skipped.
Measured: bug: misbehaves (raised CaptureError: synchronize() inside graph capture needs the device's values on the
host (a host synchronisation), which a CUDA graph cannot wait for (cudaErrorStreamCaptureUnsupported).): steps 0
(uncaptured) and 1 (captured) train, step 2's captured backward reaches 624 > 608 and ``enlarge`` synchronizes inside
the capture. Fix: equals eager (max |graph - eager| = 0): steps 2 and 4 schedule the synchronize, which runs after their
capture ends, before the launch. About 5 s for both variants on the CPU (the runs without graphs included).
"""
from __future__ import annotations

import bisect
import dataclasses

import torch
from torch import Tensor

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVlabs/tiny-cuda-nn/commit/587bd261fe40de3163ae314709b7668fa10ac610"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "enlarge"
SYMPTOM = ("a captured Trainer::training_step whose temporaries land past the GPUMemoryArena's mapped size calls "
           "cudaDeviceSynchronize inside the capture (GPUMemoryArena::enlarge), which CUDA refuses: 'operation not "
           "permitted when stream is capturing'")

DTYPE = torch.float64
N_INPUT_DIMS, NETWORK_WIDTH, N_OUTPUT_DIMS, N_HIDDEN_LAYERS = 4, 16, 4, 2
TARGET_BATCH_SIZE = 8
LOSS_SCALE = 128.0
LEARNING_RATE = 0.05                    # stand-in SGD (upstream: Adam)
CACHELINE = 16                          # elements: 128 bytes of float64
GRANULARITY = 32                        # elements: stand-in for cuda_memory_granularity() (2 MiB)
MAX_SIZE = 1 << 14                      # elements of the reserved address range
RAYS_PER_BATCH = (4, 4, 8, 8, 12, 12)   # stand-in for the adaptive m_nerf.training.rays_per_batch
MAX_RAYS = max(RAYS_PER_BATCH)
_variant = "bug"
_graphs_enabled = True                  # False: the run without graphs (every capture skipped)


def next_multiple(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def align_to_cacheline(n: int) -> int:
    return next_multiple(n, CACHELINE)


def cudaDeviceSynchronize(device: str) -> None:
    synchronize(device)                 # a capturing stream refuses it (cudaErrorStreamCaptureUnsupported)


# --- include/tiny-cuda-nn/cuda_graph.h ------------------------------------------------------------------------------

_current_captures: list = []


def current_captures() -> list:
    return _current_captures


def current_capture():
    return current_captures()[0] if current_captures() else None


class CudaGraph:
    def __init__(self) -> None:
        self.m_graph = None
        self.m_synchronize_when_capture_done = False

    def capture_and_execute(self, stream: "Stream", skip_capture: bool, fun) -> None:
        skip_capture = skip_capture or not _graphs_enabled
        if skip_capture:
            fun()
            return
        fixed = _variant == "fix"
        if fixed:                      # pushed right after cudaStreamBeginCapture(stream, Relaxed)
            current_captures().append(self)
        # cudaStreamBeginCapture(stream, Global before the fix, Relaxed after) ... fun() ... cudaStreamEndCapture
        self.m_graph, outputs = capture(fun, device=stream.device, warmups=0, name="Trainer::training_step",
                                        capture_error_mode="relaxed" if fixed else "global")
        if fixed:
            if current_captures()[-1] is not self:
                raise RuntimeError("CudaGraph: must end captures in reverse order of creation.")
            current_captures().pop()
            if self.m_synchronize_when_capture_done:
                cudaDeviceSynchronize(stream.device)
                self.m_synchronize_when_capture_done = False
        replay(self.m_graph, outputs)  # cudaGraphExecUpdate / cudaGraphInstantiate, then cudaGraphLaunch

    def schedule_synchronize(self) -> None:
        self.m_synchronize_when_capture_done = True


# --- include/tiny-cuda-nn/gpu_memory.h ------------------------------------------------------------------------------

@dataclasses.dataclass
class Interval:
    start: int
    end: int                            # exclusive

    def size(self) -> int:
        return self.end - self.start


class GPUMemoryArena:
    def __init__(self, device: str) -> None:
        self.device = device
        self.m_alignment = CACHELINE
        self.m_max_size = next_multiple(MAX_SIZE, GRANULARITY)
        self.m_free_intervals = [Interval(0, self.m_max_size)]
        self.m_allocated_intervals: dict = {}
        # cuMemAddressReserve: the whole range, at a fixed address; enlarge() maps physical memory into it
        self.m_base_address = torch.zeros(self.m_max_size, dtype=DTYPE, device=device)
        self.m_size = 0

    def data(self) -> Tensor:
        return self.m_base_address

    def allocate(self, n_bytes: int) -> int:
        if n_bytes == 0:
            n_bytes = self.m_alignment
        n_bytes = next_multiple(n_bytes, self.m_alignment)
        best_candidate = self.m_free_intervals[-1]
        for f in self.m_free_intervals:
            if f.size() >= n_bytes and f.size() < best_candidate.size():
                best_candidate = f
        start = best_candidate.start
        best_candidate.start += n_bytes
        self.m_allocated_intervals[start] = best_candidate.start
        self.enlarge(self.size())
        return start

    def free(self, start: int) -> None:
        if start not in self.m_allocated_intervals:
            raise RuntimeError("Attempted to free arena memory that was not allocated.")
        interval = Interval(start, self.m_allocated_intervals.pop(start))
        ends = [f.end for f in self.m_free_intervals]
        self.m_free_intervals.insert(bisect.bisect_right(ends, interval.end), interval)
        self.merge_adjacent_intervals()

    def enlarge(self, n_bytes: int) -> None:
        if n_bytes <= self.m_size:
            return
        if _variant == "bug":
            cudaDeviceSynchronize(self.device)
        n_bytes_to_allocate = next_multiple(n_bytes - self.m_size, GRANULARITY)
        # cuMemCreate + cuMemMap + cuMemSetAccess of [m_size, m_size + n_bytes_to_allocate)
        self.m_size += n_bytes_to_allocate
        # Need to synchronize the device to make sure memory is available to all streams.
        if _variant == "fix" and current_capture() is not None:
            current_capture().schedule_synchronize()
        else:
            cudaDeviceSynchronize(self.device)

    def size(self) -> int:
        return self.m_free_intervals[-1].start

    def merge_adjacent_intervals(self) -> None:
        merged = [self.m_free_intervals[0]]
        for cur in self.m_free_intervals[1:]:
            if merged[-1].end == cur.start:
                merged[-1] = Interval(merged[-1].start, cur.end)
            else:
                merged.append(cur)
        self.m_free_intervals = merged


class Allocation:
    """``GPUMemoryArena::Allocation``: frees its interval when released (the destructor upstream)."""

    def __init__(self, stream: "Stream", offset: int, workspace: GPUMemoryArena) -> None:
        self.m_stream, self.m_offset, self.m_workspace = stream, offset, workspace

    def matrix(self, offset: int, m: int, n: int) -> Tensor:
        start = self.m_offset + offset
        return self.m_workspace.data()[start:start + m * n].view(m, n)

    def release(self) -> None:
        if self.m_workspace is not None:
            self.m_workspace.free(self.m_offset)
            self.m_workspace = None


@dataclasses.dataclass(frozen=True)
class Stream:
    name: str
    device: str


_gpu_memory_arenas: dict = {}


def gpu_memory_arenas() -> dict:
    return _gpu_memory_arenas


def allocate_workspace(stream: Stream, n_bytes: int) -> Allocation:
    arena = gpu_memory_arenas().setdefault(stream, GPUMemoryArena(stream.device))
    return Allocation(stream, arena.allocate(n_bytes), arena)


def allocate_workspace_and_distribute(stream: Stream, shapes) -> tuple:
    """One allocation holding a cacheline-aligned matrix per ``(m, n)`` shape."""
    offsets, total = [], 0
    for m, n in shapes:
        offsets.append(total)
        total += align_to_cacheline(m * n)
    alloc = allocate_workspace(stream, total)
    return alloc, tuple(alloc.matrix(off, m, n) for off, (m, n) in zip(offsets, shapes))


class GPUMatrix:
    """A matrix borrowed from the stream's arena (``GPUMatrix<T>{m, n, stream}``); ``release`` is its destructor."""

    def __init__(self, m: int, n: int, stream: Stream) -> None:
        self.alloc = allocate_workspace(stream, m * n)
        self.t = self.alloc.matrix(0, m, n)

    def release(self) -> None:
        self.alloc.release()


# --- src/cutlass_mlp.cu, losses/l2.h, trainer.h ---------------------------------------------------------------------

class ForwardContext:
    def __init__(self) -> None:
        self.hidden: list = []

    def reset(self) -> None:
        for h in self.hidden:
            h.release()
        self.hidden = []


class CutlassMLP:
    def __init__(self) -> None:
        self.m_network_width, self.m_n_hidden_layers = NETWORK_WIDTH, N_HIDDEN_LAYERS
        self.shapes = ([(NETWORK_WIDTH, N_INPUT_DIMS)] + [(NETWORK_WIDTH, NETWORK_WIDTH)] * (N_HIDDEN_LAYERS - 1)
                       + [(N_OUTPUT_DIMS, NETWORK_WIDTH)])

    def n_params(self) -> int:
        return sum(m * n for m, n in self.shapes)

    def num_forward_activations(self) -> int:
        return self.m_n_hidden_layers

    def weight_matrices(self, params: Tensor) -> list:
        out, off = [], 0
        for m, n in self.shapes:
            out.append(params[off:off + m * n].view(m, n))
            off += m * n
        return out

    def allocate_forward_buffers(self, stream: Stream, batch_size: int) -> ForwardContext:
        forward = ForwardContext()
        forward.hidden = [GPUMatrix(self.m_network_width, batch_size, stream)
                          for _ in range(self.num_forward_activations())]
        return forward

    def forward(self, stream: Stream, input: Tensor, output: Tensor, params: Tensor) -> ForwardContext:
        forward = self.allocate_forward_buffers(stream, input.shape[1])
        weights = self.weight_matrices(params)
        x = input
        for w, h in zip(weights[:-1], forward.hidden):
            h.t.copy_(torch.relu(w @ x))                 # compute_layer<FullLayer> (ReLU)
            x = h.t
        output.copy_(weights[-1] @ x)                    # compute_layer<LastLayer> (no output activation)
        return forward

    def backward(self, stream: Stream, ctx: ForwardContext, input: Tensor, dL_doutput: Tensor, params: Tensor,
                 gradients: Tensor) -> None:
        batch_size = dL_doutput.shape[1]
        backward_tmp = [GPUMatrix(self.m_network_width, batch_size, stream)
                        for _ in range(self.num_forward_activations())]
        weights, grads = self.weight_matrices(params), self.weight_matrices(gradients)
        hidden = [h.t for h in ctx.hidden]
        grads[-1].copy_(dL_doutput @ hidden[-1].T)       # output-layer weight gradient
        delta = dL_doutput
        for i in range(len(hidden) - 1, -1, -1):
            tmp = backward_tmp[len(hidden) - 1 - i].t
            tmp.copy_((weights[i + 1].T @ delta) * (hidden[i] > 0))
            below = hidden[i - 1] if i > 0 else input
            grads[i].copy_(tmp @ below.T)
            delta = tmp
        for tmp in backward_tmp:
            tmp.release()


class L2Loss:
    def evaluate(self, stream: Stream, loss_scale: float, prediction: Tensor, target: Tensor, values: Tensor,
                 gradients: Tensor) -> None:
        n_total = prediction.numel()
        difference = prediction - target
        values.copy_(difference * difference / n_total)
        gradients.copy_(loss_scale * 2 * difference / n_total)


class SGDOptimizer:
    """Stand-in for the trainer's optimizer (upstream Adam): one eager step after the captured training step."""

    def step(self, stream: Stream, loss_scale: float, params: Tensor, gradients: Tensor) -> None:
        params.sub_(gradients * (LEARNING_RATE / loss_scale))


def reduce_sum(t: Tensor, stream: Stream) -> float:
    return float(t.sum().item())                         # the loss read back on the host, after the launch


class Trainer:
    def __init__(self, model: CutlassMLP, optimizer: SGDOptimizer, loss: L2Loss, device: str) -> None:
        self.m_model, self.m_optimizer, self.m_loss = model, optimizer, loss
        gen = generator(587)
        n = model.n_params()
        self.m_params = (torch.randn(n, generator=gen, dtype=DTYPE) * 0.4).to(device)
        self.m_param_gradients = torch.zeros(n, dtype=DTYPE, device=device)
        self.m_graph = CudaGraph()
        self.device = device
        self.m_training_prediction_tmp = torch.zeros(N_OUTPUT_DIMS, 0, dtype=DTYPE, device=device)
        self.m_training_loss_gradient_tmp = self.m_training_loss_tmp = self.m_training_prediction_tmp
        self.m_training_ctx = None

    def allocate_training_buffers(self, padded_output_width: int, batch_size: int) -> None:
        def z():
            return torch.zeros(padded_output_width, batch_size, dtype=DTYPE, device=self.device)
        self.m_training_prediction_tmp, self.m_training_loss_gradient_tmp, self.m_training_loss_tmp = z(), z(), z()

    def forward(self, stream: Stream, input: Tensor) -> None:
        self.m_training_ctx = self.m_model.forward(stream, input, self.m_training_prediction_tmp, self.m_params)

    def evaluate_loss(self, stream: Stream, loss_scale: float, target: Tensor) -> None:
        self.m_loss.evaluate(stream, loss_scale, self.m_training_prediction_tmp, target, self.m_training_loss_tmp,
                             self.m_training_loss_gradient_tmp)

    def backward(self, stream: Stream, input: Tensor) -> None:
        self.m_model.backward(stream, self.m_training_ctx, input, self.m_training_loss_gradient_tmp, self.m_params,
                              self.m_param_gradients)
        self.m_training_ctx.reset()
        self.m_training_ctx = None

    def optimizer_step(self, stream: Stream, loss_scale: float) -> None:
        self.m_optimizer.step(stream, loss_scale, self.m_params, self.m_param_gradients)

    def training_step(self, stream: Stream, input: Tensor, target: Tensor) -> float:
        batch_size = input.shape[1]
        did_allocate = False
        if self.m_training_prediction_tmp.shape[1] != batch_size:
            self.allocate_training_buffers(N_OUTPUT_DIMS, batch_size)
            did_allocate = True

        def step():
            self.forward(stream, input)
            self.evaluate_loss(stream, LOSS_SCALE, target)
            self.backward(stream, input)
            return self.m_training_loss_tmp

        self.m_graph.capture_and_execute(stream, did_allocate, step)
        self.optimizer_step(stream, LOSS_SCALE)
        return reduce_sum(self.m_training_loss_tmp, stream)


# --- the caller: a stand-in for instant-ngp's testbed ----------------------------------------------------------------

class Testbed:
    def __init__(self, device: str) -> None:
        self.device = device
        self.m_training_stream = Stream("training", device)
        self.m_trainer = Trainer(CutlassMLP(), SGDOptimizer(), L2Loss(), device)
        gen = generator(1422)
        self.dataset_rays = [torch.randn(MAX_RAYS, 6, generator=gen, dtype=DTYPE).to(device)
                             for _ in RAYS_PER_BATCH]
        self.scene = (torch.randn(N_OUTPUT_DIMS, N_INPUT_DIMS, generator=gen, dtype=DTYPE) * 0.7).to(device)

    def train_nerf_step(self, target_batch_size: int, n_rays_per_batch: int, step: int) -> float:
        stream = self.m_training_stream
        alloc, (rays, coords, targets) = allocate_workspace_and_distribute(
            stream, ((n_rays_per_batch, 6), (N_INPUT_DIMS, target_batch_size), (N_OUTPUT_DIMS, target_batch_size)))
        rays.copy_(self.dataset_rays[step][:n_rays_per_batch])
        # the ray marcher (stand-in): the batch's samples taken in turn along the rays, at t = 0.25, 0.5, ...
        sample = torch.arange(target_batch_size, device=self.device)
        ray = rays[sample % n_rays_per_batch]
        t = ((sample // n_rays_per_batch + 1) * 0.25).to(DTYPE).unsqueeze(1)
        coords.copy_(torch.cat([ray[:, :3] + t * ray[:, 3:], t], dim=1).T)
        targets.copy_(torch.tanh(self.scene @ coords))    # the scene's colour and density at the samples
        loss = self.m_trainer.training_step(stream, coords, targets)
        alloc.release()
        return loss

    def train(self) -> list:
        losses = [self.train_nerf_step(TARGET_BATCH_SIZE, n_rays, step) for step, n_rays in enumerate(RAYS_PER_BATCH)]
        return [torch.tensor(losses, dtype=DTYPE), self.m_trainer.m_params.clone()]


def train(device: str, enable_cuda_graphs: bool) -> list:
    global _graphs_enabled
    _graphs_enabled = enable_cuda_graphs
    gpu_memory_arenas().clear()            # a fresh process: no arena yet
    current_captures().clear()
    try:
        return Testbed(device).train()
    finally:
        _graphs_enabled = True
        gpu_memory_arenas().clear()
        current_captures().clear()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: train(device, enable_cuda_graphs=True),
                       lambda: train(device, enable_cuda_graphs=False))
    finally:
        _variant = "bug"
