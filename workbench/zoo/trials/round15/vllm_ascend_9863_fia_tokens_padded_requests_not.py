"""FULL graph, one request with one token: tokens are padded to the capture size, ``query_start_loc`` is not.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/9863 ("[BugFix] Fix bug from cudagraph config mode
FULL corner case", commit 595c6c7761).
Symptom: with ``cudagraph_mode=FULL`` and MTP/EAGLE speculative decoding (``num_speculative_tokens=3``, capture
size 4), a step that schedules a single request with a single token crashes the engine in the fused infer
attention (FIA) op: the number of query tokens does not match ``actual_seq_lengths_q`` (vllm-ascend main on
vLLM v0.20.2, June 2026). Eager mode runs the same batch.
Mechanism: FIA's TND layout requires the last ``actual_seq_lengths_q`` entry (``query_start_loc[num_reqs_padded]``)
to equal the number of query tokens, so ``_pad_query_start_loc_for_fia`` appends padding to ``query_start_loc``
for graph-padded batches. In FULL mode it sets ``num_reqs_padded = num_reqs`` (requests are not padded), then
takes the uniform-decode branch whenever ``num_tokens_padded == num_reqs_padded * uniform_decode_query_len``,
which spreads the padding tokens over *extra padded requests*. For 1 request with 1 token padded to 4 tokens,
``4 == 1 * 4`` holds, but there are no extra requests to spread over: the padding writes nothing and the step
runs the graph at its padded size (4 tokens) with ``query_start_loc`` still ending at the real token count (1).
The host-side FIA task update before the replay (``update_full_graph_params``) then hands the op 4 query tokens
with ``actual_seq_lengths_q = [1]`` and the op rejects it. Unpadded (eager) steps have 1 token and ``[1]``.
Doctor: padded-shape-mismatch, at ``_pad_query_start_loc_for_fia`` (it leaves real-size ``query_start_loc``
for a step run at the graph's padded token count).
Fix (upstream): skip the uniform branch when ``cudagraph_mode == FULL``, so the mixed-batch branch inserts a dummy
request ``query_start_loc[num_reqs + 1] = num_tokens_padded`` that owns the padding tokens.
"""
from __future__ import annotations

import enum
import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/9863"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_pad_query_start_loc_for_fia"
SYMPTOM = "FIA raises queryT(4) != actualSequenceLengthQ(1) on a 1-request/1-token step padded to a FULL graph"
VOCAB, DIM, MAX_NUM_REQS, NUM_SPEC = 12, 4, 2, 3
UNIFORM_DECODE_QUERY_LEN = 1 + NUM_SPEC
CUDAGRAPH_CAPTURE_SIZES = [4]


class CUDAGraphMode(enum.Enum):
    NONE = 0
    FULL = 2


def npu_fused_infer_attention_score_tnd(num_query_tokens: int, actual_seq_lengths: list[int]) -> torch.Tensor:
    """The host side of FIA in TND layout: validate, and give each query token its sequence id."""
    if not actual_seq_lengths or actual_seq_lengths[-1] != num_query_tokens:
        raise RuntimeError(f"npu_fused_infer_attention_score: queryT({num_query_tokens}) != "
                           f"actualSequenceLengthQ({actual_seq_lengths[-1] if actual_seq_lengths else 0})")
    q_lens = torch.diff(torch.tensor([0] + actual_seq_lengths))
    return torch.repeat_interleave(torch.arange(len(actual_seq_lengths)), q_lens)


def fia_kernel(q, k, v, token_seq_ids):
    """The device side: causal attention among the tokens of each query sequence."""
    t = torch.arange(q.shape[0], device=q.device)
    allowed = (token_seq_ids[:, None] == token_seq_ids[None, :]) & (t[None, :] <= t[:, None])
    scores = (q @ k.t() / math.sqrt(DIM)).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class Model:
    def __init__(self, device):
        gen = generator(9863)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(4))

    def forward(self, input_ids, token_seq_ids):
        h = self.embed_tokens[input_ids]
        return h + fia_kernel(h @ self.wq, h @ self.wk, h @ self.wv, token_seq_ids) @ self.wo


class CpuGpuBuffer:
    def __init__(self, n, device):
        self.np = np.zeros(n, dtype=np.int64)
        self.gpu = torch.zeros(n, dtype=torch.long, device=device)

    def copy_to_gpu(self):
        self.gpu.copy_(torch.from_numpy(self.np))


class NPUModelRunner:
    def __init__(self, model, device, variant, cudagraph_mode):
        self.model, self.device, self.variant = model, device, variant
        self.cudagraph_mode = cudagraph_mode                    # compilation_config.cudagraph_mode
        self.uniform_decode_query_len = UNIFORM_DECODE_QUERY_LEN
        self.query_start_loc = CpuGpuBuffer(MAX_NUM_REQS + 2, device)
        self.arange_np = np.arange(MAX_NUM_REQS + 2)
        max_tokens = max(CUDAGRAPH_CAPTURE_SIZES)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.token_seq_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)   # the FIA task's params
        self.graphs = {}

    def _pad_query_start_loc_for_fia(self, num_tokens_padded: int, num_reqs_padded: int, num_reqs: int,
                                     cudagraph_runtime_mode: CUDAGraphMode, batch_desc_num_reqs=None) -> int:
        """Satisfy FIA's TND constraint: the last ``actual_seq_lengths_q`` entry equals the token count."""
        if cudagraph_runtime_mode == CUDAGraphMode.FULL and self.cudagraph_mode == CUDAGraphMode.FULL:
            num_reqs_padded = num_reqs
        else:
            num_reqs_padded = batch_desc_num_reqs if batch_desc_num_reqs is not None else num_reqs

        uniform = num_tokens_padded == num_reqs_padded * self.uniform_decode_query_len
        if self.variant == "fix":
            # avoid corner case of cudagraph config mode FULL to enter the first padding logic
            uniform = uniform and self.cudagraph_mode != CUDAGraphMode.FULL
        if uniform:
            # Uniform-batch case: num_reqs must be no greater than num_reqs_padded
            assert num_reqs <= num_reqs_padded
            last_loc = self.query_start_loc.np[num_reqs]
            self.query_start_loc.np[num_reqs + 1: num_reqs_padded + 1] = (
                self.arange_np[1: num_reqs_padded + 1 - num_reqs] * self.uniform_decode_query_len + last_loc)
        else:
            # Mixed-batch case: num_reqs must equal num_reqs_padded
            assert num_reqs == num_reqs_padded
            if self.query_start_loc.np[num_reqs_padded] < num_tokens_padded:
                # Insert a dummy request instead of change the last value directly
                self.query_start_loc.np[num_reqs_padded + 1] = num_tokens_padded
                num_reqs_padded = num_reqs_padded + 1
        self.query_start_loc.copy_to_gpu()
        return num_reqs_padded

    def update_full_graph_params(self, num_tokens_padded: int, num_reqs_padded: int):
        """Re-issue the captured FIA task with this step's ``actual_seq_lengths`` (host lists)."""
        actual_seq_lengths_q = self.query_start_loc.np[1: num_reqs_padded + 1].tolist()
        self.token_seq_ids[:num_tokens_padded].copy_(
            npu_fused_infer_attention_score_tnd(num_tokens_padded, actual_seq_lengths_q))

    def capture_model(self):
        for size in CUDAGRAPH_CAPTURE_SIZES:                    # capture batch: uniform decode requests
            self.token_seq_ids[:size].copy_(torch.arange(size) // self.uniform_decode_query_len)
            self.graphs[size] = capture(lambda s=size: self.model.forward(self.input_ids[:s], self.token_seq_ids[:s]),
                                        device=self.device, name=f"FULL size {size}",
                                        static={"input_ids": self.input_ids, "token_seq_ids": self.token_seq_ids},
                                        owner="NPUModelRunner (ACL graph, FULL)")

    def execute_model(self, num_scheduled_tokens: list[int], token_ids: list[int]):
        num_reqs, num_tokens = len(num_scheduled_tokens), sum(num_scheduled_tokens)
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1: num_reqs + 1] = np.cumsum(num_scheduled_tokens)
        self.input_ids[:num_tokens].copy_(torch.tensor(token_ids, device=self.device))
        size = next((s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens), None)
        if self.cudagraph_mode == CUDAGraphMode.NONE or size is None:
            num_reqs_padded = self._pad_query_start_loc_for_fia(num_tokens, num_reqs, num_reqs, CUDAGraphMode.NONE)
            actual_seq_lengths_q = self.query_start_loc.np[1: num_reqs_padded + 1].tolist()
            token_seq_ids = npu_fused_infer_attention_score_tnd(num_tokens, actual_seq_lengths_q).to(self.device)
            return self.model.forward(self.input_ids[:num_tokens], token_seq_ids).clone()
        num_reqs_padded = self._pad_query_start_loc_for_fia(size, num_reqs, num_reqs, CUDAGraphMode.FULL)
        self.update_full_graph_params(size, num_reqs_padded)
        g, out = self.graphs[size]
        return replay(g, out, real=num_tokens, size=size, padded={"input_ids": self.input_ids})[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    # (num_scheduled_tokens per request, token ids): an MTP verify step (1 + 3 drafts), then one request with a
    # single token (no drafts this step), then a verify step again.
    steps = [([4], [3, 8, 1, 5]), ([1], [7]), ([4], [2, 9, 4, 6])]

    def serve(mode):
        runner = NPUModelRunner(model, device, variant, mode)
        if mode != CUDAGraphMode.NONE:
            runner.capture_model()
        return [runner.execute_model(n, ids) for n, ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(CUDAGraphMode.FULL),
                   lambda: serve(CUDAGraphMode.NONE))
