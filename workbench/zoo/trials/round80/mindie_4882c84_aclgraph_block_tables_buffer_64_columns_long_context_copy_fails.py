"""The ACL-graph decode runner's persistent ``block_tables`` input buffer is registered with a hard-coded 64 columns, so a decode batch whose longest request holds more than 64 KV blocks cannot be copied into it.

Upstream: https://github.com/Ascend/MindIE-LLM/commit/4882c840d21bc544526336e6811dc84823d16f1c ("[aclgraph] Fix block
calculation", gitcode MR !446 "merge devfix into dev", 2026-03-31). Follow-up:
https://github.com/Ascend/MindIE-LLM/commit/190017484ec15fabab33cf21e991c3f53609f904 (MR !766, 2026-04-07, "fix the
aclgraph block tables not accounting for async scheduling and MTP": ``+ 5`` spare columns).
Symptom: with the aclgraph model runner (``ModelRunnerExp`` + ``AclGraphBackend``), a decode step fails as soon as
the longest request of the batch has more than 64 KV blocks (more than 64 x 128 = 8192 tokens of context): the D2D
copy of the step's block table into the graph's input buffer raises a shape error ("The size of tensor a (64) must
match the size of tensor b (65) at non-singleton dimension 1"). Eager decode (aclgraph off) serves the same
requests. Upstream states no symptom; the failure is read from the code: ``copy_`` into a narrower slice raises, it
does not truncate.
Mechanism: ``ModelRunnerExp._init_buffer`` -> ``ForwardContext.register`` -> ``FiaAttentionMetadata.register_buffer``
(``mindie_llm/runtime/layers/attention/backend/fia_attention.py``; ``SfaMetadata.register_buffer`` in
``sparse_attention.py`` is the same) registers the graph's static input ``input_buffer["block_tables"]`` as
``torch.zeros((max_num_token, 64))``. The captured FIA decode (``apply_fullgraph_attention``) reads that buffer. At
every graph decode step ``ModelRunnerExp._padding_forward_context`` -> ``ForwardContext.copy`` ->
``FiaAttentionMetadata.copy`` does ``input_buffer_block_tables[:num_actual_tokens, :self.block_tables.shape[-1]]
.copy_(self.block_tables)``. The step's live table is ``InputMetadata.batch_block_tables``: its width is the block
count of the batch's longest request (``np.count_nonzero(block_tables > -1, axis=-1).max()``). Past 64 columns the
slice stops at the buffer's 64 columns, and ``copy_`` of a ``[B, w > 64]`` table into ``[B, 64]`` raises. The
older ``model_runner.py`` sized its graph table ``(max_seq_len + block_size - 1) // block_size``; the refactor
(57da56a "model_runner重构") hard-coded 64. Eager decode passes the live table straight to the kernel.
Doctor: undersized-buffer, at register_buffer (a static graph input registered narrower than the data a step must
put in it: the block table of a long request does not fit the captured buffer's columns. The fix changes the
width here, and threads ``max_block_per_seq`` through ``ModelRunnerExp.__init__`` / ``_init_buffer`` and
``ForwardContext.register`` to reach it).
Fix (upstream): ``ModelRunnerExp.__init__`` takes ``block_size`` (passed on by ``AclGraphModelWrapperExp``) and
computes ``self._max_block_per_seq = (max_seq_len + block_size - 1) // block_size``. ``_init_buffer`` passes it via
``ForwardContext.register`` to ``register_buffer``, which registers ``torch.zeros((max_num_token,
max_block_per_seq))``. 1900174 later adds 5 spare columns for DP, async scheduling and MTP lookahead blocks; this
workload allocates no lookahead blocks, so the modelled fix is 4882c84 alone.
Modelled: one decoder layer (embedding + learned positions, q/k/v/o projections, one FIA attention layer, lm
head), no MTP, DP, SFA or quantisation. Sizes are scaled down: block size 2 (upstream 128), hard-coded width 4
columns (upstream 64), ``max_seq_len`` 16, ``max_batch_size`` 4, so capture sizes are [1, 2, 4]. The generator's
prefill (eager in both modes) fills the KV cache, and then four teacher-forced decode steps of three requests
(padded to the size-4 graph) run. The longest request reaches 5 blocks at the third decode step. The torch_npu
kernels (``_npu_reshape_and_cache``, ``npu_fused_infer_attention_score``) are written in torch. torch_npu's
``auto_dispatch_capture`` keeps the captured FIA task's host argument ``actual_seq_lengths_kv`` rewritable by
``graph.update(cpu_update_input=...)``; this is modelled as a task-argument device buffer that the update writes.
Upstream calls ``update`` after the asynchronous ``replay()``, and the captured task waits for the update. The
emulation runs synchronously, so the update is applied just before the replay.
"""

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Ascend/MindIE-LLM/commit/4882c840d21bc544526336e6811dc84823d16f1c"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "register_buffer"
SYMPTOM = ("aclgraph decode fails once the batch's longest request holds more than 64 KV blocks (> 8192 tokens): "
           "FiaAttentionMetadata.copy cannot copy the wider block table into the 64-column graph input buffer")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM = 16, 8, 2, 4
NUM_KV_HEADS = NUM_HEADS
BLOCK_SIZE = 2                      # upstream: 128 (the FIA impl and the copy hard-code it)
HARD_CODED_BLOCK_COLUMNS = 4        # upstream: 64
MAX_SEQ_LEN, MAX_BATCH_SIZE = 16, 4
NUM_BLOCKS = 16
LAYER_PREFIX = "model.layers.0.self_attn.attn"


# --- mindie_llm/runtime/model_runner/input_buffer.py ---------------------------------------------------------

class InputBuffer:
    """Singleton store of the graph-mode input tensors (``input_buffer``)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, key):
        return self._buffers[key]

    def register(self, key, tensor):
        # When enable MTP, both main and draft models share the same input buffer: skip a second registration.
        if key in self._buffers:
            return
        self._buffers[key] = tensor


input_buffer = InputBuffer()
_global_attn_dict: dict = {}


def get_global_attn_dict():
    return _global_attn_dict


# --- mindie_llm/runtime/model_runner/forward_context.py / forward_context_exp.py -----------------------------

class BatchDescriptor(NamedTuple):
    num_tokens: int
    is_flash_comm_enabled: bool = False


@dataclasses.dataclass
class AttentionMetadata:
    seq_lens: object = None
    seq_lens_list: object = None
    slot_mapping: object = None
    block_tables: object = None
    attn_mask: object = None
    max_seq_len: int = 0
    num_tokens: int = 0


@dataclasses.dataclass
class ForwardContext:
    is_prefill: bool | None = None
    attn_metadata: AttentionMetadata | None = None
    attn_metadata_dict: dict | None = None
    capturing: bool = False
    num_actual_tokens: int = 0
    batch_descriptor: BatchDescriptor | None = None
    graph_task_args: dict | None = None      # (model) torch_npu auto-dispatch: the captured task's host arguments

    @staticmethod
    def register(max_num_token, device, variant, max_block_per_seq=None):
        """Register buffer for attention metadata (the fix adds ``max_block_per_seq``)."""
        attns = get_global_attn_dict()
        attn_layer = attns[next(iter(attns))]
        metadata_cls = attn_layer.get_attn_backend().get_builder_cls().get_metadata_cls()
        if variant == "fix":
            metadata_cls.register_buffer(max_num_token, device, max_block_per_seq)
        else:
            metadata_cls.register_buffer(max_num_token, device)

    def to_device(self, device):
        if self.attn_metadata is not None:
            self.attn_metadata.to_device(device)

    def copy(self, num_actual_tokens, num_tokens):
        self.attn_metadata.copy(num_actual_tokens, num_tokens)


_forward_context: ForwardContext | None = None


def get_forward_context():
    return _forward_context


def set_forward_context(context):
    global _forward_context
    _forward_context = context


def create_forward_context(model_inputs, mask):
    attns = get_global_attn_dict()
    metadata_cls = attns[next(iter(attns))].get_attn_backend().get_builder_cls().get_metadata_cls()
    attn_metadata = metadata_cls.from_model_input(model_inputs, mask)
    n = len(model_inputs.input_ids)
    return ForwardContext(is_prefill=model_inputs.is_prefill, attn_metadata=attn_metadata, num_actual_tokens=n,
                          batch_descriptor=BatchDescriptor(n))


def build_layerwise_attn_metadata(attn_metadata):
    return {prefix: attn_metadata for prefix in get_global_attn_dict()}


@dataclasses.dataclass
class ModelInput:
    is_prefill: bool
    input_ids: object
    position_ids: object
    block_tables: object
    slots: object
    context_length: object
    max_seq_len: int


# --- torch_npu kernels (torch forms) -------------------------------------------------------------------------

def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """Write token i's K/V to cache slot ``slot_indices[i]``; slot -1 (a padded token) is skipped."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    match = slot_indices.long().unsqueeze(1) == torch.arange(num_slots, device=key.device).unsqueeze(0)  # [T, S]
    written = match.any(0).unsqueeze(1)
    for src, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(num_slots, -1)
        upd = match.t().to(src.dtype) @ src.reshape(src.shape[0], -1)
        flat.copy_(torch.where(written, upd, flat))


def npu_fused_infer_attention_score(query, key, value, *, num_heads, num_key_value_heads, block_size, scale,
                                    block_table, actual_seq_lengths_kv):
    """Paged decode FIA (BSH, one query per request): request b attends to its first
    ``actual_seq_lengths_kv[b]`` positions, whose blocks it reads from ``block_table[b]``."""
    batch = query.shape[0]
    q = query.reshape(batch, num_heads, HEAD_DIM)
    t = torch.arange(block_table.shape[1] * block_size, device=query.device)
    blocks = block_table[:batch][:, t // block_size].long().clamp(min=0)          # -1 pads: never attended
    slots = blocks * block_size + t % block_size                                   # [B, T]
    k = key.reshape(-1, num_key_value_heads, HEAD_DIM)[slots]
    v = value.reshape(-1, num_key_value_heads, HEAD_DIM)[slots]
    scores = torch.einsum("bhd,bthd->bht", q, k) * scale
    hidden = t.unsqueeze(0) >= actual_seq_lengths_kv[:batch].long().unsqueeze(1)
    p = torch.softmax(scores.masked_fill(hidden.unsqueeze(1), -1e9), dim=-1)
    return torch.einsum("bht,bthd->bhd", p, v).reshape(batch, 1, num_heads * HEAD_DIM)


def npu_fused_infer_attention_score_prefill(query, key, value, *, actual_seq_lengths, scale):
    """TND prefill, ``sparse_mode=3`` (causal within each sequence of the packed batch)."""
    lens = torch.diff(actual_seq_lengths, prepend=actual_seq_lengths.new_zeros(1))
    seq_id = torch.repeat_interleave(torch.arange(len(lens), device=query.device), lens)
    pos = torch.arange(query.shape[0], device=query.device)
    hidden = (seq_id.unsqueeze(1) != seq_id.unsqueeze(0)) | (pos.unsqueeze(0) > pos.unsqueeze(1))
    scores = torch.einsum("ihd,jhd->hij", query, key) * scale
    p = torch.softmax(scores.masked_fill(hidden.unsqueeze(0), -1e9), dim=-1)
    return torch.einsum("hij,jhd->ihd", p, value)


# --- mindie_llm/runtime/layers/attention/backend/fia_attention.py --------------------------------------------

@dataclasses.dataclass
class FiaAttentionMetadata(AttentionMetadata):

    @staticmethod
    def from_model_input(model_inputs, mask, num_speculative_tokens=0):
        return FiaAttentionMetadata(seq_lens=model_inputs.context_length, slot_mapping=model_inputs.slots,
                                    block_tables=model_inputs.block_tables, attn_mask=mask,
                                    max_seq_len=model_inputs.max_seq_len)

    @staticmethod
    def register_buffer(max_num_token, device, max_block_per_seq=None):
        input_buffer.register("seq_lens", torch.zeros(max_num_token, dtype=torch.int32, device=device))
        if max_block_per_seq is None:
            # before 4882c84: torch.zeros((max_num_token, 64), ...)
            input_buffer.register("block_tables", torch.zeros((max_num_token, HARD_CODED_BLOCK_COLUMNS),
                                                              dtype=torch.int32, device=device))
        else:
            input_buffer.register("block_tables",
                                  torch.zeros((max_num_token, max_block_per_seq), dtype=torch.int32, device=device))
        input_buffer.register("slot_mapping", -torch.ones(max_num_token, dtype=torch.int32, device=device))

    def to_device(self, device):
        self.block_tables = torch.tensor(self.block_tables, dtype=torch.int32).to(device)
        self.slot_mapping = torch.tensor(self.slot_mapping, dtype=torch.int32).to(device)
        self.seq_lens_list = self.seq_lens
        self.seq_lens = torch.tensor(self.seq_lens).to(device)

    def copy(self, num_actual_tokens, num_tokens):
        # D2D operation
        input_buffer_seq_lens = input_buffer.get("seq_lens")
        input_buffer_seq_lens[:num_actual_tokens].copy_(self.seq_lens[:num_actual_tokens])
        input_buffer_seq_lens[num_actual_tokens:num_tokens].fill_(0)
        self.seq_lens = input_buffer_seq_lens[:num_tokens]

        self.seq_lens_list = self.seq_lens_list.tolist() + [0] * (num_tokens - num_actual_tokens)

        max_seq_pages = (self.max_seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE       # upstream: + 128 - 1) // 128

        input_buffer_block_tables = input_buffer.get("block_tables")
        input_buffer_block_tables[:num_actual_tokens, :self.block_tables.shape[-1]].copy_(self.block_tables)
        input_buffer_block_tables[:num_tokens, max_seq_pages:].fill_(0)
        input_buffer_block_tables[num_tokens:, :].fill_(0)
        self.block_tables = input_buffer_block_tables

        input_buffer_slot_mapping = input_buffer.get("slot_mapping")
        input_buffer_slot_mapping[:num_actual_tokens].copy_(self.slot_mapping[:num_actual_tokens])
        self.slot_mapping = input_buffer_slot_mapping[:num_tokens]


class FiaAttentionMetadataBuilder:
    @staticmethod
    def get_metadata_cls():
        return FiaAttentionMetadata


class FiaAttentionBackend:
    @staticmethod
    def get_builder_cls():
        return FiaAttentionMetadataBuilder


class FiaAttentionBackendImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.q_size = num_heads * head_size
        self.key_cache = self.value_cache = None
        self.block_size = BLOCK_SIZE   # NOTE: currently hard-coding.

    def reshape_and_cache(self, key, value, kv_cache, attn_metadata):
        if self.key_cache is None or id(self.key_cache) != id(kv_cache[0]):
            self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
        _npu_reshape_and_cache(key, value, kv_cache[0], kv_cache[1], attn_metadata.slot_mapping)
        return key, value

    def apply_prefill_attention(self, query, key, value, attn_metadata):
        seq_lens = torch.cumsum(attn_metadata.seq_lens, dim=0)
        out = npu_fused_infer_attention_score_prefill(query, key, value, actual_seq_lengths=seq_lens,
                                                      scale=self.scale)
        return out.reshape(query.shape[0], -1)

    def apply_decode_attention(self, query, key, value, attn_metadata):
        block_tables, seq_lens = attn_metadata.block_tables, attn_metadata.seq_lens
        batch_size = seq_lens.shape[0]
        query = query.view(batch_size, 1, self.q_size)
        key = self.key_cache.flatten(2, 3).contiguous()
        value = self.value_cache.flatten(2, 3).contiguous()
        attn_output = npu_fused_infer_attention_score(
            query, key, value, num_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            block_size=self.key_cache.shape[1], scale=self.scale, block_table=block_tables,
            actual_seq_lengths_kv=seq_lens)
        return attn_output.view(batch_size, -1)

    def apply_fullgraph_attention(self, query, attn_metadata, forward_context):
        block_size = self.block_size
        k_cache = self.key_cache.view(-1, block_size, self.num_kv_heads * self.head_size)
        v_cache = self.value_cache.view(-1, block_size, self.num_kv_heads * self.head_size)
        query = query.reshape(-1, 1, self.q_size)
        batch_size = query.shape[0]
        # actual_seq_lengths_kv=attn_metadata.seq_lens_list: a host list, captured as a task argument that
        # graph.update(cpu_update_input=...) rewrites before each replay (torch_npu auto_dispatch_capture).
        output = npu_fused_infer_attention_score(
            query, k_cache, v_cache, num_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            block_size=block_size, scale=self.scale, block_table=attn_metadata.block_tables,
            actual_seq_lengths_kv=forward_context.graph_task_args["actual_seq_lengths_kv"])
        return output.view(batch_size, -1)

    def forward_impl(self, query, key, value, forward_context, attn_metadata):
        if forward_context.is_prefill:
            return self.apply_prefill_attention(query, key, value, attn_metadata)
        elif forward_context.capturing:
            return self.apply_fullgraph_attention(query, attn_metadata, forward_context)
        else:
            return self.apply_decode_attention(query, key, value, attn_metadata)

    def forward(self, layer, query, key, value, kv_cache):
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)
        forward_context = get_forward_context()
        attn_metadata = forward_context.attn_metadata
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata[layer.prefix]
        key, value = self.reshape_and_cache(key, value, kv_cache, attn_metadata)
        return self.forward_impl(query, key, value, forward_context, attn_metadata)


class Attention:
    def __init__(self, prefix):
        self.prefix = prefix
        self.impl = FiaAttentionBackendImpl(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS)
        self.key_cache = self.value_cache = None

    def get_attn_backend(self):
        return FiaAttentionBackend

    def __call__(self, q, k, v):
        return self.impl.forward(self, q, k, v, (self.key_cache, self.value_cache))


class Model:
    def __init__(self, device):
        gen = generator(4882)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.embed_positions = randn(MAX_SEQ_LEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.attn = Attention(LAYER_PREFIX)
        _global_attn_dict.clear()
        _global_attn_dict[LAYER_PREFIX] = self.attn

    def __call__(self, input_ids, position_ids):
        h = self.embed_tokens[input_ids.long()] + self.embed_positions[position_ids]
        a = self.attn(h @ self.wq, h @ self.wk, h @ self.wv)
        return h + a @ self.wo

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- mindie_llm/runtime/compilation/aclgraph_backend.py -------------------------------------------------------

class AclGraphBackend:
    def __init__(self, model, max_num_tokens_per_batch, device):
        self.model, self.device = model, device
        self.graphs: dict = {}
        self.output_buffer: dict = {}
        self.task_args: dict = {}
        self.capture_sizes = self._get_capture_sizes(max_num_tokens_per_batch)
        self.pool = None

    def __call__(self, input_ids, position_ids):
        forward_context = get_forward_context()
        batch_descriptor = forward_context.batch_descriptor
        num_actual_tokens = forward_context.num_actual_tokens
        attn_metadata_dict = forward_context.attn_metadata_dict
        # In prefill stage or num tokens larger than max capture size will use eager mode
        if forward_context.is_prefill or num_actual_tokens > self.capture_sizes[-1]:
            return self.model(input_ids, position_ids)

        num_tokens = batch_descriptor.num_tokens
        graph = self.graphs.get(batch_descriptor)
        if graph is None:
            # start capturing
            if self.pool is None:
                self.pool = graph_pool_handle(self.device)
            task_args = {"actual_seq_lengths_kv": torch.zeros(num_tokens, dtype=torch.int32, device=self.device)}
            forward_context.capturing = True
            forward_context.graph_task_args = task_args
            graph, hidden_state = capture(
                lambda: self.model(input_ids, position_ids), device=self.device, pool=self.pool, warmups=0,
                name=f"aclgraph {batch_descriptor}", owner="AclGraphBackend", capture_error_mode="thread_local",
                static={name: input_buffer.get(name) for name in
                        ("input_ids", "position_ids", "seq_lens", "block_tables", "slot_mapping")}
                | {f"{batch_descriptor}.fia_task.actual_seq_lengths_kv": task_args["actual_seq_lengths_kv"]},
                state={"key_cache": self.model.attn.key_cache, "value_cache": self.model.attn.value_cache})
            self.output_buffer[batch_descriptor] = hidden_state
            self.graphs[batch_descriptor] = graph
            self.task_args[batch_descriptor] = task_args

        # graph.update(cpu_update_input=[{"actual_seq_lengths_kv": ...}]): upstream right after the asynchronous
        # graph.replay(), which the updated task waits for; applied first here (synchronous emulation).
        actual_seq_lengths_kv = attn_metadata_dict[next(iter(attn_metadata_dict))].seq_lens_list
        self.task_args[batch_descriptor]["actual_seq_lengths_kv"].copy_(
            torch.tensor(list(actual_seq_lengths_kv), dtype=torch.int32))
        padded = None
        if num_actual_tokens < num_tokens:
            padded = {name: input_buffer.get(name) for name in
                      ("input_ids", "position_ids", "slot_mapping", "block_tables")}
        hidden_state = replay(graph, self.output_buffer[batch_descriptor], real=num_actual_tokens, size=num_tokens,
                              padded=padded)
        return hidden_state[:num_actual_tokens]

    @staticmethod
    def _get_capture_sizes(max_num_tokens_per_batch, step=8):
        small_sizes = [1, 2, 4]
        large_sizes = range(step, max_num_tokens_per_batch, step)
        all_sizes = sorted({*small_sizes, *large_sizes, max_num_tokens_per_batch})
        return [s for s in all_sizes if s <= max_num_tokens_per_batch]

    def get_padded_graph_size(self, x):
        return next((bs for bs in self.capture_sizes if bs >= x), x)

    def compute_logits(self, hidden_states):
        return self.model.compute_logits(hidden_states)


# --- mindie_llm/runtime/model_runner/model_runner_exp.py ------------------------------------------------------

class ModelRunnerExp:
    def __init__(self, variant, device, enable_aclgraph, max_batch_size, max_seq_len, block_size):
        self.variant, self.device = variant, device
        self._max_batch_size = max_batch_size
        self._max_num_token = max_batch_size
        self._max_seq_len = max_seq_len
        if variant == "fix":
            self._block_size = block_size
            self._max_block_per_seq = (self._max_seq_len + self._block_size - 1) // self._block_size
        self._is_aclgraph_enabled = enable_aclgraph       # upstream: role != 'prefill'
        self._mask = None
        self._kv_caches_id = None
        self._is_warmup_completed = False
        self.model = Model(device)                        # load_weights
        if self._is_aclgraph_enabled:
            self.model = AclGraphBackend(self.model, self._max_batch_size, device)
            self._max_num_token = self.model.capture_sizes[-1]

    def compile(self, kv_caches):
        self._bind_kv_cache(kv_caches)
        if self._is_aclgraph_enabled:
            self._warm_up_and_compile()

    def forward(self, kv_caches, input_ids, position_ids, forward_context):
        if self._kv_caches_id != id(kv_caches[0][0]):       # _kv_cache_info.check_diff
            self._bind_kv_cache(kv_caches)
            if not self._is_warmup_completed:
                self._init_buffer()
                self._is_warmup_completed = True
        # Do operations like D2D to prepare for the forward function
        if self._is_aclgraph_enabled and not forward_context.is_prefill:
            input_ids, position_ids, forward_context = self._padding_forward_context(
                input_ids, position_ids, forward_context)
        forward_context.attn_metadata_dict = build_layerwise_attn_metadata(forward_context.attn_metadata)
        set_forward_context(forward_context)
        hidden_states = self.model(input_ids, position_ids)
        return self.model.compute_logits(hidden_states)

    def build_forward_context(self, model_inputs):
        forward_context = create_forward_context(model_inputs, self._mask)
        padding_tokens = forward_context.num_actual_tokens
        if self._is_aclgraph_enabled:
            num_tokens = self.model.get_padded_graph_size(padding_tokens)
        else:
            num_tokens = forward_context.num_actual_tokens
        forward_context.batch_descriptor = BatchDescriptor(num_tokens)
        forward_context.attn_metadata.num_tokens = num_tokens
        forward_context.to_device(self.device)
        return forward_context

    def _padding_forward_context(self, input_ids, position_ids, forward_context):
        num_actual_tokens = input_ids.shape[0]
        forward_context.num_actual_tokens = num_actual_tokens
        num_tokens = forward_context.batch_descriptor.num_tokens
        if num_tokens > self._max_num_token:
            return input_ids, position_ids, forward_context
        # do d2d operation for data not in atten_metadata
        input_buffer.get("input_ids")[:num_actual_tokens].copy_(input_ids[:num_actual_tokens])
        input_buffer.get("position_ids")[:num_actual_tokens].copy_(position_ids[:num_actual_tokens])
        forward_context.attn_metadata.num_tokens = num_tokens
        input_ids = input_buffer.get("input_ids")[:num_tokens]
        position_ids = input_buffer.get("position_ids")[:num_tokens]
        forward_context.copy(num_actual_tokens, num_tokens)
        return input_ids, position_ids, forward_context

    def _init_buffer(self):
        """Initialize input buffers for graph mode."""
        ForwardContext.register(self._max_num_token, self.device, self.variant,
                                getattr(self, "_max_block_per_seq", None))
        input_buffer.register("input_ids", torch.zeros(self._max_num_token, dtype=torch.int32, device=self.device))
        input_buffer.register("position_ids", torch.zeros(self._max_num_token, dtype=torch.int64, device=self.device))

    def _warm_up_and_compile(self):
        for num_tokens in reversed(self.model.capture_sizes):
            self._dummy_run(num_tokens)

    def _dummy_run(self, num_tokens):
        input_ids, position_ids = self._generate_dummy_inputs(num_tokens)
        _ = self.model(input_ids, position_ids)

    def _generate_dummy_inputs(self, num_tokens):
        input_ids = input_buffer.get("input_ids")[:num_tokens].fill_(0)
        position_ids = input_buffer.get("position_ids")[:num_tokens].fill_(0)
        slot_mapping = input_buffer.get("slot_mapping")[:num_tokens].fill_(-1)
        seq_lens = input_buffer.get("seq_lens")[:num_tokens].fill_(0)
        block_tables = input_buffer.get("block_tables")[:num_tokens, :].fill_(0)
        seq_lens_list = seq_lens.cpu().tolist()
        model_inputs = ModelInput(is_prefill=False, input_ids=input_ids, position_ids=position_ids,
                                  block_tables=block_tables, slots=slot_mapping, context_length=seq_lens,
                                  max_seq_len=max(seq_lens_list))
        forward_context = create_forward_context(model_inputs, self._mask)
        forward_context.batch_descriptor = BatchDescriptor(num_tokens)
        forward_context.attn_metadata.seq_lens_list = seq_lens_list
        forward_context.attn_metadata_dict = build_layerwise_attn_metadata(forward_context.attn_metadata)
        set_forward_context(forward_context)
        return input_ids, position_ids

    def _bind_kv_cache(self, kv_caches):
        self._kv_caches_id = id(kv_caches[0][0])
        for i, attn_layer in enumerate(get_global_attn_dict().values()):
            attn_layer.key_cache, attn_layer.value_cache = kv_caches[i]


# --- the generator side: requests, block allocation, batch_block_tables ---------------------------------------

def batch_block_tables(block_lists):
    """generator.generate pads each sequence's blocks with -1; InputMetadata trims the batch to the longest."""
    block_len_max = max(len(b) for b in block_lists)
    block_tables = np.asarray([np.pad(b, (0, block_len_max - len(b)), constant_values=-1) for b in block_lists])
    max_block_num = np.count_nonzero(block_tables > -1, axis=-1).max()
    return block_tables[:, :max_block_num].astype(np.int32)


def run(variant: str, device: str = "cpu"):
    gen = generator(48820)
    prompt_lens = [6, 3, 5]
    decode_steps = 4                    # request 0 reaches 9 tokens (5 blocks > 4 columns) at the third step
    own_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    allotted, start = [], 0
    for n in prompt_lens:
        need = -(-(n + decode_steps) // BLOCK_SIZE)
        allotted.append(own_blocks[start:start + need])
        start += need
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    decode_tokens = torch.randint(0, VOCAB, (decode_steps, len(prompt_lens)), generator=gen).tolist()

    def slot(r, pos):
        return allotted[r][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def model_input(is_prefill, tokens, positions, lens, slots):
        blocks = [allotted[r][:-(-c // BLOCK_SIZE)] for r, c in enumerate(lens)]
        return ModelInput(is_prefill=is_prefill, input_ids=np.asarray(tokens), position_ids=np.asarray(positions),
                          block_tables=batch_block_tables(blocks), slots=np.asarray(slots),
                          context_length=np.asarray(lens), max_seq_len=max(lens))

    def serve(aclgraph: bool):
        input_buffer._buffers.clear()                  # a fresh process
        runner = ModelRunnerExp(variant, device, aclgraph, MAX_BATCH_SIZE, MAX_SEQ_LEN, BLOCK_SIZE)
        kv_caches = [(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device),
                      torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device))]
        outs = []

        def step(mi):
            fc = runner.build_forward_context(mi)
            input_ids = torch.tensor(mi.input_ids, dtype=torch.int32, device=device)
            position_ids = torch.tensor(mi.position_ids, dtype=torch.int64, device=device)
            outs.append(runner.forward(kv_caches, input_ids, position_ids, fc).clone())

        # warm-up / first request batch: prefill (eager in both modes), then the decode graphs are captured
        step(model_input(True, sum(prompts, []), [p for n in prompt_lens for p in range(n)], prompt_lens,
                         [slot(r, p) for r, n in enumerate(prompt_lens) for p in range(n)]))
        runner.compile(kv_caches)
        lens = list(prompt_lens)
        for s in range(decode_steps):
            lens = [c + 1 for c in lens]
            step(model_input(False, decode_tokens[s], [c - 1 for c in lens], lens,
                             [slot(r, c - 1) for r, c in enumerate(lens)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
