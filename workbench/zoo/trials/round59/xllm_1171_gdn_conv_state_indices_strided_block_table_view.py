"""Qwen3.5 GDN decode under ACL graphs hands ``causal_conv1d_update`` a strided column of the wide persistent block table.

Upstream: https://github.com/xLLM-AI/xllm/pull/1171 ("bugfix: fix qwen3.5 gated delta net conv state indices for
acl graph[5/N]."), commit ae9c62dc.
Symptom: the commit states no error text; by mechanism, Qwen3.5 decode served by ACL graphs gives wrong tokens for
every request but the first: their causal-conv state is read from and written to another slot (here the null block).
Mechanism: ``Qwen3GatedDeltaNetBaseImpl::forward`` (decode branch) set ``params.conv_state_indices =
attn_metadata.block_table.select(1, 0)`` and called ``xllm::kernel::causal_conv1d_update`` ->
``npu::npu_causal_conv1d_update``, a kernel that walks ``conv_state_indices`` as a dense int32 array from its data
pointer. Eager decode's ``block_table`` is the batch's own ``params.block_tables`` (``[batch, max blocks in batch]``;
one column for these short sequences), so column 0 is dense and the kernel reads the right slots. Under ACL graphs
``AclGraph::capture`` binds ``block_tables`` to ``persistent_block_tables(padded_num_tokens)``, rows of the persistent
``[max_seqs_per_batch, max_block_table_len]`` buffer (``max_block_table_len = max_seq_len / block_size + 1``), and
``GraphPersistentParam::update`` copies each step's table into its ``[:batch, :actual_len]`` corner. ``select(1, 0)``
of that buffer has stride ``max_block_table_len``: the kernel takes element ``i`` of the flat buffer, row 0 column
``i``, for request ``i``, i.e. a column this step never wrote (zeros: the null block). The captured kernel re-reads the
same elements at every replay, so requests 1.. update and read block 0's conv state instead of their own. The
``ssm_cache`` path (``index_select`` / ``index_put_``) respects strides and is right in both modes.
Doctor: stale-input, at ``forward`` (it hands the kernel a view whose dense reading lands on elements of the static
``persistent_block_tables_`` that the step did not write: what initialisation or an earlier step left there).
Fix (upstream): ``params.conv_state_indices = attn_metadata.block_table.select(1, 0).contiguous()`` (under capture a
gather of column 0 into a dense buffer, re-run at every replay), and ``causal_conv1d_update`` in ``ops_api.cpp`` now
``CHECK``s that ``conv_state_indices`` is contiguous.
(One GDN layer reduced to conv update + a decayed recurrent state; decode steps fill their bucket, so no padding is
involved; ``npu_causal_conv1d_update`` is emulated by reading the indices with unit stride from the view's offset.)
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1171"
FAMILY = "under-sized buffers / shape contracts"
KIND = "stale-input"
SITE = "forward"
SYMPTOM = "Qwen3.5 ACL-graph decode: requests 1.. read/write the wrong conv-state slot (strided block-table column)"

VOCAB, DIM, CONV_DIM, CONV_KERNEL = 16, 4, 4, 4
BLOCK_SIZE, MAX_SEQ_LEN, MAX_SEQS_PER_BATCH = 4, 16, 4
MAX_BLOCK_TABLE_LEN = MAX_SEQ_LEN // BLOCK_SIZE + 1
NUM_BLOCKS = 6                                   # block 0 is the null block
BLOCKS = ([3], [1], [4], [2])                    # short sequences: one block each (linear state in column 0)
DECODE_STEPS = (([0, 1, 2, 3], [5, 9, 2, 7]), ([0, 1, 2, 3], [11, 4, 8, 1]), ([0, 1], [6, 13]),
                ([0, 1, 2, 3], [3, 10, 15, 0]))


@dataclasses.dataclass
class CausalConv1dUpdateParams:
    x: torch.Tensor
    conv_state: torch.Tensor
    weight: torch.Tensor
    conv_state_indices: torch.Tensor | None = None


def npu_causal_conv1d_update(x, conv_state, weight, conv_state_indices):
    """The NPU kernel: ``conv_state_indices`` is read through its data pointer, ``indices[i]`` for row ``i``."""
    idx = conv_state_indices.as_strided((x.shape[0],), (1,), conv_state_indices.storage_offset()).long()
    window = torch.cat([conv_state[idx], x[:, :, None]], dim=-1)          # [batch, conv_dim, kernel]
    conv_state[idx] = window[:, :, 1:]
    return F.silu((window * weight).sum(-1))


def causal_conv1d_update(params: CausalConv1dUpdateParams, variant: str):
    if variant == "fix" and params.conv_state_indices is not None:
        assert params.conv_state_indices.is_contiguous(), "causal_conv1d_update: conv_state_indices must be contiguous."
    return npu_causal_conv1d_update(params.x, params.conv_state, params.weight, params.conv_state_indices)


class Qwen3GatedDeltaNetBaseImpl:
    def __init__(self, device, variant):
        gen = generator(1171)
        self.variant = variant
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.in_proj = randn(DIM, CONV_DIM, gen=gen, device=device, scale=0.7)
        self.conv_weight = randn(CONV_DIM, CONV_KERNEL, gen=gen, device=device, scale=0.6)
        self.decay = torch.sigmoid(randn(CONV_DIM, gen=gen, device=device))
        self.o_proj = randn(CONV_DIM, DIM, gen=gen, device=device, scale=0.7)

    def forward(self, tokens, block_table, kv_cache):
        """Decode branch: conv update on the mixed qkv, then the recurrent (ssm) state update."""
        conv_cache, ssm_cache = kv_cache
        mixed_qkv = self.embed[tokens] @ self.in_proj
        params = CausalConv1dUpdateParams(x=mixed_qkv, conv_state=conv_cache, weight=self.conv_weight)
        if self.variant == "bug":
            params.conv_state_indices = block_table.select(1, 0)
        else:
            params.conv_state_indices = block_table.select(1, 0).contiguous()
        mixed_qkv = causal_conv1d_update(params, self.variant)
        state_indices = block_table.select(1, 0).long()
        ssm_state = torch.index_select(ssm_cache, 0, state_indices) * self.decay + mixed_qkv
        ssm_cache.index_put_((state_indices,), ssm_state)
        return (ssm_state * mixed_qkv) @ self.o_proj


class GraphPersistentParam:
    def __init__(self, device):
        self.persistent_tokens_ = torch.zeros(MAX_SEQS_PER_BATCH, dtype=torch.long, device=device)
        self.persistent_block_tables_ = torch.zeros(MAX_SEQS_PER_BATCH, MAX_BLOCK_TABLE_LEN, dtype=torch.int32,
                                                    device=device)

    def update(self, tokens, block_tables):
        n, actual_block_table_len = tokens.shape[0], block_tables.shape[1]
        self.persistent_tokens_[:n].copy_(tokens, non_blocking=True)
        self.persistent_block_tables_[:n, :actual_block_table_len].copy_(block_tables, non_blocking=True)

    def persistent_block_tables(self, padded_num_tokens):
        return self.persistent_block_tables_[:padded_num_tokens]


class AclGraphExecutorImpl:
    def __init__(self, model, kv_cache, device, enable_graph):
        self.model_, self.kv_cache, self.device, self.enable_graph = model, kv_cache, device, enable_graph
        self.persistent_param_ = GraphPersistentParam(device)
        self.graphs_ = {}

    def run(self, tokens, block_tables):
        if not self.enable_graph:
            return self.model_.forward(tokens, block_tables, self.kv_cache)      # attn_metadata.block_table
        n, p = tokens.shape[0], self.persistent_param_
        p.update(tokens, block_tables)
        if n not in self.graphs_:                          # AclGraph::capture, lazily on a bucket's first step
            events.static_buffers("GraphPersistentParam", {"persistent_tokens_": p.persistent_tokens_,
                                                           "persistent_block_tables_": p.persistent_block_tables_})
            events.persistent_state("AclGraphExecutorImpl (linear cache)",
                                    {"conv_cache": self.kv_cache[0], "ssm_cache": self.kv_cache[1]})
            g = new_graph(self.device)
            with graph(g, name=f"decode bucket {n}"):
                out = self.model_.forward(p.persistent_tokens_[:n], p.persistent_block_tables(n), self.kv_cache)
            self.graphs_[n] = (g, out)
        g, out = self.graphs_[n]
        return replay(g, out)


def run(variant: str, device: str = "cpu"):
    model = Qwen3GatedDeltaNetBaseImpl(device, variant)
    gen = generator(11710)
    conv0 = randn(NUM_BLOCKS, CONV_DIM, CONV_KERNEL - 1, gen=gen, device=device)   # as prefill left them
    ssm0 = randn(NUM_BLOCKS, CONV_DIM, gen=gen, device=device)

    def serve(graphed: bool):
        kv_cache = (conv0.clone(), ssm0.clone())
        executor = AclGraphExecutorImpl(model, kv_cache, device, graphed)
        outs = []
        for seqs, ids in DECODE_STEPS:
            block_tables = torch.tensor([BLOCKS[s] for s in seqs], dtype=torch.int32).to(device)
            outs.append(executor.run(torch.tensor(ids).to(device), block_tables).clone())
        return [*outs, kv_cache[0][1:].clone()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
