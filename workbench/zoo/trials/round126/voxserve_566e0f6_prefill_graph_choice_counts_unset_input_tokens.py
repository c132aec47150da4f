"""VoxServe ``CudaGraphWorker`` prefill: the graph-or-eager decision counts ``req.input_tokens`` before the step's preprocessing has set them, so every fresh prefill is sent to a captured prefill graph, also one longer than the largest captured sequence bucket.

Upstream: https://github.com/vox-serve/vox-serve/commit/566e0f6e7cd33939c2273ed984807ee623a2930c ("fix: token
count in deciding cuda grpah vs fallback", vox-serve/vox-serve, Keisuke Kamahori, commit on ``main`` 2025-08-26,
no PR). Read: the commit's diff of ``vox-serve/worker/cuda_graph_worker.py`` (``_can_use_prefill_cuda_graph``
removed; ``run_lm_prefill`` now calls ``_prepare_lm_inputs`` first and asks ``_get_prefill_cuda_graph_key`` with
``len(lm_inputs["input_ids"])``; ``_run_lm_prefill_with_cuda_graph`` / ``_run_lm_prefill_fallback`` take the prepared
``lm_inputs``), and at its parent commit ``cuda_graph_worker.py`` whole (``_prepare_attention_wrappers``,
``_initialize_prefill_cuda_graphs``, ``_get_cuda_graph_batch_size``, ``_get_cuda_graph_seq_len``,
``_get_prefill_cuda_graph_key``, the three prefill methods), ``worker/base.py`` (``ModelWorker.__init__``,
``_prepare_attention_wrappers``, ``_prepare_lm_inputs``, ``run_lm_prefill``), ``requests.py`` (``Request``,
``input_tokens: ... = None``), ``flashinfer_utils.py`` (``FlashInferPrefillWrapper.plan`` / ``set_kv_cache`` /
``run``) and ``model/orpheus.py`` (``_orpheus_format_prompt``, ``preprocess``, ``OrpheusAttention.forward``).
Not read: an issue or a log of the failure (the commit message is the only description).
Symptom: as the code implies (and as modelled): with ``--cuda-graph`` on, a prefill whose prompt tokenises to more
tokens than the largest captured bucket (256) fails with ``RuntimeError: No suitable prefill CUDA graph found``
instead of running eagerly; shorter prompts are served by the graphs. The eager worker serves every prompt.
Mechanism: ``ModelWorker._prepare_lm_inputs`` is where a new request is tokenised (``req.input_tokens =
self.model.preprocess(...).input_tokens``); before it runs, ``input_tokens`` is the dataclass default ``None``.
``_can_use_prefill_cuda_graph`` sums ``len(req.input_tokens)`` only over requests whose ``input_tokens`` is set, so
for a batch of new requests the total is 0, ``_get_cuda_graph_seq_len(0)`` gives the 256 bucket and the graph path is
chosen whatever the prompt's length. ``_run_lm_prefill_with_cuda_graph`` then prepares the inputs, finds no bucket
for the real token count and raises. Eager (``ModelWorker``) has no bucket to fit.
Doctor: undersized-buffer, at _can_use_prefill_cuda_graph. The graph route is taken for a prefill with more token
rows than any captured graph holds because this function sizes the step from ``input_tokens`` that are not set yet;
the upstream fix deletes it and decides on ``len(lm_inputs["input_ids"])`` in ``run_lm_prefill``.
Fix (upstream): ``run_lm_prefill`` calls ``_prepare_lm_inputs(requests)`` first, takes ``actual_seq_len =
len(lm_inputs["input_ids"])`` and routes to the graph only if ``_get_prefill_cuda_graph_key(actual_batch_size,
actual_seq_len)`` finds one, else to ``_run_lm_prefill_fallback`` (eager); both take ``lm_inputs``.
Modelled: ``Request`` (the fields used), ``OrpheusModel.preprocess`` (``voice: prompt`` between the start token and
the four end tokens, one codebook) and ``forward``; ``FlashInferPrefillWrapper`` (``plan`` with the upstream
``token_to_page`` / ``token_to_cache`` computation, static buffers of ``max_seq_len`` in graph mode and -1 past the
planned tokens, ``set_kv_cache``, ``run``); ``ModelWorker`` (page queue, paged KV cache, ``_prepare_lm_inputs``,
eager ``run_lm_prefill``); ``CudaGraphWorker`` (``cuda_graph_batch_sizes`` = powers of two up to
``max_batch_size``, ``cuda_graph_seq_len_buckets = [256]``, one shared pool, one prefill graph per
``(batch_size, 256)`` captured after five warmup forwards planned as upstream, ``kv_cache.zero_()`` after capture,
sequence padding by repeating the last token, batch padding with one-token dummy requests on temporary pages, the
copy into the static buffers, replay, last-token selection). Stand-ins: a one-layer, two-head Llama block (RMSNorm,
rotary positions, SiLU MLP) over a 40-symbol character vocabulary, float64 instead of bfloat16; FlashInfer's paged
prefill attention is a dense masked attention of each token over the K/V that this step wrote for its own request
(requests start from an empty cache, so this is what the paged kernel reads); ``run`` takes the request boundaries
from the wrapper's ``qo_indptr`` buffer. Not modelled: decode, detokenizer and depth graphs, sampling parameters
(greedy), watermarking, NVTX; and the parent commit's wrappers received ``paged_kv_indptr_buffer`` as their
``qo_indptr_buffer`` too (a separate defect, fixed later in 9870966): the model gives each its own buffer.
Workload: ``max_batch_size`` 4, 48 KV pages of 16 tokens, graphs for batch sizes 4, 2, 1 at 256 tokens. Step 1: two
new requests (23 and 29 tokens: graph (2, 256)); step 2: three new requests (24, 30, 24 tokens: graph (4, 256), one
dummy); step 3: one request whose prompt tokenises to 325 tokens; step 4: one short request (30 tokens). Outputs:
each step's last-token logits.
Measured: bug: steps 1-2 replay their graphs and equal eager (max 3.0e-15); step 3 raises ``RuntimeError: No
suitable prefill CUDA graph found``. Fix: step 3 runs eagerly (325 tokens), step 4 replays graph (1, 256); all four
steps equal eager (max |graph - eager| = 3.0e-15: float64 rounding of 256-row against unpadded matmuls; 0 at the
eager step 3).
"""
from __future__ import annotations

import dataclasses
import math
import queue
from typing import Dict, List

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vox-serve/vox-serve/commit/566e0f6e7cd33939c2273ed984807ee623a2930c"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_can_use_prefill_cuda_graph"
SYMPTOM = ("VoxServe with CUDA graphs: the prefill graph-or-eager decision counts input_tokens before they are set, "
           "so a prompt longer than the 256-token graph bucket is routed to the graphs and fails instead of running "
           "eagerly")

CHARS = " abcdefghijklmnopqrstuvwxyz.,:?!'-"
START_TOKEN, END_TOKENS = 1, [2, 3, 4, 5]
VOCAB = 6 + len(CHARS)
HIDDEN, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, INTERMEDIATE = 16, 2, 2, 1, 32
HEAD_DIM = HIDDEN // NUM_HEADS
MAX_BATCH_SIZE, MAX_NUM_PAGES, PAGE_SIZE = 4, 48, 16
DTYPE = torch.float64

_variant = "bug"


# --- vox-serve/requests.py (reduced) ----------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str = None
    next_position_id: int = None
    kv_pages: List[int] = None
    kv_token_len: int = None
    kv_last_page_len: int = None
    # input prompt tokens. shape: (seq_len, n_codebooks)
    input_tokens: List[List[int]] = None
    lm_output_tokens: List[List[int]] = dataclasses.field(default_factory=list)
    done_lm_prefill: bool = False


@dataclasses.dataclass
class PreprocessOutput:
    input_tokens: List[List[int]]


# --- vox-serve/flashinfer_utils.py (reduced; the FlashInfer kernels are a dense masked attention) ---------------------

class FlashInferPrefillWrapper:
    def __init__(self, n_qo_head, n_kv_head, n_state, page_size, batch_size=None, max_seq_len=None, device="cpu",
                 qo_indptr_buffer=None, use_cuda_graph=False):
        self.device = device
        self.use_cuda_graph = use_cuda_graph
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        if self.use_cuda_graph:
            assert self.batch_size is not None, "batch_size must be specified for cuda graph optimization"
            assert max_seq_len is not None, "max_seq_len must be specified for cuda graph optimization"
            self.qo_indptr_buf = qo_indptr_buffer
            self.token_to_page = torch.zeros(max_seq_len, dtype=torch.long, device=device)
            self.token_to_cache = torch.zeros(max_seq_len, dtype=torch.long, device=device)
        self.n_qo_head, self.n_kv_head, self.n_state = n_qo_head, n_kv_head, n_state
        self.head_dim = n_state // n_qo_head
        self.page_size = page_size

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=torch.float16):
        if self.use_cuda_graph:          # BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True).plan
            self.qo_indptr_buf.copy_(qo_indptr.to(self.device))
        else:
            self.qo_indptr_buf = qo_indptr.to(self.device)
        self.qo_indptr = qo_indptr
        self.paged_kv_indptr = paged_kv_indptr
        self.paged_kv_indices = paged_kv_indices
        self.paged_kv_last_page_len = paged_kv_last_page_len

        n_req = qo_indptr.shape[0] - 1
        starts = qo_indptr[:-1].to(torch.int32)
        lens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int32)
        total_tokens = int(lens.sum().item())
        num_pages_after = (paged_kv_indptr[1:] - paged_kv_indptr[:-1]).to(torch.int32)
        kv_len_after = (num_pages_after - 1) * self.page_size + paged_kv_last_page_len
        seg = torch.repeat_interleave(torch.arange(n_req, dtype=torch.int32), lens)
        intra = torch.arange(total_tokens, dtype=torch.int32) - torch.repeat_interleave(starts, lens)
        start_new = kv_len_after[seg] - lens[seg]
        g = start_new + intra
        page_off = torch.div(g, self.page_size, rounding_mode="floor").to(torch.int32)
        off_in_page = (g - page_off * self.page_size).to(torch.int32)
        abs_page_ptr = (paged_kv_indptr[:-1])[seg] + page_off
        if self.use_cuda_graph:
            self.token_to_page[:total_tokens] = paged_kv_indices[abs_page_ptr].to(self.device)
            self.token_to_cache[:total_tokens] = off_in_page.to(self.device)
            self.token_to_page[total_tokens:] = -1
            self.token_to_cache[total_tokens:] = -1
        else:
            self.token_to_page = paged_kv_indices[abs_page_ptr].to(self.device).long()
            self.token_to_cache = off_in_page.to(self.device).long()

    def run(self, q, kv_cache):
        """Causal prefill attention of each token over its own request's K/V written this step."""
        n_tok = q.shape[0]
        tok = torch.arange(n_tok, device=q.device)
        seg = torch.searchsorted(self.qo_indptr_buf[1:].long(), tok, right=True)
        k = kv_cache[self.token_to_page, 0, self.token_to_cache]
        v = kv_cache[self.token_to_page, 1, self.token_to_cache]
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(self.head_dim)
        allowed = (seg[:, None] == seg[None, :]) & (tok[None, :] <= tok[:, None])
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", probs, v)

    def set_kv_cache(self, kv_cache, k, v):
        page_idx = self.token_to_page
        cache_idx = self.token_to_cache
        kv_cache[page_idx, 0, cache_idx] = k
        kv_cache[page_idx, 1, cache_idx] = v


# --- vox-serve/model/orpheus.py (reduced) -----------------------------------------------------------------------------

def _rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x, pos):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE, device=x.device) / HEAD_DIM))
    ang = pos.to(DTYPE)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class OrpheusModel:
    n_codebooks = 1
    num_attention_heads, num_key_value_heads = NUM_HEADS, NUM_KV_HEADS
    num_hidden_layers, hidden_size, vocab_size = NUM_LAYERS, HIDDEN, VOCAB
    has_depth_transformer = False
    needs_input_features = needs_input_masks = False

    def __init__(self, device):
        gen = generator(566)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.layers = [dict(ln1=1.0 + r(HIDDEN, scale=0.1), q=r(HIDDEN, HIDDEN), k=r(HIDDEN, HIDDEN),
                            v=r(HIDDEN, HIDDEN), o=r(HIDDEN, HIDDEN), ln2=1.0 + r(HIDDEN, scale=0.1),
                            gate=r(HIDDEN, INTERMEDIATE), up=r(HIDDEN, INTERMEDIATE), down=r(INTERMEDIATE, HIDDEN))
                       for _ in range(NUM_LAYERS)]
        self.norm = 1.0 + r(HIDDEN, scale=0.1)
        self.lm_head = r(HIDDEN, VOCAB, scale=1.0)

    def _text_tokenizer(self, text):
        return [6 + CHARS.index(c) for c in text.lower()]

    def _orpheus_format_prompt(self, prompt, voice="tara"):
        adapted_prompt = f"{voice}: {prompt}"
        return [START_TOKEN] + self._text_tokenizer(adapted_prompt) + END_TOKENS

    def preprocess(self, prompt=None, voice="tara"):
        input_ids = self._orpheus_format_prompt(prompt, voice)
        return PreprocessOutput(input_tokens=[[t] for t in input_ids])        # add codebook dimension

    def forward(self, input_ids, position_ids, attn_wrapper, kv_cache, **kwargs):
        h = self.embed_tokens[input_ids[:, 0].long()]                            # remove codebook dimension
        for i, w in enumerate(self.layers):
            x = _rms_norm(h, w["ln1"])
            q = _rope((x @ w["q"]).view(-1, NUM_HEADS, HEAD_DIM), position_ids)
            k = _rope((x @ w["k"]).view(-1, NUM_KV_HEADS, HEAD_DIM), position_ids)
            v = (x @ w["v"]).view(-1, NUM_KV_HEADS, HEAD_DIM)
            attn_wrapper.set_kv_cache(kv_cache[i], k, v)
            h = h + attn_wrapper.run(q, kv_cache[i]).reshape(-1, HIDDEN) @ w["o"]
            x = _rms_norm(h, w["ln2"])
            h = h + (torch.nn.functional.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]
        logits = _rms_norm(h, self.norm) @ self.lm_head
        return logits[:, None, :]                                                 # add codebook dimension

    def sampling(self, logits, requests):
        output_ids = logits[:, 0, :].argmax(dim=-1)
        for req, tok in zip(requests, output_ids.tolist()):
            req.lm_output_tokens.append([tok])
        return output_ids


# --- vox-serve/worker/base.py (reduced) -------------------------------------------------------------------------------

class ModelWorker:
    def __init__(self, device, max_batch_size=MAX_BATCH_SIZE, max_num_pages=MAX_NUM_PAGES, page_size=PAGE_SIZE):
        self.model = OrpheusModel(device)
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_num_pages = max_num_pages
        self.page_size = page_size
        self.empty_pages = queue.Queue()
        for i in range(self.max_num_pages):
            self.empty_pages.put(i)
        self._prepare_attention_wrappers()

    def _make_kv_cache(self):
        return torch.zeros(self.model.num_hidden_layers, self.max_num_pages, 2, self.page_size,
                           self.model.num_key_value_heads, self.model.hidden_size // self.model.num_attention_heads,
                           dtype=DTYPE, device=self.device)

    def _prepare_attention_wrappers(self):
        self.prefill_wrapper = FlashInferPrefillWrapper(
            n_qo_head=self.model.num_attention_heads, n_kv_head=self.model.num_key_value_heads,
            n_state=self.model.hidden_size, page_size=self.page_size, device=self.device, use_cuda_graph=False)
        self.kv_cache = self._make_kv_cache()
        self.has_depth_transformer = self.model.has_depth_transformer

    def _prepare_lm_inputs(self, requests: List[Request]):
        qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len = [0], [0], [], []
        input_ids, position_ids, input_features, input_masks = [], [], [], []
        for req in requests:
            assert not req.done_lm_prefill                      # prefill requests only in this reduction
            preprocess_output = self.model.preprocess(prompt=req.prompt)
            req.input_tokens = preprocess_output.input_tokens
            input_features.append(None)
            input_masks.append(None)
            n_pages_to_allocate = (len(req.input_tokens) + self.page_size - 1) // self.page_size
            req.kv_token_len = len(req.input_tokens)
            req.kv_pages = [self.empty_pages.get_nowait() for _ in range(n_pages_to_allocate)]
            req.kv_last_page_len = len(req.input_tokens) % self.page_size
            if req.kv_last_page_len == 0:
                req.kv_last_page_len = self.page_size
            qo_indptr.append(qo_indptr[-1] + len(req.input_tokens))
            paged_kv_indptr.append(paged_kv_indptr[-1] + len(req.kv_pages))
            paged_kv_indices.extend(req.kv_pages)
            paged_kv_last_page_len.append(req.kv_last_page_len)
            input_ids.extend(req.input_tokens)
            position_ids.extend([i for i in range(len(req.input_tokens))])
            req.next_position_id = len(req.input_tokens) + 1
            req.done_lm_prefill = True
        return {"qo_indptr": qo_indptr, "paged_kv_indptr": paged_kv_indptr, "paged_kv_indices": paged_kv_indices,
                "paged_kv_last_page_len": paged_kv_last_page_len, "input_ids": input_ids,
                "position_ids": position_ids, "input_features": input_features, "input_masks": input_masks}

    def _run_eager_prefill(self, requests, lm_inputs, wrapper):
        input_ids = torch.tensor(lm_inputs["input_ids"], device=self.device, dtype=torch.int32)
        position_ids = torch.tensor(lm_inputs["position_ids"], device=self.device, dtype=torch.int32)
        qo_indptr_tensor = torch.tensor(lm_inputs["qo_indptr"], dtype=torch.int32)
        wrapper.plan(qo_indptr_tensor, torch.tensor(lm_inputs["paged_kv_indptr"], dtype=torch.int32),
                     torch.tensor(lm_inputs["paged_kv_indices"], dtype=torch.int32),
                     torch.tensor(lm_inputs["paged_kv_last_page_len"], dtype=torch.int32), DTYPE)
        logits = self.model.forward(input_ids=input_ids, position_ids=position_ids, attn_wrapper=wrapper,
                                    kv_cache=self.kv_cache, input_features=None, input_masks=None)
        # select last token for each request for prefill
        logits = logits[qo_indptr_tensor[1:].long().to(self.device) - 1]
        self.model.sampling(logits=logits, requests=requests)
        return logits

    def run_lm_prefill(self, requests: List[Request]):
        lm_inputs = self._prepare_lm_inputs(requests)
        return self._run_eager_prefill(requests, lm_inputs, self.prefill_wrapper)


# --- vox-serve/worker/cuda_graph_worker.py (parent of 566e0f6, reduced to the prefill graphs) -------------------------

class CudaGraphWorker(ModelWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cuda_graphs_lm_prefill: Dict[tuple, object] = {}
        self.cuda_graph_outputs: Dict[tuple, torch.Tensor] = {}
        self.cuda_graph_buffers: Dict[str, torch.Tensor] = {}
        self._initialize_prefill_cuda_graphs()
        self.kv_cache.zero_()

    def _prepare_attention_wrappers(self):
        self.cuda_graph_batch_sizes = [2 ** i for i in range(int(math.log2(self.max_batch_size)) + 1)][::-1]
        self.cuda_graph_seq_len_buckets = [256][::-1]
        self.cuda_graph_pool = graph_pool_handle(self.device)
        self.qo_indptr_buffer = torch.zeros(self.max_batch_size + 1, dtype=torch.int32, device=self.device)
        self.prefill_wrappers = {}
        for seq_len in self.cuda_graph_seq_len_buckets:
            for batch_size in self.cuda_graph_batch_sizes:
                if batch_size <= seq_len and seq_len % batch_size == 0:
                    key = (batch_size, seq_len)
                    self.prefill_wrappers[key] = FlashInferPrefillWrapper(
                        n_qo_head=self.model.num_attention_heads, n_kv_head=self.model.num_key_value_heads,
                        n_state=self.model.hidden_size, page_size=self.page_size, batch_size=batch_size,
                        max_seq_len=seq_len, device=self.device,
                        qo_indptr_buffer=self.qo_indptr_buffer[: batch_size + 1], use_cuda_graph=True)
        self.kv_cache = self._make_kv_cache()
        self.has_depth_transformer = self.model.has_depth_transformer

    def _initialize_prefill_cuda_graphs(self):
        max_seq_len = max(self.cuda_graph_seq_len_buckets)
        self.cuda_graph_buffers.update({
            "prefill_input_ids": torch.zeros(max_seq_len, self.model.n_codebooks, dtype=torch.int32,
                                             device=self.device),
            "prefill_position_ids": torch.zeros(max_seq_len, dtype=torch.int32, device=self.device),
            "prefill_logits": torch.zeros(max_seq_len, self.model.n_codebooks, self.model.vocab_size, dtype=DTYPE,
                                          device=self.device),
        })
        # Prefill wrapper without CUDA graph for fallback
        self.prefill_wrapper_no_cudagraph = FlashInferPrefillWrapper(
            n_qo_head=self.model.num_attention_heads, n_kv_head=self.model.num_key_value_heads,
            n_state=self.model.hidden_size, page_size=self.page_size, device=self.device, use_cuda_graph=False)

        for seq_len in self.cuda_graph_seq_len_buckets:
            for batch_size in self.cuda_graph_batch_sizes:
                if batch_size <= seq_len and seq_len % batch_size == 0:
                    key = (batch_size, seq_len)
                    seq_len_per_batch = seq_len // batch_size
                    qo_indptr = torch.arange(batch_size + 1, dtype=torch.int32) * seq_len_per_batch
                    pages_per_batch = max(1, seq_len_per_batch // self.page_size)
                    paged_kv_indptr = torch.arange(batch_size + 1, dtype=torch.int32) * pages_per_batch
                    paged_kv_indices = torch.arange(self.max_num_pages, dtype=torch.int32)
                    paged_kv_last_page_len = torch.zeros(batch_size, dtype=torch.int32)
                    wrapper = self.prefill_wrappers[key]
                    wrapper.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, DTYPE)

                    def prefill_step(seq_len=seq_len, wrapper=wrapper):
                        logits_output = self.model.forward(
                            input_ids=self.cuda_graph_buffers["prefill_input_ids"][:seq_len],
                            position_ids=self.cuda_graph_buffers["prefill_position_ids"][:seq_len],
                            attn_wrapper=wrapper, kv_cache=self.kv_cache, input_features=None, input_masks=None)
                        self.cuda_graph_buffers["prefill_logits"][:seq_len].copy_(logits_output)
                        return self.cuda_graph_buffers["prefill_logits"][:seq_len]

                    static = {"prefill_input_ids": self.cuda_graph_buffers["prefill_input_ids"],
                              "prefill_position_ids": self.cuda_graph_buffers["prefill_position_ids"],
                              f"qo_indptr_buf[{batch_size}]": wrapper.qo_indptr_buf,
                              f"token_to_page[{key}]": wrapper.token_to_page,
                              f"token_to_cache[{key}]": wrapper.token_to_cache}
                    graph, out = capture(prefill_step, device=self.device, pool=self.cuda_graph_pool, warmups=5,
                                         static=static, state={"kv_cache": self.kv_cache}, owner="CudaGraphWorker",
                                         name=f"prefill bs={batch_size} seq_len={seq_len}")
                    self.cuda_graphs_lm_prefill[key] = graph
                    self.cuda_graph_outputs[key] = out

    def _get_cuda_graph_batch_size(self, actual_batch_size: int) -> int:
        for batch_size in sorted(self.cuda_graph_batch_sizes):
            if batch_size >= actual_batch_size:
                return batch_size
        return max(self.cuda_graph_batch_sizes)

    def _get_cuda_graph_seq_len(self, actual_seq_len: int):
        for seq_len in sorted(self.cuda_graph_seq_len_buckets):
            if seq_len >= actual_seq_len:
                return seq_len
        return None

    def _get_prefill_cuda_graph_key(self, batch_size: int, seq_len: int):
        padded_batch_size = self._get_cuda_graph_batch_size(batch_size)
        padded_seq_len = self._get_cuda_graph_seq_len(seq_len)
        if padded_seq_len is None:
            return None
        key = (padded_batch_size, padded_seq_len)
        if key in self.cuda_graphs_lm_prefill:
            return key
        for batch_sz in sorted(self.cuda_graph_batch_sizes):
            if batch_sz >= padded_batch_size and batch_sz <= padded_seq_len:
                test_key = (batch_sz, padded_seq_len)
                if test_key in self.cuda_graphs_lm_prefill:
                    return test_key
        return None

    def _can_use_prefill_cuda_graph(self, requests: List[Request]) -> bool:
        """Check if we can use CUDA graphs for the current prefill batch."""
        if not requests:
            return False
        batch_size = len(requests)
        total_seq_len = sum(
            len(req.input_tokens)
            for req in requests if hasattr(req, "input_tokens") and req.input_tokens
        )
        return self._get_prefill_cuda_graph_key(batch_size, total_seq_len) is not None

    def run_lm_prefill(self, requests: List[Request]):
        if _variant == "bug":
            if self._can_use_prefill_cuda_graph(requests):
                return self._run_lm_prefill_with_cuda_graph(requests)
            return self._run_lm_prefill_fallback(requests)
        lm_inputs = self._prepare_lm_inputs(requests)
        actual_batch_size = len(requests)
        actual_seq_len = len(lm_inputs["input_ids"])
        if self._get_prefill_cuda_graph_key(actual_batch_size, actual_seq_len) is not None:
            return self._run_lm_prefill_with_cuda_graph(requests, lm_inputs)
        return self._run_lm_prefill_fallback(requests, lm_inputs)

    def _run_lm_prefill_with_cuda_graph(self, requests: List[Request], lm_inputs=None):
        if lm_inputs is None:
            lm_inputs = self._prepare_lm_inputs(requests)
        qo_indptr = lm_inputs["qo_indptr"]
        paged_kv_indptr = lm_inputs["paged_kv_indptr"]
        paged_kv_indices = lm_inputs["paged_kv_indices"]
        paged_kv_last_page_len = lm_inputs["paged_kv_last_page_len"]
        input_ids = lm_inputs["input_ids"]
        position_ids = lm_inputs["position_ids"]

        actual_batch_size = len(requests)
        actual_seq_len = len(input_ids)
        graph_key = self._get_prefill_cuda_graph_key(actual_batch_size, actual_seq_len)
        if graph_key is None:
            raise RuntimeError("No suitable prefill CUDA graph found")
        padded_batch_size, padded_seq_len = graph_key

        # Pad sequence length if needed: repeat the last element
        if actual_seq_len < padded_seq_len:
            seq_padding_size = padded_seq_len - actual_seq_len
            input_ids.extend([input_ids[-1]] * seq_padding_size)
            position_ids.extend([position_ids[-1]] * seq_padding_size)

        # Pad batch size if needed: one-token dummy requests on temporarily allocated pages
        temporaly_pages_to_allocate = [self.empty_pages.get_nowait()
                                       for _ in range(padded_batch_size - actual_batch_size)]
        for i in range(padded_batch_size - actual_batch_size):
            qo_indptr.append(qo_indptr[-1] + 1)
            paged_kv_indptr.append(paged_kv_indptr[-1] + 1)
            paged_kv_indices.append(temporaly_pages_to_allocate[i])
            paged_kv_last_page_len.append(1)

        qo_indptr_tensor = torch.tensor(qo_indptr, dtype=torch.int32)
        self.prefill_wrappers[graph_key].plan(
            qo_indptr_tensor, torch.tensor(paged_kv_indptr, dtype=torch.int32),
            torch.tensor(paged_kv_indices, dtype=torch.int32), torch.tensor(paged_kv_last_page_len, dtype=torch.int32),
            DTYPE)
        graph = self.cuda_graphs_lm_prefill[graph_key]

        # Copy inputs to CUDA graph buffers
        self.cuda_graph_buffers["prefill_input_ids"][:padded_seq_len].copy_(
            torch.tensor(input_ids, dtype=torch.int32).to(self.device))
        self.cuda_graph_buffers["prefill_position_ids"][:padded_seq_len].copy_(
            torch.tensor(position_ids, dtype=torch.int32).to(self.device))

        logits = replay(graph, self.cuda_graph_outputs[graph_key], real=actual_seq_len, size=padded_seq_len)

        # Extract logits for the actual batch size - the last token of each actual request
        actual_qo_indptr = torch.tensor([qo_indptr[i] for i in range(actual_batch_size + 1)],
                                        dtype=torch.int32).to(self.device)
        logits = logits[actual_qo_indptr[1:].long() - 1]

        for temporaly_page in temporaly_pages_to_allocate:
            self.empty_pages.put(temporaly_page)
        self.model.sampling(logits=logits, requests=requests)
        return logits

    def _run_lm_prefill_fallback(self, requests: List[Request], lm_inputs=None):
        if lm_inputs is None:
            lm_inputs = self._prepare_lm_inputs(requests)
        return self._run_eager_prefill(requests, lm_inputs, self.prefill_wrapper_no_cudagraph)


# --- the scheduler's prefill calls (reduced) --------------------------------------------------------------------------

LONG_TEXT = ("once upon a time, in a quiet village by the sea, there lived an old clockmaker who repaired every "
             "broken clock in town. each morning he opened his small shop, wound the tall clock by the door, and "
             "listened to the gulls. one winter a girl brought him a silver watch that had stopped at midnight, "
             "and he worked on it")

STEPS = [
    ["hello there.", "how are you today?"],
    ["good morning!", "it's raining again.", "see you soon."],
    [LONG_TEXT],
    ["thank you, goodbye."],
]


def _serve(device, use_cuda_graph):
    worker = CudaGraphWorker(device) if use_cuda_graph else ModelWorker(device)
    outs, n = [], 0
    for prompts in STEPS:
        requests = []
        for p in prompts:
            requests.append(Request(request_id=f"req-{n}", prompt=p))
            n += 1
        outs.append(worker.run_lm_prefill(requests).clone())
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
