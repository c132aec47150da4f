"""bitsandbytes launches its NF4 dequantize kernel on the legacy stream: under vLLM graphs it runs once at capture, and replayed 4-bit linears read a weight temporary no node writes.

Upstream: https://github.com/bitsandbytes-foundation/bitsandbytes/pull/1330 ("Enable certain CUDA kernels to accept
specified cuda stream", jeejeelee), merged 2024-08-22 as a685654b; fixes issue
https://github.com/bitsandbytes-foundation/bitsandbytes/issues/1308 ("dequantize_4bit() gives wrong output when
working in cuda graph mode"; downstream vllm-project/vllm#5569, and vllm-project/vllm#6846 forced eager mode for bnb).
Symptom: vLLM serving a bitsandbytes 4-bit (NF4) model with CUDA graphs produces nonsense text; "the weight given by
dequantize_4bit() under cuda graph mode is different from the eager mode"; with ``enforce_eager`` it is correct.
Mechanism: vLLM's ``BitsAndBytesLinearMethod._apply_4bit_weight`` runs, per shard of a merged linear,
``out[:, i:j] = matmul_4bit(bf_x, qweight[offsets[i]:offsets[i + 1]].t(), quant_states[i])``. For more than one row,
``matmul_4bit`` takes ``MatMul4Bit.forward``: ``torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state)
.to(A.dtype).t(), bias)``. ``dequantize_4bit`` (bitsandbytes/functional.py) allocates the weight temporary ``out``
with ``torch.empty`` on the current stream and calls ``lib.cdequantize_blockwise_fp32_nf4(..., get_ptr(out),
blocksize, n)``; ``dequantizeBlockwise`` (csrc/ops.cu) launched ``kDequantizeBlockwise<<<grid, 64>>>``: no stream
argument, so the legacy default stream 0. ``CUDAGraphRunner.capture`` captures the decode forward under
``torch.cuda.graph`` on a non-blocking side stream, so a launch on stream 0 neither joins the graph nor invalidates
the capture: the dequantization executes once, eagerly, during capture, while the ``linear`` that reads its result
is a node. The temporary lives in the graph's private pool; it is freed when ``linear`` returns, and the next
shard's (and the next projection's) same-sized temporary gets the same block, which the next stream-0 dequant
overwrites. At replay no node writes that block, so every 4-bit linear reads what it holds: on CUDA the weight
dequantized last at capture (here the down projection's, read by the gate and up projections too) and whatever
captured nodes placed there later; in the CPU emulation the poison of memory the graph never wrote. The logits are
wrong at every replayed step, whatever the input. A launch on stream 0 is modelled as a launch from another thread
(whose current stream is the default one): the CPU engine records only the capturing thread, as CUDA captures only
the capturing stream.
Doctor: host-work-frozen, at ``dequantize_4bit`` (its dequantization kernel ran once, outside the graph, during
capture; replays repeat only the captured kernels, so the weight temporary the captured ``linear`` reads is never
recomputed).
Fix (upstream): ``get_tensor_stream(tensor)`` returns ``torch.cuda.current_stream(tensor.device)``;
``dequantize_4bit``, ``dequantize_blockwise``, ``dequantize_no_absmax`` and ``gemv_4bit`` pass
``stream = get_tensor_stream(A)`` as a new last argument, and the C launchers (``dequantizeBlockwise``,
``dequantize``, ``gemm_4bit_inference_naive``) launch ``<<<grid, block, 0, stream>>>``, so under capture the kernel
is recorded on the capturing stream. (Diff read in full: ``bitsandbytes/functional.py``, ``csrc/ops.cu``,
``csrc/ops.cuh``, ``csrc/pythonInterface.cpp`` at a685654b; pre-fix ``MatMul4Bit.forward``/``matmul_4bit`` and the
``is_transposed`` return of ``dequantize_4bit`` read at its parent.)
Modelled: one Llama decoder layer whose MLP is bnb 4-bit (``gate_up_proj`` with two NF4 shards, ``down_proj``),
RMSNorms, a plain embedding and LM head, no attention; float32 instead of vLLM's bfloat16; NF4 without double
quantization (``nested=False``), blocksize 64; the kernel is torch code on the packed bytes (high nibble first, as
``kDequantizeBlockwise``). Only the decode graph of batch 2 is captured and served (the batch-1 path, ``gemv_4bit``,
has the same missing stream argument and is left out). Greedy sampling.
"""
from __future__ import annotations

import threading

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/bitsandbytes-foundation/bitsandbytes/pull/1330"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "dequantize_4bit"
SYMPTOM = ("vLLM bnb-4bit model under CUDA graphs: replayed 4-bit linears read NF4 weight temporaries that no "
           "graph node writes (the dequant ran on stream 0 at capture): nonsense output")

VOCAB, HIDDEN, INTER, BLOCKSIZE, BATCH, STEPS, EPS = 16, 32, 32, 64, 2, 4, 1e-6

NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]


# --------------------------------------------------------------------------------------------- bitsandbytes
class QuantState:
    def __init__(self, absmax, shape, dtype, blocksize, quant_type, code):
        self.absmax, self.shape, self.dtype = absmax, shape, dtype
        self.blocksize, self.quant_type, self.code, self.nested = blocksize, quant_type, code, False


def get_tensor_stream(tensor):
    """The fix's helper: ``torch.cuda.current_stream(tensor.device)`` (the capturing stream while capturing)."""
    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else "current stream"


def legacy_stream_launch(kernel, *args):
    """``kernel<<<grid, block>>>``: stream 0, the legacy default stream. It orders itself only with blocking streams;
    the capture's side stream is non-blocking, so the launch executes now and is not captured (another thread)."""
    worker = threading.Thread(target=kernel, args=args)
    worker.start()
    worker.join()


def stream_launch(stream, kernel, *args):
    """``kernel<<<grid, block, 0, stream>>>`` on the current stream: recorded when that stream is capturing."""
    kernel(*args)


def kDequantizeBlockwise(code, A, absmax, out, blocksize, n):
    """NF4: two 4-bit codes per byte, high nibble first, each scaled by its block's absmax."""
    idx = torch.stack(((A >> 4).long(), (A & 0x0F).long()), -1).view(-1)[:n]
    scale = absmax.view(-1, 1).expand(-1, blocksize).reshape(-1)[:n]
    out.view(-1).copy_(code[idx] * scale)


def quantize_4bit(W, code, blocksize=BLOCKSIZE):
    """Load-time NF4 quantization (host side, before serving): packed uint8 bytes and the blocks' absmax."""
    flat = W.reshape(-1, blocksize)
    absmax = flat.abs().amax(-1)
    idx = ((flat / absmax[:, None]).unsqueeze(-1) - code).abs().argmin(-1).view(-1).to(torch.uint8)
    packed = (idx[0::2] << 4) | idx[1::2]
    return packed, QuantState(absmax, tuple(W.shape), W.dtype, blocksize, "nf4", code)


def dequantize_4bit(variant, A, quant_state):
    absmax = quant_state.absmax
    out = torch.empty(quant_state.shape, dtype=quant_state.dtype, device=A.device)
    n = out.numel()
    if variant == "fix":        # stream = get_tensor_stream(A); lib.cdequantize_blockwise_fp32_nf4(..., n, stream)
        stream = get_tensor_stream(A)
        stream_launch(stream, kDequantizeBlockwise, quant_state.code, A, absmax, out, quant_state.blocksize, n)
    else:                       # lib.cdequantize_blockwise_fp32_nf4(..., n): kDequantizeBlockwise<<<grid, 64>>>
        legacy_stream_launch(kDequantizeBlockwise, quant_state.code, A, absmax, out, quant_state.blocksize, n)
    is_transposed = True if A.shape[0] == 1 else False
    return out.t() if is_transposed else out


class MatMul4Bit:
    @staticmethod
    def forward(variant, A, B, out=None, bias=None, quant_state=None):
        # 1. Dequantize  2. MatmulnN
        return torch.nn.functional.linear(A, dequantize_4bit(variant, B, quant_state).to(A.dtype).t(), bias)


def matmul_4bit(variant, A, B, quant_state, out=None, bias=None):
    # (A.numel() == A.shape[-1]: the one-row gemv_4bit path, not served here)
    return MatMul4Bit.forward(variant, A, B, out, bias, quant_state)


# -------------------------------------------------------------------------------------------------- vLLM
class BitsAndBytesLinearMethod:
    def __init__(self, variant):
        self.variant = variant

    def _apply_4bit_weight(self, layer, x, bias=None):
        original_type = x.dtype
        bf_x = x.to(torch.float32)                       # bfloat16 upstream
        qweight = layer.qweight
        quant_states = qweight.bnb_quant_state
        offsets = qweight.bnb_shard_offsets
        out_dim_0 = x.shape[0]
        out_dim_1 = sum([quant_state[1].shape[0] for quant_state in quant_states.items()])
        out = torch.empty(out_dim_0, out_dim_1, dtype=torch.float32, device=x.device)
        current_index = 0
        for i in range(len(quant_states)):
            output_size = quant_states[i].shape[0]
            out[:, current_index:current_index + output_size] = matmul_4bit(
                self.variant, bf_x, qweight[offsets[i]:offsets[i + 1]].t(), quant_states[i])
            current_index += output_size
        out = out.to(original_type)
        if bias is not None:
            out += bias
        return out


class BnbLinear:
    """A (merged) linear layer loaded by ``BitsAndBytesModelLoader``: shards packed into one ``qweight``."""

    def __init__(self, variant, shard_sizes, in_features, gen, device, code):
        packs, states, offsets = [], {}, [0]
        for i, size in enumerate(shard_sizes):
            W = torch.randn(size, in_features, generator=gen) * 0.3
            packed, states[i] = quantize_4bit(W, code)
            packs.append(packed)
            offsets.append(offsets[-1] + packed.numel())
        for st in states.values():
            st.absmax, st.code = st.absmax.to(device), st.code.to(device)
        self.qweight = torch.cat(packs).view(-1, 1).to(device)       # uint8 [packed, 1]
        self.qweight.bnb_quant_state, self.qweight.bnb_shard_offsets = states, offsets
        self.quant_method = BitsAndBytesLinearMethod(variant)

    def __call__(self, x):
        return self.quant_method._apply_4bit_weight(self, x)


class LlamaForCausalLM:
    """Embedding, RMSNorm, a bnb 4-bit MLP (gate_up_proj, SiluAndMul, down_proj), residual, final norm, LM head."""

    def __init__(self, variant, device):
        gen = generator(1308)
        code = torch.tensor(NF4)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.norm_w = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.gate_up_proj = BnbLinear(variant, [INTER, INTER], HIDDEN, gen, device, code)
        self.down_proj = BnbLinear(variant, [HIDDEN], INTER, gen, device, code)
        self.final_w = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    @staticmethod
    def rms_norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    def forward(self, input_ids):
        x = self.embed[input_ids]
        gate, up = self.gate_up_proj(self.rms_norm(x, self.norm_w)).chunk(2, -1)
        h = x + self.down_proj(torch.nn.functional.silu(gate) * up)
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


def run(variant: str, device: str = "cpu"):
    prompt = torch.randint(0, VOCAB, (BATCH,), generator=generator(1330)).to(device)

    def serve(use_cuda_graph: bool):
        model, outs = LlamaForCausalLM(variant, device), []
        if use_cuda_graph:                                         # ModelRunner.capture_model
            runner = CUDAGraphRunner(model, device)
            runner.capture(graph_pool_handle(device))
        tokens = prompt
        for _ in range(STEPS):
            logits = runner.forward(tokens).clone() if use_cuda_graph else model.forward(tokens)
            tokens = logits.argmax(-1)                             # greedy sampling
            outs += [logits, tokens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
