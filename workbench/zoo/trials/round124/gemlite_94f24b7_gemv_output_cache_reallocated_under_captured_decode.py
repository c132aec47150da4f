"""GemLite's opt-in GEMV output cache (``set_kernel_caching(True)``) re-allocates its slot buffer every ``CACHE_SIZE`` calls; a decode step captured across such a wrap keeps writing into the previous buffer, which Python has released.

Upstream: https://github.com/mobiusml/gemlite/commit/94f24b7a58a4aa907c3d9339e045668ce123a629 ("fix cuda graphs
gemv caching", mobiusml/gemlite, author mobicham, committed 2025-05-19 to master, pushed directly: no PR thread).
Read: the commit's whole diff (``gemv_revsplitK_A16fWnO16f_int32packing_forward`` and
``gemv_A16fWnO16f_int32packing_forward``, the same hunk in both); at its parent, the whole of
``triton_kernels/gemv_revsplitK_A16fWnO16f_int32packing.py`` (the Triton kernel, which ends in
``tl.atomic_add(c_ptrs, acc)`` once per split-K program, and the launcher), ``triton_kernels/config.py``
(``KERNEL.ENABLE_CACHING = False``, ``CACHE_SIZE = 256``, ``set_kernel_caching``), ``triton_kernels/utils.py``
``dequantize``, and ``core.py`` (``forward_functional``, ``get_matmul_type``: ``GEMV_REVSPLITK`` for one row and
``W_nbits < 8``, ``GEMM_SPLITK`` up to 64 rows); commits d4c2d53 ("add kernel caching support") and df570c1
(caching off by default). For the runner, mobiusml/hqq ``hqq/utils/generation_hf.py`` (same author; hqq serves
GemLite kernels): ``HFGenerator.enable_cuda_graph`` / ``gen_next_token_withgraph`` at bc8f4c7^ (May 2025) and
``gen_next_token_withgraph_v1`` at a06b02d (three eager warm-ups, capture, ``static_output.copy_``, replay).
Not read: any issue or discussion (none is linked).
Symptom: not described upstream beyond the title. As the mechanism implies (and as modelled): with kernel caching
on, a CUDA-graph decode step replays GEMV launches into a cache buffer that no longer exists (illegal memory access
or silent corruption of whatever reuses the block, and the split-K atomics accumulate into a slot nothing zeroes);
eager decoding is correct.
Mechanism: the GEMV kernels split K and ``atomic_add`` their partial sums into ``output``, which must start at
zero. To avoid a ``torch.zeros`` per call, the launcher keeps per ``(M, N)`` one buffer of ``CACHE_SIZE`` zeroed
slots and hands out the next slot each call; when the slot pointer wraps it replaces the buffer,
``entry['data'] = torch.zeros(...)``. Under a captured decode step the Python runs once: launches before the wrap
are recorded against slots of the buffer allocated outside the capture, the wrap allocates a new one from the
graph's pool, and once the capture returns nothing holds the old buffer any more. Every replay then adds into, and
reads from, memory whose owner released it.
Doctor: dangling-reference, at gemv_revsplitK_A16fWnO16f_int32packing_forward. The captured GEMV launches write and
read a slot of the cache buffer that this function replaced (and so released) during the capture.
Fix (upstream): allocate the buffer once (``torch.empty``) and zero it in place on each wrap
(``entry["data"].zero_()``), so the graph's slots stay one live allocation; the captured ``zero_`` clears the slots
used before the wrap for the next replay.
Modelled: ``KERNEL`` / ``set_kernel_caching``, the revsplit-K GEMV kernel (two ``BLOCK_SIZE_K`` chunks per
split-K program, dequantize ``(q - zeros) * scales``, ``output.add_`` for ``tl.atomic_add``) and its launcher with
``KERNEL_CACHE`` (both versions), ``forward_functional`` / ``get_matmul_type``, ``GemLiteLinearTriton`` (4-bit,
int32 packing along K, asymmetric group quantization), and an ``HFGenerator`` (prefill, ``gen_next_token_raw``,
``enable_cuda_graph``: one eager generate, then a generate whose first decode step warms up three times and
captures, the capture copying the token into ``static_output``; every graph step copies the token into
``static_input`` and replays). Stand-ins: a three-layer residual MLP language model over 4-bit GemLite linears
of one shape (so they share one cache entry), ``CACHE_SIZE = 4`` instead of 256 (a 3-call decode step then crosses
a wrap as a many-layer model's does at some capture offsets), the
``GEMM_SPLITK`` prefill path as a plain dequantized matmul, greedy decoding, a position tensor updated in place,
a replay right after the capture to run the captured step (hqq reads ``static_output`` there), float64.
Workload: prompts of 4 tokens, 3 decode steps each; three generates (prompt A, A again, then B). Served:
``enable_cuda_graph`` runs A eagerly (GEMV calls 0-8) and A again with the decode step captured at calls 18-20 (the
wrap is call 20: slots 2 and 3 of the buffer allocated at call 16, then a new buffer); all decode steps of the second
and third generates then replay.
Measured: bug: raises IllegalMemoryAccess at the first replay (second generate, decode step 1: "graph replay read freed
memory: aten.select.int ... output = entry['data'][entry['ptr'] % KERNEL.CACHE_SIZE]"); fix: equals eager
(max |graph - eager| = 0 over the 12 prefill and decode logits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/mobiusml/gemlite/commit/94f24b7a58a4aa907c3d9339e045668ce123a629"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "gemv_revsplitK_A16fWnO16f_int32packing_forward"
SYMPTOM = ("with kernel caching on, a decode step captured across a cache wrap keeps its GEMV slots in the "
           "buffer the wrap replaced, which is released after capture")

HIDDEN, VOCAB, NUM_LAYERS, MAX_POS = 32, 16, 3, 16
W_NBITS, GROUP_SIZE, BLOCK_SIZE_K = 4, 16, 8
ELEMENTS_PER_SAMPLE = 32 // W_NBITS                  # int32 packing
UNPACK_MASK = (1 << W_NBITS) - 1
DTYPE = torch.float64

_variant = "bug"


# --- gemlite/triton_kernels/config.py -----------------------------------------------------------------------------

class KERNEL:
    ENABLE_CACHING = False
    CACHE_SIZE = 4                                   # upstream: 256


def set_kernel_caching(enable: bool):
    KERNEL.ENABLE_CACHING = enable


# --- gemlite/triton_kernels/utils.py ------------------------------------------------------------------------------

def dequantize(b, scales, zeros, q_shift, unpack_mask):
    b = (b >> q_shift) & unpack_mask                 # unpack: int32 -> int32
    return (b.to(scales.dtype) - zeros) * scales     # W_group_mode == 3


# --- gemlite/triton_kernels/gemv_revsplitK_A16fWnO16f_int32packing.py ---------------------------------------------

def gemv_revsplitK_A16fWnO16f_int32packing_kernel(a, b_q, c, scales, zeros, M, N, K, W_nbits, group_size,
                                                  unpack_mask, elements_per_sample, BLOCK_SIZE_K):
    """One split-K program per 2 * BLOCK_SIZE_K rows of K; each ends in ``tl.atomic_add(c_ptrs, acc)``."""
    for pid in range(K // (BLOCK_SIZE_K * 2)):
        pid_k = pid * 2
        k_m = (pid_k * BLOCK_SIZE_K) // group_size   # both chunks share one group (BLOCK_SIZE_K * 2 <= group_size)
        acc = None
        for chunk in range(2):
            k0 = (pid_k + chunk) * BLOCK_SIZE_K
            offs_k = torch.arange(k0, k0 + BLOCK_SIZE_K, device=a.device)
            q_shift = ((offs_k % elements_per_sample) * W_nbits).to(torch.int32)[:, None]
            b = b_q[k0 // elements_per_sample:(k0 + BLOCK_SIZE_K - 1) // elements_per_sample + 1]
            b = b.repeat_interleave(elements_per_sample, 0)[k0 % elements_per_sample:][:BLOCK_SIZE_K]
            b = dequantize(b, scales[k_m], zeros[k_m], q_shift, unpack_mask)
            part = (a[:, k0:k0 + BLOCK_SIZE_K, None] * b[None]).sum(1)
            acc = part if acc is None else acc + part
        c.add_(acc)                                  # tl.atomic_add: c must start at zero


KERNEL_CACHE = {}


def gemv_revsplitK_A16fWnO16f_int32packing_forward(x, W_q, scales, zeros, W_nbits, group_size, unpack_mask,
                                                   elements_per_sample):
    global KERNEL_CACHE
    M, K, N = x.shape[0], x.shape[1], W_q.shape[1]
    kernel_output_dtype = scales.dtype

    if _variant == "bug":
        if KERNEL.ENABLE_CACHING and M == 1:
            if (M, N) not in KERNEL_CACHE:
                KERNEL_CACHE[(M, N)] = {'data': {}, 'ptr': 0}

            entry = KERNEL_CACHE[(M, N)]

            if entry['ptr'] % KERNEL.CACHE_SIZE == 0:
                entry['data'] = torch.zeros((KERNEL.CACHE_SIZE, M, N), device=W_q.device, dtype=kernel_output_dtype)
                entry['ptr'] = 0

            output = entry['data'][entry['ptr'] % KERNEL.CACHE_SIZE]
            entry['ptr'] += 1
        else:
            output = torch.zeros((M, N), device=W_q.device, dtype=kernel_output_dtype)
    else:
        if KERNEL.ENABLE_CACHING and M == 1:
            if (M, N) not in KERNEL_CACHE:
                KERNEL_CACHE[(M, N)] = {
                    "data": torch.empty((KERNEL.CACHE_SIZE, M, N), device=W_q.device, dtype=kernel_output_dtype),
                    "ptr": 0,
                }

            entry = KERNEL_CACHE[(M, N)]
            if entry["ptr"] % KERNEL.CACHE_SIZE == 0:
                entry["data"].zero_()
                entry["ptr"] = 0

            output = entry["data"][entry["ptr"] % KERNEL.CACHE_SIZE]
            entry["ptr"] += 1
        else:
            output = torch.zeros((M, N), device=W_q.device, dtype=kernel_output_dtype)

    gemv_revsplitK_A16fWnO16f_int32packing_kernel(x, W_q, output, scales, zeros, M, N, K, W_nbits, group_size,
                                                  unpack_mask, elements_per_sample, BLOCK_SIZE_K)
    return output


def gemm_splitK_A16fWnO16f_int32packing_forward(x, W_q, scales, zeros, W_nbits, group_size, unpack_mask,
                                                elements_per_sample):
    """Prefill path (1 < M <= 64), reduced to a matmul with the dequantized weight into a fresh output."""
    K = x.shape[1]
    k = torch.arange(K, device=x.device)
    q_shift = ((k % elements_per_sample) * W_nbits).to(torch.int32)[:, None]
    W = dequantize(W_q.repeat_interleave(elements_per_sample, 0), scales.repeat_interleave(group_size, 0),
                   zeros.repeat_interleave(group_size, 0), q_shift, unpack_mask)
    return x @ W


# --- gemlite/core.py ----------------------------------------------------------------------------------------------

GEMLITE_TRITON_MAPPING = {"GEMV_REVSPLITK": gemv_revsplitK_A16fWnO16f_int32packing_forward,
                          "GEMM_SPLITK": gemm_splitK_A16fWnO16f_int32packing_forward}


def get_default_gemv(W_nbits: int) -> str:
    return 'GEMV_REVSPLITK' if (W_nbits < 8) else 'GEMV_SPLITK'


def get_matmul_type(batch_size: int, W_nbits: int):
    if batch_size > 1:
        return "GEMM_SPLITK"
    return get_default_gemv(W_nbits)


def forward_functional(x, bias, tensor_args, meta_args):
    W_nbits, group_size, unpack_mask, elements_per_sample = meta_args
    out_features = tensor_args[0].shape[1]
    out_shape = x.shape[:-1] + (out_features,)
    x = x.reshape(-1, x.shape[-1])
    matmul_type_str = get_matmul_type(x.shape[0], W_nbits)
    out = GEMLITE_TRITON_MAPPING[matmul_type_str](x, *tensor_args, *meta_args).view(out_shape)
    if bias is not None:
        out += bias
    return out


class GemLiteLinearTriton:
    """4-bit weights packed 8 per int32 along K, asymmetric per-group scales and zeros."""

    def __init__(self, in_features, out_features):
        self.in_features, self.out_features, self.bias = in_features, out_features, None

    def pack(self, W):                                # W: [in_features, out_features]
        K, N = W.shape
        Wg = W.reshape(K // GROUP_SIZE, GROUP_SIZE, N)
        w_min, w_max = Wg.amin(1), Wg.amax(1)
        self.scales = (w_max - w_min) / UNPACK_MASK
        self.zeros = -w_min / self.scales
        q = torch.round(Wg / self.scales[:, None] + self.zeros[:, None]).clamp(0, UNPACK_MASK).to(torch.int32)
        q = q.reshape(K // ELEMENTS_PER_SAMPLE, ELEMENTS_PER_SAMPLE, N)
        W_q = torch.zeros(K // ELEMENTS_PER_SAMPLE, N, dtype=torch.int32, device=W.device)
        for i in range(ELEMENTS_PER_SAMPLE):
            W_q |= q[:, i] << (i * W_NBITS)
        self.W_q = W_q
        return self

    def forward(self, x):
        return forward_functional(x, self.bias, [self.W_q, self.scales, self.zeros],
                                  [W_NBITS, GROUP_SIZE, UNPACK_MASK, ELEMENTS_PER_SAMPLE])


# --- the served model: a 3-layer residual MLP LM over GemLite linears (stand-in) ---------------------------------

class GemLiteLM:
    def __init__(self, device):
        gen = generator(94)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.pos = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [GemLiteLinearTriton(HIDDEN, HIDDEN).pack(
            randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4).to(DTYPE)) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)

    def __call__(self, input_ids, cache_position):
        h = self.embed[input_ids] + self.pos[cache_position]
        for layer in self.layers:
            h = h + F.silu(layer.forward(h))
        return h @ self.lm_head


# --- hqq/utils/generation_hf.py (HFGenerator, reduced) ------------------------------------------------------------

class HFGenerator:
    def __init__(self, model, device, max_new_tokens):
        self.model, self.device, self.max_new_tokens = model, device, max_new_tokens
        self.decode_one_token = self.decode_one_token_no_sample
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.outputs = []
        ############################
        # Cuda Graph section
        self.static_input = torch.zeros((1, 1), device=device, dtype=torch.long)
        self.static_output = torch.zeros((1, 1), device=device, dtype=torch.long)
        self.cuda_graph = None
        self.static_logits = None
        self.do_capture_graph = False
        ############################
        self.gen_next_token = self.gen_next_token_raw

    def decode_one_token_no_sample(self, cur_token, cache_position):
        logits = self.model(cur_token[0], cache_position)
        new_token = torch.argmax(logits, dim=-1)[:, None]
        return logits, new_token

    def prefill(self, input_ids):
        seq_length = input_ids.shape[0]
        logits = self.model(input_ids, torch.arange(seq_length, device=self.device))
        self.outputs.append(logits.clone())
        self.cache_position.fill_(seq_length - 1)
        return torch.argmax(logits[-1:], dim=-1)[:, None]

    def gen_next_token_raw(self, next_token):
        self.cache_position += 1
        logits, next_token = self.decode_one_token(next_token.clone(), self.cache_position)
        self.outputs.append(logits.clone())
        return next_token

    def gen_next_token_withgraph_v1(self, next_token):
        self.static_input.copy_(next_token)
        self.cache_position += 1

        if self.do_capture_graph:
            def step():
                logits, out = self.decode_one_token(self.static_input, self.cache_position)
                self.static_output.copy_(out)
                return logits
            # Warm-up (3 eager runs), then capture
            self.cuda_graph, self.static_logits = capture(
                step, device=str(self.device), warmups=3, owner="HFGenerator", name="decode_one_token",
                static={"static_input": self.static_input, "cache_position": self.cache_position})
            self.do_capture_graph = False

        logits = replay(self.cuda_graph, self.static_logits)    # a capture runs nothing: replay runs the step

        self.outputs.append(logits.clone())
        return self.static_output.clone()

    def enable_cuda_graph(self, prompt):
        _ = self.generate(prompt)                     # warm-up
        self.gen_next_token = self.gen_next_token_withgraph_v1
        self.do_capture_graph = True
        _ = self.generate(prompt)                     # capture
        return self

    def generate(self, input_ids):
        next_token = self.prefill(input_ids)
        for _ in range(1, self.max_new_tokens):
            next_token = self.gen_next_token(next_token)
        return next_token


def prompt(seed):
    return torch.randint(0, VOCAB, (4,), generator=generator(seed))


def _serve(device, use_cuda_graph):
    KERNEL_CACHE.clear()
    set_kernel_caching(True)
    gen = HFGenerator(GemLiteLM(device), device, max_new_tokens=4)
    if use_cuda_graph:
        gen.enable_cuda_graph(prompt(1).to(device))
    else:
        gen.generate(prompt(1).to(device))
        gen.generate(prompt(1).to(device))
    gen.generate(prompt(3).to(device))
    return gen.outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
