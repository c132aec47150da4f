"""cuDNN frontend ``Graph::deserialize`` always ends in ``warmup``, a fake CUDA-graph capture on the handle's stream; a serialized SDPA plan first loaded inside a runner's capture begins a second capture on the capturing stream, and the capture fails.

Upstream: https://github.com/NVIDIA/cudnn-frontend/pull/183 ("Fix issues in warmup function.", NVIDIA/cudnn-frontend,
by Anerudhan, merged 2025-12-01 as 397120c; the follow-up #185 "Fix/cuda graph warmup", 0258951, only turned the
``[[maybe_unused]]`` into ``(void)cudnn_status``). Read: the PR description ("Make sure doing a cuda graph capture is
not allowed when one is already in progress / Teardown the cuda graph to prevent future errors when execute fails"),
its review thread, the diff of ``include/cudnn_frontend/graph_interface.h`` (``Graph::warmup``), the fixed
``Graph::warmup``, ``Graph::serialize`` and ``Graph::deserialize(handle, data)`` (which ends in
``CHECK_CUDNN_FRONTEND_ERROR(warmup(handle))``), ``python/pygraph/pygraph.cpp`` (``PyGraph::deserialize(handle_,
pyobj)``: the handle given, or the graph's own), and the v1.15 release note that added ``warmup`` ("triggers kernel
loading by performing a fake graph capture ... prevents deadlocks when used with other modules (e.g., NCCL)").
Symptom: a process that loads serialized (AoT-built) cuDNN graphs lazily, on the first use of a shape, cannot be
CUDA-graphed: when the first use of a shape is inside ``torch.cuda.graph`` (a runner that warms up once and then
captures every batch size), ``deserialize`` fails and the runner's capture is invalidated. Eager serving works.
Mechanism: ``warmup(handle)`` reads the handle's stream (it creates a fake stream only when that is the default
stream; an application that calls ``cudnn.set_stream(handle, torch.cuda.current_stream())`` hands it the stream being
captured), asks ``cuda_stream_is_capturing`` and only logs the answer, then calls ``cuda_graph_begin_capture(
fake_stream, cudaStreamCaptureModeRelaxed)``, ``cuda_malloc``s a 1 MiB scratch that it binds to every tensor uid,
``execute``s the plan into it, ends and destroys the fake graph and ``cuda_free``s the scratch. Inside the runner's
capture that begin-capture is on a stream that is already capturing (illegal: captures do not nest; and ``cudaMalloc``
/ ``cudaFree`` are among the calls a global-mode capture refuses), so ``deserialize`` returns the error, pygraph throws,
and the runner's capture of that batch size fails. Outside a capture (the eager reference, the runner's own warmup at
its largest batch) the same warmup is harmless.
Doctor: sync-in-capture, at warmup (a capture-illegal driver call, the nested begin-capture with its
malloc/free, made inside the runner's capture; the fix changed exactly that function to return before it).
Fix (upstream): ``if (capture_status != cudaStreamCaptureStatusNone) return {OK, "cuda graph capture active, aborting
warmup"}`` right after the query; and ``execute``'s status inside the fake capture is ignored (``(void)cudnn_status``)
so that an early return can no longer leave the fake capture open. The graph then records the plan's kernels into the
runner's capture as any ``execute`` does.
Modelled: ``Graph`` (``serialize``, ``deserialize``, ``warmup``, ``execute``, ``get_workspace_size``) reduced to the
one SDPA forward node of an inference graph (Q, K, V, O in BHSD, ``attn_scale`` pass-by-value); ``pygraph``
(``deserialize``, ``execute``, the ``handle`` it holds) and ``Handle`` with its stream (``set_stream``). The
``detail::cuda_*`` wrappers are the engine's: ``cuda_stream_is_capturing`` is ``torch.cuda.is_current_stream_capturing``
(which the engine answers for its captures), ``cuda_graph_begin_capture``/``end_capture`` are a ``graph(...)`` block in
relaxed mode on a fresh graph, ``cuda_malloc`` an uninitialised 1 MiB byte tensor; pointers are tensors, and
``execute`` views each pointer with the shape and stride the serialized tensor attributes give. Stand-ins: the
backend plan (``build_plans`` from ``cudnn_backend_data``) is one softmax attention written with tensor ops; the AoT
plan store is a dict of serialized graphs per batch size built at start-up (``build_sdpa_graph``); the model is a small
DiT-style denoiser (token embedding plus timestep MLP, one attention block whose attention is the cuDNN graph, an MLP,
an output head) served through a ``SdpaPlanCache`` that deserializes a batch size's plan on its first use; the
``DenoiserGraphRunner`` warms up once at its largest batch size and then captures batch sizes 4, 2, 1 in one pool,
padding a request to the next captured size; the flow-matching Euler scheduler runs eagerly between replays. The
teardown half of the fix (an ``execute`` error returned from inside the fake capture) is not modelled: ``execute``
does not fail here. float64.
Workload: three requests (batches 3, 1 and 2), 3 denoising steps each. Bug: building the runner raises GraphError in
``warmup`` (the capture of batch 2, whose plan is first deserialized inside it; batch 4's plan was loaded by the
eager warmup); fix: warmup is skipped inside the capture, the plan's attention is captured, and all three requests'
latents equal eager (max error 4.9e-15: batch 3 runs padded to 4).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/cudnn-frontend/pull/183"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "warmup"
SYMPTOM = ("a serialized cuDNN SDPA graph first deserialized inside a runner's CUDA-graph capture: Graph::warmup "
           "begins its fake capture on the capturing stream and the capture fails")

HIDDEN, NUM_HEADS, HEAD_DIM, TOKENS, LATENT_CHANNELS = 16, 2, 8, 8, 4
CAPTURE_SIZES = [4, 2, 1]
NUM_INFERENCE_STEPS = 3
DTYPE = torch.float64
Q_UID, K_UID, V_UID, O_UID, ATTN_SCALE_UID = 1, 2, 3, 4, 5

_variant = "bug"
_log: list[str] = []


# --- include/cudnn_frontend/utils / detail:: (the CUDA runtime calls warmup makes) ------------------------------------

class Stream:
    def __init__(self, name):
        self.name = name


def current_stream():
    """``torch.cuda.current_stream()``: the capture's side stream while a capture is open."""
    return Stream("capture side stream" if torch.cuda.is_current_stream_capturing() else "serving stream")


def cuda_stream_is_capturing(stream):
    """``cudaStreamIsCapturing``: the engine answers for the captures open on this thread."""
    return torch.cuda.is_current_stream_capturing()


def cuda_malloc(nbytes, device):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class Handle:
    """``cudnnHandle_t``: the stream the graph's kernels are launched on."""

    def __init__(self, device):
        self.device, self.stream = device, None


def set_stream(handle, stream):
    handle.stream = stream


# --- include/cudnn_frontend/graph_interface.h -------------------------------------------------------------------------

class Tensor_attributes:
    def __init__(self, uid, name, dim=(), stride=(), is_virtual=False, is_pass_by_value=False):
        self.uid, self.name, self.dim, self.stride = uid, name, tuple(dim), tuple(stride)
        self.is_virtual, self.is_pass_by_value = is_virtual, is_pass_by_value


def _tensor_at(pointer, tensor):
    """The tensor a device pointer in the variant pack holds, with the attributes' dims and strides."""
    flat = pointer.view(DTYPE) if pointer.dtype != DTYPE else pointer.view(-1)
    return flat.as_strided(tensor.dim, tensor.stride)


class Graph:
    """A cuDNN frontend graph as it comes out of ``deserialize``: tensor attributes and one built plan."""

    def __init__(self, device):
        self.device = device
        self.deserialized_tensor_properties: list[Tensor_attributes] = []
        self.deserialized_pass_by_value: dict[int, float] = {}
        self.variant_pack_uids: set[int] = set()
        self.plan = None

    def _uid(self, uid):
        return next(t for t in self.deserialized_tensor_properties if t.uid == uid)

    def get_workspace_size(self):
        return 0

    def execute(self, handle, tensor_uid_to_pointer_map, workspace):
        """The plan's kernels on ``handle``'s stream: O = softmax(Q K^T * attn_scale) V."""
        q, k, v, o = (_tensor_at(tensor_uid_to_pointer_map[uid], self._uid(uid))
                      for uid in (Q_UID, K_UID, V_UID, O_UID))
        attn_scale = tensor_uid_to_pointer_map[ATTN_SCALE_UID]          # pass-by-value: a host float
        o.copy_(torch.softmax(q @ k.transpose(-1, -2) * attn_scale, dim=-1) @ v)
        return "OK"

    def warmup(self, handle):
        """Trigger kernel loading by a fake graph capture of one execute, then throw the graph away."""
        original_stream = handle.stream
        if original_stream is None:                                     # cuda_stream_create + set_stream
            fake_stream = Stream("warmup fake stream")
            set_stream(handle, fake_stream)
        else:
            fake_stream = original_stream
        capture_status = cuda_stream_is_capturing(fake_stream)
        _log.append(f"INFO: capture_status {capture_status} original_stream "
                    f"{'DEFAULT (NULL) Stream' if original_stream is None else 'NON-DEFAULT Stream'}")
        if _variant == "fix" and capture_status:
            _log.append("INFO: cuda graph capture active, aborting warmup")
            return "OK: cuda graph capture active, aborting warmup"
        graph_obj = new_graph(self.device)
        with graph(graph_obj, name="cudnn warmup (fake capture)",          # cuda_graph_begin_capture(fake_stream,
                   capture_error_mode="relaxed"):                           #   cudaStreamCaptureModeRelaxed)
            tmp_pointer = cuda_malloc(1024 * 1024, self.device)
            cpu_pointer = 1.0
            tensor_uid_to_pointer_map = {}
            for tensor in self.deserialized_tensor_properties:
                if not tensor.is_virtual:
                    tensor_uid_to_pointer_map[tensor.uid] = cpu_pointer if tensor.is_pass_by_value else tmp_pointer
            self.execute(handle, tensor_uid_to_pointer_map, tmp_pointer)
        del graph_obj, tmp_pointer                                      # cuda_graph_destroy, cuda_free
        set_stream(handle, original_stream)
        return "OK"

    def serialize(self):
        return {"tensors": {t.name: dict(uid=t.uid, dim=list(t.dim), stride=list(t.stride), is_virtual=t.is_virtual,
                                         is_pass_by_value=t.is_pass_by_value)
                            for t in self.deserialized_tensor_properties},
                "cudnn_backend_data": self.plan, "variant_pack_uids": sorted(self.variant_pack_uids),
                "pass_by_values": {str(k): v for k, v in self.deserialized_pass_by_value.items()}}

    def deserialize(self, handle, data):
        for name, info in data["tensors"].items():
            self.deserialized_tensor_properties.append(Tensor_attributes(name=name, **info))
        self.plan = dict(data["cudnn_backend_data"])                    # plans.build_plans(handle, serialized_plan)
        self.variant_pack_uids = set(data["variant_pack_uids"])
        self.deserialized_pass_by_value = {int(k): v for k, v in data["pass_by_values"].items()}
        status = self.warmup(handle)                                    # CHECK_CUDNN_FRONTEND_ERROR(warmup(handle))
        return status


# --- python/pygraph/pygraph.cpp ---------------------------------------------------------------------------------------

class pygraph:
    def __init__(self, handle):
        self.handle, self.graph = handle, Graph(handle.device)

    def deserialize(self, data, handle=None):
        self.graph.deserialize(handle if handle is not None else self.handle, data)

    def get_workspace_size(self):
        return self.graph.get_workspace_size()

    def execute(self, variant_pack, workspace, handle=None):
        self.graph.execute(handle if handle is not None else self.handle, variant_pack, workspace)


def build_sdpa_graph(device, b, h, s, d, attn_scale):
    """AoT: ``sdpa(q, k, v, is_inference=True, attn_scale=...)``, ``build``, ``serialize`` for one batch size."""
    g = Graph(device)
    bhsd, stride = (b, h, s, d), (h * s * d, s * d, d, 1)
    g.deserialized_tensor_properties = [Tensor_attributes(uid, name, bhsd, stride)
                                        for uid, name in ((Q_UID, "Q"), (K_UID, "K"), (V_UID, "V"), (O_UID, "O"))]
    g.deserialized_tensor_properties.append(Tensor_attributes(ATTN_SCALE_UID, "attn_scale", is_pass_by_value=True))
    g.plan = {"engine": "sdpa_fprop_inference", "b": b, "h": h, "s_q": s, "s_kv": s, "d": d}
    g.variant_pack_uids = {Q_UID, K_UID, V_UID, O_UID, ATTN_SCALE_UID}
    g.deserialized_pass_by_value = {ATTN_SCALE_UID: attn_scale}
    return g.serialize()


# --- the application: a plan cache and a small denoiser ---------------------------------------------------------------

class SdpaPlanCache:
    """Serialized SDPA graphs per batch size, deserialized on the first use of that batch size."""

    def __init__(self, device, plan_store):
        self.handle = Handle(device)
        self.plan_store, self._graphs = plan_store, {}

    def get(self, batch_size):
        if batch_size not in self._graphs:
            g = pygraph(self.handle)
            g.deserialize(self.plan_store[batch_size])
            self._graphs[batch_size] = g
        return self._graphs[batch_size]


class CudnnAttention:
    def __init__(self, plan_cache):
        self.plan_cache = plan_cache

    def __call__(self, q, k, v):
        b = q.shape[0]
        set_stream(self.plan_cache.handle, current_stream())      # cudnn.set_stream(handle, current_stream())
        g = self.plan_cache.get(b)
        o = torch.empty_like(q)
        g.execute({Q_UID: q, K_UID: k, V_UID: v, O_UID: o, ATTN_SCALE_UID: 1.0 / math.sqrt(HEAD_DIM)}, workspace=None)
        return o


class Denoiser:
    """x_t (B, T, C), t (B,) -> velocity (B, T, C): embed, one attention block, MLP, head."""

    def __init__(self, device, plan_cache):
        gen = generator(183)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.x_embedder, self.pos_embed = r(LATENT_CHANNELS, HIDDEN), r(TOKENS, HIDDEN, scale=0.1)
        self.t_mlp = (r(HIDDEN, HIDDEN), r(HIDDEN, scale=0.1))
        self.to_qkv, self.to_out = r(HIDDEN, 3 * HIDDEN), r(HIDDEN, HIDDEN)
        self.mlp = (r(HIDDEN, 2 * HIDDEN), r(2 * HIDDEN, HIDDEN))
        self.final = r(HIDDEN, LATENT_CHANNELS)
        self.attn = CudnnAttention(plan_cache)

    def timestep_embedding(self, t):
        half = HIDDEN // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=DTYPE, device=t.device) / half)
        args = t[:, None] * 1000.0 * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return F.silu(emb @ self.t_mlp[0] + self.t_mlp[1])

    def __call__(self, latents, timesteps):
        b = latents.shape[0]
        h = latents @ self.x_embedder + self.pos_embed + self.timestep_embedding(timesteps)[:, None]
        qkv = F.layer_norm(h, [HIDDEN]) @ self.to_qkv
        q, k, v = (x.reshape(b, TOKENS, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
                   for x in qkv.split(HIDDEN, dim=-1))
        h = h + self.attn(q, k, v).transpose(1, 2).reshape(b, TOKENS, HIDDEN) @ self.to_out
        h = h + F.gelu(F.layer_norm(h, [HIDDEN]) @ self.mlp[0]) @ self.mlp[1]
        return F.layer_norm(h, [HIDDEN]) @ self.final


class DenoiserGraphRunner:
    """One graph per batch size (largest first, one pool); a request is padded to the next captured size."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.static_latents = torch.zeros(max(CAPTURE_SIZES), TOKENS, LATENT_CHANNELS, dtype=DTYPE, device=device)
        self.static_timesteps = torch.ones(max(CAPTURE_SIZES), dtype=DTYPE, device=device)
        self.graphs = {}

    def capture_graphs(self):
        events.static_buffers("DenoiserGraphRunner", {"latents": self.static_latents,
                                                      "timesteps": self.static_timesteps})
        with events.warmup():
            self.model(self.static_latents, self.static_timesteps)
        pool = graph_pool_handle(self.device)
        for bs in sorted(CAPTURE_SIZES, reverse=True):
            self.graphs[bs] = capture(lambda bs=bs: self.model(self.static_latents[:bs], self.static_timesteps[:bs]),
                                      device=self.device, pool=pool, warmups=0, name=f"denoiser bs={bs}",
                                      owner="DenoiserGraphRunner")

    def __call__(self, latents, timesteps):
        bs = latents.shape[0]
        size = min(s for s in self.graphs if s >= bs)
        self.static_latents[:bs].copy_(latents)
        self.static_timesteps[:bs].copy_(timesteps)
        g, out = self.graphs[size]
        out = replay(g, out, real=bs, size=size,
                     padded={"latents": self.static_latents, "timesteps": self.static_timesteps} if bs < size else None)
        return out[:bs]


def denoise(forward, latents):
    """Flow-matching Euler steps from t = 1 to t = 0 (eager, between the model's calls)."""
    sigmas = torch.linspace(1.0, 0.0, NUM_INFERENCE_STEPS + 1, dtype=DTYPE)
    for i in range(NUM_INFERENCE_STEPS):
        t = torch.full((latents.shape[0],), float(sigmas[i]), dtype=DTYPE, device=latents.device)
        velocity = forward(latents, t)
        latents = latents + float(sigmas[i + 1] - sigmas[i]) * velocity
    return latents


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    _log.clear()
    gen = generator(2025_12_01)
    plan_store = {b: build_sdpa_graph(device, b, NUM_HEADS, TOKENS, HEAD_DIM, 1.0 / math.sqrt(HEAD_DIM))
                  for b in range(1, max(CAPTURE_SIZES) + 1)}
    requests = [randn(b, TOKENS, LATENT_CHANNELS, gen=gen, device=device).to(DTYPE) for b in (3, 1, 2)]

    def serve(use_graphs):
        model = Denoiser(device, SdpaPlanCache(device, plan_store))
        forward = model
        if use_graphs:
            forward = DenoiserGraphRunner(model, device)
            forward.capture_graphs()
        return [denoise(forward, x) for x in requests]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
