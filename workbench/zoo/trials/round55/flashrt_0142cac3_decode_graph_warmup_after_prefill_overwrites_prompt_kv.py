"""The decode graph's warmup runs after prefill: its two eager steps overwrite the prompt's KV slots 0 and 1.

Upstream: https://github.com/flashrt-project/FlashRT/commit/0142cac36008949e998abecb833d6997a96a3242 ("Fix Cosmos3
Reasoner first-call graph correctness", on main; no PR or issue). Diff read, and the pre-fix
``flash_rt/models/cosmos3_reasoner/pipeline_thor.py`` (``_decode_step_bf16``, ``_ensure_graph``, ``generate``).
Symptom: the first ``generate()`` on a fresh ``CosmosReasonerThor`` engine returns greedy tokens that differ from
every later identical call (hidden because the benchmark discarded its warmup calls); no error.
Mechanism: the in-graph greedy step ``_decode_step_bf16`` reads the static scalars ``d_tok, d_pos, d_slot, d_len,
d_step`` (zero-initialised), writes the new token's K/V into ``k_cache[li][d_slot]`` / ``v_cache[li][d_slot]``
(``cosmos3_reasoner_rope_kv_bf16``), attends over ``d_len`` keys, takes the argmax into ``d_tok`` and advances
``d_pos/d_slot/d_len/d_step`` in place. ``_ensure_graph`` (once per engine: ``if self._graph is not None``) runs
``step()`` twice eagerly on a side stream, then captures one ``step()``. The old ``generate`` called it AFTER the
prefill ``_forward`` had written the prompt K/V into ``k_cache[:, :S]``: the two warmup steps ran with ``d_slot``
= 0 and 1 and wrote the dummy token's K/V over prompt positions 0 and 1 of the live cache. ``generate`` then
refills only the scalars (``d_tok.fill_(out[0]); d_pos.fill_(nxt); d_slot.fill_(S); d_len.fill_(S + 1);
d_step.zero_()``) and replays ``max_new - 1`` times, attending over a corrupted prefix. Later calls skip the
warmup, so only the first request is wrong. (Miniature: one layer, torch ops for the kernels, float32.)
Doctor: persistent-mutation, at ``_decode_step_bf16`` (its in-place K/V write at ``d_slot``, run by the warmups of
``_ensure_graph``, lands on prompt slots of the persistent cache that prefill has just filled).
Fix (upstream): ``generate`` calls ``self._ensure_graph()`` first ("Capture before prefill. Graph warmup writes
decode scratch KV slots; the real prefill below then overwrites the complete valid prompt range.") and the call
after prefill is deleted; the commit also adds ``_validate_request`` and a test asserting ``["capture", "prefill"]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashrt-project/FlashRT/commit/0142cac36008949e998abecb833d6997a96a3242"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "_decode_step_bf16"
SYMPTOM = "first generate() on a fresh engine decodes against prompt KV slots 0-1 overwritten by the graph warmup"

NL, HID, NH, NKV, HD, FF, VOCAB, EPS, THETA = 1, 8, 2, 1, 4, 16, 32, 1e-6, 100.0


def _rms(x, w, eps=EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CosmosReasonerThor:
    def __init__(self, device, variant, use_graph=True, max_seq=16, max_new_tokens=4):
        gen = generator(142)
        self.device, self.variant, self.use_graph = device, variant, use_graph
        self.max_seq, self.max_new = max_seq, max_new_tokens
        self.w = {"embed_tokens.weight": randn(VOCAB, HID, gen=gen, device=device),
                  "norm.weight": 1.0 + randn(HID, gen=gen, device=device, scale=0.1),
                  "lm_head.weight": randn(VOCAB, HID, gen=gen, device=device)}
        for li in range(NL):
            for k, shape in (("self_attn.to_q.weight", (NH * HD, HID)), ("self_attn.to_k.weight", (NKV * HD, HID)),
                             ("self_attn.to_v.weight", (NKV * HD, HID)), ("self_attn.to_out.weight", (HID, HID)),
                             ("mlp.up_proj.weight", (FF, HID)), ("mlp.down_proj.weight", (HID, FF))):
                self.w[f"layers.{li}.{k}"] = randn(*shape, gen=gen, device=device, scale=0.6)
            for k in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                self.w[f"layers.{li}.{k}"] = 1.0 + randn(HID, gen=gen, device=device, scale=0.1)
        self.inv_freq = (1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)).to(device)
        self.k_cache = torch.zeros(NL, max_seq, NKV, HD, device=device)
        self.v_cache = torch.zeros(NL, max_seq, NKV, HD, device=device)
        self.seq_len = 0
        self._init_bf16_decode()

    def _init_bf16_decode(self):
        dev = self.device
        self.W16_qkv = [torch.cat([self.w[f"layers.{li}.self_attn.to_{p}.weight"] for p in "qkv"], 0).contiguous()
                        for li in range(NL)]
        self.d_tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.d_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.d_slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.d_x = torch.zeros(1, HID, device=dev)
        self.d_qr = torch.zeros(NH, HD, device=dev)
        self.d_attn = torch.zeros(1, HID, device=dev)
        self.d_logits = torch.zeros(1, VOCAB, device=dev)
        self.d_len = torch.zeros(1, dtype=torch.int32, device=dev)
        self.d_step = torch.zeros(1, dtype=torch.long, device=dev)
        self.d_out_tokens = torch.zeros(self.max_new + 1, dtype=torch.long, device=dev)
        self.d_max_val = torch.zeros(1, device=dev)
        self.ctx_pos = torch.arange(self.max_seq, device=dev)
        f = torch.arange(self.max_seq, device=dev, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        self.d_cos_table, self.d_sin_table = emb.cos(), emb.sin()
        self._graph = None

    def cosmos3_reasoner_rope_kv_bf16(self, li, qkv):
        """RoPE q/k at ``d_pos``; write k/v into the cache at ``d_slot``; the rotated q into ``d_qr``."""
        q = qkv[:, :NH * HD].view(NH, HD)
        k = qkv[:, NH * HD:(NH + NKV) * HD].view(1, NKV, HD)
        v = qkv[:, (NH + NKV) * HD:].view(1, NKV, HD)
        cos, sin = self.d_cos_table.index_select(0, self.d_pos), self.d_sin_table.index_select(0, self.d_pos)
        self.d_qr.copy_(q * cos + _rotate_half(q) * sin)
        self.k_cache[li].index_copy_(0, self.d_slot, k * cos[:, None] + _rotate_half(k) * sin[:, None])
        self.v_cache[li].index_copy_(0, self.d_slot, v)

    def cosmos3_reasoner_decode_attn_bf16(self, li):
        """Attention of ``d_qr`` over the first ``d_len`` cache slots (GQA: one KV head)."""
        kk, vv = self.k_cache[li][:, 0], self.v_cache[li][:, 0]                  # [max_seq, HD]
        scores = (self.d_qr @ kk.T) * HD ** -0.5
        scores = scores.masked_fill(~(self.ctx_pos < self.d_len)[None, :], -1e9)
        self.d_attn.copy_((torch.softmax(scores, -1) @ vv).reshape(1, HID))

    def _decode_step_bf16(self):
        w = self.w
        torch.index_select(w["embed_tokens.weight"], 0, self.d_tok, out=self.d_x)
        for li in range(NL):
            qkv = F.linear(_rms(self.d_x, w[f"layers.{li}.input_layernorm.weight"]), self.W16_qkv[li])
            self.cosmos3_reasoner_rope_kv_bf16(li, qkv)
            self.cosmos3_reasoner_decode_attn_bf16(li)
            self.d_x.add_(F.linear(self.d_attn, w[f"layers.{li}.self_attn.to_out.weight"]))
            h = F.relu(F.linear(_rms(self.d_x, w[f"layers.{li}.post_attention_layernorm.weight"]),
                                w[f"layers.{li}.mlp.up_proj.weight"])).square()
            self.d_x.add_(F.linear(h, w[f"layers.{li}.mlp.down_proj.weight"]))
        self.d_logits.copy_(F.linear(_rms(self.d_x, w["norm.weight"]), w["lm_head.weight"]))
        # In-graph greedy step: sample, record, and advance the loop state.
        torch.max(self.d_logits.view(VOCAB), 0, out=(self.d_max_val[0], self.d_tok[0]))
        self.d_out_tokens.index_copy_(0, self.d_step, self.d_tok)
        self.d_pos.add_(1)
        self.d_slot.add_(1)
        self.d_len.add_(1)
        self.d_step.add_(1)
        return self.d_logits, self.d_out_tokens

    def _ensure_graph(self):
        if self._graph is not None or not self.use_graph:
            return
        # two eager warmup steps (side stream upstream), then the capture of one step
        self._graph, self._graph_out = capture(
            self._decode_step_bf16, device=self.device, warmups=2, name="cosmos3 decode step",
            owner="CosmosReasonerThor (decode graph)",
            static={"d_tok": self.d_tok, "d_pos": self.d_pos, "d_slot": self.d_slot, "d_len": self.d_len,
                    "d_step": self.d_step},
            state={"k_cache": self.k_cache, "v_cache": self.v_cache})

    def _layer_torch(self, li, x, cos, sin, start):
        lw = lambda k: self.w[f"layers.{li}.{k}"]  # noqa: E731 - as upstream
        S = x.shape[0]
        h = _rms(x, lw("input_layernorm.weight"))
        q = F.linear(h, lw("self_attn.to_q.weight")).view(S, NH, HD)
        k = F.linear(h, lw("self_attn.to_k.weight")).view(S, NKV, HD)
        v = F.linear(h, lw("self_attn.to_v.weight")).view(S, NKV, HD)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        self.k_cache[li, start:start + S] = k
        self.v_cache[li, start:start + S] = v
        kk, vv = self.k_cache[li, :start + S].transpose(0, 1), self.v_cache[li, :start + S].transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kk.expand(NH, -1, -1), vv.expand(NH, -1, -1),
                                           is_causal=S > 1)
        x = x + F.linear(o.transpose(0, 1).reshape(S, HID), lw("self_attn.to_out.weight"))
        h = F.relu(F.linear(_rms(x, lw("post_attention_layernorm.weight")), lw("mlp.up_proj.weight"))).square()
        return x + F.linear(h, lw("mlp.down_proj.weight"))

    def _forward(self, embeds, cos, sin, start):
        x = embeds
        for li in range(NL):
            x = self._layer_torch(li, x, cos, sin, start)
        return F.linear(_rms(x[-1:], self.w["norm.weight"]), self.w["lm_head.weight"])

    def generate(self, input_ids, max_new_tokens=None):
        max_new = int(max_new_tokens or self.max_new)
        S = int(input_ids.shape[0])
        assert S + max_new <= self.max_seq
        if self.variant == "fix":
            self._ensure_graph()              # capture before prefill: its warmup writes scratch KV slots
        embeds = F.embedding(input_ids, self.w["embed_tokens.weight"])
        pos, nxt = torch.arange(S, device=self.device), S
        cos, sin = self.d_cos_table.index_select(0, pos), self.d_sin_table.index_select(0, pos)
        logits = self._forward(embeds, cos, sin, 0)       # prompt K/V -> k_cache[:, :S]
        out = [int(logits.argmax(-1))]
        self.seq_len = S
        if self.variant == "bug":
            self._ensure_graph()              # warmup steps at d_slot 0, 1: over the prompt's K/V
        self.d_tok.fill_(out[0])
        self.d_pos.fill_(nxt)
        self.d_slot.fill_(self.seq_len)
        self.d_len.fill_(self.seq_len + 1)
        self.d_step.zero_()
        for _ in range(max_new - 1):
            if self._graph is not None:
                replay(self._graph, self._graph_out)
            else:
                self._decode_step_bf16()
        out += [int(t) for t in self.d_out_tokens[:max_new - 1].tolist()]
        self.seq_len += max_new - 1
        return torch.tensor(out, dtype=torch.float64), self.d_logits.clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(1420)
    prompts = [torch.randint(0, VOCAB, (6,), generator=gen).to(device) for _ in range(2)]

    def serve(use_graph: bool):
        engine = CosmosReasonerThor(device, variant, use_graph=use_graph)
        outs = []
        for ids in (prompts[0], prompts[0], prompts[1]):   # a fresh engine's first call, then identical calls
            outs += list(engine.generate(ids))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
