"""Under the overlap scheduler the next iteration refills the reused pinned block-offset table before the
previous iteration's async H2D has read it; the decode graph attends over another batch's KV blocks.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/15546 ("[https://nvbugs/6293536][fix] Stage KV block
offsets through a fresh host buffer").
Symptom: CUDA memory corruption / wrong attention outputs under the overlap scheduler with heavy concurrent
prefill and host KV offloading (nvbug 6293536).
Mechanism: ``TrtllmAttentionMetadata.prepare`` calls ``KVCacheManager.copy_batch_block_offsets(
self.kv_cache_block_offsets, request_ids, beam_width, num_contexts, num_seqs)``: the C++ ``impl`` fills the
single, persistently reused pinned ``host_kv_cache_block_offsets`` in place, then
``dst_tensor[pool_idx, :num_seqs].copy_(host_kv_cache_block_offsets[pool_idx, :num_seqs], non_blocking=True)``
ships it into the fixed-address device table the attention kernels read (in CUDA-graph decode replays
too). An async copy reads its source at execution time. ``_executor_loop_overlap`` runs the host one
iteration ahead: it prepares and launches iteration N+1 before it waits on iteration N
(``_process_previous_batch``), so iteration N+1's ``copy_batch_block_offsets`` overwrites the host table
while iteration N's H2D is still queued (``syncTransfers`` of KV offloading stalls the stream right in
front of it, widening the window). Replay N then reads batch N+1's page indices: another batch's physical
KV blocks. ``kv_lens`` / input ids are staged through fresh host tensors each step and stay right.
(The CUDA stream is modelled as an in-order queue of launches that the device works through only when the
host waits on it; the new token's KV write is left out.)
Doctor: stale-input, at ``copy_batch_block_offsets``: the static ``kv_cache_block_offsets`` a replay reads
does not hold its own iteration's page indices (the pending H2D picked up the next iteration's refill).
Fix (upstream): stage each call into a fresh pinned ``host_block_offsets = torch.zeros(num_pools,
num_seqs, 2, max_blocks_per_seq)``; the caching host allocator keeps it until the consuming copy has
completed, as the kv_lens / block_ids_per_seq staging already did (double buffering was profiled, not kept).
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/15546"
FAMILY = "persistent-buffer mutation"
KIND = "stale-input"
SITE = "copy_batch_block_offsets"
SYMPTOM = "overlap scheduler: decode replays attend over the next batch's KV blocks: wrong outputs / corruption"

VOCAB, DIM, TOKENS_PER_BLOCK, MAX_BLOCKS_PER_SEQ = 16, 4, 2, 3
NUM_POOLS, MAX_BATCH, BATCH = 1, 4, 3                   # decode graph captured for 3 generation requests
NUM_BLOCKS = 1 + 6 * MAX_BLOCKS_PER_SEQ                 # block 0: the dummy requests' block
BLOCK_IDS = {r: [1 + r * MAX_BLOCKS_PER_SEQ + b for b in range(MAX_BLOCKS_PER_SEQ)] for r in range(6)}
SCHEDULE = ([0, 1, 2], [3, 4, 5], [1, 3, 0], [5, 2, 4])  # request ids of each overlap iteration


class ExecutionStream:
    """The CUDA stream in miniature: launches run in order, when the host waits on the stream."""

    def __init__(self) -> None:
        self.queue: list = []
        self.done = 0

    def launch(self, fn) -> int:
        self.queue.append(fn)
        return len(self.queue)                          # an event recorded after this launch

    def wait(self, event: int) -> None:
        while self.done < event:
            self.done += 1
            self.queue[self.done - 1]()

    def synchronize(self) -> None:
        self.wait(len(self.queue))

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)``: the copy reads ``src`` when the stream gets to it."""
        self.launch(lambda: dst.copy_(src))


class KVCacheManagerCpp:
    """The C++ ``impl``: writes each request's page indices into a host block-offset table."""

    def copy_batch_block_offsets(self, output, request_ids, beam_width, offset):
        for i, rid in enumerate(request_ids):
            for pool_idx in range(output.shape[0]):
                row = torch.tensor(BLOCK_IDS[rid], dtype=torch.int32)
                output[pool_idx, offset + i * beam_width, 0] = row                 # K blocks
                output[pool_idx, offset + i * beam_width, 1] = row                 # V blocks


class KVCacheManager:
    def __init__(self, device: str, stream: ExecutionStream, variant: str) -> None:
        self.device, self.stream, self.variant = device, stream, variant
        self.impl = KVCacheManagerCpp()
        self.host_kv_cache_block_offsets = host(
            torch.zeros(NUM_POOLS, MAX_BATCH, 2, MAX_BLOCKS_PER_SEQ, dtype=torch.int32), device)   # pinned

    def copy_batch_block_offsets(self, dst_tensor, request_ids, beam_width, num_context, num_seqs):
        if self.variant == "bug":
            host_block_offsets = self.host_kv_cache_block_offsets          # one buffer, refilled in place
        else:   # fresh per call: held by the caching host allocator until the consuming copy completes
            host_block_offsets = host(torch.zeros(NUM_POOLS, num_seqs, 2, MAX_BLOCKS_PER_SEQ,
                                                  dtype=torch.int32), self.device)
        self.impl.copy_batch_block_offsets(host_block_offsets, request_ids[:num_context], 1, 0)
        self.impl.copy_batch_block_offsets(host_block_offsets, request_ids[num_context:], beam_width,
                                           num_context)
        for pool_idx in range(host_block_offsets.shape[0]):
            self.stream.copy_async(dst_tensor[pool_idx, :num_seqs], host_block_offsets[pool_idx, :num_seqs])


class TrtllmAttentionMetadata:
    def __init__(self, device: str, kv_cache_manager: KVCacheManager, stream: ExecutionStream) -> None:
        self.device, self.kv_cache_manager, self.stream = device, kv_cache_manager, stream
        self.kv_cache_block_offsets = torch.zeros(NUM_POOLS, MAX_BATCH, 2, MAX_BLOCKS_PER_SEQ,
                                                  dtype=torch.int32, device=device)
        self.kv_lens_cuda = torch.zeros(MAX_BATCH, dtype=torch.int64, device=device)
        self.input_ids_cuda = torch.zeros(MAX_BATCH, dtype=torch.int64, device=device)

    def prepare(self, request_ids, input_ids, kv_lens) -> None:
        num_seqs = len(request_ids)
        # already safe: fresh host tensors per step
        self.stream.copy_async(self.input_ids_cuda[:num_seqs], host(torch.tensor(input_ids), self.device))
        self.stream.copy_async(self.kv_lens_cuda[:num_seqs], host(torch.tensor(kv_lens), self.device))
        self.kv_cache_manager.copy_batch_block_offsets(self.kv_cache_block_offsets, request_ids, 1, 0, num_seqs)


class DecoderModel:
    def __init__(self, device: str) -> None:
        gen = generator(15546)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.k_pool = randn(NUM_BLOCKS, TOKENS_PER_BLOCK, DIM, gen=gen, device=device)
        self.v_pool = randn(NUM_BLOCKS, TOKENS_PER_BLOCK, DIM, gen=gen, device=device)

    def forward(self, input_ids, kv_lens, block_offsets):
        """Paged decode attention: one query per sequence over its pages ``block_offsets[0, seq, k/v, :]``."""
        q = self.embed[input_ids]                                                          # [B, D]
        n = block_offsets.shape[0]
        keys = self.k_pool[block_offsets[0, :, 0].long()].reshape(n, -1, DIM)
        values = self.v_pool[block_offsets[0, :, 1].long()].reshape(n, -1, DIM)
        ctx = torch.arange(keys.shape[1], device=q.device)
        scores = (keys @ q[:, :, None]).squeeze(-1).masked_fill(ctx[None, :] >= kv_lens[:, None], -1e9)
        return (torch.softmax(scores, -1)[:, :, None] * values).sum(1)


def iteration_inputs(it: int):
    gen = torch.Generator().manual_seed(700 + it)
    input_ids = torch.randint(0, VOCAB, (BATCH,), generator=gen).tolist()
    kv_lens = [3 + (it + r) % 4 for r in SCHEDULE[it]]
    return list(SCHEDULE[it]), input_ids, kv_lens


def run(variant: str, device: str = "cpu"):
    model = DecoderModel(device)

    def eager():
        outs = []
        for it in range(len(SCHEDULE)):
            rids, ids, lens = iteration_inputs(it)
            offs = torch.tensor([[BLOCK_IDS[r], BLOCK_IDS[r]] for r in rids], dtype=torch.int32)[None]
            outs.append(model.forward(torch.tensor(ids, device=device), torch.tensor(lens, device=device),
                                      offs.to(device)))
        return outs

    def served():
        stream = ExecutionStream()
        metadata = TrtllmAttentionMetadata(device, KVCacheManager(device, stream, variant), stream)
        # capture: dummy generation requests, drained before capture (torch.cuda.graph syncs)
        metadata.prepare([0] * BATCH, [0] * BATCH, [1] * BATCH)
        stream.synchronize()
        g, out = capture(lambda: model.forward(metadata.input_ids_cuda[:BATCH], metadata.kv_lens_cuda[:BATCH],
                                               metadata.kv_cache_block_offsets[:, :BATCH]),
                         device=device, name=f"decode batch {BATCH}", owner="TrtllmAttentionMetadata",
                         static={"kv_cache_block_offsets": metadata.kv_cache_block_offsets,
                                 "kv_lens_cuda": metadata.kv_lens_cuda, "input_ids_cuda": metadata.input_ids_cuda})
        results: list[torch.Tensor] = []
        previous = None
        for it in range(len(SCHEDULE)):                           # _executor_loop_overlap
            metadata.prepare(*iteration_inputs(it))               # _forward_step: prepare, then launch
            launched = stream.launch(lambda: results.append(replay(g, out).clone()))
            if previous is not None:
                stream.wait(previous)                             # _process_previous_batch
            previous = launched
        stream.synchronize()
        return results

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
