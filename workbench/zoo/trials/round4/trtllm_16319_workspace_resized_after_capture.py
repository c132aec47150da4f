"""A smaller batch's warmup grows the shared attention workspace: graphs captured before it keep the freed block.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/16319 ("[None][fix] avoid attention workspace resize
during CUDA graph capture").
Symptom: with CUDA graphs, a generation graph captured early at startup replays into an attention workspace
that was reallocated after it was captured: illegal memory access / corrupted attention (TensorRT-LLM PyTorch
backend, July 2026).
Mechanism: all generation graphs share one attention workspace, which the ``trtllm.attention`` op grows
in place (``workspace_.value().resize_({workspace_size})``) whenever a call needs more than it holds.
Warmup and capture ran shape by shape, largest batch first, assuming the largest batch needs the largest
workspace, but below a batch threshold the kernel switches to its multi-block (split-KV) implementation,
which needs more. A smaller shape's warmup therefore resized the workspace after larger graphs had been
captured, and their replays use the address of the block the resize freed.
Doctor: dangling-reference, at ``attention`` (the op that resizes the workspace and whose captured kernels
read and write it).
Fix (upstream): separate eager warmup from capture: first run every graph shape warmup-only (growing the
shared workspace to the largest size any shape needs), then capture every shape; a capture never resizes it.
"""
from __future__ import annotations

import torch

from workbench.engine import GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/16319"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "attention"
SYMPTOM = "a graph captured before a smaller shape's warmup resized the workspace replays into the freed block"
VOCAB, DIM, CTX, CHUNK = 12, 4, 6, 2          # CTX: KV tokens per sequence; CHUNK: KV tokens per split
MAX_BS, NUM_SMS = 4, 3                          # multi-block (split-KV) mode when batch * heads < NUM_SMS
DUMMY_SLOT = MAX_BS                             # KV row of the CUDA-graph dummy requests
CUDA_GRAPH_BATCH_SIZES = [1, 2, 4]
WARMUP_STEPS = 2                                # CUDAGraphRunner.WARMUP_STEPS
PROMPTS = [[3, 7], [5, 1, 9], [2], [8, 4]]      # four requests, KV slots 0..3


class Model:
    def __init__(self, device):
        gen = generator(16319)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(CTX, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


def use_multi_block(num_seqs: int) -> bool:
    """The XQA/MMHA dispatch: too few sequences to fill the SMs -> split the KV range across blocks."""
    return num_seqs < NUM_SMS


def get_workspace_size(num_seqs: int) -> int:
    """``AttentionOp::getWorkspaceSize``: scores for the plain kernel, per-split partial outputs and
    log-sum-exps for the multi-block one (which needs more for a small batch than the plain kernel
    needs for the largest)."""
    if use_multi_block(num_seqs):
        return (CTX // CHUNK) * num_seqs * (DIM + 1)
    return num_seqs * CTX


def _resize_(workspace: torch.Tensor, numel: int) -> None:
    """``workspace_.value().resize_({workspace_size})``: the tensor object stays, its memory moves to a
    new block and the old block goes back to the caching allocator (``set_`` makes that move on the CPU,
    where ``resize_`` would keep the storage object)."""
    workspace.set_(torch.empty(numel, dtype=workspace.dtype, device=workspace.device).untyped_storage())


def attention(q, k, v, k_cache, v_cache, seq_slots, position_ids, kv_lens, workspace):
    """``torch.ops.trtllm.attention`` for generation tokens: append K/V, then attend over each sequence."""
    num_seqs = q.shape[0]
    workspace_size = get_workspace_size(num_seqs)
    if workspace.numel() < workspace_size:
        _resize_(workspace, workspace_size)                 # "Attention workspace size is not enough"
    k_cache[seq_slots, position_ids] = k
    v_cache[seq_slots, position_ids] = v
    keys, values = k_cache[seq_slots], v_cache[seq_slots]                    # [bs, CTX, D]
    scores = (q[:, None, :] * keys).sum(-1) / DIM ** 0.5
    valid = torch.arange(CTX, device=q.device)[None, :] < kv_lens[:, None]
    scores = scores.masked_fill(~valid, float("-inf"))
    if not use_multi_block(num_seqs):
        s = workspace[:num_seqs * CTX].view(num_seqs, CTX)
        s.copy_(scores)
        return (torch.softmax(s, -1)[..., None] * values).sum(1)
    splits = CTX // CHUNK
    partial = workspace[:splits * num_seqs * DIM].view(splits, num_seqs, DIM)
    lse = workspace[splits * num_seqs * DIM:splits * num_seqs * (DIM + 1)].view(splits, num_seqs)
    for i in range(splits):                                                   # one CTA per KV split
        sc = scores[:, i * CHUNK:(i + 1) * CHUNK]
        m = torch.logsumexp(sc, -1)
        lse[i].copy_(m)
        w = torch.exp(sc - torch.where(torch.isinf(m), torch.zeros_like(m), m)[:, None])
        partial[i].copy_((w[..., None] * values[:, i * CHUNK:(i + 1) * CHUNK]).sum(1))
    return (torch.softmax(lse, 0)[..., None] * partial).sum(0)                # the multi-block reduction


def forward(model, input_ids, position_ids, seq_slots, kv_lens, kv_cache, workspace):
    h = model.emb[input_ids] + model.pos[position_ids]
    out = attention(h @ model.wq, h @ model.wk, h @ model.wv, kv_cache[0], kv_cache[1], seq_slots, position_ids,
                    kv_lens, workspace)
    return out @ model.lm_head


def prefill(model, kv_cache, slot, prompt):
    """Context phase, eager (its own workspace): the prompt's K/V into the request's slot."""
    pos = torch.arange(len(prompt), device=kv_cache.device)
    h = model.emb[torch.tensor(prompt, device=kv_cache.device)] + model.pos[pos]
    kv_cache[0, slot, pos] = h @ model.wk
    kv_cache[1, slot, pos] = h @ model.wv


def schedule():
    """Generation steps: (request slots, new token ids). Requests 2 and 3 finish after step 2,
    request 1 after step 3."""
    return [([0, 1, 2, 3], [4, 6, 1, 11]), ([0, 1, 2, 3], [9, 2, 7, 3]), ([0, 1], [5, 10]), ([0], [8])]


def batch_inputs(step, tokens, device):
    """What ``_prepare_tp_inputs`` copies for a generation batch: ids, positions, slots, KV lengths."""
    slots, ids = step
    pos = [len(PROMPTS[s]) + tokens[s] for s in slots]
    for s in slots:
        tokens[s] += 1
    return (torch.tensor(ids, device=device), torch.tensor(pos, device=device), torch.tensor(slots, device=device),
            torch.tensor([p + 1 for p in pos], device=device))


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def new_kv_cache():
        return torch.zeros(2, MAX_BS + 1, CTX, DIM, device=device)

    def eager():
        kv_cache, workspace, tokens, outs = new_kv_cache(), torch.empty(0, device=device), [0] * MAX_BS, []
        for slot, prompt in enumerate(PROMPTS):
            prefill(model, kv_cache, slot, prompt)
        for step in schedule():
            ids, pos, slots, kv_lens = batch_inputs(step, tokens, device)
            outs.append(forward(model, ids, pos, slots, kv_lens, kv_cache, workspace))
        return outs

    def served():
        kv_cache = new_kv_cache()
        cuda_graph_workspace = torch.empty(0, device=device)   # shared by every graph's attention metadata
        # shared_static_tensors, filled for the dummy requests the warmup and capture run
        bufs = {"input_ids": torch.zeros(MAX_BS, dtype=torch.long, device=device),
                "position_ids": torch.zeros(MAX_BS, dtype=torch.long, device=device),
                "seq_slots": torch.full((MAX_BS,), DUMMY_SLOT, dtype=torch.long, device=device),
                "kv_lens": torch.ones(MAX_BS, dtype=torch.long, device=device)}
        events.persistent_state("KVCacheManager", {"kv_cache": kv_cache})

        def graph_forward(size):
            return forward(model, bufs["input_ids"][:size], bufs["position_ids"][:size], bufs["seq_slots"][:size],
                           bufs["kv_lens"][:size], kv_cache, cuda_graph_workspace)

        runner = GraphManager(graph_forward, CUDA_GRAPH_BATCH_SIZES, device=device, num_warmups=WARMUP_STEPS,
                              static_buffers=bufs, descending=True, name="CUDAGraphRunner")
        if variant == "fix":
            # PyTorchModelEngine: every graph shape warmup-only first (grows the shared workspace to the
            # largest size any shape needs), then capture-only.
            for size in sorted(CUDA_GRAPH_BATCH_SIZES, reverse=True):
                for _ in range(WARMUP_STEPS):
                    with events.warmup():
                        graph_forward(size)
        runner.capture()                                      # per shape: warmups, then capture

        for slot, prompt in enumerate(PROMPTS):               # the requests arrive
            prefill(model, kv_cache, slot, prompt)
        tokens, outs = [0] * MAX_BS, []
        for step in schedule():
            ids, pos, slots, kv_lens = batch_inputs(step, tokens, device)
            n = ids.shape[0]
            size = runner.dispatch(n)
            for name, value in (("input_ids", ids), ("position_ids", pos), ("seq_slots", slots),
                                ("kv_lens", kv_lens)):
                bufs[name][:n].copy_(value)
            outs.append(runner.replay(size, real=n).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
