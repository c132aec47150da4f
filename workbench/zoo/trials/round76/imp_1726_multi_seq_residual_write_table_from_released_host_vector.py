"""The captured multi-sequence residual KV write copies its destination-pointer table from a host vector freed when the call returns: replays write K/V through whatever that memory later holds.

Upstream: https://github.com/kekzl/imp/pull/1726 ("fix(kv,graph): the multi-sequence residual KV write was not
graph-safe (#1708)", kekzl/imp, merged 2026-08-23; closes issue #1708, sev/s1).
Symptom: issue #1708: Qwen3-8B with ``--kv-nvfp4 --set kv_cache.bitdecoding_residual_tokens=64``. One request with
graphs on is fine. Six concurrent requests with graphs on give about 54k "an illegal memory access was encountered"
lines and every answer degenerates to ``Okay!!!!!!!!``. With ``runtime.cuda_graphs=never`` all six answers are
right. (The #1648 fix, a persistent ``residual_meta_d_buf_``, does not change this.)
Mechanism: ``GraphExecutor::write_kv_cache`` (src/exec/executor_kv_write.cu) appends each sequence's FP16 K/V to
its BitDecoding residual ring after the NVFP4 paged write. It runs once per layer inside the captured decode
graph. The multi-sequence branch (``else if (state.h_residual_seq_ids != nullptr)``) works out the destinations on
the host: ``std::vector<half*> k_ptrs(n), v_ptrs(n)`` get ``residual_k_ptr(seq_id, kv_layer) +
residual_state(seq_id).write_idx * slot_elems``. Then it ``cudaMallocAsync``s the scratch ``d_k_ptrs`` /
``d_v_ptrs``, ``cudaMemcpyAsync``s the vectors into them, launches ``residual_kv_write_multi_kernel``,
``cudaFreeAsync``s the scratch and calls the host ``advance_residual`` for each sequence. Under capture the memcpy
is a graph node that keeps the *host* address of the vector's data, and it reads that address again at every
replay. The vectors are locals, so their memory goes back to the heap when ``write_kv_cache`` returns. The next
layer's vectors of the same size get the same chunks during the capture, and so does later host code of that
size while serving. From the second replay on, the table the kernel gets is the bytes of whichever host object
now lives there, and every layer writes its K/V through those values. On a GPU that means wild addresses (the
illegal accesses); here it means the paged KV cache that attention reads. The PR names two more defects that
replays freeze. The ring index is baked into the pointers at capture. The host ring advance runs once, at capture
(the device advance is gated on ``state.kv_seq_id``, which only N == 1 sets). Neither changes what the user sees
before the fix, because the multi-sequence reader took the fill count from the device ring, which never advanced,
so it read no residual tokens. Eager is right: each call copies its own table while the vector is alive.
(The PR says the freed *device* scratch is what gets reused. In stream order each replay's memcpy node refills
that scratch before the kernel reads it, and the graph owns it as a block of its pool. The memory that is read
after release is the memcpy's host source.)
Doctor: dangling-reference, at write_kv_cache (the captured copy into the pointer scratch re-reads, at every
replay, host memory that ``write_kv_cache`` released when it returned; once another host allocation has been
handed that memory, the graph reads that allocation's data as its destination pointers).
Fix (upstream): the multi-sequence branch now tests ``state.d_residual_seq_slots`` and launches
``residual_kv_write_multi_indirect_kernel(src_k, src_v, k_layer_base, v_layer_base, seq_stride_elems,
state.d_residual_seq_slots, d_widx, slot_elems)``, which finds each sequence's slot and ring index on the device
(the engine's per-step slot upload and the manager's ``d_residual_widx``). There is no host table, no scratch and
no host ``advance_residual``. ``advance_residual_state_multi_kernel`` advances the ring once per step after the
layer loop, inside the graph.
Modelled: a 2-layer, single-KV-head decoder (q/k/v/o and an LM head, no norms, MLP or RoPE) over 3 concurrent
requests decoded together after an eager prefill. The GPU's address space is one float32 tensor (``vram``). It
holds the paged KV cache (one contiguous block per sequence; a plain FP16 store stands for NVFP4) and the residual
pool (``KVCacheManager``'s layout: per layer K then V, ``residual_max_seqs`` slots of ``residual_n_tokens`` rows). A
"pointer" is an int32 element offset into ``vram``. The host heap (glibc malloc: one LIFO free list per chunk
size) is ``HostHeap``, whose blocks are pinned host tensors. It holds the ``std::vector`` data of the pointer
tables, the decode batch builder's per-step vectors and the sampler's per-step ``result`` vector, all of the same
size here. So the sampler's vector after the first replay is what lands on the K table's chunk. On a GPU the
reuse is made explicit the same way, so it does not depend on the driver's or torch's allocators.
``cudaMemcpyAsync`` from pageable memory copies at call time when eager, and is a node that reads the host address
at launch when captured (torch itself refuses a pageable copy in a capture, so pinned blocks stand for the heap).
The TC attention's residual read is left out: before the fix, multi-sequence decode read a zero residual fill
count. The single-sequence path is left out too. The graph is captured at the first decode step and launched for
that step and every later one, as the engine's decode graph is.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kekzl/imp/pull/1726"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "write_kv_cache"
SYMPTOM = ("multi-sequence decode with graphs: the residual KV write's pointer table is read from a freed host "
           "vector, so K/V land on the paged KV cache (an illegal memory access on a GPU)")

VOCAB, HIDDEN = 16, 8
N_KV_HEADS, HEAD_DIM = 1, 8
SLOT_ELEMS = N_KV_HEADS * HEAD_DIM
N_LAYERS = 2
MAX_CTX = 12
RESIDUAL_N_TOKENS = 4          # kv_cache.bitdecoding_residual_tokens
RESIDUAL_MAX_SEQS = 4
PROMPTS = ((3, 7, 1, 12, 5), (9, 2, 14, 6, 11), (4, 13, 8, 0, 10))
SEQ_IDS = (101, 102, 103)
DECODE_STEPS = 4

PAGED_ELEMS = N_LAYERS * 2 * len(PROMPTS) * MAX_CTX * SLOT_ELEMS
RESIDUAL_PER_LAYER = RESIDUAL_MAX_SEQS * RESIDUAL_N_TOKENS * SLOT_ELEMS   # elements of K (or V) of one layer
VRAM_ELEMS = PAGED_ELEMS + N_LAYERS * 2 * RESIDUAL_PER_LAYER


# --- the host heap (glibc malloc for std::vector data) ------------------------------------------------------

class HostHeap:
    """Same-size chunks come back last-in first-out (tcache); a chunk's bytes stay as its last user left them."""

    def __init__(self, device):
        self.device, self.free_list = device, {}

    def allocate(self, n: int) -> torch.Tensor:
        chunks = self.free_list.get(n)
        return chunks.pop() if chunks else host(torch.zeros(n, dtype=torch.int32), self.device)

    def free(self, chunk: torch.Tensor) -> None:
        self.free_list.setdefault(chunk.numel(), []).append(chunk)


def cudaMemcpyAsync(dst: torch.Tensor, src_host: torch.Tensor) -> None:
    """H2D from pageable memory: eager, the bytes are taken before the call returns; captured, the memcpy node
    reads the host address when the graph runs."""
    dst.copy_(src_host, non_blocking=torch.cuda.is_current_stream_capturing())


# --- src/memory/kv_cache_manager.cpp -------------------------------------------------------------------------

class KVCacheManager:
    def __init__(self, device):
        self.residual_n_tokens_ = RESIDUAL_N_TOKENS
        self.seq_residual_state_: dict[int, list[int]] = {}         # host ring state: seq -> [write_idx, fill]
        self.residual_slot_: dict[int, int] = {}
        # graph-safe device ring state (PR #147): per residual slot
        self.d_residual_widx = torch.zeros(RESIDUAL_MAX_SEQS, dtype=torch.int32, device=device)
        self.d_residual_fc = torch.zeros(RESIDUAL_MAX_SEQS, dtype=torch.int32, device=device)

    def allocate_residual_slot(self, seq_id: int) -> int:
        return self.residual_slot_.setdefault(seq_id, len(self.residual_slot_))

    def residual_slot_of(self, seq_id: int) -> int:
        return self.residual_slot_.get(seq_id, -1)

    def residual_k_layer_base(self, layer: int) -> int:
        return PAGED_ELEMS + layer * 2 * RESIDUAL_PER_LAYER

    def residual_v_layer_base(self, layer: int) -> int:
        return self.residual_k_layer_base(layer) + RESIDUAL_PER_LAYER

    def residual_seq_stride_elems(self) -> int:
        return RESIDUAL_N_TOKENS * SLOT_ELEMS

    def residual_k_ptr(self, seq_id: int, layer: int) -> int:
        return self.residual_k_layer_base(layer) + self.residual_slot_of(seq_id) * self.residual_seq_stride_elems()

    def residual_v_ptr(self, seq_id: int, layer: int) -> int:
        return self.residual_v_layer_base(layer) + self.residual_slot_of(seq_id) * self.residual_seq_stride_elems()

    def residual_state(self, seq_id: int) -> tuple[int, int]:
        write_idx, fill_count = self.seq_residual_state_.get(seq_id, (0, 0))
        return write_idx, fill_count

    def advance_residual(self, seq_id: int) -> None:
        s = self.seq_residual_state_.setdefault(seq_id, [0, 0])
        s[0] = (s[0] + 1) % self.residual_n_tokens_
        s[1] = min(s[1] + 1, self.residual_n_tokens_)


# --- kernels (executor_kernels.h) -------------------------------------------------------------------------------

def residual_kv_write_multi_kernel(vram, src_k, src_v, d_k_ptrs, d_v_ptrs, slot_elems):
    """Row s of K/V goes to ``d_k_ptrs[s]`` / ``d_v_ptrs[s]`` (raw pointers)."""
    cols = torch.arange(slot_elems, device=vram.device)
    vram.index_put_(((d_k_ptrs.long()[:, None] + cols).flatten(),), src_k.flatten())
    vram.index_put_(((d_v_ptrs.long()[:, None] + cols).flatten(),), src_v.flatten())


def residual_kv_write_multi_indirect_kernel(vram, src_k, src_v, k_layer_base, v_layer_base, seq_stride_elems,
                                            d_seq_slots, d_residual_widx_ptr, slot_elems):
    """The fix: slot and ring index are read on the device when the kernel runs."""
    n = src_k.shape[0]
    slots = d_seq_slots[:n].long()
    offset = slots * seq_stride_elems + d_residual_widx_ptr[slots].long() * slot_elems
    cols = torch.arange(slot_elems, device=vram.device)
    vram.index_put_(((k_layer_base + offset[:, None] + cols).flatten(),), src_k.flatten())
    vram.index_put_(((v_layer_base + offset[:, None] + cols).flatten(),), src_v.flatten())


def advance_residual_state_kernel(d_widx, d_fc, slot, residual_n_tokens):
    d_widx[slot:slot + 1].add_(1).remainder_(residual_n_tokens)
    d_fc[slot:slot + 1].add_(1).clamp_(max=residual_n_tokens)


def advance_residual_state_multi_kernel(d_widx, d_fc, d_seq_slots, n_seqs, residual_n_tokens):
    slots = d_seq_slots[:n_seqs].long()
    d_widx.index_copy_(0, slots, (d_widx[slots] + 1).remainder(residual_n_tokens))
    d_fc.index_copy_(0, slots, (d_fc[slots] + 1).clamp(max=residual_n_tokens))


# --- the executor (src/exec/executor*.cu) ----------------------------------------------------------------------

class InferenceState:
    def __init__(self, **kw):
        self.is_prefill, self.kv_seq_id = False, -1
        self.h_residual_seq_ids = self.d_residual_seq_slots = None
        self.__dict__.update(kw)


class GraphExecutor:
    def __init__(self, device, variant, heap: HostHeap):
        gen = generator(1726)
        self.device, self.variant, self.heap = device, variant, heap
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq = [randn(HIDDEN, SLOT_ELEMS, gen=gen, device=device, scale=0.6) for _ in range(N_LAYERS)]
        self.wk = [randn(HIDDEN, SLOT_ELEMS, gen=gen, device=device, scale=0.6) for _ in range(N_LAYERS)]
        self.wv = [randn(HIDDEN, SLOT_ELEMS, gen=gen, device=device, scale=0.6) for _ in range(N_LAYERS)]
        self.wo = [randn(SLOT_ELEMS, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(N_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.vram = torch.zeros(VRAM_ELEMS, device=device)       # the paged KV cache and the residual pool
        n = len(PROMPTS)
        self.k_ = torch.zeros(n, SLOT_ELEMS, device=device)      # K/V workspaces (view_tokens)
        self.v_ = torch.zeros(n, SLOT_ELEMS, device=device)
        self.logits_ = torch.zeros(n, VOCAB, device=device)

    def paged(self, layer: int, which: int) -> torch.Tensor:
        """This layer's K (0) or V (1) paged cache, [seq, pos, slot_elems], a view of ``vram``."""
        per = len(PROMPTS) * MAX_CTX * SLOT_ELEMS
        start = (layer * 2 + which) * per
        return self.vram[start:start + per].view(len(PROMPTS), MAX_CTX, SLOT_ELEMS)

    def write_kv_cache(self, layer: int, state: InferenceState) -> None:
        n = state.n_tokens
        rows = torch.arange(n, device=self.device)
        self.paged(layer, 0).index_put_((rows, state.positions[:n].long()), self.k_[:n])   # the paged write
        self.paged(layer, 1).index_put_((rows, state.positions[:n].long()), self.v_[:n])

        # Phase 3c: BitDecoding residual write-through (decode only)
        kv_manager = state.kv_manager
        if state.is_prefill or n != state.n_sequences:
            return
        slot_elems = N_KV_HEADS * HEAD_DIM
        src_k_base, src_v_base = self.k_[:n], self.v_[:n]
        if self.variant == "bug" and state.h_residual_seq_ids is not None:
            # Multi-seq: build device pointer arrays per layer (host-side, ...
            # we fall back to per-call upload here for simplicity; n_sequences > 1 is rare so this is OK).
            k_ptrs, v_ptrs = self.heap.allocate(n), self.heap.allocate(n)     # std::vector<half*> k_ptrs(n), v_ptrs(n)
            for s in range(n):
                seq_id = state.h_residual_seq_ids[s]
                write_idx, _ = kv_manager.residual_state(seq_id)
                k_ptrs.numpy()[s] = kv_manager.residual_k_ptr(seq_id, layer) + write_idx * slot_elems
                v_ptrs.numpy()[s] = kv_manager.residual_v_ptr(seq_id, layer) + write_idx * slot_elems
            d_k_ptrs = torch.empty(n, dtype=torch.int32, device=self.device)    # cudaMallocAsync
            d_v_ptrs = torch.empty(n, dtype=torch.int32, device=self.device)
            cudaMemcpyAsync(d_k_ptrs, k_ptrs)
            cudaMemcpyAsync(d_v_ptrs, v_ptrs)
            residual_kv_write_multi_kernel(self.vram, src_k_base, src_v_base, d_k_ptrs, d_v_ptrs, slot_elems)
            del d_k_ptrs, d_v_ptrs                                               # cudaFreeAsync
            for s in range(n):
                kv_manager.advance_residual(state.h_residual_seq_ids[s])
            self.heap.free(v_ptrs)                                               # the vectors die at return
            self.heap.free(k_ptrs)
        elif self.variant == "fix" and state.d_residual_seq_slots is not None:
            # Multi-seq, graph-safe (#1708): everything the destination depends on is resolved on the device.
            residual_kv_write_multi_indirect_kernel(
                self.vram, src_k_base, src_v_base, kv_manager.residual_k_layer_base(layer),
                kv_manager.residual_v_layer_base(layer), kv_manager.residual_seq_stride_elems(),
                state.d_residual_seq_slots, kv_manager.d_residual_widx, slot_elems)

    def run_attention(self, layer: int, q: torch.Tensor, state: InferenceState) -> torch.Tensor:
        """paged_attention_decode_nvfp4_tc over the paged cache (no residual tokens: fill count 0 before #1726)."""
        n = state.n_tokens
        k_cache, v_cache = self.paged(layer, 0)[:n], self.paged(layer, 1)[:n]
        scores = (q[:, None, :] * k_cache).sum(-1) * SLOT_ELEMS ** -0.5                     # [n, MAX_CTX]
        past_end = torch.arange(MAX_CTX, device=self.device)[None, :] >= state.context_lens[:n, None]
        probs = torch.softmax(scores.masked_fill(past_end, float("-inf")), dim=-1)
        return (probs[:, :, None] * v_cache).sum(1)

    def forward_logits(self, state: InferenceState) -> torch.Tensor:
        n = state.n_tokens
        h = self.embed[state.token_ids[:n].long()]
        for layer in range(N_LAYERS):
            q = h @ self.wq[layer]
            self.k_[:n].copy_(h @ self.wk[layer])
            self.v_[:n].copy_(h @ self.wv[layer])
            self.write_kv_cache(layer, state)
            h = h + self.run_attention(layer, q, state) @ self.wo[layer]
        kv_manager = state.kv_manager
        if not state.is_prefill:
            # advance the residual ring state once per decode step, inside the captured graph
            if state.kv_seq_id >= 0:
                advance_residual_state_kernel(kv_manager.d_residual_widx, kv_manager.d_residual_fc,
                                              kv_manager.residual_slot_of(state.kv_seq_id), RESIDUAL_N_TOKENS)
            elif self.variant == "fix" and state.d_residual_seq_slots is not None:
                advance_residual_state_multi_kernel(kv_manager.d_residual_widx, kv_manager.d_residual_fc,
                                                    state.d_residual_seq_slots, n, RESIDUAL_N_TOKENS)
        self.logits_[:n].copy_(torch.tanh(h) @ self.lm_head)
        return self.logits_


# --- the engine (src/runtime/engine_scheduler.cpp) ---------------------------------------------------------------

class Engine:
    def __init__(self, device, variant, cuda_graphs: bool):
        self.device, self.cuda_graphs = device, cuda_graphs
        self.heap = HostHeap(device)
        self.kv_manager_ = KVCacheManager(device)
        self.executor_ = GraphExecutor(device, variant, self.heap)
        n = len(PROMPTS)
        # the decode batch pool and the persistent residual metadata buffer (#1648): fixed addresses
        self.d_token_ids = torch.zeros(n, dtype=torch.int32, device=device)
        self.d_positions = torch.zeros(n, dtype=torch.int32, device=device)
        self.d_context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.residual_meta_d_buf_ = torch.zeros(n, dtype=torch.int32, device=device)
        self.residual_meta_h_slots_ = self.heap.allocate(n)     # a member vector: resized, never freed
        self.graph = self.graph_out = None

    def upload_batch(self, tokens, positions):
        """decode_builder_.build() + upload_into_pool: std::vector<int> token_ids / positions / context_lens."""
        n = len(tokens)
        batch = [self.heap.allocate(n) for _ in range(3)]
        batch[0].numpy()[:] = tokens
        batch[1].numpy()[:] = positions
        batch[2].numpy()[:] = [p + 1 for p in positions]
        for dst, src in zip((self.d_token_ids, self.d_positions, self.d_context_lens), batch):
            cudaMemcpyAsync(dst, src)
        return batch

    def build_state(self, n, is_prefill):
        return InferenceState(token_ids=self.d_token_ids, positions=self.d_positions,
                              context_lens=self.d_context_lens, n_tokens=n, n_sequences=n,
                              is_prefill=is_prefill, kv_manager=self.kv_manager_)

    def prefill(self):
        """Eager, in lock-step (prompts of one length; the last prompt token is the first decode step's)."""
        n = len(PROMPTS)
        for pos in range(len(PROMPTS[0]) - 1):
            batch = self.upload_batch([p[pos] for p in PROMPTS], [pos] * n)
            self.executor_.forward_logits(self.build_state(n, True))
            for chunk in reversed(batch):
                self.heap.free(chunk)

    def step_decode_forward(self, tokens, position):
        n = len(tokens)
        batch = self.upload_batch(tokens, [position] * n)
        state = self.build_state(n, False)
        # residual metadata for a multi-seq step: slots into the persistent buffer, host seq ids
        for i, sid in enumerate(SEQ_IDS):
            self.kv_manager_.allocate_residual_slot(sid)
            self.residual_meta_h_slots_.numpy()[i] = self.kv_manager_.residual_slot_of(sid)
        cudaMemcpyAsync(self.residual_meta_d_buf_, self.residual_meta_h_slots_)
        state.d_residual_seq_slots = self.residual_meta_d_buf_
        state.h_residual_seq_ids = list(SEQ_IDS)
        if not self.cuda_graphs:
            logits = self.executor_.forward_logits(state).clone()
        else:
            if self.graph is None:        # captured at the first decode step of this batch size
                self.graph, self.graph_out = capture(
                    lambda: self.executor_.forward_logits(state), device=self.device, warmups=0,
                    name="decode n=3", owner="Engine decode graph",
                    static={"token_ids": self.d_token_ids, "positions": self.d_positions,
                            "context_lens": self.d_context_lens, "residual_seq_slots": self.residual_meta_d_buf_},
                    state={"kv_cache_and_residual_pool": self.executor_.vram,
                           "residual_widx": self.kv_manager_.d_residual_widx,
                           "residual_fc": self.kv_manager_.d_residual_fc})
            logits = replay(self.graph, self.graph_out).clone()
        # sample_per_request: std::vector<int32_t> result(n), one D2H gather
        result = self.heap.allocate(n)
        result.copy_(logits.argmax(dim=-1).to(torch.int32))
        next_tokens = result.tolist()
        self.heap.free(result)
        for chunk in reversed(batch):
            self.heap.free(chunk)
        return logits, next_tokens


def run(variant: str, device: str = "cpu"):
    def serve(cuda_graphs: bool):
        engine = Engine(device, variant, cuda_graphs)
        engine.prefill()
        tokens, outs = [p[-1] for p in PROMPTS], []
        for step in range(DECODE_STEPS):
            logits, tokens = engine.step_decode_forward(tokens, len(PROMPTS[0]) - 1 + step)
            outs.append(logits)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
