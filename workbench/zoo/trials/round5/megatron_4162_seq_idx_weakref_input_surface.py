"""After capture the runner weak-refs its graph input surface: the packed ``seq_idx`` it captured loses its only owner.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4162 ("Cudagraphs: Fix sequence packing segfault more
generally", commit 52150ab8fe), the follow-up to https://github.com/NVIDIA/Megatron-LM/pull/3970
("Cudagraphs: Remove fwd_graph_input_surface weakref").
Symptom: training a Mamba hybrid with sequence packing (THD, ``PackedSeqParams``) and Megatron-Core's local
CUDA graphs segfaults on graph replay under memory pressure (use-after-free), April 2026.
Mechanism: to save memory, ``create_bwd_graph`` ends by replacing the forward graph's input surface with TE
weak references (raw-pointer tensors that own no storage), and #3970 kept strong references only to buffers of
the runner's ``TensorReusePool``, assuming every other surface tensor lives in the graph pool. But
``tree_map(_resolve_input_buffer, kwargs)`` rebuilds ``PackedSeqParams`` with ``dataclasses.replace``, whose
``__post_init__`` recomputes ``seq_idx`` (a ``repeat_interleave`` of the cu_seqlens buffer) as a fresh
caching-allocator tensor, neither pool- nor graph-owned, which the capture bakes into the Mamba conv kernel.
The weak-ref pass drops that tensor's last strong reference, so every replay copies the microbatch's
``seq_idx`` into, and reads it from, a freed block.
Doctor: dangling-reference, at ``causal_conv1d_fn`` (the captured conv kernel reading the freed ``seq_idx``).
Fix (upstream): weak-ref an input-surface tensor only when it is a graph-pool buffer (not owned by the reuse
pool and carrying ``can_skip_replay_copy``); every other tensor, the ``__post_init__`` ``seq_idx`` included,
keeps a strong reference.
"""

import dataclasses
import weakref
from dataclasses import dataclass, is_dataclass

import torch
from torch import Tensor
from torch.utils._pytree import tree_map as tree_map_pyt

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4162"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "causal_conv1d_fn"
SYMPTOM = "forward replay reads (and copies the new seq_idx into) a seq_idx block freed after capture"
TOKENS, DIM, D_CONV = 8, 4, 3
NUM_WARMUP_STEPS = 1


@dataclass
class PackedSeqParams:
    qkv_format: str = None
    cu_seqlens_q: Tensor = None
    max_seqlen_q: int = None
    total_tokens: int = None
    seq_idx: Tensor = None

    def __post_init__(self):
        """Pre-compute seq_idx for Mamba mixer CUDA graph compatibility: [0, 5, 7] with 8 tokens ->
        [[0, 0, 0, 0, 0, 1, 1, 2]]."""
        cu_seqlens = self.cu_seqlens_q
        if isinstance(cu_seqlens, Tensor) and self.total_tokens is not None:
            total = torch.tensor([self.total_tokens], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
            cu_seqlens_with_max = torch.cat([cu_seqlens, total])
            seq_lengths = (cu_seqlens_with_max[1:] - cu_seqlens_with_max[:-1]).clamp(min=0)
            self.seq_idx = torch.repeat_interleave(
                torch.arange(seq_lengths.numel(), device=cu_seqlens.device), seq_lengths
            ).to(torch.int32).unsqueeze(0)


def tree_map(func, tree):
    """Megatron's tree_map: pytorch's, but also recursing into dataclasses (via ``dataclasses.replace``)."""
    def wrapper(arg):
        if is_dataclass(arg) and not isinstance(arg, type):
            changes = {f.name: tree_map_pyt(func, getattr(arg, f.name)) for f in dataclasses.fields(arg)}
            return dataclasses.replace(arg, **changes)
        return func(arg)
    return tree_map_pyt(wrapper, tree)


class ArgMetadata:
    def __init__(self, arg):
        self.type = type(arg)
        if isinstance(arg, torch.Tensor):
            self.shape, self.dtype, self.device = arg.shape, arg.dtype, arg.device
            self.requires_grad = arg.requires_grad
        else:
            self.value = arg

    def zeros_like(self):
        return torch.zeros(*self.shape, dtype=self.dtype, device=self.device, requires_grad=self.requires_grad)


class TensorReusePool:
    """Buffers reused as graph inputs; keeps a strong reference to every buffer it created."""

    def __init__(self):
        self.tensor_strong_refs, self.tensor_strong_refs_dataptrs, self.pool = [], set(), []

    def owns(self, tensor):
        return tensor.data_ptr() in self.tensor_strong_refs_dataptrs

    def get(self, meta):
        for i, buf in enumerate(self.pool):
            if buf.shape == meta.shape and buf.dtype == meta.dtype:
                return self.pool.pop(i)
        out = meta.zeros_like()
        self.tensor_strong_refs.append(out)
        self.tensor_strong_refs_dataptrs.add(out.data_ptr())
        return out


class _WeakRefTensor:
    """TE's ``make_weak_ref`` on a CUDA tensor: a tensor at ``data_ptr()`` that owns no storage. The CPU
    stand-in tracks its referent weakly; a copy into it after the referent is gone is lost here (on the GPU it
    lands in the freed block, in whatever the allocator put there)."""

    def __init__(self, t):
        self._ref, self._ptr = weakref.ref(t), t.data_ptr()
        self.shape, self.dtype, self.requires_grad = t.shape, t.dtype, t.requires_grad

    def data_ptr(self):
        return self._ptr

    def copy_(self, src):
        t = self._ref()
        if t is not None:
            t.copy_(src)
        return self


def make_weak_ref(x):
    return _WeakRefTensor(x)


def causal_conv1d_fn(x, weight, seq_idx):
    """Depthwise causal conv over the packed tokens; taps never cross a document boundary (seq_idx)."""
    s = seq_idx[0]
    out = x * weight[-1]
    for k in range(1, weight.shape[0]):
        shifted = torch.cat([x.new_zeros(k, x.shape[1]), x[:-k]])
        same = torch.cat([s.new_full((k,), -1), s[:-k]]) == s
        out = out + shifted * weight[-1 - k] * same[:, None].to(x.dtype)
    return out


class MambaLayer(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(4162)
        self.in_proj = torch.nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=0.5))
        self.conv1d = torch.nn.Parameter(randn(D_CONV, DIM, gen=gen, device=device, scale=0.5))
        self.out_proj = torch.nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=0.5))

    def forward(self, hidden_states, packed_seq_params=None):
        x = causal_conv1d_fn(hidden_states @ self.in_proj, self.conv1d, seq_idx=packed_seq_params.seq_idx)
        return hidden_states + torch.nn.functional.silu(x) @ self.out_proj


class _CudaGraphRunner:
    """Megatron's local CUDA-graph runner for one layer: a forward and a backward graph in a shared pool."""

    def __init__(self, base_module, mempool, reuse_pool, device, variant):
        self.base_module, self.mempool, self.tensor_reuse_pool = base_module, mempool, reuse_pool
        self.device, self.variant = device, variant

    @staticmethod
    def get_tensors(args, kwargs):
        def extract(arg):
            if torch.is_tensor(arg):
                return [arg]
            if is_dataclass(arg):
                return [a for f in dataclasses.fields(arg) if torch.is_tensor(a := getattr(arg, f.name))]
            return []
        return tuple(t for a in list(args) + list(kwargs.values()) for t in extract(a))

    def record_graph_capture(self, args, kwargs):
        """First microbatch: run eagerly and record argument metadata."""
        self.args = tree_map(lambda a: ArgMetadata(a) if torch.is_tensor(a) else a, args)
        self.kwargs = tree_map(lambda a: ArgMetadata(a) if torch.is_tensor(a) else a, kwargs)
        return self.base_module(*args, **kwargs)

    def create_fwd_graph(self):
        def _resolve_input_buffer(ten):
            if not isinstance(ten, ArgMetadata):
                return ten
            buf = self.tensor_reuse_pool.get(ten).detach().requires_grad_(ten.requires_grad)
            buf.can_skip_replay_copy = False
            return buf

        self.fwd_graph_input_args = tree_map(_resolve_input_buffer, self.args)
        self.fwd_graph_input_kwargs = tree_map(_resolve_input_buffer, self.kwargs)   # __post_init__ runs here
        self.fwd_graph_input_surface = self.get_tensors(self.fwd_graph_input_args, self.fwd_graph_input_kwargs)
        events.static_buffers("Megatron _CudaGraphRunner", {
            "hidden_states": self.fwd_graph_input_surface[0],
            "packed_seq_params.cu_seqlens_q": self.fwd_graph_input_surface[1],
            "packed_seq_params.seq_idx": self.fwd_graph_input_surface[2]})
        for _ in range(NUM_WARMUP_STEPS):   # warm up on zero clones of the inputs
            with events.warmup():
                def clone_ten(ten):
                    return torch.zeros_like(ten).requires_grad_(ten.requires_grad) if torch.is_tensor(ten) else ten
                w_args = tree_map(clone_ten, self.fwd_graph_input_args)
                w_kwargs = tree_map(clone_ten, self.fwd_graph_input_kwargs)
                w_out = self.base_module(*w_args, **w_kwargs)
                torch.autograd.grad(w_out, (w_args[0],) + tuple(self.base_module.parameters()),
                                    torch.zeros_like(w_out))
        self.fwd_graph = new_graph(self.device)
        with graph(self.fwd_graph, pool=self.mempool, name="fwd"):
            self.fwd_graph_outputs = self.base_module(*self.fwd_graph_input_args, **self.fwd_graph_input_kwargs)

    def create_bwd_graph(self):
        self.params_to_backprop = tuple(self.base_module.parameters())
        self.static_grad_outputs = torch.zeros_like(self.fwd_graph_outputs)
        events.static_buffers("Megatron _CudaGraphRunner bwd", {"grad_output": self.static_grad_outputs})
        self.bwd_graph = new_graph(self.device)
        with graph(self.bwd_graph, pool=self.mempool, name="bwd"):
            self.static_grad_inputs = torch.autograd.grad(
                self.fwd_graph_outputs, (self.fwd_graph_input_surface[0],) + self.params_to_backprop,
                self.static_grad_outputs)

        # now weakref everything
        def replace_with_weak_ref(arg):
            if not torch.is_tensor(arg):
                return arg
            ref = make_weak_ref(arg)
            if hasattr(arg, "can_skip_replay_copy"):
                ref.can_skip_replay_copy = arg.can_skip_replay_copy
            return ref

        if self.variant == "bug":     # #3970: keep reuse-pool buffers, assume the rest is graph-pool memory
            def replace_with_weak_ref_for_input_surface(arg):
                if torch.is_tensor(arg) and self.tensor_reuse_pool.owns(arg):
                    return arg
                return replace_with_weak_ref(arg)
        else:                         # #4162: weak-ref only graph-pool buffers
            def replace_with_weak_ref_for_input_surface(arg):
                if not torch.is_tensor(arg):
                    return replace_with_weak_ref(arg)
                if not self.tensor_reuse_pool.owns(arg) and hasattr(arg, "can_skip_replay_copy"):
                    return replace_with_weak_ref(arg)
                return arg

        self.fwd_graph_input_surface = tree_map(replace_with_weak_ref_for_input_surface,
                                                self.fwd_graph_input_surface)
        self.fwd_graph_input_args = tree_map(replace_with_weak_ref, self.fwd_graph_input_args)
        self.fwd_graph_input_kwargs = tree_map(replace_with_weak_ref, self.fwd_graph_input_kwargs)
        del self.args, self.kwargs

    def replay_fwd(self, args, kwargs):
        """``_CudagraphReplayNode.forward``: copy new data into the fwd graph input buffers, replay."""
        with torch.no_grad():         # autograd.Function.forward runs without grad
            for user_input, cudagraph_input in zip(self.get_tensors(args, kwargs), self.fwd_graph_input_surface):
                if getattr(cudagraph_input, "can_skip_replay_copy", False):
                    continue
                if user_input.data_ptr() != cudagraph_input.data_ptr():
                    cudagraph_input.copy_(user_input)
            return replay(self.fwd_graph, self.fwd_graph_outputs).clone()

    def replay_bwd(self, grad_output):
        """``_CudagraphReplayNode.backward``: copy the incoming grad, replay the bwd graph."""
        with torch.no_grad():
            self.static_grad_outputs.copy_(grad_output)
            return tuple(g.clone() for g in replay(self.bwd_graph, self.static_grad_inputs))


def microbatches(device):
    """Packed microbatches: hidden states, cu_seqlens (2 documents, padded tail), upstream gradient."""
    gen = generator(41620)
    cus = [[0, 3, 7], [0, 5, 8], [0, 2, 6], [0, 4, 5]]
    return [(randn(TOKENS, DIM, gen=gen, device=device), torch.tensor(cu, dtype=torch.int32, device=device),
             randn(TOKENS, DIM, gen=gen, device=device)) for cu in cus]


def run(variant: str, device: str = "cpu"):
    data = microbatches(device)

    def step_eager(layer, h, cu, grad):
        h = h.clone().requires_grad_(True)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=TOKENS, total_tokens=TOKENS)
        out = layer(h, packed_seq_params=psp)
        return [out.detach()] + list(torch.autograd.grad(out, (h,) + tuple(layer.parameters()), grad))

    def eager():
        layer = MambaLayer(device)
        return [t for h, cu, grad in data for t in step_eager(layer, h, cu, grad)]

    def served():
        layer = MambaLayer(device)
        runner = _CudaGraphRunner(layer, graph_pool_handle(device), TensorReusePool(), device, variant)
        outs = []
        for i, (h, cu, grad) in enumerate(data):
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=TOKENS, total_tokens=TOKENS)
            hs = h.clone().requires_grad_(True)
            if i == 0:                                     # first pass records, then create_cudagraphs()
                out = runner.record_graph_capture((hs,), {"packed_seq_params": psp})
                outs += [out.detach()] + list(torch.autograd.grad(out, (hs,) + tuple(layer.parameters()), grad))
                runner.create_fwd_graph()
                runner.create_bwd_graph()
                continue
            outs.append(runner.replay_fwd((hs,), {"packed_seq_params": psp}))
            outs += list(runner.replay_bwd(grad))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
