"""The experiments of case 05, the prediction from the mechanism, the GPU record and the doctor's workload.

Every decode batch of 4 requests replays the size-4 graph; vLLM captures with dummy sequence lengths
equal to the graph size, so with the bug that graph attends with a plan for length 4 -- positions
``[0, 4)`` -- whatever the requests' lengths are (5 to 12 here). The prediction follows: a request
stays right iff it was right eagerly and its whole prompt lies in ``[0, size)``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import VARIANTS
from ...engine import CUDAGraphMode, resolve_device
from .oplog import LoggedOp
from .split_kv import SplitKVLM, plan_splits
from .task import MAX_NEW_TOKENS, PAD, Problem, load_model, parse_answer, render_answer, sample_problems
from .upstream import CudaGraphManager

CAPTURE_SIZES = (1, 2, 4)
BATCH_SIZE = 4


@dataclasses.dataclass
class Generation:
    """Greedy decoding of a list of problems through one manager, with what each step planned."""

    problems: list[Problem]
    batch_size: int
    tokens: list[list[int]]              # generated tokens per problem
    logits: np.ndarray                   # (problems, MAX_NEW_TOKENS, vocab)
    seq_lens: list[np.ndarray]           # per batch: (decode steps, batch)
    plan_used: list[np.ndarray]          # per batch: (decode steps, batch, max_splits + 1)
    plan_needed: list[np.ndarray]

    @property
    def correct(self) -> list[bool]:
        return [parse_answer(t) == p.a + p.b for p, t in zip(self.problems, self.tokens)]

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.correct))


@torch.no_grad()
def generate(manager: CudaGraphManager, problems: list[Problem], *, batch_size: int = BATCH_SIZE) -> Generation:
    """Prefill each batch eagerly, then decode ``MAX_NEW_TOKENS - 1`` steps through ``manager``."""
    cfg, dev = manager.model.cfg, manager.device
    tokens, logits, seq_lens, used, needed = [], [], [], [], []
    for start in range(0, len(problems), batch_size):
        batch = problems[start:start + batch_size]
        lengths = torch.tensor([len(p.prompt) for p in batch], device=dev)
        prompts = torch.full((len(batch), int(lengths.max())), PAD, device=dev)
        for i, p in enumerate(batch):
            prompts[i, :len(p.prompt)] = torch.tensor(p.prompt)
        # .clone(): graph outputs are static buffers that the next replay overwrites.
        step_logits = [manager.prefill(prompts, lengths).float().cpu().clone()]
        next_ids = step_logits[0].argmax(-1).to(dev)
        b_lens, b_used, b_needed = [], [], []
        for step in range(MAX_NEW_TOKENS - 1):
            positions = lengths + step
            out = manager.decode(next_ids, positions, positions + 1)
            step_logits.append(out.float().cpu().clone())
            next_ids = out.argmax(-1)
            b_lens.append((positions + 1).cpu().numpy())
            b_used.append(manager.last_schedule.split_bounds[:len(batch)].cpu().clone().numpy())
            b_needed.append(plan_splits(positions + 1, block_size=cfg.block_size,
                                        max_splits=cfg.max_splits)[0].cpu().numpy())
        batch_logits = torch.stack(step_logits, dim=1)
        tokens += batch_logits.argmax(-1).tolist()
        logits.append(batch_logits.numpy())
        seq_lens.append(np.stack(b_lens))
        used.append(np.stack(b_used))
        needed.append(np.stack(b_needed))
    return Generation(problems, batch_size, tokens, np.concatenate(logits), seq_lens, used, needed)


def serve(model: SplitKVLM, problems: list[Problem], *, mode: CUDAGraphMode | str, variant: str = "fix",
          device: str = "cpu") -> Generation:
    """Capture (unless eager) and decode ``problems`` in batches of ``BATCH_SIZE``."""
    manager = CudaGraphManager(model, list(CAPTURE_SIZES), mode=mode, variant=variant, device=device)
    manager.capture()
    return generate(manager, problems)


# ------------------------------------------------------------------------------------- experiments
@dataclasses.dataclass
class LengthChange:
    """Capture, then one replay of the size-``len(seq_lens)`` graph with lengths unlike the capture's."""

    seq_lens: list[int]
    plan_needed: list[list[int]]
    plan_used: dict[str, list[list[int]]]             # variant -> split bounds the replay used
    planner_ops: dict[str, list[str]]                 # variant -> planner kernels in the FULL graph
    captured_ops: dict[str, list[LoggedOp]]           # variant -> kernels of the graph
    max_abs_error: dict[str, list[float]]             # variant -> per request |graph logits - eager logits|


def length_change(model: SplitKVLM, seq_lens: tuple[int, ...] = (2, 4, 9, 14), *,
                  device: str = "cpu") -> LengthChange:
    """The smallest reproduction: the cache holds ``seq_len - 1`` tokens per request, one decode step
    follows, through eager attention, the bug graph and the fix graph."""
    n = len(seq_lens)
    if n not in CAPTURE_SIZES:
        raise ValueError(f"give as many lengths as a captured size {CAPTURE_SIZES}, got {n}")
    if not all(2 <= s <= model.cfg.max_len for s in seq_lens):
        raise ValueError(f"lengths must be in 2..{model.cfg.max_len}, got {seq_lens}")
    dev = resolve_device(device)
    lens = torch.tensor(seq_lens, device=dev)
    history = torch.randint(0, 10, (n, model.cfg.max_len), generator=torch.Generator().manual_seed(0)).to(dev)
    logits, used, planner, ops = {}, {}, {}, {}
    for name, mode in (("eager", CUDAGraphMode.NONE), ("bug", CUDAGraphMode.FULL), ("fix", CUDAGraphMode.FULL)):
        manager = CudaGraphManager(model, list(CAPTURE_SIZES), mode=mode, variant="bug" if name == "bug" else "fix",
                                   device=device)
        manager.capture()
        manager.prefill(history, lens - 1)
        logits[name] = manager.decode(history[torch.arange(n, device=dev), lens - 1], lens - 1, lens).float().cpu()
        used[name] = manager.last_schedule.split_bounds[:n].cpu().tolist()
        if manager.mode is CUDAGraphMode.FULL:
            planner[name], ops[name] = manager.planner_ops(n), manager.captured_ops[n]
    needed = plan_splits(lens, block_size=model.cfg.block_size, max_splits=model.cfg.max_splits)[0]
    error = {k: (logits[k] - logits["eager"]).abs().amax(dim=-1).tolist() for k in VARIANTS}
    return LengthChange(list(seq_lens), needed.cpu().tolist(), {k: used[k] for k in VARIANTS}, planner, ops, error)


@dataclasses.dataclass
class CaseResult:
    seeds: list[int]
    n_problems: int
    accuracy: dict[str, list[float]]          # "eager" / "bug" / "fix" -> one accuracy per seed
    predicted_bug: list[float]                # per seed: eager-correct problems whose prompt fits the stale plan
    fix_equals_eager: bool                    # same tokens for every problem of every seed
    max_logit_diff_fix: float                 # max |fix - eager| over all logits
    example: dict[str, Generation]            # the first seed's generations

    def per_seed(self, name: str) -> list[float]:
        """Accuracies of "eager", "bug", "fix", or the "predicted" bug accuracy, one per seed."""
        return self.predicted_bug if name == "predicted" else self.accuracy[name]

    def mean(self, name: str) -> float:
        return float(np.mean(self.per_seed(name)))

    def std(self, name: str) -> float:
        return float(np.std(self.per_seed(name)))


def predicted_bug_accuracy(eager: Generation) -> float:
    """The mechanism's prediction: a batch replays the graph of size ``s`` whose warmup plan covers
    KV positions ``[0, s)``. The answer is a function of the prompt, so a request stays right iff
    it was right eagerly and its whole prompt lies in ``[0, s)``; every other one loses operand digits."""
    hits = []
    for start in range(0, len(eager.problems), eager.batch_size):
        chunk = eager.problems[start:start + eager.batch_size]
        size = next(s for s in CAPTURE_SIZES if s >= len(chunk))
        hits += [len(p.prompt) <= size for p in chunk]
    return float(np.mean(np.array(hits) & np.array(eager.correct)))


def run(model: SplitKVLM, *, seeds: tuple[int, ...] = (0, 1, 2), n_problems: int = 200,
        device: str = "cpu", progress: bool = True) -> CaseResult:
    """Held-out accuracy decoding eagerly, through the bug's and through the fix's FULL graphs, for
    several eval-set seeds (the error bars are over the sampling of the eval set)."""
    acc = {"eager": [], "bug": [], "fix": []}
    predicted, same, diff, example = [], True, 0.0, {}
    for seed in tqdm(seeds, desc="eval seeds", disable=not progress):
        problems = sample_problems(n_problems, seed)
        gens = {"eager": serve(model, problems, mode=CUDAGraphMode.NONE, device=device),
                "bug": serve(model, problems, mode=CUDAGraphMode.FULL, variant="bug", device=device),
                "fix": serve(model, problems, mode=CUDAGraphMode.FULL, variant="fix", device=device)}
        for name, g in gens.items():
            acc[name].append(g.accuracy)
        predicted.append(predicted_bug_accuracy(gens["eager"]))
        same &= gens["fix"].tokens == gens["eager"].tokens
        diff = max(diff, float(np.abs(gens["fix"].logits - gens["eager"].logits).max()))
        example = example or gens
    return CaseResult(list(seeds), n_problems, acc, predicted, same, diff, example)


def gpu_record(device: str = "cuda") -> dict:
    """The key numbers, for comparing a real CUDA-graph run with the CPU emulation (< 1 min on a GPU)."""
    model = load_model(device)
    lc = length_change(model, device=device)
    problems = sample_problems(200, seed=0)
    gens = {"eager": serve(model, problems, mode=CUDAGraphMode.NONE, device=device),
            "bug": serve(model, problems, mode=CUDAGraphMode.FULL, variant="bug", device=device),
            "fix": serve(model, problems, mode=CUDAGraphMode.FULL, variant="fix", device=device),
            "piecewise_bug": serve(model, problems, mode=CUDAGraphMode.PIECEWISE, variant="bug", device=device)}
    return {
        "seq_lens": lc.seq_lens,
        "plan_needed": lc.plan_needed,
        "plan_used": lc.plan_used,
        "planner_ops": lc.planner_ops,
        "captured_ops": {k: [op.name for op in v] for k, v in lc.captured_ops.items()},
        "length_change_max_abs_error": lc.max_abs_error,
        "n_problems": len(problems),
        "accuracy": {k: g.accuracy for k, g in gens.items()},
        "predicted_bug_accuracy": predicted_bug_accuracy(gens["eager"]),
        "fix_equals_eager": gens["fix"].tokens == gens["eager"].tokens,
        "piecewise_bug_equals_eager": gens["piecewise_bug"].tokens == gens["eager"].tokens,
        "generations": {k: [render_answer(t) for t in g.tokens[:BATCH_SIZE]] for k, g in gens.items()},
    }




# What the graph doctor should find in the bug variant: the kind, the op, and the file (in this
# package) and function of the source line the finding names. The fix variant: no finding.
DOCTOR_EXPECTED = ("warmup-divergence", "aten.", "split_kv.py", "plan_splits")


def doctor_workload(variant: str, device: str = "cpu", *, n_problems: int = 7) -> Callable[[], None]:
    """What the graph doctor watches: the FULL manager of ``variant`` captured and decoding a few
    held-out problems, nothing changed for the doctor."""
    def workload() -> None:
        manager = CudaGraphManager(load_model(device), list(CAPTURE_SIZES), mode=CUDAGraphMode.FULL, variant=variant,
                                   device=device)
        manager.capture()
        generate(manager, sample_problems(n_problems, seed=0))
    return workload
