"""FULL ACL graph on a full batch: the FIA dummy padding request overflows the ``max_num_reqs``-sized seq_lens / block_table buffers.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/10769 ("[BugFix] Pad seq_lens/block_table to fix FIA error
561002 with flashcomm1", vllm-project/vllm-ascend, commit 419755b4fb, merged 2026-06-25). Read: the commit message
(error text, root cause, the three trigger conditions, the fix) and its diff of
``AscendAttentionMetadataBuilder.build`` (``vllm_ascend/attention/attention_v1.py``), plus, at that commit,
``NPUModelRunner._pad_query_start_loc_for_fia``, the ``query_start_loc`` buffer sized ``max_num_reqs + 2`` and the
call site in ``execute_model`` (``vllm_ascend/worker/model_runner_v1.py``). The PR's test was not read.
Symptom: the server intermittently dies under load with FIA error 561002: ``The size(20) of actualSeqLengthsKv is not
equal to the batchSize(21)`` and, once that is padded, ``block table shape should be [21, >=29], now is [20, 1104]``.
Only when a step's tokens are padded (flashcomm1/SP, or a FULL graph's padded token count) and the step's real
request count fills ``max_num_seqs``. Eager steps (no padding) never hit it.
Mechanism: ``execute_model`` pads the token count to the graph size and, when ``cudagraph_mode == FULL`` (or SP),
calls ``_pad_query_start_loc_for_fia``: for a mixed batch whose ``query_start_loc[num_reqs] < num_tokens_padded`` it
inserts a dummy request (``query_start_loc[num_reqs + 1] = num_tokens_padded``) and returns ``num_reqs + 1``, so the
FIA TND constraint ``actual_seq_lengths_q[-1] == hidden_states.shape[0]`` holds at the padded size. The
``query_start_loc`` buffer has room for it (``max_num_reqs + 2``), but ``seq_lens`` and ``block_table`` are
``max_num_reqs`` long; ``build`` slices them ``[:num_reqs]`` with the padded count, which silently stops at
``max_num_reqs`` when the batch is full. FIA (``update_full_graph_params`` before the FULL graph's replay) then gets
``max_num_reqs + 1`` query lengths but ``max_num_reqs`` KV lengths and block-table rows.
Doctor: padded-shape-mismatch, at build. Run at the graph's padded request count, ``build`` combines the padded
``query_start_loc`` (``num_reqs + 1`` requests) with ``seq_lens`` / ``block_table`` cut to the real buffer size.
Fix (upstream): in ``build``, pad ``seq_lens_list``, the ``seq_lens`` tensor (with 1) and ``block_table`` (with a zero
row, block 0) up to the q-derived batch size ``len(actual_seq_lengths_q)``; the dummy request's output is discarded.
Modelled: ``NPUModelRunner`` (``_prepare_inputs``, ``_pad_query_start_loc_for_fia``, ``execute_model``) with
``cudagraph_mode = FULL`` and capture sizes [4, 8, 16]; the runner's persistent buffers (``query_start_loc``
``max_num_reqs + 2``, ``seq_lens`` and ``block_table`` ``max_num_reqs``, ``input_ids`` / ``positions`` /
``slot_mapping``); ``AscendAttentionMetadataBuilder.build`` as upstream (minus masks and states). The FULL graph is a
one-layer attention model over a paged KV cache (block 0 is the null block); FIA is a stand-in whose graph task reads
its parameters from device slots that ``update_full_graph_params`` stages before each replay, after the host-side
TND checks FIA makes (batch size from the query lengths against the KV lengths and block-table rows). Sampling is the
logits of each request's last token. SP, spec decode and the other attention states are left out.
Workload: ``max_num_seqs`` = 4. Step 1: prefills A (2 tokens), B (3), C (2): 7 tokens padded to the size-8 graph, a
dummy request 4th (fits). Step 2: A-C decode and D prefills 3 tokens: 4 requests, 6 tokens padded to 8: the dummy is
the 5th request, seq_lens / block_table stay at 4 and FIA raises (bug). Step 3: A-D decode (4 tokens, no padding).
"""
from __future__ import annotations

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/10769"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "build"
SYMPTOM = ("FULL graph mode with a full batch (num_reqs == max_num_seqs) whose tokens are padded: the dummy FIA "
           "request makes 5 query lengths but seq_lens/block_table stay at 4: 'The size(4) of actualSeqLengthsKv "
           "is not equal to the batchSize(5)' (FIA error 561002)")

VOCAB, HIDDEN = 16, 8
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 3
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
MAX_NUM_REQS, MAX_NUM_TOKENS = 4, 16
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ          # block 0: the null block
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
PAD_SLOT_ID = -1
CUDAGRAPH_CAPTURE_SIZES = [4, 8, 16]

_variant = "bug"


class torch_npu:  # noqa: N801 - the library's name
    @staticmethod
    def check_fia_tnd(actual_seq_lengths, actual_seq_lengths_kv, block_table):
        """The host-side checks ``npu_fused_infer_attention_score`` makes, in its order (error 561002)."""
        batch = len(actual_seq_lengths)
        if len(actual_seq_lengths_kv) != batch:
            raise RuntimeError(f"561002: The size({len(actual_seq_lengths_kv)}) of actualSeqLengthsKv is not equal "
                               f"to the batchSize({batch})")
        if block_table.shape[0] < batch:
            raise RuntimeError(f"561002: When page attention enable, block table shape should be [{batch}, "
                               f">={MAX_BLOCKS_PER_REQ}], now is {list(block_table.shape)}. [FUNC:CheckBlockTableShape]")


class CpuGpuBuffer:
    def __init__(self, *shape, dtype, device):
        self.cpu = torch.zeros(*shape, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(*shape, dtype=dtype, device=device)

    def copy_to_gpu(self, n=None):
        if n is None:
            self.gpu.copy_(self.cpu.to(self.gpu.device))
        else:
            self.gpu[:n].copy_(self.cpu[:n].to(self.gpu.device))
        return self.gpu


class AscendCommonAttentionMetadata:
    def __init__(self, query_start_loc_cpu, _seq_lens_cpu, block_table_tensor, num_reqs, num_actual_tokens):
        self.query_start_loc_cpu = query_start_loc_cpu
        self._seq_lens_cpu = _seq_lens_cpu
        self.block_table_tensor = block_table_tensor
        self.num_reqs = num_reqs
        self.num_actual_tokens = num_actual_tokens


class AscendMetadata:
    def __init__(self, seq_lens, seq_lens_list, actual_seq_lengths_q, block_table, num_actual_tokens):
        self.seq_lens, self.seq_lens_list = seq_lens, seq_lens_list
        self.actual_seq_lengths_q, self.block_tables = actual_seq_lengths_q, block_table
        self.num_actual_tokens = num_actual_tokens


class AscendAttentionMetadataBuilder:
    def build(self, common_attn_metadata):
        num_reqs = common_attn_metadata.num_reqs              # the padded request count under a FULL graph
        query_start_loc_cpu = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1]
        block_table = common_attn_metadata.block_table_tensor
        seq_lens = common_attn_metadata._seq_lens_cpu[:num_reqs]   # a max_num_reqs buffer: stops there
        actual_seq_lengths_q = query_start_loc_cpu[1:].tolist()
        seq_lens_list = seq_lens.tolist()
        if _variant == "fix":   # upstream fix: pad to the q-derived batch size (dummy: length 1, block 0)
            num_reqs_fia = len(actual_seq_lengths_q)
            if len(seq_lens_list) < num_reqs_fia:
                padding_len = num_reqs_fia - len(seq_lens_list)
                seq_lens_list = seq_lens_list + [1] * padding_len
                seq_lens = torch.cat([seq_lens, seq_lens.new_ones(padding_len)])
            if block_table is not None and block_table.shape[0] < num_reqs_fia:
                block_table = torch.cat([block_table, block_table.new_zeros(
                    (num_reqs_fia - block_table.shape[0], block_table.shape[1]))], dim=0)
        return AscendMetadata(seq_lens, seq_lens_list, actual_seq_lengths_q, block_table,
                              common_attn_metadata.num_actual_tokens)


class Model:
    """One attention layer over a paged KV cache; FIA reads its task parameters from the runner's device slots."""

    def __init__(self, runner, device):
        gen = generator(10769)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.runner = runner
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN, scale=0.3)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.kv_cache = torch.zeros(2, NUM_SLOTS + 1, HIDDEN, device=device, dtype=torch.float64)  # +1: pad sink

    def forward(self, num_tokens):
        rn = self.runner
        ids, pos = rn.input_ids.gpu[:num_tokens], rn.positions.gpu[:num_tokens]
        x = self.embed[ids] + self.pos_embed[pos]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        slot = rn.slot_mapping.gpu[:num_tokens]
        slot = torch.where(slot < 0, torch.full_like(slot, NUM_SLOTS), slot)      # _npu_reshape_and_cache skips pads
        self.kv_cache[0, slot] = k
        self.kv_cache[1, slot] = v
        # FIA (TND, paged): token t belongs to request r with cu_q[r] <= t < cu_q[r + 1]; causal at its KV position
        cu_q, kv_lens, bt = rn.fia_query_start_loc, rn.fia_seq_lens, rn.fia_block_table
        t = torch.arange(num_tokens, device=x.device)
        req = torch.searchsorted(cu_q[1:], t, right=True).clamp(max=MAX_NUM_REQS)
        tok_pos = kv_lens[req] - (cu_q[req + 1] - t)
        j = torch.arange(MAX_MODEL_LEN, device=x.device)
        slots = bt[req][:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE          # [T, L]
        keys, vals = self.kv_cache[0, slots], self.kv_cache[1, slots]
        scores = (keys * q.unsqueeze(1)).sum(-1) * HIDDEN ** -0.5
        scores = torch.where(j.unsqueeze(0) <= tok_pos.unsqueeze(1), scores, torch.full_like(scores, -1e9))
        out = (torch.softmax(scores, -1).unsqueeze(-1) * vals).sum(1) @ self.wo
        return (x + out) @ self.lm_head


class NPUModelRunner:
    def __init__(self, device, use_graph):
        self.device = device
        self.cudagraph_mode = "FULL" if use_graph else "NONE"
        self.max_num_reqs = MAX_NUM_REQS
        # NOTE: For FULL mode +2 reserves space for the FIA dummy request (_pad_query_start_loc_for_fia)
        self.query_start_loc = CpuGpuBuffer(self.max_num_reqs + 2, dtype=torch.int64, device=device)
        self.seq_lens = CpuGpuBuffer(self.max_num_reqs, dtype=torch.int64, device=device)
        self.block_table = CpuGpuBuffer(self.max_num_reqs, MAX_BLOCKS_PER_REQ, dtype=torch.int64, device=device)
        self.input_ids = CpuGpuBuffer(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.positions = CpuGpuBuffer(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.slot_mapping = CpuGpuBuffer(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        # the FULL graph's FIA task parameter slots (q-derived batch: up to max_num_reqs + 1)
        self.fia_query_start_loc = torch.zeros(self.max_num_reqs + 2, dtype=torch.int64, device=device)
        self.fia_seq_lens = torch.zeros(self.max_num_reqs + 1, dtype=torch.int64, device=device)
        self.fia_block_table = torch.zeros(self.max_num_reqs + 1, MAX_BLOCKS_PER_REQ, dtype=torch.int64,
                                           device=device)
        self.attn_metadata_builder = AscendAttentionMetadataBuilder()
        self.model = Model(self, device)
        self.graphs = {}
        if use_graph:
            self.capture_model()

    def _static(self):
        return {"input_ids": self.input_ids.gpu, "positions": self.positions.gpu,
                "slot_mapping": self.slot_mapping.gpu, "fia_query_start_loc": self.fia_query_start_loc,
                "fia_seq_lens": self.fia_seq_lens, "fia_block_table": self.fia_block_table}

    def capture_model(self):
        for n in CUDAGRAPH_CAPTURE_SIZES:                       # _dummy_run: one token per request, null block
            self.input_ids.gpu.zero_()
            self.positions.gpu.zero_()
            self.slot_mapping.gpu.fill_(PAD_SLOT_ID)
            self.fia_query_start_loc.fill_(n)
            self.fia_query_start_loc[0] = 0
            self.fia_seq_lens.fill_(1)
            self.fia_block_table.zero_()
            g, out = capture(lambda n=n: self.model.forward(n), device=self.device, name=f"FULL [{n}]",
                             owner="NPUModelRunner (FULL ACL graph)", static=self._static(),
                             state={"kv_cache": self.model.kv_cache})
            self.graphs[n] = (g, out)

    def _pad_query_start_loc_for_fia(self, num_tokens_padded, num_reqs_padded, num_reqs):
        """Satisfy the TND constraint ``hidden_states.shape[0] == actual_seq_lengths_q[-1]`` (FULL mode)."""
        num_reqs_padded = num_reqs                               # cudagraph_mode FULL: requests are not padded
        assert num_reqs == num_reqs_padded                       # mixed-batch case
        if self.query_start_loc.np[num_reqs_padded] < num_tokens_padded:
            self.query_start_loc.np[num_reqs_padded + 1] = num_tokens_padded   # insert a dummy request
            num_reqs_padded = num_reqs_padded + 1
        self.query_start_loc.copy_to_gpu()
        return num_reqs_padded

    def _prepare_inputs(self, batch, num_tokens_padded):
        num_reqs = len(batch)
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:num_reqs + 1] = np.cumsum([len(b["tokens"]) for b in batch])
        self.query_start_loc.np[num_reqs + 1:] = self.query_start_loc.np[num_reqs]
        self.seq_lens.np[:num_reqs] = [b["start"] + len(b["tokens"]) for b in batch]
        self.seq_lens.np[num_reqs:] = 0
        ids, pos, slots = [], [], []
        for i, b in enumerate(batch):
            self.block_table.np[i] = b["blocks"]
            for k, tok in enumerate(b["tokens"]):
                p = b["start"] + k
                ids.append(tok)
                pos.append(p)
                slots.append(b["blocks"][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        n = len(ids)
        self.input_ids.np[:n], self.positions.np[:n], self.slot_mapping.np[:n] = ids, pos, slots
        self.input_ids.np[n:num_tokens_padded] = 0
        self.positions.np[n:num_tokens_padded] = 0
        self.slot_mapping.np[n:num_tokens_padded] = PAD_SLOT_ID
        for buf in (self.query_start_loc, self.input_ids, self.positions, self.slot_mapping, self.block_table,
                    self.seq_lens):
            buf.copy_to_gpu()
        return n

    def update_full_graph_params(self, attn_metadata, num_tokens_padded):
        """Update the FIA graph task's host parameters (checked by FIA) and stage them for the replay."""
        q, kv, bt = attn_metadata.actual_seq_lengths_q, attn_metadata.seq_lens_list, attn_metadata.block_tables
        torch_npu.check_fia_tnd(q, kv, bt)
        batch = len(q)
        self.fia_query_start_loc.fill_(num_tokens_padded)
        self.fia_query_start_loc[0] = 0
        self.fia_query_start_loc[1:batch + 1] = torch.tensor(q, device=self.device)
        self.fia_seq_lens.zero_()
        self.fia_seq_lens[:batch] = torch.tensor(kv, device=self.device)
        self.fia_block_table.zero_()
        self.fia_block_table[:batch] = bt[:batch]

    def execute_model(self, batch):
        num_reqs = len(batch)
        num_tokens = sum(len(b["tokens"]) for b in batch)
        if self.cudagraph_mode == "FULL":
            num_tokens_padded = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens)
        else:
            num_tokens_padded = num_tokens
        self._prepare_inputs(batch, num_tokens_padded)
        num_reqs_padded = num_reqs
        if self.cudagraph_mode == "FULL":
            num_reqs_padded = self._pad_query_start_loc_for_fia(num_tokens_padded, num_reqs_padded, num_reqs)
        common = AscendCommonAttentionMetadata(self.query_start_loc.cpu, self.seq_lens.cpu,
                                               self.block_table.gpu[:num_reqs_padded], num_reqs_padded, num_tokens)
        attn_metadata = self.attn_metadata_builder.build(common)
        self.update_full_graph_params(attn_metadata, num_tokens_padded)
        if self.cudagraph_mode == "FULL":
            g, out = self.graphs[num_tokens_padded]
            logits = replay(g, out, real=num_tokens, size=num_tokens_padded)
        else:
            logits = self.model.forward(num_tokens)
        logits_indices = self.query_start_loc.gpu[1:num_reqs + 1] - 1
        return logits[logits_indices].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(10770)
    prompts = {"A": [3, 7], "B": [1, 4, 9], "C": [12, 5], "D": [2, 8, 6]}
    decode_tok = {rid: torch.randint(0, VOCAB, (4,), generator=gen).tolist() for rid in prompts}
    blocks = {rid: [1 + i * MAX_BLOCKS_PER_REQ + b for b in range(MAX_BLOCKS_PER_REQ)]
              for i, rid in enumerate(prompts)}
    # per step: (request, kind)
    schedule = [[("A", "p"), ("B", "p"), ("C", "p")],
                [("A", "d"), ("B", "d"), ("C", "d"), ("D", "p")],
                [("A", "d"), ("B", "d"), ("C", "d"), ("D", "d")]]

    def serve(use_graph):
        runner = NPUModelRunner(device, use_graph)
        computed = {rid: 0 for rid in prompts}
        ndec = {rid: 0 for rid in prompts}
        outs = []
        for step in schedule:
            batch = []
            for rid, kind in step:
                toks = prompts[rid] if kind == "p" else [decode_tok[rid][ndec[rid]]]
                batch.append({"tokens": toks, "start": computed[rid], "blocks": blocks[rid]})
            outs.append(runner.execute_model(batch))
            for (rid, kind), b in zip(step, batch):
                computed[rid] += len(b["tokens"])
                ndec[rid] += kind == "d"
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
