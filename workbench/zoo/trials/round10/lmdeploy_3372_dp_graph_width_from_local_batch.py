"""Under DP, a decode graph keyed by the ranks' padded batch is captured over this rank's own, smaller batch.

Upstream: https://github.com/InternLM/lmdeploy/pull/3372 ("fix dp cudagraph", commit f055cc2e).
Symptom: PyTorch engine with data parallelism (``dp > 1``) and CUDA graphs: decoding breaks (wrong or
missing rows, a shape error, or ranks hanging in the MoE gather) once a rank's local decode batch grows
past the batch it had when its graph was captured; ``dp = 1`` or eager mode are fine (lmdeploy 0.7.x,
March 2025).
Mechanism: with DP every rank must replay a graph of the same size, so ``ModelAgent`` gathers the ranks'
batch sizes and stores the largest as ``meta.padding_batch_size``; ``CUDAGraphRunner.get_graph_key``
keys the graph on ``next_power_of_2(padding_batch_size)`` and the runner allocates buffers for that many
rows. ``CudaGraphMixin.fill_buffers_cudagraph``, though, still sliced the buffers it hands to the model to
``next_power_of_2(batch_size)`` of this rank's *local* batch. The capture, made by the first step that
reached the key, therefore recorded the model over the capturing step's local rows only (one here, while
another rank had four). A later step of the same key with three local rows writes them into the buffers
and replays a graph that computes one row and whose logits buffer holds one.
Doctor: undersized-buffer, at ``fill_buffers_cudagraph`` (the graph serves more rows than its capture
covered: the capture width came from the local batch, not from the graph's buffers).
Fix (upstream): slice the inputs to the graph's own size, ``input_buffers['block_offsets'].size(0)``
(also for the FlashMLA ``num_splits`` copy), and set ``dp_meta.tp_sizes`` to the padded size in
``update_inputs``. (The ``tp_sizes`` part, for the MoE gather across ranks, is not modelled here.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/3372"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "fill_buffers_cudagraph"
SYMPTOM = "a DP decode graph captured over 1 local row is replayed for 3: the logits of rows 1-2 are missing"
VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 8, 4, 2, 12, 3


def next_power_of_2(n: int):
    """Return the smallest power of 2 greater than or equal to n."""
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass
class AttnMetadata:
    block_offsets: torch.Tensor
    q_start_loc: torch.Tensor
    q_seqlens: torch.Tensor
    kv_seqlens: torch.Tensor
    is_decoding: bool = True


@dataclasses.dataclass
class CudaGraphMeta:
    """Meta info of cudagraph."""
    max_batchs: int
    max_tokens: int
    num_blocks: int
    is_decoding: int
    device: str
    input_buffers: dict = None
    output_buffers: dict = None


@dataclasses.dataclass
class GraphRunnerMeta:
    padding_batch_size: int = None


class InternLM2ForCausalLM:
    """One decode layer: the token's embedding attends over its paged K/V cache, then the LM head."""

    def __init__(self, device, variant):
        gen = generator(3372)
        self.variant = variant
        self.tok_embeddings = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.output = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.k_cache = randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device)
        self.v_cache = randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata: AttnMetadata, **kwargs):
        h = self.tok_embeddings[input_ids[0]]                                   # [tokens, DIM]
        pos = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=h.device)
        slots = attn_metadata.block_offsets[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        scores = (self.k_cache[slots] @ (h @ self.wq)[:, :, None]).squeeze(-1) / DIM ** 0.5
        scores = scores.masked_fill(pos[None, :] >= attn_metadata.kv_seqlens[:, None], -1e4)
        attn = (torch.softmax(scores, -1)[:, :, None] * self.v_cache[slots]).sum(1)
        return ((h + attn) @ self.output)[None]                                 # [1, tokens, VOCAB]

    # CudaGraphMixin
    def make_buffers_cudagraph(self, graph_meta: CudaGraphMeta, *args, **kwargs) -> dict:
        """make cudagraph buffers from forward inputs."""
        max_batches, max_tokens, device = graph_meta.max_batchs, graph_meta.max_tokens, graph_meta.device
        input_buffers = dict()
        input_buffers['input_ids'] = torch.zeros(1, max_tokens, dtype=torch.int64, device=device)
        input_buffers['position_ids'] = torch.zeros((1, max_tokens), dtype=torch.int64, device=device)
        input_buffers['block_offsets'] = torch.zeros((max_batches, graph_meta.num_blocks), dtype=torch.int64,
                                                     device=device)
        input_buffers['qkv_lens'] = torch.zeros(3, max_batches, dtype=torch.int64, device=device)
        input_buffers['q_start_loc'] = input_buffers['qkv_lens'][0]
        input_buffers['q_seqlens'] = input_buffers['qkv_lens'][1]
        input_buffers['kv_seqlens'] = input_buffers['qkv_lens'][2]
        return input_buffers

    def fill_buffers_cudagraph(self, graph_meta: CudaGraphMeta, input_ids, position_ids, past_key_values,
                               attn_metadata: AttnMetadata, inputs_embeds=None, **kwargs) -> dict:
        """fill cudagraph buffers from forward inputs."""
        block_offsets = attn_metadata.block_offsets
        input_buffers = graph_meta.input_buffers

        batch_size, num_blocks = block_offsets.size()
        num_tokens = input_ids.size(-1)

        # fill buffer
        input_buffers['input_ids'][:, :num_tokens] = input_ids
        input_buffers['position_ids'][:, :num_tokens] = position_ids
        input_buffers['block_offsets'][:batch_size, :num_blocks] = block_offsets

        qkv = torch.stack((attn_metadata.q_start_loc, attn_metadata.q_seqlens, attn_metadata.kv_seqlens))
        input_buffers['qkv_lens'].zero_()
        input_buffers['qkv_lens'][:, :batch_size] = qkv

        # create inputs
        if self.variant == "bug":
            new_batch_size = next_power_of_2(batch_size)
        else:
            new_batch_size = input_buffers['block_offsets'].size(0)
        attn_metadata = AttnMetadata(block_offsets=input_buffers['block_offsets'][:new_batch_size],
                                     q_start_loc=input_buffers['q_start_loc'][:new_batch_size],
                                     q_seqlens=input_buffers['q_seqlens'][:new_batch_size],
                                     kv_seqlens=input_buffers['kv_seqlens'][:new_batch_size])
        return dict(past_key_values=past_key_values, attn_metadata=attn_metadata,
                    input_ids=input_buffers['input_ids'][:, :new_batch_size],
                    position_ids=input_buffers['position_ids'][:, :new_batch_size])


class CUDASingleGraphRunner:
    """cuda single graph runner."""

    def __init__(self, model, max_batches: int, max_tokens: int, num_blocks: int, is_decoding: bool, pool,
                 device):
        self.model = model
        self.meta = CudaGraphMeta(max_batchs=max_batches, max_tokens=max_tokens, num_blocks=num_blocks,
                                  is_decoding=is_decoding, device=device, input_buffers=dict(),
                                  output_buffers=dict())
        self.device, self.pool, self._graph = device, pool, None

    def capture(self, **kwargs):
        """capture graph."""
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta, **kwargs)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        bufs = self.meta.input_buffers
        self._graph, output = capture(lambda: self.model.forward(**padded_kwargs), device=self.device,
                                      pool=self.pool, warmups=1, name=f"decode {self.meta.max_tokens}",
                                      static={k: bufs[k] for k in ('input_ids', 'position_ids', 'block_offsets',
                                                                   'qkv_lens')},
                                      owner="lmdeploy CUDASingleGraphRunner")
        self.meta.output_buffers = dict(logits=output)
        return output

    def forward(self, **kwargs):
        """forward."""
        num_tokens = kwargs['input_ids'].size(-1)
        self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        logits = replay(self._graph, self.meta.output_buffers['logits'], real=num_tokens,
                        size=self.meta.max_tokens)
        return logits[:, :num_tokens]


class CUDAGraphRunner:
    """cuda graph runner."""

    def __init__(self, model, num_blocks: int, device):
        self.model, self.num_blocks, self.device = model, num_blocks, device
        self.graph_pool_handle = graph_pool_handle(device)
        self._runner_map = dict()
        self._runner_meta = GraphRunnerMeta()

    def get_meta(self):
        return self._runner_meta

    def get_graph_key(self, input_ids, **kwargs):
        """get graph key."""
        num_tokens = input_ids.numel()
        meta = self.get_meta()
        if meta.padding_batch_size is None:
            new_num_tokens = next_power_of_2(num_tokens)
        else:
            new_num_tokens = next_power_of_2(meta.padding_batch_size)
        return (new_num_tokens, True)

    def __call__(self, **kwargs):
        graph_key = self.get_graph_key(**kwargs)
        max_tokens = graph_key[0]
        if graph_key not in self._runner_map:
            runner = CUDASingleGraphRunner(self.model, max_batches=max_tokens, max_tokens=max_tokens,
                                           num_blocks=self.num_blocks, is_decoding=True,
                                           pool=self.graph_pool_handle, device=self.device)
            runner.capture(**kwargs)
            self._runner_map[graph_key] = runner
        else:
            runner = self._runner_map[graph_key]
        return runner.forward(**kwargs)


def run(variant: str, device: str = "cpu"):
    model = InternLM2ForCausalLM(device, variant)
    # This DP rank's decode steps: (tokens, kv lengths, block tables), and every rank's batch size
    # (all_gather in ModelAgent): another rank keeps four requests running.
    steps = [([3], [3], [[1, 2, 0]], [1, 4]),
             ([5, 1, 6], [4, 2, 5], [[1, 2, 0], [3, 0, 0], [4, 5, 6]], [3, 4]),
             ([2, 7], [5, 3], [[1, 2, 7], [3, 8, 0]], [2, 4])]

    def inputs(ids, kv_lens, tables):
        n = len(ids)
        meta = AttnMetadata(block_offsets=torch.tensor(tables, device=device),
                            q_start_loc=torch.arange(n, device=device),
                            q_seqlens=torch.ones(n, dtype=torch.int64, device=device),
                            kv_seqlens=torch.tensor(kv_lens, device=device))
        return dict(input_ids=torch.tensor([ids], device=device),
                    position_ids=torch.tensor([[k - 1 for k in kv_lens]], device=device),
                    past_key_values=None, attn_metadata=meta)

    def eager():
        return [model.forward(**inputs(*s[:3])).clone() for s in steps]

    def served():
        runner, outs = CUDAGraphRunner(model, MAX_BLOCKS, device), []
        for ids, kv_lens, tables, all_batch_sizes in steps:
            runner.get_meta().padding_batch_size = max(all_batch_sizes)     # dp > 1 and decoding
            outs.append(runner(**inputs(ids, kv_lens, tables)).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
