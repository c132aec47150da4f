"""Padded decode-graph rows keep the capture's ``b_req_idx`` / ``b_seq_len`` / ``mem_index``: their KV write lands in a live slot.

Upstream: https://github.com/ModelTC/lightllm/commit/58fa6d0f58e8049ab0237b2efed77065a1a8d5a9 ("fix paddded
cuda graph", 2025-06-10; it follows 2ece7ee9 "add padding cuda graph feature").
Symptom: the commit states none. By mechanism: once a live decode batch is not one of the captured
``cuda_graph_batch_sizes``, the padded rows of the bigger graph write the dummy token's KV into cache slots
that now belong to running requests, so those requests decode from a corrupted KV cache (wrong tokens; an
illegal memory access where the stale ids/lengths run off the tables). ``--disable_cudagraph`` is clean.
Mechanism: ``CudaGraph.warmup`` captures one graph per size in ``cuda_graph_batch_sizes`` (largest first) with
dummy inputs: ``b_req_idx = HOLD_REQUEST_ID``, ``b_seq_len = 2`` and ``mem_indexes = mem_manager.alloc(bs)``
(real slots 0..bs-1, handed back by ``mem_manager.free_all()`` afterwards). At serve time
``TpPartBaseModel._decode`` builds ``infer_state`` from the UNPADDED ``model_input`` (``copy_kv_index_to_req``
and ``init_some_extra_state`` for ``batch_size`` rows) and ``CudaGraph._replay`` replays
``self.graph[find_batch_size]``: it pads only ``graph_input_ids[batch_size:].fill_(1)``, and
``InferStateInfo.copy_for_cuda_graph`` copies each metadata tensor into ``attr_[:batch_size]``. Rows
``batch_size..find_batch_size`` of the static ``b_req_idx``/``b_seq_len``/``mem_index``/``position_ids`` keep
what the capture left there. The captured ``_token_forward`` still runs those rows: ``destindex_copy_kv``
writes their K into ``kv_buffer[mem_index]``, i.e. into slot 3, which the allocator has since given to
request B's prompt; B's attention (this step and every later one) reads the dummy token's key.
Doctor: stale-padding, at ``destindex_copy_kv`` (the padded rows' KV write goes to the slot the capture left
in the static ``mem_index``, now owned by a live request).
Fix (upstream): ``_create_padded_decode_model_input`` pads EVERY input before the infer state is built
(``input_ids`` 1, ``b_req_idx`` ``HOLD_REQUEST_ID``, ``b_seq_len`` 2, ``mem_indexes``
``HOLD_TOKEN_MEMINDEX``, the spare cache row), ``copy_kv_index_to_req``/``init_some_extra_state`` run on the
padded input, ``_replay`` does ``graph_input_ids.copy_(input_ids)`` on ``self.graph[batch_size]``,
``copy_for_cuda_graph`` copies whole tensors, and ``_create_unpad_decode_model_output`` slices the logits.
(One-layer toy; the backend samples only its requests' rows of the logits.)
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ModelTC/lightllm/commit/58fa6d0f58e8049ab0237b2efed77065a1a8d5a9"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "destindex_copy_kv"
SYMPTOM = "padded graph rows write the dummy token's KV into a live request's slot: wrong tokens (or IMA)"
VOCAB, DIM, MAX_REQ, MAX_LEN, SIZE = 12, 4, 4, 8, 24
CUDA_GRAPH_BATCH_SIZES = [1, 2, 4]       # graph_split_batch_size 2, graph_grow_step_size 2, max_batch_size 4


class MemoryManager:
    def __init__(self, device):
        self.kv_buffer = torch.zeros(SIZE + 1, DIM, device=device)     # row SIZE: the hold (padding) slot
        self.HOLD_TOKEN_MEMINDEX = SIZE
        self.device = device
        self.free_all()

    def alloc(self, need_size) -> torch.Tensor:
        out, self.free = self.free[:need_size], self.free[need_size:]
        return torch.tensor(out, dtype=torch.int32, device=self.device)

    def free_all(self):
        self.free = list(range(SIZE))


class ReqManager:
    def __init__(self, device):
        self.req_to_token_indexs = torch.zeros(MAX_REQ + 1, MAX_LEN, dtype=torch.int32, device=device)
        self.HOLD_REQUEST_ID = MAX_REQ


@dataclasses.dataclass
class ModelInput:
    batch_size: int
    input_ids: torch.Tensor
    mem_indexes: torch.Tensor
    b_req_idx: torch.Tensor
    b_seq_len: torch.Tensor


class InferStateInfo:
    def __init__(self, model_input: ModelInput):
        self.batch_size = model_input.batch_size
        self.b_req_idx, self.b_seq_len = model_input.b_req_idx, model_input.b_seq_len
        self.mem_index = model_input.mem_indexes

    def init_some_extra_state(self, model, input_ids):
        self.position_ids = self.b_seq_len.long() - 1                  # gen_decode_params

    def copy_for_cuda_graph(self, new_infer_state: "InferStateInfo", variant):
        for attr_name, attr_value in vars(new_infer_state).items():
            if isinstance(attr_value, torch.Tensor):
                attr_ = getattr(self, attr_name, None)
                if attr_ is not None and attr_.data_ptr() != attr_value.data_ptr():
                    if variant == "fix":
                        attr_.copy_(attr_value, non_blocking=True)
                    else:
                        attr_[: new_infer_state.batch_size].copy_(attr_value, non_blocking=True)

    def buffers(self):
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}


def copy_kv_index_to_req(req_to_token_indexs, b_req_idx, b_seq_len, mem_index):
    req_to_token_indexs[b_req_idx.long(), b_seq_len.long() - 1] = mem_index


def destindex_copy_kv(buffer, mem_index, kv_buffer):
    """Every row's K goes to its ``mem_index`` slot (padded rows included)."""
    kv_buffer[mem_index.long()] = buffer


class CudaGraph:
    def __init__(self, variant):
        self.graph, self.variant = {}, variant
        self.cuda_graph_batch_sizes = CUDA_GRAPH_BATCH_SIZES

    def find_closest_graph_batch_size(self, batch_size):
        return self.cuda_graph_batch_sizes[bisect.bisect_left(self.cuda_graph_batch_sizes, batch_size)]

    def need_capture(self, batch_size):
        return self.find_closest_graph_batch_size(batch_size) not in self.graph

    def capture_decode(self, model, decode_func, input_ids, infer_state):
        bs = input_ids.shape[0]
        g, out = capture(lambda: decode_func(input_ids, infer_state), device=model.device, name=f"decode bs {bs}",
                         static={"input_ids": input_ids, **infer_state.buffers()},
                         state={"kv_buffer": model.mem_manager.kv_buffer,
                                "req_to_token_indexs": model.req_manager.req_to_token_indexs},
                         owner="CudaGraph (decode)")
        self.graph[bs] = (g, input_ids, infer_state, out)
        return replay(g, out)

    def _replay(self, input_ids, infer_state):
        batch_size = input_ids.shape[0]
        if self.variant == "fix":                                 # input already padded to a graph size
            graph_obj, graph_input_ids, graph_infer_state, graph_output = self.graph[batch_size]
            graph_input_ids.copy_(input_ids)
            graph_infer_state.copy_for_cuda_graph(infer_state, self.variant)
            return replay(graph_obj, graph_output, real=infer_state.real_batch_size, size=batch_size)
        find_batch_size = self.find_closest_graph_batch_size(batch_size)
        graph_obj, graph_input_ids, graph_infer_state, graph_output = self.graph[find_batch_size]
        graph_input_ids[0:batch_size].copy_(input_ids)
        if batch_size < find_batch_size:
            graph_input_ids[batch_size:].fill_(1)                 # fill a valid token_id
        graph_infer_state.copy_for_cuda_graph(infer_state, self.variant)
        stale = {k: v for k, v in graph_infer_state.buffers().items()}
        return replay(graph_obj, graph_output, real=batch_size, size=find_batch_size, padded=stale)


class TpPartBaseModel:
    def __init__(self, device, variant, use_graph):
        gen = generator(58)
        self.device, self.variant = device, variant
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(2))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.7)
        self.mem_manager, self.req_manager = MemoryManager(device), ReqManager(device)
        self.graph = CudaGraph(variant) if use_graph else None

    def _token_forward(self, input_ids, infer_state: InferStateInfo):
        h = self.embed[input_ids.long()] + self.pos_embed[infer_state.position_ids]
        kv_buffer = self.mem_manager.kv_buffer
        destindex_copy_kv(h @ self.wk, infer_state.mem_index, kv_buffer)
        pos = torch.arange(MAX_LEN, device=h.device)
        valid = pos[None, :] < infer_state.b_seq_len.long()[:, None]
        loc = self.req_manager.req_to_token_indexs[infer_state.b_req_idx.long()].long()
        scores = (kv_buffer[loc] @ (h @ self.wq)[:, :, None]).squeeze(-1) / math.sqrt(DIM)
        p = torch.softmax(scores.masked_fill(~valid, -1e9), -1)
        return (h + (p[:, :, None] * kv_buffer[loc]).sum(1)) @ self.lm_head

    def _create_padded_decode_model_input(self, model_input: ModelInput, new_batch_size):
        pad = new_batch_size - model_input.batch_size
        new = copy.copy(model_input)
        new.batch_size = new_batch_size
        new.input_ids = F.pad(new.input_ids, (0, pad), value=1)
        new.b_req_idx = F.pad(new.b_req_idx, (0, pad), value=self.req_manager.HOLD_REQUEST_ID)
        new.b_seq_len = F.pad(new.b_seq_len, (0, pad), value=2)
        new.mem_indexes = F.pad(new.mem_indexes, (0, pad), value=self.mem_manager.HOLD_TOKEN_MEMINDEX)
        return new

    def _build_infer_state(self, model_input):
        infer_state = InferStateInfo(model_input)
        infer_state.real_batch_size = model_input.batch_size
        copy_kv_index_to_req(self.req_manager.req_to_token_indexs, infer_state.b_req_idx, infer_state.b_seq_len,
                             infer_state.mem_index)
        infer_state.init_some_extra_state(self, model_input.input_ids)
        return infer_state

    def _decode(self, model_input: ModelInput):
        if self.graph is None:
            return self._token_forward(model_input.input_ids, self._build_infer_state(model_input))
        if self.variant == "fix":
            find = self.graph.find_closest_graph_batch_size(model_input.batch_size)
            padded = self._create_padded_decode_model_input(model_input, find)
            infer_state = self._build_infer_state(padded)
            infer_state.real_batch_size = model_input.batch_size
            input_ids = padded.input_ids
        else:
            infer_state = self._build_infer_state(model_input)   # unpadded: batch_size rows only
            input_ids = model_input.input_ids
        if self.graph.need_capture(model_input.batch_size):
            logits = self.graph.capture_decode(self, self._token_forward, input_ids, infer_state)
        else:
            logits = self.graph._replay(input_ids, infer_state)
        return logits[0:model_input.batch_size] if self.variant == "fix" else logits   # unpad (fix)

    def warmup(self):
        """CudaGraph.warmup: one dummy decode per captured size, largest first, then free_all."""
        for bs in CUDA_GRAPH_BATCH_SIZES[::-1]:
            hold = torch.full((bs,), self.req_manager.HOLD_REQUEST_ID, dtype=torch.int32, device=self.device)
            self._decode(ModelInput(bs, torch.full((bs,), 1, device=self.device), self.mem_manager.alloc(bs),
                                    hold, torch.full((bs,), 2, dtype=torch.int32, device=self.device)))
            self.mem_manager.free_all()


def run(variant: str, device: str = "cpu"):
    prompts = {0: [3, 5, 7], 1: [2, 9], 2: [4, 6]}               # req id -> prompt (A, B, C)
    steps = ([0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1])            # C finishes before the last step

    def serve(graphed: bool):
        model = TpPartBaseModel(device, variant, graphed)
        if graphed:
            model.warmup()
        lens, last = {}, {}
        for r, prompt in prompts.items():                        # eager prefill: KV of every prompt token
            slots = model.mem_manager.alloc(len(prompt))
            model.req_manager.req_to_token_indexs[r, :len(prompt)] = slots
            x = model.embed[torch.tensor(prompt, device=device)] + model.pos_embed[:len(prompt)]
            model.mem_manager.kv_buffer[slots.long()] = x @ model.wk
            lens[r], last[r] = len(prompt), prompt[-1]
        outs = []
        for step, reqs in enumerate(steps):
            for r in reqs:
                lens[r] += 1
            ids = torch.tensor([(last[r] + step + 1) % VOCAB for r in reqs], device=device)
            mi = ModelInput(len(reqs), ids, model.mem_manager.alloc(len(reqs)),
                            torch.tensor(reqs, dtype=torch.int32, device=device),
                            torch.tensor([lens[r] for r in reqs], dtype=torch.int32, device=device))
            logits = model._decode(mi)
            outs.append(logits[: len(reqs)].clone())             # sample(): one row per request
            for r, t in zip(reqs, ids.tolist()):
                last[r] = t
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
