"""Dual LoRA/no-LoRA decode capture: the no-LoRA capture drops the FlashInfer wrappers the LoRA graph still reads.

Upstream: https://github.com/sgl-project/sglang/pull/24314 ("Deprecate record_nolora_graph dual MoE CUDA graph
capture"), which removed the dual capture added by #22809 ("Dual MoE CUDA graph capture for lora/nolora batches").
Symptom: with LoRA serving and decode CUDA graphs on (FlashInfer attention backend), batches that carry a LoRA
adapter decoded wrong tokens once the no-LoRA twin graph existed; batches without adapters, and
``--disable-cuda-graph``, were fine (sglang main, 2026).
Mechanism: with ``record_nolora_graph`` the ``CudaGraphRunner`` captured two decode graphs per batch size, first
the LoRA graph, then the no-LoRA graph. Each capture calls the backend's
``init_forward_metadata_capture_cuda_graph``, which builds fresh ``BatchDecodeWithPagedKVCacheWrapper`` objects,
plans them, stores them in ``self.decode_cuda_graph_metadata[bs]`` -- keyed by batch size only -- and in
``self.forward_metadata``. The second (no-LoRA) capture overwrote both, dropping the last references to the
wrappers the LoRA graph had been captured with; their int workspaces (where each wrapper keeps its plan:
FlashInfer's tile/chunk schedule of the KV) went back to the allocator while the LoRA graph's kernels still
address them. Every replay's ``init_forward_metadata_replay_cuda_graph`` -> ``indices_updater_decode.update(...,
decode_wrappers=self.decode_cuda_graph_metadata[bs])`` refreshes the shared KV index buffers and plans only the
no-LoRA wrappers, so a LoRA replay reads a plan nobody owns or refreshes: the capture-time plan (seq_lens at the
capture fill value, covering only the first KV tokens) or whatever a later allocation put in that block.
Doctor: dangling-reference, at ``init_forward_metadata_capture_cuda_graph`` (the no-LoRA capture replaces
``decode_cuda_graph_metadata[bs]``, releasing the wrapper plan buffers the LoRA graph reads at every replay).
Fix (upstream): drop the dual capture: one graph per batch size with the LoRA path always recorded (requests
without an adapter take the zero-scaling slot / the ``adapter_enabled`` early exit), so each batch size has one
set of wrappers, held by the backend, and replay plans exactly the wrappers its graph reads.
(Only the descriptions were available: #24314's, and those of the closed #23727 / #23873, which traced the
corruption to the bs-keyed ``decode_cuda_graph_metadata``; the diff itself was not read. That the replaced
wrappers had no other owner is this model's reading of the backend code. FlashInfer's plan is reduced to one
number per request: how far into the KV its tile schedule reaches. One attention layer, LoRA on the q
projection, batch size 2 only, page size 1.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/24314"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "init_forward_metadata_capture_cuda_graph"
SYMPTOM = "LoRA decode batches read a released capture-time KV plan once the no-LoRA twin graph is captured"
VOCAB, DIM, RANK, NUM_SLOTS, MAX_REQS, MAX_CTX, MAX_BS = 8, 4, 2, 16, 2, 6, 2
NUM_ADAPTER_SLOTS = 2            # slot 0: no adapter (scaling 0), slot 1: the served adapter
SEQ_LEN_FILL_VALUE = 1
NUM_KV_SPLITS = 2


class LlamaLikeModel:
    def __init__(self, device):
        gen = generator(24314)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_CTX, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


class LoRAManager:
    """Stacked adapter weights; ``weight_indices`` is the runner's per-row adapter slot (a static buffer)."""

    def __init__(self, device):
        gen = generator(22809)
        self.lora_a = randn(NUM_ADAPTER_SLOTS, DIM, RANK, gen=gen, device=device)
        self.lora_b = randn(NUM_ADAPTER_SLOTS, RANK, DIM, gen=gen, device=device)
        self.scalings = torch.tensor([0.0, 1.5]).to(device)

    def apply(self, x, weight_indices):
        a = torch.bmm(x[:, None, :], self.lora_a[weight_indices])
        return torch.bmm(a, self.lora_b[weight_indices]).squeeze(1) * self.scalings[weight_indices][:, None]


class TokenToKVPool:
    def __init__(self, device):
        self.k_cache = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.v_cache = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.req_to_token = torch.zeros(MAX_REQS, MAX_CTX, dtype=torch.long, device=device)


class BatchDecodeWithPagedKVCacheWrapper:
    """CUDA-graph mode: KV index buffers are the backend's (shared); the plan lives in the wrapper's own
    int workspace, written by ``plan`` (host-side scheduling, then a copy to the device)."""

    def __init__(self, kv_lens_buf, kv_indices_buf, device):
        self._kv_lens_buf = kv_lens_buf
        self._kv_indices_buf = kv_indices_buf
        self._int_workspace_buffer = torch.zeros(MAX_BS, dtype=torch.long, device=device)

    def plan(self, seq_lens_cpu: list[int]):
        chunk = max(1, -(-max(seq_lens_cpu) // NUM_KV_SPLITS))            # kv_chunk_size
        tile_end = [-(-n // chunk) * chunk for n in seq_lens_cpu]          # where each request's tiles stop
        self._int_workspace_buffer[:len(tile_end)].copy_(torch.tensor(tile_end).to(self._int_workspace_buffer.device))

    def forward(self, q, k_cache, v_cache):
        bs = q.shape[0]
        idx = self._kv_indices_buf[:bs]
        kv_len = self._kv_lens_buf[:bs]
        tile_end = self._int_workspace_buffer[:bs]
        pos = torch.arange(MAX_CTX, device=q.device)
        mask = (pos[None, :] < kv_len[:, None]) & (pos[None, :] < tile_end[:, None])
        scores = (k_cache[idx] @ q[:, :, None]).squeeze(-1).masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, -1)[:, :, None] * v_cache[idx]).sum(1)


@dataclasses.dataclass
class DecodeMetadata:
    decode_wrapper: BatchDecodeWithPagedKVCacheWrapper


class FlashInferIndicesUpdaterDecode:
    def __init__(self, backend):
        self.backend = backend

    def update(self, req_pool_indices, seq_lens, seq_lens_cpu, decode_wrapper):
        bs = len(seq_lens_cpu)
        b = self.backend
        b.kv_lens[:bs].copy_(seq_lens[:bs])
        b.kv_indices[:bs].copy_(b.pool.req_to_token[req_pool_indices[:bs]])   # create_flashinfer_kv_indices
        decode_wrapper.plan(seq_lens_cpu)


class FlashInferAttnBackend:
    def __init__(self, pool, device):
        self.pool, self.device = pool, device
        self.kv_lens = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        self.kv_indices = torch.zeros(MAX_BS, MAX_CTX, dtype=torch.long, device=device)
        self.indices_updater_decode = FlashInferIndicesUpdaterDecode(self)
        self.decode_cuda_graph_metadata: dict[int, BatchDecodeWithPagedKVCacheWrapper] = {}
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self.kv_lens, self.kv_indices, device)
        self.forward_metadata = None

    def init_forward_metadata(self, req_pool_indices, seq_lens, seq_lens_cpu):          # eager decode
        self.indices_updater_decode.update(req_pool_indices, seq_lens, seq_lens_cpu, self.decode_wrapper)
        self.forward_metadata = DecodeMetadata(self.decode_wrapper)

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu):
        decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self.kv_lens, self.kv_indices, self.device)
        self.indices_updater_decode.update(req_pool_indices, seq_lens, seq_lens_cpu, decode_wrapper)
        self.decode_cuda_graph_metadata[bs] = decode_wrapper            # keyed by bs only: replaces a twin
        self.forward_metadata = DecodeMetadata(decode_wrapper)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu):
        self.indices_updater_decode.update(req_pool_indices, seq_lens, seq_lens_cpu,
                                           self.decode_cuda_graph_metadata[bs])

    def forward_decode(self, q):
        return self.forward_metadata.decode_wrapper.forward(q, self.pool.k_cache, self.pool.v_cache)


def forward_decode(model, lora, backend, input_ids, positions, out_cache_loc, weight_indices, lora_enabled):
    x = model.embed[input_ids] + model.pos_embed[positions]
    q = x @ model.wq
    if lora_enabled:
        q = q + lora.apply(x, weight_indices)
    backend.pool.k_cache[out_cache_loc] = x @ model.wk                   # set_kv_buffer
    backend.pool.v_cache[out_cache_loc] = x @ model.wv
    h = x + backend.forward_decode(q)
    return h @ model.lm_head


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    weight_indices: torch.Tensor
    seq_lens_cpu: list[int]

    @property
    def has_lora(self) -> bool:
        return any(w != 0 for w in self.weight_indices.tolist())


@dataclasses.dataclass
class DecodeInputBuffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    weight_indices: torch.Tensor

    @classmethod
    def create(cls, device):
        z = lambda: torch.zeros(MAX_BS, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(), z(), z(), torch.full((MAX_BS,), SEQ_LEN_FILL_VALUE, dtype=torch.long, device=device),
                   z(), z())

    def populate_from_forward_batch(self, fb: ForwardBatch):
        for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc", "weight_indices"):
            getattr(self, name).copy_(getattr(fb, name))


class CudaGraphRunner:
    def __init__(self, model, lora, backend, device, variant):
        self.model, self.lora, self.backend, self.device = model, lora, backend, device
        # #22809's dual capture (bug) vs one LoRA-enabled graph per bs (fix, #24314).
        self.record_nolora_graph = variant == "bug"
        self.buffers = DecodeInputBuffers.create(device)
        self.graphs, self.outputs = {}, {}
        self.capture()

    def capture(self):
        for lora_enabled in ((True, False) if self.record_nolora_graph else (True,)):
            self.capture_one_batch_size(MAX_BS, lora_enabled)

    def capture_one_batch_size(self, bs, lora_enabled):
        buf = self.buffers
        self.backend.init_forward_metadata_capture_cuda_graph(bs, buf.req_pool_indices, buf.seq_lens,
                                                              [SEQ_LEN_FILL_VALUE] * bs)
        wrapper = self.backend.forward_metadata.decode_wrapper
        run_once = lambda: forward_decode(self.model, self.lora, self.backend, buf.input_ids,  # noqa: E731
                                          buf.positions, buf.out_cache_loc, buf.weight_indices, lora_enabled)
        static = dict(dataclasses.asdict(buf), kv_lens=self.backend.kv_lens, kv_indices=self.backend.kv_indices,
                      decode_wrapper_int_workspace=wrapper._int_workspace_buffer)
        key = (bs, lora_enabled) if self.record_nolora_graph else bs
        self.graphs[key], self.outputs[key] = capture(
            run_once, device=self.device, name=f"decode bs {bs} lora={lora_enabled}", owner="CudaGraphRunner",
            static=static, state={"k_cache": self.backend.pool.k_cache, "v_cache": self.backend.pool.v_cache})

    def replay(self, fb: ForwardBatch):
        bs = MAX_BS
        self.buffers.populate_from_forward_batch(fb)
        self.backend.init_forward_metadata_replay_cuda_graph(bs, self.buffers.req_pool_indices, self.buffers.seq_lens,
                                                             fb.seq_lens_cpu)
        key = (bs, fb.has_lora) if self.record_nolora_graph else bs
        return replay(self.graphs[key], self.outputs[key])


def run(variant: str, device: str = "cpu"):
    model, lora = LlamaLikeModel(device), LoRAManager(device)
    prefill = randn(NUM_SLOTS, 2, DIM, gen=generator(1), device=device)

    def setup(pool):
        # Prefill left request 0 at slots 1, 2 and request 1 at slots 3, 4.
        for req, slots in ((0, [1, 2]), (1, [3, 4])):
            pool.req_to_token[req, :2] = torch.tensor(slots).to(device)
            for s in slots:
                pool.k_cache[s], pool.v_cache[s] = prefill[s, 0], prefill[s, 1]

    # Per decode step: (req, token id, position, new slot, adapter slot). Request 0 runs with the adapter
    # in steps 0 and 2; step 1 is an adapter-free batch (it takes the no-LoRA graph in the bug variant).
    steps = [[(0, 3, 2, 5, 1), (1, 6, 2, 6, 0)],
             [(0, 1, 3, 7, 0), (1, 2, 3, 8, 0)],
             [(0, 5, 4, 9, 1), (1, 7, 4, 10, 0)]]

    def batch_of(pool, step):
        for req, _, p, slot, _ in step:
            pool.req_to_token[req, p] = slot
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(device)  # noqa: E731
        return ForwardBatch(t([i for _, i, *_ in step]), t([p for _, _, p, _, _ in step]), t([r for r, *_ in step]),
                            t([p + 1 for _, _, p, _, _ in step]), t([s for *_, s, _ in step]),
                            t([w for *_, w in step]), [p + 1 for _, _, p, _, _ in step])

    def eager():
        pool = TokenToKVPool(device)
        backend = FlashInferAttnBackend(pool, device)
        setup(pool)
        outs = []
        for step in steps:
            fb = batch_of(pool, step)
            backend.init_forward_metadata(fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
            outs.append(forward_decode(model, lora, backend, fb.input_ids, fb.positions, fb.out_cache_loc,
                                       fb.weight_indices, fb.has_lora))
        return outs

    def served():
        pool = TokenToKVPool(device)
        backend = FlashInferAttnBackend(pool, device)
        runner = CudaGraphRunner(model, lora, backend, device, variant)
        pool.k_cache.zero_()                            # warmups wrote the capture batch's KV to sentinel slot 0
        pool.v_cache.zero_()
        setup(pool)
        return [runner.replay(batch_of(pool, step)).clone() for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
