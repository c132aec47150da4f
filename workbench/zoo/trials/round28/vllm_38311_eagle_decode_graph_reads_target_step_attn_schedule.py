"""V2 EAGLE's FULL draft-decode graph replays without rebuilding attention metadata, so it attends with the schedule the target step built.

Upstream: https://github.com/vllm-project/vllm/pull/38311 ("[Model Runner V2] Rebuild attention metadata
before eagle decode full cudagraph").
Symptom: "low quality draft tokens produced at positions > 0 (after the draft prefill) that result from not
rebuilding the attention metadata during FULL cudagraph ... so that it doesn't contain stale values from
previous runs"; the fix raised the draft acceptance rate at positions > 0 (Llama-3-8B + EAGLE,
Qwen3-8B + EAGLE3, 3 speculative tokens; Model Runner V2, March 2026).
Mechanism: ``EagleSpeculator`` shares the target model's ``attn_metadata_builders``. Builders that support
FULL graphs keep what ``build()`` derives on the host in persistent buffers that a captured graph reads
by address (FA3's ahead-of-time ``scheduler_metadata``, FlashInfer's plan). ``propose()`` runs the draft
prefill eagerly with the target's metadata, prepares the decode inputs on the device
(``_prepare_eagle_docode_kernel``: input ids, positions, hidden states, ``seq_lens``, ``query_start_loc``)
and, when a graph exists for ``num_reqs``, calls ``cudagraph_manager.run(cudagraph_size)``. Only the eager
fallback calls ``build_attn_metadata`` (with ``seq_lens_np = max_model_len``, the upper bound the schedule
must cover). So the replayed ``generate_draft`` reads the schedule the *target* step built last: one made
from the target's verified lengths. Draft positions past the last accepted token run beyond it, and the
attention drops the KV blocks it does not schedule -- including the block that holds the draft token just
written -- while eager attends over all of them.
Doctor: stale-input, at ``propose`` (it replays the draft-decode graph without rebuilding the attention
metadata, so the graph reads the builder's schedule as the target step left it).
Fix (upstream): ``propose`` rebuilds the attention metadata for the draft decode (as the eager path does)
before ``cudagraph_manager.run``, refreshing the builders' persistent buffers.
(Read: the PR description; the pre-fix ``propose`` / ``generate_draft`` in ``spec_decode/eagle.py`` and
``EagleCudaGraphManager`` in ``eagle_cudagraph.py`` from a stored copy. The fix's diff was not available:
the rebuild is modelled on the eager path's ``build_attn_metadata`` call. The backend's schedule is
reduced to "KV blocks to visit per request", derived from the host ``seq_lens`` at build time.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/38311"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "propose"
SYMPTOM = "EAGLE draft tokens at positions > 0 attend with the target step's schedule; acceptance drops"

VOCAB, HIDDEN = 16, 4
MAX_NUM_REQS = 2                 # the one captured draft-decode size (num_reqs)
MAX_MODEL_LEN = 12
KV_BLOCK = 2                     # the schedule's KV block (positions per block)
NUM_SPECULATIVE_STEPS = 3        # draft prefill + 2 draft-decode steps inside the graph


class FlashAttentionMetadataBuilder:
    """Shared by the target model and the speculator. With FULL graphs its ahead-of-time schedule lives
    in a persistent buffer that captured graphs read by address; only ``build()`` writes it."""

    def __init__(self, device):
        self.device = device
        self.scheduler_metadata = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)

    def build(self, num_reqs, seq_lens, seq_lens_np):
        """``seq_lens``: the device lengths the kernel masks with; ``seq_lens_np``: the host lengths the
        schedule is planned for (KV blocks to visit per request)."""
        blocks = [(int(n) + KV_BLOCK - 1) // KV_BLOCK for n in seq_lens_np]
        self.scheduler_metadata[:num_reqs].copy_(torch.tensor(blocks, dtype=torch.long).to(self.device))
        self.scheduler_metadata[num_reqs:].zero_()
        return {"seq_lens": seq_lens, "scheduler_metadata": self.scheduler_metadata[:num_reqs]}


def flash_attn_decode(q, kv_cache, kv_rows, seq_lens, scheduler_metadata, ctx_pos):
    """One query per request over its cached keys (values = keys): positions below ``seq_lens`` and
    inside the scheduled KV blocks."""
    k = kv_cache[kv_rows]                                                  # [reqs, MAX_MODEL_LEN, H]
    valid = (ctx_pos[None, :] < seq_lens[:, None]) & (ctx_pos[None, :] // KV_BLOCK < scheduler_metadata[:, None])
    scores = (k @ q[:, :, None]).squeeze(-1).masked_fill(~valid, -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


class EagleDraftModel:
    def __init__(self, device):
        gen = generator(38311)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.7)
        self.w_h = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_k = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.w_q = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.w_o = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.ctx_pos = torch.arange(MAX_MODEL_LEN, device=device)

    def __call__(self, kv_cache, kv_rows, input_ids, positions, hidden_states, attn_metadata):
        """One token per request: write its key at (its cache row, position), attend, project."""
        x = self.embed[input_ids] + hidden_states @ self.w_h
        kv_cache[kv_rows, positions] = x @ self.w_k                       # reshape_and_cache
        a = flash_attn_decode(x @ self.w_q, kv_cache, kv_rows, attn_metadata["seq_lens"],
                              attn_metadata["scheduler_metadata"], self.ctx_pos)
        return torch.tanh(a @ self.w_o + x)

    def compute_logits(self, h):
        return h @ self.lm_head


class EagleSpeculator:
    def __init__(self, model, builder, kv_cache, device, variant, graphed):
        self.model, self.builder, self.kv_cache = model, builder, kv_cache
        self.device, self.variant, self.graphed = device, variant, graphed
        # input_buffers: written by _prepare_eagle_docode_kernel before the decode steps
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.hidden_states = torch.zeros(MAX_NUM_REQS, HIDDEN, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.kv_rows = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)   # 0: the null row
        if graphed:
            self.capture_model()

    def _build_draft_attn_metadata(self, num_reqs):
        # HACK(woosuk): the host lengths are the upper bound, max_model_len
        return self.builder.build(num_reqs, self.seq_lens[:num_reqs], [MAX_MODEL_LEN] * num_reqs)

    def generate_draft(self, num_reqs, attn_metadata):
        ids, pos = self.input_ids[:num_reqs], self.positions[:num_reqs]
        h, seq_lens = self.hidden_states[:num_reqs], self.seq_lens[:num_reqs]
        tokens = []
        for _ in range(1, NUM_SPECULATIVE_STEPS):
            h = self.model(self.kv_cache, self.kv_rows[:num_reqs], ids, pos, h,
                           dict(attn_metadata, seq_lens=seq_lens))
            ids = self.model.compute_logits(h).argmax(-1)                 # greedy draft sampling
            tokens.append(ids)
            pos, seq_lens = pos + 1, seq_lens + 1                          # _update_eagle_inputs_kernel
        return torch.stack(tokens, 1), h

    def capture_model(self):
        """``EagleCudaGraphManager.capture_graph``: dummy inputs (their keys go to the null row),
        metadata built for them, warm up, capture."""
        num_reqs = MAX_NUM_REQS
        self.kv_rows.zero_()
        self.seq_lens.fill_(1)
        attn_metadata = self._build_draft_attn_metadata(num_reqs)
        self.graph, self.out = capture(
            lambda: self.generate_draft(num_reqs, attn_metadata), device=self.device,
            owner="EagleCudaGraphManager (FULL draft decode)",
            static={"input_ids": self.input_ids, "positions": self.positions, "kv_rows": self.kv_rows,
                    "hidden_states": self.hidden_states, "seq_lens": self.seq_lens,
                    "scheduler_metadata": self.builder.scheduler_metadata},
            state={"draft_kv_cache": self.kv_cache})

    def propose(self, target_attn_metadata, kv_rows, last_token, last_pos, target_hidden):
        num_reqs = last_token.shape[0]
        # Prefill: the draft model runs eagerly with the target model's attention metadata.
        h = self.model(self.kv_cache, kv_rows, last_token, last_pos, target_hidden, target_attn_metadata)
        first = self.model.compute_logits(h).argmax(-1)
        # _prepare_eagle_docode_kernel: the decode steps' inputs
        self.kv_rows[:num_reqs].copy_(kv_rows)
        self.input_ids[:num_reqs].copy_(first)
        self.positions[:num_reqs].copy_(last_pos + 1)
        self.hidden_states[:num_reqs].copy_(h)
        self.seq_lens[:num_reqs].copy_(last_pos + 2)
        if self.graphed:                                                   # a graph for num_reqs
            if self.variant == "fix":
                self._build_draft_attn_metadata(num_reqs)                  # refresh the builders' state
            tokens, h_last = replay(self.graph, self.out)
            return torch.cat([first[:, None], tokens], 1).clone(), h_last.clone()
        attn_metadata = self._build_draft_attn_metadata(num_reqs)          # eager mode
        tokens, h_last = self.generate_draft(num_reqs, attn_metadata)
        return torch.cat([first[:, None], tokens], 1), h_last


def run(variant: str, device: str = "cpu"):
    model = EagleDraftModel(device)
    gen = generator(1)
    cache0 = randn(1 + MAX_NUM_REQS, MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.5)
    hiddens = [randn(MAX_NUM_REQS, HIDDEN, gen=gen, device=device) for _ in range(3)]
    # (target seq_lens after verification, rejected drafts, last sampled token) per engine step
    steps = [([4, 5], [0, 1], [3, 7]), ([6, 8], [1, 0], [11, 2]), ([8, 9], [0, 1], [5, 9])]

    def serve(graphed: bool):
        builder = FlashAttentionMetadataBuilder(device)
        spec = EagleSpeculator(model, builder, cache0.clone(), device, variant, graphed)
        outs = []
        for (target_lens, rejected, sampled), hid in zip(steps, hiddens):
            t = lambda xs: torch.tensor(xs, dtype=torch.long).to(device)  # noqa: E731
            # The target model's step builds its metadata with the shared builder (verified lengths).
            target_md = builder.build(MAX_NUM_REQS, t(target_lens), target_lens)
            last_pos = t(target_lens) - 1 - t(rejected)
            tokens, h_last = spec.propose(target_md, t([1, 2]), t(sampled), last_pos, hid)
            outs += [tokens, h_last]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
