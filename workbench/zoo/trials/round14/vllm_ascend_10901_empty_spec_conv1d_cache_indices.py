"""A captured GDN spec conv1d task replayed with no spec sequence gets empty ``cache_indices`` and writes conv_state rows 0..n.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/10901 ("[BugFix] Fix Qwen3.5 precision error with ACL
Graph, MTP and DP", commit 5270d84675; this program models its second fix, the empty spec conv1d task; its first
fix, stale block-table rows in dummy runs, is the vLLM bug of PR 37728 and is not modelled here).
Symptom: Qwen3.5 (GDN linear attention) with MTP, DP > 1 and ACL graphs: the first requests served after some
idle steps collapse into repeated ``!!!!!``; eager mode is fine (vllm-ascend main, June 2026).
Mechanism: the FULL decode graph contains the GDN *spec* conv1d task, whose ``cache_indices`` (one conv-state
slot per input row) are graph parameters refreshed by ``update_conv1d_graph_params`` before each replay. When
the graph replays on a rank/batch without any runtime spec sequence (a DP dummy step of an idle rank),
``meta.spec_sequence_masks`` is None and the update left ``cache_indices`` empty. The custom causal conv1d op
does not treat empty ``cache_indices`` as a no-op: it falls back to batch-indexed state, reading and writing
``conv_state[0 .. x.shape[0])``. Those rows are live conv states of real requests (here: requests whose states
were loaded while the rank idled), which are overwritten with the dummy rows' inputs. Eager dummy steps build no
attention metadata and run no conv1d at all.
Doctor: stale-padding, at ``update_conv1d_graph_params`` (the dummy rows' slot metadata, left empty, route the
padded rows' state writes to slots owned by real requests).
Fix (upstream): when the captured branch is spec but the runtime has no spec sequence, pass ``-1`` (the pad
slot id, a state no-op) for every captured input row: ``new_cache_indices = (-1,) * cap_x_dim0``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/10901"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "update_conv1d_graph_params"
SYMPTOM = "an idle DP rank's graph replay overwrites live GDN conv states; the first requests then emit garbage"
DIM, WIDTH, NUM_SLOTS, CAP_X_DIM0, VOCAB = 4, 3, 4, 2, 8
PAD_SLOT_ID = -1


class Model:
    def __init__(self, device):
        gen = generator(10901)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.conv_weights = randn(WIDTH, DIM, gen=gen, device=device, scale=0.7)
        self.w_out = randn(DIM, DIM, gen=gen, device=device, scale=0.5)


def npu_causal_conv1d_custom(x, conv_weights, conv_state, cache_indices, num_cache_indices):
    """Decode-mode causal conv1d with state update. With no cache indices (``num_cache_indices == 0``)
    the kernel indexes states by batch row; ``PAD_SLOT_ID`` rows leave the state alone."""
    rows = torch.arange(x.shape[0], device=x.device)
    slots = torch.where(num_cache_indices > 0, cache_indices[:x.shape[0]], rows)
    pad = slots == PAD_SLOT_ID
    safe = torch.where(pad, torch.full_like(slots, NUM_SLOTS), slots)    # pad rows go to a scratch state
    window = torch.cat([conv_state[safe], x[:, None, :]], dim=1)        # [n, WIDTH, DIM]
    out = (window * conv_weights).sum(1)
    conv_state[safe] = window[:, 1:]
    return torch.nn.functional.silu(out)


class GDNSpecGraph:
    """The FULL decode graph's spec conv1d task and its graph parameters."""

    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.input_ids = torch.zeros(CAP_X_DIM0, dtype=torch.long, device=device)
        self.cache_indices = torch.full((CAP_X_DIM0,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.num_cache_indices = torch.zeros((), dtype=torch.long, device=device)
        self.conv_state = torch.zeros(NUM_SLOTS + 1, WIDTH - 1, DIM, device=device)

    def forward(self):
        mixed_qkv = self.model.emb[self.input_ids]
        out = npu_causal_conv1d_custom(mixed_qkv, self.model.conv_weights, self.conv_state, self.cache_indices,
                                       self.num_cache_indices)
        return out @ self.model.w_out

    def capture(self):
        self.cache_indices.copy_(torch.arange(CAP_X_DIM0, device=self.device))
        self.num_cache_indices.fill_(CAP_X_DIM0)
        self.graph = capture(self.forward, device=self.device,
                             static={"input_ids": self.input_ids, "cache_indices": self.cache_indices,
                                     "num_cache_indices": self.num_cache_indices},
                             state={"conv_state": self.conv_state}, owner="ACLGraphWrapper (GDN spec conv1d)")
        self.conv_state.zero_()

    def update_conv1d_graph_params(self, spec_state_indices):
        """Refresh the captured task's ``cache_indices`` before replay (``spec_sequence_masks`` None: no spec seq)."""
        if spec_state_indices is not None:
            new_cache_indices = tuple(spec_state_indices) + (PAD_SLOT_ID,) * (CAP_X_DIM0 - len(spec_state_indices))
        elif self.variant == "fix":
            new_cache_indices = (PAD_SLOT_ID,) * CAP_X_DIM0     # the fix: every captured row is a state no-op
        else:
            new_cache_indices = ()                              # empty: the kernel falls back to rows 0..n
        n = len(new_cache_indices)
        if n:
            self.cache_indices.copy_(torch.tensor(new_cache_indices, device=self.device))
        self.num_cache_indices.fill_(n)
        return n

    def execute(self, tokens, spec_state_indices, use_graph):
        self.input_ids[:len(tokens)].copy_(torch.tensor(tokens, device=self.device))
        if not use_graph:
            self.cache_indices[:len(tokens)].copy_(torch.tensor(spec_state_indices, device=self.device))
            self.num_cache_indices.fill_(len(tokens))
            return self.forward()[:len(tokens)].clone()
        self.update_conv1d_graph_params(spec_state_indices)
        g, out = self.graph
        return replay(g, out, real=len(tokens), size=CAP_X_DIM0)[:len(tokens)].clone()

    def dummy_run(self, use_graph):
        """An idle DP rank's step: FULL graph replay with no spec sequence; eager runs no GDN kernel."""
        if not use_graph:
            return
        self.input_ids.zero_()
        n = self.update_conv1d_graph_params(None)
        g, out = self.graph
        replay(g, out, real=0, size=CAP_X_DIM0,
               padded={"cache_indices": self.cache_indices} if n == 0 else {})


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(3)
    loaded = randn(2, WIDTH - 1, DIM, gen=gen, device=device)

    def serve(use_graph: bool):
        gdn = GDNSpecGraph(model, device, variant)
        if use_graph:
            gdn.capture()
        # PD decode node: requests A and B get their conv states (slots 0 and 1) loaded while the rank idles
        gdn.conv_state[0:2] = loaded
        gdn.dummy_run(use_graph)
        gdn.dummy_run(use_graph)
        outs = [gdn.execute([3, 5], [0, 1], use_graph), gdn.execute([6, 2], [0, 1], use_graph)]
        outs.append(gdn.conv_state[:NUM_SLOTS].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
