"""The piecewise prefill graph plans attention for the whole model's heads while a TP rank holds only its share.

Upstream: https://github.com/xLLM-AI/xllm/pull/1164 ("bugfix: reslove prefill coredump when enable
piecewisegraph and tp on cuda device.", commit f3e59acd7).
Symptom: with the prefill piecewise CUDA graph (``FLAGS_enable_prefill_piecewise_graph``) and tensor
parallelism on CUDA, the first prefill core-dumps (illegal memory access in the FlashInfer prefill kernel).
Mechanism: on the graph path, ``CudaGraphPersistentParam::update()`` (called before the warmup and the
capture of each prefill bucket and again before every piecewise replay) rebuilds the FlashInfer plan that
the attention runners use: ``update_prefill_plan_info(plan_info, ..., num_qo_heads=n_heads,
num_kv_heads=n_kv_heads, enable_cuda_graph=true)``, with ``n_heads = args_.n_heads()`` and
``n_kv_heads = args_.n_kv_heads().value_or(n_heads)``: the whole model's head counts. The attention layer
sees ``attn_metadata.enable_cuda_graph`` and skips its own plan, so the graph-path plan is the one used by
the warmup forward and by ``AttentionRunner::run_replay`` -> ``batch_prefill``. Its query/key/value and
output tensors are the rank's shard (``num_heads_ = n_heads / tp``), which the eager path plans for
(``FlashInferAttentionImpl::prefill_forward`` passes ``num_heads_``/``num_kv_heads_``). The SM90 plan
enumerates work items per query head (``cta_head_indices`` for ``qo_head_idx < num_qo_heads``), so half the
work items address heads the rank's tensors do not have: out-of-bounds reads and writes. Modelled for one
TP rank (rank 0 of 2; the row-parallel all-reduce is left out); the kernel's out-of-bounds head is the
out-of-range index error the CPU raises. No KV cache (a plain prefill without prefix).
Doctor: undersized-buffer, at ``update`` (the graph path's plan asks the attention runner for more heads
than the captured query/key/value/output buffers hold).
Fix (upstream): ``update()`` divides by ``tp_size = world_size / max(dp_size, 1)``:
``n_heads = args_.n_heads() / tp_size`` and ``n_kv_heads = total_kv_heads / tp_size`` (1 when
``total_kv_heads < tp_size``), the per-rank counts the eager path uses.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/xLLM-AI/xllm/pull/1164"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "update"
SYMPTOM = "prefill core dump with piecewise CUDA graph + TP: the plan addresses heads the rank does not hold"

VOCAB, N_HEADS, N_KV_HEADS, HEAD_DIM = 16, 4, 2, 2      # ModelArgs: the whole model
WORLD_SIZE, DP_SIZE = 2, 1                               # runtime::Options: TP 2 (this process: rank 0)
HIDDEN = N_HEADS * HEAD_DIM
MAX_TOKENS_PER_BATCH, MAX_SEQS = 8, 4
PREFILL_BUCKETS = (4, 8)                                 # get_bucket_num_tokens for prefill


@dataclasses.dataclass
class ModelArgs:
    n_heads: int = N_HEADS
    n_kv_heads: int = N_KV_HEADS
    head_dim: int = HEAD_DIM


@dataclasses.dataclass
class Options:
    world_size: int = WORLD_SIZE
    dp_size: int = DP_SIZE


@dataclasses.dataclass
class PlanInfo:
    layer_id: int = -1
    uri: str = ""
    plan_info: list | None = None            # ffi::Array<int64_t>: host ints


@dataclasses.dataclass
class AttentionMetadata:
    q_cu_seq_lens: torch.Tensor
    kv_cu_seq_lens: torch.Tensor
    plan_info: PlanInfo
    enable_cuda_graph: bool = False
    is_prefill: bool = True


@dataclasses.dataclass
class ModelInputParams:
    q_seq_lens: torch.Tensor                 # cumulative query lengths (batch + 1)
    kv_seq_lens: torch.Tensor                # cumulative kv lengths (batch + 1)
    attn_metadata: AttentionMetadata | None = None


# ------------------------------------------------------------------ FlashInfer plan / run
def update_prefill_plan_info(plan_info, attn_meta, num_qo_heads, num_kv_heads, enable_cuda_graph):
    """The host-side prefill plan (as ``PrefillSM90Plan``): one work item per query head and request,
    each naming the head it runs (``cta_head_indices``) and the request's query/kv ranges."""
    if plan_info.layer_id != 0:
        return
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} should be divisible by num_kv_heads {num_kv_heads}")
    qo_indptr_h = attn_meta.q_cu_seq_lens.to("cpu").tolist()
    kv_indptr_h = attn_meta.kv_cu_seq_lens.to("cpu").tolist()
    works = []
    for qo_head_idx in range(num_qo_heads):
        for i in range(len(qo_indptr_h) - 1):
            works += [qo_head_idx, qo_indptr_h[i], qo_indptr_h[i + 1] - qo_indptr_h[i],
                      kv_indptr_h[i], kv_indptr_h[i + 1] - kv_indptr_h[i]]
    plan_info.uri = "batch_prefill_bf16_hd2"
    plan_info.plan_info = [num_qo_heads, num_kv_heads, len(works) // 5] + works


def batch_prefill(uri, plan_info, query, key, value, q_cu_seq_lens, kv_cu_seq_lens, sm_scale, output):
    """The prefill kernel: runs the plan's work items; the GQA group comes from the tensors' heads."""
    group = query.shape[1] // key.shape[1]
    works = plan_info[3:]
    for w in range(plan_info[2]):
        head, qo_start, qo_len, kv_start, kv_len = works[5 * w:5 * w + 5]
        q = query[qo_start:qo_start + qo_len, head]              # out of bounds past the rank's heads
        k = key[kv_start:kv_start + kv_len, head // group]
        v = value[kv_start:kv_start + kv_len, head // group]
        scores = (q @ k.T) * sm_scale
        q_pos = torch.arange(qo_len, device=query.device)[:, None] + (kv_len - qo_len)
        causal = torch.arange(kv_len, device=query.device)[None, :] > q_pos
        output[qo_start:qo_start + qo_len, head] = torch.softmax(scores.masked_fill(causal, -1e9), -1) @ v


# ------------------------------------------------------------------ piecewise capture machinery
@dataclasses.dataclass
class AttentionReplayParams:
    actual_num_tokens: int
    plan_info: list
    q_cu_seq_lens: torch.Tensor
    kv_cu_seq_lens: torch.Tensor


class AttentionRunner:
    """Records the attention call seen during a piecewise capture; runs it eagerly at each replay."""

    def run_capture(self, uri, query, key, value, sm_scale, output):
        capture = GlobalCaptureInstance.get_instance()
        capture.temporarily_end_graph()
        with events.dummy_run():                                 # nothing runs: the call is recorded
            self.uri_, self.query_, self.key_, self.value_ = uri, query, key, value
            self.scale_, self.output_ = sm_scale, output
        capture.temporarily_begin_graph()

    def run_replay(self, params):
        n = params.actual_num_tokens
        batch_prefill(self.uri_, params.plan_info, self.query_[:n], self.key_[:n], self.value_[:n],
                      params.q_cu_seq_lens, params.kv_cu_seq_lens, self.scale_, self.output_[:n])


class PiecewiseGraphs:
    def __init__(self):
        self.graphs, self.runners, self.instructions = [], [], []

    def add_graph(self, g):
        self.graphs.append(g)
        self.instructions.append(("graph", g))

    def add_attention_runner(self, runner):
        self.runners.append(runner)
        self.instructions.append(("runner", runner))

    def replay(self, runner_params, *, real, size, padded, outputs, eager):
        events.serve(self.graphs[0], real, size, padded=padded, outputs=outputs, eager=eager,
                     pieces=tuple(self.graphs))
        for kind, step in self.instructions:
            if kind == "graph":
                if step is not self.graphs[0]:
                    events.serve(step, real, size, padded=padded, outputs=outputs)
                step.replay()
            else:
                step.run_replay(runner_params)


class GlobalCaptureInstance:
    _instance = None

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        self._graphs = None
        self._ctx = None

    def is_capturing(self):
        return self._graphs is not None

    def begin_capture(self, pool, device, name):
        self._graphs, self._pool, self._device, self._name = PiecewiseGraphs(), pool, device, name
        self.temporarily_begin_graph()

    def temporarily_begin_graph(self):
        g = new_graph(self._device)
        self._ctx = contextlib.ExitStack()
        self._ctx.enter_context(graph(g, pool=self._pool, name=f"{self._name} piece {len(self._graphs.graphs)}"))
        self._open = g

    def temporarily_end_graph(self):
        ctx, self._ctx = self._ctx, None
        ctx.close()
        self._graphs.add_graph(self._open)

    def register_attention_runner(self, runner):
        self._graphs.add_attention_runner(runner)

    def end_capture(self):
        self.temporarily_end_graph()
        graphs, self._graphs = self._graphs, None
        return graphs

    def abort_capture(self, error):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(type(error), error, error.__traceback__)
        self._graphs = None


def batch_prefill_with_optional_piecewise_capture(uri, plan_info, query, key, value, q_cu_seq_lens,
                                                  kv_cu_seq_lens, sm_scale, output):
    capture = GlobalCaptureInstance.get_instance()
    if capture.is_capturing():
        runner = AttentionRunner()
        runner.run_capture(uri, query, key, value, sm_scale, output)
        capture.register_attention_runner(runner)
        return
    batch_prefill(uri, plan_info, query, key, value, q_cu_seq_lens, kv_cu_seq_lens, sm_scale, output)


# ------------------------------------------------------------------ the model (TP rank 0)
class FlashInferAttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        self.num_heads_, self.head_size_, self.scale_, self.num_kv_heads_ = num_heads, head_size, scale, num_kv_heads

    def forward(self, attn_metadata, query, key, value):
        output = torch.empty_like(query)                         # AttentionImpl::forward
        query = query.view(-1, self.num_heads_, self.head_size_)
        key = key.view(-1, self.num_kv_heads_, self.head_size_)
        value = value.view(-1, self.num_kv_heads_, self.head_size_)
        output = output.view(-1, self.num_heads_, self.head_size_)
        self.prefill_forward(attn_metadata, query, key, value, output)
        return output.view(-1, self.num_heads_ * self.head_size_)

    def prefill_forward(self, attn_metadata, query, key, value, output):
        if attn_metadata.enable_cuda_graph:
            assert attn_metadata.plan_info.plan_info is not None, "plan_info should not be null"
        else:
            update_prefill_plan_info(attn_metadata.plan_info, attn_metadata, self.num_heads_,
                                     self.num_kv_heads_, attn_metadata.enable_cuda_graph)
        batch_prefill_with_optional_piecewise_capture(
            attn_metadata.plan_info.uri, attn_metadata.plan_info.plan_info, query, key, value,
            attn_metadata.q_cu_seq_lens, attn_metadata.kv_cu_seq_lens, self.scale_, output)


class CausalLM:
    """One decoder layer on TP rank 0: column-parallel q/k/v (this rank's heads), row-parallel o_proj."""

    def __init__(self, args, options, device):
        tp = options.world_size // max(options.dp_size, 1)
        heads, kv_heads = args.n_heads // tp, max(args.n_kv_heads // tp, 1)
        gen = generator(1164)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq = randn(HIDDEN, heads * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wk = randn(HIDDEN, kv_heads * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wv = randn(HIDDEN, kv_heads * HEAD_DIM, gen=gen, device=device, scale=0.5)
        self.wo = randn(heads * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5)
        self.attn = FlashInferAttentionImpl(heads, HEAD_DIM, HEAD_DIM ** -0.5, kv_heads)

    def forward(self, tokens, params):
        attn_metadata = params.attn_metadata or AttentionMetadata(      # the eager metadata builder
            params.q_seq_lens, params.kv_seq_lens, PlanInfo(layer_id=0))
        h = self.embed[tokens]
        attn = self.attn.forward(attn_metadata, h @ self.wq, h @ self.wk, h @ self.wv)
        return h + attn @ self.wo


# ------------------------------------------------------------------ the graph executor
class CudaGraphPersistentParam:
    def __init__(self, args, options, device, variant):
        self.args_, self.options_, self.variant = args, options, variant
        self.persistent_tokens_ = torch.zeros(MAX_TOKENS_PER_BATCH, dtype=torch.long, device=device)
        self.q_seq_lens_ = torch.zeros(MAX_SEQS + 1, dtype=torch.int32, device=device)
        self.kv_seq_lens_ = torch.zeros(MAX_SEQS + 1, dtype=torch.int32, device=device)
        self.plan_info = PlanInfo()

    def persistent_tokens(self, n):
        return self.persistent_tokens_[:n]

    def update(self, tokens, params, padded_num_tokens, return_capture_params):
        n, bs = tokens.shape[0], params.q_seq_lens.shape[0] - 1
        self.persistent_tokens_[:n].copy_(tokens)
        self.q_seq_lens_[:bs + 1].copy_(params.q_seq_lens)
        self.kv_seq_lens_[:bs + 1].copy_(params.kv_seq_lens)
        attn_metadata = AttentionMetadata(self.q_seq_lens_[:bs + 1], self.kv_seq_lens_[:bs + 1],
                                          self.plan_info, enable_cuda_graph=True)
        if self.variant == "bug":
            n_heads = self.args_.n_heads
            n_kv_heads = self.args_.n_kv_heads or n_heads
        else:
            tp_size = self.options_.world_size // max(self.options_.dp_size, 1)
            n_heads = self.args_.n_heads // max(tp_size, 1)
            total_kv_heads = self.args_.n_kv_heads or self.args_.n_heads
            n_kv_heads = total_kv_heads // max(tp_size, 1) if total_kv_heads >= tp_size else 1
        attn_metadata.plan_info.layer_id = 0
        update_prefill_plan_info(attn_metadata.plan_info, attn_metadata, n_heads, n_kv_heads,
                                 enable_cuda_graph=True)
        if return_capture_params:
            return ModelInputParams(params.q_seq_lens, params.kv_seq_lens, attn_metadata)
        return None


class CudaGraph:
    def __init__(self, persistent_param, device):
        self.persistent_param_, self.device = persistent_param, device

    def capture(self, model, tokens, params, bucket_num_tokens, pool):
        self.padded_num_tokens_ = bucket_num_tokens
        param = self.persistent_param_
        graph_params = param.update(tokens, params, bucket_num_tokens, return_capture_params=True)
        # Warmup: execute forward once without capture.
        with events.warmup():
            model.forward(param.persistent_tokens(bucket_num_tokens), graph_params)
        capture = GlobalCaptureInstance.get_instance()
        capture.begin_capture(pool, self.device, f"prefill {bucket_num_tokens}")
        try:
            self.hidden_states_ = model.forward(param.persistent_tokens(bucket_num_tokens), graph_params)
        except BaseException as e:
            capture.abort_capture(e)
            raise
        self.piecewise_graph_ = capture.end_capture()
        self.model = model

    def replay(self, tokens, params):
        n, size, param = tokens.shape[0], self.padded_num_tokens_, self.persistent_param_
        updated = param.update(tokens, params, size, return_capture_params=True)
        meta = updated.attn_metadata
        replay_params = AttentionReplayParams(n, meta.plan_info.plan_info, meta.q_cu_seq_lens, meta.kv_cu_seq_lens)
        self.piecewise_graph_.replay(
            replay_params, real=n, size=size, padded={"persistent_tokens": param.persistent_tokens_},
            outputs=self.hidden_states_,
            eager=lambda: self.model.forward(param.persistent_tokens(size), updated))
        out = self.hidden_states_[:n]
        events.handed_out(self.piecewise_graph_.graphs[-1], out)
        return out


class CudaGraphExecutorImpl:
    def __init__(self, model, device, variant):
        self.model_, self.device = model, device
        self.persistent_param_ = CudaGraphPersistentParam(ModelArgs(), Options(), device, variant)
        self.prefill_graphs_ = {}
        events.static_buffers("CudaGraphExecutorImpl (prefill piecewise graphs)",
                              {"persistent_tokens": self.persistent_param_.persistent_tokens_})

    def run(self, tokens, params):
        n = tokens.shape[0]
        bucket = next(b for b in PREFILL_BUCKETS if b >= n)
        if bucket not in self.prefill_graphs_:               # lazy piecewise capture, then replay
            g = CudaGraph(self.persistent_param_, self.device)
            g.capture(self.model_, tokens, params, bucket, graph_pool_handle(self.device))
            self.prefill_graphs_[bucket] = g
        return self.prefill_graphs_[bucket].replay(tokens, params)


def run(variant: str, device: str = "cpu"):
    model = CausalLM(ModelArgs(), Options(), device)
    gen = generator(11640)
    batches = []
    for lens in ([3, 2], [4, 3], [2], [1, 2]):                # prefill batches (prompt lengths)
        tokens = torch.randint(0, VOCAB, (sum(lens),), generator=gen).to(device)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).to(device)
        batches.append((tokens, cu))

    def params_of(cu):
        return ModelInputParams(q_seq_lens=cu, kv_seq_lens=cu.clone())

    def served():
        executor = CudaGraphExecutorImpl(model, device, variant)
        return [executor.run(tokens, params_of(cu)).clone() for tokens, cu in batches]

    def eager():
        return [model.forward(tokens, params_of(cu)).clone() for tokens, cu in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
