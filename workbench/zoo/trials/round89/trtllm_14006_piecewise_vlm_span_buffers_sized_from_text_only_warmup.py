"""AutoDeploy piecewise CUDA graph: Gemma4's multimodal span kwargs get static input buffers sized by the text-only warmup; an image batch's spans do not fit them.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/14006 ("[#13858][fix] AutoDeploy fix the piecewise vlm issue",
NVIDIA/TensorRT-LLM, merged 2026-05). Read: the PR description and its CodeRabbit summary ("move the Gemma related op
to the dynamic split ... update the kwargs capture to only capture the static related ones"; "allocate memory only for
... [inputs] actually consumed by compiled submodules"), the text of issue #13858 ("Gemma4 image batches carry
variable-length multimodal span tensors. Piecewise CUDA graph currently sizes those buffers from text-only warmup"),
and a stored pre-fix version of tensorrt_llm/_torch/auto_deploy/compile/backends/torch_cudagraph.py
(PiecewiseCapturedGraph._allocate_static_input_buffers / _copy_to_static_buffers / warmup_and_capture / forward,
DualModeCapturedGraph, _setup_piecewise_mixed_batch, _capture_inner_kwargs). Not read: the PR diff itself,
piecewise_utils.split_graph_at_dynamic_ops, the Gemma4 mask-preparation op and the exact layout of its span tensors.
Symptom: with `piecewise_enabled: true`, Gemma4 (MoE / E2B) image batches cannot use the piecewise prefill graphs: the
span kwargs were given fixed-size static buffers during the text-only warmup, so a batch carrying more multimodal
spans than the warmup dummy does not fit (the issue: "piecewise is disabled for these tests").
Mechanism: PiecewiseCapturedGraph.warmup_and_capture() calls _allocate_static_input_buffers(get_args_kwargs), which
probes the warmup dummy batch (_setup_piecewise_mixed_batch: text-only, `input_ids` all ones) and gives every tensor
kwarg whose address changes between calls and whose size changes with num_tokens a static buffer
`torch.empty_like(v1)` at the largest bucket. The Gemma4 span tensors are among them, sized by the dummy's text-only
sequences. At runtime DualModeCapturedGraph routes a prefill batch to the nearest bucket and
PiecewiseCapturedGraph.forward() calls _copy_to_static_buffers(kwargs): `buf.narrow(dyn_dim, 0, src.shape[dyn_dim])`
- with more spans than the warmup had, the narrow does not fit the buffer. The mask op that reads the spans sat in
a static (captured) partition, which is why its inputs needed stable addresses at all.
Doctor: undersized-buffer, at _copy_to_static_buffers. Runtime data (the image batch's span rows) is copied into a
static graph input buffer whose size was fixed by the text-only warmup; it does not fit.
Fix (upstream): split the Gemma4 mask-preparation op into the dynamic (eager) partitions and give static buffers only
to kwargs consumed by the captured (static) submodules; the span tensors then reach the eager mask op as they are.
Modelled: PiecewiseCapturedGraph (the four methods above, same names and control flow), ADPiecewiseRunner (warmup /
capture / replay phases, one graph per num_tokens bucket, shared graph pool), DualModeCapturedGraph's bucket lookup and
output truncation, _setup_piecewise_mixed_batch. The split graph is a stand-in for split_graph_at_dynamic_ops' result
on a one-layer Gemma4 text model: [static: qkv (+ mask prep before the fix)] -> [dynamic: attention] ->
[static: o-proj + MLP + lm head]; attention is causal with bidirectional attention inside an image span (Gemma3/4
style). Stand-in span layout: `mm_span_starts` / `mm_span_lens` hold one row per image item and a zero-length row for a
text-only sequence. Sizes: hidden 8, vocab 16, float64; one bucket of 16 tokens; dummy max_seq_len 7.
Workload: warmup at bucket 16 (dummy: sequences 7, 7, 1 + a decode token -> 4 span rows; the 15-token probe has 3, so
the span buffers are sized 4). Step 1: text-only prefill of 5 + 4 tokens (2 span rows) replays bucket 16 and matches
eager. Step 2: request C (4 images of 2 tokens, 12 tokens) + request D (3 text tokens): 5 span rows into the 4-row
buffer -> the copy raises; fixed, the span rows go to the eager mask op and the step equals eager.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/14006"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_copy_to_static_buffers"
SYMPTOM = ("Gemma4 piecewise CUDA graph: the multimodal span kwargs got static buffers sized by the text-only warmup "
           "(4 rows); an image batch with 5 spans cannot be copied into them")

HIDDEN, VOCAB = 8, 16
PIECEWISE_NUM_TOKENS = [16]
MAX_SEQ_LEN, MAX_BATCH_SIZE = 7, 8
SPAN_KWARGS = ("mm_span_starts", "mm_span_lens")


class Gemma4TextModel:
    """The inner GraphModule compile_model hands to the backend (one layer), as its ops."""

    def __init__(self, device):
        gen = generator(14006)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.w1, self.w2 = r(HIDDEN, 2 * HIDDEN), r(2 * HIDDEN, HIDDEN)
        self.pos_emb, self.lm_head = r(64, HIDDEN, scale=0.3), r(HIDDEN, VOCAB, scale=0.8)

    def qkv(self, inputs_embeds, position_ids):
        x = inputs_embeds + self.pos_emb[position_ids]
        return x, x @ self.wq, x @ self.wk, x @ self.wv

    @staticmethod
    def gemma4_mm_mask_prep(inputs_embeds, mm_span_starts, mm_span_lens):
        """Token -> index of the image span holding it (-1: text), for bidirectional attention inside an image."""
        tok = torch.arange(inputs_embeds.shape[0], device=inputs_embeds.device).unsqueeze(1)
        inside = (tok >= mm_span_starts.unsqueeze(0)) & (tok < (mm_span_starts + mm_span_lens).unsqueeze(0))
        first = inside.long().argmax(1)
        return torch.where(inside.any(1), first, torch.full_like(first, -1))

    @staticmethod
    def attention(q, k, v, block_ids, cu_seqlen, out):
        """Dynamic op: per sequence (host cu_seqlen, real tokens only), causal + bidirectional inside a span."""
        out.zero_()
        for b in range(len(cu_seqlen) - 1):
            s, e = cu_seqlen[b], cu_seqlen[b + 1]
            i = torch.arange(e - s, device=q.device)
            blk = block_ids[s:e]
            allowed = (i.unsqueeze(1) >= i.unsqueeze(0)) | ((blk.unsqueeze(1) == blk.unsqueeze(0)) & (blk >= 0).unsqueeze(1))
            scores = (q[s:e] @ k[s:e].T) * HIDDEN ** -0.5
            scores = scores.masked_fill(~allowed, -1e9)
            out[s:e] = torch.softmax(scores, -1) @ v[s:e]
        return out

    def post(self, attn_out, x):
        h = x + attn_out @ self.wo
        h = h + torch.tanh(h @ self.w1) @ self.w2
        return h @ self.lm_head

    def __call__(self, inputs_embeds, position_ids, mm_span_starts, mm_span_lens, cu_seqlen):
        x, q, k, v = self.qkv(inputs_embeds, position_ids)
        block_ids = self.gemma4_mm_mask_prep(inputs_embeds, mm_span_starts, mm_span_lens)
        attn = self.attention(q, k, v, block_ids, cu_seqlen, torch.empty_like(q))
        return self.post(attn, x)


class ADPiecewiseRunner:
    """Wraps one static partition: eager in warmup, captured per num_tokens, replayed afterwards."""

    _current_num_tokens: int | None = None
    _current_real_tokens: int | None = None
    _current_phase = "warmup"

    def __init__(self, submodule, graph_pool, name, device):
        self.submodule, self.graph_pool, self.name, self.device = submodule, graph_pool, name, device
        self.entries: dict = {}

    def __call__(self, **inputs):
        nt, phase = ADPiecewiseRunner._current_num_tokens, ADPiecewiseRunner._current_phase
        if nt is None or phase == "warmup":
            return self.submodule(**inputs)
        if phase == "capture":
            g, out = capture(lambda: self.submodule(**inputs), device=self.device, pool=self.graph_pool, warmups=0,
                             name=f"{self.name}[{nt}]", owner="ADPiecewiseRunner", static=inputs)
            self.entries[nt] = (g, out)
            return out
        g, out = self.entries[nt]
        return replay(g, out, real=ADPiecewiseRunner._current_real_tokens, size=nt)


class PiecewiseCapturedGraph:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.piecewise_num_tokens = PIECEWISE_NUM_TOKENS
        self._static_input_buffers: dict = {}            # {kwarg_name: (static_buffer, dynamic_dim)}
        self.attn_out = torch.zeros(max(PIECEWISE_NUM_TOKENS), HIDDEN, dtype=torch.float64, device=device)  # out=
        pool = graph_pool_handle(device)
        m = model
        if variant == "bug":            # the mask op is traced into the first static partition
            def submod_0(inputs_embeds, position_ids, mm_span_starts, mm_span_lens):
                return (*m.qkv(inputs_embeds, position_ids),
                        m.gemma4_mm_mask_prep(inputs_embeds, mm_span_starts, mm_span_lens))
            self.static_consumed = {"inputs_embeds", "position_ids", *SPAN_KWARGS}
        else:                           # upstream fix: the Gemma4 mask op is split out as a dynamic (eager) op
            def submod_0(inputs_embeds, position_ids):
                return m.qkv(inputs_embeds, position_ids)
            self.static_consumed = {"inputs_embeds", "position_ids"}
        self.submod_0 = ADPiecewiseRunner(submod_0, pool, "submod_0", device)
        self.submod_2 = ADPiecewiseRunner(lambda attn_out, x: (m.post(attn_out, x),), pool, "submod_2", device)

    def split_gm(self, inputs_embeds, position_ids, mm_span_starts, mm_span_lens, cu_seqlen):
        if self.variant == "bug":
            x, q, k, v, block_ids = self.submod_0(inputs_embeds=inputs_embeds, position_ids=position_ids,
                                                  mm_span_starts=mm_span_starts, mm_span_lens=mm_span_lens)
        else:
            block_ids = self.model.gemma4_mm_mask_prep(inputs_embeds, mm_span_starts, mm_span_lens)   # dynamic
            x, q, k, v = self.submod_0(inputs_embeds=inputs_embeds, position_ids=position_ids)
        nt = ADPiecewiseRunner._current_num_tokens or q.shape[0]
        attn = self.model.attention(q, k, v, block_ids, cu_seqlen, self.attn_out[:nt])                  # dynamic
        return self.submod_2(attn_out=attn, x=x)[0]

    def _allocate_static_input_buffers(self, get_args_kwargs):
        max_bucket = max(self.piecewise_num_tokens)
        kw1, kw2, kw_probe = get_args_kwargs(max_bucket), get_args_kwargs(max_bucket), get_args_kwargs(max_bucket - 1)
        for key in kw1:
            v1, v2 = kw1.get(key), kw2.get(key)
            if self.variant == "fix" and key not in self.static_consumed:
                continue                # upstream fix: only kwargs the captured submodules consume
            if isinstance(v1, torch.Tensor) and isinstance(v2, torch.Tensor) and v1.data_ptr() != v2.data_ptr():
                v_probe, dyn_dim = kw_probe.get(key), None
                for d in range(v1.ndim):
                    if v1.shape[d] != v_probe.shape[d]:
                        dyn_dim = d
                        break
                if dyn_dim is not None:
                    self._static_input_buffers[key] = (torch.empty_like(v1), dyn_dim)

    def _copy_to_static_buffers(self, kwargs):
        """Copy kwargs into pre-allocated static buffers for address stability (the hazard site)."""
        for key, (buf, dyn_dim) in self._static_input_buffers.items():
            src = kwargs.get(key)
            if src is not None and isinstance(src, torch.Tensor):
                buf_view = buf.narrow(dyn_dim, 0, src.shape[dyn_dim])
                buf_view.copy_(src)
                kwargs[key] = buf_view

    def warmup_and_capture(self, get_args_kwargs, warmup_iters=3):
        self._allocate_static_input_buffers(get_args_kwargs)
        for nt in sorted(self.piecewise_num_tokens, reverse=True):
            kwargs = get_args_kwargs(nt)
            self._copy_to_static_buffers(kwargs)
            ADPiecewiseRunner._current_num_tokens = ADPiecewiseRunner._current_real_tokens = nt
            ADPiecewiseRunner._current_phase = "warmup"
            for _ in range(warmup_iters - 1):
                self.split_gm(**kwargs)
            ADPiecewiseRunner._current_phase = "capture"
            self.split_gm(**kwargs)
        ADPiecewiseRunner._current_num_tokens = None
        ADPiecewiseRunner._current_phase = "replay"

    def forward(self, num_tokens, real_tokens, **kwargs):
        self._copy_to_static_buffers(kwargs)
        ADPiecewiseRunner._current_num_tokens, ADPiecewiseRunner._current_real_tokens = num_tokens, real_tokens
        try:
            return self.split_gm(**kwargs)
        finally:
            ADPiecewiseRunner._current_num_tokens = None


class DualModeCapturedGraph:
    """Prefill/mixed path only (decode goes to the monolithic graph, not modelled)."""

    def __init__(self, piecewise):
        self.piecewise = piecewise

    def forward(self, **kwargs):
        num_tokens = kwargs["inputs_embeds"].shape[0]
        bucket = next((b for b in sorted(self.piecewise.piecewise_num_tokens) if b >= num_tokens), None)
        if bucket is None:
            return self.piecewise.model(**kwargs)
        kwargs = {**kwargs, "inputs_embeds": _pad(kwargs["inputs_embeds"], bucket),
                  "position_ids": _pad(kwargs["position_ids"], bucket)}
        return self.piecewise.forward(bucket, num_tokens, **kwargs)[:num_tokens]


def _pad(t, n):
    return torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])


class Gemma4ForConditionalGeneration:
    """The eager wrapper (embedding merge) around the compiled text model; builds the inner kwargs."""

    def __init__(self, device):
        gen = generator(13858)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).double()
        self.image_feats = randn(4, 2, HIDDEN, gen=gen, device=device).double()     # vision tower stand-in
        self.device = device

    def inner_kwargs(self, requests):
        """requests: list of (token ids, [(image index, start in the request)]); prefill from position 0."""
        emb, pos, starts, lens, cu = [], [], [], [], [0]
        for ids, images in requests:
            e = self.embed[torch.tensor(ids, device=self.device)].clone()
            for img, at in images:
                e[at:at + 2] = self.image_feats[img]
                starts.append(cu[-1] + at)
                lens.append(2)
            if not images:                       # text-only sequence: one zero-length span row
                starts.append(cu[-1])
                lens.append(0)
            emb.append(e)
            pos.append(torch.arange(len(ids), device=self.device))
            cu.append(cu[-1] + len(ids))
        tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        return {"inputs_embeds": torch.cat(emb), "position_ids": torch.cat(pos), "mm_span_starts": tensor(starts),
                "mm_span_lens": tensor(lens), "cu_seqlen": cu}


def _setup_piecewise_mixed_batch(num_tokens):
    """Text-only dummy: prefill sequences capped at max_seq_len, plus one decode token."""
    seq_lens, remaining = [], num_tokens - 1
    while remaining > 0 and len(seq_lens) < MAX_BATCH_SIZE - 1:
        seq_lens.append(min(remaining, MAX_SEQ_LEN))
        remaining -= seq_lens[-1]
    return [([1] * sl, []) for sl in seq_lens + [1]]


STEPS = [
    [([3, 5, 7, 9, 11], []), ([2, 4, 6, 8], [])],                                    # text-only prefill, 9 tokens
    [([1, 0, 0, 2, 0, 0, 3, 0, 0, 4, 0, 0], [(0, 1), (1, 4), (2, 7), (3, 10)]),      # 4 images -> 4 spans
     ([5, 6, 7], [])],                                                                # + 1 text row = 5 spans
]


def serve(device, variant, use_graphs):
    wrapper, model = Gemma4ForConditionalGeneration(device), Gemma4TextModel(device)
    if use_graphs:
        piecewise = PiecewiseCapturedGraph(model, device, variant)
        piecewise.warmup_and_capture(lambda nt: wrapper.inner_kwargs(_setup_piecewise_mixed_batch(nt)))
        runner = DualModeCapturedGraph(piecewise).forward
    else:
        runner = model
    return [runner(**wrapper.inner_kwargs(reqs)).clone() for reqs in STEPS]


def run(variant: str, device: str = "cpu"):
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, variant, True), lambda: serve(device, variant, False))
