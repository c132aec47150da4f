"""vox-serve's ``CudaGraphWorker`` replays its prefill CUDA graph for a batch padded to the capture's batch size: each
dummy request added to reach ``max_batch_size`` brings one token of its own, appended after the real tokens. But
``_get_prefill_cuda_graph_key`` chose the sequence-length bucket from the real token count alone, so a batch whose real
tokens fit the bucket while real plus dummy tokens do not was sent to that graph. The graph-mode
``FlashInferPrefillWrapper.plan`` then writes the per-token KV-cache map of all ``total_tokens`` into its static
``token_to_page`` / ``token_to_cache`` buffers, sized at capture to the bucket, and the assignment fails: the prefill
(the first step of every TTS request) raises for prompts near the bucket's size, where the eager worker, which plans
only the real requests, has no limit. The fix counts the dummy tokens when choosing the bucket (and falls back to the
eager prefill when none is big enough).

Upstream: https://github.com/vox-serve/vox-serve/commit/97b34ce0989f45d8f27534b4808968df52039095 ("fix: seq len
calculation for prefill", vox-serve/vox-serve, by Keisuke Kamahori, 2025-08-26; a direct commit on ``main``, no PR or
issue), read in a mirror of the repository with ``git show``. Read: the whole diff (``vox-serve/worker/
cuda_graph_worker.py``, ``_get_prefill_cuda_graph_key``: ``padded_seq_len = self._get_cuda_graph_seq_len(seq_len)``
becomes ``self._get_cuda_graph_seq_len(seq_len + (padded_batch_size - batch_size))``, with the comment "considering
the padding tokens to match max batch size"); at its parent 98fc958: ``cuda_graph_worker.py`` whole where it concerns
prefill (``__init__`` with its ``self.kv_cache.zero_()`` after capture, ``_prepare_attention_wrappers``,
``_initialize_prefill_cuda_graphs``, ``_get_cuda_graph_seq_len``, ``_get_prefill_cuda_graph_key``,
``run_lm_prefill``, ``_run_lm_prefill_with_cuda_graph``, ``_run_lm_prefill_fallback``), ``worker/base.py``
(``_prepare_lm_inputs``, the page queue ``empty_pages``, ``run_lm_prefill``), ``flashinfer_utils.py``
(``FlashInferPrefillWrapper.__init__``/``plan``/``run``/``set_kv_cache``, where graph mode allocates
``token_to_page = torch.zeros(max_seq_len)`` and ``plan`` does ``self.token_to_page[:total_tokens] = ...``) and
``model/orpheus.py`` (``OrpheusAttention.forward``: rope, ``attn_wrapper.set_kv_cache``, ``attn_wrapper.run``;
``OrpheusModel.forward``); the neighbouring commits 566e0f6 (before it: the graph choice counts the tokens of
``_prepare_lm_inputs``) and b52151e (after it: a fixed prefill graph batch size), which earlier rounds of this zoo
model, and 3ed4342 (after it: a guard for batches larger than the graph's).
Not read: FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (its ``plan`` in CUDA-graph mode may itself refuse a
``qo_indptr`` longer than the capture's rows before vox-serve's own assignment is reached; either way the step
raises, which I infer and have not run); which of vox-serve's models and prompt lengths met the bug in practice (no
report is stored; the commit message is the only description).
Symptom: none quoted (no issue). From the code: a prefill batch of ``batch_size`` requests with ``1024 - (max_batch_size
- batch_size) < real tokens <= 1024`` raises ``RuntimeError: The expanded size of the tensor (1024) must match the
existing size (...)`` from ``FlashInferPrefillWrapper.plan``, taking the worker down; with the fix such a batch runs
eagerly.
Mechanism: padding to the captured batch size adds tokens the bucket choice did not count, so the step's data
outgrow the static buffers the graph was captured with. Eager prefill builds its maps at the real size every step.
Doctor: undersized-buffer, at _get_prefill_cuda_graph_key: it is the function the fix changes, and it decides which
captured size (16 token rows here) serves a step whose padded batch needs 17; the overflow surfaces one call later,
in ``plan``'s write into the graph-sized ``token_to_page``.
Fix (upstream): the bucket is chosen for ``seq_len + (padded_batch_size - batch_size)`` tokens; ``run_lm_prefill``
falls back to ``_run_lm_prefill_fallback`` when no bucket is big enough (upstream had one bucket, 1024).
Modelled: ``ModelWorker`` (``_prepare_lm_inputs`` with the page queue ``empty_pages``; ``_run_lm_prefill_fallback``,
upstream a method of ``CudaGraphWorker``, sits here so that the run without graphs uses it), ``CudaGraphWorker``
(``_initialize_prefill_cuda_graphs`` with the capture's dummy plan and the ``kv_cache.zero_()`` after it,
``_get_cuda_graph_seq_len``, ``_get_prefill_cuda_graph_key``, ``run_lm_prefill``, ``_run_lm_prefill_with_cuda_graph``:
sequence padding by repeating the last token and position, one temporary page and one token per dummy request,
replay, last-token logits, page release), ``FlashInferPrefillWrapper`` (``plan``'s per-token page/offset maps
verbatim, ``set_kv_cache``, ``run``), ``OrpheusAttention``/``OrpheusDecoderLayer``/``OrpheusBackboneModel``/
``OrpheusModel.forward``.
Stand-ins: FlashInfer's paged prefill kernel is a masked attention over a fixed window of 16 key slots per token,
read back from the paged cache through ``token_to_page``/``token_to_cache`` (the prompt has no prefix, so a token's
keys are its request's tokens up to itself); the request of a token comes from the wrapper's ``qo_indptr`` buffer
(searchsorted); linear layers are broadcast multiply-sums (a row's result does not depend on the step's row count,
so the padded graph and the unpadded eager step agree exactly); int64 indices for int32, float64 for bfloat16; the
graph wrapper has a ``qo_indptr`` buffer of its own (at this revision upstream passed ``paged_kv_indptr_buffer`` for
both, a separate bug fixed later in 9870966, left out here); rope is a plain rotary of pairs; two layers of width 16,
two heads, page size 4, a 48-page pool (the graph's unused rows write to the last page, as upstream's ``-1`` maps do;
the workload never hands that page out); one sequence bucket of 16 tokens for upstream's 1024 and ``max_batch_size``
4; greedy argmax for ``OrpheusModel.sampling`` (upstream: repetition penalty and sampling); requests are prefilled
once and their pages returned; no depth transformer, input features or masks (Orpheus has none); the eager
reference is ``_run_lm_prefill_fallback`` (base ``ModelWorker.run_lm_prefill`` selects ``qo_indptr[:-1] - 1``, an
unrelated quirk not modelled).
Workload: four prefill batches (real tokens 5+6, 3+4+2, 14, 4+4+4+4 over a vocabulary of 32), in that order; outputs
per batch: the last-token logits and the sampled ids. Padded, they need 13, 10, 17 and 16 token rows.
Measured (WORKBENCH_FAST=1, CPU): bug: "misbehaves (raised RuntimeError: The expanded size of the tensor (16) must
match the existing size (17) at non-singleton dimension 0.  Target sizes: [16].  Tensor sizes: [17])" at the third
batch (14 real tokens plus three dummy ones); fix: "equals eager (max |graph - eager| = 0)" (the third batch runs
eagerly, the other three replay the graph).
"""
from __future__ import annotations

import math
import queue

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vox-serve/vox-serve/commit/97b34ce0989f45d8f27534b4808968df52039095"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_get_prefill_cuda_graph_key"
SYMPTOM = ("the prefill graph is chosen for the real token count, but padding the batch to the captured batch size "
           "adds one token per dummy request, so FlashInferPrefillWrapper.plan overflows the graph-sized token maps")

VOCAB, HIDDEN, N_HEADS, N_LAYERS = 32, 16, 2, 2
HEAD_DIM = HIDDEN // N_HEADS
PAGE_SIZE, MAX_NUM_PAGES, MAX_BATCH_SIZE = 4, 48, 4
SEQ_LEN_BUCKETS = [16]                       # upstream: [1024]
WINDOW = 16                                  # key slots per token in the attention stand-in
PROMPT_LENGTHS = ([5, 6], [3, 4, 2], [14], [4, 4, 4, 4])
DTYPE = torch.float64


# --- flashinfer_utils.py ------------------------------------------------------------------------------------------

class FlashInferPrefillWrapper:
    """vox-serve's wrapper: ``plan`` builds per-token KV page/offset maps; in graph mode they live in static buffers."""

    def __init__(self, n_qo_head, n_state, page_size, batch_size=None, max_seq_len=None, device="cpu",
                 qo_indptr_buffer=None, use_cuda_graph=False):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.n_qo_head, self.head_dim, self.page_size = n_qo_head, n_state // n_qo_head, page_size
        if use_cuda_graph:
            self.qo_indptr_buf = qo_indptr_buffer                 # FlashInfer's cudagraph-mode buffer
            self.token_to_page = torch.zeros(max_seq_len, dtype=torch.long, device=device)
            self.token_to_cache = torch.zeros(max_seq_len, dtype=torch.long, device=device)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
        if self.use_cuda_graph:                                   # FlashInfer copies the plan into its buffers
            self.qo_indptr_buf.copy_(qo_indptr.to(self.device))
            self.qo_indptr_dev = self.qo_indptr_buf
        else:
            self.qo_indptr_dev = qo_indptr.to(self.device)
        self.qo_indptr = qo_indptr

        n_req = qo_indptr.shape[0] - 1
        # Per-request counts
        starts = qo_indptr[:-1]
        lens = qo_indptr[1:] - qo_indptr[:-1]
        total_tokens = int(lens.sum().item())
        # Pages/lengths AFTER append
        num_pages_after = paged_kv_indptr[1:] - paged_kv_indptr[:-1]
        kv_len_after = (num_pages_after - 1) * self.page_size + paged_kv_last_page_len
        # Flatten to per-token
        seg = torch.repeat_interleave(torch.arange(n_req), lens)
        intra = torch.arange(total_tokens) - torch.repeat_interleave(starts, lens)
        start_new = kv_len_after[seg] - lens[seg]
        g = start_new + intra
        page_off = torch.div(g, self.page_size, rounding_mode="floor")
        off_in_page = g - page_off * self.page_size
        abs_page_ptr = paged_kv_indptr[:-1][seg] + page_off

        if self.use_cuda_graph:
            self.token_to_page[:total_tokens] = paged_kv_indices[abs_page_ptr].to(self.device)
            self.token_to_cache[:total_tokens] = off_in_page.to(self.device)
            self.token_to_page[total_tokens:] = -1
            self.token_to_cache[total_tokens:] = -1
        else:
            self.token_to_page = paged_kv_indices[abs_page_ptr].to(self.device)
            self.token_to_cache = off_in_page.to(self.device)

    def set_kv_cache(self, kv_cache, k, v):
        kv_cache[self.token_to_page, 0, self.token_to_cache] = k
        kv_cache[self.token_to_page, 1, self.token_to_cache] = v

    def run(self, q, kv_cache):
        """Paged prefill (stand-in): each token attends to its request's tokens up to itself, their keys and values
        read back from the paged cache through the token maps; a fixed window of ``WINDOW`` key slots per token."""
        n_tokens, n_req = q.shape[0], self.qo_indptr_dev.shape[0] - 1
        tokens = torch.arange(n_tokens, device=q.device)
        req = torch.searchsorted(self.qo_indptr_dev[1:], tokens, right=True).clamp(max=n_req - 1)
        start = self.qo_indptr_dev[req]
        j = torch.arange(WINDOW, device=q.device)
        key_tok = (start[:, None] + j[None, :]).clamp(max=n_tokens - 1)          # [T, W]
        visible = j[None, :] <= (tokens - start)[:, None]
        pages, offs = self.token_to_page[key_tok], self.token_to_cache[key_tok]
        keys = torch.where(visible[..., None, None], kv_cache[pages, 0, offs], 0.0)  # [T, W, H, D]
        values = torch.where(visible[..., None, None], kv_cache[pages, 1, offs], 0.0)
        scores = (q.unsqueeze(1) * keys).sum(-1) / math.sqrt(self.head_dim)      # [T, W, H]
        probs = torch.softmax(scores.masked_fill(~visible[..., None], float("-inf")), dim=1)
        return (probs.unsqueeze(-1) * values).sum(1)                              # [T, H, D]


# --- model/orpheus.py (reduced) -----------------------------------------------------------------------------------

def _linear(x, w):
    """``x @ w`` as a broadcast multiply-sum: a row's result does not depend on how many rows the step has."""
    return (x.unsqueeze(-1) * w).sum(-2)


def _rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, position_ids):
    half = HEAD_DIM // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=DTYPE, device=x.device) / half))
    ang = position_ids.to(DTYPE)[:, None, None] * inv_freq
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * torch.cos(ang) - x2 * torch.sin(ang), x1 * torch.sin(ang) + x2 * torch.cos(ang)), -1)


class OrpheusAttention:
    def __init__(self, gen, device):
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5).to(DTYPE) for _ in range(4))

    def forward(self, hidden_states, position_ids, attn_wrapper, kv_cache):
        hidden_shape = (hidden_states.shape[0], -1, HEAD_DIM)
        query_states = _linear(hidden_states, self.q_proj).view(hidden_shape)
        key_states = _linear(hidden_states, self.k_proj).view(hidden_shape)
        value_states = _linear(hidden_states, self.v_proj).view(hidden_shape)
        query_states, key_states = _rope(query_states, position_ids), _rope(key_states, position_ids)
        attn_wrapper.set_kv_cache(kv_cache, key_states, value_states)
        attn_output = attn_wrapper.run(query_states, kv_cache)
        return _linear(attn_output.reshape(hidden_states.shape[0], -1), self.o_proj)


class OrpheusDecoderLayer:
    def __init__(self, gen, device):
        self.self_attn = OrpheusAttention(gen, device)
        self.up = randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5).to(DTYPE)
        self.down = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=(2 * HIDDEN) ** -0.5).to(DTYPE)
        self.ln1 = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        self.ln2 = torch.ones(HIDDEN, dtype=DTYPE, device=device)

    def forward(self, hidden_states, position_ids, attn_wrapper, kv_cache):
        hidden_states = hidden_states + self.self_attn.forward(_rms_norm(hidden_states, self.ln1), position_ids,
                                                               attn_wrapper, kv_cache)
        return hidden_states + _linear(torch.nn.functional.silu(_linear(_rms_norm(hidden_states, self.ln2), self.up)),
                                       self.down)


class OrpheusBackboneModel:
    def __init__(self, gen, device):
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [OrpheusDecoderLayer(gen, device) for _ in range(N_LAYERS)]
        self.norm = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=HIDDEN ** -0.5).to(DTYPE)

    def embed_tokens(self, input_ids):
        return self.embed[input_ids]

    def forward(self, inputs_embeds, position_ids, attn_wrapper, kv_cache):
        hidden_states = inputs_embeds
        for i, layer in enumerate(self.layers):
            hidden_states = layer.forward(hidden_states, position_ids, attn_wrapper, kv_cache[i])
        return _linear(_rms_norm(hidden_states, self.norm), self.lm_head)


class OrpheusModel:
    n_codebooks = 1

    def __init__(self, device):
        self.model = OrpheusBackboneModel(generator(97), device)

    def forward(self, input_ids, position_ids, attn_wrapper, kv_cache):
        inputs_embeds = self.model.embed_tokens(input_ids[:, 0])           # remove codebook dimension
        logits = self.model.forward(inputs_embeds, position_ids, attn_wrapper, kv_cache)
        return logits[:, None, :]                                          # add codebook dimension

    def sampling(self, logits, requests):
        return logits[:, 0].argmax(-1)                                     # greedy stand-in for Sampler


class Request:
    def __init__(self, input_tokens):
        self.input_tokens, self.kv_pages, self.done_lm_prefill = input_tokens, [], False


# --- worker/base.py -----------------------------------------------------------------------------------------------

class ModelWorker:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.page_size, self.max_num_pages, self.max_batch_size = PAGE_SIZE, MAX_NUM_PAGES, MAX_BATCH_SIZE
        self.empty_pages = queue.Queue()
        for i in range(self.max_num_pages):
            self.empty_pages.put(i)
        self.kv_cache = torch.zeros(N_LAYERS, self.max_num_pages, 2, self.page_size, N_HEADS, HEAD_DIM, dtype=DTYPE,
                                    device=device)
        self.prefill_wrapper_no_cudagraph = FlashInferPrefillWrapper(N_HEADS, HIDDEN, self.page_size, device=device)

    def _prepare_lm_inputs(self, requests):
        qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len = [0], [0], [], []
        input_ids, position_ids = [], []
        for req in requests:                                   # prefill requests only
            n_pages_to_allocate = (len(req.input_tokens) + self.page_size - 1) // self.page_size
            req.kv_pages = [self.empty_pages.get_nowait() for _ in range(n_pages_to_allocate)]
            req.kv_last_page_len = len(req.input_tokens) % self.page_size or self.page_size
            qo_indptr.append(qo_indptr[-1] + len(req.input_tokens))
            paged_kv_indptr.append(paged_kv_indptr[-1] + len(req.kv_pages))
            paged_kv_indices.extend(req.kv_pages)
            paged_kv_last_page_len.append(req.kv_last_page_len)
            input_ids.extend([[t] for t in req.input_tokens])
            position_ids.extend(range(len(req.input_tokens)))
            req.done_lm_prefill = True
        return {"qo_indptr": qo_indptr, "paged_kv_indptr": paged_kv_indptr, "paged_kv_indices": paged_kv_indices,
                "paged_kv_last_page_len": paged_kv_last_page_len, "input_ids": input_ids,
                "position_ids": position_ids}

    def run_lm_prefill(self, requests):
        lm_inputs = self._prepare_lm_inputs(requests)
        return self._finish(requests, self._run_lm_prefill_fallback(requests, lm_inputs))

    def _run_lm_prefill_fallback(self, requests, lm_inputs):
        """Regular prefill: the real requests' plan, the forward on the real tokens."""
        input_ids = torch.tensor(lm_inputs["input_ids"], device=self.device)
        position_ids = torch.tensor(lm_inputs["position_ids"], device=self.device)
        qo_indptr_tensor = torch.tensor(lm_inputs["qo_indptr"])
        self.prefill_wrapper_no_cudagraph.plan(qo_indptr_tensor, torch.tensor(lm_inputs["paged_kv_indptr"]),
                                               torch.tensor(lm_inputs["paged_kv_indices"]),
                                               torch.tensor(lm_inputs["paged_kv_last_page_len"]))
        logits = self.model.forward(input_ids, position_ids, self.prefill_wrapper_no_cudagraph, self.kv_cache)
        logits = logits[qo_indptr_tensor[1:].to(self.device) - 1]          # last token of each request
        return logits.clone()

    def _finish(self, requests, logits):
        output_ids = self.model.sampling(logits, requests)
        for req in requests:                                  # the requests end here: their pages go back
            for page in req.kv_pages:
                self.empty_pages.put(page)
        return [logits[:, 0], output_ids.to(DTYPE)]


# --- worker/cuda_graph_worker.py ----------------------------------------------------------------------------------

class CudaGraphWorker(ModelWorker):
    def __init__(self, model, device, variant):
        super().__init__(model, device)
        self.variant = variant
        self.cuda_graphs_lm_prefill, self.prefill_outputs = {}, {}
        self._prepare_attention_wrappers()
        self._initialize_prefill_cuda_graphs()
        self.kv_cache.zero_()

    def _prepare_attention_wrappers(self):
        self.cuda_graph_batch_sizes = [2 ** i for i in range(int(math.log2(self.max_batch_size)) + 1)][::-1]
        self.cuda_graph_seq_len_buckets = SEQ_LEN_BUCKETS[::-1]
        self.cuda_graph_pool = graph_pool_handle(self.device)
        self.qo_indptr_buffer = torch.zeros(self.max_batch_size + 1, dtype=torch.long, device=self.device)
        self.prefill_wrappers = {}
        for seq_len in self.cuda_graph_seq_len_buckets:       # use only the maximum batch size for prefill
            key = (self.max_batch_size, seq_len)
            self.prefill_wrappers[key] = FlashInferPrefillWrapper(
                N_HEADS, HIDDEN, self.page_size, batch_size=self.max_batch_size, max_seq_len=seq_len,
                device=self.device, qo_indptr_buffer=self.qo_indptr_buffer, use_cuda_graph=True)

    def _initialize_prefill_cuda_graphs(self):
        max_seq_len = max(self.cuda_graph_seq_len_buckets)
        self.cuda_graph_buffers = {
            "prefill_input_ids": torch.zeros(max_seq_len, self.model.n_codebooks, dtype=torch.long,
                                             device=self.device),
            "prefill_position_ids": torch.zeros(max_seq_len, dtype=torch.long, device=self.device),
            "prefill_logits": torch.zeros(max_seq_len, 1, VOCAB, dtype=DTYPE, device=self.device)}
        buf = self.cuda_graph_buffers
        for seq_len in self.cuda_graph_seq_len_buckets:
            batch_size = self.max_batch_size
            key = (batch_size, seq_len)
            seq_len_per_batch = seq_len // batch_size
            pages_per_batch = max(1, seq_len_per_batch // self.page_size)
            wrapper = self.prefill_wrappers[key]
            wrapper.plan(torch.arange(batch_size + 1) * seq_len_per_batch,
                         torch.arange(batch_size + 1) * pages_per_batch,
                         torch.arange(self.max_num_pages), torch.zeros(batch_size, dtype=torch.long))

            def step(key=key, seq_len=seq_len):
                logits_output = self.model.forward(buf["prefill_input_ids"][:seq_len],
                                                   buf["prefill_position_ids"][:seq_len],
                                                   self.prefill_wrappers[key], self.kv_cache)
                buf["prefill_logits"][:seq_len].copy_(logits_output)
                return buf["prefill_logits"][:seq_len]

            self.cuda_graphs_lm_prefill[key], self.prefill_outputs[key] = capture(
                step, device=self.device, pool=self.cuda_graph_pool, warmups=2, name=f"prefill {key}",
                owner="CudaGraphWorker (prefill)",
                static={"prefill_input_ids": buf["prefill_input_ids"],
                        "prefill_position_ids": buf["prefill_position_ids"],
                        "qo_indptr_buf": self.qo_indptr_buffer,
                        "token_to_page": wrapper.token_to_page, "token_to_cache": wrapper.token_to_cache},
                state={"kv_cache": self.kv_cache})

    def _get_cuda_graph_seq_len(self, actual_seq_len):
        for seq_len in sorted(self.cuda_graph_seq_len_buckets):
            if seq_len >= actual_seq_len:
                return seq_len
        return None                                           # fall back to the regular forward

    def _get_prefill_cuda_graph_key(self, batch_size, seq_len):
        padded_batch_size = self.max_batch_size               # for prefill, we always use max batch size
        if self.variant == "fix":
            # considering the padding tokens to match max batch size
            padded_seq_len = self._get_cuda_graph_seq_len(seq_len + (padded_batch_size - batch_size))
        else:
            padded_seq_len = self._get_cuda_graph_seq_len(seq_len)
        if padded_seq_len is None:
            return None
        key = (padded_batch_size, padded_seq_len)
        if key in self.cuda_graphs_lm_prefill:
            return key
        for batch_sz in sorted(self.cuda_graph_batch_sizes):  # best available batch size for this seq len
            test_key = (batch_sz, padded_seq_len)
            if padded_batch_size <= batch_sz <= padded_seq_len and test_key in self.cuda_graphs_lm_prefill:
                return test_key
        return None

    def run_lm_prefill(self, requests):
        lm_inputs = self._prepare_lm_inputs(requests)
        actual_batch_size, actual_seq_len = len(requests), len(lm_inputs["input_ids"])
        if self._get_prefill_cuda_graph_key(actual_batch_size, actual_seq_len) is not None:
            logits = self._run_lm_prefill_with_cuda_graph(requests, lm_inputs)
        else:
            logits = self._run_lm_prefill_fallback(requests, lm_inputs)
        return self._finish(requests, logits)

    def _run_lm_prefill_with_cuda_graph(self, requests, lm_inputs):
        """Run prefill using CUDA graphs with padding."""
        qo_indptr, paged_kv_indptr = lm_inputs["qo_indptr"], lm_inputs["paged_kv_indptr"]
        paged_kv_indices, paged_kv_last_page_len = lm_inputs["paged_kv_indices"], lm_inputs["paged_kv_last_page_len"]
        input_ids, position_ids = lm_inputs["input_ids"], lm_inputs["position_ids"]
        actual_batch_size, actual_seq_len = len(requests), len(input_ids)

        graph_key = self._get_prefill_cuda_graph_key(actual_batch_size, actual_seq_len)
        if graph_key is None:
            raise RuntimeError("No suitable prefill CUDA graph found")
        padded_batch_size, padded_seq_len = graph_key

        if actual_seq_len < padded_seq_len:                   # pad input tensors by repeating the last element
            seq_padding_size = padded_seq_len - actual_seq_len
            input_ids.extend([input_ids[-1]] * seq_padding_size)
            position_ids.extend([position_ids[-1]] * seq_padding_size)

        # pad batch size: temporary pages for the padded requests, released right after the replay
        temporaly_pages_to_allocate = [self.empty_pages.get_nowait() for _ in range(padded_batch_size -
                                                                                      actual_batch_size)]
        for i in range(padded_batch_size - actual_batch_size):
            qo_indptr.append(qo_indptr[-1] + 1)
            paged_kv_indptr.append(paged_kv_indptr[-1] + 1)
            paged_kv_indices.append(temporaly_pages_to_allocate[i])
            paged_kv_last_page_len.append(1)

        self.prefill_wrappers[graph_key].plan(torch.tensor(qo_indptr), torch.tensor(paged_kv_indptr),
                                              torch.tensor(paged_kv_indices), torch.tensor(paged_kv_last_page_len))
        buf = self.cuda_graph_buffers
        buf["prefill_input_ids"][:padded_seq_len].copy_(torch.tensor(input_ids, device=self.device))
        buf["prefill_position_ids"][:padded_seq_len].copy_(torch.tensor(position_ids, device=self.device))
        logits = replay(self.cuda_graphs_lm_prefill[graph_key], self.prefill_outputs[graph_key],
                        real=actual_seq_len, size=padded_seq_len)
        actual_qo_indptr = torch.tensor(qo_indptr[:actual_batch_size + 1], device=self.device)
        logits = logits[actual_qo_indptr[1:] - 1].clone()
        for temporaly_page in temporaly_pages_to_allocate:    # release the temporary pages
            self.empty_pages.put(temporaly_page)
        return logits


def _requests():
    gen = generator(1997)
    return [[Request(torch.randint(0, VOCAB, (n,), generator=gen).tolist()) for n in lengths]
            for lengths in PROMPT_LENGTHS]


def run(variant: str, device: str = "cpu"):
    model = OrpheusModel(device)

    def serve():
        worker = CudaGraphWorker(model, device, variant)
        return [t for batch in _requests() for t in worker.run_lm_prefill(batch)]

    def eager():
        worker = ModelWorker(model, device)
        return [t for batch in _requests() for t in worker.run_lm_prefill(batch)]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, serve, eager)
