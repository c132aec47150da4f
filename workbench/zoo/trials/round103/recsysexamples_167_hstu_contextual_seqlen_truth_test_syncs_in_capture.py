"""NVIDIA recsys-examples HSTU inference: ``forward_output`` tests ``if jd.contextual_seqlen`` (a device tensor's truth value, a host read), so capturing the HSTU block's CUDA graphs fails for a model with contextual features.

Upstream: https://github.com/NVIDIA/recsys-examples/pull/167 ("Fix several errors:", NVIDIA/recsys-examples, by
geoffreyQiu (Junyi Qiu), merged 2025-09-17 as a803d1ee). Read: the PR description ("Add check for kvcache page size at
initialization / Fix cuda graph capture with contextual features / Fix shape mismatch of padded input batch for
inference eval"), the whole diff (``modules/paged_hstu_infer_layer.py``: ``if jd.contextual_seqlen`` ->
``if jd.contextual_seqlen is not None``; the other hunks are the page-size assert, the eval-batch padding strip and the
KV-cache sizes), and at the parent: ``paged_hstu_infer_layer.py`` (``PagedHSTUInferLayer.forward_naive``,
``forward_input``, ``forward_output``, ``uvqk_buffer_``, ``output_buffer_``), ``hstu_block_inference.py``
(``predict``, ``predict_naive``, ``predict_cudagraph``, ``set_cudagraph``, ``capture_graph``: three warmups through
``predict_naive``, then one graph per layer boundary), ``model/inference_ranking_gr.py``
(``get_jagged_metadata_buffer``, ``copy_jagged_metadata``, ``InferenceRankingGR.__init__``/``forward``),
``jagged_data.py`` and ``inference_gr_ranking.py`` (``max_batch_size = 1``, cudagraph batch sizes ``[1]``, KuaiRand
with its contextual features).
Symptom: ``InferenceRankingGR(..., use_cudagraph=True)`` for a dataset with contextual features (KuaiRand's user
features) cannot be built: ``set_cudagraph`` -> ``capture_graph`` fails in the first graph that records a
``forward_output`` ("operation not permitted when stream is capturing"); the eager model (``use_cudagraph=False``,
``forward_naive``) ranks. A model without contextual features captures (``contextual_seqlen`` is None).
Mechanism: with contextual features the static jagged metadata (``get_jagged_metadata_buffer``) holds a device
``contextual_seqlen`` of ``max_batch_size`` entries. ``forward_output`` chooses the attention's ``num_contexts`` with a
Python conditional on that tensor: ``jd.contextual_seqlen[:batch_size] if jd.contextual_seqlen else None``. For the
example's single-request batch (``max_batch_size = 1``) ``bool()`` of the one-element tensor is a device-to-host read
(``aten._local_scalar_dense`` and a stream sync). The warmups run it eagerly (the static buffer holds zeros: False, so
they attend without contexts) and pass; inside ``torch.cuda.graph`` the read is refused and the capture fails.
(With ``max_batch_size`` > 1 the same line raises "Boolean value of Tensor with more than one value is ambiguous"
already in the warmup.) ``forward_naive`` passes ``jd.contextual_seqlen`` straight through and never asks.
Doctor: sync-in-capture, at forward_output (the truth test of a device tensor is a host synchronisation inside the
capture of ``capture_graph``'s second graph; the fix changed exactly that line).
Fix (upstream): ``num_contexts=jd.contextual_seqlen[:batch_size] if jd.contextual_seqlen is not None else None``: a
test of the Python attribute, decided on the host from the buffer's presence; the graph records the slice.
Modelled: ``JaggedData``, ``get_jagged_metadata_buffer``, ``copy_jagged_metadata``, ``PagedHSTUInferLayer``
(layer norm, fused uvqk projection into ``uvqk_buffer_``, SiLU, HSTU attention, output norm gated by ``u``,
projection plus residual into ``output_buffer_``), ``HSTUBlockInference`` (``predict``, ``predict_naive``,
``predict_cudagraph`` with its padding of the token count to a captured length, ``set_cudagraph``, ``capture_graph``
with its dummy metadata and one graph per layer boundary in a shared pool) and ``InferenceRankingGR.forward`` (copy
into the static hidden states and jagged metadata, block, candidate head). Stand-ins: ``hstu_attn_varlen_func`` is a
dense masked SiLU attention over the jagged batch (causal; contextual keys visible to their whole sequence; each
candidate sees the history and itself), written with tensor ops only; the embedding collection and preprocessor are
small tables (contextual features, then interleaved item/action tokens, then candidates, plus position embeddings);
the MLP head scores the normalised candidate outputs. No paged KV cache: every request is a user's first visit, so
nothing is cached or onloaded (the KV append and the onload events are left out). float64.
Workload: three ranking requests (one user each, 3 contextual features; 5, 9 and 2 history items; 2, 3 and 4
candidates: 15, 24 and 11 tokens), ``max_seq_len`` 32, graphs for batch 1 at 16 and 32 tokens (2 layers: 3 graphs
each). Bug: building the served model raises CaptureError at the truth test in ``forward_output`` (the capture of the
32-token graph that holds layer 0's ``forward_output``); fix: the logits of all 9 candidates equal eager (max
error 4.4e-16).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/recsys-examples/pull/167"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward_output"
SYMPTOM = ("HSTU ranking inference with contextual features: capturing the block's CUDA graphs fails on "
           "`if jd.contextual_seqlen` in forward_output (a device tensor's truth value read on the host)")

HIDDEN, NUM_HEADS, HEAD_DIM, NUM_LAYERS = 16, 2, 8, 2
MAX_BATCH_SIZE, MAX_SEQ_LEN, NUM_CONTEXTUAL = 1, 32, 3
ITEM_VOCAB, ACTION_VOCAB, CONTEXT_VOCAB, NUM_TASKS = 40, 4, 12, 2
CUDAGRAPH_CONFIGS = {"batch_size": [1], "length_per_sequence": [16, 32]}
DTYPE = torch.float64

_variant = "bug"


# --- examples/hstu/modules/jagged_data.py ----------------------------------------------------------------------------

@dataclasses.dataclass
class JaggedData:
    values: Optional[torch.Tensor]
    seqlen: torch.Tensor                    # (batch_size, )
    seqlen_offsets: torch.Tensor            # (batch_size + 1)
    max_seqlen: int
    max_num_candidates: int = 0
    num_candidates: Optional[torch.Tensor] = None
    num_candidates_offsets: Optional[torch.Tensor] = None
    contextual_max_seqlen: int = 0
    contextual_seqlen: Optional[torch.Tensor] = None
    contextual_seqlen_offsets: Optional[torch.Tensor] = None
    has_interleaved_action: bool = False


# --- examples/hstu/model/inference_ranking_gr.py (metadata buffers) -----------------------------------------------------

def get_jagged_metadata_buffer(max_batch_size, max_seq_len, contextual_max_seqlen, device):
    int_dtype = torch.int32
    default_num_candidates = max_seq_len // 2
    return JaggedData(
        values=None, max_seqlen=max_seq_len,
        seqlen=torch.full((max_batch_size,), max_seq_len, dtype=int_dtype, device=device),
        seqlen_offsets=torch.arange(end=max_batch_size + 1, dtype=int_dtype, device=device) * max_seq_len,
        max_num_candidates=default_num_candidates,
        num_candidates=torch.full((max_batch_size,), default_num_candidates, dtype=int_dtype, device=device),
        num_candidates_offsets=torch.arange(end=max_batch_size + 1, dtype=int_dtype, device=device)
        * default_num_candidates,
        contextual_max_seqlen=contextual_max_seqlen,
        contextual_seqlen=torch.full((max_batch_size,), 0, dtype=int_dtype, device=device)
        if contextual_max_seqlen > 0 else None,
        contextual_seqlen_offsets=torch.full((max_batch_size + 1,), 0, dtype=int_dtype, device=device)
        if contextual_max_seqlen > 0 else None,
        has_interleaved_action=True)


def copy_jagged_metadata(dst_metadata, src_metata):
    def copy_tensor(dst, src):
        dst[: src.shape[0], ...].copy_(src, non_blocking=True)
        dst[src.shape[0]:, ...] = 0

    def copy_offsets(dst, src):
        dst[: src.shape[0], ...].copy_(src, non_blocking=True)
        dst[src.shape[0]:, ...] = src[-1, ...]

    bs = src_metata.seqlen.shape[0]
    dst_metadata.max_seqlen = src_metata.max_seqlen
    copy_tensor(dst_metadata.seqlen, src_metata.seqlen[:bs])
    copy_offsets(dst_metadata.seqlen_offsets, src_metata.seqlen_offsets[: bs + 1])
    dst_metadata.max_num_candidates = src_metata.max_num_candidates
    copy_tensor(dst_metadata.num_candidates, src_metata.num_candidates[:bs])
    copy_offsets(dst_metadata.num_candidates_offsets, src_metata.num_candidates_offsets[: bs + 1])
    dst_metadata.contextual_max_seqlen = src_metata.contextual_max_seqlen
    if src_metata.contextual_max_seqlen > 0:
        copy_tensor(dst_metadata.contextual_seqlen, src_metata.contextual_seqlen[:bs])
        copy_offsets(dst_metadata.contextual_seqlen_offsets, src_metata.contextual_seqlen_offsets[: bs + 1])


# --- hstu_attn.hstu_attn_varlen_func (stand-in) ------------------------------------------------------------------------

def hstu_attn_varlen_func(q, k, v, seq_offsets, max_seqlen, num_contexts=None, num_targets=None, alpha=1.0):
    """SiLU attention over a jagged batch; rows past ``seq_offsets[-1]`` (padding) attend to nothing."""
    T, B = q.shape[0], seq_offsets.shape[0] - 1
    t = torch.arange(T, device=q.device)
    bidx = torch.searchsorted(seq_offsets[1:].to(torch.int64), t, right=True)
    valid = bidx < B
    b = bidx.clamp(max=B - 1)
    start, end = seq_offsets[b].to(torch.int64), seq_offsets[b + 1].to(torch.int64)
    pos = t - start
    is_target = pos >= (end - start - num_targets[b].to(torch.int64))
    n_ctx = num_contexts[b].to(torch.int64) if num_contexts is not None else torch.zeros_like(pos)
    allowed = (bidx[:, None] == bidx[None, :]) & valid[:, None] & valid[None, :]
    allowed &= (pos[None, :] <= pos[:, None]) | (pos[None, :] < n_ctx[None, :])    # causal; contexts for all
    allowed &= ~is_target[None, :] | (t[None, :] == t[:, None])                     # a candidate sees only itself
    scores = F.silu(torch.einsum("qhd,khd->hqk", q, k) * alpha) / max_seqlen
    return torch.einsum("hqk,khd->qhd", scores * allowed, v)


# --- examples/hstu/modules/paged_hstu_infer_layer.py -------------------------------------------------------------------

class PagedHSTUInferLayer:
    """x = ln(x); u,v,q,k = silu(linear_bias(x)); attn = hstu_attn(q,k,v); out = linear(u * ln(attn)) + x."""

    def __init__(self, gen, device, layer_idx):
        self.layer_idx = layer_idx
        self._embedding_dim, self._num_heads = HIDDEN, NUM_HEADS
        self._linear_dim_per_head = self._attention_dim_per_head = HEAD_DIM
        self._alpha = 1.0 / (self._attention_dim_per_head ** 0.5)
        self._split_arg_list = [HEAD_DIM * NUM_HEADS] * 4
        self._max_seqlen = MAX_SEQ_LEN
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self._linear_uvqk_weight, self._linear_uvqk_bias = r(HIDDEN, 4 * HEAD_DIM * NUM_HEADS), r(4 * HEAD_DIM * NUM_HEADS)
        self._linear_proj_weight = r(HEAD_DIM * NUM_HEADS, HIDDEN)
        self._output_layernorm_weight = 1.0 + r(HEAD_DIM * NUM_HEADS, scale=0.1)
        self._output_layernorm_bias = r(HEAD_DIM * NUM_HEADS, scale=0.1)
        max_num_tokens = MAX_BATCH_SIZE * MAX_SEQ_LEN
        self.output_buffer_ = torch.empty(max_num_tokens, HIDDEN, dtype=DTYPE, device=device)
        self.uvqk_buffer_ = torch.empty(max_num_tokens, 4 * HEAD_DIM * NUM_HEADS, dtype=DTYPE, device=device)

    def _attention(self, user, value, query, key, seqlen_offsets, num_contexts, num_targets):
        value = value.reshape(-1, self._num_heads, self._linear_dim_per_head)
        query = query.reshape(-1, self._num_heads, self._attention_dim_per_head)
        key = key.reshape(-1, self._num_heads, self._attention_dim_per_head)
        jagged_attn_output = hstu_attn_varlen_func(query, key, value, seqlen_offsets, self._max_seqlen,
                                                   num_contexts=num_contexts, num_targets=num_targets,
                                                   alpha=self._alpha)
        jagged_attn_output = jagged_attn_output.reshape(-1, self._num_heads * self._linear_dim_per_head)
        return user * F.layer_norm(jagged_attn_output, [self._num_heads * self._linear_dim_per_head],
                                   self._output_layernorm_weight, self._output_layernorm_bias)

    def forward_naive(self, batch_size, num_tokens, layer_input, jd):
        normed_input = F.layer_norm(layer_input, [self._embedding_dim])
        mixed_uvqk = F.silu(torch.addmm(self._linear_uvqk_bias, normed_input, self._linear_uvqk_weight))
        user, value, query, key = torch.split(mixed_uvqk, self._split_arg_list, dim=-1)
        parallel_input = self._attention(user, value, query, key, jd.seqlen_offsets,
                                         num_contexts=jd.contextual_seqlen, num_targets=jd.num_candidates)
        return parallel_input @ self._linear_proj_weight + layer_input

    def forward_input(self, batch_size, num_tokens, input_buffer, jd):
        input_tensor = input_buffer[:num_tokens, ...]
        normed_input = F.layer_norm(input_tensor, [self._embedding_dim])
        torch.addmm(self._linear_uvqk_bias, normed_input, self._linear_uvqk_weight, out=self.uvqk_buffer_[:num_tokens])
        F.silu(self.uvqk_buffer_[:num_tokens, ...], inplace=True)
        return self.uvqk_buffer_[:num_tokens, ...]

    def forward_output(self, batch_size, num_tokens, input_buffer, jd):
        user, value, query, key = torch.split(self.uvqk_buffer_[:num_tokens, ...], self._split_arg_list, dim=-1)
        if _variant == "bug":
            num_contexts = jd.contextual_seqlen[:batch_size] if jd.contextual_seqlen else None
        else:
            num_contexts = jd.contextual_seqlen[:batch_size] if jd.contextual_seqlen is not None else None
        parallel_input = self._attention(user, value, query, key, jd.seqlen_offsets[: batch_size + 1],
                                         num_contexts=num_contexts, num_targets=jd.num_candidates[:batch_size])
        torch.add(parallel_input @ self._linear_proj_weight, input_buffer[:num_tokens, ...],
                  out=self.output_buffer_[:num_tokens, ...])
        return self.output_buffer_[:num_tokens, ...]


# --- examples/hstu/modules/hstu_block_inference.py ---------------------------------------------------------------------

class HSTUBlockInference:
    def __init__(self, gen, device):
        self.device = device
        self._attention_layers = [PagedHSTUInferLayer(gen, device, i) for i in range(NUM_LAYERS)]
        self._hstu_graph = None

    def predict(self, batch_size, num_tokens, hidden_states, jd, use_cudagraph=True):
        if self._hstu_graph is None or not use_cudagraph:
            hidden_data = hidden_states
            for hstu_layer in self._attention_layers:
                hidden_data = hstu_layer.forward_naive(batch_size, num_tokens, hidden_data, jd)
            return hidden_data
        return self.predict_cudagraph(batch_size, num_tokens, hidden_states)

    def predict_naive(self, batch_size, num_tokens, hidden_states, jd):
        jagged_metadata = JaggedData(
            values=None, max_seqlen=jd.max_seqlen, seqlen=jd.seqlen[:batch_size],
            seqlen_offsets=jd.seqlen_offsets[: batch_size + 1], max_num_candidates=jd.max_num_candidates,
            num_candidates=jd.num_candidates[:batch_size], num_candidates_offsets=jd.num_candidates_offsets[: batch_size + 1],
            contextual_max_seqlen=jd.contextual_max_seqlen, contextual_seqlen=jd.contextual_seqlen,
            contextual_seqlen_offsets=jd.contextual_seqlen_offsets, has_interleaved_action=jd.has_interleaved_action)
        hidden_data = hidden_states
        for hstu_layer in self._attention_layers:
            hstu_layer.forward_input(batch_size, num_tokens, hidden_data, jagged_metadata)
            hidden_data = hstu_layer.forward_output(batch_size, num_tokens, hidden_data, jagged_metadata)
        return hidden_data

    def predict_cudagraph(self, batch_size, num_tokens, hidden_states):
        if batch_size not in self._hstu_graph:
            batch_size = min([k for k in self._hstu_graph.keys() if k > batch_size], default=-1)
            if batch_size == -1:
                raise ValueError("No CUDA graph captured for this batch size")
        num_tokens_padded = num_tokens
        if num_tokens not in self._hstu_graph[batch_size]:
            num_tokens_padded = min([k for k in self._hstu_graph[batch_size].keys() if k > num_tokens], default=-1)
            if num_tokens_padded == -1:
                raise ValueError(f"No CUDA graph captured for #tokens {num_tokens}")
        graphs = self._hstu_graph[batch_size][num_tokens_padded]
        for idx, (g, out) in enumerate(graphs):
            replay(g, out, real=num_tokens, size=num_tokens_padded,
                   padded={"hidden_states": hidden_states} if idx == 0 else None)
        hstu_output = torch.zeros_like(hidden_states[:num_tokens, ...])
        hstu_output.copy_(self._attention_layers[-1].output_buffer_[:num_tokens, ...], non_blocking=True)
        return hstu_output

    def set_cudagraph(self, max_batch_size, max_seq_len, static_hidden_states, static_jagged_metadata,
                      cudagraph_configs):
        max_num_tokens = max_batch_size * max_seq_len
        bs_list, seqlen_list = cudagraph_configs["batch_size"], cudagraph_configs["length_per_sequence"]
        static = {"hidden_states": static_hidden_states, "seqlen": static_jagged_metadata.seqlen,
                  "seqlen_offsets": static_jagged_metadata.seqlen_offsets,
                  "num_candidates": static_jagged_metadata.num_candidates,
                  "num_candidates_offsets": static_jagged_metadata.num_candidates_offsets,
                  "contextual_seqlen": static_jagged_metadata.contextual_seqlen}
        events.static_buffers("InferenceRankingGR", {k: v for k, v in static.items() if v is not None})
        shared_graph_mempool = graph_pool_handle(self.device)
        self._hstu_graph = {max_batch_size: {}}
        self._hstu_graph[max_batch_size][max_num_tokens] = self.capture_graph(
            max_batch_size, max_num_tokens, static_hidden_states, static_jagged_metadata, shared_graph_mempool)
        for batch_size in bs_list:
            self._hstu_graph.setdefault(batch_size, {})
            for seq_len in seqlen_list:
                if seq_len > max_seq_len:
                    break
                num_tokens = seq_len * batch_size
                if num_tokens in self._hstu_graph[batch_size]:
                    continue
                self._hstu_graph[batch_size][num_tokens] = self.capture_graph(
                    batch_size, num_tokens, static_hidden_states, static_jagged_metadata, shared_graph_mempool)

    def capture_graph(self, batch_size, num_tokens, static_hidden_states, static_jagged_metadata, memory_pool):
        seqlen = num_tokens // batch_size
        int_kw = dict(dtype=static_jagged_metadata.num_candidates.dtype, device=self.device)
        static_jagged_metadata.seqlen_offsets[: batch_size + 1].copy_(torch.arange(end=batch_size + 1, **int_kw) * seqlen)
        default_num_candidates = seqlen // 2
        static_jagged_metadata.num_candidates[:batch_size].fill_(default_num_candidates)
        static_jagged_metadata.num_candidates_offsets[: batch_size + 1].copy_(
            torch.arange(end=batch_size + 1, **int_kw) * default_num_candidates)
        for _ in range(3):                                              # warmup
            with events.warmup():
                self.predict_naive(batch_size, num_tokens, static_hidden_states, static_jagged_metadata)
        layers, name = self._attention_layers, f"hstu bs={batch_size} tokens={num_tokens}"
        input_buffer = [static_hidden_states] + [layer.output_buffer_ for layer in layers]
        graphs = [capture(lambda: layers[0].forward_input(batch_size, num_tokens, static_hidden_states,
                                                          static_jagged_metadata),
                          device=self.device, pool=memory_pool, warmups=0, name=f"{name} [0]", owner="HSTUBlock")]
        for layer_idx in range(len(layers) - 1):
            def boundary(i=layer_idx):
                static_output = layers[i].forward_output(batch_size, num_tokens, input_buffer[i], static_jagged_metadata)
                return layers[i + 1].forward_input(batch_size, num_tokens, static_output, static_jagged_metadata)
            graphs.append(capture(boundary, device=self.device, pool=memory_pool, warmups=0,
                                  name=f"{name} [{layer_idx + 1}]", owner="HSTUBlock"))
        graphs.append(capture(lambda: layers[-1].forward_output(batch_size, num_tokens, input_buffer[-2],
                                                                static_jagged_metadata),
                              device=self.device, pool=memory_pool, warmups=0, name=f"{name} [{len(layers)}]",
                              owner="HSTUBlock"))
        return graphs


# --- examples/hstu/model/inference_ranking_gr.py (reduced) -------------------------------------------------------------

@dataclasses.dataclass
class Batch:
    contextual_ids: torch.Tensor        # one id per contextual feature
    item_ids: torch.Tensor              # history items
    action_ids: torch.Tensor            # one action per history item
    candidate_ids: torch.Tensor
    batch_size: int = 1


class InferenceRankingGR:
    def __init__(self, device, use_cudagraph=False, cudagraph_configs=None):
        gen = generator(167)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.device = device
        self._context_table, self._item_table = r(CONTEXT_VOCAB, HIDDEN), r(ITEM_VOCAB, HIDDEN)
        self._action_table, self._position_table = r(ACTION_VOCAB, HIDDEN), r(MAX_SEQ_LEN, HIDDEN, scale=0.1)
        self._hstu_block = HSTUBlockInference(gen, device)
        self._mlp = [(r(HIDDEN, 8), r(8, scale=0.1)), (r(8, NUM_TASKS), r(NUM_TASKS, scale=0.1))]
        self._hidden_states = randn(MAX_BATCH_SIZE * MAX_SEQ_LEN, HIDDEN, gen=gen, device=device).to(DTYPE)
        self._jagged_metadata = get_jagged_metadata_buffer(MAX_BATCH_SIZE, MAX_SEQ_LEN, NUM_CONTEXTUAL, device)
        self.use_cudagraph = use_cudagraph
        if use_cudagraph:
            self._hstu_block.set_cudagraph(MAX_BATCH_SIZE, MAX_SEQ_LEN, self._hidden_states, self._jagged_metadata,
                                           cudagraph_configs=cudagraph_configs)

    def _preprocessor(self, batch: Batch) -> JaggedData:
        """Contextual features, then item/action interleaved, then candidates; scaled, plus positions."""
        history = torch.stack([self._item_table[batch.item_ids], self._action_table[batch.action_ids]], 1)
        values = torch.cat([self._context_table[batch.contextual_ids], history.reshape(-1, HIDDEN),
                            self._item_table[batch.candidate_ids]]) * math.sqrt(HIDDEN)
        values = values + self._position_table[: values.shape[0]]
        seqlen = torch.tensor([values.shape[0]], dtype=torch.int32, device=self.device)
        num_candidates = torch.tensor([batch.candidate_ids.numel()], dtype=torch.int32, device=self.device)
        contextual_seqlen = torch.tensor([batch.contextual_ids.numel()], dtype=torch.int32, device=self.device)
        zero = torch.zeros(1, dtype=torch.int32, device=self.device)
        return JaggedData(values=values, seqlen=seqlen, seqlen_offsets=torch.cat([zero, seqlen.cumsum(0)]).int(),
                          max_seqlen=values.shape[0], max_num_candidates=batch.candidate_ids.numel(),
                          num_candidates=num_candidates, num_candidates_offsets=torch.cat([zero, num_candidates]),
                          contextual_max_seqlen=NUM_CONTEXTUAL, contextual_seqlen=contextual_seqlen,
                          contextual_seqlen_offsets=torch.cat([zero, contextual_seqlen]), has_interleaved_action=True)

    def forward(self, batch: Batch):
        jagged_data = self._preprocessor(batch)
        num_tokens = jagged_data.values.shape[0]
        if self.use_cudagraph:
            self._hidden_states[:num_tokens, ...].copy_(jagged_data.values, non_blocking=True)
            copy_jagged_metadata(self._jagged_metadata, jagged_data)
            hstu_output = self._hstu_block.predict(batch.batch_size, num_tokens, self._hidden_states,
                                                   self._jagged_metadata)
        else:
            hstu_output = self._hstu_block.predict(batch.batch_size, num_tokens, jagged_data.values, jagged_data)
        candidates = F.normalize(hstu_output[num_tokens - batch.candidate_ids.numel(): num_tokens], dim=-1)
        (w1, b1), (w2, b2) = self._mlp
        return torch.relu(candidates @ w1 + b1) @ w2 + b2


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(2025_09_17)

    def request(num_items, num_candidates):
        ints = lambda hi, n: torch.randint(0, hi, (n,), generator=gen).to(device)    # noqa: E731
        return Batch(ints(CONTEXT_VOCAB, NUM_CONTEXTUAL), ints(ITEM_VOCAB, num_items), ints(ACTION_VOCAB, num_items),
                     ints(ITEM_VOCAB, num_candidates))
    batches = [request(5, 2), request(9, 3), request(2, 4)]         # 15, 24 and 11 tokens

    def serve(use_cudagraph):
        model = InferenceRankingGR(device, use_cudagraph=use_cudagraph, cudagraph_configs=CUDAGRAPH_CONFIGS)
        return [model.forward(b).clone() for b in batches]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
