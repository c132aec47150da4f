"""Hybrid sliding-window model on FULL ACL graphs: the replay-time FIA update rebinds each task to another KV group's block table.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/8508 ("[BugFix] Fix sliding window attention computation and
improve throughput", commit ac357ed4bb, opened 2026-04-21, merged 2026-05-15).
Symptom: as reported, "Output corruption in full-graph replay path: Rebinding `block_tables` to the latest metadata
tensor causes corrupted/garbled outputs on Ascend NPU for SWA models" (corrupted / repeated text); eager mode is fine.
Mechanism: in FULL graph decode ``AscendAttentionBackendImpl.full_graph_fia`` (``vllm_ascend/attention/attention_v1.py``)
captures each attention layer's ``npu_fused_infer_attention_score`` as a task group and appends its arguments, among
them ``weak_ref_tensors(block_table)`` (the layer's own KV-cache group's table, a view of that group's persistent
``input_batch.block_table[gid]`` buffer, refreshed in place every step), to ``graph_params.attn_params[num_tokens]``,
in forward (layer) order. Before every replay ``update_graph_params`` re-launches every task
(``graph_task_update_begin`` / ``.out`` / ``graph_task_update_end``), pairing tasks with layers by
``zip(attn_keys, graph_params.attn_params[num_tokens], handles, events)`` with ``attn_keys =
list(forward_context.attn_metadata.keys())``, and it rebinds ``block_tables = attn_metadata[key].block_tables``.
``NPUModelRunner._build_attention_metadata`` fills that dict KV-cache-group by KV-cache-group, and a hybrid
sliding-window model (Gemma-2/3 style: sliding and full layers interleaved) has one group per attention type, so the
dict's key order is not the layer order: the task of a full-attention layer is paired with a sliding layer's key
(and vice versa) and is re-launched with the other group's block table. The lengths rebound at the same time
(``seq_lens_list``, ``actual_seq_lengths_q``) are the same for every group, so the block table is the only argument
that goes wrong: the layer reads the other group's block ids, i.e. pages of the layer sharing its KV tensor, or the
null block the sliding-window manager put in place of blocks that left the window. Eager layers read
``forward_context.attn_metadata[layer_name]`` and capture never runs the update: only replays are wrong. (Upstream
states no root cause, only "in our repro"; the pairing mismatch is read from the code around the hunk.)
Doctor: warmup-divergence, at ``update_graph_params`` (the capture recorded the layers' FIA tasks, in forward order,
with their own block tables; every replay's update re-binds those tasks positionally to the metadata of the step's
dict, so a replayed layer attends through another layer's block table while the eager step uses its own).
Fix (upstream): in ``update_graph_params`` the target-model branch rebinds ``block_tables`` only when
``vllm_config.model_config.hf_text_config`` has no ``sliding_window``; SWA models keep the captured
``block_tables`` (the layer's own, refreshed in place). The rest of the PR (``sparse_mode=4`` with
``pre_tokens=sliding_window`` / ``next_tokens=0``, carried through the captured params; removing
``_forward_fia_slidingwindow``) is a kernel-parameter fix that is not graph related: it is applied in both variants
and in eager mode here, so only the block-table rebind differs between the variants.
Modelled: 4 layers (sliding 0, 2; full 1, 3), 2 KV-cache groups (sliding [0, 2], full [1, 3]); layers at the same
position of their groups share a KV tensor (``KVCacheTensor.shared_by``) and the groups draw their block ids from the
one pool; the sliding group's table holds the null block 0 for blocks wholly out of the window. FULL_DECODE_ONLY graph
for 2 requests x 1 token. K/V of every position are written before the steps, identically in both modes
(``reshape_and_cache`` not modelled); the FIA kernel is dense decode attention over the paged cache with the
``sparse_mode=4`` band. A captured task's launch arguments are modelled, as in earlier trials, as per-task buffers
that ``graph_task_update`` rewrites. Weak references are kept as strong ones.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/8508"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "update_graph_params"
SYMPTOM = ("hybrid SWA model, FULL ACL graph decode: the replay update pairs tasks with layers by dict order and "
           "rebinds each to another KV group's block table; garbled output")

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 4, 2, 4
HIDDEN = NUM_HEADS * HEAD_DIM
SLIDING_WINDOW = 3                     # hf_text_config.sliding_window
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 2, 4, 20
MAX_CTX = BLOCK_SIZE * MAX_BLOCKS
NULL_BLOCK = 0                         # the block pool's null block
BATCH = 2                              # the captured FULL_DECODE_ONLY size (2 requests x 1 token)
SWA_INT_MAX = 2 ** 31 - 1
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
IS_SLIDING = [i % 2 == 0 for i in range(NUM_LAYERS)]   # Gemma-2 style: even layers sliding, odd layers global


class _ExtraCtx:
    capturing = False


_EXTRA_CTX = _ExtraCtx()


# --- vllm/v1/core/kv_cache_utils.py: one KV-cache group per attention type (uniform page size) ----------------

class KVCacheGroupSpec:
    def __init__(self, layer_names, sliding_window):
        self.layer_names, self.sliding_window = layer_names, sliding_window


def get_kv_cache_groups():
    sliding = [n for n, s in zip(LAYER_NAMES, IS_SLIDING) if s]
    full = [n for n, s in zip(LAYER_NAMES, IS_SLIDING) if not s]
    return [KVCacheGroupSpec(sliding, SLIDING_WINDOW), KVCacheGroupSpec(full, None)]


# --- vllm_ascend/attention/attention_v1.py --------------------------------------------------------------------

class AscendMetadata:
    def __init__(self, block_tables, seq_lens_list):
        self.block_tables, self.seq_lens_list = block_tables, list(seq_lens_list)
        self.actual_seq_lengths_q = list(range(1, len(seq_lens_list) + 1))
        self.causal = True


def npu_fused_infer_attention_score(query, key, value, *, block_table, actual_seq_lengths_kv, sparse_mode,
                                    pre_tokens, next_tokens, scale):
    """FIA, TND decode (one query per request at position seq_len - 1) over a paged cache. sparse_mode 4 is the band
    ``q_pos - pre_tokens <= k_pos <= q_pos + next_tokens``; sparse_mode 3 is causal."""
    t = torch.arange(MAX_CTX, device=query.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE              # [B, T]
    k = key.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    v = value.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    q_pos = actual_seq_lengths_kv[:, None] - 1
    hidden = t[None, :] > q_pos
    if sparse_mode == 4:
        hidden = hidden | (t[None, :] < q_pos - pre_tokens) | (t[None, :] > q_pos + next_tokens)
    scores = torch.einsum("bnd,btnd->bnt", query, k) * scale
    p = torch.softmax(scores.masked_fill(hidden[:, None, :], -1e9), -1)
    return torch.einsum("bnt,btnd->bnd", p, v)


class FIATask:
    """A captured FIA task group: the launch arguments that ``graph_task_update`` rewrites before a replay."""

    def __init__(self, device):
        self.block_table = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)
        self.actual_seq_lengths_kv = torch.ones(BATCH, dtype=torch.long, device=device)

    def rebind(self, block_table, actual_seq_lengths_kv):
        """``graph_task_update_begin`` / the ``.out`` launch with these arguments / ``graph_task_update_end``."""
        self.block_table.copy_(block_table)
        self.actual_seq_lengths_kv.copy_(torch.tensor(actual_seq_lengths_kv, device=self.block_table.device))


class GraphParams:
    def __init__(self, device):
        self.attn_params: dict[int, list] = {BATCH: []}
        self.handles: dict[int, list[FIATask]] = {BATCH: []}
        self.free_tasks = [FIATask(device) for _ in range(NUM_LAYERS)]


class AscendAttentionBackendImpl:
    def __init__(self, graph_params, kv_cache, sliding_window):
        self.graph_params = graph_params
        self.key_cache, self.value_cache = kv_cache
        self.sliding_window = sliding_window
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def _fia_params(self, attn_metadata):
        # (post-#8508 SWA parameters in every mode: the kernel-parameter half of the PR is not modelled as a variant)
        sparse_mode = 4 if self.sliding_window else 3 if attn_metadata.causal else 0
        pre_tokens = self.sliding_window or SWA_INT_MAX
        next_tokens = 0 if self.sliding_window else SWA_INT_MAX
        return sparse_mode, pre_tokens, next_tokens

    def forward(self, query, attn_metadata):
        if _EXTRA_CTX.capturing:
            return self.full_graph_fia(query, attn_metadata)
        sparse_mode, pre_tokens, next_tokens = self._fia_params(attn_metadata)
        return npu_fused_infer_attention_score(
            query, self.key_cache, self.value_cache, block_table=attn_metadata.block_tables,
            actual_seq_lengths_kv=torch.tensor(attn_metadata.seq_lens_list, device=query.device),
            sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens, scale=self.scale)

    def full_graph_fia(self, query, attn_metadata):
        """Capture only: record the task's arguments for the replay-time updates, launch it in a task group."""
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        sparse_mode, pre_tokens, next_tokens = self._fia_params(attn_metadata)
        self.graph_params.attn_params[num_tokens].append((
            query, self.key_cache, self.value_cache, attn_metadata.block_tables, None, BLOCK_SIZE,
            attn_metadata.seq_lens_list, attn_metadata.actual_seq_lengths_q, NUM_HEADS, NUM_HEADS, self.scale,
            sparse_mode, pre_tokens, next_tokens))
        handle = self.graph_params.free_tasks.pop(0)          # torch.npu.graph_task_group_begin(stream)
        out = npu_fused_infer_attention_score(query, self.key_cache, self.value_cache,
                                              block_table=handle.block_table,
                                              actual_seq_lengths_kv=handle.actual_seq_lengths_kv,
                                              sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                                              next_tokens=next_tokens, scale=self.scale)
        self.graph_params.handles[num_tokens].append(handle)  # torch.npu.graph_task_group_end(stream)
        return out


def update_graph_params(graph_params, attn_metadata, num_tokens, hf_text_config, variant):
    """Before each FULL replay: re-launch every recorded FIA task with the step's metadata (target-model path)."""
    attn_keys = list(attn_metadata.keys())
    for key, param, handle in zip(attn_keys, graph_params.attn_params[num_tokens], graph_params.handles[num_tokens]):
        (query, key_cache, value, block_tables, attn_mask, block_size, seq_lens, actual_seq_lengths_q,
         num_kv_heads, num_heads, scale, sparse_mode, pre_tokens, next_tokens) = param
        seq_lens = attn_metadata[key].seq_lens_list
        actual_seq_lengths_q = attn_metadata[key].actual_seq_lengths_q
        if variant == "bug" or not hasattr(hf_text_config, "sliding_window"):
            block_tables = attn_metadata[key].block_tables
        # (fix) SWA models keep the captured block_tables tensor: the layer's own group table, refreshed in place
        handle.rebind(block_tables, seq_lens)


# --- the model -------------------------------------------------------------------------------------------------

class Gemma2TextConfig:
    sliding_window = SLIDING_WINDOW


class Model:
    def __init__(self, device, graph_params, kv_caches, layer_to_tensor):
        gen = generator(8508)
        self.wq = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.wo = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.impl = [AscendAttentionBackendImpl(graph_params, kv_caches[layer_to_tensor[name]],
                                                SLIDING_WINDOW if IS_SLIDING[i] else None)
                     for i, name in enumerate(LAYER_NAMES)]

    def forward(self, hidden_states, attn_metadata):
        h = hidden_states
        for i, name in enumerate(LAYER_NAMES):
            attn = self.impl[i].forward((h @ self.wq[i]).view(-1, NUM_HEADS, HEAD_DIM), attn_metadata[name])
            h = h + torch.tanh(attn.reshape(-1, HIDDEN) @ self.wo[i])
        return h


# --- vllm_ascend/worker/model_runner_v1.py (reduced) -----------------------------------------------------------

class NPUModelRunner:
    def __init__(self, device, kv_caches, layer_to_tensor):
        self.device, self.kv_caches = device, kv_caches
        self.kv_cache_groups = get_kv_cache_groups()
        self.hf_text_config = Gemma2TextConfig()
        self.graph_params = GraphParams(device)
        self.model = Model(device, self.graph_params, kv_caches, layer_to_tensor)
        # input_batch.block_table[gid].get_device_tensor(): one persistent table per KV-cache group
        self.block_tables = [torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)
                             for _ in self.kv_cache_groups]
        self.hidden_states = torch.zeros(BATCH, HIDDEN, device=device)

    def _build_attention_metadata(self, seq_lens):
        """Group by group: every layer of a group shares the group's metadata (and block table)."""
        attn_metadata = {}
        for gid, group in enumerate(self.kv_cache_groups):
            md = AscendMetadata(self.block_tables[gid][:BATCH], seq_lens)
            for layer_name in group.layer_names:
                attn_metadata[layer_name] = md
        return attn_metadata

    def _prepare_inputs(self, group_block_ids, hidden):
        for gid, ids in enumerate(group_block_ids):
            self.block_tables[gid].copy_(torch.tensor(ids, dtype=torch.long))   # commit_block_table (in place)
        self.hidden_states.copy_(hidden)

    def capture_model(self):
        dummy = self._build_attention_metadata([1] * BATCH)                  # _dummy_run: null-block tables
        tasks = list(self.graph_params.free_tasks)

        def aclgraph_forward():
            _EXTRA_CTX.capturing = torch.cuda.is_current_stream_capturing()
            try:
                return self.model.forward(self.hidden_states, dummy)
            finally:
                _EXTRA_CTX.capturing = False

        self.graph = capture(
            aclgraph_forward, device=self.device, owner="ACLGraphWrapper (FULL_DECODE_ONLY)",
            name=f"FULL decode bs={BATCH}",
            static={"hidden_states": self.hidden_states,
                    **{f"block_table[{gid}]": t for gid, t in enumerate(self.block_tables)},
                    **{f"fia_task{i}.block_table": t.block_table for i, t in enumerate(tasks)},
                    **{f"fia_task{i}.actual_seq_lengths_kv": t.actual_seq_lengths_kv for i, t in enumerate(tasks)}},
            state={f"kv_caches[{j}].{kv}": cache for j, (k_cache, v_cache) in enumerate(self.kv_caches)
                   for kv, cache in (("key", k_cache), ("value", v_cache))})

    def execute_model(self, group_block_ids, seq_lens, hidden, use_graph, variant):
        self._prepare_inputs(group_block_ids, hidden)
        attn_metadata = self._build_attention_metadata(seq_lens)
        if not use_graph:
            return self.model.forward(self.hidden_states, attn_metadata).clone()
        update_graph_params(self.graph_params, attn_metadata, BATCH, self.hf_text_config, variant)
        g, out = self.graph
        return replay(g, out).clone()


# --- the workload ------------------------------------------------------------------------------------------------

# Per request: its blocks in each group (ids from one pool; block 0 is the null block).
SWA_BLOCKS = [[1, 2, 3, 4], [5, 6, 7, 8]]
FULL_BLOCKS = [[9, 10, 11, 12], [13, 14, 15, 16]]
STEPS = [[5, 4], [6, 5], [7, 6]]        # the two requests' KV lengths per decode step


def swa_table(blocks, seq_len):
    """The sliding-window manager's table: blocks wholly before the window are the null block."""
    q_pos = seq_len - 1
    return [NULL_BLOCK if (b + 1) * BLOCK_SIZE - 1 < q_pos - SLIDING_WINDOW else blk for b, blk in enumerate(blocks)]


def run(variant: str, device: str = "cpu"):
    groups = get_kv_cache_groups()
    # KVCacheTensor.shared_by: the j-th layer of every group shares tensor j
    layer_to_tensor = {name: j for g in groups for j, name in enumerate(g.layer_names)}
    gen = generator(85080)
    kv_init = [(randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device),
                randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device)) for _ in range(2)]
    for k, v in kv_init:                    # the null block holds nothing
        k[NULL_BLOCK].zero_()
        v[NULL_BLOCK].zero_()
    hiddens = [randn(BATCH, HIDDEN, gen=gen, device=device) for _ in STEPS]

    def serve(use_graph: bool):
        kv_caches = [(k.clone(), v.clone()) for k, v in kv_init]
        runner = NPUModelRunner(device, kv_caches, layer_to_tensor)
        if use_graph:
            runner.capture_model()
        outs = []
        for seq_lens, h in zip(STEPS, hiddens):
            group_block_ids = [[swa_table(b, s) for b, s in zip(SWA_BLOCKS, seq_lens)], FULL_BLOCKS]
            outs.append(runner.execute_model(group_block_ids, seq_lens, h, use_graph, variant))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
