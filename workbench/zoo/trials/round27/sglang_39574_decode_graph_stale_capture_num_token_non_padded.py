"""A decode CUDA graph without EP reads ``num_token_non_padded`` as the last capture left it, and masks real tokens' experts.

Upstream: https://github.com/sgl-project/sglang/pull/39574 ("[misc] Fix tool-call index, graph padded-row count, and
prefill-graph input_embeds refresh"), change 2: "``num_token_non_padded`` is only handed out when it is maintained".
Symptom: without expert parallelism, decode batches served by a CUDA graph carried a stale capture-time count of
non-padded tokens, while the same batch run eagerly carries ``None``; with the standard MoE path masking rows at or
past that count (change 3 of the same PR), real decode tokens lose their routed-expert output (wrong logits).
Mechanism: ``DecodeInputBuffers.create`` allocated the ``num_token_non_padded`` slot unconditionally and
``capture_one_batch_size`` wrote it for every captured size (one scalar buffer shared by all the decode graphs,
captured largest size first, so after capture it holds the smallest size's count). ``replay_prepare`` refreshed it
only when ``enable_num_token_non_padded()`` (expert parallelism). Without EP the static ``ForwardBatch`` of every
graph therefore hands ``TopK`` the count of the last capture: at replay of the size-4 graph with 4 real tokens the
count still says 2, and ``_mask_topk_ids_padded_region`` masks the routed experts of real tokens 2 and 3. Eager
``ForwardBatch.init_new`` fills the count only under EP, so eager masks nothing.
Doctor: stale-input, at ``replay_prepare`` (it leaves the ``num_token_non_padded`` buffer, which every replayed
decode graph reads, as the last capture wrote it).
Fix (upstream): ``DecodeInputBuffers.create`` allocates the slot only when ``enable_num_token_non_padded()``, and the
capture-time writes are guarded, so graph and eager batches follow the same rule: no count unless it is live.
(Only the PR description was available; the diff was not read. The shared scalar buffer, the capture order and the
``bs`` written at capture are this model's reading of "wrote it at capture, and refreshed it at replay only under
expert parallelism". The standard MoE path's masking, added by change 3 of the same PR, is present in both variants;
the variants differ only in change 2. Top-1 routing, no EP, decode sizes 2 and 4.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/39574"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "replay_prepare"
SYMPTOM = "without EP, replayed decode graphs mask real tokens' MoE experts with a stale capture-time token count"

VOCAB, DIM, NUM_EXPERTS = 16, 4, 3
CAPTURE_BS = [2, 4]
EP_SIZE = 1


def enable_num_token_non_padded() -> bool:
    return EP_SIZE > 1


def _mask_topk_ids_padded_region(topk_ids, topk_weights, num_token_non_padded):
    """Rows at or past the non-padded count get expert ``-1`` and weight 0 (their experts are skipped)."""
    if num_token_non_padded is None:
        return topk_ids, topk_weights
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
    padded = rows >= num_token_non_padded
    return topk_ids.masked_fill(padded, -1), topk_weights.masked_fill(padded, 0.0)


class TopK:
    def __call__(self, router_logits, num_token_non_padded):
        topk_weights, topk_ids = torch.softmax(router_logits, -1).topk(1, dim=-1)
        return _mask_topk_ids_padded_region(topk_ids, topk_weights, num_token_non_padded)


class ForwardBatch:
    def __init__(self, input_ids, num_token_non_padded=None):
        self.input_ids = input_ids
        self.batch_size = input_ids.shape[0]
        self.num_token_non_padded = num_token_non_padded

    @classmethod
    def init_new(cls, input_ids, device):
        # Eager batches carry the count only when it is maintained (expert parallelism).
        count = (torch.tensor([input_ids.shape[0]], dtype=torch.int32).to(device)
                 if enable_num_token_non_padded() else None)
        return cls(input_ids, count)


class Qwen2MoeForCausalLM:
    def __init__(self, device):
        gen = generator(39574)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.gate = randn(DIM, NUM_EXPERTS, gen=gen, device=device)
        self.w_up = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.7)
        self.w_down = randn(NUM_EXPERTS, DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.topk = TopK()

    def moe(self, x, forward_batch):
        topk_ids, topk_weights = self.topk(x @ self.gate, forward_batch.num_token_non_padded)
        valid = topk_ids[:, 0] >= 0
        e = topk_ids[:, 0].clamp(min=0)
        h = torch.relu(torch.bmm(x[:, None, :], self.w_up[e]))
        out = torch.bmm(h, self.w_down[e]).squeeze(1)
        return out * (topk_weights * valid[:, None])

    def forward(self, forward_batch):
        x = self.embed[forward_batch.input_ids]
        return (x + self.moe(x, forward_batch)) @ self.lm_head


class DecodeInputBuffers:
    def __init__(self, max_bs, device, variant):
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        if variant == "bug" or enable_num_token_non_padded():
            self.num_token_non_padded = torch.zeros(1, dtype=torch.int32, device=device)
        else:
            self.num_token_non_padded = None


class CudaGraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.buffers = DecodeInputBuffers(max(CAPTURE_BS), device, variant)
        self.graphs, self.outputs = {}, {}
        static = {"input_ids": self.buffers.input_ids}
        if self.buffers.num_token_non_padded is not None:
            static["num_token_non_padded"] = self.buffers.num_token_non_padded
        self.static = static
        for bs in reversed(CAPTURE_BS):                 # largest first, as sglang captures
            self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs):
        buffers = self.buffers
        if buffers.num_token_non_padded is not None:
            buffers.num_token_non_padded.fill_(bs)      # the capture-time count of this size
        forward_batch = ForwardBatch(buffers.input_ids[:bs], buffers.num_token_non_padded)
        self.graphs[bs], self.outputs[bs] = capture(
            lambda: self.model.forward(forward_batch), device=self.device, name=f"decode bs {bs}",
            owner="CudaGraphRunner", static=self.static)

    def replay_prepare(self, input_ids):
        raw_bs = input_ids.shape[0]
        bs = next(b for b in CAPTURE_BS if b >= raw_bs)
        self.buffers.input_ids[:raw_bs].copy_(input_ids)
        self.buffers.input_ids[raw_bs:bs].zero_()       # padded requests decode token 0
        if enable_num_token_non_padded():
            self.buffers.num_token_non_padded.fill_(raw_bs)
        return raw_bs, bs

    def replay(self, input_ids):
        raw_bs, bs = self.replay_prepare(input_ids)
        return replay(self.graphs[bs], self.outputs[bs], real=raw_bs, size=bs)[:raw_bs].clone()


def run(variant: str, device: str = "cpu"):
    steps = [torch.tensor(ids).to(device) for ids in ([3, 6, 9, 12], [1, 4], [7, 2, 11], [5, 8, 13, 14])]

    def eager():
        model = Qwen2MoeForCausalLM(device)
        return [model.forward(ForwardBatch.init_new(ids, device)).clone() for ids in steps]

    def served():
        model = Qwen2MoeForCausalLM(device)
        runner = CudaGraphRunner(model, device, variant)
        return [runner.replay(ids) for ids in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
