"""Dynamic-NTK rotary embedding branches on the device ``seq_len`` inside the captured decode: a host sync in capture.

Upstream: https://github.com/InternLM/lmdeploy/commit/93d374683dbdf63bf06bf8a1c98da089605e955c ("fix dynamic ntk
cudagraph", 2024-08-05; landed in the squashed https://github.com/InternLM/lmdeploy/pull/2104 "Refactor pytorch
engine").
Symptom: with a dynamic-NTK model (e.g. InternLM2 with ``rope_scaling: dynamic``) and CUDA graphs on, capturing the
decode graph fails ("operation not permitted when stream is capturing"); eager decoding works.
Mechanism: ``LlamaDynamicNTKScalingRotaryEmbedding.forward`` (``backends/default/rotary_embedding.py``) runs inside
the decode forward that ``CUDAGraphRunner`` captures. It computes ``seq_len = torch.max(position_ids) + 1`` on the
device and then takes a Python branch ``if seq_len > self.max_position_embeddings:`` whose body rebuilds
``inv_freq`` and ``register_buffer``s it. Evaluating that ``if`` calls ``Tensor.__bool__`` on a device tensor: a
copy to the host and a stream synchronisation. The runner's eager warmup does this legally; the capture that follows
hits the synchronisation on a capturing stream and aborts, so no decode graph of the model can be made. (Had it been
allowed, the branch and the rebound buffer would have been frozen at the capture-time positions.)
Miniature: one InternLM2 attention layer, per-sequence KV cache, ``max_position_embeddings = 8``; prompts are
prefilled eagerly token by token, then decode steps (positions 5..10) go through a graph captured lazily on the
first decode step, as ``CUDASingleGraphRunner.capture`` does (warmup = the real step, then the capture).
Doctor: sync-in-capture, at forward (``if seq_len > self.max_position_embeddings`` reads the device ``seq_len`` on the
host while the stream is capturing).
Fix (upstream): split out ``_rotary_embedding_fwd(position_ids, inv_freq, ...)``, add ``_ntk_inv_freq(seq_len)``
computing the NTK frequencies on the device, and pick ``inv_freq = torch.where(seq_len > max_position_embeddings,
ntk_inv_freq, self.inv_freq)``: no Python branch, no sync, no ``register_buffer``; each replay chooses on the device.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/commit/93d374683dbdf63bf06bf8a1c98da089605e955c"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = "capturing the decode graph of a dynamic-NTK model fails: `if seq_len > max_position_embeddings` syncs"

VOCAB, HIDDEN, HEAD_DIM = 16, 8, 8
MAX_POSITION_EMBEDDINGS, SCALING_FACTOR, ROPE_BASE = 8, 2.0, 10000
BATCH, MAX_LEN = 2, 16
PROMPTS = ([3, 9, 1, 14, 6, 2], [7, 5, 12, 0, 11, 4])
DECODE_STEPS = 6                 # positions 5..10: seq_len grows past max_position_embeddings at step 3


def _rotary_embedding_fwd(position_ids, inv_freq, scaling_factor, dtype):
    """rotary embedding forward (cos/sin for ``position_ids`` of shape [1, tokens])."""
    position_ids = position_ids.float() / scaling_factor
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :]
    freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
    emb = freqs.repeat(1, 1, 2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaDynamicNTKScalingRotaryEmbedding(torch.nn.Module):
    """LlamaRotaryEmbedding extended with Dynamic NTK scaling."""

    def __init__(self, dim, base, scaling_factor, max_position_embeddings, variant):
        super().__init__()
        self.dim, self.base, self.scaling_factor = dim, base, scaling_factor
        self.max_position_embeddings = max_position_embeddings
        self.variant = variant
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _ntk_inv_freq(self, seq_len):
        device = seq_len.device
        base = self.base * ((self.scaling_factor * seq_len / self.max_position_embeddings)
                            - (self.scaling_factor - 1)) ** (self.dim / (self.dim - 2))
        return 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim))

    def forward(self, x, position_ids):
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        seq_len = torch.max(position_ids) + 1
        if self.variant == "bug":
            if seq_len > self.max_position_embeddings:          # Tensor.__bool__: a device-to-host sync
                base = self.base * ((self.scaling_factor * seq_len / self.max_position_embeddings)
                                    - (self.scaling_factor - 1)) ** (self.dim / (self.dim - 2))
                inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float().to(x.device)
                                           / self.dim))
                self.register_buffer("inv_freq", inv_freq, persistent=False)
            return _rotary_embedding_fwd(position_ids, self.inv_freq, self.scaling_factor, x.dtype)
        ntk_inv_freq = self._ntk_inv_freq(seq_len)
        inv_freq = torch.where(seq_len > self.max_position_embeddings, ntk_inv_freq, self.inv_freq)
        return _rotary_embedding_fwd(position_ids, inv_freq, self.scaling_factor, x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class InternLM2ForCausalLM(torch.nn.Module):
    """One decoder layer: embedding, wqkv, rotary, attention over the per-sequence KV cache, wo, lm head."""

    def __init__(self, device, variant):
        super().__init__()
        gen = generator(93)
        self.tok_embeddings = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wqkv = randn(HIDDEN, 3 * HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.wo = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.6)
        self.output = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.rotary_emb = LlamaDynamicNTKScalingRotaryEmbedding(
            HEAD_DIM, ROPE_BASE, SCALING_FACTOR, MAX_POSITION_EMBEDDINGS, variant).to(device)

    def forward(self, input_ids, position_ids, past_key_values, kv_seqlens):
        """Decoding: one token per sequence; input_ids/position_ids are [1, BATCH] (packed)."""
        k_cache, v_cache = past_key_values
        x = self.tok_embeddings[input_ids[0]]
        q, k, v = (x @ self.wqkv).split(HEAD_DIM, dim=-1)
        cos, sin = self.rotary_emb(x, position_ids)
        cos, sin = cos[0], sin[0]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rows = torch.arange(BATCH, device=x.device)
        k_cache.index_put_((rows, position_ids[0]), k)
        v_cache.index_put_((rows, position_ids[0]), v)
        visible = torch.arange(MAX_LEN, device=x.device)[None, :] < kv_seqlens[:, None]
        scores = torch.einsum("bd,btd->bt", q, k_cache).masked_fill(~visible, -1e9) / HEAD_DIM ** 0.5
        attn = torch.einsum("bt,btd->bd", torch.softmax(scores, -1), v_cache)
        return (x + attn @ self.wo) @ self.output


class CUDASingleGraphRunner:
    """Captures on the first decode step of its batch size (warmup = that real step), then replays."""

    def __init__(self, model, device, past_key_values):
        self.model, self.device, self.past_key_values = model, device, past_key_values
        self.pool = graph_pool_handle(device)
        self.input_buffers = {"input_ids": torch.zeros(1, BATCH, dtype=torch.int64, device=device),
                              "position_ids": torch.zeros(1, BATCH, dtype=torch.int64, device=device),
                              "kv_seqlens": torch.zeros(BATCH, dtype=torch.int64, device=device)}
        self._graph, self.output_buffers = None, None

    def fill_buffers_cudagraph(self, input_ids, position_ids, kv_seqlens):
        self.input_buffers["input_ids"].copy_(input_ids)
        self.input_buffers["position_ids"].copy_(position_ids)
        self.input_buffers["kv_seqlens"].copy_(kv_seqlens)
        b = self.input_buffers
        return lambda: self.model(b["input_ids"], b["position_ids"], self.past_key_values, b["kv_seqlens"])

    def capture(self, **kwargs):
        fwd = self.fill_buffers_cudagraph(**kwargs)
        events.static_buffers("CUDAGraphRunner input_buffers", self.input_buffers)
        events.persistent_state("past_key_values", dict(zip(("k_cache", "v_cache"), self.past_key_values)))
        with events.warmup(real=True):
            warmup_output = fwd()
        self._graph = new_graph(self.device)
        with graph(self._graph, self.pool, name=f"decode batch={BATCH}"):
            self.output_buffers = fwd()
        return warmup_output

    def forward(self, **kwargs):
        self.fill_buffers_cudagraph(**kwargs)
        return replay(self._graph, self.output_buffers)


def run(variant: str, device: str = "cpu"):
    model = InternLM2ForCausalLM(device, variant)

    def serve(graphed: bool):
        model.rotary_emb.inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, HEAD_DIM, 2, device=device).float()
                                                         / HEAD_DIM))
        past_key_values = (torch.zeros(BATCH, MAX_LEN, HEAD_DIM, device=device),
                           torch.zeros(BATCH, MAX_LEN, HEAD_DIM, device=device))
        runner = CUDASingleGraphRunner(model, device, past_key_values)
        for pos in range(len(PROMPTS[0]) - 1):                # eager prefill, token by token
            ids = torch.tensor([[p[pos] for p in PROMPTS]], device=device)
            model(ids, torch.full((1, BATCH), pos, device=device), past_key_values,
                  torch.full((BATCH,), pos + 1, device=device))
        tokens, pos, outs = [p[-1] for p in PROMPTS], len(PROMPTS[0]) - 1, []
        for step in range(DECODE_STEPS):
            inputs = {"input_ids": torch.tensor([tokens], device=device),
                      "position_ids": torch.full((1, BATCH), pos, device=device),
                      "kv_seqlens": torch.full((BATCH,), pos + 1, device=device)}
            if not graphed:
                logits = model(inputs["input_ids"], inputs["position_ids"], past_key_values, inputs["kv_seqlens"])
            elif step == 0:
                logits = runner.capture(**inputs)
            else:
                logits = runner.forward(**inputs).clone()
            outs.append(logits)
            tokens, pos = logits.argmax(-1).tolist(), pos + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
