"""LMCache's vLLM (V0) integration with CacheBlend on (``enable_blending``) wraps the model runner's
``_prepare_model_input_tensors`` so that every step attaches a ``BlendMetadata`` to the attention metadata
(``attach_blend_prompt_indices``): it walks the step's sequence groups, takes each sequence's prompt up to its entry
of ``attn_metadata.seq_lens`` and, at the end, asserted ``seq_data_idx == len(seq_lens)``, one entry per sequence.
With CUDA graphs on, vLLM V0 pads a decode batch to the next captured batch size and extends ``seq_lens`` with a
``1`` for each padded row, so ``seq_lens`` has the graph's batch size while the loop counts only the real sequences.
Every decode step whose batch is not exactly a captured size (3, 5, 6, 7, ...) fails the assertion before the
graph is replayed; with ``enforce_eager`` there is no padding and the check holds. LMCache/lmcache-vllm #50
relaxes it to ``<=``.

Upstream: https://github.com/LMCache/lmcache-vllm/pull/50 ("Fix assertion error due to cuda graph paddings.",
repository LMCache/lmcache-vllm, author XbzOnGit, opened 2025-01-06, merged; the merge commit is not known here).
Read: the PR's description in the issues corpus ("assert seq_data_idx <= len(seq_lens) instead of ==, because it can
be < due to cuda graph padding."), and two stored versions of ``lmcache_vllm/blend_adapter.py``: one with the
``==`` assertion (12,400 characters: ``BlendMetadata``, ``ReqId2Indices``, ``get_blend_indices``,
``should_process_request``, ``process_new_request``, ``attach_blend_prompt_indices``, ``do_blend``) and a later one
with ``<=`` (15,165 characters, which also has other, later changes: a tensor-parallel reduce function for
``CacheBlendImpl``, configurable separators). Also read: excerpts of three stored versions of
``lmcache_vllm/vllm_injection.py`` (``wrap_prepare_model_input_tensors``, which calls
``attach_blend_prompt_indices`` whenever ``enable_blending`` is set; and, in a later version written for vLLM
0.7.3+, ``new_execute_model``: graph runner for a decode batch with ``use_cuda_graph``, the "CacheBlend updates" of
``selected_token_indices`` after the forward; the January 2025 ``new_execute_model`` was not seen),
``lmcache_vllm/models/llama.py`` (``llama_model_forward_with_blend`` calls ``process_new_request``,
``llama_attn_forward_with_blend`` calls ``do_blend``), and excerpts of vLLM V0's ``ModelInputForGPUBuilder.build``
(``if cuda_graph_pad_size: seq_lens.extend(itertools.repeat(1, cuda_graph_pad_size))`` before
``attn_metadata_builder.build(seq_lens, ...)``) and of the start of an attention metadata builder's ``build`` (its
docstring: "seq_lens: The maybe padded sequence lengths of the input sequences").
Not read: the PR's diff page itself (the mirror of lmcache-vllm here stops in October 2024, before CacheBlend was
added; the corpus keeps only the two file versions above, so that the PR changed only this line is taken from its
description), any discussion on the PR, LMCache's own ``CacheBlendImpl``/``SPTBlendRetriever``, and the end of vLLM
V0's ``FlashAttentionMetadataBuilder.build`` (that the padded list becomes ``attn_metadata.seq_lens`` is inferred
from the call above and from the PR's description). No user report was found.
Symptom: "assertion error due to cuda graph paddings": with CacheBlend enabled and CUDA graphs on, the engine dies
with an ``AssertionError`` in ``attach_blend_prompt_indices`` at the first decode step whose batch size is not a
captured size (a batch of 3 padded to 4). With ``enforce_eager`` it runs.
Mechanism: ``_prepare_model_input_tensors`` pads a graph-eligible decode batch of ``bs`` sequences to
``graph_batch_size`` (dummy token 0, ``PAD_SLOT_ID`` slots, ``seq_len`` 1, block 0) and hands the padded ``seq_lens``
list to the attention metadata. The LMCache wrapper then runs ``attach_blend_prompt_indices`` on that metadata: the
loop reads ``seq_lens[i]`` for the ``bs`` real sequences only, and the final check compares their count with the
padded list's length. The padded rows are there only because the step is replayed through a graph captured at
``graph_batch_size``; the eager step has exactly one entry per sequence.
Doctor: padded-shape-mismatch, at ``attach_blend_prompt_indices``: host code run on the step's padded metadata
combines the graph's padded ``seq_lens`` (``graph_batch_size`` entries) with the real batch's sequence groups and
fails its own check. The fix changes only this function (its last line).
Fix (upstream): ``assert seq_data_idx == len(seq_lens)`` -> ``assert seq_data_idx <= len(seq_lens)``.
Modelled: LMCache: ``BlendMetadata``, ``ReqId2Indices`` / ``add_blend_indices`` / ``get_blend_indices`` /
``remove_request_id_indices``, ``should_process_request``, ``process_new_request``, ``attach_blend_prompt_indices``,
``do_blend`` (its retrieval path), ``wrap_prepare_model_input_tensors``, ``new_execute_model`` (graph runner or
model, then the CacheBlend update of ``selected_token_indices``), ``llama_model_forward_with_blend`` and
``llama_attn_forward_with_blend``. vLLM V0: ``SequenceData``, ``SequenceGroupMetadata``, ``AttentionMetadata``
(``seq_lens`` list, ``seq_lens_tensor``, ``prefill_metadata``/``decode_metadata``, ``use_cuda_graph``),
``ModelRunner._prepare_model_input_tensors`` with ``cuda_graph_pad_size``, ``capture_model`` over
``_BATCH_SIZES_TO_CAPTURE`` with one memory pool, ``CUDAGraphRunner`` (static input buffers copied before replay),
``LogitsProcessor`` pruning to ``selected_token_indices``, a greedy sampler, and the scheduler's prefill-then-decode
loop.
Stand-ins: the model is one attention layer and one MLP (width 16, vocab 32, float64) over a contiguous per-sequence
KV cache (a sequence's block is its row; ``PAD_SLOT_ID`` writes go to a scratch row; the attention mask is
``seq_lens_tensor``, one length per token); captured sizes are 1, 2, 4. Matrix products are written as row-wise
multiply-and-sum so that a padded batch of 4 rows and an eager batch of 3 give bit-equal rows (a CPU GEMM's blocking
depends on the row count; not part of the bug).
The LMCache engine holds nothing (no chunk was precomputed), so ``SPTBlendRetriever``'s task returns no KV for any
layer and ``do_blend`` keeps the fresh Q/K/V, as upstream does on a miss; ``CacheBlendImpl`` is never reached and is a
placeholder. Prompts are token lists (no tokenizer); each prompt is taken as two chunks split at half its length
(a made-up split: ``_new_tokenize_prompt`` would put the boundary at the separator) and ``add_blend_indices`` is
given that boundary. No separate process, no broadcast of the metadata.
Workload: four prompts (5, 6, 5, 7 tokens) with ``max_tokens`` 5, 4, 2, 3: one prefill of the four, then decode
batches of 4 (a captured size), 3 (padded to 4), 2 and 1. Outputs: each step's logits (real rows) and each
sequence's generated tokens. Eager: the same with ``enforce_eager=True``.
Measured: bug: misbehaves (raised AssertionError: ) -- a bare ``assert``, as upstream's. Traced: the prefill
(4 sequences) runs eagerly, the first decode step (4 sequences) replays the size-4 graph, and the second decode step
(3 sequences, ``seq_lens`` ``[7, 8, 9, 1]`` after padding) fails in ``attach_blend_prompt_indices`` before any replay.
The eager run's same step has ``seq_lens`` ``[7, 8, 9]`` and passes. Fix: equals eager (max |graph - eager| = 0):
decode steps of 4, 3 (padded to 4), 2 and 1 sequences replay the graphs of sizes 4, 4, 2 and 1. About 0.1 s per
variant on the CPU (plus about 1 s of imports on the first). Not run on CUDA here.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/LMCache/lmcache-vllm/pull/50"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "attach_blend_prompt_indices"
SYMPTOM = ("with CacheBlend enabled and CUDA graphs on, every decode step whose batch is padded to a captured size "
           "dies with an AssertionError: the real sequence count is asserted equal to the graph-padded seq_lens")

DTYPE = torch.float64
VOCAB, HIDDEN, MAX_POS = 32, 16, 16
MAX_SEQS = 4
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4]
PAD_SLOT_ID = -1
_variant = "bug"


def _mm(x, w):
    """``x @ w`` row by row (a CPU GEMM's blocking depends on the row count: 3 rows and the graph's 4 would differ
    in the last bits, which is not this bug)."""
    return (x[:, :, None] * w[None]).sum(1)


# --- LMCache (stand-ins): config, engine, retriever -----------------------------------------------------------------

@dataclasses.dataclass
class LMCacheEngineConfig:
    enable_blending: bool = True
    blend_min_tokens: int = 4
    blend_recompute_ratio: float = 0.15


@dataclasses.dataclass
class RetrievedKV:
    k: torch.Tensor | None
    v: torch.Tensor | None
    valid_mask: torch.Tensor | None
    original_positions: torch.Tensor | None


class LMCacheEngine:
    """Holds the KV of precomputed chunks; here none was precomputed, so every lookup misses."""

    def __init__(self, config):
        self.config, self.store = config, {}


class SPTBlendRetriever:
    def __init__(self, cache_engine):
        self.cache_engine = cache_engine

    def new_request(self, request_prompt_list, prompt_indices_list):
        keys = [tuple(p.tolist()) for p in request_prompt_list]
        engine = self.cache_engine

        class _Task:
            def result(self, layer_id):
                hits = [engine.store[k] for k in keys if k in engine.store]
                return hits[0][layer_id] if hits else RetrievedKV(None, None, None, None)
        return _Task()


class CacheBlendImpl:
    def __init__(self, recompute_ratio):
        self.recompute_ratio = recompute_ratio


_engines: dict = {}
global_blend_retriever = None
g_manually_disabled = False


# --- lmcache_vllm/blend_adapter.py ----------------------------------------------------------------------------------

@dataclasses.dataclass
class BlendMetadata:
    processed_layer_count: int
    positions: torch.Tensor
    retrieval_task: object
    blend_executor: object
    request_prompt_list: list
    prompt_indices_list: list
    selected_token_indices: torch.Tensor
    original_query_start_loc: torch.Tensor


class ReqId2Indices:
    def __init__(self):
        self._map_dict = {}

    def add_request(self, request_id, indices):
        self._map_dict[request_id] = indices

    def get_request(self, request_id):
        return self._map_dict.get(request_id, None)

    def delete_request(self, request_id):
        self._map_dict.pop(request_id, None)


global_req_id2indices = ReqId2Indices()


def add_blend_indices(request_id, indices):
    global_req_id2indices.add_request(request_id, indices)


def get_blend_indices(request_id):
    indices = global_req_id2indices.get_request(request_id)
    return indices if indices is not None else []


def remove_request_id_indices(request_id):
    global_req_id2indices.delete_request(request_id)


def should_process_request(input_ids, attn_metadata, kv_caches):
    if g_manually_disabled:
        return False
    is_profile_run = (kv_caches is None) or (kv_caches[0] is None)
    if is_profile_run:
        return False
    cache_engine = _engines["vllm-instance"]
    if len(input_ids) < cache_engine.config.blend_min_tokens:
        return False
    has_prefill = attn_metadata.prefill_metadata is not None
    has_decode = attn_metadata.decode_metadata is not None
    return has_prefill and not has_decode


def process_new_request(input_ids, positions, attn_metadata, kv_caches):
    """Creates the cacheblend related stuff and put that into the attn metadata."""
    global global_blend_retriever
    if not should_process_request(input_ids, attn_metadata, kv_caches):
        if hasattr(attn_metadata, "blend_metadata"):
            delattr(attn_metadata, "blend_metadata")
        return attn_metadata
    cache_engine = _engines["vllm-instance"]
    if global_blend_retriever is None:
        global_blend_retriever = SPTBlendRetriever(cache_engine)
    assert hasattr(attn_metadata, "blend_metadata")
    task = global_blend_retriever.new_request(attn_metadata.blend_metadata.request_prompt_list,
                                              attn_metadata.blend_metadata.prompt_indices_list)
    attn_metadata.blend_metadata.positions = positions
    attn_metadata.blend_metadata.retrieval_task = task
    attn_metadata.blend_metadata.blend_executor = CacheBlendImpl(cache_engine.config.blend_recompute_ratio)
    return attn_metadata


def attach_blend_prompt_indices(seq_group_metadata_list, attn_metadata):
    """Attach the prompts and indices after split to blend_metadata in attn_metadata."""
    assert not hasattr(attn_metadata, "blend_metadata")
    blend_metadata = BlendMetadata(0, None, None, None, [], [], None, None)
    attn_metadata.blend_metadata = blend_metadata
    seq_lens = attn_metadata.seq_lens
    seq_data_idx = 0
    for seq_group_metadata in seq_group_metadata_list:
        for seqid, seq_data in seq_group_metadata.seq_data.items():
            seq_len = seq_lens[seq_data_idx]
            if seq_group_metadata.block_tables is not None:
                indices = get_blend_indices(seq_group_metadata.request_id)
            else:
                indices = []
            attn_metadata.blend_metadata.request_prompt_list.append(
                torch.tensor(seq_data.get_token_ids()[:seq_len], device="cpu"))
            attn_metadata.blend_metadata.prompt_indices_list.append(indices)
            seq_data_idx += 1
    if _variant == "bug":
        assert seq_data_idx == len(seq_lens)            # before #50
    else:
        assert seq_data_idx <= len(seq_lens)            # #50: "it can be < due to cuda graph padding"


def do_blend(fresh_q, fresh_k, fresh_v, attn_metadata):
    """Retrieve the KV of this layer and blend it (here every lookup misses: the fresh Q/K/V are kept)."""
    blend_metadata = getattr(attn_metadata, "blend_metadata", None)
    if blend_metadata is None:
        return fresh_q, fresh_k, fresh_v, attn_metadata
    if blend_metadata.original_query_start_loc is None:
        blend_metadata.original_query_start_loc = attn_metadata.query_start_loc.clone()
    retrieved_kv = blend_metadata.retrieval_task.result(blend_metadata.processed_layer_count)
    if retrieved_kv.k is None or retrieved_kv.v is None:
        return fresh_q, fresh_k, fresh_v, attn_metadata
    raise NotImplementedError("the blend itself is not modelled (no chunk is ever cached here)")


# --- vllm (V0) ------------------------------------------------------------------------------------------------------

class SequenceData:
    def __init__(self, token_ids):
        self._token_ids = token_ids

    def get_token_ids(self):
        return self._token_ids


class SequenceGroupMetadata:
    def __init__(self, request_id, is_prompt, seq_data, block_tables):
        self.request_id, self.is_prompt = request_id, is_prompt
        self.seq_data, self.block_tables = seq_data, block_tables


class AttentionMetadata:
    def __init__(self, num_prefills, seq_lens, seq_lens_tensor, slot_mapping, block_tables, query_start_loc,
                 use_cuda_graph):
        self.num_prefills, self.seq_lens, self.seq_lens_tensor = num_prefills, seq_lens, seq_lens_tensor
        self.slot_mapping, self.block_tables, self.query_start_loc = slot_mapping, block_tables, query_start_loc
        self.use_cuda_graph = use_cuda_graph

    @property
    def prefill_metadata(self):
        return self if self.num_prefills > 0 else None

    @property
    def decode_metadata(self):
        return self if self.num_prefills == 0 else None


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(50)
        w = lambda *s, scale: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.pos_emb = w(VOCAB, HIDDEN, scale=1.0), w(MAX_POS, HIDDEN, scale=0.5)
        self.qkv_proj, self.o_proj = w(HIDDEN, 3 * HIDDEN, scale=0.4), w(HIDDEN, HIDDEN, scale=0.4)
        self.fc, self.out = w(HIDDEN, 2 * HIDDEN, scale=0.4), w(2 * HIDDEN, HIDDEN, scale=0.4)
        self.lm_head = w(HIDDEN, VOCAB, scale=0.6)

    def llama_attn_forward_with_blend(self, positions, hidden_states, kv_cache, attn_metadata):
        q, k, v = _mm(hidden_states, self.qkv_proj).split(HIDDEN, dim=-1)
        if hasattr(attn_metadata, "blend_metadata"):
            positions = attn_metadata.blend_metadata.positions
        q, k, v, attn_metadata = do_blend(q, k, v, attn_metadata)
        # reshape_and_cache: PAD_SLOT_ID writes land on the scratch row MAX_SEQS
        slots = attn_metadata.slot_mapping
        slots = torch.where(slots < 0, torch.full_like(slots, MAX_SEQS * MAX_POS), slots)
        kv_cache[0].view(-1, HIDDEN)[slots] = k
        kv_cache[1].view(-1, HIDDEN)[slots] = v
        keys, values = kv_cache[0][attn_metadata.block_tables], kv_cache[1][attn_metadata.block_tables]
        scores = (keys * q[:, None, :]).sum(-1) / math.sqrt(HIDDEN)                # [n, MAX_POS]
        valid = torch.arange(MAX_POS, device=q.device)[None, :] < attn_metadata.seq_lens_tensor[:, None]
        probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        return _mm((probs[:, :, None] * values).sum(1), self.o_proj)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        """``llama_model_forward_with_blend``."""
        attn_metadata = process_new_request(input_ids, positions, attn_metadata, kv_caches)
        h = self.embed_tokens[input_ids] + self.pos_emb[positions]
        h = h + self.llama_attn_forward_with_blend(positions, h, kv_caches[0], attn_metadata)
        return h + _mm(torch.tanh(_mm(h, self.fc)), self.out)

    def compute_logits(self, hidden_states, selected_token_indices):
        """``LogitsProcessor``: prune to the selected rows, then the LM head."""
        return _mm(hidden_states.index_select(0, selected_token_indices), self.lm_head)


class CUDAGraphRunner:
    def __init__(self, model, kv_caches):
        self.model, self.kv_caches = model, kv_caches
        self.input_buffers, self.output_buffers, self.graph = {}, {}, None

    def capture(self, input_ids, positions, attn_metadata, memory_pool, device):
        self.input_buffers = {"input_ids": input_ids, "positions": positions,
                              "slot_mapping": attn_metadata.slot_mapping,
                              "seq_lens_tensor": attn_metadata.seq_lens_tensor,
                              "block_tables": attn_metadata.block_tables}
        self.graph, hidden_states = capture(
            lambda: self.model(input_ids, positions, self.kv_caches, attn_metadata), device=device, pool=memory_pool,
            warmups=2, name=f"decode bs={input_ids.shape[0]}", owner="CUDAGraphRunner (vLLM V0)",
            static=self.input_buffers, state={"kv_cache": self.kv_caches[0]})
        self.output_buffers = {"hidden_states": hidden_states}

    def forward(self, input_ids, positions, attn_metadata, num_real):
        self.input_buffers["input_ids"].copy_(input_ids)
        self.input_buffers["positions"].copy_(positions)
        self.input_buffers["slot_mapping"].copy_(attn_metadata.slot_mapping)
        self.input_buffers["seq_lens_tensor"].copy_(attn_metadata.seq_lens_tensor)
        self.input_buffers["block_tables"].copy_(attn_metadata.block_tables)
        # the builder wrote dummy values into every padded row: none is left as it was
        return replay(self.graph, self.output_buffers["hidden_states"], real=num_real, size=input_ids.shape[0])


class ModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = LlamaForCausalLM(device)
        # one layer: [k or v, MAX_SEQS + 1 rows (the last: pad-slot scratch), MAX_POS, HIDDEN]
        self.kv_caches = [torch.zeros(2, MAX_SEQS + 1, MAX_POS, HIDDEN, dtype=DTYPE, device=device)]
        self.graph_runners = {}
        if not enforce_eager:
            self.capture_model()

    def capture_model(self):
        max_bs, d = _BATCH_SIZES_TO_CAPTURE[-1], self.device
        input_tokens = torch.zeros(max_bs, dtype=torch.long, device=d)
        input_positions = torch.zeros(max_bs, dtype=torch.long, device=d)
        slot_mapping = torch.full((max_bs,), PAD_SLOT_ID, dtype=torch.long, device=d)
        seq_lens = torch.ones(max_bs, dtype=torch.long, device=d)
        block_tables = torch.zeros(max_bs, dtype=torch.long, device=d)
        memory_pool = graph_pool_handle(d)
        for bs in reversed(_BATCH_SIZES_TO_CAPTURE):
            attn_metadata = AttentionMetadata(0, [1] * bs, seq_lens[:bs], slot_mapping[:bs], block_tables[:bs],
                                              None, True)
            runner = CUDAGraphRunner(self.model, self.kv_caches)
            runner.capture(input_tokens[:bs], input_positions[:bs], attn_metadata, memory_pool, d)
            self.graph_runners[bs] = runner

    def _prepare_model_input_tensors(self, seq_group_metadata_list):
        is_prompt = seq_group_metadata_list[0].is_prompt
        tokens, positions, slots, seq_lens, blocks, query_lens = [], [], [], [], [], []
        for sg in seq_group_metadata_list:
            (seq_id, seq_data), = sg.seq_data.items()
            ids = seq_data.get_token_ids()
            new = range(len(ids)) if is_prompt else [len(ids) - 1]
            for p in new:
                tokens.append(ids[p])
                positions.append(p)
                slots.append(sg.block_tables[seq_id][0] * MAX_POS + p)
                blocks.append(sg.block_tables[seq_id][0])
            seq_lens.append(len(ids))
            query_lens.append(len(new))
        batch_size = len(tokens)
        use_captured_graph = not is_prompt and not self.enforce_eager and batch_size <= _BATCH_SIZES_TO_CAPTURE[-1]
        if use_captured_graph:
            graph_batch_size = next(b for b in _BATCH_SIZES_TO_CAPTURE if b >= batch_size)
            cuda_graph_pad_size = graph_batch_size - batch_size
            tokens += [0] * cuda_graph_pad_size
            positions += [0] * cuda_graph_pad_size
            slots += [PAD_SLOT_ID] * cuda_graph_pad_size
            blocks += [0] * cuda_graph_pad_size
            if cuda_graph_pad_size:
                seq_lens.extend([1] * cuda_graph_pad_size)
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        per_token_seq_lens = [p + 1 for p in positions]
        query_start_loc = t([0] + torch.tensor(query_lens).cumsum(0).tolist())
        attn_metadata = AttentionMetadata(len(seq_group_metadata_list) if is_prompt else 0, seq_lens,
                                          t(per_token_seq_lens), t(slots), t(blocks), query_start_loc,
                                          use_captured_graph)
        selected = t((query_start_loc[1:] - 1).tolist())
        return dict(input_tokens=t(tokens), input_positions=t(positions), attn_metadata=attn_metadata,
                    selected_token_indices=selected, batch_size=batch_size)

    def wrap_prepare_model_input_tensors(self, seq_group_metadata_list):
        """``lmcache_vllm.vllm_injection.wrap_prepare_model_input_tensors``."""
        model_input = self._prepare_model_input_tensors(seq_group_metadata_list)
        attn_metadata = model_input["attn_metadata"]
        if attn_metadata is not None:
            if _engines["vllm-instance"].config.enable_blending:
                attach_blend_prompt_indices(seq_group_metadata_list, attn_metadata)
        return model_input

    def new_execute_model(self, model_input):
        """``lmcache_vllm.vllm_injection.new_execute_model`` (no KV retrieve/store: nothing is cached)."""
        attn_metadata = model_input["attn_metadata"]
        if attn_metadata.prefill_metadata is None and attn_metadata.decode_metadata.use_cuda_graph:
            graph_batch_size = model_input["input_tokens"].shape[0]
            hidden_states = self.graph_runners[graph_batch_size].forward(
                model_input["input_tokens"], model_input["input_positions"], attn_metadata, model_input["batch_size"])
        else:
            hidden_states = self.model(model_input["input_tokens"], model_input["input_positions"], self.kv_caches,
                                       attn_metadata)
        selected = model_input["selected_token_indices"]
        # CacheBlend updates
        if hasattr(attn_metadata, "blend_metadata") and attn_metadata.blend_metadata.selected_token_indices is not None:
            selected = attn_metadata.blend_metadata.selected_token_indices
        logits = self.model.compute_logits(hidden_states, selected)
        return logits, logits.argmax(-1).tolist()                                  # greedy sampler


class LLM:
    def __init__(self, device, enforce_eager):
        _engines["vllm-instance"] = LMCacheEngine(LMCacheEngineConfig())
        self.model_runner = ModelRunner(device, enforce_eager)

    def generate(self, prompts, max_tokens):
        seqs = [dict(id=i, tokens=list(p), prompt_len=len(p), max_tokens=m) for i, (p, m) in
                enumerate(zip(prompts, max_tokens))]
        for s in seqs:                                  # _new_tokenize_prompt: one separator after the first chunk
            add_blend_indices(str(s["id"]), [s["prompt_len"] // 2])
        running, is_prompt, step_logits = list(seqs), True, []
        while running:
            metadata = [SequenceGroupMetadata(str(s["id"]), is_prompt, {s["id"]: SequenceData(s["tokens"])},
                                              {s["id"]: [s["id"]]}) for s in running]
            model_input = self.model_runner.wrap_prepare_model_input_tensors(metadata)
            logits, next_tokens = self.model_runner.new_execute_model(model_input)
            step_logits.append(logits)
            for s, tok in zip(running, next_tokens):
                s["tokens"].append(tok)
            for s in running:
                if len(s["tokens"]) - s["prompt_len"] >= s["max_tokens"]:
                    remove_request_id_indices(str(s["id"]))
            running = [s for s in running if len(s["tokens"]) - s["prompt_len"] < s["max_tokens"]]
            is_prompt = False
        outputs = [torch.tensor(s["tokens"][s["prompt_len"]:], dtype=DTYPE) for s in seqs]
        return step_logits + outputs


def _serve(device, enforce_eager, prompts, max_tokens):
    global global_blend_retriever
    global_blend_retriever = None
    with torch.no_grad():
        return LLM(device, enforce_eager).generate(prompts, max_tokens)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(500)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 6, 5, 7)]
    # decode batches: 4 (a captured size), then 3 (padded to 4), then 2, then 1
    max_tokens = [5, 4, 2, 3]
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, False, prompts, max_tokens),
                       lambda: _serve(device, True, prompts, max_tokens))
    finally:
        _variant = "bug"
