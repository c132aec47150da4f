"""Megatron's dynamic inference context does not resume its torch_memory_saver region after a suspend when unified memory is off, so the decode CUDA graphs it kept (static KV pointers) replay on paused, released memory.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/3696 ("Fix illegal memory access with mamba inference (bis)",
NVIDIA/Megatron-LM, by Teodor-Dumitru Ene (tdene), merged 2026-03-04 as commit
bb31e93adb14952ca4eb01cc475a5de3af0be059; a one-line follow-up to #3631, commit 2a931a3f86, "Fix illegal memory
access with mamba inference", merged the same day, which had turned the condition's ``or`` into ``and``).
Read: the diff of bb31e93adb; ``megatron/core/inference/contexts/dynamic_context.py`` at its parent 2a931a3f86
(``__init__``'s unified-memory / ``static_kv_memory_pointers`` / ``kv_cache_management_mode`` set-up and its
assertion, ``_allocate_memory_buffer``, ``_allocate_mamba_states`` (offloadable tensors registered only when
torch_memory_saver is not used), ``initialize_all_tensors`` (the large buffers allocated inside
``torch_memory_saver.region(tag=TMS_TAG, enable_cpu_backup=(mode == OFFLOAD))`` when static addresses are needed),
``reinitialize_inference_state_buffers``, ``deallocate_inference_state_buffers``, ``reset_metadata``); the diff of
2a931a3f86; ``megatron/core/inference/engines/dynamic_engine.py`` at 2a931a3f86 (``suspend``: CUDA graphs deleted
only when the KV memory pointers are not static; ``resume``: graphs re-created only in that case; with OFFLOAD the
active requests keep their KV cache); ``KVCacheManagementMode`` in ``megatron/core/inference/config.py``.
Symptom: RL with the dynamic inference engine, CUDA graphs, static KV memory pointers and torch_memory_saver (no
unified memory), KV cache mode offload: the first generation step after a suspend/resume cycle (a training phase)
fails with an illegal memory access (hybrid Mamba models).
Mechanism: with static KV pointers the engine keeps its decode CUDA graphs across suspend; they hold the addresses
of the KV cache and the Mamba states, which live in a torch_memory_saver region whose virtual addresses survive a
``pause``. Suspend pauses the region (its physical memory is released, backed up to the CPU in offload mode).
``reinitialize_inference_state_buffers`` must resume it, but #3631 guarded that with
``unified_memory_level != 0 and self._uses_torch_memory_saver``: false without unified memory, so the region stays
paused, and since the offloadable-tensor list is empty when torch_memory_saver is used, nothing is restored. The next
graph replay reads and writes the released region.
Doctor: dangling-reference, at reinitialize_inference_state_buffers. The captured decode graph reads the KV cache
and Mamba states by address while their owner (the memory-saver region) has released that memory; the resume that
would bring it back is skipped there.
Fix (upstream): ``if self.unified_memory_level != 0 or self._uses_torch_memory_saver:`` -- the region is resumed
(``torch_memory_saver.resume(tag)``, which restores the CPU backup at the same virtual addresses) and the graphs stay
valid.
Modelled: ``KVCacheManagementMode``; ``DynamicInferenceContext`` (the set-up, ``initialize_all_tensors``,
``_allocate_memory_buffer``, ``_allocate_mamba_states``, ``deallocate_inference_state_buffers``,
``reinitialize_inference_state_buffers`` as read; ``reset_metadata`` reduced to the block table and the Mamba
states; a block allocator handing each request its blocks; ``add_request``); ``DynamicInferenceEngine`` (``suspend`` /
``resume`` as read, ``step`` serving decode steps from one CUDA graph captured at start-up over the context's static
buffers, or eagerly). Stand-ins: ``torch_memory_saver`` (a region records the tensors allocated in it; ``pause``
backs them up to the CPU when asked and then poisons them with NaN -- the released pages of a real region fault
instead, which the CPU emulation cannot express while keeping the address; ``resume`` restores the backup in place,
at the same address); the hybrid model is one Mamba-like layer (a conv and an SSM state per request slot) and one
paged-attention layer over the KV cache, float64; pinned CPU backups only on CUDA. The eager reference runs the same
engine without CUDA graphs and without static KV pointers (manual offload by storage resize).
Workload: 2 requests (max_requests 2), block size 4, 8 tokens per request, teacher-forced tokens; 3 decode steps,
suspend (offload mode), a training phase that allocates and writes memory, resume, 3 more decode steps; the logits
of all 6 steps are compared. Bug: the 3 steps before the suspend equal eager, the 3 after resume return NaN logits
(max error inf); fix: equals eager (max error 0). Measured on the CPU and on an H100 (torch 2.11), twice each.
"""
from __future__ import annotations

import contextlib
import math
from enum import Enum

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/3696"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "reinitialize_inference_state_buffers"
SYMPTOM = ("after a suspend/resume cycle with static KV pointers and torch_memory_saver (no unified memory) the kept "
           "decode CUDA graphs replay on the still-paused KV cache / Mamba state region: illegal memory access")

VOCAB, HIDDEN, MAX_REQUESTS, BLOCK, MAX_SEQ = 11, 4, 2, 4, 8
STEPS_BEFORE, STEPS_AFTER = 3, 3
DTYPE = torch.float64

_variant = "bug"
_device = "cpu"
aten = torch.ops.aten


class KVCacheManagementMode(str, Enum):
    """Mode for handling large tensors (KV cache, Mamba states) during suspend/resume."""
    PERSIST = "persist"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"


# --- torch_memory_saver (stand-in) ---------------------------------------------------------------------------------------

class _RegionAllocations(TorchDispatchMode):
    """The tensors allocated inside a region (torch_memory_saver hooks the allocator)."""

    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (aten.empty, aten.empty_strided):
            self.sink.append(out)
        return out


class TorchMemorySaver:
    """Memory of a region keeps its virtual addresses across ``pause`` (physical pages released, optionally backed
    up to the CPU) and ``resume`` (pages mapped again at the same addresses, backup restored)."""

    def __init__(self):
        self.regions: dict = {}

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False):
        tensors: list = []
        with _RegionAllocations(tensors):
            yield
        self.regions[tag] = {"tensors": tensors, "cpu_backup": enable_cpu_backup, "backup": None}

    def pause(self, tag: str) -> None:
        region = self.regions[tag]
        if region["cpu_backup"]:
            region["backup"] = [t.to("cpu", copy=True) for t in region["tensors"]]
        for t in region["tensors"]:
            t.fill_(float("nan"))      # released pages (a real region faults on access: illegal memory access)

    def resume(self, tag: str) -> None:
        region = self.regions[tag]
        if region["backup"] is not None:
            for t, saved in zip(region["tensors"], region["backup"]):
                t.copy_(saved)


HAVE_TORCH_MEMORY_SAVER = True
torch_memory_saver = TorchMemorySaver()


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.device(_device).type == "cuda" else t


# --- megatron/core/inference/contexts/dynamic_context.py -----------------------------------------------------------------

class BlockAllocator:
    def __init__(self, total_count: int):
        self.total_count = total_count
        self.reset()

    def reset(self) -> None:
        self.next_block = 0

    def allocate_memory_blocks(self, count: int) -> torch.Tensor:
        ids = torch.arange(self.next_block, self.next_block + count, device=_device)
        self.next_block += count
        return ids


class DynamicInferenceContext:
    TMS_TAG = "inference_context"

    def __init__(self, *, static_kv_memory_pointers: bool, kv_cache_management_mode, unified_memory_level: int = 0):
        self.params_dtype = DTYPE
        self.max_requests = MAX_REQUESTS
        self.block_size_tokens = BLOCK
        self.max_sequence_length = MAX_SEQ
        self.max_kv_block_count = math.ceil(MAX_SEQ / BLOCK)
        self.num_attention_layers = self.num_mamba_layers = 1
        self.hidden_size_per_attention_head, self.num_attention_heads_per_partition = HIDDEN, 1
        self.mamba_conv_states_shape, self.mamba_ssm_states_shape = (HIDDEN,), (HIDDEN,)
        self.is_hybrid_model = True

        # Unified memory and general tensor management.
        self.unified_memory_level = unified_memory_level
        self.static_kv_memory_pointers = static_kv_memory_pointers
        self.kv_cache_management_mode = kv_cache_management_mode
        if self.static_kv_memory_pointers and self.kv_cache_management_mode != KVCacheManagementMode.PERSIST:
            assert HAVE_TORCH_MEMORY_SAVER or self.unified_memory_level != 0, (
                "Static KV memory pointers require UVM or torch_memory_saver when not persisted.")
        self._offloadable_tensor_names: set[str] = set()
        self._offloadable_cpu_backups: dict[str, torch.Tensor] = {}
        self._offloadable_storage_sizes: dict[str, int] = {}
        self._uses_torch_memory_saver: bool = False

        self.block_allocator = BlockAllocator(MAX_REQUESTS * self.max_kv_block_count + 1)   # + the dummy block
        self.is_tensor_state_allocated = False
        self.initialize_all_tensors()

    def _allocate_memory_buffer(self):
        """Allocate the KV cache memory buffer."""
        self.memory_buffer = torch.empty(
            (2, self.num_attention_layers, self.block_allocator.total_count, self.block_size_tokens,
             self.num_attention_heads_per_partition, self.hidden_size_per_attention_head),
            dtype=self.params_dtype, device=_device)
        if self.kv_cache_management_mode == KVCacheManagementMode.OFFLOAD and not self._uses_torch_memory_saver:
            assert self.unified_memory_level == 0
            self._offloadable_tensor_names.add("memory_buffer")
            self._offloadable_cpu_backups["memory_buffer"] = _pin(torch.empty_like(self.memory_buffer, device="cpu"))

    def _allocate_mamba_states(self):
        """Allocate Mamba states for hybrid models."""
        self.mamba_conv_states = torch.empty((self.num_mamba_layers, self.max_requests) + self.mamba_conv_states_shape,
                                             dtype=self.params_dtype, device=_device)
        self.mamba_ssm_states = torch.empty((self.num_mamba_layers, self.max_requests) + self.mamba_ssm_states_shape,
                                            dtype=self.params_dtype, device=_device)
        if self.kv_cache_management_mode == KVCacheManagementMode.OFFLOAD and not self._uses_torch_memory_saver:
            assert self.unified_memory_level == 0
            for name in ("mamba_conv_states", "mamba_ssm_states"):
                self._offloadable_tensor_names.add(name)
                self._offloadable_cpu_backups[name] = _pin(torch.empty_like(getattr(self, name), device="cpu"))

    def initialize_all_tensors(self) -> None:
        """Allocate all GPU state during initial construction."""
        if self.is_tensor_state_allocated:
            return
        self.is_tensor_state_allocated = True
        for key in vars(self).keys():
            assert not isinstance(getattr(self, key), torch.Tensor), (
                f"All tensors should be allocated within `initialize_all_tensors()`. Please move tensor '{key}'.")

        # Per-request state.
        self.request_kv_length_offsets = torch.zeros((self.max_requests,), dtype=torch.long, device=_device)
        self.request_to_kv_block_ids = torch.full((self.max_requests, self.max_kv_block_count), -1,
                                                  dtype=torch.long, device=_device)
        # Per-token state.
        self.token_to_input_ids = torch.full((self.max_requests,), 0, dtype=torch.long, device=_device)

        # Allocate large non-graphed buffers.
        need_static_addr = (self.static_kv_memory_pointers
                            and self.kv_cache_management_mode != KVCacheManagementMode.PERSIST)
        ctx_manager = contextlib.nullcontext()
        if self.unified_memory_level != 0:
            raise NotImplementedError("unified memory is not modelled")
        elif HAVE_TORCH_MEMORY_SAVER and need_static_addr:
            ctx_manager = torch_memory_saver.region(
                tag=self.TMS_TAG, enable_cpu_backup=(self.kv_cache_management_mode == KVCacheManagementMode.OFFLOAD))
            self._uses_torch_memory_saver = True
        with ctx_manager:
            self._allocate_memory_buffer()
            self._allocate_mamba_states()

        # Reset tensor-related metadata.
        self.reset_metadata()

    def reinitialize_inference_state_buffers(self):
        """Restore large tensors (KV cache, Mamba states) after a suspend."""
        if self.is_tensor_state_allocated:
            return
        self.is_tensor_state_allocated = True

        if self.kv_cache_management_mode == KVCacheManagementMode.PERSIST:
            return

        if _variant == "bug":
            bring_back = self.unified_memory_level != 0 and self._uses_torch_memory_saver
        else:
            bring_back = self.unified_memory_level != 0 or self._uses_torch_memory_saver
        if bring_back:
            # Need to bring back the memory block before we reset it.
            if self._uses_torch_memory_saver:
                torch_memory_saver.resume(self.TMS_TAG)
            if self.kv_cache_management_mode == KVCacheManagementMode.RECOMPUTE:
                self.reset_metadata()
            return

        if self.kv_cache_management_mode == KVCacheManagementMode.OFFLOAD:
            for name, tensor in ((n, getattr(self, n)) for n in self._offloadable_tensor_names):
                tensor.untyped_storage().resize_(self._offloadable_storage_sizes[name])
                tensor.copy_(self._offloadable_cpu_backups[name], non_blocking=True)
        elif self.kv_cache_management_mode == KVCacheManagementMode.RECOMPUTE:
            self.is_tensor_state_allocated = False
            self.initialize_all_tensors()

    def deallocate_inference_state_buffers(self):
        """Deallocate large tensors (KV cache, Mamba states) during suspend."""
        if not self.is_tensor_state_allocated:
            return
        self.is_tensor_state_allocated = False

        if self.kv_cache_management_mode == KVCacheManagementMode.PERSIST:
            return
        if self.unified_memory_level != 0:
            return
        if self._uses_torch_memory_saver:
            torch_memory_saver.pause(self.TMS_TAG)
            return

        if self.kv_cache_management_mode == KVCacheManagementMode.OFFLOAD:
            for name, tensor in ((n, getattr(self, n)) for n in self._offloadable_tensor_names):
                self._offloadable_storage_sizes[name] = tensor.untyped_storage().nbytes()
                self._offloadable_cpu_backups[name].copy_(tensor, non_blocking=True)
                tensor.untyped_storage().resize_(0)
        elif self.kv_cache_management_mode == KVCacheManagementMode.RECOMPUTE:
            for key in list(vars(self).keys()):
                if isinstance(getattr(self, key), torch.Tensor):
                    delattr(self, key)

    def reset_metadata(self) -> None:
        """Reset all bookkeeping state (block allocator, block table, Mamba states)."""
        self.block_allocator.reset()
        self.request_to_kv_block_ids.fill_(-1)
        self.request_kv_length_offsets.zero_()
        self.memory_buffer.zero_()
        self.mamba_conv_states.zero_()
        self.mamba_ssm_states.zero_()

    def add_request(self, slot: int) -> None:
        self.request_to_kv_block_ids[slot] = self.block_allocator.allocate_memory_blocks(self.max_kv_block_count)
        self.request_kv_length_offsets[slot] = 0
        self.mamba_conv_states[:, slot] = 0.0
        self.mamba_ssm_states[:, slot] = 0.0


# --- the hybrid model (one Mamba-like layer, one paged-attention layer) ---------------------------------------------------

class HybridModel:
    def __init__(self):
        gen = generator(3696)
        r = lambda *s: randn(*s, gen=gen, device=_device, scale=0.5).to(DTYPE)   # noqa: E731
        self.embedding, self.w_in, self.w_ssm = r(VOCAB, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.wq, self.wk, self.wv, self.w_out = r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, context: DynamicInferenceContext) -> torch.Tensor:
        x = self.embedding[input_ids]
        # Mamba layer: conv and SSM state per request slot, updated in place.
        conv = 0.5 * context.mamba_conv_states[0] + x @ self.w_in
        ssm = 0.8 * context.mamba_ssm_states[0] + torch.tanh(conv) @ self.w_ssm
        context.mamba_conv_states[0].copy_(conv)
        context.mamba_ssm_states[0].copy_(ssm)
        h = x + ssm
        # Attention layer: append this token's K/V to the paged cache, attend over the request's tokens.
        pos = context.request_kv_length_offsets
        block = context.request_to_kv_block_ids.gather(1, (pos // BLOCK)[:, None]).squeeze(1)
        offset = pos % BLOCK
        cache = context.memory_buffer
        cache[0, 0, block, offset, 0] = h @ self.wk
        cache[1, 0, block, offset, 0] = h @ self.wv
        keys = cache[0, 0][context.request_to_kv_block_ids].reshape(MAX_REQUESTS, MAX_SEQ, HIDDEN)
        values = cache[1, 0][context.request_to_kv_block_ids].reshape(MAX_REQUESTS, MAX_SEQ, HIDDEN)
        valid = torch.arange(MAX_SEQ, device=input_ids.device)[None, :] <= pos[:, None]
        scores = ((h @ self.wq)[:, None, :] * keys).sum(-1) / math.sqrt(HIDDEN)
        probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        attn = (probs[..., None] * torch.where(valid[..., None], values, torch.zeros_like(values))).sum(1)
        return (h + attn) @ self.w_out


# --- megatron/core/inference/engines/dynamic_engine.py -------------------------------------------------------------------

class DynamicInferenceEngine:
    def __init__(self, context: DynamicInferenceContext, model: HybridModel, enable_cuda_graph: bool):
        self.context, self.model, self.enable_cuda_graph = context, model, enable_cuda_graph
        self.is_suspended = False
        self.graph = self.graph_logits = None
        if enable_cuda_graph:
            self.create_cuda_graphs()

    def create_cuda_graphs(self):
        """Capture the decode step over the context's static buffers (engine start-up)."""
        ctx = self.context
        self.graph, self.graph_logits = capture(
            lambda: self.model.forward(ctx.token_to_input_ids, ctx), device=_device, warmups=0,
            name="decode", owner="DynamicInferenceEngine",
            static={"token_to_input_ids": ctx.token_to_input_ids,
                    "request_kv_length_offsets": ctx.request_kv_length_offsets,
                    "request_to_kv_block_ids": ctx.request_to_kv_block_ids},
            state={"memory_buffer": ctx.memory_buffer, "mamba_conv_states": ctx.mamba_conv_states,
                   "mamba_ssm_states": ctx.mamba_ssm_states})

    def delete_cuda_graphs(self):
        self.graph = self.graph_logits = None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        ctx.token_to_input_ids.copy_(tokens)
        if self.graph is not None:
            logits = replay(self.graph, self.graph_logits, size=MAX_REQUESTS).clone()
        else:
            logits = self.model.forward(ctx.token_to_input_ids, ctx)
        ctx.request_kv_length_offsets += 1              # update_requests: one token per request this step
        return logits

    def suspend(self):
        """Suspend engine by deallocating context's GPU state."""
        if self.is_suspended:
            return
        self.is_suspended = True
        self.context.deallocate_inference_state_buffers()
        if (self.context.kv_cache_management_mode != KVCacheManagementMode.PERSIST
                and not self.context.static_kv_memory_pointers):
            self.delete_cuda_graphs()

    def resume(self):
        """Resume engine by reallocating context's GPU state."""
        if not self.is_suspended:
            return
        self.is_suspended = False
        self.context.reinitialize_inference_state_buffers()
        if (self.enable_cuda_graph and self.context.kv_cache_management_mode != KVCacheManagementMode.PERSIST
                and not self.context.static_kv_memory_pointers):
            self.create_cuda_graphs()


def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    gen = generator(36960)
    tokens = [torch.randint(0, VOCAB, (MAX_REQUESTS,), generator=gen).to(device)
              for _ in range(STEPS_BEFORE + STEPS_AFTER)]

    def generate(use_cuda_graphs: bool):
        global torch_memory_saver
        torch_memory_saver = TorchMemorySaver()
        context = DynamicInferenceContext(static_kv_memory_pointers=use_cuda_graphs,
                                          kv_cache_management_mode=KVCacheManagementMode.OFFLOAD)
        engine = DynamicInferenceEngine(context, HybridModel(), enable_cuda_graph=use_cuda_graphs)
        for slot in range(MAX_REQUESTS):
            context.add_request(slot)
        logits = [engine.step(tokens[i]) for i in range(STEPS_BEFORE)]
        engine.suspend()
        scratch = torch.empty(4096, dtype=DTYPE, device=device).fill_(7.0)    # the training phase
        del scratch
        engine.resume()
        logits += [engine.step(tokens[i]) for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
        return [torch.stack(logits)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: generate(True), lambda: generate(False))
