"""With LoRA cudagraph specialisation, the second capture pass replays the EAGLE drafter graph (keyed on token count only) before its custom all-reduce buffers are registered.

Upstream: https://github.com/vllm-project/vllm/pull/28318 ("[bugfix] support eagle with lora cudagraph
specialization", merged November 2025; issue https://github.com/vllm-project/vllm/issues/28334; regression from
#25914, LoRA cudagraph specialisation).
Symptom: "enabling LoRA with eagle spec decoding fails with an illegal memory error unless
`cudagraph_specialize_lora` is turned off"; the crash comes at startup, during cudagraph capture, with TP > 1.
Mechanism: ``GPUModelRunner.capture_model`` runs the whole capture loop inside ``graph_capture()``, which enters
``CustomAllreduce.capture()``. With ``cudagraph_specialize_lora`` the dispatcher has keys for both LoRA states, so
``_dummy_run(num_tokens, activate_lora=...)`` runs twice per size. At the end of each dummy run
``self.drafter.dummy_run(num_tokens, use_cudagraphs=...)`` runs the EAGLE head through its own
``CUDAGraphWrapper``, whose ``BatchDescriptor`` carries the token count only. Pass 1 (no LoRA) captures the
drafter graph; pass 2 (LoRA) finds the same key and *replays* it, still inside ``CustomAllreduce.capture()``.
An all-reduce captured there (``registered=True``) reads its peers' buffer addresses from a slot of
``rank_data`` (``graph_unreg_buffers_``) that ``register_graph_buffers`` fills only when the context exits; until
then the slot holds whatever ``torch.empty`` left, and the replayed kernel dereferences it: illegal memory access.
(Emulation: TP-2 in one process, as rank 0 sees it. Rank 1's memory mapped into rank 0 is ``ipc_space``; a
peer address is a row index into it; the garbage an unregistered slot holds is a row past its end. A kernel
that dereferences it sets the sticky ``fault`` flag, which the next ``synchronize()`` reports as CUDA reports
an illegal memory access; the emulated capture executes the kernel too, but its writes are undone when
capture ends, as a CUDA capture executes nothing.)
Doctor: stale-input, at ``_dummy_run`` (the replayed drafter graph reads a ``rank_data`` slot that nothing has
written yet: the IPC-handle exchange that fills it runs later, at the capture context's exit).
Fix (upstream): ``_dummy_run`` sets ``use_cudagraphs = False`` for the drafter when
``cudagraph_specialize_lora`` and the dummy run activates LoRA ("We need to disable cudagraphs for one of the two
lora cases"), so the second pass runs the drafter eagerly instead of replaying its graph. (Read: the PR
description and the post-fix ``_dummy_run`` in stored vLLM copies; the first PR revision passed the
``batch_descriptor`` with its LoRA state to ``drafter.dummy_run`` instead. The ``rank_data`` slot mechanism is
that of ``custom_all_reduce.cuh``'s ``get_buffer_RD``/``register_graph_buffers``, as the PR thread's diagnosis
implies; it was not re-read for this module.)
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/28318"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_dummy_run"
SYMPTOM = "LoRA + EAGLE + cudagraph_specialize_lora, TP>1: illegal memory access during cudagraph capture"

HIDDEN, INTER, RANK = 8, 6, 2
CUDAGRAPH_CAPTURE_SIZES = [2, 4]
MAX_NUM_TOKENS = 4
IPC_ROWS = 16            # rank 1's buffers as mapped into rank 0 (row 0: the pre-registered staging buffer)
UNREGISTERED = 1 << 20   # what torch.empty left in a rank_data slot: an address nothing maps


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    has_lora: bool = False


class CustomAllreduce:
    """``vllm.distributed.device_communicators.custom_all_reduce.CustomAllreduce`` seen from rank 0 of TP-2."""

    def __init__(self, device):
        self.ipc_space = torch.zeros(IPC_ROWS, MAX_NUM_TOKENS, HIDDEN, device=device)
        self.rank_data = torch.full((IPC_ROWS,), UNREGISTERED, dtype=torch.long, device=device)
        self.fault = torch.zeros(1, dtype=torch.bool, device=device)   # the sticky CUDA error state
        self.graph_unreg_buffers: list[int] = []
        self._IS_CAPTURING = False

    @contextlib.contextmanager
    def capture(self):
        try:
            self._IS_CAPTURING = True
            yield
        finally:
            self._IS_CAPTURING = False
            self.register_graph_buffers()

    def synchronize(self):
        """``torch.cuda.synchronize()``: an asynchronous kernel fault surfaces here."""
        if bool(self.fault):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def register_graph_buffers(self):
        # all-gather the IPC handles of the graph buffers and open them: only now are the slots valid
        for slot, row in enumerate(self.graph_unreg_buffers):
            self.rank_data[slot] = row

    def custom_all_reduce(self, partials):
        n = partials.shape[1]
        if self._IS_CAPTURING:
            if is_capturing():
                # registered=True: the kernel reads the peer's input through rank_data[slot]
                slot = len(self.graph_unreg_buffers)
                row = slot + 1
                self.graph_unreg_buffers.append(row)
                self.ipc_space[row, :n].copy_(partials[1])          # rank 1 writes its input buffer
                ptr = self.rank_data[slot:slot + 1]
                self.fault |= ptr >= IPC_ROWS                      # an unmapped address: the kernel faults
                peer = self.ipc_space.index_select(0, ptr.clamp(max=IPC_ROWS - 1))[0, :n]
                return partials[0] + peer
            # warmup: mimic the allocation pattern, custom allreduce is out-of-place
            return torch.empty_like(partials[0])
        # registered=False: copy into the pre-registered staging buffer
        self.ipc_space[0, :n].copy_(partials[1])
        return partials[0] + self.ipc_space[0, :n]


class RowParallelMLP:
    def __init__(self, gen, device, lora):
        self.up = [randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5) for _ in range(2)]
        self.down = [randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(2)]
        self.lora_a = randn(HIDDEN, RANK, gen=gen, device=device, scale=0.5) if lora else None
        self.lora_b = randn(RANK, HIDDEN, gen=gen, device=device, scale=0.5) if lora else None

    def __call__(self, ca, x, lora_mask=None):
        partials = torch.stack([torch.tanh(x @ self.up[r]) @ self.down[r] for r in range(2)])
        h = x + ca.custom_all_reduce(partials)
        if lora_mask is not None:      # punica LoRA kernels: only in the has_lora graph
            h = h + (x @ self.lora_a) @ self.lora_b * lora_mask
        return h


class CUDAGraphWrapper:
    def __init__(self, fn, device, owner, static):
        self.fn, self.device, self.owner, self.static = fn, device, owner, static
        self.concrete_cudagraph_entries: dict[BatchDescriptor, tuple] = {}

    def __call__(self, batch_descriptor, use_cudagraphs, real=None):
        fn = lambda: self.fn(batch_descriptor)  # noqa: E731
        if not use_cudagraphs:
            return fn()
        entry = self.concrete_cudagraph_entries.get(batch_descriptor)
        if entry is None:
            entry = capture(fn, device=self.device, owner=self.owner, static=self.static,
                            name=f"{self.owner} {batch_descriptor}")
            self.concrete_cudagraph_entries[batch_descriptor] = entry
            return entry[1]
        return replay(*entry)


class EagleProposer:
    def __init__(self, gen, device, ca):
        self.model, self.ca = RowParallelMLP(gen, device, lora=False), ca
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.cudagraph = CUDAGraphWrapper(
            lambda bd: self.model(self.ca, self.hidden_states[:bd.num_tokens]), device,
            "EagleProposer (PIECEWISE)", {"hidden_states": self.hidden_states})

    def dummy_run(self, num_tokens, use_cudagraphs=True):
        # the drafter's batch descriptor: token count only, no LoRA field
        return self.cudagraph(BatchDescriptor(num_tokens), use_cudagraphs)

    def propose(self, target_hidden_states, graphed):
        n = target_hidden_states.shape[0]
        self.hidden_states[:n] = target_hidden_states
        return self.cudagraph(BatchDescriptor(n), graphed)


class GPUModelRunner:
    def __init__(self, device, variant):
        gen = generator(28318)
        self.variant, self.cudagraph_specialize_lora = variant, True
        self.ca = CustomAllreduce(device)
        self.model = RowParallelMLP(gen, device, lora=True)
        self.drafter = EagleProposer(gen, device, self.ca)
        self.inputs_embeds = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.lora_mask = torch.zeros(MAX_NUM_TOKENS, 1, device=device)
        self.cudagraph = CUDAGraphWrapper(self._forward, device, "GPUModelRunner (FULL)",
                                          {"inputs_embeds": self.inputs_embeds, "lora_mask": self.lora_mask})

    def _forward(self, bd):
        n = bd.num_tokens
        return self.model(self.ca, self.inputs_embeds[:n], self.lora_mask[:n] if bd.has_lora else None)

    def _dummy_run(self, num_tokens, activate_lora, is_graph_capturing=True):
        self.cudagraph(BatchDescriptor(num_tokens, activate_lora), use_cudagraphs=True)
        use_cudagraphs = True
        if self.variant == "fix" and self.cudagraph_specialize_lora and activate_lora:
            # Note(gnovack): disable cudagraphs for one of the two lora cases (issue 28334)
            use_cudagraphs = False
        self.drafter.dummy_run(num_tokens, use_cudagraphs=use_cudagraphs)

    def capture_model(self):
        with self.ca.capture():                     # graph_capture(): custom all-reduce capture context
            for num_tokens in reversed(CUDAGRAPH_CAPTURE_SIZES):
                for activate_lora in (False, True):
                    self._dummy_run(num_tokens, activate_lora)
        self.ca.synchronize()

    def execute_model(self, x, mask, graphed):
        n, has_lora = x.shape[0], bool(mask.any())
        if graphed:
            self.inputs_embeds[:n] = x
            self.lora_mask[:n] = mask
            hidden = self.cudagraph(BatchDescriptor(n, has_lora), True).clone()
        else:
            hidden = self.model(self.ca, x, mask if has_lora else None)
        draft = self.drafter.propose(hidden, graphed).clone()
        self.ca.synchronize()
        return hidden, draft


def run(variant: str, device: str = "cpu"):
    gen = generator(2831800)
    steps = []
    for n, lora_rows in [(4, []), (4, [1, 3]), (2, [0]), (2, [])]:
        mask = torch.zeros(n, 1)
        mask[lora_rows] = 1.0
        steps.append((randn(n, HIDDEN, gen=gen, device=device), mask.to(device)))

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant)
        if graphed:
            runner.capture_model()
        outs = []
        for x, mask in steps:
            outs.extend(runner.execute_model(x, mask, graphed))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
