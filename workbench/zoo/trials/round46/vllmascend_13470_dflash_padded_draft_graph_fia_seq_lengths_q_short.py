"""A DFlash draft batch padded to a FULL-graph size leaves the FIA's cumulative query lengths at the real token count.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/13470 ("[Bugfix][MRV2] Support probabilistic rejection
sampling for spec decode"), merged as commit 27a94764b5. Only its third part, the DFlash/DSpark full-graph
padding fix, is modelled; the sampler parts are not graph bugs.
Symptom: "Draft batches padded to the next cudagraph capture size (num_reqs_padded > num_reqs) leave
actual_seq_lengths_q short of the replayed graph's token count ... The Ascend FIA TND check (`queryT == last
element of actualSequenceLengthQ`) then fails and the engine aborts (e.g. 55 requests on gsm8k: 495 padded to
504)."
Mechanism: ``AscendDFlashSpeculator.build_draft_attn_metadatas(num_reqs_padded, ...)`` builds the draft metadata
with upstream ``Speculator._build_draft_attn_metadata(num_reqs=input_batch.num_reqs, num_reqs_padded,
num_tokens_padded = num_reqs_padded * num_query_per_req, ...)``. That function clamps ``query_start_loc`` at the
real ``num_reqs`` (the prepare kernel pads it with ``num_reqs * num_query_per_req``). The Ascend metadata builder
takes ``actual_seq_lengths_q = query_start_loc_cpu[1:].tolist()``, so the list ends at ``num_reqs *
num_query_per_req``. Before each FULL-graph replay, ``AscendAttentionBackendImpl.update_graph_params`` re-issues
every captured FIA task (``graph_task_update_begin``, then ``npu_fused_infer_attention_score.out(query=<the
captured query of num_tokens_padded rows>, actual_seq_lengths=metadata.actual_seq_lengths_q,
actual_seq_lengths_kv=metadata.seq_lens_list, ...)``). This combines the padded query with query lengths that
cover only the real requests, and the operator's TND tiling check raises.
Doctor: padded-shape-mismatch, at ``npu_fused_infer_attention_score`` (run at the graph's padded token count with
cumulative query lengths that stop at the real requests' tokens).
Fix (upstream): ``_update_draft_attn_metadata(attn_metadata, num_reqs_padded)`` in the DFlash and DSpark
speculators sets ``metadata.actual_seq_lengths_q = [(i + 1) * num_query_per_req for i in
range(num_reqs_padded)]`` for every layer, so the last element equals ``num_tokens_padded``. The padded
requests get ``num_query_per_req`` tokens each with KV length 0.
Read: the diff (dflash/speculator.py, dspark/speculator.py), the parent's dflash speculator with
``_prepare_dflash_inputs_kernel_ascend`` (the query_start_loc padding), and ``attention_v1.py`` (metadata builder,
``update_graph_params``). Upstream vLLM's ``_build_draft_attn_metadata`` was not read; its clamping is taken
from the PR text and the Ascend kernel's padding. The NPU graph-task update is modelled as host tiling that
writes the captured task's parameter buffers before the replay. The draft model is a one-layer stand-in with no
KV write for query tokens.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/13470"
FAMILY = "stale padded metadata"
KIND = "padded-shape-mismatch"
SITE = "npu_fused_infer_attention_score"
SYMPTOM = "FIA TND tiling check 'queryT != last element of actualSequenceLengthQ' aborts padded draft replays"

VOCAB, HIDDEN = 32, 8
NUM_QUERY_PER_REQ = 3            # bonus token + 2 parallel-drafting tokens
PARALLEL_DRAFTING_TOKEN_ID = 31
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 4, 3, 16
MAX_NUM_REQS = 4
MAX_NUM_TOKENS = MAX_NUM_REQS * NUM_QUERY_PER_REQ
CUDAGRAPH_BATCH_SIZES = [2, 4]   # draft capture sizes, in requests


@dataclasses.dataclass
class AscendMetadata:
    actual_seq_lengths_q: list
    seq_lens_list: list
    block_tables: torch.Tensor


class FIATask:
    """The parameters of one captured FIA task, which ``graph_task_update`` rewrites before a replay."""

    def __init__(self, device):
        self.cu_seqlens_q = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.seq_lens_kv = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.device = device


def npu_fused_infer_attention_score(query, block_table, actual_seq_lengths, actual_seq_lengths_kv, task):
    """FIA launch, host side (TND layout): validate and tile the host lists into the task's parameters."""
    query_t = query.shape[0]
    if query_t != actual_seq_lengths[-1]:
        raise RuntimeError(f"npu_fused_infer_attention_score: tiling failed, queryT ({query_t}) != last element "
                           f"of actualSequenceLengthQ ({actual_seq_lengths[-1]}) in TND layout")
    batch = len(actual_seq_lengths)
    t = lambda xs: torch.tensor(xs, dtype=torch.long).to(task.device)  # noqa: E731
    task.cu_seqlens_q.fill_(query_t)
    task.cu_seqlens_q[:batch].copy_(t(actual_seq_lengths))
    task.seq_lens_kv.zero_()
    task.seq_lens_kv[:batch].copy_(t(actual_seq_lengths_kv))
    task.block_table[:batch].copy_(block_table[:batch])


def fia_kernel(query, key_cache, task):
    """FIA on the device: each query token attends over its request's cached context (values = keys)."""
    tokens = torch.arange(query.shape[0], device=query.device)
    req = torch.searchsorted(task.cu_seqlens_q, tokens, right=True).clamp(max=MAX_NUM_REQS - 1)
    pos = torch.arange(MAX_BLOCKS * BLOCK_SIZE, device=query.device)
    slots = task.block_table[req][:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k = key_cache[slots]                                               # [T, ctx, H]
    scores = (k @ query[:, :, None]).squeeze(-1)
    scores = scores.masked_fill(pos[None, :] >= task.seq_lens_kv[req][:, None], -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


class DFlashDraftModel:
    def __init__(self, device):
        gen = generator(13470)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(64, HIDDEN, gen=gen, device=device, scale=0.3)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, positions, key_cache, attn_metadata, task):
        h = self.embed[input_ids] + self.pos_embed[positions]
        query = h @ self.wq
        if not is_capturing():            # eager launch: host tiling now; under capture the task is recorded
            npu_fused_infer_attention_score(query, attn_metadata.block_tables, attn_metadata.actual_seq_lengths_q,
                                            attn_metadata.seq_lens_list, task)
        return (h + fia_kernel(query, key_cache, task) @ self.wo) @ self.lm_head


class AscendDFlashSpeculator:
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        self.num_query_per_req = NUM_QUERY_PER_REQ
        self.model = DFlashDraftModel(device)
        gen = generator(134700)
        self.key_cache = randn(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, gen=gen, device=device)
        self.fia_task = FIATask(device)
        # persistent input buffers written by _prepare_dflash_inputs
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.graphs = {}
        if graphed:
            self.capture_model()

    # -- inputs and metadata ---------------------------------------------------------------------------
    def _prepare_dflash_inputs(self, requests):
        """``requests``: (bonus token, last valid position, block ids). Writes the real rows and pads the
        per-request buffers (``query_start_loc`` with the last real end, ``seq_lens`` with 0)."""
        n, q = len(requests), self.num_query_per_req
        ids, pos, qsl, lens, blocks = [], [], [], [], []
        for i, (bonus, last_pos, block_ids) in enumerate(requests):
            ids += [bonus] + [PARALLEL_DRAFTING_TOKEN_ID] * (q - 1)
            pos += [last_pos + 1 + j for j in range(q)]
            qsl.append(i * q)
            lens.append(last_pos + 1 + q)
            blocks.append(block_ids + [0] * (MAX_BLOCKS - len(block_ids)))
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        self.input_ids[:n * q].copy_(t(ids))
        self.positions[:n * q].copy_(t(pos))
        self.query_start_loc.copy_(t(qsl + [n * q] * (MAX_NUM_REQS + 1 - n)))
        self.seq_lens.copy_(t(lens + [0] * (MAX_NUM_REQS - n)))
        self.block_table[:n].copy_(t(blocks))
        self.block_table[n:].zero_()
        self.seq_lens_cpu = lens + [0] * (MAX_NUM_REQS - n)
        self.query_start_loc_cpu = qsl + [n * q] * (MAX_NUM_REQS + 1 - n)
        self.num_reqs = n

    def _build_draft_attn_metadata(self, num_reqs, num_reqs_padded, num_tokens_padded):
        """Upstream ``Speculator._build_draft_attn_metadata`` + the Ascend builder: ``query_start_loc`` stays
        clamped at the real ``num_reqs``; ``actual_seq_lengths_q = query_start_loc_cpu[1:].tolist()``."""
        query_start_loc_cpu = self.query_start_loc_cpu[:num_reqs_padded + 1]
        return {"model.layers.0.self_attn.attn": AscendMetadata(
            actual_seq_lengths_q=list(query_start_loc_cpu[1:]),
            seq_lens_list=self.seq_lens_cpu[:num_reqs_padded],
            block_tables=self.block_table[:num_reqs_padded])}

    def build_draft_attn_metadatas(self, num_reqs_padded):
        num_tokens_padded = num_reqs_padded * self.num_query_per_req
        attn_metadata = self._build_draft_attn_metadata(self.num_reqs, num_reqs_padded, num_tokens_padded)
        if self.variant == "fix":
            self._update_draft_attn_metadata(attn_metadata, num_reqs_padded)
        return [attn_metadata]

    def _update_draft_attn_metadata(self, attn_metadata, num_reqs_padded):
        query_lens_list = [(i + 1) * self.num_query_per_req for i in range(num_reqs_padded)]
        for metadata in attn_metadata.values():
            metadata.actual_seq_lengths_q = query_lens_list

    # -- FULL graph ------------------------------------------------------------------------------------
    def update_graph_params(self, attn_metadata, num_tokens):
        """``AscendAttentionBackendImpl.update_graph_params``: re-issue the captured FIA task with this step's
        metadata (``graph_task_update_begin`` / ``npu_fused_infer_attention_score.out`` / ``..._end``)."""
        query, _ = self.graphs[num_tokens][2]
        metadata = attn_metadata["model.layers.0.self_attn.attn"]
        npu_fused_infer_attention_score(query, metadata.block_tables, metadata.actual_seq_lengths_q,
                                        metadata.seq_lens_list, self.fia_task)

    def capture_model(self):
        q = self.num_query_per_req
        for size in CUDAGRAPH_BATCH_SIZES:          # dummy run: every request real
            self._prepare_dflash_inputs([(1, 0, [0])] * size)
            metadata = self.build_draft_attn_metadatas(size)[0]["model.layers.0.self_attn.attn"]
            num_tokens = size * q
            captured_query = torch.empty(num_tokens, HIDDEN, device=self.device)   # its shape: queryT
            npu_fused_infer_attention_score(captured_query, metadata.block_tables, metadata.actual_seq_lengths_q,
                                            metadata.seq_lens_list, self.fia_task)
            g, out = capture(
                lambda n=num_tokens, m=metadata: self.model.forward(self.input_ids[:n], self.positions[:n],
                                                                    self.key_cache, m, self.fia_task),
                device=self.device, owner=f"AscendDFlashSpeculator FULL draft graph ({size} reqs)",
                static={"input_ids": self.input_ids, "positions": self.positions,
                        "fia_task.cu_seqlens_q": self.fia_task.cu_seqlens_q,
                        "fia_task.seq_lens_kv": self.fia_task.seq_lens_kv,
                        "fia_task.block_table": self.fia_task.block_table})
            self.graphs[num_tokens] = (g, out, (captured_query, metadata))

    def propose(self, requests):
        self._prepare_dflash_inputs(requests)
        n, q = self.num_reqs, self.num_query_per_req
        if not self.graphed:
            attn_metadata = self.build_draft_attn_metadatas(n)[0]
            logits = self.model.forward(self.input_ids[:n * q], self.positions[:n * q], self.key_cache,
                                        attn_metadata["model.layers.0.self_attn.attn"], self.fia_task)
            return logits.clone()
        num_reqs_padded = next(s for s in CUDAGRAPH_BATCH_SIZES if s >= n)
        num_tokens_padded = num_reqs_padded * q
        attn_metadata = self.build_draft_attn_metadatas(num_reqs_padded)[0]
        self.update_graph_params(attn_metadata, num_tokens_padded)
        g, out, _ = self.graphs[num_tokens_padded]
        logits = replay(g, out, real=n * q, size=num_tokens_padded,
                        padded={"input_ids": self.input_ids, "positions": self.positions})
        return logits[:n * q].clone()


def run(variant: str, device: str = "cpu"):
    steps = [
        [(3, 4, [1, 2]), (5, 6, [3, 4]), (7, 2, [5]), (9, 5, [6, 7])],     # 4 requests: exactly a capture size
        [(11, 5, [1, 2]), (12, 7, [3, 4]), (13, 3, [5])],                  # 3 requests: padded to 4
        [(14, 8, [1, 2, 8])],                                             # 1 request: padded to 2
    ]

    def serve(graphed: bool):
        speculator = AscendDFlashSpeculator(device, variant, graphed)
        return [speculator.propose(reqs) for reqs in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
