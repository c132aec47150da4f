"""Transformers backend scales Gemma embeddings outside the compiled decoder: its piecewise graph reads freed ones.

Upstream: https://github.com/vllm-project/vllm/pull/48010 ("Fix embed scaling + CUDA graphs in Transformers
modelling backend", merged July 2026).
Symptom: "gibberish outputs on models which perform embed scaling _inside_ the input embedding module on the
Transformers side, i.e. Gemma" when served through the Transformers modeling backend with CUDA graphs (the
title ties it to CUDA graphs: without them the scaling in ``Base.forward`` does its job).
Mechanism: ``Base.__init__`` replaces the Hugging Face input embedding (``Gemma3TextScaledWordEmbedding``, which
multiplies by its ``embed_scale``) with vLLM's plain ``VocabParallelEmbedding`` and remembers ``self.embed_scale``.
To keep the scaling, ``Base.forward`` (plain Python, outside the compiled region) turns every call that comes with
``input_ids`` into ``inputs_embeds = self.embed_input_ids(input_ids)`` (lookup, then ``inputs_embeds *=
self.embed_scale``) and calls the compiled Hugging Face decoder with ``input_ids=None``. The decoder is the
``support_torch_compile`` region, replayed through piecewise CUDA graphs whose ``CUDAGraphWrapper`` does not copy
inputs: a replay reads every graph input at the address it had at capture, which works for the runner's
persistent ``input_ids`` / ``positions`` buffers. ``inputs_embeds`` is instead a temporary of the capture dummy run:
the graph bakes its address and the step releases it. Capture runs under ``graph_capture`` (a side stream), so
the caching allocator keeps that block for the capture stream while each served step makes its ``inputs_embeds``
elsewhere: replays embed nothing and read the released capture-time block (whatever the capture phase left
there); eager steps read the fresh embeddings.
Doctor: dangling-reference, at ``embed_input_ids`` (it creates the per-step ``inputs_embeds`` outside the graphs;
the captured decoder graph keeps reading the capture step's one after that step released it).
Fix (upstream): a ``ScaledVocabParallelEmbedding(VocabParallelEmbedding)`` (``forward`` returns
``super().forward(input_) * self.embed_scale``, with ``embed_scale=float(embed_scale)``) replaces the input
embedding when the Hugging Face module had an ``embed_scale``; ``embed_input_ids`` just calls the embedding and the
special case in ``Base.forward`` is gone, so the compiled decoder embeds (and scales) the runner's ``input_ids``
buffer inside its graph.
Read: the PR description; the pre-fix ``Base.__init__`` / ``embed_input_ids`` / ``forward`` of
``vllm/model_executor/models/transformers/base.py`` from an earlier stored version (not necessarily the fix's
parent) and the post-fix ones (with
``ScaledVocabParallelEmbedding``); the diff itself was not available, it is inferred from the two versions. That
the piecewise ``CUDAGraphWrapper`` replays inputs by their capture-time address is quoted from its docstring in
https://github.com/vllm-project/vllm/pull/53915; that the failing steps are the piecewise ones (Base.forward is not
inside them) is our reading of the code, as is the allocator's part. The decoder is one piece (the attention
splitting ops are left out: the layers here are per-token), TP=1, cudagraph_mode PIECEWISE.
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/48010"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "embed_input_ids"
SYMPTOM = "Gemma via the Transformers backend with piecewise CUDA graphs: replays read the capture step's freed embeddings (gibberish)"

VOCAB, HIDDEN, NUM_LAYERS = 16, 8, 2
MAX_POSITIONS = 32
CAPTURE_SIZES = [2, 4]                         # cudagraph_capture_sizes
MAX_NUM_TOKENS = CAPTURE_SIZES[-1]
NUM_WARMUPS = 1                                # cudagraph_num_of_warmups


class ForwardContext:
    """``set_forward_context``: how this step runs (``"NONE"`` eager, ``"PIECEWISE"``) and its batch."""

    mode = "NONE"
    num_tokens = 0                             # real tokens of the step
    padded: dict = {}


def pad_for_cudagraph(n: int) -> int:
    return next(size for size in CAPTURE_SIZES if size >= n)


@contextlib.contextmanager
def graph_capture(device):
    """``vllm.distributed.parallel_state.graph_capture``: the capture phase (warmups and the eager parts of every
    dummy run included) runs on a side stream."""
    if torch.device(device).type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(device).wait_stream(stream)


class VocabParallelEmbedding:
    def __init__(self, weight, device):
        self.weight, self.device = weight, device

    def forward(self, input_):
        return torch.nn.functional.embedding(input_, self.weight)

    __call__ = forward


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """The fix: ``VocabParallelEmbedding`` that scales its output."""

    def __init__(self, weight, device, *, embed_scale: float):
        super().__init__(weight, device)
        self.embed_scale = embed_scale

    def forward(self, input_):
        return super().forward(input_) * self.embed_scale

    __call__ = forward


class Gemma3TextScaledWordEmbedding:
    """The Hugging Face module the backend replaces: it multiplies by ``embed_scale`` (a non-persistent buffer)."""

    def __init__(self, weight, device):
        self.weight = weight
        self.embed_scale = torch.tensor(HIDDEN ** 0.5, device=device)


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class Gemma3TextModel:
    """The Hugging Face decoder (the ``support_torch_compile`` region); per-token layers keep it one piece."""

    def __init__(self, device):
        gen = generator(48010)
        self.embed_weight = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.3)
        self.embed_tokens = Gemma3TextScaledWordEmbedding(self.embed_weight, device)
        self.pos_table = randn(MAX_POSITIONS, HIDDEN, gen=gen, device=device, scale=0.2)
        self.layers = [(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4),
                        1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)) for _ in range(NUM_LAYERS)]
        self.norm_weight = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, module):
        self.embed_tokens = module

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden_states = inputs_embeds
        for w, norm_w in self.layers:
            hidden_states = hidden_states + torch.tanh(rms_norm(hidden_states, norm_w) @ w
                                                       + self.pos_table[position_ids])
        return (rms_norm(hidden_states, self.norm_weight),)


class CUDAGraphWrapper:
    """The piecewise backend's wrapper of the compiled decoder: captures one graph per token count on its first
    PIECEWISE call, and replays it afterwards. It does not copy inputs: the graph reads them where they were at
    capture."""

    def __init__(self, runnable, device):
        self.runnable, self.device = runnable, device
        self.entries = {}

    def __call__(self, **kwargs):
        ctx = ForwardContext
        if ctx.mode == "NONE":
            return self.runnable.forward(**kwargs)
        size = next(v for v in kwargs.values() if v is not None).shape[1]
        if size not in self.entries:
            g = new_graph(self.device)
            with graph(g, name=f"PIECEWISE size {size}"):
                output = self.runnable.forward(**kwargs)
            self.entries[size] = (g, output[0])
            return output
        g, output = self.entries[size]
        return (replay(g, output, real=ctx.num_tokens, size=size, padded=ctx.padded),)


class TransformersForCausalLM:
    """The backend's ``Base`` (plus the causal-LM head): plain Python around the compiled decoder."""

    def __init__(self, device, variant, graphed):
        self.device = device
        self.model = Gemma3TextModel(device)
        input_embeddings = self.model.get_input_embeddings()
        embed_scale = getattr(input_embeddings, "embed_scale", None)
        if variant == "fix":
            self.embed_scale = None
            self.model.set_input_embeddings(ScaledVocabParallelEmbedding(
                input_embeddings.weight, device, embed_scale=float(embed_scale)))
        else:                                  # scaling remembered, applied in Base.forward
            self.embed_scale = embed_scale
            self.model.set_input_embeddings(VocabParallelEmbedding(input_embeddings.weight, device))
        self.compiled = CUDAGraphWrapper(self.model, device) if graphed else None

    def embed_input_ids(self, input_ids):
        inputs_embeds = self.model.get_input_embeddings()(input_ids)
        if self.embed_scale is not None:
            inputs_embeds *= self.embed_scale
        return inputs_embeds

    def forward(self, input_ids, positions, inputs_embeds=None):
        input_ids, positions = input_ids[None, ...], positions[None, ...]
        # If the model scales embeddings inside the input embedding layer we must
        # ensure they are scaled here since VocabParallelEmbedding will not do it
        if self.embed_scale is not None and input_ids is not None and inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
            input_ids = None
        decoder = self.compiled if self.compiled is not None else self.model.forward
        outputs = decoder(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=positions)
        return outputs[0][0, ...]

    def compute_logits(self, hidden_states):
        return hidden_states @ self.model.embed_weight.T


class GPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.graphed = device, graphed
        self.model = TransformersForCausalLM(device, variant, graphed)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)

    def _dummy_run(self, num_tokens, mode):
        ForwardContext.mode, ForwardContext.num_tokens, ForwardContext.padded = mode, num_tokens, {}
        self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens])
        ForwardContext.mode = "NONE"

    def capture_model(self):
        events.static_buffers("GPUModelRunner (piecewise graphs)",
                              {"input_ids": self.input_ids, "positions": self.positions})
        with graph_capture(self.device):
            for size in reversed(CAPTURE_SIZES):
                for _ in range(NUM_WARMUPS):
                    with events.warmup():
                        self._dummy_run(size, "NONE")
                self._dummy_run(size, "PIECEWISE")

    def execute_model(self, tokens, positions):
        n = len(tokens)
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        self.input_ids[:n].copy_(t(tokens))
        self.positions[:n].copy_(t(positions))
        if not self.graphed:
            hidden_states = self.model.forward(self.input_ids[:n], self.positions[:n])
            return self.model.compute_logits(hidden_states).clone()
        size = pad_for_cudagraph(n)
        ForwardContext.mode, ForwardContext.num_tokens = "PIECEWISE", n
        ForwardContext.padded = {"input_ids": self.input_ids, "positions": self.positions}
        hidden_states = self.model.forward(self.input_ids[:size], self.positions[:size])
        ForwardContext.mode = "NONE"
        return self.model.compute_logits(hidden_states[:n]).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(4801)
    steps = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), list(range(p, p + n)))
             for n, p in ((3, 0), (4, 3), (2, 7), (4, 9))]

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, graphed)
        if graphed:
            runner.capture_model()
        return [runner.execute_model(tokens, positions) for tokens, positions in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
