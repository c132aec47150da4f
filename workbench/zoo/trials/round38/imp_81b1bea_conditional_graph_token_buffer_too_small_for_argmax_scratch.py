"""The GPU-autonomous decode graph's token buffer holds 4 bytes; greedy sampling writes its argmax scratch after it.

Upstream: https://github.com/kekzl/imp/commit/81b1bea71a04e741ffc59b2b042d02e57bbceb1d ("fix: greedy sampling
buffer overflow in conditional CUDA graph loop", on ``main``).
Symptom: as the commit reports, the overflow corrupted "the GPU-autonomous decode loop", "producing garbage
output whenever --temperature 0 was used with CUDA graphs enabled"; the per-step (non-graph) path samples
into the executor's correctly sized buffer.
Mechanism: ``CudaGraphConditionalRunner::setup`` allocates the loop's device state, ``d_token_id_``,
``d_position_``, ``d_context_len_``, ``d_step_counter_`` (one ``cudaMalloc`` each, so they lie next to each
other), copies the initial values in, and captures the body of a conditional WHILE graph:
``GraphExecutor::forward_decode_async(body_state, d_token_id_, ...)`` (embedding from the device token,
attention at ``d_position_`` over ``d_context_len_`` cached tokens, LM head, then
``sample_greedy_device(logits, d_token_id_, ...)``) and ``post_decode_step_kernel`` (ring-buffer write, position
/ context / step increments, stop check). ``sample_greedy_device`` runs the multi-block argmax and keeps its
scratch "right after d_result": ``partial_vals`` at ``d_result + 4`` and ``partial_idxs`` after them,
``ARGMAX_SCRATCH_BYTES`` = 4 + ``ARGMAX_NBLOCKS`` * 8 in all. The executor's own ``d_sample_result_`` is
allocated at that size, but ``setup`` gave ``d_token_id_`` only ``sizeof(int32_t)``: every replayed iteration
writes the partial maxima and indices over the next allocations, the loop's position and context length
(bit patterns of float logits, candidate token ids), so the following iterations rotate at garbage positions,
write the KV cache at the wrong slot and attend over the wrong context.
Doctor: undersized-buffer, at ``sample_greedy_device`` (it writes ``ARGMAX_SCRATCH_BYTES`` of partial results
through a result pointer whose graph-owned allocation holds one ``int32``).
Fix (upstream): ``setup`` allocates ``d_token_id_`` with ``ARGMAX_SCRATCH_BYTES`` (and includes
``compute/sampling.h`` for it). (Diff read: the whole 4-line hunk; ``sample_greedy_device``, the scratch
layout and the executor's allocation read at the fix commit.) Sizes here are tiny: 2 argmax blocks and a
2-word allocation granularity (256 bytes upstream) make the 5-word scratch reach ``d_position_`` and
``d_context_len_``; the WHILE node is modelled as the host replaying the captured body until the body's
kernel clears the condition.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kekzl/imp/commit/81b1bea71a04e741ffc59b2b042d02e57bbceb1d"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "sample_greedy_device"
SYMPTOM = "greedy decoding in the conditional CUDA graph loop produces garbage (argmax scratch overwrites loop state)"

VOCAB, D_MODEL, KV_SIZE = 16, 8, 32
ARGMAX_NBLOCKS, BLOCK_SIZE = 2, 4                # 64 blocks of 256 threads upstream
ARGMAX_SCRATCH_BYTES = 4 + ARGMAX_NBLOCKS * (4 + 4)
CUDA_MALLOC_GRANULARITY = 8                      # bytes (256 upstream)
PROMPT = [3, 11, 6]
MAX_STEPS = 6
EOS_ID = -1                                      # no stop token in this run: the loop ends at max_steps


class DeviceHeap:
    """``cudaMalloc``: consecutive allocations are carved from one address range, rounded up to the
    allocation granularity, so an allocation's neighbour starts right after its rounded end."""

    def __init__(self, device, words: int = 64):
        self.mem = torch.zeros(words, dtype=torch.int32, device=device)
        self.offs = 0

    def cudaMalloc(self, nbytes: int) -> torch.Tensor:
        words = -(-nbytes // 4)
        ptr = self.mem[self.offs:self.offs + words]
        self.offs += -(-nbytes // CUDA_MALLOC_GRANULARITY) * CUDA_MALLOC_GRANULARITY // 4
        return ptr


def argmax_partials(logits: torch.Tensor):
    """``argmax_partial_kernel``: block ``b`` scans a grid stride of the vocabulary and keeps its max."""
    lv = logits.view(-1, ARGMAX_NBLOCKS, BLOCK_SIZE).permute(1, 0, 2).reshape(ARGMAX_NBLOCKS, -1)
    vals, j = lv.max(-1)
    blocks = torch.arange(ARGMAX_NBLOCKS, device=logits.device)
    idxs = (j // BLOCK_SIZE) * ARGMAX_NBLOCKS * BLOCK_SIZE + blocks * BLOCK_SIZE + j % BLOCK_SIZE
    return vals, idxs.to(torch.int32)


def sample_greedy_device(logits: torch.Tensor, d_result: torch.Tensor, h_mapped=None):
    """Multi-block argmax: scratch lives right after ``d_result``.
    Layout: [result(4B)] [partial_vals(ARGMAX_NBLOCKS*4B)] [partial_idxs(ARGMAX_NBLOCKS*4B)]"""
    base = torch.as_strided(d_result, (ARGMAX_SCRATCH_BYTES // 4,), (1,))   # reinterpret_cast<char*>(d_result)
    partial_vals = base[1:1 + ARGMAX_NBLOCKS].view(torch.float32)
    partial_idxs = base[1 + ARGMAX_NBLOCKS:1 + 2 * ARGMAX_NBLOCKS]
    vals, idxs = argmax_partials(logits)                 # argmax_partial_kernel<<<ARGMAX_NBLOCKS, BLOCK_SIZE>>>
    partial_vals.copy_(vals)
    partial_idxs.copy_(idxs)
    best = torch.argmax(partial_vals).view(1)            # argmax_reduce_kernel<<<1, WARP_SIZE>>>
    d_result[0:1].copy_(partial_idxs.index_select(0, best))
    # cudaMemcpyAsync(h_mapped, d_result, 4): a scratch write to mapped memory, not modelled


def sample_greedy(logits: torch.Tensor, d_result: torch.Tensor) -> int:
    """The synchronous variant the per-step path uses (same kernels, then a copy to the host)."""
    sample_greedy_device(logits, d_result)
    return int(d_result[0])


class InferenceState:
    def __init__(self, token_ids, positions, context_lens, k_cache, v_cache):
        self.token_ids, self.positions, self.context_lens = token_ids, positions, context_lens
        self.k_cache, self.v_cache = k_cache, v_cache


class GraphExecutor:
    def __init__(self, device, heap: DeviceHeap):
        gen = generator(81)
        self.token_embedding = randn(VOCAB, D_MODEL, gen=gen, device=device)
        self.wq = randn(D_MODEL, D_MODEL, gen=gen, device=device, scale=0.5)
        self.wk = randn(D_MODEL, D_MODEL, gen=gen, device=device, scale=0.5)
        self.wv = randn(D_MODEL, D_MODEL, gen=gen, device=device, scale=0.5)
        self.wo = randn(D_MODEL, D_MODEL, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(D_MODEL, VOCAB, gen=gen, device=device)
        half = D_MODEL // 2
        self.inv_freq = (1.0 / 10000 ** (torch.arange(half) / half)).to(device)
        # Sampling result buffer: sized to hold the argmax result plus the multi-block partial scratch.
        self.d_sample_result_ = heap.cudaMalloc(ARGMAX_SCRATCH_BYTES)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ang = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)

    def forward_logits(self, state: InferenceState) -> torch.Tensor:
        h = self.token_embedding[state.token_ids.long()]                   # embedding_lookup_from_device
        q = self.rope(h @ self.wq, state.positions)
        k = self.rope(h @ self.wk, state.positions)
        slot = (state.context_lens - 1).long()                              # the new token's KV slot
        state.k_cache.index_copy_(0, slot, k)
        state.v_cache.index_copy_(0, slot, h @ self.wv)
        scores = state.k_cache @ q[0] / D_MODEL ** 0.5
        ctx_pos = torch.arange(KV_SIZE, device=scores.device)
        scores = scores.masked_fill(ctx_pos >= state.context_lens, float("-inf"))
        attn = torch.softmax(scores, 0) @ state.v_cache
        return ((h[0] + attn @ self.wo) @ self.lm_head).contiguous()

    def forward_decode_async(self, state: InferenceState, d_token_id: torch.Tensor, h_mapped=None):
        """Decode one token with the sampled token left on the device (the graph body)."""
        sample_greedy_device(self.forward_logits(state), d_token_id, h_mapped)

    def forward_decode(self, state: InferenceState) -> int:
        """The per-step path: sample into the executor's own ``d_sample_result_``."""
        return sample_greedy(self.forward_logits(state), self.d_sample_result_)


def post_decode_step_kernel(d_token_id, d_ring_buffer, d_ring_step_counter, d_position, d_context_len,
                            d_step_counter, max_steps, eos_id, handle):
    step = d_step_counter.long()
    token = d_token_id[0:1]
    d_ring_buffer.index_copy_(0, step, token)            # write token to ring buffer
    d_position.add_(1)
    d_context_len.add_(1)
    d_step_counter.add_(1)
    d_ring_step_counter.copy_(d_step_counter)
    should_stop = (d_step_counter >= max_steps) | (token == eos_id)
    handle.copy_(~should_stop)                           # cudaGraphSetConditional(handle, 0) to break the loop


class CudaGraphConditionalRunner:
    def __init__(self, variant: str):
        self.variant = variant

    def setup(self, executor: GraphExecutor, heap: DeviceHeap, state_template: InferenceState, first_token: int,
              initial_position: int, initial_context_len: int, max_steps: int, device: str):
        self.max_steps = max_steps
        # ---- Allocate device state ----
        if self.variant == "bug":
            self.d_token_id_ = heap.cudaMalloc(4)                         # sizeof(int32_t)
        else:
            self.d_token_id_ = heap.cudaMalloc(ARGMAX_SCRATCH_BYTES)
        self.d_position_ = heap.cudaMalloc(4)
        self.d_context_len_ = heap.cudaMalloc(4)
        self.d_step_counter_ = heap.cudaMalloc(4)
        self.d_ring_buffer_ = torch.zeros(max_steps, dtype=torch.int32, device=device)   # mapped pinned memory
        self.d_step_counter_mapped_ = torch.zeros(1, dtype=torch.int32, device=device)
        self.handle_ = torch.ones(1, dtype=torch.bool, device=device)                     # default 1: continue
        # ---- Initialize device state ----
        self.d_token_id_[0:1].fill_(first_token)
        self.d_position_.fill_(initial_position + 1)
        self.d_context_len_.fill_(initial_context_len + 1)
        self.d_step_counter_.fill_(0)
        # ---- Build InferenceState for graph body (uses our device pointers) ----
        body_state = InferenceState(self.d_token_id_[0:1], self.d_position_, self.d_context_len_,
                                    state_template.k_cache, state_template.v_cache)

        def body():
            executor.forward_decode_async(body_state, self.d_token_id_)
            post_decode_step_kernel(self.d_token_id_, self.d_ring_buffer_, self.d_step_counter_mapped_,
                                    self.d_position_, self.d_context_len_, self.d_step_counter_,
                                    max_steps, EOS_ID, self.handle_)
            return self.d_token_id_[0:1]

        # cudaStreamBeginCaptureToGraph(stream, body_graph) ... cudaStreamEndCapture; cudaGraphInstantiate
        self.exec_, self.out_ = capture(
            body, device=device, warmups=0, name="conditional WHILE body", owner="CudaGraphConditionalRunner",
            state={"d_token_id_": self.d_token_id_, "d_position_": self.d_position_,
                   "d_context_len_": self.d_context_len_, "d_step_counter_": self.d_step_counter_,
                   "d_ring_buffer_": self.d_ring_buffer_, "k_cache": state_template.k_cache,
                   "v_cache": state_template.v_cache})
        return True

    def launch(self):
        """``cudaGraphLaunch(exec_)``: the WHILE node re-runs its body while the handle is set."""
        while bool(self.handle_):
            replay(self.exec_, self.out_)

    def wait_and_get_tokens(self) -> torch.Tensor:
        total_steps = int(self.d_step_counter_mapped_)
        return self.d_ring_buffer_[:total_steps].clone()


class Engine:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.heap = DeviceHeap(device)
        self.executor = GraphExecutor(device, self.heap)
        self.k_cache = torch.zeros(KV_SIZE, D_MODEL, device=device)
        self.v_cache = torch.zeros(KV_SIZE, D_MODEL, device=device)
        # the per-step path's device inputs
        self.d_tokens = self.heap.cudaMalloc(4)
        self.d_positions = self.heap.cudaMalloc(4)
        self.d_context_lens = self.heap.cudaMalloc(4)

    def step(self, token: int, position: int) -> int:
        self.d_tokens.fill_(token)
        self.d_positions.fill_(position)
        self.d_context_lens.fill_(position + 1)
        state = InferenceState(self.d_tokens, self.d_positions, self.d_context_lens, self.k_cache, self.v_cache)
        return self.executor.forward_decode(state)

    def generate(self, prompt, max_steps: int, use_graph: bool):
        for position, token in enumerate(prompt):                  # prefill (token by token here)
            first_token = self.step(token, position)
        position = len(prompt) - 1
        if use_graph:                                               # temperature 0 + CUDA graphs
            runner = CudaGraphConditionalRunner(self.variant)
            state_template = InferenceState(None, None, None, self.k_cache, self.v_cache)
            runner.setup(self.executor, self.heap, state_template, first_token, position, position + 1,
                         max_steps, self.device)
            runner.launch()
            tokens = runner.wait_and_get_tokens()
        else:                                                       # per-step decode
            out, token = [], first_token
            for _ in range(max_steps):
                position += 1
                token = self.step(token, position)
                out.append(token)
            tokens = torch.tensor(out, dtype=torch.int32)
        return [tokens.to(torch.float32), self.k_cache.clone()]


def run(variant: str, device: str = "cpu"):
    def serve(use_graph: bool):
        return Engine(device, variant).generate(PROMPT, MAX_STEPS, use_graph)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
