"""sglang decode CUDA graph with padding: ``seq_lens_sum`` still counts only the real requests, so ``kv_indices`` is too small for the padded rows.

Upstream: https://github.com/sgl-project/sglang/pull/1789 ("Fix seq_lens_sum for cuda graph runner in padded cases",
merged 2024-10-25). Read: the title and description ("When we compute `seq_lens_sum` for cuda graph, we need to
consider padded requests"; it fixed a failing CI job whose log was not read). The diff itself was not read. The fixed
line appears verbatim in later ``CudaGraphRunner.replay`` code, which passes ``forward_batch.seq_lens_sum + (bs -
raw_bs)`` to ``init_forward_metadata_replay_cuda_graph`` (later ``* self.seq_len_fill_value``). I also read the
FlashInfer decode indices updater of that era (``FlashInferIndicesUpdaterDecode.call_begin_forward``), which allocates
``kv_indices = torch.empty(paged_kernel_lens_sum)`` and fills it with ``create_flashinfer_kv_indices_triton`` at the
offsets ``kv_indptr`` (the cumsum of the padded ``seq_lens``). The padding value is from PR #1779 (padded rows get
``seq_len = 1``), which is the change that made the old sum wrong.
Symptom: with CUDA graphs on, a decode batch whose size is not a captured size (3 requests replayed on the bs=4 graph)
crashes: the kv-index kernel writes past its output allocation (an illegal memory access, or a silent write into a
neighbouring block). Batches of an exact captured size, and ``--disable-cuda-graph``, run fine.
Mechanism: ``CudaGraphRunner.replay`` pads the batch from ``raw_bs`` to the captured ``bs``. It fills the static
``seq_lens`` with 1 and zeroes ``out_cache_loc`` for the padded rows, then calls
``FlashInferAttnBackend.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum)`` with
``forward_batch.seq_lens_sum``, the sum over the ``raw_bs`` real rows. ``call_begin_forward`` builds ``kv_indptr`` from
all ``bs`` padded ``seq_lens`` but allocates ``kv_indices`` with the real sum. The Triton kernel, one program per row,
writes each padded row's one index at ``kv_indptr[i] >= real sum``, past the end of ``kv_indices``. Then
``begin_forward`` copies ``kv_indices`` into the decode wrapper's static index buffer, which the graph reads.
Doctor: padded-shape-mismatch, at replay. Metadata prepared at the graph's padded size (``bs`` rows of ``seq_lens``, their
cumsum) is combined with a length computed for the real rows only (``seq_lens_sum``), and the fix changes only the
value ``replay`` passes.
Fix (upstream): ``replay`` passes ``forward_batch.seq_lens_sum + (bs - raw_bs)``, which counts the padded rows' one token each.
Modelled: the decode ``CudaGraphRunner`` (static ``input_ids``, ``req_pool_indices``, ``seq_lens``, ``out_cache_loc``,
``positions``; capture sizes 1, 2, 4). Also the FlashInfer backend's decode path: ``init_cuda_graph_state``, capture and
replay metadata, the indices updater and a ``BatchDecodeWithPagedKVCacheWrapper`` stand-in whose ``begin_forward``
copies ``kv_indptr``/``kv_indices`` into its static buffers in graph mode. The model is one attention layer with a
token-slot KV cache (slot 0 is the padding slot) and an LM head. Stand-ins: ``create_flashinfer_kv_indices_triton``
writes through a pointer into its output allocation and raises the engine's ``IllegalMemoryAccess`` when a write
leaves it. The CUDA kernel has no bound, so on a GPU the write lands in a neighbouring block or faults. The decode kernel
reads ``kv_indices`` at fixed shape, masked by ``kv_indptr``.
Workload: request A and B decode 2 steps (bs=2, a captured size: no padding, served). Then C joins and A, B, C decode 3
steps. bs=3 replays the bs=4 graph: ``kv_indptr`` ends at real sum + 1, but ``kv_indices`` holds only the real sum
(3 + 3 + 1 = 7 entries), so the padded row's index is written at element 7 of a 7-element allocation. The served run
raises on the first padded step, while eager decodes all 5 steps.
"""
from __future__ import annotations

import torch

from workbench.engine import IllegalMemoryAccess
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/1789"
FAMILY = "stale padded metadata"
KIND = "padded-shape-mismatch"
SITE = "replay"
SYMPTOM = ("decode CUDA graph replay of a padded batch (3 requests on the bs=4 graph): seq_lens_sum counts only the real "
           "rows, kv_indices is allocated that small, and create_flashinfer_kv_indices_triton writes the padded rows' "
           "indices past its end (illegal memory access)")

VOCAB, HIDDEN = 16, 8
MAX_REQS, MAX_CONTEXT_LEN = 4, 8
NUM_SLOTS = 1 + MAX_REQS * MAX_CONTEXT_LEN        # slot 0: the padding slot (out_cache_loc of padded rows)
CAPTURE_BS = [1, 2, 4]

_variant = "bug"


class ForwardBatch:
    def __init__(self, input_ids, req_pool_indices, seq_lens, out_cache_loc, positions, seq_lens_sum):
        self.batch_size = input_ids.shape[0]
        self.input_ids, self.req_pool_indices, self.seq_lens = input_ids, req_pool_indices, seq_lens
        self.out_cache_loc, self.positions, self.seq_lens_sum = out_cache_loc, positions, seq_lens_sum


# --- flashinfer (stand-ins) ----------------------------------------------------------------------------------------------

def decode_attention(q, k_buffer, v_buffer, kv_indptr, kv_indices, bs):
    """The paged decode kernel: row ``b`` attends to ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (fixed shape, masked)."""
    j = torch.arange(MAX_CONTEXT_LEN, device=q.device)
    start, length = kv_indptr[:bs].long(), (kv_indptr[1:bs + 1] - kv_indptr[:bs]).long()
    pos = (start.unsqueeze(1) + j.unsqueeze(0)).clamp(max=kv_indices.shape[0] - 1)
    slots = kv_indices[pos].long()
    scores = (q.unsqueeze(1) * k_buffer[slots]).sum(-1) * HIDDEN ** -0.5
    p = torch.softmax(scores.masked_fill(j.unsqueeze(0) >= length.unsqueeze(1), float("-inf")), -1)
    return (p.unsqueeze(-1) * v_buffer[slots]).sum(1)


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, use_cuda_graph=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None):
        self.is_cuda_graph_enabled = use_cuda_graph
        self._paged_kv_indptr_buf, self._paged_kv_indices_buf = paged_kv_indptr_buffer, paged_kv_indices_buffer

    def begin_forward(self, indptr, indices):
        if self.is_cuda_graph_enabled:                  # copy the plan's inputs into the graph's static buffers
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_indices_buf[:len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf, self._paged_kv_indices_buf = indptr, indices

    def forward(self, q, k_buffer, v_buffer):
        bs = q.shape[0]
        return decode_attention(q, k_buffer, v_buffer, self._paged_kv_indptr_buf, self._paged_kv_indices_buf, bs)


def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr, kv_start_idx,
                                        kv_indices_ptr, max_context_len):
    """grid ``(bs,)``: program ``i`` stores ``req_to_token[req_pool_indices[i], :paged_kernel_lens[i]]`` at
    ``kv_indices_ptr + kv_indptr[i]``. Like the Triton kernel it only has the pointer: no bound on the output."""
    mem = torch.as_strided(kv_indices_ptr, (kv_indices_ptr.untyped_storage().nbytes() // 4,), (1,), 0)
    base = kv_indices_ptr.storage_offset()
    rows, lens, starts = req_pool_indices.tolist(), paged_kernel_lens.tolist(), kv_indptr.tolist()
    for i, (row, length) in enumerate(zip(rows, lens)):
        out = base + starts[i]
        if out + length > mem.numel():
            raise IllegalMemoryAccess(
                f"CUDA error: an illegal memory access was encountered (create_flashinfer_kv_indices_triton program {i} "
                f"stores {length} index(es) at element {starts[i]} of a {kv_indices_ptr.numel()}-element kv_indices)")
        mem[out:out + length] = req_to_token[row, :length]


class FlashInferIndicesUpdaterDecode:
    def __init__(self, attn_backend):
        self.req_to_token = attn_backend.req_to_token
        self.kv_indptr = attn_backend.kv_indptr

    def update(self, req_pool_indices, seq_lens, seq_lens_sum, decode_wrapper):
        self.call_begin_forward(decode_wrapper, req_pool_indices, seq_lens, seq_lens_sum, self.kv_indptr, None)

    def call_begin_forward(self, wrapper, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, kv_indptr,
                           kv_start_idx):
        bs = len(req_pool_indices)
        kv_indptr[1:bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)
        kv_indptr = kv_indptr[:bs + 1]
        kv_indices = torch.empty(paged_kernel_lens_sum, dtype=torch.int32, device=kv_indptr.device)
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr,
                                            kv_start_idx, kv_indices, self.req_to_token.shape[1])
        wrapper.begin_forward(kv_indptr, kv_indices)


class FlashInferAttnBackend:
    def __init__(self, req_to_token, device):
        self.req_to_token, self.device = req_to_token, device
        self.kv_indptr = torch.zeros(MAX_REQS + 1, dtype=torch.int32, device=device)
        self.indices_updater_decode = FlashInferIndicesUpdaterDecode(self)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch):
        wrapper = BatchDecodeWithPagedKVCacheWrapper()
        self.indices_updater_decode.update(forward_batch.req_pool_indices, forward_batch.seq_lens,
                                           forward_batch.seq_lens_sum, wrapper)
        self.forward_metadata = wrapper

    def init_cuda_graph_state(self, max_bs):
        self.cuda_graph_kv_indices = torch.zeros(max_bs * MAX_CONTEXT_LEN, dtype=torch.int32, device=self.device)
        self.cuda_graph_metadata = {}

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens):
        wrapper = BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True,
                                                     paged_kv_indptr_buffer=self.kv_indptr[:bs + 1],
                                                     paged_kv_indices_buffer=self.cuda_graph_kv_indices)
        self.indices_updater_decode.update(req_pool_indices, seq_lens, int(seq_lens.sum()), wrapper)
        self.cuda_graph_metadata[bs] = wrapper
        self.forward_metadata = wrapper

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum):
        self.indices_updater_decode.update(req_pool_indices[:bs], seq_lens[:bs], seq_lens_sum,
                                           self.cuda_graph_metadata[bs])
        self.forward_metadata = self.cuda_graph_metadata[bs]

    def get_cuda_graph_seq_len_fill_value(self):
        return 1                                        # PR #1779: padded rows get seq_len 1 (0 gave NaN)

    def forward_decode(self, q, k, v, k_buffer, v_buffer, forward_batch):
        k_buffer[forward_batch.out_cache_loc] = k       # save the new token's KV, then attend
        v_buffer[forward_batch.out_cache_loc] = v
        return self.forward_metadata.forward(q, k_buffer, v_buffer)


# --- the model and its runners -------------------------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, device):
        gen = generator(1789)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_CONTEXT_LEN, HIDDEN, scale=0.3)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN, scale=0.6) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.6)
        self.k_buffer = torch.zeros(NUM_SLOTS, HIDDEN, device=device)      # token_to_kv_pool
        self.v_buffer = torch.zeros(NUM_SLOTS, HIDDEN, device=device)
        self.req_to_token = torch.zeros(MAX_REQS, MAX_CONTEXT_LEN, dtype=torch.int32, device=device)
        self.attn_backend = FlashInferAttnBackend(self.req_to_token, device)

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed[input_ids] + self.pos_embed[positions]
        attn = self.attn_backend.forward_decode(h @ self.wq, h @ self.wk, h @ self.wv, self.k_buffer, self.v_buffer,
                                                forward_batch)
        return (h + attn @ self.wo) @ self.lm_head

    def forward_decode(self, forward_batch):
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


class CudaGraphRunner:
    def __init__(self, model_runner, device):
        self.model_runner, self.device = model_runner, device
        self.capture_bs, self.max_bs = CAPTURE_BS, max(CAPTURE_BS)
        self.seq_len_fill_value = model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        model_runner.attn_backend.init_cuda_graph_state(self.max_bs)
        self.graphs, self.output_buffers = {}, {}
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs):
        fb = ForwardBatch(self.input_ids[:bs], self.req_pool_indices[:bs], self.seq_lens[:bs], self.out_cache_loc[:bs],
                          self.positions[:bs], None)
        self.model_runner.attn_backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens)
        mr = self.model_runner
        return capture(lambda: mr.forward(fb.input_ids, fb.positions, fb), device=self.device, name=f"decode bs={bs}",
                       owner="CudaGraphRunner",
                       static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                               "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc,
                               "positions": self.positions},
                       state={"k_buffer": mr.k_buffer, "v_buffer": mr.v_buffer})

    def can_run(self, forward_batch):
        return forward_batch.batch_size <= self.max_bs

    def replay(self, forward_batch):
        raw_bs = forward_batch.batch_size
        bs = next(b for b in self.capture_bs if b >= raw_bs)
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_bs].copy_(forward_batch.positions)
        seq_lens_sum = forward_batch.seq_lens_sum
        if _variant == "fix":
            seq_lens_sum = forward_batch.seq_lens_sum + (bs - raw_bs)   # the padded rows' one token each
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(bs, self.req_pool_indices,
                                                                               self.seq_lens, seq_lens_sum)
        logits = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs,
                        padded={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                                "positions": self.positions})
        return logits[:raw_bs]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": 3, "B": 11, "C": 6}                 # each request's first token
    schedule = ["AB", "AB", "ABC", "ABC", "ABC"]

    def serve(use_cuda_graph: bool):
        mr = ModelRunner(device)
        runner = CudaGraphRunner(mr, device) if use_cuda_graph else None
        row = {rid: i for i, rid in enumerate("ABC")}
        last = dict(prompts)
        length = {rid: 0 for rid in prompts}
        outs = []
        for names in schedule:
            locs, positions = [], []
            for rid in names:
                slot = 1 + row[rid] * MAX_CONTEXT_LEN + length[rid]     # allocate the new token's KV slot
                mr.req_to_token[row[rid], length[rid]] = slot
                locs.append(slot)
                positions.append(length[rid])
                length[rid] += 1
            seq_lens = [length[rid] for rid in names]
            fb = ForwardBatch(torch.tensor([last[rid] for rid in names], device=device),
                              torch.tensor([row[rid] for rid in names], dtype=torch.int32, device=device),
                              torch.tensor(seq_lens, dtype=torch.int32, device=device),
                              torch.tensor(locs, device=device), torch.tensor(positions, device=device), sum(seq_lens))
            logits = runner.replay(fb) if runner is not None and runner.can_run(fb) else mr.forward_decode(fb)
            outs.append(logits.clone())
            for rid, tok in zip(names, logits.argmax(-1).tolist()):
                last[rid] = tok
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
