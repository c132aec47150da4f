"""FastDeploy SOT + CUDAGraph: the embedding's ``ids_remove_padding.shape[0] == 0`` guard copies host data inside capture.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/5495 ("[Graph Optimization][BugFix][CI] Fix 0size bug &&
add unitest", merged 2025-12-10). Read: the PR description (motivation, the offending lines
``fastdeploy/model_executor/layers/embeddings.py#L302-L303`` introduced by #5078, the replacement snippet
``if forward_meta is not None and forward_meta.is_zero_size: return paddle.empty([0, self.embedding_dim], ...)``,
and "add ``is_zero_size`` to ``ForwardMeta``"). Not read: the diff itself, #5078's diff, the unit tests; the
``CudaGraphPiecewiseBackend.__call__`` structure (real shape -> ``real_shape_to_captured_size`` -> entry -> warm up,
capture, replay) is taken from FastDeploy's ``cudagraph_piecewise_backend.py`` as stored in the code index.
Symptom: after #5078 every SOT + CUDAGraph deployment (``graph_opt_level`` >= 1, ``use_cudagraph: true``) failed to
start: the decode graph capture dies; SOT alone (no CUDA graph) and dynamic mode run fine.
Mechanism: #5078 added a zero-size early return to ``VocabParallelEmbedding.forward``: ``if
ids_remove_padding.shape[0] == 0: return paddle.empty([0, embedding_dim])`` (EP ranks can receive no tokens). Under
SOT the token axis is a dynamic (symbolic) dim, so ``shape[0] == 0`` is not a Python int comparison: the translated
program materialises the shape and compares it on the device, which the PR says "introduces a ``memcpy_h2d``
operation", then branches on the result on the host. ``GPUModelRunner.capture_model`` -> ``_dummy_run`` ->
``CudaGraphPiecewiseBackend.__call__`` captures the whole model forward, embedding included, so that host-to-device
copy (and the host read of the comparison) lands inside the capture, which CUDA refuses.
Doctor: sync-in-capture, at forward (``VocabParallelEmbedding.forward``: the guard needs a host<->device transfer while
the decode graph is being captured; nothing about replay is involved, the capture itself cannot be made).
Fix (upstream): ``ForwardMeta`` gets ``is_zero_size`` (a host bool the runner sets outside the model) and the embedding
tests ``forward_meta is not None and forward_meta.is_zero_size`` instead of the tensor's dynamic dim.
Modelled: a 2-layer ERNIE-like decoder (token + position embedding, tanh MLP blocks, final norm, lm head), decode only
(one token per running request). ``share_inputs`` holds the static ``ids_remove_padding`` / ``positions`` buffers
(padded rows zeroed: "keep the buffer clean"); the backend captures sizes [4, 2, 1] through ``kit.capture`` with one
warm-up and replays through ``kit.replay``. ``_sot_dynamic_dim`` stands in for SOT's lowering of a dynamic
``shape[axis]``: the dim becomes a tensor copied to the device (Python data -> device memory) before the comparison.
Paddle and SOT themselves, attention and the KV cache are not modelled. The eager reference is the same SOT model
with ``use_cudagraph`` off (the zero-size guard runs, as in upstream's non-graph mode).
Workload: three requests decode six steps (batch 3 -> padded to 4, then 2, then 1 as requests finish). Bug: the
first capture (size 4) raises ``CaptureError`` at the embedding guard, so the server never starts. Fix: the capture
records the plain lookup and every step equals eager.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/5495"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = ("SOT + CUDAGraph startup fails: VocabParallelEmbedding's `ids_remove_padding.shape[0] == 0` guard is lowered "
           "to a host->device copy plus a host branch inside the decode graph capture; CUDA refuses it")

VOCAB, HIDDEN, NUM_LAYERS, MAX_POS = 16, 8, 2, 32
MAX_NUM_SEQS = 4
CUDAGRAPH_CAPTURE_SIZES = [4, 2, 1]          # GraphOptimizationConfig.cudagraph_capture_sizes (descending)
CUDAGRAPH_NUM_OF_WARMUPS = 1

_variant = "bug"


def _sot_dynamic_dim(x: torch.Tensor, axis: int) -> torch.Tensor:
    """SOT's view of ``x.shape[axis]`` for a dynamic dim: a shape tensor that the comparison consumes on the device
    (the ``memcpy_h2d`` the PR names)."""
    return torch.tensor(x.shape[axis], dtype=torch.int64, device=x.device)


# --- fastdeploy/model_executor/forward_meta.py (reduced) ---------------------------------------------------------

@dataclass
class ForwardMeta:
    ids_remove_padding: torch.Tensor
    positions: torch.Tensor
    is_zero_size: bool = False          # added by the fix; the runner sets it outside the model


# --- fastdeploy/model_executor/layers/embeddings.py (reduced) ----------------------------------------------------

class VocabParallelEmbedding:
    def __init__(self, weight):
        self.embeddings_weight = weight
        self.embedding_dim = weight.shape[1]

    def forward(self, ids_remove_padding, forward_meta=None):
        if _variant == "bug":
            if _sot_dynamic_dim(ids_remove_padding, 0) == 0:             # #5078: shape[0] == 0 under SOT
                return torch.empty(0, self.embedding_dim, device=ids_remove_padding.device)
        elif forward_meta is not None and forward_meta.is_zero_size:    # #5495
            return torch.empty(0, self.embedding_dim, device=ids_remove_padding.device)
        return self.embeddings_weight[ids_remove_padding]


# --- fastdeploy/model_executor/models/ernie4_5_moe.py (reduced) ---------------------------------------------------

class Ernie4_5_Model:
    def __init__(self, device):
        gen = generator(5495)
        self.embed_tokens = VocabParallelEmbedding(randn(VOCAB, HIDDEN, gen=gen, device=device))
        self.embed_positions = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.3)
        self.layers = [(randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.5),
                        randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def forward(self, ids_remove_padding, forward_meta):
        hidden_states = self.embed_tokens.forward(ids_remove_padding, forward_meta)
        hidden_states = hidden_states + self.embed_positions[forward_meta.positions]
        for w_up, w_down in self.layers:
            hidden_states = hidden_states + torch.tanh(hidden_states @ w_up) @ w_down
        return hidden_states / hidden_states.norm(dim=-1, keepdim=True).clamp(min=1e-6)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py (reduced) -------------------------

class ConcreteSizeEntry:
    def __init__(self, real_shape):
        self.real_shape = real_shape
        self.cuda_graph = None
        self.output_buffer = None


class CudaGraphPiecewiseBackend:
    def __init__(self, runnable, device, share_inputs):
        self.runnable, self.device, self.share_inputs = runnable, device, share_inputs
        self.real_shape_to_captured_size = {}
        for end, start in zip(CUDAGRAPH_CAPTURE_SIZES, CUDAGRAPH_CAPTURE_SIZES[1:] + [0]):
            for bs in range(start, end):
                self.real_shape_to_captured_size[bs] = start if bs == start else end
        self.real_shape_to_captured_size[CUDAGRAPH_CAPTURE_SIZES[0]] = CUDAGRAPH_CAPTURE_SIZES[0]
        self.concrete_size_entries = {s: ConcreteSizeEntry(s) for s in CUDAGRAPH_CAPTURE_SIZES}
        self.pool = graph_pool_handle(device)

    def __call__(self, **kwargs):
        real_shape = kwargs["forward_meta"].ids_remove_padding.shape[0]
        padding_real_shape = self.real_shape_to_captured_size[real_shape]
        entry = self.concrete_size_entries.get(padding_real_shape)
        assert entry is not None, f"real shape:{padding_real_shape} is not in cuda graph capture list."
        if entry.cuda_graph is None:                      # capture (the dummy run gives exactly this size)
            entry.cuda_graph, entry.output_buffer = capture(
                lambda: self.runnable(**kwargs), device=self.device, pool=self.pool,
                warmups=CUDAGRAPH_NUM_OF_WARMUPS, name=f"real shape {padding_real_shape}",
                owner="CudaGraphPiecewiseBackend",
                static={k: v for k, v in self.share_inputs.items()})
            return entry.output_buffer
        return replay(entry.cuda_graph, entry.output_buffer, real=real_shape, size=padding_real_shape)


# --- fastdeploy/worker/gpu_model_runner.py (reduced) ------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cudagraph):
        self.device, self.use_cudagraph = device, use_cudagraph
        self.share_inputs = {
            "ids_remove_padding": torch.zeros(MAX_NUM_SEQS, dtype=torch.int64, device=device),
            "positions": torch.zeros(MAX_NUM_SEQS, dtype=torch.int64, device=device),
        }
        self.model = Ernie4_5_Model(device)
        self.model_forward = (CudaGraphPiecewiseBackend(self.model.forward, device, self.share_inputs)
                              if use_cudagraph else self.model.forward)
        if use_cudagraph:
            self.capture_model()

    def initialize_forward_meta(self, num_tokens):
        ids_remove_padding = self.share_inputs["ids_remove_padding"][:num_tokens]
        self.forward_meta = ForwardMeta(ids_remove_padding=ids_remove_padding,
                                        positions=self.share_inputs["positions"][:num_tokens])
        if _variant == "fix":
            self.forward_meta.is_zero_size = ids_remove_padding.shape[0] == 0

    def _dummy_run(self, batch_size):
        self.share_inputs["ids_remove_padding"][:batch_size] = 5
        self.share_inputs["positions"][:batch_size] = 0
        self.initialize_forward_meta(batch_size)
        return self.model_forward(ids_remove_padding=self.forward_meta.ids_remove_padding,
                                  forward_meta=self.forward_meta)

    def capture_model(self):
        for batch_size in CUDAGRAPH_CAPTURE_SIZES:
            self._dummy_run(batch_size)

    def execute_model(self, token_ids, positions):
        num_tokens = len(token_ids)
        ids_buf, pos_buf = self.share_inputs["ids_remove_padding"], self.share_inputs["positions"]
        ids_buf.zero_()                                   # padding_cudagraph_inputs: keep the buffers clean
        pos_buf.zero_()
        ids_buf[:num_tokens] = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos_buf[:num_tokens] = torch.tensor(positions, dtype=torch.int64, device=self.device)
        self.initialize_forward_meta(num_tokens)
        hidden_states = self.model_forward(ids_remove_padding=self.forward_meta.ids_remove_padding,
                                           forward_meta=self.forward_meta)
        return self.model.compute_logits(hidden_states[:num_tokens])


# --- the workload -------------------------------------------------------------------------------------------

LAST_PROMPT_TOKEN = {"a": 3, "b": 7, "c": 11}
PROMPT_LEN = {"a": 5, "b": 3, "c": 6}
DECODE_STEPS = {"a": 6, "b": 3, "c": 1}          # batches of 3, 2, 2, 1, 1, 1 tokens


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cudagraph: bool):
        runner = GPUModelRunner(device, use_cudagraph)
        last = dict(LAST_PROMPT_TOKEN)
        pos = dict(PROMPT_LEN)
        done = {k: 0 for k in last}
        outs, tokens = [], {k: [] for k in last}
        while any(done[k] < DECODE_STEPS[k] for k in last):
            live = [k for k in last if done[k] < DECODE_STEPS[k]]
            logits = runner.execute_model([last[k] for k in live], [pos[k] for k in live]).clone()
            outs.append(logits)
            for row, k in enumerate(live):
                last[k] = int(logits[row].argmax())
                tokens[k].append(last[k])
                pos[k] += 1
                done[k] += 1
        return outs + [torch.tensor(tokens[k], dtype=torch.float64) for k in sorted(tokens)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
