"""A prefill graph whose DP gather was captured with MAX_LEN geometry is replayed on per-rank SUM_LEN buckets.

Upstream: https://github.com/sgl-project/sglang/pull/37933 ("[Bugfix] Keep a shared MAX_LEN prefill CUDA
graph bucket when the graph captures a DP gather (MegaMoE sparse-DP hang)"); issue #37561.
Symptom: Kimi-K3 MegaMoE with DP attention and the breakable prefill CUDA graph deadlocks after #33871
(NCCL watchdog: one rank in a tp all_reduce, the other in reduce_scatter/all_gather); with all ranks busy
on different buckets (8 vs 256) the ranks' all_gathers have different sizes.
Mechanism: ``PrefillCudaGraphRunner`` captures each token bucket with ``dp_padding_mode =
DpPaddingMode.get_default_mode_in_cuda_graph()`` (MAX_LEN) and ``global_num_tokens = [bucket] * dp_size``:
the DP gather of dense layer 0 (``dp_gather_replicate`` -> ``_dp_gather``) is recorded with every rank's
slot at ``rank * bucket`` and the TP-sharded MLP over ``dp_size * bucket`` rows, frozen in the graph.
#33871 made ``prefill_graph_tolerates_sum_len()`` true for MegaMoE, so at replay the host picks SUM_LEN and
each rank pads only to its *own* bucket. The ranks then replay graphs of different geometry: the small
rank's gather lands inside the big rank's slot and its MLP shard covers only its bucket's rows, so the big
rank's all-reduce reads another rank's partial sums that this step never wrote. Collectives are modelled as
shared buffers (``DPGroup``) that the ranks' graphs write phase by phase in lockstep.
Doctor: warmup-divergence, at ``prefill_graph_tolerates_sum_len`` (capture fixed the MAX_LEN DP geometry;
the replay-time decision now says SUM_LEN with per-rank buckets, which the graphs do not follow).
Fix (upstream): keep a shared MAX_LEN bucket whenever the prefill graph contains a DP gather: ``_dp_gather``
calls ``_note_dp_gather_in_prefill_graph()``, which latches ``get_flags().dp.prefill_graph_has_dp_gather``
while ``capturing_prefill_graph``; ``prefill_graph_tolerates_sum_len()`` returns False once it is set.
"""
from __future__ import annotations

import types

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/37933"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "prefill_graph_tolerates_sum_len"
SYMPTOM = "DP ranks replay MAX_LEN-captured prefill graphs on their own SUM_LEN buckets: the DP gather mixes rows"
DP_SIZE, HIDDEN, FFN, CAPTURE_NUM_TOKENS = 2, 4, 6, (2, 4, 8)
MAX_BUCKET = CAPTURE_NUM_TOKENS[-1]

_FLAGS = types.SimpleNamespace(dp=types.SimpleNamespace(capturing_prefill_graph=False,
                                                        prefill_graph_has_dp_gather=False))


def get_flags():
    return _FLAGS


def _note_dp_gather_in_prefill_graph(variant):
    dp = get_flags().dp
    if variant == "fix" and dp.capturing_prefill_graph:
        dp.prefill_graph_has_dp_gather = True


def prefill_graph_tolerates_sum_len(variant) -> bool:
    """May DP ranks replay the prefill graph under SUM_LEN, each on its own bucket? (MegaMoE: #33871)"""
    if variant == "bug":
        return True                               # MegaMoE: per-rank buckets always allowed
    return not get_flags().dp.prefill_graph_has_dp_gather


class DPGroup:
    """The TP group's collectives in miniature: the DP-gathered tokens and each rank's partial MLP sums."""

    def __init__(self, device):
        self.global_tokens = torch.zeros(DP_SIZE * MAX_BUCKET, HIDDEN, device=device)
        self.partial = torch.zeros(DP_SIZE, DP_SIZE * MAX_BUCKET, HIDDEN, device=device)   # [tp rank, row]


class DenseLayer0:
    """Kimi-K3's first dense layer: dp_gather_replicate, a TP-sharded MLP, all-reduce, dp_scatter."""

    def __init__(self, rank, group, w_up, w_down, variant):
        self.rank, self.group, self.w_up, self.w_down, self.variant = rank, group, w_up, w_down, variant

    def _dp_gather(self, hidden, global_num_tokens):
        _note_dp_gather_in_prefill_graph(self.variant)
        start = sum(global_num_tokens[:self.rank])
        n = global_num_tokens[self.rank]
        self.group.global_tokens[start:start + n].copy_(hidden[:n])

    def mlp_shard(self, global_num_tokens):
        total = sum(global_num_tokens)
        x = self.group.global_tokens[:total]
        self.group.partial[self.rank, :total].copy_(torch.relu(x @ self.w_up[self.rank]) @ self.w_down[self.rank])

    def all_reduce_scatter(self, hidden, out, global_num_tokens):
        start = sum(global_num_tokens[:self.rank])
        n = global_num_tokens[self.rank]
        out[:n].copy_(hidden[:n] + self.group.partial[:, start:start + n].sum(0))


class PrefillCudaGraphRunner:
    def __init__(self, rank, group, w_up, w_down, variant, device, pool):
        self.rank, self.device, self.pool = rank, device, pool
        self.layer = DenseLayer0(rank, group, w_up, w_down, variant)
        self.group = group
        self.input_embeds = torch.zeros(MAX_BUCKET, HIDDEN, device=device)
        self.output = torch.zeros(MAX_BUCKET, HIDDEN, device=device)
        self.graphs = {}

    def capture(self):
        dp = get_flags().dp
        dp.capturing_prefill_graph = True
        for bucket in reversed(CAPTURE_NUM_TOKENS):
            # dp_padding_mode = get_default_mode_in_cuda_graph() (MAX_LEN): every rank has `bucket` tokens
            global_num_tokens = [bucket] * DP_SIZE
            layer, x, out = self.layer, self.input_embeds, self.output
            pieces = (lambda g=global_num_tokens: layer._dp_gather(x, g),
                      lambda g=global_num_tokens: layer.mlp_shard(g),
                      lambda g=global_num_tokens: layer.all_reduce_scatter(x, out, g))
            self.graphs[bucket] = [
                capture(fn, device=self.device, pool=self.pool, name=f"dp{self.rank} prefill {bucket} piece{i}",
                        static={"input_embeds": x}, owner=f"sglang PrefillCudaGraphRunner (DP rank {self.rank})",
                        state={"global_tokens": self.group.global_tokens, "partial": self.group.partial})[0]
                for i, fn in enumerate(pieces)]
        dp.capturing_prefill_graph = False

    def load_batch(self, tokens, global_num_tokens_raw, variant):
        """Pick the replay bucket under this step's DP padding mode and copy the tokens in."""
        n = tokens.shape[0]
        if prefill_graph_tolerates_sum_len(variant):
            num_tokens = n                        # SUM_LEN: pad to this rank's own bucket
        else:
            num_tokens = max(global_num_tokens_raw)   # MAX_LEN: one bucket shared by all DP ranks
        bucket = next(b for b in CAPTURE_NUM_TOKENS if b >= num_tokens)
        self.input_embeds[:n].copy_(tokens)
        self.input_embeds[n:bucket].zero_()
        return bucket, n


def run(variant: str, device: str = "cpu"):
    gen = generator(37933)
    w_up = randn(DP_SIZE, HIDDEN, FFN, gen=gen, device=device, scale=0.6)
    w_down = randn(DP_SIZE, FFN, HIDDEN, gen=gen, device=device, scale=0.6)
    counts = [(7, 6), (6, 2), (3, 8), (8, 1)]          # each DP rank's prefill tokens per step
    steps = [[randn(n, HIDDEN, gen=gen, device=device) for n in c] for c in counts]

    def eager():                                       # eager SUM_LEN: gather real rows, full MLP, scatter
        outs = []
        for step in steps:
            x = torch.cat(step)
            y = x + sum(torch.relu(x @ w_up[r]) @ w_down[r] for r in range(DP_SIZE))
            outs.extend(y.split([t.shape[0] for t in step]))
        return outs

    def served():
        _FLAGS.dp.capturing_prefill_graph = _FLAGS.dp.prefill_graph_has_dp_gather = False
        group, pool = DPGroup(device), graph_pool_handle(device)
        runners = [PrefillCudaGraphRunner(r, group, w_up, w_down, variant, device, pool) for r in range(DP_SIZE)]
        for runner in runners:
            runner.capture()
        outs = []
        for step in steps:
            raw = [t.shape[0] for t in step]
            plans = [runner.load_batch(t, raw, variant) for runner, t in zip(runners, step)]
            for phase in range(3):                     # each collective is a rendezvous of all DP ranks
                for runner, (bucket, n) in zip(runners, plans):
                    replay(runner.graphs[bucket][phase], runner.output, real=n, size=bucket)
            outs.extend(runner.output[:n].clone() for runner, (_, n) in zip(runners, plans))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
