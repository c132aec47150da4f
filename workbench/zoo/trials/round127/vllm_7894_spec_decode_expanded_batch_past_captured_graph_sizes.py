"""vLLM V0 with speculative decoding (batch expansion) and CUDA graphs: ``ModelInputForGPUBuilder._use_captured_graph`` admits every decode batch up to ``_BATCH_SIZES_TO_CAPTURE[-1]`` (256) to the graphs, but ``capture_model`` only captured sizes up to ``_get_graph_batch_size(max_num_seqs)``; the scorer's expanded batch (``num_seqs * (k + 1)`` rows) is larger than that and ``execute_model`` looks up a graph that was never captured.

Upstream: https://github.com/vllm-project/vllm/pull/7894 ("extend cuda graph size for H200", vllm-project/vllm, by
kushanam with youkaichao, merged 2024-08-29 as c334b1898). Its diff bounds ``_use_captured_graph`` by the new
``self.runner.max_batchsize_to_capture`` (from ``_get_max_graph_batch_size(max_num_seqs)``) instead of
``_BATCH_SIZES_TO_CAPTURE[-1]``, and uses the same bound for the capture list, the dummy capture inputs and
``graph_block_tables``. The same bug was the subject of https://github.com/vllm-project/vllm/pull/7999 ("[Bugfix]
Prevent crash from attempting to use a CUDA graph for a batch size that wasn't captured", tjohnson31415, closed
unmerged; its review comments, dated 2024-08-29, quote a hunk of ``_use_captured_graph`` and the author's
"``_use_captured_graph()`` should verify that a graph actually exists for the batch size requested") and of
https://github.com/vllm-project/vllm/pull/7090 ("[Bugfix] fix spec decode with cuda graph", closed), whose thread
gives the traceback.
Read: the full diff of c334b1898 (``vllm/worker/model_runner.py``); at its parent, ``model_runner.py``
(``_BATCH_SIZES_TO_CAPTURE``, ``ModelInputForGPUBuilder._use_captured_graph`` / ``build``,
``GPUModelRunnerBase.capture_model``, ``ModelRunner.execute_model``, ``CUDAGraphRunner.capture`` / ``forward``,
``_get_graph_batch_size``), ``attention/backends/utils.py`` (``CommonMetadataBuilder.build``,
``CommonAttentionState``), ``spec_decode/batch_expansion.py`` (``score_proposals``, ``_expand_batch``,
``_create_target_seq_group_metadata``, ``_create_single_target_seq_group_metadata``) and
``spec_decode_worker.py`` (``_run_speculative_decoding_step``, ``_verify_tokens`` signature); the #7999 and #7090
review threads as stored (excerpts).
Symptom: (#7090) with speculative decoding and CUDA graphs, the first scoring step of a batch larger than the
captured sizes dies in ``ModelRunner.execute_model`` at ``model_executable = self.graph_runners[virtual_engine][
graph_batch_size]`` with ``KeyError: 8``; ``--enforce-eager`` serves it.
Mechanism: ``capture_model`` captures the batch sizes of ``_BATCH_SIZES_TO_CAPTURE`` up to
``_get_graph_batch_size(max_num_seqs)`` (here 1, 2, 4 for ``max_num_seqs=3``), since a scheduled batch never has
more sequences than ``max_num_seqs``. The batch-expansion scorer turns each of the ``n`` scheduled sequences into
``k + 1`` single-token decode sequences, so the target model sees ``n * (k + 1)`` decode rows.
``_use_captured_graph`` only checks ``batch_size <= _BATCH_SIZES_TO_CAPTURE[-1]`` (256): the 6-row batch is padded to
8 and sent to a graph of 8 rows that does not exist.
Doctor: undersized-buffer, at _use_captured_graph. The builder asks the captured graphs to serve more rows than the
largest captured batch; the fix bounds that check by the largest batch size actually captured.
Fix (upstream): ``_use_captured_graph`` tests ``batch_size <= self.runner.max_batchsize_to_capture``
(``_get_max_graph_batch_size(max_num_seqs)``, 4 here), so larger expanded batches run eagerly; ``capture_model`` and
``graph_block_tables`` use the same bound.
Modelled: ``SequenceGroupMetadata`` (one sequence, block table), ``ModelInputForGPUBuilder`` (``add_seq_group``,
``_use_captured_graph``, ``build`` with the graph padding and, folded in, ``CommonMetadataBuilder.build``: slot
mapping with ``PAD_SLOT_ID``, padded ``seq_lens`` of 1, block tables from the persistent host
``graph_block_tables[:batch_size]``), ``CommonAttentionState`` (``graph_capture``,
``graph_capture_get_metadata_for_batch``, ``get_graph_input_buffers``, ``prepare_graph_input_buffers``),
``CUDAGraphRunner`` (two warmup runs, capture, ``forward`` copying inputs into the static buffers and replaying),
``ModelRunner`` (``capture_model`` in reversed size order over shared dummy inputs, ``prepare_model_input``,
``execute_model`` with the ``graph_runners`` lookup and ``compute_logits`` on ``selected_token_indices``),
``BatchExpansionTop1Scorer`` (expansion into ``k + 1`` target sequences sharing the block table) and
``SpecDecodeWorker`` (greedy verification with bonus token). Stand-ins: a one-layer, one-head attention model over a
paged KV cache (a torch gather instead of the paged-attention kernel; prefill as per-token paged attention), a
proposer that proposes each sequence's last token k times (instead of the draft worker), greedy sampling, block tables
allocated up front, float64.
Workload: ``max_num_seqs=3`` (graphs for 1, 2, 4), ``k=2``. Requests A (prompt 5, 7 new tokens) and B (prompt 4, 2
new tokens) prefill together (eager); spec step 1 scores 2 * 3 = 6 target rows; B then finishes and A's three
further steps score 3 rows each (graph of 4, one padded row), accepting 2, 0 and 1 of the 2 proposed tokens.
Measured: the bug raises ``KeyError: 8`` at spec step 1 (``graph_runners`` holds 1, 2 and 4). The fix runs that
6-row step eagerly, replays the 4-row graph for A's three later steps, and equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/7894"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_use_captured_graph"
SYMPTOM = ("speculative decoding with CUDA graphs: the expanded scoring batch (num_seqs * (k + 1) rows) is sent to "
           "a graph batch size that was never captured, KeyError in execute_model")

_variant = "bug"

VOCAB, HIDDEN = 16, 8
BLOCK_SIZE, MAX_MODEL_LEN = 4, 16
NUM_GPU_BLOCKS = 1 + 2 * (MAX_MODEL_LEN // BLOCK_SIZE)       # block 0 is never handed out
MAX_NUM_SEQS, NUM_SPECULATIVE_TOKENS = 3, 2
PAD_SLOT_ID = -1
DTYPE = torch.float64

_BATCH_SIZE_ALIGNMENT = 8
# Capture graphs for token size 1, 2, 4, 8, 16, 24, 32, 40, ..., 256.
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4] + [_BATCH_SIZE_ALIGNMENT * i for i in range(1, 33)]
_NUM_WARMUP_ITERS = 2


def _get_graph_batch_size(batch_size: int) -> int:
    if batch_size <= 2:
        return batch_size
    elif batch_size <= 4:
        return 4
    else:
        return ((batch_size + _BATCH_SIZE_ALIGNMENT - 1) // _BATCH_SIZE_ALIGNMENT * _BATCH_SIZE_ALIGNMENT)


def _get_max_graph_batch_size(max_num_seqs: int) -> int:
    padded_size = _get_graph_batch_size(max_num_seqs)
    if padded_size in _BATCH_SIZES_TO_CAPTURE:
        return padded_size
    assert padded_size > _BATCH_SIZES_TO_CAPTURE[-1]
    return _BATCH_SIZES_TO_CAPTURE[-1]


# --- vllm/sequence.py (reduced) ---------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class SequenceGroupMetadata:
    request_id: str
    is_prompt: bool
    seq_data: dict                 # {seq_id: token ids (prompt + output)}
    block_tables: dict             # {seq_id: block numbers}


# --- the model (stand-in for LlamaForCausalLM, one layer) -------------------------------------------------------------

def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write this step's key/value at ``slot_mapping``; ``PAD_SLOT_ID`` rows write nothing."""
    valid = (slot_mapping >= 0)[:, None]
    slots = slot_mapping.clamp(min=0)
    key_cache.index_put_((slots,), torch.where(valid, key, key_cache[slots]))
    value_cache.index_put_((slots,), torch.where(valid, value, value_cache[slots]))


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens):
    """Each row attends to positions ``[0, seq_len)`` of its block table."""
    width = block_tables.shape[1]
    pos = torch.arange(MAX_MODEL_LEN, device=query.device)
    blocks = block_tables[:, (pos // BLOCK_SIZE).clamp(max=width - 1)]
    slots = blocks.long() * BLOCK_SIZE + (pos % BLOCK_SIZE)[None, :]
    k, v = key_cache[slots], value_cache[slots]
    scores = (k @ query[:, :, None]).squeeze(-1) / math.sqrt(HIDDEN)
    scores = scores.masked_fill(pos[None, :] >= seq_lens[:, None].long(), float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None] * v).sum(1)


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(7894)
        r = lambda *s, scale=0.6: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.embed_tokens, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)

    def __call__(self, input_ids, positions, kv_caches, attn_metadata):
        h = self.embed_tokens[input_ids] + self.pos_embed[positions]
        key_cache, value_cache = kv_caches
        reshape_and_cache(h @ self.wk, h @ self.wv, key_cache, value_cache, attn_metadata.slot_mapping)
        attn = paged_attention(h @ self.wq, key_cache, value_cache, attn_metadata.block_tables,
                               attn_metadata.seq_lens_tensor)
        return h + attn @ self.wo

    def compute_logits(self, hidden_states, selected_token_indices):
        return hidden_states.index_select(0, selected_token_indices) @ self.lm_head


# --- vllm/attention/backends (reduced) --------------------------------------------------------------------------------

@dataclasses.dataclass
class FlashAttentionMetadata:
    num_prefills: int
    slot_mapping: torch.Tensor
    seq_lens_tensor: torch.Tensor
    block_tables: torch.Tensor
    use_cuda_graph: bool

    @property
    def decode_metadata(self):
        return None if self.num_prefills else self

    @property
    def prefill_metadata(self):
        return self if self.num_prefills else None


class CommonAttentionState:
    def __init__(self, runner):
        self.runner = runner
        self._is_graph_capturing = False

    @contextlib.contextmanager
    def graph_capture(self, max_batch_size: int):
        self._is_graph_capturing = True
        d = self.runner.device
        self._graph_slot_mapping = torch.full((max_batch_size,), PAD_SLOT_ID, dtype=torch.long, device=d)
        self._graph_seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=d)
        self._graph_block_tables = torch.from_numpy(self.runner.graph_block_tables).to(device=d)
        yield
        self._is_graph_capturing = False
        del self._graph_slot_mapping
        del self._graph_seq_lens
        del self._graph_block_tables

    def graph_clone(self, batch_size: int):
        assert self._is_graph_capturing
        return self.__class__(self.runner)

    def graph_capture_get_metadata_for_batch(self, batch_size: int):
        assert self._is_graph_capturing
        return FlashAttentionMetadata(num_prefills=0, slot_mapping=self._graph_slot_mapping[:batch_size],
                                      seq_lens_tensor=self._graph_seq_lens[:batch_size],
                                      block_tables=self._graph_block_tables[:batch_size], use_cuda_graph=True)

    def get_graph_input_buffers(self, attn_metadata):
        return {"slot_mapping": attn_metadata.slot_mapping,
                "seq_lens_tensor": attn_metadata.decode_metadata.seq_lens_tensor,
                "block_tables": attn_metadata.decode_metadata.block_tables}

    def prepare_graph_input_buffers(self, input_buffers, attn_metadata):
        input_buffers["seq_lens_tensor"].copy_(attn_metadata.decode_metadata.seq_lens_tensor)
        input_buffers["block_tables"].copy_(attn_metadata.decode_metadata.block_tables)


# --- vllm/worker/model_runner.py (Aug 2024, reduced) ------------------------------------------------------------------

@dataclasses.dataclass
class ModelInputForGPU:
    input_tokens: torch.Tensor
    input_positions: torch.Tensor
    attn_metadata: FlashAttentionMetadata
    selected_token_indices: torch.Tensor
    num_real_rows: int
    virtual_engine: int = 0


class ModelInputForGPUBuilder:
    def __init__(self, runner):
        self.runner = runner
        self.decode_only = True
        self.input_tokens, self.input_positions, self.seq_lens = [], [], []
        self.slot_mapping, self.block_tables, self.selected_token_indices = [], [], []
        self.num_prefills = 0

    def add_seq_group(self, seq_group_metadata: SequenceGroupMetadata):
        if seq_group_metadata.is_prompt:
            self.decode_only = False
            self.num_prefills += 1
        for seq_id, tokens in seq_group_metadata.seq_data.items():
            block_table = seq_group_metadata.block_tables[seq_id]
            seq_len = len(tokens)
            context_len = 0 if seq_group_metadata.is_prompt else seq_len - 1
            for pos in range(context_len, seq_len):
                self.input_tokens.append(tokens[pos])
                self.input_positions.append(pos)
                self.seq_lens.append(pos + 1)
                self.slot_mapping.append(block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
                self.block_tables.append(block_table)
            self.selected_token_indices.append(len(self.input_tokens) - 1)

    def _use_captured_graph(self, batch_size: int, max_decode_seq_len: int) -> bool:
        if _variant == "bug":
            return (self.decode_only and not self.runner.enforce_eager
                    and batch_size <= _BATCH_SIZES_TO_CAPTURE[-1]
                    and max_decode_seq_len <= self.runner.max_seq_len_to_capture)
        return (self.decode_only and not self.runner.enforce_eager
                and batch_size <= self.runner.max_batchsize_to_capture
                and max_decode_seq_len <= self.runner.max_seq_len_to_capture)

    def build(self) -> ModelInputForGPU:
        device = self.runner.device
        input_tokens, input_positions = list(self.input_tokens), list(self.input_positions)
        seq_lens, slot_mapping, block_tables = list(self.seq_lens), list(self.slot_mapping), list(self.block_tables)
        max_decode_seq_len = max(seq_lens) if self.decode_only else 0
        num_real_rows = batch_size = len(input_tokens)
        use_captured_graph = self._use_captured_graph(batch_size, max_decode_seq_len)

        cuda_graph_pad_size = -1
        if use_captured_graph:
            graph_batch_size = _get_graph_batch_size(batch_size)
            assert graph_batch_size >= batch_size
            cuda_graph_pad_size = graph_batch_size - batch_size
            batch_size = graph_batch_size
            input_tokens.extend(itertools.repeat(0, cuda_graph_pad_size))
            input_positions.extend(itertools.repeat(0, cuda_graph_pad_size))
            seq_lens.extend(itertools.repeat(1, cuda_graph_pad_size))

        # attention metadata (CommonMetadataBuilder.build)
        if use_captured_graph:
            slot_mapping.extend([PAD_SLOT_ID] * cuda_graph_pad_size)
            # The shape of graph_block_tables is [max batch size, max context len // block size].
            input_block_tables = self.runner.graph_block_tables[:batch_size]
            for i, block_table in enumerate(block_tables):
                if block_table:
                    input_block_tables[i, :len(block_table)] = block_table
            block_tables_t = torch.from_numpy(input_block_tables).to(device)
        else:
            width = max(len(bt) for bt in block_tables)
            block_tables_t = torch.tensor([bt + [0] * (width - len(bt)) for bt in block_tables],
                                          dtype=torch.int32, device=device)
        attn_metadata = FlashAttentionMetadata(
            num_prefills=self.num_prefills,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables_t, use_cuda_graph=use_captured_graph)
        return ModelInputForGPU(
            input_tokens=torch.tensor(input_tokens, dtype=torch.long, device=device),
            input_positions=torch.tensor(input_positions, dtype=torch.long, device=device),
            attn_metadata=attn_metadata,
            selected_token_indices=torch.tensor(self.selected_token_indices, dtype=torch.long, device=device),
            num_real_rows=num_real_rows)


class CUDAGraphRunner:
    def __init__(self, model, backend_name: str, attn_state: CommonAttentionState):
        self.model, self.backend_name, self.attn_state = model, backend_name, attn_state
        self.input_buffers: dict = {}
        self.output_buffers: dict = {}
        self._graph = None

    def capture(self, input_ids, positions, kv_caches, attn_metadata, batch_size):
        assert self._graph is None
        static = {"input_ids": input_ids, "positions": positions,
                  **self.attn_state.get_graph_input_buffers(attn_metadata)}
        self._graph, hidden_states = capture(
            lambda: self.model(input_ids=input_ids, positions=positions, kv_caches=kv_caches,
                               attn_metadata=attn_metadata),
            device=str(input_ids.device), warmups=_NUM_WARMUP_ITERS, static=static,
            state={"key_cache": kv_caches[0], "value_cache": kv_caches[1]},
            owner="CUDAGraphRunner", name=f"decode graph bs={batch_size}")
        self.input_buffers = {**static, "kv_caches": kv_caches}
        self.output_buffers = {"hidden_states": hidden_states}
        return hidden_states

    def forward(self, input_ids, positions, kv_caches, attn_metadata, num_real_rows):
        del kv_caches
        self.input_buffers["input_ids"].copy_(input_ids)
        self.input_buffers["positions"].copy_(positions)
        self.input_buffers["slot_mapping"].copy_(attn_metadata.slot_mapping)
        self.attn_state.prepare_graph_input_buffers(self.input_buffers, attn_metadata)
        return replay(self._graph, self.output_buffers["hidden_states"], real=num_real_rows,
                      size=input_ids.shape[0], padded={"block_tables": self.input_buffers["block_tables"]})

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class ModelRunner:
    def __init__(self, model, device, enforce_eager: bool):
        self.model, self.device, self.enforce_eager = model, device, enforce_eager
        self.max_num_seqs = MAX_NUM_SEQS
        self.max_seq_len_to_capture = MAX_MODEL_LEN
        if _variant == "fix":
            self.max_batchsize_to_capture = _get_max_graph_batch_size(self.max_num_seqs)
        graph_rows = self.max_batchsize_to_capture if _variant == "fix" else max(_BATCH_SIZES_TO_CAPTURE)
        self.graph_block_tables = np.zeros((graph_rows, self.max_seq_len_to_capture // BLOCK_SIZE), dtype=np.int32)
        self.attn_state = CommonAttentionState(self)
        self.graph_runners: list[dict[int, CUDAGraphRunner]] = [{}]
        self.kv_caches = tuple(torch.zeros(NUM_GPU_BLOCKS * BLOCK_SIZE, HIDDEN, dtype=DTYPE, device=device)
                               for _ in range(2))
        if not enforce_eager:
            self.capture_model(self.kv_caches)

    def capture_model(self, kv_caches):
        if _variant == "bug":
            max_batch_size = max(_BATCH_SIZES_TO_CAPTURE)
            graph_batch_size = _get_graph_batch_size(self.max_num_seqs)
        else:
            max_batch_size = self.max_batchsize_to_capture
            graph_batch_size = self.max_batchsize_to_capture
        # Prepare dummy inputs. These will be reused for all batch sizes.
        input_tokens = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        input_positions = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        batch_size_capture_list = [bs for bs in _BATCH_SIZES_TO_CAPTURE if bs <= graph_batch_size]
        with self.attn_state.graph_capture(max_batch_size):
            for virtual_engine in range(1):
                for batch_size in reversed(batch_size_capture_list):
                    attn_metadata = self.attn_state.graph_capture_get_metadata_for_batch(batch_size)
                    graph_runner = CUDAGraphRunner(self.model, "FLASH_ATTN", self.attn_state.graph_clone(batch_size))
                    graph_runner.capture(input_tokens[:batch_size], input_positions[:batch_size], kv_caches,
                                         attn_metadata, batch_size)
                    self.graph_runners[virtual_engine][batch_size] = graph_runner

    def prepare_model_input(self, seq_group_metadata_list) -> ModelInputForGPU:
        builder = ModelInputForGPUBuilder(self)
        for seq_group_metadata in seq_group_metadata_list:
            builder.add_seq_group(seq_group_metadata)
        return builder.build()

    def execute_model(self, model_input: ModelInputForGPU):
        prefill_meta = model_input.attn_metadata.prefill_metadata
        decode_meta = model_input.attn_metadata.decode_metadata
        virtual_engine = model_input.virtual_engine
        if prefill_meta is None and decode_meta.use_cuda_graph:
            graph_batch_size = model_input.input_tokens.shape[0]
            model_executable = self.graph_runners[virtual_engine][graph_batch_size]
            hidden_states = model_executable(model_input.input_tokens, model_input.input_positions, self.kv_caches,
                                             model_input.attn_metadata, model_input.num_real_rows)
        else:
            hidden_states = self.model(input_ids=model_input.input_tokens, positions=model_input.input_positions,
                                       kv_caches=self.kv_caches, attn_metadata=model_input.attn_metadata)
        return self.model.compute_logits(hidden_states, model_input.selected_token_indices)


# --- vllm/spec_decode (reduced) ---------------------------------------------------------------------------------------

class BatchExpansionTop1Scorer:
    def __init__(self, scorer_worker: ModelRunner):
        self._scorer_worker = scorer_worker

    def score_proposals(self, seq_group_metadata_list, proposal_token_ids_list):
        target_seq_group_metadata_list = self._expand_batch(seq_group_metadata_list, proposal_token_ids_list)
        model_input = self._scorer_worker.prepare_model_input(target_seq_group_metadata_list)
        logits = self._scorer_worker.execute_model(model_input)
        return logits.reshape(len(seq_group_metadata_list), NUM_SPECULATIVE_TOKENS + 1, VOCAB)

    def _expand_batch(self, seq_group_metadata_list, proposal_token_ids_list):
        target_seq_ids_iter = itertools.count(1000)
        return list(itertools.chain.from_iterable(
            self._create_target_seq_group_metadata(seq_group_metadata, proposal_token_ids_list, i,
                                                   target_seq_ids_iter)
            for i, seq_group_metadata in enumerate(seq_group_metadata_list)))

    def _create_target_seq_group_metadata(self, input_seq_group_metadata, proposal_token_ids, batch_index,
                                          target_seq_ids_iter):
        assert not input_seq_group_metadata.is_prompt
        input_seq_id = next(iter(input_seq_group_metadata.seq_data.keys()))
        proposals = proposal_token_ids[batch_index]
        token_ids_to_score = [proposals[:i] for i in range(len(proposals) + 1)]
        return [self._create_single_target_seq_group_metadata(input_seq_group_metadata, input_seq_id,
                                                              next(target_seq_ids_iter), token_ids)
                for token_ids in token_ids_to_score]

    @staticmethod
    def _create_single_target_seq_group_metadata(seq_group_metadata, seq_id, target_seq_id, token_ids):
        return SequenceGroupMetadata(
            request_id=seq_group_metadata.request_id, is_prompt=seq_group_metadata.is_prompt,
            seq_data={target_seq_id: [*seq_group_metadata.seq_data[seq_id], *token_ids]},
            block_tables={target_seq_id: seq_group_metadata.block_tables[seq_id]})


class SpecDecodeWorker:
    def __init__(self, model, device, enforce_eager: bool):
        self.model = model
        self.scorer_worker = ModelRunner(model, device, enforce_eager)
        self.scorer = BatchExpansionTop1Scorer(self.scorer_worker)

    def get_spec_proposals(self, seq_group_metadata_list):
        """Stand-in proposer: each sequence's last token, proposed k times."""
        return [[next(iter(sgm.seq_data.values()))[-1]] * NUM_SPECULATIVE_TOKENS for sgm in seq_group_metadata_list]

    def _run_speculative_decoding_step(self, seq_group_metadata_list):
        proposals = self.get_spec_proposals(seq_group_metadata_list)
        proposal_scores = self.scorer.score_proposals(seq_group_metadata_list, proposals)
        return self._verify_tokens(proposal_scores, proposals), proposal_scores

    @staticmethod
    def _verify_tokens(proposal_scores, proposals):
        """Greedy rejection sampling: keep draft tokens while they match the target, then the target's token."""
        target_token_ids = torch.argmax(proposal_scores, dim=-1).tolist()
        accepted = []
        for target, draft in zip(target_token_ids, proposals):
            n = 0
            while n < len(draft) and draft[n] == target[n]:
                n += 1
            accepted.append(draft[:n] + [target[n]])
        return accepted


# --- the engine loop (LLMEngine.step, reduced) ------------------------------------------------------------------------

def _serve(device, enforce_eager):
    model = LlamaForCausalLM(device)
    worker = SpecDecodeWorker(model, device, enforce_eager)
    gen = generator(11)
    blocks_per_seq = MAX_MODEL_LEN // BLOCK_SIZE
    requests = []
    for i, (prompt_len, max_tokens) in enumerate(((5, 7), (4, 2))):
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()
        requests.append({"sgm": SequenceGroupMetadata(
            request_id=f"req-{i}", is_prompt=True, seq_data={i: prompt},
            block_tables={i: list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))}),
            "max_tokens": max_tokens, "generated": 0})
    outs = []
    # prefill (eager in both runs)
    logits = worker.scorer_worker.execute_model(worker.scorer_worker.prepare_model_input([r["sgm"] for r in requests]))
    outs.append(logits.clone())
    for r, token in zip(requests, torch.argmax(logits, -1).tolist()):
        r["sgm"].is_prompt = False
        next(iter(r["sgm"].seq_data.values())).append(token)
        r["generated"] = 1
    running = [r for r in requests if r["generated"] < r["max_tokens"]]
    while running:
        accepted, scores = worker._run_speculative_decoding_step([r["sgm"] for r in running])
        outs.append(scores.clone())
        for r, new_tokens in zip(running, accepted):
            new_tokens = new_tokens[:r["max_tokens"] - r["generated"]]
            next(iter(r["sgm"].seq_data.values())).extend(new_tokens)
            r["generated"] += len(new_tokens)
        running = [r for r in running if r["generated"] < r["max_tokens"]]
    outs.append(torch.tensor([t for r in requests for t in next(iter(r["sgm"].seq_data.values()))]))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, enforce_eager=False), lambda: _serve(device, enforce_eager=True))
