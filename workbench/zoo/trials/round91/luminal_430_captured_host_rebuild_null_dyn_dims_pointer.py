"""Luminal CUDA Lite: a full CUDA-graph rebuild after a captured HostOp's pointer changes parameterizes every dynamic kernel with a null dyn-dims pointer.

Upstream: https://github.com/luminal-ai/luminal/pull/430 ("Restore CUDA dyn-dims buffer on graph rebuild", merged
2026-09-02). Read: the PR description; the description of the follow-up PR #492 ("CUDA dyn dims on graph rebuild
(#430): parked, ..."), which states the mechanism; and a later stored version of the fixed file
``crates/luminal_cuda_lite/src/kernel/to_host.rs`` (``CudaGraphOpState``, ``reset_materialization_state``,
``dyn_dims_ptr``, ``materialize_impl`` with the fix's re-allocation block and its comment). Not read: the merge diff
itself (no snapshot of that commit was available), ``build_graph``'s body, or an issue (none is linked).
Symptom: serving (GPT-OSS through luminal's CUDA Lite runtime) fails at the first step after an integration
replaces an external pointer consumed by a captured HostOp (a cuBLASLt / FlashInfer child graph): the rebuilt CUDA
graph launches its dynamic kernels against device address 0 for their dyn-dims argument.
Mechanism: ``CudaGraphOp::materialize_impl`` keeps one graph-owned ``dyn_dims_buffer`` (the device vector of the
live dynamic dimensions, in ``dyn_dims_order``) that every kernel with ``has_dyn_dims_param`` reads at launch: the
kernel parameter is that buffer's pointer, the values are re-uploaded (``memcpy_htod``) whenever ``dyn_map``
changes, so dimension changes need no graph update. Captured HostOps bake their pointer arguments into child graphs,
so when ``changed_buffer_nodes`` hits ``captured_host_buffer_nodes`` the whole materialization is thrown away:
``reset_materialization_state`` drops the graph exec and graph, clears ``kernel_params``/``last_buffer_ptrs`` and
also sets ``state.dyn_dims_buffer = None`` (the buffer is released). The "allocate dyn_dims_buffer if needed" step
of ``materialize_impl`` has already run for this call, so nothing allocates it again: ``build_graph`` and the first
binding update build every dynamic kernel's parameters with ``dyn_dims_ptr(state)``, which is
``shared_dyn_dims_ptr.unwrap_or(dyn_dims_buffer ptr).unwrap_or(0)`` = 0. Every replay of the replacement graph then
reads the dimensions from address 0.
Doctor: dangling-reference, at materialize_impl (the reset releases the graph-owned dyn-dims buffer and the
replacement graph is built pointing at no live allocation for it: its replays read memory nobody owns).
Fix (upstream): in ``materialize_impl``, right after the reset on the captured-HostOp pointer rebuild and before
``build_graph``: when the op has dynamic dimensions and no bucket-shared pointer (``shared_dyn_dims_ptr``, which
survives the reset), allocate a new ``dyn_dims_buffer`` (``alloc_zeros(dyn_dims_order.len())``), fill it from
``dyn_dims_order`` and the live ``dyn_map`` (``memcpy_htod``) and store it in the state.
Modelled: one ``CudaGraphOp`` with one captured HostOp (a cuBLASLt matmul ``h = x @ w``, ``w`` an external pointer
registered by the integration) and one dynamic kernel (``masked_scale``: rows at or past the live length ``s`` are
zero, ``s`` read on the device from the dyn-dims buffer); no buckets (``shared_dyn_dims_ptr`` is None), no
cuBLASLt islands or internal buffers. Graph construction (``cuGraphAddKernelNode`` with the parameters of the
binding update) is a stream capture of the launches with those parameters; a pointer is the tensor it addresses.
Device address 0 is mapped by no allocation: the stand-in is a page no one owns by the time the graph launches
(its own segment, returned to the driver on CUDA; released, so the CPU emulation raises IllegalMemoryAccess).
The eager reference is luminal's direct path (``prepare_direct_profile`` + step launches), which allocates the
dyn-dims buffer when it is missing.
Workload: 6 steps of ``x`` [4, 3] with live lengths 4, 2, 3, 1, 4, 2; before step 3 the integration registers a
new ``w`` allocation (new weights at a new address). Bug: step 3 rebuilds the graph with a null dyn-dims pointer
and its replay faults. Fix: the rebuilt graph reads a refilled buffer (s = 1) and all six steps equal eager.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/luminal-ai/luminal/pull/430"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "materialize_impl"
SYMPTOM = ("after a captured HostOp's external pointer changes, reset_materialization_state drops dyn_dims_buffer "
           "and the rebuilt CUDA graph parameterizes its dynamic kernels with a null dyn-dims pointer")

ROWS, D_IN, D_OUT = 4, 3, 3
SEQ = [4, 2, 3, 1, 4, 2]        # live rows ('s') per step
REBIND_AT = 3                   # the integration registers a new `w` allocation before this step

_variant = "bug"


# --- cudarc stand-ins -----------------------------------------------------------------------------------------------

def alloc_zeros(n: int, device: str) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


def memcpy_htod(values: list[int], buf: torch.Tensor) -> None:
    buf.copy_(torch.tensor(values, dtype=torch.int32))              # outside any capture: a plain H2D upload


def _page_at_address_zero(device: str) -> torch.Tensor:
    """What a load from device address 0 touches: memory that no allocation owns."""
    return torch.zeros(own_segment_elems(device), dtype=torch.int32, device=device)


# --- luminal_cuda_lite: the compiled ops of one CudaGraphOp ----------------------------------------------------------

class UnifiedKernelParams:
    def __init__(self, values: list):
        self.values = values                 # device pointers (a tensor per pointer, None for 0)


class CompiledKernel:
    """``masked_scale``: out[r] = h[r] * gamma for r < s, else 0; ``s`` is read from the dyn-dims argument."""

    def __init__(self, node: str, inputs: list[str], gamma: torch.Tensor, iota: torch.Tensor):
        self.node, self.inputs = node, inputs
        self.kernel_name = "masked_scale"
        self.has_dyn_dims_param = True
        self.constants = {"gamma": gamma, "iota": iota}

    def build_params(self, output_ptr, input_ptrs, dyn_dims_ptr) -> list:
        return [output_ptr, *input_ptrs, dyn_dims_ptr]

    def launch(self, params: UnifiedKernelParams) -> None:
        out, h, dyn_dims = params.values
        live = (self.constants["iota"] < dyn_dims[0:1]).to(h.dtype)          # device-side read of 's'
        torch.mul(h * self.constants["gamma"], live.unsqueeze(1), out=out)


class CapturedHostOp:
    """A cuBLASLt matmul captured as a child graph: its pointer arguments are baked in."""

    def __init__(self, node: str, inputs: list[str]):
        self.node, self.inputs = node, inputs

    def record(self, buffers: dict) -> None:
        x, w = (buffers[n] for n in self.inputs)
        torch.matmul(x, w, out=buffers[self.node])


class CudaGraphOpState:
    def __init__(self, kernels, captured_host_ops):
        self.kernels = kernels
        self.captured_host_ops = captured_host_ops
        self.dyn_dims_buffer: torch.Tensor | None = None       # shared device buffer for dynamic dimensions
        self.shared_dyn_dims_ptr = None                         # bucket-owned buffer (no buckets here)
        self.cuda_graph = None
        self.cuda_graph_exec = None
        self.kernel_params: list[UnifiedKernelParams] = []
        self.last_dyn_values: dict[str, int] = {}
        self.last_buffer_ptrs: dict[str, int] = {}


class CudaGraphOp:
    def __init__(self, device: str, gamma: torch.Tensor):
        self.device = device
        self.dyn_dims_order = ["s"]
        self.buffer_nodes = ["x", "w", "h", "y"]
        self.captured_host_buffer_nodes = {"x", "w", "h"}
        iota = torch.arange(ROWS, dtype=torch.int32, device=device)
        self.state = CudaGraphOpState([CompiledKernel("y", ["h"], gamma, iota)], [CapturedHostOp("h", ["x", "w"])])

    @staticmethod
    def dyn_dims_ptr(state: CudaGraphOpState):
        if state.shared_dyn_dims_ptr is not None:
            return state.shared_dyn_dims_ptr
        return state.dyn_dims_buffer                          # None is device address 0

    @staticmethod
    def reset_materialization_state(state: CudaGraphOpState) -> None:
        state.cuda_graph_exec = None
        state.cuda_graph = None
        state.kernel_params.clear()
        state.last_dyn_values.clear()
        state.last_buffer_ptrs.clear()
        state.dyn_dims_buffer = None

    def build_graph(self, state: CudaGraphOpState, buffers: dict) -> None:
        """Add the HostOp child graphs and the kernel nodes (with the parameters of the first binding update)."""
        dyn_dims_ptr = self.dyn_dims_ptr(state)
        state.kernel_params = []
        for kernel in state.kernels:
            kernel_dyn_dims_ptr = dyn_dims_ptr if kernel.has_dyn_dims_param else None
            state.kernel_params.append(UnifiedKernelParams(kernel.build_params(
                buffers[kernel.node], [buffers[i] for i in kernel.inputs], kernel_dyn_dims_ptr)))
        page0 = [_page_at_address_zero(self.device)]      # mapped only while the nodes are added

        def launch_nodes():
            for op in state.captured_host_ops:
                op.record(buffers)
            for kernel, params in zip(state.kernels, state.kernel_params):
                values = [v if v is not None else (page0[0] if page0 else _page_at_address_zero(self.device))
                          for v in params.values]
                kernel.launch(UnifiedKernelParams(values))
            return buffers["y"]

        static = {"x": buffers["x"]}
        if state.dyn_dims_buffer is not None:
            static["dyn_dims"] = state.dyn_dims_buffer
        state.cuda_graph, _ = capture(launch_nodes, device=self.device, warmups=0, name="CudaGraphOp",
                                      owner="CudaGraphOp", static=static)
        state.cuda_graph_exec = state.cuda_graph
        state.last_buffer_ptrs = {n: buffers[n].data_ptr() for n in self.buffer_nodes}
        page0.clear()                 # address 0 belongs to no allocation when the graph launches
        release_to_driver(self.device)

    def materialize_impl(self, buffers: dict, dyn_map: dict) -> None:
        state = self.state
        dyn_map_changed = dyn_map != state.last_dyn_values
        # Allocate dyn_dims_buffer if needed
        if self.dyn_dims_order and state.shared_dyn_dims_ptr is None and state.dyn_dims_buffer is None:
            state.dyn_dims_buffer = alloc_zeros(len(self.dyn_dims_order), self.device)
        # Update shared dyn_dims buffer if dyn_map changed
        if dyn_map_changed and self.dyn_dims_order and state.shared_dyn_dims_ptr is None:
            memcpy_htod([dyn_map.get(d, 0) for d in self.dyn_dims_order], state.dyn_dims_buffer)
        # Build CUDA graph if needed
        if state.cuda_graph is None:
            self.build_graph(state, buffers)
        changed_buffer_nodes = {n for n in self.buffer_nodes if state.last_buffer_ptrs.get(n) != buffers[n].data_ptr()}
        changed_captured_nodes = changed_buffer_nodes & self.captured_host_buffer_nodes
        if changed_captured_nodes:
            self.reset_materialization_state(state)
            if _variant == "fix":
                # Reset releases the graph-owned dynamic-dimension buffer. The replacement graph must receive
                # a valid ABI pointer before it is built.
                if self.dyn_dims_order and state.shared_dyn_dims_ptr is None:
                    buffer = alloc_zeros(len(self.dyn_dims_order), self.device)
                    memcpy_htod([dyn_map.get(d, 0) for d in self.dyn_dims_order], buffer)
                    state.dyn_dims_buffer = buffer
            self.build_graph(state, buffers)
        state.last_dyn_values = dict(dyn_map)

    def launch(self, buffers: dict) -> torch.Tensor:
        (y,) = replay(self.state.cuda_graph_exec, (buffers["y"],))
        return y

    def execute_direct(self, buffers: dict, dyn_map: dict) -> torch.Tensor:
        """Direct step launches (``prepare_direct_profile``): no graph; the dyn-dims buffer is allocated if missing."""
        state = self.state
        if state.dyn_dims_buffer is None:
            state.dyn_dims_buffer = alloc_zeros(len(self.dyn_dims_order), self.device)
        memcpy_htod([dyn_map.get(d, 0) for d in self.dyn_dims_order], state.dyn_dims_buffer)
        for op in state.captured_host_ops:
            op.record(buffers)
        for kernel in state.kernels:
            kernel.launch(UnifiedKernelParams(kernel.build_params(
                buffers[kernel.node], [buffers[i] for i in kernel.inputs], state.dyn_dims_buffer)))
        return buffers["y"]


# --- the serving loop -------------------------------------------------------------------------------------------------

def serve(device: str, use_graph: bool, xs, w0, w1, gamma) -> list[torch.Tensor]:
    op = CudaGraphOp(device, gamma)
    buffers = {"x": torch.zeros(ROWS, D_IN, device=device), "w": w0.clone(),     # arena input + external pointer
               "h": torch.zeros(ROWS, D_OUT, device=device), "y": torch.zeros(ROWS, D_OUT, device=device)}
    out = []
    for step, (x, s) in enumerate(zip(xs, SEQ)):
        if step == REBIND_AT:
            buffers["w"] = w1.clone()       # the integration registers a new external allocation
        buffers["x"].copy_(x)
        dyn_map = {"s": s}
        if use_graph:
            op.materialize_impl(buffers, dyn_map)
            y = op.launch(buffers)
        else:
            y = op.execute_direct(buffers, dyn_map)
        out.append(y.clone())
    return out


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(430)
    xs = [randn(ROWS, D_IN, gen=gen, device=device) for _ in SEQ]
    w0 = randn(D_IN, D_OUT, gen=gen, device=device)
    w1 = randn(D_IN, D_OUT, gen=gen, device=device)
    gamma = randn(D_OUT, gen=gen, device=device)
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, True, xs, w0, w1, gamma),
                   lambda: serve(device, False, xs, w0, w1, gamma))
