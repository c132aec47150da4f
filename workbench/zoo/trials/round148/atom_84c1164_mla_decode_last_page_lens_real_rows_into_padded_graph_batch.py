"""ATOM (ROCm/ATOM, AMD's LLM serving engine on AITER kernels) runs decode of a DeepSeek (MLA) model through HIP graphs
captured at fixed batch sizes (``graph_bs``, e.g. 1, 2, 4): ``prepare_decode`` pads a decode batch of ``scheduled_bs``
sequences up to the next captured size ``bs`` and fills the ``forward_vars`` CPU/GPU buffers that the captured step
reads (slot mapping, and for AITER's MLA decode kernel ``kv_indptr``/``kv_indices``/``kv_last_page_lens``). It built
one last-page length per scheduled sequence (``_update_paged_kv_tensors``) and stored that list with
``var["kv_last_page_lens"].np[:bs] = np.array(self.kv_last_page_lens)``: a ``scheduled_bs``-long array written into a
``bs``-row slice. Without graphs (``enforce_eager``) ``bs`` is ``scheduled_bs`` and the line is harmless; with graphs,
any decode batch that is not itself a captured size (3 sequences padded to a graph of 4) makes NumPy refuse the
assignment, and the decode step dies before the graph is replayed. The fix writes the real rows
(``np[:scheduled_bs]``) and zeroes the padded ones (``np[scheduled_bs:bs] = 0``).

Upstream: https://github.com/ROCm/ATOM/commit/84c11644f2095107ae63e7a46bb6ad679774767b ("fix model_runner (#17)",
ROCm/ATOM, author la (junhaha666), co-author amd-ruitang3, committed 2025-10-21 on main; the same diff was also
committed as 0ab11a6c on the branch merged by "Merge pull request #8 from valarLip/ds_comp"). I cite the commit, not
a pull-request URL: the repository's "#8" names two different pull requests in its history, so I could not tell which
pull request "#17" is. Read, in a mirror of the repository: the whole diff (``atom/model_engine/model_runner.py``: the
``kv_last_page_lens`` hunk, the ``vars_used`` copy lengths of ``kv_indices`` (``bs`` -> ``sum(context_lens)``) and
``kv_indptr`` (``bs`` -> ``bs + 1``), and ``capture_cudagraph`` now writing ``cu_seqlens_q = arange`` before capture);
at the parent c18d8cab7: ``ModelRunner`` (``allocate_forward_vars``, ``allocate_kv_cache``, ``prepare_block_tables``,
``prepare_prefill``, ``prepare_decode``, ``_update_paged_kv_tensors``, ``prepare_model``, ``run_model``,
``postprocess``, ``forward``, ``capture_cudagraph``), ``tokenIDProcessor`` (``prepare_input_ids``,
``prepare_sampled_ids``), ``atom/utils/context.py`` (``Context``, ``set_context``/``get_context``/``reset_context``),
``CpuGpuBuffer`` (``atom/utils/__init__.py``), ``MLAAttention`` (``atom/model_ops/attention_mla.py``: ``forward``,
``_forward_prefill``, ``_forward_decode``, ``_aiter_mla_decode_fwd``), and AITER's ``mla_decode_fwd`` of that time
(``aiter/mla.py``: ``bs = qo_indptr.shape[0] - 1``, per-batch KV ranges from ``kv_indptr``). Also read, not modelled:
the later commit db4ecdf6 ("fix kv_indptr", 2025-10-26), which fills padded ``kv_indptr`` entries from
``np[scheduled_bs]`` instead of ``np[bs]``; both variants here keep ``np[bs]`` as 84c11644 left it.
Not read: the scheduler, block manager and sequence classes beyond the fields used, the DeepSeek model file
(``deepseek_v2.py``), ``concat_and_cache_mla``'s kernel, AITER's MLA assembly kernels, any issue or review thread (I
found none; the commit has no description).
Symptom: none reported in words. What the code at the parent does, with graphs and a DeepSeek model, on the first
decode step whose batch is not a captured size and has more than one sequence: ``ValueError: could not broadcast
input array from shape (3,) into shape (4,)`` in ``prepare_decode`` (a batch of one broadcasts silently).
Mechanism: ``bs = next(x for x in self.graph_bs if x >= scheduled_bs)`` pads the decode batch to a captured size;
everything per-row that ``prepare_decode`` writes must then cover ``bs`` rows (``slot_mapping`` is extended with -1,
``kv_indptr`` is extended), but ``kv_last_page_lens`` is a Python list of ``scheduled_bs`` entries written into
``np[:bs]``.
Doctor: padded-shape-mismatch, at prepare_decode. The step runs at the padded size ``bs`` and combines it with a
real-row array of ``scheduled_bs`` entries; ``prepare_decode`` is where the padded size is chosen and the buffer
written, and the function the fix changes.
Fix (upstream): ``var["kv_last_page_lens"].np[:scheduled_bs] = np.array(...)`` and ``np[scheduled_bs:bs] = 0``; the
same commit corrects the copy lengths of ``kv_indices`` and ``kv_indptr`` and writes ``cu_seqlens_q = arange`` before
capture.
Modelled: ``ModelRunner`` with ``allocate_forward_vars``, ``allocate_kv_cache``, ``prepare_block_tables``,
``prepare_prefill``, ``prepare_decode``, ``_update_paged_kv_tensors``, ``prepare_model``, ``run_model``,
``postprocess``, ``forward``, ``capture_cudagraph`` (one eager warmup, then the capture, per size, largest first,
sharing the first graph's pool); ``CpuGpuBuffer.copy_to_gpu``; ``Context``/``set_context``/``get_context``/
``reset_context``; ``tokenIDProcessor.prepare_input_ids``/``prepare_sampled_ids``; ``Sequence``, ``ScheduledBatch``;
``DeepseekV2ForCausalLM`` (``forward``, ``compute_logits``); ``MLAAttention`` (``forward``, ``_forward_prefill``,
``_forward_decode``, ``_aiter_mla_decode_fwd``); ``concat_and_cache_mla``; ``mla_decode_fwd``.
Stand-ins: the copy-length and ``cu_seqlens_q`` hunks of the commit are not graph bugs (the short ``kv_indices``
copy breaks the eager decode as well) and are applied in both variants, so the variants differ only in the
``kv_last_page_lens`` lines. The model is mine: 2 layers of width 16, one MLA head with a latent (compressed KV) of 8,
absorbed projections (``W_UK``, ``W_UV``), a learned position embedding instead of RoPE, RMSNorm, SiLU MLP of 32,
vocabulary 32, float64, greedy sampling (no temperatures, no deferred output: ``is_deferred_out = False``). Prefill
attends in the latent space too (upstream expands with ``kv_b_proj`` and calls ``flash_attn_varlen_func``), with a
block-diagonal causal mask from ``cu_seqlens_q``. ``mla_decode_fwd`` gathers a fixed window of ``MAX_CTX`` pages per
batch entry from ``kv_indptr``/``kv_indices``, takes the length from ``kv_last_page_lens`` (page size 1), ignores
``qo_indptr`` (one query row per entry) and gives zeros for an empty range. Slot -1 (padded rows) writes into spare
rows past the cache, one per row, which nothing reads (``concat_and_cache_mla`` skips them). Positions are
``context_lens`` as the parent writes them. No scheduler or block manager: requests arrive at fixed steps and take
pages from a free list; no ``warmup_model``, no tensor parallelism, no ``graph_capture()`` stream. Linear layers
are a product and a sum (``linear``) rather than a matmul, so that a row's numbers do not depend on the batch's row
count (eager runs 3 rows where the graph runs 4).
Workload: requests A (prompt 4, 6 new tokens) and B (prompt 3, 7 new tokens) are prefilled, decode twice as a batch
of 2 (a captured size), then C (prompt 5, 5 new tokens) is prefilled and the three decode together (3, padded to the
graph of 4) three times, then B and C (A has finished); ``graph_bs`` = [1, 2, 4]. The run without graphs is the
same runner with ``enforce_eager``. Outputs: every step's logits and each request's generated tokens.
Measured: the check printed
  atom_84c1164_mla_decode_last_page_lens_real_rows_into_padded_graph_batch [bug] on cpu: misbehaves (raised
    ValueError: could not broadcast input array from shape (3,) into shape (4,))
  atom_84c1164_mla_decode_last_page_lens_real_rows_into_padded_graph_batch [fix] on cpu: equals eager (max |graph -
    eager| = 0)
In both variants the two batch-of-2 decode steps replay the size-2 graph and agree with eager; the bug dies on
the first batch of 3, the fix replays the size-4 graph for it (three steps) and every logit and token is exact. Both
variants together take about 6 s on the CPU, imports included. Ruff is not installed here; not run.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from workbench.engine import events, graph, new_graph
from workbench.zoo import kit
from workbench.zoo.kit import compare, generator

UPSTREAM = "https://github.com/ROCm/ATOM/commit/84c11644f2095107ae63e7a46bb6ad679774767b"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "prepare_decode"
SYMPTOM = ("with HIP graphs, prepare_decode wrote the scheduled_bs last-page lengths of the MLA decode into the "
           "kv_last_page_lens rows of the padded graph batch, so every decode batch that was not itself a captured "
           "size (3 sequences padded to 4) failed with a NumPy broadcast ValueError")

DTYPE = torch.float64
VOCAB, DIM, KV_LORA, FFN, LAYERS = 32, 16, 8, 32, 2
BLOCK_SIZE = 1                     # AITER MLA requires block size 1
MAX_BS, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS = 4, 16, 16
NUM_BLOCKS = 48
MAX_CTX = MAX_MODEL_LEN            # pages a decode entry may attend to
GRAPH_BS = [1, 2, 4]
_variant = "bug"


# --- atom/utils ----------------------------------------------------------------------------------------------------

class CpuGpuBuffer:
    """Buffer to easily copy tensors between CPU and GPU."""

    def __init__(self, *size: int, dtype: torch.dtype, device: str) -> None:
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu")
        self.gpu = torch.zeros_like(self.cpu, device=device)
        self.np = self.cpu.numpy()

    def copy_to_gpu(self, n: int | None = None) -> Tensor:
        if n is None:
            return self.gpu.copy_(self.cpu)
        return self.gpu[:n].copy_(self.cpu[:n])


@dataclasses.dataclass
class Context:
    is_prefill: bool = False
    batch_size: int = 0
    graph_bs: int = 0
    cu_seqlens_q: Tensor | None = None
    max_seqlen_q: int = 0
    slot_mapping: Tensor | None = None
    context_lens: Tensor | None = None
    block_tables: Tensor | None = None
    max_q_len: int | None = None
    kv_indptr: Tensor | None = None
    kv_indices: Tensor | None = None
    kv_last_page_lens: Tensor | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(is_prefill: bool, batch_size: int, **kwargs) -> None:
    global _CONTEXT
    _CONTEXT = Context(is_prefill, batch_size, **kwargs)


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()


# --- aiter (stand-ins for the kernels) -----------------------------------------------------------------------------

def concat_and_cache_mla(kv_c: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write each token's latent at its slot; slot -1 (a padded row) is skipped (here: a spare row per token)."""
    spare = NUM_BLOCKS * BLOCK_SIZE + torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    kv_cache.index_copy_(0, torch.where(slot_mapping >= 0, slot_mapping, spare), kv_c)


def _softmax_weighted(scores: Tensor, valid: Tensor, values: Tensor) -> Tensor:
    """softmax over the valid entries of each row, times ``values``; a row with none gives zeros."""
    scores = scores.masked_fill(~valid, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(valid, torch.exp(scores - m), torch.zeros_like(scores))
    denom = e.sum(-1, keepdim=True)
    out = (e.unsqueeze(-1) * values).sum(-2)
    return out / torch.where(denom > 0, denom, torch.ones_like(denom))


def mla_decode_fwd(q: Tensor, kv_buffer: Tensor, o: Tensor, qo_indptr: Tensor, kv_indptr: Tensor, kv_indices: Tensor,
                   kv_last_page_lens: Tensor, max_seqlen_q: int, sm_scale: float) -> None:
    bs = qo_indptr.shape[0] - 1
    start, end = kv_indptr[:bs], kv_indptr[1: bs + 1]
    kv_len = (end - start - 1) * BLOCK_SIZE + kv_last_page_lens[:bs]
    ar = torch.arange(MAX_CTX, device=q.device)
    where = (start.long().unsqueeze(1) + ar).clamp(0, kv_indices.shape[0] - 1)
    pages = kv_indices[where].long().clamp(0, NUM_BLOCKS - 1)
    keys = kv_buffer[pages]                                           # [bs, MAX_CTX, KV_LORA]
    valid = ar.unsqueeze(0) < kv_len.unsqueeze(1)
    scores = (q[:bs].unsqueeze(1) * keys).sum(-1) * sm_scale
    o[:bs] = _softmax_weighted(scores, valid, keys)


# --- model (stand-in for atom/models/deepseek_v2.py) ----------------------------------------------------------------

def linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` as a product and a sum: each row's result does not depend on how many rows the batch has."""
    return (x.unsqueeze(-1) * w).sum(-2)


def rms_norm(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class MLAAttention:
    def __init__(self, gen, device):
        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.q_proj, self.kv_a_proj = w(DIM, DIM, scale=DIM ** -0.5), w(DIM, KV_LORA, scale=DIM ** -0.5)
        self.W_UK, self.W_UV = w(DIM, KV_LORA, scale=DIM ** -0.5), w(KV_LORA, DIM, scale=KV_LORA ** -0.5)
        self.o_proj = w(DIM, DIM, scale=DIM ** -0.5)
        self.scale = KV_LORA ** -0.5
        self.kv_cache: Tensor = torch.empty(0)

    def _forward_prefill(self, q: Tensor, kv_c: Tensor, context: Context) -> Tensor:
        n = q.shape[0]
        tok = torch.arange(n, device=q.device)
        seq_of = torch.searchsorted(context.cu_seqlens_q[1:].long(), tok, right=True)
        valid = (seq_of.unsqueeze(1) == seq_of.unsqueeze(0)) & (tok.unsqueeze(0) <= tok.unsqueeze(1))
        scores = (q.unsqueeze(1) * kv_c.unsqueeze(0)).sum(-1) * self.scale
        return _softmax_weighted(scores, valid, kv_c.unsqueeze(0).expand(n, n, KV_LORA))

    def _aiter_mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, max_seqlen_qo, kv_indptr, kv_indices,
                              kv_last_page_lens, sm_scale):
        mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_qo,
                       sm_scale=sm_scale)

    def _forward_decode(self, q: Tensor, kv_cache: Tensor, context: Context) -> Tensor:
        o = torch.empty_like(q)
        self._aiter_mla_decode_fwd(q, kv_cache, o, context.cu_seqlens_q, context.max_q_len, context.kv_indptr,
                                   context.kv_indices, context.kv_last_page_lens, self.scale)
        return o

    def forward(self, x: Tensor) -> Tensor:
        context = get_context()
        q = linear(linear(x, self.q_proj), self.W_UK)           # absorbed query, in the latent space
        kv_c = linear(x, self.kv_a_proj)
        concat_and_cache_mla(kv_c, self.kv_cache, context.slot_mapping.flatten())
        if context.is_prefill:
            lat = self._forward_prefill(q, kv_c, context)
        else:
            lat = self._forward_decode(q, self.kv_cache, context)
        return linear(linear(lat, self.W_UV), self.o_proj)


class DeepseekV2ForCausalLM:
    def __init__(self, device):
        gen = generator(8411)

        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.embed, self.pos_embed = w(VOCAB, DIM, scale=1.0), w(MAX_MODEL_LEN + 1, DIM, scale=0.5)
        self.layers = []
        for _ in range(LAYERS):
            self.layers.append({"attn_norm": 1.0 + w(DIM, scale=0.1), "self_attn": MLAAttention(gen, device),
                                "mlp_norm": 1.0 + w(DIM, scale=0.1), "w1": w(DIM, FFN, scale=DIM ** -0.5),
                                "w2": w(FFN, DIM, scale=FFN ** -0.5)})
        self.norm = 1.0 + w(DIM, scale=0.1)
        self.lm_head = w(DIM, VOCAB, scale=2.0 * DIM ** -0.5)

    def __call__(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        h = self.embed[input_ids.long()] + self.pos_embed[positions.long()]
        for layer in self.layers:
            h = h + layer["self_attn"].forward(rms_norm(h, layer["attn_norm"]))
            h = h + linear(torch.nn.functional.silu(linear(rms_norm(h, layer["mlp_norm"]), layer["w1"])), layer["w2"])
        return h

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return linear(rms_norm(hidden_states, self.norm), self.lm_head)


# --- atom/model_engine ----------------------------------------------------------------------------------------------

class Sequence:
    def __init__(self, seq_id: int, prompt: list[int], max_tokens: int):
        self.id, self.token_ids, self.max_tokens = seq_id, list(prompt), max_tokens
        self.num_prompt_tokens, self.num_cached_tokens = len(prompt), 0
        self.block_table: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * BLOCK_SIZE

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def __getitem__(self, key):
        return self.token_ids[key]


@dataclasses.dataclass
class ScheduledBatch:
    seqs: dict
    num_scheduled_tokens: np.ndarray
    total_tokens_num: int
    total_tokens_num_prefill: int = 0
    total_tokens_num_decode: int = 0
    total_seqs_num: int = 0
    total_seqs_num_prefill: int = 0
    total_seqs_num_decode: int = 0


class tokenIDProcessor:                          # noqa: N801 - upstream's name
    def __init__(self, max_num_batched_tokens: int, device: str):
        self.is_deferred_out = False
        self.input_ids = CpuGpuBuffer(max_num_batched_tokens, dtype=torch.int32, device=device)

    def prepare_input_ids(self, batch: ScheduledBatch) -> Tensor:
        seqs = list(batch.seqs.values())
        start_loc = 0
        for seq, n in zip(seqs[:batch.total_seqs_num_prefill], batch.num_scheduled_tokens):
            self.input_ids.np[start_loc: start_loc + n] = seq[seq.num_cached_tokens:]
            start_loc += n
        if batch.total_seqs_num_prefill > 0:
            return self.input_ids.copy_to_gpu(batch.total_tokens_num_prefill)
        self.input_ids.np[: batch.total_tokens_num_decode] = [seq[-1] for seq in seqs]
        return self.input_ids.copy_to_gpu(batch.total_tokens_num_decode)

    def prepare_sampled_ids(self, batch: ScheduledBatch, sampled_token_ids: Tensor) -> dict[int, int]:
        return dict(zip(batch.seqs.keys(), sampled_token_ids.tolist()))


class ModelRunner:
    def __init__(self, device: str, enforce_eager: bool):
        self.device, self.enforce_eager, self.block_size = device, enforce_eager, BLOCK_SIZE
        self.model = DeepseekV2ForCausalLM(device)
        self.tokenID_processor = tokenIDProcessor(MAX_NUM_BATCHED_TOKENS, device)
        self.allocate_forward_vars()
        self.allocate_kv_cache()
        self.graph_bs = list(GRAPH_BS)
        if not enforce_eager:
            self.capture_cudagraph()

    def allocate_forward_vars(self):
        max_bs, max_num_blocks = MAX_BS, (MAX_MODEL_LEN + self.block_size - 1) // self.block_size
        i64 = {"dtype": torch.int64, "device": self.device}
        i32 = {"dtype": torch.int32, "device": self.device}
        self.forward_vars = {
            "input_ids": self.tokenID_processor.input_ids,
            "positions": CpuGpuBuffer(MAX_NUM_BATCHED_TOKENS, **i64),
            "slot_mapping": CpuGpuBuffer(MAX_NUM_BATCHED_TOKENS, **i64),
            "context_lens": CpuGpuBuffer(max_bs, **i32),
            "block_tables": CpuGpuBuffer(max_bs, max_num_blocks, **i32),
            "cu_seqlens_q": CpuGpuBuffer(max_bs + 1, **i32),
            "kv_indptr": CpuGpuBuffer(max_bs + 1, **i32),
            "kv_indices": CpuGpuBuffer(max_bs * max_num_blocks, **i32),
            "kv_last_page_lens": CpuGpuBuffer(max_bs, **i32),
            "outputs": torch.zeros(max_bs, DIM, dtype=DTYPE, device=self.device),
        }
        self.forward_vars["cu_seqlens_q"].cpu.copy_(torch.arange(0, max_bs + 1, dtype=torch.int32))
        self.forward_vars["cu_seqlens_q"].copy_to_gpu()
        self.forward_vars["kv_last_page_lens"].cpu.fill_(1)
        self.forward_vars["kv_last_page_lens"].copy_to_gpu()

    def allocate_kv_cache(self):
        # [layer, slots (+ one spare row per token for slot -1), kv_lora_rank]
        self.kv_cache = torch.zeros(LAYERS, NUM_BLOCKS * self.block_size + MAX_NUM_BATCHED_TOKENS, KV_LORA,
                                    dtype=DTYPE, device=self.device)
        for layer_id, layer in enumerate(self.model.layers):
            layer["self_attn"].kv_cache = self.kv_cache[layer_id]

    def prepare_block_tables(self, seqs: list[Sequence]):
        block_tables = self.forward_vars["block_tables"].np
        for i, seq in enumerate(seqs):
            block_tables[i] = 0
            block_tables[i, : seq.num_blocks] = seq.block_table

    def prepare_prefill(self, batch: ScheduledBatch):
        bs, var = batch.total_seqs_num_prefill, self.forward_vars
        positions, slot_mapping, max_seqlen_q = [], [], 0
        for seq in list(batch.seqs.values())[:bs]:
            positions.extend(range(seq.num_cached_tokens, seq.num_tokens))
            max_seqlen_q = max(max_seqlen_q, seq.num_tokens - seq.num_cached_tokens)
            for i in range(seq.num_cached_tokens, seq.num_blocks):
                start = seq.block_table[i] * self.block_size
                end = start + (self.block_size if i != seq.num_blocks - 1 else seq.last_block_num_tokens)
                slot_mapping.extend(range(start, end))
        var["positions"].np[: batch.total_tokens_num_prefill] = positions
        var["slot_mapping"].np[: len(slot_mapping)] = slot_mapping
        vars_used = [("block_tables", bs), ("cu_seqlens_q", bs + 1), ("slot_mapping", len(slot_mapping))]
        ctx = {el: var[el].copy_to_gpu(num) for el, num in vars_used}
        set_context(True, batch_size=bs, max_seqlen_q=max_seqlen_q, **ctx)
        return var["positions"].copy_to_gpu(batch.total_tokens_num_prefill)

    def prepare_decode(self, batch: ScheduledBatch):
        scheduled_bs = batch.total_seqs_num_decode
        seqs = list(batch.seqs.values())[batch.total_seqs_num_prefill:]
        assert len(seqs) == scheduled_bs
        bs = scheduled_bs if self.enforce_eager else next(x for x in self.graph_bs if x >= scheduled_bs)
        assert bs >= scheduled_bs, f"current decode {scheduled_bs=} > max graph_bs{bs}"
        self.total_blocks = 0

        context_lens = [seq.num_tokens for seq in seqs]
        positions = context_lens
        slot_mapping = [seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1 for seq in seqs]
        slot_mapping.extend([-1] * (bs - scheduled_bs))

        self.kv_indices: list[int] = []
        self.kv_indptr: list[int] = [0]
        self.kv_last_page_lens: list[int] = []
        for seq in seqs:
            self._update_paged_kv_tensors(seq.block_table, seq.num_tokens)
        self.prepare_block_tables(seqs)

        sum_scheduled_tokens = batch.total_tokens_num_decode
        var = self.forward_vars
        var["slot_mapping"].np[:bs] = slot_mapping
        var["positions"].np[:sum_scheduled_tokens] = positions
        var["context_lens"].np[:scheduled_bs] = context_lens

        # extend to the maximum number of blocks as returned by the scheduler
        self.kv_indices.extend([0] * (self.total_blocks - len(self.kv_indices)))
        var["kv_indices"].np[: self.total_blocks] = np.array(self.kv_indices, dtype=np.int64)
        var["kv_indptr"].np[: scheduled_bs + 1] = np.array(self.kv_indptr, dtype=np.int64)
        var["kv_indptr"].np[scheduled_bs + 1: bs + 1] = var["kv_indptr"].np[bs]
        if _variant == "fix":
            var["kv_last_page_lens"].np[:scheduled_bs] = np.array(self.kv_last_page_lens, dtype=np.int64)
            var["kv_last_page_lens"].np[scheduled_bs:bs] = 0
        else:       # the real rows' list written into the padded batch's rows
            var["kv_last_page_lens"].np[:bs] = np.array(self.kv_last_page_lens, dtype=np.int64)
        vars_used = [
            ("slot_mapping", bs),
            ("context_lens", bs),
            ("block_tables", bs),
            ("cu_seqlens_q", bs + 1),
            ("kv_indices", sum(context_lens)),
            ("kv_indptr", bs + 1),
            ("kv_last_page_lens", bs),
        ]
        ctx = {el: var[el].copy_to_gpu(num) for el, num in vars_used}
        set_context(False, batch_size=scheduled_bs, graph_bs=bs, max_q_len=1, **ctx)
        return var["positions"].copy_to_gpu(sum_scheduled_tokens)

    def _update_paged_kv_tensors(self, block_table: list[int], seq_len: int):
        self.total_blocks += len(block_table)
        block_table_bound = (seq_len // self.block_size + 1 if seq_len % self.block_size != 0
                             else seq_len // self.block_size)
        self.kv_indices.extend(block_table[:block_table_bound])
        self.kv_indptr.append(self.kv_indptr[-1] + block_table_bound)
        last_page_len = seq_len % self.block_size
        if last_page_len == 0:
            last_page_len = self.block_size
        self.kv_last_page_lens.append(last_page_len)

    def prepare_model(self, batch: ScheduledBatch):
        bs = batch.total_seqs_num
        self.forward_vars["cu_seqlens_q"].np[1: bs + 1] = np.cumsum(batch.num_scheduled_tokens)
        input_ids = self.tokenID_processor.prepare_input_ids(batch)
        prepare_func = self.prepare_prefill if batch.total_tokens_num_prefill > 0 else self.prepare_decode
        positions = prepare_func(batch)
        return input_ids, positions

    def run_model(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        ctx = get_context()
        bs = ctx.batch_size
        if ctx.is_prefill or self.enforce_eager or bs > self.graph_bs[-1]:
            hidden_states = self.model(input_ids, positions)
        else:
            graph_bs = ctx.graph_bs
            var = self.forward_vars
            outputs = kit.replay(self.graphs[graph_bs], var["outputs"][:graph_bs], real=bs, size=graph_bs,
                                 padded={"input_ids": var["input_ids"].gpu, "positions": var["positions"].gpu})
            hidden_states = outputs[:bs]
        return self.model.compute_logits(hidden_states)

    def postprocess(self, batch: ScheduledBatch, logits: Tensor) -> dict[int, int]:
        sampled_tokens = logits.argmax(-1)                     # greedy sampler
        return self.tokenID_processor.prepare_sampled_ids(batch, sampled_tokens)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch):
        input_ids, positions = self.prepare_model(batch)
        logits = self.run_model(input_ids, positions)
        reset_context()
        return self.postprocess(batch, logits), logits

    @torch.inference_mode()
    def capture_cudagraph(self):
        var = self.forward_vars
        input_ids, positions = var["input_ids"].gpu, var["positions"].gpu
        slot_mapping, context_lens = var["slot_mapping"].gpu, var["context_lens"].gpu
        block_tables, cu_seqlens_q = var["block_tables"].gpu, var["cu_seqlens_q"].gpu
        kv_indptr, kv_indices, kv_last_page_lens = var["kv_indptr"].gpu, var["kv_indices"].gpu, \
            var["kv_last_page_lens"].gpu
        outputs = var["outputs"]
        events.static_buffers("ATOM ModelRunner forward_vars", {
            "input_ids": input_ids, "positions": positions, "slot_mapping": slot_mapping,
            "kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_last_page_lens": kv_last_page_lens})
        events.persistent_state("ATOM ModelRunner", {"kv_cache": self.kv_cache})

        self.graph_bs.sort(reverse=True)
        self.graphs: dict = {}
        self.graph_pool = None
        for bs in self.graph_bs:
            def step(bs=bs):
                outputs[:bs] = self.model(input_ids[:bs], positions[:bs])
                return outputs[:bs]
            set_context(False, batch_size=bs, slot_mapping=slot_mapping[:bs], context_lens=context_lens[:bs],
                        block_tables=block_tables[:bs], max_q_len=1, cu_seqlens_q=cu_seqlens_q[: bs + 1],
                        kv_indptr=kv_indptr[: bs + 1], kv_indices=kv_indices[:],
                        kv_last_page_lens=kv_last_page_lens[:bs])
            with events.warmup():
                step()                                                     # warmup
            g = new_graph(self.device)
            with graph(g, pool=self.graph_pool, name=f"decode bs={bs}"):
                step()                                                     # capture
            kit.remember_step(g, step)
            if self.graph_pool is None:
                self.graph_pool = g.pool()
            self.graphs[bs] = g
            reset_context()
        self.graph_bs.sort(reverse=False)


# --- workload -------------------------------------------------------------------------------------------------------

REQUESTS = {  # id: (arrives before decode step, prompt, new tokens)
    0: (0, [3, 17, 8, 25], 6),
    1: (0, [11, 4, 29], 7),
    2: (2, [7, 7, 19, 2, 30], 5),
}


def serve(device: str, enforce_eager: bool) -> list[Tensor]:
    runner = ModelRunner(device, enforce_eager)
    free_pages = list(range(NUM_BLOCKS))
    running: dict[int, Sequence] = {}
    finished: dict[int, Sequence] = {}
    results: list[Tensor] = []

    def allocate(seq: Sequence):
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(free_pages.pop(0))

    def run(seqs: list[Sequence], prefill: bool):
        for seq in seqs:
            allocate(seq)
        n = [seq.num_tokens - seq.num_cached_tokens for seq in seqs] if prefill else [1] * len(seqs)
        batch = ScheduledBatch(seqs={s.id: s for s in seqs}, num_scheduled_tokens=np.array(n, dtype=np.int32),
                               total_tokens_num=sum(n), total_seqs_num=len(seqs))
        if prefill:
            batch.total_tokens_num_prefill, batch.total_seqs_num_prefill = sum(n), len(seqs)
        else:
            batch.total_tokens_num_decode, batch.total_seqs_num_decode = sum(n), len(seqs)
        token_ids, logits = runner.forward(batch)
        results.append(logits.clone())
        for seq in seqs:
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(token_ids[seq.id])
            if seq.num_completion_tokens >= seq.max_tokens:
                finished[seq.id] = running.pop(seq.id)

    step = 0
    while step == 0 or running:
        arriving = [Sequence(i, p, m) for i, (at, p, m) in REQUESTS.items() if at == step and i not in running]
        if arriving:
            running.update({s.id: s for s in arriving})
            run(arriving, prefill=True)
        if running:
            run(list(running.values()), prefill=False)
        step += 1
    tokens = [torch.tensor(finished[i].token_ids[len(REQUESTS[i][1]):], dtype=DTYPE) for i in sorted(finished)]
    return results + tokens


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, enforce_eager=False), lambda: serve(device, enforce_eager=True))
