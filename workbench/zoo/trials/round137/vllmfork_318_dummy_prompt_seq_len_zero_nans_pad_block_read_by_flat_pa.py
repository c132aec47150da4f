"""Habana vLLM fork (HPU graphs): the runner pads every batch up to its bucket (the shapes the HPU graphs were captured
for) with dummy sequences made by ``create_dummy_seq_group_metadata(0, 0, is_prompt)``, i.e. of length 0. A dummy
prompt of length 0 gets an attention bias that masks every key, so its prompt-attention rows are softmax over nothing,
0/0 = NaN; from the second layer on its K/V are NaN, and the step writes them to ``_PAD_SLOT_ID``, slot 0 of block 0,
the padding block. A later decode graph's block list is padded to its block bucket with that same block 0; ``flat_pa``
masks padded block entries with a -inf bias, but NaN + -inf is NaN, and ``block_softmax`` subtracts one global maximum
over all blocks of the batch, so every request of the decode step gets NaN logits. The fix gives dummy sequences at
least one token (``seq_len = max(seq_len, 1)``), so their attention has a key and stays finite.

Upstream: https://github.com/HabanaAI/vllm-fork/pull/318 ("Fix seq_len for padding sequences", HabanaAI/vllm-fork,
label habana, by Michal Adamczyk, merged 2024-09-23 into habana_main as aa507d41ffc1900ba3420b6574b14ebc8d63c031; its
parent is 63fae5106, #313, which had reserved block 0 for padding the same morning). Read in a mirror of the fork with
``git show``: the whole diff (``vllm/worker/habana_model_runner.py``, ``create_dummy_seq_group_metadata``: one line,
``seq_len = max(seq_len, 1)`` after ``num_blocks`` is computed) and the PR description; at the parent 63fae5106:
``habana_model_runner.py`` (``_PAD_SLOT_ID``/``_PAD_BLOCK_ID``, ``warmup_range``, ``next_pow2``, ``find_bucket``,
``pad_list``, ``HpuModelAdapter._set_attn_bias``/``_set_block_mapping``/``forward``, ``_setup_buckets``,
``_use_graphs``, ``_prepare_prompt``, ``_prepare_decode``, ``prepare_input_tensors``, ``_seq_len``,
``trim_attn_metadata``, ``create_dummy_seq_group_metadata``, ``warmup_scenario``, ``warmup_graphs``,
``execute_model``), ``vllm/attention/backends/habana_attn.py`` (``HabanaAttentionImpl.forward``: cache write, then
``ops.prompt_attention`` or ``HabanaPagedAttention.forward_decode``), ``vllm/attention/ops/habana_paged_attn.py``
(``forward_decode`` is ``ops.flat_pa``), ``requirements-hpu.txt`` (pins vllm-hpu-extension 30ee2d1); the #313 diff
(``CpuGpuBlockAllocator.create`` and ``UncachedBlockAllocator`` start block ids at 1 on HPU); and, in a mirror of
HabanaAI/vllm-hpu-extension at 30ee2d1: ``ops.py`` (``batch2block``, ``block2batch``, ``block_softmax`` with its
global ``amax``, ``flat_pa``, ``prompt_attention``), ``cache_ops.py`` (``prepare_to_cache``,
``insert_or_update_cache``) and ``utils.py`` (``VLLMKVCache``).
Not read: Habana's ``wrap_in_hpu_graph`` / HPU graph internals (input hashing and copy-in are modelled as a capture per
bucket with a copy into static inputs), the HPU ``index_put_`` semantics for repeated indices (here all writes to slot
0 in one step carry the same values, so the order does not matter), ``SamplingMetadata``, the block managers beyond
the #313 diff, and any user report (none is linked; the PR description is the only account).
Symptom: the PR description: "Before the fix we used seq_len=0 for padding samples. This was later translated to an
empty attention_mask (since we don't have any tokens that we should include in calculations) and in turn caused NaNs
in prompt attention (0 divided by 0). Those NaNs later got propagated to kv-cache causing issues in flat_pa."
Mechanism: ``prepare_input_tensors`` pads a prompt batch of 3 to the bs-4 bucket with a dummy prompt of length 0
(``block_tables`` None, so every slot of it is ``_PAD_SLOT_ID``). Inside the prompt graph ``_set_attn_bias`` masks
all of that row's keys (``arange(seq_len) >= 0``); ``prompt_attention``'s softmax gives NaN; the dummy row's hidden
state is NaN after layer 0, and layer 1 writes NaN K/V into block 0. Decode graphs pad ``block_list`` to the block
bucket with ``_PAD_SLOT_ID`` (block 0), ``block_mapping`` with 0 and ``block_usage`` with 0 (bias -inf on every slot);
``flat_pa`` reads block 0, the NaN key gives a NaN score, ``attn.amax(...).amax()`` is NaN, and ``attn.sub_``
spreads it to every block of every request. The run without bucket padding has no dummy rows and never reads block
0. My reading, not stated upstream: a decode step that is itself padded with dummy decode rows hides it, because the
first dummy decode row writes finite K/V to slot 0 (``dummy_slots`` starts there) before the layer's ``flat_pa``
reads it; the decode batch here fills its bucket exactly.
Doctor: stale-padding, at create_dummy_seq_group_metadata: the real requests' decode rows depend on what the padded
rows of an earlier step held (a length-0 dummy sequence and, through it, NaN in the padding block), and this is the
function the fix changes; the NaN shows later, in ``flat_pa``/``block_softmax`` of the decode graph.
Fix (upstream): ``seq_len = max(seq_len, 1)`` in ``create_dummy_seq_group_metadata`` (after ``num_blocks``, so a dummy
decode sequence still has an empty block table).
Modelled: ``HabanaModelRunner`` (``create_dummy_seq_group_metadata``, ``_prepare_prompt``, ``_prepare_decode``,
``prepare_input_tensors``, ``_seq_len``, ``warmup_scenario``, ``warmup_model``, ``execute_model``),
``HpuModelAdapter`` (``_set_attn_bias``, ``_set_block_mapping``, ``forward``), ``HabanaAttentionImpl.forward``,
``warmup_range``/``next_pow2``/``find_bucket``/``pad_list``, and the extension's ``batch2block``, ``block2batch``,
``block_softmax``, ``flat_pa``, ``prompt_attention``, ``prepare_to_cache``, ``insert_or_update_cache``, as read.
Stand-ins: a 2-layer Llama (RMSNorm, fused qkv, learned positions instead of RoPE, gated MLP) of width 8, two heads;
linear layers as broadcast multiply-sums (so the padded and unpadded steps give real rows the same bits);
``F.one_hot`` as a comparison; ``wrap_in_hpu_graph`` as one captured graph per bucket (two warmups, capture, copy-in,
replay) for the buckets (prompt bs 4 x 8, prompt bs 1 x 8, decode bs 4 x 16 blocks); the bucket configs are
upstream's defaults for max_num_seqs 4 with the sequence and block ranges scaled down (block step 8 for 128); a list
of free blocks from 1 on for the block manager; decode tokens fixed in advance (no sampler), logits of the last real
token outside the graph; float64 for bfloat16. The reference is the same runner without graphs and without bucket
padding (upstream's lazy mode pads to buckets even with ``enforce_eager``, for its compiled recipes).
Workload: block size 4, 16 blocks. A, B and C prefill 8 tokens each (padded with one dummy prompt to bs 4), D arrives
one step later and prefills alone (bs 1, no dummy), then three decode steps of A-D (bs 4, 12 blocks padded to 16).
Outputs: the last-token logits of every step.
Measured (WORKBENCH_FAST=1, CPU): bug: "misbehaves (max |graph - eager| = inf)": both prefills equal eager, every
request's logits are NaN in all three decode steps (layer 1's block 0 holds a NaN key at offset 0); fix: "equals eager
(max |graph - eager| = 0)".
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HabanaAI/vllm-fork/pull/318"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "create_dummy_seq_group_metadata"
SYMPTOM = ("a prompt batch padded to its HPU-graph bucket gets dummy sequences of length 0 whose fully masked "
           "attention rows turn NaN and write NaN K/V into the padding block; later decode graphs read that block "
           "through their padded block list and every request's logits become NaN")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS, MAX_POS = 32, 8, 2, 4, 16, 2, 16
BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_NUM_SEQS = 4, 16, 4
DTYPE = torch.float64

# vllm/worker/habana_model_runner.py
_PAD_SLOT_ID = 0
_PAD_BLOCK_ID = 0

_variant = "bug"


# --- vllm_hpu_extension/ops.py at 30ee2d1 (the extension this vllm-fork revision pins) -------------------------------

def batch2block(tensor, block_mapping):
    shape = tuple(tensor.shape)
    return (block_mapping @ tensor.view(shape[0], -1)).view(-1, *shape[1:])


def block2batch(tensor, block_mapping):
    shape = tuple(tensor.shape)
    return (block_mapping.t() @ tensor.view(shape[0], -1)).view(-1, *shape[1:])


def block_softmax(batch_size, attn, block_mapping):
    # upstream: "We're using global maximum to decrease the exponent"
    tail_dims = tuple(range(1, attn.dim()))
    attn_max = attn.amax(tail_dims).amax()
    attn.sub_(attn_max)
    attn = attn.exp_()
    sums = attn.sum(dim=-1).unsqueeze(-1)
    sums = block2batch(sums, block_mapping)
    sums = batch2block(sums, block_mapping)
    sums.add_(1.0e-12)
    attn.div_(sums)
    return attn


def flat_pa(query, key_cache, value_cache, block_list, block_mapping, block_bias, scale):
    query = batch2block(scale * query, block_mapping).unsqueeze(-2)           # [blocks, heads, 1, head_dim]
    key = key_cache.index_select(0, block_list).transpose(1, 2)              # VLLMKVCache.fetch_from_cache
    value = value_cache.index_select(0, block_list).transpose(1, 2)          # [blocks, heads, block_size, head_dim]
    block_bias = block_bias.view(key.size(0), 1, 1, -1)
    key = key.transpose(2, 3)
    attn = torch.matmul(query, key) + block_bias
    attn = block_softmax(query.size(0), attn, block_mapping)
    attn = torch.matmul(attn, value)
    attn = block2batch(attn, block_mapping)
    return attn.squeeze(-2)


def prompt_attention(query, key, value, attn_bias, scale):
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    attn_weights = torch.matmul(query * scale, key.transpose(-1, -2))
    attn_weights.add_(attn_bias)
    attn_weights = torch.softmax(attn_weights, dim=-1)
    attn_weights = torch.matmul(attn_weights, value)
    return attn_weights.transpose(1, 2)


def prepare_to_cache(cache, slot_mapping):                                    # cache_ops.prepare_to_cache
    num_blocks, block_size = cache.size(0), cache.size(1)
    slot_mapping = slot_mapping.flatten()
    indices = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = torch.fmod(slot_mapping, block_size)
    num_slots_available = num_blocks * block_size
    num_kv_cache_passes = math.ceil(slot_mapping.size(0) / num_slots_available)
    return num_kv_cache_passes, num_slots_available, indices, offsets


def insert_or_update_cache(input, cache, num_kv_cache_passes, num_slots_available, block_indices, block_offsets):
    for i in range(num_kv_cache_passes):
        start_idx, end_idx = i * num_slots_available, (i + 1) * num_slots_available
        cache.index_put_((block_indices[start_idx:end_idx], block_offsets[start_idx:end_idx]),
                         input[start_idx:end_idx])


# --- the model: a small Llama (vllm/attention/backends/habana_attn.py for the attention) -----------------------------

def linear(x, weight):
    """``F.linear`` written as a broadcast multiply-sum: a row's result does not depend on how many rows the step
    has, so a step padded to its bucket and the unpadded step give the real rows the same bits."""
    return (x.unsqueeze(-2) * weight).sum(-1)


def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class HabanaAttentionImpl:
    def __init__(self, gen, device):
        self.qkv = randn(3 * N_HEADS * HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.o_proj = randn(HIDDEN, N_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.scale = HEAD_DIM ** -0.5

    def forward(self, h, kv_cache, attn_metadata):
        batch_size, seq_len, hidden_size = h.shape
        query, key, value = linear(h, self.qkv).split(N_HEADS * HEAD_DIM, dim=-1)
        query = query.reshape(-1, N_HEADS, HEAD_DIM)
        key = key.reshape(-1, N_HEADS, HEAD_DIM)
        value = value.reshape(-1, N_HEADS, HEAD_DIM)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # Reshape the input keys and values and store them in the cache (padding tokens go to _PAD_SLOT_ID).
        passes, available, indices, offsets = prepare_to_cache(key_cache, attn_metadata["slot_mapping"])
        insert_or_update_cache(key, key_cache, passes, available, indices, offsets)
        insert_or_update_cache(value, value_cache, passes, available, indices, offsets)
        if attn_metadata["is_prompt"]:
            shape = (batch_size, seq_len, N_HEADS, HEAD_DIM)
            out = prompt_attention(query.view(shape), key.view(shape), value.view(shape),
                                   attn_metadata["attn_bias"], self.scale)
        else:
            out = flat_pa(query, key_cache, value_cache, attn_metadata["block_list"], attn_metadata["block_mapping"],
                          attn_metadata["attn_bias"], self.scale)
        return linear(out.reshape(batch_size, seq_len, -1), self.o_proj)


class LlamaDecoderLayer:
    def __init__(self, gen, device):
        self.self_attn = HabanaAttentionImpl(gen, device)
        self.gate_up = randn(2 * INTER, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.down = randn(HIDDEN, INTER, gen=gen, device=device, scale=0.4).to(DTYPE)
        self.input_layernorm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.post_attention_layernorm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)

    def forward(self, h, kv_cache, attn_metadata):
        h = h + self.self_attn.forward(rms_norm(h, self.input_layernorm), kv_cache, attn_metadata)
        gate, up = linear(rms_norm(h, self.post_attention_layernorm), self.gate_up).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, self.down)


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(318)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_positions = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [LlamaDecoderLayer(gen, device) for _ in range(N_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.lm_head = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer.forward(h, kv_cache, attn_metadata)
        return rms_norm(h, self.norm)

    def compute_logits(self, hidden_states):
        return linear(hidden_states, self.lm_head)


class HpuModelAdapter:
    """What ``wrap_in_hpu_graph`` wraps: the attention bias and the block mapping are built inside the graph."""

    def __init__(self, model):
        self.model = model

    def _set_attn_bias(self, attn_metadata, batch_size, seq_len, device):
        seq_lens_t = attn_metadata["seq_lens_tensor"]
        len_mask = (torch.arange(0, seq_len, device=device, dtype=torch.int32).view(1, seq_len)
                    .ge(seq_lens_t.unsqueeze(-1)).view(batch_size, 1, 1, seq_len))
        causal_mask = torch.triu(torch.ones((batch_size, 1, seq_len, seq_len), device=device, dtype=torch.bool),
                                 diagonal=1)
        mask = causal_mask.logical_or(len_mask)
        attn_bias = torch.zeros_like(mask, dtype=DTYPE).masked_fill_(mask, -math.inf)
        return dict(attn_metadata, attn_bias=attn_bias)

    def _set_block_mapping(self, attn_metadata, batch_size, device):
        mask = torch.arange(0, BLOCK_SIZE, device=device, dtype=torch.int32).unsqueeze(0)
        mask = mask >= attn_metadata["block_usage"].unsqueeze(-1)
        attn_bias = torch.zeros_like(mask, dtype=DTYPE).masked_fill_(mask, -math.inf)
        # F.one_hot(block_mapping, num_classes=batch_size), as a comparison (one_hot checks its range on the host)
        block_mapping = (attn_metadata["block_mapping"].unsqueeze(-1)
                         == torch.arange(batch_size, device=device)).to(DTYPE)
        return dict(attn_metadata, block_mapping=block_mapping, attn_bias=attn_bias)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        batch_size, seq_len = input_ids.shape
        if attn_metadata["is_prompt"]:
            attn_metadata = self._set_attn_bias(attn_metadata, batch_size, seq_len, input_ids.device)
        else:
            attn_metadata = self._set_block_mapping(attn_metadata, batch_size, input_ids.device)
        return self.model.forward(input_ids, positions, kv_caches, attn_metadata)


# --- vllm/worker/habana_model_runner.py (reduced) -------------------------------------------------------------------

@dataclasses.dataclass
class SequenceGroupMetadata:                            # one sequence per group
    request_id: str
    is_prompt: bool
    token_ids: list
    block_table: list | None


def warmup_range(config):
    bmin, bstep, bmax = config
    ramp_up_acc = itertools.accumulate(itertools.repeat(2), func=operator.mul, initial=bmin)
    ramp_up_tw = itertools.takewhile(lambda x: x < bstep and x <= bmax, ramp_up_acc)
    return list(ramp_up_tw) + list(range(bstep, bmax + 1, bstep))


def next_pow2(value, base):
    res = base
    while value > 1:
        value = (value + 1) // 2
        res *= 2
    return res


def round_up(value, k):
    return (value + k - 1) // k * k


def find_bucket(value, config):
    bmin, bstep, _ = config
    return max(bmin, min(round_up(value, bstep), next_pow2(value, bmin)))


def pad_list(lst, k, v):
    return lst + [v] * (round_up(len(lst), k) - len(lst))


def make_tensor_with_pad(rows, max_len, pad, dtype, device):
    return torch.tensor([row + [pad] * (max_len - len(row)) for row in rows], dtype=dtype, device=device)


class HabanaModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device, self.enforce_eager = device, enforce_eager
        self.block_size = BLOCK_SIZE
        self.model = HpuModelAdapter(LlamaForCausalLM(device))
        self.kv_caches = [torch.zeros(2, NUM_GPU_BLOCKS, BLOCK_SIZE, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                          for _ in range(N_LAYERS)]
        # _setup_buckets with max_num_seqs = 4 (upstream min/step/max defaults scaled to this toy's sizes)
        self.prompt_bs_bucket_cfg = (1, min(MAX_NUM_SEQS, 32), min(MAX_NUM_SEQS, 64))
        self.decode_bs_bucket_cfg = (min(MAX_NUM_SEQS, 32), min(MAX_NUM_SEQS, 32), MAX_NUM_SEQS)
        self.prompt_seq_bucket_cfg = (BLOCK_SIZE, BLOCK_SIZE, 8)
        self.decode_block_bucket_cfg = (8, 8, 16)               # blocks_step 8 here for upstream's 128
        self.graphed_buckets = {}
        if not enforce_eager:
            self.warmup_model()

    # -- dummy sequences: batch padding and warmup --

    def create_dummy_seq_group_metadata(self, group_id, seq_len, is_prompt):
        num_blocks = math.ceil(seq_len / self.block_size)
        if _variant == "fix":
            seq_len = max(seq_len, 1)
        if is_prompt:
            input_len, output_len, block_tables = seq_len, 0, None
        else:
            input_len, output_len, block_tables = seq_len - 1, 1, [_PAD_BLOCK_ID] * num_blocks
        token_ids = [0] * max(input_len, 0) + [1] * output_len
        return SequenceGroupMetadata(str(group_id), output_len == 0, token_ids, block_tables)

    # -- input preparation --

    def _prepare_prompt(self, seqs):
        input_tokens, input_positions, slot_mapping, seq_lens = [], [], [], []
        for seq in seqs:
            seq_len = len(seq.token_ids)
            seq_lens.append(seq_len)
            input_tokens.append(list(seq.token_ids))
            input_positions.append(list(range(seq_len)))
            if seq.block_table is None:
                # "During memory profiling, the block tables are not initialized yet. In this case, we just use a
                # dummy slot mapping." (also every dummy prompt of the batch padding)
                slot_mapping.append([_PAD_SLOT_ID] * seq_len)
                continue
            slot_mapping.append([seq.block_table[i // self.block_size] * self.block_size + i % self.block_size
                                 for i in range(seq_len)])
        max_prompt_len = max(seq_lens)
        if not self.enforce_eager:
            max_prompt_len = max(find_bucket(max_prompt_len, self.prompt_seq_bucket_cfg), self.block_size)
        return dict(
            input_ids=make_tensor_with_pad(input_tokens, max_prompt_len, 0, torch.long, self.device),
            positions=make_tensor_with_pad(input_positions, max_prompt_len, 0, torch.long, self.device),
            slot_mapping=make_tensor_with_pad(slot_mapping, max_prompt_len, _PAD_SLOT_ID, torch.long, self.device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=self.device))

    def _prepare_decode(self, seqs):
        input_tokens, input_positions, slot_mapping, block_tables = [], [], [], []
        dummy_slots = itertools.cycle(range(_PAD_SLOT_ID, _PAD_SLOT_ID + self.block_size))
        for seq in seqs:
            input_tokens.append([seq.token_ids[-1]])
            position = len(seq.token_ids) - 1
            input_positions.append([position])
            block_table = seq.block_table
            block_number = _PAD_BLOCK_ID if len(block_table) == 0 else block_table[position // self.block_size]
            if block_number == _PAD_BLOCK_ID:
                slot = next(dummy_slots)
            else:
                slot = block_number * self.block_size + position % self.block_size
            slot_mapping.append([slot])
            block_tables.append(block_table)
        blocks_used = [len(bt) for bt in block_tables if bt]
        block_list = list(itertools.chain(*block_tables))
        block_mapping = list(itertools.chain.from_iterable([i] * b_u for i, b_u in enumerate(blocks_used)))
        last_block = [sl % self.block_size + 1 for sl in itertools.chain(*slot_mapping)]
        block_usage = list(itertools.chain(*[[self.block_size] * (b_u - 1) + [lb]
                                              for b_u, lb in zip(blocks_used, last_block)]))
        if not self.enforce_eager:                           # the flattened block list goes to its block bucket
            block_bucket_size = find_bucket(len(block_list), self.decode_block_bucket_cfg)
            block_list = pad_list(block_list, block_bucket_size, _PAD_SLOT_ID)
            block_mapping = pad_list(block_mapping, block_bucket_size, 0)
            block_usage = pad_list(block_usage, block_bucket_size, 0)
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)   # noqa: E731
        return dict(input_ids=t(input_tokens, torch.long), positions=t(input_positions, torch.long),
                    slot_mapping=t(slot_mapping, torch.long), block_list=t(block_list, torch.long),
                    block_mapping=t(block_mapping, torch.long), block_usage=t(block_usage, DTYPE))

    def prepare_input_tensors(self, seqs):
        is_prompt = seqs[0].is_prompt
        seqs = list(seqs)
        if not self.enforce_eager:                           # pad the batch to its bucket with dummy sequences
            bucket_cfg = self.prompt_bs_bucket_cfg if is_prompt else self.decode_bs_bucket_cfg
            batch_size_padding = find_bucket(len(seqs), bucket_cfg) - len(seqs)
            seqs += [self.create_dummy_seq_group_metadata(0, 0, is_prompt) for _ in range(batch_size_padding)]
        return (self._prepare_prompt if is_prompt else self._prepare_decode)(seqs), is_prompt

    def _seq_len(self, inputs, is_prompt):
        return inputs["slot_mapping"].size(1) if is_prompt else inputs["block_list"].numel()

    # -- the model step --

    def _forward(self, inputs, is_prompt):
        attn_metadata = {k: v for k, v in inputs.items() if k not in ("input_ids", "positions")}
        attn_metadata["is_prompt"] = is_prompt
        return self.model.forward(inputs["input_ids"], inputs["positions"], self.kv_caches, attn_metadata)

    def warmup_scenario(self, batch_size, seq_len, is_prompt):
        if is_prompt:
            seqs = [self.create_dummy_seq_group_metadata(i, seq_len, True) for i in range(batch_size)]
        else:                                                # "FIXME: seq_len is actually number of blocks"
            blocks = [seq_len // batch_size for _ in range(batch_size)]
            blocks[0] += seq_len % batch_size
            seqs = [self.create_dummy_seq_group_metadata(i, b * self.block_size - 1, False)
                    for i, b in enumerate(blocks)]
        static, _ = self.prepare_input_tensors(seqs)
        # wrap_in_hpu_graph: the first runs of a new input shape record the graph; later calls replay it
        state = {f"kv_caches[{i}]": c for i, c in enumerate(self.kv_caches)}
        g, out = capture(lambda: self._forward(static, is_prompt), device=self.device, warmups=2, static=static,
                         state=state, owner="HabanaModelRunner",
                         name=f"hpu graph {'prompt' if is_prompt else 'decode'} bs{batch_size} seq{seq_len}")
        self.graphed_buckets[(batch_size, seq_len, is_prompt)] = (g, static, out)

    def warmup_model(self):
        for batch_size, seq_len in ((4, 8), (1, 8)):
            self.warmup_scenario(batch_size, seq_len, True)
        self.warmup_scenario(4, 16, False)

    def execute_model(self, seqs):
        real_batch_size = len(seqs)
        inputs, is_prompt = self.prepare_input_tensors(seqs)
        key = (inputs["input_ids"].size(0), self._seq_len(inputs, is_prompt), is_prompt)
        if not self.enforce_eager and key in self.graphed_buckets:       # _use_graphs
            g, static, out = self.graphed_buckets[key]
            for name, t in inputs.items():                   # the graph wrapper copies the step's inputs in
                static[name].copy_(t)
            hidden_states = replay(g, out, real=real_batch_size, size=key[0])
        else:
            hidden_states = self._forward(inputs, is_prompt)
        if is_prompt:                                        # sampling_metadata.selected_token_indices
            last = torch.tensor([len(s.token_ids) - 1 for s in seqs], device=self.device)
            hidden_states = hidden_states[torch.arange(real_batch_size, device=self.device), last]
        else:
            hidden_states = hidden_states[:real_batch_size, -1]
        return self.model.model.compute_logits(hidden_states)


class BlockAllocator:
    """Stand-in for the block manager after #313: block 0 is kept for padding, requests get blocks from 1 on."""

    def __init__(self):
        self.free = list(range(1, NUM_GPU_BLOCKS))

    def ensure_slots(self, seq):
        while len(seq.block_table) * BLOCK_SIZE < len(seq.token_ids):
            seq.block_table.append(self.free.pop(0))


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(3180)
    prompts = {name: torch.randint(2, VOCAB, (8,), generator=gen).tolist() for name in "ABCD"}
    decode_tokens = torch.randint(2, VOCAB, (3, 4), generator=gen).tolist()

    def serve(enforce_eager: bool):
        runner = HabanaModelRunner(device, enforce_eager)
        allocator = BlockAllocator()
        seqs = {name: SequenceGroupMetadata(name, True, list(tokens), []) for name, tokens in prompts.items()}
        for seq in seqs.values():
            allocator.ensure_slots(seq)
        outs = [runner.execute_model([seqs[n] for n in "ABC"]),      # three prompts: padded to bs 4
                runner.execute_model([seqs["D"]])]                   # D arrives a step later: bs 1
        running = [seqs[n] for n in "ABCD"]
        for step_tokens in decode_tokens:                            # decode batches fill bucket bs 4
            for seq, token in zip(running, step_tokens):
                seq.is_prompt = False
                seq.token_ids.append(token)
                allocator.ensure_slots(seq)
            outs.append(runner.execute_model(running))
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
