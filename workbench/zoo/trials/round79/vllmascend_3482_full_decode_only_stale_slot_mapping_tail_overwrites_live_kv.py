"""MLA on FULL_DECODE_ONLY ACL graphs: stale padded ``slot_mapping`` rows make the replayed KV write hit a live slot.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/3482 ("[Fix] Clears unused slot mappings and fix accuracy
issue with MLA models when enabling `FULL_DECODE_ONLY`", commit ccb6fb9ec1, merged 2025-10-16).
Symptom: accuracy loss / garbled continuations for MLA models (DeepSeek class) with ``cudagraph_mode=FULL_DECODE_ONLY``
once the decode batch shrinks below a captured size; no error. PR: "the accuracy issue this PR fixes was caused by
stale data in `slot_mapping` being reused by subsequent inference steps". Eager mode is fine.
Mechanism: ``NPUModelRunner._prepare_inputs`` (``vllm_ascend/worker/model_runner_v1.py``) pads the step to
``num_input_tokens = vllm_config.pad_for_cudagraph(total_num_scheduled_tokens)`` when ACL graphs are on (eager:
``num_input_tokens = total_num_scheduled_tokens``), but it copies only ``slot_mapping[:total_num_scheduled_tokens]``
into the persistent ``self.slot_mapping`` (length ``max_num_tokens``) and hands the whole buffer to
``AscendCommonAttentionMetadata``. The FULL_DECODE_ONLY graph was captured from ``_dummy_run`` metadata built at the
padded size, so ``AscendMLAMetadataBuilder.build``'s ``slot_mapping[:num_actual_tokens]`` there is the first
``padded`` rows of that buffer, and the captured ``AscendMLAImpl._mla_preprocess`` -> ``exec_kv_decode``
(``npu_kv_rmsnorm_rope_cache``) writes the latent K/V of every padded row at ``slot_mapping[:padded]``. On a replay
of a smaller batch the rows ``total..padded`` still hold the slots of an earlier, larger batch. After a request
finishes, ``InputBatch.condense`` moves the last request into the freed row, so the padded tail holds that moved
request's previous slot (a live one it attends to in this very step): each layer's replayed write overwrites it with
the padded token's latent (whose hidden state, past the first layer, is that of a token that attended to nothing:
``update_mla_attn_params`` pads ``seq_lens_list`` with 0). The moved request (and every later decode) then reads a
corrupted context. Eager never writes past ``total``.
Doctor: stale-padding, at ``_prepare_inputs`` (the padded rows of ``slot_mapping`` are left as an earlier step wrote
them, and a real request's attention depends on them: the graph's KV write at those stale slots lands in the real
request's cache, which it reads in the same replay and later steps).
Fix (upstream): in ``_prepare_inputs`` after the copy, ``self.slot_mapping[total_num_scheduled_tokens:].fill_(0)``:
the padded writes go to slot 0 (the null block, which no request reads).
Modelled: a 2-layer MLA-like decoder (one latent per token per layer serving as K and V, no rope, no rmsnorm); one
KV-cache group, block size 4, block 0 the null block; one FULL_DECODE_ONLY graph at batch 4 (1 token per request).
The prompts' latents are written identically in both modes before decoding (prefill not modelled; the first
decode step takes the last prompt token). Workload: 4 requests decode, request 1 finishes after one token, and
``condense`` moves request 3 into row 1: 3 requests padded to 4, row 3 of ``slot_mapping`` still request 3's slot.
The FIA task's ``actual_seq_lengths_kv`` (rewritten by ``update_mla_attn_params`` before a replay, padded with 0) is
a task-argument buffer. ``input_ids`` and ``block_table`` padded rows stay stale as upstream (announced as padded in
both variants); they feed only the padded rows' own latents (a padded row's length is 0, so its table is unread).
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/3482"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_prepare_inputs"
SYMPTOM = ("MLA + FULL_DECODE_ONLY: padded rows of slot_mapping keep an earlier batch's slots; the replayed KV write "
           "overwrites a live request's cached latent; garbled continuations")

VOCAB, HIDDEN, LATENT, NUM_LAYERS = 16, 8, 6, 2
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 4, 3, 12
MAX_NUM_REQS = MAX_NUM_TOKENS = 4
ACLGRAPH_BATCH_SIZES = [4]              # FULL_DECODE_ONLY capture sizes (1 token per request)


# --- the model (DeepSeek-style MLA, reduced) -----------------------------------------------------------------

class Model:
    def __init__(self, device):
        gen = generator(3482)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.kv_a_proj = [randn(HIDDEN, LATENT, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.q_proj = [randn(HIDDEN, LATENT, gen=gen, device=device, scale=0.6) for _ in range(NUM_LAYERS)]
        self.o_proj = [randn(LATENT, HIDDEN, gen=gen, device=device, scale=0.8) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)


class AscendMLAMetadata:
    def __init__(self, num_actual_tokens, slot_mapping, block_table, seq_lens_list):
        self.num_actual_tokens = num_actual_tokens
        self.num_decode_tokens = num_actual_tokens
        self.slot_mapping = slot_mapping                  # builder: common_attn_metadata.slot_mapping[:num_actual]
        self.block_table = block_table
        self.seq_lens_list = list(seq_lens_list)


def npu_kv_rmsnorm_rope_cache(kv_no_split, slots, kv_cache):
    """The cache write of ``exec_kv_decode``: one latent per token at its slot."""
    kv_cache.view(-1, LATENT)[slots] = kv_no_split


def npu_fused_infer_attention_score(q, kv_cache, block_table, actual_seq_lengths_kv):
    """Decode FIA over the paged latent cache; a request of length 0 (a padded one) attends to nothing."""
    t = torch.arange(BLOCK_SIZE * MAX_BLOCKS, device=q.device)
    slots = block_table[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    kv = kv_cache.view(-1, LATENT)[slots]                                           # [B, T, L]
    valid = t[None, :] < actual_seq_lengths_kv[:, None]
    scores = (kv @ q[:, :, None]).squeeze(-1) / math.sqrt(LATENT)
    probs = torch.softmax(scores.masked_fill(~valid, -1e9), -1) * valid
    return (probs[:, :, None] * kv).sum(1)


def model_forward(model, input_ids, attn_metadata, seq_lens, kv_caches):
    """``DeepseekV2ForCausalLM.forward`` reduced: per layer ``AscendMLAImpl.forward`` (``_mla_preprocess`` writes the
    decode tokens' latents at ``slot_mapping[:num_decode_tokens]``, then ``_forward_decode``)."""
    h = model.embed_tokens[input_ids]
    n = attn_metadata.num_decode_tokens
    for layer in range(NUM_LAYERS):
        kv_no_split = h @ model.kv_a_proj[layer]
        npu_kv_rmsnorm_rope_cache(kv_no_split[:n], attn_metadata.slot_mapping[:n], kv_caches[layer])
        attn = npu_fused_infer_attention_score(h @ model.q_proj[layer], kv_caches[layer], attn_metadata.block_table,
                                               seq_lens)
        h = h + torch.tanh(attn @ model.o_proj[layer])
    return h @ model.lm_head


# --- vllm_ascend/compilation/acl_graph.py ---------------------------------------------------------------------

class FIATask:
    """The captured FIA task group's launch arguments that ``graph_task_update`` rewrites before a replay."""

    def __init__(self, size, device):
        self.actual_seq_lengths_kv = torch.zeros(size, dtype=torch.long, device=device)


def update_mla_attn_params(handle, attn_metadata, runtime_shape):
    seq_lens_list = attn_metadata.seq_lens_list
    seq_lens_list = seq_lens_list + [0] * (runtime_shape - len(seq_lens_list))
    handle.actual_seq_lengths_kv.copy_(torch.tensor(seq_lens_list, dtype=torch.long))


# --- vllm_ascend/worker/npu_input_batch.py + block_table.py (reduced) --------------------------------------

class CachedRequestState:
    def __init__(self, req_id, prompt, block_ids, max_tokens):
        self.req_id, self.token_ids, self.block_ids, self.max_tokens = req_id, list(prompt), block_ids, max_tokens
        self.num_prompt_tokens = len(prompt)

    @property
    def num_computed_tokens(self):
        return len(self.token_ids) - 1          # the last sampled token is this step's input

    def finished(self):
        return len(self.token_ids) - self.num_prompt_tokens >= self.max_tokens


class InputBatch:
    def __init__(self, device):
        self.reqs: list[CachedRequestState | None] = []
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)

    @property
    def num_reqs(self):
        return len(self.reqs)

    def remove_request(self, req_id):
        self.reqs = [None if r is not None and r.req_id == req_id else r for r in self.reqs]

    def condense(self):
        """Fill the holes left by finished requests with the requests at the end of the batch."""
        while None in self.reqs:
            hole = self.reqs.index(None)
            last = self.reqs.pop()
            if last is not None and hole < len(self.reqs):
                self.reqs[hole] = last

    def commit_block_table(self, num_reqs):
        self.block_table[:num_reqs].copy_(torch.tensor([r.block_ids for r in self.reqs], dtype=torch.long))

    def compute_slot_mapping(self):
        slots = []
        for r in self.reqs:
            pos = r.num_computed_tokens
            slots.append(r.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        return torch.tensor(slots, dtype=torch.long)


# --- vllm_ascend/worker/model_runner_v1.py (reduced) ---------------------------------------------------------

class NPUModelRunner:
    def __init__(self, model, device, use_aclgraph, variant):
        self.model, self.device, self.use_aclgraph, self.variant = model, device, use_aclgraph, variant
        self.input_batch = InputBatch(device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.kv_caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, LATENT, device=device) for _ in range(NUM_LAYERS)]
        self.aclgraph_batch_sizes = ACLGRAPH_BATCH_SIZES
        self.graphs, self.handles = {}, {}

    def pad_for_cudagraph(self, num_tokens):
        return next(b for b in self.aclgraph_batch_sizes if b >= num_tokens)

    def _build_metadata(self, num_tokens, seq_lens_list):
        return AscendMLAMetadata(num_tokens, self.slot_mapping[:num_tokens],
                                 self.input_batch.block_table[:num_tokens], seq_lens_list)

    def capture_model(self):
        for bs in self.aclgraph_batch_sizes:
            # _dummy_run -> _build_attention_metadata(force_attention=True): metadata at the padded size
            dummy = self._build_metadata(bs, [1] * bs)
            handle = FIATask(bs, self.device)
            update_mla_attn_params(handle, dummy, bs)
            input_ids = self.input_ids[:bs]
            self.handles[bs] = handle
            self.graphs[bs] = capture(
                lambda ids=input_ids, md=dummy, h=handle: model_forward(self.model, ids, md, h.actual_seq_lengths_kv,
                                                                        self.kv_caches),
                device=self.device, name=f"FULL_DECODE_ONLY bs={bs}", owner="ACLGraphWrapper (FULL_DECODE_ONLY)",
                static={"input_ids": self.input_ids, "slot_mapping": self.slot_mapping,
                        "block_table": self.input_batch.block_table,
                        "fia_task.actual_seq_lengths_kv": handle.actual_seq_lengths_kv},
                state={f"kv_caches[{i}]": c for i, c in enumerate(self.kv_caches)})

    def _prepare_inputs(self):
        num_reqs = self.input_batch.num_reqs
        total_num_scheduled_tokens = num_reqs                # pure decode: one token per request
        self.input_batch.commit_block_table(num_reqs)
        if self.use_aclgraph and total_num_scheduled_tokens <= self.aclgraph_batch_sizes[-1]:
            num_input_tokens = self.pad_for_cudagraph(total_num_scheduled_tokens)
        else:
            num_input_tokens = total_num_scheduled_tokens   # eager mode
        self.input_ids[:total_num_scheduled_tokens].copy_(
            torch.tensor([r.token_ids[-1] for r in self.input_batch.reqs], dtype=torch.long))
        slot_mapping = self.input_batch.compute_slot_mapping()
        self.slot_mapping[:total_num_scheduled_tokens].copy_(slot_mapping[:total_num_scheduled_tokens])
        if self.variant == "fix":
            self.slot_mapping[total_num_scheduled_tokens:].fill_(0)
        seq_lens_list = [r.num_computed_tokens + 1 for r in self.input_batch.reqs]
        # AscendCommonAttentionMetadata(slot_mapping=self.slot_mapping, num_actual_tokens=total, ...) -> MLA build
        attn_metadata = self._build_metadata(total_num_scheduled_tokens, seq_lens_list)
        return attn_metadata, total_num_scheduled_tokens, num_input_tokens

    def execute_model(self):
        attn_metadata, num_tokens, num_input_tokens = self._prepare_inputs()
        if self.use_aclgraph and num_input_tokens in self.graphs:
            update_mla_attn_params(self.handles[num_input_tokens], attn_metadata, num_input_tokens)
            g, out = self.graphs[num_input_tokens]
            padded = {"input_ids": self.input_ids, "block_table": self.input_batch.block_table}
            if self.variant == "bug":
                padded["slot_mapping"] = self.slot_mapping
            logits = replay(g, out, real=num_tokens, size=num_input_tokens, padded=padded)[:num_tokens].clone()
        else:
            seq_lens = torch.tensor(attn_metadata.seq_lens_list, dtype=torch.long, device=self.device)
            logits = model_forward(self.model, self.input_ids[:num_tokens], attn_metadata, seq_lens,
                                   self.kv_caches).clone()
        for r, tok in zip(self.input_batch.reqs, logits.argmax(-1).tolist()):   # greedy sampler
            r.token_ids.append(tok)
        return logits


# --- the workload -------------------------------------------------------------------------------------------

PROMPT_LENS = [3, 5, 2, 4]
BLOCK_IDS = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 0]]      # block 0: the null block
MAX_TOKENS = [4, 1, 4, 4]                                      # request 1 finishes after the first decode


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(34827)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompt_kv = [randn(NUM_BLOCKS, BLOCK_SIZE, LATENT, gen=gen, device=device) for _ in range(NUM_LAYERS)]

    def serve(use_aclgraph: bool):
        runner = NPUModelRunner(model, device, use_aclgraph, variant)
        if use_aclgraph:
            runner.capture_model()
        for cache, init in zip(runner.kv_caches, prompt_kv):     # the prompts' latents (prefill not modelled)
            cache.copy_(init)
            cache[0].zero_()
        reqs = [CachedRequestState(i, p, b, m) for i, (p, b, m) in enumerate(zip(prompts, BLOCK_IDS, MAX_TOKENS))]
        runner.input_batch.reqs = list(reqs)
        outs = []
        while runner.input_batch.num_reqs:
            outs.append(runner.execute_model())
            for r in list(runner.input_batch.reqs):
                if r.finished():
                    runner.input_batch.remove_request(r.req_id)
            runner.input_batch.condense()
        return outs + [torch.tensor(r.token_ids, dtype=torch.float64) for r in reqs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
