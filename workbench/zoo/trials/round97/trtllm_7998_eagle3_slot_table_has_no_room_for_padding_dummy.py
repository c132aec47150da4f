"""TRT-LLM Eagle3 + CUDA-graph padding: the spec resource manager's slot table holds exactly ``max_num_requests`` slots, so the padding dummy finds none while every slot is still held.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/7998 ("[https://nvbugs/5537878][fix] Reserve an extra slot for
padded batch", NVIDIA/TensorRT-LLM, merged 2025-09-25; cherry-picked as #8231). Read: the PR title and a stored later
``tensorrt_llm/_torch/speculative/eagle3.py`` that carries the fix (``Eagle3ResourceManager.__init__``: "There could be
dummy request for padding batch when using CUDA graph. Reserve one more slot for the dummy request." followed by
``slot_size = ... + 1``, ``SlotManager(slot_size)`` and ``seq_lens`` / ``start_indices`` sized ``slot_size``; in that
stored version the base reads ``self.max_seq_len``, modelled here as the ``max_num_requests`` the slot table counts),
with ``prepare_resources`` / ``free_resources`` / ``add_dummy_requests`` and ``Eagle3SpecMetadata.prepare`` /
``maybe_capture_hidden_states``; ``SlotManager``; ``CUDAGraphRunner._get_padded_batch`` of that time (the lazily created
``padding_dummy_request`` registered with ``spec_res_mgr.add_dummy_requests([CUDA_GRAPH_DUMMY_REQUEST_ID])``). The
diff and the bug report were not read: the executor ordering that keeps a finished request's slot through the next
forward (released when the previous batch is processed, after that forward) is reconstructed.
Symptom: Eagle3 speculative decoding with CUDA graphs and padding enabled dies with ``ValueError: No free slots`` from
``SlotManager.add_slot`` once the server is full: ``max_batch_size`` requests resident, one of them finishing, and the
next generation batch (the others) no longer a captured batch size. Eager runs never hit it.
Mechanism: ``Eagle3ResourceManager`` keeps one slot per request (``SlotManager(max_num_requests)``, plus per-slot
``seq_lens`` / ``start_indices`` into its ``hidden_states`` buffer). ``_get_padded_batch`` pads a generation batch to
the next captured size with one dummy request and, the first time, registers it with the spec resource manager, which
takes a slot of its own for it. A finished request is no longer scheduled but keeps its slot until it is terminated,
after this iteration's forward; with ``max_num_requests`` requests resident the padded batch needs
``max_num_requests + 1`` slots and ``add_slot`` raises.
Doctor: undersized-buffer, at __init__. ``Eagle3ResourceManager.__init__`` sizes the slot table (and the per-slot
``seq_lens`` / ``start_indices``) for the real requests only, while a padded graph step needs one more entry for the
padding dummy.
Fix (upstream): reserve one more slot for the CUDA-graph dummy: ``slot_size = max + 1`` for ``SlotManager`` and the
per-slot dictionaries.
Modelled: ``SlotManager``, ``Eagle3ResourceManager`` (``__init__``, ``prepare_resources``, ``free_resources``,
``add_dummy_requests``), ``Eagle3SpecMetadata`` (static read/write index buffers initialised to 0, ``prepare`` for the
target model, ``maybe_capture_hidden_states``), ``CUDAGraphRunner`` (``_round_up_batch_size``, ``_get_padded_batch``,
capture with warmup requests registered and freed), ``PyTorchModelEngine.forward`` and an executor loop (schedule,
``prepare_resources``, forward, sampler, then termination of the requests that finished in the previous iteration).
Stand-ins: the target model is a per-token MLP whose hidden state (one captured layer) is written through the write
indices; the draft engine runs eagerly and drafts one token from the hidden state of the last accepted token plus its
embedding; greedy acceptance; the KV-cache manager only books requests.
Workload: max batch 4, one draft token, graphs for batch sizes 2 and 4. Iteration 1 prefills A, B, C, D eagerly;
iteration 2 decodes all four (batch 4, no padding) and D reaches its two-token limit; iteration 3 decodes A, B, C,
padded to 4 while D still holds its slot; iterations 4 and 5 decode A, B, C. The bug raises ValueError (No free slots)
in iteration 3; the fix gives the dummy the reserved slot 4, replays the batch-4 graph in iterations 3 to 5 (1 or 2
tokens accepted per step) and matches eager (max error 8.9e-16, the rounding of batch-4 against batch-3 matmuls).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/7998"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = ("Eagle3 with CUDA-graph padding on a full server: registering the padding dummy with the spec resource "
           "manager raises ValueError: No free slots")

MAX_BATCH_SIZE = 4                           # max_num_requests
MAX_DRAFT_LEN = 1
TOKENS_PER_GEN = 1 + MAX_DRAFT_LEN
MAX_NUM_TOKENS, MAX_SEQ_LEN = 32, 16
CUDA_GRAPH_BATCH_SIZES = [2, 4]
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 2
HIDDEN, VOCAB = 8, 16
DTYPE = torch.float64


# --- tensorrt_llm/_torch/pyexecutor/resource_manager.py ---------------------------------------------------------------

class SlotManager:
    def __init__(self, max_num_requests: int):
        self.max_num_requests = max_num_requests
        self.slot_mapping = dict()
        self.free_slots = set(range(max_num_requests))

    def get_slot(self, request_id: int):
        return self.slot_mapping.get(request_id, None)

    def add_slot(self, request_id: int):
        if len(self.free_slots) == 0:
            raise ValueError("No free slots")
        slot = self.free_slots.pop()
        self.slot_mapping[request_id] = slot
        return slot

    def remove_slot(self, request_id: int):
        if request_id in self.slot_mapping:
            slot = self.slot_mapping.pop(request_id)
            self.free_slots.add(slot)


@dataclasses.dataclass(eq=False)
class LlmRequest:
    request_id: int
    prompt: list
    max_new_tokens: int = 0
    is_first_context_chunk: bool = True
    is_cuda_graph_dummy: bool = False
    finished: bool = False
    generated: list = dataclasses.field(default_factory=list)
    py_next_input: list | None = None            # last accepted token + draft tokens


@dataclasses.dataclass
class ScheduledRequests:
    context_requests: list
    generation_requests: list

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def can_run_cuda_graph(self) -> bool:
        return not self.context_requests


class KVCacheManager:
    """Stand-in: the target model has no attention; only the booking of dummy requests remains."""

    def add_dummy_requests(self, request_ids, is_gen=True, max_num_draft_tokens=0):
        return [LlmRequest(rid, prompt=[0], is_first_context_chunk=not is_gen,
                           py_next_input=[0] * (1 + max_num_draft_tokens)) for rid in request_ids]


# --- tensorrt_llm/_torch/speculative/eagle3.py ------------------------------------------------------------------------

class Eagle3ResourceManager:
    def __init__(self, variant, dtype, hidden_size, max_num_requests, max_seq_len, max_num_tokens, device):
        self.max_num_requests = max_num_requests
        if variant == "fix":
            # There could be dummy request for padding batch when using CUDA graph.
            # Reserve one more slot for the dummy request.
            slot_size = max_num_requests + 1
        else:
            slot_size = max_num_requests
        self.slot_manager = SlotManager(slot_size)
        max_num_tokens = min(max_num_tokens, max_num_requests * max_seq_len) + TOKENS_PER_GEN * max_num_requests
        self.hidden_states = torch.zeros((max_num_tokens, hidden_size), dtype=dtype, device=device)
        self.seq_lens = {i: 0 for i in range(slot_size)}
        self.start_indices = {i: 0 for i in range(slot_size)}

    def prepare_resources(self, scheduled_batch: ScheduledRequests):
        for req in scheduled_batch.context_requests:
            if req.is_first_context_chunk:
                self.slot_manager.add_slot(req.request_id)

    def free_resources(self, request: LlmRequest):
        slot_id = self.slot_manager.get_slot(request.request_id)
        self.seq_lens[slot_id] = 0
        self.start_indices[slot_id] = 0
        self.slot_manager.remove_slot(request.request_id)

    def add_dummy_requests(self, request_ids):
        for rid in request_ids:
            self.slot_manager.add_slot(rid)


class Eagle3SpecMetadata:
    """Target-model side: where each request's captured hidden states go in ``hidden_states``."""

    def __init__(self, resource_manager, max_num_tokens, device):
        self.eagle3_resource_manager = resource_manager
        # Initialize to 0 to avoid reading uninitialized memory during warmup
        self.hidden_states_write_indices = torch.zeros([max_num_tokens], dtype=torch.long, device=device)
        self.request_ids, self.seq_lens, self.num_tokens = None, None, 0

    def prepare(self):
        manager = self.eagle3_resource_manager
        start_idx = 0
        for req_id, seq_len in zip(self.request_ids, self.seq_lens):
            slot_id = manager.slot_manager.get_slot(req_id)
            manager.start_indices[slot_id] = start_idx
            start_idx += max(seq_len, MAX_DRAFT_LEN + 1)
            assert start_idx < manager.hidden_states.shape[0], "start_idx is greater than hidden_states.shape[0]"
        hidden_states_write_indices = []
        for req_id, seq_len in zip(self.request_ids, self.seq_lens):
            slot_id = manager.slot_manager.get_slot(req_id)
            start = manager.start_indices[slot_id]
            hidden_states_write_indices.extend(range(start, start + seq_len))
            manager.seq_lens[slot_id] = seq_len
        self.num_tokens = len(hidden_states_write_indices)
        self.hidden_states_write_indices[:self.num_tokens].copy_(
            torch.tensor(hidden_states_write_indices, dtype=torch.long))

    def maybe_capture_hidden_states(self, hidden_states, num_tokens):
        token_idx = self.hidden_states_write_indices[:num_tokens]
        self.eagle3_resource_manager.hidden_states.index_copy_(0, token_idx, hidden_states)


class Models:
    """Target model (per-token MLP, greedy verification) and the Eagle3 draft head."""

    def __init__(self, device):
        gen = generator(7998)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.8).to(DTYPE)
        self.w_target = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6).to(DTYPE)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)
        self.w_draft = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.3).to(DTYPE)

    def target(self, input_ids, spec_metadata, num_tokens):
        hidden = torch.tanh(self.embed_tokens[input_ids] @ self.w_target)
        spec_metadata.maybe_capture_hidden_states(hidden, num_tokens)
        return hidden @ self.lm_head

    def draft(self, hidden_states, read_indices, last_tokens):
        h = torch.tanh(self.embed_tokens[last_tokens] @ self.w_target + hidden_states[read_indices] @ self.w_draft)
        return torch.argmax(h @ self.lm_head, dim=-1)


# --- tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py / model_engine.py --------------------------------------------

class PyTorchModelEngine:
    def __init__(self, variant, device, use_cuda_graph):
        self.device, self.enabled, self.padding_enabled = device, use_cuda_graph, True
        self.models = Models(device)
        self.kv_cache_manager = KVCacheManager()
        self.spec_resource_manager = Eagle3ResourceManager(variant, DTYPE, HIDDEN, MAX_BATCH_SIZE, MAX_SEQ_LEN,
                                                           MAX_NUM_TOKENS, device)
        self.spec_metadata = Eagle3SpecMetadata(self.spec_resource_manager, MAX_NUM_TOKENS, device)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.padding_dummy_request = None
        self.graphs = {}
        if use_cuda_graph:
            self.warmup()

    def _round_up_batch_size(self, batch_size):
        return next(bs for bs in CUDA_GRAPH_BATCH_SIZES if bs >= batch_size)

    def _get_padded_batch(self, batch: ScheduledRequests, spec_res_mgr) -> int:
        batch_size = batch.batch_size
        if (not self.enabled or not self.padding_enabled or not batch.can_run_cuda_graph
                or batch_size > CUDA_GRAPH_BATCH_SIZES[-1]):
            return 0
        padded_batch_size = self._round_up_batch_size(batch_size)
        if batch_size == padded_batch_size:
            return 0
        padding_size = padded_batch_size - batch_size
        if padding_size + batch.batch_size > MAX_BATCH_SIZE:
            return 0
        if self.padding_dummy_request is None:
            self.padding_dummy_request = self.kv_cache_manager.add_dummy_requests(
                [CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True, max_num_draft_tokens=MAX_DRAFT_LEN)[0]
            self.padding_dummy_request.is_cuda_graph_dummy = True
            if spec_res_mgr:
                spec_res_mgr.add_dummy_requests([CUDA_GRAPH_DUMMY_REQUEST_ID])
        batch.generation_requests.extend([self.padding_dummy_request] * padding_size)
        return padding_size

    def _graph_step(self, bs):
        num_tokens = bs * TOKENS_PER_GEN

        def step():
            logits = self.models.target(self.input_ids[:num_tokens], self.spec_metadata, num_tokens)
            logits = logits.view(bs, TOKENS_PER_GEN, VOCAB)
            target_tokens = torch.argmax(logits, dim=-1)
            match = (self.input_ids[:num_tokens].view(bs, TOKENS_PER_GEN)[:, 1:] == target_tokens[:, :-1]).long()
            num_accepted = 1 + torch.cumprod(match, dim=1).sum(dim=1)
            return logits, target_tokens, num_accepted
        return step

    def _prepare_inputs(self, requests, token_lists):
        tokens = [t for toks in token_lists for t in toks]
        self.input_ids[:len(tokens)].copy_(torch.tensor(tokens, dtype=torch.long))
        self.spec_metadata.request_ids = [r.request_id for r in requests]
        self.spec_metadata.seq_lens = [len(toks) for toks in token_lists]
        self.spec_metadata.prepare()
        return len(tokens)

    def warmup(self):
        """CUDA-graph capture: warmup generation requests registered with both managers, then freed."""
        manager = self.spec_resource_manager
        for bs in reversed(CUDA_GRAPH_BATCH_SIZES):
            requests = self.kv_cache_manager.add_dummy_requests(list(range(bs)), is_gen=True,
                                                                max_num_draft_tokens=MAX_DRAFT_LEN)
            manager.add_dummy_requests([r.request_id for r in requests])
            self._prepare_inputs(requests, [r.py_next_input for r in requests])
            self.graphs[bs] = capture(self._graph_step(bs), device=self.device, warmups=1, name=f"eagle3_target_bs{bs}",
                                      owner="CUDAGraphRunner",
                                      static={"input_ids": self.input_ids, "hidden_states_write_indices":
                                              self.spec_metadata.hidden_states_write_indices},
                                      state={"eagle3_hidden_states": manager.hidden_states})
            for r in requests:
                manager.free_resources(r)

    def forward(self, batch: ScheduledRequests):
        """Returns per real request: target logits, the positions read by the draft head, the tokens to draft from."""
        if batch.context_requests:                         # prefill: eager, one pass over the prompts
            reqs = batch.context_requests
            self._prepare_inputs(reqs, [r.prompt for r in reqs])
            num_tokens = self.spec_metadata.num_tokens
            logits = self.models.target(self.input_ids[:num_tokens], self.spec_metadata, num_tokens)
            manager = self.spec_resource_manager
            read = torch.tensor([manager.start_indices[manager.slot_manager.get_slot(r.request_id)] + len(r.prompt) - 1
                                 for r in reqs], device=self.device)
            offsets = torch.cumsum(torch.tensor([len(r.prompt) for r in reqs], device=self.device), 0) - 1
            first = torch.argmax(logits[offsets], dim=-1)
            return logits[offsets][:, None], first[:, None], torch.ones_like(first), read, first
        real = len(batch.generation_requests)
        self._get_padded_batch(batch, self.spec_resource_manager)
        reqs = batch.generation_requests
        bs = len(reqs)
        self._prepare_inputs(reqs, [r.py_next_input for r in reqs])
        if self.enabled and bs in self.graphs:
            g, outputs = self.graphs[bs]
            logits, target_tokens, num_accepted = replay(g, outputs, real=real, size=bs)
        else:
            logits, target_tokens, num_accepted = self._graph_step(bs)()
        del batch.generation_requests[real:]
        starts = torch.tensor([self.spec_resource_manager.start_indices[
            self.spec_resource_manager.slot_manager.get_slot(r.request_id)] for r in reqs[:real]], device=self.device)
        logits, target_tokens, num_accepted = logits[:real], target_tokens[:real], num_accepted[:real]
        read = starts + num_accepted - 1
        last = torch.gather(target_tokens, 1, (num_accepted - 1)[:, None])[:, 0]
        return logits.clone(), target_tokens.clone(), num_accepted.clone(), read, last


# --- tensorrt_llm/_torch/pyexecutor/py_executor.py (reconstructed loop) -----------------------------------------------

def _serve(variant, device, use_cuda_graph):
    engine = PyTorchModelEngine(variant, device, use_cuda_graph)
    gen = generator(97)
    requests = [LlmRequest(100 + i, prompt=torch.randint(0, VOCAB, (n,), generator=gen).tolist(), max_new_tokens=m)
                for i, (n, m) in enumerate(((5, 20), (4, 20), (6, 20), (3, 2)))]
    active, previous_finished, results = list(requests), [], []
    for _ in range(5):
        batch = ScheduledRequests([r for r in active if r.is_first_context_chunk],
                                  [r for r in active if not r.is_first_context_chunk and not r.finished])
        engine.spec_resource_manager.prepare_resources(batch)
        logits, target_tokens, num_accepted, read, last = engine.forward(batch)
        drafts = engine.models.draft(engine.spec_resource_manager.hidden_states, read, last)
        for r in previous_finished:                         # _process_previous_batch: terminate finished requests
            engine.spec_resource_manager.free_resources(r)
            active.remove(r)
        results += [logits, num_accepted, drafts]
        accepted, drafts_host, n_acc = target_tokens.tolist(), drafts.tolist(), num_accepted.tolist()
        previous_finished = []
        for i, r in enumerate(batch.context_requests + batch.generation_requests):    # the sampler
            r.is_first_context_chunk = False
            r.generated += accepted[i][:n_acc[i]]
            r.py_next_input = [r.generated[-1], drafts_host[i]]
            if len(r.generated) >= r.max_new_tokens:
                r.finished = True
                previous_finished.append(r)
    return results


def run(variant: str, device: str = "cpu"):
    return compare("trtllm_7998_eagle3_slot_table_has_no_room_for_padding_dummy", variant, device,
                   served=lambda: _serve(variant, device, True), eager=lambda: _serve(variant, device, False))
