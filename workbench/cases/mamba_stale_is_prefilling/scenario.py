"""The experiment of case 04: a small workload served eagerly and through each variant's FULL
decode graphs, the upstream unit cases, the GPU record and the doctor's workload.

The workload is built so that the mechanism must fire: a request leaves the batch while another is
mid chunked prefill, ``condense()`` moves the latter down, and its old row keeps counters that say
"still prefilling". When three decodes later run the 4-row graph, that row is a padded row.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .mamba import MambaLM, tiny_mamba
from .runner import MAX_NUM_SEQS, NUM_SLOTS, MambaServer, Mismatch, Request, Scheduler, StepRecord
from .upstream import VARIANTS_WITH_GUARD, CommonAttentionMetadata, padded_is_prefilling, split_decodes_and_prefills

MAX_NUM_BATCHED_TOKENS = 8         # small token budget: long prompts are prefilled in chunks

# The upstream unit case (#41873): 3 real rows padded to 5; rows 3 and 4 hold stale counters.
UNIT_NUM_COMPUTED = [50, 100, 200, 10, 20]
UNIT_NUM_PROMPT = [50, 200, 200, 100, 200]
UNIT_NUM_REQS, UNIT_NUM_REQS_PADDED = 3, 5


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


@dataclasses.dataclass
class ServedRun:
    """One run of the workload through a ``MambaServer``: the tokens each request got and what
    every step did."""

    variant: str                       # "eager" or one of VARIANTS_WITH_GUARD
    generations: dict[str, list[int]]
    records: list[StepRecord]
    mismatches: list[Mismatch]
    slots: dict[str, int]              # the state slot each request was given
    min_margin: float                  # smallest top-1 minus top-2 logit over all sampled tokens


def serve(variant: str, device: str = "cpu", *, workload: list[Request] | None = None, seed: int = 0,
          model: MambaLM | None = None) -> ServedRun:
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
    return ServedRun(variant, sched.outputs, server.records, server.mismatches, dict(sched.slot), server.min_margin)


def serve_all(device: str = "cpu", *, seed: int = 0, max_tokens: int = 12,
              variants=("eager", *VARIANTS_WITH_GUARD)) -> dict[str, ServedRun]:
    """The eager reference and each variant on the same weights and workload."""
    model = tiny_mamba(seed, device=device)
    workload = default_workload(max_tokens, seed, model.config.vocab_size)
    return {v: serve(v, device, workload=workload, model=model) for v in tqdm(variants, desc="serving", leave=False)}


def agreement(result: ServedRun, reference: ServedRun) -> dict[str, float]:
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


def key_numbers(runs: dict[str, ServedRun]) -> dict:
    """The numbers a GPU run must reproduce exactly: unit cases, tokens, and who read whose slot."""
    eager = runs["eager"]
    return {
        "unit_is_prefilling": {v: unit_is_prefilling(v) for v in ("bug", "fix")},
        "unit_split": {v: list(unit_split(v)) for v in VARIANTS_WITH_GUARD},
        "generations": {v: r.generations for v, r in runs.items()},
        "agreement": {v: agreement(runs[v], eager) for v in VARIANTS_WITH_GUARD},
        "mismatches": {v: [[m.step, m.req_id, m.slot_read, m.slot_expected, m.state_of] for m in runs[v].mismatches]
                       for v in VARIANTS_WITH_GUARD},
        "full_steps": {v: [r.step for r in runs[v].records if r.mode == "full"] for v in VARIANTS_WITH_GUARD},
        "skipped_refresh_steps": {v: [r.step for r in runs[v].records if r.mode == "full" and not r.refreshed]
                                  for v in VARIANTS_WITH_GUARD},
        "min_margin": min(r.min_margin for r in runs.values()),
    }


def gpu_record(device: str = "cuda") -> dict:
    """``key_numbers`` of the eager reference and every variant served on ``device``.

    The model runs in float64, so CPU and GPU logits differ by ~1e-15 while the smallest gap
    between the top two logits of any sampled token (``min_margin``) is ~1e-2: argmax tokens cannot
    flip, and the tokens and slot mismatches are compared exactly.
    """
    return key_numbers(serve_all(device))


def describe_step(result: ServedRun, index: int) -> str:
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




# What the graph doctor should find in the bug variant: the kind, the op, and the file (in this
# package) and function of the source line the finding names. The fix variant: no finding.
DOCTOR_EXPECTED = ("stale-padding", "aten._to_copy", "mamba.py", "decode")


def doctor_workload(variant: str, device: str = "cpu", **options) -> Callable[[], None]:
    """What the graph doctor watches: the default workload served through ``variant``'s FULL graphs
    (``options`` go to ``serve``), nothing changed for the doctor."""
    def workload() -> None:
        serve(variant, device, **options)
    return workload
