"""TRT-LLM vanilla MTP + CUDA-graph padding: the padded batch's dummy request was never given a slot in the MTP hidden-states manager, so ``MTPSpecMetadata.prepare`` builds ``slot_ids`` for the padded batch with ``None``.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/6258 ("[https://nvbugs/5402719][fix]: Add cuda graph dummy
requests to the spec_resource_manager", NVIDIA/TensorRT-LLM, merged 2025-07-22). Read: the PR description (the
failure: ``slot_manager.get_slot(rid)`` in ``MTPSpecMetadata.prepare`` returns ``None`` for the CUDA-graph dummy
request, and ``torch.tensor(mtp_slot_ids, dtype=torch.int, pin_memory=True)`` then fails; the fix: register the dummy
with the spec resource manager right after it is created from the KV-cache manager); ``tensorrt_llm/_torch/speculative/
mtp.py`` of that time (``MTPHiddenStatesManager`` with its ``SlotManager``, pools, ``prepare_resources`` /
``free_resources`` / ``add_dummy_requests``; ``MTPSpecMetadata.__post_init__`` and ``prepare``; the Python path of
``MTPWorker.update_mtp_hidden_states``); ``SlotManager`` in ``pyexecutor/resource_manager.py``; a later
``_get_padded_batch`` (moved to ``cuda_graph_runner.py``, quoted in the review of #9873) that still carries the fix's
``spec_res_mgr.add_dummy_requests([CUDA_GRAPH_DUMMY_REQUEST_ID])``.
The diff itself was not read: ``_get_padded_batch`` before the fix, the warmup and the engine loop are reconstructed.
Symptom: DeepSeek-style models served with vanilla MTP (``num_nextn_predict_layers`` > 1, or relaxed acceptance),
CUDA graphs and ``cuda_graph_padding_enabled`` crash on the first generation batch whose size is not a captured batch
size: ``TypeError: 'NoneType' object cannot be interpreted as an integer`` from ``MTPSpecMetadata.prepare``. Batches
that exactly fill a captured size, and runs without CUDA graphs, work.
Mechanism: ``_get_padded_batch`` pads a generation batch up to the next captured batch size with a dummy request
(``CUDA_GRAPH_DUMMY_REQUEST_ID``) that it creates through ``kv_cache_manager.add_dummy_requests`` only. The spec
metadata is then prepared for the padded batch's request ids, but the MTP hidden-states manager's slot table covers
only the real requests (slots are added in ``prepare_resources`` for first context chunks, and the warmup's dummies
were registered and freed at capture): ``get_slot`` returns ``None`` for the padding row, and the slot-id tensor for
the graph's static ``slot_ids`` cannot be built. (For the pointer tensors just before, ``pool[None].data_ptr()`` is
silently the pool's base, the address of slot 0.)
Doctor: padded-shape-mismatch, at _get_padded_batch. The step is prepared at the graph's padded size (the padded
request list) against per-request state sized for the real requests only (the slot table); ``_get_padded_batch``
adds the padding row to one manager and not to the other.
Fix (upstream): ``_get_padded_batch`` takes the ``spec_resource_manager`` and, when it creates the CUDA-graph dummy
request, calls ``spec_resource_manager.add_dummy_requests(request_ids=[CUDA_GRAPH_DUMMY_REQUEST_ID])``, so the padding
row has a scratch slot of its own in the MTP pools.
Modelled: ``SlotManager``, ``MTPHiddenStatesManager``, ``MTPSpecMetadata`` (``__post_init__``, ``prepare`` line by
line but without ``pin_memory``), ``MTPWorker`` (``sample_and_accept_draft_tokens`` greedy, the update of
``mtp_past_tokens_pool`` / ``mtp_past_hidden_states_pool`` through ``slot_ids``, vanilla MTP layers drafting one token
each), ``PyTorchModelEngine`` (``_round_up_batch_size``, ``_get_padded_batch``, the CUDA-graph warmup with registered
warmup requests, one graph per captured batch size). Stand-ins: the target model is a per-token MLP (no attention, so
the KV-cache manager only books requests), each MTP layer is one tanh layer over the past token's embedding and the
past hidden state, the update kernel is a batched gather over the concatenated past/new rows (a stand-in for
``mtp_update_hidden_states_op``, reading ``slot_ids`` as the Python path does), the scheduler and sampler are a loop.
Workload: max batch 4, two vanilla MTP layers, graphs captured for batch sizes 2 and 4. Three requests prefill
eagerly, then three generation steps of the three requests (1 to 3 tokens accepted), each padded to 4 with the dummy.
The bug raises TypeError ('NoneType' object cannot be interpreted as an integer) in ``prepare`` at the first generation
step; the fix gives the dummy slot 3 and replays the batch-4 graph three times, equal to eager (max error 6.7e-16, the
rounding of batch-4 against batch-3 matmuls).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/6258"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_get_padded_batch"
SYMPTOM = ("vanilla MTP with CUDA-graph padding: the first generation batch padded with the CUDA-graph dummy request "
           "crashes in MTPSpecMetadata.prepare (TypeError: 'NoneType' object cannot be interpreted as an integer)")

MAX_BATCH_SIZE = 4                          # max_num_requests of the MTP hidden-states manager
NUM_NEXTN_PREDICT_LAYERS = 2                # vanilla MTP (MTP_EAGLE only when the model has one MTP layer)
CUDA_GRAPH_BATCH_SIZES = [2, 4]
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 2  # UINT64_MAX - 1
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
    is_cuda_graph_dummy: bool = False
    context_done: bool = False
    py_next_input: torch.Tensor | None = None     # [1 + max_draft_len]: last accepted token + draft tokens

    def is_first_context_chunk(self) -> bool:
        return not self.context_done


@dataclasses.dataclass
class ScheduledRequests:
    context_requests: list
    generation_requests: list
    can_run_cuda_graph: bool = True

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)


class KVCacheManager:
    """Stand-in: the target model has no attention, so only the bookkeeping of dummy requests remains."""

    def add_dummy_requests(self, request_ids, is_gen=True, max_num_draft_tokens=0):
        return [LlmRequest(rid, prompt=[0], context_done=is_gen,
                           py_next_input=torch.zeros(1 + max_num_draft_tokens, dtype=torch.long))
                for rid in request_ids]


# --- tensorrt_llm/_torch/speculative/mtp.py ---------------------------------------------------------------------------

class MTPHiddenStatesManager:
    def __init__(self, num_nextn_predict_layers, dtype, hidden_size, max_num_requests, device):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.max_num_requests = max_num_requests
        self.slot_manager = SlotManager(max_num_requests)
        self.mtp_past_hidden_states_pool = torch.zeros((max_num_requests, num_nextn_predict_layers, hidden_size),
                                                       device=device, dtype=dtype)
        self.mtp_past_tokens_pool = torch.zeros((max_num_requests, num_nextn_predict_layers), device=device,
                                                dtype=torch.long)

    def prepare_resources(self, scheduled_batch: ScheduledRequests):
        for req in scheduled_batch.context_requests:
            if req.is_first_context_chunk():
                self.slot_manager.add_slot(req.request_id)

    def free_resources(self, request: LlmRequest):
        self.slot_manager.remove_slot(request.request_id)

    def add_dummy_requests(self, request_ids):
        for rid in request_ids:
            self.slot_manager.add_slot(rid)


class MTPSpecMetadata:
    def __init__(self, max_num_requests, mtp_hidden_states_manager, device):
        self.max_num_requests = max_num_requests
        self.mtp_hidden_states_manager = mtp_hidden_states_manager
        self.request_ids = None
        # __post_init__: the static per-request buffers the captured MTP update reads
        self.mtp_hidden_states_ptrs = torch.empty([max_num_requests], dtype=torch.int64, device=device)
        self.mtp_past_tokens_ptrs = torch.empty([max_num_requests], dtype=torch.int64, device=device)
        self.slot_ids = torch.zeros([max_num_requests], dtype=torch.long, device=device)
        self.batch_indices_cuda = torch.empty([max_num_requests], dtype=torch.int, device=device)

    def prepare(self):
        assert self.request_ids is not None
        num_seqs = len(self.request_ids)
        batch_indices = torch.arange(num_seqs, dtype=torch.int, device='cpu')
        self.batch_indices_cuda[:num_seqs].copy_(batch_indices, non_blocking=True)
        if self.mtp_hidden_states_manager is not None:  # MTP vanilla or use relaxed acceptance
            mtp_slot_ids = []
            for rid in self.request_ids:
                slot_id = self.mtp_hidden_states_manager.slot_manager.get_slot(rid)
                mtp_slot_ids.append(slot_id)
            # MTP Vanilla: Update mtp hidden states and past tokens (pointers for the thop kernel)
            mtp_hidden_states_ptrs, mtp_past_tokens_ptrs = [], []
            for slot_id in mtp_slot_ids:
                mtp_hidden_states_ptrs.append(
                    self.mtp_hidden_states_manager.mtp_past_hidden_states_pool[slot_id].data_ptr())
                mtp_past_tokens_ptrs.append(self.mtp_hidden_states_manager.mtp_past_tokens_pool[slot_id].data_ptr())
            self.mtp_hidden_states_ptrs[:num_seqs].copy_(torch.tensor(mtp_hidden_states_ptrs, dtype=torch.int64))
            self.mtp_past_tokens_ptrs[:num_seqs].copy_(torch.tensor(mtp_past_tokens_ptrs, dtype=torch.int64))
            mtp_slot_ids = torch.tensor(mtp_slot_ids, dtype=torch.int)
            self.slot_ids[:num_seqs].copy_(mtp_slot_ids, non_blocking=True)


class MTPWorker:
    """Target model output -> greedy acceptance -> MTP pool update (through ``slot_ids``) -> vanilla MTP drafts."""

    def __init__(self, device, gen):
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.8).to(DTYPE)
        self.w_target = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6).to(DTYPE)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)
        self.w_mtp = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.3).to(DTYPE)
                      for _ in range(NUM_NEXTN_PREDICT_LAYERS)]

    def target_model(self, input_ids):                        # [..., T] -> hidden [..., T, H], logits
        hidden = torch.tanh(self.embed_tokens[input_ids] @ self.w_target)
        return hidden, hidden @ self.lm_head

    def sample_and_accept_draft_tokens(self, input_ids, logits):
        target_tokens = torch.argmax(logits, dim=-1)           # [bs, 1 + nextn]
        match = (input_ids[:, 1:] == target_tokens[:, :-1]).long()
        num_accepted_tokens = 1 + torch.cumprod(match, dim=1).sum(dim=1)
        return target_tokens, num_accepted_tokens

    def update_mtp_hidden_states(self, hidden_states, num_accepted_tokens, accepted_tokens, slot_ids, manager):
        """``mtp_update_hidden_states_op`` for generation rows: keep the last ``nextn`` accepted tokens/states."""
        nextn = NUM_NEXTN_PREDICT_LAYERS
        past_h = manager.mtp_past_hidden_states_pool.index_select(0, slot_ids)
        past_t = manager.mtp_past_tokens_pool.index_select(0, slot_ids)
        window = num_accepted_tokens[:, None] + torch.arange(nextn, device=slot_ids.device)[None, :]
        cat_t = torch.cat((past_t, accepted_tokens), dim=1)
        cat_h = torch.cat((past_h, hidden_states), dim=1)
        new_t = torch.gather(cat_t, 1, window)
        new_h = torch.gather(cat_h, 1, window[:, :, None].expand(-1, -1, HIDDEN))
        manager.mtp_past_tokens_pool.index_copy_(0, slot_ids, new_t)
        manager.mtp_past_hidden_states_pool.index_copy_(0, slot_ids, new_h)

    def draft(self, slot_ids, manager):
        tokens = manager.mtp_past_tokens_pool.index_select(0, slot_ids)           # [bs, nextn]
        hidden = manager.mtp_past_hidden_states_pool.index_select(0, slot_ids)    # [bs, nextn, H]
        drafts = []
        for w in self.w_mtp:
            h = torch.tanh(self.embed_tokens[tokens] @ self.w_target + hidden @ w)
            d = torch.argmax(h[:, -1] @ self.lm_head, dim=-1)
            drafts.append(d)
            tokens = torch.cat((tokens[:, 1:], d[:, None]), dim=1)
            hidden = torch.cat((hidden[:, 1:], h[:, -1:]), dim=1)
        return torch.stack(drafts, dim=1)

    def forward_generation(self, input_ids, slot_ids, manager):
        hidden, logits = self.target_model(input_ids)
        accepted_tokens, num_accepted_tokens = self.sample_and_accept_draft_tokens(input_ids, logits)
        self.update_mtp_hidden_states(hidden, num_accepted_tokens, accepted_tokens, slot_ids, manager)
        next_draft_tokens = self.draft(slot_ids, manager)
        last = torch.gather(accepted_tokens, 1, (num_accepted_tokens - 1)[:, None])
        next_new_tokens = torch.cat((last, next_draft_tokens), dim=1)
        return logits, num_accepted_tokens, next_new_tokens

    def forward_context(self, prompt, slot_id, manager):
        """Eager prefill of one request: first token, pools filled with the prompt's last tokens/states, drafts."""
        nextn = NUM_NEXTN_PREDICT_LAYERS
        hidden, logits = self.target_model(prompt)
        first = torch.argmax(logits[-1:], dim=-1)
        manager.mtp_past_tokens_pool[slot_id] = torch.cat((prompt, first))[-nextn:]
        manager.mtp_past_hidden_states_pool[slot_id] = hidden[-nextn:]
        slot = torch.tensor([slot_id], device=prompt.device)
        return logits[-1:], torch.cat((first[:, None], self.draft(slot, manager)), dim=1)


# --- tensorrt_llm/_torch/pyexecutor/model_engine.py -------------------------------------------------------------------

class PyTorchModelEngine:
    def __init__(self, variant, device, use_cuda_graph):
        self.variant, self.device, self._run_cuda_graphs = variant, device, use_cuda_graph
        self._cuda_graph_padding_enabled = True
        self.batch_size = MAX_BATCH_SIZE
        self.max_draft_len = NUM_NEXTN_PREDICT_LAYERS
        self.model = MTPWorker(device, generator(6258))
        self.kv_cache_manager = KVCacheManager()
        self.spec_resource_manager = MTPHiddenStatesManager(NUM_NEXTN_PREDICT_LAYERS, DTYPE, HIDDEN, MAX_BATCH_SIZE,
                                                            device)
        self.spec_metadata = MTPSpecMetadata(MAX_BATCH_SIZE, self.spec_resource_manager, device)
        self.input_ids = torch.zeros(MAX_BATCH_SIZE, 1 + self.max_draft_len, dtype=torch.long, device=device)
        self.cuda_graph_dummy_request = None
        self._graphs = {}
        if use_cuda_graph:
            self.warmup()

    def _round_up_batch_size(self, batch_size):
        return next(bs for bs in CUDA_GRAPH_BATCH_SIZES if bs >= batch_size)

    def _get_padded_batch(self, scheduled_requests, kv_cache_manager, spec_resource_manager=None) -> int:
        batch_size = scheduled_requests.batch_size
        if (not self._run_cuda_graphs or not self._cuda_graph_padding_enabled
                or not scheduled_requests.can_run_cuda_graph or batch_size > CUDA_GRAPH_BATCH_SIZES[-1]):
            return 0
        padded_batch_size = self._round_up_batch_size(batch_size)
        if batch_size == padded_batch_size:
            return 0
        padding_size = padded_batch_size - batch_size
        if padding_size + batch_size > self.batch_size:
            return 0
        if self.cuda_graph_dummy_request is None:
            self.cuda_graph_dummy_request = kv_cache_manager.add_dummy_requests(
                [CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True, max_num_draft_tokens=self.max_draft_len)[0]
            self.cuda_graph_dummy_request.is_cuda_graph_dummy = True
            if self.variant == "fix" and spec_resource_manager is not None:
                spec_resource_manager.add_dummy_requests(request_ids=[CUDA_GRAPH_DUMMY_REQUEST_ID])
        scheduled_requests.generation_requests.extend([self.cuda_graph_dummy_request] * padding_size)
        return padding_size

    def _graph_step(self, bs):
        def step():
            return self.model.forward_generation(self.input_ids[:bs], self.spec_metadata.slot_ids[:bs],
                                                 self.spec_resource_manager)
        return step

    def warmup(self):
        """CUDA-graph warmup: dummy generation requests registered with both managers, captured, then freed."""
        manager = self.spec_resource_manager
        for bs in reversed(CUDA_GRAPH_BATCH_SIZES):
            requests = self.kv_cache_manager.add_dummy_requests(list(range(bs)), is_gen=True,
                                                                max_num_draft_tokens=self.max_draft_len)
            manager.add_dummy_requests(request_ids=[r.request_id for r in requests])
            self._prepare_inputs(requests)
            self._graphs[bs] = capture(
                self._graph_step(bs), device=self.device, warmups=1, name=f"mtp_generation_bs{bs}",
                owner="PyTorchModelEngine",
                static={"input_ids": self.input_ids, "slot_ids": self.spec_metadata.slot_ids},
                state={"mtp_past_hidden_states_pool": manager.mtp_past_hidden_states_pool,
                       "mtp_past_tokens_pool": manager.mtp_past_tokens_pool})
            for r in requests:
                manager.free_resources(r)

    def _prepare_inputs(self, generation_requests):
        bs = len(generation_requests)
        self.input_ids[:bs].copy_(torch.stack([r.py_next_input.to(self.device) for r in generation_requests]))
        self.spec_metadata.request_ids = [r.request_id for r in generation_requests]
        self.spec_metadata.prepare()

    def forward(self, scheduled_requests: ScheduledRequests):
        """One generation iteration (context requests are prefilled eagerly by ``forward_context``)."""
        real = len(scheduled_requests.generation_requests)
        self._get_padded_batch(scheduled_requests, self.kv_cache_manager, self.spec_resource_manager)
        requests = scheduled_requests.generation_requests
        bs = len(requests)
        self._prepare_inputs(requests)
        if self._run_cuda_graphs and bs in self._graphs:
            g, outputs = self._graphs[bs]
            outputs = replay(g, outputs, real=real, size=bs)
        else:
            outputs = self._graph_step(bs)()
        del scheduled_requests.generation_requests[real:]
        return [o[:real] for o in outputs]

    def forward_context(self, scheduled_requests: ScheduledRequests):
        self.spec_resource_manager.prepare_resources(scheduled_requests)
        outs = []
        for r in scheduled_requests.context_requests:
            slot = self.spec_resource_manager.slot_manager.get_slot(r.request_id)
            logits, r.py_next_input = self.model.forward_context(torch.tensor(r.prompt, device=self.device), slot,
                                                                 self.spec_resource_manager)
            r.py_next_input = r.py_next_input[0]
            r.context_done = True
            outs.append(logits)
        return outs


def _serve(variant, device, use_cuda_graph):
    engine = PyTorchModelEngine(variant, device, use_cuda_graph)
    gen = generator(97)
    requests = [LlmRequest(100 + i, prompt=torch.randint(0, VOCAB, (n,), generator=gen).tolist())
                for i, n in enumerate((5, 4, 6))]
    results = list(engine.forward_context(ScheduledRequests(list(requests), [])))
    for _ in range(3):
        logits, num_accepted, next_new_tokens = engine.forward(ScheduledRequests([], list(requests)))
        results += [logits.clone(), num_accepted.clone(), next_new_tokens.clone()]
        for i, r in enumerate(requests):                      # the sampler: next iteration's inputs
            r.py_next_input = next_new_tokens[i].clone()
    return results


def run(variant: str, device: str = "cpu"):
    return compare("trtllm_6258_mtp_padding_dummy_has_no_spec_resource_slot", variant, device,
                   served=lambda: _serve(variant, device, True), eager=lambda: _serve(variant, device, False))
