"""vLLM-Ascend FULL ACL graphs for an M-RoPE (Qwen2.5-VL-style) model: the host-side update of the captured paged-attention tasks' sequence lengths is keyed by ``positions.shape[0]``, which for M-RoPE's [3, num_tokens] positions is 3, not the replayed graph's token count.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/3425 ("[BugFix] Fix multimodal model support fullgraph
error", vllm-project/vllm-ascend, merged 2025-10-14, commit 434059e41). Read: the commit message ("the update_attn_params
function requires passing the num_tokens parameter, and num_tokens is obtained via postions.shape[0]. However, the
multimodal model uses mrope ... which results in the postions having a shape of 2. Consequently, postions.shape[0]
retrieves an incorrect value. We resolve this issue by replacing positions.shape[0] with maybe_padded_num_tokens") and its
full diff (``NPUModelRunner._generate_process_reqs_hidden_states``: ``update_mla_attn_params`` / ``update_attn_params``
now get ``maybe_padded_num_tokens``); the pre-fix ``vllm_ascend/compilation/acl_graph.py`` (``ACLGraphWrapper``,
``update_attn_params`` zipping ``forward_context.attn_metadata`` with ``graph_params.attn_params[runtime_shape]``,
``handles`` and ``events``, re-issuing ``torch_npu._npu_paged_attention`` between ``graph_task_update_begin`` /
``graph_task_update_end`` with the step's ``seq_lens`` and recording the event; ``GraphParams`` / ``set_graph_params``: one
dict entry per ACL graph capture size), the pre-fix ``vllm_ascend/attention/attention_v1.py``
(``AscendAttentionMetadataBuilder.build`` taking ``seq_lens`` from ``seq_lens_cpu``,
``AscendAttentionBackendImpl._forward_decode_only``: under ``forward_context.capturing`` an ``ExternalEvent`` wait, the
params appended to ``graph_params.attn_params[num_tokens]``, the op issued inside ``graph_task_group_begin/end`` and the
handle kept) and the pre-fix ``vllm_ascend/worker/model_runner_v1.py`` (``_prepare_inputs``: ``num_input_tokens =
maybe_padded_num_tokens``, ``_update_input_ids_and_positions`` returning ``self.mrope_positions[:, :num_input_tokens]``,
``execute_model`` dispatching a ``BatchDescriptor(num_tokens=num_input_tokens, uniform_decode=...)``).
Symptom: multimodal M-RoPE models (Qwen2-VL / Qwen2.5-VL) fail as soon as a decode step replays a FULL ACL graph
(FULL_DECODE_ONLY / FULL modes): the update after the replay looks up graph parameters for size 3, which was never
captured (a KeyError, as the graph-params dicts hold one key per capture size; the PR names the failure only as an
error); text-only models, and eager or piecewise graph modes, are unaffected.
Mechanism: a FULL ACL graph bakes the paged-attention op's host-side arguments (``context_lens``) in at capture; every
replay must rewrite them through the task-group handles captured for that graph size, keyed by the graph's token count.
The runner takes that key from ``positions.shape[0]``. For ordinary models positions is [num_input_tokens] and the key
is right; for M-RoPE positions is [3, num_input_tokens], so the key is 3 and the update addresses graph parameters that do
not exist for the replayed size. Eagerly (or without FULL graphs) the op receives the step's ``seq_lens`` directly and
no update is made.
Doctor: padded-shape-mismatch, at _generate_process_reqs_hidden_states. The host-side work run for the replayed graph's
padded size takes that size from the positions tensor, whose leading dimension under M-RoPE is the 3 rope sections
rather than the padded token count, so the shapes disagree and the update addresses a graph size that was never captured.
Fix (upstream): pass ``maybe_padded_num_tokens`` (the token count the graph was dispatched for) to
``update_attn_params`` / ``update_mla_attn_params``.
Modelled: ``NPUModelRunner`` (``_prepare_inputs`` with ``_calc_mrope_positions`` / ``_init_mrope_positions`` and padding to
the ACL graph sizes, ``_update_input_ids_and_positions``, ``execute_model`` with the dispatcher's FULL decode-only choice,
``_generate_process_reqs_hidden_states``, ``capture_model`` through ``_dummy_run``), ``ACLGraphWrapper`` (capture on the
first FULL call of a size, replay afterwards, one global graph pool), ``GraphParams`` / ``set_graph_params`` /
``update_attn_params``, ``AscendAttentionMetadataBuilder.build`` and ``AscendAttentionBackendImpl`` (cache write,
``_forward_decode_only`` with its capture branch). Stand-ins: ``torch_npu._npu_paged_attention`` (paged decode attention
over a block-table KV cache); the NPU task groups (``graph_task_group_begin/end``, ``graph_task_update_begin/end``,
``ExternalEvent``): a captured task reads its ``context_lens`` argument from a slot held outside the graph (allocated with
the graph params, before capture), and an update rewrites that slot. Upstream issues the replay first and the captured
event wait makes the update land before each attention task; the CPU replay is synchronous, so the update is issued just
before the replay. The model: a Qwen2.5-VL-like decoder (2 layers, hidden 12, 2 heads of 6, M-RoPE sections [1, 1, 1],
vocab 16, float64) with image placeholder tokens taking M-RoPE grid positions (the vision tower is left out), greedy
sampling. Block size 4, block 0 reserved as the null block.
Workload: graphs captured for sizes [1, 2, 4]; A (5 text tokens) and B (7 tokens with a 2x2 image) prefill eagerly, then
A and B decode three steps (size-2 graph) and B decodes two more alone (size-1 graph). The bug raises KeyError: 3 at the
first decode step; the fix equals eager on all 6 steps (logits of every sampled token). Had the update silently left the
captured lengths (the dummy batch's length 1), the decode logits would be off by up to 86.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/3425"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "_generate_process_reqs_hidden_states"
SYMPTOM = ("M-RoPE multimodal models with FULL ACL graphs: the per-replay update of the captured attention tasks' "
           "sequence lengths is keyed by positions.shape[0] (3 for M-RoPE) instead of the replayed graph's token count, "
           "and decode fails")

NUM_LAYERS = 2
NUM_HEADS = NUM_KV_HEADS = 2
HEAD_SIZE = 6
HIDDEN = NUM_HEADS * HEAD_SIZE
MROPE_SECTION = [1, 1, 1]                 # rotary frequencies given to the t / h / w positions
VOCAB = 16
IMAGE_TOKEN_ID = VOCAB - 1
SPATIAL_MERGE = 1
BLOCK_SIZE = 4
NUM_BLOCKS = 8                            # block 0: the null block
MAX_BLOCKS_PER_REQ = 3
MAX_NUM_REQS = 4
MAX_NUM_TOKENS = 16
ACLGRAPH_CAPTURE_SIZES = [1, 2, 4]

_variant = "bug"


# --- torch_npu stand-ins: task groups and the paged-attention op ------------------------------------------------------

class ExternalEvent:
    """``torch.npu.ExternalEvent``: orders the host-side task update before the captured task (see the header)."""

    def wait(self, stream):
        pass

    def reset(self, stream):
        pass

    def record(self, stream):
        pass


class _NPUTaskGroupHandle:
    """A captured task group: its op reads ``context_lens`` from an argument slot the runtime keeps outside the graph."""

    def __init__(self, context_lens_slot):
        self.context_lens = context_lens_slot


_task_arg_slots: dict[int, list[torch.Tensor]] = {}   # capture size -> one context_lens slot per layer
_open_group: list = []                                 # [handle] while a task group is being captured
_updating: list = []                                   # [handle] between graph_task_update_begin / _end


def graph_task_group_begin(stream, num_tokens):
    layer = sum(1 for _ in get_graph_params().handles[num_tokens])
    _open_group.append(_NPUTaskGroupHandle(_task_arg_slots[num_tokens][layer]))


def graph_task_group_end(stream):
    return _open_group.pop()


def graph_task_update_begin(stream, handle):
    _updating.append(handle)


def graph_task_update_end(stream):
    _updating.pop()


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out):
    if _updating:                         # re-issued inside graph_task_update_begin/_end: new arguments for the task
        _updating[-1].context_lens.copy_(context_lens.to(_updating[-1].context_lens.device))
        return
    lens = _open_group[-1].context_lens if _open_group else context_lens.to(query.device)
    batch = query.shape[0]
    keys = key_cache[block_table].reshape(batch, -1, num_kv_heads, HEAD_SIZE)   # [B, L, H, D]
    vals = value_cache[block_table].reshape(batch, -1, num_kv_heads, HEAD_SIZE)
    scores = torch.einsum("bhd,blhd->bhl", query, keys) * scale_value
    cols = torch.arange(keys.shape[1], device=query.device)
    scores = scores.masked_fill((cols[None, :] >= lens[:, None])[:, None, :], -1e30)
    out.copy_(torch.einsum("bhl,blhd->bhd", torch.softmax(scores, dim=-1), vals))


# --- vllm_ascend/compilation/acl_graph.py ------------------------------------------------------------------------------

@dataclass
class GraphParams:
    events: dict
    workspaces: dict
    handles: dict
    attn_params: dict


_graph_params: GraphParams | None = None


def set_graph_params(aclgraph_capture_sizes, device):
    global _graph_params
    _graph_params = GraphParams({s: [] for s in aclgraph_capture_sizes}, {s: None for s in aclgraph_capture_sizes},
                                {s: [] for s in aclgraph_capture_sizes}, {s: [] for s in aclgraph_capture_sizes})
    _task_arg_slots.clear()
    for s in aclgraph_capture_sizes:      # the runtime's argument slots, seeded with the dummy batch's lengths
        _task_arg_slots[s] = [torch.ones(s, dtype=torch.int64, device=device) for _ in range(NUM_LAYERS)]


def get_graph_params():
    return _graph_params


def update_attn_params(update_stream, forward_context, runtime_shape):
    graph_params = get_graph_params()
    for key, param, handle, event in zip(
            forward_context.attn_metadata,
            graph_params.attn_params[runtime_shape],
            graph_params.handles[runtime_shape],
            graph_params.events[runtime_shape],
    ):
        (query, key_cache, value_cache, num_kv_heads, num_heads, scale, block_table, seq_lens, output) = param
        seq_lens = forward_context.attn_metadata[key].seq_lens
        graph_task_update_begin(update_stream, handle)
        _npu_paged_attention(query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
                             num_heads=num_heads, scale_value=scale, block_table=block_table, context_lens=seq_lens,
                             out=output)
        graph_task_update_end(update_stream)
        event.record(update_stream)


class ACLGraphWrapper:
    """FULL mode: capture on the first call of a batch descriptor, replay afterwards (one global graph pool)."""

    def __init__(self, runnable, device):
        self.runnable = runnable
        self.device = device
        self.graph_pool = graph_pool_handle(device)
        self.concrete_aclgraph_entries = {}
        self.static = {}
        self.state = {}

    def __call__(self, input_ids, positions):
        forward_context = get_forward_context()
        if forward_context.cudagraph_runtime_mode != "FULL":
            return self.runnable(input_ids, positions)
        num_tokens = forward_context.batch_descriptor
        entry = self.concrete_aclgraph_entries.get(num_tokens)
        if entry is None:
            def step():
                forward_context = get_forward_context()
                forward_context.capturing = torch.cuda.is_current_stream_capturing()
                try:
                    return self.runnable(input_ids, positions)
                finally:
                    forward_context.capturing = False
            entry = capture(step, device=self.device, pool=self.graph_pool, name=f"FULL decode [{num_tokens}]",
                            owner="NPUModelRunner", static=self.static, state=self.state)
            self.concrete_aclgraph_entries[num_tokens] = entry
            return entry[1]
        g, out = entry
        return replay(g, out, real=forward_context.num_actual_tokens, size=num_tokens)


# --- forward context ---------------------------------------------------------------------------------------------------

@dataclass
class ForwardContext:
    attn_metadata: dict
    cudagraph_runtime_mode: str
    batch_descriptor: int | None
    num_actual_tokens: int
    capturing: bool = False


_forward_context: list = []


@contextlib.contextmanager
def set_ascend_forward_context(attn_metadata, aclgraph_runtime_mode, batch_descriptor, num_actual_tokens):
    _forward_context.append(ForwardContext(attn_metadata, aclgraph_runtime_mode, batch_descriptor, num_actual_tokens))
    try:
        yield
    finally:
        _forward_context.pop()


def get_forward_context():
    return _forward_context[-1]


# --- vllm_ascend/attention/attention_v1.py ----------------------------------------------------------------------------

@dataclass
class AscendMetadata:
    num_actual_tokens: int
    block_tables: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor                # host (seq_lens_cpu[:num_reqs])
    slot_mapping: torch.Tensor
    attn_state: str


class AscendAttentionMetadataBuilder:
    def build(self, common):
        num_reqs = common["num_reqs"]
        return AscendMetadata(num_actual_tokens=common["num_actual_tokens"],
                              block_tables=common["block_table_tensor"][:num_reqs],
                              query_start_loc_cpu=common["query_start_loc_cpu"][:num_reqs + 1],
                              seq_lens=common["seq_lens_cpu"][:num_reqs],
                              slot_mapping=common["slot_mapping"][:common["num_actual_tokens"]],
                              attn_state=common["attn_state"])


class AscendAttentionBackendImpl:
    def __init__(self, layer_name, key_cache, value_cache):
        self.layer_name = layer_name
        self.key_cache, self.value_cache = key_cache, value_cache
        self.num_heads, self.num_kv_heads = NUM_HEADS, NUM_KV_HEADS
        self.scale = HEAD_SIZE ** -0.5

    def _reshape_and_cache(self, key, value, slot_mapping):
        valid = (slot_mapping >= 0)[:, None, None]
        idx = slot_mapping.clamp(min=0)
        for cache, new in ((self.key_cache, key), (self.value_cache, value)):
            flat = cache.view(-1, self.num_kv_heads, HEAD_SIZE)
            flat[idx] = torch.where(valid, new, flat[idx])

    def _forward_prefill(self, query, key, value, attn_metadata, output):
        starts = attn_metadata.query_start_loc_cpu.tolist()
        for s, e in itertools.pairwise(starts):
            q, k, v = query[s:e], key[s:e], value[s:e]
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            causal = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(causal, -1e30)
            output[s:e] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        return output

    def _forward_decode_only(self, query, attn_metadata, output):
        graph_params = get_graph_params()
        forward_context = get_forward_context()
        num_tokens = query.shape[0]
        if forward_context.capturing:
            stream = None
            event = ExternalEvent()
            event.wait(stream)
            event.reset(stream)
            graph_params.events[num_tokens].append(event)
            graph_params.attn_params[num_tokens].append((
                query, self.key_cache, self.value_cache, self.num_kv_heads, self.num_heads, self.scale,
                attn_metadata.block_tables, attn_metadata.seq_lens, output))
            graph_task_group_begin(stream, num_tokens)
            _npu_paged_attention(query=query, key_cache=self.key_cache, value_cache=self.value_cache,
                                 num_kv_heads=self.num_kv_heads, num_heads=self.num_heads, scale_value=self.scale,
                                 block_table=attn_metadata.block_tables, context_lens=attn_metadata.seq_lens,
                                 out=output)
            handle = graph_task_group_end(stream)
            graph_params.handles[num_tokens].append(handle)
        else:
            _npu_paged_attention(query=query, key_cache=self.key_cache, value_cache=self.value_cache,
                                 num_kv_heads=self.num_kv_heads, num_heads=self.num_heads, scale_value=self.scale,
                                 block_table=attn_metadata.block_tables, context_lens=attn_metadata.seq_lens,
                                 out=output)
        return output

    def forward(self, query, key, value, output):
        attn_metadata = get_forward_context().attn_metadata[self.layer_name]
        self._reshape_and_cache(key, value, attn_metadata.slot_mapping)
        if attn_metadata.attn_state == "DecodeOnly":
            return self._forward_decode_only(query, attn_metadata, output)
        return self._forward_prefill(query, key, value, attn_metadata, output)


# --- the model (Qwen2.5-VL-like decoder with M-RoPE) --------------------------------------------------------------------

def mrope_cos_sin(positions, inv_freq, section_of):
    """positions [3, T]: frequency i takes the t, h or w position of its M-RoPE section (``section_of[i]``)."""
    pos = positions[section_of].transpose(0, 1).to(inv_freq.dtype)       # [T, HEAD_SIZE // 2]
    freqs = pos * inv_freq
    return torch.cos(freqs)[:, None, :], torch.sin(freqs)[:, None, :]


def apply_rotary(x, cos, sin):
    x1, x2 = x[..., :HEAD_SIZE // 2], x[..., HEAD_SIZE // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Qwen2_5_VLForConditionalGeneration:
    def __init__(self, device):
        gen = generator(3425)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).double()
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.inv_freq = 1.0 / (10.0 ** (torch.arange(HEAD_SIZE // 2, dtype=torch.float64) / (HEAD_SIZE // 2)))
        self.inv_freq = self.inv_freq.to(device)
        self.mrope_section_of = torch.repeat_interleave(torch.arange(3), torch.tensor(MROPE_SECTION)).to(device)
        self.layers = []
        self.kv_caches = []
        for i in range(NUM_LAYERS):
            kv = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float64, device=device)
            self.kv_caches.append(kv)
            impl = AscendAttentionBackendImpl(f"model.layers.{i}.self_attn.attn", kv[0], kv[1])
            self.layers.append({"wq": r(HIDDEN, HIDDEN), "wk": r(HIDDEN, HIDDEN), "wv": r(HIDDEN, HIDDEN),
                                "wo": r(HIDDEN, HIDDEN), "w1": r(HIDDEN, HIDDEN), "w2": r(HIDDEN, HIDDEN), "impl": impl})
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)

    def __call__(self, input_ids, positions):
        hidden = self.embed_tokens[input_ids]
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.mrope_section_of)
        n = hidden.shape[0]
        for layer in self.layers:
            q = apply_rotary((hidden @ layer["wq"]).view(n, NUM_HEADS, HEAD_SIZE), cos, sin)
            k = apply_rotary((hidden @ layer["wk"]).view(n, NUM_KV_HEADS, HEAD_SIZE), cos, sin)
            v = (hidden @ layer["wv"]).view(n, NUM_KV_HEADS, HEAD_SIZE)
            output = torch.empty_like(q)
            output = layer["impl"].forward(q, k, v, output)
            hidden = hidden + output.reshape(n, HIDDEN) @ layer["wo"]
            hidden = hidden + torch.tanh(hidden @ layer["w1"]) @ layer["w2"]
        return hidden

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm_ascend/worker/model_runner_v1.py -----------------------------------------------------------------------------

class CachedRequestState:
    def __init__(self, req_id, prompt_token_ids, image_grid, block_ids):
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.image_grid = image_grid              # (start, h, w) of the image's placeholder tokens, or None
        self.block_ids = block_ids
        self.output_token_ids = []
        self.num_computed_tokens = 0
        self.mrope_positions = None
        self.mrope_position_delta = None


class NPUModelRunner:
    def __init__(self, device, use_aclgraph):
        self.device = device
        self.use_aclgraph = use_aclgraph
        self.model = Qwen2_5_VLForConditionalGeneration(device)
        self.aclgraph_batch_sizes = sorted(ACLGRAPH_CAPTURE_SIZES)
        self.update_stream = None
        self.requests = {}
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.mrope_positions = torch.zeros(3, MAX_NUM_TOKENS + 1, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int64, device=device)
        self.seq_lens_cpu = torch.zeros(MAX_NUM_REQS, dtype=torch.int64)
        self.attn_metadata_builder = AscendAttentionMetadataBuilder()
        self.model_fn = self.model
        if use_aclgraph:
            set_graph_params(self.aclgraph_batch_sizes, device)
            self.model_fn = ACLGraphWrapper(self.model, device)
            self.model_fn.static = {"input_ids": self.input_ids, "mrope_positions": self.mrope_positions,
                                    "slot_mapping": self.slot_mapping, "block_table": self.block_table}
            for s, slots in _task_arg_slots.items():
                self.model_fn.static.update({f"context_lens[{s}][{i}]": t for i, t in enumerate(slots)})
            self.model_fn.state = {f"kv_cache[{i}]": kv for i, kv in enumerate(self.model.kv_caches)}
            self.capture_model()

    # -- M-RoPE positions --------------------------------------------------------------------------------------------
    def _init_mrope_positions(self, req):
        n = len(req.prompt_token_ids)
        pos = torch.arange(n, dtype=torch.int64).repeat(3, 1)
        if req.image_grid is not None:
            start, h, w = req.image_grid
            grid = torch.arange(h * w)
            pos[0, start:start + h * w] = start
            pos[1, start:start + h * w] = start + grid // w
            pos[2, start:start + h * w] = start + grid % w
            text_start = start + h * w
            pos[:, text_start:] = start + max(h, w) + torch.arange(n - text_start)
        req.mrope_positions = pos
        req.mrope_position_delta = int(pos.max()) + 1 - n

    def _calc_mrope_positions(self, scheduled, total):
        out = torch.zeros(3, total, dtype=torch.int64)
        cursor = 0
        for req, num in scheduled:
            if req.num_computed_tokens < len(req.prompt_token_ids):
                out[:, cursor:cursor + num] = req.mrope_positions[:, req.num_computed_tokens:req.num_computed_tokens + num]
            else:
                out[:, cursor:cursor + num] = req.num_computed_tokens + req.mrope_position_delta
            cursor += num
        return out

    # -- inputs -----------------------------------------------------------------------------------------------------------
    def _update_input_ids_and_positions(self, input_ids, positions, num_input_tokens, with_prefill,
                                        maybe_padded_num_tokens):
        positions = self.mrope_positions[:, :num_input_tokens]
        return input_ids, positions

    def _prepare_inputs(self, scheduled):
        num_reqs = len(scheduled)
        total = sum(num for _, num in scheduled)
        if self.use_aclgraph and total <= self.aclgraph_batch_sizes[-1]:
            num_input_tokens = next(s for s in self.aclgraph_batch_sizes if s >= total)   # pad_for_cudagraph
        else:
            num_input_tokens = total
        attn_state = "DecodeOnly" if all(num == 1 for _, num in scheduled) else "PrefillNoCache"
        with_prefill = attn_state != "DecodeOnly"
        maybe_padded_num_tokens = num_input_tokens
        num_input_tokens = maybe_padded_num_tokens

        token_ids, slots, cu = [], [], [0]
        for i, (req, num) in enumerate(scheduled):
            all_ids = req.prompt_token_ids + req.output_token_ids
            for p in range(req.num_computed_tokens, req.num_computed_tokens + num):
                token_ids.append(all_ids[p])
                slots.append(req.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            cu.append(cu[-1] + num)
            self.seq_lens_cpu[i] = req.num_computed_tokens + num
            row = torch.zeros(MAX_BLOCKS_PER_REQ, dtype=torch.int64)
            row[:len(req.block_ids)] = torch.tensor(req.block_ids)
            self.block_table[i].copy_(row.to(self.device))
        self.input_ids[:total].copy_(torch.tensor(token_ids).to(self.device))
        self.slot_mapping[:total].copy_(torch.tensor(slots).to(self.device))
        self.slot_mapping[total:num_input_tokens].fill_(-1)
        self.mrope_positions[:, :total].copy_(self._calc_mrope_positions(scheduled, total).to(self.device))
        common = {"num_reqs": num_reqs, "num_actual_tokens": total, "block_table_tensor": self.block_table,
                  "query_start_loc_cpu": torch.tensor(cu), "seq_lens_cpu": self.seq_lens_cpu,
                  "slot_mapping": self.slot_mapping, "attn_state": attn_state}
        attn_metadata_i = self.attn_metadata_builder.build(common)
        attn_metadata = {layer["impl"].layer_name: attn_metadata_i for layer in self.model.layers}
        input_ids, positions = self._update_input_ids_and_positions(
            self.input_ids[:num_input_tokens], None, num_input_tokens, with_prefill, maybe_padded_num_tokens)
        logits_indices = torch.tensor(cu[1:]) - 1
        return (attn_metadata, positions, num_input_tokens, maybe_padded_num_tokens, logits_indices, input_ids,
                with_prefill, total)

    # -- forward ----------------------------------------------------------------------------------------------------------
    def _generate_process_reqs_hidden_states(self, attn_metadata, with_prefill, maybe_padded_num_tokens, input_ids,
                                             positions):
        forward_context = get_forward_context()
        if forward_context.cudagraph_runtime_mode == "FULL":
            runtime_shape = positions.shape[0] if _variant == "bug" else maybe_padded_num_tokens
            update_attn_params(self.update_stream, forward_context, runtime_shape)
        return self.model_fn(input_ids, positions)

    def _dispatch(self, num_input_tokens, uniform_decode):
        if self.use_aclgraph and uniform_decode and num_input_tokens in self.aclgraph_batch_sizes:
            return "FULL", num_input_tokens                 # FULL_DECODE_ONLY
        return "NONE", None

    def execute_model(self, scheduled):
        (attn_metadata, positions, num_input_tokens, maybe_padded_num_tokens, logits_indices, input_ids,
         with_prefill, total) = self._prepare_inputs(scheduled)
        mode, batch_descriptor = self._dispatch(num_input_tokens, uniform_decode=not with_prefill)
        with set_ascend_forward_context(attn_metadata, mode, batch_descriptor, total):
            hidden_states = self._generate_process_reqs_hidden_states(
                attn_metadata, with_prefill, maybe_padded_num_tokens, input_ids, positions)
        return self.model.compute_logits(hidden_states[logits_indices.to(self.device)])

    def _dummy_run(self, num_tokens):
        self.slot_mapping[:num_tokens].fill_(-1)
        self.block_table[:num_tokens].zero_()
        dummy = {"num_reqs": num_tokens, "num_actual_tokens": num_tokens, "block_table_tensor": self.block_table,
                 "query_start_loc_cpu": torch.arange(num_tokens + 1), "seq_lens_cpu": torch.ones(num_tokens, dtype=torch.int64),
                 "slot_mapping": self.slot_mapping, "attn_state": "DecodeOnly"}
        attn_metadata_i = self.attn_metadata_builder.build(dummy)
        attn_metadata = {layer["impl"].layer_name: attn_metadata_i for layer in self.model.layers}
        with set_ascend_forward_context(attn_metadata, "FULL", num_tokens, num_tokens):
            self.model_fn(self.input_ids[:num_tokens], self.mrope_positions[:, :num_tokens])

    def capture_model(self):
        for num_tokens in sorted(self.aclgraph_batch_sizes, reverse=True):
            self._dummy_run(num_tokens)


# --- workload ----------------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    I = IMAGE_TOKEN_ID

    def serve(use_aclgraph):
        runner = NPUModelRunner(device, use_aclgraph)
        reqs = [CachedRequestState("A", [3, 7, 1, 9, 4], None, [1, 2, 3]),
                CachedRequestState("B", [2, I, I, I, I, 6, 5], (1, 2, 2), [4, 5, 6])]
        for req in reqs:
            runner._init_mrope_positions(req)
        schedule = [[(reqs[0], 5), (reqs[1], 7)]] + [[(reqs[0], 1), (reqs[1], 1)]] * 3 + [[(reqs[1], 1)]] * 2
        outs = []
        for scheduled in schedule:
            logits = runner.execute_model(scheduled)
            outs.append(logits.clone())
            for (req, num), row in zip(scheduled, logits.argmax(-1).tolist()):
                req.num_computed_tokens += num
                req.output_token_ids.append(int(row))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
