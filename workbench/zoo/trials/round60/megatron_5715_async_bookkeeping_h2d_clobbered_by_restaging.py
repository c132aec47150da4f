"""The async H2D of the pinned bookkeeping buffer reads it after the next step has re-staged it in place.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5715 ("IMA fix by making the copy of book keeping
buffer to GPU blocking"), commit 0cc4d2f3.
Symptom: async ``CUDA error: an illegal memory access was encountered`` in dynamic inference, reliably
during the CUDA-graph warmup loop (steps back to back); the GPU gets corrupted token / KV-block indices.
Mechanism: ``DynamicInferenceContext`` keeps every per-step bookkeeping field (``token_to_input_ids``,
``token_to_pos_ids``, ``token_to_block_idx``, MHA metadata, ...) as views of ONE pinned host buffer,
``_cpu_bookkeeping_buf``, mirrored by one device buffer ``gpu_view._buf`` (``ContextGPUView``) whose views
the graph-captured decode forward reads at fixed addresses. Each step ``initialize_attention_state()``
re-stages the host views in place and ``transfer_bookkeeping_to_gpu()`` issues
``gpu_view._buf.copy_(_cpu_bookkeeping_buf, non_blocking=True)``, trusting that "CUDA stream ordering
guarantees the forward pass sees completed transfers". Stream order protects the device reader, not the
host writer: the copy reads its pinned source when the stream reaches it, and the host (not waiting on
the stream; it only waits for the previous step's sampled tokens) has already re-staged the next step's
indices into the same bytes. Replay N then runs on step N+1's token ids, positions and block indices.
At capture the transfer is drained before ``torch.cuda.graph`` (capture syncs), so capture is clean.
(The CUDA stream is modelled as an in-order queue of launches that the device works through only when the
host waits on it; the host waits on the previous step's forward after launching the next, as the
async-scheduled engine and the warmup loop do.)
Doctor: stale-input, at ``transfer_bookkeeping_to_gpu``: the static ``gpu_view._buf`` a replay reads does
not hold the values its own step staged (the pending H2D picked up the next step's re-staged bytes).
Fix (upstream): the coalesced H2D becomes ``non_blocking=False``, so the host cannot re-stage the pinned
buffer until its copy has completed (a shadow double buffer was benchmarked and not kept).
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5715"
FAMILY = "persistent-buffer mutation"
KIND = "stale-input"
SITE = "transfer_bookkeeping_to_gpu"
SYMPTOM = "decode replays run on the next step's token/position/KV-block indices: wrong outputs (IMA upstream)"

VOCAB, DIM, BLOCK_SIZE, MAX_TOKENS, STEPS = 16, 6, 2, 4, 4
NUM_BLOCKS = 1 + MAX_TOKENS * 4                        # block 0: the dummy block of the capture batch
PROMPT_LENS = (3, 1, 4, 2)                             # four decode requests, one token each per step
REQUEST_BLOCKS = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16])


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

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        """``dst.copy_(src, non_blocking=...)``: an async copy reads ``src`` when the stream gets to it;
        a blocking one returns once it (and everything queued before it) has run."""
        self.launch(lambda: dst.copy_(src))
        if not non_blocking:
            self.synchronize()


class ContextGPUView:
    """One contiguous device buffer; the forward pass reads its views at fixed addresses."""

    def __init__(self, device: str) -> None:
        self._buf = torch.zeros(3 * MAX_TOKENS, dtype=torch.int64, device=device)
        self.token_to_input_ids = self._buf[0:MAX_TOKENS]
        self.token_to_pos_ids = self._buf[MAX_TOKENS:2 * MAX_TOKENS]
        self.token_to_block_idx = self._buf[2 * MAX_TOKENS:3 * MAX_TOKENS]


class DynamicInferenceContext:
    def __init__(self, device: str, stream: ExecutionStream, variant: str) -> None:
        self.stream, self.variant = stream, variant
        self._cpu_bookkeeping_buf = host(torch.zeros(3 * MAX_TOKENS, dtype=torch.int64), device)   # pinned
        self.token_to_input_ids = self._cpu_bookkeeping_buf[0:MAX_TOKENS]
        self.token_to_pos_ids = self._cpu_bookkeeping_buf[MAX_TOKENS:2 * MAX_TOKENS]
        self.token_to_block_idx = self._cpu_bookkeeping_buf[2 * MAX_TOKENS:3 * MAX_TOKENS]
        self.gpu_view = ContextGPUView(device)

    def initialize_attention_state(self, input_ids, positions, block_idx) -> None:
        """Re-stage this step's bookkeeping into the pinned buffer, in place (CPU writes)."""
        self.token_to_input_ids[:] = torch.tensor(input_ids, dtype=torch.int64)
        self.token_to_pos_ids[:] = torch.tensor(positions, dtype=torch.int64)
        self.token_to_block_idx[:] = torch.tensor(block_idx, dtype=torch.int64)

    def transfer_bookkeeping_to_gpu(self) -> None:
        """Coalesced H2D of the whole bookkeeping buffer."""
        if self.variant == "bug":
            self.stream.copy_(self.gpu_view._buf, self._cpu_bookkeeping_buf, non_blocking=True)
        else:   # re-staged in place on the next step: an async copy races the host writes
            self.stream.copy_(self.gpu_view._buf, self._cpu_bookkeeping_buf, non_blocking=False)


class GPTModel:
    def __init__(self, device: str) -> None:
        gen = generator(5715)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(16, DIM, gen=gen, device=device, scale=0.5)
        self.kv_blocks = randn(NUM_BLOCKS, DIM, gen=gen, device=device)     # stands for the paged KV cache
        self.w_q, self.w_kv = randn(DIM, DIM, gen=gen, device=device), randn(DIM, DIM, gen=gen, device=device)

    def forward(self, input_ids, pos_ids, block_idx):
        h = self.embed[input_ids] + self.pos_embed[pos_ids]
        kv = self.kv_blocks[block_idx]                               # attention reads the token's KV block
        return torch.tanh(h @ self.w_q + kv @ self.w_kv)


def step_bookkeeping(step: int):
    """Decode step ``step``: one new token per request (ids drawn up front), its position and KV block."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (MAX_TOKENS,), generator=gen).tolist()
    pos = [p + step for p in PROMPT_LENS]
    blocks = [REQUEST_BLOCKS[r][p // BLOCK_SIZE] for r, p in enumerate(pos)]
    return ids, pos, blocks


def run(variant: str, device: str = "cpu"):
    model = GPTModel(device)

    def eager():
        outs = []
        for step in range(STEPS):
            ids, pos, blocks = (torch.tensor(x, dtype=torch.int64, device=device) for x in step_bookkeeping(step))
            outs.append(model.forward(ids, pos, blocks))
        return outs

    def served():
        stream = ExecutionStream()
        ctx = DynamicInferenceContext(device, stream, variant)
        v = ctx.gpu_view
        # capture: a dummy decode batch, transferred and drained before capture (torch.cuda.graph syncs)
        ctx.initialize_attention_state([0] * MAX_TOKENS, [0] * MAX_TOKENS, [0] * MAX_TOKENS)
        ctx.transfer_bookkeeping_to_gpu()
        stream.synchronize()
        g, out = capture(lambda: model.forward(v.token_to_input_ids, v.token_to_pos_ids, v.token_to_block_idx),
                         device=device, name=f"decode {MAX_TOKENS} tokens", owner="DynamicInferenceContext",
                         static={"gpu_view._buf": v._buf})
        results: list[torch.Tensor] = []
        previous = None
        for step in range(STEPS):                                     # steps back to back
            ctx.initialize_attention_state(*step_bookkeeping(step))
            ctx.transfer_bookkeeping_to_gpu()
            launched = stream.launch(lambda: results.append(replay(g, out).clone()))
            if previous is not None:
                stream.wait(previous)                  # the host only waits for the previous step's tokens
            previous = launched
        stream.synchronize()
        return results

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
