"""Gemma3n KV-sharing fast prefill under piecewise CUDA graphs: the self-decoder's output is the weak-referenced
output of its compilation unit's last graph, and the cross-decoder's graph (same pool) overwrites it on replay.

Upstream: https://github.com/vllm-project/vllm/pull/22628 ("[V1] Enable prefill optimization for Gemma3n",
vllm-project/vllm, merged). It shipped ``Gemma3nTextModel.fast_prefill_forward`` with the workaround
``hidden_states = self_decoder_hidden_states.clone()`` and the note "There is currently a bug caused by vLLM
converting output of last piecewise CUDA graph to weakref, causing memory to be prematurely freed when there are
multiple compilation units. Keep .clone() until fix in #22282". Read: the PR description (its follow-up list names
"incorrect weakref with multiple compile units (#22282)" and the ``self_decoder_hidden_state.clone()``), a stored
``vllm/model_executor/models/gemma3n.py`` containing ``fast_prefill_forward`` with that note and clone, and the
description of https://github.com/vllm-project/vllm/pull/22282 (closed, not merged), which explains the mechanism.
Not read: #22628's diff hunks, vLLM's ``CUDAGraphWrapper`` source at that commit.
Symptom: with ``--kv-sharing-fast-prefill`` and piecewise CUDA graphs, Gemma3n's returned hidden states for the
prompt tokens that produce no logits are not the self-decoder's: they hold whatever the cross-decoder's graph left in
that memory. Eager mode (and the clone) give the self-decoder states.
Mechanism: Gemma3n is compiled as two units (``set_model_tag("self_decoder")`` / ``"cross_decoder"``). Each unit's
piecewise backend marks its last graph ``is_last_graph`` and hands its output out through ``weak_ref_tensors``: the
backend assumes no other CUDA graph will use that output, so the caching allocator treats the block as free. Both
units capture into the one global graph pool, self-decoder first; the cross-decoder capture that follows at the
same size is given the freed block for its first allocation of that size. At runtime
``fast_prefill_forward`` replays the self-decoder (output = the weak view), gathers the logits rows into its static
``self.hidden_states`` buffer, replays the cross-decoder (which writes its first intermediate into that very block),
and only then uses ``self_decoder_hidden_states`` as the base into which the cross-decoder rows are scattered.
Doctor: overwritten-output, at fast_prefill_forward. The self-decoder graph's handed-out output is read (as the merge
base) after a replay of the cross-decoder graph overwrote its memory.
Fix (upstream): ``hidden_states = self_decoder_hidden_states.clone()`` before the cross-decoder runs.
Modelled: ``Gemma3nSelfDecoder`` (embedding + one layer + output projection) and ``Gemma3nCrossDecoder`` (two
layers), each wrapped in a ``CUDAGraphWrapper`` that captures one graph per size into the shared pool and, as the
last graph of its unit, keeps only ``weak_ref_tensors(output)`` (a tensor on the memory that does not own it); the
``Gemma3nTextModel`` static buffers ``positions`` / ``hidden_states``; a ``GPUModelRunner`` with static ``input_ids``
/ ``positions``, padding to capture sizes [4, 8], and the fast-prefill ``logits_indices_padded`` buffer padded to a
capture size (leftover slots hold the last index). altup and per-layer inputs are left out; a final RMS norm stays.
Workload: capture sizes 8 then 4 (self-decoder then cross-decoder each). Step 1: a 3-token prefill plus 4 decodes
(7 tokens -> graph 8; 5 logits -> cross graph 8): the cross-decoder replay overwrites the self-decoder output (here
its output lands in that block too), so the returned states of the prefill's two non-logit prompt tokens hold
cross-decoder values, and the merge, now a copy inside one block, shifts logits rows 4-6 onto each other (max error
2.86). Step 2: a 5-token prefill plus 2 decodes (7 -> 8; 3 logits -> cross graph 4): the size-4 cross graph uses
other blocks and every row is right.
"""
from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/22628"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "fast_prefill_forward"
SYMPTOM = ("Gemma3n kv-sharing fast prefill with piecewise CUDA graphs: the self-decoder output is the weak-ref'd "
           "last-graph output of its compilation unit; the cross-decoder graph captured later in the same pool "
           "reuses that block and overwrites it, so the merged hidden states of non-logit prompt tokens are wrong")

VOCAB, EMBED, HIDDEN, FF = 16, 6, 8, 12
MAX_NUM_TOKENS = 8
CUDAGRAPH_CAPTURE_SIZES = [4, 8]

_variant = "bug"


# --- vllm/utils/torch_utils.py -------------------------------------------------------------------------------

def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory that does not own it (vLLM's ``weak_ref_tensor``, a from_blob without deleter)."""
    if t.device.type == "cuda":
        iface = type("_CudaArray", (), {})()
        iface.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": "<f4", "version": 2, "data": (t.data_ptr(), False),
            "strides": tuple(s * t.element_size() for s in t.stride())}
        return torch.as_tensor(iface, device=t.device)
    assert t.dtype == torch.float32 and t.is_contiguous()
    buf = (ctypes.c_float * t.numel()).from_address(t.data_ptr())
    return torch.from_numpy(np.ctypeslib.as_array(buf).reshape(tuple(t.shape)))


# --- vllm/compilation/cuda_graph.py (one piecewise graph per compilation unit and size) ------------------------

@dataclasses.dataclass
class CUDAGraphEntry:
    num_tokens: int
    cudagraph: object = None
    output: torch.Tensor | None = None


class CUDAGraphWrapper:
    def __init__(self, runnable, name, graph_pool, device, is_last_graph=True):
        self.runnable, self.name, self.graph_pool, self.device = runnable, name, graph_pool, device
        self.is_last_graph = is_last_graph
        self.concrete_cudagraph_entries: dict[int, CUDAGraphEntry] = {}
        self.enabled = graph_pool is not None

    def __call__(self, *args):
        if not self.enabled:
            return self.runnable(*args)
        num_tokens = args[0].shape[0]
        entry = self.concrete_cudagraph_entries.get(num_tokens)
        if entry is None:
            entry = self.concrete_cudagraph_entries[num_tokens] = CUDAGraphEntry(num_tokens)
            g, output = capture(lambda: self.runnable(*args), device=self.device, pool=self.graph_pool,
                                name=f"{self.name} [{num_tokens}]", owner=f"CUDAGraphWrapper({self.name})",
                                static={f"{self.name}.arg{i}": a for i, a in enumerate(args)})
            if self.is_last_graph:
                # the output of the last graph is not used by another cuda graph: hand out a weak ref
                output = weak_ref_tensor(output)
            entry.cudagraph, entry.output = g, output
            return output
        return replay(entry.cudagraph, entry.output)


# --- vllm/model_executor/models/gemma3n.py ---------------------------------------------------------------------

def _rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Gemma3nSelfDecoder:
    def __init__(self, w):
        self.w = w

    def __call__(self, input_ids, positions):
        w = self.w
        x = w["embed_tokens"][input_ids] + w["embed_positions"][positions]          # [n, EMBED]
        x = torch.tanh(x @ w["up"])                                                  # [n, FF]
        return x @ w["down"]                                                         # [n, HIDDEN]: the output


class Gemma3nCrossDecoder:
    def __init__(self, w):
        self.w = w

    def __call__(self, positions, hidden_states):
        w = self.w
        h = hidden_states @ w["attn"]                                                # first [n, HIDDEN] block
        h = hidden_states + torch.tanh(h + w["pos"][positions])
        return h + torch.tanh(h @ w["mlp"])


class Gemma3nTextModel:
    def __init__(self, weights, graph_pool, device):
        self.self_decoder = CUDAGraphWrapper(Gemma3nSelfDecoder(weights["self"]), "self_decoder", graph_pool, device)
        self.cross_decoder = CUDAGraphWrapper(Gemma3nCrossDecoder(weights["cross"]), "cross_decoder", graph_pool,
                                              device)
        self.norm_weight = weights["norm"]
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)

    def fast_prefill_forward(self, input_ids, positions, logits_indices_padded=None, num_logits_indices=None):
        batch_size = positions.size(0)
        self.positions[:batch_size].copy_(positions)
        self_decoder_hidden_states = self.self_decoder(input_ids, self.positions[:batch_size])
        if logits_indices_padded is None:
            logits_indices_padded = torch.arange(batch_size, dtype=positions.dtype, device=positions.device)
        if _variant == "fix":       # upstream: keep the self-decoder output out of the graph pool
            hidden_states = self_decoder_hidden_states.clone()
        else:
            hidden_states = self_decoder_hidden_states
        num_padded_logits_indices = logits_indices_padded.size(0)
        self.positions[:num_padded_logits_indices].copy_(positions[logits_indices_padded])
        self.hidden_states[:num_padded_logits_indices].copy_(self_decoder_hidden_states[logits_indices_padded])
        cross_decoder_hidden_states = self.cross_decoder(self.positions[:num_padded_logits_indices],
                                                         self.hidden_states[:num_padded_logits_indices])
        if num_logits_indices is not None:
            hidden_states[logits_indices_padded[:num_logits_indices]] = (
                cross_decoder_hidden_states[:num_logits_indices])
        else:
            hidden_states = cross_decoder_hidden_states
        return _rms_norm(hidden_states, self.norm_weight)


# --- vllm/v1/worker/gpu_model_runner.py ------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, weights, device, use_cudagraph):
        self.device = device
        self.graph_pool = graph_pool_handle(device) if use_cudagraph else None
        self.cudagraph_batch_sizes = sorted(CUDAGRAPH_CAPTURE_SIZES) if use_cudagraph else []
        self.model = Gemma3nTextModel(weights, self.graph_pool, device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.logits_indices_buf = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)

    def dispatch(self, num_tokens):
        return next((s for s in self.cudagraph_batch_sizes if s >= num_tokens), num_tokens)

    def capture_model(self):
        for num_tokens in sorted(self.cudagraph_batch_sizes, reverse=True):
            self.input_ids[:num_tokens].zero_()
            self.positions[:num_tokens].copy_(torch.arange(num_tokens, device=self.device))
            # dummy run: attn_metadata is None, no fast-prefill metadata
            self.model.fast_prefill_forward(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def execute_model(self, token_ids, positions, logits_indices):
        num_tokens = len(token_ids)
        num_input_tokens = self.dispatch(num_tokens)
        self.input_ids[:num_tokens].copy_(torch.tensor(token_ids, device=self.device))
        self.positions[:num_tokens].copy_(torch.tensor(positions, device=self.device))
        # FastPrefillHelper.prepare: pad the logits indices to a captured size, leftovers = last index
        logits_indices = torch.tensor(logits_indices, dtype=torch.int64, device=self.device)
        num_logits = logits_indices.shape[0]
        buf = self.logits_indices_buf
        buf[:num_logits].copy_(logits_indices)
        buf[num_logits:] = logits_indices[-1]
        logits_indices_padded = buf[:min(self.dispatch(num_logits), MAX_NUM_TOKENS)]
        hidden_states = self.model.fast_prefill_forward(
            self.input_ids[:num_input_tokens], self.positions[:num_input_tokens], logits_indices_padded, num_logits)
        return hidden_states[:num_tokens].clone()


# --- the workload ----------------------------------------------------------------------------------------------

def _weights(device):
    gen = generator(22628)
    r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
    return {"self": {"embed_tokens": r(VOCAB, EMBED, scale=1.0), "embed_positions": r(MAX_NUM_TOKENS, EMBED),
                     "up": r(EMBED, FF), "down": r(FF, HIDDEN)},
            "cross": {"attn": r(HIDDEN, HIDDEN), "pos": r(MAX_NUM_TOKENS, HIDDEN), "mlp": r(HIDDEN, HIDDEN)},
            "norm": 1 + r(HIDDEN, scale=0.1)}


# (token_ids, positions, logits_indices) per step: one prefill request first, then decodes
STEPS = [
    ([3, 7, 1, 9, 4, 12, 5], [0, 1, 2, 6, 4, 3, 5], [2, 3, 4, 5, 6]),     # 3-token prefill + 4 decodes
    ([2, 8, 6, 11, 3, 14, 10], [0, 1, 2, 3, 4, 7, 2], [4, 5, 6]),         # 5-token prefill + 2 decodes
]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def eager():
        runner = GPUModelRunner(_weights(device), device, use_cudagraph=False)
        return [runner.execute_model(*step) for step in STEPS]

    def served():
        runner = GPUModelRunner(_weights(device), device, use_cudagraph=True)
        runner.capture_model()
        return [runner.execute_model(*step) for step in STEPS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
