"""SGLang verifies EAGLE draft trees (``--speculative-eagle-topk`` > 1) in one TARGET_VERIFY forward per step, and
with CUDA graphs on it replays a graph captured per batch-size bucket. The worker builds the tree attention mask
(``custom_mask``: for every request, ``draft_token_num`` query rows over the committed prefix plus the draft tree)
for the live requests only. When the running batch is smaller than a captured bucket, ``CudaGraphRunner.replay_prepare``
pads the batch (padded requests get ``seq_len = 1``) and asks the FlashInfer backend to re-plan the captured wrapper
for the whole bucket: ``EagleVerifyInput.generate_attn_arg_prefill`` returns ``qo_indptr``/``kv_indptr`` for all
``bs`` rows, padded ones included, but hands back ``self.custom_mask`` still sized for the live rows. FlashInfer's plan
derives the mask offsets (``mask_indptr``) from the padded indptrs and packs ``custom_mask`` segment by segment, so it
reads past the end of the mask: an illegal memory access on the first padded verify step. Without graphs (no padding)
and on steps whose batch fills its bucket exactly, the sizes agree. The fix pads the mask with ``True`` up to the size
the padded indptrs describe.

Upstream: https://github.com/sgl-project/sglang/pull/13740 ("Fix IMA with flashinfer + spec + topk & Add radix attention
test cases for eagle", sgl-project/sglang, hnyls2002, description dated 2025-11-21, merged; listed in the release notes
as "IMA with flashinfer + spec + topk compatibility (#13740)"). Read: the PR description as stored in the search index
("The custom mask is generated inside the Eagle worker with ``build_tree_kernel_efficient``. But the ``mask_indptr`` was
generated inside flashinfer's ``begin_forward``, and the ``mask_indptr`` is calculated with padded ``qo_indptr`` and
padded ``kv_indptr`` when applying CUDA graph padding. The shape diff between ``custom_mask`` and ``mask_indptr`` will
cause flashinfer to access illegal memory. Note that the current fix is not perfect"). Not read: the PR's diff page. The
fixed code I read as it stands in several stored copies of ``python/sglang/srt/speculative/eagle_info.py``
(``EagleVerifyInput.generate_attn_arg_prefill``: ``mask_numel = paged_kernel_lens_sum * self.draft_token_num +
(self.draft_token_num**2) * batch_size``; if the mask is shorter, ``# FIXME(attn): temporary fix for custom mask padding
with cuda graph`` and ``torch.cat`` of ``True`` up to ``mask_numel``), and the unfixed function in older stored copies
(forks; the index does not name them) that return ``self.custom_mask`` as built. That this block is #13740's change is
my inference from the PR text ("the current fix is not perfect") and the FIXME's wording ("temporary fix ... with cuda
graph"); I did not see the commit. Also read: ``flashinfer_backend.py`` in two stored copies (one of sgl-project/sglang
at 0005834c, one unnamed of the same era as the fix): ``init_forward_metadata_capture_cuda_graph`` for TARGET_VERIFY (a
``BatchPrefillWithPagedKVCacheWrapper`` per bucket with ``use_cuda_graph=True``, ``qo_indptr_buf``,
``paged_kv_indptr_buf=self.kv_indptr[i][: bs + 1]``, ``paged_kv_indices_buf``,
``custom_mask_buf=self.cuda_graph_custom_mask``, ``mask_indptr_buf``), ``init_forward_metadata_replay_cuda_graph``
(``indices_updater_prefill.update(req_pool_indices[:bs], seq_lens[:bs], ...)``), ``get_cuda_graph_seq_len_fill_value``
(1), ``forward_extend`` and ``FlashInferIndicesUpdaterPrefill`` (``update_single_wrapper``, ``call_begin_forward`` with
its ``spec_info.generate_attn_arg_prefill`` branch); stored copies of the runner's ``populate_from_forward_batch`` (``if
bs != raw_bs: seq_lens.fill_(seq_len_fill_value); out_cache_loc.zero_()``); #1789's description (``seq_lens_sum`` counts
the padded requests); a report quoting the runner's all-ones capture mask, ``(max_bs * seq_len_fill_value +
max_num_token) * num_tokens_per_req``; and a port of FlashInfer's ``_compute_page_mask_indptr``. Not read: FlashInfer's
``plan``/``segment_packbits`` source (written from memory: mask offsets from the indptrs, segment-wise packing,
cuda-graph copies into the wrapper's buffers), the runner's ``replay_prepare`` of that time (written from the pieces
above and memory), the EAGLE worker, ``build_tree_kernel_efficient``, issue #14624 and the PR's tests. Later history,
not modelled: issue #32666 / PR #32691 (open when stored) report that this very padding double-counts the draft tokens.
Symptom: EAGLE with ``topk > 1`` on the FlashInfer backend with CUDA graphs: illegal memory access during
TARGET_VERIFY replay preparation once the running batch is smaller than its graph bucket (the PR: "The flashinfer IMA
bugs were reported in #14624"; here raised as that error by the mask-packing stand-in).
Mechanism: replay for 3 live requests picks bucket 4; the padded request gets ``seq_len = 1`` and ``seq_lens_sum`` grows
by 1. ``generate_attn_arg_prefill(bs=4)`` builds ``qo_indptr`` (4 x ``draft_token_num`` rows) and ``kv_indptr`` (prefix
+ draft per row, padded row included) and returns the worker's mask for 3 rows. The plan's ``mask_indptr`` sums
``q_len * kv_len`` over 4 rows, 20 elements more than the mask holds, and packing reads past it.
Doctor: padded-shape-mismatch, at ``generate_attn_arg_prefill``: run at the graph's padded size, it combines tensors
sized for the padded rows (``qo_indptr``, ``kv_indptr``, ``kv_indices`` over ``bs`` requests) with one sized for the
real rows (the live requests' ``custom_mask``) and hands both to the plan; it is the function the fix changes. Not
undersized-buffer: no static buffer is too small (the captured mask buffer holds a full bucket), and not stale-padding:
nothing a padded row holds reaches a real row.
Fix (upstream): pad ``self.custom_mask`` with ``True`` to ``paged_kernel_lens_sum * draft_token_num + draft_token_num**2
* batch_size`` elements before returning it.
Modelled: ``EagleVerifyInput`` (``generate_attn_arg_prefill``), ``build_tree_kernel_efficient``,
``create_flashinfer_kv_indices_triton``, FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (``plan``,
``begin_forward``, ``forward``), ``_compute_page_mask_indptr``, ``segment_packbits``, ``FlashInferAttnBackend``
(``init_cuda_graph_state``, ``init_forward_metadata``, ``init_forward_metadata_capture_cuda_graph``,
``init_forward_metadata_replay_cuda_graph``, ``get_cuda_graph_seq_len_fill_value``, ``forward_extend``),
``FlashInferIndicesUpdaterPrefill`` (``update_single_wrapper``, ``call_begin_forward``), ``CudaGraphRunner``
(``capture``, ``capture_one_batch_size``, ``get_spec_info``, ``replay_prepare``, ``replay``), ``ForwardBatch``,
``ModelRunner``.
Stand-ins: the "packed" mask keeps one element per bit (no bit packing), so ``segment_packbits`` returns the first
``mask_indptr[-1]`` elements; where the CUDA kernel reads past the mask it raises the illegal-memory-access error
instead. The prefill kernel is a masked softmax over a fixed ``MAX_CTX``-wide gather of each request's KV slots (custom
mask from the packed buffer, or causal for extend); page size 1; one wrapper (no sliding window). The model is mine: 2
layers of width 16, 2 heads of 8, position embeddings instead of RoPE, SiLU MLP, vocabulary 32, float64. The drafter
(``BigramDrafter``, for the EAGLE draft model) guesses from a token's embedding through the target's head and builds a
4-node tree (root, its top-2 children, the first child's top child: topk 2); acceptance is greedy along the tree; the
accepted path's KV slots are re-pointed in ``req_to_token`` (upstream moves the KV). Padded requests keep
``req_pool_indices`` as left (request slot 0, an empty dummy row) and write KV slot 0, as at the time. Prefill is eager,
one request at a time, in both runs.
Workload: graphs for buckets 2 and 4 (captured largest first, two warmups each, shared pool); requests A (6 tokens)
and B (5) prefilled; two verify steps of A+B (bucket 2, exact); C (4) prefilled; three verify steps of A+B+C (bucket 4,
one padded request). Accepted drafts per step: [0, 0], [2, 2], [0, 0, 1], [0, 0, 1], [0, 0, 1]. Outputs: each step's
verify logits and accepted lengths, then K and V of every live KV slot.
Measured: the check's two outcomes (``Outcome.summary()``; ``print`` shows them as dataclass reprs) were
  sglang_13740_eagle_tree_mask_sized_for_real_rows_under_padded_verify_graph [bug] on cpu: misbehaves (raised
      RuntimeError: CUDA error: an illegal memory access was encountered (segment_packbits read custom_mask[140:160],
      past its 140 elements))
  sglang_13740_eagle_tree_mask_sized_for_real_rows_under_padded_verify_graph [fix] on cpu: equals eager (max |graph -
      eager| = 0)
The bug raises at step 3, the first padded step (20 = 4 query rows x 5 KV entries of the padded request); with the
workload cut to steps 1 and 2 (exact bucket) both variants equal the run without graphs. As a check of the workload,
not part of the program: keeping the captured mask buffer from being refreshed after the first plan makes the fix
differ from the run without graphs (a row fully masked, max |graph - eager| = inf), so replays read the refreshed
mask. Both variants together take about 4 s on the CPU after imports (the whole check about 7 s).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import List, Optional

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/13740"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "generate_attn_arg_prefill"
SYMPTOM = ("EAGLE tree verify (topk > 1) on FlashInfer with CUDA graphs: when the running batch was padded to a "
           "graph bucket, generate_attn_arg_prefill returned indptrs for the padded rows with a tree mask sized for "
           "the live rows, and FlashInfer's plan read past the mask (illegal memory access)")

DTYPE = torch.float64
VOCAB, HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 32, 16, 2, 8, 32, 2
NUM_DRAFT = 4                     # speculative_num_draft_tokens: the tree's nodes, root included
PARENTS = (-1, 0, 0, 1)           # topk 2: nodes 1 and 2 are the root's children, node 3 is node 1's child
MAX_CTX = 32                      # model context length (req_to_token width)
MAX_REQS = 4                      # req_to_token rows; row 0 is an empty dummy row
NUM_SLOTS = 128                   # KV slots; slot 0 is the dummy slot padded tokens write into
CAPTURE_BS = (2, 4)
PROMPTS = {1: [3, 17, 5, 9, 1, 22], 2: [8, 2, 20, 11, 4], 3: [7, 30, 12, 19]}
STEPS = 5
_variant = "bug"


def _depths() -> List[int]:
    depth = []
    for p in PARENTS:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def _is_ancestor_or_self(a: int, q: int) -> bool:
    while q >= 0:
        if q == a:
            return True
        q = PARENTS[q]
    return False


# --- flashinfer (stand-ins) ------------------------------------------------------------------------------------------

def _compute_page_mask_indptr(qo_indptr, paged_kv_indptr, paged_kv_last_page_len, page_size):
    mask_indptr = torch.empty_like(qo_indptr)
    mask_indptr[0] = 0
    mask_indptr[1:] = torch.cumsum(
        (qo_indptr[1:] - qo_indptr[:-1])
        * ((paged_kv_indptr[1:] - paged_kv_indptr[:-1] - 1) * page_size + paged_kv_last_page_len),
        0,
    )
    return mask_indptr


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "little"):
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` (stand-in: one element per bit). The CUDA kernel reads the
    segments unchecked; reading past ``x`` is an illegal memory access, raised here as such."""
    total = int(indptr[-1])
    if total > x.numel():
        raise RuntimeError(f"CUDA error: an illegal memory access was encountered (segment_packbits read "
                           f"custom_mask[{x.numel()}:{total}], past its {x.numel()} elements)")
    return x.index_select(0, torch.arange(total, device=x.device)), indptr


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None):
        self._use_cuda_graph = use_cuda_graph
        self._fixed_batch_size = len(qo_indptr_buf) - 1 if use_cuda_graph else 0
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, custom_mask=None, non_blocking=True):
        batch_size = len(qo_indptr) - 1
        packed_custom_mask = mask_indptr = None
        if custom_mask is not None:
            mask_indptr = _compute_page_mask_indptr(qo_indptr, paged_kv_indptr, paged_kv_last_page_len, page_size)
            packed_custom_mask, mask_indptr = segment_packbits(custom_mask.contiguous().view(-1), mask_indptr)
        if self.is_cuda_graph_enabled:
            if batch_size != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                                 f"{batch_size} mismatches the batch size set during initialization "
                                 f"{self._fixed_batch_size}")
            if len(paged_kv_indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=non_blocking)
            self._paged_kv_indptr_buf.copy_(paged_kv_indptr, non_blocking=non_blocking)
            self._paged_kv_indices_buf[: len(paged_kv_indices)].copy_(paged_kv_indices, non_blocking=non_blocking)
            if packed_custom_mask is not None:
                self._custom_mask_buf[: len(packed_custom_mask)].copy_(packed_custom_mask, non_blocking=non_blocking)
                self._mask_indptr_buf.copy_(mask_indptr, non_blocking=non_blocking)
        else:
            self._qo_indptr_buf = qo_indptr
            self._paged_kv_indptr_buf = paged_kv_indptr
            self._paged_kv_indices_buf = paged_kv_indices
            self._custom_mask_buf = packed_custom_mask
            self._mask_indptr_buf = mask_indptr

    begin_forward = plan

    def forward(self, q: torch.Tensor, paged_kv_cache, causal: bool = True, sm_scale: float = 1.0) -> torch.Tensor:
        """(stand-in kernel) uniform query rows per request; each request's KV gathered through its indices."""
        k_cache, v_cache = paged_kv_cache
        qo, kvp, indices = self._qo_indptr_buf, self._paged_kv_indptr_buf, self._paged_kv_indices_buf
        bs = qo.shape[0] - 1
        n = q.shape[0] // bs
        kv_len = kvp[1:] - kvp[:-1]
        j = torch.arange(MAX_CTX, device=q.device)
        valid = j[None, :] < kv_len[:, None]
        slots = indices[(kvp[:-1, None] + j[None, :]).clamp(max=indices.shape[0] - 1)]
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        k, v = k_cache[slots], v_cache[slots]                                # [bs, J, H, D]
        qi = torch.arange(n, device=q.device)
        if self._custom_mask_buf is not None:
            pos = (self._mask_indptr_buf[:-1, None, None] + qi[None, :, None] * kv_len[:, None, None]
                   + j[None, None, :])
            allow = self._custom_mask_buf[pos.clamp(max=self._custom_mask_buf.shape[0] - 1)] != 0
        else:
            allow = j[None, None, :] <= (kv_len[:, None, None] - n + qi[None, :, None])
        allow = allow & valid[:, None, :]
        scores = torch.einsum("bqhd,bjhd->bhqj", q.view(bs, n, HEADS, HEAD_DIM), k) * sm_scale
        scores = scores.masked_fill(~allow[:, None], float("-inf"))
        out = torch.einsum("bhqj,bjhd->bqhd", torch.softmax(scores, -1), v)
        return out.reshape(bs * n, HEADS, HEAD_DIM).contiguous()


# --- speculative (EAGLE) -------------------------------------------------------------------------------------------

def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, page_kernel_lens, kv_indptr, kv_start_idx,
                                        kv_indices, req_to_token_stride):
    """(stand-in) one program per request copies its row of req_to_token into kv_indices."""
    for i in range(req_pool_indices.shape[0]):
        start, length = int(kv_indptr[i]), int(page_kernel_lens[i])
        off = 0 if kv_start_idx is None else int(kv_start_idx[i])
        kv_indices[start:start + length] = req_to_token[req_pool_indices[i], off:off + length]


def build_tree_kernel_efficient(seq_lens: List[int], device) -> torch.Tensor:
    """(stand-in) the tree mask of the live requests: each draft row sees the prefix and its ancestors."""
    rows = []
    for seq_len in seq_lens:
        for q in range(NUM_DRAFT):
            rows += [True] * seq_len + [_is_ancestor_or_self(a, q) for a in range(NUM_DRAFT)]
    return torch.tensor(rows, dtype=torch.bool, device=device)


@dataclasses.dataclass
class EagleVerifyInput:
    draft_token: Optional[torch.Tensor]
    custom_mask: torch.Tensor
    positions: Optional[torch.Tensor]
    draft_token_num: int

    def generate_attn_arg_prefill(self, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, req_to_token):
        device = req_pool_indices.device
        batch_size = len(req_pool_indices)
        qo_indptr = torch.arange(0, (1 + batch_size) * self.draft_token_num, step=self.draft_token_num,
                                 dtype=torch.int64, device=device)
        cum_kv_seq_len = torch.zeros((batch_size + 1,), dtype=torch.int64, device=device)

        paged_kernel_lens = paged_kernel_lens + self.draft_token_num
        cum_kv_seq_len[1:] = torch.cumsum(paged_kernel_lens, dim=0)

        kv_indices = torch.empty(paged_kernel_lens_sum + self.draft_token_num * batch_size, dtype=torch.int64,
                                 device=device)
        create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, paged_kernel_lens, cum_kv_seq_len, None,
                                            kv_indices, req_to_token.size(1))
        if _variant == "fix":
            mask_numel = paged_kernel_lens_sum * self.draft_token_num + (self.draft_token_num ** 2) * batch_size
            if self.custom_mask.numel() < mask_numel:
                # FIXME(attn): temporary fix for custom mask padding with cuda graph
                self.custom_mask = torch.cat(
                    [self.custom_mask,
                     torch.full((mask_numel - self.custom_mask.numel(),), True, dtype=torch.bool, device=device)],
                    dim=0,
                )
        return kv_indices, cum_kv_seq_len, qo_indptr, self.custom_mask


# --- forward batch, pools ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardBatch:
    forward_mode: str                       # "extend" or "target_verify"
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor                  # extend: length after the chunk; verify: committed prefix
    seq_lens_cpu: torch.Tensor
    seq_lens_sum: int
    out_cache_loc: torch.Tensor
    extend_prefix_lens: Optional[torch.Tensor] = None
    spec_info: Optional[EagleVerifyInput] = None
    token_to_kv_pool: object = None
    attn_backend: object = None


class ReqToTokenPool:
    def __init__(self, device):
        self.size = MAX_REQS
        self.req_to_token = torch.zeros((MAX_REQS, MAX_CTX), dtype=torch.int64, device=device)


class MHATokenToKVPool:
    def __init__(self, device):
        self.k_buffer = [torch.zeros(NUM_SLOTS, HEADS, HEAD_DIM, dtype=DTYPE, device=device) for _ in range(LAYERS)]
        self.v_buffer = [torch.zeros(NUM_SLOTS, HEADS, HEAD_DIM, dtype=DTYPE, device=device) for _ in range(LAYERS)]

    def get_kv_buffer(self, layer_id: int):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id].index_copy_(0, loc, k)
        self.v_buffer[layer_id].index_copy_(0, loc, v)


# --- attention backend ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PrefillMetadata:
    prefill_wrappers: List[BatchPrefillWithPagedKVCacheWrapper]
    use_ragged: bool
    extend_no_prefix: bool


class FlashInferIndicesUpdaterPrefill:
    def __init__(self, model_runner, attn_backend):
        self.kv_indptr = attn_backend.kv_indptr
        self.kv_last_page_len = attn_backend.kv_last_page_len
        self.qo_indptr = attn_backend.qo_indptr
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.update = self.update_single_wrapper

    def update_single_wrapper(self, req_pool_indices, seq_lens, seq_lens_cpu, seq_lens_sum, prefix_lens,
                              prefill_wrappers, use_ragged, encoder_lens, spec_info):
        paged_kernel_lens = seq_lens
        paged_kernel_lens_sum = seq_lens_sum
        self.call_begin_forward(None, prefill_wrappers[0], req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum,
                                seq_lens, prefix_lens, None, self.kv_indptr[0], self.qo_indptr[0], use_ragged,
                                spec_info)

    def call_begin_forward(self, wrapper_ragged, wrapper_paged, req_pool_indices, paged_kernel_lens,
                           paged_kernel_lens_sum, seq_lens, prefix_lens, kv_start_idx, kv_indptr, qo_indptr,
                           use_ragged, spec_info):
        bs = len(seq_lens)
        if spec_info is None:
            # Normal extend
            kv_indptr[1: bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)
            kv_indptr = kv_indptr[: bs + 1]
            kv_indices = torch.empty(paged_kernel_lens_sum + 256, dtype=torch.int64, device=req_pool_indices.device)
            create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr,
                                                kv_start_idx, kv_indices, self.req_to_token.shape[1])
            qo_indptr[1: bs + 1] = torch.cumsum(seq_lens - prefix_lens, dim=0)
            qo_indptr = qo_indptr[: bs + 1]
            custom_mask = None
        else:
            kv_indices, kv_indptr, qo_indptr, custom_mask = spec_info.generate_attn_arg_prefill(
                req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, self.req_to_token)

        # cached part
        wrapper_paged.begin_forward(qo_indptr, kv_indptr, kv_indices, self.kv_last_page_len[:bs], HEADS, HEADS,
                                    HEAD_DIM, 1, custom_mask=custom_mask, non_blocking=True)


class FlashInferAttnBackend:
    def __init__(self, model_runner):
        device = model_runner.device
        self.max_context_len = MAX_CTX
        self.workspace_buffer = None
        max_bs = model_runner.req_to_token_pool.size
        self.kv_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int64, device=device)]
        self.kv_last_page_len = torch.ones((max_bs,), dtype=torch.int64, device=device)
        self.qo_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int64, device=device)]
        self.prefill_wrappers_paged = [BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, "NHD")]
        self.prefill_wrappers_verify = [BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, "NHD")]
        self.indices_updater_prefill = FlashInferIndicesUpdaterPrefill(model_runner, self)
        self.forward_metadata: Optional[PrefillMetadata] = None
        self.prefill_cuda_graph_metadata = {}  # For verify

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode == "target_verify":
            self.indices_updater_prefill.update(
                forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.seq_lens_cpu,
                forward_batch.seq_lens_sum, prefix_lens=None, prefill_wrappers=self.prefill_wrappers_verify,
                use_ragged=False, encoder_lens=None, spec_info=forward_batch.spec_info)
            self.forward_metadata = PrefillMetadata(self.prefill_wrappers_verify, False, False)
        else:
            self.indices_updater_prefill.update(
                forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.seq_lens_cpu,
                forward_batch.seq_lens_sum, prefix_lens=forward_batch.extend_prefix_lens,
                prefill_wrappers=self.prefill_wrappers_paged, use_ragged=False, encoder_lens=None, spec_info=None)
            self.forward_metadata = PrefillMetadata(self.prefill_wrappers_paged, False, False)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        device = self.kv_indptr[0].device
        self.cuda_graph_kv_indices = [torch.zeros((max_num_tokens * self.max_context_len,), dtype=torch.int64,
                                                  device=device)]
        self.cuda_graph_custom_mask = torch.zeros((max_num_tokens * self.max_context_len,), dtype=torch.uint8,
                                                  device=device)
        self.cuda_graph_qk_indptr = [x.clone() for x in self.kv_indptr]
        self.cuda_graph_qo_indptr = [x.clone() for x in self.kv_indptr]

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info) -> None:
        assert forward_mode == "target_verify"
        prefill_wrappers = [BatchPrefillWithPagedKVCacheWrapper(
            self.workspace_buffer, "NHD", use_cuda_graph=True,
            qo_indptr_buf=self.cuda_graph_qo_indptr[0][: bs + 1],
            paged_kv_indptr_buf=self.kv_indptr[0][: bs + 1],
            paged_kv_indices_buf=self.cuda_graph_kv_indices[0],
            paged_kv_last_page_len_buf=self.kv_last_page_len[:bs],
            custom_mask_buf=self.cuda_graph_custom_mask,
            mask_indptr_buf=self.cuda_graph_qk_indptr[0][: bs + 1],
        )]
        seq_lens_sum = seq_lens.sum().item()
        self.indices_updater_prefill.update(req_pool_indices, seq_lens, seq_lens.cpu(), seq_lens_sum, prefix_lens=None,
                                            prefill_wrappers=prefill_wrappers, use_ragged=False,
                                            encoder_lens=encoder_lens, spec_info=spec_info)
        self.prefill_cuda_graph_metadata[bs] = prefill_wrappers
        self.forward_metadata = PrefillMetadata(prefill_wrappers, False, False)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu) -> None:
        assert forward_mode == "target_verify"
        self.indices_updater_prefill.update(
            req_pool_indices[:bs], seq_lens[:bs], seq_lens_cpu[:bs] if seq_lens_cpu is not None else None,
            seq_lens_sum, prefix_lens=None, prefill_wrappers=self.prefill_cuda_graph_metadata[bs], use_ragged=False,
            encoder_lens=None, spec_info=spec_info)
        self.forward_metadata = PrefillMetadata(self.prefill_cuda_graph_metadata[bs], False, False)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch) -> torch.Tensor:
        prefill_wrapper_paged = self.forward_metadata.prefill_wrappers[0]
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        o = prefill_wrapper_paged.forward(q, forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id),
                                          causal=True, sm_scale=HEAD_DIM ** -0.5)
        return o.view(-1, HEADS * HEAD_DIM)


# --- model ---------------------------------------------------------------------------------------------------------

class DecoderLayer:
    def __init__(self, layer_id: int, gen, device):
        def w(*shape):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) / shape[0] ** 0.5).to(device)
        self.layer_id = layer_id
        self.wq, self.wk = w(HIDDEN, HEADS * HEAD_DIM), w(HIDDEN, HEADS * HEAD_DIM)
        self.wv = w(HIDDEN, HEADS * HEAD_DIM)
        self.wo, self.w1, self.w2 = w(HEADS * HEAD_DIM, HIDDEN), w(HIDDEN, FFN), w(FFN, HIDDEN)

    def forward(self, h: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        x = torch.nn.functional.rms_norm(h, (HIDDEN,))
        q = (x @ self.wq).view(-1, HEADS, HEAD_DIM)
        k = (x @ self.wk).view(-1, HEADS, HEAD_DIM)
        v = (x @ self.wv).view(-1, HEADS, HEAD_DIM)
        h = h + forward_batch.attn_backend.forward_extend(q, k, v, self, forward_batch) @ self.wo
        x = torch.nn.functional.rms_norm(h, (HIDDEN,))
        return h + torch.nn.functional.silu(x @ self.w1) @ self.w2


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(0)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE).to(device)
        self.pos_embed = (0.5 * torch.randn(MAX_CTX, HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.layers = [DecoderLayer(i, gen, device) for i in range(LAYERS)]
        self.lm_head = (torch.randn(HIDDEN, VOCAB, generator=gen, dtype=DTYPE) / HIDDEN ** 0.5).to(device)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[input_ids] + self.pos_embed[positions]
        for layer in self.layers:
            h = layer.forward(h, forward_batch)
        return torch.nn.functional.rms_norm(h, (HIDDEN,)) @ self.lm_head


# --- cuda graph runner ---------------------------------------------------------------------------------------------

class CudaGraphRunner:
    """TARGET_VERIFY graphs, one per batch-size bucket."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.capture_bs = list(CAPTURE_BS)
        self.max_bs = max(self.capture_bs)
        self.capture_forward_mode = "target_verify"
        self.num_tokens_per_bs = NUM_DRAFT
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.seq_len_fill_value = model_runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        model_runner.attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        with torch.device(self.device):
            self.input_ids = torch.zeros((self.max_num_token,), dtype=torch.int64)
            self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int64)
            self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64)
            self.out_cache_loc = torch.zeros((self.max_num_token,), dtype=torch.int64)
            self.positions = torch.zeros((self.max_num_token,), dtype=torch.int64)
            self.custom_mask = torch.ones(
                ((self.max_bs * self.seq_len_fill_value + self.max_num_token) * self.num_tokens_per_bs),
                dtype=torch.bool)
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64)
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(self.device)
        self.capture()

    def get_spec_info(self, num_tokens: int) -> EagleVerifyInput:
        return EagleVerifyInput(draft_token=None, custom_mask=self.custom_mask, positions=None,
                                draft_token_num=self.num_tokens_per_bs)

    def capture(self) -> None:
        # Reverse the order to enable better memory sharing across cuda graphs.
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs: int):
        num_tokens = bs * self.num_tokens_per_bs
        runner, backend = self.model_runner, self.model_runner.attn_backend
        forward_batch = ForwardBatch(
            forward_mode=self.capture_forward_mode, batch_size=bs, input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], seq_lens_cpu=self.seq_lens_cpu[:bs],
            seq_lens_sum=int(self.seq_lens[:bs].sum().item()), out_cache_loc=self.out_cache_loc[:num_tokens],
            spec_info=self.get_spec_info(num_tokens), token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=backend)
        backend.init_forward_metadata_capture_cuda_graph(bs, num_tokens, forward_batch.req_pool_indices,
                                                         forward_batch.seq_lens, None, forward_batch.forward_mode,
                                                         forward_batch.spec_info)

        def run_once():
            return runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

        pool = runner.token_to_kv_pool
        return capture(
            run_once, device=self.device, pool=self.pool, warmups=2, name=f"target_verify bs {bs}",
            owner="SGLang CudaGraphRunner (target_verify)",
            static={"input_ids": self.input_ids, "req_pool_indices": self.req_pool_indices,
                    "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc, "positions": self.positions,
                    "cuda_graph_qo_indptr": backend.cuda_graph_qo_indptr[0], "kv_indptr": backend.kv_indptr[0],
                    "cuda_graph_kv_indices": backend.cuda_graph_kv_indices[0],
                    "cuda_graph_custom_mask": backend.cuda_graph_custom_mask,
                    "cuda_graph_qk_indptr": backend.cuda_graph_qk_indptr[0]},
            state={**{f"k_buffer[{i}]": t for i, t in enumerate(pool.k_buffer)},
                   **{f"v_buffer[{i}]": t for i, t in enumerate(pool.v_buffer)}})

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.batch_size <= self.max_bs

    def replay_prepare(self, forward_batch: ForwardBatch) -> None:
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        bs = self.capture_bs[index]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
        self.input_ids[:raw_num_token].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_num_token].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        if bs != raw_bs:
            self.seq_lens_cpu.fill_(self.seq_len_fill_value)
        self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices, self.seq_lens,
            forward_batch.seq_lens_sum + (bs - raw_bs) * self.seq_len_fill_value, None, self.capture_forward_mode,
            forward_batch.spec_info, seq_lens_cpu=self.seq_lens_cpu)
        self.raw_bs, self.raw_num_token, self.bs = raw_bs, raw_num_token, bs

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        self.replay_prepare(forward_batch)
        num_tokens = self.bs * self.num_tokens_per_bs
        out = replay(self.graphs[self.bs], self.output_buffers[self.bs], real=self.raw_num_token, size=num_tokens,
                     padded={"input_ids": self.input_ids[:num_tokens], "positions": self.positions[:num_tokens]})
        return out[: self.raw_num_token]


# --- model runner and engine ---------------------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, use_cuda_graph: bool):
        self.device = device
        self.req_to_token_pool = ReqToTokenPool(device)
        self.token_to_kv_pool = MHATokenToKVPool(device)
        self.model = LlamaForCausalLM(device)
        self.attn_backend = FlashInferAttnBackend(self)
        self.cuda_graph_runner = CudaGraphRunner(self) if use_cuda_graph else None

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        forward_batch.token_to_kv_pool, forward_batch.attn_backend = self.token_to_kv_pool, self.attn_backend
        runner = self.cuda_graph_runner
        if forward_batch.forward_mode == "target_verify" and runner is not None and runner.can_run(forward_batch):
            return runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


class BigramDrafter:
    """(stand-in draft model) next-token guesses from a token's embedding alone, through the target's head."""

    def __init__(self, model: LlamaForCausalLM):
        logits = torch.nn.functional.rms_norm(model.embed, (HIDDEN,)) @ model.lm_head
        self.topk = logits.topk(2, dim=-1).indices.tolist()

    def draft_tree(self, root: int) -> List[int]:
        """root, its two top-k children, the first child's top child (PARENTS order)."""
        c1, c2 = self.topk[root]
        return [root, c1, c2, self.topk[c1][0]]


def serve(device, use_cuda_graph: bool) -> list:
    model_runner = ModelRunner(device, use_cuda_graph)
    req_to_token = model_runner.req_to_token_pool.req_to_token
    depth = _depths()
    drafter = BigramDrafter(model_runner.model)
    next_slot, seq_lens, verified, outputs = 1, {}, {}, []

    def t(xs):
        return torch.tensor(xs, dtype=torch.int64).to(device)

    def prefill(r: int) -> None:
        nonlocal next_slot
        prompt = PROMPTS[r]
        n = len(prompt)
        slots = list(range(next_slot, next_slot + n))
        next_slot += n
        req_to_token[r, :n] = t(slots)
        fb = ForwardBatch("extend", 1, t(prompt), torch.arange(n, device=device), t([r]), t([n]), torch.tensor([n]),
                          n, t(slots), extend_prefix_lens=t([0]))
        logits = model_runner.forward(fb)
        verified[r], seq_lens[r] = int(logits[-1].argmax()), n

    prefill(1)
    prefill(2)
    for step in range(STEPS):
        if step == 2:
            prefill(3)
        active = [1, 2] if step < 2 else [1, 2, 3]
        ids, pos, locs, draft_slots = [], [], [], {}
        for r in active:
            draft_slots[r] = list(range(next_slot, next_slot + NUM_DRAFT))
            next_slot += NUM_DRAFT
            req_to_token[r, seq_lens[r]:seq_lens[r] + NUM_DRAFT] = t(draft_slots[r])
            ids += drafter.draft_tree(verified[r])
            pos += [seq_lens[r] + d for d in depth]
            locs += draft_slots[r]
        prefix = [seq_lens[r] for r in active]
        spec_info = EagleVerifyInput(draft_token=t(ids), custom_mask=build_tree_kernel_efficient(prefix, device),
                                     positions=t(pos), draft_token_num=NUM_DRAFT)
        fb = ForwardBatch("target_verify", len(active), t(ids), t(pos), t(active), t(prefix), torch.tensor(prefix),
                          sum(prefix), t(locs), spec_info=spec_info)
        logits = model_runner.forward(fb).clone()
        outputs.append(logits)
        greedy = logits.argmax(-1).view(len(active), NUM_DRAFT).tolist()
        accepted = []
        for i, r in enumerate(active):
            tokens, path = ids[i * NUM_DRAFT:(i + 1) * NUM_DRAFT], [0]
            while True:
                nxt = [c for c in range(NUM_DRAFT) if PARENTS[c] == path[-1] and tokens[c] == greedy[i][path[-1]]]
                if not nxt:
                    break
                path.append(nxt[0])
            req_to_token[r, seq_lens[r]:seq_lens[r] + len(path)] = t([draft_slots[r][c] for c in path])
            seq_lens[r] += len(path)
            verified[r] = greedy[i][path[-1]]
            accepted.append(len(path) - 1)
        outputs.append(t(accepted))
    live = torch.arange(1, next_slot, device=device)
    pool = model_runner.token_to_kv_pool
    return outputs + [b[live].clone() for b in pool.k_buffer + pool.v_buffer]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cuda_graph=True), lambda: serve(device, use_cuda_graph=False))
