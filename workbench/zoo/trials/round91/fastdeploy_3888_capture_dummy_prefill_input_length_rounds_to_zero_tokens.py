"""FastDeploy CUDAGraph capture: the dummy prefill length ``int(num_tokens // batch_size * kv_cache_ratio)`` is 0 at a large capture size.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/3888 ("[Cherry-Pick][Bug Fix]fix the bug for real size 0 in
cudagraph", merged 2025-09-04; cherry-pick of #3879, whose page was not read). Read: the PR description (problem,
cause, solution, with a figure not viewable here). Not read: the diff. The pre-fix ``GPUModelRunner._dummy_prefill_inputs``
(``full_length = min(num_tokens // batch_size, max_model_len - max_dec_len)``; ``input_length = int(full_length *
kv_cache_ratio)``) and ``CudaGraphPiecewiseBackend.__call__`` (``real_shape_to_captured_size`` lookup, then ``assert entry
is not None, f"real shape:{padding_real_shape} is not in cuda graph capture list."``) were read in FastDeploy files of
that period stored in the code index.
Symptom: a PD-disaggregated decode (D) node with CUDAGraph on dies at startup with ``real shape:0 is not in cuda graph
capture list``; the same node without CUDAGraph starts and serves.
Mechanism: ``capture_model`` calls ``_dummy_run(num_tokens=max_num_batched_tokens, batch_size=capture_size,
in_capturing=True)`` for every capture size, largest first. ``_dummy_prefill_inputs`` gives each dummy request
``input_length = int(num_tokens // batch_size * kv_cache_ratio)`` prompt tokens; the PR: capturing with batch_size 256
on the D node made this length 0 (any budget under 512 tokens: ``// 256`` gives 0 or 1, and ``* 0.75`` truncates 1 to
0). Every dummy request then has
``seq_lens_this_time = seq_lens_encoder = 0``: no prefill exists, so the step is treated as decode-only and sent through
the graph backend with ``ids_remove_padding`` of 0 tokens; real shape 0 maps to 0, which is no capture size, and the
capture aborts. The graph for that size would have been captured from a zero-token input.
Doctor: undersized-buffer, at _dummy_prefill_inputs (the capture-time input the graph is built from is zero-sized: the
dummy batch meant to fill a ``batch_size``-row graph carries no token at all; the fix goes where that length is chosen).
Fix (upstream): "round up when computing input_length so it is never 0, and drop the multiplication by
kv_cache_ratio" (the PR also renames a clashing cache-messager signal file, not modelled). Modelled as
``full_length = min(ceil(num_tokens / batch_size), max_model_len - max_dec_len)``; ``input_length = full_length``.
Modelled: a 2-layer decoder over (token, position) only (no attention or KV cache: prefill just yields the first
token from the last prompt token), ``share_inputs`` buffers (``input_ids`` per request, ``seq_lens_this_time`` /
``seq_lens_encoder`` / ``seq_lens_decoder``, the flat static ``ids_remove_padding`` / ``positions`` the graphs read);
``_prepare_inputs`` stands in for ``get_padding_offset``; ``step_use_cudagraph`` = CUDAGraph on and no prefill in the
batch. Capture sizes [4, 2, 1] and a token budget of 4 stand in for 256 requests and the D node's budget;
``kv_cache_ratio`` 0.75; the dummy run does its prefill (eager) and one captured decode step. The profile run and the
PD/cache-messager machinery are not modelled.
Workload: start the runner (captures), then serve three prompts: one mixed prefill step, then decode steps of 3
(padded to 4), 2 and 1 requests. Bug: capture size 4 gets 4 // 4 * 0.75 -> 0 tokens per request and startup raises
AssertionError ``real shape:0 is not in cuda graph capture list.``. Fix: 1 token each, every graph is captured, and the
served tokens and logits equal the eager run's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/3888"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_dummy_prefill_inputs"
SYMPTOM = ("D node with CUDAGraph: at the largest capture size the dummy prefill length int(num_tokens // bs * 0.75) is 0, "
           "the capture step has zero tokens and startup fails with 'real shape:0 is not in cuda graph capture list'")

VOCAB, HIDDEN, NUM_LAYERS = 16, 8, 2
MAX_NUM_SEQS, MAX_MODEL_LEN = 4, 16
MAX_NUM_BATCHED_TOKENS = 4                  # the D node's token budget (stands in for 256 requests' worth)
KV_CACHE_RATIO = 0.75
CUDAGRAPH_CAPTURE_SIZES = [4, 2, 1]

_variant = "bug"


@dataclass
class ForwardMeta:
    ids_remove_padding: torch.Tensor
    positions: torch.Tensor
    step_use_cudagraph: bool


class Ernie4_5_ForCausalLM:
    def __init__(self, device):
        gen = generator(3888)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embed_positions = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.3)
        self.layers = [(randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.5),
                        randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def forward(self, ids_remove_padding, forward_meta):
        h = self.embed_tokens[ids_remove_padding] + self.embed_positions[forward_meta.positions]
        for w_up, w_down in self.layers:
            h = h + torch.tanh(h @ w_up) @ w_down
        return h / h.norm(dim=-1, keepdim=True).clamp(min=1e-6)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py (reduced) -------------------------

class ConcreteSizeEntry:
    def __init__(self, real_shape):
        self.real_shape, self.cuda_graph, self.output_buffer = real_shape, None, None


class CudaGraphPiecewiseBackend:
    def __init__(self, runnable, device, static_inputs):
        self.runnable, self.device, self.static_inputs = runnable, device, static_inputs
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
        if entry.cuda_graph is None:
            entry.cuda_graph, entry.output_buffer = capture(
                lambda: self.runnable(**kwargs), device=self.device, pool=self.pool, warmups=1,
                name=f"real shape {padding_real_shape}", owner="CudaGraphPiecewiseBackend", static=self.static_inputs)
            return entry.output_buffer
        return replay(entry.cuda_graph, entry.output_buffer, real=real_shape, size=padding_real_shape)


# --- fastdeploy/worker/gpu_model_runner.py (reduced) ------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cudagraph):
        self.device, self.use_cudagraph = device, use_cudagraph
        i64 = dict(dtype=torch.int64, device=device)
        self.share_inputs = {
            "input_ids": torch.zeros(MAX_NUM_SEQS, MAX_MODEL_LEN, **i64),
            "seq_lens_this_time": torch.zeros(MAX_NUM_SEQS, **i64),
            "seq_lens_encoder": torch.zeros(MAX_NUM_SEQS, **i64),
            "seq_lens_decoder": torch.zeros(MAX_NUM_SEQS, **i64),
            "ids_remove_padding": torch.zeros(MAX_NUM_SEQS * MAX_MODEL_LEN, **i64),
            "positions": torch.zeros(MAX_NUM_SEQS * MAX_MODEL_LEN, **i64),
        }
        self.model = Ernie4_5_ForCausalLM(device)
        static = {k: self.share_inputs[k] for k in ("ids_remove_padding", "positions")}
        self.graph_backend = CudaGraphPiecewiseBackend(self.model.forward, device, static) if use_cudagraph else None
        if use_cudagraph:
            self.capture_model()

    def _dummy_prefill_inputs(self, num_tokens, batch_size, expected_decode_len):
        max_dec_len = expected_decode_len + 1
        if _variant == "bug":
            full_length = min(num_tokens // batch_size, MAX_MODEL_LEN - max_dec_len)
            input_length = int(full_length * KV_CACHE_RATIO)
        else:   # round up so input_length is never 0; no kv_cache_ratio
            full_length = min((num_tokens + batch_size - 1) // batch_size, MAX_MODEL_LEN - max_dec_len)
            input_length = int(full_length)
        for idx in range(batch_size):
            self.share_inputs["input_ids"][idx:idx + 1, :input_length] = 5
            self.share_inputs["seq_lens_this_time"][idx:idx + 1] = input_length
            self.share_inputs["seq_lens_encoder"][idx:idx + 1] = input_length
            self.share_inputs["seq_lens_decoder"][idx:idx + 1] = 0

    def _prepare_inputs(self):
        """get_padding_offset + forward meta: pack the live tokens into the static ``ids_remove_padding``."""
        this_time = self.share_inputs["seq_lens_this_time"].tolist()
        decoder = self.share_inputs["seq_lens_decoder"].tolist()
        ids, pos, last_rows = [], [], []
        for i, n in enumerate(this_time):
            ids += self.share_inputs["input_ids"][i, :n].tolist()
            pos += list(range(decoder[i], decoder[i] + n))
            last_rows.append(len(ids) - 1 if n else -1)
        num_tokens = len(ids)
        self.share_inputs["ids_remove_padding"].zero_()           # keep the buffers clean for padded replays
        self.share_inputs["positions"].zero_()
        if num_tokens:
            self.share_inputs["ids_remove_padding"][:num_tokens] = torch.tensor(ids, device=self.device)
            self.share_inputs["positions"][:num_tokens] = torch.tensor(pos, device=self.device)
        exist_prefill = int(self.share_inputs["seq_lens_encoder"].max()) > 0
        self.forward_meta = ForwardMeta(ids_remove_padding=self.share_inputs["ids_remove_padding"][:num_tokens],
                                        positions=self.share_inputs["positions"][:num_tokens],
                                        step_use_cudagraph=self.use_cudagraph and not exist_prefill)
        return last_rows

    def _forward_and_update(self):
        last_rows = self._prepare_inputs()
        if self.forward_meta.step_use_cudagraph:
            hidden = self.graph_backend(ids_remove_padding=self.forward_meta.ids_remove_padding,
                                        forward_meta=self.forward_meta)
        else:
            hidden = self.model.forward(self.forward_meta.ids_remove_padding, self.forward_meta)
        live = [i for i, r in enumerate(last_rows) if r >= 0]
        logits = self.model.compute_logits(hidden[[last_rows[i] for i in live]]).clone()
        for row, i in enumerate(live):                            # post_process: greedy, then next step's inputs
            self.share_inputs["seq_lens_decoder"][i] += self.share_inputs["seq_lens_this_time"][i]
            self.share_inputs["seq_lens_encoder"][i] = 0
            self.share_inputs["seq_lens_this_time"][i] = 1
            self.share_inputs["input_ids"][i, 0] = int(logits[row].argmax())
        return logits, live

    def _dummy_run(self, num_tokens, batch_size, expected_decode_len=1):
        self._dummy_prefill_inputs(num_tokens, batch_size, expected_decode_len)
        for _ in range(expected_decode_len + 1):                  # the prefill step, then the captured decode step
            self._forward_and_update()
        for value in self.share_inputs.values():                  # clear the dummy requests
            value.zero_()

    def capture_model(self):
        for batch_size in CUDAGRAPH_CAPTURE_SIZES:                # largest first
            self._dummy_run(num_tokens=MAX_NUM_BATCHED_TOKENS, batch_size=batch_size)

    def insert_prefill_inputs(self, slot, prompt):
        self.share_inputs["input_ids"][slot, :len(prompt)] = torch.tensor(prompt, device=self.device)
        self.share_inputs["seq_lens_this_time"][slot] = len(prompt)
        self.share_inputs["seq_lens_encoder"][slot] = len(prompt)
        self.share_inputs["seq_lens_decoder"][slot] = 0

    def finish(self, slot):
        for key in ("seq_lens_this_time", "seq_lens_encoder", "seq_lens_decoder"):
            self.share_inputs[key][slot] = 0


PROMPTS = [[3, 9, 4], [7, 1], [12, 6, 2, 8]]
DECODE_STEPS = [3, 2, 1]                  # decode batches of 3 (padded to 4), 2, 1


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cudagraph: bool):
        runner = GPUModelRunner(device, use_cudagraph)
        for slot, prompt in enumerate(PROMPTS):
            runner.insert_prefill_inputs(slot, prompt)
        outs, tokens, done = [], [[] for _ in PROMPTS], [0] * len(PROMPTS)
        logits, live = runner._forward_and_update()               # mixed prefill (eager)
        outs.append(logits)
        for row, slot in enumerate(live):
            tokens[slot].append(int(logits[row].argmax()))
        while True:
            for slot in range(len(PROMPTS)):
                if done[slot] >= DECODE_STEPS[slot]:
                    runner.finish(slot)
            if all(d >= s for d, s in zip(done, DECODE_STEPS)):
                break
            logits, live = runner._forward_and_update()
            outs.append(logits)
            for row, slot in enumerate(live):
                tokens[slot].append(int(logits[row].argmax()))
                done[slot] += 1
        return outs + [torch.tensor(t, dtype=torch.float64) for t in tokens]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
