"""SGLang EAGLE/MTP draft CUDA graphs: when a smaller batch is padded up to a captured size, ``EAGLEDraftCudaGraphRunner.replay`` resets seq_lens, out_cache_loc and positions of the padded slots but leaves ``topk_p``, ``topk_index``, ``hidden_states`` and ``req_pool_indices`` as an earlier, larger batch left them, so the draft graph runs its padded rows on a finished request's data; a batch-wide op (a per-tensor dynamic activation scale here) carries that into the real rows.

Upstream: https://github.com/sgl-project/sglang/pull/18647 ("[sglang-miles] MTP related fix", sgl-project/sglang, by
yueming-yuan, opened 2026-02-12, merged). Read: the PR description (four bullets: ``--disable-draft-cuda-graph``;
"Zero-pad topk_p, topk_index, hidden_states, req_pool_indices for CUDA graph padding slots to prevent stale data
issues"; clamping ``topk_p`` / ``topk_index``; ``accept_length`` in ``filter_batch`` / ``merge_batch``) and
``EAGLEDraftCudaGraphRunner.replay`` in ``python/sglang/srt/speculative/eagle_draft_cuda_graph_runner.py`` at a later
commit (00023be5e), where the ``if bs != raw_bs:`` block zeroes ``topk_p``, ``topk_index``, ``hidden_states`` and
``req_pool_indices`` after ``seq_lens.fill_(seq_len_fill_value)``, ``out_cache_loc.zero_()``, ``positions.zero_()``;
the code before the fix is that block without those four resets. The diff itself was not in the corpus (the
repository is too large to fetch), so the pre-fix code is inferred from the description and the post-fix block.
Symptom: with MTP in RL rollouts (miles), draft graphs replayed at a padded batch size produced bad drafts
(out-of-range / NaN-prone values, lower acceptance) after the batch shrank; disabling draft CUDA graphs avoided it.
Mechanism: the runner captures draft graphs for ``capture_bs`` (1, 2, 4) over static buffers of ``max_bs`` rows. A
step of ``raw_bs`` requests is padded to ``bs = capture_bs[bisect_left(...)]``; ``replay`` copies only rows
``[:raw_bs]`` of ``topk_p`` / ``topk_index`` / ``hidden_states`` / ``req_pool_indices``, so rows ``[raw_bs, bs)`` keep
the last batch's values (a request that has since finished). The graph computes those rows too; any op that mixes rows
(here the per-tensor dynamic activation scale of the draft's quantized ``fc``) makes the real rows depend on them.
Eager never pads.
Doctor: stale-padding, at replay. Real rows of the draft output depend on what the padded rows of ``hidden_states`` /
``topk_index`` hold, and ``replay`` is where the padded slots are (not) neutralised.
Fix (upstream): zero ``topk_p``, ``topk_index``, ``hidden_states`` and ``req_pool_indices`` when ``bs != raw_bs``.
Modelled: ``EAGLEDraftCudaGraphRunner`` (static buffers, capture of every ``capture_bs`` in one pool, ``replay``'s
padding block, the raw-row copies, ``_postprocess_output_to_raw_bs``) and the multi-step draft forward
(``speculative_num_steps`` steps: embed the top-1 token, ``fc(cat(embed, hidden))``, a decoder MLP, lm_head,
softmax, top-k). Stand-ins: topk 1, no draft attention / KV writes (the padded rows' metadata resets are kept), the
quantized ``fc`` uses a per-tensor dynamic activation scale (amax over the batch) rounded to a 1/64 grid in float64
instead of FP8, and the target model's hidden states / first tokens are drawn at random; float64.
Workload: max_bs 4, capture_bs 1, 2, 4, 3 draft steps. Step 1 drafts for A, B, C, D (bs 4, no padding); D finishes
(its hidden state is the largest); step 2 drafts for A, B, C (raw_bs 3 padded to 4); step 3 for A, B (bs 2). Bug: step 1
and step 3 equal eager, step 2's real rows differ (D's stale hidden state in padded row 3 sets the activation scale):
step 2's draft scores differ by 0.697, its draft tokens by up to 21 ids and its final hidden states by 2.35e5
(the un-normalised draft MLP grows them over 3 steps); max |graph - eager| = 2.35e5. Fix: equals eager (max 6.55e-11, float64 rounding at hidden-state magnitudes of ~1e5; scores 6.7e-16); the zeroed
padded row's own values stay below the real rows' amax in this workload, so the scale is eager's.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/18647"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "replay"
SYMPTOM = ("EAGLE/MTP draft CUDA graphs replayed at a padded batch size run the padded rows on a finished request's "
           "stale topk_index / hidden_states, and a batch-wide activation scale carries them into the real drafts")

VOCAB, HIDDEN, INTER = 32, 16, 24
MAX_BS, CAPTURE_BS, NUM_STEPS, TOPK = 4, (1, 2, 4), 3, 1
SEQ_LEN_FILL_VALUE = 1
QUANT_LEVELS = 64.0
DTYPE = torch.float64

_variant = "bug"


def dynamic_per_tensor_quant(x):
    """Stand-in for a per-tensor dynamic activation quant (scale from the amax over the whole batch)."""
    scale = x.abs().amax().clamp_min(1e-12) / QUANT_LEVELS
    return torch.round(x / scale) * scale


class DraftModel:
    """Stand-in for the EAGLE/MTP draft head: fc(cat(embed(token), hidden)) -> MLP -> lm_head."""

    def __init__(self, device):
        gen = generator(18647)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.fc = r(HIDDEN, 2 * HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.lm_head = r(VOCAB, HIDDEN)

    def forward(self, input_ids, hidden_states):
        x = torch.cat([self.embed_tokens[input_ids], hidden_states], dim=-1)
        h = F.linear(dynamic_per_tensor_quant(x), self.fc)
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, self.down)
        return F.linear(h, self.lm_head), h


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: torch.Tensor


def draft_forward(model, forward_batch: ForwardBatch):
    """EAGLEWorker.draft_forward (reduced): ``speculative_num_steps`` top-k expansions."""
    topk_index, hidden_states = forward_batch.topk_index, forward_batch.hidden_states
    score_list, token_list = [], []
    scores = forward_batch.topk_p
    for _ in range(NUM_STEPS):
        logits, hidden_states = model.forward(topk_index.flatten(), hidden_states)
        probs = torch.softmax(logits, dim=-1)
        topk_p, topk_index = probs.topk(TOPK, dim=-1)
        scores = scores * topk_p
        score_list.append(scores)
        token_list.append(topk_index)
    return torch.cat(score_list, dim=1), torch.cat(token_list, dim=1), hidden_states


@dataclasses.dataclass
class Buffers:
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: torch.Tensor
    req_pool_indices: torch.Tensor

    def as_dict(self):
        return dict(vars(self))


class EAGLEDraftCudaGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.capture_bs = list(CAPTURE_BS)
        self.num_tokens_per_bs = TOPK
        self.seq_len_fill_value = SEQ_LEN_FILL_VALUE
        i64 = dict(dtype=torch.int64, device=device)
        self.buffers = Buffers(
            seq_lens=torch.full((MAX_BS,), self.seq_len_fill_value, **i64),
            out_cache_loc=torch.zeros(MAX_BS * NUM_STEPS, **i64), positions=torch.zeros(MAX_BS, **i64),
            topk_p=torch.zeros(MAX_BS, TOPK, dtype=DTYPE, device=device), topk_index=torch.zeros(MAX_BS, TOPK, **i64),
            hidden_states=torch.zeros(MAX_BS, HIDDEN, dtype=DTYPE, device=device),
            req_pool_indices=torch.zeros(MAX_BS, **i64))
        self.graphs, self.output_buffers = {}, {}
        pool = graph_pool_handle(device)
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs, pool)

    def capture_one_batch_size(self, bs, pool):
        b = self.buffers
        forward_batch = ForwardBatch(bs, b.seq_lens[:bs], b.req_pool_indices[:bs], b.positions[:bs],
                                     b.out_cache_loc[:bs * NUM_STEPS], b.topk_p[:bs], b.topk_index[:bs],
                                     b.hidden_states[:bs])
        return capture(lambda: draft_forward(self.model, forward_batch), device=self.device, pool=pool, warmups=2,
                       static=b.as_dict(), owner="EAGLEDraftCudaGraphRunner", name=f"draft bs {bs}")

    def _postprocess_output_to_raw_bs(self, out, raw_bs):
        return tuple(t[:raw_bs] for t in out)

    def replay(self, forward_batch: ForwardBatch):
        buffers = self.buffers
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        bs = self.capture_bs[index]
        if bs != raw_bs:
            buffers.seq_lens.fill_(self.seq_len_fill_value)
            buffers.out_cache_loc.zero_()
            buffers.positions.zero_()
            if _variant == "fix":
                buffers.topk_p.zero_()
                buffers.topk_index.zero_()
                if buffers.hidden_states is not None:
                    buffers.hidden_states.zero_()
                buffers.req_pool_indices.zero_()

        buffers.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        buffers.out_cache_loc[: raw_num_token * NUM_STEPS].copy_(forward_batch.out_cache_loc)
        buffers.positions[:raw_num_token].copy_(forward_batch.positions)
        buffers.topk_p[:raw_bs].copy_(forward_batch.topk_p)
        buffers.topk_index[:raw_bs].copy_(forward_batch.topk_index)
        buffers.hidden_states[:raw_bs].copy_(forward_batch.hidden_states)
        buffers.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)

        padded = {"topk_p": buffers.topk_p, "topk_index": buffers.topk_index, "hidden_states": buffers.hidden_states,
                  "req_pool_indices": buffers.req_pool_indices}
        out = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs, padded=padded)
        if bs != raw_bs:
            out = self._postprocess_output_to_raw_bs(out, raw_bs)
        return out


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    gen = generator(7)
    reqs = {}
    for i, name in enumerate("ABCD"):
        scale = 4.0 if name == "D" else 1.0                     # D's target hidden state has the largest amax
        reqs[name] = dict(pool_idx=i + 1, seq_len=5 + i, token=int(torch.randint(0, VOCAB, (1,), generator=gen)),
                          hidden=torch.randn(HIDDEN, generator=gen, dtype=DTYPE) * scale)

    def make_batch(names):
        i64 = dict(dtype=torch.int64)
        n = len(names)
        return ForwardBatch(
            batch_size=n, seq_lens=torch.tensor([reqs[r]["seq_len"] for r in names], **i64).to(device),
            req_pool_indices=torch.tensor([reqs[r]["pool_idx"] for r in names], **i64).to(device),
            positions=torch.tensor([reqs[r]["seq_len"] - 1 for r in names], **i64).to(device),
            out_cache_loc=torch.arange(1, 1 + n * NUM_STEPS, **i64).to(device),
            topk_p=torch.ones(n, TOPK, dtype=DTYPE).to(device),
            topk_index=torch.tensor([[reqs[r]["token"]] for r in names], **i64).to(device),
            hidden_states=torch.stack([reqs[r]["hidden"] for r in names]).to(device))

    steps = (["A", "B", "C", "D"], ["A", "B", "C"], ["A", "B"])

    def serve(use_graph: bool):
        model = DraftModel(device)
        runner = EAGLEDraftCudaGraphRunner(model, device) if use_graph else None
        outs = []
        for names in steps:
            fb = make_batch(names)
            scores, tokens, hidden = runner.replay(fb) if use_graph else draft_forward(model, fb)
            outs += [scores.clone(), tokens.to(DTYPE).clone(), hidden.clone()]
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
