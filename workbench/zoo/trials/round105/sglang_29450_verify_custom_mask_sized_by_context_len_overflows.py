"""SGLang Triton attention backend, EAGLE target verify under CUDA graphs: the graph's tree-mask buffer is sized for
``max_num_tokens * context_len`` cells, but a verify batch's mask has ``num_draft_tokens * (seq_len +
num_draft_tokens)`` cells per request; a full verify batch whose requests are close to the context length no longer
fits.

Upstream: https://github.com/sgl-project/sglang/pull/29450 ("Fix cuda_graph_custom_mask undersize overflowing on
long-context spec verify", sgl-project/sglang, by ubehera, opened 2026-06-26, open when read, not merged; the aiter/wave
sibling is #29581, the general issue is #29695).
Read: the PR description (``init_cuda_graph_state`` sizes ``cuda_graph_custom_mask`` as ``max_num_tokens *
max_context_len``; ``_update_target_verify_buffers`` builds the TARGET_VERIFY mask with length ``num_draft_tokens *
(seq_len + num_draft_tokens)``; at ``seq_len`` near ``max_context_len`` with a full verify batch the
``custom_mask[...] = spec_info.custom_mask`` assignment raises a size-mismatch RuntimeError; fix: size the buffer
``max_num_tokens * (max_context_len + (num_draft_tokens or 0))``), and ``python/sglang/srt/layers/attention/
triton_backend.py`` at stored commit 00858422 (still the old sizing): ``TritonAttnBackend.__init__``,
``init_cuda_graph_state``, ``_fill_kv_indptr_and_indices``, ``_update_target_verify_buffers``,
``init_forward_metadata_out_graph``, ``_apply_cuda_graph_metadata``, ``_build_cuda_graph_forward_metadata``,
``init_forward_metadata`` (the eager TARGET_VERIFY branch: ``custom_mask = spec_info.custom_mask``, ``mask_indptr``
from ``num_draft_tokens * (seq_lens + num_draft_tokens)``), ``get_cuda_graph_seq_len_fill_value`` (1) and
``forward_extend`` (``set_kv_buffer`` at ``out_cache_loc``, then ``extend_attention_fwd`` with the custom mask); the
NGRAM mask kernel review of #32407 for the per-request layout (``D * (seq_lens[b] + D)`` cells, row-major, prefix
columns first).
Symptom: EAGLE speculative decoding with ``--attention-backend triton`` and CUDA graphs crashes in the verify step of
long-context requests (``RuntimeError`` from the mask copy in ``_update_target_verify_buffers``); without CUDA graphs
(eager verify uses the batch's own mask tensor) it serves.
Mechanism: the verify graph reads its tree mask from one preallocated ``uint8`` buffer that replay prep fills with the
batch's mask. Its size assumes every request contributes at most ``num_draft_tokens * context_len`` cells, but each
draft row also covers the ``num_draft_tokens`` draft columns, so a batch of ``max_bs`` requests averaging more than
``context_len - num_draft_tokens`` tokens of prefix needs more cells than the buffer has.
Doctor: undersized-buffer, at init_cuda_graph_state. The graph's static mask buffer is allocated too small for the
data a legal verify batch copies into it before the replay.
Fix (upstream): size ``cuda_graph_custom_mask`` as ``max_num_tokens * (max_context_len + num_draft_tokens)``.
Modelled: ``TritonAttnBackend`` (the methods listed, TARGET_VERIFY only), a ``CudaGraphRunner`` for TARGET_VERIFY
(capture sizes 1 and 2, descending capture into one pool, two warm-up runs, padded rows reset to the seq_len fill
value / slot 0, ``init_forward_metadata_out_graph`` before every replay) and the eager ``ModelRunner`` path.
Stand-ins: a one-layer model (token + position embeddings, qkv, one RadixAttention, o_proj, lm_head) over a paged KV
pool; ``extend_attention_fwd`` as a fixed-width gather attention over the prefix (``kv_indices``) and the extend K/V,
masked by the flat custom mask at ``mask_indptr`` (indices clamped to the buffer); chain drafts (topk 1) with a fixed
draft table and fixed acceptance instead of the draft model and the sampler; prompts written to the KV pool directly;
float64.
Workload: context_len 12, num_draft_tokens 3, capture sizes [1, 2] (mask buffer 6 * 12 = 72 cells). Prompts A (5) and
B (6). Verify [A, B] (prefixes 5, 6: 51 cells), verify [A] (8: 33), verify [A, B] (11, 9: 78 cells), verify [B]
(12: 45); every verify commits 3 tokens. Bug: the third verify raises RuntimeError in ``_update_target_verify_buffers``
("The expanded size of the tensor (72) must match the existing size (78) ..."). Fix (90 cells): the 18 verify logit
rows of the four steps equal eager (max error 0). The same on an H100 (device="cuda").
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay
from workbench.engine import graph_pool_handle

UPSTREAM = "https://github.com/sgl-project/sglang/pull/29450"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "init_cuda_graph_state"
SYMPTOM = ("EAGLE target verify on CUDA graphs with the Triton backend raises a size-mismatch RuntimeError for long "
           "requests: the graph's custom-mask buffer holds max_num_tokens * context_len cells, a verify mask needs "
           "num_draft_tokens * (seq_len + num_draft_tokens) per request")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM = 32, 16, 2, 8
CONTEXT_LEN, NUM_DRAFT_TOKENS, REQ_TO_TOKEN_EXTRA = 12, 3, 7
CUDA_GRAPH_BS = [1, 2]
DTYPE = torch.float64

_variant = "bug"


class ForwardMode:
    TARGET_VERIFY = "target_verify"


@dataclasses.dataclass
class EagleVerifyInput:
    draft_token: torch.Tensor
    custom_mask: torch.Tensor          # bool, flat: per request D rows x (seq_len + D) columns
    draft_token_num: int


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: str
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor             # prefix lengths (tokens already in the KV cache)
    out_cache_loc: torch.Tensor
    spec_info: EagleVerifyInput
    attn_backend: object = None


@dataclasses.dataclass
class ForwardMetadata:
    max_extend_len: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor


# --- python/sglang/srt/layers/attention/triton_backend.py (TARGET_VERIFY paths) -------------------------------------

def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices):
    """Stand-in for the Triton kernel: ``kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], j]``."""
    width = req_to_token.shape[1]
    j = torch.arange(width, device=seq_lens.device)
    rows = req_to_token[req_pool_indices.long()]                       # [bs, width]
    dst = (kv_indptr[:-1, None].long() + j[None, :]).clamp(max=kv_indices.numel() - 1)
    keep = j[None, :] < seq_lens[:, None]
    kv_indices.scatter_(0, dst[keep], rows[keep].to(kv_indices.dtype))


def extend_attention_fwd(q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                         mask_indptr, max_extend_len, sm_scale, prefix_width):
    """Uniform-extend attention (every request has ``max_extend_len`` query rows): each row attends to its request's
    prefix (``kv_indices``) and extend K/V, as the flat custom mask at ``mask_indptr`` allows."""
    T, D = q.shape[0], max_extend_len
    rows = torch.arange(T, device=q.device)
    req, r_local = rows // D, rows % D
    prefix_len = (kv_indptr[1:] - kv_indptr[:-1])[req].long()           # [T]
    row_len = prefix_len + D
    base = mask_indptr[req].long() + r_local * row_len
    j = torch.arange(prefix_width, device=q.device)
    kv_pos = (kv_indptr[req].long()[:, None] + j[None, :]).clamp(0, kv_indices.numel() - 1)
    slots = kv_indices[kv_pos].long()                                   # [T, Wp]
    k_pre, v_pre = k_buffer[slots], v_buffer[slots]                    # [T, Wp, H, Dh]
    last = custom_mask.numel() - 1
    ok_pre = (j[None, :] < prefix_len[:, None]) & (custom_mask[(base[:, None] + j[None, :]).clamp(0, last)] != 0)
    e = torch.arange(D, device=q.device)
    k_ext = k_extend.view(-1, D, N_HEADS, HEAD_DIM)[req]               # [T, D, H, Dh]
    v_ext = v_extend.view(-1, D, N_HEADS, HEAD_DIM)[req]
    ok_ext = custom_mask[(base[:, None] + prefix_len[:, None] + e[None, :]).clamp(0, last)] != 0
    keys, vals = torch.cat([k_pre, k_ext], 1), torch.cat([v_pre, v_ext], 1)
    allowed = torch.cat([ok_pre, ok_ext], 1)                           # [T, Wp + D]
    scores = torch.einsum("thd,tkhd->thk", q, keys) * sm_scale
    probs = scores.masked_fill(~allowed[:, None, :], float("-inf")).softmax(-1)
    o.copy_(torch.einsum("thk,tkhd->thd", probs, vals))


class TritonAttnBackend:
    def __init__(self, model_runner):
        max_bs = model_runner.req_to_token_pool.size
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.num_draft_tokens = model_runner.server_args.speculative_num_draft_tokens
        self.max_context_len = model_runner.model_config.context_len
        self.device = model_runner.device
        self.kv_indptr = torch.zeros((max_bs + 1,), dtype=torch.int32, device=self.device)
        self.qo_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
        self.mask_indptr = torch.zeros((max_bs + 1,), dtype=torch.int64, device=self.device)
        self.forward_metadata: ForwardMetadata = None
        self.cuda_graph_custom_mask = None

    def _fill_kv_indptr_and_indices(self, bs, seq_lens, req_pool_indices, kv_indices):
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1:] = torch.cumsum(seq_lens, dim=0)
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)
        return kv_indptr

    def _update_target_verify_buffers(self, bs, seq_lens, req_pool_indices, spec_info):
        qo_indptr = self.qo_indptr[: bs + 1]
        qo_indptr[: bs + 1] = torch.arange(0, (1 + bs) * self.num_draft_tokens, step=self.num_draft_tokens,
                                           dtype=torch.int32, device=self.device)
        kv_indptr = self._fill_kv_indptr_and_indices(bs, seq_lens, req_pool_indices, self.cuda_graph_kv_indices)
        custom_mask = self.cuda_graph_custom_mask
        if spec_info is not None and getattr(spec_info, "custom_mask", None) is not None:
            custom_mask[: spec_info.custom_mask.shape[0]] = spec_info.custom_mask
        else:
            custom_mask = None
        seq_mask_len = self.num_draft_tokens * (seq_lens + self.num_draft_tokens)
        mask_indptr = self.mask_indptr[: bs + 1]
        mask_indptr[1 : bs + 1] = torch.cumsum(seq_mask_len, dim=0)
        return qo_indptr, kv_indptr, custom_mask, mask_indptr

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        bs = forward_batch.batch_size
        self._apply_cuda_graph_metadata(bs, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                        forward_batch.forward_mode, forward_batch.spec_info)
        if in_capture:
            self.forward_metadata = self._build_cuda_graph_forward_metadata(bs, forward_batch.forward_mode,
                                                                            forward_batch.spec_info)

    def _apply_cuda_graph_metadata(self, bs, req_pool_indices, seq_lens, forward_mode, spec_info):
        assert forward_mode == ForwardMode.TARGET_VERIFY
        bs = len(req_pool_indices)
        self._update_target_verify_buffers(bs, seq_lens, req_pool_indices, spec_info)

    def _build_cuda_graph_forward_metadata(self, bs, forward_mode, spec_info) -> ForwardMetadata:
        custom_mask = (self.cuda_graph_custom_mask if spec_info is not None
                       and getattr(spec_info, "custom_mask", None) is not None else None)
        return ForwardMetadata(max_extend_len=self.num_draft_tokens, kv_indptr=self.kv_indptr[: bs + 1],
                               kv_indices=self.cuda_graph_kv_indices, qo_indptr=self.qo_indptr[: bs + 1],
                               custom_mask=custom_mask, mask_indptr=self.mask_indptr[: bs + 1])

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager TARGET_VERIFY: fresh kv_indices, the batch's own mask."""
        bs = len(forward_batch.req_pool_indices)
        qo_indptr = torch.arange(0, (1 + bs) * self.num_draft_tokens, step=self.num_draft_tokens,
                                 dtype=torch.int32, device=self.device)
        seq_lens_sum = int(forward_batch.seq_lens.sum())
        kv_indices = torch.empty(seq_lens_sum, dtype=torch.int64, device=self.device)
        kv_indptr = self._fill_kv_indptr_and_indices(bs, forward_batch.seq_lens, forward_batch.req_pool_indices,
                                                     kv_indices)
        custom_mask = forward_batch.spec_info.custom_mask
        seq_mask_len = self.num_draft_tokens * (forward_batch.seq_lens + self.num_draft_tokens)
        mask_indptr = self.mask_indptr
        mask_indptr[1 : bs + 1] = torch.cumsum(seq_mask_len[:bs], dim=0)
        self.forward_metadata = ForwardMetadata(self.num_draft_tokens, kv_indptr, kv_indices, qo_indptr,
                                                custom_mask, mask_indptr[: bs + 1])

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.cuda_graph_kv_indices = torch.zeros((max_num_tokens * self.max_context_len), dtype=torch.int64,
                                                 device=self.device)
        if _variant == "bug":
            mask_len = max_num_tokens * self.max_context_len
        else:
            mask_len = max_num_tokens * (self.max_context_len + (self.num_draft_tokens or 0))
        self.cuda_graph_custom_mask = torch.zeros((mask_len,), dtype=torch.uint8, device=self.device)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch):
        o = torch.empty_like(q)
        self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        md = self.forward_metadata
        extend_attention_fwd(q, k.contiguous(), v.contiguous(), o, *self.token_to_kv_pool.get_kv_buffer(layer),
                             md.qo_indptr, md.kv_indptr, md.kv_indices, md.custom_mask, md.mask_indptr,
                             md.max_extend_len, layer.scaling, prefix_width=self.req_to_token.shape[1])
        return o


# --- memory pools and the model (stand-in for a one-layer decoder) --------------------------------------------------

class ReqToTokenPool:
    def __init__(self, size, width, device):
        self.size = size
        self.req_to_token = torch.zeros((size + 1, width), dtype=torch.int32, device=device)   # row 0: reserved


class MHATokenToKVPool:
    def __init__(self, num_slots, device):
        self.k_buffer = torch.zeros(num_slots, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.v_buffer = torch.zeros(num_slots, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)

    def set_kv_buffer(self, layer, loc, k, v):
        self.k_buffer[loc.long()] = k
        self.v_buffer[loc.long()] = v

    def get_kv_buffer(self, layer):
        return self.k_buffer, self.v_buffer


class RadixAttention:
    scaling = HEAD_DIM ** -0.5

    def forward(self, q, k, v, forward_batch):
        return forward_batch.attn_backend.forward_extend(q, k, v, self, forward_batch)


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(29450)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed_tokens, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(CONTEXT_LEN + REQ_TO_TOKEN_EXTRA, HIDDEN)
        self.qkv_proj, self.o_proj, self.lm_head = r(HIDDEN, 3 * HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, VOCAB)
        self.attn = RadixAttention()

    def kv(self, tokens, positions):
        h = self.embed_tokens[tokens] + self.pos_embed[positions]
        return (h @ self.qkv_proj).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed_tokens[input_ids] + self.pos_embed[positions]
        q, k, v = (h @ self.qkv_proj).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        h = h + self.attn.forward(q, k, v, forward_batch).reshape(-1, HIDDEN) @ self.o_proj
        return rms_norm(h) @ self.lm_head


# --- python/sglang/srt/model_executor/cuda_graph_runner.py (TARGET_VERIFY, reduced) ---------------------------------

class CudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner, self.device = model_runner, model_runner.device
        self.capture_bs = CUDA_GRAPH_BS
        self.max_bs = max(self.capture_bs)
        self.num_tokens_per_bs = model_runner.server_args.speculative_num_draft_tokens
        self.max_num_token = self.max_bs * self.num_tokens_per_bs
        backend = model_runner.attn_backend
        backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = backend.get_cuda_graph_seq_len_fill_value()
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros((self.max_num_token,), **i64)
        self.positions = torch.zeros((self.max_num_token,), **i64)
        self.out_cache_loc = torch.zeros((self.max_num_token,), **i64)
        self.req_pool_indices = torch.zeros((self.max_bs,), **i64)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, **i64)
        self.custom_mask = torch.ones(((self.seq_len_fill_value + self.num_tokens_per_bs) * self.num_tokens_per_bs
                                       * self.max_bs,), dtype=torch.bool, device=self.device)
        self.graphs, self.output_buffers = {}, {}
        self.capture()

    def _forward_batch(self, bs, spec_info):
        n = bs * self.num_tokens_per_bs
        return ForwardBatch(ForwardMode.TARGET_VERIFY, bs, self.input_ids[:n], self.positions[:n],
                            self.req_pool_indices[:bs], self.seq_lens[:bs], self.out_cache_loc[:n], spec_info,
                            self.model_runner.attn_backend)

    def capture(self):
        pool = graph_pool_handle(self.device)
        backend = self.model_runner.attn_backend
        static = {"input_ids": self.input_ids, "positions": self.positions, "out_cache_loc": self.out_cache_loc,
                  "req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens,
                  "kv_indptr": backend.kv_indptr, "cuda_graph_kv_indices": backend.cuda_graph_kv_indices,
                  "cuda_graph_custom_mask": backend.cuda_graph_custom_mask, "mask_indptr": backend.mask_indptr}
        kv = self.model_runner.token_to_kv_pool
        for bs in reversed(self.capture_bs):
            spec_info = EagleVerifyInput(None, self.custom_mask, self.num_tokens_per_bs)
            forward_batch = self._forward_batch(bs, spec_info)
            backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)
            model = self.model_runner.model

            def run_once(fb=forward_batch):
                return model.forward(fb.input_ids, fb.positions, fb)

            self.graphs[bs], self.output_buffers[bs] = capture(
                run_once, device=self.device, pool=pool, warmups=2, static=static,
                state={"k_buffer": kv.k_buffer, "v_buffer": kv.v_buffer}, owner="CudaGraphRunner",
                name=f"target verify bs {bs}")

    def replay(self, forward_batch: ForwardBatch):
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
            self.req_pool_indices.zero_()
        self.input_ids[:raw_num_token].copy_(forward_batch.input_ids)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        self.out_cache_loc[:raw_num_token].copy_(forward_batch.out_cache_loc)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.model_runner.attn_backend.init_forward_metadata_out_graph(
            self._forward_batch(bs, forward_batch.spec_info), in_capture=False)
        out = replay(self.graphs[bs], self.output_buffers[bs], real=raw_num_token, size=bs * self.num_tokens_per_bs)
        return out[:raw_num_token]


@dataclasses.dataclass
class ServerArgs:
    speculative_num_draft_tokens: int = NUM_DRAFT_TOKENS


@dataclasses.dataclass
class ModelConfig:
    context_len: int = CONTEXT_LEN


class ModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device, self.server_args, self.model_config = device, ServerArgs(), ModelConfig()
        width = CONTEXT_LEN + REQ_TO_TOKEN_EXTRA           # req_to_token keeps speculative headroom
        self.req_to_token_pool = ReqToTokenPool(4, width, device)
        self.token_to_kv_pool = MHATokenToKVPool(1 + 4 * width, device)           # slot 0: padding dummy
        self.model = LlamaForCausalLM(device)
        self.attn_backend = TritonAttnBackend(self)
        self.graph_runner = CudaGraphRunner(self) if use_cuda_graph else None

    def forward(self, forward_batch: ForwardBatch):
        forward_batch.attn_backend = self.attn_backend
        if self.graph_runner is not None and forward_batch.batch_size <= self.graph_runner.max_bs:
            return self.graph_runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


# --- the serving loop (stand-in for the scheduler and the EAGLE worker) ---------------------------------------------

def build_tree_kernel_efficient(seq_lens, draft_token_num, device):
    """Chain drafts (topk 1): each draft row sees the whole prefix and the drafts up to itself."""
    masks = []
    for s in seq_lens:
        m = torch.ones(draft_token_num, s + draft_token_num, dtype=torch.bool)
        m[:, s:] = torch.tril(torch.ones(draft_token_num, draft_token_num, dtype=torch.bool))
        masks.append(m.flatten())
    return torch.cat(masks).to(device)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    steps = [["A", "B"], ["A"], ["A", "B"], ["B"]]

    def serve(use_cuda_graph):
        runner = ModelRunner(device, use_cuda_graph)
        gen = generator(105)
        pool_rows = runner.req_to_token_pool.req_to_token
        width = pool_rows.shape[1]
        reqs = {}
        for row, (name, n) in enumerate((("A", 5), ("B", 6)), start=1):
            pool_rows[row] = (1 + (row - 1) * width + torch.arange(width)).to(torch.int32)
            prompt = torch.randint(0, VOCAB, (n,), generator=gen).to(device)
            _, k, v = runner.model.kv(prompt, torch.arange(n, device=device))
            runner.token_to_kv_pool.set_kv_buffer(None, pool_rows[row, :n], k, v)      # prefill, written directly
            reqs[name] = dict(row=row, len=n)
        outs = []
        for step in steps:
            D = NUM_DRAFT_TOKENS
            ids, pos, loc = [], [], []
            for name in step:
                req = reqs[name]
                ids += torch.randint(0, VOCAB, (D,), generator=gen).tolist()       # last token + drafts
                pos += [req["len"] + j for j in range(D)]
                loc += pool_rows[req["row"], req["len"]:req["len"] + D].tolist()
            seq_lens = [reqs[name]["len"] for name in step]
            i64 = dict(dtype=torch.int64, device=device)
            spec_info = EagleVerifyInput(torch.tensor(ids, **i64),
                                         build_tree_kernel_efficient(seq_lens, D, device), D)
            batch = ForwardBatch(ForwardMode.TARGET_VERIFY, len(step), torch.tensor(ids, **i64),
                                 torch.tensor(pos, **i64), torch.tensor([reqs[n]["row"] for n in step], **i64),
                                 torch.tensor(seq_lens, **i64), torch.tensor(loc, **i64), spec_info)
            outs.append(runner.forward(batch).clone())
            for name in step:
                reqs[name]["len"] += D                     # all drafts accepted: D tokens committed
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
