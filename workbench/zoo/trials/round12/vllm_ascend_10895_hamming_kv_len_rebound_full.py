"""ACL full-graph replay rebinds a hamming-sparse layer's KV length to the full sequence length.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/10895 ("[BugFix][Attention] Fix stale KV lengths
in hamming sparse attention under ACL graph replay", commit 4edfcc103d).
Symptom: with hamming sparse attention enabled (``VLLM_ASCEND_ENABLE_KVCOMP_SPARSE``) and ACL full-graph
decode, answers lose accuracy against eager mode; every other configuration is unaffected (vllm-ascend main,
June 2026).
Mechanism: in decode, a hamming-sparse layer attends only over the top-k KV blocks that the hamming distance
picked: its block table is the compacted list of those blocks and its KV length is ``seq_lens_from_hamming``
(``chunk_size * top_k``), shorter than the request's true length. The FIA operator takes the KV lengths as a
host list, baked into the captured graph task; before every replay ``update_full_graph_params`` rebinds each
layer's task with the step's lengths. It bound ``attn_metadata.seq_lens_list`` (the full lengths) to every
layer, sparse or not. Replayed, the sparse layer therefore reads as many blocks of its compacted table as the
full length covers: the entries past the top-k, which this step did not write and which still hold block ids
from earlier steps (and from the capture's dummy batch). Eager attention passes the hamming length and never
reads them.
Doctor: stale-padding, at ``update_full_graph_params`` (real rows read the compacted table's columns past
the top-k, the padded part of each row, because the replay binds the full KV length).
Fix (upstream): a per-layer override in the graph-parameter update: hamming-sparse layers are rebound with
``seq_lens_from_hamming``, dense layers keep ``seq_lens_list``.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/10895"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "update_full_graph_params"
SYMPTOM = "hamming-sparse attention under ACL full graph attends over stale blocks past the top-k (accuracy drop)"
DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, TOP_K, BATCH = 4, 2, 10, 4, 2, 2
NUM_LAYERS, SPARSE_LAYERS = 2, (1,)            # layer 1 uses hamming sparse attention


class Model:
    def __init__(self, device):
        gen = generator(10895)
        self.wq = [randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(NUM_LAYERS)]
        self.wo = [randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(NUM_LAYERS)]
        # the paged KV cache of each layer, filled by earlier prefills (read-only in these decode steps)
        self.k_cache = [randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device) for _ in range(NUM_LAYERS)]
        self.v_cache = [randn(NUM_BLOCKS * BLOCK_SIZE, DIM, gen=gen, device=device) for _ in range(NUM_LAYERS)]


def npu_fused_infer_attention_score(query, key_cache, value_cache, block_table, actual_seq_lengths_kv):
    """FIA decode: row b attends over its first ``actual_seq_lengths_kv[b]`` tokens, paged by ``block_table``."""
    t = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=query.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE          # [B, T]
    k, v = key_cache[slots], value_cache[slots]                                     # [B, T, D]
    scores = (k @ query.unsqueeze(-1)).squeeze(-1) / math.sqrt(DIM)
    scores = scores.masked_fill(t[None, :] >= actual_seq_lengths_kv[:, None], float("-inf"))
    return (torch.softmax(scores, -1).unsqueeze(-1) * v).sum(1)


class AttnMetadata:
    """The persistent decode metadata of ``AscendAttentionMetadataBuilder`` (graph inputs)."""

    def __init__(self, device):
        self.block_tables = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)
        self.block_table_from_hamming = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)
        self.seq_lens_list = [1] * BATCH                     # host lists, as FIA takes them
        self.seq_lens_from_hamming = [1] * BATCH


def hamming_dist_top_k(model, layer, hidden, block_table, seq_lens):
    """Pick each request's TOP_K most relevant KV blocks (stand-in for the hamming-distance top-k op)."""
    q = hidden @ model.wq[layer]
    picks = []
    for b, n in enumerate(seq_lens):
        blocks = block_table[b, : n // BLOCK_SIZE]                     # full blocks only
        keys = model.k_cache[layer].view(NUM_BLOCKS, BLOCK_SIZE, DIM)[blocks].mean(1)
        picks.append(blocks[torch.topk(keys @ q[b], TOP_K).indices.sort().values])
    return picks


def build(meta, model, hidden, block_tables, seq_lens):
    """The builder's per-step work (eager, before the graph): fill the persistent metadata in place."""
    for b, row in enumerate(block_tables):
        meta.block_tables[b, : len(row)] = torch.tensor(row, device=meta.block_tables.device)
    meta.seq_lens_list = list(seq_lens)
    for b, blocks in enumerate(hamming_dist_top_k(model, SPARSE_LAYERS[0], hidden, meta.block_tables, seq_lens)):
        meta.block_table_from_hamming[b, :TOP_K] = blocks             # only the top-k columns are written
    meta.seq_lens_from_hamming = [BLOCK_SIZE * TOP_K] * len(seq_lens)


def forward_layer(model, layer, hidden, meta, actual_seq_lengths_kv):
    block_table = meta.block_table_from_hamming if layer in SPARSE_LAYERS else meta.block_tables
    out = npu_fused_infer_attention_score(hidden @ model.wq[layer], model.k_cache[layer], model.v_cache[layer],
                                          block_table, actual_seq_lengths_kv)
    return hidden + out @ model.wo[layer]


def forward(model, hidden, meta, seq_lens_per_layer):
    for layer in range(NUM_LAYERS):
        hidden = forward_layer(model, layer, hidden, meta, seq_lens_per_layer[layer])
    return hidden


class GraphParams:
    """Each layer's captured FIA task arguments; rebound before every replay (``graph_task_update``)."""

    def __init__(self, device):
        self.actual_seq_lengths_kv = [torch.ones(BATCH, dtype=torch.long, device=device)
                                      for _ in range(NUM_LAYERS)]


def update_full_graph_params(graph_params, meta, variant):
    """Rebind every layer's FIA task with this step's KV lengths, before the replay."""
    for layer in range(NUM_LAYERS):
        seq_lens = meta.seq_lens_list
        if variant == "fix" and layer in SPARSE_LAYERS:
            seq_lens = meta.seq_lens_from_hamming                       # the per-layer override
        graph_params.actual_seq_lengths_kv[layer].copy_(torch.tensor(seq_lens))


STEPS = [  # (block tables, full KV lengths) of the two decoding requests
    ([[3, 5, 7, 2], [4, 6, 8, 9]], [7, 8]),
    ([[3, 5, 7, 2], [4, 6, 8, 9]], [8, 8]),
    ([[1, 7, 3, 5], [9, 2, 6, 4]], [8, 7]),
]


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = torch.Generator().manual_seed(1)
    hiddens = [torch.randn(BATCH, DIM, generator=gen).to(device) for _ in STEPS]

    def eager():
        meta, outs = AttnMetadata(device), []
        for hidden, (tables, seq_lens) in zip(hiddens, STEPS):
            build(meta, model, hidden, tables, seq_lens)
            per_layer = [torch.tensor(meta.seq_lens_from_hamming if layer in SPARSE_LAYERS else meta.seq_lens_list,
                                      device=device) for layer in range(NUM_LAYERS)]
            outs.append(forward(model, hidden, meta, per_layer))
        return outs

    def served():
        meta, graph_params = AttnMetadata(device), GraphParams(device)
        hidden_states = torch.zeros(BATCH, DIM, device=device)
        # build_for_graph_capture: a dummy batch whose block ids point at blocks 0..3
        meta.block_tables.copy_(torch.arange(MAX_BLOCKS, device=device).repeat(BATCH, 1))
        meta.block_table_from_hamming.copy_(meta.block_tables)
        g, out = capture(lambda: forward(model, hidden_states, meta, graph_params.actual_seq_lengths_kv),
                         device=device, owner="ACLGraphWrapper (FULL_DECODE_ONLY)",
                         static={"hidden_states": hidden_states, "block_tables": meta.block_tables,
                                 "block_table_from_hamming": meta.block_table_from_hamming,
                                 **{f"actual_seq_lengths_kv.{i}": t
                                    for i, t in enumerate(graph_params.actual_seq_lengths_kv)}},
                         state={**{f"k_cache.{i}": t for i, t in enumerate(model.k_cache)},
                                **{f"v_cache.{i}": t for i, t in enumerate(model.v_cache)}})
        outs = []
        for hidden, (tables, seq_lens) in zip(hiddens, STEPS):
            hidden_states.copy_(hidden)
            build(meta, model, hidden, tables, seq_lens)
            update_full_graph_params(graph_params, meta, variant)
            outs.append(replay(g, out, padded_columns={
                "block_table_from_hamming": (meta.block_table_from_hamming, TOP_K)}).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
