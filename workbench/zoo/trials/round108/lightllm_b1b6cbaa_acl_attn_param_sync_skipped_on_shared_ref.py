"""LightLLM on Ascend (ACL graphs): before a decode replay, the KV lengths baked into the graph's fused-attention tasks
are refreshed only when they differ from one host reference buffer; that reference is shared by every graph size while
the tasks are per size, so when the batch shrinks to a smaller graph whose rows carry the lengths the larger graph was
just updated with, the refresh is skipped and the smaller graph attends with stale lengths.

Upstream: https://github.com/ModelTC/LightLLM/commit/b1b6cbaa76d13a47f8a2c3c1daeb5ef56ac73977 ("Fix Ascend decode
hang: always sync ACL attn params before graph replay.", ModelTC/LightLLM, branch neo_npu, by zhangtaoshan, committed
2026-08-02; a direct commit, no pull request).
Read: the diff and, at its parent 73e03d7c3: ``paged_fa3/graph_utils.py`` (``new_seq_len_ref_buffers``,
``maybe_sync_attn_params`` with its ``torch.equal`` early return, ``update_attn_params``: a ``graph_task_update`` of
each captured FIA task of the batch size), ``graph/acl_graph.py`` (``AclGraph._replay`` then
``_prefetch_next_attn_params`` with ``b_cu_kv_seq_len_cpu.add_(1)`` on the reference slice itself; ``AclGraphParams``
keyed by batch size), ``graph/base/decode_graph.py``, ``basemodel.py`` (``_decode``,
``_create_padded_decode_model_input``), ``infer_struct.py`` (``SeqLenManager``, ``copy_for_cuda_graph``) and
``paged_fa3/fp.py`` (under capture the FIA call is recorded with the capture-time ``actual_seq_lengths_kv``).
Symptom: Ascend decode with ACL graphs hangs or goes wrong once the running batch shrinks; eager decode is fine.
Mechanism: the FIA kernel's ``actual_seq_lengths_kv`` are host arguments baked into each captured task; only
``update_attn_params`` changes them, per batch size. ``maybe_sync_attn_params`` skips that update when the step's KV
lengths equal ``b_cu_kv_seq_len_cpu_ref[:batch_size]``, one buffer for all graph sizes, which the prefetch after each
replay advances by one for the graph just replayed. After steps on the size-4 graph, a step of its first two requests
on the size-2 graph finds its lengths equal to the reference and skips the update: the size-2 tasks still hold the
lengths they were captured with (the warmup's ``graph_max_len_in_batch``), so the attention reads past each sequence.
Doctor: stale-input, at maybe_sync_attn_params. The graph's attention reads its task parameters, a static input that
only the refresh writes; ``maybe_sync_attn_params`` concludes from a reference another graph's update left behind that
this step need not write them, so the replay uses what capture left there.
Fix (upstream): ``sync_attn_params`` (renamed) always copies the step's lengths and updates the tasks before a replay
(the update stream waiting for the compute stream); ``AclGraph._replay`` drops the post-replay prefetch and makes the
compute stream wait for the update stream; the microbatch-overlap decode path gains the same sync.
Modelled as read: the functions and classes named above (``DecodeGraph`` sizes 1, 2, 4 from ``graph_split_batch_size``
2, one warmup before capture, ``warmup`` with HOLD rows at the maximal length). Stand-ins: a captured task's host
arguments are a pinned host block (its handle), written once at capture and copied by the graph at every replay;
``graph_task_update`` writes the block; the update stream and events are host order (a synchronize where the update
stream waits); a 2-layer decoder (RMSNorm, qkv, KV written at ``mem_index``, paged decode attention with page size 1
over ``req_to_token_indexs`` limited by ``actual_seq_lengths_kv``, gated MLP); eager causal prefill; tokens fixed in
advance (no sampler); float64. The microbatch-overlap path is not modelled.
Workload: requests A, B, C, D (prompts 5, 6, 3, 7) prefilled eagerly; decode [A,B,C,D] twice (size-4 graph), [A,B,C]
(padded to 4), [A,B] twice (size 2), [A] (size 1). Bug: the first [A,B] step and the [A] step skip the refresh (their
lengths equal the reference the prefetch left) and replay with the warmup's length 16 per row, attending to the HOLD
slot past each sequence: max |graph - eager| = 1.51 and 1.82 on their logits; the second [A,B] step (its tasks
prefetched right) is off by 0.23 through the layer-2 KV the first one wrote; overall 1.82. Fix: every step's logits
equal eager (max error 1.3e-15).
"""
from __future__ import annotations

import bisect
import copy
import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle, host, is_capturing, is_host, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ModelTC/LightLLM/commit/b1b6cbaa76d13a47f8a2c3c1daeb5ef56ac73977"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "maybe_sync_attn_params"
SYMPTOM = ("Ascend ACL-graph decode goes wrong once the batch shrinks to a smaller graph: the attention-parameter "
           "refresh is skipped because a reference buffer shared by all graph sizes holds the step's KV lengths")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS = 32, 16, 2, 8, 24, 2
MAX_REQS, TOKEN_SLOTS, DTYPE, I32 = 8, 96, torch.float64, torch.int32
GRAPH_MAX_BATCH, GRAPH_MAX_LEN, GRAPH_SPLIT_BATCH_SIZE, GRAPH_GROW_STEP_SIZE, MTP_STEP = 4, 16, 2, 2, 0
SEQ_LEN_REF_UNINITIALIZED = -1

_variant = "bug"


# --- lightllm/common/basemodel/attention/paged_fa3/graph_utils.py ----------------------------------------------------

def new_seq_len_ref_buffers(max_batch_size, device):
    return tuple(host(torch.full((max_batch_size,), SEQ_LEN_REF_UNINITIALIZED, dtype=I32), device) for _ in range(2))


def maybe_sync_attn_params(*, batch_size, b1_cu_q_seq_len_cpu_slice, b_cu_kv_seq_len_cpu_slice, b1_cu_q_seq_len_cpu,
                           b_cu_kv_seq_len_cpu, update_stream):
    if batch_size == 0:
        return
    if _variant == "bug" and torch.equal(b_cu_kv_seq_len_cpu_slice, b_cu_kv_seq_len_cpu):
        return
    b1_cu_q_seq_len_cpu_slice.copy_(b1_cu_q_seq_len_cpu)
    b_cu_kv_seq_len_cpu_slice.copy_(b_cu_kv_seq_len_cpu)
    if _variant == "fix":
        synchronize(update_stream)                    # update_stream.wait_stream(torch.npu.current_stream())
    update_attn_params(batch_size, b1_cu_q_seq_len_cpu_slice, b_cu_kv_seq_len_cpu_slice, update_stream)


def update_attn_params(batch_size, actual_seq_lengths, actual_seq_lengths_kv, update_stream):
    for handle in get_attn_params().handles[batch_size]:
        # graph_task_update_begin(update_stream, handle); npu_fused_infer_attention_score.out(...,
        # actual_seq_lengths_kv=...); graph_task_update_end(update_stream): the task's host arguments are re-recorded
        handle.copy_(actual_seq_lengths_kv)


# --- lightllm/common/basemodel/graph/acl_graph.py --------------------------------------------------------------------

@dataclasses.dataclass
class AclGraphParams:
    handles: dict
    attn_params: dict
    task_blocks: dict            # stand-in: the captured tasks' host parameter blocks, per batch size and layer


ATTN_PARAMS = None


def init_attn_params(batch_sizes, device):
    global ATTN_PARAMS
    ATTN_PARAMS = AclGraphParams(
        handles={bs: [] for bs in batch_sizes}, attn_params={bs: [] for bs in batch_sizes},
        task_blocks={bs: [host(torch.zeros(bs, dtype=I32), device) for _ in range(N_LAYERS)] for bs in batch_sizes})


def get_attn_params():
    return ATTN_PARAMS


def add_attn_params(batch_size, handle, attn_params):
    ATTN_PARAMS.handles[batch_size].append(handle)
    ATTN_PARAMS.attn_params[batch_size].append(attn_params)


# --- lightllm/common/basemodel/graph/base/decode_graph.py (DecodeGraph) + acl_graph.py (AclGraph) --------------------

class AclGraph:
    def __init__(self, max_batch_size, max_len_in_batch, device):
        self.graph, self.device = {}, device
        self.max_batch_size, self.graph_max_len_in_batch = max_batch_size, max_len_in_batch
        self.mempool = graph_pool_handle(device)
        graph_split_batch_size = GRAPH_SPLIT_BATCH_SIZE * (MTP_STEP + 1)
        graph_grow_step_size = GRAPH_GROW_STEP_SIZE * (MTP_STEP + 1)
        batch_sizes = [i * (MTP_STEP + 1) for i in range(1, graph_split_batch_size + 1)]
        batch_sizes += list(range(graph_split_batch_size + graph_grow_step_size, max_batch_size, graph_grow_step_size))
        self.graph_batch_sizes = sorted(set(e for e in batch_sizes if e < max_batch_size)) + [max_batch_size]
        init_attn_params(self.graph_batch_sizes, device)              # _init_decode_graph_extra
        self.update_stream = device                                    # torch.npu.Stream(): host order here

    def can_run(self, batch_size, max_len_in_batch):
        return batch_size <= self.max_batch_size and max_len_in_batch <= self.graph_max_len_in_batch

    def need_capture(self, batch_size):
        return self.find_closest_graph_batch_size(batch_size) not in self.graph

    def find_closest_graph_batch_size(self, batch_size):
        index = bisect.bisect_left(self.graph_batch_sizes, batch_size)
        return self.graph_batch_sizes[index] if index < len(self.graph_batch_sizes) else None

    def capture_decode(self, decode_func, infer_state):                # DecodeGraph._capture_decode
        batch_size = infer_state.input_ids.shape[0]
        infer_state.max_kv_seq_len = self.graph_max_len_in_batch
        static = {f"infer_state.{k}": v for k, v in vars(infer_state).items()
                  if isinstance(v, torch.Tensor) and not is_host(v) and v.device.type == torch.device(self.device).type}
        static["decode_att_state.page_table"] = infer_state.decode_att_state.page_table
        static.update({f"task[{batch_size}][{i}]": b for i, b in enumerate(get_attn_params().task_blocks[batch_size])})
        graph_obj, model_output = capture(lambda: decode_func(infer_state), device=self.device, pool=self.mempool,
                                          warmups=1, static=static, owner="AclGraph", name=f"decode bs {batch_size}")
        self.graph[batch_size] = (graph_obj, infer_state, model_output)
        return model_output

    def _base_replay(self, infer_state):                               # DecodeGraph._replay
        batch_size = infer_state.input_ids.shape[0]
        graph_obj, graph_infer_state, graph_output = self.graph[batch_size]
        graph_infer_state.copy_for_cuda_graph(infer_state)
        return ModelOutput(replay(graph_obj, graph_output.logits, real=infer_state.real_batch_size, size=batch_size))

    def _prefetch_next_attn_params(self, batch_size, b1_cu_q_seq_len_cpu, b_cu_kv_seq_len_cpu):
        synchronize(self.update_stream)                                # self.update_stream.wait_stream(compute_stream)
        update_attn_params(batch_size, b1_cu_q_seq_len_cpu, b_cu_kv_seq_len_cpu.add_(1), self.update_stream)

    def replay(self, infer_state, b1_cu_q_seq_len_cpu, b_cu_kv_seq_len_cpu):  # AclGraph._replay
        if _variant == "fix":
            # torch.npu.current_stream().wait_stream(self.update_stream): the updates ran before, in host order
            return self._base_replay(infer_state)
        graph_output = self._base_replay(infer_state)
        self._prefetch_next_attn_params(infer_state.input_ids.shape[0], b1_cu_q_seq_len_cpu, b_cu_kv_seq_len_cpu)
        return graph_output

    def warmup(self, model):
        for batch_size in self.graph_batch_sizes[::-1]:
            full = lambda value, dtype: torch.full((batch_size,), value, dtype=dtype, device=self.device)  # noqa: E731
            mem_indexes = model.mem_manager.alloc(batch_size)
            model._decode(ModelInput(batch_size, self.graph_max_len_in_batch, full(1, torch.int64),
                                     full(model.req_manager.HOLD_REQUEST_ID, torch.int64),
                                     full(self.graph_max_len_in_batch, I32), mem_indexes))
            model.mem_manager.free(mem_indexes)


# --- lightllm/common/basemodel/infer_struct.py, batch_objs.py, attention/paged_fa3 ------------------------------------

@dataclasses.dataclass
class ModelInput:
    batch_size: int
    max_kv_seq_len: int
    input_ids: torch.Tensor
    b_req_idx: torch.Tensor
    b_seq_len: torch.Tensor
    mem_indexes: torch.Tensor


@dataclasses.dataclass
class ModelOutput:
    logits: torch.Tensor


class SeqLenManager:
    def __init__(self, max_batch, device):
        self.b1_cu_q_seq_len_cpu = host(torch.empty(max_batch, dtype=I32), device)
        self.b_cu_kv_seq_len_cpu = host(torch.empty(max_batch, dtype=I32), device)

    def update(self, b1_cu_q_seq_len, b_cu_kv_seq_len):
        self.n_q, self.n_kv = b1_cu_q_seq_len.numel() - 1, b_cu_kv_seq_len.numel()
        self.b1_cu_q_seq_len_cpu[:self.n_q].copy_(b1_cu_q_seq_len[1:])
        self.b_cu_kv_seq_len_cpu[:self.n_kv].copy_(b_cu_kv_seq_len)

    def get_tensor_slices(self):
        return self.b1_cu_q_seq_len_cpu[:self.n_q], self.b_cu_kv_seq_len_cpu[:self.n_kv]


def gen_decode_params(b_seq_len):
    b_q_seq_len = torch.ones_like(b_seq_len)
    return b_q_seq_len, F.pad(torch.cumsum(b_q_seq_len, 0), (1, 0)).to(I32), b_seq_len.clone()


class DecodeAttState:
    def __init__(self, infer_state, req_manager):
        self.infer_state, self.req_manager = infer_state, req_manager

    def init_state(self):
        self.page_table = self.req_manager.req_to_token_indexs[self.infer_state.b_req_idx.long(), :GRAPH_MAX_LEN]

    def copy_for_decode_cuda_graph(self, new_state):
        self.page_table.copy_(new_state.page_table)


class InferStateInfo:
    def __init__(self, model_input, model, real_batch_size):
        self.batch_size, self.max_kv_seq_len = model_input.batch_size, model_input.max_kv_seq_len
        self.input_ids, self.b_req_idx = model_input.input_ids, model_input.b_req_idx
        self.b_seq_len, self.mem_index = model_input.b_seq_len, model_input.mem_indexes
        self.seq_len_manager, self.real_batch_size = model.seq_len_manager, real_batch_size
        self.decode_att_state = DecodeAttState(self, model.req_manager)

    def init_some_extra_state(self, model):
        self.b_q_seq_len, self.b1_cu_q_seq_len, self.b_kv_seq_len = gen_decode_params(self.b_seq_len)
        self.seq_len_manager.update(self.b1_cu_q_seq_len, self.b_kv_seq_len)    # platform_backend.name == "ascend"
        self.b1_cu_q_seq_len_cpu, self.b_cu_kv_seq_len_cpu = self.seq_len_manager.get_tensor_slices()

    def init_att_state(self):
        self.decode_att_state.init_state()

    def copy_for_cuda_graph(self, new_infer_state):
        for attr_name, attr_value in vars(new_infer_state).items():
            if isinstance(attr_value, torch.Tensor):
                attr_ = getattr(self, attr_name, None)
                if attr_ is not None and attr_.data_ptr() != attr_value.data_ptr():
                    attr_.copy_(attr_value)
        self.decode_att_state.copy_for_decode_cuda_graph(new_infer_state.decode_att_state)


def npu_fused_infer_attention_score(q, k_cache, v_cache, actual_seq_lengths_kv, block_table):
    """Paged decode attention, page size 1: each row attends to its first ``actual_seq_lengths_kv`` tokens."""
    slots = block_table.long()
    k, v = k_cache[slots], v_cache[slots]                                 # [bs, L, H, D]
    scores = torch.einsum("bhd,blhd->bhl", q, k) / HEAD_DIM ** 0.5
    masked = torch.arange(slots.shape[1], device=q.device)[None, :] >= actual_seq_lengths_kv.long()[:, None]
    return torch.einsum("bhl,blhd->bhd", scores.masked_fill(masked[:, None, :], float("-inf")).softmax(-1), v)


def paged_fa3_decode_att(q, k_cache, v_cache, infer_state):
    page_table = infer_state.decode_att_state.page_table
    if is_capturing():
        batch_size, attn_params = infer_state.batch_size, get_attn_params()
        # graph_task_group_begin / npu_fused_infer_attention_score.out / graph_task_group_end: the task is recorded
        # with the capture-time host arguments (host work, done once at capture) and reads them at every replay
        handle = attn_params.task_blocks[batch_size][len(attn_params.handles[batch_size])]
        handle.copy_(infer_state.b_cu_kv_seq_len_cpu)
        actual_seq_lengths_kv = torch.empty(batch_size, dtype=I32, device=q.device)
        actual_seq_lengths_kv.copy_(handle, non_blocking=True)
        add_attn_params(batch_size, handle, (q, k_cache, v_cache, page_table))
    else:
        actual_seq_lengths_kv = infer_state.b_cu_kv_seq_len_cpu.to(q.device)
    return npu_fused_infer_attention_score(q, k_cache, v_cache, actual_seq_lengths_kv, page_table)


# --- the model (stand-in for a Llama-style TpPartBaseModel) and its managers ------------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class MemoryManager:
    HOLD_TOKEN_MEMINDEX = 0

    def __init__(self, device):
        cache = lambda: torch.zeros(TOKEN_SLOTS, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)   # noqa: E731
        self.k_cache, self.v_cache = [cache() for _ in range(N_LAYERS)], [cache() for _ in range(N_LAYERS)]
        self.device, self._free = device, list(range(1, TOKEN_SLOTS))

    def alloc(self, n):
        idx, self._free = self._free[:n], self._free[n:]
        return torch.tensor(idx, dtype=torch.int64).to(self.device)

    def free(self, idx):
        self._free = sorted(self._free + idx.cpu().tolist())


class ReqManager:
    HOLD_REQUEST_ID = MAX_REQS

    def __init__(self, device):
        self.req_to_token_indexs = torch.zeros(MAX_REQS + 1, GRAPH_MAX_LEN, dtype=torch.int64, device=device)


def copy_kv_index_to_req(req_to_token_indexs, b_req_idx, b_seq_len, mem_index):
    req_to_token_indexs[b_req_idx.long(), b_seq_len.long() - 1] = mem_index


class TpPartBaseModel:
    def __init__(self, device, disable_cudagraph):
        gen = generator(0xB1B6)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.layers = [dict(qkv=r(3 * HIDDEN, HIDDEN), o=r(HIDDEN, HIDDEN), gate_up=r(2 * INTER, HIDDEN),
                            down=r(HIDDEN, INTER), in_norm=1.0 + r(HIDDEN, scale=0.1),
                            post_norm=1.0 + r(HIDDEN, scale=0.1)) for _ in range(N_LAYERS)]
        self.norm, self.lm_head = 1.0 + r(HIDDEN, scale=0.1), r(VOCAB, HIDDEN)
        self.device, self.graph = device, None
        self.mem_manager, self.req_manager = MemoryManager(device), ReqManager(device)
        self.seq_len_manager = SeqLenManager(GRAPH_MAX_BATCH, device)
        if not disable_cudagraph:
            refs = new_seq_len_ref_buffers(GRAPH_MAX_BATCH, device)
            self.b1_cu_q_seq_len_cpu_ref, self.b_cu_kv_seq_len_cpu_ref = refs
            self.graph = AclGraph(GRAPH_MAX_BATCH, GRAPH_MAX_LEN, device)          # _init_cudagraph
            self.graph.warmup(self)

    def _layer(self, h, i, attend):
        w, mm = self.layers[i], self.mem_manager
        q, k, v = F.linear(rms_norm(h, w["in_norm"]), w["qkv"]).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        h = h + F.linear(attend(q, k, v, mm.k_cache[i], mm.v_cache[i]).reshape(-1, HIDDEN), w["o"])
        gate, up = F.linear(rms_norm(h, w["post_norm"]), w["gate_up"]).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w["down"])

    def _token_forward(self, infer_state):
        def attend(q, k, v, k_cache, v_cache):
            k_cache.index_copy_(0, infer_state.mem_index, k)
            v_cache.index_copy_(0, infer_state.mem_index, v)
            return paged_fa3_decode_att(q, k_cache, v_cache, infer_state)

        h = self.embed[infer_state.input_ids]
        for i in range(N_LAYERS):
            h = self._layer(h, i, attend)
        return ModelOutput(F.linear(rms_norm(h, self.norm), self.lm_head))

    def prefill(self, req_idx, tokens):
        """Eager context forward of one request: causal attention over its prompt, KV written to its slots."""
        n = len(tokens)
        mem_index = self.mem_manager.alloc(n)
        self.req_manager.req_to_token_indexs[req_idx, :n] = mem_index
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()

        def attend(q, k, v, k_cache, v_cache):
            k_cache.index_copy_(0, mem_index, k)
            v_cache.index_copy_(0, mem_index, v)
            scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
            return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)

        h = self.embed[torch.tensor(tokens, dtype=torch.int64).to(self.device)]
        for i in range(N_LAYERS):
            h = self._layer(h, i, attend)

    def _create_padded_decode_model_input(self, model_input, new_batch_size):
        if model_input.batch_size == new_batch_size:
            return model_input
        pad = new_batch_size - model_input.batch_size
        new_model_input = copy.copy(model_input)
        new_model_input.batch_size = new_batch_size
        new_model_input.max_kv_seq_len = max(2, model_input.max_kv_seq_len)
        new_model_input.input_ids = F.pad(model_input.input_ids, (0, pad), value=1)
        new_model_input.b_req_idx = F.pad(model_input.b_req_idx, (0, pad), value=self.req_manager.HOLD_REQUEST_ID)
        new_model_input.b_seq_len = F.pad(model_input.b_seq_len, (0, pad), value=2)
        new_model_input.mem_indexes = F.pad(model_input.mem_indexes, (0, pad),
                                            value=MemoryManager.HOLD_TOKEN_MEMINDEX)
        return new_model_input

    def _prepare(self, model_input, origin_batch_size):              # _create_inferstate + the extra state
        infer_state = InferStateInfo(model_input, self, origin_batch_size)
        copy_kv_index_to_req(self.req_manager.req_to_token_indexs, infer_state.b_req_idx, infer_state.b_seq_len,
                             infer_state.mem_index)
        infer_state.init_some_extra_state(self)
        infer_state.init_att_state()
        return infer_state

    def _decode(self, model_input):
        origin_batch_size = infer_batch_size = model_input.batch_size
        if self.graph is not None and self.graph.can_run(infer_batch_size, model_input.max_kv_seq_len):
            infer_batch_size = self.graph.find_closest_graph_batch_size(infer_batch_size)
            model_input = self._create_padded_decode_model_input(model_input, infer_batch_size)
            infer_state = self._prepare(model_input, origin_batch_size)
            batch_size = infer_state.batch_size
            b1_cu_q_seq_len_cpu_slice = self.b1_cu_q_seq_len_cpu_ref[:batch_size]
            b_cu_kv_seq_len_cpu_slice = self.b_cu_kv_seq_len_cpu_ref[:batch_size]
            if not is_capturing():                                    # platform_backend.name == "ascend"
                maybe_sync_attn_params(
                    batch_size=batch_size, b1_cu_q_seq_len_cpu_slice=b1_cu_q_seq_len_cpu_slice,
                    b_cu_kv_seq_len_cpu_slice=b_cu_kv_seq_len_cpu_slice,
                    b1_cu_q_seq_len_cpu=infer_state.b1_cu_q_seq_len_cpu,
                    b_cu_kv_seq_len_cpu=infer_state.b_cu_kv_seq_len_cpu, update_stream=self.graph.update_stream)
            if self.graph.need_capture(infer_batch_size):
                model_output = self.graph.capture_decode(self._token_forward, infer_state)
            else:
                model_output = self.graph.replay(infer_state, b1_cu_q_seq_len_cpu_slice, b_cu_kv_seq_len_cpu_slice)
        else:
            model_output = self._token_forward(self._prepare(model_input, origin_batch_size))
        return ModelOutput(model_output.logits[:origin_batch_size])  # _create_unpad_decode_model_output


# --- the serving loop (stand-in for the router, the scheduler and the sampler) ----------------------------------------

PROMPTS = {"A": 5, "B": 6, "C": 3, "D": 7}
STEPS = [list("ABCD"), list("ABCD"), list("ABC"), list("AB"), list("AB"), list("A")]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enable_graph):
        model = TpPartBaseModel(device, disable_cudagraph=not enable_graph)
        gen, reqs, outs = generator(108), {}, []
        for i, (name, n) in enumerate(PROMPTS.items()):
            prompt = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            reqs[name] = dict(idx=i, len=n, next=torch.randint(0, VOCAB, (len(STEPS),), generator=gen).tolist())
            model.prefill(i, prompt)
        for step, batch in enumerate(STEPS):
            rs = [reqs[r] for r in batch]
            tensor = lambda values, dtype: torch.tensor(values, dtype=dtype).to(device)   # noqa: E731
            model_input = ModelInput(len(rs), max(r["len"] + 1 for r in rs),
                                     tensor([r["next"][step] for r in rs], torch.int64),
                                     tensor([r["idx"] for r in rs], torch.int64),
                                     tensor([r["len"] + 1 for r in rs], I32), model.mem_manager.alloc(len(rs)))
            outs.append(model._decode(model_input).logits.clone())
            synchronize(device)                                           # the sampler reads the logits
            for r in rs:
                r["len"] += 1
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
