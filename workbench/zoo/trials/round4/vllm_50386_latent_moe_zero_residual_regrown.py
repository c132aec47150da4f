"""A lazily grown zero-residual buffer of the latent MoE is replaced by an eager batch; graphs keep the old one.

Upstream: https://github.com/vllm-project/vllm/pull/50386 ("[Bugfix] Fix stale latent MoE residual pointer in
CUDA graphs").
Symptom: latent-MoE models (TP > 1, shared expert, flashinfer fused all-reduce + RMSNorm) served with CUDA
graphs hit ``torch.AcceleratorError: CUDA error: an illegal memory access was encountered`` consistently under
load (vLLM main, July 2026); the PR: "CUDA graphs hold stale pointers which can be freed by eager execution".
Mechanism: ``LatentMoERunner._get_zero_residual`` kept a read-only zero ``residual_in`` for the fused
all-reduce + RMSNorm kernel, allocated lazily outside capture (first by the largest capture size's warmup) and
re-allocated (``self._zero_residual = buf``) whenever a batch needed more elements. The captured graphs read
the buffer that existed at capture. An eager batch above the largest capture size (still within the flashinfer
fusion's token limit) grows the buffer, the old one is freed, and the next replay reads freed memory.
Doctor: dangling-reference, at ``_get_zero_residual`` (the zeros buffer the graph reads is replaced there and
its previous allocation released).
Fix (upstream): allocate the buffer once for the fusion's ``max_token_num`` (``max_token_num * hidden``), never
re-assign it, and hand out ``buf[:numel]`` views, so every graph reads one live allocation.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/50386"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_get_zero_residual"
SYMPTOM = "illegal memory access: a replay reads the zero-residual buffer an eager batch replaced"
HIDDEN, LATENT, EXPERTS, TOPK = 6, 4, 4, 2
CAPTURE_SIZES = [1, 2, 4]            # cudagraph_capture_sizes
FI_MAX_TOKENS = 8                    # _can_use_flashinfer: the fused AR+RMSNorm workspace's token limit
MAX_NUM_TOKENS = 16                  # max_num_batched_tokens (the profile run's size)
EPS = 1e-6


def tensor_model_parallel_all_reduce(x):
    """One rank of the TP group stands for all: the partial sums are already whole here."""
    return x * 1.0


def flashinfer_trtllm_fused_allreduce_norm(allreduce_in, residual, rms_gamma, rms_eps):
    """``rmsnorm(all_reduce(x) + residual)``: the kernel reads ``residual`` even when it is all zeros."""
    h = tensor_model_parallel_all_reduce(allreduce_in) + residual
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + rms_eps) * rms_gamma


class LatentMoERunner:
    def __init__(self, device, fixed: bool):
        gen = generator(50386)
        self.fixed = fixed
        self.down_proj = randn(HIDDEN, LATENT, gen=gen, device=device, scale=0.5)     # routed input transform
        self.router = randn(HIDDEN, EXPERTS, gen=gen, device=device, scale=0.5)
        self.experts = randn(EXPERTS, LATENT, LATENT, gen=gen, device=device, scale=0.5)
        self.shared = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.3)
        self.norm_weight = 1.0 + randn(LATENT, gen=gen, device=device, scale=0.1)
        self.up_proj = randn(LATENT, HIDDEN, gen=gen, device=device, scale=0.5)

    def _can_use_flashinfer(self, hidden_states):
        return hidden_states.shape[0] <= FI_MAX_TOKENS, FI_MAX_TOKENS

    def _get_zero_residual(self, hidden_states, max_token_num):
        """Read-only zero ``residual_in`` for the fused AR+RMSNorm kernel."""
        numel = hidden_states.numel()
        buf = getattr(self, "_zero_residual", None)
        if not self.fixed:
            if buf is None or buf.dtype != hidden_states.dtype or buf.numel() < numel:
                buf = torch.zeros(numel, dtype=hidden_states.dtype, device=hidden_states.device)
                self._zero_residual = buf                       # the previous buffer is released here
            return buf[:numel].view_as(hidden_states)
        if buf is None:
            buf = torch.zeros(max_token_num * hidden_states.shape[-1], dtype=hidden_states.dtype,
                              device=hidden_states.device)
            self._zero_residual = buf
        assert numel <= buf.numel()
        return buf[:numel].view_as(hidden_states)

    def allreduce_norm_latent_out(self, fused_output):
        ok, max_token_num = self._can_use_flashinfer(fused_output)
        if ok:
            return flashinfer_trtllm_fused_allreduce_norm(
                fused_output, self._get_zero_residual(fused_output, max_token_num), self.norm_weight, EPS)
        h = tensor_model_parallel_all_reduce(fused_output)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * self.norm_weight

    def forward(self, hidden_states):
        """``_fused_forward``: routed experts in the latent dim, one reduction + norm, up-projection, shared add."""
        latent = hidden_states @ self.down_proj
        weights, ids = torch.topk(torch.softmax(hidden_states @ self.router, -1), TOPK, dim=-1)
        expert_out = torch.einsum("tl,elm->tem", latent, self.experts)
        fused_output = (weights[..., None] * expert_out.gather(
            1, ids[..., None].expand(-1, -1, LATENT))).sum(1)
        shared_output = tensor_model_parallel_all_reduce(hidden_states @ self.shared)
        fused_latent = self.allreduce_norm_latent_out(fused_output)
        return fused_latent @ self.up_proj + shared_output


def schedule():
    """Tokens per step: small decode batches (graphs), one 6-token batch above the largest capture size
    (eager, fused path), then small batches again."""
    return [3, 2, 6, 3, 1]


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    steps = [randn(n, HIDDEN, gen=gen, device=device) for n in schedule()]

    def serve(mode):
        runner = LatentMoERunner(device, fixed=(variant == "fix"))
        hidden_buf = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)     # the model runner's input buffer
        runner.forward(hidden_buf)                                            # profile_run: unfused (too many tokens)
        manager = GraphManager(lambda size: runner.forward(hidden_buf[:size]), CAPTURE_SIZES, device=device,
                               mode=mode, static_buffers={"hidden_states": hidden_buf},
                               name="vLLM CUDAGraphWrapper")
        manager.capture()
        outs = []
        for x in steps:
            n = x.shape[0]
            size = manager.dispatch(n)
            hidden_buf[:n].copy_(x)
            if size is None:                                                  # eager: no graph for this size
                outs.append(manager.run_eager(n).clone())
                continue
            # rows [n, size) of the input buffer keep an earlier batch's tokens (padded tokens)
            outs.append(manager.replay(size, n, padded={"hidden_states": hidden_buf}).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(CUDAGraphMode.FULL), lambda: serve(CUDAGraphMode.NONE))
