"""AutoDeploy's MoE all-to-all reads ``runtime_max_tokens_per_rank`` with ``.item()`` inside the captured forward: the graph keeps the capture batch's value.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/13723 ("[#13718][feat] AutoDeploy MoE all-to-all:
cache + runtime max-tokens"); the CUDA-graph defect was raised in its review (MrGeva, pointing to his fix in
https://github.com/NVIDIA/TensorRT-LLM/pull/14505, commit 8fe6ed6) and fixed in the merged PR by the
``_bypass_captured_graphs`` mechanism (commit ecc7ae1c85).
Symptom: "this is incompatible with cudagraph, the value will be baked in during the capture and it causes
an accuracy issue in Super it goes to 0%" (Nemotron-Super with MTP + attention-DP, AutoDeploy, May 2026).
Mechanism: ``trtllm_moe`` (``custom_ops/fused_moe/trtllm_moe.py``) sizes the all-to-all dispatch from
``runtime_max_tokens_per_rank = int(batch_info_host[13].item())``, the max of ``total_num_tokens`` over the
DP ranks that the shim writes into slot 13 of the host ``batch_info`` before each forward. Inside the
captured decode graph that ``.item()`` is host work: it ran once, at capture, when slot 13 held the capture
batch's count, and the dispatch/receive extents derived from it were frozen into the kernels. A replay whose
peer DP rank holds more tokens than that dispatches only the first captured-count tokens per rank; the rest
are dropped from the expert computation (their combine rows stay zero), while eager reads the live slot 13.
Doctor: host-work-frozen, at ``trtllm_moe_fused`` (its ``batch_info_host[13].item()`` ran once, at capture).
Fix (upstream): the captured graphs bypass the runtime value: while warming up / capturing
(``cuda_graph_state.in_warm_up()``) the op uses the static ``max_num_tokens`` upper bound, so the graph's
extents hold every batch it can serve; eager forwards keep the tighter runtime value.
(Read: the review thread's diff of the ``.item()`` code and both comments; the fix commit's own diff was not
available, so the bypass is modelled from its description. Two DP ranks emulated on one device: the peer's
gathered tokens arrive in a static buffer; one expert per rank, a tiny MLP.)
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/13723"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "trtllm_moe_fused"
SYMPTOM = "peer-rank tokens past the capture-time max are dropped from the MoE; accuracy collapses (0% on Super)"

DIM, EP_SIZE, MAX_NUM_TOKENS = 4, 2, 4
BATCH_INFO_SLOTS, RUNTIME_MAX_SLOT = 16, 13


class _CudaGraphState:
    """``auto_deploy.utils.cuda_graph.cuda_graph_state``: set while the runner warms up and captures."""

    def __init__(self):
        self._in_warm_up = False

    def in_warm_up(self) -> bool:
        return self._in_warm_up


cuda_graph_state = _CudaGraphState()


class Expert:
    def __init__(self, device):
        gen = generator(13723)
        self.w1 = randn(DIM, 2 * DIM, gen=gen, device=device, scale=0.6)
        self.w2 = randn(2 * DIM, DIM, gen=gen, device=device, scale=0.6)

    def __call__(self, x):
        return torch.relu(x @ self.w1) @ self.w2


def trtllm_moe_fused(variant, expert, all_rank_hidden, batch_info_host):
    """All-to-all dispatch of every DP rank's tokens to this rank's expert, expert MLP, combine.
    ``all_rank_hidden``: ``[EP_SIZE, MAX_NUM_TOKENS, DIM]``, each rank's tokens (zeros past its count)."""
    if variant == "fix" and cuda_graph_state.in_warm_up():
        runtime_max_tokens_per_rank = MAX_NUM_TOKENS        # captured graphs bypass the runtime value
    else:
        runtime_max_tokens_per_rank = int(batch_info_host[RUNTIME_MAX_SLOT].item())
        if runtime_max_tokens_per_rank <= 0:
            runtime_max_tokens_per_rank = MAX_NUM_TOKENS
    # dispatch: per source rank, a slot of runtime_max_tokens_per_rank rows in the receive workspace
    recv = all_rank_hidden[:, :runtime_max_tokens_per_rank]
    expert_out = expert(recv.reshape(-1, DIM)).reshape(EP_SIZE, runtime_max_tokens_per_rank, DIM)
    # combine: each source rank gets its rows back; rows never dispatched stay zero
    combined = torch.zeros_like(all_rank_hidden)
    combined[:, :runtime_max_tokens_per_rank] = expert_out
    return combined


class ADEngine:
    """One DP rank's decode step: the shim writes slot 13 (max tokens over ranks), the all-gathered
    hidden states are copied into the static input, the (captured) forward runs."""

    def __init__(self, expert, device, variant, graphed):
        self.expert, self.device, self.variant, self.graphed = expert, device, variant, graphed
        self.batch_info_host = host(torch.zeros(BATCH_INFO_SLOTS, dtype=torch.int64), device)
        self.all_rank_hidden = torch.zeros(EP_SIZE, MAX_NUM_TOKENS, DIM, device=device)
        if graphed:
            # capture with the dummy decode batch: every rank at the capture batch size of 2 tokens
            self._write_batch_info([2, 2])
            cuda_graph_state._in_warm_up = True
            try:
                self.graph, self.out = capture(
                    lambda: trtllm_moe_fused(variant, expert, self.all_rank_hidden, self.batch_info_host),
                    device=device, warmups=2, owner="AutoDeploy CapturedGraph (decode)",
                    static={"all_rank_hidden": self.all_rank_hidden})
            finally:
                cuda_graph_state._in_warm_up = False

    def _write_batch_info(self, all_rank_num_tokens):
        self.batch_info_host[RUNTIME_MAX_SLOT] = max(all_rank_num_tokens)

    def forward(self, all_rank_tokens):
        counts = [t.shape[0] for t in all_rank_tokens]
        self._write_batch_info(counts)
        self.all_rank_hidden.zero_()
        for r, t in enumerate(all_rank_tokens):
            self.all_rank_hidden[r, :counts[r]].copy_(t)
        if not self.graphed:
            return trtllm_moe_fused(self.variant, self.expert, self.all_rank_hidden, self.batch_info_host).clone()
        return replay(self.graph, self.out).clone()


def run(variant: str, device: str = "cpu"):
    expert = Expert(device)
    gen = generator(1)
    steps = [[randn(2, DIM, gen=gen, device=device), randn(1, DIM, gen=gen, device=device)],
             [randn(2, DIM, gen=gen, device=device), randn(4, DIM, gen=gen, device=device)],   # peer: 4 tokens
             [randn(1, DIM, gen=gen, device=device), randn(3, DIM, gen=gen, device=device)]]

    def serve(graphed: bool):
        engine = ADEngine(expert, device, variant, graphed)
        return [engine.forward(tokens) for tokens in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
