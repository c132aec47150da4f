"""TokenSpeed's graph replay refreshes the DSA draft backend's paged-MQA top-k schedule from ``seq_lens_k``, which aliases the drafter's ``draft_seq_lens_buf``; on replay nobody writes that buffer first, so the schedule is built from the lengths the previous replay's MTP steps left there.

Upstream: https://github.com/lightseekorg/tokenspeed/pull/509 ("Fix: GLM5 DSA MTP TP4 IMA Error",
lightseekorg/tokenspeed, commit 38ad3ed9, 2026-06-25, merged; no description). Read: the commit and its whole diff; the
pre-fix files at its parent: ``execution/cuda_graph_wrapper.py`` (``_init_replay_metadata``, ``_init_forward_metadata``,
whose eager path already does ``draft_seq_lens = self.drafter.draft_seq_lens_buf[:padded_bs];
draft_seq_lens.copy_(seq_lens[:padded_bs])`` with the comment "decode metadata must alias that buffer"),
``layers/attention/backends/dsa.py`` (``init_forward_metadata_replay_cuda_graph`` ->
``_refresh_decode_topk_schedule_metadata``, which recomputes ``deep_gemm.get_paged_mqa_logits_metadata`` from
``metadata.seq_lens_k[:bs]`` and copies it into the captured ``_dsa_paged_mqa_schedule_metadata``),
``backends/trtllm_mla.py`` (``init_cuda_graph_state`` aliases ``seq_lens_k`` to the given ``seq_lens_buf``; replay only
refreshes ``block_kv_indices``), ``execution/drafter/eagle.py`` (``draft_seq_lens_buf``; ``draft`` seeds it from
``seq_lens_buf``; ``_run_multi_step_decode`` overwrites it with ``cache_start + 1`` and ``add_(1)`` per step) and
``models/glm5.py`` (the decode top-k path computes the schedule lazily once and caches it on the decode metadata;
``fp8_paged_mqa_logits(..., clean_logits=False)``). The DeepGEMM kernels were not read; which kernel raised the IMA is
not stated.
Symptom: GLM-5 (DSA) served with MTP speculative decoding and CUDA graphs on TP4 hits an illegal memory access; eager is
fine.
Mechanism: the draft DSA backend's decode metadata aliases ``seq_lens_k`` to ``drafter.draft_seq_lens_buf`` (the drafter
advances it between MTP steps). The captured indexer does not compute its paged-MQA schedule; it reads
``_dsa_paged_mqa_schedule_metadata``, which ``_refresh_decode_topk_schedule_metadata`` rewrites on the host before each
replay from ``seq_lens_k``. ``_init_replay_metadata`` writes the step's lengths into ``seq_lens_buf`` only; the draft
buffer still holds what the last replay's final MTP step left (``valid + accept + steps - 1`` of the previous step,
shorter than this step's ``seq_lens``), so the schedule covers too few KV pages. The kernel does not clean its logits,
so the positions of a missed page keep old values and the draft top-k picks the wrong tokens.
Doctor: stale-input, at _init_replay_metadata: the replay's metadata (the schedule) is built from elements of a buffer
this step did not write, the previous replay's leftovers, because the replay path skips the copy the eager path does.
Fix (upstream): in ``_init_replay_metadata`` copy ``seq_lens[:padded_bs]`` into
``drafter.draft_seq_lens_buf[:padded_bs]`` and pass that view to the draft backend, as the eager path does. The PR
also adds ``DSABackend.advance_draft_forward_metadata`` (refreshing the schedule per MTP step), GLM NextN first-step
top-k handling and a schedule shape check in ``glm5.py`` (not modelled).
Modelled: ``CudaGraphWrapper`` (capture per bucket, ``_init_replay_metadata`` with the pre-fix and fixed lines,
``_init_forward_metadata``), ``TRTLLMMLABackend`` (aliased ``seq_lens_k``, block-table refresh), ``DSABackend``
(capture/replay metadata, ``_refresh_decode_topk_schedule_metadata``), ``Eagle`` (``draft``, ``_run_first_step``,
``_run_multi_step_decode``: ``cache_start``, ``draft_seq_lens`` advance). Stand-ins: ``deep_gemm`` - the schedule is the
number of KV pages each row visits, the logits kernel writes only visited pages into a persistent, never-cleaned logits
workspace (``clean_logits=False``); the GLM NextN draft model is one DSA layer (embedding + hidden projection, index/KV
caches, top-k, sparse attention, lm_head); target verification is not modelled: each step's verified token, accept
length and ``valid_cache_lengths`` are given; float64.
Workload: pages of 4 tokens, top-k 4, 3 MTP steps (4 tokens per verify), buckets 2 and 4; requests A..D prefilled
eagerly; 5 decode steps [A,B,C], [A,B,C,D], [A,B,C,D], [A,B], [A,B,C] (buckets 4, 4, 4, 2, 4), accept lengths 1 or 2.
Bug: the first replay refreshes the schedule from the capture's dummy lengths [2, 2, 2, 2] (fresh: 12, 9, 14, 1),
later replays from the previous replay's MTP lengths (A: 11 for 13, D: the padded dummy row's 3 for 10); rows whose
length crossed a page boundary take top-k from stale logits: steps 1-3 differ in logits (up to 5.2) and draft tokens,
steps 4-5 in logits (0.05, 0.48); max error 6 (a token id). Fix: every step equals eager (max error 6.7e-16).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/pull/509"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_init_replay_metadata"
SYMPTOM = ("GLM-5 DSA + MTP with CUDA graphs: the draft backend's top-k schedule is refreshed at replay from "
           "draft_seq_lens_buf, which still holds the previous replay's MTP lengths -> wrong top-k / IMA")

VOCAB, HIDDEN, INDEX_DIM = 16, 8, 8
PAGE_SIZE, MAX_PAGES_PER_REQ, INDEX_TOPK = 4, 6, 4
MAX_LEN = PAGE_SIZE * MAX_PAGES_PER_REQ
SPEC_NUM_STEPS = 3
SPEC_NUM_TOKENS = SPEC_NUM_STEPS + 1
CAPTURE_BS, MAX_BS, POOL_SIZE = (2, 4), 4, 5          # request slot 0: the dummy request of padded rows
NUM_PAGES = 1 + (POOL_SIZE - 1) * MAX_PAGES_PER_REQ   # page 0: dummy page
DTYPE = torch.float64
NUM_SMS = 132

_variant = "bug"


# --- deep_gemm (stand-in) --------------------------------------------------------------------------------------------

class deep_gemm:
    @staticmethod
    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
        """The kernel's work schedule; here: how many KV pages each query row visits."""
        return (context_lens + block_kv - 1) // block_kv

    @staticmethod
    def fp8_paged_mqa_logits(q, kv_cache, context_lens, block_tables, schedule_metadata, logits):
        """Index logits of every visited page; ``clean_logits=False``: unvisited entries keep what ``logits`` held."""
        pos = torch.arange(MAX_LEN, device=q.device)
        slots = block_tables[:, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE            # [rows, MAX_LEN]
        scores = torch.einsum("rd,rld->rl", q, kv_cache[slots]).relu()
        visited = (pos // PAGE_SIZE)[None, :] < schedule_metadata.view(-1, 1)
        logits.copy_(torch.where(visited, scores, logits))
        return logits


# --- layers/attention/backends/trtllm_mla.py and dsa.py --------------------------------------------------------------

@dataclasses.dataclass
class TRTLLMMLADecodeMetadata:
    num_extends: int = 0
    block_kv_indices: torch.Tensor | None = None
    max_seq_len_k: int | None = None
    seq_lens_k: torch.Tensor | None = None


class TRTLLMMLABackend:
    def __init__(self, device):
        self.device, self.forward_decode_metadata = device, None
        self.decode_cuda_graph_metadata = {}

    def _create_block_kv_indices(self, batch_size, req_pool_indices, req_to_page, block_kv_indices=None):
        if block_kv_indices is None:
            block_kv_indices = torch.zeros(batch_size, MAX_PAGES_PER_REQ, dtype=torch.int64, device=self.device)
        block_kv_indices[:batch_size] = req_to_page[req_pool_indices[:batch_size]]
        return block_kv_indices

    def init_forward_metadata(self, bs, req_pool_indices, seq_lens, req_to_page):
        self.forward_decode_metadata = TRTLLMMLADecodeMetadata(
            block_kv_indices=self._create_block_kv_indices(bs, req_pool_indices, req_to_page),
            max_seq_len_k=MAX_LEN, seq_lens_k=seq_lens)

    def init_cuda_graph_state(self, max_bs, seq_lens_buf):
        self.cuda_graph_seq_lens_buf = seq_lens_buf            # alias the controller's buffer, never mutate it
        self.decode_cuda_graph_kv_indices = torch.zeros(max_bs, MAX_PAGES_PER_REQ, dtype=torch.int64,
                                                        device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs):
        metadata = TRTLLMMLADecodeMetadata(block_kv_indices=self.decode_cuda_graph_kv_indices[:bs],
                                           max_seq_len_k=MAX_LEN, seq_lens_k=self.cuda_graph_seq_lens_buf[:bs])
        self.decode_cuda_graph_metadata[bs] = metadata
        self.forward_decode_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, req_to_page=None):
        metadata = self.decode_cuda_graph_metadata[bs]
        # seq_lens_k aliases seq_lens_buf; only block indices need refresh.
        self._create_block_kv_indices(bs, req_pool_indices[:bs], req_to_page, metadata.block_kv_indices)
        self.forward_decode_metadata = metadata


class DSABackend:
    def __init__(self, device):
        self._dense_backend = TRTLLMMLABackend(device)
        self.page_size = PAGE_SIZE

    @property
    def forward_decode_metadata(self):
        return self._dense_backend.forward_decode_metadata

    def init_cuda_graph_state(self, max_bs, seq_lens_buf):
        return self._dense_backend.init_cuda_graph_state(max_bs, seq_lens_buf)

    def init_forward_metadata(self, bs, req_pool_indices, seq_lens, req_to_page):
        return self._dense_backend.init_forward_metadata(bs, req_pool_indices, seq_lens, req_to_page)

    def init_forward_metadata_capture_cuda_graph(self, bs):
        return self._dense_backend.init_forward_metadata_capture_cuda_graph(bs)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, req_to_page=None):
        result = self._dense_backend.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens,
                                                                             req_to_page=req_to_page)
        self._refresh_decode_topk_schedule_metadata(bs)
        return result

    def _refresh_decode_topk_schedule_metadata(self, bs):
        metadata = self._dense_backend.forward_decode_metadata
        schedule_metadata = getattr(metadata, "_dsa_paged_mqa_schedule_metadata", None)
        if schedule_metadata is None:
            return
        base_lens = metadata.seq_lens_k[:bs]                     # plain decode: [bs, 1]
        refreshed = deep_gemm.get_paged_mqa_logits_metadata(base_lens.view(-1, 1), self.page_size, NUM_SMS)
        schedule_metadata.copy_(refreshed)

    def forward_decode(self, q, topk_indices, kv_cache):
        """Sparse MLA decode over the top-k positions of each row (stand-in for the trtllm/flashmla kernels)."""
        metadata = self.forward_decode_metadata
        pages = metadata.block_kv_indices.gather(1, topk_indices // PAGE_SIZE)
        k = kv_cache[pages * PAGE_SIZE + topk_indices % PAGE_SIZE]                          # [bs, topk, HIDDEN]
        probs = torch.softmax(torch.einsum("bd,bkd->bk", q, k) / math.sqrt(HIDDEN), -1)
        return torch.einsum("bk,bkd->bd", probs, k)


# --- models/glm5_nextn.py (stand-in: one DSA layer) ------------------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    bs: int
    attn_backend: DSABackend


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor


class GlmMoeDsaForCausalLMNextN:
    def __init__(self, device):
        gen = generator(509)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.eh_proj = r(VOCAB, HIDDEN, scale=1.0), r(HIDDEN, HIDDEN)
        self.wq, self.wkv, self.wo, self.wq_index, self.wk_index = (r(HIDDEN, HIDDEN) for _ in range(5))
        self.lm_head = r(HIDDEN, VOCAB)
        self.inv_freq = (1.0 / 10.0 ** (torch.arange(HIDDEN, dtype=DTYPE) / HIDDEN)).to(device)
        self.kv_cache = torch.zeros(NUM_PAGES * PAGE_SIZE, HIDDEN, dtype=DTYPE, device=device)
        self.index_k_cache = torch.zeros(NUM_PAGES * PAGE_SIZE, INDEX_DIM, dtype=DTYPE, device=device)
        self.decode_logits_workspace = torch.zeros(MAX_BS, MAX_LEN, dtype=DTYPE, device=device)

    def embed(self, input_ids, positions, captured_hidden_states):
        h = self.embed_tokens[input_ids] + torch.sin(positions[:, None].to(DTYPE) * self.inv_freq)
        return h if captured_hidden_states is None else h + captured_hidden_states @ self.eh_proj

    def write_kv(self, h, out_cache_loc):
        self.kv_cache.index_copy_(0, out_cache_loc, h @ self.wkv)
        self.index_k_cache.index_copy_(0, out_cache_loc, h @ self.wk_index)

    def _get_topk_indices_decode(self, ctx, q_index):
        decode_metadata = ctx.attn_backend.forward_decode_metadata
        seq_lens_2d = decode_metadata.seq_lens_k.view(-1, 1)
        schedule_metadata = getattr(decode_metadata, "_dsa_paged_mqa_schedule_metadata", None)
        if schedule_metadata is None:                            # first use only; cached on the metadata
            schedule_metadata = deep_gemm.get_paged_mqa_logits_metadata(seq_lens_2d, PAGE_SIZE, NUM_SMS)
            decode_metadata._dsa_paged_mqa_schedule_metadata = schedule_metadata
        logits = deep_gemm.fp8_paged_mqa_logits(q_index, self.index_k_cache, seq_lens_2d,
                                                decode_metadata.block_kv_indices, schedule_metadata,
                                                self.decode_logits_workspace[:ctx.bs])
        col_ids = torch.arange(MAX_LEN, device=q_index.device)
        masked = logits.masked_fill(col_ids.view(1, -1) >= seq_lens_2d, float("-inf"))
        return masked.topk(INDEX_TOPK, dim=-1).indices

    def forward(self, ctx, input_ids, positions, out_cache_loc, captured_hidden_states):
        h = self.embed(input_ids, positions, captured_hidden_states)
        self.write_kv(h, out_cache_loc)
        topk_indices = self._get_topk_indices_decode(ctx, h @ self.wq_index)
        hidden = h + ctx.attn_backend.forward_decode(h @ self.wq, topk_indices, self.kv_cache) @ self.wo
        return LogitsProcessorOutput(next_token_logits=hidden @ self.lm_head, hidden_states=hidden)


# --- execution/drafter/eagle.py ---------------------------------------------------------------------------------------

class InputBuffers:
    def __init__(self, device):
        z = lambda: torch.zeros(MAX_BS, dtype=torch.int64, device=device)   # noqa: E731
        self.max_bs = MAX_BS
        self.seq_lens_buf, self.req_pool_indices_buf, self.input_ids_buf = z(), z(), z()
        self.positions_buf, self.out_cache_loc_buf, self.accept_lengths_buf = z(), z(), z()


class Eagle:
    def __init__(self, model, input_buffers, valid_cache_lengths, req_to_page, attn_backend):
        self.draft_model, self.input_buffers, self.attn_backend = model, input_buffers, attn_backend
        self.valid_cache_lengths, self.req_to_page = valid_cache_lengths, req_to_page
        self.spec_num_steps, self.page_size = SPEC_NUM_STEPS, PAGE_SIZE
        # Drafter-owned alias source for the draft attn backend; advanced in place during multi-step decode.
        self.draft_seq_lens_buf = torch.zeros_like(input_buffers.seq_lens_buf)

    def _run_first_step(self, bs, base_out_hidden_states):
        buffers = self.input_buffers
        ctx = ForwardContext(bs=bs, attn_backend=self.attn_backend)
        return self.draft_model.forward(ctx, buffers.input_ids_buf[:bs], buffers.positions_buf[:bs],
                                        buffers.out_cache_loc_buf[:bs], base_out_hidden_states)

    def _run_multi_step_decode(self, bs, draft_ids, next_tokens, logits_output, all_logits):
        req_pool_indices = self.input_buffers.req_pool_indices_buf[:bs]
        # Step 1's write position uses vc+accept_length after target verify.
        cache_start = (self.valid_cache_lengths.index_select(0, req_pool_indices)
                       + self.input_buffers.accept_lengths_buf[:bs])
        pos = cache_start[:, None] + torch.arange(self.spec_num_steps - 1, device=cache_start.device)
        pages = self.req_to_page[req_pool_indices].gather(1, pos // self.page_size)
        cache_locs = pages * self.page_size + pos % self.page_size      # compute_out_cache_loc_uniform
        # +1 is the kernel's read-inclusive convention; advanced per iter.
        draft_seq_lens = self.draft_seq_lens_buf[:bs]
        torch.add(cache_start, 1, out=draft_seq_lens)
        positions = cache_start.clone()
        for i in range(1, self.spec_num_steps):
            ctx = ForwardContext(bs=bs, attn_backend=self.attn_backend)
            logits_output = self.draft_model.forward(ctx, draft_ids, positions, cache_locs[:, i - 1].contiguous(),
                                                     logits_output.hidden_states)
            all_logits.append(logits_output.next_token_logits)
            draft_ids = logits_output.next_token_logits.argmax(-1)
            next_tokens[:, i + 1] = draft_ids
            if i + 1 < self.spec_num_steps:
                positions.add_(1)
                draft_seq_lens.add_(1)

    def draft(self, bs, base_out_hidden_states):
        next_tokens = torch.empty(bs, self.spec_num_steps + 1, dtype=torch.int64,
                                  device=base_out_hidden_states.device)
        next_tokens[:, 0] = self.input_buffers.input_ids_buf[:bs]        # last verified id
        # Seed the draft attn backend's aliased seq_lens for the first step.
        self.draft_seq_lens_buf[:bs].copy_(self.input_buffers.seq_lens_buf[:bs])
        logits_output = self._run_first_step(bs, base_out_hidden_states)
        all_logits = [logits_output.next_token_logits]
        draft_ids = logits_output.next_token_logits.argmax(-1)
        next_tokens[:, 1] = draft_ids
        self._run_multi_step_decode(bs, draft_ids, next_tokens, logits_output, all_logits)
        return torch.stack(all_logits, 1), next_tokens


# --- execution/cuda_graph_wrapper.py ---------------------------------------------------------------------------------

class CudaGraphWrapper:
    def __init__(self, device, use_cuda_graph):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.input_buffers = InputBuffers(device)
        self.valid_cache_lengths = torch.zeros(POOL_SIZE, dtype=torch.int64, device=device)   # runtime_states
        self.req_to_page = torch.zeros(POOL_SIZE, MAX_PAGES_PER_REQ, dtype=torch.int64, device=device)
        self.model = GlmMoeDsaForCausalLMNextN(device)
        self.target_embed = randn(VOCAB, HIDDEN, gen=generator(5090), device=device).to(DTYPE)
        self.draft_attn_backend = DSABackend(device)
        self.drafter = Eagle(self.model, self.input_buffers, self.valid_cache_lengths, self.req_to_page,
                             self.draft_attn_backend)
        self.draft_attn_backend.init_cuda_graph_state(MAX_BS, self.drafter.draft_seq_lens_buf)
        self.graphs, self.pool = {}, graph_pool_handle(device)

    def forward_step(self, bs):
        """The captured step: target verification (stand-in: hidden states of the verified token), then drafting."""
        base_out_hidden_states = self.target_embed[self.input_buffers.input_ids_buf[:bs]]
        return self.drafter.draft(bs, base_out_hidden_states)

    def capture(self):
        buf = self.input_buffers
        buf.seq_lens_buf.fill_(1)                                # get_cuda_graph_seq_len_fill_value()
        for bs in reversed(CAPTURE_BS):
            self.draft_attn_backend.init_forward_metadata_capture_cuda_graph(bs)
            with events.warmup():
                self.forward_step(bs)                            # the indexer caches its schedule here
            metadata = self.draft_attn_backend.forward_decode_metadata
            static = {"seq_lens": buf.seq_lens_buf, "req_pool_indices": buf.req_pool_indices_buf,
                      "input_ids": buf.input_ids_buf, "positions": buf.positions_buf,
                      "out_cache_loc": buf.out_cache_loc_buf, "accept_lengths": buf.accept_lengths_buf,
                      "valid_cache_lengths": self.valid_cache_lengths, "req_to_page": self.req_to_page,
                      "block_kv_indices": self.draft_attn_backend._dense_backend.decode_cuda_graph_kv_indices,
                      "dsa_paged_mqa_schedule_metadata": metadata._dsa_paged_mqa_schedule_metadata}
            self.graphs[bs] = capture(lambda bs=bs: self.forward_step(bs), device=self.device, pool=self.pool,
                                      warmups=0, name=f"decode bs {bs}", owner="tokenspeed CudaGraphWrapper",
                                      static=static, state={"kv_cache": self.model.kv_cache,
                                                            "index_k_cache": self.model.index_k_cache})

    def _init_replay_metadata(self, padded_bs, actual_bs, req_pool_indices, seq_lens, req_to_page):
        """Graph-replay path - update persistent cuda-graph buffers in place."""
        if _variant == "fix":
            draft_seq_lens = self.drafter.draft_seq_lens_buf[:padded_bs]
            draft_seq_lens.copy_(seq_lens[:padded_bs])
        else:
            draft_seq_lens = seq_lens
        self.draft_attn_backend.init_forward_metadata_replay_cuda_graph(padded_bs, req_pool_indices, draft_seq_lens,
                                                                        req_to_page=self.drafter.req_to_page)

    def _init_forward_metadata(self, padded_bs, req_pool_indices, seq_lens, req_to_page):
        """Eager path - allocate/refresh metadata for the upcoming forward."""
        # The drafter mutates draft_seq_lens_buf between MTP draft steps; decode metadata must alias that buffer.
        draft_seq_lens = self.drafter.draft_seq_lens_buf[:padded_bs]
        draft_seq_lens.copy_(seq_lens[:padded_bs])
        self.draft_attn_backend.init_forward_metadata(padded_bs, req_pool_indices, draft_seq_lens,
                                                      self.drafter.req_to_page)

    def execute(self, batch):
        """One decode step: ``batch`` rows are (req slot, valid cache length, accept length, verified token)."""
        bs, buf = len(batch), self.input_buffers
        padded_bs = next(b for b in CAPTURE_BS if b >= bs) if self.use_cuda_graph else bs
        rows = batch + [(0, 0, 1, 0)] * (padded_bs - bs)                 # padded rows: the dummy request
        slot, valid, accept, tok = (torch.tensor(c, dtype=torch.int64, device=self.device) for c in zip(*rows))
        pos = valid + accept - 1                                          # the verified token's position
        seq_lens = torch.where(slot > 0, valid + SPEC_NUM_TOKENS, torch.ones_like(valid))
        buf.seq_lens_buf[:padded_bs] = seq_lens
        buf.req_pool_indices_buf[:padded_bs] = slot
        buf.accept_lengths_buf[:padded_bs] = accept
        buf.input_ids_buf[:padded_bs] = tok
        buf.positions_buf[:padded_bs] = pos.clamp_min(0)
        page = self.req_to_page[slot].gather(1, (pos.clamp_min(0) // PAGE_SIZE)[:, None])[:, 0]
        buf.out_cache_loc_buf[:padded_bs] = page * PAGE_SIZE + pos.clamp_min(0) % PAGE_SIZE
        self.valid_cache_lengths[slot] = valid
        if not self.use_cuda_graph:
            self._init_forward_metadata(bs, buf.req_pool_indices_buf[:bs], buf.seq_lens_buf[:bs], self.req_to_page)
            logits, next_tokens = self.forward_step(bs)
        else:
            self._init_replay_metadata(padded_bs, bs, buf.req_pool_indices_buf[:padded_bs],
                                       buf.seq_lens_buf[:padded_bs], self.req_to_page)
            g, outputs = self.graphs[padded_bs]
            logits, next_tokens = replay(g, outputs, real=bs, size=padded_bs)
        return logits[:bs].clone(), next_tokens[:bs].to(DTYPE)


# --- the workload ----------------------------------------------------------------------------------------------------

PROMPTS = {"A": (1, 9), "B": (2, 6), "C": (3, 11), "D": (4, 7)}         # name: (request slot, prompt length)
SCHEDULE = [["A", "B", "C"], ["A", "B", "C", "D"], ["A", "B", "C", "D"], ["A", "B"], ["A", "B", "C"]]


def token(name, pos):
    return (5 * "ABCD".index(name) + 3 * pos + 2) % VOCAB


def prefill(wrapper, name):
    """Eager draft prefill: the prompt's KV into the request's pages."""
    slot, n = PROMPTS[name]
    wrapper.req_to_page[slot] = torch.arange(MAX_PAGES_PER_REQ) + 1 + (slot - 1) * MAX_PAGES_PER_REQ
    pos = torch.arange(n, device=wrapper.device)
    h = wrapper.model.embed(torch.tensor([token(name, p) for p in range(n)], device=wrapper.device), pos, None)
    wrapper.model.write_kv(h, wrapper.req_to_page[slot, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)


def serve(device, use_cuda_graph):
    wrapper = CudaGraphWrapper(device, use_cuda_graph)
    if use_cuda_graph:
        wrapper.capture()
    for name in PROMPTS:
        prefill(wrapper, name)
    valid = {name: n - 1 for name, (_, n) in PROMPTS.items()}
    outs = []
    for step, names in enumerate(SCHEDULE):
        accept = {name: 1 + (step + i) % 2 for i, name in enumerate(names)}
        batch = [(PROMPTS[n][0], valid[n], accept[n], token(n, valid[n] + accept[n] - 1)) for n in names]
        outs.extend(wrapper.execute(batch))
        for n in names:
            valid[n] += accept[n]
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(device, True),
                   lambda: serve(device, False))
