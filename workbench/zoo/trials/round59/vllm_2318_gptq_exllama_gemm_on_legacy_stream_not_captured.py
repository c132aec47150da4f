"""The GPTQ exllama GEMM kernel is launched on the legacy default stream: it runs once at capture and is no node of the graph.

Upstream: https://github.com/vllm-project/vllm/pull/2318 ("Enable CUDA graph for GPTQ & SqueezeLLM"), merged
2024-01-03; issue https://github.com/vllm-project/vllm/issues/2147 ("GPTQ models don't support CUDA graph"; the
stop-gap https://github.com/vllm-project/vllm/pull/2154 forced eager mode for GPTQ).
Symptom: ``TheBloke/Mixtral-8x7B-v0.1-GPTQ`` with CUDA graphs: ``RuntimeError: probability tensor contains either
`inf`, `nan` or element < 0`` in ``sampler._random_sample`` (``torch.multinomial``); with ``--enforce-eager`` it
works (AWQ models are fine).
Mechanism: ``GPTQLinearMethod.apply_weights`` calls ``ops.gptq_gemm``; ``gptq_gemm`` allocates the output ``c``
with ``torch::empty`` on the current stream, and ``gemm_half_q_half_cuda`` splits the rows into
``BLOCK_M_SIZE_MAX`` chunks and calls ``gemm_half_q_half_cuda_part``, which launched
``gemm_half_q_half_kernel<<<gridDim, blockDim>>>``: no stream argument, so the legacy default stream 0 (likewise
``reconstruct_exllama``, ``shuffle_exllama_weight`` and the SqueezeLLM kernel). ``CUDAGraphRunner.capture`` captures
the decode forward under ``torch.cuda.graph`` on a side stream that is non-blocking, so a launch on stream 0 neither
joins the graph nor invalidates the capture: it executes once, eagerly, during capture. Every other op (the norm,
the activation, the residual, the LM head) is a node; at replay each GEMM's ``c`` -- a block of the graph's pool
that no node writes -- keeps whatever it held: ``w13``'s the capture's leftovers (the emulation's NaN poison),
``w2``'s the stale contents of the freed norm temporary whose block the allocator handed it. The residual adds that
garbage, so every replayed step's logits are wrong, whatever the input (upstream, with many layers, they reached
NaN and ``multinomial`` refused them; here the sampled tokens diverge from eager). A launch on stream 0 is
modelled as a launch from another thread, whose current stream is the default one: the CPU engine records only the
capturing thread, as CUDA captures only the capturing stream.
Doctor: host-work-frozen, at ``gemm_half_q_half_cuda_part`` (its kernel ran once, outside the graph, during
capture; replays repeat only the captured kernels, so the GEMM output is never recomputed).
Fix (upstream): every launch in ``q_gemm.cu`` and ``quant_cuda_kernel.cu`` takes
``const cudaStream_t stream = at::cuda::getCurrentCUDAStream();`` and ``<<<gridDim, blockDim, 0, stream>>>``, and
the eager-mode override for GPTQ/SqueezeLLM is removed. (Read: the issue thread with chu-tianxiang's root cause,
the PR record, and the post-fix launches in ``csrc/quantization/gptq/q_gemm.cu``; the diff itself was not in the
stored snapshot: the vLLM repository is too large to fetch.)
"""
from __future__ import annotations

import threading

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/2318"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "gemm_half_q_half_cuda_part"
SYMPTOM = "replayed decode steps read GPTQ GEMM outputs that no graph node writes: garbage logits (NaN upstream)"

VOCAB, HIDDEN, INTER, GROUP, BLOCK_M_SIZE_MAX, BATCH, STEPS, EPS = 16, 8, 16, 4, 8, 2, 4, 1e-6


def legacy_stream_launch(kernel, *args):
    """``kernel<<<grid, block>>>``: stream 0, the legacy default stream. It orders itself only with blocking streams;
    the capture's side stream is non-blocking, so the launch executes now and is not captured (another thread)."""
    worker = threading.Thread(target=kernel, args=args)
    worker.start()
    worker.join()


def gemm_half_q_half_kernel(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, c):
    """Dequantize 4-bit GPTQ (v1 zero points: stored zero + 1) group by group, multiply; write c."""
    zeros = (b_gptq_qzeros + 1).repeat_interleave(GROUP, 0)
    scales = b_gptq_scales.repeat_interleave(GROUP, 0)
    torch.matmul(a, (b_q_weight - zeros) * scales, out=c)


def gemm_half_q_half_cuda_part(variant, a, b_q_weight, b_gptq_qzeros, b_gptq_scales, c):
    if variant == "fix":            # const cudaStream_t stream = at::cuda::getCurrentCUDAStream(); <<<..., 0, stream>>>
        gemm_half_q_half_kernel(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, c)
    else:                           # gemm_half_q_half_kernel<<<gridDim, blockDim>>>(...)
        legacy_stream_launch(gemm_half_q_half_kernel, a, b_q_weight, b_gptq_qzeros, b_gptq_scales, c)


def gemm_half_q_half_cuda(variant, a, b_q_weight, b_gptq_qzeros, b_gptq_scales, c):
    size_m = a.shape[0]
    last_chunk = size_m // BLOCK_M_SIZE_MAX * BLOCK_M_SIZE_MAX
    if last_chunk:
        gemm_half_q_half_cuda_part(variant, a[:last_chunk], b_q_weight, b_gptq_qzeros, b_gptq_scales, c[:last_chunk])
    if size_m - last_chunk:
        gemm_half_q_half_cuda_part(variant, a[last_chunk:], b_q_weight, b_gptq_qzeros, b_gptq_scales, c[last_chunk:])


def gptq_gemm(variant, a, b_q_weight, b_gptq_qzeros, b_gptq_scales):
    c = torch.empty(a.shape[0], b_q_weight.shape[1], dtype=a.dtype, device=a.device)   # torch::empty, current stream
    gemm_half_q_half_cuda(variant, a, b_q_weight, b_gptq_qzeros, b_gptq_scales, c)
    return c


class GPTQLinear:
    """A ``LinearBase`` with ``GPTQLinearMethod`` weights (exllama state ready: shuffled at load)."""

    def __init__(self, variant, k, n, gen, device):
        self.variant = variant
        self.qweight = torch.randint(0, 16, (k, n), generator=gen).to(torch.float32).to(device)
        self.qzeros = torch.randint(6, 9, (k // GROUP, n), generator=gen).to(torch.float32).to(device)
        self.scales = (torch.rand(k // GROUP, n, generator=gen) * 0.05 + 0.02).to(device)

    def apply_weights(self, x):
        return gptq_gemm(self.variant, x, self.qweight, self.qzeros, self.scales)


class MixtralForCausalLM:
    """One decoder layer: RMSNorm, a GPTQ MLP (w13, SiLU-and-mul, w2), the residual, the final norm, the LM head."""

    def __init__(self, variant, device):
        gen = generator(2147)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.norm_w = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.w13 = GPTQLinear(variant, HIDDEN, 2 * INTER, gen, device)
        self.w2 = GPTQLinear(variant, INTER, HIDDEN, gen, device)
        self.final_w = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    @staticmethod
    def rms_norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    def forward(self, input_ids):
        x = self.embed[input_ids]
        gate, up = self.w13.apply_weights(self.rms_norm(x, self.norm_w)).chunk(2, -1)
        h = x + self.w2.apply_weights(torch.nn.functional.silu(gate) * up)
        return self.rms_norm(h, self.final_w) @ self.lm_head


class CUDAGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.input_buffers = {"input_ids": torch.zeros(BATCH, dtype=torch.long, device=device)}
        self.graph = self.output_buffers = None

    def capture(self, memory_pool):
        ids = self.input_buffers["input_ids"]
        self.graph, hidden = capture(lambda: self.model.forward(ids), device=self.device, pool=memory_pool,
                                     name=f"decode batch {BATCH}", owner="vLLM CUDAGraphRunner",
                                     static=self.input_buffers)
        self.output_buffers = {"hidden_states": hidden}

    def forward(self, input_ids):
        self.input_buffers["input_ids"].copy_(input_ids)
        return replay(self.graph, self.output_buffers["hidden_states"])


def sample(logits, gen):
    """Sampler._random_sample: softmax, then torch.multinomial (on the host here: one generator for both runs)."""
    probs = torch.softmax(logits.float(), -1).cpu()
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1).to(logits.device)


def run(variant: str, device: str = "cpu"):
    prompt = torch.randint(0, VOCAB, (BATCH,), generator=generator(2318)).to(device)

    def serve(use_cuda_graph: bool):
        model, gen, outs = MixtralForCausalLM(variant, device), generator(7), []
        if use_cuda_graph:                                         # ModelRunner.capture_model
            runner = CUDAGraphRunner(model, device)
            runner.capture(graph_pool_handle(device))
        tokens = prompt
        for _ in range(STEPS):
            logits = runner.forward(tokens).clone() if use_cuda_graph else model.forward(tokens)
            outs.append(logits)
            tokens = sample(logits, gen)
            outs.append(tokens)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
