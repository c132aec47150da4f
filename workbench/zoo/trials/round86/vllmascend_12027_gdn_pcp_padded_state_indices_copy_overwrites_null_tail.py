"""PCP + FULL_DECODE_ONLY GDN decode: the metadata builder nulls the state-index tail from the real token count, then copies the padded block-table rows over it, so a graph-padding lane updates a live request's conv/recurrent state.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/12027 ("[v0.23.0][BugFix][GDN] Fix PD, PCP and DCP accuracy
regressions", releases/v0.23.0, merged 2026-07-16, commit a1f738a031). Read: the PR description (its four parts) and
its diff of ``vllm_ascend/ops/gdn_attn_builder.py`` (the removed lines of ``AscendGDNAttentionMetadataBuilder.build``
and the added ``_pad_non_spec_decode_graph_inputs``); for the root cause, the description of the earlier, closed
https://github.com/vllm-project/vllm-ascend/pull/12040 ("Fix GDN graph padding state indices with PCP"), which the
release PR's part 2 carries. Not read: the model runner's PCP block-table code (modelled from #12040's sentence
"under PCP, padded block-table rows are intentionally not initialized by the common model runner"), the AscendC
conv1d / recurrent kernels. Only part 2 of #12027 (non-spec graph metadata) is modelled; parts 1, 3 and 4 (decode
dispatch predicate, PCP chunk count, empty-spec reset) are not.
Symptom: Qwen3.5 / Qwen3.6 with prefill context parallelism and ``FULL_DECODE_ONLY``: when fewer requests are active
than the captured graph batch, decode output becomes corrupted (PCP=2, 198 prompts: 178 corrupted responses before,
0 after). Eager mode is correct.
Mechanism: in a FULL-graph decode step ``m.num_reqs`` is the padded graph batch (dummy FIA requests included, each
given one query token so ``query_start_loc[-1]`` equals the padded token count) while ``m.num_actual_tokens`` is the
real token count. ``split_decodes_and_prefills`` returns ``num_decodes = num_reqs`` (padded) and ``num_decode_tokens
= num_actual_tokens`` (real). The old ``build`` then did ``batch_size = m.num_actual_tokens``;
``non_spec_state_indices_tensor[batch_size:].fill_(NULL_BLOCK_ID)`` and afterwards
``non_spec_state_indices_tensor[:num_decodes].copy_(block_table[:, 0])``, which writes the padded rows of the device
block table -- never reset under PCP, still holding the slot of the request that sat there in an earlier batch --
over the tail it had just nulled; ``non_spec_query_start_loc[:num_decodes + 1]`` likewise keeps the dummies' one-token
lengths. It then shortens the Python views to ``batch_size``, but the graph captured at the padded size reads the
whole fixed-size buffers: the conv1d / recurrent decode runs one lane per padded request and writes that lane's
update into the stale slot, i.e. into a live request's ``conv_state`` / ``ssm_state``.
Doctor: stale-padding, at build. A real request's later outputs depend on what the padded rows of the graph's
state-index buffer (stale block-table slots) and of ``hidden_states`` (stale inputs) hold.
Fix (upstream): ``_pad_non_spec_decode_graph_inputs`` refreshes every fixed-shape row at the graph batch size
(``m.num_reqs``) with ``num_decode_tokens`` as the real boundary: dummy state rows ``NULL_BLOCK_ID`` and repeated
terminal ``query_start_loc`` offsets (zero-length dummy rows), e.g. ``state_indices = [id0, id1, NULL, NULL]``,
``query_start_loc = [0, 1, 2, 2, 2]``.
Modelled: ``AscendGDNAttentionMetadataBuilder.build`` (decode-only, no spec) with its persistent
``non_spec_state_indices_tensor`` / ``non_spec_query_start_loc``; ``InputBatch`` with a CPU block table whose
``condense`` moves the last row into a finished request's row (the source row keeps its data) and a PCP
``commit_block_table`` that copies only the first ``num_reqs`` rows to the device; ``_pad_query_start_loc_for_fia``
(dummies get one token each). The GDN layer is a stand-in: a width-3 causal conv update and a diagonal recurrence
over per-slot ``conv_state`` / ``ssm_state`` (slot 0 is the null block), one lane per sequence of
``query_start_loc``, all lanes read their states first and write them back in lane order. FULL graphs at 2 and 4
requests are captured by a dummy run over null blocks. Sizes: hidden 6, vocab 10 (float64).
Workload: requests A-D own state slots 1-4 (prefilled state). Steps 1 and 2 decode A-D (4 requests, no padding). C
finishes and condense moves D into row 2; row 3 still names slot 4. Steps 3 and 4 decode A, B, D padded to the
4-graph: in step 3 the dummy lane (one token under the bug) reads the stale input of row 3 and writes D's conv and
recurrent states after D's own lane, so D's step-4 logits differ from eager (max 2.3); A and B stay exact.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/12027"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "build"
SYMPTOM = ("Qwen3.5 GDN with PCP + FULL_DECODE_ONLY: 3 active requests padded to a 4-request graph; the padded "
           "state-index row keeps a live request's slot and the dummy lane overwrites its conv/recurrent state; "
           "its next decode outputs are corrupted")

HIDDEN, VOCAB, CONV_WIDTH = 6, 10, 3
MAX_NUM_REQS = 4
NUM_SLOTS = 1 + MAX_NUM_REQS          # slot 0: NULL_BLOCK_ID
NULL_BLOCK_ID = 0
CUDAGRAPH_CAPTURE_SIZES = [2, 4]

_variant = "bug"


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    block_table_tensor: torch.Tensor
    num_reqs: int
    num_actual_tokens: int


@dataclasses.dataclass
class GDNAttentionMetadata:
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    non_spec_state_indices_tensor: torch.Tensor
    non_spec_query_start_loc: torch.Tensor


def split_decodes_and_prefills(m: CommonAttentionMetadata):
    """Decode-only batch (max query length 1): every request is a decode, tokens are the real ones."""
    return m.num_reqs, 0, m.num_actual_tokens, 0


class AscendGDNAttentionMetadataBuilder:
    def __init__(self, device):
        self.use_full_cuda_graph = True
        self.decode_cudagraph_max_bs = MAX_NUM_REQS
        self.non_spec_state_indices_tensor = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.non_spec_query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int64, device=device)

    def _pad_non_spec_decode_graph_inputs(self, state_indices, query_start_loc, *, num_decode_tokens,
                                          graph_batch_size):
        """The upstream fix: refresh every fixed-shape row at the graph batch size."""
        padded_state_indices = self.non_spec_state_indices_tensor[:graph_batch_size]
        padded_state_indices[num_decode_tokens:].fill_(NULL_BLOCK_ID)
        padded_state_indices[:num_decode_tokens].copy_(state_indices[:num_decode_tokens], non_blocking=True)
        padded_query_start_loc = self.non_spec_query_start_loc[:graph_batch_size + 1]
        padded_query_start_loc[:num_decode_tokens + 1].copy_(query_start_loc[:num_decode_tokens + 1],
                                                              non_blocking=True)
        query_padding = padded_query_start_loc[num_decode_tokens + 1:]
        if query_padding.numel() > 0:
            query_padding.copy_(padded_query_start_loc[num_decode_tokens].expand_as(query_padding),
                                non_blocking=True)
        return padded_state_indices, padded_query_start_loc

    def build(self, common_prefix_len: int, m: CommonAttentionMetadata) -> GDNAttentionMetadata:
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(m)
        block_table_tensor = m.block_table_tensor[:m.num_reqs]        # mamba_get_block_table_tensor
        non_spec_state_indices_tensor = block_table_tensor[:, 0]
        non_spec_query_start_loc = m.query_start_loc
        if self.use_full_cuda_graph and num_prefills == 0 and num_decodes <= self.decode_cudagraph_max_bs:
            if _variant == "fix":
                non_spec_state_indices_tensor, non_spec_query_start_loc = self._pad_non_spec_decode_graph_inputs(
                    non_spec_state_indices_tensor, non_spec_query_start_loc,
                    num_decode_tokens=num_decode_tokens, graph_batch_size=m.num_reqs)
            else:
                batch_size = m.num_actual_tokens
                self.non_spec_state_indices_tensor[batch_size:].fill_(NULL_BLOCK_ID)
                self.non_spec_state_indices_tensor[:num_decodes].copy_(non_spec_state_indices_tensor,
                                                                       non_blocking=True)
                non_spec_state_indices_tensor = self.non_spec_state_indices_tensor[:batch_size]
                non_spec_state_indices_tensor[num_decodes:].fill_(NULL_BLOCK_ID)
                self.non_spec_query_start_loc[:num_decodes + 1].copy_(non_spec_query_start_loc, non_blocking=True)
                non_spec_num_query_tokens = non_spec_query_start_loc[-1]
                non_spec_query_start_loc = self.non_spec_query_start_loc[:batch_size + 1]
                non_spec_query_start_loc[num_decodes + 1:].fill_(non_spec_num_query_tokens)
        return GDNAttentionMetadata(num_decodes, num_decode_tokens, m.num_actual_tokens,
                                    non_spec_state_indices_tensor, non_spec_query_start_loc)


class Qwen3NextGatedDeltaNet:
    """Stand-in GDN layer: causal conv1d update + diagonal recurrence over per-slot states, then the head."""

    def __init__(self, device):
        gen = generator(12027)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.conv_weight = r(HIDDEN, CONV_WIDTH)
        self.decay = torch.sigmoid(r(HIDDEN, scale=1.0))
        self.out_proj = r(HIDDEN, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.conv_state = torch.zeros(NUM_SLOTS, HIDDEN, CONV_WIDTH - 1, device=device, dtype=torch.float64)
        self.ssm_state = torch.zeros(NUM_SLOTS, HIDDEN, device=device, dtype=torch.float64)

    def forward(self, hidden_states, attn_metadata: GDNAttentionMetadata):
        state_indices = attn_metadata.non_spec_state_indices_tensor
        query_start_loc = attn_metadata.non_spec_query_start_loc
        lanes = state_indices.shape[0]
        num_tokens = hidden_states.shape[0]
        valid = (query_start_loc[1:] - query_start_loc[:-1]) > 0            # one lane per sequence
        token = query_start_loc[:-1].clamp(max=num_tokens - 1)
        x = hidden_states[token]                                            # [lanes, H]
        window = torch.cat([self.conv_state[state_indices], x.unsqueeze(-1)], -1)
        y = torch.nn.functional.silu((window * self.conv_weight).sum(-1))
        h = self.decay * self.ssm_state[state_indices] + y
        for i in range(lanes):                                               # lanes write back in order
            s = state_indices[i:i + 1]
            keep = valid[i:i + 1].view(1, 1)
            self.conv_state.index_copy_(0, s, torch.where(keep.unsqueeze(-1), window[i:i + 1, :, 1:],
                                                          self.conv_state[s]))
            self.ssm_state.index_copy_(0, s, torch.where(keep, h[i:i + 1], self.ssm_state[s]))
        core = torch.zeros(num_tokens, HIDDEN, device=hidden_states.device, dtype=hidden_states.dtype)
        core.index_copy_(0, token, torch.where(valid.unsqueeze(-1), h, core[token]))
        out = hidden_states + core @ self.out_proj
        return out @ self.lm_head


class InputBatch:
    """Persistent request rows; ``block_table`` is the CPU side of the (PCP) block table."""

    def __init__(self):
        self.req_ids: list[str] = []
        self.block_table = torch.zeros(MAX_NUM_REQS, 1, dtype=torch.int64)

    def add_request(self, req_id, slot):
        self.block_table[len(self.req_ids), 0] = slot
        self.req_ids.append(req_id)

    def remove_and_condense(self, req_id):
        """Finished request's row is filled from the last row (move_row copies; the source row keeps its data)."""
        row, last = self.req_ids.index(req_id), len(self.req_ids) - 1
        if row != last:
            self.block_table[row] = self.block_table[last]
            self.req_ids[row] = self.req_ids[last]
        self.req_ids.pop()


class NPUModelRunner:
    def __init__(self, device, use_graph):
        self.device = device
        self.model = Qwen3NextGatedDeltaNet(device)
        self.builder = AscendGDNAttentionMetadataBuilder(device)
        self.input_batch = InputBatch()
        self.hidden_states = torch.zeros(MAX_NUM_REQS, HIDDEN, device=device, dtype=torch.float64)
        self.block_table = torch.zeros(MAX_NUM_REQS, 1, dtype=torch.int64, device=device)   # device copy
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int64, device=device)
        self.graphs = {}
        if use_graph:
            self.capture_model()

    def capture_model(self):
        for n in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self.block_table[:n].fill_(NULL_BLOCK_ID)                       # _dummy_run: null blocks
            self.query_start_loc[:n + 1].copy_(torch.arange(n + 1))
            m = CommonAttentionMetadata(self.query_start_loc[:n + 1], self.block_table, n, n)
            attn_metadata = self.builder.build(0, m)
            g, out = capture(lambda n=n, md=attn_metadata: self.model.forward(self.hidden_states[:n], md),
                             device=self.device, name=f"gdn decode FULL [{n}]", owner="NPUModelRunner (FULL_DECODE_ONLY)",
                             static={"hidden_states": self.hidden_states,
                                     "non_spec_state_indices_tensor": self.builder.non_spec_state_indices_tensor,
                                     "non_spec_query_start_loc": self.builder.non_spec_query_start_loc},
                             state={"conv_state": self.model.conv_state, "ssm_state": self.model.ssm_state})
            self.graphs[n] = (g, out)

    def commit_block_table(self, num_reqs):
        """PCP path: only the scheduled rows go to the device; padded rows keep what they held."""
        self.block_table[:num_reqs].copy_(self.input_batch.block_table[:num_reqs].to(self.device))

    def _pad_query_start_loc_for_fia(self, num_reqs, num_reqs_padded):
        """FIA needs query_start_loc[-1] == padded token count: each dummy request gets one token."""
        self.query_start_loc[:num_reqs_padded + 1].copy_(torch.arange(num_reqs_padded + 1))

    def execute_model(self, inputs):
        num_reqs = len(self.input_batch.req_ids)
        self.hidden_states[:num_reqs].copy_(inputs)
        self.commit_block_table(num_reqs)
        num_reqs_padded = (next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_reqs) if self.graphs else num_reqs)
        self._pad_query_start_loc_for_fia(num_reqs, num_reqs_padded)
        m = CommonAttentionMetadata(self.query_start_loc[:num_reqs_padded + 1], self.block_table,
                                    num_reqs_padded, num_reqs)
        attn_metadata = self.builder.build(0, m)
        if self.graphs:
            g, out = self.graphs[num_reqs_padded]
            logits = replay(g, out, real=num_reqs, size=num_reqs_padded, padded={"hidden_states": self.hidden_states})
        else:
            logits = self.model.forward(self.hidden_states[:num_reqs], attn_metadata)
        return logits[:num_reqs].clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    slots = {"A": 1, "B": 2, "C": 3, "D": 4}
    schedule = [(), (), ("C",), ()]          # requests finishing before each step (step 0 admits A-D)

    def serve(use_graph: bool):
        runner = NPUModelRunner(device, use_graph)
        gen = generator(12028)
        for rid, slot in slots.items():                       # prefill stand-in: each request's states
            runner.model.conv_state[slot] = randn(HIDDEN, CONV_WIDTH - 1, gen=gen, device=device).double()
            runner.model.ssm_state[slot] = randn(HIDDEN, gen=gen, device=device).double()
            runner.input_batch.add_request(rid, slot)
        outs = []
        for step, finished in enumerate(schedule):
            for rid in finished:
                runner.input_batch.remove_and_condense(rid)
            step_gen = generator(100 + step)
            per_req = {rid: randn(HIDDEN, gen=step_gen, device=device).double() for rid in "ABCD"}
            inputs = torch.stack([per_req[r] for r in runner.input_batch.req_ids])
            outs.append(runner.execute_model(inputs))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
