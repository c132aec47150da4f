"""DSA radix top-k scratch from a process-global buffer cache: a larger eager step reallocates it under a captured graph.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/18624 ("[https://nvbugs/6676312][fix] Restore DSA CUDA
TopK workspace lifecycle").
Symptom: DeepSeek-V4 (DSA sparse attention) on the PyTorch backend with CUDA graphs: generation steps replayed
from a graph failed or produced corrupt sparse top-k indices (a P0 bug) after commit 4f13faf713; the
metadata-owned workspaces of the earlier code did not have it (TensorRT-LLM main, September 2026).
Mechanism: commit 4f13faf713 moved the native CUDA radix top-k scratch (``top_k_radix_indices/values
workspace``) out of the DSA attention metadata into a hidden process-global buffer cache keyed only by op
type and device, with no graph or batch identity. The cache hands out its buffer while it is large enough
and replaces it with a bigger one otherwise. The decode graph's warmup sized it for the captured batch and
the capture baked its address into the top-k kernels; a later generation step too large for any captured
graph runs eagerly, asks for more rows, and the cache drops the old buffer. The next replay of the captured
graph writes and reads scratch that is no longer the cache's (freed, then handed to other tensors):
illegal memory access or garbage top-k indices.
Doctor: dangling-reference, at ``get_buffer`` (the process-global cache releases the workspace a captured
graph still addresses, replacing it by a larger one).
Fix (upstream): the DSA metadata owns persistent heuristic and radix top-k workspaces again, sized up front
for the largest token count (linear, static-tree and dynamic-tree speculative decoding included), and
``TopK.forward`` takes these caller-owned buffers through ``radix_ext_kwargs``; the hidden process-global
allocation is removed.
(Tiny indexer: one DSA layer, next_n 1 (MTP), graphs for batch size 2 only; each run starts a fresh process
cache.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/18624"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "get_buffer"
SYMPTOM = "graph replays after a larger eager step address a top-k workspace the buffer cache has released"
DIM, MAX_KV, INDEX_TOPK, NEXT_N = 4, 8, 3, 1
CUDA_GRAPH_BATCH_SIZES = [2]
MAX_BATCH_SIZE = 3
MAX_NUM_TOKENS = MAX_BATCH_SIZE * (1 + NEXT_N)


class Buffers:
    """The process-global scratch cache: one buffer per (op type, device), grown by replacement."""

    def __init__(self):
        self.allocated: dict[str, torch.Tensor] = {}

    def get_buffer(self, numel: int, dtype: torch.dtype, buffer_name: str, device: str) -> torch.Tensor:
        buf = self.allocated.get(buffer_name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)      # the old buffer is dropped
            self.allocated[buffer_name] = buf
        return buf[:numel]


_memory_buffers = Buffers()


class DSAtrtllmAttentionMetadata:
    def __init__(self, device, variant):
        self.device = device
        self.kv_lens_cuda = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=device)
        self.top_k_radix_values_workspace = None
        if variant == "fix":
            # Metadata-owned scratch, sized once for the largest token count the engine can run.
            self.top_k_radix_values_workspace = torch.empty(MAX_NUM_TOKENS * MAX_KV, device=device)

    def radix_ext_kwargs(self):
        if self.top_k_radix_values_workspace is None:
            return None
        return {"top_k_radix_values_workspace": self.top_k_radix_values_workspace}


class TopK:
    def __init__(self, index_topk):
        self.index_topk = index_topk

    def forward(self, logits, radix_ext_kwargs=None):
        num_rows, num_cols = logits.shape
        if radix_ext_kwargs is not None:
            workspace = radix_ext_kwargs["top_k_radix_values_workspace"][:num_rows * num_cols]
        else:
            workspace = _memory_buffers.get_buffer(num_rows * num_cols, logits.dtype,
                                                   f"radix_topk_{logits.device}", str(logits.device))
        return indexer_topk_decode(logits, workspace.view(num_rows, num_cols), self.index_topk)


def indexer_topk_decode(logits, radix_workspace, index_topk):
    """Radix top-k: stage 1 stages the keys in the scratch, stage 2 selects from it."""
    radix_workspace.copy_(logits)
    return radix_workspace.topk(index_topk, dim=-1).indices


class DSALayer:
    def __init__(self, device):
        gen = generator(18624)
        self.wq_idx, self.wq = (randn(DIM, DIM, gen=gen, device=device, scale=0.8) for _ in range(2))
        self.k_idx_cache = randn(MAX_BATCH_SIZE, MAX_KV, DIM, gen=gen, device=device)
        self.kv_cache = randn(MAX_BATCH_SIZE, MAX_KV, DIM, gen=gen, device=device)
        self.top_k = TopK(INDEX_TOPK)

    def forward(self, hidden_states, seq_slots, metadata):
        num_seqs = seq_slots.shape[0]
        req = seq_slots.repeat_interleave(1 + NEXT_N)
        kv_lens = metadata.kv_lens_cuda[:num_seqs].repeat_interleave(1 + NEXT_N)
        logits = torch.einsum("td,tkd->tk", hidden_states @ self.wq_idx, self.k_idx_cache[req])
        logits = logits.masked_fill(torch.arange(MAX_KV, device=logits.device)[None, :] >= kv_lens[:, None], -1e4)
        topk_indices = self.top_k.forward(logits, metadata.radix_ext_kwargs())
        k = self.kv_cache[req[:, None], topk_indices]                # sparse MLA over the selected KV
        p = torch.softmax(torch.einsum("td,tkd->tk", hidden_states @ self.wq, k), -1)
        return (p[:, :, None] * k).sum(1)


def run(variant: str, device: str = "cpu"):
    layer = DSALayer(device)
    gen = generator(3)
    # Generation steps: (seq_slots, kv_lens); the batch of 3 is larger than every captured graph.
    steps = [([0, 1], [5, 6]), ([0, 1, 2], [6, 7, 4]), ([0, 2], [7, 5])]
    hidden = [randn(len(s) * (1 + NEXT_N), DIM, gen=gen, device=device) for s, _ in steps]

    def eager():
        _memory_buffers.allocated.clear()                        # a fresh process
        metadata = DSAtrtllmAttentionMetadata(device, variant)
        outs = []
        for (slots, kv_lens), h in zip(steps, hidden):
            metadata.kv_lens_cuda[:len(slots)] = torch.tensor(kv_lens, device=device)
            outs.append(layer.forward(h, torch.tensor(slots, device=device), metadata))
        return outs

    def served():
        _memory_buffers.allocated.clear()                        # a fresh process
        metadata = DSAtrtllmAttentionMetadata(device, variant)
        bs = CUDA_GRAPH_BATCH_SIZES[0]
        input_hidden = torch.zeros(bs * (1 + NEXT_N), DIM, device=device)
        input_slots = torch.zeros(bs, dtype=torch.long, device=device)
        metadata.kv_lens_cuda.fill_(1)
        g, out = capture(lambda: layer.forward(input_hidden, input_slots, metadata), device=device,
                         name=f"generation bs {bs}", owner="CUDAGraphRunner",
                         static={"hidden_states": input_hidden, "seq_slots": input_slots,
                                 "kv_lens_cuda": metadata.kv_lens_cuda})
        outs = []
        for (slots, kv_lens), h in zip(steps, hidden):
            metadata.kv_lens_cuda[:len(slots)] = torch.tensor(kv_lens, device=device)
            if len(slots) in CUDA_GRAPH_BATCH_SIZES:
                input_hidden.copy_(h)
                input_slots.copy_(torch.tensor(slots, device=device))
                outs.append(replay(g, out).clone())
            else:                                                # no graph for this batch size: eager
                outs.append(layer.forward(h, torch.tensor(slots, device=device), metadata))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
