"""DSv4 prefill-graph pad rows attend to the HOLD KV slot; their garbage output joins real rows' MoE expert batches.

Upstream: https://github.com/ModelTC/LightLLM/commit/e78e0d429dff4a58aad5cb3e9ac8158b215d870f ("dsv4: enable
prefill cudagraph; zero pad-row attention output").
Symptom: DeepSeek-V4 with ``--enable_prefill_cudagraph`` gives nondeterministic greedy trajectories and token
flips versus eager prefill (low-confidence tokens flip); zeroing the pad rows restored eager parity (gsm8k 100q
0.980 cold / 0.960 warm).
Mechanism: prefill graphs are "graph-sandwich": the dense ops are captured per token bucket
(``graph_handle_token_nums``) and attention runs eagerly between the segments (``att_func`` calls
``_context_attention_kernel`` and copies its result into the segment's static ``o``). To hit a bucket,
``_create_padded_prefill_model_input`` appends a tail request: ``b_req_idx = req_manager.HOLD_REQUEST_ID``,
``input_ids`` 1, ``mem_indexes = mem_manager.HOLD_TOKEN_MEMINDEX``, ``b_seq_len = padded_token_num``,
``b_ready_cache_len = 0``. Its q rows attend to the HOLD slot (``req_to_token_indexs[HOLD_REQUEST_ID]``), whose
content is whatever the last pad writer left there (upstream, concurrent writers race on it), so the pad rows'
attention output is garbage. It flows into the captured dense/MoE segment: pad-row hiddens are routed to
experts and join the expert batches of real rows, changing those batches' numerics (upstream: GEMM reduction
order of the fp4 MoE, ulp-level and amplified ~1.9x per layer; here: the per-expert-batch dynamic activation
scale). Eager prefill has no pad rows at all, so real rows see only each other.
Doctor: stale-padding, at ``_context_attention_kernel`` (the pad rows' attention output is left as the HOLD slot
made it, and the real rows' MoE output depends on it).
Fix (upstream): ``DeepseekV4InferStateInfo`` computes ``_dsv4_prefill_pad_q_len`` (the HOLD tail request's q
length, ``b_seq_len[-1] - b_ready_cache_len[-1]``) and ``_context_attention_kernel`` does
``out[-pad_q_len:] = 0`` before returning, so pad rows carry no content into the captured MoE segment.
(One-layer, one-head toy; top-1 routing; the expert batch quantises with its own amax scale.)
"""
from __future__ import annotations

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ModelTC/LightLLM/commit/e78e0d429dff4a58aad5cb3e9ac8158b215d870f"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_context_attention_kernel"
SYMPTOM = "prefill-graph pad rows' HOLD-slot attention output changes the real rows' MoE output: tokens flip"

VOCAB, DIM, N_EXPERTS, QMAX = 16, 8, 2, 7.0
HANDLE_TOKEN_NUM = 8                  # the one prefill graph bucket (graph_handle_token_nums)
MAX_REQUEST_NUM, MAX_LEN, MEM_SIZE = 4, 8, 32
# prefill rounds: the prompts of each batch (total tokens <= the bucket)
ROUNDS = [[[3, 5, 2], [7, 4]], [[9, 1, 6, 11, 2, 8]], [[4, 4, 13, 2], [5, 12, 10]], [[14, 2]]]


class ReqManager:
    def __init__(self, device, mem_manager):
        self.HOLD_REQUEST_ID = MAX_REQUEST_NUM
        self.req_to_token_indexs = torch.zeros(MAX_REQUEST_NUM + 1, MAX_LEN, dtype=torch.long, device=device)
        self.req_to_token_indexs[self.HOLD_REQUEST_ID].fill_(mem_manager.HOLD_TOKEN_MEMINDEX)
        self.free_reqs = list(range(MAX_REQUEST_NUM))


class MemManager:
    def __init__(self, device):
        self.HOLD_TOKEN_MEMINDEX = MEM_SIZE
        self.kv_buffer = torch.zeros(MEM_SIZE + 1, 2, DIM, device=device)   # row MEM_SIZE: the HOLD slot
        self.next = 0

    def alloc(self, n: int) -> list[int]:
        idx = [(self.next + i) % MEM_SIZE for i in range(n)]
        self.next = (self.next + n) % MEM_SIZE
        return idx


class DeepseekV4InferStateInfo:
    """The host-side prefill metadata of one (possibly padded) batch."""

    def __init__(self, req_manager, b_req_idx, b_seq_len, b_ready_cache_len, variant: str):
        self.is_prefill = True
        self.req_manager = req_manager
        self.b_req_idx, self.b_seq_len, self.b_ready_cache_len = b_req_idx, b_seq_len, b_ready_cache_len
        q_lens = [s - r for s, r in zip(b_seq_len, b_ready_cache_len)]
        self.b_prefill_start_loc = [sum(q_lens[:i]) for i in range(len(q_lens))]
        if variant == "fix":
            self._dsv4_prefill_pad_q_len = 0
            if self.is_prefill and len(self.b_req_idx) > 0:
                if int(self.b_req_idx[-1]) == self.req_manager.HOLD_REQUEST_ID:
                    self._dsv4_prefill_pad_q_len = int(self.b_seq_len[-1] - self.b_ready_cache_len[-1])


class DeepseekV4Model:
    def __init__(self, device):
        gen = generator(78429)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(4))
        self.gate = randn(DIM, N_EXPERTS, gen=gen, device=device)
        self.experts = randn(N_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.5)
        self.expert_ids = torch.arange(N_EXPERTS, device=device)
        self.softmax_scale = DIM ** -0.5

    def pre_attention(self, mem_manager, input_ids, mem_indexes):
        """Captured segment 1: q/k/v projections, K/V written to the cache (pad tokens to the HOLD slot)."""
        x = self.embed[input_ids]
        q = x @ self.wq
        kv = torch.stack((x @ self.wk, x @ self.wv), dim=1)
        mem_manager.kv_buffer.index_copy_(0, mem_indexes, kv)
        return q

    def _context_attention_kernel(self, q, infer_state, mem_manager):
        """Eager attention between the captured segments: each request reads its K/V through req_to_token_indexs."""
        out = torch.zeros_like(q)
        kv = mem_manager.kv_buffer
        for i, req in enumerate(infer_state.b_req_idx):
            q_len = infer_state.b_seq_len[i] - infer_state.b_ready_cache_len[i]
            start = infer_state.b_prefill_start_loc[i]
            idx = infer_state.req_manager.req_to_token_indexs[req, :infer_state.b_seq_len[i]]
            k, v = kv[idx, 0], kv[idx, 1]
            s = (q[start:start + q_len] @ k.T) * self.softmax_scale
            causal = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
            out[start:start + q_len] = torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v
        pad_q_len = getattr(infer_state, "_dsv4_prefill_pad_q_len", 0)
        if pad_q_len:
            # pad rows read the HOLD slot: zero them to stay deterministic
            out[-pad_q_len:] = 0
        return out

    def post_attention(self, o):
        """Captured segment 2: o_proj and a top-1 MoE whose expert batch is quantised with its own amax scale."""
        h = o @ self.wo
        topk_ids = (h @ self.gate).argmax(-1)
        onehot = (topk_ids.unsqueeze(-1) == self.expert_ids).to(h.dtype)
        batch_amax = (h.abs().amax(-1, keepdim=True) * onehot).amax(0)            # [E]: per expert batch
        scale = (batch_amax.clamp_min(1e-6) / QMAX)[topk_ids].unsqueeze(-1)
        hq = torch.round(h / scale) * scale
        moe = torch.bmm(hq.unsqueeze(1), self.experts[topk_ids]).squeeze(1)
        return h + moe


def run(variant: str, device: str = "cpu"):
    model = DeepseekV4Model(device)

    def prepare(mem, reqs, prompts, padded: bool):
        """The (padded) model input of one prefill batch: ``_create_padded_prefill_model_input``."""
        b_req_idx, b_seq_len, ids, mem_indexes = [], [], [], []
        for prompt in prompts:
            r = reqs.free_reqs.pop(0)
            slots = mem.alloc(len(prompt))
            reqs.req_to_token_indexs[r, :len(prompt)] = torch.tensor(slots, device=device)
            b_req_idx.append(r), b_seq_len.append(len(prompt))
            ids += prompt
            mem_indexes += slots
        n = len(ids)
        if padded and n < HANDLE_TOKEN_NUM:
            pad = HANDLE_TOKEN_NUM - n
            ids += [1] * pad
            mem_indexes += [mem.HOLD_TOKEN_MEMINDEX] * pad
            b_req_idx.append(reqs.HOLD_REQUEST_ID), b_seq_len.append(pad)
        state = DeepseekV4InferStateInfo(reqs, b_req_idx, b_seq_len, [0] * len(b_req_idx), variant)
        return n, ids, mem_indexes, state

    def finish(reqs, state):
        reqs.free_reqs += [r for r in state.b_req_idx if r != reqs.HOLD_REQUEST_ID]

    def eager():
        mem = MemManager(device)
        reqs = ReqManager(device, mem)
        outs = []
        for prompts in ROUNDS:
            n, ids, mem_indexes, state = prepare(mem, reqs, prompts, padded=False)
            q = model.pre_attention(mem, torch.tensor(ids, device=device), torch.tensor(mem_indexes, device=device))
            o = model._context_attention_kernel(q, state, mem)
            outs.append(model.post_attention(o))
            finish(reqs, state)
        return outs

    def served():
        mem = MemManager(device)
        reqs = ReqManager(device, mem)
        input_ids = torch.ones(HANDLE_TOKEN_NUM, dtype=torch.long, device=device)
        mem_indexes = torch.arange(HANDLE_TOKEN_NUM, device=device)     # warmup: mem_manager.alloc, then free_all
        o = torch.zeros(HANDLE_TOKEN_NUM, DIM, device=device)            # the sandwich's attention handoff
        owner = "PrefillCudaGraph (graph-sandwich)"
        g1, q_out = capture(lambda: model.pre_attention(mem, input_ids, mem_indexes), device=device, owner=owner,
                            static={"input_ids": input_ids, "mem_indexes": mem_indexes},
                            state={"kv_buffer": mem.kv_buffer})
        dummy = DeepseekV4InferStateInfo(reqs, [reqs.HOLD_REQUEST_ID], [HANDLE_TOKEN_NUM], [0], variant)
        with events.dummy_run():
            o.copy_(model._context_attention_kernel(q_out, dummy, mem))
        g2, out = capture(lambda: model.post_attention(o), device=device, owner=owner, static={"o": o})
        mem.next = 0
        outs = []
        for prompts in ROUNDS:
            n, ids, idx, state = prepare(mem, reqs, prompts, padded=True)
            input_ids.copy_(torch.tensor(ids, device=device))
            mem_indexes.copy_(torch.tensor(idx, device=device))
            q = replay(g1, q_out, real=n, size=HANDLE_TOKEN_NUM)
            o.copy_(model._context_attention_kernel(q, state, mem))            # att_func: _o.copy_(tmp_o)
            pad_rows = {"o": o} if variant == "bug" and n < HANDLE_TOKEN_NUM else None
            outs.append(replay(g2, out, real=n, size=HANDLE_TOKEN_NUM, padded=pad_rows)[:n].clone())
            finish(reqs, state)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
