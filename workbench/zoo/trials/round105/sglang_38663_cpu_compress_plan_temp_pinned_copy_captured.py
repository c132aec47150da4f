"""SGLang DeepSeek-V4 (HIP radix backend), fixed-size MTP target verify under CUDA graphs: with CPU sequence lengths
the compression plan is built by the host planner inside the captured forward, into a temporary pinned buffer that an
async copy moves to the device; the host planning runs once, at capture, and every replay re-copies that capture-time
plan, so compressed-KV and state writes land at stale offsets.

Upstream: https://github.com/sgl-project/sglang/pull/38663 ("[AMD] Prevent DeepSeek-V4 MTP GPU faults during graph
replay", sgl-project/sglang, by bingxche, opened 2026-09-09, open when read, not merged). It names #26383
(``deaba74745d7``, which made HIP-Radix target verification build its metadata early from CPU sequence lengths) as the
regression and #30964 (GPU planner for ragged verification only) as leaving fixed-size MTP uncovered.
Read: the PR description ("The CPU planner fills a temporary pinned-memory buffer and starts an asynchronous copy to
the GPU. CUDA Graph captures that copy for later replay, but the temporary CPU buffer is not kept as graph state. A
replay can therefore use stale plan offsets. The C128 write kernel then writes outside its allocation"; fix: "Use the
existing GPU planner in the two cases that require it: CUDA Graph replay, and ragged verification" without CPU
lengths); through code search (excerpts of stored copies, the sgl-project path listed by find_files, versions not
pinned) ``CompressorPrefillPlan.generate`` / ``compress_plan`` / ``compress_forward`` of
``python/sglang/jit_kernel/dsv4/compress.py`` (``plan_tensor = torch.empty((2, num_q_tokens, 16), uint8,
device=seq_lens.device, pin_memory=seq_lens.is_cpu)``; the planner fills it; the plans are ``plan_tensor[i,
:plan_lens[i]].to(device, non_blocking=True)``; with ``use_cuda_graph`` the planner pads to ``num_q_tokens``;
``compress_forward`` builds the plan itself when given ``seq_lens``/``extend_lens``; one copy's HIP branch calls
``plan_compress_prefill_torch``) and the host planner ``plan_compress_prefill`` of ``compress_plan_torch.py`` (rows
of 4 int32: ragged_id, batch_id, position, window_len; invalid rows -1; a compress event where ``(position + 1) %
compress_ratio == 0``; a state write per window token). The HIP radix backend's own code was not found.
Symptom: DeepSeek-V4 with MTP on MI355X crashes with a multi-rank GPU memory fault (scheduler exit -6) once CUDA graph
replay serves fixed-size target verification; eager serving is fine.
Mechanism: with host lengths, ``generate`` plans on the host inside the captured forward. Host work is not recorded:
the plan is computed once, for the capture's dummy batch, and the captured ``.to(device, non_blocking=True)`` is a
memcpy node keeping the pinned buffer's address (torch keeps host blocks made in a capture for the graph). Each replay
copies that capture-time plan again, so the compress and state-write kernels use the dummy batch's positions and batch
rows, not the live ones.
Doctor: host-work-frozen, at generate. The compression plan is host work inside the captured region; replays repeat
only its copy, so the plan stays at its capture-time value.
Fix (upstream): under CUDA graph replay pass the device sequence lengths, so the (GPU) planner runs inside the graph.
Modelled: ``CompressorPrefillPlan.generate`` (host path: pinned plan filled by the host planner, async copies; device
path: the planner on device tensors), ``compress_plan``, ``compress_forward`` (state writes from the write plan, then
compression from the compress plan), a CudaGraphRunner for TARGET_VERIFY (sizes 1 and 2, padded rows to request slot
0, metadata built before every replay). Stand-ins: the HIP radix backend's target-verify metadata builder
(``init_forward_metadata_target_verify``, where the fix changes which lengths the planner gets); a one-layer model whose
attention reads the request's complete compressed blocks (ratio 4 for 128) plus the token itself; the device planner
keeps one row per token (invalid rows -1) instead of compacting; prompts prefilled eagerly through the same path; MTP
drafts fixed and all accepted; float64.
Workload: compress ratio 4, 4 verify tokens per request; prompts A (6) and B (9) prefilled eagerly; verify [A, B],
[A], [A, B], [B] (graphs of sizes 2 and 1). Bug: every replay compresses with the capture-time dummy plan; the 24
verify logit rows differ from eager (max error 10.6, CPU and an H100 alike). Fix: equal to eager (max error 0 on both).
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.engine import graph_pool_handle, host, is_host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/38663"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "generate"
SYMPTOM = ("DeepSeek-V4 MTP target verify under CUDA graphs compresses KV at stale plan offsets: the compression "
           "plan is built by the host planner once, at capture, and every replay copies that capture-time plan")

VOCAB, HIDDEN, HEAD_DIM = 32, 16, 8
COMPRESS_RATIO, RING_SIZE, MAX_BLOCKS, MAX_REQS = 4, 16, 8, 3
NUM_DRAFT_TOKENS = 4                        # MTP: last token + 3 drafts per request, fixed size
CUDA_GRAPH_BS = [1, 2]
DTYPE = torch.float64

_variant = "bug"


# --- python/sglang/jit_kernel/dsv4/compress.py (planner and compressor, reduced) ------------------------------------

def plan_compress_prefill_host(extend_lens, seq_lens, plan_c, plan_w, compress_ratio, use_cuda_graph):
    """Host planner: compress rows for window ends, write rows for every token; padded with -1 rows."""
    plan_c.fill_(-1)
    plan_w.fill_(-1)
    nc = nw = counter = 0
    for b, (sl, el) in enumerate(zip(seq_lens.tolist(), extend_lens.tolist())):
        for j in range(el):
            position, ragged_id = sl - el + j, counter + j
            if (position + 1) % compress_ratio == 0:
                plan_c[nc, 0], plan_c[nc, 1], plan_c[nc, 2], plan_c[nc, 3] = ragged_id, b, position, compress_ratio
                nc += 1
            plan_w[nw, 0], plan_w[nw, 1], plan_w[nw, 2], plan_w[nw, 3] = ragged_id, b, position, 0
            nw += 1
        counter += el
    n = plan_c.shape[0]
    return (n, n) if use_cuda_graph else (nc, nw)


def plan_compress_prefill_device(extend_lens, seq_lens, plan_c, plan_w, compress_ratio):
    """Device planner (stand-in for the JIT kernel on device lengths): one row per token slot."""
    n = plan_c.shape[0]
    t = torch.arange(n, device=seq_lens.device)
    cu = torch.cumsum(extend_lens, 0)
    b = torch.searchsorted(cu, t, right=True).clamp(max=cu.numel() - 1)
    position = seq_lens[b] - extend_lens[b] + (t - (cu[b] - extend_lens[b]))
    is_tok = t < cu[-1]
    is_c = is_tok & ((position + 1) % compress_ratio == 0)
    rows = torch.stack([t, b, position, torch.full_like(t, compress_ratio)], 1).to(torch.int32)
    plan_c.copy_(torch.where(is_c[:, None], rows, torch.full_like(rows, -1)))
    rows[:, 3] = 0
    plan_w.copy_(torch.where(is_tok[:, None], rows, torch.full_like(rows, -1)))
    return n, n


class CompressorPrefillPlan:
    def __init__(self, compress_ratio, compress_plan, write_plan):
        self.compress_ratio, self.compress_plan, self.write_plan = compress_ratio, compress_plan, write_plan

    @staticmethod
    def generate(compress_ratio, num_q_tokens, seq_lens, extend_lens, device, use_cuda_graph=False):
        seq_lens, extend_lens = seq_lens.to(torch.int64), extend_lens.to(torch.int64)
        if is_host(seq_lens) or (seq_lens.is_cpu and torch.device(device).type == "cuda"):
            # pin_memory=seq_lens.is_cpu: a temporary pinned buffer, planned on the host
            plan_tensor = host(torch.empty((2, num_q_tokens, 4), dtype=torch.int32), device)
            plan_lens = plan_compress_prefill_host(extend_lens, seq_lens, plan_tensor[0], plan_tensor[1],
                                                   compress_ratio, use_cuda_graph)
        else:
            plan_tensor = torch.empty((2, num_q_tokens, 4), dtype=torch.int32, device=seq_lens.device)
            plan_lens = plan_compress_prefill_device(extend_lens, seq_lens, plan_tensor[0], plan_tensor[1],
                                                     compress_ratio)
        return CompressorPrefillPlan(compress_ratio,
                                     plan_tensor[0, : plan_lens[0]].to(device, non_blocking=True),
                                     plan_tensor[1, : plan_lens[1]].to(device, non_blocking=True))


def compress_plan(compress_ratio, num_q_tokens, seq_lens, extend_lens, device, use_cuda_graph):
    return CompressorPrefillPlan.generate(compress_ratio, num_q_tokens, seq_lens, extend_lens, device,
                                          use_cuda_graph)


def compress_forward(kv_score_buffer, kv_score_input, indices, plan, out, *, compress_ratio):
    """Write plan: token kv into the request's state ring; compress plan: mean of the window into the compressed
    cache. Invalid (-1) rows go to request slot 0 (the padding dummy), never read for real rows."""
    w, c = plan.write_plan.long(), plan.compress_plan.long()
    ok_w, ok_c = w[:, 1] >= 0, c[:, 1] >= 0
    row_w = torch.where(ok_w, indices[w[:, 1].clamp(min=0)], torch.zeros_like(w[:, 1]))
    slot_w = torch.where(ok_w, w[:, 2] % RING_SIZE, torch.zeros_like(w[:, 2]))
    kv_score_buffer[row_w, slot_w] = kv_score_input[w[:, 0].clamp(min=0)]
    row_c = torch.where(ok_c, indices[c[:, 1].clamp(min=0)], torch.zeros_like(c[:, 1]))
    window = (c[:, 2:3] - torch.arange(compress_ratio, device=c.device)[None, :]) % RING_SIZE
    blk = torch.where(ok_c, c[:, 2] // compress_ratio, torch.zeros_like(c[:, 2])).clamp(0, MAX_BLOCKS - 1)
    out[row_c, blk] = kv_score_buffer[row_c[:, None], window].mean(1)


# --- the HIP radix backend's target-verify metadata (stand-in names) and the model ----------------------------------

@dataclasses.dataclass
class VerifyMetadata:
    c_seq_lens: torch.Tensor           # lengths the compression planner reads
    c_extend_lens: torch.Tensor
    use_cuda_graph: bool


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor             # device: prefix + extend
    extend_lens: torch.Tensor          # device
    seq_lens_cpu: list
    extend_lens_cpu: list
    attn_metadata: VerifyMetadata = None


class HipRadixAttnBackend:
    def __init__(self, device):
        self.device = device

    def init_forward_metadata_target_verify(self, forward_batch: ForwardBatch, in_cuda_graph: bool):
        if in_cuda_graph and _variant == "fix":          # the GPU planner under CUDA graph replay
            seq_lens, extend_lens = forward_batch.seq_lens, forward_batch.extend_lens
        else:                                           # #26383: full metadata early, from CPU lengths
            seq_lens = host(torch.tensor(forward_batch.seq_lens_cpu, dtype=torch.int64), self.device)
            extend_lens = host(torch.tensor(forward_batch.extend_lens_cpu, dtype=torch.int64), self.device)
        forward_batch.attn_metadata = VerifyMetadata(seq_lens, extend_lens, in_cuda_graph)


class DeepseekV4ForCausalLM:
    def __init__(self, device):
        gen = generator(38663)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_BLOCKS * COMPRESS_RATIO, HIDDEN)
        self.wq, self.wkv, self.wo, self.lm_head = r(HIDDEN, HEAD_DIM), r(HIDDEN, HEAD_DIM), r(HEAD_DIM, HIDDEN), \
            r(HIDDEN, VOCAB)
        self.kv_state = torch.zeros(MAX_REQS + 1, RING_SIZE, HEAD_DIM, dtype=DTYPE, device=device)
        self.c_kv = torch.zeros(MAX_REQS + 1, MAX_BLOCKS, HEAD_DIM, dtype=DTYPE, device=device)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch):
        md = forward_batch.attn_metadata
        h = self.embed[input_ids] + self.pos_embed[positions]
        q, kv = h @ self.wq, h @ self.wkv
        plan = compress_plan(COMPRESS_RATIO, input_ids.numel(), md.c_seq_lens, md.c_extend_lens, input_ids.device,
                             md.use_cuda_graph)
        compress_forward(self.kv_state, kv, forward_batch.req_pool_indices, plan, self.c_kv,
                         compress_ratio=COMPRESS_RATIO)
        # attention over the request's complete compressed blocks and the token itself
        cu = torch.cumsum(forward_batch.extend_lens, 0)
        b = torch.searchsorted(cu, torch.arange(input_ids.numel(), device=q.device), right=True)
        rows = forward_batch.req_pool_indices[b.clamp(max=cu.numel() - 1)]
        keys = torch.cat([self.c_kv[rows], kv[:, None, :]], 1)                        # [T, MAX_BLOCKS + 1, Dh]
        blocks = torch.arange(MAX_BLOCKS + 1, device=q.device)
        allowed = (blocks[None, :] < (positions[:, None] + 1) // COMPRESS_RATIO) | (blocks[None, :] == MAX_BLOCKS)
        scores = torch.einsum("td,tkd->tk", q, keys) * HEAD_DIM ** -0.5
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        h = h + torch.einsum("tk,tkd->td", attn, keys) @ self.wo
        return h @ self.lm_head


# --- python/sglang/srt/model_executor/cuda_graph_runner.py (TARGET_VERIFY, reduced) ---------------------------------

class CudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner, self.device = model_runner, model_runner.device
        self.capture_bs, self.num_tokens_per_bs = CUDA_GRAPH_BS, NUM_DRAFT_TOKENS
        self.max_bs = max(self.capture_bs)
        n = self.max_bs * self.num_tokens_per_bs
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids, self.positions = torch.zeros(n, **i64), torch.zeros(n, **i64)
        self.req_pool_indices = torch.zeros(self.max_bs, **i64)
        self.seq_len_fill_value = self.num_tokens_per_bs
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, **i64)
        self.extend_lens = torch.full((self.max_bs,), self.num_tokens_per_bs, **i64)
        self.graphs, self.outputs = {}, {}
        self.capture()

    def _batch(self, bs, seq_lens_cpu):
        n = bs * self.num_tokens_per_bs
        return ForwardBatch(bs, self.input_ids[:n], self.positions[:n], self.req_pool_indices[:bs],
                            self.seq_lens[:bs], self.extend_lens[:bs], seq_lens_cpu, [self.num_tokens_per_bs] * bs)

    def capture(self):
        pool = graph_pool_handle(self.device)
        model = self.model_runner.model
        static = {"input_ids": self.input_ids, "positions": self.positions, "seq_lens": self.seq_lens,
                  "req_pool_indices": self.req_pool_indices, "extend_lens": self.extend_lens}
        for bs in reversed(self.capture_bs):
            fb = self._batch(bs, [self.seq_len_fill_value] * bs)
            self.model_runner.attn_backend.init_forward_metadata_target_verify(fb, in_cuda_graph=True)
            self.graphs[bs], self.outputs[bs] = capture(
                lambda fb=fb: model.forward(fb.input_ids, fb.positions, fb), device=self.device, pool=pool,
                warmups=2, static=static, state={"kv_state": model.kv_state, "c_kv": model.c_kv},
                owner="CudaGraphRunner", on_freed="reuse", name=f"target verify bs {bs}")

    def replay(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.req_pool_indices.zero_()
        self.input_ids[:raw_num_token].copy_(forward_batch.input_ids)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        seq_lens_cpu = forward_batch.seq_lens_cpu + [self.seq_len_fill_value] * (bs - raw_bs)
        self.model_runner.attn_backend.init_forward_metadata_target_verify(self._batch(bs, seq_lens_cpu),
                                                                           in_cuda_graph=True)
        out = replay(self.graphs[bs], self.outputs[bs], real=raw_num_token, size=bs * self.num_tokens_per_bs)
        return out[:raw_num_token]


class ModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = DeepseekV4ForCausalLM(device)
        self.attn_backend = HipRadixAttnBackend(device)
        self.graph_runner = CudaGraphRunner(self) if use_cuda_graph else None

    def forward(self, forward_batch: ForwardBatch, is_verify: bool):
        if is_verify and self.graph_runner is not None:
            return self.graph_runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata_target_verify(forward_batch, in_cuda_graph=False)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    steps = [["A", "B"], ["A"], ["A", "B"], ["B"]]

    def serve(use_cuda_graph):
        runner = ModelRunner(device, use_cuda_graph)
        gen = generator(105)
        i64 = dict(dtype=torch.int64, device=device)
        reqs = {"A": dict(slot=1, len=0), "B": dict(slot=2, len=0)}

        def batch(names, n_new):
            ids, pos = [], []
            for name in names:
                r = reqs[name]
                ids += torch.randint(0, VOCAB, (n_new[name],), generator=gen).tolist()
                pos += list(range(r["len"], r["len"] + n_new[name]))
                r["len"] += n_new[name]
            lens = [reqs[nm]["len"] for nm in names]
            return ForwardBatch(len(names), torch.tensor(ids, **i64), torch.tensor(pos, **i64),
                                torch.tensor([reqs[nm]["slot"] for nm in names], **i64), torch.tensor(lens, **i64),
                                torch.tensor([n_new[nm] for nm in names], **i64), lens, [n_new[nm] for nm in names])

        runner.forward(batch(["A", "B"], {"A": 6, "B": 9}), is_verify=False)          # prefill, eager
        outs = []
        for step in steps:
            fb = batch(step, {name: NUM_DRAFT_TOKENS for name in step})                # all drafts accepted
            outs.append(runner.forward(fb, is_verify=True).clone())
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
