"""D2F static decode under CUDA graphs: the per-step reset zeroes ``slot_mapping``, so padded tokens store their K/V into live KV slot 0.

Upstream: https://github.com/SJTU-DENG-Lab/Diffulex/commit/0d511452ea43738bd8b55e111a514301ae7aac58 ("Fix
static+CUDA Graph mode and add benchmark configs", SJTU-DENG-Lab/Diffulex, commit on ``main`` 2026-01-27; no PR).
Symptom: with ``decode_mode="static"`` and CUDA graphs on (``enforce_eager=False``), the request whose KV pages start
at block 0 generates wrong text once a decode step's token count is padded up to a larger captured bucket; no error.
``enforce_eager`` gives the right text. The commit: "Fix metadata buffer initialization and padding"; the code:
"Reset buffers to safe defaults (avoid "0" being interpreted as a valid index)".
Mechanism: ``D2FModelRunner.capture_cudagraph`` (``diffulex/strategy/d2f/engine/model_runner.py``) allocates the graph
buffers with ``torch.zeros`` (``slot_mapping``, ``block_tables`` ...) and captures one graph per token bucket
(``graph_bs`` = num_seqs * ``diffusion_block_size``) with ``need_kv_cache_store=True``, so every captured attention
layer runs ``store_kvcache`` over ``slot_mapping[:bucket]``. ``run_model`` picks ``bucket_tokens = next(x for x in
self.graph_bs if x >= num_tokens)``, resets every buffer with ``for key, value in graph_vars.items(): if key !=
"outputs": value.zero_()`` and copies only ``slot_mapping[:num_tokens] = context.slot_mapping``. The padded tokens
``[num_tokens:bucket_tokens]`` therefore carry slot 0, and the store kernels (``dllm_store_kvcache_kernel_unified_*``
in ``diffulex_kernel/python/kv_cache_kernels.py``) skip only ``slot < 0``: each replayed layer writes the padded
tokens' K/V (token 0 at position 0) into slot 0 of the KV cache, the first token of whichever request owns block 0.
That request's decode attention (same replay and every later step, eager ones included) reads the corrupted K/V.
The eager path (prefill, ``enforce_eager``, more than 512 tokens) runs exactly ``num_tokens`` rows; nothing is padded.
Doctor: stale-padding, at run_model (the padded rows of ``slot_mapping`` hold 0, a valid slot, instead of the -1
sentinel; real rows' attention depends on what those padded rows hold, since their KV store lands in a live slot;
``run_model``'s reset is the line the fix changes).
Fix (upstream): ``run_model`` resets with sentinels: ``input_ids``/``positions``/``context_lens`` ``zero_()``,
``slot_mapping.fill_(-1)``, ``block_tables.fill_(-1)``, ``cu_seqlens_q.fill_(num_tokens)`` before the copy; and
``capture_cudagraph`` allocates ``slot_mapping = torch.full((max_num_tokens,), -1)`` and ``block_tables =
torch.full(..., -1)``. The same commit's rebucketing (buckets by total ``num_tokens``, ``max_num_seqs_for_graph``
fixed, eager fallbacks when a batch does not fit) is not modelled: the pre-fix buckets are kept in both variants.
Modelled: a 2-layer, 1-head decoder (embedding + position table, q/k/v/o projections, tanh residual, lm head);
unified KV layout, block size 4; ``diffusion_block_size`` 2, ``max_num_seqs`` 4, and 8 tokens standing in for the
512-token graph limit (so ``graph_bs`` = [2, 4, 8]). ``dllm_store_kvcache_kernel_unified_bf16`` is a capture-safe
one-hot scatter that skips ``slot < 0``; ``dllm_flash_attn_decode`` is a dense masked attention of each query token
over its sequence's cached context (``block_tables`` / ``context_lens``) plus the step's own tokens of that sequence
(``cu_seqlens_q``); a padded query (outside every sequence) attends to nothing. ``cu_seqlens_k`` is not modelled.
D2F diffusion is reduced: one active diffusion block per request, one token unmasked (greedy, most confident) per
step; a finished block is re-run once as ``to_cache`` (real slots, its K/V stored) next to the new active block
(slots -1). The lm head is tied to the embedding. Graphs are captured before any request (as at engine start), so
the capture-time stores into slot 0 (bug) hit no live data. Workload: prefill A (KV blocks 0..2: slot 0 is its first prompt
token) and B; decode A, B (4 tokens, bucket 4, unpadded); prefill C; six decode steps of A, B, C with 6 (padded to
8: the bug's padded tokens overwrite slot 0), 10 (eager, over the limit), 8, 10, 8, 10 tokens. Only A's rows and
A's text differ; B and C are untouched.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/SJTU-DENG-Lab/Diffulex/commit/0d511452ea43738bd8b55e111a514301ae7aac58"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "run_model"
SYMPTOM = ("static D2F decode with CUDA graphs: run_model zeroes slot_mapping, padded tokens of a larger bucket store "
           "their K/V into KV slot 0 (a live request's first token); that request's output is wrong; eager is right")

VOCAB, MASK_TOKEN_ID, HIDDEN, NUM_LAYERS, MAX_POS = 16, 15, 8, 2, 16
BLOCK_SIZE, NUM_KV_BLOCKS, MAX_MODEL_LEN = 4, 12, 12
DIFFUSION_BLOCK_SIZE, MAX_NUM_SEQS = 2, 4
GRAPH_MAX_TOKENS = 8                    # stands in for the 512-token limit of the graph path


# --- diffulex/strategy/d2f/attention/metadata.py (reduced) -----------------------------------------------------

class D2FAttnMetaData:
    def __init__(self, is_prefill, slot_mapping, context_lens, cu_seqlens_q, block_tables, need_kv_cache_store):
        self.is_prefill = is_prefill
        self.slot_mapping = slot_mapping
        self.context_lens = context_lens
        self.cu_seqlens_q = cu_seqlens_q
        self.block_tables = block_tables
        self.need_kv_cache_store = need_kv_cache_store


_ATTN_METADATA: D2FAttnMetaData | None = None


def set_d2f_attn_metadata(*args, **kwargs):
    global _ATTN_METADATA
    _ATTN_METADATA = D2FAttnMetaData(*args, **kwargs)


def fetch_d2f_attn_metadata() -> D2FAttnMetaData:
    return _ATTN_METADATA


def reset_d2f_attn_metadata():
    global _ATTN_METADATA
    _ATTN_METADATA = None


# --- diffulex_kernel/python/kv_cache_kernels.py + dllm_flash_attn_kernels.py (stand-ins) -----------------------

def dllm_store_kvcache_kernel_unified_bf16(key, value, k_cache, v_cache, slot_mapping):
    """One program per token: ``slot = slot_mapping[token]; if slot < 0: return``; else store K/V at ``slot``.
    Written as a one-hot scatter so it captures (no data-dependent shapes); equal writes to a slot land once."""
    k_flat, v_flat = k_cache.view(-1, HIDDEN), v_cache.view(-1, HIDDEN)
    slots = torch.arange(k_flat.shape[0], device=key.device)
    onehot = (slot_mapping.long()[:, None] == slots[None, :]).to(key.dtype)          # slot < 0 matches nothing
    count = onehot.sum(0)
    written = (count > 0)[:, None]
    k_flat.copy_(torch.where(written, (onehot.T @ key) / count.clamp(min=1)[:, None], k_flat))
    v_flat.copy_(torch.where(written, (onehot.T @ value) / count.clamp(min=1)[:, None], v_flat))


def store_kvcache_unified_layout(key, value, k_cache, v_cache, slot_mapping, attn_metadata):
    dllm_store_kvcache_kernel_unified_bf16(key, value, k_cache, v_cache, slot_mapping)


def dllm_flash_attn_decode(q, k, v, k_cache, v_cache, scale, attn_metadata):
    """Each query token attends to its sequence's cached context (``block_tables``, ``context_lens``) and to the
    step's tokens of the same sequence (``cu_seqlens_q``); a token outside every sequence attends to nothing."""
    cu = attn_metadata.cu_seqlens_q.long()
    context_lens = attn_metadata.context_lens.long()
    block_tables = attn_metadata.block_tables.long()
    n, num_seqs = q.shape[0], context_lens.shape[0]
    t = torch.arange(n, device=q.device)
    seq = (cu[1:][None, :] <= t[:, None]).sum(1).clamp(max=num_seqs - 1)
    start, end = cu[seq], cu[seq + 1]
    valid_q = (t >= start) & (t < end)
    j = torch.arange(block_tables.shape[1] * BLOCK_SIZE, device=q.device)
    slots = block_tables[seq][:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE          # [n, J]
    kc, vc = k_cache.view(-1, HIDDEN)[slots], v_cache.view(-1, HIDDEN)[slots]             # [n, J, D]
    valid_c = j[None, :] < context_lens[seq][:, None]
    valid_n = (t[None, :] >= start[:, None]) & (t[None, :] < end[:, None])
    scores = torch.cat([(kc @ q[:, :, None]).squeeze(-1), q @ k.T], 1) * scale
    mask = torch.cat([valid_c, valid_n], 1) & valid_q[:, None]
    probs = torch.softmax(scores.masked_fill(~mask, -1e9), -1) * mask
    ncache = j.shape[0]
    return (probs[:, :ncache, None] * vc).sum(1) + probs[:, ncache:] @ v


def dllm_flash_attn_prefill(q, k, v, scale, attn_metadata):
    cu = attn_metadata.cu_seqlens_q.tolist()
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        outs.append(torch.softmax((q[s:e] @ k[s:e].T) * scale, -1) @ v[s:e])
    return torch.cat(outs)


# --- diffulex/attention/attn_impl.py + the model (reduced) -----------------------------------------------------

class Attention:
    def __init__(self, k_cache, v_cache):
        self.k_cache, self.v_cache, self.scale = k_cache, v_cache, 1.0 / math.sqrt(HIDDEN)

    def forward(self, q, k, v):
        attn_metadata = fetch_d2f_attn_metadata()
        if attn_metadata.need_kv_cache_store:
            store_kvcache_unified_layout(k, v, self.k_cache, self.v_cache, attn_metadata.slot_mapping, attn_metadata)
        if attn_metadata.is_prefill:
            return dllm_flash_attn_prefill(q, k, v, self.scale, attn_metadata)
        return dllm_flash_attn_decode(q, k, v, self.k_cache, self.v_cache, self.scale, attn_metadata)


class Model:
    def __init__(self, device, kv_caches):
        gen = generator(511452)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embed_positions = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.layers = []
        for k_cache, v_cache in kv_caches:
            w = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5) for _ in range(4)]
            self.layers.append((w, Attention(k_cache, v_cache)))
        self.lm_head = self.embed_tokens.T              # tied embeddings

    def __call__(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        for (wq, wk, wv, wo), attn in self.layers:
            h = h + torch.tanh(attn.forward(h @ wq, h @ wk, h @ wv) @ wo)
        return h

    def compute_logits(self, hidden):
        return hidden @ self.lm_head


# --- diffulex/strategy/d2f/engine/sequence.py (reduced) ---------------------------------------------------------

class DiffusionBlock:
    def __init__(self, start):
        self.start, self.status = start, "active"          # active -> to_cache -> in_cache


class D2FSequence:
    def __init__(self, seq_id, prompt, block_table):
        self.seq_id, self.token_ids, self.block_table = seq_id, list(prompt), block_table
        self.num_prompt_tokens = len(prompt)
        self.cached_num_tokens = 0
        self.diffusion_blocks: list[DiffusionBlock] = []

    def add_active_block(self):
        self.diffusion_blocks.append(DiffusionBlock(len(self.token_ids)))
        self.token_ids += [MASK_TOKEN_ID] * DIFFUSION_BLOCK_SIZE

    def slot(self, pos):
        return self.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def diffusion_decoding_inputs(self):
        """The step's tokens (a ``to_cache`` block, then the active one), their positions and slots, the context."""
        ids, pos, slots = [], [], []
        for blk in self.diffusion_blocks:
            if blk.status == "in_cache":
                continue
            for p in range(blk.start, blk.start + DIFFUSION_BLOCK_SIZE):
                ids.append(self.token_ids[p])
                pos.append(p)
                slots.append(self.slot(p) if blk.status == "to_cache" else -1)
        return ids, pos, slots, self.cached_num_tokens


# --- diffulex/strategy/d2f/engine/model_runner.py ---------------------------------------------------------------

class D2FModelRunner:
    def __init__(self, device, variant, enforce_eager):
        self.device, self.variant, self.enforce_eager = device, variant, enforce_eager
        self.diffusion_block_size = DIFFUSION_BLOCK_SIZE
        self.kv_caches = [(torch.zeros(NUM_KV_BLOCKS, BLOCK_SIZE, HIDDEN, device=device),
                           torch.zeros(NUM_KV_BLOCKS, BLOCK_SIZE, HIDDEN, device=device)) for _ in range(NUM_LAYERS)]
        self.model = Model(device, self.kv_caches)
        if not enforce_eager:
            self.capture_cudagraph()

    def _tensor(self, values):
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def prepare_prefill(self, seqs):
        input_ids, positions, slot_mapping, cu_seqlens_q = [], [], [], [0]
        for seq in seqs:
            n = seq.num_prompt_tokens
            input_ids += seq.token_ids[:n]
            positions += list(range(n))
            slot_mapping += [seq.slot(p) for p in range(n)]
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
        set_d2f_attn_metadata(True, self._tensor(slot_mapping), None, self._tensor(cu_seqlens_q), None, True)
        return (torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                [(seq, []) for seq in seqs])

    def prepare_decode(self, seqs):
        input_ids, positions, slot_mapping, context_lens, cu_seqlens_q, rows = [], [], [], [], [0], []
        for seq in seqs:
            ids, pos, slots, context_len = seq.diffusion_decoding_inputs()
            rows.append((seq, list(range(len(input_ids), len(input_ids) + len(ids)))))
            input_ids += ids
            positions += pos
            slot_mapping += slots
            context_lens.append(context_len)
            cu_seqlens_q.append(cu_seqlens_q[-1] + len(ids))
        need_kv_cache_store = any(s >= 0 for s in slot_mapping)
        block_tables = self._tensor([seq.block_table for seq in seqs])       # prepare_block_tables
        set_d2f_attn_metadata(False, self._tensor(slot_mapping), self._tensor(context_lens),
                              self._tensor(cu_seqlens_q), block_tables, need_kv_cache_store)
        return torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device), rows

    def run_model(self, input_ids, positions, is_prefill):
        if is_prefill or self.enforce_eager or input_ids.size(0) > GRAPH_MAX_TOKENS:
            return self.model.compute_logits(self.model(input_ids, positions))
        num_tokens = input_ids.size(0)
        context = fetch_d2f_attn_metadata()
        bucket_tokens = next(x for x in self.graph_bs if x >= num_tokens)
        graph, outputs = self.graphs[bucket_tokens]
        graph_vars = self.graph_vars
        if self.variant == "bug":
            for key, value in graph_vars.items():
                if key != "outputs":
                    value.zero_()
        else:
            # Reset buffers to safe defaults (avoid "0" being interpreted as a valid index).
            graph_vars["input_ids"].zero_()
            graph_vars["positions"].zero_()
            graph_vars["slot_mapping"].fill_(-1)
            graph_vars["context_lens"].zero_()
            graph_vars["block_tables"].fill_(-1)
        graph_vars["input_ids"][:num_tokens] = input_ids
        graph_vars["positions"][:num_tokens] = positions
        graph_vars["slot_mapping"][:num_tokens] = context.slot_mapping
        num_seqs = int(context.context_lens.numel())
        graph_vars["context_lens"][:num_seqs] = context.context_lens
        if self.variant == "fix":
            graph_vars["cu_seqlens_q"].fill_(int(num_tokens))
        graph_vars["cu_seqlens_q"][: num_seqs + 1] = context.cu_seqlens_q
        bucket_num_seqs = int(bucket_tokens // max(1, int(self.diffusion_block_size)))
        if bucket_num_seqs > num_seqs:
            graph_vars["cu_seqlens_q"][num_seqs + 1: bucket_num_seqs + 1].fill_(int(num_tokens))
        graph_vars["block_tables"][:num_seqs, : context.block_tables.size(1)] = context.block_tables
        padded = {"input_ids": graph_vars["input_ids"], "positions": graph_vars["positions"]}
        if self.variant == "bug":
            padded["slot_mapping"] = graph_vars["slot_mapping"]     # 0: a live slot, not the -1 sentinel
        hidden = replay(graph, outputs, real=num_tokens, size=bucket_tokens, padded=padded)
        return self.model.compute_logits(hidden[:num_tokens])

    def capture_cudagraph(self):
        max_num_seqs_for_graph = max(1, min(MAX_NUM_SEQS, GRAPH_MAX_TOKENS // DIFFUSION_BLOCK_SIZE))
        max_num_tokens = max_num_seqs_for_graph * DIFFUSION_BLOCK_SIZE
        max_num_blocks = (MAX_MODEL_LEN + BLOCK_SIZE - 1) // BLOCK_SIZE
        dev = self.device
        input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        if self.variant == "bug":
            slot_mapping = torch.zeros(max_num_tokens, dtype=torch.int32, device=dev)
            block_tables = torch.zeros(max_num_seqs_for_graph, max_num_blocks, dtype=torch.int32, device=dev)
        else:
            slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=dev)
            block_tables = torch.full((max_num_seqs_for_graph, max_num_blocks), -1, dtype=torch.int32, device=dev)
        context_lens = torch.zeros(max_num_seqs_for_graph, dtype=torch.int32, device=dev)
        outputs = torch.zeros(max_num_tokens, HIDDEN, device=dev)
        cu_seqlens_q = torch.zeros(max_num_seqs_for_graph + 1, dtype=torch.int32, device=dev)
        self.graph_vars = dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                               context_lens=context_lens, cu_seqlens_q=cu_seqlens_q, block_tables=block_tables,
                               outputs=outputs)

        self.graph_bs = []
        seq_bs_list = [1, 2, 4, 8] + list(range(16, max_num_seqs_for_graph + 1, 16))
        for num_seqs in sorted(set([b for b in seq_bs_list if b <= max_num_seqs_for_graph] + [max_num_seqs_for_graph])):
            self.graph_bs.append(int(num_seqs) * DIFFUSION_BLOCK_SIZE)
        self.graphs = {}
        self.graph_pool = graph_pool_handle(dev)
        for num_tokens in reversed(self.graph_bs):
            num_seqs = int(num_tokens // DIFFUSION_BLOCK_SIZE)
            cu_seqlens_q[: num_seqs + 1] = torch.arange(num_seqs + 1, dtype=torch.int32, device=dev) * DIFFUSION_BLOCK_SIZE
            context_lens[:num_seqs].fill_(MAX_MODEL_LEN)
            set_d2f_attn_metadata(False, slot_mapping[:num_tokens], context_lens[:num_seqs],
                                  cu_seqlens_q[: num_seqs + 1], block_tables[:num_seqs], True)

            def step(n=num_tokens):
                outputs[:n] = self.model(input_ids[:n], positions[:n])
                return outputs[:n]

            self.graphs[num_tokens] = capture(
                step, device=dev, pool=self.graph_pool, name=f"num_tokens={num_tokens}", owner="D2FModelRunner",
                static={k: v for k, v in self.graph_vars.items() if k != "outputs"},
                state={f"kv_cache[{i}].{kv}": c for i, pair in enumerate(self.kv_caches)
                       for kv, c in zip("kv", pair)})
            reset_d2f_attn_metadata()

    def run(self, seqs, is_prefill):
        input_ids, positions, rows = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        logits = self.run_model(input_ids, positions, is_prefill).clone()
        reset_d2f_attn_metadata()
        return logits, rows


def postprocess(logits, rows):
    """Reduced D2F sampler + block bookkeeping: greedy, one (the most confident) masked token per active block."""
    probs = torch.softmax(logits, -1)
    for seq, idx in rows:
        for blk in seq.diffusion_blocks:
            if blk.status == "to_cache":
                blk.status = "in_cache"
                seq.cached_num_tokens += DIFFUSION_BLOCK_SIZE
        if not seq.diffusion_blocks:                            # prefill done: prompt cached, first block starts
            seq.cached_num_tokens = seq.num_prompt_tokens
            seq.add_active_block()
            continue
        blk = seq.diffusion_blocks[-1]
        rows_of = {p: r for r, p in zip(idx[-DIFFUSION_BLOCK_SIZE:], range(blk.start, blk.start + DIFFUSION_BLOCK_SIZE))}
        masked = [p for p in rows_of if seq.token_ids[p] == MASK_TOKEN_ID]
        best = max(masked, key=lambda p: float(probs[rows_of[p], :MASK_TOKEN_ID].max()))
        seq.token_ids[best] = int(probs[rows_of[best], :MASK_TOKEN_ID].argmax())
        if len(masked) == 1:                                    # block finished: cache it next step, open a new one
            blk.status = "to_cache"
            seq.add_active_block()


# --- the workload -------------------------------------------------------------------------------------------

PROMPTS = {"A": [5, 9, 2, 7], "B": [3, 11, 6], "C": [8, 1, 4, 13, 10]}
BLOCK_TABLES = {"A": [0, 1, 2], "B": [3, 4, 5], "C": [6, 7, 8]}      # A owns KV block 0 (slot 0: its first token)
SCHEDULE = [("prefill", "AB"), ("decode", "AB"), ("prefill", "C")] + [("decode", "ABC")] * 6


def run(variant: str, device: str = "cpu"):
    def serve(enforce_eager: bool):
        runner = D2FModelRunner(device, variant, enforce_eager)
        seqs = {name: D2FSequence(name, PROMPTS[name], BLOCK_TABLES[name]) for name in PROMPTS}
        outs = []
        for kind, names in SCHEDULE:
            logits, rows = runner.run([seqs[n] for n in names], kind == "prefill")
            postprocess(logits, rows)
            outs.append(logits)
        return outs + [torch.tensor(seqs[n].token_ids, dtype=torch.float64) for n in PROMPTS]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
