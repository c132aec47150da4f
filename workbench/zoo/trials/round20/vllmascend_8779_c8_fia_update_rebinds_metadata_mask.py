"""GQA C8 full-graph decode: every replay's task update binds the causal mask to an FIA captured without one.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/8779 ("[BugFix] Fixed a bug in GQA C8 fullgraph mode.",
commit 3583cfb03b, April 2026).
Symptom: as reported, "a bug in GQA C8 fullgraph mode where the attention mask condition for graph capturing was
incorrectly checking the original metadata instead of the potentially overridden local mask variable": GQA models
with the INT8 (C8) KV cache served with FULL / FULL_DECODE_ONLY ACL graphs decode differently from eager mode
(found by the nightly tests; the PR gives no numbers).
Mechanism: in FULL graph mode the decode attention of ``AscendC8AttentionBackendImpl`` is captured by
``full_graph_fia`` as a task group, and before every replay ``update_graph_params`` re-launches each layer's task
(``graph_task_update_begin`` ... ``npu_fused_infer_attention_score.out``) with the step's KV lengths and with the
other arguments recorded at capture in ``graph_params.attn_params``. ``full_graph_fia`` starts from
``attn_mask = attn_metadata.attn_mask`` (the builder's causal-mask template, kept for ``sparse_mode=3``) and, for
C8 (BNSD layout, antiquant), overrides it with ``attn_mask = None`` and ``sparse_mode = 0``: the captured launch
has no mask, as eager ``_forward_c8_decode`` has none. But the tuple it records stores
``weak_ref_tensors(attn_metadata.attn_mask)``, not the local ``attn_mask``. So every replay's update rebinds the
task with the causal template while keeping the C8 ``sparse_mode = 0``, under which FIA applies an explicit mask as
given: the single decode query takes the template's first row, which hides every key but the first.
Doctor: warmup-divergence, at ``full_graph_fia`` (the capture recorded a tensor reference, the metadata's mask,
that every replay's update reuses, while the captured launch and every eager step use no mask).
Fix (upstream): ``attn_params`` records ``weak_ref_tensors(attn_mask) if attn_mask is not None else None``, the
local variable, so the update rebinds the task exactly as it was captured. (Diff read: the one-line change in
``vllm_ascend/attention/attention_v1.py``; how FIA treats the template with ``sparse_mode=0`` for a BNSD decode
query is modelled from the operator's explicit-mask semantics, not measured.)
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/8779"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "full_graph_fia"
SYMPTOM = "GQA C8 FULL-graph decode attends over the first cached key only: the update binds the causal template"

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 2, 4
HIDDEN = NUM_HEADS * HEAD_DIM
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 2, 10, 4          # block_size is a multiple of 32 upstream
MAX_CTX = BLOCK_SIZE * MAX_BLOCKS
MASK_SIZE = MAX_CTX                                    # 2048 upstream (the compressed causal template)
BATCH = 2                                              # the FULL_DECODE_ONLY capture size (uniform decode)


class _ExtraCtx:
    capturing = False


_EXTRA_CTX = _ExtraCtx()


class AttentionMaskBuilder:
    """The singleton mask builder: one causal template shared by every step's metadata."""

    def __init__(self, device):
        self.mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)

    def get_attention_mask(self):
        return self.mask


class AscendMetadata:
    def __init__(self, block_tables, seq_lens_list, attn_mask):
        self.block_tables, self.seq_lens_list, self.attn_mask = block_tables, seq_lens_list, attn_mask
        self.causal = True
        self.actual_seq_lengths_q = list(range(1, len(seq_lens_list) + 1))


class AscendAttentionMetadataBuilder:
    def __init__(self, device):
        self.device = device
        self.attn_mask_builder = AttentionMaskBuilder(device)
        self.block_tables = torch.zeros(BATCH, MAX_BLOCKS, dtype=torch.long, device=device)   # persistent

    def build(self, block_tables, seq_lens):
        self.block_tables.copy_(torch.tensor(block_tables, device=self.device))
        return AscendMetadata(self.block_tables, list(seq_lens), self.attn_mask_builder.get_attention_mask())


def npu_fused_infer_attention_score(query, key, value, *, key_antiquant_scale, key_antiquant_offset,
                                    value_antiquant_scale, value_antiquant_offset, block_table,
                                    actual_seq_lengths_kv, atten_mask, sparse_mode, scale):
    """FIA, BNSD decode over a paged INT8 KV cache with per-channel antiquant. ``sparse_mode=0`` with a mask
    hides what the mask marks (the one query row of a decode step takes the mask's first row)."""
    t = torch.arange(MAX_CTX, device=query.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE          # [B, T]
    k = (key.view(-1, HEAD_DIM)[slots].float() + key_antiquant_offset) * key_antiquant_scale      # [B, T, D]
    v = (value.view(-1, HEAD_DIM)[slots].float() + value_antiquant_offset) * value_antiquant_scale
    scores = torch.einsum("bnd,btd->bnt", query[:, :, 0], k) * scale
    hidden = (t[None, :] >= actual_seq_lengths_kv[:, None])[:, None, :]
    if atten_mask is not None and sparse_mode == 0:
        hidden = hidden | atten_mask[0, :MAX_CTX][None, None, :]
    p = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    return torch.einsum("bnt,btd->bnd", p, v)[:, :, None]


class FIATask:
    """A captured FIA task group: the launch arguments that ``graph_task_update`` rewrites before a replay
    (the mask argument as a dense bool block: all False is the launch without a mask)."""

    def __init__(self, device):
        self.actual_seq_lengths_kv = torch.ones(BATCH, dtype=torch.long, device=device)
        self.atten_mask = torch.zeros(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device)

    def rebind(self, atten_mask, actual_seq_lengths_kv):
        """``graph_task_update_begin`` / the ``.out`` launch / ``graph_task_update_end``."""
        if atten_mask is None:
            self.atten_mask.zero_()
        else:
            self.atten_mask.copy_(atten_mask)
        self.actual_seq_lengths_kv.copy_(torch.tensor(actual_seq_lengths_kv, device=self.atten_mask.device))


class GraphParams:
    def __init__(self, device):
        self.attn_params: dict[int, list] = {BATCH: []}
        self.handles: dict[int, list[FIATask]] = {BATCH: []}
        self.free_tasks = [FIATask(device) for _ in range(NUM_LAYERS)]     # task groups of the one graph size


class AttentionLayer:
    def __init__(self, gen, device):
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.key_cache = torch.randint(-100, 100, (NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), generator=gen,
                                       dtype=torch.int8).to(device)
        self.value_cache = torch.randint(-100, 100, (NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), generator=gen,
                                         dtype=torch.int8).to(device)
        self._c8_k_aq_scale = (torch.rand(HEAD_DIM, generator=gen) * 0.02 + 0.01).to(device)
        self._c8_k_aq_offset = torch.randn(HEAD_DIM, generator=gen).to(device)
        self._c8_v_aq_scale = (torch.rand(HEAD_DIM, generator=gen) * 0.02 + 0.01).to(device)
        self._c8_v_aq_offset = torch.randn(HEAD_DIM, generator=gen).to(device)


class AscendC8AttentionBackendImpl:
    enable_c8_quant = True

    def __init__(self, graph_params, variant):
        self.graph_params, self.variant = graph_params, variant
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def forward(self, layer, query, attn_metadata, output):
        if _EXTRA_CTX.capturing:
            attn_output, num_tokens = self.full_graph_fia(query, attn_metadata, output, layer)
            output[:num_tokens] = attn_output[:num_tokens]
            return output
        return self._forward_c8_decode(query, attn_metadata, output, layer)

    def _forward_c8_decode(self, query, attn_metadata, output, layer):
        """C8 decode via FIA V1 BNSD with native paged INT8 KV + per-channel antiquant (eager)."""
        batch_size = len(attn_metadata.seq_lens_list)
        attn_output = npu_fused_infer_attention_score(
            query[:batch_size].unsqueeze(2), layer.key_cache, layer.value_cache,
            key_antiquant_scale=layer._c8_k_aq_scale, key_antiquant_offset=layer._c8_k_aq_offset,
            value_antiquant_scale=layer._c8_v_aq_scale, value_antiquant_offset=layer._c8_v_aq_offset,
            block_table=attn_metadata.block_tables,
            actual_seq_lengths_kv=torch.tensor(attn_metadata.seq_lens_list, device=query.device),
            atten_mask=None, sparse_mode=0, scale=self.scale)
        output[:batch_size] = attn_output.squeeze(2)
        return output

    def full_graph_fia(self, query, attn_metadata, output, layer):
        """Capture-only: record the task's arguments for later updates, then launch it in a task group."""
        graph_params = self.graph_params
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        attn_mask = attn_metadata.attn_mask
        sparse_mode = 3 if attn_metadata.causal else 0
        if self.enable_c8_quant:
            # TODO: Convert kvcache to NZ, and change layerout from BNSD to TND.
            query = query.unsqueeze(2)
            attn_mask = None
            sparse_mode = 0
        recorded_mask = attn_metadata.attn_mask if self.variant == "bug" else attn_mask
        graph_params.attn_params[num_tokens].append((
            query, layer.key_cache, layer.value_cache, attn_metadata.block_tables, recorded_mask,
            BLOCK_SIZE, attn_metadata.seq_lens_list, attn_metadata.actual_seq_lengths_q, NUM_HEADS, NUM_HEADS,
            self.scale, output, layer._c8_k_aq_scale, layer._c8_k_aq_offset, layer._c8_v_aq_scale,
            layer._c8_v_aq_offset))
        handle = graph_params.free_tasks.pop(0)           # torch.npu.graph_task_group_begin(stream)
        attn_output = npu_fused_infer_attention_score(
            query, layer.key_cache, layer.value_cache,
            key_antiquant_scale=layer._c8_k_aq_scale, key_antiquant_offset=layer._c8_k_aq_offset,
            value_antiquant_scale=layer._c8_v_aq_scale, value_antiquant_offset=layer._c8_v_aq_offset,
            block_table=attn_metadata.block_tables, actual_seq_lengths_kv=handle.actual_seq_lengths_kv,
            atten_mask=handle.atten_mask, sparse_mode=sparse_mode, scale=self.scale)
        graph_params.handles[num_tokens].append(handle)   # torch.npu.graph_task_group_end(stream)
        return attn_output.squeeze(2), num_tokens


def update_graph_params(graph_params, attn_metadata, num_tokens):
    """Before each FULL replay: re-launch every layer's FIA task with the step's KV lengths and the recorded
    arguments (C8 tasks keep BNSD and ``sparse_mode = 0``)."""
    for param, handle in zip(graph_params.attn_params[num_tokens], graph_params.handles[num_tokens]):
        (query, key_cache, value, block_tables, attn_mask, block_size, seq_lens, query_start_loc, num_kv_heads,
         num_heads, scale, attn_output, c8_k_aq_scale, c8_k_aq_offset, c8_v_aq_scale, c8_v_aq_offset) = param
        seq_lens = attn_metadata.seq_lens_list
        handle.rebind(atten_mask=attn_mask, actual_seq_lengths_kv=seq_lens)


class Model:
    def __init__(self, device, graph_params, variant):
        gen = generator(8779)
        self.layers = [AttentionLayer(gen, device) for _ in range(NUM_LAYERS)]
        self.impl = AscendC8AttentionBackendImpl(graph_params, variant)

    def forward(self, hidden_states, attn_metadata):
        h = hidden_states
        for layer in self.layers:
            q = (h @ layer.wq).view(-1, NUM_HEADS, HEAD_DIM)
            out = torch.empty_like(q)
            attn = self.impl.forward(layer, q, attn_metadata, out)
            h = h + attn.reshape(-1, HIDDEN) @ layer.wo
        return h


STEPS = [  # block tables and KV lengths of the two decoding requests
    ([[3, 5, 7, 2], [4, 6, 8, 9]], [5, 7]),
    ([[3, 5, 7, 2], [4, 6, 8, 9]], [6, 8]),
    ([[1, 7, 3, 5], [9, 2, 6, 4]], [8, 3]),
]


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(1)
    hiddens = [torch.randn(BATCH, HIDDEN, generator=gen).to(device) for _ in STEPS]

    def eager():
        model = Model(device, GraphParams(device), variant)
        builder = AscendAttentionMetadataBuilder(device)
        return [model.forward(h, builder.build(*step)).clone() for h, step in zip(hiddens, STEPS)]

    def served():
        graph_params = GraphParams(device)
        model = Model(device, graph_params, variant)
        builder = AscendAttentionMetadataBuilder(device)
        hidden_states = torch.zeros(BATCH, HIDDEN, device=device)
        # build_for_graph_capture: a dummy decode batch
        dummy = builder.build([[0, 1, 2, 3]] * BATCH, [MAX_CTX] * BATCH)

        def aclgraph_forward():
            _EXTRA_CTX.capturing = torch.cuda.is_current_stream_capturing()
            try:
                return model.forward(hidden_states, dummy)
            finally:
                _EXTRA_CTX.capturing = False

        tasks = graph_params.free_tasks
        g, out = capture(aclgraph_forward, device=device, owner="ACLGraphWrapper (FULL_DECODE_ONLY)",
                         name=f"decode bs={BATCH}",
                         static={"hidden_states": hidden_states, "block_tables": builder.block_tables,
                                 **{f"fia_task{i}.actual_seq_lengths_kv": t.actual_seq_lengths_kv
                                    for i, t in enumerate(tasks)},
                                 **{f"fia_task{i}.atten_mask": t.atten_mask for i, t in enumerate(tasks)}},
                         state={**{f"key_cache.{i}": lay.key_cache for i, lay in enumerate(model.layers)},
                                **{f"value_cache.{i}": lay.value_cache for i, lay in enumerate(model.layers)}})
        outs = []
        for h, step in zip(hiddens, STEPS):
            attn_metadata = builder.build(*step)
            hidden_states.copy_(h)
            update_graph_params(graph_params, attn_metadata, BATCH)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
