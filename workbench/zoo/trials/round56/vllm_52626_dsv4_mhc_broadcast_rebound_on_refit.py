"""An RL refit rebinds DeepSeek-V4's mHC broadcast weight; the captured decode graph keeps the old one.

Upstream: https://github.com/vllm-project/vllm/pull/52626 ("[Bugfix] Fix DeepSeek V4 mHC broadcast buffer
for weight sync"; split off from https://github.com/vllm-project/vllm/pull/51368), found in verl DSV4 RL
training, vllm/models/deepseek_v4/nvidia/model.py (Aug 2026).
Symptom: "Stale broadcast weights after refit": after an RL weight sync (``load_weights()`` again after the
graphs were captured), replayed decode graphs compute the first layer's mHC mixes with the pre-update
broadcast weight, so rollouts silently drift from the trainer's policy; eager mode is correct. No crash.
Mechanism: the first decoder layer receives the 2-D embedding, whose ``hc_mult`` hyper-connection streams
are all equal, so its mHC-pre kernel (``mhc_pre_broadcast_tilelang``) multiplies by a pre-folded weight,
``hc_attn_fn_broadcast = hc_attn_fn.view(-1, hc_mult, hidden).sum(dim=1)``, built by
``DeepseekV4ForCausalLM.finalize_mhc_broadcast_weights()`` after each ``load_weights``. It is a plain
attribute (not a parameter or buffer). The decode graphs are captured once at startup and keep its
address. On a refit ``hc_attn_fn`` (a registered Parameter) is updated in place by its weight loader,
then ``finalize_mhc_broadcast_weights()`` runs again and *assigns* a freshly summed tensor to
``layer.hc_attn_fn_broadcast``: the capture-time tensor loses its last owner and is released. Eager steps
read the attribute, i.e. the new tensor; replays keep reading the released block, which still holds the
pre-refit sums (or whatever the caching allocator puts there next).
Doctor: dangling-reference, at ``finalize_mhc_broadcast_weights`` (its rebinding releases the
``hc_attn_fn_broadcast`` storage the captured ``mhc_pre_broadcast`` still reads).
Fix (upstream): compute ``broadcast`` first; allocate only when ``layer.hc_attn_fn_broadcast is None``,
otherwise ``layer.hc_attn_fn_broadcast.copy_(broadcast)``, so the address the graphs hold stays the live
tensor (test ``test_deepseek_v4_mhc_broadcast_refit_refreshes_in_place``).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/52626"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "finalize_mhc_broadcast_weights"
SYMPTOM = "after an RL refit, replayed decode graphs mix the first layer's mHC streams with the old broadcast weight"

VOCAB, HIDDEN, HC_MULT, SINKHORN_ITERS, EPS = 16, 4, 2, 3, 1e-6
MIX_HC = (2 + HC_MULT) * HC_MULT        # pre, post and the hc_mult x hc_mult comb mixes
SIZE = 4                                # the one FULL decode capture size


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def mhc_pre_broadcast(x, hc_attn_fn, hc_attn_scale, hc_attn_base, norm_weight, fn_broadcast):
    """``mhc_pre_broadcast_tilelang`` for the first layer: the residual is ``x`` on every stream, so
    ``flatten(residual) @ hc_attn_fn.T == x @ fn_broadcast.T`` and the kernel reads ``fn_broadcast``."""
    residual = x.unsqueeze(1).expand(-1, HC_MULT, -1).contiguous()            # [T, hc, H]
    rsqrt = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)                  # rms of the equal streams
    mixes = (x @ fn_broadcast.T) * rsqrt                                        # [T, mix_hc]
    pre = torch.sigmoid(mixes[:, :HC_MULT] * hc_attn_scale[0] + hc_attn_base[:HC_MULT]) + EPS
    post = 2.0 * torch.sigmoid(mixes[:, HC_MULT:2 * HC_MULT] * hc_attn_scale[1]
                               + hc_attn_base[HC_MULT:2 * HC_MULT])
    comb = (mixes[:, 2 * HC_MULT:] * hc_attn_scale[2] + hc_attn_base[2 * HC_MULT:]).view(-1, HC_MULT, HC_MULT)
    comb = torch.softmax(comb, dim=-1)
    for _ in range(SINKHORN_ITERS):                                             # doubly stochastic
        comb = comb / comb.sum(dim=-2, keepdim=True)
        comb = comb / comb.sum(dim=-1, keepdim=True)
    layer_in = rms_norm((pre.unsqueeze(-1) * residual).sum(dim=1), norm_weight)
    return residual, post, comb, layer_in


def mhc_post(x, residual, post_mix, res_mix):
    """Expand: each new stream = post[h] * block output + sum_k comb[h, k] * streams[k]."""
    return post_mix.unsqueeze(-1) * x.unsqueeze(1) + res_mix @ residual


class DeepseekV4DecoderLayer:
    def __init__(self, device):
        # registered Parameters: allocated once, every load writes into them in place
        self.hc_attn_fn = torch.zeros(MIX_HC, HC_MULT * HIDDEN, device=device)
        self.hc_attn_scale = torch.zeros(3, device=device)
        self.hc_attn_base = torch.zeros(MIX_HC, device=device)
        self.attn_norm_weight = torch.zeros(HIDDEN, device=device)
        self.wo = torch.zeros(HIDDEN, HIDDEN, device=device)
        self.hc_attn_fn_broadcast: torch.Tensor | None = None     # plain attribute, derived

    def forward(self, x):
        assert self.hc_attn_fn_broadcast is not None
        residual, post_mix, res_mix, x = mhc_pre_broadcast(
            x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.attn_norm_weight,
            fn_broadcast=self.hc_attn_fn_broadcast)
        x = torch.tanh(x @ self.wo)                                             # attention, in miniature
        return mhc_post(x, residual, post_mix, res_mix)


class DeepseekV4ForCausalLM:
    def __init__(self, device, variant):
        self.variant = variant
        self.embed_tokens = torch.zeros(VOCAB, HIDDEN, device=device)
        self.layers = [DeepseekV4DecoderLayer(device)]
        self.start_layer = 0
        self.hc_head_fn = torch.zeros(HC_MULT, HC_MULT * HIDDEN, device=device)
        self.lm_head = torch.zeros(HIDDEN, VOCAB, device=device)

    def params(self):
        layer = self.layers[0]
        return {"embed_tokens": self.embed_tokens, "hc_head_fn": self.hc_head_fn, "lm_head": self.lm_head,
                "layers.0.hc_attn_fn": layer.hc_attn_fn, "layers.0.hc_attn_scale": layer.hc_attn_scale,
                "layers.0.hc_attn_base": layer.hc_attn_base, "layers.0.attn_norm.weight": layer.attn_norm_weight,
                "layers.0.attn.wo": layer.wo}

    def load_weights(self, weights):
        params = self.params()
        for name, w in weights.items():
            params[name].copy_(w)                     # weight_loader: in place, addresses kept
        self.finalize_mhc_broadcast_weights()

    def finalize_mhc_broadcast_weights(self) -> None:
        layer = self.layers[self.start_layer]
        if self.variant == "bug":
            layer.hc_attn_fn_broadcast = (
                layer.hc_attn_fn.detach().view(-1, HC_MULT, HIDDEN).sum(dim=1)
            )                                         # a new tensor on every call: rebinds the attribute
            return
        broadcast = layer.hc_attn_fn.detach().view(-1, HC_MULT, HIDDEN).sum(dim=1)
        if layer.hc_attn_fn_broadcast is None:
            layer.hc_attn_fn_broadcast = broadcast
        else:
            layer.hc_attn_fn_broadcast.copy_(broadcast)

    def forward(self, input_ids):
        h = self.layers[0].forward(self.embed_tokens[input_ids])               # [T, hc, H]
        flat = h.flatten(1)
        hc_pre = torch.sigmoid(flat @ self.hc_head_fn.T)                        # hc_head collapse
        x = (hc_pre.unsqueeze(-1) * h).sum(dim=1)
        return x @ self.lm_head


def checkpoint(seed, device):
    """One policy version as the trainer ships it."""
    gen = generator(seed)
    return {"embed_tokens": randn(VOCAB, HIDDEN, gen=gen, device=device),
            "hc_head_fn": randn(HC_MULT, HC_MULT * HIDDEN, gen=gen, device=device, scale=0.3),
            "lm_head": randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5),
            "layers.0.hc_attn_fn": randn(MIX_HC, HC_MULT * HIDDEN, gen=gen, device=device, scale=0.5),
            "layers.0.hc_attn_scale": randn(3, gen=gen, device=device, scale=0.5) + 1.0,
            "layers.0.hc_attn_base": randn(MIX_HC, gen=gen, device=device, scale=0.3),
            "layers.0.attn_norm.weight": randn(HIDDEN, gen=gen, device=device, scale=0.1) + 1.0,
            "layers.0.attn.wo": randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)}


class GPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.model = DeepseekV4ForCausalLM(device, variant)
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)

    def capture_model(self):
        """CUDAGraphWrapper: one FULL decode graph captured at startup, never re-captured on refit."""
        self.graph, self.logits = capture(
            lambda: self.model.forward(self.input_ids), device=self.device, name=f"FULL decode size {SIZE}",
            static={"input_ids": self.input_ids}, owner="GPUModelRunner (FULL decode graph)", on_freed="reuse")

    def execute_model(self, tokens):
        n = len(tokens)
        self.input_ids[:n].copy_(torch.tensor(tokens, dtype=torch.long).to(self.device))
        if not self.graphed:
            return self.model.forward(self.input_ids[:n]).clone()
        out = replay(self.graph, self.logits, real=n, size=SIZE, padded={"input_ids": self.input_ids})
        return out[:n].clone()


def run(variant: str, device: str = "cpu"):
    policy_v0, policy_v1 = checkpoint(526260, device), checkpoint(526261, device)

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, graphed)
        runner.model.load_weights(policy_v0)
        if graphed:
            runner.capture_model()
        outs = [runner.execute_model([3, 5, 7]), runner.execute_model([1, 9])]
        runner.model.load_weights(policy_v1)          # verl weight sync: load_weights + finalize again
        outs += [runner.execute_model([2, 4, 6, 8]), runner.execute_model([11])]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
