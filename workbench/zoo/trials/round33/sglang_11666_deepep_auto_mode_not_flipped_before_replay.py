"""A DeepEP low-latency decode graph replays over a buffer the preceding normal-mode prefill left dirty.

Upstream: https://github.com/sgl-project/sglang/pull/11666 ("Manually flip deepep_mode for cuda_graph").
Symptom: serving with ``--moe-a2a-backend deepep --deepep-mode auto`` and CUDA graphs on, the first decode
replay after a prefill batch triggers a CUDA illegal memory access in DeepEP (or in the DeepGEMM kernel
that follows it); with ``--disable-cuda-graph`` the same workload runs.
Mechanism: in ``auto`` mode every MoE layer resolves its dispatch mode per batch
(``DeepEPMode.resolve(is_extend_in_batch)``: normal for extend batches, low-latency for decode). The
dispatcher implementation's ``_get_buffer`` then calls ``DeepEPBuffer.set_dispatch_mode_as_normal()`` or
``set_dispatch_mode_as_low_latency()``; the latter runs ``clean_buffer()``
(``Buffer.clean_low_latency_buffer``) only when the class-level ``_dispatch_mode`` is ``NORMAL``, i.e. when
the previous batch used the normal kernels, which stage their tokens in the same RDMA region and leave it
dirty. The low-latency kernels assume a clean receive region (they accumulate into it and clean it after
use themselves). That Python branch ran while the decode graphs were captured, when the mode was not
``NORMAL``: no clean kernel was recorded. ``CudaGraphRunner.replay`` runs none of it, so after a prefill
(``_dispatch_mode == NORMAL``) the decode replay dispatches into the dirty receive region, while an eager
decode step would have flipped the mode and cleaned it first. Here the dirty slots add the prefill's staged
tokens to the experts' inputs (wrong numbers instead of the device fault of real DeepEP).
Doctor: warmup-divergence, at ``set_dispatch_mode_as_low_latency`` (the clean-or-not branch decided at
capture, that replays reuse while an eager decode step after a prefill decides to clean).
Fix (upstream): a ``DeepEPCudaGraphRunnerAdapter``: ``capture(is_extend_in_batch)`` records the resolved
mode and sets it before capture; ``replay()`` calls ``DeepEPBuffer.set_dispatch_mode(captured mode)`` at the
start of every ``CudaGraphRunner.replay``, so the flip and its buffer clean run on the host before the
graph's kernels.
Sources: the PR description and the truncated review diff of ``cuda_graph_runner.py``; the adapter class
and ``DeepEPBuffer.set_dispatch_mode*`` / ``clean_buffer`` read in stored sglang sources after the merge.
Simplified: real DeepEP low-latency kernels double-buffer and clean the other half; here one region is
cleaned after use.
"""
from __future__ import annotations

import enum

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/11666"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "set_dispatch_mode_as_low_latency"
SYMPTOM = "decode replay after a prefill dispatches into a DeepEP buffer left dirty (IMA upstream)"

VOCAB, HIDDEN, NUM_EXPERTS = 16, 4, 3
NUM_MAX_DISPATCH_TOKENS_PER_RANK = 8
CAPTURE_BS = 4


class DeepEPMode(enum.Enum):
    NORMAL = "normal"
    LOW_LATENCY = "low_latency"
    AUTO = "auto"

    def resolve(self, is_extend_in_batch: bool) -> "DeepEPMode":
        if self != DeepEPMode.AUTO:
            return self
        return DeepEPMode.NORMAL if is_extend_in_batch else DeepEPMode.LOW_LATENCY

    def is_normal(self) -> bool:
        return self == DeepEPMode.NORMAL

    def is_low_latency(self) -> bool:
        return self == DeepEPMode.LOW_LATENCY


class DeepEPDispatchMode(enum.Enum):
    NORMAL = 0
    LOW_LATENCY = 1


class Buffer:
    """``deep_ep.Buffer`` built with ``low_latency_mode=True`` (``--deepep-mode auto``): one RDMA region that
    the normal kernels use as their staging area and the low-latency kernels as per-expert receive slots."""

    def __init__(self, device):
        self.low_latency_mode = True
        self.rdma_buffer = torch.zeros(NUM_EXPERTS, NUM_MAX_DISPATCH_TOKENS_PER_RANK, HIDDEN, device=device)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        self.rdma_buffer.zero_()

    def dispatch(self, x):
        """Normal dispatch: tokens are staged through the RDMA region, which is left as it is."""
        staging = self.rdma_buffer.view(-1, HIDDEN)[: x.shape[0]]
        staging.copy_(x)
        return staging

    def low_latency_dispatch(self, x, topk_idx):
        """Low-latency dispatch: each token lands in its expert's receive slot by accumulation (the
        receive region must be clean); returns the per-expert receive buffer."""
        recv = self.rdma_buffer
        slot = topk_idx * NUM_MAX_DISPATCH_TOKENS_PER_RANK + torch.arange(x.shape[0], device=x.device)
        recv.view(-1, HIDDEN).index_add_(0, slot, x)
        return recv

    def low_latency_combine(self, expert_out, topk_idx):
        tokens = torch.arange(topk_idx.shape[0], device=topk_idx.device)
        out = expert_out[topk_idx, tokens]
        self.rdma_buffer.zero_()      # the kernels clean the receive region they used, for the next LL round
        return out


class DeepEPBuffer:
    _buffer: Buffer | None = None
    _dispatch_mode: DeepEPDispatchMode | None = None

    @classmethod
    def reset(cls, device):
        cls._buffer = Buffer(device)
        cls._dispatch_mode = None

    @classmethod
    def get_deepep_buffer(cls):
        return cls._buffer

    @classmethod
    def clean_buffer(cls):
        if not cls._buffer.low_latency_mode:
            return
        cls._buffer.clean_low_latency_buffer(NUM_MAX_DISPATCH_TOKENS_PER_RANK, HIDDEN, NUM_EXPERTS)

    @classmethod
    def set_dispatch_mode_as_normal(cls):
        cls._dispatch_mode = DeepEPDispatchMode.NORMAL

    @classmethod
    def set_dispatch_mode_as_low_latency(cls):
        if cls._dispatch_mode == DeepEPDispatchMode.NORMAL:
            cls.clean_buffer()
        cls._dispatch_mode = DeepEPDispatchMode.LOW_LATENCY

    @classmethod
    def set_dispatch_mode(cls, mode: DeepEPMode):
        if mode.is_low_latency():
            cls.set_dispatch_mode_as_low_latency()
        elif mode.is_normal():
            cls.set_dispatch_mode_as_normal()
        else:
            raise Exception("unsupported mode")


class _DeepEPDispatcherImplNormal:
    def _get_buffer(self):
        DeepEPBuffer.set_dispatch_mode_as_normal()
        return DeepEPBuffer.get_deepep_buffer()

    def run(self, x, topk_idx, experts_w):
        recv_x = self._get_buffer().dispatch(x)
        return torch.tanh((recv_x[:, None, :] @ experts_w[topk_idx]).squeeze(1))


class _DeepEPDispatcherImplLowLatency:
    def _get_buffer(self):
        DeepEPBuffer.set_dispatch_mode_as_low_latency()
        return DeepEPBuffer.get_deepep_buffer()

    def run(self, x, topk_idx, experts_w):
        buffer = self._get_buffer()
        recv = buffer.low_latency_dispatch(x, topk_idx)          # [experts, slots, hidden]
        expert_out = torch.tanh(recv @ experts_w)                # grouped GEMM over every expert's slots
        return buffer.low_latency_combine(expert_out, topk_idx)


class DeepEPDispatcher:
    def __init__(self, deepep_mode: DeepEPMode):
        self.deepep_mode = deepep_mode
        self._normal_dispatcher = _DeepEPDispatcherImplNormal()
        self._low_latency_dispatcher = _DeepEPDispatcherImplLowLatency()

    def _get_impl(self, forward_batch):
        resolved = self.deepep_mode.resolve(forward_batch.is_extend_in_batch)
        return self._normal_dispatcher if resolved.is_normal() else self._low_latency_dispatcher


class ForwardBatch:
    def __init__(self, input_ids, is_extend_in_batch):
        self.input_ids, self.is_extend_in_batch = input_ids, is_extend_in_batch
        self.batch_size = input_ids.shape[0]


class DeepseekV2MoE:
    def __init__(self, device):
        gen = generator(11666)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.gate = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device)
        self.experts_w = randn(NUM_EXPERTS, HIDDEN, HIDDEN, gen=gen, device=device, scale=0.8)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.dispatcher = DeepEPDispatcher(DeepEPMode.AUTO)

    def forward(self, input_ids, forward_batch):
        h = self.embed[input_ids]
        topk_idx = (h @ self.gate).argmax(-1)
        impl = self.dispatcher._get_impl(forward_batch)
        return (h + impl.run(h, topk_idx, self.experts_w)) @ self.lm_head


class DeepEPCudaGraphRunnerAdapter:
    def __init__(self):
        self._captured_deepep_mode = None

    def capture(self, is_extend_in_batch: bool):
        self._captured_deepep_mode = DeepEPMode.AUTO.resolve(is_extend_in_batch=is_extend_in_batch)
        DeepEPBuffer.set_dispatch_mode(self._captured_deepep_mode)

    def replay(self):
        assert self._captured_deepep_mode is not None
        DeepEPBuffer.set_dispatch_mode(self._captured_deepep_mode)


class CudaGraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.variant = model, variant
        self.deepep_adapter = DeepEPCudaGraphRunnerAdapter()
        self.input_ids = torch.zeros(CAPTURE_BS, dtype=torch.long, device=device)
        capture_batch = ForwardBatch(self.input_ids, is_extend_in_batch=False)
        if variant == "fix":
            self.deepep_adapter.capture(is_extend_in_batch=False)
        self.graph, self.output = capture(
            lambda: model.forward(self.input_ids, capture_batch), device=device,
            owner="CudaGraphRunner (decode)", static={"input_ids": self.input_ids},
            state={"deepep_rdma_buffer": DeepEPBuffer.get_deepep_buffer().rdma_buffer})

    def replay(self, forward_batch):
        if self.variant == "fix":
            self.deepep_adapter.replay()
        self.input_ids.copy_(forward_batch.input_ids)
        return replay(self.graph, self.output).clone()


def run(variant: str, device: str = "cpu"):
    model = DeepseekV2MoE(device)
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731

    def serve(graphed: bool):
        DeepEPBuffer.reset(device)
        runner = CudaGraphRunner(model, device, variant) if graphed else None

        def forward(ids, is_extend):
            batch = ForwardBatch(t(ids), is_extend)
            if runner is not None and not is_extend:
                return runner.replay(batch)
            return model.forward(batch.input_ids, batch).clone()

        outs = [forward([3, 9, 14, 1, 6, 11], True),        # prefill: normal dispatch
                forward([2, 7, 12, 5], False),              # decode: low-latency
                forward([8, 4, 15, 10], False),
                forward([13, 0, 7, 3, 9], True),            # a new request's prefill
                forward([1, 6, 11, 2], False)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
