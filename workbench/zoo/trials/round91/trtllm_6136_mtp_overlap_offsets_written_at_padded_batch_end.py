"""PD + MTP + overlap scheduler under CUDA-graph padding: the previous-batch position/KV-length offsets are written at the end of the padded extend batch, onto the dummy rows instead of the real ones.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/6136 ("[nvbug/5322354] fix PD + MTP + overlap scheduler accuracy
issue", NVIDIA/TensorRT-LLM, merged; description dated 2025-07-17). Read: the PR description ("The root cause is that the update of
`previous_pos_id_offsets_cuda` and `previous_kv_lens_offsets_cuda` is wrong. The dummy request should be placed at the
end.") and a stored post-fix version of ``tensorrt_llm/_torch/pyexecutor/model_engine.py`` (``_prepare_tp_inputs``
with the three-segment comment and ``num_extend_reqeust_wo_dummy = len(extend_requests) - len(extend_dummy_requests)``
used as the end of the slices written from ``new_tokens_lens_device`` / ``kv_len_offsets_device``, and
``_preprocess_inputs`` adding the two offset buffers to ``position_ids`` / ``attn_metadata.kv_lens_cuda``). The PR's
diff was not read: the pre-fix slice end (``len(extend_requests)``, the padded count) is reconstructed from the
description and from the fixed code.
Symptom: DeepSeek-V3 with MTP, the overlap scheduler and CUDA-graph padding on a disaggregated generation server loses
accuracy; without graph padding (eager, or batches that hit a captured size exactly) it is fine.
Mechanism: ``_prepare_tp_inputs`` orders the extend (draft-carrying) requests as [no previous batch (first step on the
generation server), has previous batch, CUDA-graph dummy requests]. Under the overlap scheduler the host does not yet
know how many tokens the previous step accepted, so it prepares positions and ``num_cached_tokens_per_seq`` with the
host's lagging length and writes the per-request corrections (``new_tokens_lens_device`` -> ``previous_pos_id_offsets_cuda``,
``new_tokens_lens - max_draft_len - 1`` -> ``previous_kv_lens_offsets_cuda``) for the "has previous batch" segment; the
captured ``_preprocess_inputs`` adds them on the device. The segment was addressed as the last ``previous_batch_len``
rows of ``extend_requests``, but at a padded graph size ``extend_requests`` ends with the dummy rows, so the corrections
land one segment too late: the first real requests of the segment get offset 0 (positions and KV lengths of the host's
stale view) and the dummies get the real requests' offsets. Eager batches have no dummies, so the slice is right there.
Doctor: padded-shape-mismatch, at _prepare_tp_inputs. Code run for the graph's padded batch combines a row extent
taken from the padded request list (``len(extend_requests)``, dummies included) with offset tensors sized for the real
previous-batch requests, so the real rows read offsets meant for others.
Fix (upstream): end the slices at ``num_extend_reqeust_wo_dummy`` (extend requests without the dummy ones).
Modelled: ``PyTorchModelEngine._prepare_tp_inputs`` (the extend-request path of MTP with overlap: segment order, input
ids of the previous batch gathered from ``new_tokens_device``, the two offset buffers zeroed then written, attention
metadata ``kv_lens_cuda`` from ``num_cached_tokens_per_seq``), ``_preprocess_inputs`` inside the captured forward, a
``CUDAGraphRunner`` padding to captured sizes with ``is_cuda_graph_dummy`` requests on a reserved slot, and the executor
loop that updates host lengths one step late. The model is one attention layer over a per-slot KV cache plus an lm head
(hidden 8, vocab 16, float64); the MTP sampler is a stand-in (argmax tokens, a fixed acceptance schedule). max_draft_len
1 (2 tokens per request), capture sizes [2, 4].
Workload: requests A and B arrive (first step on the generation server, prefilled prompts of 3 and 5 tokens): batch 2,
no padding, equal to eager. Step 1: C arrives and A, B carry a previous batch: [C, A, B] padded to 4 with one dummy; the
bug writes A's and B's corrections onto B's and the dummy's rows, so A runs at the host's stale positions and KV length
and B with A's: C's logits match, A's are off by 4.5. Step 2 repeats ([C, A, B] padded to 4). Steps 3-4: D joins, an
unpadded batch of 4 whose rows still differ through the corrupted KV cache and fed-back tokens (up to 11.1). The fix
equals eager. Logits of every real token are compared.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/6136"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_prepare_tp_inputs"
SYMPTOM = ("PD + MTP + overlap scheduler with CUDA-graph padding: the previous-batch position / KV-length offsets are "
           "written to the last rows of the padded extend batch (the dummies), so real requests run at stale positions "
           "and KV lengths and accuracy drops")

HIDDEN, VOCAB = 8, 16
MAX_DRAFT_LEN = 1
TOKENS_PER_REQ = 1 + MAX_DRAFT_LEN
MAX_SLOTS = 4
DUMMY_SLOT = MAX_SLOTS                 # reserved slot for CUDA-graph dummy requests
MAX_SEQ = 24
CUDA_GRAPH_BATCH_SIZES = [2, 4]
CUDA_GRAPH_DUMMY_REQUEST_ID = -1

_variant = "bug"


class LlmRequest:
    def __init__(self, request_id, prompt, seq_slot, draft_tokens, is_cuda_graph_dummy=False):
        self.py_request_id = request_id
        self.tokens = list(prompt)
        self.max_beam_num_tokens = len(prompt)
        self.py_seq_slot = seq_slot
        self.py_batch_idx = None                 # None: no previous batch (first step on the generation server)
        self.py_draft_tokens = list(draft_tokens)
        self.is_cuda_graph_dummy = is_cuda_graph_dummy
        self.is_dummy = is_cuda_graph_dummy

    def get_last_tokens(self, beam):
        return self.tokens[-1]


class ScheduledRequests:
    def __init__(self, generation_requests):
        self.context_requests = []
        self.generation_requests = list(generation_requests)


class TinyMTPModel:
    """One attention layer over a per-slot KV cache, then the lm head."""

    def __init__(self, device):
        gen = generator(6136)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.kv_cache = torch.zeros(2, MAX_SLOTS + 1, MAX_SEQ, HIDDEN, device=device, dtype=torch.float64)

    def forward(self, input_ids, position_ids, kv_lens, seq_slots):
        x = self.embed[input_ids]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        tok_slots = seq_slots.repeat_interleave(TOKENS_PER_REQ)
        pos = position_ids.clamp(0, MAX_SEQ - 1)
        self.kv_cache[0, tok_slots, pos] = k
        self.kv_cache[1, tok_slots, pos] = v
        j = torch.arange(input_ids.shape[0], device=x.device) % TOKENS_PER_REQ
        visible = kv_lens.repeat_interleave(TOKENS_PER_REQ) + j + 1          # causal inside the draft block
        keys, vals = self.kv_cache[0, tok_slots], self.kv_cache[1, tok_slots]  # [T, MAX_SEQ, H]
        scores = (keys * q.unsqueeze(1)).sum(-1) * HIDDEN ** -0.5
        cols = torch.arange(MAX_SEQ, device=x.device).unsqueeze(0)
        scores = torch.where(cols < visible.unsqueeze(1), scores, torch.full_like(scores, -1e9))
        out = (torch.softmax(scores, -1).unsqueeze(-1) * vals).sum(1) @ self.wo
        return (x + out) @ self.lm_head


class PyTorchModelEngine:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = TinyMTPModel(device)
        self.max_draft_len = MAX_DRAFT_LEN
        n_tok = (MAX_SLOTS + 1) * TOKENS_PER_REQ
        i32 = dict(dtype=torch.int64, device=device)
        self.input_ids_cuda = torch.zeros(n_tok, **i32)
        self.position_ids_cuda = torch.zeros(n_tok, **i32)
        self.previous_pos_id_offsets_cuda = torch.zeros(n_tok, **i32)
        self.previous_kv_lens_offsets_cuda = torch.zeros(MAX_SLOTS + 1, **i32)
        self.previous_pos_indices_cuda = torch.zeros(n_tok, **i32)
        self.previous_batch_indices_cuda = torch.zeros(MAX_SLOTS + 1, **i32)
        self.kv_lens_cuda = torch.zeros(MAX_SLOTS + 1, **i32)          # attn_metadata.kv_lens_cuda
        self.seq_slots_cuda = torch.zeros(MAX_SLOTS + 1, **i32)        # the KV-cache block table stand-in
        self.cuda_graph_runner = CUDAGraphRunner(self) if use_cuda_graph else None

    def _preprocess_inputs(self, num_tokens, num_seqs):
        """Runs inside the captured forward: apply the overlap-scheduler corrections on the device."""
        position_ids = self.position_ids_cuda[:num_tokens]
        position_ids += self.previous_pos_id_offsets_cuda[:num_tokens]
        kv_lens = self.kv_lens_cuda[:num_seqs]
        kv_lens += self.previous_kv_lens_offsets_cuda[:num_seqs]
        return position_ids, kv_lens

    def _forward_step(self, batch_size):
        num_tokens = batch_size * TOKENS_PER_REQ
        position_ids, kv_lens = self._preprocess_inputs(num_tokens, batch_size)
        return self.model.forward(self.input_ids_cuda[:num_tokens], position_ids, kv_lens,
                                  self.seq_slots_cuda[:batch_size])

    def _prepare_tp_inputs(self, scheduled_requests, new_tensors_device=None):
        """The MTP extend-request path with the overlap scheduler (the hazard site)."""
        input_ids, position_ids, num_cached_tokens_per_seq, seq_slots = [], [], [], []
        new_tokens_device = new_tokens_lens_device = next_draft_tokens_device = None
        if new_tensors_device is not None:
            new_tokens_device, new_tokens_lens_device, next_draft_tokens_device = new_tensors_device
        # Dummy extend requests should be at the end of extend_requests.
        extend_requests, extend_dummy_requests = [], []
        for request in scheduled_requests.generation_requests:
            (extend_dummy_requests if request.is_dummy else extend_requests).append(request)
        extend_requests += extend_dummy_requests

        previous_batch_indices, previous_pos_indices = [], []
        for request in extend_requests:
            seq_slots.append(request.py_seq_slot)
            if next_draft_tokens_device is None or request.is_dummy or request.py_batch_idx is None:
                if not request.is_cuda_graph_dummy:
                    input_ids.append(request.get_last_tokens(0))
                    input_ids.extend(request.py_draft_tokens)
                past_seen_token_num = request.max_beam_num_tokens - 1
                position_ids.extend(range(past_seen_token_num, past_seen_token_num + 1 + len(request.py_draft_tokens)))
                num_cached_tokens_per_seq.append(past_seen_token_num)
            else:
                previous_batch_idx = request.py_batch_idx
                past_seen_token_num = request.max_beam_num_tokens - 1
                position_ids.extend(range(past_seen_token_num, past_seen_token_num + 1 + self.max_draft_len))
                previous_batch_indices.append(previous_batch_idx)
                previous_pos_indices.extend([previous_batch_idx] * (1 + self.max_draft_len))
                num_cached_tokens_per_seq.append(past_seen_token_num + self.max_draft_len + 1)
            request.py_batch_idx = request.py_seq_slot

        previous_batch_len = len(previous_batch_indices)
        num_tokens = len(input_ids)
        if num_tokens > 0:
            self.input_ids_cuda[:num_tokens].copy_(torch.tensor(input_ids, dtype=torch.int64))
        if next_draft_tokens_device is not None:
            self.previous_pos_id_offsets_cuda *= 0            # initialize these two values to zeros
            self.previous_kv_lens_offsets_cuda *= 0
            if previous_batch_len > 0:
                previous_slots = self.previous_batch_indices_cuda[:previous_batch_len]
                previous_slots.copy_(torch.tensor(previous_batch_indices, dtype=torch.int64))
                previous_batch_tokens = previous_batch_len * (1 + self.max_draft_len)
                new_tokens = new_tokens_device.transpose(0, 1)[previous_slots, :].flatten()
                self.input_ids_cuda[num_tokens:num_tokens + previous_batch_tokens].copy_(new_tokens)
                kv_len_offsets_device = new_tokens_lens_device - self.max_draft_len - 1
                self.previous_pos_indices_cuda[0:previous_batch_tokens].copy_(
                    torch.tensor(previous_pos_indices, dtype=torch.int64))
                # extend requests: [no previous batch, previous batch, dummy requests]
                if _variant == "fix":
                    end = len(extend_requests) - len(extend_dummy_requests)   # num_extend_reqeust_wo_dummy
                else:
                    end = len(extend_requests)                                  # counts the dummy rows too
                self.previous_pos_id_offsets_cuda[
                    (end - previous_batch_len) * (1 + self.max_draft_len):end * (1 + self.max_draft_len)].copy_(
                        new_tokens_lens_device[self.previous_pos_indices_cuda[0:previous_batch_tokens]])
                self.previous_kv_lens_offsets_cuda[end - previous_batch_len:end].copy_(
                    kv_len_offsets_device[previous_slots])
        elif len(extend_requests) > 0:
            self.previous_pos_id_offsets_cuda *= 0
            self.previous_kv_lens_offsets_cuda *= 0

        total = len(position_ids)
        self.position_ids_cuda[:total].copy_(torch.tensor(position_ids, dtype=torch.int64))
        n = len(extend_requests)
        self.kv_lens_cuda[:n].copy_(torch.tensor(num_cached_tokens_per_seq, dtype=torch.int64))  # attn_metadata.prepare
        self.seq_slots_cuda[:n].copy_(torch.tensor(seq_slots, dtype=torch.int64))
        return n, len(extend_requests) - len(extend_dummy_requests)

    def forward(self, scheduled_requests, new_tensors_device):
        runner = self.cuda_graph_runner
        if runner is not None:
            scheduled_requests = runner.pad_batch(scheduled_requests)
        batch_size, num_real = self._prepare_tp_inputs(scheduled_requests, new_tensors_device)
        if runner is not None:
            logits = runner.replay(batch_size, num_real)
        else:
            logits = self._forward_step(batch_size)
        return logits[:num_real * TOKENS_PER_REQ]


class CUDAGraphRunner:
    def __init__(self, engine):
        self.engine = engine
        self.graphs = {}
        self.dummy = LlmRequest(CUDA_GRAPH_DUMMY_REQUEST_ID, [0], DUMMY_SLOT, [0] * MAX_DRAFT_LEN,
                                is_cuda_graph_dummy=True)
        for bs in sorted(CUDA_GRAPH_BATCH_SIZES, reverse=True):
            self.engine._prepare_tp_inputs(ScheduledRequests([self.dummy] * bs))     # warmup batch of dummies
            e = self.engine
            g, out = capture(lambda bs=bs: e._forward_step(bs), device=e.device, warmups=2, name=f"decode [{bs}]",
                             owner="CUDAGraphRunner",
                             static={"input_ids_cuda": e.input_ids_cuda, "position_ids_cuda": e.position_ids_cuda,
                                     "previous_pos_id_offsets_cuda": e.previous_pos_id_offsets_cuda,
                                     "previous_kv_lens_offsets_cuda": e.previous_kv_lens_offsets_cuda,
                                     "kv_lens_cuda": e.kv_lens_cuda, "seq_slots_cuda": e.seq_slots_cuda},
                             state={"kv_cache": e.model.kv_cache})
            self.graphs[bs] = (g, out)

    def pad_batch(self, scheduled_requests):
        n = len(scheduled_requests.generation_requests)
        bs = next(s for s in sorted(CUDA_GRAPH_BATCH_SIZES) if s >= n)
        return ScheduledRequests(scheduled_requests.generation_requests + [self.dummy] * (bs - n))

    def replay(self, batch_size, num_real):
        g, out = self.graphs[batch_size]
        return replay(g, out, real=num_real * TOKENS_PER_REQ, size=batch_size * TOKENS_PER_REQ)


def mtp_sampler(logits, requests, step):
    """Stand-in MTP sampler: per slot, the (1 + draft) new tokens, how many were accepted, the next drafts."""
    dev = logits.device
    new_tokens = torch.zeros(TOKENS_PER_REQ, MAX_SLOTS + 1, dtype=torch.int64, device=dev)
    new_tokens_lens = torch.ones(MAX_SLOTS + 1, dtype=torch.int64, device=dev)
    next_draft = torch.zeros(MAX_SLOTS + 1, MAX_DRAFT_LEN, dtype=torch.int64, device=dev)
    toks = logits.argmax(-1).view(len(requests), TOKENS_PER_REQ)
    for i, req in enumerate(requests):
        new_tokens[:, req.py_seq_slot] = toks[i]
        new_tokens_lens[req.py_seq_slot] = 1 + (step + req.py_seq_slot) % TOKENS_PER_REQ
        next_draft[req.py_seq_slot] = (toks[i, -1:] + 3) % VOCAB
    return new_tokens, new_tokens_lens, next_draft


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 7, 1], "B": [2, 9, 4, 4, 11], "C": [5, 6], "D": [8, 1, 13, 2]}
    arrivals = {0: "AB", 1: "C", 3: "D"}
    num_steps = 5

    def serve(use_cuda_graph):
        engine = PyTorchModelEngine(device, use_cuda_graph)
        gen = generator(61360)
        running, slots, outs = [], iter(range(MAX_SLOTS)), []
        previous = None                                   # (tensors, requests) of the step in flight
        for step in range(num_steps):
            new = []
            for name in arrivals.get(step, ""):           # first step on the generation server (PD)
                req = LlmRequest(name, prompts[name], next(slots), [1 + len(prompts[name])])
                p = len(prompts[name]) - 1                # the context server's KV for the prompt
                engine.model.kv_cache[:, req.py_seq_slot, :p] = randn(2, p, HIDDEN, gen=gen, device=device).double()
                new.append(req)
            running = new + running                       # [no previous batch, previous batch]
            batch = ScheduledRequests(running)
            logits = engine.forward(batch, previous[0] if previous else None)
            outs.append(logits.clone())
            tensors = mtp_sampler(logits, running, step)
            if previous is not None:                      # overlap scheduler: update the host one step late
                prev_tensors, prev_reqs = previous
                for req in prev_reqs:
                    req.max_beam_num_tokens += int(prev_tensors[1][req.py_seq_slot])
            previous = (tensors, list(running))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
