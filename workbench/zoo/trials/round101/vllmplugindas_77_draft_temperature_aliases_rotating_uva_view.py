"""Hygon vLLM plugin: the MTP drafter's temperature/seeds are rebound to the sampler's rotating UVA views, so the FULL draft graph samples with the views it saw at capture.

Upstream: https://github.com/HYGON-AI/vllm-plugin-das/pull/77 ("feat: backport PCP+EP and DeepEP-LL bubble
optimizations", HYGON-AI/vllm-plugin-das, the vLLM platform plugin for Hygon DCUs (HCU); opened and merged
2026-09-09; the fix is its commit b743430, made on review finding "P1"). Read: the PR description (third bullet:
"retain the draft temperature/seed zero-copy optimization only when CUDA graphs are explicitly disabled; graph
modes preserve vLLM's fixed graph-visible buffers and copy the current rotating UVA views into them"); the
author's reply to the review ("CUDA Graph records fixed device pointers, while the ``UvaBackedTensor`` pool rotates
its ``.gpu`` view; b743430 aliases only under ``CUDAGraphMode.NONE``; all graph modes go back to vLLM's fixed-buffer
copy path"; replay then read the latest temperature 0.75 and seed 202); the pre-fix
``vllm_hcu/patch/worker/framework_opt/patch_draft_speculator_inputs.py`` (stored at b901cd3: ``hcu_copy_request_inputs``
does ``self.temperature = temperature; self.seeds = seeds``), its later version (always ``copy_`` into the
graph-owned buffers, "rebinding these buffers to caller tensors makes captured speculator graphs read stale
storage"), and the PR's tests ``test_draft_speculator_eager_temperature_seeds_zero_copy`` /
``..._full_graph_keeps_fixed_inputs_across_uva_rotation`` ("First staged write selects UVA views A. A full graph
captures the addresses held by the speculator after this copy. The next staged write rotates the caller to UVA
views B"); upstream vLLM's ``DraftModelSpeculator`` (``__init__`` buffers, ``sample_draft``, ``_copy_request_inputs``),
``UvaBufferPool`` / ``UvaBackedTensor`` and ``SamplingStates.add_request`` / ``apply_staged_writes``.
Symptom: with MTP and probabilistic drafting under FULL CUDA graphs, draft tokens are sampled with another step's
temperatures and seeds (a new request's first drafts use the previous occupant's or zero temperature), lowering
acceptance; eager mode is unaffected. No error.
Mechanism: ``SamplingStates`` keeps temperature and seeds in ``UvaBackedTensor``s; every step
``apply_staged_writes`` republishes the host values into the *next* of two UVA buffers and points ``.gpu`` at it.
The speculator receives those views in ``_copy_request_inputs``; the plugin's zero-copy patch rebinds
``self.temperature`` / ``self.seeds`` to them instead of copying into the speculator's own buffers. The draft graph
is captured after the warmup's copy, so it holds the address of the view of that moment and reads it at every
replay: on every other step that buffer holds the previous step's values. An eager step reads the attribute anew.
Doctor: warmup-divergence, at hcu_copy_request_inputs (the capture-time rebinding decided which tensor the graph
reads; replays keep it while each eager step rebinds to the current view).
Fix (upstream): ``hcu_copy_request_inputs`` aliases only when ``cudagraph_mode`` is NONE; in graph modes it calls
the original ``_copy_request_inputs``, which ``copy_``s the views into the fixed buffers the graph reads.
Modelled: ``UvaBufferPool`` / ``UvaBackedTensor`` (two buffers, round robin; UVA memory as device memory the host
writes directly), ``SamplingStates`` (temperature, seeds), ``DraftModelSpeculator`` (buffers and
``_copy_request_inputs`` as upstream, ``sample_draft``, a ``generate_draft`` of 2 steps captured per batch size),
the plugin patch as written. Stand-ins: the draft model (embedding and position embedding, one tanh layer, LM
head), ``gumbel_sample`` (a hash of seed, position and vocab index for the noise; temperature 0 is greedy, padded
rows ``-1``), the runner (new requests each step, the target's sampled tokens from a fixed list, FULL graphs for
1, 2 and 4 requests, padding to the next size). float64.
Workload: warmup + capture on idle states (UVA buffer 1, zeros). Step 1 admits A (T=0.8) and B (T=1.5): buffer 0;
step 2 decodes A, B (buffer 1); step 3 admits C (T=1.2, 3 requests padded to 4; buffer 0); step 4 decodes
(buffer 1); step 5: A finished, D (T=0.6) takes A's slot (buffer 0). Bug: steps 1, 3 and 5 draft with buffer 1's
stale values (all greedy at step 1, C greedy at step 3, D with A's temperature and seed at step 5): 8 of 26 draft
tokens differ (4, 2 and 2 at those steps), max |graph - eager| = 10; fix: the 26 draft tokens equal eager (0).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HYGON-AI/vllm-plugin-das/pull/77"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "hcu_copy_request_inputs"
SYMPTOM = ("MTP drafts under FULL graphs sample with the temperatures/seeds of the UVA view captured at startup "
           "(another step's values on every other step): lower acceptance, no error")

VOCAB, HIDDEN, MAX_NUM_REQS, NUM_SPEC = 16, 8, 4, 2
MAX_MODEL_LEN = 32
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
DTYPE = torch.float64

_variant = "bug"


# --- vllm/v1/worker/gpu/buffer_utils.py (UVA: host memory the device reads; modelled as device memory) -------------

class UvaBufferPool:
    def __init__(self, size, dtype, max_concurrency=2):
        self.size, self.dtype, self.max_concurrency = size, dtype, max_concurrency
        self._uva_bufs = [torch.zeros(size, dtype=dtype) for _ in range(max_concurrency)]
        self._curr = 0

    def copy_to_uva(self, x):
        # Round robin to the next buffer.
        self._curr = (self._curr + 1) % self.max_concurrency
        buf = self._uva_bufs[self._curr]
        n = len(x)
        buf.numpy()[:n] = x                  # CPU-to-CPU copy (the device sees it through UVA)
        return buf[:n]


class UvaBackedTensor:
    def __init__(self, size, dtype, max_concurrency=2):
        self.dtype = dtype
        self.cpu = torch.zeros(size, dtype=dtype)      # source of truth
        self.np = self.cpu.numpy()
        self.pool = UvaBufferPool(size, dtype, max_concurrency)
        self.gpu = self.pool.copy_to_uva(self.np)

    def copy_to_uva(self, n=None):
        self.gpu = self.pool.copy_to_uva(self.np[:n] if n is not None else self.np)
        return self.gpu


class SamplingStates:
    def __init__(self, max_num_reqs):
        self.temperature = UvaBackedTensor(max_num_reqs, dtype=torch.float64)
        self.seeds = UvaBackedTensor(max_num_reqs, dtype=torch.int64)

    def add_request(self, req_idx, sampling_params):
        self.temperature.np[req_idx] = sampling_params.temperature
        self.seeds.np[req_idx] = sampling_params.seed

    def apply_staged_writes(self):
        self.temperature.copy_to_uva()
        self.seeds.copy_to_uva()


# --- vllm/v1/worker/gpu/sample/gumbel.py (stand-in kernel) ---------------------------------------------------------

def gumbel_sample(logits, idx_mapping, temperature, seeds, pos, apply_temperature=True):
    """Per row: the request's temperature and seed (padded rows, idx -1, read slot 0 and are dropped);
    temperature 0 samples greedily, else argmax(logits / T + Gumbel(seed, pos))."""
    idx = idx_mapping.long().clamp(min=0)
    temp, seed = temperature[idx], seeds[idx]
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    h = (seed[:, None] * 7919 + pos.long()[:, None] * 104729 + vocab[None, :] * 1299709) % 2147483647
    h = (h * 48271) % 2147483647
    u = (h.to(DTYPE) + 0.5) / 2147483647.0
    noisy = logits / temp.clamp(min=1e-6)[:, None] - torch.log(-torch.log(u))
    return torch.where((temp > 0)[:, None], noisy, logits).argmax(dim=-1)


# --- vllm/v1/worker/gpu/spec_decode/speculator.py (reduced) --------------------------------------------------------

class DraftModel:
    def __init__(self, device):
        gen = generator(77)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_positions = randn(MAX_MODEL_LEN + NUM_SPEC + 1, HIDDEN, gen=gen, device=device, scale=0.8).to(DTYPE)
        self.w = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.8).to(DTYPE)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).to(DTYPE)

    def forward(self, input_ids, positions):
        return torch.tanh((self.embed_tokens[input_ids] + self.embed_positions[positions]) @ self.w)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class DraftModelSpeculator:
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.num_speculative_steps = NUM_SPEC
        self.model = DraftModel(device)
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.idx_mapping = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.temperature = torch.zeros(MAX_NUM_REQS, dtype=DTYPE, device=device)
        self.seeds = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.draft_tokens = torch.zeros(MAX_NUM_REQS, NUM_SPEC, dtype=torch.int64, device=device)
        self.draft_logits = torch.zeros(MAX_NUM_REQS, NUM_SPEC, VOCAB, dtype=DTYPE, device=device)  # probabilistic
        self.cudagraph_inputs = {"input_ids": self.input_ids, "positions": self.positions,
                                 "idx_mapping": self.idx_mapping, "temperature": self.temperature,
                                 "seeds": self.seeds}
        self.graphs = {}

    def sample_draft(self, hidden_states, positions, idx_mapping, temperature, seeds):
        logits = self.model.compute_logits(hidden_states)
        # NOTE(woosuk): We must add 1 to the positions to match the Gumbel noise used for draft and target sampling.
        return gumbel_sample(logits, idx_mapping, temperature, seeds, positions + 1, apply_temperature=True)

    def _copy_request_inputs(self, num_reqs, idx_mapping, temperature, seeds):
        # Copy temperature, seeds, and idx mapping to the pre-allocated buffers.
        self.temperature.copy_(temperature)
        self.seeds.copy_(seeds)
        self.idx_mapping[:num_reqs].copy_(idx_mapping)
        if self.draft_logits is not None:
            # idx_mapping for CG padded requests points to -1, which is ignored during sampling.
            self.idx_mapping[num_reqs:].fill_(-1)

    def generate_draft(self, num_reqs_padded):
        """The drafting loop the FULL graph captures (per padded batch size)."""
        input_ids, positions = self.input_ids[:num_reqs_padded], self.positions[:num_reqs_padded]
        idx_mapping = self.idx_mapping[:num_reqs_padded]
        for step in range(self.num_speculative_steps):
            hidden_states = self.model.forward(input_ids, positions)
            draft = self.sample_draft(hidden_states, positions, idx_mapping, self.temperature, self.seeds)
            self.draft_tokens[:num_reqs_padded, step] = draft
            input_ids, positions = draft, positions + 1
        return self.draft_tokens[:num_reqs_padded]

    def capture(self, sampling_states):
        """CUDA-graph capture of the draft loop, after the dummy run's ``propose`` copied the request inputs."""
        events.shared_outputs("DraftModelSpeculator", {"draft_tokens": self.draft_tokens})
        pool = graph_pool_handle(self.vllm_config.device)
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            idx = torch.zeros(n, dtype=torch.int32, device=self.vllm_config.device)
            self._copy_request_inputs(n, idx, sampling_states.temperature.gpu, sampling_states.seeds.gpu)
            self.graphs[n] = capture(lambda n=n: self.generate_draft(n), device=self.vllm_config.device, pool=pool,
                                     name=f"draft FULL {n}", owner="DraftModelSpeculator",
                                     static=self.cudagraph_inputs)

    def propose(self, num_reqs, idx_mapping, last_sampled, positions, temperature, seeds):
        self._copy_request_inputs(num_reqs, idx_mapping, temperature, seeds)
        self.input_ids[:num_reqs].copy_(last_sampled)
        self.positions[:num_reqs].copy_(positions)
        size = next((s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_reqs), None)
        if self.graphs and size is not None:
            g, out = self.graphs[size]
            return replay(g, out, real=num_reqs, size=size,
                          padded={"input_ids": self.input_ids, "positions": self.positions})[:num_reqs].clone()
        return self.generate_draft(num_reqs).clone()


# --- vllm_hcu/patch/worker/framework_opt/patch_draft_speculator_inputs.py -----------------------------------------

def apply_to_module(cls):
    original = cls._copy_request_inputs

    @functools.wraps(original)
    def hcu_copy_request_inputs(self, num_reqs, idx_mapping, temperature, seeds):
        if _variant == "bug" or not self.vllm_config.compilation_config.cudagraph_mode:
            # Alias caller buffers (often UVA views) instead of H2D copy_.
            # idx_mapping still copied into the fixed CG-padded buffer.
            self.temperature = temperature
            self.seeds = seeds
            self.idx_mapping[:num_reqs].copy_(idx_mapping)
            if self.draft_logits is not None:
                self.idx_mapping[num_reqs:].fill_(-1)
            return
        # Graph modes: keep vLLM's fixed graph-visible buffers and copy the current rotating UVA views into them.
        original(self, num_reqs, idx_mapping, temperature, seeds)

    cls._copy_request_inputs = hcu_copy_request_inputs
    return cls


@apply_to_module
class HCUDraftModelSpeculator(DraftModelSpeculator):
    pass


# --- the runner (reduced) ------------------------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        cfg = SimpleNamespace(device=device, compilation_config=SimpleNamespace(
            cudagraph_mode="FULL" if use_cuda_graph else None))
        self.sampling_states = SamplingStates(MAX_NUM_REQS)
        self.speculator = HCUDraftModelSpeculator(cfg, device)
        self.req_id_to_index, self.free_indices, self.num_computed = {}, list(range(MAX_NUM_REQS)), {}
        if use_cuda_graph:
            self.speculator.capture(self.sampling_states)

    def add_requests(self, new_reqs, finished):
        for req_id in finished:
            self.free_indices.insert(0, self.req_id_to_index.pop(req_id))
        for req_id, params, prompt_len in new_reqs:
            req_idx = self.free_indices.pop(0)
            self.req_id_to_index[req_id] = req_idx
            self.num_computed[req_id] = prompt_len
            self.sampling_states.add_request(req_idx, params)
        self.sampling_states.apply_staged_writes()       # every step: the next UVA buffer

    def execute_model(self, new_reqs, finished, sampled):
        """``sampled``: {request: the token the target sampled this step}; returns the draft tokens."""
        self.add_requests(new_reqs, finished)
        req_ids = list(sampled)
        idx = torch.tensor([self.req_id_to_index[r] for r in req_ids], dtype=torch.int32, device=self.device)
        last = torch.tensor([sampled[r] for r in req_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([self.num_computed[r] for r in req_ids], dtype=torch.long, device=self.device)
        for r in req_ids:
            self.num_computed[r] += 1
        states = self.sampling_states
        return self.speculator.propose(len(req_ids), idx, last, pos, states.temperature.gpu, states.seeds.gpu)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    P = SimpleNamespace
    steps = [([("A", P(temperature=0.8, seed=1234), 5), ("B", P(temperature=1.5, seed=987), 3)], [],
              {"A": 3, "B": 11}),
             ([], [], {"A": 7, "B": 2}),
             ([("C", P(temperature=1.2, seed=4242), 6)], [], {"A": 9, "B": 4, "C": 13}),
             ([], [], {"A": 1, "B": 8, "C": 6}),
             ([("D", P(temperature=0.6, seed=31337), 4)], ["A"], {"B": 5, "C": 10, "D": 12})]

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        return [runner.execute_model(new, done, sampled) for new, done, sampled in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))

