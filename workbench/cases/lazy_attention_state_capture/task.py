"""The task the case's model serves: multi-digit addition, and the training that made ``data/addition_lm.pt``.

"a+b=" with both operands zero-padded to a common width of 1-3 digits; the answer is the sum
zero-padded to width+1 digits, least-significant digit first (the order a left-to-right model can
compute carries in), then EOS. "047+385=" -> "2340$" (432). Prompts of 4, 6 or 8 tokens give the
requests of one batch different sequence lengths, hence different split plans: that is what makes
a stale plan visible. Training lives here, with the case, so that ``workbench.data`` only calls it
(``python -m workbench.data addition_lm``) and nothing in the package imports ``workbench.data``.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import ROOT
from ...engine import resolve_device
from .split_kv import LMConfig, SplitKVLM

CHECKPOINT_NAME = "addition_lm.pt"
CHECKPOINT = ROOT / "data" / CHECKPOINT_NAME

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
