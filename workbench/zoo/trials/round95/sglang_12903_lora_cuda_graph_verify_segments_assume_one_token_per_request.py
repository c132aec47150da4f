"""SGLang multi-LoRA + NGRAM speculative decoding under CUDA graphs: the LoRA backend's static CUDA-graph segment
layout is built once for one token per request, so the captured target-verify graphs apply each adapter to the wrong
draft tokens (or to none) and the verify logits differ from eager.

Upstream: https://github.com/sgl-project/sglang/pull/12903 ("Support spec decoding when LoRA is applied to target
model", sgl-project/sglang, merged; description dated 2025-11-09; fixes issue 12726, "Server fails to launch with
multi-LoRA + NGRAM Speculative Decoding"). Read: the PR description ("as we assume seqlen = 1 during decoding in many
places, this result in incorrect result (e.g., for triton backend + cuda graph) or startup failure ... Generalize decoding
seq_len computation logic leveraging `spec_info.num_tokens_per_bs`"); the pre-fix ``python/sglang/srt/lora/lora_manager.py``
(``init_cuda_graph_batch_info(max_bs_in_cuda_graph)`` building ``cuda_graph_batch_info`` with ``max_len=1`` and handing it
to the backend; ``prepare_lora_batch`` choosing the static batch info when ``forward_mode.is_cuda_graph()``) and the pre-fix
``lora/backend/triton_backend.py`` (``init_cuda_graph_batch_info`` doing ``seg_lens[:max_bs].fill_(1)`` and the cumsum into
``seg_indptr``, commented "remain constant across batches"; ``prepare_lora_batch`` whose eager branch uses
``extend_seq_lens`` for extend-like modes and whose CUDA-graph branch only refreshes ``bs``, ``weight_indices``,
``lora_ranks`` and ``scalings``); and the post-fix versions of both (``init_cuda_graph_batch_info(max_bs_in_cuda_graph,
num_tokens_per_bs)``, ``seg_lens=torch.full((max_bs,), num_tokens_per_bs)``, ``max_len=num_tokens_per_bs``). The PR diff
itself was not read; the two hunks modelled are reconstructed from the pre- and post-fix files. The triton
``sgemm_lora_a_fwd``/``sgemm_lora_b_fwd`` kernels were not read either: their behaviour (one program column per segment
of ``batch_info.bs``, rows ``< seg_len`` tiled by ``max_len``, rank-0 slots skipped) is reconstructed from how the
backend fills ``LoRABatchInfo``.
Symptom: with ``--enable-lora`` (triton backend), NGRAM speculative decoding and CUDA graphs, the target model's verify
steps give "incorrect result" (the PR) for requests that use an adapter; without CUDA graphs they are right.
Mechanism: a target-verify step carries ``num_tokens_per_bs`` (= draft token count) tokens per request. The CUDA-graph
runner calls ``LoRAManager.init_cuda_graph_batch_info`` once, before capturing, and the backend lays out the static
``seg_lens``/``seg_indptr`` as one token per request; every later step only refreshes the adapter slots. The captured
LoRA kernels therefore treat token ``i`` as request ``i``'s whole segment: request 0's second draft token gets request
1's adapter, and the tokens past ``bs`` get no LoRA delta at all. Eagerly the backend builds the segments from the step's
``extend_seq_lens`` and each request's draft tokens get its own adapter.
Doctor: warmup-divergence, at init_cuda_graph_batch_info. The segment plan (one token per request) is decided once when
the graphs are set up and every replay reuses it, while the eager step decides the segments from the batch it serves.
Fix (upstream): pass ``num_tokens_per_bs`` into ``init_cuda_graph_batch_info`` and lay out ``seg_lens`` (and ``max_len``)
with that many tokens per request.
Modelled: ``LoRAManager`` (``init_cuda_graph_batch_info``, ``prepare_lora_batch``), ``TritonLoRABackend``
(``init_cuda_graph_batch_info``, ``prepare_lora_batch``, ``run_lora_a_sgemm``/``run_lora_b_sgemm``), ``LoRABatchInfo``,
a ``LoRAMemoryPool`` (slot 0 holds the base model, rank 0), ``ColumnParallelLinearWithLoRA``/``RowParallelLinearWithLoRA``,
a ``CudaGraphRunner`` capturing TARGET_VERIFY graphs for bs [1, 2, 4] into one pool with ``lora_ids=[None] * bs`` and
padding the batch on replay, and a ``ModelRunner`` that prepares the LoRA batch (as ``ForwardBatch.init_new`` does) and
then replays or runs eagerly. Stand-ins: the model (embedding + position embedding, one MLP block whose up/down
projections carry LoRA, lm_head; hidden 8, vocab 16, float64; no attention: verify tokens do not interact here), two
rank-2 adapters, the triton kernels (torch over the same segment grid; rows no program writes stay zero, where the
kernel leaves ``torch.empty`` memory that ``lora_b`` never reads), and the NGRAM drafts (fixed token lists). Assumed:
that ``is_extend()`` covers TARGET_VERIFY and that a verify batch carries ``extend_seq_lens`` (``num_tokens_per_bs`` per
request), so the eager segments are right.
Workload: 3 draft tokens per request; step 1 verifies A (adapter "fr"), B (base model), C (adapter "de") (3 requests,
padded to 4); step 2 verifies C and A (2); step 3 verifies A (1); step 4 verifies B, C, A again (padded to 4). The
verify logits of every real draft token are compared. The bug's graphs misapply the adapters (max error about 20);
the fix equals eager.
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/12903"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "init_cuda_graph_batch_info"
SYMPTOM = ("Multi-LoRA with NGRAM speculative decoding under CUDA graphs: the captured target-verify graphs use a LoRA "
           "segment layout of one token per request, so draft tokens get another request's adapter or none and the "
           "verify logits are wrong; eager is right")

HIDDEN = 8
VOCAB = 16
MAX_LORA_RANK = 2
MAX_LORAS_PER_BATCH = 3          # slot 0: the base model (rank 0)
NUM_DRAFT_TOKENS = 3             # speculative_num_draft_tokens == num_tokens_per_bs of a target-verify step
CUDA_GRAPH_BS = [1, 2, 4]
BLOCK_S = 16                     # the triton kernels' row tile
MAX_POSITION = 32

_variant = "bug"


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    TARGET_VERIFY = enum.auto()

    def is_extend(self):
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)

    def is_cuda_graph(self):
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    lora_ids: list
    extend_seq_lens: torch.Tensor | None = None
    extend_seq_lens_cpu: list | None = None


@dataclasses.dataclass
class LoRABatchInfo:
    bs: int
    num_segments: int | None
    max_len: int
    use_cuda_graph: bool
    seg_lens: torch.Tensor
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    permutation: torch.Tensor | None = None


# --- sglang/srt/lora/triton_ops (stand-ins over the kernels' launch grid) -----------------------------------------------

def _segment_rows(batch_info, num_tokens, device):
    """Per program column ``b < batch_info.bs`` (the grid is fixed at launch): the rows it owns and its slot."""
    cap = -(-batch_info.max_len // BLOCK_S) * BLOCK_S           # cdiv(max_len, BLOCK_S) row tiles
    tok = torch.arange(num_tokens, device=device)
    for b in range(batch_info.bs):
        start, seg_len = batch_info.seg_indptr[b], batch_info.seg_lens[b]
        rows = (tok >= start) & (tok < start + torch.clamp(seg_len, max=cap))
        w = batch_info.weight_indices[b:b + 1].long()              # (1,): gathers stay on the device
        yield rows, w


def sgemm_lora_a_fwd(x, weights, batch_info):
    """x: (s, in), weights: (num_slots, r, in) -> (s, r); rows of rank-0 slots and rows no segment owns are not written."""
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=x.dtype, device=x.device)
    r_idx = torch.arange(weights.shape[1], device=x.device)
    for rows, w in _segment_rows(batch_info, x.shape[0], x.device):
        rank = batch_info.lora_ranks.index_select(0, w)
        part = (x @ weights.index_select(0, w)[0].transpose(0, 1)) * (r_idx < rank).to(x.dtype)
        out = torch.where((rows & (rank > 0))[:, None], part, out)
    return out


def sgemm_lora_b_fwd(x, weights, batch_info, base_output):
    """x: (s, r), weights: (num_slots, out, r); base_output += scaling * x @ B^T on the rows each segment owns."""
    r_idx = torch.arange(weights.shape[2], device=x.device)
    for rows, w in _segment_rows(batch_info, x.shape[0], x.device):
        rank, scaling = batch_info.lora_ranks.index_select(0, w), batch_info.scalings.index_select(0, w)
        delta = scaling * ((x * (r_idx < rank).to(x.dtype)) @ weights.index_select(0, w)[0].transpose(0, 1))
        base_output.add_(torch.where((rows & (rank > 0))[:, None], delta, torch.zeros_like(delta)))
    return base_output


# --- sglang/srt/lora/backend/triton_backend.py --------------------------------------------------------------------------

class TritonLoRABackend:
    name = "triton"

    def __init__(self, max_loras_per_batch, device):
        self.max_loras_per_batch = max_loras_per_batch
        self.device = device
        self.batch_info = None

    def run_lora_a_sgemm(self, x, weights):
        return sgemm_lora_a_fwd(x, weights, self.batch_info)

    def run_lora_b_sgemm(self, x, weights, base_output):
        return sgemm_lora_b_fwd(x, weights, self.batch_info, base_output)

    def init_cuda_graph_batch_info(self, cuda_graph_batch_info, max_bs_in_cuda_graph, num_tokens_per_bs):
        # Initialize seg_lens and seg_indptr for CUDA graph as they remain constant across batches.
        seg_len = num_tokens_per_bs if _variant == "fix" else 1
        cuda_graph_batch_info.seg_lens[:max_bs_in_cuda_graph].fill_(seg_len)
        torch.cumsum(cuda_graph_batch_info.seg_lens[:max_bs_in_cuda_graph], dim=0,
                     out=cuda_graph_batch_info.seg_indptr[1:max_bs_in_cuda_graph + 1])

    def prepare_lora_batch(self, forward_batch, weight_indices, lora_ranks, scalings, batch_info=None):
        weight_indices_tensor = torch.tensor(weight_indices, dtype=torch.int32)
        lora_ranks_tensor = torch.tensor(lora_ranks, dtype=torch.int32)
        scalings_tensor = torch.tensor(scalings, dtype=torch.float64)
        bs = forward_batch.batch_size
        if batch_info is not None:
            assert batch_info.use_cuda_graph
            batch_info.bs = forward_batch.batch_size
            batch_info.num_segments = forward_batch.batch_size
        else:
            is_extend = forward_batch.forward_mode.is_extend()
            max_len = max(forward_batch.extend_seq_lens_cpu) if is_extend else 1
            seg_lens = (forward_batch.extend_seq_lens if is_extend
                        else torch.ones(bs, dtype=torch.int32, device=self.device))
            seg_indptr = torch.zeros((bs + 1,), dtype=torch.int32, device=self.device)
            seg_indptr[1:] = torch.cumsum(seg_lens, dim=0)
            batch_info = LoRABatchInfo(
                bs=bs, num_segments=bs, max_len=max_len, use_cuda_graph=False, seg_lens=seg_lens, seg_indptr=seg_indptr,
                weight_indices=torch.empty((bs,), dtype=torch.int32, device=self.device),
                lora_ranks=torch.empty((self.max_loras_per_batch,), dtype=torch.int32, device=self.device),
                scalings=torch.empty((self.max_loras_per_batch,), dtype=torch.float64, device=self.device))
        batch_info.lora_ranks[:self.max_loras_per_batch].copy_(lora_ranks_tensor.to(self.device))
        batch_info.scalings[:self.max_loras_per_batch].copy_(scalings_tensor.to(self.device))
        batch_info.weight_indices[:bs].copy_(weight_indices_tensor.to(self.device))
        self.batch_info = batch_info


# --- sglang/srt/lora: adapters, memory pool, layers, manager ------------------------------------------------------------

class LoRAAdapter:
    def __init__(self, uid, gen, device, r=MAX_LORA_RANK, alpha=4.0):
        self.uid, self.r, self.scaling = uid, r, alpha / r
        w = lambda *s: randn(*s, gen=gen, device=device, scale=0.7).double()  # noqa: E731
        self.weights = {"up_proj": (w(r, HIDDEN), w(HIDDEN, r)), "down_proj": (w(r, HIDDEN), w(HIDDEN, r))}


class LoRAMemoryPool:
    """GPU slots for the adapters of a batch; slot 0 stays the base model (``uid None``, rank 0)."""

    def __init__(self, max_loras_per_batch, device):
        self.A_buffer = {m: torch.zeros(max_loras_per_batch, MAX_LORA_RANK, HIDDEN, dtype=torch.float64, device=device)
                         for m in ("up_proj", "down_proj")}
        self.B_buffer = {m: torch.zeros(max_loras_per_batch, HIDDEN, MAX_LORA_RANK, dtype=torch.float64, device=device)
                         for m in ("up_proj", "down_proj")}
        self.uid_to_buffer_id = {None: 0}

    def prepare_lora_batch(self, cur_uids, lora_adapters):
        for uid in cur_uids:
            if uid in self.uid_to_buffer_id:
                continue
            slot = len(self.uid_to_buffer_id)
            self.uid_to_buffer_id[uid] = slot
            for module, (a, b) in lora_adapters[uid].weights.items():
                self.A_buffer[module][slot, :a.shape[0]].copy_(a)
                self.B_buffer[module][slot, :, :b.shape[1]].copy_(b)

    def get_buffer_id(self, uid):
        return self.uid_to_buffer_id[uid]


class ColumnParallelLinearWithLoRA:
    def __init__(self, weight, lora_backend):
        self.weight, self.lora_backend = weight, lora_backend

    def set_lora_info(self, A_buffer, B_buffer):
        self.A_buffer, self.B_buffer = A_buffer, B_buffer

    def forward(self, x):
        base_output = x @ self.weight.transpose(0, 1)
        lora_a_output = self.lora_backend.run_lora_a_sgemm(x, self.A_buffer)
        return self.lora_backend.run_lora_b_sgemm(lora_a_output, self.B_buffer, base_output)


class RowParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    pass


class LoRAManager:
    def __init__(self, model, adapters, device):
        self.max_loras_per_batch = MAX_LORAS_PER_BATCH
        self.device = device
        self.lora_backend = TritonLoRABackend(MAX_LORAS_PER_BATCH, device)
        self.loras = adapters
        self.memory_pool = LoRAMemoryPool(MAX_LORAS_PER_BATCH, device)
        self.cuda_graph_batch_info = None
        model.up_proj = ColumnParallelLinearWithLoRA(model.up_proj, self.lora_backend)
        model.down_proj = RowParallelLinearWithLoRA(model.down_proj, self.lora_backend)
        for name in ("up_proj", "down_proj"):
            getattr(model, name).set_lora_info(self.memory_pool.A_buffer[name], self.memory_pool.B_buffer[name])

    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph, num_tokens_per_bs):
        self.max_bs_in_cuda_graph = max_bs_in_cuda_graph
        d = self.device
        self.cuda_graph_batch_info = LoRABatchInfo(
            bs=max_bs_in_cuda_graph, use_cuda_graph=True, num_segments=None,
            seg_lens=torch.zeros(max_bs_in_cuda_graph, dtype=torch.int32, device=d),
            seg_indptr=torch.zeros(max_bs_in_cuda_graph + 1, dtype=torch.int32, device=d),
            max_len=num_tokens_per_bs if _variant == "fix" else 1,
            weight_indices=torch.zeros(max_bs_in_cuda_graph, dtype=torch.int32, device=d),
            permutation=torch.zeros(max_bs_in_cuda_graph, dtype=torch.int32, device=d),
            lora_ranks=torch.zeros(self.max_loras_per_batch, dtype=torch.int32, device=d),
            scalings=torch.zeros(self.max_loras_per_batch, dtype=torch.float64, device=d))
        self.lora_backend.init_cuda_graph_batch_info(cuda_graph_batch_info=self.cuda_graph_batch_info,
                                                     max_bs_in_cuda_graph=max_bs_in_cuda_graph,
                                                     num_tokens_per_bs=num_tokens_per_bs)

    def prepare_lora_batch(self, forward_batch):
        cur_uids = set(forward_batch.lora_ids)
        assert len(cur_uids) <= self.max_loras_per_batch
        self.memory_pool.prepare_lora_batch(cur_uids=cur_uids, lora_adapters=self.loras)
        bs = forward_batch.batch_size
        use_cuda_graph = (hasattr(self, "max_bs_in_cuda_graph") and bs <= self.max_bs_in_cuda_graph
                          and forward_batch.forward_mode.is_cuda_graph())
        weight_indices = [0] * len(forward_batch.lora_ids)
        lora_ranks = [0] * self.max_loras_per_batch
        scalings = [0.0] * self.max_loras_per_batch
        for i, uid in enumerate(forward_batch.lora_ids):
            weight_indices[i] = self.memory_pool.get_buffer_id(uid)
            if uid is not None:
                lora = self.loras[uid]
                lora_ranks[weight_indices[i]] = lora.r
                scalings[weight_indices[i]] = lora.scaling
        self.lora_backend.prepare_lora_batch(forward_batch=forward_batch, weight_indices=weight_indices,
                                             lora_ranks=lora_ranks, scalings=scalings,
                                             batch_info=self.cuda_graph_batch_info if use_cuda_graph else None)


# --- the model (stand-in) and the runners -------------------------------------------------------------------------------

class TinyLoRACausalLM:
    def __init__(self, device):
        gen = generator(12903)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.pos_embed = r(MAX_POSITION, HIDDEN, scale=0.3)
        self.up_proj = r(HIDDEN, HIDDEN)
        self.down_proj = r(HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    def forward(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.pos_embed[positions]
        h = h + self.down_proj.forward(torch.tanh(self.up_proj.forward(h)))
        return h @ self.lm_head


class CudaGraphRunner:
    """TARGET_VERIFY graphs (``num_tokens_per_bs`` tokens per request) for each captured bs, largest first, one pool."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.capture_bs = CUDA_GRAPH_BS
        self.max_bs = max(self.capture_bs)
        self.num_tokens_per_bs = NUM_DRAFT_TOKENS
        max_num_token = self.max_bs * self.num_tokens_per_bs
        self.input_ids = torch.zeros(max_num_token, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_num_token, dtype=torch.int64, device=self.device)
        model_runner.lora_manager.init_cuda_graph_batch_info(self.max_bs, self.num_tokens_per_bs)
        self.graphs, self.outputs = {}, {}
        pool = graph_pool_handle(self.device)
        info = model_runner.lora_manager.cuda_graph_batch_info
        static = {"input_ids": self.input_ids, "positions": self.positions, "lora.seg_lens": info.seg_lens,
                  "lora.seg_indptr": info.seg_indptr, "lora.weight_indices": info.weight_indices,
                  "lora.lora_ranks": info.lora_ranks, "lora.scalings": info.scalings}
        for bs in reversed(self.capture_bs):
            num_tokens = bs * self.num_tokens_per_bs
            forward_batch = ForwardBatch(ForwardMode.TARGET_VERIFY, bs, self.input_ids[:num_tokens],
                                         self.positions[:num_tokens], lora_ids=[None] * bs)
            model_runner.lora_manager.prepare_lora_batch(forward_batch)
            fn = (lambda n=num_tokens: model_runner.model.forward(self.input_ids[:n], self.positions[:n]))
            self.graphs[bs], self.outputs[bs] = capture(fn, device=self.device, pool=pool, name=f"verify bs={bs}",
                                                        owner="CudaGraphRunner", static=static)

    def can_run(self, forward_batch):
        return forward_batch.forward_mode.is_cuda_graph() and forward_batch.batch_size <= self.max_bs

    def replay(self, forward_batch):
        raw_bs = forward_batch.batch_size
        raw_num_token = forward_batch.input_ids.shape[0]
        bs = next(b for b in self.capture_bs if b >= raw_bs)
        self.input_ids[:raw_num_token].copy_(forward_batch.input_ids)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        logits = replay(self.graphs[bs], self.outputs[bs], real=raw_num_token, size=bs * self.num_tokens_per_bs,
                        padded={"input_ids": self.input_ids, "positions": self.positions})
        return logits[:raw_num_token]


class ModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = TinyLoRACausalLM(device)
        gen = generator(129030)
        adapters = {"fr": LoRAAdapter("fr", gen, device), "de": LoRAAdapter("de", gen, device)}
        self.lora_manager = LoRAManager(self.model, adapters, device)
        self.cuda_graph_runner = CudaGraphRunner(self) if use_cuda_graph else None

    def forward(self, forward_batch):
        self.lora_manager.prepare_lora_batch(forward_batch)         # as ForwardBatch.init_new does with --enable-lora
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions)


# --- workload: NGRAM target-verify steps ---------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graph):
        runner = ModelRunner(device, use_cuda_graph)
        requests = {"A": ("fr", 5), "B": (None, 7), "C": ("de", 4)}      # adapter, tokens already in the sequence
        drafts = {"A": [[3, 9, 2], [4, 4, 1], [7, 2, 8], [5, 6, 1]], "B": [[11, 5, 1], [2, 2, 3]],
                  "C": [[8, 0, 13], [6, 1, 9], [2, 12, 4]]}
        schedule = [["A", "B", "C"], ["C", "A"], ["A"], ["B", "C", "A"]]
        seq_len = {n: requests[n][1] for n in requests}
        used = {n: 0 for n in requests}
        outs = []
        for step in schedule:
            ids, pos = [], []
            for name in step:
                ids += drafts[name][used[name]]
                pos += list(range(seq_len[name], seq_len[name] + NUM_DRAFT_TOKENS))
                used[name] += 1
                seq_len[name] += 1                                    # one token accepted per step
            bs = len(step)
            forward_batch = ForwardBatch(
                ForwardMode.TARGET_VERIFY, bs, torch.tensor(ids, dtype=torch.int64).to(device),
                torch.tensor(pos, dtype=torch.int64).to(device), lora_ids=[requests[n][0] for n in step],
                extend_seq_lens=torch.full((bs,), NUM_DRAFT_TOKENS, dtype=torch.int32).to(device),
                extend_seq_lens_cpu=[NUM_DRAFT_TOKENS] * bs)
            outs.append(runner.forward(forward_batch).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
