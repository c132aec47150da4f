"""CUDA-graph warmup with MTP + overlap: dummy requests add stale ``previous_kv_lens_offsets`` to their KV lengths.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/5947 ("[nvbugs/5333742] fix MTP illegal memory access
in cuda graph warmup").
Symptom: DeepSeek-V3(-Lite) with MTP, CUDA graphs and the overlap scheduler crashes with "an illegal memory
access" while warming up / capturing the CUDA graphs (in ``applyMLARopeAndAssignQKVKernelGeneration``,
the KV-cache write); with the overlap scheduler or CUDA graphs off it runs (TensorRT-LLM 0.21, July 2025).
Mechanism: with the overlap scheduler, a step's host inputs assume every draft token of the previous step
was accepted; ``_prepare_tp_inputs`` fills the persistent ``previous_kv_lens_offsets_cuda`` (accepted - 1 -
max_draft_len per request, from the previous step's device tensors) and ``_preprocess_inputs``, the start of
the (captured) forward, adds it to ``kv_lens_cuda``. The CUDA-graph warmup runs dummy generation requests
with no previous ``new_tensors_device``, and for that case nothing reset the offsets buffer: it still held
the last real step's offsets (here from the KV-cache estimation run), so the dummy requests' KV lengths
dropped below their new tokens and the captured KV write landed before the dummy's block.
Doctor: stale-input, at ``_prepare_tp_inputs`` (the offsets buffer left unwritten for the warmup's dummy
requests).
Fix (upstream): ``_prepare_tp_inputs`` also zeroes ``previous_pos_id_offsets_cuda`` and
``previous_kv_lens_offsets_cuda`` when the generation requests have no previous ``new_tensors_device``
(the warmup's dummy requests), so ``_preprocess_inputs`` changes nothing for them.
(Modelled from the PR's description; the cache is a flat token array instead of MLA pages, the position-id
offsets are left out.)
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/5947"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "_prepare_tp_inputs"
SYMPTOM = "illegal memory access in the CUDA-graph warmup: dummy requests' KV lengths include stale offsets"
VOCAB, DIM, MAX_DRAFT_LEN, BATCH, BLOCK, NUM_BLOCKS = 8, 4, 1, 2, 8, 3
TOKENS = 1 + MAX_DRAFT_LEN                       # tokens per generation request (last token + drafts)
DUMMY_BLOCK = 0                                  # the warmup's dummy requests get the first free block


class LlmRequest:
    def __init__(self, block, prompt, accepted_schedule=()):
        self.block = block
        self.tokens = list(prompt)                  # accepted tokens (host view after the sync)
        self.accepted_schedule = list(accepted_schedule)
        self.py_batch_idx = None


class Model:
    def __init__(self, device):
        gen = generator(5947)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)


class PyTorchModelEngine:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.kv_cache = torch.zeros(NUM_BLOCKS * BLOCK, DIM, device=device)
        self.input_ids_cuda = torch.zeros(BATCH * TOKENS, dtype=torch.long, device=device)
        self.kv_lens_cuda = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.block_offsets_cuda = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.previous_kv_lens_offsets_cuda = torch.zeros(BATCH, dtype=torch.long, device=device)

    def _prepare_tp_inputs(self, requests, new_tensors_device=None):
        """Host bookkeeping -> the persistent device inputs. With the overlap scheduler the KV lengths
        assume the previous step accepted all its drafts; the device offsets correct that."""
        input_ids, kv_lens, previous_batch_indices = [], [], []
        for request in requests:
            input_ids.extend(request.tokens[-TOKENS:])     # last token + draft tokens (dummies: padding)
            if new_tensors_device is not None and request.py_batch_idx is not None:
                kv_lens.append(len(request.tokens) + (TOKENS - request.last_accepted))   # all accepted
                previous_batch_indices.append(request.py_batch_idx)
            else:
                kv_lens.append(len(request.tokens))
        n = len(requests)
        self.input_ids_cuda[:n * TOKENS].copy_(torch.tensor(input_ids, device=self.device))
        self.kv_lens_cuda[:n].copy_(torch.tensor(kv_lens, device=self.device))
        self.block_offsets_cuda[:n].copy_(torch.tensor([r.block * BLOCK for r in requests], device=self.device))
        if new_tensors_device is not None:
            if len(previous_batch_indices) > 0:
                idx = torch.tensor(previous_batch_indices, device=self.device)
                kv_len_offsets_device = new_tensors_device["new_tokens_lens_device"] - MAX_DRAFT_LEN - 1
                self.previous_kv_lens_offsets_cuda[:len(idx)].copy_(kv_len_offsets_device[idx])
            else:
                # change the data to zeros to skip the value changes in _preprocess_inputs
                self.previous_kv_lens_offsets_cuda *= 0
        elif self.variant == "fix":
            # dummy generation requests (CUDA graph warmup) have no previous new_tensors_device
            self.previous_kv_lens_offsets_cuda *= 0
        for i, request in enumerate(requests):
            request.py_batch_idx = i
        return {"input_ids": self.input_ids_cuda[:n * TOKENS], "kv_lens": self.kv_lens_cuda[:n],
                "block_offsets": self.block_offsets_cuda[:n], "num_generations": n}

    def _preprocess_inputs(self, inputs):
        """Make some changes to the device inputs and avoid blocking the async data transfer."""
        n = inputs["num_generations"]
        inputs["kv_lens"] += self.previous_kv_lens_offsets_cuda[:n]
        return inputs

    def _postprocess_inputs(self, inputs):
        """Undo ``_preprocess_inputs`` (only in CUDA graph warmup/capture, which reuse the same inputs)."""
        n = inputs["num_generations"]
        inputs["kv_lens"] -= self.previous_kv_lens_offsets_cuda[:n]

    def _forward_step(self, inputs):
        inputs = self._preprocess_inputs(inputs)
        n = inputs["num_generations"]
        x = self.model.embed[inputs["input_ids"]]                          # [n * TOKENS, DIM]
        j = torch.arange(TOKENS, device=x.device)
        # the generation kernel writes the new tokens' K/V at positions kv_len - TOKENS + j of the sequence
        slots = (inputs["block_offsets"].unsqueeze(1) + inputs["kv_lens"].unsqueeze(1) - TOKENS + j).flatten()
        self.kv_cache.index_copy_(0, slots, x)
        pos = torch.arange(BLOCK, device=x.device)
        keys = self.kv_cache[inputs["block_offsets"].unsqueeze(1) + pos]   # [n, BLOCK, DIM]
        valid = pos.unsqueeze(0) < inputs["kv_lens"].unsqueeze(1)          # [n, BLOCK]
        q = (x @ self.model.wq).view(n, TOKENS, DIM)
        scores = (q @ keys.transpose(1, 2)).masked_fill(~valid.unsqueeze(1), float("-inf"))
        attn = torch.softmax(scores, -1) @ keys
        return (attn + q).reshape(n * TOKENS, DIM) @ self.model.lm_head

    def sample(self, requests, logits):
        """Greedy MTP verification on the host, with a fixed acceptance schedule: returns the step's
        ``new_tensors_device`` (accepted tokens per request)."""
        ids = logits.argmax(-1).view(len(requests), TOKENS).tolist()
        lens = []
        for request, row in zip(requests, ids):
            accepted = request.accepted_schedule.pop(0)
            request.tokens.extend(row[:accepted])
            request.last_accepted = accepted
            lens.append(accepted)
        return {"new_tokens_lens_device": torch.tensor(lens, device=self.device)}


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        engine = PyTorchModelEngine(model, device, variant)
        outs = []
        # KV-cache estimation run (eager, before the graphs are captured): two requests decode with MTP
        # under the overlap scheduler; request 0 rejects its draft in the last step.
        reqs = [LlmRequest(1, [1, 2, 3], [2, 1]), LlmRequest(2, [4, 5], [2, 2])]
        new_tensors = None
        for _ in range(2):
            outs.append(engine._forward_step(engine._prepare_tp_inputs(reqs, new_tensors)).clone())
            new_tensors = engine.sample(reqs, outs[-1])
        outs.append(engine._forward_step(engine._prepare_tp_inputs(reqs, new_tensors)).clone())
        engine.kv_cache.zero_()                          # the KV cache manager is re-created after estimation
        if graphed:
            # warmup(): capture the generation graph for batch size 2 on dummy generation requests
            dummies = [LlmRequest(DUMMY_BLOCK, [0] * TOKENS) for _ in range(BATCH)]
            inputs = engine._prepare_tp_inputs(dummies)
            owner = "CUDAGraphRunner (generation, MTP + overlap scheduler)"
            events.static_buffers(owner, {"input_ids_cuda": engine.input_ids_cuda,
                                          "block_offsets_cuda": engine.block_offsets_cuda,
                                          "previous_kv_lens_offsets_cuda": engine.previous_kv_lens_offsets_cuda})
            events.written_metadata(owner, {"kv_lens_cuda": engine.kv_lens_cuda})
            events.persistent_state(owner, {"kv_cache": engine.kv_cache})
            for _ in range(2):
                with events.warmup():
                    engine._forward_step(inputs)
                engine._postprocess_inputs(inputs)
            g = new_graph(device)
            with graph(g, name=f"generation batch {BATCH}"):
                static_logits = engine._forward_step(inputs)
            engine._postprocess_inputs(inputs)
            engine.kv_cache.zero_()                      # warmup writes are dummy data
        # Serving: two new requests decode with MTP under the overlap scheduler.
        reqs = [LlmRequest(1, [6, 2, 7, 1], [1, 2, 2]), LlmRequest(2, [3, 3], [2, 1, 2])]
        for request in reqs:                             # their prefill already wrote the prompt's KV
            for p, t in enumerate(request.tokens[:-TOKENS]):
                engine.kv_cache[request.block * BLOCK + p] = model.embed[t]
        new_tensors = {"new_tokens_lens_device": torch.full((BATCH,), TOKENS, device=device)}
        for request in reqs:
            request.last_accepted = TOKENS
        for i, request in enumerate(reqs):
            request.py_batch_idx = i
        for _ in range(3):
            inputs = engine._prepare_tp_inputs(reqs, new_tensors)
            if graphed:
                logits = replay(g, static_logits).clone()
            else:
                logits = engine._forward_step(inputs).clone()
            outs.append(logits)
            new_tensors = engine.sample(reqs, logits)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
