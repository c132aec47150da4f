"""Case 05: a lazily planned attention schedule that CUDA-graph capture never records (vLLM #42444).

Upstream, Model Runner V2's ``CudaGraphManager.capture`` (``vllm/v1/worker/gpu/cudagraph_utils.py``,
0.20.2) built the attention metadata once per captured size and used it twice: for a warmup
forward pass and for the captured pass. FlashMLA plans its split-KV schedule lazily on the first
call that finds the schedule empty, so the *warmup* planned it (for the dummy sequence lengths of
the capture inputs), the capture found it filled and recorded no planner, and every replay
attended with the warmup's plan whatever the real lengths were: garbled DeepSeek-V4 output. The
fix (0.22.0) creates a fresh attention state for the FULL capture so the planner runs, and is
recorded, inside it; PIECEWISE capture keeps the warmup state because attention runs eagerly there.

Here: a GPT-2-style LM (``workbench.models.split_kv``) trained on addition, served by a capture
manager with the upstream structure, FULL and PIECEWISE modes, ``variant="bug"`` (shared state)
and ``variant="fix"`` (fresh state for FULL).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
from typing import NamedTuple

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from tqdm.auto import tqdm

from .. import plots
from ..data import DATA_DIR
from ..engine import events, graph, graph_pool_handle, new_graph, resolve_device, validate_capture_sizes
from ..models import split_kv
from ..models.split_kv import LMConfig, SplitKVLM, SplitKVSchedule, empty_schedule, plan_splits

SLUG = "05_lazy_attention_state_capture"
CHECKPOINT_NAME = "addition_lm.pt"
CHECKPOINT = DATA_DIR / CHECKPOINT_NAME
VARIANTS = ("bug", "fix")
MODES = ("NONE", "FULL", "PIECEWISE")     # vLLM's CUDAGraphMode: NONE = eager

# ------------------------------------------------------------------------------------------- task
# "a+b=" with both operands zero-padded to a common width of 1-3 digits; the answer is the sum
# zero-padded to width+1 digits, least-significant digit first (the order a left-to-right model
# can compute carries in), then EOS. "047+385=" -> "2340$" (432). Prompts of 4, 6 or 8 tokens give
# the requests of one batch different sequence lengths, hence different split plans.
VOCAB = "0123456789+=$_"
PLUS, EQUALS, EOS, PAD = 10, 11, 12, 13
MAX_WIDTH = 3
MAX_NEW_TOKENS = MAX_WIDTH + 2                 # answer digits + EOS
CONFIG = LMConfig(vocab_size=len(VOCAB), max_len=16, d_model=64, n_heads=4, n_layers=2, d_ff=256,
                  block_size=4, max_splits=4)


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    b: int
    width: int

    @property
    def prompt(self) -> list[int]:
        return _digits(self.a, self.width) + [PLUS] + _digits(self.b, self.width) + [EQUALS]

    @property
    def answer(self) -> list[int]:
        return _digits(self.a + self.b, self.width + 1)[::-1] + [EOS]

    @property
    def held_out(self) -> bool:
        """One problem in ten, by a hash of (width, a, b), is never trained on."""
        key = (self.width * 1_000_000 + self.a * 1000 + self.b) * 2654435761
        return (key % 2**32) % 10 == 0


def _digits(x: int, width: int) -> list[int]:
    return [int(c) for c in str(x).zfill(width)]


def sample_problems(n: int, seed: int, *, held_out: bool = True) -> list[Problem]:
    """``n`` problems (width uniform in 1..3, operands uniform), only held-out ones or only training ones."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    g = torch.Generator().manual_seed(seed)
    out: list[Problem] = []
    while len(out) < n:
        widths = torch.randint(1, MAX_WIDTH + 1, (4 * n,), generator=g)
        ab = (torch.rand(2, 4 * n, generator=g) * 10.0 ** widths).long()
        out += [p for p in (Problem(a, b, w) for a, b, w in zip(*ab.tolist(), widths.tolist()))
                if p.held_out == held_out]
    return out[:n]


def parse_answer(tokens: list[int]) -> int | None:
    """The sum a generation states, or ``None`` if it is not digits followed by EOS."""
    if EOS not in tokens:
        return None
    digits = tokens[:tokens.index(EOS)]
    if not digits or any(t > 9 for t in digits):
        return None
    return int("".join(map(str, digits[::-1])))


def render(tokens: list[int]) -> str:
    return "".join(VOCAB[t] for t in tokens)


def render_answer(tokens: list[int]) -> str:
    """A generation up to its EOS (a server stops the request there; later steps are filler)."""
    return render(tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens)


def training_batch(problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (batch, time) and next-token targets, with the loss only on answer tokens."""
    t = CONFIG.max_len - 1
    tokens = torch.full((len(problems), t), PAD)
    targets = torch.full((len(problems), t), -100)
    for i, p in enumerate(problems):
        seq = p.prompt + p.answer
        tokens[i, :len(seq) - 1] = torch.tensor(seq[:-1])
        targets[i, len(p.prompt) - 1:len(seq) - 1] = torch.tensor(p.answer)
    return tokens, targets


# --------------------------------------------------------------------------------------- training
def train(seed: int = 0, steps: int = 1500, batch_size: int = 128, lr: float = 3e-3,
          progress: bool = True) -> tuple[SplitKVLM, dict]:
    """Train the LM on freshly sampled training problems (never held-out ones).

    Runs on one CPU thread: the summation order of a multi-threaded matmul depends on the thread
    count, so this makes the checkpoint bit-identical for a given seed whatever the core count
    (same torch build).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = SplitKVLM(CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
        warmup = 100
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
        losses = []
        bar = tqdm(range(steps), desc="training", disable=not progress)
        for step in bar:
            tokens, targets = training_batch(sample_problems(batch_size, seed * 1_000_003 + step, held_out=False))
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if step % 50 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}")
    finally:
        torch.set_num_threads(threads)
    info = {"seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr,
            "final_loss": float(np.mean(losses[-50:]))}
    return model.eval(), info


def write_checkpoint(path: pathlib.Path = CHECKPOINT, seed: int = 0) -> pathlib.Path:
    """Train and save weights, config and training settings (``python -m workbench.data``)."""
    model, info = train(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": dataclasses.asdict(CONFIG), "train": info,
                "state_dict": model.state_dict()}, path)
    return path


def load_model(device: str = "cpu", path: pathlib.Path = CHECKPOINT) -> SplitKVLM:
    """The trained LM from ``data/`` (regenerate it with ``python -m workbench.data addition_lm``)."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: regenerate it with `python -m workbench.data addition_lm`")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = SplitKVLM(LMConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["state_dict"])
    return model.to(resolve_device(device)).eval()


# -------------------------------------------------------------------------------- capture manager
@dataclasses.dataclass
class AttentionState:
    """What ``create_forward_fn`` builds for one capture: the lengths the attention reads and the
    (lazily planned) schedule. MRV2's ``CapturedAttentionState`` / ``attn_metadata``."""

    seq_lens: torch.Tensor
    schedule: SplitKVSchedule


class LoggedOp(NamedTuple):
    name: str          # the aten op, as ``RecordedOp.name``
    function: str      # the ``split_kv`` function that ran it ("-": none)
    line: int          # its line in split_kv.py (0: none)


class OpLog(TorchDispatchMode):
    """The kernels run inside the block (views skipped), each with the ``split_kv`` line it came from.

    Works under a real CUDA capture too (``torch.cuda.CUDAGraph`` exposes no op list); on the CPU
    it lists the ops ``CPUGraph.ops`` records that are not views.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[LoggedOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if writes or any(t.untyped_storage()._cdata not in inputs for t in outputs):
            self.ops.append(LoggedOp(str(func), *_model_frame()))
        return out


def _model_frame() -> tuple[str, int]:
    """The innermost ``split_kv`` frame on the stack: (function, line)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == split_kv.__file__:
            return frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return "-", 0


class CudaGraphManager:
    """Decode graphs per batch size, captured as MRV2's ``CudaGraphManager.capture`` does.

    Persistent input buffers (token ids, positions, sequence lengths) and a KV cache sized for the
    largest capture size; ``capture()`` goes largest size first, one shared pool. For each size,
    ``create_forward_fn`` prepares dummy capture inputs (seq_lens = the size, as upstream's
    ``prepare_inputs_to_capture``) and builds the attention state once; a warmup pass runs, then:

    * ``FULL``: the whole decode step is captured. ``variant="bug"`` (0.20.2) captures with the
      warmup's state, whose schedule the warmup already planned; ``variant="fix"`` (0.22.0) calls
      ``create_forward_fn`` again, so the capture plans, and records the planner.
    * ``PIECEWISE``: the layers between attention ops are captured as separate graphs and
      attention runs eagerly with a fresh state every step; both variants keep the warmup state.
    * ``NONE``: eager, a fresh state every step (the reference).

    Not the shared ``GraphRunner``: upstream's bug is about *which attention-state object* the
    capture sees, and ``GraphRunner`` has no notion of one.
    """

    def __init__(self, model: SplitKVLM, capture_sizes: list[int], *, mode: str = "FULL",
                 variant: str = "fix", device: str = "cpu") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.model, self.mode, self.variant = model, mode, variant
        self.device = resolve_device(device)
        self.capture_sizes = validate_capture_sizes(capture_sizes)
        self.max_size = self.capture_sizes[-1]
        cfg = model.cfg
        self.input_ids = torch.zeros(self.max_size, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(self.max_size, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.zeros(self.max_size, dtype=torch.int64, device=self.device)
        self.attn_out = torch.zeros(cfg.n_layers, self.max_size, cfg.n_heads, cfg.head_dim, device=self.device)
        self.kv_cache = model.new_kv_cache(self.max_size, self.device)
        self.pool = None
        self.graphs: dict[int, list] = {}              # size -> [graph] (FULL) or one graph per piece
        self.outputs: dict[int, torch.Tensor] = {}     # size -> static logits
        self.piece_qkv: dict[int, list] = {}           # PIECEWISE: size -> per layer (q, k, v) static outputs
        self.attn_states: dict[int, AttentionState] = {}   # upstream's captured_attn_states
        self.captured_ops: dict[int, list[LoggedOp]] = {}
        self.last_schedule: SplitKVSchedule | None = None

    # ------------------------------------------------------------------ capture
    def create_forward_fn(self, size: int):
        """Dummy capture inputs and ONE attention state, closed over by the returned forward_fn."""
        self.seq_lens[:size] = size          # upstream: "seq_lens ... to num_tokens rather than max_model_len"
        self.seq_lens[size:] = 0
        state = AttentionState(self.seq_lens[:size], empty_schedule())
        ids, pos = self.input_ids[:size], self.positions[:size]

        def forward_fn(cg_mode: str) -> torch.Tensor:
            if cg_mode == "PIECEWISE":
                return self._capture_pieces(size, ids, pos)
            return self.model.decode_step(ids, pos, self.model.cached_attention(
                self.kv_cache, pos, state.seq_lens, state.schedule))
        return forward_fn, state

    @torch.no_grad()
    def capture(self) -> None:
        if self.mode == "NONE":
            return
        if self.graphs:
            raise RuntimeError("capture() was already called; create a new manager to capture again")
        self.pool = graph_pool_handle(self.device)
        events.static_buffers(type(self).__name__, {"input_ids": self.input_ids, "positions": self.positions,
                                                    "seq_lens": self.seq_lens})
        for size in reversed(self.capture_sizes):
            forward_fn, state = self.create_forward_fn(size)
            with events.warmup():
                forward_fn("NONE")
            log = OpLog()
            if self.mode == "PIECEWISE":
                # Kept as upstream does (for the speculator); serving builds a fresh state per step.
                self.attn_states[size] = state
                with log:
                    self.outputs[size] = forward_fn("PIECEWISE")
            else:
                if self.variant == "fix":
                    # Capture with a fresh attention state: the lazy planning must happen, and be
                    # recorded, inside the capture (vLLM 0.22.0).
                    forward_fn, state = self.create_forward_fn(size)
                self.attn_states[size] = state
                g = new_graph(self.device)
                with graph(g, pool=self.pool, name=f"size {size}"), log:
                    self.outputs[size] = forward_fn("NONE")
                self.graphs[size] = [g]
            self.captured_ops[size] = log.ops

    def _capture_pieces(self, size: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One graph per stretch between attention ops; attention itself is skipped during capture
        (upstream ``skip_attn``) and reads/writes static buffers at replay."""
        pieces, qkv, open_capture = [], [], []

        def begin() -> None:
            g = new_graph(self.device)
            ctx = graph(g, pool=self.pool)
            ctx.__enter__()
            pieces.append(g)
            open_capture[:] = [ctx]

        def end() -> None:
            open_capture.pop().__exit__(None, None, None)

        def attention_boundary(layer, q, k, v):
            end()
            qkv.append((q, k, v))
            begin()
            return self.attn_out[layer, :size]

        begin()
        try:
            logits = self.model.decode_step(ids, pos, attention_boundary)
        except BaseException:
            if open_capture:
                open_capture.pop().__exit__(*sys.exc_info())
            raise
        end()
        self.graphs[size], self.piece_qkv[size] = pieces, qkv
        return logits

    # ------------------------------------------------------------------ serving
    def graph_size(self, n: int) -> int:
        if not 1 <= n <= self.max_size:
            raise ValueError(f"batch of {n} requests; this manager serves 1..{self.max_size}")
        return next(s for s in self.capture_sizes if s >= n)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Eager prefill of right-padded prompts into cache rows [0, n); logits of each last token."""
        self.graph_size(tokens.shape[0])
        return self.model.prefill(tokens.to(self.device), lengths.to(self.device), self.kv_cache)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Logits (n, vocab) for one token per request: eager, or graph replay on padded buffers
        (then a view of the graph's static output, overwritten by the next call)."""
        n = input_ids.shape[0]
        size = self.graph_size(n)
        if self.mode == "NONE":
            self.last_schedule = empty_schedule()
            return self.model.decode_step(input_ids, positions, self.model.cached_attention(
                self.kv_cache, positions, seq_lens, self.last_schedule))
        if size not in self.outputs:
            raise RuntimeError("no graphs captured yet: call capture() before decode()")
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.seq_lens[:n] = seq_lens
        if self.mode == "FULL":
            events.serve(self.graphs[size][0], n, size, outputs=self.outputs[size], padded={
                "input_ids": self.input_ids, "positions": self.positions, "seq_lens": self.seq_lens})
            self.graphs[size][0].replay()
            self.last_schedule = self.attn_states[size].schedule
        else:
            self.last_schedule = empty_schedule()
            attention = self.model.cached_attention(self.kv_cache, self.positions[:size],
                                                    self.seq_lens[:size], self.last_schedule)
            for layer, (piece, (q, k, v)) in enumerate(zip(self.graphs[size], self.piece_qkv[size])):
                piece.replay()
                self.attn_out[layer, :size] = attention(layer, q, k, v)
            self.graphs[size][-1].replay()
        out = self.outputs[size][:n]
        events.handed_out(self.graphs[size][-1], out)
        return out

    def planner_ops(self, size: int | None = None) -> list[str]:
        """Names of the captured ops that came from ``plan_splits`` (empty: the planner was not recorded)."""
        return [op.name for op in self.captured_ops[size or self.max_size] if op.function == "plan_splits"]


# ------------------------------------------------------------------------------------- generation
# The serving setup. Every decode batch of 4 requests replays the size-4 graph; vLLM captures with
# dummy sequence lengths equal to the graph size, so with the bug that graph attends with a plan
# for length 4 -- positions [0, 4) -- whatever the requests' lengths are (5 to 12 here).
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


def serve(model: SplitKVLM, problems: list[Problem], *, mode: str, variant: str = "fix",
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
    for name, mode in (("eager", "NONE"), ("bug", "FULL"), ("fix", "FULL")):
        manager = CudaGraphManager(model, list(CAPTURE_SIZES), mode=mode, variant="bug" if name == "bug" else "fix",
                                   device=device)
        manager.capture()
        manager.prefill(history, lens - 1)
        logits[name] = manager.decode(history[torch.arange(n, device=dev), lens - 1], lens - 1, lens).float().cpu()
        used[name] = manager.last_schedule.split_bounds[:n].cpu().tolist()
        if mode == "FULL":
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
        gens = {"eager": serve(model, problems, mode="NONE", device=device),
                "bug": serve(model, problems, mode="FULL", variant="bug", device=device),
                "fix": serve(model, problems, mode="FULL", variant="fix", device=device)}
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
    gens = {"eager": serve(model, problems, mode="NONE", device=device),
            "bug": serve(model, problems, mode="FULL", variant="bug", device=device),
            "fix": serve(model, problems, mode="FULL", variant="fix", device=device),
            "piecewise_bug": serve(model, problems, mode="PIECEWISE", variant="bug", device=device)}
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


# ------------------------------------------------------------------------------------------ plots
_PLAN_LABELS = {"eager": "needed: planned from the current lengths", "bug": "bug graph: the warmup's plan",
                "fix": "fix graph: plan recorded in the graph"}


def _draw_plans(ax: plt.Axes, x: float, plans: dict[str, np.ndarray], length: int, width: float = 0.26) -> None:
    """Stacked bars, one per plan, one segment per non-empty split; a dashed line at ``length``."""
    for j, (name, bounds) in enumerate(plans.items()):
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                ax.bar(x + (j - 1) * width, hi - lo, bottom=lo, width=width * 0.9, color=plots.COLORS[name],
                       edgecolor="white", linewidth=1.5)
    ax.hlines(length, x - 1.6 * width, x + 1.6 * width, color=plots.COLORS["limit"], linestyles="--", linewidth=1.2)


def _plan_legend(fig: plt.Figure, prompt: bool = False) -> None:
    handles = [plt.Rectangle((0, 0), 1, 1, color=plots.COLORS[k]) for k in _PLAN_LABELS]
    handles.append(plt.Line2D([], [], color=plots.COLORS["limit"], linestyle="--"))
    labels = [*_PLAN_LABELS.values(), "current sequence length"]
    if prompt:
        handles.append(plt.Rectangle((0, 0), 1, 1, color=plots.COLORS["real"], alpha=0.12))
        labels.append("positions holding the prompt")
    fig.legend(handles, labels, loc="lower center", ncol=len(labels) // 2 + len(labels) % 2 if prompt else 2,
               fontsize="small", bbox_to_anchor=(0.5, 1.0))


def plot_plans(gens: dict[str, Generation], *, batch: int = 0) -> plt.Figure:
    """Per request of one decode batch and per decode step: the KV positions each split covers, as
    needed by the current length, as the bug graph read them, and as the fix graph read them."""
    lens = gens["eager"].seq_lens[batch]
    steps, n = lens.shape
    fig, axes = plt.subplots(1, n, figsize=(3.3 * n, 3.6), sharey=True, squeeze=False)
    for r, ax in enumerate(axes[0]):
        for step in range(steps):
            _draw_plans(ax, step, {"eager": gens["eager"].plan_needed[batch][step, r],
                                   "bug": gens["bug"].plan_used[batch][step, r],
                                   "fix": gens["fix"].plan_used[batch][step, r]}, lens[step, r])
        p = gens["eager"].problems[batch * gens["eager"].batch_size + r]
        ax.axhspan(0, len(p.prompt), color=plots.COLORS["real"], alpha=0.12, zorder=0)
        ax.set_title(f"request {r}: {render(p.prompt)}", fontsize="medium")
        ax.set_xticks(range(steps))
        ax.set_xlabel("decode step")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("KV-cache position")
    axes[0, 0].set_ylim(0, gens["eager"].seq_lens[batch].max() + 1)
    _plan_legend(fig, prompt=True)
    fig.tight_layout()
    return fig


def plot_length_change(lc: LengthChange) -> plt.Figure:
    """One replay after the lengths changed: the plans per request (left) and how far each
    request's logits are from eager attention's (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for r, length in enumerate(lc.seq_lens):
        _draw_plans(left, r, {"eager": lc.plan_needed[r], "bug": lc.plan_used["bug"][r],
                              "fix": lc.plan_used["fix"][r]}, length)
    left.set_xticks(range(len(lc.seq_lens)), [f"request {r}\nlength {n}" for r, n in enumerate(lc.seq_lens)])
    left.set_ylabel("KV-cache position")
    left.set_title(f"split boundaries (graph captured with lengths {len(lc.seq_lens)})")
    left.grid(axis="y", alpha=0.3)
    x = np.arange(len(lc.seq_lens))
    floor = 1e-9            # an error of exactly 0 drawn at the floor of the log axis
    for j, name in enumerate(VARIANTS):
        err = np.maximum(lc.max_abs_error[name], floor)
        right.bar(x + (j - 0.5) * 0.38, err, width=0.36, color=plots.COLORS[name], label=f"{name} graph")
    right.set_yscale("log")
    right.set_ylim(floor / 2, 1e4)
    right.set_xticks(x, [f"length {n}" for n in lc.seq_lens])
    right.set_ylabel("max |logits - eager logits|")
    right.set_title("error of the replay (bars at 1e-9 are exact 0)")
    right.legend(fontsize="small", loc="upper left", ncol=2)
    _plan_legend(fig)
    fig.tight_layout()
    return fig


def plot_accuracy(result: CaseResult) -> plt.Figure:
    """Held-out exact-match accuracy, mean and std over eval-set seeds."""
    names = ["eager", "bug", "fix", "predicted"]
    labels = {"eager": "eager", "bug": "bug graph", "fix": "fix graph", "predicted": "bug, predicted"}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    plots.bars(ax, {labels[k]: result.mean(k) for k in names}, errors={labels[k]: result.std(k) for k in names},
               colors={labels[k]: plots.COLORS[k] for k in names}, ylim=(0, 1.1), ylabel="exact-match accuracy",
               title=f"{result.n_problems} held-out problems x {len(result.seeds)} eval seeds (mean ± std)")
    return fig


def plot_generations(gens: dict[str, Generation], *, batch: int = 0) -> plt.Figure:
    """The generations of one batch: prompt, then eager / bug / fix output and the sum it states."""
    first = batch * gens["eager"].batch_size
    rows = range(first, min(first + gens["eager"].batch_size, len(gens["eager"].problems)))
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * (len(rows) + 1)))
    ax.axis("off")
    columns = [("prompt", 0.0), ("eager", 0.24), ("bug", 0.5), ("fix", 0.76)]
    for name, x in columns:
        ax.text(x, 1.0, name, fontweight="bold", transform=ax.transAxes, va="top",
                color=plots.COLORS.get(name, "black"))
    for i, row in enumerate(rows):
        y = 1.0 - (i + 1) / (len(rows) + 1)
        p = gens["eager"].problems[row]
        ax.text(0.0, y, f"{render(p.prompt)}  ({p.a + p.b})", family="monospace", transform=ax.transAxes, va="top")
        for name, x in columns[1:]:
            toks = gens[name].tokens[row]
            value = parse_answer(toks)
            mark = "right" if value == p.a + p.b else "WRONG"
            ax.text(x, y, f"{render_answer(toks)} -> {value if value is not None else '?'}  {mark}", family="monospace",
                    transform=ax.transAxes, va="top", color=plots.COLORS[name])
    ax.set_title("Greedy generations (answer digits are least-significant first; $ = end)", loc="left")
    return fig


def explore(result: CaseResult):
    """A slider over decode batches: their plans and generations (JupyterLab only)."""
    import ipywidgets as widgets
    from IPython.display import display

    n_batches = len(result.example["eager"].seq_lens)

    def show(batch: int) -> None:
        display(plot_plans(result.example, batch=batch))
        display(plot_generations(result.example, batch=batch))
        plt.close("all")

    return widgets.interactive(show, batch=widgets.IntSlider(0, 0, n_batches - 1, description="batch"))
