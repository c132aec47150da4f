"""ACL-graph re-capture after an RL sleep/wake finds the graph-param registry gone: an lru_cache hides its rebuild.

Upstream: https://github.com/DeepLink-org/dlinfer/pull/319 ("fix re-capture in RL", commit aca49b99d1e4db611386a5e7e01090d3e1c70628,
April 2026); file dlinfer/framework/lmdeploy_ext/cudagraph/ascend_cudagraph.py (lmdeploy's Ascend graph mode).
Symptom: in RL (weights updated between rollouts, the engine put to sleep and woken up), the first decode step
after wake-up that captures an ACL graph fails with ``AttributeError: 'NoneType' object has no attribute
'events'``; graph-mode decode is unusable until the process restarts. Eager mode never touches the registry.
Mechanism: on the torch_npu path without ``graph.update`` (``not aclgraph_use_torch_npu_update()``, and always
for MLA), the captured ``atb._npu_paged_attention`` bakes its ``context_lens`` at capture, so
``decode_attention`` (dlinfer/vendor/ascend/attention.py) registers each captured attention task while
``AscendGraphRunner.capturing``: ``graph_params = get_graph_params()``, ``graph_params.events[num_tokens]
.append(event)``, ``attn_params[num_tokens].append((query, key_cache, ..., attn_output))``,
``handles[num_tokens].append(graph_task_group_end(stream))``; before each replay ``update_attn_params``
re-issues those tasks with the live ``input_buffers["kv_seqlens"]``. The registry is built by
``set_graph_params(set(ret))`` as a side effect of ``_get_capture_batch_size_impl(max_batches)``, which is
``@functools.lru_cache``d and reached through ``AscendGraphRunner.get_capture_batch_sizes()`` from
``get_graph_key``. The RL sleep path calls ``ModelAgent.reset_graph_runner()`` -> ``AscendGraphRunner.reset()``,
which drops the runners and calls ``clear_graph_params()`` (``_graph_params = None``, releasing the references to
the old KV cache). After wake-up the next ``get_capture_batch_sizes()`` is a cache hit, the body (and its
``set_graph_params``) never runs again, and the next capture dereferences ``None``.
Doctor: warmup-divergence, at clear_graph_params (lazy init done once behind a cache; the reset clears what it
built but not the cache that guards rebuilding it, so the re-capture relies on state decided at first init).
Fix (upstream): a module global ``_graph_capture_sizes`` set in ``set_graph_params`` and cleared in
``clear_graph_params``, which now also calls ``_get_capture_batch_size_impl.cache_clear()`` so the next call
rebuilds the registry.
Modelled: one attention layer, one head, a contiguous KV cache (one block per sequence); the "task update" is a
per-task ``context_lens`` tensor the captured attention reads, rewritten by ``update_attn_params`` before replay;
events and workspaces are placeholders; sleep frees the KV cache and wake-up allocates a new one; the weight
update is an in-place copy; ``run`` starts from a fresh module state (cache cleared), as a new process would.
"""
from __future__ import annotations

import functools

import torch

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/DeepLink-org/dlinfer/pull/319"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "clear_graph_params"
SYMPTOM = "first ACL-graph capture after RL sleep/wake raises: graph params are None (lru_cache skips rebuild)"

VOCAB, DIM, MAX_CTX, MAX_BATCHES, NUM_SEQS = 32, 8, 8, 4, 4
PROMPT_LENS = (3, 1, 4, 2)
ROLLOUT = ((0, 1, 2), (0, 1, 2, 3), (1, 3), (0, 2, 3))   # decode steps of one rollout (sequence ids)
_VARIANT = "bug"


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def get_ascend_compatible_size(n: int) -> int:
    return next_power_of_2(n) if n <= 16 else (n + 15) & ~0xF


@functools.lru_cache
def _get_capture_batch_size_impl(max_batches: int):
    ret, batch_size = [], 1
    while batch_size <= max_batches:
        size = get_ascend_compatible_size(batch_size)
        if size > max_batches:
            break
        ret.append(size)
        batch_size = size + 1
    if max_batches not in ret:
        ret.append(max_batches)
    set_graph_params(set(ret))
    return ret


class GraphParams:
    def __init__(self, sizes):
        self.events = {s: [] for s in sizes}
        self.workspaces = {s: None for s in sizes}
        self.handles = {s: [] for s in sizes}
        self.attn_params = {s: [] for s in sizes}
        self.is_mla = False


_graph_params: GraphParams | None = None
_graph_capture_sizes: set | None = None


def set_graph_params(aclgraph_capture_sizes):
    global _graph_params, _graph_capture_sizes
    if _graph_params is not None:
        raise ValueError("Graph parameters have already been set!")
    _graph_params = GraphParams(aclgraph_capture_sizes)
    _graph_capture_sizes = aclgraph_capture_sizes


def get_graph_params():
    return _graph_params


def clear_graph_params():
    """Clear global graph params and release references to KV cache tensors."""
    global _graph_params, _graph_capture_sizes
    if _graph_params is None:
        return
    try:
        for d in (_graph_params.attn_params, _graph_params.handles, _graph_params.events):
            for k in d:
                d[k].clear()
        _graph_params.workspaces.clear()
    finally:
        _graph_params = None
        if _VARIANT == "fix":
            _graph_capture_sizes = None
            _get_capture_batch_size_impl.cache_clear()


class TaskGroupHandle:
    """What ``graph_task_group_end`` returns: the captured task, whose ``context_lens`` argument is baked in."""

    def __init__(self, context_lens):
        self.context_lens = context_lens


def paged_attention(query, key_cache, value_cache, block_table, context_lens, out):
    ctx = torch.arange(MAX_CTX, device=query.device)
    slots = block_table.long()[:, :1] * MAX_CTX + ctx[None, :]
    scores = (key_cache[slots] @ query[:, :, None]).squeeze(-1) / DIM ** 0.5
    scores = scores.masked_fill(ctx[None, :] >= context_lens.long()[:, None], -1e9)
    out.copy_((torch.softmax(scores, -1)[:, :, None] * value_cache[slots]).sum(1))


def decode_attention(query, key_cache, value_cache, block_table, kv_seq_len, attn_output):
    """dlinfer/vendor/ascend/attention.py: while capturing, register the task so replays can update it."""
    if AscendGraphRunner.capturing:
        graph_params = get_graph_params()
        num_tokens = query.shape[0]
        graph_params.events[num_tokens].append(object())              # torch.npu.ExternalEvent()
        graph_params.attn_params[num_tokens].append((query, key_cache, value_cache, block_table, kv_seq_len,
                                                     attn_output))
        handle = TaskGroupHandle(torch.empty_like(kv_seq_len))         # graph_task_group_begin ... _end
        paged_attention(query, key_cache, value_cache, block_table, handle.context_lens, attn_output)
        graph_params.handles[num_tokens].append(handle)
    else:
        paged_attention(query, key_cache, value_cache, block_table, kv_seq_len, attn_output)


def update_attn_params(forward_meta, runtime_size):
    """Before replay: re-issue each captured attention task with the live kv_seqlens."""
    graph_params = get_graph_params()
    for param, handle, event in zip(graph_params.attn_params[runtime_size], graph_params.handles[runtime_size],
                                    graph_params.events[runtime_size]):
        handle.context_lens.copy_(forward_meta.input_buffers["kv_seqlens"])


class Model:
    def __init__(self, device, seed):
        gen = generator(seed)
        self.emb, self.pos = randn(VOCAB, DIM, gen=gen, device=device), randn(MAX_CTX, DIM, gen=gen, device=device)
        self.w = {n: randn(DIM, DIM, gen=gen, device=device, scale=sc) for n, sc in zip("qkvo", (.4, .4, 1, 1))}

    def kv(self, input_ids, position_ids):
        h = self.emb[input_ids.long()] + self.pos[position_ids.long()]
        return h, h @ self.w["k"], h @ self.w["v"]

    def __call__(self, input_ids, position_ids, past_key_values, block_offsets, kv_seqlens, kv_start_indices):
        h, k, v = self.kv(input_ids, position_ids)
        key_cache, value_cache = past_key_values
        skip = kv_start_indices < 0
        slot = kv_start_indices.long().clamp(min=0)
        key_cache[slot] = torch.where(skip[:, None], key_cache[slot], k)
        value_cache[slot] = torch.where(skip[:, None], value_cache[slot], v)
        attn_output = torch.empty_like(h)
        decode_attention(h @ self.w["q"], key_cache, value_cache, block_offsets, kv_seqlens, attn_output)
        return h + attn_output @ self.w["o"]


class CudaGraphMeta:
    def __init__(self, max_batchs, device):
        self.max_batchs, self.device, self.input_buffers, self.output_buffers = max_batchs, device, {}, {}


class AscendSingleGraphRunner:
    def __init__(self, model, max_batches, device):
        self.model, self.meta, self._graph = model, CudaGraphMeta(max_batches, device), None

    def fill_buffers_cudagraph(self, input_ids, position_ids, block_offsets, kv_seqlens, kv_start_indices):
        b, n = self.meta.input_buffers, input_ids.shape[0]
        for name, src, null in (("input_ids", input_ids, 0), ("position_ids", position_ids, 0),
                                ("block_offsets", block_offsets, 0), ("kv_seqlens", kv_seqlens, 0),
                                ("kv_start_indices", kv_start_indices, -1)):
            b[name].fill_(null)
            b[name][:n] = src

    def capture(self, past_key_values, **kwargs):
        mb, dev = self.meta.max_batchs, self.meta.device
        z = lambda *s: torch.zeros(*s, dtype=torch.int32, device=dev)     # noqa: E731
        self.meta.input_buffers = {"input_ids": z(mb), "position_ids": z(mb), "block_offsets": z(mb, 1),
                                   "kv_seqlens": z(mb), "kv_start_indices": z(mb)}
        self.fill_buffers_cudagraph(**kwargs)
        b = self.meta.input_buffers
        with events.warmup():                                      # warmup, eager attention path
            self.model(past_key_values=past_key_values, **b)
        AscendGraphRunner.capturing = True                          # set around torch.npu.graph(...)
        try:
            self._graph, self.meta.output_buffers["hidden"] = capture(
                lambda: self.model(past_key_values=past_key_values, **b), device=dev, name=f"decode {mb}",
                warmups=0, owner="AscendSingleGraphRunner", static=b,
                state={"key_cache": past_key_values[0], "value_cache": past_key_values[1]})
        finally:
            AscendGraphRunner.capturing = False

    def forward(self, past_key_values, **kwargs):
        self.fill_buffers_cudagraph(**kwargs)
        update_attn_params(self.meta, self.meta.max_batchs)
        n = kwargs["input_ids"].shape[0]
        return replay(self._graph, self.meta.output_buffers["hidden"], real=n, size=self.meta.max_batchs)[:n].clone()


class AscendGraphRunner:
    capturing = False

    def __init__(self, model, device):
        self.model, self.device, self._runner_map = model, device, {}

    def get_capture_batch_sizes(self):
        return _get_capture_batch_size_impl(MAX_BATCHES)

    def __call__(self, **kwargs):
        n = kwargs["input_ids"].shape[0]
        key = next(s for s in sorted(self.get_capture_batch_sizes()) if s >= n)       # get_graph_key
        if key not in self._runner_map:
            runner = AscendSingleGraphRunner(self.model, key, self.device)
            runner.capture(**kwargs)
            self._runner_map[key] = runner
        return self._runner_map[key].forward(**kwargs)

    def reset(self):
        self._runner_map.clear()
        clear_graph_params()


def run(variant: str, device: str = "cpu"):
    global _VARIANT
    _VARIANT = variant
    gen = generator(3190)
    tokens = torch.randint(0, VOCAB, (2, len(ROLLOUT), NUM_SEQS), generator=gen)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]
    new_weights = Model(device, 3192)

    def serve(graphed: bool):
        global _graph_params, _graph_capture_sizes
        _get_capture_batch_size_impl.cache_clear()                  # a fresh process
        _graph_params = _graph_capture_sizes = None
        model = Model(device, 3191)
        runner = AscendGraphRunner(model, device) if graphed else None
        outs = []
        for rollout in range(2):
            kv = tuple(torch.zeros(NUM_SEQS * MAX_CTX, DIM, device=device) for _ in range(2))
            lens = list(PROMPT_LENS)
            for s, p in enumerate(prompts):                         # eager prefill
                _, k, v = model.kv(p.to(device), torch.arange(len(p), device=device))
                kv[0][s * MAX_CTX: s * MAX_CTX + len(p)], kv[1][s * MAX_CTX: s * MAX_CTX + len(p)] = k, v
            for step, seqs in enumerate(ROLLOUT):
                i32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device)    # noqa: E731
                kwargs = dict(input_ids=i32([tokens[rollout, step, s].item() for s in seqs]),
                              position_ids=i32([lens[s] for s in seqs]), block_offsets=i32([[s] for s in seqs]),
                              kv_seqlens=i32([lens[s] + 1 for s in seqs]),
                              kv_start_indices=i32([s * MAX_CTX + lens[s] for s in seqs]), past_key_values=kv)
                for s in seqs:
                    lens[s] += 1
                outs.append(runner(**kwargs) if graphed else model(**kwargs))
            # RL: sleep (ModelAgent.reset_graph_runner -> AscendGraphRunner.reset, KV cache freed),
            # update_params (new policy weights), wakeup (a new KV cache next rollout)
            if graphed:
                runner.reset()
            for name in model.w:
                model.w[name].copy_(new_weights.w[name])
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
