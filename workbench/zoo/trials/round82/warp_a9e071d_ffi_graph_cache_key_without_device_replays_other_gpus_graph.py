"""Warp's JAX FFI ``jax_callable`` (``GraphMode.WARP``) keys its graph cache on the call id and the buffer addresses only: under ``pmap`` a second GPU whose XLA buffers sit at the same addresses launches the first GPU's captured graph.

Upstream: https://github.com/NVIDIA/warp/commit/a9e071dd9479548694680dcb598151dd3bc87a85 ("Fix MJX-Warp FFI
Multi-GPU Deadlock", Adityakk9031, NVIDIA/warp; authored 2026-01-16, on ``main`` 2026-01-21 through Warp's GitLab
mirror, which is why https://github.com/NVIDIA/warp/pull/1181 shows "closed"), for
https://github.com/google-deepmind/mujoco/issues/2980 ("MJX: Warp FFI sometimes deadlocks when ``donate_argnums`` is
present in ``pmap``").
Symptom: Brax PPO with MJX ``impl='warp'`` on 8xA100 hangs in ``jax.pmap(training_epoch, donate_argnums=(0, 1))``
after O(1e7) training steps. With ``impl='jax'`` it trains. The PR: "identical virtual addresses can be assigned to
buffers on different devices ... a CUDA graph captured on one device was incorrectly retrieved and launched on
another device, causing silent deadlocks". No error is raised. The other GPU's step never runs on its own buffers.
Mechanism: ``warp/_src/jax_experimental/ffi.py``, ``FfiCallable.ffi_callback`` (XLA calls it once per device and
step, serialised by ``_FFI_CALLBACK_LOCK``). With ``graph_mode == GraphMode.WARP`` it builds
``capture_key = hash((call_id, *ip, *op))`` from the ``call_id`` attribute (set once, when ``__call__`` traced the
call: the same for every device of a ``pmap``) and the raw ``data`` pointers of the array inputs and outputs, and
looks it up in ``self.captures`` (an LRU ``OrderedDict``, ``graph_cache_max`` 32). On a hit it runs
``wp_cuda_graph_launch(capture.graph.graph_exec, cuda_stream)`` and returns early. On a miss it rebuilds ``wp.array``
views of the buffers on ``wp.get_cuda_device(device_ordinal)``, captures ``self.func(*arg_list)`` in
``wp.ScopedCapture()``, launches it with ``wp.capture_launch`` and stores it under the key. The key does not hold
the device. Each device's XLA allocator places the same program's buffers at the same addresses (the PR: "Memory
addresses are only unique per-device"). ``donate_argnums`` makes every step reuse the donated blocks, so the same
few address tuples come back every step. Device 1's call then finds device 0's graph and launches it. That graph
reads device 0's inputs and writes device 0's outputs. Device 1's output buffers keep whatever the allocator's
blocks held before.
Doctor: warmup-divergence, at ffi_callback. The capture on device 0 fixed the graph's buffer references. The cache
lookup in ``ffi_callback`` decides that device 1's call is that captured call, so device 1's replays run device 0's
frozen bindings. The eager step (``GraphMode.NONE``) computes on device 1's own buffers. Nothing is stale or freed:
every buffer the graph touches is live and freshly written. The function that makes the wrong match is
``ffi_callback``, and the fix changes only its key.
Fix (upstream): ``device_ordinal = get_device_ordinal_from_callframe(call_frame.contents)`` before the graph-mode
branch, and ``capture_key = hash((device_ordinal, call_id, *ip, *op))``. Each device captures and replays its own
graphs.
Modelled: two GPUs of a ``pmap``ped MJX-like step. The Warp function ``step`` is one semi-implicit Euler kernel
(a damped spring) that reads ``qpos``, ``qvel`` and writes ``qpos_out``, ``qvel_out``. It is a ``jax_callable``
with two outputs and no in-out arguments. ``pmap`` runs device 0 and then device 1 (``_FFI_CALLBACK_LOCK`` serialises
the callbacks). Each device has its own first-fit ``BFCAllocator`` over the same virtual range. Its memory is a
table from address to a tensor, and a reused block keeps what it held. The step outputs are allocated before the
donated inputs are freed, so the buffers alternate between two address pairs. The real collision needed O(1e7)
steps. Here the allocators are identical, so it happens on the first step. ``XLA_FFI_CallFrame`` is reduced to
``call_id``, the buffers, the stream and the device ordinal. ``wp.ScopedCapture`` / ``wp.capture_launch`` /
``wp_cuda_graph_launch`` are an engine graph captured without warm-up and replayed. On real GPUs the stray graph
runs on device 0's context from device 1's stream, which the report saw as a hang. Here it re-runs device 0's step
on device 0's buffers, and device 1's state is never advanced. Staged graph modes, in-out aliasing, the metadata
query, vmap and module preloading are left out.
"""
from __future__ import annotations

import collections
from enum import IntEnum

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/a9e071dd9479548694680dcb598151dd3bc87a85"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "ffi_callback"
SYMPTOM = ("jax_callable GraphMode.WARP graph cache keyed on (call_id, buffer pointers) only: under pmap with "
           "donate_argnums a second GPU with colliding buffer addresses launches the first GPU's graph; its own "
           "outputs are never computed (the report: training hangs after ~1e7 steps)")

NUM_DEVICES, NWORLD, NQ, STEPS = 2, 4, 3, 5
DT, STIFFNESS, DAMPING = 0.05, 4.0, 0.3
BLOCK = 0x200                                     # bytes of one XLA buffer block ([NWORLD, NQ] float32, rounded)
BASE = 0x7F1234560000                             # every device's allocator reserves the same virtual range


class GraphMode(IntEnum):
    NONE = 0
    JAX = 1
    WARP = 2


# --- XLA: per-device buffers, call frames and pmap ---------------------------------------------------------------

class BFCAllocator:
    """One GPU's XLA allocator: first-fit blocks in a virtual range. Addresses are unique only on this device."""

    def __init__(self, ordinal, device):
        self.ordinal, self.device = ordinal, device
        self.memory: dict[int, torch.Tensor] = {}             # address -> the device memory there
        self.live: set[int] = set()

    def allocate(self) -> int:
        ptr = BASE
        while ptr in self.live:
            ptr += BLOCK
        if ptr not in self.memory:                            # a fresh block: cudaMalloc'd, never written
            self.memory[ptr] = torch.zeros(NWORLD, NQ, device=self.device)
        self.live.add(ptr)
        return ptr

    def deallocate(self, ptr: int) -> None:
        self.live.discard(ptr)                                # the block keeps its contents


class XLA_FFI_Buffer:
    def __init__(self, data: int, dims):
        self.data, self.dims = data, tuple(dims)


class XLA_FFI_CallFrame:
    def __init__(self, call_id, args, rets, stream, device_ordinal):
        self.attrs = {"call_id": call_id}
        self.args, self.rets = args, rets
        self.stream, self.device_ordinal = stream, device_ordinal


def get_stream_from_callframe(call_frame):
    return call_frame.stream


def get_device_ordinal_from_callframe(call_frame):
    return call_frame.device_ordinal                          # XLA_FFI_DeviceOrdinal_Get


# --- warp: devices, arrays, capture --------------------------------------------------------------------------------

class Device:
    def __init__(self, ordinal, allocator):
        self.ordinal, self.allocator = ordinal, allocator


class wp:
    """The pieces of ``warp`` the callback uses."""

    devices: list[Device] = []

    @staticmethod
    def get_cuda_device(ordinal) -> Device:
        return wp.devices[ordinal]

    @staticmethod
    def array(ptr, shape, device: Device) -> torch.Tensor:
        """``wp.array(ptr=..., device=...)``: a view of the memory at ``ptr`` on ``device``."""
        return device.allocator.memory[ptr].view(shape)


class ScopedCapture:
    """``wp.ScopedCapture()`` + ``wp.capture_launch``: capture ``self.func`` once, launch the graph."""

    def __init__(self, func, arg_list, outputs, device: Device):
        self.outputs = tuple(outputs)
        self.graph, _ = capture(lambda: func(*arg_list), device=str(outputs[0].device), warmups=0,
                                name=f"jax_callable graph (cuda:{device.ordinal})",
                                static={"qpos": arg_list[0], "qvel": arg_list[1]},
                                owner=f"FfiCallable GraphMode.WARP (cuda:{device.ordinal})")


def wp_cuda_graph_launch(capture: ScopedCapture, cuda_stream) -> bool:
    """Launch the captured executable graph: it runs on the buffers it was captured with, whatever the stream."""
    replay(capture.graph, capture.outputs)
    return True


# --- the Warp function (an MJX-like step) ------------------------------------------------------------------------

def step(qpos, qvel, qpos_out, qvel_out):
    """``wp.launch(euler_kernel, ...)``: semi-implicit Euler of a damped spring, one thread per (world, dof)."""
    qvel_out.copy_(qvel + DT * (-STIFFNESS * qpos - DAMPING * qvel))
    qpos_out.copy_(qpos + DT * qvel_out)


# --- warp/_src/jax_experimental/ffi.py ---------------------------------------------------------------------------

class FfiCallDesc:
    def __init__(self, static_inputs):
        self.static_inputs = static_inputs


class FfiCallable:
    default_graph_cache_max = 32

    def __init__(self, func, num_outputs, graph_mode, variant):
        self.func = func
        self.num_outputs = num_outputs
        self.num_inputs = 2
        self.graph_mode = graph_mode
        self.call_id = 0
        self.call_descriptors = {}
        self._graph_cache_max = FfiCallable.default_graph_cache_max
        self.captures = collections.OrderedDict()             # LRU cache of graphs captured by Warp
        self.array_input_indices = [0, 1]
        self.array_output_indices = list(range(0, num_outputs))
        self._variant = variant

    def __call__(self):
        """Tracing (once per ``pmap``): the call gets one ``call_id``, the same on every device."""
        call_id = self.call_id
        self.call_descriptors[call_id] = FfiCallDesc({})
        self.call_id += 1
        return call_id

    def ffi_callback(self, call_frame):
        call_id = call_frame.attrs["call_id"]
        inputs, outputs = call_frame.args, call_frame.rets
        cuda_stream = get_stream_from_callframe(call_frame)
        if self._variant == "fix":
            device_ordinal = get_device_ordinal_from_callframe(call_frame)

        if self.graph_mode == GraphMode.WARP:
            # check if we already captured an identical call
            ip = [inputs[i].data for i in self.array_input_indices]
            op = [outputs[i].data for i in self.array_output_indices]
            if self._variant == "fix":
                capture_key = hash((device_ordinal, call_id, *ip, *op))
            else:
                capture_key = hash((call_id, *ip, *op))
            capture = self.captures.get(capture_key)

            # launch existing graph
            if capture is not None:
                if not wp_cuda_graph_launch(capture, cuda_stream):
                    raise RuntimeError("Graph launch error")
                # update the graph cache to keep recently used graphs alive
                self.captures.move_to_end(capture_key)
                # early out
                return

        device_ordinal = get_device_ordinal_from_callframe(call_frame)
        device = wp.get_cuda_device(device_ordinal)

        # reconstruct the argument list
        arg_list = [wp.array(inputs[i].data, inputs[i].dims, device) for i in range(self.num_inputs)]
        out_arrays = [wp.array(outputs[i].data, outputs[i].dims, device) for i in range(self.num_outputs)]
        arg_list += out_arrays

        if self.graph_mode == GraphMode.WARP:
            # capturing with WARP
            capture = ScopedCapture(self.func, arg_list, out_arrays, device)
            wp_cuda_graph_launch(capture, cuda_stream)            # wp.capture_launch(capture.graph)
            # keep a reference to the capture object and reuse it with same buffers
            self.captures[capture_key] = capture
            # respect the cache size limit if specified
            if self._graph_cache_max is not None and len(self.captures) > self._graph_cache_max:
                self.captures.popitem(last=False)
        else:
            self.func(*arg_list)


def jax_callable(func, num_outputs, graph_mode, variant):
    return FfiCallable(func, num_outputs, graph_mode, variant)


# --- the training loop: pmap(step, donate_argnums=(0, 1)) --------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    def serve(graph_mode):
        allocators = [BFCAllocator(d, device) for d in range(NUM_DEVICES)]
        wp.devices = [Device(d, allocators[d]) for d in range(NUM_DEVICES)]
        warp_step = jax_callable(step, num_outputs=2, graph_mode=graph_mode, variant=variant)
        call_id = warp_step()                                 # traced once for the pmap

        gen = generator(2980)
        state = []                                            # per device: (qpos ptr, qvel ptr)
        for d in range(NUM_DEVICES):                          # device_put of each device's shard
            qpos, qvel = allocators[d].allocate(), allocators[d].allocate()
            allocators[d].memory[qpos].copy_(randn(NWORLD, NQ, gen=gen, device=device))
            allocators[d].memory[qvel].copy_(randn(NWORLD, NQ, gen=gen, device=device, scale=0.5))
            state.append((qpos, qvel))

        trajectory = []
        for _ in range(STEPS):
            new_state = []
            for d in range(NUM_DEVICES):                      # pmap: one callback per device, under the lock
                alloc = allocators[d]
                qpos, qvel = state[d]
                qpos_out, qvel_out = alloc.allocate(), alloc.allocate()
                dims = (NWORLD, NQ)
                frame = XLA_FFI_CallFrame(call_id, [XLA_FFI_Buffer(qpos, dims), XLA_FFI_Buffer(qvel, dims)],
                                          [XLA_FFI_Buffer(qpos_out, dims), XLA_FFI_Buffer(qvel_out, dims)],
                                          stream=f"cudaStream(cuda:{d})", device_ordinal=d)
                warp_step.ffi_callback(frame)
                alloc.deallocate(qpos)                        # donate_argnums=(0, 1): the inputs are freed
                alloc.deallocate(qvel)
                new_state.append((qpos_out, qvel_out))
            state = new_state
            trajectory += [allocators[d].memory[p].clone() for d in range(NUM_DEVICES) for p in state[d]]
        return trajectory

    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(GraphMode.WARP), lambda: serve(GraphMode.NONE))
