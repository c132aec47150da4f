"""MRV2 EAGLE drafter under a FULL graph: per-step draft ``seq_lens_cpu`` is computed from the compact active-request sequence lengths and copied into the graph-padded attention metadata.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/14801 ("[BugFix][SpecDecode] Pad draft sequence lengths for
full graph", vllm-project/vllm-ascend, merged 2026-08-24). Read: the PR description (the shape example, the error
text and the fix's approach) and two stored versions of ``vllm_ascend/worker/v2/spec_decode/.../speculator.py``: an
older one whose ``_update_decode_attn_metadata`` takes ``self._get_seq_lens_cpu()[:num_reqs_padded]`` with
``_get_seq_lens_cpu`` returning ``torch.from_numpy(self.input_batch.seq_lens_np)``, and a later one in which
``_get_seq_lens_cpu(num_reqs_padded)`` reads the padded target input buffer instead. The PR's own diff hunks were not
read; the fix below follows the description ("reuses the padded attention-metadata buffer as the output, writes the
calculated sequence lengths into its active-request slice, and clears the graph-padding tail").
Symptom: Model Runner V2 speculative decoding with FULL_DECODE_ONLY graphs in P/D-disaggregated serving: with two
active requests and a smallest captured graph of eight request slots, the draft step dies with ``RuntimeError: The
size of tensor a (8) must match the size of tensor b (2) at non-singleton dimension 0`` from
``metadata.seq_lens_cpu.copy_(next_seq_lens_cpu)``. Eager (no graph padding) is fine.
Mechanism: ``AscendEagleSpeculator.build_draft_attn_metadatas(num_reqs_padded, ...)`` makes one attention-metadata
dict per draft step (``_init_decode_draft_attn_metadatas``): its ``seq_lens_cpu`` is
``input_buffers.draft_seq_lens_cpus[i][:num_reqs_padded]``, a view sized for the graph's padded request count. It
then calls ``_update_decode_attn_metadata(metadata, step, input_batch.num_reqs)``, which sizes its work by that
padded view but takes the target lengths from ``input_batch.seq_lens_np``. On a P/D decode worker that array holds
only the active requests, so ``seq_lens_cpu[:num_reqs_padded]`` stays at ``num_reqs`` rows and
``_calc_next_seq_lens_cpu`` returns ``num_reqs`` rows. ``copy_`` into the ``num_reqs_padded`` metadata buffer
cannot broadcast them (one active request would broadcast its length into every phantom slot). The FULL graph's FIA
task is then updated from that metadata (``actual_seq_lengths_kv``) before replay.
Doctor: padded-shape-mismatch, at _update_decode_attn_metadata. Code run at the graph's padded request count
combines the padded per-step metadata buffer with target sequence lengths sized for the real requests.
Fix (upstream): write the computed lengths into the padded metadata buffer's first ``num_reqs`` entries and zero its
tail, so phantom graph requests have length 0 and never see a stale length from an earlier, larger batch.
Modelled: ``AscendEagleSpeculator`` (the parts named above), ``InputBatch.seq_lens_np`` (compact), the per-step
``draft_seq_lens_cpus`` host buffers, and an ``EagleAclGraphManager`` that captures the decode draft steps 1..K-1 as
one FULL graph per size and, before replay, stages each step's ``seq_lens_cpu`` into the graph's device lengths
buffer (stand-in for the FIA ``actual_seq_lengths_kv`` graph-task update). The draft model is one attention layer
over a paged KV cache (block 0 is the null block; phantom rows get block-table row 0). Draft step 0 runs eagerly.
The target model is a stand-in that supplies hidden states, sampled tokens and context lengths. Sizes: hidden 8,
vocab 16 (float64), block size 4, 4 blocks per request, K = 3 draft steps, capture sizes [4, 8] (multiples of TP = 4 with
sequence parallelism).
Workload: requests A-D are admitted (prompt KV pre-filled). Step 1 drafts for A-D (4 requests, the size-4 graph, no
padding). A and C finish. Step 2 drafts for B and D: 2 active requests padded to the size-4 graph, so the compact
lengths ([2]) meet the padded metadata ([4]) and the copy raises. Step 3 repeats with B and D.
"""
from __future__ import annotations

from copy import copy

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/14801"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_update_decode_attn_metadata"
SYMPTOM = ("MRV2 spec decode with FULL_DECODE_ONLY on a P/D decode worker: 2 active requests padded to an 8-slot "
           "graph; the draft metadata update copies 2 compact sequence lengths into the 8-slot padded seq_lens_cpu "
           "and raises 'The size of tensor a (8) must match the size of tensor b (2)'")

HIDDEN, VOCAB = 8, 16
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 4
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
MAX_NUM_REQS = 8
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ      # block 0: the null block
NUM_SPECULATIVE_STEPS = 3
CUDAGRAPH_CAPTURE_SIZES = [4, 8]

_variant = "bug"


class AscendMetadata:
    def __init__(self, seq_lens_cpu):
        self.seq_lens_cpu = seq_lens_cpu
        self.seq_lens_list: list[int] = []
        self.actual_seq_lengths_q: list[int] = []
        self.attn_state = "DecodeOnly"


class InputBatch:
    """The decode worker's batch: ``seq_lens_np`` holds only the active requests (compact)."""

    def __init__(self, seq_lens, rows):
        self.num_reqs = len(seq_lens)
        self.seq_lens_np = np.array(seq_lens, dtype=np.int32)
        self.rows = rows


class InputBuffers:
    def __init__(self, device):
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_REQS, HIDDEN, device=device, dtype=torch.float64)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int64, device=device)
        # per decode draft step: host lengths (attention metadata) and the graph's device copy
        self.draft_seq_lens_cpus = [torch.zeros(MAX_NUM_REQS, dtype=torch.int32)
                                    for _ in range(NUM_SPECULATIVE_STEPS - 1)]
        self.draft_seq_lens = [torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
                               for _ in range(NUM_SPECULATIVE_STEPS - 1)]


class DraftModel:
    """One attention layer over a paged KV cache, plus the lm head."""

    def __init__(self, device):
        gen = generator(14801)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.kv_cache = torch.zeros(2, NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device, dtype=torch.float64)

    def forward(self, input_ids, hidden_states, seq_lens, block_table):
        """One decode token per row at position ``seq_lens - 1``; attends to ``[0, seq_lens)``."""
        x = self.embed[input_ids] + hidden_states
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        pos = (seq_lens - 1).clamp(min=0)
        rows = torch.arange(x.shape[0], device=x.device)
        slot = block_table[rows, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        self.kv_cache[0, slot] = k
        self.kv_cache[1, slot] = v
        j = torch.arange(MAX_MODEL_LEN, device=x.device)
        slots = block_table[:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE          # [N, L]
        keys, vals = self.kv_cache[0, slots], self.kv_cache[1, slots]
        scores = (keys * q.unsqueeze(1)).sum(-1) * HIDDEN ** -0.5
        scores = torch.where(j.unsqueeze(0) < seq_lens.unsqueeze(1), scores, torch.full_like(scores, -1e9))
        out = (torch.softmax(scores, -1).unsqueeze(-1) * vals).sum(1) @ self.wo
        h = hidden_states + out
        return h @ self.lm_head, h


class EagleAclGraphManager:
    """FULL graphs of the decode draft steps 1..K-1, one per capture size."""

    def __init__(self, speculator, device):
        self.speculator, self.device = speculator, device
        self.graphs = {}

    def capture(self):
        bufs = self.speculator.input_buffers
        for n in CUDAGRAPH_CAPTURE_SIZES:
            for s in bufs.draft_seq_lens:
                s[:n].fill_(1)                     # dummy run: position 0 of the null block
            g, out = capture(lambda n=n: self.speculator._multi_step_decode(n), device=self.device,
                             name=f"eagle decode [{n}]", owner="EagleAclGraphManager (FULL)",
                             static={"input_ids": bufs.input_ids, "hidden_states": bufs.hidden_states,
                                     "block_table": bufs.block_table,
                                     **{f"draft_seq_lens[{i}]": s for i, s in enumerate(bufs.draft_seq_lens)}},
                             state={"kv_cache": self.speculator.model.kv_cache})
            self.graphs[n] = (g, out)

    def run_fullgraph(self, draft_attn_metadatas, num_reqs, num_reqs_padded):
        bufs = self.speculator.input_buffers
        self.speculator.update_full_graph_params(draft_attn_metadatas, num_reqs_padded)
        g, out = self.graphs[num_reqs_padded]
        return replay(g, out, real=num_reqs, size=num_reqs_padded,
                      padded={"input_ids": bufs.input_ids, "hidden_states": bufs.hidden_states})


class AscendEagleSpeculator:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.max_model_len = MAX_MODEL_LEN
        self.model = DraftModel(device)
        self.input_buffers = InputBuffers(device)
        self.input_batch: InputBatch | None = None
        self.decode_cudagraph_manager = EagleAclGraphManager(self, device) if use_cuda_graph else None
        if use_cuda_graph:
            self.decode_cudagraph_manager.capture()

    def _multi_step_decode(self, n):
        bufs = self.input_buffers
        input_ids, hidden = bufs.input_ids[:n], bufs.hidden_states[:n]
        logits_per_step = []
        for step in range(1, NUM_SPECULATIVE_STEPS):
            logits, hidden = self.model.forward(input_ids, hidden, bufs.draft_seq_lens[step - 1][:n],
                                                bufs.block_table[:n])
            input_ids = logits.argmax(-1)
            logits_per_step.append(logits)
        return torch.stack(logits_per_step, 1)

    def update_full_graph_params(self, draft_attn_metadatas, num_reqs_padded):
        """Stage each step's ``actual_seq_lengths_kv`` into the graph (the FIA graph-task update)."""
        for step_metadata, dev in zip(draft_attn_metadatas, self.input_buffers.draft_seq_lens):
            meta = next(iter(step_metadata.values()))
            dev[:num_reqs_padded].copy_(meta.seq_lens_cpu.to(dev.device, torch.int64))

    def build_draft_attn_metadatas(self, attn_metadata, num_reqs_padded):
        draft_attn_metadatas = self._init_decode_draft_attn_metadatas(attn_metadata, num_reqs_padded)
        for i, per_step_attn_metadata in enumerate(draft_attn_metadatas):
            self._update_decode_attn_metadata(per_step_attn_metadata, i + 1, self.input_batch.num_reqs)
        return draft_attn_metadatas

    def _init_decode_draft_attn_metadatas(self, attn_metadata, num_reqs_padded):
        draft_attn_metadatas = []
        for seq_lens_cpu in self.input_buffers.draft_seq_lens_cpus:
            per_step_attn_metadata = {k: copy(v) for k, v in attn_metadata.items()}
            seq_lens_cpu = seq_lens_cpu[:num_reqs_padded]
            for metadata in per_step_attn_metadata.values():
                metadata.attn_state = "DecodeOnly"
                metadata.seq_lens_cpu = seq_lens_cpu
            draft_attn_metadatas.append(per_step_attn_metadata)
        return draft_attn_metadatas

    def _update_decode_attn_metadata(self, attn_metadata, step, num_reqs=None):
        """Update per-step decode attention metadata on Ascend (the hazard site)."""
        attn_meta = next(iter(attn_metadata.values()))
        num_reqs_padded = attn_meta.seq_lens_cpu.shape[0]
        seq_lens_cpu = self._get_seq_lens_cpu()[:num_reqs_padded]        # compact: only num_reqs rows
        if num_reqs is None:
            num_reqs = num_reqs_padded
        if _variant == "fix":       # upstream fix: write into the padded metadata buffer, clear its tail
            next_seq_lens_cpu = self._calc_next_seq_lens_cpu(seq_lens_cpu, num_reqs, num_reqs_padded, step,
                                                             out=attn_meta.seq_lens_cpu)
        else:
            next_seq_lens_cpu = self._calc_next_seq_lens_cpu(seq_lens_cpu, num_reqs, num_reqs_padded, step)
        query_lens_list = [i for i in range(1, num_reqs_padded + 1)]
        seq_lens_list = next_seq_lens_cpu.tolist()
        for metadata in attn_metadata.values():
            metadata.actual_seq_lengths_q = query_lens_list
            metadata.seq_lens_cpu.copy_(next_seq_lens_cpu)
            metadata.seq_lens_list = seq_lens_list

    def _calc_next_seq_lens_cpu(self, seq_lens_cpu, num_reqs, num_reqs_padded, step, out=None):
        if out is not None:
            out[:num_reqs] = torch.clamp(seq_lens_cpu[:num_reqs] + step, max=self.max_model_len)
            out[num_reqs:].fill_(0)
            return out
        next_seqs_cpu = torch.clamp(seq_lens_cpu[:num_reqs_padded] + step, max=self.max_model_len)
        next_seqs_cpu[num_reqs:].fill_(0)
        return next_seqs_cpu

    def _get_seq_lens_cpu(self):
        return torch.from_numpy(self.input_batch.seq_lens_np)

    def propose(self, input_batch, next_token_ids, target_hidden_states, block_table_rows):
        self.input_batch = input_batch
        num_reqs = input_batch.num_reqs
        bufs = self.input_buffers
        bufs.block_table.zero_()                              # phantom rows: the null block
        bufs.block_table[:num_reqs] = block_table_rows
        seq_lens = torch.from_numpy(input_batch.seq_lens_np).to(self.device, torch.int64)
        # draft step 0 (eager): the target's next token at the last position
        logits0, hidden = self.model.forward(next_token_ids, target_hidden_states, seq_lens, bufs.block_table[:num_reqs])
        bufs.input_ids[:num_reqs] = logits0.argmax(-1)
        bufs.hidden_states[:num_reqs] = hidden
        mgr = self.decode_cudagraph_manager
        if mgr is not None:
            num_reqs_padded = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_reqs)
        else:
            num_reqs_padded = num_reqs
        attn_metadata = {"model.layers.0.self_attn.attn": AscendMetadata(bufs.draft_seq_lens_cpus[0][:num_reqs])}
        draft_attn_metadatas = self.build_draft_attn_metadatas(attn_metadata, num_reqs_padded)
        if mgr is not None:
            logits = mgr.run_fullgraph(draft_attn_metadatas, num_reqs, num_reqs_padded)
        else:
            self.update_full_graph_params(draft_attn_metadatas, num_reqs_padded)
            logits = self._multi_step_decode(num_reqs)
        return torch.cat([logits0.unsqueeze(1), logits[:num_reqs]], 1).clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompt_lens = {"A": 3, "B": 5, "C": 2, "D": 6}
    schedule = ["ABCD", "BD", "BD"]

    def serve(use_cuda_graph: bool):
        spec = AscendEagleSpeculator(device, use_cuda_graph)
        gen = generator(14802)                               # the target model (stand-in)
        slot = {rid: i for i, rid in enumerate("ABCD")}
        block_rows = {rid: torch.arange(1 + i * MAX_BLOCKS_PER_REQ, 1 + (i + 1) * MAX_BLOCKS_PER_REQ)
                      for rid, i in slot.items()}
        seq_lens = dict(prompt_lens)
        for rid, n in prompt_lens.items():                   # the draft's prompt KV (prefill stand-in)
            pos = torch.arange(n)
            slots = (block_rows[rid][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(device)
            spec.model.kv_cache[:, slots] = randn(2, n, HIDDEN, gen=gen, device=device).double()
        outs = []
        for names in schedule:
            n = len(names)
            for rid in names:                                 # the target appended one token
                seq_lens[rid] += 1
            batch = InputBatch([seq_lens[r] for r in names], [slot[r] for r in names])
            next_token_ids = torch.randint(0, VOCAB, (n,), generator=gen).to(device)
            hidden = randn(n, HIDDEN, gen=gen, device=device).double()
            rows = torch.stack([block_rows[r] for r in names]).to(device)
            outs.append(spec.propose(batch, next_token_ids, hidden, rows))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
