"""vLLM TRITON_MLA under FULL decode graphs: a padded decode slot has ``seq_len = 0``, the decode kernel's stage 2 divides ``0 / 0`` for it, and the per-tensor FP8 MoE quantisation spreads that NaN to every real request of the batch.

Upstream: https://github.com/vllm-project/vllm/pull/57094 ("[Bugfix][Attention] Avoid NaN from empty seq_len in Triton
MLA decode (CUDA graph pad)", vllm-project/vllm, opened 2026-09-16, open when read; fixes issue #57017 "DeepSeek-V2-Lite
with online FP8 on an RTX 4090 (TRITON_MLA): NaN logits on every request once three or more sequences are decoded in one
CUDA-graph batch"). Read: the PR description (root cause in three steps, the regression test it adds), the issue
description and the author's comment on it ("the pr writes zeros when e_sum==0"), and the pre-fix
``vllm/v1/attention/ops/triton_decode_attention.py`` (``_fwd_grouped_kernel_stage1``, ``_decode_grouped_att_m_fwd``,
``_fwd_kernel_stage2``, ``_decode_softmax_reducev_fwd``, ``decode_attention_fwd``) and ``TritonMLAImpl.forward_mqa`` in a
2026-05 vLLM fork snapshot. The diff itself was not available: the fixed stage 2 below is the description's "write zeros
when e_sum == 0".
Symptom: DeepSeek-V2-Lite, ``--quantization fp8``, sm_89 (TRITON_MLA): with 1 or 2 concurrent requests all is well; from
3 requests on, every request of the batch gets NaN log-probs (garbage text, HTTP 400 when logprobs are asked for). Eager
or ``cudagraph_mode: NONE`` is fine; ``--max-num-seqs 2`` sidesteps it. Nothing is logged.
Mechanism: the capture sizes are 1, 2, 4, 8, ..., so a 3-request decode batch replays the 4-request graph and the runner
pads the fourth slot with ``seq_lens = 0`` and the null block. Stage 1 skips a split whose KV range is empty (it stores
nothing), stage 2 skips it too and ends with ``acc = 0, e_sum = 0``; ``result = acc / e_sum`` writes NaN into the padded
row of the attention output. The row stays to itself until the MoE: the online FP8 MoE quantises its activations with
one dynamic per-tensor scale (``amax`` over the whole batch), so the padded row's NaN makes the scale NaN and every real
row NaN. Eager never pads, so no row has an empty KV range.
Doctor: stale-padding, at _fwd_kernel_stage2 (the real rows depend on what the padded row holds: its NaN, written by
stage 2 for the empty ``seq_len``, reaches them through the batch-wide FP8 scale).
Fix (upstream): stage 2 writes zeros for a row whose ``e_sum`` is 0 (an empty KV range); a zero row leaves the per-tensor
scale alone.
Modelled: ``triton_decode_attention`` (the grouped stage 1 and stage 2 as torch ops over the whole launch grid: the
split ranges, the skip of empty splits, the stage-2 merge and its division, verbatim in effect; the per-``BLOCK_N``
online softmax of stage 1 is one softmax per split), ``TritonMLAImpl.forward_mqa`` (per-call ``o`` / ``lse`` /
``attn_logits``), ``concat_and_cache_mla`` (``PAD_SLOT_ID`` rows skipped), ``scaled_fp8_quant`` (dynamic per-tensor scale,
``torch.float8_e4m3fn``), the FP8 fused MoE of ``Fp8PerTensorOnlineMoEMethod`` (both activations quantised per tensor),
the runner's padding (``seq_lens`` 0, null block, ``PAD_SLOT_ID``) and FULL decode graphs for 2 and 4 requests.
Stand-ins: the model (DeepSeek-V2-like, 2 layers, absorbed MLA with 2 heads, latent rank 4 + rope part 2, no rotary
embedding; MoE with 4 experts, top-2; float64 outside the FP8 round trips), the KV cache (pages of 2 tokens, block 0 is
the null block), the runner writes token 0 into padded ``input_ids`` rows and token 0 embeds to zeros, so a padded row
reaches the MoE as zeros once attention writes 0 for it (upstream's padded rows may move the scale by their own finite
values; not studied here); the LM head never predicts token 0.
Workload: requests A-D, one prompt token each, greedy. Steps 1-2 decode all four (graph of 4, no padding); D finishes;
steps 3-5 decode A, B, C (graph of 4, one padded slot); step 6 decodes A, B (graph of 2). Bug: steps 1-2 equal eager
(max 0); from step 3 on every logit of every request is NaN and greedy picks token 0 (step 6 has no padding but stays
NaN: the NaN rows wrote NaN into the KV cache); max |graph - eager| = inf. Fix: equals eager, max 4.4e-15 (float64
rounding of the padded matmuls; the padded row is all zeros, the FP8 scales are eager's).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/57094"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_fwd_kernel_stage2"
SYMPTOM = ("TRITON_MLA + online FP8 MoE with FULL graphs: a padded decode slot (seq_len 0) gets 0/0 = NaN from the "
           "decode kernel's stage 2 and the per-tensor FP8 scale spreads it: NaN logits for every request once a "
           "batch is padded")

HIDDEN, VOCAB, NUM_LAYERS = 8, 16, 2
NUM_HEADS, KV_LORA_RANK, QK_ROPE_HEAD_DIM, V_HEAD_DIM = 2, 4, 2, 4
NUM_EXPERTS, TOP_K, MOE_INTER = 4, 2, 6
PAGE_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 2, 16, 4
MAX_NUM_REQS, NUM_KV_SPLITS = 4, 2
MAX_MODEL_LEN = PAGE_SIZE * MAX_BLOCKS_PER_REQ
CUDAGRAPH_CAPTURE_SIZES = [2, 4]
NULL_BLOCK_ID, PAD_SLOT_ID = 0, -1
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
DTYPE = torch.float64

_variant = "bug"


# --- vllm/v1/attention/ops/triton_decode_attention.py (Triton kernels as torch ops over the launch grid) --------------

def _split_range(b_seqlen, split_kv_id, num_kv_splits):
    kv_len_per_split = (b_seqlen + num_kv_splits - 1) // num_kv_splits        # tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)
    split_kv_start = kv_len_per_split * split_kv_id
    split_kv_end = torch.minimum(split_kv_start + kv_len_per_split, b_seqlen)
    return split_kv_start, split_kv_end


def _fwd_grouped_kernel_stage1(q, k_buffer, v_buffer, sm_scale, req_to_tokens, b_seqlen, att_out, num_kv_splits,
                               page_size, lv):
    """grid = (batch, heads, NUM_KV_SPLITS): one softmax per KV split; a split with no KV stores nothing."""
    offs_n = torch.arange(req_to_tokens.shape[1] * page_size, device=q.device)
    kv_page_number = req_to_tokens[:, offs_n // page_size].long()
    kv_loc = kv_page_number * page_size + offs_n % page_size                       # [B, N]
    k = k_buffer.reshape(-1, k_buffer.shape[-1])[kv_loc]                           # [B, N, Lk]
    v = v_buffer.reshape(-1, lv)[kv_loc]                                           # MLA: v is the latent part of k
    qk = torch.einsum("bhd,bnd->bhn", q, k) * sm_scale
    for split_kv_id in range(num_kv_splits):
        split_kv_start, split_kv_end = _split_range(b_seqlen, split_kv_id, num_kv_splits)
        in_split = (offs_n >= split_kv_start[:, None]) & (offs_n < split_kv_end[:, None])
        qk_s = qk.masked_fill(~in_split[:, None, :], float("-inf"))
        e_max = qk_s.amax(dim=-1)
        p = torch.exp(qk_s - e_max[..., None])
        e_sum = p.sum(dim=-1)
        acc = torch.einsum("bhn,bnd->bhd", p, v)
        work = (split_kv_end > split_kv_start)[:, None]                            # `if split_kv_end > split_kv_start:`
        att_out[:, :, split_kv_id, :lv] = torch.where(work[..., None], acc / e_sum[..., None],
                                                      att_out[:, :, split_kv_id, :lv])
        att_out[:, :, split_kv_id, lv] = torch.where(work, e_max + torch.log(e_sum), att_out[:, :, split_kv_id, lv])


def _decode_grouped_att_m_fwd(q, k_buffer, v_buffer, att_out, req_to_tokens, b_seqlen, num_kv_splits, sm_scale,
                              page_size):
    _fwd_grouped_kernel_stage1(q, k_buffer, v_buffer, sm_scale, req_to_tokens, b_seqlen, att_out, num_kv_splits,
                               page_size, v_buffer.shape[-1])


def _fwd_kernel_stage2(mid_o, o, lse, b_seqlen, num_kv_splits, lv):
    """grid = (batch, heads): merge the splits; a row whose every split was empty keeps acc = 0, e_sum = 0."""
    batch, heads = o.shape[0], o.shape[1]
    e_sum = torch.zeros(batch, heads, dtype=mid_o.dtype, device=o.device)
    e_max = torch.full((batch, heads), float("-inf"), dtype=mid_o.dtype, device=o.device)
    acc = torch.zeros(batch, heads, lv, dtype=mid_o.dtype, device=o.device)
    for split_kv_id in range(num_kv_splits):
        split_kv_start, split_kv_end = _split_range(b_seqlen, split_kv_id, num_kv_splits)
        work = (split_kv_end > split_kv_start)[:, None]
        tv = mid_o[:, :, split_kv_id, :lv]
        tlogic = mid_o[:, :, split_kv_id, lv]
        n_e_max = torch.maximum(tlogic, e_max)
        old_scale = torch.exp(e_max - n_e_max)
        exp_logic = torch.exp(tlogic - n_e_max)
        acc = torch.where(work[..., None], acc * old_scale[..., None] + exp_logic[..., None] * tv, acc)
        e_sum = torch.where(work, e_sum * old_scale + exp_logic, e_sum)
        e_max = torch.where(work, n_e_max, e_max)
    if _variant == "bug":
        result = acc / e_sum[..., None]                                            # seq_len 0: 0 / 0 = NaN
    else:
        result = torch.where(e_sum[..., None] > 0, acc / e_sum[..., None], 0.0)    # the fix: zeros for an empty row
    o.copy_(result.to(o.dtype))
    lse.copy_((e_max + torch.log(e_sum)).to(lse.dtype))


def _decode_softmax_reducev_fwd(logits, q, o, lse, v_buffer, b_seq_len, num_kv_splits):
    _fwd_kernel_stage2(logits, o, lse, b_seq_len, num_kv_splits, v_buffer.shape[-1])


def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits,
                         sm_scale, page_size=1):
    assert num_kv_splits == attn_logits.shape[2]
    assert q.shape[1] // v_buffer.shape[-2] > 1                                    # GQA/MQA/MLA: the grouped kernels
    _decode_grouped_att_m_fwd(q, k_buffer, v_buffer, attn_logits, req_to_token, b_seq_len, num_kv_splits, sm_scale,
                              page_size)
    _decode_softmax_reducev_fwd(attn_logits, q, o, lse, v_buffer, b_seq_len, num_kv_splits)


# --- forward context, attention metadata, MLA backend (reduced) -------------------------------------------------------

@dataclasses.dataclass
class MLADecodeMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor


_forward_context: dict = {}


def get_forward_context():
    return _forward_context


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping):
    """Write each token's latent + rope key into its slot; ``PAD_SLOT_ID`` rows write nothing."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    idx = torch.where(valid, slot_mapping, 0)
    flat.index_copy_(0, idx, torch.where(valid[:, None], torch.cat([kv_c, k_pe], dim=-1), flat[idx]))


class TritonMLAImpl:
    def __init__(self):
        self.num_heads, self.kv_lora_rank = NUM_HEADS, KV_LORA_RANK
        self.scale = (KV_LORA_RANK + QK_ROPE_HEAD_DIM) ** -0.5

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata):
        B = q.shape[0]
        num_kv_splits = NUM_KV_SPLITS
        o = torch.zeros(B, self.num_heads, self.kv_lora_rank, dtype=q.dtype, device=q.device)
        lse = torch.zeros(B, self.num_heads, dtype=q.dtype, device=q.device)
        attn_logits = torch.empty((B, self.num_heads, num_kv_splits, self.kv_lora_rank + 1), dtype=q.dtype,
                                  device=q.device)
        kv_c_and_k_pe_cache = kv_c_and_k_pe_cache.unsqueeze(2)                     # add a head dim of 1
        kv_c_cache = kv_c_and_k_pe_cache[..., :self.kv_lora_rank]
        decode_attention_fwd(q, kv_c_and_k_pe_cache, kv_c_cache, o, lse, attn_metadata.block_table,
                             attn_metadata.seq_lens, attn_logits, num_kv_splits, self.scale, PAGE_SIZE)
        return o, lse


# --- the model (DeepSeek-V2-like stand-in) ------------------------------------------------------------------------------

def scaled_fp8_quant(x):
    """Dynamic per-tensor FP8: one scale from the amax of the whole tensor (all tokens of the batch)."""
    scale = x.abs().amax() / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class DeepseekV2MLAAttention(torch.nn.Module):
    def __init__(self, gen, device, kv_cache):
        super().__init__()
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.6).to(DTYPE)  # noqa: E731
        lk = KV_LORA_RANK + QK_ROPE_HEAD_DIM
        self.q_proj, self.kv_a_proj = r(HIDDEN, NUM_HEADS * lk), r(HIDDEN, lk)
        self.w_uv, self.o_proj = r(NUM_HEADS, KV_LORA_RANK, V_HEAD_DIM), r(NUM_HEADS * V_HEAD_DIM, HIDDEN)
        self.kv_cache, self.impl = kv_cache, TritonMLAImpl()

    def forward(self, hidden_states):
        attn_metadata = get_forward_context()["attn_metadata"]
        q = (hidden_states @ self.q_proj).view(-1, NUM_HEADS, KV_LORA_RANK + QK_ROPE_HEAD_DIM)   # absorbed q
        kv = hidden_states @ self.kv_a_proj
        kv_c_normed = F.rms_norm(kv[:, :KV_LORA_RANK], (KV_LORA_RANK,))
        concat_and_cache_mla(kv_c_normed, kv[:, KV_LORA_RANK:], self.kv_cache, attn_metadata.slot_mapping)
        o, _ = self.impl.forward_mqa(q, self.kv_cache, attn_metadata)
        return torch.einsum("thr,hrv->thv", o, self.w_uv).reshape(-1, NUM_HEADS * V_HEAD_DIM) @ self.o_proj


class Fp8PerTensorOnlineMoEMethod:
    """Weights quantised at load, activations quantised with a dynamic per-tensor scale (``kFp8DynamicTensorSym``)."""

    @staticmethod
    def process_weights_after_loading(w):
        wq, scale = scaled_fp8_quant(w)
        return wq.to(DTYPE) * scale

    @staticmethod
    def apply(hidden_states, w13, w2, topk_weights, topk_ids):
        a1q, a1_scale = scaled_fp8_quant(hidden_states)
        a1 = a1q.to(DTYPE) * a1_scale
        gate_up = torch.einsum("th,tkhi->tki", a1, w13[topk_ids])                 # [T, top_k, 2 * inter]
        act = F.silu(gate_up[..., :MOE_INTER]) * gate_up[..., MOE_INTER:]
        a2q, a2_scale = scaled_fp8_quant(act)
        a2 = a2q.to(DTYPE) * a2_scale
        out = torch.einsum("tki,tkih->tkh", a2, w2[topk_ids])
        return (out * topk_weights[..., None]).sum(dim=1)


class DeepseekV2MoE(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.6).to(DTYPE)  # noqa: E731
        self.gate = r(HIDDEN, NUM_EXPERTS)
        self.quant_method = Fp8PerTensorOnlineMoEMethod()
        self.w13 = self.quant_method.process_weights_after_loading(r(NUM_EXPERTS, HIDDEN, 2 * MOE_INTER))
        self.w2 = self.quant_method.process_weights_after_loading(r(NUM_EXPERTS, MOE_INTER, HIDDEN))

    def forward(self, hidden_states):
        topk_weights, topk_ids = torch.softmax(hidden_states @ self.gate, dim=-1).topk(TOP_K, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return self.quant_method.apply(hidden_states, self.w13, self.w2, topk_weights, topk_ids)


class DeepseekV2DecoderLayer(torch.nn.Module):
    def __init__(self, gen, device, kv_cache):
        super().__init__()
        self.self_attn, self.mlp = DeepseekV2MLAAttention(gen, device, kv_cache), DeepseekV2MoE(gen, device)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attn(F.rms_norm(hidden_states, (HIDDEN,)))
        return hidden_states + self.mlp(F.rms_norm(hidden_states, (HIDDEN,)))


class DeepseekV2ForCausalLM(torch.nn.Module):
    def __init__(self, device, kv_caches):
        super().__init__()
        gen = generator(57094)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_tokens[0] = 0.0                       # stand-in: token 0 (the padding id) embeds to zeros
        self.layers = torch.nn.ModuleList(DeepseekV2DecoderLayer(gen, device, kv) for kv in kv_caches)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)
        self.logits_bias = torch.zeros(VOCAB, dtype=DTYPE, device=device)
        self.logits_bias[0] = -100.0                     # stand-in: token 0 is never predicted

    def forward(self, input_ids):
        hidden_states = self.embed_tokens[input_ids]
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return F.rms_norm(hidden_states, (HIDDEN,)) @ self.lm_head + self.logits_bias


# --- vllm/v1/worker/gpu_model_runner.py (reduced) ----------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.kv_caches = [torch.zeros(NUM_BLOCKS, PAGE_SIZE, KV_LORA_RANK + QK_ROPE_HEAD_DIM, dtype=DTYPE,
                                      device=device) for _ in range(NUM_LAYERS)]
        self.model = DeepseekV2ForCausalLM(device, self.kv_caches)
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((MAX_NUM_REQS,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.requests, self.free_blocks, self.graphs = {}, list(range(1, NUM_BLOCKS)), {}
        if use_cuda_graph:
            self.capture_model()

    def _model_forward(self, num_tokens):
        _forward_context["attn_metadata"] = MLADecodeMetadata(
            block_table=self.block_table[:num_tokens], seq_lens=self.seq_lens[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens])
        return self.model(self.input_ids[:num_tokens])

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        for bs in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self.seq_lens[:bs].fill_(MAX_MODEL_LEN)          # capture with max_model_len on the null block
            self.block_table[:bs].fill_(NULL_BLOCK_ID)
            self.slot_mapping[:bs].fill_(PAD_SLOT_ID)
            self.input_ids[:bs].fill_(0)
            self.graphs[bs] = capture(
                lambda bs=bs: self._model_forward(bs), device=self.device, pool=pool, name=f"FULL decode [{bs}]",
                owner="GPUModelRunner",
                static={"input_ids": self.input_ids, "seq_lens": self.seq_lens, "block_table": self.block_table,
                        "slot_mapping": self.slot_mapping},
                state={f"kv_caches.{i}": kv for i, kv in enumerate(self.kv_caches)})

    def add_request(self, req_id, prompt_token):
        self.requests[req_id] = {"last": prompt_token, "num_computed": 0, "blocks": []}

    def _prepare_inputs(self, req_ids, num_input_tokens):
        n = len(req_ids)
        tokens, seq_lens, slots, tables = [], [], [], []
        for req_id in req_ids:
            req = self.requests[req_id]
            pos = req["num_computed"]
            if pos % PAGE_SIZE == 0:
                req["blocks"].append(self.free_blocks.pop(0))
            tokens.append(req["last"])
            seq_lens.append(pos + 1)
            slots.append(req["blocks"][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
            tables.append(req["blocks"] + [NULL_BLOCK_ID] * (MAX_BLOCKS_PER_REQ - len(req["blocks"])))
        self.input_ids[:n].copy_(torch.tensor(tokens, dtype=torch.int64))
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        self.slot_mapping[:n].copy_(torch.tensor(slots, dtype=torch.int64))
        self.block_table[:n].copy_(torch.tensor(tables, dtype=torch.int32))
        # Padded slots of a CUDA graph batch: no KV, the null block, no cache write, the padding token.
        self.seq_lens[n:num_input_tokens].fill_(0)
        self.block_table[n:num_input_tokens].fill_(NULL_BLOCK_ID)
        self.slot_mapping[n:num_input_tokens].fill_(PAD_SLOT_ID)
        self.input_ids[n:num_input_tokens].fill_(0)

    def execute_model(self, req_ids):
        n = len(req_ids)
        num_input_tokens = next((s for s in sorted(self.graphs) if s >= n), n)
        self._prepare_inputs(req_ids, num_input_tokens)
        if num_input_tokens in self.graphs:
            g, out = self.graphs[num_input_tokens]
            logits = replay(g, out, real=n, size=num_input_tokens)[:n].clone()
        else:
            logits = self._model_forward(n)[:n].clone()
        for row, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            req["num_computed"] += 1
            req["last"] = int(logits[row].argmax())
        return logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    steps = [list("ABCD")] * 2 + [list("ABC")] * 3 + [list("AB")]

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        for req_id, token in zip("ABCD", (3, 7, 11, 14)):
            runner.add_request(req_id, token)
        return [runner.execute_model(step) for step in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
