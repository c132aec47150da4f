"""DSV4.1's eager warmup takes the mHC overlap path, so Mega mHC first sets up its stream-local barriers inside the PIECEWISE capture, which refuses it.

Upstream: https://github.com/vllm-project/vllm/pull/57874 ("[Bugfix][DSV4.1] Restrict mHC overlap to full
CUDA graphs").
Symptom: "DSV4.1's small-batch eager warmup selected overlap, while breakable PIECEWISE capture selected
Mega mHC. That could leave Mega mHC's stream-local barriers uninitialized until capture, causing startup
to fail." (DeepSeek-V4.1 on the V2 model runner, Blackwell, September 2026.)
Mechanism: each decoder layer ends with the shifted mHC step (``mhc.py``): the layer output is mixed into
the ``hc_mult`` residual streams (post / comb-res mixes) and the next layer's input is formed from them
(pre mix + RMSNorm). Two implementations exist: the small-batch *overlap* path (post on the main stream,
pre on an aux stream, at most 16 tokens) and DeepGEMM's fused *Mega mHC*
(``mhc_shifted_post_pre_deep_gemm`` -> ``deep_gemm.mega_mhc``). Mega mHC synchronises its CTAs through
barriers that DeepGEMM sets up per stream, lazily, on the first launch on that stream. Before the fix the
dispatch chose overlap from the forward context's runtime mode: the eager warmup that the graph manager
runs on the capture stream (mode NONE) took overlap, the breakable PIECEWISE capture (mode PIECEWISE) took
Mega mHC. So Mega mHC's first launch on the capture stream -- and with it the barrier setup, which copies
the initial barrier words from the host -- happened inside the capture, which a capturing stream refuses
(``cudaErrorStreamCaptureUnsupported``): capture, and so startup, fails. Eager serving never notices: it
takes overlap (or, later, Mega mHC outside any capture).
Doctor: sync-in-capture, at ``_stream_barriers`` (Mega mHC's lazy barrier setup, a host-to-device copy,
first run inside the capture because warmup took the other branch).
Fix (upstream): ``_use_mhc_overlap`` selects overlap only while the stream is actually capturing a FULL
graph (``torch.cuda.is_current_stream_capturing()`` and not PIECEWISE), still bounded by the 16-token
cutoff; eager execution (the warmup included) and PIECEWISE use Mega mHC, so the warmup initialises Mega
mHC's barriers on the capture stream before the capture.
(Read: the PR description and its file list (``mhc.py`` +6/-8, ``mega_mhc.py`` +16, ``model.py`` +2/-1)
and the current ``mega_mhc.py``; the diff itself was not available. DeepGEMM's barrier setup is C++ that
was not read: it is modelled as the host-to-device copy of the initial barrier words, the step a capture
cannot record. The mHC math is reduced to a tiny, exact stand-in shared by both paths.)
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/57874"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_stream_barriers"
SYMPTOM = "startup fails: Mega mHC sets up its stream-local barriers inside the PIECEWISE capture"

VOCAB, HIDDEN, HC_MULT, NUM_LAYERS = 16, 4, 2, 2
MIX_SIZE = HC_MULT * (HC_MULT + 2)          # pre (hc) + post (hc) + comb-res (hc * hc)
NUM_TOKENS = 4                              # the one captured batch size (decode, 4 requests)
MHC_OVERLAP_MAX_TOKENS = 16                 # overlap is only considered up to 16 tokens
NUM_BARRIER_WORDS = 8
NONE, PIECEWISE = "NONE", "PIECEWISE"


class ForwardContext:
    """``vllm.forward_context``: what the runner tells the model about this forward."""

    def __init__(self):
        self.cudagraph_runtime_mode = NONE


class DeepGemmRuntime:
    """The part of DeepGEMM's process state that matters here: Mega mHC's barriers, one set per stream."""

    def __init__(self):
        self.barriers: dict[tuple[str, str], torch.Tensor] = {}
        self.current_stream = "default"


def _stream_barriers(rt: DeepGemmRuntime, device: str) -> torch.Tensor:
    """Mega mHC's grid barriers for the current stream, set up on the stream's first launch: the
    initial barrier words come from the host (a host-to-device copy)."""
    key = (rt.current_stream, device)
    if key not in rt.barriers:
        rt.barriers[key] = torch.tensor([0] * NUM_BARRIER_WORDS, dtype=torch.int32, device=device)
    return rt.barriers[key]


def _mhc_post(x, residual, post_mix, comb_res_mix):
    """Shifted mHC post: mix the layer output into the residual streams."""
    return post_mix.unsqueeze(-1) * x.unsqueeze(1) + comb_res_mix @ residual


def _mhc_pre(new_residual, fn, mix_bases, rmsnorm_weight, eps=1e-6):
    """mHC pre for the next layer: its mixes from the residual streams, its input (RMS-normalised)."""
    logits = new_residual.flatten(1) @ fn.t() + mix_bases                    # [T, MIX_SIZE]
    pre_mix = torch.sigmoid(logits[:, :HC_MULT])
    new_post_mix = 2.0 * torch.sigmoid(logits[:, HC_MULT:2 * HC_MULT])
    new_comb_res_mix = torch.softmax(logits[:, 2 * HC_MULT:].view(-1, HC_MULT, HC_MULT), dim=-1)
    y = (pre_mix.unsqueeze(-1) * new_residual).sum(1)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * rmsnorm_weight
    return new_post_mix, new_comb_res_mix, y


def mega_mhc(rt, device, x, residual, post_mix, comb_res_mix, fn, mix_bases, rmsnorm_weight):
    """``deep_gemm.mega_mhc``: post, next pre and RMSNorm in one launch, its CTAs synchronised through
    the stream's barriers (set up on first use)."""
    _stream_barriers(rt, device)
    new_residual = _mhc_post(x, residual, post_mix, comb_res_mix)
    return (new_residual, *_mhc_pre(new_residual, fn, mix_bases, rmsnorm_weight))


def mhc_shifted_post_pre_overlap(x, residual, post_mix, comb_res_mix, fn, mix_bases, rmsnorm_weight):
    """The small-batch overlap path: post on the main stream, pre on the aux stream (same math)."""
    new_residual = _mhc_post(x, residual, post_mix, comb_res_mix)
    return (new_residual, *_mhc_pre(new_residual, fn, mix_bases, rmsnorm_weight))


def _use_mhc_overlap(variant: str, ctx: ForwardContext, num_tokens: int) -> bool:
    if num_tokens > MHC_OVERLAP_MAX_TOKENS:
        return False
    if variant == "bug":
        # eager (the capture's warmup included) -> overlap; breakable PIECEWISE capture -> Mega mHC
        return ctx.cudagraph_runtime_mode != PIECEWISE
    # only while a FULL graph is actually being captured
    return torch.cuda.is_current_stream_capturing() and ctx.cudagraph_runtime_mode != PIECEWISE


def mhc_shifted_post_pre(variant, ctx, rt, device, *args):
    if _use_mhc_overlap(variant, ctx, args[0].shape[0]):
        return mhc_shifted_post_pre_overlap(*args)
    return mega_mhc(rt, device, *args)


class DeepseekV41Model:
    def __init__(self, device):
        gen = generator(57874)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7) for _ in range(NUM_LAYERS)]
        self.fn = [randn(MIX_SIZE, HC_MULT * HIDDEN, gen=gen, device=device, scale=0.3)
                   for _ in range(NUM_LAYERS)]
        self.mix_bases = [randn(MIX_SIZE, gen=gen, device=device, scale=0.3) for _ in range(NUM_LAYERS)]
        self.norm_w = [1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, variant, ctx, rt, device, input_ids):
        h = self.embed[input_ids]
        residual = h.unsqueeze(1).repeat(1, HC_MULT, 1)
        post_mix = torch.full((h.shape[0], HC_MULT), 0.5, device=device)
        comb_res_mix = torch.eye(HC_MULT, device=device).expand(h.shape[0], HC_MULT, HC_MULT)
        y = h
        for i in range(NUM_LAYERS):
            x = torch.tanh(y @ self.w[i])                                   # the layer body
            residual, post_mix, comb_res_mix, y = mhc_shifted_post_pre(
                variant, ctx, rt, device, x, residual, post_mix, comb_res_mix,
                self.fn[i], self.mix_bases[i], self.norm_w[i])
        return y @ self.lm_head


class ModelRunner:
    """V2 runner with a breakable PIECEWISE graph for the decode batch (the mHC step is captured)."""

    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.ctx, self.rt = ForwardContext(), DeepGemmRuntime()
        self.input_ids = torch.zeros(NUM_TOKENS, dtype=torch.long, device=device)
        if graphed:
            self.capture_model()

    def _forward(self):
        return self.model.forward(self.variant, self.ctx, self.rt, self.device, self.input_ids)

    def capture_model(self):
        self.rt.current_stream = "graph_capture"       # warmup and capture run on the capture stream
        self.ctx.cudagraph_runtime_mode = NONE
        with events.warmup():                          # the eager warmup of the dummy batch
            self._forward()
        self.ctx.cudagraph_runtime_mode = PIECEWISE
        self.graph, self.out = capture(self._forward, device=self.device, warmups=0,
                                       owner="ModelRunner (PIECEWISE decode graph)",
                                       static={"input_ids": self.input_ids})
        self.rt.current_stream = "default"

    def execute_model(self, token_ids):
        self.input_ids.copy_(torch.tensor(token_ids, dtype=torch.long).to(self.device))
        if not self.graphed:
            self.ctx.cudagraph_runtime_mode = NONE
            return self._forward().clone()
        self.ctx.cudagraph_runtime_mode = PIECEWISE
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    model = DeepseekV41Model(device)
    steps = [[1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]

    def serve(graphed: bool):
        runner = ModelRunner(model, device, variant, graphed)
        return [runner.execute_model(ids) for ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
