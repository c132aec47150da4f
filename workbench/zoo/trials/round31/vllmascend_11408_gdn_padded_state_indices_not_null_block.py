"""A FULL ACL decode graph's padded dummy requests advance a live request's GDN state through stale state indices.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/11408 ("[BugFix][310p]:fix the accuracy issue
caused by mtp and aclgraph"). Only the PR description was read, not the diff: the names below follow it.
Symptom: Qwen3.5 on 310P with FULL ACLGraph and concurrent requests produced garbled output / an accuracy
regression once continuous batching made the runtime request count smaller than the captured graph size.
Mechanism: the FULL graph is captured for a fixed number of requests, so a smaller decode batch is padded
with dummy requests. The 310P GDN path did not turn those dummies into no-op entries: the persistent
state-index buffer (``state_indices``) kept, in its padded rows, the indices an earlier step wrote there, so
the captured conv1d/recurrent state update (``npu_causal_conv1d_310``) advanced whatever state those stale
indices named -- including the recurrent state of a request that is live in this batch at another row.
Doctor: stale-padding, at ``npu_causal_conv1d_310`` (the state update through padded rows' stale indices).
Fix (upstream): explicitly pad the decode metadata under full graph mode and mark dummy requests' states as
``NULL_BLOCK_ID`` (a reserved state slot no request owns), so padded rows update only that slot.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/11408"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "npu_causal_conv1d_310"
SYMPTOM = "padded dummy requests advance a live request's GDN recurrent state (garbled output on 310P)"

VOCAB, DIM, NUM_STATE_SLOTS = 16, 4, 6
SIZE = 4                      # the one FULL decode capture size (requests)
NULL_BLOCK_ID = 0             # reserved state slot: dummy requests' updates land here
DECAY = 0.5


class Model:
    def __init__(self, device):
        gen = generator(11408)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)


def npu_causal_conv1d_310(model, x, ssm_state, state_indices):
    """State update of one token per request: each row adds its delta into the state slot its index names
    (an accumulating scatter, as the kernel's per-row in-place update); returns the updated states."""
    old = ssm_state[state_indices]
    delta = (DECAY - 1.0) * old + torch.tanh(x @ model.wk)
    ssm_state.index_put_((state_indices,), delta, accumulate=True)
    return ssm_state[state_indices]


def forward(model, ssm_state, input_ids, state_indices):
    h = model.emb[input_ids]
    s = npu_causal_conv1d_310(model, h, ssm_state, state_indices)
    return (h + s) @ model.wo


class NPUModelRunner310:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.variant, self.graphed = model, device, variant, graphed
        self.ssm_state = torch.zeros(NUM_STATE_SLOTS, DIM, device=device)
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.state_indices = torch.full((SIZE,), NULL_BLOCK_ID, dtype=torch.long, device=device)
        if graphed:
            self.graph, self.out = capture(
                lambda: forward(model, self.ssm_state, self.input_ids[:SIZE], self.state_indices[:SIZE]),
                device=device, owner="NPUModelRunner310 (FULL decode ACL graph)",
                static={"input_ids": self.input_ids, "state_indices": self.state_indices},
                state={"ssm_state": self.ssm_state})
            self.ssm_state.zero_()                      # warmup/capture touched the state: start clean

    def _prepare_inputs(self, reqs, full_graph):
        """``reqs``: (token id, state slot) per scheduled request."""
        n = len(reqs)
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        self.input_ids[:n].copy_(t([tok for tok, _ in reqs]))
        self.state_indices[:n].copy_(t([slot for _, slot in reqs]))
        if full_graph and self.variant == "fix":
            # pad dummy requests as no-op entries: their states are NULL_BLOCK_ID
            self.input_ids[n:].fill_(0)
            self.state_indices[n:].fill_(NULL_BLOCK_ID)
        return n

    def execute_model(self, reqs, uniform_decode):
        full_graph = self.graphed and uniform_decode
        n = self._prepare_inputs(reqs, full_graph)
        if not full_graph:                              # prefill / mixed batches run eagerly
            return forward(self.model, self.ssm_state, self.input_ids[:n], self.state_indices[:n]).clone()
        padded = {"input_ids": self.input_ids}
        if self.variant == "bug":
            padded["state_indices"] = self.state_indices  # its padded rows were left as they were
        return replay(self.graph, self.out, real=n, size=SIZE, padded=padded)[:n].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        runner = NPUModelRunner310(model, device, variant, graphed)
        outs = []
        # A, B, C, D get state slots 1..4; first token of each (eager), then one decode step of all four.
        outs.append(runner.execute_model([(3, 1), (5, 2), (7, 3), (9, 4)], uniform_decode=False))
        outs.append(runner.execute_model([(11, 1), (12, 2), (13, 3), (14, 4)], uniform_decode=True))
        # B, C, D finish; E arrives and gets C's freed slot 3 (its state is reset, then its first token runs).
        runner.ssm_state[3].zero_()
        outs.append(runner.execute_model([(2, 3)], uniform_decode=False))
        # E and A decode: 2 requests padded to the size-4 graph (padded rows still hold 3 and 4).
        outs.append(runner.execute_model([(6, 3), (10, 1)], uniform_decode=True))
        outs.append(runner.execute_model([(1, 3), (4, 1)], uniform_decode=True))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
