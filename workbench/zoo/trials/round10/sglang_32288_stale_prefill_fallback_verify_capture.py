"""trtllm_mla: the prefill graphs' flashinfer fallback flag is still set when the target-verify graph is captured.

Upstream: https://github.com/sgl-project/sglang/pull/32288 ("Fix stale flashinfer-MLA fallback poisoning spec
verify capture (trtllm_mla + tc_piecewise)", commit 82fe0f041a; first diagnosed in #31198).
Symptom: Kimi-K2.6-NVFP4 + DFLASH with ``--attention-backend trtllm_mla`` and the ``tc_piecewise`` prefill
CUDA-graph backend hangs or crashes at serving with a deterministic all-rank ``Warp Illegal Address`` in
``flashinfer::mla::BatchMLAPagedAttentionKernel`` on the first generation batch (8xB200 nightly, SGLang main,
July 2026). Capturing the decode graphs before the prefill graphs, or running eagerly, is clean.
Mechanism: ``TRTLLMMLABackend.forward_extend`` starts with a short-circuit on persistent instance state:
``if self.forward_prefill_metadata is not None and ...fallback_to_flashinfer_impl: return
super().forward_extend(...)``. Piecewise prefill capture (and every piecewise prefill) leaves
``forward_prefill_metadata`` with ``fallback_to_flashinfer_impl=True``; the eager ``init_forward_metadata``
clears it for TARGET_VERIFY / DRAFT_EXTEND batches, but ``init_forward_metadata_capture_cuda_graph`` does not.
The decode runner's TARGET_VERIFY capture therefore takes the stale branch and records the flashinfer-MLA
wrapper's attention, which reads the wrapper's planned page layout, into the verify graph. Replay-prep then
writes trtllm-gen metadata (``block_kv_indices``, ``seq_lens_k``) that the recorded kernels never read: every
replay attends over the layout of the last prefill plan (upstream: an illegal address; here: the draft tokens'
own KV and the accepted tokens are missing from the verify attention).
Doctor: warmup-divergence, at ``forward_extend`` (a branch decided at capture from state left by another
graph's capture; eager verify steps decide otherwise).
Fix (upstream): the prefill-fallback short-circuit in ``forward_extend`` no longer applies to target-verify and
draft-extend batches (decode-family extends must never take it), mirroring the eager-path clear.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum, auto

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/32288"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_extend"
SYMPTOM = "the verify graph replays flashinfer-MLA attention on the last prefill's page layout (IMA upstream)"
VOCAB, DIM, NUM_SLOTS, MAX_BS, WIDTH = 12, 8, 32, 1, 12
NUM_DRAFT_TOKENS = 2
_in_piecewise = False


@contextlib.contextmanager
def piecewise_cuda_graph():
    global _in_piecewise
    _in_piecewise, old = True, _in_piecewise
    try:
        yield
    finally:
        _in_piecewise = old


def is_in_piecewise_cuda_graph() -> bool:
    return _in_piecewise


class ForwardMode(Enum):
    EXTEND = auto()
    TARGET_VERIFY = auto()
    DRAFT_EXTEND = auto()

    def is_target_verify(self):
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self):
        return self is ForwardMode.DRAFT_EXTEND


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor          # prefix lengths (verify) or sequence lengths (extend)
    extend_len: int                 # query tokens per request


@dataclass
class TRTLLMMLAPrefillMetadata:
    max_seq_len: int
    seq_lens: torch.Tensor
    fallback_to_flashinfer_impl: bool = False


@dataclass
class TRTLLMMLADecodeMetadata:
    block_kv_indices: torch.Tensor | None = None
    seq_lens_k: torch.Tensor | None = None


def _paged_mla_attention(q, kv_pool, kv_indices, kv_lens, q_per_req: int):
    """Causal paged MLA attention (latent KV is both key and value): query j of a request sees the first
    ``kv_len - q_per_req + 1 + j`` entries of its page row."""
    t = torch.arange(q.shape[0], device=q.device)
    req, j = t // q_per_req, t % q_per_req
    kv = kv_pool[kv_indices[req]]                                                   # [tokens, WIDTH, DIM]
    causal_len = kv_lens[req] - q_per_req + 1 + j
    valid = torch.arange(kv.shape[1], device=q.device).unsqueeze(0) < causal_len.unsqueeze(1)
    scores = (q.unsqueeze(1) * kv).sum(-1).masked_fill(~valid, float("-inf"))
    return (torch.softmax(scores / DIM ** 0.5, dim=-1).unsqueeze(-1) * kv).sum(1)


class BatchMLAPagedAttentionWrapper:
    """flashinfer's MLA wrapper: ``plan`` writes the page layout into its own buffers, ``run`` reads them."""

    def __init__(self, device):
        self._kv_indices_buf = torch.zeros(MAX_BS, WIDTH, dtype=torch.long, device=device)
        self._kv_len_arr_buf = torch.ones(MAX_BS, dtype=torch.long, device=device)

    def plan(self, kv_indices, kv_lens):
        self._kv_indices_buf[:kv_indices.shape[0], :kv_indices.shape[1]].copy_(kv_indices)
        self._kv_len_arr_buf[:kv_lens.shape[0]].copy_(kv_lens)

    def run(self, q, kv_pool, q_per_req):
        return _paged_mla_attention(q, kv_pool, self._kv_indices_buf, self._kv_len_arr_buf, q_per_req)


class FlashInferMLAAttnBackend:
    def __init__(self, req_to_token, device):
        self.req_to_token = req_to_token
        self.prefill_wrapper_paged = BatchMLAPagedAttentionWrapper(device)

    def init_forward_metadata(self, forward_batch):
        self.prefill_wrapper_paged.plan(self.req_to_token[forward_batch.req_pool_indices],
                                        forward_batch.seq_lens)

    def forward_extend(self, q, k, kv_pool, out_cache_loc, forward_batch):
        kv_pool[out_cache_loc] = k
        return self.prefill_wrapper_paged.run(q, kv_pool, forward_batch.extend_len)


class TRTLLMMLABackend(FlashInferMLAAttnBackend):
    def __init__(self, req_to_token, device, variant):
        super().__init__(req_to_token, device)
        self.variant = variant
        self.forward_prefill_metadata = None
        self.forward_decode_metadata = None

    def init_forward_metadata(self, forward_batch):
        if forward_batch.forward_mode.is_target_verify() or forward_batch.forward_mode.is_draft_extend():
            # Decode-family extends never take the prefill fallback: drop stale prefill metadata.
            self.forward_prefill_metadata = None
            seq_lens_k = forward_batch.seq_lens + forward_batch.extend_len
            self.forward_decode_metadata = TRTLLMMLADecodeMetadata(
                self.req_to_token[forward_batch.req_pool_indices], seq_lens_k)
            return
        fallback = is_in_piecewise_cuda_graph()            # tc_piecewise prefill runs flashinfer-MLA
        self.forward_prefill_metadata = TRTLLMMLAPrefillMetadata(
            int(forward_batch.seq_lens.max()), forward_batch.seq_lens, fallback_to_flashinfer_impl=fallback)
        if fallback:
            super().init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs, device):
        self.decode_cuda_graph_kv_indices = torch.zeros(max_bs, WIDTH, dtype=torch.long, device=device)
        self.decode_cuda_graph_seq_lens_k = torch.ones(max_bs, dtype=torch.long, device=device)

    def init_forward_metadata_capture_cuda_graph(self, bs, forward_mode):
        self.forward_decode_metadata = TRTLLMMLADecodeMetadata(self.decode_cuda_graph_kv_indices[:bs],
                                                               self.decode_cuda_graph_seq_lens_k[:bs])

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode):
        self.decode_cuda_graph_kv_indices[:bs].copy_(self.req_to_token[req_pool_indices])
        self.decode_cuda_graph_seq_lens_k[:bs].copy_(seq_lens + NUM_DRAFT_TOKENS)

    def forward_extend(self, q, k, kv_pool, out_cache_loc, forward_batch):
        mode = forward_batch.forward_mode
        use_prefill_fallback = (self.forward_prefill_metadata is not None
                                and self.forward_prefill_metadata.fallback_to_flashinfer_impl)
        if self.variant == "fix":
            use_prefill_fallback = use_prefill_fallback and not (mode.is_target_verify() or mode.is_draft_extend())
        if use_prefill_fallback:
            return super().forward_extend(q, k, kv_pool, out_cache_loc, forward_batch)
        kv_pool[out_cache_loc] = k
        if mode.is_target_verify() or mode.is_draft_extend():
            m = self.forward_decode_metadata                 # trtllm-gen decode kernel on block_kv_indices
            return _paged_mla_attention(q, kv_pool, m.block_kv_indices, m.seq_lens_k, forward_batch.extend_len)
        m = self.forward_prefill_metadata                    # trtllm-gen ragged prefill
        return _paged_mla_attention(q, kv_pool, self.req_to_token[forward_batch.req_pool_indices], m.seq_lens,
                                    forward_batch.extend_len)


class Model:
    def __init__(self, device):
        gen = generator(32288)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wkv = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, backend, kv_pool, input_ids, out_cache_loc, forward_batch):
        h = self.embed_tokens[input_ids]
        o = backend.forward_extend(h @ self.wq, h @ self.wkv, kv_pool, out_cache_loc, forward_batch)
        return (h + o) @ self.lm_head


def run(variant: str, device: str = "cpu"):
    req_to_token = torch.arange(1, WIDTH + 1, device=device).unsqueeze(0)           # position p -> KV slot p + 1
    req_pool_indices = torch.zeros(MAX_BS, dtype=torch.long, device=device)
    prompt = torch.tensor([3, 5, 1, 7], device=device)
    # (prefix length, draft token ids) of successive verify steps
    steps = [(4, [2, 9]), (5, [4, 4]), (7, [8, 6])]

    def serve(graphed: bool):
        model = Model(device)
        kv_pool = torch.zeros(NUM_SLOTS, DIM, device=device)
        backend = TRTLLMMLABackend(req_to_token, device, variant)
        input_ids = torch.zeros(MAX_BS * NUM_DRAFT_TOKENS, dtype=torch.long, device=device)
        out_cache_loc = torch.full((MAX_BS * NUM_DRAFT_TOKENS,), NUM_SLOTS - 1, dtype=torch.long, device=device)
        verify_batch = ForwardBatch(ForwardMode.TARGET_VERIFY, req_pool_indices,
                                    torch.ones(MAX_BS, dtype=torch.long, device=device), NUM_DRAFT_TOKENS)
        if graphed:
            # Server start: tc_piecewise prefill capture (attention runs between the pieces), then the decode
            # runner's TARGET_VERIFY capture.
            with piecewise_cuda_graph():
                backend.init_forward_metadata(ForwardBatch(ForwardMode.EXTEND, req_pool_indices,
                                                           torch.full((MAX_BS,), 2, device=device), 2))
            backend.init_cuda_graph_state(MAX_BS, device)
            backend.init_forward_metadata_capture_cuda_graph(MAX_BS, ForwardMode.TARGET_VERIFY)
            g, out = capture(lambda: model.forward(backend, kv_pool, input_ids, out_cache_loc, verify_batch),
                             device=device, warmups=1, name=f"target_verify bs {MAX_BS}",
                             static={"input_ids": input_ids, "out_cache_loc": out_cache_loc,
                                     "block_kv_indices": backend.decode_cuda_graph_kv_indices,
                                     "seq_lens_k": backend.decode_cuda_graph_seq_lens_k},
                             state={"kv_pool": kv_pool}, owner="CudaGraphRunner (TARGET_VERIFY)")
        # Prefill of the request (through the piecewise prefill graphs when graphed).
        prefill_batch = ForwardBatch(ForwardMode.EXTEND, req_pool_indices,
                                     torch.tensor([len(prompt)], device=device), len(prompt))
        with piecewise_cuda_graph() if graphed else contextlib.nullcontext():
            backend.init_forward_metadata(prefill_batch)
            outs = [model.forward(backend, kv_pool, prompt, req_to_token[0, :len(prompt)], prefill_batch).clone()]
        for prefix_len, draft_ids in steps:
            ids = torch.tensor(draft_ids, device=device)
            loc = req_to_token[0, prefix_len:prefix_len + NUM_DRAFT_TOKENS]
            seq_lens = torch.tensor([prefix_len], device=device)
            if not graphed:
                batch = ForwardBatch(ForwardMode.TARGET_VERIFY, req_pool_indices, seq_lens, NUM_DRAFT_TOKENS)
                backend.init_forward_metadata(batch)
                outs.append(model.forward(backend, kv_pool, ids, loc, batch).clone())
                continue
            input_ids.copy_(ids)
            out_cache_loc.copy_(loc)
            backend.init_forward_metadata_replay_cuda_graph(MAX_BS, req_pool_indices, seq_lens,
                                                            ForwardMode.TARGET_VERIFY)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
