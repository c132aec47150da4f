"""Case 01: RoBERTa position ids accumulate in CUDA-graph padded rows (vLLM #37884, #37873).

The runner owns a persistent ``positions`` buffer and refreshes only the slots of real tokens. A
batch of 6 tokens runs the graph captured for 8, so slots 6 and 7 are padded slots: handed to the
model, never refreshed. vLLM 0.18.1's ``replace_roberta_positions`` adds 2 to the whole view in
place, so those slots gain 2 at every step until the position embedding (514 rows) is indexed out
of range: ``IndexError`` on the CPU, a device-side assert on CUDA, after K requests.

K is predicted from the mechanism alone, before anything runs (``predict``):

* vLLM's startup calls the model on views of the same buffer without refreshing it
  (``startup_runs``): the profile run, a warmup and a capture per capture size (largest first),
  and the pooler warmup at ``max_num_reqs``. Each of them that executes ``pre_model`` adds 2 to
  every slot it covers. In PIECEWISE mode ``pre_model`` runs eagerly, capture included; in FULL
  mode it is captured, and a capture executes nothing. That gives ``v_init`` for a padded slot.
* Request ``k`` leaves ``v_init + 2k`` in the slot and looks up exactly that index, so the first
  failing request is the smallest ``k`` with ``v_init + 2k >= 514``.

The same arithmetic with vLLM's defaults (capture sizes up to 512, ``max_num_tokens`` 8192,
``max_num_reqs`` 256) and BGE-M3's 8194 positions gives 3999, the request count #37873 reports.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import get
from ...childproc import run_in_child
from ...expect import label_predicted_crash
from ...engine import CUDAGraphMode, GraphManager, validate_capture_sizes
from ...models.hf import tiny_model
from .upstream import DummyRun, RobertaRunner, from_transformers, startup_runs, vllm_capture_sizes

CASE = get("roberta_position_accumulation").stem
MAX_POSITIONS = 514          # RoBERTa-base's max_position_embeddings
PADDING_IDX = 1              # RoBERTa's pad_token_id; positions start at PADDING_IDX + 1
OFFSET = PADDING_IDX + 1     # what replace_roberta_positions adds per call
BOS, EOS = 0, 2              # <s> and </s> of the tiny vocabulary (no request contains PADDING_IDX)
TOLERANCE = 1e-5             # max abs difference to transformers that counts as "correct"
MODES = (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


# --------------------------------------------------------------------------- the prediction
def graph_mode(mode: CUDAGraphMode | str) -> CUDAGraphMode:
    """``PIECEWISE`` or ``FULL`` (strings in any case accepted): the graph modes the bug runs under."""
    mode = CUDAGraphMode.of(mode)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {[m.value for m in MODES]}, got {mode.value!r} "
                         "(without graphs there are no padded slots: use enforce_eager=True)")
    return mode


def leaves_shift(run: DummyRun, mode: CUDAGraphMode | str) -> bool:
    """Whether this run's ``+= 2`` lands in the buffer: every run executes ``pre_model``, except a
    FULL-mode capture, which only records it (a CUDA capture launches nothing)."""
    return not (run.kind == "capture" and graph_mode(mode) is CUDAGraphMode.FULL)


def predict_v_init(runs: Sequence[DummyRun], slot: int, mode: CUDAGraphMode | str) -> int:
    """Value of ``positions[slot]`` after startup (the buffer starts as zeros)."""
    return sum(v_init_breakdown(runs, slot, mode).values())


def v_init_breakdown(runs: Sequence[DummyRun], slot: int, mode: CUDAGraphMode | str) -> dict[str, int]:
    """``predict_v_init`` split by kind of startup run: how much each kind added to the slot."""
    mode = graph_mode(mode)
    parts: dict[str, int] = {}
    for r in runs:
        shift = OFFSET if r.num_tokens > slot and leaves_shift(r, mode) else 0
        parts[r.kind] = parts.get(r.kind, 0) + shift
    return parts


def predict_failing_step(v_init: int, max_positions: int = MAX_POSITIONS) -> int:
    """First request ``k >= 1`` whose padded slot ``v_init + 2k`` indexes past the table."""
    return max(1, math.ceil((max_positions - v_init) / OFFSET))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the mechanism says the bug variant will do, for one graph mode."""

    mode: CUDAGraphMode
    prompt_len: int
    padded_size: int
    v_init: int                 # the padded slots' value after startup (all equal here)
    failing_step: int           # K
    startup: dict[str, int]     # v_init by kind of startup run

    def padded_value(self, step: int) -> int:
        """The padded slots after request ``step`` (1-based), the index the embedding looked up."""
        return self.v_init + OFFSET * step


def predict(settings: Settings, mode: CUDAGraphMode | str = CUDAGraphMode.PIECEWISE) -> Prediction:
    """K for the bug variant, from ``startup_runs`` and arithmetic only (nothing is run).

    ``max_num_tokens`` is the runner's buffer, which is the largest capture size here. The padded
    size is the one a graph manager over these sizes dispatches to (nothing is captured).
    """
    mode = graph_mode(mode)
    sizes = sorted(settings.capture_sizes)
    padded = GraphManager(_no_step, sizes).dispatch(settings.prompt_len)
    if padded is None or padded == settings.prompt_len:
        raise ValueError(f"prompt_len={settings.prompt_len} has no padded slots with capture sizes "
                         f"{sizes}: choose a length just below a capture size (e.g. 6 with 8)")
    runs = startup_runs(sizes, max_num_tokens=max(sizes), max_num_reqs=settings.max_num_reqs,
                        num_warmups=settings.num_warmups)
    highest = predict_v_init(runs, 0, mode)             # slot 0 is in every run
    if highest >= MAX_POSITIONS:
        raise ValueError(f"these settings overflow during startup already (slot 0 reaches {highest} "
                         f">= {MAX_POSITIONS}): use fewer capture sizes or warmups")
    slot = max(range(settings.prompt_len, padded), key=lambda s: predict_v_init(runs, s, mode))
    v_init = predict_v_init(runs, slot, mode)
    return Prediction(mode, settings.prompt_len, padded, v_init, predict_failing_step(v_init),
                      v_init_breakdown(runs, slot, mode))


def _no_step(size: int) -> None:
    """The step of a graph manager that is only asked where it would dispatch."""



# --------------------------------------------------------------------------- the experiment
@dataclasses.dataclass(frozen=True)
class Settings:
    """The scenario: vLLM's default capture sizes, a stream of 6-token requests padded to 8."""

    capture_sizes: tuple[int, ...] = tuple(vllm_capture_sizes(512))
    prompt_len: int = 6                 # <s> + 4 tokens + </s>
    max_num_reqs: int = 256             # min(max_num_seqs, max_num_batched_tokens), vLLM's default
    num_warmups: int = 1                # cudagraph_num_of_warmups
    num_prompts: int = 16               # distinct prompts the stream cycles through
    seed: int = 0                       # weights and prompts
    shown_slots: int = 16               # buffer slots recorded after each step

    def __post_init__(self) -> None:
        validate_capture_sizes(self.capture_sizes)
        if self.prompt_len < 2:
            raise ValueError(f"prompt_len must be >= 2 (<s> and </s>), got {self.prompt_len}")
        if self.prompt_len > max(self.capture_sizes):
            raise ValueError(f"prompt_len={self.prompt_len} exceeds the largest capture size "
                             f"{max(self.capture_sizes)}")
        if self.num_prompts < 1 or self.shown_slots < 1:
            raise ValueError("num_prompts and shown_slots must be >= 1")


@dataclasses.dataclass
class StreamResult:
    """One configuration serving a stream of requests, one request per step."""

    label: str
    variant: str
    mode: CUDAGraphMode            # PIECEWISE, FULL, or NONE (enforce_eager)
    zero_padding: bool
    device: str
    prompt_len: int
    padded_size: int               # rows the model sees per step (prompt_len when eager)
    num_requests: int              # asked for
    served: int                    # completed before a failure (== num_requests when none)
    failed: bool
    failing_step: int | None       # 1-based request number that failed
    failure: str | None            # "IndexError" (CPU) or "device-side assert" (CUDA)
    error: str | None              # the exception's message
    startup_slots: list[int]       # positions[:shown_slots] after startup
    positions: list[list[int]]     # positions[:shown_slots] after each served request
    max_index: list[int]           # largest position-embedding index looked up, per served request
    max_abs_diff: list[float]      # per served request: max |hidden - transformers eager|

    def buffer(self) -> np.ndarray:
        """``[slot, step]`` with step 0 = after startup, step k = after request k."""
        return np.array([self.startup_slots, *self.positions]).T

    def summary(self) -> str:
        worst = max(self.max_abs_diff, default=float("nan"))
        end = (f"FAILED at request {self.failing_step} ({self.failure})" if self.failed
               else f"served all {self.served} requests")
        return f"{self.label}: {end}; max |diff| vs transformers over served requests = {worst:.2e}"


def make_prompts(settings: Settings, vocab_size: int) -> list[torch.Tensor]:
    """``num_prompts`` seeded requests ``<s> w1 .. wk </s>``; no token is the padding id."""
    gen = torch.Generator().manual_seed(settings.seed)
    words = torch.randint(3, vocab_size, (settings.num_prompts, settings.prompt_len - 2), generator=gen)
    return [torch.cat([torch.tensor([BOS]), w, torch.tensor([EOS])]) for w in words]


def _failure_kind(error: BaseException) -> str | None:
    if isinstance(error, IndexError):
        return "IndexError"
    if isinstance(error, RuntimeError) and "device-side assert" in str(error):
        return "device-side assert"
    return None


def serve_stream(settings: Settings, variant: str, num_requests: int, *, device: str = "cpu",
                 mode: CUDAGraphMode | str = CUDAGraphMode.PIECEWISE, zero_padding: bool = False,
                 enforce_eager: bool = False, label: str | None = None, progress: bool = False,
                 predicted_failure: int | None = None) -> StreamResult:
    """Start a runner as vLLM does, then serve ``num_requests`` requests one per step.

    Every output is compared with ``transformers`` run eagerly on that request alone. An
    out-of-range position stops the stream and is recorded (not raised): on CUDA it kills the
    context, so call this through ``run_stream``, which uses a child process there. A crash at
    ``predicted_failure`` ends the progress bar as an expected outcome, not as a failure.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    mode = CUDAGraphMode.NONE if enforce_eager else graph_mode(mode)
    with _one_cpu_thread(device):
        return _serve(settings, variant, num_requests, device, mode, zero_padding, label or variant,
                      progress, predicted_failure)


@contextlib.contextmanager
def _one_cpu_thread(device: str):
    """One intra-op thread on the CPU: these ops are tiny, so extra threads only add
    synchronisation, and on a busy machine they make every op ~100x slower."""
    if torch.device(device).type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _serve(settings: Settings, variant: str, num_requests: int, device: str, mode: CUDAGraphMode,
           zero_padding: bool, label: str, progress: bool, predicted_failure: int | None) -> StreamResult:
    hf = tiny_model("roberta", positions=MAX_POSITIONS - OFFSET, seed=settings.seed).to(device)
    model = from_transformers(hf, variant, device)
    prompts = make_prompts(settings, hf.config.vocab_size)
    with torch.no_grad():
        refs = [hf(input_ids=p[None].to(device)).last_hidden_state[0] for p in prompts]
    runner = RobertaRunner(model, settings.capture_sizes, device=device, cudagraph_mode=mode,
                           zero_padding=zero_padding, num_warmups=settings.num_warmups, max_num_reqs=settings.max_num_reqs)
    runner.capture()
    positions = runner.buffers["positions"]
    shown = min(settings.shown_slots, runner.max_size)
    rows = runner.padded_size(settings.prompt_len) or settings.prompt_len
    result = StreamResult(
        label=label, variant=variant, mode=mode,
        zero_padding=zero_padding, device=str(device), prompt_len=settings.prompt_len, padded_size=rows,
        num_requests=num_requests, served=0, failed=False, failing_step=None, failure=None, error=None,
        startup_slots=positions[:shown].tolist(), positions=[], max_index=[], max_abs_diff=[])
    with tqdm(total=num_requests, desc=result.label, disable=not progress, leave=False) as bar:
        for step in range(1, num_requests + 1):
            i = (step - 1) % len(prompts)
            try:
                (out,) = runner([prompts[i]])
                diff = (out - refs[i]).abs().max().item()   # a host sync: a device-side assert surfaces here
            except (IndexError, RuntimeError) as e:
                kind = _failure_kind(e)
                if kind is None:
                    raise
                result.failed, result.failing_step, result.failure, result.error = True, step, kind, str(e)
                _end_bar(bar, result, predicted_failure)
                break
            result.served = step
            result.max_abs_diff.append(diff)
            result.max_index.append(int(positions[:rows].max()) + model.index_offset)
            result.positions.append(positions[:shown].tolist())
            bar.update()
    return result


def _end_bar(bar: tqdm, result: StreamResult, predicted_failure: int | None) -> None:
    """A crash at the predicted request is the outcome the case shows: the bar says so and ends
    complete (a bar left short of its total reads as a failure). Any other crash stays a failure."""
    if bar.disable:
        return
    k = result.failing_step
    if k != predicted_failure:
        bar.set_description(f"{result.label}: crashed at request {k}, predicted {predicted_failure}")
        return
    label_predicted_crash(bar, k, result.label)


def can_crash(variant: str, zero_padding: bool, enforce_eager: bool) -> bool:
    """Only the in-place shift on unrefreshed padded slots can index past the table."""
    return variant == "bug" and not zero_padding and not enforce_eager


def run_stream(settings: Settings, variant: str, num_requests: int, *, device: str = "cpu",
               **kwargs) -> StreamResult:
    """``serve_stream``, in a spawned child process on CUDA when the configuration can crash (a
    device-side assert leaves the CUDA context unusable; the caller's must survive)."""
    crash = can_crash(variant, kwargs.get("zero_padding", False), kwargs.get("enforce_eager", False))
    if torch.device(device).type != "cuda" or not crash:
        return serve_stream(settings, variant, num_requests, device=device, **kwargs)
    child = run_in_child(serve_stream, settings, variant, num_requests, device=device, **kwargs)
    return child.raise_if_failed()


def reproduce(settings: Settings, device: str = "cpu", mode: CUDAGraphMode | str = CUDAGraphMode.PIECEWISE,
              extra_requests: int = 10, progress: bool = False) -> tuple[Prediction, StreamResult]:
    """The bug variant served until it fails: the prediction, and what happened."""
    prediction = predict(settings, mode)
    label = f"bug (vLLM 0.18.1), {prediction.mode.value} graphs"
    result = run_stream(settings, "bug", prediction.failing_step + extra_requests, device=device,
                        mode=prediction.mode, label=label, progress=progress,
                        predicted_failure=prediction.failing_step)
    return prediction, result


def recoveries(settings: Settings, num_requests: int, device: str = "cpu",
               progress: bool = False) -> dict[str, StreamResult]:
    """The fix, the runner-side defence, and eager mode, each serving ``num_requests`` requests."""
    return {
        "fix": run_stream(settings, "fix", num_requests, device=device, progress=progress,
                          label="fix (vLLM 0.19.0, #37884)"),
        "zero_padding": run_stream(settings, "bug", num_requests, device=device, zero_padding=True,
                                   progress=progress, label="bug + zeroed padding (#37873)"),
        "eager": run_stream(settings, "bug", num_requests, device=device, enforce_eager=True,
                            progress=progress, label="bug, enforce_eager"),
    }


# --------------------------------------------------------------------------- GPU record
def record_key(mode: CUDAGraphMode) -> str:
    """The GPU record's entry for the bug under ``mode`` (``bug_piecewise``, ``bug_full``)."""
    return f"bug_{mode.value.lower()}"


def gpu_record(device: str = "cuda", settings: Settings | None = None, fix_factor: int = 10) -> dict:
    """The case's key numbers on ``device``, JSON-ready: predicted and observed K in both graph
    modes, padded slots after startup and after the first requests, and the three fixed
    configurations serving ``fix_factor`` x K requests (K of PIECEWISE mode, vLLM's for these models)."""
    settings = settings or Settings()
    record: dict = {"settings": dataclasses.asdict(settings), "max_positions": MAX_POSITIONS}
    for mode in MODES:
        prediction, bug = reproduce(settings, device, mode)
        pad = slice(settings.prompt_len, prediction.padded_size)
        record[record_key(mode)] = {
            "predicted_v_init": prediction.v_init, "predicted_failing_step": prediction.failing_step,
            "failed": bug.failed, "failing_step": bug.failing_step, "failure": bug.failure,
            "error": bug.error, "startup_slots": bug.startup_slots,
            "padded_slots_first_steps": [row[pad] for row in bug.positions[:5]],
            "padded_slots_last_step": bug.positions[-1][pad] if bug.positions else None,
            "max_abs_diff_before_failure": max(bug.max_abs_diff, default=None),
        }
    for key, res in recoveries(settings, fix_factor * predict(settings).failing_step, device).items():
        record[key] = {"failed": res.failed, "served": res.served,
                       "max_abs_diff": max(res.max_abs_diff), "last_slots": res.positions[-1],
                       "max_index": max(res.max_index)}
    return record




# --------------------------------------------------------------------------- graph doctor
# What the graph doctor should find in the bug variant: the kind, the op, and the file (in this
# package) and function of the source line the finding names. The fix variant: no finding.
DOCTOR_EXPECTED = ("persistent-mutation", "aten.add_", "upstream.py", "replace_roberta_positions")


def doctor_workload(variant: str, device: str = "cpu",
                    mode: CUDAGraphMode | str = CUDAGraphMode.FULL) -> Callable[[], None]:
    """The scenario made small for the graph doctor: the runner started as vLLM starts it (sizes
    1-8) serving five requests of 3-8 tokens, so most of them run with padded slots."""
    mode = graph_mode(mode)

    def workload() -> None:
        hf = tiny_model("roberta", seed=0).to(device)
        runner = RobertaRunner(from_transformers(hf, variant, device), [1, 2, 4, 8], device=device,
                               cudagraph_mode=mode)
        runner.capture()
        gen = torch.Generator().manual_seed(0)
        for length in (6, 3, 8, 5, 6):
            runner([torch.randint(3, hf.config.vocab_size, (length,), generator=gen).to(device)])
    return workload
