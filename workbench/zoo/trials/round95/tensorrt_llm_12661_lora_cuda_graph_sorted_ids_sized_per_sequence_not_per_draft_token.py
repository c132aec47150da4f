"""TensorRT-LLM multi-LoRA + NGRAM speculative decoding under CUDA graphs: the CUDA-graph LoRA path keeps one sorted
index per sequence in a persistent buffer sized for ``max_batch_size`` sequences, but a verify step carries
``runtime_draft_len + 1`` tokens per sequence, so the captured LoRA scatter is asked for more rows than the buffer holds
and the engine fails while capturing its verify graphs.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/12661 ("[#12617][feat] Add support for speculative decoding with
LoRA", NVIDIA/TensorRT-LLM, merged; reviews dated 2026-04-09/10), fixing issue 12617 ("[Bug]: Ngram speculative decoding is
incompatible with LoRA", TensorRT-LLM 1.3.0rc9: enabling LoRA and NGRAM speculative decoding together aborts with a
traceback through ``modeling_qwen3``'s ``self_attn``; only the head of the traceback is stored). Read: the issue; the PR's
review threads (the ``model_engine`` hunk computing ``tokens_per_seq = self.runtime_draft_len + 1`` for linear-tree
verification and passing it to ``cuda_graph_lora_manager.prepare_cuda_graph_lora_params``, and the reviewers' notes that
the CUDA-graph kernel consumes only ``sorted_ids``/``slot_counts``/... while the eager branch rewrites
``host_request_types``/``prompt_lens_cpu``); and the post-fix ``_torch/peft/lora/cuda_graph_lora_params.py``
(``sorted_ids`` sized ``max_batch_size * max_tokens_per_seq``, ``update_sorted_indices(slot_ids, tokens_per_seq)`` expanding
per-sequence sorted indices to per-token ones, ``update_slots_params`` multiplying the slot counts by ``tokens_per_seq``),
``cuda_graph_lora_manager.py`` (``prepare_cuda_graph_lora_params``), ``adapter_slot_manager.py`` (base-model requests get
slot ``max_lora_size``) and ``layer.py`` (``_forward_cuda_graph_mode_impl``: grouped GEMM over slot-sorted rows, then
``restored_output.index_copy_(0, sorted_ids[:batch_size], output_buffer)``). Reconstructed: the pre-fix code, taken to be the
post-fix code with ``tokens_per_seq == 1`` everywhere (buffer of ``max_batch_size`` entries, one sorted id and one count
per sequence); that ``max_tokens_per_seq`` arrived with this PR is an assumption. The PR's eager-branch rewrite is not
modelled: eager here is the per-request LoRA the fixed eager branch computes, the reference in both variants.
Symptom: a server with LoRA, NGRAM speculation (linear drafts) and CUDA graphs fails at start-up while it captures the
generation graphs: the LoRA output of a verify batch cannot be scattered back.
Mechanism: the CUDA-graph LoRA parameters are persistent buffers refreshed before each step and read by the captured
grouped GEMM. ``update_sorted_indices`` writes one slot-sorted index per sequence into ``sorted_ids`` (``max_batch_size``
entries) and ``update_slots_params`` counts sequences per slot. A verify graph for ``bs`` sequences runs ``bs * (draft_len
+ 1)`` token rows; ``_forward_cuda_graph_mode_impl`` takes ``sorted_ids[:num_tokens]`` to scatter the rows back, which for
the largest graph is shorter than the rows it must place, and ``index_copy_`` raises during the warm-up run that precedes
the capture. (On smaller graphs the indices would address sequences where tokens are meant.)
Doctor: undersized-buffer, at update_sorted_indices. The static index buffer the graph reads is sized, and filled, for
one row per sequence while the captured verify step needs one row per draft token.
Fix (upstream): size ``sorted_ids`` for ``max_batch_size * max_tokens_per_seq`` tokens and, with ``tokens_per_seq =
runtime_draft_len + 1``, expand the sorted indices to every token of a sequence and count tokens (not sequences) per slot.
Modelled: ``CudaGraphLoraParams`` (``__init__``, ``update_sorted_indices``, ``update_weight_pointers``,
``update_slots_params``, ``get_slot_counts``, ``get_offset_from_counts``), ``CudaGraphLoraManager.
prepare_cuda_graph_lora_params``, ``AdapterSlotManager``, ``LoraLayer`` (``_forward_cuda_graph_mode_impl``,
``_forward_eager_mode``), a ``CUDAGraphRunner`` keyed by (batch size, draft length) padding with a base-model dummy request
and capturing largest first into one pool, and ``PyTorchModelEngine`` (``_get_lora_params_from_requests``, ``forward``).
Stand-ins: the weight pointers (per-slot weight tensors copied when the slots change), the grouped GEMM (torch over the
slot-sorted rows; rows no problem covers stay zero where the kernel leaves ``torch.empty``), the model (embedding +
position embedding, a ``qkv_proj``-like and an ``o_proj``-like ``Linear`` carrying LoRA, lm_head; hidden 8, vocab 16,
rank 2, float64; no attention), the ``PeftCacheManager`` (adapter weights by task id) and the NGRAM drafts (fixed lists).
Workload: max_batch_size 4, CUDA-graph batch sizes [1, 2, 4], max_draft_len 2 (3 tokens per verified sequence), two
adapters (tasks 1 and 2). Steps verify A (task 1), B (task 2), C (task 1) (padded to 4), then B, C, then A, then A, B, C.
The bug raises ``IndexError: index_copy_(): Number of indices (4) should be equal to source.size(dim) (12)`` while the
engine warms up its bs=4 verify graph; the fix equals eager on every step.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/12661"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "update_sorted_indices"
SYMPTOM = ("LoRA with NGRAM speculative decoding and CUDA graphs: the CUDA-graph LoRA sorted-index buffer holds one entry "
           "per sequence, the verify graph has draft_len + 1 token rows per sequence, and scattering the LoRA output "
           "back raises while the verify graphs are captured")

HIDDEN = 8
VOCAB = 16
MAX_RANK = 2
MAX_LORA_SIZE = 2                 # adapter slots; base-model requests get slot MAX_LORA_SIZE
MAX_BATCH_SIZE = 4
CUDA_GRAPH_BATCH_SIZES = [1, 2, 4]
MAX_DRAFT_LEN = 2
MAX_POSITION = 32
CUDA_GRAPH_DUMMY_REQUEST_ID = 2 ** 32 - 1

_variant = "bug"


@dataclasses.dataclass
class LlmRequest:
    py_request_id: int
    lora_task_id: int | None
    py_last_token: int
    py_draft_tokens: list
    max_beam_num_tokens: int          # tokens already in the sequence


@dataclasses.dataclass
class ScheduledRequests:
    generation_requests: list
    num_context_requests: int = 0


class PeftCacheManager:
    """Stand-in: adapter weights by task id (the C++ cache hands out weight pointers)."""

    def __init__(self, device):
        gen = generator(126610)
        w = lambda *s: randn(*s, gen=gen, device=device, scale=0.7).double()  # noqa: E731
        self.tasks = {t: {"rank": MAX_RANK, "scaling": 2.0,
                          "layers": {name: (w(MAX_RANK, HIDDEN), w(HIDDEN, MAX_RANK)) for name in ("qkv", "o")}}
                      for t in (1, 2)}

    def get_and_reset_batch_peft_table(self):
        return self.tasks


class AdapterSlotManager:
    def __init__(self, max_lora_size):
        self.max_lora_size = max_lora_size
        self.slot2task = [None] * max_lora_size
        self.task2slot = {}
        self.slots_changed = False

    def update_slots(self, requests):
        tasks = [r.lora_task_id for r in requests]
        for i, task in enumerate(tasks):
            if task is None:
                tasks[i] = self.max_lora_size
            else:
                if task not in self.task2slot:
                    slot = self.slot2task.index(None)
                    self.slot2task[slot], self.task2slot[task] = task, slot
                    self.slots_changed = True
                tasks[i] = self.task2slot[task]
        return tasks


# --- tensorrt_llm/_torch/peft/lora/cuda_graph_lora_params.py -------------------------------------------------------------

class CudaGraphLoraParams:
    """Persistent device tensors updated outside replay, read by the captured grouped GEMM."""

    def __init__(self, max_batch_size, max_lora_size, max_rank, layer_names, device, max_tokens_per_seq=1):
        self.max_batch_size, self.max_lora_size, self.max_rank = max_batch_size, max_lora_size, max_rank
        self.device = device
        self.max_tokens_per_seq = max_tokens_per_seq if _variant == "fix" else 1
        max_num_tokens = max_batch_size * self.max_tokens_per_seq
        self.sorted_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.sorted_ids_host = torch.zeros(max_num_tokens, dtype=torch.int64)
        self.slot_counts = torch.zeros(max_lora_size, dtype=torch.int32, device=device)
        self.slot_offsets_full = torch.zeros(max_lora_size + 1, dtype=torch.int64, device=device)
        self.slot_ranks = torch.zeros(max_lora_size, dtype=torch.int32, device=device)
        self.slot_scalings = torch.zeros(max_lora_size, dtype=torch.float64, device=device)
        # stand-in for the per-layer weight-pointer tables: the slots' weights themselves
        self.layer_params = {name: (torch.zeros(max_lora_size, max_rank, HIDDEN, dtype=torch.float64, device=device),
                                    torch.zeros(max_lora_size, HIDDEN, max_rank, dtype=torch.float64, device=device))
                             for name in layer_names}

    @staticmethod
    def get_sorted_indices(slot_ids):
        _, sorted_indices = torch.sort(torch.tensor(slot_ids, dtype=torch.int64), stable=True)
        return sorted_indices

    def update_sorted_indices(self, slot_ids, tokens_per_seq=1):
        actual_batch_size = len(slot_ids)
        assert actual_batch_size <= self.max_batch_size
        sorted_indices = self.get_sorted_indices(slot_ids)
        if _variant == "fix" and tokens_per_seq > 1:
            token_sorted_ids = (sorted_indices.unsqueeze(1) * tokens_per_seq
                                + torch.arange(tokens_per_seq, dtype=sorted_indices.dtype)).flatten()
            num_tokens = actual_batch_size * tokens_per_seq
        else:
            token_sorted_ids, num_tokens = sorted_indices, actual_batch_size
        self.sorted_ids_host[:num_tokens].copy_(token_sorted_ids)
        self.sorted_ids[:num_tokens].copy_(self.sorted_ids_host[:num_tokens].to(self.device))

    def update_weight_pointers(self, peft_table, slot_to_task_mapping):
        ranks = torch.zeros(self.max_lora_size, dtype=torch.int32)
        scalings = torch.zeros(self.max_lora_size, dtype=torch.float64)
        for slot_id, task_id in enumerate(slot_to_task_mapping):
            for a_slots, b_slots in self.layer_params.values():
                a_slots[slot_id].zero_()
                b_slots[slot_id].zero_()
            if task_id is None:
                continue
            task = peft_table[task_id]
            ranks[slot_id], scalings[slot_id] = task["rank"], task["scaling"]
            for name, (a, b) in task["layers"].items():
                self.layer_params[name][0][slot_id, :a.shape[0]].copy_(a)
                self.layer_params[name][1][slot_id, :, :b.shape[1]].copy_(b)
        self.slot_ranks.copy_(ranks.to(self.device))
        self.slot_scalings.copy_(scalings.to(self.device))

    @staticmethod
    def get_offset_from_counts(counts, full=False):
        offset = torch.zeros(counts.shape[0] + (1 if full else 0), dtype=torch.int64)
        offset[1:] = counts if full else counts[:-1]
        return offset.cumsum(0)

    @staticmethod
    def get_slot_counts(batch_slot_ids, max_lora_size):
        return torch.bincount(torch.tensor(batch_slot_ids, dtype=torch.int64), minlength=max_lora_size)[:max_lora_size]

    def update_slots_params(self, batch_slot_ids, tokens_per_seq=1):
        multiplier = tokens_per_seq if _variant == "fix" else 1
        slot_counts = self.get_slot_counts(batch_slot_ids, self.max_lora_size) * multiplier
        self.slot_counts.copy_(slot_counts.to(torch.int32).to(self.device))
        self.slot_offsets_full.copy_(self.get_offset_from_counts(slot_counts, full=True).to(self.device))


# --- tensorrt_llm/_torch/peft/lora/cuda_graph_lora_manager.py ------------------------------------------------------------

class CudaGraphLoraManager:
    def __init__(self, max_lora_size, max_batch_size, max_lora_rank, layer_names, device, max_tokens_per_seq=1):
        self.adapter_slot_manager = AdapterSlotManager(max_lora_size)
        self.cuda_graph_lora_params = CudaGraphLoraParams(max_batch_size, max_lora_size, max_lora_rank, layer_names,
                                                          device, max_tokens_per_seq=max_tokens_per_seq)

    def prepare_cuda_graph_lora_params(self, scheduled_requests, attn_metadata, peft_cache_manager, tokens_per_seq=1):
        assert scheduled_requests.num_context_requests == 0
        request_list = scheduled_requests.generation_requests
        peft_table = peft_cache_manager.get_and_reset_batch_peft_table()
        request_slot_ids = self.adapter_slot_manager.update_slots(request_list)
        params = self.cuda_graph_lora_params
        params.update_sorted_indices(request_slot_ids, tokens_per_seq)
        if self.adapter_slot_manager.slots_changed:
            params.update_weight_pointers(peft_table, tuple(self.adapter_slot_manager.slot2task))
            self.adapter_slot_manager.slots_changed = False
        params.update_slots_params(batch_slot_ids=request_slot_ids, tokens_per_seq=tokens_per_seq)
        return {"cuda_graph_params": params, "use_cuda_graph_mode": True}


# --- tensorrt_llm/_torch/peft/lora/layer.py ------------------------------------------------------------------------------

class LoraLayer:
    def __init__(self, name):
        self.name = name

    def forward(self, x, lora_params):
        if not lora_params:
            return None
        if lora_params.get("use_cuda_graph_mode", False):
            return self._forward_cuda_graph_mode_impl(x, lora_params["cuda_graph_params"])
        return self._forward_eager_mode(x, lora_params)

    def _forward_cuda_graph_mode_impl(self, x, params):
        batch_size = x.shape[0]
        a_slots, b_slots = params.layer_params[self.name]
        ids = params.sorted_ids[:batch_size]
        pos = torch.arange(ids.shape[0], device=x.device)
        x_sorted = x.index_select(0, ids)                           # the GEMM's a_offset walks the sorted rows
        output_buffer = torch.zeros(batch_size, HIDDEN, dtype=x.dtype, device=x.device)
        r_idx = torch.arange(params.max_rank, device=x.device)
        for slot in range(params.max_lora_size):                   # problem_count: one GEMM pair per slot
            start, count = params.slot_offsets_full[slot], params.slot_counts[slot]
            rank, scaling = params.slot_ranks[slot], params.slot_scalings[slot]
            rows = (pos >= start) & (pos < start + count) & (rank > 0)
            inter = (x_sorted @ a_slots[slot].transpose(0, 1)) * (r_idx < rank).to(x.dtype)
            out = scaling * (inter @ b_slots[slot].transpose(0, 1))
            output_buffer[:ids.shape[0]] += torch.where(rows[:, None], out, torch.zeros_like(out))
        restored_output = torch.empty_like(output_buffer)
        restored_output.index_copy_(0, ids, output_buffer)
        return restored_output

    def _forward_eager_mode(self, x, lora_params):
        """Per-request segments of ``prompt_lens`` tokens (the fixed eager branch treats verify rows as context)."""
        out = torch.zeros(x.shape[0], HIDDEN, dtype=x.dtype, device=x.device)
        start = 0
        for task, n in zip(lora_params["task_ids"], lora_params["prompt_lens"]):
            if task is not None:
                t = lora_params["peft_table"][task]
                a, b = t["layers"][self.name]
                out[start:start + n] = t["scaling"] * ((x[start:start + n] @ a.transpose(0, 1)) @ b.transpose(0, 1))
            start += n
        return out


class Linear:
    def __init__(self, weight, name):
        self.weight, self.lora = weight, LoraLayer(name)

    def forward(self, x, lora_params):
        output = x @ self.weight.transpose(0, 1)
        lora_result = self.lora.forward(x, lora_params)
        return output if lora_result is None else output + lora_result


class TinyQwen3ForCausalLM:
    def __init__(self, device):
        gen = generator(12661)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.pos_embed = r(MAX_POSITION, HIDDEN, scale=0.3)
        self.qkv_proj = Linear(r(HIDDEN, HIDDEN), "qkv")
        self.o_proj = Linear(r(HIDDEN, HIDDEN), "o")
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    def forward(self, input_ids, position_ids, lora_params):
        h = self.embed_tokens[input_ids] + self.pos_embed[position_ids]
        h = h + self.o_proj.forward(torch.tanh(self.qkv_proj.forward(h, lora_params)), lora_params)
        return h @ self.lm_head


# --- tensorrt_llm/_torch/pyexecutor: cuda_graph_runner.py and model_engine.py --------------------------------------------

class CUDAGraphRunner:
    def __init__(self, engine):
        self.engine = engine
        self.graphs, self.graph_outputs, self.graph_lora_params = {}, {}, {}
        self.memory_pool = graph_pool_handle(engine.device)
        self.padding_dummy_request = LlmRequest(CUDA_GRAPH_DUMMY_REQUEST_ID, None, 0, [0] * MAX_DRAFT_LEN, 1)

    def get_padded_batch_size(self, batch_size):
        return next(b for b in CUDA_GRAPH_BATCH_SIZES if b >= batch_size)

    def pad_batch(self, scheduled_requests):
        padded = self.get_padded_batch_size(len(scheduled_requests.generation_requests))
        reqs = scheduled_requests.generation_requests
        return ScheduledRequests(reqs + [self.padding_dummy_request] * (padded - len(reqs)))

    def capture(self, key, forward_fn, lora_params, static):
        self.graphs[key], self.graph_outputs[key] = capture(
            forward_fn, device=self.engine.device, pool=self.memory_pool, name=f"generation bs={key[0]}",
            owner="CUDAGraphRunner", static=static)
        self.graph_lora_params[key] = lora_params

    def replay(self, key, num_real_tokens):
        size = key[0] * (key[1] + 1)
        # (the padded rows hold the dummy request's tokens: neutralised, not stale)
        return replay(self.graphs[key], self.graph_outputs[key], real=num_real_tokens, size=size)


class PyTorchModelEngine:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = TinyQwen3ForCausalLM(device)
        self.peft_cache_manager = PeftCacheManager(device)
        self.runtime_draft_len = MAX_DRAFT_LEN
        self.cuda_graph_lora_manager = CudaGraphLoraManager(MAX_LORA_SIZE, MAX_BATCH_SIZE, MAX_RANK, ("qkv", "o"), device,
                                                            max_tokens_per_seq=MAX_DRAFT_LEN + 1)
        max_num_tokens = MAX_BATCH_SIZE * (MAX_DRAFT_LEN + 1)
        self.input_ids_cuda = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.position_ids_cuda = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.cuda_graph_runner = CUDAGraphRunner(self) if use_cuda_graph else None
        if use_cuda_graph:
            self._capture_generation_cuda_graphs()

    def _static(self):
        p = self.cuda_graph_lora_manager.cuda_graph_lora_params
        return {"input_ids": self.input_ids_cuda, "position_ids": self.position_ids_cuda,
                "lora.sorted_ids": p.sorted_ids, "lora.slot_counts": p.slot_counts,
                "lora.slot_offsets_full": p.slot_offsets_full, "lora.slot_ranks": p.slot_ranks}

    def _get_lora_params_from_requests(self, scheduled_requests, use_graph):
        if use_graph:
            tokens_per_seq = self.runtime_draft_len + 1 if self.runtime_draft_len > 0 else 1
            if _variant == "fix":
                return self.cuda_graph_lora_manager.prepare_cuda_graph_lora_params(
                    scheduled_requests, None, self.peft_cache_manager, tokens_per_seq)
            return self.cuda_graph_lora_manager.prepare_cuda_graph_lora_params(
                scheduled_requests, None, self.peft_cache_manager)
        reqs = scheduled_requests.generation_requests
        return {"peft_table": self.peft_cache_manager.get_and_reset_batch_peft_table(),
                "task_ids": [r.lora_task_id for r in reqs], "prompt_lens": [1 + len(r.py_draft_tokens) for r in reqs]}

    def _prepare_tp_inputs(self, scheduled_requests):
        ids, pos = [], []
        for r in scheduled_requests.generation_requests:
            ids += [r.py_last_token] + r.py_draft_tokens
            pos += list(range(r.max_beam_num_tokens - 1, r.max_beam_num_tokens + len(r.py_draft_tokens)))
        n = len(ids)
        self.input_ids_cuda[:n].copy_(torch.tensor(ids, dtype=torch.int64).to(self.device))
        self.position_ids_cuda[:n].copy_(torch.tensor(pos, dtype=torch.int64).to(self.device))
        return n

    def _capture_generation_cuda_graphs(self):
        for bs in sorted(CUDA_GRAPH_BATCH_SIZES, reverse=True):
            batch = ScheduledRequests([self.cuda_graph_runner.padding_dummy_request] * bs)
            n = self._prepare_tp_inputs(batch)
            lora_params = self._get_lora_params_from_requests(batch, use_graph=True)
            self.cuda_graph_runner.capture(
                (bs, self.runtime_draft_len),
                lambda n=n, lp=lora_params: self.model.forward(self.input_ids_cuda[:n], self.position_ids_cuda[:n], lp),
                lora_params, self._static())

    def forward(self, scheduled_requests):
        num_real_tokens = sum(1 + len(r.py_draft_tokens) for r in scheduled_requests.generation_requests)
        if self.cuda_graph_runner is None:
            n = self._prepare_tp_inputs(scheduled_requests)
            lora_params = self._get_lora_params_from_requests(scheduled_requests, use_graph=False)
            return self.model.forward(self.input_ids_cuda[:n], self.position_ids_cuda[:n], lora_params)
        padded = self.cuda_graph_runner.pad_batch(scheduled_requests)
        self._prepare_tp_inputs(padded)
        self._get_lora_params_from_requests(padded, use_graph=True)
        key = (len(padded.generation_requests), self.runtime_draft_len)
        logits = self.cuda_graph_runner.replay(key, num_real_tokens)
        return logits[:num_real_tokens]


# --- workload: NGRAM verify steps ----------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_cuda_graph):
        engine = PyTorchModelEngine(device, use_cuda_graph)
        meta = {"A": (11, 1, 5), "B": (12, 2, 7), "C": (13, 1, 4)}     # request id, LoRA task, tokens so far
        last = {"A": 3, "B": 9, "C": 6}
        drafts = {"A": [[4, 1], [7, 2], [5, 5]], "B": [[2, 2], [8, 1], [0, 3]], "C": [[6, 9], [1, 12], [14, 2]]}
        used = {n: 0 for n in meta}
        outs = []
        for step in (["A", "B", "C"], ["B", "C"], ["A"], ["A", "B", "C"]):
            reqs = []
            for name in step:
                rid, task, length = meta[name]
                reqs.append(LlmRequest(rid, task, last[name], drafts[name][used[name]], length))
                used[name] += 1
            logits = engine.forward(ScheduledRequests(reqs))
            outs.append(logits.clone())
            for i, name in enumerate(step):                       # accept one token (the target's first pick)
                rid, task, length = meta[name]
                last[name] = int(logits[i * (MAX_DRAFT_LEN + 1)].argmax())
                meta[name] = (rid, task, length + 1)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
