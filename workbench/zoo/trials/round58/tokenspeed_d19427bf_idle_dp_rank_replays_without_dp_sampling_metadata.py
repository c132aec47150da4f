"""The idle DP rank replays the global decode bucket's graph with ``ctx.dp_sampling`` left False, against the captured DP-sampling policy.

Upstream: https://github.com/lightseekorg/tokenspeed/commit/d19427bf72bd1eee368912d8115c59b157ce7c76 ("Set DP
sampling metadata for idle graph replay"; a commit of the DP-sampling branch squashed into #232).
Symptom: with DP attention + DP sampling under CUDA graphs, a DP rank with no requests while its peers decode
(``global_bs=[16, 0]``) fails its idle forward (``CudaGraphWrapper.__call__`` asserts "ctx.dp_sampling=False
does not match captured bucket policy"); its peers are left waiting in the sampler's collectives.
Mechanism: ``CudaGraphWrapper._capture_one(bs)`` decides per bucket, at capture, whether the graph samples with
DP sampling (``_dp_sampling_for_effective_bs(bs)``: ``bs >= dp_sampling_min_bs``) and bakes that branch and its
``logits_layout_plan`` (a TP-divisible ``bucket_bs``, each logits-TP rank sampling its slice) into the graph.
Under DP attention every rank replays the bucket of the *global* batch (``_global_graph_bs`` from
``global_num_tokens``), so a busy rank routes with ``forward_step.dp_sampling_route(bs, ctx)`` and publishes
``ctx.dp_sampling`` / ``ctx.logits_layout_plan``. ``ModelExecutor.execute_idle_forward`` (bs=0) built its
``ForwardContext`` and ``SamplingBatchInfo`` without that route: ``ctx.dp_sampling`` kept its default False
(decided from the local bs=0), no layout plan. ``can_run(bs=0)`` is True (the global bucket is captured), so it
replays ``graphs[padded_bs]``, captured with DP sampling, and the replay's check of the step's metadata against
the captured policy fails. Eagerly (graphs disabled) the idle rank runs the IDLE forward and never meets the
graph's policy. Here the two DP ranks live in one process and decode in lockstep; the replayed graph itself is
the right one: what is wrong is the idle step's decision, which disagrees with what capture decided.
Doctor: warmup-divergence, at execute_idle_forward (capture decided the bucket's DP-sampling branch and layout;
the idle step decides dp_sampling=False from local bs=0 and replays that bucket).
Fix (upstream): ``execute_idle_forward`` calls ``ctx.dp_sampling, _use_graph, bucket_bs =
self.forward_step.dp_sampling_route(0, ctx)``, builds ``ctx.logits_layout_plan`` with
``sampling_backend.build_logits_layout_plan(dp_sampling=..., real_bs=0, bucket_bs=...)`` and passes
``dp_sampling=ctx.dp_sampling`` to ``SamplingBatchInfo``.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/commit/d19427bf72bd1eee368912d8115c59b157ce7c76"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "execute_idle_forward"
SYMPTOM = "idle DP rank's graph replay fails the DP-sampling policy check (ctx.dp_sampling=False), peers hang"

DP_SIZE, LOGITS_TP, HIDDEN, VOCAB = 2, 2, 4, 8
CAPTURE_BS, DP_SAMPLING_MIN_BS = [2, 4], 4
STEPS = [[1, 0], [3, 0], [4, 0]]          # global_bs per decode step: rank 0 busy, rank 1 idle


def should_use_dp_sampling_for_bucket(*, dp_sampling_enabled, is_decode, effective_bs, min_bs) -> bool:
    return dp_sampling_enabled and is_decode and effective_bs >= min_bs


def dp_sampling_layout_bucket_bs(*, real_bs: int, tp_size: int) -> int:
    return ((real_bs + tp_size - 1) // tp_size) * tp_size


@dataclasses.dataclass
class LogitsLayoutPlan:
    dp_sampling: bool
    real_bs: int
    bucket_bs: int
    tp_size: int


class SamplingBackend:
    def build_logits_layout_plan(self, *, dp_sampling, real_bs, bucket_bs, tp_size) -> LogitsLayoutPlan:
        return LogitsLayoutPlan(dp_sampling, real_bs, bucket_bs, tp_size)


@dataclasses.dataclass
class ForwardContext:
    bs: int
    is_decode: bool = True
    global_num_tokens: list | None = None
    global_bs: list | None = None
    all_decode_or_idle: bool = True
    dp_sampling: bool = False
    logits_layout_plan: LogitsLayoutPlan | None = None


@dataclasses.dataclass
class SamplingBatchInfo:
    is_all_greedy: bool
    dp_sampling: bool = False


class Model:
    """Embedding + LM head + greedy sampler; with DP sampling each logits-TP rank samples its slice of the bucket."""

    def __init__(self, device, gen):
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, ctx: ForwardContext):
        logits = self.embed[input_ids] @ self.lm_head
        plan = ctx.logits_layout_plan
        if ctx.dp_sampling:                  # dp_sampling_swap: rows split over the logits TP group
            per_rank = logits[: plan.bucket_bs].view(plan.tp_size, plan.bucket_bs // plan.tp_size, VOCAB)
            return per_rank.argmax(-1).reshape(-1)           # each rank samples its slice, then gather
        return logits.argmax(-1)


class CudaGraphWrapper:
    def __init__(self, model, input_buffers, sampling_backend, device, disable):
        self.model, self.input_buffers, self.sampling_backend = model, input_buffers, sampling_backend
        self.device, self.disable = device, disable
        self.dp_size, self.max_bs, self.capture_bs, self.logits_tp_size = DP_SIZE, max(CAPTURE_BS), CAPTURE_BS, LOGITS_TP
        self.max_tokens_per_req, self.dp_sampling_enabled, self.dp_sampling_min_bs = 1, True, DP_SAMPLING_MIN_BS
        self.graphs, self.output_buffers = {}, {}
        if not self.disable:
            for bs in self.capture_bs:
                self.graphs[bs], self.output_buffers[bs] = self._capture_one(bs)

    def _capture_one(self, bs):
        dp_sampling = self._dp_sampling_for_effective_bs(bs, True)
        bucket_bs = dp_sampling_layout_bucket_bs(real_bs=bs, tp_size=self.logits_tp_size) if dp_sampling else bs
        plan = self.sampling_backend.build_logits_layout_plan(
            dp_sampling=dp_sampling, real_bs=bs, bucket_bs=bucket_bs, tp_size=self.logits_tp_size)
        ctx = ForwardContext(bs=bs, global_num_tokens=[bs] * self.dp_size, dp_sampling=dp_sampling,
                             logits_layout_plan=plan)
        ids = self.input_buffers.input_ids_buf

        def run_once():
            return self.model.forward(ids[:bs], ctx)

        return capture(run_once, device=self.device, name=f"decode bs={bs}", static={"input_ids_buf": ids},
                       owner="tokenspeed CudaGraphWrapper")

    def _global_graph_bs(self, ctx):
        if self.dp_size <= 1 or ctx.global_num_tokens is None:
            return None
        return (max(ctx.global_num_tokens) + self.max_tokens_per_req - 1) // self.max_tokens_per_req

    def _dp_sampling_for_effective_bs(self, effective_bs, is_decode):
        return should_use_dp_sampling_for_bucket(dp_sampling_enabled=self.dp_sampling_enabled, is_decode=is_decode,
                                                 effective_bs=effective_bs, min_bs=self.dp_sampling_min_bs)

    def dp_sampling_route(self, bs, ctx):
        use_graph = self._can_use_graph(bs, ctx)
        effective_bs = self._padded_bs(bs, ctx) if use_graph else bs
        dp_sampling = self._dp_sampling_for_effective_bs(effective_bs, ctx.is_decode)
        layout_bucket_bs = effective_bs
        if dp_sampling:
            layout_bucket_bs = dp_sampling_layout_bucket_bs(real_bs=effective_bs, tp_size=self.logits_tp_size)
        return dp_sampling, use_graph, layout_bucket_bs

    def _can_use_graph(self, bs, ctx):
        if self.disable or not ctx.is_decode or not ctx.all_decode_or_idle:
            return False
        global_bs = self._global_graph_bs(ctx)
        return global_bs is not None and global_bs != 0 and global_bs <= self.max_bs

    def can_run(self, bs, ctx):
        return self._can_use_graph(bs, ctx)

    def _padded_bs(self, bs, ctx):
        graph_bs = self._global_graph_bs(ctx)
        target_bs = graph_bs if graph_bs is not None else bs
        return self.capture_bs[bisect.bisect_left(self.capture_bs, target_bs)]

    padded_bs = _padded_bs

    def __call__(self, bs, ctx, sampling_info):
        use_graph = self._can_use_graph(bs, ctx)
        if not use_graph:
            return self.model.forward(self.input_buffers.input_ids_buf[:bs], ctx)
        padded_bs = self._padded_bs(bs, ctx)
        expected_dp_sampling = self._dp_sampling_for_effective_bs(padded_bs, ctx.is_decode)
        assert ctx.dp_sampling == expected_dp_sampling, (
            f"ctx.dp_sampling={ctx.dp_sampling} does not match captured bucket policy for bs={bs}, "
            f"padded_bs={padded_bs}, min_bs={self.dp_sampling_min_bs}")
        ids = self.input_buffers.input_ids_buf
        padded = {"input_ids_buf": ids[:padded_bs]} if 0 < bs < padded_bs else None
        out = replay(self.graphs[padded_bs], self.output_buffers[padded_bs], real=bs, size=padded_bs, padded=padded)
        return out[:bs]


class InputBuffers:
    def __init__(self, device):
        self.input_ids_buf = torch.zeros(max(CAPTURE_BS), dtype=torch.long, device=device)

    def fill_dummy_decode_buffers(self, batch_size):
        self.input_ids_buf[:batch_size].zero_()


class ModelExecutor:
    """One DP rank."""

    def __init__(self, model, device, variant, enforce_eager):
        self.variant, self.sampling_backend = variant, SamplingBackend()
        self.input_buffers = InputBuffers(device)
        self.forward_step = CudaGraphWrapper(model, self.input_buffers, self.sampling_backend, device, enforce_eager)

    def execute_forward(self, input_ids, global_bs):
        bs = input_ids.shape[0]
        ctx = ForwardContext(bs=bs, global_num_tokens=list(global_bs), global_bs=list(global_bs))
        ctx.dp_sampling, _use_graph, bucket_bs = self.forward_step.dp_sampling_route(bs, ctx)
        ctx.logits_layout_plan = self.sampling_backend.build_logits_layout_plan(
            dp_sampling=ctx.dp_sampling, real_bs=bs, bucket_bs=bucket_bs, tp_size=LOGITS_TP)
        self.input_buffers.input_ids_buf[:bs].copy_(input_ids)
        sampling_info = SamplingBatchInfo(is_all_greedy=True, dp_sampling=ctx.dp_sampling)
        return self.forward_step(bs, ctx, sampling_info)

    def execute_idle_forward(self, global_num_tokens, global_bs):
        """Run a zero-token forward so this rank participates in the collectives."""
        ctx = ForwardContext(bs=0, global_num_tokens=list(global_num_tokens), global_bs=list(global_bs))
        if self.variant == "fix":
            ctx.dp_sampling, _use_graph, bucket_bs = self.forward_step.dp_sampling_route(0, ctx)
            ctx.logits_layout_plan = self.sampling_backend.build_logits_layout_plan(
                dp_sampling=ctx.dp_sampling, real_bs=0, bucket_bs=bucket_bs, tp_size=LOGITS_TP)
        sampling_info = SamplingBatchInfo(is_all_greedy=True, dp_sampling=ctx.dp_sampling)
        if self.forward_step.can_run(bs=0, ctx=ctx):
            padded_bs = self.forward_step.padded_bs(0, ctx)
            self.input_buffers.fill_dummy_decode_buffers(batch_size=padded_bs)
            self.forward_step(0, ctx, sampling_info)     # IDLE produces no tokens
            return
        # eager IDLE forward: no attention, no sampler; nothing of it is returned


def run(variant: str, device: str = "cpu"):
    gen = generator(58)
    model = Model(device, gen)
    batches = [torch.randint(0, VOCAB, (bs[0],), generator=gen).to(device) for bs in STEPS]

    def serve(enforce_eager):
        ranks = [ModelExecutor(model, device, variant, enforce_eager) for _ in range(DP_SIZE)]
        outs = []
        for global_bs, input_ids in zip(STEPS, batches):
            outs.append(ranks[0].execute_forward(input_ids, global_bs).clone())
            ranks[1].execute_idle_forward(global_bs, global_bs)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
