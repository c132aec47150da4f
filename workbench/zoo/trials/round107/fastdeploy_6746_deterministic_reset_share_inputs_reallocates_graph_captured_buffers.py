"""FastDeploy with ``FD_DETERMINISTIC_MODE=1`` and CUDA graphs: after the warm-up has captured the decode graphs, the
deterministic post-warmup path calls ``InputBatch.reset_share_inputs``, which re-creates some share-input tensors
(``rope_emb`` among them) instead of refilling them, so the captured graphs keep reading the released old buffers.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/6746 ("[BugFix][Graph Optimization] Fix deterministic mode +
CUDAGraph garbled output by making reset_share_inputs CUDAGraph-safe", PaddlePaddle/FastDeploy, by gongweibao, opened
2026-03-09; still open when read, so no merge commit).
Read: the PR description (root cause: ``reset_share_inputs()`` runs after CUDAGraph capture in the deterministic-mode
post-warmup path of ``gpu_worker.py``; several of its lines create new tensor objects (``paddle.to_tensor`` /
``paddle.full``) with new GPU addresses while the graphs baked the old ones; fix: for ``reasoning_allowed_tokens``,
``free_list``, ``free_list_len`` and ``rope_emb``, under an ``FD_DETERMINISTIC_MODE`` guard, in-place ``fill_`` /
``copy_`` instead; non-deterministic mode unchanged; ``gpu_worker.py`` drops an ``if not use_cudagraph`` skip around
the call). Code read: ``fastdeploy/worker/input_batch.py`` of the search index at 000f2bff (``init_share_inputs``:
``rope_emb = get_rope(rotary_dim=head_dim, position_ids=arange(max_model_len), base=rope_theta, ...)``, ``free_list`` /
``free_list_len`` / ``reasoning_allowed_tokens`` from ``paddle.to_tensor`` / ``paddle.full``; ``reset_share_inputs``:
``fill_paddle_tensor`` for the ordinary buffers, then ``self.reasoning_allowed_tokens = paddle.to_tensor(...)``,
``self.free_list = paddle.to_tensor(free_list)``, ``self.free_list_len = paddle.full(...)`` and, without multimodal,
``self.rope_emb = get_rope(...)``), and ``fastdeploy/worker/gpu_worker.py`` at 004c57fc
(``graph_optimize_and_warm_up_model`` ends with ``self.model_runner.capture_model()``). The deterministic post-warmup
call itself and the PR's diff were not in the index: their place is taken from the description.
Symptom: with ``FD_DETERMINISTIC_MODE=1`` and ``use_cudagraph=True`` the generated text is garbled; either feature
alone is fine.
Mechanism: ``initialize_forward_meta`` hands the model ``share_inputs["rope_emb"]`` (and the other share inputs) every
step; the decode graphs captured by ``capture_model`` read the rotary table at the address it had then. The reset
after capture replaces ``rope_emb`` by a freshly built table: the share inputs (and every later ``ForwardMeta``) now
hold the new one, the old one has no owner left and its memory goes back to the allocator, and every replay still
gathers its cos/sin rows from the old address.
Doctor: dangling-reference, at reset_share_inputs. It rebinds a buffer that captured graphs read to a new tensor, which
releases the old storage while the graphs keep its address.
Fix (upstream): in deterministic mode ``reset_share_inputs`` refills those four buffers in place (``copy_`` /
``fill_``), so their addresses survive the reset.
Modelled: ``InputBatch.init_share_inputs`` / ``reset_share_inputs`` (the buffers a decode step uses,
``fill_paddle_tensor`` for the ordinary ones, the four re-created ones as read), ``get_rope``, ``ForwardMeta`` and
``GPUModelRunner.initialize_forward_meta`` (a new meta over the share inputs every step), ``capture_model`` (dummy
decode runs for capture sizes 4, 2, 1), ``CudaGraphPiecewiseBackend.__call__`` (one entry per batch size: warm-up
runs, capture, then replay returning the output buffer), ``GpuWorker.graph_optimize_and_warm_up_model`` followed by the
deterministic reset, and a decode loop with greedy ``update_inputs``. Stand-ins: a 1-layer decoder (embedding, qkv, RoPE
from ``rope_emb`` at each row's ``seq_lens_decoder``, a contiguous per-slot KV cache written at that position, causal
attention over the slot, output projection, lm head), the prompt run token by token on the eager path (FastDeploy runs
prefill steps eagerly), no padding (both decode batches are capture sizes); ``FD_DETERMINISTIC_MODE`` is a constant;
float64. On CUDA the rotary table is made big enough to own its allocator segment and the worker empties the cache
after the reset, so that the stale address faults instead of being silently reused.
Workload: max_num_seqs 4, max_model_len 16. Warm-up captures the decode graphs for 4, 2 and 1 requests, then the
deterministic reset. Two requests with 3-token prompts (prefilled eagerly, 3 steps of 2 rows), then 4 decode steps of
2 rows (graph 2 replayed). Bug: the first decode replay raises IllegalMemoryAccess (graph replay read freed memory: the
old ``rope_emb``; garbage or a fault on the GPU). Fix: the 4 decode steps' logits equal eager (max |graph - eager| = 0).
Runs twice alike.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/6746"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "reset_share_inputs"
SYMPTOM = ("deterministic mode with CUDA graphs produces garbled output: reset_share_inputs after capture re-creates "
           "rope_emb (and other share inputs), and the captured graphs keep reading the released old tensors")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM = 32, 16, 2, 8
MAX_NUM_SEQS, MAX_MODEL_LEN, ROPE_THETA = 4, 16, 10000.0
TOTAL_BLOCK_NUM, KV_CACHE_RATIO = 12, 0.75
CUDAGRAPH_CAPTURE_SIZES, CUDAGRAPH_NUM_OF_WARMUPS = (4, 2, 1), 1
FD_DETERMINISTIC_MODE = True            # envs.FD_DETERMINISTIC_MODE
DTYPE = torch.float64

_variant = "bug"


# --- fastdeploy/model_executor/layers/rotary_embedding.py (reduced) --------------------------------------------------

def get_rope(rotary_dim, position_ids, base, device):
    """cos / sin tables ``[2, max_model_len, rotary_dim // 2]``; on CUDA carved out of a tensor that owns its allocator
    segment (a real table, max_model_len x head_dim for 128k positions, is that large)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=DTYPE) / rotary_dim)
    freqs = position_ids.reshape(-1, 1).to(DTYPE) * inv_freq
    table = torch.stack([freqs.cos(), freqs.sin()])
    storage = torch.zeros(max(own_segment_elems(device), table.numel()), dtype=DTYPE, device=device)
    return storage[: table.numel()].view(table.shape).copy_(table)


# --- fastdeploy/utils.py -------------------------------------------------------------------------------------------

def fill_paddle_tensor(obj, name, value):
    getattr(obj, name).fill_(value)


# --- fastdeploy/worker/input_batch.py (reduced) ----------------------------------------------------------------------

class InputBatch:
    def __init__(self, device):
        self.device = device

    def __getitem__(self, key):
        return getattr(self, key)

    def _free_list(self):
        return list(range(TOTAL_BLOCK_NUM - 1, int(TOTAL_BLOCK_NUM * KV_CACHE_RATIO) - 1, -1))

    def init_share_inputs(self):
        d, n = self.device, MAX_NUM_SEQS
        self.input_ids = torch.zeros(n, 1, dtype=torch.int64, device=d)
        self.seq_lens_this_time = torch.zeros(n, dtype=torch.int32, device=d)
        self.seq_lens_encoder = torch.zeros(n, dtype=torch.int32, device=d)
        self.seq_lens_decoder = torch.zeros(n, dtype=torch.int32, device=d)
        self.step_idx = torch.zeros(n, 1, dtype=torch.int64, device=d)
        self.stop_flags = torch.ones(n, 1, dtype=torch.bool, device=d)
        self.reasoning_allowed_tokens = torch.tensor([100973, 100975], dtype=torch.int64, device=d)
        self.rope_emb = get_rope(HEAD_DIM, torch.arange(MAX_MODEL_LEN).reshape(1, -1), ROPE_THETA, d)
        free_list = self._free_list()
        self.free_list = torch.tensor(free_list, dtype=torch.int32, device=d)
        self.free_list_len = torch.full([1], len(free_list), dtype=torch.int32, device=d)

    def reset_share_inputs(self):
        """Reset all tensors to their initial state (deterministic-mode post-warmup path)."""
        fill_paddle_tensor(self, "input_ids", 0)
        fill_paddle_tensor(self, "seq_lens_this_time", 0)
        fill_paddle_tensor(self, "seq_lens_encoder", 0)
        fill_paddle_tensor(self, "seq_lens_decoder", 0)
        fill_paddle_tensor(self, "step_idx", 0)
        fill_paddle_tensor(self, "stop_flags", True)
        free_list = self._free_list()
        rope = get_rope(HEAD_DIM, torch.arange(MAX_MODEL_LEN).reshape(1, -1), ROPE_THETA, self.device)
        if _variant == "fix" and FD_DETERMINISTIC_MODE:
            # In-place: keep the addresses CUDA graphs baked in at capture.
            self.reasoning_allowed_tokens.copy_(torch.tensor([100973, 100975], dtype=torch.int64))
            self.free_list.copy_(torch.tensor(free_list, dtype=torch.int32))
            self.free_list_len.fill_(len(free_list))
            self.rope_emb.copy_(rope)
        else:
            self.reasoning_allowed_tokens = torch.tensor([100973, 100975], dtype=torch.int64, device=self.device)
            self.free_list = torch.tensor(free_list, dtype=torch.int32, device=self.device)
            self.free_list_len = torch.full([1], len(free_list), dtype=torch.int32, device=self.device)
            self.rope_emb = rope                                      # Reset non-multimodal rope_emb


# --- fastdeploy/model_executor/forward_meta.py (reduced) -------------------------------------------------------------

@dataclasses.dataclass
class ForwardMeta:
    ids_remove_padding: torch.Tensor
    rotary_embs: torch.Tensor
    seq_lens_decoder: torch.Tensor
    seq_lens_this_time: torch.Tensor
    caches: list


# --- the model (stand-in for an ERNIE / Qwen decoder) -----------------------------------------------------------------

def apply_rope(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class DecoderModel:
    def __init__(self, device):
        gen = generator(6746)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.qkv, self.o_proj = r(VOCAB, HIDDEN, scale=1.0), r(HIDDEN, 3 * HIDDEN), r(HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB)

    def forward(self, forward_meta: ForwardMeta):
        ids = forward_meta.ids_remove_padding
        bs = ids.shape[0]
        h = self.embed_tokens[ids]
        q, k, v = (h @ self.qkv).view(bs, 3, N_HEADS, HEAD_DIM).unbind(1)
        pos = forward_meta.seq_lens_decoder[:bs].long()
        cos, sin = forward_meta.rotary_embs[0][pos], forward_meta.rotary_embs[1][pos]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = forward_meta.caches
        rows = torch.arange(bs, device=ids.device)
        k_cache[rows, pos] = k                                        # append_attention: write this token's K/V
        v_cache[rows, pos] = v
        scores = torch.einsum("bhd,bthd->bht", q, k_cache[:bs]) / HEAD_DIM ** 0.5
        future = torch.arange(MAX_MODEL_LEN, device=ids.device)[None, :] > pos[:, None]
        attn = scores.masked_fill(future[:, None, :], float("-inf")).softmax(-1)
        out = torch.einsum("bht,bthd->bhd", attn, v_cache[:bs]).reshape(bs, HIDDEN)
        return F.rms_norm(h + out @ self.o_proj, (HIDDEN,)) @ self.lm_head


# --- fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py (reduced) ---------------------------

@dataclasses.dataclass
class ConcreteSizeEntry:
    real_shape: int
    use_cudagraph: bool = True
    cuda_graph: object = None
    output_buffer: torch.Tensor = None


class CudaGraphPiecewiseBackend:
    def __init__(self, runnable, device, use_cudagraph):
        self.runnable, self.device = runnable, device
        self.concrete_size_entries = {s: ConcreteSizeEntry(s, use_cudagraph) for s in CUDAGRAPH_CAPTURE_SIZES}

    def __call__(self, runner):
        real_shape = runner.forward_meta.ids_remove_padding.shape[0]
        entry = self.concrete_size_entries.get(real_shape)
        if entry is None or not entry.use_cudagraph:
            return self.runnable(runner.forward_meta)
        if entry.cuda_graph is None:
            share = runner.share_inputs
            static = {"input_ids": share.input_ids, "seq_lens_decoder": share.seq_lens_decoder,
                      "rope_emb": share.rope_emb}
            # the captured callable reads the runner's current forward meta, as the model's forward does
            entry.cuda_graph, entry.output_buffer = capture(
                lambda: self.runnable(runner.forward_meta), device=self.device, warmups=CUDAGRAPH_NUM_OF_WARMUPS,
                static=static, state={"k_cache": runner.caches[0], "v_cache": runner.caches[1]},
                owner="CudaGraphPiecewiseBackend", name=f"decode bs={real_shape}")
            return entry.output_buffer
        return replay(entry.cuda_graph, entry.output_buffer)


# --- fastdeploy/worker/gpu_model_runner.py (reduced) -----------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cudagraph):
        self.device, self.use_cudagraph = device, use_cudagraph
        self.share_inputs = InputBatch(device)
        self.share_inputs.init_share_inputs()
        shape = (MAX_NUM_SEQS, MAX_MODEL_LEN, N_HEADS, HEAD_DIM)
        self.caches = [torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(2)]
        self.model = DecoderModel(device)
        self.graph_backend = CudaGraphPiecewiseBackend(self.model.forward, device, use_cudagraph)
        self.forward_meta = None

    def initialize_forward_meta(self, num_running_requests):
        s = self.share_inputs
        self.forward_meta = ForwardMeta(
            ids_remove_padding=s["input_ids"][:num_running_requests, 0], rotary_embs=s["rope_emb"],
            seq_lens_decoder=s["seq_lens_decoder"], seq_lens_this_time=s["seq_lens_this_time"], caches=self.caches)

    def _dummy_run(self, batch_size):
        self.share_inputs.input_ids[:batch_size].fill_(1)
        self.share_inputs.seq_lens_this_time[:batch_size].fill_(1)
        self.share_inputs.seq_lens_decoder[:batch_size].fill_(MAX_MODEL_LEN - 1)
        self.initialize_forward_meta(batch_size)
        return self.graph_backend(self)

    def capture_model(self):
        if not self.use_cudagraph:
            return
        for batch_size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(batch_size)

    def insert_prefill_inputs(self, prompts):
        s = self.share_inputs
        for i in range(len(prompts)):
            s.stop_flags[i] = False
            s.seq_lens_encoder[i] = len(prompts[i])

    def _update_inputs(self, logits, bs):
        s = self.share_inputs
        s.input_ids[:bs, 0].copy_(logits.argmax(-1))                  # greedy sampler + update_inputs
        s.step_idx[:bs] += 1

    def prefill_step(self, tokens):
        """One prompt position of every running request, on the eager path (no graph for prefill)."""
        bs = len(tokens)
        self.share_inputs.input_ids[:bs, 0].copy_(torch.tensor(tokens, dtype=torch.int64))
        self.share_inputs.seq_lens_this_time[:bs].fill_(1)
        self.initialize_forward_meta(bs)
        logits = self.model.forward(self.forward_meta)
        self.share_inputs.seq_lens_decoder[:bs] += 1
        return logits

    def execute_model(self, num_running_requests):
        self.share_inputs.seq_lens_this_time[:num_running_requests].fill_(1)
        self.initialize_forward_meta(num_running_requests)
        logits = self.graph_backend(self)[:num_running_requests].clone()
        self.share_inputs.seq_lens_decoder[:num_running_requests] += 1
        self._update_inputs(logits, num_running_requests)
        return logits


# --- fastdeploy/worker/gpu_worker.py (reduced) -----------------------------------------------------------------------

class GpuWorker:
    def __init__(self, device, use_cudagraph):
        self.device = device
        self.model_runner = GPUModelRunner(device, use_cudagraph)

    def graph_optimize_and_warm_up_model(self):
        self.model_runner.capture_model()                             # Trigger cuda graph capture
        if FD_DETERMINISTIC_MODE:                                     # post-warmup path: start from a clean state
            self.model_runner.share_inputs.reset_share_inputs()
            release_to_driver(self.device)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [[3, 17, 8], [25, 4, 11]]

    def serve(use_cudagraph):
        worker = GpuWorker(device, use_cudagraph)
        worker.graph_optimize_and_warm_up_model()
        runner = worker.model_runner
        runner.insert_prefill_inputs(prompts)
        for step in range(len(prompts[0]) - 1):
            runner.prefill_step([p[step] for p in prompts])
        last = runner.prefill_step([p[-1] for p in prompts])
        runner._update_inputs(last, len(prompts))
        return [runner.execute_model(len(prompts)) for _ in range(4)]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
