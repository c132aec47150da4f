"""TE/JAX grouped GEMM under XLA command buffers: ``GroupedGemmFFI`` is declared command-buffer compatible but copies ``group_sizes`` to the host and synchronises the stream.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/2048 ("[JAX] Remove cudaGraph compatible trait from
GroupedGemmFFI and GroupedQuantizeFFI", NVIDIA/TransformerEngine, merged 2025-08-08, commit 9f9b481). Read: the
commit's full diff (``gemm.cpp``/``quantization.cpp`` drop ``FFI_CudaGraph_Traits`` from the two
``XLA_FFI_DEFINE_HANDLER_SYMBOL`` calls; ``tests/jax/test_custom_call_compute.py`` removes the comments "grouped_gemm
does not work with cudaGraph yet, so the jitting will breaks ... export XLA_FLAGS=--xla_gpu_enable_command_buffer= to
disable cudaGraph" and now jits ``tex.grouped_gemm``/``grouped_dense``), ``GroupedGemmFFI`` in ``gemm.cpp`` at the
parent commit (``cudaMemcpyAsync(dim_list_host.data(), group_sizes, ..., cudaMemcpyDeviceToHost, stream)`` followed by
``cudaStreamSynchronize(stream)`` with the comment "Note: This may break cudaGraph.", then one GEMM per group sized by
``dim_list_host[i]``), ``ffi.h`` (``FFI_CudaGraph_Traits = {xla::ffi::Traits::kCmdBufferCompatible}``) and the
``te_grouped_gemm_ffi`` registration in ``pybind.cpp``. No PR discussion read; XLA's command-buffer scheduling and
recording are described from XLA's design, not from XLA source read for this program.
Symptom: ``jax.jit`` of a TE grouped GEMM / grouped dense (MoE expert layer) fails on the GPU with XLA command
buffers enabled (the default): recording the command buffer stream-captures the custom call, whose D2H copy and
``cudaStreamSynchronize`` are not permitted while the stream is capturing. Users had to run un-jitted or set
``--xla_gpu_enable_command_buffer=``. (Had the sync been allowed, the per-group GEMM shapes decided on the host from
the first call's ``group_sizes`` would be frozen into every replay.)
Mechanism: XLA's command-buffer scheduling folds consecutive thunks that are command-buffer compatible (fusions,
and FFI custom calls whose handler carries ``kCmdBufferCompatible``) into one ``CommandBufferThunk``; on its first
execution the thunk records its commands -- an FFI custom call by tracing the handler under stream capture -- and
launches the recorded graph, later executions launch it again. ``GroupedGemmHandler`` was registered with
``FFI_CudaGraph_Traits``, so the custom call ``te_grouped_gemm_ffi`` landed inside the MoE layer's command buffer and
``GroupedGemmFFI`` ran during the capture: its host read of ``group_sizes`` is a host synchronisation in the
captured region.
Doctor: sync-in-capture, at GroupedGemmFFI. The D2H copy of ``group_sizes`` plus ``cudaStreamSynchronize`` is the
host wait attempted while the command buffer is being captured; the fix decides exactly whether this function is
recorded.
Fix (upstream): register ``GroupedGemmHandler`` (and ``GroupedQuantizeHandler``) without ``FFI_CudaGraph_Traits``;
XLA then leaves the custom call out of the command buffers and runs it as a plain thunk between the recorded
fusions, where the host read of the group sizes is legal and fresh every step.
Modelled: ``GroupedGemmFFI`` (host staging of ``dim_list_host``, the sum check, one GEMM per group at its row
offset), the FFI registry with ``FFI_CudaGraph_Traits``, ``GroupedGemmPrimitive``/``grouped_gemm``, and a stand-in for
the XLA GPU executable of a jitted MoE expert layer: a router fusion (argmax routing, ``group_sizes``, stable sort by
expert, gather), the ``te_grouped_gemm_ffi`` custom call, an unpermute fusion. ``CommandBufferScheduling`` groups
compatible thunks; a ``CommandBufferThunk`` records with no warm-up (workbench capture) and launches (replay).
Buffer assignment is static (allocated once per executable), so recorded command buffers need no address update.
``cudaStreamSynchronize`` is the engine's ``synchronize``; ``dim_list_host`` (a pageable ``std::vector``) is a
``host()`` buffer. BF16/FP8 scaling, bias, wgrad mode and multi-stream GEMMs are left out; float32, 8 tokens,
hidden 8, 4 experts, ffn 8.
Workload: three calls of the jitted layer with different tokens (so different routings and group sizes). With the
trait (bug) the first call's command-buffer recording reaches ``GroupedGemmFFI`` and its stream synchronisation
raises. Without it (fix) the two fusion command buffers are recorded once and replayed, the grouped GEMM runs
between them each call with that call's group sizes, and all three outputs equal the un-graphed run.
"""
from __future__ import annotations

import torch

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/2048"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "GroupedGemmFFI"
SYMPTOM = ("jax.jit of TE grouped_gemm/grouped_dense with XLA command buffers on: the command buffer records the "
           "te_grouped_gemm_ffi custom call, whose D2H copy of group_sizes + cudaStreamSynchronize fails under "
           "stream capture (tests had to disable cudaGraph via --xla_gpu_enable_command_buffer=)")

NUM_TOKENS, HIDDEN, FFN, NUM_EXPERTS = 8, 8, 8, 4
NUM_CALLS = 3

_variant = "bug"


# --- transformer_engine/jax/csrc/extensions/ffi.h --------------------------------------------------

class Traits:
    kCmdBufferCompatible = "kCmdBufferCompatible"


FFI_CudaGraph_Traits = (Traits.kCmdBufferCompatible,)

_FFI_REGISTRY: dict[str, "Handler"] = {}       # custom-call target -> handler (pybind.cpp EncapsulateFFI)


class Handler:
    def __init__(self, fn, traits=()):
        self.fn, self.traits = fn, tuple(traits)


class Stream:
    """cudaStream_t of the executable (one device)."""

    def __init__(self, device: str):
        self.device = device


# --- transformer_engine/jax/csrc/extensions/gemm.cpp -----------------------------------------------

def GroupedGemmFFI(stream: Stream, lhs_data, rhs_data, group_sizes, output, m: int, n: int, k: int):
    """One GEMM per group: rows [offset, offset + m_i) of lhs times rhs[i] (rhs_is_trans=False)."""
    num_gemms = group_sizes.shape[0]
    dim_list_host = host(torch.zeros(num_gemms, dtype=torch.int32), stream.device)   # std::vector<int32_t>
    dim_list_host.copy_(group_sizes, non_blocking=True)                              # cudaMemcpyAsync D2H
    # Note: This may break cudaGraph.
    synchronize(stream.device)                                                       # cudaStreamSynchronize
    dims = [int(v) for v in dim_list_host.tolist()]
    sum_group_sizes = sum(dims)
    if m != sum_group_sizes:
        raise RuntimeError(f"Unexpected group_sizes! M = {m}, got sum(group_sizes)={sum_group_sizes}")
    offset = 0
    for i, m_i in enumerate(dims):
        if m_i:
            torch.matmul(lhs_data[offset:offset + m_i], rhs_data[i], out=output[offset:offset + m_i])
        offset += m_i


def register_te_ffi_handlers() -> None:
    """XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmHandler, GroupedGemmFFI, ... [, FFI_CudaGraph_Traits])."""
    if _variant == "fix":        # upstream fix: no command-buffer trait on the grouped GEMM handler
        _FFI_REGISTRY["te_grouped_gemm_ffi"] = Handler(GroupedGemmFFI)
    else:
        _FFI_REGISTRY["te_grouped_gemm_ffi"] = Handler(GroupedGemmFFI, FFI_CudaGraph_Traits)


# --- transformer_engine/jax/cpp_extensions/gemm.py -------------------------------------------------

class GroupedGemmPrimitive:
    name = "te_grouped_gemm_ffi"

    @staticmethod
    def lowering(lhs, rhs, group_sizes, out):
        """The custom call of the lowered HLO: a thunk calling the registered FFI handler."""
        m, k = lhs.shape
        n = rhs.shape[-1]
        return CustomCallThunk(GroupedGemmPrimitive.name, lambda h, s: h.fn(s, lhs, rhs, group_sizes, out, m, n, k))


def grouped_gemm(lhs, rhs, group_sizes, out):
    return GroupedGemmPrimitive.lowering(lhs, rhs, group_sizes, out)


# --- XLA GPU runtime (stand-in) ----------------------------------------------------------------------

class KernelThunk:
    """A fusion: device kernels only, always command-buffer compatible."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn
        self.cmd_buffer_compatible = True

    def execute(self, stream):
        self.fn()


class CustomCallThunk:
    def __init__(self, target, call):
        self.target, self.call = target, call

    @property
    def handler(self) -> Handler:
        return _FFI_REGISTRY[self.target]

    @property
    def cmd_buffer_compatible(self) -> bool:
        return Traits.kCmdBufferCompatible in self.handler.traits

    def execute(self, stream):
        self.call(self.handler, stream)


class CommandBufferThunk:
    """Records its thunks into a command buffer (a CUDA graph) on first execution, then launches it."""

    def __init__(self, thunks, reads, writes, name):
        self.thunks, self.reads, self.writes, self.name = thunks, reads, writes, name
        self.recorded = None

    def execute(self, stream):
        if self.recorded is None:
            self.recorded = capture(lambda: self._record(stream), device=stream.device, warmups=0, name=self.name,
                                    static=self.reads, owner="XLA CommandBufferThunk")
        g, outs = self.recorded
        replay(g, outs)

    def _record(self, stream):
        for t in self.thunks:
            t.execute(stream)
        return tuple(self.writes.values())


def CommandBufferScheduling(thunks, buffers):
    """Fold runs of consecutive command-buffer-compatible thunks into CommandBufferThunks."""
    out, run = [], []

    def flush():
        if run:
            reads = {k: buffers[k] for k in sorted(set().union(*(t.reads for t in run)) - set().union(
                *(t.writes for t in run)))}
            writes = {k: buffers[k] for k in sorted(set().union(*(t.writes for t in run)))}
            out.append(CommandBufferThunk([t.thunk for t in run], reads, writes,
                                          name="command_buffer(" + ",".join(t.name for t in run) + ")"))
            run.clear()
    for t in thunks:
        if t.thunk.cmd_buffer_compatible:
            run.append(t)
        else:
            flush()
            out.append(t.thunk)
    flush()
    return out


class Scheduled:
    """A thunk with the buffers it reads and writes (from buffer assignment)."""

    def __init__(self, name, thunk, reads, writes):
        self.name, self.thunk, self.reads, self.writes = name, thunk, set(reads), set(writes)


class GpuExecutable:
    """jax.jit(moe_expert_layer) compiled for the GPU: static buffer assignment and a thunk sequence."""

    def __init__(self, device: str, enable_command_buffer: bool):
        register_te_ffi_handlers()
        self.stream = Stream(device)
        b = self.buffers = {
            "x": torch.zeros(NUM_TOKENS, HIDDEN, device=device),
            "w_router": torch.zeros(HIDDEN, NUM_EXPERTS, device=device),
            "w_experts": torch.zeros(NUM_EXPERTS, HIDDEN, FFN, device=device),
            "expert_iota": torch.arange(NUM_EXPERTS, device=device),
            "group_sizes": torch.zeros(NUM_EXPERTS, dtype=torch.int32, device=device),
            "sort_idx": torch.zeros(NUM_TOKENS, dtype=torch.long, device=device),
            "x_sorted": torch.zeros(NUM_TOKENS, HIDDEN, device=device),
            "out_sorted": torch.zeros(NUM_TOKENS, FFN, device=device),
            "out": torch.zeros(NUM_TOKENS, FFN, device=device),
        }

        def router_fusion():
            expert = torch.argmax(b["x"] @ b["w_router"], dim=-1)
            b["group_sizes"].copy_((expert.unsqueeze(1) == b["expert_iota"]).sum(0))
            b["sort_idx"].copy_(torch.argsort(expert, stable=True))
            torch.index_select(b["x"], 0, b["sort_idx"], out=b["x_sorted"])

        def unpermute_fusion():
            b["out"].index_copy_(0, b["sort_idx"], torch.relu(b["out_sorted"]))

        thunks = [
            Scheduled("router_sort_fusion", KernelThunk("router_sort_fusion", router_fusion),
                      ["x", "w_router", "expert_iota"], ["group_sizes", "sort_idx", "x_sorted"]),
            Scheduled("te_grouped_gemm_ffi",
                      grouped_gemm(b["x_sorted"], b["w_experts"], b["group_sizes"], b["out_sorted"]),
                      ["x_sorted", "w_experts", "group_sizes"], ["out_sorted"]),
            Scheduled("unpermute_fusion", KernelThunk("unpermute_fusion", unpermute_fusion),
                      ["out_sorted", "sort_idx"], ["out"]),
        ]
        self.thunks = CommandBufferScheduling(thunks, b) if enable_command_buffer else [t.thunk for t in thunks]

    def __call__(self, x, w_router, w_experts):
        b = self.buffers
        b["x"].copy_(x)
        b["w_router"].copy_(w_router)
        b["w_experts"].copy_(w_experts)
        for t in self.thunks:
            t.execute(self.stream)
        return b["out"].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def workload(enable_command_buffer: bool):
        gen = generator(2048)
        w_router = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device)
        w_experts = randn(NUM_EXPERTS, HIDDEN, FFN, gen=gen, device=device, scale=0.5)
        xs = [randn(NUM_TOKENS, HIDDEN, gen=gen, device=device) for _ in range(NUM_CALLS)]
        layer = GpuExecutable(device, enable_command_buffer)       # jax.jit(grouped_dense layer)
        return [layer(x, w_router, w_experts) for x in xs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: workload(enable_command_buffer=True), lambda: workload(enable_command_buffer=False))
