"""Whisper's decode graph is captured with dummy ``encoder_lens`` of 0: the cross-attention work is never recorded.

Upstream: https://github.com/sgl-project/sglang/pull/21190 ("[Whisper] Enable CUDA graph support and timestamp for
whisper model"), related https://github.com/sgl-project/sglang/pull/21161; the fix is one part of a feature PR.
Symptom: with CUDA graphs on, Whisper decode ran with cross-attention "skipped during capture": the graphed decoder
ignores the audio (the PR reports identical accuracy to eager only after the fix).
Mechanism: ``CudaGraphRunner`` fills its static capture inputs with dummies; ``DecodeInputBuffers.create`` fills
``encoder_lens`` with ``encoder_len_fill_value``, which was 0. ``capture_one_batch_size`` calls
``attn_backend.init_forward_metadata_capture_cuda_graph``: ``FlashInferIndicesUpdaterDecode.update_cross_attention``
plans the cross-attention decode wrapper (wrapper 1) with ``paged_kernel_lens = encoder_lens`` and the host lengths;
FlashInfer's ``plan`` sizes the split-KV work (here: the number of KV chunks) on the host from them. With every
dummy length 0 the plan has no work, so the captured forward launches no cross-attention kernel over the encoder KV
pool (``encoder_out_cache_loc``). At replay ``replay_prepare`` copies the real ``encoder_lens`` into the static
buffer and re-plans (the indptr/indices buffers are rewritten and the host plan now has work), but the graph's
launches were fixed at capture: the decoder adds nothing from the audio. Eager decode plans from the real lengths.
Modelled with one decoder layer (token + position embedding, cross-attention over a paged encoder KV pool, LM head);
self-attention is left out; ``max_source_positions`` is 12 instead of 1500.
Doctor: warmup-divergence, at update_cross_attention (the capture-time plan made from the dummy encoder lengths of
0 has no cross-attention work; replays reuse it while an eager step, planned from the real lengths, attends).
Fix (upstream): ``CudaGraphRunner.__init__`` sets ``self.encoder_len_fill_value = getattr(hf_config,
"max_source_positions", 0) if self.is_encoder_decoder else 0`` ("Non-zero encoder length ensures cross-attention
kernels are captured in the graph") and passes it to ``DecodeInputBuffers.create``. (The PR also made the cross
wrapper's plan use the encoder-side CPU lengths rather than the decoder's ``seq_lens_cpu``; both variants here plan
from the encoder lengths.)
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/21190"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "update_cross_attention"
SYMPTOM = "graphed Whisper decode ignores the audio: cross-attention kernels were never captured"

DIM, VOCAB, MAX_SOURCE_POSITIONS, MAX_TARGET_POSITIONS = 8, 16, 12, 8
MAX_BS, CHUNK, NEG = 2, 4, -1e30       # CHUNK: KV entries per split-KV work item of the decode kernel
POOL = MAX_BS * MAX_SOURCE_POSITIONS


def load_weights(device):
    gen = generator(21190)
    return SimpleNamespace(
        embed_tokens=randn(VOCAB, DIM, gen=gen, device=device),
        embed_positions=randn(MAX_TARGET_POSITIONS, DIM, gen=gen, device=device, scale=0.5),
        q_proj=randn(DIM, DIM, gen=gen, device=device, scale=0.5),
        kv_proj=randn(DIM, 2 * DIM, gen=gen, device=device, scale=0.5),
        out_proj=randn(DIM, DIM, gen=gen, device=device, scale=0.5),
        proj_out=randn(DIM, VOCAB, gen=gen, device=device))


class BatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer's decode wrapper in miniature: ``plan`` (host) sizes the work, ``run`` launches it."""

    def __init__(self, use_cuda_graph=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None):
        self._use_cuda_graph = use_cuda_graph
        self._paged_kv_indptr_buf, self._paged_kv_indices_buf = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self._num_chunks = 0                                   # plan_info: split-KV work items per request

    def plan(self, indptr, indices, kv_lens_cpu):
        if self._use_cuda_graph:                               # fixed buffers: the graph reads these addresses
            self._paged_kv_indptr_buf[: indptr.numel()].copy_(indptr)
            self._paged_kv_indices_buf[: indices.numel()].copy_(indices)
        else:
            self._paged_kv_indptr_buf, self._paged_kv_indices_buf = indptr, indices
        self._num_chunks = -(-max(kv_lens_cpu, default=0) // CHUNK)

    def run(self, q, k_buffer, v_buffer):
        bs = q.shape[0]
        indptr, indices = self._paged_kv_indptr_buf, self._paged_kv_indices_buf
        start, lens = indptr[:bs], indptr[1: bs + 1] - indptr[:bs]
        m = torch.full((bs, 1), NEG, device=q.device)
        s, acc = torch.zeros(bs, 1, device=q.device), torch.zeros_like(q)
        for c in range(self._num_chunks):                      # the launched work: fixed by the plan
            pos = c * CHUNK + torch.arange(CHUNK, device=q.device)
            valid = pos[None, :] < lens[:, None]
            slots = indices[(start[:, None] + pos[None, :]).clamp(max=indices.numel() - 1)]
            scores = ((q[:, None, :] * k_buffer[slots]).sum(-1) * DIM ** -0.5).masked_fill(~valid, NEG)
            m_new = torch.maximum(m, scores.max(-1, keepdim=True).values)
            p = torch.exp(scores - m_new) * valid
            alpha = torch.exp(m - m_new)
            s = s * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + (p[:, :, None] * v_buffer[slots]).sum(1)
            m = m_new
        return acc / s.clamp_min(1e-30)                        # no KV at all: zeros, as the kernel writes


class FlashInferAttnBackend:
    def __init__(self, pool, device):
        self.pool, self.device = pool, device
        self.kv_indptr = torch.zeros(MAX_BS + 1, dtype=torch.long, device=device)
        self.cuda_graph_kv_indices = torch.zeros(POOL, dtype=torch.long, device=device)
        self.decode_cuda_graph_metadata = {}
        self.forward_metadata = None

    def update_cross_attention(self, req_pool_indices, encoder_lens, decode_wrapper):
        """Cross attention (wrapper 1): ``paged_kernel_lens = encoder_lens``, KV from slot 0 of each request."""
        encoder_lens_cpu = encoder_lens.tolist()          # host lengths for the plan (outside any capture)
        bs = len(encoder_lens_cpu)
        indptr = torch.zeros(bs + 1, dtype=torch.long, device=self.device)
        indptr[1:] = torch.cumsum(encoder_lens, 0)
        indices = torch.cat([self.pool.req_to_token[r, :n] for r, n in zip(req_pool_indices.tolist(),
                                                                              encoder_lens_cpu)])
        decode_wrapper.plan(indptr, indices, encoder_lens_cpu)

    def init_forward_metadata(self, forward_batch):
        wrapper = BatchDecodeWithPagedKVCacheWrapper()
        self.update_cross_attention(forward_batch.req_pool_indices, forward_batch.encoder_lens, wrapper)
        self.forward_metadata = wrapper

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, encoder_lens):
        wrapper = BatchDecodeWithPagedKVCacheWrapper(True, self.kv_indptr[: bs + 1], self.cuda_graph_kv_indices)
        self.update_cross_attention(req_pool_indices, encoder_lens, wrapper)
        self.decode_cuda_graph_metadata[bs] = self.forward_metadata = wrapper

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, encoder_lens):
        self.update_cross_attention(req_pool_indices, encoder_lens, self.decode_cuda_graph_metadata[bs])

    def forward_decode(self, q):
        return self.forward_metadata.run(q, self.pool.k_buffer, self.pool.v_buffer)


def whisper_decode(w, backend, input_ids, positions):
    """WhisperForConditionalGeneration decode step: cross-attention reads the cached encoder KV (k=None, v=None)."""
    hidden = w.embed_tokens[input_ids] + w.embed_positions[positions]
    hidden = hidden + backend.forward_decode(hidden @ w.q_proj) @ w.out_proj
    return hidden @ w.proj_out


@dataclasses.dataclass
class DecodeInputBuffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    encoder_lens: torch.Tensor

    @classmethod
    def create(cls, *, device, max_bs, encoder_len_fill_value):
        return cls(torch.zeros(max_bs, dtype=torch.long, device=device),
                   torch.zeros(max_bs, dtype=torch.long, device=device),
                   torch.arange(max_bs, device=device),
                   torch.full((max_bs,), encoder_len_fill_value, dtype=torch.long, device=device))


class CudaGraphRunner:
    def __init__(self, w, backend, device, variant):
        self.w, self.backend, self.device = w, backend, device
        self.is_encoder_decoder = True
        if variant == "fix":
            # Non-zero encoder length ensures cross-attention kernels are captured in the graph.
            self.encoder_len_fill_value = MAX_SOURCE_POSITIONS if self.is_encoder_decoder else 0
        else:
            self.encoder_len_fill_value = 0
        self.buffers = DecodeInputBuffers.create(device=device, max_bs=MAX_BS,
                                                 encoder_len_fill_value=self.encoder_len_fill_value)
        self.graphs, self.output_buffers = {}, {}
        self.capture_one_batch_size(MAX_BS)

    def capture_one_batch_size(self, bs):
        b = self.buffers
        self.backend.init_forward_metadata_capture_cuda_graph(bs, b.req_pool_indices[:bs], b.encoder_lens[:bs])

        def run_once():
            return whisper_decode(self.w, self.backend, b.input_ids[:bs], b.positions[:bs])

        self.graphs[bs], self.output_buffers[bs] = capture(
            run_once, device=self.device, warmups=2, name=f"decode bs={bs}", owner="CudaGraphRunner",
            static={"input_ids": b.input_ids, "positions": b.positions, "encoder_lens": b.encoder_lens,
                    "kv_indptr": self.backend.kv_indptr, "kv_indices": self.backend.cuda_graph_kv_indices},
            state={"k_buffer": self.backend.pool.k_buffer, "v_buffer": self.backend.pool.v_buffer})

    def replay(self, forward_batch):
        bs, b = MAX_BS, self.buffers                           # replay_prepare
        b.input_ids.copy_(forward_batch.input_ids)
        b.positions.copy_(forward_batch.positions)
        b.encoder_lens.copy_(forward_batch.encoder_lens)
        self.backend.init_forward_metadata_replay_cuda_graph(bs, b.req_pool_indices[:bs], b.encoder_lens[:bs])
        self.backend.forward_metadata = self.backend.decode_cuda_graph_metadata[bs]
        return replay(self.graphs[bs], self.output_buffers[bs]).clone()


def serve(w, device, variant, graphed):
    gen = generator(1161)
    encoder_lens = [5, 7]
    pool = SimpleNamespace(k_buffer=torch.zeros(POOL, DIM, device=device),
                           v_buffer=torch.zeros(POOL, DIM, device=device),
                           req_to_token=torch.arange(POOL, device=device).view(MAX_BS, MAX_SOURCE_POSITIONS))
    for r, n in enumerate(encoder_lens):                       # prefill (eager): encoder KV into the pool
        kv = randn(n, DIM, gen=gen, device=device) @ w.kv_proj
        loc = pool.req_to_token[r, :n]                         # encoder_out_cache_loc
        pool.k_buffer[loc], pool.v_buffer[loc] = kv[:, :DIM], kv[:, DIM:]
    backend = FlashInferAttnBackend(pool, device)
    runner = CudaGraphRunner(w, backend, device, variant) if graphed else None
    tokens = torch.randint(0, VOCAB, (4, MAX_BS), generator=gen)
    outs = []
    for step in range(tokens.shape[0]):
        fb = SimpleNamespace(input_ids=tokens[step].to(device), positions=torch.full((MAX_BS,), step).to(device),
                             req_pool_indices=torch.arange(MAX_BS, device=device),
                             encoder_lens=torch.tensor(encoder_lens).to(device))
        if graphed:
            outs.append(runner.replay(fb))
        else:
            backend.init_forward_metadata(fb)
            outs.append(whisper_decode(w, backend, fb.input_ids, fb.positions))
    return outs


def run(variant: str, device: str = "cpu"):
    w = load_weights(device)
    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(w, device, variant, True),
                   lambda: serve(w, device, variant, False))
