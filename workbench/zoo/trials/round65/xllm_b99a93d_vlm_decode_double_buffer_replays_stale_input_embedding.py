"""Double-buffered ACL-graph VLM decode: replays read a stale ``persistent_embedding_``, never refreshed.

Upstream: https://github.com/xLLM-AI/xllm/commit/b99a93d19bc8c5032a60275ff73f43c9fb7f1e9f ("bugfix: fix VLM
decode graph double-buffer accuracy.", no PR number).
Symptom: with ACL-graph decode and ``enable_graph_double_buffer`` on, VLM models (Qwen-VL family) lose accuracy
in decode (wrong, repetitive text); text-only LLMs and single-buffer graphs are fine.
Mechanism: ``VlmExecutorImpl::run`` always set ``params.embedding.input_embedding =
model_->get_input_embeddings(tokens, params)`` (for a pure decode step a plain ``embed_tokens`` lookup, a fresh
tensor every step) and then called the inner ``AclGraphExecutorImpl::run``. The decode graph of each of the two
``graph_slots_`` was therefore captured by ``AclGraph::capture`` with
``graph_params->embedding.input_embedding = persistent_embedding(padded_num_tokens)``: the model reads that
slot's ``GraphPersistentParam::persistent_embedding_``, which ``update`` fills only when
``params.embedding.input_embedding`` is defined. Under schedule overlap the worker calls
``prepare_graph_input`` for step k+1 while step k runs: ``AclGraph::prepare_replay_inputs`` runs
``update(..., skip_token_update=true)`` on the next slot (tokens are still placeholders) and sets
``replay_inputs_prepared_``; the VLM embedding does not exist yet (it is made later, in ``run``), so that update
skips ``persistent_embedding_``. Then ``update_input_by_last_step_output`` writes the sampled tokens and sets
``graph.input_tokens_override``, and ``AclGraph::replay`` sees ``can_use_prepared_inputs`` and calls only
``update_tokens``. Nothing copies the step's embedding in: every replay of a slot embeds the tokens of that
slot's capture step, with this step's positions and KV cache.
Doctor: stale-input, at ``run`` (``VlmExecutorImpl::run`` hands the graph a host-computed embedding whose
persistent buffer the prepared replay path never refreshes, so the graph reads what the capture step left).
Fix (upstream): ``VlmExecutorImpl::run`` returns early for ``decode_only = is_decode() && !mm_data.valid()``:
``llm_executor_->run(tokens, positions, kv_caches, params)`` without a host embedding, so the graph is captured
running ``embed_tokens`` on ``persistent_tokens_``, which ``update_tokens`` refreshes at every replay.
(Read: the diff, and at its parent ``AclGraph::replay``/``prepare_replay_inputs``, ``prepare_graph_input``,
``GraphPersistentParam::update``, ``WorkerImpl::update_input_by_last_step_output``. Toy: one attention layer,
3 sequences padded to a 4-token bucket, the sampled tokens given by a script.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events, graph, host, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/commit/b99a93d19bc8c5032a60275ff73f43c9fb7f1e9f"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "run"
SYMPTOM = "VLM decode with graph double buffer: each slot's replays embed its capture step's tokens"

VOCAB, DIM, MAX_LEN, MAX_SEQS, IMAGE_TOKEN_ID = 16, 4, 12, 4, 15
MAX_TOKENS_PER_BATCH = 8
GRAPH_SLOT_COUNT = 2                        # enable_graph_double_buffer
NUM_CACHE_ROWS = (MAX_SEQS + 1) * MAX_LEN   # sequence 0 is the null sequence that padded rows write to
BUCKETS = (1, 2, 4, 8)


@dataclasses.dataclass
class ModelInputParams:
    is_decode: bool
    block_tables: torch.Tensor                       # the sequence's cache range, one per token (decode)
    mm_data: torch.Tensor | None = None              # image patches (valid only in the prefill)
    input_embedding: torch.Tensor | None = None      # params.embedding.input_embedding
    input_tokens_override: torch.Tensor | None = None  # params.graph.input_tokens_override


class Qwen2VLForConditionalGeneration:
    def __init__(self, device):
        gen = generator(99)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.w_vision, self.wq, self.wk, self.wv, self.wo = (
            randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(5))

    def get_input_embeddings(self, tokens, params):
        emb = self.embed_tokens[tokens]                      # a fresh tensor on every call
        if params.mm_data is not None:                       # encode(): the vision tower
            emb[tokens == IMAGE_TOKEN_ID] = torch.tanh(params.mm_data @ self.w_vision)
        return emb

    def forward(self, tokens, positions, kv_cache, params):
        k_cache, v_cache = kv_cache
        h = params.input_embedding if params.input_embedding is not None else self.embed_tokens[tokens]
        h = h + self.pos_embed[positions]
        slots = params.block_tables * MAX_LEN + positions
        k_cache[slots] = h @ self.wk
        v_cache[slots] = h @ self.wv
        ctx = torch.arange(MAX_LEN, device=h.device)
        rows = params.block_tables[:, None] * MAX_LEN + ctx
        scores = (k_cache[rows] @ (h @ self.wq)[:, :, None]).squeeze(-1)
        scores = scores.masked_fill(ctx[None, :] > positions[:, None], float("-inf"))
        return h + (torch.softmax(scores, -1)[:, :, None] * v_cache[rows]).sum(1) @ self.wo


class GraphPersistentParam:
    def __init__(self, device):
        self.device = device
        self.persistent_tokens_ = torch.zeros(MAX_TOKENS_PER_BATCH, dtype=torch.long, device=device)
        self.persistent_positions_ = torch.zeros(MAX_TOKENS_PER_BATCH, dtype=torch.long, device=device)
        self.persistent_block_tables_ = torch.zeros(MAX_TOKENS_PER_BATCH, dtype=torch.long, device=device)
        self.persistent_embedding_ = torch.zeros(0, device=device)    # sized on the first embedding

    def buffers(self):
        out = {"persistent_tokens_": self.persistent_tokens_, "persistent_positions_": self.persistent_positions_,
               "persistent_block_tables_": self.persistent_block_tables_}
        if self.persistent_embedding_.numel():
            out["persistent_embedding_"] = self.persistent_embedding_
        return out

    def update_tokens(self, tokens, params, actual_num_tokens, padded_num_tokens):
        graph_tokens = params.input_tokens_override if params.input_tokens_override is not None else tokens
        self.persistent_tokens_[:actual_num_tokens].copy_(graph_tokens[:actual_num_tokens])
        self.persistent_tokens_[actual_num_tokens:padded_num_tokens].zero_()        # zero_tensor_tail

    def update(self, tokens, positions, params, padded_num_tokens, return_capture_params=False,
               skip_token_update=False):
        n = positions.shape[0]
        if not skip_token_update:
            self.update_tokens(tokens, params, n, padded_num_tokens)
        self.persistent_positions_[:n].copy_(positions)
        self.persistent_positions_[n:padded_num_tokens].zero_()
        self.persistent_block_tables_[:n].copy_(params.block_tables)
        self.persistent_block_tables_[n:padded_num_tokens].zero_()
        # Update persistent embedding from input_embedding if available
        if params.input_embedding is not None:
            if self.persistent_embedding_.numel() == 0:
                self.persistent_embedding_ = torch.zeros(MAX_TOKENS_PER_BATCH, DIM, device=self.device)
            self.persistent_embedding_[:params.input_embedding.shape[0]].copy_(params.input_embedding)
        if not return_capture_params:
            return None
        return dataclasses.replace(
            params, block_tables=self.persistent_block_tables_[:padded_num_tokens],
            input_embedding=(self.persistent_embedding_[:padded_num_tokens]
                             if params.input_embedding is not None else None))


class AclGraph:
    def __init__(self, persistent_param, device):
        self.persistent_param_, self.graph_ = persistent_param, new_graph(device)
        self.num_tokens_, self.hidden_states_, self.replay_inputs_prepared_ = 0, None, False

    def capture(self, model, tokens, positions, kv_cache, params, bucket_num_tokens):
        self.num_tokens_ = b = bucket_num_tokens
        p = self.persistent_param_
        graph_params = p.update(tokens, positions, params, b, return_capture_params=True)
        events.static_buffers("GraphPersistentParam", p.buffers())
        events.persistent_state("AclGraphExecutorImpl (kv cache)", {"k_cache": kv_cache[0], "v_cache": kv_cache[1]})
        with graph(self.graph_, name=f"decode bucket {b}"):
            self.hidden_states_ = model.forward(p.persistent_tokens_[:b], p.persistent_positions_[:b],
                                                kv_cache, graph_params)
        return replay(self.graph_, self.hidden_states_, real=positions.shape[0])[:positions.shape[0]]

    def prepare_replay_inputs(self, tokens, positions, params):
        self.persistent_param_.update(tokens, positions, params, self.num_tokens_, skip_token_update=True)
        self.replay_inputs_prepared_ = True

    def replay(self, tokens, positions, params):
        n = positions.shape[0]
        replay_inputs_prepared, self.replay_inputs_prepared_ = self.replay_inputs_prepared_, False
        can_use_prepared_inputs = replay_inputs_prepared and params.input_tokens_override is not None
        if can_use_prepared_inputs:
            self.persistent_param_.update_tokens(tokens, params, n, self.num_tokens_)
        else:
            self.persistent_param_.update(tokens, positions, params, self.num_tokens_)
        return replay(self.graph_, self.hidden_states_, real=n)[:n]


@dataclasses.dataclass
class GraphSlot:
    persistent_param: GraphPersistentParam
    graphs: dict = dataclasses.field(default_factory=dict)
    is_prepared: bool = False


class AclGraphExecutorImpl:
    def __init__(self, model, kv_cache, device):
        self.model_, self.kv_cache, self.device = model, kv_cache, device
        self.graph_slots_ = [GraphSlot(GraphPersistentParam(device)) for _ in range(GRAPH_SLOT_COUNT)]
        self.next_replay_slot_, self.last_started_replay_slot_ = 0, -1

    def run(self, tokens, positions, params):
        if not params.is_decode:
            return self.model_.forward(tokens, positions, self.kv_cache, params)
        slot_idx = self.next_replay_slot_
        self.next_replay_slot_ = (slot_idx + 1) % GRAPH_SLOT_COUNT
        self.last_started_replay_slot_ = slot_idx
        slot = self.graph_slots_[slot_idx]
        slot.is_prepared = False
        bucket = next(b for b in BUCKETS if b >= positions.shape[0])
        if bucket in slot.graphs:
            return slot.graphs[bucket].replay(tokens, positions, params)
        g = AclGraph(slot.persistent_param, self.device)                        # lazy capture
        slot.graphs[bucket] = g
        return g.capture(self.model_, tokens, positions, self.kv_cache, params, bucket)

    def prepare_graph_input(self, tokens, positions, params):
        if not params.is_decode or self.last_started_replay_slot_ < 0:
            return
        slot = self.graph_slots_[(self.last_started_replay_slot_ + 1) % GRAPH_SLOT_COUNT]
        g = slot.graphs.get(next(b for b in BUCKETS if b >= positions.shape[0]))
        if slot.is_prepared or g is None:
            return
        slot.is_prepared = True
        g.prepare_replay_inputs(tokens, positions, params)


class VlmExecutorImpl:
    def __init__(self, model, kv_cache, device, variant, enable_graph):
        self.model_, self.kv_cache, self.variant = model, kv_cache, variant
        self.llm_executor_ = AclGraphExecutorImpl(model, kv_cache, device) if enable_graph else None

    def run(self, tokens, positions, params):
        if self.variant == "fix":
            decode_only = params.is_decode and params.mm_data is None
            if decode_only and self.llm_executor_ is not None:
                return self.llm_executor_.run(tokens, positions, params)
        params.input_embedding = self.model_.get_input_embeddings(tokens, params)
        if self.llm_executor_ is not None:
            return self.llm_executor_.run(tokens, positions, params)
        return self.model_.forward(tokens, positions, self.kv_cache, params)

    def prepare_graph_input(self, tokens, positions, params):
        if self.llm_executor_ is not None:
            self.llm_executor_.prepare_graph_input(tokens, positions, params)


def run(variant: str, device: str = "cpu"):
    model = Qwen2VLForConditionalGeneration(device)
    gen = generator(1)
    patches = torch.randn(2, DIM, generator=gen)
    prompts = ([3, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 7], [5, 1, 12], [2, 9])
    sampled = ([4, 13, 6], [10, 2, 11], [0, 9, 3], [14, 8, 5], [7, 7, 1], [12, 3, 9])   # next_tokens per step

    def dev(xs):
        return host(torch.tensor(xs), device).to(device, non_blocking=True)

    def serve(graphed: bool):
        kv_cache = (torch.zeros(NUM_CACHE_ROWS, DIM, device=device), torch.zeros(NUM_CACHE_ROWS, DIM, device=device))
        executor = VlmExecutorImpl(model, kv_cache, device, variant, graphed)
        lens = [len(p) for p in prompts]
        params = ModelInputParams(False, dev([s + 1 for s, p in enumerate(prompts) for _ in p]), patches.to(device))
        outs = [executor.run(dev([t for p in prompts for t in p]), dev([i for n in lens for i in range(n)]),
                             params).clone()]
        for step, next_tokens in enumerate(sampled):
            positions = dev([n + step for n in lens])
            params = ModelInputParams(True, dev([1, 2, 3]))
            token_ids = dev([-1, -2, -3])                     # placeholders until the last step's output lands
            executor.prepare_graph_input(token_ids, positions, params)     # prepare_work_before_execute
            token_ids = dev(next_tokens)                     # update_input_by_last_step_output: replace_token
            params.input_tokens_override = token_ids
            outs.append(executor.run(token_ids, positions, params).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
