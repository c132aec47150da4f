"""vLLM's scheduler and GPU model runner, reduced to Mamba decode under FULL graphs.

``Scheduler`` is vLLM's V1 scheduler reduced to FCFS with chunked prefill; ``MambaServer`` is
``GPUModelRunner``: it keeps the persistent batch (``upstream.InputBatch``), builds the metadata
(``upstream.build_common_metadata`` and the Mamba builder, where the ``bug``/``fix``/``guard``
variants live) and serves pure-decode batches by replaying the decode graph of the smallest
captured size that fits. Warmup, capture, dispatch and replay are the engine's ``GraphManager``'s;
this module keeps the runner's order of work, which is where the bug shows: the graph is chosen
from the batch shape first, and the metadata built afterwards decides what its state-index buffer
holds.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch

from ...engine import CUDAGraphMode, GraphManager, events, synchronize
from .mamba import NULL_BLOCK_ID, MambaLM, StateTable
from .upstream import (CachedRequestState, CommonAttentionMetadata, InputBatch, MambaMetadata, MambaMetadataBuilder,
                       build_common_metadata, check_variant, reorder_batch_to_split_decodes_and_prefills)

CAPTURE_SIZES = (1, 2, 4)          # vLLM's smallest capture sizes; 3 decodes run the 4-row graph
MAX_NUM_SEQS = 4
NUM_SLOTS = 8                      # state slots incl. the null block (slot 0)


@dataclasses.dataclass(frozen=True)
class Request:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int                    # first scheduler step at which it may be admitted


# ------------------------------------------------------------------------------ scheduler
@dataclasses.dataclass
class SchedulerOutput:
    step: int
    new_reqs: list[CachedRequestState]
    num_computed: dict[str, int]           # running requests: tokens computed before this step
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: list[str]            # finished in the previous step (the runner frees them)


class Scheduler:
    """vLLM's V1 scheduler reduced to FCFS with chunked prefill and one state slot per request.

    Running requests first (a decode takes 1 token, a prefill the rest of its prompt up to the
    budget), then arrivals while there is budget, a free row and a free slot. Freed slots join the
    back of the free queue (vLLM's free block queue), so they are not reused at once.
    """

    def __init__(self, requests: list[Request], *, max_num_seqs: int, max_num_batched_tokens: int,
                 num_slots: int) -> None:
        ids = [r.req_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids must be unique, got {ids}")
        self.requests = {r.req_id: r for r in requests}
        self.waiting = sorted(requests, key=lambda r: r.arrival)
        self.running: list[str] = []
        self.free_slots = collections.deque(range(1, num_slots))
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.computed: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.slot: dict[str, int] = {}
        self.finished: list[str] = []
        self.step = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget, scheduled = self.budget, {}
        for rid in self.running:
            n = min(len(self.requests[rid].prompt) + len(self.outputs[rid]) - self.computed[rid], budget)
            if n <= 0:
                raise ValueError(f"step {self.step}: no token budget left for running request {rid}; this "
                                 "workload would pause it (preemption is not modelled): raise the budget")
            scheduled[rid], budget = n, budget - n
        new = []
        while (self.waiting and self.waiting[0].arrival <= self.step and len(self.running) < self.max_num_seqs
               and budget > 0 and self.free_slots):
            req = self.waiting.pop(0)
            self.slot[req.req_id] = self.free_slots.popleft()
            self.computed[req.req_id], self.outputs[req.req_id] = 0, []
            self.running.append(req.req_id)
            scheduled[req.req_id] = n = min(len(req.prompt), budget)
            budget -= n
            new.append(CachedRequestState(req.req_id, list(req.prompt), self.slot[req.req_id], 0))
        new_ids = {r.req_id for r in new}
        out = SchedulerOutput(self.step, new, {r: self.computed[r] for r in self.running if r not in new_ids},
                              scheduled, self.finished)
        self.finished = []
        self.step += 1
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        for rid, n in out.num_scheduled_tokens.items():
            self.computed[rid] += n
        for rid, token in sampled.items():
            self.outputs[rid].append(token)
            if len(self.outputs[rid]) >= self.requests[rid].max_tokens:
                self.running.remove(rid)
                self.free_slots.append(self.slot[rid])
                self.finished.append(rid)


# ------------------------------------------------------------------------------ runner
@dataclasses.dataclass
class StepRecord:
    """What one model step did. ``slots_read`` is the persistent buffer a FULL graph replayed with."""

    step: int
    mode: str                          # "full" (graph replay) or "eager"
    req_ids: list[str]                 # request per real row, in row order
    num_reqs_padded: int
    is_prefilling: list[bool]          # over num_reqs_padded rows, as the metadata saw it
    counters: list[tuple[int, int]]    # (num_computed, num_prompt) behind it, per row
    split: tuple[int, int, int, int]   # (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)
    refreshed: bool                    # whether the persistent state-index buffer was refreshed
    slots_read: list[int] | None       # FULL steps: the buffer's rows [0, num_reqs_padded) at replay
    slots_expected: list[int]          # the batch's slots (real rows), NULL_BLOCK_ID for padded rows


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """A real row that a FULL graph ran on another slot than its request's."""

    step: int
    req_id: str
    row: int
    slot_read: int
    slot_expected: int
    state_of: str                      # whose state that slot holds: a request id, or "null block"


class MambaServer:
    """``GPUModelRunner`` reduced to Mamba decode under FULL graphs (``capture_sizes``).

    The buffer policy is the case's: the state-index buffer a decode graph reads belongs to the
    Mamba metadata builder and is refreshed only when the builder decides so (``GraphRunner``
    would copy every input in on every call, which is not what vLLM does here).
    ``enforce_eager=True`` (mode NONE) runs every step eagerly with exact per-request slots: the
    reference.
    """

    def __init__(self, model: MambaLM, *, variant: str = "bug", device: str = "cpu",
                 capture_sizes=CAPTURE_SIZES, max_num_reqs: int = MAX_NUM_SEQS, max_model_len: int = 64,
                 num_slots: int = NUM_SLOTS, enforce_eager: bool = False) -> None:
        self.variant = check_variant(variant)
        self.model = model
        self.enforce_eager = enforce_eager
        self.manager = GraphManager(self._forward, capture_sizes, device=device,
                                    mode=CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.FULL,
                                    num_warmups=1, static_buffers=self._capture_inputs, name=type(self).__name__)
        self.device = str(self.manager.device)
        self.capture_sizes = self.manager.capture_sizes
        if self.manager.max_size > max_num_reqs:
            raise ValueError(f"capture sizes {self.capture_sizes} exceed max_num_reqs={max_num_reqs}")
        dtype = next(model.parameters()).dtype
        self.states = StateTable.empty(model.config, num_slots, device=self.device, dtype=dtype)
        self.input_batch = InputBatch(max_num_reqs, max_model_len)
        self.builder = MambaMetadataBuilder(self.manager.max_size, self.device, full_cudagraphs=not enforce_eager,
                                            ignore_zero_query_rows=variant == "guard")
        self.input_ids = torch.zeros(self.manager.max_size, dtype=torch.long, device=self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self.slot_owner: dict[int, str] = {}
        self.records: list[StepRecord] = []
        self.mismatches: list[Mismatch] = []
        self.min_margin = float("inf")

    @property
    def graphs(self) -> dict[int, object]:
        """Size -> captured decode graph."""
        return {size: pieces[0] for size, pieces in self.manager.graphs.items()}

    @property
    def graph_logits(self) -> dict[int, torch.Tensor]:
        """Size -> the decode graph's static logits."""
        return self.manager.outputs

    def capture(self) -> None:
        """Warm up and capture one decode graph per size, largest first, into one pool."""
        self.manager.capture()
        synchronize(self.device)

    def _capture_inputs(self, size: int) -> dict[str, torch.Tensor]:
        """What vLLM's capture run builds for ``size``: dummy one-token decodes on the null block,
        whose metadata fills the builder's persistent state-index buffer. Returns the static buffers
        the graph of ``size`` reads (the manager announces them)."""
        self.builder.build_for_cudagraph_capture(_dummy_decode_metadata(size))
        return {"input_ids": self.input_ids, "state_indices_tensor_d": self.builder.state_indices_tensor_d}

    def _forward(self, size: int) -> torch.Tensor:
        """The decode step of ``size`` rows over the persistent buffers (what the graph captures)."""
        return self.model.decode(self.input_ids[:size], self.states, self.builder.state_indices_tensor_d[:size])

    @torch.no_grad()
    def execute_model(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one scheduled step; return the tokens sampled for requests past their prompt."""
        self._update_states(out)
        if not out.num_scheduled_tokens:
            return {}                                      # nothing to run; finished requests are freed
        ib = self.input_batch
        req_ids, num_reqs = ib.req_ids, ib.num_reqs
        num_scheduled = np.array([out.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        computed = ib.num_computed_tokens_cpu[:num_reqs].copy()
        num_tokens = int(num_scheduled.sum())
        # Dispatch happens first, from the batch shape alone (vLLM's cudagraph dispatcher).
        uniform_decode = num_scheduled.max() == 1 and num_tokens == num_reqs
        size = self.manager.dispatch(num_reqs) if uniform_decode else None
        if size is not None:
            # Rows [num_reqs, size) of the batch's host arrays are padded rows, and they act on the
            # host, in the metadata built below, before the replay: announced here, not at replay.
            events.serve(self.graphs[size], num_reqs, size, outputs=self.graph_logits[size], padded={
                "num_computed_tokens_cpu": ib.num_computed_tokens_cpu, "num_prompt_tokens": ib.num_prompt_tokens})
        cm = build_common_metadata(ib, num_scheduled, size or num_reqs, size or num_tokens, self.variant)
        md = self.builder.build(cm)
        ids = np.concatenate([ib.token_ids_cpu[i, computed[i]:computed[i] + n] for i, n in enumerate(num_scheduled)])
        ids = torch.from_numpy(ids).to(self.device)
        expected = ib.block_table[:num_reqs].tolist() + [NULL_BLOCK_ID] * ((size or num_reqs) - num_reqs)
        slots_read = None
        if size is not None:
            self.input_ids[:num_tokens].copy_(ids)
            slots_read = self.builder.state_indices_tensor_d[:size].tolist()
            self._check_slots(out.step, req_ids, slots_read, expected)
            last_logits = self.manager.replay(size, num_reqs)
        else:
            last_logits = self._forward_eager(ids, md)
        counters = list(zip(ib.num_computed_tokens_cpu[:cm.num_reqs].tolist(),
                            ib.num_prompt_tokens[:cm.num_reqs].tolist()))
        self.records.append(StepRecord(out.step, "eager" if size is None else "full", list(req_ids),
                                       cm.num_reqs, cm.is_prefilling.tolist(), counters,
                                       (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens),
                                       md.refreshed, slots_read, expected))
        return self._sample(last_logits, computed + num_scheduled)

    # ---------------------------------------------------------------------------- helpers
    def _update_states(self, out: SchedulerOutput) -> None:
        """Upstream order: remove finished, update counters, add new, condense, reorder."""
        ib = self.input_batch
        for rid in out.finished_req_ids:
            self.requests.pop(rid)
            ib.remove_request(rid)
        for rid, n in out.num_computed.items():
            self.requests[rid].num_computed_tokens = n
            ib.num_computed_tokens_cpu[ib.req_id_to_index[rid]] = n
        for req in out.new_reqs:
            self.requests[req.req_id] = req
            self.slot_owner[req.block_id] = req.req_id
            ib.add_request(req)
        ib.condense()
        reorder_batch_to_split_decodes_and_prefills(ib, out.num_scheduled_tokens)

    def _forward_eager(self, ids: torch.Tensor, md: MambaMetadata) -> torch.Tensor:
        """Decode rows through the decode path, each prefill through the prefill path."""
        logits = []
        if md.num_decodes:
            logits.append(self.model.decode(ids[:md.num_decode_tokens], self.states, md.state_indices_tensor_d))
        for i in range(md.num_prefills):
            a, b = md.query_start_loc_p[i], md.query_start_loc_p[i + 1]
            chunk = ids[md.num_decode_tokens + a:md.num_decode_tokens + b]
            logits.append(self.model.prefill(chunk, self.states, md.state_indices_tensor_p[i],
                                             md.has_initial_states_p[i])[-1:])
        return torch.cat(logits)

    def _check_slots(self, step: int, req_ids: list[str], slots_read: list[int], expected: list[int]) -> None:
        real = [s for s in slots_read if s != NULL_BLOCK_ID]
        if len(set(real)) != len(real):
            raise RuntimeError(f"step {step}: the graph would scatter two rows into one slot ({slots_read}); "
                               "the outcome then depends on the device's write order. Change the workload.")
        for row, rid in enumerate(req_ids):
            if slots_read[row] != expected[row]:
                owner = "null block" if slots_read[row] == NULL_BLOCK_ID else self.slot_owner.get(slots_read[row], "?")
                self.mismatches.append(Mismatch(step, rid, row, slots_read[row], expected[row], owner))

    def _sample(self, last_logits: torch.Tensor, computed_after: np.ndarray) -> dict[str, int]:
        ib, sampled = self.input_batch, {}
        logits = last_logits.double().cpu()
        for row, rid in enumerate(ib.req_ids):
            if computed_after[row] < ib.num_prompt_tokens[row]:
                continue                                   # mid-prompt chunk: nothing to sample
            top = logits[row].topk(2).values
            self.min_margin = min(self.min_margin, float(top[0] - top[1]))
            token = int(logits[row].argmax())
            sampled[rid] = token
            self.requests[rid].output_token_ids.append(token)
            ib.token_ids_cpu[row, ib.num_tokens[row]] = token
            ib.num_tokens[row] += 1
        return sampled


def _dummy_decode_metadata(size: int) -> CommonAttentionMetadata:
    """What vLLM's capture run builds: ``size`` one-token decodes on the null block."""
    return CommonAttentionMetadata(
        query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
        num_computed_tokens_cpu=torch.ones(size, dtype=torch.int32), num_reqs=size, num_actual_tokens=size,
        max_query_len=1, block_table_tensor=torch.full((size,), NULL_BLOCK_ID, dtype=torch.int32),
        is_prefilling=torch.zeros(size, dtype=torch.bool))

