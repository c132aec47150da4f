"""tinyworlds trains its video tokenizer with ``torch.compile(model, mode="reduce-overhead")`` (CUDA graph trees) and
gradient accumulation. Each optimizer step runs ``gradient_accumulation_steps`` micro-batches of ``loss, x_hat =
model(x); loss /= steps; loss.backward()`` after ``optimizer.zero_grad(set_to_none=True)``. The first micro-batch's
backward runs in the cudagraph tree's memory pool and autograd's ``AccumulateGrad`` steals its output as each
parameter's ``.grad``. The second micro-batch's ``model(x)`` is a new torch.compile invocation, so the tree starts a
new *generation* (no forward is waiting for its backward any more) and frees every live output of the path it leaves,
those ``.grad`` tensors included. The second backward then adds into a freed gradient: "accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run". The fix calls
``torch.compiler.cudagraph_mark_step_begin()`` once per optimizer step, before the micro-batch loop: with a step mark
set, the generation is the mark, which does not change between micro-batches, so the path (and the gradients on it)
stays alive until the next step.

Upstream: https://github.com/AlmondGod/tinyworlds/pull/12 ("Fix error with gradient_accumulation_steps > 1 by calling
cudagraph_mark_step_begin()", repository AlmondGod/tinyworlds, author SeanNobel; commit dc7a6d2 of 2025-11-14, merged
into main on 2025-11-22 as merge commit 305710d, approved "LGTM" by AlmondGod). Read, in a mirror of the repository:
the whole diff of dc7a6d2 (three identical two-line hunks in ``scripts/train_video_tokenizer.py``,
``scripts/train_latent_actions.py`` and ``scripts/train_dynamics.py``: ``if args.compile:
torch.compiler.cudagraph_mark_step_begin()`` before ``for micro_batch in range(args.gradient_accumulation_steps)``);
at dc7a6d2, ``scripts/train_video_tokenizer.py`` whole (``main``: ``torch.compile(model, mode="reduce-overhead",
fullgraph=False, dynamic=True)``, the decay/no-decay param groups, fused AdamW, ``create_cosine_scheduler``, the
training loop with ``zero_grad(set_to_none=True)``, ``loss /= gradient_accumulation_steps``, ``clip_grad_norm_(...,
1.0)``, ``results["loss_vals"]``), ``models/video_tokenizer.py`` (``VideoTokenizer``, ``VideoTokenizerEncoder``,
``VideoTokenizerDecoder``, ``PixelShuffleFrameHead``, the ``smooth_l1_loss`` reconstruction loss),
``models/patch_embed.py`` (``PatchEmbedding.proj``), ``models/fsq.py`` (``FiniteScalarQuantizer.forward``: tanh, scale
to ``[0, num_bins - 1]``, round with a straight-through gradient) and ``utils/scheduler_utils.py``. The PR's
description and review in the stored corpus (the description quotes the error, with a stack trace through
``video_tokenizer.py`` line 90, ``embeddings = self.encoder(frames)``, to ``patch_embed.py`` line 40, ``x =
self.proj(x)``). For the mechanism, PyTorch 2.13's (the installed wheel's) ``torch/_inductor/cudagraph_trees.py``:
``CUDAGraphTreeManager.run`` (``running_forwards_with_pending_backwards`` set by forwards, cleared by backwards),
``_run``, ``record_function``, ``execute_node``, ``run_eager``, ``get_curr_generation``, ``user_invoked_mark_step``,
``can_start_new_generation``, ``in_new_torch_compile_invocation``, ``try_end_curr_recording`` /
``try_end_curr_execution`` / ``try_end_curr_warmup``, ``dealloc_current_path_weakrefs``, ``format_dealloc_msg``,
``CUDAWarmupNode.run`` / ``path_live_weakrefs`` / ``all_outputs_are_dead``, ``CUDAGraphNode.run_first_inputs`` /
``run`` / ``reconstruct_outputs`` / ``create_storage`` / ``_allocate_and_copy_recording_inputs`` and the start of
``check_invariants``; ``torch/_dynamo/eval_frame.py`` and ``mutation_guard.py`` (``GenerationTracker.generation += 1``
on entering a compiled frame); and ``torch/include/torch/csrc/autograd/functions/accumulate_grad.h``
(``accumulateGrad``: Case 1.1 steals a stealable ``new_grad`` when ``variable_grad`` is undefined, counting a
cudagraph cached tensor's extra reference; Case 2.3 adds in place, ``variable_grad += new_grad``).
Not read: the tinyworlds issue or discussion behind the PR (none is linked), ``STTransformer``, the dataloaders,
``utils/distributed.py`` (FSDP/DDP paths), the other two training scripts beyond their hunks, the rest of PyTorch's
``CUDAGraphNode`` (``_record``, output alias bookkeeping, ``_initialize_cached_tensors``, allocator checkpointing),
and the PyTorch version tinyworlds ran (the 2.13 code read here keeps the generation rules of the November-2025
releases; its gradient-specific error message is newer, so the message modelled is the general one the PR quotes).
Symptom: with ``--compile`` and ``gradient_accumulation_steps > 1`` training stops at the first step's second
micro-batch: "RuntimeError: Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
run. Stack trace: File ".../models/video_tokenizer.py", line 90, in forward embeddings = self.encoder(frames) ... File
".../models/patch_embed.py", line 40, in forward x = self.proj(x) ... To prevent overwriting, clone the tensor outside
of torch.compile() or call torch.compiler.cudagraph_mark_step_begin() before each model invocation." (the PR
description).
Mechanism: micro-batch 0: the tree warms up the compiled forward and backward in its pool (``CUDAWarmupNode``); the
backward's gradient outputs are stolen by ``AccumulateGrad`` (``.grad`` was set to None), so each ``param.grad`` is a
tensor on pool memory that the warmup path tracks as a live output. Micro-batch 1: ``model(x)`` enters a compiled
frame (``GenerationTracker.generation += 1``); ``_run`` is in warmup and asks ``try_end_curr_warmup``:
``can_start_new_generation`` sees a new invocation, no user step mark, and no forward pending a backward, so
``dealloc_current_path_weakrefs`` frees the path's live outputs and sets an access error on their storages, the
gradients included, and the forward is then recorded as a new root (its backward as its child). The second backward's
``AccumulateGrad`` reads the freed ``param.grad`` (``variable_grad += new_grad``) and raises. With the fix, the mark
taken before the loop is the generation for every micro-batch of the step (``get_curr_generation`` returns the mark
when one is set), ``in_new_torch_compile_invocation`` stays False, the live gradients keep the path, and micro-batch 1
warms up (later: records, then replays) as a child with its own memory; the next step's mark ends the path after
``zero_grad`` dropped the gradients.
Doctor: dangling-reference, at ``main``. The read that fails is of memory its owner released: the gradient buffer
belongs to the cudagraph tree's pool, which frees it (and poisons its storage) at the generation boundary while
autograd still holds it as ``param.grad`` for the next micro-batch's accumulation. ``main`` (the training loop) is
where the defect is decided and what the fix changes: it runs several compiled invocations per optimizer step without
telling the tree where the step begins, so every micro-batch is taken for a new iteration whose predecessors' outputs
are dead. (The tree's ``dealloc_current_path_weakrefs`` is where the memory is released; the fix does not change
PyTorch.)
Fix (upstream): ``if args.compile: torch.compiler.cudagraph_mark_step_begin()`` right after
``optimizer.zero_grad(set_to_none=True)`` (and the FSDP ``set_requires_gradient_sync(False)``), before the micro-batch
loop, in all three training scripts.
Modelled: tinyworlds' ``main`` (training loop as read, with ``args.compile``, ``gradient_accumulation_steps``,
``n_updates``), ``VideoTokenizer`` (parameters named as upstream: ``encoder.patch_embed.proj``,
``encoder.latent_head``, ``decoder.latent_embed``, ``decoder.frame_head.to_pixels``; forward returns ``(recon_loss,
x_hat)``, with ``FiniteScalarQuantizer``'s math), ``unwrap_model``, ``create_cosine_scheduler`` /
``cosine_with_warmup``; PyTorch's ``GenerationTracker``, ``MarkStepBox``, ``cudagraph_mark_step_begin``,
``CompilationMode``, ``ExecutionState``, ``CUDAGraphTreeManager`` (``run``, ``_run``, ``record_function``,
``execute_node``, ``run_eager``, ``get_curr_generation``, ``user_invoked_mark_step``, ``can_start_new_generation``,
``in_new_torch_compile_invocation``, the three ``try_end_curr_*``, ``dealloc_current_path_weakrefs``,
``format_dealloc_msg``, ``clear_current_path_state_and_set_to_none``), ``CUDAWarmupNode`` and ``CUDAGraphNode``
(``run``, ``run_first_inputs``, ``check_invariants``, ``_copy_inputs_and_remove_from_src``, ``path_live_weakrefs``,
``all_outputs_are_dead``, ``_path_from_root``), ``StorageWeakRefWrapper``, and AOTAutograd's ``CompiledFunction``
(compiled forward returning user outputs plus saved activations; compiled backward taking them and the tangent, both
run through the tree).
Stand-ins: the model is a per-patch MLP autoencoder in float64 (frames ``[2, 2, 3, 4, 4]``, 2x2 patches, embed 8,
latent 3, 4 FSQ bins); the spatio-temporal transformers are one ``tanh`` each and positional encodings are left out;
``smooth_l1_loss`` (beta 1) is written out. The compiled forward/backward are hand-written joint graphs (what
AOTAutograd would trace), the same functions serve the run without graphs (upstream: eager modules and autograd).
AdamW uses PyTorch's default implementation (upstream: ``fused=True``). The C++ storage poison
(``_set_storage_data_ptr_access_error_msg``) is a table keyed by storage, checked where the program reads tensors the
tree may have freed: node inputs and, as a pre-hook on each parameter, ``AccumulateGrad``'s read of ``variable.grad``;
memory is not actually freed. Gradient stealing is PyTorch's own (real autograd and ``AccumulateGrad`` run the
backward; the compiled backward is an ``autograd.Function``'s). Graph outputs are handed out on fresh non-owning
storages over the graph's output memory (``_construct_storage_from_data_pointer``, as ``create_storage`` does) on
every run, so liveness is the caller's holding them (upstream: the recording run hands out the capture's own tensors,
and executions return the same cached TensorImpls, whose liveness discounts the cache's reference).
``loss.cpu().detach()`` is written as an explicit copy: on CUDA it is one, on the CPU ``.cpu()`` would alias the
graph's output. Allocator checkpointing (``apply_checkpoint_execution_state_in_allocator``), re-record limits,
mutation checks and the unable-to-hit-fast-path warning are left out; no workload here reaches them. Warmups run
eagerly and are announced as real steps (their results are handed out).
Workload: 4 optimizer steps of 2 micro-batches (8 seeded frame batches); eager is the same loop without compile and
without the tree. Outputs: each step's last micro-batch loss (``results["loss_vals"]``) and the final parameters.
Measured: bug: misbehaves (raised RuntimeError: Error: accessing tensor output of CUDAGraphs that has been overwritten
by a subsequent run. Stack trace: File "models/video_tokenizer.py", line 90, in forward), at step 1, micro-batch 1's
backward, after the tree recorded that micro-batch's forward and backward. Fix: equals eager (max |graph - eager| =
0): step 1 warms up, step 2 records four graphs (forward/backward for each micro-batch), steps 3-4 replay them. About
1 s per variant on the CPU.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/AlmondGod/tinyworlds/pull/12"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "main"
SYMPTOM = ("reduce-overhead training with gradient accumulation fails at the second micro-batch: each compiled call "
           "starts a new cudagraph-tree generation, which frees the graph-pool gradients autograd stole as .grad, and "
           "the next backward accumulates into freed memory ('accessing tensor output of CUDAGraphs that has been "
           "overwritten by a subsequent run')")

DTYPE = torch.float64
BATCH, FRAMES, CHANNELS, SIZE, PATCH = 2, 2, 3, 4, 2
EMBED, LATENT, NUM_BINS = 8, 3, 4
N_UPDATES, GRAD_ACCUM = 4, 2
_variant = "bug"


# --- tinyworlds: models/video_tokenizer.py, patch_embed.py, fsq.py (reduced) ---------------------------------------

def patchify(frames):
    """``rearrange(frames, 'b t c (hp p1) (wp p2) -> (b t hp wp) (c p1 p2)')``."""
    b, t, c, h, w = frames.shape
    x = frames.reshape(b, t, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 3, 5, 2, 4, 6)
    return x.reshape(b * t * (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpatchify(patches):
    hp = wp = SIZE // PATCH
    x = patches.reshape(BATCH, FRAMES, hp, wp, CHANNELS, PATCH, PATCH).permute(0, 1, 4, 2, 5, 3, 6)
    return x.reshape(BATCH, FRAMES, CHANNELS, SIZE, SIZE)


class VideoTokenizer(nn.Module):
    """``forward(frames) -> (recon_loss, x_hat)``, written as AOTAutograd's joint graph (``aot_forward`` /
    ``aot_backward``) so that the compiled and the eager run compute the same ops."""

    model_type = "VideoTokenizer"

    def __init__(self, device):
        super().__init__()
        pixels = CHANNELS * PATCH * PATCH               # upstream: 1x1 convs on patches; LayerNorm left out
        self.encoder, self.decoder = nn.Module(), nn.Module()
        self.encoder.patch_embed, self.decoder.frame_head = nn.Module(), nn.Module()
        self.encoder.patch_embed.proj = nn.Linear(pixels, EMBED, dtype=DTYPE)
        self.encoder.latent_head = nn.Linear(EMBED, LATENT, dtype=DTYPE)
        self.decoder.latent_embed = nn.Linear(LATENT, EMBED, dtype=DTYPE)
        self.decoder.frame_head.to_pixels = nn.Linear(EMBED, pixels, dtype=DTYPE)
        gen = generator(12)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=DTYPE) * 0.5)
        self.to(device)

    def layers(self):
        return (self.encoder.patch_embed.proj, self.encoder.latent_head, self.decoder.latent_embed,
                self.decoder.frame_head.to_pixels)

    def flat_params(self):
        return [t for layer in self.layers() for t in (layer.weight, layer.bias)]


def aot_forward(inputs):
    """Compiled forward graph (boxed inputs: ``[frames, *params]``): user outputs, then saved activations."""
    frames, wp, bp, wl, bl, we, be, wo, bo = inputs
    inputs.clear()
    patches = patchify(frames)
    a = torch.tanh(patches @ wp.t() + bp)                    # patch_embed.proj + encoder transformer (stand-in)
    t = torch.tanh(a @ wl.t() + bl)                          # latent_head, FiniteScalarQuantizer: tanh
    bounded = 0.5 * (t + 1) * (NUM_BINS - 1)                 # scale_and_shift
    q = 2 * torch.round(bounded) / (NUM_BINS - 1) - 1        # round (straight-through), unscale_and_unshift
    g = torch.tanh(q @ we.t() + be)                          # latent_embed + decoder transformer (stand-in)
    xh = g @ wo.t() + bo                                     # frame_head.to_pixels
    r = xh - patches
    ar = r.abs()
    recon_loss = torch.where(ar < 1, 0.5 * r * r, ar - 0.5).mean()   # F.smooth_l1_loss(x_hat, frames)
    return recon_loss, unpatchify(xh), patches, a, t, q, g, r


def aot_backward(inputs):
    """Compiled backward graph (boxed inputs: ``[*saved, tangent, *params]``): gradients of the eight parameters."""
    patches, a, t, q, g, r, tangent, wp, bp, wl, bl, we, be, wo, bo = inputs
    inputs.clear()
    dxh = r.clamp(-1, 1) * (tangent / r.numel())
    dg = (dxh @ wo) * (1 - g * g)
    dt = (dg @ we) * (1 - t * t)                             # straight-through: d q / d t = 1 after unscale
    da = (dt @ wl) * (1 - a * a)
    return (da.t() @ patches, da.sum(0), dt.t() @ a, dt.sum(0), dg.t() @ q, dg.sum(0), dxh.t() @ g, dxh.sum(0))


_VT = 'File "models/video_tokenizer.py", line '
_PROJ = (_VT + '90, in forward\n    embeddings = self.encoder(frames)  # [B, T, P, L]\n  ' + _VT + '25, in forward\n'
         '    embeddings = self.patch_embed(frames)  # [B, T, P, E]\n'
         '  File "models/patch_embed.py", line 40, in forward\n    x = self.proj(x) # [(B*T), E, Hp, Wp]')
STACK_TRACES = {   # per output; a backward output carries the forward line of its parameter's layer
    "forward": [_VT + '92, in forward\n    recon_loss = F.smooth_l1_loss(x_hat, frames)',
                _VT + '91, in forward\n    x_hat = self.decoder(quantized_z)'] + [None] * 6,
    "backward": [_PROJ] * 2 + [_VT + '27, in forward\n    predicted_latents = self.latent_head(transformed)'] * 2
                + [_VT + '60, in forward\n    embedding = self.latent_embed(latents)'] * 2
                + [_VT + '43, in forward\n    x = self.to_pixels(x)'] * 2,
}


# --- PyTorch: the C++ storage poison (stand-in) and AccumulateGrad's read of variable.grad ---------------------------

_storage_access_errors: dict[int, tuple[torch.UntypedStorage, str]] = {}


def _set_storage_data_ptr_access_error_msg(cdata: int, msg: str):
    """Any later data access of that storage raises ``msg`` (C++ in torch; the storage is kept so its id stays its)."""
    _storage_access_errors[cdata] = (torch.UntypedStorage._new_with_weak_ptr(cdata), msg)


def _check_storage_access(t):
    if isinstance(t, torch.Tensor):
        hit = _storage_access_errors.get(t.untyped_storage()._cdata)
        if hit is not None:
            raise RuntimeError(hit[1])


def _accumulate_grad_reads_variable_grad(param):
    """``AccumulateGrad::accumulateGrad`` reads ``variable.grad`` (Case 2.3: ``variable_grad += new_grad``)."""
    def pre_hook(new_grad):
        _check_storage_access(param.grad)
    return pre_hook


# --- PyTorch: torch/_dynamo generation tagging, torch/_inductor/cudagraph_trees.py (reduced) -------------------------

class GenerationTracker:
    generation = 0


class MarkStepBox:
    mark_step_counter = 0


def cudagraph_mark_step_begin():
    """``torch.compiler.cudagraph_mark_step_begin``: iterate down to distinguish from the generation counter."""
    MarkStepBox.mark_step_counter -= 1


class CompilationMode(enum.Enum):
    FORWARD, BACKWARD = range(2)


class ExecutionState(enum.Enum):
    NONE, WARMUP, RECORDING, EXECUTION = range(4)


@dataclasses.dataclass(frozen=True)
class WrappedFunction:
    model: object
    static_input_idxs: tuple
    id: str


class StorageWeakRefWrapper:
    def __init__(self, t):
        self.ref = StorageWeakRef(t.untyped_storage())
        self._data_ptr = t.untyped_storage().data_ptr()

    def __call__(self):
        return None if self.ref.expired() else self.ref.cdata

    def data_ptr(self):
        return self._data_ptr


def is_live(ref) -> bool:
    return ref is not None and ref() is not None


class _PathNode:
    parent = None

    @property
    def _path_from_root(self):
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return reversed(nodes)

    def path_live_weakrefs(self):
        for node in self._path_from_root:
            for output in node.outputs_weakrefs:
                if is_live(output):
                    yield output

    def all_outputs_are_dead(self) -> bool:
        return not list(self.path_live_weakrefs())

    def _is_cuda_graph_recorded_tensor(self, t) -> bool:
        return any(t.untyped_storage().data_ptr() == ref.data_ptr() for ref in self.path_live_weakrefs())


class CUDAWarmupNode(_PathNode):
    def __init__(self, wrapped_function, parent, stack_traces):
        self.wrapped_function, self.parent, self.stack_traces = wrapped_function, parent, stack_traces
        self.outputs_weakrefs = []

    def run(self, new_inputs):
        existing_path_data_ptrs = {ref.data_ptr() for ref in self.path_live_weakrefs()}
        non_cudagraph_inps = {t.untyped_storage()._cdata for t in new_inputs
                              if t.untyped_storage().data_ptr() not in existing_path_data_ptrs}
        for t in new_inputs:
            _check_storage_access(t)
        with events.warmup(real=True):                  # an eager run in the graph pool whose results are handed out
            out = self.wrapped_function.model(new_inputs)
        add_ref = lambda o: o.untyped_storage()._cdata not in non_cudagraph_inps
        self.outputs_weakrefs = [StorageWeakRefWrapper(o) if add_ref(o) else None for o in out]
        return out


def _cached_output(static):
    """A fresh tensor on a fresh non-owning storage over the graph's output memory (upstream reconstructs outputs from
    the recorded storage data pointers): what the caller holds, and what liveness is measured on."""
    storage = torch._C._construct_storage_from_data_pointer(static.untyped_storage().data_ptr(), static.device,
                                                          static.untyped_storage().nbytes())
    return torch.empty(0, dtype=static.dtype, device=static.device).set_(storage, static.storage_offset(),
                                                                        static.size(), static.stride())


class CUDAGraphNode(_PathNode):
    def __init__(self, wrapped_function, parent, inputs, pool, device, stack_traces, name):
        self.wrapped_function, self.parent, self.stack_traces = wrapped_function, parent, stack_traces
        self.children: dict[str, list] = {}
        self.outputs_weakrefs = []
        static = set(wrapped_function.static_input_idxs)
        if parent is not None:      # outputs of the path are used in place (stable addresses), not copied
            static |= {i for i, t in enumerate(inputs) if parent._is_cuda_graph_recorded_tensor(t)}
        self.static_input_idxs = static
        self.static_input_data_ptrs = [t.data_ptr() if i in static else None for i, t in enumerate(inputs)]
        self.recording_inputs = [(t if i in wrapped_function.static_input_idxs else _cached_output(t)) if i in static
                                 else self._allocate_recording_input(t) for i, t in enumerate(inputs)]
        copied = {f"{wrapped_function.id}.arg{i}": t for i, t in enumerate(self.recording_inputs) if i not in static}
        self.graph, self.static_outputs = capture(
            lambda: wrapped_function.model(list(self.recording_inputs)), device=device, pool=pool, warmups=0,
            name=name, static=copied, owner="CUDAGraphTreeManager")
        self.recording_outputs = replay(self.graph, self.static_outputs)    # upstream replays once after recording

    @staticmethod
    def _allocate_recording_input(t):
        _check_storage_access(t)
        static = torch.empty_like(t)
        static.copy_(t)
        return static

    def add_child(self, function_id, node):
        self.children.setdefault(function_id, []).append(node)

    def check_invariants(self, inputs) -> bool:
        return all(ptr is None or t.data_ptr() == ptr for t, ptr in zip(inputs, self.static_input_data_ptrs))

    def _copy_inputs_and_remove_from_src(self, dsts, srcs):
        for i, (dst, src) in enumerate(zip(dsts, srcs)):
            _check_storage_access(src)
            if i not in self.static_input_idxs:
                dst.copy_(src)
        srcs.clear()

    def _hand_out(self, views):
        out = tuple(_cached_output(v) for v in views)
        self.outputs_weakrefs = [StorageWeakRefWrapper(o) for o in out]
        return out

    def run_first_inputs(self, new_inputs):
        new_inputs.clear()
        views, self.recording_outputs = self.recording_outputs, None
        return self._hand_out(views)

    def run(self, new_inputs):
        self._copy_inputs_and_remove_from_src(self.recording_inputs, new_inputs)
        return self._hand_out(replay(self.graph, self.static_outputs))


class CUDAGraphTreeManager:
    def __init__(self, device):
        self.device = device
        self.cuda_graphs_thread_pool = graph_pool_handle(device)
        self.roots: dict[str, list] = {}
        self.ids_to_funcs: dict[str, WrappedFunction] = {}
        self.id_to_mode: dict[str, CompilationMode] = {}
        self.warmed_up_functions: set[str] = set()
        self._current_node = None
        self.path_state = ExecutionState.NONE
        self.current_gen = -1
        self.running_forwards_with_pending_backwards = False
        self.graph_counter = itertools.count()

    def add_function(self, model, static_input_idxs, mode, function_id, params):
        self.ids_to_funcs[function_id] = WrappedFunction(model, tuple(static_input_idxs), function_id)
        self.id_to_mode[function_id] = mode
        for p in params:                                      # stand-in for the C++ poison check on .grad reads
            p.register_hook(_accumulate_grad_reads_variable_grad(p))
        return functools.partial(self.run, function_id=function_id)

    @property
    def current_node(self):
        return self._current_node

    @current_node.setter
    def current_node(self, value):
        self._current_node = value
        if value is None:
            self.path_state = ExecutionState.NONE

    in_recording = property(lambda self: self.path_state == ExecutionState.RECORDING)
    in_warmup = property(lambda self: self.path_state == ExecutionState.WARMUP)

    def run(self, new_inputs, function_id):
        out = self._run(new_inputs, function_id)
        # The forwards are only pending following invocation, not before
        self.running_forwards_with_pending_backwards = self.id_to_mode[function_id] == CompilationMode.FORWARD
        return out

    def _run(self, new_inputs, function_id):
        if self.in_recording:
            self.try_end_curr_recording(function_id)
        if self.in_warmup:
            self.try_end_curr_warmup(function_id)
        if function_id not in self.warmed_up_functions or self.in_warmup:
            return self.run_eager(new_inputs, function_id)
        child_nodes = self.roots if self.current_node is None else self.current_node.children
        if not self.in_recording:
            for child in child_nodes.get(function_id, []):
                if child.check_invariants(new_inputs):
                    return self.execute_node(child, new_inputs)
            if self.current_node is not None and function_id in self.roots:
                self.try_end_curr_execution()
                if self.current_node is None:             # run again to hit the root matching case
                    return self.run(new_inputs, function_id)
            self.try_end_curr_execution()
        return self.record_function(new_inputs, function_id)

    def record_function(self, new_inputs, function_id):
        node = CUDAGraphNode(self.ids_to_funcs[function_id], self.current_node, new_inputs,
                             self.cuda_graphs_thread_pool, self.device, STACK_TRACES[function_id],
                             name=f"{function_id} graph {next(self.graph_counter)}")
        if self.current_node is None:
            self.roots.setdefault(function_id, []).append(node)
        else:
            self.current_node.add_child(function_id, node)
        self.current_node = node
        self.path_state = ExecutionState.RECORDING
        self.update_generation()
        return node.run_first_inputs(new_inputs)

    def execute_node(self, node, new_inputs):
        self.current_node = node
        self.path_state = ExecutionState.EXECUTION
        self.update_generation()
        return node.run(new_inputs)

    def run_eager(self, new_inputs, function_id):
        self.warmed_up_functions.add(function_id)
        node = CUDAWarmupNode(self.ids_to_funcs[function_id], self.current_node, STACK_TRACES[function_id])
        self.current_node = node
        self.path_state = ExecutionState.WARMUP
        self.update_generation()
        return node.run(new_inputs)

    def update_generation(self):
        self.current_gen = self.get_curr_generation()

    @staticmethod
    def get_curr_generation() -> int:
        if MarkStepBox.mark_step_counter != 0:
            return MarkStepBox.mark_step_counter
        return GenerationTracker.generation

    @staticmethod
    def user_invoked_mark_step() -> bool:
        return MarkStepBox.mark_step_counter != 0

    def can_start_new_generation(self) -> bool:
        if not self.in_new_torch_compile_invocation():
            return False
        if self.user_invoked_mark_step():
            return True
        return not self.running_forwards_with_pending_backwards

    def in_new_torch_compile_invocation(self) -> bool:
        return self.current_gen != self.get_curr_generation()

    def try_end_curr_recording(self, function_id):
        if self.can_start_new_generation():             # multiple invocations, allow overwriting the previous one
            self.dealloc_current_path_weakrefs()
            self.clear_current_path_state_and_set_to_none()
            return
        if self.current_node.all_outputs_are_dead():
            self.clear_current_path_state_and_set_to_none()

    def try_end_curr_execution(self):
        if self.current_node is None:
            return
        if self.can_start_new_generation() or self.current_node.all_outputs_are_dead():
            self.clear_current_path_state_and_set_to_none()

    def try_end_curr_warmup(self, function_id):
        if self.can_start_new_generation():
            self.dealloc_current_path_weakrefs()
            self.current_node = None
            return
        if self.current_node.all_outputs_are_dead():
            self.current_node = None

    @staticmethod
    def format_dealloc_msg(stack_trace):
        stack_trace = stack_trace.strip() if stack_trace else "[Could not find stack trace]"
        return ("Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run. "
                f"Stack trace: {stack_trace}. To prevent overwriting, clone the tensor outside of torch.compile() "
                "or call torch.compiler.cudagraph_mark_step_begin() before each model invocation.")

    def dealloc_current_path_weakrefs(self):
        """Free every live output of the current path (here: poison its storage; nothing is freed)."""
        stack_traces = {}
        for node in self.current_node._path_from_root:
            for ref, stack_trace in zip(node.outputs_weakrefs, node.stack_traces):
                if ref is not None:
                    stack_traces[ref.data_ptr()] = stack_trace
        for storage_ref in self.current_node.path_live_weakrefs():
            cdata = storage_ref()
            if cdata is not None and cdata not in _storage_access_errors:
                _set_storage_data_ptr_access_error_msg(
                    cdata, self.format_dealloc_msg(stack_traces.get(storage_ref.data_ptr())))

    def clear_current_path_state_and_set_to_none(self):
        self.current_node = None


# --- AOTAutograd + torch.compile(mode="reduce-overhead") (stand-in) -------------------------------------------------

class CompiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, compiled_fw, compiled_bw, frames, *params):
        recon_loss, x_hat, *saved = compiled_fw([frames, *params])
        ctx.save_for_backward(*saved, *params)
        ctx.compiled_bw, ctx.num_saved = compiled_bw, len(saved)
        ctx.mark_non_differentiable(x_hat)
        return recon_loss, x_hat

    @staticmethod
    def backward(ctx, grad_loss, grad_x_hat):
        tensors = ctx.saved_tensors
        saved, params = tensors[:ctx.num_saved], tensors[ctx.num_saved:]
        grads = ctx.compiled_bw([*saved, grad_loss.contiguous(), *params])
        return (None, None, None, *grads)


class OptimizedModule:
    """``torch.compile(model, mode="reduce-overhead")``: a compiled frame whose forward and backward graphs run
    through the device's ``CUDAGraphTreeManager``; ``compile=False`` runs the same graphs without the tree."""

    def __init__(self, model, manager=None):
        self._orig_mod, self.manager = model, manager
        params = model.flat_params()
        if manager is None:
            self.compiled_fw, self.compiled_bw = aot_forward, aot_backward
        else:
            n = len(params)
            self.compiled_fw = manager.add_function(aot_forward, range(1, 1 + n), CompilationMode.FORWARD,
                                                    "forward", params)
            self.compiled_bw = manager.add_function(aot_backward, range(7, 7 + n), CompilationMode.BACKWARD,
                                                    "backward", [])

    def __call__(self, frames):
        if self.manager is not None:
            GenerationTracker.generation += 1          # OptimizeContext on_enter: install_generation_tagging_init
        return CompiledFunction.apply(self.compiled_fw, self.compiled_bw, frames, *self._orig_mod.flat_params())


def unwrap_model(model):
    return getattr(model, "_orig_mod", model)


# --- tinyworlds: utils/scheduler_utils.py, scripts/train_video_tokenizer.py (reduced) ---------------------------------

def create_cosine_scheduler(optimizer, total_steps, warmup_fraction=0.05, min_lr_fraction=0.01):
    """``utils/scheduler_utils.py``: linear warmup, then cosine down to ``min_lr_fraction``."""
    warmup_steps = int(total_steps * warmup_fraction)

    def cosine_with_warmup(step):
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr_fraction + (1 - min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=cosine_with_warmup)


@dataclasses.dataclass
class VideoTokenizerConfig:
    device: str
    compile: bool
    n_updates: int = N_UPDATES
    gradient_accumulation_steps: int = GRAD_ACCUM
    learning_rate: float = 1e-2


def training_loader(device):
    gen = generator(1212)
    batches = [torch.rand(BATCH, FRAMES, CHANNELS, SIZE, SIZE, generator=gen, dtype=DTYPE)
               for _ in range(N_UPDATES * GRAD_ACCUM)]
    return [(x, None) for x in batches]


def main(args: VideoTokenizerConfig):
    model = VideoTokenizer(args.device)
    if args.compile:
        model = OptimizedModule(model, CUDAGraphTreeManager(args.device))
    else:
        model = OptimizedModule(model)

    decay, no_decay = [], []
    for name, param in unwrap_model(model).named_parameters():
        if param.requires_grad:
            (no_decay if len(param.shape) == 1 or name.endswith(".bias") or "norm" in name else decay).append(param)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0}],
                                  lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8)   # upstream: fused=True
    scheduler = create_cosine_scheduler(optimizer, args.n_updates)
    results = {"n_updates": 0, "loss_vals": []}

    train_iter = iter(training_loader(args.device))
    for i in range(args.n_updates):
        optimizer.zero_grad(set_to_none=True)
        if args.compile and _variant == "fix":          # the fix (PR #12)
            cudagraph_mark_step_begin()
        for micro_batch in range(args.gradient_accumulation_steps):
            (x, _) = next(train_iter)
            x = x.to(args.device, non_blocking=True)
            loss, x_hat = model(x)
            loss /= args.gradient_accumulation_steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(unwrap_model(model).parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        results["loss_vals"].append(loss.detach().to("cpu", copy=True))   # upstream: loss.cpu().detach()
        results["n_updates"] = i

    return [torch.stack(results["loss_vals"]), torch.cat([p.detach().reshape(-1) for p in
                                                          unwrap_model(model).parameters()])]


def run(variant: str, device: str = "cpu"):
    global _variant

    def eager():
        return [t.clone() for t in main(VideoTokenizerConfig(device=device, compile=False))]

    def served():
        GenerationTracker.generation, MarkStepBox.mark_step_counter = 0, 0
        _storage_access_errors.clear()
        try:
            return [t.clone() for t in main(VideoTokenizerConfig(device=device, compile=True))]
        finally:
            _storage_access_errors.clear()

    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
    finally:
        _variant = "bug"
