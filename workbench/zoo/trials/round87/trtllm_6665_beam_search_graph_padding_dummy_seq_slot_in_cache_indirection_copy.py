"""TRT-LLM beam search with CUDA-graph padding: the padded batch's dummy requests enter the cache-indirection gather by their (missing) sequence slot.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/6665 ("[TRTLLM-6650][fix] Enhance CUDA graph + Beam search to
correctly handle padding", NVIDIA/TensorRT-LLM, merged 2025-08). Read: the PR description ("Cuda Graph uses dummy
requests to pad batches. These were not correctly handled and lead to errors, when using beam search ... Adjusted
model engine to ignore dummy requests when updating cache indirection"; the CodeRabbit summary "prevent errors during
sequence slot tracking in batch preparation"), one review hunk of ``cuda_graph_runner.py`` (input/position ids sized
``batch_size * max_beam_width * token_per_request``), and two stored versions of ``pyexecutor/model_engine.py``: one
before the fix (``_prepare_tp_inputs`` appends ``request.py_seq_slot`` of every generation request, CUDA-graph dummies
included, to ``gen_request_seq_slots`` and copies ``cache_indirection_buffer[gen_request_seq_slots]`` into
``self.cache_indirection_attention[:len(scheduled_requests.generation_requests)]``; ``_get_padded_batch`` extends the
batch with ``[self.cuda_graph_dummy_request] * padding_size``; ``_maybe_get_cuda_graph`` builds the runner for
``batch_size * max_beam_width`` sequences) and one after it (``if not request.is_cuda_graph_dummy:
gen_request_seq_slots.append(...)`` with the comment "to prevent access errors due to None values", and
``num_generation_requests = len(gen_request_seq_slots)``). The PR's full diff was not read; the runner-sizing part of
it is not modelled (the pre-fix engine already passed ``batch_size * max_beam_width`` as the runner's size).
Symptom: beam search (``max_beam_width > 1``) with CUDA graphs and ``enable_padding``: as soon as a generation batch
is padded to a captured size (e.g. 3 live requests on the 4-request graph), batch preparation fails with an indexing
error; eager serving, or batches that need no padding, are fine.
Mechanism: ``PyTorchModelEngine.forward`` pads the scheduled batch with the CUDA-graph dummy request
(``_maybe_pad_batch``/``_get_padded_batch``). The dummy is created by ``KVCacheManager.add_dummy_requests``: it owns
KV blocks but never gets an executor sequence slot (``py_seq_slot is None``, as the fix's comment says). ``_prepare_tp_inputs`` then runs at the
padded size: it walks all generation requests (real and dummy), collects their sequence slots and gathers the
sampler's per-slot ``cache_indirection_buffer`` rows for all of them into the graph's static
``cache_indirection_attention``. Only the real requests have rows there; the padded rows' ``None`` slots make the
gather index the buffer with ``(slot, slot, slot, None)`` and it raises (``IndexError``).
Doctor: padded-shape-mismatch, at _prepare_tp_inputs. It runs at the graph's padded request count and combines that
count (``len(generation_requests)`` and the slot list) with the cache indirection that exists only for the real
requests; the fix sizes the copy by the real requests.
Fix (upstream): skip CUDA-graph dummies when collecting ``gen_request_seq_slots`` and size the copy by
``len(gen_request_seq_slots)``; the padded rows of ``cache_indirection_attention`` keep what an earlier step left
there, read only by the dummy sequences whose logits are dropped.
Modelled: ``PyTorchModelEngine`` (``_get_padded_batch``, ``_maybe_pad_batch``, ``_round_up_batch_size``,
``_maybe_get_cuda_graph``, ``_prepare_tp_inputs`` for generation requests, ``forward``, ``warmup`` capturing the
graphs with dummy requests), ``DecodingCUDAGraphRunner`` (static input/position ids, ``capture``/``run``), and an
attention metadata holding the static per-request KV slots and past lengths. The model is one attention layer over a
KV cache ``[kv_slot, beam, position]`` that reads history through the cache indirection (beam ``cache_indir[i, b, p]``
for ``p < pos``, its own beam at ``pos``), as TRT-LLM's beam-search attention does. The sampler is a beam-search stand
-in (cumulative log-probs, parent reordering, cache-indirection update per sequence slot); prompts are pre-filled
into the KV cache. Sizes: vocab 16, hidden 8, beam 2, max sequence 8, max batch 4, graph batch sizes [1, 2, 4].
Workload: requests A-D (sequence slots 2, 3, 1, 0) decode two steps on the 4-request graph (no padding), D finishes,
A-C decode two more steps: 3 requests padded to 4. Bug: the first padded step raises ``IndexError`` in
``_prepare_tp_inputs``. Fix: the logits of all four steps (two beams per request) equal eager serving.
"""
from __future__ import annotations

import bisect
import contextlib

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/6665"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_prepare_tp_inputs"
SYMPTOM = ("beam search + CUDA graph padding: 3 live requests padded to the 4-request graph; _prepare_tp_inputs "
           "gathers cache_indirection_buffer[gen_request_seq_slots] with the dummy's None slot and raises IndexError")

VOCAB, HIDDEN, MAX_BEAM, MAX_SEQ, MAX_BATCH = 16, 8, 2, 8, 4
CUDA_GRAPH_BATCH_SIZES = [1, 2, 4]
DUMMY_KV_SLOT = MAX_BATCH                       # KV blocks reserved for CUDA-graph dummy requests

_variant = "bug"


class LlmRequest:
    def __init__(self, request_id, py_seq_slot, kv_slot, tokens, past_len, is_cuda_graph_dummy=False):
        self.py_request_id, self.py_seq_slot, self.kv_slot = request_id, py_seq_slot, kv_slot
        self.tokens = tokens                    # last token of each beam
        self.past_len = past_len                # max_beam_num_tokens - 1
        self.is_cuda_graph_dummy = is_cuda_graph_dummy
        self.is_dummy = is_cuda_graph_dummy


class ScheduledRequests:
    def __init__(self, generation_requests):
        self.context_requests = []
        self.generation_requests = list(generation_requests)

    @property
    def batch_size(self):
        return len(self.generation_requests)


class KVCacheManager:
    def __init__(self, device):
        self.kv = torch.zeros(2, MAX_BATCH + 1, MAX_BEAM, MAX_SEQ, HIDDEN, device=device, dtype=torch.float64)

    def add_dummy_requests(self, request_ids, kv_slots):
        """Generation dummies: KV blocks, one token, no executor sequence slot."""
        return [LlmRequest(r, None, s, [0] * MAX_BEAM, 0, is_cuda_graph_dummy=True)
                for r, s in zip(request_ids, kv_slots)]


class AttentionMetadata:
    """Graph-static per-request metadata (block offsets as a KV slot, past lengths)."""

    def __init__(self, num_requests, device, is_cuda_graph):
        self.is_cuda_graph, self.beam_width = is_cuda_graph, 1
        self.kv_slots_cuda = torch.zeros(num_requests, dtype=torch.long, device=device)
        self.num_requests = num_requests

    def prepare(self, kv_slots, device):
        self.kv_slots_cuda[:len(kv_slots)].copy_(torch.tensor(kv_slots, dtype=torch.long).to(device))


class DecodingCUDAGraphRunner:
    def __init__(self, batch_size, device, attn_metadata, engine):
        self.batch_size = batch_size            # sequences: requests * max_beam_width
        self.input_ids = torch.ones(batch_size, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, batch_size, dtype=torch.long, device=device)
        self.attn_metadata, self.engine, self.device = attn_metadata, engine, device
        self._graph, self._output = None, None

    def needs_capture(self):
        return self._output is None

    def capture(self, forward_fn):
        inputs = {"attn_metadata": self.attn_metadata, "input_ids": self.input_ids, "position_ids": self.position_ids}
        e = self.engine
        self._graph, self._output = capture(
            lambda: forward_fn(inputs), device=self.device, warmups=2, name=f"decode bs={self.batch_size}",
            owner="DecodingCUDAGraphRunner",
            static={"input_ids": self.input_ids, "position_ids": self.position_ids,
                    "kv_slots_cuda": self.attn_metadata.kv_slots_cuda,
                    "cache_indirection_attention": e.cache_indirection_attention},
            state={"kv_cache": e.kv_cache_manager.kv})

    def run(self, inputs, num_real_sequences):
        seqlen = inputs["input_ids"].shape[0]
        self.input_ids[:seqlen].copy_(inputs["input_ids"])
        self.position_ids[:, :seqlen].copy_(inputs["position_ids"])
        e = self.engine
        # padded sequences: the dummies' input ids (never copied) and cache-indirection rows (left as they were)
        return replay(self._graph, self._output, real=num_real_sequences, size=self.batch_size,
                      padded={"input_ids": self.input_ids,
                              "cache_indirection_attention": e.cache_indirection_attention.view(-1, MAX_SEQ)})


class PyTorchModelEngine:
    def __init__(self, device, use_cuda_graph):
        gen = generator(6665)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv = r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.device, self.max_beam_width = device, MAX_BEAM
        self.kv_cache_manager = KVCacheManager(device)
        self.input_ids_cuda = torch.zeros(MAX_BATCH * MAX_BEAM, dtype=torch.long, device=device)
        self.position_ids_cuda = torch.zeros(MAX_BATCH * MAX_BEAM, dtype=torch.long, device=device)
        # Setup the local cache indirection buffer only once and reuse it (also used by CUDA graphs).
        self.cache_indirection_attention = torch.zeros(MAX_BATCH, MAX_BEAM, MAX_SEQ, dtype=torch.long, device=device)
        self._run_cuda_graphs = self._cuda_graph_padding_enabled = use_cuda_graph
        self._cuda_graph_batch_sizes = CUDA_GRAPH_BATCH_SIZES
        self._max_cuda_graph_batch_size = max(CUDA_GRAPH_BATCH_SIZES)
        self._cuda_graphs = {}
        self.attn_metadata = AttentionMetadata(MAX_BATCH, device, is_cuda_graph=False)
        self.cuda_graph_dummy_request = None
        self.in_warmup = False

    # --- model -------------------------------------------------------------------------------------
    def _forward_step(self, inputs):
        md = inputs["attn_metadata"]
        ids, pos = inputs["input_ids"], inputs["position_ids"][0]
        n_req = ids.shape[0] // MAX_BEAM
        slot = md.kv_slots_cuda[:n_req].unsqueeze(1).expand(n_req, MAX_BEAM).reshape(-1)
        beam = torch.arange(MAX_BEAM, device=ids.device).repeat(n_req)
        x = self.embed[ids]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        kv = self.kv_cache_manager.kv
        kv[0, slot, beam, pos] = k
        kv[1, slot, beam, pos] = v
        p = torch.arange(MAX_SEQ, device=ids.device)
        indir = self.cache_indirection_attention[:n_req].reshape(n_req * MAX_BEAM, MAX_SEQ)   # [S, MAX_SEQ]
        src_beam = torch.where(p < pos.unsqueeze(1), indir, beam.unsqueeze(1))
        keys, vals = kv[0, slot.unsqueeze(1), src_beam, p], kv[1, slot.unsqueeze(1), src_beam, p]
        scores = (keys * q.unsqueeze(1)).sum(-1) * HIDDEN ** -0.5
        scores = torch.where(p <= pos.unsqueeze(1), scores, torch.full_like(scores, -1e9))
        out = (torch.softmax(scores, -1).unsqueeze(-1) * vals).sum(1)
        return (x + out) @ self.lm_head

    # --- CUDA graph padding --------------------------------------------------------------------------
    def _round_up_batch_size(self, batch_size):
        return self._cuda_graph_batch_sizes[bisect.bisect_left(self._cuda_graph_batch_sizes, batch_size)]

    def _get_padded_batch(self, scheduled_requests):
        batch_size = scheduled_requests.batch_size
        if (not self._run_cuda_graphs or not self._cuda_graph_padding_enabled
                or batch_size > self._max_cuda_graph_batch_size):
            return 0
        padded_batch_size = self._round_up_batch_size(batch_size)
        if batch_size == padded_batch_size:
            return 0
        padding_size = padded_batch_size - batch_size
        if self.cuda_graph_dummy_request is None:
            self.cuda_graph_dummy_request = self.kv_cache_manager.add_dummy_requests([2 ** 64 - 2], [DUMMY_KV_SLOT])[0]
        scheduled_requests.generation_requests.extend([self.cuda_graph_dummy_request] * padding_size)
        return padding_size

    @contextlib.contextmanager
    def _maybe_pad_batch(self, scheduled_requests):
        padding_size = self._get_padded_batch(scheduled_requests)
        try:
            yield scheduled_requests
        finally:
            if padding_size > 0:
                scheduled_requests.generation_requests = scheduled_requests.generation_requests[:-padding_size]

    def _maybe_get_cuda_graph(self, batch):
        batch_size = len(batch.generation_requests)
        if not self._run_cuda_graphs or batch_size not in self._cuda_graph_batch_sizes:
            return None
        if batch_size not in self._cuda_graphs:
            num_sequences_in_batch = batch_size * self.max_beam_width
            attn_metadata = AttentionMetadata(batch_size, self.device, is_cuda_graph=True)
            self._cuda_graphs[batch_size] = DecodingCUDAGraphRunner(num_sequences_in_batch, self.device,
                                                                    attn_metadata, self)
        return self._cuda_graphs[batch_size]

    # --- inputs ------------------------------------------------------------------------------------
    def _prepare_tp_inputs(self, scheduled_requests, attn_metadata, cache_indirection_buffer):
        input_ids, position_ids, kv_slots, gen_request_seq_slots = [], [], [], []
        for request in scheduled_requests.generation_requests:
            for beam in range(self.max_beam_width):
                if not request.is_cuda_graph_dummy:        # (dummies' input ids are not copied)
                    input_ids.append(request.tokens[beam])
                position_ids.append(request.past_len)
            kv_slots.append(request.kv_slot)
            if _variant == "fix":
                # Do not add a gen_request_seq_slot for CUDA graph dummy requests (upstream fix)
                if not request.is_cuda_graph_dummy:
                    gen_request_seq_slots.append(request.py_seq_slot)
            else:
                gen_request_seq_slots.append(request.py_seq_slot)
        num_tokens, total_num_tokens = len(input_ids), len(position_ids)
        if num_tokens:
            self.input_ids_cuda[:num_tokens].copy_(torch.tensor(input_ids).to(self.device))
        self.position_ids_cuda[:total_num_tokens].copy_(torch.tensor(position_ids).to(self.device))
        if _variant == "fix":
            num_generation_requests = len(gen_request_seq_slots)
        else:
            num_generation_requests = len(scheduled_requests.generation_requests)
        if num_generation_requests > 0:
            is_cuda_graph_during_warmup = self.in_warmup and attn_metadata.is_cuda_graph
            if cache_indirection_buffer is not None:
                # Copy cache indirection to local buffer with offsets changing: seq_slots[i] -> i
                self.cache_indirection_attention[:num_generation_requests].copy_(
                    cache_indirection_buffer[gen_request_seq_slots])
            if cache_indirection_buffer is not None or is_cuda_graph_during_warmup:
                attn_metadata.beam_width = self.max_beam_width
        attn_metadata.prepare(kv_slots, self.device)
        return {"attn_metadata": attn_metadata, "input_ids": self.input_ids_cuda[:total_num_tokens],
                "position_ids": self.position_ids_cuda[:total_num_tokens].unsqueeze(0)}

    def forward(self, scheduled_requests, cache_indirection_buffer=None):
        num_real_sequences = scheduled_requests.batch_size * self.max_beam_width
        with self._maybe_pad_batch(scheduled_requests) as scheduled_requests:
            maybe_graph = self._maybe_get_cuda_graph(scheduled_requests)
            attn_metadata = maybe_graph.attn_metadata if maybe_graph is not None else self.attn_metadata
            inputs = self._prepare_tp_inputs(scheduled_requests, attn_metadata, cache_indirection_buffer)
            if maybe_graph is None:
                logits = self._forward_step(inputs)
            else:
                if maybe_graph.needs_capture():
                    maybe_graph.capture(self._forward_step)
                logits = maybe_graph.run(inputs, num_real_sequences)
        return logits[:num_real_sequences]

    def warmup(self):
        """Capture the decode graphs with generation dummies (KV slots 0.., no sequence slot)."""
        if not self._run_cuda_graphs:
            return
        self.in_warmup = True
        for bs in reversed(self._cuda_graph_batch_sizes):
            dummies = self.kv_cache_manager.add_dummy_requests(list(range(bs)), list(range(bs)))
            self.forward(ScheduledRequests(dummies))
        self.in_warmup = False


class BeamSearchSampler:
    """Stand-in for the beam-search decoder: cumulative log-probs, parents, cache indirection per sequence slot."""

    def __init__(self, device):
        self.cache_indirection = torch.zeros(MAX_BATCH, MAX_BEAM, MAX_SEQ, dtype=torch.long, device=device)
        self.cum_log_probs = torch.zeros(MAX_BATCH, MAX_BEAM, dtype=torch.float64, device=device)

    def update(self, requests, logits):
        for i, req in enumerate(requests):
            s, pos = req.py_seq_slot, req.past_len
            lp = torch.log_softmax(logits[i * MAX_BEAM:(i + 1) * MAX_BEAM], -1)        # [beam, vocab]
            best, tok = lp.max(-1)
            parents = torch.argsort(-(self.cum_log_probs[s] + best), stable=True)
            self.cum_log_probs[s] = (self.cum_log_probs[s] + best)[parents]
            old = self.cache_indirection[s].clone()
            self.cache_indirection[s, :, :pos] = old[parents, :pos]
            self.cache_indirection[s, :, pos] = parents
            req.tokens = [int(t) for t in tok[parents].tolist()]
            req.past_len = pos + 1


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    specs = {"A": (2, 3), "B": (3, 2), "C": (1, 4), "D": (0, 3)}      # name -> (seq slot, prompt length)
    schedule = ["ABCD", "ABCD", "ABC", "ABC"]

    def serve(use_cuda_graph):
        engine = PyTorchModelEngine(device, use_cuda_graph)
        engine.warmup()
        sampler = BeamSearchSampler(device)
        gen = generator(6666)
        reqs = {}
        for kv_slot, (name, (seq_slot, n)) in enumerate(specs.items()):   # prompt KV (prefill stand-in)
            prompt_kv = randn(2, n, HIDDEN, gen=gen, device=device).double()
            engine.kv_cache_manager.kv[:, kv_slot, :, :n] = prompt_kv.unsqueeze(1)
            first = [int(t) for t in torch.randint(0, VOCAB, (MAX_BEAM,), generator=gen).tolist()]
            reqs[name] = LlmRequest(name, seq_slot, kv_slot, first, n)
        outs = []
        for names in schedule:
            batch = [reqs[x] for x in names]
            logits = engine.forward(ScheduledRequests(batch), cache_indirection_buffer=sampler.cache_indirection)
            outs.append(logits.clone())
            sampler.update(batch, logits)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
