"""FULL_DECODE_ONLY ACL graph: the paged-attention task update allocates a fresh workspace each step and re-records the graph task on it, then drops it.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/5833 ("[BugFix]converting pa get_workspace back to
capturing", vllm-project/vllm-ascend, merged 2026-01-22, commit 1d3544c887). Read: the commit message and its full diff
(``vllm_ascend/compilation/acl_graph.py`` ``_update_attn_pa_params`` and ``vllm_ascend/worker/model_runner_v1.py``
``_build_dummy_attn_metadata`` / ``SEQ_LEN_WITH_MAX_PA_WORKSPACE``). No issue thread was read.
Symptom: GQA models served with FULL_DECODE_ONLY ACL graphs through ``_npu_paged_attention`` hit "potential memory
problems": the graph's paged-attention task runs on workspace memory that the caching allocator has already taken back.
Mechanism: the FULL decode graph records one ``_npu_paged_attention`` task per layer (``graph_task_group_begin/end``,
handle kept in ``graph_params.handles``) with the workspace obtained at capture (``graph_params.workspaces``). Before each
replay ``_update_attn_pa_params(update_stream, forward_context, runtime_shape)`` re-records that task with this step's
``seq_lens`` (``graph_task_update_begin(update_stream, handle)``). The earlier code there called
``torch_npu._npu_paged_attention_get_workspace(..., context_lens=seq_lens)`` - because capture sized the workspace with
``seq_lens = max_query_len`` (1), which can be too small - and passed that new tensor as ``workspace=``. It is a local
of ``_update_attn_pa_params``: when the function returns nothing holds it, the allocator frees it, and the re-recorded
task that the graph replays keeps only its address.
Doctor: dangling-reference, at _update_attn_pa_params. The graph task is re-recorded onto a workspace whose only owner
is a local of the update function; the replay reads and writes that memory after it was released.
Fix (upstream): drop the per-step ``_npu_paged_attention_get_workspace`` and pass
``graph_params.workspaces.get(runtime_shape)`` (owned for the graph's life); make that capture-time workspace big
enough by building the capture's dummy metadata with ``seq_lens = SEQ_LEN_WITH_MAX_PA_WORKSPACE`` when capturing.
Modelled: ``NPUModelRunner`` (``_build_dummy_attn_metadata``, capture, execute), ``ACLGraphWrapper`` (capture/replay
per runtime shape), ``graph_params`` (attn_params, handles, workspaces), ``_update_attn_pa_params`` as upstream.
Stand-ins: the FULL graph is three engine graphs sharing one pool - the part before attention, the paged-attention
task (re-recorded by ``graph_task_update_begin/end``, emulated as a fresh capture of that one op), the part after;
``_npu_paged_attention`` is a split-KV kernel that writes per-split partial results (out, max, sum) into the workspace
and then combines them, so its workspace size follows ``ceil(max(context_lens) / SPLIT_LEN)`` as
``_npu_paged_attention_get_workspace`` sizes it; the task reads the runner's persistent device ``seq_lens`` (stand-in
for the host ``context_lens`` the task update bakes in). One attention layer, 2 query heads / 1 KV head (GQA),
head dim 4, block size 4, max model len 16 (so SEQ_LEN_WITH_MAX_PA_WORKSPACE = 16), capture sizes [2, 4].
Workload: three requests with 5, 9 and 3 cached tokens decode three steps (3 requests padded to the size-4 graph, then
2 requests on the size-2 graph, then 3 again). Bug: the first replay's task reads the freed workspace
(IllegalMemoryAccess on the CPU; on a GPU the block is reused by later allocations). Fix: equals eager.
"""
from __future__ import annotations

import contextlib
import math

import torch

from workbench.engine import graph, graph_pool_handle, new_graph
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/5833"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_update_attn_pa_params"
SYMPTOM = ("FULL_DECODE_ONLY with _npu_paged_attention: before each replay the task update allocates a new workspace "
           "with _npu_paged_attention_get_workspace, re-records the PA task on it and drops it; the replayed task "
           "reads and writes freed memory")

HIDDEN, VOCAB = 8, 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 4
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 4
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
SPLIT_LEN = 4                                  # KV tokens per split of the paged-attention kernel
SEQ_LEN_WITH_MAX_PA_WORKSPACE = MAX_MODEL_LEN  # upstream: 6144
MAX_NUM_REQS = 4
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ   # block 0: reserved null block
CUDAGRAPH_CAPTURE_SIZES = [2, 4]

_variant = "bug"


class GraphParams:
    def __init__(self):
        self.attn_params: dict[int, list] = {}
        self.handles: dict[int, list] = {}
        self.workspaces: dict[int, torch.Tensor] = {}


_graph_params = GraphParams()


def get_graph_params() -> GraphParams:
    return _graph_params


class GraphTaskHandle:
    """What ``graph_task_group_end`` returns: the recorded task inside the FULL graph."""

    def __init__(self, device):
        self.device = device
        self.graph = None


@contextlib.contextmanager
def graph_task_update(handle: GraphTaskHandle):
    """``torch.npu.graph_task_update_begin/end``: the ops in the block replace the task's recorded ops."""
    g = new_graph(handle.device)
    with graph(g, name="paged attention task"):
        yield
    handle.graph = g


def _npu_paged_attention_get_workspace(query, context_lens):
    num_splits = max(1, math.ceil(int(max(context_lens)) / SPLIT_LEN))
    return torch.empty(query.shape[0], NUM_HEADS, num_splits, HEAD_DIM + 2, dtype=query.dtype, device=query.device)


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out, workspace):
    """Split-KV paged attention: per-split partials go to ``workspace``, then are combined into ``out``."""
    n, splits = query.shape[0], workspace.shape[2]
    j = torch.arange(splits * SPLIT_LEN, device=query.device)
    blk = block_table[:, (j // BLOCK_SIZE).clamp(max=MAX_BLOCKS_PER_REQ - 1)]            # [n, L]
    k = key_cache[blk, j % BLOCK_SIZE].repeat_interleave(num_heads // num_kv_heads, dim=2)  # [n, L, H, D]
    v = value_cache[blk, j % BLOCK_SIZE].repeat_interleave(num_heads // num_kv_heads, dim=2)
    scores = torch.einsum("nhd,nlhd->nhl", query, k) * scale_value
    scores = torch.where(j.view(1, 1, -1) < context_lens.view(-1, 1, 1), scores, torch.full_like(scores, -1e9))
    s = scores.view(n, num_heads, splits, SPLIT_LEN)
    m = s.amax(-1)
    p = torch.exp(s - m.unsqueeze(-1))
    vv = v.view(n, splits, SPLIT_LEN, num_heads, HEAD_DIM).permute(0, 3, 1, 2, 4)
    workspace[..., :HEAD_DIM] = torch.einsum("nhsk,nhskd->nhsd", p, vv)
    workspace[..., HEAD_DIM] = m
    workspace[..., HEAD_DIM + 1] = p.sum(-1)
    w = torch.exp(workspace[..., HEAD_DIM] - workspace[..., HEAD_DIM].amax(-1, keepdim=True))
    num = (w.unsqueeze(-1) * workspace[..., :HEAD_DIM]).sum(2)
    out.copy_(num / (w * workspace[..., HEAD_DIM + 1]).sum(2).unsqueeze(-1))


class AttnMetadata:
    def __init__(self, seq_lens_list, seq_lens, block_table):
        self.seq_lens_list = seq_lens_list   # host values (the task update's context_lens)
        self.seq_lens = seq_lens             # the runner's persistent device buffer
        self.block_tables = block_table


class ForwardContext:
    def __init__(self, attn_metadata, capturing=False):
        self.attn_metadata = attn_metadata
        self.capturing = capturing


LAYER = "model.layers.0.self_attn.attn"


def _update_attn_pa_params(update_stream, forward_context, runtime_shape):
    """Re-record each layer's paged-attention task with this step's sequence lengths (the hazard site)."""
    graph_params = get_graph_params()
    for key, param, handle in zip(forward_context.attn_metadata, graph_params.attn_params[runtime_shape],
                                  graph_params.handles[runtime_shape]):
        (query, key_cache, value_cache, num_kv_heads, num_heads, scale, block_table, seq_lens, output) = param
        seq_lens_list = forward_context.attn_metadata[key].seq_lens_list
        if _variant == "bug":
            workspace = _npu_paged_attention_get_workspace(query=query, context_lens=seq_lens_list)
        else:                                      # upstream fix: the capture-time (max) workspace
            workspace = graph_params.workspaces.get(runtime_shape)
        with graph_task_update(handle):
            _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale, block_table,
                                 seq_lens, output, workspace)


class Model:
    def __init__(self, device):
        gen = generator(5833)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv = (r(HIDDEN, d * HEAD_DIM) for d in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
        self.wo = r(NUM_HEADS * HEAD_DIM, HIDDEN)
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=torch.float64)
        self.value_cache = torch.zeros_like(self.key_cache)

    def pre_attention(self, input_ids, slot_mapping):
        x = self.embed[input_ids]
        k = (x @ self.wk).view(-1, NUM_KV_HEADS, HEAD_DIM)
        v = (x @ self.wv).view(-1, NUM_KV_HEADS, HEAD_DIM)
        self.key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot_mapping] = k
        self.value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot_mapping] = v
        query = (x @ self.wq).view(-1, NUM_HEADS, HEAD_DIM)
        output = torch.empty_like(query)
        return query, x, output

    def post_attention(self, residual, attn_out):
        return (residual + attn_out.reshape(residual.shape[0], -1) @ self.wo) @ self.lm_head


class NPUModelRunner:
    def __init__(self, device, use_aclgraph):
        self.device = device
        self.model = Model(device)
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.graphs = {}
        if use_aclgraph:
            self.pool = graph_pool_handle(device)
            for n in CUDAGRAPH_CAPTURE_SIZES:
                self.capture(n)

    def _build_dummy_attn_metadata(self, num_reqs, max_query_len=1, is_graph_capturing=False):
        if _variant == "fix" and is_graph_capturing:
            seq_lens = SEQ_LEN_WITH_MAX_PA_WORKSPACE
        else:
            seq_lens = max_query_len
        self.seq_lens[:num_reqs] = seq_lens
        self.seq_lens[num_reqs:] = 0
        self.block_table[:num_reqs] = 0
        return {LAYER: AttnMetadata([seq_lens] * num_reqs, self.seq_lens[:num_reqs], self.block_table[:num_reqs])}

    def capture(self, n):
        m, scale = self.model, HEAD_DIM ** -0.5
        attn_metadata = self._build_dummy_attn_metadata(n, is_graph_capturing=True)
        meta = attn_metadata[LAYER]
        static = {"input_ids": self.input_ids, "slot_mapping": self.slot_mapping, "block_table": self.block_table,
                  "seq_lens": self.seq_lens}
        state = {"key_cache": m.key_cache, "value_cache": m.value_cache}
        g_pre, (query, residual, output) = capture(
            lambda: m.pre_attention(self.input_ids[:n], self.slot_mapping[:n]), device=self.device, pool=self.pool,
            name=f"decode [{n}] pre-attention", owner="ACLGraphWrapper (FULL_DECODE_ONLY)", static=static, state=state)
        graph_params = get_graph_params()
        workspace = _npu_paged_attention_get_workspace(query, meta.seq_lens_list)
        handle = GraphTaskHandle(self.device)
        with graph_task_update(handle):             # graph_task_group_begin/end at capture
            _npu_paged_attention(query, m.key_cache, m.value_cache, NUM_KV_HEADS, NUM_HEADS, scale,
                                 self.block_table[:n], self.seq_lens[:n], output, workspace)
        graph_params.workspaces[n] = workspace
        graph_params.handles[n] = [handle]
        graph_params.attn_params[n] = [(query, m.key_cache, m.value_cache, NUM_KV_HEADS, NUM_HEADS, scale,
                                        self.block_table[:n], self.seq_lens[:n], output)]
        g_post, logits = capture(lambda: m.post_attention(residual, output), device=self.device, pool=self.pool,
                                 name=f"decode [{n}] post-attention", owner="ACLGraphWrapper (FULL_DECODE_ONLY)")
        self.graphs[n] = (g_pre, (query, residual, output), g_post, logits)

    def execute_model(self, token_ids, slots, block_rows, seq_lens):
        num_reqs = len(seq_lens)
        self.input_ids[:num_reqs] = token_ids
        self.slot_mapping[:num_reqs] = slots
        self.slot_mapping[num_reqs:] = 0                       # padded tokens write the null block
        self.block_table[:num_reqs] = block_rows
        self.seq_lens[:num_reqs] = torch.tensor(seq_lens, device=self.device)
        self.seq_lens[num_reqs:] = 0
        m = self.model
        if not self.graphs:
            query, residual, output = m.pre_attention(self.input_ids[:num_reqs], self.slot_mapping[:num_reqs])
            workspace = _npu_paged_attention_get_workspace(query, seq_lens)
            _npu_paged_attention(query, m.key_cache, m.value_cache, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM ** -0.5,
                                 self.block_table[:num_reqs], self.seq_lens[:num_reqs], output, workspace)
            return m.post_attention(residual, output).clone()
        n = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_reqs)
        seq_lens_list = list(seq_lens) + [0] * (n - num_reqs)
        forward_context = ForwardContext({LAYER: AttnMetadata(seq_lens_list, self.seq_lens[:n], self.block_table[:n])})
        _update_attn_pa_params(None, forward_context, n)
        g_pre, pre_out, g_post, logits = self.graphs[n]
        replay(g_pre, pre_out, real=num_reqs, size=n, padded={"input_ids": self.input_ids})
        handle = get_graph_params().handles[n][0]
        replay(handle.graph, pre_out[2], real=num_reqs, size=n)
        out = replay(g_post, logits, real=num_reqs, size=n)
        return out[:num_reqs].clone()


def run(variant: str, device: str = "cpu"):
    global _variant, _graph_params
    _variant = variant

    def serve(use_aclgraph: bool):
        global _graph_params
        _graph_params = GraphParams()
        runner = NPUModelRunner(device, use_aclgraph)
        gen = generator(5834)
        ctx = {"A": 5, "B": 9, "C": 3}
        rows = {r: torch.arange(1 + i * MAX_BLOCKS_PER_REQ, 1 + (i + 1) * MAX_BLOCKS_PER_REQ)
                for i, r in enumerate("ABC")}
        m = runner.model
        for r, n in ctx.items():                               # prompt KV (prefill stand-in)
            pos = torch.arange(n)
            slots = (rows[r][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(device)
            m.key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = randn(n, NUM_KV_HEADS, HEAD_DIM, gen=gen,
                                                                        device=device).double()
            m.value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = randn(n, NUM_KV_HEADS, HEAD_DIM, gen=gen,
                                                                          device=device).double()
        outs = []
        for names in ["ABC", "AB", "ABC"]:
            pos = [ctx[r] for r in names]                      # the new token's position
            for r in names:
                ctx[r] += 1
            slots = torch.tensor([int(rows[r][p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                                  for r, p in zip(names, pos)], device=device)
            token_ids = torch.randint(0, VOCAB, (len(names),), generator=gen).to(device)
            block_rows = torch.stack([rows[r] for r in names]).to(device)
            outs.append(runner.execute_model(token_ids, slots, block_rows, [ctx[r] for r in names]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
