"""With prefill context parallelism, the PIECEWISE graphs are captured on the runner's global input buffers while each rank writes its own tokens and positions into the PCP manager's buffers: replays run every rank on the global batch's first tokens.

Upstream: https://github.com/vllm-project/vllm/pull/53515 ("BugFix(PCP): use persistent input buffers for PIECEWISE
CUDA graphs", vllm-project/vllm, opened 2026-08-24 by pisceskkk, merged late August 2026; the unmerged draft
https://github.com/vllm-project/vllm/pull/53639 proposes another way to do the same).
Symptom: the PR describes its fix, not a user report. What follows is our reading of the pre-fix code. With the
model runner V2 (MRV2), prefill context parallelism (``prefill_context_parallel_size`` > 1, MLA models) and
``cudagraph_mode=PIECEWISE``, outputs are wrong, and nothing raises. A rank whose share of the batch
differs from the start of the global batch embeds the wrong tokens at the wrong positions, so every prefill and
mixed step gets wrong hidden states and logits. Decode-only steps are right: decode tokens are replicated on every
rank, in global order. Eager mode (``cudagraph_mode=NONE``) is right. vLLM's ``CUDAGraphWrapper`` checks replay
input addresses only in debug logging mode, so a normal run gives no warning.
Mechanism: MRV2 ``GPUModelRunner.prepare_inputs`` (``vllm/v1/worker/gpu/model_runner.py``) stages the global
scheduled batch in the runner's ``self.input_buffers``. ``maybe_partition_pcp_batch`` then calls
``PCPManager.partition_batch`` (``vllm/v1/worker/gpu/pcp_manager.py``), which builds this rank's DualChunkSwap rows
(``_build_batch_layout``: each prefill is cut into ``2 * pcp_world_size`` chunks, and rank r takes chunks r and
2P-1-r; decodes are replicated; pure prefills are moved last). It gathers the rank's tokens with
``torch.index_select(global_batch.input_ids, 0, local_gather_idx, out=input_buffers.input_ids[:num_local_tokens_padded])``
into the manager's own persistent ``InputBuffers``. It fills positions with ``prepare_pos_seq_lens`` and
``is_padding`` in those buffers too, and returns an ``InputBatch`` whose ``input_ids`` and ``positions`` are views
of the PCP buffers. ``GPUModelRunner.capture_model``, however, passed ``self.input_buffers`` to
``cudagraph_manager.capture``, and PIECEWISE capture runs the compiled model on
``input_buffers.input_ids[:num_tokens]`` and ``input_buffers.positions[:num_tokens]``. Each piece's
``CUDAGraphWrapper`` records its inputs' addresses. At replay it does not copy inputs: it replays the captured
graph, so the embedding and the rotary embedding read the runner's global buffers, which hold the global batch's
first ``num_tokens`` tokens and positions, not this rank's. An eager forward reads the tensors it is given, the
PCP-local views, so it is right.
Doctor: warmup-divergence, at capture_model. Capture decided which tensors the graphs read: the runner's global
``input_buffers``. Replays reuse those tensor references, while every eager step hands the model the PCP manager's
buffers. ``capture_model`` chose the buffers, and it is the line the fix changed. (The first piece's static inputs
are written each step, but with the global batch, so this is not an input the step forgot to write.)
Fix (upstream): ``capture_model`` now does ``input_buffers = self.input_buffers`` and
``if self.pcp_manager is not None: input_buffers = self.pcp_manager.input_buffers`` (a new property), and passes
those to ``cudagraph_manager.capture``, so capture and partitioning share the persistent ``input_ids``,
``positions`` and ``is_padding``. The PR also dispatches graphs by the largest rank-local batch:
``PCPManager.get_num_tokens_for_dispatch()``, built on a shared ``_iter_rank_chunks()``, gives the dispatch size.
It passes the chosen ``BatchExecutionDescriptor.num_tokens`` to ``partition_batch`` as ``padded_num_tokens``, and
``_build_batch_layout`` raises ``ValueError`` when that size is smaller than the largest rank-local batch. (Read: the PR
description; the pre-fix ``pcp_manager.py``, ``model_runner.py`` and ``cudagraph_utils.py`` at stored commits; the
fixed ``capture_model`` lines and ``maybe_partition_pcp_batch(..., padded_num_tokens=batch_desc.num_tokens)`` in a
later runner; the PR's tests in ``tests/v1/worker/gpu/test_pcp_manager.py``. The global staging width
``max(num_tokens, batch_desc.num_tokens)`` comes from a downstream runner built on the fix, not from the diff.)
Modelled: PCP=2, both ranks simulated one after the other in one process. Each rank has its own runner, PCP
manager, graphs and graph pool, and the weights are shared. Capture sizes are 1, 2, 4, 8 and 16, all PIECEWISE.
The compiled model is one piece: MLA attention, the splitting op that runs eagerly between pieces, is left out,
because the layers here work token by token. Each layer applies RoPE to a projection of its token, so
``positions`` matters. The PCP group's ``all_gather`` (used by ``restore_hidden_states``) is a stand-in that
concatenates the ranks' outputs, as the PR's test ``FakePCPGroup`` does. Sampling is left out: each request's
token stream is given, and decode tokens come from it like prefill tokens. The output is the restored logits of
every request at each step, which every rank sees the same. The schedule has two 8-token prefills, then two
decodes, then two decodes plus a 12-token prefill, then three decodes plus a 2-token prefill. Every rank-local
batch size is a captured size, so the pre-fix dispatch never looks for a graph that was not captured: the bug
shows only through the buffers. By our reading, a batch whose largest rank-local size was not captured (three
decodes, for example) would instead make the wrapper try a capture after capture was disabled, and raise.
"""
import contextlib
import dataclasses
from dataclasses import dataclass, replace

import numpy as np
import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/53515"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "capture_model"
SYMPTOM = ("MRV2 + prefill context parallelism + PIECEWISE graphs: the graphs were captured on the runner's "
           "global input_ids/positions, so replays embed the global batch's first tokens instead of this "
           "rank's partitioned ones (wrong logits on prefill and mixed steps, no error)")

VOCAB, HIDDEN, ROPE_DIM, NUM_LAYERS = 32, 8, 4, 2
MAX_POSITIONS = 64
PCP_WORLD_SIZE = 2
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8, 16]
MAX_NUM_REQS, MAX_NUM_BATCHED_TOKENS = 4, 16


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


# --- vllm/forward_context.py, vllm/config/compilation.py ----------------------------------------------------------

class CUDAGraphMode:
    NONE, PIECEWISE = "NONE", "PIECEWISE"


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    has_lora: bool = False


@dataclass
class ForwardContext:
    cudagraph_runtime_mode: str = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    is_padding: torch.Tensor | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextlib.contextmanager
def set_forward_context(*, cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None, is_padding=None):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(cudagraph_runtime_mode, batch_descriptor, is_padding)
    try:
        yield
    finally:
        _forward_context = prev


# --- vllm/compilation/monitor.py, vllm/compilation/cuda_graph.py ---------------------------------------------------

cudagraph_capturing_enabled = True


def set_cudagraph_capturing_enabled(enabled: bool) -> None:
    global cudagraph_capturing_enabled
    cudagraph_capturing_enabled = enabled


def validate_cudagraph_capturing_enabled() -> None:
    if not cudagraph_capturing_enabled:
        raise RuntimeError("CUDA graph capturing detected at an inappropriate time. "
                           "This operation is currently disabled.")


@dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: object = None
    output: torch.Tensor | None = None
    input_addresses: list[int] | None = None


class CUDAGraphWrapper:
    """Wraps a compiled piece. Under its runtime mode it captures one graph per batch descriptor on the first call
    and replays it afterwards. It does not copy inputs: a replay reads them at their capture-time addresses."""

    def __init__(self, runnable, runtime_mode, graph_pool, device, owner):
        self.runnable, self.runtime_mode, self.graph_pool = runnable, runtime_mode, graph_pool
        self.device, self.owner = device, owner
        self.is_debugging_mode = False                 # envs.VLLM_LOGGING_LEVEL == "DEBUG"
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}

    def __call__(self, *args):
        forward_context = get_forward_context()
        batch_descriptor = forward_context.batch_descriptor
        cudagraph_runtime_mode = forward_context.cudagraph_runtime_mode
        if cudagraph_runtime_mode == CUDAGraphMode.NONE or cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args)

        assert batch_descriptor is not None
        if batch_descriptor not in self.concrete_cudagraph_entries:
            self.concrete_cudagraph_entries[batch_descriptor] = CUDAGraphEntry(batch_descriptor=batch_descriptor)
        entry = self.concrete_cudagraph_entries[batch_descriptor]

        if entry.cudagraph is None:
            validate_cudagraph_capturing_enabled()
            entry.input_addresses = [x.data_ptr() for x in args if isinstance(x, torch.Tensor)]
            g, output = capture(lambda: self.runnable(*args), device=self.device, pool=self.graph_pool, warmups=0,
                                name=f"{self.owner} PIECEWISE num_tokens={batch_descriptor.num_tokens}",
                                owner=self.owner)
            entry.cudagraph, entry.output = g, output
            return output

        if self.is_debugging_mode:
            new_input_addresses = [x.data_ptr() for x in args if isinstance(x, torch.Tensor)]
            assert new_input_addresses == entry.input_addresses, (
                f"Input addresses for cudagraphs are different during replay. "
                f"Expected {entry.input_addresses}, got {new_input_addresses}")

        size = batch_descriptor.num_tokens
        real = size if forward_context.is_padding is None else int((~forward_context.is_padding).sum())
        return replay(entry.cudagraph, entry.output, real=real, size=size)


# --- the model (DeepSeek-style MLA decoder, token-wise parts only) ------------------------------------------------

class RotaryEmbedding:
    def __init__(self, rotary_dim, max_position, device):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def __call__(self, positions, x):
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DeepseekV2Weights:
    def __init__(self, device):
        gen = generator(53515)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [dict(input_layernorm=1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1),
                            q_pe_proj=randn(HIDDEN, ROPE_DIM, gen=gen, device=device, scale=0.5),
                            o_proj=randn(ROPE_DIM, HIDDEN, gen=gen, device=device, scale=0.5),
                            post_attention_layernorm=1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1),
                            gate_up_proj=randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.4),
                            down_proj=randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4))
                       for _ in range(NUM_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)


class DeepseekV2Model:
    """The ``support_torch_compile`` region: embedding, per layer a RoPE'd projection and an MLP, final norm."""

    def __init__(self, weights: DeepseekV2Weights, device):
        self.w = weights
        self.rotary_emb = RotaryEmbedding(ROPE_DIM, MAX_POSITIONS, device)

    def __call__(self, input_ids, positions):
        hidden_states = torch.nn.functional.embedding(input_ids, self.w.embed_tokens)
        for layer in self.w.layers:
            q_pe = rms_norm(hidden_states, layer["input_layernorm"]) @ layer["q_pe_proj"]
            q_pe = self.rotary_emb(positions, q_pe)
            hidden_states = hidden_states + torch.tanh(q_pe) @ layer["o_proj"]
            gate, up = (rms_norm(hidden_states, layer["post_attention_layernorm"]) @ layer["gate_up_proj"]).chunk(2, -1)
            hidden_states = hidden_states + (torch.nn.functional.silu(gate) * up) @ layer["down_proj"]
        return rms_norm(hidden_states, self.w.norm)


class DeepseekV2ForCausalLM:
    def __init__(self, weights, device, graph_pool, owner):
        self.w = weights
        # one piece (no splitting op left in this model), wrapped for PIECEWISE graphs
        self.model = CUDAGraphWrapper(DeepseekV2Model(weights, device), CUDAGraphMode.PIECEWISE, graph_pool,
                                      device, owner)

    def __call__(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.w.lm_head


# --- vllm/v1/worker/gpu/input_batch.py -----------------------------------------------------------------------------

class InputBuffers:
    def __init__(self, max_num_reqs, max_num_tokens, device):
        self.max_num_reqs, self.max_num_tokens = max_num_reqs, max_num_tokens
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.is_padding = torch.zeros(max_num_tokens, dtype=torch.bool, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)


@dataclass
class InputBatch:
    req_ids: list[str]
    num_reqs: int
    idx_mapping: torch.Tensor
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_tokens: int
    num_tokens_after_padding: int
    query_start_loc: torch.Tensor
    query_start_loc_np: np.ndarray
    seq_lens: torch.Tensor
    num_computed_tokens_np: np.ndarray
    is_prefilling_np: np.ndarray
    has_prefill: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    is_padding: torch.Tensor
    logits_indices: torch.Tensor


def async_copy_to_gpu(x: np.ndarray, out=None, device=None):
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(device) if out is None else out[: t.shape[0]].copy_(t)


def prepare_prefill_inputs(input_ids, idx_mapping, query_start_loc, all_token_ids, num_computed_tokens):
    """Token ``t`` of batch request ``i`` is ``all_token_ids[idx_mapping[i], num_computed_tokens + t]`` (the
    Triton kernel as torch; with sampling left out, decode tokens come from the given stream as well)."""
    for i in range(idx_mapping.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        req = int(idx_mapping[i])
        pos = int(num_computed_tokens[req])
        input_ids[start:end] = all_token_ids[req, pos:pos + end - start]


def prepare_pos_seq_lens(idx_mapping, query_start_loc, num_computed_tokens, pos, seq_lens):
    """positions of request ``i``'s tokens are ``num_computed_tokens[idx_mapping[i]] + [0, query_len)``."""
    for i in range(idx_mapping.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        computed = num_computed_tokens[idx_mapping[i].long()]
        pos[start:end] = computed + torch.arange(end - start, device=pos.device)
        seq_lens[i] = computed + (end - start)


# --- vllm/v1/worker/gpu/pcp_manager.py -----------------------------------------------------------------------------

@dataclass(frozen=True)
class RankSegment:
    global_batch_req_idx: int
    global_batch_slice: slice
    rank_local_batch_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.global_batch_slice.stop - self.global_batch_slice.start


class PCPGroupStandIn:
    """``get_pcp_group()``: ``all_gather`` concatenates the ranks' tensors (the ranks run in turn here)."""

    def __init__(self):
        self.rank_tensors: list[torch.Tensor] = []

    def all_gather(self, input_, dim=0):
        assert any(t is input_ for t in self.rank_tensors)
        return torch.cat(self.rank_tensors, dim=dim)


class PCPManager:
    """MRV2 PC batch manager: rewrites the per-step InputBatch into rank-local DualChunkSwap rows."""

    def __init__(self, pcp_world_size, pcp_rank, device, pcp_group, req_states, max_num_reqs, max_num_tokens):
        self.pcp_world_size, self.pcp_rank, self.device = pcp_world_size, pcp_rank, device
        self.pcp_group = pcp_group
        self._req_states = req_states
        self._global_batch: InputBatch | None = None
        self._hidden_restore_idx = None
        self._padded_gather_idx = None
        max_num_local_reqs = 2 * max_num_reqs
        self._input_buffers = InputBuffers(max_num_local_reqs, max_num_tokens, device)
        self._local_req_idx = torch.arange(max_num_local_reqs, dtype=torch.int32, device=device)

    @property
    def input_buffers(self) -> InputBuffers:          # (added by the fix)
        return self._input_buffers

    def _iter_rank_chunks(self, rank, num_scheduled_tokens, is_prefilling):
        """(global batch request, offset in the request's query, length) of each of ``rank``'s chunks."""
        num_chunks = 2 * self.pcp_world_size
        for global_batch_req_idx, num_tokens in enumerate(num_scheduled_tokens):
            query_len = int(num_tokens)
            if query_len == 0:
                continue
            if bool(is_prefilling[global_batch_req_idx]):
                chunk_size = (query_len + num_chunks - 1) // num_chunks
                chunk_indices = (rank, num_chunks - 1 - rank)
            else:  # decodes are replicated
                chunk_size = query_len
                chunk_indices = (0,)
            for chunk_idx in chunk_indices:
                chunk_offset = chunk_idx * chunk_size
                chunk_len = min(chunk_size, query_len - chunk_offset)
                if chunk_len > 0:
                    yield global_batch_req_idx, chunk_offset, chunk_len

    def get_num_tokens_for_dispatch(self, num_scheduled_tokens, is_prefilling) -> int:   # (added by the fix)
        return max(sum(chunk_len for _, _, chunk_len in self._iter_rank_chunks(rank, num_scheduled_tokens,
                                                                                  is_prefilling))
                   for rank in range(self.pcp_world_size))

    @staticmethod
    def _reorder_segments(segments, num_computed_tokens, is_prefilling, query_start_loc_np):
        """Move pure prefills last, the batch order MLA attention backends expect."""
        def is_pure_prefill(segment):
            req_idx = segment.global_batch_req_idx
            start_pos = (num_computed_tokens[req_idx] + segment.global_batch_slice.start
                         - query_start_loc_np[req_idx])
            return bool(is_prefilling[req_idx]) and start_pos == 0

        segments.sort(key=is_pure_prefill)
        rank_offset = 0
        for index, segment in enumerate(segments):
            segments[index] = replace(segment, rank_local_batch_slice=slice(rank_offset,
                                                                            rank_offset + segment.num_tokens))
            rank_offset += segment.num_tokens
        return segments

    def _get_rank_segments(self, rank, num_scheduled_tokens, num_computed_tokens, is_prefilling, query_start_loc_np):
        rank_segments, rank_offset = [], 0
        for global_batch_req_idx, chunk_offset, chunk_len in self._iter_rank_chunks(rank, num_scheduled_tokens,
                                                                                    is_prefilling):
            chunk_start = int(query_start_loc_np[global_batch_req_idx]) + chunk_offset
            rank_segments.append(RankSegment(global_batch_req_idx, slice(chunk_start, chunk_start + chunk_len),
                                             slice(rank_offset, rank_offset + chunk_len)))
            rank_offset += chunk_len
        return self._reorder_segments(rank_segments, num_computed_tokens, is_prefilling, query_start_loc_np)

    def _build_batch_layout(self, num_scheduled_tokens, num_computed_tokens, is_prefilling, query_start_loc_np,
                            padded_num_tokens=None):
        segments_by_rank, per_rank_num_tokens = [], []
        for rank in range(self.pcp_world_size):
            segments = self._get_rank_segments(rank, num_scheduled_tokens, num_computed_tokens, is_prefilling,
                                               query_start_loc_np)
            segments_by_rank.append(segments)
            per_rank_num_tokens.append(sum(segment.num_tokens for segment in segments))

        hidden_restore_idx = np.empty(int(query_start_loc_np[-1]), dtype=np.int64)
        if padded_num_tokens is None:
            padded_num_tokens = max(per_rank_num_tokens)
        elif padded_num_tokens < max(per_rank_num_tokens):
            raise ValueError(f"padded_num_tokens={padded_num_tokens} is smaller than the largest rank-local batch "
                             f"({max(per_rank_num_tokens)})")
        num_expanded_tokens = padded_num_tokens * self.pcp_world_size
        padded_gather_idx = np.zeros(num_expanded_tokens, dtype=np.int64)
        for rank, segments in enumerate(segments_by_rank):
            expanded_rank_offset = rank * padded_num_tokens
            for segment in segments:
                padded_gathered_slice = slice(expanded_rank_offset + segment.rank_local_batch_slice.start,
                                              expanded_rank_offset + segment.rank_local_batch_slice.stop)
                padded_gather_idx[padded_gathered_slice] = np.arange(segment.global_batch_slice.start,
                                                                     segment.global_batch_slice.stop)
                # Cache insertion pairs one slot entry with each rank's local decode.
                if not bool(is_prefilling[segment.global_batch_req_idx]) and rank != 0:
                    continue
                hidden_restore_idx[segment.global_batch_slice] = np.arange(padded_gathered_slice.start,
                                                                           padded_gathered_slice.stop)
        self._hidden_restore_idx = async_copy_to_gpu(hidden_restore_idx, device=self.device)
        self._padded_gather_idx = async_copy_to_gpu(padded_gather_idx, device=self.device)
        return segments_by_rank, per_rank_num_tokens, padded_num_tokens

    def partition_batch(self, input_batch: InputBatch, padded_num_tokens: int | None = None) -> InputBatch:
        input_buffers = self._input_buffers
        global_batch = input_batch
        self._global_batch = global_batch
        num_computed_tokens = global_batch.num_computed_tokens_np
        segments_by_rank, per_rank_num_tokens, num_local_tokens_padded = self._build_batch_layout(
            global_batch.num_scheduled_tokens, num_computed_tokens, global_batch.is_prefilling_np,
            global_batch.query_start_loc_np, padded_num_tokens)

        local_segments = segments_by_rank[self.pcp_rank]
        num_local_reqs = len(local_segments)
        local_to_global_batch_req_idx_np = np.array([s.global_batch_req_idx for s in local_segments], dtype=np.intp)
        local_start_pos_np = np.array([num_computed_tokens[s.global_batch_req_idx] + s.global_batch_slice.start
                                       - global_batch.query_start_loc_np[s.global_batch_req_idx]
                                       for s in local_segments], dtype=np.int32)
        local_num_scheduled_tokens = np.array([s.num_tokens for s in local_segments], dtype=np.int32)
        num_local_tokens = int(local_num_scheduled_tokens.sum())

        rank_token_start = self.pcp_rank * num_local_tokens_padded
        local_gather_idx = self._padded_gather_idx[rank_token_start: rank_token_start + num_local_tokens_padded]
        torch.index_select(global_batch.input_ids, 0, local_gather_idx,
                           out=input_buffers.input_ids[:num_local_tokens_padded])

        local_query_start_loc_np = np.empty(input_buffers.max_num_reqs + 1, dtype=np.int32)
        local_query_start_loc_np[0] = 0
        np.cumsum(local_num_scheduled_tokens, out=local_query_start_loc_np[1: num_local_reqs + 1])
        local_query_start_loc_np[num_local_reqs + 1:] = num_local_tokens
        async_copy_to_gpu(local_query_start_loc_np, out=input_buffers.query_start_loc)
        local_query_start_loc = input_buffers.query_start_loc[: num_local_reqs + 1]
        local_start_pos = async_copy_to_gpu(local_start_pos_np, device=self.device)

        prepare_pos_seq_lens(self._local_req_idx[:num_local_reqs], local_query_start_loc, local_start_pos,
                             input_buffers.positions, input_buffers.seq_lens[:num_local_reqs])
        is_padding = input_buffers.is_padding[:num_local_tokens_padded]
        is_padding[:num_local_tokens].fill_(False)
        is_padding[num_local_tokens:].fill_(True)
        if num_local_tokens_padded > num_local_tokens:
            input_buffers.input_ids[:num_local_tokens_padded].masked_fill_(is_padding, 0)
            input_buffers.positions[:num_local_tokens_padded].masked_fill_(is_padding, 0)

        return replace(
            input_batch,
            req_ids=[global_batch.req_ids[i] for i in local_to_global_batch_req_idx_np],
            num_reqs=num_local_reqs,
            idx_mapping=async_copy_to_gpu(global_batch.idx_mapping_np[local_to_global_batch_req_idx_np],
                                          device=self.device),
            idx_mapping_np=global_batch.idx_mapping_np[local_to_global_batch_req_idx_np],
            num_scheduled_tokens=local_num_scheduled_tokens,
            num_tokens=num_local_tokens,
            num_tokens_after_padding=num_local_tokens_padded,
            query_start_loc=local_query_start_loc,
            query_start_loc_np=local_query_start_loc_np[: num_local_reqs + 1],
            seq_lens=input_buffers.seq_lens[:num_local_reqs],
            num_computed_tokens_np=local_start_pos_np,
            input_ids=input_buffers.input_ids[:num_local_tokens_padded],
            positions=input_buffers.positions[:num_local_tokens_padded],
            is_padding=is_padding,
        )

    def restore_hidden_states(self, hidden_states):
        gathered = self.pcp_group.all_gather(hidden_states, dim=0)
        return gathered[self._hidden_restore_idx]

    def restore_for_sampling(self, hidden_states):
        return self.restore_hidden_states(hidden_states), self._global_batch


def maybe_partition_pcp_batch(manager, input_batch, padded_num_tokens=None):
    if manager is None:
        return input_batch
    return manager.partition_batch(input_batch, padded_num_tokens)


def maybe_restore_pcp_for_sampling(manager, hidden_states, input_batch):
    if manager is None:
        return hidden_states, input_batch
    return manager.restore_for_sampling(hidden_states)


# --- vllm/v1/worker/gpu/cudagraph_utils.py -------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: str
    num_tokens: int


class ModelCudaGraphManager:
    def __init__(self, cudagraph_mode, device):
        self.cudagraph_mode, self.device = cudagraph_mode, device
        self.cudagraph_sizes: dict[int, int] = {}
        if cudagraph_mode != CUDAGraphMode.NONE:
            for i in range(1, CUDAGRAPH_CAPTURE_SIZES[-1] + 1):
                self.cudagraph_sizes[i] = next(x for x in CUDAGRAPH_CAPTURE_SIZES if i <= x)

    def dispatch(self, num_tokens: int) -> BatchExecutionDescriptor:
        size = self.cudagraph_sizes.get(num_tokens)
        if size is None:
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens)
        return BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, size)

    def run_pw_graph(self, model, model_inputs):
        return model(**model_inputs)

    def capture(self, model, input_buffers: InputBuffers):
        for num_tokens in sorted(set(self.cudagraph_sizes.values()), reverse=True):
            model_inputs = {"input_ids": input_buffers.input_ids[:num_tokens],
                            "positions": input_buffers.positions[:num_tokens]}
            with events.warmup(), set_forward_context(cudagraph_runtime_mode=CUDAGraphMode.NONE):
                model(**model_inputs)
            batch_descriptor = BatchDescriptor(num_tokens=num_tokens)
            # Capture run - the CUDAGraphWrapper inside the compiled model captures.
            with set_forward_context(cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                                     batch_descriptor=batch_descriptor,
                                     is_padding=input_buffers.is_padding[:num_tokens]):
                self.run_pw_graph(model, model_inputs)


# --- vllm/v1/worker/gpu/model_runner.py ----------------------------------------------------------------------------

class RequestState:
    def __init__(self, max_num_reqs, max_model_len, device):
        self.req_id_to_index: dict[str, int] = {}
        self.all_token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.long, device=device)
        self.prefill_len = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)

    def add_request(self, req_id, prompt_len, all_token_ids):
        idx = len(self.req_id_to_index)
        self.req_id_to_index[req_id] = idx
        self.all_token_ids[idx, :len(all_token_ids)] = torch.tensor(all_token_ids)
        self.prefill_len[idx] = prompt_len


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    new_reqs: dict[str, tuple[int, list[int]]] = dataclasses.field(default_factory=dict)   # id: (prompt_len, stream)


@dataclass
class ExecuteModelState:
    input_batch: InputBatch
    hidden_states: torch.Tensor


class GPUModelRunner:
    def __init__(self, weights, pcp_rank, pcp_group, device, variant, cudagraph_mode):
        self.device, self.variant = device, variant
        self.max_num_reqs, self.max_num_tokens = MAX_NUM_REQS, MAX_NUM_BATCHED_TOKENS
        owner = f"PCP rank {pcp_rank}"
        self.model = DeepseekV2ForCausalLM(weights, device, graph_pool_handle(device), owner)
        self.req_states = RequestState(self.max_num_reqs, MAX_POSITIONS, device)
        self.input_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, device)
        self.pcp_manager = PCPManager(PCP_WORLD_SIZE, pcp_rank, device, pcp_group, self.req_states,
                                      self.max_num_reqs, self.max_num_tokens)
        self.cudagraph_manager = ModelCudaGraphManager(cudagraph_mode, device)
        self.execute_model_state: ExecuteModelState | None = None

    def capture_model(self):
        if self.variant == "bug":
            input_buffers = self.input_buffers
        else:
            input_buffers = self.input_buffers
            if self.pcp_manager is not None:
                input_buffers = self.pcp_manager.input_buffers
        events.static_buffers(f"GPUModelRunner (PCP rank {self.pcp_manager.pcp_rank}, PIECEWISE)",
                              {"input_ids": input_buffers.input_ids, "positions": input_buffers.positions})
        self.cudagraph_manager.capture(self.model, input_buffers)

    def add_requests(self, scheduler_output):
        for req_id, (prompt_len, stream) in scheduler_output.new_reqs.items():
            self.req_states.add_request(req_id, prompt_len, stream)

    def gather_batch_req_state(self, scheduler_output):
        num_tokens_per_req = scheduler_output.num_scheduled_tokens
        rs = self.req_states
        is_prefilling = {r: rs.num_computed_tokens_np[rs.req_id_to_index[r]] < rs.prefill_len[rs.req_id_to_index[r]]
                         for r in num_tokens_per_req}
        req_ids = sorted(num_tokens_per_req, key=lambda r: is_prefilling[r])   # decodes first
        num_scheduled_tokens = np.array([num_tokens_per_req[r] for r in req_ids], dtype=np.int32)
        idx_mapping_np = np.array([rs.req_id_to_index[r] for r in req_ids], dtype=np.intp)
        is_prefilling_np = np.array([is_prefilling[r] for r in req_ids], dtype=np.bool_)
        return req_ids, num_scheduled_tokens, idx_mapping_np, is_prefilling_np

    def prepare_inputs(self, batch_req_state, batch_desc: BatchExecutionDescriptor) -> InputBatch:
        req_ids, num_scheduled_tokens_np, idx_mapping_np, is_prefilling_np = batch_req_state
        num_tokens = int(num_scheduled_tokens_np.sum())
        if self.variant == "bug":
            num_tokens_after_padding = batch_desc.num_tokens
        else:                                              # graph width is rank-local now; stage the global batch
            num_tokens_after_padding = max(num_tokens, batch_desc.num_tokens)
        num_reqs = len(req_ids)
        idx_mapping = async_copy_to_gpu(idx_mapping_np, device=self.device)
        query_start_loc_np = np.empty(self.max_num_reqs + 1, dtype=np.int32)
        query_start_loc_np[0] = 0
        np.cumsum(num_scheduled_tokens_np, out=query_start_loc_np[1: num_reqs + 1])
        query_start_loc_np[num_reqs + 1:] = num_tokens
        async_copy_to_gpu(query_start_loc_np, out=self.input_buffers.query_start_loc)
        query_start_loc = self.input_buffers.query_start_loc[: num_reqs + 1]
        prepare_prefill_inputs(self.input_buffers.input_ids, idx_mapping, query_start_loc,
                               self.req_states.all_token_ids, self.req_states.num_computed_tokens_np)
        prepare_pos_seq_lens(idx_mapping, query_start_loc, self.req_states.num_computed_tokens,
                             self.input_buffers.positions, self.input_buffers.seq_lens)
        logits_indices = query_start_loc[1:] - 1
        input_batch = InputBatch(
            req_ids=req_ids, num_reqs=num_reqs, idx_mapping=idx_mapping, idx_mapping_np=idx_mapping_np,
            num_scheduled_tokens=num_scheduled_tokens_np, num_tokens=num_tokens,
            num_tokens_after_padding=num_tokens_after_padding, query_start_loc=query_start_loc,
            query_start_loc_np=query_start_loc_np[: num_reqs + 1], seq_lens=self.input_buffers.seq_lens[:num_reqs],
            num_computed_tokens_np=self.req_states.num_computed_tokens_np[idx_mapping_np],
            is_prefilling_np=is_prefilling_np, has_prefill=bool(is_prefilling_np.any()),
            input_ids=self.input_buffers.input_ids[:num_tokens_after_padding],
            positions=self.input_buffers.positions[:num_tokens_after_padding],
            is_padding=self.input_buffers.is_padding[:num_tokens_after_padding],
            logits_indices=logits_indices)
        if self.variant == "bug":
            return maybe_partition_pcp_batch(self.pcp_manager, input_batch)
        return maybe_partition_pcp_batch(self.pcp_manager, input_batch, padded_num_tokens=batch_desc.num_tokens)

    def execute_model(self, scheduler_output: SchedulerOutput):
        self.add_requests(scheduler_output)
        batch_req_state = self.gather_batch_req_state(scheduler_output)
        _, num_scheduled_tokens, _, is_prefilling_np = batch_req_state
        num_toks = int(num_scheduled_tokens.sum())
        if self.variant == "fix" and self.pcp_manager is not None:
            num_toks = self.pcp_manager.get_num_tokens_for_dispatch(num_scheduled_tokens, is_prefilling_np)
        batch_desc = self.cudagraph_manager.dispatch(num_toks)

        input_batch = self.prepare_inputs(batch_req_state, batch_desc)
        model_inputs = {"input_ids": input_batch.input_ids, "positions": input_batch.positions}
        batch_descriptor = BatchDescriptor(num_tokens=input_batch.num_tokens_after_padding)
        with set_forward_context(cudagraph_runtime_mode=batch_desc.cg_mode, batch_descriptor=batch_descriptor,
                                 is_padding=input_batch.is_padding):
            if batch_desc.cg_mode == CUDAGraphMode.PIECEWISE:
                model_output = self.cudagraph_manager.run_pw_graph(self.model, model_inputs)
            else:
                model_output = self.model(**model_inputs)
        self.execute_model_state = ExecuteModelState(input_batch, model_output)

    def sample_tokens(self):
        state, self.execute_model_state = self.execute_model_state, None
        hidden_states, input_batch = maybe_restore_pcp_for_sampling(self.pcp_manager, state.hidden_states,
                                                                    state.input_batch)
        logits = self.model.compute_logits(hidden_states[input_batch.logits_indices])
        # postprocess: the scheduled tokens are computed now
        rs = self.req_states
        rs.num_computed_tokens_np[input_batch.idx_mapping_np] += input_batch.num_scheduled_tokens
        rs.num_computed_tokens.copy_(torch.from_numpy(rs.num_computed_tokens_np))
        return logits.clone()


def token_stream(seed, n):
    return torch.randint(0, VOCAB, (n,), generator=generator(seed)).tolist()


A, B, C, D = token_stream(1, 12), token_stream(2, 12), token_stream(3, 16), token_stream(4, 6)
SCHEDULE = [
    SchedulerOutput({"A": 8, "B": 8}, {"A": (8, A), "B": (8, B)}),       # two prefills: 16 global, 8 per rank
    SchedulerOutput({"A": 1, "B": 1}),                                  # decodes only: replicated, 2 per rank
    SchedulerOutput({"A": 1, "B": 1, "C": 12}, {"C": (12, C)}),          # 14 global, 2 + 6 per rank
    SchedulerOutput({"A": 1, "B": 1, "C": 1, "D": 2}, {"D": (2, D)}),    # 5 global, 3 + 1 per rank
]


def run(variant: str, device: str = "cpu"):
    weights = DeepseekV2Weights(device)

    def serve(graphed: bool):
        set_cudagraph_capturing_enabled(True)
        pcp_group = PCPGroupStandIn()
        mode = CUDAGraphMode.PIECEWISE if graphed else CUDAGraphMode.NONE
        runners = [GPUModelRunner(weights, rank, pcp_group, device, variant, mode) for rank in range(PCP_WORLD_SIZE)]
        if graphed:
            for runner in runners:
                runner.capture_model()
        set_cudagraph_capturing_enabled(False)             # each rank's worker, once its capture is over
        outputs = []
        for scheduler_output in SCHEDULE:
            for runner in runners:
                runner.execute_model(scheduler_output)
            pcp_group.rank_tensors = [runner.execute_model_state.hidden_states for runner in runners]
            logits = [runner.sample_tokens() for runner in runners]
            outputs.append(logits[0])
        return outputs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
