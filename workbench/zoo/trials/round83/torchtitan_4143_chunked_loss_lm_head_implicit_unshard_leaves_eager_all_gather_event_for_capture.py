"""torchtitan's ChunkedLossWrapper lets FSDP unshard lm_head implicitly, inside its first chunk forward. That leaves the eager warmup's all-gather event in FSDP's shared all_gather_state, and the next step's CUDA-graph capture waits on it and fails (stream-capture isolation).

Upstream: https://github.com/pytorch/torchtitan/pull/4143 ("Fix CUDA graph capture with FSDP always reshard", Simon
Fan, merged 2026-08-13 as 04326fc8e on main; no linked issue). The same PR removes ``--training.disable_cuda_graphs``
from the ``--parallelism.fsdp_reshard_after_forward always`` integration test. The graph wrapper comes from #3559
(f84224af0), which lists "FSDP reshard_after_forward=always is unsupported ... CUDA_ERROR_STREAM_CAPTURE_ISOLATION"
as a known limitation. Its ``CUDAGraphWrapper`` has a TODO about exactly this event.
Symptom: training with CUDA graphs on (the default since #3559), FSDP with ``fsdp_reshard_after_forward=always``
and the chunked loss. Step 1 (the eager warmup) runs. Step 2 (the recording) fails with
CUDA_ERROR_STREAM_CAPTURE_ISOLATION. With ``--training.disable_cuda_graphs``, or with the "default"/"never" policies,
training works.
Mechanism: ``torchtitan/distributed/fsdp.py`` puts ``model.norm`` and ``model.lm_head`` in one FSDP unit,
``fully_shard([model.norm, model.lm_head], reshard_after_forward=policy == "always")``. With the chunked loss the
decoder forward runs with ``_skip_lm_head=True``, so it runs ``norm`` but not ``lm_head``. The root ``FSDPState._post_forward``
calls ``_force_complete_incomplete_states``, which reshards the whole group because the policy is "always". It also
consumes and clears the ``all_gather_state`` that ``norm`` left. ``ChunkedLossWrapper.__call__``
(``torchtitan/components/loss.py``) then calls ``lm_head.set_reshard_after_forward(False)`` and the related
setters, and runs ``lm_head(h_chunk)`` once per chunk. On the first chunk, FSDP's pre-forward hook
(``FSDPParamGroup.pre_forward``) has to unshard the group in the FORWARD training state. ``wait_for_unshard``
then keeps the all-gather result and its copy-out event in the shared ``comm_ctx.all_gather_state``, for
the next FSDP module to wait on ([Note: Overlapping all-gather copy-in and all-gather]). ``lm_head`` is the last
FSDP forward of the step, and the group never completes its post-forward (``norm`` does not run again), so
nothing consumes that state. The wrapper's final ``lm_head.reshard()`` does not clear it either, and neither
does the backward (``_root_post_backward_final_callback`` resets ``iter_forward_root`` and the group trackers, not
the all-gather state). ``CUDAGraphWrapper`` (``torchtitan/distributed/cudagraph.py``) runs step 1 eagerly on its
stream, then records step 2 under ``torch.cuda.graph(..., stream=_manager.stream, capture_error_mode="thread_local")``.
There, ``_root_pre_forward`` makes the all-gather streams wait on the capturing stream, which forks them into
the capture. The first FSDP all-gather (``tok_embeddings``) then reaches ``wait_for_unshard`` in FORWARD state and
makes those streams wait on the event that step 1 recorded outside any capture. CUDA refuses a captured wait on
uncaptured work, and the capture fails. Without graphs, the same wait is on an event that completed long ago,
and it is harmless.
Doctor: sync-in-capture, at __call__ (of ``ChunkedLossWrapper``). A capturing stream waits on an event recorded
outside the capture: a synchronisation with uncaptured work, which CUDA refuses during capture. The wait runs in
FSDP's ``wait_for_unshard``, but FSDP does what its contract says. The wrong decision is in
``ChunkedLossWrapper.__call__``: it leaves the unshard to the implicit pre-forward path, which fills the shared
state when nothing will consume it. The fix changed only this function.
Fix (upstream): after the three setters, ``ChunkedLossWrapper.__call__`` calls ``lm_head.unshard()`` explicitly
(under ``spmd.no_typecheck()``), while FSDP is idle. ``FSDPModule.unshard`` waits on the all-gather at once
(IDLE state: current-stream collectives, the copy-out event waited on, nothing saved). The first chunk's
pre-forward then finds the group unsharded and issues no all-gather, so ``all_gather_state`` stays empty
("This avoids populating the shared state while still reusing the unsharded weight across chunks").
Modelled: streams and events are Python objects on both backends, as the CPU engine has none. An event
remembers the capture of the stream it was recorded on. A stream that waits on a captured event joins that
capture. A capturing stream that waits on an event recorded outside its capture raises
cudaErrorStreamCaptureIsolation. No other capture rule is modelled (unjoined streams are not checked), and ops
run in program order. FSDP2 is cut down to what this path uses: ``fully_shard`` (the class swap to
``FSDP<Module>``, per-module states, grouped forward hooks), ``FSDPState`` (root/forward hooks,
``_force_complete_incomplete_states``, pre-backward hook, root post-backward callback), ``FSDPParamGroup``
(``unshard``/``wait_for_unshard``/``reshard``/pre- and post-forward) and ``FSDPModule`` (``unshard``, ``reshard``,
setters). They follow the stored pytorch ``_fsdp_state.py`` (with ``_force_complete_incomplete_states``) and ``_fsdp_param_group.py``. The dp_shard group has
2 ranks. Rank 1 runs the same step on the same batch, and its shards live in this process (``_peer_shard``).
The all-gather is a concatenation of the two ranks' copy-in buffers. The reduce-scatter is left to autograd
through that concatenation, which gives each rank's shard its slice of the full-weight gradient. So backward
runs no all-gather (pre-backward unshard is left out) and there is no post-backward reduce. Mixed precision,
DTensor/spmd types, prefetching, the mesh and ``_CUDAGraphManager``'s dummy capture are left out. Each trainer
gets its own manager (pool and stream). The branches of ``CUDAGraphWrapper.__call__`` (warm up, record,
replay) are its methods ``warmup``/``record``/``replay``, dispatched by ``wrap_with_cuda_graph``'s ``run``, and
``CrossEntropyLoss.__call__`` is the function ``cross_entropy_loss``. The model is an embedding, 2
residual tanh blocks, an RMSNorm and an untied lm_head. Training is 4 steps: 2 loss chunks, SGD and
``zero_grad(set_to_none=disable_cuda_graphs)``, as in ``Trainer.train_step``.
"""
from __future__ import annotations

import contextlib
import functools
from enum import Enum, auto
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Variable

from workbench.engine import CaptureError, events, graph_pool_handle
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/torchtitan/pull/4143"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "__call__"
SYMPTOM = ("with FSDP reshard_after_forward=always and the chunked loss, recording the CUDA graph (step 2) fails "
           "with CUDA_ERROR_STREAM_CAPTURE_ISOLATION: the first FSDP all-gather waits on the lm_head all-gather "
           "event that the eager warmup left in all_gather_state")

VOCAB, DIM, N_LAYERS, BATCH, SEQ, NUM_CHUNKS, STEPS, LR = 16, 8, 2, 2, 8, 2, 4, 0.1
WORLD_SIZE = 2
RESHARD_AFTER_FORWARD_POLICY = "always"
IGNORE_INDEX = -100


# --- the modelled CUDA runtime: streams, events, stream capture --------------------------------------------------

class _Capture:
    """One open stream capture: its origin stream and the streams that joined it."""

    def __init__(self, origin: "Stream"):
        self.origin, self.members = origin, {origin}


class Stream:
    """``torch.cuda.Stream``; ``capture`` is the capture this stream takes part in, if any."""

    def __init__(self, name: str):
        self.name = name
        self.capture: _Capture | None = None

    def __repr__(self):
        return f"<Stream {self.name}>"

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event if event is not None else Event()
        event.stream, event.capture = self, self.capture     # recorded on a capturing stream: a node of it
        return event

    def wait_event(self, event: "Event") -> None:
        """``cudaStreamWaitEvent``. From a capturing stream, the event must belong to the same capture."""
        cap = event.capture
        if self.capture is not None and cap is not self.capture:
            where = user_frame()
            what = "an event recorded outside any capture" if cap is None else "an event of another capture"
            raise CaptureError(
                f"CUDA error: operation would make the capture depend on uncaptured work "
                f"(CUDA_ERROR_STREAM_CAPTURE_ISOLATION): {self!r}, which is being captured, waits on {what} "
                f"(recorded on {event.stream!r}).\n  at {where}",
                op="cudaStreamWaitEvent", source=where)
        if cap is not None and self.capture is None:           # fork: this stream joins the capture
            self.capture = cap
            cap.members.add(self)

    def wait_stream(self, other: "Stream") -> None:
        """``Stream.wait_stream``: record an event on ``other`` and wait on it."""
        self.wait_event(other.record_event())


class Event:
    """``torch.cuda.Event``: ``record()`` uses the current stream."""

    def __init__(self):
        self.stream: Stream | None = None
        self.capture: _Capture | None = None

    def record(self, stream: Stream | None = None) -> "Event":
        return (stream or current_stream()).record_event(self)


DEFAULT_STREAM = Stream("default")
_current = [DEFAULT_STREAM]


def current_stream() -> Stream:
    return _current[-1]


@contextlib.contextmanager
def cuda_stream(s: Stream):
    """``torch.cuda.stream(s)``."""
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()


@contextlib.contextmanager
def stream_capture(s: Stream):
    """The stream side of ``torch.cuda.graph(g, pool=pool, stream=s)``: ``s`` is current and captured."""
    cap = _Capture(s)
    s.capture = cap
    try:
        with cuda_stream(s):
            yield
    finally:
        for member in cap.members:
            member.capture = None


# --- torch/distributed/fsdp/_fully_shard (cut down) ----------------------------------------------------------------

class TrainingState(Enum):
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()
    IDLE = auto()


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()


class ProcessGroup:
    """The dp_shard group (2 ranks). Rank 1 runs the same step on the same batch; its shards live in this
    process, so ``all_gather_into_tensor`` lays the two ranks' inputs out rank-major, as NCCL does."""

    def size(self) -> int:
        return WORLD_SIZE

    def all_gather_into_tensor(self, all_gather_input: torch.Tensor, peer_input: torch.Tensor) -> torch.Tensor:
        return torch.cat([all_gather_input, peer_input])


class AllGatherResult(NamedTuple):
    all_gather_output: torch.Tensor
    all_gather_event: Event | None
    all_gather_work: Any


# See [Note: Overlapping all-gather copy-in and all-gather]
class AllGatherState(NamedTuple):
    all_gather_result: AllGatherResult
    event: Event | None  # all-gather copy-out


class FSDPCommContext:
    """This has the communication state shared across FSDP states/parameter groups."""

    def lazy_init(self):
        # All-gather state and copy-in stream allow overlapping the next copy-in with the current all-gather in
        # forward; all-gather stream allows overlapping next all-gather with current forward compute
        self.all_gather_copy_in_stream = Stream("all_gather_copy_in_stream")
        self.all_gather_stream = Stream("all_gather_stream")
        self.all_gather_state: AllGatherState | None = None

    def get_all_gather_streams(self, async_op: bool, training_state: TrainingState) -> tuple[Stream, Stream]:
        if not async_op and training_state in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD):
            # Use separate streams for implicit prefetching
            return self.all_gather_copy_in_stream, self.all_gather_stream
        current = current_stream()
        return current, current


class FSDPParam:
    """One parameter: this rank's shard (registered on the module while sharded), rank 1's, and the unsharded
    view of the last all-gather's output."""

    def __init__(self, module: nn.Module, param_name: str):
        self._module, self._param_name = module, param_name
        param = getattr(module, param_name)
        self._orig_size = param.shape
        shards = param.detach().chunk(WORLD_SIZE, dim=0)
        self.sharded_param = nn.Parameter(shards[0].clone())
        self._peer_shard = nn.Parameter(shards[1].clone())          # rank 1's local shard
        self._unsharded_param: torch.Tensor | None = None
        self.all_gather_outputs: list[torch.Tensor] = []
        module._parameters[param_name] = self.sharded_param

    def init_unsharded_param(self):
        self._unsharded_param = self.all_gather_outputs[0].reshape(self._orig_size)

    def to_sharded(self):
        self._module._parameters[self._param_name] = self.sharded_param
        self._unsharded_param = None

    def to_unsharded(self):
        self._module._parameters[self._param_name] = self._unsharded_param


def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream):
    with cuda_stream(all_gather_copy_in_stream):
        # all_gather_copy_in: each rank's shards, flattened into its all-gather input
        all_gather_input = torch.cat([p.sharded_param.reshape(-1) for p in fsdp_params])
        peer_input = torch.cat([p._peer_shard.reshape(-1) for p in fsdp_params])
    all_gather_stream.wait_stream(all_gather_copy_in_stream)
    with cuda_stream(all_gather_stream):
        all_gather_output = group.all_gather_into_tensor(all_gather_input, peer_input)
        all_gather_event = all_gather_stream.record_event()
        return AllGatherResult(all_gather_output, all_gather_event, None)


def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
    if (event := all_gather_result.all_gather_event) is not None:
        current_stream().wait_event(event)
    out = all_gather_result.all_gather_output.view(group.size(), -1)
    offset = 0
    for fsdp_param in fsdp_params:
        numel = fsdp_param.sharded_param.numel()
        fsdp_param.all_gather_outputs = [out[:, offset:offset + numel]]
        offset += numel


class FSDPParamGroup:
    """This class represents a parameter group to communicate together."""

    def __init__(self, params: list[tuple[nn.Module, str]], modules: tuple[nn.Module, ...],
                 reshard_after_forward: bool, group: ProcessGroup):
        self.modules = modules
        self.fsdp_params = [FSDPParam(module, name) for module, name in params]
        self._all_gather_process_group = group
        self._training_state = TrainingState.IDLE
        self._sharded_state = ShardedState.SHARDED
        self._reshard_after_forward = reshard_after_forward     # post_forward_mesh_info is not None
        self.reduce_grads = True
        self.reshard_after_backward = True
        self.unshard_async_op = False
        self.comm_ctx = FSDPCommContext()
        self._all_gather_result: AllGatherResult | None = None

    # Runtime #
    def unshard(self, async_op: bool = False):
        if self._all_gather_result is not None:  # already called, pending wait
            return
        if self.is_unsharded:
            return  # no-op
        self._all_gather_result = foreach_all_gather(
            self.fsdp_params,
            self._all_gather_process_group,
            async_op,
            *self.comm_ctx.get_all_gather_streams(async_op, self._training_state),
        )

    def wait_for_unshard(self):
        if not self._all_gather_result:
            return  # no preceding unshard
        async_op = self._all_gather_result.all_gather_work is not None
        if self._training_state == TrainingState.FORWARD:  # implicit prefetch
            if prev_all_gather_state := self.comm_ctx.all_gather_state:
                self._wait_all_gather_streams_on_event(prev_all_gather_state.event)
                self.comm_ctx.all_gather_state = None  # free the all-gather result
        foreach_all_gather_copy_out(self._all_gather_result, self.fsdp_params, self._all_gather_process_group)
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_unsharded_param()
        self._to_unsharded()
        all_gather_copy_out_event = Event()
        all_gather_copy_out_event.record()
        if not async_op and self._training_state == TrainingState.FORWARD:
            # Defer free to allow for overlap of this copy-out with next all-gather collective
            self.comm_ctx.all_gather_state = AllGatherState(self._all_gather_result, all_gather_copy_out_event)
        else:
            self._wait_all_gather_streams_on_event(all_gather_copy_out_event)
        self._all_gather_result = None  # free unless saved in `all_gather_state`

    def _wait_all_gather_streams_on_event(self, event: Event | None):
        if event is not None:
            self.comm_ctx.all_gather_copy_in_stream.wait_event(event)
            self.comm_ctx.all_gather_stream.wait_event(event)

    def reshard(self):
        if self._training_state == TrainingState.FORWARD:
            if not self._reshard_after_forward:
                return
        self._to_sharded()

    def pre_forward(self, module, args, kwargs):
        self._training_state = TrainingState.FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        return args, kwargs

    def post_forward(self, module, input, output):
        self.reshard()
        self._training_state = TrainingState.IDLE
        return output

    def post_backward(self, *unused):
        # (the reduce-scatter is autograd through the all-gather here; resharding is what is left)
        self._training_state = TrainingState.POST_BACKWARD
        if self.reshard_after_backward:
            self.reshard()

    def finalize_backward(self):
        if self._all_gather_result is not None:
            if (event := self._all_gather_result.all_gather_event) is not None:
                current_stream().wait_event(event)
            self._all_gather_result = None

    def _to_sharded(self):
        if not self.is_sharded:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_sharded()
            self._sharded_state = ShardedState.SHARDED

    def _to_unsharded(self):
        if not self.is_unsharded:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_unsharded()
            self._sharded_state = ShardedState.UNSHARDED

    @property
    def is_sharded(self) -> bool:
        return self._sharded_state == ShardedState.SHARDED

    @property
    def is_unsharded(self) -> bool:
        return self._sharded_state == ShardedState.UNSHARDED


class FSDPStateContext:
    """This has state shared across FSDP states."""

    def __init__(self):
        self.all_states: list[FSDPState] = []
        self.iter_forward_root: FSDPState | None = None
        self.post_backward_final_callback_queued = False
        self.is_last_backward = True


class FSDPState:
    def __init__(self):
        self._fsdp_param_groups: list[FSDPParamGroup] = []
        self._is_root: bool | None = None
        self._state_ctx = FSDPStateContext()
        self._comm_ctx = FSDPCommContext()
        self._training_state = TrainingState.IDLE
        self._modules_to_run_forward: set[nn.Module] = set()
        self._auto_reshard_after_forward = True

    @property
    def _fsdp_param_group(self) -> FSDPParamGroup | None:
        return self._fsdp_param_groups[0] if self._fsdp_param_groups else None

    def init(self, modules: tuple[nn.Module, ...]):
        for module in modules:
            module.__dict__["_fsdp_state"] = self       # _insert_module_state
        self._modules = modules
        if len(modules) == 1:
            modules[0].register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self._post_forward, prepend=False)
        else:
            _register_group_forward_hooks(modules, self._pre_forward, self._post_forward,
                                          self._modules_to_run_forward)

    def _root_pre_forward(self, module, args, kwargs):
        self._lazy_init()
        if self._state_ctx.iter_forward_root is not None:
            return args, kwargs
        self._state_ctx.iter_forward_root = self
        # Wait for optimizer before implicitly prefetched all-gathers
        current = current_stream()
        self._comm_ctx.all_gather_copy_in_stream.wait_stream(current)
        self._comm_ctx.all_gather_stream.wait_stream(current)
        return args, kwargs

    def _lazy_init(self):
        if self._is_root is not None:
            return  # no-op: already initialized
        self._is_root = True
        root_module = self._modules[0]
        visited = set()
        for module in root_module.modules():
            if (state := module.__dict__.get("_fsdp_state")) is None:
                continue
            if module is not root_module:
                state._is_root = False
            if state not in visited:
                self._state_ctx.all_states.append(state)
            visited.add(state)
        self._comm_ctx.lazy_init()          # _init_shared_state
        for state in self._state_ctx.all_states:
            state._state_ctx = self._state_ctx
            state._comm_ctx = self._comm_ctx
            for fsdp_param_group in state._fsdp_param_groups:
                fsdp_param_group.comm_ctx = self._comm_ctx

    def _pre_forward(self, module, args, kwargs):
        if self._training_state == TrainingState.PRE_BACKWARD:
            return args, kwargs
        # With grouped ``fully_shard([a, b, ...])`` the pre-hook fires per module; root setup is one-shot.
        state_first_in_pass = self._training_state != TrainingState.FORWARD
        self._training_state = TrainingState.FORWARD
        if state_first_in_pass:
            args, kwargs = self._root_pre_forward(module, args, kwargs)
        for fsdp_param_group in self._fsdp_param_groups:
            args, kwargs = fsdp_param_group.pre_forward(module, args, kwargs)
        return args, kwargs

    def _post_forward(self, module, input, output):
        if self._training_state == TrainingState.PRE_BACKWARD:
            return output
        for fsdp_param_group in self._fsdp_param_groups:
            output = fsdp_param_group.post_forward(module, input, output)
        output = self._register_pre_backward_hook(output)
        self._training_state = TrainingState.IDLE
        if self._state_ctx.iter_forward_root is self:
            output = self._force_complete_incomplete_states(output)
            if all_gather_state := self._comm_ctx.all_gather_state:
                # Free the last all-gather result if needed
                self._comm_ctx.all_gather_copy_in_stream.wait_event(all_gather_state.event)
                self._comm_ctx.all_gather_stream.wait_event(all_gather_state.event)
                self._comm_ctx.all_gather_state = None  # free the all-gather result
            self._state_ctx.iter_forward_root = None
        return output

    def _force_complete_incomplete_states(self, output):
        # Complete post-forward for any state whose group forward did not run all modules (e.g. chunked loss
        # where model.forward skips head).
        for state in reversed(self._state_ctx.all_states):
            if state is self or not state._modules_to_run_forward:
                continue
            for fsdp_param_group in state._fsdp_param_groups:
                output = fsdp_param_group.post_forward(None, None, output)
            output = state._register_pre_backward_hook(output)
            state._training_state = TrainingState.IDLE
            state._modules_to_run_forward.clear()
        return output

    def _pre_backward(self, grad):
        self._training_state = TrainingState.PRE_BACKWARD
        self._register_root_post_backward_final_callback()
        return grad

    def _root_post_backward_final_callback(self):
        # Reset per-iteration state. With chunked loss, each standalone per-chunk call repopulates an inner
        # state's ``_modules_to_run_forward`` (and claims ``iter_forward_root``); clear both here.
        self._state_ctx.iter_forward_root = None
        for state in self._state_ctx.all_states:
            state._modules_to_run_forward.clear()
            for fsdp_param_group in reversed(state._fsdp_param_groups):
                if fsdp_param_group._training_state != TrainingState.POST_BACKWARD:
                    fsdp_param_group.post_backward()
                fsdp_param_group._training_state = TrainingState.IDLE
            state._training_state = TrainingState.IDLE
            if self._state_ctx.is_last_backward:
                for fsdp_param_group in state._fsdp_param_groups:
                    fsdp_param_group.finalize_backward()
        self._state_ctx.post_backward_final_callback_queued = False

    def _register_pre_backward_hook(self, output):
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._pre_backward)
        return output

    def _register_root_post_backward_final_callback(self):
        if self._state_ctx.post_backward_final_callback_queued:
            return
        self._state_ctx.post_backward_final_callback_queued = True
        Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)


def _register_group_forward_hooks(modules, pre_hook, post_hook, modules_to_run: set):
    """The pre-hook runs on every module pre-forward; the full post-hook runs when the last module of the
    group completes (otherwise only the output cast, which is the identity here)."""
    modules_set = set(modules)

    def wrapped_pre_hook(*args, **kwargs):
        if len(modules_to_run) == 0:
            modules_to_run.update(modules_set)
        return pre_hook(*args, **kwargs)

    def get_wrapped_post_hook(module):
        def wrapped_post_hook(hook_module, input, output):
            if module in modules_to_run:
                modules_to_run.remove(module)
                if len(modules_to_run) == 0:
                    return post_hook(hook_module, input, output)
            return output
        return wrapped_post_hook

    for module in modules:
        module.register_forward_pre_hook(wrapped_pre_hook, prepend=True, with_kwargs=True)
        module.register_forward_hook(get_wrapped_post_hook(module), prepend=False, always_call=True)


class _UnshardHandleImpl:
    def __init__(self, fsdp_param_group: FSDPParamGroup | None):
        self._fsdp_param_group = fsdp_param_group

    def wait(self):
        if self._fsdp_param_group is not None:
            self._fsdp_param_group.wait_for_unshard()
            self._fsdp_param_group = None


class FSDPModule:
    def _get_fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def unshard(self, async_op: bool = False):
        """Unshards the module's parameters by allocating memory and all-gathering the parameters."""
        fsdp_param_group = self._get_fsdp_state()._fsdp_param_group
        if fsdp_param_group is not None:
            fsdp_param_group.unshard(async_op=async_op)
        handle = _UnshardHandleImpl(fsdp_param_group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self):
        if fsdp_param_group := self._get_fsdp_state()._fsdp_param_group:
            fsdp_param_group.reshard()

    def _fsdp_modules(self, recurse: bool):
        return [m for m in (self.modules() if recurse else [self]) if isinstance(m, FSDPModule)]

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True):
        for module in self._fsdp_modules(recurse):
            state = module._get_fsdp_state()
            state._auto_reshard_after_forward = False
            if fsdp_param_group := state._fsdp_param_group:
                fsdp_param_group._reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        for module in self._fsdp_modules(recurse):
            if fsdp_param_group := module._get_fsdp_state()._fsdp_param_group:
                fsdp_param_group.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        for module in self._fsdp_modules(recurse):
            if fsdp_param_group := module._get_fsdp_state()._fsdp_param_group:
                fsdp_param_group.reduce_grads = requires_gradient_sync


@functools.cache
def _fsdp_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def _get_managed_params(module: nn.Module, root: nn.Module) -> list[tuple[nn.Module, str]]:
    """Parameters of ``module``'s tree not already managed by a nested ``fully_shard``."""
    if module is not root and "_fsdp_state" in module.__dict__:
        return []
    params = [(module, name) for name, _ in module.named_parameters(recurse=False)]
    for child in module.children():
        params += _get_managed_params(child, root)
    return params


def fully_shard(module, *, mesh: ProcessGroup, reshard_after_forward: bool = True):
    modules = tuple(module) if isinstance(module, list) else (module,)
    state = FSDPState()
    state.init(modules)
    params = [p for m in modules for p in _get_managed_params(m, m)]
    if params:
        state._fsdp_param_groups.append(FSDPParamGroup(params, modules, reshard_after_forward, mesh))
    for m in modules:
        m.__class__ = _fsdp_class(m.__class__)
    return module


# --- torchtitan/distributed/fsdp.py: apply_fsdp --------------------------------------------------------------------

def apply_fsdp(model: "Decoder", dp_mesh: ProcessGroup, reshard_after_forward_policy: str):
    reshard_after_forward = reshard_after_forward_policy != "never"     # get_fsdp_reshard_after_forward_policy
    fully_shard(model.tok_embeddings, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    # As an optimization, do not reshard_after_forward the last layers by default since FSDP would prefetch
    # them immediately.
    fully_shard([model.norm, model.lm_head], mesh=dp_mesh,
                reshard_after_forward=reshard_after_forward_policy == "always")
    for transformer_block in model.layers.values():
        fully_shard(transformer_block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh)


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every rank's shards (rank 0's are the model's parameters, rank 1's its peers), for the optimizer."""
    out = []
    for module in model.modules():
        state = module.__dict__.get("_fsdp_state")
        if state is not None and module is state._modules[0]:
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    out += [fsdp_param.sharded_param, fsdp_param._peer_shard]
    return out


# --- the model ----------------------------------------------------------------------------------------------------

class TransformerBlock(nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.w = nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=DIM ** -0.5))

    def forward(self, x):
        return x + torch.tanh(x @ self.w.T)


class RMSNorm(nn.Module):
    def __init__(self, device, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(DIM, device=device))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Decoder(nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(4143)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM, device=device)
        with torch.no_grad():
            self.tok_embeddings.weight.copy_(randn(VOCAB, DIM, gen=gen, device=device))
        self.layers = nn.ModuleDict({str(i): TransformerBlock(gen, device) for i in range(N_LAYERS)})
        self.norm = RMSNorm(device)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False, device=device)
        with torch.no_grad():
            self.lm_head.weight.copy_(randn(VOCAB, DIM, gen=gen, device=device, scale=DIM ** -0.5))
        self._skip_lm_head = False

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        if self._skip_lm_head:
            return h
        return self.lm_head(h)


# --- torchtitan/components/loss.py --------------------------------------------------------------------------------

def cross_entropy_loss(pred, labels, global_valid_tokens=None):
    """``CrossEntropyLoss``: sum-reduced cross entropy, normalised by the global count of valid tokens."""
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE_INDEX)
    if global_valid_tokens is not None:
        loss = loss / global_valid_tokens
    return loss, {}


class GradAccumulator:
    """Assembles the per-chunk hidden-state gradients into one [B, L, D] gradient."""

    def __init__(self, reference: torch.Tensor, num_chunks: int, dtype: torch.dtype, seq_dim: int = 1):
        self.num_chunks, self.seq_dim = num_chunks, seq_dim
        self._next_idx = 0
        self._buffer = torch.zeros_like(reference, dtype=dtype)

    def add(self, chunk_grad: torch.Tensor) -> None:
        chunk_seq_len = chunk_grad.shape[self.seq_dim]
        start = self._next_idx * chunk_seq_len
        self._buffer[:, start:start + chunk_seq_len] = chunk_grad.to(self._buffer.dtype)
        self._next_idx += 1

    def result(self) -> torch.Tensor:
        return self._buffer


class _DecoderOutputGradientBackProp(torch.autograd.Function):
    """Bridges chunked lm_head backward with decoder backward: backward returns ``accumulated_grad`` as the
    gradient for ``hidden_states``."""

    @staticmethod
    def forward(ctx, hidden_states, accumulated_grad, loss):
        ctx.save_for_backward(accumulated_grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output):
        (accumulated_grad,) = ctx.saved_tensors
        return accumulated_grad, None, None


class ChunkedLossWrapper:
    """Chunked loss: lm_head + loss per sequence chunk, FSDP reshard of lm_head disabled across the chunks."""

    def __init__(self, num_chunks: int, variant: str):
        self.num_chunks = num_chunks
        self.loss_fn = cross_entropy_loss
        self.lm_head: nn.Module | None = None
        self.variant = variant

    def set_lm_head(self, lm_head: nn.Module) -> None:
        self.lm_head = lm_head

    def __call__(self, pred, labels, global_valid_tokens=None):
        hidden_states = pred
        num_chunks = self.num_chunks
        lm_head = self.lm_head
        assert lm_head is not None, "Set lm_head before calling ChunkedLossWrapper"
        fsdp_enabled = isinstance(lm_head, FSDPModule)
        requires_grad = hidden_states.requires_grad

        def _chunk_local(t):
            chunk_len = t.shape[1] // num_chunks
            return tuple(c.contiguous() for c in torch.split(t, [chunk_len] * num_chunks, dim=1))

        h_chunks = [c.detach().requires_grad_(requires_grad) for c in _chunk_local(hidden_states)]
        label_chunks = list(_chunk_local(labels))
        grad_accumulator = None
        if requires_grad:
            grad_accumulator = GradAccumulator(hidden_states, num_chunks=num_chunks, dtype=torch.float32)
        total_loss = hidden_states.new_zeros((), dtype=torch.float32)

        # Disable FSDP reshard on lm_head to keep weight unsharded across all chunks, avoiding repeated
        # all-gathers. Coalesce per-chunk grad sync into a single reduce-scatter at the last chunk.
        if fsdp_enabled:
            lm_head.set_reshard_after_forward(False)
            lm_head.set_reshard_after_backward(False)
            lm_head.set_requires_gradient_sync(False, recurse=False)
            if self.variant == "fix":
                # An implicit unshard stores an all-gather event in FSDP's shared all_gather_state for the next
                # FSDP module to consume. Since lm_head is the final FSDP forward in this loop, eager warmup
                # leaves that state uncleared, and CUDA graph capture cannot wait on its eager event. Explicitly
                # unshard while FSDP is idle to avoid populating the shared state.
                lm_head.unshard()

        last_idx = len(h_chunks) - 1
        for i, (h_chunk, label_chunk) in enumerate(zip(h_chunks, label_chunks)):
            if fsdp_enabled and i == last_idx:
                lm_head.set_requires_gradient_sync(True, recurse=False)
            logits = lm_head(h_chunk)
            chunk_loss, _ = self.loss_fn(logits, label_chunk, global_valid_tokens)
            total_loss = total_loss + chunk_loss.detach()
            if requires_grad:
                chunk_loss.backward()
                grad_accumulator.add(h_chunk.grad)
                h_chunk.grad = None

        if fsdp_enabled:
            lm_head.set_reshard_after_forward(True)
            lm_head.set_reshard_after_backward(True)
            lm_head.set_requires_gradient_sync(True, recurse=False)
            lm_head.reshard()
        if not requires_grad:
            return total_loss, {}
        accumulated_grad = grad_accumulator.result().to(hidden_states.dtype)
        loss = _DecoderOutputGradientBackProp.apply(hidden_states, accumulated_grad, total_loss)
        return loss, {}


# --- torchtitan/distributed/cudagraph.py --------------------------------------------------------------------------

class _CUDAGraphManager:
    """Owns the graph pool and the stream that warmup and capture run on."""

    def __init__(self, device):
        self.graph_pool = graph_pool_handle(device)
        self.stream = Stream("cudagraph manager stream")


class CUDAGraphWrapper:
    """The first call warms up (eagerly, on the manager's stream), the second records, every call copies the
    tensor inputs into the recorded ones and replays."""

    def __init__(self, fn, example_inputs, *, device, trained_state):
        self._fn = fn
        self._device = device
        self._manager = _CUDAGraphManager(device)
        self._trained_state = trained_state
        self._input_indices_to_copy = [i for i, inp in enumerate(example_inputs) if isinstance(inp, torch.Tensor)]
        self._graph = None
        self._warmup_remaining = 1
        self._args: tuple | None = None
        self._output = None

    def warmup(self, *args):
        self._warmup_remaining -= 1
        current = current_stream()
        self._manager.stream.wait_stream(current)
        with events.warmup(real=True), cuda_stream(self._manager.stream):
            output = self._fn(*args)
        current.wait_stream(self._manager.stream)
        return output

    def record(self, *args):
        self._args = args
        fn, stream = self._fn, self._manager.stream

        def body():
            # torch.cuda.graph(self._graph, pool=_manager.graph_pool, stream=_manager.stream,
            #                  capture_error_mode="thread_local")
            with stream_capture(stream):
                return fn(*args)

        names = ("inputs", "labels", "global_valid_tokens")
        self._graph, self._output = capture(
            body, device=self._device, pool=self._manager.graph_pool, warmups=0, name="fwd_bwd",
            owner="torchtitan CUDAGraphWrapper", capture_error_mode="thread_local",
            static={names[i]: args[i] for i in self._input_indices_to_copy}, state=self._trained_state())

    def replay(self, *args):
        for i in self._input_indices_to_copy:
            self._args[i].copy_(args[i])
        return replay(self._graph, self._output)


def wrap_with_cuda_graph(fwd_bwd_fn, *, device, trained_state):
    graph_wrapper: CUDAGraphWrapper | None = None

    def run(inputs, labels, global_valid_tokens):
        nonlocal graph_wrapper
        args = (inputs, labels, global_valid_tokens)
        if graph_wrapper is None:
            graph_wrapper = CUDAGraphWrapper(fwd_bwd_fn, args, device=device, trained_state=trained_state)
        if graph_wrapper._warmup_remaining > 0:
            loss = graph_wrapper.warmup(*args)
        else:
            if graph_wrapper._graph is None:
                graph_wrapper.record(*args)
            loss = graph_wrapper.replay(*args)
        # CUDA graph outputs are overwritten by each replay.
        return loss.clone()

    return run


# --- torchtitan/trainer.py -----------------------------------------------------------------------------------------

class Trainer:
    def __init__(self, variant: str, device: str, disable_cuda_graphs: bool):
        self.device = device
        self.disable_cuda_graphs = disable_cuda_graphs
        self.model = Decoder(device)
        apply_fsdp(self.model, ProcessGroup(), RESHARD_AFTER_FORWARD_POLICY)
        # build_loss: the chunked loss computes lm_head itself
        self.model._skip_lm_head = True
        self.loss_fn = ChunkedLossWrapper(NUM_CHUNKS, variant)
        self.loss_fn.set_lm_head(self.model.lm_head)
        self.params = sharded_parameters(self.model)
        self.optimizer = torch.optim.SGD(self.params, lr=LR, foreach=False)
        self.fwd_bwd_fn = self._forward_backward_body
        if not disable_cuda_graphs:
            self.fwd_bwd_fn = wrap_with_cuda_graph(self.fwd_bwd_fn, device=device, trained_state=self._trained_state)

    def _trained_state(self):
        state = {f"shard[{i}]": p for i, p in enumerate(self.params)}
        state.update({f"shard[{i}].grad": p.grad for i, p in enumerate(self.params) if p.grad is not None})
        return state

    def _forward_backward_body(self, inputs, labels, global_valid_tokens):
        pred = self.model(inputs)
        loss, _ = self.loss_fn(pred, labels, global_valid_tokens)
        del pred
        loss.backward()
        return loss

    def train_step(self, inputs, labels):
        self.optimizer.zero_grad(set_to_none=self.disable_cuda_graphs)
        local_valid_tokens = (labels != IGNORE_INDEX).sum()
        global_valid_tokens = local_valid_tokens.to(self.device)
        loss = self.fwd_bwd_fn(inputs.to(self.device, copy=True), labels.to(self.device, copy=True),
                               global_valid_tokens)
        self.optimizer.step()
        return loss.detach()


def batches():
    gen = generator(7)
    out = []
    for step in range(STEPS):
        inputs = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels[step % BATCH, : step + 1] = IGNORE_INDEX
        out.append((inputs, labels))
    return out


def run(variant: str, device: str = "cpu"):
    data = batches()

    def train(graphed: bool):
        trainer = Trainer(variant, device, disable_cuda_graphs=not graphed)
        outs = []
        for inputs, labels in data:
            outs.append(trainer.train_step(inputs, labels).reshape(1))
        outs += [p.detach().clone() for p in trainer.params]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
