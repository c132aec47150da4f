"""An untagged KV cache reaches the CUDA-graph region as a copied input: the cache update lands in the copy.

Upstream: https://github.com/Lightning-AI/lightning-thunder/issues/2658 ("Bad output with cudagraphs /
possible improvements"), fixed by https://github.com/Lightning-AI/lightning-thunder/pull/2667 ("Fix
the kv cache input STATIC_MEMORY_LOCATION tag in QuickStart example", commit 72048682).
Symptom: ``thunder.compile(model, recipe="hf-transformers")`` with the reduce-overhead (CUDAGraphTransform)
plugin generates bad text with a transformers ``StaticCache``; without the plugin the text is good
(lightning-thunder main, October 2025).
Mechanism: ``CUDAGraphRunner`` uses an input of a graphed region in place only when its proxy carries
``ProxyTag.STATIC_MEMORY_LOCATION``; any other tensor input gets a static buffer of its own
(``empty_like(x).copy_(x)``) that is refreshed from the argument before every replay. The HF recipe
tagged the operand of each ``index_copy`` it rewrote inside the computation trace; the computation
inputs that carry the ``StaticCache`` key/value tensors stayed untagged (the PR's title and diff say
so; the issue reports only the bad text), so the cache reached the graph as an ordinary input. The
captured in-place cache update then writes the new token's key/value into the runner's copy, which
the next call overwrites from the real cache, which never received them: later decode steps attend
over zeros where the generated tokens' keys should be.
Doctor: persistent-mutation, at ``update`` (the in-place ``index_copy_`` of the key/value cache).
Fix (upstream): find the computation inputs that come from ``StaticCache``/``StaticLayer`` in the
prologue and tag them ``STATIC_MEMORY_LOCATION``, so the graph reads and writes the cache itself.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Lightning-AI/lightning-thunder/issues/2658"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "update"
SYMPTOM = "generated tokens' keys/values never reach the real KV cache: later decode steps go wrong"
DIM, MAX_CACHE_LEN, PROMPT = 4, 6, [3, 1]
STATIC_MEMORY_LOCATION = "STATIC_MEMORY_LOCATION"


class Attention(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(2658)
        self.emb = randn(8, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (torch.nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=0.6))
                                     for _ in range(3))


def update(keys, values, key_states, value_states, cache_position):
    """transformers' ``StaticLayer.update``: write this step's key/value at its position, in place."""
    keys.index_copy_(0, cache_position, key_states)
    values.index_copy_(0, cache_position, value_states)
    return keys, values


def decode_region(x, cache_position, wq, wk, wv, keys, values):
    """The graphed region of one decode step: projections, cache update, attention over the cache."""
    q, k, v = x @ wq, x @ wk, x @ wv
    keys, values = update(keys, values, k, v, cache_position)
    scores = (q @ keys.t()) / DIM ** 0.5
    pos = torch.arange(MAX_CACHE_LEN, device=x.device)
    scores = scores.masked_fill(pos[None, :] > cache_position[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ values


class CUDAGraphRunner:
    """thunder.transforms.cudagraph.CUDAGraphRunner: one graph per argument signature; inputs whose
    proxy is tagged STATIC_MEMORY_LOCATION are used in place, every other tensor input gets a static
    buffer that is refreshed from the argument before each replay."""

    def __init__(self, device):
        self.device = device
        self.cuda_graph_cache = {}

    def get_static_buffer(self, x):
        if isinstance(x, torch.Tensor):
            return torch.empty_like(x).copy_(x)
        return x

    def build_cuda_graph(self, fn, args, static_args_mask, names):
        static_inputs = tuple(self.get_static_buffer(arg) if not is_static else arg
                              for arg, is_static in zip(args, static_args_mask))
        copied = {n: s for n, s, m in zip(names, static_inputs, static_args_mask)
                  if not m and isinstance(s, torch.Tensor)}
        state = {n: s for n, s, m in zip(names, static_inputs, static_args_mask)
                 if m and n in ("keys", "values")}                 # tagged cache: read and written in place
        graph, static_outputs = capture(lambda: fn(*static_inputs), device=self.device, warmups=3,
                                        name="CUDAGraph1", static=copied, state=state or None,
                                        owner="thunder CUDAGraphRunner")
        return graph, static_inputs, static_outputs

    def call_cuda_graph(self, fn, args, static_inputs_mask, names):
        cache_key = (static_inputs_mask, tuple((a.dtype, a.shape, a.stride()) for a in args))
        if cache_key not in self.cuda_graph_cache:
            self.cuda_graph_cache[cache_key] = self.build_cuda_graph(fn, args, static_inputs_mask, names)
        graph, static_inputs, static_outputs = self.cuda_graph_cache[cache_key]
        for static_input, arg in zip(static_inputs, args):
            if id(static_input) != id(arg) and isinstance(static_input, torch.Tensor):
                static_input.copy_(arg)
        return replay(graph, static_outputs)


def computation_input_tags(variant):
    """Tags on the computation trace's inputs after the recipe's transform: parameters are always
    static; the cache inputs are tagged only by the fixed recipe."""
    cache_tag = {STATIC_MEMORY_LOCATION} if variant == "fix" else set()
    return {"x": set(), "cache_position": set(), "wq": {STATIC_MEMORY_LOCATION}, "wk": {STATIC_MEMORY_LOCATION},
            "wv": {STATIC_MEMORY_LOCATION}, "keys": cache_tag, "values": cache_tag}


def run(variant: str, device: str = "cpu"):
    model = Attention(device)
    names = ("x", "cache_position", "wq", "wk", "wv", "keys", "values")
    tags = computation_input_tags(variant)
    mask = tuple(STATIC_MEMORY_LOCATION in tags[n] for n in names)

    def generate(graphed: bool):
        keys = torch.zeros(MAX_CACHE_LEN, DIM, device=device)      # StaticCache layer 0
        values = torch.zeros(MAX_CACHE_LEN, DIM, device=device)
        with torch.no_grad():
            for p, tok in enumerate(PROMPT):                         # prefill (eager)
                x = model.emb[tok][None]
                update(keys, values, x @ model.wk, x @ model.wv, torch.tensor([p], device=device))
        runner = CUDAGraphRunner(device)
        token, outs = PROMPT[-1], []
        for step in range(MAX_CACHE_LEN - len(PROMPT)):
            x = model.emb[token][None].clone()
            cache_position = torch.tensor([len(PROMPT) + step], device=device)
            args = (x, cache_position, model.wq, model.wk, model.wv, keys, values)
            with torch.no_grad():
                out = (runner.call_cuda_graph(decode_region, args, mask, names) if graphed
                       else decode_region(*args))
            outs.append(out.clone())
            token = int(out.sum().abs() * 10) % 8                    # greedy-ish next token from the output
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
