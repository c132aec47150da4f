"""A CUDA-graph-captured ``moe_permute`` copies its expert offsets from a stack array: replays copy whatever the last call left there, so tokens land in the wrong expert's rows.

Upstream: https://github.com/PaddlePaddle/Paddle/pull/78568 ("[BugFix] Fix CUDA Graph compatibility for H2D async
memcpy using host-local variables", merged 2026-04-02; cherry-picked as #78599, 2026-04-07).
Symptom: with a CUDA graph captured over MoE layers that use ``moe_permute`` (non-override mode), replays produce
wrong hidden states (tokens processed by the wrong expert, some tokens' rows overwritten by others'), possibly
out-of-bounds writes; eager runs are correct. No error is raised. The PR's words: at replay "the local variable has
been destructed, the address is a dangling pointer -> undefined behaviour, possibly wrong data or a crash".
Mechanism: ``MoePermuteKernel`` (paddle/phi/kernels/gpu/moe_permute_kernel.cu), in plain (non-override) mode,
computes ``int expert_offset[kMaxNumExperts]`` and ``int expert_offset_end[kMaxNumExperts]`` from the host list
``tokens_per_expert`` in stack arrays and sends them to the device with ``cudaMemcpyAsync(...,
cudaMemcpyHostToDevice, dev_ctx.stream())`` straight from those arrays. Eagerly the driver stages the pageable source
before returning, so the values are read at the call. Under capture the memcpy node records the host address of
the stack array and reads it at every replay. When the kernel returns its frame is released; the next
``MoePermuteKernel`` call (the next MoE layer, at the same call depth) puts its own offsets in the same slots. After
the capture those slots hold the last layer's offsets, so every replay gives every layer the last layer's
``expert_offset``: ``permute_kernel`` places each layer's tokens at the wrong rows of ``X_unzipped`` (overlapping
other experts' segments), the grouped expert GEMM (split by the layer's own ``tokens_per_expert``) applies the wrong
experts' weights, and ``moe_unpermute`` gathers tokens another token overwrote.
Doctor: dangling-reference, at MoePermuteKernel (its captured H2D copy reads the stack array ``expert_offset``,
memory whose owner, the kernel's frame, released it on return and later frames reused; replays read what the last
frame left there).
Fix (upstream): the host source goes through ``backends::gpu::RestoreHostMemIfCapturingCUDAGraph(expert_offset,
kMaxNumExperts)`` (and likewise ``expert_offset_end``): while capturing it copies the bytes into host memory of
its own, freed by a post-reset callback of the graph, and returns that stable pointer; eagerly it returns the
pointer unchanged. The PR applies the same helper to 33 files (``padding_rows`` in ``dispatch_preprocess``,
``phi::Copy``'s H2D branch, ``TensorFromVector``, the p_send shape size, ...), and makes the helper allocate with
``cudaHostAlloc`` instead of ``new[]``; only the ``expert_offset`` site is modelled.
Modelled: DenseTensors are torch tensors, the host thread's stack a pinned host buffer whose frames are pushed
and popped per call; ``cudaMemcpyAsync`` from pageable memory is a blocking copy eagerly and a captured
``non_blocking`` copy (reading its source by address at replay) under capture; the runner is
``paddle.device.cuda.graphs.CUDAGraph`` (one eager step, capture, replays) over two MoE layers whose dispatch gives
every expert the same token count every step (so ``tokens_per_expert``, host data, is valid across replays);
``padding_alignment`` 1, so ``padding_rows`` is empty and ``dispatch_preprocess`` returns early; one permute block
(<= 32 rows: only the prefix chain, which needs ``expert_offset`` but not ``expert_offset_end``); float32 instead of
bf16/fp8, no scales, ``kMaxNumExperts`` 8, the expert FFN one matmul per expert.
"""
from __future__ import annotations

import torch

from workbench.engine import host, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/Paddle/pull/78568"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "MoePermuteKernel"
SYMPTOM = "MoE layers replayed from a CUDA graph route tokens by the last layer's expert offsets"

K_MAX_NUM_EXPERTS, NUM_EXPERTS, ROWS, COLS, TOPK, PADDING_ALIGNMENT, STEPS = 8, 4, 8, 6, 2, 1, 3
# Each layer's dispatch plan: every step gives every expert the same number of tokens (the pairs are dealt to
# different tokens each step), so the host list tokens_per_expert holds for every replay.
EXPERT_PAIRS = [
    [(2, 1), (2, 3), (2, 1), (2, 3), (2, 0), (2, 1), (0, 3), (1, 3)],      # tokens_per_expert [2, 4, 6, 4]
    [(1, 0), (1, 3), (1, 0), (1, 3), (1, 2), (1, 0), (2, 3), (0, 3)],      # tokens_per_expert [4, 6, 2, 4]
]


# --- the host side of the C++ runtime --------------------------------------------------------------

class HostStack:
    """The host thread's stack: a kernel's local arrays live in its frame until it returns."""

    def __init__(self, device):
        self.mem = host(torch.zeros(64, dtype=torch.int32), device)
        self.sp = 0

    def push(self, n):
        frame = self.mem[self.sp:self.sp + n]
        self.sp += n
        return frame

    def pop(self, frame):
        self.sp -= frame.numel()               # released; the next call at this depth reuses the slots


class GPUContext:
    def __init__(self, device):
        self.device = device
        self.stack = HostStack(device)
        self.post_reset_callbacks = []         # CUDAGraph::AddPostResetCallbackDuringCapturing


def IsCUDAGraphCapturing() -> bool:
    return is_capturing()


def RestoreHostMemIfCapturingCUDAGraph(dev_ctx, host_mem):
    """cuda_graph_with_memory_pool.h: while capturing, copy ``host_mem`` into memory that lives until the graph
    is reset, and return it; otherwise return ``host_mem``."""
    if IsCUDAGraphCapturing():
        new_host_mem = host(torch.tensor(host_mem.tolist(), dtype=host_mem.dtype), dev_ctx.device)
        dev_ctx.post_reset_callbacks.append(new_host_mem)     # freed by the graph's post-reset callback
        return new_host_mem
    return host_mem


def cudaMemcpyAsync_H2D(dst, src):
    """Eagerly the driver stages the pageable source before returning (the values of now); a capture records a
    memcpy node that keeps the host address and reads it at each replay."""
    dst.copy_(src, non_blocking=IsCUDAGraphCapturing())


# --- paddle/phi/kernels/gpu/moe_permute_kernel.cu ---------------------------------------------------

def permute_kernel(X, routemap_topk, probs_topk, expert_base_offset, X_unzipped, zipped_expertwise_rowmap,
                   probs_unzipped, expert_indices, num_experts):
    """One block (prefix chain): an expert's tokens go, in row order, from ``expert_base_offset[expert]`` on."""
    experts = torch.arange(num_experts, device=X.device, dtype=routemap_topk.dtype)
    mask = (routemap_topk[:, :, None] == experts).any(1).to(torch.int32)             # [rows, num_experts]
    rank = torch.cumsum(mask, 0, dtype=torch.int32) - mask
    final_pos = expert_base_offset[:num_experts] + rank
    zipped_expertwise_rowmap.copy_(torch.where(mask > 0, final_pos, torch.full_like(final_pos, -1)))
    for k in range(routemap_topk.shape[1]):
        expert = routemap_topk[:, k].long()
        out_row = zipped_expertwise_rowmap.gather(1, expert[:, None]).squeeze(1).long()
        X_unzipped.index_copy_(0, out_row, X)
        probs_unzipped.index_copy_(0, out_row, probs_topk[:, k])
        expert_indices.index_copy_(0, out_row, routemap_topk[:, k])


def MoePermuteKernel(dev_ctx, X, expert_routemap_topk, expert_prob_topk, num_experts, tokens_per_expert,
                     padding_alignment, variant):
    rows, cols = X.shape
    total = sum(-(-n // padding_alignment) * padding_alignment for n in tokens_per_expert)
    X_unzipped = torch.empty(total, cols, device=X.device)
    zipped_expertwise_rowmap = torch.empty(rows, num_experts, dtype=torch.int32, device=X.device)
    token_prob_unzipped = torch.empty(total, device=X.device)
    expert_indices = torch.empty(total, dtype=torch.int32, device=X.device)
    expert_offset_tensor = torch.empty(K_MAX_NUM_EXPERTS, dtype=torch.int32, device=X.device)
    expert_offset_end_tensor = torch.empty(K_MAX_NUM_EXPERTS, dtype=torch.int32, device=X.device)

    # plain non-override mode: int expert_offset[kMaxNumExperts]; int expert_offset_end[kMaxNumExperts];
    expert_offset = dev_ctx.stack.push(K_MAX_NUM_EXPERTS)
    expert_offset_end = dev_ctx.stack.push(K_MAX_NUM_EXPERTS)
    offsets, ends, tokens_cumulated = [0] * K_MAX_NUM_EXPERTS, [0] * K_MAX_NUM_EXPERTS, 0
    for i in range(num_experts):
        offsets[i] = tokens_cumulated
        ends[i] = offsets[i] + tokens_per_expert[i] - 1
        tokens_cumulated += -(-tokens_per_expert[i] // padding_alignment) * padding_alignment
    expert_offset.numpy()[:] = offsets                 # plain host stores into the frame
    expert_offset_end.numpy()[:] = ends
    src_offset, src_offset_end = expert_offset, expert_offset_end
    if variant == "fix":
        src_offset = RestoreHostMemIfCapturingCUDAGraph(dev_ctx, expert_offset)
        src_offset_end = RestoreHostMemIfCapturingCUDAGraph(dev_ctx, expert_offset_end)
    cudaMemcpyAsync_H2D(expert_offset_tensor, src_offset)
    cudaMemcpyAsync_H2D(expert_offset_end_tensor, src_offset_end)
    # (padding_rows is empty with padding_alignment 1: dispatch_preprocess returns at once)

    permute_kernel(X, expert_routemap_topk, expert_prob_topk, expert_offset_tensor, X_unzipped,
                   zipped_expertwise_rowmap, token_prob_unzipped, expert_indices, num_experts)
    dev_ctx.stack.pop(expert_offset_end)               # the kernel returns: its frame is released
    dev_ctx.stack.pop(expert_offset)
    return X_unzipped, zipped_expertwise_rowmap, token_prob_unzipped, expert_indices


def moe_unpermute(unzipped_tokens, zipped_expertwise_rowmap, token_prob_unzipped, num_experts):
    out = torch.zeros(zipped_expertwise_rowmap.shape[0], unzipped_tokens.shape[1], device=unzipped_tokens.device)
    for e in range(num_experts):
        pos = zipped_expertwise_rowmap[:, e].long()
        valid = (pos >= 0)[:, None]
        src = pos.clamp(min=0)
        out += torch.where(valid, unzipped_tokens[src] * token_prob_unzipped[src][:, None], 0.0)
    return out


# --- the model (PaddleFormers-style MoE layer) -----------------------------------------------------

class MoELayer:
    def __init__(self, dev_ctx, pairs, gen, device, variant):
        self.dev_ctx, self.variant = dev_ctx, variant
        self.pairs = torch.tensor(pairs, dtype=torch.int32)
        self.tokens_per_expert = torch.bincount(self.pairs.flatten(), minlength=NUM_EXPERTS).tolist()
        self.w = randn(NUM_EXPERTS, COLS, COLS, gen=gen, device=device, scale=COLS ** -0.5)
        self.routemap = torch.zeros(ROWS, TOPK, dtype=torch.int32, device=device)   # the step's dispatch
        self.probs = torch.zeros(ROWS, TOPK, device=device)

    def forward(self, x):
        X_unzipped, rowmap, probs_unzipped, _ = MoePermuteKernel(
            self.dev_ctx, x, self.routemap, self.probs, NUM_EXPERTS, self.tokens_per_expert, PADDING_ALIGNMENT,
            self.variant)
        segments = torch.split(X_unzipped, self.tokens_per_expert)                  # grouped GEMM (host splits)
        y = torch.cat([seg @ self.w[e] for e, seg in enumerate(segments)])
        return x + moe_unpermute(y, rowmap, probs_unzipped, NUM_EXPERTS)


def run(variant: str, device: str = "cpu"):
    gen = generator(78568)
    inputs = [randn(ROWS, COLS, gen=gen, device=device) for _ in range(STEPS + 1)]
    dispatch = [[(torch.randperm(ROWS, generator=gen), torch.rand(ROWS, TOPK, generator=gen).softmax(-1))
                 for _ in EXPERT_PAIRS] for _ in range(STEPS + 1)]

    def serve(graphed: bool):
        dev_ctx = GPUContext(device)
        layers = [MoELayer(dev_ctx, pairs, generator(7 + i), device, variant) for i, pairs in enumerate(EXPERT_PAIRS)]
        x_static = torch.zeros(ROWS, COLS, device=device)

        def load(step):
            x_static.copy_(inputs[step])
            for layer, (perm, probs) in zip(layers, dispatch[step]):
                layer.routemap.copy_(layer.pairs[perm].to(device))
                layer.probs.copy_(probs.to(device))

        def forward():
            h = x_static
            for layer in layers:
                h = layer.forward(h)
            return h

        outs = []
        if graphed:                                    # paddle.device.cuda.graphs.CUDAGraph
            load(0)
            static = {"x": x_static}
            for i, layer in enumerate(layers):
                static.update({f"routemap{i}": layer.routemap, f"probs{i}": layer.probs})
            g, out = capture(forward, device=device, warmups=1, name="moe forward",
                             owner="paddle CUDAGraph (MoE forward)", static=static)
            for step in range(1, STEPS + 1):
                load(step)
                outs.append(replay(g, out).clone())
            dev_ctx.post_reset_callbacks.clear()       # g.reset(): the restored host memory is freed
        else:
            for step in range(1, STEPS + 1):
                load(step)
                outs.append(forward().clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
