"""flash-attention's ``decode`` (flash_attn/utils/generation.py, March 2023) with ``cg=True`` appends to ``scores`` the
logits tensor that the decode graph's ``run`` hands back: the graph's own static output buffer, which every later
replay of that graph overwrites. The sampled tokens are right (each is taken from the logits before the next replay),
but ``generate(..., output_scores=True, return_dict_in_generate=True)`` returns, for every decode step served by a
graph, the logits of the last step that graph served. Eager decoding (``cg=False``) gets a fresh logits tensor from
every forward. The fix clones the logits before keeping them when ``cg`` is set.

Upstream: https://github.com/Dao-AILab/flash-attention/commit/f5d0fbd46805155a4406d36e8fb9f9d0324030c4
("[FT] Fix FT's single query attention for bf16 hdim128 rotary", Dao-AILab/flash-attention, Tri Dao, 2023-03-28,
pushed to main; no pull request). The commit is titled for the FT attention kernel; the fix modelled here is its
change to flash_attn/utils/generation.py, the two lines ``scores.append(logits)`` ->
``scores.append(logits if not cg else logits.clone())`` in ``decode``. Read, in a mirror of the repository: the whole
diff of f5d0fbd4 (decoder_masked_multihead_attention_utils.h, modules/mha.py: the ``neox_rotary_style`` argument
passed to ``ft_attention.single_query_attention``; utils/generation.py; tests/models/test_gpt_generation.py: a
whitespace change and an unused import removed). At its parent f5d0fbd4^: utils/generation.py whole
(``InferenceParams``, ``sample``, ``decode``, ``GenerationMixin.generate``, ``allocate_kv_cache``,
``seqlen_to_seqlen_type``, ``seqlen_type_to_seqlen``, ``DecodingCGCache``, ``update_graph_cache``, ``capture_graph``),
modules/mha.py (``_update_kv_cache``, ``MHA.forward``'s ``inference_params`` branches), models/gpt.py
(``GPTModel.forward``, ``GPTLMHeadModel.forward``), csrc/ft_attention/ft_attention.cpp (``single_query_attention``'s
signature and checks); tests/models/test_gpt_generation.py at f5d0fbd4 (``test_greedy_decode_gpt2``: ``out_cg`` is
generated with ``output_scores=True`` but only its sequences are printed; its scores are never compared). Also
read the later history of generation.py: 9f42cb6e (2023-08-27, "[Gen] Clone logits before returning when
cg=True") moved the clone into ``capture_graph``'s ``run`` (``return logits.clone()``).
Not read: the FT kernel sources beyond the diff (decoder_masked_multihead_attention*.cu/.h), GPT2Embeddings, Block,
Mlp and the fused dropout-add-layernorm paths, tensor parallelism; any user report (none found: the commit message
does not mention the scores). Not established: whether anyone was hurt before the fix; the returned ``scores`` are the
only thing wrong.
Symptom: no report. ``model.generate(input_ids, max_length, fused_ft_kernel=True, cg=True,
return_dict_in_generate=True, output_scores=True)`` returns the right ``sequences`` but wrong ``scores``: every
decode step's entry is a view of one graph's static logits and shows the logits of the last step that graph replayed
(with ``cg=False`` every entry is its own step's logits).
Mechanism: ``capture_graph`` captures ``model(input_ids, position_ids, inference_params).logits[:, -1]`` once per
length bucket and its ``run`` copies the new token and position into the graph's static inputs, sets
``lengths_per_sample``, replays and ``return logits``: the captured output tensor itself. ``decode`` keeps that
tensor in ``scores`` and samples the next token from it; the next step replays again (the same graph while the
length stays in its bucket) and writes the new logits into the same memory, so every kept entry changes with it.
``decode`` only reads ``scores`` at the end (``tuple(scores)`` in the output), after the last replay. The prompt's
logits come from an eager forward and are right.
Doctor: overwritten-output, at decode. The graph's output is handed out at each replay and ``decode`` keeps it (the
``scores.append``) past the next replay, which overwrites it; ``decode`` is the function the fix changes (it clones
what it keeps when ``cg`` is set).
Fix (upstream): ``scores.append(logits if not cg else logits.clone())`` for the prompt's logits and for each decode
step's.
Modelled: ``InferenceParams``, ``sample`` (greedy branch), ``decode`` (bug / fix as in the diff),
``GenerationMixin.generate``, ``allocate_kv_cache``, ``seqlen_to_seqlen_type``, ``seqlen_type_to_seqlen``,
``DecodingCGCache``, ``update_graph_cache`` (graphs per length bucket, one memory pool, one ``InferenceParams`` whose
KV cache and ``lengths_per_sample`` all graphs share; ``sequence_length_offset`` reset as upstream spelled it),
``capture_graph`` (warm-ups, capture, ``run``); ``_update_kv_cache``, ``MHA.forward`` (prompt: write the cache and
attend causally; decode with ``fused_ft_kernel``: ``single_query_attention``), ``GPTModel`` / ``GPTLMHeadModel``;
``single_query_attention`` (ft_attention) as a torch stand-in.
Stand-ins: a 2-layer pre-LN GPT in float64 (vocab 32, width 16, 2 heads of 8, GELU MLP of 32, learned positions, no
rotary, no dropout); ``sample`` keeps only its greedy short-circuit (top_k=1); the transformers output class is a
small dataclass. The FT kernel is torch ops: it stores the step's K/V at ``length_per_sample[b]`` (``timestep`` when
no lengths are given) and attends over the cache up to it, always walking the whole cache masked by the lengths;
both caches use the [b, h, s, d] layout (upstream K is packed [b, h, d/x, s, x]). The real kernel at this revision
also sized its shared memory from the host ``timestep``, which the graph froze at the capture's ``seqlen_og`` (the
defect 605655bc fixed on 2023-04-14, round 77's program); the stand-in leaves that out so that the only defect is
the one this commit fixed. The length buckets 32 / 2048 are scaled to 8 / 32. Warm-ups on a side stream,
``gc.collect()`` on invalidation, timing and tensor parallelism are left out; ``vocab_size`` is None (no
slicing).
Workload: as ``test_greedy_decode_gpt2`` with ``fused_ft_kernel=True``: one batch of 2 prompts of 5 tokens, greedy,
``max_length`` 12, ``return_dict_in_generate=True, output_scores=True``; eager = ``cg=False``, served = ``cg=True``
(two decode graphs: bucket 0 serves offsets 5-7, bucket 1 offsets 8-10). Outputs: the sequences and the stacked
scores (7 steps).
Measured: bug: misbehaves (max |graph - eager| = 10.2): the sequences agree with eager; the prompt's scores and
those of offsets 7 and 10 (each graph's last replay) agree, while the entries of offsets 5 and 6 hold offset 7's
logits and those of 8 and 9 hold offset 10's. Fix: equals eager (max |graph - eager| = 0). About 1 s per variant on
the CPU.
"""
from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Dao-AILab/flash-attention/commit/f5d0fbd46805155a4406d36e8fb9f9d0324030c4"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "decode"
SYMPTOM = ("generate(cg=True, output_scores=True) returns right tokens but wrong scores: each decode step's scores "
           "are a view of the decode graph's static logits, which the later replays overwrite")

VOCAB, HIDDEN, NUM_HEADS, NUM_LAYERS, MLP_HIDDEN = 32, 16, 2, 2, 32
HEAD_DIM = HIDDEN // NUM_HEADS
MAX_POSITIONS = 32
SEQLEN_TYPE_BOUNDS = (8, 32)          # upstream 32, 2048
DTYPE = torch.float64
VARIANT = {"v": "bug"}

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])


# --- csrc/ft_attention/ft_attention.cpp (single_query_attention), as torch ops ---------------------------------------

def single_query_attention(q, k, v, k_cache, v_cache, length_per_sample_, timestep, rotary_embedding_dim=0):
    """Attention of one new token per sequence against the cache, storing its K/V at the sequence's length.
    q, k, v: [b, h, d]; k_cache, v_cache: [b, h, s, d] (stand-in layout for both)."""
    batch_size, nheads, memory_max_seqlen, headdim = v_cache.shape
    assert q.shape == (batch_size, nheads, headdim)
    if length_per_sample_ is not None:
        assert length_per_sample_.shape == (batch_size,) and length_per_sample_.dtype == torch.int32
        tlength = length_per_sample_.long()
    else:
        tlength = torch.full((batch_size,), timestep, dtype=torch.long, device=q.device)
    idx = tlength.view(batch_size, 1, 1, 1).expand(batch_size, nheads, 1, headdim)
    k_cache.scatter_(2, idx, k.unsqueeze(2))
    v_cache.scatter_(2, idx, v.unsqueeze(2))
    ti = torch.arange(memory_max_seqlen, device=q.device)
    valid = (ti.view(1, 1, -1) <= tlength.view(batch_size, 1, 1))                     # [b, 1, s]
    qk = torch.einsum("bhd,bhsd->bhs", q, k_cache) / headdim ** 0.5
    probs = torch.softmax(qk.masked_fill(~valid, float("-inf")), dim=-1)
    vals = torch.where(valid.unsqueeze(-1), v_cache, torch.zeros((), dtype=v_cache.dtype, device=q.device))
    return torch.einsum("bhs,bhsd->bhd", probs, vals)


# --- flash_attn/modules/mha.py ---------------------------------------------------------------------------------------

def _update_kv_cache(kv, inference_params, layer_idx):
    """kv: (batch_size, seqlen, 2, nheads, head_dim)"""
    num_heads, head_dim = kv.shape[-2:]
    if layer_idx not in inference_params.key_value_memory_dict:
        kv_cache = torch.empty(inference_params.max_batch_size, inference_params.max_sequence_len, 2,
                               num_heads, head_dim, dtype=kv.dtype, device=kv.device)
        inference_params.key_value_memory_dict[layer_idx] = kv_cache
    else:
        if not inference_params.fused_ft_kernel:
            kv_cache = inference_params.key_value_memory_dict[layer_idx]
        else:
            k_cache, v_cache = inference_params.key_value_memory_dict[layer_idx]
            kv_cache = None
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    sequence_start = inference_params.sequence_len_offset
    sequence_end = sequence_start + kv.shape[1]
    assert batch_end <= (kv_cache.shape[0] if kv_cache is not None else v_cache.shape[0])
    assert sequence_end <= (kv_cache.shape[1] if kv_cache is not None else v_cache.shape[2])
    if not inference_params.fused_ft_kernel:
        kv_cache[batch_start:batch_end, sequence_start:sequence_end, ...] = kv
        return kv_cache[batch_start:batch_end, :sequence_end, ...]
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
    """inner_cross_attn: softmax(q k^T) v, causal for the prompt."""

    def __call__(self, q, kv, causal):
        k, v = kv.unbind(dim=2)                                                 # b s h d
        scores = torch.einsum("bthd,bshd->bhts", q, k) / HEAD_DIM ** 0.5
        if causal:
            t, s = scores.shape[-2:]
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(s - t + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        return torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v)


class MHA:
    def __init__(self, gen, device, layer_idx):
        self.layer_idx, self.causal, self.rotary_emb_dim = layer_idx, True, 0
        self.num_heads, self.head_dim = NUM_HEADS, HEAD_DIM
        self.Wqkv = randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.out_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.inner_cross_attn = CrossAttention()

    def forward(self, x, inference_params):
        b, s, _ = x.shape
        qkv = (x @ self.Wqkv).view(b, s, 3, self.num_heads, self.head_dim)
        if (not inference_params.fused_ft_kernel) or inference_params.sequence_len_offset == 0:
            q = qkv[:, :, 0]
            kv = _update_kv_cache(qkv[:, :, 1:], inference_params, self.layer_idx)
            # If we're processing the prompt, causal=None (use self.causal). If we're decoding, causal=False.
            causal = self.causal if inference_params.sequence_len_offset == 0 else False
            context = self.inner_cross_attn(q, kv, causal=causal)
        else:
            assert inference_params.fused_ft_kernel
            context = single_query_attention(
                *qkv[:, 0].unbind(dim=1),
                *inference_params.key_value_memory_dict[self.layer_idx],
                inference_params.lengths_per_sample, inference_params.sequence_len_offset,
                self.rotary_emb_dim,
            ).unsqueeze(1)
        return context.reshape(b, s, HIDDEN) @ self.out_proj


class Mlp:
    def __init__(self, gen, device):
        self.fc1 = randn(HIDDEN, MLP_HIDDEN, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.fc2 = randn(MLP_HIDDEN, HIDDEN, gen=gen, device=device, scale=0.3).to(DTYPE)

    def forward(self, x):
        return F.gelu(x @ self.fc1) @ self.fc2


# --- flash_attn/models/gpt.py ----------------------------------------------------------------------------------------

class GPTModel:
    def __init__(self, gen, device):
        self.word_embeddings = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.position_embeddings = randn(MAX_POSITIONS, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.mixers = [MHA(gen, device, layer_idx=i) for i in range(NUM_LAYERS)]
        self.mlps = [Mlp(gen, device) for _ in range(NUM_LAYERS)]

    def forward(self, input_ids, position_ids=None, inference_params=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden_states = self.word_embeddings[input_ids] + self.position_embeddings[position_ids]
        for mixer, mlp in zip(self.mixers, self.mlps):                   # prenorm blocks
            hidden_states = hidden_states + mixer.forward(F.layer_norm(hidden_states, (HIDDEN,)), inference_params)
            hidden_states = hidden_states + mlp.forward(F.layer_norm(hidden_states, (HIDDEN,)))
        return F.layer_norm(hidden_states, (HIDDEN,))                      # ln_f


# --- flash_attn/utils/generation.py ----------------------------------------------------------------------------------

@dataclasses.dataclass
class InferenceParams:
    """Inference parameters that are passed to the main model in order to efficiently calculate and store the
    context during inference."""
    max_sequence_len: int
    max_batch_size: int
    sequence_len_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = dataclasses.field(default_factory=dict)
    fused_ft_kernel: bool = False
    lengths_per_sample: Optional[torch.Tensor] = None


@dataclasses.dataclass
class GreedySearchDecoderOnlyOutput:          # transformers.generation's output class (stand-in)
    sequences: torch.Tensor
    scores: Optional[tuple] = None


def sample(logits, top_k=1, top_p=0.0, temperature=1.0):
    """Sample from top-k logits (only the greedy short-circuit is modelled)."""
    if top_k == 1:  # Short-circuit for greedy decoding
        return logits.argmax(dim=-1)
    raise NotImplementedError("only greedy decoding is modelled")


def decode(input_ids, model, max_length, top_k=1, top_p=0.0, temperature=1.0, eos_token_id=None,
           vocab_size=None, fused_ft_kernel=False, cg=False):
    """Decoding, greedy here. Returns GreedySearchDecoderOnlyOutput with sequences (batch, max_length) and
    scores: tuple of (batch, vocab_size)."""
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
    fix = VARIANT["v"] == "fix"
    scores = []
    with torch.inference_mode():
        logits = model(input_ids, inference_params=inference_params).logits[:, -1]
        if vocab_size is not None:
            logits = logits[..., :vocab_size]
        scores.append(logits if not (cg and fix) else logits.clone())
        next_token = sample(logits, top_k=top_k, top_p=top_p, temperature=temperature)
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
            if vocab_size is not None:
                logits = logits[..., :vocab_size]
            if fix:
                scores.append(logits if not cg else logits.clone())
            else:
                scores.append(logits)                   # under cg: the graph's static logits, replayed over later
            next_token = sample(logits, top_k=top_k, temperature=temperature)
            sequences.append(next_token)
            inference_params.sequence_len_offset += 1
            if eos_token_id is not None and (next_token == eos_token_id).all():
                break
            if inference_params.sequence_len_offset >= max_length - 1:
                break
    return GreedySearchDecoderOnlyOutput(
        sequences=torch.cat([input_ids, torch.stack(sequences, dim=1)], dim=1), scores=tuple(scores))


class GenerationMixin:
    def generate(self, input_ids, max_length, top_k=1, top_p=0.0, temperature=1.0,
                 return_dict_in_generate=False, output_scores=False, **kwargs):
        output = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p, temperature=temperature, **kwargs)
        if not output_scores:
            output.scores = None
        return output if return_dict_in_generate else output.sequences


class GPTLMHeadModel(GenerationMixin):
    def __init__(self, gen, device):
        self.device = device
        self.transformer = GPTModel(gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.6).to(DTYPE)

    def parameters(self):
        return iter([self.lm_head])

    def __call__(self, input_ids, position_ids=None, inference_params=None):
        hidden_states = self.transformer.forward(input_ids, position_ids=position_ids,
                                                 inference_params=inference_params)
        return CausalLMOutput(logits=hidden_states @ self.lm_head)


def allocate_kv_cache(max_batch_size, max_seqlen, nheads, headdim, layers, device, dtype=DTYPE):
    shape = (max_batch_size, nheads, max_seqlen, headdim)             # stand-in: V's layout for K too
    return {i: (torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))
            for i in range(layers)}


def seqlen_to_seqlen_type(seqlen: int) -> int:
    """Convert sequence length to a seqlen_type. This is used to determine which cuda graph to use."""
    return 0 if seqlen < SEQLEN_TYPE_BOUNDS[0] else (1 if seqlen < SEQLEN_TYPE_BOUNDS[1] else 2)


def seqlen_type_to_seqlen(seqlen_type: int) -> int:
    assert seqlen_type in [0, 1, 2]
    return 1 if seqlen_type == 0 else (SEQLEN_TYPE_BOUNDS[0] if seqlen_type == 1 else SEQLEN_TYPE_BOUNDS[1])


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


@torch.inference_mode()
def update_graph_cache(model, cache, batch_size, seqlen_og, max_seqlen, dtype=None, n_warmups=2):
    if cache is None:
        cache = DecodingCGCache()
    param_example = next(iter(model.parameters()))
    device = param_example.device
    if dtype is None:
        dtype = param_example.dtype
    if ((device, dtype) != (cache.device, cache.dtype) or batch_size > cache.max_batch_size
            or max_seqlen > cache.max_seqlen):  # Invalidate the cache
        cache.callables = {}
        cache.mempool = None
        cache.inference_params = None
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
            seqlen = min(max(seqlen_og, seqlen_type_to_seqlen(s_type)), max_seqlen)
            cache.callables[s_type] = capture_graph(model, cache.inference_params, batch_size, seqlen_og, seqlen,
                                                    mempool=cache.mempool, n_warmups=n_warmups)

    def dispatch(input_ids, position_ids, seqlen):
        return cache.callables[seqlen_to_seqlen_type(seqlen)](input_ids, position_ids, seqlen)

    cache.run = dispatch
    cache.inference_params.sequence_length_offset = 0  # Reset so it's not confusing (sic: upstream's spelling)
    return cache


def capture_graph(model, inference_params, batch_size, seqlen_og, max_seqlen, mempool=None, n_warmups=2):
    assert max_seqlen >= seqlen_og
    device = next(iter(model.parameters())).device
    input_ids = torch.full((batch_size, 1), 0, dtype=torch.long, device=device)
    position_ids = torch.full((batch_size, 1), 0, dtype=torch.long, device=device)
    inference_params.lengths_per_sample[:] = seqlen_og

    def step():
        return model(input_ids, position_ids=position_ids, inference_params=inference_params).logits[:, -1]

    static = {"input_ids": input_ids, "position_ids": position_ids,
              "lengths_per_sample": inference_params.lengths_per_sample}
    state = {f"kv_cache[{i}].{n}": t for i, kv in inference_params.key_value_memory_dict.items()
             for n, t in zip(("k", "v"), kv)}
    # Warmup before capture (upstream: on a side stream), then capture into the shared pool.
    graph, logits = capture(step, device=str(device), pool=mempool, warmups=n_warmups,
                            name=f"decode bs={batch_size} <= {max_seqlen}", static=static, state=state,
                            owner="capture_graph")

    def run(new_input_ids, new_position_ids, seqlen):
        inference_params.lengths_per_sample[:] = seqlen
        input_ids.copy_(new_input_ids)
        position_ids.copy_(new_position_ids)
        return replay(graph, logits)                   # graph.replay(); return logits

    return run


# --- the workload: tests/models/test_gpt_generation.py::test_greedy_decode_gpt2 with fused_ft_kernel=True -----------

def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    gen = generator(5032823)
    weights_seed = 328
    input_ids = torch.randint(0, VOCAB, (2, 5), generator=gen).to(device)
    max_length = 12

    def generate(cg: bool):
        model = GPTLMHeadModel(generator(weights_seed), device)
        out = model.generate(input_ids=input_ids, max_length=max_length, fused_ft_kernel=True, cg=cg,
                             return_dict_in_generate=True, output_scores=True)
        return [out.sequences.to(DTYPE), torch.stack(out.scores, dim=1)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
