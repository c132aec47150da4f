"""The shared-expert output made on the aux stream is not recorded on its consumer stream: the caching allocator
hands its block to the next aux-stream allocation while the queued routed+shared combine still has to read it.

Upstream: https://github.com/local-inference-lab/vllm/pull/93 ("Fix shared-expert auxiliary-stream output
lifetime"; the same diff is fork commit 8e46bca85 "moe: record shared expert aux output stream").
Symptom: GLM-5.2 TP6, B12X MoE, BF16 shared experts, fused all-reduce+RMSNorm and CUDA graphs: graph capture
dies with an illegal memory access (Xid 31); a delayed consumer reads the next allocation's data (93, not 17).
Mechanism: ``SharedExperts._run_in_aux_stream`` (``fused_moe/runner/shared_experts.py``) runs
``output = self._layer(shared_experts_input)`` under ``torch.cuda.stream(self._stream)`` (the global
``aux_stream()``), so the caching allocator files ``output``'s block under the aux stream, then
``current_stream().wait_stream(self._stream)`` and returns it; the stale comment said record_stream was not
needed "because we synch the streams". The wait orders the kernels, not the allocator: once Python drops the
last reference (``SharedExperts.output`` clears ``_output[idx]``, the combine is only *enqueued*), the block is
free for the aux stream's next allocation. Upstream does not say which aux allocation outran the consumer (the
PR's test and #706's repro use a delayed consumer); the model makes it concrete with two micro-batches
(``_output`` has a slot per ``dbo_current_ubatch_id()``) whose MoE runs on different current streams: ubatch 1's
``maybe_sync_shared_experts_stream`` makes the aux stream wait ubatch 1's stream only, so its shared expert's
output lands in ubatch 0's block and is written before ubatch 0's queued combine reads it. Capture records
that aliasing into the graph (the emulated allocator and its segment are the process's; streams are in-order
queues the device works off when the host waits: the stream waited on first, then the rest), and every replay
combines ubatch 0's routed output with ubatch 1's shared output. Eager computes the same layers, no streams.
Doctor: dangling-reference, at _run_in_aux_stream (the captured combine reads a block whose owner released it
to the allocator, which handed it to the next aux-stream allocation).
Fix (upstream): ``consumer_stream = current_stream(); consumer_stream.wait_stream(self._stream);
output.record_stream(consumer_stream)``: the free is deferred until the consumer stream has passed (during a
capture, until the capture ends), so the next aux allocation gets another block.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/local-inference-lab/vllm/pull/93"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_run_in_aux_stream"
SYMPTOM = "captured MoE combine reads the next ubatch's shared-expert output: wrong hidden states / IMA at capture"

TOKENS, HIDDEN, INTER, LAYERS, UBATCHES, STEPS = 2, 4, 6, 2, 2, 3


class Stream:
    """A CUDA stream in miniature: launches run in order, when the host (or another stream) waits on them."""

    def __init__(self, device_streams: list) -> None:
        self.queue, self.done, self.all = [], 0, device_streams
        device_streams.append(self)

    def launch(self, fn) -> None:
        self.queue.append(fn)

    def position(self) -> int:
        return len(self.queue)

    def run_until(self, position: int) -> None:
        while self.done < position:
            self.done += 1
            self.queue[self.done - 1]()

    def wait_stream(self, other: "Stream") -> None:
        at = other.position()
        self.launch(lambda: other.run_until(at))

    def synchronize_all(self) -> None:
        self.run_until(len(self.queue))
        for other in self.all:
            other.run_until(len(other.queue))


class DataPtr:
    """What Python owns of an allocation; when its last reference goes, the block goes back to the allocator."""

    def __init__(self, allocator, block: int) -> None:
        self.allocator, self.block, self.stream_uses = allocator, block, []

    def record_stream(self, stream: Stream) -> None:
        self.stream_uses.append((stream, stream.position()))

    def __del__(self) -> None:
        self.allocator.free(self.block, self.stream_uses)


class CachingAllocator:
    """The CUDA caching allocator in miniature: one segment of equal blocks, free lists per stream."""

    def __init__(self, device: str, blocks: int) -> None:
        self.segment = torch.zeros(blocks, TOKENS, HIDDEN, device=device)
        self.owner_stream: dict = {}
        self.free_blocks: list = []                 # (block, stream)
        self.pending: list = []                     # (block, stream, [(use stream, position)])
        self.next_unused = 0

    def malloc(self, stream: Stream) -> DataPtr:
        self.process_events()
        for i, (block, owner) in enumerate(self.free_blocks):
            if owner is stream:                     # a freed block of this stream: reused at once
                del self.free_blocks[i]
                return DataPtr(self, block)
        block, self.next_unused = self.next_unused, self.next_unused + 1
        self.owner_stream[block] = stream
        return DataPtr(self, block)

    def free(self, block: int, stream_uses: list) -> None:
        if stream_uses:                             # insert_events (deferred until no capture)
            self.pending.append((block, stream_uses))
        else:
            self.free_blocks.insert(0, (block, self.owner_stream[block]))

    def process_events(self) -> None:
        if torch.cuda.is_current_stream_capturing():   # needs_events_deferred_until_no_capture
            return
        for block, uses in list(self.pending):
            if all(s.done >= at for s, at in uses):
                self.pending.remove((block, uses))
                self.free_blocks.insert(0, (block, self.owner_stream[block]))

    def tensor(self, ptr: DataPtr) -> torch.Tensor:
        return self.segment[ptr.block]


class SharedExperts:
    def __init__(self, allocator, aux, w_gate_up, w_down, variant: str) -> None:
        self.allocator, self._stream, self.variant = allocator, aux, variant
        self.w_gate_up, self.w_down = w_gate_up, w_down
        self._output: list = [None] * UBATCHES

    def _layer(self, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.matmul(torch.nn.functional.silu(x @ self.w_gate_up), self.w_down, out=out)

    def maybe_sync_shared_experts_stream(self, current: Stream) -> None:
        self._stream.wait_stream(current)

    def _run_in_aux_stream(self, shared_experts_input: torch.Tensor, current: Stream) -> DataPtr:
        output = self.allocator.malloc(self._stream)                 # with torch.cuda.stream(self._stream)
        out = self.allocator.tensor(output)
        self._stream.launch(lambda: self._layer(shared_experts_input, out))
        consumer_stream = current
        consumer_stream.wait_stream(self._stream)
        if self.variant == "fix":
            output.record_stream(consumer_stream)
        return output

    def apply(self, shared_experts_input, current: Stream, ubatch: int) -> None:
        self._output[ubatch] = self._run_in_aux_stream(shared_experts_input, current)

    def output(self, ubatch: int) -> DataPtr:
        output, self._output[ubatch] = self._output[ubatch], None
        return output


def moe_layer(layer, hidden, ubatch_streams, hiddens_out):
    """One MoE layer for every ubatch (DBO): router, routed experts on the ubatch's stream, shared on aux."""
    shared, w_router = layer["shared"], layer["router"]
    for ubatch, current in enumerate(ubatch_streams):
        x, out = hidden[ubatch], hiddens_out[ubatch]
        shared.maybe_sync_shared_experts_stream(current)
        routed = torch.empty_like(x)
        current.launch(lambda x=x, routed=routed: torch.mul(x @ w_router, torch.tanh(x), out=routed))
        shared.apply(x, current, ubatch)
        shared_output = shared.allocator.tensor(shared.output(ubatch))   # DataPtr dropped: only the address
        current.launch(lambda routed=routed, so=shared_output, out=out: torch.add(routed, so, out=out))


def run(variant: str, device: str = "cpu"):
    gen = generator(93)
    layers_w = [(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5),
                 randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5),
                 randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5)) for _ in range(LAYERS)]
    steps = [randn(UBATCHES, TOKENS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]

    def eager():
        outs = []
        for x in steps:
            h = x.clone()
            for w_router, w_gu, w_d in layers_w:
                h = (h @ w_router) * torch.tanh(h) + torch.nn.functional.silu(h @ w_gu) @ w_d
            outs.append(h)
        return outs

    def served():
        device_streams: list = []
        ubatch_streams = [Stream(device_streams) for _ in range(UBATCHES)]
        aux = Stream(device_streams)                                  # aux_stream(), one for all layers
        allocator = CachingAllocator(device, blocks=2 * LAYERS * UBATCHES)
        layers = [{"router": r, "shared": SharedExperts(allocator, aux, gu, d, variant)} for r, gu, d in layers_w]
        static_input = torch.zeros(UBATCHES, TOKENS, HIDDEN, device=device)
        hiddens = [torch.empty(UBATCHES, TOKENS, HIDDEN, device=device) for _ in range(LAYERS)]

        def forward():
            hidden = static_input
            for layer, hidden_out in zip(layers, hiddens):
                moe_layer(layer, hidden, ubatch_streams, hidden_out)
                hidden = hidden_out
            ubatch_streams[-1].synchronize_all()
            return hidden * 1.0

        static_input.copy_(steps[0])
        g, out = capture(forward, device=device, name="full decode bs=4 (2 ubatches)", owner="CUDAGraphWrapper",
                         static={"input_ids": static_input})
        outs = []
        for x in steps:
            static_input.copy_(x)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
