"""The talker's captured decode graph samples every step with the (seed, offset) FlashInfer read at capture.

Upstream: https://github.com/sgl-project/sglang-omni/pull/419 ("[Fix] Qwen3-Omni: Force pytorch sampling
backend for talker layer-0"); root cause traced in the closed first attempt #415.
Symptom: with CUDA graphs on, the Qwen3-Omni talker produced catastrophic per-sample WER outliers (558%, 897%):
the codec AR decoder fell into a self-reinforcing loop and repeated one phrase until ``max_tokens``. Which
samples failed changed from boot to boot (CI ``n_above_50 == 0`` flaked).
Mechanism: the talker (layer 0 of the speech pipeline) runs under SGLang's decode ``CudaGraphRunner`` and
samples inside the captured forward. SGLang's ``Sampler.forward`` with the default ``sampling_backend=
"flashinfer"`` calls ``top_k_top_p_sampling_from_probs(probs, top_ks, top_ps, filter_apply_order="joint")``
without ``seed=``/``offset=``, so FlashInfer calls ``get_seed_and_offset`` on the host: it reads the global
CUDA generator's philox (seed, offset) and passes them BY VALUE to the kernel. At capture that host work ran
once; every replay repeats only the kernel with the capture's (seed, offset), so each decode step draws the
same uniform per row, and the generator's host offset never advances again. The captured offset depends on
how many RNG calls came before capture (init, warmups), hence the boot-to-boot variation. Eager sampling
reads a fresh offset on every call. The torch path (``torch.multinomial``) instead asks
``philox_cuda_state``: inside a capture that yields the graph-safe generator's device ``seed_extragraph`` /
``offset_extragraph`` tensors plus an intra-graph increment, and ``CUDAGraph.replay`` refills them from the
host generator (and advances it) before each replay. Miniature: vocab of 8, 2 requests, 6 decode steps.
Doctor: host-work-frozen, at top_k_top_p_sampling_from_probs (its host ``get_seed_and_offset`` ran once at
capture; replays keep the capture's philox seed/offset).
Fix (upstream): the talker's server-args factory forces ``server_args.sampling_backend = "pytorch"`` for talker
layer-0 (on CUDA; #1737 later keeps it as "the existing CUDA RNG workaround"), so the captured sampler takes
its philox offset from the graph-safe generator state that advances on every replay.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang-omni/pull/419"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "top_k_top_p_sampling_from_probs"
SYMPTOM = "every graphed talker decode step samples with the same frozen uniforms: codec tokens loop"
VOCAB, HIDDEN, BS, STEPS, WARMUPS = 8, 4, 2, 6, 2


class CUDAGeneratorImpl:
    """The global CUDA generator: host philox (seed, offset), plus the graph-safe device copies."""

    def __init__(self, seed, device):
        self.seed, self.philox_offset_per_thread = seed, 0
        self.seed_extragraph = torch.zeros((), dtype=torch.float64, device=device)
        self.offset_extragraph = torch.zeros((), dtype=torch.float64, device=device)
        self.offset_intragraph = 0

    def philox_cuda_state(self, increment):
        """``at::PhiloxCudaState``: device tensors + intra-graph offset while capturing, host values otherwise."""
        increment = (increment + 3) // 4 * 4
        if is_capturing():
            offset = self.offset_extragraph + self.offset_intragraph
            self.offset_intragraph += increment
            return self.seed_extragraph, offset
        seed, offset = self.seed, self.philox_offset_per_thread
        self.philox_offset_per_thread += increment
        return seed, offset

    def capture_prologue(self):
        self.offset_intragraph = 0

    def capture_epilogue(self):
        return self.offset_intragraph                          # wholegraph_increment

    def replay_prologue(self, wholegraph_increment):
        """Run by ``CUDAGraph.replay`` before launching: publish the host state, then advance it."""
        self.seed_extragraph.fill_(self.seed)
        self.offset_extragraph.fill_(self.philox_offset_per_thread)
        self.philox_offset_per_thread += wholegraph_increment


def philox_uniform(seed, offset, n, device):
    """The kernel's counter-based uniform per row from (seed, offset): ints by value, or device tensors."""
    r = torch.arange(n, device=device, dtype=torch.float64)
    x = torch.sin((r + offset) * 12.9898 + seed * 78.233) * 43758.5453
    return x - torch.floor(x)


def get_seed_and_offset(increment, gen):
    """``flashinfer.utils.get_seed_and_offset``: read the generator on the host and advance it."""
    seed, offset = gen.seed, gen.philox_offset_per_thread
    gen.philox_offset_per_thread += (increment + 3) // 4 * 4
    return seed, offset


def _inverse_cdf(probs, top_ks, top_ps, u):
    sorted_probs, sorted_idx = probs.double().sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    keep = ranks.unsqueeze(0) < top_ks.unsqueeze(1)
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_ps.double().unsqueeze(1)
    kept = sorted_probs * keep
    cdf = (kept / kept.sum(-1, keepdim=True)).cumsum(-1)
    pick = (cdf < u.unsqueeze(1)).sum(-1).clamp(max=probs.shape[-1] - 1)
    return sorted_idx.gather(1, pick.unsqueeze(1)).squeeze(1)


def top_k_top_p_sampling_from_probs(probs, top_ks, top_ps, gen, filter_apply_order="joint", seed=None,
                                    offset=None):
    """``flashinfer.sampling``: with no seed/offset given, they are taken on the host (by value)."""
    if seed is None or offset is None:
        seed, offset = get_seed_and_offset(probs.shape[0] * 32, gen)
    return _inverse_cdf(probs, top_ks, top_ps, philox_uniform(seed, offset, probs.shape[0], probs.device))


def top_k_top_p_min_p_sampling_from_probs_torch(probs, top_ks, top_ps, gen):
    """SGLang's torch path: ``torch.multinomial`` on the filtered probs (philox state via the generator)."""
    seed, offset = gen.philox_cuda_state(probs.shape[0] * 32)
    return _inverse_cdf(probs, top_ks, top_ps, philox_uniform(seed, offset, probs.shape[0], probs.device))


@dataclasses.dataclass
class ServerArgs:
    sampling_backend: str = "flashinfer"


def configure_talker_server_args(server_args, variant):
    """sglang-omni's talker (layer-0) server-args factory; the fix forces the torch sampler on CUDA."""
    if variant == "fix":
        server_args.sampling_backend = "pytorch"
    return server_args


class SamplingBatchInfo:
    def __init__(self, device):
        self.temperatures = torch.tensor([[0.9], [0.7]], device=device)
        self.top_ks = torch.tensor([6, 4], device=device)
        self.top_ps = torch.tensor([0.95, 0.9], device=device)


class Sampler:
    def __init__(self, server_args, gen):
        self.server_args, self.gen = server_args, gen

    def forward(self, logits, sampling_info):
        probs = torch.softmax(logits / sampling_info.temperatures, dim=-1)
        if self.server_args.sampling_backend == "flashinfer":
            return top_k_top_p_sampling_from_probs(probs.contiguous(), sampling_info.top_ks,
                                                   sampling_info.top_ps, self.gen, filter_apply_order="joint")
        return top_k_top_p_min_p_sampling_from_probs_torch(probs, sampling_info.top_ks, sampling_info.top_ps,
                                                           self.gen)


class Qwen3OmniTalker:
    """The talker's AR codec decoder in miniature; sampling runs inside its forward (captured with it)."""

    def __init__(self, device, sampler, sampling_info):
        gen = generator(419)
        self.codec_embedding = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.codec_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)
        self.sampler, self.sampling_info = sampler, sampling_info

    def forward(self, input_ids):
        h = torch.tanh(self.codec_embedding[input_ids] @ self.w)
        return self.sampler.forward(h @ self.codec_head, self.sampling_info)


def run(variant: str, device: str = "cpu"):
    first_codes = [3, 5]

    def build():
        server_args = configure_talker_server_args(ServerArgs(), variant)
        gen = CUDAGeneratorImpl(seed=1234, device=device)
        gen.philox_offset_per_thread = 40                      # RNG calls before capture (init, NCCL, ...)
        return Qwen3OmniTalker(device, Sampler(server_args, gen), SamplingBatchInfo(device)), gen

    def eager():
        talker, _ = build()
        input_ids = torch.tensor(first_codes, device=device)
        outs = []
        for _ in range(STEPS):
            input_ids = talker.forward(input_ids)
            outs.append(input_ids.clone())
        return outs

    def served():
        talker, gen = build()
        # CudaGraphRunner: static input_ids; warmup forwards then capture of the decode forward (+ sampler)
        input_ids = torch.tensor(first_codes, device=device)
        gen.capture_prologue()
        g, next_ids = capture(lambda: talker.forward(input_ids), device=device, warmups=WARMUPS,
                              static={"input_ids": input_ids}, owner="CudaGraphRunner (talker decode)",
                              name=f"decode bs={BS}")
        wholegraph_increment = gen.capture_epilogue()
        # serve from the RNG position the eager reference starts at (warmups/capture consumed some)
        gen.philox_offset_per_thread = 40
        input_ids.copy_(torch.tensor(first_codes, device=device))
        outs = []
        for _ in range(STEPS):
            gen.replay_prologue(wholegraph_increment)           # what torch's CUDAGraph.replay does first
            out = replay(g, next_ids)
            outs.append(out.clone())
            input_ids.copy_(out)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
