"""Spec-v2 EAGLE on NPU graphs: target-verify's replay_prepare on the overlap plan stream rewrites the pooled positions/out_cache_loc the draft graph has yet to read.

Upstream: https://github.com/sgl-project/sglang/pull/19507 ("[bugfix] disable share input buffer feature on npu
due to accuracy issue", merged; opened 2026-02-27). The pool came in with
https://github.com/sgl-project/sglang/pull/19180 ("Refactor CUDA graph input buffers with shared buffer pool",
merged 2026-02-23).
Symptom: EAGLE3 speculative decoding (spec-v2, ``SGLANG_ENABLE_OVERLAP_PLAN_STREAM``) on Ascend with graphs: "memory
trampling". The draft model's positions and ``out_cache_loc`` hold the verify batch's values, so drafts use wrong
rotary positions and write their KV to other requests' slots. Sometimes ``gatherv3`` raises an out-of-bounds
error; otherwise accuracy silently drops. Without graphs each forward builds its own tensors, and eager is right.
Mechanism: ``model_executor/input_buffers.py``: #19180 made every graph runner's static inputs go through
``ForwardInputBuffers.share_buffers()``. For each field, ``_share_one_buffer(name, buffer)`` looks the field name up
in the process-wide ``_forward_input_buffer_pool``. If the buffer already there is larger, the new runner gets an
``as_strided`` view of it (an equal-sized one, such as ``seq_lens``, replaces the entry and is not aliased). The target model's TARGET_VERIFY runner (``NPUGraphRunner``) is built first; its
``positions``/``out_cache_loc`` are ``max_bs * speculative_num_draft_tokens`` long. The draft runner
(``EAGLEDraftNpuGraphRunner``, built later by ``EagleDraftWorker.init_cuda_graphs``) has shorter ones
(``max_bs * topk`` and ``max_bs * topk * num_steps``), so its draft graph is captured on the target runner's
storage. The pool rests on the assumption that the buffers "are filled immediately before each replay and the
forwards that use them are sequential / mutually exclusive" (the pool's later docstring). In
``EAGLEWorkerV2.forward_batch_generation``, ``EagleDraftWorker.draft`` copies the draft inputs into the buffers and
replays the draft graph on the compute stream. ``EAGLEWorkerV2.verify`` then runs
``EagleVerifyInput.prepare_for_v2_verify`` under ``plan_stream_ctx``. That calls the target runner's
``replay_prepare``, which ``copy_``s the verify batch's ``positions``/``out_cache_loc`` into the pooled storage.
Only afterwards does the compute stream ``wait_stream(plan_stream)``; nothing makes the plan stream wait for the
draft graph. The plan stream's copies land while the multi-step draft graph is still running, so its kernels read
the verify layout: per request ``seq_len + 0..num_draft_tokens-1`` positions and slots, where the draft expects one
position per request and ``num_steps`` slots per request.
Doctor: persistent-mutation, at share_buffers. Target-verify's input preparation writes, in place, storage that is
also the draft graph's static ``positions``/``out_cache_loc``, while the draft graph in flight still has to read
them. The two graphs alias because ``share_buffers`` pools buffers by field name, and that is the function the fix
changed.
Fix (upstream): ``share_buffers`` returns at once when ``is_npu()`` ("disable share input buffer on npu due to
accuracy issue"). Each NPU graph runner owns its input buffers again. (An earlier, struck-out version of the PR kept
sharing and gave only the draft graph private buffers under the overlap plan stream.)
Modelled: Ascend (``is_npu()`` is true) with topk 1, 3 draft steps (4 draft tokens) and one captured batch size
(bs 2, no padding). Two graph runners are modelled, target verify and draft; draft-extend, which also pools its
inputs, is left out. Streams are modelled as a deterministic ordering. A kernel launched on an idle stream has run
by the time the host goes on. The draft graph (or the eager draft forward) keeps the compute stream busy; it and
everything launched after it run when the host synchronises at the end of the step. The idle plan stream runs its
work at once. So the draft's input copies land first, then target-verify's ``replay_prepare`` copies, then the
draft graph's reads.
Models are one attention layer each, with a learned position table in place of rotary embeddings and one KV tensor
per model pool. ``select_top_k_tokens``/``fast_topk`` are an argmax, and ``build_tree_kernel_efficient`` for topk 1
is a chain ``[verified_id, drafts]`` at positions ``seq_len + depth``. Those verify positions are computed from
``seq_lens`` in the plan step (upstream they come from the draft tree and the attention buffers are corrected after
the wait). The verify graph's ``input_ids`` (the drafts) are copied on the compute stream after the wait.
Upstream's ``positions.add_(1)`` per step with ``sub_`` at the end of the captured draft is written as
``positions + (i + 1)``. The ``_share_one_buffer`` dtype/device asserts are kept.
"""

import math
from dataclasses import dataclass, fields
from typing import Dict, Optional

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/19507"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "share_buffers"
SYMPTOM = ("spec-v2 EAGLE on NPU graphs with the overlap plan stream: target-verify's replay_prepare rewrites the "
           "pooled positions/out_cache_loc the draft graph is about to read; wrong drafts, KV written to wrong slots")

VOCAB, HIDDEN = 16, 8
BS = 2                                          # the one captured batch size (raw_bs == bs)
TOPK, NUM_STEPS = 1, 3                          # speculative_eagle_topk, speculative_num_steps
NUM_DRAFT_TOKENS = NUM_STEPS + 1                # speculative_num_draft_tokens
MAX_CTX = 20                                    # req_to_token row length
NUM_SLOTS = 1 + BS * MAX_CTX                    # slot 0: the padding slot
MAX_POS = MAX_CTX + NUM_DRAFT_TOKENS
ROUNDS = [[5, 7], [9, 11]]                      # seq_lens of the two decode rounds served

_variant = "bug"


def is_npu() -> bool:
    return True                                 # Ascend


# --- a stream in miniature ------------------------------------------------------------------------------------

class Stream:
    """Kernels run in launch order. One launched on an idle stream has run by the time the host goes on. A long
    launch (a multi-step draft forward) keeps the stream busy, and it and everything behind it run when the host
    synchronises."""

    def __init__(self):
        self.queue = []

    def launch(self, kernel, *, long: bool = False):
        if self.queue or long:
            self.queue.append(kernel)
        else:
            kernel()

    def wait_stream(self, other: "Stream"):
        # work launched here from now on follows everything launched on ``other`` (which is never busy here)
        other.synchronize()

    def synchronize(self):
        while self.queue:
            self.queue.pop(0)()


# --- sglang/srt/model_executor/input_buffers.py (after #19180) ------------------------------------------------

_forward_input_buffer_pool: Dict[str, torch.Tensor] = {}


@dataclass
class ForwardInputBuffers:

    def _share_buffer_key(self, name: str) -> str:
        return name

    def _share_one_buffer(self, name: str, new_buffer: torch.Tensor) -> torch.Tensor:
        buffer_size = new_buffer.size()
        buffer_stride = new_buffer.stride()

        old_buffer = _forward_input_buffer_pool.get(name, None)
        if old_buffer is not None:
            assert new_buffer.dtype == old_buffer.dtype, f"Buffer {name} has different dtype than before."
            assert new_buffer.device == old_buffer.device, f"Buffer {name} has different device than before."
            if old_buffer.numel() > new_buffer.numel():
                new_buffer = old_buffer

        _forward_input_buffer_pool[name] = new_buffer
        return new_buffer.as_strided(buffer_size, buffer_stride)

    def share_buffers(self):
        if _variant == "fix":
            # disable share input buffer on npu due to accuracy issue   (PR #19507)
            if is_npu():
                return

        for f in fields(self):
            name = f.name
            buffer = getattr(self, name)
            if buffer is None:
                continue
            setattr(self, name, self._share_one_buffer(self._share_buffer_key(name), buffer))


# --- batches ------------------------------------------------------------------------------------------------------

@dataclass
class EagleDraftInput:
    topk_index: torch.Tensor                    # [bs, topk]: the first draft token (from the last draft extend)
    hidden_states: torch.Tensor                 # [bs, hidden]
    verified_id: torch.Tensor                   # [bs]


@dataclass
class ForwardBatch:
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    input_ids: Optional[torch.Tensor] = None
    spec_info: Optional[EagleDraftInput] = None


# --- the models -------------------------------------------------------------------------------------------------

def attention(q, kv_pool, table, kv_lens):
    """Each query attends over its request's first ``kv_lens`` token slots (``req_to_token`` row)."""
    keys = kv_pool[table]                                                     # [n, MAX_CTX, hidden]
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(HIDDEN)
    hidden = torch.arange(MAX_CTX, device=q.device)[None, :] >= kv_lens[:, None]
    p = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (p.unsqueeze(-1) * keys).sum(1)


class Model:
    """One attention layer over its own KV pool; the draft head also takes the target's hidden states."""

    def __init__(self, gen, device, req_to_token, draft: bool):
        self.req_to_token = req_to_token
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.8)
        self.w_h = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5) if draft else None
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.wk = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=1.5)
        self.kv_pool = randn(NUM_SLOTS, HIDDEN, gen=gen, device=device)    # prefilled KV (and stale slots)

    def forward(self, input_ids, positions, out_cache_loc, req_pool_indices, kv_lens, hidden_states=None):
        x = self.embed[input_ids] + self.pos[positions]
        if hidden_states is not None:
            x = x + hidden_states @ self.w_h
        self.kv_pool.index_copy_(0, out_cache_loc.long(), torch.tanh(x @ self.wk))     # set_kv_buffer
        o = attention(x @ self.wq, self.kv_pool, self.req_to_token[req_pool_indices], kv_lens)
        h = torch.tanh(x + o)
        return h @ self.lm_head, h

    def forward_target_verify(self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens):
        n = NUM_DRAFT_TOKENS
        bs = req_pool_indices.shape[0]
        depth = torch.arange(n, device=seq_lens.device).repeat(bs)
        kv_lens = seq_lens.repeat_interleave(n) + depth + 1                  # the chain is causal
        logits, _ = self.forward(input_ids, positions, out_cache_loc, req_pool_indices.repeat_interleave(n),
                                 kv_lens)
        return logits


# --- sglang/srt/hardware_backend/npu/graph_runner/npu_graph_runner.py (TARGET_VERIFY) ---------------------------

@dataclass
class DecodeInputBuffers(ForwardInputBuffers):
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor


class NPUGraphRunner:
    def __init__(self, model: Model, device):
        self.model = model
        max_num_token = BS * NUM_DRAFT_TOKENS
        self.buffers = DecodeInputBuffers(
            input_ids=torch.zeros(max_num_token, dtype=torch.int64, device=device),
            req_pool_indices=torch.zeros(BS, dtype=torch.int64, device=device),
            seq_lens=torch.ones(BS, dtype=torch.int64, device=device),
            out_cache_loc=torch.zeros(max_num_token, dtype=torch.int32, device=device),
            positions=torch.zeros(max_num_token, dtype=torch.int64, device=device),
        )
        self.buffers.share_buffers()
        b = self.buffers

        def run_once():
            return self.model.forward_target_verify(b.input_ids, b.positions, b.out_cache_loc,
                                                    b.req_pool_indices, b.seq_lens)

        self.graph, self.output = capture(
            run_once, device=device, name=f"target_verify bs={BS}", owner="NPUGraphRunner (target verify)",
            static={f.name: getattr(b, f.name) for f in fields(b)},
            state={"target kv_pool": model.kv_pool, "req_to_token": model.req_to_token})

    def replay_prepare(self, forward_batch: ForwardBatch):
        b, raw_bs = self.buffers, forward_batch.batch_size
        raw_num_token = raw_bs * NUM_DRAFT_TOKENS
        b.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        b.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        b.out_cache_loc[:raw_num_token].copy_(forward_batch.out_cache_loc)
        b.positions[:raw_num_token].copy_(forward_batch.positions)

    def replay(self, forward_batch: ForwardBatch):
        self.buffers.input_ids[: forward_batch.input_ids.shape[0]].copy_(forward_batch.input_ids)
        return replay(self.graph, self.output)


# --- sglang/srt/speculative/eagle_draft_cuda_graph_runner.py + npu/graph_runner/eagle_draft_npu_graph_runner.py --

@dataclass
class EagleDraftInputBuffers(ForwardInputBuffers):
    req_pool_indices: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: Optional[torch.Tensor]

    def _share_buffer_key(self, name: str) -> str:
        if name == "hidden_states":
            return "eagle_draft.hidden_states"
        return name


class EAGLEDraftNpuGraphRunner:
    def __init__(self, eagle_worker: "EagleDraftWorker", device):
        self.eagle_worker = eagle_worker
        max_num_token = BS * TOPK
        self.buffers = EagleDraftInputBuffers(
            req_pool_indices=torch.zeros(BS, dtype=torch.int64, device=device),
            out_cache_loc=torch.zeros(max_num_token * NUM_STEPS, dtype=torch.int32, device=device),
            positions=torch.zeros(max_num_token, dtype=torch.int64, device=device),
            seq_lens=torch.ones(BS, dtype=torch.int64, device=device),
            topk_index=torch.zeros(BS, TOPK, dtype=torch.int64, device=device),
            hidden_states=torch.zeros(BS, HIDDEN, device=device),
        )
        self.buffers.share_buffers()
        b = self.buffers
        forward_batch = ForwardBatch(
            batch_size=BS, req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens,
            out_cache_loc=b.out_cache_loc, positions=b.positions,
            spec_info=EagleDraftInput(topk_index=b.topk_index, hidden_states=b.hidden_states, verified_id=None))

        def run_once():
            return self.eagle_worker.draft_forward(forward_batch)

        self.graph, self.output = capture(
            run_once, device=device, name=f"eagle draft bs={BS}", owner="EAGLEDraftNpuGraphRunner",
            static={f.name: getattr(b, f.name) for f in fields(b)},
            state={"draft kv_pool": eagle_worker.draft_model.kv_pool,
                   "req_to_token": eagle_worker.draft_model.req_to_token})

    def replay(self, forward_batch: ForwardBatch, stream: Stream):
        b, raw_bs = self.buffers, forward_batch.batch_size
        raw_num_token = raw_bs * TOPK

        def copy_inputs():
            b.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
            b.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
            b.out_cache_loc[: raw_num_token * NUM_STEPS].copy_(forward_batch.out_cache_loc)
            b.positions[:raw_num_token].copy_(forward_batch.positions)
            b.topk_index[:raw_bs].copy_(forward_batch.spec_info.topk_index)
            b.hidden_states[:raw_bs].copy_(forward_batch.spec_info.hidden_states)

        result = {}

        def graph_kernels():
            result["out"] = replay(self.graph, self.output)

        stream.launch(copy_inputs)
        stream.launch(graph_kernels, long=True)
        return result


# --- sglang/srt/speculative/eagle_worker_v2.py ------------------------------------------------------------------

class EagleDraftWorker:
    def __init__(self, draft_model: Model, req_to_token, device, use_graph: bool, compute_stream: Stream):
        self.draft_model, self.req_to_token, self.device = draft_model, req_to_token, device
        self.compute_stream = compute_stream
        self.cuda_graph_runner = EAGLEDraftNpuGraphRunner(self, device) if use_graph else None

    def draft_forward(self, forward_batch: ForwardBatch):
        spec_info = forward_batch.spec_info
        topk_index, hidden_states = spec_info.topk_index, spec_info.hidden_states
        bs = forward_batch.batch_size
        out_cache_loc = forward_batch.out_cache_loc.reshape(bs, TOPK, NUM_STEPS)
        out_cache_loc = out_cache_loc.permute((2, 0, 1)).reshape(NUM_STEPS, -1)

        score_list, token_list = [], []
        for i in range(NUM_STEPS):
            input_ids = topk_index.flatten()                       # select_top_k_tokens (topk 1)
            token_list.append(input_ids)
            if i == NUM_STEPS - 1:
                break
            positions = forward_batch.positions + (i + 1)          # forward_batch.positions.add_(1)
            kv_lens = forward_batch.seq_lens + (i + 1)
            logits, hidden_states = self.draft_model.forward(
                input_ids, positions, out_cache_loc[i], forward_batch.req_pool_indices, kv_lens, hidden_states)
            topk_p, topk_index = torch.softmax(logits, dim=-1).max(dim=-1, keepdim=True)    # fast_topk
            score_list.append(topk_p)
        return torch.stack(token_list, dim=1), torch.cat(score_list, dim=1)

    def draft(self, batch: dict):
        # EagleDraftInputV2Mixin.prepare_for_v2_draft: assign_draft_cache_locs (page size 1)
        draft_input: EagleDraftInput = batch["spec_info"]
        seq_lens, req_pool_indices = batch["seq_lens"], batch["req_pool_indices"]
        cols = seq_lens[:, None] + torch.arange(TOPK * NUM_STEPS, device=self.device)[None, :]
        out_cache_loc = self.req_to_token[req_pool_indices[:, None], cols].flatten().to(torch.int32)
        forward_batch = ForwardBatch(
            batch_size=BS, req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
            positions=seq_lens.repeat_interleave(TOPK, dim=0), spec_info=draft_input)

        if self.cuda_graph_runner is not None:
            result = self.cuda_graph_runner.replay(forward_batch, self.compute_stream)
        else:
            result = {}

            def eager_kernels():
                result["out"] = self.draft_forward(forward_batch)
            self.compute_stream.launch(eager_kernels, long=True)

        verify_input = {"draft_token": None, "draft_scores": None}

        def build_tree_kernel_efficient():                        # topk 1: a chain [verified_id, drafts]
            draft_tokens, scores = result["out"]
            verify_input["draft_token"] = torch.cat(
                [draft_input.verified_id[:, None], draft_tokens], dim=1).flatten()
            verify_input["draft_scores"] = scores.clone()
        self.compute_stream.launch(build_tree_kernel_efficient)
        return verify_input


class EAGLEWorkerV2:
    def __init__(self, gen, device, use_graph: bool):
        self.device = device
        self.compute_stream, self.plan_stream = Stream(), Stream()     # SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1
        # ReqToTokenPool: request r's tokens live in slots 1 + r*MAX_CTX ... (slot 0 is the padding slot)
        self.req_to_token = (1 + torch.arange(BS * MAX_CTX, device=device)).view(BS, MAX_CTX)
        self.target_model = Model(gen, device, self.req_to_token, draft=False)
        draft_model = Model(gen, device, self.req_to_token, draft=True)
        # the target worker (and its TARGET_VERIFY graph runner) is built first, then the draft worker
        self.graph_runner = NPUGraphRunner(self.target_model, device) if use_graph else None
        self.draft_worker = EagleDraftWorker(draft_model, self.req_to_token, device, use_graph, self.compute_stream)

    def verify(self, batch: dict, verify_input: dict):
        seq_lens, req_pool_indices = batch["seq_lens"], batch["req_pool_indices"]
        # Prepare for target verify in a separate stream (EagleVerifyInputV2Mixin.prepare_for_v2_verify)
        depth = torch.arange(NUM_DRAFT_TOKENS, device=self.device)
        cols = seq_lens[:, None] + depth[None, :]
        verify_forward_batch = ForwardBatch(
            batch_size=BS, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
            out_cache_loc=self.req_to_token[req_pool_indices[:, None], cols].flatten().to(torch.int32),
            positions=cols.flatten())                             # assign_extend_cache_locs, tree positions
        if self.graph_runner is not None:
            self.plan_stream.launch(lambda: self.graph_runner.replay_prepare(verify_forward_batch))
        self.compute_stream.wait_stream(self.plan_stream)

        out = {}

        def target_verify():                                      # in the main compute stream
            verify_forward_batch.input_ids = verify_input["draft_token"]
            if self.graph_runner is not None:
                out["logits"] = self.graph_runner.replay(verify_forward_batch)
            else:
                b = verify_forward_batch
                out["logits"] = self.target_model.forward_target_verify(
                    b.input_ids, b.positions, b.out_cache_loc, b.req_pool_indices, b.seq_lens)
        self.compute_stream.launch(target_verify)
        return out

    def forward_batch_generation(self, batch: dict):
        verify_input = self.draft_worker.draft(batch)
        out = self.verify(batch, verify_input)
        self.compute_stream.synchronize()                         # the scheduler reads the results
        logits = out["logits"].clone()
        target_predict = logits.argmax(dim=-1).view(BS, NUM_DRAFT_TOKENS)
        candidates = verify_input["draft_token"].view(BS, NUM_DRAFT_TOKENS)
        accept = (candidates[:, 1:] == target_predict[:, :-1]).long().cumprod(dim=1).sum(dim=1) + 1
        return [verify_input["draft_scores"], candidates.float(), logits, accept.float()]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_graph: bool):
        _forward_input_buffer_pool.clear()                        # a fresh process
        gen = generator(19507)
        worker = EAGLEWorkerV2(gen, device, use_graph)
        outs = []
        for seq_lens in ROUNDS:
            batch = {
                "req_pool_indices": torch.arange(BS, device=device),
                "seq_lens": torch.tensor(seq_lens, device=device),
                "spec_info": EagleDraftInput(
                    topk_index=torch.randint(VOCAB, (BS, TOPK), generator=gen).to(device),
                    hidden_states=randn(BS, HIDDEN, gen=gen, device=device),
                    verified_id=torch.randint(VOCAB, (BS,), generator=gen).to(device)),
            }
            outs += worker.forward_batch_generation(batch)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
