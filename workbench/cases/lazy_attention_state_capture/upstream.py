"""The mirrored upstream code: Model Runner V2's ``CudaGraphManager`` and the attention state it captures.

Upstream (vLLM #42444, ``vllm/v1/worker/gpu/cudagraph_utils.py``): ``CudaGraphManager.capture``
(0.20.2) called ``create_forward_fn`` once per captured size. That fills the capture inputs with
dummy values (``prepare_inputs_to_capture``: sequence lengths equal to the size) and builds ONE
attention state, which the warmup pass and the capture then both used. FlashMLA plans its split-KV
schedule lazily, on the first call that finds the schedule empty: the warmup planned it, the capture
found it filled and recorded no planner, and every replay attended with the warmup's plan. The fix
(0.22.0) builds a fresh attention state for the FULL capture, so the planner runs, and is recorded,
inside it; PIECEWISE keeps the warmup state, because attention runs eagerly between the pieces with
a fresh state every step.

Warmup, capture, dispatch and replay are the engine's ``GraphManager``'s. What stays here is the
case's own policy, where the bug lives: the capture inputs of a size, and *which attention-state
object* each capture sees (``variant="bug"``: the warmup's; ``variant="fix"``: a fresh one for FULL).
"""
from __future__ import annotations

import dataclasses

import torch

from .. import check_variant
from ...engine import CUDAGraphMode, GraphManager, is_capturing
from .oplog import LoggedOp, OpLog
from .split_kv import SplitKVLM, SplitKVSchedule, empty_schedule


@dataclasses.dataclass
class AttentionState:
    """What ``create_forward_fn`` builds for one capture: the lengths the attention reads and the
    (lazily planned) schedule. MRV2's ``CapturedAttentionState`` / ``attn_metadata``."""

    seq_lens: torch.Tensor
    schedule: SplitKVSchedule


class CudaGraphManager:
    """Decode graphs per batch size, captured as MRV2's ``CudaGraphManager.capture`` does.

    Persistent input buffers (token ids, positions, sequence lengths) and a KV cache sized for the
    largest capture size; graphs are captured largest size first into one pool. Before each size,
    ``create_forward_fn`` fills the capture inputs with dummy lengths (the size, as upstream) and
    builds the attention state; a warmup pass runs with it, then:

    * ``FULL``: the whole decode step is captured. ``variant="bug"`` (0.20.2) captures with the
      warmup's state, whose schedule the warmup already planned; ``variant="fix"`` (0.22.0)
      captures with a fresh state, so the capture plans, and records the planner.
    * ``PIECEWISE``: the layers between attention ops are captured as separate graphs, and attention
      runs eagerly between them (``GraphManager.eager``) with a fresh state every step; both variants
      keep the warmup state.
    * ``NONE``: eager, a fresh state every step (the reference).

    ``mode`` is a ``CUDAGraphMode`` or its name, in any case.
    """

    def __init__(self, model: SplitKVLM, capture_sizes: list[int], *, mode: CUDAGraphMode | str = CUDAGraphMode.FULL,
                 variant: str = "fix", device: str = "cpu") -> None:
        self.model, self.variant = model, check_variant(variant)
        self.manager = GraphManager(self._forward, capture_sizes, device=device, mode=mode, num_warmups=1,
                                    static_buffers=self.create_forward_fn, name=type(self).__name__)
        self.mode, self.device = self.manager.mode, self.manager.device
        self.capture_sizes, self.max_size = self.manager.capture_sizes, self.manager.max_size
        self.input_ids = torch.zeros(self.max_size, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(self.max_size, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.zeros(self.max_size, dtype=torch.int64, device=self.device)
        self.kv_cache = model.new_kv_cache(self.max_size, self.device)
        self.attn_states: dict[int, AttentionState] = {}   # upstream's captured_attn_states
        self.captured_ops: dict[int, list[LoggedOp]] = {}
        self.last_schedule: SplitKVSchedule | None = None
        self._eager_attention = self.manager.eager(self._attention_between_pieces)

    @property
    def graphs(self) -> dict[int, list]:
        """Size -> [graph] (FULL) or one graph per piece (PIECEWISE)."""
        return self.manager.graphs

    @property
    def outputs(self) -> dict[int, torch.Tensor]:
        """Size -> static logits."""
        return self.manager.outputs

    # ------------------------------------------------------------------ capture
    def create_forward_fn(self, size: int) -> dict[str, torch.Tensor]:
        """Dummy capture inputs for ``size`` and ONE attention state for its warmup and capture.
        Returns the static buffers the graphs of ``size`` read (the manager announces them)."""
        self.seq_lens[:size] = size          # upstream: "seq_lens ... to num_tokens rather than max_model_len"
        self.seq_lens[size:] = 0
        self.attn_states[size] = AttentionState(self.seq_lens[:size], empty_schedule())
        return {"input_ids": self.input_ids, "positions": self.positions, "seq_lens": self.seq_lens}

    def capture(self) -> None:
        """Warmup and capture every size (nothing in mode NONE); the kernels each capture recorded
        go to ``captured_ops``."""
        log = OpLog(lambda: self.manager.capturing)
        with log:
            self.manager.capture()
        self.captured_ops.update(log.ops)

    def _forward(self, size: int) -> torch.Tensor:
        """The decode step the manager warms up and captures for ``size``."""
        ids, pos = self.input_ids[:size], self.positions[:size]
        if self.manager.capturing != size:           # a re-run of the step without graphs: fresh state
            state = AttentionState(self.seq_lens[:size], empty_schedule())
        elif not is_capturing():                     # the warmup: the state create_forward_fn built
            state = self.attn_states[size]
        elif self.mode is CUDAGraphMode.PIECEWISE:
            return self.model.decode_step(ids, pos, self._eager_attention)
        elif self.variant == "fix":
            # Capture with a fresh attention state: the lazy planning must happen, and be recorded,
            # inside the capture (vLLM 0.22.0).
            state = self.attn_states[size] = AttentionState(self.seq_lens[:size], empty_schedule())
        else:
            state = self.attn_states[size]           # the warmup's state, its schedule already planned
        return self.model.decode_step(ids, pos, self.model.cached_attention(
            self.kv_cache, pos, state.seq_lens, state.schedule))

    def _attention_between_pieces(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor) -> torch.Tensor:
        """PIECEWISE attention, run eagerly at every replay: a fresh schedule each step (the first
        layer plans it, the others reuse it), over the persistent positions and lengths."""
        size = q.shape[0]
        if layer == 0:
            self.last_schedule = empty_schedule()
        return self.model.cached_attention(self.kv_cache, self.positions[:size], self.seq_lens[:size],
                                           self.last_schedule)(layer, q, k, v)

    # ------------------------------------------------------------------ serving
    def _check_batch(self, n: int) -> None:
        if not 1 <= n <= self.max_size:
            raise ValueError(f"batch of {n} requests; this manager serves 1..{self.max_size}")

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Eager prefill of right-padded prompts into cache rows [0, n); logits of each last token."""
        self._check_batch(tokens.shape[0])
        return self.model.prefill(tokens.to(self.device), lengths.to(self.device), self.kv_cache)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Logits (n, vocab) for one token per request: eager, or graph replay on padded buffers
        (then a view of the graph's static output, overwritten by the next call)."""
        n = input_ids.shape[0]
        self._check_batch(n)
        size = self.manager.dispatch(n)
        if size is None:
            self.last_schedule = empty_schedule()
            return self.model.decode_step(input_ids, positions, self.model.cached_attention(
                self.kv_cache, positions, seq_lens, self.last_schedule))
        if not self.graphs:
            raise RuntimeError("no graphs captured yet: call capture() before decode()")
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.seq_lens[:n] = seq_lens
        out = self.manager.replay(size, n, padded={
            "input_ids": self.input_ids, "positions": self.positions, "seq_lens": self.seq_lens})
        if self.mode is CUDAGraphMode.FULL:
            self.last_schedule = self.attn_states[size].schedule
        return out

    def planner_ops(self, size: int | None = None) -> list[str]:
        """Names of the captured ops that came from ``plan_splits`` (empty: the planner was not recorded)."""
        return [op.name for op in self.captured_ops[size or self.max_size] if op.function == "plan_splits"]
