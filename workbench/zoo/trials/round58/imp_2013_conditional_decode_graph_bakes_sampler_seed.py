"""The graphed decode loop bakes the sampler's seed into its kernel: every decode step draws the same uniform.

Upstream: https://github.com/kekzl/imp/pull/2013 ("fix(sampling): graph decode drew every token from one fixed
quantile").
Symptom: Qwen3.8-27B-NVFP4, temperature 0.7, no seed: the reasoning started with ``{"`` in 8 of 8 runs (all
``{"T":0.4,"N":``) and two identical requests (top_k 20, top_p 0.95) came back byte-identical; after the fix 1 of 8
and the outputs differ. Here the graphed tokens differ from the per-step (host) decode path's.
Mechanism: ``CudaGraphConditionalRunner::setup`` captures the whole decode step once per request as the body of a
conditional WHILE node (``GraphExecutor::forward_decode_async`` -> embedding/layers/LM head/sampler writing
``d_token_id_``, then ``post_decode_step_kernel`` advancing ``d_position_``/``d_step_counter_`` and writing the ring
buffer). Its ``body_state.seed = config_.seed`` (``req.seed``, -1 without a request seed), and inside the captured
``forward_decode_async`` the host computes ``unsigned seed = state.seed >= 0 ? state.seed : 42u`` and launches
``sample_topk_topp_device(last_logits, top_k, top_p, temperature, seed, d_token_id, h_mapped, stream)``: a kernel
argument passed by value, frozen into the kernel node at capture. Every WHILE iteration replays the same Philox seed,
so every step of every request samples at the same quantile. The host decode paths call ``compute_step_seed(req)`` =
base seed + ``output_tokens.size()``: a new seed per step (#1143), which the graph body never received.
(The loop is modelled as one replay of the captured body per iteration; a 32-bit integer mix stands in for Philox.)
Doctor: host-work-frozen, at forward_decode_async (the seed is host work inside the captured region: its value at
capture is baked into the sampler launch and every replayed step reuses it).
Fix (upstream): the graph body gets ``seed - initial_position`` plus a device-side salt ``*d_position_`` (re-uploaded
by ``rearm()``), threaded through ``sample_topk_topp_device`` into the multiblock and CUB kernels, so step j draws
with ``compute_step_seed + j`` as the host paths do; ``compute_step_seed`` becomes unsigned, masked to 31 bits
(a negative seed read as unset fell back to 42u), and ``fill_sampling_params`` uses it for the prefill token too.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kekzl/imp/pull/2013"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward_decode_async"
SYMPTOM = "every graphed decode step samples at the same quantile: the sampler seed is frozen at capture"

VOCAB, HIDDEN, MAX_STEPS, CLOCK = 16, 8, 6, 0x5A17C3


class Weights:
    def __init__(self, device):
        gen = generator(2013)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w1 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.freq = randn(HIDDEN, gen=gen, device=device, scale=0.3)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8)


class Request:
    def __init__(self, id, seed, prompt):
        self.id, self.seed, self.prompt, self.output_tokens = id, seed, prompt, []


def compute_step_seed(req):
    """Base seed (request seed, else hash(id) ^ clock), plus the step: unsigned, masked to 31 bits."""
    base = req.seed if req.seed >= 0 else ((req.id * 2654435761) ^ CLOCK)
    return (base + len(req.output_tokens)) & 0x7FFFFFFF


class InferenceState:
    def __init__(self, positions, temperature, top_k, top_p, seed):
        self.positions, self.temperature, self.top_k, self.top_p, self.seed = positions, temperature, top_k, top_p, seed


def sample_topk_topp_device(logits, top_k, top_p, temperature, seed, d_result, d_seed_salt=None):
    """Top-k/top-p sampling; ``seed`` is a host integer passed by value, ``d_seed_salt`` device memory (post-fix)."""
    state = torch.full((1,), seed, dtype=torch.long, device=logits.device)
    if d_seed_salt is not None:
        state = (state + d_seed_salt) & 0xFFFFFFFF
    for _ in range(2):                                        # stand-in for Philox(seed): a 32-bit mix
        state = (((state >> 16) ^ state) * 0x45D9F3B) & 0xFFFFFFFF
    u = ((state >> 16) ^ state).double() / float(1 << 32)
    probs = torch.softmax(logits[0].double() / temperature, -1)
    vals, idx = probs.topk(top_k)
    vals = vals * ((vals.cumsum(0) - vals) < top_p)
    cdf = vals.cumsum(0)
    pick = (cdf < u * cdf[-1]).sum().clamp(max=top_k - 1)
    d_result.copy_(idx.gather(0, pick.reshape(1)))


class GraphExecutor:
    def __init__(self, w):
        self.w = w

    def forward_decode_async(self, state, d_token_id, d_seed_salt=None):
        """Embedding -> layer -> LM head -> sample into ``d_token_id`` (no host sync)."""
        w = self.w
        x = w.emb[d_token_id] + torch.sin(state.positions[:, None].to(w.freq.dtype) * w.freq)
        logits = torch.tanh(x @ w.w1) @ w.lm_head
        top_k = state.top_k if state.top_k > 0 else 50
        top_p = state.top_p if state.top_p > 0.0 else 1.0
        seed = state.seed if state.seed >= 0 else 42             # host unsigned int, by value
        sample_topk_topp_device(logits, top_k, top_p, state.temperature, seed, d_token_id, d_seed_salt)
        return logits


def post_decode_step_kernel(d_token_id, d_ring_buffer, d_position, d_step_counter):
    d_ring_buffer.index_copy_(0, d_step_counter, d_token_id)
    d_position.add_(1)
    d_step_counter.add_(1)


class Config:
    def __init__(self, temperature, top_k, top_p, seed, initial_position, max_steps):
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.initial_position, self.max_steps = initial_position, max_steps


class CudaGraphConditionalRunner:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant

    def setup(self, executor, first_token, config):
        self.config = config
        dev = self.device
        self.d_token_id_ = torch.full((1,), first_token, dtype=torch.long, device=dev)
        self.d_position_ = torch.full((1,), config.initial_position, dtype=torch.long, device=dev)
        self.d_step_counter_ = torch.zeros(1, dtype=torch.long, device=dev)
        self.d_ring_buffer_ = torch.zeros(config.max_steps, dtype=torch.long, device=dev)
        if self.variant == "fix":
            # step j draws with compute_step_seed + j: seed - initial_position, plus the device salt *d_position_
            seed, salt = (config.seed - config.initial_position) & 0xFFFFFFFF, self.d_position_
        else:
            seed, salt = config.seed, None                        # config_.seed baked into the body
        body_state = InferenceState(self.d_position_, config.temperature, config.top_k, config.top_p, seed)

        def body():
            logits = executor.forward_decode_async(body_state, self.d_token_id_, salt)
            post_decode_step_kernel(self.d_token_id_, self.d_ring_buffer_, self.d_position_, self.d_step_counter_)
            return logits

        self.graph, self.out = capture(body, device=dev, warmups=0, name="conditional WHILE body",
                                       owner="CudaGraphConditionalRunner",
                                       state={"d_token_id_": self.d_token_id_, "d_position_": self.d_position_,
                                              "d_step_counter_": self.d_step_counter_,
                                              "d_ring_buffer_": self.d_ring_buffer_})

    def launch(self):
        for _ in range(self.config.max_steps):                    # one WHILE iteration per replay of the body
            replay(self.graph, self.out)
        return self.d_ring_buffer_.clone()


def prefill_token(w, req):
    """The prompt's last logits, sampled host-side (fill_sampling_params, with compute_step_seed)."""
    return (int(req.prompt[-1]) * 5 + 3) % VOCAB


def serve_request(w, device, variant, req, graphed, temperature=0.8, top_k=8, top_p=0.95):
    executor = GraphExecutor(w)
    first = prefill_token(w, req)
    req.output_tokens.append(first)
    position = len(req.prompt)                                    # the first decode step's input position
    if graphed:
        gcfg = Config(temperature, top_k, top_p, compute_step_seed(req) if variant == "fix" else req.seed,
                      position, MAX_STEPS)
        runner = CudaGraphConditionalRunner(device, variant)
        runner.setup(executor, first, gcfg)
        return runner.launch()
    d_token = torch.full((1,), first, dtype=torch.long, device=device)
    for _ in range(MAX_STEPS):                                    # per-step host decode
        state = InferenceState(torch.full((1,), position, dtype=torch.long, device=device),
                               temperature, top_k, top_p, compute_step_seed(req))
        executor.forward_decode_async(state, d_token)
        req.output_tokens.append(int(d_token))
        position += 1
    return torch.tensor(req.output_tokens[1:], device=device)


def run(variant: str, device: str = "cpu"):
    w = Weights(device)

    def serve(graphed: bool):
        reqs = [Request(7, -1, [3, 9, 4]), Request(11, -1, [3, 9, 4]), Request(12, 1234, [2, 6])]
        return [serve_request(w, device, variant, r, graphed) for r in reqs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
