"""TE's context-parallel P2P attention backward zero-fills the THD tail with ``dq[cu_seqlens_q_padded[-1]:]``, a slice bounded by a device scalar: inside the CUDA-graph capture of a Megatron THD layer that slice is a host sync, so the backward graph cannot be captured.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/2898 ("[PyT] [Common] add support for enabling cuda graph
under thd format in megatron.", NVIDIA/TransformerEngine, merged 2026-07-01 as 4cd705b75). Read: the PR's commit
messages ("address @timmoon10: drop FAv2-bwd alloc gate, rely on THD tail zero-fill", "add graph guard for one zero
fill") and its whole diff of ``attention/dot_product_attention/context_parallel.py`` (the guarded zero-fill in
``AttnFuncWithCPAndKVP2P.backward`` and the unconditional mask zero-fill added at its end), ``backends.py``
(``FusedAttnFunc.backward``), ``dot_product_attention.py`` (``pad_between_seqs``) and ``router.py``;
``context_parallel.py`` at the parent (``AttnFuncWithCPAndKVP2P.backward``: ``dq_buffer``, the per-step
``dq``/``dk``/``dv`` combination, ``cp_p2p_bwd_flash_attn``) and ``graph.py`` at the parent
(``set_capture_start``/``is_graph_capturing``, ``_make_graphed_callables`` warm-up, forward and backward capture,
``Graphed.forward``/``backward``, ``make_graphed_callables`` setting the flag around it); Megatron's
``TECudaGraphHelper.create_cudagraphs`` at 4b18b260f0 (it calls TE's ``make_graphed_callables`` on sample THD
inputs). This program models the P2P backward's tail zero-fill only.
Symptom: Megatron training in THD (packed sequences, ``pad_between_seqs``) with context parallelism and TE CUDA
graphs fails while capturing the layer's backward graph (reconstructed from the diff, not quoted from a report:
its comment says "`tensor[scalar_tensor:]` slicing would force a GPU->CPU sync that is forbidden during CUDA graph
capture"). Eager training runs.
Mechanism: the flash-attention varlen backward writes dQ/dK/dV only up to ``cu_seqlens_*_padded[-1]``; the THD
batch is padded to the graph's fixed token count, so the rows past that boundary (the tail) keep whatever
``torch.empty_like`` left, and ``AttnFuncWithCPAndKVP2P.backward`` ends with ``dq[cu_seqlens_q_padded[-1]:]
.fill_(0)`` (and the same for dk, dv). ``cu_seqlens_q_padded`` is a device tensor, so the slice bound is read back
to the host (``__index__`` -> ``.item()``). ``_make_graphed_callables`` warms the layer up eagerly (fine) and then
captures ``torch.autograd.backward`` of its outputs: the first zero-fill synchronises inside the capture and the
capture fails.
Doctor: sync-in-capture, at backward. The host read of ``cu_seqlens_q_padded[-1]`` happens in
``AttnFuncWithCPAndKVP2P.backward`` while the backward graph is being captured; the fix changes that function.
Fix (upstream): ``if is_graph_capturing():`` the tail is zeroed with a sync-free mask,
``q_pad_mask = torch.arange(dq.shape[0], device=dq.device) >= cu_seqlens_q_padded[-1]; dq[q_pad_mask] = 0`` (and
``kv_pad_mask`` for dk, dv); eager keeps the pre-existing slice fill.
Modelled: ``set_capture_start``/``set_capture_end``/``is_graph_capturing``, ``make_graphed_callables`` and
``_make_graphed_callables`` (warm-up iterations of forward + backward, forward graph, backward graph, one mempool,
``Graphed`` copying new inputs and grads into the static buffers), called once as Megatron's
``TECudaGraphHelper.create_cudagraphs`` does, and ``AttnFuncWithCPAndKVP2P`` forward/backward for
``qkv_format="thd"``, causal, flash attention (not fused), no fp8.
Stand-ins: one context-parallel rank (``cp_size`` 1: the ring's single step, the P2P exchange the identity, the
step's results combined with ``copy_``); the flash-attention varlen kernels are dense masked attention that writes
only rows before ``cu_seqlens_*_padded[-1]`` (``flash_attn_fwd``/``flash_attn_bwd``); the layer is
``linear_qkv`` -> core attention -> ``linear_proj`` with one head, its autograd written out (``_backward``); the
loss is a masked MSE and the optimizer SGD, both eager. float64, 16 THD tokens (2 sequences), hidden 4, head dim 3.
Workload: ``make_graphed_callables`` on the first batch (2 warm-up iterations), then 4 training iterations with
different sequence lengths (real 5+4, 3+6, 7+2, 4+4 tokens; padded to even lengths; tails of 6, 6, 6, 8 tokens),
each replaying the forward and backward graphs. Returned: every iteration's loss and the final weights. Bug: the
capture of the backward graph raises (the emulation's CaptureError for the ``.item()``), as upstream. Fix: every
iteration equals eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/2898"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "backward"
SYMPTOM = ("THD + context parallelism + TE CUDA graphs: the P2P attention backward's tail zero-fill slices dq by "
           "cu_seqlens_q_padded[-1], a host sync inside the backward-graph capture, so the capture fails")

TOKENS, HIDDEN, HEAD_DIM = 16, 4, 3
NUM_WARMUP_ITERS = 2
LR = 0.1
DTYPE = torch.float64
BATCHES = [(5, 4), (3, 6), (7, 2), (4, 4)]        # real tokens of the two packed sequences, per iteration

_variant = "bug"

# --- transformer_engine/pytorch/graph.py ----------------------------------------------------------------------------
_IS_GRAPH_CAPTURING = False


def set_capture_start() -> None:
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = True


def set_capture_end() -> None:
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = False


def is_graph_capturing() -> bool:
    """Return whether within `make_graphed_callables`."""
    return _IS_GRAPH_CAPTURING


# --- flash-attention varlen kernels (stand-ins) ----------------------------------------------------------------------

def _thd_layout(cu_seqlens, cu_seqlens_padded, tokens, device):
    """Per THD token: its sequence (by padded offsets) and whether it is a real token of that sequence."""
    pos = torch.arange(tokens, device=device)
    num_seqs = cu_seqlens.shape[0] - 1
    seq = torch.bucketize(pos, cu_seqlens_padded[1:], right=True)
    seq_c = seq.clamp(max=num_seqs - 1)
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    valid = (seq < num_seqs) & (pos - cu_seqlens_padded[seq_c] < seqlens[seq_c])
    return pos, seq, valid


def flash_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, softmax_scale):
    """Causal varlen attention over the padded THD layout; returns (out, softmax probabilities)."""
    pos, seq, valid_q = _thd_layout(cu_seqlens_q, cu_seqlens_q_padded, q.shape[0], q.device)
    _, seq_kv, valid_kv = _thd_layout(cu_seqlens_kv, cu_seqlens_kv_padded, k.shape[0], k.device)
    mask = (valid_q[:, None] & valid_kv[None, :] & (seq[:, None] == seq_kv[None, :])
            & (pos[None, :] <= pos[:, None]))
    s = (q @ k.t() * softmax_scale).masked_fill(~mask, float("-inf"))
    p = torch.where(valid_q[:, None], torch.softmax(s, dim=-1), torch.zeros_like(s))
    return p @ v, p


def flash_attn_bwd(dout, q, k, v, out, p, cu_seqlens_q_padded, cu_seqlens_kv_padded, dq, dk, dv, softmax_scale):
    """Writes dq/dk/dv rows up to cu_seqlens_*_padded[-1] only: the THD tail keeps what the buffers held."""
    ds = p * (dout @ v.t() - (dout * out).sum(dim=-1, keepdim=True))
    rows_q = (torch.arange(q.shape[0], device=q.device) < cu_seqlens_q_padded[-1])[:, None]
    rows_kv = (torch.arange(k.shape[0], device=k.device) < cu_seqlens_kv_padded[-1])[:, None]
    dq.copy_(torch.where(rows_q, ds @ k * softmax_scale, dq))
    dk.copy_(torch.where(rows_kv, ds.t() @ q * softmax_scale, dk))
    dv.copy_(torch.where(rows_kv, p.t() @ dout, dv))


# --- transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py (reduced) ------------------------

class _Ctx:
    pass


class AttnFuncWithCPAndKVP2P:
    """Attention with context parallelism, KV exchanged P2P in a ring (here one rank: a single ring step)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                softmax_scale, qkv_format="thd", use_fused_attention=False):
        cp_size = 1
        out = torch.zeros_like(q)
        for i in range(cp_size):
            out_, softmax_ = flash_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                            cu_seqlens_kv_padded, softmax_scale)
            out.copy_(out_)
        ctx.saved = (q, k, v, out, softmax_, cu_seqlens_q_padded, cu_seqlens_kv_padded)
        ctx.qkv_format, ctx.use_fused_attention, ctx.softmax_scale, ctx.cp_size = (
            qkv_format, use_fused_attention, softmax_scale, cp_size)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, softmax_, cu_seqlens_q_padded, cu_seqlens_kv_padded = ctx.saved
        cp_size, rank = ctx.cp_size, 0
        dq_buffer = torch.empty_like(q)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for i in range(cp_size):
            dq_, dk_, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            flash_attn_bwd(dout, q, k, v, out, softmax_, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                           dq_, dk_, dv_, ctx.softmax_scale)
            dq = dq_buffer
            if i == (cp_size - rank - 1) and rank == (cp_size - 1):     # causal, the diagonal step
                dq.copy_(dq_)
            else:
                dq.add_(dq_)
            if i == 0:
                dk.copy_(dk_)
                dv.copy_(dv_)
            else:
                dk.add_(dk_)
                dv.add_(dv_)

        if ctx.qkv_format == "thd" and not ctx.use_fused_attention:
            if _variant == "bug":
                dq[cu_seqlens_q_padded[-1]:].fill_(0)
                dk[cu_seqlens_kv_padded[-1]:].fill_(0)
                dv[cu_seqlens_kv_padded[-1]:].fill_(0)
            elif is_graph_capturing():
                # arange+mask under capture: `tensor[scalar_tensor:]` slicing would force a GPU->CPU sync
                q_pad_mask = torch.arange(dq.shape[0], device=dq.device) >= cu_seqlens_q_padded[-1]
                kv_pad_mask = torch.arange(dk.shape[0], device=dk.device) >= cu_seqlens_kv_padded[-1]
                dq[q_pad_mask] = 0
                dk[kv_pad_mask] = 0
                dv[kv_pad_mask] = 0
            else:
                # Pre-existing TE eager-mode behaviour.
                dq[cu_seqlens_q_padded[-1]:].fill_(0)
                dk[cu_seqlens_kv_padded[-1]:].fill_(0)
                dv[cu_seqlens_kv_padded[-1]:].fill_(0)
        return dq, dk, dv


# --- the graphed callable: a Megatron THD attention layer (autograd written out) -------------------------------------

class TransformerLayer:
    def __init__(self, device, gen):
        r = lambda *s: (torch.randn(*s, generator=gen, dtype=DTYPE) * 0.5).to(device)   # noqa: E731
        self.linear_qkv_weight = r(HIDDEN, 3 * HEAD_DIM)
        self.linear_proj_weight = r(HEAD_DIM, HIDDEN)
        self.softmax_scale = HEAD_DIM ** -0.5

    def forward(self, hidden_states, cu_seqlens_q, cu_seqlens_q_padded):
        self._hidden = hidden_states
        q, k, v = (hidden_states @ self.linear_qkv_weight).split(HEAD_DIM, dim=-1)
        self._ctx = _Ctx()
        self._core = AttnFuncWithCPAndKVP2P.forward(self._ctx, q, k, v, cu_seqlens_q, cu_seqlens_q,
                                                    cu_seqlens_q_padded, cu_seqlens_q_padded, self.softmax_scale)
        return self._core @ self.linear_proj_weight

    def _backward(self, grad_output):
        """What autograd runs for ``forward``: returns (dgrad of hidden_states, wgrad qkv, wgrad proj)."""
        wgrad_proj = self._core.t() @ grad_output
        dq, dk, dv = AttnFuncWithCPAndKVP2P.backward(self._ctx, grad_output @ self.linear_proj_weight.t())
        dqkv = torch.cat([dq, dk, dv], dim=-1)
        return dqkv @ self.linear_qkv_weight.t(), self._hidden.t() @ dqkv, wgrad_proj


def _make_graphed_callables(layer, sample_args, device):
    """TE ``_make_graphed_callables`` for one callable: warm-up, forward graph, backward graph, one mempool."""
    mempool = graph_pool_handle(device)
    for _ in range(NUM_WARMUP_ITERS):
        with events.warmup():
            out = layer.forward(*sample_args)
            layer._backward(torch.zeros_like(out))
    owner = "te.make_graphed_callables"
    static = dict(zip(("hidden_states", "cu_seqlens_q", "cu_seqlens_q_padded"), sample_args))
    fwd_graph, static_outputs = capture(lambda: layer.forward(*sample_args), device=device, pool=mempool,
                                        warmups=0, name="fwd", owner=owner, static=static)
    static_grad_outputs = torch.empty_like(static_outputs)
    bwd_graph, static_grad_inputs = capture(lambda: layer._backward(static_grad_outputs), device=device,
                                            pool=mempool, warmups=0, name="bwd", owner=owner,
                                            static={"static_grad_outputs": static_grad_outputs})

    class Graphed:
        @staticmethod
        def forward(*inputs):
            for static_input, new_input in zip(sample_args, inputs):
                if static_input.data_ptr() != new_input.data_ptr():
                    static_input.copy_(new_input)
            return replay(fwd_graph, static_outputs)

        @staticmethod
        def backward(grad):
            static_grad_outputs.copy_(grad)
            return replay(bwd_graph, static_grad_inputs)

    return Graphed


def make_graphed_callables(layer, sample_args, device):
    """TE's public ``make_graphed_callables``: marks its window for ``is_graph_capturing()`` around the work."""
    set_capture_start()
    graphed = _make_graphed_callables(layer, sample_args, device)
    set_capture_end()
    return graphed


# --- the workload ----------------------------------------------------------------------------------------------------

def _batch(lens, gen, device):
    padded = [n + n % 2 for n in lens]             # THD sequences padded to a multiple of 2 * cp_size
    cu_seqlens = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32)
    cu_seqlens_padded = torch.tensor([0, padded[0], padded[0] + padded[1]], dtype=torch.int32)
    hidden = torch.zeros(TOKENS, HIDDEN, dtype=DTYPE)
    target = torch.zeros(TOKENS, HIDDEN, dtype=DTYPE)
    loss_mask = torch.zeros(TOKENS, dtype=DTYPE)
    for s in range(2):
        start = int(cu_seqlens_padded[s])
        hidden[start:start + lens[s]] = torch.randn(lens[s], HIDDEN, generator=gen, dtype=DTYPE)
        target[start:start + lens[s]] = torch.randn(lens[s], HIDDEN, generator=gen, dtype=DTYPE)
        loss_mask[start:start + lens[s]] = 1.0
    return [t.to(device) for t in (hidden, cu_seqlens, cu_seqlens_padded, target, loss_mask)]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    set_capture_end()
    gen = generator(2898)
    batches = [_batch(lens, gen, device) for lens in BATCHES]

    def train(graphed):
        layer = TransformerLayer(device, generator(28))
        step = layer
        if graphed:
            hidden, cu, cu_padded = (t.clone() for t in batches[0][:3])
            step = make_graphed_callables(layer, (hidden, cu, cu_padded), device)   # TECudaGraphHelper.create_cudagraphs
        losses = []
        for hidden, cu, cu_padded, target, loss_mask in batches:
            out = step.forward(hidden, cu, cu_padded)
            err = (out - target) * loss_mask[:, None]
            losses.append(0.5 * (err * err).sum())
            backward = step.backward if graphed else layer._backward
            _, wgrad_qkv, wgrad_proj = backward(err)
            layer.linear_qkv_weight.sub_(LR * wgrad_qkv)            # the eager optimizer
            layer.linear_proj_weight.sub_(LR * wgrad_proj)
        return [torch.stack(losses), layer.linear_qkv_weight.clone(), layer.linear_proj_weight.clone()]

    eager = lambda: train(graphed=False)      # noqa: E731
    served = lambda: train(graphed=True)      # noqa: E731
    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
