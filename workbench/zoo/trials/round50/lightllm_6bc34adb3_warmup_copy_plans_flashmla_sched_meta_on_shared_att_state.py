"""The capture warmup plans FlashMLA's tile schedule on the att state it shares with the capture; replays keep the dummy plan.

Upstream: https://github.com/ModelTC/LightLLM/commit/6bc34adb3896473a8eda46609c232b571faa7d8e ("dsv4: enable decode
cudagraph; fix warmup-baked FlashMLASchedMeta"), on the DeepSeek-V4 branches (``support_ds4``/``ds4_prod``); no issue.
Symptom: silent accuracy drop with decode CUDA graphs on (GSM8K 0.96 -> 0.74, coherent but runaway generations);
eager is correct; after the fix batch-1 greedy decode is character-identical to eager.
Mechanism: ``CudaGraph.warmup`` runs a dummy decode batch (``seq_len = 2``, ``HOLD_REQUEST_ID``) through
``model.forward`` -> ``_decode``, which builds the infer state, calls ``init_att_state()`` (the
``NsaFlashMlaFp8SparseDecodeAttState.init_state`` builds ``lengths``/indices and a fresh
``flashmla_sched_meta = {ratio: flash_mla.get_mla_metadata()[0] ...}``) and then ``_capture_decode``. That runs one
warmup, ``decode_func(copy.copy(infer_state))``: the copy is shallow, so it SHARES ``decode_att_state``; FlashMLA
plans lazily at its first kernel call (``have_initialized`` False -> the scheduling kernel plans tiles from the
current ``topk_length``) and writes the plan back onto that shared ``FlashMLASchedMeta``. The capture,
``decode_func(infer_state)`` under ``torch.cuda.graph``, then finds the plan made and records only the attention
kernel bound to the warmup's plan tensors. Every replay (``_replay``: ``copy_for_cuda_graph`` refreshes the
state's tensors, not the plan) runs real requests with a schedule planned for a 2-token KV: attention under-reads the
KV. An eager step builds a fresh att state and plans from its own lengths. Miniature: one decode layer, a token
pool (``kv_buffer``) indexed by ``req_to_token_indexs``, a plan of ``ceil(length / TILE)`` tiles per request.
Doctor: warmup-divergence, at _capture_decode (the warmup on a shallow copy makes the lazy plan on the att state the
capture reuses, so the planning kernel is not in the graph and replays keep the dummy batch's schedule).
Fix (upstream): ``NsaFlashMlaFp8SparseDecodeAttState.reset_sched_meta_for_capture()`` recreates
``flashmla_sched_meta`` with fresh, unplanned objects; ``_reset_att_state_sched_meta(infer_state)`` calls it (for
``decode_att_state`` and ``decode_att_state1``) in both ``_capture_decode`` and ``_capture_decode_overlap``, after
the warmup and before ``torch.cuda.graph``: planning happens inside the captured region and re-runs on every replay.
"""
from __future__ import annotations

import copy

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/ModelTC/LightLLM/commit/6bc34adb3896473a8eda46609c232b571faa7d8e"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_capture_decode"
SYMPTOM = "decode graphs replay the dummy batch's FlashMLA tile schedule: attention under-reads the KV (GSM8K 0.74)"

VOCAB, DIM, TILE = 12, 4, 2
BATCH, MAX_LEN = 2, 8                    # the graph batch size, graph_max_len_in_batch
HOLD_REQUEST_ID, TOKENS = BATCH, 3 * MAX_LEN


class FlashMLASchedMeta:
    def __init__(self):
        self.tile_scheduler_metadata, self.num_splits, self.have_initialized = None, None, False


def get_mla_metadata():
    return FlashMLASchedMeta(), None


def get_decoding_sched_meta(topk_length):
    """The planning kernel: tiles scheduled per request, and the split offsets."""
    tiles = (topk_length + TILE - 1) // TILE
    return tiles, torch.cumsum(tiles, 0)


def flash_mla_with_kvcache(q, k_cache, indices, topk_length, tile_scheduler_metadata):
    """Sparse decode: plan lazily on the first call with this sched meta, then attend over the scheduled tiles."""
    meta = tile_scheduler_metadata
    if not meta.have_initialized:
        meta.tile_scheduler_metadata, meta.num_splits = get_decoding_sched_meta(topk_length)
        meta.have_initialized = True
    kv = k_cache[indices]                                            # [b, MAX_LEN, DIM]
    cols = torch.arange(MAX_LEN, device=q.device)
    visible = (cols[None, :] < meta.tile_scheduler_metadata[:, None] * TILE) & (cols[None, :] < topk_length[:, None])
    scores = torch.einsum("bd,btd->bt", q, kv).masked_fill(~visible, -1e9)
    return torch.einsum("bt,btd->bd", torch.softmax(scores, -1), kv)


class ReqManager:
    def __init__(self, device):
        self.req_to_token_indexs = torch.zeros(BATCH + 1, MAX_LEN, dtype=torch.long, device=device)


class MemManager:
    def __init__(self, device):
        self.kv_buffer, self.next = torch.zeros(TOKENS, DIM, device=device), 0

    def alloc(self, n):
        self.next += n
        return list(range(self.next - n, self.next))

    def free_all(self):
        self.next = 0


class NsaFlashMlaFp8SparseDecodeAttState:
    def __init__(self, infer_state, req_manager):
        self.infer_state, self.req_manager = infer_state, req_manager
        self.topk_indices = self.lengths = self.flashmla_sched_meta = None

    def init_state(self):
        s = self.infer_state
        self.topk_indices = self.req_manager.req_to_token_indexs[s.b_req_idx]   # gen_nsa_ks_ke, in miniature
        self.lengths = s.b_seq_len.clone()
        self.flashmla_sched_meta = {ratio: get_mla_metadata()[0] for ratio in (0, 4, 128)}

    def reset_sched_meta_for_capture(self):
        self.flashmla_sched_meta = {ratio: get_mla_metadata()[0] for ratio in (0, 4, 128)}

    def copy_for_decode_cuda_graph(self, new_state):
        for name, value in vars(new_state).items():
            if isinstance(value, torch.Tensor) and getattr(self, name).data_ptr() != value.data_ptr():
                getattr(self, name).copy_(value)

    def decode_att(self, q, k_cache):
        return flash_mla_with_kvcache(q, k_cache, self.topk_indices, self.lengths, self.flashmla_sched_meta[0])


class InferStateInfo:
    def __init__(self, input_ids, b_req_idx, b_seq_len, mem_index, req_manager):
        self.input_ids, self.b_req_idx, self.b_seq_len, self.mem_index = input_ids, b_req_idx, b_seq_len, mem_index
        self.decode_att_state = NsaFlashMlaFp8SparseDecodeAttState(self, req_manager)
        self.decode_att_state1 = None

    def copy_for_cuda_graph(self, new_infer_state):
        for name, value in vars(new_infer_state).items():
            if isinstance(value, torch.Tensor) and getattr(self, name).data_ptr() != value.data_ptr():
                getattr(self, name).copy_(value)
        self.decode_att_state.copy_for_decode_cuda_graph(new_infer_state.decode_att_state)


def _reset_att_state_sched_meta(infer_state):
    for att_state in (infer_state.decode_att_state, infer_state.decode_att_state1):
        if att_state is not None:
            att_state.reset_sched_meta_for_capture()


class CudaGraph:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.mempool, self.graph = graph_pool_handle(device), {}

    def _capture_decode(self, decode_func, infer_state):
        pure_para_set = set(vars(infer_state))
        with events.warmup():
            decode_func(copy.copy(infer_state))             # shallow: the copy shares decode_att_state
        for name in set(vars(infer_state)) - pure_para_set:
            delattr(infer_state, name)
        if self.variant == "fix":
            _reset_att_state_sched_meta(infer_state)         # plan again, inside the captured region
        graph_obj = new_graph(self.device)
        with graph(graph_obj, self.mempool, name=f"decode batch_size={BATCH}"):
            model_output = decode_func(infer_state)
        self.graph[BATCH] = (graph_obj, infer_state, model_output)
        replay(graph_obj, model_output)
        return model_output

    def _replay(self, infer_state):
        graph_obj, graph_infer_state, graph_output = self.graph[infer_state.input_ids.shape[0]]
        graph_infer_state.copy_for_cuda_graph(infer_state)
        return replay(graph_obj, graph_output)


class TpPartBaseModel:
    def __init__(self, weights, device, variant, graphed):
        self.w, self.device = weights, device
        self.req_manager, self.mem_manager = ReqManager(device), MemManager(device)
        self.graph = CudaGraph(device, variant) if graphed else None

    def _token_forward(self, infer_state):
        x = self.w["emb"][infer_state.input_ids]
        self.mem_manager.kv_buffer.index_copy_(0, infer_state.mem_index, x @ self.w["wkv"])
        att = infer_state.decode_att_state.decode_att(x @ self.w["wq"], self.mem_manager.kv_buffer)
        return (x + att @ self.w["wo"]) @ self.w["lm_head"]

    def _decode(self, input_ids, b_req_idx, b_seq_len, mem_indexes):
        t = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
        infer_state = InferStateInfo(t(input_ids), t(b_req_idx), t(b_seq_len), t(mem_indexes), self.req_manager)
        rows, cols = infer_state.b_req_idx, infer_state.b_seq_len - 1      # copy_kv_index_to_req
        self.req_manager.req_to_token_indexs[rows, cols] = infer_state.mem_index
        infer_state.decode_att_state.init_state()                          # init_att_state
        if self.graph is None:
            return self._token_forward(infer_state)
        if BATCH not in self.graph.graph:
            events.static_buffers("CudaGraph (graph infer_state)", {
                "input_ids": infer_state.input_ids, "b_seq_len": infer_state.b_seq_len,
                "mem_index": infer_state.mem_index, "b_req_idx": infer_state.b_req_idx,
                "topk_indices": infer_state.decode_att_state.topk_indices,
                "lengths": infer_state.decode_att_state.lengths})
            events.persistent_state("token pool", {"kv_buffer": self.mem_manager.kv_buffer})
            return self.graph._capture_decode(self._token_forward, infer_state)
        return self.graph._replay(infer_state)

    def warmup(self):
        """CudaGraph.warmup: a dummy decode batch (seq_len 2, HOLD_REQUEST_ID) captures the decode graph."""
        if self.graph is not None:
            self._decode([1] * BATCH, [HOLD_REQUEST_ID] * BATCH, [2] * BATCH, self.mem_manager.alloc(BATCH))
        self.mem_manager.free_all()


PROMPTS = ([3, 7, 1], [5, 2, 8, 6])
DECODE_STEPS = 4


def run(variant: str, device: str = "cpu"):
    gen = generator(6)
    weights = {"emb": randn(VOCAB, DIM, gen=gen, device=device)}
    for name in ("wq", "wkv", "wo"):
        weights[name] = randn(DIM, DIM, gen=gen, device=device, scale=0.8)
    weights["lm_head"] = randn(DIM, VOCAB, gen=gen, device=device)

    def serve(graphed: bool):
        model = TpPartBaseModel(weights, device, variant, graphed)
        model.warmup()
        for r, p in enumerate(PROMPTS):                                  # eager prefill: the prompts' K/V
            slots = model.mem_manager.alloc(len(p) - 1)
            model.req_manager.req_to_token_indexs[r, :len(slots)] = torch.tensor(slots, device=device)
            ids = torch.tensor(p[:-1], device=device)
            model.mem_manager.kv_buffer[slots] = weights["emb"][ids] @ weights["wkv"]
        tokens, lens, outs = [p[-1] for p in PROMPTS], [len(p) for p in PROMPTS], []
        for _ in range(DECODE_STEPS):
            logits = model._decode(tokens, list(range(BATCH)), lens, model.mem_manager.alloc(BATCH)).clone()
            outs.append(logits)
            tokens, lens = logits.argmax(-1).tolist(), [n + 1 for n in lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
