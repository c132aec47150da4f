"""TE releases a model chunk's input-gradient buffer one layer too early: the next chunk's backward graph overwrites it mid-send.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/2018 ("[PyTorch] Fix cudagraph static_input and
static_grad_input reuse", commit 06947e87b).
Symptom: pipeline-parallel training with Megatron-Core and TE's ``make_graphed_callables`` using
``_reuse_graph_input_output_buffers`` (memory-saving buffer reuse), with several layers per model chunk:
the input gradient a stage sends to the previous pipeline stage can be overwritten by the next
microbatch's backward replay before the send has finished, so the previous stage back-propagates a wrong
gradient (TransformerEngine main, August 2025).
Mechanism: with ``_reuse_graph_input_output_buffers``, ``_make_graphed_callables`` weak-refs (gives back to
the graph pool) the static grad inputs of the previous backward graph once the next one is captured, assuming
that Megatron's send of a chunk's input gradient to the previous stage finishes before the end of the next
backward pass. It kept one ``previous_per_callable_bwd_idx`` across chunks, so with two layers per chunk the
grad input of a chunk's last backward graph (the one that is sent) was released right after the first layer
of the next chunk's backward had been captured. The second layer of that next backward pass was captured into
the released block, and its replay writes there while the earlier send is still in flight.
Doctor: overwritten-output, at ``recv_backward`` (the read, at the send's completion, of the handed-out
input gradient that a later backward replay has overwritten).
Fix (upstream): reset ``previous_per_callable_bwd_idx`` at the start of each chunk's backward (only grad
inputs consumed inside the chunk are released at once) and release the previous chunk's last grad input
only when the next chunk's backward capture is complete (``previous_chunk_last_callable_bwd_idx``, at
``l_no == 0``). The PR also keyed static-input reuse by input signature (not modelled here).
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/2018"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "recv_backward"
SYMPTOM = "the previous pipeline stage receives the next microbatch's input gradient instead of its own"
TOKENS, HIDDEN, NUM_MICROBATCHES, LAYERS_PER_CHUNK, NUM_WARMUP_ITERS = 4, 3, 3, 2, 1
# The last pipeline stage's 1F1B schedule (no warmup microbatches): fwd chunk 1, bwd chunk 1, ...
ORDER = [1, -1] * NUM_MICROBATCHES


class TransformerLayer(torch.nn.Module):
    """A layer of the stage (frozen weight: only the input gradient matters here)."""

    def __init__(self, seed, device):
        super().__init__()
        self.weight = torch.nn.Parameter(randn(HIDDEN, HIDDEN, gen=generator(seed), device=device, scale=0.7),
                                         requires_grad=False)

    def forward(self, hidden_states):
        return torch.tanh(hidden_states @ self.weight)


class _WeakRefTensor:
    """``make_weak_ref``: a tensor's address without ownership (the graph pool may hand the block on).
    On CUDA, as TE does, a raw pointer wrapped through ``__cuda_array_interface__``; on the CPU, a weak
    reference to the storage, which the emulated graph pool keeps alive while any graph uses it."""

    def __init__(self, t: torch.Tensor):
        self._meta = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.is_cuda:
            self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                             "typestr": "<f4", "version": 2}
        else:
            self._ref = StorageWeakRef(t.untyped_storage())

    def tensor(self) -> torch.Tensor:
        offset, shape, stride, dtype, device = self._meta
        if device.type == "cuda":
            return torch.as_tensor(self, device=device).view(dtype)
        storage = torch.UntypedStorage._new_with_weak_ptr(self._ref.cdata)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def make_weak_ref(x):
    if isinstance(x, torch.Tensor):
        return _WeakRefTensor(x)
    if isinstance(x, tuple):
        return tuple(make_weak_ref(t) for t in x)
    return x


def _strong(x):
    return x.tensor() if isinstance(x, _WeakRefTensor) else x


def _make_graphed_callables(callables, sample_args, *, device, _order, _num_layers_per_chunk, fixed):
    """TE's ``_make_graphed_callables`` with ``_order`` and ``_reuse_graph_input_output_buffers=True``
    (one model chunk per stage, no kwargs, no FP8)."""
    owner = "te.make_graphed_callables"
    num_model_chunks = max(_order)
    num_microbatches = len(_order) // num_model_chunks // 2
    _prefix_num_layers = [0]
    for m_chunk in range(num_model_chunks):
        _prefix_num_layers.append(_prefix_num_layers[-1] + _num_layers_per_chunk[m_chunk])

    # Reuse static inputs between microbatches whose forward and backward scopes do not overlap.
    fwd_sample_qs, consumed_sample_q, fwd_idx = {}, [], [0] * num_model_chunks
    for c_id in _order:
        m_chunk = abs(c_id) - 1
        if c_id > 0:
            start = _prefix_num_layers[m_chunk] * num_microbatches + fwd_idx[m_chunk] * _num_layers_per_chunk[m_chunk]
            fwd_sample_idx = [start + i for i in range(_num_layers_per_chunk[m_chunk])]
            fwd_sample_qs[m_chunk] = fwd_sample_qs.get(m_chunk, []) + fwd_sample_idx
            for per_callable_fwd_idx in fwd_sample_idx:
                if consumed_sample_q:
                    sample_args[per_callable_fwd_idx] = sample_args[consumed_sample_q.pop(0)]
            fwd_idx[m_chunk] += 1
        else:
            n = min(len(fwd_sample_qs[m_chunk]), _num_layers_per_chunk[m_chunk])
            consumed_sample_q += fwd_sample_qs[m_chunk][:n]
            fwd_sample_qs[m_chunk] = fwd_sample_qs[m_chunk][n:]

    unique = {id(a[0]): a[0] for a in sample_args}
    events.static_buffers(owner, {f"sample_args {i}": t for i, t in enumerate(unique.values())})
    per_callable_static_input_surfaces = [tuple(args) for args in sample_args]
    per_callable_func = [callables[_prefix_num_layers[0] + (i % _num_layers_per_chunk[0])]
                         for i in range(len(sample_args))]

    for func, args in zip(callables, sample_args):                     # warmup
        for _ in range(NUM_WARMUP_ITERS):
            with events.warmup():
                out = func(*args)
                torch.autograd.grad(out, tuple(args), grad_outputs=torch.zeros_like(out))

    mempool = graph_pool_handle(device)
    n = len(sample_args)
    fwd_graphs, bwd_graphs = [None] * n, [None] * n
    per_callable_static_outputs, per_callable_static_grad_outputs = [None] * n, [None] * n
    per_callable_static_grad_inputs = [None] * n
    fwd_idx, bwd_idx = [0] * num_model_chunks, [0] * num_model_chunks
    static_grad_outputs_dict = {}
    previous_per_callable_bwd_idx = None
    previous_chunk_last_callable_bwd_idx = None
    for c_id in _order:
        if c_id > 0:
            m_chunk = c_id - 1
            for l_no in range(_num_layers_per_chunk[m_chunk]):
                idx = _prefix_num_layers[m_chunk] * num_microbatches + fwd_idx[m_chunk] * _num_layers_per_chunk[m_chunk] + l_no
                func, args = per_callable_func[idx], sample_args[idx]
                fwd_graphs[idx], out = capture(lambda func=func, args=args: func(*args), device=device, pool=mempool,
                                               warmups=0, name=f"fwd {idx}", owner=owner)
                per_callable_static_outputs[idx] = (out,)
            fwd_idx[m_chunk] += 1
        else:
            m_chunk = -c_id - 1
            if fixed:
                previous_per_callable_bwd_idx = None
            for l_no in reversed(range(_num_layers_per_chunk[m_chunk])):
                idx = _prefix_num_layers[m_chunk] * num_microbatches + bwd_idx[m_chunk] * _num_layers_per_chunk[m_chunk] + l_no
                static_input_surface = per_callable_static_input_surfaces[idx]
                static_outputs = per_callable_static_outputs[idx]
                # grad outputs are only used within a backward: one static buffer per signature
                keys = tuple((o.shape, o.dtype, o.layout) for o in static_outputs)
                if keys not in static_grad_outputs_dict:
                    static_grad_outputs_dict[keys] = tuple(torch.zeros_like(o) for o in static_outputs)
                    events.static_buffers(owner, {f"static_grad_outputs {len(static_grad_outputs_dict)}":
                                                  static_grad_outputs_dict[keys][0]})
                static_grad_outputs = static_grad_outputs_dict[keys]
                bwd_graphs[idx] = new_graph(device)
                with graph(bwd_graphs[idx], pool=mempool, name=f"bwd {idx}"):
                    grad_inputs = torch.autograd.grad(static_outputs, static_input_surface,
                                                      grad_outputs=static_grad_outputs, only_inputs=True)
                per_callable_static_grad_outputs[idx] = static_grad_outputs
                per_callable_static_grad_inputs[idx] = tuple(grad_inputs)
                del grad_inputs

                # Weak ref the static outputs of the forward pass of this backward.
                per_callable_static_outputs[idx] = make_weak_ref(static_outputs)
                # Weak ref the static grad inputs of the previous backward pass (upstream note:
                # "After a backward pass, we assume Mcore will send the grad input to another pipeline
                # parallel rank and that the communication is finished before the end of the next
                # backward pass").
                if previous_per_callable_bwd_idx is not None:
                    prev = previous_per_callable_bwd_idx
                    per_callable_static_grad_inputs[prev] = make_weak_ref(per_callable_static_grad_inputs[prev])
                previous_per_callable_bwd_idx = idx
                if fixed and l_no == 0:      # the previous chunk's last grad input: only now
                    if previous_chunk_last_callable_bwd_idx is not None:
                        prev = previous_chunk_last_callable_bwd_idx
                        per_callable_static_grad_inputs[prev] = make_weak_ref(per_callable_static_grad_inputs[prev])
                    previous_chunk_last_callable_bwd_idx = idx
            bwd_idx[m_chunk] += 1

    def make_graphed_autograd_function(i):
        static_input_surface = per_callable_static_input_surfaces[i]

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                for dst, src in zip(static_input_surface, inputs):
                    if dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)
                outs = tuple(_strong(o) for o in per_callable_static_outputs[i])
                return tuple(o.detach() for o in replay(fwd_graphs[i], outs))

            @staticmethod
            def backward(ctx, *grads):
                for g, grad in zip(per_callable_static_grad_outputs[i], grads):
                    if g.data_ptr() != grad.data_ptr():
                        g.copy_(grad)
                static_grad_inputs = tuple(_strong(b) for b in per_callable_static_grad_inputs[i])
                return tuple(b.detach() for b in replay(bwd_graphs[i], static_grad_inputs))

        return lambda *args: Graphed.apply(*args)[0]

    return [make_graphed_autograd_function(i) for i in range(n)]


class P2P:
    """Megatron's send of a stage's input gradient to the previous stage: asynchronous, and (as TE
    assumes) complete before the end of the next backward pass on this rank."""

    def __init__(self):
        self.in_flight = []
        self.received = []

    def send_backward(self, input_tensor_grad):
        self.in_flight.append(input_tensor_grad)

    def wait(self, keep_last: int):
        while len(self.in_flight) > keep_last:
            recv_backward(self, self.in_flight.pop(0))


def recv_backward(p2p, tensor):
    """The previous stage receives the bytes of the sent tensor when the send completes."""
    p2p.received.append(tensor.clone())


def run(variant: str, device: str = "cpu"):
    gen = generator(2018)
    activations = [randn(TOKENS, HIDDEN, gen=gen, device=device) for _ in range(NUM_MICROBATCHES)]
    targets = [randn(TOKENS, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(NUM_MICROBATCHES)]

    def train(graphed: bool):
        layers = [TransformerLayer(10 + l, device) for l in range(LAYERS_PER_CHUNK)]
        if graphed:
            sample_args = [(torch.zeros(TOKENS, HIDDEN, device=device, requires_grad=True),)
                           for _ in range(LAYERS_PER_CHUNK * NUM_MICROBATCHES)]
            graphed_callables = _make_graphed_callables(layers, sample_args, device=device, _order=ORDER,
                                                        _num_layers_per_chunk=[LAYERS_PER_CHUNK],
                                                        fixed=(variant == "fix"))
        p2p, losses = P2P(), []
        for mb in range(NUM_MICROBATCHES):                      # 1F1B steady state of the last stage
            input_tensor = activations[mb].clone().requires_grad_()          # recv_forward
            hidden = input_tensor
            for l_no in range(LAYERS_PER_CHUNK):
                fn = graphed_callables[mb * LAYERS_PER_CHUNK + l_no] if graphed else layers[l_no]
                hidden = fn(hidden)
            loss = 0.5 * ((hidden - targets[mb]) ** 2).sum()
            losses.append(loss.detach().clone())
            torch.autograd.backward(loss)                                    # backward_step
            p2p.send_backward(input_tensor.grad)
            p2p.wait(keep_last=1)          # the previous microbatch's send completes by now
        p2p.wait(keep_last=0)
        return losses + p2p.received

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
