"""The sampler captured in the decode graph froze its min-p dispatch at capture: replays ignore ``min_p``.

Upstream: https://github.com/sgl-project/sglang/pull/1306 ("Fix bugs in sampler with CUDA graph /
torch.compile"), fixing https://github.com/sgl-project/sglang/issues/1301.
Symptom: after the sampler was moved into the decode CUDA graph (sgl-project/sglang#1253, late August
2024), requests with ``min_p > 0`` were sampled as if ``min_p`` were 0 whenever the decode step ran
through the CUDA graph; with ``--disable-cuda-graph`` the same requests honoured it (sglang v0.2.14/15).
Mechanism: ``CudaGraphRunner`` captures ``forward_decode`` together with ``Sampler.forward_cuda`` on a
dummy ``SamplingBatchInfo`` (``SamplingBatchInfo.dummy_one``: temperature 1, top_p 1, top_k max, min_p
0). ``forward_cuda`` chooses between the min-p kernel path (top-k renorm -> top-p renorm ->
``min_p_sampling_from_probs``) and the joint ``top_k_top_p_sampling_from_probs`` kernel on the host,
from the batch's ``need_min_p_sampling``. At capture that is False, so only the top-k/top-p kernels are
recorded. On replay ``inplace_assign`` copies the live batch's ``temperatures``/``top_ps``/``top_ks``/
``min_ps`` tensors into the static sampling buffers, but no kernel reads ``min_ps`` any more: the
branch was decided once, at capture. Eager decode takes the min-p path for the same batch and
returns different tokens.
Doctor: warmup-divergence, at ``forward_cuda`` (the sampler's min-p dispatch was decided at capture from
the dummy batch; replays reuse it while an eager step decides otherwise).
Fix (upstream): ``SamplingBatchInfo`` carries ``need_min_p_sampling`` and the decode step does not use the
CUDA graph when a batch needs min-p sampling (``ModelRunner.forward_decode`` falls back to eager), so
the captured top-k/top-p path only serves batches it is valid for.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/1306"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward_cuda"
SYMPTOM = "min_p is silently ignored for decode steps served by the CUDA graph (sampler captured without it)"
VOCAB, DIM = 8, 4
BATCH_SIZE_LIST = [1, 2, 4]


@dataclasses.dataclass
class SamplingBatchInfo:
    vocab_size: int
    temperatures: torch.Tensor = None
    top_ps: torch.Tensor = None
    top_ks: torch.Tensor = None
    min_ps: torch.Tensor = None
    # Dispatch in CUDA graph
    need_min_p_sampling: bool = False

    @classmethod
    def from_params(cls, params, vocab_size, device):
        return cls(
            vocab_size=vocab_size,
            temperatures=torch.tensor([p["temperature"] for p in params], device=device).view(-1, 1),
            top_ps=torch.tensor([p["top_p"] for p in params], device=device),
            top_ks=torch.tensor([p["top_k"] for p in params], dtype=torch.int32, device=device),
            min_ps=torch.tensor([p["min_p"] for p in params], device=device),
            need_min_p_sampling=any(p["min_p"] > 0 for p in params),
        )

    @classmethod
    def dummy_one(cls, max_bs, vocab_size, device):
        return cls(
            vocab_size=vocab_size,
            temperatures=torch.ones((max_bs, 1), device=device),
            top_ps=torch.ones((max_bs,), device=device),
            top_ks=torch.full((max_bs,), vocab_size, dtype=torch.int32, device=device),
            min_ps=torch.zeros((max_bs,), device=device),
        )

    def __getitem__(self, key):
        return SamplingBatchInfo(self.vocab_size, self.temperatures[key], self.top_ps[key], self.top_ks[key],
                                 self.min_ps[key], self.need_min_p_sampling)

    def inplace_assign(self, bs, other):
        self.temperatures[:bs] = other.temperatures
        self.top_ps[:bs] = other.top_ps
        self.top_ks[:bs] = other.top_ks
        self.min_ps[:bs] = other.min_ps


def top_k_renorm_prob(probs, top_ks):
    ranks = probs.argsort(-1, descending=True).argsort(-1)
    probs = probs * (ranks < top_ks[:, None].long())
    return probs / probs.sum(-1, keepdim=True)


def top_p_renorm_prob(probs, top_ps):
    sorted_p, idx = probs.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_ps[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def _inverse_cdf(probs, uniform_samples):
    """Deterministic stand-in for flashinfer's rejection sampler: one uniform per row."""
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, (uniform_samples * cdf[:, -1]).unsqueeze(-1)).squeeze(-1).clamp(max=VOCAB - 1)


def top_k_top_p_sampling_from_probs(probs, uniform_samples, top_ks, top_ps):
    return _inverse_cdf(top_p_renorm_prob(top_k_renorm_prob(probs, top_ks), top_ps), uniform_samples)


def min_p_sampling_from_probs(probs, uniform_samples, min_ps):
    keep = probs >= probs.max(-1, keepdim=True).values * min_ps[:, None]
    return _inverse_cdf(probs * keep, uniform_samples)


class Sampler:
    def forward_cuda(self, logits, sampling_info: SamplingBatchInfo, uniform_samples):
        probs = torch.softmax(logits / sampling_info.temperatures, dim=-1)
        if sampling_info.need_min_p_sampling:
            probs = top_k_renorm_prob(probs, sampling_info.top_ks)
            probs = top_p_renorm_prob(probs, sampling_info.top_ps)
            batch_next_token_ids = min_p_sampling_from_probs(probs, uniform_samples, sampling_info.min_ps)
        else:
            batch_next_token_ids = top_k_top_p_sampling_from_probs(
                probs, uniform_samples, sampling_info.top_ks, sampling_info.top_ps)
        return batch_next_token_ids


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(1306)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=1.5)
        self.sampler = Sampler()

    def forward_decode(self, input_ids, sampling_info, uniform_samples):
        x = self.embed[input_ids.long()]
        logits = (x + torch.tanh(x @ self.w)) @ self.lm_head
        return self.sampler.forward_cuda(logits, sampling_info, uniform_samples)


class CudaGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.batch_size_list = BATCH_SIZE_LIST
        self.max_bs = max(self.batch_size_list)
        self.input_ids = torch.zeros((self.max_bs,), dtype=torch.int32, device=device)
        self.uniform_samples = torch.zeros((self.max_bs,), device=device)
        # Sampling inputs
        self.sampling_info = SamplingBatchInfo.dummy_one(self.max_bs, VOCAB, device)
        self.graphs, self.output_buffers = {}, {}
        for bs in reversed(self.batch_size_list):
            def run_once(bs=bs):
                return self.model.forward_decode(self.input_ids[:bs], self.sampling_info[:bs],
                                                 self.uniform_samples[:bs])
            self.graphs[bs], self.output_buffers[bs] = capture(
                run_once, device=device, name=f"bs {bs}",
                static={"input_ids": self.input_ids, "uniform_samples": self.uniform_samples,
                        "temperatures": self.sampling_info.temperatures, "top_ps": self.sampling_info.top_ps,
                        "top_ks": self.sampling_info.top_ks, "min_ps": self.sampling_info.min_ps},
                owner="CudaGraphRunner (decode + sampler)")

    def can_run(self, batch_size):
        return batch_size <= self.max_bs

    def replay(self, input_ids, sampling_info, uniform_samples):
        raw_bs = input_ids.shape[0]
        bs = self.batch_size_list[bisect.bisect_left(self.batch_size_list, raw_bs)]
        self.input_ids[:raw_bs] = input_ids
        self.uniform_samples[:raw_bs] = uniform_samples
        self.sampling_info.inplace_assign(raw_bs, sampling_info)
        return replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs)[:raw_bs].clone()


class ModelRunner:
    def __init__(self, model, device, variant, use_cuda_graph):
        self.model, self.variant = model, variant
        self.cuda_graph_runner = CudaGraphRunner(model, device) if use_cuda_graph else None

    def forward_decode(self, input_ids, sampling_info, uniform_samples):
        if (
            self.cuda_graph_runner
            and self.cuda_graph_runner.can_run(len(input_ids))
            and (self.variant == "bug" or not sampling_info.need_min_p_sampling)
        ):
            return self.cuda_graph_runner.replay(input_ids, sampling_info, uniform_samples)
        return self.model.forward_decode(input_ids, sampling_info, uniform_samples)


# (token, sampling params) per request over three decode steps; B and C ask for min_p.
PARAMS = [dict(temperature=1.0, top_p=1.0, top_k=VOCAB, min_p=0.0),
          dict(temperature=1.3, top_p=0.95, top_k=6, min_p=0.3),
          dict(temperature=1.0, top_p=1.0, top_k=VOCAB, min_p=0.5)]
STEPS = [([1, 4, 6], [0.15, 0.92, 0.97]), ([2, 5, 7], [0.6, 0.88, 0.05]), ([3, 0, 2], [0.4, 0.99, 0.9])]


def run(variant: str, device: str = "cpu"):
    model = LlamaForCausalLM(device)

    def serve(graphed: bool):
        runner = ModelRunner(model, device, variant, use_cuda_graph=graphed)
        sampling_info = SamplingBatchInfo.from_params(PARAMS, VOCAB, device)
        outs = []
        for ids, u in STEPS:
            input_ids = torch.tensor(ids, dtype=torch.int32, device=device)
            uniform = torch.tensor(u, device=device)
            outs.append(runner.forward_decode(input_ids, sampling_info, uniform).float())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
