"""SGLang's TRT-LLM MHA backend binds the zero-initialised draft-decode ``cache_seqlens`` buffer at CUDA-graph capture and never copies ``seq_lens`` into it: the EAGLE draft warmup attends over an empty KV range, produces NaN, and the NaN check aborts startup.

Upstream: https://github.com/sgl-project/sglang/pull/26521 ("fix: copy seq_lens in TRTLLM MHA draft decode cuda graph
capture", sgl-project/sglang, merged; description dated 2026-05-28). Read: the PR description (motivation, symptom with
EAGLE3 + ``trtllm_mha`` + ``SGLANG_SPEC_NAN_DETECTION=1``: ``Assertion `NaN detected! draft_forward step 0` failed``
while capturing, the dumped draft ``attn_out`` rows NaN or 0; fix: "mirror the replay-time copy in the draft-decode
capture branch"). Read the pre-fix ``TRTLLMHAAttnBackend`` (``init_cuda_graph_state``,
``init_forward_metadata_capture_cuda_graph`` whose draft branch sets ``metadata.cache_seqlens_int32 =
self.decode_cuda_graph_metadata["cache_seqlens"][:bs]`` and nothing more, ``init_forward_metadata_replay_cuda_graph``
whose draft branch does ``metadata.cache_seqlens_int32.copy_(seq_lens + self.speculative_step_id + 1)``,
``init_forward_metadata``, ``forward_decode`` passing ``seq_lens=self.forward_metadata.cache_seqlens_int32`` to
``flashinfer.decode.trtllm_batch_decode_with_kv_cache``, ``TRTLLMHAAttnMultiStepDraftBackend``) in an annotated copy
of ``trtllm_mha_backend.py``, and a stored ``EAGLEDraftCudaGraphRunner`` (buffers, ``capture_one_batch_size`` with its
two warmup ``run_once`` calls before the capture, ``replay`` with its padding). The PR diff itself was not read: the
fixed capture branch is reconstructed from the description (the copy the replay branch already did).
Symptom: EAGLE3 speculative decoding with ``--attention-backend trtllm_mha`` and ``SGLANG_SPEC_NAN_DETECTION=1`` dies
while capturing the draft CUDA graphs ("Capturing batches (bs=30 ...) 4%") on the NaN assertion of draft step 0; the
server never starts. Eager draft decode is fine.
Mechanism: the capture branch of the draft-decode metadata binds a slice of the pre-allocated, zero-initialised
``cache_seqlens`` buffer as the kernel's KV lengths but never seeds it, unlike the normal-decode branch (which builds
it from ``seq_lens``) and the replay branch (which copies ``seq_lens + step + 1`` before every replay). The runner's
warmup forwards and the capture itself therefore run the TRT-LLM decode kernel with ``cache_seqlens == 0``: an empty
KV range, whose softmax normalisation is 0/0. The draft step's logits are NaN and the NaN check raises. Replays are
not affected (the replay branch writes the buffer), which is why only capture fails.
Doctor: stale-input, at init_forward_metadata_capture_cuda_graph. The captured step reads an element of a static
input (the backend's ``cache_seqlens`` buffer) that the capture-time preparation never wrote: the warmup and capture
runs see the buffer's initial zeros instead of this (dummy) batch's lengths.
Fix (upstream): copy ``seq_lens + speculative_step_id + 1`` into the bound ``cache_seqlens`` slice in the capture branch
too, so the captured kernels see non-empty KV ranges during warmup.
Modelled: ``TRTLLMMHAMetadata``, ``TRTLLMHAAttnBackend`` (``init_cuda_graph_state``, ``init_forward_metadata``,
``init_forward_metadata_capture_cuda_graph``, ``init_forward_metadata_replay_cuda_graph``, ``forward_decode``),
``TRTLLMHAAttnMultiStepDraftBackend``, ``EAGLEDraftCudaGraphRunner`` (``capture_one_batch_size`` with ``run_once``,
``replay`` with its padding of ``seq_lens`` to ``seq_len_fill_value`` = 1), ``EAGLEWorker.draft_forward`` (topk = 1,
``positions.add_(1)`` per step, ``maybe_detect_nan`` after each draft forward), ``ReqToTokenPool``,
``MHATokenToKVPool``.
Stand-ins: ``trtllm_batch_decode_with_kv_cache`` is a masked softmax attention over ``block_tables[:, :seq_len]``
(page size 1) whose normalisation is exp-sum, so an empty range gives 0/0; ``maybe_detect_nan`` (upstream a
``torch._assert_async``) checks on the host when no capture is open and raises; the EAGLE3 draft model is one attention
layer (hidden 8, vocab 16, float64) fed by the target hidden state; the target verify is a stand-in that accepts the
first draft token.
Workload: capture sizes [1, 2, 4], speculative_num_steps 3 (two draft forwards, one per step backend). Three requests
(prompts of 3, 5 and 4 tokens) run three draft rounds, each padded 3 -> 4. The bug raises at the first warmup of the
bs=4 capture ("NaN detected! draft_forward step 0"), as upstream; the fix captures cleanly and its draft scores and
tokens equal eager's.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.engine import graph_pool_handle, is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/26521"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "init_forward_metadata_capture_cuda_graph"
SYMPTOM = ("EAGLE3 + trtllm_mha: the draft-decode CUDA-graph capture binds a zero-initialised cache_seqlens buffer and "
           "never seeds it, so the warmup attends over an empty KV range, yields NaN, and the NaN check aborts startup")

HIDDEN, VOCAB = 8, 16
MAX_CONTEXT_LEN = 16
MAX_REQS = 4
NUM_SLOTS = 64
TOPK = 1
SPECULATIVE_NUM_STEPS = 3
CAPTURE_BS = [1, 2, 4]
SGLANG_SPEC_NAN_DETECTION = True   # the reproduction's SGLANG_SPEC_NAN_DETECTION=1

_variant = "bug"


def maybe_detect_nan(t: torch.Tensor, msg: str) -> None:
    if not SGLANG_SPEC_NAN_DETECTION or is_capturing():
        return
    if bool(torch.isnan(t).any()):
        raise RuntimeError(f"Assertion `NaN detected! {msg}` failed.")


# --- flashinfer.decode (stand-in) ------------------------------------------------------------------------------------

def trtllm_batch_decode_with_kv_cache(query, kv_cache, block_tables, seq_lens, max_seq_len, bmm1_scale):
    k_cache, v_cache = kv_cache
    keys = k_cache[block_tables.long()]                                   # [bs, W, H]
    vals = v_cache[block_tables.long()]
    scores = (keys * query.unsqueeze(1)).sum(-1) * bmm1_scale             # [bs, W]
    cols = torch.arange(block_tables.shape[1], device=query.device)
    valid = (cols.unsqueeze(0) < seq_lens.unsqueeze(1)) & (cols.unsqueeze(0) < max_seq_len)
    scores = scores.masked_fill(~valid, float("-inf"))
    m = scores.max(-1, keepdim=True).values
    p = torch.exp(scores - m).masked_fill(~valid, 0.0)
    return (p.unsqueeze(-1) * vals).sum(1) / p.sum(-1, keepdim=True)     # empty KV range: 0/0


# --- memory pools -----------------------------------------------------------------------------------------------------

class ReqToTokenPool:
    def __init__(self, device):
        # row 0: the padding rows' request
        self.req_to_token = torch.zeros(MAX_REQS + 1, MAX_CONTEXT_LEN, dtype=torch.int32, device=device)


class MHATokenToKVPool:
    def __init__(self, device):
        self.k_buffer = [torch.zeros(NUM_SLOTS, HIDDEN, dtype=torch.float64, device=device)]
        self.v_buffer = [torch.zeros(NUM_SLOTS, HIDDEN, dtype=torch.float64, device=device)]

    def set_kv_buffer(self, layer, loc, k, v):
        self.k_buffer[layer.layer_id][loc.long()] = k
        self.v_buffer[layer.layer_id][loc.long()] = v

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]


@dataclasses.dataclass
class EagleDraftInput:
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: torch.Tensor


@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    spec_info: EagleDraftInput
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    input_ids: torch.Tensor | None = None
    attn_backend: object = None

    @property
    def seq_lens_sum(self):
        return int(self.seq_lens_cpu.sum())


# --- python/sglang/srt/layers/attention/trtllm_mha_backend.py ---------------------------------------------------------

@dataclasses.dataclass
class TRTLLMMHAMetadata:
    cache_seqlens_int32: torch.Tensor = None
    max_seq_len_k: int = 0
    cu_seqlens_q: torch.Tensor = None
    page_table: torch.Tensor = None


class TRTLLMHAAttnBackend:
    def __init__(self, model_runner, speculative_step_id: int = 0):
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = 1
        self.max_context_len = MAX_CONTEXT_LEN
        self.speculative_step_id = speculative_step_id
        self.decode_cuda_graph_metadata = {}
        self.forward_metadata = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        max_num_pages = (self.max_context_len + self.page_size - 1) // self.page_size
        i32 = dict(dtype=torch.int32, device=self.device)
        self.decode_cuda_graph_metadata = {
            "cache_seqlens": torch.zeros(max_bs, **i32),
            "page_table": torch.zeros(max_bs, max_num_pages, **i32),
            "strided_indices": torch.arange(0, self.max_context_len, self.page_size, device=self.device),
            "cu_seqlens_q": torch.arange(0, max_bs + 1, **i32),
            "page_table_draft_decode": torch.zeros(max_bs, max_num_pages, **i32),
        }

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager draft decode."""
        metadata = TRTLLMMHAMetadata()
        metadata.cache_seqlens_int32 = (forward_batch.seq_lens + (self.speculative_step_id + 1)).to(torch.int32)
        metadata.max_seq_len_k = int(forward_batch.seq_lens_cpu.max()) + (self.speculative_step_id + 1)
        metadata.cu_seqlens_q = torch.arange(0, forward_batch.batch_size + 1, dtype=torch.int32, device=self.device)
        metadata.page_table = forward_batch.req_to_token_pool.req_to_token[
            forward_batch.req_pool_indices.long(), : metadata.max_seq_len_k]
        self.forward_metadata = metadata

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        metadata = TRTLLMMHAMetadata()
        # Draft Decode (topk = 1)
        metadata.cache_seqlens_int32 = self.decode_cuda_graph_metadata["cache_seqlens"][:bs]
        if _variant == "fix":
            metadata.cache_seqlens_int32.copy_(seq_lens + self.speculative_step_id + 1)
        metadata.max_seq_len_k = int(seq_lens.max()) + (self.speculative_step_id + 1)
        metadata.cu_seqlens_q = self.decode_cuda_graph_metadata["cu_seqlens_q"][: bs + 1]
        metadata.page_table = self.decode_cuda_graph_metadata["page_table_draft_decode"][:bs, :]
        self.decode_cuda_graph_metadata[bs] = metadata
        self.forward_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        seq_lens = seq_lens[:bs]
        seq_lens_cpu = seq_lens_cpu[:bs]
        req_pool_indices = req_pool_indices[:bs]
        # Draft Decode (topk = 1)
        metadata = self.decode_cuda_graph_metadata[bs]
        max_len = int(seq_lens_cpu.max())
        metadata.max_seq_len_k = max_len + self.speculative_step_id + 1
        max_seq_pages = (metadata.max_seq_len_k + self.page_size - 1) // self.page_size
        metadata.cache_seqlens_int32.copy_(seq_lens + self.speculative_step_id + 1)
        page_indices = self.req_to_token[
            req_pool_indices[:, None].long(),
            self.decode_cuda_graph_metadata["strided_indices"][:max_seq_pages][None, :]]
        metadata.page_table[:, :max_seq_pages].copy_(page_indices // self.page_size)
        self.forward_metadata = metadata

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        cache_loc = forward_batch.out_cache_loc
        if save_kv_cache and k is not None:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, cache_loc, k, v)
        k_cache, v_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        return trtllm_batch_decode_with_kv_cache(
            query=q, kv_cache=(k_cache, v_cache), block_tables=self.forward_metadata.page_table,
            seq_lens=self.forward_metadata.cache_seqlens_int32, max_seq_len=self.max_context_len,
            bmm1_scale=HIDDEN ** -0.5)


class TRTLLMHAAttnMultiStepDraftBackend:
    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [TRTLLMHAAttnBackend(model_runner, speculative_step_id=i)
                              for i in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_capture_cuda_graph(
                forward_batch.batch_size, forward_batch.batch_size * self.topk, forward_batch.req_pool_indices,
                forward_batch.seq_lens, None, "DECODE", forward_batch.spec_info)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch, bs):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_replay_cuda_graph(
                bs, forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.seq_lens_sum, None,
                "DECODE", forward_batch.spec_info, seq_lens_cpu=forward_batch.seq_lens_cpu)


# --- the draft model (stand-in for the EAGLE3 head) -------------------------------------------------------------------

@dataclasses.dataclass
class RadixAttention:
    layer_id: int


@dataclasses.dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor


class LlamaForCausalLMEagle3:
    def __init__(self, device):
        gen = generator(26521)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.fc = r(HIDDEN, HIDDEN)
        self.pos_emb = r(MAX_CONTEXT_LEN, HIDDEN, scale=0.3)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.attn = RadixAttention(layer_id=0)

    def forward(self, input_ids, positions, forward_batch):
        x = (self.embed_tokens[input_ids.long()] + forward_batch.spec_info.hidden_states @ self.fc
             + self.pos_emb[positions.long()])
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        o = forward_batch.attn_backend.forward_decode(q, k, v, self.attn, forward_batch)
        h = x + o @ self.wo
        return LogitsProcessorOutput(next_token_logits=h @ self.lm_head, hidden_states=h)


class ModelRunner:
    def __init__(self, device):
        self.device = device
        self.req_to_token_pool = ReqToTokenPool(device)
        self.token_to_kv_pool = MHATokenToKVPool(device)
        self.model = LlamaForCausalLMEagle3(device)


# --- python/sglang/srt/speculative/eagle_worker.py --------------------------------------------------------------------

class EAGLEWorker:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.topk = TOPK
        self.speculative_num_steps = SPECULATIVE_NUM_STEPS
        self.draft_model_runner = ModelRunner(device)
        self.draft_attn_backend = TRTLLMHAAttnMultiStepDraftBackend(
            self.draft_model_runner, self.topk, self.speculative_num_steps)
        self.cuda_graph_runner = EAGLEDraftCudaGraphRunner(self) if use_cuda_graph else None

    def draft_forward(self, forward_batch: ForwardBatch):
        spec_info = forward_batch.spec_info
        bs = forward_batch.batch_size
        topk_p, topk_index, hidden_states = spec_info.topk_p, spec_info.topk_index, spec_info.hidden_states
        out_cache_loc = forward_batch.out_cache_loc.reshape(bs, self.topk, self.speculative_num_steps)
        out_cache_loc = out_cache_loc.permute((2, 0, 1)).reshape(self.speculative_num_steps, -1)
        score_list, token_list = [], []
        scores = None
        for i in range(self.speculative_num_steps):
            # select_top_k_tokens (topk = 1): a chain
            input_ids = topk_index.flatten()
            scores = topk_p if scores is None else scores * topk_p
            score_list.append(scores.flatten())
            token_list.append(input_ids)
            if i == self.speculative_num_steps - 1:
                break
            forward_batch.input_ids = input_ids
            forward_batch.out_cache_loc = out_cache_loc[i]
            forward_batch.positions.add_(1)
            forward_batch.attn_backend = self.draft_attn_backend.attn_backends[i]
            spec_info.hidden_states = hidden_states
            logits_output = self.draft_model_runner.model.forward(input_ids, forward_batch.positions, forward_batch)
            maybe_detect_nan(logits_output.next_token_logits, f"draft_forward step {i}")
            probs = torch.softmax(logits_output.next_token_logits, dim=-1)
            topk_p, topk_index = probs.max(dim=-1, keepdim=True)
            hidden_states = logits_output.hidden_states
        return torch.stack(score_list, dim=1), torch.stack(token_list, dim=1).to(torch.float64)

    def draft(self, forward_batch: ForwardBatch):
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        self.draft_attn_backend.init_forward_metadata(forward_batch)
        return self.draft_forward(forward_batch)


# --- python/sglang/srt/speculative/eagle_draft_cuda_graph_runner.py ---------------------------------------------------

class EAGLEDraftCudaGraphRunner:
    def __init__(self, eagle_worker: EAGLEWorker):
        self.eagle_worker = eagle_worker
        self.model_runner = eagle_worker.draft_model_runner
        self.device = eagle_worker.device
        self.speculative_num_steps = eagle_worker.speculative_num_steps
        self.topk = eagle_worker.topk
        self.draft_attn_backend = eagle_worker.draft_attn_backend
        self.capture_bs = CAPTURE_BS
        self.num_tokens_per_bs = self.topk
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        self.draft_attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = self.draft_attn_backend.attn_backends[0].get_cuda_graph_seq_len_fill_value()
        d = dict(device=self.device)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, **d)
        self.out_cache_loc = torch.zeros(self.max_num_token * self.speculative_num_steps, dtype=torch.int64, **d)
        self.positions = torch.zeros(self.max_num_token, dtype=torch.int64, **d)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32, **d)
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32)
        self.topk_p = torch.zeros(self.max_bs, self.topk, dtype=torch.float64, **d)
        self.topk_index = torch.zeros(self.max_bs, self.topk, dtype=torch.int64, **d)
        self.hidden_states = torch.zeros(self.max_bs, HIDDEN, dtype=torch.float64, **d)
        self.graphs, self.output_buffers = {}, {}
        self.pool = graph_pool_handle(self.device)
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def _static(self):
        static = {"req_pool_indices": self.req_pool_indices, "out_cache_loc": self.out_cache_loc,
                  "positions": self.positions, "seq_lens": self.seq_lens, "topk_p": self.topk_p,
                  "topk_index": self.topk_index, "hidden_states": self.hidden_states}
        for i, backend in enumerate(self.draft_attn_backend.attn_backends):
            static[f"attn_backends[{i}].cache_seqlens"] = backend.decode_cuda_graph_metadata["cache_seqlens"]
            static[f"attn_backends[{i}].page_table_draft_decode"] = \
                backend.decode_cuda_graph_metadata["page_table_draft_decode"]
        return static

    def can_run(self, forward_batch):
        return forward_batch.batch_size <= self.max_bs

    def capture_one_batch_size(self, num_seqs: int):
        num_tokens = num_seqs * self.num_tokens_per_bs
        spec_info = EagleDraftInput(topk_p=self.topk_p[:num_seqs], topk_index=self.topk_index[:num_seqs],
                                    hidden_states=self.hidden_states[:num_seqs])
        forward_batch = ForwardBatch(
            batch_size=num_seqs, req_pool_indices=self.req_pool_indices[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs], seq_lens_cpu=self.seq_lens_cpu[:num_seqs],
            out_cache_loc=self.out_cache_loc[: num_tokens * self.speculative_num_steps],
            positions=self.positions[:num_tokens], spec_info=spec_info,
            req_to_token_pool=self.model_runner.req_to_token_pool, token_to_kv_pool=self.model_runner.token_to_kv_pool)

        def run_once():
            output_cache_loc_backup = forward_batch.out_cache_loc
            hidden_states_backup = forward_batch.spec_info.hidden_states
            ret = self.eagle_worker.draft_forward(forward_batch)
            forward_batch.out_cache_loc = output_cache_loc_backup
            forward_batch.spec_info.hidden_states = hidden_states_backup
            forward_batch.positions.sub_(self.eagle_worker.speculative_num_steps - 1)
            return ret

        self.draft_attn_backend.init_forward_metadata_capture_cuda_graph(forward_batch)
        kv = self.model_runner.token_to_kv_pool
        return capture(run_once, device=self.device, pool=self.pool, warmups=2, name=f"eagle draft [{num_seqs}]",
                       owner="EAGLEDraftCudaGraphRunner", static=self._static(),
                       state={"k_buffer": kv.k_buffer[0], "v_buffer": kv.v_buffer[0]})

    def replay(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
            self.positions.zero_()
            self.topk_p.zero_()
            self.topk_index.zero_()
            self.hidden_states.zero_()
            self.req_pool_indices.zero_()
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[: raw_num_token * self.speculative_num_steps].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        self.topk_p[:raw_bs].copy_(forward_batch.spec_info.topk_p)
        self.topk_index[:raw_bs].copy_(forward_batch.spec_info.topk_index)
        self.hidden_states[:raw_bs].copy_(forward_batch.spec_info.hidden_states)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        if bs != raw_bs:
            forward_batch.batch_size = bs
            forward_batch.seq_lens = self.seq_lens[:bs]
            forward_batch.req_pool_indices = self.req_pool_indices[:bs]
            forward_batch.positions = self.positions[:bs * self.num_tokens_per_bs]
        if bs != raw_bs:
            self.seq_lens_cpu.fill_(self.seq_len_fill_value)
        self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu[:raw_bs])
        forward_batch.seq_lens_cpu = self.seq_lens_cpu[:bs]
        self.draft_attn_backend.init_forward_metadata_replay_cuda_graph(forward_batch, bs)
        scores, tokens = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs)
        forward_batch.batch_size = raw_bs
        return scores[:raw_bs], tokens[:raw_bs]


# --- the workload -----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [3, 5, 4]
    num_rounds = 3

    def serve(use_cuda_graph):
        worker = EAGLEWorker(device, use_cuda_graph)        # the draft graphs are captured at startup
        runner = worker.draft_model_runner
        gen = generator(265210)
        kv = runner.token_to_kv_pool
        req_to_token = runner.req_to_token_pool.req_to_token
        next_slot = 1                                       # slot 0: padding
        seq_lens = []
        for r, plen in enumerate(prompts, start=1):        # the draft KV of each prompt (draft extend stand-in)
            slots = torch.arange(next_slot, next_slot + plen)
            next_slot += plen
            req_to_token[r, :plen] = slots.to(device=device, dtype=torch.int32)
            kv.k_buffer[0][slots.to(device)] = randn(plen, HIDDEN, gen=gen, device=device).double()
            kv.v_buffer[0][slots.to(device)] = randn(plen, HIDDEN, gen=gen, device=device).double()
            seq_lens.append(plen)
        topk_index = torch.tensor([[2], [7], [11]], dtype=torch.int64, device=device)
        outs = []
        for _ in range(num_rounds):
            bs = len(prompts)
            out_cache_loc = []
            for r in range(bs):                            # assign_draft_cache_locs
                slots = list(range(next_slot, next_slot + SPECULATIVE_NUM_STEPS))
                next_slot += SPECULATIVE_NUM_STEPS
                req_to_token[r + 1, seq_lens[r]: seq_lens[r] + SPECULATIVE_NUM_STEPS] = torch.tensor(
                    slots, dtype=torch.int32, device=device)
                out_cache_loc += slots
            sl = torch.tensor(seq_lens, dtype=torch.int32)
            spec_info = EagleDraftInput(
                topk_p=(torch.rand(bs, 1, generator=gen, dtype=torch.float64) * 0.5 + 0.5).to(device),
                topk_index=topk_index,
                hidden_states=randn(bs, HIDDEN, gen=gen, device=device).double())
            forward_batch = ForwardBatch(
                batch_size=bs, req_pool_indices=torch.arange(1, bs + 1, device=device),
                seq_lens=sl.to(device), seq_lens_cpu=sl.clone(),
                out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64, device=device),
                positions=(sl - 1).to(device=device, dtype=torch.int64), spec_info=spec_info,
                req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=kv)
            scores, tokens = worker.draft(forward_batch)
            outs += [scores.clone(), tokens.clone()]
            topk_index = tokens[:, 1:2].to(torch.int64)    # target verify stand-in: accept the first draft token
            seq_lens = [s + 1 for s in seq_lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
