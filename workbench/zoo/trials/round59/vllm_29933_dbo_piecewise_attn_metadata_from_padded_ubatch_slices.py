"""DBO with PIECEWISE graphs builds attention metadata from the padded microbatch slices (padded tokens, real requests).

Upstream: https://github.com/vllm-project/vllm/pull/29933 ("[BugFix] Fix DBO assert `assert B_block_table == B_q`"),
fixing a regression from https://github.com/vllm-project/vllm/pull/28579 (pad for CUDA graphs before building the
attention metadata).
Symptom: ``tests/v1/distributed/test_dbo.py`` fails on B200 with ``AssertionError`` at ``assert B_block_table ==
B_q`` in the CUTLASS MLA decode. It passed on H100 only because those backends do not check the two shapes.
Mechanism: ``GPUModelRunner.execute_model`` pads the batch to the dispatched graph size (``num_tokens_padded =
batch_desc.num_tokens``). A PIECEWISE descriptor carries no request count, so ``num_reqs_padded = num_reqs``.
``maybe_create_ubatch_slices`` returns ``(ubatch_slices, ubatch_slices_padded)``. ``_pad_out_ubatch_slices`` stretches
the last microbatch's ``token_slice`` to ``num_tokens_padded`` and its ``request_slice`` to ``num_reqs_padded``.
After #28579, the padded slices went to ``_build_attention_metadata`` whatever the mode was.
``split_attn_metadata`` / ``_make_metadata_with_slice`` then give the second microbatch ``num_actual_tokens`` = its
padded token count and ``num_reqs`` = its real request count. The MLA builder's ``split_decodes_and_prefills``
(all decodes) returns ``num_decode_tokens = num_actual_tokens`` and ``num_decodes = num_reqs``. ``forward`` slices
``decode_q = q[:num_decode_tokens]`` (the microbatch's padded rows, as the piecewise graph produced them), while the
decode block table is ``block_table_tensor[:num_decodes]`` (real rows). CUTLASS MLA asserts the two are equal.
Attention is the splitting op of a PIECEWISE graph, so it runs eagerly at the graph's padded size between the
captured pieces. Only FULL graphs need request-padded metadata, because there the captured attention reads a
fixed number of request rows.
Doctor: padded-shape-mismatch, at ``execute_model`` (it hands the graph-padded microbatch slices to the metadata
builder in PIECEWISE mode, so the attention that runs at the padded token count gets block-table rows for the real
requests only).
Fix (upstream): ``pad_attn = cudagraph_mode == CUDAGraphMode.FULL`` and ``ubatch_slices_attn = ubatch_slices_padded
if pad_attn else ubatch_slices``. ``_build_attention_metadata`` gets ``num_tokens_padded``/``num_reqs_padded`` only
when ``pad_attn`` is set. ``create_ubatch_slices`` becomes ``maybe_create_ubatch_slices``, which returns both
variants. The model inputs still use the padded slices.
Read: the PR description and its review-thread hunk of ``ubatch_utils.py``. Also read: stored post-fix
``ubatch_utils.py`` (``_pad_out_ubatch_slices``, ``maybe_create_ubatch_slices``, ``_make_metadata_with_slice``), the
post-fix ``execute_model`` lines (``pad_attn``, ``ubatch_slices_attn``), and CUTLASS MLA's decode asserts.
Here the two microbatch threads run in turn, each piecewise graph copies its inputs into its own static buffers
(as ``cudagraph_copy_inputs`` does), and the KV cache is pre-filled (no KV write).
"""
from __future__ import annotations

import dataclasses
import enum

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/29933"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "execute_model"
SYMPTOM = "DBO + PIECEWISE: CUTLASS MLA 'assert B_block_table == B_q' fails when the second microbatch holds padding"

VOCAB, HIDDEN, PAGE_SIZE, MAX_BLOCKS, NUM_BLOCKS = 32, 8, 4, 2, 16
MAX_NUM_REQS = MAX_NUM_TOKENS = 8
CUDAGRAPH_CAPTURE_SIZES = [4, 8]                       # whole-batch sizes; each microbatch graph holds half


CUDAGraphMode = enum.Enum("CUDAGraphMode", ["NONE", "PIECEWISE", "FULL"])


@dataclasses.dataclass
class UBatchSlice:
    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start


def _pad_out_ubatch_slices(ubatch_slices, num_total_tokens, num_reqs_padded):
    second = ubatch_slices[1]
    return [ubatch_slices[0], UBatchSlice(slice(second.request_slice.start, num_reqs_padded),
                                          slice(second.token_slice.start, num_total_tokens))]


def maybe_create_ubatch_slices(should_ubatch, num_scheduled_tokens, num_tokens_padded, num_reqs_padded):
    if not should_ubatch:
        return None, None
    split_point = int(num_tokens_padded) // 2
    cu_num_tokens = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int32)
    np.cumsum(num_scheduled_tokens, dtype=np.int32, out=cu_num_tokens[1:])
    first_req_stop = int(np.searchsorted(cu_num_tokens, split_point, side="left"))
    second_req_start = int(np.searchsorted(cu_num_tokens, split_point, side="right") - 1)
    ubatch_slices = [UBatchSlice(slice(0, first_req_stop), slice(0, split_point)),
                     UBatchSlice(slice(second_req_start, len(cu_num_tokens) - 1),
                                 slice(split_point, int(cu_num_tokens[-1])))]
    ubatch_slices_padded = _pad_out_ubatch_slices(ubatch_slices, num_tokens_padded, num_reqs_padded)
    assert sum(s.num_tokens for s in ubatch_slices_padded) == num_tokens_padded
    return ubatch_slices, ubatch_slices_padded


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor


def _make_metadata_with_slice(ubatch_slice, attn_metadata):
    """Decode-only miniature (no request straddles the split). The last token may lie past the last request:
    that is CG padding."""
    rs, ts = ubatch_slice.request_slice, ubatch_slice.token_slice
    qsl = attn_metadata.query_start_loc_cpu[rs.start:rs.stop + 1] - attn_metadata.query_start_loc_cpu[rs.start]
    return CommonAttentionMetadata(qsl, attn_metadata.seq_lens[rs], rs.stop - rs.start, ts.stop - ts.start,
                                   int((qsl[1:] - qsl[:-1]).max()), attn_metadata.block_table_tensor[rs])


def split_decodes_and_prefills(m, decode_threshold=1):
    if m.max_query_len <= decode_threshold:
        return m.num_reqs, 0, m.num_actual_tokens, 0
    raise NotImplementedError("decode-only miniature")


@dataclasses.dataclass
class MLACommonMetadata:
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor


def mla_metadata_builder_build(common):
    num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(common)
    return MLACommonMetadata(common.num_actual_tokens, num_decodes, num_decode_tokens,
                             common.block_table_tensor[:num_decodes], common.seq_lens[:num_decodes])


def cutlass_mla_decode(q, kv_c_and_k_pe_cache, seq_lens, page_table):
    B_q = q.shape[0]
    B_block_table, block_num = page_table.shape
    assert B_block_table == B_q
    k = kv_c_and_k_pe_cache[page_table.long()].reshape(B_q, block_num * PAGE_SIZE, HIDDEN)
    scores = (k @ q[:, :, None]).squeeze(-1)
    pos = torch.arange(block_num * PAGE_SIZE, device=q.device)
    scores = scores.masked_fill(pos[None, :] >= seq_lens[:, None].long(), -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * k).sum(1)


class GPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.variant = device, variant
        self.cudagraph_mode = CUDAGraphMode.PIECEWISE if graphed else CUDAGraphMode.NONE
        gen = generator(29933)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_embed = randn(16, HIDDEN, gen=gen, device=device, scale=0.3)
        self.w_q = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_o = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.kv_cache = randn(NUM_BLOCKS, PAGE_SIZE, HIDDEN, gen=gen, device=device)
        # persistent input buffers
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.graphs = {}
        if graphed:
            self.capture_model()

    # -- the model: two captured pieces around the splitting op (attention) ----------------------------
    def pre_attn(self, ids, pos):
        h = self.embed[ids] + self.pos_embed[pos]
        return h, h @ self.w_q

    def post_attn(self, h, attn_out):
        return (h + attn_out @ self.w_o) @ self.lm_head

    def forward_attn(self, q, attn_metadata):
        """``MLACommonImpl.forward``: real tokens only; padded rows of the output stay zero."""
        output = torch.zeros_like(q)
        q = q[:attn_metadata.num_actual_tokens]
        decode_q = q[:attn_metadata.num_decode_tokens]
        output[:attn_metadata.num_decode_tokens] = cutlass_mla_decode(
            decode_q, self.kv_cache, attn_metadata.seq_lens, attn_metadata.block_table)
        return output

    def capture_model(self):
        for size in CUDAGRAPH_CAPTURE_SIZES:
            n = size // 2                                     # one microbatch's padded token count
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            pos = torch.zeros(n, dtype=torch.long, device=self.device)
            g0, out0 = capture(lambda i=ids, p=pos: self.pre_attn(i, p), device=self.device, name=f"piece 0 ({n})",
                               owner=f"piecewise graph 0 ({n} tokens)", static={"input_ids": ids, "positions": pos})
            h_in, a_in = torch.zeros(n, HIDDEN, device=self.device), torch.zeros(n, HIDDEN, device=self.device)
            g1, out1 = capture(lambda h=h_in, a=a_in: self.post_attn(h, a), device=self.device,
                               name=f"piece 1 ({n})", owner=f"piecewise graph 1 ({n} tokens)",
                               static={"hidden_states": h_in, "attn_output": a_in})
            self.graphs[n] = ((g0, out0, ids, pos), (g1, out1, h_in, a_in))

    def _run_ubatch(self, token_slice, real, attn_metadata):
        ids, pos = self.input_ids[token_slice], self.positions[token_slice]
        if self.cudagraph_mode is CUDAGraphMode.NONE:
            h, q = self.pre_attn(ids, pos)
            return self.post_attn(h, self.forward_attn(q, attn_metadata))
        n = token_slice.stop - token_slice.start
        (g0, out0, s_ids, s_pos), (g1, out1, h_in, a_in) = self.graphs[n]
        s_ids.copy_(ids), s_pos.copy_(pos)
        h, q = replay(g0, out0, real=real, size=n, padded={"input_ids": s_ids, "positions": s_pos})
        attn_out = self.forward_attn(q, attn_metadata)        # the splitting op, eager at the padded size
        h_in.copy_(h), a_in.copy_(attn_out)
        return replay(g1, out1, real=real, size=n).clone()

    def execute_model(self, requests):           # requests: (token id, position, block ids), one decode token each
        num_reqs = num_tokens = len(requests)
        t = lambda xs, dt=torch.long: torch.tensor(xs, dtype=dt).to(self.device)  # noqa: E731
        self.input_ids[:num_tokens].copy_(t([r[0] for r in requests]))
        self.positions[:num_tokens].copy_(t([r[1] for r in requests]))
        self.seq_lens[:num_reqs].copy_(t([r[1] + 1 for r in requests], torch.int32))
        self.block_table[:num_reqs].copy_(t([r[2] + [0] * (MAX_BLOCKS - len(r[2])) for r in requests], torch.int32))
        num_scheduled_tokens = np.ones(num_reqs, dtype=np.int32)
        if self.cudagraph_mode is CUDAGraphMode.NONE:
            num_tokens_padded = num_tokens
        else:                                                 # dispatch: PIECEWISE descriptor, no num_reqs
            num_tokens_padded = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens)
        num_reqs_padded = num_reqs
        ubatch_slices, ubatch_slices_padded = maybe_create_ubatch_slices(
            True, num_scheduled_tokens, num_tokens_padded, num_reqs_padded)
        if self.variant == "bug":
            ubatch_slices_attn = ubatch_slices_padded         # #28579: padded slices whatever the mode
        else:
            pad_attn = self.cudagraph_mode == CUDAGraphMode.FULL
            ubatch_slices_attn = ubatch_slices_padded if pad_attn else ubatch_slices
        attn_metadata = self._build_attention_metadata(num_tokens, num_reqs, ubatch_slices_attn)
        return torch.cat([self._run_ubatch(ub.token_slice, ub_real.num_tokens, m)  # model inputs: padded slices
                          for ub, ub_real, m in zip(ubatch_slices_padded, ubatch_slices, attn_metadata)])[:num_tokens]

    def _build_attention_metadata(self, num_tokens, num_reqs, ubatch_slices):
        common = CommonAttentionMetadata(
            query_start_loc_cpu=torch.arange(num_reqs + 1, dtype=torch.int32), seq_lens=self.seq_lens[:num_reqs],
            num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=1,
            block_table_tensor=self.block_table[:num_reqs])
        return [mla_metadata_builder_build(_make_metadata_with_slice(s, common)) for s in ubatch_slices]


def run(variant: str, device: str = "cpu"):
    steps = [
        [(3, 4, [1, 2]), (5, 6, [3, 4]), (7, 2, [5]), (9, 5, [6, 7]), (2, 3, [8]), (4, 7, [9, 10]),
         (6, 1, [11]), (8, 6, [12, 13])],                                            # 8 tokens: no padding
        [(11, 5, [1, 2]), (12, 7, [3, 4]), (13, 3, [5]), (14, 6, [6, 7]), (15, 2, [8]), (16, 4, [9, 10])],  # 6 -> 8
        [(17, 6, [2, 3]), (18, 1, [4]), (19, 7, [5, 6])],                            # 3 -> 4
        [(20, 2, [1]), (21, 5, [2, 3]), (22, 7, [4, 5]), (23, 3, [6]), (24, 6, [7, 8]), (25, 0, [9]),
         (26, 4, [10, 11])],                                                          # 7 -> 8
    ]

    def serve(graphed: bool):
        runner = GPUModelRunner(device, variant, graphed)
        return [runner.execute_model(reqs).clone() for reqs in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
