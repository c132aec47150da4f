"""Megatron-LM under ``nsys profile`` with local CUDA graphs: the NVTX range names pushed during a layer's capture are fresh str objects that ``nvtx_range_pop`` releases, so every replay reads its range names from freed, reused memory.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4541 ("Avoid nsys profile crash with CUDA graphs",
NVIDIA/Megatron-LM, tdene, merged 2026-04-30 as commit 12f18dafbf). Read: the whole diff (9 added lines in
``megatron/core/utils.py``: the module-level ``_nvtx_range_msg_pool`` with its comment, and the
``setdefault`` line with its comment in ``nvtx_range_push``); ``megatron/core/utils.py`` at 12f18dafbf (the NVTX
section: ``_nvtx_enabled``, ``_nvtx_range_messages``, ``configure_nvtx_profiling``, ``_nvtx_range_get_func_path``,
``nvtx_range_push``, ``nvtx_range_pop``, ``nvtx_decorator``); ``transformer_layer.py`` at 12f18dafbf
(``_forward_attention``/``_forward_mlp`` and their ``nvtx_range_push(suffix=...)``/``nvtx_range_pop(suffix=...)``
pairs around ``self_attention``, ``self_attn_bda``, ``mlp``, ``mlp_bda``). The PR has no description and no linked
issue; the failure is the one its code comments state: "These string objects may be created during CUDA graph
capture. If they are not pinned, the NVTX range names will be garbage-collected and nsys profile crashes" and "They
may hold identical data, but they are different addresses; matters when CUDA-graphed".
Symptom: ``nsys profile`` of a Megatron run with ``--cuda-graph-impl local`` and NVTX ranges enabled
(``configure_nvtx_profiling(True)``) crashes once the captured layers replay: the ranges recorded inside a graph are
resolved through the ``char*`` that NVTX got at capture, and that string is gone.
Mechanism: ``nvtx_range_push(suffix="self_attention")`` builds the range name afresh at every call
(``_nvtx_range_get_func_path()`` then ``f"{msg}.{suffix}"``), keeps it on ``_nvtx_range_messages`` and passes it to
``torch.cuda.nvtx.range_push``, i.e. the address of that str object's characters. The matching ``nvtx_range_pop``
pops it, and the last reference is gone: CPython frees the object and its small-object allocator hands the block to
the next string of the same size. A range pushed during the layer's capture belongs to the graph, which keeps that
address and reads the name at every replay: by then the block holds whatever string took it last.
Doctor: dangling-reference, at nvtx_range_push. The graph captured in the layer reads (through the NVTX pointer) a
host block whose owner, the str made in ``nvtx_range_push`` during capture, was released right after the range was
popped; every replay reads memory that other objects reuse.
Fix (upstream): ``_nvtx_range_msg_pool.setdefault(msg, msg)`` in ``nvtx_range_push``: the first object made for a
name (in the eager warmup, before any capture) is pinned for the life of the process and is the one handed to NVTX
from then on, so the address a graph records stays valid.
Modelled: the NVTX section of ``megatron/core/utils.py`` as upstream writes it (``_nvtx_range_get_func_path`` with
``inspect``; the fix is the pooled line); ``TransformerLayer._forward_attention``/``_forward_mlp`` with their four
NVTX ranges (an RMSNorm, a one-head self-attention, bias-dropout-add as a residual add, a GELU MLP; float64, dropout
0); a ``CudaGraphManager`` reduced to: ``cuda_graph_warmup_steps`` eager iterations, one warm-up, capture of the
layer forward, replays with a static ``hidden_states`` buffer. Stand-ins: a Python str's characters are explicit
here (``_PyStr``: a str whose characters are written into a block of ``_PyMalloc``, a host arena with LIFO free
lists per 16-byte size class, as CPython's pymalloc reuses freed blocks; the size is the compact-ASCII object's,
48 + len + 1 bytes); every string the upstream code builds is a ``_PyStr``. ``torch.cuda.nvtx`` under nsys is
``_NsysNvtx``: a push writes the name, read through the pointer, into the next row of the report (a device buffer,
so that inside a capture the read is a recorded copy, which the replay repeats at the same address); rows restart
at each iteration.
Workload: one layer, 5 iterations of [4 x 2 x 8] hidden states; iteration 0 is eager (``cuda_graph_warmup_steps``),
iteration 1 warms up and captures, iterations 1-4 replay. Outputs per iteration: the layer output and the report.
Bug: the strings the capture pushed were freed by its pops and their blocks taken by later strings of the same size
class, so every replay (iterations 1-4) reports ``..._forward_mlp.mlp_bda`` for the ``self_attn_bda`` range and the
bare ``..._forward_mlp`` path for the ``mlp`` range (max error 101 in the report's bytes; the layer outputs are
equal). Fix: the pinned strings of the eager iteration are the ones the capture hands to NVTX, and all five
iterations equal eager (max error 0).
"""
from __future__ import annotations

import inspect

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4541"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "nvtx_range_push"
SYMPTOM = ("nsys profile with local CUDA graphs: NVTX range names pushed during a layer's capture are str objects "
           "released right after, so every replay reads the names from freed, reused memory (nsys crashes)")

SEQ, BATCH, HIDDEN, FFN = 4, 2, 8, 16
ITERS = 5
DTYPE = torch.float64
NAME_BYTES = 192            # width of a report row (every range name here is shorter)
MAX_RANGES = 8

_variant = "bug"


# --- CPython's small-object allocator and str objects (stand-in) -----------------------------------------------------

class _PyMalloc:
    """Blocks of a host arena, per 16-byte size class, with LIFO free lists (pymalloc's ``freeblock``)."""

    def __init__(self, device, blocks=64, block_bytes=512):
        self.arena = host(torch.zeros(blocks, block_bytes, dtype=torch.uint8), device)
        self.free_lists: dict[int, list[int]] = {}
        self.next_block = 0

    def alloc(self, size_class):
        free = self.free_lists.setdefault(size_class, [])
        if free:
            return free.pop()
        self.next_block += 1
        return self.next_block - 1

    def free(self, size_class, block):
        self.free_lists[size_class].append(block)


_heap: _PyMalloc | None = None


class _PyStr(str):
    """A str object: its characters (NUL-terminated) live in a pymalloc block for as long as the object does."""

    def __new__(cls, value):
        self = super().__new__(cls, value)
        self._heap, self._size_class = _heap, (48 + len(value) + 1 + 15) // 16
        self._block = _heap.alloc(self._size_class)
        row = _heap.arena[self._block]
        for i, byte in enumerate(value.encode() + b"\0"):   # host work (runs once inside a capture)
            row[i] = byte
        return self

    def c_str(self):
        """What ``PyUnicode_AsUTF8`` hands to C: the object's own characters, by address."""
        return self._heap.arena[self._block, :len(self) + 1]

    def __del__(self):
        self._heap.free(self._size_class, self._block)


class _NsysNvtx:
    """``torch.cuda.nvtx`` while ``nsys profile --cuda-graph-trace=node`` runs: a range records its name through
    the pointer it was given; a range recorded inside a graph capture is re-read at each replay."""

    def __init__(self, device):
        self.report = torch.zeros(MAX_RANGES, NAME_BYTES, dtype=torch.uint8, device=device)
        self.row = 0

    def iteration_begin(self):
        self.row = 0

    def range_push(self, msg):
        name = msg.c_str()
        self.report[self.row, :name.numel()].copy_(name, non_blocking=True)
        self.row += 1

    def range_pop(self):
        pass


_nsys: _NsysNvtx | None = None


# --- megatron/core/utils.py: NVTX profiling --------------------------------------------------------------------------

_nvtx_enabled: bool = False  # Whether NVTX range profiling is enabled
_nvtx_range_messages: list[str] = []  # Messages associated with active NVTX ranges
# Permanently pin the string object representing the name of each NVTX range.
# These string objects may be created during CUDA graph capture.
# If they are not pinned, the NVTX range names will be garbage-collected and nsys profile crashes.
_nvtx_range_msg_pool: dict[str, str] = {}


def configure_nvtx_profiling(enabled: bool) -> None:
    global _nvtx_enabled
    _nvtx_enabled = enabled


def _nvtx_range_get_func_path():
    """Module path and function name of nvtx_range_push/pop's caller."""
    frame = inspect.currentframe().f_back.f_back
    caller_func = inspect.getframeinfo(frame).function
    module = inspect.getmodule(frame)

    return _PyStr(f"{module.__name__}.{caller_func}")


def nvtx_range_push(msg=None, suffix=None) -> None:
    if not _nvtx_enabled:
        return

    if msg is None:
        msg = _nvtx_range_get_func_path()
    if suffix is not None:
        msg = _PyStr(f"{msg}.{suffix}")

    if _variant == "fix":
        # If we have entered this range before, do not use the newly-created "msg" object.
        # But instead point to the original, first-created, "msg" object.
        # They may hold identical data, but they are different addresses; matters when CUDA-graphed.
        msg = _nvtx_range_msg_pool.setdefault(msg, msg)

    # Track messages to ensure consistency when popping
    _nvtx_range_messages.append(msg)

    # Push NVTX range
    _nsys.range_push(msg)


def nvtx_range_pop(msg=None, suffix=None) -> None:
    if not _nvtx_enabled:
        return

    if msg is None:
        msg = _nvtx_range_get_func_path()
    if suffix is not None:
        msg = _PyStr(f"{msg}.{suffix}")

    # Update list of NVTX range messages and check for consistency
    if not _nvtx_range_messages:
        raise RuntimeError("Attempted to pop NVTX range from empty stack")
    last_msg = _nvtx_range_messages.pop()
    if msg is not None and msg != last_msg:
        raise ValueError(
            f"Attempted to pop NVTX range from stack with msg={msg}, "
            f"but last range has msg={last_msg}"
        )

    # Pop NVTX range
    _nsys.range_pop()


# --- megatron/core/transformer: TransformerLayer and its local CUDA graph --------------------------------------------

class TransformerConfig:
    def __init__(self, cuda_graph_impl="none", cuda_graph_warmup_steps=1):
        self.cuda_graph_impl = cuda_graph_impl
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps


def _rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class TransformerLayer:
    def __init__(self, config, device):
        gen = generator(4541)
        w = lambda *shape: (0.3 * torch.randn(*shape, generator=gen)).to(DTYPE).to(device)  # noqa: E731
        self.config = config
        self.input_layernorm_weight = 1.0 + w(HIDDEN)
        self.linear_qkv, self.linear_proj = w(HIDDEN, 3 * HIDDEN), w(HIDDEN, HIDDEN)
        self.pre_mlp_layernorm_weight = 1.0 + w(HIDDEN)
        self.linear_fc1, self.linear_fc2 = w(HIDDEN, FFN), w(FFN, HIDDEN)
        if config.cuda_graph_impl == "local":
            self.cudagraph_manager = CudaGraphManager(config, self, device)

    def self_attention(self, x):
        q, k, v = (x @ self.linear_qkv).chunk(3, dim=-1)                              # [s, b, h] each
        scores = torch.einsum("sbh,tbh->bst", q, k) / HIDDEN ** 0.5
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return torch.einsum("bst,tbh->sbh", probs, v) @ self.linear_proj

    def _forward_attention(self, hidden_states):
        input_layernorm_output = _rms_norm(hidden_states, self.input_layernorm_weight)
        residual = hidden_states

        # Self attention.
        nvtx_range_push(suffix="self_attention")
        attention_output = self.self_attention(input_layernorm_output)
        nvtx_range_pop(suffix="self_attention")

        nvtx_range_push(suffix="self_attn_bda")
        hidden_states = residual + attention_output                                     # dropout 0
        nvtx_range_pop(suffix="self_attn_bda")
        return hidden_states

    def _forward_mlp(self, hidden_states):
        pre_mlp_layernorm_output = _rms_norm(hidden_states, self.pre_mlp_layernorm_weight)
        residual = hidden_states

        nvtx_range_push(suffix="mlp")
        mlp_output = torch.nn.functional.gelu(pre_mlp_layernorm_output @ self.linear_fc1) @ self.linear_fc2
        nvtx_range_pop(suffix="mlp")

        nvtx_range_push(suffix="mlp_bda")
        hidden_states = residual + mlp_output
        nvtx_range_pop(suffix="mlp_bda")
        return hidden_states

    def _forward(self, hidden_states):
        return self._forward_mlp(self._forward_attention(hidden_states))

    def __call__(self, hidden_states):
        if self.config.cuda_graph_impl == "local":
            return self.cudagraph_manager(hidden_states)
        return self._forward(hidden_states)


class CudaGraphManager:
    """``cuda_graph_warmup_steps`` eager iterations; then warm up, capture the layer forward and replay it."""

    def __init__(self, config, base_module, device):
        self.config, self.base_module, self.device = config, base_module, device
        self.calls, self.graph, self.static_input = 0, None, None

    def __call__(self, hidden_states):
        self.calls += 1
        if self.calls <= self.config.cuda_graph_warmup_steps:
            return self.base_module._forward(hidden_states)
        if self.graph is None:
            self.static_input = hidden_states.clone()

            def step():
                _nsys.iteration_begin()            # nsys reports the warm-up and the capture as iterations too
                return self.base_module._forward(self.static_input)

            self.graph, self.static_output = capture(
                step, device=self.device, warmups=1, name="transformer_layer", owner="CudaGraphManager",
                static={"hidden_states": self.static_input})
        self.static_input.copy_(hidden_states)
        return replay(self.graph, self.static_output)


# --- the workload ----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(45410)
    microbatches = [randn(SEQ, BATCH, HIDDEN, gen=gen, device=device).to(DTYPE) for _ in range(ITERS)]

    def train(config):
        global _heap, _nsys
        _nvtx_range_messages.clear()
        _nvtx_range_msg_pool.clear()          # a fresh process: ``nsys profile python pretrain_gpt.py ...``
        _heap, _nsys = _PyMalloc(device), _NsysNvtx(device)
        configure_nvtx_profiling(True)
        layer, outputs = TransformerLayer(config, device), []
        for hidden_states in microbatches:
            _nsys.iteration_begin()
            output = layer(hidden_states)
            outputs += [output.clone(), _nsys.report.clone()]
        return outputs

    eager = lambda: train(TransformerConfig())                                                 # noqa: E731
    served = lambda: train(TransformerConfig(cuda_graph_impl="local"))                         # noqa: E731
    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
