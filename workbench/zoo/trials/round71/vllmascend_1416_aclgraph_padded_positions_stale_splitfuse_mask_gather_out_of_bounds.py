"""ACL-graph padding hands the split-fuse mask builder stale ``positions`` rows: the mask gather goes out of bounds.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/1416 ("[Bugfix] Reset all unused positions to prevent
out-of-bounds in GatherV3", commit 2690697caa, merged 2025-06-26; closes issue #1038; v0.9.1 backport #1397).
Symptom: with the V1 engine and ACL graphs (piecewise) on, a benchmark run fails sporadically in a chunked-prefill
(split-fuse) step: ``gather_v3_base.h:137: Assertion `(0 <= val && val < this->gxSize_)' Index 308 out of
range[0 273)!``. Hard to reproduce; eager mode (``enforce_eager``) is fine.
Mechanism: ``NPUModelRunner._process_reqs`` pads the step to a captured size only when ``self.use_aclgraph``
(``num_input_tokens = self.vllm_config.pad_for_cudagraph(total_num_scheduled_tokens)``; the else branch, "# Eager
mode.", does not pad). It copies only the real rows into the persistent ``self.positions`` buffer
(``self.positions[:total_num_scheduled_tokens].copy_(self.positions_cpu[:total_num_scheduled_tokens])``) and then
takes ``positions = self.positions[:num_input_tokens]``: the padded rows still hold the positions an earlier,
larger batch wrote there. Those ``positions`` go to the captured model pieces (rotary embedding) and, for a
``ChunkedPrefill`` step, to ``_make_attention_mask`` -> ``AttentionMaskBuilder.get_splitfuse_attn_mask``, which
builds ``attn_mask = get_attn_mask(max_seq_len) * -10000`` (a ``max_seq_len x max_seq_len`` mask, for a bf16
model) and gathers its rows with ``torch.index_select(attn_mask, dim=0, index=position)`` (GatherV3 on the NPU).
A stale position from a long earlier request is >= this step's ``max_seq_len``: the gather's bounds assertion
fires. (vLLM builds its masks from other arguments, so the same stale rows are harmless there.)
Doctor: stale-padding, at ``_process_reqs`` (it hands ``self.positions[:num_input_tokens]`` to the graph pieces and
to the split-fuse mask gather but wrote only the real rows, so whether the step survives depends on what the padded
rows of the static ``positions`` buffer still hold from an earlier batch).
Fix (upstream): one line in ``_process_reqs``, before the copy: ``self.positions[total_num_scheduled_tokens:
num_input_tokens].zero_()``; padded tokens then gather mask row 0, always in range.
Modelled: one decoder layer, 2 heads of size 4, float32 compute (the runner's ``dtype`` is bf16 only to pick the
mask value, as upstream). Piecewise ACL graphs: piece 0 (embedding, QKV projection, neox rotary on ``positions``)
and piece 1 (o_proj + MLP) are captured per size in ``aclgraph_batch_sizes`` [1, 2, 4, 8]; the attention
(``reshape_and_cache`` + ``_npu_flash_attention`` / ``_npu_paged_attention_splitfuse``) runs eagerly between them
on real rows only, and ``compute_logits`` runs eagerly on the sampled rows. ``torch.index_select`` on the NPU is
GatherV3, which checks its indices: ``_gather_v3`` makes that check explicit (eager code, outside any capture), so
the bug raises the same error on the CPU and on a GPU. Input batch, scheduler and sampler are reduced to a fixed
schedule with teacher-forced tokens: A (14-token prompt, two chunks), then B and C; at step 3 B decodes and C
prefills 2 tokens (3 tokens padded to 4), and padded row 3 still holds A's position 11 from step 2 while
``max_seq_len`` is 3.
"""
from __future__ import annotations

import enum

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/1416"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_process_reqs"
SYMPTOM = ("GatherV3 index out of range in a chunked-prefill step under ACL graphs: the padded rows of "
           "self.positions keep an earlier batch's positions and the split-fuse mask is gathered by them")

VOCAB, HIDDEN, NUM_HEADS, HEAD_SIZE = 32, 16, 2, 4
BLOCK_SIZE, BLOCKS_PER_REQ = 4, 4
MAX_NUM_TOKENS = 16
CUDAGRAPH_CAPTURE_SIZES = [8, 4, 2, 1]                 # vLLM keeps them in descending order
ROPE_THETA = 10000.0

PROMPTS = {"A": 14, "B": 2, "C": 2, "D": 3}
REQ_INDEX = {"A": 0, "B": 1, "C": 2, "D": 3}            # fixed block-table rows / KV blocks per request
# (request, tokens scheduled) per step; a request's first token is at its num_computed_tokens
SCHEDULE = (
    (("A", 8),),                                       # A's first prefill chunk (PrefillNoCache), 8 -> 8
    (("A", 6), ("B", 2)),                              # A's last chunk + B's prompt (ChunkedPrefill), 8 -> 8
    (("B", 1), ("C", 2)),                              # A finished; B decodes, C prefills (ChunkedPrefill), 3 -> 4
    (("B", 1), ("C", 1), ("D", 3)),                    # ChunkedPrefill, 5 -> 8
)


class AscendAttentionState(enum.Enum):
    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3


# --- vllm_ascend/attention/attention.py -----------------------------------------------------------------

def generate_attn_mask(max_seq_len: int, dtype=torch.float16, mask_value=None):
    mask_flag = torch.tril(torch.ones((max_seq_len, max_seq_len), dtype=torch.bool)).view(max_seq_len, max_seq_len)
    mask_flag = ~mask_flag
    if mask_value is None:
        mask_value = torch.finfo(torch.float32).min if dtype == torch.float16 else 1
    return torch.masked_fill(torch.zeros(size=(max_seq_len, max_seq_len)), mask_flag, mask_value).to(dtype)


def _gather_v3(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``torch.index_select(x, 0, index)`` as the NPU runs it: the GatherV3 kernel asserts every index."""
    bad = (index < 0) | (index >= x.shape[0])
    if bool(bad.any()):
        val = int(index[bad][0])
        raise RuntimeError(f"gather_v3_base.h:137: Assertion `(0 <= val && val < this->gxSize_)' "
                           f"Index {val} out of range[0 {x.shape[0]})!")
    return torch.index_select(x, dim=0, index=index)


class AttentionMaskBuilder:
    def __init__(self, attn_mask: torch.Tensor):
        self._seq_len_cached = attn_mask.shape[0]
        self.attn_mask_cache = attn_mask
        self.splitfuse_mask_value = -10000

    @classmethod
    def initialize_from_len(cls, max_seq_len: int, dtype=torch.float16, mask_value=None):
        return cls(generate_attn_mask(max_seq_len, dtype, mask_value))

    def update_attn_cache(self, seqlen: int, dtype, device):
        if seqlen > self._seq_len_cached or self.attn_mask_cache.dtype != dtype:
            self._seq_len_cached = seqlen
            self.attn_mask_cache = generate_attn_mask(seqlen, dtype)
        if self.attn_mask_cache.device != torch.device(device):
            self.attn_mask_cache = self.attn_mask_cache.to(device)

    def get_attn_mask(self, max_seq_len: int, dtype, device):
        self.update_attn_cache(max_seq_len, dtype, device)
        return self.attn_mask_cache[:max_seq_len, :max_seq_len].contiguous()

    def get_splitfuse_attn_mask(self, seq_lens, query_lens, position, dtype, device) -> torch.Tensor:
        max_seq_len = max(seq_lens, default=0)
        assert max_seq_len <= self._seq_len_cached          # (the longer-than-cache branch is not modelled)
        self.update_attn_cache(max_seq_len, dtype, device)
        if self.attn_mask_cache.numel() > 1 and self.attn_mask_cache[0][1] > 0:
            attn_mask = self.get_attn_mask(max_seq_len, dtype, device)
            attn_mask *= -10000
        else:
            attn_mask = self.attn_mask_cache
        return _gather_v3(attn_mask, position)[:, :max_seq_len]


# --- vllm_ascend/attention/attention_v1.py ----------------------------------------------------------------

class AscendMetadata:
    def __init__(self, num_actual_tokens, block_tables, query_lens, seq_lens, slot_mapping, attn_state, attn_mask):
        self.num_actual_tokens = num_actual_tokens
        self.block_tables, self.query_lens, self.seq_lens = block_tables, query_lens, seq_lens
        self.slot_mapping, self.attn_state, self.attn_mask = slot_mapping, attn_state, attn_mask
        self.num_input_tokens = 0


def _attend(q, k, v, bias):
    """q [n, H, D], k/v [s, H, D], bias [n, s] added to the scores."""
    scores = torch.einsum("nhd,shd->hns", q, k) / HEAD_SIZE ** 0.5 + bias[None]
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v)


class AscendAttentionBackendImpl:
    def forward(self, query, key, value, kv_cache, attn_metadata, output):
        """Piecewise graphs split here: this runs eagerly on the real tokens of the (padded) piece-0 outputs."""
        output.zero_()
        if attn_metadata is None:                            # dummy / capture runs
            return output
        n = attn_metadata.num_actual_tokens
        query = query.view(-1, NUM_HEADS, HEAD_SIZE)
        key = key.view(-1, NUM_HEADS, HEAD_SIZE)
        value = value.view(-1, NUM_HEADS, HEAD_SIZE)
        key_cache, value_cache = kv_cache
        key_cache[attn_metadata.slot_mapping] = key[:n]      # torch_npu._npu_reshape_and_cache
        value_cache[attn_metadata.slot_mapping] = value[:n]
        out = output.view(-1, NUM_HEADS, HEAD_SIZE)
        row = 0
        for i, (q_len, seq_len) in enumerate(zip(attn_metadata.query_lens.tolist(),
                                                 attn_metadata.seq_lens.tolist())):
            blocks = attn_metadata.block_tables[i]
            slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=blocks.device)).reshape(-1)
            k, v = key_cache[slots[:seq_len]], value_cache[slots[:seq_len]]
            q = query[row:row + q_len]
            if attn_metadata.attn_state == AscendAttentionState.PrefillNoCache:
                # torch_npu._npu_flash_attention: mask value 1 = masked (bf16 model)
                mask = attn_metadata.attn_mask[:q_len, :seq_len].float()
                bias = mask.masked_fill(mask != 0, float("-inf"))
            elif attn_metadata.attn_state == AscendAttentionState.DecodeOnly:
                bias = torch.zeros(q_len, seq_len, device=q.device)     # _npu_paged_attention
            else:
                # torch_npu._npu_paged_attention_splitfuse: adds the gathered mask rows of its query rows
                bias = attn_metadata.attn_mask[row:row + q_len, :seq_len].float()
            out[row:row + q_len] = _attend(q, k, v, bias)
            row += q_len
        return output


# --- the model: one layer, split into two ACL-graph pieces around the attention --------------------------

class Model:
    def __init__(self, device):
        gen = generator(1416)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.qkv_proj = randn(HIDDEN, 3 * NUM_HEADS * HEAD_SIZE, gen=gen, device=device, scale=0.4)
        self.o_proj = randn(NUM_HEADS * HEAD_SIZE, HIDDEN, gen=gen, device=device, scale=0.4)
        self.mlp = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_SIZE, 2, device=device).float() / HEAD_SIZE))

    def rotary_emb(self, positions, x):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x = x.view(x.shape[0], NUM_HEADS, HEAD_SIZE)
        x1, x2 = x[..., : HEAD_SIZE // 2], x[..., HEAD_SIZE // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(1)

    def piece0(self, input_ids, positions):
        x = self.embed_tokens[input_ids]
        q, k, v = (x @ self.qkv_proj).chunk(3, dim=-1)
        return self.rotary_emb(positions, q), self.rotary_emb(positions, k), v.contiguous()

    def piece1(self, attn_output):
        h = attn_output @ self.o_proj
        return h + torch.tanh(h @ self.mlp)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm_ascend/worker/model_runner_v1.py -----------------------------------------------------------------

class NPUModelRunner:
    def __init__(self, model, device, variant, enforce_eager: bool):
        self.model, self.device, self.variant = model, device, variant
        self.dtype = torch.bfloat16
        self.use_aclgraph = not enforce_eager                # compilation level PIECEWISE
        self.aclgraph_batch_sizes = list(reversed(CUDAGRAPH_CAPTURE_SIZES))
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.input_ids_cpu = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64)
        self.positions_cpu = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64)
        self.positions_np = self.positions_cpu.numpy()
        self.arange_np = np.arange(MAX_NUM_TOKENS, dtype=np.int64)
        self.attn_output = torch.zeros(MAX_NUM_TOKENS, NUM_HEADS * HEAD_SIZE, device=device)
        self.attn_mask_builder = AttentionMaskBuilder.initialize_from_len(BLOCK_SIZE * BLOCKS_PER_REQ, self.dtype)
        self.attn_impl = AscendAttentionBackendImpl()
        n_slots = len(REQ_INDEX) * BLOCKS_PER_REQ * BLOCK_SIZE
        self.kv_caches = (torch.zeros(n_slots, NUM_HEADS, HEAD_SIZE, device=device),
                          torch.zeros(n_slots, NUM_HEADS, HEAD_SIZE, device=device))
        self.block_table_cpu = torch.arange(len(REQ_INDEX) * BLOCKS_PER_REQ).view(len(REQ_INDEX), BLOCKS_PER_REQ)
        self.graphs = {}

    def pad_for_cudagraph(self, batch_size: int) -> int:
        return next(s for s in self.aclgraph_batch_sizes if s >= batch_size)

    # piecewise backend: each piece has its own graph per runtime size
    def _piece0(self, num_tokens):
        return self.model.piece0(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _piece1(self, num_tokens):
        return self.model.piece1(self.attn_output[:num_tokens])

    def capture_model(self):
        for size in CUDAGRAPH_CAPTURE_SIZES:                 # _dummy_run(size), attn_metadata None
            g0, out0 = capture(lambda s=size: self._piece0(s), device=self.device, name=f"piece 0, {size} tokens",
                               static={"input_ids": self.input_ids, "positions": self.positions},
                               owner="NPUModelRunner (ACL graph, piecewise)")
            g1, out1 = capture(lambda s=size: self._piece1(s), device=self.device, name=f"piece 1, {size} tokens",
                               static={"attn_output": self.attn_output},
                               owner="NPUModelRunner (ACL graph, piecewise)")
            self.graphs[size] = (g0, out0, g1, out1)

    def _make_attention_mask(self, seq_lens, query_lens, position, attn_state):
        if attn_state == AscendAttentionState.ChunkedPrefill:
            return self.attn_mask_builder.get_splitfuse_attn_mask(seq_lens, query_lens, position, self.dtype,
                                                                  self.device)
        elif attn_state == AscendAttentionState.PrefillNoCache:
            max_seq_len = max(seq_lens, default=0)
            return self.attn_mask_builder.get_attn_mask(max_seq_len, self.dtype, self.device)
        return None

    def _process_reqs(self, batch, num_computed_tokens, token_ids):
        """``batch``: (request, tokens scheduled); returns the logits at each request's last scheduled token."""
        num_reqs = len(batch)
        num_scheduled_tokens = np.array([k for _, k in batch], dtype=np.int64)
        total_num_scheduled_tokens = int(num_scheduled_tokens.sum())
        if self.use_aclgraph and total_num_scheduled_tokens <= self.aclgraph_batch_sizes[-1]:
            # Add padding to the batch size.
            num_input_tokens = self.pad_for_cudagraph(total_num_scheduled_tokens)
        else:
            # Eager mode.
            num_input_tokens = total_num_scheduled_tokens

        computed = np.array([num_computed_tokens[r] for r, _ in batch], dtype=np.int64)
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        cu_num_tokens = np.cumsum(num_scheduled_tokens)
        cumsums_offsets = np.repeat(cu_num_tokens - num_scheduled_tokens, num_scheduled_tokens)
        sample_indices = torch.from_numpy(cu_num_tokens - 1).to(self.device)
        arange = self.arange_np[:total_num_scheduled_tokens] - cumsums_offsets
        positions_np = self.positions_np[:total_num_scheduled_tokens]
        np.add(computed[req_indices], arange, out=positions_np)

        if self.variant == "fix":
            self.positions[total_num_scheduled_tokens:num_input_tokens].zero_()
        self.positions[:total_num_scheduled_tokens].copy_(self.positions_cpu[:total_num_scheduled_tokens])
        positions = self.positions[:num_input_tokens]

        seq_lens_np = computed + num_scheduled_tokens
        seq_lens = torch.from_numpy(seq_lens_np)
        block_table = self.block_table_cpu[[REQ_INDEX[r] for r, _ in batch]]
        block_numbers = block_table[torch.from_numpy(req_indices), torch.from_numpy(positions_np // BLOCK_SIZE)]
        slot_mapping = block_numbers * BLOCK_SIZE + torch.from_numpy(positions_np % BLOCK_SIZE)

        if np.array_equal(seq_lens_np, num_scheduled_tokens):
            attn_state = AscendAttentionState.PrefillNoCache
        elif np.all(num_scheduled_tokens == 1):
            attn_state = AscendAttentionState.DecodeOnly
        else:                                                # splitfuse (chunked prefill enabled)
            attn_state = AscendAttentionState.ChunkedPrefill
        attn_mask = self._make_attention_mask(seq_lens=seq_lens_np.tolist(), query_lens=num_scheduled_tokens,
                                              position=positions, attn_state=attn_state)
        attn_metadata = AscendMetadata(total_num_scheduled_tokens, block_table.to(self.device),
                                       torch.from_numpy(num_scheduled_tokens), seq_lens,
                                       slot_mapping.to(self.device), attn_state, attn_mask)
        attn_metadata.num_input_tokens = num_input_tokens

        ids = [token_ids[r][num_computed_tokens[r] + i] for r, k in batch for i in range(k)]
        self.input_ids_cpu[:total_num_scheduled_tokens] = torch.tensor(ids, dtype=torch.int64)
        self.input_ids[:total_num_scheduled_tokens].copy_(self.input_ids_cpu[:total_num_scheduled_tokens])

        # Run forward pass
        if num_input_tokens in self.graphs and self.use_aclgraph:
            g0, out0, g1, out1 = self.graphs[num_input_tokens]
            padded = {"input_ids": self.input_ids}
            if self.variant == "bug":
                padded["positions"] = self.positions
            q, k, v = replay(g0, out0, real=total_num_scheduled_tokens, size=num_input_tokens, padded=padded)
            self.attn_impl.forward(q, k, v, self.kv_caches, attn_metadata, self.attn_output[:num_input_tokens])
            hidden_states = replay(g1, out1, real=total_num_scheduled_tokens, size=num_input_tokens)
        else:
            q, k, v = self.model.piece0(self.input_ids[:num_input_tokens], positions)
            self.attn_impl.forward(q, k, v, self.kv_caches, attn_metadata, self.attn_output[:num_input_tokens])
            hidden_states = self.model.piece1(self.attn_output[:num_input_tokens])
        for r, k in batch:
            num_computed_tokens[r] += k
        return self.model.compute_logits(hidden_states[sample_indices]).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(14160)
    token_ids = {r: torch.randint(0, VOCAB, (BLOCK_SIZE * BLOCKS_PER_REQ,), generator=gen).tolist() for r in PROMPTS}

    def serve(graphed: bool):
        runner = NPUModelRunner(model, device, variant, enforce_eager=not graphed)
        if graphed:
            runner.capture_model()
        num_computed_tokens = {r: 0 for r in PROMPTS}
        return [runner._process_reqs(batch, num_computed_tokens, token_ids) for batch in SCHEDULE]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
