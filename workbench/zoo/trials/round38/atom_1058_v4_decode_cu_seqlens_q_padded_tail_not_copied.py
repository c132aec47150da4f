"""A padded DeepSeek-V4 decode graph writes a padded token's KV into a live request's SWA ring.

Upstream: https://github.com/ROCm/ATOM/pull/1058 ("fix(v4): drop redundant cu_seqlens_q refill in attention
metadata builder"), commit 5590c762f.
Symptom: none stated in the PR; the commit message says the builder overwrote ModelRunner's
``cu_seqlens_q`` and copied only ``scheduled_bs + 1`` entries, so the GPU buffer did not match "the range
ModelRunner populates" (the cudagraph-padded tail). Modelled harm: silent corruption of a live request's
sliding-window KV state, so its decode output goes wrong.
Mechanism: ``ModelRunner.prepare_inputs`` writes the step's prefix sum into
``forward_vars["cu_seqlens_q"].np[1:bs+1]`` and, for a decode batch padded to the graph size ``bs``, sets
the tail ``np[scheduled_bs+1 : bs+1]`` to the boundary value ``np[scheduled_bs]`` (padded sequences get
zero tokens). ``DeepseekV4AttentionMetadataBuilder.prepare_decode`` then re-filled
``np[:scheduled_bs+1]`` with a uniform ``np.arange`` and ran ``copy_to_gpu(scheduled_bs + 1)``: the padded
tail never reached the GPU buffer, which kept what an earlier step (a larger batch, or capture) left there.
The decode graph, captured at ``bs``, runs ``swa_write(kv, positions, attn_md.cu_seqlens_q,
state_slot_mapping, self.swa_kv, ...)`` over ``bs`` sequences; the kernel derives each sequence's token
count from ``cu_seqlens_q[b+1] - cu_seqlens_q[b]``, so a padded sequence with a stale non-zero count writes
``kv[src]`` of a padded token (stale ``input_ids``/``positions`` rows) into
``swa_kv[state_slot_per_seq[b], positions[src] % cache_size]`` -- and ``state_slot_per_seq`` is itself
copied only for ``scheduled_bs`` rows, so its padded row still names a slot that now belongs to a live
request. That request's next attention reads the clobbered ring entry.
Doctor: stale-padding, at ``swa_write`` (the SWA ring write through padded rows' stale ``cu_seqlens_q``
tail and stale state slot).
Fix (upstream): remove the ``np.arange`` refill and copy ``bs + 1`` entries
(``var["cu_seqlens_q"].copy_to_gpu(bs + 1)``), so the padded tail that ModelRunner set to the boundary
value reaches the GPU and every padded sequence has zero tokens (the kernel returns for ``tok_n <= 0``).
Diff read: yes (the builder hunk; ``ModelRunner.prepare_inputs`` tail padding and ``swa_write`` /
``_swa_write_kernel`` read at that commit).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ROCm/ATOM/pull/1058"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "swa_write"
SYMPTOM = "a padded decode sequence's stale cu_seqlens_q tail writes garbage KV into a live request's SWA ring"

VOCAB, DIM = 32, 4
MAX_NUM_TOKENS = 16
NUM_SLOTS = 4                # per-request state-cache slots
CACHE_SIZE = 8               # window_size + max_spec_steps (no MTP here); positions stay below it
GRAPH_BS = [4]               # decode capture sizes
TRASH_SLOT = NUM_SLOTS       # where the kernel's bailing programs "write" (nothing is read from it)


class CpuGpuBuffer:
    """ATOM's ``forward_vars`` entry: a host mirror ``np`` and a device buffer ``gpu``."""

    def __init__(self, n, device, dtype=torch.long):
        self.np = torch.zeros(n, dtype=dtype)
        self.gpu = torch.zeros(n, dtype=dtype, device=device)

    def copy_to_gpu(self, n):
        self.gpu[:n].copy_(self.np[:n].to(self.gpu.device))
        return self.gpu[:n]


class DeepseekV4Attention:
    """One SWA attention layer: project, ``swa_write`` into the per-request ring, attend over the ring."""

    def __init__(self, device):
        gen = generator(1058)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wkv = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.swa_kv = torch.zeros(NUM_SLOTS + 1, CACHE_SIZE, DIM, device=device)
        self.ring = torch.arange(CACHE_SIZE, device=device)

    def forward(self, input_ids, positions, cu_seqlens_q, state_slot_mapping, batch_id_per_token,
                write_per_batch):
        x = self.emb[input_ids]
        kv = x @ self.wkv
        # SWA write per-token in decode, before attention
        swa_write(kv, positions, cu_seqlens_q, state_slot_mapping, self.swa_kv, CACHE_SIZE, write_per_batch)
        q = x @ self.wq
        slot = state_slot_mapping[batch_id_per_token]                     # [T]
        keys = self.swa_kv[slot]                                           # [T, CACHE_SIZE, DIM]
        scores = (keys @ q[:, :, None]).squeeze(-1)
        scores = scores.masked_fill(self.ring[None, :] > positions[:, None], -1e9)
        return (torch.softmax(scores, -1)[:, :, None] * keys).sum(1) @ self.wo


def swa_write(kv, positions, cu_seqlens_q, state_slot_per_seq, swa_kv, cache_size, write_per_batch):
    """``_swa_write_kernel`` over the grid ``(bs, write_per_batch)``: program ``(b, r)`` writes the r-th of the
    last ``min(cu_seqlens_q[b+1] - cu_seqlens_q[b], write_per_batch)`` tokens of seq ``b`` into
    ``swa_kv[state_slot_per_seq[b], positions[src] % cache_size]``; programs past that count bail."""
    bs = state_slot_per_seq.shape[0]
    cu_start, cu_end = cu_seqlens_q[:bs], cu_seqlens_q[1:bs + 1]
    write_n = torch.clamp(cu_end - cu_start, min=0).clamp(max=write_per_batch)
    for r in range(write_per_batch):
        live = r < write_n
        src_id = (cu_end - write_n + r).clamp(min=0)
        slot = torch.where(live, state_slot_per_seq, torch.full_like(state_slot_per_seq, TRASH_SLOT))
        ring_idx = positions[src_id] % cache_size
        swa_kv[slot, ring_idx] = kv[src_id]


class DeepseekV4AttentionMetadataBuilder:
    def __init__(self, runner, variant):
        self.model_runner, self.variant = runner, variant

    def prepare_decode(self, batch, bs):
        var = self.model_runner.forward_vars
        scheduled_bs = len(batch)
        max_seqlen_q = 1
        var["positions"].np[:scheduled_bs] = torch.tensor([pos for _, pos, _ in batch])
        if self.variant == "bug":
            var["cu_seqlens_q"].np[: scheduled_bs + 1] = torch.arange(
                0, (scheduled_bs + 1) * max_seqlen_q, max_seqlen_q)
            cu_seqlens_q = var["cu_seqlens_q"].copy_to_gpu(scheduled_bs + 1)
        else:
            cu_seqlens_q = var["cu_seqlens_q"].copy_to_gpu(bs + 1)
        var["v4_meta_state_slot_groups"].np[:scheduled_bs] = torch.tensor([slot for _, _, slot in batch])
        positions = var["positions"].copy_to_gpu(scheduled_bs)
        state_slot = var["v4_meta_state_slot_groups"].copy_to_gpu(scheduled_bs)
        # _attach_v4_per_fwd_meta: batch_id_per_token over the padded width (one token per seq in decode)
        var["batch_id_per_token"].np[:bs] = torch.arange(bs)
        var["batch_id_per_token"].copy_to_gpu(bs)
        return cu_seqlens_q, positions, state_slot

    def prepare_prefill(self, batch):
        var = self.model_runner.forward_vars
        lens = [len(prompt) for prompt, _ in batch]
        total = sum(lens)
        var["positions"].np[:total] = torch.cat([torch.arange(n) for n in lens])
        var["v4_meta_state_slot_groups"].np[: len(batch)] = torch.tensor([slot for _, slot in batch])
        var["batch_id_per_token"].np[:total] = torch.repeat_interleave(torch.arange(len(batch)),
                                                                      torch.tensor(lens))
        return (var["cu_seqlens_q"].copy_to_gpu(len(batch) + 1), var["positions"].copy_to_gpu(total),
                var["v4_meta_state_slot_groups"].copy_to_gpu(len(batch)),
                var["batch_id_per_token"].copy_to_gpu(total), max(lens))


class ModelRunner:
    def __init__(self, model, device, variant, enforce_eager):
        self.model, self.device, self.enforce_eager = model, device, enforce_eager
        self.forward_vars = {name: CpuGpuBuffer(MAX_NUM_TOKENS + 1, device) for name in
                             ("input_ids", "positions", "cu_seqlens_q", "v4_meta_state_slot_groups",
                              "batch_id_per_token")}
        self.attn_metadata_builder = DeepseekV4AttentionMetadataBuilder(self, variant)
        self.graphs = {}
        if not enforce_eager:
            self.capture_cudagraph()

    def _decode_forward(self, bs):
        var = self.forward_vars
        return self.model.forward(var["input_ids"].gpu[:bs], var["positions"].gpu[:bs],
                                  var["cu_seqlens_q"].gpu[:bs + 1],
                                  var["v4_meta_state_slot_groups"].gpu[:bs],
                                  var["batch_id_per_token"].gpu[:bs], 1)

    def capture_cudagraph(self):
        var = self.forward_vars
        for bs in GRAPH_BS:
            # build_for_cudagraph_capture: synthetic uniform decode over slots [0, bs)
            var["cu_seqlens_q"].np[: bs + 1] = torch.arange(bs + 1)
            var["cu_seqlens_q"].copy_to_gpu(bs + 1)
            var["v4_meta_state_slot_groups"].np[:bs] = torch.arange(bs)
            var["v4_meta_state_slot_groups"].copy_to_gpu(bs)
            var["positions"].np[:bs] = CACHE_SIZE - 1
            var["positions"].copy_to_gpu(bs)
            var["batch_id_per_token"].np[:bs] = torch.arange(bs)
            var["batch_id_per_token"].copy_to_gpu(bs)
            self.graphs[bs] = capture(
                lambda bs=bs: self._decode_forward(bs), device=self.device,
                owner="ModelRunner (V4 decode graph)",
                static={name: buf.gpu for name, buf in var.items()},
                state={"swa_kv": self.model.swa_kv})
        self.model.swa_kv.zero_()          # capture warmup data is throwaway

    def prefill(self, batch):
        """``batch``: (prompt token ids, state slot) per request; runs eagerly."""
        var = self.forward_vars
        ids = [t for prompt, _ in batch for t in prompt]
        var["input_ids"].np[: len(ids)] = torch.tensor(ids)
        var["input_ids"].copy_to_gpu(len(ids))
        var["cu_seqlens_q"].np[1: len(batch) + 1] = torch.cumsum(torch.tensor([len(p) for p, _ in batch]), 0)
        cu, positions, slots, bid, max_len = self.attn_metadata_builder.prepare_prefill(batch)
        out = self.model.forward(var["input_ids"].gpu[: len(ids)], positions, cu, slots, bid, max_len)
        return out.clone()

    def decode(self, batch):
        """``batch``: (token id, position, state slot) per request, one token each."""
        var = self.forward_vars
        scheduled_bs = len(batch)
        bs = scheduled_bs if self.enforce_eager else next(x for x in GRAPH_BS if x >= scheduled_bs)
        var["input_ids"].np[:scheduled_bs] = torch.tensor([tok for tok, _, _ in batch])
        var["input_ids"].copy_to_gpu(scheduled_bs)
        # prepare_inputs: prefix sum, then the cudagraph-padded tail set to the boundary value
        var["cu_seqlens_q"].np[1: scheduled_bs + 1] = torch.arange(1, scheduled_bs + 1)
        var["cu_seqlens_q"].np[scheduled_bs + 1: bs + 1] = var["cu_seqlens_q"].np[scheduled_bs]
        cu, positions, slots = self.attn_metadata_builder.prepare_decode(batch, bs)
        if self.enforce_eager:
            return self._decode_forward(bs)[:scheduled_bs].clone()
        padded = {"input_ids": var["input_ids"].gpu, "positions": var["positions"].gpu,
                  "state_slot_mapping": var["v4_meta_state_slot_groups"].gpu}
        if self.attn_metadata_builder.variant == "bug":      # the padded tail was never copied
            padded["cu_seqlens_q[1:]"] = var["cu_seqlens_q"].gpu[1:]   # row b = end offset of seq b
        graph, outputs = self.graphs[bs]
        out = replay(graph, outputs, real=scheduled_bs, size=bs, padded=padded)
        return out[:scheduled_bs].clone()


def run(variant: str, device: str = "cpu"):
    def serve(enforce_eager: bool):
        runner = ModelRunner(DeepseekV4Attention(device), device, variant, enforce_eager)
        outs = []
        # A, B, C, D (slots 0..3) prefill two prompt tokens each, then decode one step as a full batch.
        outs.append(runner.prefill([([3, 5], 0), ([7, 9], 1), ([11, 13], 2), ([15, 17], 3)]))
        outs.append(runner.decode([(4, 2, 0), (6, 2, 1), (8, 2, 2), (10, 2, 3)]))
        # D finishes; A, B, C decode padded to the size-4 graph.
        outs.append(runner.decode([(12, 3, 0), (14, 3, 1), (16, 3, 2)]))
        # C finishes; E gets D's freed slot 3 and prefills three prompt tokens.
        outs.append(runner.prefill([([19, 21, 23], 3)]))
        # A, B, E decode padded to the size-4 graph, then once more.
        outs.append(runner.decode([(18, 4, 0), (20, 4, 1), (25, 3, 3)]))
        outs.append(runner.decode([(22, 5, 0), (24, 5, 1), (27, 4, 3)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
