"""Flash-V100 FULL decode graph: ``active_num_partitions.fill_()`` records the capture's partition count, so replays attend to only the first KV partitions.

Upstream: https://github.com/1CatAI/1Cat-vLLM/commit/e64d39aa7ee170a44dcdd3789e480d9aa24140ea ("[Core] Stabilize
SM70 Qwen MTP paths", June 2026; audit entry 405 "Flash-V100 decode dynamic-partition quality root cause and planner
fix"; PR #69 cites it for wrong Higgs-Audio TTS output under the graph).
Symptom: Qwen3.6-35B-A3B-AWQ on V100 (FLASH_ATTN_V100, FULL decode graph) answered the first prompt, then later turns
drifted into "severe repetition and stale story content"; ``VLLM_FLASH_V100_DECODE_DYNAMIC_PARTITIONS=0`` cured it.
Op-level A/B (capture seq 257, replay seq 4097, workspace 8192): ``max_diff=0.233`` before, 0.0 after.
Mechanism: ``flash_attn_decode_paged()`` plans on the host: ``_get_decode_plan()`` turns ``max_seq_len_hint`` (the
step's longest sequence) into ``plan.actual_num_partitions``; ``_get_decode_workspace_for_plan()`` writes it into the
cached workspace's device scalar: ``workspace.active_num_partitions.fill_(plan.actual_num_partitions)``, which the paged
decode / reduce kernels read to skip KV partitions beyond the sequence. Under FULL decode graph capture that ``fill_``
is recorded with the capture-time Python int (the short dummy length: 2 partitions here); replays never re-plan, so each
re-writes 2 and the reduce drops every later partition: the first turn is right, longer contexts silently lose their
newer KV. Eager steps plan (and fill) for their own length.
Doctor: host-work-frozen, at ``_get_decode_workspace_for_plan`` (the ``fill_`` of a host-planned Python int runs inside
the captured region; replays repeat it with the capture-time partition count; eager fills the step's).
Fix (upstream): the fill leaves the op: the builder owns a persistent int32 scalar (``_ensure_decode_active_num_
partitions``) that ``_update_decode_active_num_partitions`` fills with ``ceil(max_seq_len_hint / partition_size)`` in
``build()`` / ``build_for_cudagraph_capture()``, outside the graph, every step; the op takes it as
``active_num_partitions`` and fills its own only when none is given (``_get_decode_plan`` also promotes a capture
without one to the whole workspace envelope, ``_cuda_graph_capture_active()``).
Modelled: the op-level A/B of the audit entry: the workspace / launch envelope is the graph's (the companion
``_attach_decode_shape_hints`` hunk, which sized it from ``common_attn_metadata.max_seq_len``, is applied in both
variants), so only the frozen scalar differs. KV of the context is pre-filled; fp32 instead of fp16.
"""
from __future__ import annotations

import collections

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/1CatAI/1Cat-vLLM/commit/e64d39aa7ee170a44dcdd3789e480d9aa24140ea"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_get_decode_workspace_for_plan"
SYMPTOM = "Flash-V100 FULL decode graph: replays reduce only the capture-time count of KV partitions (long-turn drift)"

NUM_HEADS, HEAD_DIM = 2, 4
HIDDEN = NUM_HEADS * HEAD_DIM
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 4, 6, 16
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS          # the graph's envelope: 24 tokens
PARTITION_SIZE = 4                               # upstream default 256
MAX_NUM_SEQS = 2
CAPTURE_SEQ_LEN = 5                              # the dummy capture's decode length: 2 partitions


_DecodePlan = collections.namedtuple(
    "_DecodePlan", "partition_size actual_num_partitions launch_num_partitions workspace_num_partitions")
_DecodeWorkspace = collections.namedtuple(
    "_DecodeWorkspace", "tmp_out max_logits exp_sums active_num_partitions max_num_partitions")
_decode_workspace_cache: dict = {}


def _cuda_graph_capture_active() -> bool:
    return bool(torch.cuda.is_current_stream_capturing())


def _get_decode_plan(q, k_cache, block_table, *, max_seq_len_hint, workspace_seq_capacity_hint,
                     active_num_partitions, variant):
    max_seq_capacity = block_table.shape[1] * k_cache.shape[1]
    effective_max_seq_len = max(1, int(max_seq_len_hint or max_seq_capacity))
    effective_workspace_seq_capacity = max(1, int(workspace_seq_capacity_hint or effective_max_seq_len),
                                           effective_max_seq_len)
    if (variant == "fix" and workspace_seq_capacity_hint is not None and active_num_partitions is None
            and _cuda_graph_capture_active()):
        # replay replays the captured fill_: capture the whole workspace envelope instead of a short hint
        effective_max_seq_len = max(effective_max_seq_len, effective_workspace_seq_capacity)
    ps = PARTITION_SIZE
    runtime_num_partitions = max(1, (effective_max_seq_len + ps - 1) // ps)
    workspace_num_partitions = max(1, (effective_workspace_seq_capacity + ps - 1) // ps)
    return _DecodePlan(ps, runtime_num_partitions,
                       workspace_num_partitions if workspace_seq_capacity_hint is not None else runtime_num_partitions,
                       workspace_num_partitions)


def _get_decode_workspace_for_plan(q, *, batch_capacity, plan, active_num_partitions=None):
    key = (str(q.device), batch_capacity, plan.partition_size)
    workspace = _decode_workspace_cache.get(key)
    if workspace is None or workspace.max_num_partitions < plan.workspace_num_partitions:
        n = 1 << (plan.workspace_num_partitions - 1).bit_length()     # _round_decode_partition_capacity
        workspace = _DecodeWorkspace(  # tmp_out, max_logits, exp_sums, active_num_partitions
            torch.empty(batch_capacity, NUM_HEADS, n, HEAD_DIM, device=q.device),
            *torch.empty(2, batch_capacity, NUM_HEADS, n, device=q.device),
            torch.empty(1, dtype=torch.int32, device=q.device), n)
        _decode_workspace_cache[key] = workspace
    if active_num_partitions is None:      # before the fix: always, no caller could pass one
        workspace.active_num_partitions.fill_(plan.actual_num_partitions)
        active_num_partitions = workspace.active_num_partitions
    return workspace.tmp_out, workspace.max_logits, workspace.exp_sums, active_num_partitions


def decode_paged_fwd(q, k_cache, v_cache, out, block_table, seq_lens, tmp_out, max_logits, exp_sums,
                     active_num_partitions, softmax_scale, partition_size, launch_num_partitions):
    """Partitioned paged decode, then the reduce over partitions ``< active_num_partitions`` (a device scalar)."""
    b, n_part, ps = q.shape[0], launch_num_partitions, partition_size
    t = torch.arange(n_part * ps, device=q.device)
    slots = block_table[:, t // BLOCK_SIZE].long() * BLOCK_SIZE + t % BLOCK_SIZE
    k = k_cache.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    v = v_cache.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("bhd,bthd->bht", q, k) * softmax_scale
    scores = scores.masked_fill((t[None, :] >= seq_lens[:, None].long())[:, None, :], -1e30).view(b, NUM_HEADS,
                                                                                                   n_part, ps)
    m = scores.amax(-1)
    p = torch.exp(scores - m[..., None])
    max_logits[:b, :, :n_part].copy_(m)
    exp_sums[:b, :, :n_part].copy_(p.sum(-1))
    tmp_out[:b, :, :n_part].copy_(torch.einsum("bhpt,bpthd->bhpd", p, v.view(b, n_part, ps, NUM_HEADS, HEAD_DIM))
                                  / exp_sums[:b, :, :n_part, None])
    active = torch.arange(n_part, device=q.device) < active_num_partitions.long()
    m = max_logits[:b, :, :n_part].masked_fill(~active, -1e30)
    w = exp_sums[:b, :, :n_part] * torch.exp(m - m.amax(-1, keepdim=True))
    out.copy_((w[..., None] * tmp_out[:b, :, :n_part]).sum(2) / w.sum(-1)[..., None])
    return out


def flash_attn_decode_paged(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale, out, max_seq_len_hint=None,
                            workspace_seq_capacity_hint=None, active_num_partitions=None, variant="bug"):
    plan = _get_decode_plan(q, k_cache, block_table, max_seq_len_hint=max_seq_len_hint,
                            workspace_seq_capacity_hint=workspace_seq_capacity_hint,
                            active_num_partitions=active_num_partitions, variant=variant)
    tmp_out, max_logits, exp_sums, active_num_partitions = _get_decode_workspace_for_plan(
        q, batch_capacity=q.shape[0], plan=plan, active_num_partitions=active_num_partitions)
    return decode_paged_fwd(q, k_cache, v_cache, out, block_table, seq_lens, tmp_out, max_logits, exp_sums,
                            active_num_partitions, softmax_scale, plan.partition_size, plan.launch_num_partitions)


CommonAttentionMetadata = collections.namedtuple(
    "CommonAttentionMetadata", "seq_lens seq_lens_cpu block_table_tensor max_seq_len")

class TritonAttentionMetadata:
    def __init__(self, common):
        self.block_table, self.seq_lens, self.seq_lens_cpu = (common.block_table_tensor, common.seq_lens,
                                                              common.seq_lens_cpu)
        self.flash_v100_decode_active_num_partitions = None


class FlashAttnV100MetadataBuilder:
    def __init__(self, device, variant):
        self.device, self.variant, self._decode_active_num_partitions = device, variant, None

    def _attach_decode_shape_hints(self, attn_metadata, common_attn_metadata, *, static_decode=False):
        max_seq_len_hint = int(attn_metadata.seq_lens_cpu.max())
        attn_metadata.flash_v100_decode_max_seq_len_hint = max_seq_len_hint
        attn_metadata.flash_v100_decode_workspace_seq_capacity_hint = None
        if static_decode:
            raw_seq_capacity = common_attn_metadata.block_table_tensor.shape[1] * BLOCK_SIZE
            attn_metadata.flash_v100_decode_workspace_seq_capacity_hint = min(
                raw_seq_capacity, max(max_seq_len_hint, common_attn_metadata.max_seq_len))

    def _ensure_decode_active_num_partitions(self):
        if self._decode_active_num_partitions is None:
            self._decode_active_num_partitions = torch.empty((1,), dtype=torch.int32, device=self.device)
        return self._decode_active_num_partitions

    def _update_decode_active_num_partitions(self, attn_metadata):
        attn_metadata.flash_v100_decode_active_num_partitions = None
        if (attn_metadata.flash_v100_decode_workspace_seq_capacity_hint is None
                and self._decode_active_num_partitions is None):
            return
        active = max(1, (attn_metadata.flash_v100_decode_max_seq_len_hint + PARTITION_SIZE - 1) // PARTITION_SIZE)
        active_num_partitions = self._ensure_decode_active_num_partitions()
        active_num_partitions.fill_(active)
        attn_metadata.flash_v100_decode_active_num_partitions = active_num_partitions

    def build_for_cudagraph_capture(self, common_attn_metadata):
        attn_metadata = TritonAttentionMetadata(common_attn_metadata)
        self._attach_decode_shape_hints(attn_metadata, common_attn_metadata, static_decode=True)
        if self.variant == "fix":
            self._update_decode_active_num_partitions(attn_metadata)
        return attn_metadata

    def build(self, common_prefix_len, common_attn_metadata):
        attn_metadata = TritonAttentionMetadata(common_attn_metadata)
        self._attach_decode_shape_hints(attn_metadata, common_attn_metadata)
        if self.variant == "fix":
            self._update_decode_active_num_partitions(attn_metadata)
        return attn_metadata


class GPUModelRunner:
    """One decoder layer whose attention is the Flash-V100 paged decode; a FULL graph for the q=1 decode batch."""

    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        gen = generator(64)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.key_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, gen=gen, device=device, scale=1.5)
        self.value_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, gen=gen, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_SEQS, HIDDEN, device=device)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device)
        self.attn_out = torch.zeros(MAX_NUM_SEQS, NUM_HEADS, HEAD_DIM, device=device)
        self.builder = FlashAttnV100MetadataBuilder(device, variant)
        self.graph = None
        _decode_workspace_cache.clear()

    def _prepare_inputs(self, seq_lens, block_ids):
        self.block_table.copy_(torch.tensor(block_ids, dtype=torch.int32))
        self.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        return CommonAttentionMetadata(self.seq_lens, torch.tensor(seq_lens), self.block_table, MAX_MODEL_LEN)

    def forward(self, attn_metadata):
        q = (self.hidden_states @ self.wq).view(-1, NUM_HEADS, HEAD_DIM)
        flash_attn_decode_paged(
            q, self.key_cache, self.value_cache, attn_metadata.block_table, attn_metadata.seq_lens,
            softmax_scale=HEAD_DIM ** -0.5, out=self.attn_out,
            max_seq_len_hint=attn_metadata.flash_v100_decode_max_seq_len_hint,
            workspace_seq_capacity_hint=attn_metadata.flash_v100_decode_workspace_seq_capacity_hint,
            active_num_partitions=attn_metadata.flash_v100_decode_active_num_partitions, variant=self.variant)
        return self.hidden_states + self.attn_out.reshape(-1, HIDDEN) @ self.wo

    def capture_model(self):
        common = self._prepare_inputs([CAPTURE_SEQ_LEN] * MAX_NUM_SEQS, [[0] * MAX_BLOCKS] * MAX_NUM_SEQS)
        attn_metadata = self.builder.build_for_cudagraph_capture(common)
        static = {"hidden_states": self.hidden_states, "block_table": self.block_table, "seq_lens": self.seq_lens,
                  **({} if attn_metadata.flash_v100_decode_active_num_partitions is None else
                     {"decode_active_num_partitions": attn_metadata.flash_v100_decode_active_num_partitions})}
        self.graph = capture(lambda: self.forward(attn_metadata), device=self.device, name=f"decode {MAX_NUM_SEQS}",
                             owner="CUDAGraphWrapper (FULL decode, FLASH_ATTN_V100)", static=static,
                             state={"key_cache": self.key_cache, "value_cache": self.value_cache})

    def execute_model(self, hidden, seq_lens, block_ids):
        common = self._prepare_inputs(seq_lens, block_ids)
        self.hidden_states.copy_(hidden)
        attn_metadata = self.builder.build(0, common)
        if self.graph is None:
            return self.forward(attn_metadata).clone()
        g, out = self.graph
        return replay(g, out).clone()


BLOCK_IDS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
STEPS = [[5, 7], [11, 6], [19, 14], [24, 9]]     # decode lengths per step: 2, 3, 5, 6 partitions


def run(variant: str, device: str = "cpu"):
    gen = generator(6405)
    hiddens = [randn(MAX_NUM_SEQS, HIDDEN, gen=gen, device=device) for _ in STEPS]

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant)
        if graphed:
            runner.capture_model()
        return [runner.execute_model(h, lens, BLOCK_IDS) for h, lens in zip(hiddens, STEPS)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
