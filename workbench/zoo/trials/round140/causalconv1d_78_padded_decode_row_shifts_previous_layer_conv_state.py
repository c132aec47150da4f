"""``causal_conv1d_update`` does not skip padded decode rows (``conv_state_indices == -1``): a padded row of a CUDA
graph captured for more requests shifts and overwrites the convolution state of a live request. Megatron-LM's hybrid
dynamic inference pads a decode-only batch to a captured graph size and marks the padded rows with ``-1`` in
``MambaMetadata.request_to_mamba_state_idx_cudagraph_only``; ``MambaMixer.ssm_decode`` hands that tensor to
``causal_conv1d_update`` as ``conv_state_indices``. Before causal-conv1d #78 the CUDA kernel took ``-1`` as a batch
coordinate like any other: its pointer ``conv_state_ptr + (-1) * conv_state_batch_stride`` lands on the entry just
before the layer's view of ``mamba_conv_states`` -- the *previous* Mamba layer's last request slot, which
``allocate_slot`` hands out first. The padded row shifts that window left and appends its own ``xBC`` (computed from
whatever the padded token row of the static input still holds), so that request's next decode step convolves over a
corrupted window and its tokens diverge from the unpadded run. The fix returns early for ``conv_state_batch_coord <
0`` after storing zeros to the row's output.

Upstream: https://github.com/Dao-AILab/causal-conv1d/pull/78 ("Support padding tokens", repository
Dao-AILab/causal-conv1d, author Keshav Santhanam (santhnm2), opened 2025-09-12, merged 2025-10-08 as commit d87608f;
first released in tag v1.5.3.post1). Read, in a mirror of the repository: the whole diff of d87608f
(``csrc/causal_conv1d_update.cu``: ``causal_conv1d_update_kernel`` computes ``out`` before the state pointer and
``if (conv_state_batch_coord < 0) { out[i * out_l_stride] = 0 for every i; return; }``; ``csrc/causal_conv1d_fwd.cu``:
``causal_conv1d_channellast_fwd_kernel`` sets ``out_vals[i] = 0`` and skips tokens with ``seq_idx < 0``; the new tests
``test_causal_conv1d_update_with_padding`` -- padded rows' outputs exactly 0, ``conv_state`` untouched outside the
valid rows -- and ``test_causal_conv1d_varlen_padding``); the pre-fix ``causal_conv1d_update.cu`` whole (the
non-circular path: shift the window left by ``seqlen``, append ``x``, convolve the last ``width`` values, SiLU);
``csrc/causal_conv1d.cpp`` ``causal_conv1d_update`` (checks dtype, contiguity and shape of ``conv_state_indices``,
never its sign); ``causal_conv1d/causal_conv1d_interface.py`` ``causal_conv1d_update`` and
``causal_conv1d_update_ref``. The PR description in the stored corpus ("Skips padding tokens in
``causal_conv1d_update_kernel`` and ``causal_conv1d_channellast_fwd_kernel``, where padding tokens are defined as
having ``seq_idx < 0`` or ``conv_state_indices < 0``. This is to ensure shapes do not have to change when using CUDA
graphs with padding.") and the opening of the same author's issue state-spaces/mamba#783 (addressed by the sibling
PR mamba#792). The consumer,
in a mirror of NVIDIA/Megatron-LM at e07c4a4450 ("Add hybrid model support for dynamic inference engine (#1907)", same
author, 2025-11-07, the first revision with hybrid dynamic inference): ``megatron/core/utils.py``
``check_mamba_sequence_packing_support`` (requires causal_conv1d >= 1.5.3.post1, the first release with this fix, and
mamba_ssm >= 2.2.6.post3), ``MambaMetadata`` whole (``request_to_mamba_state_idx_cudagraph_only`` filled with -1,
``reset_cudagraph_mapping``, ``update_cudagraph_mapping``, ``allocate_slot`` popping the last free slot),
``MambaMixer.dynamic_inference`` (decode-only fast path: ``batch_indices = ...cudagraph_only[:
context.padded_active_token_count]``), ``decode`` and ``ssm_decode`` (``causal_conv1d_update(xBC, conv_state,
weight, bias, activation, conv_state_indices=batch_indices)``, then ``selective_state_update(...,
state_batch_indices=batch_indices)``), and in ``DynamicInferenceContext`` ``mamba_conv_states`` (``(num_mamba_layers,
max_requests) + (conv_dim, d_conv)``), ``mamba_states_cache``, ``reset_attention_state`` and the padding in
``initialize_attention_state`` (``padded_active_token_count`` rounded up to a captured size; the Mamba mapping updated
for decode-only steps).
Not read: the discussion of PR #78 beyond its description, issue #783 beyond its opening and its test script,
Megatron's per-layer ``CudaGraphManager`` capture of ``MambaLayer`` and its engine's warmup loop
(``create_cuda_graphs``), and the varlen-prefill half of the fix (``seq_idx < 0`` in the channel-last forward), which
is not modelled.
Symptom: the PR states only the goal (static shapes under CUDA graphs with padding); issue #783 reports, for the
varlen side, that "the outputs of the non-padded tokens are affected by the padded tokens". What the missing skip does
in the decode kernel is read from the code (a guess about what users saw, not a quote): a padded decode batch of a
hybrid Mamba model corrupts the convolution window of the request in the previous layer's last slot (or writes before
the state buffer for layer 0), and that request's generation diverges from the unpadded run.
Mechanism: the decode graph is captured for ``DECODE_GRAPH_SIZE`` rows and replayed for fewer requests; the padded
rows' ``conv_state_indices`` are ``-1``. ``causal_conv1d_update``'s kernel moves its pointer to ``conv_state_ptr +
coord * conv_state_batch_stride`` of the allocation the layer's ``conv_state`` is a view of. For layer ``l >= 1`` that
is the entry of layer ``l - 1``, slot ``max_requests - 1``: the padded row reads that window, shifts it left by one,
writes its ``xBC`` into the last column (every layer ``l - 1`` has already run this step, so the damage shows at the
next step). The SSM update is not at fault here: ``selective_state_update`` skips ``-1`` rows (mamba #792, which
Megatron requires).
Doctor: stale-padding, at ``causal_conv1d_update``: a real request's conv state (persistent state) depends on what the
padded rows hold -- the padded row's write through its ``-1`` coordinate lands in an entry a live request owns. The
kernel is where the defect is decided and what the fix changes (the early return for a negative coordinate).
Fix (upstream): in ``causal_conv1d_update_kernel``, ``if (conv_state_batch_coord < 0)`` store zeros to the row's
``out`` and return before touching ``conv_state``.
Modelled: causal-conv1d's ``causal_conv1d_update`` (the kernel's non-circular path and its pointer arithmetic on the
allocation, ``skip_padding`` being the fix); mamba_ssm's ``selective_state_update`` (with #792's skip, both variants);
Megatron's ``MambaMetadata`` (``request_to_mamba_state_idx``, ``request_to_mamba_state_idx_cudagraph_only``,
``reset_cudagraph_mapping``, ``update_cudagraph_mapping``, ``allocate_slot``, ``free_slots``),
``DynamicInferenceContext`` (``mamba_conv_states``, ``mamba_ssm_states``, ``mamba_states_cache``,
``padded_active_token_count``, ``token_to_input_ids``, ``reset_attention_state``), ``MambaMixer``
(``dynamic_inference``, ``decode``, ``ssm_decode``), ``MambaLayer`` and ``DynamicInferenceEngine``
(``create_cuda_graphs``, ``add_request``, ``step``).
Stand-ins: two Mamba2 layers (d_model 8, 2 heads of 2, d_state 2, one group, d_conv 4, conv_dim 8) without the
``z`` gate and gated norm, float64; prompts are fed one token at a time through the decode kernel (upstream prefill
uses ``causal_conv1d_varlen_states`` and the chunked scan; both leave the same per-slot state); one graph for both
layers' decode step (upstream: one per ``MambaLayer``); ``conv_state`` entries outside the allocation (layer 0's
padded rows on the GPU) are read as zeros and not written -- that memory is not modelled; when several padded rows
write one entry, the first row's value is kept (on the GPU: a race). Products are written as broadcast sums
(``linear``) and transcendental functions row by row (``per_row``), so that a row's numbers do not depend on
whether the batch has 3 or 4 rows (CPU BLAS blocking and vector-math tails would move the last bit). The
reference run decodes exactly the real rows: Megatron's eager decode-only step also rounds its token count up
(``round_up_tokens``, capped at ``max_requests``), so with this pre-fix kernel its eager steps would have padded
rows too; the model follows the PR's motivation (graph padding) and takes the unpadded run as what padding must
not change.
Workload: three requests (slots 3, 2, 1) prefilled, three decode steps padded from 3 to 4 rows, the third request
finishes and a fourth takes its slot, two more padded steps; teacher-forced tokens. Outputs: the prefill logits and
every decode step's logits.
Measured: bug: misbehaves (max |graph - eager| = 9.76): after the first padded step only layer 0's conv state of slot
3 (the first request's) differs from the unpadded run (layer 1's padded row shifted it); from the second decode step
on, that request's logits diverge (9.10, 1.19, then 5.79 and 9.76 after the fourth request joins) while the other
requests' match. Fix: equals eager (max |graph - eager| = 0). About 1.5 s per variant on the CPU.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Dao-AILab/causal-conv1d/pull/78"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "causal_conv1d_update"
SYMPTOM = ("a padded decode row (conv_state_indices -1) shifts the previous layer's conv state of the first "
           "request's slot; that request's tokens diverge from the unpadded run")

VOCAB, D_MODEL = 16, 8
NHEADS, HEADDIM, DSTATE, NGROUPS, D_CONV = 2, 2, 2, 1, 4
D_INNER = NHEADS * HEADDIM
CONV_DIM = D_INNER + 2 * NGROUPS * DSTATE
NUM_MAMBA_LAYERS, MAX_REQUESTS = 2, 4
DECODE_GRAPH_SIZE = 4


def per_row(fn, t):
    """``fn`` applied to each batch row on its own, as one kernel program per row computes it: CPU vector math
    rounds a tensor's tail differently from its body, so ``exp`` over 3 rows and over 4 would move a row's last bit
    and the unpadded run would differ from the padded one for no reason of the graph's."""
    return torch.stack([fn(t[i]) for i in range(t.shape[0])])


def _rows_of_allocation(view):
    """The allocation ``view`` is a leading-dim slice of, one entry (``view.stride(0)`` elements) per row, and the
    row of ``view[0]`` in it: what a kernel's ``ptr + coord * batch_stride`` addresses."""
    base = view if view._base is None else view._base
    per_entry = view.stride(0)
    rows = base.view(-1, per_entry)
    first = (view.storage_offset() - base.storage_offset()) // per_entry
    return rows, first, per_entry


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, *, skip_padding=False):
    """``causal_conv1d.causal_conv1d_update`` for ``x`` of ``(batch, dim)`` (one token), as its CUDA kernel runs it
    (the non-circular path, ``cache_seqlens is None``): batch row ``b`` works on the conv state at ``conv_state_ptr +
    conv_state_indices[b] * conv_state_batch_stride``, shifts it left by one, appends ``x[b]`` and convolves the last
    ``width`` values. ``skip_padding``: #78's early return for ``conv_state_batch_coord < 0`` (output 0, state
    untouched)."""
    assert cache_seqlens is None, "only the non-circular conv state is modelled"
    batch, dim = x.shape
    state_len, width = conv_state.shape[-1], weight.shape[-1]
    rows, first, per_entry = _rows_of_allocation(conv_state)
    coord = (torch.arange(batch, device=x.device) if conv_state_indices is None
             else conv_state_indices.long())
    target = first + coord                                   # conv_state_ptr + coord * conv_state_batch_stride
    inside = (target >= 0) & (target < rows.shape[0])         # outside the allocation: not modelled (zeros, no store)
    padding = coord < 0
    window = rows[target.clamp(0, rows.shape[0] - 1)].view(batch, dim, state_len)
    window = torch.where(inside[:, None, None], window, torch.zeros_like(window))
    x_new = torch.cat([window, x[:, :, None].to(window.dtype)], dim=-1)   # (batch, dim, state_len + 1)
    new_state = x_new[:, :, -state_len:]                       # the kernel's shift-and-append, stored back
    out = (x_new[:, :, -width:] * weight[None]).sum(-1)
    if bias is not None:
        out = out + bias
    if activation in ("silu", "swish"):
        out = out * per_row(torch.sigmoid, out)
    write = inside & ~padding if skip_padding else inside
    if skip_padding:
        out = torch.where(padding[:, None], torch.zeros_like(out), out)   # out[i * out_l_stride] = 0; return
    # the kernel's stores through its pointer: entry ``target[b]`` takes row b's window where ``write[b]`` (an entry
    # several rows write keeps the first one's value; on the GPU, whichever program stores last)
    writer = (target[:, None] == torch.arange(rows.shape[0], device=x.device)[None, :]) & write[:, None]
    src = writer.to(torch.int32).argmax(0)
    rows.copy_(torch.where(writer.any(0)[:, None], new_state.reshape(batch, per_entry)[src], rows))
    return out


def selective_state_update(state, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """``mamba_ssm.ops.triton.selective_state_update`` for one group, with mamba #792's skip of rows whose
    ``state_batch_indices`` is negative (Megatron requires mamba_ssm >= 2.2.6.post3, which has it)."""
    batch = x.shape[0]
    idx = state_batch_indices.long()
    valid = idx >= 0
    old = state[idx.clamp(min=0)]                              # (batch, nheads, headdim, dstate)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = torch.where(dt <= 20.0, per_row(torch.nn.functional.softplus, dt), dt)
    dA = per_row(torch.exp, A[None] * dt[..., None])
    new = old * dA + (dt * x)[..., None] * B[:, None, None, :]
    out = (new * C[:, None, None, :]).sum(-1)
    if D is not None:
        out = out + x * D
    out = torch.where(valid[:, None, None], out, torch.zeros_like(out))
    rows, first, per_entry = _rows_of_allocation(state)
    writer = ((first + idx)[:, None] == torch.arange(rows.shape[0], device=x.device)[None, :]) & valid[:, None]
    src = writer.to(torch.int32).argmax(0)
    rows.copy_(torch.where(writer.any(0)[:, None], new.reshape(batch, per_entry)[src], rows))
    return out


def rms_norm(x, eps=1e-5):
    return per_row(lambda r: r * torch.rsqrt((r * r).mean(-1, keepdim=True) + eps), x)


def linear(x, w):
    """``x @ w`` as a broadcast product and a sum: a row's result does not depend on how many rows the batch has
    (CPU BLAS blocks a 4-row and a 3-row product differently, which moves the last bit)."""
    return (x[:, :, None] * w[None]).sum(1)


class MambaMetadata:
    """Megatron's slot allocator and the CUDA-graph mapping (``-1`` for rows no request owns)."""

    def __init__(self, max_requests, device):
        self.max_requests = max_requests
        self.request_to_mamba_state_idx = torch.full((max_requests,), -1, dtype=torch.int32, device=device)
        self.request_to_mamba_state_idx_cudagraph_only = torch.full((max_requests,), -1, dtype=torch.int32,
                                                                    device=device)
        self.mamba_state_free_slots = list(range(max_requests))

    def reset_cudagraph_mapping(self):
        self.request_to_mamba_state_idx_cudagraph_only.fill_(-1)

    def update_cudagraph_mapping(self, active_mamba_indices, num_active_requests):
        self.request_to_mamba_state_idx_cudagraph_only[0:num_active_requests] = active_mamba_indices

    def allocate_slot(self):
        return self.mamba_state_free_slots.pop()               # the last free slot first

    def free_slots(self, slot):
        self.mamba_state_free_slots.append(slot)


class DynamicInferenceContext:
    def __init__(self, device):
        self.mamba_metadata = MambaMetadata(MAX_REQUESTS, device)
        self.mamba_conv_states = torch.zeros((NUM_MAMBA_LAYERS, MAX_REQUESTS, CONV_DIM, D_CONV),
                                             dtype=torch.float64, device=device)
        self.mamba_ssm_states = torch.zeros((NUM_MAMBA_LAYERS, MAX_REQUESTS, NHEADS, HEADDIM, DSTATE),
                                            dtype=torch.float64, device=device)
        self.token_to_input_ids = torch.zeros(MAX_REQUESTS, dtype=torch.long, device=device)
        self.padded_active_token_count = 0

    def mamba_states_cache(self, mamba_layer_number):
        return self.mamba_conv_states[mamba_layer_number], self.mamba_ssm_states[mamba_layer_number]

    def reset_attention_state(self):
        """After each step: the Mamba CUDA-graph mapping goes back to ``-1``."""
        self.mamba_metadata.reset_cudagraph_mapping()


class MambaMixer:
    def __init__(self, layer_number, gen, device, variant):
        self.layer_number, self.variant = layer_number, variant
        self.in_proj = randn(D_MODEL, CONV_DIM + NHEADS, gen=gen, device=device, scale=0.6).double()
        self.conv1d_weight = randn(CONV_DIM, D_CONV, gen=gen, device=device, scale=0.7).double()
        self.conv1d_bias = randn(CONV_DIM, gen=gen, device=device, scale=0.3).double()
        self.A_log = randn(NHEADS, gen=gen, device=device, scale=0.3).double()
        self.D = randn(NHEADS, gen=gen, device=device, scale=0.5).double()
        self.dt_bias = randn(NHEADS, gen=gen, device=device, scale=0.5).double()
        self.out_proj = randn(D_INNER, D_MODEL, gen=gen, device=device, scale=0.6).double()

    def dynamic_inference(self, hidden_states, context):
        """The decode-only fast path: the CUDA-graph mapping, padded rows included."""
        conv_state, ssm_state = context.mamba_states_cache(self.layer_number)
        batch_indices = context.mamba_metadata.request_to_mamba_state_idx_cudagraph_only[
            : context.padded_active_token_count]
        return self.decode(hidden_states, conv_state, ssm_state, batch_indices=batch_indices)

    def decode(self, hidden_states, conv_state, ssm_state, batch_indices):
        zxBCdt = linear(hidden_states, self.in_proj)
        return linear(self.ssm_decode(zxBCdt, conv_state, ssm_state, batch_indices), self.out_proj)

    def ssm_decode(self, zxBCdt, conv_state, ssm_state, batch_indices):
        b = zxBCdt.shape[0]
        xBC, dt = torch.split(zxBCdt, [CONV_DIM, NHEADS], dim=-1)
        xBC = causal_conv1d_update(xBC, conv_state, self.conv1d_weight, self.conv1d_bias, "silu",
                                   conv_state_indices=batch_indices, skip_padding=self.variant == "fix")
        x, B, C = torch.split(xBC, [D_INNER, NGROUPS * DSTATE, NGROUPS * DSTATE], dim=-1)
        A = -torch.exp(self.A_log)[:, None, None].expand(NHEADS, HEADDIM, DSTATE)
        y = selective_state_update(
            ssm_state, x.reshape(b, NHEADS, HEADDIM), dt[:, :, None].expand(b, NHEADS, HEADDIM), A, B, C,
            D=self.D[:, None].expand(NHEADS, HEADDIM), dt_bias=self.dt_bias[:, None].expand(NHEADS, HEADDIM),
            dt_softplus=True, state_batch_indices=batch_indices)
        return y.reshape(b, D_INNER)


class MambaLayer:
    def __init__(self, layer_number, gen, device, variant):
        self.mixer = MambaMixer(layer_number, gen, device, variant)

    def __call__(self, hidden_states, context):
        return hidden_states + self.mixer.dynamic_inference(rms_norm(hidden_states), context)


class MambaModel:
    def __init__(self, device, variant):
        gen = generator(78)
        self.embedding = randn(VOCAB, D_MODEL, gen=gen, device=device).double()
        self.layers = [MambaLayer(i, gen, device, variant) for i in range(NUM_MAMBA_LAYERS)]
        self.output_layer = randn(D_MODEL, VOCAB, gen=gen, device=device).double()

    def forward(self, input_ids, context):
        hidden = self.embedding[input_ids]
        for layer in self.layers:
            hidden = layer(hidden, context)
        return linear(rms_norm(hidden), self.output_layer)


class DynamicInferenceEngine:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.model = MambaModel(device, variant)
        self.context = DynamicInferenceContext(device)
        if graphed:
            self.create_cuda_graphs()

    def create_cuda_graphs(self):
        """At startup, before any request: the dummy batch's mapping is all ``-1``."""
        ctx = self.context
        ctx.padded_active_token_count = DECODE_GRAPH_SIZE
        self.graph, self.logits = capture(
            lambda: self.model.forward(ctx.token_to_input_ids[:DECODE_GRAPH_SIZE], ctx),
            device=self.device, owner="DynamicInferenceEngine (decode graph)",
            static={"token_to_input_ids": ctx.token_to_input_ids,
                    "request_to_mamba_state_idx_cudagraph_only":
                        ctx.mamba_metadata.request_to_mamba_state_idx_cudagraph_only},
            state={"mamba_conv_states": ctx.mamba_conv_states, "mamba_ssm_states": ctx.mamba_ssm_states})

    def add_request(self, req):
        """Slot allocation and an eager prefill (one token at a time through the same kernels, real index only)."""
        ctx = self.context
        req["slot"] = ctx.mamba_metadata.allocate_slot()
        ctx.mamba_metadata.request_to_mamba_state_idx[req["slot"]] = req["slot"]
        ctx.mamba_conv_states[:, req["slot"]] = 0.0
        ctx.mamba_ssm_states[:, req["slot"]] = 0.0
        index = torch.tensor([req["slot"]], dtype=torch.int32, device=self.device)
        for token in req["prompt"]:
            hidden = self.model.embedding[torch.tensor([token], device=self.device)]
            for layer in self.model.layers:
                conv_state, ssm_state = ctx.mamba_states_cache(layer.mixer.layer_number)
                hidden = hidden + layer.mixer.decode(rms_norm(hidden), conv_state, ssm_state, index)
            logits = linear(rms_norm(hidden), self.model.output_layer)
        return logits.clone()

    def finish(self, req):
        self.context.mamba_metadata.request_to_mamba_state_idx[req["slot"]] = -1
        self.context.mamba_metadata.free_slots(req["slot"])

    def step(self, reqs):
        ctx, n = self.context, len(reqs)
        ids = torch.tensor([r["script"].pop(0) for r in reqs], dtype=torch.long, device=self.device)
        ctx.token_to_input_ids[:n].copy_(ids)
        slots = torch.tensor([r["slot"] for r in reqs], dtype=torch.int32, device=self.device)
        ctx.mamba_metadata.update_cudagraph_mapping(slots, n)
        if self.graphed:
            ctx.padded_active_token_count = DECODE_GRAPH_SIZE
            out = replay(self.graph, self.logits, real=n, size=DECODE_GRAPH_SIZE,
                         padded={"token_to_input_ids": ctx.token_to_input_ids})  # padded ids: an earlier step's
            out = out[:n].clone()
        else:
            ctx.padded_active_token_count = n
            out = self.model.forward(ctx.token_to_input_ids[:n], ctx).clone()
        ctx.reset_attention_state()
        return out


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        engine = DynamicInferenceEngine(device, variant, graphed)
        a = {"prompt": [3, 7, 1], "script": [5, 9, 2, 8, 6]}
        b = {"prompt": [4, 4], "script": [1, 0, 13, 7, 2]}
        c = {"prompt": [12, 5, 9, 9], "script": [11, 3, 10]}
        d = {"prompt": [6, 14], "script": [15, 2]}
        outs = [engine.add_request(r) for r in (a, b, c)]     # slots 3, 2, 1
        outs += [engine.step([a, b, c]) for _ in range(3)]    # 3 requests padded to the 4-row graph
        engine.finish(c)                                       # c finishes; d takes its slot
        outs.append(engine.add_request(d))
        outs += [engine.step([a, b, d]) for _ in range(2)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
