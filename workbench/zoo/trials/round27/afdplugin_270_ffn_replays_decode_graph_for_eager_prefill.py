"""The FFN worker replays a decode graph for an eager prefill step with the same graph key: the captured 4+4 layout.

Upstream: https://github.com/vllm-project/afd-plugin/pull/270 ("fix: gate GPU FFN graph replay on Attention run
mode"), fixing https://github.com/vllm-project/afd-plugin/issues/261 ("FFN graph cache replays during eager
prefill in FULL_DECODE_ONLY").
Symptom: attention-FFN disaggregation with ``FULL_DECODE_ONLY``: two attention ranks feed one FFN rank; an FFN
graph captured for a uniform decode step of 4 + 4 tokens (graph key 8) is replayed for a chunked-prefill step of
7 + 1 tokens (also key 8) whose attention runs eagerly, so the FFN results go back in the captured layout.
Mechanism: ``GPUFFNModelRunner.execute_model`` looks the graph up by ``make_ffn_graph_key(dp_metadata_list)``,
the token count aggregated per FFN rank, and ``graph_run_mode`` returns REPLAY whenever a graph with that key
exists and the step is neither warmup nor capture. At capture ``_dummy_run`` had run
``connector.control_plane.update_state_from_dp_metadata`` for the decode layout (4 tokens from each attention
rank), so the captured ``send_ffn_output`` copies rows ``[0, 4)`` back to rank 0 and ``[4, 8)`` to rank 1. The
replay skips ``_ffn_forward`` (and with it the connector-state update) and reuses that layout, while an eager FFN
step would now split 7 / 1: rank 0 receives only 4 of its 7 rows (the rest keep an earlier step's values) and rank
1 receives rank 0's row 4 instead of its own.
Doctor: warmup-divergence, at ``update_state_from_dp_metadata`` (the per-rank layout it set before capture is
what every replay reuses; an eager step sets it again from this step's metadata).
Fix (upstream): the attention side now publishes whether it is replaying its graph (``is_graph_replaying`` /
``attention_run_mode`` in the control payload), and ``graph_run_mode`` returns REPLAY only when that flag is set
and a local graph exists; otherwise the FFN runs eagerly.
(The fix diff itself was not in the stored snapshot: modelled from the PR and issue descriptions and from the
pre-fix code of ``ffn_model_runner.py`` / ``cuda_graph.py`` at afd-plugin 2e4378f; the NPU side is left out.)
"""
from __future__ import annotations

import enum

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/afd-plugin/pull/270"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "update_state_from_dp_metadata"
SYMPTOM = "an eager 7+1 prefill step gets the FFN results of a replayed 4+4 decode graph (wrong rows per rank)"

DIM, MAX_TOKENS, NUM_ATTN_RANKS = 4, 8, 2


class AFDGraphRunMode(enum.Enum):
    WARMUP, CAPTURE, REPLAY, EAGER = range(4)


def graph_run_mode(*, is_warmup, is_graph_capturing, graph_enabled, graph_exists, attention_replaying, variant):
    if is_warmup:
        return AFDGraphRunMode.WARMUP
    if is_graph_capturing:
        return AFDGraphRunMode.CAPTURE
    replay_ok = graph_exists if variant == "bug" else (attention_replaying and graph_exists)
    if graph_enabled and replay_ok:
        return AFDGraphRunMode.REPLAY
    return AFDGraphRunMode.EAGER


def make_ffn_graph_key(num_tokens_across_dp):
    return (sum(num_tokens_across_dp),)          # aggregated per FFN rank: 2 attention ranks -> 1 FFN rank


class ControlPlane:
    def __init__(self):
        self.num_tokens_per_rank = [0] * NUM_ATTN_RANKS

    def update_state_from_dp_metadata(self, num_tokens_across_dp):
        self.num_tokens_per_rank = [int(n) for n in num_tokens_across_dp]


class Connector:
    """The FFN side of the attention<->FFN transfer: one receive buffer, one return buffer per attention rank."""

    def __init__(self, device):
        self.control_plane = ControlPlane()
        self.recv_hidden = torch.zeros(MAX_TOKENS, DIM, device=device)
        self.ret = tuple(torch.zeros(MAX_TOKENS, DIM, device=device) for _ in range(NUM_ATTN_RANKS))

    def recv_attn_output(self):
        return self.recv_hidden[:sum(self.control_plane.num_tokens_per_rank)]

    def send_ffn_output(self, out):
        off = 0
        for rank, n in enumerate(self.control_plane.num_tokens_per_rank):
            self.ret[rank][:n].copy_(out[off:off + n])
            off += n


class GPUFFNModelRunner:
    def __init__(self, device, variant, graphed):
        gen = generator(270)
        self.w1 = randn(DIM, 2 * DIM, gen=gen, device=device, scale=0.6)
        self.w2 = randn(2 * DIM, DIM, gen=gen, device=device, scale=0.6)
        self.variant, self.use_cuda_graph = variant, graphed
        self.connector = Connector(device)
        self._cuda_graphs = {}

    def _ffn_forward(self, num_tokens_across_dp, update_connector_state=True):
        if update_connector_state:
            self.connector.control_plane.update_state_from_dp_metadata(num_tokens_across_dp)
        hidden_states = self.connector.recv_attn_output()
        out = torch.nn.functional.silu(hidden_states @ self.w1) @ self.w2
        self.connector.send_ffn_output(out)
        return out

    def capture_model(self, num_tokens_across_dp):
        """``_dummy_run`` in FULL mode: set the connector state, then capture the forward without updating it."""
        if not self.use_cuda_graph:
            return
        self.connector.control_plane.update_state_from_dp_metadata(num_tokens_across_dp)
        g, _ = capture(lambda: self._ffn_forward(num_tokens_across_dp, update_connector_state=False),
                       device=self.connector.recv_hidden.device.type, owner="GPUFFNModelRunner (FFN graph)",
                       static={"recv_hidden": self.connector.recv_hidden})
        self._cuda_graphs[make_ffn_graph_key(num_tokens_across_dp)] = {"graph": g, "output": self.connector.ret}

    def execute_model(self, num_tokens_across_dp, attention_replaying):
        info = self._cuda_graphs.get(make_ffn_graph_key(num_tokens_across_dp))
        mode = graph_run_mode(is_warmup=False, is_graph_capturing=False, graph_enabled=self.use_cuda_graph,
                              graph_exists=info is not None, attention_replaying=attention_replaying,
                              variant=self.variant)
        if mode is AFDGraphRunMode.REPLAY:
            return replay(info["graph"], info["output"])
        self._ffn_forward(num_tokens_across_dp)
        return self.connector.ret


def run(variant: str, device: str = "cpu"):
    gen = generator(261)
    decode = [4, 4]
    steps = [(decode, True), ([7, 1], False), (decode, True), ([7, 1], False)]   # (layout, attention replays)
    hidden = [randn(MAX_TOKENS, DIM, gen=gen, device=device) for _ in steps]

    def serve(graphed: bool):
        runner = GPUFFNModelRunner(device, variant, graphed)
        runner.capture_model(decode)                     # FULL_DECODE_ONLY: one uniform-decode FFN graph
        outs = []
        for (layout, attention_replaying), h in zip(steps, hidden):
            runner.connector.recv_hidden.copy_(h)        # the attention ranks' tokens, rank 0's first
            ret = runner.execute_model(layout, attention_replaying and graphed)
            for rank, n in enumerate(layout):            # each attention rank reads back its own rows
                outs.append(ret[rank][:n].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
