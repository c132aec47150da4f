"""Breakable-graph shared output buffer aliases the first capture's sharded output; smaller buckets serve key-size rows.

Upstream: https://github.com/sgl-project/sglang/pull/30834 ("[cuda-graph] Size breakable-graph shared buffer from
warmup output; slice by produced row count").
Symptom: with a model-level sequence-parallel scheme that keeps hidden states sharded through the captured region
(each rank's body returns ``num_tokens / sp_size`` rows and gathers later), prefill breakable CUDA graph (BCG) replay
returned outputs with the wrong number of rows for the smaller token buckets (or the capture of a bucket failed when
its copy into the shared buffer did not fit); eager prefill was fine (reported on an internal deployment, sglang main,
July 2026).
Mechanism: ``BreakableCudaGraphBackend.capture_one`` shares one output buffer across the per-bucket graphs: the first
(largest) capture's output tensor itself becomes ``_shared_output_buffer``, and every later capture records
``_copy_output_to_buffer(out, buffer, size)`` -- ``buffer[:size].copy_(out[:size])`` -- and stores
``_slice_output(buffer, size)``, both sliced by the shape key's size. That assumes the body produces exactly
``shape_key.size`` leading rows. A body that returns this rank's token shard produces ``size / sp`` rows: the aliased
buffer holds only ``max_size / sp`` rows, and for a smaller bucket the captured copy broadcasts the shard into
``size`` rows and the stored view hands out ``size`` rows -- twice the rows the graph computed, the extra ones a
copy of another token (for a bucket whose ``size`` exceeds the buffer's rows the copy does not fit at all).
Doctor: undersized-buffer, at ``capture_one`` (the stored view of the shared buffer serves ``shape_key.size`` rows
while the captured body produced ``size / sp``; the buffer itself was sized from the first capture's shard).
Fix (upstream): allocate the shared output buffer up front from the warmup output, sized to the first capture's full
shape-key size (instead of aliasing that capture's output), and copy/slice each capture's output by the row count the
body actually produced (``_output_rows``, clamped to the shape-key size).
(Tiny body: one decoder MLP on input embeddings, SP size 2 as seen from rank 0, buckets 8 and 2 tokens. I read the PR
description and the pre-fix ``BreakableCudaGraphBackend`` code; the post-fix code is modelled from the description.)
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/30834"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "capture_one"
SYMPTOM = "smaller prefill buckets hand out twice the rows the sharded graph body produced (a duplicated token row)"

HIDDEN, SP_SIZE, SP_RANK = 4, 2, 0
CAPTURE_NUM_TOKENS = [8, 2]          # captured largest first (the backend's assumption)
MAX_NUM_TOKENS = max(CAPTURE_NUM_TOKENS)


class ShardedDecoder:
    """Model-level sequence parallelism: the body keeps this rank's token shard (gathered later, outside)."""

    def __init__(self, device):
        gen = generator(30834)
        self.w_up = randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.6)
        self.w_down = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)

    def forward(self, input_embeds):
        shard = input_embeds.shape[0] // SP_SIZE
        h = input_embeds[SP_RANK * shard:(SP_RANK + 1) * shard]
        return torch.nn.functional.silu(h @ self.w_up) @ self.w_down + h


class BreakableCudaGraphBackend:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self._graphs, self._outputs = {}, {}
        self._pool = graph_pool_handle(device)
        self._shared_output_buffer = None
        self._buffer_rows = 0

    def _slice_output(self, output, num_tokens):
        return output[:num_tokens]

    def _copy_output_to_buffer(self, output, output_buffer, num_tokens):
        output_buffer[:num_tokens].copy_(output[:num_tokens])

    def _output_rows(self, output, size):
        return min(output.shape[0], size)

    def capture_one(self, shape_key, forward_fn, static):
        size = shape_key
        for _ in range(2):
            with events.warmup():
                warm = forward_fn()
        if self.variant == "fix":
            if self._shared_output_buffer is None:
                # Sized to the first (largest) capture's full key size, not to what its body returned.
                self._shared_output_buffer = torch.zeros((size,) + tuple(warm.shape[1:]), dtype=warm.dtype,
                                                         device=warm.device)
                self._buffer_rows = size
                events.shared_outputs("BreakableCudaGraphBackend", {"shared_output_buffer": self._shared_output_buffer})
            rows = self._output_rows(warm, size)
        else:
            rows = size

        def captured():
            out = forward_fn()
            if self._shared_output_buffer is not None:
                self._copy_output_to_buffer(out, self._shared_output_buffer, rows)
            return out

        g, out = capture(captured, device=self.device, pool=self._pool, warmups=0, name=f"prefill bcg {size} tokens",
                         owner="BreakableCudaGraphBackend", static=static)
        if self._shared_output_buffer is None:
            self._shared_output_buffer = out        # alias the first capture's output
            self._buffer_rows = out.shape[0]
            events.shared_outputs("BreakableCudaGraphBackend", {"shared_output_buffer": out})
            stored = self._slice_output(out, size)
        else:
            stored = self._slice_output(self._shared_output_buffer, rows)
        self._graphs[shape_key] = g
        self._outputs[shape_key] = stored

    def replay(self, shape_key):
        return replay(self._graphs[shape_key], self._outputs[shape_key])


class PrefillCudaGraphRunner:
    def __init__(self, model, device, variant):
        self.model = model
        self.input_embeds = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.backend = BreakableCudaGraphBackend(device, variant)
        for num_tokens in CAPTURE_NUM_TOKENS:
            self.backend.capture_one(num_tokens, lambda n=num_tokens: model.forward(self.input_embeds[:n]),
                                     static={"input_embeds": self.input_embeds})

    def execute(self, input_embeds):
        n = input_embeds.shape[0]
        self.input_embeds[:n].copy_(input_embeds)
        return self.backend.replay(n).clone()


def run(variant: str, device: str = "cpu"):
    model = ShardedDecoder(device)
    gen = generator(7)
    prompts = [randn(n, HIDDEN, gen=gen, device=device) for n in (8, 2, 8, 2)]

    def eager():
        return [model.forward(x) for x in prompts]

    def served():
        runner = PrefillCudaGraphRunner(model, device, variant)
        return [runner.execute(x) for x in prompts]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
