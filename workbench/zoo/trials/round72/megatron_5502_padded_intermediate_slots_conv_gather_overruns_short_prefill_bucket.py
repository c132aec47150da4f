"""Padded Mamba intermediate-state slots gather a ``d_conv`` window that overruns a prefill CUDA-graph bucket shorter than ``d_conv``.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/5502 ("Mamba prefix caching fixes", merged 2026-07-14, commit
e5344abbdf). The graph fix is one item of the PR: the clamp in ``MambaMixer._ssm_prefill`` and the comments in
``MambaMetadata._update_intermediate_metadata``. The rest is scheduler and prefix-skip work; it is not modelled.
Symptom: a hybrid (Mamba) model served by the dynamic inference engine, with prefix caching and CUDA graphs for
non-decode steps, fails while it builds its CUDA graphs. The smallest prefill bucket has fewer tokens than the
conv window (``d_conv`` = 4; the bucket sizes halve down to the rounder floor of 2 tokens, and
``generate_cuda_graph_batch_dimensions_list`` already skips 1-token prefill buckets because "the gather kernel
asserts on index >= 1 against a 1-element tensor at capture time"). The conv-state gather of the padded slots
indexes past the token axis: an out-of-bounds index, i.e. a device-side assert during warmup/capture. Eager steps
pad the token count to a multiple of ``TOKEN_ROUNDER`` (64), which is never shorter than ``d_conv``, so they run.
The new test ``test_prefill_shorter_than_conv_window`` covers a prompt shorter than ``d_conv`` with
``num_cuda_graphs`` set, and says CUDA graphs are needed to hit this path.
Mechanism: every prefill step extracts intermediate Mamba states for prefix caching. This always runs, "CUDA graph
compat". ``MambaMetadata._update_intermediate_metadata`` (megatron/core/inference/contexts/attention_context/
mamba_metadata.py) sizes ``intermediate_abs_positions`` to the bucket's ``padded_prefill_count *
MAX_INTERMEDIATE_OFFSETS_PER_REQUEST`` slots. It fills the unused slots (all of them when no request has a block
boundary, e.g. the dummy requests of a graph warmup) with the "safe default" ``abs_position = d_conv``: "conv
gather reads tokens [0..d_conv-1], which are within bounds". ``MambaMixer._ssm_prefill`` (megatron/core/ssm/
mamba_mixer.py) then gathers ``xBC_pre_conv[0, abs_position + [-d_conv..-1], :]`` for every slot. Real slots
always sit at a block boundary inside their sequence. Padded slots read tokens ``0..d_conv-1``, which do not
exist when the step's token axis (the graph bucket's ``token_count``) is shorter than ``d_conv``.
Doctor: stale-padding, at _ssm_prefill (the padded slots of the intermediate-state metadata hold a sentinel
position. Whether the whole captured step survives depends on what those padded slots hold: at a bucket shorter
than the conv window their gather window lies past the token axis, although every real slot is in range. The fix
changes code only here, where the padded slots are consumed).
Fix (upstream): ``_ssm_prefill`` clamps the gather positions into ``[0, seq_len - 1]`` with
``seq_len = xBC_pre_conv.shape[1]`` ("Real slots are always in range, so this is a no-op for them, and
padding-slot results are never read"). The padding comments in ``mamba_metadata.py`` are updated to match.
Modelled: one Mamba layer whose mixer is the conv part only: in_proj to (z, xBC), the varlen causal conv
(``causal_conv1d_varlen_states`` + ``tensor_masked_update`` of the live conv state, ``causal_conv1d_varlen_fn``
with no initial state), a gate, and out_proj. There is no SSM scan and no intermediate SSM states or chunk indices.
Prefix-cache offsets follow ``MambaSlotAllocator.compute_and_store_offsets`` with no KV match, and
``commit_intermediate_states`` copies the real slots into durable conv slots; EOS caching and restores are left
out. Sizes are scaled down: block = mamba chunk = 4 tokens, ``d_conv`` = 4, ``TOKEN_ROUNDER`` = 8,
``REQUEST_ROUNDER`` = 2, and prefill-only buckets (8 or 2 tokens, 1 or 2 prefill requests). Each step serves one
new request's whole prompt (no chunking, no decode).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/5502"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_ssm_prefill"
SYMPTOM = ("building the prefill CUDA graphs of a hybrid model with prefix caching fails: padded intermediate-state "
           "slots gather conv tokens [0..d_conv-1] past the end of a bucket shorter than d_conv")

VOCAB, HIDDEN, CONV_DIM, D_CONV, LAYERS = 16, 4, 4, 4, 1
BLOCK_SIZE = MAMBA_CHUNK_SIZE = 4                       # upstream: 256-token KV blocks, 128-token SSM chunks
MAX_REQUESTS, MAX_TOKENS, MAX_SLOTS = 2, 16, 8
TOKEN_ROUNDER, REQUEST_ROUNDER = 8, 2                   # upstream 64, 4
CUDA_GRAPH_TOKEN_COUNTS = [8, 2]                        # exponential sizes, floored at CUDA_GRAPH_ROUNDER = 2
MAX_INTERMEDIATE_OFFSETS_PER_REQUEST = 3


# --- megatron/core/inference/batch_dimensions_utils.py ----------------------------------------------

class InferenceBatchDimensions(NamedTuple):
    token_count: int = 0
    prefill_req_count: int = 0
    decode_req_count: int = 0

    def is_applicable_for_batch_dim(self, real: "InferenceBatchDimensions", strict: bool = True) -> bool:
        return (self.token_count >= real.token_count and self.prefill_req_count >= real.prefill_req_count
                and self.decode_req_count >= real.decode_req_count)

    def is_valid(self, max_requests: int) -> bool:
        return (self.token_count > 0 and self.prefill_req_count + self.decode_req_count <= max_requests
                and self.token_count >= self.prefill_req_count + self.decode_req_count)


class CUDAGraphBatchDimensionBuilder:
    @staticmethod
    def generate_cuda_graph_batch_dimensions_list(max_requests: int) -> list[InferenceBatchDimensions]:
        dims = []
        for size in CUDA_GRAPH_TOKEN_COUNTS:
            for prefill_req_count in (1, 2):
                # Skip token_count == 1 with prefill_req == 1 (the gather kernel asserts at capture time).
                if size < 2:
                    continue
                d = InferenceBatchDimensions(size, prefill_req_count, 0)
                if d.is_valid(max_requests):
                    dims.append(d)
        return sorted(set(dims), reverse=True)

    @staticmethod
    def match_graph_config(real, dims_list, strict=True):
        applicable = [d for d in dims_list if d.is_applicable_for_batch_dim(real, strict)]
        return min(applicable) if applicable else None


# --- megatron/core/inference/contexts/attention_context/mamba_metadata.py ---------------------------

class MambaMetadata:
    def __init__(self, device):
        self.device, self.d_conv = device, D_CONV
        i32 = dict(dtype=torch.int32, device=device)
        self._cu_seqlens_buffer = torch.zeros(MAX_REQUESTS + 1, **i32)
        self._batch_indices_prefill_buffer = torch.full((MAX_REQUESTS,), -1, **i32)
        self._conv_seq_start_buffer = torch.zeros(MAX_TOKENS, **i32)
        self._intermediate_abs_positions_buffer = torch.zeros(MAX_REQUESTS * MAX_INTERMEDIATE_OFFSETS_PER_REQUEST,
                                                              **i32)
        self.conv_gather_offsets = torch.arange(-D_CONV, 0, **i32)      # [-d_conv, ..., -1]

    def update(self, prefill_lengths, mamba_indices, padded_batch_dimensions, intermediate_offsets,
               intermediate_counts):
        real_prefill_count = len(prefill_lengths)
        padded_prefill_count = padded_batch_dimensions.prefill_req_count
        padded_token_count = padded_batch_dimensions.token_count
        cu = [0]
        for n in prefill_lengths:
            cu.append(cu[-1] + n)
        cu += [cu[-1]] * (padded_prefill_count - real_prefill_count)          # padded requests: zero length
        self._cu_seqlens_buffer[:padded_prefill_count + 1].copy_(torch.tensor(cu, dtype=torch.int32))
        self.cu_seqlens = self._cu_seqlens_buffer[:padded_prefill_count + 1]
        idx = list(mamba_indices) + [-1] * (padded_prefill_count - real_prefill_count)
        self._batch_indices_prefill_buffer[:padded_prefill_count].copy_(torch.tensor(idx, dtype=torch.int32))
        self.batch_indices_prefill = self._batch_indices_prefill_buffer[:padded_prefill_count]
        starts = [cu[r] for r, n in enumerate(prefill_lengths) for _ in range(n)]
        starts += [0] * (padded_token_count - len(starts))                      # padded tokens
        self._conv_seq_start_buffer[:padded_token_count].copy_(torch.tensor(starts, dtype=torch.int32))
        self.conv_seq_start = self._conv_seq_start_buffer[:padded_token_count]
        self._update_intermediate_metadata(intermediate_offsets, intermediate_counts, real_prefill_count,
                                           padded_prefill_count)

    def _update_intermediate_metadata(self, intermediate_offsets_gpu, intermediate_counts_gpu, real_prefill_count,
                                      padded_prefill_count):
        max_count = padded_prefill_count * MAX_INTERMEDIATE_OFFSETS_PER_REQUEST
        if intermediate_offsets_gpu is not None and real_prefill_count > 0:
            counts_list = intermediate_counts_gpu.tolist()
            intermediate_offsets_gpu = intermediate_offsets_gpu.to(self.device)
            intermediate_counts_gpu = intermediate_counts_gpu.to(self.device)
            if sum(counts_list) > 0:
                cu = self._cu_seqlens_buffer[:real_prefill_count + 1]
                seq_starts = cu[:real_prefill_count].to(torch.int64)
                offsets = intermediate_offsets_gpu.to(torch.int64)
                abs_positions_2d = seq_starts.unsqueeze(1).expand_as(offsets) + offsets
                j_indices = torch.arange(MAX_INTERMEDIATE_OFFSETS_PER_REQUEST, device=self.device).unsqueeze(0)
                valid_mask = j_indices < intermediate_counts_gpu.unsqueeze(1)
                valid_abs_positions = abs_positions_2d[valid_mask]
                real_count = valid_abs_positions.numel()
                self._intermediate_abs_positions_buffer[:real_count] = valid_abs_positions.to(torch.int32)
                # Pad unused slots with safe defaults for CUDA graph replay:
                # - abs_positions=d_conv: conv gather reads tokens [0..d_conv-1],
                #   which are within bounds and produce a valid but unused state
                if real_count < max_count:
                    self._intermediate_abs_positions_buffer[real_count:max_count].fill_(self.d_conv)
                self.intermediate_count = real_count
            else:
                self._intermediate_abs_positions_buffer[:max_count] = self.d_conv
                self.intermediate_count = 0
            self.per_request_intermediate_counts = counts_list
        else:
            # No extraction: fill with safe defaults for CUDA graph warmup
            # (same rationale as padding comment above)
            self._intermediate_abs_positions_buffer[:max_count] = self.d_conv
            self.intermediate_count = 0
            self.per_request_intermediate_counts = []
        self.intermediate_abs_positions = self._intermediate_abs_positions_buffer[:max_count]


# --- megatron/core/inference/contexts/mamba_slot_allocator.py ---------------------------------------

class MambaSlotAllocator:
    def __init__(self, context, device):
        self.context = context
        k = MAX_INTERMEDIATE_OFFSETS_PER_REQUEST
        self.conv_states = torch.zeros(LAYERS, MAX_SLOTS, CONV_DIM, D_CONV, device=device)      # durable cache
        self.next_free_slot = 0
        self.hash_to_slot: dict = {}
        self._intermediate_offsets_cpu = torch.zeros(MAX_REQUESTS, k, dtype=torch.int32)
        self._intermediate_counts_cpu = torch.zeros(MAX_REQUESTS, dtype=torch.int32)
        self._intermediate_block_ids_cpu = torch.full((MAX_REQUESTS, k), -1, dtype=torch.int32)
        self._has_intermediates = False
        self.max_intermediate_count = k * MAX_REQUESTS
        # Per-step scratch the captured prefill writes the intermediate conv states into.
        self.intermediate_conv_out = torch.zeros(LAYERS, self.max_intermediate_count, CONV_DIM, D_CONV,
                                                 device=device)

    def compute_and_store_offsets(self, req, current_id, skip_tokens, prefill_chunk_length, num_matched_blocks,
                                  overall_required_blocks):
        prompt_len = len(req.prompt_tokens)
        kv_div_rel = num_matched_blocks * BLOCK_SIZE - skip_tokens
        last_aligned_rel = (prompt_len // BLOCK_SIZE) * BLOCK_SIZE - skip_tokens
        penultimate_rel = (overall_required_blocks - 1) * BLOCK_SIZE - skip_tokens
        seq_len = prefill_chunk_length - skip_tokens
        offsets = sorted({o for o in (kv_div_rel, last_aligned_rel, penultimate_rel)
                          if 0 < o < seq_len and o % MAMBA_CHUNK_SIZE == 0})
        count = len(offsets)
        if count > 0:
            self._intermediate_offsets_cpu[current_id, :count] = torch.tensor(offsets, dtype=torch.int32)
            self._intermediate_block_ids_cpu[current_id, :count] = torch.tensor(
                [(skip_tokens + o) // BLOCK_SIZE - 1 for o in offsets], dtype=torch.int32)
            self._has_intermediates = True
        self._intermediate_counts_cpu[current_id] = count

    def get_intermediate_cpu_data(self, prefill_count):
        if not self._has_intermediates or prefill_count == 0:
            return None, None
        return self._intermediate_offsets_cpu[:prefill_count], self._intermediate_counts_cpu[:prefill_count]

    def commit_intermediate_states(self, requests):
        """After the forward pass (or graph replay): copy the real slots into durable cache slots."""
        metadata = self.context.mamba_metadata
        src, slots = [], []
        offset = 0
        for r, count in enumerate(metadata.per_request_intermediate_counts):
            for j in range(count):
                block = int(self._intermediate_block_ids_cpu[r, j])
                self.hash_to_slot[(requests[r].request_id, block)] = self.next_free_slot
                src.append(offset + j)
                slots.append(self.next_free_slot)
                self.next_free_slot += 1
            offset += count
        if src:
            dev = self.conv_states.device
            self.conv_states[:, torch.tensor(slots, device=dev)] = self.intermediate_conv_out[
                :, torch.tensor(src, device=dev)]
        self._intermediate_counts_cpu.fill_(0)
        self._intermediate_offsets_cpu.fill_(0)
        self._intermediate_block_ids_cpu.fill_(-1)
        self._has_intermediates = False
        return self.conv_states[:, slots].clone()


# --- megatron/core/inference/contexts/dynamic_context.py --------------------------------------------

class DynamicInferenceRequest:
    def __init__(self, request_id: int, prompt_tokens: list):
        self.request_id, self.prompt_tokens = request_id, prompt_tokens


class DynamicInferenceContext:
    def __init__(self, device, use_cuda_graphs):
        self.device = device
        self.token_to_input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self.mamba_conv_states = torch.zeros(LAYERS, MAX_REQUESTS, CONV_DIM, D_CONV, device=device)   # live
        self.mamba_metadata = MambaMetadata(device)
        self.mamba_slot_allocator = MambaSlotAllocator(self, device)
        self.cuda_graph_batch_dimensions_list = (
            CUDAGraphBatchDimensionBuilder.generate_cuda_graph_batch_dimensions_list(MAX_REQUESTS)
            if use_cuda_graphs else [])
        self.reset()

    def reset(self):
        self.requests: list[DynamicInferenceRequest] = []
        self.active_token_count = 0
        self.mamba_conv_states.zero_()

    @staticmethod
    def round_up_tokens(value):
        return TOKEN_ROUNDER * -(-value // TOKEN_ROUNDER)

    @staticmethod
    def round_up_requests(value):
        return REQUEST_ROUNDER * -(-value // REQUEST_ROUNDER)

    def add_request(self, req, dummy=False):
        current_id = len(self.requests)
        n = len(req.prompt_tokens)
        self.token_to_input_ids[self.active_token_count:self.active_token_count + n].copy_(
            torch.tensor(req.prompt_tokens, dtype=torch.long))
        self.mamba_conv_states[:, current_id].zero_()                   # a fresh request: zeroed Mamba state
        if not dummy:
            self.mamba_slot_allocator.compute_and_store_offsets(req, current_id, 0, n, 0, -(-n // BLOCK_SIZE))
        self.requests.append(req)
        self.active_token_count += n

    def add_dummy_requests_for_cudagraph_capture(self, graph_dimensions):
        per, rem = divmod(graph_dimensions.token_count, graph_dimensions.prefill_req_count)
        for i in range(graph_dimensions.prefill_req_count):
            self.add_request(DynamicInferenceRequest(-1 - i, [0] * (per + (1 if i < rem else 0))), dummy=True)

    def initialize_attention_state(self, *, construct_graph_dimensions=None):
        if construct_graph_dimensions is not None:
            self.add_dummy_requests_for_cudagraph_capture(construct_graph_dimensions)
        self.batch_dimensions = InferenceBatchDimensions(self.active_token_count, len(self.requests), 0)
        best_graph = CUDAGraphBatchDimensionBuilder.match_graph_config(
            self.batch_dimensions, self.cuda_graph_batch_dimensions_list, strict=True)   # strict: hybrid model
        self._using_cuda_graph_this_step = best_graph is not None
        if best_graph is not None:
            self.padded_batch_dimensions = best_graph
        else:
            self.padded_batch_dimensions = InferenceBatchDimensions(
                self.round_up_tokens(self.active_token_count),
                min(MAX_REQUESTS, self.round_up_requests(len(self.requests))), 0)
        self.padded_active_token_count = self.padded_batch_dimensions.token_count
        offsets, counts = self.mamba_slot_allocator.get_intermediate_cpu_data(len(self.requests))
        self.mamba_metadata.update([len(r.prompt_tokens) for r in self.requests], range(len(self.requests)),
                                   self.padded_batch_dimensions, offsets, counts)

    def using_cuda_graph_this_step(self):
        return self._using_cuda_graph_this_step


# --- megatron/core/ssm/ops (torch forms of the varlen conv kernels) ----------------------------------

def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """The last ``state_len`` inputs of each sequence (zeros before its start): [n, dim, state_len]."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    pos = ends.unsqueeze(1) - state_len + torch.arange(state_len, device=x.device).unsqueeze(0)
    valid = pos >= starts.unsqueeze(1)
    return (x[pos.clamp(min=0)] * valid.unsqueeze(-1)).transpose(1, 2)


def tensor_masked_update(states, idx, new_states):
    """``states[idx[i]] = new_states[i]`` for every ``idx[i] >= 0`` (padded requests carry -1)."""
    match = (idx.long().unsqueeze(1) == torch.arange(states.shape[0], device=idx.device).unsqueeze(0))
    upd = torch.einsum("ns,ncw->scw", match.to(new_states.dtype), new_states)
    states.copy_(torch.where(match.any(0).view(-1, 1, 1), upd, states))


def causal_conv1d_varlen_fn(x, weight, bias, precomputed_seq_start):
    """Depthwise causal conv of each token over its own sequence: x [T, dim], weight [dim, w]."""
    t, w = x.shape[0], weight.shape[1]
    src = torch.arange(t, device=x.device).unsqueeze(1) - (w - 1) + torch.arange(w, device=x.device).unsqueeze(0)
    valid = src >= precomputed_seq_start.long().unsqueeze(1)
    xs = x[src.clamp(min=0)] * valid.unsqueeze(-1)                     # [T, w, dim]
    return F.silu((xs * weight.t().unsqueeze(0)).sum(1) + bias)


# --- megatron/core/ssm/mamba_mixer.py ---------------------------------------------------------------

class MambaMixer(torch.nn.Module):
    def __init__(self, gen, variant, device, layer_number=1):
        super().__init__()
        self.variant, self.layer_number, self.d_conv = variant, layer_number, D_CONV
        self.in_proj = randn(HIDDEN, 2 * CONV_DIM, gen=gen, device=device, scale=0.5)        # -> z, xBC
        self.conv1d_weight = randn(CONV_DIM, D_CONV, gen=gen, device=device, scale=0.5)
        self.conv1d_bias = randn(CONV_DIM, gen=gen, device=device, scale=0.1)
        self.out_proj = randn(CONV_DIM, HIDDEN, gen=gen, device=device, scale=0.5)

    def _dynamic_inference(self, hidden_states, context):
        conv_state = context.mamba_conv_states[self.layer_number - 1]
        zxBCdt = hidden_states @ self.in_proj
        y = self._dynamic_inference_prefill(zxBCdt, context, conv_state, mamba_layer_idx=self.layer_number - 1)
        return y @ self.out_proj

    def _dynamic_inference_prefill(self, zxBCdt, context, conv_state, mamba_layer_idx=None):
        metadata = context.mamba_metadata
        # Prepare intermediate extraction buffers (always passed, CUDA graph compat)
        slot_allocator = context.mamba_slot_allocator
        intermediate_conv_out = None
        if slot_allocator is not None and mamba_layer_idx is not None:
            intermediate_conv_out = slot_allocator.intermediate_conv_out[mamba_layer_idx]
        return self._ssm_prefill(zxBCdt, conv_state=conv_state, cu_seqlens=metadata.cu_seqlens,
                                 batch_indices=metadata.batch_indices_prefill,
                                 intermediate_abs_positions=metadata.intermediate_abs_positions,
                                 intermediate_conv_out=intermediate_conv_out,
                                 conv_gather_offsets=metadata.conv_gather_offsets,
                                 conv_seq_start=metadata.conv_seq_start)

    def _ssm_prefill(self, zxBCdt, conv_state, cu_seqlens, batch_indices, intermediate_abs_positions,
                     intermediate_conv_out, conv_gather_offsets, conv_seq_start):
        zxBCdt = zxBCdt.unsqueeze(0)                                        # l d -> b=1 l d
        z, xBC = torch.split(zxBCdt, [CONV_DIM, CONV_DIM], dim=-1)
        # Save final conv states from the input sequence
        conv_varlen_states = causal_conv1d_varlen_states(xBC.squeeze(0), cu_seqlens, state_len=conv_state.shape[-1])
        tensor_masked_update(conv_state, batch_indices, conv_varlen_states)
        xBC_pre_conv = xBC if intermediate_conv_out is not None else None
        xBC = causal_conv1d_varlen_fn(xBC.squeeze(0), self.conv1d_weight, self.conv1d_bias,
                                      precomputed_seq_start=conv_seq_start).unsqueeze(0)
        y = xBC * F.silu(z)

        if intermediate_conv_out is not None:
            n = intermediate_abs_positions.shape[0]
            # Vectorized conv state extraction
            # conv_gather_offsets: [d_conv] = [-d_conv, ..., -1]
            gather_positions = (
                intermediate_abs_positions.unsqueeze(1).long() + conv_gather_offsets.unsqueeze(0).long()
            )  # [n, d_conv]
            if self.variant == "fix":
                # Clamp into the valid token range. Padding/warmup slots use the safe-default
                # abs_position == d_conv; when the prefill sequence is shorter than d_conv (a small
                # CUDA-graph warmup bucket) those indices overrun the token axis.
                seq_len = xBC_pre_conv.shape[1]
                gather_positions = gather_positions.clamp_(0, seq_len - 1)
            intermediate_conv = xBC_pre_conv[0, gather_positions, :]        # [n, d_conv, conv_dim]
            intermediate_conv_out[:n].copy_(intermediate_conv.transpose(1, 2))
        return y.squeeze(0)


class HybridModel(torch.nn.Module):
    def __init__(self, gen, variant, device):
        super().__init__()
        self.embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.mixer = MambaMixer(gen, variant, device)

    def forward(self, input_ids, context):
        h = self.embedding[input_ids]
        return h + self.mixer._dynamic_inference(h, context)


# --- megatron/core/inference/engines/dynamic_engine.py ----------------------------------------------

class DynamicInferenceEngine:
    def __init__(self, model, device, enable_cuda_graph):
        self.model, self.device = model, device
        self.context = DynamicInferenceContext(device, enable_cuda_graph)
        self.cuda_graphs = {}
        if enable_cuda_graph:
            self.create_cuda_graphs()

    def _forward(self, token_count):
        with torch.no_grad():
            return self.model(self.context.token_to_input_ids[:token_count], self.context)

    def create_cuda_graphs(self):
        context, metadata = self.context, self.context.mamba_metadata
        static = {"token_to_input_ids": context.token_to_input_ids, "cu_seqlens": metadata._cu_seqlens_buffer,
                  "batch_indices_prefill": metadata._batch_indices_prefill_buffer,
                  "conv_seq_start": metadata._conv_seq_start_buffer,
                  "intermediate_abs_positions": metadata._intermediate_abs_positions_buffer}
        for dims in context.cuda_graph_batch_dimensions_list:
            context.initialize_attention_state(construct_graph_dimensions=dims)
            self.cuda_graphs[dims] = capture(lambda t=dims.token_count: self._forward(t), device=self.device,
                                             warmups=1, name=f"prefill {dims}",
                                             owner="DynamicInferenceEngine.create_cuda_graphs", static=static,
                                             state={"mamba_conv_states": context.mamba_conv_states})
            context.reset()

    def step(self, req):
        context = self.context
        context.add_request(req)
        context.initialize_attention_state()
        real, padded = context.active_token_count, context.padded_active_token_count
        if context.using_cuda_graph_this_step():
            g, out = self.cuda_graphs[context.padded_batch_dimensions]
            hidden = replay(g, out, real=real, size=padded, padded={"token_to_input_ids": context.token_to_input_ids})
        else:
            hidden = self._forward(padded)
        outputs = [hidden[:real].clone(), context.mamba_conv_states[:, 0].clone()]
        outputs.append(context.mamba_slot_allocator.commit_intermediate_states(context.requests))
        context.reset()                                                     # prefill done: request leaves
        return outputs


def run(variant: str, device: str = "cpu"):
    gen = generator(5502)
    model = HybridModel(gen, variant, device)
    lengths = [7, 2, 8, 1]                                  # buckets (8,1,0), (2,1,0), (8,1,0), (2,1,0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]

    def serve(graphed: bool):
        engine = DynamicInferenceEngine(model, device, enable_cuda_graph=graphed)
        outs = []
        for i, p in enumerate(prompts):
            outs += engine.step(DynamicInferenceRequest(i, p))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
