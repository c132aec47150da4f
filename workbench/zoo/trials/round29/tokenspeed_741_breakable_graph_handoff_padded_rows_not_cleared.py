"""A padded breakable prefill graph hands an eager attention break's stale tail rows to the next segment.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/741 ("fix: clear padded breakable graph handoffs").
Symptom: the PR has no description; its regression test
(``test_replay_clears_unwritten_padding_at_break_handoff``) shows a padded replay passing an eager break's
undefined (NaN) tail rows on to the following graph segment, and ``scrub_padding_tail``'s docstring names
the harm: the padded-row garbage "grows across layers and can overflow to NaN through projections / FP8
quantize" (breakable prefill CUDA graphs, July 2026).
Mechanism: ``PrefillGraph.replay`` pads a prefill of ``num_tokens`` to a captured ``bucket`` and calls
``BreakableCapture.replay()``. Each attention layer is a ``@break_point`` (eager) between two captured
segments; ``_record_break``'s ``replay_fn`` runs the varlen attention on the live context, which writes
only the ``num_tokens`` real rows, and ``_land_in`` copies them into ``dst.narrow(0, 0, rows)`` of the
shape-keyed handoff buffer: its padded rows keep whatever an earlier, longer replay (or the capture's
dummy batch) left there. The following captured segment consumes all ``bucket`` rows; its dynamic
per-tensor FP8 activation quantization (modelled here as ``per_tensor_quant_fp8`` before ``o_proj``)
takes one amax over the whole tensor, so the stale rows set the scale with which the real rows are
quantized. (Which captured op first mixes rows is not in the diff; the FP8 quantize is the one the
helper's docstring names.)
Doctor: stale-padding, at ``per_tensor_quant_fp8`` (the per-tensor amax reads the handoff's stale padded rows).
Fix (upstream): ``BreakableCapture.replay(valid_rows=num_tokens)``; after each eager break lands its
result, ``scrub_padding_tail(valid_rows, dst)`` zeroes the handoff rows past the real prefix, so the
following segment sees zeros there.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/741"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "per_tensor_quant_fp8"
SYMPTOM = "padded prefill replay quantizes real rows with a scale set by a longer earlier prompt's stale rows"

VOCAB, DIM = 16, 8
BUCKET = 4                         # the one captured prefill bucket (tokens)
FP8_MAX = 448.0                    # torch.float8_e4m3fn's largest finite value


class ForwardContext:
    """The per-forward ambient context; a break reads the live one (rebound at replay)."""

    def __init__(self, input_num_tokens: int):
        self.input_num_tokens = input_num_tokens


_ambient: list[ForwardContext] = []


def current_forward_ctx() -> ForwardContext:
    return _ambient[-1]


class active_forward:                                    # noqa: N801 - upstream's name
    def __init__(self, ctx: ForwardContext):
        self.ctx = ctx

    def __enter__(self):
        _ambient.append(self.ctx)

    def __exit__(self, *exc):
        _ambient.pop()
        return False


def scrub_padding_tail(num_real_tokens: int, *tensors: torch.Tensor) -> None:
    """Zero the padded tail rows ``[num_real_tokens:]`` of token-shaped tensors in place."""
    for t in tensors:
        if t is not None and num_real_tokens < t.shape[0]:
            t[num_real_tokens:].zero_()


def _land_in(dst: torch.Tensor, result: torch.Tensor) -> None:
    """Copy the break's result into the stable handoff buffer: only its leading (real) rows."""
    if result.shape == dst.shape:
        dst.copy_(result)
    else:
        dst.narrow(0, 0, result.shape[0]).copy_(result)


class BreakableCapture:
    """An ordered list of captured graph segments and eager breaks sharing one pool."""

    def __init__(self, device: str, variant: str):
        self.device, self.variant = device, variant
        self.pool = graph_pool_handle(device)
        self.segments: list = []
        self._handoff: dict = {}
        self._valid_rows: int | None = None

    def add_graph(self, fn, static, name):
        g, out = capture(fn, device=self.device, pool=self.pool, static=static, name=name,
                         owner="BreakableCapture (prefill segment)")
        self.segments.append(("graph", g, out, static))
        return out

    def add_eager(self, fn):
        result = fn()
        self.segments.append(("eager", fn))
        return result

    def replay(self, size: int, valid_rows: int | None = None):
        previous, self._valid_rows = self._valid_rows, (valid_rows if self.variant == "fix" else None)
        out = None
        try:
            for seg in self.segments:
                if seg[0] == "eager":
                    seg[1]()
                    continue
                _, g, outputs, static = seg
                real = size if valid_rows is None else valid_rows
                # Handoff rows past the real prefix are padded rows the step left as they were,
                # unless the break scrubbed them (the fix).
                padded = {k: v for k, v in static.items() if k == "handoff"} if self._valid_rows is None else {}
                out = replay(g, outputs, real=real, size=size, padded=padded)
        finally:
            self._valid_rows = previous
        return out


def _record_break(cap: BreakableCapture, fn, args):
    """Record ``fn(*args, ctx)`` as an eager break; its first output lands in a shape-keyed handoff."""
    state: dict = {}

    def replay_fn():
        result = fn(*args, current_forward_ctx())
        dst = state.get("dst")
        if dst is None:
            key = (tuple(result.shape), result.dtype)
            dst = state["dst"] = cap._handoff.setdefault(key, torch.empty_like(result))
        _land_in(dst, result)
        if cap._valid_rows is not None:
            scrub_padding_tail(cap._valid_rows, dst)
        return dst

    return cap.add_eager(replay_fn)


class Model:
    def __init__(self, device):
        gen = generator(741)
        scale = torch.ones(VOCAB, 1)
        scale[8:] = 6.0                                   # some tokens embed with a much larger norm
        self.embed = (torch.randn(VOCAB, DIM, generator=gen) * scale).to(device)
        self.w_qkv = randn(DIM, 3 * DIM, gen=gen, device=device, scale=0.5)
        self.w_o = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.w_up = randn(DIM, DIM, gen=gen, device=device, scale=0.5)


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def qkv_proj(model, hidden):
    return hidden @ model.w_qkv


def varlen_attention(qkv, ctx: ForwardContext):
    """The eager break: causal attention over the live prompt's real tokens only (the varlen kernel
    writes ``sum(cu_seqlens_q)`` rows)."""
    n = ctx.input_num_tokens
    q, k, v = qkv[:n].split(DIM, dim=-1)
    scores = (q @ k.T) / DIM ** 0.5
    causal = torch.ones(n, n, dtype=torch.bool, device=qkv.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v


def per_tensor_quant_fp8(x):
    """Dynamic per-tensor FP8 quantization (quantize-dequantize): one amax over every row."""
    scale = x.abs().amax().clamp(min=1e-12) / FP8_MAX
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


def o_proj_and_mlp(model, attn_out, hidden):
    h = hidden + per_tensor_quant_fp8(attn_out) @ model.w_o
    return h + torch.relu(rms_norm(h) @ model.w_up)


def forward_eager(model, hidden, ctx):
    """The model's eager prefill forward on the real tokens."""
    return o_proj_and_mlp(model, varlen_attention(qkv_proj(model, hidden), ctx), hidden)


class PrefillGraph:
    def __init__(self, model, device, variant):
        self.model = model
        self.input_embeds_buf = torch.zeros(BUCKET, DIM, device=device)
        self.cap = BreakableCapture(device, variant)
        with active_forward(ForwardContext(BUCKET)):     # the capture's dummy batch fills the bucket
            qkv = self.cap.add_graph(lambda: qkv_proj(model, self.input_embeds_buf),
                                     {"input_embeds": self.input_embeds_buf}, "bucket 4 / segment 0")
            handoff = _record_break(self.cap, varlen_attention, (qkv,))
            self.cap.add_graph(lambda: o_proj_and_mlp(model, handoff, self.input_embeds_buf),
                               {"handoff": handoff, "input_embeds": self.input_embeds_buf},
                               "bucket 4 / segment 1")

    def replay(self, input_ids: torch.Tensor):
        num_tokens = input_ids.shape[0]
        self.input_embeds_buf[:num_tokens].copy_(self.model.embed[input_ids])
        # Re-pad tail rows: the padded tokens embed as token 1.
        self.input_embeds_buf[num_tokens:].copy_(self.model.embed[1].expand(BUCKET - num_tokens, DIM))
        with active_forward(ForwardContext(num_tokens)):
            out = self.cap.replay(BUCKET, valid_rows=num_tokens)
        return out[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    prompts = [[9, 12, 14, 10], [3, 5], [2, 6, 7], [8, 11, 13, 15], [4]]

    def served():
        graph = PrefillGraph(model, device, variant)
        return [graph.replay(torch.tensor(p, device=device)) for p in prompts]

    def eager():
        outs = []
        for p in prompts:
            ids = torch.tensor(p, device=device)
            with active_forward(ForwardContext(len(p))):
                outs.append(forward_eager(model, model.embed[ids], current_forward_ctx()).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
