"""vLLM-Ascend speculative decoding with replicated PCP and FULL ACL graphs: for MLA/GQA drafts the graph path of the first draft stage (draft prefill) reuses the target's attention metadata and skips the replicated-PCP preparation, so the draft's persistent block-table and slot-mapping buffers, which the captured graph reads, keep an earlier batch's (or the preceding draft decode's) layout.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/16300 ("[BugFix][SpecDecode] Refresh replicated PCP draft graph
cache mappings", vllm-project/vllm-ascend, by wzx0726, opened 2026-09-11, merged). Read: the PR description ("the first
draft stage under FULL graph replay must refresh the persistent block-table and slot-mapping buffers captured by the
draft model. The MLA/GQA path reuses target attention metadata and skips ``_prepare_replicated_prefill_attn``, leaving
those default buffers stale between batches or draft steps"; the fix extracts ``_refresh_replicated_prefill_mappings``
and reuses it from the preparation path and the MLA/GQA graph path, DSA/SFA keep their metadata rebuild); the
speculator ``vllm_ascend/worker/v2/spec_decode`` (``_prepare_replicated_prefill_attn``: guards on ``replicated_pcp``,
``attn_metadata``, ``input_batch`` and ``is_dummy``, then ``block_tables.gather_block_tables(idx_mapping,
num_reqs_padded=...)``, ``block_tables.compute_slot_mappings(idx_mapping, query_start_loc, positions,
num_tokens_padded=...)``, ``build_slot_mappings_by_layer`` and ``_build_draft_attn_metadata(step=0)``; ``_prefill``;
``build_draft_attn_metadatas(num_reqs_padded, num_tokens_padded, is_draft_model_prefill)``; ``capture``) and the
post-fix unit tests ``test_graph_prefill_builds_draft_metadata`` (gather/compute called once iff replicated PCP, the
metadata rebuilt only for DSA/SFA) and ``test_graph_prefill_refreshes_captured_cache_buffers`` (GQA/MLA: the captured
block-table and slot buffers must hold the current request's blocks and slots, at the same addresses, after "the
preceding single-token decode has left a different slot layout"). The parent commit's code itself was not available;
its MLA/GQA graph path is reconstructed from the description and the tests.
Symptom: replicated-PCP speculative decoding with MLA/GQA drafts and FULL graphs on Ascend gets a low draft acceptance
rate (the draft writes and reads its KV cache at wrong slots); no error; eager / piecewise drafts are fine.
Mechanism: the FULL draft-prefill graph was captured on the draft ``BlockTables``' persistent ``input_block_tables``
and ``slot_mappings``. In eager/piecewise mode ``_prefill`` calls ``_prepare_replicated_prefill_attn``, which refreshes
both for the current batch. In FULL mode the runner calls ``build_draft_attn_metadatas(..., is_draft_model_prefill=True)``
and replays; for GQA/MLA that path returned the target's metadata without the refresh, so the replay wrote this step's
draft KV at the slots the draft decode steps of the previous step left in ``slot_mappings`` (one token per request),
and attended through the previous batch's block-table rows (a finished request's blocks once the batch changed).
Doctor: stale-input, at build_draft_attn_metadatas. The graph reads the static block-table and slot-mapping buffers
that this step's graph path never wrote: they hold what the previous draft decode (or capture) left there.
Fix (upstream): ``_refresh_replicated_prefill_mappings`` (gather the block tables, compute the slot mappings into the
persistent buffers) is called from the MLA/GQA graph path too; the target metadata and its padded query layout are kept.
Modelled: ``BlockTables.gather_block_tables`` / ``compute_slot_mappings`` on persistent buffers (padding rows zeroed,
padded slots -1), ``_prepare_replicated_prefill_attn``, ``_refresh_replicated_prefill_mappings``,
``build_draft_attn_metadatas``, ``_prefill`` (eager path), ``capture`` (dummy batch: the preparation is bypassed) and
FULL replay of one draft-prefill graph (2 requests, 8 tokens). Stand-ins: the draft is one GQA layer (embedding plus a
projection of the target hidden states, paged causal attention per token over its request's block-table row, an MLP-free
output head), no RoPE; the target model is a table (hidden states drawn per token, sampled tokens fixed in advance); one
draft decode step per proposal runs eagerly (it refreshes the same buffers with its one-token layout); block 0 is the
null block; float64.
Workload: blocks of 4 slots; A (state row 0, blocks 1-4), B (row 1, blocks 5-8), C (row 2, blocks 9-12). Step 1: A's 5
and B's 3 prompt tokens; step 2: A 2 tokens, B 3; step 3: B finished, A 3 tokens and C's 4 prompt tokens; step 4: A 1,
C 2. Each step runs the draft prefill (graph, padded to 8 tokens) and one eager draft decode step. Bug: every real row
of every step differs (draft-prefill logits 3.03, 2.93, 2.77, 1.76 in steps 1-4; the decode logits 3.37, 3.36, 3.45,
4.03, since they read the KV the replay stored at the wrong slots): step 1 replays on the capture-time zero tables and
slots, later steps on the one-token slot layout and the block-table rows of the previous draft decode (B's row while C
runs in step 3); max |graph - eager| = 4.03. Fix: equals eager (max error 1.3e-15, float64 rounding).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/16300"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "build_draft_attn_metadatas"
SYMPTOM = ("replicated-PCP speculative decoding with MLA/GQA drafts on FULL ACL graphs: the draft-prefill graph path skips "
           "refreshing the draft's block-table and slot-mapping buffers, so the replay uses an earlier step's layout")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM = 32, 16, 2, 8
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS, MAX_NUM_REQS = 4, 4, 16, 4
NUM_REQS_PADDED, NUM_TOKENS_PADDED = 2, 8              # the one captured draft-prefill graph
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


@dataclasses.dataclass
class AscendInputBatch:
    idx_mapping: torch.Tensor          # batch row -> request state row
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    num_reqs: int
    num_tokens: int
    is_dummy: bool = False


@dataclasses.dataclass
class AscendMetadata:
    query_start_loc: torch.Tensor      # actual_seq_lengths_q as a device tensor
    attn_state: str = "DecodeOnly"


# --- vllm/v1/worker/gpu/block_table.py (persistent gathered tables and slot mappings) ---------------------------------

class BlockTables:
    def __init__(self, device):
        i32 = dict(dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, **i32)          # per request state row
        self.input_block_tables = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, **i32)    # gathered per batch row
        self.slot_mappings = torch.zeros(1, NUM_TOKENS_PADDED, **i32)             # [kv cache groups, tokens]

    def gather_block_tables(self, idx_mapping, num_reqs_padded):
        n = idx_mapping.numel()
        self.input_block_tables[:n].copy_(self.block_tables[idx_mapping.long()])
        self.input_block_tables[n:num_reqs_padded].zero_()
        return (self.input_block_tables[:num_reqs_padded],)

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded):
        out = torch.full((num_tokens_padded,), PAD_SLOT_ID, dtype=torch.int32)
        tables, qsl, pos = self.block_tables.cpu(), query_start_loc.tolist(), positions.cpu()
        for row, req_idx in enumerate(idx_mapping.tolist()):
            for t in range(qsl[row], qsl[row + 1]):
                p = int(pos[t])
                out[t] = tables[req_idx, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        self.slot_mappings[0, :num_tokens_padded].copy_(out)
        return self.slot_mappings[:, :num_tokens_padded]


def build_slot_mappings_by_layer(slot_mappings, kv_cache_config=None):
    return {"draft.layer": slot_mappings}


# --- the draft model (stand-in for the MTP / Eagle GQA draft layer) --------------------------------------------------

class DraftModel:
    def __init__(self, device):
        gen = generator(16300)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.fc = r(VOCAB, HIDDEN, scale=1.0), r(HIDDEN, HIDDEN)
        self.qkv, self.o_proj, self.lm_head = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(VOCAB, HIDDEN)

    def forward(self, input_ids, positions, hidden_states, query_start_loc, block_table, slot_mapping, kv_cache):
        h = self.embed_tokens[input_ids] + F.linear(hidden_states, self.fc)
        q, k, v = F.linear(h, self.qkv).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        k_cache, v_cache = (c.view(-1, N_HEADS, HEAD_DIM) for c in kv_cache)
        slots = slot_mapping[0].long()
        dst = torch.where(slots >= 0, slots, torch.zeros_like(slots))    # padded tokens store into the null block
        k_cache.index_copy_(0, dst, k)                                       # reshape_and_cache
        v_cache.index_copy_(0, dst, v)
        t = torch.arange(input_ids.numel(), device=input_ids.device)
        req = (t[:, None] >= query_start_loc[None, 1:]).sum(1).clamp(max=block_table.size(0) - 1)
        ctx = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=input_ids.device)
        ctx_slots = block_table[req][:, ctx // BLOCK_SIZE].long() * BLOCK_SIZE + ctx % BLOCK_SIZE
        scores = torch.einsum("thd,tchd->thc", q, k_cache[ctx_slots]) / HEAD_DIM ** 0.5
        masked = ctx[None, :] > positions[:, None]                        # causal over the request's own sequence
        p = scores.masked_fill(masked[:, None, :], float("-inf")).softmax(-1)
        h = h + F.linear(torch.einsum("thc,tchd->thd", p, v_cache[ctx_slots]).reshape(-1, HIDDEN), self.o_proj)
        return F.linear(torch.tanh(h), self.lm_head)


# --- vllm_ascend/worker/v2/spec_decode (the Ascend speculator, replicated PCP, GQA draft) ----------------------------

class AscendEagleSpeculator:
    def __init__(self, device, full_graph: bool):
        self.device, self.full_graph = device, full_graph
        self.replicated_pcp, self.attn_architecture = True, "GQA"
        self.draft_attn_layer_names = {"draft.layer"}
        self.model = DraftModel(device)
        self.block_tables = BlockTables(device)
        self.kv_cache = tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                              for _ in range(2))
        # the target runner's persistent input buffers and attention metadata (refreshed by the target each step)
        self.input_ids = torch.zeros(NUM_TOKENS_PADDED, dtype=torch.int64, device=device)
        self.positions = torch.zeros(NUM_TOKENS_PADDED, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(NUM_TOKENS_PADDED, HIDDEN, dtype=DTYPE, device=device)
        self.model_state_attn_metadata = {"draft.layer": AscendMetadata(
            torch.zeros(NUM_REQS_PADDED + 1, dtype=torch.int64, device=device))}
        self.input_batch: AscendInputBatch | None = None
        self.graph = self.logits = None

    def _build_draft_attn_metadata(self, num_reqs, num_reqs_padded, num_tokens_padded, step):
        qsl = torch.zeros(num_reqs_padded + 1, dtype=torch.int64, device=self.device)
        qsl[:num_reqs + 1].copy_(self.input_batch.query_start_loc)
        qsl[num_reqs + 1:] = self.input_batch.num_tokens
        return {"draft.layer": AscendMetadata(qsl)}

    def _refresh_replicated_prefill_mappings(self, num_reqs_padded, num_tokens_padded):
        input_batch = self.input_batch
        self.block_tables.gather_block_tables(input_batch.idx_mapping, num_reqs_padded=num_reqs_padded)
        return self.block_tables.compute_slot_mappings(input_batch.idx_mapping, input_batch.query_start_loc,
                                                       input_batch.positions, num_tokens_padded=num_tokens_padded)

    def _prepare_replicated_prefill_attn(self, attn_metadata, slot_mappings, num_reqs_padded, num_tokens_padded):
        """Rebuild global draft prefill state for replicated PCP."""
        input_batch = self.input_batch
        if not self.replicated_pcp or attn_metadata is None or input_batch is None:
            return attn_metadata, slot_mappings
        if input_batch.is_dummy:
            return attn_metadata, slot_mappings
        slot_mappings_tensor = self._refresh_replicated_prefill_mappings(num_reqs_padded, num_tokens_padded)
        slot_mappings = build_slot_mappings_by_layer(slot_mappings_tensor)
        attn_metadata = self._build_draft_attn_metadata(input_batch.num_reqs, num_reqs_padded, num_tokens_padded, step=0)
        return attn_metadata, slot_mappings

    def build_draft_attn_metadatas(self, num_reqs_padded, num_tokens_padded, is_draft_model_prefill):
        """Build draft_attn_metadatas for the FULL draft graph (before its replay)."""
        attn_metadata = {name: m for name, m in self.model_state_attn_metadata.items()
                         if name in self.draft_attn_layer_names}
        if is_draft_model_prefill:
            if self.attn_architecture in ("DSA", "SFA"):
                prepared, _ = self._prepare_replicated_prefill_attn(attn_metadata, None, num_reqs_padded,
                                                                     num_tokens_padded)
                return [prepared]
            # MLA/GQA keep the target metadata and its padded query layout
            if _variant == "fix":
                input_batch = self.input_batch
                if self.replicated_pcp and input_batch is not None and not input_batch.is_dummy:
                    self._refresh_replicated_prefill_mappings(num_reqs_padded, num_tokens_padded)
            return [attn_metadata]
        raise NotImplementedError("draft decode graphs are not modelled")

    def _run_model(self, num_tokens, attn_metadata, slot_mappings):
        return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens],
                                  self.hidden_states[:num_tokens], attn_metadata["draft.layer"].query_start_loc,
                                  self.block_tables.input_block_tables[:NUM_REQS_PADDED],
                                  slot_mappings["draft.layer"], self.kv_cache)

    def _prefill(self, num_reqs, num_tokens, attn_metadata, slot_mappings):        # eager / piecewise path
        attn_metadata, slot_mappings = self._prepare_replicated_prefill_attn(attn_metadata, slot_mappings,
                                                                             num_reqs, num_tokens)
        return self._run_model(num_tokens, attn_metadata, slot_mappings)

    def capture(self):
        """Capture the FULL draft-prefill graph on a dummy batch (the preparation is bypassed)."""
        self.input_batch = AscendInputBatch(torch.zeros(1, dtype=torch.int32), torch.tensor([0, 1]),
                                            torch.zeros(1, dtype=torch.int64), 1, 1, is_dummy=True)
        metadata = self.model_state_attn_metadata
        slots = build_slot_mappings_by_layer(self.block_tables.slot_mappings[:, :NUM_TOKENS_PADDED])

        def prefill_graph_forward():
            return self._run_model(NUM_TOKENS_PADDED, metadata, slots)

        static = {"input_ids": self.input_ids, "positions": self.positions, "hidden_states": self.hidden_states,
                  "query_start_loc": metadata["draft.layer"].query_start_loc,
                  "input_block_tables": self.block_tables.input_block_tables,
                  "slot_mappings": self.block_tables.slot_mappings}
        self.graph, self.logits = capture(prefill_graph_forward, device=self.device, static=static,
                                          state={"k_cache": self.kv_cache[0], "v_cache": self.kv_cache[1]},
                                          owner="AscendEagleSpeculator", name="draft prefill FULL graph")

    def _set_target_inputs(self, input_batch, tokens, hidden):
        """Stand-in for the target runner: its persistent inputs and metadata, padded rows neutralised."""
        n = input_batch.num_tokens
        self.input_ids.zero_()
        self.input_ids[:n].copy_(tokens)
        self.positions.zero_()
        self.positions[:n].copy_(input_batch.positions)
        self.hidden_states.zero_()
        self.hidden_states[:n].copy_(hidden)
        qsl = self.model_state_attn_metadata["draft.layer"].query_start_loc
        qsl[:input_batch.num_reqs + 1].copy_(input_batch.query_start_loc)
        qsl[input_batch.num_reqs + 1:] = n

    def propose(self, input_batch, tokens, hidden):
        self.input_batch = input_batch
        self._set_target_inputs(input_batch, tokens, hidden)
        n = input_batch.num_tokens
        if self.full_graph:
            self.build_draft_attn_metadatas(NUM_REQS_PADDED, NUM_TOKENS_PADDED, is_draft_model_prefill=True)
            logits = replay(self.graph, self.logits, real=n, size=NUM_TOKENS_PADDED)[:n].clone()
        else:
            logits = self._prefill(NUM_REQS_PADDED, n, self.model_state_attn_metadata, None).clone()
        # one draft decode step (eager stand-in): the last token of each request proposes the next
        last = input_batch.query_start_loc[1:] - 1
        draft_tokens = logits[last].argmax(-1)
        next_pos = input_batch.positions[last] + 1
        decode_batch = AscendInputBatch(input_batch.idx_mapping, torch.arange(input_batch.num_reqs + 1),
                                        next_pos, input_batch.num_reqs, input_batch.num_reqs)
        self.input_batch = decode_batch
        self._set_target_inputs(decode_batch, draft_tokens, hidden[last].tanh())
        slot_mappings = build_slot_mappings_by_layer(self._refresh_replicated_prefill_mappings(
            NUM_REQS_PADDED, decode_batch.num_tokens))
        decode_logits = self._run_model(decode_batch.num_tokens, self._build_draft_attn_metadata(
            decode_batch.num_reqs, NUM_REQS_PADDED, decode_batch.num_tokens, step=1), slot_mappings).clone()
        return [logits, decode_logits]


# --- the serving loop -------------------------------------------------------------------------------------------------

REQUESTS = {"A": (0, [1, 2, 3, 4]), "B": (1, [5, 6, 7, 8]), "C": (2, [9, 10, 11, 12])}
SCHEDULE = [[("A", 0, 5), ("B", 0, 3)], [("A", 5, 2), ("B", 3, 3)], [("A", 7, 3), ("C", 0, 4)],
            [("A", 10, 1), ("C", 4, 2)]]                  # (request, first position, tokens) per step


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(full_graph: bool):
        spec = AscendEagleSpeculator(device, full_graph)
        for row, blocks in REQUESTS.values():
            spec.block_tables.block_tables[row].copy_(torch.tensor(blocks, dtype=torch.int32))
        if full_graph:
            spec.capture()
        gen = generator(7)
        outs = []
        for step in SCHEDULE:
            idx, qsl, pos = [], [0], []
            for name, first, count in step:
                idx.append(REQUESTS[name][0])
                qsl.append(qsl[-1] + count)
                pos += list(range(first, first + count))
            n = qsl[-1]
            tokens = torch.randint(0, VOCAB, (n,), generator=gen).to(device)
            hidden = randn(n, HIDDEN, gen=gen, device=device).to(DTYPE)
            batch = AscendInputBatch(torch.tensor(idx, dtype=torch.int32).to(device), torch.tensor(qsl).to(device),
                                     torch.tensor(pos).to(device), len(step), n)
            outs += spec.propose(batch, tokens, hidden)
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
