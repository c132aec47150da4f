"""The next step's refill of the pinned ``_slot_idx_cpu`` lands in the previous step's still-queued slot-index H2D.

Upstream: https://github.com/mstar-project/mstar/commit/9e55017ea6004f9dc5c3684562c06f36c7c83874
("sampling: fence the reused pinned staging buffers (row_cpu, _slot_idx_cpu) with a CUDA event").
Symptom: silent mis-sampling with the host running ahead of the GPU (MSTAR_TP_ASYNC_SCHED,
MSTAR_TP_STEP_BARRIER=0): "the per-step slot-index refill could corrupt the previous step's gather", so a
row is sampled with another request's temperature, seed and RNG offset. There is no crash.
Mechanism: ``SamplerBuffers.gather_for_request_ids`` fills the pinned ``_slot_idx_cpu[i] = slot`` on the
host and issues one async H2D, ``idx_view = _slot_idx_gpu[:padded_bs]; idx_view.copy_(_slot_idx_cpu[:padded_bs],
non_blocking=True)``. It then queues one ``index_select(master, 0, idx_view, out=buf[:padded_bs])`` per
``Buffer``, into the "cuda-graph-friendly per-step buffers" that the captured ``CudaGraphableSampler`` reads
(temperature, seed, and the RNG offset, which the graph advances and ``scatter_offset`` writes back by the
same indices). A non_blocking H2D reads its pinned source when the copy engine reaches it. With the host a
step ahead, step N+1's refill of ``_slot_idx_cpu`` overwrites step N's indices before step N's copy runs,
so step N gathers (and scatters back) step N+1's slots. Here the batch [a, b] is followed by [b] after a
finishes: a's row is sampled with b's temperature, seed and RNG offset.
``Buffer.write_master_row`` reuses its one-row pinned ``row_cpu`` the same way; the same commit fences it.
In this batch schedule its writes never overlap.
(The device stream is modelled as a queue that runs only when the host waits on an event: the host runs a
step ahead. Eager is the same code with the device keeping up.)
Doctor: persistent-mutation, at ``gather_for_request_ids``. The host rewrites the persistent pinned
slot-index buffer in place while the previous step's queued copy into the graph-read gather indices still
has to read it.
Fix (upstream): a reuse fence per staging buffer. ``SamplerBuffers._slot_idx_ev`` (and ``Buffer._stage_ev``)
is recorded after each staged async copy and synchronized before the next host write of the same buffer.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/mstar-project/mstar/commit/9e55017ea6004f9dc5c3684562c06f36c7c83874"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "gather_for_request_ids"
SYMPTOM = "host-ahead scheduling: a step's sampler rows gathered with the next step's slots (wrong temp/seed/offset)"

MAX_BS, VOCAB = 4, 8
CAPTURE_SIZES = (1, 2)
CONFIGS = {"a": (0.5, 1), "b": (1.5, 2), "c": (1.0, 3)}      # rid -> (temperature, seed)
# (requests registered before the step, the step's batch, requests finished after it)
SCHEDULE = [("a", ["a"], ""), ("", ["a"], ""), ("b", ["a", "b"], "a"), ("", ["b"], ""),
            ("c", ["b", "c"], ""), ("", ["b", "c"], "")]


class Stream:
    """The device stream as the host sees it: launches queue up and the device runs them later. An
    event's ``synchronize()`` runs the queue up to the point where the event was recorded."""

    def __init__(self, device: str, runs_behind: bool):
        self.device, self.runs_behind, self.queue, self.done = device, runs_behind, [], 0

    def launch(self, fn) -> None:
        self.queue.append(fn)
        if not self.runs_behind:
            self.run_until(len(self.queue))

    def run_until(self, mark: int) -> None:
        while self.done < mark:
            self.queue[self.done]()
            self.done += 1
        synchronize(self.device)


class Event:                        # torch.cuda.Event(); .record() on construction
    def __init__(self, stream: Stream):
        self.stream, self.mark = stream, len(stream.queue)

    def synchronize(self) -> None:
        self.stream.run_until(self.mark)


@dataclasses.dataclass
class Buffer:
    """``buf`` [max_bs] per-step (read by the graph), ``master`` slot-indexed, ``row_cpu`` pinned staging."""
    buf: torch.Tensor
    master: torch.Tensor
    row_cpu: torch.Tensor
    stream: Stream
    fenced: bool
    _stage_ev: Event | None = None

    @classmethod
    def allocate(cls, device, dtype, default, stream, fenced) -> "Buffer":
        return cls(torch.full((MAX_BS,), default, dtype=dtype, device=device),
                   torch.full((MAX_BS,), default, dtype=dtype, device=device),
                   host(torch.zeros(1, dtype=dtype), device), stream, fenced)

    def write_master_row(self, slot: int, value) -> None:
        if self.fenced and self._stage_ev is not None:
            self._stage_ev.synchronize()
        self.row_cpu[0] = value
        dst, src = self.master[slot:slot + 1], self.row_cpu
        self.stream.launch(lambda: dst.copy_(src, non_blocking=True))
        if self.fenced:
            self._stage_ev = Event(self.stream)

    def gather(self, idx_view: torch.Tensor, padded_bs: int) -> None:
        out = self.buf[:padded_bs]
        self.stream.launch(lambda: torch.index_select(self.master, 0, idx_view, out=out))

    def scatter(self, idx_view: torch.Tensor, real_bs: int) -> None:
        self.stream.launch(lambda: self.master.index_copy_(0, idx_view[:real_bs], self.buf[:real_bs]))


class CudaGraphableSampler:
    def __init__(self, temperature_buf, seed_buf, offset_buf):
        self.temperature_buf, self.seed_buf, self.offset_buf = temperature_buf, seed_buf, offset_buf

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits / self.temperature_buf[:, None], dim=-1)
        x = self.seed_buf.to(torch.float32) * 12.9898 + self.offset_buf.to(torch.float32) * 78.233
        u = torch.frac(torch.sin(x).abs() * 43758.5453)                 # Philox(seed, offset) stand-in
        self.offset_buf.add_(1)                                         # advanced in graph
        return (probs.cumsum(-1) < u[:, None]).sum(-1).clamp(max=VOCAB - 1)


class SamplerBuffers:
    def __init__(self, device: str, stream: Stream, fenced: bool):
        self.stream, self.fenced = stream, fenced
        self.temperature = Buffer.allocate(device, torch.float32, 1.0, stream, fenced)
        self.seed = Buffer.allocate(device, torch.int64, 0, stream, fenced)
        self.offset = Buffer.allocate(device, torch.int64, 0, stream, fenced)
        self._slot_idx_cpu = host(torch.zeros(MAX_BS, dtype=torch.int64), device)     # pinned
        self._slot_idx_gpu = torch.zeros(MAX_BS, dtype=torch.int64, device=device)
        self._slot_idx_ev: Event | None = None
        self._last_real_bs = 0
        self._rid_to_slot: dict[str, int] = {}
        self._free_slots = list(range(MAX_BS))
        self._pending_init: set[int] = set()
        self._cached_config: dict[str, tuple[float, int]] = {}

    def slice_for_bs(self, bs: int) -> CudaGraphableSampler:
        return CudaGraphableSampler(self.temperature.buf[:bs], self.seed.buf[:bs], self.offset.buf[:bs])

    def register_request(self, rid: str, config: tuple[float, int]) -> None:
        slot = self._free_slots.pop()
        self._rid_to_slot[rid] = slot
        self._pending_init.add(slot)                 # GPU writes deferred to the next gather
        self._cached_config[rid] = config

    def unregister_request(self, rid: str) -> None:
        self._cached_config.pop(rid, None)
        self._free_slots.append(self._rid_to_slot.pop(rid))

    def _init_slot(self, slot: int, rid: str) -> None:
        offset_row = self.offset.master[slot:slot + 1]
        self.stream.launch(offset_row.zero_)
        temperature, seed = self._cached_config[rid]
        self.temperature.write_master_row(slot, temperature)
        self.seed.write_master_row(slot, seed)
        self._pending_init.discard(slot)

    def gather_for_request_ids(self, request_ids: list[str], padded_bs: int) -> None:
        if self.fenced and self._slot_idx_ev is not None:
            self._slot_idx_ev.synchronize()          # the fix: wait for the previous H2D of this buffer
        for i, rid in enumerate(request_ids):
            slot = self._rid_to_slot.get(rid, 0)
            if slot in self._pending_init:
                self._init_slot(slot, rid)
            self._slot_idx_cpu[i] = slot
        for i in range(len(request_ids), padded_bs):
            self._slot_idx_cpu[i] = 0
        # Single async H2D (pinned) of the slot indices.
        idx_view, src = self._slot_idx_gpu[:padded_bs], self._slot_idx_cpu[:padded_bs]
        self.stream.launch(lambda: idx_view.copy_(src, non_blocking=True))
        if self.fenced:
            self._slot_idx_ev = Event(self.stream)
        for buf in (self.temperature, self.seed, self.offset):
            buf.gather(idx_view, padded_bs)
        self._last_real_bs = len(request_ids)

    def scatter_offset(self) -> None:
        self.offset.scatter(self._slot_idx_gpu, self._last_real_bs)


def run(variant: str, device: str = "cpu"):
    gen = generator(9055)
    logits = [randn(len(batch), VOCAB, gen=gen, device=device, scale=0.7) for _, batch, _ in SCHEDULE]

    def serve(use_graphs: bool):
        stream = Stream(device, runs_behind=use_graphs)          # the graph path runs the host a step ahead
        bufs = SamplerBuffers(device, stream, fenced=(variant == "fix"))
        graphs = {}
        if use_graphs:
            for bs in CAPTURE_SIZES:
                logits_buf, sampler = torch.zeros(bs, VOCAB, device=device), bufs.slice_for_bs(bs)
                graphs[bs] = (logits_buf, *capture(
                    lambda s=sampler, lb=logits_buf: s.sample(lb), device=device, name=f"sampler_bs{bs}",
                    static={"logits": logits_buf, "temperature_buf": sampler.temperature_buf,
                            "seed_buf": sampler.seed_buf}, state={"offset_buf": sampler.offset_buf},
                    owner="mstar piecewise runner"))
        tokens: list[torch.Tensor] = []

        def forward(step: int, bs: int) -> None:                   # queued on the device stream
            if use_graphs:
                logits_buf, g, out = graphs[bs]
                logits_buf.copy_(logits[step])
                tokens.append(replay(g, out).clone())
            else:
                tokens.append(bufs.slice_for_bs(bs).sample(logits[step]).clone())

        prev = None
        for step, (joins, batch, leaves) in enumerate(SCHEDULE):
            for rid in joins:
                bufs.register_request(rid, CONFIGS[rid])
            bufs.gather_for_request_ids(batch, len(batch))
            stream.launch(lambda step=step, bs=len(batch): forward(step, bs))
            bufs.scatter_offset()
            done = Event(stream)
            if prev is not None:
                prev.synchronize()                                 # resolve step N-1's tokens
            prev = done
            for rid in leaves:
                bufs.unregister_request(rid)
        prev.synchronize()
        return tokens

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
