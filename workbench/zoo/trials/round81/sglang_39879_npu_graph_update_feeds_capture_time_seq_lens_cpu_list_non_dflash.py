"""SGLang on Ascend NPU graphs: after the DFlash support (#37565) the NPU graph runner feeds ``graph.update`` the attention backend's graph-bound ``seq_lens_cpu_list``, which for non-DFlash batches still holds the list built at capture, so every replay attends over the capture-time KV lengths.

Upstream: https://github.com/sgl-project/sglang/pull/39879 ("[NPU] Gate DFlash replay metadata refresh behind
spec_algorithm check", iridiumine, description and review 2026-09-17, ``/rerun-failed-ci`` 2026-09-18, merged).
It repairs a regression of https://github.com/sgl-project/sglang/pull/37565 ("[NPU] Support DFlash speculative
decoding for MiMo-V2.5-Pro (mxfp4)", described 2026-09-02, merged), whose description says it keeps "seq_lens_cpu_list
rebindable by graph.update so KV lengths are not frozen at capture time".
Symptom: on Ascend NPU with NPU graphs, models served without DFlash (plain decode here) get wrong decode output
after #37565: the fused-infer-attention kernel of every replay reads the KV lengths the graph was captured with
(the capture batch's filler lengths) instead of the live requests' lengths. ``--disable-cuda-graph`` is right, and so
is DFlash. (#39879 also removes, as performance fixes, the unconditional ``seq_lens[:bs].cpu()`` D2H sync #37565 put
on DSA/DSV4 verify replays and its redundant buffer copies on the pre-planned replay path.)
Mechanism: NPU attention (``torch_npu.npu_fused_infer_attention_score``, FIA) takes the per-request KV lengths as a
host list, ``actual_seq_lengths_kv``. ``NPUGraphRunner._capture_graph`` captures with ``torch.npu.graph(...,
auto_dispatch_capture=True)``, which records the op with that list by value; before each replay
``NPUGraphRunner._update_inputs`` rebinds it with ``self.graphs[self.bs].update(cpu_update_input=[{
self.update_attr_name: seq_lens}])``. In ``AscendAttnBackend`` (python/sglang/srt/hardware_backend/npu/attention/
ascend_backend.py) the list the kernel sees in graph mode is ``forward_metadata.seq_lens_cpu_list``:
``_init_cuda_graph_metadata`` builds it at capture (``metadata.seq_lens_cpu_list = seq_lens.cpu().int().tolist()``,
the capture buffers' ``seq_len_fill_value`` 0), and ``_apply_cuda_graph_metadata`` (capture and replay) refreshed it
only under ``if forward_mode.is_target_verify():`` (#37565: DFlash's ``seq_lens_cpu``, else ``seq_lens + draft
tokens``). Before #37565, ``NPUGraphRunner.execute`` (graph_runner/npu_graph_runner.py) computed the update from the
live batch, ``forward_batch.seq_lens.cpu().tolist() + [0] * (self.bs - self.raw_bs)`` (``+ captured_req_width`` in
verify). #37565 made the replay path read ``forward_metadata.seq_lens_cpu_list`` instead, correct for DFlash (whose
target graphs are all verify graphs, refreshed each replay), but for the other graphs, e.g. a decode graph, "the
backend keeps the capture-time list, so graph.update replays stale capture-time seq lens instead of the live
batch's lengths" (PR text). Eager decode builds ``seq_lens_cpu_int`` from the live batch in ``init_forward_metadata``.
Doctor: host-work-frozen, at execute (the KV-length list is host work, ``seq_lens.cpu().int().tolist()`` run once for
the capture batch and baked into the captured FIA call; NPU graphs replay that value unless the runner rebinds it,
and ``execute`` is where the rebinding value is chosen: after #37565 it passes the capture-time list for non-DFlash
graphs; the fix restores the live batch's lengths there).
Fix (upstream): every #37565 replay-path addition is gated behind ``spec_algorithm.is_dflash()``: for non-DFlash,
``execute`` again "recomputes seq_lens from the live batch (``forward_batch.seq_lens.cpu() + captured_req_width``)
exactly as before #37565", and ``_apply_cuda_graph_metadata`` refreshes ``seq_lens_cpu_list`` only for a DFlash
verify (``seq_lens_cpu`` = prefix + block size, the true KV length).
Modelled: the pre-fix runner is read from the PR description and the pre-#37565 runner (which the fix restores for
non-DFlash "byte-for-byte"): the post-#37565 ``execute`` itself was not readable, so its update line is written as the
PR states it (``forward_metadata.seq_lens_cpu_list``, for every algorithm), and the stale case modelled is the one the
backend code shows: a decode graph (``spec_algorithm`` NONE), whose list ``_apply_cuda_graph_metadata`` never refreshes.
Of the backend hunk only the removed lines and the first added comment line were readable; the fixed DFlash-only
refresh under it is reconstructed from that comment.
One MHA attention layer (2 heads of 4) between an embedding (+ position embedding) and the LM head; the KV pool
(page size 4, slot page 0 kept for padded tokens) is prefilled with random KV instead of a prefill pass; four requests
decode six steps (4, 4, 4, then 3 padded to the 4-graph, then 2 on the 2-graph), fed fixed token ids. The FIA stand-in
gathers each request's KV through the block table and masks positions ``>= actual_seq_lengths_kv[b]`` (a request of
length 0, a padded row, gives 0). ``NPUGraph`` is a stand-in for torch_npu's: its dispatch record holds the host list
in pinned host memory, written once when the op is captured and copied in by the captured kernel at every replay;
``update(cpu_update_input=...)`` writes the new values there after the previous replay finished (upstream overlaps
the update with the replay on a thread).
The verify branch of the backend is kept as upstream has it but not exercised; no overlap plan stream (every batch
goes through ``load_batch``), no shared graph memory pool, one graph per batch size.
"""
from __future__ import annotations

import bisect
import enum

import torch

from workbench.engine import host, is_capturing, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/39879"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "execute"
SYMPTOM = ("Ascend NPU graphs after the DFlash support: graph.update rebinds FIA's actual_seq_lengths_kv with the "
           "backend's capture-time seq_lens_cpu_list for non-DFlash graphs; every decode replay uses capture KV lengths")

NUM_HEADS, HEAD_DIM = 2, 4
HIDDEN, VOCAB = 8, 16
PAGE_SIZE = 4
CONTEXT_LEN = 16                                  # model_config.context_len
MAX_RUNNING_REQUESTS = 4
CUDA_GRAPH_BS = [2, 4]
NUM_PAGES = 1 + MAX_RUNNING_REQUESTS * (CONTEXT_LEN // PAGE_SIZE)      # page 0: the padded tokens' slot


# --- torch_npu stand-ins -------------------------------------------------------------------------------------------

_capturing_graph = None        # the NPUGraph whose torch.npu.graph(..., auto_dispatch_capture=True) is open


class NPUGraph:
    """``torch.npu.NPUGraph`` captured with ``auto_dispatch_capture=True``: each captured op with host-list inputs
    leaves a dispatch record holding them by value; ``update(cpu_update_input=[{name: values}, ...])`` rewrites the
    records' inputs for the next ``replay()``."""

    RECORD_CAPACITY = 64

    def __init__(self, device):
        self.device = device
        self.graph_dispatch_records: list[dict[str, torch.Tensor]] = []
        self._record_storage = host(torch.zeros(self.RECORD_CAPACITY, dtype=torch.int32), device)
        self._record_used = 0
        self.graph = self.outputs = None

    def dispatch_record(self, name, values):
        """The record of an op captured now, holding ``values`` (the launch's host list) by value."""
        n = len(values)
        record = self._record_storage[self._record_used:self._record_used + n]
        self._record_used += n
        record.numpy()[:] = values              # host memory, written once, when the op is captured
        self.graph_dispatch_records.append({name: record})
        return record

    def update(self, cpu_update_input):
        synchronize(self.device)                 # the last replay has consumed the inputs it was given
        for record, inputs in zip(self.graph_dispatch_records, cpu_update_input):
            for name, values in inputs.items():
                record[name].copy_(torch.tensor(values, dtype=torch.int32))


def _host_list_input(name, values, device):
    """A host-list kernel input: copied in at launch; inside an auto-dispatch capture, kept in the op's record."""
    if is_capturing() and _capturing_graph is not None:
        record = _capturing_graph.dispatch_record(name, values)
        lens = torch.empty(len(values), dtype=torch.int32, device=device)
        lens.copy_(record, non_blocking=True)
        return lens
    return torch.tensor(values, dtype=torch.int32).to(device)


def npu_fused_infer_attention_score(query, key, value, *, block_table, block_size, num_heads, num_key_value_heads,
                                    input_layout, scale, actual_seq_lengths_kv):
    """Paged decode attention, BSH layout: request ``b`` attends over its first ``actual_seq_lengths_kv[b]``
    cached tokens, found through ``block_table[b]``."""
    assert input_layout == "BSH"
    kv_lens = _host_list_input("actual_seq_lengths_kv", actual_seq_lengths_kv, query.device)
    bs = query.shape[0]
    t = torch.arange(block_table.shape[1] * block_size, device=query.device)
    slots = block_table[:, t // block_size].long() * block_size + t % block_size                 # [B, T]
    k = key.reshape(-1, num_key_value_heads, HEAD_DIM)[slots]                                      # [B, T, H, D]
    v = value.reshape(-1, num_key_value_heads, HEAD_DIM)[slots]
    q = query.view(bs, num_heads, HEAD_DIM)
    scores = torch.einsum("bhd,bthd->bht", q, k) * scale
    valid = t[None, :] < kv_lens[:, None].long()
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)           # no KV (a padded row): output 0
    out = torch.einsum("bht,bthd->bhd", probs, v)
    return out.reshape(bs, 1, num_heads * HEAD_DIM), None


# --- forward_batch_info.py, spec_info.py ----------------------------------------------------------------------------

class ForwardMode(enum.Enum):
    DECODE = 2
    TARGET_VERIFY = 4

    def is_target_verify(self):
        return self is ForwardMode.TARGET_VERIFY

    def is_decode_or_idle(self):
        return self is ForwardMode.DECODE


class SpeculativeAlgorithm(enum.Enum):
    NONE = 0
    EAGLE = 1
    DFLASH = 2

    def is_dflash(self):
        return self is SpeculativeAlgorithm.DFLASH


def _is_dflash_verify(spec_info) -> bool:
    return spec_info is not None and spec_info.spec_input_type == "DFLASH_VERIFY"


class ForwardBatch:
    def __init__(self, *, forward_mode, batch_size, input_ids, req_pool_indices, seq_lens, out_cache_loc, positions,
                 seq_lens_cpu, spec_info=None):
        self.forward_mode, self.batch_size = forward_mode, batch_size
        self.input_ids, self.req_pool_indices, self.positions = input_ids, req_pool_indices, positions
        self.seq_lens = seq_lens                  # device, including this step's token
        self.seq_lens_cpu = seq_lens_cpu          # host mirror
        self.out_cache_loc, self.spec_info = out_cache_loc, spec_info

    def needs_forward_metadata_init(self):
        return True                               # no overlap plan stream: metadata is planned by the runner


class LogitsProcessorOutput:
    def __init__(self, next_token_logits):
        self.next_token_logits = next_token_logits


# --- mem_cache ------------------------------------------------------------------------------------------------------

class ReqToTokenPool:
    def __init__(self, device):
        self.req_to_token = torch.zeros(MAX_RUNNING_REQUESTS, CONTEXT_LEN, dtype=torch.int32, device=device)


class NPUMHATokenToKVPool:
    def __init__(self, device):
        self.k_buffer = torch.zeros(NUM_PAGES * PAGE_SIZE, NUM_HEADS, HEAD_DIM, device=device)
        self.v_buffer = torch.zeros(NUM_PAGES * PAGE_SIZE, NUM_HEADS, HEAD_DIM, device=device)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[loc.long()] = cache_k.view(-1, NUM_HEADS, HEAD_DIM)
        self.v_buffer[loc.long()] = cache_v.view(-1, NUM_HEADS, HEAD_DIM)

    def get_key_buffer(self, layer_id):
        return self.k_buffer

    def get_value_buffer(self, layer_id):
        return self.v_buffer


# --- hardware_backend/npu/attention/ascend_backend.py ---------------------------------------------------------------

class ForwardMetadata:
    def __init__(self):
        self.block_tables = None
        self.seq_lens_cpu_int = None
        self.seq_lens_cpu_list = None
        self.seq_lens = None


class AscendAttnBackend:
    def __init__(self, model_runner):
        self.variant = model_runner.variant
        self.device = model_runner.device
        self.forward_metadata = None
        self.page_size = PAGE_SIZE
        self.max_context_len = CONTEXT_LEN
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.speculative_num_draft_tokens = None
        self.graph_metadata = {}
        self.graph_mode = False

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager: the metadata of this batch."""
        self.forward_metadata = ForwardMetadata()
        seq_lens_max = forward_batch.seq_lens.max()
        self.forward_metadata.block_tables = (
            self.req_to_token[forward_batch.req_pool_indices, :seq_lens_max][:, :: self.page_size] // self.page_size)
        self.forward_metadata.seq_lens = forward_batch.seq_lens.int()
        self.forward_metadata.seq_lens_cpu_int = forward_batch.seq_lens_cpu.int()
        self.graph_mode = False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        total_context_len = self.max_context_len + self.page_size - 1
        self.graph_metadata = {
            "block_tables": torch.empty((max_bs, total_context_len // self.page_size), dtype=torch.int32,
                                        device=self.device),
        }

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        bs = forward_batch.batch_size
        if in_capture:
            self._init_cuda_graph_metadata(bs, forward_batch.forward_mode, forward_batch.seq_lens)
        self._apply_cuda_graph_metadata(
            bs=bs,
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=forward_batch.seq_lens,
            seq_lens_cpu=forward_batch.seq_lens.cpu() if in_capture else forward_batch.seq_lens_cpu,
            forward_mode=forward_batch.forward_mode,
            spec_info=forward_batch.spec_info,
        )

    def _init_cuda_graph_metadata(self, bs, forward_mode, seq_lens):
        """Create and store the per-bs ForwardMetadata for CUDA graph capture."""
        metadata = ForwardMetadata()
        metadata.block_tables = self.graph_metadata["block_tables"][:bs, :]
        metadata.seq_lens_cpu_list = seq_lens.cpu().int().tolist()
        metadata.seq_lens = seq_lens
        self.graph_metadata[bs] = metadata
        return metadata

    def _apply_cuda_graph_metadata(self, bs, req_pool_indices, seq_lens, seq_lens_cpu, forward_mode, spec_info):
        """Shared capture+replay body for the cuda-graph init path."""
        metadata = self.graph_metadata[bs]
        max_len = seq_lens_cpu[:bs].max().item()
        if forward_mode.is_target_verify() and not _is_dflash_verify(spec_info):
            max_len += self.speculative_num_draft_tokens
        max_seq_pages = (max_len + self.page_size - 1) // self.page_size
        metadata.block_tables[:bs, :max_seq_pages].copy_(
            self.req_to_token[req_pool_indices[:bs], 0:max_len:self.page_size] // self.page_size)
        metadata.block_tables[:bs, max_seq_pages:].fill_(0)
        metadata.block_tables[bs:, :].fill_(0)

        if forward_mode.is_target_verify():
            seq_lens = seq_lens + self.speculative_num_draft_tokens
            # For DFlash, seq_lens_cpu (= prefix + block_size) is the true KV
            if self.variant == "bug":
                # length; other spec algorithms already added the draft tokens above.
                if _is_dflash_verify(spec_info) and seq_lens_cpu is not None:
                    kv_lens = seq_lens_cpu[:bs]
                else:
                    kv_lens = seq_lens[:bs]
                metadata.seq_lens_cpu_list = kv_lens.cpu().int().tolist()
            elif _is_dflash_verify(spec_info) and seq_lens_cpu is not None:
                # length; refresh the graph-bound list from that CPU tensor.
                metadata.seq_lens_cpu_list = seq_lens_cpu[:bs].int().tolist()
        metadata.seq_lens[:bs].copy_(seq_lens[:bs])

        self.forward_metadata = metadata
        self.graph_mode = True

    def get_cuda_graph_seq_len_fill_value(self):
        return 0

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, self.page_size, NUM_HEADS * HEAD_DIM)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id).view(-1, self.page_size,
                                                                              NUM_HEADS * HEAD_DIM)
        query = q.view(-1, 1, NUM_HEADS * HEAD_DIM)
        if self.forward_metadata.seq_lens_cpu_int is None:
            actual_seq_lengths_kv = self.forward_metadata.seq_lens_cpu_list
        else:
            actual_seq_lengths_kv = self.forward_metadata.seq_lens_cpu_int.cpu().int().tolist()
        output, _ = npu_fused_infer_attention_score(
            query, k_cache, v_cache,
            block_table=self.forward_metadata.block_tables,
            block_size=self.page_size,
            num_heads=NUM_HEADS,
            num_key_value_heads=NUM_HEADS,
            input_layout="BSH",
            scale=HEAD_DIM ** -0.5,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
        )
        return output.view(-1, NUM_HEADS * HEAD_DIM)


# --- the model ------------------------------------------------------------------------------------------------------

class RadixAttention:
    def __init__(self, layer_id, attn_backend):
        self.layer_id, self.attn_backend = layer_id, attn_backend

    def __call__(self, q, k, v, forward_batch):
        return self.attn_backend.forward_decode(q, k, v, self, forward_batch)


class TinyForCausalLM:
    def __init__(self, attn_backend, device):
        gen = generator(39879)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embed_positions = randn(CONTEXT_LEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.qkv_proj = randn(HIDDEN, 3 * NUM_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.o_proj = randn(NUM_HEADS * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.attn = RadixAttention(0, attn_backend)

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.embed_tokens[input_ids] + self.embed_positions[positions]
        q, k, v = (hidden @ self.qkv_proj).split(NUM_HEADS * HEAD_DIM, dim=-1)
        hidden = hidden + self.attn(q, k, v, forward_batch) @ self.o_proj
        return LogitsProcessorOutput(next_token_logits=hidden @ self.lm_head)


# --- hardware_backend/npu/graph_runner/npu_graph_runner.py ------------------------------------------------------------

class NPUGraphRunner:
    """A NPUGraphRunner runs the forward pass of a model with npu graph (the CudaGraphRunner parts it uses inlined)."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.variant, self.device = model_runner.variant, model_runner.device
        self.attn_backend = model_runner.attn_backend
        self.capture_forward_mode = ForwardMode.DECODE
        self.captured_req_width = 1
        self.capture_bs = list(CUDA_GRAPH_BS)
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * self.captured_req_width
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = self.attn_backend.get_cuda_graph_seq_len_fill_value()
        with torch.device(self.device):
            self.input_ids = torch.zeros((self.max_num_token,), dtype=torch.int64)
            self.req_pool_indices = torch.zeros((self.max_bs,), dtype=torch.int64)
            self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32)
            self.out_cache_loc = torch.zeros((self.max_num_token,), dtype=self._cache_loc_dtype())
            self.positions = torch.zeros((self.max_num_token,), dtype=torch.int64)
        self.seq_lens_cpu = host(torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32), self.device)
        self.update_attr_name = None
        self.update_attr_type = None
        self._init_arch_map()
        self.graphs, self.output_buffers = {}, {}
        self.capture()

    def _init_arch_map(self):
        self.attr_name = {"MLA": "actual_seq_lengths_kv", "MHA": "context_lens", "TARGET_VERIFY": "actual_seq_kvlen"}
        self.attr_type = {"MLA": [], "MHA": torch.Tensor(), "TARGET_VERIFY": []}

    def _get_update_attr_name(self):
        return self.attr_name["MLA"]

    def _get_update_attr_type(self):
        return self.attr_type["MLA"]

    def _cache_loc_dtype(self):
        return torch.int32

    def _create_device_graph(self):
        return NPUGraph(self.device)

    def can_run(self, forward_batch):
        return forward_batch.batch_size <= self.max_bs

    def capture(self):
        for bs in reversed(self.capture_bs):
            graph, output = self.capture_one_batch_size(bs)
            self.graphs[bs] = graph
            self.output_buffers[bs] = output

    def capture_one_batch_size(self, bs):
        num_tokens = bs * self.captured_req_width
        forward_batch = ForwardBatch(
            forward_mode=self.capture_forward_mode, batch_size=bs,
            input_ids=self.input_ids[:num_tokens], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], out_cache_loc=self.out_cache_loc[:num_tokens],
            positions=self.positions[:num_tokens], seq_lens_cpu=self.seq_lens_cpu[:bs])
        self.attn_backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)

        def run_once():
            return self.model_runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

        graph = self._create_device_graph()
        output = self._capture_graph(graph, run_once, bs)
        return graph, output

    def _capture_graph(self, graph, run_once_fn, bs):
        global _capturing_graph
        pool = self.model_runner.token_to_kv_pool
        static = {"input_ids": self.input_ids, "positions": self.positions, "req_pool_indices": self.req_pool_indices,
                  "seq_lens": self.seq_lens, "out_cache_loc": self.out_cache_loc,
                  "block_tables": self.attn_backend.graph_metadata["block_tables"]}
        _capturing_graph = graph                  # torch.npu.graph(graph, ..., auto_dispatch_capture=True)
        try:
            graph.graph, out = capture(lambda: run_once_fn().next_token_logits, device=self.device, warmups=2,
                                       name=f"NPUGraph decode bs={bs}", owner="NPUGraphRunner", static=static,
                                       state={"k_buffer": pool.k_buffer, "v_buffer": pool.v_buffer})
        finally:
            _capturing_graph = None
        graph.outputs = out
        return LogitsProcessorOutput(next_token_logits=out)

    def _update_inputs(self, seq_lens):
        if isinstance(self.update_attr_type, torch.Tensor):
            seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.graphs[self.bs].update(cpu_update_input=[{self.update_attr_name: seq_lens}])

    def load_batch(self, forward_batch):
        """CudaGraphRunner.replay_prepare: copy the batch into the capture buffers, pad, plan the metadata."""
        raw_bs = forward_batch.batch_size
        raw_num_token = raw_bs * self.captured_req_width
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        if bs != raw_bs:
            self.seq_lens.fill_(self.seq_len_fill_value)
            self.out_cache_loc.zero_()
            self.seq_lens_cpu.fill_(self.seq_len_fill_value)
        self.input_ids[:raw_num_token].copy_(forward_batch.input_ids)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw_num_token].copy_(forward_batch.out_cache_loc)
        self.positions[:raw_num_token].copy_(forward_batch.positions)
        self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        self.attn_backend.init_forward_metadata_out_graph(ForwardBatch(
            forward_mode=forward_batch.forward_mode, batch_size=bs,
            input_ids=self.input_ids[: bs * self.captured_req_width], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], out_cache_loc=self.out_cache_loc[: bs * self.captured_req_width],
            positions=self.positions[: bs * self.captured_req_width], seq_lens_cpu=self.seq_lens_cpu[:bs],
            spec_info=forward_batch.spec_info))
        self.raw_bs, self.raw_num_token, self.bs = raw_bs, raw_num_token, bs

    def execute(self, forward_batch):
        if forward_batch.needs_forward_metadata_init():
            self.load_batch(forward_batch)
        else:
            # In speculative decoding, these two fields are still needed.
            self.input_ids[: self.raw_num_token].copy_(forward_batch.input_ids)
            self.positions[: self.raw_num_token].copy_(forward_batch.positions)

        graph_key = self.bs
        self.update_attr_name = self._get_update_attr_name()
        self.update_attr_type = self._get_update_attr_type()
        if self.variant == "bug" or self.model_runner.spec_algorithm.is_dflash():
            # #37565: the graph-bound list the backend keeps (refreshed only on a verify replay)
            seq_lens = self.attn_backend.forward_metadata.seq_lens_cpu_list
        elif forward_batch.forward_mode.is_target_verify():
            seq_lens_cpu = forward_batch.seq_lens.cpu() + self.captured_req_width
            seq_lens = seq_lens_cpu.tolist() + [0] * (self.bs - self.raw_bs)
        else:
            seq_lens = forward_batch.seq_lens.cpu().tolist() + [0] * (self.bs - self.raw_bs)
        self._update_inputs(seq_lens)
        graph = self.graphs[graph_key]
        output = replay(graph.graph, graph.outputs, real=self.raw_num_token, size=self.bs * self.captured_req_width,
                        padded={"input_ids": self.input_ids, "positions": self.positions,
                                "req_pool_indices": self.req_pool_indices})
        return LogitsProcessorOutput(next_token_logits=output[: self.raw_num_token])


# --- model_runner.py ------------------------------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, variant, device, use_graphs):
        self.variant, self.device = variant, device
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.req_to_token_pool = ReqToTokenPool(device)
        self.token_to_kv_pool = NPUMHATokenToKVPool(device)
        self.attn_backend = AscendAttnBackend(self)
        self.model = TinyForCausalLM(self.attn_backend, device)
        self.graph_runner = NPUGraphRunner(self) if use_graphs else None

    def forward(self, forward_batch):
        if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
            return self.graph_runner.execute(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


# --- the workload ---------------------------------------------------------------------------------------------------

PREFIX_LENS = [5, 7, 3, 6]
SCHEDULE = [[0, 1, 2, 3]] * 3 + [[0, 1, 3]] * 2 + [[0, 1]]       # request 2 finishes, then request 3


def serve(variant, device, use_graphs):
    runner = ModelRunner(variant, device, use_graphs)
    gen = generator(18)
    pool, req_to_token = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    pages_per_req = CONTEXT_LEN // PAGE_SIZE
    for r in range(MAX_RUNNING_REQUESTS):                     # each request's pages, and its prefilled KV
        req_to_token[r] = (1 + r * pages_per_req) * PAGE_SIZE + torch.arange(CONTEXT_LEN, dtype=torch.int32)
        slots = req_to_token[r, : PREFIX_LENS[r]].long()
        pool.k_buffer[slots] = randn(PREFIX_LENS[r], NUM_HEADS, HEAD_DIM, gen=gen, device=device)
        pool.v_buffer[slots] = randn(PREFIX_LENS[r], NUM_HEADS, HEAD_DIM, gen=gen, device=device)
    lens = list(PREFIX_LENS)
    logits = []
    for reqs in SCHEDULE:
        token_ids = torch.randint(0, VOCAB, (len(reqs),), generator=gen)
        positions = [lens[r] for r in reqs]
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(reqs),
            input_ids=token_ids.to(device),
            req_pool_indices=torch.tensor(reqs, dtype=torch.int64).to(device),
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32).to(device),
            out_cache_loc=torch.stack([req_to_token[r, p] for r, p in zip(reqs, positions)]),
            positions=torch.tensor(positions, dtype=torch.int64).to(device),
            seq_lens_cpu=host(torch.tensor([p + 1 for p in positions], dtype=torch.int32), device))
        logits.append(runner.forward(forward_batch).next_token_logits.clone())    # the sampler reads them now
        for r in reqs:
            lens[r] += 1
    return logits


def run(variant: str, device: str = "cpu"):
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(variant, device, use_graphs=True), lambda: serve(variant, device, use_graphs=False))
