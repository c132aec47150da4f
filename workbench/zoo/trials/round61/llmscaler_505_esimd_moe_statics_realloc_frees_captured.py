"""An eager batch of another size reallocates the esimd MoE static buffers that captured XPU graphs still use.

Upstream: https://github.com/intel/llm-scaler/pull/505 ("esimd MoE: sticky (grow-only) static buffers for
XPU-graph safety"), merge commit e9e9aeaa654b103064495a94069498b882b97d92.
Symptom: with ``VLLM_XPU_ENABLE_XPU_GRAPH=1`` (cudagraph_mode FULL_DECODE_ONLY), Qwen3.6-35B-A3B fp8 TP=2 emits
"!!!!" (NaN / garbage logits); ``MOE_STICKY_BUF=0`` reproduces it; eager mode is always correct.
Mechanism: ``moe_forward_full`` / ``moe_forward_full_v2`` (csrc/moe_batch/moe.sycl) keep file-level
``static thread_local`` scratch tensors shared by every MoE layer (``s2_topk_idx``, ``s2_topk_weight``,
``s2_routed_output``, ``s2_final_output``, ``s2_intermediates``). Their host helper ``ensure_moe_buffers_v2`` runs
at the start of every call and did ``if (s2_cached_ntokens != n_tokens) s2_... = torch::empty({n_tokens, ...})``:
every change of size reallocated and released the previous tensors to the allocator. A capture bakes the
addresses of the current set into the decode graph; replays never run ``ensure_*`` again. vLLM captures the
decode sizes largest first, so capturing bs=2 already released the set graph bs=4 was captured with, and a
batch that runs eagerly (here a 3-token prefill chunk, which FULL_DECODE_ONLY serves without a graph) released
the set of graph bs=2. The allocator hands those blocks to later tensors (here the step's logits, which async
scheduling keeps alive while the next step's graph is launched); the next bs=2 replay still writes its MoE
scratch and output there and overwrites them: the previous step's logits become that replay's MoE output.
Eager is correct because every call re-runs ``ensure_*`` and uses the live tensors.
Doctor: dangling-reference, at ensure_moe_buffers_v2 (its reallocation releases the storage a captured graph
still writes and reads).
Fix (upstream): the buffers only grow (``an = max(s2_cached_ntokens, n_tokens)``, reallocate only when
``s2_cached_ntokens < n_tokens``; ``MOE_STICKY_BUF=0`` restores the old behaviour), and the op returns
``s2_final_output.narrow(0, 0, n_tokens)``, so every captured address stays valid for the process lifetime.
"""
from __future__ import annotations

import torch

from workbench.engine import reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/intel/llm-scaler/pull/505"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "ensure_moe_buffers_v2"
SYMPTOM = "XPU-graph decode after an eager batch of another size writes freed MoE buffers: garbage ('!!!!') output"

HIDDEN, INTER, EXPERTS, TOP_K, NUM_SHARED, LAYERS = 8, 4, 4, 2, 1, 2
CAPTURE_SIZES = (4, 2)          # captured largest first, as vLLM does


class MoeStatics:
    """The file-level ``static thread_local`` buffers of moe.sycl, shared by all MoE layers."""

    def __init__(self, sticky: bool) -> None:
        self.sticky = sticky    # MOE_STICKY_BUF (the fix's default); False = the old behaviour
        self.s2_topk_idx = self.s2_topk_weight = None
        self.s2_routed_output = self.s2_final_output = self.s2_intermediates = None
        self.s2_cached_ntokens = -1


def moe_sticky_disabled(st: MoeStatics) -> bool:
    return not st.sticky


def ensure_moe_buffers_v2(st: MoeStatics, n_tokens: int, top_k: int, num_shared_experts: int,
                          hidden_size: int, intermediate_size: int, dev) -> None:
    rows_per_token = top_k + num_shared_experts
    sticky = not moe_sticky_disabled(st)
    an = max(st.s2_cached_ntokens, n_tokens) if sticky else n_tokens
    need = st.s2_cached_ntokens < n_tokens if sticky else st.s2_cached_ntokens != n_tokens
    if need:                        # reassigning releases the previous tensors to the allocator
        st.s2_topk_idx = torch.empty(an, top_k, dtype=torch.int32, device=dev)
        st.s2_topk_weight = torch.empty(an, top_k, device=dev)
        st.s2_routed_output = torch.empty(an * rows_per_token, hidden_size, device=dev)
        st.s2_final_output = torch.empty(an, hidden_size, device=dev)
        st.s2_intermediates = torch.empty(an * rows_per_token, intermediate_size, device=dev)
        st.s2_cached_ntokens = an


def moe_forward_full_v2(st, x, router_logits, w13, shared_w13, w2, shared_w2, top_k, num_shared_experts):
    """TopK -> up (routed + shared rows) -> down -> accumulate, all through the static buffers."""
    n = x.shape[0]
    ensure_moe_buffers_v2(st, n, top_k, num_shared_experts, x.shape[1], w13.shape[2], x.device)
    vals, idx = torch.topk(router_logits, top_k, dim=-1)
    st.s2_topk_idx[:n].copy_(idx)
    st.s2_topk_weight[:n].copy_(torch.softmax(vals, dim=-1))
    experts = st.s2_topk_idx[:n].long()
    routed, shared = n * top_k, n * num_shared_experts
    inter = st.s2_intermediates
    inter[:routed].copy_(torch.nn.functional.silu(torch.einsum("nh,nkhi->nki", x, w13[experts])).reshape(routed, -1))
    inter[routed:routed + shared].copy_(torch.nn.functional.silu(x @ shared_w13))
    out = st.s2_routed_output
    down = torch.einsum("nki,nkih->nkh", inter[:routed].view(n, top_k, -1), w2[experts])
    out[:routed].copy_((down * st.s2_topk_weight[:n, :, None]).reshape(routed, -1))
    out[routed:routed + shared].copy_(inter[routed:routed + shared] @ shared_w2)
    final = st.s2_final_output
    torch.add(out[:routed].view(n, top_k, -1).sum(1), out[routed:routed + shared], out=final[:n])
    return final if moe_sticky_disabled(st) else final.narrow(0, 0, n)


class Qwen3MoeDecoderLayer:
    def __init__(self, gen, device) -> None:
        self.gate = randn(HIDDEN, EXPERTS, gen=gen, device=device)
        self.w13 = randn(EXPERTS, HIDDEN, INTER, gen=gen, device=device, scale=0.5)
        self.w2 = randn(EXPERTS, INTER, HIDDEN, gen=gen, device=device, scale=0.5)
        self.shared_w13 = randn(HIDDEN, INTER, gen=gen, device=device, scale=0.5)
        self.shared_w2 = randn(INTER, HIDDEN, gen=gen, device=device, scale=0.5)

    def _forward_esimd_moe(self, st, hidden_states):
        router_logits = hidden_states @ self.gate
        return moe_forward_full_v2(st, hidden_states, router_logits, self.w13, self.shared_w13, self.w2,
                                   self.shared_w2, TOP_K, NUM_SHARED)

    def forward(self, st, hidden_states):
        return hidden_states + self._forward_esimd_moe(st, hidden_states)   # residual add reads the MoE output


class Qwen3MoeModel:
    def __init__(self, device) -> None:
        gen = generator(505)
        self.layers = [Qwen3MoeDecoderLayer(gen, device) for _ in range(LAYERS)]
        self.lm_head = randn(HIDDEN, HIDDEN, gen=gen, device=device)

    def forward(self, st, hidden_states):
        for layer in self.layers:
            hidden_states = layer.forward(st, hidden_states)
        return hidden_states

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


def run(variant: str, device: str = "cpu"):
    model = Qwen3MoeModel(device)
    gen = generator(5050)
    # (kind, embeddings): decode batches replay a graph; the prefill chunk runs eagerly (FULL_DECODE_ONLY)
    steps = [("decode", randn(2, HIDDEN, gen=gen, device=device)),
             ("prefill", randn(3, HIDDEN, gen=gen, device=device)),
             ("decode", randn(2, HIDDEN, gen=gen, device=device)),
             ("decode", randn(2, HIDDEN, gen=gen, device=device)),
             ("decode", randn(4, HIDDEN, gen=gen, device=device))]

    def eager():
        st = MoeStatics(sticky=(variant == "fix"))
        return [model.compute_logits(model.forward(st, x)) for _, x in steps]

    def served():
        st = MoeStatics(sticky=(variant == "fix"))
        graphs = {}
        for size in CAPTURE_SIZES:                      # capture_model(): largest size first
            x_buf = torch.zeros(size, HIDDEN, device=device)
            g, out = capture(lambda x_buf=x_buf: model.forward(st, x_buf), device=device, on_freed="reuse",
                             name=f"decode_bs{size}", static={"inputs_embeds": x_buf}, owner="vllm xpu model runner")
            graphs[size] = (g, out, x_buf)
        results = []
        for kind, x in steps:
            if kind == "prefill":
                results.append(model.compute_logits(model.forward(st, x)))
                continue
            g, out, x_buf = graphs[x.shape[0]]
            x_buf.copy_(x)
            hidden = replay(g, out)
            with reuse_freed_blocks():                  # async scheduling keeps these logits past the next step
                results.append(model.compute_logits(hidden))
        return results

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
