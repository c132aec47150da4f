"""The prefill graph's ``qo_indptr`` static buffer is a view of the ``paged_kv_indptr`` one: plan() clobbers it.

Upstream: https://github.com/vox-serve/vox-serve/commit/9870966cee01b8ef992277a94e27a4d6016b9e34
("fix: accuracy of cuda graph worker"; a direct commit on main, no PR; whole diff read, with
``flashinfer_utils.py`` at that commit and flashinfer's ``BatchPrefillWithPagedKVCacheWrapper.plan``).
Symptom: wrong (inaccurate) outputs from the CUDA-graph worker, per the commit title; the eager fallback
(``prefill_wrapper_no_cudagraph``) was correct.
Mechanism: ``CudaGraphWorker._prepare_attention_wrappers`` built each graph-mode ``FlashInferPrefillWrapper``
with ``qo_indptr_buffer=self.paged_kv_indptr_buffer[: batch_size + 1]`` and
``paged_kv_indptr_buffer=self.paged_kv_indptr_buffer[: batch_size + 1]``: flashinfer's
``BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True)`` got one storage as both its ``qo_indptr_buf``
and its ``paged_kv_indptr_buf``. Its ``plan()`` copies ``qo_indptr`` into ``_qo_indptr_buf`` and then
``paged_kv_indptr`` into ``_paged_kv_indptr_buf``, so the second copy overwrites the first: the captured
attention kernel, which reads the buffers by address, segments the queries by cumulative page counts
instead of cumulative token counts. Tokens are attributed to the wrong requests (or to none) and the
logits taken at each request's last token (``qo_indptr[1:] - 1``, from the host copy) are wrong.
The same commit also fixed a second bug, not modelled here: ``run_lm_decode`` padded the batch by
pointing every padded row at the last real request's page and ``last_page_len``, so ``set_kv_cache``
(``kv_cache[token_to_page, 0, token_to_cache] = k``) wrote the padded rows' K/V over that request's newest
KV slot; the fix points padded rows at one scratch page (``tmp_page``) with ``last_page_len = 1``.
Doctor: persistent-mutation, at ``plan`` (the copy of ``paged_kv_indptr`` into its static buffer writes
the ``qo_indptr`` static input that the graph reads; the write is host-issued, before the replay).
Fix (upstream): a separate ``self.qo_indptr_buffer = torch.zeros(max_batch_size + 1, int32)`` passed as
``qo_indptr_buffer=self.qo_indptr_buffer[: batch_size + 1]``.
Sizes are tiny: one attention head, a toy embedding model, batches that fill the captured bucket exactly.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vox-serve/vox-serve/commit/9870966cee01b8ef992277a94e27a4d6016b9e34"
FAMILY = "persistent-buffer mutation"
KIND = "persistent-mutation"
SITE = "plan"
SYMPTOM = "prefill CUDA graph segments queries by page counts (aliased indptr buffers): wrong logits"

VOCAB, DIM, PAGE_SIZE, MAX_NUM_PAGES = 16, 8, 4, 8
MAX_BATCH_SIZE = 2                    # = prefill_graph_batch_size
SEQ_LEN_BUCKET = 8                    # cuda_graph_seq_len_buckets
MAX_PAGES_PER_REQ = 2
MAX_KV = MAX_PAGES_PER_REQ * PAGE_SIZE


class BatchPrefillWithPagedKVCacheWrapper:
    """flashinfer's paged prefill wrapper: in CUDA-graph mode ``plan`` copies into the user's buffers,
    otherwise it keeps fresh device copies; ``run`` reads whatever the buffers hold."""

    def __init__(self, device, use_cuda_graph=False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None):
        self.device, self._use_cuda_graph = device, use_cuda_graph
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._tok = torch.arange(SEQ_LEN_BUCKET, device=device)
        self._kv_pos = torch.arange(MAX_KV, device=device)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size):
        self._page_size = page_size
        if self._use_cuda_graph:
            self._qo_indptr_buf.copy_(qo_indptr)
            self._paged_kv_indptr_buf.copy_(paged_kv_indptr)
            self._paged_kv_last_page_len_buf.copy_(paged_kv_last_page_len)
            self._paged_kv_indices_buf[: len(paged_kv_indices)].copy_(paged_kv_indices)
        else:
            self._qo_indptr_buf = qo_indptr.to(self.device)
            self._paged_kv_indptr_buf = paged_kv_indptr.to(self.device)
            self._paged_kv_indices_buf = paged_kv_indices.to(self.device)
            self._paged_kv_last_page_len_buf = paged_kv_last_page_len.to(self.device)

    def run(self, q, kv_cache):
        """Causal batch prefill over the paged cache (one head); rows past ``qo_indptr[-1]`` give 0."""
        qo, kvp = self._qo_indptr_buf, self._paged_kv_indptr_buf
        indices, last = self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf
        batch, p = qo.shape[0] - 1, self._page_size
        tok = self._tok[: q.shape[0]]
        seg = torch.searchsorted(qo[1:], tok, right=True)              # request of each query row
        valid = seg < batch
        seg = seg.clamp(max=batch - 1)
        qo_len = qo[1:] - qo[:-1]
        kv_len = (kvp[1:] - kvp[:-1] - 1) * p + last
        pos = kv_len[seg] - qo_len[seg] + (tok - qo[seg])                 # causal position of each query
        j = self._kv_pos
        page = indices[(kvp[seg][:, None] + j // p).clamp(0, indices.shape[0] - 1)]
        k, v = kv_cache[page, 0, j % p], kv_cache[page, 1, j % p]        # [rows, MAX_KV, DIM]
        scores = (k @ q[:, :, None]).squeeze(-1) / DIM ** 0.5
        mask = (j[None, :] <= pos[:, None]) & (j[None, :] < kv_len[seg][:, None])
        attn = torch.softmax(scores.masked_fill(~mask, -1e9), -1)
        return (attn[:, :, None] * v).sum(1) * valid[:, None]


class FlashInferPrefillWrapper:
    """vox-serve's wrapper (``flashinfer_utils.py``): plans flashinfer and maps each new token to its
    (page, offset) for ``set_kv_cache``."""

    def __init__(self, device, page_size, batch_size=None, max_seq_len=None, qo_indptr_buffer=None,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 use_cuda_graph=False):
        self.device, self.use_cuda_graph, self.page_size = device, use_cuda_graph, page_size
        self.attn_wrapper = BatchPrefillWithPagedKVCacheWrapper(
            device, use_cuda_graph=use_cuda_graph, qo_indptr_buf=qo_indptr_buffer,
            paged_kv_indptr_buf=paged_kv_indptr_buffer, paged_kv_indices_buf=paged_kv_indices_buffer,
            paged_kv_last_page_len_buf=paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            self.token_to_page = torch.zeros(max_seq_len, dtype=torch.long, device=device)
            self.token_to_cache = torch.zeros(max_seq_len, dtype=torch.long, device=device)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
        self.attn_wrapper.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                               self.page_size)
        n_req = qo_indptr.shape[0] - 1
        starts, lens = qo_indptr[:-1], qo_indptr[1:] - qo_indptr[:-1]
        total_tokens = int(lens.sum())
        num_pages_after = paged_kv_indptr[1:] - paged_kv_indptr[:-1]
        kv_len_after = (num_pages_after - 1) * self.page_size + paged_kv_last_page_len
        seg = torch.repeat_interleave(torch.arange(n_req), lens)
        intra = torch.arange(total_tokens) - torch.repeat_interleave(starts, lens)
        g = kv_len_after[seg] - lens[seg] + intra
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

    def run(self, q, kv_cache):
        return self.attn_wrapper.run(q, kv_cache)

    def set_kv_cache(self, kv_cache, k, v):
        kv_cache[self.token_to_page, 0, self.token_to_cache] = k
        kv_cache[self.token_to_page, 1, self.token_to_cache] = v


class Model:
    def __init__(self, device):
        gen = generator(9870966)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(SEQ_LEN_BUCKET, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo, self.lm_head = (
            randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(5))

    def forward(self, input_ids, position_ids, attn_wrapper, kv_cache):
        h = self.embed[input_ids] + self.pos_embed[position_ids]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        attn_wrapper.set_kv_cache(kv_cache, k, v)
        o = attn_wrapper.run(q, kv_cache)
        return (h + o @ self.wo) @ self.lm_head


class ModelWorker:
    """Eager worker: ``run_lm_prefill`` with the non-graph flashinfer wrapper."""

    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.kv_cache = torch.zeros(MAX_NUM_PAGES, 2, PAGE_SIZE, DIM, device=device)
        self.empty_pages = list(range(MAX_NUM_PAGES))
        self.prefill_wrapper_no_cudagraph = FlashInferPrefillWrapper(device, PAGE_SIZE, use_cuda_graph=False)

    def prepare_lm_inputs(self, prompts):
        """Allocate pages for each prompt; host-side indptr lists as in vox-serve's ``LMInputs``."""
        qo_indptr, kv_indptr, kv_indices, last_page_len, input_ids, position_ids = [0], [0], [], [], [], []
        for prompt in prompts:
            n_pages = -(-len(prompt) // PAGE_SIZE)
            kv_indices += [self.empty_pages.pop(0) for _ in range(n_pages)]
            qo_indptr.append(qo_indptr[-1] + len(prompt))
            kv_indptr.append(kv_indptr[-1] + n_pages)
            last_page_len.append(len(prompt) - (n_pages - 1) * PAGE_SIZE)
            input_ids += prompt
            position_ids += list(range(len(prompt)))
        return {"qo_indptr": qo_indptr, "paged_kv_indptr": kv_indptr, "paged_kv_indices": kv_indices,
                "paged_kv_last_page_len": last_page_len,
                "input_ids": torch.tensor(input_ids).to(self.device),
                "position_ids": torch.tensor(position_ids).to(self.device)}

    def run_lm_prefill(self, lm_inputs):
        qo_indptr = torch.tensor(lm_inputs["qo_indptr"])
        self.prefill_wrapper_no_cudagraph.plan(qo_indptr, torch.tensor(lm_inputs["paged_kv_indptr"]),
                                               torch.tensor(lm_inputs["paged_kv_indices"]),
                                               torch.tensor(lm_inputs["paged_kv_last_page_len"]))
        logits = self.model.forward(lm_inputs["input_ids"], lm_inputs["position_ids"],
                                    self.prefill_wrapper_no_cudagraph, self.kv_cache)
        return logits[(qo_indptr[1:] - 1).to(self.device)].clone()


class CudaGraphWorker(ModelWorker):
    def __init__(self, model, device, variant):
        super().__init__(model, device, variant)
        self._prepare_attention_wrappers()
        self._initialize_prefill_cuda_graphs()

    def _prepare_attention_wrappers(self):
        d = self.device
        if self.variant == "fix":
            self.qo_indptr_buffer = torch.zeros(MAX_BATCH_SIZE + 1, dtype=torch.long, device=d)
        self.paged_kv_indptr_buffer = torch.zeros(MAX_BATCH_SIZE + 1, dtype=torch.long, device=d)
        self.paged_kv_indices_buffer = torch.zeros(MAX_NUM_PAGES, dtype=torch.long, device=d)
        self.paged_kv_last_page_len_buffer = torch.zeros(MAX_BATCH_SIZE, dtype=torch.long, device=d)
        batch_size = MAX_BATCH_SIZE
        qo_buffer = self.qo_indptr_buffer if self.variant == "fix" else self.paged_kv_indptr_buffer
        self.prefill_wrappers = {(batch_size, SEQ_LEN_BUCKET): FlashInferPrefillWrapper(
            d, PAGE_SIZE, batch_size=batch_size, max_seq_len=SEQ_LEN_BUCKET,
            qo_indptr_buffer=qo_buffer[: batch_size + 1],
            paged_kv_indptr_buffer=self.paged_kv_indptr_buffer[: batch_size + 1],
            paged_kv_indices_buffer=self.paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer=self.paged_kv_last_page_len_buffer[:batch_size],
            use_cuda_graph=True)}

    def _initialize_prefill_cuda_graphs(self):
        d = self.device
        self.cuda_graph_buffers = {
            "prefill_input_ids": torch.zeros(SEQ_LEN_BUCKET, dtype=torch.long, device=d),
            "prefill_position_ids": torch.zeros(SEQ_LEN_BUCKET, dtype=torch.long, device=d),
            "prefill_logits": torch.zeros(SEQ_LEN_BUCKET, DIM, device=d),
        }
        self.cuda_graphs_lm_prefill = {}
        batch_size, seq_len = MAX_BATCH_SIZE, SEQ_LEN_BUCKET
        key = (batch_size, seq_len)
        wrapper = self.prefill_wrappers[key]
        seq_len_per_batch = seq_len // batch_size
        pages_per_batch = max(1, seq_len_per_batch // PAGE_SIZE)
        wrapper.plan(torch.arange(batch_size + 1) * seq_len_per_batch, torch.arange(batch_size + 1) * pages_per_batch,
                     torch.arange(MAX_NUM_PAGES), torch.zeros(batch_size, dtype=torch.long))
        bufs = self.cuda_graph_buffers

        def step():
            logits = self.model.forward(bufs["prefill_input_ids"][:seq_len], bufs["prefill_position_ids"][:seq_len],
                                        wrapper, self.kv_cache)
            bufs["prefill_logits"][:seq_len].copy_(logits)
            return bufs["prefill_logits"]

        fw = wrapper.attn_wrapper
        graph, out = capture(
            step, device=d, warmups=5, name=f"prefill bs={batch_size} seq={seq_len}",
            owner="CudaGraphWorker (prefill graph)",
            static={"prefill_input_ids": bufs["prefill_input_ids"],
                    "prefill_position_ids": bufs["prefill_position_ids"],
                    "qo_indptr_buf": fw._qo_indptr_buf, "paged_kv_indptr_buf": fw._paged_kv_indptr_buf,
                    "paged_kv_indices_buf": fw._paged_kv_indices_buf,
                    "paged_kv_last_page_len_buf": fw._paged_kv_last_page_len_buf,
                    "token_to_page": wrapper.token_to_page, "token_to_cache": wrapper.token_to_cache},
            state={"kv_cache": self.kv_cache})
        self.cuda_graphs_lm_prefill[key] = (graph, out)

    def run_lm_prefill(self, lm_inputs):
        actual_seq_len = lm_inputs["input_ids"].shape[0]
        graph_key = (MAX_BATCH_SIZE, SEQ_LEN_BUCKET)        # the workload fills the bucket exactly
        qo_indptr_tensor = torch.tensor(lm_inputs["qo_indptr"])
        self.prefill_wrappers[graph_key].plan(qo_indptr_tensor, torch.tensor(lm_inputs["paged_kv_indptr"]),
                                              torch.tensor(lm_inputs["paged_kv_indices"]),
                                              torch.tensor(lm_inputs["paged_kv_last_page_len"]))
        graph, out = self.cuda_graphs_lm_prefill[graph_key]
        self.cuda_graph_buffers["prefill_input_ids"][:actual_seq_len].copy_(lm_inputs["input_ids"])
        self.cuda_graph_buffers["prefill_position_ids"][:actual_seq_len].copy_(lm_inputs["position_ids"])
        logits = replay(graph, out)[:SEQ_LEN_BUCKET]
        actual_qo_indptr = qo_indptr_tensor[: MAX_BATCH_SIZE + 1].to(self.device)
        return logits[actual_qo_indptr[1:] - 1].clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    batches = [[[3, 1, 4, 1, 5], [9, 2, 6]],          # 5 + 3 tokens: qo [0,5,8], kv pages [0,2,3]
               [[5, 3], [5, 8, 9, 7, 9, 3]],          # 2 + 6 tokens: qo [0,2,8], kv pages [0,1,3]
               [[2, 7, 1, 8], [2, 8, 1, 8]]]          # 4 + 4 tokens: qo [0,4,8], kv pages [0,1,2]

    def serve(worker_cls):
        worker = worker_cls(model, device, variant)
        return [worker.run_lm_prefill(worker.prepare_lm_inputs(prompts)) for prompts in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(CudaGraphWorker),
                   lambda: serve(ModelWorker))
