"""A graph reset keeps the DP ``padding_batch_size``: the warmup after wakeup captures every decode graph too small.

Upstream: https://github.com/InternLM/lmdeploy/pull/4741 ("Fix mtp dpmeta and guard the warmup", commit
b56ddfb6; the "Reset graph-runner padding metadata" part: ``GraphRunner.reset`` clears
``_runner_meta.padding_batch_size``).
Symptom: RL rollouts with the PyTorch engine under DP (Qwen3.5 MTP with DP/EP): after ``sleep`` and
``wakeup`` the engine fails while warming up again (reported as DeepEP timeouts: one rank fails, the others
wait); a fresh engine warms up fine (lmdeploy main, July 2026). The failure is reconstructed from the diff.
Mechanism: under DP, ``_prepare_dp_v1`` writes the DP-wide decode batch size into the graph runner's
``GraphRunnerMeta.padding_batch_size`` before each decode step, and ``CUDAGraphRunner.get_graph_key``
prefers it over the local batch size (every rank must replay the same graph). ``sleep`` calls
``reset_graph_runner``, which drops the captured graphs but kept the meta. ``wakeup`` warms up again, and
warmup forwards bypass ``_prepare_dp_v1``: each warmup batch (largest capture size first) gets its graph
key, and so the ``max_batches``/``max_tokens`` of the graph captured for it, from the stale
``padding_batch_size`` of the last decode step before sleep. When that step was small (the tail of a
rollout), the warmup batch does not fit the static buffers its graph was just sized with.
Doctor: undersized-buffer, at ``get_graph_key`` (the capture size comes from a stale padding value,
smaller than the batch the capture must hold).
Fix (upstream): ``GraphRunner.reset`` sets ``self._runner_meta.padding_batch_size = None`` and
``CUDAGraphRunner.reset`` calls ``super().reset()``.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/4741"
FAMILY = "warmup/capture vs replay state"
KIND = "undersized-buffer"
SITE = "get_graph_key"
SYMPTOM = "warmup after sleep/wakeup captures the 4-sequence decode graph with 1-sequence buffers and fails"
VOCAB, HIDDEN, MAX_POS, MAX_BATCHES, DP = 13, 4, 32, 4, 2


@dataclasses.dataclass
class GraphRunnerMeta:
    padding_batch_size: int = None


@dataclasses.dataclass
class DPMeta:
    dp_batches: list
    dp_is_decoding: bool


@dataclasses.dataclass
class ModelInputs:
    input_ids: torch.Tensor            # [1, num_tokens]
    position_ids: torch.Tensor         # [1, num_tokens]
    is_decoding: bool
    dp_meta: DPMeta = None


@dataclasses.dataclass
class CudaGraphMeta:
    max_batchs: int
    max_tokens: int
    device: str
    input_buffers: dict = None
    output_buffers: dict = None


class Qwen3_5ForCausalLM:
    """Token-wise here: the decode graph's inputs are the token ids and their positions."""

    def __init__(self, device):
        gen = generator(4741)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.rotary = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.3)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def __call__(self, input_ids, position_ids):
        h = self.embed_tokens[input_ids] + self.rotary[position_ids]
        return torch.tanh(h @ self.w) @ self.lm_head

    # CudaGraphMixin
    def make_buffers_cudagraph(self, graph_meta: CudaGraphMeta):
        device = graph_meta.device
        return dict(input_ids=torch.zeros(1, graph_meta.max_tokens, dtype=torch.long, device=device),
                    position_ids=torch.zeros(1, graph_meta.max_tokens, dtype=torch.long, device=device))

    def fill_buffers_cudagraph(self, graph_meta: CudaGraphMeta, input_ids, position_ids):
        input_buffers = graph_meta.input_buffers
        num_tokens = input_ids.size(-1)
        input_buffers['input_ids'].zero_()
        input_buffers['input_ids'][:, :num_tokens] = input_ids
        input_buffers['position_ids'].zero_()
        input_buffers['position_ids'][:, :num_tokens] = position_ids
        return dict(input_ids=input_buffers['input_ids'], position_ids=input_buffers['position_ids'])


class ARCudagraphStrategy:
    def get_max_tokens(self, batch_size: int, origin_batch_size: int, num_tokens: int) -> int:
        return batch_size                                   # decoding: one token per sequence


class CUDASingleGraphRunner:
    def __init__(self, model, max_batches, max_tokens, pool, device):
        self.model, self.pool, self.device = model, pool, device
        self.meta = CudaGraphMeta(max_batchs=max_batches, max_tokens=max_tokens, device=device)
        self._graph = None

    def capture(self, input_ids, position_ids):
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, input_ids, position_ids)
        events.static_buffers(f'CUDASingleGraphRunner(max_batchs={self.meta.max_batchs})', self.meta.input_buffers)
        with events.warmup(real=True):
            warmup_output = self.model(**padded_kwargs)
        self._graph = new_graph(self.device)
        with graph(self._graph, pool=self.pool, name=f'decode max_batchs={self.meta.max_batchs}'):
            output = self.model(**padded_kwargs)
        self.meta.output_buffers = dict(logits=output)
        return warmup_output[:, :input_ids.size(-1)]

    def forward(self, input_ids, position_ids):
        self.model.fill_buffers_cudagraph(self.meta, input_ids, position_ids)
        logits = self.meta.output_buffers['logits']
        events.serve(self._graph, input_ids.size(-1), self.meta.max_tokens,
                     padded={'input_ids': self.meta.input_buffers['input_ids'][0]}, outputs=logits)
        self._graph.replay()
        return logits[:, :input_ids.size(-1)]


class GraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self._runner_meta = GraphRunnerMeta()

    def reset(self):
        """Remove all graphs to prevent hanging on exit."""
        if self.variant == 'fix':
            self._runner_meta.padding_batch_size = None

    def get_meta(self):
        return self._runner_meta

    def get_capture_batch_sizes(self):
        ret, batch_size = [], 1
        while batch_size < MAX_BATCHES:
            ret.append(batch_size)
            batch_size *= 2
        ret.append(MAX_BATCHES)
        return ret


class CUDAGraphRunner(GraphRunner):
    def __init__(self, model, device, variant, eager_mode: bool):
        super().__init__(model, device, variant)
        self.eager_mode = eager_mode
        self.graph_pool_handle = graph_pool_handle(device)
        self._runner_map: dict = {}
        self.cudagraph_strategy = ARCudagraphStrategy()

    def _get_capture_tokens(self, batch_size: int):
        for size in self.get_capture_batch_sizes():
            if size >= batch_size:
                return size
        assert False, f'Unsupported batch_size={batch_size}'

    def get_graph_key(self, input_ids, batch_size: int, is_decoding: bool):
        """Get graph key."""
        meta = self.get_meta()
        query_len = input_ids.size(1) // batch_size
        if meta.padding_batch_size is None:
            batch_size = self._get_capture_tokens(batch_size)
        else:
            batch_size = self._get_capture_tokens(meta.padding_batch_size)
        return (batch_size, is_decoding, query_len)

    def __call__(self, inputs: ModelInputs):
        if self.eager_mode or not inputs.is_decoding:
            return self.model(inputs.input_ids, inputs.position_ids)
        batch_size = inputs.input_ids.size(-1)
        graph_key = self.get_graph_key(inputs.input_ids, batch_size, inputs.is_decoding)
        if graph_key not in self._runner_map:
            max_batches = graph_key[0]
            max_tokens = self.cudagraph_strategy.get_max_tokens(max_batches, batch_size, inputs.input_ids.size(1))
            runner = CUDASingleGraphRunner(self.model, max_batches, max_tokens, self.graph_pool_handle, self.device)
            output = runner.capture(inputs.input_ids, inputs.position_ids)
            self._runner_map[graph_key] = runner
            return output
        return self._runner_map[graph_key].forward(inputs.input_ids, inputs.position_ids)

    def reset(self):
        """Remove all graphs to prevent hanging on exit."""
        if self.variant == 'fix':
            super().reset()
        self._runner_map.clear()


def make_dummy(batch_size: int, is_decoding: bool, device):
    num_tokens = batch_size if is_decoding else batch_size * 2
    return ModelInputs(input_ids=torch.zeros(1, num_tokens, dtype=torch.long, device=device),
                       position_ids=torch.zeros(1, num_tokens, dtype=torch.long, device=device),
                       is_decoding=is_decoding)


class BaseModelAgent:
    def __init__(self, device, variant, eager_mode: bool):
        self.device = device
        self.model = Qwen3_5ForCausalLM(device)
        self.patched_model = CUDAGraphRunner(self.model, device, variant, eager_mode)
        self.warmup()

    def warmup(self):
        """Warmup: prefill, then one decode per capture batch size (largest first), without DP sync."""
        inputs = make_dummy(MAX_BATCHES, is_decoding=False, device=self.device)
        inputs.dp_meta = DPMeta([MAX_BATCHES] * DP, dp_is_decoding=False)
        self._forward_impl(inputs)
        for num_tokens in sorted(self.patched_model.get_capture_batch_sizes(), reverse=True):
            inputs = make_dummy(num_tokens, is_decoding=True, device=self.device)
            inputs.dp_meta = DPMeta([num_tokens] * DP, dp_is_decoding=True)
            self._forward_impl(inputs)

    def _prepare_dp_v1(self, inputs: ModelInputs, other_rank_batch: int):
        """Gather every DP rank's batch: decoding ranks all pad to the largest one."""
        all_num_tokens = [inputs.input_ids.numel(), other_rank_batch]
        if inputs.is_decoding:
            meta = self.patched_model.get_meta()
            meta.padding_batch_size = max(all_num_tokens)
        inputs.dp_meta = DPMeta(all_num_tokens, dp_is_decoding=inputs.is_decoding)
        return inputs

    def _forward_impl(self, inputs: ModelInputs):
        return self.patched_model(inputs)

    def step(self, token_ids, positions, other_rank_batch: int):
        inputs = ModelInputs(input_ids=torch.tensor([token_ids], device=self.device),
                             position_ids=torch.tensor([positions], device=self.device), is_decoding=True)
        inputs = self._prepare_dp_v1(inputs, other_rank_batch)
        return self._forward_impl(inputs)[0].clone()

    def reset_graph_runner(self):
        self.patched_model.reset()

    def sleep(self):
        self.reset_graph_runner()

    def wakeup(self):
        self.warmup()


def run(variant: str, device: str = "cpu"):
    def serve(eager_mode: bool):
        agent = BaseModelAgent(device, variant, eager_mode)
        outs = [agent.step([3, 5, 7], [4, 6, 9], other_rank_batch=2),     # pads to 3 -> graph of 4
                agent.step([8], [10], other_rank_batch=1)]                 # rollout tail: pads to 1
        agent.sleep()                                                      # update weights, release memory
        agent.wakeup()
        outs.append(agent.step([2, 11], [3, 5], other_rank_batch=2))
        outs.append(agent.step([1, 4, 6, 9], [2, 2, 7, 8], other_rank_batch=3))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
