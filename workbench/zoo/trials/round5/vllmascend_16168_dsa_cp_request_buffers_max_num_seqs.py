"""Per-request metadata buffers sized by max_num_seqs, written for a graph-padded request count above it.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/16168 ("Fix per-request metadata buffer
sizing for DSA-CP under full cudagraph padding"; re-applies #12599, reverted in #16181).
Symptom: DeepSeek-V4 with DSA-CP + MTP and ``cudagraph_mode=FULL_DECODE_ONLY`` crashed when serving
concurrent requests: ``aclnnInplaceCopy`` shape mismatch ``Shape [16] vs [6]`` (EZ1007) with
``--max-num-seqs 6`` and 3 concurrent MTP requests, or illegal device memory accesses (EZ9999).
Mechanism: the DSA-CP metadata builder allocated its per-request buffers (``local_seq_lens``,
``start_pos``...) with ``scheduler_config.max_num_seqs`` rows. In FULL-decode graph mode the MTP
draft path gets ``num_reqs`` as the padded request count: the token bucket of the captured graph
(12 tokens of 3 requests pad to 16, one draft token per request), which exceeds ``max_num_seqs``.
The ``[:num_reqs]`` views of the buffers are silently truncated and ``copy_()`` into them fails;
kernels handed the whole buffer index past its end.
Doctor: undersized-buffer, at ``build`` (the copy of the padded request metadata into a static buffer
too small for it).
Fix (upstream): size every per-request buffer with one graph-mode-aware capacity,
``max_padded_reqs = max(max_num_seqs, max_cudagraph_capture_size)``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/16168"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "build"
SYMPTOM = "shape mismatch (EZ1007) copying 16 padded requests' metadata into a 6-row buffer"
DIM, WINDOW, SLOTS = 4, 3, 24
MAX_NUM_SEQS, NUM_SPEC_TOKENS = 6, 3
CAPTURE_SIZES = [4, 8, 16]                  # token buckets; max_cudagraph_capture_size = 16 > max_num_seqs
DECODE_QUERY_LEN = 1 + NUM_SPEC_TOKENS


class AscendDSACPMetadataBuilder:
    """Per-request metadata of the sparse attention, in buffers the FULL graphs read."""

    def __init__(self, device: str, graph_aware: bool) -> None:
        max_padded_reqs = MAX_NUM_SEQS
        if graph_aware:
            max_padded_reqs = max(max_padded_reqs, max(CAPTURE_SIZES))
        self.local_seq_lens = torch.zeros(max_padded_reqs, dtype=torch.long, device=device)
        self.start_pos = torch.zeros(max_padded_reqs, dtype=torch.long, device=device)

    def build(self, seq_lens: torch.Tensor, start_pos: torch.Tensor, num_reqs: int):
        self.local_seq_lens[:num_reqs].copy_(seq_lens)
        self.start_pos[:num_reqs].copy_(start_pos)
        return self.local_seq_lens, self.start_pos


class DraftAttention:
    """The MTP draft layer's sparse attention: each token attends over its request's local window."""

    def __init__(self, device: str) -> None:
        gen = generator(16168)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, hidden, req_index, local_seq_lens, start_pos, kv_cache):
        q = hidden @ self.wq
        seq_lens, starts = local_seq_lens[req_index], start_pos[req_index]          # per token
        offs = torch.arange(WINDOW, device=hidden.device)
        keys = kv_cache[(starts[:, None] + offs) % SLOTS]                           # [T, W, D]
        valid = offs[None, :] < seq_lens[:, None]
        scores = (q[:, None, :] * keys).sum(-1).masked_fill(~valid, -1e9)
        probs = torch.softmax(scores, -1) * valid
        return (probs[..., None] * keys).sum(1) @ self.wo


def steps(device: str):
    """Concurrent MTP requests, one draft token each: 1 request (4 target tokens, bucket 4), then
    3 requests (12 target tokens, bucket 16)."""
    gen = generator(1616)
    out = []
    for n in (1, 3):
        out.append((randn(n, DIM, gen=gen, device=device),
                    torch.tensor([3, 2, 3][:n], device=device), torch.tensor([0, 5, 11][:n], device=device)))
    return out


def run(variant: str, device: str = "cpu"):
    model = DraftAttention(device)
    gen = generator(6)
    kv_cache_init = randn(SLOTS, DIM, gen=gen, device=device)

    def served():
        kv_cache = kv_cache_init.clone()
        builder = AscendDSACPMetadataBuilder(device, graph_aware=(variant == "fix"))
        hidden = torch.zeros(max(CAPTURE_SIZES), DIM, device=device)
        req_index = torch.zeros(max(CAPTURE_SIZES), dtype=torch.long, device=device)
        graphs = {}
        for size in sorted(CAPTURE_SIZES, reverse=True):
            # capture dummy batch: uniform decode, DECODE_QUERY_LEN tokens per request
            num_reqs = size // DECODE_QUERY_LEN
            req_index[:size].copy_(torch.arange(size, device=device) // DECODE_QUERY_LEN)
            builder.build(torch.ones(num_reqs, dtype=torch.long, device=device),
                          torch.zeros(num_reqs, dtype=torch.long, device=device), num_reqs)
            graphs[size] = capture(
                lambda s=size: model.forward(hidden[:s], req_index[:s], builder.local_seq_lens, builder.start_pos,
                                             kv_cache),
                device=device, name=f"size {size}", owner="NPUModelRunner (FULL_DECODE_ONLY)",
                static={"hidden_states": hidden, "req_index": req_index, "local_seq_lens": builder.local_seq_lens,
                        "start_pos": builder.start_pos}, state={"kv_cache": kv_cache})
        outs = []
        for h, lens, starts in steps(device):
            n = h.shape[0]
            size = next(s for s in CAPTURE_SIZES if s >= n * DECODE_QUERY_LEN)    # the target step's bucket
            num_reqs = size                     # draft path: padded request count = bucket, one token each
            hidden[:n].copy_(h)
            req_index[:size].copy_(torch.arange(size, device=device))
            pad = num_reqs - n
            builder.build(torch.cat([lens, lens.new_zeros(pad)]), torch.cat([starts, starts.new_zeros(pad)]), num_reqs)
            g, out = graphs[size]
            outs.append(replay(g, out, real=n, size=size, padded={"hidden_states": hidden})[:n].clone())
        return outs

    def eager():
        kv_cache = kv_cache_init.clone()
        builder = AscendDSACPMetadataBuilder(device, graph_aware=(variant == "fix"))
        outs = []
        for h, lens, starts in steps(device):
            n = h.shape[0]
            seq_lens, start_pos = builder.build(lens, starts, n)
            outs.append(model.forward(h, torch.arange(n, device=device), seq_lens, start_pos, kv_cache))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
