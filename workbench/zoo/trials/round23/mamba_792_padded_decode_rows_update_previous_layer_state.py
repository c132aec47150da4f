"""``selective_state_update`` does not skip padded rows (``state_batch_indices == -1``): they update a live state.

Upstream: https://github.com/state-spaces/mamba/pull/792 ("Skip padding tokens", addresses state-spaces/mamba#783),
merged Oct 2025. The padding comes from the caller's decode CUDA graph, as in Megatron-LM's dynamic inference:
``MambaMetadata.update`` fills the padded tail of ``_batch_indices_decode_buffer`` with ``-1`` when a graph captured
for more requests replays a smaller batch.
Symptom: the PR states only the goal ("to ensure shapes do not have to change when using CUDA graphs with padding";
issue #783 not read). What the missing skip does, from the kernel: a padded decode batch of a hybrid Mamba model
corrupts the SSM state of a live request (or faults, when the row lands outside the state buffer), so its
generation diverges from the unpadded eager run.
Mechanism (from the diff): ``_selective_scan_update_kernel`` loads ``state_batch_idx`` for its batch row and moves
its pointer to ``state_ptr + state_batch_idx * stride_state_batch`` before loading, updating and storing the state.
The ``state`` it is given is one layer's view of the context's ``mamba_ssm_states`` (``[num_mamba_layers,
max_requests, nheads, headdim, dstate]``), so a padded row (``-1``) of layer ``l`` reads and overwrites the state of
layer ``l - 1``'s *last* request slot -- the first slot ``MambaMetadata.allocate_slot`` hands out -- with an update
computed from the padded row's own inputs (what the graph's static input rows still hold). That request's next
decode step reads the corrupted state. (Layer 0's padded rows land before the buffer; that memory is not modelled.)
Doctor: stale-padding, at ``selective_state_update`` (the kernel writes through the padded rows' state index, so a
real request's state depends on what the padded rows hold).
Fix (upstream): the kernel returns early for ``state_batch_idx < 0``, after storing zeros to the row's output;
``_chunk_state_fwd_kernel`` likewise masks chunks whose last ``seq_idx`` is negative (the prefill side, not modelled).
Simplified here: two Mamba2 mixers without convolution or gating, prompts fed token by token through the same
kernel (upstream prefill uses the chunked scan), one decode graph of 4 rows, teacher-forced tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/state-spaces/mamba/pull/792"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "selective_state_update"
SYMPTOM = "a padded decode row updates the first request's SSM state of the previous layer; its tokens diverge"

VOCAB, D_MODEL, NHEADS, HEADDIM, DSTATE, NGROUPS = 16, 4, 2, 2, 2, 1
NUM_MAMBA_LAYERS, MAX_REQUESTS = 2, 4
DECODE_GRAPH_SIZE = 4


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, *, skip_padding=False):
    """``mamba_ssm.ops.triton.selective_state_update`` with its kernel's pointer arithmetic kept: batch row ``b``
    loads and stores the state at ``state_ptr + state_batch_indices[b] * state.stride(0)`` of the allocation
    ``state`` is a view of. ``skip_padding``: the early return #792 added for ``state_batch_idx < 0``."""
    batch = x.shape[0]
    base = state if state._base is None else state._base
    per_row = state.stride(0)
    rows = base.view(-1, per_row)                          # the allocation, one state per row
    row0 = (state.storage_offset() - base.storage_offset()) // per_row
    idx = state_batch_indices.long()
    row_ids = row0 + idx
    inside = (row_ids >= 0) & (row_ids < rows.shape[0])   # outside the allocation: not modelled
    padding = idx < 0
    old = rows[row_ids.clamp(0, rows.shape[0] - 1)].view(batch, *state.shape[1:])
    old = torch.where(inside[:, None, None, None], old, torch.zeros_like(old))
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    dA = torch.exp(A * dt[..., None])
    group = torch.arange(NHEADS, device=x.device) // (NHEADS // NGROUPS)
    dB = B[:, group][:, :, None, :] * dt[..., None]
    new = old * dA + dB * x[..., None]
    out = (new * C[:, group][:, :, None, :]).sum(-1)
    if D is not None:
        out = out + x * D
    write = inside & ~padding if skip_padding else inside
    if skip_padding:
        out = torch.where(padding[:, None, None], torch.zeros_like(out), out)   # tl.store(out_ptrs, 0.0)
    # tl.store(state_ptrs, state): each row of the allocation takes the value of the program that writes it
    writer = (row_ids[:, None] == torch.arange(rows.shape[0], device=x.device)[None, :]) & write[:, None]
    src = writer.to(torch.int32).argmax(0)
    rows.copy_(torch.where(writer.any(0)[:, None], new.reshape(batch, per_row)[src], rows))
    return out


def rms_norm(x, eps=1e-5):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


class MambaMetadata:
    def __init__(self, max_requests, device):
        self.max_requests = max_requests
        self._batch_indices_decode_buffer = torch.full((max_requests,), -1, dtype=torch.int32, device=device)
        self.mamba_state_free_slots = list(range(max_requests))
        self.batch_indices_decode = None

    def allocate_slot(self):
        return self.mamba_state_free_slots.pop()           # the last free slot first

    def free_slot(self, slot):
        self.mamba_state_free_slots.append(slot)

    def update(self, active_mamba_indices, real_decode_count, padded_decode_count):
        self._batch_indices_decode_buffer[:real_decode_count].copy_(active_mamba_indices[:real_decode_count])
        if padded_decode_count > real_decode_count:
            self._batch_indices_decode_buffer[real_decode_count:padded_decode_count] = -1
        self.batch_indices_decode = self._batch_indices_decode_buffer[:padded_decode_count]


class DynamicInferenceContext:
    def __init__(self, device):
        self.mamba_metadata = MambaMetadata(MAX_REQUESTS, device)
        self.mamba_ssm_states = torch.zeros((NUM_MAMBA_LAYERS, MAX_REQUESTS, NHEADS, HEADDIM, DSTATE), device=device)


class MambaMixer:
    def __init__(self, layer_number, gen, device, variant):
        self.layer_number, self.variant = layer_number, variant
        width = NHEADS * HEADDIM + 2 * NGROUPS * DSTATE + NHEADS
        self.in_proj = randn(D_MODEL, width, gen=gen, device=device, scale=0.6)
        self.out_proj = randn(NHEADS * HEADDIM, D_MODEL, gen=gen, device=device, scale=0.6)
        self.A_log = randn(NHEADS, gen=gen, device=device, scale=0.3)
        self.D = randn(NHEADS, gen=gen, device=device, scale=0.5)
        self.dt_bias = randn(NHEADS, gen=gen, device=device, scale=0.5)

    def decode(self, hidden, context, batch_indices):
        b = hidden.shape[0]
        xBCdt = rms_norm(hidden) @ self.in_proj            # the layer's pre-norm, then in_proj
        x, B, C, dt = torch.split(xBCdt, [NHEADS * HEADDIM, NGROUPS * DSTATE, NGROUPS * DSTATE, NHEADS], -1)
        A = -torch.exp(self.A_log)[:, None, None].expand(NHEADS, HEADDIM, DSTATE)
        y = selective_state_update(
            context.mamba_ssm_states[self.layer_number], x.reshape(b, NHEADS, HEADDIM),
            dt[:, :, None].expand(b, NHEADS, HEADDIM), A, B.reshape(b, NGROUPS, DSTATE),
            C.reshape(b, NGROUPS, DSTATE), D=self.D[:, None].expand(NHEADS, HEADDIM),
            dt_bias=self.dt_bias[:, None].expand(NHEADS, HEADDIM), dt_softplus=True,
            state_batch_indices=batch_indices, skip_padding=self.variant == "fix")
        return hidden + y.reshape(b, -1) @ self.out_proj


class MambaModel:
    def __init__(self, device, variant):
        gen = generator(792)
        self.embedding = randn(VOCAB, D_MODEL, gen=gen, device=device)
        self.layers = [MambaMixer(i, gen, device, variant) for i in range(NUM_MAMBA_LAYERS)]
        self.output_layer = randn(D_MODEL, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, context, batch_indices):
        hidden = self.embedding[input_ids]
        for layer in self.layers:
            hidden = layer.decode(hidden, context, batch_indices)
        return rms_norm(hidden) @ self.output_layer


class DynamicInferenceEngine:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.model = MambaModel(device, variant)
        self.context = DynamicInferenceContext(device)
        self.input_ids = torch.zeros(DECODE_GRAPH_SIZE, dtype=torch.long, device=device)
        mm = self.context.mamba_metadata
        if graphed:   # captured at startup, on the dummy batch the buffers hold (every index -1)
            self.graph, self.logits = capture(
                lambda: self.model.forward(self.input_ids, self.context,
                                           mm._batch_indices_decode_buffer[:DECODE_GRAPH_SIZE]),
                device=device, owner="DynamicInferenceEngine (decode graph)",
                static={"input_ids": self.input_ids, "batch_indices_decode": mm._batch_indices_decode_buffer},
                state={"mamba_ssm_states": self.context.mamba_ssm_states})

    def add_request(self, req):
        req["slot"] = self.context.mamba_metadata.allocate_slot()
        self.context.mamba_ssm_states[:, req["slot"]] = 0.0
        index = torch.tensor([req["slot"]], dtype=torch.int32, device=self.device)
        for token in req["prompt"]:                          # eager prefill, one token at a time
            logits = self.model.forward(torch.tensor([token], device=self.device), self.context, index)
        return logits.clone()

    def step(self, reqs):
        n = len(reqs)
        t = lambda xs, dtype: torch.tensor(xs, dtype=dtype, device=self.device)  # noqa: E731
        self.input_ids[:n].copy_(t([r["script"].pop(0) for r in reqs], torch.long))
        padded = DECODE_GRAPH_SIZE if self.graphed else n
        self.context.mamba_metadata.update(t([r["slot"] for r in reqs], torch.int32), n, padded)
        if not self.graphed:
            return self.model.forward(self.input_ids[:n], self.context,
                                      self.context.mamba_metadata.batch_indices_decode).clone()
        out = replay(self.graph, self.logits, real=n, size=DECODE_GRAPH_SIZE,
                     padded={"input_ids": self.input_ids})   # padded token rows keep an earlier step's ids
        return out[:n].clone()


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        engine = DynamicInferenceEngine(device, variant, graphed)
        a = {"prompt": [3, 7, 1], "script": [5, 9, 2, 8, 6]}
        b = {"prompt": [4, 4], "script": [1, 0, 13, 7, 2]}
        c = {"prompt": [12, 5, 9, 9], "script": [11, 3, 10]}
        d = {"prompt": [6, 14], "script": [15, 2]}
        outs = [engine.add_request(r) for r in (a, b, c)]
        outs += [engine.step([a, b, c]) for _ in range(3)]      # 3 requests padded to the 4-row graph
        engine.context.mamba_metadata.free_slot(c["slot"])      # c finishes; d takes its slot
        outs.append(engine.add_request(d))
        outs += [engine.step([a, b, d]) for _ in range(2)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
