"""Case 04: a stale ``is_prefilling`` in padded rows makes Mamba requests read each other's state.

vLLM #41873 / #42947 (issue #41841). Under FULL CUDA graphs a pure-decode batch of ``n`` requests
runs the graph captured for ``size >= n`` rows. ``_build_attention_metadata`` computes
``is_prefilling = num_computed < num_prompt`` over all ``size`` rows, and rows ``>= n`` still hold
the counters ``condense()`` left behind. If a request was moved out of such a row mid chunked
prefill, the padded row reads ``True`` and becomes a zero-length "prefill"; the Mamba builder sees
``num_prefills > 0`` and skips refreshing the persistent state-index buffer; the FULL graph (already
chosen) replays with the previous pure-decode step's slots. Requests then read and write other
requests' recurrent state: no error, different tokens.

This module serves a small workload through ``MambaServer`` (scheduler, persistent batch, Mamba
metadata, FULL decode graphs) once eagerly and once per variant, and returns what each step did.
"""
from __future__ import annotations

import collections
import dataclasses

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from tqdm.auto import tqdm

from workbench import plots
from workbench.engine import events, graph, graph_pool_handle, new_graph, resolve_device, synchronize
from workbench.models.mamba import NULL_BLOCK_ID, MambaLM, StateTable, tiny_mamba

from .mamba_batch import (VARIANTS, CachedRequestState, CommonAttentionMetadata, InputBatch,
                          MambaMetadata, MambaMetadataBuilder, build_common_metadata, check_variant,
                          padded_is_prefilling, reorder_batch_to_split_decodes_and_prefills,
                          split_decodes_and_prefills)

CASE = "04_mamba_stale_is_prefilling"
CAPTURE_SIZES = (1, 2, 4)          # vLLM's smallest capture sizes; 3 decodes run the 4-row graph
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 8         # small token budget: long prompts are prefilled in chunks
NUM_SLOTS = 8                      # state slots incl. the null block (slot 0)

# The upstream unit case (#41873): 3 real rows padded to 5; rows 3 and 4 hold stale counters.
UNIT_NUM_COMPUTED = [50, 100, 200, 10, 20]
UNIT_NUM_PROMPT = [50, 200, 200, 100, 200]
UNIT_NUM_REQS, UNIT_NUM_REQS_PADDED = 3, 5


# ------------------------------------------------------------------------------ workload
@dataclasses.dataclass(frozen=True)
class Request:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int                    # first scheduler step at which it may be admitted


def default_workload(max_tokens: int = 12, seed: int = 0, vocab_size: int = 64) -> list[Request]:
    """Three short requests decoding together, then a long prompt arrives and is chunk-prefilled.

    R0 finishes while R3 is mid-prefill, so ``condense()`` moves R3 from row 3 to row 0 and row 3
    keeps R3's counters (computed < prompt). When R3's prefill ends, three decodes run the 4-row
    graph with row 3 as a padded row. ``max_tokens`` sets R1/R2's length (R0: 4, R3: 8).
    """
    if max_tokens < 8:
        raise ValueError(f"max_tokens must be >= 8 so R1 and R2 outlive R3's prefill, got {max_tokens}")
    gen = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(1, vocab_size, (n,), generator=gen).tolist())

    return [Request("R0", prompt(3), 4, 0), Request("R1", prompt(3), max_tokens, 0),
            Request("R2", prompt(2), max_tokens, 0), Request("R3", prompt(20), 8, 3)]


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

    A case-specific manager on ``new_graph``/``graph`` rather than ``GraphRunner``: the state-index
    buffer a decode graph reads belongs to the Mamba metadata builder and is refreshed only when the
    builder decides so, whereas ``GraphRunner`` copies every input into its buffers on every call.
    ``enforce_eager=True`` runs every step eagerly with exact per-request slots: the reference.
    """

    def __init__(self, model: MambaLM, *, variant: str = "bug", device: str = "cpu",
                 capture_sizes=CAPTURE_SIZES, max_num_reqs: int = MAX_NUM_SEQS, max_model_len: int = 64,
                 num_slots: int = NUM_SLOTS, enforce_eager: bool = False) -> None:
        self.variant = check_variant(variant)
        self.device = str(resolve_device(device))
        self.model = model
        self.enforce_eager = enforce_eager
        self.capture_sizes = sorted(capture_sizes)
        if max(self.capture_sizes) > max_num_reqs:
            raise ValueError(f"capture sizes {self.capture_sizes} exceed max_num_reqs={max_num_reqs}")
        dtype = next(model.parameters()).dtype
        self.states = StateTable.empty(model.config, num_slots, device=self.device, dtype=dtype)
        self.input_batch = InputBatch(max_num_reqs, max_model_len)
        self.builder = MambaMetadataBuilder(max(self.capture_sizes), self.device, full_cudagraphs=not enforce_eager,
                                            ignore_zero_query_rows=variant == "guard")
        self.input_ids = torch.zeros(max(self.capture_sizes), dtype=torch.long, device=self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self.slot_owner: dict[int, str] = {}
        self.graphs: dict[int, object] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}
        self.records: list[StepRecord] = []
        self.mismatches: list[Mismatch] = []
        self.min_margin = float("inf")

    @torch.no_grad()
    def capture(self) -> None:
        """Warm up and capture one decode graph per size, largest first, into one pool."""
        if self.enforce_eager:
            return
        pool = graph_pool_handle(self.device)
        events.static_buffers(type(self).__name__, {"input_ids": self.input_ids,
                                                    "state_indices_tensor_d": self.builder.state_indices_tensor_d})
        for size in reversed(self.capture_sizes):
            md = self.builder.build_for_cudagraph_capture(_dummy_decode_metadata(size))
            ids = self.input_ids[:size]
            with events.warmup():
                self.model.decode(ids, self.states, md.state_indices_tensor_d)
            g = new_graph(self.device)
            with graph(g, pool=pool, name=f"size {size}"):
                self.graph_logits[size] = self.model.decode(ids, self.states, md.state_indices_tensor_d)
            self.graphs[size] = g
        synchronize(self.device)

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
        size = self._graph_size(num_reqs) if uniform_decode else None
        if size is not None:        # rows [num_reqs, size) of the batch's host arrays are padded rows
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
            self.graphs[size].replay()
            last_logits = self.graph_logits[size][:num_reqs]
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

    def _graph_size(self, num_reqs: int) -> int | None:
        if self.enforce_eager or num_reqs > self.capture_sizes[-1]:
            return None
        return next(s for s in self.capture_sizes if s >= num_reqs)

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


# ------------------------------------------------------------------------------ running the case
@dataclasses.dataclass
class ServeResult:
    """One served run: the tokens each request got and what every step did."""

    variant: str                       # "eager" or one of VARIANTS
    generations: dict[str, list[int]]
    records: list[StepRecord]
    mismatches: list[Mismatch]
    slots: dict[str, int]              # the state slot each request was given
    min_margin: float                  # smallest top-1 minus top-2 logit over all sampled tokens


def serve(variant: str, device: str = "cpu", *, workload: list[Request] | None = None, seed: int = 0,
          model: MambaLM | None = None) -> ServeResult:
    """Serve ``workload`` with FULL decode graphs and ``variant``'s metadata; ``"eager"``: no graphs."""
    eager = variant == "eager"
    model = model if model is not None else tiny_mamba(seed, device=device)
    workload = workload if workload is not None else default_workload(seed=seed, vocab_size=model.config.vocab_size)
    # An eager run has no padded rows, so its metadata variant does not matter.
    server = MambaServer(model, variant="fix" if eager else variant, device=device, enforce_eager=eager)
    server.capture()
    sched = Scheduler(workload, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                      num_slots=NUM_SLOTS)
    while sched.has_work():
        out = sched.schedule()
        sched.update(out, server.execute_model(out))
    return ServeResult(variant, sched.outputs, server.records, server.mismatches, dict(sched.slot), server.min_margin)


def serve_all(device: str = "cpu", *, seed: int = 0, max_tokens: int = 12,
              variants=("eager", *VARIANTS)) -> dict[str, ServeResult]:
    """The eager reference and each variant on the same weights and workload."""
    model = tiny_mamba(seed, device=device)
    workload = default_workload(max_tokens, seed, model.config.vocab_size)
    return {v: serve(v, device, workload=workload, model=model) for v in tqdm(variants, desc="serving", leave=False)}


def agreement(result: ServeResult, reference: ServeResult) -> dict[str, float]:
    """Per request: the fraction of generated positions whose token equals the reference's."""
    return {rid: float(np.mean([a == b for a, b in zip(toks, reference.generations[rid])]))
            for rid, toks in result.generations.items()}


def unit_is_prefilling(variant: str) -> list[bool]:
    """The upstream unit case: ``is_prefilling`` over the 5 padded rows."""
    return padded_is_prefilling(torch.tensor(UNIT_NUM_COMPUTED, dtype=torch.int32),
                                torch.tensor(UNIT_NUM_PROMPT, dtype=torch.int32),
                                UNIT_NUM_REQS, UNIT_NUM_REQS_PADDED, variant).tolist()


def unit_split(variant: str, *, treat_short_extends_as_decodes: bool = False) -> tuple[int, int, int, int]:
    """2 real decodes padded to 4 rows; row 2 was vacated mid-prefill (4 of 16 prompt tokens).

    ``query_start_loc = [0, 1, 2, 2, 2]``, 4 padded tokens: the batch a FULL 4-row graph runs.
    """
    is_prefilling = padded_is_prefilling(torch.tensor([12, 30, 4, 16], dtype=torch.int32),
                                         torch.tensor([12, 30, 16, 16], dtype=torch.int32), 2, 4, variant)
    cm = CommonAttentionMetadata(torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
                                 torch.tensor([12, 30, 4, 16], dtype=torch.int32), num_reqs=4,
                                 num_actual_tokens=4, max_query_len=1,
                                 block_table_tensor=torch.tensor([3, 5, 0, 0], dtype=torch.int32),
                                 is_prefilling=is_prefilling)
    return split_decodes_and_prefills(cm, treat_short_extends_as_decodes=treat_short_extends_as_decodes,
                                      ignore_zero_query_rows=variant == "guard")


def key_numbers(runs: dict[str, ServeResult]) -> dict:
    """The numbers a GPU run must reproduce exactly: unit cases, tokens, and who read whose slot."""
    eager = runs["eager"]
    return {
        "unit_is_prefilling": {v: unit_is_prefilling(v) for v in ("bug", "fix")},
        "unit_split": {v: list(unit_split(v)) for v in VARIANTS},
        "generations": {v: r.generations for v, r in runs.items()},
        "agreement": {v: agreement(runs[v], eager) for v in VARIANTS},
        "mismatches": {v: [[m.step, m.req_id, m.slot_read, m.slot_expected, m.state_of] for m in runs[v].mismatches]
                       for v in VARIANTS},
        "full_steps": {v: [r.step for r in runs[v].records if r.mode == "full"] for v in VARIANTS},
        "skipped_refresh_steps": {v: [r.step for r in runs[v].records if r.mode == "full" and not r.refreshed]
                                  for v in VARIANTS},
        "min_margin": min(r.min_margin for r in runs.values()),
    }


def gpu_record(device: str = "cuda") -> dict:
    """``key_numbers`` of the eager reference and every variant served on ``device``.

    The model runs in float64, so CPU and GPU logits differ by ~1e-15 while the smallest gap
    between the top two logits of any sampled token (``min_margin``) is ~1e-2: argmax tokens cannot
    flip, and the tokens and slot mismatches are compared exactly.
    """
    return key_numbers(serve_all(device))


def describe_step(result: ServeResult, index: int) -> str:
    """One step of a served run as text: each row's request, counters, is_prefilling and slots."""
    if not 0 <= index < len(result.records):
        raise ValueError(f"index must be in [0, {len(result.records)}), got {index}")
    rec = result.records[index]
    lines = [f"{result.variant}, step {rec.step}: {rec.mode} ({len(rec.req_ids)} real rows, "
             f"{rec.num_reqs_padded} in the batch); split (decodes, prefills, decode tokens, prefill tokens) "
             f"= {rec.split}; state-index buffer refreshed: {rec.refreshed}",
             "row  request  computed/prompt  is_prefilling  slot read  own slot"]
    for row in range(rec.num_reqs_padded):
        rid = rec.req_ids[row] if row < len(rec.req_ids) else "(pad)"
        read = "-" if rec.slots_read is None else rec.slots_read[row]
        computed, prompt = rec.counters[row]
        counters = f"{computed}/{prompt}"
        lines.append(f"{row:>3}  {rid:>7}  {counters:>15}  {rec.is_prefilling[row]!s:>13}  {read!s:>9}"
                     f"  {rec.slots_expected[row]:>8}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ figures
_PREFILL_CODES = "wb04_is_prefilling"      # registered so the shared heatmap helper can use it
matplotlib.colormaps.register(ListedColormap(["#c6dbef", plots.COLORS["real"], "#fdd0a2", plots.COLORS["bug"]],
                                             name=_PREFILL_CODES), force=True)
_PREFILL_LABELS = ["real, decode", "real, prefilling", "padded, False", "padded, stale True"]


def prefill_matrix(result: ServeResult, max_rows: int = MAX_NUM_SEQS) -> np.ndarray:
    """``codes[row, step]``: 0/1 real row is_prefilling False/True, 2/3 padded row False/True, NaN unused."""
    codes = np.full((max_rows, len(result.records)), np.nan)
    for j, rec in enumerate(result.records):
        n = len(rec.req_ids)
        for row, flag in enumerate(rec.is_prefilling):
            codes[row, j] = (0 if row < n else 2) + int(flag)
    return codes


def plot_is_prefilling(runs: dict[str, ServeResult], variants=("bug", "fix")) -> plt.Figure:
    """Rows x steps of ``is_prefilling`` as the metadata saw it; FULL steps whose refresh was skipped marked."""
    fig, axes = plt.subplots(1, len(variants), figsize=(6.2 * len(variants), 3.4), squeeze=False)
    for ax, v in zip(axes[0], variants):
        res = runs[v]
        im = plots.heatmap(ax, prefill_matrix(res), xlabel="step", ylabel="batch row", vmin=-0.5, vmax=3.5,
                           cmap=_PREFILL_CODES, title=f"{v}: is_prefilling per row (grey: row not in the batch)")
        im.colorbar.set_ticks(range(4), labels=_PREFILL_LABELS)
        ax.set_xticks(range(len(res.records)), [r.step for r in res.records], fontsize="x-small")
        ax.set_yticks(range(MAX_NUM_SEQS))
        for j, rec in enumerate(res.records):
            for row in range(len(rec.req_ids), rec.num_reqs_padded):
                computed, prompt = rec.counters[row]
                ax.text(j, row, f"{computed}\n{'<' if computed < prompt else '>='}{prompt}", ha="center",
                        va="center", fontsize=6, color="white" if rec.is_prefilling[row] else "black")
            if rec.mode == "full":
                ax.annotate("F", (j, MAX_NUM_SEQS - 0.45), ha="center", va="bottom", fontsize="x-small",
                            color=plots.COLORS["bug"] if not rec.refreshed else "black", annotation_clip=False)
        ax.set_ylim(-0.5, MAX_NUM_SEQS + 0.1)
    fig.suptitle("F = FULL graph replay (red F: state-index refresh skipped, the graph reads last time's slots)",
                 fontsize="small", y=1.02)
    fig.tight_layout()
    return fig


_SLOT_CODES = "wb04_state_slots"
matplotlib.colormaps.register(ListedColormap(["#c6dbef", plots.COLORS["bug"], "#fdd0a2"], name=_SLOT_CODES),
                              force=True)


def plot_state_slots(runs: dict[str, ServeResult], variants=("bug", "fix")) -> plt.Figure:
    """Per FULL replay and row: the slot the graph read from the state-index buffer, whose state
    that slot holds, and (where wrong) the slot the row's request owns."""
    fig, axes = plt.subplots(len(variants), 1, figsize=(9, 2.6 * len(variants)), squeeze=False)
    for ax, v in zip(axes[:, 0], variants):
        res = runs[v]
        full = [r for r in res.records if r.mode == "full"]
        owner = {s: rid for rid, s in res.slots.items()}
        rows = max(r.num_reqs_padded for r in full)
        codes = np.full((rows, len(full)), np.nan)
        for j, rec in enumerate(full):
            for row, (got, want) in enumerate(zip(rec.slots_read, rec.slots_expected)):
                real = row < len(rec.req_ids)
                codes[row, j] = (1 if got != want else 0) if real else 2
                whose = "null" if got == NULL_BLOCK_ID else f"{owner.get(got, '?')}'s"
                text = f"{rec.req_ids[row] if real else 'pad'}: {got} ({whose})"
                if got != want:
                    text += f"\nshould be {want}"
                ax.text(j, row, text, ha="center", va="center", fontsize=6.5,
                        color="white" if got != want else "black")
        im = plots.heatmap(ax, codes, xlabel="step (FULL graph replays only)", ylabel="batch row", cmap=_SLOT_CODES,
                           vmin=-0.5, vmax=2.5, title=f"{v}: slot each row's state was read from and written to")
        im.colorbar.set_ticks(range(3), labels=["own slot", "another's slot", "padded row"])
        ax.set_xticks(range(len(full)), [r.step for r in full], fontsize="x-small")
        ax.set_yticks(range(rows))
    fig.tight_layout()
    return fig


def plot_token_agreement(runs: dict[str, ServeResult], variants=("bug", "fix")) -> plt.Figure:
    """Token by token against eager (green: equal, red: differs), and the per-request agreement."""
    eager = runs["eager"]
    rids = sorted(eager.generations)
    fig, axes = plt.subplots(1, len(variants) + 1, figsize=(4.2 * (len(variants) + 1), 3.0),
                             gridspec_kw={"width_ratios": [2] * len(variants) + [1.6]})
    cmap = ListedColormap([plots.COLORS["bug"], plots.COLORS["fix"]])
    width = max(len(t) for t in eager.generations.values())
    for ax, v in zip(axes, variants):
        same = np.full((len(rids), width), np.nan)
        for i, rid in enumerate(rids):
            for k, (a, b) in enumerate(zip(runs[v].generations[rid], eager.generations[rid])):
                same[i, k] = float(a == b)
        ax.imshow(np.ma.masked_invalid(same), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        for i, rid in enumerate(rids):
            for k, token in enumerate(runs[v].generations[rid]):
                ax.text(k, i, str(token), ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(rids)), rids)
        ax.set_xlabel("generated token #")
        ax.set_title(f"{v}: tokens (green = eager's, red = not)")
    ax = axes[-1]
    xs = np.arange(len(rids))
    w = 0.8 / len(variants)
    for k, v in enumerate(variants):
        agree = agreement(runs[v], eager)
        ax.bar(xs + (k - (len(variants) - 1) / 2) * w, [agree[r] for r in rids], w, label=v,
               color=plots.COLORS.get(v, plots.COLORS["predicted"]))
    ax.set_xticks(xs, rids)
    ax.set_ylim(0, 1.25)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_ylabel("fraction of tokens = eager")
    ax.set_title("per-request agreement")
    ax.legend(fontsize="small", loc="upper center", ncols=len(variants))
    fig.tight_layout()
    return fig
