"""Nemotron-H DP branch calls the Mamba mixer directly: breakable prefill graphs bind the capture batch's metadata.

Upstream: https://github.com/sgl-project/sglang/pull/34561 ("[Fix] Fix Nemotron-H Mamba illegal memory access under DP
attention with CUDA graph").
Symptom: Nemotron-H (e.g. Nemotron-3-Ultra NVFP4) served with ``--enable-dp-attention`` and a prefill CUDA-graph backend
(``--cuda-graph-backend-prefill breakable``, or torch.compile piecewise) crashes at graph replay with an illegal memory
access; without DP attention, or eagerly, it runs (sglang main, August 2026).
Mechanism: breakable CUDA graphs (BCG) capture the forward as segments split at ``eager_on_graph`` breaks; a break runs
eagerly at replay and reads the live batch from the forward context, while everything between breaks is recorded once.
The Mamba mixer must be such a break: ``Mamba2AttnBackend.forward`` reads ``self.forward_metadata``
(``query_start_loc``, ``mamba_cache_indices``, ``has_initial_states``), fresh tensors that ``init_forward_metadata``
builds for every batch outside the graph. ``NemotronHMambaDecoderLayer.forward`` routed the non-DP path through
``breakable_nemotron_mamba2_with_output``, but its ``is_dp_attention_enabled()`` branch called
``self._forward_mamba(hidden_states, forward_batch)`` directly, so under BCG the mixer's kernels were recorded into the
surrounding segment, bound to the capture batch's metadata tensors. The next ``init_forward_metadata`` (the next
bucket's capture, or the first live batch) replaces ``forward_metadata`` and releases them; every replay then reads
that released metadata (an illegal memory access, or the capture batch's sequence layout and state slots where the
block was reused).
Doctor: dangling-reference, at ``_forward_mamba`` (called inside the captured segment, it binds the graph to the capture
batch's per-batch Mamba metadata, which ``init_forward_metadata`` releases before any replay).
Fix (upstream): in the DP branch, dispatch like the non-DP path: ``is_in_breakable_cuda_graph()`` ->
``breakable_nemotron_mamba2_with_output(hidden_states, output, layer_id, False)`` (a graph break that takes the live
batch and metadata from the forward context), ``is_in_tc_piecewise_cuda_graph()`` -> the split op, otherwise
``_forward_mamba`` as before.
(I read the PR description and the surrounding ``nemotron_h.py`` / split-op code; the dispatch is modelled from them.
Tiny model: one Mamba layer with a diagonal linear recurrence standing in for conv1d + SSD, input embeddings given,
page size 1; gathers and scatters of the state pool are written with masks.)
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/34561"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_forward_mamba"
SYMPTOM = "breakable prefill graphs replay the DP-branch Mamba mixer on the capture batch's released metadata"

HIDDEN, VOCAB_OUT, MAX_REQS, NUM_MAMBA_SLOTS = 4, 6, 4, 6
CAPTURE_NUM_TOKENS = [8, 4]
MAX_NUM_TOKENS = max(CAPTURE_NUM_TOKENS)
ENABLE_DP_ATTENTION = True

# ------------------------------------------------------------------ breakable CUDA graph (BCG)
_bcg = {"enabled": False, "capture": None}
_forward_context = {"forward_batch": None, "layers": None}


def is_in_breakable_cuda_graph():
    return _bcg["enabled"]


def is_dp_attention_enabled():
    return ENABLE_DP_ATTENTION


@contextmanager
def enable_breakable_cuda_graph():
    old = _bcg["enabled"]
    _bcg["enabled"] = True
    try:
        yield
    finally:
        _bcg["enabled"] = old


@contextmanager
def set_forward_context(forward_batch, layers):
    old = dict(_forward_context)
    _forward_context.update(forward_batch=forward_batch, layers=layers)
    try:
        yield
    finally:
        _forward_context.update(old)


def eager_on_graph(enable: bool):
    """A graph break: under capture, end the segment, run eagerly, record the call, start a new segment."""
    def decorate(inner):
        def wrapper(*args):
            capture = _bcg["capture"]
            if not enable or capture is None:
                return inner(*args)
            capture._end_current_segment()
            output = inner(*args)
            capture.cuda_graph.items.append(("break", inner, args))
            capture._begin_new_segment()
            return output
        return wrapper
    return decorate


class BreakableCUDAGraph:
    def __init__(self):
        self.items = []       # ("graph", g) segments and ("break", fn, captured args), in order

    def replay(self, outputs, real, size):
        graphs = tuple(item[1] for item in self.items if item[0] == "graph")
        events.serve(graphs[0], real, size, outputs=outputs, pieces=graphs)
        for item in self.items:
            if item[0] == "graph":
                item[1].replay()
            else:
                item[1](*item[2])     # breaks are replayed with their capture-time arguments
        views = outputs.view_as(outputs)
        events.handed_out(graphs[-1], views)
        return views


class BreakableCUDAGraphCapture:
    def __init__(self, cuda_graph, pool, device, name):
        self.cuda_graph, self.pool, self.device, self.name = cuda_graph, pool, device, name
        self._ctx = self._graph = None

    def _begin_new_segment(self):
        self._graph = new_graph(self.device)
        self._ctx = graph(self._graph, pool=self.pool, name=f"{self.name} segment {len(self.cuda_graph.items)}")
        self._ctx.__enter__()

    def _end_current_segment(self):
        self._ctx.__exit__(None, None, None)
        self.cuda_graph.items.append(("graph", self._graph))

    def __enter__(self):
        _bcg["capture"] = self
        self._begin_new_segment()
        return self

    def __exit__(self, exc_type, exc, tb):
        _bcg["capture"] = None
        if exc_type is not None:
            return self._ctx.__exit__(exc_type, exc, tb)
        self._end_current_segment()
        return False


# ------------------------------------------------------------------ Mamba backend and model
@dataclasses.dataclass
class ForwardBatch:
    batch_size: int
    req_pool_indices: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_seq_lens_cpu: list


@dataclasses.dataclass
class ForwardMetadata:
    query_start_loc: torch.Tensor
    mamba_cache_indices: torch.Tensor
    has_initial_states: torch.Tensor
    num_prefill_tokens: int


class Mamba2AttnBackend:
    def __init__(self, device):
        self.device = device
        self.ssm_states = torch.zeros(NUM_MAMBA_SLOTS, HIDDEN, device=device)        # slot 0: padding dummy
        self.req_index_to_mamba_index_mapping = torch.arange(MAX_REQS, device=device) + 1
        self.req_index_to_mamba_index_mapping[0] = 0
        self.slot_ids = torch.arange(NUM_MAMBA_SLOTS, device=device)
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch):
        """Per-batch metadata, built eagerly outside the graphs (fresh tensors every batch)."""
        query_start_loc = torch.zeros(forward_batch.batch_size + 1, dtype=torch.long, device=self.device)
        query_start_loc[1:] = torch.cumsum(forward_batch.extend_seq_lens, 0)
        self.forward_metadata = ForwardMetadata(
            query_start_loc=query_start_loc,
            mamba_cache_indices=self.req_index_to_mamba_index_mapping[forward_batch.req_pool_indices],
            has_initial_states=forward_batch.extend_prefix_lens > 0,
            num_prefill_tokens=sum(forward_batch.extend_seq_lens_cpu))

    def forward(self, mixer, layer_id, hidden_states, output, forward_batch):
        md = self.forward_metadata
        x = hidden_states @ mixer.in_proj
        t = torch.arange(x.shape[0], device=x.device)
        starts, ends = md.query_start_loc[:-1], md.query_start_loc[1:]
        member = (t[:, None] >= starts[None, :]) & (t[:, None] < ends[None, :])          # token t in sequence b
        same_seq = (member[:, None, :] & member[None, :, :]).any(-1) & (t[:, None] >= t[None, :])
        decay = mixer.A[None, None, :] ** (t[:, None] - t[None, :]).clamp(min=0)[:, :, None].float()
        y = torch.where(same_seq[:, :, None], decay * x[None, :, :], 0.0).sum(1)
        onehot = md.mamba_cache_indices[:, None] == self.slot_ids[None, :]             # [bs, slots]
        h0 = torch.where(onehot[:, :, None], self.ssm_states[None, :, :], 0.0).sum(1)
        h0 = torch.where(md.has_initial_states[:, None], h0, 0.0)
        since_start = (t[:, None] - starts[None, :] + 1).clamp(min=0).float()
        y = y + torch.where(member[:, :, None], mixer.A ** since_start[:, :, None] * h0[None, :, :], 0.0).sum(1)
        is_last = t[:, None] == (ends - 1)[None, :]
        final = torch.where(is_last[:, :, None], y[:, None, :], 0.0).sum(0)              # [bs, HIDDEN]
        written = onehot.any(0)
        new_states = torch.where(onehot.T[:, :, None], final[None, :, :], 0.0).sum(1)
        self.ssm_states.copy_(torch.where(written[:, None], new_states, self.ssm_states))
        return y @ mixer.out_proj


_attn_backend: dict = {}


def get_attn_backend():
    return _attn_backend["backend"]


class HybridLinearAttnBackend:
    def __init__(self, device):
        self.linear_attn_backend = Mamba2AttnBackend(device)

    def init_forward_metadata(self, forward_batch):
        self.linear_attn_backend.init_forward_metadata(forward_batch)


def nemotron_mamba2_with_output(hidden_states, output, layer_id, fuse_mlp_allreduce=False):
    """Split op: take the live batch and metadata from the forward context; the mixer runs on the real rows."""
    forward_batch = _forward_context["forward_batch"]
    mamba_layer = _forward_context["layers"][layer_id]
    metadata = get_attn_backend().linear_attn_backend.forward_metadata
    num_actual_tokens = metadata.num_prefill_tokens
    if hidden_states.shape[0] != num_actual_tokens:
        hidden_states = hidden_states[:num_actual_tokens]
    ret = mamba_layer._forward_mamba(hidden_states, forward_batch)
    output[:num_actual_tokens].copy_(ret)
    if output.shape[0] != num_actual_tokens:
        output[num_actual_tokens:].zero_()


breakable_nemotron_mamba2_with_output = eager_on_graph(True)(nemotron_mamba2_with_output)


class Mamba2Mixer:
    def __init__(self, gen, device):
        self.in_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.out_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.A = torch.tensor([0.9, 0.7, 0.5, 0.8], device=device)


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class NemotronHMambaDecoderLayer:
    def __init__(self, gen, device, layer_id, variant):
        self.layer_id, self.variant = layer_id, variant
        self.norm_weight = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.mixer = Mamba2Mixer(gen, device)

    def _forward_mamba(self, hidden_states, forward_batch):
        attn_backend = get_attn_backend()
        return attn_backend.linear_attn_backend.forward(mixer=self.mixer, layer_id=self.layer_id,
                                                        hidden_states=hidden_states, output=None,
                                                        forward_batch=forward_batch)

    def forward(self, hidden_states, residual, forward_batch):
        if residual is None:
            residual = hidden_states
        hidden_states = rms_norm(hidden_states, self.norm_weight)
        if is_dp_attention_enabled():
            if self.variant == "fix" and is_in_breakable_cuda_graph():
                output = torch.empty_like(hidden_states)
                breakable_nemotron_mamba2_with_output(hidden_states, output, self.layer_id, False)
                return output, residual
            output = self._forward_mamba(hidden_states, forward_batch)
            return output, residual
        if is_in_breakable_cuda_graph():
            output = torch.empty_like(hidden_states)
            breakable_nemotron_mamba2_with_output(hidden_states, output, self.layer_id)
            return output, residual
        return self._forward_mamba(hidden_states, forward_batch), residual


class NemotronHForCausalLM:
    def __init__(self, device, variant):
        gen = generator(34561)
        self.layers = [NemotronHMambaDecoderLayer(gen, device, 0, variant)]
        self.norm_f = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB_OUT, gen=gen, device=device, scale=0.7)

    def forward(self, input_embeds, forward_batch):
        hidden_states, residual = input_embeds, None
        for layer in self.layers:
            hidden_states, residual = layer.forward(hidden_states, residual, forward_batch)
        return rms_norm(hidden_states + residual, self.norm_f) @ self.lm_head


# ------------------------------------------------------------------ prefill runner
class PrefillCudaGraphRunner:
    """Breakable prefill graphs per token bucket (captured largest first)."""

    def __init__(self, model, attn_backend, device):
        self.model, self.attn_backend, self.device = model, attn_backend, device
        self.input_embeds = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=device)
        self.req_pool_indices = torch.zeros(MAX_REQS, dtype=torch.long, device=device)
        self._pool = graph_pool_handle(device)
        self._graphs = {}
        events.static_buffers("PrefillCudaGraphRunner", {"input_embeds": self.input_embeds,
                                                         "req_pool_indices": self.req_pool_indices})
        events.persistent_state("MambaPool", {"ssm_states": attn_backend.linear_attn_backend.ssm_states})
        for num_tokens in sorted(CAPTURE_NUM_TOKENS, reverse=True):
            self.capture_one(num_tokens)

    def capture_one(self, num_tokens):
        # Dummy batch: one request (req pool slot 0 -> the dummy Mamba slot) over the whole bucket.
        forward_batch = ForwardBatch(1, self.req_pool_indices[:1],
                                     torch.tensor([num_tokens], device=self.device),
                                     torch.tensor([0], device=self.device), [num_tokens])
        with enable_breakable_cuda_graph(), set_forward_context(forward_batch, self.model.layers):
            self.attn_backend.init_forward_metadata(forward_batch)
            for _ in range(2):
                with events.warmup():
                    self.model.forward(self.input_embeds[:num_tokens], forward_batch)
            cuda_graph = BreakableCUDAGraph()
            with BreakableCUDAGraphCapture(cuda_graph, self._pool, self.device, f"prefill bcg {num_tokens} tokens"):
                out = self.model.forward(self.input_embeds[:num_tokens], forward_batch)
        self._graphs[num_tokens] = (cuda_graph, out)

    def execute(self, forward_batch, input_embeds):
        n = input_embeds.shape[0]
        num_tokens = min(s for s in CAPTURE_NUM_TOKENS if s >= n)
        self.input_embeds[:n].copy_(input_embeds)
        self.input_embeds[n:num_tokens].zero_()
        self.req_pool_indices[:forward_batch.batch_size].copy_(forward_batch.req_pool_indices)
        cuda_graph, out = self._graphs[num_tokens]
        with enable_breakable_cuda_graph(), set_forward_context(forward_batch, self.model.layers):
            self.attn_backend.init_forward_metadata(forward_batch)    # eager, outside the captured segments
            return cuda_graph.replay(out, real=n, size=num_tokens)[:n].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    # (req pool index, new tokens, cached prefix tokens) per request; A's second chunk continues its SSM state.
    steps = [[(1, 3, 0), (2, 2, 0)], [(1, 3, 3), (3, 1, 0)], [(2, 2, 2)]]
    embeds = [randn(sum(n for _, n, _ in step), HIDDEN, gen=gen, device=device) for step in steps]

    def batch_of(step):
        t = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
        return ForwardBatch(len(step), t([r for r, _, _ in step]), t([n for _, n, _ in step]),
                            t([p for _, _, p in step]), [n for _, n, _ in step])

    def serve(graphed: bool):
        model = NemotronHForCausalLM(device, variant)
        backend = _attn_backend["backend"] = HybridLinearAttnBackend(device)
        outs = []
        if graphed:
            runner = PrefillCudaGraphRunner(model, backend, device)
            backend.linear_attn_backend.ssm_states.zero_()     # capture only touched the dummy slot
            for step, x in zip(steps, embeds):
                outs.append(runner.execute(batch_of(step), x))
        else:
            for step, x in zip(steps, embeds):
                forward_batch = batch_of(step)
                backend.init_forward_metadata(forward_batch)
                with set_forward_context(forward_batch, model.layers):
                    outs.append(model.forward(x, forward_batch))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
