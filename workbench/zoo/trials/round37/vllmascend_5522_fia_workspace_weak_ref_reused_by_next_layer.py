"""A FULL ACL graph's later attention layers run FIA on a workspace the first layer already released.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/5522 ("[Bugfix] fix the precision issues that
may raise from the inter-layer reuse of the workspace in certain scenarios"), commit 03679cf1d3.
Symptom: "the FIA operator shares a single workspace among different layers within the same computation
graph. To enable memory reuse, we adopt the weak_ref_tensor mechanism. However, this approach may lead
to precision anomalies in certain scenarios" (vllm-ascend, FULL / FULL_DECODE_ONLY ACL graphs, Dec 2025).
Mechanism: in ``AscendAttentionBackendImpl.full_graph_fia`` (capturing), the first layer finds
``graph_params.workspaces[num_tokens]`` empty, asks ``_npu_fused_infer_attention_score_get_max_workspace``
for a workspace and stores it with ``update_graph_params_workspaces``, which kept only
``weak_ref_tensors(workspace)``. The only owner is the local ``workspace`` of the first layer's call: once
it returns, the block goes back to the graph pool while the capture is still open, and the next
activation the capture allocates (here the second layer's new ``residual`` from ``npu_add_rms_norm``) is
placed in it. Every later layer's ``full_graph_fia`` takes the weak reference out of ``workspaces`` and
records FIA with that address as its scratch space, so each replay writes the attention scores of layer 2
over the live residual, which the post-attention add-norm then reads.
Doctor: dangling-reference, at ``full_graph_fia`` (the captured FIA of layer 2 writes through a workspace
whose owner released it during the capture).
Fix (upstream): ``update_graph_params_workspaces`` stores the workspace itself (a strong reference) for the
whole capture, so all layers of the graph share one live block; ``ACLGraphWrapper.__call__`` turns the
stored workspaces into weak references (``weak_ref_workspaces``) only after the capture has ended.
Model notes: one KV head group per request, decode only (one token per request, ``FULL_DECODE_ONLY``);
the per-replay FIA host parameters (``actual_seq_lengths_kv``, refreshed upstream by
``_update_attn_fia_params``) are a device ``seq_lens`` buffer here. The model takes ``inputs_embeds`` (as
vLLM does for multimodal models) and has attention-only layers; sizes are chosen so that the released
workspace fits the next activation exactly (the emulated pool hands on blocks of one size; the NPU and
CUDA caching allocators also split a larger free block).
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/5522"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "full_graph_fia"
SYMPTOM = "precision anomalies: a later layer's FIA scratch writes land on a live activation"

HIDDEN, NUM_HEADS, HEAD_SIZE, MAX_SEQ_LEN, VOCAB = 8, 2, 3, 4, 11
NUM_LAYERS = 2
NUM_REQS = 4                                  # the one FULL decode capture size (tokens = requests)
EPS = 1e-6


def weak_ref_tensors(t: torch.Tensor) -> torch.Tensor:
    """``vllm_ascend.utils.weak_ref_tensors``: a tensor on the same memory that does not own it (the C++ op
    builds it ``from_blob`` with no deleter), so it never keeps the block from being handed on."""
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


class GraphParams:
    def __init__(self, capture_sizes):
        self.workspaces: dict[int, torch.Tensor | None] = {n: None for n in capture_sizes}


_graph_params: GraphParams | None = None


def set_graph_params(capture_sizes):
    global _graph_params
    _graph_params = GraphParams(capture_sizes)


def get_graph_params() -> GraphParams:
    return _graph_params


def update_graph_params_workspaces(num_tokens: int, workspace: torch.Tensor, variant: str):
    if _graph_params is not None:
        _graph_params.workspaces[num_tokens] = weak_ref_tensors(workspace) if variant == "bug" else workspace


def weak_ref_workspaces(params: GraphParams | None):
    """The fix: weak references only once the whole capture has ended."""
    if params is None:
        return
    for num_tokens, ws in params.workspaces.items():
        if ws is not None:
            params.workspaces[num_tokens] = weak_ref_tensors(ws)


class ForwardContext:
    capturing = False


forward_context = ForwardContext()


def _npu_fused_infer_attention_score_get_max_workspace(query):
    """FIA's scratch size for this many tokens (scores of every head over the longest context)."""
    return torch.empty(query.shape[0] * NUM_HEADS * MAX_SEQ_LEN, device=query.device)


def npu_fused_infer_attention_score_out(query, key_cache, value_cache, seq_lens, workspace, out):
    """Decode FIA: scores go to the workspace, softmax runs there, ``out`` gets probabilities @ V."""
    n = query.shape[0]
    scores = workspace[: n * NUM_HEADS * MAX_SEQ_LEN].view(n, NUM_HEADS, MAX_SEQ_LEN)
    scores.copy_(torch.einsum("thd,tlhd->thl", query, key_cache[:n]))
    scores.mul_(HEAD_SIZE ** -0.5)
    ctx = torch.arange(MAX_SEQ_LEN, device=query.device)
    scores.masked_fill_((ctx[None, :] >= seq_lens[:n, None])[:, None, :], float("-inf"))
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    scores.div_(scores.sum(-1, keepdim=True))
    out.copy_(torch.einsum("thl,tlhd->thd", scores, value_cache[:n]))


class AscendAttentionBackendImpl:
    def __init__(self, variant):
        self.variant = variant
        self.key_cache = self.value_cache = None

    def full_graph_fia(self, query, attn_metadata, output):
        num_tokens = query.shape[0]
        graph_params = get_graph_params()
        # Get workspace from cache or calculate it if not present.
        workspace = graph_params.workspaces.get(num_tokens)
        if workspace is None:
            workspace = _npu_fused_infer_attention_score_get_max_workspace(query)
            update_graph_params_workspaces(num_tokens, workspace, self.variant)
        npu_fused_infer_attention_score_out(query, self.key_cache, self.value_cache, attn_metadata["seq_lens"],
                                            workspace, output)
        return output

    def forward(self, query, key, value, attn_metadata):
        n = query.shape[0]
        pos = attn_metadata["positions"][:n]
        req = torch.arange(n, device=query.device)
        self.key_cache.index_put_((req, pos), key)            # reshape_and_cache
        self.value_cache.index_put_((req, pos), value)
        output = torch.empty(n, NUM_HEADS, HEAD_SIZE, device=query.device)
        if forward_context.capturing:
            return self.full_graph_fia(query, attn_metadata, output)
        # eager: FIA allocates its own scratch
        npu_fused_infer_attention_score_out(query, self.key_cache, self.value_cache, attn_metadata["seq_lens"],
                                            _npu_fused_infer_attention_score_get_max_workspace(query), output)
        return output


def rms_norm(x, weight):
    out = x * (HIDDEN ** 0.5 / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) + EPS))
    return out.mul_(weight)


def npu_add_rms_norm(x, residual, weight):
    """``torch_npu.npu_add_rms_norm``: a new residual (x + residual) and its norm, both fresh tensors."""
    residual = x + residual
    return rms_norm(residual, weight), residual


class DecoderLayer:
    def __init__(self, gen, device, variant):
        self.w_qkv = randn(HIDDEN, 3 * NUM_HEADS * HEAD_SIZE, gen=gen, device=device, scale=0.6)
        self.w_o = randn(NUM_HEADS * HEAD_SIZE, HIDDEN, gen=gen, device=device, scale=0.6)
        self.ln1 = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.ln2 = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.impl = AscendAttentionBackendImpl(variant)

    def self_attn(self, hidden_states, attn_metadata):
        qkv = hidden_states @ self.w_qkv
        q, k, v = (t.view(-1, NUM_HEADS, HEAD_SIZE) for t in qkv.split(NUM_HEADS * HEAD_SIZE, -1))
        attn_output = self.impl.forward(q, k, v, attn_metadata)
        return attn_output.view(-1, NUM_HEADS * HEAD_SIZE) @ self.w_o          # o_proj

    def forward(self, hidden_states, residual, attn_metadata):
        if residual is None:
            residual = hidden_states
            hidden_states = rms_norm(hidden_states, self.ln1)
        else:
            hidden_states, residual = npu_add_rms_norm(hidden_states, residual, self.ln1)
        hidden_states = self.self_attn(hidden_states, attn_metadata)
        hidden_states, residual = npu_add_rms_norm(hidden_states, residual, self.ln2)
        return hidden_states, residual


class Model:
    def __init__(self, device, variant):
        gen = generator(5522)
        self.layers = [DecoderLayer(gen, device, variant) for _ in range(NUM_LAYERS)]
        self.norm = 1 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6)

    def forward(self, inputs_embeds, attn_metadata):
        hidden_states, residual = inputs_embeds, None
        for layer in self.layers:
            hidden_states, residual = layer.forward(hidden_states, residual, attn_metadata)
        hidden_states, _ = npu_add_rms_norm(hidden_states, residual, self.norm)
        return hidden_states @ self.lm_head


class NPUModelRunner:
    def __init__(self, device, variant, graphed):
        self.device, self.variant, self.graphed = device, variant, graphed
        self.model = Model(device, variant)
        self.kv_caches = []
        for layer in self.model.layers:
            layer.impl.key_cache = torch.zeros(NUM_REQS, MAX_SEQ_LEN, NUM_HEADS, HEAD_SIZE, device=device)
            layer.impl.value_cache = torch.zeros(NUM_REQS, MAX_SEQ_LEN, NUM_HEADS, HEAD_SIZE, device=device)
            self.kv_caches += [layer.impl.key_cache, layer.impl.value_cache]
        self.inputs_embeds = torch.zeros(NUM_REQS, HIDDEN, device=device)
        self.positions = torch.zeros(NUM_REQS, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(NUM_REQS, dtype=torch.long, device=device)
        self.attn_metadata = {"positions": self.positions, "seq_lens": self.seq_lens}
        if graphed:
            self.capture_model()

    def capture_model(self):
        set_graph_params([NUM_REQS])
        self.graph_pool = graph_pool_handle(self.device)

        def warmup_then_capture():
            return self.model.forward(self.inputs_embeds, self.attn_metadata)

        static = {"inputs_embeds": self.inputs_embeds, "positions": self.positions, "seq_lens": self.seq_lens}
        state = {f"kv_cache_{i}": t for i, t in enumerate(self.kv_caches)}
        # ACLGraphWrapper.__call__: dummy runs are eager (CUDAGraphMode.NONE), then the capture.
        forward_context.capturing = False
        with events.warmup():
            warmup_then_capture()

        def captured():
            forward_context.capturing = True
            try:
                return warmup_then_capture()
            finally:
                forward_context.capturing = False

        self.graph, self.output = capture(captured, device=self.device, pool=self.graph_pool, warmups=0,
                                          name=f"FULL decode {NUM_REQS}", static=static, state=state,
                                          owner="NPUModelRunner (FULL_DECODE_ONLY ACL graph)")
        if self.variant == "fix":
            weak_ref_workspaces(get_graph_params())
        for cache in self.kv_caches:
            cache.zero_()                    # the dummy runs' KV is not any request's

    def execute_model(self, embeds, positions):
        self.inputs_embeds.copy_(embeds)
        self.positions.copy_(positions)
        self.seq_lens.copy_(positions + 1)
        if self.graphed:
            return replay(self.graph, self.output).clone()
        return self.model.forward(self.inputs_embeds, self.attn_metadata).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(55220)
    steps = [(randn(NUM_REQS, HIDDEN, gen=gen, device=device), torch.full((NUM_REQS,), p, device=device))
             for p in range(MAX_SEQ_LEN)]

    def serve(graphed: bool):
        runner = NPUModelRunner(device, variant, graphed)
        with torch.no_grad():
            return [runner.execute_model(e, p) for e, p in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
