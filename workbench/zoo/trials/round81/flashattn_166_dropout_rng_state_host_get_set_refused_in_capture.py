"""FlashAttention saves the dropout RNG state on the host in forward and restores it in backward, so a captured training step with dropout is refused.

Upstream: https://github.com/Dao-AILab/flash-attention/pull/166 ("Enable CUDA graph capture", ksivaman,
Dao-AILab/flash-attention, merged 2023-04-16, merge commit 635f159e; main commit 31018c5f "Support CUDA graph
capture"; fixes issue #165 "CUDA graph capture not supported").
Symptom: capturing ``flash_attn_unpadded_func(q, k, v, cu_seqlens, cu_seqlens, seq_len, seq_len, pdrop)`` with
``pdrop > 0`` in ``torch.cuda.graph(g)`` fails with ``RuntimeError: Cannot call CUDAGeneratorImpl::current_seed
during CUDA graph capture. If you need this call to be captured, please file an issue. Current
cudaStreamCaptureStatus: cudaStreamCaptureStatusActive``. The same code with dropout runs eagerly, and a
capture with ``dropout_p = 0`` works. Training steps graphed with ``make_graphed_callables`` or a whole-step
``torch.cuda.graph`` therefore could not use FlashAttention with attention dropout.
Mechanism: the dropout mask is never stored. The backward kernel draws it again from the same philox seed and
offset. Before the fix, ``FlashAttnFunc.forward`` (flash_attn/flash_attn_interface.py) remembered where the
forward's draw started with ``rng_state = torch.cuda.get_rng_state() if dropout_p > 0 else None``: a host copy of
the generator's seed and offset, saved for backward. ``mha_fwd`` (csrc/flash_attn/fmha_api.cpp) then takes
``gen->philox_cuda_state(counter_offset)``, which advances the offset by ``b * h * 32``. ``FlashAttnFunc.backward``
rewound the generator on the host with ``cur_rng_state = torch.cuda.get_rng_state();
torch.cuda.set_rng_state(rng_state)``, so that ``mha_bwd``'s own ``gen->philox_cuda_state(counter_offset)`` handed
the backward kernel the forward's (seed, offset); afterwards it put the state back with
``torch.cuda.set_rng_state(cur_rng_state)``. Eagerly this host snapshot and rewind is exact. Inside a capture it
is host bookkeeping that no replay repeats. Under capture, ``philox_cuda_state`` gives kernels the graph's device
seed/offset (``seed_extragraph_``, ``offset_extragraph_``) plus a capture-relative offset, and
``CUDAGraph::replay`` advances them for each replay. A host snapshot taken once at capture would not follow.
PyTorch's generator therefore refuses the read (``current_seed`` / ``philox_offset_per_thread`` assert that no
capture is open). The first ``get_rng_state`` in the captured ``forward`` raises, and the capture is abandoned.
Doctor: host-work-frozen, at forward (``FlashAttnFunc.forward`` takes a host snapshot of the generator inside the
captured region, and its ``backward`` depends on it. A host value read once at capture cannot follow the replays'
offsets, so the generator refuses it. The fix removed exactly this line: ``forward`` takes ``rng_state`` from the
kernel's output instead).
Fix (upstream): ``mha_fwd`` allocates ``rng_state = torch::empty({2}, kInt64)`` on the device and passes its
pointer to the forward kernel, which writes the seed and offset it unpacked from ``philox_args`` (``if (bidx == 0
&& tidx == 0) { params.rng_state[0] = seed; params.rng_state[1] = offset; }``). It returns the tensor
(``result.push_back(rng_state)``). ``_flash_attn_forward`` unpacks ``softmax_lse, rng_state, *rest =
flash_attn_cuda.fwd(...)``, ``forward`` saves that device tensor, and ``backward`` passes it to
``_flash_attn_backward`` without any ``get_rng_state``/``set_rng_state``. ``mha_bwd`` sets ``params.rng_state``
from it instead of calling ``gen->philox_cuda_state`` (that call remains only for ``rng_state = None``, the
``FlashAttnQKVPackedSplitFunc`` path). The backward kernel builds ``Philox ph(params.rng_state[0], 0,
params.rng_state[1] + ...)``. Each replay's forward writes that replay's seed/offset into graph memory, and the
replayed backward reads them there.
Modelled: ``FlashAttnFunc`` only (the QKV-packed, KV-packed and split variants change in the same way). Autograd
is driven by hand: ``train_step`` calls ``FlashAttnFunc.forward(ctx, ...)`` and then ``FlashAttnFunc.backward(ctx,
dout)`` with a ``FunctionCtx`` stand-in; loss = sum(out * target), so dout = target. The step is captured whole,
as ``make_graphed_callables`` captures forward and backward. ``flash_attn_cuda.fwd``/``bwd`` stand for
``mha_fwd``/``mha_bwd``, and the two kernels for one dense attention. All sequences have the same length, so the
kernels reshape ``(total, h, d)`` to ``(b, s, h, d)`` instead of walking ``cu_seqlens``. Philox is a counter-based
integer hash of (seed, offset + element index). ``CUDAGeneratorImpl`` is PyTorch 2.0's default CUDA generator in
miniature: host ``seed_``/``philox_offset_per_thread_``, ``philox_cuda_state`` for eager and captured kernels,
``capture_prologue``/``capture_epilogue``/``replay_prologue``. ``cuda.get_rng_state``/``set_rng_state``/
``manual_seed`` stand for ``torch.cuda``'s. ``CUDAGraphWithRNG`` is the user's ``torch.cuda.graph`` capture plus the
generator hooks that ``CUDAGraph::capture_begin``/``capture_end``/``replay`` call; the graph's
``seed_extragraph_``/``offset_extragraph_`` are its static inputs. The warmup and the capture leave the
generator elsewhere, so the served run reseeds after capture: eager and served both run three steps from
``manual_seed(SEED)``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Dao-AILab/flash-attention/pull/166"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = ("capturing a FlashAttention step with dropout raises 'Cannot call CUDAGeneratorImpl::current_seed during "
           "CUDA graph capture' from torch.cuda.get_rng_state() in FlashAttnFunc.forward")

BATCH, SEQLEN, NHEADS, HEADDIM = 2, 4, 2, 8
DROPOUT_P, SEED, STEPS = 0.25, 1234, 3
VARIANT = {"v": "bug"}
_MASK32 = (1 << 32) - 1


def capturing() -> bool:
    """``at::cuda::currentStreamCaptureStatus() != CaptureStatus::None``."""
    return torch.cuda.is_current_stream_capturing()


# --- aten/src/ATen/cuda/CUDAGeneratorImpl.cpp (PyTorch 2.0) -----------------------------------------------

class PhiloxCudaState:
    """By value when not capturing; under capture, pointers to the graph's seed/offset plus an intragraph offset."""

    def __init__(self, seed, offset, seed_ptr=None, offset_ptr=None, offset_intragraph=0):
        self.seed_, self.offset_ = seed, offset
        self.seed_ptr, self.offset_ptr, self.offset_intragraph_ = seed_ptr, offset_ptr, offset_intragraph
        self.captured_ = seed_ptr is not None


class CUDAGeneratorImpl:
    def __init__(self, device):
        self.device = device
        self.seed_, self.philox_offset_per_thread_ = 67280421310721, 0
        self.seed_extragraph_ = self.offset_extragraph_ = None
        self.offset_intragraph_, self.graph_expects_this_gen_ = 0, False

    def _assert_not_capturing(self, what):
        if capturing():
            raise RuntimeError(f"Cannot call CUDAGeneratorImpl::{what} during CUDA graph capture. If you need this "
                               "call to be captured, please file an issue. Current cudaStreamCaptureStatus: "
                               "cudaStreamCaptureStatusActive")

    def set_current_seed(self, seed):
        self._assert_not_capturing("set_current_seed")
        self.seed_, self.philox_offset_per_thread_ = seed, 0

    def current_seed(self):
        self._assert_not_capturing("current_seed")
        return self.seed_

    def set_philox_offset_per_thread(self, offset):
        self._assert_not_capturing("set_philox_offset_per_thread")
        self.philox_offset_per_thread_ = offset

    def philox_offset_per_thread(self):
        self._assert_not_capturing("philox_offset_per_thread")
        return self.philox_offset_per_thread_

    def get_state(self) -> torch.Tensor:
        """A host tensor of (seed, offset) (torch's is a byte tensor that holds the same two numbers)."""
        return torch.tensor([self.current_seed(), self.philox_offset_per_thread()], dtype=torch.int64)

    def set_state(self, new_state: torch.Tensor) -> None:
        seed, offset = (int(x) for x in new_state)
        self.set_current_seed(seed)
        self.set_philox_offset_per_thread(offset)

    def capture_prologue(self, seed_extragraph, offset_extragraph):
        self.seed_extragraph_, self.offset_extragraph_ = seed_extragraph, offset_extragraph
        self.offset_intragraph_, self.graph_expects_this_gen_ = 0, True

    def capture_epilogue(self) -> int:
        self.graph_expects_this_gen_ = False
        return self.offset_intragraph_

    def philox_cuda_state(self, increment: int) -> PhiloxCudaState:
        increment = ((increment + 3) // 4) * 4
        if capturing():
            assert self.graph_expects_this_gen_
            state = PhiloxCudaState(None, None, self.seed_extragraph_, self.offset_extragraph_,
                                    self.offset_intragraph_)
            self.offset_intragraph_ += increment
            return state
        state = PhiloxCudaState(self.seed_, self.philox_offset_per_thread_)
        self.philox_offset_per_thread_ += increment
        return state


def replay_prologue(gen: CUDAGeneratorImpl, seed_extragraph, offset_extragraph, wholegraph_increment):
    """``CUDAGraph::replay``: before launching, hand the graph this replay's seed/offset and advance the host offset."""
    seed_extragraph.fill_(gen.current_seed())
    offset_extragraph.fill_(gen.philox_offset_per_thread())
    gen.philox_offset_per_thread_ += wholegraph_increment


class cuda:
    """``torch.cuda``'s RNG functions on the default CUDA generator."""

    default_generator: CUDAGeneratorImpl | None = None

    @staticmethod
    def get_rng_state() -> torch.Tensor:
        return cuda.default_generator.get_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor) -> None:
        cuda.default_generator.set_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        cuda.default_generator.set_current_seed(seed)


# --- csrc/flash_attn/src/philox.cuh, fmha_fprop_kernel_1xN.h, fmha_dgrad_kernel_1xN_loop.h ---------------

def unpack(philox_args: PhiloxCudaState, device):
    """``at::cuda::philox::unpack`` on the device: (seed, offset) as the kernel sees them."""
    if philox_args.captured_:
        return philox_args.seed_ptr, philox_args.offset_ptr + philox_args.offset_intragraph_
    return (torch.full((1,), philox_args.seed_, dtype=torch.int64, device=device),
            torch.full((1,), philox_args.offset_, dtype=torch.int64, device=device))


def Philox(seed, offset, shape, device):
    """Uniform [0, 1) numbers: element i depends only on (seed, offset + i)."""
    n = 1
    for s in shape:
        n *= s
    counter = offset + torch.arange(n, dtype=torch.int64, device=device)
    h = (counter * 2654435761 + seed * 40503 + 12345) & _MASK32
    h = ((h ^ (h >> 13)) * 1274126177) & _MASK32
    h = h ^ (h >> 16)
    return (h.to(torch.float32) / float(1 << 32)).view(*shape)


def _heads_first(t, b, s):
    return t.view(b, s, t.shape[1], t.shape[2]).transpose(1, 2)           # (b, h, s, d)


def _tokens_first(t):
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])          # (total, h, d)


def device_1xN_loop(params):
    """The forward kernel: softmax(QK^T), dropout from philox, times V."""
    q, k, v = (_heads_first(t, params.b, params.seqlen_q) for t in (params.q, params.k, params.v))
    scores = q @ k.transpose(-1, -2) * params.scale_bmm1
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None])
    seed, offset = unpack(params.philox_args, q.device)
    if VARIANT["v"] == "fix":
        params.rng_state[0:1].copy_(seed)                                  # (bidx == 0 && tidx == 0)
        params.rng_state[1:2].copy_(offset)
    keep = (Philox(seed, offset, p.shape, q.device) >= params.p_dropout).to(p.dtype)
    params.o.copy_(_tokens_first((p * keep / (1.0 - params.p_dropout)) @ v))
    params.softmax_lse.copy_(lse)


def compute_dq_dk_dv_1xN(params):
    """The backward kernel: recompute P from the saved logsumexp, draw the same dropout mask, and apply the chain rule."""
    b, s = params.b, params.seqlen_q
    q, k, v, o, do = (_heads_first(t, b, s) for t in (params.q, params.k, params.v, params.o, params.do))
    p = torch.exp(q @ k.transpose(-1, -2) * params.scale_bmm1 - params.softmax_lse[..., None])
    if VARIANT["v"] == "fix":
        seed, offset = params.rng_state[0:1], params.rng_state[1:2]
    else:
        seed, offset = unpack(params.philox_args, q.device)
    keep_scaled = (Philox(seed, offset, p.shape, q.device) >= params.p_dropout).to(p.dtype) / (1.0 - params.p_dropout)
    dv = (p * keep_scaled).transpose(-1, -2) @ do
    dp = (do @ v.transpose(-1, -2)) * keep_scaled
    softmax_d = (do * o).sum(-1)
    ds = p * (dp - softmax_d[..., None])
    params.dq.copy_(_tokens_first(ds @ k * params.scale_bmm1))
    params.dk.copy_(_tokens_first(ds.transpose(-1, -2) @ q * params.scale_bmm1))
    params.dv.copy_(_tokens_first(dv))
    return softmax_d


# --- csrc/flash_attn/fmha_api.cpp --------------------------------------------------------------------

class Launch_params:
    pass


class flash_attn_cuda:
    @staticmethod
    def fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
            zero_tensors, is_causal, return_softmax, num_splits, gen_):
        """``mha_fwd``."""
        gen = gen_ or cuda.default_generator
        is_dropout = p_dropout > 0.0
        params = Launch_params()
        params.b, params.h, params.seqlen_q = cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_q
        params.q, params.k, params.v, params.o = q, k, v, out
        params.softmax_lse = torch.empty(params.b, params.h, max_seqlen_q, dtype=torch.float32, device=q.device)
        params.p_dropout, params.scale_bmm1 = p_dropout, softmax_scale
        # We use a custom RNG that increases the offset by batch_size * nheads * 32.
        counter_offset = params.b * params.h * 32
        if VARIANT["v"] == "fix":
            rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
            # Forward kernel will populate memory with the seed and offset.
            params.rng_state = rng_state
        if is_dropout:
            params.philox_args = gen.philox_cuda_state(counter_offset)
        device_1xN_loop(params)                                               # run_fmha_fwd
        result = [params.softmax_lse]
        if VARIANT["v"] == "fix":
            result.append(rng_state)
        return result

    @staticmethod
    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            p_dropout, softmax_scale, zero_tensors, is_causal, num_splits, gen_, rng_state=None):
        """``mha_bwd``."""
        gen = gen_ or cuda.default_generator
        is_dropout = p_dropout > 0.0
        params = Launch_params()
        params.b, params.h, params.seqlen_q = cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_q
        params.q, params.k, params.v, params.o, params.do = q, k, v, out, dout
        params.dq, params.dk, params.dv, params.softmax_lse = dq, dk, dv, softmax_lse
        params.p_dropout, params.scale_bmm1 = p_dropout, softmax_scale
        # We use a custom RNG that increases the offset by batch_size * nheads * 32.
        counter_offset = params.b * params.h * 32
        if VARIANT["v"] == "fix" and rng_state is not None:
            params.rng_state = rng_state
        elif is_dropout:
            params.philox_args = gen.philox_cuda_state(counter_offset)
            if VARIANT["v"] == "fix":
                seed, offset = unpack(params.philox_args, q.device)
                params.rng_state = torch.cat([seed, offset])
        softmax_d = compute_dq_dk_dv_1xN(params)                              # launch(params, stream, false)
        return dq, dk, dv, softmax_d


# --- flash_attn/flash_attn_interface.py -----------------------------------------------------------------

def _flash_attn_forward(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p, softmax_scale, causal, return_softmax, num_splits=0, generator=None):
    if VARIANT["v"] == "bug":
        softmax_lse, *rest = flash_attn_cuda.fwd(
            q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, False, causal, return_softmax, num_splits, generator
        )
        S_dmask = rest[0] if return_softmax else None
        return out, softmax_lse, S_dmask
    softmax_lse, rng_state, *rest = flash_attn_cuda.fwd(
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, False, causal, return_softmax, num_splits, generator
    )
    S_dmask = rest[0] if return_softmax else None
    return out, softmax_lse, rng_state, S_dmask


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, rng_state=None,
                         num_splits=0, generator=None):
    dout = dout.contiguous()  # CUDA code assumes that dout is contiguous
    _, _, _, softmax_d = flash_attn_cuda.bwd(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, False, causal,
        num_splits, generator, rng_state)
    return dq, dk, dv, softmax_d


class FunctionCtx:
    """``torch.autograd.function.FunctionCtx``: what forward saves for backward."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class FlashAttnFunc:

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, return_softmax, deterministic):
        if VARIANT["v"] == "bug":
            # Save rng_state because the backward pass will regenerate the dropout mask
            rng_state = cuda.get_rng_state() if dropout_p > 0 else None
            if softmax_scale is None:
                softmax_scale = q.shape[-1] ** (-0.5)
            out, softmax_lse, S_dmask = _flash_attn_forward(
                q, k, v, torch.empty_like(q), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                dropout_p, softmax_scale, causal=causal, return_softmax=return_softmax
            )
        else:
            if softmax_scale is None:
                softmax_scale = q.shape[-1] ** (-0.5)
            out, softmax_lse, rng_state, S_dmask = _flash_attn_forward(
                q, k, v, torch.empty_like(q), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                dropout_p, softmax_scale, causal=causal, return_softmax=return_softmax
            )
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state)
        ctx.dropout_p = dropout_p
        ctx.max_seqlen_q = max_seqlen_q
        ctx.max_seqlen_k = max_seqlen_k
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.deterministic = deterministic
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        if VARIANT["v"] == "bug":
            if rng_state is not None:
                cur_rng_state = cuda.get_rng_state()
                cuda.set_rng_state(rng_state)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            _flash_attn_backward(
                dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.dropout_p, ctx.softmax_scale, ctx.causal,
                num_splits=1 if ctx.deterministic else 0,
            )
            if rng_state is not None:
                cuda.set_rng_state(cur_rng_state)
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            _flash_attn_backward(
                dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.dropout_p, ctx.softmax_scale, ctx.causal,
                rng_state, num_splits=1 if ctx.deterministic else 0,
            )
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


# --- the user's training step (issue #165's repro, with backward) ----------------------------------------

def train_step(q, k, v, target, cu_seqlens):
    """out = flash_attn_unpadded_func(q, k, v, cu_seqlens, cu_seqlens, SEQLEN, SEQLEN, DROPOUT_P);
    loss = (out * target).sum(); loss.backward()."""
    ctx = FunctionCtx()
    out = FlashAttnFunc.forward(ctx, q, k, v, cu_seqlens, cu_seqlens, SEQLEN, SEQLEN, DROPOUT_P,
                                None, False, False, False)
    dq, dk, dv, *_ = FlashAttnFunc.backward(ctx, target)
    return out, dq, dk, dv


class CUDAGraphWithRNG:
    """``torch.cuda.graph(g)`` around the step, with the default generator's ``CUDAGraph`` hooks."""

    def __init__(self, device, gen):
        self.device, self.gen = device, gen
        self.seed_extragraph_ = torch.zeros(1, dtype=torch.int64, device=device)
        self.offset_extragraph_ = torch.zeros(1, dtype=torch.int64, device=device)

    def capture(self, fn, static):
        self.gen.capture_prologue(self.seed_extragraph_, self.offset_extragraph_)   # capture_begin
        try:
            self.g, self.out = capture(
                fn, device=self.device, warmups=1, name="train step", owner="make_graphed_callables",
                static={**static, "seed_extragraph_": self.seed_extragraph_,
                        "offset_extragraph_": self.offset_extragraph_})
        finally:
            self.wholegraph_increment_ = self.gen.capture_epilogue()                # capture_end

    def replay(self):
        replay_prologue(self.gen, self.seed_extragraph_, self.offset_extragraph_, self.wholegraph_increment_)
        return replay(self.g, self.out)


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    data = generator(166)
    total = BATCH * SEQLEN
    steps = [tuple(randn(total, NHEADS, HEADDIM, gen=data, device=device) for _ in range(4)) for _ in range(STEPS)]
    cu_seqlens = torch.arange(0, (BATCH + 1) * SEQLEN, step=SEQLEN, dtype=torch.int32, device=device)

    def eager():
        cuda.default_generator = CUDAGeneratorImpl(device)
        cuda.manual_seed(SEED)
        outs = []
        for q, k, v, target in steps:
            outs += [t.clone() for t in train_step(q, k, v, target, cu_seqlens)]
        return outs

    def served():
        cuda.default_generator = gen = CUDAGeneratorImpl(device)
        static_q, static_k, static_v, static_target = (t.clone() for t in steps[0])
        g = CUDAGraphWithRNG(device, gen)
        g.capture(lambda: train_step(static_q, static_k, static_v, static_target, cu_seqlens),
                  static={"q": static_q, "k": static_k, "v": static_v, "dout": static_target})
        cuda.manual_seed(SEED)
        outs = []
        for q, k, v, target in steps:
            for buf, x in zip((static_q, static_k, static_v, static_target), (q, k, v, target)):
                buf.copy_(x)
            outs += [t.clone() for t in g.replay()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
