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
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm.auto import tqdm

from .. import plots
from ..childproc import run_in_child
from ..engine import GraphError, GraphRunner, events, graph, graph_pool_handle, new_graph, validate_capture_sizes
from ..models.hf import tiny_model
from ..models.roberta import RobertaEmbeddingModel, from_transformers

CASE = "01_roberta_position_accumulation"
MAX_POSITIONS = 514          # RoBERTa-base's max_position_embeddings
PADDING_IDX = 1              # RoBERTa's pad_token_id; positions start at PADDING_IDX + 1
OFFSET = PADDING_IDX + 1     # what replace_roberta_positions adds per call
BOS, EOS = 0, 2              # <s> and </s> of the tiny vocabulary (no request contains PADDING_IDX)
TOLERANCE = 1e-5             # max abs difference to transformers that counts as "correct"
MODES = ("piecewise", "full")


# --------------------------------------------------------------------------- the mechanism
def vllm_capture_sizes(max_capture_size: int) -> list[int]:
    """vLLM's default ``cudagraph_capture_sizes``: 1, 2, 4, then every 8 below 256, every 16 above."""
    if max_capture_size < 1:
        raise ValueError(f"max_capture_size must be >= 1, got {max_capture_size}")
    sizes = [s for s in (1, 2, 4) if s <= max_capture_size]
    sizes += list(range(8, min(max_capture_size + 1, 256), 8))
    sizes += list(range(256, max_capture_size + 1, 16))
    return sizes


@dataclasses.dataclass(frozen=True)
class DummyRun:
    """One startup call of the model on ``positions[:num_tokens]`` (vLLM ``_dummy_run``)."""

    kind: str          # "profile", "warmup", "capture" or "pooler warmup"
    num_tokens: int


def startup_runs(capture_sizes: Sequence[int], *, max_num_tokens: int, max_num_reqs: int,
                 num_warmups: int = 1, enforce_eager: bool = False) -> list[DummyRun]:
    """The model calls vLLM makes before serving, in order (v0.18.1 ``gpu_worker`` / ``gpu_model_runner``).

    ``determine_available_memory`` -> ``profile_run``: one run at ``max_num_tokens``.
    ``compile_or_warm_up_model`` -> ``capture_model``: per capture size, largest first,
    ``cudagraph_num_of_warmups`` eager runs then the capture run; then the pooler warmup, one eager
    run at ``max_num_reqs = min(max_num_seqs, max_num_batched_tokens)``. Not modelled: extra
    ``compile_sizes`` (empty by default) and FULL decode-only graphs (embedding requests are
    prefills: they run the PIECEWISE "mixed prefill-decode" graphs).
    """
    runs = [DummyRun("profile", max_num_tokens)]
    if not enforce_eager:
        for size in sorted(capture_sizes, reverse=True):
            runs += [DummyRun("warmup", size)] * num_warmups + [DummyRun("capture", size)]
    return runs + [DummyRun("pooler warmup", max_num_reqs)]


def leaves_shift(run: DummyRun, mode: str) -> bool:
    """Whether this run's ``+= 2`` lands in the buffer: every run executes ``pre_model``, except a
    FULL-mode capture, which only records it (a CUDA capture launches nothing)."""
    return not (run.kind == "capture" and mode == "full")


def predict_v_init(runs: Sequence[DummyRun], slot: int, mode: str) -> int:
    """Value of ``positions[slot]`` after startup (the buffer starts as zeros)."""
    return sum(v_init_breakdown(runs, slot, mode).values())


def v_init_breakdown(runs: Sequence[DummyRun], slot: int, mode: str) -> dict[str, int]:
    """``predict_v_init`` split by kind of startup run: how much each kind added to the slot."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
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

    mode: str
    prompt_len: int
    padded_size: int
    v_init: int                 # the padded slots' value after startup (all equal here)
    failing_step: int           # K
    startup: dict[str, int]     # v_init by kind of startup run

    def padded_value(self, step: int) -> int:
        """The padded slots after request ``step`` (1-based), the index the embedding looked up."""
        return self.v_init + OFFSET * step


def predict(settings: Settings, mode: str = "piecewise") -> Prediction:
    """K for the bug variant, from ``startup_runs`` and arithmetic only (nothing is run).

    ``max_num_tokens`` is the runner's buffer, which is the largest capture size here.
    """
    sizes = sorted(settings.capture_sizes)
    padded = next((s for s in sizes if s >= settings.prompt_len), None)
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


# --------------------------------------------------------------------------- the runner
class RobertaRunner(GraphRunner):
    """vLLM's GPU model runner for this model, on top of ``GraphRunner``.

    ``GraphRunner`` gives the persistent buffers (``input_ids``, ``positions``) sized for the largest
    capture size, the capture sizes, padding to the next size and the shared pool. This subclass
    adds the three things vLLM does around the graph that matter here, which is why it replaces
    ``capture`` and ``__call__``:

    * ``capture()`` runs vLLM's whole startup (``startup_runs``) on views of the buffers, never
      refreshing them, as ``_dummy_run`` does.
    * Attention metadata (``request_ids``) is rebuilt over the whole padded batch every step, as
      vLLM's attention builder rebuilds ``query_start_loc``; positions are not (``copy_to_gpu(n)``).
    * ``cudagraph_mode="piecewise"`` captures only ``model.model`` and runs ``model.pre_model``
      eagerly on the padded views before every replay, as vLLM does for these prefill-only models;
      ``"full"`` captures ``model.forward`` whole.

    ``zero_padding=True`` is the second upstream defence (#37873): zero the padded positions
    before the model runs. ``enforce_eager=True``: no graphs, no padding.
    """

    def __init__(self, model: RobertaEmbeddingModel, capture_sizes: Sequence[int], *, device: str = "cpu",
                 cudagraph_mode: str = "piecewise", zero_padding: bool = False, enforce_eager: bool = False,
                 num_warmups: int = 1, max_num_reqs: int | None = None) -> None:
        if cudagraph_mode not in MODES:
            raise ValueError(f"cudagraph_mode must be one of {MODES}, got {cudagraph_mode!r}")
        super().__init__(model, {"input_ids": ((), torch.int32), "positions": ((), torch.int64)},
                         capture_sizes, device=device, num_warmups=num_warmups, enforce_eager=enforce_eager)
        self.cudagraph_mode = cudagraph_mode
        self.zero_padding = zero_padding
        self.max_num_reqs = self.max_size if max_num_reqs is None else max_num_reqs
        if not 1 <= self.max_num_reqs <= self.max_size:
            raise ValueError(f"max_num_reqs must be in [1, {self.max_size}], got {max_num_reqs}")
        self.request_ids = torch.zeros(self.max_size, dtype=torch.int64, device=self.device)
        self.startup: list[DummyRun] = []

    def _model_inputs(self, rows: int) -> dict[str, torch.Tensor]:
        return {**self._views(rows), "request_ids": self.request_ids[:rows]}

    def capture(self) -> list[DummyRun]:
        """Run vLLM's startup: profile run, warmups and captures, pooler warmup. Returns the runs."""
        if self.startup:
            raise GraphError("capture() was already called; create a new runner to start again.")
        self.pool = graph_pool_handle(self.device)
        self.startup = startup_runs(self.capture_sizes, max_num_tokens=self.max_size,
                                    max_num_reqs=self.max_num_reqs, num_warmups=self.num_warmups,
                                    enforce_eager=self.enforce_eager)
        events.static_buffers(type(self).__name__, self.buffers)
        with torch.no_grad():
            for run in self.startup:
                self.request_ids[:run.num_tokens].zero_()       # dummy batch: one request
                inputs = self._model_inputs(run.num_tokens)
                if run.kind != "capture":
                    with events.warmup() if run.kind == "warmup" else contextlib.nullcontext():
                        self.model(**inputs)
                    continue
                body = self.model
                if self.cudagraph_mode == "piecewise":
                    self.model.pre_model(inputs["input_ids"], inputs["positions"])
                    body = self.model.model
                g = new_graph(self.device)
                with graph(g, pool=self.pool, name=f"size {run.num_tokens}"):
                    self.outputs[run.num_tokens] = body(**inputs)
                self.graphs[run.num_tokens] = g
        return self.startup

    def __call__(self, requests: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Serve one batch of requests (1-D token tensors); returns each request's hidden states."""
        if not requests:
            raise ValueError("empty batch: give at least one request")
        lens = [int(r.numel()) for r in requests]
        if min(lens) == 0 or any(r.dim() != 1 for r in requests):
            raise ValueError(f"each request must be a non-empty 1-D token tensor, got lengths {lens}")
        n = sum(lens)
        if n > self.max_size:
            raise ValueError(f"{n} tokens exceed the runner's {self.max_size} (its largest capture size)")
        if not self.enforce_eager and not self.graphs:
            raise GraphError("no graphs captured yet: call runner.capture() before serving")
        size = self.padded_size(n)
        rows = n if size is None else size
        self.steps += 1
        self.history.append((n, size))
        # What _prepare_inputs writes: real tokens and their positions, metadata for the padded batch.
        self.buffers["input_ids"][:n].copy_(torch.cat(requests).to(torch.int32))
        self.buffers["positions"][:n].copy_(torch.cat([torch.arange(k) for k in lens]))
        request_ids = torch.full((rows,), -1, dtype=torch.int64)
        request_ids[:n] = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        self.request_ids[:rows].copy_(request_ids)
        if self.zero_padding and rows > n:
            self.buffers["positions"][n:rows].zero_()                   # vLLM 0.19.0 _preprocess
        inputs = self._model_inputs(rows)
        with torch.no_grad():
            if size is None:
                out = self.model(**inputs)
            else:
                if self.cudagraph_mode == "piecewise":
                    self.model.pre_model(inputs["input_ids"], inputs["positions"])
                events.serve(self.graphs[size], n, size, padded=self.buffers, outputs=self.outputs[size])
                self.graphs[size].replay()
                out = self.outputs[size]
        starts = np.cumsum([0] + lens)
        per_request = [out[a:b] for a, b in zip(starts[:-1], starts[1:])]
        if size is not None:
            events.handed_out(self.graphs[size], per_request)
        return per_request


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
    mode: str                      # "piecewise", "full" or "eager"
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
                 mode: str = "piecewise", zero_padding: bool = False, enforce_eager: bool = False,
                 label: str | None = None, progress: bool = False) -> StreamResult:
    """Start a runner as vLLM does, then serve ``num_requests`` requests one per step.

    Every output is compared with ``transformers`` run eagerly on that request alone. An
    out-of-range position stops the stream and is recorded (not raised): on CUDA it kills the
    context, so call this through ``run_stream``, which uses a child process there.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    with _one_cpu_thread(device):
        return _serve(settings, variant, num_requests, device, mode, zero_padding, enforce_eager,
                      label or variant, progress)


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


def _serve(settings: Settings, variant: str, num_requests: int, device: str, mode: str,
           zero_padding: bool, enforce_eager: bool, label: str, progress: bool) -> StreamResult:
    hf = tiny_model("roberta", positions=MAX_POSITIONS - OFFSET, seed=settings.seed).to(device)
    model = from_transformers(hf, variant, device)
    prompts = make_prompts(settings, hf.config.vocab_size)
    with torch.no_grad():
        refs = [hf(input_ids=p[None].to(device)).last_hidden_state[0] for p in prompts]
    runner = RobertaRunner(model, settings.capture_sizes, device=device, cudagraph_mode=mode,
                           zero_padding=zero_padding, enforce_eager=enforce_eager,
                           num_warmups=settings.num_warmups, max_num_reqs=settings.max_num_reqs)
    runner.capture()
    positions = runner.buffers["positions"]
    shown = min(settings.shown_slots, runner.max_size)
    rows = runner.padded_size(settings.prompt_len) or settings.prompt_len
    result = StreamResult(
        label=label, variant=variant, mode="eager" if enforce_eager else mode,
        zero_padding=zero_padding, device=str(device), prompt_len=settings.prompt_len, padded_size=rows,
        num_requests=num_requests, served=0, failed=False, failing_step=None, failure=None, error=None,
        startup_slots=positions[:shown].tolist(), positions=[], max_index=[], max_abs_diff=[])
    for step in tqdm(range(1, num_requests + 1), desc=result.label, disable=not progress, leave=False):
        i = (step - 1) % len(prompts)
        try:
            (out,) = runner([prompts[i]])
            diff = (out - refs[i]).abs().max().item()   # a host sync: a device-side assert surfaces here
        except (IndexError, RuntimeError) as e:
            kind = _failure_kind(e)
            if kind is None:
                raise
            result.failed, result.failing_step, result.failure, result.error = True, step, kind, str(e)
            break
        result.served = step
        result.max_abs_diff.append(diff)
        result.max_index.append(int(positions[:rows].max()) + model.index_offset)
        result.positions.append(positions[:shown].tolist())
    return result


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


def reproduce(settings: Settings, device: str = "cpu", mode: str = "piecewise",
              extra_requests: int = 10, progress: bool = False) -> tuple[Prediction, StreamResult]:
    """The bug variant served until it fails: the prediction, and what happened."""
    prediction = predict(settings, mode)
    label = f"bug (vLLM 0.18.1), {mode.upper()} graphs"
    result = run_stream(settings, "bug", prediction.failing_step + extra_requests, device=device,
                        mode=mode, label=label, progress=progress)
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
def gpu_record(device: str = "cuda", settings: Settings | None = None, fix_factor: int = 10) -> dict:
    """The case's key numbers on ``device``, JSON-ready: predicted and observed K in both graph
    modes, padded slots after startup and after the first requests, and the three fixed
    configurations serving ``fix_factor`` x K requests (K of PIECEWISE mode, vLLM's for these models)."""
    settings = settings or Settings()
    record: dict = {"settings": dataclasses.asdict(settings), "max_positions": MAX_POSITIONS}
    for mode in MODES:
        prediction, bug = reproduce(settings, device, mode)
        pad = slice(settings.prompt_len, prediction.padded_size)
        record[f"bug_{mode}"] = {
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


# --------------------------------------------------------------------------- figures
def _crash_label(res: StreamResult) -> str:
    return f"{res.failure} at request {res.failing_step}"


def _color(res: StreamResult) -> str:
    """Red: the bug as shipped; green: a fix (either defence); grey: eager."""
    if res.mode == "eager":
        return plots.COLORS["eager"]
    return plots.COLORS["bug"] if can_crash(res.variant, res.zero_padding, False) else plots.COLORS["fix"]


def _linestyle(res: StreamResult) -> str:
    return ":" if res.mode == "eager" else ("--" if res.zero_padding or res.mode == "full" else "-")


def plot_positions_heatmaps(streams: Sequence[StreamResult]) -> plt.Figure:
    """The positions buffer (slot x step) for each stream, colour limits 0..514 shared."""
    fig, axes = plt.subplots(len(streams), 1, figsize=(10, 2.8 * len(streams)), squeeze=False)
    box = {"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1.5}
    for ax, res in zip(axes[:, 0], streams):
        im = plots.heatmap(ax, res.buffer(), xlabel="request (0 = after startup)", ylabel="buffer slot",
                           title=res.label, vmin=0, vmax=MAX_POSITIONS, colorbar_label="position id")
        im.colorbar.ax.axhline(MAX_POSITIONS, color=plots.COLORS["limit"], linewidth=3)
        im.colorbar.ax.set_yticks([0, 256, MAX_POSITIONS], ["0", "256", f"{MAX_POSITIONS} = table size"])
        ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
        bands = [(0, res.prompt_len, "real tokens", plots.COLORS["real"])]
        if res.padded_size > res.prompt_len:
            bands.append((res.prompt_len, res.padded_size, "padded slots", plots.COLORS["padded"]))
            for y in (res.prompt_len - 0.5, res.padded_size - 0.5):
                ax.axhline(y, color=plots.COLORS["padded"], linewidth=1.2)
        bands.append((res.padded_size, len(res.startup_slots), "not in the model's view", "#555555"))
        for lo, hi, text, color in bands:
            if hi > lo:
                ax.text(0.01, (lo + hi) / 2 - 0.5, text, color=color, va="center", ha="left",
                        fontsize="small", fontweight="bold", transform=ax.get_yaxis_transform(), bbox=box)
        if res.failed:
            k = res.failing_step
            ax.axvspan(k - 0.5, k + 0.5, color=plots.COLORS["bug"])
            ax.set_xlim(-0.5, k + 0.5 + 0.02 * k)
            note, color = _crash_label(res), plots.COLORS["bug"]
        else:
            note, color = f"largest index looked up: {max(res.max_index)}", "#333333"
        ax.text(0.99, 0.97, note, ha="right", va="top", color=color, fontsize="small", fontweight="bold",
                transform=ax.transAxes, bbox=box)
    fig.tight_layout()
    return fig


def plot_index_growth(predictions: Sequence[Prediction], streams: Sequence[StreamResult],
                      log: bool = False) -> plt.Figure:
    """Largest position-embedding index looked up at each request, against the predictions
    (one per graph mode; a stream's crash is marked at its mode's predicted index)."""
    by_mode = {p.mode: p for p in predictions}
    fig, ax = plt.subplots(figsize=(9, 4))
    for res in streams:
        label = res.label if res.failed else f"{res.label}: at most {max(res.max_index)}"
        ax.step(np.arange(1, res.served + 1), res.max_index, where="post", color=_color(res),
                linestyle=_linestyle(res), linewidth=2, label=label)
        if res.failed and res.mode in by_mode:
            index = by_mode[res.mode].padded_value(res.failing_step)
            ax.plot([res.failing_step], [index], "x", color=_color(res), markersize=10, mew=2.5,
                    label=f"{_crash_label(res)} (index {index})")
    for p in predictions:
        k = np.arange(1, p.failing_step + 1)
        ax.plot(k, p.v_init + OFFSET * k, color=plots.COLORS["predicted"], linestyle=":", linewidth=2.5,
                label=f"predicted, {p.mode.upper()}: {p.v_init} + 2k, fails at k = {p.failing_step}")
    ax.axhline(MAX_POSITIONS, color=plots.COLORS["limit"], linestyle="--", linewidth=1,
               label=f"max_position_embeddings = {MAX_POSITIONS}")
    if log:
        ax.set_yscale("log", base=2)
        ax.set_ylim(2, MAX_POSITIONS * 1.5)
        ticks = [2, 8, 32, 128, MAX_POSITIONS]
        ax.set_yticks(ticks, [str(t) for t in ticks])
    else:
        ax.set_ylim(0, MAX_POSITIONS * 1.08)
    ax.set_xlabel("request")
    ax.set_ylabel("largest position index looked up" + (" (log scale)" if log else ""))
    p = predictions[0]
    ax.set_title(f"{p.prompt_len}-token requests padded to {p.padded_size}")
    ax.legend(loc="lower right" if not log else "center right", fontsize="small")
    fig.tight_layout()
    return fig


def plot_correctness(streams: Sequence[StreamResult], floor: float = 1e-9) -> plt.Figure:
    """Per-request max |hidden - transformers|, one panel per stream (exact zeros drawn at ``floor``)."""
    cols = 2 if len(streams) > 1 else 1
    rows = math.ceil(len(streams) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.8 * rows), sharey=True, squeeze=False)
    for ax, res in zip(axes.flat, streams):
        ax.plot(np.arange(1, res.served + 1), np.maximum(res.max_abs_diff, floor), ".", markersize=2,
                color=_color(res))
        ax.axhline(TOLERANCE, color=plots.COLORS["limit"], linestyle="--", linewidth=1)
        ax.text(0.01, TOLERANCE, f" tolerance {TOLERANCE:g}", va="bottom", fontsize="small",
                transform=ax.get_yaxis_transform())
        if res.failed:
            ax.axvline(res.failing_step, color=plots.COLORS["bug"], linewidth=2)
            ax.text(res.failing_step, 1e-4, _crash_label(res) + " ", ha="right", fontsize="small",
                    color=plots.COLORS["bug"], fontweight="bold")
            ax.set_xlim(0, res.failing_step * 1.05)
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, 1e-3)
        ax.set_title(f"{res.label}: worst {max(res.max_abs_diff):.1e}", fontsize="medium")
        ax.set_xlabel("request")
    for ax in axes[:, 0]:
        ax.set_ylabel("max |hidden - transformers|")
    for ax in list(axes.flat)[len(streams):]:
        ax.set_visible(False)
    fig.suptitle("Each served request vs transformers.RobertaModel run eagerly on that request alone")
    fig.tight_layout()
    return fig


def plot_buffer_row(streams: Sequence[StreamResult], step: int) -> plt.Figure:
    """The positions buffer after request ``step`` for each stream, as bars per slot."""
    fig, axes = plt.subplots(1, len(streams), figsize=(3.6 * len(streams), 3.2), sharey=True, squeeze=False)
    for ax, res in zip(axes[0], streams):
        slots = np.arange(len(res.startup_slots))
        kind = np.where(slots < res.prompt_len, "real", np.where(slots < res.padded_size, "padded", "unused"))
        colors = [plots.COLORS.get(k, "#cccccc") for k in kind]
        if step <= res.served:
            values = res.buffer()[:, step]
            title = f"{res.label}\nafter request {step}"
            top = int(values[res.prompt_len:res.padded_size].max()) if res.padded_size > res.prompt_len else None
            if top is not None:
                ax.annotate(str(top), (res.prompt_len - 0.5 + (res.padded_size - res.prompt_len) / 2, top),
                            ha="center", va="bottom", fontsize="small", color=plots.COLORS["padded"])
        else:
            values = np.zeros(len(slots))
            title = f"{res.label}\n{_crash_label(res)}"
        ax.bar(slots, values, color=colors)
        ax.axhline(MAX_POSITIONS, color=plots.COLORS["limit"], linestyle="--", linewidth=1)
        ax.set_title(title, fontsize="small")
        ax.set_xlabel("buffer slot")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               (plots.COLORS["real"], plots.COLORS["padded"], "#cccccc")]
    axes[0, -1].legend(handles + [plt.Line2D([], [], color=plots.COLORS["limit"], linestyle="--")],
                       ["real tokens", "padded slots", "not in view", f"table size {MAX_POSITIONS}"],
                       fontsize="x-small", loc="center right")
    axes[0, 0].set_ylabel("position id")
    axes[0, 0].set_ylim(0, MAX_POSITIONS * 1.12)
    fig.tight_layout()
    return fig


def explore(streams: Sequence[StreamResult]):
    """An ipywidgets step slider over ``plot_buffer_row`` (blue real, orange padded, grey unused)."""
    import ipywidgets as widgets

    def view(step: int) -> None:
        plot_buffer_row(streams, step)
        plt.show()

    last = max(r.served for r in streams)
    return widgets.interact(view, step=widgets.IntSlider(value=streams[0].served, min=0, max=last, step=1,
                                                         continuous_update=False))
