"""vllm-ascend with MTP on a GDN hybrid model (Qwen3-Next) and FULL ACL graphs: ``NPUModelRunner._determine_batch_execution_and_padding`` calls a batch a uniform decode from its shape alone (``max_num_scheduled_tokens == 1 + num_spec`` and ``num_tokens == max * num_reqs``), so a fresh prompt of exactly ``num_speculative_tokens + 1`` tokens is dispatched to the captured spec-decode graph; its GDN layer replays the spec branch, which continues from a cached recurrent state (read through the builder's persistent state indices, not refreshed for a prefill) instead of starting the prompt from zero.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/6835 ("[BugFix][MTP] Fix prefill misclassified as decode
when prompt tokens == num_spec_tokens + 1", vllm-project/vllm-ascend, by SlightwindSec (Cao Yi), opened 2026-02-26,
merged 2026-03-05 as commit 50441e465 on main). Read: the PR description and the full diff of 50441e465
(``vllm_ascend/worker/model_runner_v1.py``, one hunk in ``_determine_batch_execution_and_padding``; the e2e test
``test_mtp_qwen3_next.py`` gains the prompt "Who are you?"); at its parent: ``model_runner_v1.py``
(``_prepare_inputs`` with ``num_decode_draft_tokens``, ``_build_attn_state``, ``_pad_query_start_loc_for_fia``, the
dispatch part of ``execute_model``, ``_determine_batch_execution_and_padding``, ``_build_attention_metadata`` with the
GDN ``num_accepted_tokens`` / ``num_decode_draft_tokens_cpu`` / ``gdn_query_start_loc`` handling, ``_dummy_run``),
``vllm_ascend/patch/worker/patch_qwen3_next.py`` (``AscendQwen3Next_GatedDeltaNet.forward`` / ``_forward_core``),
``vllm_ascend/compilation/acl_graph.py`` (``ACLGraphWrapper.__call__``), ``vllm_ascend/platform.py`` (cudagraph modes);
and vLLM at the commit the PR names (83b47f67b): ``vllm/v1/cudagraph_dispatcher.py``
(``_create_padded_batch_descriptor``, ``dispatch``), ``vllm/v1/attention/backends/gdn_attn.py``
(``GDNAttentionMetadataBuilder``: ``__init__``, ``build``, ``build_for_cudagraph_capture``),
``vllm/v1/attention/backends/utils.py`` (``split_decodes_and_prefills``, ``mamba_get_block_table_tensor``),
``vllm/model_executor/layers/fla/ops/fused_recurrent.py`` (the kernel). Also read, for context only: the
descriptions of vLLM #50532 (closed) and #47123 (open), which report the same collision in vLLM.
Not read: the MTP proposer and rejection sampler, the full-attention layers and their FIA parameter update
(``update_full_graph_params``), the causal-conv kernels, ``chunk_gated_delta_rule``'s internals, the PR's review thread.
Symptom: (PR text) "When MTP is enabled, prefill requests with ``prompt_tokens == num_spec_tokens + 1`` are incorrectly
classified as decode requests, causing accuracy issues." No error; only such prompts (and what follows them) are wrong.
Mechanism: under FULL / FULL_DECODE_ONLY the dispatcher keys FULL graphs on uniform-decode batches, captured by
``_dummy_run`` with ``build_for_cudagraph_capture`` metadata: every row a spec decode, so the captured GDN
``_forward_core`` takes the spec branch (``fused_recurrent_gated_delta_rule`` from the state at
``spec_state_indices[i, num_accepted_tokens[i] - 1]``, states stored in place) and reads the builder's persistent
``spec_state_indices_tensor`` / ``spec_query_start_loc`` / ``num_accepted_tokens``. A new request whose whole prompt is
``1 + num_spec`` tokens has the decode shape, so ``_determine_batch_execution_and_padding`` dispatches FULL and the
graph replays. For that step the scheduler sent no draft tokens, so the builder sees a prefill (``num_prefills == 1``,
``has_initial_state`` False) and skips the persistent refresh: the replay runs the prompt from the state of the last
decode step's request, writes into that request's blocks, and leaves the new request's blocks uninitialised. An eager
step (or the fix) runs the prefill branch from a zero state and initialises the request's block.
Doctor: warmup-divergence, at _determine_batch_execution_and_padding. The capture decided the spec-decode branch of the
GDN core (continue from a cached state), the replay reuses it for a batch that the builder and an eager step treat as
a prefill (start from zero); the runner's classification is what sends that batch to the graph.
Fix (upstream): ``uniform_decode`` also requires ``is_all_decode`` (every request has ``num_computed_tokens > 0``) when
speculative decoding is on; the fresh prompt then runs eagerly (FULL_DECODE_ONLY has no graph for it).
Modelled: ``NPUModelRunner`` (persistent ``input_ids``, ``query_start_loc`` / ``gdn_query_start_loc``, ``seq_lens``,
``num_accepted_tokens``, ``num_decode_draft_tokens``, mamba block table; ``_update_states``, ``_prepare_inputs``,
``_determine_batch_execution_and_padding``, ``_pad_query_start_loc_for_fia``, ``_build_attention_metadata``,
``execute_model``, ``_dummy_run``, ``capture_model``), ``CudagraphDispatcher`` (FULL_DECODE_ONLY keys,
``_create_padded_batch_descriptor``, ``dispatch``), the forward context, ``ACLGraphWrapper`` (capture on the first FULL
call per batch descriptor, replay after; the warmup dummy runs folded into the capture call),
``GDNAttentionMetadataBuilder`` (``build`` with its spec / non-spec branches and both persistent-buffer refreshes,
``build_for_cudagraph_capture``), ``split_decodes_and_prefills``, ``Qwen3NextGatedDeltaNet._forward_core`` (the Ascend
patch's branch structure, causal conv left out).
Stand-ins: the model (embedding, one gated-delta-rule layer, LM head; no full-attention layers, which a spec-verify
graph computes like a prefill); the FLA kernels (torch, float64: the same recurrence token by token; the fused kernel's
indexed loads and stores written as masked blends); a scheduler with a FIFO mamba block queue (block 0 null, two
blocks per request), an MTP drafter stand-in (``draft = (last + 7) % 16``) and greedy rejection sampling; one
speculative token.
Workload: FULL_DECODE_ONLY graphs of 2 and 4 tokens (1 and 2 requests). Request A (3-token prompt, blocks 1, 2) prefills
eagerly and decodes three steps in the 2-token graph, then finishes; request B (2-token prompt = num_spec + 1, blocks
3, 4) arrives, prefills, decodes three steps. Compared: the target logits of every step (the last prompt token, or all
1 + num_spec tokens of a decode step).
Measured: bug: max |graph - eager| = 15.7. A's steps (0-3) equal eager exactly; B's prefill (step 4) replays the graph
from A's block 1 (stale indices [1, 2], num_accepted 1) and is off by 0.964 (greedy 11 instead of 2); B's decode steps
then start from its never-written block 3 and differ by 15.7, 10.4 and 0.44 (the wrong token also changes the inputs).
Fix: B's prefill runs eagerly, equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/6835"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_determine_batch_execution_and_padding"
SYMPTOM = ("MTP on a GDN hybrid model with FULL ACL graphs: a fresh prompt of exactly num_speculative_tokens + 1 "
           "tokens is classified as a uniform decode and replays the captured spec-decode graph, whose recurrent "
           "branch starts from a cached state instead of zero: wrong logits from the first token on (accuracy drop), "
           "no error")

HIDDEN, VOCAB = 8, 16
H = HV = 2                                   # key / value heads of the gated delta rule
K = V = 4                                    # head dims
NUM_SPECULATIVE_TOKENS = 1
UNIFORM_DECODE_QUERY_LEN = 1 + NUM_SPECULATIVE_TOKENS
MAX_NUM_REQS = 2
MAX_NUM_TOKENS = 16
CUDAGRAPH_CAPTURE_SIZES = [2, 4]             # tokens: 1 and 2 requests of 1 + num_spec tokens
CUDAGRAPH_NUM_OF_WARMUPS = 1
NUM_MAMBA_BLOCKS = 1 + MAX_NUM_REQS * UNIFORM_DECODE_QUERY_LEN   # block 0: the null block
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


class CUDAGraphMode:
    NONE, PIECEWISE, FULL = "NONE", "PIECEWISE", "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


# --- vllm/v1/cudagraph_dispatcher.py (reduced: FULL_DECODE_ONLY) -----------------------------------------------------

class CudagraphDispatcher:
    """FULL_DECODE_ONLY: FULL graphs for uniform decode batches only; everything else runs eagerly."""

    def __init__(self, cudagraph_mode):
        self.cudagraph_mode = cudagraph_mode
        self.uniform_decode_query_len = UNIFORM_DECODE_QUERY_LEN
        self.keys = set()
        if cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY:
            for n in CUDAGRAPH_CAPTURE_SIZES:
                self.keys.add(BatchDescriptor(n, n // UNIFORM_DECODE_QUERY_LEN, True))

    def _create_padded_batch_descriptor(self, num_tokens, uniform_decode):
        num_tokens_padded = next((s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens), num_tokens)
        if uniform_decode and self.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY:
            num_reqs = num_tokens_padded // self.uniform_decode_query_len
            assert num_tokens_padded % self.uniform_decode_query_len == 0
        else:
            uniform_decode, num_reqs = False, min(num_tokens_padded, MAX_NUM_REQS)
        return BatchDescriptor(num_tokens_padded, num_reqs, uniform_decode)

    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, disable_full=False):
        if self.cudagraph_mode == CUDAGraphMode.NONE or num_tokens > max(CUDAGRAPH_CAPTURE_SIZES):
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        batch_desc = self._create_padded_batch_descriptor(num_tokens, uniform_decode)
        if not disable_full and batch_desc in self.keys:
            return CUDAGraphMode.FULL, batch_desc
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)


# --- vllm/forward_context.py / vllm_ascend/ascend_forward_context.py (reduced) ---------------------------------------

@dataclasses.dataclass
class ForwardContext:
    attn_metadata: dict
    cudagraph_runtime_mode: str
    batch_descriptor: BatchDescriptor
    num_actual_tokens: int
    capturing: bool = False


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_ascend_forward_context(attn_metadata, num_tokens, aclgraph_runtime_mode, batch_descriptor, num_actual_tokens):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, aclgraph_runtime_mode, batch_descriptor, num_actual_tokens)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    return _forward_context


# --- vllm/v1/attention/backends/utils.py + gdn_attn.py (reduced) ---------------------------------------------------

@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor

    def compute_num_computed_tokens(self):
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])


def split_decodes_and_prefills(common_attn_metadata, decode_threshold=1):
    m = common_attn_metadata
    num_reqs, num_tokens = m.num_reqs, m.num_actual_tokens
    if m.max_query_len <= decode_threshold:
        return num_reqs, 0, num_tokens, 0
    query_lens = m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]
    if int(query_lens[0]) > decode_threshold:
        return 0, num_reqs, 0, num_tokens
    is_prefill = query_lens > decode_threshold
    first_prefill = int(is_prefill.int().argmax())
    num_decode_tokens = int(m.query_start_loc_cpu[first_prefill])
    return first_prefill, num_reqs - first_prefill, num_decode_tokens, num_tokens - num_decode_tokens


@dataclasses.dataclass
class GDNAttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_spec_decodes: int
    num_spec_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor | None = None
    spec_query_start_loc: torch.Tensor | None = None
    non_spec_query_start_loc: torch.Tensor | None = None
    non_spec_query_start_loc_cpu: torch.Tensor | None = None
    spec_state_indices_tensor: torch.Tensor | None = None
    non_spec_state_indices_tensor: torch.Tensor | None = None
    spec_sequence_masks: torch.Tensor | None = None
    spec_token_indx: torch.Tensor | None = None
    non_spec_token_indx: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None


class GDNAttentionMetadataBuilder:
    def __init__(self, device, use_full_cuda_graph):
        self.num_spec = NUM_SPECULATIVE_TOKENS
        self.use_spec_decode = self.num_spec > 0
        self.use_full_cuda_graph = use_full_cuda_graph
        self.decode_cudagraph_max_bs = min(MAX_NUM_REQS * (self.num_spec + 1), max(CUDAGRAPH_CAPTURE_SIZES))
        bs = self.decode_cudagraph_max_bs
        i32 = dict(dtype=torch.int32, device=device)
        self.spec_state_indices_tensor = torch.zeros((bs, self.num_spec + 1), **i32)
        self.non_spec_state_indices_tensor = torch.zeros((bs,), **i32)
        self.spec_sequence_masks = torch.zeros((bs,), dtype=torch.bool, device=device)
        self.spec_token_indx = torch.zeros((bs * (self.num_spec + 1),), **i32)
        self.non_spec_token_indx = torch.zeros((bs * (self.num_spec + 1),), **i32)
        self.spec_query_start_loc = torch.zeros((bs + 1,), **i32)
        self.non_spec_query_start_loc = torch.zeros((bs + 1,), **i32)
        self.num_accepted_tokens = torch.zeros((bs,), **i32)

    def persistent_buffers(self):
        return {"spec_state_indices_tensor": self.spec_state_indices_tensor,
                "non_spec_state_indices_tensor": self.non_spec_state_indices_tensor,
                "spec_sequence_masks": self.spec_sequence_masks, "spec_token_indx": self.spec_token_indx,
                "non_spec_token_indx": self.non_spec_token_indx, "spec_query_start_loc": self.spec_query_start_loc,
                "non_spec_query_start_loc": self.non_spec_query_start_loc,
                "num_accepted_tokens": self.num_accepted_tokens}

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None):
        m = common_attn_metadata
        query_start_loc, query_start_loc_cpu = m.query_start_loc, m.query_start_loc_cpu
        context_lens_tensor = m.compute_num_computed_tokens()
        block_table_tensor = m.block_table_tensor          # mamba_get_block_table_tensor, mamba_cache_mode "none"

        spec_sequence_masks_cpu = None
        if (not self.use_spec_decode or num_decode_draft_tokens_cpu is None
                or int(num_decode_draft_tokens_cpu[num_decode_draft_tokens_cpu >= 0].sum()) == 0):
            spec_sequence_masks, num_spec_decodes = None, 0
        else:
            spec_sequence_masks_cpu = num_decode_draft_tokens_cpu >= 0
            num_spec_decodes = int(spec_sequence_masks_cpu.sum())
            spec_sequence_masks = spec_sequence_masks_cpu.to(query_start_loc.device)

        if spec_sequence_masks is None:
            num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(m, 1)
            num_spec_decode_tokens = 0
            spec_token_indx = non_spec_token_indx = spec_state_indices_tensor = spec_query_start_loc = None
            non_spec_state_indices_tensor = block_table_tensor[:, 0]
            non_spec_query_start_loc, non_spec_query_start_loc_cpu = query_start_loc, query_start_loc_cpu
            num_accepted_tokens = None
        else:
            query_lens = query_start_loc[1:] - query_start_loc[:-1]
            query_lens_cpu = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
            non_spec_query_lens = query_lens[~spec_sequence_masks]
            num_decodes = int((non_spec_query_lens == 1).sum())
            num_zero_len = int((non_spec_query_lens == 0).sum())
            num_prefills = non_spec_query_lens.size(0) - num_decodes - num_zero_len
            num_decode_tokens = num_decodes
            num_prefill_tokens = int(non_spec_query_lens.sum()) - num_decode_tokens
            num_spec_decode_tokens = int(query_lens.sum()) - num_prefill_tokens - num_decode_tokens
            if num_prefills == 0 and num_decodes == 0:
                spec_token_size = min(num_spec_decodes * (self.num_spec + 1), int(query_start_loc[-1]))
                spec_token_indx = torch.arange(spec_token_size, dtype=torch.int32, device=query_start_loc.device)
                non_spec_token_indx = torch.empty(0, dtype=torch.int32, device=query_start_loc.device)
                spec_state_indices_tensor = block_table_tensor[spec_sequence_masks, :self.num_spec + 1]
                non_spec_state_indices_tensor = None
                spec_query_start_loc = query_start_loc[:num_spec_decodes + 1]
                non_spec_query_start_loc = non_spec_query_start_loc_cpu = None
            else:
                spec_token_masks = torch.repeat_interleave(spec_sequence_masks, query_lens.long())
                index = torch.argsort(spec_token_masks.int(), stable=True).to(torch.int32)
                num_non_spec_tokens = num_prefill_tokens + num_decode_tokens
                non_spec_token_indx, spec_token_indx = index[:num_non_spec_tokens], index[num_non_spec_tokens:]
                spec_state_indices_tensor = block_table_tensor[spec_sequence_masks, :self.num_spec + 1]
                non_spec_state_indices_tensor = block_table_tensor[~spec_sequence_masks, 0]
                spec_query_start_loc = torch.zeros(num_spec_decodes + 1, dtype=torch.int32, device=query_lens.device)
                spec_query_start_loc[1:] = torch.cumsum(query_lens[spec_sequence_masks], 0)
                non_spec_query_start_loc_cpu = torch.zeros(query_lens_cpu.size(0) - num_spec_decodes + 1,
                                                           dtype=torch.int32)
                non_spec_query_start_loc_cpu[1:] = torch.cumsum(query_lens_cpu[~spec_sequence_masks_cpu], 0)
                non_spec_query_start_loc = non_spec_query_start_loc_cpu.to(query_lens.device)
            num_accepted_tokens = num_accepted_tokens[spec_sequence_masks]

        if num_prefills > 0:
            has_initial_state = context_lens_tensor > 0
            if spec_sequence_masks is not None:
                has_initial_state = has_initial_state[~spec_sequence_masks]
        else:
            has_initial_state = None
        assert not (num_decodes > 0 and num_spec_decodes > 0)

        # Prepare tensors for cudagraph (m.num_actual_tokens is already padded by the model runner)
        batch_size = m.num_actual_tokens
        if (self.use_full_cuda_graph and num_prefills == 0 and num_decodes == 0
                and num_spec_decodes <= self.decode_cudagraph_max_bs
                and num_spec_decode_tokens <= self.decode_cudagraph_max_bs):
            self.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state_indices_tensor)
            spec_state_indices_tensor = self.spec_state_indices_tensor[:batch_size]
            spec_state_indices_tensor[num_spec_decodes:].fill_(PAD_SLOT_ID)
            self.spec_sequence_masks[:num_spec_decodes].copy_(spec_sequence_masks[:num_spec_decodes])
            spec_sequence_masks = self.spec_sequence_masks[:batch_size]
            spec_sequence_masks[num_spec_decodes:].fill_(False)
            self.non_spec_token_indx[:non_spec_token_indx.size(0)].copy_(non_spec_token_indx)
            non_spec_token_indx = self.non_spec_token_indx[:non_spec_token_indx.size(0)]
            self.spec_token_indx[:spec_token_indx.size(0)].copy_(spec_token_indx)
            spec_token_indx = self.spec_token_indx[:spec_token_indx.size(0)]
            self.spec_query_start_loc[:num_spec_decodes + 1].copy_(spec_query_start_loc)
            spec_num_query_tokens = spec_query_start_loc[-1]
            spec_query_start_loc = self.spec_query_start_loc[:batch_size + 1]
            spec_query_start_loc[num_spec_decodes + 1:].fill_(int(spec_num_query_tokens))
            self.num_accepted_tokens[:num_spec_decodes].copy_(num_accepted_tokens)
            num_accepted_tokens = self.num_accepted_tokens[:batch_size]
            num_accepted_tokens[num_spec_decodes:].fill_(1)

        if (self.use_full_cuda_graph and num_prefills == 0 and num_spec_decodes == 0
                and num_decodes <= self.decode_cudagraph_max_bs):
            self.non_spec_state_indices_tensor[:num_decodes].copy_(non_spec_state_indices_tensor)
            non_spec_state_indices_tensor = self.non_spec_state_indices_tensor[:batch_size]
            non_spec_state_indices_tensor[num_decodes:].fill_(PAD_SLOT_ID)
            self.non_spec_query_start_loc[:num_decodes + 1].copy_(non_spec_query_start_loc)
            non_spec_num_query_tokens = non_spec_query_start_loc[-1]
            non_spec_query_start_loc = self.non_spec_query_start_loc[:batch_size + 1]
            non_spec_query_start_loc[num_decodes + 1:].fill_(int(non_spec_num_query_tokens))

        return GDNAttentionMetadata(
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_spec_decodes=num_spec_decodes,
            num_spec_decode_tokens=num_spec_decode_tokens, num_actual_tokens=m.num_actual_tokens,
            has_initial_state=has_initial_state, spec_query_start_loc=spec_query_start_loc,
            non_spec_query_start_loc=non_spec_query_start_loc,
            non_spec_query_start_loc_cpu=non_spec_query_start_loc_cpu,
            spec_state_indices_tensor=spec_state_indices_tensor,
            non_spec_state_indices_tensor=non_spec_state_indices_tensor, spec_sequence_masks=spec_sequence_masks,
            spec_token_indx=spec_token_indx, non_spec_token_indx=non_spec_token_indx,
            num_accepted_tokens=num_accepted_tokens)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        m = common_attn_metadata
        assert m.num_reqs <= self.decode_cudagraph_max_bs and m.num_actual_tokens <= self.decode_cudagraph_max_bs
        num_accepted_tokens = torch.diff(m.query_start_loc)
        num_decode_draft_tokens_cpu = (num_accepted_tokens - 1).cpu()
        return self.build(0, m, num_accepted_tokens, num_decode_draft_tokens_cpu)


# --- the gated delta rule kernels (stand-ins for vllm's FLA ops, float64) --------------------------------------------

def _l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _gated_delta_step(h, q, k, v, g, beta):
    """One token per row: h [N, HV, V, K]; use_qk_l2norm_in_kernel, scale K ** -0.5."""
    q, k = _l2norm(q) * K ** -0.5, _l2norm(k)
    h = h * torch.exp(g)[..., None, None]
    v_new = (v - (h * k[:, :, None, :]).sum(-1)) * beta[..., None]
    h = h + v_new[..., None] * k[:, :, None, :]
    return h, (h * q[:, :, None, :]).sum(-1)


def _blend_rows(dst, index, valid, rows):
    """``dst[index[i]] = rows[i]`` for the valid rows (distinct indices), as a masked blend."""
    hit = (torch.arange(dst.shape[0], device=dst.device)[None, :] == index[:, None]) & valid[:, None]
    w = hit.to(dst.dtype)
    covered = w.sum(0).view((-1,) + (1,) * (dst.dim() - 1))
    return dst * (1 - covered) + torch.einsum("nd,n...->d...", w, rows)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, inplace_final_state, cu_seqlens,
                                     ssm_state_indices, num_accepted_tokens=None):
    """IS_CONTINUOUS_BATCHING: sequence i runs tokens [cu_seqlens[i], cu_seqlens[i + 1]) from the state at
    ``ssm_state_indices[i, num_accepted_tokens[i] - 1]`` (column 0 without spec decoding) and, in place, stores the
    state after its t-th token at ``ssm_state_indices[i, t]``; a PAD_SLOT_ID index skips the sequence."""
    n, num_tokens = cu_seqlens.shape[0] - 1, q.shape[0]
    idx = ssm_state_indices[:n].long()
    if idx.dim() == 1:
        idx = idx[:, None]
    if num_accepted_tokens is not None:
        i_t = num_accepted_tokens[:n].long() - 1
    else:
        i_t = torch.zeros(n, dtype=torch.long, device=q.device)
    state_idx = idx.gather(1, i_t[:, None])[:, 0]
    seq_ok = state_idx >= 0
    h = initial_state[state_idx.clamp(min=0)] * seq_ok[:, None, None, None].to(DTYPE)
    bos, lens = cu_seqlens[:n].long(), (cu_seqlens[1:n + 1] - cu_seqlens[:n]).long()
    out = torch.zeros(num_tokens, HV, V, dtype=q.dtype, device=q.device)
    for t in range(idx.shape[1]):
        active = seq_ok & (lens > t)
        tok = (bos + t).clamp(max=num_tokens - 1)
        h_new, o = _gated_delta_step(h, q[tok], k[tok], v[tok], g[tok], beta[tok])
        h = torch.where(active[:, None, None, None], h_new, h)
        out = _blend_rows(out, tok, active, o)
        if inplace_final_state:
            dst = idx[:, t]
            initial_state.copy_(_blend_rows(initial_state, dst.clamp(min=0), active & (dst >= 0), h))
    return out, initial_state


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens_cpu):
    """Prefill: the same recurrence token by token per sequence, from ``initial_state[i]``; returns the final states."""
    out = torch.zeros(q.shape[0], HV, V, dtype=q.dtype, device=q.device)
    final = initial_state.clone()
    for i in range(cu_seqlens_cpu.shape[0] - 1):
        h = initial_state[i:i + 1]
        for t in range(int(cu_seqlens_cpu[i]), int(cu_seqlens_cpu[i + 1])):
            h, o = _gated_delta_step(h, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
            out[t] = o[0]
        final[i] = h[0]
    return out, final


# --- the model (stand-in: Qwen3-Next reduced to one GatedDeltaNet layer, float64) ---------------------------------

class Qwen3NextGatedDeltaNet:
    prefix = "model.layers.0.linear_attn"

    def __init__(self, gen, device, ssm_state):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.wq, self.wk, self.wv = r(HIDDEN, H * K), r(HIDDEN, H * K), r(HIDDEN, HV * V)
        self.wa, self.wb, self.wo = r(HIDDEN, HV), r(HIDDEN, HV), r(HV * V, HIDDEN, scale=1.5)
        self.A_log, self.dt_bias = r(HV, scale=0.3), r(HV, scale=0.3)
        self.ssm_state = ssm_state                               # self.kv_cache[...][1]

    def forward(self, hidden_states):
        t = hidden_states.shape[0]
        q = (hidden_states @ self.wq).view(t, H, K)
        k = (hidden_states @ self.wk).view(t, H, K)
        v = (hidden_states @ self.wv).view(t, HV, V)
        g = -torch.exp(self.A_log) * torch.nn.functional.softplus(hidden_states @ self.wa + self.dt_bias)
        beta = torch.sigmoid(hidden_states @ self.wb)             # fused_gdn_gating
        core_attn_out = torch.zeros(t, HV, V, dtype=DTYPE, device=hidden_states.device)
        self._forward_core(q, k, v, g, beta, core_attn_out)
        return hidden_states + core_attn_out.reshape(t, HV * V) @ self.wo

    def _forward_core(self, q, k, v, g, beta, core_attn_out):
        """AscendQwen3Next_GatedDeltaNet._forward_core (patch_qwen3_next.py), the causal conv left out."""
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            return
        md = attn_metadata[self.prefix]
        ssm_state = self.ssm_state
        num_actual_tokens = md.num_actual_tokens
        q, k, v = q[:num_actual_tokens], k[:num_actual_tokens], v[:num_actual_tokens]
        g, beta = g[:num_actual_tokens], beta[:num_actual_tokens]
        spec = md.spec_sequence_masks is not None
        if spec and md.num_prefills == 0 and md.num_decodes == 0:
            parts_spec, parts_non_spec = (q, k, v, g, beta), None
        elif spec:
            parts_spec = tuple(x.index_select(0, md.spec_token_indx) for x in (q, k, v, g, beta))
            parts_non_spec = tuple(x.index_select(0, md.non_spec_token_indx) for x in (q, k, v, g, beta))
        else:
            parts_spec, parts_non_spec = None, (q, k, v, g, beta)

        # 2.1: the multi-query (spec decode) part: continue every sequence from its cached state
        core_attn_out_spec = core_attn_out_non_spec = None
        if spec:
            core_attn_out_spec, _ = fused_recurrent_gated_delta_rule(
                *parts_spec, initial_state=ssm_state, inplace_final_state=True,
                cu_seqlens=md.spec_query_start_loc[:md.num_spec_decodes + 1],
                ssm_state_indices=md.spec_state_indices_tensor, num_accepted_tokens=md.num_accepted_tokens)
        # 2.2: the remaining part: prefills from a zero state unless they have one
        if md.num_prefills > 0:
            initial_state = ssm_state[md.non_spec_state_indices_tensor.long()].clone()
            initial_state[~md.has_initial_state] = 0
            core_attn_out_non_spec, last_recurrent_state = chunk_gated_delta_rule(
                *parts_non_spec, initial_state=initial_state, cu_seqlens_cpu=md.non_spec_query_start_loc_cpu)
            ssm_state[md.non_spec_state_indices_tensor.long()] = last_recurrent_state        # Init cache
        elif md.num_decodes > 0:
            core_attn_out_non_spec, _ = fused_recurrent_gated_delta_rule(
                *parts_non_spec, initial_state=ssm_state, inplace_final_state=True,
                cu_seqlens=md.non_spec_query_start_loc[:md.num_decodes + 1],
                ssm_state_indices=md.non_spec_state_indices_tensor)

        # 3. Merge core attention output
        if spec and core_attn_out_non_spec is not None:
            merged = torch.zeros(num_actual_tokens, HV, V, dtype=DTYPE, device=q.device)
            merged.index_copy_(0, md.spec_token_indx.long(), core_attn_out_spec)
            merged.index_copy_(0, md.non_spec_token_indx.long(), core_attn_out_non_spec)
            core_attn_out[:num_actual_tokens] = merged
        elif spec:
            core_attn_out[:num_actual_tokens] = core_attn_out_spec
        else:
            core_attn_out[:num_actual_tokens] = core_attn_out_non_spec


class Qwen3NextForCausalLM:
    def __init__(self, device, ssm_state):
        gen = generator(6835)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.linear_attn = Qwen3NextGatedDeltaNet(gen, device, ssm_state)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).to(DTYPE)

    def __call__(self, input_ids):
        return self.linear_attn.forward(self.embed_tokens[input_ids])

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm_ascend/compilation/acl_graph.py (reduced) ------------------------------------------------------------------

class ACLGraphWrapper:
    """FULL graphs keyed by batch descriptor: captured on the first FULL call, replayed afterwards. (The runner's
    warmup dummy runs are folded into the capture call.)"""

    def __init__(self, runnable, runtime_mode, device, static, state):
        self.runnable, self.runtime_mode, self.device = runnable, runtime_mode, device
        self.static, self.state = static, state
        self.concrete_aclgraph_entries: dict[BatchDescriptor, tuple] = {}

    def __call__(self, input_ids):
        forward_context = get_forward_context()
        batch_descriptor = forward_context.batch_descriptor
        if (forward_context.cudagraph_runtime_mode == CUDAGraphMode.NONE
                or forward_context.cudagraph_runtime_mode != self.runtime_mode):
            return self.runnable(input_ids)
        entry = self.concrete_aclgraph_entries.get(batch_descriptor)
        if entry is None:
            forward_context.capturing = True
            entry = capture(lambda: self.runnable(input_ids), device=self.device, warmups=CUDAGRAPH_NUM_OF_WARMUPS,
                            name=f"FULL_DECODE_ONLY {batch_descriptor.num_tokens} tokens", owner="ACLGraphWrapper",
                            static=self.static, state=self.state)
            self.concrete_aclgraph_entries[batch_descriptor] = entry
            return entry[1]
        aclgraph, output = entry
        return replay(aclgraph, output, real=forward_context.num_actual_tokens, size=batch_descriptor.num_tokens)


# --- vllm_ascend/worker/model_runner_v1.py (reduced) ------------------------------------------------------------------

@dataclasses.dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]]
    token_ids: dict[str, list[int]]
    num_computed_tokens: dict[str, int]
    num_prompt_tokens: dict[str, int]
    block_ids: dict[str, list[int]]

    @property
    def total_num_scheduled_tokens(self):
        return sum(self.num_scheduled_tokens.values())


class InputBatch:
    def __init__(self):
        self.req_ids: list[str] = []
        self.num_computed_tokens_cpu = np.zeros(MAX_NUM_REQS, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(MAX_NUM_REQS, dtype=np.int32)
        self.num_accepted_tokens_cpu = np.ones(MAX_NUM_REQS, dtype=np.int32)
        self.block_table = np.zeros((MAX_NUM_REQS, UNIFORM_DECODE_QUERY_LEN), dtype=np.int32)

    @property
    def num_reqs(self):
        return len(self.req_ids)


class NPUModelRunner:
    def __init__(self, device, cudagraph_mode):
        self.device = device
        self.speculative_config = {"method": "qwen3_next_mtp", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
        self.uniform_decode_query_len = UNIFORM_DECODE_QUERY_LEN
        self.cudagraph_mode = cudagraph_mode
        self.cudagraph_dispatcher = CudagraphDispatcher(cudagraph_mode)
        self.input_batch = InputBatch()
        i32 = dict(dtype=torch.int32)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.query_start_loc_cpu = torch.zeros(MAX_NUM_TOKENS + 2, **i32)
        self.seq_lens_cpu = torch.zeros(MAX_NUM_TOKENS + 1, **i32)
        self.gdn_query_start_loc_cpu = torch.zeros(MAX_NUM_TOKENS + 2, **i32)
        self.num_accepted_tokens = torch.ones(MAX_NUM_TOKENS, **i32, device=device)   # (vLLM: the buffer's .gpu)
        self.num_decode_draft_tokens_cpu = torch.full((MAX_NUM_TOKENS,), -1, **i32)
        self.block_table = torch.zeros(MAX_NUM_TOKENS, UNIFORM_DECODE_QUERY_LEN, dtype=torch.int32, device=device)
        self.ssm_state = torch.zeros(NUM_MAMBA_BLOCKS, HV, V, K, dtype=DTYPE, device=device)
        self.model = Qwen3NextForCausalLM(device, self.ssm_state)
        self.gdn_builder = GDNAttentionMetadataBuilder(device, cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY)
        if cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY:
            self.model = ACLGraphWrapper(self.model, CUDAGraphMode.FULL, device,
                                         static={"input_ids": self.input_ids, **self.gdn_builder.persistent_buffers()},
                                         state={"ssm_state": self.ssm_state})
            self.capture_model()

    def get_model(self):
        return self.model.runnable if isinstance(self.model, ACLGraphWrapper) else self.model

    # - batch classification and graph dispatch ------------------------------------------------------------------

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, force_uniform_decode=None):
        num_tokens_padded = num_tokens
        if _variant == "bug":
            uniform_decode = (
                ((max_num_scheduled_tokens == self.uniform_decode_query_len)
                 and (num_tokens == max_num_scheduled_tokens * num_reqs))
                if force_uniform_decode is None else force_uniform_decode)
        else:
            is_all_decode = np.all(self.input_batch.num_computed_tokens_cpu[:num_reqs] > 0)
            uniform_decode = (
                ((is_all_decode if self.speculative_config else True)
                 and (max_num_scheduled_tokens == self.uniform_decode_query_len)
                 and (num_tokens == max_num_scheduled_tokens * num_reqs))
                if force_uniform_decode is None else force_uniform_decode)
        return self.cudagraph_dispatcher.dispatch(num_tokens=num_tokens_padded, uniform_decode=uniform_decode)

    def _pad_query_start_loc_for_fia(self, num_tokens_padded, num_reqs_padded, num_reqs):
        if num_tokens_padded == num_reqs_padded * self.uniform_decode_query_len:
            assert num_reqs <= num_reqs_padded
            last_loc = int(self.query_start_loc_cpu[num_reqs])
            self.query_start_loc_cpu[num_reqs + 1:num_reqs_padded + 1] = (
                torch.arange(1, num_reqs_padded + 1 - num_reqs, dtype=torch.int32) * self.uniform_decode_query_len
                + last_loc)
        else:
            assert num_reqs == num_reqs_padded
            self.query_start_loc_cpu[num_reqs_padded + 1] = num_tokens_padded
            num_reqs_padded = num_reqs_padded + 1
        return num_reqs_padded

    # - inputs and metadata ----------------------------------------------------------------------------------------

    def _update_states(self, scheduler_output):
        batch = self.input_batch
        batch.req_ids = list(scheduler_output.num_scheduled_tokens)
        for row, req_id in enumerate(batch.req_ids):
            batch.num_computed_tokens_cpu[row] = scheduler_output.num_computed_tokens[req_id]
            batch.num_prompt_tokens[row] = scheduler_output.num_prompt_tokens[req_id]
            batch.block_table[row] = scheduler_output.block_ids[req_id]

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        batch, num_reqs = self.input_batch, self.input_batch.num_reqs
        tokens = [t for req_id in batch.req_ids for t in scheduler_output.token_ids[req_id]]
        total = len(tokens)
        self.input_ids[:total].copy_(torch.tensor(tokens, dtype=torch.int64))
        cu_num_tokens = np.cumsum(num_scheduled_tokens)
        self.query_start_loc_cpu[0] = 0
        self.query_start_loc_cpu[1:num_reqs + 1] = torch.from_numpy(cu_num_tokens)
        self.query_start_loc_cpu[num_reqs + 1:].fill_(int(cu_num_tokens[-1]))
        self.gdn_query_start_loc_cpu.copy_(self.query_start_loc_cpu)   # the unpadded copy kept for GDN
        self.seq_lens_cpu[:num_reqs] = torch.from_numpy(batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled_tokens)
        self.seq_lens_cpu[num_reqs:].fill_(0)
        self.block_table[:num_reqs].copy_(torch.from_numpy(batch.block_table[:num_reqs]))
        if not scheduler_output.scheduled_spec_decode_tokens:
            logits_indices = self.query_start_loc_cpu[1:num_reqs + 1].long() - 1
        else:
            num_decode_draft_tokens = np.full(num_reqs, -1, dtype=np.int32)
            logits_indices = []
            for row, req_id in enumerate(batch.req_ids):
                drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
                if drafts:
                    decoding = batch.num_computed_tokens_cpu[row] >= batch.num_prompt_tokens[row]
                    num_decode_draft_tokens[row] = len(drafts) if decoding else -1
                end = int(cu_num_tokens[row])
                logits_indices += list(range(end - len(drafts) - 1, end))
            logits_indices = torch.tensor(logits_indices)
            self.num_decode_draft_tokens_cpu[:num_reqs] = torch.from_numpy(num_decode_draft_tokens)
            self.num_decode_draft_tokens_cpu[num_reqs:].fill_(-1)
        return logits_indices, total

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, num_tokens_padded, num_reqs_padded,
                                  use_spec_decode=False, for_cudagraph_capture=False):
        if use_spec_decode:
            self.num_accepted_tokens[:num_reqs] = torch.from_numpy(self.input_batch.num_accepted_tokens_cpu[:num_reqs])
            self.num_accepted_tokens[num_reqs:].fill_(1)
        qsl_cpu = self.query_start_loc_cpu[:num_reqs_padded + 1].clone()
        if use_spec_decode:                                           # GDN needs the unpadded query_start_loc
            qsl_cpu = self.gdn_query_start_loc_cpu[:num_reqs_padded + 1].clone()
        cm = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(self.device), query_start_loc_cpu=qsl_cpu,
            seq_lens=self.seq_lens_cpu[:num_reqs_padded].to(self.device), num_reqs=num_reqs_padded,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len, block_table_tensor=self.block_table[:num_reqs_padded])
        if for_cudagraph_capture:
            md = self.gdn_builder.build_for_cudagraph_capture(cm)
        elif use_spec_decode:
            md = self.gdn_builder.build(0, cm, num_accepted_tokens=self.num_accepted_tokens[:num_reqs_padded],
                                        num_decode_draft_tokens_cpu=self.num_decode_draft_tokens_cpu[:num_reqs_padded])
        else:
            md = self.gdn_builder.build(0, cm)
        return {Qwen3NextGatedDeltaNet.prefix: md}

    # - steps ------------------------------------------------------------------------------------------------------

    def execute_model(self, scheduler_output):
        self._update_states(scheduler_output)
        num_reqs = self.input_batch.num_reqs
        num_scheduled_tokens_np = np.array([scheduler_output.num_scheduled_tokens[r] for r in self.input_batch.req_ids],
                                           dtype=np.int32)
        logits_indices, num_tokens_unpadded = self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)
        cudagraph_mode, batch_desc = self._determine_batch_execution_and_padding(
            num_tokens=num_tokens_unpadded, num_reqs=num_reqs, num_scheduled_tokens_np=num_scheduled_tokens_np,
            max_num_scheduled_tokens=int(num_scheduled_tokens_np.max()))
        num_tokens_padded = batch_desc.num_tokens
        num_reqs_padded = batch_desc.num_reqs if batch_desc.num_reqs is not None else num_reqs
        if cudagraph_mode == CUDAGraphMode.FULL:
            num_reqs_padded = self._pad_query_start_loc_for_fia(num_tokens_padded, num_reqs_padded, num_reqs)
        use_spec_decode = len(scheduler_output.scheduled_spec_decode_tokens) > 0
        attn_metadata = self._build_attention_metadata(
            num_tokens_unpadded, num_reqs, int(num_scheduled_tokens_np.max()), num_tokens_padded, num_reqs_padded,
            use_spec_decode=use_spec_decode)
        with set_ascend_forward_context(attn_metadata, num_tokens_padded, cudagraph_mode, batch_desc,
                                        num_tokens_unpadded):
            hidden_states = self.model(self.input_ids[:num_tokens_padded])
        return self.get_model().compute_logits(hidden_states[logits_indices]).clone()

    def _dummy_run(self, num_tokens, cudagraph_runtime_mode, uniform_decode):
        num_reqs = num_tokens // self.uniform_decode_query_len
        mode, batch_desc = self._determine_batch_execution_and_padding(
            num_tokens=num_tokens, num_reqs=num_reqs, num_scheduled_tokens_np=None,
            max_num_scheduled_tokens=self.uniform_decode_query_len, force_uniform_decode=uniform_decode)
        assert mode == cudagraph_runtime_mode
        num_reqs_padded = batch_desc.num_reqs
        seq_lens = np.full(num_reqs_padded, self.uniform_decode_query_len, dtype=np.int32)
        self.seq_lens_cpu[:num_reqs_padded] = torch.from_numpy(seq_lens)
        self.seq_lens_cpu[num_reqs_padded:].fill_(0)
        self.query_start_loc_cpu[:num_reqs_padded + 1] = (torch.arange(num_reqs_padded + 1)
                                                          * self.uniform_decode_query_len)
        self.gdn_query_start_loc_cpu.copy_(self.query_start_loc_cpu)
        num_reqs_padded = self._pad_query_start_loc_for_fia(batch_desc.num_tokens, num_reqs_padded, num_reqs)
        attn_metadata = self._build_attention_metadata(
            num_tokens, num_reqs, self.uniform_decode_query_len, batch_desc.num_tokens, num_reqs_padded,
            for_cudagraph_capture=True)
        with set_ascend_forward_context(attn_metadata, batch_desc.num_tokens, cudagraph_runtime_mode, batch_desc,
                                        num_tokens):
            self.model(self.input_ids[:batch_desc.num_tokens])

    def capture_model(self):
        for num_tokens in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(num_tokens, CUDAGraphMode.FULL, uniform_decode=True)


# --- the engine side (stand-ins: scheduler, MTP drafter, greedy rejection sampler) -----------------------------------

class Scheduler:
    """Schedules whole prompts, then 1 + num_spec tokens per decode step; mamba blocks from a FIFO free queue."""

    def __init__(self):
        self.free_block_queue = list(range(1, NUM_MAMBA_BLOCKS))
        self.requests: dict[str, dict] = {}

    def add_request(self, req_id, prompt, max_decode_steps):
        blocks = [self.free_block_queue.pop(0) for _ in range(UNIFORM_DECODE_QUERY_LEN)]
        self.requests[req_id] = {"prompt": list(prompt), "num_computed_tokens": 0, "blocks": blocks,
                                 "last_token": None, "draft": [], "decode_steps_left": max_decode_steps}

    def schedule(self):
        out = SchedulerOutput({}, {}, {}, {}, {}, {})
        for req_id, req in self.requests.items():
            prefill = req["num_computed_tokens"] < len(req["prompt"])
            tokens = req["prompt"] if prefill else [req["last_token"]] + req["draft"]
            out.num_scheduled_tokens[req_id] = len(tokens)
            out.token_ids[req_id] = tokens
            if not prefill:
                out.scheduled_spec_decode_tokens[req_id] = list(req["draft"])
            out.num_computed_tokens[req_id] = req["num_computed_tokens"]
            out.num_prompt_tokens[req_id] = len(req["prompt"])
            out.block_ids[req_id] = req["blocks"]
        return out

    @staticmethod
    def propose_draft_token_ids(last_token):
        return [(last_token + 7) % VOCAB]                       # stand-in for the MTP proposer

    def update_from_output(self, scheduler_output, logits, runner):
        row0 = 0
        for row, req_id in enumerate(scheduler_output.num_scheduled_tokens):
            req = self.requests[req_id]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            target = [int(t) for t in logits[row0:row0 + len(drafts) + 1].argmax(-1)]
            row0 += len(drafts) + 1
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            output = target[:accepted + 1]                      # greedy rejection sampling
            if drafts:
                req["num_computed_tokens"] += len(output)
                req["decode_steps_left"] -= 1
            else:
                req["num_computed_tokens"] += scheduler_output.num_scheduled_tokens[req_id]
            runner.input_batch.num_accepted_tokens_cpu[row] = len(output)
            req["last_token"], req["draft"] = output[-1], self.propose_draft_token_ids(output[-1])
        for req_id in [r for r, q in self.requests.items() if q["decode_steps_left"] == 0]:
            self.free_block_queue += self.requests.pop(req_id)["blocks"]


def _serve(device, cudagraph_mode):
    runner = NPUModelRunner(device, cudagraph_mode)
    scheduler = Scheduler()
    arrivals = {0: [("A", [5, 9, 2], 3)], 4: [("B", [7, 1], 3)]}     # B: a prompt of num_spec + 1 tokens
    outs = []
    for step in range(8):
        for req_id, prompt, steps in arrivals.get(step, []):
            scheduler.add_request(req_id, prompt, steps)
            runner.input_batch.num_accepted_tokens_cpu[len(scheduler.requests) - 1] = 1
        scheduler_output = scheduler.schedule()
        logits = runner.execute_model(scheduler_output)
        outs.append(logits)
        scheduler.update_from_output(scheduler_output, logits, runner)
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, CUDAGraphMode.FULL_DECODE_ONLY),
                       lambda: _serve(device, CUDAGraphMode.NONE))
