"""GDN's nested ``torch.compile`` first sees the spec-decode input inside the FULL capture: its autotuner synchronizes.

Upstream: https://github.com/vllm-project/vllm/pull/42070 ("[Bugfix] Remove nested torch.compile in GDN
rearrange_mixed_qkv causing CUDA graph capture failure", merged May 2026); the decorator came with
https://github.com/vllm-project/vllm/pull/40711 ("[Aiter][ROCm] gdn_linear_attn kernel fusion"), and
https://github.com/vllm-project/vllm/pull/42154 proposed the same removal with the analysis followed here.
Symptom: ``vllm serve Qwen/Qwen3.5-35B-A3B --speculative-config '{"method":"qwen3_next_mtp",
"num_speculative_tokens":2}'`` dies while capturing CUDA graphs: ``torch.AcceleratorError: CUDA error: operation
not permitted when stream is capturing`` (then ``cudaErrorStreamCaptureInvalidated``); the same engine without
graphs serves (CI "Basic Models Tests (Extra Initialization)" for Qwen3_5MTP / Qwen3_5MoeMTP failed the same way).
Mechanism: #40711 decorated ``GatedDeltaNetAttention.rearrange_mixed_qkv`` (the split of the packed conv output
``mixed_qkv`` into per-head query / key / value) with ``@torch.compile(fullgraph=True)``. Dynamo compiles such a
function lazily, once per guard set: a call whose input is new (``None`` rather than a tensor, a tensor of a shape
not seen yet) compiles a new graph, and Inductor autotunes the generated Triton kernel on its first launch, timing
every config with ``do_bench``, which calls ``torch.cuda.synchronize()``. ``_forward_core`` calls the method twice,
on ``mixed_qkv_spec`` and on ``mixed_qkv_non_spec`` (one of them ``None`` in a pure batch). Before capture only
non-spec batches reach it (the profile run; the capture warmups, ``cudagraph_num_of_warmups = 0``, are none), so
the spec path, ``batch * (1 + num_speculative_tokens)`` rows, is first called inside ``torch.cuda.graph(...)`` of
the FULL uniform-decode capture: the compile-time autotune synchronizes the capturing stream and the capture is
invalidated. The method is already traced by the outer compilation of the model, so the nested decorator only
adds a second, lazy one.
Doctor: sync-in-capture, at ``do_bench`` (the autotuner's timing synchronization, run by the first call of the
spec path inside the capture).
Fix (upstream): remove the ``@torch.compile(fullgraph=True)`` decorator from ``rearrange_mixed_qkv`` (the body is
unchanged), so nothing compiles or autotunes lazily while the graph is being captured.
Read: the descriptions of #42070 and #42154 (the latter's diff drops the same two decorators) and #40711's review
thread; the diff of #42070 itself (the decorator removal) was read through those. Dynamo's guard cache and
Inductor's autotuner are reduced to what they do here: compile once per new input, time two kernel configs with
``do_bench``. The GDN recurrence is reduced to a gated delta rule on one head group, all draft tokens accepted.
"""
from __future__ import annotations

import torch

from workbench.engine import is_capturing
from workbench.engine.cpu_graph import host_sync_error
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/42070"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "do_bench"
SYMPTOM = "capturing the MTP uniform-decode graph fails: the spec path's first compile autotunes (synchronizes) in capture"

VOCAB, HIDDEN = 16, 8
NUM_HEADS, HEAD_K, HEAD_V = 2, 2, 2
KEY_DIM, VALUE_DIM = NUM_HEADS * HEAD_K, NUM_HEADS * HEAD_V
CONV_KERNEL = 2
NUM_SPEC = 2                                  # num_speculative_tokens (qwen3_next_mtp)
QUERY_LEN = 1 + NUM_SPEC                      # uniform_decode_query_len
MAX_REQS = 2
GRAPH_TOKENS = MAX_REQS * QUERY_LEN           # the FULL uniform-decode capture size
PROFILE_TOKENS = 5                            # the profile run's (non-spec, prefill) batch


def cuda_synchronize(device: str) -> None:
    """``torch.cuda.synchronize()``: a capturing stream refuses it (cudaErrorStreamCaptureUnsupported). The CPU
    emulation has no stream to wait on, so the rule is stated here."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    elif is_capturing():
        raise host_sync_error("torch.cuda.synchronize", user_frame())


def do_bench(kernel, config, args, device: str) -> float:
    """``triton.testing.do_bench``: launch the kernel with one config and time it; the timer waits for the
    device (``torch.cuda.synchronize()``)."""
    kernel(config, *args)
    cuda_synchronize(device)
    return float(config["XBLOCK"])            # stands for the measured time (deterministic)


class CachingAutotuner:
    """Inductor's ``CachingAutotuner``: on the first launch, ``benchmark_all_configs`` times every config and
    keeps the fastest; later launches use it."""

    configs = ({"XBLOCK": 128}, {"XBLOCK": 64})

    def __init__(self, kernel, device):
        self.kernel, self.device, self.best = kernel, device, None

    def benchmark_all_configs(self, args):
        timings = [do_bench(self.kernel, cfg, args, self.device) for cfg in self.configs]
        return self.configs[timings.index(min(timings))]

    def run(self, *args):
        if self.best is None:
            self.best = self.benchmark_all_configs(args)
        return self.kernel(self.best, *args)


def torch_compile(fn, device: str):
    """``@torch.compile(fullgraph=True)`` on a method: Dynamo keeps one compiled entry per guard set (here:
    ``None``, or the input's shape and dtype); a call that fails every guard compiles a new entry, and the
    Inductor kernel generated for a tensor input is autotuned on its first launch."""
    cache = {}

    def compiled(self, mixed_qkv):
        guard = None if mixed_qkv is None else (tuple(mixed_qkv.shape), mixed_qkv.dtype)
        if guard not in cache:
            if mixed_qkv is None:             # nothing to generate: the graph only returns Nones
                cache[guard] = None
            else:                             # a Triton split/copy kernel (its configs change no value)
                cache[guard] = CachingAutotuner(lambda config, this, x: fn(this, x), device)
        tuner = cache[guard]
        return fn(self, mixed_qkv) if tuner is None else tuner.run(self, mixed_qkv)

    return compiled


class Model:
    def __init__(self, device):
        gen = generator(42070)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.in_proj_qkv = randn(HIDDEN, 2 * KEY_DIM + VALUE_DIM, gen=gen, device=device, scale=0.5)
        self.conv_weight = randn(2 * KEY_DIM + VALUE_DIM, CONV_KERNEL, gen=gen, device=device, scale=0.7)
        self.in_proj_ba = randn(HIDDEN, 2 * NUM_HEADS, gen=gen, device=device, scale=0.5)
        self.out_proj = randn(VALUE_DIM, HIDDEN, gen=gen, device=device, scale=0.5)


class GatedDeltaNetAttention:
    """One Qwen3-Next / Qwen3.5 linear-attention layer; ``_forward_core`` serves non-spec and spec batches."""

    def __init__(self, model, device, variant):
        self.model = model
        self._compiled = torch_compile(GatedDeltaNetAttention._rearrange, device) if variant == "bug" else None

    def rearrange_mixed_qkv(self, mixed_qkv):
        if self._compiled is not None:        # @torch.compile(fullgraph=True)   (#40711; removed by the fix)
            return self._compiled(self, mixed_qkv)
        return self._rearrange(mixed_qkv)

    def _rearrange(self, mixed_qkv):
        if mixed_qkv is None:
            return None, None, None
        query, key, value = torch.split(mixed_qkv, [KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
        query = query.reshape(-1, NUM_HEADS, HEAD_K).contiguous()
        key = key.reshape(-1, NUM_HEADS, HEAD_K).contiguous()
        value = value.reshape(-1, NUM_HEADS, HEAD_V).contiguous()
        return query, key, value

    def causal_conv1d_update(self, x, conv_state, state_idx, query_len):
        """Depthwise causal conv over ``query_len`` tokens per request (request r owns rows ``r * query_len``
        on); the conv state is read and written in place."""
        reqs = state_idx.shape[0]
        x = x.view(reqs, query_len, -1)
        conv = conv_state[state_idx]                                    # [reqs, C, K - 1]
        outs = []
        for t in range(query_len):
            window = torch.cat([conv, x[:, t, :, None]], dim=-1)        # [reqs, C, K]
            outs.append(torch.nn.functional.silu((window * self.model.conv_weight).sum(-1)))
            conv = window[..., 1:]
        conv_state[state_idx] = conv
        return torch.stack(outs, 1).reshape(reqs * query_len, -1)

    def fused_recurrent_gated_delta_rule(self, q, k, v, b, a, ssm_state, state_idx, query_len):
        reqs = state_idx.shape[0]
        q = q.view(reqs, query_len, NUM_HEADS, HEAD_K)
        k = torch.nn.functional.normalize(k.view(reqs, query_len, NUM_HEADS, HEAD_K), dim=-1)
        v = v.view(reqs, query_len, NUM_HEADS, HEAD_V)
        beta = torch.sigmoid(b).view(reqs, query_len, NUM_HEADS)
        g = torch.sigmoid(a).view(reqs, query_len, NUM_HEADS)
        s = ssm_state[state_idx]                                        # [reqs, H, K, V]
        o = []
        for t in range(query_len):                # all draft tokens accepted: no rollback
            kt, vt = k[:, t], v[:, t]
            s = s * g[:, t, :, None, None]
            err = vt - torch.einsum("rhkv,rhk->rhv", s, kt)
            s = s + beta[:, t, :, None, None] * kt[..., None] * err[:, :, None, :]
            o.append(torch.einsum("rhkv,rhk->rhv", s, q[:, t]))
        ssm_state[state_idx] = s
        return torch.stack(o, 1).reshape(reqs * query_len, VALUE_DIM)

    def _forward_core(self, mixed_qkv, b, a, conv_state, ssm_state, meta):
        if meta["num_spec_decodes"] > 0:      # a pure spec-decode batch: every token is a spec token
            mixed_qkv_spec, mixed_qkv_non_spec = mixed_qkv, None
            idx, qlen = meta["spec_state_indices"], QUERY_LEN
        else:                                 # a pure non-spec batch (the profile run's prefill)
            mixed_qkv_spec, mixed_qkv_non_spec = None, mixed_qkv
            idx, qlen = meta["non_spec_state_indices"], meta["query_len"]
        if mixed_qkv_spec is not None:
            mixed_qkv_spec = self.causal_conv1d_update(mixed_qkv_spec, conv_state, idx, qlen)
        if mixed_qkv_non_spec is not None:
            mixed_qkv_non_spec = self.causal_conv1d_update(mixed_qkv_non_spec, conv_state, idx, qlen)
        query_spec, key_spec, value_spec = self.rearrange_mixed_qkv(mixed_qkv_spec)
        query_non_spec, key_non_spec, value_non_spec = self.rearrange_mixed_qkv(mixed_qkv_non_spec)
        if query_spec is not None:
            return self.fused_recurrent_gated_delta_rule(query_spec, key_spec, value_spec, b, a, ssm_state, idx,
                                                         qlen)
        return self.fused_recurrent_gated_delta_rule(query_non_spec, key_non_spec, value_non_spec, b, a,
                                                     ssm_state, idx, qlen)

    def forward(self, input_ids, conv_state, ssm_state, meta):
        h = self.model.embed[input_ids]
        b, a = (h @ self.model.in_proj_ba).split(NUM_HEADS, dim=-1)
        core = self._forward_core(h @ self.model.in_proj_qkv, b, a, conv_state, ssm_state, meta)
        return h + core @ self.model.out_proj


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.device = device
        self.layer = GatedDeltaNetAttention(model, device, variant)
        self.conv_state = torch.zeros(MAX_REQS + 1, 2 * KEY_DIM + VALUE_DIM, CONV_KERNEL - 1, device=device)
        self.ssm_state = torch.zeros(MAX_REQS + 1, NUM_HEADS, HEAD_K, HEAD_V, device=device)
        self.input_ids = torch.zeros(GRAPH_TOKENS, dtype=torch.long, device=device)
        self.spec_state_indices = torch.arange(MAX_REQS, device=device)
        self.profile_run()
        self.graph = None
        if graphed:                               # capture_model(): FULL uniform decode, no warmup runs
            meta = {"num_spec_decodes": MAX_REQS, "spec_state_indices": self.spec_state_indices}
            self.graph, self.out = capture(
                lambda: self.layer.forward(self.input_ids, self.conv_state, self.ssm_state, meta),
                device=device, warmups=0, name=f"FULL uniform decode {GRAPH_TOKENS}",
                owner="GPUModelRunner (FULL decode graph)",
                static={"input_ids": self.input_ids, "spec_state_indices": self.spec_state_indices},
                state={"conv_state": self.conv_state, "ssm_state": self.ssm_state})

    def profile_run(self):
        """The memory profiling run: one dummy prefill (non-spec path) on the spare state slot."""
        ids = torch.zeros(PROFILE_TOKENS, dtype=torch.long, device=self.device)
        meta = {"num_spec_decodes": 0, "query_len": PROFILE_TOKENS,
                "non_spec_state_indices": torch.full((1,), MAX_REQS, device=self.device)}
        self.layer.forward(ids, self.conv_state, self.ssm_state, meta)

    def execute_model(self, tokens, state_slots):
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        self.input_ids.copy_(t(tokens))
        self.spec_state_indices.copy_(t(state_slots))
        if self.graph is not None:
            return replay(self.graph, self.out).clone()
        meta = {"num_spec_decodes": MAX_REQS, "spec_state_indices": self.spec_state_indices}
        return self.layer.forward(self.input_ids, self.conv_state, self.ssm_state, meta).clone()


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(4207)
    steps = [torch.randint(0, VOCAB, (GRAPH_TOKENS,), generator=gen).tolist() for _ in range(3)]

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        return [runner.execute_model(tokens, [0, 1]) for tokens in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
