"""ROCm naive-EP MoE cannot be graph-captured: ``BatchedDataRouter.prepare`` loops over experts on the host, reading ``count_nonzero`` of each expert's routing mask and gathering its tokens by boolean indexing.

Upstream: https://github.com/alibaba/rtp-llm/pull/1325 ("fix(moe): make ROCm batched (naive) EP routing padding-safe
and graph-capturable", alibaba/rtp-llm; loomts, opened 2026-08-24, merged; last stored review 2026-09-04).
Read: the PR description as stored (in Chinese: the per-expert Python loop with boolean indexing and ``count_nonzero()``
"introduces GPU-to-CPU synchronisation and blocks Graph capture"; the per-expert capacity ``ll_num_max_token /
tp_size``; the ROCm ``SelectTopk`` ``.int()`` copy; the fixed-shape ``prepare``/``finalize`` plan passed through a
per-forward ``router_context``; the executor sized by ``num_tokens``); the review thread quoting the new ``prepare``
head (``local_ids``, ``routed``, the scratch column ``num_experts``, ``match = zeros(...).scatter_(1, slots,
routed)``, "no boolean indexing, no device-to-host expert counts") and the reviewer's note that the int32 indices must
become int64 for ``scatter_``/``gather``; the AI review summary (router materialises ``[E, T, H]``). From the repository
snapshot of 2026-08-20 (before the merge): ``router/batched_data_router.py`` whole (``BatchedDataRouter``,
``TopKWeightAndReduceNaiveBatched``) and ``executor/batched_triton_executor.py`` (``BatchedTritonExperts.execute``).
The rest of the fixed code was not read: positions, packed rows and the finalize gather are rebuilt from the text.
Symptom: with the ROCm batched (naive EP, ``tp_size == ep_size``) MoE path, HIP graph capture of the decode step fails
(device-to-host synchronisation while the stream captures), so the engine cannot serve that configuration with graphs.
Mechanism: ``prepare`` runs ``rows = torch.count_nonzero(topks)`` and ``if rows == 0: continue`` for every local expert:
the ``if`` reads a device value on the host. Eagerly that is only a stall per expert; inside ``hipStreamBeginCapture``
the host read is refused and the capture dies (the boolean gather ``a1[topks]`` and ``finalize``'s
``fused_expert_output[e, :rows]`` / ``output[topks]`` are further host syncs on the same path).
Doctor: sync-in-capture, at prepare (its ``if rows == 0`` is the first host read of device data in the captured forward;
the fix rewrote ``prepare`` and ``finalize`` into shape-static tensor code).
Fix (upstream): ``prepare`` builds the routing plan with fixed shapes: ``local_ids``, ``routed``, ``slots`` (non-local
slots to a scratch column), the ``match`` matrix by ``scatter_``, per-expert positions by ``cumsum``, ``packed_rows``
per top-k slot, ``expert_num_tokens`` as a device count, inputs packed by ``index_copy`` into ``[E, num_tokens, H]``;
``finalize`` restores ``[num_tokens, top_k, H]`` with ``index_select``, zeroes non-local placeholder rows before any
multiplication, applies the top-k weights, sums over top-k. No ``.item()``, no boolean indexing.
Modelled: ``MoEConfigAdapter`` (8 experts, top-2, one rank), ``BatchedDataRouter.prepare``/``finalize`` (pre-fix as
read, fixed as rebuilt; the plan kept on a ``router_context``), ``TopKWeightAndReduceNaiveBatched.apply`` as read,
``BatchedTritonExperts.execute`` as read with stand-in kernels (``invoke_moe_batched_triton_kernel`` writes the first
``expert_num_tokens[e]`` rows of each expert block, ``silu_and_mul``), ``FusedMoe`` (prepare, execute, finalize),
``select_topk`` (softmax, top-k, renormalise), and a small decoder (embedding, gate + MoE, residual, lm_head) served
by a ``CudaGraphRunner`` stand-in (``initCapture`` over buckets 4 and 2 with one warm-up, ``canRun``, ``prepareInputs``
padding the batch, ``forward`` replaying). Not modelled: TP all-reduce (one rank), the ``SelectTopk`` int32 copy, the
executor's scratch sizing (it follows the router's layout here). float64.
Workload: 4 decode steps of 3, 4, 2 and 3 requests (random token ids, seeded); eager reference on the real batch.
Bug: ``initCapture`` raises CaptureError at ``if rows == 0`` in ``prepare`` while capturing the 4-request graph.
Fix: every step replays a padded graph (3 -> 4) or an exact one; max |graph - eager| = 3.6e-15 over all 12
logits rows (float64 rounding of the padded batches). The pre-fix and fixed routers agree eagerly to 2.7e-15.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/pull/1325"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "prepare"
SYMPTOM = ("ROCm naive-EP batched MoE: HIP graph capture of decode fails on the router's per-expert count_nonzero / "
           "boolean-index loop (a device-to-host sync in the captured forward)")

VOCAB, HIDDEN, INTER = 24, 16, 32
EXPERT_NUM, TOP_K = 8, 2
CAPTURE_BS = [2, 4]
DTYPE = torch.float64
_variant = "bug"


@dataclasses.dataclass
class MoEConfigAdapter:
    expert_num: int = EXPERT_NUM
    moe_k: int = TOP_K
    tp_size: int = 1
    ep_rank: int = 0
    ll_num_max_token: int = max(CAPTURE_BS)


@dataclasses.dataclass
class ExpertTokensMetadata:
    expert_num_tokens: torch.Tensor
    expert_num_tokens_cpu: Optional[torch.Tensor] = None


@dataclasses.dataclass
class ExpertForwardPayload:
    expert_x: torch.Tensor
    expert_x_scale: Optional[torch.Tensor]
    expert_tokens_meta: ExpertTokensMetadata


@dataclasses.dataclass
class CombineForwardPayload:
    fused_expert_output: torch.Tensor


# --- rtp_llm/models_py/modules/factory/fused_moe/impl/common/router/batched_data_router.py ------------

class TopKWeightAndReduceNaiveBatched(object):
    def __init__(self, rank: int):
        self.rank = rank

    def apply(self, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        num_tokens = topk_ids.size(0)
        num_local_experts = fused_expert_output.size(0)
        K = fused_expert_output.size(-1)
        output = torch.zeros((num_tokens, K), device=fused_expert_output.device, dtype=fused_expert_output.dtype)
        first_expert = num_local_experts * self.rank
        last_expert = first_expert + num_local_experts
        for expert_id in range(first_expert, last_expert):
            matching_tokens = topk_ids == expert_id
            topks = torch.any(matching_tokens, dim=1).flatten()
            rows = torch.count_nonzero(matching_tokens)
            rhs = fused_expert_output[expert_id - first_expert, :rows, :]
            if not apply_router_weight_on_input:
                rhs.mul_(topk_weights[matching_tokens].view(rhs.size(0), 1))
            output[topks] = output[topks] + rhs
        return output


class BatchedDataRouter:
    def __init__(self, config: MoEConfigAdapter):
        self.max_num_tokens = (config.ll_num_max_token + config.tp_size - 1) // config.tp_size
        self.ep_rank = config.ep_rank
        self.tp_size = config.tp_size
        self.num_local_experts = config.expert_num // self.tp_size
        self.router_context = None            # (fix) the per-forward routing plan prepare hands to finalize

    def prepare(self, a1, a1_scale, a2_scale, topk_weights, topk_ids) -> ExpertForwardPayload:
        assert a1.dim() == 2 and topk_ids.dim() == 2 and a1.size(0) == topk_ids.size(0)
        num_tokens, hidden_dim = a1.size()
        if _variant == "bug":
            tokens_per_expert = torch.zeros(self.num_local_experts, dtype=torch.int, device=a1.device)
            b_a1 = torch.zeros((self.num_local_experts, self.max_num_tokens, hidden_dim), dtype=a1.dtype,
                               device=a1.device)
            first_expert = self.num_local_experts * self.ep_rank
            last_expert = first_expert + self.num_local_experts
            for expert_id in range(first_expert, last_expert):
                topks = torch.any(topk_ids == expert_id, dim=1).flatten()
                rows = torch.count_nonzero(topks.flatten())
                if rows == 0:
                    continue
                idx = expert_id - first_expert
                tokens_per_expert[idx] = rows
                rhs = a1[topks]
                b_a1[idx, :rows, :] = rhs
            return ExpertForwardPayload(b_a1, None, ExpertTokensMetadata(tokens_per_expert))

        # Shapes below depend only on num_tokens, keeping the plan CUDA-Graph capturable:
        # no boolean indexing, no device-to-host expert counts.
        num_experts = self.num_local_experts
        local_ids = topk_ids.to(torch.int64) - num_experts * self.ep_rank
        routed = (local_ids >= 0) & (local_ids < num_experts)
        slots = torch.where(routed, local_ids, num_experts)      # column num_experts is scratch
        match = torch.zeros((num_tokens, num_experts + 1), dtype=torch.bool, device=a1.device).scatter_(
            1, slots, routed)
        counts = match.to(torch.int64)
        positions = counts.cumsum(0) - counts                    # rank of each token within its expert
        packed_rows = slots * num_tokens + positions.gather(1, slots)
        b_a1 = torch.zeros(((num_experts + 1) * num_tokens, hidden_dim), dtype=a1.dtype, device=a1.device)
        b_a1.index_copy_(0, packed_rows.flatten(), a1.repeat_interleave(topk_ids.size(1), dim=0))
        expert_num_tokens = counts[:, :num_experts].sum(0).to(torch.int32)
        self.router_context = (packed_rows, routed)
        expert_x = b_a1.view(num_experts + 1, num_tokens, hidden_dim)[:num_experts]
        return ExpertForwardPayload(expert_x, None, ExpertTokensMetadata(expert_num_tokens))

    def finalize(self, payload: CombineForwardPayload, topk_weights, topk_ids, apply_router_weight_on_input,
                 extra_finalize_args) -> torch.Tensor:
        if _variant == "bug":
            return TopKWeightAndReduceNaiveBatched(self.ep_rank).apply(
                payload.fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)
        packed_rows, routed = self.router_context
        out = payload.fused_expert_output
        rows = torch.where(routed, packed_rows, 0)                # placeholders read row 0 ...
        gathered = out.reshape(-1, out.size(-1)).index_select(0, rows.flatten()).view(*rows.shape, -1)
        gathered = torch.where(routed.unsqueeze(-1), gathered, 0.0)   # ... and are zeroed before any multiply
        if not apply_router_weight_on_input:
            gathered = gathered * topk_weights.unsqueeze(-1)
        return gathered.sum(dim=1)


# --- rtp_llm/models_py/modules/factory/fused_moe/impl/common/executor/batched_triton_executor.py -----

def invoke_moe_batched_triton_kernel(A, B, C, expert_num_tokens) -> None:
    """Per expert e: C[e, m] = A[e, m] @ B[e]^T for m < expert_num_tokens[e]; other rows are not written."""
    valid = torch.arange(A.size(1), device=A.device)[None, :] < expert_num_tokens[:, None]
    C.copy_(torch.where(valid.unsqueeze(-1), torch.bmm(A, B.transpose(1, 2)), C))


def silu_and_mul(out, x) -> None:
    d = x.size(-1) // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


class BatchedTritonExperts:
    def __init__(self, config: MoEConfigAdapter, weights):
        self.max_num_tokens = (config.ll_num_max_token + config.tp_size - 1) // config.tp_size
        self.w1, self.w2 = weights["moe_w1"], weights["moe_w2"]      # [E, 2I, H], [E, H, I]

    @property
    def local_num_experts(self) -> int:
        return self.w1.size(0)

    def execute(self, payload: ExpertForwardPayload, activation, expert_map, a2_scale, apply_router_weight_on_input,
                extra_expert_args) -> CombineForwardPayload:
        expert_num_tokens = payload.expert_tokens_meta.expert_num_tokens
        E, N = self.local_num_experts, self.w1.size(1)
        rows = payload.expert_x.size(1)       # max_num_tokens before the fix, num_tokens after
        dev, dt = payload.expert_x.device, payload.expert_x.dtype
        intermediate_cache1 = torch.empty((E, rows, N), device=dev, dtype=dt)
        intermediate_cache2 = torch.empty((E, rows, N // 2), device=dev, dtype=dt)
        output = torch.empty((E, rows, self.w2.size(1)), device=dev, dtype=self.w2.dtype)
        invoke_moe_batched_triton_kernel(payload.expert_x, self.w1, intermediate_cache1, expert_num_tokens)
        intermediate_cache2.fill_(0)
        silu_and_mul(intermediate_cache2.view(-1, N // 2), intermediate_cache1.view(-1, N))
        invoke_moe_batched_triton_kernel(intermediate_cache2, self.w2, output, expert_num_tokens)
        return CombineForwardPayload(fused_expert_output=output)


class FusedMoe:
    def __init__(self, router: BatchedDataRouter, fused_experts: BatchedTritonExperts):
        self.router, self.fused_experts = router, fused_experts

    def forward(self, hidden_states, topk_weights, topk_ids, activation="silu"):
        payload = self.router.prepare(hidden_states, None, None, topk_weights, topk_ids)
        combine_payload = self.fused_experts.execute(payload, activation, None, None, False, None)
        return self.router.finalize(combine_payload, topk_weights, topk_ids, False, None)


def select_topk(router_logits: torch.Tensor, top_k: int):
    """SelectTopk (softmax, top-k, renormalise)."""
    probs = torch.softmax(router_logits, dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    return topk_weights / topk_weights.sum(dim=-1, keepdim=True), topk_ids


# --- a small MoE decoder and the graph runner ---------------------------------------------------------

class MoEDecoder:
    def __init__(self, device: str):
        gen = generator(1325)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.config = MoEConfigAdapter()
        self.embed_tokens, self.gate = r(VOCAB, HIDDEN, scale=1.0), r(HIDDEN, EXPERT_NUM)
        self.lm_head = r(HIDDEN, VOCAB)
        weights = {"moe_w1": r(EXPERT_NUM, 2 * INTER, HIDDEN, scale=0.3),
                   "moe_w2": r(EXPERT_NUM, HIDDEN, INTER, scale=0.3)}
        self.moe = FusedMoe(BatchedDataRouter(self.config), BatchedTritonExperts(self.config, weights))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens[input_ids]
        topk_weights, topk_ids = select_topk(h @ self.gate, self.config.moe_k)
        return (h + self.moe.forward(h, topk_weights, topk_ids)) @ self.lm_head


class CudaGraphRunner:
    """Stand-in for rtp_llm/cpp/cuda_graph/cuda_graph_runner.cc (decode graphs per batch-size bucket)."""

    def __init__(self, model: MoEDecoder, device: str):
        self.model, self.device = model, device
        self.capture_range = sorted(CAPTURE_BS)
        self.input_ids = torch.zeros(max(CAPTURE_BS), dtype=torch.long, device=device)
        self.graph_instances = {}

    def initCapture(self):
        for bs in reversed(self.capture_range):
            self.input_ids.zero_()
            self.graph_instances[bs] = capture(
                lambda bs=bs: self.model.forward(self.input_ids[:bs]), device=self.device, warmups=1,
                name=f"decode bs={bs}", owner="CudaGraphRunner", static={"input_ids": self.input_ids})

    def canRun(self, batch_size: int) -> bool:
        return batch_size <= self.capture_range[-1]

    def prepareInputs(self, input_ids: torch.Tensor) -> int:
        bs = len(input_ids)
        graph_bs = next(b for b in self.capture_range if b >= bs)
        self.input_ids[:bs].copy_(input_ids)
        self.input_ids[bs:graph_bs].zero_()  # padded requests decode token 0
        return graph_bs

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        bs = len(input_ids)
        if not self.canRun(bs):
            return self.model.forward(input_ids)
        graph_bs = self.prepareInputs(input_ids)
        g, out = self.graph_instances[graph_bs]
        return replay(g, out, real=bs, size=graph_bs)[:bs]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(13250)
    steps = [torch.randint(0, VOCAB, (n,), generator=gen).to(device) for n in (3, 4, 2, 3)]

    def serve(use_cuda_graph: bool):
        model = MoEDecoder(device)
        if not use_cuda_graph:
            return [model.forward(ids).clone() for ids in steps]
        runner = CudaGraphRunner(model, device)
        runner.initCapture()
        return [runner.forward(ids).clone() for ids in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
