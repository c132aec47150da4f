"""The overlap scheduler's next-step ``free_swa`` clears ``full_to_swa_index_mapping`` before the in-flight decode step's ``replay_prepare`` reads it.

Upstream: https://github.com/sgl-project/sglang/pull/26380 ("[core] WAR barrier for overlap schedule buffer
writes, without fwd occupancy cost"; refined by #28363 and #31687).
Symptom: flaky, silently lower accuracy (``test_disaggregation_dsv4`` gsm8k ~0.87) with the overlap
scheduler: an SWA layer of a decode step attends to slot 0 instead of its oldest in-window token.
Mechanism: ``Scheduler.event_loop_overlap`` prepares step N+1 on ``schedule_stream`` while forward N, launched
by ``run_batch`` on ``forward_stream``, is still queued behind the previous forward. The only ordering was
``forward_stream.wait_stream(schedule_stream)`` (read-after-write). ``prepare_for_decode`` of N+1 writes the
shared GPU tables: ``req_to_token`` (alloc of the new token) and ``full_to_swa_index_mapping`` (alloc; and
``free_swa`` of the token that slides out of the window, which sets its entry to 0 and frees its SWA slot).
Forward N's ``DecodeCudaGraphRunner.replay_prepare`` (eager kernels before ``graph.replay()``) gathers
``req_to_token`` rows of its window and translates them through ``full_to_swa_index_mapping`` into the
graph's static ``swa_page_table``. The token N+1 frees is the oldest one of N's window; with no
write-after-read fence the clear lands first, so N's page table holds 0 there and the replayed attention
reads the padding slot. (Streams are modelled deterministically: the forward stream is busy, so its kernels
run when an event or a wait reaches them; the idle schedule stream runs its kernels at once.)
Doctor: persistent-mutation, at ``event_loop_overlap`` (the loop lets the next schedule write, in place, the
shared table whose old entries the graph step in flight still has to read).
Fix (upstream): ``schedule_stream.wait_stream(forward_stream)`` at the top of every overlap event loop
(normal, disagg decode, disagg prefill), so all schedule writes to shared buffers follow the previous
forward's reads; host syncs were moved off ``schedule_stream`` to keep forward occupancy.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/26380"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "event_loop_overlap"
SYMPTOM = "an SWA decode step attends to slot 0 instead of its oldest in-window token: flaky lower accuracy"

HIDDEN, WINDOW, BS, STEPS = 4, 3, 2, 5
MAX_CTX = WINDOW + STEPS + 1
SWA_SLOTS = 1 + BS * (WINDOW + 2)          # slot 0: the padding slot


class Stream:
    """A stream in miniature: kernels run in launch order; a busy stream holds them until waited on."""

    def __init__(self, busy: bool):
        self.busy, self.kernels, self.ran, self.pending = busy, [], 0, []

    def launch(self, kernel):
        self.kernels.append(kernel)
        if not self.busy:
            for other, upto in self.pending:
                other.run_until(upto)
            self.pending.clear()
            self.run_until(len(self.kernels))

    def wait_stream(self, other: "Stream"):
        upto = len(other.kernels)
        if self.busy:
            self.kernels.append(lambda: other.run_until(upto))
        else:
            self.pending.append((other, upto))

    def run_until(self, upto: int):
        while self.ran < upto:
            self.ran += 1
            self.kernels[self.ran - 1]()

    def record(self):
        upto = len(self.kernels)
        return lambda: self.run_until(upto)          # event.synchronize()


class SWATokenToKVPoolAllocator:
    def __init__(self, device):
        self.full_to_swa_index_mapping = torch.zeros(1 + BS * MAX_CTX, dtype=torch.long, device=device)
        self.k_pool = torch.zeros(SWA_SLOTS, HIDDEN, device=device)
        self.v_pool = torch.zeros(SWA_SLOTS, HIDDEN, device=device)
        self.next_full, self.swa_free = 1, collections.deque(range(1, SWA_SLOTS))

    def alloc(self):
        full, swa = self.next_full, self.swa_free.popleft()
        self.next_full += 1
        return full, swa

    def free_swa(self, full: int, swa: int, stream: Stream):
        def kernel():
            self.full_to_swa_index_mapping[full] = 0
        stream.launch(kernel)
        self.swa_free.append(swa)


@dataclasses.dataclass
class Req:
    rid: int
    full_locs: list
    swa_locs: list


@dataclasses.dataclass
class Result:
    out: torch.Tensor | None = None
    copy_done: object = None


class Model:
    def __init__(self, gen, device):
        self.wq, self.wk, self.wv = (randn(HIDDEN, HIDDEN, gen=gen, device=device) for _ in range(3))

    def forward_decode(self, x, out_cache_loc, swa_page_table, pools):
        k_pool, v_pool = pools
        q = x @ self.wq
        k_pool.index_copy_(0, out_cache_loc, x @ self.wk)
        v_pool.index_copy_(0, out_cache_loc, x @ self.wv)
        keys, vals = k_pool[swa_page_table], v_pool[swa_page_table]          # [bs, window, hidden]
        scores = torch.softmax((keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(HIDDEN), dim=-1)
        return (scores.unsqueeze(-1) * vals).sum(1)


class DecodeCudaGraphRunner:
    def __init__(self, model, allocator, req_to_token, device, use_graph):
        self.model, self.alloc, self.req_to_token, self.use_graph = model, allocator, req_to_token, use_graph
        self.input_embeds = torch.zeros(BS, HIDDEN, device=device)
        self.out_cache_loc = torch.zeros(BS, dtype=torch.long, device=device)
        self.swa_page_table = torch.zeros(BS, WINDOW, dtype=torch.long, device=device)
        pools = (allocator.k_pool, allocator.v_pool)
        self.fn = lambda: model.forward_decode(self.input_embeds, self.out_cache_loc, self.swa_page_table, pools)
        if use_graph:
            self.graph, self.output = capture(
                self.fn, device=device, name=f"decode bs={BS}", owner="sglang DecodeCudaGraphRunner",
                static={"input_embeds": self.input_embeds, "out_cache_loc": self.out_cache_loc,
                        "swa_page_table": self.swa_page_table},
                state={"swa_k_pool": allocator.k_pool, "swa_v_pool": allocator.v_pool})

    def replay_prepare(self, x, req_pool_indices, seq_lens):
        """init_forward_metadata_replay_cuda_graph: gather req_to_token over the window, translate to SWA."""
        mapping = self.alloc.full_to_swa_index_mapping
        cols = seq_lens.unsqueeze(1) - WINDOW + torch.arange(1, WINDOW + 1, device=seq_lens.device)
        full_page_table = self.req_to_token[req_pool_indices.unsqueeze(1), cols]
        self.swa_page_table.copy_(mapping[full_page_table])
        self.out_cache_loc.copy_(mapping[self.req_to_token[req_pool_indices, seq_lens]])
        self.input_embeds.copy_(x)

    def replay(self):
        return replay(self.graph, self.output) if self.use_graph else self.fn()


class Scheduler:
    def __init__(self, variant, device, overlap, gen):
        self.variant, self.device, self.overlap = variant, device, overlap
        self.schedule_stream, self.forward_stream = Stream(busy=False), Stream(busy=overlap)
        self.req_to_token = torch.zeros(BS, MAX_CTX, dtype=torch.long, device=device)
        self.alloc = SWATokenToKVPoolAllocator(device)
        model = Model(gen, device)
        self.reqs = [Req(r, [], []) for r in range(BS)]
        for req in self.reqs:                      # prefill WINDOW tokens (synchronous, before serving)
            ctx = randn(WINDOW, HIDDEN, gen=gen, device=device)
            for pos in range(WINDOW):
                full, swa = self.alloc.alloc()
                req.full_locs.append(full)
                req.swa_locs.append(swa)
                self.req_to_token[req.rid, pos] = full
                self.alloc.full_to_swa_index_mapping[full] = swa
                self.alloc.k_pool[swa] = ctx[pos] @ model.wk
                self.alloc.v_pool[swa] = ctx[pos] @ model.wv
        self.runner = DecodeCudaGraphRunner(model, self.alloc, self.req_to_token, device, use_graph=overlap)

    def prepare_for_decode(self):
        """Schedule the next decode step on schedule_stream: evict the token leaving the window, alloc one."""
        for req in self.reqs:
            pos = len(req.full_locs)
            self.alloc.free_swa(req.full_locs[pos - WINDOW], req.swa_locs[pos - WINDOW], self.schedule_stream)
            full, swa = self.alloc.alloc()
            req.full_locs.append(full)
            req.swa_locs.append(swa)

            def kernel(r=req.rid, pos=pos, full=full, swa=swa):
                self.req_to_token[r, pos] = full
                self.alloc.full_to_swa_index_mapping[full] = swa
            self.schedule_stream.launch(kernel)
        return torch.arange(BS, device=self.device), torch.tensor(
            [len(r.full_locs) - 1 for r in self.reqs], device=self.device)

    def run_batch(self, batch, x):
        req_pool_indices, seq_lens = batch
        result = Result()
        self.forward_stream.wait_stream(self.schedule_stream)          # read-after-write only

        def forward():
            self.runner.replay_prepare(x, req_pool_indices, seq_lens)
            result.out = self.runner.replay().clone()
        self.forward_stream.launch(forward)
        result.copy_done = self.forward_stream.record()
        return result

    @staticmethod
    def process_batch_result(result, outs):
        result.copy_done()                                             # copy_done.synchronize()
        outs.append(result.out)

    def event_loop_overlap(self, xs):
        outs, result_queue = [], collections.deque()
        for x in xs:
            if self.variant == "fix":
                self.schedule_stream.wait_stream(self.forward_stream)  # _apply_war_barrier
            batch = self.prepare_for_decode()                          # get_next_batch_to_run
            result_queue.append(self.run_batch(batch, x))
            if len(result_queue) > 1:
                self.process_batch_result(result_queue.popleft(), outs)
        while result_queue:
            self.process_batch_result(result_queue.popleft(), outs)
        return outs

    def event_loop_normal(self, xs):
        outs = []
        for x in xs:
            self.process_batch_result(self.run_batch(self.prepare_for_decode(), x), outs)
        return outs


def run(variant: str, device: str = "cpu"):
    def steps(gen):
        return [randn(BS, HIDDEN, gen=gen, device=device) for _ in range(STEPS)]

    def eager():
        gen = generator(26380)
        sched = Scheduler(variant, device, overlap=False, gen=gen)
        return sched.event_loop_normal(steps(gen))

    def served():
        gen = generator(26380)
        sched = Scheduler(variant, device, overlap=True, gen=gen)
        return sched.event_loop_overlap(steps(gen))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
