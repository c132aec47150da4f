"""A FULL-graph eagle draft: the replay-time FIA update re-binds each draft step's task to the capture's block table.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/7348 ("[Bugfix] Fix padding logic in eagle proposer for
kimi25", commit 84a74f0cb1, merged March 2026).
Symptom: as reported, a "fia verifying error" for the Kimi-2.5 eagle draft model run with FULL ACL graphs once
``draft_step > 1`` (the FIA operator's argument validation fails on replay); where the validation passes, the
replayed draft attention reads the KV pages of the capture's block table, not the step's (wrong draft tokens;
this consequence is inferred from the diff, the PR reports only the verify error).
Mechanism (from the diff): in FULL graph mode ``AscendAttentionBackendImpl.full_graph_fia`` captures each layer's
``npu_fused_infer_attention_score`` as a task group and records its arguments in ``graph_params.attn_params``
(``query, key_cache, value, block_tables, attn_mask, block_size, seq_lens, ...``; upstream through
``weak_ref_tensors``). Before every replay ``update_graph_params`` walks the recorded tasks; for the draft model
``draft_step = attn_count // num_layers`` picks ``attn_metadata[draft_step][key]`` and it re-launches the task
(``graph_task_update_begin`` / ``.out`` / ``graph_task_update_end``) with that step's ``seq_lens_list`` and
``actual_seq_lengths_q``, but with the **recorded** ``block_tables``. The draft steps after the first run on a
shallow copy of the common metadata whose ``block_table_tensor`` ``_pad_tensor`` pads to the graph's
``input_batch_size`` with ``F.pad``: a new tensor every step. So the recorded tensor is the capture (dummy run)'s
padded table, and each replay of the later draft steps attends through the capture's block ids; eager draft
steps use the step's table. (The first draft step's table is a view of the runner's persistent block table,
refreshed in place, so its recorded reference happens to stay right.)
Doctor: warmup-divergence, at ``update_graph_params`` (the replay update reuses the tensor reference recorded at
capture for the task's block table, while eager steps read the step's metadata).
Fix (upstream): ``update_graph_params`` also takes ``block_tables = attn_metadata[draft_step][key].block_tables``
(``attn_metadata[key].block_tables`` for the target model) before the re-launch. The same PR moved the proposer's
FULL-mode padding of ``query_start_loc``/``seq_lens``/``block_table_tensor`` after the dispatch and made
``_pad_tensor`` pad to an absolute size; in this workload (one padded row) both forms give the same tensors, so
only the update differs between the variants. The recorded tuple is kept with strong references here (upstream
holds weak references, so the recorded table may even be freed memory: the FIA validation failure).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/7348"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "update_graph_params"
SYMPTOM = "eagle draft steps after the first replay attention through the capture's block table (FIA verify error)"

NUM_HEADS, HEAD_DIM = 2, 4
HIDDEN = NUM_HEADS * HEAD_DIM
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 2, 12, 3
MAX_CTX = BLOCK_SIZE * MAX_BLOCKS
NUM_SPEC = 2                      # draft steps in the merged FULL eagle graph (draft_step 0 and 1)
NUM_LAYERS = 1                    # the eagle head's one attention layer
NUM_REQS = 2                      # real requests
INPUT_BATCH = 3                   # the captured FULL size they are padded to
LAYER_KEY = "model.layers.0.self_attn.attn"


class _ExtraCtx:
    is_draft_model = True
    capturing = False


_EXTRA_CTX = _ExtraCtx()


class AscendMetadata:
    def __init__(self, block_tables, seq_lens_list):
        self.block_tables, self.seq_lens_list = block_tables, list(seq_lens_list)
        self.actual_seq_lengths_q = list(range(1, len(seq_lens_list) + 1))


def npu_fused_infer_attention_score(query, key, value, *, block_table, actual_seq_lengths_kv, scale):
    """FIA, TND decode (one query per request) over a paged KV cache; keys past ``actual_seq_lengths_kv`` hidden."""
    t = torch.arange(MAX_CTX, device=query.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE              # [B, T]
    k = key.view(-1, NUM_HEADS, HEAD_DIM)[slots]                                      # [B, T, N, D]
    v = value.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("bnd,btnd->bnt", query, k) * scale
    hidden = (t[None, :] >= actual_seq_lengths_kv[:, None])[:, None, :]
    p = torch.softmax(scores.masked_fill(hidden, -1e9), -1)
    return torch.einsum("bnt,btnd->bnd", p, v)


class FIATask:
    """A captured FIA task group: the launch arguments that ``graph_task_update`` rewrites before a replay."""

    def __init__(self, device):
        self.block_table = torch.zeros(INPUT_BATCH, MAX_BLOCKS, dtype=torch.long, device=device)
        self.actual_seq_lengths_kv = torch.ones(INPUT_BATCH, dtype=torch.long, device=device)

    def rebind(self, block_table, actual_seq_lengths_kv):
        """``graph_task_update_begin`` / the ``.out`` launch with these arguments / ``graph_task_update_end``."""
        self.block_table.copy_(block_table)
        self.actual_seq_lengths_kv.copy_(torch.tensor(actual_seq_lengths_kv, device=self.block_table.device))


class GraphParams:
    def __init__(self, device):
        self.attn_params: dict[int, list] = {INPUT_BATCH: []}
        self.handles: dict[int, list[FIATask]] = {INPUT_BATCH: []}
        self.free_tasks = [FIATask(device) for _ in range(NUM_SPEC * NUM_LAYERS)]


class AscendAttentionBackendImpl:
    def __init__(self, graph_params, key_cache, value_cache):
        self.graph_params, self.key_cache, self.value_cache = graph_params, key_cache, value_cache
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def forward(self, query, attn_metadata):
        if _EXTRA_CTX.capturing:
            return self.full_graph_fia(query, attn_metadata)
        n = len(attn_metadata.seq_lens_list)
        return npu_fused_infer_attention_score(
            query[:n], self.key_cache, self.value_cache, block_table=attn_metadata.block_tables[:n],
            actual_seq_lengths_kv=torch.tensor(attn_metadata.seq_lens_list, device=query.device), scale=self.scale)

    def full_graph_fia(self, query, attn_metadata):
        """Capture only: record the task's arguments for the replay-time updates, launch it in a task group."""
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        self.graph_params.attn_params[num_tokens].append((
            query, self.key_cache, self.value_cache, attn_metadata.block_tables, None, BLOCK_SIZE,
            attn_metadata.seq_lens_list, attn_metadata.actual_seq_lengths_q, NUM_HEADS, NUM_HEADS, self.scale))
        handle = self.graph_params.free_tasks.pop(0)          # torch.npu.graph_task_group_begin(stream)
        out = npu_fused_infer_attention_score(query, self.key_cache, self.value_cache,
                                              block_table=handle.block_table,
                                              actual_seq_lengths_kv=handle.actual_seq_lengths_kv, scale=self.scale)
        self.graph_params.handles[num_tokens].append(handle)  # torch.npu.graph_task_group_end(stream)
        return out


def update_graph_params(graph_params, draft_attn_metadatas, num_tokens, variant):
    """Before each FULL draft replay: re-launch every recorded FIA task with its draft step's metadata."""
    attn_keys = list(draft_attn_metadatas[0].keys())
    num_layers = len(attn_keys)
    attn_keys = attn_keys * (len(graph_params.attn_params[num_tokens]) // num_layers)
    attn_count = 0
    for key, param, handle in zip(attn_keys, graph_params.attn_params[num_tokens],
                                  graph_params.handles[num_tokens]):
        (query, key_cache, value, block_tables, attn_mask, block_size, seq_lens, query_start_loc,
         num_kv_heads, num_heads, scale) = param
        draft_step = attn_count // num_layers
        seq_lens = draft_attn_metadatas[draft_step][key].seq_lens_list
        if variant == "fix":
            block_tables = draft_attn_metadatas[draft_step][key].block_tables
        attn_count = attn_count + 1
        handle.rebind(block_table=block_tables, actual_seq_lengths_kv=seq_lens)


class EagleHead:
    def __init__(self, device, graph_params):
        gen = generator(7348)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.wn = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        key_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS * HEAD_DIM, gen=gen, device=device)
        value_cache = randn(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS * HEAD_DIM, gen=gen, device=device)
        self.impl = AscendAttentionBackendImpl(graph_params, key_cache, value_cache)

    def forward(self, hidden_states, attn_metadata):
        q = (hidden_states @ self.wq).view(-1, NUM_HEADS, HEAD_DIM)
        attn = self.impl.forward(q, attn_metadata[LAYER_KEY])
        n = attn.shape[0]
        return torch.tanh(hidden_states[:n] + attn.reshape(n, HIDDEN) @ self.wo)


class SpecDecodeBaseProposer:
    def __init__(self, device, graph_params):
        self.device = device
        self.model = EagleHead(device, graph_params)
        self.block_table = torch.zeros(INPUT_BATCH, MAX_BLOCKS, dtype=torch.long, device=device)   # persistent

    def _pad_tensor(self, tensor, desired_size):
        pad_size = desired_size - tensor.shape[0]
        if pad_size > 0:
            pad = [0] * (2 * tensor.dim() - 1) + [pad_size]
            tensor = F.pad(tensor, pad, mode="constant", value=0)
        else:
            tensor = tensor[:desired_size]
        return tensor

    def build_draft_attn_metadatas(self, block_ids, seq_lens, input_batch_size):
        """Draft step 0 reads the runner's persistent table; later steps a padded copy (``_pad_tensor``)."""
        n = len(block_ids)
        self.block_table[:n].copy_(torch.tensor(block_ids, device=self.device))
        self.block_table[n:].fill_(0)
        pad = [1] * (input_batch_size - n)                      # padded requests: one (null) key
        metadatas = [{LAYER_KEY: AscendMetadata(self.block_table[:input_batch_size], list(seq_lens) + pad)}]
        block_table_tensor = self.block_table[:n]              # common_attn_metadata.block_table_tensor
        for draft_step in range(1, NUM_SPEC):
            padded = self._pad_tensor(block_table_tensor, input_batch_size)
            metadatas.append({LAYER_KEY: AscendMetadata(padded, [s + draft_step for s in seq_lens] + pad)})
        return metadatas

    def propose(self, hidden_states, draft_attn_metadatas):
        """The merged eagle draft: NUM_SPEC draft steps, each one attention over its step's metadata."""
        outs, h = [], hidden_states
        for draft_step in range(NUM_SPEC):
            h = self.model.forward(h, draft_attn_metadatas[draft_step]) @ self.model.wn
            outs.append(h)
        return torch.stack(outs, 1)


# Per step: the two requests' block ids and KV lengths (the decode moves on; the second step gets new blocks).
STEPS = [
    ([[3, 5, 0], [4, 6, 0]], [3, 4]),
    ([[7, 9, 11], [8, 10, 2]], [5, 4]),
    ([[1, 2, 3], [6, 4, 5]], [4, 5]),
]


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(11)
    hiddens = [torch.randn(NUM_REQS, HIDDEN, generator=gen).to(device) for _ in STEPS]

    def eager():
        proposer = SpecDecodeBaseProposer(device, GraphParams(device))
        outs = []
        for h, (block_ids, seq_lens) in zip(hiddens, STEPS):
            metadatas = proposer.build_draft_attn_metadatas(block_ids, seq_lens, NUM_REQS)
            outs.append(proposer.propose(h, metadatas).clone())
        return outs

    def served():
        graph_params = GraphParams(device)
        proposer = SpecDecodeBaseProposer(device, graph_params)
        hidden_states = torch.zeros(INPUT_BATCH, HIDDEN, device=device)
        # dummy_run for capture: dummy block ids and lengths for the padded draft batch
        dummy = proposer.build_draft_attn_metadatas([[1, 2, 3]] * NUM_REQS, [MAX_CTX] * NUM_REQS, INPUT_BATCH)
        tasks = list(graph_params.free_tasks)

        def aclgraph_forward():
            _EXTRA_CTX.capturing = torch.cuda.is_current_stream_capturing()
            try:
                return proposer.propose(hidden_states, dummy)
            finally:
                _EXTRA_CTX.capturing = False

        g, out = capture(aclgraph_forward, device=device, owner="ACLGraphWrapper (FULL eagle draft)",
                         name=f"draft bs={INPUT_BATCH}",
                         static={"hidden_states": hidden_states,
                                 **{f"fia_task{i}.block_table": t.block_table for i, t in enumerate(tasks)},
                                 **{f"fia_task{i}.actual_seq_lengths_kv": t.actual_seq_lengths_kv
                                    for i, t in enumerate(tasks)}},
                         state={"key_cache": proposer.model.impl.key_cache,
                                "value_cache": proposer.model.impl.value_cache})
        outs = []
        for h, (block_ids, seq_lens) in zip(hiddens, STEPS):
            metadatas = proposer.build_draft_attn_metadatas(block_ids, seq_lens, INPUT_BATCH)
            hidden_states[:NUM_REQS].copy_(h)
            hidden_states[NUM_REQS:].zero_()
            update_graph_params(graph_params, metadatas, INPUT_BATCH, variant)
            res = replay(g, out, real=NUM_REQS, size=INPUT_BATCH)
            outs.append(res[:NUM_REQS].clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
