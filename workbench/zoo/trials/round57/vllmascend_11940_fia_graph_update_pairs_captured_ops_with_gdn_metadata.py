"""Hybrid Qwen3.5 on FULL ACL graphs: the replay-time FIA update pairs captured attention tasks with GDN-layer metadata.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/11940 ("[Bugfix][LoRA][Qwen3.5]Fix Qwen3.5 densemodel
LoRA scenarios with tp, fully_sharded_loras and aclgraph.", commit b80fa2678f); the same root cause and error text
are in the unmerged https://github.com/vllm-project/vllm-ascend/pull/11641.
Symptom: Qwen3.5 dense + LoRA (cudagraph_specialize_lora) + FULL ACL graph decode: the worker dies on the first
replayed decode with ``AttributeError: 'GDNAttentionMetadata' object has no attribute 'seq_lens_list'`` (where
the pairing lands on another layer instead, the replayed attention uses that layer's lengths: wrong output).
Mechanism: in FULL decode each full-attention layer's ``npu_fused_infer_attention_score`` (FIA) is captured as a
task group and its arguments appended to ``graph_params.attn_params[num_tokens]``. Before every replay
``AscendAttentionBackendImpl.update_graph_params`` (``vllm_ascend/attention/attention_v1.py``) re-launches each
recorded task with the step's ``seq_lens_list`` / ``actual_seq_lengths_q`` / ``block_tables``, pairing tasks with
layers by ``zip(attn_keys, captured_attn_params, handles, events)``. ``attn_keys = list(attn_metadata.keys())``
lists every layer of ``forward_context.attn_metadata``: the FIA layers (the full-attention KV cache group comes
first) and the GDN linear-attention layers (``GDNAttentionMetadata``, no captured FIA task: their conv1d tasks
are updated by ``update_conv1d_graph_params``). The code relied on "self_attn first + zip truncation". With LoRA
specialisation every size is captured twice (has_lora True, then False), so ``graph_param_count`` is twice the
FIA layer count: the non-layer-aware path takes ``attn_keys[:graph_param_count]``, which now reaches into the
GDN keys, sorts it by layer index into ``_ATTN_KEYS_BUFFER`` and writes it back over ``attn_keys``; the first
captured FIA task is then paired with ``model.layers.0.linear_attn`` and its metadata has no ``seq_lens_list``.
Capture and warmup never run this update; only replays do.
Doctor: stale-input, at ``update_graph_params`` (the refresh of the captured FIA tasks' arguments is keyed over
layers that own no captured task, so the tasks are not re-launched with the step's lengths and block table).
Fix (upstream): one line: ``attn_keys = [k for k in attn_metadata if hasattr(attn_metadata[k], "seq_lens_list")]``
so ``num_layers``, the key ordering and the pairing count only FIA layers. (The PR's LoRA shrink-kernel
``DataCopyPad`` change and the LoRA class cleanup are not graph related and not modelled.)
(Miniature: 8 layers in Qwen3.5's 3:1 pattern, full attention at layers 3 and 7; GDN layers as a stateless gated
mixer; one LoRA adapter on the attention output; decode graphs for 2 requests; LoRA requests replay the has_lora
graph, whose tasks are the first two recorded.)
"""
from __future__ import annotations

import math
import re

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/11940"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "update_graph_params"
SYMPTOM = "FULL-graph decode replay of hybrid Qwen3.5 + LoRA: AttributeError 'GDNAttentionMetadata' ... 'seq_lens_list'"

NUM_HEADS, HEAD_DIM = 2, 4
HIDDEN = NUM_HEADS * HEAD_DIM
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 2, 12, 3
MAX_CTX = BLOCK_SIZE * MAX_BLOCKS
NUM_LAYERS, FULL_ATTENTION_INTERVAL = 8, 4
BATCH = 2                                      # the captured FULL decode size (one token per request)
FIA_KEYS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS) if i % FULL_ATTENTION_INTERVAL == 3]
GDN_KEYS = [f"model.layers.{i}.linear_attn" for i in range(NUM_LAYERS) if i % FULL_ATTENTION_INTERVAL != 3]
_ATTN_KEYS_BUFFER: list[str] = []


class AscendMetadata:
    def __init__(self, block_tables, seq_lens_list):
        self.block_tables, self.seq_lens_list = block_tables, list(seq_lens_list)
        self.actual_seq_lengths_q = list(range(1, len(seq_lens_list) + 1))


class GDNAttentionMetadata:
    def __init__(self, num_decodes):
        self.num_decodes = num_decodes


def npu_fused_infer_attention_score(query, key, value, *, block_table, actual_seq_lengths_kv, scale):
    """FIA, TND decode over a paged KV cache; keys past ``actual_seq_lengths_kv`` are hidden."""
    t = torch.arange(MAX_CTX, device=query.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    k = key.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    v = value.view(-1, NUM_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("bnd,btnd->bnt", query, k) * scale
    p = torch.softmax(scores.masked_fill((t[None, :] >= actual_seq_lengths_kv[:, None])[:, None, :], -1e9), -1)
    return torch.einsum("bnt,btnd->bnd", p, v)


class FIATask:
    """A captured FIA task group: the launch arguments ``graph_task_update`` rewrites before a replay."""

    def __init__(self, device):
        self.block_table = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)
        self.actual_seq_lengths_kv = torch.ones(BATCH, dtype=torch.long, device=device)

    def rebind(self, block_table, actual_seq_lengths_kv):
        self.block_table.copy_(block_table)
        self.actual_seq_lengths_kv.copy_(torch.tensor(actual_seq_lengths_kv, device=self.block_table.device))


class GraphParams:
    def __init__(self, device):
        self.attn_params: dict[int, list] = {BATCH: []}
        self.handles: dict[int, list[FIATask]] = {BATCH: []}
        # Task argument slots, made before capture (2 LoRA cases x the FIA layers).
        self.free_tasks = [FIATask(device) for _ in range(2 * len(FIA_KEYS))]


class AscendAttentionBackendImpl:
    def __init__(self, graph_params, key_cache, value_cache):
        self.graph_params, self.key_cache, self.value_cache = graph_params, key_cache, value_cache
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def forward(self, query, attn_metadata):
        if torch.cuda.is_current_stream_capturing():
            return self.full_graph_fia(query, attn_metadata)
        return npu_fused_infer_attention_score(
            query, self.key_cache, self.value_cache, block_table=attn_metadata.block_tables,
            actual_seq_lengths_kv=torch.tensor(attn_metadata.seq_lens_list, device=query.device), scale=self.scale)

    def full_graph_fia(self, query, attn_metadata):
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        self.graph_params.attn_params[num_tokens].append((
            query, self.key_cache, self.value_cache, attn_metadata.block_tables, BLOCK_SIZE,
            attn_metadata.seq_lens_list, attn_metadata.actual_seq_lengths_q, NUM_HEADS, self.scale,
            None))                                        # layer_name: None (not layer-aware replay)
        handle = self.graph_params.free_tasks.pop(0)      # torch.npu.graph_task_group_begin(stream)
        out = npu_fused_infer_attention_score(query, self.key_cache, self.value_cache, block_table=handle.block_table,
                                              actual_seq_lengths_kv=handle.actual_seq_lengths_kv, scale=self.scale)
        self.graph_params.handles[num_tokens].append(handle)  # torch.npu.graph_task_group_end(stream)
        return out


def extract_layer_index(key: str) -> int:
    match = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", key)
    return int(match.group(1)) if match else 0


def update_graph_params(graph_params, attn_metadata, num_tokens, variant):
    """Before each FULL replay: re-launch every recorded FIA task with its layer's metadata (non-layer-aware path)."""
    global _ATTN_KEYS_BUFFER
    if variant == "bug":
        attn_keys = list(attn_metadata.keys())
    else:
        # Only standard (FIA) attention layers have captured graph params here.
        attn_keys = [k for k in attn_metadata if hasattr(attn_metadata[k], "seq_lens_list")]
    attn_keys_length = len(graph_params.attn_params[num_tokens])
    if attn_keys_length == 0:
        return
    if not _ATTN_KEYS_BUFFER or len(_ATTN_KEYS_BUFFER) != attn_keys_length:
        attn_keys_tmp = attn_keys[:attn_keys_length]
        attn_keys_tmp.sort(key=extract_layer_index)
        _ATTN_KEYS_BUFFER = attn_keys_tmp[:attn_keys_length]
    attn_keys[:attn_keys_length] = _ATTN_KEYS_BUFFER
    for key, param, handle in zip(attn_keys, graph_params.attn_params[num_tokens], graph_params.handles[num_tokens]):
        (query, key_cache, value, block_tables, block_size, seq_lens, actual_seq_lengths_q, num_heads, scale,
         layer_name) = param
        metadata_key = layer_name if layer_name is not None and layer_name in attn_metadata else key
        seq_lens = attn_metadata[metadata_key].seq_lens_list
        block_tables = attn_metadata[metadata_key].block_tables
        handle.rebind(block_tables, seq_lens)


class Qwen3_5Model:
    def __init__(self, device, graph_params):
        gen = generator(11940)
        self.wq = {k: randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for k in FIA_KEYS}
        self.wo = {k: randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for k in FIA_KEYS}
        self.impl = {k: AscendAttentionBackendImpl(graph_params, randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen,
                                                                       device=device),
                                                   randn(NUM_BLOCKS, BLOCK_SIZE, HIDDEN, gen=gen, device=device))
                     for k in FIA_KEYS}
        self.gdn_w = {k: randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.5) for k in GDN_KEYS}
        self.lora_a = randn(HIDDEN, 2, gen=gen, device=device, scale=0.5)
        self.lora_b = randn(2, HIDDEN, gen=gen, device=device, scale=0.5)

    def forward(self, hidden_states, attn_metadata, has_lora):
        h = hidden_states
        for i in range(NUM_LAYERS):
            if i % FULL_ATTENTION_INTERVAL == 3:
                key = f"model.layers.{i}.self_attn.attn"
                attn = self.impl[key].forward((h @ self.wq[key]).view(-1, NUM_HEADS, HEAD_DIM), attn_metadata[key])
                o = attn.reshape(-1, HIDDEN)
                out = o @ self.wo[key]
                if has_lora:
                    out = out + (o @ self.lora_a) @ self.lora_b
                h = h + out
            else:
                a, g = (h @ self.gdn_w[f"model.layers.{i}.linear_attn"]).split(HIDDEN, dim=-1)
                h = h + torch.tanh(a) * torch.sigmoid(g)
        return h


def build_attn_metadata(block_table, seq_lens):
    """Full-attention KV cache group first, then the GDN group (as forward_context.attn_metadata is built)."""
    md = {k: AscendMetadata(block_table, seq_lens) for k in FIA_KEYS}
    md.update({k: GDNAttentionMetadata(len(seq_lens)) for k in GDN_KEYS})
    return md


# Per decode step (2 LoRA requests): block ids and KV lengths.
STEPS = [([[3, 5, 0], [4, 6, 0]], [3, 4]), ([[7, 9, 11], [8, 10, 2]], [5, 6]), ([[1, 2, 3], [6, 4, 5]], [4, 5])]


def run(variant: str, device: str = "cpu"):
    gen = generator(57)
    hidden = [randn(BATCH, HIDDEN, gen=gen, device=device) for _ in STEPS]
    table = lambda ids: torch.tensor(ids, dtype=torch.long, device=device)   # noqa: E731

    def eager():
        model = Qwen3_5Model(device, GraphParams(device))
        return [model.forward(h, build_attn_metadata(table(ids), lens), has_lora=True).clone()
                for (ids, lens), h in zip(STEPS, hidden)]

    def served():
        global _ATTN_KEYS_BUFFER
        _ATTN_KEYS_BUFFER = []
        graph_params = GraphParams(device)
        model = Qwen3_5Model(device, graph_params)
        input_hidden = torch.zeros(BATCH, HIDDEN, device=device)
        block_table = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)      # persistent
        dummy = build_attn_metadata(block_table, [1] * BATCH)                                # dummy run
        graphs = {}
        for has_lora in (True, False):                    # cudagraph_specialize_lora: both cases per size
            g, out = capture(lambda lo=has_lora: model.forward(input_hidden, dummy, lo), device=device,
                             name=f"FULL decode {BATCH} lora={has_lora}", owner="NPUModelRunner (ACL graph)",
                             static={"hidden_states": input_hidden, "block_table": block_table})
            graphs[has_lora] = (g, out)
        outs = []
        for (ids, lens), h in zip(STEPS, hidden):
            input_hidden.copy_(h)
            block_table.copy_(table(ids))
            update_graph_params(graph_params, build_attn_metadata(block_table, lens), BATCH, variant)
            g, out = graphs[True]
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
