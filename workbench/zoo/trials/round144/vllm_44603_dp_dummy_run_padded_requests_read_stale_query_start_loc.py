"""A data-parallel rank with nothing to do runs vLLM's dummy batch so that its peers' collectives do not hang; with FULL
CUDA graphs the dummy batch is padded, like every uniform-decode batch, to a captured size, which pads its *requests*
too (one dummy request becomes ``num_reqs_padded`` of them) and makes ``_dummy_run`` build attention metadata over all
of them. ``_dummy_run`` wrote ``query_start_loc`` only for its one real request (``[1 : num_reqs + 1]``), whereas
``_prepare_inputs`` fills the tail of the buffer with the last offset. The padded requests' offsets, which the
captured attention reads from the persistent buffer, were therefore whatever the previous *real* step had left there:
a padded request whose sequence length the dummy run set to 0 got a query length of 1 (or more) from the stale
offsets, broke the invariant ``seq_lens >= query_lens``, and the decode attention kernel faulted. The fix fills
``query_start_loc[num_reqs + 1 : num_reqs_padded + 1]`` with the last real offset, as ``_prepare_inputs`` does.

Upstream: https://github.com/vllm-project/vllm/pull/44603 ("fix: pad dummy run query_start_loc", vllm-project/vllm,
author Uranus (UranusSeven), merged 2026-06-05 as the squash commit d2f70da116257d02f34d12bf478c974ea9179dac, parent
6542d489). The same bug and the same fix had been described earlier in https://github.com/vllm-project/vllm/pull/40003
("[BugFix]Fix the bug where query_start_loc values are polluted/corrupted in _dummy_run", Pluto966, opened 2026-04-16,
still open when read), whose description is the only account of the symptom I found. Read, in a mirror of the vLLM
fork jsboige/vllm (which carries upstream history to 2026-08-22; the full vLLM repository is too large to mirror
here): the whole diff of d2f70da1 (``vllm/v1/worker/gpu_model_runner.py``, +3 lines in ``GPUModelRunner._dummy_run``);
at its parent: all of ``_dummy_run``; the ``query_start_loc`` lines of ``_prepare_inputs`` ("pad query_start_loc to be
non-decreasing, as kernels like FlashAttention requires that"); ``_build_attention_metadata`` (block-table padding
with ``NULL_BLOCK_ID``, ``CommonAttentionMetadata`` built over ``num_reqs_padded`` requests from
``query_start_loc.gpu[: num_reqs_padded + 1]``); ``_get_slot_mappings`` (padded slots filled with -1); the part of
``_determine_batch_execution_and_padding`` that re-dispatches with the DP-synchronised token count;
``CudagraphDispatcher``'s request count for a FULL uniform-decode descriptor
(``num_tokens_padded // uniform_decode_query_len``); ``Worker.execute_dummy_batch``
(``_dummy_run(uniform_decode_query_len, uniform_decode=True)``); ``BlockTable.clear_row`` / ``commit_block_table`` /
``get_device_tensor``; ``split_decodes_and_prefills``; the MLA builder's and the sparse indexer's use of
``query_start_loc`` and ``seq_lens`` (``seq_len - decode_len + i + 1`` per query token,
``_prepare_uniform_decode_kernel``). And the stored text of PR #40003's description (an excerpt; its trigger list is
cut off after "Disaggregated prefill-decode").
Not read: a description of #44603 (none is stored; the commit message is its title), any issue behind it, its reviews;
``coordinate_batch_across_dp``; ``CUDAGraphWrapper`` at that revision; the attention kernels themselves (CUDA/C++), so
*which* kernel asserted, and how, is not known to me.
Symptom: PR #40003: "the phantom (padded) positions then read the stale residual values, producing incorrect
``decode_lens`` via ``diff(query_start_loc)`` that violate the invariant ``seq_lens[i] >= decode_lens[i]``, leading to
attention kernel assertion failures and process crashes", in "DP (Data Parallel) + disaggregated prefill-decode
deployments" with FULL CUDA graphs, when a rank has no tokens and runs ``_dummy_run()`` to keep its DP peers in step.
Mechanism: ``execute_dummy_batch`` runs ``_dummy_run(1, uniform_decode=True)``: one dummy request of one token. The
DP-synchronised dispatch pads it to the peers' count and then to a captured FULL decode size, and for a uniform decode
batch the descriptor's request count is that token count: 4 requests here. Only when the runtime mode is FULL does
``_dummy_run`` build attention metadata, over ``num_reqs_padded`` requests; it writes ``seq_lens`` for all of them (1,
then 0 for the padded ones), the padded block-table rows (``NULL_BLOCK_ID``) and the slots (-1), but
``query_start_loc`` only at ``[1 : num_reqs + 1]``. The captured FULL graph reads the persistent ``query_start_loc``
buffer, so its padded requests' offsets are the previous real step's: after a step with three decodes,
``[0, 1, 2, 3, 3]``, i.e. query lengths ``[1, 1, 1, 0]`` against sequence lengths ``[1, 0, 0, 0]``. A query token of a
request with ``seq_len - query_len + i + 1 <= 0`` keys has not even its own key; upstream's kernels then assert
(#40003); here the stand-in kernel's read of the block holding that key goes out of bounds. Without graphs the dummy
run builds no attention metadata (runtime mode NONE): nothing reads the offsets.
Doctor: stale-input, at ``_dummy_run``: the replayed step reads elements of a static input (``query_start_loc``'s
padded request offsets) that the step did not write, and what it gets is what an earlier step left there;
``_dummy_run`` is where only ``[1 : num_reqs + 1]`` is written, and the function the fix changes.
Fix (upstream): after ``query_start_loc.np[1 : num_reqs + 1] = cum_num_tokens``, ``_dummy_run`` adds
``query_start_loc.np[num_reqs + 1 : num_reqs_padded + 1].fill(cum_num_tokens[-1])``, so the padded requests have no
tokens.
Modelled: ``GPUModelRunner`` (``_prepare_inputs``, ``_determine_batch_execution_and_padding``, ``_get_slot_mappings``,
``_build_attention_metadata``, ``_dummy_run``, ``execute_model``, ``capture_model``,
``add_request``/``remove_request``, the persistent ``input_ids``, ``positions``, ``query_start_loc``,
``optimistic_seq_lens_cpu``/``seq_lens`` buffers), ``CpuGpuBuffer`` (``cpu``/``gpu``, ``copy_to_gpu``), ``BlockTable``
(``add_row``, ``clear_row``, ``commit_block_table``, ``get_device_tensor``, ``slot_mapping``),
``CommonAttentionMetadata``, ``CudagraphDispatcher.dispatch``, ``coordinate_batch_across_dp``, ``CUDAGraphWrapper``
(one FULL graph per ``BatchDescriptor``), ``set_forward_context``, ``reshape_and_cache_flash`` (skips slot -1),
``Worker.execute_dummy_batch``, ``NULL_BLOCK_ID`` / ``PAD_SLOT_ID``.
Stand-ins: the decode attention kernel (``paged_decode_attention``) is mine: upstream names no kernel, only "attention
kernel assertion failures". It maps each query token to its request through ``query_start_loc``, takes
``seq_len - query_len + i + 1`` keys, and reads the block that holds the query's own key; with no keys that index is
-1, which the gather refuses (CPU: ``RuntimeError``; CUDA: a device-side assert). The model is two tiny decoder layers
(width 8, RoPE, SiLU MLP, one head), float64. The DP peer is a list of its token counts per step
(``coordinate_batch_across_dp`` takes the max); the prompts' KV comes from the prefill node as seeded random rows
written by ``load_kv`` (the KV connector). Without graphs nothing is padded (no MoE here, so vLLM's DP token padding
would not change the numbers). Host-to-device copies of the pinned buffers are blocking (upstream: non-blocking,
ordered by ``synchronize_input_prep``'s events); sampling is greedy.
Workload: three requests (prompts 5, 2 and 7 tokens, KV received) decode two steps each beside a peer with three; they
finish; the rank is idle for a step while the peer still has three (``execute_dummy_batch``); a fourth request arrives
and decodes two steps. FULL graphs for 2 and 4 tokens. Outputs: each real step's logits and greedy tokens, and both
layers' KV caches.
Measured: the check printed, for the bug (raised at the dummy step's replay) and the fix:
  vllm_44603_dp_dummy_run_padded_requests_read_stale_query_start_loc [bug] on cpu: misbehaves
      (raised RuntimeError: index -1 is out of bounds for dimension 1 with size 3)
  vllm_44603_dp_dummy_run_padded_requests_read_stale_query_start_loc [fix] on cpu: equals eager
      (max |graph - eager| = 0)
About 1.1 s (bug) and 0.3 s (fix) on the CPU.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/44603"
FAMILY = "stale padded metadata"
KIND = "stale-input"
SITE = "_dummy_run"
SYMPTOM = ("with DP and FULL CUDA graphs, an idle rank's dummy batch reads the query_start_loc offsets the previous "
           "real step left for its padded requests, whose query lengths then exceed their sequence lengths: the "
           "attention kernel faults")

DTYPE = torch.float64
VOCAB, HIDDEN, NUM_LAYERS = 16, 8, 2
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 8, 3
MAX_NUM_REQS = MAX_NUM_TOKENS = 4
CUDAGRAPH_CAPTURE_SIZES = (2, 4)
UNIFORM_DECODE_QUERY_LEN = 1
NULL_BLOCK_ID, PAD_SLOT_ID = 0, -1
_variant = "bug"


class CUDAGraphMode:
    NONE, FULL = "NONE", "FULL"


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc: Tensor
    seq_lens: Tensor
    block_table_tensor: Tensor
    slot_mapping: Tensor
    num_reqs: int
    num_actual_tokens: int


_forward_context: dict = {"attn_metadata": None}


class set_forward_context:
    def __init__(self, attn_metadata):
        self.attn_metadata = attn_metadata

    def __enter__(self):
        self.prev, _forward_context["attn_metadata"] = _forward_context["attn_metadata"], self.attn_metadata

    def __exit__(self, *exc):
        _forward_context["attn_metadata"] = self.prev


# --- kernels --------------------------------------------------------------------------------------------------------

def reshape_and_cache_flash(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write each token's K/V at its slot; a slot of -1 (padding, dummy runs) is skipped."""
    valid = (slot_mapping >= 0).unsqueeze(1)
    idx = slot_mapping.clamp(min=0)
    for cache, new in ((kv_cache[0].view(-1, HIDDEN), key), (kv_cache[1].view(-1, HIDDEN), value)):
        cache.index_copy_(0, idx, torch.where(valid, new, cache.index_select(0, idx)))


def paged_decode_attention(q: Tensor, kv_cache: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                           block_table: Tensor) -> Tensor:
    """(stand-in) Causal attention over the paged KV cache; request boundaries from ``query_start_loc``."""
    num_tokens, num_reqs = q.shape[0], seq_lens.shape[0]
    t = torch.arange(num_tokens, device=q.device)
    req = torch.searchsorted(query_start_loc[1:], t, right=True)        # the request whose rows hold token t
    has_req = req < num_reqs
    r = req.clamp(max=num_reqs - 1)
    start = query_start_loc.index_select(0, r)
    query_len = query_start_loc.index_select(0, r + 1) - start
    ctx_len = seq_lens.index_select(0, r) - query_len + (t - start) + 1    # keys at positions [0, ctx_len)
    ctx_len = torch.where(has_req, ctx_len, torch.ones_like(ctx_len))   # rows past the last request: no work
    last_block = (ctx_len - 1).div(BLOCK_SIZE, rounding_mode="floor")  # the block holding the query's own key
    j = torch.arange(MAX_BLOCKS_PER_REQ * BLOCK_SIZE, device=q.device)
    blk = torch.minimum(j.div(BLOCK_SIZE, rounding_mode="floor").unsqueeze(0), last_block.unsqueeze(1))
    slots = block_table.index_select(0, r).gather(1, blk) * BLOCK_SIZE + j % BLOCK_SIZE
    keys = kv_cache[0].view(-1, HIDDEN).index_select(0, slots.reshape(-1)).view(num_tokens, -1, HIDDEN)
    values = kv_cache[1].view(-1, HIDDEN).index_select(0, slots.reshape(-1)).view(num_tokens, -1, HIDDEN)
    scores = (q.unsqueeze(1) * keys).sum(-1) / math.sqrt(HIDDEN)
    scores = scores.masked_fill(j.unsqueeze(0) >= ctx_len.unsqueeze(1), float("-inf"))
    out = (torch.softmax(scores, dim=-1).unsqueeze(-1) * values).sum(1)
    return torch.where(has_req.unsqueeze(1), out, torch.zeros_like(out))


def linear(x: Tensor, w: Tensor) -> Tensor:
    return (x.unsqueeze(1) * w.unsqueeze(0)).sum(-1)           # row by row: a row's result ignores the batch size


def rope(x: Tensor, positions: Tensor) -> Tensor:
    half = HIDDEN // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=DTYPE) / half)
    ang = positions.to(DTYPE).unsqueeze(1) * freq
    a, b = x[:, :half], x[:, half:]
    return torch.cat([a * torch.cos(ang) - b * torch.sin(ang), a * torch.sin(ang) + b * torch.cos(ang)], dim=1)


# --- model ----------------------------------------------------------------------------------------------------------

class Attention:
    def __init__(self, device):
        self.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HIDDEN, dtype=DTYPE, device=device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:   # unified_attention_with_output
        md = _forward_context["attn_metadata"]
        if md is None:                          # a dummy run without attention metadata: the layer does nothing
            return torch.zeros_like(q)
        reshape_and_cache_flash(k, v, self.kv_cache, md.slot_mapping)
        return paged_decode_attention(q, self.kv_cache, md.query_start_loc, md.seq_lens, md.block_table_tensor)


class DecoderLayer:
    def __init__(self, gen, device):
        def w(*shape):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * 0.5).to(device)
        self.wq, self.wk, self.wv, self.wo = w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN)
        self.w_gate, self.w_up, self.w_down = w(2 * HIDDEN, HIDDEN), w(2 * HIDDEN, HIDDEN), w(HIDDEN, 2 * HIDDEN)
        self.attn = Attention(device)

    def forward(self, positions: Tensor, h: Tensor) -> Tensor:
        q, k, v = rope(linear(h, self.wq), positions), rope(linear(h, self.wk), positions), linear(h, self.wv)
        h = h + linear(self.attn.forward(q, k, v), self.wo)
        g = linear(h, self.w_gate)
        return h + linear(g * torch.sigmoid(g) * linear(h, self.w_up), self.w_down)


class DecoderForCausalLM:
    def __init__(self, device):
        gen = generator(44603)
        self.embed = (torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.layers = [DecoderLayer(gen, device) for _ in range(NUM_LAYERS)]
        self.lm_head = (torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE) * 0.5).to(device)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        h = self.embed.index_select(0, input_ids)
        for layer in self.layers:
            h = layer.forward(positions, h)
        return h

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return linear(hidden_states, self.lm_head)


# --- runner ---------------------------------------------------------------------------------------------------------

class CpuGpuBuffer:
    def __init__(self, *shape, device):
        self.cpu = host(torch.zeros(*shape, dtype=torch.long), device)     # pinned
        self.gpu = torch.zeros(*shape, dtype=torch.long, device=device)

    def copy_to_gpu(self, n: int | None = None) -> None:
        n = self.cpu.shape[0] if n is None else n
        self.gpu[:n].copy_(self.cpu[:n])


class BlockTable:
    def __init__(self, device):
        self.block_table = CpuGpuBuffer(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, device=device)
        self.slot_mapping = CpuGpuBuffer(MAX_NUM_TOKENS, device=device)

    def add_row(self, block_ids: list, row_idx: int) -> None:
        for i, b in enumerate(block_ids):
            self.block_table.cpu[row_idx, i] = b

    def clear_row(self, row_idx: int) -> None:
        self.block_table.cpu[row_idx].fill_(0)

    def commit_block_table(self, num_reqs: int) -> None:
        self.block_table.copy_to_gpu(num_reqs)

    def get_device_tensor(self, num_reqs: int) -> Tensor:
        return self.block_table.gpu[:num_reqs]


@dataclasses.dataclass
class CachedRequestState:
    req_id: str
    prompt_len: int
    block_ids: list
    last_token: int
    num_computed_tokens: int = 0


def coordinate_batch_across_dp(num_tokens: int, peer_num_tokens: int) -> int:
    return max(num_tokens, peer_num_tokens)                  # the all-reduce of the DP ranks' token counts


class CudagraphDispatcher:
    def __init__(self, use_cuda_graph: bool):
        self.keys = {BatchDescriptor(s, s // UNIFORM_DECODE_QUERY_LEN) for s in CUDAGRAPH_CAPTURE_SIZES} \
            if use_cuda_graph else set()

    def dispatch(self, num_tokens: int, uniform_decode: bool):
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES):
            desc = BatchDescriptor(size, size // UNIFORM_DECODE_QUERY_LEN)
            if uniform_decode and size >= num_tokens and desc in self.keys:
                return CUDAGraphMode.FULL, desc
        return CUDAGraphMode.NONE, None


class CUDAGraphWrapper:
    """FULL mode: one graph per batch descriptor, captured on the capture pass, replayed afterwards."""

    def __init__(self, runner: "GPUModelRunner"):
        self.runner, self.concrete_cudagraph_entries = runner, {}

    def __call__(self, num_tokens: int, desc: BatchDescriptor | None, runtime_mode: str, *, real: int,
                 padded: dict, is_graph_capturing: bool = False) -> Tensor:
        rn = self.runner

        def forward():
            return rn.model.forward(input_ids=rn.input_ids.gpu[:num_tokens], positions=rn.positions.gpu[:num_tokens])
        if runtime_mode == CUDAGraphMode.NONE:
            return forward()
        if is_graph_capturing:
            self.concrete_cudagraph_entries[desc] = capture(
                forward, device=rn.device, warmups=1, name=f"FULL {desc}", owner="GPUModelRunner",
                static={"input_ids": rn.input_ids.gpu, "positions": rn.positions.gpu,
                        "query_start_loc": rn.query_start_loc.gpu, "seq_lens": rn.seq_lens,
                        "block_table": rn.block_table.block_table.gpu, "slot_mapping": rn.block_table.slot_mapping.gpu},
                state={f"kv_cache.{i}": layer.attn.kv_cache for i, layer in enumerate(rn.model.layers)})
            return self.concrete_cudagraph_entries[desc][1]
        graph, output = self.concrete_cudagraph_entries[desc]
        return replay(graph, output, real=real, size=desc.num_tokens, padded=padded)


class GPUModelRunner:
    def __init__(self, device: str, use_cuda_graph: bool):
        self.device, self.use_cuda_graph = device, use_cuda_graph
        self.model = DecoderForCausalLM(device)
        self.input_ids = CpuGpuBuffer(MAX_NUM_TOKENS, device=device)
        self.positions = CpuGpuBuffer(MAX_NUM_TOKENS, device=device)
        self.query_start_loc = CpuGpuBuffer(MAX_NUM_REQS + 1, device=device)
        self.optimistic_seq_lens_cpu = host(torch.zeros(MAX_NUM_REQS, dtype=torch.long), device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_table = BlockTable(device)
        self.requests: dict = {}
        self.req_ids: list = []                  # the input batch's rows
        self.cudagraph_dispatcher = CudagraphDispatcher(use_cuda_graph)
        self.model_wrapper = CUDAGraphWrapper(self)
        self.gen = generator(4460)

    # -- request state --
    def add_request(self, req: CachedRequestState) -> None:
        self.requests[req.req_id] = req
        self.req_ids.append(req.req_id)
        self.block_table.add_row(req.block_ids, len(self.req_ids) - 1)
        self.load_kv(req)

    def load_kv(self, req: CachedRequestState) -> None:
        """(stand-in) The KV connector writes the prompt's KV, computed on the prefill node, into its blocks."""
        for layer in self.model.layers:
            kv = (torch.randn(2, req.prompt_len, HIDDEN, generator=self.gen, dtype=DTYPE)).to(self.device)
            for pos in range(req.prompt_len):
                layer.attn.kv_cache[:, req.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = kv[:, pos]
        req.num_computed_tokens = req.prompt_len

    def remove_request(self, req_id: str) -> None:
        row = self.req_ids.index(req_id)
        self.block_table.clear_row(row)
        del self.requests[req_id], self.req_ids[row]      # (condense: the later rows move up)
        for i, rid in enumerate(self.req_ids[row:], start=row):
            self.block_table.clear_row(i)
            self.block_table.add_row(self.requests[rid].block_ids, i)
        self.block_table.clear_row(len(self.req_ids))

    # -- a real step --
    def _prepare_inputs(self, num_reqs: int) -> int:
        cum = 0
        for i, rid in enumerate(self.req_ids[:num_reqs]):
            req = self.requests[rid]
            pos = req.num_computed_tokens
            self.input_ids.cpu[i], self.positions.cpu[i] = req.last_token, pos
            self.block_table.slot_mapping.cpu[i] = req.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            self.optimistic_seq_lens_cpu[i] = pos + 1
            cum += UNIFORM_DECODE_QUERY_LEN
            self.query_start_loc.cpu[i + 1] = cum
        self.query_start_loc.cpu[0] = 0
        # Note: pad query_start_loc to be non-decreasing, as kernels like FlashAttention requires that
        self.query_start_loc.cpu[num_reqs + 1:].fill_(cum)
        self.optimistic_seq_lens_cpu[num_reqs:].fill_(0)
        for buf in (self.input_ids, self.positions, self.block_table.slot_mapping):
            buf.copy_to_gpu(cum)
        self.query_start_loc.copy_to_gpu()
        return cum

    def _determine_batch_execution_and_padding(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                                               peer_num_tokens: int):
        num_tokens_across_dp = coordinate_batch_across_dp(num_tokens, peer_num_tokens)
        mode, desc = self.cudagraph_dispatcher.dispatch(num_tokens_across_dp, uniform_decode)
        return mode, desc or BatchDescriptor(num_tokens, num_reqs)

    def _get_slot_mappings(self, num_tokens_padded: int, num_tokens_unpadded: int) -> Tensor:
        slot_mapping = self.block_table.slot_mapping.gpu[:num_tokens_padded]
        slot_mapping[num_tokens_unpadded:num_tokens_padded].fill_(PAD_SLOT_ID)
        return slot_mapping

    def _build_attention_metadata(self, num_tokens_padded: int, num_reqs: int, num_reqs_padded: int,
                                  slot_mapping: Tensor) -> CommonAttentionMetadata:
        blk_table_tensor = self.block_table.get_device_tensor(num_reqs_padded)
        blk_table_tensor[num_reqs:num_reqs_padded].fill_(NULL_BLOCK_ID)   # padded requests: the null block
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.gpu[:num_reqs_padded + 1], seq_lens=self.seq_lens[:num_reqs_padded],
            block_table_tensor=blk_table_tensor, slot_mapping=slot_mapping, num_reqs=num_reqs_padded,
            num_actual_tokens=num_tokens_padded)

    def execute_model(self, peer_num_tokens: int) -> tuple[Tensor, Tensor]:
        num_reqs = len(self.req_ids)
        num_tokens = self._prepare_inputs(num_reqs)
        mode, desc = self._determine_batch_execution_and_padding(num_tokens, num_reqs, True, peer_num_tokens)
        num_tokens_padded, num_reqs_padded = desc.num_tokens, desc.num_reqs
        self.seq_lens[:num_reqs_padded].copy_(self.optimistic_seq_lens_cpu[:num_reqs_padded])
        self.block_table.commit_block_table(num_reqs_padded)
        slot_mapping = self._get_slot_mappings(num_tokens_padded, num_tokens)
        attn_metadata = self._build_attention_metadata(num_tokens_padded, num_reqs, num_reqs_padded, slot_mapping)
        with set_forward_context(attn_metadata):
            hidden_states = self.model_wrapper(
                num_tokens_padded, desc, mode, real=num_tokens,
                padded={"input_ids": self.input_ids.gpu, "positions": self.positions.gpu})
        logits = self.model.compute_logits(hidden_states[:num_tokens])
        sampled = logits.argmax(dim=-1)
        for rid, tok in zip(self.req_ids, sampled.tolist()):
            self.requests[rid].last_token = tok
            self.requests[rid].num_computed_tokens += 1
        return logits.clone(), sampled.clone()

    # -- the dummy batch --
    def _dummy_run(self, num_tokens: int, cudagraph_runtime_mode: str | None = None, uniform_decode: bool = False,
                   is_graph_capturing: bool = False, peer_num_tokens: int = 0) -> Tensor:
        max_query_len = UNIFORM_DECODE_QUERY_LEN if uniform_decode else num_tokens
        num_reqs = min(MAX_NUM_REQS, -(-num_tokens // max_query_len))
        num_scheduled_tokens = [max_query_len] * num_reqs
        mode, desc = self._determine_batch_execution_and_padding(num_tokens, num_reqs, uniform_decode, peer_num_tokens)
        cudagraph_runtime_mode = mode if cudagraph_runtime_mode is None else cudagraph_runtime_mode
        num_tokens_padded, num_reqs_padded = desc.num_tokens, desc.num_reqs
        # Dummy runs have no real slot assignments: fill with -1 so the KV writes are skipped.
        slot_mapping = self._get_slot_mappings(num_tokens_padded, 0)
        attn_metadata = None
        padded = {"input_ids": self.input_ids.gpu, "positions": self.positions.gpu}
        if cudagraph_runtime_mode == CUDAGraphMode.FULL:
            self.optimistic_seq_lens_cpu[:num_reqs] = max_query_len
            self.optimistic_seq_lens_cpu[num_reqs:].fill_(0)
            self.seq_lens.copy_(self.optimistic_seq_lens_cpu)
            cum_num_tokens = 0
            for i, n in enumerate(num_scheduled_tokens):
                cum_num_tokens += n
                self.query_start_loc.cpu[i + 1] = cum_num_tokens
            if _variant == "fix":
                self.query_start_loc.cpu[num_reqs + 1:num_reqs_padded + 1].fill_(cum_num_tokens)
            else:       # the padded requests' offsets stay as the last real step left them
                padded["query_start_loc"] = self.query_start_loc.gpu[1:]
            self.query_start_loc.copy_to_gpu()
            self.block_table.commit_block_table(num_reqs_padded)
            attn_metadata = self._build_attention_metadata(num_tokens_padded, num_reqs, num_reqs_padded, slot_mapping)
        with set_forward_context(attn_metadata):
            return self.model_wrapper(num_tokens_padded, desc, cudagraph_runtime_mode, real=num_tokens,
                                      padded=padded, is_graph_capturing=is_graph_capturing)

    def capture_model(self) -> None:
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(size, CUDAGraphMode.FULL, uniform_decode=True, is_graph_capturing=True)


class Worker:
    def __init__(self, device: str, use_cuda_graph: bool):
        self.model_runner = GPUModelRunner(device, use_cuda_graph)
        if use_cuda_graph:
            self.model_runner.capture_model()

    def execute_dummy_batch(self, peer_num_tokens: int) -> None:
        num_tokens = UNIFORM_DECODE_QUERY_LEN
        self.model_runner._dummy_run(num_tokens, uniform_decode=True, peer_num_tokens=peer_num_tokens)


# --- workload -------------------------------------------------------------------------------------------------------

# per step: requests that arrive (id, prompt length, KV blocks, first token from the prefill node), whether this rank
# has work, the DP peer's token count, and requests that finish after the step
SCHEDULE = [
    ([("A", 5, [1, 2], 3), ("B", 2, [3], 7), ("C", 7, [4, 5, 6], 11)], True, 3, []),
    ([], True, 3, ["A", "B", "C"]),
    ([], False, 3, []),                                  # idle: execute_dummy_batch beside a peer with three
    ([("D", 4, [1, 2], 9)], True, 1, []),
    ([], True, 2, ["D"]),
]


def serve(device: str, use_cuda_graph: bool) -> list[Tensor]:
    worker = Worker(device, use_cuda_graph)
    runner, outputs = worker.model_runner, []
    for arrivals, busy, peer, finished in SCHEDULE:
        for rid, prompt_len, blocks, token in arrivals:
            runner.add_request(CachedRequestState(rid, prompt_len, blocks, token))
        if busy:
            outputs += list(runner.execute_model(peer))
        else:
            worker.execute_dummy_batch(peer)
        for rid in finished:
            runner.remove_request(rid)
    return outputs + [layer.attn.kv_cache.clone() for layer in runner.model.layers]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cuda_graph=True), lambda: serve(device, use_cuda_graph=False))
