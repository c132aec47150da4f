"""LightLLM MLA decode: graph warmup on the capture's own ``infer_state`` makes the capture skip the lazy split plan.

Upstream: https://github.com/ModelTC/LightLLM/pull/696 ("udpate mla decode attention.", commit 6ede09e14), the
change to ``lightllm/common/basemodel/cuda_graph.py`` (the same fix was first committed on a branch as
46ce4d476, "fix cuda graph error.").
Symptom: no public report; the branch commit carrying the fix is titled "fix cuda graph error.". DeepSeek-V2/V3
(MLA) decode under CUDA graphs splits the KV with the plan of the capture's dummy batch (two tokens per request):
for longer requests stage 2 merges partials from the wrong blocks (wrong logits), and stage 1 can write more
partials than ``mid_o`` was sized for (``vsm_count * 4 + batch_size``); decode without graphs is correct.
Mechanism: ``gqa_token_decode_attention_flash_decoding`` computes its split plan once per step, on the first
layer, and caches it on the ``infer_state`` for the later layers: ``if not hasattr(infer_state,
"decode_att_block_seq")`` it allocates ``decode_att_block_seq`` / ``mid_o_batch_start_index`` and launches
``_fwd_kernel_calcu_index_and_block_seq`` (block size from ``sum(b_seq_len)``, each request's first partial
index from the cumulative block counts). ``CudaGraph.capture_decode`` ran its warmup ``decode_func(input_ids,
infer_state)`` on the very ``infer_state`` it then captures with, so the warmup left both attributes on it; the
capture found them, skipped the plan kernel, and recorded stage 1 / stage 2 reading the warmup's tensors
(outside the graph). ``CudaGraph.replay`` copies the new step's tensors into the captured ``infer_state``
(``copy_for_cuda_graph``), but nothing rewrites the plan: every replay splits with the dummy batch's block
size and merges each request's partials from the dummy batch's start indices, while stage 1 writes them at the
offsets the live lengths give.
Doctor: warmup-divergence, at ``gqa_token_decode_attention_flash_decoding`` (its lazy ``hasattr`` init,
decided by the warmup, is skipped by the capture and reused by every replay).
Fix (upstream): warm up on a shallow copy, ``decode_func(input_ids, copy.copy(infer_state))  # infer_state
must copy()``, so the attributes the warmup adds land on the copy and the capture records the plan kernel.
Note: #696 also introduced the lazily cached plan itself (it replaced per-call ``mid_o_block_seq`` buffers);
the bug lived in the branch commits that preceded the guarded warmup, not in a LightLLM release.
"""
from __future__ import annotations

import copy

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ModelTC/LightLLM/pull/696"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "gqa_token_decode_attention_flash_decoding"
SYMPTOM = "MLA decode under CUDA graphs merges split-KV partials with the dummy batch's block plan (wrong logits)"

VOCAB, DIM, Q_HEAD_NUM, KV_LORA_RANK, Q_ROPE_DIM, LAYERS = 16, 8, 2, 4, 2, 2
BLOCK_N = 4                          # run_config["BLOCK_N"]
VSM_COUNT = 1                        # what flash_decode_stage1(get_sm_count=True) reports for this toy
MAX_REQ, MAX_LEN, TOKEN_SLOTS = 8, 16, 128
HOLD_REQUEST_ID = MAX_REQ - 1        # the dummy batch's request row
GRAPH_BATCH_SIZE = 3


def cdiv(a, b):
    return (a + b - 1) // b


class InferStateInfo:
    def __init__(self):
        self.batch_size = None
        self.total_token_num = None
        self.b_req_idx = None
        self.b_seq_len = None
        self.max_len_in_batch = None
        self.mem_index = None
        self.is_cuda_graph = False

    def copy_for_cuda_graph(self, new_infer_state):
        for attr_name, attr_value in vars(new_infer_state).items():
            if isinstance(attr_value, torch.Tensor):
                attr_ = getattr(self, attr_name, None)
                if attr_ is not None:
                    attr_.copy_(attr_value)


def _fwd_kernel_calcu_index_and_block_seq(b_seq_len, decode_att_block_seq, mid_o_batch_start_index, num_sm):
    """One program: the block size for this step's flash decoding and each request's first partial."""
    total_token_num = b_seq_len.sum()
    block_seq = torch.div(total_token_num, num_sm * 4, rounding_mode="floor") + 1
    block_seq = cdiv(block_seq, BLOCK_N) * BLOCK_N
    block_seq_len = cdiv(b_seq_len, block_seq)
    cumsum_seq_len = torch.cumsum(block_seq_len, 0)
    mid_o_batch_start_index.copy_(cumsum_seq_len - block_seq_len)
    decode_att_block_seq.copy_(block_seq.reshape(1))


def flash_decode_stage1(in_block_seq, q_nope, q_rope, kv_nope, kv_rope, req_to_tokens, b_req_idx, b_seqlen,
                        mid_out, mid_out_logsumexp, softmax_scale):
    """Each request's sequence cut into blocks of ``block_seq`` tokens; one (partial output, logsumexp)
    per block, written at consecutive indices counted inside the kernel (``out_batch_start_index``)."""
    block_seq = in_block_seq[0]
    blocks = mid_out.shape[1]
    pos = torch.arange(MAX_LEN, device=q_nope.device)
    locs = req_to_tokens[b_req_idx][:, :MAX_LEN]                                   # [B, L]
    k_nope, k_rope = kv_nope[locs, 0], kv_rope[locs, 0]                            # [B, L, R], [B, L, P]
    att = (torch.einsum("bhd,bld->hbl", q_nope, k_nope) + torch.einsum("bhd,bld->hbl", q_rope, k_rope)) * softmax_scale
    cur_block_num = cdiv(b_seqlen, block_seq)
    out_batch_start_index = torch.cumsum(cur_block_num, 0) - cur_block_num
    target = out_batch_start_index[:, None] + torch.div(pos[None, :], block_seq, rounding_mode="floor")
    valid = (pos[None, :] < b_seqlen[:, None]) & (target < blocks)
    idx = torch.where(valid, target, blocks).reshape(1, -1).expand(Q_HEAD_NUM, -1)   # block ``blocks``: discard
    att = att.masked_fill(~valid[None], -1e30).reshape(Q_HEAD_NUM, -1)
    m = torch.full((Q_HEAD_NUM, blocks + 1), -1e30, device=att.device).scatter_reduce(1, idx, att, "amax")
    e = torch.exp(att - m.gather(1, idx))
    s = torch.zeros(Q_HEAD_NUM, blocks + 1, device=att.device).scatter_add(1, idx, e)
    v = k_nope.reshape(1, -1, KV_LORA_RANK).expand(Q_HEAD_NUM, -1, -1)
    acc = torch.zeros(Q_HEAD_NUM, blocks + 1, KV_LORA_RANK, device=att.device).scatter_add(
        1, idx[..., None].expand(-1, -1, KV_LORA_RANK), e[..., None] * v)
    written = (s > 0)[:, :blocks]
    # (a block no request reaches keeps an empty partial here; the kernel leaves it unwritten)
    mid_out.copy_(torch.where(written[..., None], acc[:, :blocks] / s[:, :blocks, None].clamp(min=1e-30), 0.0))
    mid_out_logsumexp.copy_(torch.where(written, m[:, :blocks] + torch.log(s[:, :blocks].clamp(min=1e-30)),
                                        float("-inf")))


def flash_decode_stage2(out_block_seq, batch_start_index, mid_out, mid_out_logexpsum, b_seqlen, out):
    """Per request: merge ``cdiv(seq_len, block_seq)`` partials from ``batch_start_index`` on."""
    block_seq = out_block_seq[0]
    blocks = mid_out.shape[1]
    j = torch.arange(blocks, device=mid_out.device)
    idx = batch_start_index[:, None] + j[None, :]                                  # [B, J]
    valid = (j[None, :] < cdiv(b_seqlen, block_seq)[:, None]) & (idx < blocks)
    idx = idx.clamp(max=blocks - 1)
    logic = mid_out_logexpsum[:, idx].masked_fill(~valid[None], float("-inf"))    # [H, B, J]
    w = torch.exp(logic - logic.amax(-1, keepdim=True))
    o = (w[..., None] * mid_out[:, idx]).sum(-2) / w.sum(-1, keepdim=True)        # [H, B, R]
    out.copy_(o.permute(1, 0, 2))


def gqa_token_decode_attention_flash_decoding(q_nope, q_rope, kv_nope, kv_rope, infer_state, req_to_tokens,
                                              softmax_scale, alloc_tensor_func=torch.empty):
    batch_size = infer_state.batch_size
    device = q_nope.device
    o_tensor = alloc_tensor_func(q_nope.shape, dtype=q_nope.dtype, device=device)
    vsm_count = VSM_COUNT                          # flash_decode_stage1(..., get_sm_count=True)
    if not hasattr(infer_state, "decode_att_block_seq"):
        decode_att_block_seq = torch.empty([1], dtype=torch.int64, device=device)
        mid_o_batch_start_index = torch.empty([batch_size], dtype=torch.int64, device=device)
        _fwd_kernel_calcu_index_and_block_seq(infer_state.b_seq_len, decode_att_block_seq,
                                              mid_o_batch_start_index, vsm_count)
        infer_state.decode_att_block_seq = decode_att_block_seq
        infer_state.mid_o_batch_start_index = mid_o_batch_start_index
    mid_o = torch.empty([Q_HEAD_NUM, vsm_count * 4 + batch_size, KV_LORA_RANK], dtype=torch.float32, device=device)
    mid_o_logexpsum = torch.empty([Q_HEAD_NUM, vsm_count * 4 + batch_size], dtype=torch.float32, device=device)
    flash_decode_stage1(infer_state.decode_att_block_seq, q_nope, q_rope, kv_nope, kv_rope, req_to_tokens,
                        infer_state.b_req_idx, infer_state.b_seq_len, mid_o, mid_o_logexpsum, softmax_scale)
    flash_decode_stage2(infer_state.decode_att_block_seq, infer_state.mid_o_batch_start_index, mid_o,
                        mid_o_logexpsum, infer_state.b_seq_len, o_tensor)
    return o_tensor


class Deepseek2TpPartModel:
    def __init__(self, device):
        gen = generator(696)
        self.device = device
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.layers = [dict(q_nope=randn(DIM, Q_HEAD_NUM * KV_LORA_RANK, gen=gen, device=device, scale=0.6),
                            q_rope=randn(DIM, Q_HEAD_NUM * Q_ROPE_DIM, gen=gen, device=device, scale=0.6),
                            kv_nope=randn(DIM, KV_LORA_RANK, gen=gen, device=device, scale=0.6),
                            kv_rope=randn(DIM, Q_ROPE_DIM, gen=gen, device=device, scale=0.6),
                            o=randn(Q_HEAD_NUM * KV_LORA_RANK, DIM, gen=gen, device=device, scale=0.5))
                       for _ in range(LAYERS)]
        self.kv_nope = [torch.zeros(TOKEN_SLOTS, 1, KV_LORA_RANK, device=device) for _ in range(LAYERS)]
        self.kv_rope = [torch.zeros(TOKEN_SLOTS, 1, Q_ROPE_DIM, device=device) for _ in range(LAYERS)]
        self.req_to_token_indexs = torch.zeros(MAX_REQ, MAX_LEN, dtype=torch.long, device=device)
        self.softmax_scale = (KV_LORA_RANK + Q_ROPE_DIM) ** -0.5

    def _token_forward(self, input_ids, infer_state):
        h = self.emb[input_ids]
        bs = h.shape[0]
        for i, w in enumerate(self.layers):
            q_nope = (h @ w["q_nope"]).view(bs, Q_HEAD_NUM, KV_LORA_RANK)
            q_rope = (h @ w["q_rope"]).view(bs, Q_HEAD_NUM, Q_ROPE_DIM)
            self.kv_nope[i][infer_state.mem_index] = (h @ w["kv_nope"])[:, None]     # destindex_copy_kv
            self.kv_rope[i][infer_state.mem_index] = (h @ w["kv_rope"])[:, None]
            o = gqa_token_decode_attention_flash_decoding(q_nope, q_rope, self.kv_nope[i], self.kv_rope[i],
                                                          infer_state, self.req_to_token_indexs, self.softmax_scale)
            h = h + o.reshape(bs, -1) @ w["o"]
        return h

    def create_inferstate(self, b_req_idx, b_seq_len, mem_index):
        infer_state = InferStateInfo()
        infer_state.batch_size = b_req_idx.shape[0]
        infer_state.b_req_idx, infer_state.b_seq_len, infer_state.mem_index = b_req_idx, b_seq_len, mem_index
        infer_state.total_token_num = int(sum(b_seq_len.tolist()))
        infer_state.max_len_in_batch = int(max(b_seq_len.tolist()))
        return infer_state


class CudaGraph:
    def __init__(self, device, variant, max_batch_size=GRAPH_BATCH_SIZE, max_len_in_batch=MAX_LEN):
        self.graph = {}
        self.device, self.variant = device, variant
        self.mempool = graph_pool_handle(device)
        self.max_batch_size = max_batch_size
        self.graph_max_len_in_batch = max_len_in_batch

    def need_capture(self, batch_size):
        return batch_size not in self.graph

    def capture_decode(self, model, decode_func, input_ids, infer_state):
        batch_size = input_ids.shape[0]
        infer_state.max_len_in_batch = self.graph_max_len_in_batch
        infer_state.total_token_num = self.graph_max_len_in_batch * batch_size
        owner = "CudaGraph (decode)"
        events.static_buffers(owner, {"input_ids": input_ids, "b_req_idx": infer_state.b_req_idx,
                                      "b_seq_len": infer_state.b_seq_len, "mem_index": infer_state.mem_index})
        events.persistent_state(owner, {f"kv_nope{i}": t for i, t in enumerate(model.kv_nope)}
                                | {f"kv_rope{i}": t for i, t in enumerate(model.kv_rope)}
                                | {"req_to_token_indexs": model.req_to_token_indexs})
        with events.warmup():
            if self.variant == "fix":
                decode_func(input_ids, copy.copy(infer_state))  # infer_state must copy()
            else:
                decode_func(input_ids, infer_state)
        graph_obj, predict_logics = capture(lambda: decode_func(input_ids, infer_state), device=self.device,
                                            pool=self.mempool, warmups=0, owner=owner)
        self.graph[batch_size] = (graph_obj, input_ids, infer_state, predict_logics)
        return replay(graph_obj, predict_logics)

    def replay(self, input_ids, infer_state):
        batch_size = input_ids.shape[0]
        graph_obj, graph_input_ids, graph_infer_state, graph_predict_logics = self.graph[batch_size]
        graph_input_ids.copy_(input_ids)
        graph_infer_state.copy_for_cuda_graph(infer_state)
        return replay(graph_obj, graph_predict_logics)

    def warmup(self, model):
        """Dummy decode at startup, as ``CudaGraph.warmup(model)``: requests of two tokens each."""
        bs = self.max_batch_size
        b_req_idx = torch.full((bs,), HOLD_REQUEST_ID, dtype=torch.long, device=self.device)
        dummy_slots = torch.arange(TOKEN_SLOTS - bs, TOKEN_SLOTS, device=self.device)
        model.req_to_token_indexs[HOLD_REQUEST_ID, :2] = dummy_slots[:2]
        b_seq_len = torch.full((bs,), 2, dtype=torch.long, device=self.device)
        infer_state = model.create_inferstate(b_req_idx, b_seq_len, dummy_slots)
        input_ids = torch.ones(bs, dtype=torch.long, device=self.device)
        self.capture_decode(model, model._token_forward, input_ids, infer_state)


def run(variant: str, device: str = "cpu"):
    def serve(graphed: bool):
        model = Deepseek2TpPartModel(device)
        graph = CudaGraph(device, variant) if graphed else None
        if graph is not None:
            graph.warmup(model)
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(device)  # noqa: E731
        prompts = [[3, 5, 7, 9, 2, 4], [1, 8, 6, 11, 13, 10, 12, 14], [15, 0, 3]]
        lens, next_slot, outs = [], 0, []
        # prefill (eager, one token at a time): fill each request's KV
        for r, prompt in enumerate(prompts):
            for pos, tok in enumerate(prompt):
                model.req_to_token_indexs[r, pos] = next_slot
                state = model.create_inferstate(t([r]), t([pos + 1]), t([next_slot]))
                out = model._token_forward(t([tok]), state)
                next_slot += 1
            outs.append(out.clone())
            lens.append(len(prompt))
        toks = [p[-1] for p in prompts]
        for _ in range(4):                          # decode steps of the three requests
            slots = []
            for r in range(len(prompts)):
                model.req_to_token_indexs[r, lens[r]] = next_slot
                slots.append(next_slot)
                next_slot += 1
                lens[r] += 1
            infer_state = model.create_inferstate(t([0, 1, 2]), t(lens), t(slots))
            input_ids = t([(tok * 5 + 3) % VOCAB for tok in toks])
            if graph is not None:
                logits = graph.replay(input_ids, infer_state).clone()
            else:
                logits = model._token_forward(input_ids, infer_state)
            outs.append(logits)
            toks = logits.argmax(-1).tolist()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
