"""aiter's Triton FA2 interface (``flash_attn_triton_amd.interface_v2.fwd``) builds ``rng_state`` with ``torch.as_tensor([seed, offset])`` on every call; under a CUDA default device that is a host-to-device upload of Python data, and capturing ``flash_attn_func`` fails.

Upstream: https://github.com/ROCm/aiter/pull/3711 ("[Triton] Fix flaky graph capture tests", ROCm/aiter, merged
2026-06-15 as commit 0124ca4770fb by Michael Melesse). Read: the whole diff (``interface_v2.py``: ``fwd`` and
``varlen_fwd`` stop calling ``torch.as_tensor([philox_seed, philox_offset])`` and return a module-level
``_RNG_STATE`` built once at import, "a per-call alloc inherits the default device and does an illegal H2D under CUDA
graph capture"; ``test_mha_dao_ai.py``: ``test_mha_dao_ai_graph`` and ``test_mha_dao_ai_varlen_graph`` parametrized
over ``default_device`` in ``("cpu", "cuda")`` with a ``_with_default_device`` context around ``torch.cuda.graph``,
whose docstring explains the flakiness), ``interface_v2.fwd`` at the parent commit in full, ``flash_attn_triton_amd``
``utils.py`` (``PHILOX_SEED`` / ``PHILOX_OFFSET``), and ``aiter/ops/triton/attention/mha.py`` (``mha_set_impl``,
``_flash_attn_forward`` and its ``dao_ai`` branch calling ``flash_attn_2.fwd``, ``_FlashAttnFunc.forward``,
``flash_attn_func``). No issue is linked.
Symptom: capturing ``flash_attn_func(q, k, v, causal=True)`` with the ``dao_ai`` implementation fails whenever the
torch default device is the GPU: the graph tests failed or passed depending on test order ("a sibling test that leaks
``torch.set_default_device("cuda")`` ... makes any tensor constructor in the op that omits ``device=`` allocate on
CUDA, an illegal H2D during capture"). Any program that leaves a CUDA default device set and captures the op hits
the same failure (gLLM's ``ModelLoader``, for one, sets the default device to CUDA); eager calls work.
Mechanism: ``fwd`` computes ``rng_state = torch.as_tensor([philox_seed, philox_offset])`` for its return value on
every call. The constructor names no device, so ``torch.set_default_device``'s ``DeviceContext`` gives it the default
one. With a CUDA default it copies the two Python ints from pageable host memory to the device, which a capturing
stream refuses. Eager calls run the same line and are allowed the copy, so only the capture fails.
Doctor: sync-in-capture, at fwd. A copy of Python data from pageable host memory to the device (a synchronising
upload) is attempted while ``flash_attn_func`` is being captured; ``fwd`` makes it, and the fix changed ``fwd``.
Fix (upstream): ``_RNG_STATE = torch.tensor([PHILOX_SEED, PHILOX_OFFSET])`` once at import, and
``rng_state = _RNG_STATE`` in ``fwd`` and ``varlen_fwd``: nothing is made, so nothing is uploaded, in the capture.
Modelled: ``interface_v2.fwd`` (argument checks, ``out.zero_()``, ``softmax_lse`` / ``sd_mask`` for
``SHAPE_EXPECTATIONS="exact"``, the call of ``attention_forward_prefill_triton_impl``, the return tuple; DEBUG prints
and most output assertions left out), ``mha.py``'s ``mha_set_impl``, ``_flash_attn_forward`` (non-varlen, no FP8, no
sink, no PE; the ``dao_ai`` branch), ``_FlashAttnFunc.forward`` and ``flash_attn_func``, and the test's
``dao_ai_impl`` fixture, ``_with_default_device`` and graph flow (3 warm-ups, capture, replay, eager reference).
Stand-ins: ``attention_forward_prefill_triton_impl`` is a torch causal GQA attention (bottom-right-aligned mask) that
writes ``out`` and ``softmax_lse``; ``torch.set_default_device`` is ``_DeviceContext``, which does what torch's
``DeviceContext`` mode does for a factory called without ``device=``: it passes the default device (written out in
``torch_as_tensor``, since a dispatch mode entered before the capture would hide it from the engine). The test's three
warm-ups run inside ``_with_default_device`` here (eagerly the upload is allowed, so this changes nothing). Sizes
scaled (batch 2, seqlen 6, 4 query heads, head dim 8), float64; ``mha_type="gqa"`` (2 KV heads).
Workload: the test's capture of ``flash_attn_func(q, k, v, causal=True)`` on static ``q``/``k``/``v``, then three
replays with new inputs copied in, against eager calls on the same inputs. The bug raises the engine's CaptureError
at the capture (``torch.as_tensor(..., device=...)`` inside graph capture; on CUDA, torch refuses the pageable copy);
the fix captures and its three outputs equal eager (max error 0).
"""
from __future__ import annotations

import contextlib
from typing import Literal, Optional

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/aiter/pull/3711"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "fwd"
SYMPTOM = ("capturing aiter's flash_attn_func (dao_ai impl) fails when the torch default device is the GPU: "
           "interface_v2.fwd makes rng_state with torch.as_tensor([seed, offset]) on every call, a host-to-device "
           "upload of Python data inside the capture")

BATCH, SEQLEN, NHEADS, NHEADS_K, D = 2, 6, 4, 2, 8
STEPS = 3
DTYPE = torch.float64

_variant = "bug"


# --- torch.set_default_device (stand-in for torch.utils._device.DeviceContext) ---------------------------------------

class _DeviceContext:
    current: Optional[str] = None


def torch_as_tensor(data, dtype=None):
    """``torch.as_tensor(data)`` as it runs under ``torch.set_default_device(d)``: no ``device=`` given, so the
    default device's ``DeviceContext`` passes ``device=d``."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    if _DeviceContext.current is not None:
        kwargs["device"] = _DeviceContext.current
    return torch.as_tensor(data, **kwargs)


# --- aiter/ops/triton/_triton_kernels/flash_attn_triton_amd/utils.py -------------------------------------------------

PHILOX_SEED = 0x1BF58
PHILOX_OFFSET = 0x1D4B49
SHAPE_EXPECTATIONS = "exact"
USE_EXP2 = True


# --- flash_attn_triton_amd/fwd_prefill.py (stand-in for the Triton kernel) ------------------------------------------

def attention_forward_prefill_triton_impl(q, k, v, out, softmax_lse, sd_mask, sm_scale, alibi_slopes, causal,
                                          window_size_left, window_size_right, bias, layout, cu_seqlens_q,
                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, philox_seed,
                                          philox_offset, return_softmax, use_exp2):
    assert layout == "bshd" and dropout_p == 0.0 and alibi_slopes is None
    group = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(group, dim=2)
    vv = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * sm_scale
    if causal:                                  # aligned to the bottom-right corner (FA2)
        qi = torch.arange(max_seqlen_q, device=q.device)[:, None]
        kj = torch.arange(max_seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(kj > qi + (max_seqlen_k - max_seqlen_q), float("-inf"))
    softmax_lse.copy_(torch.logsumexp(scores, dim=-1))
    out.copy_(torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vv))


# --- flash_attn_triton_amd/interface_v2.py ---------------------------------------------------------------------------

# fix: "Built once at import, not per call: a per-call alloc inherits the default device and does an illegal H2D
# under CUDA graph capture."
_RNG_STATE = torch.tensor([PHILOX_SEED, PHILOX_OFFSET])


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor],
        alibi_slopes: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
        window_size_left: int, window_size_right: int, softcap: float, return_softmax: bool,
        gen_: Optional[torch.Tensor] = None):
    if softcap != 0.0:
        raise NotImplementedError("softcap is not supported in the AMD Triton FA2 interface (expected 0.0).")
    if out is None:
        out = torch.zeros_like(q)
    else:
        out.zero_()

    # Layout / shapes
    layout: Literal["bshd", "bhsd", "thd"] = "bshd"
    max_seqlen_q = q.shape[1]
    max_seqlen_k = k.shape[1]
    batch, _, nheads_q, _ = q.shape

    # Dropout + RNG seed
    philox_seed, philox_offset = PHILOX_SEED, PHILOX_OFFSET
    if _variant == "bug":
        rng_state = torch_as_tensor([philox_seed, philox_offset])
    else:
        rng_state = _RNG_STATE

    # argument checks
    assert q.dim() == 4 and k.dim() == 4 and v.dim() == 4
    assert q.shape[-1] == k.shape[-1] == v.shape[-1]
    assert q.dtype == k.dtype == v.dtype
    assert out.shape[:-1] == q.shape[:-1] and out.shape[-1] == v.shape[-1]
    nheads_k = k.shape[2]
    assert (nheads_q % nheads_k) == 0

    softmax_lse = torch.zeros((batch, nheads_q, max_seqlen_q), device=q.device, dtype=torch.float32)
    if dropout_p > 0.0 or return_softmax:
        sd_mask = torch.zeros((batch, nheads_q, max_seqlen_q, max_seqlen_k), device=q.device, dtype=torch.float32)
    else:
        sd_mask = None

    attention_forward_prefill_triton_impl(
        q, k, v, out, softmax_lse, sd_mask, softmax_scale, alibi_slopes, causal, window_size_left,
        window_size_right, None, layout, None, None, max_seqlen_q, max_seqlen_k, dropout_p, philox_seed,
        philox_offset, return_softmax, USE_EXP2)

    assert out.shape == q.shape, f"[fwd] out shape {out.shape} != q shape {q.shape}"
    assert softmax_lse.dtype == torch.float32
    return out, softmax_lse, sd_mask, rng_state


class flash_attn_2:                                          # the interface module as mha.py imports it
    fwd = staticmethod(fwd)


# --- aiter/ops/triton/attention/mha.py -------------------------------------------------------------------------------

_MHA_IMPL: Literal["default", "dao_ai"] = "default"


def mha_set_impl(impl: Literal["default", "dao_ai"]):
    global _MHA_IMPL
    _MHA_IMPL = impl


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, bias,
                        alibi_slopes, return_lse, return_softmax, max_seqlen_q, max_seqlen_k, sink=None):
    if bias is not None:
        raise ValueError("Bias is not supported yet in the Triton Backend")
    if window_size_right != -1:
        raise ValueError("window_size_right is not supported yet in the Triton Backend")
    o = torch.zeros((q.shape[:-1] + v.shape[-1:]), dtype=q.dtype, device=q.device)
    batch, seqlen_q, num_q_heads = (int(x) for x in q.shape[:-1])
    softmax_lse = torch.zeros((batch, num_q_heads, max_seqlen_q), device=q.device, dtype=torch.float32)
    philox_seed = philox_offset = 0                          # no dropout
    s_dmask = None
    if _MHA_IMPL == "dao_ai":
        assert sink is None, "dao_ai impl does not support attention sink."
        assert window_size_left == -1 and window_size_right == -1, "dao_ai impl does not support sliding window."
        o, softmax_lse, s_dmask, _ = flash_attn_2.fwd(
            q, k, v, o, alibi_slopes, dropout_p, softmax_scale, causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, return_softmax=return_softmax)
        assert softmax_lse.shape[0] == batch and softmax_lse.shape[1] == num_q_heads
    else:
        raise NotImplementedError("the default _attn_fwd Triton path is not modelled")
    return o, softmax_lse, s_dmask, philox_seed, philox_offset


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, bias, alibi_slopes, deterministic,
                return_lse, return_softmax, sink, is_grad_enabled):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        head_size_og = q.size(3)
        if head_size_og % 8 != 0:
            q, k, v = (torch.nn.functional.pad(t, [0, 8 - head_size_og % 8]) for t in (q, k, v))
        out_padded, softmax_lse, S_dmask, philox_seed, philox_offset = _flash_attn_forward(
            q, k, v, dropout_p, softmax_scale, causal=causal, window_size_left=int(window_size[0]),
            window_size_right=int(window_size[1]), bias=bias, alibi_slopes=alibi_slopes, return_lse=return_lse,
            return_softmax=return_softmax and dropout_p > 0, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
            sink=sink)
        out = out_padded[..., :head_size_og]
        result = [out]
        if return_lse:
            result.append(softmax_lse)
        return result[0] if len(result) == 1 else tuple(result)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), bias=None,
                    alibi_slopes=None, deterministic=True, return_lse=False, return_attn_probs=False, sink=None):
    return _FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, bias, alibi_slopes,
                                deterministic, return_lse, return_attn_probs, sink, torch.is_grad_enabled())


# --- op_tests/triton_tests/attention/test_mha_dao_ai.py --------------------------------------------------------------

@contextlib.contextmanager
def _with_default_device(device):
    prev_device = _DeviceContext.current
    try:
        _DeviceContext.current = device
        yield
    finally:
        _DeviceContext.current = prev_device


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(3711)
    inputs = [tuple(randn(BATCH, SEQLEN, h, D, gen=gen, device=device).to(DTYPE) for h in (NHEADS, NHEADS_K, NHEADS_K))
              for _ in range(STEPS + 1)]

    def graphed():
        mha_set_impl("dao_ai")                                   # the dao_ai_impl fixture
        try:
            q, k, v = (t.clone() for t in inputs[0])
            with torch.no_grad(), _with_default_device(device):  # the leaked default device (test: "cuda")
                g, out_graph = capture(lambda: flash_attn_func(q, k, v, causal=True), device=device, warmups=3,
                                       name="flash_attn_func", owner="test_mha_dao_ai_graph",
                                       static={"q": q, "k": k, "v": v})
            outs = []
            for q_new, k_new, v_new in inputs[1:]:
                q.copy_(q_new)
                k.copy_(k_new)
                v.copy_(v_new)
                outs.append(replay(g, out_graph).clone())
            return outs
        finally:
            mha_set_impl("default")

    def eager():
        mha_set_impl("dao_ai")
        try:
            with torch.no_grad():
                return [flash_attn_func(q.clone(), k.clone(), v.clone(), causal=True) for q, k, v in inputs[1:]]
        finally:
            mha_set_impl("default")

    return compare(__name__.rsplit(".", 1)[-1], variant, device, graphed, eager)
