"""flash-attention's CUDA-graph decoding captures each length bucket with the FT attention kernel's shared-memory logits array sized from the prompt-length host ``timestep``; replays at longer lengths lose the keys past it.

Upstream: https://github.com/Dao-AILab/flash-attention/commit/605655bc66bc0fb11ac10dad2e656a97f3729b5b
("[Gen] Fix FT kernel when using CG", Tri Dao, 2023-04-14, pushed to main; no PR). CUDA-graph decoding
(``update_graph_cache`` / ``capture_graph``) came in with 7c219154 (2023-01-15).
Symptom: ``model.generate(..., fused_ft_kernel=True, cg=True)`` (GPT / GPT-J) gives logits that differ from the
``cg=False`` run once the sequence grows past the prompt length the decode graphs were captured at (the new
``test_gptj_generation`` asserts ``torch.equal(logits_cg, logits)``; seqlen 100, max_length 150): wrong scores and
tokens (an overrun past the shared-memory allocation can also fault).
Mechanism: ``MHA.forward`` (flash_attn/modules/mha.py) calls ``ft_attention.single_query_attention(q, k, v, k_cache,
v_cache, inference_params.lengths_per_sample, inference_params.sequence_len_offset, ...)``; the host int becomes
``params.timestep`` (csrc/ft_attention/ft_attention.cpp ``set_params``). The launcher sizes the kernel's dynamic
shared memory from it (``smem_size_in_bytes``: ``max_timesteps = min(params.timestep, params.memory_max_len);
qk_sz = div_up(max_timesteps + 1, 4) * 16``), while the kernel loops over ``tlength = params.length_per_sample[bi]``
(the device lengths) and writes ``qk_smem[ti - first_step]`` for every ``ti <= tlength``. In
flash_attn/utils/generation.py, ``update_graph_cache`` makes ``InferenceParams(sequence_len_offset=seqlen_og, ...)``
and captures one decode graph per length bucket (<32, <2048, >=2048) through ``capture_graph``, which set only
``lengths_per_sample[:] = seqlen_og`` and left the host ``sequence_len_offset`` at the prompt length (the
``sequence_length_offset = 0`` reset was a typo that set a new attribute). The smem size is a launch parameter, so
every bucket's graph keeps the array sized for ``seqlen_og + 1`` logits. The graph's ``run`` then writes the real
length, up to the bucket's end, into ``lengths_per_sample``: the kernel's logits run past the array (into the
logits / reduction scratch, or out of the allocation). Eager decoding passes ``lengths_per_sample=None`` and the live
``sequence_len_offset`` every step, so its array always fits.
Doctor: undersized-buffer, at capture_graph (capture_graph captured each bucket's decode graph with the host
timestep at the prompt length, so the attention kernel's shared-memory logits array is a capture-time size; the
bucket's replays serve sequences with more key positions than that array holds).
Fix (upstream): ``capture_graph(model, inference_params, batch_size, max_seqlen, ...)`` sets
``inference_params.sequence_len_offset = max_seqlen - 1`` and ``lengths_per_sample[:] = max_seqlen - 1`` for the
capture ("seqlen_cpu is used to determine the size of smem. Hence seqlen_cpu must be >= lengths_per_sample") and
restores the offset after; ``update_graph_cache`` passes each bucket's upper bound
(``seqlen_type_to_seqlen`` -> ``seqlen_type_to_max_seqlen``: 32, 2048, 2**32, capped at max_seqlen) and resets
``sequence_len_offset`` (typo fixed).
Modelled: a 2-layer GPT (word + position embeddings, pre-LN attention blocks, no MLP, no rotary), float32, batch 2,
2 heads of dim 8; greedy decoding of a 5-token prompt to max_length 20, eager (``cg=False``) against graphs
(``cg=True``), both with the FT kernel. The length buckets 32 / 2048 are scaled to 8 / 32. The FT kernel is torch
ops: it stores the new K/V at ``tlength`` in the cache, writes the masked QK products of its key positions into the
launch's shared memory (one ``torch.empty`` per launch, sized by ``smem_size_in_bytes``: fixed at capture, as a
launch parameter is), and softmaxes what that array holds. Positions past the array are lost (on the GPU they
overwrite the fp16 logits area or leave the allocation; the model drops them). The reduction / rotary scratch
that ``smem_size_in_bytes`` also takes the max over is left out (at this size it would cover every length), and the
K cache uses the V cache's [b, h, s, d] layout instead of the packed one. The kernel's thread-count choice from the
host timestep, warmup on a side stream, and tensor parallelism are left out.
"""

import dataclasses
from collections import namedtuple
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Dao-AILab/flash-attention/commit/605655bc66bc0fb11ac10dad2e656a97f3729b5b"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "capture_graph"
SYMPTOM = ("generate(fused_ft_kernel=True, cg=True): logits diverge from cg=False once the sequence outgrows the "
           "prompt length the decode graphs were captured at (FT kernel smem sized from the capture-time timestep)")

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
            context = single_query_attention(
                *qkv[:, 0].unbind(dim=1),
                *inference_params.key_value_memory_dict[self.layer_idx],
                inference_params.lengths_per_sample, inference_params.sequence_len_offset,
                self.rotary_emb_dim,
                True,                                                       # neox_rotary_style
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


def seqlen_type_to_seqlen(seqlen_type: int) -> int:                  # before the fix: the bucket's lower bound
    assert seqlen_type in [0, 1, 2]
    return 1 if seqlen_type == 0 else (SEQLEN_TYPE_BOUNDS[0] if seqlen_type == 1 else SEQLEN_TYPE_BOUNDS[1])


def seqlen_type_to_max_seqlen(seqlen_type: int) -> int:              # the fix: the bucket's upper bound
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
        cache.device, cache.dtype = device, dtype
        cache.max_batch_size, cache.max_seqlen = batch_size, max_seqlen
        kv_cache = allocate_kv_cache(batch_size, max_seqlen, NUM_HEADS, HEAD_DIM, NUM_LAYERS, device, dtype)
        lengths_per_sample = torch.full((batch_size,), seqlen_og, dtype=torch.int32, device=device)
        cache.inference_params = InferenceParams(
            max_sequence_len=max_seqlen, max_batch_size=batch_size, sequence_len_offset=seqlen_og,
            key_value_memory_dict=kv_cache, fused_ft_kernel=True, lengths_per_sample=lengths_per_sample)
        cache.mempool = graph_pool_handle(model.device)
    for s_type in range(seqlen_to_seqlen_type(seqlen_og), seqlen_to_seqlen_type(max_seqlen) + 1):
        if s_type not in cache.callables:
            if VARIANT["v"] == "fix":
                max_seqlen_ = min(max(seqlen_og, seqlen_type_to_max_seqlen(s_type)), max_seqlen)
                cache.callables[s_type] = capture_graph(model, cache.inference_params, batch_size, max_seqlen_,
                                                        mempool=cache.mempool, n_warmups=n_warmups)
            else:
                seqlen = min(max(seqlen_og, seqlen_type_to_seqlen(s_type)), max_seqlen)
                cache.callables[s_type] = capture_graph(model, cache.inference_params, batch_size, seqlen_og,
                                                        seqlen, mempool=cache.mempool, n_warmups=n_warmups)

    def dispatch(input_ids, position_ids, seqlen):
        return cache.callables[seqlen_to_seqlen_type(seqlen)](input_ids, position_ids, seqlen)

    cache.run = dispatch
    if VARIANT["v"] == "fix":
        cache.inference_params.sequence_len_offset = 0               # Reset so it's not confusing
    else:
        cache.inference_params.sequence_length_offset = 0            # (typo: a new attribute, nothing reset)
    return cache


def capture_graph(model, inference_params, batch_size, *lengths, mempool=None, n_warmups=2):
    device = next(iter(model.parameters())).device
    input_ids = torch.full((batch_size, 1), 0, dtype=torch.long, device=device)
    position_ids = torch.full((batch_size, 1), 0, dtype=torch.long, device=device)
    if VARIANT["v"] == "fix":
        (max_seqlen,) = lengths
        sequence_len_offset_og = inference_params.sequence_len_offset
        # TD [2023-04-14]: important for correctness of the FT's attention kernel, as seqlen_cpu is
        # used to determine the size of smem. Hence seqlen_cpu must be >= lengths_per_sample.
        inference_params.sequence_len_offset = max_seqlen - 1
        inference_params.lengths_per_sample[:] = max_seqlen - 1
    else:
        seqlen_og, max_seqlen = lengths
        assert max_seqlen >= seqlen_og
        inference_params.lengths_per_sample[:] = seqlen_og           # host sequence_len_offset left as it was

    def step():
        return model(input_ids, position_ids=position_ids, inference_params=inference_params).logits[:, -1]

    static = {"input_ids": input_ids, "position_ids": position_ids,
              "lengths_per_sample": inference_params.lengths_per_sample}
    state = {f"kv_cache[{i}].{n}": t for i, kv in inference_params.key_value_memory_dict.items()
             for n, t in zip(("k", "v"), kv)}
    graph, logits = capture(step, device=str(device), pool=mempool, warmups=n_warmups,
                            name=f"decode <= {max_seqlen}", static=static, state=state, owner="capture_graph")

    def run(new_input_ids, new_position_ids, seqlen):
        inference_params.lengths_per_sample[:] = seqlen
        input_ids.copy_(new_input_ids)
        position_ids.copy_(new_position_ids)
        return replay(graph, logits)

    if VARIANT["v"] == "fix":
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
    gen = generator(605655)
    model = GPTLMHeadModel(gen, device)
    batch_size, seqlen, max_length = 2, 5, 20                  # buckets <8 and 8..31 (upstream <32, <2048)
    input_ids = torch.randint(0, VOCAB, (batch_size, seqlen), generator=gen).to(device)

    def generate(cg: bool):
        with torch.inference_mode():
            sequences, scores = decode(input_ids, model, max_length, fused_ft_kernel=True, cg=cg)
        return [sequences, scores]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
