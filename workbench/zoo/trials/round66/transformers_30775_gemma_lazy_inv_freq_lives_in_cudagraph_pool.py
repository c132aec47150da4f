"""Gemma's rotary ``inv_freq`` is created lazily inside the first compiled call, so it lives in the cudagraph pool.

Upstream: https://github.com/huggingface/transformers/pull/30775 ("Make `Gemma` work with `torch.compile`", merged
May 2024; the same change reached the "Copied from" rotary classes).
Symptom: ``model.forward = torch.compile(model.forward, mode="reduce-overhead")`` with a static-cache ``generate``
fails on Gemma (A10, torch 2.3): "RuntimeError: Error: accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run. Stack trace: ... modeling_gemma.py, line 113, in forward
self.inv_freq = 1.0 / (. To prevent overwriting, clone the tensor outside of torch.compile() ...".
Mechanism: ``GemmaRotaryEmbedding.__init__`` (src/transformers/models/gemma/modeling_gemma.py) did
``self.register_buffer("inv_freq", None, persistent=False)``; ``GemmaRotaryEmbedding.forward(x, position_ids)``
did the lazy init ``if self.inv_freq is None: self.inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2,
dtype=torch.int64, device=x.device).float() / self.dim))`` and then ``freqs = inv_freq_expanded @
position_ids_expanded``. The first compiled call (prefill) is recorded by cudagraph trees: the new ``inv_freq`` is
allocated in the trees' graph pool and, as a mutated module attribute, is an output of that graph. The next calls
(decode, a recompiled graph since ``inv_freq`` is no longer None) read it as an input. But each call is a new
generation: the trees treat the outputs of earlier generations as dead and hand their memory to the next
recording, so the decode graph's own buffers land in the memory the module still reads as ``inv_freq``, and every
decode replay overwrites it. (cudagraph trees detect the read of the overwritten output and raise the error above;
the model leaves that check out and shows the wrong rotary angles it guards against.) Eager is right: ``inv_freq``
is an ordinary allocation nothing reuses.
Doctor: overwritten-output, at ``GemmaRotaryEmbedding.forward`` (its lazy init makes ``inv_freq`` an output of the
first graph; later graphs read it after a replay that reused its pool memory overwrote it).
Fix (upstream): ``__init__`` computes ``inv_freq`` eagerly and registers it as a real (non-persistent) buffer; the
``if self.inv_freq is None`` branch leaves ``forward``.
Modelled: one layer, one head, batch 1, a static KV cache; ``CUDAGraphTreeManager`` records each function on its
first call (no warmup run), one generation per call; the trees' checkpointed allocator is modelled by
``empty_from_pool``, through which the inductor buffer of the ``freqs`` product (the K=1 matmul lowered to a
pointwise multiply) is allocated: it hands out the memory of a dead output of the same size. A CPU capture executes
what it records, so on the CPU the first decode replay already reads the overwritten ``inv_freq``; on CUDA the
second does.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/transformers/pull/30775"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "forward"
SYMPTOM = "torch.compile(reduce-overhead) Gemma generate: decode replays overwrite the lazily created rotary inv_freq"

VOCAB, HIDDEN, HEAD_DIM, MAX_LEN = 16, 8, 8, 16
PROMPT = (3, 9, 1, 12, 6)
NEW_TOKENS = 5

_TREE = None          # the manager whose recording is open (its allocator serves the compiled code's buffers)


def empty_from_pool(shape, device):
    """An inductor buffer: during a recording, the trees' allocator may place it in a dead output's memory."""
    if _TREE is not None:
        return _TREE.allocate(shape)
    return torch.empty(shape, device=device)


class GemmaRotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, base=10000, device=None, variant="bug"):
        super().__init__()
        self.dim, self.base = dim, base
        if variant == "bug":
            self.register_buffer("inv_freq", None, persistent=False)
        else:
            inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
            self.register_buffer("inv_freq", tensor=inv_freq.to(device), persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        if self.inv_freq is None:
            self.inv_freq = 1.0 / (
                self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64, device=x.device).float() / self.dim))
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = empty_from_pool((position_ids.shape[0], self.dim // 2, position_ids.shape[1]), x.device)
        torch.mul(inv_freq_expanded, position_ids_expanded, out=freqs)      # inv_freq_expanded @ position_ids
        emb = torch.cat((freqs, freqs), dim=1).transpose(1, 2)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class GemmaForCausalLM(torch.nn.Module):
    """Embedding, one attention layer with RoPE over a static KV cache, lm head."""

    def __init__(self, device, variant):
        super().__init__()
        gen = generator(30775)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.6) for _ in range(3))
        self.wo = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.6)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.rotary_emb = GemmaRotaryEmbedding(HEAD_DIM, base=100, device=device, variant=variant)

    def forward(self, input_ids, position_ids, cache_position, k_cache, v_cache):
        h = self.embed[input_ids]                                   # [1, seq, HIDDEN]
        cos, sin = self.rotary_emb(h, position_ids)
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k_cache.index_copy_(0, cache_position, k[0])                # StaticCache.update
        v_cache.index_copy_(0, cache_position, v[0])
        ctx = torch.arange(MAX_LEN, device=h.device)
        mask = ctx[None, :] <= cache_position[:, None]
        scores = (q[0] @ k_cache.T / HEAD_DIM ** 0.5).masked_fill(~mask, -1e9)
        out = h + (torch.softmax(scores, -1) @ v_cache @ self.wo)[None]
        return out @ self.lm_head


class CUDAGraphTreeManager:
    """cudagraph trees in miniature: one shared pool; a function is recorded on its first call and replayed after;
    every call is a new generation, and the outputs of earlier generations are dead memory for new recordings."""

    def __init__(self, device):
        self.device = device
        self.cuda_graphs_thread_pool = graph_pool_handle(device)
        self.nodes = {}
        self.live_outputs, self.dead_outputs = [], []

    def allocate(self, shape):
        nbytes = torch.Size(shape).numel() * 4
        for i, t in enumerate(self.dead_outputs):
            if t.untyped_storage().nbytes() == nbytes:
                return self.dead_outputs.pop(i).view(-1).view(shape)
        return torch.empty(shape, device=self.device)

    def run(self, function_id, model, static_inputs, inputs, state):
        global _TREE
        self.dead_outputs += self.live_outputs                      # a new generation begins
        self.live_outputs = []
        node = self.nodes.get(function_id)
        if node is None:                                            # record_function
            before = {n: m.__dict__.get("_buffers", {}).copy() for n, m in model.named_modules()}
            for dst, src in zip(static_inputs, inputs):
                dst.copy_(src)
            _TREE = self
            try:
                g, logits = capture(lambda: model(*static_inputs, *state), device=self.device, warmups=0,
                                    pool=self.cuda_graphs_thread_pool, name=function_id,
                                    owner="CUDAGraphTreeManager",
                                    static={"input_ids": static_inputs[0], "position_ids": static_inputs[1],
                                            "cache_position": static_inputs[2]},
                                    state={"k_cache": state[0], "v_cache": state[1]})
            finally:
                _TREE = None
            mutated = [b for n, m in model.named_modules() for k, b in m._buffers.items()
                       if b is not None and before[n].get(k) is not b]        # side effects: graph outputs
            node = self.nodes[function_id] = (g, logits, mutated)
        g, logits, mutated = node
        for dst, src in zip(static_inputs, inputs):
            dst.copy_(src)
        out = replay(g, logits)
        self.live_outputs += [logits] + mutated
        return out


def run(variant: str, device: str = "cpu"):
    def generate(compiled: bool):
        model = GemmaForCausalLM(device, variant)
        k_cache = torch.zeros(MAX_LEN, HEAD_DIM, device=device)
        v_cache = torch.zeros(MAX_LEN, HEAD_DIM, device=device)
        tree = CUDAGraphTreeManager(device) if compiled else None
        statics = {}
        tokens, start, outs = list(PROMPT), 0, []
        while len(outs) < NEW_TOKENS:
            ids = torch.tensor([tokens[start:]]).to(device)
            pos = torch.arange(start, len(tokens))
            inputs = (ids, pos[None].to(device), pos.to(device))
            if compiled:
                key = f"forward seq{ids.shape[1]}"
                if key not in statics:
                    statics[key] = tuple(torch.zeros_like(t) for t in inputs)
                logits = tree.run(key, model, statics[key], inputs, (k_cache, v_cache))
            else:
                logits = model(*inputs, k_cache, v_cache)
            next_token_logits = logits[:, -1, :].clone()
            outs.append(next_token_logits)
            start = len(tokens)
            tokens.append(int(next_token_logits.argmax(-1)))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
