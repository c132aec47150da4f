"""Tokasaurus (a small LLM inference engine from Stanford's Scaling Intelligence lab) runs tensor parallelism with its
token rows sharded over the ranks: each rank embeds its slice of the batch, and every attention, MLP and lm-head step
all-gathers the ranks' rows (in rank order) before working on the whole batch, then reduce-scatters back. For TP the
worker pads a batch to a multiple of ``tp_size`` (``make_input_batch_state``) and slices the token-row tensors per rank
(``tp_slice``); position ids, the attention metadata and the KV append slots stay global. Decode batches are replayed
in a CUDA graph captured for the next larger size (``ModelRunner.match_to_graph``), whose per-rank static buffers hold
``graph_size / tp_size`` token rows. Before the fix the batch was padded only to the TP multiple, not to the graph's
size: ``CUDAGraphInfo.copy_into_input_batch_state`` copied each rank's few token rows into the front of its buffer,
but the graph's all-gather lays the rows out by the graph's size (rank 0's buffer, then rank 1's), while positions,
sequences (decode metadata), KV append slots and the lm-head indices keep the real tokens at rows ``0 .. B-1``. With
B = 2 real tokens in the graph of 4 (tp 2), the gathered row 1, which the metadata takes for the second sequence, is
rank 0's stale padding row, and that sequence's own token sits at row 2, which the metadata takes for a padded
sequence. The second sequence then gets the token computed from the stale row and its KV slot gets that row's keys. The
fix pads the batch to the matched graph's size before slicing (``ModelRunner.calc_padding``), so every tensor the
graph reads has the graph's rows and the layouts agree.

Upstream: https://github.com/ScalingIntelligence/tokasaurus/commit/1a116e9a1c31b22a5e81cfe46f43696d1957a3e1 ("bugfix
padding with tp + cudagraph, edge case recompiles after warmup", repository ScalingIntelligence/tokasaurus, author
Jordan Benjamin, 2025-06-29), a direct commit on ``main`` (parent c01e494; no pull request or issue that I found).
Read, in a mirror of the repository: the whole diff of 1a116e9 (``model/utils.py``, ``model/basic_worker.py``,
``model/llama.py``, ``model/pipeline_worker.py``, ``model/types.py``, ``manager/input_building.py``); at its parent:
``model/utils.py`` (``tp_slice``, ``pad_and_slice_tensor``, ``make_input_batch_state``,
``add_decoding_ids_to_batch_state``, ``make_model``'s extra KV page for graphs, ``CUDAGraphInfo`` with
``copy_into_input_batch_state``/``run``/``plan``, ``create_cudagraph``, ``ModelRunner``, ``setup_and_run_loop``,
``unpad_output_batch_state``), all of ``model/basic_worker.py`` (``basic_model_loop``'s preprocess / run_model /
synchronize / postprocess), ``model/llama.py`` (``all_gather``, ``reduce_scatter``, ``LlamaAttention.make_attn_fn``
with its ``num_padding`` handling and capture assert, ``LlamaAttention.forward``, ``calc_tokens_and_logprobs``,
``LlamaLMHead``, ``LlamaEmbeddings``, ``LlamaModel.forward``, ``LlamaForCausalLM.forward``/``plan``/``setup_caches``),
``model/types.py`` (``PageInformation.pad_for_cudagraph``, the builders, ``AttentionInfo``, ``BatchSamplingParams``,
``ModelInput``, ``BatchState``), ``model/attention_utils.py`` (``create_wrappers_for_cudagraph``,
``append_to_kv_cache``, ``tokasaurus_attention`` up to the decode call), ``model/kv_cache.py`` (``LayerKVCache``),
``manager/input_building.py`` (``make_dummy_batch``, ``calc_kv_token_indices``, ``seqs_to_input``) and the
cudagraph fields of ``common_types.ServerConfig`` (``cudagraph_max_size`` 128, ``cudagraph_step`` 16).
Not read: FlashInfer's wrappers and kernels (what ``plan`` does with ``use_cuda_graph`` is from my memory of its API:
a fixed batch size and copies into the given buffers); the manager's scheduler and page allocator;
``run_overlapped_loop``; the pipeline-parallel worker beyond the diff; hydragen; torch.compile/async-TP paths; the
tests (moved in by the next commit). No issue, PR discussion or user report exists that I could find.
Symptom: none reported in words; the commit title says "bugfix padding with tp + cudagraph". What a user sees is my
reading of the code: with ``tp_size > 1`` and CUDA graphs on, a decode batch whose TP-padded size is smaller than its
graph (e.g. 5 sequences with tp 2 in the graph of 16) returns wrong tokens and log-probabilities for sequences past
the first rank's share, and writes wrong keys into their KV slots, silently; with tp 1 or an exact size it is right.
Mechanism: ``make_input_batch_state`` pads position ids, lm-head indices and sampling parameters only to a multiple of
``tp_size`` and slices the lm-head indices per rank; ``add_decoding_ids_to_batch_state`` does the same for the token
ids. ``copy_into`` writes ``src.shape[0]`` rows at the front of each static buffer. In the graph, rank r's token rows
occupy gathered rows ``r * G/tp ..``, but ``position_ids``, ``append_kv_token_indices``, the decode wrapper's
per-sequence metadata (padded by ``pad_for_cudagraph``) and the lm-head indices count the real tokens as rows
``0 .. B-1``. Here (B = 2, G = 4, tp 2) gathered row 1 is rank 0's stale row (the previous step's second token) but
gets sequence B's position, pages and KV slot; B's real token (row 2) is treated as a padded sequence and appends to
the dummy page; rank 0's stale lm-head index picks row 1, and ``run``'s ``output_ids[:batch_size]`` hands out rank 0's
two results. Without graphs (``use_cudagraphs`` off, or prefill) the batch has exactly the TP-padded rows and the
layouts agree.
Doctor: padded-shape-mismatch, at ``make_input_batch_state``: the graph, run at its padded size, combines tensors
padded in two layouts: the token rows padded per rank at the end of each rank's slice, and the global metadata (real
rows first, padding at the end); a real row of one meets a padded row of the other. (Writing zeros into the rows the
copy leaves would not fix it: the rows would still be paired wrongly; so not stale-input.) ``make_input_batch_state``
is where the padding is decided (to a TP multiple instead of the graph's size), and the function the fix changes.
Fix (upstream): ``ModelRunner.calc_padding`` returns the padding to the matched graph's size (else the TP padding);
``make_input_batch_state`` takes ``num_total_padding``/``num_lm_head_padding`` and pads position ids, lm-head indices
and sampling parameters by them (keeping ``raw_lm_head_indices``); ``add_decoding_ids_to_batch_state`` pads the
token ids by ``num_total_padding`` before ``tp_slice``; ``copy_into_input_batch_state`` offsets lm-head indices by
the remaining per-device padding (zero here); ``CUDAGraphInfo.run`` returns whole outputs and
``unpad_output_batch_state`` cuts them to ``model_input.num_lm_head_tokens()``. The same commit adds warmup shapes
(size 1, prefill with an lm-head token) and a ``clone`` in ``tp_slice`` against torch.compile recompiles, and
refactors ``LlamaForCausalLM.set_attention_info``: not graph defects, not modelled (the clone is kept).
Modelled: ``ServerConfig``, ``PageInformation``(``Builder``) with ``pad_for_cudagraph``, ``AttentionInfo``(``Builder``),
``BatchSamplingParams``(``Builder``), ``ModelInput``, ``BatchState``, ``make_dummy_batch``, ``calc_kv_token_indices``,
``seqs_to_input``, ``tp_slice``, ``pad_and_slice_tensor``, ``make_input_batch_state``,
``add_decoding_ids_to_batch_state``, ``move_batch_state``, ``unpad_output_batch_state``, ``append_to_kv_cache``,
``tokasaurus_attention``, ``all_gather``, ``reduce_scatter``, ``LlamaAttention`` (``attn_fn`` with ``num_padding``),
``LlamaMLP``, ``calc_tokens_and_logprobs``, ``LlamaLMHead``, ``LlamaForCausalLM`` (``forward``, ``plan``,
``set_wrappers``), ``CUDAGraphInfo`` (``copy_into_input_batch_state``, ``plan``, ``run``), ``create_cudagraph`` (three
warmups, then capture), ``ModelRunner`` (``run_default``, ``plan_default``, ``match_to_graph``,
``match_state_to_graph``, ``calc_padding``, ``plan``, ``run``, ``record_graphs``), ``basic_model_loop``'s steps
(``BasicWorkers.preprocess``/``run_model``, ``batch_index_to_last_token``).
Stand-ins: the TP group runs in one process: every module holds each rank's shard, a loop over ranks stands for the
rank processes, ``all_gather`` is a concatenation and ``reduce_scatter`` a sum split in row blocks, and one graph
captures all ranks' step (upstream: one graph per rank process, NCCL collectives inside); each rank still has its own
batch states, static buffers, wrappers and KV cache. FlashInfer's decode/prefill wrappers are mine: paged attention
over a fixed window of 4 pages (masked by each sequence's length), ``plan`` copying into the graph's buffers (zeroed at
creation; upstream ``torch.empty``); the decode ``run`` returns no LSE. ``sample_from_probs`` takes the most probable
token (upstream: FlashInfer sampling with ``torch.rand`` uniforms), so only the log-probabilities see the
temperatures. The captured callable first points the layers at the graph's own attention info and wrappers (what
``create_cudagraph``'s ``plan`` did before the capture). ``unpad_output_batch_state`` takes both the input state (before
the fix) and the model input (the fix). No pipeline parallelism, hydragen, top-p, torch.compile, warmup batches or
overlapped loop; the manager is ``seqs_to_input`` over whole prompts and a fixed schedule with preallocated pages.
float64 (upstream: bf16 model, fp32 sampling); the model: 2 layers, width 16, 2 heads of 8 (one per rank), SiLU MLP
of 32, vocabulary 24, RMSNorm, RoPE; tp 2, page size 4, graph sizes 4 (``cudagraph_max_size`` = ``cudagraph_step`` =
4); the run without graphs is the same server with ``use_cudagraphs`` off (no dummy page).
Workload: four requests (prompts of 5, 3, 6, 4 tokens; A and C greedy, B at temperature 0.5, D at 0.8) prefilled in one
eager batch, two decode steps of 4 (exactly the graph), D done: one of 3 (TP-padded to 4, still exact), C done: two
steps of 2 in the graph of 4. Outputs: rank 0's tokens and log-probabilities of each step, and every rank's and
layer's K and V caches (the real pages).
Measured: the check printed
  tokasaurus_1a116e9_tp_cudagraph_decode_not_padded_to_graph_size [bug] on cpu: misbehaves
      (max |graph - eager| = 14)
  tokasaurus_1a116e9_tp_cudagraph_decode_not_padded_to_graph_size [fix] on cpu: equals eager
      (max |graph - eager| = 0)
The first four steps agree; at the first step of 2, B gets token 14 (its previous token, from the stale row) instead
of 0 (log-probability -0.281 against -0.655); at the next, the same token 22 but -0.942 against -0.633; all eight
caches differ (up to 4.08). About 2.2 s (bug) and 1.1 s (fix) on the CPU, each with its run without graphs.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/ScalingIntelligence/tokasaurus/commit/1a116e9a1c31b22a5e81cfe46f43696d1957a3e1"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "make_input_batch_state"
SYMPTOM = ("with tensor parallelism and CUDA graphs, a decode batch smaller than its graph was padded only to a "
           "multiple of tp_size: the graph's all-gather lays each rank's token rows out at the graph's size, so real "
           "positions, sequences, KV slots and lm-head slots met other (stale) token rows, and a sequence got a token "
           "and KV computed from the wrong row")

DTYPE = torch.float64
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, INTERMEDIATE, NUM_LAYERS = 24, 16, 2, 8, 32, 2
TP_SIZE = 2
ROPE_THETA, RMS_EPS, MAX_POSITION = 10000.0, 1e-5, 32
MAX_KV_PAGES_PER_SEQ = 4          # the kernels' static key window: 4 pages of 4 tokens
_variant = "bug"


@dataclasses.dataclass
class ServerConfig:
    page_size: int = 4
    kv_cache_num_tokens: int = 40
    tp_size: int = TP_SIZE
    use_cudagraphs: bool = True
    cudagraph_max_size: int = 4
    cudagraph_step: int = 4
    cudagraph_max_kv_indices_per_seq: int = MAX_KV_PAGES_PER_SEQ
    max_batch_index: int = 8

    def kv_cache_num_blocks(self) -> int:
        assert self.kv_cache_num_tokens % self.page_size == 0
        return self.kv_cache_num_tokens // self.page_size


# --- model/types.py ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PageInformation:
    qo_indptr: Tensor | None
    kv_indptr: Tensor
    kv_indices: Tensor
    kv_last_page_len: Tensor
    num_seqs: int
    num_tokens: int

    def to(self, device) -> PageInformation:
        return dataclasses.replace(
            self, qo_indptr=None if self.qo_indptr is None else self.qo_indptr.to(device),
            kv_indptr=self.kv_indptr.to(device), kv_indices=self.kv_indices.to(device),
            kv_last_page_len=self.kv_last_page_len.to(device))

    def pad_for_cudagraph(self, num_seqs: int) -> None:
        assert self.num_seqs <= num_seqs
        if self.num_seqs == num_seqs:
            return
        assert self.qo_indptr is None, "cudagraphs are for decode only"
        num_to_pad = num_seqs - self.num_seqs
        self.kv_indices = F.pad(self.kv_indices, (0, num_to_pad), value=0)
        self.kv_indptr = torch.cat([self.kv_indptr, self.kv_indptr[-1] + torch.arange(
            1, num_to_pad + 1, dtype=self.kv_indptr.dtype, device=self.kv_indptr.device)])
        self.kv_last_page_len = F.pad(self.kv_last_page_len, (0, num_to_pad), value=1)


@dataclasses.dataclass
class PageInformationBuilder:
    qo_indptr: list = dataclasses.field(default_factory=lambda: [0])
    kv_indptr: list = dataclasses.field(default_factory=lambda: [0])
    kv_indices: list = dataclasses.field(default_factory=list)
    kv_last_page_len: list = dataclasses.field(default_factory=list)
    num_seqs: int = 0
    num_tokens: int = 0

    def add_sequence(self, kv_indices: list[int], kv_seq_len: int, num_qtokens: int, page_size: int) -> None:
        self.qo_indptr.append(self.qo_indptr[-1] + num_qtokens)
        sliced_kv_indices = kv_indices[:math.ceil(kv_seq_len / page_size)]
        self.kv_indices.extend(sliced_kv_indices)
        self.kv_indptr.append(self.kv_indptr[-1] + len(sliced_kv_indices))
        last_page_len = kv_seq_len % page_size
        self.kv_last_page_len.append(page_size if last_page_len == 0 else last_page_len)
        self.num_seqs += 1
        self.num_tokens += num_qtokens

    def build(self, skip_qo_indptr: bool = False) -> PageInformation:
        return PageInformation(
            qo_indptr=None if skip_qo_indptr else torch.tensor(self.qo_indptr, dtype=torch.int32),
            kv_indptr=torch.tensor(self.kv_indptr, dtype=torch.int32),
            kv_indices=torch.tensor(self.kv_indices, dtype=torch.int32),
            kv_last_page_len=torch.tensor(self.kv_last_page_len, dtype=torch.int32),
            num_seqs=self.num_seqs, num_tokens=self.num_tokens)


@dataclasses.dataclass
class AttentionInfo:
    page_size: int
    append_kv_token_indices: Tensor
    prefill_info: PageInformation
    decode_info: PageInformation
    num_padding: int = 0                # to make batches that are a tp-sized multiple for tensor parallelism

    def split_q(self, q: Tensor) -> tuple[Tensor, Tensor]:
        prefill_q = q[:self.prefill_info.num_tokens]
        decode_q = q[self.prefill_info.num_tokens:]
        assert len(decode_q) == self.decode_info.num_tokens, (len(decode_q), self.decode_info.num_tokens)
        return prefill_q, decode_q

    def to(self, device) -> AttentionInfo:
        return dataclasses.replace(self, append_kv_token_indices=self.append_kv_token_indices.to(device),
                                   prefill_info=self.prefill_info.to(device), decode_info=self.decode_info.to(device))


@dataclasses.dataclass
class AttentionInfoBuilder:
    page_size: int
    append_kv_token_indices: list[int]
    prefill_builder: PageInformationBuilder
    decode_builder: PageInformationBuilder
    num_padding: int = 0

    def build(self) -> AttentionInfo:
        return AttentionInfo(page_size=self.page_size,
                             append_kv_token_indices=torch.tensor(self.append_kv_token_indices, dtype=torch.long),
                             prefill_info=self.prefill_builder.build(),
                             decode_info=self.decode_builder.build(skip_qo_indptr=True), num_padding=self.num_padding)


@dataclasses.dataclass
class BatchSamplingParams:
    temperature: Tensor | None = None
    greedy_mask: Tensor | None = None

    def to(self, device) -> BatchSamplingParams:
        return BatchSamplingParams(temperature=self.temperature.to(device), greedy_mask=self.greedy_mask.to(device))


@dataclasses.dataclass
class BatchSamplingParamsBuilder:
    temperature: list = dataclasses.field(default_factory=list)
    greedy_mask: list = dataclasses.field(default_factory=list)

    def add_sequence(self, temperature: float) -> None:
        greedy = temperature == 0.0
        self.greedy_mask.append(greedy)
        self.temperature.append(1.0 if greedy else temperature)   # no division by a zero temperature

    def build(self) -> BatchSamplingParams:
        return BatchSamplingParams(temperature=torch.tensor(self.temperature, dtype=DTYPE),
                                   greedy_mask=torch.tensor(self.greedy_mask, dtype=torch.bool))


@dataclasses.dataclass
class ModelInput:
    attention_info_builder: AttentionInfoBuilder
    prefill_input_ids: list[int]
    batch_indices: list[int]
    lm_head_indices: list[int]
    sampling_builder: BatchSamplingParamsBuilder
    position_ids: list[int]
    schedule_id: str

    def build_attention_info(self) -> AttentionInfo:
        return self.attention_info_builder.build()

    def build_sampling_params(self) -> BatchSamplingParams:
        return self.sampling_builder.build()

    def decode_start_pos(self) -> int:
        return len(self.prefill_input_ids)

    def num_prefill_tokens(self) -> int:
        return len(self.prefill_input_ids)

    def num_decode_tokens(self) -> int:
        return len(self.batch_indices) - self.num_prefill_tokens()

    def num_lm_head_tokens(self) -> int:
        return len(self.lm_head_indices)


@dataclasses.dataclass
class BatchState:
    position_ids: Tensor
    attention_info: AttentionInfo
    sampling_params: BatchSamplingParams | None = None
    input_ids: Tensor | None = None
    prefill_input_ids: Tensor | None = None
    lm_head_indices: Tensor | None = None
    hidden_states: Tensor | None = None
    output_ids: Tensor | None = None
    logprobs: Tensor | None = None
    position_embeddings: tuple[Tensor, Tensor] | None = None
    lm_head_indices_padding: int = 0          # before the fix
    num_total_padding: int = 0                # the fix
    num_lm_head_padding: int = 0              # the fix
    raw_lm_head_indices: Tensor | None = None   # the unpadded lm_head_indices, to update the last-token map


# --- manager/input_building.py ------------------------------------------------------------------------------------

def calc_kv_token_indices(kv_block_indices: list[int], page_size: int, start_idx: int, num_tokens: int) -> list[int]:
    return [kv_block_indices[pos // page_size] * page_size + pos % page_size
            for pos in range(start_idx, start_idx + num_tokens)]


def make_dummy_batch(config: ServerConfig, prefill_tokens: int, decode_tokens: int) -> ModelInput:
    page_size = config.page_size
    decode_builder, sampling_builder = PageInformationBuilder(), BatchSamplingParamsBuilder()
    append_kv_token_indices = []
    assert prefill_tokens == 0          # (only the decode-only dummy batches of create_cudagraph are modelled)
    for _ in range(decode_tokens):
        decode_builder.add_sequence(kv_indices=[0], kv_seq_len=1, num_qtokens=1, page_size=page_size)
        append_kv_token_indices.extend(calc_kv_token_indices([0], page_size, 0, 1))
        sampling_builder.add_sequence(temperature=0.5)
    return ModelInput(
        attention_info_builder=AttentionInfoBuilder(page_size, append_kv_token_indices, PageInformationBuilder(),
                                                    decode_builder),
        prefill_input_ids=[], batch_indices=[0] * decode_tokens, lm_head_indices=list(range(decode_tokens)),
        sampling_builder=sampling_builder, position_ids=[0] * decode_tokens, schedule_id="dummy_batch")


@dataclasses.dataclass
class Sequence:
    id: str
    input_ids: list[int]
    kv_indices: list[int]
    batch_index: int
    temperature: float
    completion_scheduled: int = 0

    def prompt_total(self) -> int:
        return len(self.input_ids)

    def total_scheduled(self) -> int:
        return self.prompt_total() + self.completion_scheduled


def seqs_to_input(decoding_seqs: list[Sequence], prefill_seqs: list[Sequence], schedule_id: str,
                  page_size: int) -> ModelInput:
    position_ids, lm_head_indices, append_kv_token_indices, prefill_input_ids = [], [], [], []
    prefill_builder, decode_builder = PageInformationBuilder(), PageInformationBuilder()
    sampling_builder = BatchSamplingParamsBuilder()
    for seq in prefill_seqs:                                    # whole prompts (no chunking here)
        slen = seq.prompt_total()
        prefill_input_ids.extend(seq.input_ids)
        position_ids.extend(range(slen))
        prefill_builder.add_sequence(kv_indices=seq.kv_indices, kv_seq_len=slen, num_qtokens=slen, page_size=page_size)
        append_kv_token_indices.extend(calc_kv_token_indices(seq.kv_indices, page_size, 0, slen))
        lm_head_indices.append(len(position_ids) - 1)
        sampling_builder.add_sequence(temperature=seq.temperature)
    for seq in decoding_seqs:
        current_token_pos_id = seq.total_scheduled() - 1        # the last prefill token produced the first decode token
        position_ids.append(current_token_pos_id)
        decode_builder.add_sequence(kv_indices=seq.kv_indices, kv_seq_len=current_token_pos_id + 1, num_qtokens=1,
                                    page_size=page_size)
        append_kv_token_indices.extend(calc_kv_token_indices(seq.kv_indices, page_size, current_token_pos_id, 1))
        sampling_builder.add_sequence(temperature=seq.temperature)
    start_of_decode = len(prefill_input_ids)
    lm_head_indices.extend(range(start_of_decode, start_of_decode + len(decoding_seqs)))
    batch_indices = [s.batch_index for s in prefill_seqs for _ in range(s.prompt_total())]
    batch_indices += [s.batch_index for s in decoding_seqs]
    return ModelInput(
        attention_info_builder=AttentionInfoBuilder(page_size, append_kv_token_indices, prefill_builder,
                                                    decode_builder),
        prefill_input_ids=prefill_input_ids, batch_indices=batch_indices, lm_head_indices=lm_head_indices,
        sampling_builder=sampling_builder, position_ids=position_ids, schedule_id=schedule_id)


# --- model/utils.py: batch states ---------------------------------------------------------------------------------

def tp_slice(x: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    if _variant == "fix" and tp_size == 1:
        return x
    bs = x.shape[0]
    assert bs % tp_size == 0, f"bs={bs} must be divisible by tp_size={tp_size}"
    bs_per_rank = bs // tp_size
    out = x[tp_rank * bs_per_rank:(tp_rank + 1) * bs_per_rank]
    return out.clone() if _variant == "fix" else out


def pad_and_slice_tensor(x: Tensor, num_padding: int, tp_rank: int, tp_size: int) -> Tensor:
    if num_padding > 0:
        x = F.pad(x, (0, num_padding))
    return tp_slice(x, tp_rank, tp_size)


def make_input_batch_state(inp: ModelInput, tp_rank: int = 0, tp_size: int = 1,
                           add_raw_lm_head_indices: bool = False, num_total_padding: int = 0,
                           num_lm_head_padding: int = 0) -> BatchState:
    prefill_input_ids = torch.tensor(inp.prefill_input_ids, dtype=torch.long)
    position_ids = torch.tensor(inp.position_ids, dtype=torch.long)
    lm_head_indices = torch.tensor(inp.lm_head_indices, dtype=torch.long)
    state = BatchState(prefill_input_ids=prefill_input_ids, attention_info=inp.build_attention_info(),
                       position_ids=position_ids, sampling_params=inp.build_sampling_params(),
                       lm_head_indices=lm_head_indices)
    sp = state.sampling_params
    if _variant == "fix":
        # the padding comes from ModelRunner.calc_padding: up to the matched graph's size, else to a tp multiple
        state.num_total_padding, state.num_lm_head_padding = num_total_padding, num_lm_head_padding
        state.attention_info.num_padding = num_total_padding
        if num_total_padding > 0:
            state.position_ids = F.pad(state.position_ids, (0, num_total_padding), value=0)
        if tp_size > 1 or num_lm_head_padding > 0:
            state.raw_lm_head_indices = state.lm_head_indices
        state.lm_head_indices = pad_and_slice_tensor(state.lm_head_indices, num_lm_head_padding, tp_rank, tp_size)
        sp.greedy_mask = pad_and_slice_tensor(sp.greedy_mask, num_lm_head_padding, tp_rank, tp_size)
        sp.temperature = pad_and_slice_tensor(sp.temperature, num_lm_head_padding, tp_rank, tp_size)
        return state
    # before the fix: only padded to a multiple of tp_size, whatever graph the batch is then replayed in
    state.raw_lm_head_indices = lm_head_indices if add_raw_lm_head_indices else None
    if tp_size > 1:
        bs = state.position_ids.shape[0]
        num_padding = math.ceil(bs / tp_size) * tp_size - bs
        state.attention_info.num_padding = num_padding
        if num_padding > 0:
            state.position_ids = F.pad(state.position_ids, (0, num_padding), value=0)
        num_lm_head_indices = state.lm_head_indices.shape[0]
        lm_head_indices_padding = math.ceil(num_lm_head_indices / tp_size) * tp_size - num_lm_head_indices
        state.lm_head_indices_padding = lm_head_indices_padding
        state.lm_head_indices = pad_and_slice_tensor(state.lm_head_indices, lm_head_indices_padding, tp_rank, tp_size)
        sp.greedy_mask = pad_and_slice_tensor(sp.greedy_mask, lm_head_indices_padding, tp_rank, tp_size)
        sp.temperature = pad_and_slice_tensor(sp.temperature, lm_head_indices_padding, tp_rank, tp_size)
    return state


def add_decoding_ids_to_batch_state(state: BatchState, decoding_input_ids: Tensor, tp_rank: int = 0,
                                    tp_size: int = 1) -> None:
    assert state.prefill_input_ids is not None
    input_ids = torch.cat([state.prefill_input_ids.to(decoding_input_ids.device), decoding_input_ids], dim=0)
    if _variant == "fix":
        state.input_ids = pad_and_slice_tensor(input_ids, state.num_total_padding, tp_rank, tp_size)
    else:
        if tp_size > 1:
            num_padding = state.attention_info.num_padding
            if num_padding > 0:
                input_ids = F.pad(input_ids, (0, num_padding), value=0)
            input_ids = tp_slice(input_ids, tp_rank, tp_size)
        state.input_ids = input_ids
    state.prefill_input_ids = None


def move_batch_state(state: BatchState, device) -> None:
    state.position_ids = state.position_ids.to(device)
    state.attention_info = state.attention_info.to(device)
    state.sampling_params = state.sampling_params.to(device)
    state.lm_head_indices = state.lm_head_indices.to(device)
    if state.raw_lm_head_indices is not None:
        state.raw_lm_head_indices = state.raw_lm_head_indices.to(device)
    if state.prefill_input_ids is not None:
        state.prefill_input_ids = state.prefill_input_ids.to(device)


def unpad_output_batch_state(output_batch_state: BatchState, input_batch_state: BatchState,
                             model_input: ModelInput) -> None:
    if _variant == "fix":
        num_lm_head_tokens = model_input.num_lm_head_tokens()
        output_batch_state.output_ids = output_batch_state.output_ids[:num_lm_head_tokens]
        output_batch_state.logprobs = output_batch_state.logprobs[:num_lm_head_tokens]
    elif (lm_padding := input_batch_state.lm_head_indices_padding) > 0:
        output_batch_state.output_ids = output_batch_state.output_ids[:-lm_padding]
        output_batch_state.logprobs = output_batch_state.logprobs[:-lm_padding]


# --- model/attention_utils.py and the FlashInfer wrappers (stand-ins) ----------------------------------------------

def _paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_indptr: Tensor, kv_indices: Tensor,
                     token_seq: Tensor, token_kv_len: Tensor) -> Tensor:
    """(stand-in for FlashInfer's kernels) Query token t attends the first ``token_kv_len[t]`` keys of sequence
    ``token_seq[t]``'s pages ``kv_indices[kv_indptr[s]:kv_indptr[s + 1]]``, over a fixed window of pages."""
    num_pages, page_size, num_heads, head_dim = k_cache.shape
    j = torch.arange(MAX_KV_PAGES_PER_SEQ * page_size, device=q.device)
    start = kv_indptr.long().index_select(0, token_seq)
    idx = (start.unsqueeze(1) + j.div(page_size, rounding_mode="floor").unsqueeze(0)).clamp(max=kv_indices.shape[0] - 1)
    pages = kv_indices.long().index_select(0, idx.reshape(-1)).view(idx.shape)
    slots = (pages * page_size + (j % page_size).unsqueeze(0)).reshape(-1)
    keys = k_cache.view(-1, num_heads, head_dim).index_select(0, slots).view(q.shape[0], -1, num_heads, head_dim)
    values = v_cache.view(-1, num_heads, head_dim).index_select(0, slots).view(q.shape[0], -1, num_heads, head_dim)
    scores = (q.unsqueeze(1) * keys).sum(-1) / math.sqrt(head_dim)
    valid = j.unsqueeze(0) < token_kv_len.unsqueeze(1)
    scores = scores.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    return (torch.softmax(scores, dim=1).unsqueeze(-1) * values).sum(1)


def _kv_lens(kv_indptr: Tensor, kv_last_page_len: Tensor, page_size: int) -> Tensor:
    num_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    return (num_pages - 1) * page_size + kv_last_page_len.long()


class BatchPrefillWithPagedKVCacheWrapper:
    """(stand-in) Causal ragged prefill over the paged cache; ``plan`` keeps the metadata on the device."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size: int,
             device) -> None:
        self.qo_indptr, self.kv_indptr = qo_indptr.to(device), paged_kv_indptr.to(device)
        self.kv_indices, self.kv_last_page_len = paged_kv_indices.to(device), paged_kv_last_page_len.to(device)
        self.page_size = page_size

    def run(self, q: Tensor, paged_kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        t = torch.arange(q.shape[0], device=q.device)
        qo_end = self.qo_indptr[1:].long()
        token_seq = torch.searchsorted(qo_end, t, right=True)
        seq_kv_len = _kv_lens(self.kv_indptr, self.kv_last_page_len, self.page_size)
        token_kv_len = seq_kv_len.index_select(0, token_seq) - (qo_end.index_select(0, token_seq) - 1 - t)
        return _paged_attention(q, *paged_kv_cache, self.kv_indptr, self.kv_indices, token_seq, token_kv_len)


class BatchDecodeWithPagedKVCacheWrapper:
    """(stand-in) Decode attention, one query per sequence. With ``use_cuda_graph`` the metadata lives in fixed
    buffers that ``plan`` copies into (the batch size is fixed; the graph's kernels read the buffers)."""

    def __init__(self, use_cuda_graph: bool = False, paged_kv_indptr_buffer: Tensor | None = None,
                 paged_kv_indices_buffer: Tensor | None = None,
                 paged_kv_last_page_len_buffer: Tensor | None = None):
        self.is_cuda_graph_enabled = use_cuda_graph
        if use_cuda_graph:
            self._paged_kv_indptr_buf = paged_kv_indptr_buffer
            self._paged_kv_indices_buf = paged_kv_indices_buffer
            self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
            self._fixed_batch_size = paged_kv_last_page_len_buffer.shape[0]

    def plan(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, page_size: int, device) -> None:
        self.page_size = page_size
        if self.is_cuda_graph_enabled:
            if last_page_len.shape[0] != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                                 f"{last_page_len.shape[0]} mismatches the batch size set during initialization "
                                 f"{self._fixed_batch_size}")
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_indices_buf[:indices.shape[0]].copy_(indices)
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
        else:
            self._paged_kv_indptr_buf = indptr.to(device)
            self._paged_kv_indices_buf = indices.to(device)
            self._paged_kv_last_page_len_buf = last_page_len.to(device)

    def run(self, q: Tensor, paged_kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        token_seq = torch.arange(q.shape[0], device=q.device)
        kv_len = _kv_lens(self._paged_kv_indptr_buf, self._paged_kv_last_page_len_buf, self.page_size)
        return _paged_attention(q, *paged_kv_cache, self._paged_kv_indptr_buf, self._paged_kv_indices_buf,
                                token_seq, kv_len)


@dataclasses.dataclass
class WrapperCollection:
    prefill_wrapper: BatchPrefillWithPagedKVCacheWrapper | None = None
    decode_wrapper: BatchDecodeWithPagedKVCacheWrapper | None = None


def create_wrappers() -> WrapperCollection:
    return WrapperCollection(BatchPrefillWithPagedKVCacheWrapper(), BatchDecodeWithPagedKVCacheWrapper())


def create_wrappers_for_cudagraph(device, num_decode_sequences: int, max_kv_indices: int) -> WrapperCollection:
    # (upstream: torch.empty buffers; zeros here, so that the stand-in kernel's fixed window only gathers valid pages)
    return WrapperCollection(None, BatchDecodeWithPagedKVCacheWrapper(
        use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.zeros(num_decode_sequences + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.zeros(max_kv_indices, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.zeros(num_decode_sequences, dtype=torch.int32, device=device)))


def append_to_kv_cache(token_indices: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    _, num_key_value_heads, head_dim = key.shape
    k_cache.view(-1, num_key_value_heads, head_dim)[token_indices] = key
    v_cache.view(-1, num_key_value_heads, head_dim)[token_indices] = value


def tokasaurus_attention(ragged_q, ragged_k, ragged_v, k_cache, v_cache, attn_info: AttentionInfo,
                         wrappers: WrapperCollection) -> Tensor:
    append_to_kv_cache(attn_info.append_kv_token_indices, ragged_k, ragged_v, k_cache, v_cache)
    prefill_q, decode_q = attn_info.split_q(ragged_q)
    outs = []
    if prefill_q.numel() > 0:
        outs.append(wrappers.prefill_wrapper.run(prefill_q, (k_cache, v_cache)))
    if decode_q.numel() > 0:
        outs.append(wrappers.decode_wrapper.run(decode_q, (k_cache, v_cache)))
    return torch.cat(outs, dim=0)


# --- model/llama.py (every rank's shard in one object: a loop over ranks stands for the rank processes) -------------

def linear(x: Tensor, w: Tensor) -> Tensor:
    return (x.unsqueeze(1) * w.unsqueeze(0)).sum(-1)           # row by row: a row's result ignores the batch size


def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS))


def all_gather(xs: list[Tensor]) -> list[Tensor]:
    """(stand-in for NCCL's all_gather_into_tensor over the TP group) every rank gets the ranks' rows in rank order."""
    out = torch.cat(xs, dim=0)
    return [out for _ in xs]


def reduce_scatter(xs: list[Tensor]) -> list[Tensor]:
    """(stand-in for reduce_scatter_tensor) the sum over ranks, rank r keeping the r-th block of rows."""
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return list(total.chunk(len(xs), dim=0))


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention:
    def __init__(self, layer_idx: int, config: ServerConfig, num_pages: int, gen, device):
        self.layer_idx, self.tp_size = layer_idx, config.tp_size
        self.heads_per_rank = NUM_HEADS // config.tp_size
        width = self.heads_per_rank * HEAD_DIM
        full = {n: torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN, generator=gen, dtype=DTYPE) * 0.4 for n in "qkv"}
        o_full = torch.randn(HIDDEN, NUM_HEADS * HEAD_DIM, generator=gen, dtype=DTYPE) * 0.4
        self.input_layernorm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.q_proj = [full["q"][r * width:(r + 1) * width].to(device) for r in range(self.tp_size)]
        self.k_proj = [full["k"][r * width:(r + 1) * width].to(device) for r in range(self.tp_size)]
        self.v_proj = [full["v"][r * width:(r + 1) * width].to(device) for r in range(self.tp_size)]
        self.o_proj = [o_full[:, r * width:(r + 1) * width].to(device) for r in range(self.tp_size)]
        shape = (num_pages, config.page_size, self.heads_per_rank, HEAD_DIM)     # LayerKVCache, one per rank
        self.k_cache = [torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(self.tp_size)]
        self.v_cache = [torch.zeros(shape, dtype=DTYPE, device=device) for _ in range(self.tp_size)]
        self.attention_info: list[AttentionInfo | None] = [None] * self.tp_size
        self.wrapper_collection: list[WrapperCollection | None] = [None] * self.tp_size

    def attn_fn(self, rank: int, ragged_q: Tensor, ragged_k: Tensor, ragged_v: Tensor) -> Tensor:
        attention_info = self.attention_info[rank]
        num_padding = attention_info.num_padding
        if is_capturing():
            assert num_padding == 0, f"no sirree, num_padding={num_padding}"
        orig_q = ragged_q
        if num_padding > 0:
            ragged_q, ragged_k, ragged_v = ragged_q[:-num_padding], ragged_k[:-num_padding], ragged_v[:-num_padding]
        out = tokasaurus_attention(ragged_q, ragged_k, ragged_v, self.k_cache[rank], self.v_cache[rank],
                                   attention_info, self.wrapper_collection[rank])
        if num_padding > 0:
            out = F.pad(out, (0, 0, 0, 0, 0, num_padding))
        assert out.shape == orig_q.shape
        return out

    def forward(self, batch_states: list[BatchState]) -> None:
        gathered = all_gather([rms_norm(bs.hidden_states, self.input_layernorm) for bs in batch_states])
        o_proj = []
        for rank, bs in enumerate(batch_states):
            hidden_states = gathered[rank]
            bsz = hidden_states.shape[0]
            q = linear(hidden_states, self.q_proj[rank]).view(bsz, self.heads_per_rank, HEAD_DIM)
            k = linear(hidden_states, self.k_proj[rank]).view(bsz, self.heads_per_rank, HEAD_DIM)
            v = linear(hidden_states, self.v_proj[rank]).view(bsz, self.heads_per_rank, HEAD_DIM)
            cos, sin = bs.position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            attn_output = self.attn_fn(rank, q, k, v).view(bsz, -1)
            o_proj.append(linear(attn_output, self.o_proj[rank]))
        for bs, part in zip(batch_states, reduce_scatter(o_proj)):
            bs.hidden_states = bs.hidden_states + part


class LlamaMLP:
    def __init__(self, config: ServerConfig, gen, device):
        tp, inter = config.tp_size, INTERMEDIATE // config.tp_size
        gate = torch.randn(INTERMEDIATE, HIDDEN, generator=gen, dtype=DTYPE) * 0.4
        up = torch.randn(INTERMEDIATE, HIDDEN, generator=gen, dtype=DTYPE) * 0.4
        down = torch.randn(HIDDEN, INTERMEDIATE, generator=gen, dtype=DTYPE) * 0.3
        self.post_attention_layernorm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.gate_proj = [gate[r * inter:(r + 1) * inter].to(device) for r in range(tp)]
        self.up_proj = [up[r * inter:(r + 1) * inter].to(device) for r in range(tp)]
        self.down_proj = [down[:, r * inter:(r + 1) * inter].to(device) for r in range(tp)]

    def forward(self, batch_states: list[BatchState]) -> None:
        gathered = all_gather([rms_norm(bs.hidden_states, self.post_attention_layernorm) for bs in batch_states])
        down = []
        for rank, hidden_states in enumerate(gathered):
            g = linear(hidden_states, self.gate_proj[rank])
            down.append(linear(g * torch.sigmoid(g) * linear(hidden_states, self.up_proj[rank]), self.down_proj[rank]))
        for bs, part in zip(batch_states, reduce_scatter(down)):
            bs.hidden_states = bs.hidden_states + part


def sample_from_probs(probs: Tensor) -> Tensor:
    """(stand-in) upstream draws ``torch.rand`` uniforms for FlashInfer's ``sampling_from_probs``; here the most
    probable token, so that both runs are deterministic."""
    return probs.argmax(dim=-1)


def calc_tokens_and_logprobs(logits: Tensor, temperature: Tensor, greedy_mask: Tensor) -> tuple[Tensor, Tensor]:
    probs = F.softmax(logits / temperature.unsqueeze(-1), dim=-1)
    next_token_ids = torch.where(greedy_mask, logits.argmax(dim=-1), sample_from_probs(probs).long())
    chosen_logprobs = probs.gather(dim=-1, index=next_token_ids.unsqueeze(-1)).squeeze(-1).log()
    return next_token_ids, chosen_logprobs


class LlamaLMHead:
    def __init__(self, gen, device):
        self.input_norm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.lm_head = (torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE) * 0.6).to(device)   # not sharded

    def forward(self, batch_states: list[BatchState]) -> None:
        gathered = all_gather([bs.hidden_states for bs in batch_states])
        ids, logprobs = [], []
        for rank, bs in enumerate(batch_states):
            needed_hidden_states = gathered[rank][bs.lm_head_indices]
            logits = linear(rms_norm(needed_hidden_states, self.input_norm), self.lm_head)
            sp = bs.sampling_params
            next_token_ids, chosen_logprobs = calc_tokens_and_logprobs(logits, sp.temperature, sp.greedy_mask)
            ids.append(next_token_ids)
            logprobs.append(chosen_logprobs)
        for bs, i, lp in zip(batch_states, all_gather(ids), all_gather(logprobs)):
            bs.output_ids, bs.logprobs = i, lp


class LlamaForCausalLM:
    def __init__(self, config: ServerConfig, num_pages: int, device):
        gen = generator(1161)
        self.device, self.tp_size = device, config.tp_size
        self.embed_tokens = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE).to(device)
        self.layers = [(LlamaAttention(i, config, num_pages, gen, device), LlamaMLP(config, gen, device))
                       for i in range(NUM_LAYERS)]
        self.lm_head = LlamaLMHead(gen, device)
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE) / HEAD_DIM)
        freqs = torch.arange(MAX_POSITION, dtype=DTYPE).unsqueeze(1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos, self.rope_sin = emb.cos().to(device), emb.sin().to(device)
        self.wrapper_collection: list[WrapperCollection | None] = [None] * self.tp_size

    def attention_layers(self) -> list[LlamaAttention]:
        return [attn for attn, _ in self.layers]

    def forward(self, batch_states: list[BatchState]) -> list[BatchState]:
        # a copy of each input state: the graph's outputs must not be its inputs
        outs = [BatchState(input_ids=bs.input_ids, attention_info=bs.attention_info, position_ids=bs.position_ids,
                           sampling_params=bs.sampling_params, lm_head_indices=bs.lm_head_indices)
                for bs in batch_states]
        for out in outs:                                        # LlamaModel.forward
            out.hidden_states = self.embed_tokens[out.input_ids]
            out.position_embeddings = (self.rope_cos[out.position_ids], self.rope_sin[out.position_ids])
        for attn, mlp in self.layers:                           # LlamaBlock
            attn.forward(outs)
            mlp.forward(outs)
        self.lm_head.forward(outs)
        return outs

    def set_wrappers(self, rank: int, wrappers: WrapperCollection) -> None:
        self.wrapper_collection[rank] = wrappers
        for layer in self.attention_layers():
            layer.wrapper_collection[rank] = wrappers

    def plan(self, rank: int, attn_info: AttentionInfo) -> None:
        for layer in self.attention_layers():
            layer.attention_info[rank] = attn_info
        wrappers = self.wrapper_collection[rank]
        if attn_info.prefill_info.num_tokens > 0:
            p = attn_info.prefill_info
            wrappers.prefill_wrapper.plan(p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len,
                                          attn_info.page_size, self.device)
        if attn_info.decode_info.num_tokens > 0:
            d = attn_info.decode_info
            wrappers.decode_wrapper.plan(d.kv_indptr, d.kv_indices, d.kv_last_page_len, attn_info.page_size,
                                         self.device)


# --- model/utils.py: graphs and the runner ------------------------------------------------------------------------

@dataclasses.dataclass
class CUDAGraphInfo:
    config: ServerConfig
    graph: object
    input_batch_state: list[BatchState]           # one per rank
    output_batch_state: list[BatchState]
    wrappers: list[WrapperCollection]
    model: LlamaForCausalLM
    num_decode_tokens: int

    def copy_into_input_batch_state(self, rank: int, new_input_batch_state: BatchState) -> dict[str, int]:
        static = self.input_batch_state[rank]
        written = {}

        def copy_into(name: str, src: Tensor, dst: Tensor) -> None:
            assert src.shape[0] <= dst.shape[0], f"src.shape[0]={src.shape[0]} > dst.shape[0]={dst.shape[0]}"
            dst[:src.shape[0]].copy_(src)
            written[name] = src.shape[0]

        copy_into("position_ids", new_input_batch_state.position_ids, static.position_ids)
        # padding's append indices point to the dummy last page added for the graphs
        static.attention_info.append_kv_token_indices.fill_(self.config.kv_cache_num_blocks() * self.config.page_size)
        copy_into("append_kv_token_indices", new_input_batch_state.attention_info.append_kv_token_indices,
                  static.attention_info.append_kv_token_indices)
        copy_into("input_ids", new_input_batch_state.input_ids, static.input_ids)
        lm_head_indices = new_input_batch_state.lm_head_indices
        if _variant == "fix":
            num_lm_head_padding = static.lm_head_indices.shape[0] - lm_head_indices.shape[0]
            assert num_lm_head_padding >= 0
            num_indices_per_device = lm_head_indices.shape[0]
            lm_head_index_devices = lm_head_indices.div(num_indices_per_device, rounding_mode="floor")
            lm_head_indices = lm_head_indices + lm_head_index_devices * num_lm_head_padding
        copy_into("lm_head_indices", lm_head_indices, static.lm_head_indices)
        copy_into("greedy_mask", new_input_batch_state.sampling_params.greedy_mask, static.sampling_params.greedy_mask)
        copy_into("temperature", new_input_batch_state.sampling_params.temperature, static.sampling_params.temperature)
        return written

    def plan(self, rank: int, input_batch_state: BatchState) -> None:
        self.model.set_wrappers(rank, self.wrappers[rank])
        self.model.plan(rank, input_batch_state.attention_info)

    def run(self, input_batch_states: list[BatchState]) -> list[BatchState]:
        size = self.num_decode_tokens
        real = input_batch_states[0].attention_info.decode_info.num_tokens
        written = [self.copy_into_input_batch_state(r, s) for r, s in enumerate(input_batch_states)]
        # the global rows of the replicated position ids that this step's copy left as they were
        padded = {f"rank{r}.position_ids": self.input_batch_state[r].position_ids
                  for r in range(len(written)) if written[r]["position_ids"] == real < size}
        outputs = tuple(t for o in self.output_batch_state for t in (o.output_ids, o.logprobs, o.hidden_states))
        views = replay(self.graph, outputs, real=real, size=size, padded=padded)
        for r, state in enumerate(input_batch_states):
            output_ids, logprobs, hidden_states = views[3 * r:3 * r + 3]
            if _variant == "fix":
                state.output_ids, state.logprobs, state.hidden_states = output_ids, logprobs, hidden_states
            else:
                batch_size = state.position_ids.shape[0]
                state.output_ids, state.logprobs = output_ids[:batch_size], logprobs[:batch_size]
                state.hidden_states = hidden_states[:batch_size]
        return input_batch_states


def create_cudagraph(config: ServerConfig, model: LlamaForCausalLM, num_decode_tokens: int) -> CUDAGraphInfo:
    tp_size, device = config.tp_size, model.device
    assert num_decode_tokens % tp_size == 0
    orig_wrappers = list(model.wrapper_collection)
    dummy_inp = make_dummy_batch(config, prefill_tokens=0, decode_tokens=num_decode_tokens)
    states, wrappers = [], []
    for rank in range(tp_size):
        state = make_input_batch_state(dummy_inp, tp_rank=rank, tp_size=tp_size)
        add_decoding_ids_to_batch_state(state, torch.zeros(num_decode_tokens, dtype=torch.long), rank, tp_size)
        move_batch_state(state, device)
        state.input_ids = state.input_ids.to(device)
        w = create_wrappers_for_cudagraph(device, num_decode_tokens,
                                          config.cudagraph_max_kv_indices_per_seq * num_decode_tokens)
        model.set_wrappers(rank, w)
        model.plan(rank, state.attention_info)
        states.append(state)
        wrappers.append(w)
    static = {}
    for rank, s in enumerate(states):
        static.update({f"rank{rank}.input_ids": s.input_ids, f"rank{rank}.position_ids": s.position_ids,
                       f"rank{rank}.append_kv_token_indices": s.attention_info.append_kv_token_indices,
                       f"rank{rank}.lm_head_indices": s.lm_head_indices,
                       f"rank{rank}.greedy_mask": s.sampling_params.greedy_mask,
                       f"rank{rank}.temperature": s.sampling_params.temperature,
                       f"rank{rank}.paged_kv_indptr": wrappers[rank].decode_wrapper._paged_kv_indptr_buf,
                       f"rank{rank}.paged_kv_indices": wrappers[rank].decode_wrapper._paged_kv_indices_buf,
                       f"rank{rank}.paged_kv_last_page_len": wrappers[rank].decode_wrapper._paged_kv_last_page_len_buf})
    state = {f"layer{i}.rank{r}.{kv}_cache": getattr(attn, f"{kv}_cache")[r]
             for i, attn in enumerate(model.attention_layers()) for r in range(tp_size) for kv in "kv"}

    def graph_forward() -> list[BatchState]:
        for rank in range(tp_size):                 # the layers read the graph's own metadata and wrappers (as planned)
            model.set_wrappers(rank, wrappers[rank])
            for layer in model.attention_layers():
                layer.attention_info[rank] = states[rank].attention_info
        return model.forward(states)

    g, out_batch_state = capture(graph_forward, device=device, warmups=3, static=static, state=state,
                                 name=f"size {num_decode_tokens}", owner="tokasaurus ModelRunner")
    for rank in range(tp_size):
        model.set_wrappers(rank, orig_wrappers[rank])
    return CUDAGraphInfo(config, g, states, out_batch_state, wrappers, model, num_decode_tokens)


class ModelRunner:
    def __init__(self, config: ServerConfig, model: LlamaForCausalLM):
        self.config, self.model = config, model
        self.default_wrappers = list(model.wrapper_collection)
        self.recorded_graphs = False
        self.graphs: list[CUDAGraphInfo] = []

    def run_default(self, input_batch_states: list[BatchState]) -> list[BatchState]:
        for rank in range(self.config.tp_size):
            self.model.set_wrappers(rank, self.default_wrappers[rank])
        return self.model.forward(input_batch_states)

    def plan_default(self, rank: int, input_batch_state: BatchState) -> None:
        self.model.set_wrappers(rank, self.default_wrappers[rank])
        self.model.plan(rank, input_batch_state.attention_info)

    def match_to_graph(self, num_prefill_tokens: int, num_decode_tokens: int) -> int | None:
        if num_prefill_tokens > 0 or num_decode_tokens > self.config.cudagraph_max_size or not self.recorded_graphs:
            return None
        assert num_decode_tokens > 0
        for i, graph in enumerate(self.graphs):
            if num_decode_tokens <= graph.num_decode_tokens:
                return i
        raise RuntimeError(f"Shouldn't get here, num_decode_tokens={num_decode_tokens}")

    def match_state_to_graph(self, input_batch_state: BatchState) -> int | None:
        info = input_batch_state.attention_info
        return self.match_to_graph(info.prefill_info.num_tokens, info.decode_info.num_tokens)

    def calc_padding(self, num_prefill_tokens: int, num_decode_tokens: int, num_lm_head_tokens: int):
        """(the fix) returns (all_tokens_padding, lm_head_tokens_padding)"""
        matched_graph_index = self.match_to_graph(num_prefill_tokens, num_decode_tokens)
        if matched_graph_index is not None:                    # cudagraph padding
            assert num_prefill_tokens == 0 and num_lm_head_tokens == num_decode_tokens
            graph_size = self.graphs[matched_graph_index].num_decode_tokens
            assert graph_size % self.config.tp_size == 0
            decode_padding = graph_size - num_decode_tokens
            return decode_padding, decode_padding
        tp = self.config.tp_size                               # normal TP padding
        num_total_tokens = num_prefill_tokens + num_decode_tokens
        total_padding = math.ceil(num_total_tokens / tp) * tp - num_total_tokens
        lm_head_indices_padding = math.ceil(num_lm_head_tokens / tp) * tp - num_lm_head_tokens
        return total_padding, lm_head_indices_padding

    def plan(self, rank: int, input_batch_state: BatchState) -> None:
        graph_index = self.match_state_to_graph(input_batch_state)
        if graph_index is None:
            self.plan_default(rank, input_batch_state)
            return
        graph = self.graphs[graph_index]
        input_batch_state.attention_info.decode_info.pad_for_cudagraph(graph.num_decode_tokens)
        graph.plan(rank, input_batch_state)

    def run(self, input_batch_states: list[BatchState]) -> list[BatchState]:
        graph_index = self.match_state_to_graph(input_batch_states[0])
        if graph_index is None:
            return self.run_default(input_batch_states)
        return self.graphs[graph_index].run(input_batch_states)

    def record_graphs(self) -> None:
        max_bs, step = self.config.cudagraph_max_size, self.config.cudagraph_step
        assert max_bs % step == 0
        self.graphs = [create_cudagraph(self.config, self.model, n) for n in range(step, max_bs + 1, step)]
        self.recorded_graphs = True


# --- model/basic_worker.py: basic_model_loop, for the whole TP group ------------------------------------------------

class BasicWorkers:
    def __init__(self, config: ServerConfig, device: str):
        self.config, self.device = config, device
        num_pages = config.kv_cache_num_blocks() + (1 if config.use_cudagraphs else 0)  # + the padding's dummy page
        self.model = LlamaForCausalLM(config, num_pages, device)
        for rank in range(config.tp_size):
            self.model.set_wrappers(rank, create_wrappers())
        self.batch_index_to_last_token = [torch.zeros(config.max_batch_index, dtype=torch.long, device=device)
                                          for _ in range(config.tp_size)]
        self.model_runner = ModelRunner(config, self.model)
        if config.use_cudagraphs:
            self.model_runner.record_graphs()

    def preprocess(self, inp: ModelInput) -> list[BatchState]:
        tp_size, states = self.config.tp_size, []
        for tp_rank in range(tp_size):
            if _variant == "fix":
                num_total_padding, num_lm_head_padding = self.model_runner.calc_padding(
                    inp.num_prefill_tokens(), inp.num_decode_tokens(), inp.num_lm_head_tokens())
                state = make_input_batch_state(inp, tp_rank=tp_rank, tp_size=tp_size,
                                               num_total_padding=num_total_padding,
                                               num_lm_head_padding=num_lm_head_padding)
            else:
                state = make_input_batch_state(inp, tp_rank=tp_rank, tp_size=tp_size,
                                               add_raw_lm_head_indices=tp_size > 1)
            self.model_runner.plan(tp_rank, state)
            move_batch_state(state, self.device)
            states.append(state)
        return states

    def run_model(self, inp: ModelInput, states: list[BatchState]) -> tuple[Tensor, Tensor]:
        batch_indices = torch.tensor(inp.batch_indices, dtype=torch.long).to(self.device)
        decoding_batch_indices = batch_indices[inp.decode_start_pos():]
        for tp_rank, state in enumerate(states):
            decoding_input_ids = self.batch_index_to_last_token[tp_rank][decoding_batch_indices]
            add_decoding_ids_to_batch_state(state, decoding_input_ids, tp_rank, self.config.tp_size)
        outputs = self.model_runner.run(states)
        for tp_rank, (state, out) in enumerate(zip(states, outputs)):
            unpad_output_batch_state(out, state, inp)
            lm_head_indices = state.raw_lm_head_indices if state.raw_lm_head_indices is not None \
                else state.lm_head_indices
            self.batch_index_to_last_token[tp_rank][batch_indices[lm_head_indices]] = out.output_ids
        return outputs[0].output_ids.clone(), outputs[0].logprobs.clone()      # postprocess: rank 0 reports


# --- workload -----------------------------------------------------------------------------------------------------

REQUESTS = [  # id, prompt, KV pages, temperature (0: greedy)
    ("A", [3, 17, 5, 9, 21], [0, 1, 2], 0.0),
    ("B", [11, 2, 14], [3, 4], 0.5),
    ("C", [7, 19, 1, 13, 8, 22], [5, 6, 7], 0.0),
    ("D", [4, 15, 10, 6], [8, 9], 0.8),
]
SCHEDULE = [(["A", "B", "C", "D"], []),          # (prefill, decode)
            ([], ["A", "B", "C", "D"]), ([], ["A", "B", "C", "D"]),
            ([], ["A", "B", "C"]),                # 3 tokens: padded to 4 for TP, the graph's size
            ([], ["A", "B"]), ([], ["A", "B"])]   # 2 tokens in the graph of 4


def serve(device: str, use_cudagraphs: bool) -> list[Tensor]:
    config = ServerConfig(use_cudagraphs=use_cudagraphs)
    workers = BasicWorkers(config, device)
    seqs = {rid: Sequence(rid, prompt, pages, i, temp) for i, (rid, prompt, pages, temp) in enumerate(REQUESTS)}
    outputs = []
    for step, (prefill, decode) in enumerate(SCHEDULE):
        for rid in decode:
            seqs[rid].completion_scheduled += 1
        inp = seqs_to_input([seqs[r] for r in decode], [seqs[r] for r in prefill], f"step{step}", config.page_size)
        outputs += list(workers.run_model(inp, workers.preprocess(inp)))
    num_blocks = config.kv_cache_num_blocks()
    return outputs + [cache[:num_blocks].clone() for attn in workers.model.attention_layers()
                      for cache in attn.k_cache + attn.v_cache]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cudagraphs=True), lambda: serve(device, use_cudagraphs=False))
