"""The FP8-KV attention backend asserts ``layer._q_scale == 1.0`` on a device tensor inside the captured region: capture fails.

Upstream: https://github.com/vllm-project/vllm/pull/22758 ("fp8 kv cache support fix for torch.compile"), merged
2025-08.
Symptom: "Torch compile was erroring in attention layer on assert for q_scale to be equals 1.0. The error came
originally from HIP saying that operation is not allowed during cuda graph capture" (ROCm, ``kv_cache_dtype="fp8"``,
CUDA graphs on); ``--enforce-eager`` serves fine.
Mechanism: the ``Attention`` layer keeps its FP8 scales as device tensors (``_q_scale``, ``_k_scale``, ``_v_scale``)
and, for K and V only, host copies (``_k_scale_float``, ``_v_scale_float``) that ``BaseKVCacheMethod.
process_weights_after_loading`` sets next to ``layer._k_scale.copy_(k_scale)``. ``TritonAttentionImpl.forward``
runs inside the captured decode graph (full CUDA graphs of the attention backend): it writes the new K/V into the
paged cache (``reshape_and_cache_flash``, scaled by ``_k_scale``/``_v_scale``), then, for an fp8 cache, views the
cache as fp8 and checks ``assert layer._q_scale == 1.0, "A non 1.0 q_scale is not currently supported."``. The
comparison is a device kernel; ``assert`` then calls ``bool()`` on its one-element device result, a device-to-host
copy and a stream synchronisation. Eagerly (warmup, ``--enforce-eager``) it passes, the scale is 1.0; during the
stream capture the synchronisation is refused ("operation not permitted when stream is capturing"), the capture is
invalidated and the engine fails at start-up.
Doctor: sync-in-capture, at ``forward`` (``TritonAttentionImpl.forward``: the assert's ``bool()`` of the device
tensor ``layer._q_scale == 1.0`` inside the capture).
Fix (upstream): ``process_weights_after_loading`` also sets ``layer._q_scale_float = q_scale`` (a Python float,
``.item()`` at load time when the checkpoint gives a tensor, as the review asked), and the backends assert
``layer._q_scale_float == 1.0``: a host comparison, no device access inside the capture. (Read: PR description and
the ``kv_cache.py`` hunk of the diff; pre-fix ``v1/attention/backends/triton_attn.py`` and the post-fix asserts in
later backends; the backend hunks themselves were not in the stored snapshot.)
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/22758"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = "CUDA graph capture fails: assert on the device tensor layer._q_scale == 1.0 synchronises the capturing stream"

VOCAB, HIDDEN, NUM_HEADS, HEAD_SIZE, MAX_LEN, BATCH, STEPS = 16, 8, 2, 4, 8, 2, 5


class Attention:
    """``vllm.attention.layer.Attention`` in miniature: the scales and the layer's paged KV cache."""

    def __init__(self, impl, device, k_scale: float, v_scale: float):
        self.impl, self.kv_cache_dtype = impl, impl.kv_cache_dtype
        self.q_scale, self.k_scale, self.v_scale = -1.0, k_scale, v_scale      # checkpoint: no q scale
        one = lambda: torch.tensor(1.0, device=device)  # noqa: E731
        self._q_scale, self._k_scale, self._v_scale = one(), one(), one()
        self._k_scale_float = self._v_scale_float = 1.0
        # [2, num_blocks * block_size, num_kv_heads, head_size]: one block of MAX_LEN slots per request
        self.kv_cache = torch.zeros(2, BATCH * MAX_LEN, NUM_HEADS, HEAD_SIZE, device=device)


class BaseKVCacheMethod:
    def __init__(self, variant: str):
        self.variant = variant

    def process_weights_after_loading(self, layer: Attention) -> None:
        k_scale, v_scale = layer.k_scale, layer.v_scale
        # These are used in the final Attention.forward()
        layer._k_scale.fill_(k_scale)
        layer._v_scale.fill_(v_scale)
        layer._k_scale_float, layer._v_scale_float = float(k_scale), float(v_scale)
        q_scale = layer.q_scale if layer.q_scale > 0.0 else 1.0
        layer._q_scale.fill_(q_scale)
        if self.variant == "fix":                                   # + layer._q_scale_float = q_scale
            layer._q_scale_float = q_scale.item() if isinstance(q_scale, torch.Tensor) else float(q_scale)


@dataclasses.dataclass
class FlashAttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens]
    seq_lens: torch.Tensor          # [num_seqs]


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    key_cache.index_copy_(0, slot_mapping, key / k_scale)           # stored scaled (fp8 in the real cache)
    value_cache.index_copy_(0, slot_mapping, value / v_scale)


def unified_attention(q, k, v, out, seqused_k, softmax_scale, k_descale, v_descale):
    keys = k.view(BATCH, MAX_LEN, NUM_HEADS, HEAD_SIZE) * k_descale[:, None, :, None]
    values = v.view(BATCH, MAX_LEN, NUM_HEADS, HEAD_SIZE) * v_descale[:, None, :, None]
    scores = torch.einsum("bhd,bthd->bht", q, keys) * softmax_scale
    masked = torch.arange(MAX_LEN, device=q.device)[None, None, :] >= seqused_k[:, None, None]
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), -1)
    out.copy_(torch.einsum("bht,bthd->bhd", probs, values))


class TritonAttentionImpl:
    def __init__(self, variant: str):
        self.variant, self.kv_cache_dtype, self.scale = variant, "fp8", HEAD_SIZE ** -0.5

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping,
                                self.kv_cache_dtype, layer._k_scale, layer._v_scale)
        if self.kv_cache_dtype.startswith("fp8"):
            # (key_cache.view(self.fp8_dtype): the miniature keeps the scaled values in float32)
            if self.variant == "bug":
                assert layer._q_scale == 1.0, "A non 1.0 q_scale is not currently supported."
            else:
                assert layer._q_scale_float == 1.0, "A non 1.0 q_scale is not currently supported."
        descale_shape = (attn_metadata.seq_lens.shape[0], NUM_HEADS)
        unified_attention(query, key_cache, value_cache, output, attn_metadata.seq_lens, self.scale,
                          layer._k_scale.expand(descale_shape), layer._v_scale.expand(descale_shape))
        return output


class LlamaForCausalLM:
    def __init__(self, variant: str, device):
        gen = generator(22758)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.qkv_proj = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.5)
        self.o_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.attn = Attention(TritonAttentionImpl(variant), device, k_scale=0.5, v_scale=0.25)
        BaseKVCacheMethod(variant).process_weights_after_loading(self.attn)
        self.attn_out = torch.zeros(BATCH, NUM_HEADS, HEAD_SIZE, device=device)

    def model_step(self, input_ids, attn_metadata):
        x = self.embed[input_ids]
        q, k, v = (x @ self.qkv_proj).view(BATCH, 3, NUM_HEADS, HEAD_SIZE).unbind(1)
        # unified_attention_with_output -> impl.forward
        self.attn.impl.forward(self.attn, q, k, v, self.attn.kv_cache, attn_metadata, self.attn_out)
        h = x + self.attn_out.reshape(BATCH, HIDDEN) @ self.o_proj
        return h @ self.lm_head


class GPUModelRunner:
    def __init__(self, variant: str, device, use_cuda_graph: bool):
        self.model, self.use_cuda_graph, self.graph = LlamaForCausalLM(variant, device), use_cuda_graph, None
        self.input_ids = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(BATCH, dtype=torch.long, device=device)
        self.attn_metadata = FlashAttentionMetadata(self.slot_mapping, self.seq_lens)
        self.block_start = torch.arange(BATCH, device=device) * MAX_LEN

    def _prepare_inputs(self, token_ids, positions):
        self.input_ids.copy_(token_ids)
        self.slot_mapping.copy_(self.block_start + positions)
        self.seq_lens.copy_(positions + 1)

    def capture_model(self):
        self._prepare_inputs(torch.zeros_like(self.input_ids), torch.zeros_like(self.seq_lens))   # dummy run
        self.graph, self.logits = capture(
            lambda: self.model.model_step(self.input_ids, self.attn_metadata), device=self.input_ids.device.type,
            name=f"FULL size {BATCH}", owner="vLLM CUDAGraphWrapper (FULL)",
            static={"input_ids": self.input_ids, "slot_mapping": self.slot_mapping, "seq_lens": self.seq_lens},
            state={"kv_cache": self.model.attn.kv_cache})

    def execute_model(self, token_ids, positions):
        self._prepare_inputs(token_ids, positions)
        if self.use_cuda_graph:
            return replay(self.graph, self.logits).clone()
        return self.model.model_step(self.input_ids, self.attn_metadata).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(2275)
    prompt = torch.randint(0, VOCAB, (BATCH,), generator=gen).to(device)

    def serve(use_cuda_graph: bool):
        runner = GPUModelRunner(variant, device, use_cuda_graph)
        if use_cuda_graph:
            runner.capture_model()                                   # at engine start-up
        runner.model.attn.kv_cache.zero_()
        tokens, outs = prompt, []
        for step in range(STEPS):
            positions = torch.full((BATCH,), step, dtype=torch.long, device=device)
            logits = runner.execute_model(tokens, positions)
            outs.append(logits)
            tokens = logits.argmax(-1)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
