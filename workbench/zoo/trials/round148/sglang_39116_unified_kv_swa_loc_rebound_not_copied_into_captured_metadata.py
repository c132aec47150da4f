"""SGLang's DeepSeek-V4 HIP backend (unified-KV ring) builds target-verify attention metadata eagerly, outside the
CUDA graph, and hands it to the captured graph through ``replay_cuda_graph_metadata_from``: the first metadata (the
capture's) is kept, and every later one is ``copy_``-ed into it. ``UnifiedKvMetadata.copy_`` copied the index streams in
place but listed ``swa_loc`` (the per-token SWA-ring write target ``req_slot * ring + pos % ring``) under
``assign_fields``: it rebound the Python attribute to the new tensor. The captured KV store of every layer reads
``swa_loc`` by address, so replays kept writing this step's K into the ring slots computed for the capture's dummy
batch, and the rebinding dropped the last reference to that capture-time tensor, so the address the graph holds is
freed memory the allocator hands on. Attention (whose window indices were copied in place) then reads ring slots this
step never wrote. The fix moves ``swa_loc`` to ``copy_fields``: the live write target is copied into the buffer the
graph reads.

Upstream: https://github.com/sgl-project/sglang/pull/39116 ("[AMD] Fix Dspark accept length and reduce host bubble on
DSV4", sgl-project/sglang, author RolaoDenthu, description dated 2026-09-11, merged; merge commit not known to me).
Read: the PR description (item 1, "Refresh captured SWA write locations in place": "UnifiedKvMetadata.copy_ previously
rebound swa_loc through assign_fields. For metadata built outside the graph, this updates the Python reference but
leaves the buffer referenced by captured kernels unchanged. DSPARK's draft KV-store path consumes swa_loc, so
subsequent replays can write KV to stale ring locations. Move swa_loc to copy_fields"). The changed hunk, as two
versions of ``python/sglang/srt/layers/attention/deepseek_v4_backend_hip_radix.py``: before, in a mirror of
RolaoDenthu/sglang (branch main, 2026-06-22: ``UnifiedKvMetadata.copy_`` with ``assign_fields=["swa_loc"]`` and the
comment "swa_loc is recomputed each forward (recorded inside cuda graphs), so it is rebound rather than copied across
replays"; how it came to be: #27978 ("Cache unified_kv swa_loc once per step instead of per layer", merged as
36d61613a, with the field then on ``DSV4AttnMetadata`` as ``unified_swa_loc``) and its branch commit 89d86f9b2 ("fix:
move unified_swa_loc to assign_fields"); there also ``DSV4AttnMetadata.copy_``, ``DSV4Metadata.copy_``,
``init_forward_metadata_target_verify`` ("HIP path: build target-verify metadata eagerly even when
SGLANG_PREP_IN_CUDA_GRAPH is enabled"), ``init_forward_metadata_target_verify_old``,
``expand_extend_with_same_length``, ``init_forward_metadata_out_graph``, ``replay_cuda_graph_metadata_from``,
``get_unified_swa_loc`` and ``dsv4/metadata.py``'s ``copy_metadata``), and in two later stored copies of the file from
the search index (their repository is not shown; one has ``_attach_unified_kv_decode_streams(core, state_slot)`` given
``req_pool_indices_repeated`` for target-verify, computing ``swa_loc`` and ``verify_store_state_slot``); after, the
file stored for sgl-project/sglang at 003bbaf9 (``"swa_loc"`` now last in ``copy_fields`` under "Captured store_cache
reads swa_loc by address, and the eager target-verify path builds it outside the graph", ``assign_fields=[]``) and for
RolaoDenthu/sglang at 026da361 (the same). The readers of ``swa_loc``, from stored copies: ``models/deepseek_v4.py``
(``fused_qk_norm_rope_swa_store(..., swa_loc=attn_backend.get_unified_swa_loc(forward_batch))``) and the DSpark
drafter's ``_store_block_kv`` (``set_unified_key_buffer_radix_fused_norm_rope(swa_loc=...)``; a stored copy whose file
name the index does not show).
Not read: the PR's own diff page and its other two items (a Triton causal-expansion kernel and ``output_size`` for
``repeat_interleave``; building uniform DSpark verify metadata inside the graph), the DSpark drafter beyond
``_store_block_kv``, the Triton/asm unified-KV kernels (``build_decode_streams``, ``decode``,
``store_swa_into_unified``), SGLang's ``CudaGraphRunner`` for this backend (its capture/replay order is SGLang's usual
one, assumed), any test. No issue with user reports was found.
Symptom: DSpark speculative decoding of DeepSeek-V4 on AMD (HIP graphs through ``torch.cuda.CUDAGraph``): a low
acceptance length ("Fix accept length for dspark"); in the PR's words, replays "write KV to stale ring locations".
Mechanism: capture: ``init_forward_metadata_out_graph(in_capture=True)`` builds target-verify metadata for the dummy
batch (request slot 0) and stores it; the graph records each layer's ring store at that metadata's ``swa_loc`` (tensor
A). Replay: the runner writes its static inputs, builds the live metadata eagerly and ``copy_``-s it into the stored
one; ``UnifiedKvMetadata.copy_`` copies ``swa_indices``/``swa_indptr``/``verify_store_state_slot`` in place and
rebinds ``swa_loc`` to the new tensor. A's last reference goes with it; the graph keeps A's address.
Doctor: dangling-reference, at copy_. The graph reads, at every replay, a tensor its owner released: the rebinding in
``UnifiedKvMetadata.copy_`` (through ``copy_metadata``'s ``assign_fields``) is where the metadata stops holding the
capture-time ``swa_loc``, and that field list is what the fix changes. (Had something else kept A alive, the same
defect would read as a stale input; here nothing does.)
Fix (upstream): ``copy_fields=[..., "c128_out_loc", "swa_loc"]``, ``assign_fields=[]``.
Modelled: ``copy_metadata``, ``UnifiedKvMetadata`` (``copy_``), ``DSV4AttnMetadata`` (``copy_``), ``DSV4Metadata``
(``copy_``), ``DeepSeekV4TokenToKVPool`` (``get_unified_kv``, ``unified_swa_ring_size``, ``unified_swa_window``),
``DeepseekV4HipRadixBackend`` (``init_forward_metadata``, ``init_forward_metadata_target_verify``,
``init_forward_metadata_target_verify_old``, ``expand_extend_with_same_length``, ``make_core_attn_metadata``,
``_attach_unified_kv_decode_streams``, ``init_forward_metadata_out_graph``, ``replay_cuda_graph_metadata_from``,
``get_unified_swa_loc``, ``forward``), ``MQALayer``, ``ForwardBatch``, ``CudaGraphRunner`` (``capture``,
``replay_prepare``, ``replay``).
Stand-ins: one TARGET_VERIFY graph (bs 2, 3 tokens a request, no padding); request slot 0 is the capture's dummy and
live requests use slots 1..2; MQA with one shared K=V head per layer (DSV4 shares k and v); the ring store is an
``index_copy_`` at ``swa_loc`` (for the fused norm/RoPE store kernel); attention is a masked softmax over a fixed
[tokens, window] table of ring slots (for the ragged ``swa_indices``/``swa_indptr`` decode streams; ``swa_indptr`` is
kept and gives each row's length); no compressed (c4/c128) streams, indexer, attention sink, RoPE or fp8; the ring
holds window + draft tokens (upstream's "spec_extra room"). Prefill is eager in both runs and built with the same
stream builder over the prompt (upstream uses the ``pf_*`` prefill path). The drafter is a fixed token rule, not the
DSpark model: only the target's verify store, which the fix's comment names, is modelled. Graphs use
``on_freed="reuse"``: reading the released A returns the bytes it last held (the capture's dummy slots); on CUDA the
caching allocator may instead have handed the block to a later same-sized tensor (a later step's ``swa_loc``: one step
stale), wrong either way; with ``"raise"`` the first replay raises ``IllegalMemoryAccess`` instead. The metadata
classes keep only the fields modelled (upstream's ``copy_fields`` lists are longer); the capture's two warmups
(SGLang's ``run_once`` twice) are assumed.
Workload: 2 layers, width 16, vocab 32, window 4, ring 7; prompts of 5 and 6 tokens prefilled eagerly into slots 1 and
2; then 5 verify steps of 3 tokens a request (the last accepted token and two drafts), greedy acceptance. Outputs:
each step's logits and accepted counts, then the live slots' ring of every layer.
Measured: the check printed
  sglang_39116_unified_kv_swa_loc_rebound_not_copied_into_captured_metadata [bug] on cpu: misbehaves (max |graph -
    eager| = 5.21)
  sglang_39116_unified_kv_swa_loc_rebound_not_copied_into_captured_metadata [fix] on cpu: equals eager (max |graph -
    eager| = 0)
Both variants together take about 5 s on the CPU, imports included. With ``on_freed="raise"`` the bug raises
``IllegalMemoryAccess: graph replay read freed memory: aten.index_copy_.default ... in forward`` (the ring store) at
the first replay; the fix is unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import List, Optional

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/39116"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "copy_"
SYMPTOM = ("target-verify metadata built outside the graph was copy_-ed into the captured metadata with swa_loc "
           "rebound instead of copied, so replays stored each step's K at the capture's (released) ring locations and "
           "attention read slots never written")

DTYPE = torch.float64
VOCAB, HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 16, 2, 8, 2
WIN, NUM_DRAFT = 4, 3
RING = WIN + NUM_DRAFT                      # unified_swa_ring_size: window + spec_extra room
MAX_REQS = 3                                # slot 0: the capture's dummy; live requests use 1..2
BS, STEPS = 2, 5
PROMPTS = ([3, 17, 5, 9, 1], [8, 2, 20, 11, 4, 30])
_variant = "bug"


# --- dsv4/metadata.py ------------------------------------------------------------------------------------------------

def copy_metadata(*, src, dst, check_eq_fields: List[str], copy_fields: List[str],
                  assign_fields: Optional[List[str]] = None) -> None:
    assign_fields = assign_fields or []
    for name in check_eq_fields:
        assert getattr(src, name) == getattr(dst, name), name
    for name in copy_fields:
        src_val, dst_val = getattr(src, name), getattr(dst, name)
        if src_val is None and dst_val is None:
            continue
        assert dst_val is not None, name
        dst_val.copy_(src_val)              # tensors in place; nested metadata through its own copy_
    for name in assign_fields:
        setattr(dst, name, getattr(src, name))
    provided = check_eq_fields + copy_fields + assign_fields
    assert len(provided) == len(set(provided)) and set(provided) == {f.name for f in fields(src)}


@dataclass
class UnifiedKvMetadata:
    """unified-kv per-forward metadata"""
    swa_loc: Optional[torch.Tensor] = None                  # SWA ring write target (req_slot*ring + pos%ring)
    swa_indices: Optional[torch.Tensor] = None              # ragged decode index stream (here [tokens, WIN], -1 pad)
    swa_indptr: Optional[torch.Tensor] = None
    verify_store_state_slot: Optional[torch.Tensor] = None  # per-token req slot of target-verify

    def copy_(self, other: UnifiedKvMetadata) -> None:
        if _variant == "bug":
            copy_metadata(src=other, dst=self, check_eq_fields=[],
                          copy_fields=["swa_indices", "swa_indptr", "verify_store_state_slot"],
                          # swa_loc is recomputed each forward (recorded inside cuda graphs),
                          # so it is rebound rather than copied across replays.
                          assign_fields=["swa_loc"])
        else:
            copy_metadata(src=other, dst=self, check_eq_fields=[],
                          copy_fields=["swa_indices", "swa_indptr", "verify_store_state_slot",
                                       # Captured store_cache reads swa_loc by address, and the eager
                                       # target-verify path builds it outside the graph.
                                       "swa_loc"],
                          assign_fields=[])


@dataclass
class DSV4AttnMetadata:
    seq_lens_casual: torch.Tensor
    positions_casual: torch.Tensor
    swa_topk_lengths: torch.Tensor
    unified: Optional[UnifiedKvMetadata] = None

    def copy_(self, other: DSV4AttnMetadata) -> None:
        copy_metadata(src=other, dst=self, check_eq_fields=[],
                      copy_fields=["seq_lens_casual", "positions_casual", "swa_topk_lengths", "unified"])


@dataclass
class DSV4Metadata:
    core_attn_metadata: DSV4AttnMetadata

    def copy_(self, other: DSV4Metadata) -> None:
        self.core_attn_metadata.copy_(other.core_attn_metadata)


# --- pool, batch, backend --------------------------------------------------------------------------------------------

class DeepSeekV4TokenToKVPool:
    def __init__(self, device):
        self.unified_swa_window, self.unified_swa_ring_size = WIN, RING
        self.unified_kv = [torch.zeros(MAX_REQS * RING, HEAD_DIM, dtype=DTYPE, device=device) for _ in range(LAYERS)]

    def get_unified_kv(self, layer_id: int) -> torch.Tensor:
        return self.unified_kv[layer_id]


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: str                       # "target_verify" or "extend"
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor                  # committed KV length of each request
    seq_lens_cpu: torch.Tensor


class DeepseekV4HipRadixBackend:
    def __init__(self, pool: DeepSeekV4TokenToKVPool, device):
        self.token_to_kv_pool, self.device = pool, device
        self.speculative_num_draft_tokens = NUM_DRAFT
        self.forward_metadata: Optional[DSV4Metadata] = None
        self.cuda_graph_metadata_of_bs: dict = {}
        self.MAX_SEQ_LEN_FOR_CAPTURE = 64

    def expand_extend_with_same_length(self, bs, qo_len, seq_lens, req_pool_indices):
        seq_lens_casual = (seq_lens[:, None] + torch.arange(-qo_len + 1, 1, device=self.device)).flatten()
        req_pool_indices_repeated = req_pool_indices.repeat_interleave(qo_len)
        return seq_lens_casual, req_pool_indices_repeated

    def make_core_attn_metadata(self, seq_lens_casual: torch.Tensor) -> DSV4AttnMetadata:
        return DSV4AttnMetadata(seq_lens_casual=seq_lens_casual, positions_casual=seq_lens_casual - 1,
                                swa_topk_lengths=torch.clamp(seq_lens_casual, max=WIN))

    def _attach_unified_kv_decode_streams(self, core: DSV4AttnMetadata, state_slot: torch.Tensor) -> None:
        """Per-token window streams; target-verify passes the per-token (repeated) req slots."""
        pool = self.token_to_kv_pool
        ring = pool.unified_swa_ring_size
        n = core.positions_casual.shape[0]
        state_slot = state_slot[:n].to(torch.int64)
        pos = core.positions_casual.to(torch.int64)
        if core.unified is None:
            core.unified = UnifiedKvMetadata()
        window_pos = pos[:, None] - torch.arange(pool.unified_swa_window, device=self.device)[None, :]
        slots = state_slot[:, None] * ring + window_pos % ring
        core.unified.swa_indices = torch.where(window_pos >= 0, slots, torch.full_like(slots, -1))
        core.unified.swa_indptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=self.device),
                                             torch.cumsum(core.swa_topk_lengths.to(torch.int64), 0)])
        # SWA ring write target, same value for every layer this forward.
        core.unified.swa_loc = state_slot * ring + pos % ring
        core.unified.verify_store_state_slot = state_slot

    def init_forward_metadata_target_verify_old(self, req_pool_indices, seq_lens) -> DSV4Metadata:
        bs = len(seq_lens)
        seq_lens = seq_lens + self.speculative_num_draft_tokens
        seq_lens_casual, repeated = self.expand_extend_with_same_length(
            bs, self.speculative_num_draft_tokens, seq_lens, req_pool_indices)
        core = self.make_core_attn_metadata(seq_lens_casual)
        self._attach_unified_kv_decode_streams(core, repeated)
        return DSV4Metadata(core)

    def init_forward_metadata_target_verify(self, req_pool_indices, seq_lens) -> DSV4Metadata:
        # HIP path: build target-verify metadata eagerly even when SGLANG_PREP_IN_CUDA_GRAPH is enabled.
        return self.init_forward_metadata_target_verify_old(req_pool_indices, seq_lens)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode == "target_verify":
            metadata = self.init_forward_metadata_target_verify(forward_batch.req_pool_indices,
                                                                forward_batch.seq_lens)
        else:                               # (stand-in) eager prefill of one request: positions 0..L-1
            length = forward_batch.positions.shape[0]
            core = self.make_core_attn_metadata(torch.arange(1, length + 1, device=self.device))
            self._attach_unified_kv_decode_streams(core, forward_batch.req_pool_indices.repeat(length))
            metadata = DSV4Metadata(core)
        self.forward_metadata = metadata

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        bs = forward_batch.batch_size
        assert int(forward_batch.seq_lens_cpu[:bs].max()) + NUM_DRAFT <= self.MAX_SEQ_LEN_FOR_CAPTURE
        temp_metadata = self.init_forward_metadata_target_verify(forward_batch.req_pool_indices[:bs],
                                                                 forward_batch.seq_lens[:bs])
        self.replay_cuda_graph_metadata_from(bs=bs, temp_metadata=temp_metadata)

    def replay_cuda_graph_metadata_from(self, bs: int, temp_metadata: DSV4Metadata) -> None:
        if bs not in self.cuda_graph_metadata_of_bs:
            # First call (from capture): store the new metadata directly.
            self.cuda_graph_metadata_of_bs[bs] = temp_metadata
            self.forward_metadata = temp_metadata
            return
        chosen_metadata = self.cuda_graph_metadata_of_bs[bs]
        chosen_metadata.copy_(temp_metadata)
        self.forward_metadata = chosen_metadata

    def get_unified_swa_loc(self, forward_batch: ForwardBatch) -> torch.Tensor:
        positions = forward_batch.positions
        unified = self.forward_metadata.core_attn_metadata.unified
        cached = unified.swa_loc if unified is not None else None
        if cached is not None and cached.shape[0] == positions.shape[0]:
            return cached
        ring = self.token_to_kv_pool.unified_swa_ring_size
        req_slot = forward_batch.req_pool_indices.to(torch.int64)
        if req_slot.shape[0] != positions.shape[0]:
            req_slot = req_slot.repeat_interleave(positions.shape[0] // req_slot.shape[0])
        return req_slot * ring + positions.to(torch.int64) % ring

    def forward(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Target-verify runs through the unified-KV decode kernel over the per-token window streams."""
        unified = self.forward_metadata.core_attn_metadata.unified
        kv_cache = self.token_to_kv_pool.get_unified_kv(layer_id)
        idx = unified.swa_indices
        lengths = unified.swa_indptr[1:] - unified.swa_indptr[:-1]
        valid = torch.arange(WIN, device=self.device)[None, :] < lengths[:, None]
        kv = kv_cache[idx.clamp(min=0)]                                       # [T, WIN, HEAD_DIM]
        scores = torch.einsum("thd,twd->thw", q, kv) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        return torch.einsum("thw,twd->thd", torch.softmax(scores, -1), kv)


# --- model -----------------------------------------------------------------------------------------------------------

class MQALayer:
    def __init__(self, layer_id: int, gen, device):
        def w(*shape):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) / shape[0] ** 0.5).to(device)
        self.layer_id = layer_id
        self.wq, self.wkv, self.wo = w(HIDDEN, HEADS * HEAD_DIM), w(HIDDEN, HEAD_DIM), w(HEADS * HEAD_DIM, HIDDEN)
        self.w1, self.w2 = w(HIDDEN, 2 * HIDDEN), w(2 * HIDDEN, HIDDEN)

    def forward(self, h, forward_batch: ForwardBatch, attn_backend: DeepseekV4HipRadixBackend, pool):
        x = torch.nn.functional.rms_norm(h, (HIDDEN,))
        q = (x @ self.wq).view(-1, HEADS, HEAD_DIM)
        kv = x @ self.wkv
        # fused_qk_norm_rope_swa_store: swa_loc is layer-independent, computed once per forward by the backend
        swa_loc = attn_backend.get_unified_swa_loc(forward_batch)
        pool.get_unified_kv(self.layer_id).index_copy_(0, swa_loc, kv)
        h = h + attn_backend.forward(q, self.layer_id).reshape(-1, HEADS * HEAD_DIM) @ self.wo
        x = torch.nn.functional.rms_norm(h, (HIDDEN,))
        return h + torch.nn.functional.silu(x @ self.w1) @ self.w2


class DeepseekV4ForCausalLM:
    def __init__(self, device):
        gen = generator(0)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE).to(device)
        self.pos_embed = (0.5 * torch.randn(64, HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.layers = [MQALayer(i, gen, device) for i in range(LAYERS)]
        self.lm_head = (torch.randn(HIDDEN, VOCAB, generator=gen, dtype=DTYPE) / HIDDEN ** 0.5).to(device)

    def forward(self, forward_batch: ForwardBatch, attn_backend, pool) -> torch.Tensor:
        h = self.embed[forward_batch.input_ids] + self.pos_embed[forward_batch.positions]
        for layer in self.layers:
            h = layer.forward(h, forward_batch, attn_backend, pool)
        return torch.nn.functional.rms_norm(h, (HIDDEN,)) @ self.lm_head


# --- cuda graph runner -----------------------------------------------------------------------------------------------

class CudaGraphRunner:
    """One TARGET_VERIFY graph for BS requests x NUM_DRAFT tokens."""

    def __init__(self, model, attn_backend, pool, device):
        self.model, self.attn_backend, self.pool, self.device = model, attn_backend, pool, device
        n = BS * NUM_DRAFT
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.req_pool_indices = torch.zeros(BS, dtype=torch.long, device=device)     # dummy slot 0
        self.seq_lens = torch.ones(BS, dtype=torch.long, device=device)               # seq_len fill value 1
        self.static_batch = ForwardBatch("target_verify", BS, self.input_ids, self.positions,
                                         self.req_pool_indices, self.seq_lens, self.seq_lens.cpu())
        self.capture()

    def capture(self) -> None:
        self.attn_backend.init_forward_metadata_out_graph(self.static_batch, in_capture=True)

        def run_once():
            return self.model.forward(self.static_batch, self.attn_backend, self.pool)

        self.graph, self.output = capture(
            run_once, device=self.device, warmups=2, name="target_verify bs 2", on_freed="reuse",
            owner="SGLang CudaGraphRunner (target_verify)",
            static={"input_ids": self.input_ids, "positions": self.positions,
                    "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens},
            state={f"unified_kv[{i}]": kv for i, kv in enumerate(self.pool.unified_kv)})

    def replay_prepare(self, forward_batch: ForwardBatch) -> None:
        self.input_ids.copy_(forward_batch.input_ids)
        self.positions.copy_(forward_batch.positions)
        self.req_pool_indices.copy_(forward_batch.req_pool_indices)
        self.seq_lens.copy_(forward_batch.seq_lens)
        self.attn_backend.init_forward_metadata_out_graph(forward_batch)

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        self.replay_prepare(forward_batch)
        return replay(self.graph, self.output)


# --- engine ----------------------------------------------------------------------------------------------------------

def _long(xs, device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long).to(device)


def draft_tokens(last: int) -> list:
    """(stand-in drafter) two proposals after the last accepted token."""
    return [(last * 5 + 3) % VOCAB, (last * 7 + 1) % VOCAB]


def serve(device, use_cuda_graphs: bool) -> list:
    pool = DeepSeekV4TokenToKVPool(device)
    model = DeepseekV4ForCausalLM(device)
    backend = DeepseekV4HipRadixBackend(pool, device)
    runner = CudaGraphRunner(model, backend, pool, device) if use_cuda_graphs else None   # captured at startup
    outputs, slots, last, seq_lens = [], [1, 2], [], []
    for slot, prompt in zip(slots, PROMPTS):                 # eager prefill (extend) in both runs
        length = len(prompt)
        fb = ForwardBatch("extend", 1, _long(prompt, device), torch.arange(length, device=device),
                          _long([slot], device), _long([0], device), torch.tensor([0]))
        backend.init_forward_metadata(fb)
        logits = model.forward(fb, backend, pool)
        outputs.append(logits[-1:].clone())
        last.append(int(logits[-1].argmax()))
        seq_lens.append(length)
    for _ in range(STEPS):                                   # target-verify steps
        ids = [t for tok in last for t in [tok] + draft_tokens(tok)]
        positions = [s + j for s in seq_lens for j in range(NUM_DRAFT)]
        fb = ForwardBatch("target_verify", BS, _long(ids, device), _long(positions, device), _long(slots, device),
                          _long(seq_lens, device), torch.tensor(seq_lens))
        if runner is not None:
            logits = runner.replay(fb)
        else:
            backend.init_forward_metadata(fb)
            logits = model.forward(fb, backend, pool)
        outputs.append(logits.clone())
        greedy = logits.argmax(-1).view(BS, NUM_DRAFT).tolist()
        accepted = []
        for r in range(BS):
            drafts, n = ids[r * NUM_DRAFT + 1:(r + 1) * NUM_DRAFT], 0
            while n < NUM_DRAFT - 1 and greedy[r][n] == drafts[n]:
                n += 1
            accepted.append(n)
            last[r] = greedy[r][n]
            seq_lens[r] += n + 1
        outputs.append(_long(accepted, device))
    live = torch.tensor(slots)
    rows = (live[:, None] * RING + torch.arange(RING)[None, :]).flatten().to(device)
    return outputs + [kv[rows].clone() for kv in pool.unified_kv]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cuda_graphs=True), lambda: serve(device, use_cuda_graphs=False))
