"""flash-attention's decode-graph cache is keyed only by the length bucket: a later, smaller batch is dispatched to the graph captured for an earlier, larger batch.

Upstream: https://github.com/Dao-AILab/flash-attention/commit/311d6606bf82cece56b600f7f500b4c41d88e27d
("[Gen] Fix FT kernel smem size, CG when batch size changed", Tri Dao, 2023-04-20, pushed to main; no PR).
CUDA-graph decoding (``update_graph_cache`` / ``capture_graph``) came in with 7c219154 (2023-01-15).
Symptom: ``model.generate(..., fused_ft_kernel=True, cg=True)`` called again with a smaller batch than an earlier
call (the new tests/models/test_gpt_generation_cg.py runs batch 1, then 3, then 2 and asserts
``torch.equal(logits, logits_cg)`` against ``cg=False``) dies in the first decode step with
``RuntimeError: The size of tensor a (3) must match the size of tensor b (2) at non-singleton dimension 0``
(``cg=False`` is fine).
Mechanism: in flash_attn/utils/generation.py, ``update_graph_cache`` invalidates its ``DecodingCGCache`` only when
the device/dtype change or ``batch_size > cache.max_batch_size`` or ``max_seqlen > cache.max_seqlen``; it then
captures a decode graph per length bucket ``if s_type not in cache.callables`` and ``dispatch(input_ids,
position_ids, seqlen)`` picks ``cache.callables[seqlen_to_seqlen_type(seqlen)]``. Neither the key nor the lookup
holds the batch size. After a batch-3 call, a batch-2 call keeps the cache (KV cache and ``lengths_per_sample``
sized for 3 rows, which the prompt pass fills through ``_update_kv_cache``'s ``batch_start:batch_end`` slice),
finds every bucket already captured and captures nothing. The decode steps go to the batch-3 graph, whose
``run`` copies the new tokens into its own static ``input_ids`` (``[3, 1]``): ``input_ids.copy_(new_input_ids)``
with a ``[2, 1]`` tensor raises (a batch of 1 would broadcast into all 3 rows and hand back 3 rows of logits).
Eager decoding makes a fresh ``InferenceParams`` of the call's own batch size every call.
Doctor: warmup-divergence, at update_graph_cache (each bucket's graph was captured at the batch size of the call
that captured it: its static inputs, kernel grid and logits have that many rows; the cache key cannot tell a call
with another batch size from it, so a smaller batch replays what the capture fixed, while an eager step runs at
its own batch size).
Fix (upstream): ``update_graph_cache`` keys the graphs by ``(batch_size, s_type)`` and ``dispatch`` looks them up
with ``input_ids.shape[0]``, so a smaller batch captures its own graphs against the retained (larger) cache;
``MHA.forward`` / ``ParallelMHA.forward`` pass ``k_cache[batch_start:batch_end]``,
``v_cache[batch_start:batch_end]`` and ``lengths_per_sample[batch_start:batch_end]`` to
``ft_attention.single_query_attention`` instead of the whole cache (whose ``CHECK_SHAPE`` takes the batch size from
``v_cache``). The commit's other change (``cudaFuncSetAttribute`` for FT kernels with >= 48 KB of shared memory)
is not modelled.
Modelled: as the sibling program for 605655bc (whose fix both variants carry here: the capture sets the host
``sequence_len_offset`` and ``lengths_per_sample`` to the bucket's maximum): a 2-layer GPT (word + position
embeddings, pre-LN attention blocks, no MLP, no rotary), float32, 2 heads of dim 8; greedy decoding (no teacher
outputs) of a 4-token prompt, eager (``cg=False``) against graphs (``cg=True``), both with the FT kernel, three
calls as the upstream test: batch 1 / max_length 6, batch 3 / 7, batch 2 / 6. The length buckets 32 / 2048 are
scaled to 8 / 32. The FT kernel is torch ops; the K cache uses the V cache's [b, h, s, d] layout instead of the
packed one. Warmup on a side stream, tensor parallelism and the ``gc.collect()`` after the invalidation are left
out.
"""

import dataclasses
from collections import namedtuple
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Dao-AILab/flash-attention/commit/311d6606bf82cece56b600f7f500b4c41d88e27d"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "update_graph_cache"
SYMPTOM = ("generate(fused_ft_kernel=True, cg=True) with a smaller batch than an earlier call is dispatched to the "
           "earlier batch's decode graph (cache keyed by length bucket only) and fails copying its tokens in")

VOCAB, HIDDEN, NUM_HEADS, NUM_LAYERS = 32, 16, 2, 2
HEAD_DIM = HIDDEN // NUM_HEADS
MAX_POSITIONS = 64
SEQLEN_TYPE_BOUNDS = (8, 32)          # upstream 32, 2048
VARIANT = {"v": "bug"}

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])


def div_up(m: int, n: int) -> int:
    return (m + n - 1) // n


# --- csrc/ft_attention (ft_attention.cpp, decoder_masked_multihead_attention*.{cu,hpp}) ----------------

@dataclasses.dataclass
class Masked_multihead_attention_params:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor
    batch_size: int
    num_heads: int
    memory_max_len: int
    hidden_size_per_head: int
    timestep: int
    rotary_embedding_dim: int
    neox_rotary_style: bool
    inv_sqrt_dh: float
    length_per_sample: Optional[torch.Tensor]


def smem_size_in_bytes(params: Masked_multihead_attention_params) -> int:
    """The dynamic shared memory of one (head, batch) block: the Q*K^T values in float, one per timestep
    (float32 logits reuse the same buffer)."""
    max_timesteps = min(params.timestep, params.memory_max_len)
    qk_sz = div_up(max_timesteps + 1, 4) * 16
    return qk_sz


def masked_multihead_attention_kernel(params: Masked_multihead_attention_params, smem_: torch.Tensor) -> None:
    qk_smem = smem_                                             # [b, h, slots]: extern __shared__ float[]
    b, h, dh = params.batch_size, params.num_heads, params.hidden_size_per_head
    if params.length_per_sample is None:
        tlength = torch.full((b,), params.timestep, dtype=torch.long, device=params.q.device)
    else:
        tlength = params.length_per_sample.long()               # the device lengths
    # Store the current timestep's K and V in the cache, at tlength.
    idx = tlength.view(b, 1, 1, 1).expand(b, h, 1, dh)
    params.k_cache.scatter_(2, idx, params.k.unsqueeze(2))
    params.v_cache.scatter_(2, idx, params.v.unsqueeze(2))
    # qk_smem[ti - first_step] = qk for ti <= tlength: one slot per timestep, as many as the launch gave.
    n = min(qk_smem.shape[-1], params.memory_max_len)
    ti = torch.arange(n, device=params.q.device)
    valid = ti.view(1, 1, n) <= tlength.view(b, 1, 1)
    qk = torch.einsum("bhd,bhtd->bht", params.q, params.k_cache[:, :, :n]) * params.inv_sqrt_dh
    qk_smem[..., :n].copy_(qk.masked_fill(~valid, float("-inf")))
    logits = torch.softmax(qk_smem[..., :n], dim=-1)
    v = torch.where(valid.unsqueeze(-1), params.v_cache[:, :, :n], torch.zeros((), device=params.q.device))
    params.out.copy_(torch.einsum("bht,bhtd->bhd", logits, v))


def masked_multihead_attention(params: Masked_multihead_attention_params) -> None:
    """MMHA_LAUNCH_KERNEL: <<<grid(num_heads, batch_size), threads, smem_sz, stream>>>."""
    smem_sz = smem_size_in_bytes(params)                        # host: a launch parameter
    smem_ = torch.empty(params.batch_size, params.num_heads, smem_sz // 4, dtype=torch.float32,
                        device=params.q.device)
    masked_multihead_attention_kernel(params, smem_)


def single_query_attention(q, k, v, k_cache, v_cache, length_per_sample_, timestep, rotary_embedding_dim=0,
                           neox_rotary_style=True):
    batch_size, nheads, memory_max_seqlen, headdim = v_cache.shape
    assert q.shape == (batch_size, nheads, headdim)
    if length_per_sample_ is not None:
        assert length_per_sample_.shape == (batch_size,) and length_per_sample_.dtype == torch.int32
    out = torch.empty_like(q)
    params = Masked_multihead_attention_params(
        q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, out=out, batch_size=batch_size, num_heads=nheads,
        memory_max_len=memory_max_seqlen, hidden_size_per_head=headdim, timestep=timestep,
        rotary_embedding_dim=rotary_embedding_dim, neox_rotary_style=neox_rotary_style,
        inv_sqrt_dh=1.0 / headdim ** 0.5, length_per_sample=length_per_sample_)
    masked_multihead_attention(params)
    return out


# --- flash_attn/modules/mha.py ------------------------------------------------------------------------

def _update_kv_cache(kv, inference_params, layer_idx):
    """kv: (batch_size, seqlen, 2, nheads, head_dim)"""
    num_heads, head_dim = kv.shape[-2:]
    if layer_idx not in inference_params.key_value_memory_dict:
        kv_cache = torch.empty(inference_params.max_batch_size, inference_params.max_sequence_len, 2,
                               num_heads, head_dim, dtype=kv.dtype, device=kv.device)
        inference_params.key_value_memory_dict[layer_idx] = kv_cache
    else:
        k_cache, v_cache = inference_params.key_value_memory_dict[layer_idx]
        kv_cache = None
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    sequence_start = inference_params.sequence_len_offset
    sequence_end = sequence_start + kv.shape[1]
    assert batch_end <= (kv_cache.shape[0] if kv_cache is not None else v_cache.shape[0])
    assert inference_params.sequence_len_offset == 0
    if kv_cache is not None:
        kv_cache[batch_start:batch_end, sequence_start:sequence_end, ...] = kv
        k_cache = kv_cache[:, :, 0].permute(0, 2, 1, 3).contiguous()        # b h s d
        v_cache = kv_cache[:, :, 1].permute(0, 2, 1, 3).contiguous()
        inference_params.key_value_memory_dict[layer_idx] = (k_cache, v_cache)
    else:
        k_cache[batch_start:batch_end, :, :sequence_end] = kv[:, :, 0].permute(0, 2, 1, 3)
        v_cache[batch_start:batch_end, :, :sequence_end] = kv[:, :, 1].permute(0, 2, 1, 3)
    return kv


class CrossAttention:
    def __call__(self, q, kv, causal):
        k, v = kv.unbind(dim=2)                                             # b s h d
        scores = torch.einsum("bthd,bshd->bhts", q, k) / HEAD_DIM ** 0.5
        if causal:
            s = scores.shape[-1]
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v)


class MHA:
    def __init__(self, gen, device, layer_idx):
        self.layer_idx, self.causal = layer_idx, True
        self.num_heads, self.head_dim, self.rotary_emb_dim = NUM_HEADS, HEAD_DIM, 0
        self.Wqkv = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.6)
        self.out_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4)
        self.inner_cross_attn = CrossAttention()

    def forward(self, x, inference_params):
        b, s, _ = x.shape
        qkv = (x @ self.Wqkv).view(b, s, 3, self.num_heads, self.head_dim)
        if (not inference_params.fused_ft_kernel) or inference_params.sequence_len_offset == 0:
            q = qkv[:, :, 0]
            kv = _update_kv_cache(qkv[:, :, 1:], inference_params, self.layer_idx)
            causal = self.causal if inference_params.sequence_len_offset == 0 else False
            context = self.inner_cross_attn(q, kv, causal=causal)
        else:
            assert inference_params.fused_ft_kernel
            if VARIANT["v"] == "fix":                                   # the live batch's rows of the cache
                batch_start = inference_params.batch_size_offset
                batch_end = batch_start + qkv.shape[0]
                k_cache, v_cache = inference_params.key_value_memory_dict[self.layer_idx]
                lengths_per_sample = (inference_params.lengths_per_sample[batch_start:batch_end]
                                      if inference_params.lengths_per_sample is not None else None)
                context = single_query_attention(
                    *qkv[:, 0].unbind(dim=1),
                    k_cache[batch_start:batch_end], v_cache[batch_start:batch_end],
                    lengths_per_sample, inference_params.sequence_len_offset,
                    self.rotary_emb_dim,
                    True,                                                   # neox_rotary_style
                )
            else:                                                       # the whole cache
                context = single_query_attention(
                    *qkv[:, 0].unbind(dim=1),
                    *inference_params.key_value_memory_dict[self.layer_idx],
                    inference_params.lengths_per_sample, inference_params.sequence_len_offset,
                    self.rotary_emb_dim,
                    True,                                                   # neox_rotary_style
                )
            context = context.unsqueeze(1)
        return context.reshape(b, s, HIDDEN) @ self.out_proj


# --- flash_attn/models/gpt.py -------------------------------------------------------------------------

class GPTLMHeadModel:
    def __init__(self, gen, device):
        self.device = device
        self.word_embeddings = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.position_embeddings = randn(MAX_POSITIONS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.mixers = [MHA(gen, device, layer_idx=i) for i in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def parameters(self):
        return iter([self.word_embeddings])

    def __call__(self, input_ids, position_ids=None, inference_params=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.word_embeddings[input_ids] + self.position_embeddings[position_ids]
        for mixer in self.mixers:
            hidden = hidden + mixer.forward(F.layer_norm(hidden, (HIDDEN,)), inference_params)
        return CausalLMOutput(logits=F.layer_norm(hidden, (HIDDEN,)) @ self.lm_head)


# --- flash_attn/utils/generation.py -------------------------------------------------------------------

@dataclasses.dataclass
class InferenceParams:
    max_sequence_len: int
    max_batch_size: int
    sequence_len_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = dataclasses.field(default_factory=dict)
    fused_ft_kernel: bool = False
    lengths_per_sample: Optional[torch.Tensor] = None


def allocate_kv_cache(max_batch_size, max_seqlen, nheads, headdim, layers, device, dtype=torch.float32):
    shape = (max_batch_size, nheads, max_seqlen, headdim)
    return {i: (torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))
            for i in range(layers)}


def seqlen_to_seqlen_type(seqlen: int) -> int:
    return 0 if seqlen < SEQLEN_TYPE_BOUNDS[0] else (1 if seqlen < SEQLEN_TYPE_BOUNDS[1] else 2)


def seqlen_type_to_max_seqlen(seqlen_type: int) -> int:
    assert seqlen_type in [0, 1, 2]
    return SEQLEN_TYPE_BOUNDS[0] if seqlen_type == 0 else (SEQLEN_TYPE_BOUNDS[1] if seqlen_type == 1 else 2**32)


@dataclasses.dataclass
class DecodingCGCache:
    max_batch_size: int = 0
    max_seqlen: int = 0
    device = None
    dtype = None
    callables: dict = dataclasses.field(default_factory=dict)
    mempool = None
    inference_params: Optional[InferenceParams] = None
    run: Optional[Callable] = None


def update_graph_cache(model, cache, batch_size, seqlen_og, max_seqlen, dtype=torch.float32, n_warmups=2):
    if cache is None:
        cache = DecodingCGCache()
    device = next(iter(model.parameters())).device
    if ((device, dtype) != (cache.device, cache.dtype) or batch_size > cache.max_batch_size
            or max_seqlen > cache.max_seqlen):                       # Invalidate the cache
        cache.callables = {}
        cache.mempool = None
        cache.inference_params = None                                 # (upstream then gc.collect())
        cache.device, cache.dtype = device, dtype
        cache.max_batch_size, cache.max_seqlen = batch_size, max_seqlen
        kv_cache = allocate_kv_cache(batch_size, max_seqlen, NUM_HEADS, HEAD_DIM, NUM_LAYERS, device, dtype)
        lengths_per_sample = torch.full((batch_size,), seqlen_og, dtype=torch.int32, device=device)
        cache.inference_params = InferenceParams(
            max_sequence_len=max_seqlen, max_batch_size=batch_size, sequence_len_offset=seqlen_og,
            key_value_memory_dict=kv_cache, fused_ft_kernel=True, lengths_per_sample=lengths_per_sample)
        cache.mempool = graph_pool_handle(model.device)
    for s_type in range(seqlen_to_seqlen_type(seqlen_og), seqlen_to_seqlen_type(max_seqlen) + 1):
        key = (batch_size, s_type) if VARIANT["v"] == "fix" else s_type
        if key not in cache.callables:
            max_seqlen_ = min(max(seqlen_og, seqlen_type_to_max_seqlen(s_type)), max_seqlen)
            cache.callables[key] = capture_graph(model, cache.inference_params, batch_size, max_seqlen_,
                                                 mempool=cache.mempool, n_warmups=n_warmups)

    def dispatch(input_ids, position_ids, seqlen):
        if VARIANT["v"] == "fix":
            batch_size = input_ids.shape[0]
            return cache.callables[batch_size, seqlen_to_seqlen_type(seqlen)](input_ids, position_ids, seqlen)
        return cache.callables[seqlen_to_seqlen_type(seqlen)](input_ids, position_ids, seqlen)

    cache.run = dispatch
    cache.inference_params.sequence_len_offset = 0                   # Reset so it's not confusing
    return cache


def capture_graph(model, inference_params, batch_size, max_seqlen, mempool=None, n_warmups=2):
    device = next(iter(model.parameters())).device
    input_ids = torch.full((batch_size, 1), 0, dtype=torch.long, device=device)
    position_ids = torch.full((batch_size, 1), 0, dtype=torch.long, device=device)
    sequence_len_offset_og = inference_params.sequence_len_offset
    # TD [2023-04-14]: important for correctness of the FT's attention kernel, as seqlen_cpu is
    # used to determine the size of smem. Hence seqlen_cpu must be >= lengths_per_sample.
    inference_params.sequence_len_offset = max_seqlen - 1
    inference_params.lengths_per_sample[:] = max_seqlen - 1

    def step():
        return model(input_ids, position_ids=position_ids, inference_params=inference_params).logits[:, -1]

    static = {"input_ids": input_ids, "position_ids": position_ids,
              "lengths_per_sample": inference_params.lengths_per_sample}
    state = {f"kv_cache[{i}].{n}": t for i, kv in inference_params.key_value_memory_dict.items()
             for n, t in zip(("k", "v"), kv)}
    graph, logits = capture(step, device=str(device), pool=mempool, warmups=n_warmups,
                            name=f"decode bs={batch_size} <= {max_seqlen}", static=static, state=state,
                            owner="capture_graph")

    def run(new_input_ids, new_position_ids, seqlen):
        inference_params.lengths_per_sample[:] = seqlen
        input_ids.copy_(new_input_ids)
        position_ids.copy_(new_position_ids)
        return replay(graph, logits)

    inference_params.sequence_len_offset = sequence_len_offset_og
    return run


def decode(input_ids, model, max_length, fused_ft_kernel=False, cg=False):
    """Greedy decoding (all sequences of the batch have the same length)."""
    batch_size, seqlen_og = input_ids.shape
    if cg:
        assert fused_ft_kernel
        if not hasattr(model, "_decoding_cache"):
            model._decoding_cache = None
        model._decoding_cache = update_graph_cache(model, model._decoding_cache, batch_size, seqlen_og, max_length)
        inference_params = model._decoding_cache.inference_params
        inference_params.max_sequence_len = max_length
        inference_params.max_batch_size = batch_size
        inference_params.sequence_len_offset = 0
    else:
        inference_params = InferenceParams(max_sequence_len=max_length, max_batch_size=batch_size,
                                           fused_ft_kernel=fused_ft_kernel)
    scores = []
    with torch.inference_mode():
        logits = model(input_ids, inference_params=inference_params).logits[:, -1]
        scores.append(logits if not cg else logits.clone())
        next_token = logits.argmax(dim=-1)
        sequences = [next_token]
        inference_params.sequence_len_offset = seqlen_og
        while True:
            position_ids = torch.full((batch_size, 1), inference_params.sequence_len_offset, dtype=torch.long,
                                      device=input_ids.device)
            if not cg:
                logits = model(next_token.unsqueeze(1), position_ids=position_ids,
                               inference_params=inference_params).logits[:, -1]
            else:
                logits = model._decoding_cache.run(next_token.unsqueeze(1), position_ids,
                                                   inference_params.sequence_len_offset)
            scores.append(logits if not cg else logits.clone())
            next_token = logits.argmax(dim=-1)
            sequences.append(next_token)
            inference_params.sequence_len_offset += 1
            if inference_params.sequence_len_offset >= max_length - 1:
                break
    return torch.cat([input_ids, torch.stack(sequences, dim=1)], dim=1), torch.stack(scores, dim=1)


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(311660)
    model = GPTLMHeadModel(gen, device)
    seqlen = 4
    # As tests/models/test_gpt_generation_cg.py: batch 1, then a larger batch and max_length (the cache is
    # reallocated), then a smaller batch and max_length (the cache is kept); all in the first bucket (< 8).
    calls = [(1, 6), (3, 7), (2, 6)]
    prompts = [torch.randint(0, VOCAB, (batch_size, seqlen), generator=gen).to(device) for batch_size, _ in calls]

    def generate(cg: bool):
        out = []
        with torch.inference_mode():
            for input_ids, (_, max_length) in zip(prompts, calls):
                sequences, scores = decode(input_ids, model, max_length, fused_ft_kernel=True, cg=cg)
                out += [sequences, scores]
        return out

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
