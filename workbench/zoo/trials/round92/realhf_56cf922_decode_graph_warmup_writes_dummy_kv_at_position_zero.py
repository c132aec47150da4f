"""ReaLHF's decoding CUDA graph is warmed up on dummy inputs with cache_seqlens = 0: the eager warmup appends the dummy token's K/V into slot 0 of every live KV cache, overwriting the first prompt token.

Upstream: https://github.com/openpsi-project/ReaLHF/commit/56cf92272d4854a48148f4ac5a0fb810ec132710 ("fix normal cuda
graph generate bug", openpsi-project/ReaLHF, committed to main 2024-03-08, before the repository's first pull requests).
Read: the commit's full diff of ``impl/model/nn/flash_mqat/flash_generate.py`` and the file before it:
``get_decoding_cuda_graph`` (input buffers ``input_ids``/``position_ids`` = zeros, ``cache_seqlens=torch.zeros(bs)``,
the live ``k_caches``/``v_caches``; one eager ``model._forward(**input_buffers)`` then ``torch.cuda.graph`` capture of
the same call) and ``generate`` (prefill, copying the prompt K/V into ``kvcache_seqlen``-long caches, ``genstep``, then
the main loop copying ``next_tokens``/``cache_seqlens`` into the input buffers, ``graph.replay()``, then
``cache_seqlens`` incremented). After the fix the buffers are ``input_ids=torch.ones(...)``,
``position_ids=cache_seqlens.clone()[:, None]`` and ``cache_seqlens=cache_seqlens.clone()``, with the comment "here
cache_seqlens should be the real cache_seqlens, otherwise k/v cache will be changed in-place during capturing", and
``generate`` passes ``cache_seqlens`` in. The same commit also comments out the reuse of a graph cached across
``generate`` calls; the workload below makes one ``generate`` call, so that part is not modelled. Reconstructed: the
model (FlashMQAT stand-in) and flash-attn's ``flash_attn_with_kvcache`` semantics (append K/V at ``cache_seqlens[b]`` in
place, attend to positions up to ``cache_seqlens[b]``).
Symptom: generation with CUDA graphs (PPO rollouts) produces different tokens and log-probabilities from generation
without graphs, from the first decoding step on; nothing raises.
Mechanism: the graph is built after prefill, on the KV caches that already hold the prompts. Its warmup is a real eager
forward of a dummy batch (token 0 at position 0, ``cache_seqlens`` 0), and the attention kernel appends the dummy
token's K/V at ``cache_seqlens`` = 0 of every sequence: the slot of the first prompt token. Replays write at the right
positions afterwards, but that slot is never rewritten, so every decoded token attends to a dummy key/value instead of
the first prompt token. Without graphs there is no warmup.
Doctor: persistent-mutation, at get_decoding_cuda_graph. Eager code around the capture (the warmup forward on dummy
inputs) writes into the KV caches at slots that hold live prompt data it does not own, clobbering them for every later
step.
Fix (upstream): build the input buffers from the real ``cache_seqlens`` (and positions), so the warmup's append lands in
the slot the first decoding step is about to write anyway.
Modelled: ``generate`` (prefill into per-layer caches of length ``max_seqlen + max_new_tokens``, ``genstep`` greedy, the
decoding loop with copies into the input buffers and replays), ``get_decoding_cuda_graph`` (both forms of the input
buffers, one warmup then capture), ``GenerationConfig`` and a ``FlashMQATModel`` stand-in (2 layers, hidden 8, 2 heads
of 4, vocab 16, learned positions, float64) whose ``_forward`` appends K/V as ``flash_attn_with_kvcache`` does.
Workload: three prompts (lengths 3, 5, 4) are prefilled (their logits give the first token), then 5 decoding steps run
greedily through the graph (``max_new_tokens`` 6). The prefill logits match; the bug's logits differ from eager from the
first decoding step on (2.66 there, 5.92 at most) and two of the three sequences take other tokens. The fix equals
eager.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/openpsi-project/ReaLHF/commit/56cf92272d4854a48148f4ac5a0fb810ec132710"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "get_decoding_cuda_graph"
SYMPTOM = ("generation with the decoding CUDA graph diverges from eager generation: the graph's warmup on dummy inputs "
           "with cache_seqlens = 0 writes the dummy token's K/V over the first prompt token in every live KV cache")

N_LAYERS, HIDDEN, N_HEADS, HEAD_DIM, VOCAB, MAX_POSITIONS = 2, 8, 2, 4, 16, 32

_variant = "bug"


@dataclasses.dataclass
class GenerationConfig:
    min_new_tokens: int = 1
    max_new_tokens: int = 10
    greedy: bool = True


def flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens):
    """Append ``k``/``v`` at ``cache_seqlens[b]`` in place, attend over positions ``0..cache_seqlens[b]``."""
    bs, max_len = k_cache.shape[0], k_cache.shape[1]
    rows = torch.arange(bs, device=q.device)
    pos = cache_seqlens.long()
    k_cache[rows, pos] = k
    v_cache[rows, pos] = v
    scores = torch.einsum("bhd,bshd->bhs", q, k_cache) * HEAD_DIM ** -0.5
    visible = torch.arange(max_len, device=q.device)[None, :] <= pos[:, None]            # [bs, max_len]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("bhs,bshd->bhd", torch.softmax(scores, -1), v_cache)


class FlashMQATModel:
    """Stand-in: embedding + learned positions, pre-norm attention blocks with an MLP, lm head."""

    def __init__(self, device):
        gen = generator(56)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.device = device
        self.wte, self.wpe = r(VOCAB, HIDDEN, scale=1.0), r(MAX_POSITIONS, HIDDEN, scale=0.3)
        self.layers = [dict(wqkv=r(HIDDEN, 3 * HIDDEN), wo=r(HIDDEN, HIDDEN), w1=r(HIDDEN, 2 * HIDDEN),
                            w2=r(2 * HIDDEN, HIDDEN)) for _ in range(N_LAYERS)]
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    @staticmethod
    def _norm(x):
        return torch.nn.functional.layer_norm(x, (HIDDEN,))

    def _mlp(self, layer, x):
        return torch.nn.functional.gelu(self._norm(x) @ layer["w1"]) @ layer["w2"]

    def prefill(self, prompt):
        """One prompt, causal self-attention; returns the last logits and per-layer prompt K/V [len, heads, dim]."""
        n = prompt.shape[0]
        x = self.wte[prompt] + self.wpe[:n]
        kvs = []
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        for layer in self.layers:
            q, k, v = (self._norm(x) @ layer["wqkv"]).view(n, 3, N_HEADS, HEAD_DIM).unbind(1)
            kvs.append((k, v))
            scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
            att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
            x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(n, HIDDEN) @ layer["wo"]
            x = x + self._mlp(layer, x)
        return (self._norm(x) @ self.lm_head)[-1], kvs

    def _forward(self, input_ids, position_ids, k_caches, v_caches, cache_seqlens, max_seqlen=None, cu_seqlens=None):
        """One decoding token per sequence; K/V caches are changed in place."""
        bs = input_ids.shape[0]
        x = self.wte[input_ids[:, 0]] + self.wpe[position_ids[:, 0]]
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            q, k, v = (self._norm(x) @ layer["wqkv"]).view(bs, 3, N_HEADS, HEAD_DIM).unbind(1)
            out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens)
            x = x + out.reshape(bs, HIDDEN) @ layer["wo"]
            x = x + self._mlp(layer, x)
        return (self._norm(x) @ self.lm_head)[:, None, :]


def genstep(next_token_logits, unfinished_sequences, generated_idx, gconfig):
    next_tokens = next_token_logits.argmax(-1)
    terminate = generated_idx >= gconfig.max_new_tokens - 1
    return next_tokens, terminate, unfinished_sequences


@torch.no_grad()
def get_decoding_cuda_graph(model, bs, k_caches, v_caches, cache_seqlens):
    # Build a CUDAGraph for decoding inference.
    if _variant == "fix":
        input_buffers = dict(
            input_ids=torch.ones(bs, 1, dtype=torch.long, device=model.device),
            position_ids=cache_seqlens.clone()[:, None].long(),
            k_caches=k_caches,
            v_caches=v_caches,
            # NOTE: here cache_seqlens should be the real cache_seqlens, otherwise k/v cache will be changed in-place
            cache_seqlens=cache_seqlens.clone(),
            max_seqlen=None,
            cu_seqlens=None,
        )
    else:
        input_buffers = dict(
            input_ids=torch.zeros(bs, 1, dtype=torch.long, device=model.device),
            position_ids=torch.zeros(bs, 1, dtype=torch.long, device=model.device),
            k_caches=k_caches,
            v_caches=v_caches,
            cache_seqlens=torch.zeros(bs, dtype=torch.int32, device=model.device),
            max_seqlen=None,
            cu_seqlens=None,
        )
    static = {name: input_buffers[name] for name in ("input_ids", "position_ids", "cache_seqlens")}
    state = {f"{kind}[{i}]": c for kind in ("k_caches", "v_caches") for i, c in enumerate(input_buffers[kind])}
    # model._forward(**input_buffers) once eagerly, then the capture of the same call
    graph, output = capture(lambda: model._forward(**input_buffers), device=model.device, warmups=1,
                            name=f"decoding bs={bs}", owner="get_decoding_cuda_graph", static=static, state=state)
    output_buffers = dict(logits=output)
    return graph, input_buffers, output_buffers


@torch.no_grad()
def generate(model, prompts, gconfig, use_cuda_graph):
    device = model.device
    bs = len(prompts)
    input_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
    max_seqlen = max(len(p) for p in prompts)
    kvcache_seqlen = max_seqlen + gconfig.max_new_tokens
    k_caches = [torch.zeros(bs, kvcache_seqlen, N_HEADS, HEAD_DIM, dtype=torch.float64, device=device)
                for _ in range(N_LAYERS)]
    v_caches = [torch.zeros_like(k) for k in k_caches]

    # Prefill: the prompts' K/V go into the caches, the last logits give the first token.
    logits = []
    for b, prompt in enumerate(prompts):
        last, kvs = model.prefill(torch.tensor(prompt, dtype=torch.long, device=device))
        logits.append(last)
        for layer_idx, (k, v) in enumerate(kvs):
            k_caches[layer_idx][b, :len(prompt)] = k
            v_caches[layer_idx][b, :len(prompt)] = v
    logits = torch.stack(logits)
    cache_seqlens = input_lens.clone()
    unfinished_sequences = torch.ones(bs, dtype=torch.long, device=device)
    generated_idx = 0
    next_tokens, terminate, unfinished_sequences = genstep(logits, unfinished_sequences, generated_idx, gconfig)
    all_logits = [logits.clone()]
    generated_idx += 1

    if use_cuda_graph:
        graph, input_buffers, output_buffers = get_decoding_cuda_graph(model, bs, k_caches, v_caches, cache_seqlens)

    # The main loop.
    while not terminate:
        if use_cuda_graph:
            input_buffers["input_ids"].copy_(next_tokens.unsqueeze(-1))
            input_buffers["position_ids"].copy_(cache_seqlens.unsqueeze(-1))
            input_buffers["cache_seqlens"].copy_(cache_seqlens)
            # K/v cache will be changed in-place with flash attention.
            logits = replay(graph, output_buffers["logits"])[:bs].squeeze(1)
        else:
            logits = model._forward(next_tokens.unsqueeze(-1), cache_seqlens.long().unsqueeze(-1), k_caches, v_caches,
                                    cache_seqlens)[:, 0]
        all_logits.append(logits.clone())
        cache_seqlens += 1
        next_tokens, terminate, unfinished_sequences = genstep(logits, unfinished_sequences, generated_idx, gconfig)
        generated_idx += 1
    return all_logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [[3, 7, 1], [9, 2, 5, 5, 11], [4, 8, 13, 6]]
    gconfig = GenerationConfig(max_new_tokens=6)

    def serve(use_cuda_graph):
        return generate(FlashMQATModel(device), prompts, gconfig, use_cuda_graph)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
