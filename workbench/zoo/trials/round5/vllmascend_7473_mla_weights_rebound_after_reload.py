"""RL weight reload rebinds the MLA absorbed weights, while the graphs captured once keep the old ones.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/7473 ("fix(attention): reuse weight address
in graph + RL scenario"), vllm-ascend ``AscendMLAImpl`` / ``AscendSFAImpl`` (Mar 2026).
Symptom: in RL rollouts (verl-style) with ACL graphs on, after each ``update_weights`` the MLA decode
graphs keep computing with the previous policy's ``W_UV`` / ``W_UK_T`` ("captured address always
points to old data"): the rollout silently samples from a mix of new and old weights.
Mechanism: in graph + RL mode the graphs are captured once and weights are updated in place, so every
address the graphs read must stay fixed. ``process_weights_after_loading`` derives ``W_UV`` and
``W_UK_T`` from ``kv_b_proj.weight`` with ``.contiguous()`` and rebinds the attributes, so each reload
gives them new storage. The captured decode graphs still read the storage of capture time, which
the rebinding released: they see its old bytes (or whatever reuses the block).
Doctor: dangling-reference, at ``_q_proj_and_k_up_proj`` (the first captured bmm that reads the
released ``W_UK_T``; ``_v_up_proj`` reads the released ``W_UV`` the same way).
Fix (upstream): on the first call allocate ``W_UV`` / ``W_UK_T``; on later calls ``copy_()`` the new
values into the same storage, so the captured addresses stay valid.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/7473"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_q_proj_and_k_up_proj"
SYMPTOM = "after an RL weight update the replayed decode graphs use the old W_UK_T / W_UV (stale policy)"

HIDDEN, HEADS, NOPE, V_DIM, LORA, CTX, SLOTS = 6, 2, 3, 3, 4, 3, 16
CAPTURE_SIZES = [1, 2, 4]


def checkpoint(seed: int, device: str) -> dict[str, torch.Tensor]:
    """One policy version as the trainer ships it (kv_b_proj in the checkpoint's [out, in] layout)."""
    gen = generator(seed)
    return {"q_proj": randn(HIDDEN, HEADS * NOPE, gen=gen, device=device, scale=0.5),
            "kv_b_proj": randn(HEADS * (NOPE + V_DIM), LORA, gen=gen, device=device, scale=0.5),
            "o_proj": randn(HEADS * V_DIM, HIDDEN, gen=gen, device=device, scale=0.5)}


class AscendMLAImpl:
    """The MLA decode path: q absorbed into the latent space through W_UK_T, output up-projected by W_UV."""

    def __init__(self, device: str, keep_addresses: bool) -> None:
        self.keep_addresses = keep_addresses
        # parameters: allocated once at model init; every load writes into them (weight_loader copy_)
        self.q_proj = torch.zeros(HIDDEN, HEADS * NOPE, device=device)
        self.kv_b_proj = torch.zeros(HEADS * (NOPE + V_DIM), LORA, device=device)
        self.o_proj = torch.zeros(HEADS * V_DIM, HIDDEN, device=device)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, w in weights.items():
            getattr(self, name).copy_(w)               # in place: the parameters keep their addresses

    def process_weights_after_loading(self) -> None:
        kv_b_proj_weight = self.kv_b_proj.T                                        # [L, H*(P+V)]
        kv_b_proj_weight = kv_b_proj_weight.view(LORA, HEADS, NOPE + V_DIM)
        W_UK, W_UV = kv_b_proj_weight.split([NOPE, V_DIM], dim=-1)
        if not self.keep_addresses or not hasattr(self, "W_UV"):
            # Convert from (L, N, V) to (N, L, V)
            self.W_UV = W_UV.transpose(0, 1).contiguous()
            # Convert from (L, N, P) to (N, P, L)
            self.W_UK_T = W_UK.permute(1, 2, 0).contiguous()
        else:
            self.W_UV.copy_(W_UV.transpose(0, 1).contiguous())
            self.W_UK_T.copy_(W_UK.permute(1, 2, 0).contiguous())

    def _q_proj_and_k_up_proj(self, x):
        q_nope = (x @ self.q_proj).view(-1, HEADS, NOPE).transpose(0, 1)          # (N, B, P)
        ql_nope = torch.bmm(q_nope, self.W_UK_T)                                   # (N, B, L)
        return ql_nope.transpose(0, 1)

    def _v_up_proj(self, x):
        x = x.view(-1, HEADS, LORA).transpose(0, 1)                                # (N, B, L)
        x = torch.bmm(x, self.W_UV)                                                # (N, B, V)
        return x.transpose(0, 1).reshape(-1, HEADS * V_DIM)

    def forward_decode(self, hidden_states, ctx_slots, kv_cache):
        ql_nope = self._q_proj_and_k_up_proj(hidden_states)                        # (B, N, L)
        latent = kv_cache[ctx_slots]                                               # (B, C, L)
        scores = torch.einsum("bnl,bcl->bnc", ql_nope, latent) / LORA ** 0.5
        o_latent = torch.einsum("bnc,bcl->bnl", torch.softmax(scores, -1), latent)
        return self._v_up_proj(o_latent) @ self.o_proj


def rollouts(device: str):
    """Two rollouts of the same engine: policy v0, a weight update to v1, then policy v1. Each
    rollout prefills the latent cache of its requests, then decodes (batches of 3 and 2, 3 and 1)."""
    gen = generator(7473)
    out = []
    for version, batches in ((0, (3, 2)), (1, (3, 1))):
        latents = randn(SLOTS, LORA, gen=gen, device=device)
        steps = [(randn(n, HIDDEN, gen=gen, device=device),
                  torch.randint(0, SLOTS, (n, CTX), generator=gen).to(device)) for n in batches]
        out.append((version, latents, steps))
    return out


def run(variant: str, device: str = "cpu"):
    weights = [checkpoint(74730, device), checkpoint(74731, device)]
    plan = rollouts(device)

    def serve(graphed: bool):
        impl = AscendMLAImpl(device, keep_addresses=(variant == "fix"))
        impl.load_weights(weights[0])
        impl.process_weights_after_loading()
        kv_cache = torch.zeros(SLOTS, LORA, device=device)
        bufs = {"hidden_states": torch.zeros(max(CAPTURE_SIZES), HIDDEN, device=device),
                "ctx_slots": torch.zeros(max(CAPTURE_SIZES), CTX, dtype=torch.long, device=device)}
        if graphed:
            # graph + RL: captured once at engine start, never re-captured on weight updates
            events.persistent_state("NPUModelRunner", {"kv_cache": kv_cache})
            manager = GraphManager(
                lambda size: impl.forward_decode(bufs["hidden_states"][:size], bufs["ctx_slots"][:size], kv_cache),
                CAPTURE_SIZES, device=device, mode=CUDAGraphMode.FULL, static_buffers=bufs,
                on_freed="reuse", name="ACL graphs (FULL_DECODE_ONLY)")
            manager.capture()
        outs = []
        for version, latents, steps in plan:
            if version > 0:                                      # the trainer pushes new weights
                impl.load_weights(weights[version])
                impl.process_weights_after_loading()
            kv_cache.copy_(latents)                              # prefill of this rollout (eager)
            for hidden, ctx in steps:
                n = hidden.shape[0]
                if not graphed:
                    outs.append(impl.forward_decode(hidden, ctx, kv_cache))
                    continue
                size = manager.dispatch(n)
                bufs["hidden_states"][:n].copy_(hidden)
                bufs["ctx_slots"][:n].copy_(ctx)
                out = manager.replay(size, real=n, padded=bufs)  # padded rows keep the last step's rows
                outs.append(out.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
