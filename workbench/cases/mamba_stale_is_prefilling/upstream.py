"""vLLM's persistent input batch and Mamba metadata, reduced to what decides a FULL graph's state slots.

Mirrors, field for field where it matters, vLLM v0.20.2 (before #41873) and v0.22.0 (after):

* ``InputBatch`` (``vllm/v1/worker/gpu_input_batch.py``): ``add_request`` fills the smallest hole
  left by a removed request, else appends; ``remove_request`` only forgets the request id;
  ``condense()`` moves the last request into each hole and **does not clear the row it vacates**,
  so rows ``>= num_reqs`` keep the counters of their last occupant.
* ``reorder_batch_to_split_decodes_and_prefills`` (``vllm/v1/attention/backends/utils.py``):
  decode -> short_extend -> long_extend -> prefill order, by ``swap_states``.
* ``build_common_metadata``: ``GPUModelRunner._build_attention_metadata``. It computes
  ``is_prefilling = num_computed < num_prompt`` over **num_reqs_padded** rows. ``bug``: padded rows
  keep whatever the vacated rows say. ``fix`` (#41873): ``is_prefilling[num_reqs:] = False``.
* ``split_decodes_and_prefills``: upstream, plus the consumer-side guard proposed in #42947
  (``ignore_zero_query_rows``: ``is_prefilling`` may only mark rows that have query tokens).
* ``MambaMetadataBuilder`` (``vllm/v1/attention/backends/mamba_attn.py``): splits with
  ``treat_short_extends_as_decodes=False`` and refreshes its **persistent** ``state_indices_tensor_d``
  (the buffer a FULL decode graph captured) only when ``num_prefills == 0``.

A stale ``True`` in a padded row makes that row (and every padded row after it) a zero-length
"prefill"; the refresh is skipped; the FULL graph, dispatched before the metadata was built, replays
with last time's state slots.
"""
from __future__ import annotations

import bisect
import dataclasses

import numpy as np
import torch

from .. import VARIANTS
from .. import check_variant as _check_variant
from .mamba import NULL_BLOCK_ID

# 'bug': before vLLM #41873; 'fix': #41873 zeroes padded rows; 'guard': #42947's consumer-side guard.
VARIANTS_WITH_GUARD = (*VARIANTS, "guard")


def check_variant(variant: str) -> str:
    """``variant`` if it is one of ``VARIANTS_WITH_GUARD``, else a ``ValueError`` that lists them."""
    return _check_variant(variant, VARIANTS_WITH_GUARD)


@dataclasses.dataclass
class CachedRequestState:
    """What the runner keeps per request (upstream ``CachedRequestState``, one Mamba block)."""

    req_id: str
    prompt_token_ids: list[int]
    block_id: int                  # the request's state slot
    num_computed_tokens: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


class InputBatch:
    """The runner's persistent per-row request state (rows are reused; see module doc)."""

    def __init__(self, max_num_reqs: int, max_model_len: int) -> None:
        if max_num_reqs < 1 or max_model_len < 1:
            raise ValueError(f"max_num_reqs and max_model_len must be >= 1, got {max_num_reqs}, {max_model_len}")
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()
        self.block_table = np.full(max_num_reqs, NULL_BLOCK_ID, dtype=np.int32)
        self._removed: list[int] = []      # upstream BatchUpdateBuilder.removed (kept sorted)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        return [r for r in self._req_ids if r is not None]

    def add_request(self, request: CachedRequestState) -> int:
        """Place ``request`` in the smallest hole, else at the end; write all its counters."""
        if request.req_id in self.req_id_to_index:
            raise ValueError(f"request {request.req_id!r} is already in the batch")
        if request.num_tokens > self.max_model_len:
            raise ValueError(f"request {request.req_id!r} has {request.num_tokens} tokens > max_model_len "
                             f"{self.max_model_len}")
        req_index = self._removed.pop(0) if self._removed else self.num_reqs
        if req_index >= self.max_num_reqs:
            raise ValueError(f"batch is full ({self.max_num_reqs} requests)")
        if req_index == len(self._req_ids):
            self._req_ids.append(request.req_id)
        else:
            self._req_ids[req_index] = request.req_id
        self.req_id_to_index[request.req_id] = req_index
        tokens = request.prompt_token_ids + request.output_token_ids
        self.token_ids_cpu[req_index, :len(tokens)] = tokens
        self.num_tokens[req_index] = len(tokens)
        self.num_prompt_tokens[req_index] = request.num_prompt_tokens
        self.num_computed_tokens_cpu[req_index] = request.num_computed_tokens
        self.block_table[req_index] = request.block_id
        return req_index

    def remove_request(self, req_id: str) -> int | None:
        """Forget ``req_id``; its row keeps every counter (must be followed by ``condense()``)."""
        req_index = self.req_id_to_index.pop(req_id, None)
        if req_index is None:
            return None
        self._req_ids[req_index] = None
        bisect.insort(self._removed, req_index)
        return req_index

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange two rows completely (used by the decode-first reorder)."""
        id1, id2 = (self._req_ids[i] if 0 <= i < len(self._req_ids) else None for i in (i1, i2))
        if id1 is None or id2 is None:
            raise ValueError(f"swap_states needs two occupied rows, got {i1} ({id1}) and {i2} ({id2})")
        self._req_ids[i1], self._req_ids[i2] = id2, id1
        self.req_id_to_index[id1], self.req_id_to_index[id2] = i2, i1
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu, self.block_table):
            arr[[i1, i2]] = arr[[i2, i1]]
        self.token_ids_cpu[[i1, i2]] = self.token_ids_cpu[[i2, i1]]

    def condense(self) -> None:
        """Move the last requests down into the holes. The vacated rows are NOT cleared (upstream)."""
        empty = self._removed
        num_reqs = self.num_reqs
        if not empty:
            return
        if num_reqs == 0:
            self._req_ids.clear()
            empty.clear()
            return
        last_req_index = num_reqs + len(empty) - 1
        while empty:
            while last_req_index in empty:
                last_req_index -= 1
            empty_index = empty[0]
            if empty_index >= last_req_index:
                break
            empty.pop(0)
            req_id = self._req_ids[last_req_index]
            self._req_ids[empty_index], self._req_ids[last_req_index] = req_id, None
            self.req_id_to_index[req_id] = empty_index
            n = self.num_tokens[last_req_index]
            self.token_ids_cpu[empty_index, :n] = self.token_ids_cpu[last_req_index, :n]
            self.num_tokens[empty_index] = n
            self.num_prompt_tokens[empty_index] = self.num_prompt_tokens[last_req_index]
            self.num_computed_tokens_cpu[empty_index] = self.num_computed_tokens_cpu[last_req_index]
            self.block_table[empty_index] = self.block_table[last_req_index]     # block_table.move_row
            last_req_index -= 1
        del self._req_ids[num_reqs:]
        empty.clear()


def reorder_batch_to_split_decodes_and_prefills(input_batch: InputBatch, num_scheduled_tokens: dict[str, int],
                                                decode_threshold: int = 1) -> bool:
    """Upstream's reorder: decode -> short_extend -> long_extend -> prefill, by ``swap_states``."""
    num_reqs = input_batch.num_reqs
    scheduled = np.array([num_scheduled_tokens[r] for r in input_batch.req_ids])
    computed = input_batch.num_computed_tokens_cpu[:num_reqs]
    prompt = input_batch.num_prompt_tokens[:num_reqs]
    has_context = computed > 0
    below = scheduled <= decode_threshold
    done_prefilling = computed >= prompt
    regions = np.zeros(num_reqs, dtype=np.int32)
    regions[has_context & below & ~done_prefilling] = 1          # short extend
    regions[has_context & ~below] = 2                            # long extend
    regions[~has_context] = 3                                    # first prompt chunk
    target = np.sort(regions, kind="stable")
    needs_swap = regions != target
    if not needs_swap.any():
        return False
    orig = np.where(needs_swap)[0]
    src = orig[np.argsort(regions[needs_swap], kind="stable")]
    src_dest = {int(s): int(d) for s, d in zip(src, orig)}
    for s in src_dest:
        d = src_dest[s]
        while s != d:
            input_batch.swap_states(s, d)
            nxt = src_dest.get(d, d)
            src_dest[d] = d
            d = nxt
    return True


@dataclasses.dataclass
class CommonAttentionMetadata:
    """The fields of upstream ``CommonAttentionMetadata`` the Mamba builder reads (CPU copies)."""

    query_start_loc_cpu: torch.Tensor      # [num_reqs + 1] int32; padded rows have query length 0
    num_computed_tokens_cpu: torch.Tensor  # [num_reqs] int32
    num_reqs: int                          # num_reqs_padded under a FULL graph
    num_actual_tokens: int                 # num_tokens_padded under a FULL graph
    max_query_len: int
    block_table_tensor: torch.Tensor       # [num_reqs] int32 state slot per row; padded rows NULL
    is_prefilling: torch.Tensor | None     # [num_reqs] bool


def padded_is_prefilling(num_computed: torch.Tensor, num_prompt: torch.Tensor, num_reqs: int,
                         num_reqs_padded: int, variant: str) -> torch.Tensor:
    """``is_prefilling`` as ``_build_attention_metadata`` computes it over ``num_reqs_padded`` rows.

    ``bug``/``guard``: rows ``>= num_reqs`` say whatever their stale counters say. ``fix`` (#41873):
    they are zeroed.
    """
    check_variant(variant)
    if not 0 < num_reqs <= num_reqs_padded <= len(num_computed):
        raise ValueError(f"need 0 < num_reqs ({num_reqs}) <= num_reqs_padded ({num_reqs_padded}) <= rows "
                         f"({len(num_computed)})")
    is_prefilling = num_computed[:num_reqs_padded] < num_prompt[:num_reqs_padded]
    if variant == "fix":
        is_prefilling[num_reqs:] = False
    return is_prefilling


def build_common_metadata(input_batch: InputBatch, num_scheduled: np.ndarray, num_reqs_padded: int,
                          num_tokens_padded: int, variant: str) -> CommonAttentionMetadata:
    """``_build_attention_metadata``: real rows from the batch, padded rows neutralised except
    ``is_prefilling`` (``num_scheduled[row]`` are the real rows' query lengths)."""
    num_reqs = input_batch.num_reqs
    if len(num_scheduled) != num_reqs:
        raise ValueError(f"num_scheduled has {len(num_scheduled)} rows, the batch {num_reqs}")
    cu = np.cumsum(num_scheduled)
    qsl = np.zeros(num_reqs_padded + 1, dtype=np.int32)
    qsl[1:num_reqs + 1] = cu
    qsl[num_reqs + 1:] = cu[-1]                                   # padded rows: query length 0
    block_table = input_batch.block_table[:num_reqs_padded].copy()
    block_table[num_reqs:] = NULL_BLOCK_ID
    is_prefilling = padded_is_prefilling(input_batch.num_computed_tokens_cpu_tensor,
                                         torch.from_numpy(input_batch.num_prompt_tokens), num_reqs,
                                         num_reqs_padded, variant)
    return CommonAttentionMetadata(
        query_start_loc_cpu=torch.from_numpy(qsl),
        num_computed_tokens_cpu=input_batch.num_computed_tokens_cpu_tensor[:num_reqs_padded].clone(),
        num_reqs=num_reqs_padded, num_actual_tokens=num_tokens_padded,
        max_query_len=int(num_scheduled.max()), block_table_tensor=torch.from_numpy(block_table),
        is_prefilling=is_prefilling)


def split_decodes_and_prefills(cm: CommonAttentionMetadata, decode_threshold: int = 1,
                               require_uniform: bool = False, treat_short_extends_as_decodes: bool = True,
                               ignore_zero_query_rows: bool = False) -> tuple[int, int, int, int]:
    """Upstream v0.20.2, line for line; ``ignore_zero_query_rows`` is #42947's proposed guard.

    Returns ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``; the batch is
    expected in decode -> short_extend -> long_extend -> prefill order.
    """
    max_query_len, num_reqs, num_tokens = cm.max_query_len, cm.num_reqs, cm.num_actual_tokens
    query_start_loc = cm.query_start_loc_cpu
    if (max_query_len <= decode_threshold and (not require_uniform or decode_threshold <= 1)
            and treat_short_extends_as_decodes):
        return num_reqs, 0, num_tokens, 0
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if query_lens[0].item() > decode_threshold:
        return 0, num_reqs, 0, num_tokens
    if require_uniform:
        if torch.all((query_lens == query_lens[0]) | (query_lens == 0)):
            return num_reqs, 0, num_tokens, 0
        is_prefill = query_lens != query_lens[0]
    else:
        is_prefill = query_lens > decode_threshold
    if not treat_short_extends_as_decodes:
        assert cm.is_prefilling is not None
        prefilling = cm.is_prefilling & (query_lens > 0) if ignore_zero_query_rows else cm.is_prefilling
        is_prefill |= prefilling
    if not torch.any(is_prefill):
        return num_reqs, 0, num_tokens, 0
    first_prefill = is_prefill.int().argmax(dim=-1).item()
    num_decodes = first_prefill
    num_prefills = num_reqs - num_decodes
    num_decode_tokens = query_start_loc[first_prefill].item()
    num_prefill_tokens = num_tokens - num_decode_tokens
    return num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens


@dataclasses.dataclass
class MambaMetadata:
    """Upstream ``BaseMambaAttentionMetadata`` (the fields Mamba1 uses without prefix caching)."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_reqs: int
    has_initial_states_p: list[bool] | None
    query_start_loc_p: list[int] | None
    state_indices_tensor_p: list[int] | None
    state_indices_tensor_d: torch.Tensor         # the persistent buffer's view when refreshed
    refreshed: bool                              # whether the persistent buffer was written


class MambaMetadataBuilder:
    """Builds Mamba metadata; owns the persistent decode state-index buffer FULL graphs capture."""

    def __init__(self, decode_cudagraph_max_bs: int, device: str, *, full_cudagraphs: bool,
                 ignore_zero_query_rows: bool = False) -> None:
        self.decode_cudagraph_max_bs = decode_cudagraph_max_bs
        self.device = device
        self.full_cudagraphs = full_cudagraphs
        self.ignore_zero_query_rows = ignore_zero_query_rows
        self.state_indices_tensor_d = torch.empty(decode_cudagraph_max_bs, dtype=torch.int32, device=device)

    def build_for_cudagraph_capture(self, cm: CommonAttentionMetadata) -> MambaMetadata:
        if not (cm.max_query_len == 1 and cm.num_reqs <= self.decode_cudagraph_max_bs):
            raise ValueError("Mamba only supports decode-only FULL graph capture with num_reqs <= "
                             f"{self.decode_cudagraph_max_bs}")
        return self.build(cm)

    def build(self, cm: CommonAttentionMetadata) -> MambaMetadata:
        num_reqs = cm.num_reqs
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cm, decode_threshold=1, treat_short_extends_as_decodes=False,
            ignore_zero_query_rows=self.ignore_zero_query_rows)
        state_indices = cm.block_table_tensor
        has_initial_states_p = query_start_loc_p = state_indices_p = None
        if num_prefills > 0:
            qsl = cm.query_start_loc_cpu
            query_start_loc_p = (qsl[-num_prefills - 1:] - num_decode_tokens).tolist()
            has_initial_states_p = (cm.num_computed_tokens_cpu[num_reqs - num_prefills:num_reqs] > 0).tolist()
            state_indices_p = state_indices[num_decodes:].tolist()
        metadata = MambaMetadata(num_prefills, num_prefill_tokens, num_decodes, num_decode_tokens, num_reqs,
                                 has_initial_states_p, query_start_loc_p, state_indices_p,
                                 state_indices[:num_decodes].to(self.device), refreshed=False)
        return self._update_metadata_for_cudagraph_capture(metadata)

    def _update_metadata_for_cudagraph_capture(self, metadata: MambaMetadata) -> MambaMetadata:
        """Refresh the persistent buffer, **only for a pure-decode batch** (upstream condition)."""
        if (metadata.num_prefills == 0 and metadata.num_decodes <= self.decode_cudagraph_max_bs
                and self.full_cudagraphs):
            padded_bs = metadata.num_reqs
            self.state_indices_tensor_d[:metadata.num_decodes].copy_(metadata.state_indices_tensor_d)
            view = self.state_indices_tensor_d[:padded_bs]
            view[metadata.num_decodes:] = NULL_BLOCK_ID
            return dataclasses.replace(metadata, state_indices_tensor_d=view, refreshed=True)
        return metadata
