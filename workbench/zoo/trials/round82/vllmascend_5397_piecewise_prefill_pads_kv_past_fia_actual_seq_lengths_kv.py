"""Piecewise ACL graph, MHA prefill: FIA gets query trimmed to the real tokens but K/V at the padded graph size.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/5397 ("[bugfix] Fix MHA model runtime error in aclgraph
mode", vllm-project/vllm-ascend, commit bc5b7a5fb5, merged 2025-12-26).
Symptom: MHA models (MiniCPM-2B, Baichuan-7B) crash in piecewise ACL-graph mode on a prefill whose token count is
below its graph size: "(E89999): When layout is TND and PA not enabled, keyT(8) and valueT(8) must be equal to the
last element of actualSeqenceLengthKV(5) [CheckInputShapeWhenLayoutIsTND, prompt_flash_attention_tiling.cpp]". The
e2e test of MiniCPM-2B had been disabled ("TODO: revert me when minicpm is fixed"). Eager mode runs the same prompts.
Mechanism: ``NPUModelRunner._prepare_inputs`` (``vllm_ascend/worker/model_runner_v1.py``) pads the step to
``num_input_tokens = vllm_config.pad_for_cudagraph(total_num_scheduled_tokens)`` when ACL graphs are on and the step
fits the largest capture size (eager: ``num_input_tokens = total_num_scheduled_tokens``), so the graph pieces run at
the padded size and hand attention (the splitting op, run eagerly between the pieces) padded query/key/value. The
metadata is real-sized: ``AscendAttentionMetadataBuilder.build`` sets ``actual_seq_lengths_q =
query_start_loc_cpu[1:].tolist()`` (cumulative real lengths). ``AscendAttentionBackendImpl
.forward_fused_infer_attention`` (``vllm_ascend/attention/attention_v1.py``) trims the query,
``num_tokens = attn_metadata.actual_seq_lengths_q[-1]; query = query[:num_tokens]``, but for ``PrefillNoCache`` (all
requests fresh prefills, ``_build_attn_state``) ``_get_fia_params`` returns the raw ``key``/``value`` (not the paged
cache) with ``actual_seq_lengths_kv = attn_metadata.actual_seq_lengths_q`` and no block table. In TND layout without
PA, ``npu_fused_infer_attention_score`` requires ``key.shape[0] == value.shape[0] == actual_seq_lengths_kv[-1]``:
padded K/V (8 rows) meet real-sized lengths (5). Decode/chunked-prefill states read K/V from the paged cache (per
request ``seq_lens_list`` and a block table), so only the cache-less prefill passes the padded tensors through, and
only when the prefill is below its bucket (a prefill that fills the bucket has no padded rows).
Doctor: padded-shape-mismatch, at ``forward_fused_infer_attention`` (run on the piecewise graph's padded tensors, it
trims the query to the real token count but combines the padded K/V with the real-sized ``actual_seq_lengths_kv``;
that is the function the upstream diff changes).
Fix (upstream): in ``forward_fused_infer_attention``, after trimming the query,
``if attn_metadata.attn_state == AscendAttentionState.PrefillNoCache: key = key[:num_tokens]; value =
value[:num_tokens]``.
Modelled: a 2-layer MHA decoder (2 heads of 4, a learned position table standing in for rope, no norms or MLP);
``torch_npu`` is a stand-in class whose ``npu_fused_infer_attention_score`` does TND attention with sparse_mode 3
(bottom-right causal) and makes the TND shape checks (queryT, and keyT/valueT without PA); ``_npu_reshape_and_cache``
writes the paged cache. Piecewise graphs: one piece before layer 0's attention, one between the attentions, one
after, captured per size (2 and 8) by ``_dummy_run`` with no attention metadata (attention fills its output with
0, as upstream), sharing one pool; attention (``unified_attention_with_output``) runs eagerly between the replays.
Decode uses FIA over the paged cache (the ``_npu_paged_attention`` branch is left out). The FULL-graph
``full_graph_fia`` path, DP, sequence parallelism and the sampler's extras are left out; sampling is greedy. The model is MHA, as in the report (the PR's
test adds a GQA MiniCPM4 beside it; why GQA models escaped the check was not traced).
Workload: requests A (3 tokens) and B (5 tokens) prefill together (8 tokens, fills bucket 8), decode once and
finish; then C (2) and D (3) prefill together: 5 tokens padded to 8 (the upstream numbers), then decode once.
"""
from __future__ import annotations

import enum

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/5397"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "forward_fused_infer_attention"
SYMPTOM = ("MHA models in piecewise ACL-graph mode: a prefill below its graph size crashes FIA: keyT(8) and "
           "valueT(8) must be equal to the last element of actualSeqenceLengthKV(5)")

VOCAB, NUM_HEADS, HEAD_SIZE, NUM_LAYERS, MAX_POS = 16, 2, 4, 2, 16
NUM_KV_HEADS = NUM_HEADS                               # MHA
HIDDEN = NUM_HEADS * HEAD_SIZE
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 12, 2
MAX_NUM_TOKENS, MAX_NUM_REQS = 8, 4
CUDAGRAPH_BATCH_SIZES = [2, 8]                         # compilation_config.cudagraph_capture_sizes


# --- torch_npu (stand-in) --------------------------------------------------------------------------------------

class torch_npu:  # noqa: N801 - the library's name
    @staticmethod
    def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
        key_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)[slot_indices] = key
        value_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)[slot_indices] = value

    @staticmethod
    def npu_fused_infer_attention_score(query, key, value, atten_mask=None, block_table=None, input_layout="TND",
                                        block_size=128, actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                        num_key_value_heads=1, num_heads=1, scale=1.0, sparse_mode=3):
        """TND layout. Without PA (``block_table`` None) K/V are token-major and ``actual_seq_lengths_kv`` is
        cumulative, like ``actual_seq_lengths``; with PA they are the paged cache and the lengths are per request."""
        assert input_layout == "TND" and sparse_mode == 3
        if query.shape[0] != actual_seq_lengths[-1]:
            raise RuntimeError(f"(E89999): When layout is TND, queryT({query.shape[0]}) must be equal to the last "
                               f"element of actualSequenceLengthQ({actual_seq_lengths[-1]})")
        if block_table is None:
            if not key.shape[0] == value.shape[0] == actual_seq_lengths_kv[-1]:
                raise RuntimeError(
                    f"(E89999): When layout is TND and PA not enabled, keyT({key.shape[0]}) and valueT("
                    f"{value.shape[0]}) must be equal to the last element of actualSeqenceLengthKV("
                    f"{actual_seq_lengths_kv[-1]})[FUNC:CheckInputShapeWhenLayoutIsTND]"
                    f"[FILE:prompt_flash_attention_tiling.cpp]")
        out = torch.empty_like(query)
        q_end = kv_end = 0
        for b, q_cum in enumerate(actual_seq_lengths):
            q_start, q_end = q_end, q_cum
            if block_table is None:
                kv_start, kv_end = kv_end, actual_seq_lengths_kv[b]
                k, v = key[kv_start:kv_end], value[kv_start:kv_end]
            else:
                kv_len = actual_seq_lengths_kv[b]
                t = torch.arange(kv_len, device=query.device)
                slots = block_table[b, t // block_size] * block_size + t % block_size
                k = key.reshape(-1, num_key_value_heads, HEAD_SIZE)[slots]
                v = value.reshape(-1, num_key_value_heads, HEAD_SIZE)[slots]
            nq, nk = q_end - q_start, k.shape[0]
            allowed = (torch.arange(nk, device=query.device)[None, :]
                       <= torch.arange(nq, device=query.device)[:, None] + (nk - nq))      # rightDownCausal
            scores = torch.einsum("qhd,khd->hqk", query[q_start:q_end], k) * scale
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
        return out, None


# --- vllm_ascend/attention/attention_v1.py ---------------------------------------------------------------------

class AscendAttentionState(enum.Enum):
    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3


class AscendMetadata:
    def __init__(self, attn_state, num_actual_tokens, seq_lens_list, actual_seq_lengths_q, block_tables,
                 slot_mapping):
        self.attn_state = attn_state
        self.num_actual_tokens = num_actual_tokens                # tokens excluding padding
        self.seq_lens_list = seq_lens_list
        self.actual_seq_lengths_q = actual_seq_lengths_q          # cumulative real query lengths
        self.block_tables = block_tables
        self.slot_mapping = slot_mapping


class AscendAttentionMetadataBuilder:
    def build(self, common_attn_metadata):
        num_reqs = common_attn_metadata["num_reqs"]
        num_actual_tokens = common_attn_metadata["num_actual_tokens"]
        query_start_loc_cpu = common_attn_metadata["query_start_loc_cpu"][:num_reqs + 1]
        seq_lens = common_attn_metadata["seq_lens_cpu"][:num_reqs]
        return AscendMetadata(
            attn_state=common_attn_metadata["attn_state"],
            num_actual_tokens=num_actual_tokens,
            seq_lens_list=seq_lens.tolist(),
            actual_seq_lengths_q=query_start_loc_cpu[1:].tolist(),
            block_tables=common_attn_metadata["block_table_tensor"],
            slot_mapping=common_attn_metadata["slot_mapping"][:num_actual_tokens])


class AscendAttentionBackendImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, variant):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.variant = variant
        self.key_cache = self.value_cache = None

    def _get_fia_params(self, key, value, attn_metadata):
        if attn_metadata.attn_state == AscendAttentionState.PrefillNoCache:
            block_size = 128
            block_table = None
            actual_seq_lengths_kv = attn_metadata.actual_seq_lengths_q
        else:                                  # DecodeOnly / chunked prefill: K/V from the paged cache
            num_block, block_size, _, _ = self.key_cache.shape
            key = self.key_cache.view(num_block, block_size, -1)
            value = self.value_cache.view(num_block, block_size, -1)
            block_table = attn_metadata.block_tables
            actual_seq_lengths_kv = attn_metadata.seq_lens_list
        return key, value, block_size, block_table, actual_seq_lengths_kv

    def forward_fused_infer_attention(self, query, key, value, attn_metadata, output):
        key, value, block_size, block_table, actual_seq_lengths_kv = self._get_fia_params(key, value, attn_metadata)
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        query = query[:num_tokens]
        if self.variant == "fix" and attn_metadata.attn_state == AscendAttentionState.PrefillNoCache:
            key = key[:num_tokens]
            value = value[:num_tokens]
        attn_output, _ = torch_npu.npu_fused_infer_attention_score(
            query=query, key=key, value=value, atten_mask=None, block_table=block_table, input_layout="TND",
            block_size=block_size, actual_seq_lengths=attn_metadata.actual_seq_lengths_q,
            actual_seq_lengths_kv=actual_seq_lengths_kv, num_key_value_heads=self.num_kv_heads,
            num_heads=self.num_heads, scale=self.scale, sparse_mode=3)
        attn_output = attn_output.view(num_tokens, self.num_heads, self.head_size)
        output[:num_tokens] = attn_output[:num_tokens]
        return output

    def reshape_and_cache(self, key, value, kv_cache, attn_metadata):
        if self.key_cache is None:
            self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
        slots = attn_metadata.slot_mapping
        torch_npu._npu_reshape_and_cache(key=key[:attn_metadata.num_actual_tokens],
                                         value=value[:attn_metadata.num_actual_tokens],
                                         key_cache=self.key_cache, value_cache=self.value_cache,
                                         slot_indices=slots[:attn_metadata.num_actual_tokens])
        return key, value

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)
        output = output.view(-1, self.num_heads, self.head_size)
        if attn_metadata is None:              # _dummy_run of a PIECEWISE capture builds no attention metadata
            return output.fill_(0)
        key, value = self.reshape_and_cache(key, value, kv_cache, attn_metadata)
        return self.forward_fused_infer_attention(query, key, value, attn_metadata, output)


# --- vllm: forward context, Attention layer, the splitting op ------------------------------------------------

class ForwardContext:
    attn_metadata: dict | None = None
    no_compile_layers: dict = {}


_forward_context = ForwardContext()


class Attention:
    def __init__(self, prefix, device, variant):
        self.layer_name = prefix
        self.impl = AscendAttentionBackendImpl(NUM_HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, NUM_KV_HEADS, variant)
        self.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=device)
        _forward_context.no_compile_layers[prefix] = self


def unified_attention_with_output(query, key, value, output, layer_name):
    """The piecewise split point: runs eagerly, reads this step's metadata from the forward context."""
    self = _forward_context.no_compile_layers[layer_name]
    attn_metadata = _forward_context.attn_metadata
    if isinstance(attn_metadata, dict):
        attn_metadata = attn_metadata[layer_name]
    self.impl.forward(self, query, key, value, self.kv_cache, attn_metadata, output)


class MiniCPMForCausalLM:
    """An MHA decoder, cut where torch.compile splits it (at each attention)."""

    def __init__(self, device, variant):
        gen = generator(5397)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embed_positions = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.qkv_proj = [randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.o_proj = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.attn = [Attention(f"model.layers.{i}.self_attn.attn", device, variant) for i in range(NUM_LAYERS)]

    def qkv(self, i, h):
        q, k, v = (h @ self.qkv_proj[i]).split(HIDDEN, dim=-1)
        output = torch.empty(h.shape[0], HIDDEN, dtype=h.dtype, device=h.device)   # Attention.forward's output
        return q.contiguous(), k.contiguous(), v.contiguous(), output

    def submod_0(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        return (h,) + self.qkv(0, h)

    def submod_after_attn(self, i, h, attn_output):
        h = h + torch.tanh(attn_output @ self.o_proj[i])
        return (h,) + self.qkv(i + 1, h) if i + 1 < NUM_LAYERS else (h,)

    def forward(self, input_ids, positions):
        h, q, k, v, out = self.submod_0(input_ids, positions)
        for i in range(NUM_LAYERS):
            unified_attention_with_output(q, k, v, out, self.attn[i].layer_name)
            h, *rest = self.submod_after_attn(i, h, out)
            if rest:
                q, k, v, out = rest
        return h

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm_ascend/compilation: the piecewise ACL graphs ----------------------------------------------------------

class PiecewiseACLGraphs:
    """One set of pieces per capture size; attention runs eagerly between their replays."""

    def __init__(self, model, runner, device):
        self.model, self.runner, self.device = model, runner, device
        self.pool = graph_pool_handle(device)
        self.pieces: dict[int, list] = {}

    def capture(self, size):
        m, r = self.model, self.runner
        static = {"input_ids": r.input_ids, "positions": r.positions}
        pieces = [capture(lambda: m.submod_0(r.input_ids[:size], r.positions[:size]), device=self.device,
                          pool=self.pool, name=f"piecewise submod_0 size {size}",
                          owner="ACLGraphWrapper (PIECEWISE)", static=static)]
        for i in range(NUM_LAYERS):
            h, q, k, v, out = pieces[-1][1]
            unified_attention_with_output(q, k, v, out, m.attn[i].layer_name)
            pieces.append(capture(lambda i=i, h=h, out=out: m.submod_after_attn(i, h, out), device=self.device,
                                  pool=self.pool, name=f"piecewise submod_{i + 1} size {size}",
                                  owner="ACLGraphWrapper (PIECEWISE)"))
        self.pieces[size] = pieces

    def __call__(self, size, num_actual_tokens):
        r = self.runner
        outs = None
        for i, (g, outputs) in enumerate(self.pieces[size]):
            padded = ({"input_ids": r.input_ids} if i == 0 else
                      {"attn_output": self.pieces[size][i - 1][1][4]})      # never written past the real rows
            outs = replay(g, outputs, real=num_actual_tokens, size=size, padded=padded)
            if i < NUM_LAYERS:
                _, q, k, v, out = outs
                unified_attention_with_output(q, k, v, out, self.model.attn[i].layer_name)
        return outs[0]


# --- vllm_ascend/worker/model_runner_v1.py (reduced) -----------------------------------------------------------

class CachedRequestState:
    def __init__(self, req_id, token_ids, block_ids):
        self.req_id, self.token_ids, self.block_ids = req_id, token_ids, block_ids
        self.num_computed_tokens = 0


class NPUModelRunner:
    def __init__(self, model, device, use_aclgraph):
        self.model, self.device, self.use_aclgraph = model, device, use_aclgraph
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.long, device=device)
        self.query_start_loc_np = np.zeros(MAX_NUM_REQS + 1, dtype=np.int64)
        self.seq_lens_np = np.zeros(MAX_NUM_REQS, dtype=np.int64)
        self.cudagraph_batch_sizes = CUDAGRAPH_BATCH_SIZES
        self.attn_metadata_builder = AscendAttentionMetadataBuilder()
        self.aclgraphs = PiecewiseACLGraphs(model, self, device) if use_aclgraph else None

    def pad_for_cudagraph(self, num_tokens):
        return next(b for b in self.cudagraph_batch_sizes if b >= num_tokens)

    def capture_model(self):
        for num_tokens in reversed(self.cudagraph_batch_sizes):
            self._dummy_run(num_tokens)

    def _dummy_run(self, num_tokens):
        _forward_context.attn_metadata = None          # PIECEWISE: no attention metadata in the dummy run
        self.aclgraphs.capture(num_tokens)

    def _build_attn_state(self, num_reqs, num_scheduled_tokens):
        if np.array_equal(self.seq_lens_np[:num_reqs], num_scheduled_tokens):
            return AscendAttentionState.PrefillNoCache
        if np.all(num_scheduled_tokens == 1):
            return AscendAttentionState.DecodeOnly
        return AscendAttentionState.ChunkedPrefill

    def _prepare_inputs(self, reqs, num_scheduled_tokens):
        num_reqs = len(reqs)
        num_scheduled_tokens = np.asarray(num_scheduled_tokens, dtype=np.int64)
        total_num_scheduled_tokens = int(num_scheduled_tokens.sum())
        if self.use_aclgraph and total_num_scheduled_tokens <= self.cudagraph_batch_sizes[-1]:
            # Add padding to the batch size.
            num_input_tokens = self.pad_for_cudagraph(total_num_scheduled_tokens)
        else:
            # Eager mode.
            num_input_tokens = total_num_scheduled_tokens
        cu_num_tokens = np.cumsum(num_scheduled_tokens)
        self.query_start_loc_np[0] = 0
        self.query_start_loc_np[1:num_reqs + 1] = cu_num_tokens
        self.query_start_loc_np[num_reqs + 1:] = cu_num_tokens[-1]
        ids, pos, slots = [], [], []
        for r, n in zip(reqs, num_scheduled_tokens.tolist()):
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                ids.append(r.token_ids[p])
                pos.append(p)
                slots.append(r.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        self.seq_lens_np[:num_reqs] = [r.num_computed_tokens + n for r, n in zip(reqs, num_scheduled_tokens)]
        self.input_ids[:total_num_scheduled_tokens].copy_(torch.tensor(ids))
        self.positions[:total_num_scheduled_tokens].copy_(torch.tensor(pos))
        self.positions[total_num_scheduled_tokens:num_input_tokens].zero_()
        self.slot_mapping[:total_num_scheduled_tokens].copy_(torch.tensor(slots))
        self.block_table[:num_reqs].copy_(torch.tensor([r.block_ids for r in reqs]))
        attn_state = self._build_attn_state(num_reqs, num_scheduled_tokens)
        common_attn_metadata = {
            "num_reqs": num_reqs, "num_actual_tokens": total_num_scheduled_tokens,
            "query_start_loc_cpu": torch.from_numpy(self.query_start_loc_np.copy()),
            "seq_lens_cpu": torch.from_numpy(self.seq_lens_np.copy()), "attn_state": attn_state,
            "block_table_tensor": self.block_table[:num_reqs], "slot_mapping": self.slot_mapping}
        attn_metadata = self.attn_metadata_builder.build(common_attn_metadata)
        logits_indices = torch.from_numpy(cu_num_tokens - 1).to(self.device)
        return attn_metadata, total_num_scheduled_tokens, num_input_tokens, logits_indices

    def execute_model(self, reqs, num_scheduled_tokens):
        attn_metadata, num_tokens, num_input_tokens, logits_indices = self._prepare_inputs(reqs, num_scheduled_tokens)
        _forward_context.attn_metadata = {a.layer_name: attn_metadata for a in self.model.attn}
        if self.use_aclgraph and num_input_tokens in self.aclgraphs.pieces:
            hidden_states = self.aclgraphs(num_input_tokens, num_tokens)
        else:
            hidden_states = self.model.forward(self.input_ids[:num_input_tokens], self.positions[:num_input_tokens])
        logits = self.model.compute_logits(hidden_states[logits_indices]).clone()
        for r, n, tok in zip(reqs, num_scheduled_tokens, logits.argmax(-1).tolist()):   # greedy sampler
            r.num_computed_tokens += n
            r.token_ids.append(tok)
        return logits


# --- the workload ----------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    gen = generator(53970)
    prompt_lens = {"A": 3, "B": 5, "C": 2, "D": 3}
    prompts = {k: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for k, n in prompt_lens.items()}
    block_ids = {"A": [1, 2], "B": [3, 4], "C": [5, 6], "D": [7, 8]}
    waves = [("A", "B"), ("C", "D")]          # 3 + 5 = 8 tokens (fills the bucket); 2 + 3 = 5 tokens (padded to 8)
    decode_steps = 1

    def serve(use_aclgraph):
        model = MiniCPMForCausalLM(device, variant)
        runner = NPUModelRunner(model, device, use_aclgraph)
        if use_aclgraph:
            runner.capture_model()
        outs = []
        for wave in waves:
            reqs = [CachedRequestState(k, list(prompts[k]), block_ids[k]) for k in wave]
            outs.append(runner.execute_model(reqs, [len(r.token_ids) for r in reqs]))        # prefill
            for _ in range(decode_steps):
                outs.append(runner.execute_model(reqs, [1] * len(reqs)))                      # decode
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
