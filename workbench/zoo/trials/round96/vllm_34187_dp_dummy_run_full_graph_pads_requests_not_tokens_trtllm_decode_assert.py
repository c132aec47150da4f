"""An idle DP rank's dummy run is padded to its peers' FULL-graph batch: the attention metadata gets the padded request count but the unpadded token count, and FlashInfer's TRTLLM decode path asserts.

Upstream: https://github.com/vllm-project/vllm/pull/34187 ("[Bugfix] Fix DP Attention Padding in Dummy Run",
vllm-project/vllm, merged, opened 2026-02-09; maintainer mirror of #34009 by benchislett), fixing the maintainer-filed
issues #32626 ("TRTLLM Attention Failure with DP/EP") and #33450 ("Attention Assertion": ``assert num_decode_tokens %
num_decodes == 0, "TRTLLM decode requires uniform query lengths per request."``). Read: both PR descriptions and both
issues; ``GPUModelRunner._dummy_run`` before the fix (stored copies: ``_build_attention_metadata(num_tokens=
num_tokens_unpadded, num_reqs=num_reqs_padded, ...)`` with ``pad_attn = cudagraph_runtime_mode == CUDAGraphMode.FULL``
used only for the ubatch slices) and after it (``num_tokens_padded=num_tokens_padded if pad_attn else None``); the
sibling reports #34064 (``execute_dummy_batch`` -> ``_dummy_run(1, uniform_decode=True)``) and #35243 (how
``split_decodes_and_prefills`` treats the zero-length padded requests of a uniform batch).
Symptom: DP + EP serving with the FlashInfer backend and TRTLLM decode attention (Blackwell) crashes on the rank that runs
a dummy batch while its peer decodes two or more requests: ``AssertionError: TRTLLM decode requires uniform query lengths
per request`` (``num_decode_tokens == 1``, ``num_decodes == 2``).
Mechanism: an idle DP rank must still run the step in lockstep (the MoE all2all), so ``execute_dummy_batch`` calls
``_dummy_run(1, uniform_decode=True)``. The DP sync pads the token count to the peers' (2), and the dispatcher picks the
uniform-decode FULL graph of that size, whose descriptor also pads the requests to 2. ``_dummy_run`` built the metadata
for that graph with ``num_reqs=num_reqs_padded`` but without ``num_tokens_padded``: ``num_actual_tokens`` stayed 1.
``split_decodes_and_prefills`` counts the zero-length padded request as a decode, so the TRTLLM builder sees 1 decode
token over 2 decodes. The normal step (``execute_model``) passes both padded counts; eager mode builds no metadata for
the dummy run at all.
Doctor: padded-shape-mismatch, at _dummy_run. The dummy run executes at the graph's padded size and combines the padded
request count with the real token count in one attention metadata.
Fix (upstream): ``_dummy_run`` passes ``num_tokens_padded=num_tokens_padded if pad_attn else None``, as the normal
execution path does.
Modelled: ``GPUModelRunner`` (``_dummy_run``, ``execute_dummy_batch``, ``execute_model``, ``capture_model``,
``_build_attention_metadata``) with its persistent input/metadata buffers, ``CudagraphDispatcher`` (uniform-decode FULL
sizes 1, 2, 4), the DP token sync (max across ranks), ``CommonAttentionMetadata``, ``split_decodes_and_prefills`` and
``FlashInferMetadataBuilder.build`` on the TRTLLM decode path with its uniformity assert. Stand-ins: the decoder is one
attention layer (paged KV cache, ``reshape_and_cache_flash`` with -1 padding slots, a torch
``trtllm_batch_decode_with_kv_cache``) plus an MLP; the two DP ranks run in one process one after the other; the MoE
all2all that forces the lockstep is left out.
Workload: DP 2; rank 0 decodes requests A and B (A alone in the middle step) from a seeded paged KV cache, rank 1 is
idle and runs dummy batches. Served: both ranks capture FULL graphs at 1, 2 and 4 tokens, then three steps (rank 0 with
2, 1, 2 requests, padded to the DP maximum). Eager: the same steps without graphs. The bug raises the AssertionError in
rank 1's first dummy run; the fix's rank-0 hidden states equal eager.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/34187"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_dummy_run"
SYMPTOM = ("DP+EP serving with FlashInfer TRTLLM decode crashes on the idle rank: its dummy run is padded to the peers' "
           "FULL graph (2 requests) but builds attention metadata with 1 token, and the TRTLLM decode assert fires")

DP_SIZE, HIDDEN, VOCAB = 2, 4, 16
BLOCK_SIZE, NUM_BLOCKS, MAX_NUM_REQS, BLOCKS_PER_REQ = 4, 8, 4, 3
MAX_MODEL_LEN = BLOCK_SIZE * BLOCKS_PER_REQ
CUDAGRAPH_CAPTURE_SIZES = (1, 2, 4)
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


class CUDAGraphMode:
    NONE, FULL = "NONE", "FULL"


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


class CudagraphDispatcher:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def dispatch(self, num_tokens: int, uniform_decode: bool):
        if not self.enabled or not uniform_decode or num_tokens > CUDAGRAPH_CAPTURE_SIZES[-1]:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        padded = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens)
        return CUDAGraphMode.FULL, BatchDescriptor(padded, num_reqs=padded, uniform=True)   # query len 1


def coordinate_batch_across_dp(num_tokens_per_rank: list[int]) -> int:
    """DP sync: every rank runs the step at the largest token count (idle ranks count their 1-token dummy)."""
    return max(num_tokens_per_rank)


# --- vllm/v1/attention/backends/utils.py, flashinfer.py ----------------------------------------------------------------

@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


def split_decodes_and_prefills(cam: CommonAttentionMetadata, decode_threshold: int = 1):
    query_lens = cam.query_start_loc_cpu[1:] - cam.query_start_loc_cpu[:-1]
    if bool(((query_lens == query_lens[0]) | (query_lens == 0)).all()) and int(query_lens[0]) <= decode_threshold:
        # a padded uniform batch: zero-length (padding) requests count as decodes (matches the captured size)
        return cam.num_reqs, 0, cam.num_actual_tokens, 0
    is_prefill = query_lens > decode_threshold
    first_prefill = int(is_prefill.int().argmax()) if bool(is_prefill.any()) else cam.num_reqs
    num_decode_tokens = int(cam.query_start_loc_cpu[first_prefill])
    return first_prefill, cam.num_reqs - first_prefill, num_decode_tokens, cam.num_actual_tokens - num_decode_tokens


@dataclass
class FlashInferMetadata:
    num_decodes: int
    q_len_per_req: int
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor


class FlashInferMetadataBuilder:
    use_trtllm_decode_attention = True

    def build(self, common_prefix_len: int, cam: CommonAttentionMetadata) -> FlashInferMetadata:
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(cam)
        assert num_prefills == 0, "the model runs decode-only batches here"
        if self.use_trtllm_decode_attention and num_decodes > 0:
            assert num_decode_tokens % num_decodes == 0, (
                "TRTLLM decode requires uniform query lengths per request.")
        return FlashInferMetadata(num_decodes, num_decode_tokens // num_decodes, cam.seq_lens,
                                  cam.block_table_tensor, cam.slot_mapping)


def reshape_and_cache_flash(key, value, kv_cache, slot_mapping):
    trash = NUM_BLOCKS * BLOCK_SIZE                       # the slot that padding writes land in (skipped upstream)
    slots = torch.where(slot_mapping >= 0, slot_mapping, torch.full_like(slot_mapping, trash))
    kv_cache.view(-1, 2, HIDDEN).index_copy_(0, slots, torch.stack([key, value], dim=1))


def trtllm_batch_decode_with_kv_cache(query, kv_cache, block_tables, seq_lens, q_len_per_req):
    assert q_len_per_req == 1 and query.shape[0] == block_tables.shape[0]
    kv = kv_cache[block_tables].reshape(block_tables.shape[0], MAX_MODEL_LEN, 2, HIDDEN)
    keys, values = kv[:, :, 0], kv[:, :, 1]
    valid = torch.arange(MAX_MODEL_LEN, device=query.device)[None] < seq_lens[:, None]
    scores = (keys @ query[:, :, None]).squeeze(-1).masked_fill(~valid, -1e30)
    probs = torch.softmax(scores, -1) * valid.any(-1, keepdim=True)
    return (probs[:, :, None] * values).sum(1)


# --- the model: one attention layer and an MLP -------------------------------------------------------------------------

class TinyDecoder:
    def __init__(self, device):
        gen = generator(34187)
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.5).to(DTYPE)  # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN), r(MAX_MODEL_LEN, HIDDEN)
        self.wq, self.wk, self.wv, self.wo, self.w_mlp = (r(HIDDEN, HIDDEN) for _ in range(5))

    def forward(self, input_ids, positions, kv_cache, attn_metadata: FlashInferMetadata | None):
        h = self.embed[input_ids] + self.pos_embed[positions]
        if attn_metadata is None:                       # profile/dummy run without attention metadata
            attn = torch.zeros_like(h)
        else:
            reshape_and_cache_flash(h @ self.wk, h @ self.wv, kv_cache, attn_metadata.slot_mapping)
            attn = trtllm_batch_decode_with_kv_cache(h @ self.wq, kv_cache, attn_metadata.block_tables,
                                                     attn_metadata.seq_lens, attn_metadata.q_len_per_req)
        h = h + attn @ self.wo
        return h + torch.tanh(h @ self.w_mlp)


# --- vllm/v1/worker/gpu_model_runner.py --------------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, dp_rank: int, device, use_cudagraph: bool, kv_init: torch.Tensor):
        self.dp_rank, self.device = dp_rank, device
        self.model = TinyDecoder(device)
        self.cudagraph_dispatcher = CudagraphDispatcher(use_cudagraph)
        self.attn_metadata_builder = FlashInferMetadataBuilder()
        self.kv_cache = kv_init.clone()                                     # [NUM_BLOCKS + 1 (trash), BS, 2, H]
        n = CUDAGRAPH_CAPTURE_SIZES[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), PAD_SLOT_ID, dtype=torch.long, device=device)
        self.seq_lens_cpu = torch.zeros(MAX_NUM_REQS, dtype=torch.long)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.query_start_loc_cpu = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.long)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, BLOCKS_PER_REQ, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple] = {}

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, num_tokens_padded=None,
                                  for_cudagraph_capture=False):
        self.seq_lens.copy_(self.seq_lens_cpu.to(self.device))
        self.query_start_loc.copy_(self.query_start_loc_cpu.to(self.device))
        cam = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:num_reqs + 1], query_start_loc_cpu=self.query_start_loc_cpu[:num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs], num_reqs=num_reqs,
            num_actual_tokens=num_tokens_padded if num_tokens_padded is not None else num_tokens,
            max_query_len=max_query_len, block_table_tensor=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens_padded if num_tokens_padded is not None else num_tokens])
        return self.attn_metadata_builder.build(0, cam)

    def _run(self, mode, batch_desc, attn_metadata, num_tokens_unpadded, is_graph_capturing=False):
        n = batch_desc.num_tokens
        fwd = lambda: self.model.forward(self.input_ids[:n], self.positions[:n], self.kv_cache, attn_metadata)  # noqa: E731
        if is_graph_capturing:
            self.graphs[n] = capture(fwd, device=self.device, warmups=1, name=f"dp{self.dp_rank}_decode_{n}",
                                     owner=f"GPUModelRunner(dp_rank={self.dp_rank})",
                                     static={"input_ids": self.input_ids, "positions": self.positions,
                                             "slot_mapping": self.slot_mapping, "seq_lens": self.seq_lens,
                                             "block_table": self.block_table},
                                     state={"kv_cache": self.kv_cache})
            return None
        if mode == CUDAGraphMode.FULL:
            g, out = self.graphs[n]
            return replay(g, out, real=num_tokens_unpadded, size=n,
                          padded={"input_ids": self.input_ids, "positions": self.positions})
        return fwd()

    @torch.inference_mode()
    def _dummy_run(self, num_tokens, cudagraph_runtime_mode=None, uniform_decode=False, is_graph_capturing=False,
                   num_tokens_across_dp=None):
        num_tokens_unpadded = num_tokens
        max_query_len = 1 if uniform_decode else num_tokens
        num_reqs = min(num_tokens, MAX_NUM_REQS) if uniform_decode else 1
        mode, batch_desc = self.cudagraph_dispatcher.dispatch(max(num_tokens, num_tokens_across_dp or 0), uniform_decode)
        if cudagraph_runtime_mode is not None:
            mode = cudagraph_runtime_mode
        num_tokens_padded = batch_desc.num_tokens
        num_reqs_padded = batch_desc.num_reqs if batch_desc.num_reqs is not None else num_reqs
        self.slot_mapping[:num_tokens_padded].fill_(PAD_SLOT_ID)
        attn_metadata = None
        if mode == CUDAGraphMode.FULL:
            self.seq_lens_cpu[:num_reqs] = max_query_len
            self.seq_lens_cpu[num_reqs:] = 0
            self.query_start_loc_cpu[1:num_reqs + 1] = torch.arange(1, num_reqs + 1) * max_query_len
            self.query_start_loc_cpu[num_reqs + 1:] = num_reqs * max_query_len
            pad_attn = mode == CUDAGraphMode.FULL
            if _variant == "bug":
                attn_metadata = self._build_attention_metadata(
                    num_tokens=num_tokens_unpadded, num_reqs=num_reqs_padded, max_query_len=max_query_len,
                    for_cudagraph_capture=is_graph_capturing)
            else:
                attn_metadata = self._build_attention_metadata(
                    num_tokens=num_tokens_unpadded, num_tokens_padded=num_tokens_padded if pad_attn else None,
                    num_reqs=num_reqs_padded, max_query_len=max_query_len, for_cudagraph_capture=is_graph_capturing)
        return self._run(mode, batch_desc, attn_metadata, num_tokens_unpadded, is_graph_capturing)

    def capture_model(self):
        for size in CUDAGRAPH_CAPTURE_SIZES:
            self._dummy_run(size, cudagraph_runtime_mode=CUDAGraphMode.FULL, uniform_decode=True, is_graph_capturing=True)

    def execute_dummy_batch(self, num_tokens_across_dp):
        self._dummy_run(1, uniform_decode=True, num_tokens_across_dp=num_tokens_across_dp)

    @torch.inference_mode()
    def execute_model(self, requests, num_tokens_across_dp):
        """``requests``: (token id, context length before this token, block ids) per decoding request."""
        num_reqs = len(requests)
        mode, batch_desc = self.cudagraph_dispatcher.dispatch(max(num_reqs, num_tokens_across_dp), True)
        num_tokens_padded = batch_desc.num_tokens if mode == CUDAGraphMode.FULL else num_reqs
        num_reqs_padded = batch_desc.num_reqs if mode == CUDAGraphMode.FULL else num_reqs
        ids, pos, slots = [], [], []
        self.seq_lens_cpu.zero_()
        for i, (token, ctx, blocks) in enumerate(requests):
            ids.append(token), pos.append(ctx), slots.append(blocks[ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE)
            self.seq_lens_cpu[i] = ctx + 1
            self.block_table[i].copy_(torch.tensor(blocks, dtype=torch.long).to(self.device))
        self.input_ids[:num_reqs].copy_(torch.tensor(ids).to(self.device))
        self.positions[:num_reqs].copy_(torch.tensor(pos).to(self.device))
        self.slot_mapping[:num_reqs].copy_(torch.tensor(slots).to(self.device))
        self.slot_mapping[num_reqs:num_tokens_padded].fill_(PAD_SLOT_ID)
        self.query_start_loc_cpu[1:num_reqs + 1] = torch.arange(1, num_reqs + 1)
        self.query_start_loc_cpu[num_reqs + 1:] = num_reqs
        attn_metadata = self._build_attention_metadata(num_tokens=num_reqs, num_tokens_padded=num_tokens_padded,
                                                       num_reqs=num_reqs_padded, max_query_len=1)
        out = self._run(mode, BatchDescriptor(num_tokens_padded, num_reqs_padded, True), attn_metadata, num_reqs)
        return out[:num_reqs].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(341870)
    kv_init = randn(NUM_BLOCKS + 1, BLOCK_SIZE, 2, HIDDEN, gen=gen, device=device).to(DTYPE)
    # rank 0's requests: A (blocks 0-2, 5 tokens cached), B (blocks 3-5, 3 tokens cached)
    blocks = {"A": [0, 1, 2], "B": [3, 4, 5]}
    schedule = [["A", "B"], ["A"], ["A", "B"]]
    tokens = torch.randint(0, VOCAB, (len(schedule), 2), generator=gen).tolist()

    def serve(use_cudagraph):
        runners = [GPUModelRunner(r, device, use_cudagraph, kv_init) for r in range(DP_SIZE)]
        if use_cudagraph:
            for runner in runners:
                runner.capture_model()
        ctx = {"A": 5, "B": 3}
        outputs = []
        for step, names in enumerate(schedule):
            num_tokens_across_dp = coordinate_batch_across_dp([len(names), 1])    # rank 1 idle: a 1-token dummy
            reqs = [(tokens[step][i], ctx[nm], blocks[nm]) for i, nm in enumerate(names)]
            outputs.append(runners[0].execute_model(reqs, num_tokens_across_dp))
            runners[1].execute_dummy_batch(num_tokens_across_dp)
            for nm in names:
                ctx[nm] += 1
        return outputs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
