"""triton_kernels' per-stream scratch allocator replaces its cached buffer with a bigger one; an earlier graph still writes its TMA descriptors into the freed one.

Upstream: https://github.com/triton-lang/triton/pull/9259 ("[triton_kernels] Fix device descriptor allocator to keep
a pool", Mogball, approved by ThomasRaoux, merged 2026-01-20; no issue). The PR's words: "Suppose during graph
capture, an 8 KB tensor is allocated as Triton scratch memory. It is recorded in the CUDA graph. However, if the
allocator needs to resize and allocators 16 KB, the previous tensor is decref'd and gc'd by Python. When replaying the
CUDA graph, the first 8 KB tensor that was captured is now dangling."
Symptom: a model whose matmuls run triton_kernels' persistent (TMA) kernel, served with one CUDA graph per batch
size: once a graph for a larger batch has been captured, replaying a graph for a smaller batch corrupts memory or
hits an illegal memory access / TMA descriptor fault. Eager is correct.
Mechanism: ``matmul`` (triton_kernels/matmul.py) installs ``triton.set_allocator(get_per_device_per_stream_alloc_fn(
a.device))`` whenever the persistent kernel is chosen. ``_p_matmul`` builds a device-side TMA descriptor for its
output (``Y = tl.make_tensor_descriptor(YPtr, Y.shape, Y.strides[:-1] + (1,), Y.block_shape)``), so every launch asks
the allocator for ``global_scratch_size * grid`` bytes of global scratch, where each program writes its descriptor
and the epilogue stores through it; the persistent grid is ``min(num_SMs, tiles)``, so a bigger batch needs more.
``get_per_device_per_stream_alloc_fn``'s inner ``alloc_fn(size, alignment, stream)`` caches one int8 tensor per
stream and, when it is too small, replaces the dict entry with a bigger ``torch.empty``: the old tensor loses its
last reference (Triton's launcher keeps none) and is freed. A graph captured earlier on that stream baked the old
scratch address into its ``_p_matmul`` launches, so each of its replays writes descriptors into, and reads them back
from, memory its owner released. Eager launches always use the tensor just returned (stream-ordered frees are safe).
Doctor: dangling-reference, at alloc_fn (its grow path drops the cached scratch tensor that the graph captured for the
smaller batch still addresses; every later replay of that graph reads and writes memory whose owner released it).
Fix (upstream): ``_per_stream_tensors = collections.defaultdict(list)``; ``alloc_fn`` appends a bigger tensor instead
of replacing the old one and returns ``tensors[-1]``, so every scratch buffer ever handed out stays alive.
Modelled: the dense (no routing) persistent path of ``matmul`` in a 2-layer MLP (up and down projections, SiLU),
fp32, with only the Y descriptor in device scratch (128 bytes a program) holding Y's shape and strides (not its
address); ``_p_matmul`` runs program by program with torch ops, tiles stored through the descriptor read back from
scratch (TMA's bounds clip kept, clamped). NUM_SMS = 4, BLOCK_M = 2, BLOCK_N = 4. The runner captures one graph per
decode batch size in ascending order (the PR's 8 KB-then-16 KB case), warming up and capturing on one capture stream
(as vLLM's ``graph_capture`` does), and then frees cached memory (``empty_cache``); the launcher's ``stream``
argument is that stream's handle. A profile run at the token budget (eager, default stream) precedes capture, and
prefill runs eagerly on the default stream, whose scratch is therefore never regrown. On CUDA each scratch tensor is
the head of a 16 MiB allocation (a segment of its own) so that ``release_to_driver`` unmaps it once freed and the
stale replay (the first step after capture) faults before any later allocation could map that address again; on
the CPU the emulation raises ``IllegalMemoryAccess``.
"""
from __future__ import annotations

import collections
import contextlib

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, release_to_driver, replay

UPSTREAM = "https://github.com/triton-lang/triton/pull/9259"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "alloc_fn"
SYMPTOM = ("after a larger batch's capture regrows triton_kernels' per-stream scratch, the smaller batch's graph "
           "writes and reads its TMA descriptors in the freed scratch")

HIDDEN, INTERMEDIATE, NUM_LAYERS = 8, 8, 2
NUM_SMS = 4                                   # torch.cuda.get_device_properties(0).multi_processor_count
BLOCK_M, BLOCK_N = 2, 4
TMA_DESC_BYTES = 128                          # one CUtensorMap; global_scratch_size of _p_matmul per program
CUDA_GRAPH_BATCH_SIZES = [2, 4]
MAX_NUM_TOKENS = 6
DEFAULT_STREAM, GRAPH_CAPTURE_STREAM = 0, 1   # stream handles the launcher passes to the allocator
SEGMENT_BYTES = 16 << 20                      # CUDA only: >= 10 MiB and a 2 MiB multiple, a segment of its own


# --- triton/runtime/_allocation.py + the launcher (what matters here) ---------------------------------------------

class _Runtime:
    allocator = None                          # triton.set_allocator's ContextVar
    stream = DEFAULT_STREAM                   # torch.cuda.current_stream().cuda_stream


def set_allocator(alloc_fn):
    _Runtime.allocator = alloc_fn


@contextlib.contextmanager
def graph_capture():
    """vLLM's ``graph_capture``: warmups and captures all run on one dedicated stream."""
    previous, _Runtime.stream = _Runtime.stream, GRAPH_CAPTURE_STREAM
    try:
        yield
    finally:
        _Runtime.stream = previous


def launch_p_matmul(grid, **kwargs):
    """The kernel launcher: a kernel with device-side descriptors needs ``global_scratch_size`` bytes per program."""
    alloc_size = grid * TMA_DESC_BYTES
    global_scratch = _Runtime.allocator(alloc_size, 128, _Runtime.stream)
    _p_matmul(grid, global_scratch=global_scratch, **kwargs)
    # the launcher keeps no reference to global_scratch


def _torch_empty_int8(size, device):
    """``torch.empty(size, dtype=torch.int8)``; on CUDA the head of a block that owns its segment (see Modelled)."""
    if torch.device(device).type == "cuda":
        return torch.empty(max(size, SEGMENT_BYTES), device=device, dtype=torch.int8)[:size]
    return torch.empty(size, device=device, dtype=torch.int8)


# --- triton_kernels/matmul_details/_p_matmul.py -------------------------------------------------------------------

def make_tensor_descriptor(global_scratch, pid, shape, strides):
    """``tl.make_tensor_descriptor``: the program writes the descriptor into its slot of global scratch."""
    desc = global_scratch[pid * TMA_DESC_BYTES:pid * TMA_DESC_BYTES + 16].view(torch.int32)
    desc[0].fill_(shape[0])
    desc[1].fill_(shape[1])
    desc[2].fill_(strides[0])
    desc[3].fill_(strides[1])
    return desc


def descriptor_store(desc, YPtr, off_m, off_n, out):
    """``Y.store([off_m, off_n], out)``: the TMA unit addresses the tile from the descriptor's shape and strides."""
    offs_m = torch.arange(off_m, off_m + BLOCK_M, device=YPtr.device)
    offs_n = torch.arange(off_n, off_n + BLOCK_N, device=YPtr.device)
    in_bounds = (offs_m[:, None] < desc[0]) & (offs_n[None, :] < desc[1])
    offs = (offs_m[:, None] * desc[2] + offs_n[None, :] * desc[3]).long()
    offs = torch.where(in_bounds, offs, 0).clamp(0, YPtr.numel() - 1)
    YPtr.view(-1).scatter_(0, offs.view(-1), out.reshape(-1))


def _p_matmul(grid, *, Y, X, W, M, N, K, grid_m, grid_n, NUM_SMS, global_scratch, ACTIVATION_FN=None):
    for pid in range(grid):                                       # tl.program_id(0)
        # why is this faster than using host-side tensor descriptor?!
        Yd = make_tensor_descriptor(global_scratch, pid, (M, N), (Y.stride(0), 1))
        num_blocks = grid_m * grid_n
        for block_id in range(pid, num_blocks, NUM_SMS):
            pid_m, pid_n = divmod(block_id, grid_n)
            off_m, off_n = BLOCK_M * pid_m, BLOCK_N * pid_n
            acc = X[off_m:off_m + BLOCK_M] @ W[:, off_n:off_n + BLOCK_N]
            if ACTIVATION_FN is not None:
                acc = ACTIVATION_FN(acc)
            descriptor_store(Yd, Y, off_m, off_n, acc)


_per_device_alloc_fns = {}


def get_per_device_per_stream_alloc_fn(device, variant):
    if device not in _per_device_alloc_fns:
        if variant == "bug":
            _per_stream_tensors = {}

            def alloc_fn(size: int, alignment: int, stream):
                assert alignment == 128
                if stream not in _per_stream_tensors or _per_stream_tensors[stream].numel() < size:
                    _per_stream_tensors[stream] = _torch_empty_int8(size, device)   # the old one is freed
                    _per_stream_tensors[stream].__hibernate__ = {"type": "ignore"}
                return _per_stream_tensors[stream]
        else:
            _per_stream_tensors = collections.defaultdict(list)

            def alloc_fn(size: int, alignment: int, stream: int):
                assert alignment == 128
                tensors = _per_stream_tensors[stream]
                if not tensors or tensors[-1].numel() < size:
                    tensors.append(_torch_empty_int8(size, device))
                    tensors[-1].__hibernate__ = {"type": "ignore"}
                return tensors[-1]

        _per_device_alloc_fns[device] = alloc_fn
    return _per_device_alloc_fns[device]


# --- triton_kernels/matmul.py (dense, persistent path) ------------------------------------------------------------

def matmul(a, b, variant, fused_activation=None):
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, device=a.device)
    grid_m, grid_n = -(-M // BLOCK_M), -(-N // BLOCK_N)
    grid = grid_m * grid_n
    is_persistent = True                                        # opt_flags: TMA-capable target
    if is_persistent:
        grid = min(NUM_SMS, grid)
        set_allocator(get_per_device_per_stream_alloc_fn(a.device, variant))
    launch_p_matmul(grid, Y=c, X=a, W=b, M=M, N=N, K=K, grid_m=grid_m, grid_n=grid_n, NUM_SMS=grid,
                    ACTIVATION_FN=fused_activation)
    return c


# --- the model and its runner -------------------------------------------------------------------------------------

class MLP:
    def __init__(self, gen, device):
        self.w_up = randn(HIDDEN, INTERMEDIATE, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.w_down = randn(INTERMEDIATE, HIDDEN, gen=gen, device=device, scale=INTERMEDIATE ** -0.5)


class Model:
    def __init__(self, device, variant):
        gen = generator(9259)
        self.variant = variant
        self.layers = [MLP(gen, device) for _ in range(NUM_LAYERS)]

    def forward(self, hidden_states):
        h = hidden_states
        for layer in self.layers:
            up = matmul(F.layer_norm(h, (HIDDEN,)), layer.w_up, self.variant, fused_activation=F.silu)
            h = h + matmul(up, layer.w_down, self.variant)
        return h


class CUDAGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.graphs, self.inputs, self.outputs = {}, {}, {}

    def capture_model(self):
        with graph_capture():
            for bs in CUDA_GRAPH_BATCH_SIZES:
                x = torch.zeros(bs, HIDDEN, device=self.device)
                self.inputs[bs] = x
                self.graphs[bs], self.outputs[bs] = capture(
                    lambda x=x: self.model.forward(x), device=self.device, name=f"decode bs {bs}",
                    owner="CUDAGraphRunner", static={"hidden_states": x})
        release_to_driver(self.device)                 # the serving process frees cached memory after capture

    def profile_run(self, num_tokens):
        """A dummy eager forward at the token budget before capture (default stream)."""
        self.model.forward(torch.zeros(num_tokens, HIDDEN, device=self.device))

    def execute(self, hidden_states):
        bs = hidden_states.shape[0]
        if bs in self.graphs:
            self.inputs[bs].copy_(hidden_states)
            return replay(self.graphs[bs], self.outputs[bs]).clone()
        return self.model.forward(hidden_states).clone()        # prefill: eager, default stream


def run(variant: str, device: str = "cpu"):
    gen = generator(92590)
    steps = [2, 4, 2, MAX_NUM_TOKENS, 2, 4]                     # decode batches, a prefill, decode batches
    hidden = [randn(m, HIDDEN, gen=gen, device=device) for m in steps]

    def serve(graphed: bool):
        _per_device_alloc_fns.clear()                           # a fresh process
        runner = CUDAGraphRunner(Model(device, variant), device)
        runner.profile_run(MAX_NUM_TOKENS)
        if graphed:
            runner.capture_model()
        return [runner.execute(h) for h in hidden]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
